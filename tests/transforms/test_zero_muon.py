"""Muon under ZeRO: whole matrices are orthogonalised on owner ranks (`map_whole`), so
sharded Muon equals unsharded Muon, and an fp16 overflow never touches the momentum."""
import pytest
import torch

import dsfn
from dsfn import tree
from dsfn.runtime import counters, init_mesh
from dsfn.state.layout import Placed, is_placed
from dsfn.testing import run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import assert_matches_reference, mse_loss_fp32, train_step_for
from dsfn.transforms import data_parallel, loss_scale, mixed_precision, shard_zero

SIZES = [6, 10, 7, 3]            # matrices 10x6, 7x10, 3x7 (none divides evenly by 4) + biases
BATCHES = regression_batches(4, 8, 6, 3, seed=2)


def _muon():
    return dsfn.optim.muon(lr=0.02, adam_lr=1e-2, weight_decay=0.1, ns_method="standard", ns_dtype=torch.float32)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sharded_muon_equals_unsharded(stage, world):
    assert_matches_reference(lambda: [shard_zero(stage)], lambda: make_mlp(SIZES, 0), _muon, BATCHES, world,
                             rtol=1e-5, atol=1e-6)


def test_muon_under_data_parallel_equals_unsharded():
    assert_matches_reference(lambda: [data_parallel()], lambda: make_mlp(SIZES, 0), _muon, BATCHES, 2,
                             rtol=1e-5, atol=1e-6)


def _zero3_traffic():
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    step = dsfn.compose(shard_zero(3))(train_step_for(apply_fn))
    state = step.init_state(params, _muon())
    momentum = tree.leaves(state.opt_state.momentum, is_leaf=is_placed)
    counters.reset()
    state, _ = step(state, BATCHES[0])
    return ([type(m).__name__ for m in momentum], counters.calls("dp", "all_to_all"),
            [tuple(m.data.shape) for m in tree.leaves(state.opt_state.momentum, is_leaf=is_placed)])


def test_zero3_keeps_momentum_sharded_and_exchanges_matrices_once():
    for kinds, a2a, shapes in run_on_ranks(_zero3_traffic, 2, timeout=60):
        assert kinds == ["Placed"] * 3                 # one momentum buffer per matrix, each a shard
        assert shapes == [(30,), (35,), (11,)]          # ceil(numel / 2): never the whole matrix
        assert a2a == 2                                 # one fp32 group: to the owners and back


def _overflow_keeps_momentum():
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    step = dsfn.compose(shard_zero(2), mixed_precision(torch.float16), loss_scale(init_scale=2.0 ** 40, hysteresis=1))(
        train_step_for(apply_fn, mse_loss_fp32))
    state = step.init_state(params, _muon())
    before = [x.data.clone() if isinstance(x, Placed) else x.clone()
              for x in tree.leaves(state.opt_state, is_leaf=is_placed)]
    state, m = step(state, BATCHES[0])                   # 2**40 overflows fp16: the step is skipped
    after = [x.data if isinstance(x, Placed) else x for x in tree.leaves(state.opt_state, is_leaf=is_placed)]
    scale = float(state.extra["loss_scale"].scale) if hasattr(state.extra["loss_scale"], "scale") else None
    return int(state.step), all(torch.equal(a, b) for a, b in zip(before, after)), scale


def test_fp16_overflow_never_poisons_the_momentum():
    for step_no, unchanged, scale in run_on_ranks(_overflow_keeps_momentum, 2, timeout=60):
        assert step_no == 0 and unchanged, "an overflowed step must leave Muon's momentum (and all state) untouched"
        assert scale is not None and scale < 2.0 ** 40   # the overflow was seen (hysteresis 1: halved)


class _TwoRanks:
    def size(self, axis):
        return 2

    def local_rank(self, axis):
        return 0


def test_sharded_muon_update_stays_on_the_params_device(monkeypatch):
    """ZeRO gives Muon FlatShard pieces; under NCCL they are CUDA tensors and the update must
    come back there (host buffers in `map_whole` made it a CPU tensor, and
    `p(cuda) * (1 - lr wd) - lr * u(cpu)` failed). Gloo has no second device, so `meta`
    stands in for CUDA: one process on a fake 2-rank axis whose all-to-all records devices."""
    import dsfn.runtime.flat as flat
    from dsfn.state.layout import FlatShard
    seen = []

    def all_to_all(t, axis, **kw):
        seen.append(t.device)
        return t.clone()
    monkeypatch.setattr(flat, "current_mesh", lambda: _TwoRanks())
    monkeypatch.setattr(flat.C, "all_to_all", all_to_all)
    meta = torch.device("meta")
    shapes = {"blocks.0.w": (10, 6), "blocks.1.w": (7, 10), "blocks.2.w": (3, 7)}
    params = {n: Placed(torch.empty(-(-s[0] * s[1] // 2), device=meta), FlatShard("dp", s)) for n, s in shapes.items()}
    grads = {n: Placed(torch.empty_like(p.data), p.layout) for n, p in params.items()}
    tx = dsfn.optim.muon(lr=0.02, weight_decay=0.1)                 # default ns_dtype: the device's
    state = tx.init(params)
    from dsfn.effects import activate
    with activate([shard_zero(1)]):          # ZeRO answers Muon's whole-matrix primitive
        new_params, new_state = tx.apply(grads, state, params)
    assert seen and set(seen) == {meta}
    for n, p in new_params.items():
        assert isinstance(p, Placed) and p.data.device == meta and p.data.shape == params[n].data.shape
        assert new_state.momentum[n].data.device == meta
