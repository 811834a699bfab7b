"""LAMB (You et al., 2019) with DeepSpeed's FusedLamb semantics: Adam's moments, an
elementwise update, then a per-tensor trust ratio.

Per leaf, with t = count + 1 (DeepSpeed's `fused_lamb` kernel; its pure-torch twin is
`deepspeed.ops.op_builder.npu.fused_lamb.NPUFusedLamb.lamb`):

    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = m / (sqrt(v) + eps)            (eps_inside_sqrt: m / sqrt(v + eps))
    u = u + weight_decay * p
    r = clamp(||p|| / ||u||, min_coeff, max_coeff), or 1 when either norm is 0
    p <- p - lr * c_t * r * u,   c_t = sqrt(1 - b2 ** t) / (1 - b1 ** t)  (1 without bias correction)

The moments are not bias-corrected inside `u` (c_t scales the step, as the kernel does), so
the trust ratio sees the raw moments. The norms are of the logical tensors: inside a Step,
pieces (ZeRO shards, tp slices) are combined through `dsfn.logical.reduce_leaves`, so every
rank applies the single-process ratio. No host sync: c_t is computed on tensors.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from dsfn import logical, tree
from dsfn.checks import check_real
from dsfn.optim._foreach import check_betas
from dsfn.optim.base import GradientTransformation, PyTree, chain, flatten_like, tensor_leaves, zero_count
from dsfn.optim.learning_rate import LearningRate, check_learning_rate, scale_by_learning_rate

__all__ = ["LambState", "lamb", "scale_by_lamb"]


class LambState(NamedTuple):
    """count: 0-dim int64 (updates made); mu, nu: the moments, shaped like params."""
    count: torch.Tensor
    mu: PyTree
    nu: PyTree


def scale_by_lamb(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                  bias_correction: bool = True, eps_inside_sqrt: bool = False, max_coeff: float = 10.0,
                  min_coeff: float = 0.01) -> GradientTransformation:
    """LAMB's direction `c_t * r * u` (module docstring), without the lr."""
    b1, b2 = check_betas((b1, b2), "lamb")
    eps = check_real("lamb(eps)", eps, lo=0.0, hint="; e.g. 1e-8")
    wd = check_real("lamb(weight_decay)", weight_decay, lo=0.0, hint="; use 0 for no weight decay")
    lo = check_real("lamb(min_coeff)", min_coeff, lo=0.0)
    hi = check_real("lamb(max_coeff)", max_coeff, lo=lo, hint=f"; at least min_coeff ({lo})")
    bias_correction, inside = bool(bias_correction), bool(eps_inside_sqrt)

    def init(params: PyTree) -> LambState:
        leaves, spec = tensor_leaves(params, "params")
        zeros = lambda: tree.unflatten(spec, [torch.zeros_like(x) for x in leaves])  # noqa: E731
        return LambState(zero_count(), zeros(), zeros())

    def update(updates: PyTree, state: LambState, params: PyTree = None) -> tuple[PyTree, LambState]:
        g, spec = tensor_leaves(updates, "updates")
        if not g:
            return updates, state._replace(count=state.count + 1)
        if params is None:
            raise ValueError("lamb needs params (its trust ratio is ||p|| / ||u||): call update(grads, state, params)")
        p = flatten_like(params, spec, "params")
        mu = flatten_like(state.mu, spec, "lamb state mu")
        nu = flatten_like(state.nu, spec, "lamb state nu")
        mu = torch._foreach_add(torch._foreach_mul(mu, b1), g, alpha=1.0 - b1)
        nu = torch._foreach_addcmul(torch._foreach_mul(nu, b2), g, g, value=1.0 - b2)
        denom = torch._foreach_sqrt(torch._foreach_add(nu, eps)) if inside else \
            torch._foreach_add(torch._foreach_sqrt(nu), eps)
        u = torch._foreach_div(mu, denom)
        if wd:
            u = torch._foreach_add(u, p, alpha=wd)
        ratio = _trust_ratios(u, p, updates, lo, hi)
        count = state.count + 1
        if bias_correction:
            t = count.to(torch.float64)
            c = (torch.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t)).to(u[0].dtype)
            ratio = [r * c.to(r.device) for r in ratio]
        out = torch._foreach_mul(u, ratio)
        return tree.unflatten(spec, out), LambState(count, tree.unflatten(spec, mu), tree.unflatten(spec, nu))

    return GradientTransformation(init, update)


def _trust_ratios(u: list[torch.Tensor], p: list[torch.Tensor], layout_of: PyTree, lo: float,
                  hi: float) -> list[torch.Tensor]:
    """Per leaf, clamp(||p|| / ||u||, lo, hi), or 1 where either norm is 0 (0-dim tensors;
    the norms of the logical tensors: `layout_of`'s pieces say how to combine them)."""
    pieces = logical.leaves(layout_of)
    sq = logical.reduce_leaves([x.float().square().sum() for x in p] + [x.float().square().sum() for x in u],
                               pieces + pieces)
    n = len(u)
    out = []
    for k in range(n):
        pn, un = sq[k].sqrt(), sq[n + k].sqrt()
        r = torch.where((pn > 0) & (un > 0), (pn / un).clamp(lo, hi), torch.ones_like(pn))
        out.append(r.to(u[k].dtype))
    return out


def lamb(lr: LearningRate, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
         bias_correction: bool = True, eps_inside_sqrt: bool = False, max_coeff: float = 10.0,
         min_coeff: float = 0.01) -> GradientTransformation:
    """DeepSpeed's FusedLamb (`"type": "Lamb"`): LAMB with its defaults (module docstring).

    State: `(LambState, ScaleByLearningRateState)`.
    """
    check_learning_rate(lr, "lamb")
    b1, b2 = check_betas(betas, "lamb")
    return chain(scale_by_lamb(b1, b2, eps, weight_decay, bias_correction, eps_inside_sqrt, max_coeff, min_coeff),
                 scale_by_learning_rate(lr))
