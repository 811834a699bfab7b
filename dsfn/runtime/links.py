"""Which link a collective's bytes travel: inside a node (NVLink) or across nodes (the NIC).

One accounting, shared by the runtime's counters (`collectives.CommCounters`, hence
`Step.explain`) and the cost model (`dsfn.comm_model`), so that what a run measured and
what the model projects to 1,000 nodes are the same quantity.

A collective over a group of g ranks, with B the bytes the runtime counts for it on one
rank (all_gather: the gathered output; reduce_scatter: the full input; all_reduce, all_to_all,
broadcast: the tensor), has a *traffic* of B, except all_reduce: 2B (a reduce-scatter
then an all-gather of B). For a node holding m of the group's ranks, the bytes that
must cross that node's boundary, whatever the algorithm (ring, tree, hierarchical: each
byte the node lacks enters it at least once), are

| op             | bytes crossing the node's boundary (per group on the node)       |
|----------------|-------------------------------------------------------------------|
| all_gather     | B (g-m)/g: the pieces held off the node come in                  |
| reduce_scatter | B (g-m)/g: the partial sums of pieces owned off the node go out  |
| all_reduce     | 2B (g-m)/g (reduce-scatter + all-gather)                         |
| all_to_all     | B (g-m)/g: the part of the input destined off the node           |
| broadcast      | B into a node that does not hold the source, 0 into the source's |

With the group spread evenly over n' nodes, (g-m)/g = (n'-1)/n'; a node-local group
(n' = 1) crosses nothing. Several groups along one mesh axis can touch one node (the
dp_replicate groups of hybrid sharding: one per rank of the node); the node's boundary
carries all of them: *inter-node bytes per node* = (crossing of one group) x (groups of the
axis on the node), the groups along an axis being translates of one another in the mesh
(every mesh here is row-major over node-major ranks), so that number is (ranks of the
node) / m. A rank's *intra-node bytes* (per rank) are what its node-local links carry for
it: traffic x (m-1)/m (broadcast: all of it when the source is another rank of the node).
For a node-local group (m = g) that is everything but its own piece, traffic/g, which moves
nowhere. For a group across nodes it is what the fast collectives do (NCCL's rings and
trees over all of a node's NICs, a hierarchical gather): each rank brings 1/m of the
node's missing bytes in through its own NIC and hands it to the m-1 others over NVLink,
and the node's own pieces are exchanged there too, so a rank's NVLink traffic stays
traffic x (m-1)/m however many nodes the group spans (counting only (m-1)/g would make a
flat collective over many nodes look free of NVLink time).

Imports nothing above the runtime.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dsfn.errors import ConfigError
from dsfn.runtime.topology import Topology

__all__ = ["OPS", "GroupLinks", "LinkBytes", "group_links", "link_bytes", "traffic"]

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "send")


def traffic(op: str, nbytes: float) -> float:
    """The bytes a collective of `nbytes` counted moves (module docstring): 2x for all_reduce."""
    if op not in OPS:
        raise ConfigError(f"unknown collective {op!r}; one of {OPS}")
    return 2 * nbytes if op == "all_reduce" else nbytes


@dataclass(frozen=True)
class GroupLinks:
    """A group of ranks seen from one node: `size` ranks, `on_node` of them on the node,
    `groups_on_node` groups of its axis touching the node, `node`/`topology` to place a
    broadcast's source. `cross` is the fraction (size - on_node) / size."""

    size: int
    on_node: int
    groups_on_node: int
    node: int
    topology: Topology

    @property
    def cross(self) -> float:
        return (self.size - self.on_node) / self.size

    @property
    def nodes_spanned(self) -> int:
        return -(-self.size // self.on_node)


def group_links(ranks: Sequence[int], topology: Topology, rank: int | None = None) -> GroupLinks:
    """The `GroupLinks` of the group `ranks` seen from the node of `rank` (default: the
    group's first rank). A ConfigError when `rank` is not on a node the group touches."""
    ranks = list(ranks)
    if not ranks:
        raise ConfigError("a collective's group holds at least one rank")
    node = topology.node_of(ranks[0] if rank is None else rank)
    m = sum(1 for r in ranks if topology.node_of(r) == node)
    if m == 0:
        raise ConfigError(f"rank {rank} is on node {node}, which holds no rank of the group {ranks[:8]}...")
    return GroupLinks(len(ranks), m, max(1, topology.ranks_per_node // m), node, topology)


@dataclass
class LinkBytes:
    """Bytes by link: `intra` over the node-local links (per rank), `inter` across this
    node's boundary (per node, every group of the axis on the node)."""

    intra: float = 0.0
    inter: float = 0.0

    def __iadd__(self, other: "LinkBytes") -> "LinkBytes":
        self.intra += other.intra
        self.inter += other.inter
        return self

    def __add__(self, other: "LinkBytes") -> "LinkBytes":
        return LinkBytes(self.intra + other.intra, self.inter + other.inter)

    def scaled(self, k: float) -> "LinkBytes":
        return LinkBytes(self.intra * k, self.inter * k)


def link_bytes(op: str, nbytes: float, links: GroupLinks, src: int | None = None,
               me: int | None = None) -> LinkBytes:
    """The intra-/inter-node split of one collective of `nbytes` counted (module docstring).
    `src`: a broadcast's source (a global rank); None counts it as off the node when the
    group spans nodes (the worst node). `me`: the rank counting (a broadcast's source
    receives nothing). A point-to-point "send" (`src`: its receiver) crosses this node's
    boundary when the receiver is on another node, else it stays on the node's links."""
    t = traffic(op, nbytes)
    if op == "send":
        off = links.topology.node_of(src) != links.node
        return LinkBytes(0.0 if off else t, t if off else 0.0)
    if op == "broadcast":
        if links.on_node == links.size:
            off = False
        else:
            off = src is None or links.topology.node_of(src) != links.node
        return LinkBytes(0.0 if off or src == me else t, t * links.groups_on_node if off else 0.0)
    return LinkBytes(t * (links.on_node - 1) / links.on_node, t * links.cross * links.groups_on_node)
