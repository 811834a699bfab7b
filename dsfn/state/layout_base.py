"""The layout protocol (`Layout`) and the layouts that split nothing themselves: `Replicated`
(the whole tensor), `Nested` (one layout's piece split by another), `Offloaded` (a piece kept
on another device), and `MeshCoords` (a mesh stand-in for another rank's `runs`).

The layouts that split a tensor over a mesh axis are in `dsfn.state.split_layouts`; the
rules over placed leaves and trees in `dsfn.state.placement`; `dsfn.state.layout` describes
them all and re-exports every name.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any

import torch

from dsfn.runtime.mesh import Mesh, current_mesh


class Layout(abc.ABC):
    """Base class; subclasses are frozen (hashable) dataclasses."""

    @abc.abstractmethod
    def shard(self, full: torch.Tensor, mesh: Mesh | None = None) -> torch.Tensor:
        """This rank's piece of the logical tensor `full` (no communication)."""

    @abc.abstractmethod
    def unshard(self, local: torch.Tensor, mesh: Mesh | None = None) -> torch.Tensor:
        """The logical tensor, rebuilt from every rank's `local` piece (collective)."""

    @abc.abstractmethod
    def local_shape(self, mesh: Mesh | None = None) -> tuple[int, ...]:
        """Shape of this rank's piece."""

    @abc.abstractmethod
    def runs(self, mesh: Any = None) -> list[tuple[int, int, int]]:
        """This rank's piece as runs of the flattened logical tensor (see the module docstring)."""

    def axes(self) -> tuple[str, ...]:
        """The mesh axes this layout splits the tensor over (its pieces are disjoint along
        them, except for replicas: see `duplicate`)."""
        return ()

    def duplicate(self, mesh: Any = None) -> bool:
        """True when this rank's piece is a replica of one that a lower rank along the layout's
        axes holds: the elements are counted (norms, checkpoints) by that rank only."""
        return False

    def holds(self, mesh: Any = None) -> bool:
        """Whether this rank holds a piece at all. False only where a layout gives some ranks
        nothing (a StageOwned non-owner: a 0-element piece, whatever the shape); a layout
        nested over it (`Nested`) then has nothing to split there. A layout that only moves
        an `inner` layout's piece (Offloaded, offload's NvmeOffloaded) answers for its inner."""
        inner = getattr(self, "inner", None)
        return inner.holds(mesh) if isinstance(inner, Layout) else True


@dataclass(frozen=True)
class Replicated(Layout):
    shape: tuple[int, ...] = ()

    def shard(self, full, mesh=None):
        return full

    def unshard(self, local, mesh=None):
        return local

    def local_shape(self, mesh=None):
        return self.shape

    def runs(self, mesh=None):
        n = math.prod(self.shape)
        return [(0, n, 0)] if n else []


@dataclass(frozen=True)
class Nested(Layout):
    """`outer`'s piece of `inner`'s piece: the logical tensor is split by `inner` (e.g.
    tensor parallel's DimShard over tp), then this rank's inner piece is split by `outer`,
    whose `shape` is inner's local shape (e.g. ZeRO's FlatShard over dp)."""
    inner: Layout
    outer: Layout

    @property
    def shape(self) -> tuple[int, ...]:
        return self.inner.shape

    # Where `inner` gives this rank nothing (`holds` false: a StageOwned non-owner), the piece is
    # inner's empty one and `outer` is skipped. Every rank of outer's axes then skips it too: they
    # differ from this rank only along outer's axes, and whether a layout holds a piece depends
    # only on the rank's coordinates along its own axes (ZeRO's dp group lies inside one stage).
    def local_shape(self, mesh=None):
        if not self.inner.holds(mesh):
            return self.inner.local_shape(mesh)
        return self.outer.local_shape(mesh)

    def shard(self, full, mesh=None):
        piece = self.inner.shard(full, mesh)
        return self.outer.shard(piece, mesh) if self.inner.holds(mesh) else piece

    def unshard(self, local, mesh=None):
        if not self.inner.holds(mesh):
            return self.inner.unshard(local, mesh)
        return self.inner.unshard(self.outer.unshard(local, mesh), mesh)

    def holds(self, mesh=None):
        return self.inner.holds(mesh) and self.outer.holds(mesh)

    def runs(self, mesh=None):
        m = mesh or current_mesh()
        if not self.inner.holds(m):
            return []
        inner = self.inner.runs(m)           # (logical, length, offset in the inner piece)
        out: list[tuple[int, int, int]] = []
        k = 0
        for a, n, loc in self.outer.runs(m):  # (offset in the inner piece, length, offset in ours)
            while k < len(inner) and inner[k][2] + inner[k][1] <= a:
                k += 1
            j = k
            while j < len(inner) and inner[j][2] < a + n:
                s, length, off = inner[j]
                lo, hi = max(a, off), min(a + n, off + length)
                if lo < hi:
                    out.append((s + lo - off, hi - lo, loc + lo - a))
                j += 1
        return out

    def axes(self):
        return self.inner.axes() + tuple(a for a in self.outer.axes() if a not in self.inner.axes())

    def duplicate(self, mesh=None):
        if not self.inner.holds(mesh):
            return self.inner.duplicate(mesh)
        return self.inner.duplicate(mesh) or self.outer.duplicate(mesh)


@dataclass(frozen=True)
class Offloaded(Layout):
    """`inner`'s piece kept on `device` (e.g. "cpu"); `home` is where compute happens."""
    inner: Layout
    device: str = "cpu"
    home: str = "cpu"

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape (of the layout it wraps)."""
        return self.inner.shape

    def local_shape(self, mesh=None):
        return self.inner.local_shape(mesh)

    def shard(self, full, mesh=None):
        return self.inner.shard(full, mesh).to(self.device)

    def unshard(self, local, mesh=None):
        return self.inner.unshard(local.to(self.home), mesh)

    def runs(self, mesh=None):
        return self.inner.runs(mesh)

    def axes(self):
        return self.inner.axes()

    def duplicate(self, mesh=None):
        return self.inner.duplicate(mesh)

    def holds(self, mesh=None):
        return self.inner.holds(mesh)


@dataclass(frozen=True)
class Quantized(Layout):
    """`inner`'s piece (1-D: a FlatShard's) stored block-wise quantized: one uint8 tensor, the
    piece's codes padded to whole blocks of `block`, then its fp32 scales
    (`dsfn.runtime.quantized.WireFormat.pack`); `dtype` is the logical dtype it dequantizes
    to. ZeRO++'s frozen weights held quantized (`shard_zero(3, quantize_frozen=...)`): lossy
    by design, so only constants use it, never state: `runs` refuses (no checkpoint reads
    or writes such a piece)."""
    inner: Layout
    fmt: str = "int8"
    block: int = 2048
    dtype: torch.dtype = torch.float32

    @property
    def shape(self) -> tuple[int, ...]:
        return self.inner.shape

    @property
    def wire(self) -> Any:
        from dsfn.runtime.quantized import WireFormat
        return WireFormat(self.fmt, self.block, 0)

    def piece_numel(self, mesh=None) -> int:
        return math.prod(self.inner.local_shape(mesh))

    def local_shape(self, mesh=None):
        return (self.wire.packed_bytes(self.piece_numel(mesh)),)

    def shard(self, full, mesh=None):
        return self.wire.pack(self.inner.shard(full, mesh))

    def dequantized(self, local, mesh=None) -> torch.Tensor:
        """This rank's inner piece, dequantized (no communication)."""
        return self.wire.unpack(local, self.piece_numel(mesh), self.dtype).view(self.inner.local_shape(mesh))

    def unshard(self, local, mesh=None):
        return self.inner.unshard(self.dequantized(local, mesh), mesh)

    def runs(self, mesh=None):
        from dsfn.errors import LayoutError
        raise LayoutError("a piece held quantized (shard_zero(3, quantize_frozen=...): a frozen weight) is not "
                          "state: no checkpoint saves or loads it; export the model with "
                          "dsfn.checkpoint.export_state(state, out, apply_fn=...) (it dequantizes)")

    def axes(self):
        return self.inner.axes()

    def duplicate(self, mesh=None):
        return self.inner.duplicate(mesh)


@dataclass(frozen=True)
class MeshCoords:
    """A mesh stand-in with given axis sizes and this rank's coordinates, for computing
    another rank's `runs` (e.g. a saved rank's, when loading a checkpoint)."""
    sizes: tuple[tuple[str, int], ...]
    coords: tuple[tuple[str, int], ...]

    @staticmethod
    def of(sizes: dict[str, int], coords: dict[str, int]) -> "MeshCoords":
        return MeshCoords(tuple(sorted(sizes.items())), tuple(sorted(coords.items())))

    def size(self, axis: str) -> int:
        return dict(self.sizes).get(axis, 1)

    def local_rank(self, axis: str) -> int:
        return dict(self.coords).get(axis, 0)
