"""The effect-handler mechanism: primitives, the active stack, `bind`.

Code inside a step (the user's `train_step`, a model, an optimizer) calls a few dsfn
*primitives* for the things a transform may want to change. `bind(name, default, *args)`
runs primitive `name` through the handlers of the running Step's transforms, outermost
first, and finally `default` (what one process does). A transform handles primitive P
by defining `handle_P(self, call_next, *args)` (see `dsfn.transforms.core`).

This module is the bottom layer: it imports nothing else of dsfn, so every layer
(state, optimizers, models, transforms) can declare or call primitives without import
circles.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

_local = threading.local()


def active_stack() -> tuple[Any, ...]:
    """Transforms of the running Step, outermost first (empty outside a Step)."""
    return getattr(_local, "stack", ())


class _Activate:
    def __init__(self, stack: Sequence[Any]):
        self.stack = tuple(stack)

    def __enter__(self):
        self.prev = active_stack()
        _local.stack = self.prev + self.stack
        return self

    def __exit__(self, *exc):
        _local.stack = self.prev
        return False


def activate(stack: Sequence[Any]) -> _Activate:
    """Context manager: `stack`'s transforms handle primitives inside the block."""
    return _Activate(stack)


def bind(primitive: str, default: Callable[..., Any], *args: Any) -> Any:
    """Run `primitive` through the active handlers, outermost first, then `default`."""
    name = "handle_" + primitive
    handlers = [t for t in active_stack() if hasattr(t, name)]

    def call(i: int, *a: Any) -> Any:
        if i == len(handlers):
            return default(*a)
        return getattr(handlers[i], name)(lambda *b: call(i + 1, *b), *a)

    return call(0, *args)
