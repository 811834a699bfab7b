"""The shared machinery of the transforms that cut every sequence over a mesh axis:
`sequence_parallel` (Ulysses, contiguous slices) and `context_parallel` (ring attention,
head and tail chunks). One class, `SplitSequence`, holds the batch sharding, the global
positions, the token-weighted loss, a Hugging Face model's own loss and router balance over
the whole sequence, and the gradient sum over the axis; each transform's module says its
layout and its attention. Mechanism shared by those two transforms (like
`dsfn.transforms.core`): it holds no policy of either. The behaviour is documented in
`dsfn.transforms.sequence_parallel`.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import torch

from dsfn import tree
from dsfn.functional import until_backward
from dsfn.errors import ConfigError, ShapeError, StackError
from dsfn.runtime import collectives as C
from dsfn.runtime.buckets import all_reduce_buckets
from dsfn.runtime.mesh import current_mesh
from dsfn.adapters import SequenceSplit, adapter_for
from dsfn.engines.ulysses import UlyssesSDPA
from dsfn.engines.positions import PositionsWatch, passed_on, takes
from dsfn.engines.sequence_shards import pad_sequences, shift_left, slice_sequences
from dsfn.transforms.core import Transform, scratch
from dsfn.transforms.facts import stack_facts


def crossing(mesh: Any, axis: str) -> str:
    """Whether the axis's groups cross nodes (the slow links), as explain says it."""
    return "crosses nodes" if mesh.spans_nodes(axis) else "within a node"


# ---------------------------------------------------------------------------------------------
# the transform
# ---------------------------------------------------------------------------------------------

class SplitSequence(Transform):
    """The machinery of a transform that cuts every sequence over a mesh axis (see
    `dsfn.transforms.sequence_parallel`, whose defaults these are): the batch, positions,
    the token-weighted loss and a model's own loss, the gradient sum over the axis. A
    subclass says the layout (`pieces_per_rank`, `_take`) and the attention (`_sdpa_mode`,
    and a Hugging Face model's `sequence_attention`)."""
    name = "sequence_parallel"
    roles = frozenset({"sequence_parallel"})

    def __init__(self, axis: str = "sp", seq_length: int | None = None, seq_length_is_variable: bool = True,
                 seq_key: str = "input_ids", labels_key: str = "labels", shift_labels: bool = False,
                 ignore_index: int = -100, pad_token_id: int = 0, auto: bool = True,
                 require_position_ids: bool = True):
        if seq_length is not None and (not isinstance(seq_length, int) or isinstance(seq_length, bool)
                                       or seq_length < 1):
            raise ConfigError(f"sequence_parallel(seq_length={seq_length!r}): a positive int, or None")
        if not seq_length_is_variable and seq_length is None:
            raise ConfigError("sequence_parallel(seq_length_is_variable=False) needs seq_length=N (the fixed length)")
        if seq_length is not None and seq_length_is_variable:
            raise ConfigError(f"sequence_parallel(seq_length={seq_length}): the length is read only when it is fixed, "
                              "and seq_length_is_variable=True (the default) takes any length, so it would do "
                              f"nothing; write sequence_parallel(seq_length={seq_length}, "
                              "seq_length_is_variable=False) to require it, or drop seq_length")
        for key, v in (("axis", axis), ("seq_key", seq_key), ("labels_key", labels_key)):
            if not isinstance(v, str) or not v:
                raise ConfigError(f"sequence_parallel({key}={v!r}): a non-empty string")
        self.axis = axis
        self.seq_length = seq_length
        self.seq_length_is_variable = bool(seq_length_is_variable)
        self.seq_key = seq_key
        self.labels_key = labels_key
        self.shift_labels = bool(shift_labels)
        self.ignore_index = int(ignore_index)
        self.pad_token_id = int(pad_token_id)
        self.auto = bool(auto)
        self.require_position_ids = bool(require_position_ids)
        self.bucket_mb = 25
        # this step's notes live in the Step's scratch (`_notes`): the batch's positions and
        # lengths, its padding, the labels _weigh patched, the HF losses normalised, the watches
        self._manual_ok: set[int] = set()      # id(module) found not to be a HF model (auto=False)

    # 2-D (`context_parallel` outside `sequence_parallel`): the inner splitter's attention wraps
    # the outer's (Ulysses' all-to-all, then the ring over the outer axis), so only a transform
    # whose attention is wrapped may sit right outside one that wraps
    wraps_outer_attention = False       # Ulysses: True (its attention calls the one installed before it)
    wrapped_by_inner = False            # ring attention: True (it takes the whole outer-local sequence)

    def facts(self) -> dict[str, Any]:
        # "sequence_axis": a splitter outside or inside another shares the loss and the padding
        # (2-D: the whole sequence is cut over both axes; see `_outer_axes` / `_inner_axes`)
        return {"sequence_axis": self.axis, "sequence_wrapped_by_inner": self.wrapped_by_inner,
                "sequence_labels_key": self.labels_key}

    def check_stack(self, stack, index):
        outside = [t for t in stack[:index] if "checkpoint" not in t.roles]
        splitters = [i for i, t in enumerate(stack[:index]) if "sequence_axis" in t.facts()]
        if self.wraps_outer_attention and len(splitters) == 1 and outside and outside[-1] is stack[splitters[0]] \
                and stack[splitters[0]].facts().get("sequence_wrapped_by_inner") \
                and all("checkpoint" in t.roles for t in stack[:splitters[0]]):
            return      # 2-D: right inside a ring (context_parallel), itself outermost
        if outside:
            two_d = (" or right inside an outermost context_parallel (2-D)" if self.wraps_outer_attention else "")
            other = [t for t in outside if "sequence_axis" not in t.facts()] or outside
            front = "".join(f"{stack[i].name}(), " for i in splitters if self.wraps_outer_attention)
            raise StackError(f"{self.name} must be the outermost transform (async_checkpoint may sit outside){two_d}; "
                             f"{other[0].name} is outside it: write compose({front}{self.name}(), "
                             f"{other[0].name}(...), ...)")

    @property
    def _outer_axes(self) -> tuple[str, ...]:
        """The sequence axes of a splitter outside this one (2-D: context_parallel's cp outside
        Ulysses): this rank's tokens are a slice of that one's, the loss is weighed over both."""
        return stack_facts(self).outside(self).all("sequence_axis")

    @property
    def _inner_axes(self) -> tuple[str, ...]:
        """The sequence axes of a splitter inside this one (2-D): it weighs the loss over both
        and cuts this one's slice again, so this one pads to a multiple of its pieces too."""
        return stack_facts(self).inside(self).all("sequence_axis")

    @property
    def _dp_axes(self) -> tuple[str, ...]:
        """The axes inside that split the batch and average over it (stack facts): data
        parallel's "dp_axis", and a "batch_axis" (expert parallel's ep, whose ranks see other rows)."""
        inside = stack_facts(self).inside(self)
        return inside.all("dp_axis") + tuple(a for a in inside.all("batch_axis") if a not in inside.all("dp_axis"))

    def explain_note(self) -> str:
        mesh = current_mesh()
        outer = "".join(f"; 2-D: inside the ring over {a!r} ({crossing(mesh, a)})" for a in self._outer_axes)
        return (f"sequence_parallel over {self.axis!r} (size {mesh.size(self.axis)}, {crossing(mesh, self.axis)}): "
                f"Ulysses all-to-all{outer}")

    def _notes(self) -> SimpleNamespace:
        """This step's notes (the Step's scratch, `dsfn.effects.scratch`), with their defaults:
        `positions` (global positions of this rank's tokens, [1, T/sp]), `arange` (the ones
        shard_batch made: consecutive, no documents), `batch_shifted` (the batch holds
        whole-sequence shift_labels), `local_len` / `real_len` (this rank's slice length; the
        sequence length before padding to sp), `padded` / `right_padded` (the attention_mask
        has zeros; only at the ends of rows), `unpatched` (id(label patched by _weigh) ->
        (label, original)), `in_grad` (depth inside handle_value_and_grad), `hf_losses` (HF
        model losses the adapter normalised), `watches` (id(inner model) -> PositionsWatch)."""
        notes = scratch(self)
        if not hasattr(notes, "in_grad"):
            notes.__dict__.update(positions=None, arange=None, batch_shifted=False, local_len=None, real_len=None,
                                  padded=False, right_padded=True, unpatched={}, in_grad=0, hf_losses=0, watches={},
                                  index=None, pre_split_len=None, shifted={})
        return notes

    # -- the batch ------------------------------------------------------------------------------
    @property
    def loss_labels_key(self) -> str:
        # 2-D, inside: the splitter outside shifted the labels over the whole sequence
        shifted = self.shift_labels or (self._outer_axes and self._notes().batch_shifted)
        return "shift_labels" if shifted else self.labels_key

    def shard_batch(self, batch: Any) -> Any:
        """This rank's slice of every sequence-shaped tensor (see the module docstring)."""
        if not isinstance(batch, dict) or self.seq_key not in batch:
            raise ShapeError(f"{self.name}: the batch must be a dict with {self.seq_key!r} "
                             f"[batch, seq]; got {type(batch).__name__}"
                             + (f" with keys {sorted(batch)}" if isinstance(batch, dict) else ""))
        ids = batch[self.seq_key]
        if ids.dim() != 2:
            raise ShapeError(f"sequence_parallel: batch[{self.seq_key!r}] must be [batch, seq]; got {tuple(ids.shape)}")
        b, t = ids.shape
        for key, x in batch.items():
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] != t:
                raise ShapeError(f"sequence_parallel: batch[{key!r}] has shape {tuple(x.shape)}, whose sequence "
                                 f"length (dim 1) {x.shape[1]} differs from batch[{self.seq_key!r}]'s "
                                 f"{tuple(ids.shape)}; every sequence-shaped tensor must have the same length")
        if self.seq_length is not None and not self.seq_length_is_variable and t != self.seq_length:
            raise ShapeError(f"sequence_parallel(seq_length={self.seq_length}, seq_length_is_variable=False): got a "
                             f"batch of length {t}; pad or cut batches to {self.seq_length}, or use "
                             "seq_length_is_variable=True")
        mask = batch.get("attention_mask")
        # padding anywhere (left, right, holes): the model's padding mask is applied inside Ulysses
        # attention over the whole sequence. Decided on the whole batch, so every rank agrees
        # (the mask's slices are all-gathered only then)
        self._notes().padded = isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.bool().all())
        if self._outer_axes and isinstance(mask, torch.Tensor):
            # 2-D, inside: this rank's part of the batch is one of the outer splitter's; every rank
            # must agree (the attention outside gathers the mask over its axis only when it has one)
            flag = torch.tensor([float(self._notes().padded)])
            for ax in self._outer_axes:
                flag = C.all_reduce(flag, ax, "max")
            self._notes().padded = bool(flag.item())
        # right padding (1...1 0...0) is exact even without the mask: no real token sees a pad key
        self._notes().right_padded = not self._notes().padded or bool((mask[:, 1:] <= mask[:, :-1]).all())
        batch = self._with_shift_labels(batch)
        n = current_mesh().size(self.axis)
        self._notes().real_len = t          # before padding: labels the model is given are cut there
        pieces = self.pieces_per_rank * n
        for ax in self._inner_axes:         # 2-D: the splitter inside cuts each rank's part again
            pieces *= current_mesh().size(ax)
        if t % pieces:
            if not self.seq_length_is_variable:
                raise ShapeError(f"{self.name}: the fixed seq_length {t} is not divisible by {pieces} "
                                 f"({self.axis}={n} x {self.pieces_per_rank} chunks"
                                 + "".join(f" x {a}={current_mesh().size(a)}" for a in self._inner_axes)
                                 + "); choose a seq_length that is a multiple of it, or seq_length_is_variable=True "
                                 "(padded)")
            batch = pad_sequences(batch, t, -(-t // pieces) * pieces, seq_key=self.seq_key,
                                  ignore_index=self.ignore_index,
                                  # labels that are the input ids themselves pad as tokens (their
                                  # targets, shift_labels, are made before and pad as ignored)
                                  labels_keys=tuple(k for k in (self.labels_key, "shift_labels") if k != self.seq_key),
                                  pad_token_id=self.pad_token_id)
            t = batch[self.seq_key].shape[1]
        self._notes().batch_shifted = isinstance(batch.get("shift_labels"), torch.Tensor)
        self._notes().local_len = t // n
        self._notes().pre_split_len = t
        out = self._take(batch, t, n, current_mesh().local_rank(self.axis), ids.device)
        if self._outer_axes and not self._notes().shifted:
            # 2-D, inside: the outer splitter's chunks are not contiguous, so a model's own loss is
            # scored against the batch's whole-sequence shift_labels (made by the outer one from
            # its labels key), as this rank's slice holds them
            key = stack_facts(self).outside(self).first("sequence_labels_key", self.labels_key)
            labels = out.get(key)
            if isinstance(labels, torch.Tensor) and isinstance(out.get("shift_labels"), torch.Tensor):
                self._notes().shifted = {id(labels): (labels, out["shift_labels"])}
        return out

    # the layout: rank r's contiguous slice [r*c, (r+1)*c) (context parallel: a head and a tail chunk)
    pieces_per_rank = 1
    contiguous = True

    def _take(self, batch: dict, t: int, n: int, r: int, device: Any) -> dict:
        c = t // n
        # global positions of this rank's tokens, [1, T/sp] (broadcast over rows, which ZeRO may
        # split further); a batch's own position_ids are taken from the batch the loss sees
        self._notes().positions = torch.arange(r * c, (r + 1) * c, device=device)[None]
        self._notes().arange = self._notes().positions      # known consecutive: Ulysses attention needs no all-gather of them
        self._notes().index = self._notes().positions[0]
        return slice_sequences(batch, r, c)

    def _with_shift_labels(self, batch: dict) -> dict:
        """A copy of `batch`, with "shift_labels" (each row's labels one to the left, the last
        target ignored) under `shift_labels=True`; at sp = 1 too, so a step that reads
        batch["shift_labels"] runs unchanged in one process."""
        batch = dict(batch)
        if self.shift_labels:
            if self.labels_key not in batch:
                raise ShapeError(f"sequence_parallel(shift_labels=True): the batch has no {self.labels_key!r}")
            batch["shift_labels"] = shift_left(batch[self.labels_key], self.ignore_index)
        return batch

    def wrap_step(self, fn):
        def step(state, batch):
            if current_mesh().size(self.axis) == 1:
                if self.shift_labels and isinstance(batch, dict):
                    batch = self._with_shift_labels(batch)
                return fn(state, batch)
            return fn(state, self.shard_batch(batch))
        return step

    # -- loss and gradients ---------------------------------------------------------------------
    def handle_value_and_grad(self, call_next, fn, params, args, kwargs, has_aux):
        if current_mesh().size(self.axis) == 1:
            return call_next(fn, params, args, kwargs, has_aux)
        if self._inner_axes:
            # 2-D, outside: the splitter inside weighs the loss over both axes; this one sums
            return self._summed(call_next(fn, params, args, kwargs, has_aux), has_aux)
        args, kwargs, weight = self._weigh(args, kwargs)

        def weighted(p, *a, **k):
            before = self._notes().hf_losses
            out = fn(p, *a, **k)
            value, aux = out if has_aux else (out, None)
            if self._notes().hf_losses > before:
                # the model's own loss, already sum / (the group's count): the sp sum is the mean
                w = 1.0
            elif weight is None:
                raise ConfigError(f"sequence_parallel: the differentiated function's batch argument has no "
                                  f"{self.loss_labels_key!r}; the loss is weighted by each rank's count of valid "
                                  f"labels (set labels_key=...), or use a Hugging Face model's own loss (labels=)")
            else:
                w = weight.to(value.dtype)
            value = value * w
            return (value, aux) if has_aux else value
        self._notes().in_grad += 1
        try:
            value, grads = call_next(weighted, params, args, kwargs, has_aux)
        finally:
            self._notes().in_grad -= 1
            if not self._notes().in_grad:
                self._notes().unpatched = {}
        return self._summed((value, grads), has_aux)

    def _summed(self, value_grads: tuple, has_aux: bool) -> tuple:
        """The value and gradients summed over the axis (the ranks' weighted parts add up to the group's)."""
        value, grads = value_grads
        aux = None
        if has_aux:
            value, aux = value
        value = C.all_reduce(value.reshape(1), self.axis, "sum").reshape(())
        # bucketed: few, large all-reduces
        leaves, spec = tree.flatten(grads)
        facts = stack_facts(self)        # (in the stack's wire dtype)
        return ((value, aux) if has_aux else value), tree.unflatten(
            spec, all_reduce_buckets(leaves, self.axis, self.bucket_mb * 2**20, "sum", facts.grad_wire_dtype,
                                     facts.grads_keep_dtype))

    def _weigh(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, torch.Tensor | None]:
        """The local loss's weight n_rank / n_group, from the labels in the step's batch (the
        first dict argument holding `loss_labels_key`); a rank without valid labels gets one
        made valid and weight 0. None when the batch has no such labels (then the loss must
        be a Hugging Face model's own, see `_split`)."""
        key = self.loss_labels_key
        args, kwargs = list(args), dict(kwargs)
        slots = [(args, i) for i in range(len(args))] + [(kwargs, k) for k in kwargs]
        found = next(((box, i) for box, i in slots
                      if isinstance(box[i], dict) and isinstance(box[i].get(key), torch.Tensor)), None)
        if found is None:
            batch = next((box[i] for box, i in slots if isinstance(box[i], dict)), {})
            if isinstance(batch.get("position_ids"), torch.Tensor):
                self._notes().positions = batch["position_ids"]
            return tuple(args), kwargs, None
        box, i = found
        batch = box[i]
        if isinstance(batch.get("position_ids"), torch.Tensor):
            self._notes().positions = batch["position_ids"]
        labels = batch[key]
        valid = labels != self.ignore_index
        n_local = valid.sum().to(torch.float64)
        n_group = n_local.reshape(1)
        for ax in (self.axis, *self._outer_axes):       # 2-D: the whole sequence is over both
            n_group = C.all_reduce(n_group, ax, "sum")
        n_group = n_group.reshape(())
        if int(n_group) == 0:
            raise ShapeError(f"sequence_parallel: no valid label in the whole batch ({key!r} is all "
                             f"{self.ignore_index}); the token-weighted loss is undefined")
        weight = n_local / n_group
        if int(n_local) == 0:      # keep the local mean finite: one valid label, weight 0
            original = labels
            labels = labels.clone()
            labels.reshape(-1)[0] = 0
            box[i] = {**batch, key: labels}
            self._notes().unpatched[id(labels)] = (labels, original)    # a HF model's own loss sees the original
        return tuple(args), kwargs, weight.float()

    # -- a model's own loss (the adapter's: dsfn.integrations.hf.sequence_loss) ---------------------
    def _split(self) -> SequenceSplit:
        """What a model's own loss needs to know of this step's split (a plain record)."""
        return SequenceSplit(axis=self.axis, dp_axes=tuple(self._dp_axes), local_len=self._notes().local_len,
                             real_len=self._notes().real_len, batch_shifted=self._notes().batch_shifted, in_grad=bool(self._notes().in_grad),
                             originals=self._notes().unpatched, normalised=self._normalised,
                             shifted=self._shifted_labels(), sum_axes=self._outer_axes)

    def _shifted_labels(self) -> Any:
        """The labels this rank's loss is scored against, for layouts whose slices are not
        contiguous (context parallel; a slice of its chunks in 2-D): id(labels) -> (labels,
        their whole-sequence shift). None for contiguous slices (a model's own loss shifts its
        labels over the neighbours)."""
        return self._notes().shifted if (not self.contiguous or self._outer_axes) else None

    def _normalised(self) -> None:
        """The adapter made a model's own loss the group's token mean (its sp weight is 1)."""
        self._notes().hf_losses += 1

    # -- attention and positions ----------------------------------------------------------------
    def handle_apply_module(self, call_next, apply_fn, params, args, kwargs):
        if not self.auto:
            self._check_manual(apply_fn.module)
        if current_mesh().size(self.axis) == 1:
            return call_next(apply_fn, params, args, kwargs)
        module = apply_fn.module
        via = []        # inner models that get position_ids through the forward's **kwargs (peft)
        given = kwargs.get("position_ids")
        if self._outer_axes and isinstance(given, torch.Tensor) and given.shape[-1] == self._notes().pre_split_len:
            # 2-D, inside: the outer splitter's positions of its tokens, cut as this one cut the tokens
            kwargs = {**kwargs, "position_ids": given.index_select(-1, self._notes().index.to(given.device))}
        if "position_ids" not in kwargs:
            if not takes(module, "position_ids"):
                via = passed_on(module, "position_ids")
            if takes(module, "position_ids") or via:
                kwargs = {**kwargs, "position_ids": self._notes().positions}
            elif self.require_position_ids:
                raise ConfigError(f"sequence_parallel: {type(module).__name__}.forward takes no position_ids, so it "
                                  "would number this rank's tokens from 0 instead of by their place in the sequence. "
                                  "Give the forward a position_ids argument, or pass require_position_ids=False if "
                                  "the model uses no positions (or gets them another way)")
        adapter = adapter_for(module)        # a Hugging Face model's loss, router and attention rules
        if adapter is not None:
            valid = self._notes().index < self._notes().real_len       # this rank's positions that are tokens
            # 2-D: the splitter inside makes the model's loss and router balance those of the whole
            # sequence (over both axes); this one only cuts and attends
            inner = bool(self._inner_axes)
            with (contextlib.nullcontext() if inner else adapter.own_loss(module, self._split(), args, kwargs)), \
                    (contextlib.nullcontext() if inner else adapter.global_router_balance(
                        module, [self.axis, *self._outer_axes], list(self._dp_axes), valid)), \
                    self._watching(module, via, kwargs.get("position_ids")):
                with until_backward(self._hf_attention(adapter, module)):      # recomputes alike
                    return call_next(apply_fn, params, args, kwargs)
        if not self._notes().right_padded:
            raise ShapeError(f"sequence_parallel: the batch's attention_mask has left padding or holes, and "
                             f"{type(module).__name__} is not a Hugging Face model, whose padding mask dsfn applies "
                             "inside Ulysses attention; AutoSP / ulysses_sdpa attention is causal over the whole "
                             "sequence with no mask. Right-pad (1...1 0...0) or pack such rows")
        if not self.auto:       # the model calls ulysses_sdpa itself
            return call_next(apply_fn, params, args, kwargs)
        mode = self._sdpa_mode()
        with until_backward(mode):
            out = call_next(apply_fn, params, args, kwargs)
        if not mode.calls and not mode.inert:
            # attention computed another way would see only this rank's tokens: silently wrong
            raise ConfigError(f"{self.name}: {type(module).__name__}'s forward made no causal "
                              "scaled_dot_product_attention call, so dsfn found no attention to run over "
                              f"{self.axis!r}; attention computed another way would see only this rank's tokens. "
                              "Compute attention with torch.nn.functional.scaled_dot_product_attention(q, k, v, "
                              "is_causal=True), use a Hugging Face model"
                              + (", or call ulysses_sdpa yourself with sequence_parallel(auto=False)"
                                 if self.wraps_outer_attention else ""))
        return out

    def _hf_attention(self, adapter: Any, module: Any) -> Any:
        """A Hugging Face model's attention over the axis (Ulysses: `dsfn_ulysses`)."""
        return adapter.sequence_attention(module, self.axis, self._notes().arange, padded=self._notes().padded)

    def _sdpa_mode(self) -> Any:
        """The mode that runs a non-HF model's causal sdpa calls over the axis (AutoSP: Ulysses)."""
        return UlyssesSDPA(self.axis)


    @contextlib.contextmanager
    def _watching(self, module: Any, inner: list, positions: Any):
        """While `module`'s forward runs: whether the position_ids reach one of `inner` (PositionsWatch)."""
        if not inner:
            yield
            return
        watch = PositionsWatch(module, inner, positions)
        for m in inner:
            self._notes().watches[id(m)] = watch
        try:
            yield
        finally:
            for m in inner:
                if self._notes().watches.get(id(m)) is watch:
                    del self._notes().watches[id(m)]
        watch.check()

    # -- layer events: the inner models a **kwargs forward passes position_ids on to -------------
    def handle_units_of(self, call_next, module):
        return call_next(module) + tuple(m for watch in self._notes().watches.values() for m in watch.inner)

    def handle_run_unit(self, call_next, module, phase, value, recompute):
        if phase == "pre" and self._notes().watches:
            watch = self._notes().watches.get(id(module))
            if watch is not None:
                watch.hear(value[1])
        return call_next(module, phase, value, recompute)

    def _check_manual(self, module: Any) -> None:
        """`auto=False` leaves a non-HF model's attention to its own `ulysses_sdpa` calls; a
        Hugging Face model's attention is always Ulysses (dsfn_ulysses), so there it would do
        nothing: a ConfigError (at any sp, so a one-process run finds it too)."""
        if id(module) in self._manual_ok:
            return
        if adapter_for(module) is not None:         # a Hugging Face model (its adapter runs its attention)
            raise ConfigError(f"sequence_parallel(auto=False): {type(module).__name__} is a Hugging Face model, whose "
                              "attention dsfn always runs as Ulysses through its attention interface "
                              "(dsfn_ulysses), so auto=False would do nothing; drop auto=False (it is for models "
                              "that call ulysses_sdpa themselves)")
        self._manual_ok.add(id(module))
