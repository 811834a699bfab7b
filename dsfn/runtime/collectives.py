"""Collectives over named mesh axes, with per-axis call and byte counters.

Every collective dsfn issues goes through here, so tests and `explain` can compare the
communication a stack performs with the theory. Bytes counted per call:

| op              | bytes counted                          |
|-----------------|----------------------------------------|
| all_reduce      | the tensor's bytes                      |
| all_gather      | the gathered (full) output's bytes      |
| reduce_scatter  | the (full) input's bytes                |
| all_to_all      | the input's bytes                       |
| broadcast       | the tensor's bytes                      |

Each count also splits its bytes by link (`dsfn.runtime.links`): `intra` (this rank's bytes
over node-local links) and `inter` (bytes crossing this rank's node's boundary, per node),
from the axis's group on the mesh's `topology`; the factors are cached per axis and mesh.
A size-1 axis performs no communication and counts nothing. `async_op=True` returns a
`Pending` whose `wait()` gives the result. Under NCCL, host tensors (step counts,
metrics) are staged through the device and the result comes back to the host.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from dsfn.errors import DistributedError, ShapeError
from dsfn.identity_cache import KeyedCache
from dsfn.runtime import env
from dsfn.runtime.links import group_links, link_bytes
from dsfn.runtime.mesh import Mesh, current_mesh


@dataclass
class OpCount:
    """Calls and counted bytes of one (axis, op); `intra` (per rank) and `inter` (per node)
    split the traffic by link (`dsfn.runtime.links`)."""

    calls: int = 0
    bytes: int = 0
    intra: float = 0.0
    inter: float = 0.0
    # of `bytes`, what quantized collectives (ZeRO++) sent as codes and as their fp32 scales
    codes: int = 0
    scales: int = 0


def _link_factors(op: str, axis: str, m: Mesh) -> tuple[float, float]:
    unit = link_bytes(op, 1, group_links(m.ranks(axis), m.topology, m.rank))
    return unit.intra, unit.inter


class CommCounters:
    """Counts collectives per (axis, op). `snapshot()` copies, `reset()` zeroes."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], OpCount] = defaultdict(OpCount)
        # (axis, op) -> (intra factor, inter factor), the link split per counted byte, on a mesh
        # held by weak reference
        self._factors = KeyedCache(weak=True)

    def record(self, axis: str, op: str, nbytes: int, mesh: Mesh | None = None, src: int | None = None) -> None:
        """Count one call of `op` along `axis` (a gradient channel "x/grads" counts as x)
        moving `nbytes`; `mesh` (default: the current one) places its group on the
        topology, `src` is a broadcast's source (a global rank), or the receiver of a
        point-to-point "send" (its bytes cross this node's boundary when the receiver is on
        another node)."""
        axis = axis.split("/")[0]
        key = (axis, op)
        c = self._counts[key]
        c.calls += 1
        c.bytes += int(nbytes)
        m = mesh if mesh is not None else current_mesh()
        if op in ("broadcast", "send"):     # the other end decides the link, call by call
            split = link_bytes(op, nbytes, group_links(m.ranks(axis), m.topology, m.rank), src, m.rank)
            c.intra += split.intra
            c.inter += split.inter
            return
        f = self._factors.get(key, (m,), lambda: _link_factors(op, axis, m))
        c.intra += nbytes * f[0]
        c.inter += nbytes * f[1]

    def quantized(self, axis: str, op: str, codes: int, scales: int) -> None:
        """Of the bytes `record` counted for (axis, op), `codes` were quantized codes and
        `scales` their fp32 scales (`dsfn.runtime.quantized` calls it beside each quantized
        collective, so explain shows the two apart)."""
        c = self._counts[(axis.split("/")[0], op)]
        c.codes += int(codes)
        c.scales += int(scales)

    def snapshot(self) -> dict[tuple[str, str], OpCount]:
        return {k: OpCount(v.calls, v.bytes, v.intra, v.inter, v.codes, v.scales) for k, v in self._counts.items()}

    def bytes(self, axis: str | None = None, op: str | None = None) -> int:
        return sum(v.bytes for (a, o), v in self._counts.items()
                   if (axis is None or a == axis) and (op is None or o == op))

    def calls(self, axis: str | None = None, op: str | None = None) -> int:
        return sum(v.calls for (a, o), v in self._counts.items()
                   if (axis is None or a == axis) and (op is None or o == op))

    def reset(self) -> None:
        self._counts.clear()
        self._factors.clear()


counters = CommCounters()

# Gauges: named levels the runtime reports (e.g. "zero3.live_units"), with their maxima.
gauges: dict[str, int] = {}
gauge_max: dict[str, int] = {}


def gauge(name: str, value: int) -> None:
    gauges[name] = value
    gauge_max[name] = max(gauge_max.get(name, value), value)


def reset_gauges() -> None:
    gauges.clear()
    gauge_max.clear()


class Pending:
    """An in-flight collective; `wait()` returns its result tensor."""

    def __init__(self, work, result: torch.Tensor, finish: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self._work, self._result, self._finish = work, result, finish

    def done(self) -> bool:
        """Whether it finished (never blocks)."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._finish is not None:
            self._result, self._finish = self._finish(self._result), None
        return self._result


_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN}


# torch >= 2.10 renamed the tensor collectives; keep working on older releases (>= 2.4)
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _done(result: torch.Tensor, async_op: bool):
    return Pending(None, result) if async_op else result


def _check_dim0_divisible(op: str, t: torch.Tensor, axis: str, n: int) -> None:
    if t.dim() == 0 or t.shape[0] % n:
        raise ShapeError(f"{op} along {axis!r} needs dim 0 divisible by {n}, got shape {tuple(t.shape)}; "
                         "pad the tensor first")


def _to_backend(t: torch.Tensor) -> torch.Tensor:
    """NCCL moves only CUDA tensors: stage host tensors (counts, metrics) on the device."""
    if t.device.type == "cpu" and env.backend() == "nccl":
        return t.to(env.device())
    return t


def _result(work, out: torch.Tensor, home: torch.device, async_op: bool, target: torch.Tensor | None = None):
    """The collective's result back where the caller's tensor lives (into `target` if in place)."""
    finish = None
    if out.device != home:
        finish = (lambda r: target.copy_(r)) if target is not None else (lambda r: r.to(home))
    if async_op:
        return Pending(work, out, finish)
    return finish(out) if finish is not None else out


def all_reduce_(t: torch.Tensor, axis: str, op: str = "sum", *, mesh: Mesh | None = None,
                async_op: bool = False):
    """In-place all-reduce of `t` along `axis` (op: sum | avg | max | min)."""
    m = mesh if mesh is not None else current_mesh()      # inline: once per collective
    if m.size(axis) == 1:
        return _done(t, async_op)
    counters.record(axis, "all_reduce", _nbytes(t), m)
    dev = _to_backend(t)
    work = dist.all_reduce(dev, op=_OPS[op], group=m.comm_group(axis), async_op=async_op)
    return _result(work, dev, t.device, async_op, target=t)


def all_reduce(t: torch.Tensor, axis: str, op: str = "sum", *, mesh: Mesh | None = None,
               async_op: bool = False):
    """All-reduce into a new tensor; `t` is left unchanged."""
    if (mesh if mesh is not None else current_mesh()).size(axis) == 1:
        return _done(t, async_op)
    return all_reduce_(t.clone(), axis, op, mesh=mesh, async_op=async_op)


def all_gather(t: torch.Tensor, axis: str, *, mesh: Mesh | None = None, async_op: bool = False):
    """Concatenate every rank's `t` along dim 0: shape [size * t.shape[0], ...]."""
    m = mesh if mesh is not None else current_mesh()      # inline: once per collective
    n = m.size(axis)
    if n == 1:
        return _done(t, async_op)
    home, t = t.device, _to_backend(t.contiguous())
    out = torch.empty((n * t.shape[0],) + tuple(t.shape[1:]) if t.dim() else (n,), dtype=t.dtype,
                      device=t.device)
    counters.record(axis, "all_gather", _nbytes(out), m)
    work = _all_gather_tensor(out, t if t.dim() else t.reshape(1), group=m.comm_group(axis), async_op=async_op)
    return _result(work, out, home, async_op)


class _PendingAll(Pending):
    """Several in-flight collectives (`Pending`s, or torch works needing no conversion)
    waited for as one; `wait()` returns `result`."""

    def __init__(self, pendings: list, result):
        self._pendings, self._all = pendings, result

    def done(self) -> bool:
        return all(p.done() if isinstance(p, Pending) else p.is_completed() for p in self._pendings)

    def wait(self):
        for p in self._pendings:
            p.wait()
        return self._all


def all_gather_into_(outs: list[torch.Tensor], ts: list[torch.Tensor], axis: str, *, mesh: Mesh | None = None,
                     async_op: bool = False):
    """One all-gather of several tensors, each into a caller's buffer: rank r's `ts[k]`
    (any shape, k elements) lands in `outs[k]` (contiguous, size * k elements) at
    [r * k, (r + 1) * k). Counted as one call (the outputs' bytes). No output-sized buffer
    is made here (the caller's are written; gloo copies through one of its own, NCCL
    writes them directly; a host buffer under NCCL is staged on the device). Under NCCL the
    tensors travel as one coalesced all-gather (one grouped kernel, one Python call into
    torch, whatever their number), as DeepSpeed's and FSDP1's coalesced gathers. Returns
    `outs` (a `Pending` of it with `async_op`)."""
    m = mesh if mesh is not None else current_mesh()      # inline: once per collective
    n = m.size(axis)
    for o, t in zip(outs, ts):
        if not o.is_contiguous() or o.numel() != n * t.numel() or o.dtype != t.dtype:
            raise ShapeError(f"all_gather_into_ along {axis!r}: output {tuple(o.shape)} {o.dtype} (contiguous: "
                             f"{o.is_contiguous()}) must be {n} x input {tuple(t.shape)} {t.dtype}, contiguous")
    if n == 1:
        for o, t in zip(outs, ts):
            o.copy_(t.reshape(-1))
        return _done(outs, async_op)
    counters.record(axis, "all_gather", sum(o.numel() * o.element_size() for o in outs), m)
    backend = env.backend()
    if backend == "gloo" and all(o.device.type == "cpu" for o in outs):
        # gloo's all-gather receives into an output-sized buffer of its own and copies out;
        # its broadcast receives in place: rank r's piece is broadcast into its slot
        group, ranks, me = m.comm_group(axis), m.ranks(axis), m.local_rank(axis)
        works = []
        for o, t in zip(outs, ts):
            k = t.numel()
            o[me * k:(me + 1) * k].copy_(t.reshape(-1))
            for r in range(n):
                works.append(dist.broadcast(o[r * k:(r + 1) * k], src=ranks[r], group=group, async_op=True))
        done = _PendingAll(works, outs)
        return done if async_op else done.wait()
    if backend == "nccl" and all(o.device.type == "cuda" for o in outs):
        ins = [_to_backend(t.contiguous()).view(-1) for t in ts]
        done = _PendingAll([_coalesced_all_gather(m.comm_group(axis), [o.view(-1) for o in outs], ins)], outs)
        return done if async_op else done.wait()
    pendings = []
    for o, t in zip(outs, ts):
        dev = _to_backend(o)
        work = _all_gather_tensor(dev.view(-1), _to_backend(t.contiguous()).view(-1), group=m.comm_group(axis),
                                  async_op=True)
        pendings.append(_result(work, dev, o.device, True, target=o))
    done = _PendingAll(pendings, outs)
    return done if async_op else done.wait()


def _coalesced_all_gather(group, outs: list[torch.Tensor], ins: list[torch.Tensor]):
    """One coalesced all-gather of `ins` into `outs` (NCCL: one grouped launch; the process
    group call torch's own _coalescing_manager makes, torch >= 2.1); its work."""
    return group.allgather_into_tensor_coalesced(outs, ins)


def reduce_scatter(t: torch.Tensor, axis: str, op: str = "sum", *, mesh: Mesh | None = None,
                   async_op: bool = False, out: torch.Tensor | None = None, consume: bool = False):
    """Reduce `t` over the axis and keep this rank's dim-0 chunk: shape [t.shape[0] // size, ...].

    `out`: write the chunk there (contiguous, the chunk's shape and dtype) instead of a new
    tensor. `consume=True`: the caller gives up `t` (its contents may be overwritten):
    gloo's reduce-scatter clones its input and all-reduces the clone, so there the
    all-reduce runs on `t` itself instead, with no input-sized temporary (same bytes moved
    and counted)."""
    m = mesh if mesh is not None else current_mesh()      # inline: once per collective
    n = m.size(axis)
    if n == 1:
        if out is not None:
            out.copy_(t)
            t = out
        return _done(t, async_op)
    _check_dim0_divisible("reduce_scatter", t, axis, n)
    home, t = t.device, _to_backend(t.contiguous())
    shape = (t.shape[0] // n,) + tuple(t.shape[1:])
    if out is not None and (tuple(out.shape) != shape or out.dtype != t.dtype or not out.is_contiguous()):
        raise ShapeError(f"reduce_scatter along {axis!r}: out is {tuple(out.shape)} {out.dtype}, the chunk "
                         f"is {shape} {t.dtype} (contiguous)")
    counters.record(axis, "reduce_scatter", _nbytes(t), m)
    if consume and env.backend() == "gloo" and t.device.type == "cpu" and op in ("sum", "avg"):
        me = m.local_rank(axis)
        target = out if out is not None else torch.empty(shape, dtype=t.dtype, device=home)
        work = dist.all_reduce(t, op=_OPS["sum"], group=m.comm_group(axis), async_op=True)

        def chunk(r: torch.Tensor) -> torch.Tensor:
            mine = r[me * shape[0]:(me + 1) * shape[0]]
            return target.copy_(mine).div_(n) if op == "avg" else target.copy_(mine)
        done = Pending(work, t, chunk)
        return done if async_op else done.wait()
    dev_out = out if out is not None and out.device == t.device else \
        torch.empty(shape, dtype=t.dtype, device=t.device)
    work = _reduce_scatter_tensor(dev_out, t, op=_OPS[op], group=m.comm_group(axis), async_op=async_op)
    return _result(work, dev_out, home, async_op, target=out if out is not None and out is not dev_out else None)


def all_to_all(t: torch.Tensor, axis: str, *, mesh: Mesh | None = None, async_op: bool = False):
    """Split dim 0 into `size` chunks, send chunk i to rank i, concatenate what arrives."""
    m = mesh if mesh is not None else current_mesh()      # inline: once per collective
    n = m.size(axis)
    if n == 1:
        return _done(t, async_op)
    _check_dim0_divisible("all_to_all", t, axis, n)
    home, t = t.device, _to_backend(t.contiguous())
    out = torch.empty_like(t)
    counters.record(axis, "all_to_all", _nbytes(t), m)
    work = dist.all_to_all_single(out, t, group=m.comm_group(axis), async_op=async_op)
    return _result(work, out, home, async_op)


def all_to_all_rows(t: torch.Tensor, send: list[int], recv: list[int], axis: str, *,
                    mesh: Mesh | None = None) -> torch.Tensor:
    """Variable-size all-to-all of rows: the first `send[0]` rows of `t` go to the rank at index 0
    along `axis`, the next `send[1]` to index 1, ...; `recv[i]` rows arrive from index i, in
    index order ([sum(recv), *t.shape[1:]]). `send` / `recv` are host ints (every rank's
    `recv` is its peers' `send` to it: exchange the counts first)."""
    m = mesh if mesh is not None else current_mesh()      # inline: once per collective
    n = m.size(axis)
    if n == 1:
        return t
    if len(send) != n or len(recv) != n or sum(send) != t.shape[0]:
        raise DistributedError(f"all_to_all_rows over {axis!r} (size {n}): send counts {send} must be {n} "
                               f"counts summing to the {t.shape[0]} rows sent, recv counts {recv} {n} counts")
    home, t = t.device, _to_backend(t.contiguous())
    out = t.new_empty((sum(recv), *t.shape[1:]))
    counters.record(axis, "all_to_all", _nbytes(t), m)
    dist.all_to_all_single(out, t, output_split_sizes=list(recv), input_split_sizes=list(send),
                           group=m.comm_group(axis))
    return out.to(home)


class RingShift:
    """In-flight ring shift (`ring_shift`): `wait()` gives the tensors received from the
    previous rank along the axis, in the order sent."""

    def __init__(self, works: list, received: list[torch.Tensor], homes: list[torch.device], sent: list):
        self._works, self._received, self._homes, self._sent = works, received, homes, sent

    def wait(self) -> list[torch.Tensor]:
        for w in self._works:
            w.wait()
        self._works, self._sent = [], []
        return [r.to(h) for r, h in zip(self._received, self._homes)]


def ring_shift(ts: list[torch.Tensor], axis: str, *, mesh: Mesh | None = None) -> RingShift:
    """Send each of `ts` to the next rank along `axis` (index + 1, wrapping) and receive the
    previous rank's, asynchronously (one batch of isend / irecv: ring attention's K/V
    rotation). Every rank of the axis calls it with tensors of the same shapes and dtypes.
    Size-1 axis: `wait()` returns `ts` themselves. Counted as a "send" of the bytes sent (to the
    next rank: its link decides intra- or inter-node)."""
    m = mesh if mesh is not None else current_mesh()      # inline: once per collective
    n = m.size(axis)
    if n == 1:
        return RingShift([], list(ts), [t.device for t in ts], [])
    ranks, me = m.ranks(axis), m.local_rank(axis)
    nxt, prev = ranks[(me + 1) % n], ranks[(me - 1) % n]
    group = m.comm_group(axis)
    sent = [_to_backend(t.contiguous()) for t in ts]
    received = [torch.empty_like(t) for t in sent]
    counters.record(axis, "send", sum(_nbytes(t) for t in sent), m, nxt)
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in sent] + \
          [dist.P2POp(dist.irecv, r, prev, group) for r in received]
    works = dist.batch_isend_irecv(ops)
    return RingShift(works, received, [t.device for t in ts], sent)


def broadcast_(t: torch.Tensor, axis: str, src: int = 0, *, mesh: Mesh | None = None,
               async_op: bool = False):
    """In-place broadcast from the rank at index `src` along `axis`."""
    m = mesh if mesh is not None else current_mesh()      # inline: once per collective
    if m.size(axis) == 1:
        return _done(t, async_op)
    counters.record(axis, "broadcast", _nbytes(t), m, m.ranks(axis)[src])
    dev = _to_backend(t)
    work = dist.broadcast(dev, src=m.ranks(axis)[src], group=m.comm_group(axis), async_op=async_op)
    return _result(work, dev, t.device, async_op, target=t)


def each_piece(t: torch.Tensor, axis: str, *, mesh: Mesh | None = None):
    """Every rank's `t` along `axis`, one at a time in rank order: yields (index along the
    axis, piece), the piece being `t` itself for this rank and otherwise one reused buffer
    broadcast from that rank (valid until the next one). A collective every rank must run
    to the end. Holds one piece besides `t`, where an all-gather holds all of them: for
    rebuilding a tensor whose pieces do not lie consecutively (a split along dim 1)."""
    m = mesh if mesh is not None else current_mesh()      # inline: once per collective
    me, buf = m.local_rank(axis), None
    t = t.contiguous()
    for r in range(m.size(axis)):
        if r == me:
            piece = t
        else:
            buf = torch.empty_like(t) if buf is None else buf
            piece = buf
        broadcast_(piece, axis, src=r, mesh=m)
        yield r, piece


def barrier(axis: str | None = None, *, mesh: Mesh | None = None) -> None:
    m = mesh if mesh is not None else current_mesh()      # inline: once per collective
    if axis is None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
    elif m.size(axis) > 1:
        dist.barrier(group=m.comm_group(axis))
