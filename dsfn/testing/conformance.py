"""The conformance matrix: every stack equals the single-process reference, or refuses.

A *case* is (stack, optimizer, model, world size). `run_case` trains the single-process
reference here (the same train_step, no parallel transform; transforms that change the
math — accumulation, clipping, mixed precision — are in the reference too) and the stack
on `world` gloo ranks, and compares:

- losses at every step (fp32: rtol 1e-5; mixed precision: rtol 2e-2);
- the final logical state (params and optimizer state) where the optimizer keeps
  reduction-order bits where they are (SGD-momentum and its variants): fp32 rtol 1e-5.
  Adam-like optimizers divide each element by its own second moment, which turns
  reduction-order bits near eps into visible differences (at world >= 2; and even at
  world 1 for a bias feeding BatchNorm, whose gradient is all eps-level noise); for them
  only the losses are compared (stated per optimizer in `OPTIMIZERS`).

A case that cannot work is listed in `REFUSALS` — one place — with the dsfn error it
must raise and why; `run_case` then checks the stack raises exactly that. `cases()`
enumerates the matrix (combinations a model cannot take part in, e.g. tensor parallel of a
model without a tp plan, are refusals too, not silent skips).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import tempfile
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import dsfn
from dsfn.errors import ConfigError, DsfnError, ShapeError, StackError
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import BatchNormMLP, Routed, make_mlp, make_tiny_causal_lm, regression_batches, routed_batches, \
    token_batches
from dsfn.testing.ranks import run_on_ranks

VOCAB = 101
STEPS = 3


# ---------------------------------------------------------------------------------------------
# models: (make, batches, loss, kind)


def _lm_loss(apply_fn, params, batch):
    logits = apply_fn(params, batch["input_ids"])
    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch["labels"].reshape(-1),
                           ignore_index=-100)


def _hf_labels_loss(apply_fn, params, batch):
    """A Hugging Face user's train step: the model's own loss (`labels=`: it shifts them)."""
    return apply_fn(params, input_ids=batch["input_ids"], labels=batch.get("hf_labels", batch["input_ids"])).loss


def _prompted_tokens():
    """`_tokens` with `hf_labels`: the input ids, each row's prompt ignored (-100), prompts
    of different lengths, so ranks, micro-batches and sequence slices hold different numbers
    of valid targets: a loss normalised over a part instead of the whole batch differs."""
    out = []
    for b in _tokens():
        labels = b["input_ids"].clone()
        for r in range(labels.shape[0]):
            labels[r, :(3 * r) % 11] = -100
        out.append({**b, "hf_labels": labels})
    return out


def _mse_loss(apply_fn, params, batch):
    return F.mse_loss(apply_fn(params, batch["x"]).float(), batch["y"])


def _gpt():
    from dsfn.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=16, n_layer=2, n_head=4, d_model=32))


def _gpt_plan(model):
    from dsfn.models.gpt import tp_plan
    return tp_plan()


def _hf_ckpt(reentrant: bool) -> nn.Module:
    m = make_tiny_causal_lm("llama")
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return m.train()


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    make: Callable[[], nn.Module]
    batches: Callable[[], list]
    loss: Callable
    attention: bool = False          # sequence parallel applies
    tp: str | None = None            # "auto" (HF plan) | "gpt" (dsfn's plan) | None (no plan)
    batch_stats: bool = False        # normalises by batch statistics (BatchNorm): see `_reference`
    reference_make: Callable[[], nn.Module] | None = None   # the reference's model, when it differs
    rtol: float = 1e-5               # a model's own floor (see BatchNorm's)


def _tokens():
    return token_batches(STEPS, 8, 12, VOCAB, seed=1)     # rows divisible by world 4 x accumulate 2


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(lambda: make_mlp([6, 10, 3], seed=1), lambda: regression_batches(STEPS, 8, 6, 3, seed=3),
                     _mse_loss),
    "routed": ModelSpec(lambda: Routed(True, seed=1), lambda: routed_batches(STEPS, 8), _mse_loss),
    # 16 rows: at world 4 with accumulate(2) each BatchNorm batch still has 2 rows. rtol 5e-5:
    # normalising by the statistics of 2 rows divides by |x1 - x2|, which turns reduction-order
    # bits into ~2e-5 relative in the momentum (measured: 1 element of 60 at 1.7e-5, the whole
    # matrix run's only two misses at 1e-5)
    "batchnorm": ModelSpec(lambda: BatchNormMLP(seed=1), lambda: regression_batches(STEPS, 16, 6, 3, seed=3), _mse_loss,
                           batch_stats=True, rtol=5e-5),
    "gpt": ModelSpec(_gpt, _tokens, _lm_loss, attention=True, tp="gpt"),
    "llama": ModelSpec(lambda: make_tiny_causal_lm("llama"), _tokens, _lm_loss, attention=True, tp="auto"),
    "qwen2": ModelSpec(lambda: make_tiny_causal_lm("qwen2"), _tokens, _lm_loss, attention=True, tp="auto"),
    "gemma2": ModelSpec(lambda: make_tiny_causal_lm("gemma2"), _tokens, _lm_loss, attention=True, tp="auto"),
    # the loss axis: Hugging Face's own loss (labels=), sequence parallel shifting the labels
    # over the whole sequence; llama's labels ignore prompts of uneven lengths
    "llama+labels": ModelSpec(lambda: make_tiny_causal_lm("llama"), _prompted_tokens, _hf_labels_loss,
                              attention=True, tp="auto"),
    "qwen2+labels": ModelSpec(lambda: make_tiny_causal_lm("qwen2"), _tokens, _hf_labels_loss, attention=True,
                              tp="auto"),
    # 4 query / 1 key-value heads: tensor parallel's ranks share replicas of the one kv head
    "llama+kv1": ModelSpec(lambda: make_tiny_causal_lm("llama", num_attention_heads=4, num_key_value_heads=1),
                           _tokens, _lm_loss, attention=True, tp="auto"),
    # the activation-checkpointing axis: HF's own checkpointing, compared with the model without it
    "llama+hf_ckpt": ModelSpec(lambda: _hf_ckpt(False), _tokens, _lm_loss, attention=True, tp="auto",
                               reference_make=lambda: make_tiny_causal_lm("llama")),
    "llama+hf_ckpt_reentrant": ModelSpec(lambda: _hf_ckpt(True), _tokens, _lm_loss, attention=True, tp="auto",
                                         reference_make=lambda: make_tiny_causal_lm("llama")),
}


# ---------------------------------------------------------------------------------------------
# optimizers: (make, state compared at world >= 2)


@dataclasses.dataclass(frozen=True)
class OptSpec:
    make: Callable[[], Any]
    compare_state: bool             # compare the final state (else losses only: see the module docstring)


def _groups():
    label = lambda path, x: "decay" if x.dim() >= 2 else "no_decay"   # noqa: E731
    return dsfn.optim.partition({"decay": dsfn.optim.sgd(0.1, momentum=0.9, weight_decay=0.1),
                                 "no_decay": dsfn.optim.sgd(0.1, momentum=0.9)}, label)


OPTIMIZERS: dict[str, OptSpec] = {
    "sgd": OptSpec(lambda: dsfn.optim.sgd(0.1, momentum=0.9), True),
    "clip+sgd": OptSpec(lambda: dsfn.optim.chain(dsfn.optim.clip_by_global_norm(0.05),
                                                 dsfn.optim.sgd(0.1, momentum=0.9)), True),
    "groups": OptSpec(_groups, True),
    "adamw": OptSpec(lambda: dsfn.optim.adamw(3e-3), False),
    "clip+adamw": OptSpec(lambda: dsfn.optim.chain(dsfn.optim.clip_by_global_norm(0.05), dsfn.optim.adamw(3e-3)),
                          False),
    "muon": OptSpec(lambda: dsfn.optim.muon(lr=0.02, adam_lr=3e-3, allow_no_muon=True), False),
    "from_torch": OptSpec(lambda: dsfn.optim.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True),
                          True),
}


# ---------------------------------------------------------------------------------------------
# stacks: transforms for a model, the mesh for a world size, the reference's transforms


@dataclasses.dataclass(frozen=True)
class StackSpec:
    make: Callable[[nn.Module, ModelSpec, str], list]      # (model, spec, tmpdir) -> transforms
    mesh: Callable[[int], dict] = lambda w: {"dp": w}
    reference: Callable[[], list] = lambda: []
    worlds: tuple[int, ...] = (1, 2, 4)
    rtol: float = 1e-5
    atol: float = 1e-6
    resume: bool = False            # checkpoint at step 2, resume a fresh state from it


def _T():
    import dsfn.transforms as T
    return T


def _tp(model, spec):
    T = _T()
    if spec.tp == "gpt":
        return T.tensor_parallel(_gpt_plan(model), model=model)
    return T.tensor_parallel("auto", model=model)


STACKS: dict[str, StackSpec] = {
    "data_parallel": StackSpec(lambda m, s, d: [_T().data_parallel()]),
    "zero0": StackSpec(lambda m, s, d: [_T().shard_zero(0)]),
    "zero1": StackSpec(lambda m, s, d: [_T().shard_zero(1)]),
    "zero2": StackSpec(lambda m, s, d: [_T().shard_zero(2)]),
    "zero3": StackSpec(lambda m, s, d: [_T().shard_zero(3)]),
    "zero3+offload_cpu": StackSpec(lambda m, s, d: [_T().shard_zero(3), _T().offload("cpu")]),
    "zero2+offload_nvme": StackSpec(lambda m, s, d: [_T().shard_zero(2), _T().offload("nvme", path=d)]),
    "zero3+accumulate": StackSpec(lambda m, s, d: [_T().shard_zero(3), _T().accumulate(2)],
                                  reference=lambda: [_T().accumulate(2)]),
    "zero2+clip_grad_norm": StackSpec(lambda m, s, d: [_T().shard_zero(2), _T().clip_grad_norm(0.05)],
                                      reference=lambda: [_T().clip_grad_norm(0.05)]),
    "zero3+mixed_precision": StackSpec(lambda m, s, d: [_T().shard_zero(3), _T().mixed_precision()],
                                       reference=lambda: [_T().mixed_precision()], rtol=2e-2, atol=1e-2),
    "tp": StackSpec(lambda m, s, d: [_tp(m, s)], mesh=lambda w: {"tp": w}, worlds=(2, 4)),
    "zero1+tp": StackSpec(lambda m, s, d: [_T().shard_zero(1), _tp(m, s)], mesh=lambda w: {"dp": w // 2, "tp": 2},
                          worlds=(2, 4)),
    "sp+zero3": StackSpec(lambda m, s, d: [_T().sequence_parallel(), _T().shard_zero(3)],
                          mesh=lambda w: {"dp": w // 2, "sp": 2}, worlds=(2, 4)),
    "zero1+tp+offload_cpu": StackSpec(lambda m, s, d: [_T().shard_zero(1), _tp(m, s), _T().offload("cpu")],
                                      mesh=lambda w: {"dp": w // 2, "tp": 2}, worlds=(2, 4)),
    "zero3+remat": StackSpec(lambda m, s, d: [_T().shard_zero(3), _T().remat()]),
    "zero2+remat_offload": StackSpec(lambda m, s, d: [_T().shard_zero(2), _T().remat(offload="cpu")]),
    "zero2+async_checkpoint+resume": StackSpec(
        lambda m, s, d: [_T().shard_zero(2), _T().async_checkpoint(os.path.join(d, "ckpt"), every=2)], resume=True),
}


# ---------------------------------------------------------------------------------------------
# refusals: the one list of combinations that must raise, with the error and why


@dataclasses.dataclass(frozen=True)
class Refusal:
    applies: Callable[[str, str, str], bool]       # (stack, optimizer, model)
    error: type[DsfnError]
    match: str
    why: str


REFUSALS: list[Refusal] = [
    Refusal(lambda s, o, m: "remat" in s and m == "batchnorm", ConfigError, "no repeated blocks to checkpoint",
            "remat's default picks the model's repeated blocks; this model has none (name them: modules=[...])"),
    Refusal(lambda s, o, m: s in ("tp", "zero1+tp", "zero1+tp+offload_cpu") and MODELS[m].tp is None, ConfigError,
            "declares no tp plan", "tensor parallel needs a plan; the model has none (pass plan=...)"),
    Refusal(lambda s, o, m: s == "sp+zero3" and not MODELS[m].attention, ShapeError,
            "the batch must be a dict with 'input_ids' [batch, seq]",
            "sequence parallel splits a token sequence; the model's batches have none"),
]


def refusal(stack: str, optimizer: str, model: str) -> Refusal | None:
    return next((r for r in REFUSALS if r.applies(stack, optimizer, model)), None)


@dataclasses.dataclass(frozen=True)
class Case:
    stack: str
    optimizer: str
    model: str
    world: int

    def __str__(self) -> str:
        return f"{self.stack} | {self.optimizer} | {self.model} | world {self.world}"


def cases() -> list[Case]:
    """The whole matrix (refused combinations included: they must raise)."""
    out = []
    for s, o, m in itertools.product(STACKS, OPTIMIZERS, MODELS):
        for w in STACKS[s].worlds:
            out.append(Case(s, o, m, w))
    return out


# ---------------------------------------------------------------------------------------------
# running a case


def _reference(case: Case) -> list:
    """The reference's transforms. A model that normalises by batch statistics (BatchNorm)
    sees, under data parallel, each rank's rows as its batch (DDP's semantics): its
    single-process reference is gradient accumulation over `world` micro-batches (times any
    accumulation in the stack), which normalises each rank's rows alone and averages the
    gradients. Buffers follow DDP's rule (rank 0's), compared in tests/test_buffers.py."""
    ref = list(STACKS[case.stack].reference())
    if not MODELS[case.model].batch_stats or case.world == 1:
        return ref
    T = _T()
    n = next((t.n for t in ref if isinstance(t, T.accumulate(1).__class__)), 1)
    return [t for t in ref if not isinstance(t, T.accumulate(1).__class__)] + [T.accumulate(n * case.world)]


def _train(case: Case, tmpdir: str, transforms: bool) -> tuple[list[float], Any]:
    """Train on this rank: the stack (transforms=True) or the reference; (losses, logical state)."""
    from dsfn.runtime import init_mesh
    from dsfn.testing.reference import train_step_for
    spec, sspec, ospec = MODELS[case.model], STACKS[case.stack], OPTIMIZERS[case.optimizer]
    if transforms and case.world > 1:
        init_mesh(**sspec.mesh(case.world))
    model = spec.make() if transforms or spec.reference_make is None else spec.reference_make()
    apply_fn, params = dsfn.functionalize(model)
    make = (lambda: sspec.make(model, spec, tmpdir)) if transforms else (lambda: _reference(case))
    step = dsfn.compose(*make())(train_step_for(apply_fn, spec.loss))
    state = step.place(dsfn.TrainState.create(params, ospec.make(), seed=0, buffers=apply_fn.buffers))
    losses = []
    batches = spec.batches()
    for i, b in enumerate(batches):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        if transforms and sspec.resume and i == 1:
            for t in step.stack:
                if hasattr(t, "wait"):
                    t.wait()
            # resume: a fresh state (as a restarted job builds it) loaded from the checkpoint
            fresh_fn, fresh_params = dsfn.functionalize(spec.make())
            fresh = step.place(dsfn.TrainState.create(fresh_params, ospec.make(), seed=0, buffers=fresh_fn.buffers))
            state = dsfn.checkpoint.load(os.path.join(tmpdir, "ckpt"), like=fresh)
    full = step.gather(state)
    for t in step.stack:
        if hasattr(t, "wait"):
            t.wait()
    return losses, {"params": full.params, "opt_state": full.opt_state, "step": full.step}


def run_case(case: Case, tmpdir: str | None = None, timeout: float = 240.0) -> str:
    """'passed' or 'refused' (the listed error was raised); AssertionError otherwise."""
    tmpdir = tmpdir or tempfile.mkdtemp(prefix="dsfn-conformance-")
    why = refusal(case.stack, case.optimizer, case.model)
    if why is not None:
        try:
            run_on_ranks(_train, case.world, case, tmpdir, True, timeout=timeout)
        except Exception as e:     # RankFailure carries the rank's error text
            text = str(e)
            assert why.error.__name__ in text and why.match in text, \
                f"{case}: expected {why.error.__name__} matching {why.match!r} ({why.why}), got: {text[:2000]}"
            return "refused"
        raise AssertionError(f"{case}: expected a refusal ({why.error.__name__}: {why.why}), but it ran")
    sspec, ospec = STACKS[case.stack], OPTIMIZERS[case.optimizer]
    ref_losses, ref_state = _train(case, tmpdir + "-ref", False)
    results = run_on_ranks(_train, case.world, case, tmpdir, True, timeout=timeout)
    for r, (losses, state) in enumerate(results):
        rtol = max(sspec.rtol, MODELS[case.model].rtol)
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                   torch.tensor(ref_losses, dtype=torch.float64), rtol=rtol, atol=sspec.atol,
                                   msg=lambda m: f"{case}: rank {r} losses {losses} vs reference {ref_losses}: {m}")
        if ospec.compare_state:
            assert_trees_close(state, ref_state, rtol=rtol, atol=max(sspec.atol, 1e-6),
                               msg=f"{case}: rank {r} final state vs reference")
    return "passed"
