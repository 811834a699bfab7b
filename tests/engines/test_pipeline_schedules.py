"""dsfn.engines.pipeline.schedules: generated schedules are valid, the simulator's bubble and
activation peaks match the closed forms, bad sizes are named errors, broken schedules fail
the checker (negative controls), and the timeline PNG decodes.

Tolerances: bubble fractions are compared with abs 1e-9 (the simulator sums exact multiples
of t_f/v and t_b/v; the closed forms hold exactly, not approximately).
"""
from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsfn.engines.pipeline.schedules import (Action, Kind, Schedule, build_schedule,
                                             bubble_closed_form, check_schedule, gpipe,
                                             interleaved_1f1b, one_f_one_b, render_timeline,
                                             simulate, zbv)
from dsfn.errors import ConfigError

SETTINGS = settings(deadline=None, max_examples=40, derandomize=True)
TOL = 1e-9
P = st.integers(1, 8)
V = st.integers(2, 4)
COST = st.sampled_from([(1.0, 2.0), (1.0, 1.0), (1.0, 3.0), (2.0, 1.0), (0.7, 1.9)])


@st.composite
def sized(draw, name: str):
    """(p, m, v) a schedule accepts: 1f1b m >= p, interleaved m a multiple of p, else m >= 1."""
    p, v = draw(P), draw(V)
    if name == "1f1b":
        m = p + draw(st.integers(0, 16))
    elif name == "interleaved":
        m = p * draw(st.integers(1, 4))
    else:
        m = draw(st.integers(1, 24))
    return p, m, v


def _independent_timing_check(res) -> None:
    """Re-derive from the timelines alone: no two actions overlap on a rank, and every action
    starts after its dependencies end (written apart from the module's own tables)."""
    end = {}
    for tl in res.timelines:
        for sl in tl:
            end[(sl.action.kind, sl.action.stage, sl.action.mb)] = sl.end
    last = res.p * res.v - 1

    def grad_end(s, j):
        return end.get((Kind.BW, s, j), end.get((Kind.B, s, j)))
    for tl in res.timelines:
        for a, b in zip(tl, tl[1:]):
            assert b.start >= a.end - TOL, (a, b)
        for sl in tl:
            a = sl.action
            deps = []
            if a.kind is Kind.F and a.stage > 0:
                deps.append(end[(Kind.F, a.stage - 1, a.mb)])
            if a.kind in (Kind.B, Kind.BW):
                deps.append(end[(Kind.F, a.stage, a.mb)])
                if a.stage < last:
                    deps.append(grad_end(a.stage + 1, a.mb))
            if a.kind is Kind.W:
                deps.append(end[(Kind.B, a.stage, a.mb)])
            assert all(sl.start >= d - TOL for d in deps), sl


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zbv"])
@SETTINGS
@given(data=st.data())
def test_every_generated_schedule_passes_check_and_times_consistently(name, data):
    p, m, v = data.draw(sized(name))
    s = build_schedule(name, p, m, v)
    check_schedule(s)
    check_schedule(list(map(list, s.ranks)), s.p, s.m, s.v)        # plain lists work too
    assert s == build_schedule(name, p, m, v)                       # deterministic
    assert s.v == {"gpipe": 1, "1f1b": 1, "interleaved": v, "zbv": 2}[name]
    res = simulate(s)
    _independent_timing_check(res)
    assert 0.0 <= res.bubble_fraction < 1.0
    assert all(b <= res.makespan + TOL for b in res.busy)


@SETTINGS
@given(data=st.data(), cost=COST)
def test_1f1b_and_gpipe_bubble_equal_closed_form(data, cost):
    """(p-1)/(m+p-1) exactly, for any t_f, t_b (idle / total rank-time)."""
    p, m, _ = data.draw(sized("1f1b"))
    for s in (one_f_one_b(p, m), gpipe(p, m)):
        res = simulate(s, *cost)
        assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=TOL)
        assert res.makespan == pytest.approx((m + p - 1) * sum(cost), abs=TOL)


@SETTINGS
@given(data=st.data(), cost=COST)
def test_interleaved_bubble_equals_megatron_closed_form(data, cost):
    p, m, v = data.draw(sized("interleaved"))
    res = simulate(interleaved_1f1b(p, m, v), *cost)
    assert res.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=TOL)
    assert bubble_closed_form("interleaved", p, m, v) == pytest.approx(res.bubble_fraction, abs=TOL)


@SETTINGS
@given(p=st.integers(2, 8), k=st.integers(1, 4), extra=st.integers(0, 7), v=V)
def test_interleaved_and_zbv_bubbles_below_1f1b(p, k, extra, v):
    """Conditions: p >= 2 (at p = 1 every schedule has no bubble), 1F1B's m >= p; interleaved
    at any v >= 2 with m a multiple of p; ZBV at any m >= p (t_b = 2 t_f, t_w = t_b / 2)."""
    m = p * k
    f1b = simulate(one_f_one_b(p, m)).bubble_fraction
    assert simulate(interleaved_1f1b(p, m, v)).bubble_fraction < f1b - 1e-6
    assert simulate(zbv(p, m)).bubble_fraction < f1b - 1e-6
    m2 = p + extra
    assert simulate(zbv(p, m2)).bubble_fraction < simulate(one_f_one_b(p, m2)).bubble_fraction - 1e-6


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zbv"])
def test_single_rank_has_no_bubble(name):
    assert simulate(build_schedule(name, 1, 5, 3)).bubble_fraction == pytest.approx(0.0, abs=TOL)


@SETTINGS
@given(data=st.data())
def test_peak_activations(data):
    """1F1B: rank r holds at most p - r micro-batches (stage 0: p, never more than p);
    GPipe: m on every rank; interleaved rank 0: min(p + (p-1)/v, m) (Megatron's warm-up);
    ZBV: at most p stage micro-batches on any rank, exactly p on every rank once m >= 2p-1
    (the paper's "1x 1F1B" at stage 0). Only split schedules leave W pending."""
    p, m, v = data.draw(sized("1f1b"))
    r1 = simulate(one_f_one_b(p, m))
    assert r1.peak_activations == tuple(float(p - r) for r in range(p))
    assert max(r1.peak_activations) <= p
    rg = simulate(gpipe(p, m))
    assert rg.peak_activations == (float(m),) * p
    assert rg.peak_w_pending == r1.peak_w_pending == (0,) * p
    rz = simulate(zbv(p, m))
    assert max(rz.peak_activations) <= p
    if m >= 2 * p - 1:
        assert rz.peak_activations == (float(p),) * p
    assert min(rz.peak_w_pending) >= 1
    mi = p * max(1, m // p)
    ri = simulate(interleaved_1f1b(p, mi, v))
    assert ri.peak_activations[0] == pytest.approx(min(p + (p - 1) / v, mi))
    assert ri.peak_activations[0] == ri.peak_activation_chunks[0] / v


def test_split_backward_releases_activations_at_b_and_counts_w_apart():
    """One rank, one stage: F0 B0 F1 B1 W0 W1 holds 1 activation at a time (freed by B) while
    two Ws wait; F0 F1 B0 B1 W0 W1 holds 2. Timing: B costs t_b - t_w, W costs t_w."""
    def sched(order):
        acts = tuple(Action(0, 0, 0, int(t[1]), Kind(t[0])) for t in order.split())
        return Schedule("custom", 1, 2, 1, (acts,))
    a = simulate(sched("F0 B0 F1 B1 W0 W1"), t_f=1.0, t_b=3.0, t_w=1.0)
    assert (a.peak_activation_chunks, a.peak_w_pending) == ((1,), (2,))
    assert [(sl.start, sl.end) for sl in a.timelines[0]] == [(0, 1), (1, 3), (3, 4), (4, 6), (6, 7), (7, 8)]
    b = simulate(sched("F0 F1 B0 B1 W0 W1"))
    assert (b.peak_activation_chunks, b.peak_w_pending) == ((2,), (2,))


def test_1f1b_order_is_warm_up_steady_cool_down():
    assert one_f_one_b(3, 4).steps() == ["rank 0: F0 F1 F2 BW0 F3 BW1 BW2 BW3",
                                         "rank 1: F0 F1 BW0 F2 BW1 F3 BW2 BW3",
                                         "rank 2: F0 BW0 F1 BW1 F2 BW2 F3 BW3"]
    assert gpipe(2, 2).steps() == ["rank 0: F0 F1 BW0 BW1", "rank 1: F0 F1 BW0 BW1"]


def _torch_orders(cls, p: int, **attrs) -> list[list[tuple[str, int, int]]]:
    """torch.distributed.pipelining's own per-rank order (its private planner, called without
    stages or a process group; skipped if torch's internals moved)."""
    names = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "BW"}
    obj = cls.__new__(cls)
    try:
        for k, val in attrs.items():
            setattr(obj, k, val)
        orders = [obj._calculate_single_rank_operations(r) for r in range(p)]
        return [[(names[a.computation_type.name], a.stage_index, a.microbatch_index)
                 for a in acts if a is not None] for acts in orders]
    except (AttributeError, TypeError, KeyError) as e:       # pragma: no cover - torch version drift
        pytest.skip(f"torch's schedule planner changed: {e!r}")


@pytest.mark.parametrize("p, m", [(1, 3), (2, 2), (2, 8), (3, 4), (4, 8), (4, 13), (8, 8), (8, 24)])
def test_zbv_and_interleaved_equal_torch_pipelining_orders(p, m):
    """The same per-rank orders as torch's ScheduleZBVZeroBubble and ScheduleInterleaved1F1B
    (m a multiple of p), idle placeholders dropped."""
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")

    def ours(s):
        return [[(a.kind.value, a.stage, a.mb) for a in acts] for acts in s]
    assert ours(zbv(p, m)) == _torch_orders(sched.ScheduleZBVZeroBubble, p, pp_group_size=p,
                                            _n_microbatches=m, num_stages=2 * p)
    if m % p == 0:
        for v in (2, 3):
            rounds = max(1, m // p)
            assert ours(interleaved_1f1b(p, m, v)) == _torch_orders(
                sched.ScheduleInterleaved1F1B, p, pp_group_size=p, _n_microbatches=m, n_local_stages=v,
                number_of_rounds=rounds, microbatches_per_round=m // rounds)


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda: one_f_one_b(4, 3), r"m=3 < p=4.*microbatches to >= 4.*gpipe"),
    (lambda: interleaved_1f1b(4, 6, 2), r"multiple of the pipeline ranks.*microbatches=8"),
    (lambda: interleaved_1f1b(4, 8, 1), r"v >= 2.*1f1b"),
    (lambda: gpipe(0, 4), r"p must be an int >= 1"),
    (lambda: zbv(2, 0), r"m must be an int >= 1"),
    (lambda: one_f_one_b(-1, 4), r"p must be an int >= 1"),
    (lambda: interleaved_1f1b(2, 4, 0), r"v must be an int >= 1"),
    (lambda: gpipe(2.0, 4), r"p must be an int"),
    (lambda: build_schedule("dualpipe", 2, 4), r"unknown pipeline schedule 'dualpipe'.*1f1b"),
    (lambda: simulate(one_f_one_b(2, 4), t_b=2.0, t_w=2.0), r"0 < t_w < t_b"),
    (lambda: simulate(one_f_one_b(2, 4), t_f=0.0), r"t_f > 0"),
])
def test_bad_input_is_a_named_config_error(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


# --- negative controls: broken schedules fail check_schedule ------------------------------------

def _with(s: Schedule, rank: int, acts) -> Schedule:
    ranks = list(s.ranks)
    ranks[rank] = tuple(acts)
    return Schedule(s.name, s.p, s.m, s.v, tuple(ranks))


def test_swapping_a_forward_after_its_backward_fails():
    s = one_f_one_b(4, 8)
    acts = list(s[3])                       # last rank: F0 BW0 F1 BW1 ...
    acts[0], acts[1] = acts[1], acts[0]
    with pytest.raises(ConfigError, match=r"BW\(stage 3, mb 0\).*comes before F\(stage 3, mb 0\)"):
        check_schedule(_with(s, 3, acts))


def test_w_before_its_b_fails():
    s = zbv(2, 4)
    acts = list(s[0])
    i = next(i for i, a in enumerate(acts) if a.kind is Kind.W)
    acts[i - 1], acts[i] = acts[i], acts[i - 1]
    with pytest.raises(ConfigError, match=r"W\(stage .*comes before B\("):
        check_schedule(_with(s, 0, acts))


def test_dropping_a_backward_fails():
    s = one_f_one_b(2, 4)
    acts = [a for a in s[0] if not (a.kind is Kind.BW and a.mb == 2)]
    with pytest.raises(ConfigError, match=r"stage 0, micro-batch 2 has 1 F, 0 BW, 0 B, 0 W"):
        check_schedule(_with(s, 0, acts))


def test_a_duplicate_or_misplaced_action_fails():
    s = gpipe(2, 2)
    with pytest.raises(ConfigError, match=r"stage 1, micro-batch 0 has 2 F"):
        check_schedule(_with(s, 1, (s[1][0],) + s[1]))
    with pytest.raises(ConfigError, match=r"out of place in rank 0"):
        check_schedule(_with(s, 0, s[0] + (Action(1, 1, 0, 0, Kind.F),)))
    with pytest.raises(ConfigError, match=r"rank lists for p=3"):
        check_schedule(s, 3, 2, 1)


def test_cross_rank_cycle_deadlocks():
    """Each list alone is in dependency order, but rank 0 waits for rank 1's B0, which waits
    behind rank 1's F1, which waits for rank 0's F1, which is after rank 0's B0."""
    F, BW = Kind.F, Kind.BW
    r0 = [Action(0, 0, 0, 0, F), Action(0, 0, 0, 0, BW), Action(0, 0, 0, 1, F), Action(0, 0, 0, 1, BW)]
    r1 = [Action(1, 1, 0, 0, F), Action(1, 1, 0, 1, F), Action(1, 1, 0, 0, BW), Action(1, 1, 0, 1, BW)]
    with pytest.raises(ConfigError, match=r"deadlocks: rank 0 at BW\(stage 0, mb 0\).*waits for B\(stage 1, "
                                          r"mb 0\); rank 1 at F\(stage 1, mb 1\).* waits for F\(stage 0, mb 1\)"):
        check_schedule([r0, r1], 2, 2, 1)
    check_schedule([r0, [r1[0], r1[2], r1[1], r1[3]]], 2, 2, 1)     # the fixed order passes


@SETTINGS
@given(data=st.data(), name=st.sampled_from(["1f1b", "interleaved", "zbv"]))
def test_moving_any_backward_before_its_forward_fails(data, name):
    """A random mutation: take a B/BW and move it to the front of its rank's list."""
    p, m, v = data.draw(sized(name))
    s = build_schedule(name, p, m, v)
    r = data.draw(st.integers(0, p - 1))
    acts = list(s[r])
    i = data.draw(st.sampled_from([i for i, a in enumerate(acts) if a.kind in (Kind.B, Kind.BW)]))
    acts.insert(0, acts.pop(i))
    with pytest.raises(ConfigError, match=r"comes before F\("):
        check_schedule(_with(s, r, acts))


# --- picture ----------------------------------------------------------------------------------

def _png_chunks(data: bytes) -> dict[bytes, bytes]:
    out, i = {}, 8
    while i < len(data):
        (n,) = struct.unpack(">I", data[i:i + 4])
        tag, body = data[i + 4:i + 8], data[i + 8:i + 8 + n]
        assert struct.unpack(">I", data[i + 8 + n:i + 12 + n])[0] == zlib.crc32(tag + body)
        out[tag] = out.get(tag, b"") + body
        i += 12 + n
    return out


def test_render_timeline_writes_a_png_of_the_stated_size(tmp_path):
    res = simulate(one_f_one_b(4, 8))
    path = tmp_path / "tl.png"
    w, h = render_timeline(res, path, px_per_unit=10, row_px=12, gap_px=2, margin_px=3)
    assert (w, h) == (2 * 3 + round(res.makespan * 10), 2 * 3 + 4 * 12 + 3 * 2)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks = _png_chunks(data)
    assert struct.unpack(">IIBBBBB", chunks[b"IHDR"]) == (w, h, 8, 2, 0, 0, 0)
    raw = zlib.decompress(chunks[b"IDAT"])
    assert len(raw) == h * (1 + 3 * w)
    row = raw[(3 + 2) * (1 + 3 * w) + 1:][:3 * w]           # a row inside rank 0's band
    px = [tuple(row[3 * x:3 * x + 3]) for x in range(w)]
    assert px[0] == (255, 255, 255)                          # margin
    assert (66, 133, 244) in px and (52, 168, 83) in px      # F blue and BW green both drawn
    first_bw = res.timelines[0][4]                            # rank 0: F0..F3, then BW0
    assert first_bw.action.kind is Kind.BW
    assert px[3 + round(first_bw.start * 10) + 1] == (52, 168, 83)
