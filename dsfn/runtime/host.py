"""Device -> host copies: the one way dsfn moves a tensor into (pinned) host memory."""
from __future__ import annotations

import torch

__all__ = ["copy_to_host"]


def copy_to_host(t: torch.Tensor, pin: bool = True, non_blocking: bool = False
                 ) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """`t` in host memory, and an event that completes when it is there (None: it already is).

    A CPU tensor is returned as it is. Otherwise a new host tensor of `t`'s shape and dtype
    (pinned when `pin` and CUDA is available: only pinned memory copies asynchronously)
    receives the copy. `non_blocking` on a CUDA tensor queues the copy on the current stream,
    ordered after the kernels that made `t` and before later writes to its memory on that
    stream; whoever reads the result waits for the returned event first (`event.synchronize()`,
    from any thread). Otherwise the copy is done when this returns and the event is None.
    """
    if t.device.type == "cpu":
        return t, None
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin and torch.cuda.is_available())
    asynchronous = non_blocking and t.is_cuda
    out.copy_(t, non_blocking=asynchronous)
    if not asynchronous:
        return out, None
    ready = torch.cuda.Event()
    ready.record()
    return out, ready
