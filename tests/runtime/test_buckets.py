"""FixedBuckets: the same launches in the same order whatever subset of keys arrives, in any order.

This is what makes ranks whose data reach different parameters issue matching
collectives (tests/transforms/test_data_dependent.py runs it end to end)."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsfn.runtime.buckets import FixedBuckets


def _plan(sizes, bucket_elems, devices=None):
    keys = [f"p{i}" for i in range(len(sizes))]
    return keys, FixedBuckets(keys, [(n,) for n in sizes], [torch.float32] * len(sizes), bucket_elems, devices)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=8), bucket=st.integers(1, 20), data=st.data())
def test_launches_are_plan_order_whatever_arrives(sizes, bucket, data):
    keys, plan = _plan(sizes, bucket)
    arrived = data.draw(st.permutations(keys))[: data.draw(st.integers(0, len(keys)))]
    launched = []
    for k in arrived:
        launched += plan.add(k, torch.full((sizes[keys.index(k)],), 1.0))
    launched += plan.end_round()
    # every bucket exactly once, in plan order, each with all its keys
    assert [[k for k, _ in b] for b in launched] == plan.buckets
    for b in launched:
        for k, t in b:
            assert t.shape == (sizes[keys.index(k)],)
            assert float(t.sum()) == (sizes[keys.index(k)] if k in arrived else 0.0)   # zeros for the missing


def test_a_missing_parameters_zeros_are_made_on_its_device():
    """An untouched parameter's zero gradient lives on the parameter's device (was: the host),
    or on its bucket-mates' device when some arrived; `meta` stands in for CUDA."""
    keys, plan = _plan([3, 4], 100, devices=[torch.device("meta"), torch.device("meta")])
    (bucket,) = plan.end_round()
    assert all(t.device.type == "meta" for _, t in bucket)
    keys, plan = _plan([3, 4], 100)
    plan.add("p1", torch.ones(4, device="meta"))
    (bucket,) = plan.end_round()
    assert dict(bucket)["p0"].device.type == "meta"


def test_a_key_arriving_again_in_its_round_is_summed():
    keys, plan = _plan([2, 2], 100)
    assert plan.add("p0", torch.ones(2)) == []
    assert plan.add("p0", torch.ones(2)) == []
    (bucket,) = plan.add("p1", torch.ones(2))
    assert dict(bucket)["p0"].tolist() == [2.0, 2.0]
