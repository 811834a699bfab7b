"""`async_checkpoint(dir, every, keep=None, engine="async", host_cache_size=None, capture="auto")`.

After the inner step returns the new state, if the step advanced (a skipped fp16 step does
not) and `int(new_state.step) % every == 0`, the state is saved to `dir/step_N` with
`dsfn.checkpoint.save` (atomic commit, universal format, `keep=N` retention):

- `engine="async"` (default): the state is captured by reference (states are immutable;
  the next step makes new tensors) and written by a background thread
  (`dsfn.checkpoint.async_engine.AsyncSaver`) on checkpointing's own gloo group, while
  training continues. The step blocks only for the capture, or to wait for the previous
  save when it is still flushing (one save in flight).
- `engine="sync"`: the save runs inline (the fallback, and the comparison).

Errors of a background save (disk full, permission denied, a rank that failed) surface
as `CheckpointError` (the original error chained, and in `.cause`) at the next step call,
at the next due save, at `wait()`, and at interpreter exit (atexit flush) — never lost.
Call `ckpt.wait()` (on the transform) before reading the last checkpoint or tearing down
the process group.

The transform may sit anywhere in the stack: `wrap_step` sees the physical state that
the step takes and returns, which is what `save` stores (in any layout).

`user_data`: a function `state -> JSON object` (a data-loader position, a run id) called
at each save on the training thread; its result is stored in the manifest. Read it back
from the same step as the state: `m = dsfn.checkpoint.read_manifest(dir)`,
`state = dsfn.checkpoint.load(m.path, like)`, `m.user_data`.

Metrics: `ckpt_blocked_s` on the steps where a save was due (capture plus any wait for
the previous save, or the whole save with `engine="sync"`); with the async engine also
`ckpt_cached_bytes`, the bytes the capture copied into the host cache.

Host cache (`dsfn.checkpoint.host_cache`): `capture="auto"` (default) copies tensors that
live on a device (CUDA) into a reused host buffer — pinned, filled by asynchronous copies on
a side stream — so the captured state stops holding device memory once they land, and
references host tensors (on a CPU-only machine nothing is copied: the state already lives in
host memory). `capture="copy"` snapshots every tensor (for a state that something updates
in place); `"reference"` never copies. `host_cache_size` bounds the buffer in bytes (None:
DataStates' 16 GiB per process, at most a quarter of host memory over the node's ranks,
`host_cache.default_capacity()`; pinned only for CUDA state): tensors are taken in leaf order until the next does not fit,
the rest are captured by reference, so the bound trades memory for nothing but held memory.
Multi-rank: a background failure is raised by every rank (the writer's protocol makes all
ranks fail a save together), but each rank notices it at its own next step; a launcher
(torchrun, `dsfn.launch`) then stops the others.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from dsfn.errors import CheckpointError, ConfigError
from dsfn.transforms.core import Transform, make_transform

ENGINES = ("async", "sync")


class AsyncCheckpoint(Transform):
    name = "async_checkpoint"
    roles = frozenset({"checkpoint"})

    def __init__(self, dir: str | os.PathLike, every: int, keep: int | None = None, engine: str = "async",
                 host_cache_size: int | None = None, capture: str = "auto", timeout_s: float | None = None,
                 user_data: Callable[[Any], Any] | None = None):
        if not isinstance(dir, (str, os.PathLike)):
            raise ConfigError(f"async_checkpoint(dir={dir!r}): dir is a directory path")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(f"async_checkpoint(every={every!r}): save every N steps, N an int >= 1")
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            raise ConfigError(f"async_checkpoint(keep={keep!r}): keep is a number of checkpoints >= 1 "
                              "(or None for all)")
        if engine not in ENGINES:
            raise ConfigError(f"async_checkpoint(engine={engine!r}): use one of {list(ENGINES)}")
        if host_cache_size is not None and (not isinstance(host_cache_size, int) or host_cache_size < 0):
            raise ConfigError(f"async_checkpoint(host_cache_size={host_cache_size!r}): a byte count >= 0 or None")
        from dsfn.checkpoint.host_cache import CAPTURE_POLICIES, HostCache
        if capture not in CAPTURE_POLICIES:
            raise ConfigError(f"async_checkpoint(capture={capture!r}): use one of {list(CAPTURE_POLICIES)}")
        if engine == "sync" and (capture != "auto" or host_cache_size is not None):
            raise ConfigError("async_checkpoint(engine='sync') writes inline and has no host cache: "
                              "drop host_cache_size/capture, or use engine='async'")
        if capture == "reference" and host_cache_size is not None:
            raise ConfigError(f"async_checkpoint(capture='reference', host_cache_size={host_cache_size}): a capture by "
                              "reference copies nothing into the host cache, so its size would do nothing; drop "
                              "host_cache_size, or use capture='auto' (device tensors) or 'copy' (every tensor)")
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or not timeout_s > 0):
            raise ConfigError(f"async_checkpoint(timeout_s={timeout_s!r}): seconds a save waits for the other ranks, "
                              "a number > 0 (or None: 600)")
        self.dir, self.every, self.keep, self.engine = os.fspath(dir), every, keep, engine
        self.host_cache_size, self.capture = host_cache_size, capture
        self.timeout_s = timeout_s
        if user_data is not None and not callable(user_data):
            raise ConfigError("async_checkpoint(user_data=...): a function state -> JSON-serialisable object "
                              "(e.g. lambda state: {'batch': loader.position}), called at each save")
        self.user_data = user_data
        self._saver = None
        if engine == "async":
            from dsfn.checkpoint.async_engine import AsyncSaver
            self._saver = AsyncSaver(cache=HostCache(host_cache_size, capture))

    # -- public --------------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until the in-flight save is committed; raise CheckpointError if it failed."""
        if self._saver is not None:
            self._saver.wait()

    @property
    def busy(self) -> bool:
        """True while a background save is running."""
        return self._saver is not None and self._saver.busy

    # -- Transform -----------------------------------------------------------------------------
    def speculative_grad(self, state):
        return lambda g: g          # gradients pass through untouched

    def wrap_step(self, fn):
        def step(state, batch):
            if self._saver is not None:
                self._saver.check()          # a failed background save stops training here
            new_state, metrics = fn(state, batch)
            before, after = _step_of(state), _step_of(new_state)
            if after is None or after == before or after % self.every != 0:
                return new_state, metrics
            kwargs: dict[str, Any] = {"step": after, "keep": self.keep}
            if self.user_data is not None:
                kwargs["user_data"] = self.user_data(new_state)   # at the step boundary, on this thread
            if self.timeout_s is not None:
                kwargs["timeout_s"] = self.timeout_s
            if self._saver is not None:
                blocked = self._saver.submit(self.dir, new_state, **kwargs)
                cached = self._saver.last_stage.copied_bytes if self._saver.last_stage else 0
                return new_state, {**metrics, "ckpt_blocked_s": blocked, "ckpt_cached_bytes": cached}
            from dsfn.checkpoint.writer import save
            t0 = time.perf_counter()
            save(self.dir, new_state, **kwargs)
            blocked = time.perf_counter() - t0
            return new_state, {**metrics, "ckpt_blocked_s": blocked}
        return step


def _step_of(state: Any) -> int | None:
    s = getattr(state, "step", None)
    if s is None:
        return None
    s = getattr(s, "data", s)       # a Placed step
    try:
        return int(s)
    except (TypeError, ValueError, RuntimeError):
        raise CheckpointError(f"async_checkpoint: state.step is {s!r}, not an integer") from None


def async_checkpoint(*args: Any, **kwargs: Any) -> AsyncCheckpoint:
    """`async_checkpoint(dir, every, keep=None, engine="async", host_cache_size=None, capture="auto")`;
    see the module docstring."""
    return make_transform(AsyncCheckpoint, "async_checkpoint", args, kwargs)
