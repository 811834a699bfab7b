"""The torch optimizer step adapter of `from_torch`: one update of a torch optimizer over lists of leaves.

`TorchStep.run` builds fresh parameter tensors (copies), sets their `.grad`, builds the
optimizer, loads the per-parameter state (`StateSpec`: what the elementwise probe learnt
about it), calls `step()` and reads the new parameters and state back, checking that the
optimizer kept only per-parameter state of the probed kinds. Inputs are never written.
See `dsfn.optim.torch_optim`'s docstring.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from dsfn.errors import ConfigError

__all__ = ["SUGGEST", "StateSpec", "TorchStep", "number_tensor", "what"]

SUGGEST = ("use an elementwise optimizer, e.g. dsfn.optim.from_torch(torch.optim.AdamW, ...) or "
           "dsfn.optim.adamw(...)")


@dataclass(frozen=True)
class StateSpec:
    """What the probe learnt about the optimizer's per-parameter state."""
    tensor_keys: tuple[str, ...]                 # shaped like the parameter
    scalar_keys: tuple[str, ...]                 # 0-dim tensors
    number_keys: tuple[tuple[str, type], ...]    # Python numbers (stored as 0-dim tensors)
    none_keys: tuple[str, ...]                   # present with value None
    copy_grads: bool                             # the optimizer writes to p.grad: hand it copies
    lr_default: float | None                     # the class's default lr (None: no lr)

    @property
    def keys(self) -> frozenset:
        return frozenset(self.tensor_keys + self.scalar_keys + tuple(k for k, _ in self.number_keys)
                         + self.none_keys)


class TorchStep:
    """One update of the torch optimizer over lists of leaves (the core of the transform)."""

    def __init__(self, optimizer: Callable, hyper: dict, who: str):
        self.optimizer = optimizer
        self.hyper = hyper
        self.who = who
        self.spec: StateSpec | None = None

    def make(self, params: list[torch.Tensor], lr: float | None) -> torch.optim.Optimizer:
        kw = dict(self.hyper)
        if lr is not None:
            kw["lr"] = lr
        try:
            opt = self.optimizer(params, **kw)
        except Exception as e:
            raise ConfigError(f"{self.who}: building the optimizer with {sorted(kw)} failed: "
                              f"{type(e).__name__}: {e}") from e
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"{self.who}: it made a {type(opt).__name__}, not a torch.optim.Optimizer; pass "
                              "an optimizer class such as torch.optim.AdamW")
        return opt

    def run(self, p: list[torch.Tensor], g: list[torch.Tensor], tensors: dict[str, list[torch.Tensor]],
            scalars: dict[str, torch.Tensor], load: bool, lr: float | None,
            names: Callable[[], list[str]]) -> tuple[list, dict, dict]:
        """(new params, {key: new tensor state per leaf}, {key: new scalar}); inputs untouched."""
        with torch.no_grad():
            fresh = self._fresh(p, g)
            opt = self.make(fresh, lr)
            if load:
                self._load(opt, fresh, tensors, scalars)
            versions = [gi._version for gi in g]
            opt.step()
            if any(gi._version != v for gi, v in zip(g, versions)):
                raise RuntimeError(f"{self.who} wrote to the gradients it was given (the elementwise probe "
                                   "did not see it do so); please report this optimizer")
            ids = {id(x) for x in fresh}
            extra = [k for k in opt.state if id(k) not in ids]
            if extra:
                raise ConfigError(f"{self.who} keeps state under keys other than its parameters "
                                  f"({len(extra)} entries); from_torch can carry only per-parameter state")
            new_t, new_s = self._read_back(opt, fresh, g, names)
        return fresh, new_t, new_s

    def _fresh(self, p: list[torch.Tensor], g: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of the parameters, each with its gradient as `.grad` (a copy where needed)."""
        spec = self.spec
        fresh = [x.detach().clone() for x in p]
        for x, gi in zip(fresh, g):
            gi = gi.detach()
            if gi.dtype != x.dtype or gi.device != x.device:
                gi = gi.to(device=x.device, dtype=x.dtype)          # a new tensor
            elif spec.copy_grads:
                gi = gi.clone()
            x.grad = gi
        return fresh

    def _load(self, opt: torch.optim.Optimizer, fresh: list[torch.Tensor], tensors: dict[str, list[torch.Tensor]],
              scalars: dict[str, torch.Tensor]) -> None:
        """The per-parameter state, copied into `opt.state` (numbers as numbers, None keys as None)."""
        spec = self.spec
        numbers = dict(spec.number_keys)
        for i, x in enumerate(fresh):
            st: dict[str, Any] = {k: tensors[k][i].clone() for k in spec.tensor_keys}
            for k in spec.scalar_keys:
                st[k] = scalars[k].clone()      # one per parameter: torch steps them in place
            for k, kind in numbers.items():
                st[k] = kind(scalars[k].item())
            for k in spec.none_keys:
                st[k] = None
            opt.state[x] = st

    def _read_back(self, opt: torch.optim.Optimizer, fresh: list[torch.Tensor], g: list[torch.Tensor],
                   names: Callable[[], list[str]]) -> tuple[dict, dict]:
        """({key: new tensor state per leaf}, {key: new scalar}) from `opt.state` after the step,
        checked against the probed spec (ConfigError naming the parameter)."""
        spec = self.spec
        new_t: dict[str, list] = {k: [] for k in spec.tensor_keys}
        new_s: dict[str, torch.Tensor] = {}
        for i, x in enumerate(fresh):
            x.grad = None
            st = opt.state.get(x, {})
            if set(st) != spec.keys:
                raise ConfigError(f"{self.who}: parameter {names()[i]!r} has state keys {sorted(st)}, the "
                                  f"elementwise probe saw {sorted(spec.keys)}; from_torch needs the same "
                                  "state keys for every parameter at every step")
            for k in spec.tensor_keys:
                t = st[k]
                if not isinstance(t, torch.Tensor) or t.shape != x.shape:
                    raise ConfigError(f"{self.who}: state {k!r} of parameter {names()[i]!r} is "
                                      f"{what(t)}, not a tensor of the parameter's shape {tuple(x.shape)}: "
                                      f"the optimizer is not elementwise; {SUGGEST}")
                if t.untyped_storage().data_ptr() == g[i].untyped_storage().data_ptr():
                    t = t.clone()      # torch kept the gradient itself: the state must not alias an input
                new_t[k].append(t)
            for k in spec.scalar_keys + tuple(k for k, _ in spec.number_keys):
                v = st[k]
                t = v if isinstance(v, torch.Tensor) else number_tensor(v)
                if t.dim() != 0:
                    raise ConfigError(f"{self.who}: state {k!r} of parameter {names()[i]!r} is {what(v)}, "
                                      "the probe saw a scalar")
                if k not in new_s:
                    new_s[k] = t
                elif not torch.equal(new_s[k], t):
                    raise ConfigError(f"{self.who}: its scalar state {k!r} differs between parameters "
                                      f"({new_s[k].item()} for {names()[0]!r}, {t.item()} for "
                                      f"{names()[i]!r}); from_torch keeps one value per key for all "
                                      "parameters (as torch's step count), so it cannot run this optimizer")
        return new_t, new_s


def number_tensor(v: Any) -> torch.Tensor:
    """A Python number from torch's state as a 0-dim tensor that holds it exactly."""
    if isinstance(v, bool):
        return torch.tensor(v, dtype=torch.bool)
    if isinstance(v, int):
        return torch.tensor(v, dtype=torch.int64)
    if isinstance(v, float):
        return torch.tensor(v, dtype=torch.float64)
    raise ConfigError(f"from_torch: state value {v!r} is a {type(v).__name__}, not a number")


def what(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {tuple(v.shape)}"
    return f"a {type(v).__name__}"
