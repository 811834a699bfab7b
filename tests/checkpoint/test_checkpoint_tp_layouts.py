"""Checkpoints of tensor-parallel layouts: DimShard over tp, PackedDimShard (fused qkv with
uneven parts) and Nested (ZeRO's FlatShard over dp of a tp shard), saved on a dp=2 x tp=2
mesh, load bitwise into the same layout, tp=4, dp=4 (FlatShard only) and a single
replicated process; padding in loaded pieces is zero; export consolidates them; a corrupt
"layout" slice is a clear CheckpointError."""
import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from dsfn import checkpoint as ck
from dsfn import tree
from dsfn.runtime import current_mesh, init_mesh
from dsfn.state.layout import (
    DimShard,
    FlatShard,
    MeshCoords,
    Nested,
    PackedDimShard,
    Placed,
    Replicated,
    gather_tree,
    is_placed,
    place,
)
from dsfn.testing import run_on_ranks

STEP = 3
# name: (shape, dtype, tensor-parallel layout kind); every size is uneven somewhere
LEAVES = {
    "w_col": ((7, 5), torch.float32, ("dim", 0)),
    "w_row": ((4, 7), torch.float32, ("dim", 1)),
    "qkv": ((10, 3), torch.bfloat16, ("packed", 0, (6, 2, 2))),
    "gate_up": ((3, 9), torch.float32, ("packed", 1, (5, 3, 1))),
    "z_col": ((7, 5), torch.float32, ("nested_dim", 0)),
    "z_row": ((3, 7), torch.float64, ("nested_dim", 1)),
    "z_qkv": ((10, 3), torch.float32, ("nested_packed", 0, (6, 2, 2))),
    "z_bias": ((5,), torch.float32, ("nested_dim", 0)),
    "norm": ((3,), torch.float32, ("rep",)),
    "flat": ((11,), torch.float32, ("flat",)),
}


def _logical():
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, (shape, dtype, _) in LEAVES.items():
        t = torch.randn(shape, generator=g, dtype=torch.float64) + 3.0      # no zeros: padding stands out
        out[name] = t.to(dtype)
    return out


def _tp_layout(shape, spec, sizes):
    kind = spec[0]
    if kind == "rep":
        return Replicated(shape)
    if kind == "flat":
        return FlatShard("dp", shape)
    inner = DimShard("tp", spec[1], shape) if kind.endswith("dim") else PackedDimShard("tp", spec[1], shape, spec[2])
    if kind.startswith("nested"):
        return Nested(inner, FlatShard("dp", tuple(inner.local_shape(MeshCoords.of(sizes, {})))))
    return inner


def _layouts(target, sizes):
    """Layouts of every leaf: "tp" (the tensor-parallel family at mesh `sizes`), "flat"
    (ZeRO-only: FlatShard over dp) or "rep" (everything replicated)."""
    out = {}
    for name, (shape, _, spec) in LEAVES.items():
        if target == "tp":
            out[name] = _tp_layout(shape, spec, sizes)
        elif target == "flat":
            out[name] = FlatShard("dp", shape)
        else:
            out[name] = Replicated(shape)
    return out


def _state(target, sizes, zeros=False):
    logical = _logical()
    layouts = _layouts(target, sizes)
    params = {k: place(torch.zeros_like(v) if zeros else v, layouts[k]) for k, v in logical.items()}
    return {"params": params, "step": torch.tensor(0 if zeros else STEP)}


def _save(root):
    init_mesh(dp=2, tp=2)
    ck.save(root, _state("tp", {"dp": 2, "tp": 2}), step=STEP)


def _padding_ok(x, mesh):
    """The loaded piece equals shard(logical), and elements outside its runs are zero."""
    if not isinstance(x, Placed):
        return True
    pf = x.data.reshape(-1)
    used = torch.zeros(pf.numel(), dtype=torch.bool)
    for _, n, loc in x.layout.runs(mesh):
        used[loc:loc + n] = True
    return bool((pf[~used] == 0).all())


def _load(root, target, **axes):
    init_mesh(**axes)
    mesh = current_mesh()
    sizes = {"dp": mesh.size("dp"), "tp": mesh.size("tp")}
    like = _state(target, sizes, zeros=True)
    loaded = ck.load(root, like)
    assert tree.structure(loaded, is_leaf=is_placed) == tree.structure(like, is_leaf=is_placed)
    want = _logical()
    pieces = {k: bool(torch.equal(x.data, x.layout.shard(want[k], mesh))) if isinstance(x, Placed) else None
              for k, x in loaded["params"].items()}
    padding = {k: _padding_ok(x, mesh) for k, x in loaded["params"].items()}
    return gather_tree(loaded), pieces, padding


def _assert_logical(state, where):
    want = _logical()
    assert int(state["step"]) == STEP, where
    for k, v in want.items():
        got = state["params"][k]
        assert got.dtype == v.dtype and torch.equal(got, v), f"{where}: {k}"


@pytest.fixture(scope="module")
def tp_ckpt(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tp_ckpt"))
    run_on_ranks(_save, 4, root, timeout=120)
    return root


def test_manifest_keeps_old_kinds_and_describes_tp_layouts(tp_ckpt):
    m = ck.read_manifest(tp_ckpt)
    leaves = m.leaves
    kinds = {k.removeprefix("params."): {s["kind"] for s in d["slices"]} for k, d in leaves.items() if "slices" in d}
    assert kinds["w_col"] == {"dim"} and kinds["w_row"] == {"dim"}
    assert kinds["flat"] == {"flat"} and kinds["norm"] == {"full"} and kinds["step"] == {"full"}
    for k in ("qkv", "gate_up", "z_col", "z_row", "z_qkv", "z_bias"):
        assert kinds[k] == {"layout"}, k
    # tp-only leaves are written by the dp=0 ranks, ZeRO-over-tp leaves by every rank
    assert len(leaves["params.w_col"]["slices"]) == 2 and len(leaves["params.qkv"]["slices"]) == 2
    assert len(leaves["params.z_col"]["slices"]) == 4
    for s in leaves["params.z_qkv"]["slices"]:
        assert set(s) == {"file", "kind", "coords"} and set(s["coords"]) == {"dp", "sp", "tp", "pp"}
    assert leaves["params.z_qkv"]["layout"]["type"] == "Nested"
    assert leaves["params.qkv"]["layout"] == {"type": "PackedDimShard", "axis": "tp", "dim": 0, "shape": [10, 3],
                                              "parts": [6, 2, 2]}
    # stored "layout" slices hold only valid elements: the stored sizes add up to the logical size
    total = {}
    for f in m.files:
        fh = load_file(os.path.join(m.path, f))
        for k, t in fh.items():
            total[k] = total.get(k, 0) + t.numel()
    for k, (shape, _, _) in LEAVES.items():
        assert total["params." + k] == math.prod(shape), k
    assert ck.verify(tp_ckpt) == []


@pytest.mark.parametrize("target,world,axes", [
    ("tp", 4, {"dp": 2, "tp": 2}),
    ("tp", 4, {"dp": 1, "tp": 4}),
    ("flat", 4, {"dp": 4, "tp": 1}),
    ("tp", 2, {"dp": 1, "tp": 2}),
])
def test_tp_checkpoint_loads_into_other_layouts(tp_ckpt, target, world, axes):
    for rank, (state, pieces, padding) in enumerate(run_on_ranks(_load, world, tp_ckpt, target, timeout=120,
                                                                 **axes)):
        where = f"{target} {axes} rank {rank}"
        _assert_logical(state, where)
        assert all(v is not False for v in pieces.values()), (where, pieces)
        assert all(padding.values()), (where, padding)


def test_tp_checkpoint_loads_replicated_in_one_process(tp_ckpt):
    loaded = ck.load(tp_ckpt, _state("rep", {}, zeros=True), restore_rng=False)
    assert all(not isinstance(x, Placed) for x in loaded["params"].values())
    _assert_logical(loaded, "replicated")


def test_a_tp_checkpoint_saved_from_tp4_loads_back_into_dp2_tp2(tmp_path, tp_ckpt):
    """Round trip through another mesh: load at tp=4 and save there, then load at dp=2 x tp=2."""
    def resave(src, dst):
        init_mesh(dp=1, tp=4)
        like = _state("tp", {"dp": 1, "tp": 4}, zeros=True)
        ck.save(dst, ck.load(src, like), step=STEP)
    run_on_ranks(resave, 4, tp_ckpt, str(tmp_path), timeout=120)
    for state, pieces, padding in run_on_ranks(_load, 4, str(tmp_path), "tp", dp=2, tp=2, timeout=120):
        _assert_logical(state, "tp4 -> dp2 tp2")
        assert all(v is not False for v in pieces.values()) and all(padding.values())


def test_export_and_convert_consolidate_tp_layouts(tp_ckpt, tmp_path):
    want = _logical()
    hf = load_file(ck.export(tp_ckpt, tmp_path / "hf"))
    assert set(hf) == set(want)
    for k, v in want.items():
        assert hf[k].dtype == v.dtype and torch.equal(hf[k], v), k
    pt = torch.load(ck.export(tp_ckpt, tmp_path / "pt", format="torch"), weights_only=True)
    for k, v in want.items():
        assert torch.equal(pt[k], v), k
    conv = ck.convert(tp_ckpt, tmp_path / "conv")
    _assert_logical(ck.load(conv, _state("rep", {}, zeros=True)), "converted")


# -- corrupt manifests ------------------------------------------------------------------------------
def _corrupt_copy(src, dst, edit):
    step_dir = ck.resolve(src)
    out = os.path.join(dst, os.path.basename(step_dir))
    shutil.copytree(step_dir, out)
    mpath = os.path.join(out, "manifest.json")
    with open(mpath) as f:
        raw = json.load(f)
    edit(raw)
    with open(mpath, "w") as f:
        json.dump(raw, f)
    return out


def _layout_slice(raw, leaf="params.z_qkv", i=1):
    return raw["leaves"][leaf]["slices"][i]


@pytest.mark.parametrize("edit,match", [
    (lambda raw: _layout_slice(raw).pop("coords"), r"params\.z_qkv.*'layout' slice.*coords"),
    (lambda raw: _layout_slice(raw)["coords"].pop("tp"), r"params\.z_qkv.*no coordinate for mesh axis 'tp'"),
    (lambda raw: _layout_slice(raw)["coords"].update(tp=5), r"coordinate 5 is outside mesh axis 'tp' of size 2"),
    (lambda raw: _layout_slice(raw)["coords"].update(dp=1 - _layout_slice(raw)["coords"]["dp"]),
     r"params\.z_qkv.*but the manifest describes"),
    (lambda raw: raw["leaves"]["params.qkv"]["layout"]["parts"].__setitem__(0, 7), r"params\.qkv.*layout"),
    (lambda raw: raw["leaves"]["params.qkv"]["layout"].update(type="Mystery"), r"unknown layout type 'Mystery'"),
])
def test_corrupt_layout_slice_is_a_clear_error(tp_ckpt, tmp_path, edit, match):
    bad = _corrupt_copy(tp_ckpt, str(tmp_path), edit)
    with pytest.raises(ck.CheckpointError, match=match):
        ck.load(bad, _state("rep", {}, zeros=True), restore_rng=False)
    with pytest.raises(ck.CheckpointError, match=match):
        ck.export(bad, tmp_path / "out")


def test_stored_size_mismatch_is_a_clear_error(tp_ckpt, tmp_path):
    """A "layout" slice whose saving rank holds a different number of elements than stored:
    the qkv parts changed so that rank's runs no longer match the stored tensor."""
    def edit(raw):
        raw["leaves"]["params.qkv"]["layout"]["parts"] = [8, 1, 1]
    bad = _corrupt_copy(tp_ckpt, str(tmp_path), edit)
    with pytest.raises(ck.CheckpointError, match=r"tensor 'params\.qkv' is torch\.bfloat16 \(15,\) but the manifest "
                                                  r"describes a torch\.bfloat16 \((18|12),\) slice"):
        ck.load(bad, _state("rep", {}, zeros=True), restore_rng=False)
