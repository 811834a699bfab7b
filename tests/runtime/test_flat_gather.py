"""ZeRO's gathers and reductions into reused flat buffers (`dsfn.runtime.flat`):
`gather_into_buffers` equals `all_gather_full` bitwise while allocating only the unit's
buffer (counted by a TorchDispatchMode), `BufferPool` never hands out a buffer someone
still views, and a pooled `ShardReducer` (bucket reduced in place, shards written into a
lent flat buffer) equals the plain one bitwise."""
import time

import pytest
import torch

from dsfn.runtime import collectives as C
from dsfn.runtime import counters, init_mesh
from dsfn.runtime.flat import BufferPool, ShardReducer, all_gather_full, gather_into_buffers
from dsfn.state.layout import FlatShard, place
from dsfn.testing import run_on_ranks
from dsfn.testing.alloc import AllocCounter


SHAPES = [(5, 7), (3,), (4, 4), (9,), (2, 3, 5)]       # padded under 2, 3 and 4 ranks
DTYPES = [torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]


def _shards():
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=g).to(d) for s, d in zip(SHAPES, DTYPES)]
    return full, [place(x, FlatShard("dp", tuple(x.shape))).data for x in full]


def _gather(bucket):
    n = init_mesh().size("dp")
    full, shards = _shards()
    counters.reset()
    want = all_gather_full(shards, SHAPES, "dp", bucket)
    ref = (counters.calls("dp", "all_gather"), counters.bytes("dp", "all_gather"))
    counters.reset()
    g = gather_into_buffers(shards, SHAPES, "dp", bucket)
    got = g.wait()
    calls = (counters.calls("dp", "all_gather"), counters.bytes("dp", "all_gather"))
    equal = all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, want))
    equal_full = all(torch.equal(a, b) for a, b in zip(got, full))
    # every view lies in its bucket's buffer: one storage per bucket, no per-tensor copies
    storages = {t.untyped_storage().data_ptr() for t in got}
    in_slabs = all(t.untyped_storage().data_ptr() == g.slabs[k].untyped_storage().data_ptr()
                   for t, k in zip(got, g.slab_of))
    return dict(equal=equal, equal_full=equal_full, ref=ref, calls=calls, storages=len(storages),
                slabs=len(g.slabs), in_slabs=in_slabs, n=n)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("bucket", [8, 10_000])
def test_gather_into_buffers_equals_all_gather_full(world, bucket):
    for r in run_on_ranks(_gather, world, bucket, timeout=60):
        assert r["equal"] and r["equal_full"]
        assert r["calls"] == r["ref"]                    # same calls, same bytes as the bucketed gather
        assert r["in_slabs"]
        if world > 1:
            assert r["storages"] == r["slabs"] == r["ref"][0]    # one buffer per bucket (2 dtypes, or more)
        else:
            assert r["storages"] == len(SHAPES)          # size-1 axis: views of the shards themselves


def _allocations():
    n = init_mesh().size("dp")
    _, shards = _shards()
    shards = [s.float() for s in shards]                 # one dtype: one bucket
    unit = sum(n * s.numel() * 4 for s in shards)        # the gathered unit, padding included
    pool = BufferPool(keep=1)
    out = {"unit": unit}
    for key, fn in [("plain", lambda: all_gather_full(shards, SHAPES, "dp", 10_000)),
                    ("into", lambda: gather_into_buffers(shards, SHAPES, "dp", 10_000).wait()),
                    ("pooled", lambda: gather_into_buffers(shards, SHAPES, "dp", 10_000, pool)),
                    ("pooled_again", lambda: gather_into_buffers(shards, SHAPES, "dp", 10_000, pool))]:
        with AllocCounter() as mode:
            g = fn()
            if key.startswith("pooled"):
                views = g.wait()
        if key.startswith("pooled"):
            ok = all(torch.equal(v, full) for v, full in zip(views, _shards()[0]))
            del views
            g.release(pool)
            out[key + "_ok"] = ok
            # gloo's worker thread drops its finished work (which references the buffer) just
            # after wait() returns; the pool hands a buffer out only once nothing else holds it
            time.sleep(0.05)
        out[key] = mode.bytes
    return out


def test_gather_allocates_only_the_unit_buffer():
    """Bytes made by one unit's gather, counted by a TorchDispatchMode: exactly the unit's
    buffer; nothing once the pool holds one of its size. Negative control: the
    concatenating gather (`all_gather_full`) makes the concatenation, the gathered buffer
    and a copy per tensor: more than twice the unit."""
    for r in run_on_ranks(_allocations, 2, timeout=60):
        assert r["into"] == r["unit"]
        assert r["pooled"] == r["unit"] and r["pooled_again"] == 0
        assert r["pooled_ok"] and r["pooled_again_ok"]
        assert r["plain"] > 2 * r["unit"]


def test_pool_never_hands_out_a_viewed_buffer():
    pool = BufferPool(keep=2)
    a = pool.take(16, torch.float32, torch.device("cpu"))
    view = a[4:8]
    pool.give(a)                                   # a view is alive: set aside, not handed out
    b = pool.take(16, torch.float32, torch.device("cpu"))
    assert b.data_ptr() != a.data_ptr()
    del view
    pool.give(b)
    assert pool.take(16, torch.float32, torch.device("cpu")).data_ptr() == b.data_ptr()
    # the view is gone now: the buffer set aside is handed out, once
    assert pool.take(16, torch.float32, torch.device("cpu")).data_ptr() == a.data_ptr()
    assert pool.take(16, torch.float32, torch.device("cpu")).data_ptr() not in (a.data_ptr(), b.data_ptr())
    # lent buffers: handed out again only once no view of them is left
    lent = pool.take_lent(32, torch.float32, torch.device("cpu"))
    held = lent[:8]
    again = pool.take_lent(32, torch.float32, torch.device("cpu"))
    assert again.data_ptr() != lent.data_ptr()
    del held
    assert pool.take_lent(32, torch.float32, torch.device("cpu")).data_ptr() == lent.data_ptr()


def _reduce(rounds):
    """Two steps of a ShardReducer, with and without a pool, over `rounds` rounds each."""
    init_mesh()
    me = torch.distributed.get_rank()
    named = [(f"p{i}", torch.empty(s, device="meta")) for i, s in enumerate([(6, 5), (7,), (33,), (4, 4), (50,)])]
    pool = BufferPool(keep=3)
    out = {}
    for key, p in [("plain", None), ("pooled", pool)]:
        ptrs, steps = [], []
        for step in range(2):
            red = ShardReducer("dp", 40, "avg", None, named, pool=p)
            g = torch.Generator().manual_seed(100 * step + me)
            for _ in range(rounds):
                red.new_round()
                for k, t in reversed(named):
                    red.add(k, torch.randn(t.shape, generator=g))
            shards = red.finish()
            steps.append({k: v.clone() for k, v in shards.items()})
            ptrs.append({v.untyped_storage().data_ptr() for v in shards.values()})
            if step == 0 and key == "pooled":
                del shards                   # the previous step's shards are dropped: the buffer is free
        out[key] = steps
        out[key + "_ptrs"] = ptrs
    # a step's shards still held: the next step's are not written over them (with a check
    # that lends a buffer whatever views it, this pool of one would hand the same one out)
    pool = BufferPool(keep=1)
    red = ShardReducer("dp", 40, "avg", None, named, pool=pool)
    for k, t in reversed(named):
        red.add(k, torch.ones(t.shape))
    held = red.finish()
    before = {k: v.clone() for k, v in held.items()}
    red = ShardReducer("dp", 40, "avg", None, named, pool=pool)
    for k, t in reversed(named):
        red.add(k, torch.full(t.shape, 2.0))
    red.finish()
    out["held_intact"] = all(torch.equal(before[k], v) for k, v in held.items())
    out["held_ones"] = all(bool(v.max() == 1) for v in held.values())
    return out


@pytest.mark.parametrize("world,rounds", [(2, 1), (2, 2), (3, 1)])
def test_pooled_shard_reducer_equals_plain(world, rounds):
    for r in run_on_ranks(_reduce, world, rounds, timeout=60):
        for a, b in zip(r["plain"], r["pooled"]):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        if rounds == 1:    # the first round's shards all live in one buffer, the same one next step
            assert len(r["pooled_ptrs"][0]) == 1 and r["pooled_ptrs"][0] == r["pooled_ptrs"][1]
            assert len(r["plain_ptrs"][0]) > 1
        assert r["held_intact"] and r["held_ones"]


def _reduce_scatter_into():
    init_mesh()
    n, me = C.current_mesh().size("dp"), torch.distributed.get_rank()
    t = torch.randn(n * 7, generator=torch.Generator().manual_seed(me))
    out = {}
    for op in ("sum", "avg"):
        want = C.reduce_scatter(t, "dp", op)
        dst = torch.empty(7)
        scratch = t.clone()
        got = C.reduce_scatter(scratch, "dp", op, out=dst, consume=True)
        into = C.reduce_scatter(t, "dp", op, out=torch.empty(7), async_op=True).wait()
        out[op] = (torch.equal(want, got), got is dst, torch.equal(want, into), torch.equal(scratch, t))
    return out


def test_reduce_scatter_into_a_buffer_consuming_the_input():
    """Bitwise equal to the plain reduce-scatter; with consume=True (gloo) the input was
    used as the all-reduce's buffer (it changed): no input-sized clone was made."""
    for r in run_on_ranks(_reduce_scatter_into, 2, timeout=60):
        for op in ("sum", "avg"):
            equal, same, equal_into, untouched = r[op]
            assert equal and same and equal_into
            assert not untouched
