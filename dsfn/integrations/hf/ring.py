"""Ring attention for Hugging Face models: the "dsfn_ring" attention implementation.

`ring_attention_context(model, axis, positions, ...)` is a context: while it is active
the model's attention implementation (`config._attn_implementation`, every sub-config's) is
"dsfn_ring", registered with transformers' `AttentionInterface` together with a mask
function that builds no [T, T] mask (no rank's chunks can describe the whole sequence's) and
passes a 2-D padding mask on.
"dsfn_ring" takes HF's q [B, H, T, d], k / v [B, Hkv, T, d] and runs
`dsfn.engines.ring_attention.ring_attention` over `axis`: causal over the global
`positions`, the layer's `sliding_window` (HF's: a key is seen while q - k < window), the
documents of packed rows (position_ids that restart) and padding (a 2-D attention_mask), the
layer's `scaling` and its logit soft-capping (Gemma2's `softcap`). The documents come from the position_ids and attention_mask the layer
itself gets (the rows the model runs: a data-parallel split or a micro-batch), made whole
over cp by one all-gather per forward. A model with a cache (`use_cache=True`) is masked by
documents too (Hugging Face's single process then masks only causally: train packed rows
with use_cache=False). Grouped-query heads stay Hkv on the wire. Refused
(ConfigError): attention dropout while training, a custom (not 2-D) attention mask. `dsfn.transforms.context_parallel` enters it around every forward.
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


class _Context:
    """One active ring attention: the cp axis, this rank's global positions [T] (the head and
    tail chunks), the position_ids tensor known to be the transform's own (consecutive: no
    documents), whether the batch has padding, the documents found per (position_ids,
    attention_mask) this forward (one all-gather each, kept for every layer and a recompute)
    and the `record` of each call."""

    def __init__(self, axis: str, positions: torch.Tensor, consecutive: Any, padded: bool, record: Any):
        self.axis, self.positions, self.consecutive, self.padded, self.record = (axis, positions, consecutive,
                                                                                 padded, record)
        self.documents: dict[tuple[int, int], tuple[Any, Any, torch.Tensor | None]] = {}


_ACTIVE: list[_Context] = []      # innermost last


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, _ring_forward)
        AttentionMaskInterface.register(NAME, _padding_only)


def _padding_only(*args: Any, attention_mask: Any = None, **kwargs: Any) -> torch.Tensor | None:
    """The mask function of "dsfn_ring": no [T, T] mask (no rank's chunks describe the whole
    sequence's); when the batch has padding, this rank's 2-D padding mask [b, T] is passed on
    (the ring applies it over the whole sequence: `_documents`)."""
    ctx = _ACTIVE[-1] if _ACTIVE else None
    if ctx is None or not ctx.padded or not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return None
    return attention_mask


def _whole(x: torch.Tensor, axis: str, t: int) -> torch.Tensor:
    """[b, T] this rank's chunks of a per-token tensor -> [b, n x T] the whole sequence's, in
    global order (all-gathered over `axis`, each rank's head and tail chunks put in place)."""
    from dsfn.engines.ring_attention import head_tail_positions
    from dsfn.runtime import collectives as C
    from dsfn.runtime.mesh import current_mesh
    n = current_mesh().size(axis)
    b = x.shape[0]
    parts = C.all_gather(x.contiguous(), axis).reshape(n, b, t).to(x.device)
    full = torch.empty(b, n * t, dtype=x.dtype, device=x.device)
    for r in range(n):
        full[:, head_tail_positions(n * t, n, r).to(x.device)] = parts[r]
    return full


def _documents(ctx: _Context, position_ids: Any, mask: Any, rows: int, t: int) -> torch.Tensor | None:
    """[rows, T] each of this rank's tokens' document over the whole sequence, -1 for padding,
    from the position_ids (restarting: packed documents) and 2-D attention_mask the layer got
    (the rows the model runs: a data-parallel split or micro-batch of the batch); None when
    there are neither. One all-gather over cp per tensor and forward."""
    from dsfn.engines.positions import document_ids
    pid = position_ids if isinstance(position_ids, torch.Tensor) and position_ids.dim() in (1, 2) \
        and position_ids is not ctx.consecutive else None
    keys = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    if pid is None and keys is None:
        return None
    key = (id(pid), id(keys))
    got = ctx.documents.get(key)
    if got is not None and got[0] is pid and got[1] is keys:
        return got[2]
    local = ctx.positions.to(pid.device if pid is not None else keys.device)
    docs = None
    if pid is not None:
        p = pid if pid.dim() == 2 else pid[None]
        p = p.expand(rows, -1) if p.shape[0] == 1 else p
        whole = document_ids(_whole(p, ctx.axis, t))
        if not bool((whole[:, -1] == 0).all()):          # some row holds more than one document
            docs = whole.index_select(1, local)
    if keys is not None:
        whole_valid = _whole(keys.to(torch.uint8), ctx.axis, t).bool()
        if not bool(whole_valid.all()):          # decided on the whole sequence: every rank alike
            valid = whole_valid.index_select(1, local)
            docs = (docs if docs is not None else torch.zeros(rows, t, dtype=torch.long,
                                                              device=valid.device)).masked_fill(~valid, -1)
    ctx.documents[key] = (pid, keys, docs)
    return docs


def _ring_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                  sliding_window: int | None = None, softcap: float | None = None, **kwargs: Any):
    """HF attention signature -> ([B, T, H, d], None)."""
    from dsfn.engines.ring_attention import ring_attention
    ctx = _ACTIVE[-1]
    name = type(module).__name__
    if dropout and module.training:
        raise ConfigError(f"context_parallel: {name} has attention dropout {dropout}; ring attention has none: set "
                          "the model's attention_dropout to 0")
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() != 2:
        raise ConfigError(f"context_parallel: {name}'s attention got a {attention_mask.dim()}-D attention mask "
                          f"{tuple(attention_mask.shape)}; ring attention applies the causal mask, sliding windows, "
                          "packed documents (position_ids) and a 2-D padding mask itself, and cannot honour a "
                          "custom mask: express it as padding or documents, or use sequence_parallel() (Ulysses)")
    documents = _documents(ctx, kwargs.get("position_ids"), attention_mask, query.shape[0], query.shape[2])
    out = ring_attention(query, key, value, ctx.axis, ctx.positions.to(query.device), documents, causal=True,
                         window=sliding_window, scale=scaling, record=ctx.record, softcap=softcap)
    return out.transpose(1, 2), None


@contextlib.contextmanager
def ring_attention_context(model: nn.Module, axis: str, positions: torch.Tensor, consecutive: Any = None,
                           padded: bool = False, record: Any = None) -> Iterator[None]:
    """Make `model` (and its sub-configs) use ring attention over `axis` inside the context:
    this rank's tokens at global `positions` [T]; `consecutive`: the position_ids tensor the
    transform gave the model (no documents looked for in it); `padded`: the batch's
    attention_mask has zeros; `record`: each call's `RingCall` (see `ring_attention`)."""
    _register()
    configs = detect.attention_configs(model, "context_parallel")
    _ACTIVE.append(_Context(axis, positions, consecutive, padded, record))
    try:
        with detect.attention_implementation(configs, NAME):
            yield
    finally:
        _ACTIVE.pop()
