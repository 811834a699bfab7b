"""Where the kernel tests run: `DSFN_TEST_DEVICE=cpu` (default) or `cuda`.

- cpu: Triton's CPU interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets unless
  the environment already has a value) runs the real kernels against torch references.
- cuda: the tests that take the `device` fixture (the Triton-vs-torch comparisons) run on
  "cuda" with compiled kernels; every other test here is interpreter- or host-specific
  (RSS peaks, 2**31 offsets through the interpreter, CPU dispatch rules) and is skipped.
  The interpreter must be off *before* anything imports Triton, so the caller exports
  TRITON_INTERPRET=0 with DSFN_TEST_DEVICE=cuda (tests/conftest.py only sets a default):

      DSFN_TEST_DEVICE=cuda TRITON_INTERPRET=0 python -m pytest tests/ops

  (benchmarks/gpu_checks.sh does this).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

DEVICES = ("cpu", "cuda")
HERE = Path(__file__).resolve().parent


def selected_device() -> str:
    return os.environ.get("DSFN_TEST_DEVICE", "cpu").strip().lower() or "cpu"


def pytest_configure(config):
    dev = selected_device()
    if dev not in DEVICES:
        raise pytest.UsageError(f"DSFN_TEST_DEVICE={dev!r}: use one of {list(DEVICES)}")
    if dev == "cuda":
        import torch

        from dsfn.ops import dispatch
        if not torch.cuda.is_available():
            raise pytest.UsageError("DSFN_TEST_DEVICE=cuda but torch sees no CUDA device")
        if dispatch.interpreting():
            raise pytest.UsageError("DSFN_TEST_DEVICE=cuda needs compiled kernels: export TRITON_INTERPRET=0 "
                                    "before running pytest (tests/conftest.py defaults it to 1)")


def pytest_collection_modifyitems(config, items):
    if selected_device() != "cuda":
        return
    skip = pytest.mark.skip(reason="CPU/interpreter-specific; DSFN_TEST_DEVICE=cuda runs the tests taking `device`")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents and "device" not in getattr(item, "fixturenames", ()):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> str:
    """The device the kernel comparisons run on (session scope: usable under hypothesis)."""
    return selected_device()


@pytest.fixture
def no_interpreter(monkeypatch):
    """A process that imported dsfn without TRITON_INTERPRET: compiled kernels, which cannot
    run on CPU tensors (the variable and the value dispatch recorded at import, together)."""
    from dsfn.ops import dispatch
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(dispatch, "_JIT_INTERPRET", False)


@pytest.fixture(scope="module")
def triton_forced():
    """DSFN_KERNELS=triton for a module: functions that dispatch (`adamw_update_multi`,
    `cast_tensors`) run the Triton kernels (the interpreter on CPU) instead of the references."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSFN_KERNELS", "triton")
        yield
