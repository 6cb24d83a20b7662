"""How a flat shard looks to ``torch.distributed.checkpoint`` (DCP): ``ShardView``.

A zerocompile shard is a slice ``[start, stop)`` of a parameter flattened in row-major order
(``runtime/sharded_param.py``). DCP describes what each rank holds as boxes of the tensor's
*own* shape: an offset and a size per dimension. A flat slice of an N-D tensor is a union of
such boxes, each of them contiguous in the flat order (``flat_range_boxes``), so a shard can
be saved and loaded in the parameter's real shape. That makes a zerocompile checkpoint
interchangeable with one of the unsharded model: same keys, same shapes, and DCP reshards
between any two layouts by intersecting boxes.

``ShardView`` is a tensor of the parameter's global shape without storage; it hands DCP its
boxes through DCP's ``_Checkpointable`` protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``; see ``zerocompile/_torch_compat.py``).
Each box is a view into the flat shard, so loading writes into the shard in place.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from zerocompile import _torch_compat


def flat_range_boxes(shape: tuple, start: int, stop: int) -> list[tuple[tuple, tuple]]:
    """The flat row-major range ``[start, stop)`` of a tensor of ``shape`` as ``(offsets, sizes)``
    boxes, in flat order. Each box fixes a prefix of indices, spans a range of one dimension and
    all of the later ones, so its elements are contiguous in the flat order. At most
    ``2 * len(shape) - 1`` boxes."""
    if start >= stop:
        return []
    if len(shape) == 0:
        return [((), ())]
    row = math.prod(shape[1:])
    first, end = divmod(start, row), divmod(stop, row)
    if first[1] == 0 and end[1] == 0:                      # whole rows
        return [((first[0],) + (0,) * (len(shape) - 1), (end[0] - first[0],) + tuple(shape[1:]))]
    if (stop - 1) // row == first[0]:                      # inside one row
        base = first[0] * row
        return [((first[0],) + off, (1,) + size)
                for off, size in flat_range_boxes(shape[1:], start - base, stop - base)]
    head = (first[0] + 1) * row if first[1] else start     # partial first row, whole rows, partial last row
    tail = end[0] * row
    return flat_range_boxes(shape, start, head) + flat_range_boxes(shape, head, tail) + \
        flat_range_boxes(shape, tail, stop)


class ShardView(torch.Tensor):
    """The elements ``[start, start + flat.numel())`` of a tensor of ``shape`` (row-major), held
    in the 1-D ``flat``, as DCP sees them. No torch operation runs on it: it only answers DCP."""

    @staticmethod
    def __new__(cls, flat: torch.Tensor, shape: tuple, start: int):
        if flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError(f"ShardView needs a contiguous 1-D tensor, got shape {tuple(flat.shape)}")
        shape = torch.Size(shape)
        if start < 0 or start + flat.numel() > shape.numel():
            raise ValueError(f"ShardView: elements [{start}, {start + flat.numel()}) outside a tensor "
                             f"of shape {tuple(shape)}")
        view = _torch_compat.storageless_tensor(cls, shape, flat.dtype, flat.device)
        view._pieces = []
        pos = 0
        for offsets, sizes in flat_range_boxes(tuple(shape), start, start + flat.numel()):
            n = math.prod(sizes)
            view._pieces.append((torch.Size(offsets), flat[pos:pos + n].view(sizes)))
            pos += n
        view._properties = TensorProperties(dtype=flat.dtype)
        return view

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise NotImplementedError(
            f"zerocompile: {func} on a ShardView; it only describes a shard to "
            "torch.distributed.checkpoint")

    def __repr__(self, *args, **kwargs):
        return f"ShardView(shape={tuple(self.shape)}, dtype={self.dtype}, boxes={len(self._pieces)})"

    # -- DCP's _Checkpointable protocol --------------------------------------------------
    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, piece.shape),
                                                      properties=self._properties, size=self.shape))
                for offsets, piece in self._pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets, piece.shape) for offsets, piece in self._pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, piece in self._pieces:
            if offsets == index.offset:
                return piece
        raise ValueError(f"zerocompile: no box at offset {index.offset} for '{index.fqn}'")
