"""All-gathers of `FlatShard` pieces that make new full tensors: stage 1/2's bucketed
`all_gather_full` (one all-gather per bucket, each tensor copied out of it: `GatherHandle`)
and MiCS's two-stage `hierarchical_all_gather` over nodes, which `dsfn.runtime.flat`'s
gathers into buffers use across nodes."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dsfn.runtime import collectives as C
from dsfn.runtime.mesh import current_mesh


class GatherHandle:
    """In-flight bucketed all-gathers; `wait()` returns the full tensors in input order."""

    def __init__(self, n: int, shapes: Sequence[tuple[int, ...]], count: int):
        self.n, self.shapes = n, shapes
        self._out: list[torch.Tensor | None] = [None] * count
        self._inflight: list[tuple[list[tuple[int, int]], C.Pending]] = []

    def wait(self) -> list[torch.Tensor]:
        for items, pending in self._inflight:
            rows = pending.wait().view(self.n, -1)
            offset = 0
            for i, c in items:
                numel = math.prod(self.shapes[i])
                self._out[i] = rows[:, offset:offset + c].reshape(-1)[:numel].reshape(self.shapes[i])
                offset += c
        self._inflight = []
        return self._out  # type: ignore[return-value]


def all_gather_full(shards: Sequence[torch.Tensor], shapes: Sequence[tuple[int, ...]], axis: str,
                    bucket_elems: int, async_op: bool = False):
    """Inverse of the reduce-scatter: full tensors of `shapes` from every rank's shards.

    Shards are grouped by dtype and packed into buckets of at most `bucket_elems`
    elements, one all-gather each. Returns the list, or a `GatherHandle` with `async_op`.
    """
    n = current_mesh().size(axis)
    shards = [s.detach() for s in shards]      # collectives write outside autograd
    handle = GatherHandle(n, shapes, len(shards))
    order = sorted(range(len(shards)), key=lambda i: str(shards[i].dtype))   # stable: keeps order per dtype
    bucket: list[int] = []

    def flush() -> None:
        if not bucket:
            return
        flat = torch.cat([shards[i].reshape(-1) for i in bucket]) if len(bucket) > 1 else shards[bucket[0]].reshape(-1)
        handle._inflight.append(([(i, shards[i].numel()) for i in bucket], C.all_gather(flat, axis, async_op=True)))
        bucket.clear()

    used = 0
    for i in order:
        if bucket and (shards[i].dtype != shards[bucket[0]].dtype or used + shards[i].numel() > bucket_elems):
            flush()
            used = 0
        bucket.append(i)
        used += shards[i].numel()
    flush()
    return handle if async_op else handle.wait()


def hierarchical_all_gather(outs: list[torch.Tensor], ins: list[torch.Tensor], cross: str, local: str) -> C.Pending:
    """The all-gather of `ins` over a group of S nodes x L ranks (node-major: group rank
    b*L + j is node b's j-th), in two stages: over `cross` (S ranks, one per node, the same j)
    then over `local` (the L ranks of this node); each `outs[k]` receives the S*L pieces in
    group-rank order, as a flat all-gather writes them. Every node brings the same bytes
    across its boundary as a flat ring would, in S-1 network hops instead of S*L-1, through
    one NIC per rank. Completed when it returns (a Pending for `FlatGather`)."""
    m = current_mesh()
    nodes, per = m.size(cross), m.size(local)
    mid = [torch.empty(nodes * t.numel(), dtype=t.dtype, device=t.device) for t in ins]
    C.all_gather_into_(mid, list(ins), cross)                  # [b]: node b's piece at my place j
    full = [torch.empty(per * x.numel(), dtype=x.dtype, device=x.device) for x in mid]
    C.all_gather_into_(full, mid, local)                       # [j][b]: every place of every node
    for out, f, t in zip(outs, full, ins):
        c = t.numel()
        out.view(nodes, per, c).copy_(f.view(per, nodes, c).transpose(0, 1))
    return C.Pending(None, outs)
