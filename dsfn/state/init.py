"""Build a placed state without ever holding the full model on a rank (DeepSpeed's
`zero.Init`, FSDP2's meta-device init + DCP load).

    with torch.device("meta"):
        model = MyModel(config)                           # no memory
    apply_fn, params = dsfn.functionalize(model)          # meta tensors: names, shapes, dtypes
    state = init_sharded(step, params, tx, source=hf_checkpoint("ckpt_dir"), apply_fn=apply_fn)
    # or source=lambda name, like: torch.randn(like.shape) * 0.02 (a per-leaf initialiser)

Three phases, under the step's transforms:
1. *Layouts.* The logical state is made of the meta tensors and placed by every
   transform's `place` (ZeRO's FlatShard, tensor parallel's DimShard, Nested, mixed
   precision's master copies): every leaf gets its layout and a meta piece of its
   local shape. Nothing is allocated, nothing is communicated.
2. *Values.* Each meta piece is allocated (zeros: the padding) and filled with the runs of
   the logical tensor its layout covers (`Layout.runs`), read from `source`: a
   safetensors checkpoint reads exactly those runs (one positioned read each), a
   per-leaf initialiser makes one full tensor at a time and drops it once its pieces
   are cut. Then `place_after` (offload: pieces to host memory or
   NVMe files) and the "init_optimizer" primitive (optimizer state born as shards).
   Under offload the pieces are made in host memory (pinned for a CUDA device) and the
   optimizer state is made from the parameters' host view, so the compute device never
   holds the offloaded state, not even while it is made; the pieces offload leaves on the
   device (ZeRO-3's parameters without `params=True`) move there one at a time. With
   NVMe, the rank's pieces are in host memory once, before they are written to files.
3. *Frozen parameters* (`apply_fn.frozen`, with `apply_fn=`): placed by the
   "place_constants" primitive (shard_zero(3): FlatShard) and filled the same way, into
   `apply_fn.constants`; other meta constants (non-persistent buffers, which no checkpoint
   holds: rotary tables) are remade by their module as its construction makes them
   (`remade_buffer`), or else filled whole from `source`.

Peak per rank: this rank's state + the largest single tensor (an initialiser's full
tensor; for a checkpoint only the runs being read). Every rank computes the same values
independently, so a source must be deterministic (a seeded initialiser: seed from the name).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dsfn import tree
from dsfn.effects import activate, bind
from dsfn.errors import ConfigError
from dsfn.runtime import env
from dsfn.runtime.mesh import current_mesh, ensure_ready
from dsfn.state.layout import Placed, Replicated, is_placed, mirrored_param
from dsfn.state.train_state import TrainState, mark_placed

__all__ = ["Initializer", "SafetensorsSource", "hf_checkpoint", "init_sharded", "place_frozen", "place_state",
           "store_constants"]

Runs = Sequence[tuple[int, int]]     # (logical start, length) in the row-major flattened tensor


class Initializer:
    """A source from `fn(name, like) -> tensor` (`like`: a meta tensor of the logical shape
    and dtype): one full tensor at a time, cached until another name is asked for (a
    parameter and its master copy read the same one)."""

    def __init__(self, fn: Callable[[str, torch.Tensor], torch.Tensor]):
        if not callable(fn):
            raise ConfigError(f"init_sharded(source=...): an initialiser is a callable (name, like) -> tensor, "
                              f"got {fn!r}")
        self.fn = fn
        self._last: tuple[str, torch.Tensor] | None = None

    def has(self, name: str) -> bool:
        return True

    def read(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, runs: Runs) -> list[torch.Tensor]:
        if self._last is None or self._last[0] != name:
            self._last = None                       # drop the previous one before making the next
            full = self.fn(name, torch.empty(shape, dtype=dtype, device="meta"))
            if not isinstance(full, torch.Tensor) or tuple(full.shape) != tuple(shape):
                raise ConfigError(f"init_sharded: the initialiser returned "
                                  f"{tuple(full.shape) if isinstance(full, torch.Tensor) else type(full).__name__} "
                                  f"for {name!r}; it must return a tensor of shape {tuple(shape)}")
            self._last = (name, full.detach().reshape(-1))
        flat = self._last[1]
        return [flat[s:s + n] for s, n in runs]

    def done(self) -> None:
        self._last = None


class SafetensorsSource:
    """A Hugging Face checkpoint directory: `model.safetensors`, or shards listed by
    `model.safetensors.index.json`. Reads only the requested runs, each with one positioned
    read of exactly its bytes (`dsfn.runtime.sfio.File.read_into`); `bytes_read` counts
    them. (safetensors' own `safe_open(..., "pt").get_slice` is not used: its torch backend
    loads the whole file into memory, `UntypedStorage.from_file(shared=False)`, before slicing.)"""

    def __init__(self, path: str | os.PathLike, rename: Callable[[str], str] | None = None):
        path = os.fspath(path)
        self._open: dict[str, Any] = {}           # file -> sfio.File, until done()
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                self.files = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
        elif os.path.isfile(single) or os.path.isfile(path):
            file = single if os.path.isfile(single) else path
            self.files = {k: file for k in self._handle(file).keys()}
        else:
            raise ConfigError(f"init_sharded: {path} holds neither model.safetensors nor "
                              "model.safetensors.index.json (a Hugging Face save_pretrained directory)")
        self.rename = rename or (lambda n: n)
        self.bytes_read = 0

    def has(self, name: str) -> bool:
        return self.rename(name) in self.files

    def _handle(self, file: str):
        h = self._open.get(file)
        if h is None:
            from dsfn.runtime.sfio import File
            h = self._open[file] = File(file, verify=False)
        return h

    def read(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, runs: Runs) -> list[torch.Tensor]:
        key = self.rename(name)
        f = self._handle(self.files[key])
        stored, stored_shape = f.info(key)
        if tuple(stored_shape) != tuple(shape):
            raise ConfigError(f"init_sharded: {key!r} has shape {tuple(stored_shape)} in the checkpoint, the model "
                              f"wants {tuple(shape)}")
        out = []
        for start, length in runs:
            buf = torch.empty(length, dtype=stored)
            f.read_into(key, start, buf)
            self.bytes_read += length * buf.element_size()
            out.append(buf.to(dtype))
        return out

    def done(self) -> None:
        for h in self._open.values():
            h.close()
        self._open = {}


def hf_checkpoint(path: str | os.PathLike, rename: Callable[[str], str] | None = None) -> SafetensorsSource:
    """The source for a `save_pretrained` directory (names: the model's parameter names;
    `rename` maps a parameter name to the checkpoint's when they differ)."""
    return SafetensorsSource(path, rename)


class _Sources:
    """The first of several sources that has a name (a checkpoint, then an initialiser for
    what it lacks, e.g. non-persistent buffers)."""

    def __init__(self, sources: Sequence[Any]):
        self.sources = [s if hasattr(s, "read") else Initializer(s) for s in sources]

    def read(self, name, shape, dtype, runs):
        for s in self.sources:
            if s.has(name):
                return s.read(name, shape, dtype, runs)
        raise ConfigError(f"init_sharded: no source has {name!r} (the checkpoint lacks it); pass an initialiser "
                          "after the checkpoint, source=[hf_checkpoint(dir), fn], to make such tensors")

    def done(self):
        for s in self.sources:
            s.done()


def _is_meta(x: Any) -> bool:
    t = x.data if isinstance(x, Placed) else x
    return isinstance(t, torch.Tensor) and t.is_meta


def _fill(leaf: Any, name: str, like: torch.Tensor, source: _Sources, device: torch.device,
          pin: bool = False) -> Any:
    """A meta leaf (plain: replicated, or Placed) -> the same leaf holding its values: the
    runs of logical tensor `name` (made in its own dtype, `like`'s), cast to the leaf's dtype
    (mixed precision's bf16 parameter and its fp32 master come from the same values)."""
    local = leaf.data if isinstance(leaf, Placed) else leaf
    layout = leaf.layout if isinstance(leaf, Placed) else Replicated(tuple(local.shape))
    runs = layout.runs(current_mesh())
    piece = torch.zeros(tuple(local.shape), dtype=local.dtype, device=device,   # zeros: the padding
                        pin_memory=pin and device.type == "cpu")
    flat = piece.view(-1)
    if runs:
        values = source.read(name, tuple(like.shape), like.dtype, [(s, n) for s, n, _ in runs])
        for (_, n, at), v in zip(runs, values):
            flat[at:at + n].copy_(v)          # copy_ casts to the leaf's dtype
    return Placed(piece, leaf.layout) if isinstance(leaf, Placed) else piece


def _fill_tree(state: Any, names: Callable[[str, Any], str | None], logical: dict[str, torch.Tensor],
               source: _Sources, device: torch.device, pin: bool = False) -> tuple[Any, set[int]]:
    """(state with its meta leaves filled, the flat indices of the leaves filled)."""
    leaves, spec = tree.flatten(state, is_leaf=is_placed)
    paths = [p for p, _ in tree.leaves_with_path(state, is_leaf=is_placed)]
    todo = [(k, names(paths[k], leaves[k])) for k in range(len(leaves)) if _is_meta(leaves[k])]
    unknown = [paths[k] for k, n in todo if n is None]
    if unknown:
        raise ConfigError(f"init_sharded: state leaves {unknown[:5]} are meta tensors that mirror no parameter "
                          "or buffer, so nothing says their values")
    # grouped by name, so an initialiser makes each full tensor once
    for k, name in sorted(todo, key=lambda kn: kn[1]):
        leaves[k] = _fill(leaves[k], name, logical[name], source, device, pin)
    return tree.unflatten(spec, leaves), {k for k, _ in todo}


def _to_device(state: Any, filled: set[int], device: torch.device) -> Any:
    """The filled leaves that offload did not take (still host pieces, not `Offloaded`)
    moved to the compute device, one at a time."""
    from dsfn.state.layout import Offloaded
    leaves, spec = tree.flatten(state, is_leaf=is_placed)
    for k in filled:
        x = leaves[k]
        if isinstance(x, Placed) and isinstance(x.layout, Offloaded):
            continue
        t = x.data if isinstance(x, Placed) else x
        if t.device != device:
            t = t.to(device)
            leaves[k] = Placed(t, x.layout) if isinstance(x, Placed) else t
    return tree.unflatten(spec, leaves)


def place_state(stack: Sequence[Any], facts: Any, state: Any) -> Any:
    """`state` placed by `stack` (with its StackFacts `facts`): each transform's `place`,
    innermost first, then the `place_after`s (layouts that wrap the finished ones: offload).
    `Step.place`'s work on whatever mesh is current: `dsfn.estimate` places a meta state on
    a virtual mesh with it (meta leaves hold nothing to broadcast or move)."""
    with activate(stack, facts):
        for t in reversed(stack):
            state = t.place(state)
        for t in reversed(stack):
            if t.place_after is not None:     # (Transform declares it: None means none)
                state = t.place_after(state)
    return state


def init_sharded(step: Any, params: dict[str, torch.Tensor], tx: Any, *, source: Any,
                 apply_fn: Any = None, buffers: dict[str, torch.Tensor] | None = None, seed: int = 0,
                 extra: dict | None = None, device: torch.device | str | None = None) -> TrainState:
    """`step.init_state(params, tx, ...)` for a model that does not fit on one rank.

    `params` (and `buffers`; default `apply_fn.buffers`) may be meta tensors, e.g.
    `functionalize` of a model built under `torch.device("meta")`; their values come from
    `source`: a `hf_checkpoint(dir)`, a per-leaf initialiser `fn(name, like) -> tensor`
    (`like`: a meta tensor of the logical shape and dtype; any tensor of that shape),
    or a list of them (the first that has a name gives it). Real (non-meta) leaves are
    kept as given. With `apply_fn`, its frozen parameters are placed by the stack
    (shard_zero(3): 1/N per rank, stored in `apply_fn.constants`) and its other meta
    constants are filled whole. The result equals `step.init_state` with the full values;
    `device` (default: the runtime's compute device) is where the pieces are made.
    """
    ensure_ready(step.stack)
    source = _Sources(source if isinstance(source, (list, tuple)) else [source])
    device = torch.device(device) if device is not None else env.device()
    if buffers is None and apply_fn is not None:
        buffers = apply_fn.buffers
    logical = {**(buffers or {}), **dict(tree.leaves_with_path(params))}
    shapes = {n: tuple(t.shape) for n, t in tree.leaves_with_path(params)}

    def name_of(path: str, x: Any) -> str | None:
        if path.startswith("params."):
            return path[len("params."):]
        if path.startswith("buffers."):
            return path[len("buffers."):]
        shape = tuple(x.layout.shape) if isinstance(x, Placed) else tuple(x.shape)
        return mirrored_param(path, shape, shapes)    # mixed precision's master copies

    state = TrainState.create(params, tx, seed=seed, extra=extra, init_optimizer=False, buffers=buffers)
    afters = [t.place_after for t in reversed(step.stack) if t.place_after is not None]
    # under offload the pieces are made in host memory (pinned for a CUDA device) and stay
    # there when offload keeps them: the device never holds the offloaded state, not even
    # while it is made; pieces offload leaves alone move to the device one at a time
    fill_on = torch.device("cpu") if afters else device
    try:
        with activate(step.stack, getattr(step, "facts", None)):
            for t in reversed(step.stack):
                state = t.place(state)
            state, filled = _fill_tree(state, name_of, logical, source, fill_on,
                                       pin=bool(afters) and device.type == "cuda")
            for after in afters:                 # layouts that wrap the finished ones (offload)
                state = after(state)
            if fill_on != device:
                state = _to_device(state, filled, device)
            state = state.replace(opt_state=bind("init_optimizer", lambda s: s.tx.init(s.params), state))
            if apply_fn is not None:
                _init_constants(apply_fn, source, device)
    finally:
        source.done()
    return mark_placed(state)


def _init_constants(apply_fn: Any, source: _Sources, device: torch.device) -> None:
    frozen = {n: apply_fn.constants[n] for n in apply_fn.frozen if isinstance(apply_fn.constants.get(n), torch.Tensor)}
    placed = bind("place_constants", lambda c: c, frozen) if frozen else {}
    logical = {n: t for n, t in apply_fn.constants.items() if isinstance(t, torch.Tensor)}
    filled = {n: (_fill(x, n, logical[n], source, device) if _is_meta(x) else x) for n, x in placed.items()}
    for n, t in apply_fn.constants.items():       # non-persistent buffers: whole, replicated
        if n not in filled and _is_meta(t):
            made = remade_buffer(apply_fn.module, n, t)
            filled[n] = made.to(device) if made is not None else _fill(t, n, t, source, device)
    store_constants(apply_fn, filled)


def remade_buffer(module: torch.nn.Module, name: str, like: torch.Tensor) -> torch.Tensor | None:
    """Non-persistent buffer `name` of `module` (built on meta) as the module's construction
    computes it, or None when it cannot be remade (then a source must hold it).

    A checkpoint never holds such buffers (a rotary `inv_freq`, a causal mask): their owner
    submodule, when it holds no parameters and is built from its `config` alone (Hugging
    Face's rotary embeddings) or from nothing, is constructed again on the CPU and its buffer
    taken, if it has `like`'s shape. Costs the owner's buffers, no parameter."""
    import inspect
    owner_name, _, attr = name.rpartition(".")
    try:
        owner = module.get_submodule(owner_name) if owner_name else module
    except AttributeError:
        return None
    if attr not in getattr(owner, "_non_persistent_buffers_set", ()) or next(owner.parameters(), None) is not None:
        return None
    try:
        params = list(inspect.signature(type(owner).__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    required = [p for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    config = getattr(owner, "config", None)
    if not required:
        args = ()
    elif len(required) == 1 and required[0].name == "config" and config is not None:
        args = (config,)
    else:
        return None
    with torch.device("cpu"):
        fresh = type(owner)(*args)
    made = dict(fresh.named_buffers(recurse=False)).get(attr)
    if made is None or tuple(made.shape) != tuple(like.shape):
        return None
    return made.to(like.dtype)


def place_frozen(apply_fn: Any) -> None:
    """Store `apply_fn`'s frozen parameters placed, in place, once: those still plain tensors go
    through the "place_constants" primitive (ZeRO-3 shards them, tensor parallel splits them;
    default: as they are) and `store_constants` keeps the result."""
    todo = {n: apply_fn.constants[n] for n in getattr(apply_fn, "frozen", ())
            if isinstance(apply_fn.constants.get(n), torch.Tensor)}
    if todo:
        store_constants(apply_fn, bind("place_constants", lambda c: c, todo))


def store_constants(apply_fn: Any, placed: dict[str, Any]) -> None:
    """Put `placed` (name -> tensor or Placed piece) into `apply_fn.constants` in place
    (every apply_fn sharing that dict sees them) and release the module's own full tensors
    of the sharded names (tied aliases share the object), so the pieces are the only copy
    this process holds."""
    params = dict(apply_fn.module.named_parameters(remove_duplicate=False))
    for name, x in placed.items():
        if x is apply_fn.constants.get(name):
            continue
        apply_fn.constants[name] = x
        p = params.get(name)
        if p is not None and isinstance(x, Placed) and not p.is_meta:     # a meta one holds nothing
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
