"""ZeRO-3 gathers each unit straight into flat buffers kept across steps (one storage per
unit and bucket, FSDP2's unsharded storage, whose memory is freed between uses): counted
by a TorchDispatchMode, the first step makes each unit's buffers once (backward
re-gathers into the forward's), and from the second step on no gather makes anything. Results are bitwise those of a ZeRO-3 that keeps nothing
(negative control: there every step allocates again)."""
import torch
import torch.nn.functional as F

import dsfn
from dsfn.models.gpt import GPT, GPTConfig
from dsfn.runtime import init_mesh
from dsfn.testing import assert_trees_equal, run_on_ranks
from dsfn.testing.alloc import AllocCounter
from dsfn.testing.models import token_batches
from dsfn.transforms import mixed_precision, shard_zero
from dsfn.engines.zero import units as Z



def _loss(apply_fn, params, batch):
    logits = apply_fn(params, batch["input_ids"])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch["labels"].reshape(-1))


def _run(keep, precision):
    """keep: ZeRO-3 keeps its unit storages and transfer buffers across steps (False: both
    are forgotten before every step, the negative control)."""
    init_mesh()
    n = torch.distributed.get_world_size()
    model = GPT(GPTConfig.preset("tiny", n_layer=3))
    apply_fn, params = dsfn.functionalize(model)
    zero = shard_zero(3, prefetch=1)
    extra = [mixed_precision(torch.bfloat16)] if precision else []

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lambda p, b: _loss(apply_fn, p, b))(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    step = dsfn.compose(zero, *extra)(train_step)
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=1e-2)))
    made, gathers = [], []
    real = Z.gather_into_buffers

    def counted(shards, shapes, *a, **k):
        with AllocCounter() as mode:
            g = real(shards, shapes, *a, **k)
        made[-1] += mode.bytes
        gathers[-1].append(sum(n * s.numel() * s.element_size() for s in shards))
        return g
    Z.gather_into_buffers = counted
    try:
        losses = []
        for batch in token_batches(3, 4, 16, 256, seed=0):
            made.append(0)
            gathers.append([])
            if not keep:
                zero._engine.plans.clear()    # the unit plans, their storages with them
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
    finally:
        Z.gather_into_buffers = real
    return dict(made=made, gathered=[sum(g) for g in gathers], calls=[len(g) for g in gathers],
                largest=max(max(g) for g in gathers), losses=losses, params=step.gather(state).params)


def test_zero3_gathers_reuse_their_buffers_across_steps():
    pooled = run_on_ranks(_run, 2, True, False, timeout=90)
    control = run_on_ranks(_run, 2, False, False, timeout=90)
    for p, c in zip(pooled, control):
        assert p["calls"][0] == 2 * 4              # root + 3 blocks, forward and backward
        # first step: each unit's buffers once (backward re-gathers into the forward's), no
        # other buffer; later steps: nothing at all
        assert 2 * p["made"][0] == p["gathered"][0]
        assert p["made"][1] == p["made"][2] == 0
        # keeping nothing, every step makes its buffers again
        assert c["made"][0] == c["made"][1] == c["made"][2] == p["made"][0]
        assert p["losses"] == c["losses"]
        assert_trees_equal(p["params"], c["params"])


def test_zero3_gathers_reuse_buffers_under_mixed_precision():
    for p, c in zip(run_on_ranks(_run, 2, True, True, timeout=90), run_on_ranks(_run, 2, False, True, timeout=90)):
        assert p["made"][1] == p["made"][2] == 0 and c["made"][2] == c["made"][0] > 0
        assert p["losses"] == c["losses"]
        assert_trees_equal(p["params"], c["params"])


def _stage12(stage, donate):
    init_mesh()
    n = torch.distributed.get_world_size()
    model = GPT(GPTConfig.preset("tiny", n_layer=2))
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lambda p, b: _loss(apply_fn, p, b))(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    step = dsfn.compose(shard_zero(stage), donate=donate)(train_step)
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=1e-2)))
    kept, moved = 0, 0
    for batch in token_batches(3, 4, 16, 256, seed=0):
        before = {k: (v.data_ptr(), v.numel() % n == 0) for k, v in state.params.items()}
        state, m = step(state, batch)
        for k, v in state.params.items():
            ptr, even = before[k]
            if even:
                kept += v.data_ptr() == ptr
                moved += v.data_ptr() != ptr
    return dict(kept=kept, moved=moved, params={k: v.clone() for k, v in state.params.items()},
                loss=float(m["loss"]))


def test_zero12_donated_step_gathers_into_the_old_parameters():
    """Stages 1-2 under donation: every parameter whose numel the dp size divides is
    all-gathered into its old tensor (no second full copy); bitwise the non-donated result.
    Negative control: without donation every step's parameters are new tensors."""
    for stage in (1, 2):
        donated = run_on_ranks(_stage12, 2, stage, True, timeout=90)
        plain = run_on_ranks(_stage12, 2, stage, False, timeout=90)
        for d, p in zip(donated, plain):
            assert d["kept"] > 0 and d["moved"] == 0
            assert p["kept"] == 0 and p["moved"] == d["kept"]
            assert d["loss"] == p["loss"]
            assert_trees_equal(d["params"], p["params"])
