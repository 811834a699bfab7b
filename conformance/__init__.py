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
stratified subset CI runs. `conformance.mutations` lists the bugs the matrix must catch.

What is not promised: a row whose every update is normalised by a clip below the gradient
norm (`clip+sgd`, `clip+adamw`, `zero2+clip_grad_norm`) checks the global norm and is blind
to the gradient's scale by construction; each stack also runs without such a clip. Mixed
precision runs at worlds 1 and 2 only (see its StackSpec).

This package is the repository's test machinery (tests/conformance, benchmarks/conformance.py,
benchmarks/mutations.py), not part of the installed dsfn: dsfn imports none of it. Its
modules: `models`, `optimizers`, `stacks` (the matrix's axes), `matrix` (rows, refusals, the
default sample), `compare` (the tolerances and the comparison), `runner` (`run_case`), and
`mutations` (the injected bugs; imported on its own, since importing it registers a
rank-start hook). The names below are re-exported.
"""
from conformance.compare import FP32_ATOL, FP32_RTOL, MIN_RATIO, MP_FLOOR, MP_LOSS_RTOL, MP_REL, Verdict, compare, \
    sensitivity
from conformance.matrix import REFUSALS, SAMPLE_SEED, Case, Refusal, cases, default_sample, pipelined, refusal
from conformance.models import MODELS, STEPS, VOCAB, ModelSpec
from conformance.optimizers import ADAM_EPS, ADAM_WD, OPTIMIZERS, OptSpec
from conformance.runner import run_case
from conformance.stacks import STACKS, StackSpec

__all__ = ["ADAM_EPS", "ADAM_WD", "FP32_ATOL", "FP32_RTOL", "MIN_RATIO", "MODELS", "MP_FLOOR", "MP_LOSS_RTOL", "MP_REL",
           "OPTIMIZERS", "REFUSALS", "SAMPLE_SEED", "STACKS", "STEPS", "VOCAB", "Case", "ModelSpec", "OptSpec",
           "Refusal", "StackSpec", "Verdict", "cases", "compare", "default_sample", "pipelined", "refusal", "run_case",
           "sensitivity"]
