"""A device mesh with named axes (dp, sp, tp, ...) over torch.distributed process groups.

Ranks are laid out row-major in the order the axes are given, the last axis varying
fastest: with `Mesh({"dp": 2, "tp": 2})` ranks 0,1 form the first tp group and ranks
0,2 the first dp group. Axis sizes multiply to the world size.

Every rank must construct the same mesh (process-group creation is collective).
A mesh in a single process has every axis of size 1 and no groups.

An axis can be *split* (`Mesh.split`, hybrid sharding): `split("dp", k)` adds the axes
"dp_shard" (blocks of k consecutive ranks of each dp group: with the launcher's node-major
ranks, the ranks of one node when k divides the dp ranks a node holds) and "dp_replicate"
(the ranks at the same place in every block). Collectives, layouts and checkpoints take
them as any axis. The mesh knows the launcher's topology (`Mesh.topology`,
`dsfn.runtime.topology`), hence which axes cross nodes (`Mesh.spans_nodes`). Without `init_mesh`,
the mesh is all-dp over the world (initialising the process group first when launched
under torchrun). A transform working over an axis the mesh does not name (tp, sp, ...)
on more than one rank is an error (`ensure_ready`), never a silent size-1 axis.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import threading
from typing import Any, Iterator, Mapping, Sequence

import torch.distributed as dist

from dsfn.errors import MeshError
from dsfn.runtime import env
from dsfn.runtime.topology import Topology, topology

DEFAULT_AXES = ("dp", "sp", "tp", "pp")
# Over the data-parallel axis, size 1 is exactly right when the mesh does not name it
# (a pure tp/sp run); over any other axis a transform would silently do nothing.
_SIZE_ONE_OK = ("dp",)


class Mesh:
    """Named axes over the world; `group(axis)` is this rank's process group along it."""

    def __init__(self, axes: Mapping[str, int] | None = None):
        world = env.world_size()
        axes = dict(axes) if axes else {"dp": -1}
        self.named: tuple[str, ...] = tuple(axes)    # axes the caller asked for (not defaulted)
        for name, size in axes.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise MeshError(f"mesh axis names must be identifiers, got {name!r}")
            if not isinstance(size, int) or (size < 1 and size != -1):
                raise MeshError(f"mesh axis {name!r} has size {size!r}; sizes are positive ints "
                                "(or -1 once, meaning 'the rest of the world')")
        inferred = [n for n, s in axes.items() if s == -1]
        if len(inferred) > 1:
            raise MeshError(f"only one mesh axis may be -1 (inferred), got {inferred}")
        known = math.prod(s for s in axes.values() if s != -1)
        if inferred:
            if world % known:
                raise MeshError(f"world size {world} is not divisible by the fixed axes "
                                f"{ {n: s for n, s in axes.items() if s != -1} } (product {known})")
            axes[inferred[0]] = world // known
        if math.prod(axes.values()) != world:
            raise MeshError(f"mesh axes {axes} multiply to {math.prod(axes.values())}, but the world "
                            f"size is {world}; choose sizes whose product is {world}")
        for name in DEFAULT_AXES:   # transforms may always ask for the standard axes
            axes.setdefault(name, 1)
        self.axes: dict[str, int] = axes
        self.rank = env.rank()
        self.coords = self._coords_of(self.rank)
        self._groups: dict[str, object] = {}
        self._ranks: dict[str, list[int]] = {}
        self.topology: Topology = topology()
        self.splits: dict[str, int] = {}           # axis -> its shard blocks' size (`split`)
        self._sub: dict[str, tuple[str, int]] = {}  # split axis name -> (parent axis, size)
        self._sub_groups: dict[str, list[list[int]]] = {}      # split axis name -> all its groups
        self._split_names: dict[str, tuple[str, str]] = {}     # axis -> the names of its split
        if env.is_distributed():
            self._build_groups()
        else:
            self._ranks = {a: [0] for a in self.axes}

    is_virtual = False

    @classmethod
    def virtual(cls, axes: Mapping[str, int], coords: Mapping[str, int] | None = None,
                topology: Topology | None = None) -> "Mesh":
        """A mesh of `axes` (sizes, in this order) as the rank at `coords` (default: index 0
        on every axis) of a world of their product sees it, laid out on `topology` (default:
        one node): sizes, ranks and groups' ranks, but no process group — nothing can be
        communicated over it (`dsfn.estimate` places meta states on it; `split` makes no group)."""
        self = cls.__new__(cls)
        self.named = tuple(axes)
        self.axes = dict(axes)
        for name in DEFAULT_AXES:
            self.axes.setdefault(name, 1)
        world = math.prod(self.axes.values())
        self.rank = self._rank_of({a: (coords or {}).get(a, 0) for a in self.axes})
        self.coords = self._coords_of(self.rank)
        self.topology = topology or Topology(1, world, "one node (a virtual mesh)")
        self.is_virtual = True
        self._groups, self.splits, self._sub, self._sub_groups, self._split_names = {}, {}, {}, {}, {}
        self._ranks = {a: next(g for g in self.axis_groups(a) if self.rank in g) for a in self.axes}
        return self

    def _coords_of(self, rank: int) -> dict[str, int]:
        coords, rest = {}, rank
        for name, size in reversed(self.axes.items()):
            coords[name] = rest % size
            rest //= size
        return {n: coords[n] for n in self.axes}

    def _rank_of(self, coords: Mapping[str, int]) -> int:
        rank = 0
        for name, size in self.axes.items():
            rank = rank * size + coords[name]
        return rank

    def _build_groups(self) -> None:
        names = list(self.axes)
        for axis in names:
            others = [n for n in names if n != axis]
            # every rank creates every group in the same order (new_group is collective)
            for other_coords in itertools.product(*(range(self.axes[n]) for n in others)):
                fixed = dict(zip(others, other_coords))
                ranks = [self._rank_of({**fixed, axis: i}) for i in range(self.axes[axis])]
                if self.axes[axis] == 1:
                    group = channel = None
                else:
                    group = dist.group.WORLD if len(ranks) == env.world_size() else dist.new_group(ranks)
                    channel = dist.new_group(ranks)     # the axis's gradient channel (`grad_channel`)
                if self.rank in ranks:
                    self._groups[axis] = group
                    self._groups[grad_channel(axis)] = channel
                    self._ranks[axis] = ranks

    # -- split axes (hybrid sharding) ----------------------------------------------------------------
    def split(self, axis: str, inner: int, names: tuple[str, str] | None = None) -> tuple[str, str]:
        """Split `axis` into blocks of `inner` consecutive ranks: returns the names of the
        block axis (`names[0]`, default "<axis>_shard", size `inner`) and of the axis across
        blocks (`names[1]`, default "<axis>_replicate", size size(axis) // inner), creating
        their process groups on the first call (collective: every rank calls it at the same
        point, as the first place of a hybrid ZeRO does). A split axis can be split again (a
        shard group across nodes into its node-local part and the part across nodes). One
        split per axis: another size is a MeshError."""
        axis = self._check_axis(axis)
        shard, replicate = names or (f"{axis}_shard", f"{axis}_replicate")
        have = self.splits.get(axis)
        if have == inner:
            return self._split_names[axis]
        if have is not None:
            raise MeshError(f"the mesh already splits {axis!r} into shard groups of {have}; one hybrid layout per "
                            f"mesh axis: use shard groups of {have} in every transform, or init_mesh(...) again")
        n = self.size(axis)
        if isinstance(inner, bool) or not isinstance(inner, int) or inner < 1 or n % inner:
            raise MeshError(f"cannot split {axis!r} (size {n}) into groups of {inner!r}: use a divisor of {n}")
        if shard in self.axes or replicate in self.axes or shard in self._sub or replicate in self._sub:
            raise MeshError(f"the mesh already has an axis named {shard!r} or {replicate!r}")
        self._sub[shard], self._sub[replicate] = (axis, inner), (axis, n // inner)
        for name in (shard, replicate):
            self._sub_groups[name] = []
        for ranks in self.axis_groups(axis):
            blocks = [ranks[b:b + inner] for b in range(0, n, inner)]
            across = [ranks[j::inner] for j in range(inner)]
            for name, groups in ((shard, blocks), (replicate, across)):
                for rs in groups:     # every rank creates every group in the same order
                    self._add_group(name, rs)
        self.splits[axis] = inner
        self._split_names[axis] = (shard, replicate)
        return shard, replicate

    def _add_group(self, name: str, ranks: list[int]) -> None:
        if len(ranks) == 1 or not env.is_distributed() or self.is_virtual:
            group = channel = None
        else:
            group, channel = dist.new_group(ranks), dist.new_group(ranks)
        self._sub_groups[name].append(ranks)
        if self.rank in ranks:
            self._groups[name], self._groups[grad_channel(name)] = group, channel
            self._ranks[name] = ranks

    @property
    def all_axes(self) -> dict[str, int]:
        """Every axis's size, the split axes' included (`axes` has the mesh axes only)."""
        return {**self.axes, **{name: size for name, (_, size) in self._sub.items()}}

    @property
    def all_coords(self) -> dict[str, int]:
        """This rank's index along every axis, the split axes' included."""
        return {**self.coords, **{name: self.local_rank(name) for name in self._sub}}

    def axis_groups(self, axis: str) -> list[list[int]]:
        """Every group of ranks along mesh axis `axis`, over the whole mesh (each in axis order)."""
        axis = self._check_axis(axis)
        if axis in self._sub:
            return [list(g) for g in self._sub_groups[axis]]
        others = [a for a in self.axes if a != axis]
        return [[self._rank_of({**dict(zip(others, coords)), axis: i}) for i in range(self.axes[axis])]
                for coords in itertools.product(*(range(self.axes[a]) for a in others))]

    def parent(self, axis: str) -> str:
        """The mesh axis a split axis was cut from (an axis's own name otherwise)."""
        axis = self._check_axis(axis)
        return self._sub[axis][0] if axis in self._sub else axis

    def spans_nodes(self, axis: str) -> bool:
        """Whether this rank's group along `axis` holds ranks of more than one node."""
        return self.topology.nodes_spanned(self.ranks(axis)) > 1

    def ranks_on_node(self, axis: str) -> int:
        """How many ranks of this rank's `axis` group run on its node (the largest node-local
        shard group); a MeshError when nodes hold different numbers of them."""
        counts = {len(g) for g in self.topology.local_groups(self.ranks(axis))}
        if len(counts) != 1:
            raise MeshError(f"the {axis!r} group {self.ranks(axis)} has different numbers of ranks on its nodes "
                            f"({self.topology.describe()}); order the mesh axes so that {axis!r} groups divide "
                            "into whole nodes")
        return counts.pop()

    def first_copy(self, axes: Sequence[str]) -> bool:
        """Whether this rank holds the first copy of a piece split over `axes`: index 0 along
        every other mesh axis (a split axis among `axes` stands for its part of its parent: the
        copies are then along the other part)."""
        split_parts = {a: self._sub[a][0] for a in axes if a in self._sub}
        for name, c in self.coords.items():
            if name in axes:
                continue
            parts = [a for a, parent in split_parts.items() if parent == name]
            if parts:
                other = [s for s, (p, _) in self._sub.items() if p == name and s not in parts]
                if any(self.local_rank(s) != 0 for s in other):
                    return False
            elif c != 0:
                return False
        return True

    def size(self, axis: str) -> int:
        axis = self._check_axis(axis)
        sub = self._sub.get(axis)
        return sub[1] if sub is not None else self.axes[axis]

    def local_rank(self, axis: str) -> int:
        """This rank's index along `axis` (0 .. size-1)."""
        axis = self._check_axis(axis)
        if axis in self._sub:
            return self._ranks[axis].index(self.rank) if self._ranks.get(axis) else 0
        return self.coords[axis]

    def group(self, axis: str):
        """The process group along `axis` holding this rank (None for a size-1 axis, and on a
        virtual mesh); for `grad_channel(axis)`, a second group over the same ranks."""
        self._check_axis(axis)
        return self._groups.get(axis)

    def comm_group(self, axis: str):
        """`group(axis)` for a collective about to run: a virtual mesh has no process group, so a
        collective on it would reach the default group or hang; MeshError instead."""
        self._check_axis(axis)
        if self.is_virtual:
            raise MeshError(f"a collective on a virtual mesh ({self.axes}; Mesh.virtual): it has no process group, "
                            "so nothing can be communicated over it")
        return self._groups.get(axis)

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along `axis`, in axis order."""
        axis = self._check_axis(axis)
        return list(self._ranks[axis])

    def _check_axis(self, axis: str) -> str:
        """The axis a name refers to (a gradient channel's is its axis); MeshError if none."""
        axis = axis[: -len(_CHANNEL)] if axis.endswith(_CHANNEL) else axis
        if axis not in self.axes and axis not in self._sub:
            for base in self.axes:
                if axis in (f"{base}_shard", f"{base}_replicate"):
                    raise MeshError(f"mesh axis {axis!r} is a split of {base!r} (hybrid sharding) that this mesh "
                                    f"has not made: it is made when a shard_zero(..., shard_group=...) or "
                                    f"shard_zero(3, hpz=...) first places state on the mesh "
                                    f"(mesh.split({base!r}, k) on every rank)")
            raise MeshError(f"mesh has no axis {axis!r}; its axes are {list(self.axes)}. "
                            f"Create it on every rank with {self._fix(axis)}")
        return axis

    def _fix(self, axis: str) -> str:
        names = [n for n in self.named if n != axis] + [axis]
        return f"dsfn.runtime.mesh.init_mesh({', '.join(f'{n}=...' for n in names)})"

    def require(self, axis: str, by: str = "a transform") -> None:
        """Raise MeshError unless `axis` is an axis `by` can use on this mesh.

        An axis the mesh lacks is an error; so is, on more than one rank, a model-parallel
        axis (anything but dp) that `init_mesh` did not name: it has size 1 by default, and
        the transform would silently do nothing while every rank runs the whole model.
        `init_mesh(..., tp=1)` names it with size 1 on purpose.
        """
        if axis not in self.axes:
            raise MeshError(f"{by} works over mesh axis {axis!r}, but the mesh has no such axis "
                            f"(its axes are {self.axes}). Create it on every rank, before the first "
                            f"step, with {self._fix(axis)}")
        world = env.world_size()
        if world > 1 and axis not in self.named and axis not in _SIZE_ONE_OK:
            named = {n: self.axes[n] for n in self.named}
            raise MeshError(f"{by} works over mesh axis {axis!r}, but the mesh names only {named} "
                            f"(all-dp unless init_mesh is called), so {axis!r} has size 1 and "
                            f"{by} would do nothing on these {world} ranks. Call {self._fix(axis)} on "
                            f"every rank before the first step (sizes multiplying to {world}); pass "
                            f"{axis}=1 to run without it on purpose")

    def __repr__(self) -> str:
        return f"Mesh({self.axes}, rank={self.rank})"


_current: Mesh | None = None
_virtual = threading.local()    # .meshes: `on_virtual_mesh`'s, innermost last (this thread's only)


@contextlib.contextmanager
def on_virtual_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """`current_mesh()` is the virtual `mesh` (`Mesh.virtual`) inside this block, in this
    thread (another thread, e.g. an async checkpoint's writer, keeps the process mesh)."""
    if not mesh.is_virtual:
        raise MeshError("on_virtual_mesh takes a Mesh.virtual(...) mesh")
    stack = _virtual.__dict__.setdefault("meshes", [])
    stack.append(mesh)
    try:
        yield mesh
    finally:
        stack.pop()


def holds_nothing(x: Any) -> bool:
    """Whether `x` is a tensor placed for its layout only: a meta tensor while the current mesh is
    virtual (`dsfn.estimate` places a meta state; a host copy of it would allocate real memory).
    A meta tensor on a real mesh stands in for a device tensor (dsfn.testing.syncs) and is moved."""
    return getattr(x, "is_meta", False) and current_mesh().is_virtual


def init_mesh(**axes: int) -> Mesh:
    """Build the process mesh (initialising torch.distributed from torchrun vars if needed).

    `init_mesh(dp=2, tp=2)`; unnamed standard axes get size 1; one axis may be -1.
    With no arguments every rank is on `dp`.
    """
    global _current
    env.init_distributed()
    _current = Mesh(axes or None)
    return _current


def current_mesh() -> Mesh:
    """The mesh set by `init_mesh`, or a default all-dp mesh over the current world.

    Under a launcher (WORLD_SIZE > 1) the process group is initialised first
    (`env.ensure_distributed`), so the default mesh spans every rank.
    """
    global _current
    virtual = getattr(_virtual, "meshes", None)
    if virtual:
        return virtual[-1]
    env.ensure_distributed()
    if _current is None or _current.rank != env.rank() or math.prod(_current.axes.values()) != env.world_size():
        _current = Mesh()
    return _current


_CHANNEL = "/grads"


def grad_channel(axis: str) -> str:
    """The name of `axis`'s gradient channel: the same ranks, a process group of its own.

    Collectives issued on demand (ZeRO-3's all-gathers in backward) and collectives
    launched as gradients complete (its reduce-scatters) interleave in an order that
    depends on which parameters a rank's data reached; on two groups, each keeps one
    order on every rank. Every collective takes it where it takes an axis name."""
    return axis + _CHANNEL


def reset_mesh() -> None:
    global _current
    _current = None


env.before_exit(reset_mesh)      # its sub-groups go before the process groups are destroyed


def ensure_ready(stack: Sequence[Any]) -> None:
    """Run at the start of every Step entry point: the process group and the mesh axes.

    Initialises the process group when launched (`env.ensure_distributed`), then checks
    every transform's mesh axis (`transform.axis`) with `Mesh.require`: a missing axis, or
    an un-named tp/sp axis on more than one rank, is a MeshError naming the
    `init_mesh(...)` call that fixes it.
    """
    env.ensure_distributed()
    mesh = None
    for t in stack:
        axis = getattr(t, "axis", None)
        if isinstance(axis, str):
            mesh = mesh or current_mesh()
            mesh.require(axis, by=f"{getattr(t, 'name', type(t).__name__)}(axis={axis!r})")
