"""A candidate's predicted memory, step time and communication (`predict(layout, ...)`).

**Memory** is `estimate_memory` of the layout's own stack (a meta state placed on a virtual
mesh of the layout, `mesh_order` as `init_mesh` lays it), plus the activations the planner
models (`ModelFacts.act_bytes_per_token`, counted on the meta model):

    T   = micro_batch x seq / (sp x cp)                  tokens of a micro-batch on a rank
    A   = (replicated + split / tp) x T                  one layer's kept bytes
    act = layers_on_rank x A x in_flight                 (remat: the layer inputs h x T each, + one A)
        + root x T / tp                                  (embeddings, logits, loss)

`in_flight` is 1 without a pipeline (micro-batches run one after another) and the pipeline
simulator's peak stage micro-batches held at once (`simulate(schedule).peak_activations`).
The peak (`_peak`) is the state plus the larger of two moments: the end of a forward (the
activations, under accumulation the gradient sum so far, Ulysses' all-to-all copies of one
layer) and the end of a backward (the gradients, the reduce bucket in flight or under remat
the recomputed layer, under accumulation this micro-batch's gradients beside the sum, under
ZeRO-3 a unit's gradient and the next unit's prefetch). Each term was found against the
measured candidates of `benchmarks/plan.py` and is named in `_peak`.

**Compute**: the model's FLOPs (`ModelFacts.train_flops_per_token`; remat adds one forward
of the layers) over a rank's tokens, divided by tp (and pp: a rank runs its stage), at
`cluster.flops x cluster.efficiency`, plus `cluster.layer_overhead` seconds per layer and
micro-batch (the framework's per-layer cost, which dominates a tiny model on CPU).

**Communication**: the collectives a rank (rank 0 of the mesh) issues in one step, counted
as the runtime counts them (`Step.explain`: all_gather the gathered output, reduce_scatter
the input, all_reduce and all_to_all the tensor, send what is sent), with their bytes per
link (`dsfn.runtime.links`) and seconds (`dsfn.comm_model.collective`). The sizes come off
the placed meta state: every tensor flattened and padded to a multiple of its shard group
(`MemoryEstimate.leaves`). What overlaps: ZeRO's gathers (prefetched) and reduce-scatters,
data parallel's bucket all-reduces, HSDP's cross-replica all-reduce and the ring's K/V
sends are asynchronous in the runtime, hidden behind compute up to `cluster.overlap`; tp's
and Ulysses' collectives, expert all-to-alls, pipeline sends and the metrics are waited on
where they are issued: exposed.

**Pipeline**: `simulate` of the schedule with each micro-batch's stage forward and backward
times; the step is its makespan, and the bubble is makespan - the busy time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dsfn.comm_model import Cluster, collective
from dsfn.errors import ConfigError
from dsfn.planner.layout import MESH_ORDER, Layout
from dsfn.planner.model import ModelFacts

__all__ = ["CommItem", "Prediction", "estimate", "mesh_group", "predict", "state_key"]

ASYNC = {("dp", "all_gather"), ("dp", "reduce_scatter"), ("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter"),
         ("dp_replicate", "all_reduce"), ("dp", "grad_all_reduce"), ("cp", "send")}
"""(axis, op) the runtime issues asynchronously (module docstring)."""


@dataclass
class CommItem:
    axis: str
    op: str
    calls: int
    nbytes: int
    intra: float
    inter: float
    seconds: float
    overlapped: bool


@dataclass
class Prediction:
    """One candidate's predictions. Seconds per step; bytes per rank."""

    layout: Layout
    memory: Any                       # MemoryEstimate of the layout's stack
    activations: int
    compute_s: float
    comm: list[CommItem] = field(default_factory=list)
    exposed_s: float = 0.0
    bubble_s: float = 0.0
    optimizer_s: float = 0.0
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0

    reduce_bucket: int = 0            # bytes of the gradient bucket in flight at the end of backward
    peak: int = 0
    """Predicted device bytes at the step's peak (the largest rank's): the state on the device,
    plus the larger of the end of forward (activations, the gathered unit, hpZ's secondary
    shards, and under accumulation or a pipeline the gradients summed so far) and the end of
    backward (the gradients and the reduce bucket in flight, the unit): activations are freed
    as gradients are made."""

    def links(self) -> dict[tuple[str, str], tuple[float, float]]:
        """{(axis, op): (intra bytes per rank, inter bytes per node)}: `Explanation.links`' shape."""
        out: dict[tuple[str, str], tuple[float, float]] = {}
        for c in self.comm:
            a, b = out.get((c.axis, c.op), (0.0, 0.0))
            out[c.axis, c.op] = (a + c.intra, b + c.inter)
        return out

    def exposed_by_link(self) -> dict[str, float]:
        """Exposed communication seconds by link ("intra", "inter"), split in proportion to bytes."""
        out = {"intra": 0.0, "inter": 0.0}
        total = sum(c.seconds for c in self.comm) or 1.0
        for c in self.comm:
            share = c.seconds / total * self.exposed_s
            b = (c.intra + c.inter) or 1.0
            out["intra"] += share * c.intra / b
            out["inter"] += share * c.inter / b
        return out


def mesh_group(layout: Layout, axis: str, rank: int = 0) -> list[int]:
    """Global ranks of `rank`'s group along `axis` of the layout's mesh (MESH_ORDER, row-major)."""
    stride = math.prod(getattr(layout, a) for a in MESH_ORDER[MESH_ORDER.index(axis) + 1:])
    base = rank - (rank // stride) % getattr(layout, axis) * stride
    return [base + i * stride for i in range(getattr(layout, axis))]


def _param_pieces(est: Any, layout: Layout) -> list[int]:
    """Elements of each parameter on this rank after tp / ep / pp (before ZeRO), in order."""
    cached = getattr(est, "_pieces", None)
    if cached is not None:
        return cached
    from dsfn.engines.zero.shards import zero_layout
    pieces = []
    for path, lay, shape, dtype, nbytes in est.leaves:
        if not path.startswith("params."):
            continue
        z = zero_layout(lay)
        pieces.append(math.prod(z.shape) if z is not None else math.prod(shape))
    est._pieces = pieces
    return pieces


_UNITS: dict[int, tuple[Any, int]] = {}


def _unit_count(module: Any) -> int:
    """ZeRO-3's units of `module` (`dsfn.units.find_units`) + its root unit, counted once per module."""
    hit = _UNITS.get(id(module))
    if hit is None or hit[0] is not module:
        from dsfn.units import find_units
        hit = _UNITS[id(module)] = (module, len(find_units(module, None)) + 1)
    return hit[1]


def state_key(lay: Layout) -> tuple:
    """What a layout's placed state depends on: its estimate is shared by the layouts that
    differ only in micro-batches and remat."""
    return (lay.dp, lay.tp, lay.pp, lay.sp, lay.cp, lay.ep, lay.zero, lay.shard, lay.schedule, lay.virtual,
            lay.offload, lay.bf16)


_ESTIMATES: dict[tuple, Any] = {}
_TX = None


def _planner_tx() -> Any:
    """The optimizer the planner estimates with: AdamW (two fp32 moments; its lr does not matter)."""
    global _TX
    if _TX is None:
        from dsfn.optim import adamw
        _TX = adamw(1e-3)
    return _TX


def estimate(layout: Layout, module: Any, cluster: Cluster, pp_rank: int | None = None) -> Any:
    """`estimate_memory` of the layout's stack on its mesh (a pipeline: its largest rank, or
    `pp_rank`), remembered per (module, ranks per node, `state_key`, pp_rank)."""
    from dsfn.estimate import estimate_memory
    key = (id(module), cluster.gpus_per_node, state_key(layout), pp_rank)
    hit = _ESTIMATES.get(key)
    if hit is not None and hit[0] is module:
        return hit[1]
    if len(_ESTIMATES) > 4096:
        _ESTIMATES.clear()
    est = estimate_memory(module, layout.stack(module), layout.world, tp=layout.tp, sp=layout.sp, pp=layout.pp,
                               ep=layout.ep, cp=layout.cp, ranks_per_node=cluster.gpus_per_node,
                               mesh_order=MESH_ORDER, pp_rank=pp_rank, tx=_planner_tx())
    _ESTIMATES[key] = (module, est)
    return est


def _layer_bytes(layout: Layout, facts: ModelFacts, seq: int, elem: int) -> float:
    """One layer's kept activation bytes for one micro-batch on a rank."""
    rep, split, _ = facts.act_bytes_per_token(seq, elem)
    return (rep + split / layout.tp) * layout.micro_batch * seq / (layout.sp * layout.cp)


def _activations(layout: Layout, facts: ModelFacts, seq: int, elem: int, in_flight: float, layers: int,
                 last: bool) -> float:
    """A rank's modelled activation bytes (module docstring): `layers` of its stages, `in_flight`
    stage micro-batches held at once, the root's (logits, loss) on the rank holding the head."""
    tokens_mb = layout.micro_batch * seq / (layout.sp * layout.cp)
    root = facts.act_bytes_per_token(seq, elem)[2]
    one_layer = _layer_bytes(layout, facts, seq, elem)
    kept = (facts.hidden * elem * tokens_mb) if layout.remat else one_layer
    return layers * kept * in_flight + (one_layer if layout.remat else 0.0) + (root * tokens_mb if last else 0.0)


def _peak(layout: Layout, e: Any, activations: float, reduce_bucket: int, whole_grads: int,
          a2a: float = 0.0, layer: float = 0.0) -> int:
    """Device bytes at the step's peak (`Prediction.peak`). `whole_grads`: the rank's gradients
    unsharded, what accumulation sums micro-batch after micro-batch (measured: also at ZeRO 2/3).
    `a2a`: Ulysses' all-to-all bytes of one layer's q, k, v and output (`_a2a_bytes`); `layer`:
    one layer's kept activations (under remat, what the last layers' recompute holds while
    the gradients are nearly whole)."""
    held = e.params + e.optimizer + e.master
    transient = e.largest_unit + e.secondary + e.dispatched + e.ring_in_flight
    summed = max(e.grads, whole_grads) if layout.accum > 1 else 0      # the micro-batches' sum so far
    forward = activations + summed
    backward = e.grads + max(reduce_bucket, (layer + 3 * a2a) if layout.remat else 0.0) \
        + (whole_grads if layout.accum > 1 else 0)    # + this micro-batch's own
    if layout.zero == 3:
        # a unit's backward holds its gathered weights and its whole gradient, and (flat, HSDP:
        # gathered again) the next unit's prefetch; hpZ rebuilds units from the secondary it holds
        backward += (1 if layout.shard == "hpz" else 2) * e.largest_unit
    # Ulysses: a layer's backward holds the gradients of q, k, v and the output on both sides of
    # its all-to-alls, at the peak of the activations (measured: ~3 x one layout's bytes)
    forward += 3 * a2a
    return int(held + transient + max(forward, backward))


def _a2a_bytes(layout: Layout, facts: ModelFacts, seq: int, elem: int) -> float:
    """Bytes of one layer's q, k, v and attention output on a rank in one micro-batch, the
    tensors Ulysses' all-to-alls move (0 without sp; key/value heads replicated up to sp)."""
    if layout.sp == 1:
        return 0.0
    tokens = layout.micro_batch * seq / (layout.sp * layout.cp)
    kv = max(facts.kv_heads, layout.sp)
    return tokens * (2 * facts.heads + 2 * kv) * facts.head_dim * elem / layout.tp


def predict(layout: Layout, facts: ModelFacts, cluster: Cluster, global_batch: int, seq: int, *,
            module: Any = None) -> Prediction:
    """The candidate's predictions (module docstring); `module`: the meta model (default
    `facts.meta_module()`). A pipeline's memory is its largest rank's, each rank estimated."""
    module = module if module is not None else facts.meta_module()
    elem = 2 if layout.bf16 else 4
    sim = sched = None
    if layout.pp > 1:
        sched, sim = _schedule(layout)
    per_rank = []
    # the first, second and last pipeline ranks: the ranks between hold stages like the second's
    for r in sorted({0, min(1, layout.pp - 1), layout.pp - 1}):
        e = estimate(layout, module, cluster, pp_rank=r if layout.pp > 1 else None)
        local = sum(_param_pieces(e, layout))
        bucket = (min(25 * 2**20 // elem, local) if layout.zero == 0 else min(4_000_000, local)) * elem \
            if layout.data > 1 else 0
        if sim is None:
            acts = _activations(layout, facts, seq, elem, 1.0, facts.layers, True)
        else:
            layers = sum(e2 - s2 for s2, e2 in _stage_layers(facts.layers, layout, sched, r))
            acts = _activations(layout, facts, seq, elem, sim.peak_activations[r], layers, r == layout.pp - 1)
        per_rank.append((_peak(layout, e, acts, bucket, local * elem, _a2a_bytes(layout, facts, seq, elem),
                               _layer_bytes(layout, facts, seq, elem)), e, acts, bucket))
    peak, est, acts, bucket = max(per_rank, key=lambda x: x[0])
    est0 = per_rank[0][1]           # rank 0's own state for its collectives
    layers_here = math.ceil(facts.layers / layout.pp)
    rows_per_data = global_batch // layout.data
    # --- compute ---
    tokens_rank = rows_per_data * seq / (layout.sp * layout.cp)        # per step, all micro-batches
    rate = cluster.flops * cluster.efficiency
    fwd = facts.forward_flops_per_token(seq)
    flops_rank = tokens_rank * (3 * fwd + (facts.layer_forward_flops_per_token(seq) if layout.remat else 0.0)) \
        / (layout.tp * layout.pp)
    passes = 4 if layout.remat else 3
    overhead = cluster.layer_overhead * layers_here * layout.accum * passes / 3
    compute = flops_rank / rate + overhead
    pred = Prediction(layout, est, int(acts), compute, peak=peak, reduce_bucket=bucket)
    pred.comm = _comm(layout, facts, cluster, est0, module, seq, elem, sched)
    # --- optimizer step: the state streamed once (read + write) at device (or host) bandwidth
    state_bytes = est.params + est.optimizer + est.master + est.host
    hbm = cluster.hbm
    pred.optimizer_s = 2 * state_bytes / (cluster.host_bandwidth if layout.offload else hbm)
    if layout.offload:          # gradients down, parameters up over PCIe
        pred.optimizer_s += (est.host / 4) * 2 * elem / cluster.pcie
    asyn = sum(c.seconds for c in pred.comm if c.overlapped)
    sync = sum(c.seconds for c in pred.comm if not c.overlapped)
    hidden_budget = compute * cluster.overlap
    pred.exposed_s = sync + max(asyn - hidden_budget, 0.0) if cluster.overlap > 0 else sync + asyn
    if sim is not None:
        t_f = compute / (layout.accum * passes) * (passes - 2)      # F (+ its recompute) of one micro-batch
        t_b = compute / layout.accum - t_f
        pred.bubble_s = _makespan(layout, t_f, t_b) - compute if t_f > 0 else 0.0
    pred.step_s = compute + pred.bubble_s + pred.exposed_s + pred.optimizer_s
    pred.tokens_per_s = global_batch * seq / pred.step_s
    pred.mfu = facts.train_flops_per_token(seq) * global_batch * seq / (pred.step_s * layout.world * cluster.flops)
    return pred


_MAKESPANS: dict[tuple, float] = {}
_SCHEDULES: dict[tuple, Any] = {}


def _schedule(layout: Layout) -> tuple[Any, Any]:
    """(the pipeline's schedule, its unit-time simulation), built once per (name, p, m, v)."""
    from dsfn.engines.pipeline.schedules import build_schedule
    from dsfn.engines.pipeline.simulate import simulate
    key = (layout.schedule, layout.pp, layout.accum, layout.virtual)
    if key not in _SCHEDULES:
        sched = build_schedule(layout.schedule, layout.pp, layout.accum, layout.virtual or 2)
        _SCHEDULES[key] = (sched, simulate(sched))
    return _SCHEDULES[key]


def _makespan(layout: Layout, t_f: float, t_b: float) -> float:
    """The schedule's simulated makespan at stage times t_f, t_b: simulated once per (schedule,
    sizes, t_b / t_f), since a schedule's makespan scales with its stage times."""
    from dsfn.engines.pipeline.schedules import build_schedule
    from dsfn.engines.pipeline.simulate import simulate
    key = (layout.schedule, layout.pp, layout.accum, layout.virtual, round(t_b / t_f, 9))
    if key not in _MAKESPANS:
        sched = build_schedule(layout.schedule, layout.pp, layout.accum, layout.virtual or 2)
        _MAKESPANS[key] = simulate(sched, t_f=1.0, t_b=t_b / t_f).makespan
    return _MAKESPANS[key] * t_f


def _stage_layers(n_layers: int, layout: Layout, sched: Any, rank: int) -> list[tuple[int, int]]:
    """[start, end) layer ranges of `rank`'s stages: the pipeline's even split (`plan_stages`)."""
    from dsfn.engines.pipeline.stages import stage_bounds
    stages = sorted({a.stage for acts in sched for a in acts if a.rank == rank})
    cuts = stage_bounds(n_layers, layout.pp * sched.v)
    return [cuts[s] for s in stages]


def _comm(layout: Layout, facts: ModelFacts, cluster: Cluster, est: Any, module: Any, seq: int,
          elem: int, sched: Any = None) -> list[CommItem]:
    """Rank 0's collectives in one step (module docstring; tests/planner check them call for
    call against `Step.explain`)."""
    out: list[CommItem] = []
    gpn = cluster.gpus_per_node

    def add(axis: str, op: str, calls: int, nbytes: float, ranks: list[int], src: int | None = None,
            timed_calls: int | None = None) -> None:
        """`timed_calls`: the calls the time is paid for where they differ from the counted ones."""
        c = collective(axis, ranks, op, calls if timed_calls is None else timed_calls, nbytes, cluster, 0, src)
        if c is not None:
            out.append(CommItem(axis, op, calls, int(nbytes), c.links.intra, c.links.inter, c.seconds,
                                (axis, op) in ASYNC or (axis == "dp" and op == "all_reduce" and layout.zero == 0)))
    dp = mesh_group(layout, "dp")
    pieces = _param_pieces(est, layout)
    n = layout.dp
    k = sum(1 for r in dp if r // gpn == 0) if layout.shard != "flat" else n      # dp ranks on rank 0's node
    shard_n = k if layout.shard == "hsdp" else n
    padded = sum(-(-p // shard_n) * shard_n for p in pieces)
    local = sum(pieces)
    gloo_tensors = len(pieces) if cluster.backend == "gloo" else 0
    units = 0
    if layout.zero == 3:            # ZeRO-3's units: the model's, or under a pipeline rank 0's stages' layers + a root each
        units = _unit_count(module) if sched is None else \
            sum(e2 - s2 + 1 for s2, e2 in _stage_layers(facts.layers, layout, sched, 0))
    bucket = 4_000_000
    buckets = max(1, math.ceil(local / bucket))
    rows = (layout.micro_batch * layout.accum)
    tokens = rows * seq // (layout.sp * layout.cp)       # per step on a rank
    # ZeRO-3 gathers and reduce-scatters per micro-batch, under accumulate and in a pipeline
    # alike (each pass needs the unit); HSDP's cross-replica all-reduce runs once, at the end
    per_mb = layout.accum if layout.zero == 3 else 1
    if n > 1:
        if layout.zero == 0:
            add("dp", "all_reduce", buckets + 1, local * elem + 8, dp)
        elif layout.zero in (1, 2):
            add("dp", "reduce_scatter", buckets, padded * elem, dp)
            # on gloo the updated parameters are gathered a tensor at a time, in place (counted
            # as one call per bucket: `collectives.all_gather_into_`)
            add("dp", "all_gather", buckets, padded * elem, dp, timed_calls=gloo_tensors or None)
        elif layout.shard == "hsdp":
            shard, rep = dp[:k], dp[::k]
            add("dp_shard", "all_gather", 2 * units * per_mb, 2 * padded * elem * per_mb, shard)
            add("dp_shard", "reduce_scatter", buckets * per_mb, padded * elem * per_mb, shard)
            add("dp_replicate", "all_reduce", buckets, padded // k * elem, rep)
        elif layout.shard == "hpz":
            add("dp", "all_gather", units * per_mb, padded * elem * per_mb, dp)
            add("dp_shard", "all_gather", units * per_mb, padded * elem * per_mb, dp[:k])
            add("dp", "reduce_scatter", buckets * per_mb, padded * elem * per_mb, dp)
        else:
            add("dp", "all_gather", 2 * units * per_mb, 2 * padded * elem * per_mb, dp,
                timed_calls=2 * gloo_tensors * per_mb or None)
            add("dp", "reduce_scatter", buckets * per_mb, padded * elem * per_mb, dp)
        if layout.zero > 0:
            add("dp", "all_reduce", 2 if layout.pp > 1 else 1, 8, dp)
    # the gradients sp / cp sum: ZeRO's shard of them (its shard group's), or all of them
    summed = (padded // shard_n if layout.zero >= 1 and shard_n > 1 else local) if n > 1 else local
    h = facts.hidden
    act = tokens * h * elem
    L = math.ceil(facts.layers / layout.pp)
    if layout.tp > 1:
        tp = mesh_group(layout, "tp")
        # remat re-runs the layer's forward but its last all-reduce (its output is not needed again)
        per_layer = 4 + (1 if layout.remat else 0)
        extra = 2 if layout.pp == 1 else 1
        # per micro-batch (the bytes are the step's: `act` counts all its tokens)
        add("tp", "all_reduce", (per_layer * L + extra) * layout.accum, (per_layer * L + extra) * act, tp)
        vocab = -(-facts.vocab // layout.tp) * layout.tp
        if layout.pp == 1:
            add("tp", "all_gather", layout.accum, tokens * vocab * 4, tp)
    if layout.sp > 1:
        sp = mesh_group(layout, "sp")
        hd = facts.head_dim
        kv = max(facts.kv_heads, layout.sp) if facts.kv_heads < layout.sp else facts.kv_heads
        per = tokens * (2 * facts.heads * hd + 2 * kv * hd) * elem // layout.tp
        passes = 3 if layout.remat else 2
        add("sp", "all_to_all", 4 * passes * L * layout.accum, passes * L * per, sp)
        add("sp", "all_reduce", buckets + 2, summed * elem + 12, sp)
    if layout.cp > 1:
        cp = mesh_group(layout, "cp")
        mb_tokens = tokens // layout.accum
        # K and V of the rank's tokens (its K/V heads); the block's positions (int64, the cp-local
        # sequence) travel with the forward's K/V and backward's first (and a recompute's) K/V
        kv_block = 2 * mb_tokens * (facts.kv_heads // layout.tp) * facts.head_dim * elem
        positions = seq // layout.cp * 8
        # per layer and ring step: F sends K/V once, B three times (K/V, dK/dV); remat's forward once more
        per = L * (layout.cp - 1) * layout.accum
        calls = (4 + layout.remat) * per
        add("cp", "send", calls, calls * kv_block + (2 + layout.remat) * per * positions, [0, cp[1]], src=cp[1])
        add("cp", "all_reduce", buckets + 2, summed * elem + 12, cp)
        if layout.sp > 1:       # 2-D: the ring's positions made whole over cp, Ulysses' over sp, per micro-batch
            add("cp", "all_gather", layout.accum, layout.accum * layout.micro_batch * seq * 8, cp)
            add("sp", "all_gather", layout.accum, layout.accum * seq // layout.cp * 8, mesh_group(layout, "sp"))
    if layout.pp > 1:
        pp = mesh_group(layout, "pp")
        mb_act = layout.micro_batch * seq // (layout.sp * layout.cp) * h * elem
        add("pp", "send", layout.accum, layout.accum * mb_act, [0, pp[1]], src=pp[1])
        if facts.tied:          # the tied embedding's sum over its two stages (ZeRO-3: of its shard)
            tied = facts.vocab * h // layout.tp
            add("pp", "all_reduce", 1, (-(-tied // n) if layout.zero == 3 else tied) * elem, pp)
        add("pp", "broadcast", 1, 4, pp, src=pp[-1])
    return out
