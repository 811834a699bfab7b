"""A stage's backward split in two passes (zero-bubble's B and W): the input gradient now,
the weight gradients later, about one backward's work in all.

Given a stage's output `out` (its activation, or the last stage's scalar loss), the gradient
arriving for it (None for a loss) and the stage's input activation `h_in` (a leaf that
requires grad; None on the first stage):

- `backward_input(out, grad, h_in, weights)` (B) runs autograd towards `h_in` alone
  (`torch.autograd.backward(..., inputs=[h_in])`): a node that feeds both (a linear layer's
  addmm) computes only its input branch, the weight branches do not run. On the way it keeps
  the gradients arriving at the *boundary* nodes — the nodes on the input's path whose other
  edges lead to weights — with a pre-hook; `h_in.grad` is filled, the weights' `.grad` are
  not. Returns a `WeightGrad`. With no input to differentiate (the first stage, or an output
  that does not depend on `h_in`), nothing runs: the whole backward is W's.
- `WeightGrad.run()` (W) re-enters the graph at those boundary nodes with the kept gradients
  and runs only their weight branches (`torch.autograd.backward(edges, grads,
  inputs=weights)`), so the weights' `.grad` are accumulated by autograd's own AccumulateGrad,
  as the whole backward would. Then the graph (kept alive by B's `retain_graph`, for W) is
  released: after `run()` the WeightGrad holds nothing.

The boundaries are found per call by walking the autograd graph from `out`: the input's
closure is every node from which `h_in`'s accumulator is reachable; from each weight's
accumulator the walk goes up (towards `out`) until it meets that closure. Weights meeting a
common boundary form one group, run by one autograd call; groups are independent (no node
of one group's weight branches is in another's), so a group's call recomputes nothing of
another's. A group with several boundaries (a weight used twice on the input's path) may
recompute the input-path nodes between them; a pre-hook then replaces each boundary's
incoming gradients with the kept ones, so nothing is counted twice. This is the method of
torch.distributed.pipelining's `stage_backward_input` / `stage_backward_weight`.

Work: B + W runs each node's input and weight branches once each, as one backward does,
plus (per B) a walk of the graph in Python, O(nodes). Memory: between B and W the whole
stage graph is kept (saved activations and the boundary gradients); W frees it.
Imports no transform.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from dsfn.errors import ConfigError

__all__ = ["WeightIndex", "WeightGrad", "backward_input"]


class WeightIndex:
    """The weights (leaf tensors requiring grad) a stage's W fills, by their autograd
    accumulator node. Build it once and reuse it: holding the accumulators keeps each
    leaf's node the same object through every forward that uses it."""

    def __init__(self, weights: Sequence[torch.Tensor]):
        self.by_node: dict[Node, torch.Tensor] = {}
        self._edges = []
        for w in weights:
            if not (isinstance(w, torch.Tensor) and w.requires_grad and w.grad_fn is None):
                what = (type(w).__name__ if not isinstance(w, torch.Tensor) else
                        "a tensor that does not require grad" if not w.requires_grad else
                        f"a non-leaf tensor (made by {type(w.grad_fn).__name__})")
                raise ConfigError(f"the weights of a split backward are leaf tensors that require grad (the "
                                  f"parameters as the forward uses them), got {what}: pass the leaves")
            edge = get_gradient_edge(w)
            self._edges.append(edge)
            self.by_node[edge.node] = w


class WeightGrad:
    """What B kept for W (module docstring). `groups`: per group, the kept (boundary node,
    its incoming gradients) pairs and the group's weights. `whole`: when B found no input
    to differentiate, (out, grad) for a whole backward at W. `run()` once."""

    def __init__(self, groups: list[tuple[list[tuple[Node, tuple]], list[torch.Tensor]]],
                 whole: tuple[torch.Tensor, torch.Tensor | None] | None):
        self.groups, self.whole = groups, whole
        self.done = False

    def run(self) -> None:
        """Accumulate the weights' gradients into their `.grad`; frees the kept graph."""
        if self.done:
            raise ConfigError("a stage's weight gradient (W) ran twice for one backward: each B has one W")
        self.done = True
        if self.whole is not None:
            out, grad = self.whole
            self.whole = None
            torch.autograd.backward(out, grad)
        groups, self.groups = self.groups, []
        for kept, weights in groups:
            roots, grads = [], []
            for node, incoming in kept:
                for i, g in enumerate(incoming):
                    if g is not None:
                        roots.append(GradientEdge(node, i))
                        grads.append(g)
            if not roots:
                continue
            handles = []
            if len(kept) > 1:
                # a boundary below another of the group gets, besides its own root gradient,
                # what flows down from the upper one: clamp it to what B saw arrive
                for node, incoming in kept:
                    handles.append(node.register_prehook(lambda _g, fixed=incoming: fixed))
            try:
                torch.autograd.backward(roots, grads, inputs=weights)
            finally:
                for h in handles:
                    h.remove()


def _parents(root: Node) -> dict[Node, list[Node]]:
    """Every node reachable from `root` -> the nodes whose next_functions name it."""
    parents: dict[Node, list[Node]] = {root: []}
    stack = [root]
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if nxt not in parents:
                parents[nxt] = []
                stack.append(nxt)
            parents[nxt].append(node)
    return parents


def _up(starts: Sequence[Node], parents: dict[Node, list[Node]], stop: set[Node] | frozenset = frozenset()
        ) -> tuple[set[Node], set[Node]]:
    """Nodes reached from `starts` towards the output (through `parents`), not entering
    `stop`: (reached, the `stop` nodes met)."""
    seen, met = set(starts), set()
    stack = list(starts)
    while stack:
        for up in parents[stack.pop()]:
            if up in stop:
                met.add(up)
            elif up not in seen:
                seen.add(up)
                stack.append(up)
    return seen, met


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, h_in: torch.Tensor | None,
                   weights: WeightIndex) -> WeightGrad:
    """B: fill `h_in.grad` with d(out)/d(h_in) applied to `grad` (ones for a scalar loss,
    `grad=None`), leaving the weights' `.grad` untouched; returns the `WeightGrad` W runs
    (module docstring). `out` must not be used afterwards (its graph belongs to W now)."""
    root = out.grad_fn
    if root is None:
        raise ConfigError("a stage's output does not depend on anything that requires grad: nothing to "
                          "back-propagate (the stage's forward ran without autograd recording?)")
    if h_in is None or not h_in.requires_grad:
        return WeightGrad([], (out, grad))         # the first stage: all of its backward is W's
    parents = _parents(root)
    h_node = get_gradient_edge(h_in).node
    if h_node not in parents:
        return WeightGrad([], (out, grad))         # no input gradient to compute: all of it is W's
    closure, _ = _up([h_node], parents)
    # group the weights by the boundary nodes where their branches meet the input's path
    group_of: dict[Node, int] = {}
    groups: list[tuple[set[Node], list[torch.Tensor]]] = []
    for node, w in weights.by_node.items():
        if node not in parents:
            continue                               # not used by this stage
        _, met = _up([node], parents, closure)
        ids = sorted({group_of[b] for b in met if b in group_of})
        target = ids[0] if ids else len(groups)
        if not ids:
            groups.append((set(), []))
        for other in ids[1:]:                      # this weight joins groups: merge them
            groups[target][0].update(groups[other][0])
            groups[target][1].extend(groups[other][1])
            for b in groups[other][0]:
                group_of[b] = target
            groups[other] = (set(), [])
        groups[target][0].update(met)
        groups[target][1].append(w)
        for b in met:
            group_of[b] = target
    kept: dict[Node, tuple] = {}
    boundaries = [b for bs, _ in groups for b in bs]

    def keep(node: Node):
        def hook(grad_outputs: tuple) -> None:
            kept[node] = grad_outputs
        return hook
    handles = [b.register_prehook(keep(b)) for b in boundaries]
    try:
        torch.autograd.backward(out, grad, inputs=[h_in], retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return WeightGrad([([(b, kept[b]) for b in bs if b in kept], ws) for bs, ws in groups if ws], None)
