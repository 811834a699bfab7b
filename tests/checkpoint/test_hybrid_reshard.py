"""Hybrid ZeRO checkpoints (`shard_zero(3, shard_group="node")`): one copy on disk, any layout back.

A hybrid state is `FlatShard("dp_shard", ...)` leaves: sharded over the k ranks of a node
and replicated across nodes ("dp_replicate"). The checkpoint must hold each element once
(the first copy, `Mesh.first_copy`) and load into any layout: flat ZeRO-3 at world 2 and 4,
hybrid 2 nodes x 4 ranks (world 8); and a flat checkpoint must load into hybrid layouts.

Sources (world 4, 2 ranks per node): hybrid ZeRO-3 saved synchronously (`ck.save`) and
through `async_checkpoint` (the background engine), and flat ZeRO-3 at world 4. After
SAVE_AT steps each source saves, then trains CONTINUE more steps uninterrupted. Every
target loads the checkpoint into a freshly placed template (`step.init_state`: placing a
hybrid ZeRO makes the "dp_shard" split the load's regions need), checks the gathered
state is bitwise the saved one, continues training, and matches the uninterrupted run:
bitwise where the layout is the source's own (same world, same sharding), else at fp32
rtol 1e-6 (another world splits the batch, another sharding reduces in another order; Adam's
first moment also gets atol 1e-8: see tests/checkpoint/test_checkpoint_reshard.py's MU_ATOL).
"""
import os

import torch

import dsfn
from dsfn import checkpoint as ck
from dsfn import tree
from dsfn.runtime.sfio import File
from dsfn.runtime import init_mesh
from dsfn.state.layout import Placed, is_placed
from dsfn.testing import assert_trees_close, run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import mse_loss_fp32, train_step_for
from dsfn.transforms import async_checkpoint, shard_zero

SIZES = [5, 7, 3]                   # parameter counts 35, 7, 21, 3: FlatShard pads at 2 and 4 ranks
SAVE_AT, CONTINUE = 3, 2
BATCHES = regression_batches(SAVE_AT + CONTINUE, 8, 5, 3, seed=1)
RTOL, MU_ATOL = 1e-6, 1e-8
TIMEOUT = 240                       # 8 ranks on 2 shared cores: generous


def _make(group=None, extra=()):
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    zero = shard_zero(3) if group is None else shard_zero(3, shard_group=group)
    step = dsfn.compose(zero, *extra)(train_step_for(apply_fn, mse_loss_fp32))
    return step, params, dsfn.optim.adamw(lr=1e-2, weight_decay=0.1)


def _run(step, state, batches):
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


def _logical(step, state):
    return step.gather(state).replace(tx=None)


def _leaf_axes(state):
    return sorted({x.layout.axis for x in tree.leaves(state, is_leaf=is_placed) if isinstance(x, Placed)})


def _save(root):
    """World 4, 2 ranks per node: the three sources, each saved after SAVE_AT steps and continued."""
    init_mesh()
    out = {}
    for name, group in (("hybrid", "node"), ("flat", None)):
        step, params, tx = _make(group)
        state, _ = _run(step, step.init_state(params, tx), BATCHES[:SAVE_AT])
        out[name + "_axes"] = _leaf_axes(state)
        ck.save(f"{root}/{name}", state)
        logical = _logical(step, state)
        cont, losses = _run(step, state, BATCHES[SAVE_AT:])
        out[name] = (logical, losses, _logical(step, cont))
    # the background engine: saves at step SAVE_AT while training continues
    t = async_checkpoint(f"{root}/hybrid_async", every=SAVE_AT, engine="async")
    step, params, tx = _make("node", [t])
    _, losses = _run(step, step.init_state(params, tx), BATCHES)
    t.wait()
    out["async_losses"] = losses
    return out


def _load(root, sources, group):
    """Every source into this world's ZeRO-3 (`group`: None = flat, else shard_group)."""
    init_mesh()
    rows = {}
    for src in sources:
        step, params, tx = _make(group)
        like = step.init_state(params, tx)          # placed first: a hybrid template has made its split
        loaded = ck.load(f"{root}/{src}", like=like)
        got = _logical(step, loaded)
        cont, losses = _run(step, loaded, BATCHES[SAVE_AT:])
        rows[src] = (got, losses, _logical(step, cont), _leaf_axes(loaded))
    return rows


def _assert_equal(a, b, what):
    la, lb = tree.leaves_with_path(a), tree.leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb], f"{what}: leaf paths differ"
    for (p, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), f"{what}: leaf {p} differs"


def _assert_close(final, losses, expected, expected_losses, what):
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(expected_losses, dtype=torch.float64), rtol=RTOL, atol=0,
                               msg=lambda m: f"{what} losses: {m}")
    adam, expected_adam = final.opt_state[1], expected.opt_state[1]
    assert_trees_close(final.params, expected.params, rtol=RTOL, atol=0, msg=what + " params")
    assert_trees_close(adam.nu, expected_adam.nu, rtol=RTOL, atol=0, msg=what + " adam nu")
    assert_trees_close(adam.mu, expected_adam.mu, rtol=RTOL, atol=MU_ATOL, msg=what + " adam mu")
    assert int(final.step) == int(expected.step)


def _stored_elements(step_dir):
    """{leaf path: elements stored for it, over every rank file} (read from the files' headers)."""
    m = ck.read_manifest(step_dir)
    out = {}
    for name, info in m.files.items():
        fh = File(os.path.join(m.path, name), info)
        try:
            for key in fh.keys():
                if key in m.leaves:
                    _, shape = fh.info(key)
                    out[key] = out.get(key, 0) + int(torch.Size(shape).numel())
        finally:
            fh.close()
    return out


def _assert_one_copy(step_dir):
    """Each tensor leaf's slices tile [0, numel) exactly once, and the files hold exactly that."""
    m = ck.read_manifest(step_dir)
    stored = _stored_elements(step_dir)
    for path, desc in m.leaves.items():
        if "value" in desc:
            continue
        numel = int(torch.Size(desc["shape"]).numel())
        slices = desc["slices"]
        if desc["layout"]["type"] == "Replicated":
            assert [s["kind"] for s in slices] == ["full"], f"{step_dir} {path}: {slices}"
        else:
            assert all(s["kind"] == "flat" for s in slices), f"{step_dir} {path}: {slices}"
            spans = sorted((s["start"], s["stop"]) for s in slices)
            pos = 0
            for a, b in spans:
                assert a == pos, f"{step_dir} {path}: slices {spans} leave a gap or overlap at {pos}"
                pos = b
            assert pos == numel, f"{step_dir} {path}: slices {spans} cover {pos} of {numel} elements"
        assert stored.get(path, 0) == numel, f"{step_dir} {path}: {stored.get(path, 0)} elements on disk, not {numel}"


def _saved(root):
    results = run_on_ranks(_save, 4, root, timeout=TIMEOUT, ranks_per_node=2)
    for rank, r in enumerate(results):
        assert r["hybrid_axes"] == ["dp_shard"] and r["flat_axes"] == ["dp"], (rank, r["hybrid_axes"])
        for name in ("hybrid", "flat"):
            _assert_equal(r[name][0], results[0][name][0], f"{name} source, rank {rank} vs rank 0")
        # checkpointing in the background changes nothing in training
        assert r["async_losses"][SAVE_AT:] == results[0]["hybrid"][1], rank
    return results[0]


def test_hybrid_checkpoint_holds_one_copy_and_reloads_at_any_layout(tmp_path):
    root = str(tmp_path)
    table = _saved(root)
    step_dirs = {"hybrid": f"{root}/hybrid", "flat": f"{root}/flat",
                 "hybrid_async": os.path.join(root, "hybrid_async", f"step_{SAVE_AT:08d}")}
    for d in step_dirs.values():
        _assert_one_copy(d)
        assert ck.verify(d) == []
    # the hybrid checkpoint's leaves came from the first copy's ranks only: dp_replicate index 0,
    # i.e. the first node's ranks 0 and 1 (every rank's file also holds its own generator states)
    m = ck.read_manifest(step_dirs["hybrid"])
    writers = {m.files[s["file"]]["rank"] for d in m.leaves.values() for s in d.get("slices", ())}
    assert writers == {0, 1}, writers

    targets = [(2, None, None, ["hybrid", "hybrid_async"]),        # flat ZeRO-3, world 2
               (4, None, 2, ["hybrid", "hybrid_async"]),           # flat ZeRO-3, world 4
               (8, "node", 4, ["hybrid", "flat"]),                 # hybrid 2 nodes x 4 ranks
               (4, "node", 2, ["hybrid", "flat"])]                 # hybrid 2 x 2: own layout and from flat
    for world, group, per_node, sources in targets:
        results = run_on_ranks(_load, world, root, sources, group, timeout=TIMEOUT, ranks_per_node=per_node)
        for rank, rows in enumerate(results):
            for src in sources:
                got, losses, final, axes = rows[src]
                what = f"{src} (world 4) -> {'flat' if group is None else 'hybrid'} ZeRO-3 world {world}, rank {rank}"
                assert axes == (["dp"] if group is None else ["dp_shard"]), (what, axes)
                saved_logical, uninterrupted_losses, uninterrupted = table[src.removesuffix("_async")]
                _assert_equal(got, saved_logical, what + " (gathered loaded state)")
                own = world == 4 and (group is None) == (src == "flat")
                if own:
                    assert losses == uninterrupted_losses, f"{what}: {losses} != {uninterrupted_losses}"
                    _assert_equal(final, uninterrupted, what + " (resumed vs uninterrupted)")
                else:
                    _assert_close(final, losses, uninterrupted, uninterrupted_losses, what)
