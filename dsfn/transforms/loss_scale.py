"""`loss_scale()`: fp16 loss scaling with DeepSpeed's dynamic semantics.

The differentiated loss is multiplied by the current scale; at the update, gradients are
checked for inf/NaN on every rank and the verdict is agreed over every mesh axis
(all-reduce max), so all ranks skip together. On overflow the step is skipped — params,
optimizer state and `state.step` are returned untouched, so no NaN reaches a moment —
and the scale follows DeepSpeed's `DynamicLossScaler.update_scale`:

- overflow: if the hysteresis budget is 1 (or `hysteresis == 1`): scale = max(scale / 2,
  min_scale), raising `LossScaleError` when the scale is already at `min_scale`;
  otherwise spend one unit of hysteresis. Record the overflow iteration.
- clean step: (`consecutive_hysteresis`: refill hysteresis); with
  `stable = cur_iter - last_overflow_iter - 1`, if stable > 0 and stable % window == 0:
  scale *= 2 (and refill hysteresis).
- `cur_iter` counts every step, skipped or not.
Defaults: init_scale 2**16, window 1000, hysteresis 2, min_scale 1. A static scale
(`static=S`) multiplies by S and never changes (overflowed steps are still skipped); the
dynamic options (init_scale, window, hysteresis, min_scale, consecutive_hysteresis) are then
a ConfigError unless left at their defaults.

Unscaling is folded into one multiply with gradient clipping when `clip_grad_norm` sits
inside this transform (a stack fact: a transform with the "clip" role inside); otherwise
it multiplies by 1/scale itself. The clip learns the factor the gradients still carry
through the "grad_unscale" primitive (no arguments; default None: nothing left to undo),
which this transform answers with 1/scale while its update runs with the unscale left to
the clip. A primitive rather than an attribute read: clip_grad_norm reads no other
transform, and any transform that defers a scale can answer it. The scale state lives in
`state.extra["loss_scale"]` (so checkpoints carry it). Metrics: `loss_scale`, `skipped`
(1.0 on a skipped step).
"""
from __future__ import annotations

from typing import Any

import torch

from dsfn import tree
from dsfn.errors import ConfigError, DsfnError
from dsfn.transforms.core import Transform, make_transform, scratch
from dsfn.transforms.facts import stack_facts
from dsfn.engines.grad_stats import any_nonfinite_everywhere

KEY = "loss_scale"


class LossScaleError(DsfnError, RuntimeError):
    """Overflow persists at the minimum loss scale."""


@tree.dataclass
class LossScaleState:
    scale: torch.Tensor               # float32 0-dim
    cur_iter: torch.Tensor            # int64 0-dim
    last_overflow_iter: torch.Tensor  # int64 0-dim
    hysteresis: torch.Tensor          # int64 0-dim: overflows still absorbed before halving


class LossScale(Transform):
    name = "loss_scale"
    roles = frozenset({"loss_scale"})

    def __init__(self, init_scale: float = 2.0 ** 16, window: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0, static: float | None = None, consecutive_hysteresis: bool = False):
        if static is not None and not (isinstance(static, (int, float)) and static > 0):
            raise ConfigError(f"loss_scale(static={static!r}): a static scale is a number > 0")
        if not (isinstance(init_scale, (int, float)) and init_scale > 0):
            raise ConfigError(f"loss_scale(init_scale={init_scale!r}): use a number > 0, e.g. 2**16")
        if not isinstance(window, int) or window < 1:
            raise ConfigError(f"loss_scale(window={window!r}): the scale window is a step count >= 1")
        if not isinstance(hysteresis, int) or hysteresis < 1:
            raise ConfigError(f"loss_scale(hysteresis={hysteresis!r}): hysteresis is an int >= 1 (1 = halve at "
                              "the first overflow)")
        if static is not None:
            # a static scale never changes: the dynamic options would be accepted and do nothing
            given = {k: v for k, v, default in (("init_scale", init_scale, 2.0 ** 16), ("window", window, 1000),
                                                ("hysteresis", hysteresis, 2), ("min_scale", min_scale, 1.0),
                                                ("consecutive_hysteresis", consecutive_hysteresis, False))
                     if v != default}
            if given:
                opts = ", ".join(f"{k}={v!r}" for k, v in given.items())
                raise ConfigError(f"loss_scale(static={static!r}, {opts}): a static scale is the scale of every step "
                                  f"and never changes, so {', '.join(given)} would do nothing; drop "
                                  f"{'it' if len(given) == 1 else 'them'}, or drop static= for a dynamic scale")
        elif not (isinstance(min_scale, (int, float)) and 0 < min_scale <= init_scale):
            raise ConfigError(f"loss_scale(min_scale={min_scale!r}): use 0 < min_scale <= init_scale")
        self.init_scale = float(static if static is not None else init_scale)
        self.window, self.hysteresis, self.min_scale = window, hysteresis, float(min_scale)
        self.static = static is not None
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        # per step (the Step's scratch): the scale in force, whether the update was skipped, the
        # unscale left to an inner clip while this update runs (answered to "grad_unscale")

    def initial_state(self) -> LossScaleState:
        i64 = lambda v: torch.tensor(v, dtype=torch.int64)
        return LossScaleState(torch.tensor(self.init_scale, dtype=torch.float32), i64(0), i64(-1),
                              i64(self.hysteresis))

    def place(self, state: Any) -> Any:
        if KEY in state.extra:
            return state
        return state.replace(extra={**state.extra, KEY: self.initial_state()})

    def wrap_step(self, fn):
        def step(state, batch):
            if KEY not in state.extra:
                raise ConfigError("loss_scale: the state has no loss-scale entry; call step.place(state) first")
            scratch(self).scale = state.extra[KEY].scale
            return fn(state, batch)
        return step

    def handle_value_and_grad(self, call_next, fn, params, args, kwargs, has_aux):
        scale = scratch(self).scale

        def scaled(p, *a, **k):
            # scale in float32: an fp16 loss times 2**16 would itself overflow, while the
            # backward still runs through the fp16 graph
            out = fn(p, *a, **k)
            return (out[0].float() * scale, out[1]) if has_aux else out.float() * scale
        value, grads = call_next(scaled, params, args, kwargs, has_aux)
        if has_aux:
            return (value[0] / scale, value[1]), grads
        return value / scale, grads

    def speculative_grad(self, state):
        """Unscaling by the step's scale (known at its start); an overflow skips the update, so a
        speculation made from it is simply never used. With clipping inside, the unscale is folded
        into the clip (which needs the global norm): None."""
        if self._clip_inside() or KEY not in getattr(state, "extra", {}):
            return None
        inv = (1.0 / state.extra[KEY].scale.double()).float()
        return lambda g: torch.mul(g, inv.to(g.device, non_blocking=True))   # elementwise as the _foreach_mul below

    def handle_apply_gradients(self, call_next, state, grads):
        ls: LossScaleState = state.extra[KEY]
        overflow = any_nonfinite_everywhere(grads)
        new_ls = self.updated(ls, overflow)
        notes = scratch(self)
        notes.skipped = overflow
        notes.scale = new_ls.scale
        if overflow:
            return state.replace(extra={**state.extra, KEY: new_ls})
        inv = (1.0 / ls.scale.double()).float()
        if self._clip_inside():
            notes.pending_unscale = inv
            try:
                new = call_next(state, grads)
            finally:
                notes.pending_unscale = None
        else:
            leaves, spec = tree.flatten(grads)
            new = call_next(state, tree.unflatten(
                spec, torch._foreach_mul(leaves, inv.to(leaves[0].device, non_blocking=True)) if leaves else []))
        return new.replace(extra={**new.extra, KEY: new_ls})

    def handle_grad_unscale(self, call_next):
        """The factor (1/scale, float32 0-dim) the gradients on their way to the update still
        carry, while this transform's update runs with the unscale left to a clip inside it."""
        pending = getattr(scratch(self), "pending_unscale", None)
        return pending if pending is not None else call_next()

    def _clip_inside(self) -> bool:
        """Whether a transform with the "clip" role sits inside this one (a stack fact)."""
        return stack_facts(self).inside(self).has_role("clip")

    def updated(self, ls: LossScaleState, overflow: bool) -> LossScaleState:
        """DeepSpeed's DynamicLossScaler.update_scale, on tensors (see module docstring)."""
        scale, hyst = float(ls.scale), int(ls.hysteresis)
        cur, last = int(ls.cur_iter), int(ls.last_overflow_iter)
        if self.static:
            pass
        elif overflow:
            if self.hysteresis == 1 or hyst == 1:
                if scale == self.min_scale:
                    raise LossScaleError(f"gradient overflow persists at the minimum loss scale {self.min_scale}: "
                                         "the loss or gradients are inf/NaN even unscaled. Lower the learning "
                                         "rate, check the data, or use bf16 (mixed_precision(torch.bfloat16)) "
                                         "which needs no loss scaling")
                scale = max(scale / 2.0, self.min_scale)
            else:
                hyst -= 1
            last = cur
        else:
            if self.consecutive_hysteresis:
                hyst = self.hysteresis
            stable = cur - last - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    hyst = self.hysteresis
                scale *= 2.0
        if self.static and overflow:
            last = cur
        i64 = lambda v: torch.tensor(v, dtype=torch.int64)
        return LossScaleState(torch.tensor(scale, dtype=torch.float32), i64(cur + 1), i64(last), i64(hyst))

    def handle_reduce_metrics(self, call_next, metrics):
        metrics = dict(metrics)
        notes = scratch(self)
        scale = getattr(notes, "scale", None)
        if scale is not None:
            metrics["loss_scale"] = scale.detach().float().reshape(())
        metrics["skipped"] = torch.tensor(1.0 if getattr(notes, "skipped", False) else 0.0)
        return call_next(metrics)


def loss_scale(*args: Any, **kwargs: Any) -> LossScale:
    """`loss_scale(init_scale=2**16, window=1000, hysteresis=2, min_scale=1.0, static=None,
    consecutive_hysteresis=False)`; see the module docstring."""
    return make_transform(LossScale, "loss_scale", args, kwargs)
