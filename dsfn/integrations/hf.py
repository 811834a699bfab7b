"""Hugging Face transformers integration: Ulysses attention for HF models.

`ulysses_attention(model, axis)` is a context: while it is active the model's attention
implementation (`config._attn_implementation`) is "dsfn_ulysses", registered with
transformers' `AttentionInterface` (and a mask function that builds no mask: the causal
mask is over the whole sequence, which no rank's slice can describe). "dsfn_ulysses"
turns q, k, v [B, H, T/sp, d] into [B, H/sp, T, d] (all-to-all over `axis`), calls the
model's own implementation — sdpa (causal flag), eager (an explicit causal mask; keeps
e.g. Gemma2's logit soft-capping), flash_attention_2/3 when installed — and turns the
output back. `dsfn.transforms.sequence_parallel` enters it around every forward, so an
HF model trains under sequence parallelism unchanged.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dsfn.errors import ConfigError

NAME = "dsfn_ulysses"
_AXIS: list[str] = []          # the sp axis of the active context (innermost last)
_INNER: list[str] = []         # the model's own implementation, to call on full sequences


def is_hf_model(module: Any) -> bool:
    cfg = getattr(module, "config", None)
    return isinstance(module, nn.Module) and hasattr(cfg, "_attn_implementation_internal")


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, _ulysses_forward)
        AttentionMaskInterface.register(NAME, _no_mask)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def _inner_forward(module: nn.Module, impl: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if impl in (None, "eager"):
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(impl, None)


def _ulysses_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF attention signature: q [B, H, T/sp, d], k/v [B, Hkv, T/sp, d] -> ([B, T/sp, H, d], None)."""
    from dsfn.runtime.mesh import current_mesh
    from dsfn.transforms.sequence_parallel import check_heads, heads_to_seq, seq_to_heads
    axis, impl = _AXIS[-1], _INNER[-1]
    n = current_mesh().size(axis)
    check_heads(query.shape[1], key.shape[1], n, type(module).__name__)
    q, k, v = (seq_to_heads(t, axis) for t in (query, key, value))
    t = q.shape[2]
    mask = None
    if impl in (None, "eager"):       # eager adds the mask to the scores: a causal one over all T
        mask = torch.full((t, t), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device).triu(1)[None, None]
    kwargs = {k_: v_ for k_, v_ in kwargs.items() if k_ not in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k")}
    out, _ = _inner_forward(module, impl)(module, q, k, v, mask, **kwargs)      # [B, T, H/sp, d]
    out = heads_to_seq(out.transpose(1, 2).contiguous(), axis)                  # [B, H, T/sp, d]
    return out.transpose(1, 2), None


@contextlib.contextmanager
def ulysses_attention(model: nn.Module, axis: str) -> Iterator[None]:
    """Make `model` (and its sub-configs) use Ulysses attention over `axis` inside the context."""
    _register()
    configs = [c for c in {id(m.config): m.config for m in model.modules()
                           if hasattr(getattr(m, "config", None), "_attn_implementation_internal")}.values()]
    saved = [c._attn_implementation_internal for c in configs]
    inner = {s if not isinstance(s, dict) else None for s in saved}
    if len(inner) != 1:
        raise ConfigError(f"sequence_parallel: the model's sub-configs use different attention implementations "
                          f"{saved}; Ulysses wraps one. Load the model with a single attn_implementation "
                          "(e.g. 'sdpa' for all parts)")
    _AXIS.append(axis)
    _INNER.append(inner.pop())
    try:
        for c in configs:
            c._attn_implementation_internal = NAME
        yield
    finally:
        for c, s in zip(configs, saved):
            c._attn_implementation_internal = s
        _AXIS.pop()
        _INNER.pop()
