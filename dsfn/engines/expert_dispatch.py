"""Token dispatch for expert parallelism: each token's top-k assignments travel to the ranks
that hold their experts and come back weighted by the gate (the machinery under
`dsfn.transforms.expert_parallel`, which holds the policy). Imports no transform.

Layout. The `ep` axis has n ranks; an experts module holds E experts as fused tensors with
the expert on dim 0 (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]: transformers 5's
`MixtralExperts`, `Qwen3MoeExperts`, ...). Rank r of the ep group holds experts
[r*E/n, (r+1)*E/n) (a `DimShard("ep", 0)` piece, L = E/n experts).

One dispatch (`ExpertDispatch.run`) for T local tokens, k assignments each ([T, k] expert
ids and gate weights, from the router that ran locally):

1. Assignments in priority order: every token's first choice in token order, then every
   second choice, ... (slot-major: DeepSpeed's top-2 gating keeps first choices before
   second ones, Megatron's "position" drop order).
2. With a `capacity` (capacity_factor): expert e keeps its first C assignments of this
   rank in that order, C = max(min_capacity, ceil(capacity_factor * T * k / E)) (DeepSpeed's
   `_capacity`, per rank: its `top1gating` / `top2gating` count this rank's tokens); the
   rest are dropped: their contribution is 0 and the gate weights are not renormalised
   (the residual stream carries the token, as in DeepSpeed and Megatron). Dropless without.
3. The kept assignments sorted by expert (hence by owner), their per-expert counts
   exchanged (one all-to-all of n*L ints), their hidden states sent with a variable-size
   all-to-all (`all_to_all_rows`).
4. The owner runs its L experts over what arrived with the module's own forward (HF's
   experts implementation: grouped matmuls where configured), ids local, gate weight 1.
5. The outputs go back with the reverse all-to-all; each is weighted by its gate in the
   source rank and summed per token (`index_add`), in the hidden dtype.

Gradients. Backward runs both exchanges in reverse. The experts' gradients then hold the
contributions of every ep rank's tokens, i.e. the sum of n ranks' losses, where the
data-parallel average over the whole batch wants their mean: the return exchange's
backward scales by 1/n (so the experts' weight gradients are the mean) and the dispatch's
backward by n (so the tokens' input gradients are unchanged). Exact for a power-of-two n.
The non-expert parameters' gradients are averaged over ep by the transform.

Every rank runs both exchanges of every layer in forward and in backward, whatever its
tokens chose (a rank whose experts receive nothing still joins them).

Bytes: the dispatch sends this rank's kept rows S (S = T * k when dropless), the return
sends back the R rows it received, each H elements of the hidden dtype; backward sends the
same again (the return's gradient S rows, the dispatch's R): 2 (S + R) H bytes-per-element
per layer and step on this rank, plus the counts (n L int64, forward). Summed over the ep
group, sum R = sum S: 4 x (tokens x k) x H per layer, the closed form; one rank's share
depends on its routing (R: what its experts were sent).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from dsfn.runtime import collectives as C
from dsfn.runtime.mesh import current_mesh

__all__ = ["ExpertDispatch", "DispatchStats", "capacity_of", "kept_assignments"]


def capacity_of(tokens: int, k: int, experts: int, capacity_factor: float, min_capacity: int) -> int:
    """Assignments of one rank an expert keeps: max(min_capacity, ceil(cf * tokens * k / E))."""
    return max(int(min_capacity), math.ceil(capacity_factor * tokens * k / experts))


def kept_assignments(top_k_index: torch.Tensor, experts: int, capacity: int | None) -> torch.Tensor:
    """The flat assignment positions p = t * k + j ([T, k] row-major) that are kept, sorted by
    expert and, within an expert, in priority order (slot j first, then token t; module
    docstring); with `capacity`, each expert's first `capacity` of them. Deterministic."""
    t, k = top_k_index.shape
    idx = top_k_index.reshape(-1).long()
    pos = torch.arange(t * k, device=idx.device)
    priority = (pos % k) * t + pos // k                 # slot-major
    order = torch.argsort(idx * (t * k) + priority, stable=True)
    if capacity is None:
        return order
    counts = torch.bincount(idx, minlength=experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(order.numel(), device=idx.device) - starts[idx[order]]
    return order[rank_in_expert < capacity]


class _Exchange(torch.autograd.Function):
    """Rows to the ep ranks (`send` counts out, `recv` counts in); backward sends the row
    gradients back the other way, scaled by `grad_scale` (module docstring)."""

    @staticmethod
    def forward(ctx, x, send, recv, axis, grad_scale):
        ctx.send, ctx.recv, ctx.axis, ctx.grad_scale = send, recv, axis, grad_scale
        return C.all_to_all_rows(x, send, recv, axis)

    @staticmethod
    def backward(ctx, grad):
        back = C.all_to_all_rows(grad.contiguous(), ctx.recv, ctx.send, ctx.axis)
        if ctx.grad_scale != 1:
            back = back * ctx.grad_scale
        return back, None, None, None, None


@dataclass
class DispatchStats:
    """What the step's dispatches did on this rank (summed over layers and micro-batches):
    assignments routed to each expert (kept and dropped), assignments dropped, and the rows
    and bytes the exchanges sent in forward."""

    experts: int
    routed: torch.Tensor | None = None           # [E] int64: assignments per expert, before drops
    dropped: int = 0
    assignments: int = 0
    rows_sent: int = 0
    bytes_sent: int = 0
    # per dispatch: (module name, rows this rank sends, rows it receives, bytes per row)
    layers: list = field(default_factory=list)
    per_layer: dict = field(default_factory=dict)    # module name -> [E] assignments (summed over its calls)

    def add(self, name: str, idx: torch.Tensor, kept: int, received: int, row_bytes: int) -> None:
        counts = torch.bincount(idx.reshape(-1).long(), minlength=self.experts).cpu()
        self.routed = counts if self.routed is None else self.routed + counts
        self.per_layer[name] = counts if name not in self.per_layer else self.per_layer[name] + counts
        self.assignments += idx.numel()
        self.dropped += idx.numel() - kept
        self.rows_sent += kept
        # forward: the dispatch sends this rank's kept rows, the return the rows it received
        self.bytes_sent += (kept + received) * row_bytes
        self.layers.append((name, kept, received, row_bytes))


class ExpertDispatch:
    """The dispatch of one experts module over `axis` (module docstring). `experts` is E
    (global), `capacity_factor` None for dropless."""

    def __init__(self, axis: str, experts: int, capacity_factor: float | None, min_capacity: int = 0):
        self.axis, self.experts = axis, experts
        self.capacity_factor, self.min_capacity = capacity_factor, min_capacity

    def run(self, module: nn.Module, forward, hidden: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor, stats: DispatchStats | None = None, name: str = "") -> torch.Tensor:
        """The experts' combined output [T, H] for `hidden` [T, H] routed by `top_k_index` /
        `top_k_weights` [T, k]; `forward(hidden, index, weights)` is the module's own forward
        (or what the layer events hand down), run here on this rank's experts."""
        mesh = current_mesh()
        n = mesh.size(self.axis)
        e, (t, k) = self.experts, top_k_index.shape
        local = e // n
        capacity = (None if self.capacity_factor is None else
                    capacity_of(t, k, e, self.capacity_factor, self.min_capacity))
        with torch.no_grad():
            order = kept_assignments(top_k_index, e, capacity)
            chosen = top_k_index.reshape(-1).long()[order]
            per_expert = torch.bincount(chosen, minlength=e)
            # how many rows each owner sends me, per my local expert: [n sources, L]
            incoming = C.all_to_all(per_expert.reshape(n, local).contiguous(), self.axis).reshape(n, local)
            counts = torch.stack([per_expert.reshape(n, local).sum(1), incoming.sum(1)]).tolist()
            send, recv = counts[0], counts[1]
            # the local expert of every arriving row: by source, then by expert
            local_ids = torch.repeat_interleave(torch.arange(local, device=hidden.device).repeat(n),
                                                incoming.reshape(-1).to(hidden.device))
        if stats is not None:
            stats.add(name, top_k_index, order.numel(), sum(recv), hidden.shape[-1] * hidden.element_size())
        tokens = order // k
        rows = _Exchange.apply(hidden[tokens], send, recv, self.axis, float(n))
        ones = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
        saved = module.num_experts
        module.num_experts = local          # the module's forward sizes its one-hot by it
        try:
            out = forward(rows, local_ids.unsqueeze(1), ones)
        finally:
            module.num_experts = saved
        if rows.requires_grad and not out.requires_grad:
            # no expert of this rank ran (nothing arrived): the output still depends on the rows,
            # so backward runs both exchanges here as on the ranks they talk to
            out = out + rows.sum() * 0
        back = _Exchange.apply(out, recv, send, self.axis, 1.0 / n)
        weights = top_k_weights.reshape(-1)[order].unsqueeze(1)
        contrib = (back * weights).to(hidden.dtype)
        return torch.zeros_like(hidden).index_add(0, tokens, contrib)
