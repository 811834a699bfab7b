"""Gradient clipping by global norm, with `torch.nn.utils.clip_grad_norm_`'s semantics.

The norm is the norm of the logical gradients: inside a Step, pieces (ZeRO shards,
tensor-parallel slices) are combined through the `reduce_leaves` primitive
(`dsfn.logical`), so every rank clips by the single-process norm.
"""
from __future__ import annotations

import torch

from dsfn import logical, tree
from dsfn.checks import check_real
from dsfn.optim._foreach import mul_scalar
from dsfn.optim.base import EmptyState, GradientTransformation, PyTree, tensor_leaves


def global_norm(t: PyTree) -> torch.Tensor:
    """The 2-norm of all leaves viewed as one vector: a 0-dim tensor.

    Computed like torch's `clip_grad_norm_`: the norm of the per-leaf norms (on the first
    leaf's device, in the promoted dtype of the leaves). Sharded leaves count their
    logical tensor once (`dsfn.logical.global_norm`). An empty tree gives 0.
    """
    tensor_leaves(t, "tree")
    return logical.global_norm(t)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's `clip_grad_norm_` factor min(1, max_norm / (norm + 1e-6)), a tensor (no host
    sync). The one home of the clipping rule: `clip_by_global_norm` here and the
    `clip_grad_norm` transform (DeepSpeed's gradient_clipping, fused with loss_scale's
    unscale) both multiply by it."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """`u -> u * min(max_norm / (global_norm(u) + 1e-6), 1)` (no state).

    The factor is a tensor (no host sync); like torch, the updates are multiplied even
    when it is 1. Each result keeps its leaf's dtype. The norm is the logical one under
    every stack (see the module docstring).
    """
    max_norm = check_real("clip_by_global_norm(max_norm)", max_norm, lo=0.0, lo_open=True,
                          hint="; to disable clipping leave clip_by_global_norm out of the chain")

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree = None) -> tuple[PyTree, EmptyState]:
        u, spec = tensor_leaves(updates, "updates")
        if not u:
            return updates, state
        coef = clip_coefficient(logical.global_norm(updates), max_norm)
        return tree.unflatten(spec, mul_scalar(u, coef, promote=True)), state   # torch: grads.mul_(coef)

    return GradientTransformation(init, update)
