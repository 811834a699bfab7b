"""`accumulate(n)`: gradient accumulation over n micro-batches, one optimizer step.

Handles the gradient primitive: the batch arguments' leading dimension is split into n
equal micro-batches (each announced through the "micro_batch" primitive as its forward begins), the differentiated function runs once per micro-batch with its
loss multiplied by 1/n (the only place the loss is scaled for accumulation), and the
gradients and values are summed — the mean over the whole batch. Any reduction a
transform further out does inside backward (ZeRO-2/3 reduce-scatter) therefore happens
per micro-batch into the shard; stage 0/1 and data parallel reduce once, at the end.

A Hugging Face causal LM's own loss (`labels=`) is a mean over the valid targets, which
differ between micro-batches (padding, prompts): the mean of the micro-batch means is not
the whole batch's mean. While the micro-batches run, that loss divides by the valid targets
of the whole batch (with data parallel: of the global batch), counted once from the batch
tensor its labels are a slice of (`dsfn.adapters.MicroBatchCounts`), as Hugging Face
Trainer's `num_items_in_batch` does: the sum over micro-batches is the batch's token mean.

The batch must reach the differentiated function as arguments
(`value_and_grad(lambda p, b: loss(p, b))(params, batch)`): a batch captured by a closure
cannot be split, and is refused (ConfigError) rather than run n times whole.
"""
from __future__ import annotations

from typing import Any

from dsfn import tree
from dsfn.adapters import MicroBatchCounts, adapter_for, micro_batches
from dsfn.engines.micro_batches import slice_micro_batches
from dsfn.errors import ConfigError, StackError
from dsfn.functional import MicroBatch, micro_batch_begins
from dsfn.transforms.core import Transform, make_transform


class Accumulate(Transform):
    name = "accumulate"
    roles = frozenset({"accumulate"})

    def __init__(self, n: int):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"accumulate(n={n!r}): the number of micro-batches is an int >= 1")
        self.n = n

    def handle_value_and_grad(self, call_next, fn, params, args, kwargs, has_aux):
        if self.n == 1:
            return call_next(fn, params, args, kwargs, has_aux)
        micro, whole_of = slice_micro_batches(args, kwargs, self.n, f"accumulate({self.n})")
        inv = 1.0 / self.n

        def scaled(p, *a, **k):
            out = fn(p, *a, **k)
            return (out[0] * inv, out[1]) if has_aux else out * inv
        total_v, total_g, spec, auxes = None, None, None, []
        with micro_batches(MicroBatchCounts(self.n, whole_of)):
            for j, (a, k) in enumerate(micro):
                micro_batch_begins(MicroBatch(j, "forward", self.n))
                value, grads = call_next(scaled, params, a, k, has_aux)
                if has_aux:
                    value, aux = value
                    auxes.append(aux)
                total_v = value if total_v is None else total_v + value
                # one gradient sum held between micro-batches: the micro-batch's own gradients
                # are dropped as they are added, a leaf at a time (a whole-tree add would hold
                # the old sum, the new one and the addend at once, and the addend stayed
                # bound through the next micro-batch's forward)
                leaves, mb_spec = tree.flatten(grads)
                del grads
                if total_g is None:
                    total_g, spec = leaves, mb_spec
                else:
                    if mb_spec != spec:      # the leaf-wise sum pairs leaves by position
                        raise StackError(f"accumulate({self.n}): micro-batch {j}'s gradients have another tree "
                                         f"structure than micro-batch 0's ({mb_spec} vs {spec})")
                    for i in range(len(leaves)):
                        total_g[i] = total_g[i] + leaves[i]
                        leaves[i] = None
                del leaves
        return ((total_v, auxes) if has_aux else total_v), tree.unflatten(spec, total_g)

    def handle_apply_module(self, call_next, apply_fn, params, args, kwargs):
        """A model's own loss (a Hugging Face causal LM given labels) is the whole batch's
        token mean, through its adapter (module docstring)."""
        module = getattr(apply_fn, "module", None)
        adapter = adapter_for(module) if self.n > 1 else None
        if adapter is None:
            return call_next(apply_fn, params, args, kwargs)
        with adapter.token_mean_over(module, [], args, kwargs):
            return call_next(apply_fn, params, args, kwargs)


def accumulate(*args: Any, **kwargs: Any) -> Accumulate:
    """`accumulate(n)`; see the module docstring."""
    return make_transform(Accumulate, "accumulate", args, kwargs)
