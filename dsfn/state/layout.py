"""Layouts: which part of a logical tensor this rank holds, and where.

A layout converts both ways between the *logical* tensor (what the single-process
reference holds) and this rank's *physical* piece:

    local = layout.shard(full, mesh)      # no communication: take this rank's piece
    full  = layout.unshard(local, mesh)   # collective along the layout's axis

A leaf with a non-trivial layout is stored as `Placed(data, layout)`, a pytree node
whose single child is the tensor and whose metadata is the layout, so tree maps go
straight to the tensor while the layout travels with it (and two trees only match
when their layouts match). A plain tensor leaf is replicated.

Layouts the foundation knows:
- `Replicated`: every rank holds the whole tensor.
- `FlatShard(axis, shape)`: flattened, zero-padded to a multiple of the axis size,
  rank i holds elements [i*c, (i+1)*c) with c = ceil(numel / size). ZeRO's layout.
- `DimShard(axis, dim, shape)`: split along `dim` into `size` chunks of ceil(n / size),
  the last chunks zero-padded so every rank's piece has the same shape. TP's layout.
- `Offloaded(inner, device)`: `inner`'s piece, kept on another device (host memory).
Padding never leaves a layout: `unshard` trims it.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any

import torch

from dsfn import tree
from dsfn.errors import ShapeError
from dsfn.runtime import collectives as C
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


@dataclass(frozen=True)
class Replicated(Layout):
    shape: tuple[int, ...] = ()

    def shard(self, full, mesh=None):
        return full

    def unshard(self, local, mesh=None):
        return local

    def local_shape(self, mesh=None):
        return self.shape


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class FlatShard(Layout):
    """Flattened and split evenly over `axis`; `shape` is the logical shape."""
    axis: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def chunk(self, mesh: Mesh | None = None) -> int:
        return _ceil_div(self.numel, (mesh or current_mesh()).size(self.axis))

    def local_shape(self, mesh=None):
        return (self.chunk(mesh),)

    def shard(self, full, mesh=None):
        m = mesh or current_mesh()
        _check_shape(full, self.shape, self)
        c = self.chunk(m)
        start = min(m.local_rank(self.axis) * c, self.numel)
        piece = full.reshape(-1)[start:start + c]
        if piece.numel() < c:   # the last ranks hold padding
            piece = torch.cat([piece, piece.new_zeros(c - piece.numel())])
        return piece.clone()

    def unshard(self, local, mesh=None):
        m = mesh or current_mesh()
        flat = C.all_gather(local.reshape(-1), self.axis, mesh=m)
        return flat[: self.numel].reshape(self.shape)


@dataclass(frozen=True)
class DimShard(Layout):
    """Split along `dim` over `axis`; `shape` is the logical shape."""
    axis: str
    dim: int
    shape: tuple[int, ...]

    def chunk(self, mesh: Mesh | None = None) -> int:
        return _ceil_div(self.shape[self.dim], (mesh or current_mesh()).size(self.axis))

    def local_shape(self, mesh=None):
        s = list(self.shape)
        s[self.dim] = self.chunk(mesh)
        return tuple(s)

    def shard(self, full, mesh=None):
        m = mesh or current_mesh()
        _check_shape(full, self.shape, self)
        c = self.chunk(m)
        n = self.shape[self.dim]
        start = min(m.local_rank(self.axis) * c, n)
        piece = full.narrow(self.dim, start, min(c, n - start))
        if piece.shape[self.dim] < c:
            pad = list(piece.shape)
            pad[self.dim] = c - piece.shape[self.dim]
            piece = torch.cat([piece, piece.new_zeros(pad)], dim=self.dim)
        return piece.clone()

    def unshard(self, local, mesh=None):
        m = mesh or current_mesh()
        moved = local.movedim(self.dim, 0).contiguous()
        full = C.all_gather(moved, self.axis, mesh=m)
        return full[: self.shape[self.dim]].movedim(0, self.dim).contiguous()


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


def _check_shape(full: torch.Tensor, shape: tuple[int, ...], layout: Layout) -> None:
    if not isinstance(full, torch.Tensor):
        from dsfn.errors import LeafTypeError
        raise LeafTypeError(f"{layout} needs a torch.Tensor, got {type(full).__name__}")
    if tuple(full.shape) != tuple(shape):
        raise ShapeError(f"{layout} describes a tensor of shape {tuple(shape)}, got {tuple(full.shape)}")


@dataclass(frozen=True)
class Placed:
    """A physical leaf: this rank's `data` under `layout`. A pytree node, not a leaf."""
    data: torch.Tensor
    layout: Layout


tree.register_node(Placed, lambda p: ((p.data,), p.layout), lambda layout, children: Placed(children[0], layout))


def is_placed(x: Any) -> bool:
    return isinstance(x, Placed)


def layout_of(x: Any) -> Layout:
    return x.layout if isinstance(x, Placed) else Replicated(tuple(x.shape) if isinstance(x, torch.Tensor) else ())


def place(full: torch.Tensor, layout: Layout, mesh: Mesh | None = None) -> Any:
    """Logical tensor -> this rank's physical leaf (a plain tensor when replicated)."""
    if isinstance(layout, Replicated):
        return full
    return Placed(layout.shard(full, mesh), layout)


def unplace(x: Any, mesh: Mesh | None = None) -> Any:
    """Physical leaf -> logical tensor (collective for sharded layouts)."""
    return x.layout.unshard(x.data, mesh) if isinstance(x, Placed) else x


def place_tree(logical: Any, layouts: Any, mesh: Mesh | None = None) -> Any:
    """Apply a tree of layouts (same structure as `logical`) leaf by leaf."""
    return tree.map(lambda x, l: place(x, l, mesh), logical, layouts,
                    is_leaf=lambda x: isinstance(x, Layout))


def gather_tree(physical: Any, mesh: Mesh | None = None) -> Any:
    """Every Placed leaf back to its logical tensor; plain leaves pass through."""
    return tree.map(lambda x: unplace(x, mesh), physical, is_leaf=is_placed)


def data(x: Any) -> Any:
    """The local tensor of a leaf, placed or not."""
    return x.data if isinstance(x, Placed) else x


def mirrored_param(path: str, shape: tuple[int, ...] | None, param_shapes: dict[str, tuple[int, ...]]) -> str | None:
    """The parameter an optimizer-state leaf mirrors: the longest dotted suffix of its
    `path` that names a parameter of the same (logical) `shape` (Adam's `mu.<name>`,
    mixed precision's `master.<name>` -> `<name>`). The one rule by which ZeRO shards,
    offload moves and zenflow masks optimizer state along with its parameter."""
    if shape is None:
        return None
    parts = path.split(".")
    for k in range(len(parts)):
        name = ".".join(parts[k:])
        s = param_shapes.get(name)
        if s is not None and tuple(s) == tuple(shape):
            return name
    return None
