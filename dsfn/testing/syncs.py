"""The host syncs of one training step of a small GPT on the `meta` device (for the sync
tests and benchmarks/host_syncs.py)."""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
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


@contextlib.contextmanager
def meta_runs_kernels() -> Iterator[None]:
    """Dispatch picks the fused (Triton) paths for meta tensors, as it does for CUDA ones;
    the per-tensor AdamW kernel is its torch reference (which shares the kernel's argument
    preparation) and the multi-tensor kernels launch nothing (meta holds no values)."""
    from dsfn.ops import adamw as A
    from dsfn.ops import cast as C
    from dsfn.ops import dispatch

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *a, **k: None
    fake = lambda *ts, dtypes=(): bool(ts) and all(t.device.type == "meta" for t in ts  # noqa: E731
                                                   if isinstance(t, torch.Tensor))
    with patched(dispatch, "use_triton", fake), patched(A, "adamw_update_triton", A.adamw_update_torch), \
            patched(A, "_adamw_multi_kernel", NoLaunch()), patched(C, "_cast_multi_kernel", NoLaunch()):
        yield


@contextlib.contextmanager
def per_leaf_adamw() -> Iterator[None]:
    """The old AdamW preparation, for negative controls: one kernel call per leaf, each
    copying the host lr and step to the device (blocking) and making its own scalars."""
    from dsfn.ops import adamw as A

    def per_leaf(params, grads, ms, vs, *, lr, step, out=None, **kw):
        lr, step = torch.tensor(float(lr), dtype=torch.float64), torch.tensor(step, dtype=torch.int64)
        return [A.adamw_update(p, g, m, v, lr=lr, step=step, out=None if out is None else out[i], **kw)
                for i, (p, g, m, v) in enumerate(zip(params, grads, ms, vs))]
    old_scalar = lambda x, f64: (x.reshape(()).to(**f64) if isinstance(x, torch.Tensor)  # noqa: E731
                                 else torch.tensor(float(x), **f64))
    with patched(A, "adamw_update_multi", per_leaf), patched(A, "_scalar_on", old_scalar):
        yield


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    """`obj.name = value` for the block, then the old value back."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)
