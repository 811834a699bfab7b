"""Which implementation of a kernel runs: Triton where it can run, plain torch elsewhere.

Every op in `dsfn/ops/` has a torch reference (same signature, any device) and a Triton
kernel. `use_triton(*tensors, dtypes=())` decides per call:

- default "auto": Triton when it is importable and every tensor is on one CUDA device
  that can run the kernel; the references everywhere else. A CUDA device that cannot
  (compute capability < 7.0; bf16 operands on a device without bf16, i.e. < sm_80) falls
  back to the reference with a one-time RuntimeWarning naming the reason.
- `DSFN_KERNELS=torch` forces the references; `DSFN_KERNELS=triton` forces the kernels,
  which on CPU needs `TRITON_INTERPRET=1` (Triton's interpreter: how the tests run the
  real kernels on CPU); where they cannot run it is a ConfigError, not a silent fallback.

No kernel is selected on a device where it cannot run (CPU without the interpreter, MPS,
a CUDA build without Triton, a pre-Volta GPU, bf16 on a pre-Ampere GPU, tensors spread
over several GPUs). Kernels launch under `device_guard(tensor)`: Triton launches on the
*current* CUDA device, which need not be the tensors' one.

`TRITON_INTERPRET` is read by `triton.jit` when a kernel is decorated, i.e. when `dsfn.ops`
is imported; the value then is recorded here (`interpreting()`). Changing the variable
afterwards cannot change what the kernels are, so any Triton selection with a changed
value raises ConfigError (set it before importing dsfn). ROCm devices skip the capability
checks (Triton's AMD backend; their capability numbers are not sm versions).

Triton's cache follows its own settings (`TRITON_HOME`, `TRITON_CACHE_DIR`); dsfn never
overrides them.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from dsfn.errors import ConfigError

MODES = ("auto", "torch", "triton")
# Triton's own minimum (Volta) and the first CUDA generation with bf16 arithmetic (Ampere)
MIN_CAPABILITY = (7, 0)
BF16_CAPABILITY = (8, 0)
_TRUE = ("1", "true", "yes", "on", "y")        # Triton's getenv_bool


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def _interpret_now() -> bool:
    """What `triton.jit` would decide now: interpreted (CPU) or compiled kernels."""
    try:
        import triton
        return bool(triton.knobs.runtime.interpret)     # env, or a value set in Python
    except (ImportError, AttributeError):               # no triton, or one without `knobs` (< 3.4)
        return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


# dsfn's kernel modules import this module and decorate their kernels right after, in the
# same import: this is the interpreter setting their `triton.jit` saw.
_JIT_INTERPRET = _interpret_now()


def interpreting() -> bool:
    """True when dsfn's Triton kernels run in Triton's CPU interpreter: TRITON_INTERPRET
    was set when `dsfn.ops` was imported (see `check_interpreter` for a later change)."""
    return _JIT_INTERPRET


def check_interpreter() -> None:
    """ConfigError if TRITON_INTERPRET differs from its value when dsfn's kernels were
    decorated: `triton.jit` chose interpreted or compiled kernels then, for good."""
    now = _interpret_now()
    if now != _JIT_INTERPRET:
        raise ConfigError(
            f"TRITON_INTERPRET changed after dsfn's Triton kernels were created: they are "
            f"{'interpreted (CPU)' if _JIT_INTERPRET else 'compiled (GPU)'} kernels, but TRITON_INTERPRET now "
            f"says {'interpret' if now else 'compile'}. triton.jit reads it once, when `dsfn.ops` is imported: set "
            f"TRITON_INTERPRET={'1' if now else '0'} in the environment before importing dsfn (and triton), "
            "not afterwards")


def mode() -> str:
    m = os.environ.get("DSFN_KERNELS", "auto").strip().lower()
    if m not in MODES:
        raise ConfigError(f"DSFN_KERNELS={m!r}: use one of {list(MODES)}")
    return m


def device_supports_bf16(device: torch.device | str) -> bool:
    """Whether `device` does bf16 arithmetic natively: a CUDA device of compute capability
    >= 8.0 (ROCm: torch's answer). False for every other device type: torch runs bf16 on
    CPU too, but through fp32 conversions (see `dsfn.optim.muon` for what that means)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if torch.version.hip:
        return torch.cuda.is_bf16_supported()
    return tuple(torch.cuda.get_device_capability(device)) >= BF16_CAPABILITY


def _tensors(tensors: Iterable[Any]) -> list[torch.Tensor]:
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def _cuda_problem(device: torch.device, dtypes: set[torch.dtype]) -> str | None:
    """Why a Triton kernel cannot run on CUDA `device` with operands of `dtypes`, or None."""
    if torch.version.hip:
        return None
    cap = tuple(torch.cuda.get_device_capability(device))
    if cap < MIN_CAPABILITY:
        return (f"{device} has compute capability {cap[0]}.{cap[1]}; Triton needs >= "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}")
    if torch.bfloat16 in dtypes and not device_supports_bf16(device):
        return (f"{device} (compute capability {cap[0]}.{cap[1]}) has no bf16 arithmetic (needs >= "
                f"{BF16_CAPABILITY[0]}.{BF16_CAPABILITY[1]}) for these bf16 operands")
    return None


def triton_problem(*tensors: torch.Tensor, dtypes: Iterable[torch.dtype] = ()) -> str | None:
    """Why a Triton kernel cannot run on these tensors (plus outputs of `dtypes`), or None
    when it can. Raises ConfigError if TRITON_INTERPRET changed since import."""
    ts = _tensors(tensors)
    if not triton_available():
        return "triton is not importable"
    check_interpreter()
    devices = {t.device for t in ts}
    kinds = {d.type for d in devices}
    if kinds <= {"cpu"}:
        return None if interpreting() else "CPU tensors need TRITON_INTERPRET=1 (set before importing dsfn)"
    if kinds != {"cuda"}:
        return f"Triton kernels run on CUDA (or CPU with TRITON_INTERPRET=1), not on {sorted(kinds)}"
    if len(devices) > 1:
        return f"tensors on several CUDA devices {sorted(map(str, devices))}"
    return _cuda_problem(devices.pop(), {t.dtype for t in ts} | set(dtypes))


_warned: set[str] = set()


def use_triton(*tensors: torch.Tensor, dtypes: Iterable[torch.dtype] = ()) -> bool:
    """Whether the op should run its Triton kernel on these tensors (see the module docstring).
    `dtypes`: dtypes of outputs the kernel writes beyond the tensors' own (e.g. a bf16 copy)."""
    m = mode()
    if m == "torch":
        return False
    ts = _tensors(tensors)
    kinds = {t.device.type for t in ts}
    if m == "auto":
        if not ts or kinds != {"cuda"} or not triton_available():
            return False
        why = triton_problem(*ts, dtypes=dtypes)
        if why is not None and why not in _warned:
            _warned.add(why)          # once per reason: the fallback is permanent for the process
            warnings.warn(f"dsfn.ops: using the torch reference instead of the Triton kernel: {why}",
                          RuntimeWarning, stacklevel=3)
        return why is None
    why = triton_problem(*ts, dtypes=dtypes)
    if why is not None:
        raise ConfigError(f"DSFN_KERNELS=triton but Triton kernels cannot run on {sorted(kinds)}: {why} "
                          f"(triton importable: {triton_available()}, TRITON_INTERPRET: {interpreting()}); "
                          "use a CUDA device of compute capability >= 7.0, set TRITON_INTERPRET=1 before "
                          "importing dsfn on CPU, or DSFN_KERNELS=auto")
    return True


def device_guard(*tensors: torch.Tensor | torch.device):
    """Context for a kernel launch: the first CUDA device among `tensors` (tensors or
    devices) made current, since Triton launches on the current device and stream; a no-op
    for CPU (the interpreter)."""
    for t in tensors:
        dev = t.device if isinstance(t, torch.Tensor) else t
        if isinstance(dev, torch.device) and dev.type == "cuda":
            return torch.cuda.device(dev)
    return contextlib.nullcontext()


_host = threading.local()


@contextlib.contextmanager
def host_update(enabled: bool = True, session: Any = None, plan: Any = None, cores: float | None = None):
    """Within this block, optimizer updates of CPU tensors use the fused host kernel
    (`dsfn.ops.cpu_adam`): `offload` runs its host update here. Outside it, CPU updates
    keep torch's foreach arithmetic (bitwise torch.optim). `session` (offload's overlap
    bookkeeping) offers precomputed leaf updates (`lookup`) and takes the step's recipe
    (`record`); `plan` (offload's NVMe streaming) gives file-backed destinations for the
    new state (`out_for`), sub-group size (`group_bytes`), `prefetch` and `release`; see
    `dsfn.engines.offload`. `cores`: the kernel's thread fraction (`cpu_adamw_(cores=)`)."""
    prev = (getattr(_host, "on", False), getattr(_host, "session", None), getattr(_host, "plan", None),
            getattr(_host, "cores", None))
    _host.on, _host.session, _host.plan, _host.cores = bool(enabled), session, plan, cores
    try:
        yield
    finally:
        _host.on, _host.session, _host.plan, _host.cores = prev


def host_cores() -> float | None:
    return getattr(_host, "cores", None)


def host_plan() -> Any:
    return getattr(_host, "plan", None)


def host_session() -> Any:
    return getattr(_host, "session", None)


def host_update_active() -> bool:
    return getattr(_host, "on", False)
