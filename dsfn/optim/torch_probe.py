"""`from_torch`'s elementwise probe: does a torch optimizer update each element on its own?

Three steps on a random 6x5 parameter with a live torch optimizer, the same through the
transform's step adapter (`TorchStep`, a fresh optimizer per step), and the same values
flattened and split into two 1-D pieces (17 and 13 elements) updated by two separate
calls, as two ZeRO ranks would; ConfigError when they differ by more than 1e-6 relative,
or when a state entry is of a kind the transform cannot carry. See
`dsfn.optim.torch_optim`'s docstring.
"""
from __future__ import annotations

from typing import Any

import torch

from dsfn.errors import ConfigError
from dsfn.optim.torch_step import SUGGEST, StateSpec, TorchStep

__all__ = ["PROBE_RTOL", "PROBE_SHAPE", "PROBE_SPLIT", "PROBE_STEPS", "probe", "rel_diff", "same"]

PROBE_SHAPE = (6, 5)
PROBE_SPLIT = 17             # the flat 30 elements as pieces of 17 and 13, like two ZeRO ranks
PROBE_STEPS = 3
PROBE_RTOL = 1e-6


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    if a.shape != b.shape:
        return float("inf")
    d = (a - b).abs().max()
    if not torch.isfinite(d):
        return 0.0 if torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan()) \
            else float("inf")
    return float(d / b.abs().max().clamp_min(1e-30))


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:
        return a is b


def probe(core: TorchStep, lr: float | None) -> StateSpec:
    """The elementwise probe (see the module docstring); sets and returns `core.spec`, or raises ConfigError."""
    who = core.who
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(PROBE_SHAPE, generator=gen)
    grads = [torch.randn(PROBE_SHAPE, generator=gen) for _ in range(PROBE_STEPS)]
    lr_default, copy_grads, live_states, live_params, changed = _live(core, lr, p0, grads)
    tensor_keys, scalar_keys, number_keys, none_keys = _state_kinds(who, live_states[-1])
    core.spec = StateSpec(tuple(tensor_keys), tuple(scalar_keys), tuple(number_keys), tuple(none_keys), copy_grads,
                          lr_default)
    whole, pieces = _transform_runs(core, lr, p0, grads, tensor_keys)
    for t in range(PROBE_STEPS):
        _check_step(who, t, whole[t], pieces, live_params[t], live_states[t], changed, tensor_keys,
                    scalar_keys + [k for k, _ in number_keys])
    return core.spec


def _live(core: TorchStep, lr: float | None, p0: torch.Tensor, grads: list[torch.Tensor]):
    """1. the live torch optimizer on the whole 2-D parameter: (its lr, whether it writes to
    p.grad, its state and parameter after each step, the param_groups keys it changed)."""
    who = core.who
    live = p0.clone()
    opt = core.make([live], lr)
    lr_default = opt.param_groups[0].get("lr") if lr is None else lr
    if isinstance(lr_default, torch.Tensor):
        lr_default = float(lr_default)
    group0 = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    copy_grads = False
    live_states, live_params = [], []
    for g in grads:
        live.grad = g.clone()
        v = live.grad._version
        try:
            opt.step()
        except Exception as e:
            raise ConfigError(f"{who}: a step on a {PROBE_SHAPE} parameter failed: {type(e).__name__}: {e}; "
                              f"from_torch runs optimizers whose step() takes no closure and whose update is "
                              f"elementwise; {SUGGEST}") from e
        copy_grads |= live.grad is None or live.grad._version != v
        live_states.append({k: (x.clone() if isinstance(x, torch.Tensor) else x)
                            for k, x in opt.state.get(live, {}).items()})
        live_params.append(live.detach().clone())
    changed = sorted(k for k, v in opt.param_groups[0].items() if k != "params"
                     and (k not in group0 or not same(group0[k], v)))
    return lr_default, copy_grads, live_states, live_params, changed


def _state_kinds(who: str, st: dict) -> tuple[list, list, list, list]:
    """The live state's keys by kind: (shaped like the parameter, 0-dim tensors, Python
    numbers with their type, None); ConfigError for any other kind."""
    tensor_keys, scalar_keys, number_keys, none_keys = [], [], [], []
    for k in sorted(st):
        v = st[k]
        if not isinstance(k, str):
            raise ConfigError(f"{who}: state key {k!r} is not a string; from_torch stores state by name")
        if isinstance(v, torch.Tensor):
            if tuple(v.shape) == PROBE_SHAPE:
                tensor_keys.append(k)
            elif v.dim() == 0:
                scalar_keys.append(k)
            else:
                raise ConfigError(f"{who} is not elementwise: its state {k!r} of a parameter of shape "
                                  f"{PROBE_SHAPE} has shape {tuple(v.shape)} (e.g. factored statistics); dsfn "
                                  f"shards parameters into flat pieces, each needing state of its own shape; "
                                  f"{SUGGEST}")
        elif isinstance(v, (bool, int, float)):
            number_keys.append((k, type(v)))
        elif v is None:
            none_keys.append(k)
        else:
            raise ConfigError(f"{who}: its state {k!r} is a {type(v).__name__}; from_torch stores tensors and "
                              "numbers only")
    return tensor_keys, scalar_keys, number_keys, none_keys


def _transform_runs(core: TorchStep, lr: float | None, p0: torch.Tensor, grads: list[torch.Tensor],
                    tensor_keys: list[str]):
    """2. this transform's way (a fresh optimizer per step) on the whole parameter, and
    3. on two flat pieces, each updated on its own (as two ZeRO ranks would): (whole, pieces),
    each a history of (params, tensor state, scalar state) per step."""
    def run(pieces: list[torch.Tensor], gs: list[list[torch.Tensor]]):
        p, tens, sc = pieces, {k: [torch.zeros_like(x) for x in pieces] for k in tensor_keys}, {}
        hist = []
        for t, g in enumerate(gs):
            p, tens, sc = core.run(p, g, tens, sc, t > 0, lr, lambda: [f"probe{i}" for i in range(len(pieces))])
            hist.append((p, tens, sc))
        return hist
    whole = run([p0.clone()], [[g] for g in grads])
    flat = p0.reshape(-1)
    pieces = [run([flat[:PROBE_SPLIT].clone()], [[g.reshape(-1)[:PROBE_SPLIT]] for g in grads]),
              run([flat[PROBE_SPLIT:].clone()], [[g.reshape(-1)[PROBE_SPLIT:]] for g in grads])]
    return whole, pieces


def _check_step(who: str, t: int, whole_t: tuple, pieces: list, live_param: torch.Tensor, live_state: dict,
                changed: list, tensor_keys: list[str], scalar_keys: list[str]) -> None:
    """Step t's comparisons: the transform's whole-parameter run against the live optimizer,
    the two pieces against the whole run (ConfigError naming what differs)."""
    wp, wt, ws = whole_t
    checks = [("the new parameter", wp[0], live_param)]
    checks += [(f"state {k!r}", wt[k][0], live_state.get(k)) for k in tensor_keys]
    for what, mine, theirs in checks:
        if not isinstance(theirs, torch.Tensor) or rel_diff(mine, theirs) > PROBE_RTOL:
            hint = f" (it changed param_groups[0] keys {changed})" if changed else ""
            raise ConfigError(f"{who}: a fresh optimizer per step, loaded with the per-parameter state, "
                              f"does not reproduce the live optimizer ({what} after step {t + 1} differs): it "
                              f"keeps state that from_torch cannot carry between steps{hint}; {SUGGEST}")
    split = [(wp[0], [h[t][0][0] for h in pieces], "the new values")]
    split += [(wt[k][0], [h[t][1][k][0] for h in pieces], f"state {k!r}") for k in tensor_keys]
    for full, parts, what in split:
        if rel_diff(torch.cat([x.reshape(-1) for x in parts]), full) > PROBE_RTOL:
            raise ConfigError(f"{who} is not elementwise: its update of a parameter depends on elements "
                              f"other than its own ({what} of a {PROBE_SHAPE} parameter differ after step "
                              f"{t + 1} when it is updated as two flat pieces); dsfn shards parameters "
                              f"into flat pieces and updates each rank's pieces on their own; {SUGGEST}")
    for k in scalar_keys:
        if any(not torch.equal(h[t][2][k], ws[k]) for h in pieces):
            raise ConfigError(f"{who} is not elementwise: its scalar state {k!r} depends on the parameter's "
                              f"values (differs between flat pieces of one parameter); {SUGGEST}")
