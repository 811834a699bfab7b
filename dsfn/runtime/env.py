"""Process environment: device, backend and the default process group.

This is the only module in dsfn that decides CUDA vs CPU and NCCL vs gloo. Everything
else asks it (`device()`, `backend()`, `rank()`, ...), so the same code runs on one CPU
process, on gloo ranks started by `dsfn.launch.spawn`, and on GPUs under `torchrun`.

The process group is read from the torchrun environment variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK). With none of them set the process is a
single-process run: nothing is initialised and rank()/world_size() are 0/1. Under a
launcher (WORLD_SIZE > 1) no init call is needed: the first use of a Step calls
`ensure_distributed()`, which initialises the group as `deepspeed.initialize` does.
"""
from __future__ import annotations

import atexit
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from dsfn.errors import ConfigError, DistributedError

# Variables that together describe one rank of an env:// rendezvous.
REQUIRED_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_TRUE = {"1", "true", "yes", "on"}


def force_cpu() -> bool:
    """True when `DSFN_FORCE_CPU` is set to 1/true/yes/on: use CPU + gloo even if CUDA is visible."""
    return os.environ.get("DSFN_FORCE_CPU", "").strip().lower() in _TRUE


def use_cuda() -> bool:
    """True when this process computes on CUDA (available and not forced to CPU)."""
    return not force_cpu() and torch.cuda.is_available()


def local_rank() -> int:
    """This process's index on its node (LOCAL_RANK; 0 for a single process)."""
    value = os.environ.get("LOCAL_RANK")
    if value is None or value == "":
        return 0
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"LOCAL_RANK={value!r} is not an integer") from None


def local_world_size() -> int:
    """Number of ranks on this node (LOCAL_WORLD_SIZE, else world_size())."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value:
        try:
            return int(value)
        except ValueError:
            raise DistributedError(f"LOCAL_WORLD_SIZE={value!r} is not an integer") from None
    return world_size()


def device() -> torch.device:
    """This process's compute device: `cuda:{i}` on CUDA, else `cpu`.

    i is `LOCAL_RANK % device_count()`: torchrun shows every rank all of the node's GPUs
    (i = LOCAL_RANK), while launchers that give each task its own GPU (SLURM's
    `--gpus-per-task`, `CUDA_VISIBLE_DEVICES` set per rank) show each rank one device,
    which is then `cuda:0` whatever LOCAL_RANK says.
    """
    if use_cuda():
        count = torch.cuda.device_count()
        return torch.device("cuda", local_rank() % count if count > 1 else 0)
    return torch.device("cpu")


def bind_device() -> torch.device:
    """Make `device()` the current CUDA device (no-op on CPU); returns `device()`.

    NCCL communicators, `torch.cuda.current_stream()` and new CUDA tensors without an index
    all follow the current device, which is cuda:0 until someone sets it; a rank that never
    binds runs every collective on GPU 0. Called by `init_distributed` and by
    `ensure_distributed` for a group that someone else initialised. Idempotent and cheap.
    """
    dev = device()
    if dev.type == "cuda" and torch.cuda.current_device() != dev.index:
        torch.cuda.set_device(dev)
    return dev


def backend() -> str:
    """The collective backend: `DSFN_BACKEND` when set ("gloo" or "nccl"), else the one
    matching `device()`: "nccl" on CUDA, "gloo" on CPU.

    `DSFN_BACKEND=gloo` with CUDA tensors runs several ranks on one GPU (NCCL refuses two
    ranks on one device): gloo stages the CUDA tensors through the host. For tests and
    benchmarks, not for speed."""
    forced = os.environ.get("DSFN_BACKEND", "").strip().lower()
    if forced:
        if forced not in ("gloo", "nccl"):
            raise ConfigError(f"DSFN_BACKEND={forced!r}: use 'gloo' or 'nccl', or unset it to pick by device")
        if forced == "nccl" and not use_cuda():
            raise ConfigError("DSFN_BACKEND=nccl needs CUDA (none is available, or DSFN_FORCE_CPU is set); "
                              "unset DSFN_BACKEND or use 'gloo'")
        return forced
    return "nccl" if use_cuda() else "gloo"


def is_distributed() -> bool:
    """True once the default process group is initialised (by dsfn or by anyone else)."""
    return dist.is_available() and dist.is_initialized()


def _launched() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) a launcher set for this process when WORLD_SIZE > 1, else None."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        return (int(os.environ["RANK"]), world) if world > 1 else None
    except (KeyError, ValueError):
        return None


def rank() -> int:
    """Global rank in the default group. Before the group exists (a launched script before its
    first Step), the launcher's RANK, so `if rank() == 0:` picks one rank from the script's
    first line; 0 for a single process."""
    if is_distributed():
        return dist.get_rank()
    launched = _launched()
    return launched[0] if launched else 0


def world_size() -> int:
    """Number of ranks in the default group; before it exists the launcher's WORLD_SIZE (as
    `rank()`); 1 for a single process."""
    if is_distributed():
        return dist.get_world_size()
    launched = _launched()
    return launched[1] if launched else 1


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name}={value!r} is not an integer") from None


def init_distributed(timeout_s: float = 300) -> bool:
    """Initialise the default process group from torchrun's environment variables.

    Idempotent. Returns True when a process group is (now) initialised, False for a
    single process (none of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), in which
    case nothing is initialised.

    Raises:
        DistributedError: some but not all of the variables are set, or they are
            inconsistent (rank out of range, not integers).
    """
    if is_distributed():
        bind_device()          # a group someone else initialised: still compute on our device
        return True
    present = [v for v in REQUIRED_VARS if os.environ.get(v)]
    if not present:
        return False
    missing = [v for v in REQUIRED_VARS if v not in present]
    if missing:
        raise DistributedError(
            f"incomplete distributed environment: {', '.join(present)} set but "
            f"{', '.join(missing)} missing. Launch with `torchrun --nproc-per-node N script.py`, "
            f"`python -m dsfn.launch --nproc N script.py` or `dsfn.launch.spawn(fn, N)`, "
            f"or unset {', '.join(present)} to run as a single process.")
    if not dist.is_available():
        raise DistributedError("torch.distributed is not available in this build of PyTorch")
    rank_, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if world < 1 or not 0 <= rank_ < world:
        raise DistributedError(f"RANK={rank_} is not in [0, WORLD_SIZE={world})")
    be = backend()
    kwargs = {}
    if be == "nccl":
        # Bind the device before init so NCCL never guesses (all ranks on cuda:0).
        kwargs["device_id"] = bind_device()
    dist.init_process_group(backend=be, init_method="env://", rank=rank_, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    # a process that exits with the group still open can abort in gloo's teardown
    atexit.register(_shutdown_at_exit)
    return True


def ensure_distributed() -> bool:
    """Initialise the default process group if a launcher says this is one of several ranks.

    With WORLD_SIZE > 1 in the environment (torchrun, `python -m dsfn.launch`) and no
    process group yet, this is `init_distributed()`; otherwise it does nothing (a group
    that is already initialised, by dsfn or anyone else, is used as it is). Called at the
    start of every Step entry point (`place`, `init_state`, `step(...)`, `gather`,
    `explain`) and by `current_mesh()`, so a launched script never silently trains as N
    independent world-size-1 runs. Cheap: two lookups once the group exists.

    Returns whether a process group is initialised.

    Raises:
        DistributedError: WORLD_SIZE > 1 but RANK, MASTER_ADDR or MASTER_PORT is
            missing (each missing one is named), or the values are inconsistent.
    """
    if is_distributed():
        _bind_once()           # the group may come from the user or a library (HF Trainer, DeepSpeed)
        return True
    value = os.environ.get("WORLD_SIZE", "").strip()
    if not value:
        return False
    try:
        world = int(value)
    except ValueError:
        raise DistributedError(f"WORLD_SIZE={value!r} is not an integer") from None
    if world <= 1:
        return False
    missing = [v for v in REQUIRED_VARS if not os.environ.get(v)]
    if missing:
        raise DistributedError(
            f"WORLD_SIZE={world} says this process is one of {world} ranks, but "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set, so the process "
            f"group cannot be initialised. Launch with `torchrun --nproc-per-node N script.py` or "
            f"`python -m dsfn.launch --nproc N script.py` (they set RANK, WORLD_SIZE, MASTER_ADDR "
            f"and MASTER_PORT), set {', '.join(missing)} yourself, or unset WORLD_SIZE to run as a "
            f"single process.")
    return init_distributed()


_bound = False       # bind_device() ran since the group was initialised (reset by shutdown)


def _bind_once() -> None:
    """`bind_device()` once per process group (ensure_distributed runs at every Step call)."""
    global _bound
    if not _bound:
        bind_device()
        _bound = True


def backend_in_use() -> str | None:
    """The initialised default group's backend ("nccl", "gloo", ...), or None without a group."""
    return dist.get_backend() if is_distributed() else None


def check_state_device(tensors, what: str = "the state") -> None:
    """ConfigError when the process group runs NCCL but every tensor of `tensors` is a host
    tensor: the collectives would stage everything through the GPU while all compute runs on
    the CPU, silently (the usual cause: a model never moved with `.to(device)`).

    Host tensors next to device ones are fine (offloaded state, step counters); tensors on
    `meta` or any device count as on the device. Nothing is checked without a group, under
    gloo, or with DSFN_FORCE_CPU set (then the backend is gloo anyway).
    """
    if backend_in_use() != "nccl":
        return
    ts = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    if ts and all(t.device.type == "cpu" for t in ts):
        raise ConfigError(
            f"the process group uses NCCL (GPUs), but {what} is on the CPU ({len(ts)} host tensors, none on a "
            f"device): training would run on the CPU. Move the model before functionalize — "
            f"`model.to(dsfn.runtime.device())` ({device()} on this rank) — and put batches there too; or "
            f"set DSFN_FORCE_CPU=1 to train on the CPU with gloo")


def shutdown() -> None:
    """Destroy the default process group if one is initialised (no-op otherwise)."""
    global _bound
    _bound = False
    if is_distributed():
        dist.destroy_process_group()


_before_exit: list = []      # what holds sub-groups (the mesh registers its reset): dropped first


def before_exit(fn) -> None:
    """Run `fn()` at interpreter exit before the process groups are destroyed (a holder of
    groups or work handles lets go of them: `dsfn.runtime.mesh` registers its reset)."""
    if fn not in _before_exit:
        _before_exit.append(fn)


def _shutdown_at_exit() -> None:
    """At interpreter exit, after the user's script: the process group and everything that
    holds it or its work handles go while the interpreter still runs. Left to finalisation,
    gloo's worker threads free a finished collective's tensors during interpreter teardown
    and a rank aborts ("terminate called without an active exception", exit -6) after a
    script that succeeded. So: drop dsfn's mesh (its sub-groups: `before_exit`), destroy
    every group, and collect the cycles that still hold work handles and their tensors."""
    import gc
    try:
        for fn in _before_exit:
            fn()
        gc.collect()                  # work handles in garbage cycles go before their groups
        shutdown()
    finally:
        gc.collect()


_allocator_tuned = False
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3     # glibc mallopt parameters
_MMAP_THRESHOLD_MAX = 32 * 2**20                  # glibc's cap on 64-bit
_libc: Any = None                                 # glibc through ctypes, once found (False: none)


def _glibc() -> Any:
    """glibc's allocator entry points (ctypes), or None off glibc or with
    `DSFN_MALLOC_TUNING=0`, which leaves the allocator entirely to the user."""
    global _libc
    if os.environ.get("DSFN_MALLOC_TUNING", "1").strip().lower() in {"0", "false", "no", "off"}:
        return None
    if _libc is None:
        try:
            import ctypes
            lib = ctypes.CDLL("libc.so.6")
            _libc = lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else False
        except OSError:
            _libc = False
    return _libc or None


def tune_host_allocator() -> bool:
    """Keep freed host memory in the process instead of returning it to the kernel.

    A functional step allocates new parameter/optimizer tensors every step and frees the
    old ones. With glibc's defaults, blocks of several MB are mmapped and unmapped each
    time, so every step page-faults its state in again (measured: 4-45k faults and up to
    2x the optimizer time on a 27M model). Raising the mmap and trim thresholds lets
    glibc reuse the blocks. Idempotent; a no-op off glibc; `DSFN_MALLOC_TUNING=0` opts
    out. Called when the first Step is built. Returns whether the settings were applied.
    """
    global _allocator_tuned
    if _allocator_tuned:
        return True
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
    ok = libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1 and ok
    _allocator_tuned = ok
    return ok


host_heap_trims = 0        # trim_host_heap calls that trimmed, in this process (for tests)


def trim_host_heap() -> bool:
    """Give the free pages inside glibc's heap back to the kernel (`malloc_trim(0)`).

    For steps that keep host memory low (donated ZeRO-3 on CPU calls it once per step, at
    the end of backward). A step's freed blocks (activations, gathered units, temporaries)
    stay resident as holes between the blocks still held, and the next step's allocations
    do not fit them all: resident memory creeps up step after step, beyond what is ever
    held at once (benchmarks/README.md, issue 31: ZeRO-3 + donate's peak RSS 0.79-0.90x
    DDP's with the holes, 0.75-0.79x trimmed). Trimming drops the holes' pages; the next
    step faults back in what it touches (+12% CPU time per step on that 27M GPT). A
    no-op off glibc and with `DSFN_MALLOC_TUNING=0`. Returns whether it trimmed.
    """
    global host_heap_trims
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    host_heap_trims += 1
    return True
