"""`estimate_memory(model, stack, world_size)`: per-rank bytes of a training state before launching it.

    est = dsfn.estimate_memory(model_on_meta, [shard_zero(3), offload("cpu"), mixed_precision()],
                               world_size=64, tx=dsfn.optim.adamw(3e-4))
    print(est)                       # params / grads / optimizer / master / unit / buckets / host / nvme
    est.deepspeed()                  # DeepSpeed's estimate_zero{2,3}_model_states_mem_needs formulas

The model may live on the meta device (nothing is allocated), or be a parameter count
(one flat tensor of that many elements). Per rank, with N = dp size, every tensor taken
separately as dsfn lays it out (tp split first, then ZeRO's flat shard, padded to N):

| field | what |
|---|---|
| `params` | the parameters on the compute device, in the compute dtype (mixed_precision's param_dtype): whole under ZeRO 0-2, a 1/N shard under ZeRO 3 (tensors with <= param_persistence_threshold elements whole) |
| `grads` | the gradients that persist through backward: whole under ZeRO 0/1 (reduced after backward), a 1/N shard under ZeRO 2/3 |
| `optimizer` | `tx.init`'s state on the device (run on meta tensors: exact leaves): the leaves mirroring a parameter are 1/N shards under ZeRO >= 1, scalars whole |
| `master` | mixed precision's fp32 master weights on the device (1/N under ZeRO >= 1) |
| `largest_unit` | ZeRO 3: the most bytes gathered at once (the largest unit — a repeated block — plus the root unit's parameters, which stay gathered through the forward) |
| `buckets` | gradient-reduction buckets (reduce_bucket_size elements, at most the model) and, ZeRO 1/2, the all-gather bucket |
| `host` / `nvme` | what `offload("cpu")` / `offload("nvme")` moves off the device: optimizer state and master weights, and ZeRO 3's parameter shards with `params=True` |
| `secondary` | ZeRO++ hpZ (`shard_zero(3, hpz=k)`): every gathered unit's secondary shard, 1/k of the unit as gathered (each tensor padded to N) in the compute dtype, all held at once from the end of forward until backward re-gathers each unit |

Pipeline parallel (`pipeline_parallel(schedule, microbatches, model=...)` in the stack, pp =
the "pp" axis' size): the model is cut as the transform cuts it (`plan_stages` over p*v
stages: even, the first stages one layer more, or `split=`; embeddings on the first stage,
final norm and head on the last, a tied embedding on both) and placed as the schedule
places the stages (stage -> rank). On pipeline rank r every field above counts only the
parameters of r's stages — the whole tensor (`StageOwned`), a tied one on both its ranks —
then ZeRO over dp as above (ZeRO-1 outside: the optimizer state 1/N). `pp_rank=` picks the
rank; by default the estimate is the rank with the largest device peak (`pp_rank` says which).

| field | what |
|---|---|
| `activations` | **modelled, not measured**: the most activation bytes this rank holds at once under the schedule — the schedule's own order walked (a forward adds its stage's micro-batch, its backward (B or BW) frees it), so the peak in micro-batches is `simulate(schedule).peak_activations[r]` (1F1B: p - r; GPipe: m; interleaved, ZBV: the simulator's). One micro-batch of one stage is an activation model, not a trace: 34·b·s·h bytes per layer at 16 bits (Korthikanti et al. 2022, "Reducing Activation Recomputation", Table 2 without parallelism: attention, MLP, norms, dropout masks; the attention scores not stored, as under flash / SDPA attention), i.e. `ACT_VALUES_PER_LAYER` = 17 values per token per hidden unit in the compute dtype, 1/(tp·sp) of it per rank under tensor / sequence parallel; plus the embedding output (b·s·h values) on the first stage and the logits (b·s·V values) on the last. b·s is one micro-batch's tokens on this rank (`batch=(rows, seq_len)` of the step's whole batch, split over dp when a dp transform is in the stack, then into `microbatches`), h the model config's hidden size, V its vocabulary. A layer recomputed in backward (`remat()` in the stack — its default modules, or patterns naming whole layers, policy "nothing" — or the model's own gradient checkpointing) holds its input only: b·s·h values (1/sp; 1/tp more with `partition_activations`; none on the device with `offload="cpu"`), and a backward of its stage adds one layer's whole 17·b·s·h/(tp·sp) rematerialised at a time (Korthikanti et al.'s full recomputation); other remat policies and sublayer patterns are counted as without remat (an upper bound, said in the note). ZBV's weight-gradient leftovers between B and W and the p2p buffers are not modelled |

Hybrid sharding (`shard_zero(stage, shard_group=k)`, HSDP / MiCS) shards over the k ranks of a
shard group instead of all N: every "1/N" above is then 1/k (the state is replicated N/k
times). k comes from `dsfn.engines.shard_groups.group_size`, checked as ZeRO checks it, on
the launcher's topology (or `ranks_per_node=`, which "node" needs when estimating another
world than the running one).

`params + optimizer + master + host + nvme` is the state `Step.explain` measures on a rank
(its leaves); `explain()` shows this estimate beside it (on a pipeline, for this rank's
stages). Gradients, units, buckets and activations are transient (not state) and are
estimated only; activations are a model (above).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from dsfn import tree
from dsfn.errors import ConfigError

__all__ = ["ACT_VALUES_PER_LAYER", "MemoryEstimate", "deepspeed_zero2_estimate", "deepspeed_zero3_estimate",
           "estimate_memory", "measured_state_bytes"]

_GiB = 2**30

ACT_VALUES_PER_LAYER = 17
"""Activation values kept per token per hidden unit by one transformer layer for its backward:
Korthikanti et al. 2022's 34·s·b·h bytes at 16 bits (no recomputation, no parallelism,
attention scores not stored). A model, not a measurement."""


@dataclass
class MemoryEstimate:
    """Per-rank bytes (see the module docstring for each field)."""
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
    activations: int = 0            # pipeline: modelled peak activation bytes of this rank (module docstring)
    pp_rank: int | None = None      # pipeline: the rank estimated (index along the pipeline axis)
    pipeline_schedule: str | None = None
    pipeline_microbatches: int = 0
    pipeline_stages: tuple[int, ...] = ()          # this rank's stages
    peak_microbatches: float = 0.0  # simulate(schedule).peak_activations[pp_rank]: stage micro-batches held at once
    microbatch_activations: int = 0  # one micro-batch's modelled activations through this rank's stages (all v)
    activation_note: str = ""       # what the activation figure assumed, or why it is 0

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
                + self.secondary + self.activations)

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
        g = _human
        lines = [f"memory estimate per rank ({_count(self.num_params)} params, world {self.world_size}, "
                 f"mesh {self.mesh}, ZeRO {self.stage}{', offload ' + self.offload if self.offload else ''}):"]
        dp = self.mesh.get("dp", self.world_size)
        if self.shard_group is not None:
            lines.append(f"  hybrid sharding: the state is sharded over shard groups of {self.shard_group} of the {dp} "
                         f"dp ranks (1/{self.shard_group} per rank, not 1/{dp}) and replicated "
                         f"{dp // self.shard_group} times")
        if self.pipeline_schedule is not None:
            lines.append(_pipeline_line(self))
        if self.hpz is not None:
            lines.append(f"  hpZ: each gathered unit keeps a secondary shard over {self.hpz} ranks (1/{self.hpz} of "
                         "the unit, in the compute dtype) from its forward to its backward: 'secondary'")
        for k in ("params", "grads", "optimizer", "master", "largest_unit", "buckets", "host", "nvme"):
            lines.append(f"  {k:13s} {g(getattr(self, k))}")
        if self.hpz is not None:
            lines.append(f"  {'secondary':13s} {g(self.secondary)}   (hpZ, all units' secondary shards after forward)")
        if self.pipeline_schedule is not None:
            lines.append(f"  {'activations':13s} {g(self.activations)}   ({_activation_detail(self)})")
        lines.append(f"  {'device peak':13s} {g(self.device)}   (state on this rank: {g(self.state)})")
        return "\n".join(lines)

    __repr__ = __str__


def _pipeline_line(est: "MemoryEstimate") -> str:
    many = len(est.pipeline_stages) > 1
    stages = ", ".join(str(k) for k in est.pipeline_stages)
    return (f"  pipeline: schedule {est.pipeline_schedule!r}, {est.pipeline_microbatches} micro-batches, pp "
            f"{est.mesh.get('pp', 1)}; pipeline rank {est.pp_rank} holds stage{'s' if many else ''} {stages} "
            f"(the fields count {'their' if many else 'its'} parameters only); peak {est.peak_microbatches:g} "
            f"micro-batch{'' if est.peak_microbatches == 1 else 'es'} of activations held at once under "
            f"{est.pipeline_schedule!r}")


def _activation_detail(est: "MemoryEstimate") -> str:
    if not est.microbatch_activations:
        return f"modelled; {est.activation_note}"
    return (f"modelled: peak {est.peak_microbatches:g} micro-batch{'' if est.peak_microbatches == 1 else 'es'} under "
            f"{est.pipeline_schedule!r} x {_human(est.microbatch_activations).strip()} per micro-batch through this "
            f"rank's stages; {est.activation_note}")


def _count(n: int) -> str:
    """A parameter count in the largest unit that keeps a digit before the point: 7.24B, 15.3M, 840."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def _human(b: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= size:
            return f"{b / size:9.3f} {unit}"
    return f"{b:9.0f} B  "


def deepspeed_zero2_estimate(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                             cpu_offload: bool = False, additional_buffer_factor: float = 1.5) -> dict[str, int]:
    """DeepSpeed's `estimate_zero2_model_states_mem_needs` (runtime/zero/stage_1_and_2.py, 0.19.8):
    {"gpu": bytes per GPU, "cpu": bytes per node}. Without offload 2Ψ + 18Ψ/N per GPU (16-bit
    params, then 16-bit and fp32 grads, fp32 params and Adam's two moments, sharded); with
    CPU offload 2Ψ per GPU and Ψ·max(4N, 16)·1.5 per node."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / total_gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return {"gpu": int(gpu), "cpu": int(cpu)}


def deepspeed_zero3_estimate(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                             num_nodes: int = 1, cpu_offload: bool = False, cpu_offload_params: bool = False,
                             zero_init: bool = True, additional_buffer_factor: float = 1.5) -> dict[str, int]:
    """DeepSpeed's `estimate_zero3_model_states_mem_needs` (runtime/zero/stage3.py, 0.19.8):
    {"gpu": bytes per GPU, "cpu": bytes per node}; 4 bytes per element of the largest layer
    on the GPU, plus 18Ψ/N (no offload) or 2Ψ/N (optimizer offload) or nothing (both offloaded)."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu = largest
            cpu = total_params * (18 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 18 * gpus_factor))
        else:
            gpu = largest + int(2 * total_params / total_gpus)
            cpu = total_params * (16 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 16 * gpus_factor))
        cpu *= additional_buffer_factor
    else:
        gpu = largest + int(18 * total_params / total_gpus)
        cpu = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node * additional_buffer_factor
    return {"gpu": int(gpu), "cpu": int(cpu)}


class _Mesh:
    """Just enough of a Mesh for `Layout.local_shape` and `shard_groups.group_size`: axis
    sizes (row-major in the given order, as `Mesh` lays them out), a topology, no process group."""

    def __init__(self, sizes: dict[str, int], topology: Any = None):
        self.sizes, self.topology = sizes, topology

    def size(self, axis: str) -> int:
        return self.sizes.get(axis, 1)

    def axis_groups(self, axis: str) -> list[list[int]]:
        names = list(self.sizes)
        stride = math.prod(self.sizes[a] for a in names[names.index(axis) + 1:])
        n, world = self.sizes[axis], math.prod(self.sizes.values())
        starts = [r for r in range(world) if (r // stride) % n == 0]
        return [[r + i * stride for i in range(n)] for r in starts]


def _group(spec: Any, cross_node: bool, sizes: dict[str, int], world_size: int, ranks_per_node: int | None,
           who: str) -> int | None:
    """Ranks of a hybrid shard group (or hpZ secondary group) `spec` ("node" or k) on a mesh of
    `sizes`: ZeRO's own `group_size` on the topology of `ranks_per_node`, else the launcher's
    when it launched `world_size` ranks. None for no group (spec None) or one that is the whole
    dp axis (flat sharding)."""
    if spec is None:
        return None
    from dsfn.engines.shard_groups import group_size      # ZeRO's check and arithmetic
    from dsfn.runtime.topology import Topology, topology
    if ranks_per_node is not None:
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1 \
                or world_size % ranks_per_node:
            raise ConfigError(f"estimate_memory(ranks_per_node={ranks_per_node!r}): a divisor of world_size "
                              f"{world_size}")
        topo = Topology(world_size // ranks_per_node, ranks_per_node, "estimate_memory(ranks_per_node=...)")
    else:
        topo = topology()
        if topo.world != world_size:
            if spec == "node":
                raise ConfigError(f"estimate_memory: {who} needs the ranks per node of a {world_size}-rank job, and "
                                  f"this process was launched as {topo.describe()}; pass ranks_per_node=")
            topo = Topology(1, world_size, "one node (estimate_memory: no ranks_per_node given)")
    k = group_size(_Mesh(sizes, topo), "dp", spec, cross_node, who)
    return None if k == sizes["dp"] else k


def _stack_of(stack: Any) -> tuple:
    if hasattr(stack, "stack") and hasattr(stack, "fn"):      # a Step
        return tuple(stack.stack)
    return tuple(stack or ())


def _find(stack: tuple, name: str) -> Any:
    return next((t for t in stack if getattr(t, "name", None) == name), None)


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


def _unit_params(module: nn.Module | None, zero: Any, names: set[str]) -> tuple[int, int]:
    """(elements of the largest unit, elements outside every unit) for ZeRO 3."""
    if module is None:
        return 0, 0
    from dsfn.units import find_units        # the same units as ZeRO-3
    units = find_units(module, getattr(zero, "units", None))
    inside, largest = set(), 0
    for uname, m in units:
        n = 0
        for pname, p in m.named_parameters(prefix=uname):
            if pname in names and pname not in inside:
                inside.add(pname)
                n += p.numel()
        largest = max(largest, n)
    root = sum(p.numel() for n, p in module.named_parameters() if n in names and n not in inside)
    return largest, root


def estimate_memory(model: nn.Module | dict | int, stack: Sequence[Any] | Any = (), world_size: int = 1, *,
                    tx: Any = None, tp: int | None = None, sp: int | None = None, pp: int | None = None,
                    pp_rank: int | None = None, batch: tuple[int, int] | None = None,
                    dtype: torch.dtype | None = None, ranks_per_node: int | None = None) -> MemoryEstimate:
    """Per-rank bytes of parameters, gradients, optimizer state, master weights, the largest
    gathered unit, buckets, host and NVMe (see the module docstring).

    Args:
        model: an nn.Module (meta device is enough), {name: shape} or a parameter count.
        stack: the transforms (or a Step) the run will use.
        world_size: ranks; dp = world / (tp * sp * pp).
        tx: the optimizer (default: `dsfn.optim.adamw`); its state is made on meta tensors.
        tp, sp, pp: mesh sizes (default: 2 if the stack has tensor_parallel / sequence_parallel /
            pipeline_parallel and world_size allows, else 1 — pass them for any other mesh).
        pp_rank: with pipeline_parallel, the pipeline rank (index along its axis) to estimate;
            default: the rank with the largest device peak.
        batch: (rows, seq_len) of the step's whole batch, for a pipeline's modelled activations
            (without it they are 0, and the printout says so).
        dtype: the parameters' dtype without mixed precision (default: the model's, else fp32).
        ranks_per_node: the launcher's ranks per node, for `shard_zero(shard_group="node")` /
            `hpz="node"` (default: this job's topology when it has `world_size` ranks).
    """
    from dsfn.optim import adamw
    stack = _stack_of(stack)
    shapes, module, model_dtype = _params_of(model)
    model_dtype = dtype or model_dtype
    tx = tx if tx is not None else adamw(1e-3)
    tp = tp if tp is not None else (2 if _find(stack, "tensor_parallel") and world_size % 2 == 0 else 1)
    sp = sp if sp is not None else (2 if _find(stack, "sequence_parallel") and world_size % (2 * tp) == 0 else 1)
    pipe = _find(stack, "pipeline_parallel")
    pp = pp if pp is not None else (2 if pipe is not None and world_size % (2 * tp * sp) == 0 else 1)
    if world_size % (tp * sp * pp):
        raise ConfigError(f"estimate_memory: world_size {world_size} is not divisible by tp {tp} x sp {sp}"
                          + (f" x pp {pp}" if pp > 1 else ""))
    if pipe is not None and pp_rank is None:
        # the rank whose stages weigh the most (a pipeline's ranks differ: embeddings, head)
        ranks = [estimate_memory(model, stack, world_size, tx=tx, tp=tp, sp=sp, pp=pp, pp_rank=r, batch=batch,
                                 dtype=dtype, ranks_per_node=ranks_per_node) for r in range(pp)]
        return max(ranks, key=lambda e: (e.device, -e.pp_rank))
    dp = world_size // (tp * sp * pp)
    mesh = _Mesh({"dp": dp, "tp": tp, "sp": sp})
    zero = _find(stack, "shard_zero")
    stage = getattr(zero, "stage", 0) if zero is not None else 0
    n_shard = dp if (zero is not None or _find(stack, "data_parallel") is not None) else 1
    sizes = {"dp": dp, "sp": sp, "tp": tp}          # Mesh's default axis order (dp outermost)
    if pp > 1:
        sizes["pp"] = pp
    hybrid = hpz = None
    if zero is not None and stage >= 1:
        hybrid = _group(getattr(zero, "shard_group", None), bool(getattr(zero, "cross_node", False)), sizes,
                        world_size, ranks_per_node, f"shard_zero({stage}, shard_group={zero.shard_group!r})")
        hpz = _group(getattr(zero, "hpz", None), False, sizes, world_size, ranks_per_node,
                     f"shard_zero(3, hpz={getattr(zero, 'hpz', None)!r})")
    if hybrid is not None:
        n_shard = hybrid            # the state is 1/k of a shard group, replicated across the groups
    mp = _find(stack, "mixed_precision")
    mp_active = mp is not None and mp.param_dtype != mp.master_dtype
    pdtype = mp.param_dtype if mp_active else model_dtype
    master_dtype = mp.master_dtype if mp_active else model_dtype
    off = _find(stack, "offload")
    threshold = getattr(zero, "param_persistence_threshold", 0) if zero is not None else 0

    # tp: each planned parameter's local shape
    local: dict[str, tuple[int, ...]] = dict(shapes)
    tpt = _find(stack, "tensor_parallel")
    if tpt is not None and tp > 1:
        for name, layout in tpt.param_layouts(shapes).items():
            try:
                local[name] = tuple(layout.local_shape(mesh))
            except Exception:   # noqa: BLE001  (a layout needing more of a mesh: count it whole)
                pass
    pipeline = None
    if pipe is not None:       # this pipeline rank's stages: their parameters only
        pipeline = _pipeline_rank(pipe, module, shapes, pp, pp_rank)
        local = {n: s for n, s in local.items() if pp_rank in pipeline["owners"][n]}
    numel = {n: math.prod(s) for n, s in local.items()}
    sharded = lambda n: stage == 3 and numel[n] > threshold
    shard = lambda k: math.ceil(k / n_shard)
    esize = lambda dt: torch.empty((), dtype=dt).element_size()

    est = MemoryEstimate(num_params=sum(math.prod(s) for s in shapes.values()), world_size=world_size,
                         mesh={"dp": dp, "tp": tp, "sp": sp, **({"pp": pp} if pp > 1 else {})}, stage=stage,
                         offload=getattr(off, "device", None), offload_params=bool(getattr(off, "params", False)),
                         shard_group=hybrid, hpz=hpz)
    pb, gb = esize(pdtype), esize(pdtype)
    param_bytes = sum((shard(k) if sharded(n) else k) * pb for n, k in numel.items())
    if off is not None and est.offload_params and stage == 3:
        moved = sum(shard(k) * pb for n, k in numel.items() if sharded(n))
        param_bytes -= moved
        setattr(est, "nvme" if est.offload == "nvme" else "host", moved)
    est.params = param_bytes
    total_local = sum(numel.values())
    est.grads = sum((shard(k) if stage >= 2 else k) * gb for k in numel.values())

    # optimizer state: tx.init on meta tensors of the local shapes in the master dtype
    meta = {n: torch.empty(s, dtype=master_dtype, device="meta") for n, s in local.items()}
    mirrored = scalars = 0
    for path, x in tree.leaves_with_path(tx.init(meta)):
        if not isinstance(x, torch.Tensor):
            continue
        mirrors = next((n for n in local if path.endswith(n) and tuple(x.shape) == local[n]), None)
        if mirrors is None:
            scalars += x.numel() * x.element_size()
        else:
            mirrored += (shard(x.numel()) if stage >= 1 else x.numel()) * x.element_size()
    master_bytes = 0
    if mp_active:
        master_bytes = sum((shard(k) if stage >= 1 else k) * esize(master_dtype) for k in numel.values())
    opt_bytes = mirrored + scalars
    if off is not None:          # offload moves what mirrors a parameter; scalars (counts, lr) stay
        where = "nvme" if est.offload == "nvme" else "host"
        setattr(est, where, getattr(est, where) + mirrored + master_bytes)
        opt_bytes, master_bytes = scalars, 0
    est.optimizer, est.master = opt_bytes, master_bytes
    if stage == 3:
        largest, root = _unit_params(module, zero, set(shapes))
        scale = lambda k: k if tpt is None or tp == 1 else math.ceil(k / tp)
        est.largest_unit = (scale(largest) + scale(root)) * pb if module is not None else 0
        est.largest_layer = largest
        if hpz is not None:         # every sharded tensor is gathered padded to N, and 1/hpz of it kept
            est.secondary = sum(shard(k) * n_shard // hpz * pb for n, k in numel.items() if sharded(n))
    if zero is not None or _find(stack, "data_parallel") is not None:
        rb = getattr(zero, "reduce_bucket_size", None)
        if rb is None:
            dpt = _find(stack, "data_parallel")
            rb = int(getattr(dpt, "bucket_mb", 25.0) * 2**20) // gb
        est.buckets = min(rb, total_local) * gb
        if stage in (1, 2):
            est.buckets += min(getattr(zero, "allgather_bucket_size", total_local), total_local) * pb
    if pipeline is not None:
        dp_split = dp if (zero is not None or _find(stack, "data_parallel") is not None) else 1
        _pipeline_activations(est, pipe, pipeline, pp_rank, batch, dp_split, tp * sp, esize(pdtype),
                              _find(stack, "remat"), tp, sp)
    return est


def _pipeline_rank(pipe: Any, module: nn.Module | None, shapes: dict[str, tuple[int, ...]], pp: int,
                   pp_rank: int) -> dict[str, Any]:
    """The pipeline transform's cut and placement, as it makes them: its schedule (`build_schedule`
    of its schedule, microbatches, virtual at pp), stage -> rank from the schedule's actions,
    `plan_stages` of the model over p*v stages (its split, layers). {"schedule", "plan",
    "owners": {param: pipeline ranks holding it}, "stages": this rank's stages}."""
    from dsfn.engines.pipeline_schedules import build_schedule
    from dsfn.engines.pipeline_stages import plan_stages
    if isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or not 0 <= pp_rank < pp:
        raise ConfigError(f"estimate_memory(pp_rank={pp_rank!r}): a pipeline rank 0 .. {pp - 1}")
    module = module if module is not None else getattr(pipe, "model", None)
    if not isinstance(module, nn.Module):
        raise ConfigError("estimate_memory with pipeline_parallel needs the model's layers to cut it into stages: "
                          "pass the nn.Module as model= (the meta device is enough), or pipeline_parallel(..., "
                          "model=model)")
    schedule = build_schedule(pipe.schedule, pp, pipe.microbatches, pipe.virtual)
    where = {a.stage: a.rank for acts in schedule for a in acts}
    plan = plan_stages(module, list(shapes), len(where), pipe.split, pipe.layers)
    owners = {n: {where[s] for s in plan.param_stages[n]} for n in shapes}
    return {"schedule": schedule, "plan": plan, "owners": owners, "module": module,
            "stages": tuple(sorted(s for s, r in where.items() if r == pp_rank))}


def _model_dims(module: nn.Module) -> tuple[int | None, int | None]:
    """(hidden size, vocabulary) from the model's config: Hugging Face's hidden_size /
    vocab_size, dsfn GPT's d_model / vocab_size (n_embd for GPT-2 style configs)."""
    config = getattr(module, "config", None)
    hidden = next((getattr(config, k) for k in ("hidden_size", "d_model", "n_embd")
                   if isinstance(getattr(config, k, None), int)), None)
    vocab = getattr(config, "vocab_size", None)
    return hidden, vocab if isinstance(vocab, int) else None


def _recomputed_layers(remat: Any, plan: Any) -> tuple[set[int], set[int], str]:
    """The plan's layers whose activations are recomputed in backward — checkpointed whole by
    `remat` (its default modules, or patterns naming whole layers, with policy "nothing") or by
    the model's own gradient checkpointing (Hugging Face's flag on the layer) — and a note on
    what is not modelled (other remat policies, sublayer patterns: counted as without remat):
    (by the model, by remat — the layers the model checkpoints itself remat skips — note)."""
    import fnmatch
    names = [f"{plan.layers_path}.{k}" for k in range(len(plan.layers))]
    done = {k for k, layer in enumerate(plan.layers) if getattr(layer, "gradient_checkpointing", False) is True}
    note = "the model's gradient checkpointing" if done else ""
    if remat is not None:
        policy = getattr(remat, "policy", "nothing")
        modules = getattr(remat, "modules", None)
        whole = set(range(len(names))) if modules is None else \
            {k for k, n in enumerate(names) if any(fnmatch.fnmatchcase(n, p) for p in modules)}
        if policy != "nothing" or not whole:
            what = f"policy={policy!r}" if policy != "nothing" else f"modules={list(modules)}"
            note = ", ".join(x for x in (note, f"remat({what}) not modelled: counted as without remat, "
                                               "an upper bound") if x)
        else:
            by_remat = whole - done
            note = ", ".join(x for x in (note, "remat()") if x)
            return done, by_remat, note
    return done, set(), note


def _pipeline_activations(est: MemoryEstimate, pipe: Any, pipeline: dict[str, Any], pp_rank: int,
                          batch: tuple[int, int] | None, dp_split: int, tp_sp: int, act_bytes: int,
                          remat: Any = None, tp: int = 1, sp: int = 1) -> None:
    """Fill the pipeline fields of `est` for rank `pp_rank`: the schedule's peak in stage
    micro-batches (the engine's simulator) and the modelled activation bytes (module docstring).
    Layers recomputed in backward (`remat`, the model's own checkpointing) hold their input
    only, b·s·h values (1/sp under sequence parallel, 1/tp more with partition_activations, on
    the host with offload="cpu"), and each backward rematerialises one layer's whole
    activations at a time on top of what is held."""
    from dsfn.engines.pipeline_schedules import simulate
    schedule, plan = pipeline["schedule"], pipeline["plan"]
    m = pipe.microbatches
    est.pp_rank, est.pipeline_schedule, est.pipeline_microbatches = pp_rank, pipe.schedule, m
    est.pipeline_stages = pipeline["stages"]
    est.peak_microbatches = simulate(schedule).peak_activations[pp_rank]
    hidden, vocab = _model_dims(pipeline["module"])
    if batch is None:
        est.activation_note = "bytes not estimated: pass batch=(rows, seq_len) of the step's batch"
        return
    if hidden is None:
        est.activation_note = "bytes not estimated: the model's config names no hidden size (hidden_size, d_model)"
        return
    rows, seq = batch
    if rows % (dp_split * m):
        raise ConfigError(f"estimate_memory(batch={tuple(batch)}): {rows} rows do not split into {dp_split} dp "
                          f"rank{'s' if dp_split > 1 else ''} x {m} micro-batches (pipeline_parallel(microbatches={m}))"
                          f"; pass a batch whose rows are a multiple of {dp_split * m}")
    mb_rows = rows // (dp_split * m)
    tokens = mb_rows * seq
    n_stages = plan.n_stages
    by_model, by_remat, recompute_note = _recomputed_layers(remat, plan)
    recomputed = by_model | by_remat
    split = sp * (tp if getattr(remat, "partition_activations", False) else 1)
    kept = {k: tokens * hidden // sp for k in by_model}
    kept.update({k: 0 if getattr(remat, "offload", None) else tokens * hidden // split for k in by_remat})
    layer_values = ACT_VALUES_PER_LAYER * tokens * hidden // tp_sp

    def stage_bytes(s: int) -> int:
        a, b = plan.bounds[s]
        values = sum(kept.get(k, layer_values) for k in range(a, b))
        if s == 0:
            values += tokens * hidden                       # the embedding's output
        if s == n_stages - 1 and vocab:
            values += tokens * vocab                        # the logits
        return values * act_bytes
    per_stage = {s: stage_bytes(s) for s in est.pipeline_stages}
    # a backward of a stage with recomputed layers rematerialises one of them at a time
    transient = {s: layer_values * act_bytes if any(k in recomputed for k in range(*plan.bounds[s])) else 0
                 for s in est.pipeline_stages}
    held = peak = 0
    for act in schedule[pp_rank]:            # the schedule's order: F holds, B / BW frees (W keeps nothing here)
        if act.kind.value == "F":
            held += per_stage[act.stage]
        elif act.kind.value in ("B", "BW"):
            peak = max(peak, held + transient[act.stage])
            held -= per_stage[act.stage]
        peak = max(peak, held)
    est.activations = peak
    est.microbatch_activations = sum(per_stage.values())
    est.activation_note = (f"{ACT_VALUES_PER_LAYER} values per token per hidden unit per layer, {mb_rows} "
                           f"row{'s' if mb_rows != 1 else ''} x {seq} tokens per micro-batch, hidden {hidden}"
                           f"{f', vocabulary {vocab}' if vocab else ''}, "
                           f"{act_bytes} B per value")
    mine = sorted(k for s in est.pipeline_stages for k in range(*plan.bounds[s]) if k in recomputed)
    if mine:
        est.activation_note += (f"; recomputed in backward ({recompute_note}): layers {mine} hold their input only "
                                f"({', '.join(f'{kept[k]:,}' for k in mine)} values on the device), plus one layer's "
                                f"{layer_values:,} values rematerialised during a backward")
    elif recompute_note:
        est.activation_note += f"; {recompute_note}"


def measured_state_bytes(explanation: Any) -> dict[str, int]:
    """`Step.explain`'s leaves summed as `MemoryEstimate` fields: params, optimizer, master
    (on the device), host and nvme (offloaded leaves of any kind)."""
    out = {"params": 0, "optimizer": 0, "master": 0, "host": 0, "nvme": 0}
    for path, layout, _shape, _dtype, nbytes in explanation.leaves:
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


def explain_estimate(stack: Sequence[Any], state: Any, batch: Any = None) -> MemoryEstimate | None:
    """`estimate_memory` for `Step.explain`: the logical shapes of `state.params` (a placed
    state), the state's optimizer and the current mesh; with pipeline_parallel, this rank's
    index along its axis and the (rows, seq_len) of `batch`'s first 2-D tensor (its token
    ids, for the modelled activations). None (with a warning) when the stack holds something
    the estimate cannot read."""
    import warnings
    from dsfn.runtime import env
    from dsfn.runtime.mesh import current_mesh
    from dsfn.state.layout import Placed, is_placed
    try:
        shapes, dtype = {}, None
        for path, x in tree.leaves_with_path(state.params, is_leaf=is_placed):
            if isinstance(x, Placed):
                shapes[path] = tuple(getattr(x.layout, "shape", x.data.shape))
                dtype = dtype or x.data.dtype
            elif isinstance(x, torch.Tensor):
                shapes[path] = tuple(x.shape)
                dtype = dtype or x.dtype
        if not shapes or getattr(state, "tx", None) is None:
            return None
        mesh = current_mesh()
        mp = _find(tuple(stack), "mixed_precision")
        if mp is not None and mp.param_dtype != mp.master_dtype:
            dtype = mp.master_dtype
        pipe = _find(tuple(stack), "pipeline_parallel")
        pp = mesh.size(pipe.axis) if pipe is not None else 1
        pp_rank = mesh.local_rank(pipe.axis) if pipe is not None else None
        return estimate_memory(shapes, stack, env.world_size(), tx=state.tx, tp=mesh.size("tp"),
                               sp=mesh.size("sp"), pp=pp, pp_rank=pp_rank, batch=_tokens_shape(batch), dtype=dtype)
    except Exception as e:    # noqa: BLE001  (explain still reports what it measured)
        warnings.warn(f"explain: no memory estimate for this stack ({type(e).__name__}: {e})", stacklevel=3)
        return None


def _tokens_shape(batch: Any) -> tuple[int, int] | None:
    """(rows, seq_len) of a batch's first 2-D tensor (token ids), or None."""
    if batch is None:
        return None
    for x in tree.leaves(batch):
        if isinstance(x, torch.Tensor) and x.dim() == 2:
            return int(x.shape[0]), int(x.shape[1])
    return None


def estimate_vs_measured(est: MemoryEstimate, explanation: Any) -> str:
    """The estimate's state fields beside `Step.explain`'s measured bytes, one line each."""
    measured = measured_state_bytes(explanation)
    lines = ["memory per rank (estimate | measured state leaves):"]
    if est.pipeline_schedule is not None:
        lines.append(_pipeline_line(est))
    for k in ("params", "optimizer", "master", "host", "nvme"):
        lines.append(f"  {k:13s} {_human(getattr(est, k))} | {_human(measured[k])}")
    for k in ("grads", "largest_unit", "buckets"):
        lines.append(f"  {k:13s} {_human(getattr(est, k))} | (transient, not measured)")
    if est.pipeline_schedule is not None:
        lines.append(f"  {'activations':13s} {_human(est.activations)} | (transient, not measured; "
                     f"{_activation_detail(est)})")
    return "\n".join(lines)
