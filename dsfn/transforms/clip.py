"""`clip_grad_norm(max_norm)`: clip by the global gradient norm over all shards and axes.

The norm is the single-process one: a sharded gradient contributes its piece once per
shard axis, a replicated one once (dsfn.engines.grad_stats), so ZeRO stages 0-3 report the
same norm as the reference. Clipping follows torch's `clip_grad_norm_`: grads are
multiplied by min(1, max_norm / (norm + 1e-6)) (`dsfn.optim.clip.clip_coefficient`, the
rule `dsfn.optim.clip_by_global_norm` applies to updates inside an optimizer chain).
Inside `loss_scale`, unscaling is the same multiply: factor = (1/scale) * min(1, max_norm
/ (norm/scale + 1e-6)) — one pass, DeepSpeed's combined unscale-and-clip. The clip asks
for the factor the gradients still carry through the "grad_unscale" primitive
(`bind("grad_unscale", ...)`: loss_scale answers 1/scale while its update runs with the
unscale left to the clip; the default, None, means nothing is left to undo), so it reads
no other transform's attributes. Metric: `grad_norm` (unscaled, before clipping; NaN on a
step that `loss_scale` skipped for overflow, where no norm is computed).
"""
from __future__ import annotations

from typing import Any

import torch

from dsfn import tree
from dsfn.errors import ConfigError
from dsfn.optim.clip import clip_coefficient
from dsfn.transforms.core import Transform, bind, make_transform, scratch, with_role
from dsfn.engines.grad_stats import global_sq_norm


class ClipGradNorm(Transform):
    name = "clip_grad_norm"
    roles = frozenset({"clip"})

    def __init__(self, max_norm: float):
        if not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ConfigError(f"clip_grad_norm(max_norm={max_norm!r}): use a number > 0 "
                              "(leave the transform out to disable clipping)")
        self.max_norm = float(max_norm)

    def check_stack(self, stack, index):
        from dsfn.errors import StackError
        if with_role(stack[index + 1:], "loss_scale"):
            raise StackError("clip_grad_norm must sit inside loss_scale (it needs unscaled gradients): write "
                             "compose(..., loss_scale(), clip_grad_norm(max_norm))")

    def wrap_step(self, fn):
        def step(state, batch):
            scratch(self).norm = None      # a skipped update (overflow) computes no norm: reported as NaN
            return fn(state, batch)
        return step

    def handle_apply_gradients(self, call_next, state, grads):
        unscale = bind("grad_unscale", lambda: None)     # 1/scale an outer loss_scale left to this clip, or None
        inv = unscale.double() if unscale is not None else torch.ones((), dtype=torch.float64)
        norm = global_sq_norm(grads).sqrt() * inv
        scratch(self).norm = norm.float()
        factor = (inv * clip_coefficient(norm, self.max_norm)).float()
        leaves, spec = tree.flatten(grads)
        return call_next(state, tree.unflatten(
            spec, torch._foreach_mul(leaves, _to(factor, leaves[0].device)) if leaves else []))

    def handle_reduce_metrics(self, call_next, metrics):
        norm = getattr(scratch(self), "norm", None)
        norm = norm if norm is not None else torch.tensor(float("nan"))
        return call_next({**metrics, "grad_norm": norm.reshape(())})


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; non-blocking towards a device (a blocking copy syncs the stream), blocking
    towards the host (a non-blocking copy into pageable memory could be read before it lands)."""
    return t.to(device, non_blocking=device.type != "cpu")


def clip_grad_norm(*args: Any, **kwargs: Any) -> ClipGradNorm:
    """`clip_grad_norm(max_norm)`; see the module docstring."""
    return make_transform(ClipGradNorm, "clip_grad_norm", args, kwargs)
