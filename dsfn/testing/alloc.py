"""Counting what a block of torch code allocates (for memory tests and benchmarks)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsfn import tree


class AllocCounter(TorchDispatchMode):
    """Bytes of the new storages made by aten ops inside the block (views, in-place ops and
    collectives writing into given tensors make none)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seen = {t.untyped_storage().data_ptr() for t in tree.leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        out = func(*args, **kwargs)
        for t in tree.leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                self.bytes += t.untyped_storage().nbytes()
        return out


def allocation_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """(fn(), the high-water mark of torch's CPU allocations during fn, allocations minus
    frees in time order: `torch.profiler` memory events)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    live = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return out, peak
