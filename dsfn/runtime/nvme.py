"""File-backed ("NVMe") tensors for `offload("nvme", path=...)`.

A `FileStore` owns a private directory under the user's `path`. `alloc` makes one file
per call, pre-allocates it (`posix_fallocate`, so a full disk fails *here*, before any
state is computed from it), maps it shared (`torch.from_file(..., shared=True)`, an
mmap) and unlinks it at once: the tensors stay valid for as long as any of them is
referenced (the mapping keeps the inode), the disk space returns when the last one is
freed, and a crash never leaves files behind. Each tensor starts on its own page, so
`release` (madvise(MADV_DONTNEED) over its pages) drops it from this process's resident
memory without touching any other tensor; the data stays in the file (page cache / disk)
and is read back on the next access.

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


def _madvise(addr: int, length: int, advice: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL("libc.so.6", use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), advice)


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def check_writable(path: str | os.PathLike | None, what: str = "offload(device='nvme')") -> str:
    """`path` as an absolute directory this process can create files in, or ConfigError."""
    if path is None or str(path) == "":
        raise ConfigError(f"{what} needs path=<a directory on a fast local disk> to hold the state files")
    path = os.path.abspath(os.fspath(path))
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
        self.dir = os.path.join(root, f"dsfn-nvme-{os.getpid()}-{next(_counter)}")
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
        return dst

    def close(self) -> None:
        """Remove the directory (mapped tensors stay valid: their files are already unlinked)."""
        self.closed = True
        self._finalizer()


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


def _advise(tensors: Sequence[torch.Tensor], advice: int, what: str) -> None:
    """madvise every page of each (file-backed, this module's) tensor."""
    for t in tensors:
        n = t.numel() * t.element_size()
        if n == 0:
            continue
        _check_mapped(t, what)
        start = t.data_ptr() // PAGE * PAGE
        _madvise(start, _round_up(t.data_ptr() + n - start, PAGE), advice)


def prefetch(tensors: Sequence[torch.Tensor]) -> None:
    """Ask the kernel to read the pages of file-backed tensors ahead, asynchronously
    (madvise(MADV_WILLNEED)); the disk reads overlap whatever runs next."""
    _advise(tensors, MADV_WILLNEED, "prefetch")


def release(tensors: Sequence[torch.Tensor]) -> None:
    """Drop the pages of file-backed tensors from resident memory (the data stays in the file)."""
    _advise(tensors, MADV_DONTNEED, "release")


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
