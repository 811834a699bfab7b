"""The link accounting (`dsfn.runtime.links`): pure cases, and what explain reports on 2 nodes."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import dsfn
from dsfn.errors import ConfigError
from dsfn.runtime import init_mesh
from dsfn.runtime.links import group_links, link_bytes, traffic
from dsfn.runtime.topology import Topology
from dsfn.testing import run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.transforms import shard_zero


@settings(max_examples=60, deadline=None)
@given(nodes=st.integers(1, 16), per=st.integers(1, 8), spanned=st.integers(1, 16), on=st.integers(1, 8),
       nbytes=st.integers(0, 10**9), op=st.sampled_from(["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]))
def test_a_balanced_group_crosses_n_minus_1_over_n_of_its_traffic(nodes, per, spanned, on, nbytes, op):
    spanned, on = min(spanned, nodes), min(on, per)
    topo = Topology(nodes, per)
    ranks = [n * per + i for n in range(spanned) for i in range(on)]      # `on` ranks on each of `spanned` nodes
    split = link_bytes(op, nbytes, group_links(ranks, topo))
    t = traffic(op, nbytes)
    assert split.inter == pytest.approx(t * (spanned - 1) / spanned * (per // on))
    # NVLink carries (m-1)/m of a rank's traffic, however many nodes the group spans
    assert split.intra == pytest.approx(t * (on - 1) / on)
    if spanned == 1:
        assert split.inter == 0


def test_broadcast_enters_each_node_without_the_source_and_all_reduce_is_twice():
    topo = Topology(2, 2)
    gl = group_links([0, 2], topo, rank=0)
    assert link_bytes("broadcast", 100, gl, src=2, me=0).inter == 100 * 2      # both groups of the axis on node 0
    assert link_bytes("broadcast", 100, gl, src=0, me=0).inter == 0
    assert link_bytes("all_reduce", 100, gl).inter == 2 * 100 * 1 / 2 * 2      # 2 groups on the node
    with pytest.raises(ConfigError):
        traffic("all_sum", 1)
    with pytest.raises(ConfigError):
        group_links([0, 1], topo, rank=3)


def _explain(kw):
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp([4, 6, 2], 0))

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(
            lambda p, b: torch.nn.functional.mse_loss(apply_fn(p, b["x"]), b["y"]))(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    step = dsfn.compose(shard_zero(3, **kw))(train_step)
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=0.1)))
    ex = step.explain(state, regression_batches(1, 4, 4, 2)[0])
    return ex.links, ex.inter_bytes, str(ex)


def test_explain_hsdp_gathers_inside_nodes_and_only_the_replicate_all_reduce_crosses():
    for links, inter, text in run_on_ranks(_explain, 4, {"shard_group": "node"}, ranks_per_node=2, timeout=60):
        gathers = {k: v for k, v in links.items() if k[1] == "all_gather"}
        assert gathers and all(v[1] == 0 and v[0] > 0 for v in gathers.values())      # 100% intra-node
        crossing = {k for k, v in links.items() if v[1] > 0 and k != ("dp", "all_reduce")}   # the loss metric aside
        assert crossing == {("dp_replicate", "all_reduce")}
        assert "node-local" in text and "inter-node (per node)" in text


def test_explain_negative_controls_one_node_is_all_intra_and_flat_zero3_crosses():
    for links, inter, _ in run_on_ranks(_explain, 4, {"shard_group": "node"}, ranks_per_node=4, timeout=60):
        assert inter == 0
    for links, inter, _ in run_on_ranks(_explain, 4, {}, ranks_per_node=2, timeout=60):
        assert links[("dp", "all_gather")][1] > 0


def test_a_send_crosses_the_node_boundary_only_to_another_node():
    topo = Topology(2, 2)
    across = link_bytes("send", 100, group_links([0, 2], topo, rank=0), src=2)
    inside = link_bytes("send", 100, group_links([0, 1], topo, rank=0), src=1)
    assert (across.intra, across.inter) == (0, 100)
    assert (inside.intra, inside.inter) == (100, 0)
