"""Learning rates: the `LearningRate` forms, their checks and values, and `scale_by_learning_rate`.

A `LearningRate` is a float, a schedule `f(count) -> float | Tensor` called with the
transform's 0-dim int64 `count` (= updates already applied; see `dsfn.optim.schedules`
for DeepSpeed's), or a tensor of shape () or (1,). A tensor lr is used as is at every
update (its device and dtype are kept; changing its value in place between steps takes
effect) and is the very object stored in the state. `current_lr(opt_state)` reads the lr
an lr-applying transform recorded in its state.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Union

import torch

from dsfn import tree
from dsfn.checks import check_real
from dsfn.errors import ConfigError, LeafTypeError
from dsfn.optim._foreach import mul_scalar
from dsfn.optim.base import GradientTransformation, PyTree, tensor_leaves, zero_count

__all__ = ["LearningRate", "Schedule", "ScaleByLearningRateState", "check_learning_rate", "current_lr", "lr_record",
           "lr_value", "scale_by_learning_rate"]

Schedule = Callable[[torch.Tensor], float | torch.Tensor]
LearningRate = Union[float, torch.Tensor, Schedule]


def check_learning_rate(lr: Any, who: str) -> None:
    """ConfigError unless `lr` is a float >= 0, a schedule, or a 1-element float tensor."""
    if isinstance(lr, torch.Tensor):
        if lr.dim() > 1 or lr.numel() != 1:
            raise ConfigError(f"{who}(lr=tensor of shape {tuple(lr.shape)}): a tensor lr must have shape () "
                              "or (1,)")
        if not lr.is_floating_point():
            raise ConfigError(f"{who}(lr=tensor of dtype {lr.dtype}): a tensor lr must be floating point, e.g. "
                              "torch.tensor(1e-3, dtype=torch.float64)")
        if lr.device.type == "cpu" and not bool(lr.reshape(()) >= 0):   # no host sync for device lrs
            raise ConfigError(f"{who}(lr={lr.item()!r}): the learning rate must be >= 0")
        return
    if callable(lr):
        return
    check_real(f"{who}(lr)", lr, lo=0.0, hint="; pass a learning rate >= 0, a schedule (e.g. "
               "dsfn.optim.schedules.WarmupLR(...)) or a 1-element tensor")


def lr_value(lr: LearningRate, count: torch.Tensor) -> float | torch.Tensor:
    if isinstance(lr, torch.Tensor):
        return lr
    if callable(lr):
        v = lr(count)
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise LeafTypeError(f"the lr schedule returned a tensor of shape {tuple(v.shape)}; "
                                    "return a float or a 1-element tensor")
            return v
        return float(v)
    return float(lr)


def lr_record(v: float | torch.Tensor) -> torch.Tensor:
    return v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64)


class ScaleByLearningRateState(NamedTuple):
    """count: 0-dim int64 (updates made); lr: the lr of the last update (before the first
    update: the lr the first one will use). A tensor lr is stored as the same object; a
    float lr as a 0-dim float64 CPU tensor. `current_lr` finds this field."""
    count: torch.Tensor
    lr: torch.Tensor


def scale_by_learning_rate(lr: LearningRate, *, flip_sign: bool = True) -> GradientTransformation:
    """`u -> -lr * u` (or `lr * u` with flip_sign=False); lr resolved at each update.

    The lr used by the update at count c is `lr(c)` for a schedule; the state records it.
    """
    check_learning_rate(lr, "scale_by_learning_rate")
    sign = -1.0 if flip_sign else 1.0

    def init(params: PyTree) -> ScaleByLearningRateState:
        count = zero_count()
        return ScaleByLearningRateState(count=count, lr=lr_record(lr_value(lr, count)))

    def update(updates: PyTree, state: ScaleByLearningRateState,
               params: PyTree = None) -> tuple[PyTree, ScaleByLearningRateState]:
        u, spec = tensor_leaves(updates, "updates")
        v = lr_value(lr, state.count)
        new = ScaleByLearningRateState(count=state.count + 1, lr=lr_record(v))
        if not u:
            return updates, new
        if isinstance(v, torch.Tensor):
            factor = torch.neg(v.reshape(())) if flip_sign else v   # stays a tensor: no host sync
        else:
            factor = sign * v
        return tree.unflatten(spec, mul_scalar(u, factor, promote=False)), new

    return GradientTransformation(init, update)


def _is_lr_state(x: Any) -> bool:
    """A state node (NamedTuple or dataclass) with a tensor field `lr`: the protocol by which
    any lr-applying transform (ours, or e.g. a Muon step) reports its lr to `current_lr`."""
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return "lr" in x._fields and isinstance(x.lr, torch.Tensor)
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and isinstance(getattr(x, "lr", None), torch.Tensor)


def current_lr(opt_state: PyTree) -> torch.Tensor | None:
    """The `lr` of the first lr-recording state node in `opt_state` (flatten order), or None.

    Lr-recording nodes are NamedTuples/dataclasses with a tensor field `lr`
    (`ScaleByLearningRateState`, `AdamState`). Used for the `lr` step metric; with several
    learning rates (e.g. `partition`) it is the first one's.
    """
    for node in tree.leaves(opt_state, is_leaf=_is_lr_state):
        if _is_lr_state(node):
            return node.lr
    return None
