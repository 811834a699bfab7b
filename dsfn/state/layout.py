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
- `PackedDimShard(axis, dim, shape, parts)`: a fused tensor (qkv, gate_up) whose `dim`
  concatenates `parts`; every part is split like DimShard and a rank's piece is its chunk
  of each part, in part order (rank r of a fused qkv holds [q_r; k_r; v_r]).
- `GroupDimShard(axis, dim, shape, groups)`: `dim` split into `groups` equal blocks, `groups`
  dividing the axis size n; the n / groups consecutive ranks of a block hold identical
  replicas of it. Tensor parallel's k/v projections with fewer kv heads than tp.
- `StageOwned(axis, owners, shape)`: the ranks at `owners` along `axis` (pipeline
  parallelism's "pp": the stages that use the parameter) hold the whole tensor, every
  other rank an empty one (shape (0,)). A second owner (a tied embedding's last stage)
  holds a replica of the first's (`duplicate`).
- `Nested(inner, outer)`: `outer`'s piece of `inner`'s piece: how ZeRO shards a
  tensor-parallel shard over dp (`Nested(DimShard("tp", ...), FlatShard("dp", piece shape))`).
  A rank whose inner piece is empty (`holds` false: a StageOwned non-owner) holds an empty
  piece and `outer` is skipped.
- `Offloaded(inner, device)`: `inner`'s piece, kept on another device (host memory).
Padding never leaves a layout: `unshard` trims it. A piece that repeats one another rank
along the layout's axes holds (`duplicate(mesh)`, a GroupDimShard replica) is neither
counted in reductions over the whole nor written to checkpoints.

Every layout also lists its piece as `runs(mesh)`: contiguous runs of the row-major
flattened logical tensor, `(logical start, length, offset in the flattened piece)`,
ascending — how checkpoints describe and reshard any layout. `MeshCoords` stands in for
a mesh when the runs of another rank are needed.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any

import torch

from dsfn import tree
from dsfn.errors import LayoutError, ShapeError
from dsfn.runtime import collectives as C
from dsfn.placed import Placed, is_placed  # noqa: F401  (re-exported: the leaf these layouts describe)
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


def _check_shape(full: torch.Tensor, shape: tuple[int, ...], layout: Layout) -> None:
    if not isinstance(full, torch.Tensor):
        from dsfn.errors import LeafTypeError
        raise LeafTypeError(f"{layout} needs a torch.Tensor, got {type(full).__name__}")
    if tuple(full.shape) != tuple(shape):
        raise ShapeError(f"{layout} describes a tensor of shape {tuple(shape)}, got {tuple(full.shape)}")


def layout_of(x: Any) -> Layout:
    return x.layout if isinstance(x, Placed) else Replicated(tuple(x.shape) if isinstance(x, torch.Tensor) else ())


def leaf_records(state: Any) -> list[tuple[str, Layout, tuple[int, ...], torch.dtype, int]]:
    """(path, layout, local shape, dtype, bytes) of every tensor leaf of `state`, the pieces
    this rank holds (`Step.explain`'s leaves; a meta piece counts the bytes it stands for:
    `dsfn.estimate` reads a meta state placed on a virtual mesh with it)."""
    out = []
    for path, x in tree.leaves_with_path(state, is_leaf=is_placed):
        t = x.data if isinstance(x, Placed) else x
        if isinstance(t, torch.Tensor):
            out.append((path, layout_of(x), tuple(t.shape), t.dtype, t.numel() * t.element_size()))
    return out


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


def stage_copies(layout: Any) -> StageOwned | None:
    """The StageOwned of a leaf held as copies by several stages (a tied embedding and
    head), directly or as the inner layout of a Nested (ZeRO's shard of it), else None.
    Each owner's gradient of such a leaf is a part (its own stage's uses): the update
    needs their sum over `axis`, which whoever takes the gradients over forms."""
    while isinstance(layout, Nested):
        layout = layout.inner
    return layout if isinstance(layout, StageOwned) and len(layout.owners) > 1 else None


def stage_split(layout: Any) -> tuple[StageOwned | None, Any]:
    """(the StageOwned, the layout inside the stage or None) of a leaf's layout: `StageOwned`
    itself, or `Nested(StageOwned, inner)` (the stage's tensor split further inside the stage,
    e.g. tensor_parallel's DimShard); (None, None) for any other layout."""
    if isinstance(layout, StageOwned):
        return layout, None
    if isinstance(layout, Nested) and isinstance(layout.inner, StageOwned):
        return layout.inner, layout.outer
    return None, None


def stage_piece_shape(layout: Any) -> tuple[int, ...]:
    """The shape of an owner's piece of a leaf laid out by stages, seen from any rank along
    the stages' axis: `StageOwned`'s whole tensor, or for `Nested(StageOwned, X)` (the stage's
    tensor split further inside the stage: tensor_parallel's DimShard) this rank's piece of X
    (X's axes lie inside a stage, so a non-owner's coordinates give an owner's piece)."""
    owned, inner = stage_split(layout)
    if owned is None:
        raise LayoutError(f"stage_piece_shape: {layout!r} is not a stage's layout (StageOwned, or Nested with a "
                          "StageOwned inside)")
    return tuple(inner.local_shape()) if inner is not None else tuple(owned.shape)


def shard_further(x: Any, make: Any) -> Placed:
    """Put the layout `make(shape)` on top of whatever layout leaf `x` has: `shape` is the
    shape of x's local piece; a placed leaf becomes `Nested(its layout, make(shape))`."""
    if isinstance(x, Placed):
        outer = make(tuple(x.data.shape))
        return Placed(outer.shard(x.data), Nested(x.layout, outer))
    layout = make(tuple(x.shape))
    return Placed(layout.shard(x), layout)


def inner_view(x: Any, piece: torch.Tensor) -> Any:
    """`piece` (x's outer layer undone, e.g. gathered over dp) as the transforms inside see it:
    a Placed with the inner layout for a Nested leaf, else the plain tensor."""
    if isinstance(x, Placed) and isinstance(x.layout, Nested):
        return Placed(piece, x.layout.inner)
    return piece


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


def map_with_mirrors(state: Any, fn: Any, params: bool = True) -> Any:
    """`state` with `fn(owner, leaf) -> new leaf` applied to every parameter (`owner`: its own
    path) and to every optimizer-state leaf that mirrors one (`owner`: the parameter's path,
    by `mirrored_param` on the leaves' logical shapes as they are before this call), so a
    parameter and its mirrors always take one layout. With `params=False` only the mirrors
    are mapped. Leaves that mirror nothing (step counts, scalars) are left as they are."""
    shapes = {p: _logical_shape_of(x) for p, x in tree.leaves_with_path(state.params, is_leaf=is_placed)}

    def mirror(path: str, x: Any) -> Any:
        if not isinstance(x, (torch.Tensor, Placed)):
            return x
        owner = mirrored_param(path, _logical_shape_of(x), shapes)
        return x if owner is None else fn(owner, x)
    new_params = tree.map_with_path(fn, state.params, is_leaf=is_placed) if params else state.params
    opt = getattr(state, "opt_state", None)
    new_opt = tree.map_with_path(mirror, opt, is_leaf=is_placed) if opt is not None else opt
    return state.replace(params=new_params, opt_state=new_opt)


def _logical_shape_of(x: Any) -> tuple[int, ...]:
    return tuple(x.layout.shape) if isinstance(x, Placed) else tuple(x.shape)


def sum_stage_copies(parts: list[torch.Tensor], copies: list[StageOwned],
                     owner_numel: list[int]) -> list[torch.Tensor]:
    """The one sum of a tied leaf's gradient parts over the stages that hold copies of it (a
    tied embedding and head: `stage_copies`), so every copy takes the same update. `parts[k]`:
    this rank's gradient of leaf k (an owner's part, or a non-owner's empty tensor),
    `copies[k]` its StageOwned, `owner_numel[k]` the elements of an owner's part (a non-owner
    joins with that many zeros: the owners' parts are alike, the same coordinates inside the
    stage). Every rank along each copies' axis joins one all-reduce per (axis, dtype), in the
    order given; an owner gets the sum in its part's shape, a non-owner its part back."""
    todo: dict[tuple[str, torch.dtype], list[int]] = {}
    for k, (part, owned) in enumerate(zip(parts, copies)):
        todo.setdefault((owned.axis, part.dtype), []).append(k)
    out = list(parts)
    for (axis, dtype), ks in todo.items():
        flat_parts = [parts[k].reshape(-1) if copies[k].holds() else
                      torch.zeros(owner_numel[k], dtype=dtype, device=parts[k].device) for k in ks]
        flat = C.all_reduce_(torch.cat(flat_parts), axis, "sum")
        at = 0
        for k, part in zip(ks, flat_parts):
            if copies[k].holds():
                out[k] = flat[at:at + part.numel()].view_as(parts[k]).clone()
            at += part.numel()
    return out
