"""DeepSpeed's learning-rate schedules as pure functions of the update count.

Names, constructor arguments and values follow `deepspeed/runtime/lr_schedules.py`
(DeepSpeed 0.19.8): `WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `OneCycle`,
`LRRangeTest`; plus `constant` and `linear`. A schedule is a callable
`schedule(count) -> float`, `count` = the number of updates already applied (a 0-dim
int64 tensor, as `scale_by_learning_rate` passes it, or an int). Values are computed on
the host in float64 with the same float operations as DeepSpeed, so they are bitwise
DeepSpeed's (checked once against the 0.19.8 source driven like its engine; the tests
use an independent transcription instead, so they do not need deepspeed).

## count <-> DeepSpeed's `last_batch_iteration`

DeepSpeed builds the scheduler with `last_batch_iteration = -1`; the constructor writes
`get_lr()` into the optimizer. `engine.step()` then runs `optimizer.step()` and *after*
it `lr_scheduler.step()`, which does `last_batch_iteration += 1` and writes `get_lr()`
again (skipped on an fp16 overflow, when the update is skipped too). So the k-th applied
update (k = 1, 2, ...) uses the lr computed at `last_batch_iteration = k - 2`. Here the
update at `count = c` is the (c+1)-th, hence

    schedule(c) == DeepSpeed get_lr() at last_batch_iteration = c - 1,

with c = 0 meaning the value the constructor set. Equivalently, a DeepSpeed scheduler
whose `state_dict()` holds `last_batch_iteration = L` (after L + 1 updates) resumes
here at count = L + 1. An update skipped for overflow must not advance `count` (as it
does not step DeepSpeed's scheduler). Consequences, all DeepSpeed's:
- `WarmupLR` / `WarmupDecayLR`: c = 0 and c = 1 both give `warmup_min_lr` (the
  constructor's value, then gamma = log(1)/log(W) = 0, or 0/W for linear). The lr
  reaches `warmup_max_lr` at c = W + 1 (log: already at c = W), W = max(2, warmup_num_steps).
- `WarmupCosineLR`: c = 0 gives 0.0 (the constructor's value, whatever
  `warmup_min_ratio`), c = 1 gives `base_lr * warmup_min_ratio`. DeepSpeed PR #5287
  proposed changing these two steps and was closed unmerged, so this is still
  DeepSpeed's behaviour. The cosine reaches `cos_min_ratio` at c = total_num_steps
  and stays there (progress is clamped, as in DeepSpeed 0.19).
- `OneCycle`: c is DeepSpeed's `batch_iteration = last_batch_iteration + 1`: min lr at
  c = 0, peak at c = cycle_first_step_size, min again at c = total cycle size, then decay.

Deviations (by design): an unknown `warmup_type` raises ConfigError (DeepSpeed warns
and uses "log"); negative lrs/ratios/rates raise ConfigError; per-param-group lists are
not taken (use `dsfn.optim.partition` with one schedule per group); `WarmupLR` needs
`warmup_max_lr` (DeepSpeed defaults it to the optimizer's lr, which a schedule cannot
see; `from_config(..., optimizer_lr=...)` fills it in like DeepSpeed).
"""
from __future__ import annotations

import abc

import inspect
import math
from typing import Any, Mapping

import torch

from dsfn.checks import check_int, check_real
from dsfn.errors import ConfigError

__all__ = ["LRRangeTest", "OneCycle", "Schedule", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "constant",
           "from_config", "linear"]

WARMUP_TYPES = ("log", "linear")


def _count(count: Any) -> int:
    """The update count as an int (a 0-dim integer tensor or an int >= 0)."""
    if isinstance(count, torch.Tensor):
        if count.numel() != 1 or count.is_floating_point() or count.dtype == torch.bool:
            raise ConfigError(f"a schedule takes the 0-dim int64 update count, got a {count.dtype} tensor of "
                              f"shape {tuple(count.shape)}")
        c = int(count)
    elif isinstance(count, int) and not isinstance(count, bool):
        c = count
    else:
        raise ConfigError(f"a schedule takes the update count (int or 0-dim int64 tensor), got {count!r}")
    if c < 0:
        raise ConfigError(f"update count {c} < 0; counts start at 0")
    return c


def _lr(name: str, v: Any) -> float:
    return check_real(name, v, lo=0.0, hint="; learning rates are >= 0")


def _warmup_type(who: str, v: Any) -> str:
    if v not in WARMUP_TYPES:
        raise ConfigError(f"{who}(warmup_type={v!r}): use 'log' or 'linear' (DeepSpeed would silently use 'log')")
    return v


def _warmup_steps(who: str, v: Any) -> int:
    return check_int(f"{who}(warmup_num_steps)", v, lo=1, hint="; DeepSpeed requires a positive integer")


class Schedule(abc.ABC):
    """Base class: `schedule(count) -> float`; subclasses define `value(c: int)`."""

    def __call__(self, count: Any) -> float:
        return self.value(_count(count))

    @abc.abstractmethod
    def value(self, c: int) -> float:
        """The learning rate for the update made after `c` earlier updates."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._args().items())
        return f"{type(self).__name__}({args})"

    def _args(self) -> dict:
        return {}


class constant(Schedule):
    """`lr` at every count."""

    def __init__(self, lr: float):
        self.lr = _lr("constant(lr)", lr)

    def value(self, c: int) -> float:
        return self.lr

    def _args(self) -> dict:
        return {"lr": self.lr}


class linear(Schedule):
    """`init + (end - init) * min(c, steps) / steps`: `init` at c = 0, `end` from c = steps on."""

    def __init__(self, init: float, end: float, steps: int):
        self.init = _lr("linear(init)", init)
        self.end = _lr("linear(end)", end)
        self.steps = check_int("linear(steps)", steps, lo=1, hint="; the number of updates to go from init to end")

    def value(self, c: int) -> float:
        if c >= self.steps:
            return self.end
        return self.init + (self.end - self.init) * (c / self.steps)

    def _args(self) -> dict:
        return {"init": self.init, "end": self.end, "steps": self.steps}


class WarmupLR(Schedule):
    """From `warmup_min_lr` up to `warmup_max_lr` over `warmup_num_steps`, then constant.

    With lbi = c - 1 (see the module docstring), W = max(2, warmup_num_steps):
    gamma = log(lbi + 1) / log(W) ("log") or lbi / W ("linear") while lbi < W, else 1;
    lr = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma; c = 0 gives warmup_min_lr.
    """

    def __init__(self, warmup_min_lr: float = 0.0, warmup_max_lr: float | None = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log"):
        who = type(self).__name__
        if warmup_max_lr is None:
            raise ConfigError(f"{who} needs warmup_max_lr: DeepSpeed defaults it to the optimizer's lr, which a "
                              "schedule cannot see; pass warmup_max_lr=<your lr> (or use schedules.from_config with "
                              "optimizer_lr=...)")
        self.warmup_min_lr = _lr(f"{who}(warmup_min_lr)", warmup_min_lr)
        self.warmup_max_lr = _lr(f"{who}(warmup_max_lr)", warmup_max_lr)
        self.warmup_num_steps = _warmup_steps(who, warmup_num_steps)
        self.warmup_type = _warmup_type(who, warmup_type)
        # DeepSpeed's derived constants, computed with its expressions (bitwise values)
        self._delta = self.warmup_max_lr - self.warmup_min_lr
        self._w = max(2, self.warmup_num_steps)
        self._inv_log_w = 1.0 / math.log(self._w)

    def _warmup_gamma(self, lbi: int) -> float:
        if self.warmup_type == "log":
            return self._inv_log_w * math.log(lbi + 1)
        return lbi / self._w

    def _gamma(self, lbi: int) -> float:
        return self._warmup_gamma(lbi) if lbi < self._w else 1.0

    def value(self, c: int) -> float:
        if c == 0:
            return self.warmup_min_lr          # the constructor's value (get_lr at lbi < 0)
        return self.warmup_min_lr + (self._delta * self._gamma(c - 1))

    def _args(self) -> dict:
        return {"warmup_min_lr": self.warmup_min_lr, "warmup_max_lr": self.warmup_max_lr,
                "warmup_num_steps": self.warmup_num_steps, "warmup_type": self.warmup_type}


class WarmupDecayLR(WarmupLR):
    """`WarmupLR`, then linear decay to 0 at `total_num_steps`.

    After warmup (lbi >= W): gamma = max(0, (total_num_steps - lbi) / max(1, total_num_steps - W)).
    """

    def __init__(self, total_num_steps: int, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log"):
        self.total_num_steps = check_int("WarmupDecayLR(total_num_steps)", total_num_steps, lo=0)
        super().__init__(warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def _gamma(self, lbi: int) -> float:
        if lbi < self._w:
            return self._warmup_gamma(lbi)
        return max(0.0, float(self.total_num_steps - lbi) / float(max(1.0, self.total_num_steps - self._w)))

    def _args(self) -> dict:
        return {"total_num_steps": self.total_num_steps, **super()._args()}


class WarmupCosineLR(Schedule):
    """`base_lr * ratio`: ratio warms up from `warmup_min_ratio` to 1, then follows a cosine to `cos_min_ratio`.

    `base_lr` is the optimizer lr DeepSpeed scales (its `org_lrs`). With lbi = c - 1:
    lbi < W: ratio = warmup_min_ratio + (1 - warmup_min_ratio) * gamma (gamma as WarmupLR);
    else ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2),
    p = min(1, (lbi - W + 1) / max(1, total_num_steps - W)). c = 0 gives 0.0.
    """

    def __init__(self, base_lr: float, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log"):
        who = "WarmupCosineLR"
        self.base_lr = _lr(f"{who}(base_lr)", base_lr)
        self.total_num_steps = check_int(f"{who}(total_num_steps)", total_num_steps, lo=0)
        self.warmup_min_ratio = check_real(f"{who}(warmup_min_ratio)", warmup_min_ratio, lo=0.0)
        self.warmup_num_steps = _warmup_steps(who, warmup_num_steps)
        self.cos_min_ratio = check_real(f"{who}(cos_min_ratio)", cos_min_ratio, lo=0.0)
        self.warmup_type = _warmup_type(who, warmup_type)
        self._w = max(2, self.warmup_num_steps)
        self._inv_log_w = 1.0 / math.log(self._w)

    def ratio(self, count: Any) -> float:
        """The lr ratio at `count` (0.0 at count 0)."""
        c = _count(count)
        if c == 0:
            return 0.0
        lbi = c - 1
        if lbi < self._w:
            r = self._inv_log_w * math.log(lbi + 1) if self.warmup_type == "log" else lbi / self._w
            return self.warmup_min_ratio + r * (1. - self.warmup_min_ratio)
        progress = min(1.0, (lbi - self._w + 1) / max(1, self.total_num_steps - self._w))
        r = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1. - self.cos_min_ratio) * r)

    def value(self, c: int) -> float:
        if c == 0:
            return 0.0                         # DeepSpeed's constructor sets 0.0, not base_lr * ratio
        return self.base_lr * self.ratio(c)

    def _args(self) -> dict:
        return {"base_lr": self.base_lr, "total_num_steps": self.total_num_steps,
                "warmup_min_ratio": self.warmup_min_ratio, "warmup_num_steps": self.warmup_num_steps,
                "cos_min_ratio": self.cos_min_ratio, "warmup_type": self.warmup_type}


class OneCycle(Schedule):
    """1-cycle: lr rises from `cycle_min_lr` to `cycle_max_lr` over `cycle_first_step_size`
    updates, falls back over `cycle_second_step_size`, then decays as
    `cycle_min_lr / (1 + decay_lr_rate * (c - total) / decay_step_size)` (flat at
    `cycle_min_lr` if `decay_step_size` or `decay_lr_rate` is 0). Stair counts > 0 hold the
    lr flat in that many stairs per half cycle.

    `momentum(count)` is DeepSpeed's cycled first beta (None without `cycle_momentum`): it
    falls from `cycle_max_mom` to `cycle_min_mom` while the lr rises. DeepSpeed writes it
    (with beta2 = 0.99) into optimizers that have `betas`; dsfn's Adam takes constant betas,
    so this is exposed for custom transforms and logging. At count 0 it is `cycle_min_mom`
    (DeepSpeed's constructor sets that, unlike its own formula's `cycle_max_mom`).
    """

    def __init__(self, cycle_min_lr: float, cycle_max_lr: float, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0):
        who = "OneCycle"
        self.cycle_min_lr = _lr(f"{who}(cycle_min_lr)", cycle_min_lr)
        self.cycle_max_lr = _lr(f"{who}(cycle_max_lr)", cycle_max_lr)
        self.decay_lr_rate = check_real(f"{who}(decay_lr_rate)", decay_lr_rate, lo=0.0)
        first = check_real(f"{who}(cycle_first_step_size)", cycle_first_step_size, lo=0.0, lo_open=True)
        second = first if cycle_second_step_size is None else check_real(
            f"{who}(cycle_second_step_size)", cycle_second_step_size, lo=0.0)
        self.cycle_first_step_size, self.cycle_second_step_size = first, second
        self.cycle_first_stair_count = check_int(f"{who}(cycle_first_stair_count)", cycle_first_stair_count)
        self.cycle_second_stair_count = self.cycle_first_stair_count if cycle_second_stair_count is None else \
            check_int(f"{who}(cycle_second_stair_count)", cycle_second_stair_count)
        self.decay_step_size = check_real(f"{who}(decay_step_size)", decay_step_size, lo=0.0)
        self.cycle_momentum = bool(cycle_momentum)
        self.cycle_min_mom = check_real(f"{who}(cycle_min_mom)", cycle_min_mom, lo=0.0, hi=1.0)
        self.cycle_max_mom = check_real(f"{who}(cycle_max_mom)", cycle_max_mom, lo=0.0, hi=1.0)
        self.decay_mom_rate = check_real(f"{who}(decay_mom_rate)", decay_mom_rate, lo=0.0)
        # DeepSpeed's derived constants (floats, as in its _initialize_cycle)
        self._total = first + second
        self._step_ratio = first / self._total
        no_decay_window = math.isclose(self.decay_step_size, 0)
        self._skip_lr_decay = no_decay_window or math.isclose(self.decay_lr_rate, 0)
        self._skip_mom_decay = no_decay_window or math.isclose(self.decay_mom_rate, 0)

    def _scale(self, bi: int) -> float:
        """DeepSpeed's `_get_scale_factor` at batch_iteration = bi (= count)."""
        cycle = math.floor(1 + bi / self._total)
        x = 1. + bi / self._total - cycle
        if x <= self._step_ratio:
            scale, stairs = x / self._step_ratio, self.cycle_first_stair_count
        else:
            scale, stairs = (x - 1) / (self._step_ratio - 1), self.cycle_second_stair_count
        if stairs > 0:
            # stairs are placed from the integer position in the cycle, as DeepSpeed does
            ci = bi % self._total
            if ci <= self.cycle_first_step_size:
                pos = ci * stairs / self.cycle_first_step_size
            else:
                pos = (self._total - ci) * stairs / self.cycle_second_step_size
            scale = math.floor(pos) / stairs
        return scale

    def value(self, c: int) -> float:
        lbi = c - 1
        if lbi < self._total:
            return self.cycle_min_lr + (self.cycle_max_lr - self.cycle_min_lr) * self._scale(c)
        if self._skip_lr_decay:
            return self.cycle_min_lr
        factor = 1 + self.decay_lr_rate * ((lbi - self._total + 1) / self.decay_step_size)
        return self.cycle_min_lr / factor

    def momentum(self, count: Any) -> float | None:
        """The first beta DeepSpeed uses for the update at `count`, or None without cycle_momentum."""
        c = _count(count)
        if not self.cycle_momentum:
            return None
        if c == 0:
            return self.cycle_min_mom
        lbi = c - 1
        if lbi < self._total:
            return self.cycle_max_mom - (self.cycle_max_mom - self.cycle_min_mom) * self._scale(c)
        if self._skip_mom_decay:
            return self.cycle_max_mom
        return self.cycle_max_mom * (1 + self.decay_mom_rate * ((lbi - self._total + 1) / self.decay_step_size))

    def _args(self) -> dict:
        return {k: getattr(self, k) for k in (
            "cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
            "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum",
            "cycle_min_mom", "cycle_max_mom", "decay_mom_rate")}


class LRRangeTest(Schedule):
    """`lr_range_test_min_lr * (1 + lr_range_test_step_rate * i)`, i = c / step_size
    (floored with `lr_range_test_staircase`)."""

    def __init__(self, lr_range_test_min_lr: float = 1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False):
        who = "LRRangeTest"
        self.lr_range_test_min_lr = _lr(f"{who}(lr_range_test_min_lr)", lr_range_test_min_lr)
        self.lr_range_test_step_size = check_int(f"{who}(lr_range_test_step_size)", lr_range_test_step_size, lo=1)
        self.lr_range_test_step_rate = check_real(f"{who}(lr_range_test_step_rate)", lr_range_test_step_rate,
                                                  lo=0.0)
        self.lr_range_test_staircase = bool(lr_range_test_staircase)

    def value(self, c: int) -> float:
        # DeepSpeed's interval uses last_batch_iteration + 1 == c
        i = float(c) / self.lr_range_test_step_size
        if self.lr_range_test_staircase:
            i = math.floor(i)
        return self.lr_range_test_min_lr * (1 + self.lr_range_test_step_rate * i)

    def _args(self) -> dict:
        return {k: getattr(self, k) for k in ("lr_range_test_min_lr", "lr_range_test_step_size",
                                              "lr_range_test_step_rate", "lr_range_test_staircase")}


_BY_NAME = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
            "OneCycle": OneCycle, "LRRangeTest": LRRangeTest}


def from_config(scheduler: Mapping[str, Any], optimizer_lr: float | None = None) -> Schedule:
    """A schedule from a ds_config `"scheduler"` entry: `{"type": "WarmupLR", "params": {...}}`.

    `optimizer_lr` (the ds_config optimizer's lr) is what DeepSpeed uses for WarmupLR's
    missing `warmup_max_lr` and as WarmupCosineLR's base lr.
    """
    if not isinstance(scheduler, Mapping) or "type" not in scheduler:
        raise ConfigError(f"scheduler config {scheduler!r}: expected {{'type': <name>, 'params': {{...}}}}")
    kind = scheduler["type"]
    if kind not in _BY_NAME:
        raise ConfigError(f"scheduler type {kind!r} is not one of {sorted(_BY_NAME)}")
    params = dict(scheduler.get("params") or {})
    params.pop("last_batch_iteration", None)   # resuming is the state's count, not a schedule argument
    cls = _BY_NAME[kind]
    allowed = set(inspect.signature(cls.__init__).parameters) - {"self", "base_lr"}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ConfigError(f"scheduler {kind}: unknown params {unknown}; allowed: {sorted(allowed)}")
    if kind == "WarmupLR" and params.get("warmup_max_lr") is None:
        if optimizer_lr is None:
            raise ConfigError("WarmupLR without warmup_max_lr uses the optimizer's lr: pass optimizer_lr=")
        params["warmup_max_lr"] = optimizer_lr
    if kind == "WarmupCosineLR":
        if optimizer_lr is None:
            raise ConfigError("WarmupCosineLR scales the optimizer's lr: pass optimizer_lr=")
        params["base_lr"] = optimizer_lr
    return cls(**params)
