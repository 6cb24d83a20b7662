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
``__create_chunk_list__``, ``__get_tensor_shard__``; see ``zerocompile/_torch_compat/tensors.py``).
Each box is a view into the flat shard, so loading writes into the shard in place.

``sharded_tensor`` wraps a ``ShardView`` in a ``DTensor`` over the shard's process group: the
value ``model.state_dict()`` gives for a parameter whose values live only in shards, and
``ZeroOptimizer.state_dict()`` for sharded optimizer state, as FSDP2 gives DTensors. torch's
``torch.distributed.checkpoint.state_dict`` helpers pass them through and DCP reads and writes
their boxes (a DTensor hands DCP's protocol to its local tensor); ``local_part`` reads one back.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

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
        view.flat = flat
        """The elements this view describes (a view of a shard, or a copy of one)."""
        view.start = start
        """Flat index of ``flat[0]`` in the whole tensor."""
        return view

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return args[0]
        if func is torch.ops.aten.view.default and tuple(args[1]) == tuple(args[0].shape):
            return ShardView(args[0].flat, args[0].shape, args[0].start)     # DTensor.from_local's view_as
        raise NotImplementedError(
            f"zerocompile: {func} on a sharded value (a DTensor over zerocompile's flat shards, from "
            "model.state_dict() or ZeroOptimizer.state_dict()): it holds this rank's elements for "
            "torch.distributed.checkpoint (dcp.save / dcp.load) and model/optimizer load_state_dict only. "
            "Save with dcp.save or zerocompile.save_checkpoint; for full values use "
            "zerocompile.full_state_dict(model) (StateDictOptions(full_state_dict=True) of torch's state-dict "
            "helpers cannot gather these shards), or zerocompile.gathered_parameters(model)")

    def __reduce_ex__(self, protocol):
        # torch.save of a per-rank state dict: the elements, not the storage-less wrapper
        return (ShardView, (self.flat.detach().clone(), tuple(self.shape), self.start))

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


def sharded_tensor(flat: torch.Tensor, shape: tuple, start: int, group) -> torch.Tensor:
    """The elements ``[start, start + flat.numel())`` of a tensor of ``shape`` held by this rank
    of the process group ``group`` (``flat``: 1-D, the rest lives on the other ranks), as a
    ``DTensor`` whose local tensor is a ``ShardView``. Placement ``Shard(0)`` (``Replicate()``
    for a 0-dim tensor, which one rank holds) says only that the value is distributed: where
    each element lives is what the ``ShardView`` tells DCP."""
    shape = torch.Size(shape)
    mesh = DeviceMesh.from_group(group, device_type=flat.device.type)
    view = ShardView(flat, shape, start)
    if len(shape) == 0:
        return DTensor.from_local(view, mesh, [Replicate()], run_check=False)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(view, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def local_part(value) -> ShardView | None:
    """The ``ShardView`` behind a value made by ``sharded_tensor`` (or a bare one), else None."""
    if isinstance(value, DTensor):
        value = value.to_local()
    return value if isinstance(value, ShardView) else None
