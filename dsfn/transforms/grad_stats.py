"""Layout-aware reductions over gradient trees: global norm and overflow, counted once.

A sharded leaf (`Placed` with a FlatShard/DimShard layout, possibly Offloaded) holds a
disjoint piece of its logical tensor, so its partial sums are added over the layout's
axis; a replicated leaf is counted once, as every rank holds the same values. Padding
is zero and adds nothing. The result is the single-process value on every rank.
"""
from __future__ import annotations

from typing import Any

import torch

from dsfn import tree
from dsfn.runtime import collectives as C
from dsfn.runtime.mesh import current_mesh
from dsfn.state.layout import DimShard, FlatShard, Offloaded, Placed, is_placed


def shard_axis(x: Any) -> str | None:
    """The mesh axis a leaf is split over (None when replicated)."""
    if not isinstance(x, Placed):
        return None
    layout = x.layout
    while isinstance(layout, Offloaded):
        layout = layout.inner
    return layout.axis if isinstance(layout, (FlatShard, DimShard)) else None


def global_sq_norm(grads: Any) -> torch.Tensor:
    """Sum of squares of every logical gradient element, float64, equal on every rank."""
    groups: dict[str | None, list[torch.Tensor]] = {}
    for x in tree.leaves(grads, is_leaf=is_placed):
        t = x.data if isinstance(x, Placed) else x
        if t.numel():
            groups.setdefault(shard_axis(x), []).append(t)
    total = torch.zeros((), dtype=torch.float64)
    for axis, ts in sorted(groups.items(), key=lambda kv: str(kv[0])):
        part = torch.stack([n.to(torch.float64) for n in torch._foreach_norm(ts, 2)]).square().sum()
        if axis is not None:
            part = C.all_reduce_(part.reshape(1), axis, "sum").reshape(())
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
