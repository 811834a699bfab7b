"""Which implementation of a kernel runs: Triton where it can run, plain torch elsewhere.

Every op in `dsfn/ops/` has a torch reference (same signature, any device) and a Triton
kernel. `use_triton(*tensors)` decides per call:

- default "auto": Triton when it is importable and every tensor is on a CUDA device;
  the references everywhere else.
- `DSFN_KERNELS=torch` forces the references; `DSFN_KERNELS=triton` forces the kernels,
  which on CPU needs `TRITON_INTERPRET=1` (Triton's interpreter: how the tests run the
  real kernels on CPU); where they cannot run it is an error, not a silent fallback.

No kernel is selected on a device where it cannot run (CPU without the interpreter, MPS,
a CUDA build without Triton). Triton's cache follows its own settings (`TRITON_HOME`,
`TRITON_CACHE_DIR`); dsfn never overrides them.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Any

import torch

from dsfn.errors import ConfigError

MODES = ("auto", "torch", "triton")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def mode() -> str:
    m = os.environ.get("DSFN_KERNELS", "auto").strip().lower()
    if m not in MODES:
        raise ConfigError(f"DSFN_KERNELS={m!r}: use one of {list(MODES)}")
    return m


def can_run_triton(*tensors: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on these tensors' devices."""
    if not triton_available():
        return False
    devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if devices <= {"cuda"}:
        return True
    return devices <= {"cpu"} and interpreting()


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether the op should run its Triton kernel on these tensors (see the module docstring)."""
    m = mode()
    if m == "torch":
        return False
    if m == "auto":
        devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
        return bool(devices) and devices <= {"cuda"} and triton_available()
    ok = can_run_triton(*tensors)
    if m == "triton" and not ok:
        devices = sorted({t.device.type for t in tensors if isinstance(t, torch.Tensor)})
        raise ConfigError(f"DSFN_KERNELS=triton but Triton kernels cannot run on {devices} "
                          f"(triton importable: {triton_available()}, TRITON_INTERPRET: {interpreting()}); "
                          "use a CUDA device, set TRITON_INTERPRET=1 on CPU, or DSFN_KERNELS=auto")
    return ok


_host = threading.local()


@contextlib.contextmanager
def host_update(enabled: bool = True, session: Any = None, plan: Any = None, cores: float | None = None):
    """Within this block, optimizer updates of CPU tensors use the fused host kernel
    (`dsfn.ops.cpu_adam`): `offload` runs its host update here. Outside it, CPU updates
    keep torch's foreach arithmetic (bitwise torch.optim). `session` (offload's overlap
    bookkeeping) offers precomputed leaf updates (`lookup`) and takes the step's recipe
    (`record`); `plan` (offload's NVMe streaming) gives file-backed destinations for the
    new state (`out_for`), sub-group size (`group_bytes`), `prefetch` and `release`; see
    `dsfn.transforms.offload`. `cores`: the kernel's thread fraction (`cpu_adamw_(cores=)`)."""
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
