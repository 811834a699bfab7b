"""The asynchronous checkpoint engine: the synchronous `save`, run on a background thread.

    saver = AsyncSaver()
    saver.submit(dir, state, keep=3)      # returns after the capture; the write runs behind
    ...                                   # training continues (its own collectives included)
    saver.wait()                          # blocks until the save is committed; re-raises its error

Capture is by reference: a dsfn state is an immutable pytree and the next step builds
new tensors, never writing into the ones captured, so handing the state to the thread
costs nothing (no copy). An `AsyncSaver(cache=HostCache(...))` instead copies the
tensors its policy picks into a bounded, reused host buffer at the capture
(`dsfn.checkpoint.host_cache`): device state then stops holding device memory once its
asynchronous copies land, and a snapshot protects a state that something updates in place.

Deadlock safety (DCP's known pitfall: `async_save` on the default group deadlocks against
the training loop's own collectives). The background thread talks to other ranks only on
checkpointing's dedicated gloo group (`writer.checkpoint_group`), never on the default or
mesh groups, and it never *creates* a group: `submit` creates the checkpoint group and the
mesh on the calling (training) thread first, where group creation is ordered the same on
every rank. Each process group has its own connections and worker, so collectives on two
groups from two threads do not wait on each other.

At most one save is in flight: `submit` waits for the previous one first. A background
failure is kept and re-raised as `CheckpointError` (its cause chained and in `.cause`) by
`check()` (non-blocking), `wait()` and the next `submit`; an `atexit` hook flushes the
last save and reports a failure on stderr and in the exit status (1), so nothing is lost
silently.

Donation (`step(state, batch, donate=True)`, `dsfn.state.donation`): a donated step writes
the new values into its input state's tensors, i.e. into what a capture by reference still
holds. The saver is a registered reader: before a donated step writes, it waits for the
in-flight save when that save references state tensors (`settle_for_donation`). A capture
that copied every tensor (`HostCache` with `capture="copy"` and room for the state) holds
no references, so a donated step never waits for it.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from typing import Any

from dsfn.checkpoint.host_cache import HostCache, StagedEvent, StageReport
from dsfn.errors import CheckpointError

__all__ = ["AsyncSaver"]


class AsyncSaver:
    """One background checkpoint writer per process (one save in flight).

    `nice`: the writer thread lowers its own scheduling priority by this much (Linux
    threads have their own nice value), so on a host whose cores the training loop keeps
    busy the write takes the idle cycles instead of stealing the step's; the save then
    takes longer, which only matters if the next one is due before it ends. 0 disables.
    """

    def __init__(self, nice: int = 10, cache: HostCache | None = None) -> None:
        self.nice = int(nice)
        self.cache = cache
        self.last_stage: StageReport | None = None   # what the newest capture copied / referenced
        self._thread: threading.Thread | None = None
        self._error: CheckpointError | None = None
        self._lock = threading.Lock()
        self._atexit_registered = False
        self._holds_references = False    # the in-flight save reads tensors of a live state
        from dsfn.state import donation
        donation.register_reader(self)

    # -- public ------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """True while a save is running in the background."""
        t = self._thread
        return t is not None and t.is_alive()

    def submit(self, directory: Any, state: Any, step: int | None = None, keep: int | None = None,
               user_data: Any = None, timeout_s: float | None = None) -> float:
        """Start saving `state` in the background; returns the seconds the caller was blocked.

        Collective in the sense of `dsfn.checkpoint.save`: every rank submits the same step.
        Waits for the previous save first (raising its error, if it failed).
        """
        t0 = time.perf_counter()
        self.wait()
        from dsfn.checkpoint import rng, writer
        from dsfn.runtime.mesh import current_mesh
        if user_data is not None:
            writer.check_json(user_data, "user_data")     # a bad value fails here, not in the background
        # the generators as they are at this step boundary, not when the thread gets to them
        kwargs: dict[str, Any] = {"step": step, "keep": keep, "user_data": user_data, "rng_state": rng.capture()}
        if timeout_s is not None:
            kwargs["timeout_s"] = timeout_s
        # collective set-up on *this* thread, never in the background (see the module docstring)
        current_mesh()
        writer.checkpoint_group(timeout_s if timeout_s is not None else writer.DEFAULT_TIMEOUT_S)
        if not self._atexit_registered:
            ref = weakref.ref(self)
            atexit.register(_flush_at_exit, ref)
            self._atexit_registered = True
        staged = None
        if self.cache is not None:
            state, staged, self.last_stage = self.cache.stage(state)
        self._holds_references = self.cache is None or self.last_stage.referenced_bytes > 0
        th = threading.Thread(target=self._run, args=(directory, state, kwargs, step, staged),
                              name="dsfn-async-checkpoint", daemon=True)
        self._thread = th
        th.start()
        return time.perf_counter() - t0

    def settle_for_donation(self) -> None:
        """Before a donated step overwrites state buffers: wait for the in-flight save if it
        reads them by reference (its failure, if any, is raised here)."""
        if self._holds_references and self.busy:
            self.wait()

    def check(self) -> None:
        """Raise the failure of a finished background save (once); never blocks."""
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            raise err

    def wait(self) -> None:
        """Block until the in-flight save (if any) finished; re-raise its failure."""
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None
        self.check()

    # -- the background thread -----------------------------------------------------------------
    def _run(self, directory: Any, state: Any, kwargs: dict, step: int | None,
             staged: StagedEvent | None) -> None:
        time.sleep(0)          # hand the GIL straight back to the training thread, blocked in start()
        from dsfn.checkpoint import writer
        _lower_priority(self.nice)
        try:
            if staged is not None:
                staged.wait()  # the capture's device-to-host copies have landed
            writer.save(directory, state, **kwargs)
        except BaseException as e:  # noqa: BLE001 (kept and re-raised on the training thread)
            what = f"step {step}" if step is not None else "a step"
            err = CheckpointError(f"background checkpoint save of {what} to {directory} failed: "
                                  f"{type(e).__name__}: {e}")
            err.__cause__ = e
            err.cause = e
            with self._lock:
                self._error = err


def _lower_priority(nice: int) -> None:
    """Raise this thread's nice value by `nice` (best effort; never raises)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        pass


def _flush_at_exit(ref: weakref.ref[AsyncSaver]) -> None:
    saver = ref()
    if saver is None:
        return
    try:
        saver.wait()
    except CheckpointError as e:
        # Python ignores an exception raised by an atexit hook (the exit status stays 0), so a
        # job whose last checkpoint failed would look successful: end the process with status 1
        # (hooks registered before this one are skipped; the failure matters more)
        print(f"dsfn: {e}\ndsfn: the last checkpoint was not saved; exiting with status 1",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
