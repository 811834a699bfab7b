"""Which parameters get Muon (DeepSpeed's `set_optimizer_flags`), and per-head Muon's head counts.

`default_use_muon(path, x)` is DeepSpeed's rule (`ndim >= 2`, no "embed" / "lm_head" in the
dotted path); `mask=` overrides it. `choose_muon(params, mask, num_heads, num_kv_heads)`
gives the per-leaf choice `(use_muon, heads)` that `dsfn.optim.muon` keeps as static state;
`muon_split` shows it by path; `check_some_muon` refuses (or, allowed, warns about) a choice
with no Muon parameter at all. See `dsfn.optim.muon`'s docstring for the rules.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from dsfn import logical, tree
from dsfn.errors import ConfigError
from dsfn.optim.base import PyTree, tensor_leaves
from dsfn.optim.masks import Mask, as_bool, evaluate_mask
from dsfn.placed import is_placed

__all__ = ["HeadsFn", "check_heads", "check_some_muon", "choose_muon", "default_use_muon", "muon_split"]

# Attention projection names for `num_heads=<int>` (DeepSpeed's leaf-module classification):
# the per-head split is on dim 0, so only projections whose *output* is blocked by heads.
_QUERY_LEAVES = ("q_proj", "query", "wq")
_KV_LEAVES = ("k_proj", "key", "wk", "v_proj", "value", "wv")
_NOT_HEAD_BLOCKED = ("qkv_proj", "query_key_value", "c_attn", "in_proj_qkv", "wqkv",
                     "q_a_proj", "kv_a_proj", "q_b_proj", "kv_b_proj")

HeadsFn = Callable[[str, torch.Tensor], int | None]


# which parameters get Muon


def default_use_muon(path: str, x: torch.Tensor) -> bool:
    """DeepSpeed's rule: `x.ndim >= 2` and no "embed" / "lm_head" in the name."""
    return x.dim() >= 2 and "embed" not in path and "lm_head" not in path


def _leaf_module(path: str) -> str:
    parts = path.split(".")
    return (parts[-2] if len(parts) >= 2 else parts[-1]).lower()


def _name_heads(path: str, num_heads: int, num_kv_heads: int | None) -> int:
    leaf = _leaf_module(path)
    if any(leaf.startswith(k) for k in _NOT_HEAD_BLOCKED):
        return 0
    if any(leaf.startswith(k) for k in _KV_LEAVES):
        return num_kv_heads if num_kv_heads is not None else num_heads
    if any(leaf.startswith(k) for k in _QUERY_LEAVES):
        return num_heads
    return 0


def check_heads(x: torch.Tensor, h: int, where: str) -> tuple[int, int]:
    if isinstance(h, bool) or not isinstance(h, int) or h < 1:
        raise ConfigError(f"{where}: num_heads={h!r}; a head count is an int >= 1")
    if x.dim() != 2:
        raise ConfigError(f"{where}: per-head Muon needs a 2-D attention projection, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    if rows % h:
        raise ConfigError(f"{where}: the output dim {rows} does not split into {h} heads; per-head Muon views "
                          f"the matrix as [heads, head_dim, in]. Pass the right num_heads / num_kv_heads")
    return rows, cols


def _logical(params: PyTree) -> PyTree:
    """params with every sharded (`Placed`) leaf replaced by a meta tensor of its logical
    shape: the Muon/AdamW choice is about matrices, not about the flat shards ZeRO gives
    the optimizer."""
    return logical.logical_view(params)


def choose_muon(params: PyTree, mask: Mask | None, num_heads: Any, num_kv_heads: int | None) -> tuple[tuple, tuple]:
    """(use_muon, heads) per leaf in params' flatten order; ConfigError on a bad choice."""
    params = _logical(params)
    leaves, _ = tensor_leaves(params, "params")
    paths = [p for p, _ in tree.leaves_with_path(params)]
    if mask is None:
        use = tuple(default_use_muon(p, x) for p, x in zip(paths, leaves))
    else:
        use = evaluate_mask(mask, params, "mask", as_bool)
        for p, x, u in zip(paths, leaves, use):
            if u and x.dim() < 2:
                raise ConfigError(f"muon(mask=...) selects {p!r} of shape {tuple(x.shape)} for Muon; Muon "
                                  "orthogonalises matrices (ndim >= 2). Leave 1-D/0-D params to the AdamW")
    for p, x, u in zip(paths, leaves, use):
        if u and not x.is_floating_point():
            raise ConfigError(f"muon: parameter {p!r} has dtype {x.dtype}; Muon needs floating-point matrices")
    heads = [0] * len(leaves)
    if num_heads is not None:
        examined = {}
        for k, (p, x, u) in enumerate(zip(paths, leaves, use)):
            if not u:
                continue
            if callable(num_heads):
                h = num_heads(p, x)
                h = 0 if h is None else h
                if h != 0:
                    check_heads(x, h, f"muon(num_heads=...) for {p!r}")
            else:
                h = _name_heads(p, num_heads, num_kv_heads)
                if h:
                    rows, _ = check_heads(x, h, f"muon(num_heads={num_heads}) for {p!r}")
                    examined[p] = (h, rows // h)
            heads[k] = h
        if not callable(num_heads):
            if not examined:
                raise ConfigError(f"muon(num_heads={num_heads}): no Muon parameter is an attention projection "
                                  f"named {_QUERY_LEAVES + _KV_LEAVES} (the module before '.weight'), so per-head "
                                  "Muon would do nothing. Pass num_heads=callable(path, tensor) -> heads or None "
                                  "for other names, or leave num_heads=None")
            dims = {hd for _, hd in examined.values()}
            if len(dims) > 1:
                detail = ", ".join(f"{p}: {h} heads of {hd}" for p, (h, hd) in sorted(examined.items()))
                raise ConfigError(f"muon(num_heads={num_heads}, num_kv_heads={num_kv_heads}): the projections do "
                                  f"not share one head_dim ({detail}). With grouped-query attention pass "
                                  "num_kv_heads=<key/value heads>; otherwise use num_heads=callable(path, tensor)")
    return use, tuple(heads)


def muon_split(params: PyTree, mask: Mask | None = None, num_heads: int | HeadsFn | None = None,
               num_kv_heads: int | None = None) -> dict:
    """Which leaves `muon(mask=mask, num_heads=...)` trains with Muon and which with AdamW.

    Returns `{"muon": [paths], "adam": [paths], "heads": {path: heads}}` (paths dotted, in
    params' flatten order; "heads" lists the per-head Muon matrices).
    """
    use, heads = choose_muon(params, mask, num_heads, num_kv_heads)
    paths = [p for p, _ in tree.leaves_with_path(params, is_leaf=is_placed)]
    return {"muon": [p for p, u in zip(paths, use) if u], "adam": [p for p, u in zip(paths, use) if not u],
            "heads": {p: h for p, h in zip(paths, heads) if h}}


def check_some_muon(params: PyTree, n_leaves: int, mask: Mask | None, allow_no_muon: bool) -> None:
    """A choice with no Muon parameter: ConfigError, or with `allow_no_muon` a UserWarning
    (attributed to the caller of the optimizer's `init`: user -> init -> _init -> here)."""
    paths = [p for p, _ in tree.leaves_with_path(params, is_leaf=is_placed)]
    shown = ", ".join(f"{p}{tuple(x.shape)}" for p, x in list(zip(paths, tree.leaves(_logical(params))))[:6])
    why = (f"no parameter qualifies for Muon (needs ndim >= 2 and a name without 'embed'/'lm_head'"
           f"{', or mask=True' if mask is not None else ''}), so all {n_leaves} params")
    listed = f"{shown}{' ...' if n_leaves > 6 else ''}"
    if not allow_no_muon:
        raise ConfigError(
            f"muon: {why} would be trained by the auxiliary AdamW: {listed}. Use dsfn.optim.adamw(...) "
            "for that, choose Muon params with mask=..., or pass allow_no_muon=True.")
    # accepted, but said: this optimizer is then an AdamW with Muon's defaults (DeepSpeed is silent)
    warnings.warn(f"muon(allow_no_muon=True): {why} go to the auxiliary AdamW (adam_lr, adam_betas, "
                  f"adam_eps); Muon updates nothing: {listed}", UserWarning, stacklevel=4)
