"""Bugs injected on purpose, to show the tests that claim to catch them do (the repository's
test machinery, like the rest of `conformance`: not part of the installed dsfn).

A *mutation* patches one function of dsfn (unittest.mock: nothing is written to the
library) so that training is wrong in one known way. `tests/conformance/test_mutations.py`
(`-m slow`) and `benchmarks/mutations.py` (the table) check, for each, that

- every row of the conformance matrix it affects fails (`rows(name)`: the affected stacks,
  each with an SGD-momentum, an AdamW and a Muon row where the mutation affects them), and
- the default selection fails: the default conformance run (`tests/conformance`) or the
  test file that owns the feature (`Mutation.owner`).

Where a mutation applies:

- in this process: `with active("name"): ...` installs it and sets `DSFN_MUTATION`, so rank
  processes see it whatever their start method (forked ranks inherit the patch; spawned
  ones, and a pytest run started as a subprocess, install it from the variable);
- in a whole pytest run: `DSFN_MUTATION=name pytest ...` (`tests/conftest.py` calls
  `activate_from_env()`), and `dsfn.testing.ranks.run_on_ranks` installs it at the start of
  every rank it runs.

A mutation with `ranks_only` changes a function that the single-process references use too
(the optimizer update, `apply_gradients`); it misbehaves only where a process group is
initialised (a rank), so a reference stays right and the stack's rows must differ from it.

To add one (a new transform adds its own): a `Mutation` in `MUTATIONS` with the patch,
`affects(case)` (which matrix rows must fail, and why the others cannot) and `owner`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable, Iterator
from unittest import mock

import torch

from dsfn.errors import ConfigError
from dsfn.testing import ranks

ENV = "DSFN_MUTATION"

__all__ = ["ENV", "MUTATIONS", "Mutation", "activate_from_env", "active", "rows"]


def in_rank() -> bool:
    """True in a rank (a process group is initialised: `run_on_ranks` starts one even at world 1)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    bug: str                                   # the injected bug, in words
    patch: Callable[[], contextlib.AbstractContextManager]
    affects: Callable[[Any], bool]             # (conformance Case) -> this row must fail
    owner: tuple[str, ...]                     # the test files that own the feature
    ranks_only: bool = False


# ------------------------------------------------------------------------------------------
# the patches


def _reducer_sums():
    from dsfn.runtime import flat
    orig = flat.ShardReducer.__init__

    def init(self, axis, bucket_elems, op="avg", *args, **kwargs):
        orig(self, axis, bucket_elems, "sum" if op == "avg" else op, *args, **kwargs)
    return mock.patch.object(flat.ShardReducer, "__init__", init)


def _hybrid_no_cross():
    from dsfn.runtime import flat
    return mock.patch.object(flat.ShardReducer, "_reduce_across", lambda self: None)


def _pipeline_drops_microbatch():
    """The last stage's loss of micro-batch 0 is multiplied by 0: its gradient (and its part
    of the loss) never reaches the parameters."""
    from dsfn.engines.pipeline import runner as pipeline_runner
    orig = pipeline_runner.run_rank

    def run_rank(actions, n_stages, links, forward, *args, **kwargs):
        def dropping(stage, mb, h_in):
            out = forward(stage, mb, h_in)
            return out * 0 if stage == n_stages - 1 and mb == 0 else out
        return orig(actions, n_stages, links, dropping, *args, **kwargs)
    return mock.patch.object(pipeline_runner, "run_rank", run_rank)


def _update(transform: Callable[[Any, Any], Any]):
    """base.step with its new params passed through `transform(old, new)` in a rank."""
    from dsfn import tree
    from dsfn.optim import base
    orig = base.step

    def step(tx, grads, state, params):
        new_params, new_state = orig(tx, grads, state, params)
        if not in_rank():
            return new_params, new_state
        return transform((params, state), (new_params, new_state), tree)
    return mock.patch.object(base, "step", step)


def _no_update():
    return _update(lambda old, new, tree: old)


def _last_stage_skips_update():
    """On the pipeline's last stage the update is not applied: its parameters (and optimizer
    state) stay as they were while the other stages step — the stages out of step."""
    def skip(old, new, tree):
        from dsfn.runtime.mesh import current_mesh
        mesh = current_mesh()
        if "pp" in mesh.axes and mesh.size("pp") > 1 and mesh.local_rank("pp") == mesh.size("pp") - 1:
            return old
        return new
    return _update(skip)


def _update_scaled():
    def scaled(old, new, tree):
        def mix(p, q):
            return p + 0.75 * (q - p) if isinstance(q, torch.Tensor) and q.is_floating_point() else q
        return tree.map(mix, old[0], new[0]), new[1]
    return _update(scaled)


def _zero_grads():
    from dsfn import tree
    from dsfn.state import train_state
    orig = train_state.TrainState.apply_gradients

    def apply_gradients(self, grads):
        if in_rank():
            grads = tree.map(lambda g: torch.zeros_like(g) if isinstance(g, torch.Tensor) else g, grads)
        return orig(self, grads)
    return mock.patch.object(train_state.TrainState, "apply_gradients", apply_gradients)


def _ckpt_drops_moments():
    """Loading fills every optimizer moment (a >= 1-dim floating leaf of opt_state, master
    weights aside) with zeros: a resumed run restarts its momentum / Adam moments."""
    from dsfn.checkpoint import reader
    orig = reader.assemble

    def assemble(leaf, desc, region, shape, dtype, rd):
        buf = orig(leaf, desc, region, shape, dtype, rd)
        if leaf.startswith("opt_state.") and ".master" not in leaf and len(shape) >= 1 and dtype.is_floating_point:
            return torch.zeros_like(buf)
        return buf
    return mock.patch.object(reader, "assemble", assemble)


def _host_adamw_no_wd():
    from dsfn.ops import cpu_adam
    orig = cpu_adam.cpu_adamw_multi_

    def multi(*args, **kwargs):
        kwargs["weight_decay"] = 0.0
        return orig(*args, **kwargs)
    return mock.patch.object(cpu_adam, "cpu_adamw_multi_", multi)


def _whole_batch():
    from dsfn.engines import data_parallel       # the replicas' machinery, under data_parallel and shard_zero
    return mock.patch.object(data_parallel, "split_batch", lambda batch, axis: batch)


def _ep_wrong_expert():
    """Expert parallel sends every assignment to the next expert (index + 1 mod E)."""
    from dsfn.engines import expert_dispatch
    orig = expert_dispatch.ExpertDispatch.run

    def run(self, module, forward, hidden, index, weights, *args, **kwargs):
        return orig(self, module, forward, hidden, (index + 1) % self.experts, weights, *args, **kwargs)
    return mock.patch.object(expert_dispatch.ExpertDispatch, "run", run)


def _ep_expert_grad_sum():
    """The experts' gradients left the sum over the ep ranks' tokens (the return exchange's
    backward not scaled by 1/ep), not the mean over the expert-data-parallel tokens."""
    from dsfn.engines import expert_dispatch
    orig = expert_dispatch._Exchange.apply
    return mock.patch.object(expert_dispatch._Exchange, "apply",
                             lambda x, send, recv, axis, scale: orig(x, send, recv, axis, 1.0))


def _ep_replicas_not_averaged():
    """The non-expert gradients not averaged over ep (the "batch_axis" mean skipped)."""
    from dsfn.engines import data_parallel
    return mock.patch.object(data_parallel.Replicas, "mean_over_batch_axes", lambda self, grads, axes, facts: grads)


def _qwz_local_scales():
    """qwZ's gathered codes dequantized with this rank's own scales (the scales not gathered)."""
    from dsfn.runtime import quantized as Q
    orig = Q._Dequantizing.wait

    def wait(self):
        if self._works is not None:
            for w in self._works:
                if w is not None:
                    w.wait()
            self._works = [None]
            self._scales = self._inputs[1].repeat(self._n)
        return orig(self)
    return mock.patch.object(Q._Dequantizing, "wait", wait)


def _qgz_unscaled():
    """qgZ's received codes read without their scales (every scale taken as 1)."""
    from dsfn.runtime import quantized as Q
    orig = Q._dequantize_rows
    return mock.patch.object(Q, "_dequantize_rows",
                             lambda codes, scales, w, wire: orig(codes, torch.ones_like(scales), w, wire))


def _cp_skips_block():
    """Ring attention leaves out the last visible chunk pair of every K/V block that has two or more."""
    from dsfn.engines import ring_attention
    orig = ring_attention._pairs

    def pairs(mask, cq, ck):
        out = list(orig(mask, cq, ck))
        return out[:-1] if len(out) > 1 else out
    return mock.patch.object(ring_attention, "_pairs", pairs)


def _cp_labels_contiguous():
    """Context parallel takes the tokens in head and tail chunks but the labels (and their shift)
    in contiguous slices: the head-tail layout undone on the labels only."""
    from dsfn.transforms.context_parallel import ContextParallel
    orig = ContextParallel._take

    def take(self, batch, t, n, r, device):
        out = orig(self, batch, t, n, r, device)
        c = t // n
        for key in (self.labels_key, "shift_labels"):
            if isinstance(batch.get(key), torch.Tensor) and key != self.seq_key:
                out[key] = batch[key][:, r * c:(r + 1) * c].contiguous()
        labels, shifted = out.get(self.labels_key), out.get("shift_labels")
        if isinstance(labels, torch.Tensor) and isinstance(shifted, torch.Tensor):
            self._notes().shifted = {id(labels): (labels, shifted)}     # a model's own loss scores these
        return out
    return mock.patch.object(ContextParallel, "_take", take)


# ------------------------------------------------------------------------------------------
# which rows each must fail


def _K():
    import conformance as K
    return K


def _dp(case) -> int:
    return _K().STACKS[case.stack].axes(case.world).get("dp", 1)


def _scale_blind(case) -> bool:
    """Every update is normalised by a clip below the gradient norm: a gradient scaled by
    any factor gives the same update (the rows that check the norm, not the scale)."""
    K = _K()
    return K.STACKS[case.stack].clipped or K.OPTIMIZERS[case.optimizer].clipped


def _uses_host_adamw(case) -> bool:
    return "offload" in case.stack and "remat_offload" not in case.stack and \
        case.optimizer in ("adamw", "clip+adamw", "muon")


def _ep_row(case) -> bool:
    return "ep" in case.stack.split("+")


# a rank given the whole batch computes the same mean loss and gradient as the reference
# (averaged over dp: the same again), unless what it computes depends on its own rows:
# BatchNorm's batch statistics. (Hugging Face's token-count loss is normalised by the
# all-reduced count times dp, so it is blind to this too: measured.)
_SPLIT_SEEN = ("batchnorm",)

MUTATIONS: dict[str, Mutation] = {m.name: m for m in [
    # (ZeRO-1's reducer too: stages >= 1 reduce-scatter the gradients into the optimizer's shards)
    Mutation("reducer_sums", "ZeRO's gradient reducer sums instead of averaging", _reducer_sums,
             lambda c: any(z in c.stack for z in ("zero1", "zero2", "zero3", "hsdp")) and _dp(c) > 1
             and not _scale_blind(c), ("tests/transforms/test_zero.py",)),
    # each shard group's gradients averaged over its own ranks' rows only: the groups' updates
    # differ from the whole batch's (and from each other), whatever the optimizer
    Mutation("hybrid_no_cross", "hybrid sharding reduces inside the shard group only (the all-reduce across "
             "groups forgotten)", _hybrid_no_cross, lambda c: "hsdp" in c.stack,
             ("tests/transforms/test_zero_hybrid.py",)),
    Mutation("pipeline_drops_microbatch", "the pipeline drops one micro-batch's gradient (and loss)",
             _pipeline_drops_microbatch, lambda c: _K().pipelined(c.stack), ("tests/transforms/test_pipeline_parallel.py",)),
    Mutation("pipeline_stage_out_of_step", "the pipeline's last stage skips its update (the stages out of step)",
             _last_stage_skips_update, lambda c: _K().pipelined(c.stack),
             ("tests/transforms/test_pipeline_parallel.py",), ranks_only=True),
    Mutation("no_update", "the optimizer update switched off in the ranks", _no_update, lambda c: True,
             ("tests/transforms/test_data_parallel.py",), ranks_only=True),
    Mutation("zero_grads", "all gradients zeroed (in the ranks)", _zero_grads, lambda c: True,
             ("tests/transforms/test_data_parallel.py",), ranks_only=True),
    Mutation("ckpt_drops_moments", "checkpoint load drops the optimizer moments", _ckpt_drops_moments,
             lambda c: _K().STACKS[c.stack].resume, ("tests/checkpoint/test_resume.py",)),
    Mutation("host_adamw_no_wd", "host AdamW ignores weight decay", _host_adamw_no_wd, _uses_host_adamw,
             ("tests/ops/test_cpu_adam.py", "tests/transforms/test_offload.py")),
    Mutation("whole_batch", "every rank trains on the whole global batch", _whole_batch,
             lambda c: _dp(c) > 1 and c.model in _SPLIT_SEEN, ("tests/transforms/test_data_parallel.py",)),
    Mutation("update_scaled", "the update scaled by 0.75 (in the ranks)", _update_scaled, lambda c: True,
             ("tests/transforms/test_data_parallel.py",), ranks_only=True),
    # expert parallel: every row of an ep stack (the models without experts refuse it)
    Mutation("ep_wrong_expert", "expert parallel sends each token to the wrong expert", _ep_wrong_expert,
             _ep_row, ("tests/transforms/test_expert_parallel.py",)),
    Mutation("ep_expert_grad_sum", "the experts' gradients summed over the ep ranks' tokens, not averaged",
             _ep_expert_grad_sum, lambda c: _ep_row(c) and not _scale_blind(c),
             ("tests/transforms/test_expert_parallel.py",)),
    Mutation("ep_replicas_not_averaged", "the non-expert gradients not averaged over ep", _ep_replicas_not_averaged,
             _ep_row, ("tests/transforms/test_expert_parallel.py",)),
    # ZeRO++: qwZ quantizes the tensors of >= 64 elements (the sequence models'), qgZ every 2-D gradient
    Mutation("qwz_local_scales", "qwZ's weights dequantized with the rank's own scales, not the gathered ones",
             _qwz_local_scales, lambda c: "qwz" in c.stack.split("+") and _K().MODELS[c.model].attention,
             ("tests/runtime/test_quantized_gather.py",)),
    Mutation("qgz_unscaled", "qgZ's gradient codes read without their scales", _qgz_unscaled,
             lambda c: "qgz" in c.stack.split("+"), ("tests/runtime/test_quantized_reduce.py",)),
    # context parallel: every cp row (the models without a token sequence refuse it)
    Mutation("cp_skips_block", "ring attention skips a K/V block", _cp_skips_block,
             lambda c: "cp" in c.stack.split("+"), ("tests/engines/test_ring_attention.py",)),
    Mutation("cp_labels_contiguous", "context parallel's head-tail layout undone on the labels only",
             _cp_labels_contiguous, lambda c: "cp" in c.stack.split("+"),
             ("tests/transforms/test_context_parallel.py",)),
]}


# ------------------------------------------------------------------------------------------
# installing them

_installed: dict[str, contextlib.ExitStack] = {}


def _get(name: str) -> Mutation:
    if name not in MUTATIONS:
        raise ConfigError(f"{ENV}: no mutation {name!r}; known: {', '.join(MUTATIONS)}")
    return MUTATIONS[name]


def _install(name: str) -> None:
    if name in _installed:
        return
    stack = contextlib.ExitStack()
    stack.enter_context(_get(name).patch())
    _installed[name] = stack


def activate_from_env() -> list[str]:
    """Install the mutations named in `DSFN_MUTATION` (comma-separated) for the rest of this
    process (each once; a forked child inherits its parent's). Returns the names."""
    names = [n for n in os.environ.get(ENV, "").split(",") if n]
    for n in names:
        _install(n)
    return names


@contextlib.contextmanager
def active(name: str) -> Iterator[Mutation]:
    """Install mutation `name` here, and name it in `DSFN_MUTATION` for the ranks, until exit."""
    m = _get(name)
    if name in _installed:
        yield m
        return
    old = os.environ.get(ENV)
    os.environ[ENV] = ",".join([x for x in (old or "").split(",") if x] + [name])
    try:
        with m.patch():
            _installed[name] = contextlib.ExitStack()       # a forked rank must not install it again
            try:
                yield m
            finally:
                _installed.pop(name, None)
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


# ------------------------------------------------------------------------------------------
# the rows a mutation must fail


ROW_OPTIMIZERS = ("sgd", "adamw", "muon")


def rows(name: str, all_rows: bool = False) -> list:
    """The matrix rows mutation `name` must fail. By default one row per (affected stack,
    optimizer in ROW_OPTIMIZERS, or the clipped ones where only those are affected), at the
    stack's full world (every axis > 1; 2 where only world >= 2 is affected), the model
    cycling over those the stack runs and the mutation affects. `all_rows`: every affected
    runnable row of the whole matrix."""
    K = _K()
    m = _get(name)
    affected = [c for c in K.cases() if K.refusal(c.stack, c.optimizer, c.model) is None and m.affects(c)]
    if all_rows:
        return affected
    out, turn = [], 0
    for stack, sspec in K.STACKS.items():
        mine = [c for c in affected if c.stack == stack and c.world == sspec.full_world()]
        opts = [o for o in ROW_OPTIMIZERS if any(c.optimizer == o for c in mine)] or \
            sorted({c.optimizer for c in mine}, key=list(K.OPTIMIZERS).index)
        for o in opts:
            models = [c.model for c in mine if c.optimizer == o]
            out.append(K.Case(stack, o, models[turn % len(models)], sspec.full_world()))
            turn += 1
    return out


# every rank `run_on_ranks` starts installs the mutations named in DSFN_MUTATION first
ranks.at_rank_start(activate_from_env)
