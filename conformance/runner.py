"""Running a conformance row: `run_case(case)` trains the single-process reference here and the
stack on `case.world` gloo ranks (`dsfn.testing.ranks.run_on_ranks`), checks a listed refusal
raises its error, and compares every rank with the reference (`conformance.compare`).
"""
from __future__ import annotations

import os
import tempfile
from typing import Any

import dsfn
from dsfn.testing.ranks import run_on_ranks

from conformance.compare import MIN_RATIO, Verdict, compare, sensitivity
from conformance.matrix import Case, refusal
from conformance.models import MODELS, STEPS
from conformance.optimizers import OPTIMIZERS
from conformance.stacks import STACKS


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
    import dsfn.transforms as T
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
    need = STACKS[case.stack].min_ratio or MIN_RATIO
    assert ratio >= need, (f"{case}: the reference's {STEPS} updates moved a parameter leaf by only {ratio:.3g}x "
                           f"the tolerance (need >= {need:g}): this row could not see a lost update")
    results = run_on_ranks(_train, case.world, case, tmpdir, True, timeout=timeout,
                           ranks_per_node=STACKS[case.stack].ranks_per_node(case.world))
    worst = [compare(case, r, losses, state, ref_losses, ref_state, ref_init)
             for r, (losses, state, _) in enumerate(results)]
    return Verdict("passed", ratio, None if worst[0] is None else max(worst))
