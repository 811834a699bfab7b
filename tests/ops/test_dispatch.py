"""`dsfn.ops.dispatch`: no Triton kernel is selected where it cannot run, and kernels launch
on their tensors' device.

This machine has no GPU, so CUDA tensors are stood in for by a tensor subclass whose
`.device` says "cuda:<i>", and the device's compute capability by a monkeypatched
`torch.cuda.get_device_capability`; dispatch only looks at those (nothing is launched on
them). Checked: capability < 7.0 and bf16 operands (or a bf16 output) below 8.0 fall back
to the torch reference with one warning per reason in "auto" mode and raise ConfigError in
"triton" mode; tensors on two GPUs are refused; a TRITON_INTERPRET changed after import is
a ConfigError; `device_guard` makes the tensors' GPU current, and every kernel launch of
the three ops happens inside it, on the tensors' device.
"""
from __future__ import annotations

import contextlib
import re
import warnings

import pytest
import torch

from dsfn.errors import ConfigError
from dsfn.ops import adamw as A
from dsfn.ops import cross_entropy as ce
from dsfn.ops import dispatch
from dsfn.ops import rmsnorm as R


def fake_cuda(t: torch.Tensor, index: int = 0) -> torch.Tensor:
    """`t` (a CPU tensor) reporting itself as on cuda:<index>."""
    cls = type(f"OnCuda{index}", (torch.Tensor,), {"device": property(lambda self: torch.device("cuda", index))})
    return torch.Tensor._make_subclass(cls, t)


@pytest.fixture
def gpu(monkeypatch):
    """A fake GPU of settable compute capability ({"cap": (major, minor)}); triton importable."""
    state = {"cap": (9, 0)}
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: state["cap"])
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setattr(dispatch, "_JIT_INTERPRET", False)       # a GPU process: compiled kernels
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert dispatch.triton_available()
    return state


def _auto(*tensors, **kw):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")                          # dispatch's own once-only is what is tested
        picked = dispatch.use_triton(*tensors, **kw)
    return picked, [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]


def test_capable_gpu_selects_triton(monkeypatch, gpu):
    monkeypatch.setenv("DSFN_KERNELS", "auto")
    x = fake_cuda(torch.zeros(4))
    xb = fake_cuda(torch.zeros(4, dtype=torch.bfloat16))
    assert _auto(x, xb) == (True, [])
    assert dispatch.triton_problem(x, xb) is None and dispatch.device_supports_bf16(torch.device("cuda", 0))


@pytest.mark.parametrize("cap, bf16, match", [
    ((6, 1), False, r"cuda:0 has compute capability 6\.1; Triton needs >= 7\.0"),
    ((7, 5), True, r"cuda:0 \(compute capability 7\.5\) has no bf16 arithmetic \(needs >= 8\.0\)"),
])
def test_incapable_gpu_falls_back_once_in_auto_and_raises_in_triton_mode(monkeypatch, gpu, cap, bf16, match):
    gpu["cap"] = cap
    x = fake_cuda(torch.zeros(4, dtype=torch.bfloat16 if bf16 else torch.float32))
    monkeypatch.setenv("DSFN_KERNELS", "auto")
    picked, warned = _auto(x)
    assert not picked and len(warned) == 1
    assert "torch reference instead of the Triton kernel" in warned[0]
    assert re.search(match, warned[0]), warned[0]
    assert _auto(x) == (False, [])                               # once per reason
    monkeypatch.setenv("DSFN_KERNELS", "triton")
    with pytest.raises(ConfigError, match=r"DSFN_KERNELS=triton but Triton kernels cannot run on \['cuda'\]: " + match):
        dispatch.use_triton(x)


def test_bf16_output_counts_on_a_pre_ampere_gpu(monkeypatch, gpu):
    """fp32 operands run on sm_75; a bf16 copy-out (adamw's lowp_dtype) does not."""
    gpu["cap"] = (7, 5)
    monkeypatch.setenv("DSFN_KERNELS", "auto")
    x = fake_cuda(torch.zeros(4))
    assert _auto(x) == (True, [])
    picked, warned = _auto(x, dtypes=(torch.bfloat16,))
    assert not picked and "no bf16 arithmetic" in warned[0]
    assert not dispatch.device_supports_bf16(torch.device("cuda", 0))


def test_tensors_on_two_gpus_are_refused(monkeypatch, gpu):
    monkeypatch.setenv("DSFN_KERNELS", "triton")
    with pytest.raises(ConfigError, match=r"tensors on several CUDA devices \['cuda:0', 'cuda:1'\]"):
        dispatch.use_triton(fake_cuda(torch.zeros(2), 0), fake_cuda(torch.zeros(2), 1))


def test_interpreter_changed_after_import_is_a_config_error(monkeypatch):
    """triton.jit read TRITON_INTERPRET when dsfn's kernels were decorated; flipping it later
    changes nothing about them, so selecting a kernel then must say so."""
    was = dispatch.interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "0" if was else "1")
    msg = r"TRITON_INTERPRET changed after dsfn's Triton kernels were created.*before importing dsfn"
    with pytest.raises(ConfigError, match=msg):
        dispatch.check_interpreter()
    x = torch.randn(3, 4)
    with pytest.raises(ConfigError, match=msg):
        R.rms_norm_triton(x, torch.ones(4))
    monkeypatch.setenv("DSFN_KERNELS", "triton")
    with pytest.raises(ConfigError, match=msg):
        dispatch.use_triton(x)
    monkeypatch.setenv("DSFN_KERNELS", "auto")               # CPU tensors in auto: no kernel considered
    assert dispatch.use_triton(x) is False
    monkeypatch.setenv("TRITON_INTERPRET", "1" if was else "0")
    dispatch.check_interpreter()                               # back as at import: fine


def test_device_guard_makes_the_tensors_gpu_current(monkeypatch):
    made = []

    def device(d):
        made.append(torch.device(d))
        return contextlib.nullcontext()
    monkeypatch.setattr(torch.cuda, "device", device)
    with dispatch.device_guard(torch.zeros(1), fake_cuda(torch.zeros(1), 1)):
        pass
    with dispatch.device_guard(torch.device("cuda", 2)):
        pass
    with dispatch.device_guard(torch.zeros(1)):               # CPU (the interpreter): nothing to switch
        pass
    assert made == [torch.device("cuda", 1), torch.device("cuda", 2)]


def test_every_kernel_launch_is_inside_the_device_guard(monkeypatch):
    """AdamW, RMSNorm (forward, backward) and cross-entropy (forward, backward tiles) launch
    their kernels inside `device_guard` of their own tensors' device."""
    guarded, launches = [], []

    @contextlib.contextmanager
    def guard(*tensors):
        guarded.append({t.device for t in tensors})
        guarded.append("in")
        yield
        guarded.append("out")

    class Spy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*args, **kwargs):
                assert guarded and guarded[-1] == "in", f"{self.name} launched outside device_guard"
                launches.append((self.name, guarded[-2]))
                return launch(*args, **kwargs)
            return run
    monkeypatch.setattr(dispatch, "device_guard", guard)
    for mod, name in ((A, "_adamw_kernel"), (R, "_rms_fwd_kernel"), (R, "_rms_bwd_kernel"),
                      (ce, "_ce_fwd_tile_kernel"), (ce, "_ce_bwd_tile_kernel")):
        monkeypatch.setattr(mod, name, Spy(name, getattr(mod, name)))
    p = torch.randn(40)
    A.adamw_update_triton(p, torch.randn(40), torch.zeros(40), torch.zeros(40), lr=1e-3, step=1, block=64)
    x = torch.randn(3, 8, requires_grad=True)
    R.rms_norm_triton(x, torch.ones(8)).sum().backward()
    h, w = torch.randn(4, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    ce.linear_cross_entropy_triton(h, w, torch.tensor([1, 2, 3, 9]), vocab_tile=4).backward()
    names = [n for n, _ in launches]
    assert names.count("_adamw_kernel") == 1 and names.count("_rms_fwd_kernel") == 1
    assert names.count("_rms_bwd_kernel") == 1
    assert names.count("_ce_fwd_tile_kernel") == 3 and names.count("_ce_bwd_tile_kernel") == 3   # 10 / 4: 3 tiles
    assert all(devs == {torch.device("cpu")} for _, devs in launches)
