"""Bucketed collectives between full tensors and their `FlatShard` pieces (ZeRO's traffic).

A full tensor of `numel` elements over an axis of size n is zero-padded to n*c elements
(c = ceil(numel / n)) and viewed as [n, c]: row r is rank r's shard. A bucket of several
tensors is the concatenation of those views along dim 1, [n, sum(c_i)], so one
reduce-scatter (or all-gather) of the flattened bucket moves every tensor in it and each
rank's row holds its shards back to back.

ZeRO-3's gathers use the transposed layout (`gather_into_buffers`): each full tensor
contiguous in a flat buffer, written there by the collective itself, so the weights are
views of it; the buffers come from a `pool` (ZeRO-3: each unit's own storages, kept across
steps; `BufferPool`: buffers kept between uses, ZeRO's gradient shards).

`BufferPool` lives in `dsfn.runtime.buffer_pool`; stage 1/2's `all_gather_full` and the
two-stage `hierarchical_all_gather` in `dsfn.runtime.gathers`. This module re-exports them.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from dsfn.errors import ConfigError
from dsfn.runtime import collectives as C
from dsfn.runtime.buffer_pool import BufferPool
from dsfn.runtime.gathers import GatherHandle, all_gather_full, hierarchical_all_gather  # noqa: F401
from dsfn.runtime.mesh import current_mesh


def padded_rows(full: torch.Tensor, n: int) -> torch.Tensor:
    """`full` flattened, zero-padded and viewed as [n, ceil(numel / n)]."""
    return padded_rows_many([full], n)[0]


def padded_rows_many(fulls: Sequence[torch.Tensor], n: int) -> list[torch.Tensor]:
    """`padded_rows` of each tensor, in one Python call (a ZeRO-3 unit's gradients)."""
    out = []
    for full in fulls:
        flat = full.reshape(-1)
        c = -(-flat.numel() // n)
        if flat.numel() < n * c:
            flat = torch.cat([flat, flat.new_zeros(n * c - flat.numel())])
        out.append(flat.view(n, c))
    return out


class ShardReducer:
    """Reduce-scatter full gradients into this rank's shards, in buckets, asynchronously.

    `named` lists every key that may get a gradient, `(key, tensor)` in registration order
    (a tensor of the full gradient's shape and dtype; `devices` where each lives). The
    buckets are a fixed plan over them (`dsfn.runtime.buckets.FixedBuckets`, about
    `bucket_elems` elements each, in backward order): `add(key, grad)` queues a full
    gradient and launches every bucket that is complete, in plan order. Each forward of a
    step after the first is a new *round* (`new_round()`: a later micro-batch): the
    previous round's remaining buckets launch first, zero-filled. `finish()` does the same
    for the last round, waits, and returns {key: shard} (each [c] = ceil(numel / n),
    reduced with `op` over `axis`, summed over rounds) for every key. At most
`MAX_INFLIGHT` buckets are in flight (each holds its input of full gradients until it is
waited for), so the full gradients alive during backward stay a few buckets. Keys whose parameter
    took no part in this rank's loss contribute zeros, so every rank launches the same
    reduce-scatters in the same order whatever its data touched.

    With a `pool` (kept by the caller across steps), the first round's shards are written
    into one flat buffer per dtype, lent by the pool and lent again next step once nothing
    references this step's shards: these long-lived tensors are then the same block every
    step instead of new ones made in the middle of backward among activations (holes
    glibc cannot reuse). A bucket packed here (several tensors) is reduced in place
    (`consume`: no input-sized clone under gloo). Without a pool every shard is a fresh
    tensor. The values are bitwise the same either way.

    `dtype` is the wire dtype (None: each gradient's own). With `keep_dtype` the reduced
    shards go back to the dtype of the key's gradient (`named`) as they arrive, so rounds
    are summed there (fp32 training that communicates in bf16: DeepSpeed's
    communication_data_type); without it they stay in the wire dtype.

    With `replicate` (hybrid sharding: `axis` is a shard group, the ranks holding the same
    shard lie along `replicate`), every bucket's reduced shards are then all-reduced (with
    `op`) across `replicate`, once, at `finish()`: one shard-sized all-reduce per bucket
    (HSDP's, MiCS's second stage), issued after the last reduce-scatter so that its order
    among this rank's collectives is the program's, not backward's timing (a blocking
    all-reduce issued while a shard-group peer still waits in backward for this rank's
    all-gather could otherwise close a wait cycle across groups). `on_bucket` then runs at
    `finish()`, on the fully reduced buckets.

    `wire` (ZeRO++ qgZ, a `dsfn.runtime.quantized.WireFormat`): every floating bucket is
    reduced by `reduce_scatter_quantized` instead (its rows block-wise quantized through
    all-to-alls, each tensor on blocks of its own; `hierarchy` = (cross, local): inside the
    node first, then across nodes), synchronously as it completes; 1-D gradients exactly
    (`_reduce_quantized`); the result is cast back to the bucket's dtype.

    `on_bucket([(key, shard), ...])`, when given, is called once per reduced bucket as it
    completes (while backward still runs, for all but the last buckets), in plan order: the
    sink a caller hands in (ZeRO passes the "grad_bucket_ready" primitive, which
    `offload(overlap=True)` handles to start its host updates early).
    """

    def __init__(self, axis: str, bucket_elems: int, op: str = "avg", dtype: torch.dtype | None = None,
                 named: Sequence[tuple[Any, torch.Tensor]] = (), devices: dict | None = None,
                 pool: BufferPool | None = None, keep_dtype: bool = False,
                 on_bucket: Callable[[list[tuple[Any, torch.Tensor]]], None] | None = None,
                 replicate: str | None = None, wire: Any = None, hierarchy: tuple[str, str] | None = None):
        from dsfn.runtime.buckets import FixedBuckets, backward_order
        self.axis, self.op, self.dtype = axis, op, dtype
        self.wire, self.hierarchy = wire, hierarchy      # qgZ (`reduce_scatter_quantized`); None: exact
        self._dims = {k: t.dim() for k, t in named}     # qgZ quantizes the gradients of 2+ dims
        self.replicate = replicate if replicate is not None and current_mesh().size(replicate) > 1 else None
        self.on_bucket = on_bucket
        self.n = current_mesh().size(axis)
        named = list(named)
        by_key = dict(named)
        order = backward_order(named)
        rows = [(self.n, -(-by_key[k].numel() // self.n)) for k in order]
        self.plan = FixedBuckets(order, rows, [dtype or by_key[k].dtype for k in order], bucket_elems,
                                 [(devices or {}).get(k) for k in order], [by_key[k].numel() for k in order])
        self._inflight: list[tuple[list[tuple[Any, int]], C.Pending]] = []
        self._rounds = 0
        self.shards: dict[Any, torch.Tensor] = {}
        self.pool = pool
        # pooled layout: bucket b's shards at out_at[b] in its dtype's flat buffer (first round)
        widths = [sum(-(-by_key[k].numel() // self.n) for k in ks) for ks in self.plan.buckets]
        self._out_total: dict[torch.dtype, int] = {}
        self._out_at: list[int] = []
        for ks, w in zip(self.plan.buckets, widths):
            dt = self.plan.dtypes[ks[0]]
            self._out_at.append(self._out_total.get(dt, 0))
            self._out_total[dt] = self._out_total.get(dt, 0) + w
        self._out: dict[torch.dtype, torch.Tensor] = {}
        self._out_used: set[int] = set()
        # key -> the dtype its reduced shard goes back to (only keys whose wire dtype differs)
        self._home_dtype = {k: t.dtype for k, t in named if keep_dtype and dtype is not None and t.dtype != dtype
                            and t.is_floating_point()}

    def new_round(self) -> None:
        """A forward of the same step begins (accumulation): close the previous round."""
        if self._rounds:
            self._launch(self.plan.end_round())
        self._rounds += 1

    def add(self, key: Any, grad: torch.Tensor) -> None:
        self.add_many([(key, grad)])

    def add_many(self, items: Sequence[tuple[Any, torch.Tensor]]) -> None:
        """`add` of several gradients at once (a ZeRO-3 unit's): one Python call per unit."""
        keys, grads, known = [], [], self.plan.bucket_of
        for key, grad in items:
            if key not in known:
                raise KeyError(f"ShardReducer: {key!r} is not one of the keys it was made for")
            keys.append(key)
            grads.append(grad.to(self.dtype) if self.dtype is not None and grad.dtype != self.dtype else grad)
        self._launch(self.plan.add_many(list(zip(keys, padded_rows_many(grads, self.n)))))

    def _launch(self, buckets: list) -> None:
        for items in buckets:
            if self.wire is not None and self.n > 1 and items[0][1].is_floating_point():
                self._inflight.append(([(k, rows.shape[1]) for k, rows in items],
                                       C.Pending(None, self._reduce_quantized(items))))
            elif self.pool is None or self.n == 1:
                bucket = torch.cat([rows for _, rows in items], dim=1) if len(items) > 1 else items[0][1]
                pending = C.reduce_scatter(bucket.reshape(-1), self.axis, self.op, async_op=True)
                self._inflight.append(([(k, rows.shape[1]) for k, rows in items], pending))
            else:
                self._launch_pooled(items)
            # an in-flight reduce-scatter holds its input, a bucket of full gradients: waiting
            # for the oldest beyond MAX_INFLIGHT keeps that O(bucket), not O(model), during
            # backward (a wait issues no collective, so every rank's sequence is unchanged)
            if len(self._inflight) > self.MAX_INFLIGHT:
                self._drain(block=False, keep=self.MAX_INFLIGHT)
        if buckets:
            self._drain(block=False)          # finished ones release their inputs now

    MAX_INFLIGHT = 2

    def _reduce_quantized(self, items: list) -> torch.Tensor:
        """qgZ of one bucket (synchronous): the rows of its tensors of 2+ dims through
        `reduce_scatter_quantized`, each tensor's segment padded to whole blocks (a block never
        mixes two tensors' scales); 1-D tensors (norms, biases: small, and quantized beside a
        large neighbour they would round to zero) reduce-scattered exactly, as DeepSpeed's
        qgZ falls back for them. Returns this rank's row of the bucket, in its dtype."""
        from dsfn.runtime.quantized import reduce_scatter_quantized
        whole = self.wire.whole_blocks
        dtype = items[0][1].dtype
        quant = [(k, rows) for k, rows in items if self._dims.get(k, 2) >= 2]
        exact = [(k, rows) for k, rows in items if self._dims.get(k, 2) < 2]
        pieces: dict[Any, torch.Tensor] = {}
        if quant:
            widths = [rows.shape[1] for _, rows in quant]
            padded = torch.cat([torch.nn.functional.pad(rows, (0, whole(w) - w))
                                for (_, rows), w in zip(quant, widths)], dim=1)
            row = reduce_scatter_quantized(padded, self.axis, self.wire, self.op, self.hierarchy)
            at = 0
            for (k, _), w in zip(quant, widths):
                pieces[k] = row[at:at + w]
                at += whole(w)
        if exact:
            bucket = torch.cat([rows for _, rows in exact], dim=1) if len(exact) > 1 else exact[0][1]
            row = C.reduce_scatter(bucket.reshape(-1), self.axis, self.op)
            for (k, rows), piece in zip(exact, row.split([r.shape[1] for _, r in exact])):
                pieces[k] = piece
        return torch.cat([pieces[k].to(dtype) for k, _ in items])

    def _launch_pooled(self, items: list) -> None:
        first = items[0][1]
        width = sum(rows.shape[1] for _, rows in items)
        if len(items) > 1:     # packed here: the reduce-scatter may overwrite it
            bucket = torch.cat([rows for _, rows in items], dim=1)
        else:
            bucket = items[0][1]
        b = self.plan.bucket_of[items[0][0]]
        out = None
        # a later round's shards are summed into the first's: those are fresh tensors
        if b not in self._out_used and self.plan.dtypes[items[0][0]] == first.dtype:
            flat = self._out.get(first.dtype)
            if flat is None:
                flat = self._out[first.dtype] = self.pool.take_lent(self._out_total[first.dtype], first.dtype,
                                                                    first.device)
            if flat.device == first.device:
                out = flat[self._out_at[b]:self._out_at[b] + width]
                self._out_used.add(b)
        pending = C.reduce_scatter(bucket.reshape(-1), self.axis, self.op, async_op=True, out=out,
                                   consume=len(items) > 1)
        self._inflight.append(([(k, rows.shape[1]) for k, rows in items], pending))

    def _drain(self, block: bool, keep: int | None = None) -> None:
        """Collect finished buckets, oldest first (all of them with `block`; with `keep`,
        wait until at most `keep` remain in flight)."""
        while self._inflight:
            items, pending = self._inflight[0]
            must = block or (keep is not None and len(self._inflight) > keep)
            if not must and not pending.done():
                return
            self._inflight.pop(0)
            row = pending.wait()
            home = self._home_dtype
            for (i, c), piece in zip(items, row.split([c for _, c in items])):
                if home:
                    piece = piece.to(home.get(i, piece.dtype))
                # views of the bucket's row (a fresh tensor of exactly the shards' size)
                self.shards[i] = piece if i not in self.shards else self.shards[i] + piece
            if self.on_bucket is not None and self.replicate is None:
                self.on_bucket([(i, self.shards[i]) for i, _ in items])

    def finish(self) -> dict[Any, torch.Tensor]:
        self._launch(self.plan.end_round())
        self._drain(block=True)
        if self.replicate is not None:
            self._reduce_across()
        return self.shards

    def _reduce_across(self) -> None:
        """Hybrid sharding: each bucket's shards all-reduced across the replicate axis (one
        call per bucket, all in flight at once, in plan order), in the wire dtype. Under qgZ
        (`wire`) the shards of 2+-dim gradients cross quantized instead, each on blocks of
        its own (`all_reduce_quantized`); 1-D ones exactly, as inside the group."""
        done = self._reduce_across_quantized() if self.wire is not None else set()
        pending = []
        for keys in self.plan.buckets:
            rest = [k for k in keys if k not in done]
            p = None
            if rest:
                parts = [self.shards[k] for k in rest]
                flat = torch.cat([t.reshape(-1) for t in parts]) if len(parts) > 1 else parts[0].reshape(-1).clone()
                wire = flat if self.dtype is None or flat.dtype == self.dtype else flat.to(self.dtype)
                p = C.all_reduce_(wire, self.replicate, self.op, async_op=True)
            pending.append((keys, rest, p))
        for keys, rest, p in pending:
            if p is not None:
                flat = p.wait()
                parts = [self.shards[k] for k in rest]
                for k, part, piece in zip(rest, parts, flat.split([t.numel() for t in parts])):
                    self.shards[k] = piece.view(part.shape).to(part.dtype)
            if self.on_bucket is not None:
                self.on_bucket([(k, self.shards[k]) for k in keys])

    def _reduce_across_quantized(self) -> set:
        """qgZ across replicas: the shards of 2+-dim gradients, each quantized on its own;
        the keys it reduced."""
        from dsfn.runtime.quantized import all_reduce_quantized
        done = set()
        for keys in self.plan.buckets:
            for k in keys:
                part = self.shards[k]
                if self._dims.get(k, 1) >= 2 and part.is_floating_point():
                    self.shards[k] = all_reduce_quantized(part, self.replicate, self.wire, self.op).to(part.dtype)
                    done.add(k)
        return done


class FlatGather:
    """In-flight all-gathers of several shards, each straight into a flat buffer (`slabs`).

    Buffer layout: a bucket's tensors back to back, tensor i taking n * c_i elements
    (c_i = its shard's numel; the tensor's own numel, then its zero padding), so the full
    tensor i is the contiguous view `slabs[slab_of[i]][at_i : at_i + numel_i].view(shape_i)`:
    `wait()` returns these views in input order, without copying anything. Size-1 axis:
    the views are views of the shards themselves (`slabs` are the shards).

    Each bucket is one collective call (`collectives.all_gather_into_`: under NCCL one
    coalesced all-gather, one grouped kernel, whatever the number of tensors). Writes into a
    slab keep its version counter: a slab refilled with the same weights (ZeRO-3's backward
    re-gather) leaves the views autograd saved valid.
    """

    def __init__(self, views: list[tuple[int, int, tuple[int, ...]]], slabs: list[torch.Tensor], pendings: list):
        self._spec, self.slabs, self._pendings = views, slabs, pendings
        self.slab_of = [k for k, _, _ in views]
        # quantized slabs (qwZ): slab index -> its `_Dequantizing` (kept for hpZ's secondary
        # codes), and each slab's element count and dtype (`gather_into_buffers` fills them)
        self._dequant: dict[int, Any] = {}
        self._slab_numel: list[int] = []
        self._slab_dtype: list[torch.dtype] = []

    def wait(self) -> list[torch.Tensor]:
        for p in self._pendings:
            p.wait()
        self._pendings = []
        return [self.slabs[k][at:at + math.prod(shape)].view(shape) for k, at, shape in self._spec]

    def pieces_over(self, axis: str) -> list[torch.Tensor]:
        """This rank's 1/k of every slab along `axis` (size k, dividing each slab: slabs hold
        n * c elements per tensor and k divides the gather's n), copied: ZeRO++ hpZ's
        secondary shard, kept once the slabs are freed. A quantized slab's is its gathered
        codes and scales' 1/k (`_Dequantizing.codes_over`: held quantized, and backward gets
        bitwise the forward's weights). `regather` rebuilds the slabs from every rank's
        pieces. After `wait`."""
        m = current_mesh()
        k, me = m.size(axis), m.local_rank(axis)
        return [self._dequant[j].codes_over(axis) if j in self._dequant else s.view(k, -1)[me].clone()
                for j, s in enumerate(self.slabs)]

    def regather(self, pieces: list[torch.Tensor], axis: str, pool: Any) -> "FlatGather":
        """Start gathering this gather's slabs again, into buffers from `pool` (a UnitStorage:
        the same storages), from `pieces_over(axis)` of every rank along `axis`; the views
        are laid out as here. One all-gather per slab, each over `axis` only."""
        slabs, pendings = [], []
        for j, piece in enumerate(pieces):
            like = self._dequant.get(j)
            if like is not None:             # qwZ: the forward's codes, dequantized again
                buf = pool.take(self._slab_numel[j], self._slab_dtype[j], piece.device)
                version = buf._version
                pendings.append(like.regather_quantized(buf, piece, axis))
            else:
                buf = pool.take(piece.numel() * current_mesh().size(axis), piece.dtype, piece.device)
                version = buf._version
                pendings.append(C.all_gather_into_([buf], [piece], axis, async_op=True))
            torch._C._autograd._unsafe_set_version_counter((buf,), (version,))
            slabs.append(buf)
        g = FlatGather(self._spec, slabs, pendings)
        g._inputs = pieces            # alive until the gathers complete
        return g

    def release(self, pool: BufferPool | None) -> None:
        """Give the buffers back to `pool` (after `wait`; the views must be dropped by now)."""
        for p in self._pendings:
            p.wait()
        for d in self._dequant.values():      # codes kept for `pieces_over` go with the slabs
            d.drop_codes()
        slabs, self.slabs, self._pendings = self.slabs, [], []
        if pool is not None and not self._own:
            for s in slabs:
                pool.give(s)

    _own = False      # True when the slabs are the caller's shards (size-1 axis): never pooled


def gather_into_buffers(shards: Sequence[torch.Tensor], shapes: Sequence[tuple[int, ...]], axis: str,
                        bucket_elems: int, pool: BufferPool | None = None,
                        hierarchy: tuple[str, str] | None = None, wire: Any = None,
                        packed: Mapping[int, tuple[Any, torch.dtype]] | None = None,
                        keep_codes: bool = False) -> FlatGather:
    """Start all-gathering full tensors of `shapes` from every rank's `shards` (FlatShard
    pieces), each directly into its place in a flat buffer (see `FlatGather`), taken from
    `pool` when one is given. Shards are grouped by (dtype, device) and packed into buckets
    of at most `bucket_elems` shard elements: one all-gather call per bucket (every rank
    issues the same sequence: it depends only on shapes, dtypes and devices).

    Bytes made per bucket: its buffer, n * sum(c_i) — no concatenation of the shards and no
    per-tensor copy out of a gathered buffer (`all_gather_full` makes both).

    `hierarchy` = (cross, local): `axis` is a group across nodes made of `local` (its ranks
    on one node, consecutive) and `cross` (the same place on every node); each bucket is then
    gathered in two stages, across nodes first, then inside the node (MiCS's hierarchical
    all-gather, `hierarchical_all_gather`), synchronously.

    `wire` (a `dsfn.runtime.quantized.WireFormat`, ZeRO++ qwZ): the tensors it `quantizes`
    (floating, at least its `min_numel` elements) go in buckets of their own, gathered as
    block-wise codes and scales and dequantized into the buffer (`all_gather_quantized_into`);
    the others as they are. Not with `hierarchy` (those gathers stay unquantized).
    `packed` (index -> (its WireFormat, the logical dtype)): shards held quantized (ZeRO++'s
    frozen weights: `WireFormat.pack`ed pieces of ceil(numel / n) elements), gathered as
    their codes and scales whatever `wire` and `hierarchy` say. `keep_codes`: the quantized
    slabs keep their gathered codes until `release` (hpZ's secondary shard is cut from them).
    """
    n = current_mesh().size(axis)
    packed = packed or {}
    shards = [s.detach() for s in shards]      # collectives write outside autograd
    # per shard: (its logical dtype, its elements on this rank, its wire format or None)
    dtypes = [packed[i][1] if i in packed else s.dtype for i, s in enumerate(shards)]
    sizes = [-(-math.prod(shape) // n) if i in packed else s.numel() for i, (s, shape) in enumerate(zip(shards, shapes))]
    if n == 1:
        whole = [packed[i][0].unpack(s, sizes[i], dtypes[i]) if i in packed else s.reshape(-1)
                 for i, s in enumerate(shards)]
        g = FlatGather([(i, 0, tuple(shape)) for i, shape in enumerate(shapes)], whole, [])
        g._own = True
        return g
    formats = [packed[i][0] if i in packed else
               wire if wire is not None and hierarchy is None and wire.quantizes(s.dtype, math.prod(shape)) else None
               for i, (s, shape) in enumerate(zip(shards, shapes))]
    views: list[tuple[int, int, tuple[int, ...]] | None] = [None] * len(shards)
    slabs, pendings, dequant, slab_numel, slab_dtype = [], [], {}, [], []
    groups = [(str(dtypes[i]), str(s.device), repr(formats[i]), i in packed) for i, s in enumerate(shards)]
    order = sorted(range(len(shards)), key=groups.__getitem__)  # stable
    bucket: list[int] = []

    def flush() -> None:
        if not bucket:
            return
        i0 = bucket[0]
        numel = n * sum(sizes[i] for i in bucket)
        buf = (pool.take if pool is not None else
               lambda numel, dtype, device: torch.empty(numel, dtype=dtype, device=device))(
            numel, dtypes[i0], shards[i0].device)
        outs, at = [], 0
        for i in bucket:
            size = n * sizes[i]
            outs.append(buf[at:at + size])
            views[i] = (len(slabs), at, tuple(shapes[i]))
            at += size
        version = buf._version
        ins = [shards[i] for i in bucket]
        if formats[i0] is not None:
            from dsfn.runtime.quantized import all_gather_quantized_into
            pending = all_gather_quantized_into(outs, ins, axis, formats[i0], packed=i0 in packed,
                                                keep_codes=keep_codes)
            dequant[len(slabs)] = pending
            pendings.append(pending)
        else:
            pendings.append(C.all_gather_into_(outs, ins, axis, async_op=True) if hierarchy is None
                            else hierarchical_all_gather(outs, ins, *hierarchy))
        torch._C._autograd._unsafe_set_version_counter((buf,), (version,))
        slabs.append(buf)
        slab_numel.append(numel)
        slab_dtype.append(dtypes[i0])
        bucket.clear()

    used = 0
    for i in order:
        if bucket and (groups[i] != groups[bucket[0]] or used + sizes[i] > bucket_elems):
            flush()
            used = 0
        bucket.append(i)
        used += sizes[i]
    flush()
    g = FlatGather(views, slabs, pendings)  # type: ignore[arg-type]
    g._dequant, g._slab_numel, g._slab_dtype = dequant, slab_numel, slab_dtype
    return g


def owners_by_size(numels: Sequence[int], n: int) -> list[int]:
    """Assign tensors to n ranks, balanced by size: largest first, each to the least-loaded
    rank (ties: the lower rank). Deterministic: depends only on the sizes."""
    load = [0] * n
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        o = min(range(n), key=lambda r: (load[r], r))
        owner[i] = o
        load[o] += numels[i]
    return owner


def map_whole(fn, shards: Sequence[torch.Tensor], shapes: Sequence[tuple[int, ...]], axis: str) -> list[torch.Tensor]:
    """Apply a non-elementwise `fn(i, full_i) -> new full_i` (same shape and dtype) to
    tensors that exist only as `FlatShard` pieces over `axis`; return this rank's pieces of
    the results.

    Each whole tensor is computed once, on an owner rank (`owners_by_size`): every rank
    sends its piece of tensor i to i's owner, the owner rebuilds it, applies `fn`, and
    sends each rank its piece of the result. Two all-to-alls per dtype, each moving the
    tensors' elements once ((n-1)/n of them off-rank; rows are padded to the largest
    owner's share). `shards[i]` is this rank's piece [chunk_i] of a tensor of `shapes[i]`
    (zero padding past its end, as `FlatShard` stores it; the result's padding is zero).
    Collective over `axis`: every rank passes the same shapes and dtypes.

    Device: every buffer is made on the shards' device (one device for all of them), so
    `fn` sees whole tensors there and the returned pieces live there too: under NCCL the
    owner's `fn` (Newton-Schulz for Muon) runs on the GPU and results come back as GPU
    tensors, never staged through the host.
    """
    n = current_mesh().size(axis)
    if n == 1:
        return [fn(i, s.reshape(-1)[:math.prod(shape)].reshape(shape)).reshape(-1).clone()
                if s.numel() else s.clone() for i, (s, shape) in enumerate(zip(shards, shapes))]
    devices = {s.device for s in shards}
    if len(devices) > 1:
        raise ConfigError(f"map_whole: shards on several devices {sorted(map(str, devices))}; pass them on one")
    device = devices.pop() if devices else None
    out: list[torch.Tensor | None] = [None] * len(shards)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, s in enumerate(shards):
        by_dtype.setdefault(s.dtype, []).append(i)
    me = current_mesh().local_rank(axis)
    for dtype, idx in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        chunks = [shards[i].numel() for i in idx]
        owner = owners_by_size([math.prod(shapes[i]) for i in idx], n)
        mine = [[k for k in range(len(idx)) if owner[k] == o] for o in range(n)]     # positions per owner
        width = max(sum(chunks[k] for k in ks) for ks in mine) or 1
        send = torch.zeros(n, width, dtype=dtype, device=device)       # on the shards' device, not the host
        for o, ks in enumerate(mine):
            at = 0
            for k in ks:
                send[o, at:at + chunks[k]] = shards[idx[k]].detach().reshape(-1)
                at += chunks[k]
        got = C.all_to_all(send.reshape(-1), axis).view(n, width)       # row r: rank r's pieces of my tensors
        back = torch.zeros(n, width, dtype=dtype, device=device)
        at = 0
        for k in mine[me]:
            c, shape = chunks[k], shapes[idx[k]]
            numel = math.prod(shape)
            full = got[:, at:at + c].reshape(-1)[:numel].reshape(shape)
            new = fn(idx[k], full)
            if tuple(new.shape) != tuple(shape) or new.dtype != dtype or new.device != device:
                raise ConfigError(f"map_whole: fn changed tensor {idx[k]} from {tuple(shape)} {dtype} on {device} "
                                 f"to {tuple(new.shape)} {new.dtype} on {new.device}")
            back[:, at:at + c] = padded_rows(new.detach(), n)
            at += c
        ret = C.all_to_all(back.reshape(-1), axis).view(n, width)       # row o: my pieces of o's tensors
        for o, ks in enumerate(mine):
            at = 0
            for k in ks:
                out[idx[k]] = ret[o, at:at + chunks[k]].clone()
                at += chunks[k]
    return out  # type: ignore[return-value]
