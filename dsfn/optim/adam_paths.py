"""The fast paths of `adam_step`'s update, chosen per step: the Triton kernel, the C++ host kernel, in place.

- `fused_adamw_step`: where dispatch picks Triton (CUDA by default) for fp32 params and
  moments (`fused_adamw_applies`), one multi-tensor launch of `dsfn.ops.adamw`'s kernel
  per device and grad dtype;
- `host_adamw_step`: inside `dispatch.host_update()` (what `offload` does) for fp32 CPU
  params and moments (`host_adamw_applies`), the fused C++ host kernel
  (`dsfn.ops.cpu_adam`), with offload's session and NVMe plan;
- `adam_in_place`: a donated step with a float lr (`dsfn.state.donation`), the foreach
  kernels of `adam_step` writing into the state's own tensors, group by group.

Each returns the new leaves; `dsfn.optim.adam_transform.adam_step` builds the state.
"""
from __future__ import annotations

from typing import Any

import torch

from dsfn import tree
from dsfn.aliasing import writable
from dsfn.optim.base import flatten_like
from dsfn.optim.learning_rate import lr_value

__all__ = ["IN_PLACE_GROUP_BYTES", "adam_in_place", "fused_adamw_applies", "fused_adamw_step", "host_adamw_applies",
           "host_adamw_step"]

# a donated Adam step's leaves are updated in groups of about this many bytes (of params),
# so its one temporary (the denominator) is a group's, not the whole state's
IN_PLACE_GROUP_BYTES = 16 * 2**20


def adam_in_place(g, p, state, spec, b1, b2, eps, wd, lr: float, bc1, bc2_sqrt, amsgrad):
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
        if size >= IN_PLACE_GROUP_BYTES:
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


def fused_adamw_applies(p: list[torch.Tensor], state: Any, spec: tree.TreeSpec) -> bool:
    """The Triton AdamW kernel runs where dispatch picks Triton (CUDA by default) for fp32
    params and moments; everything else keeps the foreach path."""
    from dsfn.ops import dispatch
    if not p or any(x.dtype != torch.float32 for x in p) or not dispatch.use_triton(*p):
        return False
    return all(x.dtype == torch.float32 for x in tree.leaves(state.mu) + tree.leaves(state.nu))


def host_adamw_applies(p: list[torch.Tensor], g: list[torch.Tensor], state: Any) -> bool:
    """The C++ host kernel runs inside `dispatch.host_update()` (what `offload` does) for
    fp32 CPU params and moments."""
    from dsfn.ops import dispatch
    if not p or not dispatch.host_update_active():
        return False
    mn = tree.leaves(state.mu) + tree.leaves(state.nu)
    return all(x.dtype == torch.float32 and x.device.type == "cpu" for x in p + mn) and \
        all(x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16) for x in g)



def host_adamw_step(g, p, state: Any, spec, v, t: int, count, b1, b2, eps, wd, lr) -> tuple[list, list, list]:
    """New params and moments from the fused C++ host kernel (`dsfn.ops.cpu_adam`): one
    multi-threaded pass over copies of (param, m, v) (inputs are never written). Moments are
    torch's bitwise; params within an ulp (the kernel's sqrt is correctly rounded).

    An offload session (`dispatch.host_session()`) may hold leaves already updated during
    backward from these very inputs (`lookup` checks them); those are taken as they are.
    The step's recipe (inputs of the next step per leaf path, scalars) is recorded for it.
    Returns the (param, m, v) leaves."""
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
    return new_p, mu, nu


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

def fused_adamw_step(g, p, state: Any, spec, v, t: int, b1, b2, eps, wd) -> tuple[list, list, list]:
    """One multi-tensor launch of the Triton kernel per device and grad dtype over every
    (param, grad, m, v) (`dsfn.ops.adamw.adamw_update_multi`): the step's scalars are made
    once (on the host for a float lr, on the device for a tensor one: no host sync), never
    per leaf, and the new leaves of a non-donated step are views into one flat buffer per
    kind. Returns the (param, m, v) leaves."""
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
    return new_p, new_m, new_v
