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
one over the whole sequence before that (`batch["shift_labels"]`: a chunk's last target is
another chunk's first token; `shift_labels=False` when the labels are already each
position's target), and the loss the train step computes from `batch["shift_labels"]` (or
the labels) is made the token mean over the whole sequence and batch: this
rank's mean is weighted by its share of the valid targets, and values and gradients are
summed over cp (the machinery shared with sequence parallel: `SplitSequence` with a head-tail layout
and ring attention instead of Ulysses). Positions are global: a forward that takes
`position_ids` gets the rank's global positions.

Which attention: a Hugging Face model's attention runs as the registered "dsfn_ring"
(`dsfn.integrations.hf.ring`): causal over the global positions, with the layer's sliding
window, packed documents (position_ids that restart: a key only for queries of its
document) and padding (attention_mask 0: a key for nobody), from the position_ids and 2-D
mask the layer gets (the rows it runs), made whole over cp; a mask of another shape is a
ShapeError; its own loss (`labels=`) is scored against the transform's whole-sequence
shift of those labels, the token mean over the whole sequence and batch. A non-HF model's
causal `scaled_dot_product_attention` calls (no mask; `dsfn.models.gpt`) are intercepted
(`RingSDPA`; no documents, right padding only, as sequence parallel's AutoSP). Gemma2's
logit soft-capping runs inside the ring's blocks. Refused: attention dropout.

2-D (unified sequence parallelism): `compose(context_parallel(), sequence_parallel(), ...)`
on a mesh with cp and sp axes. The ring runs over cp, Ulysses over sp inside each cp rank's
chunks: sp slices those chunks contiguously, its all-to-all hands the ring the cp-local
sequence for H / sp heads (and K/V heads), and the ring applies every mask; the splitter
inside weighs the loss over both axes. Put sp on the fast links: `init_mesh(cp=..., sp=...)`
lays the later axis inside a node; `explain` says which axis crosses nodes.

Nothing in the state is laid out over cp: checkpoints are unchanged. Stack: outermost
(only `async_checkpoint` may sit outside), as sequence_parallel; `pipeline_parallel` inside
runs the ring in each stage.
"""
from __future__ import annotations

from typing import Any

import torch

from dsfn.engines.ring_attention import RingCall, RingSDPA, head_tail_positions
from dsfn.engines.sequence_shards import take_positions
from dsfn.runtime.mesh import current_mesh
from dsfn.errors import ShapeError
from dsfn.transforms.core import make_transform
from dsfn.transforms.sequence_split import SplitSequence, crossing


class ContextParallel(SplitSequence):
    name = "context_parallel"
    roles = frozenset({"context_parallel"})
    pieces_per_rank = 2                 # a head and a tail chunk
    contiguous = False
    wrapped_by_inner = True             # 2-D: Ulysses inside runs its all-to-all around this ring

    def __init__(self, axis: str = "cp", seq_key: str = "input_ids", labels_key: str = "labels",
                 shift_labels: bool = True, ignore_index: int = -100, pad_token_id: int = 0):
        super().__init__(axis=axis, seq_key=seq_key, labels_key=labels_key, shift_labels=shift_labels,
                         ignore_index=ignore_index, pad_token_id=pad_token_id)
        self.last_ring: list[RingCall] = []         # the last step's ring attention calls (explain)

    def explain_note(self) -> str:
        mesh = current_mesh()
        n = mesh.size(self.axis)
        lines = [f"context_parallel over {self.axis!r} (size {n}, {crossing(mesh, self.axis)}): ring attention, "
                 f"{n} K/V blocks per attention layer pass around the ring (sequence in {2 * n} chunks, a head and "
                 "a tail per rank)"]
        for ax in self._inner_axes:
            lines.append(f"  2-D: sequence_parallel over {ax!r} (size {mesh.size(ax)}, {crossing(mesh, ax)}) inside: "
                         f"Ulysses' all-to-all over {ax!r} within each {self.axis!r} rank's chunks, the ring over "
                         f"{self.axis!r} across")
        calls = self.last_ring
        if calls:
            c = calls[0]
            total = sum(x.wire_bytes for x in calls)
            lines.append(f"  last step: {len(calls)} ring attention calls; per call a K/V block of {c.block_bytes:,} B "
                         f"(K, V [{c.rows}, {c.kv_heads}, {c.seq}, {c.head_dim}] x {c.itemsize} B + positions"
                         f"{' + documents' if c.documents else ''}) makes {c.n - 1} shifts in forward and "
                         f"{c.n - 1} in backward, its dK / dV ({c.grad_bytes:,} B fp32) {c.n}: {c.wire_bytes:,} B sent per call, "
                         f"{total:,} B this step; chunk pairs computed {sum(x.pairs for x in calls)} of "
                         f"{sum(x.pairs_total for x in calls)} (the rest fully masked, skipped); one block in flight "
                         f"beside the rank's own: {c.block_bytes:,} B")
        return "\n".join(lines)

    def _take(self, batch: dict, t: int, n: int, r: int, device: Any) -> dict:
        pos = head_tail_positions(t, n, r).to(device)
        notes = self._notes()
        notes.positions = pos[None]
        notes.own_positions = notes.positions      # the ones this transform made: no documents in them
        notes.arange = None
        notes.ring_positions = pos
        notes.index = pos
        self.last_ring = notes.ring_calls = []      # filled by this step's ring attention calls
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() != 2:
            raise ShapeError(f"context_parallel: the batch's attention_mask has shape {tuple(mask.shape)}; ring "
                             "attention applies a 2-D padding mask [batch, seq] (and packed documents from "
                             "position_ids) over the whole sequence, not a custom mask: express it as padding or "
                             "documents, or use sequence_parallel() (Ulysses)")
        out = take_positions(batch, pos)
        labels = out.get(self.labels_key)
        # a model given labels= is scored against their whole-sequence shift (a chunk's last
        # target is another chunk's first token): the pair the transform made
        notes.shifted = ({id(labels): (labels, out["shift_labels"])} if isinstance(labels, torch.Tensor)
                         and isinstance(out.get("shift_labels"), torch.Tensor) else {})
        return out

    def _hf_attention(self, adapter: Any, module: Any) -> Any:
        notes = self._notes()
        return adapter.ring_attention(module, self.axis, notes.ring_positions, notes.own_positions, notes.padded,
                                      notes.ring_calls.append)

    def _sdpa_mode(self) -> Any:
        return RingSDPA(self.axis, self._notes().ring_positions, self._notes().ring_calls.append)


def context_parallel(*args: Any, **kwargs: Any) -> ContextParallel:
    """`context_parallel(axis="cp", seq_key="input_ids", labels_key="labels", shift_labels=True,
    ignore_index=-100, pad_token_id=0)`; see the module docstring. `shift_labels=False`: the
    batch's labels are already each position's target (`labels[t]` = token t + 1), so they
    are cut as they are and the loss is weighted by them (a model's own loss, which shifts
    `labels=` itself, then needs shift_labels=True)."""
    return make_transform(ContextParallel, "context_parallel", args, kwargs)
