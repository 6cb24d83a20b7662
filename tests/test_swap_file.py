"""The NVMe offload I/O engine (``runtime/swap_file.py``): tensors go to a file and come back
bit for bit, with O_DIRECT and buffered; a bad path and a full disk are clear errors at setup;
the file is deleted when closed or collected."""

from __future__ import annotations

import errno
import gc
import os

import pytest
import torch

from zerocompile.runtime.swap_file import PAGE, SwapFile, SwapFileError, aligned_empty


def test_aligned_empty_is_page_aligned_and_padded():
    for numel, dtype in ((1, torch.float32), (1025, torch.bfloat16), (3 * PAGE + 1, torch.uint8)):
        t = aligned_empty(numel, dtype)
        assert t.numel() == numel and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % PAGE == 0
        room = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
        assert room >= -(-numel * t.element_size() // PAGE) * PAGE


@pytest.mark.parametrize("direct", [True, False])
def test_tensors_round_trip_bit_for_bit(tmp_path, direct):
    swap = SwapFile(tmp_path, "test", threads=4, block_bytes=2 * PAGE, direct=direct)
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(1, generator=g), "b": torch.randn(5000, generator=g).to(torch.bfloat16),
               "c": torch.randn(3 * 2 * PAGE // 4 + 7, generator=g), "empty": torch.zeros(0)}
    pending = []
    for key, value in tensors.items():
        region = swap.reserve(key, value.numel() * value.element_size())
        assert region.offset % PAGE == 0
        buf = aligned_empty(value.numel(), value.dtype)
        buf.copy_(value)
        pending.append(swap.write(key, buf))
    for transfer in pending:
        transfer.wait()
    assert os.path.getsize(swap.path) == swap.size
    for key, value in tensors.items():
        out = aligned_empty(value.numel(), value.dtype)
        swap.read(key, out).wait()
        assert torch.equal(out, value), key
    if direct:
        assert swap.direct      # ext4 here supports O_DIRECT
    path = swap.path
    swap.close()
    assert swap.closed and not os.path.exists(path)


def test_o_direct_refuses_unaligned_buffers_and_sizes_must_match(tmp_path):
    swap = SwapFile(tmp_path, "t", direct=True)
    swap.reserve("x", 400)
    if swap.direct:
        unaligned = torch.empty(101)[1:]
        with pytest.raises(ValueError, match="page-aligned buffer"):
            swap.write("x", unaligned)
    with pytest.raises(ValueError, match="writing 404 bytes at byte 0 of region 'x' of 400"):
        swap.write("x", aligned_empty(101, torch.float32))
    with pytest.raises(ValueError, match="reading 404 bytes at byte 0 of region 'x' of 400"):
        swap.read("x", aligned_empty(101, torch.float32))
    if swap.direct:
        with pytest.raises(ValueError, match="O_DIRECT transfers start at multiples of 4096 bytes, not 8"):
            swap.read("x", aligned_empty(2, torch.float32), start=8)
    with pytest.raises(ValueError, match="region 'x' has 400 bytes, not 8"):
        swap.reserve("x", 8)
    swap.close()


@pytest.mark.parametrize("direct", [True, False])
def test_partial_transfers_at_page_offsets(tmp_path, direct):
    """Tiles of a region go and come back on their own (the optimizer step streams tiles)."""
    swap = SwapFile(tmp_path, "tiles", block_bytes=PAGE, direct=direct)
    n, tile = 5000, 2048                      # 2048 fp32 = two pages per tile; the last tile partial
    swap.reserve("m", n * 4)
    full = torch.arange(n, dtype=torch.float32)
    buf = aligned_empty(tile, torch.float32)
    for a in range(0, n, tile):
        b = min(a + tile, n)
        buf[: b - a].copy_(full[a:b])
        swap.write("m", buf[: b - a], start=a * 4).wait()
    out = aligned_empty(n, torch.float32)
    swap.read("m", out).wait()
    assert torch.equal(out, full)
    piece = aligned_empty(tile, torch.float32)
    swap.read("m", piece[: n - 2 * tile], start=2 * tile * 4).wait()
    assert torch.equal(piece[: n - 2 * tile], full[2 * tile :])
    swap.close()


def test_file_deleted_when_collected(tmp_path):
    swap = SwapFile(tmp_path, "gc")
    path = swap.path
    assert os.path.exists(path)
    del swap
    gc.collect()
    assert not os.path.exists(path)


def test_two_swap_files_of_one_name_in_one_directory_keep_their_own_bytes(tmp_path):
    """Two optimizers of one process offloading to the same nvme_path (same name, same rank):
    the second gets a file of its own, so neither reads the other's tensors."""
    a, b = SwapFile(tmp_path, "optimizer-rank0"), SwapFile(tmp_path, "optimizer-rank0")
    assert a.path != b.path and os.path.basename(b.path).startswith("zerocompile-optimizer-rank0-pid")
    for swap, value in ((a, 1.0), (b, 2.0)):
        swap.reserve("m", PAGE)
        src = aligned_empty(PAGE // 4, torch.float32)
        src.fill_(value)
        swap.write("m", src).wait()
    for swap, value in ((a, 1.0), (b, 2.0)):
        out = aligned_empty(PAGE // 4, torch.float32)
        swap.read("m", out).wait()
        assert torch.equal(out, torch.full((PAGE // 4,), value))
    a.close()
    b.close()
    assert os.listdir(tmp_path) == []


def test_bad_path_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(SwapFileError, match=r"cannot create nvme_path .*a_file/sub.*give a writable directory"):
        SwapFile(blocker / "sub", "x")
    with pytest.raises(SwapFileError, match="cannot create nvme_path '/proc/zerocompile"):
        SwapFile("/proc/zerocompile", "x")


def test_full_disk_is_a_clear_error_when_space_is_reserved(tmp_path, monkeypatch):
    """posix_fallocate reports ENOSPC at reserve time (simulated: filling a real disk in a test
    is not an option), before any optimizer state is written."""
    swap = SwapFile(tmp_path, "full")

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(SwapFileError, match=r"not enough space in nvme_path .* to reserve 8192 bytes \(\d+ bytes "
                                            r"free\); free space or point nvme_path elsewhere"):
        swap.reserve("big", 5000)
    assert "big" not in swap.regions
    swap.close()
