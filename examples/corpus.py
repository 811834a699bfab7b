"""A real text corpus that every machine with Python has: the standard library's sources.

The bytes of the stdlib's `*.py` files (site-packages excluded), in sorted path order,
joined by newlines and capped at `max_bytes`. Byte-level: token id = byte value
(vocab 256). Reading ~8 MB this way takes well under a second, so nothing is cached.

The same Python installation gives the same bytes; a different Python version gives a
different (but equally real) corpus.
"""
from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["batches", "decode", "encode", "load_corpus", "stdlib_root", "train_val_split"]

# Third-party code lives under the stdlib directory too; keep only the standard library.
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _source_files(root: Path) -> list[Path]:
    files = [p for p in root.rglob("*.py")
             if p.is_file() and not _EXCLUDED_DIRS.intersection(p.relative_to(root).parts)]
    # Sort on the relative POSIX path: the same order on every OS and Python version.
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(max_bytes: int = 8_000_000, root: str | Path | None = None) -> torch.Tensor:
    """The corpus as `uint8[N]`, N <= max_bytes (N == max_bytes unless the sources are smaller).

    Files are read whole, in sorted order, each followed by b"\\n", until `max_bytes` is reached.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = Path(root) if root is not None else stdlib_root()
    chunks: list[bytes] = []
    total = 0
    for path in _source_files(root):
        try:
            chunk = path.read_bytes() + b"\n"
        except OSError:       # an unreadable file (permissions, broken link): skip it
            continue
        chunks.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    if total == 0:
        raise FileNotFoundError(f"no readable *.py files under {root}")
    data = b"".join(chunks)[:max_bytes]
    # bytearray: torch.frombuffer wants a writable buffer.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def train_val_split(data: torch.Tensor, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Split `uint8[N]` into (train, val): the last `val_fraction` is held out.

    Because files are in sorted order the validation bytes come from files the model
    never trains on.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = max(1, int(len(data) * val_fraction))
    return data[:-n_val], data[-n_val:]


def batches(data: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0
            ) -> Iterator[dict[str, torch.Tensor]]:
    """Infinite, deterministic stream of random windows of `data` (uint8[N]).

    Yields {"input_ids": Long[B, T], "labels": Long[B, T]} with labels[b, t] the byte after
    input_ids[b, t]. The same (data, batch_size, seq_len, seed) gives the same stream on
    every rank, which is what data parallelism over a *global* batch needs.
    """
    n_windows = len(data) - seq_len       # window start o needs data[o : o + T + 1]
    if n_windows <= 0:
        raise ValueError(f"corpus of {len(data)} bytes is too short for seq_len={seq_len}")
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, n_windows, (batch_size, 1), generator=g)
        window = data[starts + offsets].long()               # [B, T + 1]
        yield {"input_ids": window[:, :-1].contiguous(), "labels": window[:, 1:].contiguous()}


def encode(text: str) -> torch.Tensor:
    """str -> Long[len(utf-8 bytes)]."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(ids: torch.Tensor) -> str:
    """Long[T] of byte values -> str (invalid UTF-8 replaced, so any sample prints)."""
    return bytes(int(i) & 0xFF for i in ids.tolist()).decode("utf-8", errors="replace")
