"""Fast host AdamW: the optimizer step of CPU offload, vectorised and multi-threaded.

`cpu_adamw_(param, grad, exp_avg, exp_avg_sq, *, lr, step, ...)` updates fp32 CPU tensors
in place with torch.optim.AdamW's math (decoupled weight decay, bias correction), in one
fused pass; `cpu_adamw_multi_(params, grads, exp_avgs, exp_avg_sqs, ...)` does a list in
one call, parallel over the concatenated work. DeepSpeed's counterpart is
`DeepSpeedCPUAdam` (csrc/adam, AVX intrinsics) with `cpuadam_cores_perc` of the cores.

Math (t = `step`, the 1-based number of this update; the same float32 operations in the
same order as torch.optim.AdamW and `dsfn.ops.adamw.adamw_update_torch`):

    p *= 1 - lr*wd;  m = lerp(m, g, 1 - b1);  v = b2*v + (1 - b2)*g*g
    p += (-lr / (1 - b1**t)) * m / (sqrt(v) / sqrt(1 - b2**t) + eps)

The step scalars are computed in float64 and rounded once to float32, as torch rounds a
Python scalar for a float32 kernel. exp_avg and exp_avg_sq come out bitwise equal to
torch's; the param differs from torch's only where torch's CPU `sqrt` (not correctly
rounded: about one root in five is an ulp off) differs from the IEEE root used here, and
is bitwise torch's op order with a correctly rounded sqrt (tests/ops/test_cpu_adam.py).

Inputs: param, exp_avg, exp_avg_sq contiguous float32 CPU tensors of one shape; grad of
that shape, float32, bfloat16 or float16 (read as float32); `lowp_out` None or a
contiguous bfloat16/float16 tensor of that shape that receives the new param, rounded to
nearest even like `Tensor.to`, in the same pass. Bad input raises LeafTypeError (not a
tensor, dtype), ShapeError (shape, layout) or ConfigError (device, hyper-parameters).

Threads: `cores=None` uses torch.get_num_threads(); a fraction in (0, 1] uses
max(1, int(cores * os.cpu_count())) threads (DeepSpeed's `cpuadam_cores_perc`). Results
do not depend on the thread count (the update is elementwise).

Backends (`cpu_adam_backend()` says which runs):

- "cpp": dsfn/ops/csrc/cpu_adam.cpp, one C++ file with a C ABI (no torch headers, builds
  in about a second), compiled on first use by `torch.utils.cpp_extension.load(name=
  "dsfn_cpu_adam", is_python_module=False)` into torch's extension cache (TORCH_EXTENSIONS_DIR,
  default ~/.cache/torch_extensions/<python-torch-tag>/dsfn_cpu_adam) and reused by later
  processes (ninja rebuilds only when the source changes). No -march=native: the hot loops
  are built for AVX-512, AVX2+FMA and baseline x86-64 (GCC target_clones) and chosen at
  load time, so a cache shared between machines stays correct. Needs a C++ compiler with
  OpenMP and the `ninja` executable; called through ctypes, which releases the GIL.
- "foreach": the same math with torch `_foreach_*` ops (torch's own sqrt, hence torch's
  results bitwise), used when the build fails (one RuntimeWarning says why).

`DSFN_CPU_ADAM=auto|cpp|foreach` (default auto) or the `backend=` argument chooses:
auto = cpp when it builds, else foreach; cpp = cpp or an error.
"""
from __future__ import annotations

import ctypes
import math
import os
import subprocess
import threading
import warnings
from collections.abc import Sequence
from numbers import Integral
from pathlib import Path

import torch

from dsfn.checks import check_real
from dsfn.errors import ConfigError, LeafTypeError, ShapeError
from dsfn.ops.adamw import check_adam_operands

__all__ = ["BACKENDS", "cpu_adam_backend", "cpu_adam_threads", "cpu_adamw_", "cpu_adamw_multi_"]

BACKENDS = ("auto", "cpp", "foreach")
ENV = "DSFN_CPU_ADAM"
SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_adam.cpp"
_EXT_NAME = "dsfn_cpu_adam"
_ABI_VERSION = 1
_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
_GRAD_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_LOWP_CODES = {torch.bfloat16: 1, torch.float16: 2}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_build_error: str | None = None
_built = False


# ---------------------------------------------------------------------------------------
# the C++ library


def _build() -> ctypes.CDLL:
    from torch.utils import cpp_extension
    path = cpp_extension.load(name=_EXT_NAME, sources=[str(SOURCE)], extra_cflags=list(_CFLAGS),
                              extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    lib = ctypes.CDLL(str(path))
    lib.dsfn_cpu_adam_abi_version.restype = ctypes.c_int32
    if lib.dsfn_cpu_adam_abi_version() != _ABI_VERSION:
        raise RuntimeError(f"{path} has ABI version {lib.dsfn_cpu_adam_abi_version()}, expected {_ABI_VERSION}")
    lib.dsfn_cpu_adam_max_threads.restype = ctypes.c_int32
    f = lib.dsfn_cpu_adamw
    vp = ctypes.c_void_p
    f.argtypes = [ctypes.c_int64, vp, vp, vp, vp, vp, vp, vp, vp] + [ctypes.c_float] * 7 + [ctypes.c_int32]
    f.restype = ctypes.c_int32
    return lib


def _load_lib() -> ctypes.CDLL | None:
    """The built library, or None (with `_build_error` set) when it cannot be built."""
    global _lib, _build_error, _built
    if _built:
        return _lib
    with _lock:
        if not _built:
            try:
                _lib = _build()
            except (RuntimeError, OSError, ImportError, ValueError, subprocess.SubprocessError) as e:
                # no compiler, no ninja, OpenMP missing, a stale or foreign library, ...
                _build_error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
                _lib = None
            _built = True
    return _lib


def _resolve(backend: str | None) -> str:
    choice = backend if backend is not None else os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        src = "backend=" if backend is not None else f"{ENV}="
        raise ConfigError(f"cpu_adamw: {src}{choice!r} is not one of {BACKENDS}")
    if choice == "foreach":
        return "foreach"
    lib = _load_lib()
    if lib is not None:
        return "cpp"
    if choice == "cpp":
        raise ConfigError(f"cpu_adamw: the C++ host AdamW ({SOURCE}) could not be built ({_build_error}); "
                          f"install a C++ compiler with OpenMP and ninja, or use {ENV}=foreach")
    _warn_fallback()
    return "foreach"


_warned = False


def _warn_fallback() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"dsfn cpu_adamw: the C++ host AdamW could not be built ({_build_error}); using the "
                      f"slower torch foreach implementation (set {ENV}=foreach to silence this)",
                      RuntimeWarning, stacklevel=3)


def cpu_adam_backend(backend: str | None = None) -> str:
    """"cpp" or "foreach": the implementation `cpu_adamw_` runs (building the C++ one if needed)."""
    return _resolve(backend)


def cpu_adam_threads(cores: float | None = None) -> int:
    """The number of threads `cpu_adamw_(cores=cores)` uses."""
    if cores is None:
        return max(1, torch.get_num_threads())
    c = check_real("cpu_adamw(cores)", cores, lo=0.0, hi=1.0, lo_open=True,
                   hint="; pass the fraction of os.cpu_count() threads to use, e.g. 0.8, or None")
    return max(1, int(c * (os.cpu_count() or 1)))


# ---------------------------------------------------------------------------------------
# validation


def _check_tensors(who: str, param, grad, exp_avg, exp_avg_sq, lowp_out) -> None:
    extra = () if lowp_out is None else (("lowp_out", lowp_out, tuple(_LOWP_CODES),
                                          "use bfloat16 or float16 (or lowp_out=None)"),)
    named = check_adam_operands(who, param, grad, exp_avg, exp_avg_sq, extra)
    for name, t in named:
        if t.device.type != "cpu":
            raise ConfigError(f"{who}: {name} is on {t.device}; the host AdamW updates CPU tensors (move the "
                              "state to the CPU, or use dsfn.ops.adamw_update on the device)")
    for name, t in named:
        if not t.is_contiguous():
            raise ShapeError(f"{who}: {name} is not contiguous (strides {t.stride()}); the host AdamW works "
                             "in place on contiguous tensors: pass .contiguous() buffers you keep")


def _scalars(who: str, lr, step, beta1, beta2, eps, weight_decay) -> tuple[float, ...]:
    """float32-rounded (decay, neg_step, bc2_sqrt, w1, beta2, w2, eps) for this step."""
    b1 = check_real(f"{who}(beta1)", beta1, lo=0.0, hi=1.0, hi_open=True, hint="; e.g. 0.9")
    b2 = check_real(f"{who}(beta2)", beta2, lo=0.0, hi=1.0, hi_open=True, hint="; e.g. 0.999")
    eps = check_real(f"{who}(eps)", eps, lo=0.0, hint="; e.g. 1e-8")
    wd = check_real(f"{who}(weight_decay)", weight_decay, lo=0.0, hint="; use 0 for no weight decay")
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or not lr.is_floating_point():
            raise ConfigError(f"{who}(lr=tensor of shape {tuple(lr.shape)}, dtype {lr.dtype}): pass a float "
                              "or a 1-element floating tensor")
        lr = float(lr.item())
    lr = check_real(f"{who}(lr)", lr, lo=0.0, hint="; the learning rate must be >= 0")
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point():
        step = int(step.item())
    if isinstance(step, bool) or not isinstance(step, Integral) or step < 1:
        raise ConfigError(f"{who}(step={step!r}): pass an int >= 1 (the number of this update, from 1: "
                          "torch's state['step'] after its increment)")
    t = float(step)
    bc1 = 1.0 - b1 ** t
    bc2_sqrt = math.sqrt(1.0 - b2 ** t)
    vals = (1.0 - lr * wd, -(lr / bc1), bc2_sqrt, 1.0 - b1, b2, 1.0 - b2, eps)
    return tuple(torch.tensor(vals, dtype=torch.float64).to(torch.float32).tolist())


# ---------------------------------------------------------------------------------------
# the two implementations


def _run_cpp(lib: ctypes.CDLL, params, grads, exp_avgs, exp_avg_sqs, lowps, sc, nthreads: int) -> None:
    n = len(params)
    ptrs = lambda ts: (ctypes.c_void_p * n)(*[t.data_ptr() if t is not None else None for t in ts])
    gtypes = (ctypes.c_int32 * n)(*[_GRAD_CODES[g.dtype] for g in grads])
    ltypes = (ctypes.c_int32 * n)(*[_LOWP_CODES[x.dtype] if x is not None else -1 for x in lowps])
    numels = (ctypes.c_int64 * n)(*[p.numel() for p in params])
    rc = lib.dsfn_cpu_adamw(n, ptrs(params), ptrs(grads), gtypes, ptrs(exp_avgs), ptrs(exp_avg_sqs), ptrs(lowps),
                            ltypes, numels, *sc, nthreads)
    if rc != 0:   # pragma: no cover - arguments are validated above
        raise RuntimeError(f"dsfn_cpu_adamw returned {rc}")


def _run_foreach(params, grads, exp_avgs, exp_avg_sqs, lowps, sc, nthreads: int | None) -> None:
    decay, neg_step, bc2_sqrt, w1, b2, w2, eps = sc
    keep = [i for i, p in enumerate(params) if p.numel() > 0]
    if not keep:
        return
    pick = lambda ts: [ts[i] for i in keep]
    params, grads, exp_avgs, exp_avg_sqs, lowps = map(pick, (params, grads, exp_avgs, exp_avg_sqs, lowps))
    old = torch.get_num_threads()
    if nthreads is not None and nthreads != old:
        torch.set_num_threads(nthreads)
    try:
        with torch.no_grad():
            g = [x if x.dtype == torch.float32 else x.float() for x in grads]
            if decay != 1.0:
                torch._foreach_mul_(params, decay)
            torch._foreach_lerp_(exp_avgs, g, w1)
            torch._foreach_mul_(exp_avg_sqs, b2)
            torch._foreach_addcmul_(exp_avg_sqs, g, g, value=w2)
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denom, bc2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(params, exp_avgs, denom, value=neg_step)   # p + (neg_step * m) / d
            for p, lp in zip(params, lowps):
                if lp is not None:
                    lp.copy_(p)
    finally:
        if nthreads is not None and nthreads != old:
            torch.set_num_threads(old)


# ---------------------------------------------------------------------------------------
# public API


def cpu_adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               lr: float, step: int, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
               weight_decay: float = 0.0, cores: float | None = None, lowp_out: torch.Tensor | None = None,
               backend: str | None = None) -> None:
    """One AdamW step on fp32 CPU tensors, in place (see the module docstring)."""
    cpu_adamw_multi_([param], [grad], [exp_avg], [exp_avg_sq], lr=lr, step=step, beta1=beta1, beta2=beta2,
                     eps=eps, weight_decay=weight_decay, cores=cores,
                     lowp_outs=None if lowp_out is None else [lowp_out], backend=backend, _who="cpu_adamw_")


def cpu_adamw_multi_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                     exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *, lr: float,
                     step: int, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                     weight_decay: float = 0.0, cores: float | None = None,
                     lowp_outs: Sequence[torch.Tensor | None] | None = None, backend: str | None = None,
                     _who: str = "cpu_adamw_multi_") -> None:
    """`cpu_adamw_` over lists (one lr/step for all), in one call parallel over all the elements.

    `lowp_outs`: None, or a list (same length) of bfloat16/float16 tensors or None entries.
    """
    who = _who
    lists = {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if lowp_outs is not None:
        lists["lowp_outs"] = lowp_outs
    for name, ts in lists.items():
        if isinstance(ts, torch.Tensor) or not isinstance(ts, Sequence):
            raise LeafTypeError(f"{who}: {name} must be a list of tensors, got {type(ts).__name__}")
    lens = {name: len(ts) for name, ts in lists.items()}
    if len(set(lens.values())) != 1:
        raise ShapeError(f"{who}: the lists have different lengths {lens}; pass one entry per param")
    params, grads, exp_avgs, exp_avg_sqs = (list(x) for x in (params, grads, exp_avgs, exp_avg_sqs))
    lowps = list(lowp_outs) if lowp_outs is not None else [None] * len(params)
    for i in range(len(params)):
        w = who if _who == "cpu_adamw_" else f"{who}[{i}]"
        _check_tensors(w, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], lowps[i])
    sc = _scalars(who, lr, step, beta1, beta2, eps, weight_decay)
    nthreads = cpu_adam_threads(cores)
    if not params:
        return
    if _resolve(backend) == "cpp":
        _run_cpp(_lib, params, grads, exp_avgs, exp_avg_sqs, lowps, sc, nthreads)
    else:
        _run_foreach(params, grads, exp_avgs, exp_avg_sqs, lowps, sc, None if cores is None else nthreads)
