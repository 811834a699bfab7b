"""Device -> host copies: the one way dsfn moves a tensor into (pinned) host memory."""
from __future__ import annotations

import torch

__all__ = ["SimulatedEvent", "copy_to_host", "wait_last"]


class SimulatedEvent:
    """The completion event of a copy queued on a device without CUDA streams: `meta`, the
    stand-in for a GPU in the sync tests (`dsfn.runtime.syncs`). Complete at once;
    `synchronize()` is the host wait it stands for, and `count_host_syncs` counts it
    (kind "synchronize", like `torch.cuda.Event.synchronize`), from any thread."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = None if device is None else torch.device(device)

    def record(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def copy_to_host(t: torch.Tensor, pin: bool = True, non_blocking: bool = False
                 ) -> tuple[torch.Tensor, "torch.cuda.Event | SimulatedEvent | None"]:
    """`t` in host memory, and an event that completes when it is there (None: it already is).

    A CPU tensor is returned as it is. Otherwise a new host tensor of `t`'s shape and dtype
    (pinned when `pin` and `t` is a CUDA tensor: only pinned memory copies asynchronously,
    and pinning for any other device only costs page-locked memory) receives the copy.
    `non_blocking` on a CUDA tensor queues the copy on the current stream *of `t`'s device*
    (the stream torch's copy uses, whatever the current device is), ordered after the kernels
    that made `t` and before later writes to its memory on that stream; the returned event is
    recorded on that same stream, and whoever reads the result waits for it first
    (`event.synchronize()`, from any thread; events of one device's stream complete in
    order, so waiting for the last one of a batch waits for all: `wait_last`). A `meta`
    tensor (the GPU's stand-in) gets a `SimulatedEvent`, so its waits are counted too.
    Otherwise the copy is done when this returns and the event is None.
    """
    if t.device.type == "cpu":
        return t, None
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin and t.is_cuda)
    out.copy_(t, non_blocking=non_blocking)       # a host tensor of another device: ordinary copy
    if non_blocking and t.device.type == "meta":
        return out, SimulatedEvent(t.device)
    if not (non_blocking and t.is_cuda):
        return out, None
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(t.device))
    return out, ready


def wait_last(events) -> int:
    """Wait for a batch of `(device, event)` pairs (events of `copy_to_host`, in the order
    they were recorded): only the last event of each device, since one device's stream runs
    its copies in order. Returns the number of waits (<= the number of devices)."""
    last: dict = {}
    for device, ev in events:
        if ev is not None:
            last[device] = ev
    for ev in last.values():
        ev.synchronize()
    return len(last)
