"""ZeRO-3's unit lifecycle: parameters gathered just in time, unit by unit (FSDP2's
unshard / reshard / pre_forward / post_backward).

A `UnitGatherer` serves one forward of a module whose parameters are ZeRO-3 shards:

- pre_forward (`unit_pre`, the unit's "run_unit" pre event): the unit is unsharded — its shards
  all-gathered straight into the unit's kept storages (`UnitStorage`, one flat buffer per
  bucket, the weights views of it; `dsfn.runtime.flat.gather_into_buffers`) — and the next
  `prefetch` units are launched; its trainable weights enter autograd as one node
  (`GatherUnit`);
- post_forward (`unit_post`, its post event): the unit is resharded — its storages' memory freed (resized to 0),
  the tensor objects kept — and a gradient hook on its outputs is registered;
- pre_backward (`_before_backward`): the unit is gathered again into the same storages just
  before its backward, so what autograd saved sees the weights again;
- post_backward (`grads_ready`): the unit's gradients go to the sink `due` in one call, and
  the unit is resharded once its last one arrived.

Every rank issues the same gathers in the same order whatever its data reaches (a unit it
skips is gathered and dropped), forward in registration order, backward the root then the
last unit down to the first. A recompute in backward (activation checkpointing) installs
the re-gathered weights of the modules owning them directly, heard through the layer events'
"recompute_pre" / "recompute_post" (`RecomputeWatch`, `dsfn.layer_events.RecomputeEvents`).
`UnitPlan` is what does not change from step to step (slots, units, owners, order,
storages). Machinery only: it imports no transform and calls back into none; its inputs
(the plan, the shards, the axis, bucket size, prefetch depth, the gradient sink) are
passed in.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from dsfn.engines.zero.unit_plan import Gather, GatherUnit, RecomputeWatch, UnitPlan, UnitStorage  # noqa: F401
from dsfn.layer_events import ForwardEnded, recompute_hook  # noqa: F401
from dsfn.placed import Placed
from dsfn.runtime import collectives as C
from dsfn.runtime.flat import FlatGather, gather_into_buffers
from dsfn.state.layout import FlatShard

__all__ = ["Gather", "GatherUnit", "RecomputeWatch", "UnitGatherer", "UnitPlan", "UnitStorage", "recompute_hook"]


class UnitGatherer:
    """Gathers a forward's sharded parameters unit by unit (module docstring).

    Index i refers to `params`' i-th sharded entry; unit 0 is the root. The number of
    gathered units besides the root is published as the runtime gauge
    "zero3.live_units" (current and max) for tests and explain.
    """

    def __init__(self, module: nn.Module, params: dict[str, Any], plan: UnitPlan, leaves: tuple,
                 frozen: dict[str, tuple[torch.Tensor, FlatShard, Any]], axis: str, bucket_elems: int, prefetch: int,
                 due: Any = None, secondary: str | None = None, hierarchy: tuple[str, str] | None = None,
                 concurrent: bool = False, wire: Any = None):
        """`plan`: the module's UnitPlan; `leaves`: (names, FlatShards, compute devices) of the
        ZeRO shards among `params`; `frozen`: name -> (piece to gather, its FlatShard, for a
        piece held quantized (its WireFormat, the dtype it dequantizes to), else None); the
        gathers run over `axis` in buckets of `bucket_elems`, `prefetch` units ahead. `due`
        (inside value_and_grad, else None): the gradient sink — `gathers_made(keys)` as a
        unit is gathered under grad, `grads_arrived([(key, grad)])` as its gradients come.
        `secondary` (ZeRO++ hpZ): an axis of a few ranks (a node's) over which each unit
        gathered in a forward under grad keeps a secondary shard (1/size of the gathered
        unit, copied as the forward's gather is released), so backward re-gathers the unit
        over that axis alone instead of over `axis`. `concurrent` (interleaved micro-batches:
        several forwards' gatherers alive at once, their hooks kept for recomputes): a unit is
        installed for a recompute only once this gatherer's own backward re-gathered it (its
        outputs' gradient hook), so another micro-batch's forward, or its recompute, leaves
        this gatherer's hooks inert. `wire` (ZeRO++ qwZ): the gathers' quantized format
        (`dsfn.runtime.quantized.WireFormat`; hpZ's secondary shard keeps the forward's codes), None: exact."""
        self.wire = wire
        self.module, self.axis, self.bucket_elems, self.prefetch, self.due = module, axis, bucket_elems, prefetch, due
        self.secondary = secondary
        self.concurrent = concurrent
        self.hierarchy = hierarchy        # (cross, local): MiCS's two-stage gather (`hierarchical_all_gather`)
        self._secondary: dict[int, tuple[FlatGather, list[torch.Tensor]]] = {}   # unit -> (gather, pieces)
        names, layouts, homes = leaves
        # the step's shards, in plan order: trainable ones, then frozen ones (no gradients)
        self.names, self.frozen, self.index, self.slots = plan.names, plan.frozen, plan.index, plan.slots
        self.units, self.unit_params, self.unit_of = plan.units, plan.unit_params, plan.unit_of
        self._owners, self._bw_seq, self._bw_pos = plan.owners, plan.bw_seq, plan.bw_pos
        self.shards = [params[n].data for n in names] + [piece for piece, _, _ in frozen.values()]
        self.layouts = layouts + [layout for _, layout, _ in frozen.values()]
        # frozen weights held quantized: index -> (their WireFormat, the dtype they dequantize to)
        self.packed = {len(names) + k: held for k, (_, _, held) in enumerate(frozen.values()) if held is not None}
        # where each gathered weight must be (offload(params=True) keeps shards on the host)
        self.homes = homes + [piece.device for piece, _, _ in frozen.values()]
        self.call_params = {n: (v.data if isinstance(v, Placed) else v) for n, v in params.items()}
        self.view: Any = None     # the apply_fn to run the module with (ZeRO-3's `begin_forward` sets it)
        # a unit is gathered into flat buffers (`FlatGather.slabs`); its weights are views of them
        self.full_now: dict[int, torch.Tensor] = {}              # index -> gathered weight, in use
        self._pending: dict[int, FlatGather] = {}             # unit -> in-flight gather
        self._fw: dict[int, FlatGather] = {}                  # unit -> forward gather, in use
        self._bw: dict[int, tuple[FlatGather, dict[int, torch.Tensor]]] = {}   # unit -> re-gathered for backward
        self._bw_left: dict[int, set[int]] = {}               # unit -> trainable indices whose grad is due
        self._grads_done: set[int] = set()                    # indices whose gradient arrived this backward
        self._bw_pending: dict[int, FlatGather] = {}          # unit -> prefetched backward gather
        self._unit_storage = plan.storages          # each unit's, shared by every gatherer (UnitStorage)
        self._watch: RecomputeWatch | None = None     # the engine's, from `listening`
        self._watched = False
        self._live: set[int] = set()
        self._phase = "forward"                               # "backward" once the forward returned
        self._installed: dict[tuple[int, str], torch.Tensor] = {}   # recompute: slot -> what we put there
        self._fw_next = 0                                     # next unit forward launches
        self._bw_next = 0

    # -- gathering -------------------------------------------------------------------------------
    # Every rank issues the same all-gathers in the same order, whatever units its data
    # reaches (a routed expert, a skipped layer): forward launches units strictly in
    # registration order, so calling unit u first launches every earlier unit not launched
    # yet ("catch-up"; one this rank skipped is gathered and dropped), and the forward's
    # end launches the rest. Backward does the same over its fixed sequence: the root,
    # then the last unit down to the first. A unit called again after it was released
    # (re-use within one forward) is gathered again: ranks must re-use units alike.
    def _launch(self, u: int) -> None:
        if u in self._pending or u in self._live or not self.unit_params[u]:
            return
        # one bucketed all-gather per unit, into pooled buffers; async so the next unit's
        # gather overlaps compute
        self._pending[u] = self._gather_async(u)
        live = self._live
        live.add(u)
        n = len(live) - (0 in live)        # the gauge "zero3.live_units", inline (once per unit)
        _GAUGES["zero3.live_units"] = n
        if n > _GAUGE_MAX.get("zero3.live_units", -1):
            _GAUGE_MAX["zero3.live_units"] = n

    def _on_home(self, i: int) -> torch.Tensor:
        """Shard i on its compute device (a host shard is copied there non-blocking), so the
        gathered weight lands where the forward runs, under gloo and NCCL alike."""
        s = self.shards[i]
        return s if s.device == self.homes[i] else s.to(self.homes[i], non_blocking=True)

    def _launch_upto(self, u: int) -> None:
        """Launch units `_fw_next .. u` (registration order) that are not launched yet."""
        while self._fw_next <= min(u, len(self.units) - 1):
            self._launch(self._fw_next)
            self._fw_next += 1

    def _drop_skipped(self, before: int) -> None:
        """Units launched ahead of `before` that this rank never ran: wait for their gathers
        (the ranks that run them need the collective) and free them."""
        skipped = [v for v in self._pending if 0 < v < before]
        if not skipped:       # (the usual case: the gauge is unchanged)
            return
        for v in skipped:
            self._release(v, self._pending.pop(v))
            self._live.discard(v)
        _gauge_live(self._live)

    def _materialize(self, u: int) -> None:
        if u >= self._fw_next:
            self._launch_upto(u)
        elif u not in self._pending and u not in self._live:
            self._launch(u)                   # re-use after release: gathered again
        self._drop_skipped(u)
        handle = self._pending.pop(u, None)
        if handle is not None:
            for i, t in zip(self.unit_params[u], handle.wait()):
                self.full_now[i] = t
            self._fw[u] = handle

    def _release(self, u: int, handle: FlatGather) -> None:
        """A gather of unit u is no longer used (waited for first: a collective may still be
        writing): its storages' memory goes once no gather of the unit is in use. Under hpZ,
        a forward gather made for backward leaves its secondary shard first (every rank does,
        for every unit it gathered, run or skipped: backward's sequence is the same on all)."""
        if self.secondary is not None and self._phase == "forward" and self.due is not None \
                and torch.is_grad_enabled():
            handle.wait()
            pieces = handle.pieces_over(self.secondary)
            self._secondary[u] = (handle, pieces)
            _gauge_secondary(self._secondary)
        handle.release(None)
        self._unit_storage[u].done()

    def finish_forward(self) -> None:
        """The forward is over: launch the units this rank never reached, and drop them."""
        self._launch_upto(len(self.units) - 1)
        self._drop_skipped(len(self.units))

    def full(self, i: int) -> torch.Tensor:
        return self.full_now[i]

    def shard_shape(self, i: int) -> tuple[int, ...]:
        return tuple(self.shards[i].shape)

    def unit_pre(self, u: int) -> None:
        """Unit u is about to run (its "run_unit" pre event): gathered, the next `prefetch`
        launched; in backward (a recompute of the unit: activation checkpointing) its
        re-gathered weights are installed instead."""
        if self._phase == "backward":      # a recompute of the unit (activation checkpointing)
            self.install_for_recompute(self.unit_params[u])
            return
        self._materialize(u)
        self._launch_upto(u + self.prefetch)   # prefetch: overlaps this unit's compute
        ids = self.unit_params[u]
        trainable = [i for i in ids if i not in self.frozen]
        if torch.is_grad_enabled() and self.due is not None:
            names = self.names
            self.due.gathers_made([names[i] for i in trainable])
        # one autograd node for the unit's trainable weights (one Python call forward and
        # backward per unit, not per tensor); frozen weights take no part in autograd
        fulls = dict(zip(trainable, GatherUnit.apply(self, tuple(trainable),
                                                      *(self.shards[i] for i in trainable))))
        for i in ids:
            full = fulls.get(i)
            if full is None:
                full = self.full_now[i]
            for owner, attr in self.slots[i]:
                owner._parameters[attr] = full

    def unit_post(self, u: int, out: Any) -> None:
        """Unit u has run (its "run_unit" post event; `out` its output): resharded, its
        re-gather for backward armed on `out`; after a recompute its shards go back."""
        if self._phase == "backward":
            self.restore_after_recompute(self.unit_params[u])
            return
        for i in self.unit_params[u]:
            self.full_now.pop(i, None)
            for owner, attr in self.slots[i]:
                owner._parameters[attr] = self.shards[i]
        handle = self._fw.pop(u, None)
        if handle is not None:
            self._release(u, handle)
            self._before_backward(u, out)
        live = self._live
        live.discard(u)
        # the gauge "zero3.live_units" (collectives.gauge), inline: this runs once per unit
        n = len(live) - (0 in live)
        _GAUGES["zero3.live_units"] = n
        if n > _GAUGE_MAX.get("zero3.live_units", -1):
            _GAUGE_MAX["zero3.live_units"] = n

    def _before_backward(self, u: int, out: Any) -> None:
        """Re-gather unit u just before its backward: when the first gradient of its outputs
        is computed (FSDP2's pre-backward hook). Its saved weights are views of the unit's
        storages, which the re-gather fills again."""
        if not torch.is_grad_enabled():
            return
        ts = [t for t in _tensors_in(out) if t.requires_grad]
        if ts:
            torch.autograd.graph.register_multi_grad_hook(ts, lambda _g: self._needed_in_backward(u), mode="any")

    def _needed_in_backward(self, u: int) -> None:
        if u not in self._bw:
            self._gather_for_backward(u)

    def _gather_async(self, u: int) -> FlatGather:
        """Start gathering unit u into its storages (the same ones in forward and backward)."""
        ids = self.unit_params[u]
        store = self._unit_storage[u]
        shards, homes, layouts = self.shards, self.homes, self.layouts
        on_home = [shards[j] if shards[j].device == homes[j] else self._on_home(j) for j in ids]
        packed = {k: self.packed[j] for k, j in enumerate(ids) if j in self.packed} if self.packed else None
        return store.gather(lambda pool: gather_into_buffers(
            on_home, [layouts[j].shape for j in ids], self.axis, self.bucket_elems, pool, self.hierarchy, self.wire,
            packed, keep_codes=self.secondary is not None))

    def _gather_for_backward_async(self, u: int) -> FlatGather:
        """Start unit u's backward gather: from the secondary shards over the secondary axis
        (hpZ) when its forward left them, else as in forward."""
        kept = self._secondary.pop(u, None)
        if kept is None:
            return self._gather_async(u)
        _gauge_secondary(self._secondary)
        handle, pieces = kept
        return self._unit_storage[u].gather(lambda pool: handle.regather(pieces, self.secondary, pool))

    def _bw_launch_upto(self, pos: int) -> None:
        """Launch the backward sequence's units up to position `pos` not launched yet."""
        while self._bw_next <= min(pos, len(self._bw_seq) - 1):
            v = self._bw_seq[self._bw_next]
            if self.unit_params[v]:
                self._bw_pending[v] = self._gather_for_backward_async(v)
            self._bw_next += 1

    def _gather_for_backward(self, u: int) -> None:
        """Re-gather unit u for backward (after every unit before it in the backward sequence:
        the root, then the last unit down to the first), drop units this rank's backward
        passed without using, and prefetch the next ones."""
        p = self._bw_pos[u]
        if p >= self._bw_next:
            self._bw_launch_upto(p)
        handle = self._bw_pending.pop(u, None) or self._gather_for_backward_async(u)
        for v in [v for v in self._bw_pending if v != 0 and self._bw_pos[v] < p]:
            self._release(v, self._bw_pending.pop(v))     # a unit this rank skipped: its gather, dropped
        ids = self.unit_params[u]
        self._bw[u] = (handle, dict(zip(ids, handle.wait())))
        # the unit is dropped when its last trainable weight's gradient arrives (every use of
        # its weights in backward is then done); one holding frozen weights, which no
        # gradient marks done, when backward has passed it
        self._bw_left[u] = {j for j in ids if j not in self.frozen and j not in self._grads_done}
        for v in [v for v in self._bw if v not in (0, u) and self._bw_pos[v] < p and self._has_frozen(v)]:
            self._drop_bw(v)
        self._bw_launch_upto(p + self.prefetch)
        # units held for backward besides the root (gathered, or in flight): stays bounded
        C.gauge("zero3.backward_units", len((set(self._bw) | set(self._bw_pending)) - {0}))

    def _has_frozen(self, u: int) -> bool:
        return any(j in self.frozen for j in self.unit_params[u])

    def _drop_bw(self, u: int) -> None:
        handle = self._bw.pop(u)[0]          # its weights' views go with the entry
        self._bw_left.pop(u, None)
        self._release(u, handle)

    def finish_backward(self) -> None:
        """Backward is over: gather (and drop) the units this rank's backward never reached,
        so every rank has issued the whole backward sequence."""
        self._bw_launch_upto(len(self._bw_seq) - 1)
        for v in list(self._bw_pending):
            self._release(v, self._bw_pending.pop(v))
        for v in list(self._bw):
            self._drop_bw(v)
        self._grads_done.clear()
        if self._secondary:             # none is left once the whole sequence ran; never kept past it
            self._secondary.clear()
            _gauge_secondary(self._secondary)

    def grads_ready(self, pairs: list[tuple[int, torch.Tensor]]) -> None:
        """Gradients (index, grad) arrived: every use of those weights in backward is done; a
        unit's buffers go with its last one. Then they go to the reducer, in one call."""
        touched = set()
        for i, _ in pairs:
            self._grads_done.add(i)
            u = self.unit_of[i]
            left = self._bw_left.get(u)
            if left is not None:
                left.discard(i)
                touched.add(u)
        for u in touched:
            if not self._bw_left[u] and not self._has_frozen(u):
                self._drop_bw(u)
        names = self.names
        self.due.grads_arrived([(names[i], g) for i, g in pairs])

    # -- context -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def listening(self, registry: dict[int, list], watch: "RecomputeWatch"):
        """This gatherer hears its units' layer events until backward is over: `registry` (id
        of a unit module -> [(gatherer, unit index)], the engine's, read by ZeRO's "run_unit"
        handler) holds it meanwhile; from the forward's end, `watch` (the engine's) holds the
        modules owning its parameters directly, for a recompute (`_recompute_events_on`)."""
        self._watch = watch
        entries = []
        for u, m in enumerate(self.units):
            runs = registry.setdefault(id(m), [])
            runs.append((self, u))
            entries.append((id(m), runs))
        try:
            yield self
        finally:
            for u, (key, runs) in enumerate(entries):
                runs.remove((self, u))
                if not runs and registry.get(key) is runs:
                    del registry[key]
            if self._watched:
                watch.remove(self)
                self._watched = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        # a forward ended early on purpose (ForwardEnded: this rank's part of the model is done)
        # is complete: the dp ranks holding that part all end there, so no unit is left to launch for the others' sake
        ended = exc[0] is None or issubclass(exc[0], ForwardEnded)
        if exc[0] is None:
            self.finish_forward()
        # left by an exception inside the forward: waited for, their storages freed
        for u, handle in [*self._pending.items(), *self._fw.items()]:
            self._release(u, handle)
        self._pending.clear()
        self._fw.clear()
        self.full_now.clear()
        self._live.clear()
        _gauge_live(self._live)
        self._phase = "backward"
        if ended:
            self._recompute_events_on()
        return False

    # -- recompute in backward (activation checkpointing) -------------------------------------------
    def install_for_recompute(self, ids: list[int]) -> None:
        """The re-gathered weights of parameters `ids` in their modules' slots, for a recompute."""
        if self.concurrent:       # only what this gatherer's own backward has reached
            ids = [i for i in ids if self.unit_of[i] in self._bw]
        for u in sorted({self.unit_of[i] for i in ids}, key=lambda v: self._bw_pos[v]):
            if u not in self._bw:
                self._gather_for_backward(u)
        for i in ids:
            # a slot someone else filled for its own recompute (tiled compute puts in the
            # weights it saved) is left alone: only a shard is replaced
            slots = [(o, a) for o, a in self.slots[i] if o._parameters.get(a) is self.shards[i]]
            if not slots:
                continue
            # through Gather, as in the forward: the recompute must save what the forward
            # saved (autograd saves a weight only when it requires grad)
            self.full_now[i] = self._bw[self.unit_of[i]][1][i]
            full = Gather.apply(self.shards[i], self, i)
            for owner, attr in slots:
                owner._parameters[attr] = full
                self._installed[(id(owner), attr)] = full

    def restore_after_recompute(self, ids: list[int]) -> None:
        """The shards of parameters `ids` back in their slots after a recompute."""
        for i in ids:
            self.full_now.pop(i, None)
            for owner, attr in self.slots[i]:
                mine = self._installed.pop((id(owner), attr), None)
                if mine is not None and owner._parameters.get(attr) is mine:
                    owner._parameters[attr] = self.shards[i]

    def _recompute_events_on(self) -> None:
        """From the forward's end: the modules owning sharded parameters directly are watched
        for a recompute in backward (activation checkpointing: `RecomputeWatch`), which gets
        their unit's re-gathered weights around their call."""
        if self._watch is not None and not self._watched:
            self._watch.add(self, self._owners)
            self._watched = True


def _tensors_in(out: Any) -> list[torch.Tensor]:
    """The tensors of a module's output: a tensor, or (nested) tuples, lists and mappings of
    them (a Hugging Face ModelOutput is a mapping)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for x in out for t in _tensors_in(x)]
    if isinstance(out, dict):
        return [t for x in out.values() for t in _tensors_in(x)]
    return []


def _gauge_secondary(kept: dict[int, tuple[Any, list[torch.Tensor]]]) -> None:
    """hpZ's secondary shards held now, in bytes (gauge "zero3.secondary_bytes")."""
    C.gauge("zero3.secondary_bytes", sum(p.numel() * p.element_size() for _, ps in kept.values() for p in ps))


def _gauge_live(live: set[int]) -> None:
    """Gathered units other than the root (unit 0, live for the whole forward)."""
    C.gauge("zero3.live_units", len(live - {0}))


# the runtime's gauges (`collectives.gauge`'s dicts), updated inline on the per-unit path
_GAUGES, _GAUGE_MAX = C.gauges, C.gauge_max
