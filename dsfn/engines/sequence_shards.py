"""Sequence shards: a batch's sequences cut into the contiguous slices of an sp group.

Machinery of `dsfn.transforms.sequence_parallel` (which decides when and along which axis):
labels shifted left by one over the whole sequence before it is cut (`shift_left`), a
batch padded at the end to a length the group divides (`pad_sequences`), and rank r's
slice [r*c, (r+1)*c) of every sequence-shaped tensor (`slice_sequences`). Inputs are
passed in (the keys, the fill values, the rank and slice length); imports no transform.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["pad_sequences", "shift_left", "slice_sequences", "take_positions"]


def shift_left(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Each row's labels one to the left (the next token's), the last target `ignore_index`."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore_index)], dim=1)


def pad_sequences(batch: dict, t: int, to: int, *, seq_key: str, labels_keys: tuple[str, ...], ignore_index: int,
                  pad_token_id: int) -> dict:
    """`batch` with every tensor of dim >= 2 padded along dim 1 from length `t` to `to`:
    labels (`labels_keys`) with `ignore_index`, the attention_mask with 0, `seq_key` with
    `pad_token_id`, position_ids counting on, anything else with 0."""
    extra = to - t
    out = {}
    for key, x in batch.items():
        if not (isinstance(x, torch.Tensor) and x.dim() >= 2):
            out[key] = x
            continue
        if key in labels_keys:
            fill = ignore_index
        elif key == "attention_mask":
            fill = 0
        elif key == seq_key:
            fill = pad_token_id
        elif key == "position_ids":
            out[key] = torch.cat([x, x[:, -1:] + torch.arange(1, extra + 1, device=x.device)], dim=1)
            continue
        else:
            fill = 0
        pad = list(x.shape)
        pad[1] = extra
        out[key] = torch.cat([x, x.new_full(pad, fill)], dim=1)
    return out


def slice_sequences(batch: dict[str, Any], r: int, c: int) -> dict[str, Any]:
    """Rank r's tokens [r*c, (r+1)*c) of every tensor of dim >= 2 (dim 1), contiguous: the
    model may .view() them (HF's loss does, which a column slice of several rows does not
    allow); other values as they are."""
    return {k: (x[:, r * c:(r + 1) * c].contiguous() if isinstance(x, torch.Tensor) and x.dim() >= 2 else x)
            for k, x in batch.items()}


def take_positions(batch: dict[str, Any], positions: torch.Tensor) -> dict[str, Any]:
    """The tokens at `positions` ([c] global indices, e.g. context parallel's head and tail
    chunks) of every tensor of dim >= 2 (dim 1), contiguous; other values as they are."""
    return {k: (x.index_select(1, positions.to(x.device)).contiguous()
                if isinstance(x, torch.Tensor) and x.dim() >= 2 else x)
            for k, x in batch.items()}
