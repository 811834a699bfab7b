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
from types import SimpleNamespace
from typing import Any, Callable, Sequence

_local = threading.local()


def active_stack() -> tuple[Any, ...]:
    """Transforms of the running Step, outermost first (empty outside a Step)."""
    return getattr(_local, "stack", ())


def active_segments() -> tuple["_Activate", ...]:
    """The active blocks, innermost first: each has `.stack` and `.facts` (the stack's
    facts, dsfn.transforms.facts; None until derived)."""
    return getattr(_local, "segments", ())


class _Activate:
    def __init__(self, stack: Sequence[Any], facts: Any = None):
        self.stack = tuple(stack)
        self.facts = facts
        self.scratch: dict[int, SimpleNamespace] | None = None    # id(transform) -> its scratch here

    def __enter__(self):
        self.prev = active_stack()
        self.prev_segments = active_segments()
        _local.stack = self.prev + self.stack
        _local.segments = (self,) + self.prev_segments
        return self

    def __exit__(self, *exc):
        _local.stack = self.prev
        _local.segments = self.prev_segments
        return False


def activate(stack: Sequence[Any], facts: Any = None) -> _Activate:
    """Context manager: `stack`'s transforms handle primitives inside the block; `facts` is
    what the stack implies (a Step passes its own; else derived when first asked for)."""
    return _Activate(stack, facts)


def scratch(owner: Any) -> SimpleNamespace:
    """`owner`'s scratch for the block running it (a Step's call: one step): a namespace made
    at the first ask and dropped when the block exits. What a transform notes during a step
    (the norm it measured, a batch's positions, the running stage) lives here, not on the
    transform object, so one object in two stacks, or in the next step, starts clean."""
    for seg in active_segments():
        for t in seg.stack:
            if t is owner:
                if seg.scratch is None:
                    seg.scratch = {}
                ns = seg.scratch.get(id(owner))
                if ns is None:
                    ns = seg.scratch[id(owner)] = SimpleNamespace()
                return ns
    raise RuntimeError(f"dsfn internal error: scratch({type(owner).__name__}) asked outside a block running it")


def bind(primitive: str, default: Callable[..., Any], *args: Any) -> Any:
    """Run `primitive` through the active handlers, outermost first, then `default`."""
    name = "handle_" + primitive
    handlers = [t for t in active_stack() if hasattr(t, name)]

    def call(i: int, *a: Any) -> Any:
        if i == len(handlers):
            return default(*a)
        return getattr(handlers[i], name)(lambda *b: call(i + 1, *b), *a)

    return call(0, *args)
