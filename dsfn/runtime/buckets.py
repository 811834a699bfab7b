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
