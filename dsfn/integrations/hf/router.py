"""A mixture-of-experts model's router load-balancing loss over the whole batch.

`global_router_balance(model, sum_axes, mean_axes)` is a context: while it is active the
model's module-level `load_balancing_loss_func` (Mixtral, Qwen2/3-MoE, OLMoE, ...) is
`_GlobalRouterBalance`, which sums the routing statistics over the data / sequence
parallel axes so that the ranks' losses add up to the single-process loss of the whole
batch. Whether a function is HF's Switch-style balance loss is decided once per function
(`_switch_balance_loss`, cached).
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dsfn.adapters import micro_batch_counts
from dsfn.errors import ConfigError
from dsfn.integrations.hf import detect


class _GlobalRouterBalance:
    """A mixture-of-experts model's `load_balancing_loss_func` (Switch Transformer's auxiliary
    loss, E * sum_i f_i * P_i: f_i the share of top-k assignments to expert i, P_i its mean
    router probability) over the *whole* batch while dsfn runs the model.

    HF's function computes f and P over the router logits it is given: under data or
    sequence parallelism, this rank's rows only. The loss is not linear in the rows, so the
    mean (dp) or sum (sp) of the ranks' losses is not the batch's: under sp it even counts
    the loss sp times. Here the assignment counts and row counts (no gradient) are summed
    over every axis in `sum_axes` (sp: the ranks' losses are summed) and `mean_axes` (dp:
    averaged), and this rank returns its share dp * E * sum_i f_i * (its probability sum_i /
    rows): summed over sp and averaged over dp that is the whole batch's loss, with the
    gradient of each rank's router probabilities. Same arithmetic as HF's (attention mask
    included). Under `accumulate` the loss of the whole batch would need every micro-batch's
    routing before the first backward: refused (ConfigError)."""

    def __init__(self, original: Any, model: nn.Module):
        self.original, self.model = original, model
        self.known = _switch_balance_loss(original)
        self.sum_axes: dict[str, int] = {}
        self.mean_axes: dict[str, int] = {}
        self.valid: torch.Tensor | None = None    # [T] positions that are tokens (sp's padding is not)

    def __call__(self, gate_logits, num_experts=None, top_k=2, attention_mask=None):
        if gate_logits is None or not isinstance(gate_logits, tuple) or not gate_logits:
            return self.original(gate_logits, num_experts, top_k, attention_mask)
        if micro_batch_counts() is not None:
            raise ConfigError(
                f"accumulate: {type(self.model).__name__} adds its router load-balancing loss "
                "(output_router_logits=True), which is not linear in the batch's rows: summed over "
                "micro-batches it is not the whole batch's loss, and the whole batch's routing is known only "
                "after every micro-batch ran. Use a larger batch per step without accumulate, or set "
                "output_router_logits=False and add an auxiliary loss of your own")
        axes = [(a, n) for a, n in {**self.sum_axes, **self.mean_axes}.items() if n > 1]
        if not axes:
            return self.original(gate_logits, num_experts, top_k, attention_mask)
        if not self.known:
            raise ConfigError(
                f"{type(self.model).__name__} adds a router load-balancing loss (output_router_logits=True) "
                f"computed by {type(self.model).__module__}.load_balancing_loss_func, whose arithmetic dsfn "
                f"does not know, over this rank's rows only: under {', '.join(a for a, _ in axes)} it would not be "
                "the whole batch's. Set output_router_logits=False (and add an auxiliary loss of your own), or "
                "train without data / sequence parallelism")
        from dsfn.runtime import collectives as C
        dev = gate_logits[0].device
        counts = torch.zeros(num_experts, dtype=torch.float32, device=dev)
        probs = torch.zeros(num_experts, dtype=torch.float32, device=dev)
        rows = torch.zeros((), dtype=torch.float32, device=dev)
        mask = attention_mask.reshape(-1).to(dev, torch.float32) if attention_mask is not None else None
        if mask is None and self.valid is not None:     # rows are [batch, T] row-major
            t = self.valid.numel()
            mask = self.valid.to(dev, torch.float32).expand(gate_logits[0].shape[0] // t, t).reshape(-1)
        for layer in gate_logits:
            weights = torch.nn.functional.softmax(layer.to(dev), dim=-1)
            _, chosen = torch.topk(weights, top_k, dim=-1)
            each = (mask.repeat_interleave(top_k) if mask is not None
                    else torch.ones(chosen.numel(), dtype=torch.float32, device=dev))
            counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen.reshape(-1), each)
            w = weights.float() if mask is None else weights.float() * mask.unsqueeze(-1)
            probs = probs + w.sum(dim=0)
            rows = rows + (mask.sum() if mask is not None else weights.shape[0])
        stats = torch.cat([counts, rows.reshape(1)]).detach()
        for a, _ in axes:
            stats = C.all_reduce(stats, a, "sum")
        dp = 1
        for n in self.mean_axes.values():
            dp *= n
        total = stats[-1]
        return torch.sum((stats[:-1] / total) * (probs / total)) * (num_experts * dp)


_KNOWN_BALANCE: dict[Any, bool] = {}


def _switch_balance_loss(fn: Any) -> bool:
    """Whether `fn` is HF's Mixtral-style `load_balancing_loss_func(gate_logits, num_experts,
    top_k, attention_mask)` (Mixtral, Qwen2/3-MoE, OLMoE, ... : softmax router, top-k
    assignment shares times mean probabilities), which `_GlobalRouterBalance` reproduces;
    other routers (product keys, Switch's router_probs) are not."""
    if fn not in _KNOWN_BALANCE:
        try:
            names = list(inspect.signature(fn).parameters)
            source = inspect.getsource(fn)
        except (TypeError, ValueError, OSError):
            names, source = [], ""
        _KNOWN_BALANCE[fn] = (names == ["gate_logits", "num_experts", "top_k", "attention_mask"]
                              and "tokens_per_expert" in source and "router_prob" in source
                              and "num_keys" not in source)
    return _KNOWN_BALANCE[fn]


@contextlib.contextmanager
def global_router_balance(model: nn.Module, sum_axes: list[str], mean_axes: list[str],
                          valid: torch.Tensor | None = None) -> Iterator[None]:
    """While the model runs: its module's `load_balancing_loss_func` (when it has one: Mixtral,
    Qwen2-MoE, ...) is the whole batch's over `sum_axes` (summed, sp) and `mean_axes`
    (averaged, dp); see `_GlobalRouterBalance`. Nested contexts add their axes. `valid`
    ([T] bool, this rank's positions): which are tokens, when the model gets no attention
    mask (sequence parallel's padding to a multiple of sp)."""
    from dsfn.runtime.mesh import current_mesh
    home = fn = None
    for m in detect.loss_modules(model) or [model]:        # a wrapped model's (peft): the inner model's module
        home = sys.modules.get(type(m).__module__)
        fn = getattr(home, "load_balancing_loss_func", None)
        if callable(fn):
            model = m
            break
    if not callable(fn):
        yield
        return
    mesh = current_mesh()
    installed = fn if isinstance(fn, _GlobalRouterBalance) else _GlobalRouterBalance(fn, model)
    added = []
    for axes, into in ((sum_axes, installed.sum_axes), (mean_axes, installed.mean_axes)):
        for a in axes:
            if a not in into:
                into[a] = mesh.size(a)
                added.append((into, a))
    before = installed.valid
    if valid is not None:
        installed.valid = valid
    home.load_balancing_loss_func = installed
    try:
        yield
    finally:
        installed.valid = before
        for into, a in added:
            del into[a]
        if installed is not fn:
            home.load_balancing_loss_func = fn
