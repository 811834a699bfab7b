"""Build the compiled ops the tests use once, before any timed test runs.

A first use JIT-builds a C++ op into torch's extension cache (TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions): dsfn's host AdamW (`dsfn.ops.cpu_adam`, about a second idle)
and DeepSpeed's CPU shared-memory comm op (which every DeepSpeed run on the CPU
accelerator loads in `init_distributed`: about a minute on a loaded 2-core machine, and
several ranks at once wait on one build). On a fresh machine that build would land inside
the first test that needs it, under its timeout. `tests/conftest.py` calls `prebuild`
after collection for the ops the collected tests need, and `./dev setup` runs
`python -m dsfn.testing.prebuild`; a warm cache makes either a few seconds (the build
tools only check that the library is current).

Each build runs in a child process, so the test process never loads OpenMP or DeepSpeed
itself before it forks its ranks. A build that fails is reported and left to the op's own
fallback (the host AdamW's foreach backend) or to the test that needs it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

__all__ = ["OPS", "is_built", "prebuild"]

_CPU_ADAM = """
from dsfn.ops import cpu_adam
cpu_adam._load_lib()
print(cpu_adam.cpu_adam_backend())
"""
_DEEPSPEED_SHM = """
import os
os.environ.setdefault("DS_ACCELERATOR", "cpu")
from deepspeed.comm.torch import build_shm_op
print("built" if build_shm_op() is not None else "not built (not compatible here)")
"""
OPS = {"cpu_adam": _CPU_ADAM, "deepspeed_shm": _DEEPSPEED_SHM}


def _has_deepspeed() -> bool:
    import importlib.util
    return importlib.util.find_spec("deepspeed") is not None


_LIBS = {"cpu_adam": ("dsfn_cpu_adam", "dsfn_cpu_adam.so"),
         "deepspeed_shm": ("deepspeed_shm_comm", "deepspeed_shm_comm.so")}


def is_built(name: str) -> bool:
    """Whether op `name`'s library is already in torch's extension cache (and, for dsfn's
    own, newer than its source): then a first use only loads it."""
    from torch.utils import cpp_extension
    folder, lib = _LIBS[name]
    path = os.path.join(cpp_extension._get_build_directory(folder, verbose=False), lib)
    if not os.path.exists(path):
        return False
    if name == "cpu_adam":
        from dsfn.ops import cpu_adam
        return os.path.getmtime(path) >= os.path.getmtime(cpu_adam.SOURCE)
    return True


def prebuild(names: list[str] | None = None, timeout: float = 900.0, missing_only: bool = False) -> list[str]:
    """Build the named ops (default: all that apply here; with `missing_only`, only those not
    in the cache yet); one line per op saying what happened and how long it took."""
    names = list(OPS) if names is None else names
    lines = []
    for name in names:
        if name == "deepspeed_shm" and not _has_deepspeed():
            continue
        if missing_only and is_built(name):
            continue
        start = time.perf_counter()
        env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
        try:
            proc = subprocess.run([sys.executable, "-c", OPS[name]], capture_output=True, text=True,
                                  timeout=timeout, env=env)
            out = (proc.stdout.strip().splitlines() or [""])[-1] if proc.returncode == 0 else \
                f"FAILED (exit {proc.returncode}): {(proc.stderr.strip().splitlines() or [''])[-1][:200]}"
        except subprocess.TimeoutExpired:
            out = f"FAILED: still building after {timeout:.0f} s"
        lines.append(f"prebuild {name}: {out} ({time.perf_counter() - start:.1f} s)")
    return lines


if __name__ == "__main__":
    for line in prebuild(sys.argv[1:] or None):
        print(line)
