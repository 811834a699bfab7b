"""Mesh: axis sizes, rank coordinates, groups, and clear errors for bad sizes."""
import pytest
import torch

from dsfn.errors import MeshError
from dsfn.runtime import collectives as C
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks


def _coords_and_sums(axes):
    mesh = init_mesh(**axes)
    r = torch.tensor([float(mesh.rank)])
    sums = {a: C.all_reduce(r, a).item() for a in ("dp", "tp")}
    return mesh.coords, mesh.ranks("dp"), mesh.ranks("tp"), sums


def test_2x2_mesh_groups_are_row_major_with_tp_fastest():
    out = run_on_ranks(_coords_and_sums, 4, {"dp": 2, "tp": 2}, timeout=60)
    assert [o[1] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [o[2] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o[3]["tp"] for o in out] == [1, 1, 5, 5]     # 0+1, 2+3
    assert [o[3]["dp"] for o in out] == [2, 4, 2, 4]     # 0+2, 1+3


def _make(axes):
    try:
        init_mesh(**axes)
    except MeshError as e:
        return str(e)
    return "ok"


def test_sizes_that_do_not_multiply_to_world_are_an_error():
    msgs = run_on_ranks(_make, 2, {"dp": 2, "tp": 2}, timeout=60)
    assert all("multiply to 4" in m and "world size is 2" in m for m in msgs)
    msgs = run_on_ranks(_make, 4, {"dp": -1, "tp": 3}, timeout=60)
    assert all("not divisible" in m for m in msgs)


def test_single_process_mesh_and_bad_axis_names():
    mesh = init_mesh()
    assert mesh.size("dp") == 1 and mesh.group("dp") is None
    with pytest.raises(MeshError, match="no axis 'ep'"):
        mesh.size("ep")
    with pytest.raises(MeshError, match="positive"):
        init_mesh(dp=0)


def _stack_error(mesh_axes, make_stack):
    """The MeshError message of a Step's first use (place) on this rank, or "ok"."""
    import dsfn
    from dsfn.runtime import reset_mesh
    from dsfn.testing.models import make_mlp

    reset_mesh()
    if mesh_axes is not None:
        init_mesh(**mesh_axes)
    model = make_mlp([4, 8, 2])
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose(*make_stack(model))(lambda s, b: (s, {}))
    try:
        step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)))
    except MeshError as e:
        return str(e)
    return "ok"


def _tp(model):
    from dsfn.transforms import tensor_parallel
    return (tensor_parallel({"layers.0": "colwise", "layers.1": "rowwise"}, model=model),)


def _sp(model):
    from dsfn.transforms import sequence_parallel
    return (sequence_parallel(),)


def test_tp_over_a_mesh_without_tp_names_the_init_mesh_fix():
    # init_mesh(dp=2) on 2 ranks, then tensor_parallel: tp would be a silent size-1 axis
    msgs = run_on_ranks(_stack_error, 2, {"dp": 2}, _tp, timeout=60)
    for m in msgs:
        assert "tensor_parallel(axis='tp')" in m and "dsfn.runtime.mesh.init_mesh(dp=..., tp=...)" in m
    # naming tp=1 says "on purpose": no error from the mesh check
    assert run_on_ranks(_stack_error, 2, {"dp": 2, "tp": 1}, _tp, timeout=60) == ["ok", "ok"]


def test_sp_with_the_default_all_dp_mesh_is_an_error_on_two_ranks():
    msgs = run_on_ranks(_stack_error, 2, None, _sp, timeout=60)
    for m in msgs:
        assert "sequence_parallel(axis='sp')" in m and "dsfn.runtime.mesh.init_mesh(dp=..., sp=...)" in m
        assert "'dp': 2" in m


def _default_mesh():
    from dsfn.runtime import current_mesh, reset_mesh
    reset_mesh()
    mesh = current_mesh()
    return mesh.axes, mesh.named


def test_default_mesh_over_a_world_of_two_is_all_dp():
    assert run_on_ranks(_default_mesh, 2, timeout=60) == [({"dp": 2, "sp": 1, "tp": 1, "pp": 1}, ("dp",))] * 2


def test_a_transform_over_an_axis_the_mesh_lacks_names_the_fix():
    from dsfn.transforms import data_parallel
    msg = _stack_error({"dp": 1}, lambda m: (data_parallel(axis="model"),))
    assert "no such axis" in msg and "dsfn.runtime.mesh.init_mesh(dp=..., model=...)" in msg
    # single process: tp/sp of size 1 are fine (nothing is silently left out)
    assert _stack_error(None, _tp) == "ok"


# -- split axes over the launcher's nodes (hybrid sharding) ----------------------------------------
def _split_layout(axes, inner):
    mesh = init_mesh(**axes)
    shard, replicate = mesh.split("dp", inner)
    r = torch.tensor([float(mesh.rank)])
    return {"topology": (mesh.topology.nodes, mesh.topology.ranks_per_node),
            "shard": mesh.ranks(shard), "replicate": mesh.ranks(replicate),
            "sizes": (mesh.size(shard), mesh.size(replicate)),
            "spans": {a: mesh.spans_nodes(a) for a in ("dp", shard, replicate)},
            "sums": (C.all_reduce(r, shard).item(), C.all_reduce(r.clone(), replicate).item())}


def test_split_dp_at_two_nodes_of_two_is_the_node_and_the_same_place_across_nodes():
    out = run_on_ranks(_split_layout, 4, {"dp": 4}, 2, ranks_per_node=2, timeout=60)
    assert {o["topology"] for o in out} == {(2, 2)}
    assert [o["shard"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]        # the node's ranks
    assert [o["replicate"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]    # same local index
    assert {o["sizes"] for o in out} == {(2, 2)}
    assert [o["spans"] for o in out] == [{"dp": True, "dp_shard": False, "dp_replicate": True}] * 4
    assert [o["sums"] for o in out] == [(1, 2), (1, 4), (5, 2), (5, 4)]          # the groups really are these


def test_split_dp_on_one_node_spans_no_node():
    # negative control: the same split with the four ranks on one node crosses nothing
    out = run_on_ranks(_split_layout, 4, {"dp": 4}, 2, timeout=60)
    assert {o["topology"] for o in out} == {(1, 4)}
    assert [o["shard"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o["spans"] for o in out] == [{"dp": False, "dp_shard": False, "dp_replicate": False}] * 4


def test_split_dp_of_a_dp_tp_mesh_keeps_each_shard_group_on_its_node():
    # dp 2 x tp 2 on two nodes of two: each node holds one dp rank of every dp group, so the
    # dp groups [0, 2], [1, 3] cross nodes and their split into groups of 1 is node-local
    out = run_on_ranks(_split_layout, 4, {"dp": 2, "tp": 2}, 1, ranks_per_node=2, timeout=60)
    assert [o["replicate"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [o["spans"]["dp"] for o in out] == [True] * 4
    assert [o["spans"]["dp_shard"] for o in out] == [False] * 4


def _hybrid_axes(spec, cross_node):
    """The axes `shard_zero(3, shard_group=spec)` shards and replicates over after place, or
    the ConfigError it raises."""
    import dsfn
    from dsfn.errors import ConfigError
    from dsfn.runtime import current_mesh, reset_mesh
    from dsfn.testing.models import make_mlp
    from dsfn.transforms import shard_zero

    reset_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp([4, 8, 2]))
    step = dsfn.compose(shard_zero(3, shard_group=spec, cross_node=cross_node))(lambda s, b: (s, {}))
    try:
        step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)))
    except ConfigError as e:
        return str(e)
    mesh = current_mesh()
    return dict(mesh.splits), (mesh.ranks("dp_shard") if mesh.splits else None)


def test_shard_group_node_follows_the_launchers_nodes():
    two = run_on_ranks(_hybrid_axes, 4, "node", False, ranks_per_node=2, timeout=60)
    assert two == [({"dp": 2}, [0, 1]), ({"dp": 2}, [0, 1]), ({"dp": 2}, [2, 3]), ({"dp": 2}, [2, 3])]
    # negative control: one node of four holds the whole dp axis, so "node" splits nothing
    one = run_on_ranks(_hybrid_axes, 4, "node", False, ranks_per_node=4, timeout=60)
    assert one == [({}, None)] * 4


def test_a_shard_group_larger_than_a_node_needs_cross_node():
    msgs = run_on_ranks(_hybrid_axes, 4, 4, False, ranks_per_node=2, timeout=60)
    assert all(isinstance(m, str) and "cross_node=True" in m and "several nodes" in m for m in msgs), msgs
    # with cross_node the group of 4 is the whole dp axis (flat ZeRO-3 over both nodes)
    assert run_on_ranks(_hybrid_axes, 4, 4, True, ranks_per_node=2, timeout=60) == [({}, None)] * 4
    # negative control: on one node of four the same group of 4 is node-local
    assert run_on_ranks(_hybrid_axes, 4, 4, False, ranks_per_node=4, timeout=60) == [({}, None)] * 4
