"""Pack many tensors into a few flat buffers so one collective moves them all.

`pack(tensors, bucket_bytes)` groups tensors by dtype and device, in order, into
buckets of at most `bucket_bytes` (a tensor larger than that gets a bucket of its own);
`Bucket.unpack(flat)` returns views of `flat` shaped like the originals.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
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


class FixedBuckets:
    """A fixed bucket plan over known keys, launched in plan order whatever subset arrives.

    `keys` are listed in launch order (the expected backward order: the last parameters
    first) with each tensor's shape and dtype; consecutive keys of one dtype fill
    buckets of at most `bucket_elems` elements. `add(key, t)` stores a tensor (summing a
    key that arrives again in the same round) and returns the buckets that may launch now:
    a bucket launches once all its keys arrived *and* every earlier bucket launched.
    `end_round()` returns the rest of the round's buckets, their missing keys zero-filled,
    and starts the next round.

    Every rank therefore launches every bucket once per round, in the same order, whatever
    parameters its data reached: the collectives match across ranks (a parameter no token
    reached on this rank contributes zeros), on gloo and on NCCL alike.
    """

    def __init__(self, keys: Sequence, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype],
                 bucket_elems: int, devices: Sequence[torch.device | None] | None = None,
                 sizes: Sequence[int] | None = None):
        self.keys = list(keys)
        self.shapes = dict(zip(self.keys, (tuple(x) for x in shapes)))
        # what a key weighs against bucket_elems: its element count (or `sizes`, e.g. unpadded)
        self.numels = dict(zip(self.keys, sizes)) if sizes is not None else \
            {k: math.prod(v) for k, v in self.shapes.items()}
        self.dtypes = dict(zip(self.keys, dtypes))
        self.devices = dict(zip(self.keys, devices)) if devices is not None else {}
        self.buckets: list[list] = []
        used, last_dtype = 0, None
        for k in self.keys:
            n, dt = self.numels[k], self.dtypes[k]
            if not self.buckets or dt != last_dtype or used + n > max(1, int(bucket_elems)):
                self.buckets.append([])
                used = 0
            self.buckets[-1].append(k)
            used, last_dtype = used + n, dt
        self.bucket_of = {k: b for b, ks in enumerate(self.buckets) for k in ks}
        self._round: dict = {}
        self._next = 0

    def __contains__(self, key: object) -> bool:
        return key in self.bucket_of

    def add(self, key: object, t: torch.Tensor) -> list[list[tuple[object, torch.Tensor]]]:
        return self.add_many([(key, t)])

    def add_many(self, items: Sequence[tuple[object, torch.Tensor]]) -> list[list[tuple[object, torch.Tensor]]]:
        """`add` of several keys at once (a unit's gradients): the buckets that may launch now."""
        for key, t in items:
            prev = self._round.get(key)
            if key in self._round and self.bucket_of[key] < self._next:    # its bucket already went this round
                raise RuntimeError(f"gradient of {key!r} arrived after its bucket was reduced; it belongs to "
                                   "the next round (end_round was not called between two backward passes)")
            self._round[key] = t if prev is None else prev + t
        return self._ready(fill=False)

    def end_round(self) -> list[list[tuple[object, torch.Tensor]]]:
        out = self._ready(fill=True)
        self._round, self._next = {}, 0
        return out

    def _ready(self, fill: bool) -> list[list[tuple[object, torch.Tensor]]]:
        out = []
        while self._next < len(self.buckets):
            ks = self.buckets[self._next]
            if not fill and any(k not in self._round for k in ks):
                break
            like = next((self._round[k] for k in ks if k in self._round), None)
            out.append([(k, self._round[k] if k in self._round else self._zeros(k, like)) for k in ks])
            for k in ks:         # launched: keep the key (a late arrival is an error), drop the tensor
                self._round[k] = None
            self._next += 1
        return out

    def _zeros(self, key: object, like: torch.Tensor | None) -> torch.Tensor:
        # where the gradient would have been: its bucket's other members, else the parameter's device
        device = like.device if like is not None else self.devices.get(key)
        return torch.zeros(self.shapes[key], dtype=self.dtypes[key], device=device)


def backward_order(named: Sequence[tuple[object, torch.Tensor]]) -> list[object]:
    """Keys in the order backward produces their gradients, as far as it is known before
    the first step: the reverse of the parameters' registration order (DDP's initial
    bucket order). Only the bucket boundaries depend on it, never the result."""
    return [k for k, _ in reversed(list(named))]


class OverlappedAllReduce:
    """All-reduce gradients in buckets while backward still runs (DDP's overlap).

    `named` lists the parameters that may get a gradient, `(key, tensor)` in registration
    order (a tensor of the gradient's shape and dtype; `devices` gives where each lives, for
    the zeros of an untouched one). `add(key, grad)` queues a gradient
    as autograd produces it; buckets of a fixed plan (`FixedBuckets`, about `bucket_bytes`
    each) are launched asynchronously as soon as they are complete, in plan order.
    `finish()` launches the rest (zeros for parameters that took no part in this rank's
    loss), waits, and returns {key: reduced} (views into the buckets) for every key.
    """

    def __init__(self, axis: str, bucket_bytes: int, op: str, named: Sequence[tuple[object, torch.Tensor]],
                 devices: dict | None = None):
        from dsfn.runtime import collectives as C
        self._C, self.axis, self.op = C, axis, op
        named = list(named)
        self.shapes = {k: tuple(t.shape) for k, t in named}
        order = backward_order(named)
        by_key = dict(named)
        elem = max((by_key[k].element_size() for k in order), default=4)
        self.plan = FixedBuckets(order, [(by_key[k].numel(),) for k in order], [by_key[k].dtype for k in order],
                                 max(1, bucket_bytes // elem), [(devices or {}).get(k) for k in order])
        self._inflight: list[tuple[list[tuple[object, int]], object]] = []

    def add(self, key: object, grad: torch.Tensor) -> None:
        self._launch(self.plan.add(key, grad.reshape(-1)))

    def _launch(self, buckets: list) -> None:
        for items in buckets:
            flat = torch.cat([g for _, g in items]) if len(items) > 1 else items[0][1].clone()
            self._inflight.append(([(k, g.numel()) for k, g in items],
                                   self._C.all_reduce_(flat, self.axis, self.op, async_op=True)))

    def finish(self) -> dict:
        self._launch(self.plan.end_round())
        out = {}
        for items, pending in self._inflight:
            flat = pending.wait()
            for (key, n), piece in zip(items, flat.split([n for _, n in items])):
                out[key] = piece.view(self.shapes[key])
        self._inflight = []
        return out


def all_reduce_buckets(tensors: Sequence[torch.Tensor], axis: str, bucket_bytes: int,
                       op: str | None, wire_dtype: torch.dtype | None = None,
                       keep_dtype: bool = False) -> list[torch.Tensor]:
    """Reduce (op="avg"/"sum") or broadcast from index 0 (op=None) a list of tensors in buckets.

    All buckets are launched before any is waited on, so transfers pipeline.
    Returns new tensors; the inputs are not modified. `wire_dtype`: floating tensors travel
    (and are reduced) in that dtype, and come back in it, or in their own with `keep_dtype`.
    """
    from dsfn.runtime import collectives as C     # collectives imports this module
    tensors = list(tensors)
    if wire_dtype is not None:
        wired = [t.to(wire_dtype) if t.is_floating_point() else t for t in tensors]
        out = all_reduce_buckets(wired, axis, bucket_bytes, op)
        return [o.to(t.dtype) if keep_dtype else o for o, t in zip(out, tensors)]
    buckets = pack(tensors, bucket_bytes)
    pending = []
    for b in buckets:
        flat = b.flatten(tensors)
        if op is None:
            pending.append(C.broadcast_(flat, axis, 0, async_op=True))
        else:
            pending.append(C.all_reduce_(flat, axis, op, async_op=True))
    return reassemble(len(tensors), buckets, [p.wait() for p in pending])
