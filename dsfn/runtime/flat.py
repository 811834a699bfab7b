"""Bucketed collectives between full tensors and their `FlatShard` pieces (ZeRO's traffic).

A full tensor of `numel` elements over an axis of size n is zero-padded to n*c elements
(c = ceil(numel / n)) and viewed as [n, c]: row r is rank r's shard. A bucket of several
tensors is the concatenation of those views along dim 1, [n, sum(c_i)], so one
reduce-scatter (or all-gather) of the flattened bucket moves every tensor in it and each
rank's row holds its shards back to back.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from dsfn.runtime import collectives as C
from dsfn.runtime.mesh import current_mesh


def padded_rows(full: torch.Tensor, n: int) -> torch.Tensor:
    """`full` flattened, zero-padded and viewed as [n, ceil(numel / n)]."""
    flat = full.reshape(-1)
    c = -(-flat.numel() // n)
    if flat.numel() < n * c:
        flat = torch.cat([flat, flat.new_zeros(n * c - flat.numel())])
    return flat.view(n, c)


class ShardReducer:
    """Reduce-scatter full gradients into this rank's shards, in buckets, asynchronously.

    `add(i, grad)` queues gradient i (full tensor); a bucket is launched once it holds
    `bucket_elems` elements. `finish()` launches the rest, waits, and returns
    {i: shard} (each shard [c_i], reduced with `op` over `axis`). Adding the same i again
    (a later micro-batch) sums into its shard. Buckets are launched in the order the
    gradients arrive, which autograd makes identical on every rank.
    """

    def __init__(self, axis: str, bucket_elems: int, op: str = "avg", dtype: torch.dtype | None = None):
        self.axis, self.bucket_elems, self.op, self.dtype = axis, max(1, int(bucket_elems)), op, dtype
        self.n = current_mesh().size(axis)
        self._queue: list[tuple[int, torch.Tensor]] = []
        self._queued = 0
        self._inflight: list[tuple[list[tuple[int, int]], C.Pending]] = []
        self.shards: dict[int, torch.Tensor] = {}

    def add(self, i: int, grad: torch.Tensor) -> None:
        if self.dtype is not None and grad.dtype != self.dtype:
            grad = grad.to(self.dtype)
        self._queue.append((i, padded_rows(grad, self.n)))
        self._queued += grad.numel()
        if self._queued >= self.bucket_elems:
            self._launch()

    def _launch(self) -> None:
        if not self._queue:
            return
        by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
        for i, rows in self._queue:
            by_dtype.setdefault(rows.dtype, []).append((i, rows))
        for items in by_dtype.values():
            bucket = torch.cat([rows for _, rows in items], dim=1) if len(items) > 1 else items[0][1]
            pending = C.reduce_scatter(bucket.reshape(-1), self.axis, self.op, async_op=True)
            self._inflight.append(([(i, rows.shape[1]) for i, rows in items], pending))
        self._queue, self._queued = [], 0

    def finish(self) -> dict[int, torch.Tensor]:
        self._launch()
        for items, pending in self._inflight:
            row = pending.wait()
            for (i, c), piece in zip(items, row.split([c for _, c in items])):
                # views of the bucket's row (a fresh tensor of exactly the shards' size)
                self.shards[i] = piece if i not in self.shards else self.shards[i] + piece
        self._inflight = []
        return self.shards


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
