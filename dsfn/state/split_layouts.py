"""The layouts that split a tensor over a mesh axis: `FlatShard` (ZeRO's), `DimShard` (tensor
parallel's), `PackedDimShard` (a fused tensor's parts), `GroupDimShard` (blocks held by groups
of ranks) and `StageOwned` (pipeline stages). See `dsfn.state.layout` for what each holds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dsfn.errors import LayoutError, ShapeError
from dsfn.runtime import collectives as C
from dsfn.runtime.mesh import Mesh, current_mesh
from dsfn.state.layout_base import Layout


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
        return self.unshard_into(local, local.new_empty(m.size(self.axis) * local.numel()), m)

    def unshard_into(self, local: torch.Tensor, out: torch.Tensor, mesh: Mesh | None = None) -> torch.Tensor:
        """`unshard` gathered straight into `out` (flat, contiguous, at least size x the
        piece's elements; no staging copy): returns the logical tensor, a view of `out`.
        Reusing one `out` for many tensors (export) bounds the peak by the largest one."""
        m = mesh or current_mesh()
        piece = local.reshape(-1)
        flat = out[: m.size(self.axis) * piece.numel()]
        C.all_gather_into_([flat], [piece], self.axis, mesh=m)
        return flat[: self.numel].view(self.shape)

    def runs(self, mesh=None):
        m = mesh or current_mesh()
        c = self.chunk(m)
        start = min(m.local_rank(self.axis) * c, self.numel)
        stop = min(start + c, self.numel)
        return [(start, stop - start, 0)] if stop > start else []

    def axes(self):
        return (self.axis,)


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
        n, c = self.shape[self.dim], self.chunk(m)
        if self.dim == 0 and local.is_contiguous():     # rank pieces are consecutive rows
            full = local.new_empty((m.size(self.axis) * c, *local.shape[1:]))
            C.all_gather_into_([full.view(-1)], [local.view(-1)], self.axis, mesh=m)
            return full[:n]
        return _unshard_by_pieces(local, self, m, lambda r: [(min(r * c, n), max(0, min(c, n - r * c)), 0)])

    def runs(self, mesh=None):
        m = mesh or current_mesh()
        c = self.chunk(m)
        n = self.shape[self.dim]
        start = min(m.local_rank(self.axis) * c, n)
        return _dim_runs(self.shape, self.dim, [(start, min(c, n - start), 0)], c)

    def axes(self):
        return (self.axis,)


def _unshard_by_pieces(local: torch.Tensor, layout: Layout, mesh: Mesh,
                       blocks_of: Any) -> torch.Tensor:
    """The logical tensor of a layout splitting `layout.dim` over `layout.axis`, received one
    rank's piece at a time (`collectives.each_piece`) and copied into place: `blocks_of(r)`
    lists rank r's (logical start along dim, length, start in its piece). Peak: the result
    and one piece (an all-gather would hold every piece besides the result)."""
    full = local.new_empty(layout.shape)
    for r, piece in C.each_piece(local, layout.axis, mesh=mesh):
        for start, length, at in blocks_of(r):
            if length > 0:
                full.narrow(layout.dim, start, length).copy_(piece.narrow(layout.dim, at, length))
    return full


def _dim_runs(shape: tuple[int, ...], dim: int, blocks: list[tuple[int, int, int]],
              local_extent: int) -> list[tuple[int, int, int]]:
    """Runs of a piece made of `blocks` (logical start along `dim`, length, local start along
    `dim`) of a tensor of `shape`, the piece having `local_extent` rows along `dim`."""
    inner, outer, n = math.prod(shape[dim + 1:]), math.prod(shape[:dim]), shape[dim]
    out = []
    for o in range(outer):
        for a, k, la in blocks:
            if k > 0 and inner:
                out.append((o * n * inner + a * inner, k * inner, (o * local_extent + la) * inner))
    merged: list[tuple[int, int, int]] = []
    for r in out:      # adjacent in both spaces -> one run (a whole-tensor piece is one run)
        if merged and merged[-1][0] + merged[-1][1] == r[0] and merged[-1][2] + merged[-1][1] == r[2]:
            merged[-1] = (merged[-1][0], merged[-1][1] + r[1], merged[-1][2])
        else:
            merged.append(r)
    return merged


@dataclass(frozen=True)
class PackedDimShard(Layout):
    """A fused tensor split part by part over `axis`: `dim` is the concatenation of
    `parts` (sizes summing to shape[dim]); part p is split like DimShard (chunk
    ceil(p / size), the last chunks zero-padded) and this rank's piece concatenates its
    chunk of every part in order. Local size along `dim`: sum of the chunks."""
    axis: str
    dim: int
    shape: tuple[int, ...]
    parts: tuple[int, ...]

    def __post_init__(self):
        if sum(self.parts) != self.shape[self.dim] or any(p < 1 for p in self.parts):
            raise ShapeError(f"PackedDimShard: parts {self.parts} must be positive and sum to dim {self.dim} of "
                             f"shape {self.shape} ({self.shape[self.dim]})")

    def chunks(self, mesh: Mesh | None = None) -> tuple[int, ...]:
        n = (mesh or current_mesh()).size(self.axis)
        return tuple(_ceil_div(p, n) for p in self.parts)

    def local_shape(self, mesh=None):
        s = list(self.shape)
        s[self.dim] = sum(self.chunks(mesh))
        return tuple(s)

    def _blocks(self, mesh, rank: int | None = None) -> list[tuple[int, int, int]]:
        """(logical start along dim, valid length, local start) of each part's chunk held
        by `rank` along the axis (default: this rank)."""
        r = mesh.local_rank(self.axis) if rank is None else rank
        out, off, loc = [], 0, 0
        for p, c in zip(self.parts, self.chunks(mesh)):
            a = min(r * c, p)
            out.append((off + a, min(c, p - a), loc))
            off, loc = off + p, loc + c
        return out

    def shard(self, full, mesh=None):
        m = mesh or current_mesh()
        _check_shape(full, self.shape, self)
        pieces = []
        for (a, k, _), c in zip(self._blocks(m), self.chunks(m)):
            piece = full.narrow(self.dim, a, k)
            if k < c:
                pad = list(piece.shape)
                pad[self.dim] = c - k
                piece = torch.cat([piece, piece.new_zeros(pad)], dim=self.dim)
            pieces.append(piece)
        return torch.cat(pieces, dim=self.dim).contiguous()

    def unshard(self, local, mesh=None):
        m = mesh or current_mesh()
        return _unshard_by_pieces(local, self, m, lambda r: self._blocks(m, r))

    def runs(self, mesh=None):
        m = mesh or current_mesh()
        return _dim_runs(self.shape, self.dim, self._blocks(m), sum(self.chunks(m)))

    def axes(self):
        return (self.axis,)


@dataclass(frozen=True)
class GroupDimShard(Layout):
    """`dim` split into `groups` equal blocks over `axis` (size n, a multiple of `groups`):
    rank r holds block r // (n / groups), so the n / groups consecutive ranks of a block
    hold identical replicas (no padding; the lowest rank of a block is its owner, the
    others are `duplicate`). Tensor parallel's k/v projections at tp > kv heads: the
    groups are the kv heads and every rank holds the head its query heads use. Whoever
    writes to a replica keeps the replicas equal (tensor parallel sums their gradients)."""
    axis: str
    dim: int
    shape: tuple[int, ...]
    groups: int

    def __post_init__(self):
        if self.groups < 1 or self.shape[self.dim] % self.groups:
            raise ShapeError(f"GroupDimShard: {self.groups} groups do not split dim {self.dim} of shape {self.shape}")

    @property
    def block_size(self) -> int:
        return self.shape[self.dim] // self.groups

    def replicas(self, mesh: Any = None) -> int:
        """How many ranks along the axis hold each block (n / groups)."""
        n = (mesh or current_mesh()).size(self.axis)
        if n % self.groups:
            raise ShapeError(f"GroupDimShard: {self.groups} groups over axis {self.axis!r} of size {n}; the axis "
                             "size must be a multiple of the groups")
        return n // self.groups

    def block(self, mesh: Any = None, rank: int | None = None) -> int:
        """The block rank `rank` along the axis (default: this rank) holds."""
        m = mesh or current_mesh()
        return (m.local_rank(self.axis) if rank is None else rank) // self.replicas(m)

    def local_shape(self, mesh=None):
        s = list(self.shape)
        s[self.dim] = self.block_size
        return tuple(s)

    def shard(self, full, mesh=None):
        _check_shape(full, self.shape, self)
        return full.narrow(self.dim, self.block(mesh) * self.block_size, self.block_size).clone()

    def unshard(self, local, mesh=None):
        m = mesh or current_mesh()
        k = self.replicas(m)
        return _unshard_by_pieces(local, self, m,
                                  lambda r: [(r // k * self.block_size, self.block_size, 0)] if r % k == 0 else [])

    def runs(self, mesh=None):
        return _dim_runs(self.shape, self.dim, [(self.block(mesh) * self.block_size, self.block_size, 0)], self.block_size)

    def axes(self):
        return (self.axis,)

    def duplicate(self, mesh=None):
        m = mesh or current_mesh()
        return m.local_rank(self.axis) % self.replicas(m) != 0


@dataclass(frozen=True)
class StageOwned(Layout):
    """The whole tensor on the ranks at `owners` along `axis`, nothing elsewhere: pipeline
    parallelism's layout of a parameter (and its optimizer-state mirrors), held by the stages
    that use it ("pp" indices; a tied embedding's: the first and the last stage).

    Invariant: an owner's piece is the logical tensor (`shape`); every other rank along
    `axis` holds a 0-element tensor of shape (0,) (same dtype and device). `owners[0]`
    holds the canonical copy: `unshard` broadcasts it, and every other owner is a
    `duplicate` (its elements are counted, in norms and checkpoints, by owners[0] only).
    Whoever updates the leaf keeps the owners' copies equal (a pipeline sums a tied
    parameter's gradients over its owners before the update). `owners` is sorted, unique
    and non-empty; every owner must lie inside the axis (checked where the mesh is known).
    """
    axis: str
    owners: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self):
        owners = self.owners
        if not isinstance(owners, tuple) or not all(isinstance(o, int) and not isinstance(o, bool) for o in owners):
            raise LayoutError(f"StageOwned: owners {owners!r} must be a tuple of ints (indices along axis "
                              f"{self.axis!r}), e.g. owners=(0,) or owners=(0, {self.axis}_size - 1)")
        if not owners:
            raise LayoutError(f"StageOwned: owners is empty; name at least one index along axis {self.axis!r} "
                              "that holds the tensor")
        if any(o < 0 for o in owners):
            raise LayoutError(f"StageOwned: owners {owners} has a negative index; owners are indices 0 .. size-1 "
                              f"along axis {self.axis!r}")
        if list(owners) != sorted(set(owners)):
            raise LayoutError(f"StageOwned: owners {owners} must be sorted and unique "
                              f"(pass owners={tuple(sorted(set(owners)))})")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in self.shape):
            raise ShapeError(f"StageOwned: shape {self.shape!r} is not a shape (a tuple of non-negative ints)")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def _index(self, mesh: Any) -> int:
        """This rank's index along the axis, after checking every owner lies inside it."""
        m = mesh or current_mesh()
        n = m.size(self.axis)
        if self.owners[-1] >= n:
            raise LayoutError(f"StageOwned: owner {self.owners[-1]} lies outside mesh axis {self.axis!r} of size "
                              f"{n} (owners {self.owners}); owners are indices 0 .. {n - 1}: build the layout "
                              f"for this mesh (init_mesh({self.axis}=...)) or re-split the stages")
        return m.local_rank(self.axis)

    def holds(self, mesh=None):
        return self._index(mesh) in self.owners

    def local_shape(self, mesh=None):
        return tuple(self.shape) if self.holds(mesh) else (0,)

    def shard(self, full, mesh=None):
        _check_shape(full, self.shape, self)
        return full.clone() if self.holds(mesh) else full.new_empty((0,))

    def unshard(self, local, mesh=None):
        """owners[0]'s copy broadcast along the axis (collective: every rank along it calls it);
        owners[0] gets its own piece back, as Replicated does."""
        m = mesh or current_mesh()
        first = self._index(m) == self.owners[0]
        if first:
            _check_shape(local, self.shape, self)
        full = local if first else local.new_empty(self.shape)
        C.broadcast_(full, self.axis, src=self.owners[0], mesh=m)
        return full

    def runs(self, mesh=None):
        return [(0, self.numel, 0)] if self.numel and self.holds(mesh) else []

    def axes(self):
        return (self.axis,)

    def duplicate(self, mesh=None):
        return self._index(mesh) in self.owners[1:]


def _check_shape(full: torch.Tensor, shape: tuple[int, ...], layout: Layout) -> None:
    if not isinstance(full, torch.Tensor):
        from dsfn.errors import LeafTypeError
        raise LeafTypeError(f"{layout} needs a torch.Tensor, got {type(full).__name__}")
    if tuple(full.shape) != tuple(shape):
        raise ShapeError(f"{layout} describes a tensor of shape {tuple(shape)}, got {tuple(full.shape)}")
