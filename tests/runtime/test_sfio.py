"""`dsfn.runtime.sfio`: files are standard safetensors; any element range reads back
exactly; a flipped byte is caught by exactly the reads that cover its checksum block."""
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsfn.errors import CheckpointError
from dsfn.runtime import sfio

BLOCK = 64          # small blocks: every tensor spans several


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(37, 5, generator=g), "b": torch.randint(0, 100, (50,), generator=g),
            "c": torch.randn(3, generator=g).to(torch.bfloat16), "s": torch.tensor(7.5), "e": torch.zeros(0, 4),
            "m": torch.rand(9, generator=g) > 0.5}


def _write(path):
    items = list(_tensors().items())
    entries = [(n, t.dtype, tuple(t.shape)) for n, t in sorted(items, key=lambda kv: (-kv[1].element_size(), kv[0]))]
    w = sfio.Writer(str(path), entries, {"k": "v"}, block_size=BLOCK)
    for n, _, _ in entries:
        w.write(n, dict(items)[n])
    return w.close()


def test_files_are_standard_safetensors(tmp_path):
    from safetensors.torch import load_file
    record = _write(tmp_path / "f.safetensors")
    got = load_file(str(tmp_path / "f.safetensors"))
    for k, v in _tensors().items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v)
    assert record["bytes"] == os.path.getsize(tmp_path / "f.safetensors")


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["a", "b", "c", "m"]), data=st.data())
def test_any_element_range_reads_back_exactly(tmp_path_factory, name, data):
    path = tmp_path_factory.mktemp("r") / "f.safetensors"
    record = _write(path)
    want = _tensors()[name].reshape(-1)
    start = data.draw(st.integers(0, want.numel()))
    stop = data.draw(st.integers(start, want.numel()))
    f = sfio.File(str(path), record)
    try:
        out = torch.empty(stop - start, dtype=want.dtype)
        f.read_into(name, start, out)
    finally:
        f.close()
    assert torch.equal(out, want[start:stop])


def _flip(path, offset):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x10]))


def test_flipped_byte_is_caught_by_reads_of_its_block_only(tmp_path):
    path = str(tmp_path / "f.safetensors")
    record = _write(path)
    f = sfio.File(path, record)
    dtype, _, lo, hi = f.entries["a"]
    data_start = f.data_start
    f.close()
    _flip(path, data_start + lo + 2 * BLOCK + 3)              # inside block 2 of tensor "a"
    f = sfio.File(path, record)
    try:
        assert torch.equal(f.read("b"), _tensors()["b"])        # other tensors read fine
        first = torch.empty(BLOCK // 4, dtype=dtype)            # block 0 of "a": fine
        f.read_into("a", 0, first)
        with pytest.raises(CheckpointError, match=r"block 2 of tensor 'a'"):
            f.read_into("a", 2 * BLOCK // 4 + 5, torch.empty(1, dtype=dtype))   # one element of block 2
    finally:
        f.close()
    f = sfio.File(path, record)
    with pytest.raises(CheckpointError, match="corrupt"):
        f.check_all()
    f.close()


def test_header_damage_and_truncation_are_caught(tmp_path):
    path = str(tmp_path / "f.safetensors")
    record = _write(path)
    _flip(path, 8 + 3)                                         # inside the JSON header
    with pytest.raises(CheckpointError, match="corrupt"):
        sfio.File(path, record)
    record = _write(path)
    with open(path, "r+b") as fh:
        fh.truncate(record["bytes"] - 1)
    with pytest.raises(CheckpointError, match="truncated"):
        sfio.File(path, record)
    with pytest.raises(CheckpointError, match="no checksums"):
        sfio.File(path, {})


def test_direct_and_buffered_writes_give_the_same_file(tmp_path):
    """O_DIRECT goes through an aligned staging buffer and truncates its padded tail; the
    bytes must be exactly those of a plain buffered write (sizes around the buffer and the
    alignment included)."""
    g = torch.Generator().manual_seed(1)
    items = [("big", torch.randn(sfio.BOUNCE_SIZE // 4 + 1000, generator=g)),
             ("odd", torch.randint(0, 9, (4097,), dtype=torch.uint8, generator=g)), ("s", torch.tensor(3))]
    ra = sfio.write_file(str(tmp_path / "d.st"), items, direct=True)
    rb = sfio.write_file(str(tmp_path / "b.st"), items, direct=False)
    assert ra == rb
    assert (tmp_path / "d.st").read_bytes() == (tmp_path / "b.st").read_bytes()
    assert os.path.getsize(tmp_path / "d.st") == ra["bytes"]


def _write_from_rank(root, items):
    import torch.distributed as dist
    r = dist.get_rank()
    # every rank writes different bytes at the same time through its staging buffer
    return sfio.write_file(f"{root}/r{r}.st", [(n, t + r) for n, t in items])


def test_forked_ranks_do_not_share_the_staging_buffer(tmp_path):
    from safetensors.torch import load_file

    from dsfn.testing import run_on_ranks
    sfio.write_file(str(tmp_path / "warm.st"), [("x", torch.zeros(10))])     # the parent's buffer exists
    items = [("x", torch.arange(3 * sfio.BOUNCE_SIZE // 8, dtype=torch.float64))]
    run_on_ranks(_write_from_rank, 2, str(tmp_path), items, timeout=60)
    for r in range(2):
        assert torch.equal(load_file(str(tmp_path / f"r{r}.st"))["x"], items[0][1] + r)


def test_a_one_element_view_with_a_stride_reads_as_its_bytes():
    """A 1-element column of a [n, c] buffer (ZeRO's shard of a 1-element bias) is contiguous
    to torch but has stride c: its bytes are still the element's."""
    from dsfn.runtime.sfio import byte_view
    buf = torch.arange(6, dtype=torch.float32).view(2, 3)
    one = buf[:, 1][:1]
    assert one.is_contiguous() and one.stride(0) == 3
    assert bytes(byte_view(one)) == bytes(byte_view(torch.tensor([1.0])))
