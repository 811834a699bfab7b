"""`BufferPool`: flat buffers kept for reuse between uses (ZeRO's gradient shards, the flat
gathers' slabs), handed out again only once nothing views them."""
from __future__ import annotations

import time

import torch


class BufferPool:
    """Flat buffers kept for reuse, keyed by (numel, dtype, device): at most `keep` idle ones
    per key. Long-lived buffers of the same sizes step after step (ZeRO's gradient shards,
    `take_lent`; gathers with a pool): taking them from here lets the allocator see the same
    blocks every time, instead of fresh blocks interleaved with activations (holes glibc
    cannot reuse).

    A buffer is handed out again only when nothing else references its storage (no view
    of it is alive): a weight someone still holds is never overwritten by a later gather.
    """

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._idle: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._lent: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._held: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (numel, dtype, torch.device(device))
        idle = self._idle.get(key)
        if idle:
            return idle.pop()
        held = self._held.get(key, [])
        for attempt in range(4):
            for k, buf in enumerate(held):
                if _sole(buf):               # whoever still viewed it at `give` is done now
                    return held.pop(k)
            if not held:
                break
            # usually a collective backend's worker thread that has not destroyed a finished
            # work yet (gloo drops its tensors just after the wait returns): let it run
            time.sleep(0 if attempt < 2 else 1e-4)
        return torch.empty(numel, dtype=dtype, device=device)

    def take_lent(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer that its user never gives back (it hands out views of it, e.g. gradient
        shards): the pool keeps it and lends it again once no view of it is left."""
        lent = self._lent.setdefault((numel, dtype, torch.device(device)), [])
        for buf in lent:
            if _sole(buf):
                return buf
        buf = torch.empty(numel, dtype=dtype, device=device)
        if len(lent) < self.keep:
            lent.append(buf)
        return buf

    def give(self, buf: torch.Tensor) -> None:
        key = (buf.numel(), buf.dtype, buf.device)
        idle, held = self._idle.setdefault(key, []), self._held.setdefault(key, [])
        if len(idle) + len(held) >= self.keep:
            return
        # still viewed (a caller's view, or a finished collective's work object not yet
        # destroyed): kept aside and taken again only once nothing else references it
        (idle if _sole(buf) else held).append(buf)

    def clear(self) -> None:
        self._idle.clear()
        self._lent.clear()
        self._held.clear()


def _sole(buf: torch.Tensor) -> bool:
    """Whether `buf` is the only tensor on its storage (the temporary storage object made
    here counts once, `buf` once: more means a view of it is alive)."""
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata) <= 2
