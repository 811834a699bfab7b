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
unit's buffers are storages kept across steps (`UnitStorage`): their memory exists while
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
trainable ones (same all-gathers, same re-gathers in backward), in mixed
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
choice: only shards are ever held). With `pipeline_parallel` inside (a "pipeline" role),
whose schedule interleaves micro-batches' forwards and backwards, a round is a micro-batch's
backward instead of its forward, and stages 2-3 sum a parameter held by two stages (a tied
embedding) over the pipeline axis after reducing it (DeepSpeed refuses ZeRO-2/3 with its
pipeline engine).

Beyond one node (`dsfn.engines.zero.groups`; the launcher's topology, `dsfn.runtime.topology`):
with `shard_group=k` ("node": the dp ranks of one node) the shards are cut over k ranks
(mesh axis "dp_shard") and are copies across the groups ("dp_replicate"): every all-gather
and reduce-scatter above runs inside the group, then each bucket's reduced shards are
all-reduced across the groups once (at backward's end, so no wait cycle can form with the
group's gathers), and the state per rank is 1/k instead of 1/N. Per node and step, only
that all-reduce crosses the network: 2·P·(n-1)/n bytes for n nodes (P the parameter bytes)
instead of flat stage 3's ≈ 3·P·(n-1)/n. With `hpz=k` (stage 3) the shards stay over all N
ranks; each unit gathered in a forward under value_and_grad keeps this rank's 1/k of it
(k ranks of a node, "dp_shard"), from which backward re-gathers it inside the node
(`UnitGatherer`, gauge "zero3.secondary_bytes").

Policy and machinery: this module holds the policy (options, checks, which primitives
ZeRO handles and when it is in effect); the work is in engines, one per stage as in
DeepSpeed (`dsfn.engines.zero.stage12` for stages 1-2, `dsfn.engines.zero.stage3` with
its unit lifecycle in `dsfn.engines.zero.units`, both over `dsfn.engines.zero.shards`),
and what is replicated (stage 0, world 1, persistent parameters) is data parallel's
(`dsfn.engines.data_parallel.Replicas`). The handlers branch on no stage: the engine chosen
at construction answers.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dsfn.engines.data_parallel import Replicas
from dsfn.engines.zero.stage12 import Stage12
from dsfn.engines.zero.shards import ZeroOptions
from dsfn.engines.zero.stage3 import Stage3
from dsfn.errors import ConfigError, StackError
from dsfn.functional import until_backward
from dsfn.placed import data_of
from dsfn.runtime.flat import map_whole
from dsfn.runtime.mesh import current_mesh
from dsfn.state.train_state import never_placed
from dsfn.transforms.core import Transform, make_transform, map_rest_inside, with_role
from dsfn.transforms.facts import StackFacts, stack_facts


class ShardZero(Transform):
    name = "shard_zero"
    roles = frozenset({"data_parallel", "zero"})

    def __init__(self, stage: int, axis: str = "dp", reduce_bucket_size: int = 4_000_000,
                 allgather_bucket_size: int = 50_000_000, param_persistence_threshold: int = 0,
                 units: Sequence[str] | None = None, prefetch: int = 1, split_batch: bool = True,
                 shard_group: int | str | None = None, hpz: int | str | None = None, cross_node: bool = False,
                 hierarchical_gather: bool = False, quantize_weights: str | None = None,
                 quantize_block: int = 2048, quantize_grads: str | None = None, quantize_grads_block: int = 32,
                 quantize_frozen: str | None = None):
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
        _check_stage_options(stage, allgather_bucket_size, param_persistence_threshold, units, prefetch,
                             shard_group, hpz)
        _check_groups(stage, shard_group, hpz, cross_node, hierarchical_gather)
        if not isinstance(axis, str):
            raise ConfigError(f"shard_zero(axis=...) takes a mesh axis name, got {axis!r}")
        self.axis = axis
        self.split_batch = bool(split_batch)
        # what is replicated (stage 0, world 1, persistent parameters) is data parallel's work
        self._replicas = Replicas(axis, reduce_bucket_size * 4)
        self.stage = stage
        self.reduce_bucket_size = reduce_bucket_size
        self.allgather_bucket_size = allgather_bucket_size
        self.param_persistence_threshold = param_persistence_threshold
        self.units = tuple(units) if units is not None else None
        self.prefetch = prefetch
        self.shard_group, self.hpz, self.cross_node = shard_group, hpz, bool(cross_node)
        self.hierarchical_gather = hierarchical_gather
        self.wire = _weight_wire(stage, quantize_weights, quantize_block, quantize_frozen is not None)
        self.frozen_wire = _frozen_wire(stage, quantize_frozen, quantize_block)
        self.grad_wire = _grad_wire(stage, quantize_grads, quantize_grads_block)
        # the stage's engine (none at stage 0: data parallel's replicas do everything)
        self._engine = _engine_for(self)

    # -- stack rules ----------------------------------------------------------------------------
    def check_stack(self, stack, index):
        for t in with_role(stack, "data_parallel"):
            if t is not self:
                raise StackError("shard_zero already does data parallelism over "
                                 f"{self.axis!r}; remove {t.name}() from the stack")
        inside = StackFacts(stack[index + 1:]).whole
        if inside.first("hears_grad_buckets") and inside.all("batch_axis"):
            # the buckets would be heard before the mean over the batch axis (`_batch_mean`)
            raise StackError(f"shard_zero: a transform inside hears reduced gradient buckets (offload's overlap) "
                             f"while another splits the batch over {inside.all('batch_axis')}: not supported "
                             "together; drop offload(overlap=True)")

    def facts(self) -> dict[str, Any]:
        return {"dp_axis": self.axis, "zero_stage": self.stage, "reduce_bucket_size": self.reduce_bucket_size,
                "zero_single_rank": self._shard_single_rank, "zero_shard_group": self.shard_group,
                "zero_hpz": self.hpz, "allgather_bucket_size": self.allgather_bucket_size, "zero_units": self.units,
                # stages 2-3 take each gradient over as backward makes it (taps, unit gathers):
                # a transform inside never sees them at its own leaves
                "takes_grads_in_backward": self.stage >= 2}

    def explain_note(self) -> str:
        mesh = current_mesh()
        if mesh.size(self.axis) == 1:
            return f"shard_zero({self.stage}): the {self.axis!r} axis has size 1, so nothing is sharded (identity)"
        note = f"shard_zero({self.stage}) over {self.axis!r} (size {mesh.size(self.axis)})"
        if self._engine is None:
            return note

        def where(axis: str) -> str:
            return f"{axis!r} ({mesh.size(axis)}, {'across nodes' if mesh.spans_nodes(axis) else 'inside a node'})"
        shard, replicate = self._engine.shard_axes()
        if replicate is not None:
            note += f": hybrid, state sharded over {where(shard)} and replicated over {where(replicate)}"
        if self.hierarchical_gather:
            hierarchy = self._engine.hierarchy_axes()
            note += (f": parameters gathered across nodes over {where(hierarchy[0])}, then inside the node over "
                     f"{where(hierarchy[1])}" if hierarchy is not None else
                     ": hierarchical_gather has nothing to do (the shard group is inside a node)")
        secondary = self._engine.secondary_axis() if self.hpz is not None else None
        if secondary is not None:
            note += (f": hpZ, each gathered unit keeps a secondary shard over {where(secondary)} for backward's "
                     f"re-gather (+1/{mesh.size(secondary)} of a unit per rank from its forward to its backward)")
        if self.grad_wire is not None:
            g = self.grad_wire
            local = mesh.ranks_on_node(shard)
            note += (f": qgZ, gradient buckets reduced as {g.fmt} codes with one fp32 scale per {g.block} elements "
                     + (f"by all-to-all inside each node ({local} ranks), then across nodes (one row per node)"
                        if local < mesh.size(shard) and local > 1 else f"by one all-to-all over {where(shard)}")
                     + (f", then all-reduced across {where(replicate)} as codes too" if replicate is not None else ""))
        if self.wire is not None:
            w = self.wire
            note += (f": qwZ, weights of >= {w.min_numel} elements gathered as {w.fmt} codes (1 B per element) with "
                     f"one fp32 scale per {w.block} elements{' (the secondary keeps the codes)' if secondary else ''}, "
                     "dequantized into the unit; the shards stay exact")
        return note

    # tests that exercise the sharded machinery in one process (on `meta`, standing in for a
    # GPU) set this; training never does
    _shard_single_rank = False

    def _in_effect(self) -> Any:
        """The stage's engine where it acts, else None: a shard of one rank is the whole
        tensor, so at world 1 ZeRO lays out, gathers, copies and reduces nothing — it costs
        what `data_parallel` at world 1 costs (nothing) — unless it streams offloaded
        parameters (`streams_params`)."""
        if self._engine is None or (current_mesh().size(self.axis) == 1 and not self._shard_single_rank
                                    and not self.streams_params()):
            return None
        return self._engine

    def streams_params(self) -> bool:
        """ZeRO-Infinity on one rank: stage 3 with `offload(params=True)` inside keeps every
        parameter in host memory (or NVMe) and streams it to the device unit by unit (the
        "gather" of a one-rank shard is its copy to the device, released after the unit ran;
        gradients go to the host as backward makes them, and the update runs there), so its
        machinery acts at world 1 too. Read off offload's published fact `offload_params`."""
        return self.stage == 3 and bool(stack_facts(self).inside(self).first("offload_params", False))

    # -- layout -----------------------------------------------------------------------------------
    def place(self, state: Any) -> Any:
        state = self._replicas.broadcast(state)     # replicas start equal (broadcast from dp rank 0)
        engine = self._in_effect()
        return state if engine is None else engine.place(state)

    def unplaced(self, state: Any) -> str | None:
        engine = self._in_effect()
        if engine is None:          # world 1 included: nothing of ZeRO's to find
            if self._replicas.size() > 1 and never_placed(state):
                return (f"it is TrainState.create's state, whose replicas on the {self.axis!r} ranks were never "
                        "made equal (place broadcasts dp rank 0's)")
            return None
        return engine.unplaced(state) if hasattr(state, "params") else None

    # -- gradients --------------------------------------------------------------------------------
    def handle_value_and_grad(self, call_next, fn, params, args, kwargs, has_aux):
        facts = stack_facts(self)
        engine = self._in_effect()
        if engine is None:     # data parallel's reduction (once, after backward, with accumulation inside)
            reduction = self._replicas.begin_reduction(params, facts,
                                                       overlap=not facts.inside(self).has_role("accumulate"))
            value, grads = call_next(reduction.differentiated(fn), params, args, kwargs, has_aux)
            return value, self._batch_mean(reduction.finish(grads), facts)
        # a transform inside that hears reduced buckets (offload's overlapped host update)
        hears = facts.inside(self).first("hears_grad_buckets", False)
        reduction = engine.Reduction(engine, fn, params, facts, hears)
        try:
            value, grads = call_next(reduction.fn, params, args, kwargs, has_aux)
        except BaseException:
            reduction.close()
            raise
        return value, self._batch_mean(reduction.finish(grads), facts)

    def _batch_mean(self, grads: Any, facts: Any) -> Any:
        """The reduced gradients also averaged over the batch axes of a transform inside (expert
        parallel's ep: the fact "batch_axis"), leaves laid out over such an axis excepted
        (data parallel's rule, `Replicas.mean_over_batch_axes`): after the reduce-scatters, on
        the shards, so it costs 1/dp of the gradients under stages 1-3."""
        return self._replicas.mean_over_batch_axes(grads, facts.inside(self).all("batch_axis"), facts)

    def handle_micro_batch(self, call_next, event):
        """Micro-batch j's forward or backward begins: the running reduction hears whether the
        micro-batches interleave (then a round of buckets is a backward, not a forward)."""
        engine = self._in_effect()
        if engine is not None and engine.active is not None:
            engine.active.hear(event)
        return call_next(event)

    # -- the replicated parts: data parallel's machinery --------------------------------------------
    def wrap_step(self, fn):
        if not self.split_batch:
            return fn

        def step(state, batch):
            return fn(state, self._replicas.split(batch))
        return step

    def handle_reduce_metrics(self, call_next, metrics):
        return call_next(self._replicas.average_metrics(metrics))

    def handle_sync_buffers(self, call_next, buffers):
        """Every replica takes dp rank 0's buffers (data_parallel's rule)."""
        return call_next(self._replicas.sync_buffers(buffers))

    def handle_reduce_leaves(self, call_next, partials, pending, op):
        """Leaves split over this transform's axis (its shards) are combined over it; under
        hybrid sharding over the shard group's axis (not across the copies)."""
        partials, pending = self._replicas.reduce_leaves(partials, pending, op)
        if self._engine is not None and self.shard_group is not None:
            partials, pending = self._engine.reduce_leaves(partials, pending, op)
        return call_next(partials, pending, op)

    # -- update -----------------------------------------------------------------------------------
    def handle_apply_gradients(self, call_next, state, grads):
        engine = self._in_effect()
        if engine is None:
            return call_next(state, grads)
        state, grads, finish = engine.begin_update(state, grads)
        new = call_next(state, grads)
        return new if finish is None else finish(new)

    def handle_map_whole(self, call_next, fn, pieces):
        """Whole-tensor functions of ZeRO shards (Muon): rebuilt and mapped once, on an owner rank."""
        job = None if self._engine is None else self._engine.whole_job(pieces)
        if job is None:
            return call_next(fn, pieces)

        def whole(j: int, piece: torch.Tensor) -> torch.Tensor:
            k = job.ours[j]
            return data_of(call_next(lambda _i, w: fn(k, w), [job.inner(j, piece)])[0])
        out = job.placed(map_whole(whole, job.shards, job.shapes, job.axis))
        return map_rest_inside(call_next, fn, pieces, job.rest, out)

    def handle_init_optimizer(self, call_next, state):
        """The optimizer state is made for what the update will see (stages 1-2: shards)."""
        engine = self._in_effect()
        return call_next(state if engine is None else engine.optimizer_view(state))

    # -- forward ----------------------------------------------------------------------------------
    def handle_place_constants(self, call_next, frozen):
        """Frozen parameters -> this rank's pieces (stage 3 shards them; see the module docstring)."""
        frozen = call_next(frozen)
        if self._engine is None or current_mesh().size(self.axis) == 1:
            return frozen
        return self._engine.place_constants(frozen)

    def handle_apply_module(self, call_next, apply_fn, params, args, kwargs):
        with self._replicas.token_mean(apply_fn, args, kwargs):       # a model's own loss: the batch's token mean
            engine = self._in_effect()
            if engine is None:
                return call_next(apply_fn, params, args, kwargs)
            # frozen parameters are gathered in the compute dtype of a mixed precision inside
            dtype = stack_facts(self).inside(self).first("compute_dtype")
            units = engine.begin_forward(apply_fn, params, dtype)
            if units is None:
                return call_next(apply_fn, params, args, kwargs)
            # the gatherer hears its units' layer events until backward is over: a recompute
            # re-gathers its unit
            with until_backward(units.listening(engine.live_units, engine.recompute_watch)), units:
                return call_next(units.view, units.call_params, args, kwargs)

    def handle_units_of(self, call_next, module):
        """The modules whose layer events ZeRO-3 needs: its units of `module` (the root too)."""
        found = call_next(module)
        engine = self._in_effect()
        return found if engine is None or self.stage < 3 else found + tuple(engine.units_of(module))

    def handle_run_unit(self, call_next, module, phase, value, recompute):
        """A unit about to run ("pre": gathered just in time) or just run ("post": released, its
        backward re-gather armed), for every live gatherer of it — before the transforms inside
        act (a pipeline stage's last layer ends the forward after the release)."""
        engine = self._engine
        if engine is None:
            return call_next(module, phase, value, recompute)
        if phase == "recompute_pre" or phase == "recompute_post":     # a module owning shards directly
            watched = engine.recompute_watch.live.get(id(module)) if self.stage == 3 else None
            for m, gatherer, ids in watched or ():
                if m is module:
                    if phase == "recompute_pre":
                        gatherer.install_for_recompute(ids)
                    else:
                        gatherer.restore_after_recompute(ids)
            return call_next(module, phase, value, recompute)
        runs = engine.live_units.get(id(module))
        if runs:
            if phase == "pre":
                for gatherer, u in runs:
                    gatherer.unit_pre(u)
            elif phase == "post":
                for gatherer, u in runs:
                    gatherer.unit_post(u, value)
        return call_next(module, phase, value, recompute)


def _engine_for(zero: ShardZero) -> Any:
    """The engine of `zero`'s stage: None (stage 0), Stage12 or Stage3, given one frozen options object."""
    if zero.stage == 0:
        return None
    options = ZeroOptions(zero.axis, zero.stage, zero.reduce_bucket_size, zero.allgather_bucket_size,
                          zero.param_persistence_threshold, zero.units, zero.prefetch, zero.shard_group,
                          zero.cross_node, zero.hpz, zero.hierarchical_gather, zero.wire, zero.grad_wire,
                          zero.frozen_wire)
    return Stage12(options) if zero.stage in (1, 2) else Stage3(options)


def shard_zero(*args: Any, **kwargs: Any) -> ShardZero:
    """`shard_zero(stage, axis="dp", reduce_bucket_size=4e6, allgather_bucket_size=5e7,
    param_persistence_threshold=0, units=None, prefetch=1, split_batch=True,
    shard_group=None, hpz=None, cross_node=False, hierarchical_gather=False,
    quantize_weights=None, quantize_block=2048, quantize_grads=None, quantize_grads_block=32,
    quantize_frozen=None)`.

    ZeRO++ qwZ (stage 3): `quantize_weights="int8"` (or "fp8_e4m3") gathers the weights for
    the compute as block-wise symmetric codes with one fp32 scale per `quantize_block`
    elements (`dsfn.ops.quantize`), dequantized into the gathered unit: a quarter of the bytes
    from fp32, half from bf16, + 4 / quantize_block per element of scales. Under hpZ the
    secondary shard keeps the forward's codes and scales (a byte an element), so backward's
    re-gather sends codes too and rebuilds bitwise the forward's weights. Tensors of fewer than `quantize_block` elements (norms, biases) and
    non-floating ones travel as they are; so do MiCS's hierarchical gathers. The shards, the
    master weights, the optimizer state and checkpoints never hold quantized values: only the
    gathered compute copy is lossy (int8: within half a block's scale, absmax / 254, per
    element).

    ZeRO++'s quantized nontrainable weights (stage 3): `quantize_frozen="int8"` (or
    "fp8_e4m3") holds each frozen parameter's shard (a LoRA base) quantized, once, at the
    first step: its codes and scales (a `Quantized` layout; a byte an element, + 4 /
    quantize_block), gathered as they are and dequantized into the unit in the compute
    dtype, so a frozen base costs a quarter (fp32) or half (bf16) of its shard's memory and
    wire. The same size rule as qwZ; independent of `quantize_weights`. Lossy by design:
    the held weights are the quantized ones from then on (`export_state` writes them
    dequantized); trainable state is never quantized.

    ZeRO++ qgZ (stages 1-3): `quantize_grads="int4"` (or "int8") replaces each gradient
    bucket's reduce-scatter by block-wise quantized all-to-alls (one fp32 scale per
    `quantize_grads_block` elements of each destination's row): where the shard axis spans
    nodes, inside the node first (dequantized, summed over the node's ranks, requantized),
    then across nodes with one row per node; then averaged. Each tensor is quantized on blocks
    of its own; 1-D gradients (norms, biases) are reduce-scattered exactly. The default block
    (32: 0.625 B an element on the wire) keeps the example GPT's eval loss after 300 steps
    within 1% of the exact run's (+0.62%; 64: +1.02%, outside; benchmarks/quantized_comm.py). Synchronous per bucket (the exact
    reduce-scatter overlaps backward). No error feedback. Under hybrid sharding the
    in-group reduce-scatter is quantized, and so is the all-reduce of the shards across
    groups (a quantized all-to-all, then the reduced chunks gathered as codes: every replica
    dequantizes the same codes, so they stay bitwise equal); 1-D gradients exact there too.

    Beyond one node (stages 1-3): `shard_group="node"` (or k ranks) is hybrid sharding
    (FSDP2's HSDP, DeepSpeed's MiCS): the state is sharded over the dp ranks of one node
    and replicated across nodes; gradients are reduce-scattered inside the group, then
    the shard-sized result is all-reduced across groups, so only that all-reduce crosses
    the network. `hpz="node"` (stage 3, ZeRO++'s hpZ) keeps flat sharding over every dp
    rank, but each unit gathered in forward leaves a node-local secondary shard from which
    backward re-gathers it inside the node. A group spanning nodes needs
    `cross_node=True`; with `hierarchical_gather=True` (MiCS's) such a group gathers its
    parameters across nodes first, then inside each node. The axes are named "dp_shard" /
    "dp_replicate" (`explain`).

    Bucket sizes and the threshold count elements, as DeepSpeed's config keys do. Two
    defaults differ from DeepSpeed's on purpose: `reduce_bucket_size` (DeepSpeed 5e8) is
    small so that stage 2/3 keep only a bucket of full gradients alive and start
    reducing while backward runs; `param_persistence_threshold` (DeepSpeed 1e5) is 0
    because a unit's small parameters ride in the same all-gather as its large ones (no
    extra call), while a persistent one would need its own gradient all-reduce.

    An option the stage never reads is a ConfigError when given another value than its
    default: `allgather_bucket_size` at stage 0; `param_persistence_threshold`, `units`
    and `prefetch` below stage 3.
    """
    return make_transform(ShardZero, "shard_zero", args, kwargs)


# the options only some stages read, with their defaults and the stages that read them
_STAGE_OPTIONS = (("allgather_bucket_size", 50_000_000, (1, 2, 3),
                   "stage 0 all-reduces whole gradients and all-gathers nothing"),
                  ("param_persistence_threshold", 0, (3,), "stages 0-2 keep every parameter whole on every rank"),
                  ("units", None, (3,), "stages 0-2 keep every parameter whole, so no unit is ever gathered"),
                  ("prefetch", 1, (3,), "stages 0-2 keep every parameter whole, so no unit is ever gathered"),
                  ("shard_group", None, (1, 2, 3), "stage 0 shards nothing"),
                  ("hpz", None, (3,), "stages 0-2 keep every parameter whole, so no unit is re-gathered in backward"))


def _check_group_spec(key: str, v: Any) -> None:
    if v is None or v == "node":
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"shard_zero({key}={v!r}): give a number of dp ranks (an int >= 1) or 'node' (the dp "
                          "ranks of one node, from the launcher's topology)")


def _weight_wire(stage: int, fmt: Any, block: Any, frozen: bool = False) -> Any:
    """qwZ's wire format (None: exact gathers); ConfigErrors for what cannot be quantized.
    `frozen`: quantize_frozen is given (it reads `quantize_block` too)."""
    if fmt is None:
        if block != 2048 and not frozen:
            raise ConfigError(f"shard_zero(quantize_block={block!r}) sizes quantized weight gathers; pass "
                              "quantize_weights='int8' (or 'fp8_e4m3') too, or drop it")
        return None
    if stage != 3:
        raise ConfigError(f"shard_zero({stage}, quantize_weights={fmt!r}): only stage 3 gathers weights for the "
                          "compute (stages 1-2 gather the updated parameters into the state, which must stay "
                          "exact); use shard_zero(3, quantize_weights=...)")
    return _checked_wire("quantize_weights", fmt, "weights travel as 'int8' (ZeRO++ qwZ) or 'fp8_e4m3'",
                         ("int8", "fp8_e4m3"), "quantize_block", block, block)


def _frozen_wire(stage: int, fmt: Any, block: Any) -> Any:
    """The format frozen weights are held in (None: as they are); ConfigErrors as qwZ's."""
    if fmt is None:
        return None
    if stage != 3:
        raise ConfigError(f"shard_zero({stage}, quantize_frozen={fmt!r}): only stage 3 stores frozen weights as "
                          "shards it gathers for the compute; use shard_zero(3, quantize_frozen=...)")
    return _checked_wire("quantize_frozen", fmt, "frozen weights are held as 'int8' (ZeRO++'s "
                         "zero_quantized_nontrainable_weights) or 'fp8_e4m3'", ("int8", "fp8_e4m3"),
                         "quantize_block", block, block)


def _checked_wire(option: str, fmt: Any, formats_text: str, formats: tuple[str, ...], block_option: str,
                  block: Any, min_numel: int) -> Any:
    """`WireFormat(fmt, block, min_numel)` once `fmt` is one of `formats` (else a ConfigError
    naming `option` and `formats_text`) and `block` suits it (`check_format`)."""
    from dsfn.ops.quantize import check_format
    from dsfn.runtime.quantized import WireFormat
    if fmt not in formats:
        raise ConfigError(f"shard_zero({option}={fmt!r}): {formats_text}")
    check_format(fmt, block, f"shard_zero({option}=..., {block_option}=...)")
    return WireFormat(fmt, block, min_numel)


def _grad_wire(stage: int, fmt: Any, block: Any) -> Any:
    """qgZ's wire format (None: exact reduce-scatters); ConfigErrors for what cannot be quantized."""
    if fmt is None:
        if block != 32:
            raise ConfigError(f"shard_zero(quantize_grads_block={block!r}) sizes quantized gradient reductions; pass "
                              "quantize_grads='int4' (or 'int8') too, or drop it")
        return None
    if stage == 0:
        raise ConfigError("shard_zero(0, quantize_grads=...): stage 0 all-reduces whole gradients, it has no "
                          "reduce-scatter to quantize; use stage 1, 2 or 3")
    return _checked_wire("quantize_grads", fmt, "gradients travel as 'int4' (ZeRO++ qgZ) or 'int8'", ("int4", "int8"),
                         "quantize_grads_block", block, 0)


def _check_groups(stage: int, shard_group: Any, hpz: Any, cross_node: Any, hierarchical: Any) -> None:
    """Hybrid sharding's and hpZ's options (their stages are `_check_stage_options`')."""
    _check_group_spec("shard_group", shard_group)
    _check_group_spec("hpz", hpz)
    if shard_group is not None and hpz is not None:
        raise ConfigError(f"shard_zero({stage}, shard_group={shard_group!r}, hpz={hpz!r}): choose one; hybrid "
                          "sharding already gathers inside its shard group in forward and backward, and hpZ keeps "
                          "flat sharding with a node-local copy for backward only")
    if not isinstance(cross_node, bool):
        raise ConfigError(f"shard_zero(cross_node={cross_node!r}): a bool")
    if cross_node and shard_group is None:
        raise ConfigError("shard_zero(cross_node=True) lets a shard group span nodes, but no shard_group is given: "
                          "add shard_group=k, or drop cross_node")
    if not isinstance(hierarchical, bool):
        raise ConfigError(f"shard_zero(hierarchical_gather={hierarchical!r}): a bool")
    if hierarchical and (stage != 3 or not cross_node):
        raise ConfigError(f"shard_zero({stage}, hierarchical_gather=True) gathers a stage-3 shard group that spans "
                          "nodes in two stages (across nodes, then inside them), but "
                          + ("parameters are gathered only at stage 3: use shard_zero(3, ...)" if stage != 3 else
                             "without cross_node=True no shard group spans nodes: add shard_group=k, "
                             "cross_node=True, or drop hierarchical_gather"))


def _check_stage_options(stage: int, *values: Any) -> None:
    """A ConfigError for an option given a value its stage never reads (it would be accepted and
    do nothing); an option left at its default is not "given"."""
    for (key, default, stages, why), v in zip(_STAGE_OPTIONS, values):
        if stage not in stages and v != default:
            need = f"stage={stages[0]}" if len(stages) == 1 else "stage >= 1"
            raise ConfigError(f"shard_zero({stage}, {key}={v!r}): {key} is read only at {need}, and {why}: "
                              f"drop {key}, or use shard_zero({stages[0]}, ...)")
