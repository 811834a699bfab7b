"""What `Step.explain` shows of `dsfn.estimate_memory`: the estimate of the stack for the
placed state it explains (`explain_estimate`), beside the bytes of its leaves
(`estimate_vs_measured`)."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from dsfn import tree
from dsfn.estimate import MemoryEstimate, estimate_memory, measured_state_bytes
from dsfn.transforms.compose import ESTIMATE_VIEW
from dsfn.estimate_activations import activation_detail, human_bytes, pipeline_line

__all__ = ["estimate_vs_measured", "explain_estimate"]


def explain_estimate(stack: Sequence[Any], state: Any, batch: Any = None) -> MemoryEstimate | None:
    """`estimate_memory` for `Step.explain`: the logical shapes of `state.params` (a placed
    state), the state's optimizer and the current mesh; with pipeline_parallel, this rank's
    index along its axis and the (rows, seq_len) of `batch`'s first 2-D tensor (its token
    ids, for the modelled activations). None (with a warning) when the stack holds something
    the estimate cannot read."""
    import warnings
    from dsfn.runtime import env
    from dsfn.runtime.mesh import current_mesh
    from dsfn.state.layout import Placed, is_placed
    from dsfn.transforms.facts import StackFacts
    try:
        shapes, dtype = {}, None
        for path, x in tree.leaves_with_path(state.params, is_leaf=is_placed):
            t = x.data if isinstance(x, Placed) else x
            if isinstance(t, torch.Tensor):
                shapes[path] = tuple(x.layout.shape) if isinstance(x, Placed) else tuple(t.shape)
                dtype = dtype or t.dtype
        if not shapes or getattr(state, "tx", None) is None:
            return None
        mesh, whole = current_mesh(), StackFacts(tuple(stack)).whole
        if whole.first("compute_dtype") is not None:      # mixed precision: the logical parameters are the masters'
            dtype = whole.first("master_dtype")
        pp_axis = whole.first("pp_axis")
        pp = mesh.size(pp_axis) if pp_axis is not None else 1
        pp_rank = mesh.local_rank(pp_axis) if pp_axis is not None else None
        return estimate_memory(shapes, stack, env.world_size(), tx=state.tx, tp=mesh.size("tp"),
                               sp=mesh.size("sp"), pp=pp, pp_rank=pp_rank, batch=_tokens_shape(batch), dtype=dtype)
    except Exception as e:    # noqa: BLE001  (explain still reports what it measured)
        warnings.warn(f"explain: no memory estimate for this stack ({type(e).__name__}: {e})", stacklevel=3)
        return None


def _tokens_shape(batch: Any) -> tuple[int, int] | None:
    """(rows, seq_len) of a batch's first 2-D tensor (token ids), or None."""
    for x in tree.leaves(batch) if batch is not None else ():
        if isinstance(x, torch.Tensor) and x.dim() == 2:
            return int(x.shape[0]), int(x.shape[1])
    return None


def estimate_vs_measured(est: MemoryEstimate, explanation: Any) -> str:
    """The estimate's state fields beside `Step.explain`'s measured bytes, one line each."""
    measured = measured_state_bytes(explanation)
    lines = ["memory per rank (estimate | measured state leaves):"]
    if est.pipeline_schedule is not None:
        lines.append(pipeline_line(est))
    for k in ("params", "optimizer", "master", "host", "nvme"):
        lines.append(f"  {k:13s} {human_bytes(getattr(est, k))} | {human_bytes(measured[k])}")
    for k in ("grads", "largest_unit", "buckets"):
        lines.append(f"  {k:13s} {human_bytes(getattr(est, k))} | (transient, not measured)")
    if est.pipeline_schedule is not None:
        lines.append(f"  {'activations':13s} {human_bytes(est.activations)} | (transient, not measured; "
                     f"{activation_detail(est)})")
    return "\n".join(lines)


ESTIMATE_VIEW.update(estimate=explain_estimate, compare=estimate_vs_measured)
