"""`remat(modules=None, policy="nothing", offload=None)`: activation checkpointing as a transform.

JAX's `jax.checkpoint` / DeepSpeed's activation checkpointing for a model that does not
checkpoint itself. Each selected module's forward runs under non-reentrant
`torch.utils.checkpoint.checkpoint`: autograd keeps the module's inputs (and, by policy,
some of its intermediates) instead of every intermediate activation, and backward re-runs
the module's forward ("recompute") to get the rest. The gradients are the ones without
remat (the same ops on the same values; RNG state, e.g. dropout, is replayed); the cost is
one more forward of each selected module per step.

- `modules`: which modules to checkpoint. None (default): the model's repeated blocks,
  found as ZeRO-3 finds its units (`dsfn.units.find_units`: a Hugging Face
  `_no_split_modules` class, else the children of the model's largest `ModuleList`; e.g.
  `blocks.0 .. blocks.N-1` of `dsfn.models.GPT`, `model.layers.*` of a HF Llama). Or
  dotted-name patterns (`fnmatch`, as zero's `units=`), e.g. `["blocks.*.mlp"]`. A module
  nested in another selected one is dropped (the outer checkpoint covers it). Modules that
  Hugging Face's own `gradient_checkpointing_enable()` already checkpoints are skipped.
- `policy`: what the checkpoint saves besides the module's inputs.
  * "nothing" (default; JAX's `nothing_saveable`): everything inside is recomputed.
  * "matmuls" or "dots" (JAX's `dots_saveable`): the outputs of matrix products are saved
    as well, so backward recomputes only the cheap elementwise ops between them: aten's
    mm, addmm, bmm, baddbmm and the fused attention kernels (scaled_dot_product_*: the
    attention's two products). This is torch's selective activation checkpointing
    (`create_selective_checkpoint_contexts` with `CheckpointPolicy.MUST_SAVE`, passed as
    the checkpoint's `context_fn`), through remat's own pair of dispatch modes
    (`dsfn.engines.remat`): torch's refuses any op in the recompute that the forward of the
    region did not run, and ZeRO-3's re-gather for the recompute runs such ops.
  * a list of aten `OpOverload`s to save, or a callable `policy(ctx, op, *args, **kwargs)`
    returning a `torch.utils.checkpoint.CheckpointPolicy` (or a bool: True = save), as
    torch's `create_selective_checkpoint_contexts` takes. The policy decides in forward
    (`ctx.is_recompute` is False).
- `offload`: None, or "cpu": the saved module inputs that require grad (the residual
  stream between blocks) are kept in host memory — pinned, copied on a side CUDA stream
  so the copy overlaps the next module's compute — and brought back to the device for the
  recompute, the next one (backward runs the modules in reverse) prefetched on the side
  stream while the current one recomputes (DeepSpeed's `cpu_checkpointing`). Inputs that
  do not require grad (masks, rotary tables: shared by every block and alive anyway) stay
  where they are. On a CPU device host memory *is* the device memory: nothing is copied
  and nothing overlaps; the bytes are still counted. With a selective policy the saved
  matmul outputs stay on the device.

Gauges (dsfn.runtime.collectives, shown by `step.explain`): "remat.modules" (modules
checkpointed in the last forward), "remat.offloaded_bytes" (module inputs held on the host
by `offload`), "remat.policy_saved_bytes" (op outputs a selective policy saved); both count
one value_and_grad so far, their peak is the `gauge_max`.

Mechanism (the machinery lives in dsfn/engines/remat.py). remat handles the "apply_module"
primitive: for the forward it replaces each selected module's `forward` (an instance
attribute, as tensor parallel installs its forwards) with one that calls
`checkpoint(original_forward, ..., use_reentrant=False, context_fn=<policy>)` — the
module's own hooks (ZeRO-3's unit gathers) stay outside the checkpoint, as with Hugging
Face's checkpointing — and keeps that installed until value_and_grad's backward is over
(`dsfn.functional.until_backward`; a checkpoint of the model's own around a remat'd module
recomputes through the wrapper, so its recompute saves what its forward saved), as every
other part of the forward's set-up is kept (the step's parameters bound to the module,
ZeRO-3's unit and recompute hooks, tensor parallel's forwards, Ulysses attention). So the
recompute runs on the step's parameters, ZeRO-3 re-gathers the unit's shards for it, and
tensor / sequence parallel re-issue their collectives. Torch-function modes active in the
forward (sequence parallel's AutoSP attention for non-HF models) are re-entered for the
recompute by `dsfn.functional`, as for a model's own checkpoint calls, since autograd's
engine does not run backward under them. A layer's KV cache (`cache`, `past_key_values`,
...) is turned off while it is checkpointed, as Hugging Face does (a recompute would
append to it again). Outside value_and_grad (no grad) nothing is wrapped.

Stack position: inside `shard_zero` / `data_parallel`, `tensor_parallel` and
`sequence_parallel` (`compose(shard_zero(3), tensor_parallel(...), remat(), ...)`): their
set-up for the forward is installed first and remat wraps what they installed, so one
order is tested and documented; anything else is a StackError naming the fix. Its place
relative to `accumulate`, `offload`, `mixed_precision`, `loss_scale`, `clip_grad_norm`,
`zenflow` does not matter (they do not touch the forward's modules). With `pipeline_parallel`
either order works (`compose(pipeline_parallel(...), remat())` is the one documented): the
pipeline keeps the checkpointed forwards installed until its step's last backward, and each
micro-batch's recompute of a stage's layers runs in that micro-batch's backward. Select the
layers or modules inside them there; a module holding the layer list the pipeline cuts (e.g.
`modules=["model"]`) is a ConfigError.

- `partition_activations` (DeepSpeed's key of that name): under `tensor_parallel`, a
  checkpointed module's saved inputs that require grad (the residual stream) are the same on
  every rank of the tp group; each rank keeps only its 1/tp of them (flattened, split in
  equal contiguous pieces, the last padded) and the recompute all-gathers them over the tp
  axis first. Saved bytes per rank fall by the tp degree for one all-gather of the input per
  recomputed module; with `offload="cpu"` the piece is what goes to host memory. The
  premise (the input is whole and equal on the tp ranks) is checked once per model, on its
  first step, by comparing the inputs' sums over the tp group (a LayoutError if a plan hands
  the blocks tp-local inputs); with tp of size 1 nothing is split. Requires tensor_parallel
  in the stack (StackError otherwise). Gauge "remat.partitioned_bytes": the pieces kept.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dsfn.engines import remat as engine
from dsfn.engines.remat import MATMUL_OPS, Chain, HostStash, Installed, TpPartition, save_rule
from dsfn.errors import ConfigError, StackError
from dsfn.functional import in_backward, until_backward
from dsfn.identity_cache import KeyedCache
from dsfn.runtime import collectives as C
from dsfn.transforms.core import Transform, make_transform, with_role
from dsfn.transforms.facts import stack_facts
from dsfn.units import find_units

__all__ = ["MATMUL_OPS", "POLICIES", "Remat", "remat"]

POLICIES = ("nothing", "matmuls", "dots")

# the roles whose set-up for the forward remat must find already installed (outside it)
_OUTSIDE_ROLES = ("sequence_parallel", "data_parallel", "tensor_parallel")


class Remat(Transform):
    name = "remat"
    roles = frozenset({"remat"})

    def __init__(self, modules: Sequence[str] | None = None, policy: Any = "nothing", offload: str | None = None,
                 partition_activations: bool = False):
        if isinstance(modules, str):
            modules = (modules,)
        if modules is not None:
            modules = tuple(modules)
            if not modules or not all(isinstance(p, str) and p for p in modules):
                raise ConfigError(f"remat(modules={modules!r}): give module-name patterns (e.g. ['blocks.*']) or "
                                  "None for the model's repeated blocks")
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise ConfigError(f"remat(policy={policy!r}): use one of {list(POLICIES)}, a list of aten "
                                  "OpOverloads to save, or a callable (ctx, op, *args, **kwargs) -> CheckpointPolicy")
        elif isinstance(policy, (list, tuple)):
            bad = [op for op in policy if not isinstance(op, torch._ops.OpOverload)]
            if bad:
                raise ConfigError(f"remat(policy=[...]): {bad[:3]} are not aten OpOverloads; write e.g. "
                                  "torch.ops.aten.mm.default (not torch.ops.aten.mm)")
            policy = tuple(policy)
        elif not callable(policy):
            raise ConfigError(f"remat(policy={policy!r}): use one of {list(POLICIES)}, a list of aten OpOverloads "
                              "or a callable")
        if offload not in (None, "cpu"):
            raise ConfigError(f"remat(offload={offload!r}): use None (saved inputs stay on the device) or 'cpu' "
                              "(kept in host memory, brought back for the recompute)")
        if not isinstance(partition_activations, bool):
            raise ConfigError(f"remat(partition_activations={partition_activations!r}): True (each tp rank keeps "
                              "1/tp of the saved inputs) or False")
        self.modules = modules
        self.policy = policy
        self.offload = offload
        self.partition_activations = partition_activations
        self._partition_checked: set[int] = set()          # id(model) whose premise was checked
        # id(model) -> (targets, skipped names), the model held alive
        self._selected = KeyedCache()
        self._last: tuple[list[str], list[str]] | None = None                             # names, skipped names

    # -- stack ---------------------------------------------------------------------------------
    def check_stack(self, stack, index):
        for role in _OUTSIDE_ROLES:
            for t in with_role(stack[index + 1:], role):
                raise StackError(f"remat must sit inside {t.name}: write compose({t.name}(...), remat(...)) — "
                                 f"{t.name} installs its part of the forward (gathers, collectives, hooks) first, "
                                 "and remat checkpoints the modules with that in place, so the recompute in backward "
                                 "re-runs it")
        if self.partition_activations:
            tp = list(with_role(stack[:index], "tensor_parallel"))
            if not tp:
                raise StackError("remat(partition_activations=True) splits the saved inputs over the tensor parallel "
                                 "group: add tensor_parallel(...) outside it (compose(tensor_parallel(...), "
                                 "remat(partition_activations=True))) or drop partition_activations")

    def facts(self) -> dict[str, Any]:
        # the module-name patterns checkpointed (None: the model's repeated blocks); a
        # pipeline refuses patterns naming a module that holds the layers it cuts
        return {"remat_modules": self.modules, "remat_policy": self.policy, "remat_offload": self.offload,
                "remat_partition_activations": self.partition_activations}

    @property
    def _tp_axis(self) -> str | None:
        """The tensor-parallel axis outside (partition_activations splits over it): a stack fact."""
        return stack_facts(self).outside(self).first("tp_axis")

    def explain_note(self) -> str:
        what = {"nothing": "only their inputs are saved (everything inside is recomputed in backward)",
                "matmuls": "their inputs and matmul/attention outputs are saved (the rest is recomputed)",
                "dots": "their inputs and matmul/attention outputs are saved (the rest is recomputed)"}
        saved = what.get(self.policy, "saved per the given policy") if isinstance(self.policy, str) \
            else "saved per the given policy"
        where = "; inputs held in host memory (offload='cpu')" if self.offload else ""
        if self.partition_activations:
            tp = self._tp_axis or "tensor-parallel"
            where += f"; each {tp} rank keeps 1/{tp} of them (partition_activations)"
        if self._last is None:
            which = (f"modules matching {list(self.modules)}" if self.modules is not None
                     else "the model's repeated blocks")
            return f"remat(policy={self._policy_name()!r}): checkpoints {which}: {saved}{where}"
        names, skipped = self._last
        shown = ", ".join(names[:3]) + (f", ... {names[-1]}" if len(names) > 3 else "")
        skip = (f"; {len(skipped)} skipped (the model checkpoints them itself: {', '.join(skipped[:2])}"
                f"{', ...' if len(skipped) > 2 else ''})" if skipped else "")
        return (f"remat(policy={self._policy_name()!r}): checkpoints {len(names)} modules ({shown}): "
                f"{saved}{where}{skip}")

    def _policy_name(self) -> str:
        return self.policy if isinstance(self.policy, str) else "custom"

    # -- forward ---------------------------------------------------------------------------------
    def handle_apply_module(self, call_next, apply_fn, params, args, kwargs):
        if not torch.is_grad_enabled():          # nothing is saved for a backward: run as it is
            return call_next(apply_fn, params, args, kwargs)
        targets, skipped = self._targets(apply_fn.module)
        self._last = ([n for n, _ in targets], skipped)
        C.gauge("remat.modules", len(targets))
        hooks = []
        if self.partition_activations:
            from dsfn.runtime.mesh import current_mesh
            if current_mesh().size(self._tp_axis) > 1:
                first = id(apply_fn.module) not in self._partition_checked
                self._partition_checked.add(id(apply_fn.module))
                hooks.append(TpPartition(self._tp_axis, check=first))
        if self.offload:
            hooks.append(HostStash())
        with until_backward(Installed(targets, save_rule(self.policy), Chain(hooks) if hooks else None)):
            return call_next(apply_fn, params, args, kwargs)

    # -- layer events: each target's call runs under a checkpoint -----------------------------------
    def handle_unit_calls_of(self, call_next, module):
        return call_next(module) + tuple(m for m, _ in engine.LIVE.values())

    def handle_run_unit(self, call_next, module, phase, value, recompute):
        hit = engine.LIVE.get(id(module)) if phase == "call" else None
        if hit is None or hit[0] is not module:
            return call_next(module, phase, value, recompute)
        forward, args, kwargs = value
        # the transforms inside see the call (and its recompute in backward, marked then) inside the checkpoint
        inner = lambda *a, **k: call_next(module, phase, (forward, a, k), in_backward())   # noqa: E731
        return hit[1].run(module, inner, args, kwargs)

    def _targets(self, model: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[str]]:
        return self._selected.get(id(model), (model,), lambda: self._select(model))

    def _select(self, model: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[str]]:
        named = list(model.named_modules())
        if self.modules is not None:
            found = [(n, m) for n, m in named if n and any(fnmatch.fnmatchcase(n, p) for p in self.modules)]
            if not found:
                raise ConfigError(f"remat(modules={list(self.modules)}) matches no module of "
                                  f"{type(model).__name__}; module names look like {[n for n, _ in named[1:6]]}")
            names = [n for n, _ in found]
            found = [(n, m) for n, m in found if not any(n != o and n.startswith(o + ".") for o in names)]
        else:
            found = find_units(model, None)
            if not found:
                raise ConfigError(f"remat(): {type(model).__name__} has no repeated blocks to checkpoint (no Hugging "
                                  "Face _no_split_modules, no nn.ModuleList); name the modules: "
                                  f"remat(modules=[...]), e.g. among {[n for n, _ in named[1:6]]}")
        # a Hugging Face layer with gradient_checkpointing_enable() on checkpoints itself
        skipped = [n for n, m in found if getattr(m, "gradient_checkpointing", False) is True]
        targets = [(n, m) for n, m in found if n not in skipped]
        return targets, skipped


def remat(*args: Any, **kwargs: Any) -> Remat:
    """`remat(modules=None, policy="nothing", offload=None)`; see the module docstring."""
    return make_transform(Remat, "remat", args, kwargs)
