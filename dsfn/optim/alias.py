"""Optimizers as chains of primitives, matching `torch.optim.{AdamW, Adam, SGD}`.

Every alias is a chain whose state is the tuple of its stages' states, with one layout
for every choice of flags (unused stages are stateless), so a checkpoint's tree does not
depend on e.g. `maximize`. The last stage applies the lr and records it (`current_lr`).

Numerics: `adamw`/`adam` end in `adam_step`, which reproduces torch's arithmetic, so
parameters equal torch's bitwise except where a step carries a parameter across or
near zero (then within an ulp of the values involved). `sgd` builds `-lr * buf` and
adds it; torch fuses `p - lr * buf` into one FMA, so it may differ by an ulp per step.
"""
from __future__ import annotations

from typing import Sequence

from dsfn.checks import check_real
from dsfn.errors import ConfigError
from dsfn.optim._foreach import check_betas
from dsfn.optim.base import GradientTransformation, chain, identity
from dsfn.optim.transform import (LearningRate, adam_step, add_decayed_weights, check_learning_rate, scale,
                                  scale_by_learning_rate, trace)


def _sign(maximize: bool) -> GradientTransformation:
    # torch negates the gradient before anything else (weight decay included)
    return scale(-1.0) if maximize else identity()


def adamw(lr: LearningRate, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.01, amsgrad: bool = False, maximize: bool = False) -> GradientTransformation:
    """`torch.optim.AdamW`: decoupled weight decay, bias-corrected moments.

    Per leaf, with t = count + 1: `p <- p * (1 - lr*wd) - (lr / bc1) * m / (sqrt(v)/sqrt(bc2) + eps)`.
    State: `(EmptyState, AdamState)` (maximize, then `adam_step`).
    """
    check_learning_rate(lr, "adamw")
    b1, b2 = check_betas(betas, "adamw")
    eps = check_real("adamw(eps)", eps, lo=0.0, hint="; e.g. 1e-8")
    wd = check_real("adamw(weight_decay)", weight_decay, lo=0.0, hint="; use 0 for no weight decay")
    return chain(_sign(maximize), adam_step(lr, b1, b2, eps, wd, amsgrad))


def adam(lr: LearningRate, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0, amsgrad: bool = False, maximize: bool = False) -> GradientTransformation:
    """`torch.optim.Adam`: L2 weight decay (`g + wd * p`) added to the gradient before the moments.

    State: `(EmptyState, EmptyState, AdamState)` (maximize, L2 term, `adam_step`).
    """
    check_learning_rate(lr, "adam")
    b1, b2 = check_betas(betas, "adam")
    eps = check_real("adam(eps)", eps, lo=0.0, hint="; e.g. 1e-8")
    wd = check_real("adam(weight_decay)", weight_decay, lo=0.0, hint="; use 0 for no weight decay")
    return chain(_sign(maximize), add_decayed_weights(wd), adam_step(lr, b1, b2, eps, 0.0, amsgrad))


def sgd(lr: LearningRate, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
        weight_decay: float = 0.0, maximize: bool = False) -> GradientTransformation:
    """`torch.optim.SGD`, including its first-step rule (the momentum buffer starts as the gradient).

    State: `(EmptyState, EmptyState, TraceState | EmptyState, ScaleByLearningRateState)`
    (maximize, L2 term, momentum, lr); no momentum buffers are kept when momentum == 0.
    """
    check_learning_rate(lr, "sgd")
    momentum = check_real("sgd(momentum)", momentum, lo=0.0, hint="; e.g. 0.9, or 0 for plain SGD")
    dampening = check_real("sgd(dampening)", dampening)
    wd = check_real("sgd(weight_decay)", weight_decay, lo=0.0, hint="; use 0 for no weight decay")
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ConfigError(f"sgd(nesterov=True) needs momentum > 0 and dampening == 0 (got momentum={momentum}, "
                          f"dampening={dampening}); set nesterov=False or change them")
    mom = trace(momentum, dampening, nesterov) if momentum != 0.0 else identity()
    return chain(_sign(maximize), add_decayed_weights(wd), mom, scale_by_learning_rate(lr))
