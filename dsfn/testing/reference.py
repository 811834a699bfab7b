"""`assert_matches_reference`: a stack of transforms on N ranks equals the single process.

The reference is the same `train_step` with no transforms, in this process, on the same
global batches. The stack runs on `world_size` gloo ranks (`run_on_ranks`); every rank
gathers its final state to logical form, and losses and the final logical state
(params and optimizer state) are compared leaf by leaf.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

import dsfn
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.ranks import run_on_ranks

LossFn = Callable[[Callable, Any, dict], torch.Tensor]


def mse_loss(apply_fn: Callable, params: Any, batch: dict) -> torch.Tensor:
    return torch.nn.functional.mse_loss(apply_fn(params, batch["x"]), batch["y"])


def lm_loss(apply_fn: Callable, params: Any, batch: dict) -> torch.Tensor:
    """Next-token cross-entropy; the model returns logits or a Hugging Face output (`.logits`)."""
    logits = apply_fn(params, batch["input_ids"])
    logits = getattr(logits, "logits", logits)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))


def hf_labels_loss(apply_fn: Callable, params: Any, batch: dict) -> torch.Tensor:
    """A Hugging Face causal LM's own loss as users write it: `labels=` (the model shifts them)."""
    return apply_fn(params, input_ids=batch["input_ids"], labels=batch["labels"]).loss


def hf_shift_labels_loss(apply_fn: Callable, params: Any, batch: dict) -> torch.Tensor:
    """DeepSpeed ALST's way: the batch's labels shifted before it is split (`shift_labels=`;
    HF computes a loss only when `labels` are given too)."""
    return apply_fn(params, input_ids=batch["input_ids"], labels=batch["labels"],
                    shift_labels=batch["shift_labels"]).loss


def with_shift_labels(batch: dict, ignore_index: int = -100) -> dict:
    """`batch` with "shift_labels": each row's labels moved one to the left, the last
    position ignored."""
    lab = batch["labels"]
    return {**batch, "shift_labels": torch.cat([lab[:, 1:], lab.new_full((lab.shape[0], 1), ignore_index)], dim=1)}


def mse_loss_fp32(apply_fn: Callable, params: Any, batch: dict) -> torch.Tensor:
    """`mse_loss` with the prediction promoted to fp32 (for bf16 / fp16 compute)."""
    return torch.nn.functional.mse_loss(apply_fn(params, batch["x"]).float(), batch["y"])


def train_step_for(apply_fn: Callable, loss_fn: LossFn = mse_loss) -> Callable:
    """The standard pure train step: gradients of `loss_fn`, one update, `{"loss": loss}`."""
    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lambda p, b: loss_fn(apply_fn, p, b))(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    return train_step


def run_steps(step: Any, state: Any, batches: Sequence[dict]) -> tuple[list[float], dict]:
    """Run `step` over `batches`; (the losses, the final logical {"params", "opt_state"})."""
    losses = []
    for batch in batches:
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    full = step.gather(state)
    return losses, {"params": full.params, "opt_state": full.opt_state}


@dataclass
class RunResult:
    losses: list[float]
    state: Any          # final logical TrainState
    metrics: list[dict]


def run_training(make_model: Callable[[], nn.Module], make_tx: Callable[[], Any], batches: Sequence[dict],
                 transforms: Sequence[Any] | Callable[[nn.Module], Sequence[Any]] = (), loss_fn: LossFn = mse_loss,
                 seed: int = 0) -> RunResult:
    """Train on this process/rank with `transforms` (a sequence, or `f(model) -> transforms`
    for transforms that need the model, e.g. tensor_parallel); returns losses and the
    gathered state."""
    torch.manual_seed(seed)
    model = make_model()
    apply_fn, params = dsfn.functionalize(model)
    if callable(transforms):
        transforms = transforms(model)
    step = dsfn.compose(*transforms)(train_step_for(apply_fn, loss_fn))
    state = step.place(dsfn.TrainState.create(params, make_tx(), seed=seed))
    losses, metrics = [], []
    for batch in batches:
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
        metrics.append({k: float(v) for k, v in m.items()})
    return RunResult(losses, step.gather(state), metrics)


def _strip(state: Any) -> dict:
    return {"params": state.params, "opt_state": state.opt_state, "step": state.step}


def assert_matches_reference(make_transforms: Callable[[], Sequence[Any]], make_model: Callable[[], nn.Module],
                             make_tx: Callable[[], Any], batches: Sequence[dict], world_size: int,
                             loss_fn: LossFn = mse_loss, rtol: float = 1e-5, atol: float = 1e-6,
                             seed: int = 0, timeout: float = 120.0,
                             make_reference_transforms: Callable[[], Sequence[Any]] = tuple
                             ) -> tuple[RunResult, list[RunResult]]:
    """Run the reference here and the stack on `world_size` ranks; assert they agree.

    `make_transforms` is called inside every rank (transforms may hold per-rank state).
    The reference is the single process with `make_reference_transforms()` (default: none;
    pass the transforms that change the math, e.g. clipping, to compare like with like).
    Returns (reference, per-rank results) for further checks.
    """
    ref = run_training(make_model, make_tx, batches, tuple(make_reference_transforms()), loss_fn, seed)

    def rank_fn():
        res = run_training(make_model, make_tx, batches, tuple(make_transforms()), loss_fn, seed)
        res.state = res.state.replace(tx=None)   # optimizers hold closures: not picklable
        return res

    results = run_on_ranks(rank_fn, world_size, timeout=timeout)
    for r, res in enumerate(results):
        assert torch.allclose(torch.tensor(res.losses, dtype=torch.float64),
                              torch.tensor(ref.losses, dtype=torch.float64), rtol=rtol, atol=atol), \
            f"rank {r} losses {res.losses} differ from the reference {ref.losses}"
        assert_trees_close(_strip(res.state), _strip(ref.state), rtol=rtol, atol=atol,
                           msg=f"rank {r} final state vs reference")
    return ref, results
