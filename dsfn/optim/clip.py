"""Gradient clipping by global norm, with `torch.nn.utils.clip_grad_norm_`'s semantics."""
from __future__ import annotations

import torch

from dsfn import tree
from dsfn.optim._foreach import check_real, mul_scalar
from dsfn.optim.base import EmptyState, GradientTransformation, PyTree, tensor_leaves


def global_norm(t: PyTree) -> torch.Tensor:
    """The 2-norm of all leaves viewed as one vector: a 0-dim tensor.

    Computed like torch's `clip_grad_norm_`: the norm of the per-leaf norms (on the first
    leaf's device, in the promoted dtype of the leaves). An empty tree gives 0.
    """
    leaves, _ = tensor_leaves(t, "tree")
    return _norm_of(leaves)


def _norm_of(leaves: list[torch.Tensor]) -> torch.Tensor:
    if not leaves:
        return torch.zeros(())
    first = leaves[0].device
    norms = torch._foreach_norm(leaves, 2)
    return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """`u -> u * min(max_norm / (global_norm(u) + 1e-6), 1)` (no state).

    The factor is a tensor (no host sync); like torch, the updates are multiplied even
    when it is 1. Each result keeps its leaf's dtype.
    """
    max_norm = check_real("clip_by_global_norm(max_norm)", max_norm, lo=0.0, lo_open=True,
                          hint="; to disable clipping leave clip_by_global_norm out of the chain")

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree = None) -> tuple[PyTree, EmptyState]:
        u, spec = tensor_leaves(updates, "updates")
        if not u:
            return updates, state
        coef = torch.clamp(max_norm / (_norm_of(u) + 1e-6), max=1.0)
        return tree.unflatten(spec, mul_scalar(u, coef, promote=True)), state   # torch: grads.mul_(coef)

    return GradientTransformation(init, update)
