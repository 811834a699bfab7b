"""`from_torch(torch.optim.X, **hyper)`: any elementwise torch optimizer as a GradientTransformation.

    tx = dsfn.optim.from_torch(torch.optim.RMSprop, lr=1e-3, momentum=0.9, centered=True)
    tx = dsfn.optim.partition({"decay": from_torch(torch.optim.NAdam, lr=lr, weight_decay=0.1),
                               "no_decay": from_torch(torch.optim.NAdam, lr=lr)}, labels)

How it runs. Each update builds fresh parameter tensors (copies of the pieces this rank
holds), sets their `.grad` to the gradients, builds `X(fresh, lr=..., **hyper)`, loads
the per-parameter state from the optimizer-state pytree (copies), calls `step()`, and
reads the new parameters and state back. Inputs are never written: the torch optimizer
only ever mutates tensors made for this call. Before the first update (count 0) no state
is loaded, so torch initialises it itself, exactly as a live optimizer would.

State (`FromTorchState`): `count` (0-dim int64, updates made), `tensors[key]` for every
torch state key shaped like the parameter (Adam's `exp_avg`, SGD's `momentum_buffer`): a
tree with the structure of the params, so its leaf paths end with the parameter's path
(`<tensors>.exp_avg.<param>`) and ZeRO shards, offload moves and checkpoints reshard it
with its parameter (a state tensor that is the caller's gradient itself is copied);
`scalars[key]` for per-parameter scalar state (torch's `step`, NAdam's `mu_product`,
ASGD's `eta`/`mu`): one 0-dim tensor per key, shared by all
parameters (torch keeps equal values for every parameter of a group; a differing value
raises ConfigError); Python numbers in torch's state are stored as 0-dim tensors and
handed back as numbers; and `lr`, the learning rate of the last update (before the first:
the one it will use), which `current_lr` reports. Before the first update `tensors` and
`scalars` hold zeros (torch's lazy initialisation replaces them).

Only elementwise optimizers qualify: dsfn splits parameters into flat pieces (ZeRO,
offload sub-groups) and runs the optimizer on each rank's pieces separately, which equals
the optimizer on whole tensors only when each element's update depends on that element's
own parameter, gradient and state. `from_torch` refuses torch.optim's LBFGS, SparseAdam,
Adafactor and Muon by name, and runs an *elementwise probe* for every optimizer at
construction: three steps on a random 6x5 parameter with a live torch optimizer, the same
through this transform, and the same values flattened and split into two 1-D pieces (17
and 13 elements) updated by two separate calls, as two ZeRO ranks would. It refuses with
ConfigError when the pieces' results differ from the whole's by more than 1e-6 relative
(not elementwise), when this transform's result differs from the live optimizer's (state
kept outside the per-parameter state, e.g. in `param_groups`), or when a state tensor is
not shaped like its parameter (factored statistics).

Hyper-parameters are passed to the torch class as given, except: `lr` may be a float, a
1-element tensor or a dsfn schedule `f(count)` (it is resolved at each update and passed
as a float; omitted: the class's default); `foreach` defaults to False where the class
takes it (the per-tensor loop, torch's own choice on CPU: results do not depend on the
device the update runs on); `capturable=True` (CUDA-graph capture of a live optimizer)
and `params` are refused. Per-group hyper-parameters come from composing several
`from_torch` transforms with `dsfn.optim.partition`.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from dsfn import tree
from dsfn.errors import ConfigError, LeafTypeError
from dsfn.optim.base import GradientTransformation, PyTree, tensor_leaves, zero_count
from dsfn.optim.transform import LearningRate, flatten_like, lr_record, lr_value, check_learning_rate
from dsfn.placed import is_placed

__all__ = ["FromTorchState", "from_torch"]


class FromTorchState(NamedTuple):
    """count: 0-dim int64 (updates made); tensors: {torch state key: tree like params};
    scalars: {torch state key: 0-dim tensor}; lr: the lr of the last update (0-dim tensor;
    None when neither the caller nor the class gives one)."""
    count: torch.Tensor
    tensors: dict
    scalars: dict
    lr: torch.Tensor | None


_SUGGEST = ("use an elementwise optimizer, e.g. dsfn.optim.from_torch(torch.optim.AdamW, ...) or "
            "dsfn.optim.adamw(...)")

_NOT_ELEMENTWISE = {
    "LBFGS": "LBFGS is not elementwise: it runs a line search over all parameters at once with a closure "
             "(its state holds flattened histories of every parameter)",
    "SparseAdam": "SparseAdam needs sparse gradients (nn.Embedding(sparse=True)) and dsfn's gradients are "
                  "dense; torch.optim.Adam is its dense counterpart",
    "Adafactor": "Adafactor is not elementwise: it keeps factored second moments (row and column statistics "
                 "of each matrix), which a flat piece of the matrix does not have",
    "Muon": "Muon is not elementwise: it orthogonalises each whole matrix (Newton-Schulz); dsfn.optim.muon "
            "does this under ZeRO by gathering each matrix on one rank",
}

_PROBE_SHAPE = (6, 5)
_PROBE_SPLIT = 17             # the flat 30 elements as pieces of 17 and 13, like two ZeRO ranks
_PROBE_STEPS = 3
_PROBE_RTOL = 1e-6


@dataclass(frozen=True)
class _Spec:
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


def _describe(opt: Any) -> str:
    base = opt.func if isinstance(opt, functools.partial) else opt
    mod = getattr(base, "__module__", "") or ""
    name = getattr(base, "__qualname__", None) or getattr(base, "__name__", None) or repr(base)
    if mod.startswith("torch.optim"):
        mod = "torch.optim"
    return f"{mod}.{name}" if mod else name


def _check_known(optimizer: Any) -> None:
    base = optimizer.func if isinstance(optimizer, functools.partial) else optimizer
    for name, why in _NOT_ELEMENTWISE.items():
        cls = getattr(torch.optim, name, None)
        if cls is not None and isinstance(base, type) and issubclass(base, cls):
            raise ConfigError(f"from_torch(torch.optim.{name}): {why}. dsfn shards "
                              f"parameters into flat pieces and updates each rank's pieces on their own; "
                              f"{_SUGGEST}")


class _TorchStep:
    """One update of the torch optimizer over lists of leaves (the core of the transform)."""

    def __init__(self, optimizer: Callable, hyper: dict, who: str):
        self.optimizer = optimizer
        self.hyper = hyper
        self.who = who
        self.spec: _Spec | None = None

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
        spec = self.spec
        with torch.no_grad():
            fresh = [x.detach().clone() for x in p]
            for x, gi in zip(fresh, g):
                gi = gi.detach()
                if gi.dtype != x.dtype or gi.device != x.device:
                    gi = gi.to(device=x.device, dtype=x.dtype)          # a new tensor
                elif spec.copy_grads:
                    gi = gi.clone()
                x.grad = gi
            opt = self.make(fresh, lr)
            if load:
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
                                          f"{_what(t)}, not a tensor of the parameter's shape {tuple(x.shape)}: "
                                          f"the optimizer is not elementwise; {_SUGGEST}")
                    if t.untyped_storage().data_ptr() == g[i].untyped_storage().data_ptr():
                        t = t.clone()      # torch kept the gradient itself: the state must not alias an input
                    new_t[k].append(t)
                for k in spec.scalar_keys + tuple(k for k, _ in spec.number_keys):
                    v = st[k]
                    t = v if isinstance(v, torch.Tensor) else _number_tensor(v)
                    if t.dim() != 0:
                        raise ConfigError(f"{self.who}: state {k!r} of parameter {names()[i]!r} is {_what(v)}, "
                                          "the probe saw a scalar")
                    if k not in new_s:
                        new_s[k] = t
                    elif not torch.equal(new_s[k], t):
                        raise ConfigError(f"{self.who}: its scalar state {k!r} differs between parameters "
                                          f"({new_s[k].item()} for {names()[0]!r}, {t.item()} for "
                                          f"{names()[i]!r}); from_torch keeps one value per key for all "
                                          "parameters (as torch's step count), so it cannot run this optimizer")
        return fresh, new_t, new_s


def _number_tensor(v: Any) -> torch.Tensor:
    """A Python number from torch's state as a 0-dim tensor that holds it exactly."""
    if isinstance(v, bool):
        return torch.tensor(v, dtype=torch.bool)
    if isinstance(v, int):
        return torch.tensor(v, dtype=torch.int64)
    if isinstance(v, float):
        return torch.tensor(v, dtype=torch.float64)
    raise ConfigError(f"from_torch: state value {v!r} is a {type(v).__name__}, not a number")


def _what(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {tuple(v.shape)}"
    return f"a {type(v).__name__}"


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    if a.shape != b.shape:
        return float("inf")
    d = (a - b).abs().max()
    if not torch.isfinite(d):
        return 0.0 if torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan()) \
            else float("inf")
    return float(d / b.abs().max().clamp_min(1e-30))


def _probe(core: _TorchStep, lr: float | None) -> _Spec:
    """The elementwise probe (see the module docstring); returns the state spec or raises ConfigError."""
    who = core.who
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(_PROBE_SHAPE, generator=gen)
    grads = [torch.randn(_PROBE_SHAPE, generator=gen) for _ in range(_PROBE_STEPS)]
    # 1. the live torch optimizer on the whole 2-D parameter
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
            raise ConfigError(f"{who}: a step on a {_PROBE_SHAPE} parameter failed: {type(e).__name__}: {e}; "
                              f"from_torch runs optimizers whose step() takes no closure and whose update is "
                              f"elementwise; {_SUGGEST}") from e
        copy_grads |= live.grad is None or live.grad._version != v
        live_states.append({k: (x.clone() if isinstance(x, torch.Tensor) else x)
                            for k, x in opt.state.get(live, {}).items()})
        live_params.append(live.detach().clone())
    changed = sorted(k for k, v in opt.param_groups[0].items() if k != "params"
                     and (k not in group0 or not _same(group0[k], v)))
    st = live_states[-1]
    tensor_keys, scalar_keys, number_keys, none_keys = [], [], [], []
    for k in sorted(st):
        v = st[k]
        if not isinstance(k, str):
            raise ConfigError(f"{who}: state key {k!r} is not a string; from_torch stores state by name")
        if isinstance(v, torch.Tensor):
            if tuple(v.shape) == _PROBE_SHAPE:
                tensor_keys.append(k)
            elif v.dim() == 0:
                scalar_keys.append(k)
            else:
                raise ConfigError(f"{who} is not elementwise: its state {k!r} of a parameter of shape "
                                  f"{_PROBE_SHAPE} has shape {tuple(v.shape)} (e.g. factored statistics); dsfn "
                                  f"shards parameters into flat pieces, each needing state of its own shape; "
                                  f"{_SUGGEST}")
        elif isinstance(v, (bool, int, float)):
            number_keys.append((k, type(v)))
        elif v is None:
            none_keys.append(k)
        else:
            raise ConfigError(f"{who}: its state {k!r} is a {type(v).__name__}; from_torch stores tensors and "
                              "numbers only")
    core.spec = _Spec(tuple(tensor_keys), tuple(scalar_keys), tuple(number_keys), tuple(none_keys), copy_grads,
                      lr_default)

    # 2. this transform's way (a fresh optimizer per step) on the whole parameter, and
    # 3. on two flat pieces, each updated on its own (as two ZeRO ranks would)
    def run(pieces: list[torch.Tensor], gs: list[list[torch.Tensor]]):
        p, tens, sc = pieces, {k: [torch.zeros_like(x) for x in pieces] for k in tensor_keys}, {}
        hist = []
        for t, g in enumerate(gs):
            p, tens, sc = core.run(p, g, tens, sc, t > 0, lr, lambda: [f"probe{i}" for i in range(len(pieces))])
            hist.append((p, tens, sc))
        return hist
    whole = run([p0.clone()], [[g] for g in grads])
    flat = p0.reshape(-1)
    pieces = [run([flat[:_PROBE_SPLIT].clone()], [[g.reshape(-1)[:_PROBE_SPLIT]] for g in grads]),
              run([flat[_PROBE_SPLIT:].clone()], [[g.reshape(-1)[_PROBE_SPLIT:]] for g in grads])]
    for t in range(_PROBE_STEPS):
        wp, wt, ws = whole[t]
        checks = [("the new parameter", wp[0], live_params[t])]
        checks += [(f"state {k!r}", wt[k][0], live_states[t].get(k)) for k in tensor_keys]
        for what, mine, theirs in checks:
            if not isinstance(theirs, torch.Tensor) or _rel_diff(mine, theirs) > _PROBE_RTOL:
                hint = f" (it changed param_groups[0] keys {changed})" if changed else ""
                raise ConfigError(f"{who}: a fresh optimizer per step, loaded with the per-parameter state, "
                                  f"does not reproduce the live optimizer ({what} after step {t + 1} differs): it "
                                  f"keeps state that from_torch cannot carry between steps{hint}; {_SUGGEST}")
        split = [(wp[0], [h[t][0][0] for h in pieces], "the new values")]
        split += [(wt[k][0], [h[t][1][k][0] for h in pieces], f"state {k!r}") for k in tensor_keys]
        for full, parts, what in split:
            if _rel_diff(torch.cat([x.reshape(-1) for x in parts]), full) > _PROBE_RTOL:
                raise ConfigError(f"{who} is not elementwise: its update of a parameter depends on elements "
                                  f"other than its own ({what} of a {_PROBE_SHAPE} parameter differ after step "
                                  f"{t + 1} when it is updated as two flat pieces); dsfn shards parameters "
                                  f"into flat pieces and updates each rank's pieces on their own; {_SUGGEST}")
        for k in scalar_keys + [k for k, _ in number_keys]:
            if any(not torch.equal(h[t][2][k], ws[k]) for h in pieces):
                raise ConfigError(f"{who} is not elementwise: its scalar state {k!r} depends on the parameter's "
                                  f"values (differs between flat pieces of one parameter); {_SUGGEST}")
    return core.spec


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:
        return a is b


def from_torch(optimizer: Callable[..., torch.optim.Optimizer], lr: LearningRate | None = None,
               **hyper: Any) -> GradientTransformation:
    """A torch optimizer whose update is elementwise, as a GradientTransformation.

    `optimizer`: a `torch.optim.Optimizer` subclass (torch's AdamW, Adam, SGD, Adagrad,
    RMSprop, Adamax, NAdam, RAdam, ASGD, Rprop, Adadelta, or a third-party one of that
    kind) or a callable `f(params, **hyper) -> Optimizer`. `lr`: a float, a 1-element
    tensor or a schedule `f(count)` (None: the class's default). `hyper`: the class's other
    keyword arguments, passed as given (`foreach` defaults to False).

    Offers `apply` (the new parameters directly, torch's values bitwise) besides `update`
    (`p' - p`, exact except where a step moves a parameter across or near zero). State:
    `FromTorchState` (see the module docstring). Raises ConfigError at construction for an
    optimizer that is not elementwise (by name or by the elementwise probe), for
    `capturable=True` or `params=`, and when the class rejects the hyper-parameters.
    """
    who = f"from_torch({_describe(optimizer)})"
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"from_torch got an optimizer instance ({type(optimizer).__name__}); pass the class and "
                          f"its hyper-parameters, e.g. from_torch(torch.optim.AdamW, lr=1e-3)")
    if not callable(optimizer):
        raise ConfigError(f"from_torch({optimizer!r}): pass a torch.optim.Optimizer subclass, e.g. torch.optim.AdamW")
    _check_known(optimizer)
    if "params" in hyper:
        raise ConfigError(f"{who}: do not pass params; from_torch supplies this rank's parameter pieces at each "
                          "update (per-group hyper-parameters: compose with dsfn.optim.partition)")
    if hyper.get("capturable"):
        raise ConfigError(f"{who}(capturable=True): capturable is for CUDA-graph capture of a live optimizer; "
                          "from_torch builds a fresh optimizer at each update and keeps the step count on the "
                          "host. Drop capturable")
    if lr is not None:
        check_learning_rate(lr, who)
    try:
        accepts_foreach = "foreach" in inspect.signature(optimizer).parameters
    except (TypeError, ValueError):
        accepts_foreach = False
    if accepts_foreach and "foreach" not in hyper:
        hyper["foreach"] = False
    core = _TorchStep(optimizer, hyper, who)
    probe_lr = None
    if lr is not None:
        v = float(lr_value(lr, zero_count()))
        probe_lr = v if v > 0 else 1e-2        # a warm-up schedule may start at 0: the probe needs a real step
    spec = _probe(core, probe_lr)
    state_dtypes: dict[tuple[torch.dtype, str], dict[str, tuple[torch.dtype, torch.device]]] = {}

    def dtypes_for(x: torch.Tensor) -> dict[str, tuple[torch.dtype, torch.device]]:
        """dtype and device of each state entry torch makes for a parameter like `x` (one tiny step)."""
        key = (x.dtype, str(x.device))
        if key not in state_dtypes:
            with torch.no_grad():
                z = torch.zeros(_PROBE_SHAPE, dtype=x.dtype, device=x.device)
                z.grad = torch.ones_like(z)
                opt = core.make([z], probe_lr)
                try:
                    opt.step()
                except Exception as e:
                    raise ConfigError(f"{who}: a step on {x.dtype} parameters on {x.device} failed: "
                                      f"{type(e).__name__}: {e}") from e
                st = opt.state.get(z, {})
                state_dtypes[key] = {k: (v.dtype, v.device) for k, v in st.items() if isinstance(v, torch.Tensor)}
        return state_dtypes[key]

    def lr_now(count: torch.Tensor) -> tuple[float | None, torch.Tensor | None]:
        if lr is None:
            return None, (None if spec.lr_default is None else lr_record(float(spec.lr_default)))
        v = lr_value(lr, count)
        return float(v), lr_record(v)

    def init(params: PyTree) -> FromTorchState:
        leaves, tspec = tensor_leaves(params, "params")
        count = zero_count()
        dts = [dtypes_for(x) for x in leaves]
        tensors = {k: tree.unflatten(tspec, [torch.zeros(x.shape, dtype=d.get(k, (x.dtype,))[0], device=x.device)
                                             for x, d in zip(leaves, dts)])
                   for k in spec.tensor_keys}
        scalars = {}
        for k in spec.scalar_keys:
            dt, dev = dts[0].get(k, (torch.float32, torch.device("cpu"))) if dts else \
                (torch.get_default_dtype(), torch.device("cpu"))
            scalars[k] = torch.zeros((), dtype=dt, device=dev)
        for k, kind in spec.number_keys:
            scalars[k] = _number_tensor(kind(0))
        return FromTorchState(count, tensors, scalars, lr_now(count)[1])

    def step(updates: PyTree, state: FromTorchState, params: PyTree):
        """(new param leaves, param leaves, spec, new state); leaves are None for an empty tree."""
        if not isinstance(state, FromTorchState):
            raise LeafTypeError(f"{who} got a state of type {type(state).__name__}; pass the state its init/update "
                                "returned")
        g, tspec = tensor_leaves(updates, "updates")
        count = state.count + 1
        lr_f, lr_rec = lr_now(state.count)
        if not g:
            return None, None, tspec, state._replace(count=count, lr=lr_rec)
        if params is None:
            raise LeafTypeError(f"{who} needs params: call update(grads, state, params)")
        p = flatten_like(params, tspec, "params")
        missing = [k for k in spec.tensor_keys if k not in state.tensors] + \
            [k for k in spec.scalar_keys + tuple(k for k, _ in spec.number_keys) if k not in state.scalars]
        if missing:
            raise LeafTypeError(f"{who}: the state lacks {missing}; pass the state this transform's init/update "
                                "returned")
        tens = {k: flatten_like(state.tensors[k], tspec, f"{who} state.tensors[{k!r}]") for k in spec.tensor_keys}

        def names() -> list[str]:
            return [q for q, _ in tree.leaves_with_path(tree.unflatten(tspec, range(len(g))), is_leaf=is_placed)]
        new_p, new_t, new_s = core.run(p, g, tens, state.scalars, int(state.count) > 0, lr_f, names)
        new = FromTorchState(count, {k: tree.unflatten(tspec, new_t[k]) for k in spec.tensor_keys}, new_s, lr_rec)
        return new_p, p, tspec, new

    def update(updates: PyTree, state: FromTorchState, params: PyTree = None) -> tuple[PyTree, FromTorchState]:
        new_p, p, tspec, new = step(updates, state, params)
        if new_p is None:
            return updates, new
        return tree.unflatten(tspec, torch._foreach_sub(new_p, p)), new

    def apply(updates: PyTree, state: FromTorchState, params: PyTree) -> tuple[PyTree, FromTorchState]:
        new_p, _, tspec, new = step(updates, state, params)
        return (params if new_p is None else tree.unflatten(tspec, new_p)), new

    return GradientTransformation(init, update, apply)
