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
from typing import Any, Callable, NamedTuple

import torch

from dsfn import tree
from dsfn.errors import ConfigError, LeafTypeError
from dsfn.optim.base import GradientTransformation, PyTree, tensor_leaves, zero_count
from dsfn.optim.torch_probe import PROBE_SHAPE, probe
from dsfn.optim.torch_step import SUGGEST, StateSpec, TorchStep, number_tensor
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
                              f"{SUGGEST}")


def _check_args(optimizer: Any, lr: LearningRate | None, hyper: dict, who: str) -> None:
    """ConfigError for what `from_torch` refuses; `foreach` defaults to False where the class takes it."""
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


class _FromTorch:
    """One `from_torch` transformation: the step adapter with its probed spec, the lr, and
    the dtypes of torch's state per parameter dtype and device (learnt on first use)."""

    def __init__(self, core: TorchStep, spec: StateSpec, lr: LearningRate | None, probe_lr: float | None):
        self.core, self.spec, self.lr, self.probe_lr = core, spec, lr, probe_lr
        self.who = core.who
        self.state_dtypes: dict[tuple[torch.dtype, str], dict[str, tuple[torch.dtype, torch.device]]] = {}

    def dtypes_for(self, x: torch.Tensor) -> dict[str, tuple[torch.dtype, torch.device]]:
        """dtype and device of each state entry torch makes for a parameter like `x` (one tiny step)."""
        key = (x.dtype, str(x.device))
        if key not in self.state_dtypes:
            with torch.no_grad():
                z = torch.zeros(PROBE_SHAPE, dtype=x.dtype, device=x.device)
                z.grad = torch.ones_like(z)
                opt = self.core.make([z], self.probe_lr)
                try:
                    opt.step()
                except Exception as e:
                    raise ConfigError(f"{self.who}: a step on {x.dtype} parameters on {x.device} failed: "
                                      f"{type(e).__name__}: {e}") from e
                st = opt.state.get(z, {})
                self.state_dtypes[key] = {k: (v.dtype, v.device) for k, v in st.items()
                                          if isinstance(v, torch.Tensor)}
        return self.state_dtypes[key]

    def lr_now(self, count: torch.Tensor) -> tuple[float | None, torch.Tensor | None]:
        lr, spec = self.lr, self.spec
        if lr is None:
            return None, (None if spec.lr_default is None else lr_record(float(spec.lr_default)))
        v = lr_value(lr, count)
        return float(v), lr_record(v)

    def init(self, params: PyTree) -> FromTorchState:
        spec = self.spec
        leaves, tspec = tensor_leaves(params, "params")
        count = zero_count()
        dts = [self.dtypes_for(x) for x in leaves]
        tensors = {k: tree.unflatten(tspec, [torch.zeros(x.shape, dtype=d.get(k, (x.dtype,))[0], device=x.device)
                                             for x, d in zip(leaves, dts)])
                   for k in spec.tensor_keys}
        scalars = {}
        for k in spec.scalar_keys:
            dt, dev = dts[0].get(k, (torch.float32, torch.device("cpu"))) if dts else \
                (torch.get_default_dtype(), torch.device("cpu"))
            scalars[k] = torch.zeros((), dtype=dt, device=dev)
        for k, kind in spec.number_keys:
            scalars[k] = number_tensor(kind(0))
        return FromTorchState(count, tensors, scalars, self.lr_now(count)[1])

    def step(self, updates: PyTree, state: FromTorchState, params: PyTree):
        """(new param leaves, param leaves, spec, new state); leaves are None for an empty tree."""
        who, spec = self.who, self.spec
        if not isinstance(state, FromTorchState):
            raise LeafTypeError(f"{who} got a state of type {type(state).__name__}; pass the state its init/update "
                                "returned")
        g, tspec = tensor_leaves(updates, "updates")
        count = state.count + 1
        lr_f, lr_rec = self.lr_now(state.count)
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
        new_p, new_t, new_s = self.core.run(p, g, tens, state.scalars, int(state.count) > 0, lr_f, names)
        new = FromTorchState(count, {k: tree.unflatten(tspec, new_t[k]) for k in spec.tensor_keys}, new_s, lr_rec)
        return new_p, p, tspec, new

    def update(self, updates: PyTree, state: FromTorchState, params: PyTree = None) -> tuple[PyTree, FromTorchState]:
        new_p, p, tspec, new = self.step(updates, state, params)
        if new_p is None:
            return updates, new
        return tree.unflatten(tspec, torch._foreach_sub(new_p, p)), new

    def apply(self, updates: PyTree, state: FromTorchState, params: PyTree) -> tuple[PyTree, FromTorchState]:
        new_p, _, tspec, new = self.step(updates, state, params)
        return (params if new_p is None else tree.unflatten(tspec, new_p)), new


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
    _check_args(optimizer, lr, hyper, who)
    core = TorchStep(optimizer, hyper, who)
    probe_lr = None
    if lr is not None:
        v = float(lr_value(lr, zero_count()))
        probe_lr = v if v > 0 else 1e-2        # a warm-up schedule may start at 0: the probe needs a real step
    t = _FromTorch(core, probe(core, probe_lr), lr, probe_lr)
    return GradientTransformation(t.init, t.update, t.apply)
