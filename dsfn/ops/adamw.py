"""Fused AdamW step: one pass over (param, grad, exp_avg, exp_avg_sq), out of place.

The update is dsfn's `adamw` (= `torch.optim.AdamW`, decoupled weight decay) for one
tensor. With t = `step` (the 1-based number of this update: torch's `state["step"]` after
its increment, dsfn's `AdamState.count + 1`), w1 = 1 - beta1, w2 = 1 - beta2:

    bc1 = 1 - beta1 ** t,  bc2 = 1 - beta2 ** t                     (float64)
    m'  = lerp(m, g, w1)                                            (torch.lerp)
    v'  = v * beta2 + (w2 * g) * g                                  (mul, addcmul; fma)
    d   = sqrt(v') / sqrt(bc2) + eps
    p'  = p * (1 - lr * weight_decay) + ((-lr / bc1) * m') / d      (mul, addcdiv)
    lowp = p'.to(lowp_dtype)                                        (optional)

The three step-dependent scalars (1 - lr*wd, -lr/bc1, sqrt(bc2)) are computed once per
call in float64 and rounded to float32 (as torch rounds a Scalar for a float32 kernel);
every per-element operation is float32, in torch's order. `lr` and `step` may be 0-dim
device tensors, so a schedule changes them without a host sync or a recompilation.

Three functions with one signature (`adamw_update_torch`, `adamw_update_triton`,
`adamw_update`; the last picks one with `dsfn.ops.dispatch.use_triton`). Inputs:

- param, exp_avg, exp_avg_sq: float32, one shape, one device (the fp32 master weights
  and their moments); grad: that shape and device, float32, bfloat16 or float16 (read as
  float32). Any layout; results are contiguous.
- lr: a float >= 0 or a 1-element floating tensor (float64 keeps torch's rounding of a
  Python float lr); step: an int >= 1 or a 1-element tensor (any numeric dtype). Tensors
  on another device are copied to the params' device.
- lowp_dtype: None, torch.bfloat16 or torch.float16: also return p' in that dtype,
  written in the same pass (round to nearest even, like `Tensor.to`).
- out: None (fresh results) or destinations (param, exp_avg, exp_avg_sq[, param_lowp]):
  contiguous, of the right shape/dtype/device; they may be the inputs themselves (an
  in-place update) but must not otherwise overlap them or each other.

Returns `AdamWUpdate(param, exp_avg, exp_avg_sq, param_lowp)`; param_lowp is None when
no low-precision copy was asked for. Bad input raises LeafTypeError (not a tensor, wrong
dtype), ShapeError (shapes, layout of `out`) or ConfigError (devices, hyper-parameters).

Numerics: the reference is torch.optim.AdamW bitwise (the same torch ops). The kernel
does the same float32 operations in the same order with IEEE-rounded sqrt and division
(`sqrt_rn`, `div_rn`), fused multiply-adds exactly where torch's vector kernels have them
(lerp, addcmul) and no other contraction (`enable_fp_fusion=False`). It agrees with the
reference to an ulp of the update: torch's CPU `sqrt` is not correctly rounded, so about
one root in six differs by an ulp (see tests/ops/test_adamw_kernel.py).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral
from typing import Any, NamedTuple

import torch

from dsfn.checks import check_real
from dsfn.errors import ConfigError, ShapeError
from dsfn.ops import dispatch
from dsfn.ops.adamw_checks import (  # noqa: F401  (check_adam_operands: public here too)
    check_adam_operands, check_out, check_scalar_tensor)
from dsfn.ops.adamw_kernels import triton

if triton is not None:       # the kernels (`dsfn.ops.adamw_kernels`); the helpers are public here too
    from dsfn.ops.adamw_kernels import adamw_kernel as _adamw_kernel
    from dsfn.ops.adamw_kernels import adamw_multi_kernel as _adamw_multi_kernel
    from dsfn.ops.adamw_kernels import block_offsets, cast_rne, to_bf16_rtne  # noqa: F401

__all__ = ["DEFAULT_BLOCK", "AdamWUpdate", "adamw_coefficients", "adamw_update", "adamw_update_multi", "adamw_update_torch",
           "adamw_update_triton"]

DEFAULT_BLOCK = 1024


class AdamWUpdate(NamedTuple):
    """The new param (float32), exp_avg, exp_avg_sq, and the low-precision param copy (or None)."""
    param: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    param_lowp: torch.Tensor | None


# ---------------------------------------------------------------------------------------
# validation and the per-call scalars


class _Prepared(NamedTuple):
    coef: torch.Tensor          # float32 [3] on the params' device: 1 - lr*wd, -lr/bc1, sqrt(bc2)
    w1: float
    beta2: float
    w2: float
    eps: float
    lowp_dtype: torch.dtype | None
    out: tuple | None


def adamw_coefficients(lr: float | torch.Tensor, step: int | torch.Tensor, beta1: float, beta2: float,
                       weight_decay: float, device: torch.device) -> torch.Tensor:
    """float32 tensor [1 - lr*wd, -lr/(1 - beta1**step), sqrt(1 - beta2**step)] on `device`.

    Computed in float64 (on the host for Python numbers, on `device` for tensors: no host
    sync) and rounded once to float32.
    """
    if not isinstance(lr, torch.Tensor) and not isinstance(step, torch.Tensor):
        t = float(step)
        bc1, bc2_sqrt = 1.0 - beta1 ** t, math.sqrt(1.0 - beta2 ** t)
        vals = [1.0 - lr * weight_decay, -(lr / bc1), bc2_sqrt]
        host = torch.tensor(vals, dtype=torch.float64).to(torch.float32)
        if torch.device(device).type == "cpu":
            return host
        # pinned and non_blocking: a blocking (or pageable) host-to-device copy synchronises
        if torch.device(device).type == "cuda":
            host = host.pin_memory()
        return host.to(device, non_blocking=True)
    f64: dict[str, Any] = {"device": device, "dtype": torch.float64}
    lr_t = _scalar_on(lr, f64)
    t = _scalar_on(step, f64)
    bc1 = 1.0 - torch.pow(beta1, t)
    bc2_sqrt = torch.sqrt(1.0 - torch.pow(beta2, t))
    return torch.stack([1.0 - lr_t * weight_decay, -(lr_t / bc1), bc2_sqrt]).to(torch.float32)


def _scalar_on(x: float | int | torch.Tensor, f64: dict[str, Any]) -> torch.Tensor:
    """0-dim float64 of `x` on f64["device"], with no blocking copy: a host tensor or number
    is filled in by value, a tensor on another device is copied non-blocking."""
    if not isinstance(x, torch.Tensor):
        return torch.full((), float(x), **f64)
    x = x.reshape(())
    if x.device.type == "cpu" and torch.device(f64["device"]).type != "cpu":
        return torch.full((), float(x), **f64)
    return x.to(f64["dtype"]).to(f64["device"], non_blocking=True)


def _prepare(param, grad, exp_avg, exp_avg_sq, lr, step, beta1, beta2, eps, weight_decay, lowp_dtype,
             out) -> _Prepared:
    named = check_adam_operands("adamw_update", param, grad, exp_avg, exp_avg_sq)
    devices = {t.device for _, t in named}
    if len(devices) != 1:
        raise ConfigError(f"adamw_update: param, grad, exp_avg, exp_avg_sq are on different devices "
                          f"{sorted(str(d) for d in devices)}; move them to one device")
    b1 = check_real("adamw_update(beta1)", beta1, lo=0.0, hi=1.0, hi_open=True, hint="; e.g. 0.9")
    b2 = check_real("adamw_update(beta2)", beta2, lo=0.0, hi=1.0, hi_open=True, hint="; e.g. 0.999")
    eps = check_real("adamw_update(eps)", eps, lo=0.0, hint="; e.g. 1e-8")
    wd = check_real("adamw_update(weight_decay)", weight_decay, lo=0.0, hint="; use 0 for no weight decay")
    if isinstance(lr, torch.Tensor):
        check_scalar_tensor("lr", lr, floating=True)
        if lr.device.type == "cpu" and not bool(lr.reshape(()) >= 0):      # no host sync for device lrs
            raise ConfigError(f"adamw_update(lr={lr.item()!r}): the learning rate must be >= 0")
    else:
        lr = check_real("adamw_update(lr)", lr, lo=0.0, hint="; or pass a 1-element tensor")
    if isinstance(step, torch.Tensor):
        check_scalar_tensor("step", step, floating=False)
        if step.device.type == "cpu" and not bool(step.reshape(()) >= 1):
            raise ConfigError(f"adamw_update(step={step.item()!r}): step counts updates from 1 (torch's "
                              "state['step'] after its increment; dsfn's AdamState.count + 1)")
    elif isinstance(step, bool) or not isinstance(step, Integral) or step < 1:
        raise ConfigError(f"adamw_update(step={step!r}): pass an int >= 1 (the number of this update, from 1) "
                          "or a 1-element tensor")
    out, lowp_dtype = check_out(out, lowp_dtype, param)
    coef = adamw_coefficients(lr, step, b1, b2, wd, param.device)
    return _Prepared(coef, 1.0 - b1, b2, 1.0 - b2, eps, lowp_dtype, out)


def _outputs(prep: _Prepared, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Destinations: `out` where given, else fresh contiguous tensors."""
    out = prep.out or ()

    def fresh(dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(param.shape, dtype=dtype, device=param.device)
    dst = [out[i] if i < len(out) else fresh(torch.float32) for i in range(3)]
    if prep.lowp_dtype is not None:
        dst.append(out[3] if len(out) == 4 else fresh(prep.lowp_dtype))
    else:
        dst.append(None)
    return tuple(dst)


# ---------------------------------------------------------------------------------------
# torch reference


def adamw_update_torch(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                       *, lr: float | torch.Tensor, step: int | torch.Tensor, beta1: float = 0.9,
                       beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                       lowp_dtype: torch.dtype | None = None, out: Sequence[torch.Tensor] | None = None
                       ) -> AdamWUpdate:
    """The reference: torch ops in torch.optim.AdamW's order (see the module docstring)."""
    prep = _prepare(param, grad, exp_avg, exp_avg_sq, lr, step, beta1, beta2, eps, weight_decay, lowp_dtype, out)
    decay, neg_step_size, bc2_sqrt = prep.coef.unbind(0)
    with torch.no_grad():
        g = grad.float()
        m = torch.lerp(exp_avg, g, prep.w1)
        v = exp_avg_sq * prep.beta2
        v.addcmul_(g, g, value=prep.w2)
        denom = v.sqrt()
        denom.div_(bc2_sqrt)
        denom.add_(prep.eps)
        p = param * decay
        q = m * neg_step_size
        q.div_(denom)
        p.add_(q)
        lowp = p.to(prep.lowp_dtype) if prep.lowp_dtype is not None else None
        if prep.out is None:
            return AdamWUpdate(p.contiguous(), m.contiguous(), v.contiguous(), lowp)
        dst = _outputs(prep, param)
        for d, s in zip(dst, (p, m, v, lowp)):
            if d is not None:
                d.copy_(s)
        return AdamWUpdate(*dst)


# ---------------------------------------------------------------------------------------
# Triton kernel


def adamw_update_triton(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                        *, lr: float | torch.Tensor, step: int | torch.Tensor, beta1: float = 0.9,
                        beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                        lowp_dtype: torch.dtype | None = None, out: Sequence[torch.Tensor] | None = None,
                        block: int = DEFAULT_BLOCK) -> AdamWUpdate:
    """The Triton kernel; arguments and result as `adamw_update_torch`.

    `block` (a power of two) is the elements per program. Raises ConfigError where Triton
    cannot run on these tensors (no triton, or CPU without TRITON_INTERPRET=1).
    """
    prep = _prepare(param, grad, exp_avg, exp_avg_sq, lr, step, beta1, beta2, eps, weight_decay, lowp_dtype, out)
    why = "triton is not importable" if triton is None else dispatch.triton_problem(
        param, grad, exp_avg, exp_avg_sq, *(prep.out or ()), dtypes=_lowp_dtypes(prep.lowp_dtype))
    if why is not None:
        raise ConfigError(f"adamw_update_triton: Triton kernels cannot run on {param.device.type}: {why} (triton "
                          f"importable: {triton is not None}, TRITON_INTERPRET: {dispatch.interpreting()}); "
                          "use adamw_update")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or block & (block - 1):
        raise ConfigError(f"adamw_update_triton(block={block!r}): use a power of two, e.g. {DEFAULT_BLOCK}")
    dst = _outputs(prep, param)
    n = param.numel()
    if n == 0:
        return AdamWUpdate(*dst)
    args, kwargs = _kernel_args(param, grad, exp_avg, exp_avg_sq, prep, dst, block)
    with dispatch.device_guard(param):          # Triton launches on the current device, not param's
        _adamw_kernel[(triton.cdiv(n, block),)](*args, **kwargs)
    return AdamWUpdate(*dst)


def _lowp_dtypes(lowp_dtype: torch.dtype | None) -> tuple[torch.dtype, ...]:
    return () if lowp_dtype is None else (lowp_dtype,)


def _kernel_args(param, grad, exp_avg, exp_avg_sq, prep: _Prepared, dst: tuple, block: int) -> tuple[tuple, dict]:
    """`_adamw_kernel`'s arguments (the launch grid is cdiv(numel, block) programs)."""
    p_out, m_out, v_out, lowp_out = dst
    args = (param.contiguous(), grad.contiguous(), exp_avg.contiguous(), exp_avg_sq.contiguous(), prep.coef,
            p_out, m_out, v_out, p_out if lowp_out is None else lowp_out, param.numel(),
            prep.w1, prep.beta2, prep.w2, prep.eps)
    kwargs = {"BLOCK": block, "LERP_SMALL": abs(prep.w1) < 0.5, "WRITE_LOWP": lowp_out is not None,
              "num_warps": 4, "enable_fp_fusion": False}
    return args, kwargs


def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 *, lr: float | torch.Tensor, step: int | torch.Tensor, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 0.0, lowp_dtype: torch.dtype | None = None,
                 out: Sequence[torch.Tensor] | None = None) -> AdamWUpdate:
    """One fused AdamW step (module docstring): Triton where `dispatch.use_triton` says so
    (CUDA tensors by default), the torch reference elsewhere."""
    kw: dict[str, Any] = {"lr": lr, "step": step, "beta1": beta1, "beta2": beta2, "eps": eps,
                          "weight_decay": weight_decay, "lowp_dtype": lowp_dtype, "out": out}
    dests = tuple(out) if isinstance(out, (list, tuple)) else ()      # out[3]'s dtype: the low-precision copy
    tensors = [t for t in (param, grad, exp_avg, exp_avg_sq, *dests) if isinstance(t, torch.Tensor)]
    if tensors and dispatch.use_triton(*tensors, dtypes=_lowp_dtypes(lowp_dtype)):
        return adamw_update_triton(param, grad, exp_avg, exp_avg_sq, **kw)
    return adamw_update_torch(param, grad, exp_avg, exp_avg_sq, **kw)



# ---------------------------------------------------------------------------------------
# multi-tensor: one launch per group


DEFAULT_ITERS = 16          # blocks per program: a chunk of 16K elements at DEFAULT_BLOCK


def adamw_update_multi(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                       exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
                       lr: float | torch.Tensor, step: int | torch.Tensor, beta1: float = 0.9,
                       beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                       lowp_dtype: torch.dtype | None = None,
                       out: Sequence[Sequence[torch.Tensor]] | None = None,
                       block: int = DEFAULT_BLOCK, iters: int = DEFAULT_ITERS) -> list[AdamWUpdate]:
    """`adamw_update` of every tensor of a group, with the step's scalars made once.

    Operands as `adamw_update`'s, one list entry per tensor (shapes may differ; all on one
    device). `out`: None, or one destination tuple per tensor as `adamw_update`'s `out`
    (e.g. the inputs themselves: an in-place update). Without `out` the results of all
    tensors are views into one fresh flat buffer per output kind (params, exp_avg,
    exp_avg_sq, low-precision params), so the group allocates 3-4 tensors, not 3-4 per leaf.

    Where `dispatch.use_triton` picks Triton: one multi-tensor kernel launch per grad dtype
    in the group (`dsfn.ops.multi_tensor`), computing exactly the per-tensor kernel's
    operations (bitwise its results). Elsewhere the torch reference per tensor.
    """
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n) or (out is not None and len(out) != n):
        raise ShapeError(f"adamw_update_multi: {n} params, {len(grads)} grads, {len(exp_avgs)} exp_avgs, "
                         f"{len(exp_avg_sqs)} exp_avg_sqs{'' if out is None else f', {len(out)} outs'}; pass one "
                         "entry per tensor in each list")
    if n == 0:
        return []
    kw: dict[str, Any] = {"lr": lr, "step": step, "beta1": beta1, "beta2": beta2, "eps": eps,
                          "weight_decay": weight_decay, "lowp_dtype": lowp_dtype}
    flat_out = [t for o in (out or ()) for t in o if isinstance(t, torch.Tensor)]
    if not dispatch.use_triton(*params, *grads, *exp_avgs, *exp_avg_sqs, *flat_out,
                               dtypes=_lowp_dtypes(lowp_dtype)):
        return [adamw_update_torch(p, g, m, v, out=None if out is None else out[i], **kw)
                for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs))]
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or block & (block - 1):
        raise ConfigError(f"adamw_update_multi(block={block!r}): use a power of two, e.g. {DEFAULT_BLOCK}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ConfigError(f"adamw_update_multi(iters={iters!r}): use an int >= 1, e.g. {DEFAULT_ITERS}")
    # the group's scalars and checks, once: leaf 0 is checked in full by _prepare, the rest
    # by the properties the kernel relies on
    prep = _prepare(params[0], grads[0], exp_avgs[0], exp_avg_sqs[0], lr, step, beta1, beta2, eps, weight_decay,
                    lowp_dtype, None if out is None else out[0])
    device = params[0].device
    for i in range(1, n):
        check_adam_operands("adamw_update_multi", params[i], grads[i], exp_avgs[i], exp_avg_sqs[i])
    if any(t.device != device for ts in (params, grads, exp_avgs, exp_avg_sqs) for t in ts):
        raise ConfigError("adamw_update_multi: the tensors are on several devices; group them per device")
    lowp = prep.lowp_dtype
    dst = _multi_outputs(params, out, lowp, device)
    from dsfn.ops.multi_tensor import TL_DTYPES, chunk_table, pointer_table
    by_grad: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(grads):
        if params[i].numel():
            by_grad.setdefault(g.dtype, []).append(i)
    ins = [[x.contiguous() for x in xs] for xs in (params, grads, exp_avgs, exp_avg_sqs)]
    with dispatch.device_guard(params[0]):
        for gdtype, idx in by_grad.items():
            cols = [[c[i] for i in idx] for c in ins] + [[dst[k][i] for i in idx] for k in range(3)]
            cols.append([dst[3][i] for i in idx] if lowp is not None else cols[4])
            table = pointer_table(cols, device)
            chunks = chunk_table([params[i].numel() for i in idx], block * iters, device)
            _adamw_multi_kernel[(chunks.shape[0],)](
                table, chunks, prep.coef, prep.w1, prep.beta2, prep.w2, prep.eps,
                G_DTYPE=TL_DTYPES[gdtype], L_DTYPE=TL_DTYPES[lowp if lowp is not None else torch.float32],
                BLOCK=block, ITERS=iters, LERP_SMALL=abs(prep.w1) < 0.5, WRITE_LOWP=lowp is not None,
                num_warps=4, enable_fp_fusion=False)
    return [AdamWUpdate(dst[0][i], dst[1][i], dst[2][i], dst[3][i] if lowp is not None else None) for i in range(n)]


def _multi_outputs(params: Sequence[torch.Tensor], out, lowp: torch.dtype | None,
                   device: torch.device) -> list[list[torch.Tensor | None]]:
    """Destinations [param, exp_avg, exp_avg_sq, lowp] x tensor: `out`'s (checked), else
    views into one flat buffer per kind."""
    n = len(params)
    if out is not None:
        dst: list[list[Any]] = [[None] * n for _ in range(4)]
        for i, o in enumerate(out):
            o = tuple(o)
            if len(o) not in (3, 4) or (lowp is not None) != (len(o) == 4):
                raise ConfigError(f"adamw_update_multi: out[{i}] has {len(o)} entries; pass (param, exp_avg, "
                                  "exp_avg_sq) per tensor, and param_lowp as a 4th with lowp_dtype")
            for k, t in enumerate(o):
                want = lowp if k == 3 else torch.float32
                if (not isinstance(t, torch.Tensor) or t.dtype != want or t.shape != params[i].shape
                        or not t.is_contiguous() or t.device != device):
                    raise ShapeError(f"adamw_update_multi: out[{i}][{k}] must be a contiguous {want} tensor of "
                                     f"shape {tuple(params[i].shape)} on {device}")
                dst[k][i] = t
        return dst
    from dsfn.ops.multi_tensor import flat_views
    shapes = [p.shape for p in params]
    return [flat_views(shapes, torch.float32, device), flat_views(shapes, torch.float32, device),
            flat_views(shapes, torch.float32, device), flat_views(shapes, lowp, device) if lowp is not None else [None] * n]
