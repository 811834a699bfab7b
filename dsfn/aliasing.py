"""The donation flag: whether an update may write its results into its inputs' buffers.

The bottom of donation (`dsfn.state.donation` has the semantics and the rest): a
thread-local flag a donating Step sets (`donating`), which the update functions (the
optimizers' Adam/SGD paths, the host and Triton AdamW kernels, mixed precision's
low-precision copy) consult through `writable(tensors)`. It imports nothing of dsfn, so
the optimizers read it without reaching the state floor.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

import torch

__all__ = ["donating", "may_alias", "writable"]

_local = threading.local()


def may_alias() -> bool:
    """True inside a donated step: update outputs may reuse (overwrite) their inputs' buffers."""
    return getattr(_local, "on", False)


@contextlib.contextmanager
def donating(enabled: bool = True) -> Iterator[None]:
    """Within this block `may_alias()` is `enabled` (nested blocks restore the outer value)."""
    prev = may_alias()
    _local.on = bool(enabled)
    try:
        yield
    finally:
        _local.on = prev


def writable(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether an update may write its results into `tensors` in place: donation is on, and
    no two of them share a first element (the same tensor twice would be updated twice)."""
    if not may_alias():
        return False
    seen = set()
    for t in tensors:
        key = (t.device, t.data_ptr())
        if t.numel() and key in seen:
            return False
        seen.add(key)
    return True
