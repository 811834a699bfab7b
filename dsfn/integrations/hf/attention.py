"""Ulysses attention for Hugging Face models: the "dsfn_ulysses" attention implementation.

`ulysses_attention(model, axis)` is a context: while it is active the model's attention
implementation (`config._attn_implementation`) is "dsfn_ulysses", registered with
transformers' `AttentionInterface` (and a mask function that builds no mask: the causal
mask is over the whole sequence, which no rank's slice can describe; "dsfn_ulysses"
builds it after the all-to-all, over all T, with the layer's sliding window if any). "dsfn_ulysses"
turns q, k, v [B, H, T/sp, d] into [B, H/sp, T, d] (all-to-all over `axis`), calls the
model's own implementation — sdpa (causal flag), eager (an explicit causal mask; keeps
e.g. Gemma2's logit soft-capping), flash_attention_2/3 when installed — and turns the
output back. `dsfn.transforms.sequence_parallel` enters it around every forward (through
`HuggingFaceAdapter.sequence_attention`), so an HF model trains under sequence parallelism
unchanged.

Supported inside "dsfn_ulysses": grouped-query attention whose key/value heads sp does
not divide (they are repeated by `kv_replication`'s factor in `repeat_kv`'s order, and the
module's `num_key_value_groups` is lowered to match while its own implementation runs);
sliding windows; packed rows (position_ids restarting at each document: all-gathered
once per forward, a block-diagonal causal mask over the whole sequence for eager/sdpa,
the whole position_ids for flash attention). Refused (ConfigError): a window or packed
documents with an implementation other than eager, sdpa or flash attention; query heads
sp does not divide (MeshError).

The active contexts (`_ACTIVE`, innermost last) keep, per forward, the documents and
padding masks all-gathered per position_ids / mask tensor, so a checkpointed layer's
recompute gathers nothing again.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dsfn.errors import ConfigError
from dsfn.engines.positions import document_ids
from dsfn.integrations.hf import detect

NAME = "dsfn_ulysses"


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, _ulysses_forward)
        AttentionMaskInterface.register(NAME, _no_mask)


def _no_mask(*args: Any, attention_mask: Any = None, **kwargs: Any) -> torch.Tensor | None:
    """The mask function of "dsfn_ulysses": no [T, T] mask (no rank's slice can describe the
    causal mask over the whole sequence; `_ulysses_forward` builds it after the all-to-all).
    When the batch has padding (the transform saw a 0 in the whole batch's attention_mask),
    this rank's slice of the 2-D padding mask [b, T/sp] is passed on for that."""
    ctx = _ACTIVE[-1] if _ACTIVE else None
    if ctx is None or not ctx.padded or not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return None
    return attention_mask


def _inner_forward(module: nn.Module, impl: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if impl in (None, "eager"):
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(impl, None)


class _Context:
    """One active `ulysses_attention`: the sp axis, the model's own implementation, the
    position_ids known to be consecutive (no documents: no all-gather needed), and the
    documents found per position_ids tensor this forward (one all-gather per tensor, kept
    for the recompute of a checkpointed layer)."""

    def __init__(self, axis: str, inner: str | None, consecutive: torch.Tensor | None, padded: bool = False):
        self.axis, self.inner, self.consecutive, self.padded = axis, inner, consecutive, padded
        self.documents: dict[Any, tuple] = {}   # id(position_ids) (or ("whole", id)) -> what was found
        self.keys: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}      # padding masks gathered this forward


def _valid_keys(ctx: _Context, mask: torch.Tensor) -> torch.Tensor:
    """The whole sequence's padding mask [b, T] (True: a real token) from this rank's slice
    [b, T/sp], all-gathered over sp once per mask tensor (kept for a recompute)."""
    got = ctx.keys.get(id(mask))
    if got is not None and got[0] is mask:
        return got[1]
    from dsfn.runtime import collectives as C
    from dsfn.runtime.mesh import current_mesh
    n = current_mesh().size(ctx.axis)
    b, c = mask.shape
    full = C.all_gather(mask.to(torch.uint8).contiguous(), ctx.axis).reshape(n, b, c).permute(1, 0, 2)
    full = full.reshape(b, n * c).to(mask.device).bool()
    ctx.keys[id(mask)] = (mask, full)
    return full


_ACTIVE: list[_Context] = []   # innermost last


def _whole_sequence(ctx: _Context, position_ids: torch.Tensor) -> torch.Tensor:
    """[b, T] the whole sequence's position_ids from this rank's slice [b, T/sp] (all-gathered
    over sp once per tensor and forward, kept for every layer and a recompute)."""
    got = ctx.documents.get(("whole", id(position_ids)))
    if got is not None and got[0] is position_ids:
        return got[1]
    from dsfn.runtime import collectives as C
    from dsfn.runtime.mesh import current_mesh
    n = current_mesh().size(ctx.axis)
    b, c = position_ids.shape
    full = C.all_gather(position_ids.contiguous(), ctx.axis).reshape(n, b, c).permute(1, 0, 2).reshape(b, n * c)
    full = full.to(position_ids.device)
    ctx.documents[("whole", id(position_ids))] = (position_ids, full)
    return full


def _documents(ctx: _Context, position_ids: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the whole sequence's position_ids [b, T], document ids [b, T]) from this rank's slice
    [b, T/sp] (all-gathered over sp), or (None, None) when every row holds one document.
    A new document starts where a position is not its predecessor + 1 — HF's
    `find_packed_sequence_indices`, so packed rows (position_ids restarting at 0) are masked
    as the single-process model masks them."""
    if position_ids is None or position_ids is ctx.consecutive or position_ids.dim() not in (1, 2):
        return None, None
    got = ctx.documents.get(id(position_ids))
    if got is not None and got[0] is position_ids:
        return got[1], got[2]
    full = _whole_sequence(ctx, position_ids if position_ids.dim() == 2 else position_ids[None])
    docs = document_ids(full)
    if bool((docs[:, -1] == 0).all()):
        full, docs = None, None
    ctx.documents[id(position_ids)] = (position_ids, full, docs)
    return full, docs


def _ulysses_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF attention signature: q [B, H, T/sp, d], k/v [B, Hkv, T/sp, d] -> ([B, T/sp, H, d], None).

    Key/value heads fewer than sp (or not divisible by it) are first repeated by
    `kv_replication`'s factor f (in `repeat_kv`'s order), and the module's
    `num_key_value_groups` is H / (Hkv * f) while its own implementation runs."""
    from dsfn.runtime.mesh import current_mesh
    from dsfn.engines import ulysses
    ctx = _ACTIVE[-1]
    axis, impl = ctx.axis, ctx.inner
    n = current_mesh().size(axis)
    f = ulysses.kv_replication(query.shape[1], key.shape[1], n, type(module).__name__)
    key, value = ulysses.replicate_kv(key, f), ulysses.replicate_kv(value, f)
    if impl in detect.MASKS_ITSELF:
        # 2-D: the implementation outside (context parallel's "dsfn_ring") takes the whole
        # outer-local sequence this all-to-all makes and applies the causal mask, window,
        # documents and padding itself, from its own notes of the whole batch
        q, k, v = (ulysses.seq_to_heads(t, axis) for t in (query, key, value))
        rest = {k_: v_ for k_, v_ in kwargs.items() if k_ not in {"position_ids", "labels", "shift_labels",
                                                                   "num_items_in_batch"}}
        # the position_ids and padding mask of the outer-local sequence (all-gathered over sp,
        # once per tensor and forward), from which it finds documents and padding
        pid = kwargs.get("position_ids")
        if isinstance(pid, torch.Tensor) and pid.dim() in (1, 2) and pid is not ctx.consecutive:
            rest["position_ids"] = _whole_sequence(ctx, pid if pid.dim() == 2 else pid[None])
        mask = (_valid_keys(ctx, attention_mask).long() if isinstance(attention_mask, torch.Tensor)
                and attention_mask.dim() == 2 else None)
        out, _ = _inner_forward(module, impl)(module, q, k, v, mask, **rest)          # [B, T, H/sp, d]
        out = ulysses.heads_to_seq(out.transpose(1, 2).contiguous(), axis)
        return out.transpose(1, 2), None
    full_positions, docs = _documents(ctx, kwargs.get("position_ids"))
    keys = (_valid_keys(ctx, attention_mask) if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
            else None)                                                       # [b, T]: padding (left, right, holes)
    q, k, v = (ulysses.seq_to_heads(t, axis) for t in (query, key, value))
    t = q.shape[2]
    mask = None
    window = kwargs.get("sliding_window")        # this layer's window (Mistral, Gemma2's sliding layers)
    windowed = window is not None and window < t
    flash = str(impl).startswith("flash_attention")
    if (windowed or docs is not None or keys is not None) and impl not in (None, "eager", "sdpa") and not flash:
        what = (f"a sliding window ({window})" if windowed else "packed documents (position_ids restarting)"
                if docs is not None else "padding (attention_mask with zeros)")
        raise ConfigError(f"sequence_parallel: {type(module).__name__} has {what} and attention implementation "
                          f"{impl!r}; dsfn's Ulysses attention builds that mask over the whole sequence for "
                          "'eager', 'sdpa' and flash attention only: load the model with one of those")
    if impl in (None, "eager") or (impl == "sdpa" and (windowed or docs is not None or keys is not None)):
        # the model's mask over the whole sequence: causal, within the window (HF's
        # sliding_window_overlay: kv > q - window) and within each document (HF's packed
        # sequence mask); eager adds it to the scores, sdpa takes it as a boolean mask.
        # (Flash attention gets sliding_window and the whole position_ids itself.)
        i = torch.arange(t, device=q.device)
        allowed = (i[None, :] <= i[:, None])[None]                                # [1, T, T]
        if windowed:
            allowed = allowed & (i[None, :] > i[:, None] - window)
        if docs is not None:
            allowed = allowed & (docs[:, :, None] == docs[:, None, :]).to(q.device)  # [b, T, T]
        if keys is not None:                     # HF's padding_mask_function: no query sees a pad key
            allowed = allowed & keys[:, None, :].to(q.device)
        if impl == "sdpa":
            mask = allowed[:, None]
        else:
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~allowed, torch.finfo(q.dtype).min)[:, None]
    drop = {"position_ids", "labels", "shift_labels", "num_items_in_batch"}
    if not flash:
        drop |= {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    kwargs = {k_: v_ for k_, v_ in kwargs.items() if k_ not in drop}
    if flash and docs is not None:
        kwargs["position_ids"] = full_positions          # flash attention's own varlen path, over all T
    if flash and keys is not None:
        mask = keys                                      # flash attention unpads by the 2-D mask itself
    groups = getattr(module, "num_key_value_groups", None)
    if f > 1 and isinstance(groups, int):
        module.num_key_value_groups = groups // f        # this rank's q heads per (replicated) kv head
    try:
        out, _ = _inner_forward(module, impl)(module, q, k, v, mask, **kwargs)  # [B, T, H/sp, d]
    finally:
        if f > 1 and isinstance(groups, int):
            module.num_key_value_groups = groups
    out = ulysses.heads_to_seq(out.transpose(1, 2).contiguous(), axis)                  # [B, H, T/sp, d]
    return out.transpose(1, 2), None


@contextlib.contextmanager
def ulysses_attention(model: nn.Module, axis: str, consecutive: torch.Tensor | None = None,
                      padded: bool = False) -> Iterator[None]:
    """Make `model` (and its sub-configs) use Ulysses attention over `axis` inside the context.
    `consecutive`: a position_ids tensor known to number every row's tokens consecutively
    (the transform's own), for which no documents are looked for. `padded`: the batch's
    attention_mask has zeros, so the model's padding mask is applied over the whole sequence."""
    _register()
    configs = detect.attention_configs(model, "sequence_parallel")
    saved = [c._attn_implementation_internal for c in configs]
    if _ACTIVE and all(s == NAME for s in saved):
        # Ulysses is installed already (an earlier forward of the same step, whose set-up lives
        # until backward: a pipeline's outstanding micro-batches): this forward's context wraps
        # what that one wraps, not Ulysses itself
        saved = [_ACTIVE[-1].inner] * len(configs)
    inner = {s if not isinstance(s, dict) else None for s in saved}
    if len(inner) != 1:
        raise ConfigError(f"sequence_parallel: the model's sub-configs use different attention implementations "
                          f"{saved}; Ulysses wraps one. Load the model with a single attn_implementation "
                          "(e.g. 'sdpa' for all parts)")
    _ACTIVE.append(_Context(axis, inner.pop(), consecutive, padded))
    try:
        with detect.attention_implementation(configs, NAME):
            yield
    finally:
        _ACTIVE.pop()
