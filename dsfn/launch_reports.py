"""What `dsfn.launch.spawn`'s parent hears from its ranks, and the RankFailure it makes of it.

`collect` listens to every rank's pipe and process sentinel until each has reported (or
died), keeping on for a short grace after the first failure so the root cause (the
earliest failure) is reported rather than a peer's collateral error; `failure_error`
turns the failures into one RankFailure naming the root cause, and `timeout_error` names
the hung ranks with their Python stacks (`hung_stacks`: faulthandler on SIGUSR1, written
to `stack_path(stack_dir, rank)`).
"""
from __future__ import annotations

import multiprocessing.connection as mp_connection
import os
import pickle
import signal
import time
import traceback
from typing import Any, Sequence

from dsfn.errors import RankFailure

__all__ = ["collect", "failure_error", "hung_stacks", "read_report", "stack_path", "timeout_error"]

# After the first failure, how long to keep listening for other ranks' reports, so the
# root cause (the earliest failure) is reported rather than a peer's collateral error.
_FAILURE_GRACE_S = 0.25
# How long hung ranks get to write their Python stacks after SIGUSR1 at a timeout.
_STACK_DUMP_WAIT_S = 1.0
_MAX_STACK_CHARS = 6000


def stack_path(stack_dir: str, rank: int) -> str:
    return os.path.join(stack_dir, f"rank{rank}.stack")


def read_report(conn: Any) -> tuple | None:
    """The rank's report if one is waiting; None when nothing (more) can come from it."""
    try:
        if not conn.poll(0):
            return None
        data = conn.recv_bytes()
    except (EOFError, OSError):
        return None
    try:
        return pickle.loads(data)
    except Exception as e:
        return ("error", type(e).__name__,
                f"the result arrived but could not be unpickled in the parent: {e}",
                traceback.format_exc(), time.time())


def hung_stacks(procs: Sequence[Any], ranks: Sequence[int], stack_dir: str) -> dict[int, str]:
    """Python stacks of hung ranks, via faulthandler on SIGUSR1."""
    for r in ranks:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    stacks: dict[int, str] = {}
    end = time.monotonic() + _STACK_DUMP_WAIT_S
    while time.monotonic() < end and len(stacks) < len(ranks):
        time.sleep(0.05)
        for r in ranks:
            try:
                with open(stack_path(stack_dir, r)) as f:
                    text = f.read()
            except OSError:
                continue
            if text.strip():
                stacks[r] = text
    return stacks


def collect(procs: Sequence[Any], conns: Sequence[Any], deadline: float, timeout: float,
            stack_dir: str) -> list:
    """The ranks' results by rank; RankFailure for a rank that raised, died or is still
    running at `deadline`."""
    n = len(procs)
    reports: list[tuple | None] = [None] * n
    exited: dict[int, int | None] = {}    # ranks that died without a report -> exit code
    pending = set(range(n))
    dead_conns: set[int] = set()           # EOF seen; wait for the process sentinel only
    first_failure: float | None = None

    while pending:
        limit = deadline if first_failure is None else min(deadline, first_failure + _FAILURE_GRACE_S)
        remaining = limit - time.monotonic()
        if remaining <= 0:
            break
        waitables: dict[Any, int] = {}
        for r in pending:
            waitables[procs[r].sentinel] = r
            if r not in dead_conns:
                waitables[conns[r]] = r
        for obj in mp_connection.wait(list(waitables), timeout=remaining):
            r = waitables[obj]
            if r not in pending:
                continue
            report = read_report(conns[r])
            if report is not None:
                reports[r] = report
                pending.discard(r)
                failed = report[0] != "ok"
            elif procs[r].is_alive():
                dead_conns.add(r)  # pipe closed but the process lingers: its sentinel will tell
                continue
            else:
                procs[r].join(timeout=1)
                exited[r] = procs[r].exitcode
                pending.discard(r)
                failed = True
            if failed and first_failure is None:
                first_failure = time.monotonic()

    errors = {r: rep for r, rep in enumerate(reports) if rep is not None and rep[0] == "error"}
    if exited or errors:
        raise failure_error(n, exited, errors)
    if pending:
        raise timeout_error(procs, n, pending, timeout, stack_dir)
    return [rep[1] for rep in reports]  # type: ignore[index]


def timeout_error(procs: Sequence[Any], n: int, pending: set[int], timeout: float, stack_dir: str) -> RankFailure:
    """The RankFailure of a timeout: the ranks still running, the first one's Python stack."""
    hung = sorted(pending)
    stacks = hung_stacks(procs, hung, stack_dir)
    done = sorted(set(range(n)) - pending)
    msg = (f"spawn timed out after {timeout:g} s: rank(s) {hung} of {n} still running "
           f"(finished: {done}). A rank that never returns is usually blocked in a "
           f"collective that another rank did not call, or stuck in fn itself.")
    if hung[0] in stacks:
        msg += (f"\n\nPython stack of rank {hung[0]} at the timeout:\n"
                f"{stacks[hung[0]][-_MAX_STACK_CHARS:]}")
    err = RankFailure(msg, rank=hung[0], reason="timeout")
    err.ranks = hung
    err.stacks = stacks
    return err


def failure_error(n: int, exited: dict[int, int | None], errors: dict[int, tuple]) -> RankFailure:
    """One RankFailure naming the root cause: a rank that died silently (peers only ever
    see it as a broken connection), else the earliest exception."""
    def describe_exit(code: int | None) -> str:
        if code is not None and code < 0:
            try:
                return f"was killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code} without returning a result"

    others: list[str] = []
    if exited:
        rank = min(exited)
        code = exited[rank]
        msg = f"rank {rank} of {n} {describe_exit(code)}"
        err = RankFailure(msg, rank=rank, reason="exit")
        err.exitcode = code
        err.remote_traceback = None
    else:
        rank = min(errors, key=lambda r: (errors[r][4], r))
        _, etype, emsg, tb, _ = errors[rank]
        msg = f"rank {rank} of {n} raised {etype}: {emsg}\n\nTraceback from rank {rank}:\n{tb}"
        err = RankFailure(msg, rank=rank, reason="exception")
        err.exitcode = None
        err.remote_traceback = tb
    for r in sorted(exited):
        if r != rank:
            others.append(f"rank {r} {describe_exit(exited[r])}")
    for r in sorted(errors):
        if r != rank:
            first_line = errors[r][2].splitlines()[0] if errors[r][2] else ""
            others.append(f"rank {r} raised {errors[r][1]}: {first_line[:200]}")
    if others:
        err.args = (err.args[0] + "\nAlso failed (often as a consequence): " + "; ".join(others),)
    err.failed_ranks = sorted(set(exited) | set(errors))
    return err
