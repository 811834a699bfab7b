"""A bounded, reusable host staging cache for checkpoint captures.

`async_checkpoint` captures the state by reference: a dsfn state is immutable, so the
tensors a save needs stay valid while the background writer reads them. Two cases want a
*copy* instead, and this cache makes it cheap and bounded:

- device state (CUDA): holding the captured state keeps a second copy of the parameters
  and optimizer state in device memory until the write ends. Copying it into host memory
  (pinned, so the copies run asynchronously on a side stream) lets device memory go as soon
  as the copies land; the step blocks only to enqueue them.
- a state whose tensors someone updates in place (a user's own in-place code, a donated
  buffer): a snapshot at the step boundary keeps the checkpoint what the step produced.

Policy (`capture`):

- `"auto"`: tensors that are not in host memory are copied; host tensors are referenced
  (on a CPU-only machine nothing is copied: the state already lives in host memory).
- `"copy"`: every tensor is copied (a snapshot).
- `"reference"`: nothing is copied.

`capacity` bounds the cache in bytes. The default (None) is DeepSpeed DataStates'
`host_cache_size` of 16 GiB of pinned host memory per process, lowered to a quarter of the
host's physical memory shared by the node's ranks (`default_capacity()`): pinned memory is
page-locked, so an unbounded cache as large as a rank's device state can starve the host.
`capacity=sys.maxsize` removes the bound. Tensors are taken in the
state's leaf order; the first that does not fit and every later one are captured by
reference, so a bound trades host memory for held device memory, never correctness. The
buffer is one flat byte tensor, allocated once (grown up to the bound when a larger state
comes, the old block handed back to the driver rather than kept by torch's caching host
allocator) and reused by every save: one save is in flight at a time, and `stage` is only
called once the previous save has finished (`AsyncSaver.submit` waits first).

Pinning (`pin=None`): the buffer is pinned only when what it stages lives on a CUDA device
(the copies are then asynchronous on a side stream of *that* device); a CPU or other
device's state gets ordinary memory, whatever `torch.cuda.is_available()` says.

Layout of the buffer: each copied tensor occupies `nbytes` rounded up to `ALIGN` bytes, in
leaf order; a staged tensor is a contiguous view of its slot with the source's dtype and
shape.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any

import torch

from dsfn import tree
from dsfn.errors import CheckpointError

__all__ = ["CAPTURE_POLICIES", "HostCache", "StageReport"]

CAPTURE_POLICIES = ("auto", "copy", "reference")
ALIGN = 64          # bytes: every slot starts aligned for any dtype's view (and for vector loads)
DATASTATES_HOST_CACHE_BYTES = 16 << 30     # DataStates' documented host_cache_size (16 GB per process)


def default_capacity() -> int:
    """The default bound in bytes: 16 GiB (DataStates), at most a quarter of the host's
    physical memory divided by the ranks on this node (LOCAL_WORLD_SIZE)."""
    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return DATASTATES_HOST_CACHE_BYTES
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return min(DATASTATES_HOST_CACHE_BYTES, phys // (4 * local))


@dataclasses.dataclass(frozen=True)
class StageReport:
    """What one capture did: bytes copied into the cache and bytes still referenced."""
    copied_bytes: int
    referenced_bytes: int
    copied_tensors: int
    referenced_tensors: int
    seconds: float               # time the caller spent staging (enqueueing, on CUDA)


class HostCache:
    """Stages a state's tensors into one reusable host buffer (see the module docstring)."""

    def __init__(self, capacity: int | None = None, capture: str = "auto", pin: bool | None = None) -> None:
        if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0):
            raise CheckpointError(f"HostCache(capacity={capacity!r}): a byte count >= 0, or None for unbounded")
        if capture not in CAPTURE_POLICIES:
            raise CheckpointError(f"HostCache(capture={capture!r}): use one of {list(CAPTURE_POLICIES)}")
        self.capacity = default_capacity() if capacity is None else capacity
        self.capture = capture
        # None: pinned exactly when the staged tensors are CUDA tensors (decided per stage)
        self.pin = None if pin is None else bool(pin)
        self.buffer: torch.Tensor | None = None       # uint8 [allocated bytes]
        self.pinned = False                           # whether `buffer` is page-locked
        self.allocations = 0                          # how often the buffer was (re)allocated
        self._streams: dict = {}                      # CUDA device -> its side stream

    def wants(self, t: torch.Tensor) -> bool:
        """Whether the policy copies tensor `t` (before the bound is applied)."""
        if self.capture == "copy":
            return True
        if self.capture == "auto":
            return t.device.type != "cpu"
        return False

    def stage(self, state: Any) -> tuple[Any, "StagedEvent", StageReport]:
        """Return `state` with the chosen tensors replaced by views of the cache.

        The returned event must be waited on (`event.wait()`) by whoever reads the staged
        tensors: device-to-host copies run asynchronously on a side stream.
        """
        t0 = time.perf_counter()
        tensors = [x for x in tree.leaves(state) if isinstance(x, torch.Tensor)]
        plan: dict[int, int] = {}            # id(tensor) -> byte offset of its slot
        used = 0
        bound = self.capacity
        for t in tensors:
            if id(t) in plan or not self.wants(t) or t.numel() == 0:
                continue
            size = _slot(t)
            if bound is not None and used + size > bound:
                break                         # this one and every later one by reference
            plan[id(t)] = used
            used += size
        cuda = [t.device for t in tensors if id(t) in plan and t.is_cuda]
        self._ensure(used, self.pin if self.pin is not None else bool(cuda))
        # one side stream per CUDA device the tensors live on (not the current device's):
        # each waits for its device's compute stream, which made the tensors
        streams = {d: self._side_stream(d) for d in dict.fromkeys(cuda)}
        for d, s in streams.items():
            s.wait_stream(torch.cuda.current_stream(d))
        copied: dict[int, torch.Tensor] = {}
        for t in tensors:
            off = plan.get(id(t))
            if off is None or id(t) in copied:
                continue
            stream = streams.get(t.device) if t.is_cuda else None
            dst = self.buffer[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            with (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()), torch.no_grad():
                dst.copy_(t.detach(), non_blocking=stream is not None and self.pinned)
            if stream is not None:
                t.record_stream(stream)    # its memory is not reused before the copy has run
            copied[id(t)] = dst
        event = StagedEvent(list(streams.values()))
        staged = tree.map(lambda x: copied.get(id(x), x) if isinstance(x, torch.Tensor) else x, state)
        n_ref = [t for t in tensors if id(t) not in copied]
        report = StageReport(copied_bytes=sum(c.numel() * c.element_size() for c in copied.values()),
                             referenced_bytes=sum(t.numel() * t.element_size() for t in n_ref),
                             copied_tensors=len(copied), referenced_tensors=len(n_ref),
                             seconds=time.perf_counter() - t0)
        return staged, event, report

    # -- internals -----------------------------------------------------------------------------
    def _ensure(self, nbytes: int, pin: bool) -> None:
        if nbytes == 0:
            return
        if self.buffer is not None and self.buffer.numel() >= nbytes and (self.pinned or not pin):
            return                           # reuse (a pinned buffer serves host-only saves too)
        if self.buffer is not None:
            was_pinned, self.buffer = self.pinned, None    # free the smaller one first
            if was_pinned:
                _release_pinned()
        try:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        except RuntimeError as e:            # out of (pinnable) host memory
            raise CheckpointError(
                f"checkpoint host cache: could not allocate {nbytes / 2**20:.1f} MiB of "
                f"{'pinned ' if pin else ''}host memory ({e}); bound it with "
                "async_checkpoint(host_cache_size=BYTES) or capture by reference (capture='reference')") from e
        self.pinned = pin
        self.allocations += 1

    def _side_stream(self, device: torch.device):
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s


def _release_pinned() -> None:
    """Return freed pinned blocks to the driver: torch's caching host allocator otherwise
    keeps every block it ever pinned, so a buffer grown n times would hold n blocks."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


class StagedEvent:
    """Completion of a stage's copies: `wait()` blocks the calling thread until they landed."""

    def __init__(self, streams=()) -> None:
        if streams is not None and not isinstance(streams, (list, tuple)):
            streams = [streams]              # a single stream (older callers)
        self._events = []
        for stream in streams or ():
            event = torch.cuda.Event()
            event.record(stream)
            self._events.append(event)

    def wait(self) -> None:
        for event in self._events:
            event.synchronize()


def _slot(t: torch.Tensor) -> int:
    n = t.numel() * t.element_size()
    return (n + ALIGN - 1) // ALIGN * ALIGN

