"""`plan(model, cluster, global_batch, seq_len)`: every valid layout, predicted and ranked.

The search space is every transform that changes the layout (`Layout`): tp inside a node,
Ulysses sp and ring cp, expert parallel (a MoE's experts), the pipeline (degree, schedule,
virtual stages, micro-batches), the data axis (ZeRO 0-3; at stage 3 flat, HSDP or hpZ
shard groups), remat, offload, and the micro-batch size. A degree that does not divide what
it splits (heads, key/value heads, layers, experts, the batch, the sequence) is rejected by
name; every other candidate's stack is built and handed to `compose`, and its meta state
placed by `estimate_memory`: what dsfn refuses there is rejected with dsfn's own message,
so the planner never proposes what dsfn would not run. A candidate that does not fit
`cluster.memory x memory_fraction` is rejected with its predicted peak.

Families (a layout without its sizes: "zero3-hsdp tp pp(1f1b) remat") are reported with the
reason each rejected family was rejected, `PlanResult.rejected`.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from torch import nn

from dsfn.comm_model import Cluster
from dsfn.errors import ConfigError, DsfnError
from dsfn.estimate_activations import human_bytes
from dsfn.planner.layout import Layout
from dsfn.planner.model import ModelFacts
from dsfn.planner.predict import Prediction, predict, state_key

__all__ = ["Constraints", "PlanError", "PlanResult", "Rejection", "plan", "search_space"]


class PlanError(ConfigError):
    """No layout of the search space can train this model on this cluster with this batch."""


@dataclass(frozen=True)
class Constraints:
    """What the search may use. None: every size that divides. `memory_fraction`: the share of
    a device's memory a layout may plan to use (the rest: allocator fragmentation, NCCL and
    CUDA context). `sp_min_seq` / `cp_min_seq`: sequence lengths from which Ulysses / ring are
    searched (below them the sequence is short enough to keep whole). `micro_batches`: rows
    per micro-batch tried. `offload`: "auto" searches offload only where nothing fits without it."""

    tp: Sequence[int] | None = None
    pp: Sequence[int] | None = None
    sp: Sequence[int] | None = None
    cp: Sequence[int] | None = None
    ep: Sequence[int] | None = None
    zero: Sequence[int] = (0, 1, 2, 3)
    shard: Sequence[str] = ("flat", "hsdp", "hpz")
    schedules: Sequence[str] = ("1f1b", "interleaved", "zbv")
    remat: Sequence[bool] = (False, True)
    offload: bool | str = "auto"
    micro_batches: Sequence[int] = (1, 2, 4, 8)
    memory_fraction: float = 0.9
    sp_min_seq: int = 16384
    cp_min_seq: int = 32768
    max_pp: int = 32

    @classmethod
    def of(cls, c: "Constraints | dict | None") -> "Constraints":
        if c is None:
            return cls()
        if isinstance(c, Constraints):
            return c
        if isinstance(c, dict):
            bad = sorted(set(c) - set(cls.__dataclass_fields__))
            if bad:
                raise ConfigError(f"plan(constraints=...): unknown keys {bad}; use {sorted(cls.__dataclass_fields__)}")
            return cls(**c)
        raise ConfigError(f"plan(constraints={c!r}): a dsfn.planner.Constraints or a dict of its fields")


@dataclass
class Rejection:
    family: str
    reason: str
    layout: Layout | None = None


@dataclass
class PlanResult:
    """`candidates`: the valid layouts that fit, fastest first (their `Prediction`s);
    `rejected`: {family: reason} of the families with no candidate; `unfit`: the fitting
    layouts' smallest peak when nothing fits (the memory that would)."""

    facts: ModelFacts
    cluster: Cluster
    global_batch: int
    seq_len: int
    candidates: list[Prediction] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    considered: int = 0

    @property
    def best(self) -> Prediction:
        return self.candidates[0]

    def table(self, top: int = 10) -> str:
        """The top candidates (memory, step time split, tokens/s, MFU) and the rejected families."""
        c, f = self.cluster, self.facts
        lines = [f"plan: {f.name} ({f.params / 1e9:.3g}B params{'' if not f.experts else f', {f.active_params / 1e9:.3g}B active'}) "
                 f"on {c.nodes} x {c.gpus_per_node} {c.name} ({human_bytes(c.memory).strip()} each), global batch "
                 f"{self.global_batch} x {self.seq_len} tokens; {self.considered} layouts considered, "
                 f"{len(self.candidates)} fit",
                 f"{'#':>3} {'layout':58s} {'peak':>11} {'step s':>9} {'compute':>8} {'exposed':>8} {'bubble':>8} "
                 f"{'tok/s':>10} {'MFU':>6}"]
        for i, p in enumerate(self.candidates[:top]):
            lines.append(f"{i + 1:3d} {p.layout.describe():58s} {human_bytes(p.peak):>11} {p.step_s:9.4g} "
                         f"{p.compute_s:8.3g} {p.exposed_s:8.3g} {p.bubble_s:8.3g} {p.tokens_per_s:10.4g} "
                         f"{100 * p.mfu:5.1f}%")
        if self.candidates:
            lines.append(f"best: {self.best.layout.code()}")
        if self.rejected:
            lines.append("rejected families:")
            for fam, why in sorted(self.rejected.items()):
                lines.append(f"  {fam}: {why}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_space(facts: ModelFacts, cluster: Cluster, global_batch: int, seq: int,
                 constraints: Constraints) -> Iterable[Layout | Rejection]:
    """Every layout of the search space, or a `Rejection` naming the degree that does not
    divide what it splits (module docstring)."""
    W, gpn = cluster.world, cluster.gpus_per_node
    cs = constraints
    bf16 = cluster.dtype == "bf16"

    def allowed(name: str, options: list[int]) -> list[int]:
        given = getattr(cs, name)
        return [o for o in options if given is None or o in given]
    tps = allowed("tp", _divisors(gpn))
    for tp in tps:
        if facts.heads % tp or (facts.mla is None and facts.kv_heads % tp):
            yield Rejection(f"tp{tp}", f"tp {tp} does not divide the {facts.heads} query / {facts.kv_heads} key-value "
                                       "heads")
            continue
        sps = allowed("sp", [d for d in _divisors(gpn // tp) if d == 1 or seq >= cs.sp_min_seq or cs.sp])
        for sp in sps:
            if sp > 1 and (facts.heads % (tp * sp) or seq % sp):
                yield Rejection("sp", f"tp x sp = {tp * sp} does not divide the {facts.heads} heads (Ulysses splits "
                                      f"heads over sp) or the sequence {seq}")
                continue
            cps = allowed("cp", [d for d in _divisors(W // (tp * sp)) if d == 1 or seq >= cs.cp_min_seq or cs.cp])
            for cp in cps:
                if cp > 1 and seq % (2 * cp * sp):
                    yield Rejection("cp", f"the sequence {seq} is not a multiple of 2 x cp x sp = {2 * cp * sp} "
                                          "(ring attention's head-tail chunks)")
                    continue
                rest = W // (tp * sp * cp)
                eps = allowed("ep", [d for d in _divisors(rest) if d == 1 or (facts.experts and facts.experts % d == 0)])
                if facts.experts and cs.ep is None:
                    bad = [d for d in _divisors(rest) if facts.experts % d and d > 1]
                    if bad:
                        yield Rejection("ep", f"ep {bad[0]} does not divide the {facts.experts} experts")
                for ep in eps:
                    for pp in allowed("pp", [d for d in _divisors(rest // ep) if d <= cs.max_pp]):
                        if pp > 1 and facts.layers < pp:
                            yield Rejection("pp", f"pp {pp} exceeds the {facts.layers} layers")
                            continue
                        dp = rest // (ep * pp)
                        yield from _data_layouts(facts, cluster, global_batch, seq, cs, bf16,
                                                 dict(dp=dp, tp=tp, sp=sp, cp=cp, ep=ep, pp=pp))


def _data_layouts(facts, cluster, global_batch, seq, cs, bf16, mesh) -> Iterable[Layout | Rejection]:
    dp, pp = mesh["dp"], mesh["pp"]
    data = dp * mesh["ep"]
    if global_batch % data:
        yield Rejection(f"dp{data}", f"the global batch {global_batch} is not divisible by the {data} data ranks "
                                     "(dp x ep)")
        return
    rows = global_batch // data
    k = max(1, cluster.gpus_per_node // (mesh["tp"] * mesh["sp"] * mesh["cp"] * mesh["ep"]))
    for mb in [m for m in cs.micro_batches if rows % m == 0]:
        accum = rows // mb
        schedules = [None] if pp == 1 else list(cs.schedules)
        for sched in schedules:
            if sched is not None and accum < pp:
                yield Rejection(f"pp({sched}{' v2' if sched == 'interleaved' else ''})", f"{accum} micro-batches of {mb} rows are fewer than pp {pp}")
                continue
            virtual = 2 if sched == "interleaved" else None
            fam = f"pp({sched}{' v2' if virtual else ''})"
            if sched in ("interleaved", "zbv") and facts.layers < 2 * pp:
                yield Rejection(fam, f"{facts.layers} layers cannot fill 2 stages per rank at pp {pp}")
                continue
            if sched == "interleaved" and accum % pp:
                yield Rejection(fam, f"interleaved 1F1B runs micro-batches in groups of pp {pp}; "
                                                   f"{accum} is not a multiple")
                continue
            for zero in cs.zero:
                if dp == 1 and zero > 1:        # nothing to shard over: ZeRO 2/3 at dp 1 is ZeRO 1
                    yield Rejection(f"zero{zero}", f"dp 1 leaves ZeRO {zero} nothing to shard (it is ZeRO 1)")
                    continue
                shards = ["flat"] if zero < 3 or dp <= k or dp % k else [s for s in cs.shard]
                for shard in shards:
                    for remat in cs.remat:
                        yield Layout(zero=zero, shard=shard, schedule=sched, virtual=virtual, micro_batch=mb,
                                     accum=accum, remat=remat, bf16=bf16, **mesh)


def plan(model: Any, cluster: Cluster | None = None, *, global_batch: int, seq_len: int,
         constraints: Constraints | dict | None = None, top: int | None = None) -> PlanResult:
    """The valid layouts of `model` on `cluster` that fit, ranked by predicted step time.

    Args:
        model: a Hugging Face config (or dict with model_type), a preset name
            (`dsfn.planner.presets.PRESETS`), a dsfn GPTConfig, or an nn.Module (meta is enough).
        cluster: `dsfn.Cluster.h100(nodes)`, `.h200(nodes)`, `.cpu(nodes, ranks_per_node)` or
            your own (default: one H100 node).
        global_batch: sequences per optimizer step (all ranks together).
        seq_len: tokens per sequence.
        constraints: `Constraints` (or a dict of its fields) narrowing the search.
        top: keep only the fastest `top` candidates.

    Raises:
        PlanError: nothing fits (the message gives the smallest peak any valid layout needs), or
            no degree divides the batch.
        ConfigError: the model cannot be read (the FLOPs count names what it lacks).
    """
    cluster = cluster if cluster is not None else Cluster.h100(1)
    if not isinstance(cluster, Cluster):
        raise ConfigError(f"plan(cluster={type(cluster).__name__}): use dsfn.Cluster.h100(nodes), .h200(nodes), "
                          ".cpu(nodes, ranks_per_node) or dsfn.Cluster(...)")
    for name, v in (("global_batch", global_batch), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"plan({name}={v!r}): a positive int")
    facts = ModelFacts.of(model)
    cs = Constraints.of(constraints)
    module = model if isinstance(model, nn.Module) and not _has_real_weights(model) else facts.meta_module()
    result = PlanResult(facts, cluster, global_batch, seq_len)
    limit = cluster.memory * cs.memory_fraction
    judged: dict[tuple, str | None] = {}
    smallest: tuple[float, Layout] | None = None
    fits_by_family: Counter = Counter()
    reasons: dict[str, str] = {}
    offload_opts = [False, True] if cs.offload is True else [False]
    items = list(search_space(facts, cluster, global_batch, seq_len, cs))
    layouts = [x for x in items if isinstance(x, Layout)]
    for x in items:
        if isinstance(x, Rejection):
            reasons.setdefault(x.family, x.reason)
    if not layouts:
        raise PlanError(f"plan: no layout of {facts.name} on {cluster.world} ranks: "
                        + ("; ".join(sorted(set(reasons.values()))[:4]) or "the constraints leave none")
                        + ". Change the global batch to a multiple of the data ranks, or the degrees (constraints=)")

    def run(lays: list[Layout]) -> None:
        nonlocal smallest
        for lay in lays:
            result.considered += 1
            fam = lay.family()
            low = _state_lower_bound(lay, facts)
            if low > limit:             # cannot fit whatever the estimate adds: not placed at all
                reasons.setdefault(fam, f"does not fit: its state alone needs at least {human_bytes(low).strip()} "
                                        f"per device (> {cs.memory_fraction:.0%} of "
                                        f"{human_bytes(cluster.memory).strip()})")
                if smallest is None or low < smallest[0]:
                    smallest = (low, lay)
                continue
            key = state_key(lay)
            if key not in judged:
                judged[key] = _judge(lay, module)
            if judged[key] is not None:
                reasons.setdefault(fam, judged[key])
                continue
            try:
                p = predict(lay, facts, cluster, global_batch, seq_len, module=module)
            except DsfnError as e:
                reasons.setdefault(fam, f"dsfn refuses it: {e}")
                continue
            if p.peak > limit:
                if smallest is None or p.peak < smallest[0]:
                    smallest = (p.peak, lay)
                reasons.setdefault(fam, f"does not fit: needs {human_bytes(p.peak).strip()} per device "
                                        f"(> {cs.memory_fraction:.0%} of {human_bytes(cluster.memory).strip()})")
                continue
            fits_by_family[fam] += 1
            result.candidates.append(p)
    run([lay.with_(offload=o) for o in offload_opts for lay in layouts])
    if not result.candidates and cs.offload == "auto":
        run([lay.with_(offload=True) for lay in layouts])
    # a family is rejected when no fitting candidate has all of its features ("pp(1f1b)" is
    # not rejected while "zero1 pp(1f1b)" fits)
    fitted = [set(f.split()) for f in fits_by_family]
    result.rejected = {f: r for f, r in reasons.items() if not any(set(f.split()) <= g for g in fitted)}
    if not result.candidates:
        need = f"; the smallest layout ({smallest[1].describe()}) needs {human_bytes(smallest[0]).strip()} per " \
               f"device, {human_bytes(smallest[0] / cs.memory_fraction).strip()} of memory with the " \
               f"{cs.memory_fraction:.0%} margin" if smallest else \
            "; none could be estimated: " + ("; ".join(sorted(set(reasons.values()))[:3]) or "no layout")
        raise PlanError(f"plan: no layout of {facts.name} fits {cluster.world} x {human_bytes(cluster.memory).strip()} "
                        f"({cluster.name}){need}. Use more nodes, devices with more memory, a smaller global batch "
                        f"or sequence, or allow offload (constraints=dict(offload=True))")
    result.candidates.sort(key=lambda p: (p.step_s, p.peak))
    if top is not None:
        result.candidates = result.candidates[:top]
    return result


def _state_lower_bound(lay: Layout, facts: ModelFacts) -> float:
    """Bytes of state any rank of `lay` holds at least: the parameters split over every axis
    that can split them (tp x pp x ep), in the compute dtype (/ dp at ZeRO-3), and AdamW's
    fp32 moments (+ fp32 master weights under bf16) / dp at ZeRO >= 1; none when offloaded."""
    p = facts.params / (lay.tp * lay.pp * lay.ep)
    pb = 2 if lay.bf16 else 4
    opt = 0.0 if lay.offload else p * (8 + (4 if lay.bf16 else 0)) / (lay.dp if lay.zero >= 1 else 1)
    shard = lay.dp if lay.zero == 3 else 1
    if lay.shard == "hsdp":
        return 0.0                      # its shard group is a node's part of dp: the estimate decides
    return p * pb / shard + opt


def _has_real_weights(module: Any) -> bool:
    return any(p.device.type != "meta" for p in module.parameters())


def _judge(lay: Layout, module: Any) -> str | None:
    """None when `compose` takes the layout's stack, else dsfn's reason."""
    from dsfn.transforms.compose import compose
    try:
        compose(*lay.stack(module))(_no_step)
    except DsfnError as e:
        return f"compose refuses the stack: {e}"
    return None


def _no_step(state: Any, batch: Any) -> Any:     # compose judges the stack, not the step
    return state, {}
