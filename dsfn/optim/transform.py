"""Primitive gradient transformations; the aliases (`adamw`, `sgd`, ...) chain these.

Each primitive does one job and follows `torch.optim`'s arithmetic so that the chains in
`alias.py` match `torch.optim.{AdamW, Adam, SGD}`:

| primitive | update (per leaf) | state |
|---|---|---|
| `scale(f)` | `u * f` | none |
| `add_decayed_weights(wd)` | `u + wd * p` | none |
| `scale_by_adam(b1, b2, eps, amsgrad)` | `m_hat / (sqrt(v_hat) + eps)` | count, mu, nu (, nu_max) |
| `adam_step(lr, b1, b2, eps, wd, amsgrad)` | torch Adam(W)'s `p' - p` (fused, bitwise) | count, mu, nu (, nu_max), lr |
| `trace(momentum, dampening, nesterov)` | torch SGD's momentum buffer | count, trace |
| `scale_by_learning_rate(lr)` | `-lr * u` | count, lr |

Learning rates (`LearningRate`): a float, a schedule `f(count) -> float | Tensor` called
with the transform's 0-dim int64 `count` (= updates already applied; see
`dsfn.optim.schedules` for DeepSpeed's), or a tensor of shape () or (1,). A tensor lr is
used as is at every update (its device and dtype are kept; changing its value in place
between steps takes effect) and is the very object stored in the state.

Modules: learning rates in `dsfn.optim.learning_rate` (`LearningRate`, `lr_value`,
`scale_by_learning_rate`, `current_lr`), Adam in `dsfn.optim.adam_transform` (its fast
paths in `dsfn.optim.adam_paths`); all importable from here too.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from dsfn import tree
from dsfn.aliasing import writable
from dsfn.checks import check_real
from dsfn.errors import ConfigError, LeafTypeError
from dsfn.optim.adam_transform import AdamState, ScaleByAdamState, adam_step, scale_by_adam  # noqa: F401
from dsfn.optim.base import (  # noqa: F401  (flatten_like: public here too)
    EmptyState,
    GradientTransformation,
    PyTree,
    flatten_like,
    tensor_leaves,
    zero_count,
)
from dsfn.optim.learning_rate import (  # noqa: F401  (the learning rates: public here too)
    LearningRate,
    Schedule,
    ScaleByLearningRateState,
    check_learning_rate,
    current_lr,
    lr_record,
    lr_value,
    scale_by_learning_rate,
)


# ---------------------------------------------------------------------------------------
# stateless


def scale(factor: float) -> GradientTransformation:
    """`u -> u * factor` (`factor=-1` is an exact negation, torch's `maximize`)."""
    factor = check_real("scale(factor)", factor)

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree = None) -> tuple[PyTree, EmptyState]:
        u, spec = tensor_leaves(updates, "updates")
        if not u or factor == 1.0:
            return updates, state
        out = torch._foreach_neg(u) if factor == -1.0 else torch._foreach_mul(u, factor)
        return tree.unflatten(spec, out), state

    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: float = 0.0) -> GradientTransformation:
    """`u -> u + weight_decay * p` (torch's `grad.add(param, alpha=weight_decay)`).

    Before `scale_by_adam` it is Adam's L2 penalty; after it and before
    `scale_by_learning_rate` it is AdamW's decoupled decay `p * (1 - lr * wd)`.
    """
    wd = check_real("add_decayed_weights(weight_decay)", weight_decay, lo=0.0,
                    hint="; use 0 for no weight decay")

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree = None) -> tuple[PyTree, EmptyState]:
        if wd == 0.0:
            return updates, state
        if params is None:
            raise LeafTypeError("add_decayed_weights needs params: call update(grads, state, params)")
        u, spec = tensor_leaves(updates, "updates")
        if not u:
            return updates, state
        p = flatten_like(params, spec, "params")
        return tree.unflatten(spec, torch._foreach_add(u, p, alpha=wd)), state

    return GradientTransformation(init, update)


# ---------------------------------------------------------------------------------------
# SGD momentum


class TraceState(NamedTuple):
    """count: 0-dim int64 (updates made); trace: momentum buffers shaped like params."""
    count: torch.Tensor
    trace: PyTree


def trace(momentum: float, dampening: float = 0.0, nesterov: bool = False) -> GradientTransformation:
    """torch.optim.SGD's momentum buffer.

    First update (count 0): `buf = g` (a copy; torch's first-step rule, no dampening).
    Later: `buf = momentum * buf + (1 - dampening) * g`.
    Output: `g + momentum * buf` with nesterov, else `buf`.
    """
    momentum = check_real("trace(momentum)", momentum, lo=0.0, hint="; e.g. 0.9")
    dampening = check_real("trace(dampening)", dampening)
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ConfigError(f"nesterov=True needs momentum > 0 and dampening == 0 (got momentum={momentum}, "
                          f"dampening={dampening}); set nesterov=False or change them")

    def init(params: PyTree) -> TraceState:
        leaves, spec = tensor_leaves(params, "params")
        return TraceState(count=zero_count(), trace=tree.unflatten(spec, [torch.zeros_like(x) for x in leaves]))

    def update(updates: PyTree, state: TraceState, params: PyTree = None) -> tuple[PyTree, TraceState]:
        g, spec = tensor_leaves(updates, "updates")
        count = state.count + 1
        if not g:
            return updates, state._replace(count=count)
        buf = flatten_like(state.trace, spec, "trace state")
        in_place = writable(buf)                    # a donated step: the buffer is updated in place
        if int(state.count) == 0:
            if in_place:
                with torch.no_grad():
                    torch._foreach_copy_(buf, g)
            else:
                buf = [x.detach().clone() for x in g]   # a copy: the state must not alias the caller's grads
        else:
            if in_place:
                with torch.no_grad():
                    torch._foreach_mul_(buf, momentum)
            else:
                buf = torch._foreach_mul(buf, momentum)
            torch._foreach_add_(buf, g, alpha=1.0 - dampening)
        out = torch._foreach_add(g, buf, alpha=momentum) if nesterov else buf
        return tree.unflatten(spec, out), TraceState(count=count, trace=tree.unflatten(spec, buf))

    return GradientTransformation(init, update)
