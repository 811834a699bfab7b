"""Comparing a conformance row with its single-process reference: the tolerances (fp32 rows
at rtol 1e-5; mixed-precision rows within `MP_REL` of what the reference's updates changed,
quantized-communication rows within their StackSpec's `update_rel` of it),
`compare` (AssertionError on a mismatch), `sensitivity` (how many times its tolerance the
reference moved the parameters; a row needs `MIN_RATIO`) and the `Verdict` of a row.
"""
from __future__ import annotations

from typing import Any

import torch

from dsfn.testing.asserts import assert_trees_close

from conformance.matrix import Case
from conformance.models import MODELS
from conformance.optimizers import OPTIMIZERS
from conformance.stacks import STACKS

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


def _atol(case: Case) -> float:
    """The fp32 state comparison's absolute floor: FP32_ATOL, or the optimizer's where larger."""
    return max(FP32_ATOL, OPTIMIZERS[case.optimizer].atol)


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
        if STACKS[case.stack].mixed or STACKS[case.stack].update_rel:
            t = (STACKS[case.stack].update_rel or MP_REL) * c + MP_FLOOR * fin.numel() ** 0.5
        else:
            t = float((_atol(case) + rtol * fin.abs()).norm())
        change2, tol2 = change2 + c * c, tol2 + t * t
    return (change2 / tol2) ** 0.5 if tol2 else 0.0


def compare(case: Case, rank: int, losses: list[float], state: dict, ref_losses: list[float], ref_state: dict,
            ref_init: dict) -> float | None:
    """AssertionError unless this rank's losses and final logical state match the reference.

    fp32 rows: every loss and every element of the final state (parameters, optimizer
    state, step) at rtol 1e-5 (a model's own floor where larger), atol 1e-6 (an optimizer's
    own floor where larger: Muon's 1e-5).
    Mixed-precision rows: losses at rtol MP_LOSS_RTOL; each leaf of the final state within
    MP_REL of what the reference's updates changed in it (L2 over the leaf). Returns, for a
    mixed-precision row, the largest measured |stack - reference| / change over the leaves."""
    sspec = STACKS[case.stack]
    rtol = max(sspec.rtol, MODELS[case.model].rtol)
    if len(losses) != len(ref_losses):
        raise AssertionError(f"{case}: rank {rank} ran {len(losses)} steps, the reference {len(ref_losses)}")
    lrt, lat = (MP_LOSS_RTOL, 0.0) if sspec.mixed else (rtol, sspec.atol)
    by_update = sspec.mixed or sspec.update_rel is not None
    rel = sspec.update_rel or MP_REL
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(ref_losses, dtype=torch.float64),
                               rtol=lrt, atol=lat,
                               msg=lambda m: f"{case}: rank {rank} losses {losses} vs reference {ref_losses}: {m}")
    if not by_update:
        assert_trees_close(state, ref_state, rtol=rtol, atol=max(sspec.atol, _atol(case)),
                           msg=f"{case}: rank {rank} final state vs reference")
        return None
    from dsfn import tree
    if tree.structure(state) != tree.structure(ref_state):
        assert_trees_close(state, ref_state, rtol=0, atol=0, msg=f"{case}: rank {rank} final state vs reference")
    bad, worst = [], 0.0
    for path, a, r, r0 in _pairs(state, ref_state, ref_init):
        change = float((r - (r0 if r0 is not None else torch.zeros_like(r))).norm())
        err = float((a - r).norm())
        tol = rel * change + MP_FLOOR * r.numel() ** 0.5
        if change > MP_FLOOR * r.numel() ** 0.5:
            worst = max(worst, err / change)
        if not err <= tol:
            bad.append(f"  {path}: |stack - reference| {err:.3g} > {tol:.3g} "
                       f"({rel:g} of the reference's change {change:.3g})")
    if bad:
        raise AssertionError(f"{case}: rank {rank} final state vs the same-precision reference: {len(bad)} leaves "
                             "differ by more than their tolerance\n" + "\n".join(bad[:10]))
    return worst
