"""Hugging Face transformers integration: Ulysses attention for HF models.

`ulysses_attention(model, axis)` is a context: while it is active the model's attention
implementation (`config._attn_implementation`) is "dsfn_ulysses", registered with
transformers' `AttentionInterface` (and a mask function that builds no mask: the causal
mask is over the whole sequence, which no rank's slice can describe; "dsfn_ulysses"
builds it after the all-to-all, over all T, with the layer's sliding window if any). "dsfn_ulysses"
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
    window = kwargs.get("sliding_window")        # this layer's window (Mistral, Gemma2's sliding layers)
    windowed = window is not None and window < t
    if windowed and impl not in (None, "eager", "sdpa") and not str(impl).startswith("flash_attention"):
        raise ConfigError(f"sequence_parallel: {type(module).__name__} has a sliding window ({window}) and attention "
                          f"implementation {impl!r}; dsfn's Ulysses attention applies the window over the whole "
                          "sequence for 'eager', 'sdpa' and flash attention only")
    if impl in (None, "eager") or (impl == "sdpa" and windowed):
        # the model's mask over the whole sequence: causal, and within the window (HF's
        # sliding_window_overlay: kv > q - window); eager adds it to the scores, sdpa takes
        # it as a boolean mask. (Flash attention gets sliding_window itself, over all T.)
        i = torch.arange(t, device=q.device)
        allowed = i[None, :] <= i[:, None]
        if windowed:
            allowed = allowed & (i[None, :] > i[:, None] - window)
        if impl == "sdpa":
            mask = allowed[None, None]
        else:
            mask = torch.zeros((t, t), dtype=q.dtype, device=q.device).masked_fill(
                ~allowed, torch.finfo(q.dtype).min)[None, None]
    kwargs = {k_: v_ for k_, v_ in kwargs.items() if k_ not in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                                                                 "labels", "shift_labels", "num_items_in_batch")}
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


def _labels_passed(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    import inspect
    if kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None:
        return True
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return bool(args)        # cannot tell: a positional argument may be the labels
    return bound.arguments.get("labels") is not None


@contextlib.contextmanager
def own_loss(model: nn.Module, make_loss, args: tuple, kwargs: dict) -> Iterator[None]:
    """While the model runs under sequence parallelism, its `loss_function` is
    `make_loss(inner, model)` (dsfn.transforms.sequence_parallel: labels shifted over the whole
    sequence, normalised over the group), where `inner` is HF's `ForCausalLMLoss`. A model
    given labels whose loss is anything else, or that computes its loss without
    `loss_function`, is an error: its loss would be over this rank's slice only."""
    if not _labels_passed(model, args, kwargs):
        yield
        return
    from transformers.loss.loss_utils import LOSS_MAPPING
    causal = LOSS_MAPPING["ForCausalLM"]
    name = type(model).__name__
    current = getattr(model, "loss_function", None)
    if current is not causal:
        raise ConfigError(f"sequence_parallel: {name} was given labels and its loss_function is "
                          f"{getattr(current, '__name__', current)!r}; under sequence parallelism dsfn can make only "
                          "HF's causal-LM loss (ForCausalLMLoss) exact over the whole sequence. Compute the loss "
                          "in the train step from the logits instead (the transform weights it by token count)")
    calls = []

    def loss(*a: Any, **k: Any) -> torch.Tensor:
        calls.append(1)
        return make_loss(causal, model)(*a, **k)
    had = "_loss_function" in model.__dict__
    saved = model.__dict__.get("_loss_function")
    model._loss_function = loss
    try:
        yield
    finally:
        if had:
            model._loss_function = saved
        else:
            del model._loss_function
    if not calls:
        raise ConfigError(f"sequence_parallel: {name} was given labels but did not compute its loss with its "
                          "loss_function, so dsfn cannot shift them over the whole sequence: its loss would be over "
                          "this rank's slice only. Compute the loss in the train step from the logits instead")
