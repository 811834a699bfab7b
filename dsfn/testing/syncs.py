"""The host syncs of one training step of a small GPT on the `meta` device (for the sync
tests and benchmarks/host_syncs.py)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

import dsfn
from dsfn.runtime.syncs import HostSyncCounter, count_host_syncs


def later_step_syncs(n_layer: int, stack: Callable[[], Sequence[Any]], tx: Any) -> HostSyncCounter:
    """The counter of one later step of the tiny GPT with `n_layer` layers under `stack()`,
    optimizer `tx`, batch 2, all on `meta`. Placing and the first step (which builds what
    later steps reuse) run under a counter of their own: they read meta data too."""
    from dsfn.models import GPT, GPTConfig, gpt_loss
    cfg = dataclasses.replace(GPTConfig.preset("tiny"), n_layer=n_layer)
    apply_fn, params = dsfn.functionalize(GPT(cfg, seed=0).to("meta"))

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lambda p, b: gpt_loss(apply_fn(p, b["input_ids"]), b["labels"]))(
            state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    step = dsfn.compose(*stack())(train_step)
    ids = torch.zeros(2, cfg.seq_len, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "labels": ids}
    with count_host_syncs():
        state = step.place(dsfn.TrainState.create(params, tx=tx))
        state, _ = step(state, batch)
    with count_host_syncs() as s:
        step(state, batch)
    return s
