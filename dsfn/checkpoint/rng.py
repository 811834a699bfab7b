"""The process-global random number generators of one rank, as tensors (checkpointed per rank).

A dsfn state carries its own seed (`TrainState.rng`), but code inside and around the step
also draws from the global generators: `nn.Dropout` and SDPA dropout use torch's default
(CPU or current CUDA device) generator, a data pipeline may use `random` or numpy. An
exact resume needs all of them, on every rank, as they were at the step boundary.

`capture()` snapshots them as a dict of tensors (no pickle: Python's and numpy's
Mersenne Twister states become integer tensors); `restore(snapshot)` puts them back.
Keys: "torch_cpu" (uint8), "torch_cuda" (uint8, the current device, when CUDA is
initialised), "python" (int64: version, 624 words, position) and "python_gauss", "numpy" (int64: 624 words,
position, has_gauss) and "numpy_gauss" (float64), when numpy is importable.
"""
from __future__ import annotations

import random

import torch

PREFIX = "__rng__/"


def capture() -> dict[str, torch.Tensor]:
    """This process's generator states, as tensors (copies)."""
    out = {"torch_cpu": torch.get_rng_state().clone()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = torch.cuda.get_rng_state().clone()
    version, words, gauss = random.getstate()     # (3, 625 words incl. position, gauss_next)
    out["python"] = torch.tensor([version, *words], dtype=torch.int64)
    if gauss is not None:
        out["python_gauss"] = torch.tensor([gauss], dtype=torch.float64)
    try:
        import numpy as np
    except ImportError:     # pragma: no cover - numpy ships with torch's CPU wheels' users
        return out
    name, keys, pos, has_gauss, cached = np.random.get_state()
    if name == "MT19937":
        out["numpy"] = torch.tensor([*keys.tolist(), pos, has_gauss], dtype=torch.int64)
        out["numpy_gauss"] = torch.tensor([cached], dtype=torch.float64)
    return out


def restore(snapshot: dict[str, torch.Tensor]) -> None:
    """Set this process's generators from a `capture()` snapshot (keys it lacks are left)."""
    if "torch_cpu" in snapshot:
        torch.set_rng_state(snapshot["torch_cpu"].to(torch.uint8))
    if "torch_cuda" in snapshot and torch.cuda.is_available():
        torch.cuda.set_rng_state(snapshot["torch_cuda"].to(torch.uint8))
    if "python" in snapshot:
        v = snapshot["python"].tolist()
        gauss = float(snapshot["python_gauss"][0]) if "python_gauss" in snapshot else None
        random.setstate((int(v[0]), tuple(int(x) for x in v[1:]), gauss))
    if "numpy" in snapshot:
        import numpy as np
        v = snapshot["numpy"].tolist()
        cached = float(snapshot["numpy_gauss"][0]) if "numpy_gauss" in snapshot else 0.0
        np.random.set_state(("MT19937", np.array(v[:624], dtype=np.uint32), int(v[624]), int(v[625]), cached))
