"""Ring attention for Hugging Face models: the "dsfn_ring" attention implementation.

`ring_attention_context(model, axis, positions, documents)` is a context: while it is active
the model's attention implementation (`config._attn_implementation`, every sub-config's) is
"dsfn_ring", registered with transformers' `AttentionInterface` together with a mask
function that builds no mask (no rank's chunks can describe the whole sequence's mask).
"dsfn_ring" takes HF's q [B, H, T, d], k / v [B, Hkv, T, d] and runs
`dsfn.engines.ring_attention.ring_attention` over `axis`: causal over the global
`positions`, the layer's `sliding_window` (HF's: a key is seen while q - k < window), the
documents of packed rows and padding (`documents`, from the whole batch's position_ids and
attention_mask), the layer's `scaling`. Grouped-query heads stay Hkv on the wire. Refused
(ConfigError): attention logit soft-capping (Gemma2's `softcap`), attention dropout while
training, chunked attention. `dsfn.transforms.context_parallel` enters it around every forward.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dsfn.errors import ConfigError
from dsfn.integrations.hf import detect

NAME = "dsfn_ring"
detect.MASKS_ITSELF.add(NAME)
_ACTIVE: list[tuple[str, torch.Tensor, torch.Tensor | None, Any]] = []   # (axis, positions, documents, record)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, _ring_forward)
        AttentionMaskInterface.register(NAME, lambda *a, **k: None)


def _ring_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                  sliding_window: int | None = None, softcap: float | None = None, **kwargs: Any):
    """HF attention signature -> ([B, T, H, d], None)."""
    from dsfn.engines.ring_attention import ring_attention
    axis, positions, documents, record = _ACTIVE[-1]
    name = type(module).__name__
    if softcap:
        raise ConfigError(f"context_parallel: {name} soft-caps its attention logits (softcap={softcap}), which ring "
                          "attention does not; use sequence_parallel() (Ulysses) for this model")
    if dropout and module.training:
        raise ConfigError(f"context_parallel: {name} has attention dropout {dropout}; ring attention has none: set "
                          "the model's attention_dropout to 0")
    out = ring_attention(query, key, value, axis, positions.to(query.device),
                         None if documents is None else documents.to(query.device), causal=True,
                         window=sliding_window, scale=scaling, record=record)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def ring_attention_context(model: nn.Module, axis: str, positions: torch.Tensor,
                           documents: torch.Tensor | None = None, record: Any = None) -> Iterator[None]:
    """Make `model` (and its sub-configs) use ring attention over `axis` inside the context
    (`record`: each call's `RingCall`, see `ring_attention`)."""
    _register()
    configs = detect.attention_configs(model, "context_parallel")
    _ACTIVE.append((axis, positions, documents, record))
    try:
        with detect.attention_implementation(configs, NAME):
            yield
    finally:
        _ACTIVE.pop()
