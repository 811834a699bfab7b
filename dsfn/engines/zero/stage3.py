"""ZeRO stage 3 (DeepSpeed's `stage3.py`, FSDP2's fully_shard): parameters, gradients and
optimizer state in flat shards; a unit's parameters gathered just in time.

- place: parameters above `param_persistence_threshold` elements become this rank's shard
  (the others stay whole, their gradients all-reduced), and the optimizer-state leaves
  that mirror a sharded parameter too;
- forward ("apply_module"): a `UnitGatherer` (dsfn.engines.zero.units) gathers each unit
  before it runs and frees it after, and again for backward; frozen parameters (a LoRA
  base) are stored sharded as constants of the apply_fn and gathered with their unit, in
  the compute dtype of a mixed precision inside;
- gradients: reduce-scattered in buckets as each unit's arrive, on the axis's gradient
  channel (its all-gathers are issued on demand during backward, so the two sequences
  would interleave differently on ranks whose data reached different units); a parameter
  gathered n times in a forward (a re-used unit) gets n gradients, summed here and handed
  to the reducer once per round (`GradientsDue`); each forward of a step is a round;
- update: gradients follow their parameter's layout; nothing is gathered after it.

Imports no transform; `dsfn.transforms.zero` picks this engine for stage 3.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from dsfn import tree
from dsfn.aliasing import may_alias
from dsfn.engines.zero.groups import split_axes
from dsfn.engines.zero.units import RecomputeWatch, UnitGatherer, UnitPlan
from dsfn.engines.zero.shards import GradientRounds, ZeroOptions, ZeroShards, compute_device, zero_layout
from dsfn.identity_cache import IdentityCache, KeyedCache
from dsfn.placed import Placed, data_of, is_placed
from dsfn.runtime import env
from dsfn.runtime.mesh import current_mesh, grad_channel
from dsfn.state.init import place_frozen, store_constants
from dsfn.state.layout import FlatShard, Quantized

__all__ = ["GradientsDue", "Stage3", "Stage3Reduction"]


class GradientsDue:
    """The gradient sink of one value_and_grad: a parameter gathered n times in a forward (a
    loss calling apply_fn twice, a re-used unit) gets n gradients in backward; they are
    summed here and handed to the reducer once, as one key per round, when the last one
    arrives (or at backward's end, `flush`)."""

    def __init__(self, reducer: Any, rounds: GradientRounds | None = None):
        self.reducer = reducer
        self.rounds = rounds                     # interleaved micro-batches: this forward's backward is a round
        self.expect: dict[str, list] = {}        # key -> [gradients still due, their sum]
        self.gatherers: list[UnitGatherer] = []  # this round's forwards, for backward's end
        self.host_units = False                  # a unit was gathered into host memory

    def gathers_made(self, keys: list[str]) -> None:
        """A unit's weights were gathered for a forward under grad: one more gradient due per key."""
        expect = self.expect
        for key in keys:
            rec = expect.get(key)
            if rec is None:
                expect[key] = [1, None]
            else:
                rec[0] += 1

    def grads_arrived(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """(key, gradient) pairs of one backward node (a unit): summed per key, and the
        complete ones handed to the reducer in one call."""
        if self.rounds is not None:
            self.rounds.enter(self)
        ready = []
        for key, grad in items:
            rec = self.expect.get(key)
            if rec is None:                       # not counted (no grad mode at its forward): pass on
                ready.append((key, grad))
                continue
            rec[0] -= 1
            rec[1] = grad if rec[1] is None else rec[1] + grad
            if rec[0] == 0:
                del self.expect[key]
                ready.append((key, rec[1]))
        if ready:
            self.reducer.add_many(ready)

    def end_backward(self) -> None:
        """A round's backward is over: its units' remaining gathers, and the uses whose
        gradient never came (their partial sums) go to the reducer."""
        for g in self.gatherers:
            g.finish_backward()
        self.gatherers = []
        for key, (_, partial) in sorted(self.expect.items()):
            if partial is not None:
                self.reducer.add(key, partial)
        self.expect = {}


class Stage3(ZeroShards):
    """Stage 3 over `axis` (module docstring)."""

    def __init__(self, options: ZeroOptions):
        super().__init__(options)
        # the modules owning sharded parameters directly, watched for a recompute while their
        # gatherers' backwards are still to come (read by ZeRO's "run_unit" handler)
        self.recompute_watch = RecomputeWatch()
        # ZeRO++ hpZ: a secondary shard of each gathered unit over groups of `hpz` dp ranks
        # ("node" or an int): backward re-gathers inside the group (`UnitGatherer`)
        self.hpz = options.hpz
        # MiCS's hierarchical gather: a shard group spanning nodes gathers across nodes, then inside
        self.hierarchical_gather = options.hierarchical_gather
        self.wire = options.wire          # qwZ: the weight gathers' quantized format (None: exact)
        self.frozen_wire = options.frozen_wire    # frozen weights held quantized in this format (None: exact)
        self.param_persistence_threshold = options.param_persistence_threshold
        self.units, self.prefetch = options.units, options.prefetch
        self.due: GradientsDue | None = None         # the running value_and_grad's sink
        # id(apply_fn) -> (view, cast) per apply_fn (held alive) and its constants' ids and dtype
        self._views = KeyedCache()
        # (module, parameter names, frozen names) -> UnitPlan (the module held alive): what is
        # the same every step, the units' gather storages included
        self.plans = KeyedCache()
        self._leaves = IdentityCache()               # (leaf layouts, names) -> shard_leaves' answer
        self._secondary_on = IdentityCache()         # mesh -> hpZ's secondary axis; holds the mesh
        self._hierarchy_on = IdentityCache()         # mesh -> MiCS's (cross, local) axes; holds the mesh

    def secondary_axis(self) -> str | None:
        """hpZ's secondary group axis ("dp_shard" of the split), or None (no hpZ, or a group
        that is the whole dp axis: backward's gather is then the forward's)."""
        if self.hpz is None:
            return None
        mesh = current_mesh()
        return self._secondary_on.get((mesh,), lambda: self._make_secondary_axis(mesh))

    def _make_secondary_axis(self, mesh: Any) -> str | None:
        axis, replicate = split_axes(mesh, self.dp_axis, self.hpz, False, f"shard_zero(3, hpz={self.hpz!r})")
        return None if replicate is None else axis

    def hierarchy_axes(self) -> tuple[str, str] | None:
        """(cross, local) axes of the shard group's two-stage gather (MiCS's hierarchical
        gather), or None: not asked, or a group inside one node (nothing to do in two stages)."""
        if not self.hierarchical_gather:
            return None
        mesh = current_mesh()
        return self._hierarchy_on.get((mesh,), lambda: self._make_hierarchy_axes(mesh))

    def _make_hierarchy_axes(self, mesh: Any) -> tuple[str, str] | None:
        shard = self.axis
        local = mesh.ranks_on_node(shard)
        if local < mesh.size(shard):
            local_axis, cross_axis = mesh.split(shard, local, names=(f"{shard}_local", f"{shard}_cross"))
            return cross_axis, local_axis
        return None

    def owner_grad_numel(self, numel: int) -> int:
        """A sharded leaf's owner holds a shard of its gradient; a persistent one the whole."""
        return super().owner_grad_numel(numel) if numel > self.param_persistence_threshold else numel

    def sharded(self, x: Any) -> bool:
        """Parameters above the persistence threshold are stored sharded."""
        return data_of(x).numel() > self.param_persistence_threshold

    def keeps_whole(self, x: Any) -> bool:
        return not self.mine(x)

    # -- layout ---------------------------------------------------------------------------------
    def place(self, state: Any) -> Any:
        params = dict(tree.leaves_with_path(state.params, is_leaf=is_placed))
        state = state.replace(params=tree.map(lambda x: self.as_shard(x) if self.sharded(x) else x, state.params,
                                              is_leaf=is_placed))
        # a mirror is sharded with its parameter (a persistent one's stays whole)
        return self.shard_mirrors(state, params, whole=lambda p: not self.sharded(p))

    def unplaced(self, state: Any) -> str | None:
        for path, x in tree.leaves_with_path(state.params, is_leaf=is_placed):
            if self.mine(x):
                return None
            if self.sharded(x):
                return f"parameter {path!r} is a whole tensor, not this rank's ZeRO-3 shard"
        return None

    # -- gradients ------------------------------------------------------------------------------
    def begin_update(self, state: Any, grads: Any) -> tuple[Any, Any, Any]:
        """(state, gradients, finish) for the optimizer: gradients follow their parameter's
        layout (persistent ones stay whole); `finish` None: nothing to do after the update."""
        grads = tree.map(lambda g, p: self.as_shard(g) if self.mine(p) else g, grads, state.params, is_leaf=is_placed)
        return state, grads, None

    # -- frozen parameters ----------------------------------------------------------------------
    def place_constants(self, frozen: dict[str, Any]) -> dict[str, Any]:
        """Frozen parameters (name -> tensor, or an inner transform's piece) -> this rank's
        FlatShard pieces (meta tensors too: `init_sharded` fills them later)."""
        return {n: (self.as_shard(x) if self.sharded(x) else x) for n, x in frozen.items()}

    def shard_frozen(self, apply_fn: Any) -> None:
        """Store `apply_fn`'s frozen parameters sharded, in place: their `constants` entries
        become Placed pieces (through the "place_constants" primitive); the module's full
        tensors are released. With `frozen_wire` (ZeRO++'s quantized nontrainable weights)
        each sharded floating piece of at least its `min_numel` elements is then held
        quantized (a `Quantized` layout: codes and scales, a byte an element), once."""
        place_frozen(apply_fn)
        wire = self.frozen_wire
        if wire is None:
            return
        held = {}
        for n in apply_fn.frozen:
            v = apply_fn.constants.get(n)
            if self.mine(v) and not isinstance(v.layout, Quantized) and not v.data.is_meta \
                    and wire.quantizes(v.data.dtype, math.prod(v.layout.shape)):
                held[n] = Placed(wire.pack(v.data), Quantized(v.layout, wire.fmt, wire.block, v.data.dtype))
        if held:
            store_constants(apply_fn, held)

    def frozen_view(self, apply_fn: Any, dtype: torch.dtype | None
                    ) -> tuple[Any, dict[str, tuple[torch.Tensor, FlatShard, Any]]]:
        """(an ApplyFn whose constants are plain tensors — a sharded frozen parameter's local
        piece —, {name: (the piece to gather, in `dtype` when given; its FlatShard; for a
        piece held quantized, (its WireFormat, the dtype it dequantizes to), else None)}).
        `begin_forward` caches it per apply_fn (held alive), its constants and dtype."""
        cast = {}
        for n, v in apply_fn.constants.items():
            if not self.mine(v):
                continue
            t, layout = v.data, v.layout
            # held quantized: gathered as its codes, dequantized into the compute dtype
            held = (layout.wire, dtype or layout.dtype) if isinstance(layout, Quantized) else None
            piece = t.to(dtype) if held is None and dtype is not None and t.is_floating_point() else t
            cast[n] = (piece, zero_layout(layout), held)
        return apply_fn.with_local_constants(), cast

    # -- units ----------------------------------------------------------------------------------
    def shard_leaves(self, params: dict[str, Any]) -> tuple[tuple[str, ...], list[FlatShard], list[torch.device]]:
        """(names of ZeRO's shards among `params`, their FlatShards, their compute devices).
        Depends only on the names and the leaves' layouts, which a step hands on to the next:
        `begin_forward` caches it on them (the same objects: a list comparison checks
        identity first, no Python call per leaf)."""
        names = tuple(n for n, v in params.items() if self.mine(v))
        return names, [zero_layout(params[n].layout) for n in names], [compute_device(params[n]) for n in names]

    def units_of(self, module: Any) -> list[Any]:
        """The modules of `module`'s unit plans (the root, unit 0, and its units), for the layer events."""
        return [m for plan in self.plans.values() if plan.units[0] is module for m in plan.units]

    def begin_forward(self, apply_fn: Any, params: dict[str, Any], compute_dtype: torch.dtype | None
                      ) -> UnitGatherer | None:
        """The forward's set-up with every unit gathered just in time (module docstring): a
        `UnitGatherer`, or None when nothing of this forward is sharded. Run the module as
        `g.view(g.call_params, ...)` inside `with until_backward(g.listening(engine.live_units,
        engine.recompute_watch)), g:` (it hears its units' layer events until backward is over, so a recompute
        re-gathers its unit in backward's fixed order). What stays the same step after step is
        cached here, each a hit in one call: the frozen view, the shard leaves, the unit plan."""
        if current_mesh().size(self.axis) > 1:
            self.shard_frozen(apply_fn)
        view, frozen = self._views.get(id(apply_fn), (apply_fn,), lambda: self.frozen_view(apply_fn, compute_dtype),
                                       (tuple(map(id, apply_fn.constants.values())), compute_dtype))
        if not frozen and not any(self.mine(v) for v in params.values()):
            return None
        leaves = self._leaves.get((), lambda: self.shard_leaves(params),
                                  ([v.layout if type(v) is Placed else None for v in params.values()], list(params)))
        module, names, frozen_names = apply_fn.module, leaves[0], tuple(frozen)
        plan = self.plans.get((id(module), names, frozen_names), (module,),
                              lambda: UnitPlan(module, names, frozen_names, self.units))
        due = self.due
        gatherer = UnitGatherer(apply_fn.module, params, plan, leaves, frozen, self.axis,
                                self.allgather_bucket_size, self.prefetch, due, self.secondary_axis(),
                                self.hierarchy_axes(), concurrent=due is not None and due.rounds is not None,
                                wire=self.wire)
        if due is not None:           # inside value_and_grad: its backward ends the sequence
            due.gatherers.append(gatherer)
            due.host_units = due.host_units or any(d.type == "cpu" for d in gatherer.homes)
        gatherer.view = view
        return gatherer


class Stage3Reduction:
    """The gradient reduction of one value_and_grad under ZeRO-3 (`Stage3.Reduction(engine,
    fn, params, facts, hears)`; lifecycle: autograd runs `.fn`, `finish(grads)` gives the
    reduced shards and ends it, `close()` ends it after an error). Each forward's units
    report their gradients to a `GradientsDue` sink; micro-batches that interleave (`hear`)
    get a sink per forward and a round per backward (`GradientRounds`). A nested
    value_and_grad is reduced by the outermost one."""

    def __init__(self, engine: Stage3, fn: Any, params: Any, facts: Any, hears: bool):
        self.engine, self.facts, self.fn = engine, facts, fn
        self.nested = engine.due is not None
        if self.nested:
            return
        self.plan = engine.grad_plan(params)
        self.due = due = engine.due = GradientsDue(engine.reducer(self.plan, facts, hears, grad_channel(engine.axis)))
        self.sinks = sinks = [due]
        engine.active = self
        self.rounds = rounds = GradientRounds(due.reducer, close=GradientsDue.end_backward)

        def each_forward(*a, **k):
            if rounds.interleaved:       # a micro-batch's forward: a sink of its own
                mine = GradientsDue(due.reducer, rounds)
                sinks.append(mine)
                engine.due = mine        # its units' gatherers report to it
                try:
                    return fn(*a, **k)
                finally:
                    engine.due = due
            due.end_backward()           # one after another: the previous one's backward closes first
            due.reducer.new_round()
            return fn(*a, **k)
        self.fn = each_forward

    def close(self) -> None:
        if not self.nested:
            self.engine.due = self.engine.active = None

    def hear(self, event: Any) -> None:
        if not self.nested:
            self.rounds.hear(event)

    def finish(self, grads: Any) -> Any:
        if self.nested:
            return grads
        try:
            for sink in self.sinks:          # the last round's, then what no gradient ever reached
                sink.end_backward()
            if any(sink.host_units for sink in self.sinks) and may_alias():
                # every unit is released: a donated step gives the heap's holes back
                # (env.trim_host_heap; on a GPU the units churn device memory instead)
                env.trim_host_heap()
        finally:
            self.engine.due = self.engine.active = None
        return self.engine.finish_reduction(self.due.reducer, self.plan, grads, self.facts)


Stage3.Reduction = Stage3Reduction
