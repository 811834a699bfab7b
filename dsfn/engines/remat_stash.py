"""Remat's saved-input hooks, applied to the checkpoints' saved inputs by `Chain` (in order on
pack, reversed on unpack): `HostStash()` (offload="cpu": pinned host copies on a side
stream, the next recompute's input prefetched) and `TpPartition(axis, check)`
(partition_activations: keep 1/tp, all-gather it back). `dsfn.engines.remat` installs them.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from dsfn.runtime import collectives as C
from dsfn.runtime.host import copy_to_host

__all__ = ["Chain", "HostStash", "TpPartition"]


# ---------------------------------------------------------------------------------------------
# offload="cpu": the checkpoints' saved inputs in host memory

_side_streams: dict[Any, Any] = {}


def _side_stream(device: torch.device):
    s = _side_streams.get(device)
    if s is None:
        s = _side_streams[device] = torch.cuda.Stream(device=device)
    return s


class _Held:
    """A saved input held on the host: `host` (and, on CUDA, the event of its copy); the
    device copy made for the recompute (`back`, ready at `back_ready`) until it is used."""
    __slots__ = ("host", "ready", "device", "index", "back", "back_ready", "__weakref__")

    def __init__(self, host, ready, device, index):
        self.host, self.ready, self.device, self.index = host, ready, device, index
        self.back = self.back_ready = None


class HostStash:
    """Saved-tensor hooks around the checkpoint calls of one forward: pack moves a saved
    input that requires grad to host memory, unpack brings it back (prefetching the one the
    next recompute needs). Publishes the host bytes as the gauge "remat.offloaded_bytes"."""

    def __init__(self):
        # CUDA inputs in pack order (weak: an input lives as long as the checkpoint that saved it)
        self.items: list[weakref.ref] = []
        self.storages: dict[tuple[int, int], int] = {}       # dedup for the byte count
        self.bytes = 0

    def pack(self, t: Any) -> Any:
        if isinstance(t, _Piece):               # partition_activations' piece of an input: hold the piece
            t.piece = self._hold(t.piece)
            return t
        if not isinstance(t, torch.Tensor) or not t.requires_grad or t.device.type == "meta":
            return t
        return self._hold(t)

    def _hold(self, t: torch.Tensor) -> Any:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in self.storages:
            self.storages[key] = 1
            self.bytes += t.untyped_storage().nbytes()
            C.gauge("remat.offloaded_bytes", self.bytes)
        if t.device.type != "cuda":
            # host memory is this device's memory: keep the tensor (nothing to copy or overlap)
            return _Held(t.detach(), None, t.device, -1)
        side = _side_stream(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))    # t is computed
        with torch.cuda.stream(side):
            host, ready = copy_to_host(t.detach(), pin=True, non_blocking=True)
        t.record_stream(side)               # its memory is not reused before the copy has read it
        item = _Held(host, ready, t.device, len(self.items))
        self.items.append(weakref.ref(item))
        return item

    def unpack(self, item: Any) -> Any:
        if isinstance(item, _Piece):
            item.piece = self.unpack(item.piece)
            return item
        if not isinstance(item, _Held):
            return item
        if item.device.type != "cuda":
            return item.host
        if item.back is None:
            self._fetch(item)
        current = torch.cuda.current_stream(item.device)
        current.wait_event(item.back_ready)
        t, item.back, item.back_ready = item.back, None, None
        t.record_stream(current)
        # backward recomputes the modules in reverse order: bring the previous input now
        if 0 < item.index <= len(self.items):
            prev = self.items[item.index - 1]()
            if prev is not None and prev.back is None:
                self._fetch(prev)
        return t

    def _fetch(self, item: _Held) -> None:
        side = _side_stream(item.device)
        with torch.cuda.stream(side):
            if item.ready is not None:
                side.wait_event(item.ready)
            item.back = item.host.to(item.device, non_blocking=True)
            item.back_ready = torch.cuda.Event()
            item.back_ready.record(side)

    def close(self) -> None:
        self.items.clear()
        self.storages.clear()
        self.bytes = 0
        C.gauge("remat.offloaded_bytes", 0)


# ---------------------------------------------------------------------------------------------
# saved-input hooks: partition over tp, then offload; undone in reverse for the recompute

class Chain:
    """Saved-tensor hooks applied in order on pack and in reverse order on unpack."""

    def __init__(self, hooks: list):
        self.hooks = hooks

    def pack(self, t: torch.Tensor) -> Any:
        for h in self.hooks:
            t = h.pack(t)
        return t

    def unpack(self, item: Any) -> torch.Tensor:
        for h in reversed(self.hooks):
            item = h.unpack(item)
        return item

    def close(self) -> None:
        for h in self.hooks:
            h.close()


class _Piece:
    """This tp rank's piece of a saved input: flat elements [r*c, (r+1)*c) of the input
    (c = ceil(numel / tp), the last piece zero-padded), with the input's shape."""
    __slots__ = ("piece", "shape", "numel")

    def __init__(self, piece: torch.Tensor, shape: torch.Size, numel: int):
        self.piece, self.shape, self.numel = piece, shape, numel


class TpPartition:
    """partition_activations: keep 1/tp of each saved input that requires grad, all-gather it
    back over `axis` for the recompute (every tp rank recomputes the same modules in the same
    order, so the gathers match)."""

    def __init__(self, axis: str, check: bool):
        from dsfn.runtime.mesh import current_mesh
        mesh = current_mesh()
        self.axis, self.check = axis, check
        self.n, self.rank = mesh.size(axis), mesh.local_rank(axis)
        self.bytes = 0

    def pack(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.requires_grad or t.device.type == "meta" or t.numel() < self.n:
            return t
        flat = t.detach().reshape(-1)
        if self.check:
            self._check_equal(flat)
        c = -(-flat.numel() // self.n)
        piece = flat[self.rank * c:(self.rank + 1) * c].clone()     # its own storage: the whole can be freed
        if piece.numel() < c:
            piece = torch.cat([piece, piece.new_zeros(c - piece.numel())])
        self.bytes += piece.numel() * piece.element_size()
        C.gauge("remat.partitioned_bytes", self.bytes)
        return _Piece(piece, t.shape, flat.numel())

    def unpack(self, item: Any) -> Any:
        if not isinstance(item, _Piece):
            return item
        whole = C.all_gather(item.piece, self.axis)
        return whole[:item.numel].view(item.shape)

    def _check_equal(self, flat: torch.Tensor) -> None:
        # the premise: the tp group holds this input whole and equal (a sum differs if not)
        from dsfn.errors import LayoutError
        w = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64) / flat.numel()
        sig = torch.stack([flat.double().sum(), (flat.double() * w).sum()]).reshape(1, 2)
        sigs = C.all_gather(sig, self.axis)
        if not bool((sigs == sigs[0]).all()):
            raise LayoutError(f"remat(partition_activations=True): a checkpointed module's input (shape "
                              f"{tuple(flat.shape)} flattened) differs across the {self.axis!r} group, so it cannot be "
                              "split over it and gathered back; the tensor parallel plan hands the module tp-local "
                              "inputs. Drop partition_activations")

    def close(self) -> None:
        self.bytes = 0
        C.gauge("remat.partitioned_bytes", 0)
