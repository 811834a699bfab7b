"""`StageOwned(axis, owners, shape)`: pipeline parallelism's layout. The owners along `axis`
hold the whole tensor, every other rank a 0-element one; owners[0]'s copy is the canonical
one (`unshard` broadcasts it; the other owners are `duplicate`). Checked: validation, the
pieces / runs / duplicates of every rank, shard -> unshard on real ranks (alone and nested
with ZeRO's FlatShard in either order), the JSON description, a global norm reduced over
"pp" by hand (each element counted once), and checkpoints holding each element once that
load into any layout and back, bitwise. The negative controls break `duplicate` and show
the norm and the checkpoint catch it."""
import itertools
import json
import math
import os

import pytest
import torch

from dsfn import checkpoint as ck
from dsfn import tree
from dsfn.checkpoint.format import layout_from_json, layout_to_json, read_manifest
from dsfn.effects import activate
from dsfn.errors import CheckpointError, LayoutError, ShapeError
from dsfn.logical import global_norm
from dsfn.runtime import collectives as C
from dsfn.runtime import init_mesh
from dsfn.state.layout import (
    FlatShard,
    Layout,
    MeshCoords,
    Nested,
    Placed,
    Replicated,
    StageOwned,
    gather_tree,
    is_placed,
    place,
)
from dsfn.testing import run_on_ranks

OWNERS = {2: [(0,), (1,), (0, 1)], 3: [(0,), (1,), (2,), (0, 2), (0, 1, 2)]}


def _full(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 10).to(dtype)


# -- validation --------------------------------------------------------------------------------
@pytest.mark.parametrize("owners", [(), (1, 0), (0, 0), (-1,), (0.5,), [0], (True,)])
def test_bad_owners_are_named_errors(owners):
    with pytest.raises(LayoutError, match="StageOwned"):
        StageOwned("pp", owners, (3,))


def test_bad_shape_is_a_shape_error():
    with pytest.raises(ShapeError):
        StageOwned("pp", (0,), (3, -1))


def test_owner_outside_the_axis_is_an_error_once_the_mesh_is_known():
    layout = StageOwned("pp", (0, 2), (4,))            # fine on its own
    m = MeshCoords.of({"pp": 2}, {"pp": 0})
    for call in (layout.local_shape, layout.runs, layout.duplicate, layout.holds,
                 lambda m: layout.shard(torch.zeros(4), m)):
        with pytest.raises(LayoutError, match="outside mesh axis 'pp' of size 2"):
            call(m)


def test_shard_checks_the_shape():
    with pytest.raises(ShapeError):
        StageOwned("pp", (0,), (3,)).shard(torch.zeros(4), MeshCoords.of({"pp": 2}, {"pp": 0}))


# -- pieces, runs and duplicates of every rank (no communication) --------------------------------
@pytest.mark.parametrize("n,owners", [(n, o) for n, os_ in OWNERS.items() for o in os_])
@pytest.mark.parametrize("shape", [(5, 3), (7,), ()])
def test_pieces_runs_and_duplicates(n, owners, shape):
    layout = StageOwned("pp", owners, shape)
    full = _full(shape, torch.float64)
    numel = math.prod(shape)
    cover = torch.zeros(numel, dtype=torch.int64)
    for r in range(n):
        m = MeshCoords.of({"pp": n, "dp": 1}, {"pp": r})
        piece = layout.shard(full, m)
        assert tuple(piece.shape) == layout.local_shape(m)
        assert piece.dtype == full.dtype
        assert layout.axes() == ("pp",)
        if r in owners:
            assert torch.equal(piece, full) and piece.data_ptr() != full.data_ptr()   # a copy, not an alias
            assert layout.runs(m) == [(0, numel, 0)]
            assert layout.holds(m)
        else:
            assert tuple(piece.shape) == (0,) and layout.runs(m) == [] and not layout.holds(m)
        assert layout.duplicate(m) == (r in owners[1:])
        if not layout.duplicate(m):
            for s, k, _ in layout.runs(m):
                cover[s:s + k] += 1
    assert (cover == 1).all(), f"{layout}: non-duplicate pieces cover elements {cover.tolist()} times"


def _nested_layouts(shape, pp, dp, owners):
    """ZeRO's FlatShard over dp nested both ways with StageOwned over pp."""
    n = math.prod(shape)
    return [Nested(StageOwned("pp", owners, shape), FlatShard("dp", shape)),            # stage, then ZeRO
            Nested(FlatShard("dp", shape), StageOwned("pp", owners, (-(-n // dp),)))]    # ZeRO, then stage


@pytest.mark.parametrize("owners", [(0,), (1,), (0, 1)])
def test_nested_with_flatshard_covers_each_element_once(owners):
    shape = (5, 3)
    full = _full(shape, torch.float64)
    for layout in _nested_layouts(shape, 2, 2, owners):
        cover = torch.zeros(math.prod(shape), dtype=torch.int64)
        for pp, dp in itertools.product(range(2), range(2)):
            m = MeshCoords.of({"pp": 2, "dp": 2}, {"pp": pp, "dp": dp})
            piece = layout.shard(full, m)
            assert tuple(piece.shape) == tuple(layout.local_shape(m)), (layout, pp, dp)
            assert set(layout.axes()) == {"pp", "dp"}
            if pp not in owners:
                assert piece.numel() == 0 and layout.runs(m) == [] and not layout.holds(m)
            flat = piece.reshape(-1)
            for s, k, off in layout.runs(m):
                assert torch.equal(flat[off:off + k], full.reshape(-1)[s:s + k])
                if not layout.duplicate(m):
                    cover[s:s + k] += 1
        assert (cover == 1).all(), f"{layout}: {cover.tolist()}"


# -- shard -> unshard on real ranks --------------------------------------------------------------
def _round_trip(n):
    init_mesh(pp=n)
    out = []
    for owners in OWNERS[n]:
        for shape, dtype in (((5, 3), torch.float32), ((), torch.float64), ((4,), torch.int64),
                             ((2, 3), torch.bfloat16)):
            full = _full(shape, dtype, seed=len(out))
            layout = StageOwned("pp", owners, shape)
            x = place(full, layout)
            assert isinstance(x, Placed) and tuple(x.data.shape) == layout.local_shape()
            got = gather_tree({"w": x})["w"]
            out.append(bool(torch.equal(got, full) and got.dtype == dtype))
    # owners[0] is the canonical copy: a diverged second owner does not leak into the gather
    layout = StageOwned("pp", (0, n - 1), (4,))
    x = place(torch.arange(4.0), layout)
    if layout.duplicate():
        x = Placed(x.data + 100, layout)
    out.append(bool(torch.equal(gather_tree(x), torch.arange(4.0))))
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_shard_unshard_round_trip(n):
    for rank, res in enumerate(run_on_ranks(_round_trip, n, n, timeout=90)):
        assert all(res), (rank, res)


def _nested_round_trip():
    init_mesh(pp=2, dp=2)
    out = []
    for owners in ((0,), (1,), (0, 1)):
        for layout in _nested_layouts((5, 3), 2, 2, owners):
            full = _full((5, 3), seed=len(out))
            x = place(full, layout)
            out.append(tuple(x.data.shape) == tuple(layout.local_shape()) and bool(torch.equal(gather_tree(x), full)))
    return out


def test_nested_round_trip_at_pp2_dp2():
    for rank, res in enumerate(run_on_ranks(_nested_round_trip, 4, timeout=120)):
        assert all(res), (rank, res)


# -- JSON ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", [StageOwned("pp", (0,), (5, 3)), StageOwned("pp", (0, 3), ()),
                                    *_nested_layouts((5, 3), 2, 2, (0, 1))])
def test_json_round_trip(layout):
    d = json.loads(json.dumps(layout_to_json(layout)))
    assert layout_from_json(d) == layout


@pytest.mark.parametrize("bad", [{"type": "StageOwned", "axis": "pp", "owners": [], "shape": [3]},
                                 {"type": "StageOwned", "axis": "pp", "owners": [1, 0], "shape": [3]},
                                 {"type": "StageOwned", "axis": "pp", "owners": "0", "shape": [3]},
                                 {"type": "StageOwned", "axis": "pp", "shape": [3]}])
def test_bad_json_is_a_checkpoint_error(bad):
    with pytest.raises(CheckpointError, match="corrupt"):
        layout_from_json(bad)


# -- a global norm reduced over pp by hand -----------------------------------------------------------
class _HandReduce:
    """Stands in for a pipeline transform's answer to `reduce_leaves`: sums the partials of
    the leaves split over each of `axes` over it."""

    def __init__(self, axes):
        self.axes = axes

    def handle_reduce_leaves(self, call_next, partials, pending, op):
        partials, pending = list(partials), list(pending)
        for axis in self.axes:
            idx = [k for k, a in enumerate(pending) if axis in a]
            if idx:
                vec = torch.stack([partials[k].double().reshape(()) for k in idx])
                C.all_reduce_(vec, axis, op)
                for j, k in enumerate(idx):
                    partials[k] = vec[j].to(partials[k].dtype)
                    pending[k] = tuple(a for a in pending[k] if a != axis)
        return call_next(partials, pending, op)


SHAPES = {"emb": (6, 4), "w0": (4, 4), "w1": (4, 3), "head_b": (3,)}


def _stage_layouts(n, nested=False):
    owners = {"emb": (0, n - 1), "w0": (0,), "w1": (n - 1,), "head_b": (n - 1,)}   # emb: tied
    out = {k: StageOwned("pp", owners[k], s) for k, s in SHAPES.items()}
    if nested:
        out = {k: Nested(l, FlatShard("dp", l.shape)) for k, l in out.items()}
    return out


def _logical():
    return {k: _full(s, seed=i) for i, (k, s) in enumerate(SHAPES.items())}


def _norm(n, break_duplicate, nested=False):
    if break_duplicate:
        StageOwned.duplicate = lambda self, mesh=None: False      # a child process: nothing leaks
    init_mesh(pp=n, dp=2) if nested else init_mesh(pp=n)
    state = tree.map(lambda x, l: place(x, l), _logical(), _stage_layouts(n, nested),
                     is_leaf=lambda x: isinstance(x, (torch.Tensor, Layout)))
    with activate([_HandReduce(("pp", "dp") if nested else ("pp",))]):
        return float(global_norm(state))


@pytest.mark.parametrize("n", [2, 3])
def test_global_norm_counts_each_element_once(n):
    want = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x.double())
                                                       for x in _logical().values()])))
    got = run_on_ranks(_norm, n, n, False, timeout=90)
    assert all(g == pytest.approx(want, rel=1e-6) for g in got), (got, want)
    # negative control: the second owner of the tied embedding no longer a duplicate -> counted twice
    bad = run_on_ranks(_norm, n, n, True, timeout=90)
    assert all(b > want * (1 + 1e-3) for b in bad), (bad, want)


def test_global_norm_nested_at_pp2_dp2():
    want = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x.double())
                                                       for x in _logical().values()])))
    got = run_on_ranks(_norm, 4, 2, False, True, timeout=120)
    assert all(g == pytest.approx(want, rel=1e-6) for g in got), (got, want)


# -- checkpoints -----------------------------------------------------------------------------------
def _placed(layouts, values=None):
    return tree.map(lambda x, l: place(x if values is None else torch.zeros_like(x), l), _logical(), layouts,
                    is_leaf=lambda x: isinstance(x, (torch.Tensor, Layout)))


def _save_staged(root, n, break_duplicate=False, nested=False):
    if break_duplicate:
        StageOwned.duplicate = lambda self, mesh=None: False
    init_mesh(pp=n, dp=2) if nested else init_mesh(pp=n)
    ck.save(root, _placed(_stage_layouts(n, nested)), step=1)


def _save_replicated(root):
    init_mesh()
    ck.save(root, _logical(), step=1)


def _load_into(root, kind, n):
    if kind == "replicated":
        init_mesh()
        like = _placed({k: Replicated(s) for k, s in SHAPES.items()}, values=0)
    else:
        init_mesh(pp=n)
        like = _placed(_stage_layouts(n), values=0)
    loaded = ck.load(root, like)
    assert tree.structure(loaded, is_leaf=is_placed) == tree.structure(like, is_leaf=is_placed)
    pieces = {k: (x.data if isinstance(x, Placed) else x) for k, x in loaded.items()}
    return pieces, gather_tree(loaded)


def _check_once(root, n, owners_file_rank):
    """Every StageOwned leaf has one slice, written by owners[0] (its rank), holding every element."""
    m = read_manifest(root)
    layouts = _stage_layouts(n)
    for k, s in SHAPES.items():
        slices = m.leaves[k]["slices"]
        assert len(slices) == 1, (k, slices)
        assert slices[0]["file"] == f"rank_{owners_file_rank(layouts[k]):05d}.safetensors", (k, slices)
        assert m.leaves[k]["layout"]["type"] in ("StageOwned", "Nested")
    stored = sum(os.path.getsize(os.path.join(m.path, f)) for f in m.files)
    assert stored >= 4 * sum(math.prod(s) for s in SHAPES.values())


@pytest.mark.parametrize("n", [2, 3])
def test_checkpoint_holds_each_element_once_and_reloads_anywhere(tmp_path, n):
    root = str(tmp_path / "staged")
    run_on_ranks(_save_staged, n, root, n, timeout=90)
    _check_once(root, n, lambda l: l.owners[0])
    want = _logical()
    # saved at pp=n with StageOwned -> replicated at world 1
    [(pieces, whole)] = run_on_ranks(_load_into, 1, root, "replicated", 1, timeout=60)
    for k in SHAPES:
        assert torch.equal(whole[k], want[k]), k
    # -> StageOwned at pp=2 and pp=3 (other owners): owners hold the tensor, the others nothing
    for m in (2, 3):
        layouts = _stage_layouts(m)
        for r, (pieces, whole) in enumerate(run_on_ranks(_load_into, m, root, "staged", m, timeout=90)):
            for k in SHAPES:
                assert torch.equal(whole[k], want[k]), (m, r, k)
                if r in layouts[k].owners:
                    assert torch.equal(pieces[k], want[k]), (m, r, k)
                else:
                    assert tuple(pieces[k].shape) == (0,), (m, r, k)
    # the reverse: saved replicated at world 1 -> StageOwned at pp=n
    root1 = str(tmp_path / "replicated")
    run_on_ranks(_save_replicated, 1, root1, timeout=60)
    for r, (pieces, whole) in enumerate(run_on_ranks(_load_into, n, root1, "staged", n, timeout=90)):
        for k in SHAPES:
            assert torch.equal(whole[k], want[k]), (r, k)


def test_nested_checkpoint_at_pp2_dp2_loads_replicated(tmp_path):
    root = str(tmp_path / "nested")
    run_on_ranks(_save_staged, 4, root, 2, False, True, timeout=120)
    # pp is the outer mesh axis: rank = pp * 2 + dp; owners[0]'s dp=0 rank writes the first half,
    # its dp=1 rank the second: two slices per leaf, disjoint, on the owners[0] stage only
    m = read_manifest(root)
    for k, layout in _stage_layouts(2).items():
        files = sorted(s["file"] for s in m.leaves[k]["slices"])
        o = layout.owners[0]
        assert files == [f"rank_{o * 2:05d}.safetensors", f"rank_{o * 2 + 1:05d}.safetensors"], (k, files)
    [(_, whole)] = run_on_ranks(_load_into, 1, root, "replicated", 1, timeout=60)
    for k, v in _logical().items():
        assert torch.equal(whole[k], v), k


def _load_error(root):
    init_mesh()
    try:
        ck.load(root, _placed({k: Replicated(s) for k, s in SHAPES.items()}, values=0))
    except CheckpointError as e:
        return str(e)
    return None


def test_negative_control_second_owner_not_a_duplicate_writes_two_copies(tmp_path):
    root = str(tmp_path / "broken")
    run_on_ranks(_save_staged, 2, root, 2, True, timeout=90)
    assert len(read_manifest(root).leaves["emb"]["slices"]) == 2     # the tied embedding is on disk twice
    with pytest.raises(AssertionError):
        _check_once(root, 2, lambda l: l.owners[0])                  # the check above catches it
    [err] = run_on_ranks(_load_error, 1, root, timeout=60)
    assert err is not None and "cover" in err, err                 # and so does the reader
