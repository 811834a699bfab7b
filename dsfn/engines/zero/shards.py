"""What every ZeRO stage >= 1 does with flat shards: the common machinery under
`dsfn.engines.zero.stage12` and `dsfn.engines.zero.stage3` (the transform is
`dsfn.transforms.zero`, which holds the policy and picks the stage's engine).

A leaf ZeRO sees is a tensor, a piece placed by a transform inside (tensor parallel's
DimShard), or ZeRO's own shard of either: FlatShard, or Nested(inner layout, FlatShard)
(possibly Offloaded). ZeRO's "full tensor" is the piece the transforms inside hold.

`ZeroShards(axis, stage, ...)` keeps the options and the caches that stay the same step
after step (the gradient plan, the gradient buffer pool); its stage's subclass fills in
what differs (`_reduced_keys`, `value_and_grad`, `place`, `apply_gradients`, ...).
Imports no transform.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dsfn import tree
from dsfn.aliasing import writable
from dsfn.effects import bind
from dsfn.engines.data_parallel import reduce_grads, registration_order
from dsfn.engines.grad_stats import reduce_over_axis
from dsfn.engines.zero.groups import split_axes
from dsfn.identity_cache import IdentityCache
from dsfn.placed import Placed, data_of, is_placed
from dsfn.runtime import collectives as C
from dsfn.runtime.flat import BufferPool, ShardReducer, all_gather_full
from dsfn.runtime.mesh import current_mesh, grad_channel
from dsfn.state.layout import (FlatShard, Layout, Nested, Offloaded, Quantized, held_copies, map_with_mirrors,
                               mirrored_param, shard_further, stage_piece_shape, sum_held_copies)

__all__ = ["GradientRounds", "WholeJob", "ZeroOptions", "ZeroShards", "compute_device", "inner_piece", "logical_shape", "zero_layout"]


def compute_device(x: Any) -> torch.device:
    """Where leaf `x` is computed with: an offloaded piece's `home` (the device it came from,
    e.g. cuda:0 for a shard kept in host memory), else the device its data is on."""
    layout = x.layout if isinstance(x, Placed) else None
    while isinstance(layout, Nested):
        layout = layout.outer
    if isinstance(layout, Offloaded):
        return torch.device(layout.home)
    return data_of(x).device


def zero_layout(layout: Layout) -> FlatShard | None:
    """ZeRO's FlatShard in a leaf's layout (under Quantized and Offloaded, as Nested's outer), or None."""
    while isinstance(layout, (Quantized, Offloaded)):
        layout = layout.inner
    if isinstance(layout, Nested):
        layout = layout.outer
    return layout if isinstance(layout, FlatShard) else None


def inner_piece(x: Placed, piece: torch.Tensor) -> Any:
    """The tensor ZeRO's shard `x` was cut from, rebuilt (`piece`), as the transforms inside
    see it: a Placed with the inner layout under Nested, else the plain tensor."""
    layout = x.layout
    while isinstance(layout, Offloaded):
        layout = layout.inner
    return Placed(piece, layout.inner) if isinstance(layout, Nested) else piece


def logical_shape(x: Any) -> tuple[int, ...]:
    return tuple(x.layout.shape) if isinstance(x, Placed) else tuple(x.shape)


def bucket_ready(items: list[tuple[str, torch.Tensor]]) -> None:
    """A reduced bucket of gradient shards, [(key, shard), ...], handed to the transforms that
    handle the "grad_bucket_ready" primitive (default: nothing)."""
    bind("grad_bucket_ready", lambda items: None, items)


@dataclass(frozen=True)
class ZeroOptions:
    """ZeRO's options as the engines read them (fixed at construction; `shard_zero` checks
    them). Counts of elements, as DeepSpeed's config keys are; `units`: module patterns of
    stage 3's units (None: every ModuleList's children); `shard_group` / `hpz`: a number of
    dp ranks or "node" (hybrid sharding, ZeRO++'s hpZ); `wire`: stage 3's quantized
    weight gathers (ZeRO++ qwZ), None for full precision."""

    axis: str
    stage: int
    reduce_bucket_size: int
    allgather_bucket_size: int
    param_persistence_threshold: int = 0
    units: tuple[str, ...] | None = None
    prefetch: int = 1
    shard_group: Any = None
    cross_node: bool = False
    hpz: Any = None
    hierarchical_gather: bool = False
    wire: Any = None            # stage 3's quantized weight gathers (qwZ): a runtime.quantized.WireFormat
    grad_wire: Any = None       # the quantized gradient reduce-scatter (qgZ): a WireFormat
    frozen_wire: Any = None     # frozen weights held quantized (stage 3): a WireFormat


class GradientRounds:
    """The rounds of a ShardReducer, one per micro-batch of a step.

    Micro-batches that run one after another (accumulate: each forward follows the previous
    one's backward) close the previous round as the next forward begins. Micro-batches whose
    forwards and backwards interleave — a "micro_batch" event with `interleaved` says so
    (`hear`): a 1F1B order runs F1 before B0 — take a round per backward instead: the first
    gradient of another forward's owner (`enter`) closes the previous owner's round
    (`close(previous)`, e.g. ZeRO-3's `GradientsDue.end_backward`, first) and opens the
    next. Every dp rank runs the same order, so the rounds switch at the same point on each."""

    def __init__(self, reducer: ShardReducer, close: Any = None):
        self.reducer, self.close = reducer, close
        self.owner: Any = None
        self.interleaved = False

    def hear(self, event: Any) -> None:
        """A "micro_batch" event (`dsfn.layer_events.MicroBatch`) of the running value_and_grad."""
        if event.interleaved:
            self.interleaved = True

    def enter(self, owner: Any) -> None:
        """A gradient of `owner`'s backward is about to reach the reducer."""
        if owner is self.owner:
            return
        if self.owner is not None and self.close is not None:
            self.close(self.owner)
        self.reducer.new_round()
        self.owner = owner


class ZeroShards:
    """The flat-shard machinery of ZeRO stages 1-3 over `axis` (module docstring)."""

    def __init__(self, options: ZeroOptions):
        self.dp_axis, self.stage = options.axis, options.stage
        # hybrid sharding: state sharded over groups of `shard_group` dp ranks ("node" or an
        # int), replicated across them (`dsfn.engines.zero.groups`); None: the whole dp axis
        self.shard_group, self.cross_node = options.shard_group, options.cross_node
        self._axes_on = IdentityCache()         # mesh -> (shard axis, replicate axis); holds the mesh
        self.reduce_bucket_size = options.reduce_bucket_size
        self.allgather_bucket_size = options.allgather_bucket_size
        self.grad_wire = options.grad_wire          # qgZ: the reduce-scatter's quantized format (None: exact)
        self._grad_plans = IdentityCache()      # (tree spec, leaf layouts) -> grad_plan's plan
        # gradient buckets and shards, the same blocks every step
        self.grad_pool = BufferPool(keep=ShardReducer.MAX_INFLIGHT + 1)
        # id(unit module) -> [(gatherer, unit index)]: stage 3's gatherers hearing that module's
        # layer events now (a forward's, until its backward is over; several while forwards overlap)
        self.live_units: dict[int, list] = {}

    active: Any = None      # the running value_and_grad's reduction (`begin_reduction`), else None

    # -- axes -----------------------------------------------------------------------------------
    def shard_axes(self) -> tuple[str, str | None]:
        """(the axis ZeRO's shards split over, the axis across which they are copies, or None):
        (dp, None) flat; ("dp_shard", "dp_replicate") hybrid. Resolved on the current mesh at
        first use (the split's process groups are made then, on every rank alike)."""
        if self.shard_group is None:        # flat: no mesh lookup (this runs per leaf in places)
            return self.dp_axis, None
        mesh = current_mesh()
        return self._axes_on.get((mesh,), lambda: split_axes(
            mesh, self.dp_axis, self.shard_group, self.cross_node,
            f"shard_zero({self.stage}, shard_group={self.shard_group!r})"))

    @property
    def axis(self) -> str:
        """The axis ZeRO's FlatShards split over (the shard group's under hybrid sharding)."""
        return self.shard_axes()[0]

    @property
    def replicate_axis(self) -> str | None:
        return self.shard_axes()[1]

    # -- leaves ---------------------------------------------------------------------------------
    def mine(self, x: Any) -> bool:
        """Whether leaf `x` is ZeRO's shard (rather than a tensor or an inner transform's piece)."""
        return isinstance(x, Placed) and zero_layout(x.layout) is not None

    def as_shard(self, x: Any) -> Any:
        """A full (already reduced) tensor or inner piece -> this rank's Placed shard."""
        return x if self.mine(x) else shard_further(x, lambda shape: FlatShard(self.axis, shape))

    def shard_layout(self, x: Any) -> Layout:
        """The layout of `x`'s shard: its own if it is one, else what `as_shard` would give it."""
        if self.mine(x):         # a gradient shard lives where compute does (not Offloaded)
            layout = x.layout
            while isinstance(layout, Offloaded):
                layout = layout.inner
            return layout
        if isinstance(x, Placed):
            return Nested(x.layout, FlatShard(self.axis, tuple(x.data.shape)))
        return FlatShard(self.axis, tuple(x.shape))

    def keeps_whole(self, x: Any) -> bool:
        """Whether parameter leaf `x` stays whole on every rank, its gradient all-reduced
        (stage 3's persistent parameters; none below stage 3)."""
        return False

    # -- optimizer state ------------------------------------------------------------------------
    def shard_mirrors(self, state: Any, params: dict[str, Any], whole: Any = None) -> Any:
        """`state` with every optimizer-state leaf that mirrors a parameter of `params` (path ->
        the parameter as it was before placing: same shape, a path ending with the parameter's:
        Adam's `mu.<name>`, `master.<name>`) as this rank's shard, unless `whole(parameter)`
        (`dsfn.state.layout.map_with_mirrors`: a parameter and its mirrors take one layout)."""
        def shard_mirror(owner: str, x: Any) -> Any:
            return x if whole is not None and whole(params[owner]) else self.as_shard(x)
        return map_with_mirrors(state, shard_mirror, params=False)

    def unplaced_opt_state(self, state: Any) -> str | None:
        """A whole tensor where a mirror's shard belongs (the first leaf decides)."""
        shapes = None          # made only when a whole tensor comes before any shard
        for path, x in tree.leaves_with_path(getattr(state, "opt_state", None), is_leaf=is_placed):
            if self.mine(x):
                return None
            if isinstance(x, torch.Tensor) and x.dim() > 0:
                if shapes is None:
                    shapes = {n: logical_shape(p) for n, p in tree.leaves_with_path(state.params, is_leaf=is_placed)}
                if mirrored_param(path, logical_shape(x), shapes) is not None:
                    return (f"optimizer state {path!r} is a whole tensor, not this rank's "
                            f"ZeRO-{self.stage} shard")
        return None

    # -- gradients ------------------------------------------------------------------------------
    def grad_plan(self, params: Any) -> dict[str, Any]:
        """What the reduction decides per parameter leaf — the reducer's keys (paths in
        registration order), full gradient shapes and devices; each leaf's path, whether it
        is all-reduced (kept whole) and its gradient shard's layout — computed once per
        structure and leaf layouts (the same objects step after step: compared by identity
        first, so a hit costs no Python call per leaf)."""
        leaves, spec = tree.flatten(params, is_leaf=is_placed)
        key = [x.layout if type(x) is Placed else (x.shape, x.dtype, x.device) for x in leaves]
        return self._grad_plans.get((), lambda: self._make_grad_plan(params, spec), (spec, key))

    def _make_grad_plan(self, params: Any, spec: Any) -> dict[str, Any]:
        # the keys that may reach the reducer (whole ones are all-reduced); the full gradient's shape
        named, devices = [], {}
        for path, x in registration_order(params):
            if self._outside_reducer(x):
                continue
            full = zero_layout(x.layout).shape if self.mine(x) else tuple(data_of(x).shape)
            named.append((path, torch.empty(full, dtype=data_of(x).dtype, device="meta")))
            devices[path] = compute_device(x)     # zeros of an unused one: where grads are
        with_path = tree.leaves_with_path(params, is_leaf=is_placed)
        replicated = [k for k, (_, x) in enumerate(with_path) if self._outside_reducer(x)]
        plan = dict(named=named, devices=devices, paths=[p for p, _ in with_path], replicated=replicated,
                    layouts=[None if k in replicated else self.shard_layout(x) for k, (_, x) in enumerate(with_path)],
                    spec=spec,
                    # leaves held as copies by several holders (a tied embedding and head): summed after
                    copies=[k for k, (_, x) in enumerate(with_path)
                            if isinstance(x, Placed) and held_copies(x.layout) is not None])
        return plan

    def _outside_reducer(self, x: Any) -> bool:
        """A leaf whose gradient is all-reduced whole, not reduce-scattered: one kept whole, or
        one of no elements on this rank (a leaf another holder keeps: the same on every dp rank
        of this holder, so the reducer's plan stays alike on them). A key that never
        gets a gradient in a bucket would hold the bucket, and every later one, until the
        round's end: no reduce-scatter could start while backward runs."""
        return self.keeps_whole(x) or (not self.mine(x) and data_of(x).numel() == 0)

    def reducer(self, plan: dict[str, Any], facts: Any, hears: bool, channel: str) -> ShardReducer:
        """A reduce-scatter plan over the step's gradients on `channel` (the shard axis, or its
        gradient channel) — under hybrid sharding then all-reduced across the replicate
        axis's gradient channel —, in the stack's wire dtype (`facts`: the stack's StackFacts); with
        `hears` (a transform inside hears reduced buckets: offload's overlapped host update)
        each bucket goes to the "grad_bucket_ready" primitive as it completes."""
        replicate = self.replicate_axis
        grad_wire = self.grad_wire
        return ShardReducer(channel, self.reduce_bucket_size, "avg", facts.grad_wire_dtype, plan["named"],
                            plan["devices"], pool=self.grad_pool, keep_dtype=facts.grads_keep_dtype,
                            on_bucket=bucket_ready if hears else None,
                            replicate=None if replicate is None else grad_channel(replicate),
                            wire=grad_wire, hierarchy=self.qgz_hierarchy(channel) if grad_wire is not None else None)

    def qgz_hierarchy(self, channel: str) -> tuple[str, str] | None:
        """qgZ's (cross, local) axes (on `channel`'s side: the gradient channels where it is
        one) when the shard axis spans nodes: its node-local ranks exchange first. None inside
        one node (one flat exchange)."""
        mesh = current_mesh()
        n, local = mesh.size(self.axis), mesh.ranks_on_node(self.axis)
        if local >= n or local == 1:
            return None
        inner, across = mesh.split(self.axis, local, names=(f"{self.axis}_local", f"{self.axis}_cross"))
        on = grad_channel if channel != self.axis else (lambda a: a)
        return on(across), on(inner)

    def finish_reduction(self, reducer: ShardReducer, plan: dict[str, Any], grads: Any, facts: Any) -> Any:
        """The step's gradients as ZeRO hands them on: the reducer's shards (zeros where this
        rank's loss did not reach a parameter), whole ones all-reduced."""
        paths, gs = plan["paths"], tree.leaves(grads, is_leaf=is_placed)
        shards = reducer.finish()
        replicated = plan["replicated"]
        reduced = dict(zip(replicated, reduce_grads([data_of(gs[k]) for k in replicated], self.dp_axis,
                                                    self.reduce_bucket_size * 4, "avg", facts)))
        out = []
        for k, (path, layout) in enumerate(zip(paths, plan["layouts"])):
            if k in reduced:
                g = gs[k]
                out.append(Placed(reduced[k], g.layout) if isinstance(g, Placed) else reduced[k])
                continue
            out.append(Placed(shards[path], layout))   # zeros where this rank's loss did not reach it
        if self.stage >= 2 and plan["copies"]:
            out = self.sum_copies(out, plan["copies"])
        return tree.unflatten(plan["spec"], out)

    def owner_grad_numel(self, numel: int) -> int:
        """Elements of the reduced gradient an owner of a `numel`-element leaf holds: its shard."""
        return -(-numel // current_mesh().size(self.axis))

    def sum_copies(self, grads: list[Any], which: list[int]) -> list[Any]:
        """Gradients of the leaves `which` (indices into `grads`, found once per structure by
        `grad_plan`) that several holders keep as copies (`held_copies` of their layout: a
        tied embedding and head) summed over the holders (`dsfn.state.layout.sum_held_copies`),
        so the copies take the same update. Stages 2-3 take the gradients over inside
        backward, before whoever holds the copies could sum them; a non-holder joins with
        zeros of a holder's reduced piece."""
        parts = [grads[k].data for k in which]
        copies = [held_copies(grads[k].layout) for k in which]
        # (a non-holder's 0-element leaf stays outside ZeRO: its layout is the stage's)
        numel = [0 if c.holds() else self.owner_grad_numel(math.prod(stage_piece_shape(grads[k].layout)))
                 for k, c in zip(which, copies)]
        out = list(grads)
        for k, summed in zip(which, sum_held_copies(parts, copies, numel)):
            if summed is not grads[k].data:
                out[k] = Placed(summed, grads[k].layout)
        return out

    # -- update ---------------------------------------------------------------------------------
    def gather_updated(self, shards: list[torch.Tensor], shapes: list[tuple[int, ...]],
                       olds: list[torch.Tensor]) -> list[torch.Tensor]:
        """Updated shards all-gathered into full parameters. In a donated step the old full
        parameters are the step's to overwrite: a tensor whose storage holds exactly its
        padded size (numel divisible by the dp size, contiguous) is gathered into its old
        tensor in place, so no second full copy of the parameters is made; the others (and
        every tensor of a step that does not donate) get new ones."""
        n = current_mesh().size(self.axis)
        into = [k for k, (s, o) in enumerate(zip(shards, olds))
                if isinstance(o, torch.Tensor) and o.is_contiguous() and o.numel() == n * s.numel()
                and o.dtype == s.dtype and o.device == s.device and o.numel()]
        if n == 1 or not into or not writable([olds[k] for k in into]):
            return all_gather_full(shards, shapes, self.axis, self.allgather_bucket_size)
        rest = [k for k in range(len(shards)) if k not in set(into)]
        out: list[torch.Tensor] = list(olds)
        C.all_gather_into_([olds[k].view(-1) for k in into], [shards[k] for k in into], self.axis)
        for k, t in zip(rest, all_gather_full([shards[k] for k in rest], [shapes[k] for k in rest], self.axis,
                                              self.allgather_bucket_size) if rest else []):
            out[k] = t
        return out

    def whole_job(self, pieces: list[Any]) -> "WholeJob | None":
        """What the "map_whole" primitive does with ZeRO's shards among `pieces` (Muon's
        whole-matrix functions), or None when none is ZeRO's over its axis: each such tensor is
        rebuilt and mapped once, on an owner rank (`dsfn.runtime.flat.map_whole` over
        `job.axis`); a shard of a tensor-parallel piece is rebuilt to that piece, which the
        transforms inside (tensor parallel) turn into the whole. Every rank of a tp group owns
        the same tensors, so their inner collectives match."""
        ours = [k for k, x in enumerate(pieces) if self.mine(x) and zero_layout(x.layout).axis == self.axis]
        return WholeJob(pieces, ours, self.axis) if ours else None

    def reduce_leaves(self, partials: list[torch.Tensor], pending: list[tuple[str, ...]], op: str):
        """The `reduce_leaves` primitive for leaves split over a hybrid shard axis: combined over
        the shard group only (its copies across the replicate axis are equal, not parts)."""
        axis = self.axis
        return (partials, pending) if axis == self.dp_axis else reduce_over_axis(partials, pending, axis, op)

    # -- what a stage adds (defaults: nothing) ----------------------------------------------------
    def place_constants(self, frozen: dict[str, Any]) -> dict[str, Any]:
        return frozen

    def begin_forward(self, apply_fn: Any, params: dict[str, Any], compute_dtype: torch.dtype | None) -> Any:
        """A forward's set-up (stage 3: its units gathered just in time), or None: nothing to do."""
        return None

    # the stage's gradient reduction of one value_and_grad: `Reduction(engine, fn, params,
    # facts, hears)`, a lifecycle object (`.fn`, `hear`, `finish`, `close`); set by each stage
    Reduction: Any = None

    def optimizer_view(self, state: Any) -> Any:
        """The state the optimizer makes its state for (stages 1-2: shards of the parameters)."""
        return state


class WholeJob:
    """ZeRO's part of one "map_whole" call (`ZeroShards.whole_job`): `ours` (indices into
    `pieces` of ZeRO's shards), their `shards` on one device and logical `shapes` for
    `dsfn.runtime.flat.map_whole` over `axis`; `inner(j, piece)` is the rebuilt tensor j as
    the transforms inside see it; `placed(new)` lays the results out as the pieces were;
    `rest`: the other indices, for the transforms inside."""

    def __init__(self, pieces: list[Any], ours: list[int], axis: str):
        self.pieces, self.ours, self.axis = pieces, ours, axis
        self.rest = [k for k in range(len(pieces)) if k not in set(ours)]
        shards = [pieces[k].data for k in ours]
        home = {s.device for s in shards}
        dev = next(iter(home)) if len(home) == 1 else torch.device("cpu")
        self.shards = [s.to(dev) for s in shards]
        self.shapes = [zero_layout(pieces[k].layout).shape for k in ours]

    def inner(self, j: int, piece: torch.Tensor) -> Any:
        return inner_piece(self.pieces[self.ours[j]], piece)

    def placed(self, new: list[torch.Tensor]) -> list[Any]:
        """`pieces` with ZeRO's replaced by the results (this rank's shards of them)."""
        out = list(self.pieces)
        for k, t in zip(self.ours, new):
            out[k] = Placed(t.to(self.pieces[k].data.device), self.pieces[k].layout)
        return out
