"""Primitive gradient transformations; the aliases (`adamw`, `sgd`, ...) chain these.

Each primitive does one job and follows `torch.optim`'s arithmetic so that the chains in
`alias.py` match `torch.optim.{AdamW, Adam, SGD}`:

| primitive | update (per leaf) | state |
|---|---|---|
| `scale(f)` | `u * f` | none |
| `add_decayed_weights(wd)` | `u + wd * p` | none |
| `scale_by_adam(b1, b2, eps, amsgrad)` | `m_hat / (sqrt(v_hat) + eps)` | count, mu, nu (, nu_max) |
| `adam_step(lr, b1, b2, eps, wd, amsgrad)` | torch Adam(W)'s `p' - p` (fused, bitwise) | count, mu, nu (, nu_max), lr |
| `trace(momentum, dampening, nesterov)` | torch SGD's momentum buffer | count, trace |
| `scale_by_learning_rate(lr)` | `-lr * u` | count, lr |

Learning rates (`LearningRate`): a float, a schedule `f(count) -> float | Tensor` called
with the transform's 0-dim int64 `count` (= updates already applied; see
`dsfn.optim.schedules` for DeepSpeed's), or a tensor of shape () or (1,). A tensor lr is
used as is at every update (its device and dtype are kept; changing its value in place
between steps takes effect) and is the very object stored in the state.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Union

import torch

from dsfn import tree
from dsfn.checks import check_real
from dsfn.errors import ConfigError, LeafTypeError
from dsfn.optim._foreach import mul_scalar
from dsfn.optim.base import (
    EmptyState,
    GradientTransformation,
    PyTree,
    tensor_leaves,
    zero_count,
)
from dsfn.aliasing import donating, writable

Schedule = Callable[[torch.Tensor], float | torch.Tensor]
LearningRate = Union[float, torch.Tensor, Schedule]


def flatten_like(t: PyTree, spec: tree.TreeSpec, what: str) -> list[torch.Tensor]:
    leaves, s = tree.flatten(t)
    if s != spec:
        raise LeafTypeError(f"{what} does not have the structure of the updates ({s} vs {spec}); pass the "
                            "state this transform's init/update returned for the same params tree")
    return leaves


def check_learning_rate(lr: Any, who: str) -> None:
    """ConfigError unless `lr` is a float >= 0, a schedule, or a 1-element float tensor."""
    if isinstance(lr, torch.Tensor):
        if lr.dim() > 1 or lr.numel() != 1:
            raise ConfigError(f"{who}(lr=tensor of shape {tuple(lr.shape)}): a tensor lr must have shape () "
                              "or (1,)")
        if not lr.is_floating_point():
            raise ConfigError(f"{who}(lr=tensor of dtype {lr.dtype}): a tensor lr must be floating point, e.g. "
                              "torch.tensor(1e-3, dtype=torch.float64)")
        if lr.device.type == "cpu" and not bool(lr.reshape(()) >= 0):   # no host sync for device lrs
            raise ConfigError(f"{who}(lr={lr.item()!r}): the learning rate must be >= 0")
        return
    if callable(lr):
        return
    check_real(f"{who}(lr)", lr, lo=0.0, hint="; pass a learning rate >= 0, a schedule (e.g. "
               "dsfn.optim.schedules.WarmupLR(...)) or a 1-element tensor")


def lr_value(lr: LearningRate, count: torch.Tensor) -> float | torch.Tensor:
    if isinstance(lr, torch.Tensor):
        return lr
    if callable(lr):
        v = lr(count)
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise LeafTypeError(f"the lr schedule returned a tensor of shape {tuple(v.shape)}; "
                                    "return a float or a 1-element tensor")
            return v
        return float(v)
    return float(lr)


def lr_record(v: float | torch.Tensor) -> torch.Tensor:
    return v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64)


# ---------------------------------------------------------------------------------------
# stateless


def scale(factor: float) -> GradientTransformation:
    """`u -> u * factor` (`factor=-1` is an exact negation, torch's `maximize`)."""
    factor = check_real("scale(factor)", factor)

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree = None) -> tuple[PyTree, EmptyState]:
        u, spec = tensor_leaves(updates, "updates")
        if not u or factor == 1.0:
            return updates, state
        out = torch._foreach_neg(u) if factor == -1.0 else torch._foreach_mul(u, factor)
        return tree.unflatten(spec, out), state

    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: float = 0.0) -> GradientTransformation:
    """`u -> u + weight_decay * p` (torch's `grad.add(param, alpha=weight_decay)`).

    Before `scale_by_adam` it is Adam's L2 penalty; after it and before
    `scale_by_learning_rate` it is AdamW's decoupled decay `p * (1 - lr * wd)`.
    """
    wd = check_real("add_decayed_weights(weight_decay)", weight_decay, lo=0.0,
                    hint="; use 0 for no weight decay")

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree = None) -> tuple[PyTree, EmptyState]:
        if wd == 0.0:
            return updates, state
        if params is None:
            raise LeafTypeError("add_decayed_weights needs params: call update(grads, state, params)")
        u, spec = tensor_leaves(updates, "updates")
        if not u:
            return updates, state
        p = flatten_like(params, spec, "params")
        return tree.unflatten(spec, torch._foreach_add(u, p, alpha=wd)), state

    return GradientTransformation(init, update)


# ---------------------------------------------------------------------------------------
# Adam


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
        """(new param leaves, param leaves, spec, new state); leaves are None for an empty tree."""
        g, spec = tensor_leaves(updates, "updates")
        count = state.count + 1
        v = lr_value(lr, state.count)
        if not g:
            return None, None, spec, state._replace(count=count, lr=lr_record(v))
        if params is None:
            raise LeafTypeError("adam_step needs params: call update(grads, state, params)")
        p = flatten_like(params, spec, "params")
        t = int(count)
        if not amsgrad and _fused_adamw_applies(p, state, spec):
            return _fused_adamw_step(g, p, state, spec, v, t, count, b1, b2, eps, wd)
        if not amsgrad and _host_adamw_applies(p, g, state):
            return _host_adamw_step(g, p, state, spec, v, t, count, b1, b2, eps, wd, lr)
        bc1, bc2_sqrt = 1.0 - b1 ** t, (1.0 - b2 ** t) ** 0.5
        donated = writable(p + tree.leaves(state.mu) + tree.leaves(state.nu))
        if donated and not isinstance(v, torch.Tensor):
            mu, nu, nu_max = _adam_in_place(g, p, state, spec, b1, b2, eps, wd, v, bc1, bc2_sqrt, amsgrad)
            new = AdamState(count, tree.unflatten(spec, mu), tree.unflatten(spec, nu),
                            tree.unflatten(spec, nu_max) if amsgrad else None, lr=lr_record(v))
            return p, p, spec, new
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
        new = AdamState(count, tree.unflatten(spec, mu), tree.unflatten(spec, nu),
                        tree.unflatten(spec, nu_max) if amsgrad else None, lr=lr_record(v))
        return new_p, p, spec, new

    return GradientTransformation(init, update, apply)


# a donated Adam step's leaves are updated in groups of about this many bytes (of params),
# so its one temporary (the denominator) is a group's, not the whole state's
_IN_PLACE_GROUP_BYTES = 16 * 2**20


def _adam_in_place(g, p, state, spec, b1, b2, eps, wd, lr: float, bc1, bc2_sqrt, amsgrad):
    """A donated step's Adam (float lr): the kernels and order of `adam_step`'s foreach path,
    writing m, v (v_max) and p' into the state's own tensors (`dsfn.state.donation`), group
    by group. Elementwise, so bitwise the out-of-place result. Returns (mu, nu, nu_max) leaves."""
    mu = flatten_like(state.mu, spec, "Adam state.mu")
    nu = flatten_like(state.nu, spec, "Adam state.nu")
    mx = flatten_like(state.nu_max, spec, "Adam state.nu_max") if amsgrad else None
    groups, cur, size = [], [], 0
    for k, x in enumerate(p):
        cur.append(k)
        size += x.numel() * x.element_size()
        if size >= _IN_PLACE_GROUP_BYTES:
            groups.append(cur)
            cur, size = [], 0
    groups += [cur] if cur else []
    with torch.no_grad():
        for idx in groups:
            gi, pi, mi, vi = ([xs[k] for k in idx] for xs in (g, p, mu, nu))
            torch._foreach_lerp_(mi, gi, 1.0 - b1)
            torch._foreach_mul_(vi, b2)
            torch._foreach_addcmul_(vi, gi, gi, value=1.0 - b2)
            if amsgrad:
                xi = [mx[k] for k in idx]
                torch._foreach_maximum_(xi, vi)
            denom = torch._foreach_sqrt(xi if amsgrad else vi)
            torch._foreach_div_(denom, bc2_sqrt)
            torch._foreach_add_(denom, eps)
            if wd != 0.0:
                torch._foreach_mul_(pi, 1 - lr * wd)
            torch._foreach_addcdiv_(pi, mi, denom, value=-(lr / bc1))
    return mu, nu, mx


def _fused_adamw_applies(p: list[torch.Tensor], state: AdamState, spec: tree.TreeSpec) -> bool:
    """The Triton AdamW kernel runs where dispatch picks Triton (CUDA by default) for fp32
    params and moments; everything else keeps the foreach path."""
    from dsfn.ops import dispatch
    if not p or any(x.dtype != torch.float32 for x in p) or not dispatch.use_triton(*p):
        return False
    return all(x.dtype == torch.float32 for x in tree.leaves(state.mu) + tree.leaves(state.nu))


def _host_adamw_applies(p: list[torch.Tensor], g: list[torch.Tensor], state: AdamState) -> bool:
    """The C++ host kernel runs inside `dispatch.host_update()` (what `offload` does) for
    fp32 CPU params and moments."""
    from dsfn.ops import dispatch
    if not p or not dispatch.host_update_active():
        return False
    mn = tree.leaves(state.mu) + tree.leaves(state.nu)
    return all(x.dtype == torch.float32 and x.device.type == "cpu" for x in p + mn) and \
        all(x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16) for x in g)


def _host_adamw_step(g, p, state: AdamState, spec, v, t: int, count, b1, b2, eps, wd, lr):
    """New params and moments from the fused C++ host kernel (`dsfn.ops.cpu_adam`): one
    multi-threaded pass over copies of (param, m, v) (inputs are never written). Moments are
    torch's bitwise; params within an ulp (the kernel's sqrt is correctly rounded).

    An offload session (`dispatch.host_session()`) may hold leaves already updated during
    backward from these very inputs (`lookup` checks them); those are taken as they are.
    The step's recipe (inputs of the next step per leaf path, scalars) is recorded for it."""
    from dsfn.ops import dispatch
    mu_in = flatten_like(state.mu, spec, "Adam state.mu")
    nu_in = flatten_like(state.nu, spec, "Adam state.nu")
    session = dispatch.host_session()
    lr_f = float(v)
    hyper = (b1, b2, eps, wd)
    new_p, mu, nu = [None] * len(g), [None] * len(g), [None] * len(g)
    todo = list(range(len(g)))
    if session is not None:
        from dsfn.placed import is_placed
        # parameter paths (a sharded leaf is one Placed node: its path, not its child's)
        paths = [q for q, _ in tree.leaves_with_path(tree.unflatten(spec, todo), is_leaf=is_placed)]
        hits = {k: session.lookup(paths[k], g[k], p[k], mu_in[k], nu_in[k], lr_f, t, hyper) for k in todo}
        for k, hit in hits.items():
            if hit is not None:
                new_p[k], mu[k], nu[k] = hit
        todo = [k for k, hit in hits.items() if hit is None]
    if todo:
        _host_adamw_groups(todo, g, p, mu_in, nu_in, new_p, mu, nu, dispatch.host_plan(),
                           {"lr": lr_f, "step": t, "beta1": b1, "beta2": b2, "eps": eps, "weight_decay": wd,
                            "cores": dispatch.host_cores()})
    if session is not None:
        session.record(paths, new_p, mu, nu, hyper, lambda c: float(lr_value(lr, c)), int(count))
    new = AdamState(count, tree.unflatten(spec, mu), tree.unflatten(spec, nu), None, lr=lr_record(v))
    return new_p, p, spec, new


def _host_adamw_groups(todo, g, p, mu_in, nu_in, new_p, mu, nu, plan, kw) -> None:
    """Run the host kernel over leaves `todo`, writing new (param, m, v) into `new_p`, `mu`,
    `nu`. Without a plan: one call over fresh copies. With offload's NVMe plan: in
    sub-groups of about `plan.group_bytes`, each leaf's result goes straight into its
    pre-allocated file-backed destination; the next sub-group's inputs are read ahead
    (`plan.prefetch`) while this one computes, and a finished sub-group's pages (inputs and
    outputs) are released, so resident memory stays about one sub-group."""
    from dsfn.ops.cpu_adam import cpu_adamw_multi_

    in_place = plan is None and writable([x[k] for k in todo for x in (p, mu_in, nu_in)])

    def dest(x: torch.Tensor) -> torch.Tensor:
        if in_place and x.is_contiguous():     # a donated step: the kernel updates the input
            return x
        d = plan.out_for(x) if plan is not None else None
        if d is None:
            return x.clone(memory_format=torch.contiguous_format)
        return d.copy_(x)
    groups, cur, size = [], [], 0
    limit = plan.group_bytes if plan is not None else float("inf")
    for k in todo:
        cur.append(k)
        size += 3 * p[k].numel() * p[k].element_size()
        if size >= limit:
            groups.append(cur)
            cur, size = [], 0
    if cur:
        groups.append(cur)
    for i, grp in enumerate(groups):
        if plan is not None and i + 1 < len(groups):
            plan.prefetch([x[k] for k in groups[i + 1] for x in (p, mu_in, nu_in)])
        outs = [[dest(x[k]) for x in (p, mu_in, nu_in)] for k in grp]
        cpu_adamw_multi_([o[0] for o in outs], [g[k].contiguous() for k in grp], [o[1] for o in outs],
                         [o[2] for o in outs], **kw)
        for k, (a, b, c) in zip(grp, outs):
            new_p[k], mu[k], nu[k] = a, b, c
        if plan is not None:
            plan.release([x[k] for k in grp for x in (p, mu_in, nu_in)] + [x for o in outs for x in o])


def _fused_adamw_step(g, p, state: AdamState, spec, v, t: int, count, b1, b2, eps, wd):
    """One multi-tensor launch of the Triton kernel per device and grad dtype over every
    (param, grad, m, v) (`dsfn.ops.adamw.adamw_update_multi`): the step's scalars are made
    once (on the host for a float lr, on the device for a tensor one: no host sync), never
    per leaf, and the new leaves of a non-donated step are views into one flat buffer per
    kind."""
    from dsfn.ops.adamw import adamw_update_multi
    mu = flatten_like(state.mu, spec, "Adam state.mu")
    nu = flatten_like(state.nu, spec, "Adam state.nu")
    # a donated step: each element is read and written by the same program, so out= may be the input
    in_place = writable(p + mu + nu) and all(x.is_contiguous() for x in p + mu + nu)
    by_device: dict[torch.device, list[int]] = {}
    for k, x in enumerate(p):
        by_device.setdefault(x.device, []).append(k)
    new_p, new_m, new_v = [None] * len(p), [None] * len(p), [None] * len(p)
    for dev, idx in by_device.items():
        # a host tensor lr handed to the kernel's scalar set-up would be a blocking copy;
        # its value is read on the host and the coefficients made there (one small copy)
        lr = float(v.reshape(())) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v
        outs = adamw_update_multi([p[k] for k in idx], [g[k] for k in idx], [mu[k] for k in idx],
                                  [nu[k] for k in idx], lr=lr, step=t, beta1=b1, beta2=b2, eps=eps,
                                  weight_decay=wd,
                                  out=[(p[k], mu[k], nu[k]) for k in idx] if in_place else None)
        for k, o in zip(idx, outs):
            new_p[k], new_m[k], new_v[k] = o.param, o.exp_avg, o.exp_avg_sq
    new = AdamState(count, tree.unflatten(spec, new_m), tree.unflatten(spec, new_v), None, lr=lr_record(v))
    return new_p, p, spec, new


# ---------------------------------------------------------------------------------------
# SGD momentum


class TraceState(NamedTuple):
    """count: 0-dim int64 (updates made); trace: momentum buffers shaped like params."""
    count: torch.Tensor
    trace: PyTree


def trace(momentum: float, dampening: float = 0.0, nesterov: bool = False) -> GradientTransformation:
    """torch.optim.SGD's momentum buffer.

    First update (count 0): `buf = g` (a copy; torch's first-step rule, no dampening).
    Later: `buf = momentum * buf + (1 - dampening) * g`.
    Output: `g + momentum * buf` with nesterov, else `buf`.
    """
    momentum = check_real("trace(momentum)", momentum, lo=0.0, hint="; e.g. 0.9")
    dampening = check_real("trace(dampening)", dampening)
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ConfigError(f"nesterov=True needs momentum > 0 and dampening == 0 (got momentum={momentum}, "
                          f"dampening={dampening}); set nesterov=False or change them")

    def init(params: PyTree) -> TraceState:
        leaves, spec = tensor_leaves(params, "params")
        return TraceState(count=zero_count(), trace=tree.unflatten(spec, [torch.zeros_like(x) for x in leaves]))

    def update(updates: PyTree, state: TraceState, params: PyTree = None) -> tuple[PyTree, TraceState]:
        g, spec = tensor_leaves(updates, "updates")
        count = state.count + 1
        if not g:
            return updates, state._replace(count=count)
        buf = flatten_like(state.trace, spec, "trace state")
        in_place = writable(buf)                    # a donated step: the buffer is updated in place
        if int(state.count) == 0:
            if in_place:
                with torch.no_grad():
                    torch._foreach_copy_(buf, g)
            else:
                buf = [x.detach().clone() for x in g]   # a copy: the state must not alias the caller's grads
        else:
            if in_place:
                with torch.no_grad():
                    torch._foreach_mul_(buf, momentum)
            else:
                buf = torch._foreach_mul(buf, momentum)
            torch._foreach_add_(buf, g, alpha=1.0 - dampening)
        out = torch._foreach_add(g, buf, alpha=momentum) if nesterov else buf
        return tree.unflatten(spec, out), TraceState(count=count, trace=tree.unflatten(spec, buf))

    return GradientTransformation(init, update)


# ---------------------------------------------------------------------------------------
# learning rate


class ScaleByLearningRateState(NamedTuple):
    """count: 0-dim int64 (updates made); lr: the lr of the last update (before the first
    update: the lr the first one will use). A tensor lr is stored as the same object; a
    float lr as a 0-dim float64 CPU tensor. `current_lr` finds this field."""
    count: torch.Tensor
    lr: torch.Tensor


def scale_by_learning_rate(lr: LearningRate, *, flip_sign: bool = True) -> GradientTransformation:
    """`u -> -lr * u` (or `lr * u` with flip_sign=False); lr resolved at each update.

    The lr used by the update at count c is `lr(c)` for a schedule; the state records it.
    """
    check_learning_rate(lr, "scale_by_learning_rate")
    sign = -1.0 if flip_sign else 1.0

    def init(params: PyTree) -> ScaleByLearningRateState:
        count = zero_count()
        return ScaleByLearningRateState(count=count, lr=lr_record(lr_value(lr, count)))

    def update(updates: PyTree, state: ScaleByLearningRateState,
               params: PyTree = None) -> tuple[PyTree, ScaleByLearningRateState]:
        u, spec = tensor_leaves(updates, "updates")
        v = lr_value(lr, state.count)
        new = ScaleByLearningRateState(count=state.count + 1, lr=lr_record(v))
        if not u:
            return updates, new
        if isinstance(v, torch.Tensor):
            factor = torch.neg(v.reshape(())) if flip_sign else v   # stays a tensor: no host sync
        else:
            factor = sign * v
        return tree.unflatten(spec, mul_scalar(u, factor, promote=False)), new

    return GradientTransformation(init, update)


def _is_lr_state(x: Any) -> bool:
    """A state node (NamedTuple or dataclass) with a tensor field `lr`: the protocol by which
    any lr-applying transform (ours, or e.g. a Muon step) reports its lr to `current_lr`."""
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return "lr" in x._fields and isinstance(x.lr, torch.Tensor)
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and isinstance(getattr(x, "lr", None), torch.Tensor)


def current_lr(opt_state: PyTree) -> torch.Tensor | None:
    """The `lr` of the first lr-recording state node in `opt_state` (flatten order), or None.

    Lr-recording nodes are NamedTuples/dataclasses with a tensor field `lr`
    (`ScaleByLearningRateState`, `AdamState`). Used for the `lr` step metric; with several
    learning rates (e.g. `partition`) it is the first one's.
    """
    for node in tree.leaves(opt_state, is_leaf=_is_lr_state):
        if _is_lr_state(node):
            return node.lr
    return None
