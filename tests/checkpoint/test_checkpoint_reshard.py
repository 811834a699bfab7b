"""The reshard matrix: a checkpoint saved at any world size {1, 2, 4} under any ZeRO stage
{0, 1, 2, 3} loads into every world size x stage (12 sources x 12 targets = 144 pairs).

For every pair, on every target rank:
- the loaded state gathered to logical form (params, optimizer moments, step, rng and the
  loss-scale state in `extra["loss_scale"]`) is bitwise the saved logical state;
- training continued from the loaded state is bitwise training continued from the saved
  logical state placed into the same target layout (`step.place(logical.replace(tx=tx))`);
- in the source's own layout (same world size, same stage) the resumed run is bitwise the
  uninterrupted run of the source;
- in any other layout the resumed run matches the uninterrupted run of the source at fp32
  rtol 1e-6 (losses and final params / moments): a different world size splits the batch
  differently, so sums are rounded in another order and only rounding may differ.

The main family is fp32 with `loss_scale()` (it composes with fp32: the scale is a power of
two, so scaling and unscaling are exact and the scale state still grows and is carried).
Two mixed-precision families load into all 12 targets of their own family (bitwise checks
only; the cross-world comparison is a bf16/fp16 rounding question, not a checkpoint one):
- bf16 compute with fp32 master weights (`mixed_precision()`), saved at world 2 stage 2
  and world 4 stage 3;
- fp16 compute + dynamic loss scaling, saved at world 2 stage 3 and world 4 stage 1 after
  overflows (skipped steps, spent hysteresis, a halved scale), so the loss-scale state
  differs from its initial value in every field and decides which continued steps skip.

The model's parameter counts (35, 7, 21, 3) are odd, so FlatShard pads every leaf at
world 2 and 4. One `run_on_ranks` per source world trains and saves every source of that
world; one per target world loads every source into every target stage.
"""
import pytest
import torch

import dsfn
from dsfn import checkpoint as ck
from dsfn import tree
from dsfn.runtime import init_mesh
from dsfn.testing import assert_trees_close, run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import mse_loss_fp32, train_step_for
from dsfn.transforms import loss_scale, mixed_precision, shard_zero

SIZES = [5, 7, 3]                   # parameter counts 35, 7, 21, 3: none divides by 2 or 4
SAVE_AT = 3                         # steps trained before the save
BATCHES = regression_batches(SAVE_AT + 2, 8, 5, 3, seed=1)   # 2 steps continued after it
WORLDS = (1, 2, 4)
STAGES = (0, 1, 2, 3)
SOURCES = ([(w, s, "fp32") for w in WORLDS for s in STAGES]
           + [(2, 2, "bf16"), (4, 3, "bf16"), (2, 3, "fp16"), (4, 1, "fp16")])
RTOL = 1e-6                         # fp32 resume in another layout vs the uninterrupted run
# Adam's first moment is an average of raw gradients; an element whose per-sample terms
# nearly cancel has a large *relative* rounding error when the batch is summed in another
# order (measured: up to 1.3e-5 relative, but at most 5.6e-9 absolute, about one fp32 ulp of
# the ~0.1 terms). Fewer continued steps or other data do not bring it under rtol 1e-6, so
# mu alone gets this atol; losses, params and the second moment hold at rtol 1e-6, atol 0
# (measured: at most 2.1e-7, 5.5e-7 and 4.8e-7 relative).
MU_ATOL = 1e-8
TIMEOUT = 300                       # generous: the 2 CPU cores are shared with other test runs


def _transforms(family):
    """The stack inside shard_zero, in canonical order. In fp16 the initial scale 2**17
    overflows in the first steps on this data; window 2 doubles it again soon after."""
    ls = lambda: loss_scale(init_scale=2.0 ** 17, window=2)
    return {"fp32": lambda: [ls()],
            "bf16": lambda: [mixed_precision()],
            "fp16": lambda: [mixed_precision(torch.float16), ls()]}[family]()


def _make(stage, family):
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    step = dsfn.compose(shard_zero(stage), *_transforms(family))(train_step_for(apply_fn, mse_loss_fp32))
    return step, params, dsfn.optim.adamw(lr=1e-2, weight_decay=0.1)


def _run(step, state, batches):
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


def _logical(step, state):
    return step.gather(state).replace(tx=None)      # optimizers hold closures: not picklable


def _path(root, world, stage, family):
    return f"{root}/w{world}_zero{stage}_{family}"


def _save_world(root, world):
    """Every source of this world: train SAVE_AT steps, save, then continue uninterrupted."""
    init_mesh()
    out = {}
    for src in SOURCES:
        if src[0] != world:
            continue
        _, stage, family = src
        step, params, tx = _make(stage, family)
        state, _ = _run(step, step.init_state(params, tx), BATCHES[:SAVE_AT])
        ck.save(_path(root, *src), state)
        logical = _logical(step, state)
        cont, losses = _run(step, state, BATCHES[SAVE_AT:])
        out[src] = (logical, losses, _logical(step, cont))
    return out


def _load_world(root, saved, world):
    """Every source into every stage of this world (same family)."""
    init_mesh()
    rows = {}
    for src, (logical, _, _) in saved.items():
        family = src[2]
        for stage in STAGES:
            step, params, tx = _make(stage, family)
            loaded = ck.load(_path(root, *src), like=step.init_state(params, tx))
            got_logical = _logical(step, loaded)
            cont, losses = _run(step, loaded, BATCHES[SAVE_AT:])
            # the reference: the saved logical state placed into this same target layout
            ref, ref_losses = _run(step, step.place(logical.replace(tx=tx)), BATCHES[SAVE_AT:])
            rows[src, stage] = (got_logical, losses, _logical(step, cont), ref_losses, _logical(step, ref))
    return rows


def _name(src, world, stage, rank=None):
    w, s, family = src
    where = "" if rank is None else f", rank {rank}"
    return f"{family} saved at world {w} zero{s} -> world {world} zero{stage}{where}"


def _assert_equal(a, b, what):
    la, lb = tree.leaves_with_path(a), tree.leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb], f"{what}: leaf paths differ"
    for (p, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), f"{what}: leaf {p} differs"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(root, {source: (saved logical state, uninterrupted losses, uninterrupted final state)})."""
    root = str(tmp_path_factory.mktemp("reshard"))
    table = {}
    for world in WORLDS:
        results = run_on_ranks(_save_world, world, root, world, timeout=TIMEOUT)
        for rank, res in enumerate(results[1:], 1):       # gather is collective: all ranks agree
            for src, (logical, losses, final) in res.items():
                _assert_equal(logical, results[0][src][0], f"source {src}: rank {rank} vs rank 0")
                assert losses == results[0][src][1]
        table.update(results[0])
    assert set(table) == set(SOURCES)
    return root, table


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"to_world{w}")
def loaded(request, saved):
    """(target world, per-rank {(source, target stage): rows}) for every source."""
    root, table = saved
    world = request.param
    return world, run_on_ranks(_load_world, world, root, table, world, timeout=TIMEOUT)


def _pairs(loaded):
    world, results = loaded
    assert len(results) == world
    for rank, rows in enumerate(results):
        assert set(rows) == {(src, stage) for src in SOURCES for stage in STAGES}
        for (src, stage), row in rows.items():
            yield src, world, stage, rank, row


def test_sources_are_distinct_layouts_with_live_loss_scale_state(saved):
    """The matrix is meaningful: each checkpoint records its source world size and step,
    and the loss-scale state is carried (fp16: after overflows, away from its initial
    value in every field)."""
    root, table = saved
    for src, (logical, _, _) in table.items():
        world, _, family = src
        manifest = ck.read_manifest(_path(root, *src))
        assert manifest.world_size == world and manifest.step == int(logical.step), src
        if family == "bf16":
            assert "loss_scale" not in logical.extra
            continue
        ls = logical.extra["loss_scale"]
        assert int(ls.cur_iter) == SAVE_AT, src
        if family == "fp16":
            assert int(logical.step) < SAVE_AT, f"{src}: no step was skipped before the save"
            assert float(ls.scale) < 2.0 ** 17 and int(ls.hysteresis) == 1 and int(ls.last_overflow_iter) >= 0, src
        else:
            assert int(logical.step) == SAVE_AT and int(ls.last_overflow_iter) == -1, src


def test_loaded_state_is_bitwise_the_saved_logical_state(saved, loaded):
    """Params, optimizer moments (and master weights), step, rng and loss-scale state."""
    _, table = saved
    for src, world, stage, rank, (got_logical, *_rest) in _pairs(loaded):
        logical = table[src][0]
        _assert_equal(got_logical, logical, _name(src, world, stage, rank) + " (gathered loaded state)")
        assert ("loss_scale" in got_logical.extra) == (src[2] != "bf16")


def test_training_from_loaded_state_is_bitwise_training_from_placed_saved_state(loaded):
    for src, world, stage, rank, (_, losses, final, ref_losses, ref_final) in _pairs(loaded):
        what = _name(src, world, stage, rank)
        assert losses == ref_losses, f"{what}: losses {losses} != {ref_losses}"
        _assert_equal(final, ref_final, what + " (state after continuing)")


def test_resume_in_the_source_layout_is_bitwise_the_uninterrupted_run(saved, loaded):
    _, table = saved
    checked = 0
    for src, world, stage, rank, (_, losses, final, _, _) in _pairs(loaded):
        if (world, stage) != src[:2]:
            continue
        _, uninterrupted_losses, uninterrupted_final = table[src]
        what = _name(src, world, stage, rank)
        assert losses == uninterrupted_losses, f"{what}: resumed {losses} != uninterrupted {uninterrupted_losses}"
        _assert_equal(final, uninterrupted_final, what + " (resumed vs uninterrupted)")
        checked += 1
    world = loaded[0]
    assert checked == world * sum(src[0] == world for src in SOURCES)


def test_fp32_resume_in_any_layout_matches_the_uninterrupted_run_at_rtol_1e6(saved, loaded):
    """Losses, params and Adam's second moment at rtol 1e-6 with atol 0; the first moment at
    rtol 1e-6 with atol MU_ATOL (see there); step, rng, Adam's count and lr and the
    loss-scale state exactly."""
    _, table = saved
    checked = 0
    for src, world, stage, rank, (_, losses, final, _, _) in _pairs(loaded):
        if src[2] != "fp32":
            continue
        _, uninterrupted_losses, expected = table[src]
        what = _name(src, world, stage, rank)
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                   torch.tensor(uninterrupted_losses, dtype=torch.float64), rtol=RTOL, atol=0,
                                   msg=lambda m: f"{what} losses: {m}")
        adam, expected_adam = final.opt_state[1], expected.opt_state[1]
        assert_trees_close(final.params, expected.params, rtol=RTOL, atol=0, msg=what + " params")
        assert_trees_close(adam.nu, expected_adam.nu, rtol=RTOL, atol=0, msg=what + " adam nu")
        assert_trees_close(adam.mu, expected_adam.mu, rtol=RTOL, atol=MU_ATOL, msg=what + " adam mu")
        exact = lambda st, a: {"step": st.step, "rng": st.rng, "extra": st.extra, "count": a.count, "lr": a.lr}
        _assert_equal(exact(final, adam), exact(expected, expected_adam), what + " (exact leaves)")
        checked += 1
    assert checked == loaded[0] * len(STAGES) * sum(src[2] == "fp32" for src in SOURCES)
