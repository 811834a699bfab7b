"""shard_zero(3) shards frozen parameters (a LoRA base): each rank stores 1/N of the base,
gathers it unit by unit like the trainable weights, and training equals the single
process. Ψ_f below is the frozen base's element count; a rank holds Σ ceil(numel / N)."""
import math

import pytest
import torch
from torch import nn

import dsfn
from dsfn.errors import LeafTypeError
from dsfn.runtime import collectives as C
from dsfn.runtime import init_mesh
from dsfn.state.layout import FlatShard, Placed
from dsfn.testing import assert_trees_close, run_on_ranks
from dsfn.testing.models import regression_batches
from dsfn.testing.reference import mse_loss, train_step_for
from dsfn.transforms import mixed_precision, shard_zero

D, LAYERS, RANK = 24, 4, 2
FP32 = dict(rtol=1e-5, atol=1e-6)


class LoRALinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank update x A^T B^T."""

    def __init__(self, d_in: int, d_out: int, r: int = RANK):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(r, d_in) * 0.3)
        self.b = nn.Parameter(torch.randn(d_out, r) * 0.3)

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


class LoRAModel(nn.Module):
    """A frozen input projection (root unit), LAYERS LoRA blocks (the units), a trainable head."""

    def __init__(self, seed: int = 0, base_seed: int | None = None):
        super().__init__()
        torch.manual_seed(seed if base_seed is None else base_seed)
        self.inp = nn.Linear(D, D)
        self.inp.requires_grad_(False)
        self.blocks = nn.ModuleList(LoRALinear(D, D) for _ in range(LAYERS))
        torch.manual_seed(seed)
        for blk in self.blocks:                       # adapters: the same whatever the base seed
            nn.init.normal_(blk.a, std=0.3)
            nn.init.normal_(blk.b, std=0.3)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        h = self.inp(x)
        for blk in self.blocks:
            h = torch.tanh(blk(h))
        return self.head(h)


def frozen_numels(model: nn.Module) -> dict[str, int]:
    return {n: p.numel() for n, p in model.named_parameters() if not p.requires_grad}


BATCHES = regression_batches(3, 8, D, 3, seed=1)


def _reference(base_seed=None):
    model = LoRAModel(base_seed=base_seed)
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose()(train_step_for(apply_fn, mse_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=1e-2)))
    losses = []
    for b in BATCHES:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return losses, step.gather(state)


def _train(stage, prefetch=1):
    init_mesh()
    model = LoRAModel()
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose(shard_zero(stage, prefetch=prefetch))(train_step_for(apply_fn, mse_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=1e-2)))
    losses = []
    C.reset_gauges()
    for b in BATCHES:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    frozen = {n: apply_fn.constants[n] for n in apply_fn.frozen}
    held = sum(x.data.numel() if isinstance(x, Placed) else x.numel() for x in frozen.values()) * 4
    module_held = sum(p.numel() for p in model.parameters() if not p.requires_grad) * 4
    layouts = {n: (x.layout if isinstance(x, Placed) else None) for n, x in frozen.items()}
    # evaluation outside the Step cannot use the pieces: a clear error
    try:
        apply_fn(state.params if stage < 3 else {k: torch.zeros(1) for k in params}, BATCHES[0]["x"])
        outside = None
    except LeafTypeError as e:
        outside = str(e)
    full = step.gather(state)
    return dict(losses=losses, params=full.params, opt=full.opt_state, held=held, module_held=module_held,
                layouts=layouts, live=C.gauge_max.get("zero3.live_units"),
                backward=C.gauge_max.get("zero3.backward_units"), outside=outside)


@pytest.mark.parametrize("world", [2, 4])
def test_lora_base_sharded_and_training_equals_reference(world):
    ref_losses, ref = _reference()
    numels = frozen_numels(LoRAModel())
    per_rank = 4 * sum(math.ceil(n / world) for n in numels.values())
    full_bytes = 4 * sum(numels.values())
    for r, res in enumerate(run_on_ranks(_train, world, 3, timeout=120)):
        # storage: 1/N of the frozen base (padding only), the module keeps no full copy
        assert res["held"] == per_rank, (r, res["held"], per_rank)
        assert res["held"] <= full_bytes / world + 4 * (world - 1) * len(numels)
        assert res["module_held"] == 0
        assert all(isinstance(lay, FlatShard) and lay.shape == tuple(LoRAModel().get_parameter(n).shape)
                   for n, lay in res["layouts"].items()), res["layouts"]
        # transient: one unit (+ the prefetched one) gathered in forward, in backward likewise
        assert res["live"] == 2 and res["backward"] <= 2, (res["live"], res["backward"])
        assert "stored sharded" in res["outside"]
        # the math: the single process with the frozen base replicated
        assert torch.allclose(torch.tensor(res["losses"]), torch.tensor(ref_losses), **FP32), (res["losses"], ref_losses)
        assert_trees_close(res["params"], ref.params, **FP32)
        assert_trees_close(res["opt"], ref.opt_state, **FP32)
    # negative control: a different frozen base gives other losses, so the comparison sees the base
    other, _ = _reference(base_seed=7)
    assert not torch.allclose(torch.tensor(other), torch.tensor(ref_losses), **FP32)


def test_stage2_keeps_frozen_base_replicated():
    """Negative control of the byte count: below stage 3 every rank holds the whole base."""
    numels = frozen_numels(LoRAModel())
    for res in run_on_ranks(_train, 2, 2, timeout=60):
        assert res["held"] == 4 * sum(numels.values())
        assert res["module_held"] == 4 * sum(numels.values())
        assert all(lay is None for lay in res["layouts"].values())


def _train_bf16():
    init_mesh()
    model = LoRAModel()
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose(shard_zero(3), mixed_precision(torch.bfloat16))(train_step_for(apply_fn, mse_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=1e-2)))
    seen = []
    model.blocks[0].base.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    losses = []
    for b in BATCHES:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return losses, seen


def test_frozen_base_computes_in_mixed_precision_dtype():
    """Under mixed_precision the gathered frozen weights are in the compute dtype, as the
    replicated constants are without ZeRO (the same losses as shard_zero(2) + bf16)."""
    (losses3, seen), = run_on_ranks(_train_bf16, 1, timeout=60)
    res = run_on_ranks(_train_bf16, 2, timeout=60)
    for losses, seen in res:
        assert seen and all(d == torch.bfloat16 for d in seen), seen
        assert torch.allclose(torch.tensor(losses), torch.tensor(losses3), rtol=2e-2), (losses, losses3)


def _eval_only():
    init_mesh()
    model = LoRAModel()
    apply_fn, params = dsfn.functionalize(model)
    x = BATCHES[0]["x"]
    with torch.no_grad():
        expect = model(x)

    def eval_step(state, batch):
        with torch.no_grad():
            return state, {"loss": mse_loss(apply_fn, state.params, batch)}
    step = dsfn.compose(shard_zero(3))(eval_step)
    state = step.init_state(params, dsfn.optim.sgd(lr=0.1))
    before = [t.clone() for t in dsfn.tree.leaves(state.params)]
    C.reset_gauges()
    _, m = step(state, BATCHES[0])
    unchanged = all(torch.equal(a, b) for a, b in zip(before, dsfn.tree.leaves(state.params)))
    return float(m["loss"]), float(torch.nn.functional.mse_loss(expect, BATCHES[0]["y"])), unchanged, \
        C.gauge_max.get("zero3.live_units")


def test_sharded_evaluation_step():
    """An eval step (no gradients, no update) under shard_zero(3) gathers units one at a
    time and gives the loss of the unsharded model, averaged over the dp ranks' halves."""
    for loss, _, unchanged, live in run_on_ranks(_eval_only, 2, timeout=60):
        full = mse_loss(dsfn.functionalize(LoRAModel())[0], dsfn.functionalize(LoRAModel())[1], BATCHES[0])
        assert abs(loss - float(full)) <= 1e-5 * abs(float(full)) + 1e-6, (loss, float(full))
        assert unchanged and live == 2


def _explain(stage):
    init_mesh()
    model = LoRAModel()
    model.register_buffer("mask", torch.ones(D), persistent=False)     # a constant buffer
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose(shard_zero(stage))(train_step_for(apply_fn, mse_loss))
    ex = step.explain(step.init_state(params, dsfn.optim.adamw(lr=1e-2)), BATCHES[0])
    return {p: (lay, nbytes) for p, lay, _, _, nbytes in ex.leaves if p.startswith("constants.")}


def test_explain_counts_frozen_parameters_and_constant_buffers():
    numels = frozen_numels(LoRAModel())
    for world in (1, 2):
        consts = run_on_ranks(_explain, world, 3, timeout=60)[0]
        assert set(consts) == {f"constants.{n}" for n in numels} | {"constants.mask"}
        assert consts["constants.mask"][1] == 4 * D
        frozen = sum(b for p, (_, b) in consts.items() if p != "constants.mask")
        assert frozen == 4 * sum(math.ceil(n / world) for n in numels.values()), (world, frozen)
        if world == 2:
            assert all(isinstance(lay, FlatShard) for p, (lay, _) in consts.items() if p != "constants.mask")


# -- tensor parallel: frozen parameters split by the plan (and then by ZeRO-3 over dp) ------------------
PLAN = {"inp": "colwise_rep", "blocks.*.base": "colwise_rep"}


def _train_tp(mesh, zero, **kw):
    from dsfn.transforms import tensor_parallel
    init_mesh(**mesh)
    model = LoRAModel()
    apply_fn, params = dsfn.functionalize(model)
    stack = ([shard_zero(3, **kw)] if zero else []) + [tensor_parallel(PLAN, model=model)]
    step = dsfn.compose(*stack)(train_step_for(apply_fn, mse_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1, momentum=0.9)))
    losses = []
    for b in BATCHES:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    frozen = {n: apply_fn.constants[n] for n in apply_fn.frozen}
    held = sum((x.data if isinstance(x, Placed) else x).numel() * 4 for x in frozen.values())
    full = step.gather(state)
    return dict(losses=losses, params=full.params, opt=full.opt_state, held=held,
                layouts={n: type(x.layout).__name__ if isinstance(x, Placed) else None for n, x in frozen.items()})


@pytest.mark.parametrize("mesh,zero", [(dict(dp=1, tp=2), False), (dict(dp=2, tp=2), True)])
def test_frozen_base_split_by_tp_plan(mesh, zero):
    """Frozen weights of planned modules are tp pieces (1/tp), and ZeRO-3 shards those over dp
    (1/(tp*dp)); training equals the single process."""
    ref_model = LoRAModel()
    apply_fn, params = dsfn.functionalize(ref_model)
    step = dsfn.compose()(train_step_for(apply_fn, mse_loss))
    ref = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1, momentum=0.9)))
    ref_losses = []
    for b in BATCHES:
        ref, m = step(ref, b)
        ref_losses.append(float(m["loss"]))
    world = mesh["dp"] * mesh["tp"]
    numels = frozen_numels(LoRAModel())              # every frozen tensor is in a planned module
    dp = mesh["dp"] if zero else 1
    expect = 4 * sum(math.ceil(k // mesh["tp"] / dp) for k in numels.values())
    for res in run_on_ranks(_train_tp, world, mesh, zero, timeout=120):
        kind = "Nested" if zero else "DimShard"
        assert set(res["layouts"].values()) == {kind}, res["layouts"]
        assert res["held"] == expect, (res["held"], expect)
        assert res["held"] <= 4 * sum(numels.values()) / world + 4 * len(numels)
        assert torch.allclose(torch.tensor(res["losses"]), torch.tensor(ref_losses), **FP32)
        assert_trees_close(res["params"], ref.params, **FP32)
        assert_trees_close(res["opt"], ref.opt_state, **FP32)


# -- held quantized: shard_zero(3, quantize_frozen=...) (DeepSpeed's zero_quantized_nontrainable_weights) --
BLOCK = 64


def _train_held(kw, mesh, base=None, mp=False):
    """Train the LoRA model under shard_zero(3, **kw); `base`: name -> values to give its
    frozen weights first. Returns the losses, the held frozen constants (as each rank stores
    them, and dequantized whole), the all-gather bytes, the adapters after training and the
    explain rows of the constants."""
    from dsfn.runtime import counters
    from dsfn.state.layout import unplace
    init_mesh(**mesh)
    model = LoRAModel()
    if base is not None:
        with torch.no_grad():
            for n, v in base.items():
                model.get_parameter(n).copy_(v)
    original = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    apply_fn, params = dsfn.functionalize(model)
    stack = [shard_zero(3, **kw)] + ([mixed_precision(torch.bfloat16)] if mp else [])
    step = dsfn.compose(*stack)(train_step_for(apply_fn, mse_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1, momentum=0.9)))
    counters.reset()
    C.reset_gauges()
    losses = []
    for b in BATCHES:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    sent = counters.bytes(op="all_gather")
    frozen = {n: apply_fn.constants[n] for n in apply_fn.frozen}
    stored = {n: (type(x.layout).__name__, x.data.dtype, x.data.numel() * x.data.element_size()) for n, x in frozen.items()}
    whole = {n: unplace(x).clone() for n, x in frozen.items()}
    ex = step.explain(state, BATCHES[0])
    rows = {p[len("constants."):]: nbytes for p, _, _, _, nbytes in ex.leaves if p.startswith("constants.")}
    return dict(losses=losses, stored=stored, whole=whole, original=original, sent=sent,
                params={k: v.clone() for k, v in step.gather(state).params.items()}, explain=rows,
                secondary=C.gauge_max.get("zero3.secondary_bytes"))


def test_frozen_weights_held_quantized_train_as_the_model_with_that_base():
    """dp2, quantize_frozen="int8": each large frozen shard is stored once as its codes and
    scales (uint8, a byte an element + 4 / block), the small ones (biases) as they are; what
    the units compute with is exactly that held base: the run equals, bitwise, an exact
    shard_zero(3) run of the model whose frozen weights are the dequantized ones. The held
    base is within absmax / 254 of the original (int8), not equal to it; the gathers send
    fewer bytes; explain counts the bytes held."""
    from dsfn.runtime.quantized import WireFormat
    wire = WireFormat("int8", BLOCK, BLOCK)
    exact = run_on_ranks(_train_held, 2, {}, {"dp": 2}, timeout=120)
    got = run_on_ranks(_train_held, 2, {"quantize_frozen": "int8", "quantize_block": BLOCK}, {"dp": 2}, timeout=120)
    same = run_on_ranks(_train_held, 2, {}, {"dp": 2}, got[0]["whole"], timeout=120)
    for r in range(2):
        q = got[r]
        for n, (kind, dtype, nbytes) in q["stored"].items():
            numel = LoRAModel().get_parameter(n).numel()
            if numel >= BLOCK:
                assert (kind, dtype, nbytes) == ("Quantized", torch.uint8, wire.packed_bytes(math.ceil(numel / 2))), n
                err = (q["whole"][n] - q["original"][n]).abs().max()
                assert 0 < err <= q["original"][n].abs().max() / 254 * (1 + 1e-6), (n, err)
            else:
                assert (kind, nbytes) == ("FlatShard", 4 * math.ceil(numel / 2)), n
                assert torch.equal(q["whole"][n], q["original"][n]), n
            assert q["explain"][n] == nbytes, (n, q["explain"][n], nbytes)
        assert q["losses"] == same[r]["losses"]
        for k in q["params"]:
            assert torch.equal(q["params"][k], same[r]["params"][k]), k
        assert q["losses"] != exact[r]["losses"]
        torch.testing.assert_close(torch.tensor(q["losses"]), torch.tensor(exact[r]["losses"]), rtol=1e-3, atol=0)
        assert q["sent"] < 0.75 * exact[r]["sent"], (q["sent"], exact[r]["sent"])


def test_held_quantized_base_under_hpz_and_mixed_precision():
    """4 ranks on 2 nodes, hpZ: the secondary shard keeps the forward's codes (fewer bytes
    held than the dequantized fp32 slices), and backward rebuilds bitwise the forward's
    weights — the run equals the flat (no hpZ) one bitwise. Under bf16 the held base is
    dequantized into the compute dtype and trains near the exact bf16 run."""
    kw = {"quantize_frozen": "int8", "quantize_block": BLOCK}
    flat = run_on_ranks(_train_held, 4, kw, {"dp": 4}, timeout=120, ranks_per_node=2)
    hpz = run_on_ranks(_train_held, 4, {**kw, "hpz": "node"}, {"dp": 4}, timeout=120, ranks_per_node=2)
    plain_hpz = run_on_ranks(_train_held, 4, {"hpz": "node"}, {"dp": 4}, timeout=120, ranks_per_node=2)
    for a, b, c in zip(flat, hpz, plain_hpz):
        assert a["losses"] == b["losses"]
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), k
        assert 0 < b["secondary"] < 0.6 * c["secondary"], (b["secondary"], c["secondary"])
    bf16 = run_on_ranks(_train_held, 2, kw, {"dp": 2}, None, True, timeout=120)
    ref = run_on_ranks(_train_held, 2, {}, {"dp": 2}, None, True, timeout=120)
    for a, b in zip(bf16, ref):
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=2e-2, atol=0)


def test_quantize_frozen_bad_options_are_named_errors():
    from dsfn.errors import ConfigError
    with pytest.raises(ConfigError, match=r"shard_zero\(2, quantize_frozen='int8'\): only stage 3"):
        shard_zero(2, quantize_frozen="int8")
    with pytest.raises(ConfigError, match=r"quantize_frozen='int4'\): frozen weights are held as 'int8'"):
        shard_zero(3, quantize_frozen="int4")
    with pytest.raises(ConfigError, match="block"):
        shard_zero(3, quantize_frozen="int8", quantize_block=0)


def _export_held(out):
    init_mesh(dp=2)
    model = LoRAModel()
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose(shard_zero(3, quantize_frozen="int8", quantize_block=BLOCK))(train_step_for(apply_fn, mse_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)))
    state, _ = step(state, BATCHES[0])
    from dsfn.state.layout import unplace
    whole = {n: unplace(apply_fn.constants[n]).clone() for n in apply_fn.frozen}
    path = dsfn.checkpoint.export_state(state, out, apply_fn=apply_fn)
    return path, whole


def test_export_writes_the_held_quantized_base_dequantized(tmp_path):
    """export_state writes a frozen weight held quantized as its logical dtype (fp32), the
    values the units compute with."""
    from safetensors.torch import load_file
    path, whole = run_on_ranks(_export_held, 2, str(tmp_path / "out"), timeout=120)[0]
    got = load_file(path)
    for n, v in whole.items():
        assert got[n].dtype == torch.float32 and torch.equal(got[n], v), n


def test_frozen_base_held_quantized_under_tensor_parallel():
    """dp2 x tp2: ZeRO-3's pieces of the tp-split frozen weights are held quantized (their
    layout wraps the Nested one) and training stays near the exact dp2 x tp2 run, not equal."""
    mesh = dict(dp=2, tp=2)
    exact = run_on_ranks(_train_tp, 4, mesh, True, timeout=120)
    held = run_on_ranks(_train_tp, 4, mesh, True, quantize_frozen="int8", quantize_block=BLOCK, timeout=120)
    for a, b in zip(exact, held):
        assert "Quantized" in set(b["layouts"].values()), b["layouts"]
        torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=1e-3, atol=0)
        assert b["losses"] != a["losses"]
