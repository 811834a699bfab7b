"""Muon with an auxiliary AdamW, as DeepSpeed's `{"optimizer": {"type": "Muon"}}` (`MuonWithAuxAdam`).

    tx = dsfn.optim.muon(lr=0.02, adam_lr=3e-4)
    tx.split(params)            # {"muon": [paths], "adam": [paths], "heads": {path: n}}
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)

## Which parameters get Muon

DeepSpeed's rule (`deepspeed/__init__.py::set_optimizer_flags`): a parameter uses Muon when
`ndim >= 2` and its name contains neither `"embed"` nor `"lm_head"` (case-sensitive
substrings of the dotted path, e.g. `model.layers.0.mlp.up_proj.weight`). Everything
else (embeddings, the output head, norms, biases) is trained by an AdamW inside the same
optimizer. `mask=` overrides the rule (a pytree of bools shaped like params, or
`(path, tensor) -> bool`; True = Muon). The choice is made once, at `init`, and kept in
the state as static structure. `muon_split(params, mask)` / `tx.split(params)` show it.

## The Muon update (per matrix; `muon_matrix_update`)

DeepSpeed's `runtime/zero/muon/original_muon.py::muon_update` (Keller Jordan's Muon):

    m' = lerp(m, g, 1 - momentum)                 # = momentum * m + (1 - momentum) * g
    u  = lerp(g, m', momentum) if nesterov else m'
    O  = NS(u)                                    # Newton-Schulz, below, in the NS dtype
    O *= sqrt(max(1, u.size(-2) / u.size(-1)))    # in the NS dtype, then cast to g's dtype
    p' = p * (1 - lr * weight_decay) - lr * O

NS: transpose a tall matrix so rows <= cols; divide by its Frobenius norm + 1e-7 (in the
wider of u's dtype and the NS dtype, fp32 for fp16, then cast to the NS dtype: DeepSpeed's
order, so an fp16 NS dtype cannot turn a large finite gradient into inf); `ns_steps` times
`A = X Xᵀ; X = a X + (b A + c A²) X` with the quintic (a, b, c) = (3.4445, -4.7750,
2.0315); transpose back. Its output is not exactly
orthogonal: the singular values end in about [0.68, 1.20] (the attracting band of the
quintic), which Muon accepts by design.

Shapes, as DeepSpeed: a 4-D (conv) tensor is viewed as 2-D `(out, in*kh*kw)` for NS,
while the scale keeps DeepSpeed's expression on the original tensor, `size(-2)/size(-1)`
(for a conv that is the kernel's kh/kw). A 3-D tensor (e.g. stacked experts `[E, out,
in]`) is orthogonalised per leading index (NS is batched), scale from its last two dims.

`ns_method="gram"` (DeepSpeed's default): the Gram Newton-Schulz of
`zeropower_via_gram_newtonschulz`: for a non-square matrix it iterates on the small Gram
matrix `R = X Xᵀ` and accumulates the polynomial `Q` (restart at iteration 2), then
returns `Q X`; the same map as "standard" up to rounding. Square matrices use the
standard iteration.

`num_heads`: DeepSpeed's `per_head_muon`: an attention projection `[heads * head_dim,
in]` is viewed as `[heads, head_dim, in]`, each head's block is orthogonalised
separately (batched NS), scaled by `sqrt(max(1, head_dim / in))`.

## The auxiliary AdamW

`dsfn.optim.adam_step(adam_lr, *adam_betas, adam_eps, adam_weight_decay)` on the
non-Muon leaves: torch.optim.AdamW's arithmetic (DeepSpeed's `adam_update` is the same
formula: bias-corrected moments, `p * (1 - lr * wd) - lr * m_hat / (sqrt(v_hat) + eps)`).

## State (`MuonState`, a pytree)

- `count`: 0-dim int64 CPU tensor, updates made.
- `momentum`: a tree with the structure of params; a Muon leaf holds its momentum
  buffer (the parameter's shape and dtype, zeros at init), an Adam leaf is None (no
  state). So a ZeRO layer sees `momentum.<param path>` mirroring each Muon parameter.
- `adam`: `AdamState` of `adam_step` over the Adam leaves only: `count`, `mu.<path>`,
  `nu.<path>` shaped like their parameters (None at Muon leaves), `nu_max` None, `lr`.
- `lr`: the Muon lr of the last update (0-dim float64, or the tensor lr itself);
  `current_lr` reports it. The Adam lr is `adam.lr`.
- static (structure, not leaves): `use_muon` (per-leaf bool, params' flatten order) and
  `heads` (per-leaf head count for per-head NS, 0 = whole matrix).

## Deviations from DeepSpeed

- Learning rates may be schedules `count -> lr` (or 1-element tensors), per group.
- A configuration where no parameter qualifies for Muon raises ConfigError (DeepSpeed
  silently trains everything with AdamW, issue #8441/PR #8438); `allow_no_muon=True`
  accepts it with a UserWarning at `init` saying that every parameter goes to the AdamW.
- The NS dtype. DeepSpeed (`original_muon.py::ns_compute_dtype`) runs "standard" in bf16
  and "gram" in fp16 where the accelerator supports them, fp32 otherwise. dsfn's default
  (`ns_dtype=None`, `ns_compute_dtype(device)`) is chosen per device, for both methods:
  - a CUDA device with native bf16 (compute capability >= 8.0; ROCm: torch's
    `is_bf16_supported`): bf16, the quintic iteration in bf16 as Muon is designed to run;
  - any other device, CPU included: fp32. torch does run bf16 matmuls on CPU, but
    without AMX they convert through fp32 (measured: a 1024² bf16 matmul 4x slower than
    fp32 on an AVX-512 host), so bf16 there only loses precision; a pre-Ampere GPU has
    no bf16 arithmetic (DeepSpeed's fp32 fallback).
  "gram" gets bf16 too rather than DeepSpeed's fp16 (one NS dtype per device, as required;
  measured relative error of the update vs fp64: "gram" 0.03-0.05 in bf16, "standard"
  0.025-0.04 in bf16, both ~0.005 in fp16). `ns_dtype=torch.float16` gives DeepSpeed's
  "gram" choice; any explicit `ns_dtype` overrides the device rule.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dsfn import logical, tree
from dsfn.checks import check_int, check_real
from dsfn.errors import ConfigError, LeafTypeError
from dsfn.optim._foreach import check_betas, mul_scalar
from dsfn.optim.base import GradientTransformation, PyTree, tensor_leaves, zero_count
from dsfn.optim.masks import Mask
from dsfn.optim.muon_params import (  # noqa: F401  (default_use_muon, HeadsFn: public here too)
    HeadsFn, check_heads, check_some_muon, choose_muon, default_use_muon, muon_split)
from dsfn.optim.ns_iteration import (  # noqa: F401  (the NS constants and kernels: public here too)
    NS_COEFFS, NS_EPS, NS_METHODS, check_ns_args, gram_newton_schulz, newton_schulz, ns_compute_dtype)
from dsfn.optim.transform import (
    AdamState,
    LearningRate,
    lr_record,
    lr_value,
    adam_step,
    check_learning_rate,
)
from dsfn.placed import Placed, data_of, is_placed

__all__ = ["MuonState", "MuonTransformation", "gram_newton_schulz", "muon", "muon_matrix_update", "muon_split",
           "newton_schulz", "ns_compute_dtype", "orthogonalize"]
# DeepSpeed's defaults (MuonWithAuxAdam / engine): muon lr 0.02, momentum 0.95; adam lr 3e-4
MUON_LR_DEFAULT = 0.02
ADAM_LR_DEFAULT = 3e-4


# ---------------------------------------------------------------------------------------
# the Muon update of one matrix


def _ns_dtype(ns_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    return ns_compute_dtype(device) if ns_dtype is None else ns_dtype


def _ns(x: torch.Tensor, ns_steps: int, ns_method: str, dtype: torch.dtype) -> torch.Tensor:
    fn = gram_newton_schulz if ns_method == "gram" else newton_schulz
    return fn(x, ns_steps, dtype)


def orthogonalize(update: torch.Tensor, *, ns_steps: int = 5, ns_method: str = "gram",
                  ns_dtype: torch.dtype | None = None, num_heads: int | None = None) -> torch.Tensor:
    """Muon's orthogonalised, shape-scaled update for one tensor (DeepSpeed's `muon_update`
    after the momentum): NS in `ns_dtype` (None: `ns_compute_dtype(update.device)`, bf16 on
    a bf16-capable GPU, fp32 elsewhere), times `sqrt(max(1, rows/cols))`, cast back to
    `update`'s dtype, in `update`'s shape and on its device. See the module docstring for
    >2-D tensors and `num_heads` (per-head blocks of dim 0, 2-D only)."""
    check_ns_args("orthogonalize", ns_steps, ns_method, ns_dtype)
    if update.dim() < 2:
        raise ConfigError(f"orthogonalize: Muon needs a matrix (ndim >= 2), got shape {tuple(update.shape)}; "
                          "1-D parameters belong to the auxiliary AdamW")
    dtype = _ns_dtype(ns_dtype, update.device)
    shape = update.shape
    if num_heads is not None:
        rows, cols = check_heads(update, num_heads, "orthogonalize")
        head_dim = rows // num_heads
        out = _ns(update.reshape(num_heads, head_dim, cols), ns_steps, ns_method, dtype)
        scale = max(1.0, head_dim / cols) ** 0.5
    else:
        x = update.reshape(shape[0], -1) if update.dim() == 4 else update     # conv filters, as DeepSpeed
        out = _ns(x, ns_steps, ns_method, dtype)
        scale = max(1.0, shape[-2] / shape[-1]) ** 0.5
    if scale != 1.0:
        out = out * scale
    return out.reshape(shape).to(update.dtype)


def muon_matrix_update(momentum_buf: torch.Tensor, grad: torch.Tensor, *, momentum: float = 0.95,
                       nesterov: bool = True, ns_steps: int = 5, ns_method: str = "gram",
                       ns_dtype: torch.dtype | None = None,
                       num_heads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One full matrix's Muon step, pure: `(update, new_momentum)`.

    `new_momentum = lerp(momentum_buf, grad, 1 - momentum)`; the update is
    `orthogonalize(lerp(grad, new_momentum, momentum) if nesterov else new_momentum)`,
    already scaled by `sqrt(max(1, rows/cols))`, in `grad`'s shape and dtype. The caller
    applies `p' = p * (1 - lr * wd) - lr * update`. Inputs are not modified. Needs the
    whole (reduced) gradient and momentum of the matrix: NS is not elementwise.
    """
    if momentum_buf.shape != grad.shape:
        raise LeafTypeError(f"muon_matrix_update: momentum buffer of shape {tuple(momentum_buf.shape)} for a "
                            f"gradient of shape {tuple(grad.shape)}; Muon needs the whole matrix (not a flat shard)")
    u, new_m = _direction(momentum_buf, grad, momentum, nesterov)
    return orthogonalize(u, ns_steps=ns_steps, ns_method=ns_method, ns_dtype=ns_dtype, num_heads=num_heads), new_m


def _direction(momentum_buf: torch.Tensor, grad: torch.Tensor, momentum: float,
               nesterov: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(direction u, new momentum): elementwise, so it runs on shards as on whole matrices."""
    new_m = torch.lerp(momentum_buf, grad, 1.0 - momentum)
    return (torch.lerp(grad, new_m, momentum) if nesterov else new_m), new_m


def _orthogonalize_all(directions: dict[int, Any], heads: tuple, ns_kw: dict) -> dict[int, Any]:
    """Orthogonalised updates for leaf k's direction, in its layout. Newton-Schulz needs the
    whole matrix: a piece (ZeRO shard, tp slice) goes through the `map_whole` primitive
    (`dsfn.logical`), which the transforms owning its layout answer (ZeRO orthogonalises
    each matrix once, on an owner rank); a whole tensor is orthogonalised here."""
    ks = list(directions)

    def orth(j: int, full: torch.Tensor) -> torch.Tensor:
        return orthogonalize(full, num_heads=heads[ks[j]] or None, **ns_kw)
    return dict(zip(ks, logical.map_whole(orth, [directions[k] for k in ks])))



# ---------------------------------------------------------------------------------------
# the transformation


@tree.dataclass
class MuonState:
    """count: 0-dim int64 (updates made). momentum: params-shaped tree, Muon leaves = momentum
    buffers (param's shape/dtype), Adam leaves None. adam: `AdamState` over the Adam leaves.
    lr: Muon lr of the last update. use_muon, heads (static): per-leaf choices."""
    count: torch.Tensor
    momentum: Any
    adam: AdamState
    lr: torch.Tensor
    use_muon: tuple = tree.static_field(default=())
    heads: tuple = tree.static_field(default=())


class MuonTransformation(GradientTransformation):
    """A GradientTransformation with `split(params)` (see `muon_split`)."""

    def split(self, params: PyTree) -> dict:
        return self._split_fn(params)


def _like(template: Any, t: torch.Tensor) -> Any:
    """`t` in `template`'s layout (a Placed piece stays a Placed piece)."""
    return Placed(t, template.layout) if isinstance(template, Placed) else t


def _select(leaves: list, keep: Sequence[bool], spec: tree.TreeSpec) -> PyTree:
    return tree.unflatten(spec, [x if k else None for x, k in zip(leaves, keep)])


def _decay_and_step(p: torch.Tensor, upd: torch.Tensor, lr: float | torch.Tensor, wd: float) -> torch.Tensor:
    """DeepSpeed's `p.mul_(1 - lr * wd); p.add_(update, alpha=-lr)`, out of place."""
    if isinstance(lr, torch.Tensor):
        lr_t = lr.reshape(())
        base = mul_scalar([p], 1 - lr_t * wd, promote=True)[0] if wd != 0.0 else p
        return torch.add(base, mul_scalar([upd], -lr_t, promote=False)[0])
    base = torch.mul(p, 1.0 - lr * wd) if wd != 0.0 else p
    return torch.add(base, upd, alpha=-lr)


@dataclasses.dataclass(frozen=True)
class _Settings:
    """One `muon(...)`'s checked arguments."""
    mu_lr: LearningRate
    beta: float
    nesterov: bool
    wd: float
    ns_orth: dict
    mask: Mask | None
    num_heads: Any
    num_kv_heads: int | None
    allow_no_muon: bool
    adam_tx: GradientTransformation


def _settings(lr, momentum, nesterov, ns_steps, weight_decay, ns_method, ns_dtype, muon_lr, adam_lr, adam_betas,
              adam_eps, adam_weight_decay, mask, num_heads, num_kv_heads, allow_no_muon) -> _Settings:
    """`muon`'s arguments checked (ConfigError on a bad one), the defaults filled in."""
    mu_lr = muon_lr if muon_lr is not None else (lr if lr is not None else MUON_LR_DEFAULT)
    ad_lr = adam_lr if adam_lr is not None else (lr if lr is not None else ADAM_LR_DEFAULT)
    check_learning_rate(mu_lr, "muon(muon_lr)" if muon_lr is not None else "muon")
    check_learning_rate(ad_lr, "muon(adam_lr)" if adam_lr is not None else "muon")
    beta = check_real("muon(momentum)", momentum, lo=0.0, hi=1.0, hi_open=True,
                      hint="; Muon's momentum lies in [0, 1), e.g. 0.95")
    check_ns_args("muon", ns_steps, ns_method, ns_dtype)
    wd = check_real("muon(weight_decay)", weight_decay, lo=0.0, hint="; use 0 for no weight decay")
    awd = wd if adam_weight_decay is None else check_real("muon(adam_weight_decay)", adam_weight_decay, lo=0.0,
                                                          hint="; use 0 for no weight decay")
    b1, b2 = check_betas(adam_betas, "muon(adam_betas)")
    eps = check_real("muon(adam_eps)", adam_eps, lo=0.0, hint="; e.g. 1e-10")
    if mask is not None and not callable(mask) and not isinstance(mask, (Mapping, list, tuple)):
        raise ConfigError(f"muon(mask={mask!r}): pass a pytree of bools shaped like params or a callable "
                          "(path, tensor) -> bool (True = Muon)")
    if num_heads is not None and not callable(num_heads):
        check_int("muon(num_heads)", num_heads, lo=1, hint="; or a callable (path, tensor) -> heads | None")
    if num_kv_heads is not None:
        if num_heads is None or callable(num_heads):
            raise ConfigError("muon(num_kv_heads=...) goes with an int num_heads; with a callable num_heads return "
                              "each projection's head count from it")
        check_int("muon(num_kv_heads)", num_kv_heads, lo=1)
    nesterov = bool(nesterov)
    adam_tx = adam_step(ad_lr, b1, b2, eps, awd)
    ns_orth = {"ns_steps": ns_steps, "ns_method": ns_method, "ns_dtype": ns_dtype}
    return _Settings(mu_lr=mu_lr, beta=beta, nesterov=nesterov, wd=wd, ns_orth=ns_orth, mask=mask,
                     num_heads=num_heads, num_kv_heads=num_kv_heads, allow_no_muon=allow_no_muon, adam_tx=adam_tx)


def _init(s: _Settings, params: PyTree) -> MuonState:
    """The fresh state: the Muon/AdamW choice, zero momentum buffers, the AdamW's state."""
    tensor_leaves(params, "params")
    leaves, spec = tree.flatten(params, is_leaf=is_placed)      # sharded leaves whole (Placed)
    use, heads = choose_muon(params, s.mask, s.num_heads, s.num_kv_heads)
    if not any(use):
        check_some_muon(params, len(leaves), s.mask, s.allow_no_muon)
    count = zero_count()
    momentum_tree = _select([tree.map(torch.zeros_like, x) for x in leaves], use, spec)
    adam_state = s.adam_tx.init(_select(leaves, [not u for u in use], spec))
    return MuonState(count=count, momentum=momentum_tree, adam=adam_state,
                     lr=lr_record(lr_value(s.mu_lr, count)), use_muon=use, heads=heads)


def _checked_inputs(grads: PyTree, state: MuonState, params: PyTree):
    """(grad leaves, spec, param leaves, momentum leaves, momentum spec), after checking that
    grads, state and params belong together (LeafTypeError naming what differs)."""
    if not isinstance(state, MuonState):
        raise LeafTypeError(f"muon: expected the MuonState from this optimizer's init/update, got "
                            f"{type(state).__name__}")
    tensor_leaves(grads, "grads")
    g, spec = tree.flatten(grads, is_leaf=is_placed)             # Placed shards stay whole
    use = state.use_muon
    if len(g) != len(use):
        raise LeafTypeError(f"muon: the state was made for {len(use)} params, the grads have {len(g)}; init the "
                            "optimizer with the same params tree")
    if params is None:
        raise LeafTypeError("muon needs params: call update(grads, state, params)")
    p, p_spec = tree.flatten(params, is_leaf=is_placed)
    if p_spec != spec:
        raise LeafTypeError(f"muon: params and grads differ in structure ({p_spec} vs {spec})")
    paths = None
    for k, (gi, pi) in enumerate(zip(g, p)):
        gd, pd = data_of(gi), data_of(pi)
        if gd.dtype != pd.dtype or gd.shape != pd.shape:
            paths = paths or [q for q, _ in tree.leaves_with_path(params, is_leaf=is_placed)]
            what = "dtype" if gd.dtype != pd.dtype else "shape"
            raise LeafTypeError(
                f"muon: grad of {paths[k]!r} has {what} {gd.dtype if what == 'dtype' else tuple(gd.shape)} but "
                f"the param has {pd.dtype if what == 'dtype' else tuple(pd.shape)}; pass grads in the params' "
                f"{what} (e.g. grads = tree.map(lambda g, p: g.to(p.dtype), grads, params))")
    m_leaves, m_spec = tree.flatten(state.momentum, is_leaf=is_placed)
    if len(m_leaves) != sum(use):
        raise LeafTypeError(f"muon: state.momentum holds {len(m_leaves)} buffers for {sum(use)} Muon params; "
                            "pass the state this optimizer's init/update returned")
    return g, spec, p, m_leaves, m_spec


def _step(s: _Settings, grads: PyTree, state: MuonState, params: PyTree):
    """(new param leaves, param leaves, spec, new state)."""
    g, spec, p, m_leaves, m_spec = _checked_inputs(grads, state, params)
    use = state.use_muon
    v = lr_value(s.mu_lr, state.count)
    new_p: list[Any] = [None] * len(p)
    new_m: list[Any] = [None] * len(p)
    directions: dict[int, Any] = {}
    it = iter(m_leaves)
    for k, u in enumerate(use):
        if u:       # momentum and direction are elementwise: on shards as on matrices
            d, m = _direction(data_of(next(it)), data_of(g[k]), s.beta, s.nesterov)
            directions[k], new_m[k] = _like(g[k], d), _like(g[k], m)
    updates = _orthogonalize_all(directions, state.heads, s.ns_orth)
    for k, upd in updates.items():
        new_p[k] = _like(p[k], _decay_and_step(data_of(p[k]), data_of(upd), v, s.wd))
    not_use = [not u for u in use]
    sub_p, adam_state = s.adam_tx.apply(_select(g, not_use, spec), state.adam, _select(p, not_use, spec))
    it_a = iter(tree.leaves(sub_p, is_leaf=is_placed))
    for k, u in enumerate(use):
        if not u:
            new_p[k] = next(it_a)
    new = MuonState(count=state.count + 1, momentum=tree.unflatten(m_spec, [x for x in new_m if x is not None]),
                    adam=adam_state, lr=lr_record(v), use_muon=use, heads=state.heads)
    return new_p, p, spec, new


def muon(lr: LearningRate | None = None, momentum: float = 0.95, *, nesterov: bool = True, ns_steps: int = 5,
         weight_decay: float = 0.0, ns_method: str = "gram", ns_dtype: torch.dtype | None = None,
         muon_lr: LearningRate | None = None, adam_lr: LearningRate | None = None,
         adam_betas: Sequence[float] = (0.9, 0.95), adam_eps: float = 1e-10,
         adam_weight_decay: float | None = None, mask: Mask | None = None,
         num_heads: int | HeadsFn | None = None, num_kv_heads: int | None = None,
         allow_no_muon: bool = False) -> MuonTransformation:
    """Muon for hidden matrices + AdamW for the rest (DeepSpeed's `MuonWithAuxAdam`).

    Args:
        lr: the ds_config optimizer `lr`: used by both groups unless `muon_lr` / `adam_lr`
            override it. With no lr at all the groups use DeepSpeed's class defaults, 0.02
            (Muon) and 3e-4 (AdamW). Any lr may be a float, a schedule `count -> lr`
            (`dsfn.optim.schedules`) or a 1-element tensor.
        momentum: Muon's momentum β in [0, 1) (DeepSpeed 0.95).
        nesterov: use `lerp(g, m, β)` rather than `m` as the direction (DeepSpeed: True).
        ns_steps: Newton-Schulz iterations, >= 1 (DeepSpeed 5).
        weight_decay: decoupled decay `p *= 1 - lr * wd`, for both groups (DeepSpeed 0).
        ns_method: "gram" (DeepSpeed's default) or "standard".
        ns_dtype: NS compute dtype; None = per device, at each update (`ns_compute_dtype`):
            bf16 on a CUDA device with native bf16 (compute capability >= 8.0), fp32
            elsewhere (CPU included). torch.float16 is DeepSpeed's "gram" choice.
        muon_lr: the Muon group's lr (overrides `lr`).
        adam_lr: the AdamW group's lr (overrides `lr`).
        adam_betas, adam_eps: the AdamW's (DeepSpeed (0.9, 0.95), 1e-10).
        adam_weight_decay: the AdamW's decay; None = `weight_decay` (DeepSpeed shares it).
        mask: which params get Muon (True) instead of the default rule; a pytree of bools
            or `(path, tensor) -> bool`, evaluated once at init.
        num_heads: per-head Muon (DeepSpeed's `per_head_muon`). An int applies to the
            attention projections named q_proj/query/wq (num_heads) and
            k_proj/key/wk/v_proj/value/wv (`num_kv_heads`, default num_heads) by the module
            before the parameter name; fused QKV and MLA projections stay whole. A callable
            `(path, tensor) -> heads | None` chooses freely.
        num_kv_heads: key/value head count for grouped-query attention (with int num_heads).
        allow_no_muon: accept params where nothing qualifies for Muon (all AdamW, with a
            UserWarning at init naming them); by default that is a ConfigError, since it is
            almost always a mistake.

    State: `MuonState` (see the module docstring). `tx.split(params)` shows the choice.
    """
    s = _settings(lr, momentum, nesterov, ns_steps, weight_decay, ns_method, ns_dtype, muon_lr, adam_lr, adam_betas,
                  adam_eps, adam_weight_decay, mask, num_heads, num_kv_heads, allow_no_muon)

    def split_fn(params: PyTree) -> dict:
        return muon_split(params, mask, num_heads, num_kv_heads)

    def init(params: PyTree) -> MuonState:
        return _init(s, params)

    def update(grads: PyTree, state: MuonState, params: PyTree = None) -> tuple[PyTree, MuonState]:
        new_p, p, spec, new = _step(s, grads, state, params)
        if not new_p:
            return grads, new
        return tree.map(torch.sub, tree.unflatten(spec, new_p), tree.unflatten(spec, p)), new

    def apply(grads: PyTree, state: MuonState, params: PyTree) -> tuple[PyTree, MuonState]:
        new_p, _, spec, new = _step(s, grads, state, params)
        return (tree.unflatten(spec, new_p) if new_p else params), new

    tx = MuonTransformation(init, update, apply)
    tx._split_fn = split_fn
    return tx
