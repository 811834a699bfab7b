"""`remat`: activation checkpointing as a transform, for models without their own.

Equality: the example GPT and a tiny Hugging Face Llama, trained 3 SGD-momentum steps with
`remat` (each policy, with and without offload), give the losses and final logical state of
the same run without it (fp32, rtol 1e-5), under no transform, data_parallel and
shard_zero(1|2|3) on 2 ranks, tensor_parallel and sequence_parallel on 2.

Memory: saved-activation bytes are counted with `saved_tensors_hooks` around the step (every
tensor autograd saves, deduplicated by storage, the parameters' storages left out) for a
4-layer GPT at sequence 1024: with remat they fall to <= 1/3 of the count without; with
offload="cpu" the bytes held on the device fall below one block's activations and the host
holds exactly the blocks' inputs.

Negative controls: the same counting without remat sees every block's activations (so the
memory test can fail); a recompute fed stale weights (the step's set-up for the forward torn
down when the forward returns, instead of after backward) gives a different run — and the same
tear-down without remat does not, so the difference is the recompute's.
"""
from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

import dsfn
from dsfn.effects import activate
import dsfn.functional as functional
from dsfn.errors import ConfigError, StackError
from dsfn.models.gpt import GPT, GPTConfig
from dsfn.runtime import collectives as C
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import token_batches
from dsfn.testing.reference import lm_loss, train_step_for
from dsfn.transforms import (data_parallel, mixed_precision, remat, sequence_parallel, shard_zero,
                             tensor_parallel)

GPT_CFG = GPTConfig(vocab_size=97, seq_len=16, n_layer=3, n_head=4, d_model=32)
BATCHES = {"gpt": token_batches(3, 4, 16, 97, seed=3), "llama": token_batches(3, 4, 12, 101, seed=2)}


def _model(family: str, dropout: float = 0.0):
    if family == "gpt":
        m = GPT(GPTConfig(**{**GPT_CFG.__dict__, "dropout": dropout}), seed=0)
    else:
        from dsfn.testing.models import make_tiny_causal_lm
        m = make_tiny_causal_lm("llama")
    m.train()
    return m


def _train(family, make_stack, mesh=None, stale=False, dropout=0.0, hf_gc=False):
    if mesh:
        init_mesh(**mesh)
    torch.manual_seed(0)
    model = _model(family, dropout)
    if hf_gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose(*make_stack(model))(train_step_for(apply_fn, lm_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(0.5, momentum=0.9)))
    losses = []
    patches = contextlib.ExitStack()
    if stale in (True, "functional"):      # the step's parameters unbound from the module after forward
        patches.enter_context(mock.patch.object(functional, "until_backward", _exit_at_once))
    if stale in (True, "remat"):           # remat's wrappers removed after forward
        patches.enter_context(mock.patch("dsfn.transforms.remat.until_backward", _exit_at_once))
    with patches:
        for b in BATCHES[family]:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
    full = step.gather(state)
    assert "forward" not in {k for _, mod in model.named_modules() for k in mod.__dict__}, "a wrapper was left"
    return losses, {"params": full.params, "opt_state": full.opt_state}


@contextlib.contextmanager
def _exit_at_once(cm):
    with cm as v:
        yield v


_REF: dict = {}


def _reference(family):
    if family not in _REF:
        _REF[family] = _train(family, lambda m: [])
    return _REF[family]


def _check(family, make_stack, world, mesh=None):
    ref = _reference(family)
    runs = [_train(family, make_stack, mesh)] if world == 1 else \
        run_on_ranks(_train, world, family, make_stack, mesh, timeout=180)
    for losses, state in runs:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=1e-5, atol=1e-6)
        assert_trees_close(state, ref[1], rtol=1e-5, atol=1e-6)


STACKS = {
    "none": (lambda m, r: [r], 1, None),
    "data_parallel": (lambda m, r: [data_parallel(), r], 2, None),
    "zero1": (lambda m, r: [shard_zero(1), r], 2, None),
    "zero2": (lambda m, r: [shard_zero(2), r], 2, None),
    "zero3": (lambda m, r: [shard_zero(3), r], 2, None),
}


@pytest.mark.parametrize("stack", sorted(STACKS))
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_remat_equals_no_remat(family, stack):
    if family == "llama":
        pytest.importorskip("transformers")
    make, world, mesh = STACKS[stack]
    _check(family, lambda m: make(m, remat()), world, mesh)


@pytest.mark.parametrize("kw", [dict(policy="matmuls"), dict(offload="cpu"), dict(policy="dots", offload="cpu")],
                         ids=["matmuls", "offload", "dots+offload"])
@pytest.mark.parametrize("stack", ["none", "zero3"])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_policies_and_offload_equal_no_remat(family, stack, kw):
    if family == "llama":
        pytest.importorskip("transformers")
    make, world, mesh = STACKS[stack]
    _check(family, lambda m: make(m, remat(**kw)), world, mesh)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_tensor_parallel_outside_remat_equals_no_remat(family):
    """The recompute re-runs tensor parallel's forwards (their collectives included)."""
    if family == "llama":
        pytest.importorskip("transformers")
        plan = lambda m: tensor_parallel("auto", model=m)
    else:
        from dsfn.models.gpt import tp_plan
        plan = lambda m: tensor_parallel(tp_plan(), model=m)
    _check(family, lambda m: [plan(m), remat()], 2, {"tp": 2})


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_sequence_parallel_outside_remat_equals_no_remat(family):
    """The recompute re-runs Ulysses attention (its all-to-alls included)."""
    if family == "llama":
        pytest.importorskip("transformers")
    _check(family, lambda m: [sequence_parallel(), remat(offload="cpu")], 2, {"sp": 2})


def _tp_plan(family, m):
    if family == "llama":
        return tensor_parallel("auto", model=m)
    from dsfn.models.gpt import tp_plan
    return tensor_parallel(tp_plan(), model=m)


@pytest.mark.parametrize("offload", [None, "cpu"], ids=["device", "offload"])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_partition_activations_under_tensor_parallel_equals_no_remat(family, offload):
    """DeepSpeed's partition_activations: each tp rank keeps 1/tp of a block's input and the
    recompute all-gathers it back; the run equals the one without remat."""
    if family == "llama":
        pytest.importorskip("transformers")
    _check(family, lambda m: [_tp_plan(family, m), remat(partition_activations=True, offload=offload)], 2,
           {"tp": 2})


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_dp2_x_tp2_with_zero3_and_partitioned_remat_equals_no_remat(family):
    if family == "llama":
        pytest.importorskip("transformers")
    _check(family, lambda m: [shard_zero(3), _tp_plan(family, m), remat(partition_activations=True)], 4,
           {"dp": 2, "tp": 2})


def _train_with_own_piece_only(*args):
    """Negative control: the recompute gets this rank's piece repeated instead of the gathered input."""
    import sys
    remat_mod = sys.modules["dsfn.engines.remat_stash"]     # remat's saved-input hooks

    def unpack(self, item):
        if not isinstance(item, remat_mod._Piece):
            return item
        return torch.cat([item.piece] * self.n)[:item.numel].view(item.shape)
    with mock.patch.object(remat_mod.TpPartition, "unpack", unpack):
        return _train(*args)


def test_negative_control_partitioned_inputs_not_gathered_differ():
    runs = run_on_ranks(_train_with_own_piece_only, 2, "gpt",
                        lambda m: [_tp_plan("gpt", m), remat(partition_activations=True)], {"tp": 2}, timeout=180)
    ref = _reference("gpt")
    for losses, _ in runs:
        assert losses[0] == pytest.approx(ref[0][0], rel=1e-6)        # the first forward is not recomputed
        assert max(abs(a - b) for a, b in zip(losses[1:], ref[0][1:])) > 1e-3, (losses, ref[0])


def _partitioned_and_offloaded_bytes(kw):
    init_mesh(tp=2)
    from dsfn.models.gpt import tp_plan
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=32)
    model = GPT(cfg, seed=0)
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose(tensor_parallel(tp_plan(), model=model), remat(**kw))(train_step_for(apply_fn, lm_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(0.1)))
    C.reset_gauges()
    step(state, token_batches(1, 2, 64, 256, seed=0)[0])
    return C.gauge_max.get("remat.partitioned_bytes", 0), C.gauge_max.get("remat.offloaded_bytes", 0)


def test_partition_activations_keeps_one_tp_share_of_the_saved_inputs():
    inputs = 4 * 2 * 64 * 32 * 4                # 4 blocks x [2, 64, 32] fp32, whole on each tp rank
    whole = run_on_ranks(_partitioned_and_offloaded_bytes, 2, dict(offload="cpu"), timeout=120)
    split = run_on_ranks(_partitioned_and_offloaded_bytes, 2, dict(offload="cpu", partition_activations=True),
                         timeout=120)
    for (p0, h0), (p1, h1) in zip(whole, split):
        assert (p0, h0) == (0, inputs)          # without: every rank holds every input
        assert (p1, h1) == (inputs // 2, inputs // 2)    # with: its half, and only that goes to the host


def _differing_inputs():
    init_mesh(tp=2)
    from dsfn.engines.remat import TpPartition
    part = TpPartition("tp", check=True)
    x = torch.full((4, 3), float(torch.distributed.get_rank()), requires_grad=True)
    try:
        part.pack(x * 1)
    except Exception as e:                       # noqa: BLE001 - the type and message are the result
        return type(e).__name__, str(e)
    return None


def test_partition_activations_refuses_inputs_that_differ_across_the_tp_group():
    for r in run_on_ranks(_differing_inputs, 2, timeout=60):
        assert r is not None and r[0] == "LayoutError" and "differs across the 'tp' group" in r[1], r


def test_partition_activations_needs_tensor_parallel():
    with pytest.raises(StackError, match="partition_activations=True.*add tensor_parallel"):
        dsfn.compose(shard_zero(3), remat(partition_activations=True))
    with pytest.raises(ConfigError, match="partition_activations"):
        remat(partition_activations="tp")
    r = remat(partition_activations=True)
    step = dsfn.compose(tensor_parallel({"x": "colwise"}), r)(lambda s, b: (s, {}))   # the documented stack
    with activate(step.stack, step.facts):       # the note names the stack's tp axis (a stack fact)
        assert "each tp rank keeps 1/tp of them (partition_activations)" in r.explain_note()


def test_custom_policies_and_module_patterns():
    save_mm = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]
    for r in (remat(policy=save_mm), remat(policy=lambda ctx, op, *a, **k: op in save_mm),
              remat(modules=["blocks.*.mlp", "blocks.*.attn"]), remat(modules="blocks.1")):
        _check("gpt", lambda m, r=r: [r], 1)


def test_dropout_is_replayed_in_the_recompute():
    """The recompute draws the forward's dropout masks (RNG state replayed): bitwise the run
    without remat, which differs from a run without dropout."""
    ref = _train("gpt", lambda m: [], dropout=0.2)
    got = _train("gpt", lambda m: [remat()], dropout=0.2)
    assert got[0] == ref[0]
    assert_trees_close(got[1], ref[1], rtol=0, atol=0)
    assert got[0] != _reference("gpt")[0]


# -- negative control: a recompute on stale weights -------------------------------------------------

def test_negative_control_recompute_on_stale_weights_differs():
    ref = _reference("gpt")
    stale_remat = _train("gpt", lambda m: [remat()], stale=True)
    diff = max(float((stale_remat[1]["params"][k] - ref[1]["params"][k]).abs().max()) for k in ref[1]["params"])
    assert diff > 1e-4, diff
    # the same tear-down without remat changes nothing: the difference is the recompute's
    plain = _train("gpt", lambda m: [], stale=True)
    assert_trees_close(plain[1], ref[1], rtol=1e-6, atol=1e-7)


def test_remat_inside_the_models_own_checkpoint_keeps_its_wrapping_until_backward():
    """HF checkpoints each decoder layer, remat each layer's MLP inside it: HF's recompute runs
    the MLP through remat's wrapper (kept until backward is over), so it saves what its forward
    saved, and the run equals the reference. Negative control: remat's wrappers removed when
    the forward returns — the recompute saves the MLP's activations the forward did not, which
    torch's checkpoint refuses."""
    pytest.importorskip("transformers")
    ref = _reference("llama")
    make = lambda m: [remat(modules=["model.layers.*.mlp"])]
    losses, state = _train("llama", make, hf_gc=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=1e-5, atol=1e-6)
    assert_trees_close(state, ref[1], rtol=1e-5, atol=1e-6)
    from torch.utils.checkpoint import CheckpointError
    with pytest.raises(CheckpointError):
        _train("llama", make, hf_gc=True, stale="remat")


# -- memory ---------------------------------------------------------------------------------------

class SavedBytes:
    """Bytes autograd saves while active (deduplicated by storage; `exclude`: storages not
    counted, e.g. the parameters'). Tensors a hook further in packs (remat's offload, the
    checkpoint's own) never reach it."""

    def __init__(self, exclude=()):
        self.exclude = set(exclude)
        self.seen: dict[int, int] = {}

    def pack(self, t):
        if t.device.type != "meta":
            s = t.untyped_storage()
            if s.data_ptr() not in self.exclude:
                self.seen[s.data_ptr()] = max(self.seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())


def saved_bytes(make_stack, n_layer=4, seq=1024, d_model=64):
    """(device-held saved bytes, remat's host-held bytes) of one step of a GPT at `seq`."""
    cfg = GPTConfig(vocab_size=256, seq_len=seq, n_layer=n_layer, n_head=4, d_model=d_model)
    apply_fn, params = dsfn.functionalize(GPT(cfg, seed=0))
    step = dsfn.compose(*make_stack())(train_step_for(apply_fn, lm_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(0.1)))
    batch = token_batches(1, 1, seq, 256, seed=0)[0]
    counter = SavedBytes(exclude=[p.untyped_storage().data_ptr() for p in params.values()])
    C.reset_gauges()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        step(state, batch)
    return counter.bytes, C.gauge_max.get("remat.offloaded_bytes", 0)


def test_remat_saves_at_most_a_third_of_the_activations():
    none, _ = saved_bytes(lambda: [])
    with_remat, host = saved_bytes(lambda: [remat()])
    assert host == 0
    assert with_remat <= none / 3, (with_remat, none)


def test_negative_control_the_counter_sees_every_blocks_activations():
    """Without remat each block adds its activations (many times its input); the count grows
    with depth, so a remat that saved nothing would fail the test above."""
    input_bytes = 1 * 1024 * 64 * 4
    four, two = saved_bytes(lambda: [], n_layer=4)[0], saved_bytes(lambda: [], n_layer=2)[0]
    per_block = (four - two) / 2
    assert per_block >= 8 * input_bytes, (per_block, input_bytes)
    # with remat a block adds only its input
    r4, r2 = saved_bytes(lambda: [remat()], n_layer=4)[0], saved_bytes(lambda: [remat()], n_layer=2)[0]
    assert (r4 - r2) / 2 == input_bytes


def test_offload_keeps_the_block_inputs_on_the_host():
    input_bytes = 1 * 1024 * 64 * 4
    four, two = saved_bytes(lambda: [], n_layer=4)[0], saved_bytes(lambda: [], n_layer=2)[0]
    per_block = (four - two) / 2
    on_device, host = saved_bytes(lambda: [remat(offload="cpu")])
    with_remat, _ = saved_bytes(lambda: [remat()])
    assert host == 4 * input_bytes                      # every block's input, nothing else
    assert on_device + host == with_remat               # the same saved tensors, split by place
    assert on_device <= per_block, (on_device, per_block)     # less than one block's activations


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host copies on a side stream)")
def test_offload_on_cuda_moves_inputs_to_pinned_host_memory_and_matches():
    def run(r):
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=256, seq_len=512, n_layer=4, n_head=4, d_model=128)
        model = GPT(cfg, seed=0).cuda()
        apply_fn, params = dsfn.functionalize(model)
        step = dsfn.compose(*r)(train_step_for(apply_fn, lm_loss))
        state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(0.5, momentum=0.9)))
        losses = []
        for b in token_batches(3, 2, 512, 256, seed=0):
            state, m = step(state, {k: v.cuda() for k, v in b.items()})
            losses.append(float(m["loss"]))
        return losses, step.gather(state).params
    ref = run([])
    for r in ([remat()], [remat(offload="cpu")], [remat(policy="matmuls", offload="cpu")]):
        got = run(r)
        torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=1e-5, atol=1e-6)
        assert_trees_close(got[1], ref[1], rtol=1e-5, atol=1e-6)


# -- stack rules, errors, explain ---------------------------------------------------------------------

@pytest.mark.parametrize("outer", ["data_parallel", "shard_zero", "tensor_parallel", "sequence_parallel"])
def test_remat_outside_a_parallel_transform_is_a_stack_error(outer):
    make = {"data_parallel": data_parallel, "shard_zero": lambda: shard_zero(3),
            "tensor_parallel": lambda: tensor_parallel({"x": "colwise"}), "sequence_parallel": sequence_parallel}[outer]
    with pytest.raises(StackError, match=f"remat must sit inside {outer}"):
        dsfn.compose(remat(), make())
    dsfn.compose(make(), remat())                         # the documented order


def test_position_among_other_transforms_is_free():
    dsfn.compose(remat(), mixed_precision())
    dsfn.compose(mixed_precision(), remat())


def test_config_errors_name_the_fix():
    with pytest.raises(ConfigError, match="policy"):
        remat(policy="everything")
    with pytest.raises(ConfigError, match="OpOverload"):
        remat(policy=[torch.ops.aten.mm])
    with pytest.raises(ConfigError, match="offload"):
        remat(offload="nvme")
    with pytest.raises(ConfigError, match="unknown argument"):
        remat(units=["x"])
    apply_fn, params = dsfn.functionalize(GPT(GPT_CFG))
    step = dsfn.compose(remat(modules=["layers.*"]))(train_step_for(apply_fn, lm_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(0.1)))
    with pytest.raises(ConfigError, match=r"matches no module.*blocks"):
        step(state, BATCHES["gpt"][0])
    lin = torch.nn.Sequential(torch.nn.Linear(4, 4))
    apply_fn, params = dsfn.functionalize(lin)
    step = dsfn.compose(remat())(train_step_for(apply_fn, lambda f, p, b: f(p, b["x"]).sum()))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(0.1)))
    with pytest.raises(ConfigError, match="no repeated blocks"):
        step(state, {"x": torch.ones(2, 4)})


def test_explain_names_the_checkpointed_modules():
    apply_fn, params = dsfn.functionalize(GPT(GPT_CFG))
    step = dsfn.compose(remat(offload="cpu"))(train_step_for(apply_fn, lm_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(0.1)))
    text = str(step.explain(state, BATCHES["gpt"][0]))
    assert "remat(policy='nothing'): checkpoints 3 modules (blocks.0, blocks.1, blocks.2)" in text
    assert "host memory" in text and "peak remat.modules: 3" in text
    assert "peak remat.offloaded_bytes: 24576" in text     # 3 blocks x [4, 16, 32] fp32


def test_hf_layers_that_checkpoint_themselves_are_skipped():
    pytest.importorskip("transformers")
    from dsfn.testing.models import make_tiny_causal_lm
    model = make_tiny_causal_lm("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    apply_fn, params = dsfn.functionalize(model)
    r = remat()
    step = dsfn.compose(r)(train_step_for(apply_fn, lm_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(0.1)))
    step(state, BATCHES["llama"][0])
    assert "checkpoints 0 modules" in r.explain_note()
    assert "2 skipped (the model checkpoints them itself: model.layers.0, model.layers.1)" in r.explain_note()


def test_checkpoints_only_forwards_that_record_gradients():
    from dsfn.transforms.core import activate
    from torch.utils.checkpoint import checkpoint as torch_checkpoint
    apply_fn, params = dsfn.functionalize(GPT(GPT_CFG))
    ids = BATCHES["gpt"][0]["input_ids"]
    calls = []

    def counting(*a, **k):
        calls.append(1)
        return torch_checkpoint(*a, **k)
    with mock.patch("dsfn.engines.remat.checkpoint", side_effect=counting), activate((remat(),)):
        with torch.no_grad():
            apply_fn(params, ids)
        assert calls == []
        apply_fn(params, ids)                    # grad mode, no value_and_grad: unwrapped after the call
        assert len(calls) == GPT_CFG.n_layer
    assert "forward" not in apply_fn.module.blocks[0].__dict__


# -- what the recompute runs ----------------------------------------------------------------------

def _matmuls_per_step(make_stack, mesh=None):
    """aten matmul calls executed in one step (forward, recompute, backward) of the GPT."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from dsfn.engines.remat import MATMUL_OPS
    if mesh:
        init_mesh(**mesh)

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in MATMUL_OPS:
                Count.n += 1
            return func(*args, **(kwargs or {}))
    apply_fn, params = dsfn.functionalize(_model("gpt"))
    step = dsfn.compose(*make_stack())(train_step_for(apply_fn, lm_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(0.1)))
    with Count():
        step(state, BATCHES["gpt"][0])
    return Count.n


@pytest.mark.parametrize("zero3", [False, True], ids=["plain", "zero3"])
def test_the_recompute_reruns_the_blocks_matmuls_unless_the_policy_saved_them(zero3):
    """Per block the forward runs 5 matmuls (qkv, attention, attn.proj, fc, mlp.proj): "nothing"
    re-runs the first 4 in backward (the recompute stops once it has every tensor backward
    needs; mlp.proj's output is not one of them); "matmuls" hands back their saved outputs."""
    outer = [shard_zero(3)] if zero3 else []

    def count(r):
        make = lambda: outer + r
        return run_on_ranks(_matmuls_per_step, 2, make)[0] if zero3 else _matmuls_per_step(make)
    base, nothing, matmuls = count([]), count([remat()]), count([remat(policy="matmuls")])
    assert nothing - base == 4 * GPT_CFG.n_layer, (base, nothing)
    assert matmuls == base, (base, matmuls)
