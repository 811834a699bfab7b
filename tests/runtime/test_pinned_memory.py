"""Pinned host memory is bounded and only used where it helps (copies from a CUDA device).

`torch.empty` is wrapped to record each allocation's `pin_memory` (and to allocate ordinary
memory, so this runs without CUDA); `torch.cuda.is_available` is patched to True, the case
where the old rule (`pin = torch.cuda.is_available()`) pinned host-only state.
"""
from __future__ import annotations

import pytest
import torch

from dsfn.checkpoint import host_cache as H
from dsfn.checkpoint.host_cache import HostCache
from dsfn.runtime.host import copy_to_host


@pytest.fixture
def allocations(monkeypatch):
    seen: list[tuple[int, bool]] = []
    real = torch.empty

    def empty(*size, pin_memory=False, **kw):
        t = real(*size, **kw)
        seen.append((t.numel(), bool(pin_memory)))
        return t
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return seen


def _state(n: int = 1000, k: int = 3):
    return {f"w{i}": torch.full((n,), float(i)) for i in range(k)}


def test_host_state_is_copied_into_unpinned_memory(allocations):
    cache = HostCache(capacity=1 << 20, capture="copy")
    staged, event, report = cache.stage(_state())
    event.wait()
    assert report.copied_tensors == 3 and torch.equal(staged["w2"], torch.full((1000,), 2.0))
    assert allocations == [(cache.buffer.numel(), False)] and not cache.pinned


def test_control_explicit_pin_is_honoured(allocations):
    cache = HostCache(capacity=1 << 20, capture="copy", pin=True)
    cache.stage(_state())[1].wait()
    assert allocations[-1][1] is True and cache.pinned


def test_default_bound_is_datastates_size_or_a_share_of_host_memory(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cap = HostCache().capacity
    assert cap == H.default_capacity() and 0 < cap <= 16 << 30
    import os
    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert cap <= phys // 32


def test_default_bound_applies_the_rest_is_referenced(monkeypatch, allocations):
    monkeypatch.setattr(H, "default_capacity", lambda: 2 * 4096)       # room for two of the tensors
    cache = HostCache(capture="copy")
    state = _state(n=1024)
    staged, event, report = cache.stage(state)
    event.wait()
    assert report.copied_tensors == 2 and report.referenced_tensors == 1
    assert staged["w2"] is state["w2"] and cache.buffer.numel() <= 2 * 4096


def test_one_buffer_is_reused_and_a_grown_pinned_one_is_released(monkeypatch, allocations):
    released = []
    monkeypatch.setattr(H, "_release_pinned", lambda: released.append(1))
    cache = HostCache(capacity=1 << 20, capture="copy", pin=True)
    for _ in range(3):
        cache.stage(_state())[1].wait()
    assert cache.allocations == 1 and len(allocations) == 1 and released == []
    cache.stage(_state(n=4000))[1].wait()                                # a larger state: grow once
    assert cache.allocations == 2 and released == [1]


def test_copy_to_host_pins_only_for_cuda_tensors(allocations):
    """A host tensor passes through; a non-CUDA device tensor is not pinned (meta stands for
    one: its copy fails after the allocation, which is all this looks at)."""
    t = torch.ones(3)
    assert copy_to_host(t)[0] is t and allocations == []
    with pytest.raises(NotImplementedError):
        copy_to_host(torch.ones(3, device="meta"))
    assert allocations and all(pin is False for _, pin in allocations)


def test_side_streams_are_made_per_tensor_device(monkeypatch):
    """Each CUDA device the staged tensors live on gets its own side stream, made *on that
    device* (a bare `torch.cuda.Stream()` is made on the current device, cuda:0 by default)."""
    made = []

    class FakeStream:
        def __init__(self, device=None):
            made.append(device)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    cache = HostCache(capacity=1 << 20)
    a = cache._side_stream(torch.device("cuda", 3))
    b = cache._side_stream(torch.device("cuda", 1))
    assert cache._side_stream(torch.device("cuda", 3)) is a and a is not b
    assert made == [torch.device("cuda", 3), torch.device("cuda", 1)]


def test_staged_event_waits_for_every_stream(monkeypatch):
    """One event per side stream, recorded on it; wait() synchronises them all."""
    log = []

    class FakeEvent:
        def record(self, stream):
            log.append(("record", stream))

        def synchronize(self):
            log.append(("sync", None))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    H.StagedEvent(["s3", "s1"]).wait()
    assert log == [("record", "s3"), ("record", "s1"), ("sync", None), ("sync", None)]
    log.clear()
    H.StagedEvent([]).wait()                 # host-only stage: nothing to wait for
    assert log == []
