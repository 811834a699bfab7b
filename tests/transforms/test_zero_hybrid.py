"""shard_zero beyond one node: hybrid sharding (`shard_group`, HSDP/MiCS) and hpZ (`hpz`).

The ranks are laid out on nodes as torchrun lays them out (`run_on_ranks(...,
ranks_per_node=k)`: ranks 0..k-1 on node 0, ...). Properties:

- every stage trains equal to the single process, at every world / nodes layout;
- each rank stores 1/k of the state (k = the shard group), the groups are the nodes, and
  the communication is what hybrid sharding promises: all-gathers and reduce-scatters on the
  shard group, one shard-sized all-reduce across groups; hpZ's backward gathers on the node;
- bad layouts are ConfigErrors naming the fix.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import dsfn
from dsfn.errors import ConfigError
from dsfn.runtime import collectives as C
from dsfn.runtime import current_mesh
from dsfn.state.layout import FlatShard, Placed
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import run_training
from dsfn.transforms import shard_zero

SIZES = [6, 10, 3]
BATCHES = regression_batches(3, 8, 6, 3, seed=3)
FP32 = dict(rtol=1e-5, atol=1e-6)


def _model():
    return make_mlp(SIZES, seed=1)


def _sgd():
    return dsfn.optim.sgd(0.1, momentum=0.9)


def _reference():
    ref = run_training(_model, _sgd, BATCHES)
    return {"params": ref.state.params, "opt_state": ref.state.opt_state}


def _train(options, world, per_node, batches=BATCHES):
    """Train on `world` ranks, `per_node` to a node: (per rank: final logical state, comm
    counts {(axis, op): bytes}, the layouts' axes, the state's bytes on this rank, the mesh
    groups of the split axes, the peak secondary shard bytes)."""
    def fn():
        C.counters.reset()
        C.reset_gauges()
        res = run_training(_model, _sgd, batches, [shard_zero(**options)])
        counts = {k: v.bytes for k, v in C.counters.snapshot().items()}
        mesh = current_mesh()
        groups = {a: mesh.ranks(a) for a in ("dp_shard", "dp_replicate")} if "dp" in mesh.splits else {}
        return ({"params": res.state.params, "opt_state": res.state.opt_state}, counts, groups,
                C.gauge_max.get("zero3.secondary_bytes", 0))
    return run_on_ranks(fn, world, ranks_per_node=per_node, timeout=90)


# ----------------------------------------------------------------------------------------------
# equality with the single process
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_equals_single_process_on_two_nodes(stage):
    ref = _reference()
    for rank, (state, counts, groups, _) in enumerate(_train(dict(stage=stage, shard_group="node"), 4, 2)):
        assert_trees_close(state, ref, **FP32, msg=f"hybrid ZeRO-{stage} (2 nodes x 2) vs single process")
        assert groups == {"dp_shard": [rank // 2 * 2, rank // 2 * 2 + 1], "dp_replicate": [rank % 2, rank % 2 + 2]}
        assert counts.get(("dp_replicate", "all_reduce"), 0) > 0, "no all-reduce across the shard groups"


@settings(max_examples=4, deadline=None)
@given(layout=st.sampled_from([(4, 2, "node"), (4, 2, 1), (8, 4, "node"), (8, 4, 2), (8, 2, "node"), (4, 1, "node")]),
       stage=st.sampled_from([1, 2, 3]))
def test_every_layout_of_nodes_and_groups_trains_alike(layout, stage):
    """Worlds, ranks per node and shard groups (a node's dp ranks, a divisor of them, 1 =
    replicated state with the all-reduce across every rank)."""
    world, per_node, group = layout
    ref = _reference()
    for state, *_ in _train(dict(stage=stage, shard_group=group), world, per_node):
        assert_trees_close(state, ref, **FP32, msg=f"shard_zero({stage}, shard_group={group!r}) at {layout}")


def test_hpz_equals_single_process_and_regathers_in_the_node():
    ref = _reference()
    out = _train(dict(stage=3, hpz="node"), 4, 2)
    for state, counts, groups, secondary in out:
        assert_trees_close(state, ref, **FP32, msg="hpZ (2 nodes x 2) vs single process")
        # forward gathers over every dp rank, backward only inside the node, from the secondary shard
        assert counts[("dp", "all_gather")] > 0 and counts[("dp_shard", "all_gather")] > 0
        assert groups["dp_shard"] in ([0, 1], [2, 3])
        assert secondary > 0, "hpZ kept no secondary shard"
    # the secondary is 1/2 (the node's ranks) of the largest gathered unit set: here the whole
    # model is one root unit, padded to a multiple of 4
    numel = sum(4 * math.ceil(p.numel() / 4) for p in _model().parameters())
    assert out[0][3] == numel * 4 // 2


# ----------------------------------------------------------------------------------------------
# layout and communication
# ----------------------------------------------------------------------------------------------

def test_the_shard_groups_are_the_nodes_and_the_state_is_one_kth():
    def fn():
        apply_fn, params = dsfn.functionalize(_model())
        step = dsfn.compose(shard_zero(3, shard_group="node"))(
            lambda s, b: (s, {"loss": torch.zeros(())}))
        state = step.place(dsfn.TrainState.create(params, _sgd(), seed=0))
        mesh = current_mesh()
        axes = {x.layout.axis for x in dsfn.tree.leaves(state.params, is_leaf=lambda v: isinstance(v, Placed))
                if isinstance(x, Placed) and isinstance(x.layout, FlatShard)}
        local = sum(x.data.numel() for x in dsfn.tree.leaves(state.params, is_leaf=lambda v: isinstance(v, Placed)))
        return axes, mesh.ranks("dp_shard"), mesh.ranks("dp_replicate"), mesh.spans_nodes("dp_shard"), \
            mesh.spans_nodes("dp_replicate"), local
    full = sum(p.numel() for p in _model().parameters())
    for rank, (axes, shard, replicate, shard_spans, rep_spans, local) in enumerate(run_on_ranks(fn, 8,
                                                                                                ranks_per_node=4)):
        assert axes == {"dp_shard"}
        assert shard == list(range(rank // 4 * 4, rank // 4 * 4 + 4)), "a shard group is not its node"
        assert replicate == [rank % 4, rank % 4 + 4]
        assert not shard_spans and rep_spans
        assert full / 4 <= local <= full / 4 + len(list(_model().parameters())), "state is not 1/4 per rank"


def test_hybrid_communication_stays_in_the_node_but_one_all_reduce():
    """Every all-gather and reduce-scatter on the shard group (inside a node); across nodes
    only the all-reduce of the reduced shards: 1/k of what a flat reduce-scatter moves."""
    hybrid = _train(dict(stage=3, shard_group="node"), 4, 2)[0][1]
    flat = _train(dict(stage=3), 4, 2)[0][1]
    data = {k: v for k, v in hybrid.items() if k[0] != "dp"}      # dp: place's broadcast, the metrics
    assert set(data) == {("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter"), ("dp_replicate", "all_reduce")}
    # the all-reduce moves the shard-sized result: half of the group's reduce-scatter input
    assert hybrid[("dp_replicate", "all_reduce")] * 2 == hybrid[("dp_shard", "reduce_scatter")]
    assert ("dp", "all_gather") in flat and ("dp_replicate", "all_reduce") not in flat


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(stage=0, shard_group="node"), "shard_group is read only at stage >= 1"),
    (dict(stage=2, hpz="node"), "hpz is read only at stage=3"),
    (dict(stage=3, shard_group="node", hpz="node"), "choose one"),
    (dict(stage=3, shard_group=0), "an int >= 1"),
    (dict(stage=3, hpz="nodes"), "'node'"),
    (dict(stage=3, cross_node=True), "no shard_group is given"),
])
def test_bad_options_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        shard_zero(**kwargs)


@pytest.mark.parametrize("options, world, per_node, match", [
    (dict(stage=3, shard_group=3), 4, 2, "does not divide"),
    (dict(stage=3, shard_group=4), 8, 2, "several nodes"),
    (dict(stage=3, shard_group=2, cross_node=True), 6, 3, "not whole ones"),
])
def test_layouts_that_disagree_with_the_nodes_are_config_errors(options, world, per_node, match):
    with pytest.raises(Exception, match=match) as info:
        _train(options, world, per_node)
    assert "ConfigError" in str(info.value)


def test_a_group_across_nodes_trains_when_asked():
    """cross_node=True (MiCS with a shard size above a node): groups of 4 on nodes of 2."""
    ref = _reference()
    for state, counts, groups, _ in _train(dict(stage=3, shard_group=4, cross_node=True), 8, 2):
        assert_trees_close(state, ref, **FP32)
        assert len(groups["dp_shard"]) == 4


def test_hierarchical_gather_of_a_group_across_nodes_trains_alike_and_gathers_in_two_stages():
    """MiCS's hierarchical gather: groups of 4 on nodes of 2 gather across nodes (one rank per
    node) and then inside the node; the values are a flat gather's."""
    ref = _reference()
    out = _train(dict(stage=3, shard_group=4, cross_node=True, hierarchical_gather=True), 8, 2)
    one_stage = _train(dict(stage=3, shard_group=4, cross_node=True), 8, 2)[0][1]
    for state, counts, groups, _ in out:
        assert_trees_close(state, ref, **FP32)
        assert counts[("dp_shard_cross", "all_gather")] > 0 and counts[("dp_shard_local", "all_gather")] > 0
    counts = out[0][1]
    # the second stage writes every unit whole, as the one-stage gather did; the first brings
    # in 1/2 of that (one piece from each of the 2 nodes); what stays on "dp_shard" is
    # step.gather's logical gather at the end, the same in both runs
    assert counts[("dp_shard_local", "all_gather")] + counts[("dp_shard", "all_gather")] == \
        one_stage[("dp_shard", "all_gather")]
    assert counts[("dp_shard_cross", "all_gather")] * 2 == counts[("dp_shard_local", "all_gather")]


def test_hierarchical_gather_needs_a_group_that_can_span_nodes():
    with pytest.raises(ConfigError, match="cross_node=True"):
        shard_zero(3, shard_group=2, hierarchical_gather=True)
    with pytest.raises(ConfigError, match="stage 3"):
        shard_zero(2, shard_group=2, cross_node=True, hierarchical_gather=True)
