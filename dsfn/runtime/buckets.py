"""Pack many tensors into a few flat buffers so one collective moves them all.

`pack(tensors, bucket_bytes)` groups tensors by dtype and device, in order, into
buckets of at most `bucket_bytes` (a tensor larger than that gets a bucket of its own);
`Bucket.unpack(flat)` returns views of `flat` shaped like the originals.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Bucket:
    indices: list[int]              # positions in the original list
    shapes: list[torch.Size]

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([tensors[i].reshape(-1) for i in self.indices])

    def unpack(self, flat: torch.Tensor) -> list[torch.Tensor]:
        sizes = [math.prod(s) for s in self.shapes]
        return [piece.view(shape) for piece, shape in zip(flat.split(sizes), self.shapes)]


def pack(tensors: list[torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    buckets: list[Bucket] = []
    open_: dict[tuple, tuple[Bucket, int]] = {}
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        b, used = open_.get(key, (None, 0))
        if b is None or used + nbytes > bucket_bytes:
            b, used = Bucket([], []), 0
            buckets.append(b)
        b.indices.append(i)
        b.shapes.append(t.shape)
        open_[key] = (b, used + nbytes)
    return buckets


def reassemble(n: int, buckets: list[Bucket], flats: list[torch.Tensor]) -> list[torch.Tensor]:
    """The list of n tensors rebuilt from each bucket's (reduced) flat buffer."""
    out: list[torch.Tensor | None] = [None] * n
    for b, flat in zip(buckets, flats):
        for i, t in zip(b.indices, b.unpack(flat)):
            out[i] = t
    return out  # type: ignore[return-value]


class OverlappedAllReduce:
    """All-reduce gradients in buckets while backward still runs (DDP's overlap).

    `add(key, grad)` queues a gradient as autograd produces it; once the queue holds
    `bucket_bytes` (per dtype) a bucket is flattened and its all-reduce launched
    asynchronously. `finish()` launches the rest, waits, and returns {key: reduced}
    (views into the buckets). Autograd produces gradients in the same order on every
    rank, so buckets match across ranks.
    """

    def __init__(self, axis: str, bucket_bytes: int, op: str = "avg"):
        from dsfn.runtime import collectives as C
        self._C, self.axis, self.bucket_bytes, self.op = C, axis, bucket_bytes, op
        self._queue: dict[torch.dtype, list[tuple[object, torch.Tensor]]] = {}
        self._queued: dict[torch.dtype, int] = {}
        self._inflight: list[tuple[list[tuple[object, torch.Tensor]], object]] = []

    def add(self, key: object, grad: torch.Tensor) -> None:
        q = self._queue.setdefault(grad.dtype, [])
        q.append((key, grad))
        self._queued[grad.dtype] = self._queued.get(grad.dtype, 0) + grad.numel() * grad.element_size()
        if self._queued[grad.dtype] >= self.bucket_bytes:
            self._launch(grad.dtype)

    def _launch(self, dtype: torch.dtype) -> None:
        items = self._queue.pop(dtype, [])
        self._queued[dtype] = 0
        if items:
            flat = torch.cat([g.reshape(-1) for _, g in items])
            self._inflight.append((items, self._C.all_reduce_(flat, self.axis, self.op, async_op=True)))

    def finish(self) -> dict:
        for dtype in list(self._queue):
            self._launch(dtype)
        out = {}
        for items, pending in self._inflight:
            flat = pending.wait()
            for (key, g), piece in zip(items, flat.split([g.numel() for _, g in items])):
                out[key] = piece.view(g.shape)
        self._inflight = []
        return out
