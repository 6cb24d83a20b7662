"""The bucket copy ops (runtime/bucket_ops.py) against plain torch, and torch.library's own
checks of their schemas and fake kernels."""

from __future__ import annotations

import pytest
import torch

from zerocompile.runtime.bucket_ops import divide_reduced, pack_gradients, pack_shards, unpack_gathered_bucket


def _reference_unpack(gathered, world, chunks):
    rows, out, offset = gathered.view(world, -1), [], 0
    for chunk in chunks:
        out.append(rows[:, offset:offset + chunk].reshape(-1).clone())
        offset += chunk
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpack_gathered_bucket_is_slices_of_the_rows(world, dtype):
    chunks = [5, 1, 12, 3]
    gathered = torch.randn(world * sum(chunks)).to(dtype)
    got = unpack_gathered_bucket(gathered, world, chunks)
    want = _reference_unpack(gathered, world, chunks)
    assert len(got) == len(chunks)
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.is_contiguous() and torch.equal(g, w)
        # a new tensor, never a view of the bucket (world 1 included): the bucket is freed after
        assert g.untyped_storage().data_ptr() != gathered.untyped_storage().data_ptr()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_pack_gradients_puts_chunk_r_of_every_gradient_in_row_r(world):
    grads = [torch.randn(world * c) for c in (3, 1, 7)]
    got = pack_gradients(grads, world)
    want = torch.cat([g.view(world, -1) for g in grads], dim=1).reshape(-1)
    assert torch.equal(got, want)
    # what rank r receives from a reduce-scatter of it: chunk r of each gradient, in order
    rows = got.view(world, -1)
    for r in range(world):
        assert torch.equal(rows[r], torch.cat([g.view(world, -1)[r] for g in grads]))


def test_pack_shards_is_cat():
    shards = [torch.randn(n) for n in (4, 1, 9)]
    assert torch.equal(pack_shards(shards), torch.cat(shards))


def _generated_division(x, divisor):
    return x / divisor


@pytest.mark.parametrize("divisor", [2, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_divide_reduced_is_the_quotient_aten_and_inductor_compute(divisor, dtype):
    """The average the bucketing pass writes as an op is bitwise what ``aten.div`` and
    inductor's generated kernel compute, which is what it replaces; a new tensor."""
    reduced = (torch.randn(1000, generator=torch.Generator().manual_seed(divisor)) * 1e3).to(dtype)
    got = divide_reduced(reduced, float(divisor))
    assert got.dtype == dtype and got.untyped_storage().data_ptr() != reduced.untyped_storage().data_ptr()
    assert torch.equal(got, torch.ops.aten.div.Tensor(reduced, divisor))
    torch._dynamo.reset()                 # one compile per case, not a recompile of the last one's
    generated = torch.compile(_generated_division, backend="inductor", fullgraph=True, dynamic=False)
    assert torch.equal(got, generated(reduced, divisor))


@pytest.mark.parametrize("op, args", [
    (unpack_gathered_bucket, lambda: (torch.randn(2 * 9), 2, [4, 5])),
    (pack_shards, lambda: ([torch.randn(4), torch.randn(5)],)),
    (pack_gradients, lambda: ([torch.randn(4), torch.randn(6)], 2)),
    (divide_reduced, lambda: (torch.randn(6), 2.0)),
], ids=["unpack_gathered_bucket", "pack_shards", "pack_gradients", "divide_reduced"])
def test_opcheck(op, args):
    """Schema, fake kernel and aliasing as torch.library checks them for custom ops."""
    torch.library.opcheck(op, args(), test_utils=("test_schema", "test_faketensor"))
