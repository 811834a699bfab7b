"""Shared by the parallelism benchmarks: timed steps, and one step's collectives split
into forward and backward.

`mark` is a dict the benchmark's loss function writes to: when `mark["on"]` it stores
`mark["fwd"] = collectives.counters.snapshot()` at the end of the forward, so the
collectives counted up to there are the forward's.
"""
from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from dsfn.runtime import collectives as C


def timed_steps(step: Any, state: Any, batches: list, warmup: int) -> tuple[Any, list, list, list]:
    """Run every batch (a barrier before each); returns (state, wall s, process CPU s of the
    steps after `warmup`, every step's loss)."""
    times, cpu, losses = [], [], []
    for i, b in enumerate(batches):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        state, m = step(state, b)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        losses.append(float(m["loss"]))
    return state, times, cpu, losses


def explained_step(step: Any, state: Any, batch: Any, mark: dict) -> tuple[Any, dict]:
    """`step.explain` of one more (dropped) step and its collectives per "axis/op":
    {"calls", "bytes", "fwd_calls", "fwd_bytes"}."""
    before = C.counters.snapshot()
    mark["on"] = True
    ex = step.explain(state, batch)
    mark["on"] = False
    fwd = {k: (v.calls - (before[k].calls if k in before else 0), v.bytes - (before[k].bytes if k in before else 0))
           for k, v in mark.get("fwd", {}).items()}
    comm = {}
    for (axis, op), (calls, nbytes) in ex.collectives.items():
        fc, fb = fwd.get((axis, op), (0, 0))
        comm[f"{axis}/{op}"] = {"calls": calls, "bytes": nbytes, "fwd_calls": fc, "fwd_bytes": fb}
    return ex, comm
