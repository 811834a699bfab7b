"""`map_whole`: a non-elementwise function of whole tensors applied to FlatShard pieces
equals sharding the function of the gathered tensors, on 1-4 ranks, with every tensor
computed once (on its owner)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsfn.runtime import counters, init_mesh
from dsfn.runtime.flat import map_whole, owners_by_size
from dsfn.state.layout import FlatShard, place
from dsfn.testing import run_on_ranks


def _fn(i, x):
    # non-elementwise and index-dependent: a wrong owner, order or shape shows up
    return x.reshape(x.shape[0], -1).cumsum(-1).reshape(x.shape) * (i + 1) + x.flip(0)


def _run(shapes, dtypes):
    init_mesh()
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=g).to(d) for s, d in zip(shapes, dtypes)]
    shards = [place(x, FlatShard("dp", tuple(x.shape))).data for x in full]
    calls = []

    def fn(i, x):
        calls.append(i)
        return _fn(i, x)
    counters.reset()
    got = map_whole(fn, shards, shapes, "dp")
    want = [place(_fn(i, x), FlatShard("dp", tuple(x.shape))).data for i, x in enumerate(full)]
    ok = all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))
    return ok, calls, (counters.calls("dp", "all_to_all"), counters.bytes("dp", "all_to_all"))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_map_whole_equals_sharded_function_of_full_tensors(world):
    shapes = [(7, 5), (3,), (4, 4, 2), (1, 9), (13, 2), (2, 2)]
    dtypes = [torch.float32, torch.float32, torch.float64, torch.float32, torch.bfloat16, torch.float32]
    results = run_on_ranks(_run, world, shapes, dtypes, timeout=60)
    assert all(ok for ok, _, _ in results)
    calls = sorted(i for _, c, _ in results for i in c)
    assert calls == list(range(len(shapes))), "every tensor is computed exactly once, on one rank"
    # traffic: two all-to-alls per dtype (3 dtypes), none on one rank
    n_calls, nbytes = results[0][2]
    assert n_calls == (0 if world == 1 else 2 * 3)
    if world > 1:   # a rank sends its 1/n of every tensor, twice; rows padded to the busiest owner
        payload = sum(math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in zip(shapes, dtypes))
        assert 2 * payload / world <= nbytes <= 2 * payload


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=30), st.integers(1, 8))
def test_owner_assignment_is_balanced(numels, n):
    owner = owners_by_size(numels, n)
    load = [sum(x for x, o in zip(numels, owner) if o == r) for r in range(n)]
    # greedy largest-first: no rank exceeds the mean by more than the largest tensor
    assert max(load) <= math.ceil(sum(numels) / n) + max(numels)
    assert owner == owners_by_size(numels, n)


class _TwoRanks:
    """A 2-rank axis seen from rank 0, without a process group (see the test below)."""

    def size(self, axis):
        return 2

    def local_rank(self, axis):
        return 0


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_map_whole_keeps_every_buffer_on_the_shards_device(monkeypatch, device):
    """Under NCCL the shards are CUDA tensors: the send/return buffers, what `fn` gets and the
    returned pieces must all be on that device (host buffers made the owner's NS run on CPU
    and hand back CPU pieces). Gloo has no second device, so `meta` stands in for CUDA: a
    fake all-to-all on a 2-rank axis records the devices it is given (meta tensors hold no
    data; the values are checked by the tests above), and an allocation on the host fails
    ("Cannot copy out of meta tensor"). `cpu` runs the same path on real data."""
    import dsfn.runtime.flat as flat
    seen = []

    def all_to_all(t, axis, **kw):
        seen.append(t.device)
        return t.clone()                  # rank 0's own rows come back; enough for devices and shapes
    monkeypatch.setattr(flat, "current_mesh", lambda: _TwoRanks())
    monkeypatch.setattr(flat.C, "all_to_all", all_to_all)
    shapes = [(7, 5), (3,), (4, 4, 2), (2, 2)]
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float64]
    shards = [torch.zeros(-(-math.prod(s) // 2), dtype=d, device=device) for s, d in zip(shapes, dtypes)]
    got_devices = []

    def fn(i, x):
        got_devices.append(x.device)
        return _fn(i, x)
    out = map_whole(fn, shards, shapes, "dp")
    want = torch.device(device)
    assert len(seen) == 2 * 3 and set(seen) == {want}          # to the owners and back, per dtype
    assert got_devices and set(got_devices) == {want}
    for o, s in zip(out, shards):
        assert o.device == want and o.dtype == s.dtype and o.shape == s.shape
