"""`context_parallel()`: ring attention over the mesh's cp axis, for sequences that the head
count does not limit.

The sequence of every batch row is cut into 2 x cp chunks and rank r holds chunks r and
2cp - 1 - r (`dsfn.engines.ring_attention.head_tail_positions`): under a causal mask every
rank then does the same attention work. Everything per token (embeddings, MLPs, norms, the
head, the loss) runs on the rank's 2 chunks; attention runs as ring attention
(`dsfn.engines.ring_attention`): each rank's queries meet every rank's keys and values as
the K/V blocks pass around the ring, merged by log-sum-exp, the next block's transfer
overlapping the current block's compute, fully masked chunk pairs skipped; backward sends
dK / dV around the ring the same way. Grouped-query attention sends its few K/V heads.

The batch: every sequence-shaped tensor (dim 1) is taken at the rank's positions (padded at
the end to a multiple of 2 x cp: ignored labels, mask 0). The labels are shifted left by
one over the whole sequence before that (`batch["shift_labels"]`, always: a chunk's last
target is another chunk's first token), and the loss the train step computes from
`batch["shift_labels"]` is made the token mean over the whole sequence and batch: this
rank's mean is weighted by its share of the valid targets, and values and gradients are
summed over cp (the machinery shared with sequence parallel: `SplitSequence` with a head-tail layout
and ring attention instead of Ulysses). Positions are global: a forward that takes
`position_ids` gets the rank's global positions.

Which attention: a non-Hugging-Face model's causal `scaled_dot_product_attention` calls
(no mask; `dsfn.models.gpt`) are intercepted (`RingSDPA`). Not built yet, refused with a
ConfigError: Hugging Face models (their attention registration and own loss), and padding
or packed documents in the batch; in the stack, sequence_parallel together with it (2-D).

Nothing in the state is laid out over cp: checkpoints are unchanged. Stack: outermost
(only `async_checkpoint` may sit outside), as sequence_parallel.
"""
from __future__ import annotations

from typing import Any

import torch

from dsfn.adapters import adapter_for
from dsfn.engines.ring_attention import RingSDPA, head_tail_positions
from dsfn.engines.sequence_shards import take_positions
from dsfn.errors import ConfigError, ShapeError
from dsfn.runtime.mesh import current_mesh
from dsfn.transforms.core import make_transform
from dsfn.transforms.sequence_split import SplitSequence


class ContextParallel(SplitSequence):
    name = "context_parallel"
    roles = frozenset({"context_parallel"})
    pieces_per_rank = 2                 # a head and a tail chunk

    def __init__(self, axis: str = "cp", seq_key: str = "input_ids", labels_key: str = "labels",
                 ignore_index: int = -100, pad_token_id: int = 0):
        super().__init__(axis=axis, seq_key=seq_key, labels_key=labels_key, shift_labels=True,
                         ignore_index=ignore_index, pad_token_id=pad_token_id)

    def explain_note(self) -> str:
        n = current_mesh().size(self.axis)
        return (f"context_parallel over {self.axis!r} (size {n}): ring attention, {n} K/V blocks per attention "
                f"layer pass around the ring (sequence in {2 * n} chunks, a head and a tail per rank)")

    def _take(self, batch: dict, t: int, n: int, r: int, device: Any) -> dict:
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and not bool(mask.bool().all()):
            raise ShapeError("context_parallel: the batch's attention_mask has padding; padding in ring attention is "
                             "not built yet: pack or cut the rows to full length")
        if "position_ids" in batch:
            raise ShapeError("context_parallel: the batch holds position_ids (packed documents?); documents in ring "
                             "attention are not built yet")
        pos = head_tail_positions(t, n, r).to(device)
        self._notes().positions = pos[None]
        self._notes().arange = None
        self._notes().ring_positions = pos
        return take_positions(batch, pos)

    def handle_apply_module(self, call_next, apply_fn, params, args, kwargs):
        if current_mesh().size(self.axis) > 1 and adapter_for(apply_fn.module) is not None:
            raise ConfigError(f"context_parallel: {type(apply_fn.module).__name__} is a Hugging Face model; its "
                              "attention registration and own loss under ring attention are not built yet. Use "
                              "sequence_parallel() (Ulysses) for it")
        return super().handle_apply_module(call_next, apply_fn, params, args, kwargs)

    def _sdpa_mode(self) -> Any:
        return RingSDPA(self.axis, self._notes().ring_positions)


def context_parallel(*args: Any, **kwargs: Any) -> ContextParallel:
    """`context_parallel(axis="cp", seq_key="input_ids", labels_key="labels", ignore_index=-100,
    pad_token_id=0)`; see the module docstring."""
    return make_transform(ContextParallel, "context_parallel", args, kwargs)
