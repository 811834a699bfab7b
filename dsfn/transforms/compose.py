"""`compose(*transforms)(train_step)` and the `Step` it returns.

`compose(a, b)(f) == a(b(f))`: `a` is outermost. A Step holds the user's pure
`train_step` and the stack (outermost first):

    step.place(state)   logical -> this rank's physical state (innermost transform first)
    step.gather(state)  physical -> logical (layouts on the leaves, then each transform's gather)
    step(state, batch)  -> (new_state, metrics)

Inside `step(state, batch)` the transforms are active (they handle primitives), each
transform's `wrap_step` wraps the function (the outermost runs first), and the metrics
go through the "reduce_metrics" primitive. Metrics come back as detached 0-dim tensors.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from dsfn import tree
from dsfn.errors import LeafTypeError, StackError
from dsfn.state.layout import gather_tree
from dsfn.transforms.core import Transform, activate, bind, check_stack

StepFn = Callable[[Any, Any], tuple[Any, dict]]


class Step:
    """A train step with a stack of transforms around it."""

    def __init__(self, fn: StepFn, stack: tuple[Transform, ...] = ()):
        if isinstance(fn, Step):
            stack, fn = tuple(stack) + fn.stack, fn.fn
        if not callable(fn):
            raise StackError(f"compose(...) must be applied to a train_step function, got {fn!r}")
        self.fn = fn
        self.stack = check_stack(stack)
        wrapped = self._call_inner
        for t in reversed(self.stack):   # the innermost wraps first, so the outermost runs first
            wrapped = t.wrap_step(wrapped)
        self._wrapped = wrapped

    def _call_inner(self, state: Any, batch: Any) -> tuple[Any, dict]:
        out = self.fn(state, batch)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
            raise StackError("train_step must return (new_state, metrics: dict); got "
                             f"{type(out).__name__}")
        return out

    def place(self, state: Any) -> Any:
        """Logical state -> this rank's physical state."""
        with activate(self.stack):
            for t in reversed(self.stack):
                state = t.place(state)
        return state

    def gather(self, state: Any) -> Any:
        """Physical state -> logical state (collective when leaves are sharded).

        The layouts on the leaves are gathered first; then each transform undoes the
        structural changes its `place` made, outermost first (the reverse of `place`).
        """
        state = gather_tree(state)
        with activate(self.stack):
            for t in self.stack:
                state = t.gather(state)
        return state

    def __call__(self, state: Any, batch: Any) -> tuple[Any, dict[str, torch.Tensor]]:
        _check_batch(batch)
        with activate(self.stack):
            new_state, metrics = self._wrapped(state, batch)
            metrics = _metrics_to_tensors(metrics, new_state)
            metrics = bind("reduce_metrics", lambda m: m, metrics)
        return new_state, metrics

    def __repr__(self) -> str:
        inner = getattr(self.fn, "__name__", repr(self.fn))
        for t in reversed(self.stack):
            inner = f"{t.describe()}({inner})"
        return f"Step[{inner}]"


def compose(*transforms: Transform) -> Callable[[StepFn], Step]:
    """`compose(a, b, c)(f) == a(b(c(f)))`; the stack is validated now, not at the first step."""
    stack = check_stack(transforms)

    def apply(fn: StepFn) -> Step:
        return Step(fn, stack)

    return apply


def _check_batch(batch: Any) -> None:
    for path, x in tree.leaves_with_path(batch):
        if not isinstance(x, torch.Tensor):
            raise LeafTypeError(f"batch leaf {path or '<root>'!r} is a {type(x).__name__}; every batch "
                                "leaf must be a torch.Tensor (convert with torch.as_tensor)")


def _metrics_to_tensors(metrics: dict, state: Any) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise LeafTypeError(f"metric {k!r} has shape {tuple(v.shape)}; metrics are scalars")
            out[k] = v.detach().reshape(())
        elif isinstance(v, (int, float, bool)):
            out[k] = torch.tensor(float(v))
        else:
            raise LeafTypeError(f"metric {k!r} is a {type(v).__name__}; metrics are scalars or 0-dim tensors")
    opt_state = getattr(state, "opt_state", None)
    if "lr" not in out and opt_state is not None:
        from dsfn.optim import current_lr
        lr = current_lr(opt_state)
        if lr is not None:
            out["lr"] = lr.detach().reshape(()).clone()
    return out
