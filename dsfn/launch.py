"""Start a function (or a script) on N local ranks, torchrun-style, and fail fast.

`spawn(fn, world_size)` runs `fn` in `world_size` child processes that form one process
group (gloo on CPU by default) and returns their results indexed by rank. It exists for
tests and small local runs: a rank that raises, dies or hangs turns into a `RankFailure`
that names the rank within a fraction of a second (or at the timeout), and no child is
ever left behind.

`python -m dsfn.launch --nproc N script.py [args...]` is a tiny torchrun for local CPU
runs: it sets the same environment variables and runs the script N times. As under
torchrun, the script needs no init call: the first use of a Step (or `current_mesh()`,
`init_mesh()`) initialises the process group (`dsfn.runtime.env.ensure_distributed`).

How the ranks meet: the parent hosts the rendezvous TCPStore itself (port 0, so the OS
picks a free port and there is no bind race between picking and using it) and the ranks
connect as clients (`TORCHELASTIC_USE_AGENT_STORE=True`, exactly what torchrun does).
The store is started only after the children are forked, so no child inherits a copy
of its server thread; the port reaches each child through its pipe. What the parent hears
from the ranks, and the RankFailure it makes of it: `dsfn.launch_reports`.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Mapping, Sequence

from dsfn.errors import ConfigError
from dsfn.launch_reports import collect, stack_path

__all__ = ["spawn", "main"]

_START_METHODS = ("fork", "spawn", "forkserver")


# --------------------------------------------------------------------------- helpers


def _start_store(timeout_s: float):
    """A TCPStore server in this process on a free port (the rendezvous of one run)."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, None, True,
                    timeout=datetime.timedelta(seconds=max(float(timeout_s), 30.0)),
                    wait_for_workers=False)


def _rank_env(rank: int, world_size: int, port: int, ranks_per_node: int | None = None) -> dict[str, str]:
    """The torchrun environment of one local rank; with `ranks_per_node`, the environment
    torchrun gives it when the ranks are spread over nodes of that many (node-major: node
    `rank // ranks_per_node`), so topology-aware code runs as on several nodes."""
    per = ranks_per_node or world_size
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % per),
        "LOCAL_WORLD_SIZE": str(per),
        "GROUP_RANK": str(rank // per),
        "GROUP_WORLD_SIZE": str(world_size // per),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        # Ranks connect to the parent's store as clients instead of rank 0 hosting it.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def _die_with_parent(parent_pid: int | None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphans even if the
    parent itself is SIGKILLed), and exit now if the parent is already gone.

    `parent_pid` None: the parent is a forkserver, not the caller; skip both."""
    if parent_pid is None:
        return
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except Exception:  # pragma: no cover - best effort
            pass
    if os.getppid() != parent_pid:
        os._exit(1)


def _to_cpu(result: Any) -> Any:
    """Move tensors in a pytree result to CPU, so unpickling in the parent never
    initialises CUDA there (which would break later fork-started runs)."""
    import torch

    from dsfn import tree

    try:
        return tree.map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, result)
    except Exception:
        return result


# --------------------------------------------------------------------------- child


def _child_main(rank: int, world_size: int, fn: Callable[..., Any], args: tuple,
                kwargs: dict, env: Mapping[str, str | None] | None, conn: Any,
                stack_dir: str, parent_pid: int | None, start_method: str,
                ranks_per_node: int | None = None) -> None:
    """Body of one rank: set up the environment, run fn, report back, exit hard."""
    status = 1
    try:
        try:
            # Own process group so the parent can kill the rank with anything it started.
            os.setpgrp()
        except OSError:
            pass
        _die_with_parent(parent_pid)
        stack_file = open(stack_path(stack_dir, rank), "w")
        # At a timeout the parent sends SIGUSR1 and reports where the rank was stuck.
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)

        port = pickle.loads(conn.recv_bytes())

        if not env or "DSFN_FORCE_CPU" not in env:
            os.environ["DSFN_FORCE_CPU"] = "1"
        for key, value in (env or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = str(value)
        os.environ.update(_rank_env(rank, world_size, port, ranks_per_node))

        import torch

        if start_method == "fork":
            # GNU OpenMP (libgomp, which torch's CPU build uses) is not fork-safe: once
            # the parent has run a parallel region, a forked child that enters one with
            # more than one thread hangs forever (a matmul is enough). One thread is
            # safe, and is also what N ranks sharing the CPUs want anyway.
            torch.set_num_threads(1)
        elif "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))

        from dsfn.runtime import env as dsfn_env

        dsfn_env.init_distributed()
        result = fn(*args, **kwargs)
        try:
            payload = pickle.dumps(("ok", _to_cpu(result)), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise TypeError(f"the return value of fn on rank {rank} cannot be pickled "
                            f"({type(e).__name__}: {e}); return tensors, numbers or plain "
                            f"containers of them") from e
        # Report before tearing down: the result is what matters, and a teardown that
        # hangs must not hide it.
        conn.send_bytes(payload)
        status = 0
        try:
            dsfn_env.shutdown()
        except Exception:
            pass
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent
        report = ("error", type(e).__qualname__, str(e), traceback.format_exc(), time.time())
        try:
            conn.send_bytes(pickle.dumps(report))
        except Exception:
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        # Skip atexit handlers and destructors inherited from the parent (pytest's,
        # gloo's): they can hang or run the parent's cleanup a second time.
        os._exit(status)


# --------------------------------------------------------------------------- parent


def _relay_lines(pipe: Any, sink: Any, lock: threading.Lock) -> None:
    """Copy one rank's output to `sink` a whole line at a time, so lines printed by
    several ranks at once never interleave mid-line (an unbuffered child writes each
    piece of a `print` separately)."""
    out = getattr(sink, "buffer", None)
    for line in iter(pipe.readline, b""):
        with lock:
            if out is not None:
                out.write(line)
            else:
                sink.write(line.decode(errors="replace"))
            sink.flush()
    pipe.close()


def _kill(procs: Sequence[Any]) -> None:
    """SIGKILL every rank that has not been reaped yet (with its process group), then reap."""
    for p in procs:
        if p.pid is None or p.exitcode is not None:
            continue
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.kill()
        except Exception:
            pass
    for p in procs:
        if p.pid is not None:
            p.join(timeout=5)


def _check_spawn_args(world_size: Any, timeout: Any, start_method: str, env: Mapping[str, str | None] | None,
                      ranks_per_node: Any) -> None:
    """ConfigError for arguments `spawn` refuses, and for a parent a forked rank cannot start from."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"spawn: world_size must be an int >= 1, got {world_size!r}")
    if not timeout or timeout <= 0:
        raise ConfigError(f"spawn: timeout must be > 0 seconds, got {timeout!r}")
    if ranks_per_node is not None and (isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int)
                                       or ranks_per_node < 1 or world_size % ranks_per_node):
        raise ConfigError(f"spawn: ranks_per_node={ranks_per_node!r} must be an int >= 1 dividing "
                          f"world_size={world_size}")
    if start_method not in _START_METHODS:
        raise ConfigError(f"spawn: start_method must be one of {_START_METHODS}, got {start_method!r}")
    if start_method == "fork":
        wants_cuda = env is not None and str(env.get("DSFN_FORCE_CPU", "1")).strip().lower() not in (
            "1", "true", "yes", "on")
        torch_mod = sys.modules.get("torch")
        if wants_cuda and torch_mod is not None and torch_mod.cuda.is_initialized():
            raise ConfigError("spawn: CUDA is already initialised in this process and a forked "
                              "child cannot use it; pass start_method='spawn' or keep "
                              "DSFN_FORCE_CPU=1")
        dist_mod = sys.modules.get("torch.distributed")
        if dist_mod is not None and dist_mod.is_available() and dist_mod.is_initialized():
            # the child would inherit the parent's process group (and hang in it)
            raise ConfigError("spawn: this process has an initialised torch.distributed process group, "
                              "which forked ranks would inherit; call spawn before init_process_group "
                              "(or after destroy_process_group), or pass start_method='spawn'")


def _start_ranks(ctx: Any, world_size: int, fn: Callable[..., Any], args: tuple, kwargs: dict,
                 env: Mapping[str, str | None] | None, stack_dir: str, start_method: str,
                 ranks_per_node: int | None, procs: list, conns: list) -> None:
    """Start the ranks' processes, appending each to `procs` and its pipe to `conns` (so the
    caller reaps what started even when a later start fails)."""
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=_child_main, name=f"dsfn-rank{rank}",
            args=(rank, world_size, fn, args, kwargs, dict(env) if env else None,
                  child_conn, stack_dir,
                  None if start_method == "forkserver" else os.getpid(), start_method, ranks_per_node))
        try:
            proc.start()
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            if start_method == "fork":
                raise
            raise ConfigError(
                f"spawn: with start_method={start_method!r}, fn and its arguments must be "
                f"picklable (define fn at module level), or use start_method='fork' "
                f"({type(e).__name__}: {e})") from e
        finally:
            child_conn.close()
        procs.append(proc)
        conns.append(parent_conn)


def _send_port(conns: Sequence[Any], port: int) -> None:
    """The rendezvous port, to every rank through its pipe."""
    port_msg = pickle.dumps(port)
    for conn in conns:
        try:
            conn.send_bytes(port_msg)
        except OSError:
            pass  # that rank already died; collect reports it


def _release(procs: Sequence[Any], conns: Sequence[Any]) -> None:
    """Kill and reap what is left of the ranks; close their pipes and process handles."""
    _kill(procs)
    for conn in conns:
        conn.close()
    for proc in procs:
        try:
            proc.close()
        except ValueError:
            pass


def spawn(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
          kwargs: Mapping[str, Any] | None = None, timeout: float = 120.0,
          start_method: str = "fork", env: Mapping[str, str | None] | None = None,
          ranks_per_node: int | None = None) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` local ranks; return results by rank.

    Each rank is a child process with torchrun's variables (RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT) and
    `DSFN_FORCE_CPU=1` unless `env` sets it; `env` adds variables (a None value unsets
    one). The rank initialises the default process group
    (`dsfn.runtime.env.init_distributed`), runs fn, sends back its return value
    (pickled; tensors moved to CPU) and destroys the group.

    Args:
        fn: with "fork" (default, ~50x faster to start) any callable, closures
            included; with "spawn"/"forkserver" it must be picklable (module level).
        world_size: number of ranks, >= 1.
        timeout: seconds for the whole run, start-up included.
        start_method: "fork", "spawn" or "forkserver".
        env: extra environment variables for the ranks.
        ranks_per_node: lay the ranks out as torchrun does over nodes of this many ranks
            (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE), so a test sees
            the topology of several nodes (`dsfn.runtime.topology`); must divide
            world_size. Default: one node.

    Raises:
        RankFailure: reason "exception" (a rank raised; the message has its remote
            traceback, also in `.remote_traceback`), "exit" (a rank died without a
            result; `.exitcode`, negative for a signal) or "timeout" (`.ranks` still
            running, their Python stacks in `.stacks`). The other ranks are killed at
            once, so a rank blocked in a collective never delays the report.
        ConfigError: invalid world_size, timeout or start_method.

    Under "fork" each rank runs torch with one intra-op thread: libgomp hangs a
    forked child that uses more threads after the parent has. Do not raise it in fn.
    """
    _check_spawn_args(world_size, timeout, start_method, env, ranks_per_node)
    kwargs = dict(kwargs or {})
    args = tuple(args)

    ctx = mp.get_context(start_method)
    deadline = time.monotonic() + timeout
    stack_dir = tempfile.mkdtemp(prefix="dsfn-spawn-")
    procs: list[Any] = []
    conns: list[Any] = []
    store = None
    try:
        _start_ranks(ctx, world_size, fn, args, kwargs, env, stack_dir, start_method, ranks_per_node, procs, conns)
        # Only now, with every child started, start the store's server thread.
        store = _start_store(timeout)
        _send_port(conns, store.port)
        results = collect(procs, conns, deadline, timeout, stack_dir)
        # Give ranks a moment to finish tearing down their groups before the store goes.
        for proc in procs:
            proc.join(timeout=max(0.0, min(deadline - time.monotonic(), 5.0)))
        return results
    finally:
        _release(procs, conns)
        del store
        shutil.rmtree(stack_dir, ignore_errors=True)


# --------------------------------------------------------------------------- CLI


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dsfn.launch",
        description="Run a script on N local ranks (a tiny torchrun for CPU/gloo runs). "
                    "The script needs no init call: its first Step use joins the process group.")
    p.add_argument("--nproc", "--nproc-per-node", type=int, default=1, dest="nproc",
                   help="number of ranks (default 1)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before all ranks are killed (default: none)")
    p.add_argument("-m", "--module", action="store_true",
                   help="treat the target as a module name (python -m MODULE)")
    p.add_argument("script", help="script path (or module name with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m dsfn.launch`; returns the process exit code.

    The first rank to exit non-zero ends the run: the others are killed and its code is
    returned (124 on timeout).
    """
    ns = _parse_args(argv)
    if ns.nproc < 1:
        print(f"dsfn.launch: --nproc must be >= 1, got {ns.nproc}", file=sys.stderr)
        return 2
    store = _start_store(ns.timeout or 300.0)
    base = dict(os.environ)
    base.setdefault("DSFN_FORCE_CPU", "1")
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ns.nproc)))
    cmd = [sys.executable] + (["-m"] if ns.module else []) + [ns.script] + list(ns.script_args)
    parent_pid = os.getpid()
    procs: list[subprocess.Popen] = []
    relays: list[threading.Thread] = []
    locks = {"stdout": threading.Lock(), "stderr": threading.Lock()}
    code = 0
    try:
        for rank in range(ns.nproc):
            proc = subprocess.Popen(
                cmd, env={**base, **_rank_env(rank, ns.nproc, store.port)},
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, preexec_fn=lambda: _die_with_parent(parent_pid))
            procs.append(proc)
            for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
                relay = threading.Thread(target=_relay_lines, args=(pipe, getattr(sys, name), locks[name]),
                                         daemon=True)
                relay.start()
                relays.append(relay)
        deadline = None if ns.timeout is None else time.monotonic() + ns.timeout
        running = set(range(ns.nproc))
        while running:
            for r in sorted(running):
                rc = procs[r].poll()
                if rc is None:
                    continue
                running.discard(r)
                if rc != 0 and code == 0:
                    code = rc if rc > 0 else 128 - rc
                    print(f"dsfn.launch: rank {r} of {ns.nproc} failed with exit code {rc}; "
                          f"stopping the other ranks", file=sys.stderr)
            if code != 0:
                break
            if deadline is not None and time.monotonic() > deadline:
                print(f"dsfn.launch: timed out after {ns.timeout:g} s; ranks still running: "
                      f"{sorted(running)}", file=sys.stderr)
                code = 124
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        code = 130
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
        for proc in procs:
            proc.wait()
        for relay in relays:
            # A grandchild that kept the pipe open must not hold the launcher forever.
            relay.join(timeout=5.0)
        del store
    return code


if __name__ == "__main__":
    sys.exit(main())
