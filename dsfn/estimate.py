"""`estimate_memory(model, stack, world_size)`: per-rank bytes of a training state before launching it.

    est = dsfn.estimate_memory(model_on_meta, [shard_zero(3), offload("cpu"), mixed_precision()],
                               world_size=64, tx=dsfn.optim.adamw(3e-4))
    print(est)                       # params / grads / optimizer / master / unit / buckets / host / nvme
    est.deepspeed()                  # DeepSpeed's estimate_zero{2,3}_model_states_mem_needs formulas

The state is placed, not modelled: a meta state of the model (`TrainState.create` of meta
parameters; nothing is allocated) goes through the stack's own `place`
(`dsfn.state.init.place_state`, as `Step.place`) on a virtual mesh of `world_size` ranks
(`Mesh.virtual`: sizes, ranks per node, no process group; meta leaves hold nothing to
broadcast or move). Its leaves' bytes are the state fields, summed as `Step.explain`'s
leaves are (`state_fields`). The transients (gradients, units, buckets, hpZ's secondary
shards, a pipeline's modelled activations) come from the stack's published facts and the
placed leaves' layouts. No transform is looked at but through its `place` and `facts()`.
Every field, and what each assumes: docs/estimate.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from dsfn import tree
from dsfn.errors import ConfigError
from dsfn.estimate_activations import (ACT_VALUES_PER_LAYER, activation_detail, pipeline_activations, pipeline_cut,
                                       pipeline_line, ring_activations)
from dsfn.estimate_activations import human_bytes as _human
from dsfn.estimate_deepspeed import deepspeed_zero2_estimate, deepspeed_zero3_estimate

__all__ = ["ACT_VALUES_PER_LAYER", "MemoryEstimate", "deepspeed_zero2_estimate", "deepspeed_zero3_estimate",
           "estimate_memory", "measured_state_bytes", "state_fields"]


@dataclass
class MemoryEstimate:
    """Per-rank bytes (see docs/estimate.md for each field)."""
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    master: int = 0
    largest_unit: int = 0
    buckets: int = 0
    host: int = 0
    nvme: int = 0
    num_params: int = 0
    largest_layer: int = 0          # elements of the largest unit (DeepSpeed's largest_layer_params)
    world_size: int = 1
    mesh: dict = field(default_factory=dict)
    stage: int = 0
    offload: str | None = None
    offload_params: bool = False
    secondary: int = 0
    shard_group: int | None = None  # hybrid sharding: ranks of a shard group (None: flat over dp)
    hpz: int | None = None          # ZeRO++ hpZ: ranks of a secondary group (None: off)
    activations: int = 0            # pipeline: modelled peak activation bytes of this rank (docs/estimate.md)
    pp_rank: int | None = None      # pipeline: the rank estimated (index along the pipeline axis)
    pipeline_schedule: str | None = None
    pipeline_microbatches: int = 0
    pipeline_stages: tuple[int, ...] = ()          # this rank's stages
    peak_microbatches: float = 0.0  # simulate(schedule).peak_activations[pp_rank]: stage micro-batches held at once
    microbatch_activations: int = 0  # one micro-batch's modelled activations through this rank's stages (all v)
    activation_note: str = ""       # what the activation figure assumed, or why it is 0
    dispatched: int = 0             # expert parallel: the dispatched rows held for backward (docs/estimate.md)
    dispatched_note: str = ""
    ring_in_flight: int = 0         # context parallel: the K/V block received while the rank's own is used
    leaves: list = field(default_factory=list, repr=False)   # the placed meta state's leaf_records (path, layout,
    #                                 local shape, dtype, bytes): what the planner reads the padded sizes off

    @property
    def state(self) -> int:
        """The state on this rank wherever it lives: what `Step.explain` measures."""
        return self.params + self.optimizer + self.master + self.host + self.nvme

    @property
    def device(self) -> int:
        """Peak device bytes of model states: state on the device + grads + largest unit + buckets
        (+ hpZ's secondary shards, all held while backward starts; + a pipeline's modelled
        activations)."""
        return (self.params + self.optimizer + self.master + self.grads + self.largest_unit + self.buckets
                + self.secondary + self.activations + self.dispatched + self.ring_in_flight)

    def deepspeed(self, gpus_per_node: int = 8) -> dict[str, int]:
        """DeepSpeed's published formulas for this model and dp size: {"gpu": per GPU, "cpu":
        per node of `gpus_per_node`} (`estimate_zero2_model_states_mem_needs` for stages <= 2,
        `estimate_zero3_model_states_mem_needs` for 3, whose largest layer is `largest_layer`)."""
        n = self.shard_group or self.mesh.get("dp", self.world_size)     # MiCS: the formulas over its shard group
        per_node = min(gpus_per_node, n)
        nodes = max(n // per_node, 1)
        cpu = self.offload is not None
        if self.stage == 3:
            return deepspeed_zero3_estimate(self.num_params, self.largest_layer, per_node, nodes, cpu_offload=cpu,
                                            cpu_offload_params=self.offload_params)
        return deepspeed_zero2_estimate(self.num_params, per_node, nodes, cpu_offload=cpu)

    def __str__(self) -> str:
        lines = [f"memory estimate per rank ({_count(self.num_params)} params, world {self.world_size}, "
                 f"mesh {self.mesh}, ZeRO {self.stage}{', offload ' + self.offload if self.offload else ''}):"]
        dp = self.mesh.get("dp", self.world_size)
        if self.shard_group is not None:
            lines.append(f"  hybrid sharding: the state is sharded over shard groups of {self.shard_group} of the {dp} "
                         f"dp ranks (1/{self.shard_group} per rank, not 1/{dp}) and replicated "
                         f"{dp // self.shard_group} times")
        if self.pipeline_schedule is not None:
            lines.append(pipeline_line(self))
        if self.hpz is not None:
            lines.append(f"  hpZ: each gathered unit keeps a secondary shard over {self.hpz} ranks (1/{self.hpz} of "
                         "the unit, in the compute dtype) from its forward to its backward: 'secondary'")
        for k in ("params", "grads", "optimizer", "master", "largest_unit", "buckets", "host", "nvme"):
            lines.append(f"  {k:13s} {_human(getattr(self, k))}")
        if self.hpz is not None:
            lines.append(f"  {'secondary':13s} {_human(self.secondary)}   (hpZ, all units' secondary shards after "
                         "forward)")
        if self.pipeline_schedule is not None:
            lines.append(f"  {'activations':13s} {_human(self.activations)}   ({activation_detail(self)})")
        elif self.mesh.get("cp", 1) > 1:
            lines.append(f"  {'activations':13s} {_human(self.activations)}   (modelled; {self.activation_note})")
            lines.append(f"  {'ring block':13s} {_human(self.ring_in_flight)}   (context parallel: one K/V block in "
                         "flight beside the rank's own)")
        if self.dispatched or self.dispatched_note:
            lines.append(f"  {'dispatched':13s} {_human(self.dispatched)}   (expert parallel: {self.dispatched_note})")
        lines.append(f"  {'device peak':13s} {_human(self.device)}   (state on this rank: {_human(self.state)})")
        return "\n".join(lines)

    __repr__ = __str__


def _count(n: int) -> str:
    """A parameter count in the largest unit that keeps a digit before the point: 7.24B, 15.3M, 840."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def _topology(world_size: int, ranks_per_node: int | None, zero: Any) -> Any:
    """The virtual mesh's topology: `ranks_per_node`'s, else the launcher's when it launched
    `world_size` ranks, else one node (a ConfigError where a "node" shard group needs it)."""
    from dsfn.runtime.topology import Topology, topology
    if ranks_per_node is not None:
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1 \
                or world_size % ranks_per_node:
            raise ConfigError(f"estimate_memory(ranks_per_node={ranks_per_node!r}): a divisor of world_size "
                              f"{world_size}")
        return Topology(world_size // ranks_per_node, ranks_per_node, "estimate_memory(ranks_per_node=...)")
    topo = topology()
    if topo.world == world_size:
        return topo
    stage = zero.get("zero_stage", 0)
    for key, who in (("zero_shard_group", "shard_group"), ("zero_hpz", "hpz")):
        if stage >= 1 and zero.get(key) == "node":
            raise ConfigError(f"estimate_memory: shard_zero({stage}, {who}='node') needs the ranks per node of a "
                              f"{world_size}-rank job, and this process was launched as {topo.describe()}; pass "
                              "ranks_per_node=")
    return Topology(1, world_size, "one node (estimate_memory: no ranks_per_node given)")


def _params_of(model: Any) -> tuple[dict[str, tuple[int, ...]], nn.Module | None, torch.dtype]:
    if isinstance(model, nn.Module):
        seen, shapes, dtype = set(), {}, torch.float32
        for n, p in model.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                shapes[n] = tuple(p.shape)
                dtype = p.dtype
        return shapes, model, dtype
    if isinstance(model, int) and not isinstance(model, bool) and model > 0:
        return {"params": (model,)}, None, torch.float32
    if isinstance(model, dict) and model:       # {name: shape or tensor}
        shapes = {n: tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v) for n, v in model.items()}
        first = next(iter(model.values()))
        return shapes, None, first.dtype if isinstance(first, torch.Tensor) else torch.float32
    raise ConfigError(f"estimate_memory(model={type(model).__name__}): pass an nn.Module (the meta device is "
                      "enough), a dict {name: shape} or a parameter count (an int > 0)")


_META_STATES: dict[tuple, tuple[Any, Any]] = {}


def _placed_meta(stack: tuple, facts: Any, shapes: dict, dtype: torch.dtype, tx: Any) -> Any:
    """The meta state of `shapes` placed by `stack` on the current (virtual) mesh. The unplaced
    meta state is remembered per (tx, shapes, dtype): a caller estimating many stacks of one
    model with one tx (the planner) builds it once; states are immutable, placing makes new ones."""
    from dsfn.state.init import place_state
    from dsfn.state.train_state import TrainState
    key = (id(tx), tuple(shapes.items()), dtype)
    hit = _META_STATES.get(key)
    if hit is not None and hit[0] is tx:
        state = hit[1]
    else:
        meta = lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x      # noqa: E731
        state = TrainState.create({n: torch.empty(s, dtype=dtype, device="meta") for n, s in shapes.items()}, tx)
        state = state.replace(step=meta(state.step), rng=meta(state.rng), opt_state=tree.map(meta, state.opt_state))
        if len(_META_STATES) > 8:
            _META_STATES.clear()
        _META_STATES[key] = (tx, state)
    return place_state(stack, facts, state)


def estimate_memory(model: nn.Module | dict | int, stack: Sequence[Any] | Any = (), world_size: int = 1, *,
                    tx: Any = None, tp: int | None = None, sp: int | None = None, pp: int | None = None,
                    pp_rank: int | None = None, batch: tuple[int, int] | None = None,
                    dtype: torch.dtype | None = None, ranks_per_node: int | None = None,
                    ep: int | None = None, cp: int | None = None,
                    mesh_order: Sequence[str] | None = None) -> MemoryEstimate:
    """Per-rank bytes of parameters, gradients, optimizer state, master weights, the largest
    gathered unit, buckets, host and NVMe (see docs/estimate.md).

    Args:
        model: an nn.Module (meta device is enough), {name: shape} or a parameter count.
        stack: the transforms (or a Step) the run will use.
        world_size: ranks; dp = world / (tp * sp * pp).
        tx: the optimizer (default: `dsfn.optim.adamw`); its state is made on meta tensors.
        tp, sp, pp: mesh sizes (default: 2 if the stack has tensor_parallel / sequence_parallel /
            pipeline_parallel and world_size allows, else 1 — pass them for any other mesh).
        ep: the expert-parallel size (default: 2 if the stack has expert_parallel and world_size
            allows, else 1); dp = world / (tp * sp * pp * ep).
        cp: the context-parallel size (default: 2 if the stack has context_parallel and world_size
            allows, else 1); dp = world / (tp * sp * pp * ep * cp). With batch=, a context-parallel
            stack's activations per rank are modelled (its tokens: rows / dp x seq / (cp x sp))
            and the ring's K/V block in flight counted.
        pp_rank: with pipeline_parallel, the pipeline rank (index along its axis) to estimate;
            default: the rank with the largest device peak.
        batch: (rows, seq_len) of the step's whole batch, for a pipeline's modelled activations
            (without it they are 0, and the printout says so).
        dtype: the parameters' dtype without mixed precision (default: the model's, else fp32).
        ranks_per_node: the launcher's ranks per node, for `shard_zero(shard_group="node")` /
            `hpz="node"` (default: this job's topology when it has `world_size` ranks).
        mesh_order: the mesh axes outermost first, as the run's `init_mesh` lays them out
            (default: dp, cp, sp, tp, ep, pp); it decides which groups a node holds.
    """
    from dsfn.engines.zero.groups import group_size
    from dsfn.optim import adamw
    from dsfn.runtime.mesh import Mesh, on_virtual_mesh
    from dsfn.state.layout import leaf_records
    from dsfn.transforms.facts import StackFacts
    step_facts = getattr(stack, "facts", None) if hasattr(stack, "fn") else None     # a Step
    stack = tuple(stack.stack) if hasattr(stack, "fn") else tuple(stack or ())
    facts = step_facts if step_facts is not None else StackFacts(stack)
    whole = facts.whole
    shapes, module, model_dtype = _params_of(model)
    tx = tx if tx is not None else adamw(1e-3)
    tp = tp if tp is not None else (2 if whole.has_role("tensor_parallel") and world_size % 2 == 0 else 1)
    sp = sp if sp is not None else (2 if whole.has_role("sequence_parallel") and world_size % (2 * tp) == 0 else 1)
    pipe = next(iter(whole.with_role("pipeline")), None)
    pp = pp if pp is not None else (2 if pipe is not None and world_size % (2 * tp * sp) == 0 else 1)
    # expert parallel: an axis of its own that carries data (dsfn.transforms.expert_parallel)
    ep = ep if ep is not None else (2 if whole.has_role("expert_parallel") and world_size % (2 * tp * sp * pp) == 0
                                    else 1)
    cp = cp if cp is not None else (2 if whole.has_role("context_parallel")
                                    and world_size % (2 * tp * sp * pp * ep) == 0 else 1)
    if world_size % (tp * sp * pp * ep * cp):
        raise ConfigError(f"estimate_memory: world_size {world_size} is not divisible by tp {tp} x sp {sp}"
                          + (f" x pp {pp}" if pp > 1 else "") + (f" x ep {ep}" if ep > 1 else "")
                          + (f" x cp {cp}" if cp > 1 else ""))
    if pipe is not None and pp_rank is None:
        # the rank whose stages weigh the most (a pipeline's ranks differ: embeddings, head)
        ranks = [estimate_memory(model, stack, world_size, tx=tx, tp=tp, sp=sp, pp=pp, pp_rank=r, batch=batch, ep=ep,
                                 dtype=dtype, ranks_per_node=ranks_per_node, cp=cp, mesh_order=mesh_order)
                 for r in range(pp)]
        return max(ranks, key=lambda e: (e.device, -e.pp_rank))
    dp = world_size // (tp * sp * pp * ep * cp)
    zero = next(iter(whole.with_role("zero")), {})
    stage, dp_axis = zero.get("zero_stage", 0), whole.first("dp_axis", "dp")
    cut = pipeline_cut(pipe, module, list(shapes), pp, pp_rank) if pipe is not None else None
    sizes = {"dp": dp, **({"cp": cp} if cp > 1 else {}), "sp": sp, "tp": tp, **({"ep": ep} if ep > 1 else {}),
             **({"pp": pp} if pp > 1 else {})}     # dp outermost
    sizes = {**sizes, "pp": pp}
    if mesh_order is not None:
        order = [k for k in mesh_order if k in sizes]
        missing = [k for k, v in sizes.items() if v > 1 and k not in order]
        if missing or len(set(order)) != len(order):
            raise ConfigError(f"estimate_memory(mesh_order={tuple(mesh_order)}): name each mesh axis of size > 1 "
                              f"once (missing: {missing})")
        sizes = {**{k: sizes[k] for k in order}, **{k: v for k, v in sizes.items() if k not in order}}
    mesh = Mesh.virtual(sizes, {"pp": pp_rank or 0}, _topology(world_size, ranks_per_node, zero))
    with on_virtual_mesh(mesh):
        state = _placed_meta(stack, facts, shapes, dtype or model_dtype, tx)
        hpz = group_size(mesh, dp_axis, zero["zero_hpz"], False, f"shard_zero(3, hpz={zero['zero_hpz']!r})") \
            if stage >= 1 and zero.get("zero_hpz") is not None else None
    replicas = whole.has_role("data_parallel")
    hybrid = mesh.splits.get(dp_axis) if stage >= 1 else None      # the shard group ZeRO's place split dp into
    n_shard = hybrid or (dp if replicas else 1)
    est = MemoryEstimate(num_params=sum(math.prod(s) for s in shapes.values()), world_size=world_size,
                         mesh={"dp": dp, "tp": tp, "sp": sp, **({"ep": ep} if ep > 1 else {}),
                               **({"pp": pp} if pp > 1 else {}), **({"cp": cp} if cp > 1 else {})}, stage=stage,
                         offload=whole.first("offload"), offload_params=bool(whole.first("offload_params", False)),
                         shard_group=hybrid, hpz=None if hpz == dp else hpz)
    est.leaves = list(leaf_records(state))
    for k, v in state_fields(est.leaves).items():
        setattr(est, k, v)
    pb = _transients(est, state, whole, zero, stage, n_shard, replicas, module, shapes, tp)
    if cut is not None:
        pipeline_activations(est, cut, pipe, next(iter(whole.with_role("remat")), None), pp_rank, batch,
                             dp if replicas else 1, tp, sp, pb)
    _dispatched(est, next(iter(whole.with_role("expert_parallel")), None), batch, dp if replicas else 1, ep, sp,
                pb, pipe, whole)
    if cp > 1 and cut is None:
        ring_activations(est, module, batch, dp if replicas else 1, tp, sp, cp, pb)
    return est


def _dispatched(est, facts, batch, dp, ep, sp, pb, pipe, whole) -> None:
    """Expert parallel's dispatched rows into `est`: per MoE layer a rank sends S = T x k rows
    (T its tokens) and receives R of them, S = R under even routing (the mean over the ranks);
    it holds the sent rows, the received ones and the experts' outputs for backward: 3 S x H
    x `pb` bytes per layer (what `explain` measures per layer, there with the real R)."""
    if facts is None or ep == 1:
        return
    if batch is None or facts.get("ep_top_k") is None or pipe is not None or whole.has_role("accumulate"):
        est.dispatched_note = ("needs batch=(rows, seq)" if batch is None else
                               "the model's top-k is not known" if facts.get("ep_top_k") is None else
                               "per micro-batch under a pipeline / accumulate: not modelled")
        return
    rows, seq = batch
    tokens = rows * seq / (dp * ep * sp)
    s = tokens * facts["ep_top_k"]
    est.dispatched = int(facts["ep_moe_layers"] * 3 * s * facts["ep_hidden"] * pb)
    est.dispatched_note = (f"{facts['ep_moe_layers']} MoE layers x 3 x {s:g} rows (tokens x k, even routing) x "
                           f"hidden {facts['ep_hidden']} x {pb} B")


def _transients(est, state, whole, zero, stage, n_shard, replicas, module, shapes, tp) -> int:
    """The transients into `est`, per parameter leaf: the elements ZeRO cut it from (this rank's tp / stage
    piece; 0 for another stage's), and its shard's elements when ZeRO shards it. Returns the compute bytes."""
    from dsfn.engines.zero.shards import zero_layout
    from dsfn.state.layout import Placed, is_placed
    from dsfn.units import unit_sizes
    leaves = tree.leaves(state.params, is_leaf=is_placed)
    pieces = [x.data if isinstance(x, Placed) else x for x in leaves]
    pb = pieces[0].element_size() if pieces else 4          # the compute dtype's
    zeros = [zero_layout(x.layout) if isinstance(x, Placed) else None for x in leaves]
    cut_from = [math.prod(z.shape) if z is not None else t.numel() for z, t in zip(zeros, pieces)]
    shards = [t.numel() if z is not None else 0 for z, t in zip(zeros, pieces)]
    shard = lambda k: math.ceil(k / n_shard)        # noqa: E731
    total = sum(cut_from)
    est.grads = sum((shard(k) if stage >= 2 else k) * pb for k in cut_from)
    if stage == 3 and module is not None:
        largest, root = unit_sizes(module, zero.get("zero_units"), set(shapes))     # ZeRO-3's units
        scale = (lambda k: math.ceil(k / tp)) if whole.has_role("tensor_parallel") and tp > 1 else (lambda k: k)
        est.largest_unit, est.largest_layer = (scale(largest) + scale(root)) * pb, largest
    if est.hpz is not None:         # every sharded tensor is gathered padded to N, and 1/hpz of it kept
        est.secondary = sum(s * n_shard // est.hpz * pb for s in shards)
    if replicas:
        rb = zero.get("reduce_bucket_size") or whole.first("dp_bucket_bytes", 25 * 2**20) // pb
        est.buckets = min(rb, total) * pb
        if stage in (1, 2):
            est.buckets += min(zero["allgather_bucket_size"], total) * pb
    return pb


def state_fields(leaves: Any) -> dict[str, int]:
    """State leaves — (path, layout, local shape, dtype, bytes), `dsfn.state.layout.leaf_records`
    of a state, real or placed on meta — summed as `MemoryEstimate` fields: params, optimizer,
    master (on the device), host and nvme (offloaded leaves of any kind)."""
    out = {"params": 0, "optimizer": 0, "master": 0, "host": 0, "nvme": 0}
    for path, layout, _shape, _dtype, nbytes in leaves:
        kind = type(layout).__name__
        if "Offloaded" in kind:
            out["nvme" if "Nvme" in kind else "host"] += nbytes
        elif path.startswith("params."):
            out["params"] += nbytes
        elif path.startswith("opt_state.master."):
            out["master"] += nbytes
        elif path.startswith("opt_state."):
            out["optimizer"] += nbytes
    return out


def measured_state_bytes(explanation: Any) -> dict[str, int]:
    """`Step.explain`'s leaves summed as `MemoryEstimate` fields (`state_fields`)."""
    return state_fields(explanation.leaves)
