"""File-backed ("NVMe") tensors for `offload("nvme", path=...)`.

A `FileStore` owns a private directory under the user's `path`. `alloc` makes one file
per call, pre-allocates it (`posix_fallocate`, so a full disk fails *here*, before any
state is computed from it), maps it shared (`torch.from_file(..., shared=True)`, an
mmap) and unlinks it at once: the tensors stay valid for as long as any of them is
referenced (the mapping keeps the inode), the disk space returns when the last one is
freed, and a crash never leaves files behind. Each tensor starts on its own page, so
`release` can drop it from memory without touching any other tensor; the data stays in the
file and is read back on the next access.

Write-back (`release`): dropping a written page from the process (madvise(MADV_DONTNEED))
is not enough, since the dirty page stays in the page cache, i.e. in host memory, until the
kernel's flusher gets to it. So a released sub-group is handed to one background
write-back thread, which writes its pages to disk (`msync(MS_SYNC)` of the range), evicts
the now clean pages from the page cache (`MADV_PAGEOUT`, Linux >= 5.4; where the kernel
lacks it they stay as clean, reclaimable cache) and unmaps them (`MADV_DONTNEED`). The
thread runs while the caller computes the next sub-group (the syscalls release the GIL),
and a `release` first waits for the previous one's write-back, so at most one sub-group
is in flight: the disk I/O overlaps the update and host memory stays bounded. `drain()`
waits for the last one (the offload update calls it before it returns).

Functional contract: the store never writes into a tensor it handed out before; every
step's new state gets a new file, so an old state stays valid (no donation).
"""
from __future__ import annotations

import atexit
import ctypes
import errno
import itertools
import math
import mmap
import os
import shutil
import threading
import weakref
from collections.abc import Sequence

import torch

from dsfn.errors import ConfigError, DsfnError

PAGE = mmap.PAGESIZE
MADV_WILLNEED = 3
MADV_DONTNEED = 4
MADV_PAGEOUT = 21
MS_SYNC = 4
_counter = itertools.count()
_lock = threading.Lock()
# address ranges [start, end) of the file mappings this module made: madvise is only ever
# applied inside them (DONTNEED on anonymous memory would zero live heap data)
_mapped: dict[int, int] = {}
_libc = None


class NvmeSpaceError(DsfnError, OSError):
    """The offload path has no room for the state (raised before any state changes)."""


def _fallocate(fd: int, offset: int, length: int) -> None:
    """Reserve `length` bytes of the file (tests monkeypatch this to simulate a full disk)."""
    os.posix_fallocate(fd, offset, length)


def _libc_fns():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL("libc.so.6", use_errno=True)
        for fn in (lib.madvise, lib.msync):
            fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        lib.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        _libc = lib
    return _libc


def _madvise(addr: int, length: int, advice: int) -> int:
    return _libc_fns().madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), advice)


def _msync(addr: int, length: int) -> None:
    if _libc_fns().msync(ctypes.c_void_p(addr), ctypes.c_size_t(length), MS_SYNC) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"msync of an NVMe state range failed: {os.strerror(e)}")


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def check_writable(path: str | os.PathLike | None, what: str = "offload(device='nvme')") -> str:
    """`path` as an absolute directory this process can create files in, or ConfigError.
    Only its last level may be missing (then it is created): a missing parent is refused."""
    if path is None or str(path) == "":
        raise ConfigError(f"{what} needs path=<a directory on a fast local disk> to hold the state files")
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    if not os.path.exists(path) and not os.path.exists(parent):
        # a missing mount point or a typo: creating the whole chain (as root, on the root disk)
        # would put "NVMe" state on whatever disk holds `/`
        raise ConfigError(f"{what}: neither path {path!r} nor its parent {parent!r} exists; pass a directory on a "
                          "fast local disk (dsfn creates at most the last level of it)")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".dsfn-probe-{os.getpid()}-{next(_counter)}")
        with open(probe, "wb") as f:
            f.write(b"x")
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{what}: path {path!r} is not a writable directory ({e.strerror or e}); "
                          "pass a directory this process can create files in") from None
    return path


class FileStore:
    """File-backed tensors in a private directory under `path` (see the module docstring)."""

    def __init__(self, path: str | os.PathLike | None):
        root = check_writable(path)
        self.root = root
        clean_stale_stores(root)
        self.dir = os.path.join(root, f"{_STORE_PREFIX}{_host()}-{os.getpid()}-{next(_counter)}")
        os.makedirs(self.dir, exist_ok=False)
        self.closed = False
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.dir, True)
        atexit.register(self._finalizer)

    def alloc(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """Fresh zero-filled file-backed tensors of the given (shape, dtype); one file, each
        tensor page-aligned. Raises NvmeSpaceError when the disk cannot hold them."""
        if self.closed:
            raise ConfigError(f"the NVMe store {self.dir} was closed; make a new offload transform")
        offsets, total = [], 0
        for shape, dtype in specs:
            offsets.append(total)
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            total += _round_up(max(nbytes, 1), PAGE)
        total = max(total, PAGE)
        with _lock:
            name = os.path.join(self.dir, f"state-{next(_counter):08d}.bin")
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                _fallocate(fd, 0, total)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise NvmeSpaceError(f"offload(device='nvme'): no space for {total / 2**20:.1f} MiB of state "
                                         f"under {self.root} ({e.strerror or e}); free space or pass another "
                                         "path. The state was not changed.") from None
                raise
            buf = torch.from_file(name, shared=True, size=total, dtype=torch.uint8)
            _register(buf.data_ptr(), buf.data_ptr() + total)
        finally:
            os.close(fd)
            os.unlink(name)      # the mapping keeps the data; the space returns with the last reference
        out = []
        for (shape, dtype), off in zip(specs, offsets):
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            out.append(buf[off:off + nbytes].view(dtype).view(shape))
        return out

    def store(self, tensors: Sequence[torch.Tensor], subgroup_bytes: int = 64 << 20) -> list[torch.Tensor]:
        """Copies of `tensors` in a fresh file, written in sub-groups of about
        `subgroup_bytes`; each sub-group is released from resident memory once written."""
        dst = self.alloc([(tuple(t.shape), t.dtype) for t in tensors])
        group: list[torch.Tensor] = []
        size = 0
        for d, t in zip(dst, tensors):
            d.copy_(t)
            group.append(d)
            size += d.numel() * d.element_size()
            if size >= subgroup_bytes:
                release(group)
                group, size = [], 0
        release(group)
        drain()
        return dst

    def close(self) -> None:
        """Remove the directory (mapped tensors stay valid: their files are already unlinked)."""
        self.closed = True
        self._finalizer()


_STORE_PREFIX = "dsfn-nvme-"


def _host() -> str:
    return "".join(c if c.isalnum() else "_" for c in os.uname().nodename) or "host"


def clean_stale_stores(root: str) -> list[str]:
    """Remove store directories under `root` left by processes of this host that are gone
    (a SIGKILLed run cannot clean up; its files were unlinked already, so only the empty
    directory remains). Directories of other hosts (a shared path) are left alone."""
    removed = []
    prefix = f"{_STORE_PREFIX}{_host()}-"
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].split("-")[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True          # exists, owned by someone else
    return True


def _register(start: int, end: int) -> None:
    """Remember a new mapping; ranges it overlaps belonged to mappings already gone (the
    kernel reuses their addresses), so they are dropped. Stale entries can only make the
    check below more lenient, never fail a valid call."""
    with _lock:
        for s in [s for s, e in _mapped.items() if s < end and start < e]:
            del _mapped[s]
        _mapped[start] = end


def _check_mapped(t: torch.Tensor, what: str) -> None:
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    with _lock:
        ok = any(s <= lo and hi <= e for s, e in _mapped.items())
    if not ok:
        raise RuntimeError(f"dsfn internal error: nvme.{what} of a tensor that is not in an NVMe state file "
                           f"(address {lo:#x}); refusing to madvise anonymous memory")


def _ranges(tensors: Sequence[torch.Tensor], what: str) -> list[tuple[int, int]]:
    """The page-aligned (address, length) of each (file-backed, this module's) tensor."""
    out = []
    for t in tensors:
        n = t.numel() * t.element_size()
        if n == 0:
            continue
        _check_mapped(t, what)
        start = t.data_ptr() // PAGE * PAGE
        out.append((start, _round_up(t.data_ptr() + n - start, PAGE)))
    return out


def prefetch(tensors: Sequence[torch.Tensor]) -> None:
    """Ask the kernel to read the pages of file-backed tensors ahead, asynchronously
    (madvise(MADV_WILLNEED)); the disk reads overlap whatever runs next."""
    for addr, n in _ranges(tensors, "prefetch"):
        _madvise(addr, n, MADV_WILLNEED)


class _Writeback:
    """One background thread writing released ranges back and evicting them (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, ranges: list[tuple[int, int]], keep_alive: Sequence[torch.Tensor]) -> None:
        """Write back `ranges` in the background. `keep_alive`: the tensors whose memory they
        are; the job holds them so the mapping cannot be unmapped (and its addresses reused by
        other memory) before the job is done."""
        self.drain()                       # at most one sub-group in flight
        if not ranges:
            return
        th = threading.Thread(target=self._run, args=(ranges, list(keep_alive)), name="dsfn-nvme-writeback",
                              daemon=True)
        with self._lock:
            self._thread = th
        th.start()

    def _run(self, ranges: list[tuple[int, int]], keep_alive: list[torch.Tensor]) -> None:
        try:
            for addr, n in ranges:
                _msync(addr, n)                     # dirty pages to disk
                _madvise(addr, n, MADV_PAGEOUT)     # clean pages out of the page cache (EINVAL: old kernel)
                _madvise(addr, n, MADV_DONTNEED)    # and out of this process
        except BaseException as e:  # noqa: BLE001 (raised by the next drain, on the caller's thread)
            self._error = e
        finally:
            keep_alive.clear()

    def drain(self) -> None:
        with self._lock:
            th, self._thread = self._thread, None
        if th is not None:
            th.join()
        err, self._error = self._error, None
        if err is not None:
            raise DsfnError(f"offload(device='nvme'): writing state back to disk failed: {err}") from err


_writeback = _Writeback()


def release(tensors: Sequence[torch.Tensor]) -> None:
    """Write file-backed tensors back to disk and drop them from host memory, in the
    background (the data stays in the file; see the module docstring). Waits for the
    previous release's write-back first."""
    _writeback.submit(_ranges(tensors, "release"), tensors)


def drain() -> None:
    """Wait until every released range is written back and evicted."""
    _writeback.drain()


def page_cache_bytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s (file-backed) pages present in host memory, mapped or only cached
    (mincore): what `release` is meant to bring to ~0."""
    ranges = _ranges([t], "page_cache_bytes")
    total = 0
    for addr, n in ranges:
        vec = (ctypes.c_ubyte * (n // PAGE))()
        if _libc_fns().mincore(ctypes.c_void_p(addr), ctypes.c_size_t(n), vec) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"mincore failed: {os.strerror(e)}")
        total += sum(v & 1 for v in vec) * PAGE
    return total


def mapped_files(root: str) -> dict[str, dict[str, int]]:
    """{file: {"size": bytes mapped, "rss": resident bytes}} for this process's mappings of
    files under `root` (from /proc/self/smaps; unlinked files included)."""
    root = os.path.abspath(root)
    out: dict[str, dict[str, int]] = {}
    cur = None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
                name = " ".join(parts[5:]).removesuffix(" (deleted)") if len(parts) > 5 else ""
                cur = out.setdefault(name, {"size": 0, "rss": 0}) if name.startswith(root) else None
            elif cur is not None and parts[0] == "Size:":
                cur["size"] += int(parts[1]) * 1024
            elif cur is not None and parts[0] == "Rss:":
                cur["rss"] += int(parts[1]) * 1024
    return out


def is_file_backed(t: torch.Tensor, root: str) -> bool:
    """Whether `t`'s memory lies in a mapping of a file under `root`."""
    root = os.path.abspath(root)
    p = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= p < hi:
                return len(parts) > 5 and parts[5].startswith(root)
    return False
