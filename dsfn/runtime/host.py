"""Device -> host copies: the one way dsfn moves a tensor into (pinned) host memory."""
from __future__ import annotations

import torch

__all__ = ["copy_to_host"]


def copy_to_host(t: torch.Tensor, pin: bool = True, non_blocking: bool = False
                 ) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """`t` in host memory, and an event that completes when it is there (None: it already is).

    A CPU tensor is returned as it is. Otherwise a new host tensor of `t`'s shape and dtype
    (pinned when `pin` and `t` is a CUDA tensor: only pinned memory copies asynchronously,
    and pinning for any other device only costs page-locked memory) receives the copy.
    `non_blocking` on a CUDA tensor queues the copy on the current stream *of `t`'s device*
    (the stream torch's copy uses, whatever the current device is), ordered after the kernels
    that made `t` and before later writes to its memory on that stream; the returned event is
    recorded on that same stream, and whoever reads the result waits for it first
    (`event.synchronize()`, from any thread). Otherwise the copy is done when this returns and
    the event is None.
    """
    if t.device.type == "cpu":
        return t, None
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin and t.is_cuda)
    out.copy_(t, non_blocking=non_blocking)       # a host tensor of another device: ordinary copy
    if not (non_blocking and t.is_cuda):
        return out, None
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(t.device))
    return out, ready
