"""Counting the bytes of new storages a block of torch code allocates (for memory tests)."""
from __future__ import annotations

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
