"""Host memory of save, load and export, measured as the process's resident high-water
mark (Linux `VmHWM`, reset through `/proc/self/clear_refs`) around the call:

- load: peak <= this rank's target shard + SLACK, well inside the required bound of the
  shard + the largest single tensor (the reader reads straight into the result; SLACK
  covers two checksum blocks of scratch);
- save: peak <= SLACK (nothing is staged: tensors go to disk from their own memory);
- export: peak <= the largest tensor + SLACK (one output tensor at a time).
"""
import ctypes
import re
import warnings

import pytest
import torch

from dsfn import checkpoint as ck
from dsfn import tree
from dsfn.runtime import init_mesh
from dsfn.state.layout import FlatShard, Replicated, gather_tree, place
from dsfn.testing import run_on_ranks

MB = 1 << 20
# 6 x 8 MiB + one 16 MiB tensor (4M fp32); sizes not divisible by 3 or 4 so shards pad
SHAPES = {f"w{i}": (1023, 2049) for i in range(6)} | {"big": (4096, 1025)}


def _logical():
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _nbytes(t):
    return t.numel() * t.element_size()


def _placed(values, kind):
    return {k: place(v, FlatShard("dp", tuple(v.shape)) if kind == "flat" else Replicated(tuple(v.shape)))
            for k, v in values.items()}


def _status(key):
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _honest_allocator():
    """glibc settings under which resident memory tracks live memory: blocks over 128 KiB
    are mmapped and unmapped when freed (the process may have inherited
    `dsfn.runtime.env.tune_host_allocator`'s keep-everything settings), free heap trimmed."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 128 << 10)        # M_MMAP_THRESHOLD
    libc.mallopt(-1, 128 << 10)        # M_TRIM_THRESHOLD
    libc.malloc_trim(0)


def _peak_during(fn):
    """(fn(), resident high-water mark during fn minus resident memory before it, bytes).

    Run fn once first, unmeasured: the first call pages in code (file-backed resident
    pages of libtorch) and makes process groups, which is not what is measured here."""
    fn()
    _honest_allocator()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                   # resets VmHWM to the current VmRSS
    before = _status("VmRSS")
    out = fn()
    return out, _status("VmHWM") - before


def _save(root):
    init_mesh()
    state = _placed(_logical(), "flat")
    _, peak = _peak_during(lambda: ck.save(root, state, step=1))
    return peak


def _load(root, kind):
    init_mesh()
    like = _placed({k: torch.zeros(s) for k, s in SHAPES.items()}, kind)
    shard = sum(_nbytes(x) for x in tree.leaves(like))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # other world size: RNG states not restored
        loaded, peak = _peak_during(lambda: ck.load(root, like))
    want, got = _logical(), gather_tree(loaded)
    ok = all(torch.equal(want[k], got[k]) for k in SHAPES)
    return peak, shard, ok


LARGEST = max(_nbytes(torch.empty(s)) for s in SHAPES.values())
SLACK = 4 * MB          # two 1 MiB checksum blocks + Python objects; every tensor here is 8 MiB+


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mem"))
    peaks = run_on_ranks(_save, 2, root, timeout=120)
    return root, peaks


def test_save_stages_nothing(saved):
    _, peaks = saved
    for rank, peak in enumerate(peaks):
        assert peak <= SLACK, f"rank {rank}: saving raised resident memory by {peak / MB:.1f} MiB"


@pytest.mark.parametrize("world,kind", [(4, "flat"), (3, "flat"), (1, "rep")])
def test_load_peak_is_the_shard_plus_one_tensor(saved, world, kind):
    root, _ = saved
    for rank, (peak, shard, ok) in enumerate(run_on_ranks(_load, world, root, kind, timeout=120)):
        assert ok, f"rank {rank}: loaded values differ"
        assert peak <= shard + SLACK < shard + LARGEST, (f"world {world} rank {rank}: load peak {peak / MB:.1f} "
                                                         f"MiB > shard {shard / MB:.1f} MiB + {SLACK / MB} MiB")


def _export(root, out):
    _, peak = _peak_during(lambda: ck.export(root, out, format="hf", prefix=""))
    return peak


def test_export_peak_is_one_tensor_plus_one_slice(saved, tmp_path):
    root, _ = saved
    (peak,) = run_on_ranks(_export, 1, root, str(tmp_path), timeout=120)
    assert peak <= LARGEST + SLACK, f"export peak {peak / MB:.1f} MiB"
    from safetensors.torch import load_file
    got = load_file(str(tmp_path / "model.safetensors"))
    want = _logical()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def _files_opened(root):
    """Load into this rank's flat shards; the data files the load opened."""
    from dsfn.checkpoint import reader
    init_mesh()
    like = _placed({k: torch.zeros(s) for k, s in SHAPES.items()}, "flat")
    opened = set()
    real = reader.Reader.get

    def get(self, name):
        opened.add(name)
        return real(self, name)
    reader.Reader.get = get
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ck.load(root, like)
    finally:
        reader.Reader.get = real
    return sorted(opened)


def test_load_opens_only_the_files_holding_its_slices(saved):
    """2-rank flat shards loaded at world 4: ranks 0-1 need only rank 0's half, ranks 2-3 rank 1's;
    the other file is not even opened (its header is not read)."""
    root, _ = saved
    for rank, opened in enumerate(run_on_ranks(_files_opened, 4, root, timeout=120)):
        assert opened == [f"rank_{rank // 2:05d}.safetensors"], (rank, opened)
