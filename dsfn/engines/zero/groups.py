"""Shard groups of hybrid sharding: which ranks share one copy of the sharded state.

Hybrid sharding (FSDP2's HSDP, DeepSpeed's MiCS) shards ZeRO's state over a *shard group*
of k ranks of the dp axis and replicates it across the groups; ZeRO++'s hpZ keeps a
secondary copy of each gathered unit over such a group. A group is a block of k
consecutive ranks of a dp group (`Mesh.split`: axes "<dp>_shard" and "<dp>_replicate");
the launcher numbers ranks node-major, so blocks that divide the dp ranks of a node are
node-local.

`group_size(mesh, dp_axis, spec, cross_node, who)` turns a spec into k, checked against
the launcher's topology on every dp group of the mesh (so every rank reaches the same
verdict before any process group is made):

- "node": the dp ranks one node holds (a MeshError when nodes hold different numbers);
- an int k: must divide the dp size; a block must not straddle nodes unless
  `cross_node` (MiCS with `mics_shard_size` above a node), and then holds whole nodes.

Imports no transform.
"""
from __future__ import annotations

from typing import Any

from dsfn.errors import ConfigError
from dsfn.runtime.mesh import Mesh

__all__ = ["group_size", "split_axes"]


def group_size(mesh: Mesh, dp_axis: str, spec: Any, cross_node: bool, who: str) -> int:
    """The shard group size `spec` ("node" or an int) means on `mesh` (module docstring)."""
    n = mesh.size(dp_axis)
    topo = mesh.topology
    groups = mesh.axis_groups(dp_axis)
    per_node = {len(g) for grp in groups for g in topo.local_groups(grp)}
    if len(per_node) != 1:
        raise ConfigError(f"{who}: the {dp_axis!r} groups hold different numbers of ranks on their nodes "
                          f"({topo.describe()}), so no shard group is node-local; lay the mesh out so that "
                          f"each node holds the same number of ranks of every {dp_axis!r} group")
    local = per_node.pop()
    if spec == "node":
        return local
    k = spec
    if n % k:
        raise ConfigError(f"{who}: a shard group of {k} ranks does not divide the {dp_axis!r} axis of {n} ranks; "
                          f"use a divisor of {n} (e.g. {local}, the {dp_axis!r} ranks of one node, or 'node')")
    straddles = any(topo.nodes_spanned(grp[b:b + k]) > 1 for grp in groups for b in range(0, n, k))
    if straddles and not cross_node:
        raise ConfigError(f"{who}: shard groups of {k} would put ranks of several nodes in one group "
                          f"(each node holds {local} {dp_axis!r} rank(s); {topo.describe()}), so every gather would "
                          f"cross the network; use 'node' ({local}) or a divisor of {local}, or pass "
                          "cross_node=True to span nodes on purpose (MiCS with a shard size above a node)")
    if straddles and k % local:
        raise ConfigError(f"{who}: shard groups of {k} span nodes but not whole ones (each node holds {local} "
                          f"{dp_axis!r} rank(s); {topo.describe()}): the layout disagrees with the launcher's "
                          f"topology; use a multiple of {local}")
    return k


def split_axes(mesh: Mesh, dp_axis: str, spec: Any, cross_node: bool, who: str) -> tuple[str, str | None]:
    """(the shard axis, the replicate axis or None) of a shard group `spec` on `mesh`: the dp
    axis itself (no replicate) when the group is the whole dp axis."""
    k = group_size(mesh, dp_axis, spec, cross_node, who)
    if k == mesh.size(dp_axis):
        return dp_axis, None
    return mesh.split(dp_axis, k)
