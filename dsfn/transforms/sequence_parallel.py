"""`sequence_parallel()`: DeepSpeed Ulysses over the mesh's sp axis.

Each rank of an sp group holds a contiguous slice of every sequence (rank r: tokens
[r * T/sp, (r+1) * T/sp)). Everything per-token (embeddings, MLPs, norms, the LM head,
the loss) runs on the slice; attention needs the whole sequence, so it is wrapped:

    q, k, v  [B, H, T/sp, d]  --all-to-all-->  [B, H/sp, T, d]   (sequence -> heads)
    local causal attention over the full sequence, this rank's H/sp heads
    out      [B, H/sp, T, d]  --all-to-all-->  [B, H, T/sp, d]   (heads -> sequence)

(4 all-to-alls of the q/k/v/o activation size per attention layer in forward; their
adjoints in backward.) Heads are those this rank computes (after tensor parallel's split,
so heads are split over tp x sp); sp must divide the query heads (else a MeshError naming
the sp degrees that work). Grouped-query attention with key/value heads that sp does not
divide (fewer than sp, e.g. 8 query / 2 kv heads at sp=4, or 1 kv head per tp rank at
tp=2 x sp=2): k and v are first repeated by f = sp / gcd(Hkv, sp) (`kv_replication`,
DeepSpeed's kv_replication_factor) in `repeat_kv`'s order (kv head j -> copies j*f ..
j*f+f-1), so every rank receives the key/value heads its query heads use; the copies'
gradients sum back through the repeat, and k, v travel with Hkv*f heads. Query heads that
are not a multiple of the key/value heads (after tp's split) are a MeshError.

Which attention is wrapped:
- a Hugging Face model (`config._attn_implementation`): during the step the model's
  attention implementation is the registered "dsfn_ulysses" (dsfn.integrations.hf),
  which calls the model's own implementation (sdpa, eager, flash-attention) on the
  full-sequence / head-sharded tensors with a causal mask over the whole sequence;
- any other model (`auto=True`, AutoSP): every `torch.nn.functional.scaled_dot_product_attention`
  call its forward makes is intercepted (a TorchFunctionMode) and run as Ulysses —
  causal sdpa without an explicit mask, e.g. `dsfn.models.gpt`. The attention calls are
  found at run time rather than in a captured graph: no tracing or recompiling for new
  sequence lengths, and any Python control flow works;
- `auto=False`: the model calls `ulysses_sdpa(q, k, v)` in its attention (manual); for a
  Hugging Face model, whose attention is always wrapped, a ConfigError at its first forward.

Positions are global: the forward gets `position_ids` of this rank's tokens when the
caller did not pass them (RoPE and learned position embeddings see positions r*T/sp,
...); a wrapper whose forward passes **kwargs on to a Hugging Face model that takes them (peft's
PeftModelForCausalLM, a user's module) gets them that way, checked to reach the inner forward;
a model whose forward takes no `position_ids` is an error (it would count from 0
on every rank) unless `require_position_ids=False`. Attention is causal over the whole sequence;
right padding (attention_mask 1...1 0...0) is exact for the valid tokens. Any other padding
(left padding, holes) is applied as the model's padding mask inside Ulysses attention for a
Hugging Face model (eager, sdpa, flash): the transform sees a 0 in the whole batch's
attention_mask, the model's mask function hands the rank's slice [b, T/sp] on, and
`dsfn.integrations.hf` all-gathers it over sp (once per forward) and masks the pad keys
(HF's `padding_mask_function`, with the causal, window and document masks). A non-HF model
(AutoSP / ulysses_sdpa: no mask) with such padding is a ShapeError: right-pad or pack.
Chunked attention (Llama4's `attention_chunk_size`) is a ConfigError: its mask is not built.

Packed rows (several documents per row, a Hugging Face model given `position_ids` that
restart at 0 at each document): inside Ulysses attention every rank holds the whole
sequence for its heads, so `dsfn.integrations.hf` all-gathers the position_ids over sp
(once per forward; not when they are the transform's own consecutive positions) and
masks attention to each document (a document starts where a position is not its
predecessor + 1, HF's `find_packed_sequence_indices`), together with the causal mask and
any sliding window: eager and sdpa get that mask, flash attention the whole sequence's
position_ids (its own varlen path) and the caller's `cu_seq_lens_q/k` as they are (they
describe the whole sequence). Documents are separated whatever `use_cache` or an
attention_mask say (single-process HF separates them only with use_cache=False and no
attention_mask). AutoSP / `ulysses_sdpa` models (no mask) get no document masking.

The batch (`wrap_step`, before the step sees it): every tensor with a sequence dim
(dim 1, the length of `batch[seq_key]`) is split over sp; a tensor of dim >= 2 whose dim
1 differs is an error naming the key and both shapes. With `shift_labels=True` the
labels are shifted left by one *before* splitting (`batch["shift_labels"]`: the next
token of every position, ignore_index at the end), so the slice boundaries lose no
target. Lengths not divisible by sp are padded at the end (ignored labels, mask 0) when
`seq_length_is_variable`; with a fixed `seq_length` any other length is an error (a
`seq_length` with `seq_length_is_variable=True` is a ConfigError: nothing would read it).

Loss: the step's loss is made the token-weighted mean over the whole sp group: this
rank's loss (a mean over its valid tokens) is weighted by n_rank / n_group (counted from
`batch[labels_key] != ignore_index`), the weighted values and gradients are summed over
sp. A rank whose slice has no valid label (all padding) still runs (attention needs
every rank): one of its labels is made valid and its weight is 0, so it adds exactly 0.

A Hugging Face causal LM's own loss (`model(input_ids=..., labels=...).loss`, with or
without `shift_labels=`): while the model runs, its `loss_function` is HF's
`ForCausalLMLoss` given (a) `shift_labels`: `labels` shifted over the whole sequence (the
target of a slice's last token is the next rank's first label, one small all-gather over
sp; targets in sp padding ignored), or the `shift_labels=` the caller passed when the batch
held them before it was split (`shift_labels=True` or a 'shift_labels' key; otherwise they
were shifted inside the slice: an error); (b) `num_items_in_batch` = the valid targets of
the whole batch over sp and the data-parallel axes inside / dp (the caller's
`num_items_in_batch`, if given, / dp), so this rank's loss is dp * its sum / the global
count: summed over sp (weight 1) and averaged over dp it is the single-process loss, a
token mean over the whole batch (HF Trainer's `average_tokens_across_devices`; a loss the
train step computes itself keeps DDP's mean of the dp ranks' means). A model given labels
whose `loss_function` is not ForCausalLMLoss, that does not call it, or whose logits or
labels do not cover this rank's slice is an error. Outside `value_and_grad` (an eval
metric) the model's loss is the whole group's value, not differentiable. Every slice
handed to the model is contiguous.

Stack: outermost (only `async_checkpoint` may sit outside): its gradient sum over sp
runs after ZeRO's reduce-scatter over dp (the sum is linear, so it commutes).
"""
from __future__ import annotations

from typing import Any

from dsfn.engines.ulysses import (  # noqa: F401  (ulysses_sdpa, kv_replication, replicate_kv: public here too)
    UlyssesSDPA,
    kv_replication,
    replicate_kv,
    ulysses_sdpa,
)
from dsfn.transforms.core import make_transform
from dsfn.transforms.sequence_split import SplitSequence


class SequenceParallel(SplitSequence):
    """Ulysses over `axis`: contiguous slices, the all-to-alls around attention (module docstring)."""
    wraps_outer_attention = True        # 2-D: right inside context_parallel, its attention is the ring


def sequence_parallel(*args: Any, **kwargs: Any) -> SequenceParallel:
    """`sequence_parallel(axis="sp", seq_length=None, seq_length_is_variable=True, seq_key="input_ids",
    labels_key="labels", shift_labels=False, ignore_index=-100, pad_token_id=0, auto=True,
    require_position_ids=True)`;
    see the module docstring. `auto=False` leaves a non-HF model's attention alone: it
    calls `ulysses_sdpa` itself."""
    return make_transform(SequenceParallel, "sequence_parallel", args, kwargs)
