"""Where a sequence-parallel rank's position_ids go: whether a model's forward takes them
(`takes`), the wrapped Hugging Face models a **kwargs forward passes them on to
(`passed_on`: peft's inner model), and the proof that they reached one (`PositionsWatch`,
heard through sequence parallel's "run_unit" handler). Machinery of
`dsfn.transforms.sequence_parallel`; imports no transform.
"""
from __future__ import annotations

import inspect
from typing import Any

from dsfn.adapters import adapter_for
from dsfn.errors import ConfigError

__all__ = ["PositionsWatch", "document_ids", "passed_on", "takes"]


def document_ids(position_ids: Any) -> Any:
    """[b, T] each position's document in rows of packed sequences: a new document starts where
    a position id is not its predecessor + 1 (HF's `find_packed_sequence_indices`); 0 throughout
    a row holding one document."""
    import torch
    diff = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (diff != 1).long().cumsum(-1)


def takes(module: Any, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def passed_on(module: Any, name: str) -> list:
    """The wrapped Hugging Face models (the adapter's `loss_modules`: peft's inner
    LlamaForCausalLM, a user's wrapper's) whose forward takes `name`, when `module`'s forward
    takes no `name` but passes **kwargs on (peft's PeftModelForCausalLM.forward(..., **kwargs));
    else []."""
    adapter = adapter_for(module)
    if adapter is None:
        return []
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return []
    return [m for m in adapter.loss_modules(module) if m is not module and takes(m, name)]


class PositionsWatch:
    """The proof that the position_ids passed through a model's **kwargs reached one of the
    `inner` models' forward (a wrapper may drop them: its tokens would count from 0). Heard
    through sequence parallel's "run_unit" handler (phase "pre" of each inner model) while
    the forward runs; `check()` after it."""

    def __init__(self, module: Any, inner: list, positions: Any):
        self.module, self.inner, self.positions = module, inner, positions
        self.seen = False

    def hear(self, kwargs: dict) -> None:
        if kwargs.get("position_ids") is self.positions:
            self.seen = True

    def check(self) -> None:
        if not self.seen:
            raise ConfigError(f"sequence_parallel: {type(self.module).__name__}.forward takes no position_ids, and "
                              "the position_ids dsfn passed through its **kwargs did not reach "
                              f"{', '.join(type(m).__name__ for m in self.inner)}.forward, which would number this "
                              "rank's tokens from 0 instead of by their place in the sequence. Pass **kwargs (or "
                              "position_ids) on to the model, or give the forward a position_ids argument")
