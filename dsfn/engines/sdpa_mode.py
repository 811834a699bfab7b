"""`CausalSDPAMode`: a TorchFunctionMode that runs every causal, maskless
`F.scaled_dot_product_attention` call of a model's forward over a mesh axis (the AutoSP way:
the calls are found at run time, no tracing). Ulysses (`dsfn.engines.ulysses.UlyssesSDPA`)
and ring attention (`dsfn.engines.ring_attention.RingSDPA`) say what runs instead
(`attend`). Imports no transform."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from dsfn.errors import ConfigError

__all__ = ["CausalSDPAMode"]

_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class CausalSDPAMode(TorchFunctionMode):
    """Base: `who` names the transform in errors; subclasses define `attend(func, q, k, v, args)`."""

    who = "sequence_parallel"

    def __init__(self, axis: str):
        super().__init__()
        self.axis = axis
        self._inert = False
        self.calls = 0          # the sdpa calls run over the axis (none: the model's attention is not sdpa)

    def __enter__(self):
        # an instance of this kind for this axis on the mode stack already (a later forward of the
        # same step, whose set-up lives until backward: a pipeline's outstanding micro-batches):
        # this one stays off the stack, else the outer mode would run the inner one's attention twice
        self._inert = any(type(m) is type(self) and m.axis == self.axis for m in _get_current_function_mode_stack())
        return self if self._inert else super().__enter__()

    @property
    def inert(self) -> bool:
        """Whether this instance stayed off the mode stack (another of its kind runs the calls)."""
        return self._inert

    def __exit__(self, *exc):
        return False if self._inert else super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        a = {**dict(zip(_NAMES, args)), **kwargs}
        if a.get("attn_mask") is not None or not a.get("is_causal", False):
            raise ConfigError(f"{self.who}: an intercepted scaled_dot_product_attention call has an explicit mask or "
                              "is not causal; only causal attention without masks (is_causal=True) is run this way")
        self.calls += 1
        return self.attend(func, a["query"], a["key"], a["value"], a)

    def attend(self, func: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: dict) -> torch.Tensor:
        raise NotImplementedError
