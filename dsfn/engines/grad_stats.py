"""Layout-aware reductions over gradient trees: global norm and overflow, counted once.

A sharded leaf (`Placed` with a FlatShard/DimShard/Nested layout, possibly Offloaded)
holds a disjoint piece of its logical tensor, so its partial sums are added over the
layout's axes; a replicated leaf is counted once, as every rank holds the same values. Padding
is zero and adds nothing. The result is the single-process value on every rank.
"""
from __future__ import annotations

import math

from typing import Any

import torch

from dsfn import tree
from dsfn.logical import reduce_leaves
from dsfn.runtime import collectives as C
from dsfn.runtime.mesh import current_mesh
from dsfn.state.layout import Placed, is_placed


def global_sq_norm(grads: Any) -> torch.Tensor:
    """Sum of squares of every logical gradient element, float64, equal on every rank.

    Per-leaf partial sums go through the `reduce_leaves` primitive (`dsfn.logical`), which
    the transforms owning the leaves' axes answer: one mechanism for this transform's
    clipping and an optimizer's `clip_by_global_norm`."""
    # every leaf with logical elements takes part, on every rank alike (the reduction is
    # collective): a rank's piece may be empty (a pipeline stage's StageOwned non-owner)
    xs = [x for x in tree.leaves(grads, is_leaf=is_placed)
          if (math.prod(x.layout.shape) if isinstance(x, Placed) and hasattr(x.layout, "shape") else
              (x.data if isinstance(x, Placed) else x).numel())]
    if not xs:
        return torch.zeros((), dtype=torch.float64)
    norms = torch._foreach_norm([x.data if isinstance(x, Placed) else x for x in xs], 2)
    parts = reduce_leaves([n.to(torch.float64).square() for n in norms], xs, "sum")
    # summed on the device (host parts, e.g. offloaded leaves, are copied there non-blocking):
    # reading each part on the host would be one device sync per leaf
    home = _device_of(parts)
    return torch.stack([p.reshape(()).to(home, non_blocking=True) for p in parts]).sum()


def _device_of(ts: list[torch.Tensor]) -> torch.device:
    """Where a reduction of `ts` runs without a host read: the first non-CPU device, else the CPU
    (moving host values to a device never waits for it; the other way round would)."""
    return next((t.device for t in ts if t.device.type != "cpu"), torch.device("cpu"))


def reduce_over_axis(partials: list[torch.Tensor], pending: list[tuple[str, ...]], axis: str,
                     op: str) -> tuple[list[torch.Tensor], list[tuple[str, ...]]]:
    """A transform's answer to the `reduce_leaves` primitive for the mesh axis it owns: the
    partials of the leaves still split over `axis` are combined over it (one all-reduce of
    all of them, in float64), and `axis` is struck from their pending axes."""
    idx = [k for k, axes in enumerate(pending) if axis in axes]
    if not idx:
        return partials, pending
    out, left = list(partials), list(pending)
    if current_mesh().size(axis) > 1:
        device = partials[idx[0]].device
        flat = [partials[k].detach().reshape(-1).to(device, torch.float64) for k in idx]
        vec = C.all_reduce_(torch.cat(flat), axis, op)
        for k, piece in zip(idx, vec.split([f.numel() for f in flat])):
            out[k] = piece.reshape(partials[k].shape).to(partials[k].device, partials[k].dtype)
    for k in idx:
        left[k] = tuple(a for a in pending[k] if a != axis)
    return out, left


def any_nonfinite_everywhere(grads: Any) -> bool:
    """True when any rank (over every mesh axis) holds an inf/NaN gradient element."""
    leaves = [t for t in tree.leaves(grads) if t.numel()]
    # one flag for all leaves, made and all-reduced on the device: a single host read per step
    # (a bool() per leaf would wait for the device once per gradient tensor)
    if leaves:
        home = _device_of(leaves)
        norms = [n.to(home, non_blocking=True) for n in torch._foreach_norm(leaves, float("inf"))]
        flag = (~torch.stack(norms).isfinite()).any().to(torch.float32).reshape(1)
    else:
        flag = torch.zeros(1)
    mesh = current_mesh()
    for axis, size in mesh.axes.items():
        if size > 1:
            C.all_reduce_(flag, axis, "max")
    return bool(flag.item() > 0)
