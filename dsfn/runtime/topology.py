"""Which node each rank runs on, from the launcher's environment.

Launchers place ranks node-major: node `g` holds global ranks `g*L .. g*L + L-1` (L ranks
per node). The topology is read, in this order, from

- torchrun (and `python -m dsfn.launch`, `dsfn.launch.spawn`): `LOCAL_WORLD_SIZE` (L) and
  `GROUP_RANK` (this node's index); `GROUP_WORLD_SIZE` when set is the number of nodes;
- SLURM's `srun`: `SLURM_NNODES`, `SLURM_NTASKS_PER_NODE` ("8", or "8(x4)"),
  `SLURM_PROCID` (this rank) and `SLURM_NODEID`;
- otherwise (and for a single process inside a SLURM allocation) one node holding every rank.

A task of a several-task `srun` step that is a world of one rank (RANK, WORLD_SIZE, ... not
exported) is a `DistributedError`: each task would otherwise train alone.

A launcher whose numbers disagree (ranks that do not divide into equal nodes, a node index
that is not `rank // L`) is a `DistributedError` naming the variables: a hybrid layout
built on a wrong topology would put its "node-local" groups across the network.

`Topology.node_of(rank)` and `nodes_spanned(ranks)` are what the mesh (shard groups that
never straddle a node), `explain` (bytes inside / across nodes) and `dsfn.estimate` use.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

from dsfn.errors import DistributedError
from dsfn.runtime import env

__all__ = ["Topology", "topology"]


@dataclass(frozen=True)
class Topology:
    """`nodes` nodes of `ranks_per_node` ranks each, ranks node-major; `source` names the
    launcher it was read from ("torchrun", "slurm" or "one node")."""

    nodes: int
    ranks_per_node: int
    source: str = "one node"

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def nodes_spanned(self, ranks: Iterable[int]) -> int:
        """How many nodes hold the ranks of `ranks` (1: a node-local group)."""
        return len({self.node_of(r) for r in ranks})

    def local_groups(self, ranks: Iterable[int]) -> list[list[int]]:
        """`ranks` split by node, each node's ranks in their given order, nodes ascending."""
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            by_node.setdefault(self.node_of(r), []).append(r)
        return [by_node[n] for n in sorted(by_node)]

    def describe(self) -> str:
        return f"{self.nodes} node(s) x {self.ranks_per_node} rank(s) (from {self.source})"


def _int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name}={value!r} is not an integer; fix the launcher's environment") from None


def _slurm_tasks_per_node(name: str, value: str) -> int:
    """SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE (`name`): "8", "8(x4)"; several counts
    ("8(x3),4") mean nodes of different sizes, which no layout here supports."""
    counts = {int(m.group(1)) for m in re.finditer(r"(\d+)(?:\(x\d+\))?", value)}
    if len(counts) != 1:
        raise DistributedError(f"{name}={value!r}: nodes run different numbers of ranks; launch "
                               "the same number on every node (srun --ntasks-per-node=N)")
    return counts.pop()


def from_environ(environ: Mapping[str, str], world: int, rank: int) -> Topology:
    """The topology `environ` describes for a world of `world` ranks, checked from `rank`'s side."""
    per = _int(environ, "LOCAL_WORLD_SIZE")
    step_tasks = _int(environ, "SLURM_STEP_NUM_TASKS")
    if per is None and world == 1 and step_tasks is not None and step_tasks > 1:
        raise DistributedError(f"srun started {step_tasks} tasks (SLURM_STEP_NUM_TASKS={step_tasks}), but this one "
                               "is a world of 1 rank: each task would train alone. dsfn joins the process group "
                               "from RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: export them per task "
                               "(RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID, MASTER_ADDR "
                               "the first node), or run one torchrun per node under srun (README, Several nodes)")
    if per is not None:
        source, node = "torchrun", _int(environ, "GROUP_RANK")
        nodes = _int(environ, "GROUP_WORLD_SIZE")
        names = "LOCAL_WORLD_SIZE / GROUP_RANK"
    elif world > 1 and environ.get("SLURM_NNODES", "").strip() and (
            environ.get("SLURM_NTASKS_PER_NODE", "").strip() or environ.get("SLURM_TASKS_PER_NODE", "").strip()):
        # (a single process in an allocation, e.g. the batch script's own python, is one node:
        # the allocation's variables describe srun's tasks, not this process)
        tasks = "SLURM_NTASKS_PER_NODE" if environ.get("SLURM_NTASKS_PER_NODE", "").strip() else "SLURM_TASKS_PER_NODE"
        source, names = "slurm", f"SLURM_NNODES / {tasks} / SLURM_NODEID"
        per = _slurm_tasks_per_node(tasks, environ[tasks])
        nodes, node = _int(environ, "SLURM_NNODES"), _int(environ, "SLURM_NODEID")
    else:
        return Topology(1, world)
    if per < 1 or world % per:
        raise DistributedError(f"{source}: {per} ranks per node do not divide the world of {world} ranks "
                               f"({names}); launch the same number of ranks on every node")
    if nodes is not None and nodes * per != world:
        raise DistributedError(f"{source}: {nodes} nodes x {per} ranks per node != world size {world} ({names}); "
                               "the launcher's variables disagree")
    if node is not None and node != rank // per:
        raise DistributedError(f"{source}: rank {rank} runs on node {node}, but ranks are expected node-major "
                               f"(node {rank // per} with {per} ranks per node; {names}). Launch with the "
                               "default rank assignment (torchrun's, srun's block distribution)")
    return Topology(world // per, per, source)


def topology() -> Topology:
    """This job's topology, from the launcher's environment (module docstring)."""
    return from_environ(os.environ, env.world_size(), env.rank())
