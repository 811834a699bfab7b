"""Count the host syncs a piece of code would make on a GPU, on any machine.

A *host sync* is an operation after which the Python thread waits until the device has
run every kernel queued before it: reading a device value on the host (`.item()`,
`bool(t)`, `float(t)`, `.tolist()`, an `if` on a tensor), an op whose output shape depends
on device data (`nonzero`, `masked_select`, `unique`, boolean indexing), a blocking copy
between host and device in either direction (PyTorch synchronises the stream after a
`non_blocking=False` copy, host-to-device included), and explicit `synchronize()` calls. A
training step should make O(1) of them, never one per parameter tensor.

`count_host_syncs()` is a context that counts them at the dispatcher, for tensors on the
*device types* it is given (default: cuda and meta). The `meta` device stands in for a GPU
on a CPU-only machine: a model, batch and state put on `meta` run the same code paths as
on CUDA (host scalars stay on the CPU, device work on meta), and the counter answers the
reads a meta tensor cannot (`.item()` gives 0 / False, a copy to the host gives zeros,
`nonzero` gives no rows) so the step runs to the end and every would-be sync is counted.
Values read that way are fake: count with it, never compare numbers from it.

    with count_host_syncs() as syncs:
        state, metrics = step(state, batch)
    syncs.total, syncs.by_kind        # e.g. 1, {"item": 1}
    syncs.events                      # [(kind, op name, shape)] in order, to find the sources

`devices=("cpu",)` counts on CPU tensors as if they were device tensors (an upper bound:
host-side reads that would not sync on a GPU are counted too; copies are not, there is no
other side). Kinds: "item" (a scalar read), "data_dependent" (nonzero & co.), "d2h"
(blocking device-to-host copy), "h2d" (blocking host-to-device copy), "synchronize"
(`torch.cuda.synchronize`, `Event.synchronize`, `Stream.synchronize` and meta's
`dsfn.runtime.host.SimulatedEvent.synchronize`, patched while the context is open: these
are counted from every thread, offload's workers included).
"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncCounter", "count_host_syncs"]

aten = torch.ops.aten

# ops whose output shape depends on the values of a device tensor: the host waits to allocate it
_DATA_DEPENDENT = {getattr(aten, op).default for op in
                   ("nonzero", "masked_select", "_unique2", "unique_consecutive", "unique_dim")
                   if hasattr(aten, op)}


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


class HostSyncCounter(TorchDispatchMode):
    """The dispatch mode behind `count_host_syncs` (see the module docstring)."""

    def __init__(self, devices: Sequence[str] = ("cuda", "meta")) -> None:
        super().__init__()
        self.devices = frozenset(devices)
        self.by_kind: Counter[str] = Counter()
        self.events: list[tuple[str, str, tuple[int, ...]]] = []
        self.background: Counter[str] = Counter()     # waits made by other threads (see count_host_syncs)
        self.thread = threading.get_ident()

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def reset(self) -> None:
        self.by_kind.clear()
        self.events.clear()
        self.background.clear()

    def note(self, kind: str, what: str, shape: tuple[int, ...] = ()) -> None:
        self.by_kind[kind] += 1
        self.events.append((kind, what, tuple(shape)))

    def _on_device(self, t) -> bool:
        return _is_tensor(t) and t.device.type in self.devices

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if func is aten._local_scalar_dense.default and self._on_device(args[0]):
            self.note("item", name, args[0].shape)
            if args[0].device.type == "meta":
                return False if args[0].dtype is torch.bool else (0 if not args[0].is_floating_point() else 0.0)
        elif func in _DATA_DEPENDENT and self._on_device(args[0]):
            self.note("data_dependent", name, args[0].shape)
            if args[0].device.type == "meta" and func is aten.nonzero.default:
                return torch.empty((0, args[0].dim()), dtype=torch.int64, device="meta")
        elif func is aten._to_copy.default:
            src, dst = args[0].device, torch.device(kwargs.get("device") or args[0].device)
            blocking = not kwargs.get("non_blocking", False)
            if self._on_device(args[0]) and dst.type == "cpu" and src.type != "cpu":
                if blocking:
                    self.note("d2h", name, args[0].shape)
                if src.type == "meta":          # no data to copy: zeros stand in for it
                    dtype = kwargs.get("dtype") or args[0].dtype
                    return torch.zeros(args[0].shape, dtype=dtype, device="cpu")
            elif src.type == "cpu" and dst.type != "cpu" and dst.type in self.devices and blocking:
                self.note("h2d", name, args[0].shape)
        elif func is aten.copy_.default:
            dst, src = args[0], args[1]
            blocking = not (kwargs.get("non_blocking", False) or (len(args) > 2 and args[2]))
            if _is_tensor(src) and src.device != dst.device:
                if self._on_device(src) and dst.device.type == "cpu":
                    if blocking:
                        self.note("d2h", name, src.shape)
                    if src.device.type == "meta":     # no data to copy: zeros stand in for it
                        return dst.zero_()
                elif src.device.type == "cpu" and self._on_device(dst) and blocking:
                    self.note("h2d", name, src.shape)
        return func(*args, **kwargs)


class _ConstructorCopies(TorchFunctionMode):
    """`torch.tensor(data, device=d)` / `torch.as_tensor(data, device=d)` on a counted device:
    built on the host and copied over blocking (its copy is below the dispatch mode's view)."""

    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
            dev = torch.device(kwargs["device"])
            src = args[0] if args else None
            already = isinstance(src, torch.Tensor) and src.device == dev
            if dev.type in self.counter.devices and dev.type != "cpu" and not already:
                self.counter.note("h2d", f"torch.{func.__name__}(device={dev})")
        return func(*args, **kwargs)


@contextlib.contextmanager
def _patched_synchronize(counter: HostSyncCounter) -> Iterator[None]:
    """`torch.cuda.synchronize` and `Event/Stream.synchronize` counted (then run as usual)."""
    patched = []

    def wrap(owner, attr, what):
        orig = getattr(owner, attr, None)
        if orig is None:
            return

        def counted(*a, **k):
            if threading.get_ident() == counter.thread:
                counter.note("synchronize", what)
            else:               # a worker's wait: it does not stall the training thread
                counter.background["synchronize"] += 1
            return orig(*a, **k)
        setattr(owner, attr, counted)
        patched.append((owner, attr, orig))

    wrap(torch.cuda, "synchronize", "torch.cuda.synchronize")
    wrap(torch.cuda.Event, "synchronize", "torch.cuda.Event.synchronize")
    wrap(torch.cuda.Stream, "synchronize", "torch.cuda.Stream.synchronize")
    from dsfn.runtime.host import SimulatedEvent      # meta's copy events (the GPU's stand-in)
    wrap(SimulatedEvent, "synchronize", "SimulatedEvent.synchronize")
    try:
        yield
    finally:
        for owner, attr, orig in reversed(patched):
            setattr(owner, attr, orig)


@contextlib.contextmanager
def count_host_syncs(devices: Sequence[str] = ("cuda", "meta")) -> Iterator[HostSyncCounter]:
    """A context counting the host syncs of the code inside it (see the module docstring).

    Only this thread's waits are host syncs (`total`, `by_kind`, `events`): they stall the
    thread that launches the device's work. Waits for events made on other threads
    (offload's worker waiting for a bucket's copy, a checkpoint writer) are counted apart,
    in `background` (only the `synchronize` kind: a dispatch mode is thread-local).
    """
    counter = HostSyncCounter(devices)
    with _patched_synchronize(counter), _ConstructorCopies(counter), counter:
        yield counter
