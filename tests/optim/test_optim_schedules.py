"""DeepSpeed's lr schedules: values, edge steps, tails, and the count <-> last_batch_iteration mapping.

Expected values come from three independent sources, none of which calls dsfn's code:
1. `DSLike`: a small transcription of DeepSpeed's stateful protocol (constructor with
   last_batch_iteration = -1, then `engine.step()` = optimizer.step() followed by
   scheduler.step()), with DeepSpeed's published formulas written in closed form here.
   The lr in effect at the k-th optimizer step must equal `schedule(k - 1)`.
2. The assertions of DeepSpeed's own tests (tests/unit/runtime/test_lr_schedulers.py),
   translated with that mapping.
3. Hand-computed points, including the steps 0/1 of DeepSpeed PR #5287's repro.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsfn.optim as O
from dsfn.errors import ConfigError
from dsfn.optim import schedules as S

SETTINGS = settings(deadline=None, max_examples=25, derandomize=True)
REL = 1e-12


# ---------------------------------------------------------------------------------------
# 1. independent transcription of DeepSpeed's protocol and formulas (closed forms)


def warm(lbi: int, w: int, kind: str) -> float:
    w = max(2, w)
    return math.log(lbi + 1) / math.log(w) if kind == "log" else lbi / w


def warmup_lr(lbi, lo, hi, w, kind):
    if lbi < 0:
        return lo
    return lo + (hi - lo) * (warm(lbi, w, kind) if lbi < max(2, w) else 1.0)


def warmup_decay_lr(lbi, total, lo, hi, w, kind):
    if lbi < 0:
        return lo
    w2 = max(2, w)
    g = warm(lbi, w, kind) if lbi < w2 else max(0.0, (total - lbi) / max(1, total - w2))
    return lo + (hi - lo) * g


def warmup_cosine_lr(lbi, base, total, wmin, w, cmin, kind):
    if lbi < 0:
        return 0.0
    w2 = max(2, w)
    if lbi < w2:
        return base * (wmin + (1 - wmin) * warm(lbi, w, kind))
    progress = min(1.0, (lbi - w2 + 1) / max(1, total - w2))
    return base * max(0.0, cmin + (1 - cmin) * 0.5 * (1 + math.cos(math.pi * progress)))


def cycle_position(bi, first, second, first_stairs, second_stairs):
    """Scale in [0, 1]: rises over `first` batches, falls over `second`; stairs floor it."""
    total = first + second
    ci = bi % total
    if ci <= first:
        s, n = ci / first, first_stairs
    else:
        s, n = (total - ci) / second, second_stairs
    return math.floor(s * n + 1e-9) / n if n > 0 else s      # 1e-9: s * n may round just below a stair


def one_cycle_lr(lbi, lo, hi, rate, first, second, fs, ss, dss):
    total = first + second
    if lbi < total:
        return lo + (hi - lo) * cycle_position(lbi + 1, first, second, fs, ss)
    if dss == 0 or rate == 0:
        return lo
    return lo / (1 + rate * (lbi - total + 1) / dss)


def one_cycle_mom(lbi, lo, hi, rate, first, second, fs, ss, dss):
    total = first + second
    if lbi < total:
        return hi - (hi - lo) * cycle_position(lbi + 1, first, second, fs, ss)
    if dss == 0 or rate == 0:
        return hi
    return hi * (1 + rate * (lbi - total + 1) / dss)


class DSLike:
    """DeepSpeed's scheduler protocol: the constructor writes `initial` into the optimizer,
    each step() increments last_batch_iteration and writes get_lr(last_batch_iteration)."""

    def __init__(self, get, initial):
        self.get, self.lbi, self.value = get, -1, initial

    def step(self):
        self.lbi += 1
        self.value = self.get(self.lbi)


def used_by_updates(drv: DSLike, n: int) -> list[float]:
    """The value in effect at each of n engine steps (optimizer.step, then scheduler.step)."""
    out = []
    for _ in range(n):
        out.append(drv.value)       # optimizer.step() uses this
        drv.step()                  # then lr_scheduler.step()
    return out


def assert_values(schedule, expected: list[float]) -> None:
    got = [schedule(torch.tensor(c)) for c in range(len(expected))]
    for c, (g, e) in enumerate(zip(got, expected)):
        assert g == pytest.approx(e, rel=REL, abs=1e-15), f"count {c}: {g} != {e}"


warm_st = st.fixed_dictionaries({
    "w": st.sampled_from([1, 2, 3, 10, 33]) | st.integers(min_value=1, max_value=60),
    "kind": st.sampled_from(["log", "linear"]),
    "lo": st.sampled_from([0.0, 1e-5, 0.01]),
    "hi": st.sampled_from([1e-3, 0.1, 0.2]),
    "total": st.sampled_from([0, 5, 10, 20, 100]) | st.integers(min_value=0, max_value=120),
})


@SETTINGS
@given(a=warm_st)
def test_warmup_lr_equals_deepspeed_protocol(a):
    n = 2 * max(2, a["w"]) + 10
    drv = DSLike(lambda lbi: warmup_lr(lbi, a["lo"], a["hi"], a["w"], a["kind"]), a["lo"])
    assert_values(S.WarmupLR(a["lo"], a["hi"], a["w"], a["kind"]), used_by_updates(drv, n))


@SETTINGS
@given(a=warm_st)
def test_warmup_decay_lr_equals_deepspeed_protocol(a):
    n = max(a["total"], a["w"]) + 10
    drv = DSLike(lambda lbi: warmup_decay_lr(lbi, a["total"], a["lo"], a["hi"], a["w"], a["kind"]), a["lo"])
    assert_values(S.WarmupDecayLR(a["total"], a["lo"], a["hi"], a["w"], a["kind"]), used_by_updates(drv, n))


@SETTINGS
@given(a=warm_st, wmin=st.sampled_from([0.0, 0.2, 0.5]), cmin=st.sampled_from([0.0, 1e-4, 0.1]),
       base=st.sampled_from([1.0, 3e-4]))
def test_warmup_cosine_lr_equals_deepspeed_protocol(a, wmin, cmin, base):
    n = max(a["total"], a["w"]) + 10
    drv = DSLike(lambda lbi: warmup_cosine_lr(lbi, base, a["total"], wmin, a["w"], cmin, a["kind"]), 0.0)
    sched = S.WarmupCosineLR(base, a["total"], wmin, a["w"], cmin, a["kind"])
    assert_values(sched, used_by_updates(drv, n))


@SETTINGS
@given(lo=st.sampled_from([0.0, 1e-3]), hi=st.sampled_from([0.01, 0.1]), rate=st.sampled_from([0.0, 1e-3, 0.5]),
       first=st.integers(min_value=1, max_value=12), second=st.none() | st.integers(min_value=1, max_value=12),
       fs=st.sampled_from([0, 0, 2, 3]), ss=st.none() | st.sampled_from([0, 2, 5]),
       dss=st.sampled_from([0, 1, 5]), mlo=st.sampled_from([0.8, 0.85]), mrate=st.sampled_from([0.0, 0.01]))
def test_one_cycle_equals_deepspeed_protocol(lo, hi, rate, first, second, fs, ss, dss, mlo, mrate):
    sched = S.OneCycle(lo, hi, decay_lr_rate=rate, cycle_first_step_size=first, cycle_second_step_size=second,
                       cycle_first_stair_count=fs, cycle_second_stair_count=ss, decay_step_size=dss,
                       cycle_min_mom=mlo, cycle_max_mom=0.9, decay_mom_rate=mrate)
    second_ = first if second is None else second
    ss_ = fs if ss is None else ss
    n = 3 * (first + second_) + 5
    args = (rate, first, second_, fs, ss_, dss)
    assert_values(sched, used_by_updates(DSLike(lambda lbi: one_cycle_lr(lbi, lo, hi, *args), lo), n))
    moms = used_by_updates(DSLike(lambda lbi: one_cycle_mom(lbi, mlo, 0.9, mrate, *args[1:]), mlo), n)
    for c, m in enumerate(moms):
        assert sched.momentum(c) == pytest.approx(m, rel=REL), c


@SETTINGS
@given(lo=st.sampled_from([1e-4, 1e-3]), size=st.integers(min_value=1, max_value=20),
       rate=st.sampled_from([1e-3, 1.0, 2.5]), stair=st.booleans())
def test_lr_range_test_equals_deepspeed_protocol(lo, size, rate, stair):
    get = lambda lbi: lo * (1 + rate * ((lbi + 1) // size if stair else (lbi + 1) / size))  # noqa: E731
    assert_values(S.LRRangeTest(lo, size, rate, stair), used_by_updates(DSLike(get, lo), 3 * size + 3))


def test_the_lr_deepspeed_uses_at_each_optimizer_step_is_the_lr_dsfn_uses_at_that_count():
    """End to end: torch AdamW driven like DeepSpeed's engine vs dsfn adamw(lr=schedule)."""
    kw = dict(total_num_steps=12, warmup_min_ratio=0.0, warmup_num_steps=4, cos_min_ratio=0.1, warmup_type="linear")
    base = 0.05
    drv = DSLike(lambda lbi: warmup_cosine_lr(lbi, base, 12, 0.0, 4, 0.1, "linear"), 0.0)
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 2, generator=gen) + 2.0}
    ref = torch.nn.Parameter(params["w"].clone())
    opt = torch.optim.AdamW([ref], lr=base, foreach=False)
    opt.param_groups[0]["lr"] = drv.value            # the scheduler's constructor
    tx = O.adamw(S.WarmupCosineLR(base, **kw))
    state = tx.init(params)
    for k in range(16):
        g = torch.randn(3, 2, generator=gen)
        ref.grad = g.clone()
        used = opt.param_groups[0]["lr"]
        opt.step()                                   # engine.step(): optimizer first ...
        drv.step()                                   # ... then the scheduler writes its lr
        opt.param_groups[0]["lr"] = drv.value
        updates, state = tx.update({"w": g}, state, params)
        params = O.apply_updates(params, updates)
        assert float(O.current_lr(state)) == pytest.approx(used, rel=REL, abs=0), k
        torch.testing.assert_close(params["w"], ref.detach(), rtol=1e-6, atol=1e-7)
    assert int(state[1].count) == 16


# ---------------------------------------------------------------------------------------
# 2. DeepSpeed's own test assertions, translated (step_lrs read after k+1 steps = count k+1)


@pytest.mark.parametrize("w", [10, 15, 19, 33])
@pytest.mark.parametrize("kind", ["log", "linear"])
def test_deepspeed_warmup_and_warmup_decay_assertions(w, kind):
    lrs = [S.WarmupLR(0.1, 0.2, w, kind)(k + 1) for k in range(2 * w)]
    assert lrs[0] == 0.1 and lrs[w] == 0.2 and all(x == 0.2 for x in lrs[w:])
    d = [S.WarmupDecayLR(2 * w, 0.1, 0.2, w, kind)(k + 1) for k in range(2 * w)]
    assert d[0] == 0.1 and d[w] == 0.2
    assert all(a > b for a, b in zip(d[w:], d[w + 1:]))


@pytest.mark.parametrize("lo, hi, rate, cs, dss", [
    (1e-5, 1e-2, 1e-3, 10, 10), (1e-3, 1e-1, 0, 21, 21), (1e-3, 1e-1, 1e-1, 21, 21), (1e-5, 1e-1, 0, 10, 0)])
def test_deepspeed_one_cycle_assertions(lo, hi, rate, cs, dss):
    n = max(50, cs * 3) // 2
    s = S.OneCycle(lo, hi, decay_lr_rate=rate, cycle_first_step_size=cs, decay_step_size=dss)
    lrs = [s(k) for k in range(n)]               # DeepSpeed reads get_lr() before each step
    assert lrs[0] == lo and lrs[cs] == hi
    assert all(a < b for a, b in zip(lrs[:cs], lrs[1:cs]))
    assert all(a > b for a, b in zip(lrs[cs:2 * cs], lrs[cs + 1:2 * cs]))
    if rate > 0:
        assert all(a > b for a, b in zip(lrs[2 * cs:], lrs[2 * cs + 1:]))


@pytest.mark.parametrize("rate, size", [(1e-3, 10), (0.0, 21)])
def test_deepspeed_one_cycle_momentum_assertions(rate, size):
    s = S.OneCycle(1e-3, 1e-2, cycle_min_mom=0.08, cycle_max_mom=0.09, decay_mom_rate=rate,
                   cycle_first_step_size=size, decay_step_size=size)
    n = max(50, size * 3) // 2
    moms = [s.momentum(k) for k in range(n)]
    # DeepSpeed's test reads get_mom() (0.09 at k=0); the optimizer really holds the
    # constructor's cycle_min_mom for the first update, which is what momentum(0) reports
    assert moms[0] == 0.08 and moms[1] == pytest.approx(0.09 - 0.01 / size, rel=REL)
    assert moms[size] == 0.08
    assert all(a > b for a, b in zip(moms[1:size], moms[2:size]))
    assert all(a < b for a, b in zip(moms[size:2 * size], moms[size + 1:2 * size]))
    if rate > 0:
        assert all(a < b for a, b in zip(moms[2 * size:], moms[2 * size + 1:]))


@pytest.mark.parametrize("total, w, cmin, wmin", [
    (100, 10, 0.1, 0.2), (200, 20, 0.1, 0.2), (500, 30, 0.0, 0.2), (600, 300, 0.1, 0.0), (600, 550, 0.0, 0.0)])
def test_deepspeed_warmup_cosine_assertions(total, w, cmin, wmin):
    lr = 0.0015
    s = S.WarmupCosineLR(lr, total, warmup_min_ratio=wmin, warmup_num_steps=w, cos_min_ratio=cmin)
    lrs = [s(k + 1) for k in range(total)]
    assert abs(lrs[0] - lr * wmin) < 1e-7
    assert abs(lrs[w - 1] - lr) < 1e-7
    assert abs(lrs[total - 1] - lr * cmin) < 1e-7
    assert all(a < b for a, b in zip(lrs[:w], lrs[1:w]))
    assert all(a > b for a, b in zip(lrs[w:total], lrs[w + 1:total]))


def test_deepspeed_tensor_lr_contract_values_and_cosine_initial_values():
    # (value set by the constructor, value after scheduler.step(1)) = (count 0, count 2)
    cases = [
        (S.LRRangeTest(), 1e-3, 1e-3 * (1 + 2 / 2000)),
        (S.OneCycle(0.01, 0.1, cycle_first_step_size=10, cycle_second_step_size=10, cycle_momentum=False),
         0.01, 0.01 + (0.1 - 0.01) * 2 / 10),
        (S.WarmupLR(warmup_max_lr=0.1, warmup_num_steps=10), 0.0, 0.1 * math.log(2) / math.log(10)),
        (S.WarmupDecayLR(100, warmup_num_steps=10, warmup_max_lr=0.1), 0.0, 0.1 * math.log(2) / math.log(10)),
        (S.WarmupCosineLR(0.1, 100, warmup_num_steps=10), 0.0, 0.1 * math.log(2) / math.log(10)),
    ]
    for s, init, after_step_1 in cases:
        assert s(0) == pytest.approx(init, rel=REL, abs=0) and s(2) == pytest.approx(after_step_1, rel=REL), s
    c = S.WarmupCosineLR(0.01, total_num_steps=10, warmup_num_steps=10, cos_min_ratio=0.1)
    assert all(c.ratio(lbi + 1) == pytest.approx(0.1, rel=REL) for lbi in range(10, 15))
    assert S.OneCycle(0.1, 1.0, cycle_momentum=False).momentum(3) is None


def _one_cycle_lrs(first_stairs, steps=16, first=8, second=8, second_stairs=None):
    s = S.OneCycle(0.001, 0.01, cycle_first_step_size=first, cycle_second_step_size=second,
                   cycle_first_stair_count=first_stairs, cycle_second_stair_count=second_stairs)
    return [s(k + 1) for k in range(steps)]      # scheduler.step() then get_lr()


def test_deepspeed_one_cycle_stair_assertions():
    continuous = _one_cycle_lrs(0)
    assert len(set(continuous[:8])) == 8
    stairs = _one_cycle_lrs(2)
    assert stairs != continuous and len(set(stairs[:8])) < 8 and stairs[0] == stairs[1]
    assert _one_cycle_lrs(8) == continuous
    cont = _one_cycle_lrs(0, steps=31, first=10, second=21, second_stairs=0)
    aligned = _one_cycle_lrs(10, steps=31, first=10, second=21, second_stairs=21)
    assert aligned == pytest.approx(cont) and aligned[9] == pytest.approx(0.01)


# ---------------------------------------------------------------------------------------
# 3. hand-computed points, edge steps, tails


def test_warmup_lr_hand_values_and_steps_0_1():
    log = S.WarmupLR(0.0, 0.1, 10, "log")
    assert [log(c) for c in (0, 1)] == [0.0, 0.0]            # constructor value, then log(1) = 0
    assert log(2) == pytest.approx(0.030102999566398, rel=1e-12)   # 0.1 * log10(2)
    assert log(10) == pytest.approx(0.1, rel=1e-15) and log(11) == 0.1 and log(10**6) == 0.1
    lin = S.WarmupLR(0.0, 0.1, 10, "linear")
    assert [lin(c) for c in (0, 1, 2, 10, 11, 50)] == pytest.approx([0.0, 0.0, 0.01, 0.09, 0.1, 0.1], rel=1e-12)
    one = S.WarmupLR(0.0, 0.1, 1, "linear")                  # warmup_num_steps is raised to 2
    assert [one(c) for c in (0, 1, 2, 3)] == pytest.approx([0.0, 0.0, 0.05, 0.1], rel=1e-12)


def test_warmup_decay_lr_hand_values_and_tail():
    s = S.WarmupDecayLR(total_num_steps=20, warmup_min_lr=0.1, warmup_max_lr=0.2, warmup_num_steps=10,
                        warmup_type="linear")
    assert [s(c) for c in (0, 1, 11, 16, 21, 22, 1000)] == pytest.approx([0.1, 0.1, 0.2, 0.15, 0.1, 0.1, 0.1],
                                                                        rel=1e-12)


def test_warmup_cosine_lr_pr5287_steps_and_tail():
    # PR #5287's repro: lr=1.0, total 100, warmup 10, linear; DeepSpeed (unmerged PR) gives 0, 0, 0.1, ...
    s = S.WarmupCosineLR(1.0, total_num_steps=100, warmup_num_steps=10, warmup_type="linear")
    assert s(0) == 0.0 and s(1) == 0.0
    assert s(2) == pytest.approx(0.1, rel=1e-15) and s(10) == pytest.approx(0.9, rel=1e-15)
    first_cos = 1e-4 + (1 - 1e-4) * (1 + math.cos(math.pi / 90)) / 2
    assert s(11) == pytest.approx(first_cos, rel=1e-15)
    assert s(100) == pytest.approx(1e-4, rel=1e-12)
    assert all(s(c) == pytest.approx(1e-4, rel=1e-12) for c in (101, 150, 10**5))   # clamped, no oscillation
    w = S.WarmupCosineLR(2.0, 100, warmup_min_ratio=0.2, warmup_num_steps=10)
    assert w(0) == 0.0 and w(1) == pytest.approx(0.4, rel=1e-15)      # 0.0 first, whatever the min ratio


def test_one_cycle_hand_values():
    s = S.OneCycle(0.01, 0.1, cycle_first_step_size=10, cycle_second_step_size=10, decay_lr_rate=0.5,
                   decay_step_size=5, cycle_min_mom=0.8, cycle_max_mom=0.9)
    assert [s(c) for c in (0, 2, 10, 15, 20)] == pytest.approx([0.01, 0.028, 0.1, 0.055, 0.01], rel=1e-12)
    assert s(25) == pytest.approx(0.01 / 1.5, rel=1e-12) and s(30) == pytest.approx(0.01 / 2, rel=1e-12)
    assert [s.momentum(c) for c in (0, 1, 10, 20, 40)] == pytest.approx([0.8, 0.89, 0.8, 0.9, 0.9], rel=1e-12)


def test_lr_range_test_and_simple_schedules_hand_values():
    st_ = S.LRRangeTest(1e-3, 10, 1.0, lr_range_test_staircase=True)
    assert [st_(c) for c in (0, 9, 10, 25)] == pytest.approx([1e-3, 1e-3, 2e-3, 3e-3], rel=1e-12)
    assert S.LRRangeTest(1e-3, 10, 1.0)(5) == pytest.approx(1.5e-3, rel=1e-12)
    assert O.constant(0.3)(torch.tensor(7)) == 0.3
    lin = O.linear(1.0, 0.0, 4)
    assert [lin(c) for c in range(6)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]


def test_count_may_be_an_int_or_a_0_dim_int_tensor_only():
    s = S.WarmupLR(0.0, 0.1, 10)
    assert s(torch.tensor(5, dtype=torch.int64)) == s(5) == s(torch.tensor([5]))
    for bad in (-1, torch.tensor(-2), 1.5, torch.tensor(2.0), True, torch.tensor([1, 2])):
        with pytest.raises(ConfigError):
            s(bad)


# ---------------------------------------------------------------------------------------
# ds_config import


def test_from_config_follows_deepspeed_defaults_and_rejects_unknown_keys():
    s = S.from_config({"type": "WarmupLR", "params": {"warmup_num_steps": 10, "last_batch_iteration": -1}},
                      optimizer_lr=0.1)
    assert isinstance(s, S.WarmupLR) and s.warmup_max_lr == 0.1
    c = S.from_config({"type": "WarmupCosineLR", "params": {"total_num_steps": 100}}, optimizer_lr=3e-4)
    assert c.base_lr == 3e-4 and c(2000) == pytest.approx(3e-4 * 1e-4)   # warmup_num_steps defaults to 1000
    with pytest.raises(ConfigError, match="unknown params \\['warmup_steps'\\]"):
        S.from_config({"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_steps": 3}})
    with pytest.raises(ConfigError, match="not one of"):
        S.from_config({"type": "Cosine", "params": {}})
    with pytest.raises(ConfigError, match="warmup_num_steps"):
        S.from_config({"type": "WarmupLR", "params": {"warmup_num_steps": "auto", "warmup_max_lr": 0.1}})
    with pytest.raises(ConfigError, match="optimizer_lr"):
        S.from_config({"type": "WarmupLR", "params": {}})
