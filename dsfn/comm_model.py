"""Communication per training step, by link, from one node to 1,000: a cost model.

For a model of P parameters (its tensors grouped in ZeRO-3 units) on `nodes` nodes of
`gpus_per_node` ranks, `step_comm` lists the collectives one step issues on one rank
under a layout, with the bytes the runtime would count for each (padding included: every
tensor is flattened and zero-padded to a multiple of its shard group's size, as
`dsfn.runtime.flat` does), and splits them by link with the runtime's own accounting
(`dsfn.runtime.links`): intra-node bytes per rank, inter-node bytes per node. Layouts
(all ZeRO-3, `shard_zero(3, ...)`):

| layout | collectives per step (k = dp ranks of a node, D = dp size)                       |
|--------|-----------------------------------------------------------------------------------|
| flat   | all-gather each unit over dp in forward and in backward; reduce-scatter over dp   |
| hsdp   | the same over dp_shard (k, the node); all-reduce of the shard over dp_replicate   |
|        | (HSDP / MiCS: `shard_group="node"`)                                              |
| hpz    | forward all-gather over dp, backward re-gather over dp_shard; reduce-scatter over dp |
|        | (ZeRO++ hpZ: `hpz="node"`)                                                      |
| zeropp | hpz with qwZ (both gathers int8: 1 byte per element + an fp32 scale per 2,048)    |
|        | and qgZ (int4 all-to-all inside the node, then one row per node across, + scales |
|        | per 64): ZeRO++ whole  (`hpz="node", quantize_weights="int8", quantize_grads=...`) |

`tp` > 1 (inside a node) splits each weight matrix over tp ranks and adds Megatron's four
activation all-reduces per layer (two in forward, two in backward) of tokens x hidden;
`sp` > 1 (Ulysses, inside a node) adds eight all-to-alls per layer of tokens x hidden and
the gradients' all-reduce over sp. Message counts: one all-gather per unit and pass, one
reduce-scatter (and under hsdp one all-reduce) per unit, as FSDP and a DeepSpeed
reduce bucket of a layer's size do (`reduce_bucket=` elements instead: one per bucket), one
metrics all-reduce over dp.

Time (`Plan.seconds`) is an alpha-beta model, the links given as data (`Link`): per call,
a ring's hops each cost the link's latency (m-1 node-local hops, n'-1 across nodes; an
all-reduce across nodes takes NCCL's tree, 2 log2(n') hops);
bytes cost intra-node bytes / NVLink bandwidth (per GPU) plus inter-node bytes per node /
(NIC bandwidth x NICs per node). Communication only, none of it overlapped with compute:
a projection to compare layouts, not a step time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from dsfn.errors import ConfigError
from dsfn.runtime.links import LinkBytes, group_links, link_bytes
from dsfn.runtime.topology import Topology

__all__ = ["Link", "Cluster", "ModelSpec", "Collective", "collective", "Plan", "LAYOUTS", "QUANTIZED_LAYOUTS", "NVLINK_H100",
           "NIC_400G",
           "llama", "LLAMA_7B", "LLAMA_70B", "step_comm"]

LAYOUTS = ("flat", "hsdp", "hpz")
# modelled, not measured call for call (the scales' count depends on the buckets): ZeRO++ whole
QUANTIZED_LAYOUTS = ("zeropp",)


@dataclass(frozen=True)
class Link:
    """A link: `bandwidth` bytes/s per direction, `latency` seconds per message (hop)."""

    name: str
    bandwidth: float
    latency: float


# H100/H200 SXM: NVLink 4, 18 links, 900 GB/s bidirectional = 450 GB/s per direction per GPU
NVLINK_H100 = Link("NVLink 4 (H100/H200 SXM), 450 GB/s per direction per GPU", 450e9, 3e-6)
# one 400 Gb/s NIC per GPU (InfiniBand NDR / RoCE): 50 GB/s per direction
NIC_400G = Link("400 Gb/s NIC per GPU, 50 GB/s per direction", 50e9, 10e-6)


@dataclass(frozen=True)
class Cluster:
    """`nodes` nodes of `gpus_per_node` devices, `intra` between devices of a node,
    `nics_per_node` NICs of `inter` per node; each device holds `memory` bytes and computes
    `flops` dense (bf16, or the run's dtype) FLOP/s at peak, of which a training step's
    matmuls reach `efficiency` (stated per device kind; `dsfn.planner.calibrate` measures it).
    `overlap`: the fraction of an asynchronous collective's time the runtime hides behind
    compute (1.0 on GPUs, where NCCL runs on its own streams; 0.0 on CPU ranks, whose gloo
    threads take the cores the compute needs). `dtype`: the compute dtype the planner stacks
    (`mixed_precision()` for bf16). Presets: `Cluster.h100(nodes)`, `Cluster.h200(nodes)`,
    `Cluster.cpu(nodes, ranks_per_node)`."""

    nodes: int
    gpus_per_node: int = 8
    intra: Link = NVLINK_H100
    inter: Link = NIC_400G
    nics_per_node: int = 8
    memory: float = 80 * 2**30
    flops: float = 989e12
    efficiency: float = 0.45
    overlap: float = 1.0
    dtype: str = "bf16"
    name: str = "H100 SXM"
    hbm: float = 3.35e12
    layer_overhead: float = 0.0
    op_costs: tuple = ()
    host_bandwidth: float = 100e9
    pcie: float = 50e9
    backend: str = "nccl"
    """Calibrated collectives ((op, group size, seconds per call, seconds per byte counted), ...):
    where one is given it replaces the links' alpha-beta for that op and group size
    (`dsfn.planner.calibrate` measures them on this machine's ranks). `hbm`: device memory
    bandwidth (the optimizer's update streams the state); `layer_overhead`: seconds per layer and
    micro-batch the framework adds to a step's compute (what a tiny model on CPU is made of);
    `host_bandwidth`: the host memory's bytes per second (an offloaded optimizer's update);
    `pcie`: bytes per second each way between device and host (offload's gradients down and
    parameters up); `backend`: the collectives' ("nccl", or "gloo" on CPU ranks)."""

    @property
    def topology(self) -> Topology:
        return Topology(self.nodes, self.gpus_per_node, "comm_model")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @classmethod
    def h100(cls, nodes: int = 1, **kw) -> "Cluster":
        """Nodes of 8 H100 SXM (80 GiB HBM3, 989 TFLOP/s dense bf16), NVLink 4 inside, a 400 Gb/s
        InfiniBand NIC per GPU across."""
        return cls(nodes, **{"name": "H100 SXM", "memory": 80 * 2**30, **kw})

    @classmethod
    def h200(cls, nodes: int = 1, **kw) -> "Cluster":
        """Nodes of 8 H200 SXM (141 GB = 140 GiB HBM3e, the H100's compute and links)."""
        return cls(nodes, **{"name": "H200 SXM", "memory": 140 * 2**30, "hbm": 4.8e12, **kw})

    @classmethod
    def cpu(cls, nodes: int = 2, ranks_per_node: int = 2, *, memory: float = 4 * 2**30, flops: float = 20e9,
            efficiency: float = 1.0, bandwidth: float = 2e9, latency: float = 60e-6, **kw) -> "Cluster":
        """CPU/gloo ranks as this machine runs them (`dsfn.testing.run_on_ranks(..., ranks_per_node=)`):
        every "link" is a loopback socket of `bandwidth` bytes/s and `latency` s, the step in
        fp32, `flops` the rate one rank's step reaches (measure both: `dsfn.planner.calibrate`)."""
        link = Link("gloo over loopback", bandwidth, latency)
        return cls(nodes, ranks_per_node, link, link, 1, memory, flops, efficiency,
                   **{"overlap": 0.0, "dtype": "fp32", "name": "CPU gloo", "backend": "gloo", **kw})


@dataclass(frozen=True)
class ModelSpec:
    """A model as ZeRO-3 sees it: `units`, each a tuple of (numel, split over tp) per tensor;
    `hidden`, `layers` for tp/sp activation traffic."""

    name: str
    units: tuple[tuple[tuple[int, bool], ...], ...]
    hidden: int = 0
    layers: int = 0

    @property
    def params(self) -> int:
        return sum(n for u in self.units for n, _ in u)


def llama(name: str, hidden: int, intermediate: int, layers: int, vocab: int, heads: int,
          kv_heads: int) -> ModelSpec:
    """A Llama's tensors from its config: a unit per decoder layer, the root unit holding
    embeddings, final norm and (untied) lm_head."""
    kv = hidden // heads * kv_heads
    layer = ((hidden * hidden, True), (hidden * kv, True), (hidden * kv, True), (hidden * hidden, True),
             (hidden * intermediate, True), (hidden * intermediate, True), (intermediate * hidden, True),
             (hidden, False), (hidden, False))
    root = ((vocab * hidden, True), (hidden, False), (vocab * hidden, True))
    return ModelSpec(name, (root,) + (layer,) * layers, hidden, layers)


LLAMA_7B = llama("Llama-2 7B", 4096, 11008, 32, 32000, 32, 32)            # 6.74e9 parameters
LLAMA_70B = llama("Llama-3 70B", 8192, 28672, 80, 128256, 64, 8)          # 70.6e9 parameters


@dataclass
class Collective:
    """One kind of collective in a step: `calls` of `op` over `axis`, `nbytes` counted in
    all (the runtime's convention), split by link, and its modelled seconds."""

    axis: str
    op: str
    calls: int
    nbytes: int
    links: LinkBytes
    seconds: float


@dataclass
class Plan:
    """A step's collectives on one rank under a layout (`step_comm`)."""

    layout: str
    cluster: Cluster
    collectives: list[Collective] = field(default_factory=list)

    @property
    def inter_bytes(self) -> float:
        """Bytes crossing a node's boundary per step (per node)."""
        return sum(c.links.inter for c in self.collectives)

    @property
    def intra_bytes(self) -> float:
        """A rank's bytes over node-local links per step."""
        return sum(c.links.intra for c in self.collectives)

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.collectives)

    def counted(self) -> dict[tuple[str, str], tuple[int, int]]:
        """{(axis, op): (calls, bytes)}: what `Step.explain` shows as `collectives`."""
        return {(c.axis, c.op): (c.calls, c.nbytes) for c in self.collectives}


def collective(axis: str, ranks: Sequence[int], op: str, calls: int, nbytes: float, cluster: Cluster,
               rank: int | None = None, src: int | None = None) -> Collective | None:
    """`calls` of `op` over the group `ranks` (global ranks, seen from `rank`'s node, default
    the group's first), `nbytes` counted in all: its link split and alpha-beta seconds (module
    docstring). None when the group is one rank or nothing is sent."""
    if len(ranks) == 1 or calls == 0:
        return None
    topo = cluster.topology
    gl = group_links(ranks, topo, rank)
    split = link_bytes(op, nbytes, gl, src=src, me=rank)
    if op == "send":            # point to point: one hop, over the link the receiver sits behind
        hops = calls * (cluster.inter.latency if split.inter > 0 else cluster.intra.latency)
    else:
        across = 2 * math.ceil(math.log2(gl.nodes_spanned)) if op == "all_reduce" else gl.nodes_spanned - 1
        hops = calls * (cluster.intra.latency * (gl.on_node - 1) + cluster.inter.latency * across)
    secs = hops + split.intra / cluster.intra.bandwidth + split.inter / (cluster.inter.bandwidth * cluster.nics_per_node)
    for o, g, alpha, beta in cluster.op_costs:
        if o == op and g == len(ranks):
            secs = calls * alpha + nbytes * beta
    return Collective(axis, op, calls, int(nbytes), split, secs)


def _padded(numel: int, n: int) -> int:
    return -(-numel // n) * n


def step_comm(model: ModelSpec, layout: str, cluster: Cluster, *, elem_bytes: int = 2, tp: int = 1, sp: int = 1,
              tokens: int = 4096, reduce_bucket: float | None = None, metric_bytes: int = 8) -> Plan:
    """One step's collectives on rank 0 (module docstring). `elem_bytes`: the parameters'
    and gradients' element size (2: bf16); `tokens`: tokens per rank per step (tp/sp
    activations); `metric_bytes`: the metrics all-reduced over dp (a loss and its count, as
    float32: 8)."""
    if layout not in LAYOUTS + QUANTIZED_LAYOUTS:
        raise ConfigError(f"unknown layout {layout!r}; one of {LAYOUTS + QUANTIZED_LAYOUTS}")
    L = cluster.gpus_per_node
    if L % (tp * sp):
        raise ConfigError(f"tp x sp = {tp * sp} must divide the {L} GPUs of a node (tp and sp stay inside a node)")
    topo = cluster.topology
    world = topo.world
    dp = list(range(0, world, tp * sp))              # rank 0's dp group (mesh dp, sp, tp: tp fastest)
    k = L // (tp * sp)                               # dp ranks per node
    groups = {"dp": dp, "dp_shard": dp[:k], "dp_replicate": dp[::k], "tp": list(range(tp)),
              "sp": list(range(0, tp * sp, tp))}
    plan = Plan(layout, cluster)

    def add(axis: str, op: str, calls: int, nbytes: int) -> None:
        c = collective(axis, groups[axis], op, calls, nbytes, cluster)
        if c is not None:
            plan.collectives.append(c)

    def local(n: int, split: bool) -> int:
        return -(-n // tp) if split and tp > 1 else n

    def unit_bytes(n: int) -> list[int]:
        return [sum(_padded(local(t, s), n) for t, s in u) * elem_bytes for u in model.units]

    P_local = sum(local(t, s) for u in model.units for t, s in u)
    units = len(model.units)
    buckets = units if reduce_bucket is None else max(1, math.ceil(P_local / reduce_bucket))
    if layout == "flat":
        per = sum(unit_bytes(len(dp)))
        add("dp", "all_gather", 2 * units, 2 * per)
        add("dp", "reduce_scatter", buckets, per)
    elif layout == "hsdp":
        per = sum(unit_bytes(k))
        add("dp_shard", "all_gather", 2 * units, 2 * per)
        add("dp_shard", "reduce_scatter", buckets, per)
        add("dp_replicate", "all_reduce", buckets, per // k)
    elif layout == "hpz":
        per = sum(unit_bytes(len(dp)))
        add("dp", "all_gather", units, per)
        add("dp_shard", "all_gather", units, per)
        add("dp", "reduce_scatter", buckets, per)
    else:                       # zeropp: hpZ + qwZ (int8, scales per 2048) + qgZ (int4, scales per 64)
        elems = sum(unit_bytes(len(dp))) // elem_bytes
        q8 = elems + 4 * math.ceil(elems / 2048)
        add("dp", "all_gather", 2 * units, q8)              # codes and scales: two calls per unit
        add("dp_shard", "all_gather", 2 * units, q8)
        nodes = len(dp) // k
        q4 = elems // 2 + 4 * math.ceil(elems / 64)
        add("dp_shard", "all_to_all", 2 * buckets, q4)       # every destination's row, inside the node
        add("dp_replicate", "all_to_all", 2 * buckets, q4 // k if nodes > 1 else 0)   # one row per node
    add("dp", "all_reduce", 1, metric_bytes)
    act = tokens * model.hidden * elem_bytes
    add("tp", "all_reduce", 4 * model.layers, 4 * model.layers * act)
    add("sp", "all_to_all", 8 * model.layers, 8 * model.layers * act)
    add("sp", "all_reduce", buckets, P_local * elem_bytes)
    return plan


def projections(model: ModelSpec, nodes: Sequence[int], layouts: Sequence[str] = LAYOUTS,
                **kw) -> dict[tuple[int, str], Plan]:
    """`step_comm` for each node count and layout (other arguments as `step_comm`'s)."""
    return {(n, lay): step_comm(model, lay, Cluster(n), **kw) for n in nodes for lay in layouts}
