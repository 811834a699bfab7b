"""`shard_zero(stage)`: ZeRO data parallelism over the mesh's dp axis.

Every stage is data parallelism (batch split over dp, metrics averaged); what differs is
what each rank stores, as layouts on the state's leaves:

| stage | params            | grads (after backward)          | optimizer state   |
|-------|-------------------|---------------------------------|-------------------|
| 0     | replicated        | all-reduced (mean), replicated  | replicated        |
| 1     | replicated        | reduce-scattered after backward | FlatShard         |
| 2     | replicated        | reduce-scattered in buckets *during* backward; full grads are dropped as soon as they are queued | FlatShard |
| 3     | FlatShard         | as stage 2                      | FlatShard         |

`FlatShard` (dsfn.state.layout): each tensor is flattened, zero-padded to a multiple of
the dp size and split evenly; padding is zero, so it never changes sums, norms or
updates, and `gather` trims it. Optimizer-state leaves are sharded when they *mirror* a
parameter: same shape and a path that ends with the parameter's path (Adam's
`mu.<name>`, mixed precision's `master.<name>`); scalars (counts, lr) stay replicated.

Update (stages 1-2): each rank slices its shard of the parameters, the optimizer runs on
shards (`tx.update` sees flat pieces; every elementwise optimizer is unchanged by
this), and the updated shards are all-gathered, bucketed (in a donated step, into the old
full parameters where their size allows: no second full copy). Stage 3 keeps parameters
sharded: `apply_fn` (the "apply_module" primitive) gathers a *unit*'s parameters just
before the unit runs and frees them after it — straight into one flat buffer per dtype,
the weights being views of it (`dsfn.runtime.flat.gather_into_buffers`: one collective per
bucket, under NCCL one coalesced all-gather, whatever its number of tensors). As in FSDP2, each
unit's buffers are storages kept across steps (`_UnitStorage`): their memory exists while
a gather of the unit is in use and is freed (storage resized to 0) when none is. Autograd
saves the gathered weights themselves; backward re-gathers the unit into the same
storages just before the unit's backward (a gradient hook on the unit's outputs), so the
saved weights see the data again — no saved-tensor hooks, nothing per op or per tensor
in forward or backward. On the host, a donated step then hands glibc's free heap pages
back to the kernel once, at the end of backward (`runtime.env.trim_host_heap`): a
per-size free list of unit storages was measured and kept resident memory higher, since
the blocks it holds serve no other allocation, while the heap's holes (activations,
gathered units, temporaries) made resident memory creep up step after step. The next
unit is prefetched while the current one runs. Units default to the model's repeated
blocks (a Hugging Face `_no_split_modules`, else the children of its largest
ModuleList); the parameters outside every unit form a root unit, live for the whole
forward. Parameters with at most `param_persistence_threshold` elements stay
replicated (their gradients are all-reduced), as in DeepSpeed.

Frozen parameters (`requires_grad=False`: the base model of LoRA/PEFT fine-tuning) are
not state but constants of the apply_fn (`apply_fn.frozen`); stage 3 stores them sharded
too, as DeepSpeed ZeRO-3 and FSDP2 do: at the Step's first forward (or when
`dsfn.state.init.init_sharded` builds the state) each entry of `apply_fn.constants` it
names becomes this rank's `FlatShard` piece (`Placed`) and the module's own full tensor is
released, so a frozen base costs 1/N per rank. They are gathered per unit with the
trainable ones (same all-gathers, same saved-tensor re-gathers in backward), in mixed
precision's compute dtype when one is inside, and never get gradients or optimizer state;
a unit's frozen weights re-gathered for backward are dropped once backward moves to the
next unit (trainable ones go when their gradient arrives).

Ranks whose data reach different parameters (MoE routing, a skipped branch) issue the same
collectives: gradients are reduce-scattered in a fixed bucket plan over every parameter
(`dsfn.runtime.buckets.FixedBuckets`; zeros for a parameter this rank's loss did not
reach), stage 3 gathers units in a fixed order whatever a rank's forward calls (a unit it
skips is gathered and dropped), and its reduce-scatters travel on the axis's gradient
channel (`grad_channel`), so the on-demand gathers of backward cannot interleave with them
differently on different ranks. Activation checkpointing (Hugging Face's, a user's
`torch.utils.checkpoint`): the unit hooks stay until backward is over, and a recompute
re-gathers its unit in backward's order, then frees it (`zero3.backward_units` gauge).

Communication per step (Ψ = parameter elements, N = dp size, counted by the runtime):
stages 1-2 reduce-scatter Ψ and all-gather Ψ (2Ψ(N-1)/N moved per rank); stage 3
all-gathers Ψ in forward and again in backward and reduce-scatters Ψ (3Ψ(N-1)/N).
Gradient accumulation reduces every micro-batch into the shard (DeepSpeed's stage 2/3
choice: only shards are ever held).
"""
from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dsfn import tree
from dsfn.effects import bind
from dsfn.errors import ConfigError, StackError
from dsfn.functional import until_backward
from dsfn.runtime import collectives as C
from dsfn.runtime import env
from dsfn.runtime.flat import BufferPool, FlatGather, ShardReducer, all_gather_full, gather_into_buffers, map_whole
from dsfn.runtime.mesh import current_mesh, grad_channel
from dsfn.state.donation import may_alias, writable
from dsfn.state.init import store_constants
from dsfn.state.layout import (
    FlatShard,
    Layout,
    Nested,
    Offloaded,
    Placed,
    inner_view,
    is_placed,
    mirrored_param,
    shard_further,
)
from dsfn.transforms.core import make_transform
from dsfn.units import find_units
from dsfn.transforms.data_parallel import (
    DataParallel,
    all_reduce_buckets,
    registration_order,
    tap_gradients,
)


class ShardZero(DataParallel):
    name = "shard_zero"
    roles = frozenset({"data_parallel", "zero"})

    def __init__(self, stage: int, axis: str = "dp", reduce_bucket_size: int = 4_000_000,
                 allgather_bucket_size: int = 50_000_000, param_persistence_threshold: int = 0,
                 units: Sequence[str] | None = None, prefetch: int = 1, split_batch: bool = True):
        if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise ConfigError(f"shard_zero(stage={stage!r}): stage must be 0, 1, 2 or 3 "
                              "(0 = plain data parallel, 1 = + optimizer state, 2 = + gradients, 3 = + parameters)")
        for key, v in (("reduce_bucket_size", reduce_bucket_size), ("allgather_bucket_size", allgather_bucket_size)):
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"shard_zero({key}={v!r}): a bucket holds a positive number of elements")
        if not isinstance(param_persistence_threshold, int) or param_persistence_threshold < 0:
            raise ConfigError(f"shard_zero(param_persistence_threshold={param_persistence_threshold!r}): "
                              "use an element count >= 0 (0 shards every parameter)")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(f"shard_zero(prefetch={prefetch!r}): prefetch depth is an int >= 0")
        super().__init__(axis=axis, split_batch=split_batch, bucket_mb=reduce_bucket_size * 4 / 2**20)
        self.stage = stage
        self.reduce_bucket_size = reduce_bucket_size
        self.allgather_bucket_size = allgather_bucket_size
        self.param_persistence_threshold = param_persistence_threshold
        self.units = tuple(units) if units is not None else None
        self.prefetch = prefetch
        self._reducer: ShardReducer | None = None
        self._gatherers: list[UnitGatherer] = []     # stage 3: this round's forwards, for backward's end
        self._host_units = False                      # stage 3: this value_and_grad gathered units on the host
        self._expect: dict[str, list] = {}            # stage 3: key -> [gradients still due, their sum]
        self._frozen_dtype: torch.dtype | None = None  # mixed precision's compute dtype (check_stack)
        self._views: dict[int, tuple] = {}             # id(apply_fn) -> (apply_fn, constants' ids, view, cast)
        # stage 3: (module, parameter names) -> (module, _UnitPlan): what is the same every step,
        # the units' gather storages included
        self._plans: dict[tuple, tuple[nn.Module, _UnitPlan]] = {}
        # stages 1-3: gradient buckets and shards, the same blocks every step
        self._grad_pool = BufferPool(keep=ShardReducer.MAX_INFLIGHT + 1)

    # -- stack rules -------------------------------------------------------------------
    def check_stack(self, stack, index):
        super().check_stack(stack, index)    # overlap and reduce dtype, as data parallel
        for t in stack:
            if type(t) is DataParallel:
                raise StackError("shard_zero already does data parallelism over "
                                 f"{self.axis!r}; remove data_parallel() from the stack")
        # frozen parameters are gathered in the compute dtype of a mixed precision inside
        inner = stack[index + 1:]
        self._frozen_dtype = next((t.param_dtype for t in inner if "mixed_precision" in getattr(t, "roles", ())
                                   and getattr(t, "active", False)), None)

    def explain_note(self) -> str:
        if current_mesh().size(self.axis) == 1:
            return f"shard_zero({self.stage}): the {self.axis!r} axis has size 1, so nothing is sharded (identity)"
        return f"shard_zero({self.stage}) over {self.axis!r} (size {current_mesh().size(self.axis)})"

    # -- layout ----------------------------------------------------------------------------
    # A leaf ZeRO sees is a tensor, a piece placed by a transform inside (tensor parallel's
    # DimShard), or ZeRO's own shard of either: FlatShard, or Nested(inner layout, FlatShard)
    # (possibly Offloaded). ZeRO's "full tensor" is the piece the transforms inside hold.
    # tests that exercise the sharded machinery in one process (on `meta`, standing in for a
    # GPU) set this; training never does
    _shard_single_rank = False

    @property
    def _stage(self) -> int:
        """The stage in effect: 0 where the axis has one rank. A shard of one rank is the whole
        tensor, so world 1 lays out, gathers, copies and reduces nothing: it costs what
        `data_parallel` at world 1 costs (nothing)."""
        if self._shard_single_rank:
            return self.stage
        return 0 if current_mesh().size(self.axis) == 1 else self.stage

    def _sharded(self, x: Any) -> bool:
        """Stage-3 rule: parameters above the persistence threshold are stored sharded."""
        return _data(x).numel() > self.param_persistence_threshold

    def _mine(self, x: Any) -> bool:
        """Whether leaf `x` is ZeRO's shard (rather than a tensor or an inner transform's piece)."""
        return isinstance(x, Placed) and _zero_layout(x.layout) is not None

    def place(self, state: Any) -> Any:
        state = super().place(state)            # replicas start equal (broadcast from dp rank 0)
        if self._stage == 0:
            return state
        params = dict(tree.leaves_with_path(state.params, is_leaf=is_placed))
        shapes = {name: _logical_shape(p) for name, p in params.items()}
        if self.stage == 3:
            state = state.replace(params=tree.map(
                lambda x: self._as_shard(x) if self._sharded(x) else x, state.params, is_leaf=is_placed))

        def shard_mirror(path: str, x: Any) -> Any:
            is_tensor = isinstance(x, (torch.Tensor, Placed))
            owner = mirrored_param(path, _logical_shape(x) if is_tensor else None, shapes)
            if owner is None or (self.stage == 3 and not self._sharded(params[owner])):
                return x
            return self._as_shard(x)
        return state.replace(opt_state=tree.map_with_path(shard_mirror, state.opt_state, is_leaf=is_placed))

    def unplaced(self, state: Any) -> str | None:
        if self._stage == 0:          # world 1 included: nothing of ZeRO's to find
            return super().unplaced(state)
        if not hasattr(state, "params"):
            return None
        if self.stage == 3:
            for path, x in tree.leaves_with_path(state.params, is_leaf=is_placed):
                if self._mine(x):
                    return None
                if self._sharded(x):
                    return f"parameter {path!r} is a whole tensor, not this rank's ZeRO-3 shard"
            return None
        shapes = None          # made only when a whole tensor comes before any shard
        for path, x in tree.leaves_with_path(getattr(state, "opt_state", None), is_leaf=is_placed):
            if self._mine(x):
                return None
            if isinstance(x, torch.Tensor) and x.dim() > 0:
                if shapes is None:
                    shapes = {n: _logical_shape(p) for n, p in tree.leaves_with_path(state.params, is_leaf=is_placed)}
                if mirrored_param(path, _logical_shape(x), shapes) is not None:
                    return (f"optimizer state {path!r} is a whole tensor, not this rank's "
                            f"ZeRO-{self.stage} shard")
        return None

    # -- gradients -------------------------------------------------------------------------
    def handle_value_and_grad(self, call_next, fn, params, args, kwargs, has_aux):
        if self._stage == 0:
            return super().handle_value_and_grad(call_next, fn, params, args, kwargs, has_aux)
        outer = self._reducer
        if outer is None:
            plan = self._grad_plan(params)
            named, devices = plan["named"], plan["devices"]
            # stage 3 reduce-scatters on a channel of their own: its all-gathers are issued on
            # demand during backward, so the two sequences interleave differently on ranks
            # whose data reached different units; each channel's own order is the same
            axis = grad_channel(self.axis) if self.stage == 3 else self.axis
            reducer = ShardReducer(axis, self.reduce_bucket_size, "avg", self._reduce_dtype, named, devices,
                                   pool=self._grad_pool)
        else:
            reducer = outer
        self._reducer = reducer
        try:
            if self.stage == 2:
                fn = tap_gradients(fn, reducer.add)
            if outer is None and self.stage >= 2:
                fn = self._rounds(fn, reducer)     # each forward (micro-batch) is a round of buckets
            value, grads = call_next(fn, params, args, kwargs, has_aux)
            if outer is None:
                self._end_backward()
                if self._host_units and may_alias():
                    # every unit is released: a donated step gives the heap's holes back
                    # (env.trim_host_heap; on a GPU the units churn device memory instead)
                    env.trim_host_heap()
        finally:
            self._reducer = outer
            if outer is None:
                self._gatherers, self._expect, self._host_units = [], {}, False
        if outer is not None:      # nested call: the outermost call reduces
            return value, grads
        # reducer keys are leaf paths (flatten order: plan["paths"]); stage 1 reduces everything
        # after backward, in order
        paths, gs = plan["paths"], tree.leaves(grads, is_leaf=is_placed)
        if self.stage == 1:
            for path, g in zip(paths, gs):
                reducer.add(path, _data(g))
        shards = reducer.finish()
        replicated = plan["replicated"]
        reduced = dict(zip(replicated, all_reduce_buckets([_data(gs[k]) for k in replicated], self.axis,
                                                          self.reduce_bucket_size * 4, "avg")))
        out = []
        for k, (path, layout) in enumerate(zip(paths, plan["layouts"])):
            if k in reduced:
                g = gs[k]
                out.append(Placed(reduced[k], g.layout) if isinstance(g, Placed) else reduced[k])
                continue
            out.append(Placed(shards[path], layout))   # zeros where this rank's loss did not reach it
        return value, tree.unflatten(plan["spec"], out)

    def _grad_plan(self, params: Any) -> dict[str, Any]:
        """What handle_value_and_grad decides per parameter leaf — the reducer's keys (paths in
        registration order), full gradient shapes and devices; each leaf's path, whether it
        is all-reduced (stage-3 persistent) and its gradient shard's layout — computed once
        per structure and leaf layouts (the same objects step after step: compared by
        identity first, so a hit costs no Python call per leaf)."""
        leaves, spec = tree.flatten(params, is_leaf=is_placed)
        key = [x.layout if type(x) is Placed else (x.shape, x.dtype, x.device) for x in leaves]
        hit = self._grad_plan_cache
        if hit is not None and hit[0] == spec and hit[1] == key:
            return hit[2]
        # the keys that may reach the reducer: every parameter (stages 1-2), or the
        # stage-3 shards (persistent ones are all-reduced); the full gradient's shape
        named, devices = [], {}
        for path, x in registration_order(params):
            if self.stage == 3 and not self._mine(x):
                continue
            full = _zero_layout(x.layout).shape if self._mine(x) else tuple(_data(x).shape)
            named.append((path, torch.empty(full, dtype=_data(x).dtype, device="meta")))
            devices[path] = compute_device(x)     # zeros of an unused one: where grads are
        with_path = tree.leaves_with_path(params, is_leaf=is_placed)
        replicated = [k for k, (_, x) in enumerate(with_path) if self.stage == 3 and not self._mine(x)]
        plan = dict(named=named, devices=devices, paths=[p for p, _ in with_path], replicated=replicated,
                    layouts=[None if k in replicated else self._shard_layout(x) for k, (_, x) in enumerate(with_path)],
                    spec=spec)
        self._grad_plan_cache = (spec, key, plan)
        return plan

    _grad_plan_cache = None

    def _rounds(self, fn, reducer: ShardReducer):
        """`fn` that, at each call (each forward of the step: a micro-batch), first closes the
        previous one's backward: its units' remaining gathers and its buckets."""
        def wrapped(*args, **kwargs):
            self._end_backward()
            reducer.new_round()
            return fn(*args, **kwargs)
        return wrapped

    def _end_backward(self) -> None:
        for g in self._gatherers:
            g.finish_backward()
        self._gatherers = []
        for key, (_, partial) in sorted(self._expect.items()):    # uses whose gradient never came
            if partial is not None:
                self._reducer.add(key, partial)
        self._expect = {}

    # A stage-3 parameter gathered n times in a forward (a loss calling apply_fn twice, a
    # re-used unit) gets n gradients in backward; they are summed here and handed to the
    # reducer once, as one key per round, when the last one arrives (or at backward's end).
    def _gathers_made(self, keys: list[str]) -> None:
        """A unit's weights were gathered for a forward under grad: one more gradient due per key."""
        expect = self._expect
        for key in keys:
            rec = expect.get(key)
            if rec is None:
                expect[key] = [1, None]
            else:
                rec[0] += 1

    def _grads_arrived(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """(key, gradient) pairs of one backward node (a unit): summed per key as described
        above, and the complete ones handed to the reducer in one call."""
        ready = []
        for key, grad in items:
            rec = self._expect.get(key)
            if rec is None:                       # not counted (no grad mode at its forward): pass on
                ready.append((key, grad))
                continue
            rec[0] -= 1
            rec[1] = grad if rec[1] is None else rec[1] + grad
            if rec[0] == 0:
                del self._expect[key]
                ready.append((key, rec[1]))
        if ready:
            self._reducer.add_many(ready)

    # -- update ----------------------------------------------------------------------------
    def handle_apply_gradients(self, call_next, state, grads):
        if self._stage == 0:
            return call_next(state, grads)
        if self.stage == 3:   # grads follow their parameter's layout (persistent ones stay replicated)
            grads = tree.map(lambda g, p: self._as_shard(g) if self._mine(p) else g, grads, state.params,
                             is_leaf=is_placed)
            return call_next(state, grads)
        grads = tree.map(self._as_shard, grads, is_leaf=is_placed)
        olds = [_data(x) for x in tree.leaves(state.params, is_leaf=is_placed)]
        shards = tree.map(self._as_shard, state.params, is_leaf=is_placed)
        new = call_next(state.replace(params=shards), grads)
        leaves, spec = tree.flatten(new.params, is_leaf=is_placed)
        full = self._gather_updated([x.data for x in leaves], [_zero_layout(x.layout).shape for x in leaves], olds)
        return new.replace(params=tree.unflatten(spec, [inner_view(x, f) for x, f in zip(leaves, full)]))

    def _gather_updated(self, shards: list[torch.Tensor], shapes: list[tuple[int, ...]],
                        olds: list[torch.Tensor]) -> list[torch.Tensor]:
        """Stages 1-2: the updated shards all-gathered into full parameters. In a donated
        step the old full parameters are the step's to overwrite: a tensor whose storage
        holds exactly its padded size (numel divisible by the dp size, contiguous) is
        gathered into its old tensor in place, so no second full copy of the parameters is
        made; the others (and every tensor of a step that does not donate) get new ones."""
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

    def handle_map_whole(self, call_next, fn, pieces):
        """Whole-tensor functions of ZeRO shards (Muon): each tensor is rebuilt and mapped once,
        on an owner rank (`dsfn.runtime.flat.map_whole`); a shard of a tensor-parallel piece is
        rebuilt to that piece, which the transforms inside (tensor parallel) turn into the
        whole. Every rank of a tp group owns the same tensors, so their inner collectives
        match."""
        ours = [k for k, x in enumerate(pieces) if self._mine(x) and _zero_layout(x.layout).axis == self.axis]
        if not ours:
            return call_next(fn, pieces)
        out = list(pieces)
        rest = [k for k in range(len(pieces)) if k not in set(ours)]

        def whole(j: int, piece: torch.Tensor) -> torch.Tensor:
            x = pieces[ours[j]]
            res = call_next(lambda _i, w: fn(ours[j], w), [_inner_piece(x, piece)])[0]
            return _data(res)
        shards = [x.data for x in (pieces[k] for k in ours)]
        home = {s.device for s in shards}
        dev = next(iter(home)) if len(home) == 1 else torch.device("cpu")
        new = map_whole(whole, [s.to(dev) for s in shards], [_zero_layout(pieces[k].layout).shape for k in ours],
                        self.axis)
        for k, t in zip(ours, new):
            out[k] = Placed(t.to(pieces[k].data.device), pieces[k].layout)
        if rest:
            for k, r in zip(rest, call_next(lambda j, w: fn(rest[j], w), [pieces[k] for k in rest])):
                out[k] = r
        return out

    def handle_init_optimizer(self, call_next, state):
        """The optimizer state is made for what the update will see: shards (stage >= 1)."""
        if self._stage in (1, 2):
            state = state.replace(params=tree.map(self._as_shard, state.params, is_leaf=is_placed))
        return call_next(state)

    def _as_shard(self, x: Any) -> Any:
        """A full (already reduced) tensor or inner piece -> this rank's Placed shard."""
        return x if self._mine(x) else shard_further(x, lambda shape: FlatShard(self.axis, shape))

    def _shard_layout(self, x: Any) -> Layout:
        """The layout of `x`'s shard: its own if it is one, else what `_as_shard` would give it."""
        if self._mine(x):         # a gradient shard lives where compute does (not Offloaded)
            layout = x.layout
            while isinstance(layout, Offloaded):
                layout = layout.inner
            return layout
        if isinstance(x, Placed):
            return Nested(x.layout, FlatShard(self.axis, tuple(x.data.shape)))
        return FlatShard(self.axis, tuple(x.shape))

    # -- stage 3: frozen parameters ---------------------------------------------------------------
    def handle_place_constants(self, call_next, frozen):
        """Frozen parameters (name -> tensor, or an inner transform's piece) -> this rank's
        FlatShard pieces at stage 3 (meta tensors too: `init_sharded` fills them later)."""
        frozen = call_next(frozen)
        if self.stage != 3 or current_mesh().size(self.axis) == 1:
            return frozen
        return {n: (self._as_shard(x) if self._sharded(x) else x) for n, x in frozen.items()}

    def shard_frozen(self, apply_fn: Any) -> None:
        """Store `apply_fn`'s frozen parameters sharded, in place (see the module docstring):
        their `constants` entries become Placed pieces; the module's full tensors are released."""
        if self.stage != 3 or current_mesh().size(self.axis) == 1:
            return
        todo = {n: apply_fn.constants[n] for n in getattr(apply_fn, "frozen", ())
                if isinstance(apply_fn.constants.get(n), torch.Tensor)}
        if not todo:
            return
        placed = bind("place_constants", lambda c: c, todo)
        store_constants(apply_fn, placed)

    def _frozen_view(self, apply_fn: Any) -> tuple[Any, dict[str, tuple[torch.Tensor, FlatShard]]]:
        """(an ApplyFn whose constants are plain tensors — a sharded frozen parameter's local
        piece —, {name: (the piece to gather, in the compute dtype; its FlatShard)}); cached
        per apply_fn."""
        ids = tuple(map(id, apply_fn.constants.values()))
        hit = self._views.get(id(apply_fn))
        if hit is not None and hit[0] is apply_fn and hit[1] == ids:
            return hit[2], hit[3]
        from dsfn.functional import ApplyFn
        dtype = self._frozen_dtype
        pieces = {n: v.data for n, v in apply_fn.constants.items() if self._mine(v)}
        cast = {n: (t.to(dtype) if dtype is not None and t.is_floating_point() else t,
                    _zero_layout(apply_fn.constants[n].layout)) for n, t in pieces.items()}
        consts = {n: _data(v) for n, v in apply_fn.constants.items()}
        view = ApplyFn(apply_fn.module, consts, apply_fn.param_names, apply_fn.buffers, apply_fn.buffer_dtype,
                       frozen=apply_fn.frozen)
        self._views[id(apply_fn)] = (apply_fn, ids, view, cast)
        return view, cast

    # -- stage 3: gather units just in time -----------------------------------------------------
    def _shard_leaves(self, params: dict[str, Any]) -> tuple[tuple[str, ...], list[FlatShard], list[torch.device]]:
        """(names of ZeRO's shards among `params`, their FlatShards, their compute devices).
        Depends only on the names and the leaves' layouts, which a step hands on to the next
        (the same objects: a list comparison checks identity first, no Python call per leaf)."""
        key = [v.layout if type(v) is Placed else None for v in params.values()]
        hit = self._shard_leaves_cache
        if hit is not None and hit[0] == key and hit[1] == list(params):
            return hit[2]
        names = tuple(n for n, v in params.items() if self._mine(v))
        out = (names, [_zero_layout(params[n].layout) for n in names], [compute_device(params[n]) for n in names])
        self._shard_leaves_cache = (key, list(params), out)
        return out

    _shard_leaves_cache = None

    def _unit_plan(self, module: nn.Module, names: tuple[str, ...], frozen: tuple[str, ...]) -> "_UnitPlan":
        key = (id(module), names, frozen)
        hit = self._plans.get(key)
        if hit is None or hit[0] is not module:
            hit = self._plans[key] = (module, _UnitPlan(module, names, frozen, self.units))
        return hit[1]

    def handle_apply_module(self, call_next, apply_fn, params, args, kwargs):
        with self.token_mean(apply_fn, args, kwargs):       # HF's own loss: the whole batch's token mean
            return self._apply_module(call_next, apply_fn, params, args, kwargs)

    def _apply_module(self, call_next, apply_fn, params, args, kwargs):
        if self._stage != 3:
            return call_next(apply_fn, params, args, kwargs)
        self.shard_frozen(apply_fn)
        view, frozen = self._frozen_view(apply_fn)
        if not frozen and not any(self._mine(v) for v in params.values()):
            return call_next(apply_fn, params, args, kwargs)
        gatherer = UnitGatherer(apply_fn.module, params, self, frozen)
        if self._reducer is not None:           # inside value_and_grad: its backward ends the sequence
            self._gatherers.append(gatherer)
            self._host_units = self._host_units or any(d.type == "cpu" for d in gatherer.homes)
        # unit hooks stay until backward is over, so a recompute (activation checkpointing)
        # re-gathers its unit in backward's fixed order; saved-tensor hooks cover the forward
        with until_backward(gatherer.module_hooks()), gatherer:
            return call_next(view, gatherer.call_params, args, kwargs)


def shard_zero(*args: Any, **kwargs: Any) -> ShardZero:
    """`shard_zero(stage, axis="dp", reduce_bucket_size=4e6, allgather_bucket_size=5e7,
    param_persistence_threshold=0, units=None, prefetch=1, split_batch=True)`.

    Bucket sizes and the threshold count elements, as DeepSpeed's config keys do. Two
    defaults differ from DeepSpeed's on purpose: `reduce_bucket_size` (DeepSpeed 5e8) is
    small so that stage 2/3 keep only a bucket of full gradients alive and start
    reducing while backward runs; `param_persistence_threshold` (DeepSpeed 1e5) is 0
    because a unit's small parameters ride in the same all-gather as its large ones (no
    extra call), while a persistent one would need its own gradient all-reduce.
    """
    return make_transform(ShardZero, "shard_zero", args, kwargs)


def _data(x: Any) -> torch.Tensor:
    return x.data if isinstance(x, Placed) else x


def compute_device(x: Any) -> torch.device:
    """Where leaf `x` is computed with: an offloaded piece's `home` (the device it came from,
    e.g. cuda:0 for a shard kept in host memory), else the device its data is on."""
    layout = x.layout if isinstance(x, Placed) else None
    while isinstance(layout, Nested):
        layout = layout.outer
    if isinstance(layout, Offloaded):
        return torch.device(layout.home)
    return _data(x).device


def _zero_layout(layout: Layout) -> FlatShard | None:
    """ZeRO's FlatShard in a leaf's layout (under Offloaded, as Nested's outer), or None."""
    while isinstance(layout, Offloaded):
        layout = layout.inner
    if isinstance(layout, Nested):
        layout = layout.outer
    return layout if isinstance(layout, FlatShard) else None


def _inner_piece(x: Placed, piece: torch.Tensor) -> Any:
    """The tensor ZeRO's shard `x` was cut from, rebuilt (`piece`), as the transforms inside
    see it: a Placed with the inner layout under Nested, else the plain tensor."""
    layout = x.layout
    while isinstance(layout, Offloaded):
        layout = layout.inner
    return Placed(piece, layout.inner) if isinstance(layout, Nested) else piece


def _logical_shape(x: Any) -> tuple[int, ...]:
    return tuple(x.layout.shape) if isinstance(x, Placed) else tuple(x.shape)


# ---------------------------------------------------------------------------------------------
# Stage 3 machinery
# ---------------------------------------------------------------------------------------------

class _Gather(torch.autograd.Function):
    """shard -> full parameter (gathered by the UnitGatherer); backward queues the full
    gradient for reduce-scatter and returns a zero-stride zero for the shard."""

    @staticmethod
    def forward(ctx, shard, gatherer, index):
        ctx.gatherer, ctx.index, ctx.shard_device = gatherer, index, shard.device
        return gatherer.full(index)

    @staticmethod
    def backward(ctx, grad):
        ctx.gatherer.grads_ready([(ctx.index, grad)])
        # autograd wants the input's device: an offloaded shard lives on the host while its
        # gathered weight (and so `grad`) is on the compute device
        stand_in = torch.zeros((), dtype=grad.dtype, device=ctx.shard_device)
        return stand_in.expand(ctx.gatherer.shard_shape(ctx.index)), None, None


class _GatherUnit(torch.autograd.Function):
    """A unit's shards -> its full trainable parameters (gathered by the UnitGatherer), as
    one autograd node; backward hands every arrived gradient to the gatherer (which queues
    it for reduce-scatter) and returns zero-stride zeros for the shards."""

    @staticmethod
    def forward(ctx, gatherer, ids, *shards):
        ctx.gatherer, ctx.ids = gatherer, ids
        ctx.homes = [s.device for s in shards]
        ctx.shapes = [s.shape for s in shards]
        ctx.set_materialize_grads(False)        # an unused weight's gradient stays None
        full = gatherer._full
        return tuple([full[i] for i in ids])

    @staticmethod
    def backward(ctx, *grads):
        arrived, out = [], []
        for i, grad, home, shape in zip(ctx.ids, grads, ctx.homes, ctx.shapes):
            if grad is None:            # not reached by this loss: the reducer gets zeros at the end
                out.append(None)
                continue
            arrived.append((i, grad))
            # autograd wants the input's device: an offloaded shard lives on the host while its
            # gathered weight (and so `grad`) is on the compute device
            out.append(torch.zeros((), dtype=grad.dtype, device=home).expand(shape))
        if arrived:
            ctx.gatherer.grads_ready(arrived)     # the unit's gradients, in one call
        return (None, None, *out)


class _UnitPlan:
    """What a UnitGatherer needs to know about a module and its sharded parameters that does
    not change from step to step (computed once per module and parameter names, cached by
    ShardZero): index i = the i-th name (trainable shards, then frozen ones); each index's
    (owner module, attribute) slots (tied aliases too); the units (unit 0: the root) and
    the indices each holds; the modules owning sharded parameters directly (for a
    recompute); backward's gather order; each unit's gather storages (`storages`: unit ->
    _UnitStorage, shared by every gatherer of this module)."""

    def __init__(self, module: nn.Module, names: tuple[str, ...], frozen: tuple[str, ...], units: Any):
        self.names = list(names) + list(frozen)
        self.frozen = set(range(len(names), len(self.names)))
        self.index = {n: i for i, n in enumerate(self.names)}
        # every (owner module, attribute) slot through which a parameter is reached (tied ones too)
        by_obj: dict[int, list[str]] = {}
        for full_name, p in module.named_parameters(remove_duplicate=False):
            by_obj.setdefault(id(p), []).append(full_name)
        canonical = {n: aliases for aliases in by_obj.values() for n in aliases[:1]}
        self.slots: list[list[tuple[nn.Module, str]]] = []
        for n in self.names:
            slots = []
            for alias in canonical.get(n, [n]):
                owner_name, _, attr = alias.rpartition(".")
                slots.append((module.get_submodule(owner_name), attr))
            self.slots.append(slots)
        # units: a sharded parameter reached from exactly one unit belongs to it; one reached
        # from several units (tied across units) or from none belongs to the root
        unit_mods = find_units(module, units)

        def unit_holding(alias: str) -> int | None:
            return next((u for u, (uname, _) in enumerate(unit_mods) if alias.startswith(uname + ".")), None)
        owner_of: dict[int, int] = {}
        for i, n in enumerate(self.names):
            holders = {unit_holding(alias) for alias in canonical.get(n, [n])}
            if len(holders) == 1 and None not in holders:
                owner_of[i] = holders.pop()
        self.unit_params: list[list[int]] = [[] for _ in unit_mods]
        for i in sorted(owner_of):
            self.unit_params[owner_of[i]].append(i)
        root = [i for i in range(len(self.names)) if i not in owner_of]
        # the root unit (parameters outside every unit) runs first and stays live to the end
        self.units = [module] + [m for _, m in unit_mods]
        self.unit_params.insert(0, root)
        self.unit_of = {i: u for u, ids in enumerate(self.unit_params) for i in ids}
        # modules owning sharded parameters directly: (module, indices), for recompute hooks
        owners: dict[int, tuple[nn.Module, list[int]]] = {}
        for i, slots in enumerate(self.slots):
            for owner, _ in slots:
                owners.setdefault(id(owner), (owner, []))[1].append(i)
        self.owners = [(m, sorted(set(ids))) for m, ids in owners.values()]
        self.bw_seq = [0] + list(range(len(self.units) - 1, 0, -1))   # backward's gather order
        self.bw_pos = {u: k for k, u in enumerate(self.bw_seq)}
        self.storages: dict[int, _UnitStorage] = {u: _UnitStorage() for u in range(len(self.units))}


class UnitGatherer:
    """Gathers a forward's sharded parameters unit by unit (see the module docstring).

    Index i refers to `params`' i-th sharded entry; unit 0 is the root. The number of
    gathered units besides the root is published as the runtime gauge
    "zero3.live_units" (current and max) for tests and explain.
    """

    def __init__(self, module: nn.Module, params: dict[str, Any], zero: ShardZero,
                 frozen: dict[str, tuple[torch.Tensor, FlatShard]] | None = None):
        self.zero, self.module = zero, module
        frozen = frozen or {}
        names, layouts, homes = zero._shard_leaves(params)
        plan = zero._unit_plan(module, names, tuple(frozen))
        # the step's shards, in plan order: trainable ones, then frozen ones (no gradients)
        self.names, self.frozen, self.index, self.slots = plan.names, plan.frozen, plan.index, plan.slots
        self.units, self.unit_params, self.unit_of = plan.units, plan.unit_params, plan.unit_of
        self._owners, self._bw_seq, self._bw_pos = plan.owners, plan.bw_seq, plan.bw_pos
        self.shards = [params[n].data for n in names] + [piece for piece, _ in frozen.values()]
        self.layouts = layouts + [layout for _, layout in frozen.values()]
        # where each gathered weight must be (offload(params=True) keeps shards on the host)
        self.homes = homes + [piece.device for piece, _ in frozen.values()]
        self.call_params = {n: (v.data if isinstance(v, Placed) else v) for n, v in params.items()}
        # a unit is gathered into flat buffers (`FlatGather.slabs`); its weights are views of them
        self._full: dict[int, torch.Tensor] = {}              # index -> gathered weight, in use
        self._pending: dict[int, FlatGather] = {}             # unit -> in-flight gather
        self._fw: dict[int, FlatGather] = {}                  # unit -> forward gather, in use
        self._bw: dict[int, tuple[FlatGather, dict[int, torch.Tensor]]] = {}   # unit -> re-gathered for backward
        self._bw_left: dict[int, set[int]] = {}               # unit -> trainable indices whose grad is due
        self._grads_done: set[int] = set()                    # indices whose gradient arrived this backward
        self._bw_pending: dict[int, FlatGather] = {}          # unit -> prefetched backward gather
        self._unit_storage = plan.storages          # each unit's, shared by every gatherer (_UnitStorage)
        self._recompute_hooks: list[Any] = []
        self._live: set[int] = set()
        self._phase = "forward"                               # "backward" once the forward returned
        self._installed: dict[tuple[int, str], torch.Tensor] = {}   # recompute: slot -> what we put there
        self._fw_next = 0                                     # next unit forward launches
        self._bw_next = 0

    # -- gathering -------------------------------------------------------------------------------
    # Every rank issues the same all-gathers in the same order, whatever units its data
    # reaches (a routed expert, a skipped layer): forward launches units strictly in
    # registration order, so calling unit u first launches every earlier unit not launched
    # yet ("catch-up"; one this rank skipped is gathered and dropped), and the forward's
    # end launches the rest. Backward does the same over its fixed sequence: the root,
    # then the last unit down to the first. A unit called again after it was released
    # (re-use within one forward) is gathered again: ranks must re-use units alike.
    def _launch(self, u: int) -> None:
        if u in self._pending or u in self._live or not self.unit_params[u]:
            return
        # one bucketed all-gather per unit, into pooled buffers; async so the next unit's
        # gather overlaps compute
        self._pending[u] = self._gather_async(u)
        self._live.add(u)
        _gauge_live(self._live)

    def _on_home(self, i: int) -> torch.Tensor:
        """Shard i on its compute device (a host shard is copied there non-blocking), so the
        gathered weight lands where the forward runs, under gloo and NCCL alike."""
        s = self.shards[i]
        return s if s.device == self.homes[i] else s.to(self.homes[i], non_blocking=True)

    def _launch_upto(self, u: int) -> None:
        """Launch units `_fw_next .. u` (registration order) that are not launched yet."""
        while self._fw_next <= min(u, len(self.units) - 1):
            self._launch(self._fw_next)
            self._fw_next += 1

    def _drop_skipped(self, before: int) -> None:
        """Units launched ahead of `before` that this rank never ran: wait for their gathers
        (the ranks that run them need the collective) and free them."""
        for v in [v for v in self._pending if 0 < v < before]:
            self._release(v, self._pending.pop(v))
            self._live.discard(v)
        _gauge_live(self._live)

    def _materialize(self, u: int) -> None:
        if u >= self._fw_next:
            self._launch_upto(u)
        elif u not in self._pending and u not in self._live:
            self._launch(u)                   # re-use after release: gathered again
        self._drop_skipped(u)
        handle = self._pending.pop(u, None)
        if handle is not None:
            for i, t in zip(self.unit_params[u], handle.wait()):
                self._full[i] = t
            self._fw[u] = handle

    def _release(self, u: int, handle: FlatGather) -> None:
        """A gather of unit u is no longer used (waited for first: a collective may still be
        writing): its storages' memory goes once no gather of the unit is in use."""
        handle.release(None)
        self._unit_storage[u].done()

    def finish_forward(self) -> None:
        """The forward is over: launch the units this rank never reached, and drop them."""
        self._launch_upto(len(self.units) - 1)
        self._drop_skipped(len(self.units))

    def full(self, i: int) -> torch.Tensor:
        return self._full[i]

    def shard_shape(self, i: int) -> tuple[int, ...]:
        return tuple(self.shards[i].shape)

    def _pre(self, u: int):
        def hook(mod, args):
            if self._phase == "backward":      # a recompute of the unit (activation checkpointing)
                self._install_for_recompute(self.unit_params[u])
                return
            self._materialize(u)
            self._launch_upto(u + self.zero.prefetch)   # prefetch: overlaps this unit's compute
            ids = self.unit_params[u]
            trainable = [i for i in ids if i not in self.frozen]
            if torch.is_grad_enabled() and self.zero._reducer is not None:
                names = self.names
                self.zero._gathers_made([names[i] for i in trainable])
            # one autograd node for the unit's trainable weights (one Python call forward and
            # backward per unit, not per tensor); frozen weights take no part in autograd
            fulls = dict(zip(trainable, _GatherUnit.apply(self, tuple(trainable),
                                                          *(self.shards[i] for i in trainable))))
            for i in ids:
                full = fulls.get(i)
                if full is None:
                    full = self.full(i)
                for owner, attr in self.slots[i]:
                    owner._parameters[attr] = full
        return hook

    def _post(self, u: int):
        def hook(mod, args, out):
            if self._phase == "backward":
                self._restore(self.unit_params[u])
                return
            for i in self.unit_params[u]:
                self._full.pop(i, None)
                for owner, attr in self.slots[i]:
                    owner._parameters[attr] = self.shards[i]
            handle = self._fw.pop(u, None)
            if handle is not None:
                self._release(u, handle)
                self._before_backward(u, out)
            self._live.discard(u)
            _gauge_live(self._live)
        return hook

    def _before_backward(self, u: int, out: Any) -> None:
        """Re-gather unit u just before its backward: when the first gradient of its outputs
        is computed (FSDP2's pre-backward hook). Its saved weights are views of the unit's
        storages, which the re-gather fills again."""
        if not torch.is_grad_enabled():
            return
        ts = [t for t in _tensors_in(out) if t.requires_grad]
        if ts:
            torch.autograd.graph.register_multi_grad_hook(ts, lambda _g: self._needed_in_backward(u), mode="any")

    def _needed_in_backward(self, u: int) -> None:
        if u not in self._bw:
            self._gather_for_backward(u)

    def _gather_async(self, u: int) -> FlatGather:
        """Start gathering unit u into its storages (the same ones in forward and backward)."""
        ids = self.unit_params[u]
        store = self._unit_storage[u]
        shards, homes, layouts = self.shards, self.homes, self.layouts
        on_home = [shards[j] if shards[j].device == homes[j] else self._on_home(j) for j in ids]
        return store.gather(lambda pool: gather_into_buffers(
            on_home, [layouts[j].shape for j in ids], self.zero.axis, self.zero.allgather_bucket_size, pool))

    def _bw_launch_upto(self, pos: int) -> None:
        """Launch the backward sequence's units up to position `pos` not launched yet."""
        while self._bw_next <= min(pos, len(self._bw_seq) - 1):
            v = self._bw_seq[self._bw_next]
            if self.unit_params[v]:
                self._bw_pending[v] = self._gather_async(v)
            self._bw_next += 1

    def _gather_for_backward(self, u: int) -> None:
        """Re-gather unit u for backward (after every unit before it in the backward sequence:
        the root, then the last unit down to the first), drop units this rank's backward
        passed without using, and prefetch the next ones."""
        p = self._bw_pos[u]
        if p >= self._bw_next:
            self._bw_launch_upto(p)
        handle = self._bw_pending.pop(u, None) or self._gather_async(u)
        for v in [v for v in self._bw_pending if v != 0 and self._bw_pos[v] < p]:
            self._release(v, self._bw_pending.pop(v))     # a unit this rank skipped: its gather, dropped
        ids = self.unit_params[u]
        self._bw[u] = (handle, dict(zip(ids, handle.wait())))
        # the unit is dropped when its last trainable weight's gradient arrives (every use of
        # its weights in backward is then done); one holding frozen weights, which no
        # gradient marks done, when backward has passed it
        self._bw_left[u] = {j for j in ids if j not in self.frozen and j not in self._grads_done}
        for v in [v for v in self._bw if v not in (0, u) and self._bw_pos[v] < p and self._has_frozen(v)]:
            self._drop_bw(v)
        self._bw_launch_upto(p + self.zero.prefetch)
        # units held for backward besides the root (gathered, or in flight): stays bounded
        C.gauge("zero3.backward_units", len((set(self._bw) | set(self._bw_pending)) - {0}))

    def _has_frozen(self, u: int) -> bool:
        return any(j in self.frozen for j in self.unit_params[u])

    def _drop_bw(self, u: int) -> None:
        handle = self._bw.pop(u)[0]          # its weights' views go with the entry
        self._bw_left.pop(u, None)
        self._release(u, handle)

    def finish_backward(self) -> None:
        """Backward is over: gather (and drop) the units this rank's backward never reached,
        so every rank has issued the whole backward sequence."""
        self._bw_launch_upto(len(self._bw_seq) - 1)
        for v in list(self._bw_pending):
            self._release(v, self._bw_pending.pop(v))
        for v in list(self._bw):
            self._drop_bw(v)
        self._grads_done.clear()

    def grads_ready(self, pairs: list[tuple[int, torch.Tensor]]) -> None:
        """Gradients (index, grad) arrived: every use of those weights in backward is done; a
        unit's buffers go with its last one. Then they go to the reducer, in one call."""
        touched = set()
        for i, _ in pairs:
            self._grads_done.add(i)
            u = self.unit_of[i]
            left = self._bw_left.get(u)
            if left is not None:
                left.discard(i)
                touched.add(u)
        for u in touched:
            if not self._bw_left[u] and not self._has_frozen(u):
                self._drop_bw(u)
        names = self.names
        self.zero._grads_arrived([(names[i], g) for i, g in pairs])

    # -- context -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def module_hooks(self):
        """The units' forward hooks, kept until backward is over; from the forward's end, the
        hooks that install re-gathered weights for a recompute (`_recompute_hooks_on`)."""
        hooks = []
        for u, m in enumerate(self.units):
            hooks.append(m.register_forward_pre_hook(self._pre(u)))
            hooks.append(m.register_forward_hook(self._post(u)))
        try:
            yield self
        finally:
            for h in hooks + self._recompute_hooks:
                h.remove()
            self._recompute_hooks = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.finish_forward()
        # left by an exception inside the forward: waited for, their storages freed
        for u, handle in [*self._pending.items(), *self._fw.items()]:
            self._release(u, handle)
        self._pending.clear()
        self._fw.clear()
        self._full.clear()
        self._live.clear()
        _gauge_live(self._live)
        self._phase = "backward"
        if exc[0] is None:
            self._recompute_hooks_on()
        return False

    # -- recompute in backward (activation checkpointing) -------------------------------------------
    def _install_for_recompute(self, ids: list[int]) -> None:
        for u in sorted({self.unit_of[i] for i in ids}, key=lambda v: self._bw_pos[v]):
            if u not in self._bw:
                self._gather_for_backward(u)
        for i in ids:
            # a slot someone else filled for its own recompute (tiled compute puts in the
            # weights it saved) is left alone: only a shard is replaced
            slots = [(o, a) for o, a in self.slots[i] if o._parameters.get(a) is self.shards[i]]
            if not slots:
                continue
            # through _Gather, as in the forward: the recompute must save what the forward
            # saved (autograd saves a weight only when it requires grad)
            self._full[i] = self._bw[self.unit_of[i]][1][i]
            full = _Gather.apply(self.shards[i], self, i)
            for owner, attr in slots:
                owner._parameters[attr] = full
                self._installed[(id(owner), attr)] = full

    def _restore(self, ids: list[int]) -> None:
        for i in ids:
            self._full.pop(i, None)
            for owner, attr in self.slots[i]:
                mine = self._installed.pop((id(owner), attr), None)
                if mine is not None and owner._parameters.get(attr) is mine:
                    owner._parameters[attr] = self.shards[i]

    def _recompute_hooks_on(self) -> None:
        """Hooks for a recompute in backward (activation checkpointing), installed once the
        forward is over: a module owning sharded parameters directly gets its unit's
        re-gathered weights around its forward. Global module hooks (one pair, a dict
        lookup per module call), so the forward itself runs no per-module Python; Hugging
        Face and `remat` checkpoint a layer's `forward` past the layer's own hooks, its
        submodules' calls still pass them (and `remat` runs marked global hooks itself)."""
        owners = {id(m): ids for m, ids in self._owners}

        def pre(mod, args):
            ids = owners.get(id(mod))
            if ids is not None:
                self._install_for_recompute(ids)

        def post(mod, args, out):
            ids = owners.get(id(mod))
            if ids is not None:
                self._restore(ids)
        self._recompute_hooks = [nn.modules.module.register_module_forward_pre_hook(recompute_hook(pre)),
                                 nn.modules.module.register_module_forward_hook(recompute_hook(post))]


def recompute_hook(hook):
    """Mark a module hook that must also run around a recompute of the module's `forward`
    alone (`remat` checkpoints `forward`, past the module's hooks, as Hugging Face does):
    ZeRO-3's hooks install the unit's re-gathered parameters for it."""
    hook._dsfn_recompute = True
    return hook


class _UnitStorage:
    """One unit's gather buffers, kept across steps (FSDP2's unsharded storage): the same
    tensors, so the same storage objects, every time the unit is gathered. Their memory
    exists while some gather of the unit is in use (`users` > 0) and is freed — storages
    resized to 0 bytes, the tensor objects kept — when none is. A weight autograd saved
    in forward (a view of a buffer) is therefore valid again once backward re-gathers the
    unit into the same storages. Writes into a buffer that saved views share keep its
    version counter (the data is the same weights again)."""

    def __init__(self) -> None:
        self.slabs: list[torch.Tensor] = []
        self.users = 0
        self._next = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """`gather_into_buffers`' k-th bucket buffer (its pool interface): the k-th kept one,
        with its memory (re)allocated; a new one on the first gather or a changed plan."""
        k, self._next = self._next, self._next + 1
        s = self.slabs[k] if k < len(self.slabs) else None
        if s is None or s.numel() != numel or s.dtype != dtype or s.device != torch.device(device):
            s = torch.empty(numel, dtype=dtype, device=device)
            self.slabs[k:k + 1] = [s]
        nbytes = numel * s.element_size()
        if s.untyped_storage().nbytes() != nbytes:
            s.untyped_storage().resize_(nbytes)
        return s

    def gather(self, start: Any) -> FlatGather:
        """`start(pool)` (a gather_into_buffers call taking its buffers from here), counted
        as one more user."""
        self._next = 0
        handle = start(self)      # its writes keep the buffers' version counters (FlatGather)
        self.users += 1
        return handle

    def done(self) -> None:
        """A gather is no longer used (its collectives are complete); the last one frees the memory."""
        self.users -= 1
        if self.users == 0:
            for s in self.slabs:
                s.untyped_storage().resize_(0)


def _tensors_in(out: Any) -> list[torch.Tensor]:
    """The tensors of a module's output: a tensor, or (nested) tuples, lists and mappings of
    them (a Hugging Face ModelOutput is a mapping)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for x in out for t in _tensors_in(x)]
    if isinstance(out, dict):
        return [t for x in out.values() for t in _tensors_in(x)]
    return []


def _gauge_live(live: set[int]) -> None:
    """Gathered units other than the root (unit 0, live for the whole forward)."""
    C.gauge("zero3.live_units", len(live - {0}))
