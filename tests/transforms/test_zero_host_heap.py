"""A donated ZeRO-3 step whose units are gathered in host memory gives glibc's free heap
pages back to the kernel once per step, at the end of backward (`env.trim_host_heap`):
the blocks a step frees (activations, gathered units) otherwise stay resident as holes
that the next steps' allocations do not all fit, and resident memory creeps above what is
ever held (benchmarks/README.md, memory.py). A non-donated step keeps its freed memory on
purpose (`tune_host_allocator`): the negative control, whose holes stay resident."""
import ctypes
import re

import pytest
import torch
import torch.nn.functional as F

import dsfn
from dsfn.models.gpt import GPT, GPTConfig
from dsfn.runtime import env, init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.models import token_batches
from dsfn.transforms import shard_zero


def _glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "malloc_trim")
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _glibc(), reason="malloc_trim is glibc's")

HOLES, HOLE = 3, 16 << 20          # freed heap blocks between live ones: 48 MiB of holes


def _rss() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def _step(stage: int, donate: bool):
    init_mesh()
    apply_fn, params = dsfn.functionalize(GPT(GPTConfig.preset("tiny")))
    seen = {}

    def train_step(state, batch):
        def loss_fn(p, b):
            logits = apply_fn(p, b["input_ids"])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["labels"].reshape(-1))
        loss, grads = dsfn.value_and_grad(loss_fn)(state.params, batch)
        seen["after_backward"] = _rss()
        return state.apply_gradients(grads), {"loss": loss}
    step = dsfn.compose(shard_zero(stage), donate=donate)(train_step)
    return step, step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=1e-2))), seen


def _holes_after_backward(donate: bool) -> dict:
    """Resident memory right after a step's backward minus before the step, with HOLES
    freed heap blocks of HOLE bytes left in the heap just before it."""
    env.tune_host_allocator()          # glibc keeps freed blocks: the holes stay resident
    step, state, seen = _step(3, donate)
    batches = token_batches(2, 4, 16, 256, seed=0)
    state, _ = step(state, batches[0])
    holes, guards = [], []
    for _ in range(HOLES):             # each hole followed by a live block: not the heap's top
        holes.append(torch.ones(HOLE // 4))
        guards.append(torch.ones(1 << 16))
    del holes
    before = _rss()
    trims = env.host_heap_trims
    step(state, batches[1])
    return dict(drop=before - seen["after_backward"], trims=env.host_heap_trims - trims)


def test_donated_zero3_step_gives_the_heaps_holes_back():
    donated = run_on_ranks(_holes_after_backward, 2, True, timeout=120)
    kept = run_on_ranks(_holes_after_backward, 2, False, timeout=120)
    for d, k in zip(donated, kept):
        assert d["trims"] == 1 and k["trims"] == 0, (d, k)
        # trimmed: the holes' pages are gone by the end of backward (measured 48-49 MiB)
        assert d["drop"] >= 0.75 * HOLES * HOLE, d
        # not trimmed: they stay resident (measured -1..0 MiB)
        assert d["drop"] - k["drop"] >= 0.75 * HOLES * HOLE, (d, k)


def _trims_per_step(stage: int, donate: bool, steps: int = 3) -> int:
    step, state, _ = _step(stage, donate)
    before = env.host_heap_trims
    for b in token_batches(steps, 4, 16, 256, seed=0):
        state, _ = step(state, b)
    return env.host_heap_trims - before


def test_only_donated_zero3_steps_trim_once_per_step():
    def run():
        return dict(zero3_donated=_trims_per_step(3, True), zero3=_trims_per_step(3, False),
                    zero2_donated=_trims_per_step(2, True))
    for res in run_on_ranks(run, 2, timeout=120):
        assert res == dict(zero3_donated=3, zero3=0, zero2_donated=0), res
