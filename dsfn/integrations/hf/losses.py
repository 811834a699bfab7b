"""A Hugging Face model's own loss (`labels=`) as the whole batch's token mean.

- `token_mean_over(model, axes, ...)`: under data parallel and accumulation, the causal-LM
  loss of the modules that compute it (`detect.loss_modules`) divided by the valid targets
  of the whole batch (`_WholeBatchLoss`), and the router balance over the whole batch
  (`router.global_router_balance`);
- `own_loss(model, split, ...)` / `sequence_loss(split, inner, module)`: under sequence
  parallel, the labels shifted over the whole sequence and the loss normalised over the
  sp x dp group.
A model given labels whose loss dsfn cannot find, or cannot make exact, is refused
(ConfigError).
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dsfn.adapters import SequenceSplit, micro_batch_counts
from dsfn.errors import ConfigError, ShapeError
from dsfn.integrations.hf import detect, router


def _causal_loss() -> Any:
    from transformers.loss.loss_utils import LOSS_MAPPING
    return LOSS_MAPPING["ForCausalLM"]


def _labels_passed(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    if kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None:
        return True
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return bool(args)        # cannot tell: a positional argument may be the labels
    return bound.arguments.get("labels") is not None


class _WholeBatchLoss:
    """A model's `loss_function` while dsfn runs it: HF's `ForCausalLMLoss` divided by the
    valid targets of the whole batch — over the data-parallel `axes` (one all-reduce of a
    scalar) and, under accumulation, over every micro-batch (`dsfn.adapters.MicroBatchCounts`). Nested
    contexts add their axes to the one installed object."""

    def __init__(self, causal: Any, model: nn.Module):
        self.causal, self.model = causal, model
        self.axes: list[tuple[str, int]] = []
        self.calls = 0          # how often the model's forward called it (the proof it is the model's loss)

    def __call__(self, logits, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                 shift_labels=None, **kw):
        self.calls += 1
        counts = micro_batch_counts()
        spread = [(a, size) for a, size in self.axes if size > 1]
        if num_items_in_batch is None and (labels is not None or shift_labels is not None) and (spread or counts):
            from dsfn.runtime import collectives as C

            def reduce(n):
                for a, _ in spread:
                    n = C.all_reduce(n, a, "sum")
                return n
            dp = 1
            for _, size in spread:
                dp *= size
            source = shift_labels if shift_labels is not None else labels
            target_of = (lambda t: t) if shift_labels is not None else (lambda t: t[..., 1:])
            if counts is not None:        # the whole batch's count, over every micro-batch
                num_items_in_batch = counts.num_items(source, target_of, ignore_index, reduce, dp, self.model)
            else:
                num_items_in_batch = reduce((target_of(source) != ignore_index).sum().to(torch.float64).reshape(1)) / dp
            num_items_in_batch = num_items_in_batch.reshape(()).to(logits.device, torch.float32)
        return self.causal(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                           ignore_index=ignore_index, shift_labels=shift_labels, **kw)


@contextlib.contextmanager
def token_mean_over(model: nn.Module, axes: list[str], args: tuple, kwargs: dict) -> Iterator[None]:
    """`_token_mean_over`, and the router load-balancing loss of a mixture-of-experts model over
    the whole batch (`global_router_balance`, the axes averaged)."""
    with router.global_router_balance(model, [], axes), _token_mean_over(model, axes, args, kwargs):
        yield


@contextlib.contextmanager
def _token_mean_over(model: nn.Module, axes: list[str], args: tuple, kwargs: dict) -> Iterator[None]:
    """Data parallelism and accumulation for a Hugging Face causal LM's own loss (`labels=` /
    `shift_labels=`): while the model runs, the `loss_function` of the module that computes it
    (`loss_modules`: the model itself, or the HF model inside peft, torch.compile or a user's
    wrapper; never a wrapper's attribute the inner forward does not read) gets `num_items_in_batch` =
    the valid targets of the whole batch over the dp `axes` / dp (one all-reduce of a scalar),
    so this rank's loss is dp * (its sum) / (the global count) and the dp average of the
    gradients is the gradient of the global token mean — the single-process loss of the
    whole batch, whatever each rank's share of ignored labels (padding, prompts). Without it
    each rank takes its own mean and dp averages the means (DDP's result; HF Trainer's
    `average_tokens_across_devices` fixes the same). Under `accumulate` (`axes` may be
    empty) the count spans every micro-batch (`dsfn.adapters.MicroBatchCounts`). Nothing changes
    when the caller passes `num_items_in_batch`, when the model's loss is not HF's
    causal-LM loss, or when sequence parallel already normalises it. A model given labels whose
    forward then calls none of those `loss_function`s (or that has one and no module of its tree
    defines it) is refused (ConfigError): its loss would be a per-rank mean."""
    from dsfn.runtime.mesh import current_mesh
    spread = [(a, current_mesh().size(a)) for a in axes]
    labelled = _labels_passed(model, args, kwargs)
    mods = detect.loss_modules(model)
    if not mods:
        if labelled and getattr(model, "loss_function", None) is not None:
            raise ConfigError(_unfound(model, "it has a loss_function but no module of its tree defines one"))
        yield
        return
    causal = _causal_loss()
    losses, new = [], []
    for m in mods:
        own = m.__dict__.get("_loss_function")
        if isinstance(own, _WholeBatchLoss):          # nested (accumulate and data parallel): one loss, all axes
            pass
        elif own is None and m.loss_function is causal:
            own = _WholeBatchLoss(causal, m)
            m._loss_function = own
            new.append(m)
        else:                                         # the user's own loss_function, or sequence parallel's
            continue
        own.axes.extend(spread)
        losses.append(own)
    before = sum(loss.calls for loss in losses)
    try:
        yield
        if labelled and losses:
            _check_called(model, mods, sum(loss.calls for loss in losses) - before)
    finally:
        for loss in losses:
            del loss.axes[len(loss.axes) - len(spread):]
        for m in new:
            del m._loss_function


def _unfound(model: nn.Module, why: str) -> str:
    return (f"{type(model).__name__} was given labels, and dsfn cannot find the module that computes its own "
            f"loss ({why}), so it cannot make that loss the whole batch's token mean: it would be each rank's "
            "(or micro-batch's) own mean. Compute the loss in the train step from the logits instead, or pass "
            "num_items_in_batch= (the whole batch's count of valid targets / the data-parallel size) yourself")


def _check_called(model: nn.Module, mods: list[nn.Module], calls: int) -> None:
    """The proof that the loss dsfn normalised is the model's: labels were given, so one of the
    modules that define it (`mods`) must have called its `loss_function`."""
    if not calls:
        names = ", ".join(type(m).__name__ for m in mods)
        raise ConfigError(_unfound(model, f"the forward did not call the loss_function of {names}"))


def sequence_loss(split: SequenceSplit, inner: Any, module: nn.Module) -> Any:
    """A model's `loss_function` while it runs under sp (`split`: what sequence_parallel tells
    of this step's batch): HF's ForCausalLMLoss (`inner`) given the labels shifted over the
    whole sequence (`shift_labels`, so it does not shift inside the slice) and
    `num_items_in_batch` = the valid targets of the whole sp x dp batch / dp, so this rank's
    loss is dp * (its sum) / (the global count): summed over sp and averaged over dp (by the
    data-parallel transforms inside) it is the global token mean. Under `accumulate` the count
    spans every micro-batch of the step (`dsfn.adapters.MicroBatchCounts`)."""
    from dsfn.runtime import collectives as C
    from dsfn.runtime.mesh import current_mesh
    axis = split.axis

    def loss(logits, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
             shift_labels=None, **kw):
        given = shift_labels if shift_labels is not None else labels     # as the model got them
        labels = split.original(labels)
        shift_labels = split.original(shift_labels)
        c = logits.shape[1] if logits.dim() >= 2 else None
        if shift_labels is not None:
            if not split.batch_shifted:
                raise ConfigError(
                    f"sequence_parallel: {type(module).__name__} got shift_labels=, but the batch had none "
                    "before it was split over sp (sequence_parallel(shift_labels=False) and no "
                    "'shift_labels' key), so these labels were shifted inside this rank's slice and the "
                    "target of its last token is lost. Pass only labels= (the transform shifts them over the "
                    "whole sequence), or use sequence_parallel(shift_labels=True) and pass "
                    "shift_labels=batch['shift_labels']")
            target = shift_labels
        elif labels is not None and split.shifted is not None:
            # not contiguous (context parallel's head and tail chunks): the transform's shift of these labels
            target = split.shifted_of(labels)
            if target is None:
                raise ConfigError(
                    f"context_parallel: {type(module).__name__} got labels= that are not the batch's labels (as "
                    "the transform cut them, under context_parallel(shift_labels=True, labels_key=<their key>)); "
                    "their targets cannot be shifted inside this rank's chunks. Pass the batch's labels, or "
                    "shift_labels=batch['shift_labels']")
        elif labels is not None:
            target = _shift_over_sp(split, labels, ignore_index, module)
        else:
            return inner(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                         ignore_index=ignore_index, shift_labels=shift_labels, **kw)
        if target.dim() != 2 or target.shape[1] != split.local_len or c != split.local_len:
            raise ShapeError(
                f"sequence_parallel: {type(module).__name__}'s loss got labels of shape {tuple(target.shape)} "
                f"and logits of shape {tuple(logits.shape)}; under sp both must cover this rank's slice "
                f"[batch, {split.local_len}] of the batch's sequences (pass the batch's labels, or tensors "
                "made from its slices; no logits_to_keep)")
        target = target.contiguous()

        def reduce(n):
            n = n.reshape(1)
            for ax in (axis, *split.sum_axes, *split.dp_axes):
                n = C.all_reduce(n, ax, "sum")
            return n.reshape(())
        dp = 1
        for ax in split.dp_axes:
            dp *= current_mesh().size(ax)
        counts = micro_batch_counts()
        if num_items_in_batch is None and counts is not None:
            # under accumulate: the valid targets of the whole batch, every micro-batch's
            # (`dsfn.adapters.MicroBatchCounts`), / dp / the number of micro-batches
            shifted = shift_labels is not None
            shift = ((lambda t: t) if shifted else (lambda t: split.shifted_of(t)) if split.shifted is not None
                     else (lambda t: _shift_over_sp(split, t, ignore_index, module)))
            items = counts.num_items(
                given if counts.whole_of.get(id(given)) is not None else (shift_labels if shifted else labels),
                shift, ignore_index, reduce, dp, module)
        elif num_items_in_batch is None:
            items = reduce((target != ignore_index).sum().to(torch.float64)) / dp
        else:       # the caller's count of the whole batch (e.g. over accumulated micro-batches)
            items = torch.as_tensor(num_items_in_batch, dtype=torch.float64) / dp
        items = items.to(logits.device, torch.float32)      # the loss stays fp32 (HF upcasts logits)
        if not split.in_grad:
            # outside a gradient (evaluation): the value of the whole sp group (averaged over dp
            # by the metrics of data-parallel transforms), not differentiable
            with torch.no_grad():
                part = inner(logits, None, vocab_size, num_items_in_batch=items,
                             ignore_index=ignore_index, shift_labels=target, **kw)
                part = part.detach().reshape(1)
                for ax in (axis, *split.sum_axes):
                    part = C.all_reduce(part, ax, "sum")
                return part.reshape(())
        split.normalised()
        return inner(logits, None, vocab_size, num_items_in_batch=items,
                     ignore_index=ignore_index, shift_labels=target, **kw)
    return loss


def _shift_over_sp(split: SequenceSplit, labels: torch.Tensor, ignore_index: int, module: nn.Module) -> torch.Tensor:
    """labels [B, T/sp] (this rank's slice) -> the next token's label of every position, over
    the whole sequence: the last one is the next rank's first (ignore_index on the last rank)."""
    from dsfn.runtime import collectives as C
    from dsfn.runtime.mesh import current_mesh
    if labels.dim() != 2 or labels.shape[1] != split.local_len:
        raise ShapeError(f"sequence_parallel: {type(module).__name__} got labels of shape {tuple(labels.shape)}; "
                         f"under sp they must be this rank's slice [batch, {split.local_len}] of the batch's "
                         "sequences, which the transform shifts over the whole sequence")
    mesh = current_mesh()
    n, r = mesh.size(split.axis), mesh.local_rank(split.axis)
    firsts = C.all_gather(labels[:, :1].contiguous(), split.axis).reshape(n, labels.shape[0], 1)
    nxt = firsts[r + 1] if r + 1 < n else labels.new_full((labels.shape[0], 1), ignore_index)
    out = torch.cat([labels[:, 1:], nxt.to(labels.device, labels.dtype)], dim=1)
    # targets in the padding (labels made from the padded input_ids) are not the batch's
    c = split.local_len
    pos = torch.arange(r * c + 1, (r + 1) * c + 1, device=out.device)
    return out.masked_fill((pos >= split.real_len)[None], ignore_index)


@contextlib.contextmanager
def own_loss(model: nn.Module, split: SequenceSplit, args: tuple, kwargs: dict) -> Iterator[None]:
    """While the model runs under sequence parallelism, the `loss_function` of each module that
    computes its loss (`loss_modules`: the model itself, or the HF model inside peft / a wrapper)
    is `sequence_loss(split, inner, module)` (labels shifted over the whole sequence, normalised
    over the group; `split`: what dsfn.transforms.sequence_parallel tells of this step's
    batch), where `inner` is HF's `ForCausalLMLoss`. A model
    given labels whose loss is anything else, that holds no such module, or that computes its
    loss without `loss_function`, is an error: its loss would be over this rank's slice only."""
    labelled = _labels_passed(model, args, kwargs)
    causal = _causal_loss()
    name = type(model).__name__
    mods = detect.loss_modules(model)
    if labelled and not mods:
        raise ConfigError(f"sequence_parallel: {name} was given labels but no module of it defines a loss_function "
                          "(a Hugging Face model's), so dsfn cannot shift them over the whole sequence: its loss "
                          "would be over this rank's slice only. Compute the loss in the train step from the logits "
                          "instead (the transform weights it by token count)")
    targets = []
    for m in mods:
        current = getattr(m, "loss_function", None)
        if current is causal:
            targets.append(m)
        elif labelled:
            whose = "its" if m is model else f"the wrapped {type(m).__name__}'s"
            raise ConfigError(f"sequence_parallel: {name} was given labels and {whose} loss_function is "
                              f"{getattr(current, '__name__', current)!r}; under sequence "
                              "parallelism dsfn can make only HF's causal-LM loss (ForCausalLMLoss) exact over the "
                              "whole sequence. Compute the loss in the train step from the logits instead (the "
                              "transform weights it by token count)")
    calls = []

    def installed(m: nn.Module) -> Any:
        def loss(*a: Any, **k: Any) -> torch.Tensor:
            calls.append(1)
            return sequence_loss(split, causal, m)(*a, **k)
        return loss
    saved = [(m, "_loss_function" in m.__dict__, m.__dict__.get("_loss_function")) for m in targets]
    for m in targets:
        m._loss_function = installed(m)
    try:
        yield
    finally:
        for m, had, before in saved:
            if had:
                m._loss_function = before
            else:
                del m._loss_function
    if labelled and not calls:
        if kwargs.get("shift_labels") is not None and kwargs.get("labels") is None:
            # HF's causal LMs compute a loss only `if labels is not None`; shift_labels= alone is ignored
            raise ConfigError(f"sequence_parallel: {name} was given shift_labels= without labels=, and a Hugging "
                              "Face causal LM computes its loss only when labels= is given (its .loss is None). "
                              "Pass both: model(input_ids=..., labels=batch['labels'], "
                              "shift_labels=batch['shift_labels']) under sequence_parallel(shift_labels=True), "
                              "or labels= alone (the transform then shifts them over the whole sequence)")
        raise ConfigError(f"sequence_parallel: {name} was given labels but did not compute its loss with the "
                          f"loss_function of {', '.join(type(m).__name__ for m in mods)}, so dsfn cannot shift them "
                          "over the whole sequence: its loss would be over this rank's slice only. Compute the "
                          "loss in the train step from the logits instead")
