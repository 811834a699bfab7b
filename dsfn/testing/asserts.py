"""Assertions over pytrees of tensors: same structure, leaves close (or bitwise equal).

On failure the message names each mismatching leaf by its path ("params.layers.0.w"),
with shapes, the number of mismatching elements, and the largest absolute and relative
errors — what you need to tell a reduction-order wobble from a wrong gradient.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from dsfn import tree

__all__ = ["assert_trees_close", "assert_trees_equal"]

_MAX_REPORTED = 10


def _prefix(msg: str) -> str:
    return f"{msg}: " if msg else ""


def _check_structure(actual: Any, expected: Any, msg: str) -> tuple[list, list]:
    """Paired (path, leaf) lists; AssertionError naming the differing paths otherwise."""
    a_leaves = tree.leaves_with_path(actual)
    e_leaves = tree.leaves_with_path(expected)
    if tree.structure(actual) == tree.structure(expected):
        return a_leaves, e_leaves
    a_paths = [p for p, _ in a_leaves]
    e_paths = [p for p, _ in e_leaves]
    only_a = [p for p in a_paths if p not in set(e_paths)]
    only_e = [p for p in e_paths if p not in set(a_paths)]
    lines = [f"{_prefix(msg)}tree structures differ"]
    if only_a:
        lines.append(f"  only in actual:   {only_a[:_MAX_REPORTED]}")
    if only_e:
        lines.append(f"  only in expected: {only_e[:_MAX_REPORTED]}")
    if not only_a and not only_e:
        lines.append("  (same leaf paths; node types or None placement differ)")
    lines.append(f"  actual:   {tree.structure(actual)}")
    lines.append(f"  expected: {tree.structure(expected)}")
    raise AssertionError("\n".join(lines))


def _as_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if type(x).__module__ == "numpy":
        return torch.as_tensor(x)
    return None


def _fmt_index(flat_index: int, shape: torch.Size) -> str:
    if len(shape) == 0:
        return "()"
    idx = []
    for side in reversed(shape):
        idx.append(flat_index % side)
        flat_index //= side
    return str(tuple(reversed(idx)))


def _compare_tensors(path: str, a: torch.Tensor, e: torch.Tensor, rtol: float, atol: float,
                     check_dtype: bool) -> str | None:
    """None when close, else a one-leaf report."""
    if a.shape != e.shape:
        return f"{path}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    if check_dtype and a.dtype != e.dtype:
        return f"{path}: dtype {a.dtype} != expected {e.dtype}"
    if a.numel() == 0:
        return None
    wide = torch.complex128 if (a.is_complex() or e.is_complex()) else torch.float64
    a64, e64 = a.to(wide), e.to(wide)
    abs_err = (a64 - e64).abs()
    # NaN matches NaN and equal infinities match; anything else non-finite is an error.
    both_nan = torch.isnan(a64) & torch.isnan(e64)
    same_inf = torch.isinf(e64) & (a64 == e64)
    tol = atol + rtol * e64.abs()
    finite = torch.isfinite(a64) & torch.isfinite(e64)
    ok = (finite & (abs_err <= tol)) | both_nan | same_inf
    if bool(ok.all()):
        return None
    bad = ~ok
    n_bad = int(bad.sum())
    parts = [f"{path}: {n_bad}/{a.numel()} elements differ (shape {tuple(a.shape)}, {a.dtype})"]
    flat_a, flat_e = a64.reshape(-1), e64.reshape(-1)
    finite_bad = (bad & finite).reshape(-1)
    if bool(finite_bad.any()):
        err = torch.where(finite_bad, abs_err.reshape(-1), torch.zeros_like(abs_err.reshape(-1)))
        worst = int(err.argmax())
        rel = torch.where(finite_bad, err / flat_e.abs().clamp_min(torch.finfo(torch.float64).tiny),
                          torch.zeros_like(err))
        parts.append(f"max abs err {float(err[worst]):.3e} at {_fmt_index(worst, a.shape)} "
                     f"(actual {flat_a[worst].item():.8g}, expected {flat_e[worst].item():.8g}), "
                     f"max rel err {float(rel.max()):.3e}")
    nonfinite_bad = (bad & ~finite).reshape(-1)
    if bool(nonfinite_bad.any()):
        first = int(nonfinite_bad.to(torch.uint8).argmax())
        parts.append(f"{int(nonfinite_bad.sum())} with NaN/inf, first at {_fmt_index(first, a.shape)} "
                     f"(actual {flat_a[first].item():.8g}, expected {flat_e[first].item():.8g})")
    parts.append(f"rtol={rtol:g}, atol={atol:g}")
    return "; ".join(parts)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as integers (so -0.0 != 0.0 and equal NaNs compare equal)."""
    x = x.contiguous()
    if x.is_complex():
        x = torch.view_as_real(x).contiguous()
    if x.is_floating_point():
        int_dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        return x.view(int_dtype)
    return x


def _compare_bits(path: str, a: torch.Tensor, e: torch.Tensor) -> str | None:
    if a.shape != e.shape:
        return f"{path}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    if a.dtype != e.dtype:
        return f"{path}: dtype {a.dtype} != expected {e.dtype}"
    if torch.equal(_bits(a), _bits(e)):
        return None
    diff = _bits(a) != _bits(e)
    if a.is_complex():
        diff = diff.any(dim=-1)
    n_bad = int(diff.sum())
    detail = ""
    if a.is_floating_point() or a.is_complex():
        abs_err = (a.to(torch.complex128 if a.is_complex() else torch.float64)
                   - e.to(torch.complex128 if a.is_complex() else torch.float64)).abs()
        detail = f"; max abs err {float(torch.nan_to_num(abs_err, nan=math.inf).max()):.3e}"
    worst = int(diff.reshape(-1).to(torch.uint8).argmax())
    return (f"{path}: {n_bad}/{a.numel()} elements differ bitwise (shape {tuple(a.shape)}, "
            f"{a.dtype}){detail}; first at {_fmt_index(worst, a.shape)}: "
            f"actual {a.reshape(-1)[worst].item()!r}, expected {e.reshape(-1)[worst].item()!r}")


def _compare_scalars(path: str, a: Any, e: Any, rtol: float | None, atol: float | None) -> str | None:
    numbers = (int, float, complex)
    if rtol is not None and isinstance(a, numbers) and isinstance(e, numbers) \
            and not isinstance(a, bool) and not isinstance(e, bool):
        if (a != a and e != e) or a == e or abs(a - e) <= atol + rtol * abs(e):
            return None
        return f"{path}: {a!r} != expected {e!r} (abs err {abs(a - e):.3e}, rtol={rtol:g}, atol={atol:g})"
    if type(a) is not type(e) or a != e:
        return f"{path}: {a!r} ({type(a).__name__}) != expected {e!r} ({type(e).__name__})"
    return None


def _run(actual: Any, expected: Any, msg: str, rtol: float | None, atol: float | None,
         check_dtype: bool) -> None:
    a_leaves, e_leaves = _check_structure(actual, expected, msg)
    problems: list[str] = []
    for (path, a), (_, e) in zip(a_leaves, e_leaves):
        path = path or "<root>"
        at, et = _as_tensor(a), _as_tensor(e)
        if at is not None and et is not None:
            if rtol is None:
                problem = _compare_bits(path, at, et)
            else:
                problem = _compare_tensors(path, at, et, rtol, atol, check_dtype)
        elif at is not None or et is not None:
            problem = (f"{path}: {type(a).__name__} != expected {type(e).__name__} "
                       f"(one is a tensor, the other is not)")
        else:
            problem = _compare_scalars(path, a, e, rtol, atol)
        if problem:
            problems.append(problem)
    if problems:
        head = f"{_prefix(msg)}{len(problems)} of {len(a_leaves)} leaves differ"
        shown = problems[:_MAX_REPORTED]
        more = [f"  ... and {len(problems) - len(shown)} more"] if len(problems) > len(shown) else []
        raise AssertionError("\n".join([head] + [f"  {p}" for p in shown] + more))


def assert_trees_close(actual: Any, expected: Any, rtol: float = 1.3e-6, atol: float = 1e-5,
                       msg: str = "", check_dtype: bool = True) -> None:
    """Assert two pytrees have the same structure and leaves with |a - e| <= atol + rtol*|e|.

    Tensors must match in shape (and dtype unless `check_dtype=False`); NaN matches NaN.
    Non-tensor leaves (Python numbers, strings) compare with the same tolerance or `==`.
    Defaults are torch.testing's float32 tolerances; state the tolerance a test needs.
    """
    _run(actual, expected, msg, rtol, atol, check_dtype)


def assert_trees_equal(actual: Any, expected: Any, msg: str = "") -> None:
    """Assert two pytrees are identical: same structure, and every tensor leaf has the
    same shape, dtype and bits (so 0.0 vs -0.0 differs, the same NaN matches)."""
    _run(actual, expected, msg, None, None, True)
