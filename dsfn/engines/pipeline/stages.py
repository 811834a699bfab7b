"""A model cut into pipeline stages, and one stage's forward run inside the user's own step.

The model's repeated blocks (`dsfn.units.find_units` of the classes a model declares in
`_no_split_modules`: a Hugging Face decoder's layers, dsfn GPT's blocks — or the ModuleList
named by `layers=`, whose blocks must run one after the other, each on the previous one's
output) are cut into S stages of consecutive
layers (`plan_stages`: even, the first stages taking one more when S does not divide them,
or the counts given by `split=`). A parameter belongs to the stage of its layer; the
modules registered before the layer list (embeddings) belong to the first stage, those
after it (final norm, head) to the last; a parameter held by several modules (a tied
embedding and head) belongs to every stage that uses it.

`running_stage(plan, s, h_in)` runs stage s inside an ordinary forward of the whole model
— the user's loss function calling apply_fn, unchanged — by steering it with hooks that
are installed at forward time (after the parameters were put into the module):

- a stage after the first: the modules before the layers that hold parameters return zeros
  shaped like the received activation `h_in` instead of running (their weights live on
  the first stage); the layers before the stage are skipped (the layer list is cut for
  the call); the stage's first layer gets `h_in` as its hidden states;
- a stage before the last: its last layer's output (the activation to send on) is raised
  as `StopForward(h)`: the rest of the model and the user's loss do not run.

The last stage runs to the end, so the user's loss function computes the loss there.

The stand-ins and the cut list last one forward; the hooks on the layers (`StageHooks`) last a
whole step, steered by `StageHooks.running(stage, h_in, recompute)`, so that activation
checkpointing's recomputes in backward (several micro-batches outstanding at once) see their
own micro-batch's `h_in` and never raise StopForward (the class docstring).
Imports no transform.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any
from dataclasses import dataclass, field

import torch
from torch import nn

from dsfn.engines.remat import is_checkpointed
from dsfn.errors import ConfigError
from dsfn.functional import ForwardEnded
from dsfn.units import find_units

__all__ = ["StageHooks", "StagePlan", "StopForward", "layer_holders", "plan_stages", "running_stage", "stage_bounds"]


class StopForward(ForwardEnded):
    """Raised by a stage before the last, when its last layer is done: `value` is the
    activation to send to the next stage (a tensor)."""

    def __init__(self, value: torch.Tensor):
        super().__init__("pipeline stage done")
        self.value = value


@dataclass
class StagePlan:
    """`layers` (the ModuleList at `layers_path` in `parent`, attribute `attr`) cut into stages
    `bounds[s] = (start, stop)`; `param_stages[name]` the stages using parameter `name`;
    `before` the (parent, attribute) of each module before the layers holding parameters;
    `root` the model cut."""

    layers_path: str
    parent: nn.Module
    attr: str
    layers: tuple[nn.Module, ...]
    bounds: list[tuple[int, int]]
    param_stages: dict[str, tuple[int, ...]]
    before: list[tuple[nn.Module, str]] = field(default_factory=list)
    root: nn.Module | None = None

    @property
    def n_stages(self) -> int:
        return len(self.bounds)

    def describe(self) -> str:
        return ", ".join(f"stage {s}: layers {a}-{b - 1}" for s, (a, b) in enumerate(self.bounds))


def _layer_list(module: nn.Module, layers: str | None) -> tuple[str, nn.ModuleList]:
    if layers is not None:
        try:
            found = module.get_submodule(layers)
        except AttributeError:
            found = None
        if not isinstance(found, nn.ModuleList):
            raise ConfigError(f"pipeline_parallel(layers={layers!r}): that is not a ModuleList of the model; name the "
                              "list of its repeated blocks, e.g. layers='model.layers'")
        return layers, found
    # only blocks a model declares (Hugging Face's and dsfn GPT's _no_split_modules): any
    # other ModuleList may hold branches (experts) rather than a sequence of layers
    declared = any(getattr(m, "_no_split_modules", None) for m in module.modules())
    units = find_units(module, None) if declared else []
    parents = {name.rsplit(".", 1)[0] for name, _ in units if "." in name}
    if len(parents) == 1:
        path = parents.pop()
        found = module.get_submodule(path)
        if isinstance(found, nn.ModuleList):
            return path, found
    raise ConfigError(f"pipeline_parallel: cannot find the layers of {type(module).__name__} to cut into stages "
                      "(it declares no repeated blocks, _no_split_modules as Hugging Face models do, held in one "
                      "ModuleList); pass the ModuleList of blocks that run one after the other: "
                      "pipeline_parallel(..., layers='path.to.ModuleList'), e.g. layers='model.layers'")


def layer_holders(module: nn.Module, layers: str | None = None) -> tuple[str, list[str]]:
    """The path of the layer list `plan_stages` would cut, and the names of the modules holding
    it (each prefix of the path, the model itself as "", and the list)."""
    path, _ = _layer_list(module, layers)
    parts = path.split(".")
    return path, [".".join(parts[:i]) for i in range(len(parts) + 1)]


def stage_bounds(n_layers: int, n_stages: int, split: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """[start, end) layer indices of each of `n_stages` stages: `split` layer counts, or as even
    as integers allow (the first stages one layer more)."""
    if split is None:
        if n_layers < n_stages:
            raise ConfigError(f"pipeline_parallel: the model has {n_layers} layers, fewer than the {n_stages} stages "
                              "asked (pp size x virtual stages); use fewer stages or a deeper model")
        base, extra = divmod(n_layers, n_stages)
        counts = [base + (1 if s < extra else 0) for s in range(n_stages)]
    else:
        counts = list(split)
        if len(counts) != n_stages or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts) \
                or sum(counts) != n_layers:
            raise ConfigError(f"pipeline_parallel(split={list(split)}): give {n_stages} layer counts (one per stage, "
                              f"each >= 1) summing to the model's {n_layers} layers")
    bounds, at = [], 0
    for c in counts:
        bounds.append((at, at + c))
        at += c
    return bounds


def plan_stages(module: nn.Module, param_names: Sequence[str], n_stages: int, split: Sequence[int] | None = None,
                layers: str | None = None) -> StagePlan:
    """Cut `module` into `n_stages` stages (module docstring)."""
    path, layer_list = _layer_list(module, layers)
    bounds = stage_bounds(len(layer_list), n_stages, split)
    stage_of_layer = {k: s for s, (a, b) in enumerate(bounds) for k in range(a, b)}
    order = {name: k for k, (name, _) in enumerate(module.named_modules())}
    at = order[path]
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    by_name = dict(module.named_parameters(remove_duplicate=False))
    before_mods: dict[str, nn.Module] = {}
    param_stages: dict[str, tuple[int, ...]] = {}
    prefix = path + "."
    for name in param_names:
        stages = set()
        for alias in aliases.get(id(by_name[name]), [name]):
            owner = alias.rsplit(".", 1)[0] if "." in alias else ""
            if alias.startswith(prefix):
                stages.add(stage_of_layer[int(alias[len(prefix):].split(".", 1)[0])])
            elif order.get(owner, -1) < at:
                stages.add(0)
                before_mods[owner] = module.get_submodule(owner)
            else:
                stages.add(n_stages - 1)
        param_stages[name] = tuple(sorted(stages))
    parent_path, attr = path.rsplit(".", 1) if "." in path else ("", path)
    before = []
    for owner in before_mods:
        ppath, a = owner.rsplit(".", 1) if "." in owner else ("", owner)
        before.append((module.get_submodule(ppath), a))
    return StagePlan(path, module.get_submodule(parent_path), attr, tuple(layer_list), bounds, param_stages, before,
                     module)


class _LikeReceived(nn.Module):
    """Stands in for a module before the layers on a later stage: zeros shaped like the
    received activation (what it computes is overwritten at the stage's first layer)."""

    def __init__(self, like: torch.Tensor):
        super().__init__()
        self.like = like

    def forward(self, *args, **kwargs):
        return torch.zeros_like(self.like)


def in_checkpoint() -> bool:
    """Whether the code running now is inside a non-reentrant `torch.utils.checkpoint` region
    (its saved-tensor hooks are the innermost ones): what it saves is recomputed in backward.
    Reads torch's private hook stack; False where that is not available."""
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, RuntimeError, TypeError):
        return False
    return bool(hooks) and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", "")


class StageHooks:
    """What steers a plan's layers for one training step, as verbs of the layer events
    (the "run_unit" primitive, `dsfn.layer_events.UnitEvents`): `before(module, args, kwargs)`
    as a unit is about to run, `after(module, out)` once it has run, for the modules of
    `units()` (the layers, the layer list's parent and the parents of the modules before it).
    Steered by `running(stage, h_in, recompute)`, which says which stage runs and on which
    received activation.

    They are heard from a step's first forward to the end of its last backward, because a
    recompute in backward (activation checkpointing) re-runs a layer's forward: through the
    layer's events when the checkpoint wraps the layer's `__call__` (a model's own loop calling
    `checkpoint(layer, h)`, Hugging Face before transformers 5), past them when it wraps
    `forward` (`remat`, Hugging Face 5: the checkpoint then saved the input they gave it).
    While `running` is not set they do nothing; while it names another stage, neither do they
    (a rank holds several stages under interleaved / ZBV). Per layer:

    - the first layer of a stage s > 0 takes `h_in` as its hidden states — in a recompute the
      `h_in` of the micro-batch whose backward runs (the runner says which), so each of the
      micro-batches outstanding at once (1F1B holds up to p) recomputes from its own input;
    - the last layer of a stage before the last raises `StopForward(h)` in a forward, and
      returns its output in a recompute (the checkpoint needs the recomputed values); the
      transforms outside the pipeline in the stack heard the layer's post event first
      (ZeRO-3 released its weights and armed their re-gather for backward);
    - every layer: a layer of another stage running is a ConfigError (a checkpoint around the
      whole layer loop recomputes every layer, the stage's cut gone)."""

    def __init__(self, plan: StagePlan):
        self.plan = plan
        self.active: tuple[int, torch.Tensor | None, bool] | None = None     # (stage, h_in, recompute)
        # a layer of the stage ran inside a checkpoint in a forward (a model's own
        # `checkpoint(layer, h)`): its backward will recompute it; the caller reads and resets it
        self.saw_checkpoint = False
        self._stage_of = {k: s for s, (a, b) in enumerate(plan.bounds) for k in range(a, b)}
        self._layer = {id(m): k for k, m in enumerate(plan.layers)}
        self._first_of = {plan.bounds[s][0]: s for s in range(1, plan.n_stages)}
        self._stop_at: int | None = None            # the layer whose output ends this forward
        self._on_forward: dict[int, Any] = {}       # id(parent) -> this forward's cut (`running_stage`)

    def units(self) -> list[nn.Module]:
        """The modules whose layer events these verbs read: the layers, then the layer list's
        parent and the parents of the modules before it (a forward's cut is made there)."""
        parents = [self.plan.parent] + [p for p, _ in self.plan.before]
        return list(self.plan.layers) + parents

    @contextlib.contextmanager
    def running(self, stage: int, h_in: torch.Tensor | None, recompute: bool = False) -> Iterator[None]:
        """Stage `stage` runs (its forward, or its backward's recomputes when `recompute`) on `h_in`."""
        prev = self.active, self._stop_at
        self.active = (stage, h_in, recompute)
        start, stop = self.plan.bounds[stage]
        self._stop_at = stop - 1 if not recompute and stage < self.plan.n_stages - 1 else None
        try:
            yield
        finally:
            self.active, self._stop_at = prev

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """`module` is about to run: new (args, kwargs) for a stage's first layer (it takes the
        received activation), else None; the cut of this forward made at a parent."""
        cut = self._on_forward.get(id(module))
        if cut is not None:
            cut(module)
        k = self._layer.get(id(module))
        if k is None:
            return None
        active = self.active
        if active is not None and not active[2] and not self.saw_checkpoint and in_checkpoint():
            self.saw_checkpoint = True
        if active is not None and self._stage_of[k] != active[0]:
            what = "a recompute in backward" if active[2] else "the forward"
            raise ConfigError(f"pipeline_parallel: layer {k} of {self.plan.layers_path} (stage "
                              f"{self._stage_of[k]}) ran in {what} of stage {active[0]}: the model runs its "
                              "layers other than one after the other from the list (a checkpoint around the "
                              "whole layer loop, or a layer called outside it). Checkpoint the layers one by "
                              "one (remat() or model.gradient_checkpointing_enable()), or name the list of "
                              "blocks run in sequence: pipeline_parallel(..., layers='path.to.ModuleList')")
        if active is None or self._first_of.get(k) != active[0]:
            return None
        h_in = active[1]
        if args:
            return (h_in,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": h_in}

    def after(self, module: nn.Module, out: Any) -> None:
        """`module` has run: the last layer of a forward's stage before the last raises
        `StopForward` with the activation to send on (a recompute returns its output)."""
        k = self._layer.get(id(module))
        if k is None or k != self._stop_at:
            return
        h = out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, (tuple, list)) else None
        if not isinstance(h, torch.Tensor):
            raise ConfigError(f"pipeline_parallel: layer {k} of {self.plan.layers_path} returned "
                              f"{type(out).__name__}, not a tensor (or a tuple starting with one): the activation "
                              "to send to the next stage cannot be found")
        raise StopForward(h)

    def close(self) -> None:
        """The step is over: nothing runs any more."""
        self.active, self._stop_at, self._on_forward = None, None, {}


@contextlib.contextmanager
def running_stage(plan: StagePlan, stage: int, h_in: torch.Tensor | None, hooks: StageHooks) -> Iterator[None]:
    """Make the model's next forward run stage `stage` only (module docstring). `h_in`: the
    activation received from the previous stage (None on the first). `hooks`: the step's
    `StageHooks` of `plan`, whose verbs the layer events of the step call (kept for the
    recomputes in backward)."""
    start, stop = plan.bounds[stage]
    swaps: list[tuple[nn.Module, str, nn.Module]] = []

    def swap(parent: nn.Module, attr: str, new: nn.Module) -> None:
        swaps.append((parent, attr, parent._modules[attr]))
        parent._modules[attr] = new

    # at forward time (the parameters are in place by then): stand-ins and the cut layer list
    parents: dict[int, tuple[nn.Module, list]] = {}
    if stage > 0:
        for parent, attr in plan.before:
            parents.setdefault(id(parent), (parent, []))[1].append(("before", attr))
    parents.setdefault(id(plan.parent), (plan.parent, []))[1].append(("layers", plan.attr))

    def on_forward(todo):
        def cut(mod):
            _refuse_checkpointed_holders(plan)
            for kind, attr in todo:
                if any(p is mod and a == attr for p, a, _ in swaps):
                    continue
                if kind == "before":
                    swap(mod, attr, _LikeReceived(h_in))
                else:
                    swap(mod, attr, nn.ModuleList(plan.layers[start:stop]))
        return cut
    prev = hooks._on_forward
    hooks._on_forward = {key: on_forward(todo) for key, (_, todo) in parents.items()}
    try:
        with hooks.running(stage, h_in):
            yield
    finally:
        hooks._on_forward = prev
        for parent, attr, original in reversed(swaps):
            parent._modules[attr] = original


def _refuse_checkpointed_holders(plan: StagePlan) -> None:
    """A module holding the layer list whose forward remat checkpoints would recompute every
    layer in backward, without the stage's cut: a ConfigError naming the fix."""
    if plan.root is None:
        return
    parts = plan.layers_path.split(".")
    for i in range(len(parts) + 1):
        path = ".".join(parts[:i])
        if is_checkpointed(plan.root.get_submodule(path)):      # (pipeline_parallel's check_stack, first)
            raise ConfigError(f"pipeline_parallel with remat: remat checkpoints {path or 'the model'!r}, which holds "
                              f"the layers {plan.layers_path} cut into stages; its recompute in backward would run "
                              "every layer. Checkpoint the layers or modules inside them: remat() (the model's "
                              f"repeated blocks) or remat(modules=['{plan.layers_path}.*'])")
