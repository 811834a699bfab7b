"""Host syncs per step of every offload stack (issue 24): at most 3, and not growing with the
number of layers (2 vs 6), for offload("cpu"), overlap=True, "nvme" and zenflow.

Two stand-ins for the GPU (no CUDA here):
- `meta` (world 1, `dsfn.testing.syncs.later_step_syncs`): the model, batch and state on
  meta run the CUDA code paths; a non-blocking copy to the host gives a counted
  `SimulatedEvent`. Every offload path runs (ZeRO at world 1 lays out nothing; overlap=True's
  buckets then come from offload's own world-1 source, staged and waited for by the worker).
- gloo world 2 with a `SimulatedCopyEngine` in offload's overlap pipeline: ZeRO-2/3 reduce
  gradients in buckets, each bucket is staged and its event waited for by the worker (counted
  apart, `HostSyncCounter.background`): one wait per bucket, none on the training thread.
"""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import dsfn
from dsfn.runtime.syncs import count_host_syncs
from dsfn.testing.ranks import run_on_ranks
from dsfn.testing.syncs import later_step_syncs, meta_runs_kernels
from dsfn.transforms import mixed_precision, offload, shard_zero
from dsfn.transforms.zenflow import zenflow

OFFLOAD = importlib.import_module("dsfn.engines.offload")     # offload's machinery: its host copies' waits


def _stacks(tmp):
    return {
        "zero2+cpu": lambda: [shard_zero(2), offload("cpu")],
        "zero3+cpu+bf16": lambda: [shard_zero(3), offload("cpu"), mixed_precision(torch.bfloat16)],
        "zero2+cpu+overlap": lambda: [shard_zero(2), offload("cpu", overlap=True)],
        "zero3+cpu+overlap+bf16": lambda: [shard_zero(3), offload("cpu", overlap=True),
                                           mixed_precision(torch.bfloat16)],
        "zero2+nvme": lambda: [shard_zero(2), offload("nvme", path=tmp)],
        "zero2+cpu+bf16+zenflow": lambda: [shard_zero(2), offload("cpu"), mixed_precision(torch.bfloat16),
                                           zenflow(update_interval=2, overlap=True)],
        "zenflow": lambda: [zenflow(update_interval=2)],
    }


@pytest.fixture
def meta_device(monkeypatch):
    """meta is the compute device (zenflow's device path runs where `env.device()` says)."""
    from dsfn.runtime import env
    monkeypatch.setattr(env, "device", lambda: torch.device("meta"))
    with meta_runs_kernels():
        yield


@pytest.mark.parametrize("name", ["zero2+cpu", "zero3+cpu+bf16", "zero2+cpu+overlap", "zero3+cpu+overlap+bf16",
                                  "zero2+nvme", "zero2+cpu+bf16+zenflow", "zenflow"])
def test_offload_stacks_sync_at_most_3_times_per_step_whatever_the_depth(meta_device, tmp_path, name):
    stack = _stacks(str(tmp_path))[name]
    small = later_step_syncs(2, stack, dsfn.optim.adamw(1e-3))
    large = later_step_syncs(6, stack, dsfn.optim.adamw(1e-3))
    assert small.total <= 3, small.events
    assert large.total == small.total, (small.events, large.events)
    if "overlap" in name:    # world 1: offload's own bucket source stages the gradients, the worker waits
        assert small.background["synchronize"] >= 1, small.background
        assert small.by_kind["synchronize"] + small.background["synchronize"] >= 1
    else:
        assert small.by_kind["synchronize"] >= 1     # the host copies are waited for (once per device)


def test_control_a_wait_per_tensor_is_counted(meta_device, tmp_path, monkeypatch):
    """The control: the old host copy, one `Event.synchronize` per tensor, is counted and
    grows with the layers."""
    def each(events):
        for _, ev in events:
            if ev is not None:
                ev.synchronize()
    monkeypatch.setattr(OFFLOAD, "wait_last", each)
    stack = _stacks(str(tmp_path))["zero2+cpu"]
    small = later_step_syncs(2, stack, dsfn.optim.adamw(1e-3)).total
    large = later_step_syncs(6, stack, dsfn.optim.adamw(1e-3)).total
    assert large > small > 3


# ----------------------------------------------------------------------------------------------
# world 2: the overlap pipeline's waits, bucket by bucket
# ----------------------------------------------------------------------------------------------

def _overlap_rank(stage, n_layer, mp):
    from dsfn.models import GPT, GPTConfig, gpt_loss
    from dsfn.runtime.mesh import init_mesh
    from dsfn.runtime.host_copies import SimulatedCopyEngine
    init_mesh()
    cfg = dataclasses.replace(GPTConfig.preset("tiny"), n_layer=n_layer)
    out = {}
    for overlap in (True, False):
        apply_fn, params = dsfn.functionalize(GPT(cfg, seed=0))

        def train_step(state, batch):
            loss, grads = dsfn.value_and_grad(lambda p, b: gpt_loss(apply_fn(p, b["input_ids"]), b["labels"]))(
                state.params, batch)
            return state.apply_gradients(grads), {"loss": loss}
        o = offload("cpu", overlap=overlap)
        if overlap:      # the CPU shards taken as device ones: staged, one simulated event per bucket
            o._session.pipe.engine = SimulatedCopyEngine()
        t = [shard_zero(stage, reduce_bucket_size=4096), o] + ([mixed_precision(torch.bfloat16)] if mp else [])
        step = dsfn.compose(*t)(train_step)
        state = step.init_state(params, dsfn.optim.adamw(1e-3))
        g = torch.Generator().manual_seed(0)
        losses, counts = [], []
        for i in range(3):
            ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
            staged0 = o._session.pipe.staged if overlap else 0
            with count_host_syncs() as syncs:
                state, m = step(state, {"input_ids": ids, "labels": ids})
            losses.append(float(m["loss"]))
            if overlap:
                counts.append((syncs.total, syncs.background["synchronize"], o._session.pipe.staged - staged0,
                               [sl.allocations for sl in o._session.pipe.slots]))
        out[overlap] = (losses, counts, dsfn.gather(state).params,
                        (o._session.hits, o._session.reused, [s.allocations for s in o._session.pipe.slots])
                        if overlap else None)
    return out


@pytest.mark.parametrize("stage,mp", [(2, True), (3, False)])   # fp32 copies that persist: hits
def test_overlap_pipeline_waits_once_per_bucket_off_the_training_thread(stage, mp):
    per_depth = {}
    for n_layer in (2, 6):
        res = run_on_ranks(_overlap_rank, 2, stage, n_layer, mp, timeout=300)[0]
        losses, counts, params, (hits, reused, allocs) = res[True]
        rlosses, _, rparams, _ = res[False]
        assert losses == rlosses                               # the staged path is bitwise the plain one
        for k in params:
            assert torch.equal(params[k], rparams[k]), k
        assert hits > 0 and reused > 0                         # speculation used; gradients copied once
        assert len(allocs) == 2                                # two staging buffers, never more
        assert counts[0][3] == counts[-1][3]                   # grown in the first step, then reused
        for main, background, buckets, _ in counts:
            assert main == 0                                   # the training thread never waits here
            assert buckets >= 2 and background == buckets     # one event wait per bucket
        per_depth[n_layer] = counts[-1]
    assert per_depth[6][2] > per_depth[2][2]                   # more layers: more buckets, same 0 main waits
