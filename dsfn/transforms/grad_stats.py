"""Layout-aware reductions over gradient trees: global norm and overflow, counted once.

A sharded leaf (`Placed` with a FlatShard/DimShard/Nested layout, possibly Offloaded)
holds a disjoint piece of its logical tensor, so its partial sums are added over the
layout's axes; a replicated leaf is counted once, as every rank holds the same values. Padding
is zero and adds nothing. The result is the single-process value on every rank.
"""
from __future__ import annotations

from typing import Any

import torch

from dsfn import tree
from dsfn.runtime import collectives as C
from dsfn.runtime.mesh import current_mesh
from dsfn.state.layout import Placed, is_placed


def shard_axes(x: Any) -> tuple[str, ...]:
    """The mesh axes a leaf is split over (() when replicated); a Nested layout (ZeRO over
    tensor parallel) is split over both."""
    return x.layout.axes() if isinstance(x, Placed) else ()


def global_sq_norm(grads: Any) -> torch.Tensor:
    """Sum of squares of every logical gradient element, float64, equal on every rank."""
    groups: dict[tuple[str, ...], list[torch.Tensor]] = {}
    for x in tree.leaves(grads, is_leaf=is_placed):
        t = x.data if isinstance(x, Placed) else x
        if t.numel():
            groups.setdefault(shard_axes(x), []).append(t)
    total = torch.zeros((), dtype=torch.float64)
    for axes, ts in sorted(groups.items()):
        part = torch.stack([n.to(torch.float64) for n in torch._foreach_norm(ts, 2)]).square().sum()
        if axes:     # the pieces are disjoint over the grid of these axes: add them over each
            part = part.reshape(1)
            for axis in axes:
                part = C.all_reduce_(part, axis, "sum")
            part = part.reshape(())
        total = total + part.cpu()
    return total


def any_nonfinite_everywhere(grads: Any) -> bool:
    """True when any rank (over every mesh axis) holds an inf/NaN gradient element."""
    leaves = [t for t in tree.leaves(grads) if t.numel()]
    local = any(not bool(torch.isfinite(n)) for n in torch._foreach_norm(leaves, float("inf"))) if leaves else False
    flag = torch.tensor([1.0 if local else 0.0])
    mesh = current_mesh()
    for axis, size in mesh.axes.items():
        if size > 1:
            C.all_reduce_(flag, axis, "max")
    return bool(flag.item() > 0)
