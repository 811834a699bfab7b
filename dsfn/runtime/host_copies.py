"""Offload's gradient pipeline: buckets leave the device during backward, the host works on
bucket k while bucket k+1 is still copying.

    pipe = HostPipeline(engine_for(device), work)      # work(k, [(key, host tensor)]) runs on a worker
    pipe.submit([(key, device_tensor), ...])           # one bucket, as the reducer finishes it
    ...
    pipe.drain()                                       # every bucket's work done (errors re-raised)

Layout and invariants:
- Two staging buffers (`n_buffers`, pinned on CUDA), flat bytes grown to the largest bucket
  and reused bucket after bucket: bucket k lands in buffer k % 2. A bucket's tensors are
  copied back to back into one buffer, as one batch on the copy engine's stream, and one
  event is recorded after them: the worker waits for that event once per bucket, never once
  per tensor, and the training thread never waits for a device event at all.
- Two worker threads: the *unstage* thread waits for bucket k's event and copies its
  tensors out of the staging buffer into host tensors of their own (a memcpy), which frees
  the buffer; the *update* thread then runs `work(k, ...)` on those copies (its to keep).
  So a host update slower than backward (AdamW on the host usually is) never holds a
  staging buffer: `submit` waits for a free buffer only while a bucket is still being
  copied out (the training thread waits for that memcpy, never for the device or the
  update), and buckets queue for the update thread as host copies.
- No pageable copies: the staging buffers are pinned whenever the engine copies from CUDA.
- Host tensors (CPU training, no device) are not staged: `work` gets them as they are, and
  with `defer_host=True` (the default) their work runs at `drain()`, on the calling thread:
  with no device, backward and the host update share the same cores, so running them
  concurrently only makes them compete, and the pipeline then costs what the plain
  update costs.

Copy engines (`engine_for`): `StreamCopyEngine` (CUDA: a side stream per device that first
waits for the compute stream; `meta`, the GPU's stand-in in the sync tests, gets counted
`SimulatedEvent`s), and `SimulatedCopyEngine` (tests and benchmarks: a virtual slow device
stream on a thread, copies in FIFO order each taking `seconds_per_byte * nbytes`, with a
timeline of (bucket, "copy"|"update", start, end)).
"""
from __future__ import annotations

import collections
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dsfn.errors import ConfigError
from dsfn.runtime.host import SimulatedEvent

__all__ = ["ArrivalBuckets", "HostPipeline", "SimulatedCopyEngine", "StreamCopyEngine", "engine_for"]


class StreamCopyEngine:
    """Device -> pinned host copies on a side stream per CUDA device (ordered after the
    compute stream's work so far); `meta` tensors get a `SimulatedEvent`."""

    pinned = True

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def copy(self, k: int, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]):
        dev = srcs[0].device
        if dev.type != "cuda":
            for d, s in zip(dsts, srcs):
                d.copy_(s, non_blocking=True)
            return SimulatedEvent(dev)
        side = self._streams.get(dev)
        if side is None:
            side = self._streams[dev] = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))     # the gradients were made there
        with torch.cuda.stream(side):
            for d, s in zip(dsts, srcs):
                d.copy_(s, non_blocking=True)
                s.record_stream(side)             # not reused before the copy has run
            ev = torch.cuda.Event()
            ev.record(side)
        return ev


class _SimEvent(SimulatedEvent):
    def __init__(self) -> None:
        super().__init__("meta")
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        super().synchronize()           # what the sync counter sees


class SimulatedCopyEngine:
    """A slow device stream, simulated: copies run one after another on a thread, each taking
    `seconds_per_byte * nbytes` (plus `latency`) before its data lands; `timeline` records
    (bucket, "copy", start, end) in seconds since the engine was made (the pipeline adds
    its "update" entries). Its events are `SimulatedEvent`s (counted by `count_host_syncs`).
    `pinned=False` makes it report pageable staging (for the pipeline's own check)."""

    def __init__(self, seconds_per_byte: float = 0.0, latency: float = 0.0, pinned: bool = True) -> None:
        self.seconds_per_byte, self.latency, self.pinned = seconds_per_byte, latency, pinned
        self.t0 = time.perf_counter()
        self.timeline: list[tuple[int, str, float, float]] = []
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="dsfn-sim-copy", daemon=True)
        self._thread.start()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def note(self, k: int, what: str, start: float, end: float) -> None:
        with self._lock:
            self.timeline.append((k, what, start, end))

    def copy(self, k: int, dsts, srcs):
        ev = _SimEvent()
        self._q.put((k, list(dsts), [s.detach() for s in srcs], ev))
        return ev

    def _run(self) -> None:
        while True:
            k, dsts, srcs, ev = self._q.get()
            start = self.now()
            nbytes = sum(s.numel() * s.element_size() for s in srcs)
            time.sleep(self.latency + self.seconds_per_byte * nbytes)
            for d, s in zip(dsts, srcs):
                d.copy_(s)
            self.note(k, "copy", start, self.now())
            ev._done.set()


def engine_for(device: torch.device | str) -> StreamCopyEngine | None:
    """The copy engine for gradients on `device`: None for host tensors (nothing to copy)."""
    return None if torch.device(device).type == "cpu" else StreamCopyEngine()


class ArrivalBuckets:
    """Gradients grouped into buckets in the order they arrive: `add(key, grad)` appends, and
    once the open bucket holds at least `bucket_elems` elements it goes to `emit(items)` (a
    list of (key, grad)); `flush()` emits the last, partial one. The bucket source of
    offload's pipeline where no ZeRO reducer reports buckets (one data-parallel rank)."""

    def __init__(self, bucket_elems: int, emit: Callable[[list[tuple[Any, torch.Tensor]]], None]) -> None:
        if not isinstance(bucket_elems, int) or bucket_elems < 1:
            raise ConfigError(f"ArrivalBuckets(bucket_elems={bucket_elems!r}): a positive number of elements")
        self.bucket_elems, self.emit = bucket_elems, emit
        self._items: list[tuple[Any, torch.Tensor]] = []
        self._elems = 0
        self.emitted = 0

    def add(self, key: Any, grad: torch.Tensor) -> None:
        self._items.append((key, grad))
        self._elems += grad.numel()
        if self._elems >= self.bucket_elems:
            self.flush()

    def flush(self) -> None:
        items, self._items, self._elems = self._items, [], 0
        if items:
            self.emitted += 1
            self.emit(items)


class _Slot:
    """One staging buffer: flat bytes, grown to the largest bucket it has held."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.buffer: torch.Tensor | None = None
        self.allocations = 0

    def views(self, like: Sequence[torch.Tensor], pin: bool) -> list[torch.Tensor]:
        sizes = [(t.numel() * t.element_size() + 63) // 64 * 64 for t in like]   # aligned starts
        need = sum(sizes)
        if self.buffer is None or self.buffer.numel() < need:
            self.buffer = None
            self.buffer = torch.empty(need, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
            self.allocations += 1
        out, off = [], 0
        for t, n in zip(like, sizes):
            nb = t.numel() * t.element_size()
            out.append(self.buffer[off:off + nb].view(t.dtype).view(t.shape))
            off += n
        return out


class HostPipeline:
    """See the module docstring. `work(k, items)` gets bucket k's `(key, host tensor)` pairs
    on the worker thread (or at `drain` for host tensors with `defer_host`). `engine`: a copy
    engine, or None to pick one per bucket by its tensors' device (`engine_for`)."""

    def __init__(self, work: Callable[[int, list[tuple[Any, torch.Tensor]]], None], engine: Any = None,
                 n_buffers: int = 2, defer_host: bool = True) -> None:
        if n_buffers < 1:
            raise ConfigError(f"HostPipeline(n_buffers={n_buffers}): needs at least one staging buffer")
        self.work, self.engine, self.defer_host = work, engine, defer_host
        self.slots = [_Slot(i) for i in range(n_buffers)]
        self._free: collections.deque[_Slot] = collections.deque(self.slots)
        self._busy: collections.deque[tuple[_Slot, concurrent.futures.Future]] = collections.deque()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsfn-offload")
        self._unstage_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                   thread_name_prefix="dsfn-offload-unstage")
        self._futures: list[concurrent.futures.Future] = []
        self._deferred: list[tuple[int, list]] = []
        self._engines: dict[torch.device, Any] = {}
        self.buckets = 0
        self.items = 0                  # tensors submitted, all buckets together
        self.staged = 0                 # buckets copied through a staging buffer

    def _engine(self, device: torch.device):
        if self.engine is not None:
            return self.engine
        if device not in self._engines:
            self._engines[device] = engine_for(device)
        return self._engines[device]

    def submit(self, items: Sequence[tuple[Any, torch.Tensor]]) -> None:
        """Bucket `self.buckets` (its tensors made on the device by now, in stream order)."""
        items = list(items)
        if not items:
            return
        k = self.buckets
        self.buckets += 1
        self.items += len(items)
        srcs = [t.detach() for _, t in items]
        engine = self._engine(srcs[0].device)
        if engine is None:                       # host tensors: nothing to copy
            if self.defer_host:
                self._deferred.append((k, items))
            else:
                self._futures.append(self._pool.submit(self.work, k, items))
            return
        if engine.pinned is False:
            raise ConfigError("HostPipeline: the copy engine stages into pageable memory, which cannot be "
                              "copied asynchronously; use an engine with pinned staging (StreamCopyEngine)")
        slot = self._take_slot()
        dsts = slot.views(srcs, pin=engine.pinned)
        event = engine.copy(k, dsts, srcs)       # one batch, one event for the bucket
        self.staged += 1
        staged = list(zip([key for key, _ in items], dsts))
        out = self._unstage_pool.submit(self._unstage, k, staged, event)
        self._busy.append((slot, out))           # the buffer is free once its bucket is copied out
        self._futures.append(self._pool.submit(self._update, k, out, engine))

    def _take_slot(self) -> _Slot:
        while not self._free:
            slot, fut = self._busy.popleft()
            fut.result()                         # a host wait: that bucket is copied out of it
            self._free.append(slot)
        # buffers whose work is done go back first, oldest first
        while self._busy and self._busy[0][1].done():
            self._free.append(self._busy.popleft()[0])
        return self._free.popleft()

    def _unstage(self, k: int, staged: list, event) -> list:
        """Bucket k out of its staging buffer (unstage thread): its one event wait, then a
        host copy of each tensor, after which the buffer may take bucket k+2."""
        event.synchronize()                      # the bucket's one wait
        return [(key, t.clone()) for key, t in staged]

    def _update(self, k: int, unstaged: concurrent.futures.Future, engine) -> None:
        items = unstaged.result()                # (update thread) in bucket order
        start = engine.now() if hasattr(engine, "now") else None
        self.work(k, items)
        if start is not None:
            engine.note(k, "update", start, engine.now())

    def drain(self) -> None:
        """Wait for every submitted bucket's work; run deferred host work here. Re-raises
        the first error a bucket's work raised (after all have finished)."""
        futures, self._futures = self._futures, []
        first = None
        for f in futures:
            try:
                f.result()
            except BaseException as e:           # noqa: BLE001 - re-raised below
                first = first or e
        while self._busy:
            self._free.append(self._busy.popleft()[0])
        deferred, self._deferred = self._deferred, []
        if first is None:
            for k, items in deferred:
                self.work(k, items)
        if first is not None:
            raise first

    def close(self) -> None:
        self._unstage_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
