"""dsfn.runtime.host_copies: offload's bucket-by-bucket gradient pipeline, on CPU with a
simulated slow device stream (`SimulatedCopyEngine`): the host work of bucket k runs while
bucket k+1 copies, two staging buffers serve every bucket, one event wait per bucket, and
the training thread never waits for the device."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from dsfn.errors import ConfigError
from dsfn.runtime.host_copies import HostPipeline, SimulatedCopyEngine
from dsfn.runtime.syncs import count_host_syncs


def _buckets(n, numel=4096):
    return [[(f"b{k}.w{i}", torch.full((numel,), float(k * 10 + i))) for i in range(3)] for k in range(n)]


def _run(n=6, copy_s=0.02, work_s=0.02, n_buffers=2):
    eng = SimulatedCopyEngine(seconds_per_byte=copy_s / (3 * 4096 * 4))
    seen, threads = {}, set()

    def work(k, items):
        threads.add(threading.current_thread().name)
        time.sleep(work_s)                          # the host AdamW of bucket k
        seen[k] = [(key, t.clone()) for key, t in items]
    pipe = HostPipeline(work, engine=eng, n_buffers=n_buffers)
    with count_host_syncs() as syncs:
        for items in _buckets(n):
            pipe.submit(items)
        main_syncs = syncs.total
        pipe.drain()
    pipe.close()
    return eng, pipe, seen, syncs, main_syncs, threads


def _span(tl, k, what):
    return next((s, e) for b, w, s, e in tl if b == k and w == what)


def test_update_of_bucket_k_overlaps_the_copy_of_bucket_k_plus_1():
    eng, pipe, seen, syncs, _, threads = _run()
    for k in range(5):
        upd_start, _ = _span(eng.timeline, k, "update")
        _, next_copy_end = _span(eng.timeline, k + 1, "copy")
        assert upd_start < next_copy_end, eng.timeline     # update k starts before copy k+1 ends
        assert _span(eng.timeline, k, "copy")[1] <= upd_start  # and after its own data landed
    assert threads == {t for t in threads if t.startswith("dsfn-offload")}


def test_two_buffers_serve_every_bucket_and_values_arrive_intact():
    eng, pipe, seen, _, _, _ = _run(n=8)
    assert len(pipe.slots) == 2 and pipe.staged == 8
    assert sum(s.allocations for s in pipe.slots) == 2      # allocated once each, then reused
    for k, items in seen.items():
        for i, (key, t) in enumerate(items):
            assert key == f"b{k}.w{i}" and torch.equal(t, torch.full((4096,), float(k * 10 + i)))


def test_one_wait_per_bucket_and_none_on_the_training_thread():
    _, pipe, _, syncs, main_syncs, _ = _run(n=6)
    assert main_syncs == 0                      # submit never waits for the device
    assert syncs.total == 0                     # drain waits for host work only
    assert syncs.background == {"synchronize": 6}       # the worker: one event per bucket


def test_control_per_tensor_waits_are_counted():
    """The control: a pipeline whose worker waited once per tensor (what offload's
    speculation did) is seen by the counter as 3 waits per bucket."""
    eng = SimulatedCopyEngine()

    class PerTensor(HostPipeline):
        def _unstage(self, k, staged, event):
            for _ in staged:
                event.synchronize()
            return [(key, t.clone()) for key, t in staged]
    pipe = PerTensor(lambda k, items: None, engine=eng)
    with count_host_syncs() as syncs:
        for items in _buckets(4):
            pipe.submit(items)
        pipe.drain()
    assert syncs.background == {"synchronize": 12}


def test_slow_host_work_never_holds_the_staging_buffers():
    """A host update much slower than the copies (the usual case: host AdamW vs the device's
    backward) does not hold the staging buffers: buckets are copied out at once and queue for
    the update as host copies, so copy k+2 starts long before update k ends; every bucket
    arrives intact, updates run in bucket order. Negative control: a pipeline that frees a
    buffer only after its bucket's update (the old one) starts copy k+2 after update k."""
    eng, pipe, seen, _, _, _ = _run(n=6, copy_s=0.001, work_s=0.03)
    assert len(seen) == 6 and sum(s.allocations for s in pipe.slots) == 2
    for k in range(4):
        assert _span(eng.timeline, k + 2, "copy")[0] < _span(eng.timeline, k, "update")[1], eng.timeline
    ups = [_span(eng.timeline, k, "update") for k in range(6)]
    assert all(a[1] <= b[0] for a, b in zip(ups, ups[1:]))     # updates in bucket order

    class HeldUntilUpdated(HostPipeline):
        def _unstage(self, k, staged, event):
            event.synchronize()
            return staged, threading.Event()        # no copy out: the update reads the buffer

        def _update(self, k, unstaged, engine):
            staged, done = unstaged.result()
            start = engine.now()
            try:
                self.work(k, staged)
            finally:
                engine.note(k, "update", start, engine.now())
                done.set()

        def _take_slot(self):
            while not self._free:
                slot, fut = self._busy.popleft()
                fut.result()[1].wait()              # the buffer is free once its update ended
                self._free.append(slot)
            return self._free.popleft()
    ctl_eng = SimulatedCopyEngine(seconds_per_byte=0.001 / (3 * 4096 * 4))
    ctl = HeldUntilUpdated(lambda k, items: time.sleep(0.03), engine=ctl_eng)
    for items in _buckets(6):
        ctl.submit(items)
    ctl.drain()
    ctl.close()
    for k in range(4):
        assert _span(ctl_eng.timeline, k + 2, "copy")[0] >= _span(ctl_eng.timeline, k, "update")[1]


def test_host_tensors_are_not_staged_and_run_at_drain_on_the_caller():
    ran = []
    pipe = HostPipeline(lambda k, items: ran.append((k, threading.current_thread().name, items[0][1])))
    t = torch.ones(3)
    pipe.submit([("a", t)])
    assert ran == []                            # deferred: no core contention with backward
    pipe.drain()
    assert ran[0][0] == 0 and ran[0][1] == threading.current_thread().name and ran[0][2] is t
    assert pipe.staged == 0


def test_pageable_engine_and_errors_are_refused():
    with pytest.raises(ConfigError, match="pageable"):
        HostPipeline(lambda k, i: None, engine=SimulatedCopyEngine(pinned=False)).submit([("a", torch.ones(2))])
    with pytest.raises(ConfigError, match="n_buffers"):
        HostPipeline(lambda k, i: None, n_buffers=0)

    def boom(k, items):
        raise KeyError("bucket work failed")
    pipe = HostPipeline(boom, engine=SimulatedCopyEngine())
    pipe.submit([("a", torch.ones(2))])
    with pytest.raises(KeyError):
        pipe.drain()


def test_arrival_buckets_close_at_the_size_in_arrival_order_and_flush_the_rest():
    from dsfn.runtime.host_copies import ArrivalBuckets
    got = []
    b = ArrivalBuckets(10, got.append)
    for key, n in [("a", 4), ("b", 5), ("c", 3), ("d", 12), ("e", 2)]:
        b.add(key, torch.zeros(n))
    assert [[k for k, _ in items] for items in got] == [["a", "b", "c"], ["d"]]    # closed at >= 10 elements
    b.flush()
    b.flush()                                                                      # nothing left: no empty bucket
    assert [[k for k, _ in items] for items in got] == [["a", "b", "c"], ["d"], ["e"]] and b.emitted == 3
    with pytest.raises(ConfigError, match="positive"):
        ArrivalBuckets(0, got.append)
