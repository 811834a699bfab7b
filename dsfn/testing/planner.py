"""Measuring a planner candidate (`dsfn.planner.Layout`) on this machine's ranks: what the
planner's predictions are checked against (tests/planner, benchmarks/plan.py).

`measure(layout, build, batch_of, ...)` runs on every rank of a `run_on_ranks` job: it
builds the model (`build()`, the same seed on every rank), composes `layout.stack(model)`,
places the state, runs `warmup` steps, then per step the wall time (the slowest rank's, after
a barrier), the allocation high-water mark of one step (`dsfn.testing.alloc.allocation_peak`,
on top of the placed state's bytes `Step.explain` lists) and `Step.explain`'s collectives and
bytes per link. Returns a `Measured` per rank.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["Measured", "measure", "train_step_for"]


@dataclass
class Measured:
    """One rank's figures: `seconds` per step (each timed step; the slowest rank's), `peak`
    bytes (state + the step's allocation high-water mark), `state` bytes, `links`
    {(axis, op): (intra, inter)} and `collectives` {(axis, op): (calls, bytes)} of one step."""

    seconds: list[float] = field(default_factory=list)
    peak: int = 0
    state: int = 0
    links: dict = field(default_factory=dict)
    collectives: dict = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)


def train_step_for(apply_fn: Callable) -> Callable:
    """A causal-LM train step: the mean cross-entropy of the logits against `batch["labels"]`."""
    import dsfn

    def loss_fn(params, batch):
        out = apply_fn(params, batch["input_ids"])
        logits = out.logits if hasattr(out, "logits") else out
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    return train_step


def measure(layout: Any, build: Callable[[], torch.nn.Module], batch: dict, *, steps: int = 3, warmup: int = 1,
            lr: float = 1e-3, memory: bool = True) -> Measured:
    """Run `layout` on this job's ranks (module docstring); call it on every rank."""
    import torch.distributed as dist

    import dsfn
    from dsfn.runtime import init_mesh
    from dsfn.testing.alloc import allocation_peak
    init_mesh(**layout.mesh)
    model = build()
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose(*layout.stack(model), donate=True)(train_step_for(apply_fn))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=lr)))
    out = Measured()
    for _ in range(warmup):
        state, m = step(state, batch)
        out.losses.append(float(m["loss"]))
    ex = step.explain(state, batch)
    out.links, out.collectives = dict(ex.links), dict(ex.collectives)
    out.state = sum(r[-1] for r in ex.leaves if "Offloaded" not in type(r[1]).__name__)
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        state, m = step(state, batch)
        out.losses.append(float(m["loss"]))
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        out.seconds.append(float(dt))
    if memory:
        holder = [state]

        def one():
            holder[0], _ = step(holder[0], batch)
        _, peak = allocation_peak(one)
        out.peak = out.state + peak
    return out
