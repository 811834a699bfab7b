"""The transform protocol and the primitive dispatcher (effect handlers).

`train_step` calls a handful of dsfn *primitives* for the things a transform may want to
change. Each primitive has a default meaning (what a single process does); while a
`Step` runs, its transforms are *active* and may handle primitives:

| primitive          | arguments                                  | default                      |
|--------------------|--------------------------------------------|------------------------------|
| "value_and_grad"   | (fn, params, args, kwargs, has_aux)        | autograd on one process      |
| "apply_gradients"  | (state, grads)                             | optimizer update, step += 1  |
| "reduce_metrics"   | (metrics: dict[str, 0-dim tensor])         | identity                     |
| "apply_module"     | (apply_fn, params, args, kwargs)           | the module's forward         |
| "init_optimizer"   | (placed state with opt_state unset)        | `tx.init(state.params)`      |
| "sync_buffers"     | (buffers: dict name -> tensor)             | as they are (end of a step)  |
| "reduce_leaves"    | (partials, pending axes per leaf, op)      | LayoutError if any axis left |
| "map_whole"        | (fn, pieces)                               | fn on whole tensors          |
| "grad_bucket_ready"| ([(key, reduced gradient shard), ...])     | nothing (a reducer's sink)   |
| "grad_unscale"     | ()                                         | None (nothing left to undo)  |
| "micro_batch"      | (event: dsfn.layer_events.MicroBatch)        | nothing (an announcement)    |
| "run_unit"         | (module, phase, value, recompute)          | the value as it is           |
| "units_of"         | (module)                                   | () (no unit wants events)    |
| "unit_calls_of"    | (module)                                   | () (no forward is wrapped)   |

"reduce_leaves" and "map_whole" are how code inside the step (an optimizer, a mask, a user's function) asks
for a value of the *whole* (`dsfn.logical`): the transforms owning a leaf's mesh axes
(ZeRO and data parallel: dp; tensor parallel: tp) answer for that axis. "grad_bucket_ready"
is how a reducer's buckets reach another transform: ZeRO binds it as each bucket of
reduced shards completes (when a transform inside publishes `hears_grad_buckets`), and
offload's overlapped host update handles it. "grad_unscale" is the factor the gradients handed
to "apply_gradients" still carry (a loss scale left for an inner clip to fold into its multiply):
loss_scale answers it, clip_grad_norm asks. "micro_batch" announces that micro-batch j's forward
or backward begins: accumulate and the pipeline bind it, ZeRO hears from it whether the
micro-batches interleave (its rounds of gradient buckets are then backwards, not forwards).
"run_unit" is a layer event: one installer (`dsfn.layer_events.UnitEvents`, owned by the Step for
the whole step) hooks each unit that a transform names through "units_of", and binds it as the
unit is about to run (phase "pre", value `(args, kwargs)`) and has run ("post", value its
output), `recompute` True inside backward; a module named through "unit_calls_of" has its
forward call go down the chain too (phase "call", value `(forward, args, kwargs)`, the chain
returns the output: tensor parallel's collectives around the local matmul, remat's checkpoint,
compile_units' compiled forward); a recompute in backward of the modules owning ZeRO-3's shards
directly comes as "recompute_pre" / "recompute_post" (`dsfn.layer_events.RecomputeEvents`). Handlers run in stack order, so ZeRO-3's gather and
release come before an inner pipeline stage's steering and stop, whatever the registration order.

A transform handles primitive P by defining `handle_P(self, call_next, *args)`; it may
change the arguments, call `call_next(*args)` (the transforms further in, and finally
the default), and change the result. Dispatch starts at the outermost transform and
moves inwards, like middleware: the outermost transform sees the physical state it laid
out (e.g. ZeRO's flat shards) and hands the next one a more logical view, down to the
default that does the single-process work. Transforms that do not define `handle_P`
are skipped, so a new transform is a new handler, never a new branch here.

Besides handlers, a transform may change the state's layout (`place`: logical ->
physical; the generic `gather` of layouts inverts it) and wrap the whole step
(`wrap_step`: batch slicing, step-boundary hooks).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, ClassVar, Sequence

from dsfn.effects import activate, active_stack, bind, scratch  # noqa: F401  (the mechanism lives in dsfn.effects)
from dsfn.errors import ConfigError
from dsfn.transforms.compose import Step


class Transform:
    """Base class of every transform.

    Subclasses set `name`, take their options in `__init__` (keyword arguments are
    validated by `make_transform`), and override what they need:
    - `check_stack(stack, index)`: raise StackError if the stack cannot work;
    - `place(state)`: logical state -> this rank's physical state (run innermost first);
    - `place_after`: a second placement pass, after every transform's `place` (None: none);
    - `gather(state)`: undo structural changes of `place` after the layouts on the
      leaves were gathered (run outermost first);
    - `unplaced(state)`: say what shows `place` never ran on a state (see its docstring);
    - `wrap_step(fn)`: a step function around `fn` (same signature);
    - `handle_<primitive>(call_next, *args)`: see the module docstring;
    - `speculative_grad(state)`: see its docstring (offload's overlapped host update);
    - `explain_note()`: this transform's line in `Step.explain` (default: `describe()`).
    `unique = True` (the default) forbids two transforms of the same class in a stack.
    Every hook a Step or the stack facts call is declared here with a default that means
    "nothing" (`dsfn.transforms.compose.HOOKS`), so callers call it, never probe for it.
    """

    name: ClassVar[str] = "transform"
    unique: ClassVar[bool] = True
    # what the transform is, for other transforms' stack rules (`with_role`): e.g.
    # "data_parallel", "zero", "mixed_precision", "loss_scale", "clip", "accumulate",
    # "offload", "zenflow", "checkpoint". Rules name roles, not classes, so transform
    # modules never import each other to check a stack.
    roles: ClassVar[frozenset[str]] = frozenset()

    def check_stack(self, stack: Sequence["Transform"], index: int) -> None:
        """Raise StackError when this transform cannot work at `stack[index]`. Reads the
        stack's roles and facts only; never writes to a transform (this one included): what a
        handler needs of its neighbours it reads from `dsfn.transforms.facts.stack_facts`."""

    def facts(self) -> dict[str, Any]:
        """Plain facts this transform publishes to the others in its stack (an axis name, a
        dtype, a stage: values fixed by its options; see dsfn.transforms.facts)."""
        return {}

    def place(self, state: Any) -> Any:
        return state

    place_after: Callable[[Any], Any] | None = None
    """None (the default: nothing to do), or a method `place_after(state) -> state` that runs
    after every transform's `place`, outermost last (`Step.place`, `Step.init_state`): layouts
    that wrap the finished ones (offload moves the placed pieces to host memory or NVMe
    files). A transform that has one makes `init_state` build the pieces in host memory."""

    def gather(self, state: Any) -> Any:
        return state

    def unplaced(self, state: Any) -> str | None:
        """What in `state` shows that this transform's `place` never ran on it (a phrase for
        the error, e.g. "parameter 'w' is a whole tensor, not this rank's ZeRO-3 shard"), or
        None when it is placed or there is nothing to tell by. A structural look, no
        collectives; a Step refuses a state for which any transform answers."""
        return None

    def wrap_step(self, fn: Callable[[Any, Any], tuple[Any, dict]]) -> Callable[[Any, Any], tuple[Any, dict]]:
        return fn

    def speculative_grad(self, state: Any) -> Callable[[Any], Any] | None:
        """What this transform's `apply_gradients` handler does to each gradient shard before
        the optimizer sees it, as a pure per-tensor function known at the *start* of the step
        (`state` is the step's input state); None when that cannot be known before the step
        ends (e.g. clipping needs the global norm). `offload(overlap=True)` speculates a
        parameter's host update from `f(shard)` of every transform inside it, in stack order,
        and only when none returns None. The default, None, is the safe answer; a transform
        that leaves gradients alone returns the identity."""
        return None

    def explain_note(self) -> str:
        """This transform's line in `Step.explain()`'s stack (what it does here, e.g. the axis
        size it shards over). The default is `describe()`: its name and options."""
        return self.describe()

    def describe(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{self.name}({opts})"

    def __repr__(self) -> str:
        return self.describe()

    def __call__(self, fn: Callable) -> Step:
        """`t(f)`: a Step with `t` outermost; `t(Step)` prepends `t` to its stack."""
        return Step(fn, (self,))      # Step(a_step, stack) prepends stack to a_step's


def with_role(stack: Sequence[Transform], role: str) -> list[Transform]:
    """The transforms of `stack` (in order) that declare `role` in their `roles`."""
    return [t for t in stack if role in t.roles]


def map_rest_inside(call_next: Any, fn: Any, pieces: Sequence[Any], rest: Sequence[int], out: list) -> list:
    """A "map_whole" handler's leaves it does not own (`rest`: indices into `pieces`) handed to
    the transforms inside in one call, `fn` still called with each leaf's own index; their
    results written into `out` (the handler's list, its own leaves already mapped)."""
    if rest:
        rest = list(rest)
        for k, r in zip(rest, call_next(lambda j, w: fn(rest[j], w), [pieces[k] for k in rest])):
            out[k] = r
    return out


def make_transform(cls: type[Transform], factory_name: str, args: tuple, kwargs: dict) -> Transform:
    """Build `cls(*args, **kwargs)`, turning a bad signature into an actionable ConfigError."""
    sig = inspect.signature(cls.__init__)
    params = [p for p in sig.parameters.values() if p.name != "self"]
    names = [p.name for p in params]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)   # e.g. options passed through
    unknown = [] if takes_any else [k for k in kwargs if k not in names]
    if unknown:
        raise ConfigError(f"{factory_name}() got unknown argument(s) {unknown}; valid arguments: {names}")
    try:
        sig.bind(None, *args, **kwargs)
    except TypeError as e:
        raise ConfigError(f"{factory_name}(): {e}; signature: {factory_name}{_public_sig(sig)}") from None
    return cls(*args, **kwargs)


def _public_sig(sig: inspect.Signature) -> str:
    return str(sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "self"]))
