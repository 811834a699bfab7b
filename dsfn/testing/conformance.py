"""The conformance matrix: every stack equals the single-process reference, or refuses.

A *case* (row) is (stack, optimizer, model, world size). `run_case` trains the
single-process reference here (the same train_step, no parallel transform; transforms that
change the math — accumulation, clipping, mixed precision — are in the reference too) and
the stack on `world` gloo ranks, for STEPS (3) steps, and promises, for every rank:

- fp32 rows: the loss of every step and every element of the final logical state
  (parameters, the whole optimizer state — momentum, Adam's moments, Muon's momentum —
  and the step count) within rtol 1e-5 (a model's own floor where larger), atol 1e-6,
  for every optimizer. Adam-like optimizers use eps ADAM_EPS, above the gradients'
  reduction-order noise (see its comment), so their state is comparable;
- mixed-precision rows: compared with a reference in the same precision (bf16 compute and
  gradients, fp32 master weights, the same casts; each rank's rows one bf16 micro-batch of
  the reference, `_reference`): each leaf of the final state within MP_REL (1/20) of what
  the reference's updates changed in it (L2 over the leaf), the losses within rtol
  MP_LOSS_RTOL. `Verdict.worst` is the largest measured fraction;
- every row: the reference's updates moved the parameters at least MIN_RATIO (10) times the
  comparison's tolerance (`sensitivity`, reported as `Verdict.ratio`), so a lost update, a
  zeroed gradient or a scaled update cannot pass.

A case that cannot work is listed in `REFUSALS` — one place — with the dsfn error it
must raise and why; `run_case` then checks the stack raises exactly that. `cases()`
enumerates the matrix (combinations a model cannot take part in, e.g. tensor parallel of a
model without a tp plan, are refusals too, not silent skips); `default_sample()` is the
stratified subset CI runs. `dsfn.testing.mutations` lists the bugs the matrix must catch.

What is not promised: a row whose every update is normalised by a clip below the gradient
norm (`clip+sgd`, `clip+adamw`, `zero2+clip_grad_norm`) checks the global norm and is blind
to the gradient's scale by construction; each stack also runs without such a clip. Mixed
precision runs at worlds 1 and 2 only (see its StackSpec).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import random
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
    rtol: float = 1e-5               # a model's own floor, where one needs it
    layers: int = 2                  # repeated blocks (pipeline stages are cut from them)


def _tokens():
    return token_batches(STEPS, 8, 12, VOCAB, seed=1)     # rows divisible by world 4 x accumulate 2


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(lambda: make_mlp([6, 10, 3], seed=1), lambda: regression_batches(STEPS, 8, 6, 3, seed=3),
                     _mse_loss),
    "routed": ModelSpec(lambda: Routed(True, seed=1), lambda: routed_batches(STEPS, 8), _mse_loss),
    # 32 rows: at world 4 with accumulate(2) each BatchNorm batch has 4 rows. With 16 (2 rows
    # per batch) normalising divides by |x1 - x2|, and zero3+accumulate's AdamW rows at w4 missed
    # by 1.8e-4 on the input bias (whose gradient is exactly zero, so all noise) even at rtol
    # 5e-5; with 4 rows all 322 BatchNorm rows pass at the common rtol 1e-5
    "batchnorm": ModelSpec(lambda: BatchNormMLP(seed=1), lambda: regression_batches(STEPS, 32, 6, 3, seed=3), _mse_loss,
                           batch_stats=True),
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
    # 4 layers: pipeline schedules with 2 stages per rank (interleaved, ZBV) at pp 2
    "qwen2+4layers": ModelSpec(lambda: make_tiny_causal_lm("qwen2", num_hidden_layers=4), _tokens, _lm_loss,
                               attention=True, tp="auto", layers=4),
    "llama+kv1": ModelSpec(lambda: make_tiny_causal_lm("llama", num_attention_heads=4, num_key_value_heads=1),
                           _tokens, _lm_loss, attention=True, tp="auto"),
    # the activation-checkpointing axis: HF's own checkpointing, compared with the model without it
    "llama+hf_ckpt": ModelSpec(lambda: _hf_ckpt(False), _tokens, _lm_loss, attention=True, tp="auto",
                               reference_make=lambda: make_tiny_causal_lm("llama")),
    "llama+hf_ckpt_reentrant": ModelSpec(lambda: _hf_ckpt(True), _tokens, _lm_loss, attention=True, tp="auto",
                                         reference_make=lambda: make_tiny_causal_lm("llama")),
}


def _lora_llama() -> nn.Module:
    """The usual LoRA fine-tune: peft's `PeftModelForCausalLM` around a tiny Llama (r=4 on
    q_proj / v_proj; B random too, so A trains from the first step); the base is frozen, and
    the inner `LlamaForCausalLM` computes the loss."""
    import peft
    lm = make_tiny_causal_lm("llama")
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                          init_lora_weights=False)
    return peft.get_peft_model(lm, cfg)


MODELS["llama+lora"] = ModelSpec(_lora_llama, _prompted_tokens, _hf_labels_loss, attention=True, tp="auto")


# ---------------------------------------------------------------------------------------------
# optimizers: (make, state compared at world >= 2)


# Adam's eps: well above the reduction-order noise of a gradient element, so dividing by the
# second moment does not turn last bits into visible differences. A gradient perturbation d
# moves an element by at most about lr * d / eps per step: with eps 1e-8 an element whose
# gradient is noise (a key bias, a bias feeding BatchNorm) moves by +-lr whatever its bits;
# 1e-5 still left 1e-6-level misses (BatchNorm's bias, Muon's Adam part on an embedding);
# 1e-4 keeps them ~10x under atol 1e-6. Adam stays scale-aware enough for the comparison, and
# its moments (compared too) are linear / quadratic in the gradient.
ADAM_EPS = 1e-4
# decoupled weight decay large enough that 3 steps of it are seen at rtol 1e-5
ADAM_WD = 0.1


@dataclasses.dataclass(frozen=True)
class OptSpec:
    make: Callable[[], Any]
    family: str                     # "sgd" (SGD-momentum and variants) | "adam" (Adam-like: AdamW, Muon)
    clipped: bool = False           # a clip below the gradient norm normalises every update (blind to its scale)


def _groups():
    label = lambda path, x: "decay" if x.dim() >= 2 else "no_decay"   # noqa: E731
    return dsfn.optim.partition({"decay": dsfn.optim.sgd(0.1, momentum=0.9, weight_decay=0.1),
                                 "no_decay": dsfn.optim.sgd(0.1, momentum=0.9)}, label)


def _adamw():
    return dsfn.optim.adamw(3e-3, eps=ADAM_EPS, weight_decay=ADAM_WD)


OPTIMIZERS: dict[str, OptSpec] = {
    "sgd": OptSpec(lambda: dsfn.optim.sgd(0.1, momentum=0.9), "sgd"),
    "clip+sgd": OptSpec(lambda: dsfn.optim.chain(dsfn.optim.clip_by_global_norm(0.05),
                                                 dsfn.optim.sgd(0.1, momentum=0.9)), "sgd", clipped=True),
    "groups": OptSpec(_groups, "sgd"),
    "adamw": OptSpec(_adamw, "adam"),
    "clip+adamw": OptSpec(lambda: dsfn.optim.chain(dsfn.optim.clip_by_global_norm(0.05), _adamw()), "adam",
                          clipped=True),
    "muon": OptSpec(lambda: dsfn.optim.muon(lr=0.02, adam_lr=3e-3, adam_eps=ADAM_EPS, weight_decay=ADAM_WD,
                                            allow_no_muon=True), "adam"),
    "from_torch": OptSpec(lambda: dsfn.optim.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True),
                          "sgd"),
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
    mixed: bool = False             # bf16 compute, fp32 master: compared by the update (see `compare`)
    clipped: bool = False           # a clip below the gradient norm normalises every update
    nodes: int | None = None        # the ranks spread over this many nodes (launcher topology; None: one)
    also_sampled: tuple[int, ...] = ()   # more worlds the default sample runs it at (one row each)

    def ranks_per_node(self, world: int) -> int | None:
        return world // self.nodes if self.nodes and world > 1 else None

    def axes(self, world: int) -> dict[str, int]:
        """The mesh at `world` ranks ({} at world 1: no process group axes)."""
        return dict(self.mesh(world)) if world > 1 else {}

    def full_world(self) -> int:
        """The smallest world size of this stack at which every parallel axis is > 1."""
        return min(w for w in self.worlds if w > 1 and all(n > 1 for n in self.mesh(w).values()))


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
                                      reference=lambda: [_T().clip_grad_norm(0.05)], clipped=True),
    # the reference is the same precision and the same casts: bf16 compute and gradients, fp32
    # master weights, each rank's rows a bf16 micro-batch (see `_reference`). Worlds 1 and 2
    # only: the mean of 2 bf16 gradients is the reference's micro-batch sum to the bit (measured
    # on every LM but GPT, <= 3.3% of the update there), while 4 ranks' bf16 reduce-scatter sums
    # in another order than any single process, which measured 8-17% of the update on the
    # Adam / Muon rows: above the 1/10 of the update that `MP_REL` allows.
    "zero3+mixed_precision": StackSpec(lambda m, s, d: [_T().shard_zero(3), _T().mixed_precision()],
                                       reference=lambda: [_T().mixed_precision()], mixed=True, worlds=(1, 2)),
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
    # beyond one node: the ranks on 2 nodes (the launcher's topology); hybrid sharding shards
    # over a node's dp ranks and replicates across the nodes (world 4: 2 groups x 2; world 8:
    # 2 x 4, and with tp 2 inside each node 2 x 2); hpZ shards over all and re-gathers in a node
    "hsdp1": StackSpec(lambda m, s, d: [_T().shard_zero(1, shard_group="node")], worlds=(4, 8), nodes=2,
                       also_sampled=(8,)),
    "hsdp2": StackSpec(lambda m, s, d: [_T().shard_zero(2, shard_group="node")], worlds=(4, 8), nodes=2,
                       also_sampled=(8,)),
    "hsdp3": StackSpec(lambda m, s, d: [_T().shard_zero(3, shard_group="node")], worlds=(4, 8), nodes=2,
                       also_sampled=(8,)),
    "zero3+hpz": StackSpec(lambda m, s, d: [_T().shard_zero(3, hpz="node")], worlds=(4, 8), nodes=2,
                           also_sampled=(8,)),
    # pipeline parallel: each schedule at pp 2 (4 micro-batches of the 8 rows), and with ZeRO-1
    # over dp (2 micro-batches of each dp rank's 4 rows); interleaved and ZBV run 4 stages
    "pp_gpipe": StackSpec(lambda m, s, d: [_T().pipeline_parallel("gpipe", 4, model=m)], mesh=lambda w: {"pp": w},
                          worlds=(2,)),
    "pp_1f1b": StackSpec(lambda m, s, d: [_T().pipeline_parallel("1f1b", 4, model=m)], mesh=lambda w: {"pp": w},
                         worlds=(2,)),
    "pp4_1f1b": StackSpec(lambda m, s, d: [_T().pipeline_parallel("1f1b", 4, model=m)], mesh=lambda w: {"pp": w},
                          worlds=(4,)),
    "pp_interleaved": StackSpec(lambda m, s, d: [_T().pipeline_parallel("interleaved", 4, model=m)],
                                mesh=lambda w: {"pp": w}, worlds=(2,)),
    "pp_zbv": StackSpec(lambda m, s, d: [_T().pipeline_parallel("zbv", 4, model=m)], mesh=lambda w: {"pp": w},
                        worlds=(2,)),
    # activation checkpointing inside the stages (the hf_ckpt models, their own, run in every
    # pipelined row too): each micro-batch's layers recomputed in its backward
    "pp_1f1b+remat": StackSpec(lambda m, s, d: [_T().pipeline_parallel("1f1b", 4, model=m), _T().remat()],
                               mesh=lambda w: {"pp": w}, worlds=(2,)),
    "zero1+pp": StackSpec(lambda m, s, d: [_T().shard_zero(1), _T().pipeline_parallel("1f1b", 2, model=m)],
                          mesh=lambda w: {"dp": w // 2, "pp": 2}, worlds=(4,)),
    # ZeRO-2/3 around the pipeline: a round of gradient buckets per micro-batch's backward;
    # small buckets, so a stage's gradients fill several and rounds matter
    "zero2+pp": StackSpec(lambda m, s, d: [_T().shard_zero(2, reduce_bucket_size=3000),
                                           _T().pipeline_parallel("1f1b", 2, model=m)],
                          mesh=lambda w: {"dp": w // 2, "pp": 2}, worlds=(4,)),
    "zero3+pp": StackSpec(lambda m, s, d: [_T().shard_zero(3, reduce_bucket_size=3000),
                                           _T().pipeline_parallel("1f1b", 2, model=m)],
                          mesh=lambda w: {"dp": w // 2, "pp": 2}, worlds=(4,)),
    # tensor parallel inside each pipeline stage (Megatron's TP x PP, x DP with ZeRO-1): a stage's
    # parameters split over its tp group, nothing on the other stages; every axis 2
    "pp+tp": StackSpec(lambda m, s, d: [_T().pipeline_parallel("1f1b", 4, model=m), _tp(m, s)],
                       mesh=lambda w: {"pp": 2, "tp": w // 2}, worlds=(4,)),
    "zero1+pp+tp": StackSpec(lambda m, s, d: [_T().shard_zero(1), _T().pipeline_parallel("1f1b", 2, model=m),
                                              _tp(m, s)],
                             mesh=lambda w: {"dp": w // 4, "pp": 2, "tp": 2}, worlds=(8,)),
    # sequence parallel (Ulysses) outside the pipeline: each sp rank's sequence slice crosses the
    # stage boundary to the same sp rank of the next stage
    "sp+pp": StackSpec(lambda m, s, d: [_T().sequence_parallel(), _T().pipeline_parallel("1f1b", 2, model=m)],
                       mesh=lambda w: {"sp": 2, "pp": w // 2}, worlds=(4,)),
    "hsdp3+tp": StackSpec(lambda m, s, d: [_T().shard_zero(3, shard_group="node"), _tp(m, s)],
                          mesh=lambda w: {"dp": w // 2, "tp": 2}, worlds=(8,), nodes=2),
}


# ---------------------------------------------------------------------------------------------
# refusals: the one list of combinations that must raise, with the error and why


@dataclasses.dataclass(frozen=True)
class Refusal:
    applies: Callable[[str, str, str], bool]       # (stack, optimizer, model)
    error: type[DsfnError]
    match: str
    why: str


def pipelined(stack: str) -> bool:
    """Whether a stack pipelines (its name has a "pp" or "pp_<schedule>" part)."""
    return any(part == "pp" or part.startswith(("pp_", "pp4_")) for part in stack.split("+"))


REFUSALS: list[Refusal] = [
    Refusal(lambda s, o, m: "tp" in s.split("+") and m == "llama+lora", ConfigError, "matches no module of PeftModel",
            "the HF tp plan names the inner model's modules; peft's wrapper (and its LoRA layers) has no plan: "
            "a clear error, not a silent replicated run"),
    Refusal(lambda s, o, m: "remat" in s and m == "batchnorm" and not pipelined(s), ConfigError,
            "no repeated blocks to checkpoint",
            "remat's default picks the model's repeated blocks; this model has none (name them: modules=[...])"),
    # before tensor parallel's: a pipeline's model is cut when the stack is built (pp+tp on the MLP)
    Refusal(lambda s, o, m: pipelined(s) and not MODELS[m].attention, ConfigError,
            "cannot find the layers", "pipeline stages are cut from the model's repeated blocks; it has none "
            "(name them: layers='...')"),
    Refusal(lambda s, o, m: "tp" in s.split("+") and MODELS[m].tp is None, ConfigError,
            "declares no tp plan", "tensor parallel needs a plan; the model has none (pass plan=...)"),
    Refusal(lambda s, o, m: s == "sp+zero3" and not MODELS[m].attention, ShapeError,
            "the batch must be a dict with 'input_ids' [batch, seq]",
            "sequence parallel splits a token sequence; the model's batches have none"),
    Refusal(lambda s, o, m: s in ("pp_interleaved", "pp_zbv", "pp4_1f1b") and MODELS[m].attention
            and MODELS[m].layers < 4, ConfigError, "fewer than the 4 stages",
            "4 stages (2 ranks x 2 virtual stages, or 4 ranks) need 4 layers; the model has 2"),
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
        return f"{self.stack} | {self.optimizer} | {self.model} | world {self.world}{self._axes(' ', ', ')}"

    @property
    def id(self) -> str:
        """A test id: stack/optimizer/model/w<world>[axis sizes], e.g. `zero1+tp/sgd/gpt/w4[dp2,tp2]`."""
        return f"{self.stack}/{self.optimizer}/{self.model}/w{self.world}{self._axes('', ',')}"

    def _axes(self, sep: str, join: str) -> str:
        sspec = STACKS[self.stack]
        axes = sspec.axes(self.world)
        if sspec.ranks_per_node(self.world):
            axes["nodes"] = sspec.nodes
        return f"{sep}[{join.join(f'{k}{sep}{n}' for k, n in axes.items())}]" if axes else ""


def cases() -> list[Case]:
    """The whole matrix (refused combinations included: they must raise)."""
    out = []
    for s, o, m in itertools.product(STACKS, OPTIMIZERS, MODELS):
        for w in STACKS[s].worlds:
            out.append(Case(s, o, m, w))
    return out


SAMPLE_SEED = 26


def default_sample(seed: int = SAMPLE_SEED) -> list[Case]:
    """The rows CI runs by default: a stratified sample of the runnable matrix, the same for a seed.

    - every stack twice, at its full world (`StackSpec.full_world`: 2, or 4 where the stack has
      two parallel axes, so each is 2): once with an SGD-momentum-family optimizer, once with an
      Adam-like one (the same stack with a scale-sensitive and a scale-blind update);
    - within a family the optimizer, and the model, are the least used so far among those the
      stack runs (ties broken by `random.Random(seed)`), so every optimizer and every model
      appears at world >= 2 (`tests/conformance/test_matrix.py` asserts it).
    Refused combinations are not drawn: each listed refusal has its own test.
    """
    rng = random.Random(seed)
    used_opt = {o: 0 for o in OPTIMIZERS}
    used_model = {m: 0 for m in MODELS}
    out = []

    def least(counts: dict[str, int], allowed: list[str]) -> str:
        low = min(counts[x] for x in allowed)
        return rng.choice([x for x in allowed if counts[x] == low])

    def draw(stack: str, family: str, world: int) -> None:
        opts = [o for o, spec in OPTIMIZERS.items() if spec.family == family
                and any(refusal(stack, o, m) is None for m in MODELS)]
        o = least(used_opt, opts)
        m = least(used_model, [m for m in MODELS if refusal(stack, o, m) is None])
        used_opt[o] += 1
        used_model[m] += 1
        out.append(Case(stack, o, m, world))
    for stack, sspec in STACKS.items():
        for family in ("sgd", "adam"):
            draw(stack, family, sspec.full_world())
        for k, world in enumerate(sspec.also_sampled):      # one more row each, the families alternating
            draw(stack, ("sgd", "adam")[(len(out) + k) % 2], world)
    return out


# ---------------------------------------------------------------------------------------------
# running a case


def _reference(case: Case) -> list:
    """The reference's transforms. A model that normalises by batch statistics (BatchNorm)
    sees, under data parallel, each rank's rows as its batch (DDP's semantics): its
    single-process reference is gradient accumulation over `world` micro-batches (times any
    accumulation in the stack), which normalises each rank's rows alone and averages the
    gradients. Buffers follow DDP's rule (rank 0's), compared in tests/test_buffers.py.
    A mixed-precision stack gets the same reference: each rank computes its rows' bf16
    gradients, as each micro-batch of the reference does (a bf16 matmul over all rows at
    once rounds differently)."""
    ref = list(STACKS[case.stack].reference())
    if not (MODELS[case.model].batch_stats or STACKS[case.stack].mixed) or case.world == 1:
        return ref
    T = _T()
    n = next((t.n for t in ref if isinstance(t, T.accumulate(1).__class__)), 1)
    return [t for t in ref if not isinstance(t, T.accumulate(1).__class__)] + [T.accumulate(n * case.world)]


def _logical(step: Any, state: Any) -> dict:
    full = step.gather(state)
    return {"params": full.params, "opt_state": full.opt_state, "step": full.step}


def _train(case: Case, tmpdir: str, transforms: bool) -> tuple[list[float], Any, Any]:
    """Train on this rank: the stack (transforms=True) or the reference; (losses, logical
    state after the last step, logical state before the first: the reference's only)."""
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
    init = None if transforms else _logical(step, state)
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
    final = _logical(step, state)
    for t in step.stack:
        if hasattr(t, "wait"):
            t.wait()
    return losses, final, init


# ---------------------------------------------------------------------------------------------
# comparing a row with its reference

FP32_RTOL = 1e-5
FP32_ATOL = 1e-6
# mixed precision: per leaf, || stack - reference ||_2 <= MP_REL * || what the reference's
# STEPS updates changed in that leaf ||_2 (+ MP_FLOOR per element, for leaves that barely move).
# The stack and its reference compute in bf16 alike; they differ only by reduction order (the
# sharded run reduces bf16 gradients over ranks, the reference sums the whole batch at once),
# which measured under 1% of the update on every row; a lost update, a 0.75 or 2x scale or a
# dropped moment moves the leaf by >= 25% of it.
MP_REL = 0.05
MP_FLOOR = 1e-6
# losses of a mixed-precision row: |loss - reference| <= MP_LOSS_RTOL * |loss| (bf16 logits;
# the reference computes the same bf16 forward)
MP_LOSS_RTOL = 5e-3
# every row's reference must move its parameters by at least this many times the tolerance:
# a row that cannot see a lost update checks nothing
MIN_RATIO = 10.0


class Verdict(str):
    """'passed' or 'refused' (compares equal to those strings), with `ratio`: how many times
    the comparison's tolerance the reference's STEPS updates moved the parameters (see
    `sensitivity`; None for a refusal)."""
    ratio: float | None = None
    worst: float | None = None     # mixed precision: the largest |stack - reference| / change of a leaf

    def __new__(cls, text: str, ratio: float | None = None, worst: float | None = None) -> "Verdict":
        v = super().__new__(cls, text)
        v.ratio, v.worst = ratio, worst
        return v


def _pairs(a: Any, b: Any, c: Any | None) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    from dsfn import tree
    la, lb = tree.leaves_with_path(a), tree.leaves_with_path(b)
    lc = dict(tree.leaves_with_path(c)) if c is not None else {}
    out = []
    for (p, x), (q, y) in zip(la, lb):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            z = lc.get(p)
            out.append((p, x.detach().double(), y.detach().double(),
                        z.detach().double() if isinstance(z, torch.Tensor) and z.shape == y.shape else None))
    return out


def sensitivity(case: Case, ref_init: dict, ref_final: dict) -> float:
    """How many times its tolerance the reference's STEPS updates moved the parameters:
    || change || / || per-element tolerance ||, over all parameters together (fp32: the
    tolerance is atol + rtol |p|; mixed precision: MP_REL of each leaf's change + MP_FLOOR)."""
    rtol = max(STACKS[case.stack].rtol, MODELS[case.model].rtol)
    change2 = tol2 = 0.0
    for _p, fin, _, ini in _pairs(ref_final["params"], ref_final["params"], ref_init["params"]):
        if ini is None:
            continue
        c = float((fin - ini).norm())
        if STACKS[case.stack].mixed:
            t = MP_REL * c + MP_FLOOR * fin.numel() ** 0.5
        else:
            t = float((FP32_ATOL + rtol * fin.abs()).norm())
        change2, tol2 = change2 + c * c, tol2 + t * t
    return (change2 / tol2) ** 0.5 if tol2 else 0.0


def compare(case: Case, rank: int, losses: list[float], state: dict, ref_losses: list[float], ref_state: dict,
            ref_init: dict) -> float | None:
    """AssertionError unless this rank's losses and final logical state match the reference.

    fp32 rows: every loss and every element of the final state (parameters, optimizer
    state, step) at rtol 1e-5 (a model's own floor where larger), atol 1e-6.
    Mixed-precision rows: losses at rtol MP_LOSS_RTOL; each leaf of the final state within
    MP_REL of what the reference's updates changed in it (L2 over the leaf). Returns, for a
    mixed-precision row, the largest measured |stack - reference| / change over the leaves."""
    sspec = STACKS[case.stack]
    rtol = max(sspec.rtol, MODELS[case.model].rtol)
    if len(losses) != len(ref_losses):
        raise AssertionError(f"{case}: rank {rank} ran {len(losses)} steps, the reference {len(ref_losses)}")
    lrt, lat = (MP_LOSS_RTOL, 0.0) if sspec.mixed else (rtol, sspec.atol)
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(ref_losses, dtype=torch.float64),
                               rtol=lrt, atol=lat,
                               msg=lambda m: f"{case}: rank {rank} losses {losses} vs reference {ref_losses}: {m}")
    if not sspec.mixed:
        assert_trees_close(state, ref_state, rtol=rtol, atol=max(sspec.atol, FP32_ATOL),
                           msg=f"{case}: rank {rank} final state vs reference")
        return None
    from dsfn import tree
    if tree.structure(state) != tree.structure(ref_state):
        assert_trees_close(state, ref_state, rtol=0, atol=0, msg=f"{case}: rank {rank} final state vs reference")
    bad, worst = [], 0.0
    for path, a, r, r0 in _pairs(state, ref_state, ref_init):
        change = float((r - (r0 if r0 is not None else torch.zeros_like(r))).norm())
        err = float((a - r).norm())
        tol = MP_REL * change + MP_FLOOR * r.numel() ** 0.5
        if change > MP_FLOOR * r.numel() ** 0.5:
            worst = max(worst, err / change)
        if not err <= tol:
            bad.append(f"  {path}: |stack - reference| {err:.3g} > {tol:.3g} "
                       f"({MP_REL:g} of the reference's change {change:.3g})")
    if bad:
        raise AssertionError(f"{case}: rank {rank} final state vs the same-precision reference: {len(bad)} leaves "
                             "differ by more than their tolerance\n" + "\n".join(bad[:10]))
    return worst


def run_case(case: Case, tmpdir: str | None = None, timeout: float = 240.0) -> Verdict:
    """Verdict 'passed' or 'refused' (the listed error was raised); AssertionError otherwise.

    A runnable row trains the reference here and the stack on `case.world` ranks for STEPS
    steps, and `compare`s every rank with the reference. It also fails when the reference's
    updates are too small for the comparison to see: `sensitivity` below MIN_RATIO."""
    tmpdir = tmpdir or tempfile.mkdtemp(prefix="dsfn-conformance-")
    why = refusal(case.stack, case.optimizer, case.model)
    if why is not None:
        try:
            run_on_ranks(_train, case.world, case, tmpdir, True, timeout=timeout,
                         ranks_per_node=STACKS[case.stack].ranks_per_node(case.world))
        except Exception as e:     # RankFailure carries the rank's error text
            text = str(e)
            assert why.error.__name__ in text and why.match in text, \
                f"{case}: expected {why.error.__name__} matching {why.match!r} ({why.why}), got: {text[:2000]}"
            return Verdict("refused")
        raise AssertionError(f"{case}: expected a refusal ({why.error.__name__}: {why.why}), but it ran")
    ref_losses, ref_state, ref_init = _train(case, tmpdir + "-ref", False)
    ratio = sensitivity(case, ref_init, ref_state)
    assert ratio >= MIN_RATIO, (f"{case}: the reference's {STEPS} updates moved a parameter leaf by only {ratio:.3g}x "
                                f"the tolerance (need >= {MIN_RATIO:g}): this row could not see a lost update")
    results = run_on_ranks(_train, case.world, case, tmpdir, True, timeout=timeout,
                           ranks_per_node=STACKS[case.stack].ranks_per_node(case.world))
    worst = [compare(case, r, losses, state, ref_losses, ref_state, ref_init)
             for r, (losses, state, _) in enumerate(results)]
    return Verdict("passed", ratio, None if worst[0] is None else max(worst))
