"""ZeRO-3's unit pieces that `dsfn.engines.zero.units.UnitGatherer` drives: the autograd
nodes of a gather (`Gather`: one parameter; `GatherUnit`: a unit's parameters as one node;
their backward hands the gradients to the gatherer), `UnitPlan` (what does not change from
step to step: slots, units, owners, backward's order, storages),, `UnitStorage` (a unit's
gather buffers, kept across steps) and `RecomputeWatch` (the modules a recompute in backward
re-installs weights for, heard through the layer events).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsfn.identity_cache import IdentityCache
from dsfn.layer_events import recompute_events_for
from dsfn.units import find_units

__all__ = ["Gather", "GatherUnit", "RecomputeWatch", "UnitPlan", "UnitStorage"]


class Gather(torch.autograd.Function):
    """shard -> full parameter (gathered by the UnitGatherer); backward queues the full
    gradient for reduce-scatter and returns a zero-stride zero for the shard."""

    @staticmethod
    def forward(ctx, shard, gatherer, index):
        ctx.gatherer, ctx.index, ctx.shard_device = gatherer, index, shard.device
        return gatherer.full(index)

    @staticmethod
    def backward(ctx, grad):
        ctx.gatherer.grads_ready([(ctx.index, grad)])
        # autograd wants the input's device: an offloaded shard lives on the host while its
        # gathered weight (and so `grad`) is on the compute device
        stand_in = torch.zeros((), dtype=grad.dtype, device=ctx.shard_device)
        return stand_in.expand(ctx.gatherer.shard_shape(ctx.index)), None, None


class GatherUnit(torch.autograd.Function):
    """A unit's shards -> its full trainable parameters (gathered by the UnitGatherer), as
    one autograd node; backward hands every arrived gradient to the gatherer (which queues
    it for reduce-scatter) and returns zero-stride zeros for the shards."""

    @staticmethod
    def forward(ctx, gatherer, ids, *shards):
        ctx.gatherer, ctx.ids = gatherer, ids
        ctx.homes = [s.device for s in shards]
        ctx.shapes = [s.shape for s in shards]
        ctx.set_materialize_grads(False)        # an unused weight's gradient stays None
        full = gatherer.full_now
        return tuple([full[i] for i in ids])

    @staticmethod
    def backward(ctx, *grads):
        arrived, out = [], []
        for i, grad, home, shape in zip(ctx.ids, grads, ctx.homes, ctx.shapes):
            if grad is None:            # not reached by this loss: the reducer gets zeros at the end
                out.append(None)
                continue
            arrived.append((i, grad))
            # autograd wants the input's device: an offloaded shard lives on the host while its
            # gathered weight (and so `grad`) is on the compute device
            out.append(torch.zeros((), dtype=grad.dtype, device=home).expand(shape))
        if arrived:
            ctx.gatherer.grads_ready(arrived)     # the unit's gradients, in one call
        return (None, None, *out)


class UnitPlan:
    """What a UnitGatherer needs to know about a module and its sharded parameters that does
    not change from step to step (computed once per module and parameter names, cached by
    ZeRO-3's engine): index i = the i-th name (trainable shards, then frozen ones); each index's
    (owner module, attribute) slots (tied aliases too); the units (unit 0: the root) and
    the indices each holds; the modules owning sharded parameters directly (for a
    recompute); backward's gather order; each unit's gather storages (`storages`: unit ->
    UnitStorage, shared by every gatherer of this module)."""

    def __init__(self, module: nn.Module, names: tuple[str, ...], frozen: tuple[str, ...], units: Any):
        self.names = list(names) + list(frozen)
        self.frozen = set(range(len(names), len(self.names)))
        self.index = {n: i for i, n in enumerate(self.names)}
        # every (owner module, attribute) slot through which a parameter is reached (tied ones too)
        by_obj: dict[int, list[str]] = {}
        for full_name, p in module.named_parameters(remove_duplicate=False):
            by_obj.setdefault(id(p), []).append(full_name)
        canonical = {n: aliases for aliases in by_obj.values() for n in aliases[:1]}
        self.slots: list[list[tuple[nn.Module, str]]] = []
        for n in self.names:
            slots = []
            for alias in canonical.get(n, [n]):
                owner_name, _, attr = alias.rpartition(".")
                slots.append((module.get_submodule(owner_name), attr))
            self.slots.append(slots)
        # units: a sharded parameter reached from exactly one unit belongs to it; one reached
        # from several units (tied across units) or from none belongs to the root
        unit_mods = find_units(module, units)

        def unit_holding(alias: str) -> int | None:
            return next((u for u, (uname, _) in enumerate(unit_mods) if alias.startswith(uname + ".")), None)
        owner_of: dict[int, int] = {}
        for i, n in enumerate(self.names):
            holders = {unit_holding(alias) for alias in canonical.get(n, [n])}
            if len(holders) == 1 and None not in holders:
                owner_of[i] = holders.pop()
        self.unit_params: list[list[int]] = [[] for _ in unit_mods]
        for i in sorted(owner_of):
            self.unit_params[owner_of[i]].append(i)
        root = [i for i in range(len(self.names)) if i not in owner_of]
        # the root unit (parameters outside every unit) runs first and stays live to the end
        self.units = [module] + [m for _, m in unit_mods]
        self.unit_params.insert(0, root)
        self.unit_of = {i: u for u, ids in enumerate(self.unit_params) for i in ids}
        # modules owning sharded parameters directly: (module, indices), for recompute hooks
        owners: dict[int, tuple[nn.Module, list[int]]] = {}
        for i, slots in enumerate(self.slots):
            for owner, _ in slots:
                owners.setdefault(id(owner), (owner, []))[1].append(i)
        self.owners = [(m, sorted(set(ids))) for m, ids in owners.values()]
        self.bw_seq = [0] + list(range(len(self.units) - 1, 0, -1))   # backward's gather order
        self.bw_pos = {u: k for k, u in enumerate(self.bw_seq)}
        self.storages: dict[int, UnitStorage] = {u: UnitStorage() for u in range(len(self.units))}


class UnitStorage:
    """One unit's gather buffers, kept across steps (FSDP2's unsharded storage): the same
    tensors, so the same storage objects, every time the unit is gathered. Their memory
    exists while some gather of the unit is in use (`users` > 0) and is freed — storages
    resized to 0 bytes, the tensor objects kept — when none is. A weight autograd saved
    in forward (a view of a buffer) is therefore valid again once backward re-gathers the
    unit into the same storages. Writes into a buffer that saved views share keep its
    version counter (the data is the same weights again)."""

    def __init__(self) -> None:
        self.slabs: list[torch.Tensor] = []
        self.users = 0
        self._next = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """`gather_into_buffers`' k-th bucket buffer (its pool interface): the k-th kept one,
        with its memory (re)allocated; a new one on the first gather or a changed plan."""
        k, self._next = self._next, self._next + 1
        s = self.slabs[k] if k < len(self.slabs) else None
        if s is None or s.numel() != numel or s.dtype != dtype or s.device != torch.device(device):
            s = torch.empty(numel, dtype=dtype, device=device)
            self.slabs[k:k + 1] = [s]
        nbytes = numel * s.element_size()
        if s.untyped_storage().nbytes() != nbytes:
            s.untyped_storage().resize_(nbytes)
        return s

    def gather(self, start: Any) -> FlatGather:
        """`start(pool)` (a gather_into_buffers call taking its buffers from here), counted
        as one more user."""
        self._next = 0
        handle = start(self)      # its writes keep the buffers' version counters (FlatGather)
        self.users += 1
        return handle

    def done(self) -> None:
        """A gather is no longer used (its collectives are complete); the last one frees the memory."""
        self.users -= 1
        if self.users == 0:
            for s in self.slabs:
                s.untyped_storage().resize_(0)


class RecomputeWatch:
    """ZeRO-3's modules owning sharded parameters directly whose recompute in backward a live
    gatherer serves: `live[id(module)] = [(module, gatherer, indices)]`, read by ZeRO's
    "run_unit" handler at the "recompute_pre" / "recompute_post" events, and the one
    `RecomputeEvents` watching them while some gatherer is registered (the engine's: gatherers
    of outstanding micro-batches share it)."""

    def __init__(self) -> None:
        self.live: dict[int, list] = {}
        self.events: Any = None
        self._added: dict[int, list] = {}        # id(gatherer) -> its (key, entry) pairs
        self._events = IdentityCache()           # (live, the stack's transforms) -> the RecomputeEvents

    def add(self, gatherer: "UnitGatherer", owners: list) -> None:
        live, added = self.live, []
        for m, ids in owners:
            entry = (m, gatherer, ids)
            live.setdefault(id(m), []).append(entry)
            added.append((id(m), entry))
        self._added[id(gatherer)] = added
        if self.events is None:
            events = recompute_events_for(live, self._events)
            if events is not None:
                self.events = events.__enter__()

    def remove(self, gatherer: "UnitGatherer") -> None:
        live = self.live
        for key, entry in self._added.pop(id(gatherer), ()):
            entries = live.get(key)
            if entries is None:
                continue
            if len(entries) == 1 and entries[0] is entry:
                del live[key]
            else:                    # several gatherers' backwards outstanding
                entries[:] = [e for e in entries if e is not entry]
                if not entries:
                    del live[key]
        if not self._added and self.events is not None:
            self.events.__exit__(None, None, None)
            self.events = None
