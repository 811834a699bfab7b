"""Model adapters: how a wrapped library's own loss and attention stay right under the
transforms that split their inputs.

A wrapped library computes some values of the whole itself: a Hugging Face causal LM
divides its own loss by the valid targets it sees, balances its router over the tokens it
sees, and runs its attention on whatever sequence it holds. The transforms that split
those inputs (data_parallel and shard_zero over dp, accumulate over micro-batches,
sequence_parallel over sp) ask the adapter registered for the model, never the library
(and `tensor_parallel("auto")` asks it for the model's own tp plan):

    adapter = adapter_for(apply_fn.module)        # None: a plain model, nothing to adjust
    with adapter.token_mean_over(module, axes, args, kwargs): ...

An integration registers its adapter when imported (`dsfn.integrations.hf` registers
Hugging Face's; `import dsfn` imports it, and it imports transformers only when used), so
core transforms import no integration and an integration imports no transform.

Also here, for any adapter: the micro-batch counts accumulation publishes while its
micro-batches run (`micro_batches`, `micro_batch_counts`), which a model's own loss reads
to normalise by the whole batch's valid targets.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ContextManager, Protocol

import torch
from torch import nn

from dsfn.errors import ConfigError

__all__ = ["MicroBatchCounts", "ModelAdapter", "SequenceSplit", "adapter_for", "micro_batch_counts",
           "micro_batches", "register_adapter"]


@dataclass(frozen=True)
class SequenceSplit:
    """What sequence parallelism tells a model's own loss about this step's batch (`own_loss`):
    plain values, read while the model runs.

    axis: the sp mesh axis; dp_axes: the data-parallel axes inside sp (they average over
    theirs); local_len: this rank's slice length; real_len: the sequences' length before
    they were padded to a multiple of sp; batch_shifted: the batch held whole-sequence
    `shift_labels` before it was split; in_grad: the model runs inside value_and_grad (else
    its loss is an evaluation's: the group's value); originals: id(labels the transform made
    valid for a zero weight) -> (those labels, the batch's); normalised: called once per loss
    made the group's token mean inside a gradient (the transform then weighs it 1);
    shifted: for a layout whose slices are not contiguous (context parallel's head and tail
    chunks: a slice's last target is not its neighbour's first label), None; else
    id(this rank's labels) -> (those labels, their whole-sequence shift taken at this rank's
    positions), which a model given `labels=` is then scored against; sum_axes: the axes of a
    splitter outside this one (2-D: context parallel's cp around Ulysses), over which the
    loss's count and value are summed as over `axis`."""
    axis: str
    dp_axes: tuple[str, ...]
    local_len: int
    real_len: int
    batch_shifted: bool
    in_grad: bool
    originals: Mapping[int, tuple[torch.Tensor, torch.Tensor]]
    normalised: Callable[[], None]
    shifted: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    sum_axes: tuple[str, ...] = ()

    def original(self, t: Any) -> Any:
        """The batch's labels for `t` where the transform patched them, else `t`."""
        got = self.originals.get(id(t)) if t is not None else None
        return got[1] if got is not None and got[0] is t else t

    def shifted_of(self, labels: torch.Tensor) -> torch.Tensor | None:
        """`labels`' whole-sequence shift at this rank's positions (non-contiguous layouts), or None.
        `labels` is the transform's tensor, or rows of it (a view: the data-parallel split or a
        micro-batch inside take the batch's rows by slicing), whose shift is the same rows."""
        shifted = self.shifted or {}
        got = shifted.get(id(labels))
        if got is not None and got[0] is labels:
            return got[1]
        base = labels._base
        got = shifted.get(id(base)) if base is not None else None
        if got is None or got[0] is not base or labels.dim() != 2 or base.dim() != 2 \
                or labels.shape[1] != base.shape[1] or labels.stride() != base.stride():
            return None
        first = (labels.storage_offset() - base.storage_offset()) // base.stride(0)
        return got[1][first:first + labels.shape[0]]


class ModelAdapter(Protocol):
    """What the transforms ask of a model family (each returns a context active while the
    model runs; see dsfn.integrations.hf for Hugging Face's answers)."""

    def holds(self, module: Any) -> bool:
        """Whether this adapter's rules apply to `module` (a model of its library, or one wrapping it)."""

    def token_mean_over(self, module: nn.Module, axes: list[str], args: tuple, kwargs: dict) -> ContextManager:
        """The model's own loss as the token mean over `axes` (data parallel) and micro-batches."""

    def own_loss(self, module: nn.Module, split: SequenceSplit, args: tuple, kwargs: dict) -> ContextManager:
        """The model's own loss made exact over the sequences sequence parallel split (`split`)."""

    def global_router_balance(self, module: nn.Module, sum_axes: list[str], mean_axes: list[str],
                              valid: torch.Tensor | None) -> ContextManager:
        """A mixture-of-experts router balance loss over the whole batch."""

    def sequence_attention(self, module: nn.Module, axis: str, consecutive: torch.Tensor | None,
                           padded: bool) -> ContextManager:
        """The model's attention as Ulysses attention over `axis`."""

    def ring_attention(self, module: nn.Module, axis: str, positions: torch.Tensor, consecutive: Any = None,
                       padded: bool = False, record: Callable | None = None) -> ContextManager:
        """The model's attention as ring attention over `axis` (this rank's tokens at global
        `positions` [T]; `consecutive`: the position_ids the transform gave, holding no
        documents; `padded`: the batch's attention_mask has zeros; `record`: called with each
        call's `dsfn.engines.ring_attention.RingCall`)."""

    def loss_modules(self, module: nn.Module) -> list[nn.Module]:
        """The modules that compute `module`'s own loss (wrappers looked through)."""

    def tensor_parallel_plan(self, module: nn.Module) -> dict | None:
        """The model's own tensor-parallel plan ({module pattern: style}; `tensor_parallel("auto")`),
        or None / {} when it declares none."""

    def expert_parallel_plan(self, module: nn.Module) -> dict | None:
        """The model's own expert-parallel plan ({module pattern: style}; `expert_parallel("auto")`),
        or None / {} when it declares none."""


_adapters: list[ModelAdapter] = []


def register_adapter(adapter: ModelAdapter) -> None:
    """Make `adapter` answer for the models it `holds` (registered once; first match wins)."""
    if adapter not in _adapters:
        _adapters.append(adapter)


def adapter_for(module: Any) -> ModelAdapter | None:
    """The registered adapter for `module`, or None (a plain model: nothing to adjust)."""
    for a in _adapters:
        if a.holds(module):
            return a
    return None


class MicroBatchCounts:
    """Set by `accumulate(n)` while its micro-batches run (`micro_batches`): a model's own
    causal-LM loss (Hugging Face's) divides by the valid targets of the *whole* batch, not of its micro-batch.

    `whole_of` maps each micro-batch tensor accumulate made (by id: a slice of a batch
    tensor) to that whole (rank-local) batch tensor. A loss given labels that are such a
    slice counts the valid targets of the whole tensor (`target_of`: labels -> targets, e.g.
    shifted; `reduce`: summed over the parallel axes), once per step (cached), and returns
    `num_items_in_batch` = that count / (dp x n): each micro-loss is dp x n x (its sum) / N,
    accumulation's 1/n and the dp average make the sum over micro-batches and ranks the
    single-process token mean of the whole batch — before backward, so gradients reduced
    during backward (ZeRO-2/3) are right as they are (Hugging Face Trainer's
    `num_items_in_batch`, counted from the batch)."""

    def __init__(self, n: int, whole_of: dict[int, torch.Tensor]):
        self.n = n
        self.whole_of = whole_of
        self._counts: dict[tuple[int, int], torch.Tensor] = {}

    def num_items(self, labels: torch.Tensor, target_of: Any, ignore_index: int, reduce: Any, dp: int,
                  model: nn.Module) -> torch.Tensor:
        whole = self.whole_of.get(id(labels))
        if whole is None:
            raise ConfigError(
                f"accumulate({self.n}): {type(model).__name__}'s own loss got labels that are not a slice of the "
                "batch accumulate split into micro-batches, so dsfn cannot count the valid targets of the whole "
                "batch, and the mean of the micro-batch means differs from the batch's token mean whenever the "
                "micro-batches hold different numbers of ignored labels. Pass the batch's labels tensor to the "
                "model unchanged (move batches to the device before the step), or pass num_items_in_batch= yourself")
        key = (id(whole), ignore_index)
        if key not in self._counts:
            n = (target_of(whole) != ignore_index).sum().to(torch.float64).reshape(1)
            self._counts[key] = reduce(n).reshape(())
        return self._counts[key] / (dp * self.n)


_micro_batches: list[MicroBatchCounts] = []


@contextlib.contextmanager
def micro_batches(counts: MicroBatchCounts) -> Iterator[MicroBatchCounts]:
    """While accumulation's micro-batches run: a model's own loss normalises for the whole batch."""
    _micro_batches.append(counts)
    try:
        yield counts
    finally:
        _micro_batches.pop()


def micro_batch_counts() -> MicroBatchCounts | None:
    """The active accumulation's counts (None outside `accumulate`'s micro-batches)."""
    return _micro_batches[-1] if _micro_batches else None
