"""`dsfn.runtime.topology.from_environ`: which node each rank runs on, from torchrun's or
SLURM's variables; a launcher whose numbers disagree is a DistributedError naming them."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsfn.errors import DistributedError
from dsfn.runtime.topology import Topology, from_environ


def _torchrun(rank: int, nodes: int, per: int) -> dict[str, str]:
    """The variables torchrun's agent on node `rank // per` gives local rank `rank % per`."""
    return {"RANK": str(rank), "WORLD_SIZE": str(nodes * per), "LOCAL_RANK": str(rank % per),
            "LOCAL_WORLD_SIZE": str(per), "GROUP_RANK": str(rank // per), "GROUP_WORLD_SIZE": str(nodes)}


def _slurm(rank: int, nodes: int, per: int, tasks: str | None = None) -> dict[str, str]:
    """What `srun --nodes N --ntasks-per-node L` (block distribution) gives task `rank`."""
    return {"SLURM_NNODES": str(nodes), "SLURM_NTASKS_PER_NODE": tasks or str(per), "SLURM_PROCID": str(rank),
            "SLURM_NODEID": str(rank // per), "SLURM_LOCALID": str(rank % per), "SLURM_NTASKS": str(nodes * per)}


def test_torchrun_two_nodes_of_two():
    topo = from_environ(_torchrun(2, 2, 2), 4, 2)
    assert topo == Topology(2, 2, "torchrun")
    assert topo.world == 4 and [topo.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert topo.nodes_spanned([0, 1]) == 1 and topo.nodes_spanned([0, 2]) == 2
    assert topo.local_groups([3, 0, 2, 1]) == [[0, 1], [3, 2]]


def test_torchrun_without_group_world_size_counts_the_nodes_from_the_world():
    environ = _torchrun(5, 2, 4)
    del environ["GROUP_WORLD_SIZE"]
    assert from_environ(environ, 8, 5) == Topology(2, 4, "torchrun")


@pytest.mark.parametrize("tasks", ["4", "4(x2)"])
def test_slurm_tasks_per_node_plain_and_repeated(tasks):
    assert from_environ(_slurm(5, 2, 4, tasks), 8, 5) == Topology(2, 4, "slurm")


def test_slurm_tasks_per_node_falls_back_to_the_allocations_count():
    environ = _slurm(1, 2, 2)
    environ["SLURM_TASKS_PER_NODE"] = environ.pop("SLURM_NTASKS_PER_NODE") + "(x2)"
    assert from_environ(environ, 4, 1) == Topology(2, 2, "slurm")


def test_torchrun_inside_srun_is_read_from_torchrun():
    # srun starts one torchrun agent per node (1 task per node); the agent starts 4 ranks
    environ = {**_slurm(1, 2, 1), **_torchrun(6, 2, 4)}
    assert from_environ(environ, 8, 6) == Topology(2, 4, "torchrun")


def test_no_launcher_is_one_node_of_every_rank():
    assert from_environ({}, 8, 3) == Topology(1, 8, "one node")
    assert from_environ({}, 1, 0) == Topology(1, 1, "one node")
    assert from_environ({"SLURM_NNODES": "2"}, 4, 0) == Topology(1, 4, "one node")    # no tasks per node


def test_a_single_process_in_a_slurm_allocation_is_one_node():
    # the batch script's own `python eval.py` in an allocation of 2 nodes x 8 tasks
    assert from_environ({"SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_PROCID": "0",
                         "SLURM_NODEID": "0"}, 1, 0) == Topology(1, 1, "one node")
    # negative control: the same variables on a world of 16 ranks are two nodes
    assert from_environ({"SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_NODEID": "0"},
                        16, 0) == Topology(2, 8, "slurm")


@pytest.mark.parametrize("environ, world, rank, names", [
    ({**_torchrun(0, 2, 2), "LOCAL_WORLD_SIZE": "3"}, 4, 0, ["LOCAL_WORLD_SIZE"]),       # 3 does not divide 4
    ({**_torchrun(0, 2, 2), "GROUP_WORLD_SIZE": "3"}, 4, 0, ["LOCAL_WORLD_SIZE"]),       # 3 x 2 != 4
    ({**_torchrun(2, 2, 2), "GROUP_RANK": "0"}, 4, 2, ["GROUP_RANK"]),                   # not node-major
    ({**_torchrun(0, 2, 2), "LOCAL_WORLD_SIZE": "two"}, 4, 0, ["LOCAL_WORLD_SIZE"]),    # not an integer
    ({**_torchrun(0, 2, 2), "LOCAL_WORLD_SIZE": "0"}, 4, 0, ["LOCAL_WORLD_SIZE"]),
    ({**_slurm(0, 2, 4), "SLURM_NNODES": "3"}, 8, 0, ["SLURM_NNODES", "SLURM_NTASKS_PER_NODE"]),
    ({**_slurm(0, 2, 4), "SLURM_NTASKS_PER_NODE": "3"}, 8, 0, ["SLURM_NTASKS_PER_NODE"]),
    ({**_slurm(5, 2, 4), "SLURM_NODEID": "0"}, 8, 5, ["SLURM_NODEID"]),                  # cyclic distribution
    ({**_slurm(0, 2, 4), "SLURM_NTASKS_PER_NODE": "4(x1),3"}, 7, 0, ["SLURM_NTASKS_PER_NODE"]),  # uneven nodes
    ({**_slurm(0, 2, 4), "SLURM_NNODES": "x"}, 8, 0, ["SLURM_NNODES"]),
])
def test_inconsistent_launcher_variables_are_an_error_naming_them(environ, world, rank, names):
    with pytest.raises(DistributedError) as info:
        from_environ(environ, world, rank)
    assert all(n in str(info.value) for n in names), str(info.value)


def test_consistent_variables_of_the_error_cases_are_accepted():
    """Negative control of the table above: the unmodified environments are fine."""
    assert from_environ(_torchrun(2, 2, 2), 4, 2).nodes == 2
    assert from_environ(_slurm(5, 2, 4), 8, 5).nodes == 2


@settings(max_examples=60, deadline=None)
@given(nodes=st.integers(1, 6), per=st.integers(1, 8), data=st.data())
def test_node_of_and_nodes_spanned_follow_the_node_major_layout(nodes, per, data):
    world = nodes * per
    rank = data.draw(st.integers(0, world - 1))
    for environ in (_torchrun(rank, nodes, per), _slurm(rank, nodes, per, f"{per}(x{nodes})")):
        topo = from_environ(environ, world, rank)
        assert (topo.nodes, topo.ranks_per_node, topo.world) == (nodes, per, world)
        # node-major: node g holds g*per .. g*per + per-1, the node each rank's launcher named
        for r in range(world):
            assert topo.node_of(r) == r // per
            assert r in range(topo.node_of(r) * per, (topo.node_of(r) + 1) * per)
        assert topo.node_of(rank) == int(environ.get("GROUP_RANK", environ.get("SLURM_NODEID")))
        ranks = data.draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world))
        assert topo.nodes_spanned(ranks) == len({r // per for r in ranks})
        assert sum(len(g) for g in topo.local_groups(ranks)) == len(ranks)
        assert all(topo.nodes_spanned(g) == 1 for g in topo.local_groups(ranks))
        # a node's own ranks are node-local; one rank of each of two nodes is not
        node = topo.node_of(rank)
        assert topo.nodes_spanned(range(node * per, (node + 1) * per)) == 1
        if nodes > 1:
            assert topo.nodes_spanned([rank, (rank + per) % world]) == 2


def test_srun_tasks_without_the_process_group_variables_are_an_error():
    # `srun --nodes 2 --ntasks-per-node 4 python train.py` with nothing exported: each task
    # sees a world of 1 and would train alone
    environ = {**_slurm(5, 2, 4), "SLURM_STEP_NUM_TASKS": "8"}
    with pytest.raises(DistributedError, match="SLURM_STEP_NUM_TASKS=8") as info:
        from_environ(environ, 1, 0)
    assert all(v in str(info.value) for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    # negative controls: the same task with the variables exported, a one-task step, and
    # torchrun's agent started by srun (its ranks carry LOCAL_WORLD_SIZE)
    assert from_environ(environ, 8, 5) == Topology(2, 4, "slurm")
    assert from_environ({**environ, "SLURM_STEP_NUM_TASKS": "1"}, 1, 0) == Topology(1, 1, "one node")
    assert from_environ({**environ, "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0"}, 1, 0).nodes == 1
