"""Cutting a differentiated function's batch arguments into micro-batches: the one piece of
machinery `accumulate(n)` and `pipeline_parallel(microbatches=m)` share. Imports no transform.

Every tensor argument's leading (batch) dimension is cut into n equal slices, in order;
other arguments are passed to every micro-batch unchanged. `whole_of` maps each slice
(by id) to the batch tensor it was cut from, which a model's adapter uses to count the
whole batch's valid targets (`dsfn.adapters.MicroBatchCounts`).
"""
from __future__ import annotations

from typing import Any

import torch

from dsfn import tree
from dsfn.errors import ConfigError, ShapeError

__all__ = ["slice_micro_batches"]


def slice_micro_batches(args: Any, kwargs: Any, n: int, who: str) -> tuple[list[tuple[Any, Any]], dict[int, Any]]:
    """([(args_i, kwargs_i) for each of the n micro-batches], whole_of). A ConfigError when
    no argument is a tensor (a batch captured by a closure cannot be cut), a ShapeError
    naming the input when a leading dimension is not a multiple of n. `who` names the
    transform in the messages (e.g. "accumulate(4)")."""
    wholes = tree.leaves((args, kwargs))
    if not any(isinstance(x, torch.Tensor) for x in wholes):
        raise ConfigError(f"{who}: the differentiated function was given no batch tensors to split into "
                          "micro-batches (a batch captured by a closure is invisible to it). Pass the batch as an "
                          "argument: value_and_grad(lambda p, b: loss(p, b))(params, batch)")

    def take(i: int):
        def cut(path: str, x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if x.dim() == 0 or x.shape[0] % n:
                raise ShapeError(f"{who}: input {path or '<arg>'!r} has shape {tuple(x.shape)}; its leading "
                                 f"(batch) dimension must be a multiple of {n}")
            rows = x.shape[0] // n
            return x[i * rows:(i + 1) * rows]
        return tree.map_with_path(cut, args), tree.map_with_path(cut, kwargs)
    micro = [take(i) for i in range(n)]
    whole_of = {}
    for part_tree in micro:
        for part, whole in zip(tree.leaves(part_tree), wholes):
            if isinstance(part, torch.Tensor) and part is not whole:
                whole_of[id(part)] = whole
    return micro, whole_of
