"""Adam: `scale_by_adam` (the direction) and `adam_step` (torch.optim.Adam/AdamW's whole step).

Both follow torch.optim.Adam's arithmetic (see `dsfn.optim.transform`'s table). `adam_step`
picks its update's path per step: the Triton kernel, the C++ host kernel, in place in a
donated step (`dsfn.optim.adam_paths`), or the foreach kernels here.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from dsfn import tree
from dsfn.aliasing import donating, writable
from dsfn.checks import check_real
from dsfn.errors import LeafTypeError
from dsfn.optim._foreach import mul_scalar
from dsfn.optim.adam_paths import (adam_in_place, fused_adamw_applies, fused_adamw_step, host_adamw_applies,
                                   host_adamw_step)
from dsfn.optim.base import GradientTransformation, PyTree, flatten_like, tensor_leaves, zero_count
from dsfn.optim.learning_rate import LearningRate, check_learning_rate, lr_record, lr_value

__all__ = ["AdamState", "ScaleByAdamState", "adam_step", "scale_by_adam"]


class ScaleByAdamState(NamedTuple):
    """count: 0-dim int64 (updates made); mu, nu: first/second moments shaped like params;
    nu_max: running max of nu (amsgrad) or None."""
    count: torch.Tensor
    mu: PyTree
    nu: PyTree
    nu_max: PyTree


class AdamState(NamedTuple):
    """`adam_step`'s state: ScaleByAdamState's fields plus `lr` (see ScaleByLearningRateState)."""
    count: torch.Tensor
    mu: PyTree
    nu: PyTree
    nu_max: PyTree
    lr: torch.Tensor


def _adam_init(params: PyTree, amsgrad: bool) -> tuple[PyTree, PyTree, PyTree]:
    leaves, spec = tensor_leaves(params, "params")
    zeros = lambda: tree.unflatten(spec, [torch.zeros_like(x) for x in leaves])
    return zeros(), zeros(), (zeros() if amsgrad else None)


def _adam_moments(g: list[torch.Tensor], state: Any, spec: tree.TreeSpec, b1: float, b2: float,
                  amsgrad: bool) -> tuple[list, list, list | None]:
    """torch.optim.Adam's moment updates (same kernels, so bitwise torch's), out of place,
    or into the input moments inside a donated step (`dsfn.state.donation`)."""
    mu_in = flatten_like(state.mu, spec, "Adam state.mu")
    nu_in = flatten_like(state.nu, spec, "Adam state.nu")
    max_in = flatten_like(state.nu_max, spec, "Adam state.nu_max") if amsgrad else []
    if writable(mu_in + nu_in + max_in):
        with torch.no_grad():
            torch._foreach_lerp_(mu_in, g, 1.0 - b1)
            torch._foreach_mul_(nu_in, b2)
            torch._foreach_addcmul_(nu_in, g, g, value=1.0 - b2)
            if amsgrad:
                torch._foreach_maximum_(max_in, nu_in)
        return mu_in, nu_in, (max_in if amsgrad else None)
    mu = torch._foreach_lerp(mu_in, g, 1.0 - b1)
    nu = torch._foreach_mul(nu_in, b2)
    torch._foreach_addcmul_(nu, g, g, value=1.0 - b2)          # nu is ours: in place is pure
    nu_max = None
    if amsgrad:
        nu_max = torch._foreach_maximum(max_in, nu)
    return mu, nu, nu_max


def _check_adam_args(who: str, b1: Any, b2: Any, eps: Any) -> tuple[float, float, float]:
    return (check_real(f"{who}(b1)", b1, lo=0.0, hi=1.0, hi_open=True, hint="; e.g. 0.9"),
            check_real(f"{who}(b2)", b2, lo=0.0, hi=1.0, hi_open=True, hint="; e.g. 0.999"),
            check_real(f"{who}(eps)", eps, lo=0.0, hint="; e.g. 1e-8"))


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  amsgrad: bool = False) -> GradientTransformation:
    """Adam's direction `m_hat / (sqrt(v_hat) + eps)` with torch's bias correction (no lr).

    For composing custom chains, e.g. `chain(scale_by_adam(), masked(add_decayed_weights(wd),
    by_ndim(2), others="pass"), scale_by_learning_rate(lr))`. With t = count + 1:
    `m = lerp(m, g, 1 - b1)`, `v = b2 * v + (1 - b2) * g * g`,
    `out = m / (bc1 * (sqrt(v) / sqrt(bc2) + eps))`, bc_i = 1 - b_i ** t (float64, host).
    The aliases use `adam_step`, which also applies the lr and matches torch bitwise.
    """
    b1, b2, eps = _check_adam_args("scale_by_adam", b1, b2, eps)
    amsgrad = bool(amsgrad)

    def init(params: PyTree) -> ScaleByAdamState:
        return ScaleByAdamState(zero_count(), *_adam_init(params, amsgrad))

    def update(updates: PyTree, state: ScaleByAdamState, params: PyTree = None) -> tuple[PyTree, ScaleByAdamState]:
        g, spec = tensor_leaves(updates, "updates")
        count = state.count + 1
        if not g:
            return updates, state._replace(count=count)
        t = int(count)
        bc1, bc2_sqrt = 1.0 - b1 ** t, (1.0 - b2 ** t) ** 0.5
        mu, nu, nu_max = _adam_moments(g, state, spec, b1, b2, amsgrad)
        denom = torch._foreach_sqrt(nu_max if amsgrad else nu)
        torch._foreach_mul_(denom, bc1 / bc2_sqrt)                # bc1 folded in: one pass fewer
        torch._foreach_add_(denom, eps * bc1)
        out = torch._foreach_div(mu, denom)
        new = ScaleByAdamState(count, tree.unflatten(spec, mu), tree.unflatten(spec, nu),
                               tree.unflatten(spec, nu_max) if amsgrad else None)
        return tree.unflatten(spec, out), new

    return GradientTransformation(init, update)


def adam_step(lr: LearningRate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
              weight_decay: float = 0.0, amsgrad: bool = False) -> GradientTransformation:
    """torch.optim.Adam/AdamW's whole step: moments, bias correction, lr, decoupled decay.

    With t = count + 1, bc_i = 1 - b_i ** t (float64, host), lr = lr(count):
        m = lerp(m, g, 1 - b1);  v = b2 * v + (1 - b2) * g * g   (v_max = max(v_max, v))
        denom = sqrt(v) / sqrt(bc2) + eps
        p' = p * (1 - lr * weight_decay) + (-lr / bc1) * m / denom        (torch's addcdiv_)
        update = p' - p
    p' is computed with torch's own kernels and scalars, and `p' - p` is exact whenever
    p' is within a factor 2 of p (Sterbenz), so `apply_updates` returns torch's p'
    bitwise except where a step moves a parameter across or near zero (then within an
    ulp of the larger value). 9 foreach passes (+1 with weight decay, +1 amsgrad), the
    same as scaling a direction by -lr would take. `apply` (the fast path `TrainState`
    uses) returns p' itself: torch's result bitwise, two passes fewer.

    The state is `AdamState` (moments, count, and `lr` as for `scale_by_learning_rate`).
    `weight_decay` is AdamW's decoupled decay; for Adam's L2 penalty put
    `add_decayed_weights(wd)` before this and leave weight_decay=0.
    """
    check_learning_rate(lr, "adam_step")
    b1, b2, eps = _check_adam_args("adam_step", b1, b2, eps)
    wd = check_real("adam_step(weight_decay)", weight_decay, lo=0.0, hint="; use 0 for no weight decay")
    amsgrad = bool(amsgrad)

    def init(params: PyTree) -> AdamState:
        count = zero_count()
        return AdamState(count, *_adam_init(params, amsgrad), lr=lr_record(lr_value(lr, count)))

    def update(updates: PyTree, state: AdamState, params: PyTree = None) -> tuple[PyTree, AdamState]:
        with donating(False):           # returns p' - p: p itself must stay as it was
            new_p, p, spec, new = step(updates, state, params)
        if new_p is None:
            return updates, new
        torch._foreach_sub_(new_p, p)                               # exact: see the docstring
        return tree.unflatten(spec, new_p), new

    def apply(updates: PyTree, state: AdamState, params: PyTree) -> tuple[PyTree, AdamState]:
        new_p, _, spec, new = step(updates, state, params)
        return (params if new_p is None else tree.unflatten(spec, new_p)), new

    def step(updates: PyTree, state: AdamState, params: PyTree):
        return _adam_update(updates, state, params, lr, b1, b2, eps, wd, amsgrad)

    return GradientTransformation(init, update, apply)


def _adam_update(updates: PyTree, state: AdamState, params: PyTree, lr: LearningRate, b1: float, b2: float,
                 eps: float, wd: float, amsgrad: bool):
    """`adam_step`'s update: (new param leaves, param leaves, spec, new state); leaves are
    None for an empty tree. The path: Triton, host, in place (donated, float lr), or foreach."""
    g, spec = tensor_leaves(updates, "updates")
    count = state.count + 1
    v = lr_value(lr, state.count)
    if not g:
        return None, None, spec, state._replace(count=count, lr=lr_record(v))
    if params is None:
        raise LeafTypeError("adam_step needs params: call update(grads, state, params)")
    p = flatten_like(params, spec, "params")
    t = int(count)
    if not amsgrad and fused_adamw_applies(p, state, spec):
        new_p, mu, nu = fused_adamw_step(g, p, state, spec, v, t, b1, b2, eps, wd)
        return new_p, p, spec, AdamState(count, tree.unflatten(spec, mu), tree.unflatten(spec, nu), None,
                                         lr=lr_record(v))
    if not amsgrad and host_adamw_applies(p, g, state):
        new_p, mu, nu = host_adamw_step(g, p, state, spec, v, t, count, b1, b2, eps, wd, lr)
        return new_p, p, spec, AdamState(count, tree.unflatten(spec, mu), tree.unflatten(spec, nu), None,
                                         lr=lr_record(v))
    bc1, bc2_sqrt = 1.0 - b1 ** t, (1.0 - b2 ** t) ** 0.5
    donated = writable(p + tree.leaves(state.mu) + tree.leaves(state.nu))
    if donated and not isinstance(v, torch.Tensor):
        mu, nu, nu_max = adam_in_place(g, p, state, spec, b1, b2, eps, wd, v, bc1, bc2_sqrt, amsgrad)
        new = AdamState(count, tree.unflatten(spec, mu), tree.unflatten(spec, nu),
                        tree.unflatten(spec, nu_max) if amsgrad else None, lr=lr_record(v))
        return p, p, spec, new
    new_p, mu, nu, nu_max = _foreach_adam(g, p, state, spec, v, b1, b2, eps, wd, bc1, bc2_sqrt, amsgrad, donated)
    new = AdamState(count, tree.unflatten(spec, mu), tree.unflatten(spec, nu),
                    tree.unflatten(spec, nu_max) if amsgrad else None, lr=lr_record(v))
    return new_p, p, spec, new


def _foreach_adam(g, p, state, spec, v, b1, b2, eps, wd, bc1, bc2_sqrt, amsgrad, donated):
    """The foreach path (torch's kernels and order): (new params, mu, nu, nu_max) leaves;
    into p in a donated step with a tensor lr (computed out of place, then copied)."""
    mu, nu, nu_max = _adam_moments(g, state, spec, b1, b2, amsgrad)
    denom = torch._foreach_sqrt(nu_max if amsgrad else nu)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    if isinstance(v, torch.Tensor):
        # tensor lr: scalars stay tensors (no host sync). torch multiplies p by the
        # tensor (1 - lr*wd) in place and passes -lr/bc1 to addcdiv_ as a Scalar; its
        # (s * m) / denom + p order is kept, so this is torch's update bitwise too
        lr_t = v.reshape(())
        new_p = mul_scalar(p, 1 - lr_t * wd, promote=True) if wd != 0.0 else None
        q = mul_scalar(mu, -(lr_t / bc1), promote=False)
        torch._foreach_div_(q, denom)
        if new_p is None:
            new_p = torch._foreach_add(p, q)
        else:
            torch._foreach_add_(new_p, q)
    else:
        step_size = v / bc1
        if wd != 0.0:
            new_p = torch._foreach_mul(p, 1 - v * wd)
            torch._foreach_addcdiv_(new_p, mu, denom, value=-step_size)
        else:
            new_p = torch._foreach_addcdiv(p, mu, denom, value=-step_size)
    if donated and new_p is not p:      # tensor lr: computed as above, then stored into p
        with torch.no_grad():
            torch._foreach_copy_(p, new_p)
        new_p = p
    return new_p, mu, nu, nu_max
