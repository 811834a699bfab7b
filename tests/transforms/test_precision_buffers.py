"""mixed_precision keeps buffers and constants in their dtype (issue 25, item 1).

Parameters (trainable and frozen) compute in `param_dtype`; a Hugging Face rotary table
(`inv_freq`, a non-persistent buffer in `apply_fn.constants`) and other buffers reach the
forward as they are, as under FSDP2 and DeepSpeed, unless `buffer_dtype=` is given.

The model is a tiny Llama with rope_theta 500000 whose window of tokens sits at positions
32641..32768 (`position_ids`), which costs what a short sequence costs but gives the
rotary angles of a long context. The reference is FSDP2's recipe written by hand: bf16
parameters, fp32 buffers, fp32 master weights updated by SGD. Negative controls put back
the old cast (every floating constant and buffer in `param_dtype`) with a monkeypatch and
show the assertions fail; `buffer_dtype=torch.bfloat16` gives exactly the hand-written
run whose buffers are cast too.
"""
import copy

import pytest
import torch
from torch import nn

import dsfn
from dsfn.functional import ApplyFn
from dsfn.transforms import mixed_precision
from dsfn.transforms.mixed_precision import MixedPrecision

pytest.importorskip("transformers", reason="the hf extra (transformers) gives the rotary Llama")

LR = 0.5                 # large enough that three steps move the weights the rotary table acts on
S, LAST = 128, 32768     # the window's length and its last position
STEPS = 3


def _old_cast_constants(self, apply_fn):
    """mixed_precision's constant cast before this fix: every floating constant (rotary
    tables included) and every persistent buffer in `param_dtype`."""
    consts = {k: (v.to(self.param_dtype) if v.is_floating_point() else v) for k, v in apply_fn.constants.items()}
    return ApplyFn(apply_fn.module, consts, apply_fn.param_names, apply_fn.buffers, self.param_dtype)


def _llama():
    from dsfn.testing.models import make_tiny_causal_lm
    return make_tiny_causal_lm("llama", rope_theta=500000.0, initializer_range=0.3, head_dim=128,
                               num_attention_heads=2, num_key_value_heads=1)     # Llama-3's 64 frequencies


def _batches():
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(LAST - S + 1, LAST + 1).expand(2, S)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 101, (2, S), generator=g)
        out.append({"input_ids": ids, "labels": ids, "position_ids": pos})
    return out


def _loss(apply_fn, params, b):
    return apply_fn(params, input_ids=b["input_ids"], labels=b["labels"], position_ids=b["position_ids"]).loss


def _dsfn_run(model, seen=None, steps=STEPS, **mp):
    """Losses of `steps` SGD steps under `mixed_precision(**mp)`; `seen` collects what the
    rotary module reads in each forward (its inv_freq and the cos it returns)."""
    model = copy.deepcopy(model)
    if seen is not None:
        model.model.rotary_emb.register_forward_hook(
            lambda m, args, out: seen.append((m.inv_freq.detach().clone(), out[0].detach().clone())))
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, b):
        loss, grads = dsfn.value_and_grad(lambda p, b: _loss(apply_fn, p, b))(state.params, b)
        return state.apply_gradients(grads), {"loss": loss}

    step = dsfn.compose(mixed_precision(**mp))(train_step)
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=LR)))
    losses = []
    for b in _batches()[:steps]:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return losses


def _fsdp2_style(model, cast_buffers=False):
    """The same steps by hand: bf16 parameters, buffers fp32 (FSDP2, DeepSpeed) or cast to
    bf16 too (`cast_buffers`), fp32 master weights updated by SGD."""
    ref = copy.deepcopy(model)
    fp32_buffers = {n: b.clone() for n, b in ref.named_buffers()}
    master = {n: p.detach().clone().float() for n, p in ref.named_parameters()}
    ref.to(torch.bfloat16)
    if not cast_buffers:
        for n, b in fp32_buffers.items():
            owner, _, leaf = n.rpartition(".")
            setattr(ref.get_submodule(owner), leaf, b)
    losses = []
    for b in _batches():
        ref.zero_grad(set_to_none=True)
        loss = ref(**b).loss
        loss.backward()
        losses.append(float(loss.detach()))
        with torch.no_grad():
            for n, p in ref.named_parameters():
                master[n] -= LR * p.grad.float()
                p.copy_(master[n])
    return losses


def test_rotary_angles_at_position_32768_are_fp32s(monkeypatch):
    model = _llama()
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    assert inv_freq.dtype == torch.float32
    want_angle = LAST * inv_freq                               # the fp32 angles at position 32768
    want_cos = torch.cos(want_angle)

    def check(seen):
        for got_inv, cos in seen:
            assert got_inv.dtype == torch.float32 and torch.equal(got_inv, inv_freq)
            assert torch.equal(LAST * got_inv, want_angle)
            last = cos[0, -1, : inv_freq.numel()].float()      # HF repeats the half; position 32768
            assert (last - want_cos).abs().max() <= 2 ** -7, (last, want_cos)   # one bf16 rounding of cos

    seen = []
    _dsfn_run(model, seen, steps=2)
    assert len(seen) == 2
    check(seen)

    # negative control: the old cast rounds inv_freq to bf16; at 32768 the angle moves by radians
    monkeypatch.setattr(MixedPrecision, "_cast_constants", _old_cast_constants)
    old = []
    _dsfn_run(model, old, steps=1)
    assert old[0][0].dtype == torch.bfloat16
    assert (LAST * old[0][0].float() - want_angle).abs().max() > 1.0
    with pytest.raises(AssertionError):
        check(old)


def test_llama_at_long_positions_equals_the_fsdp2_style_run(monkeypatch):
    model = _llama()
    want = _fsdp2_style(model)
    got = _dsfn_run(model)
    assert got == want                                          # the same ops in the same order: bitwise
    # negative control: the old cast is another run, and a step apart the gap grows
    monkeypatch.setattr(MixedPrecision, "_cast_constants", _old_cast_constants)
    old = _dsfn_run(model)
    assert old != want and abs(old[-1] - want[-1]) > 1e-3, (old, want)


def test_buffer_dtype_casts_buffers_and_constants():
    model = _llama()
    seen = []
    got = _dsfn_run(model, seen, buffer_dtype=torch.bfloat16)
    assert all(inv.dtype == torch.bfloat16 for inv, _ in seen)
    assert got == _fsdp2_style(model, cast_buffers=True)
    assert got != _fsdp2_style(model)                      # control: the fp32-buffer run differs
    with pytest.raises(dsfn.errors.ConfigError, match="buffer_dtype"):
        mixed_precision(buffer_dtype=torch.int8)


class _Scaled(nn.Module):
    """A Linear, a frozen Linear, a persistent fp32 buffer, a non-persistent one and a
    BatchNorm; records the dtypes the forward sees."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.frozen, self.bn = nn.Linear(4, 4), nn.Linear(4, 4), nn.BatchNorm1d(4)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.full((4,), 1.0 + 2 ** -10))      # not representable in bf16
        self.register_buffer("shift", torch.full((4,), 2 ** -12), persistent=False)
        self.seen = {}

    def forward(self, x):
        self.seen = {"fc": self.fc.weight.dtype, "frozen": self.frozen.weight.dtype, "scale": self.scale.dtype,
                     "shift": self.shift.dtype, "bn.running_mean": self.bn.running_mean.dtype}
        return self.bn(self.frozen(self.fc(x))) * self.scale + self.shift


def _seen(**mp):
    model = _Scaled()
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, b):
        loss, grads = dsfn.value_and_grad(lambda p, b: apply_fn(p, b["x"]).float().pow(2).mean())(state.params, b)
        return state.apply_gradients(grads), {"loss": loss}

    step = dsfn.compose(mixed_precision(**mp))(train_step)
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1), buffers=apply_fn.buffers))
    state, _ = step(state, {"x": torch.randn(8, 4)})
    assert state.buffers["bn.running_mean"].dtype == torch.float32 and state.buffers["scale"].dtype == torch.float32
    return model.seen


def test_parameters_compute_in_param_dtype_buffers_keep_theirs(monkeypatch):
    bf16, fp32 = torch.bfloat16, torch.float32
    want = {"fc": bf16, "frozen": bf16, "scale": fp32, "shift": fp32, "bn.running_mean": bf16}
    assert _seen() == want                       # BatchNorm's statistics follow its weights (torch's kernel)
    assert _seen(buffer_dtype=bf16) == {k: bf16 for k in want}
    monkeypatch.setattr(MixedPrecision, "_cast_constants", _old_cast_constants)
    assert _seen() != want                       # negative control: the old cast hands bf16 buffers
