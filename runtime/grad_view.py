"""What ``p.grad`` shows of a gradient that lives in flat shards: a ``DTensor``.

A zerocompile shard is the slice ``[rank * chunk, (rank + 1) * chunk)`` of the parameter
flattened and zero-padded to ``chunk * world`` elements, ``chunk = ceil(numel / world)``
(``runtime/sharded_param.py``). DTensor's ``Shard(0)`` of a 1-D tensor of ``numel`` elements
cuts it the same way (``torch.chunk``: ``ceil(numel / world)`` elements per rank, the last
ranks shorter or empty), so this rank's shard gradient without its padding *is* the local
part of the flattened gradient as a ``DTensor``. torch's norm and clipping utilities
(``torch.nn.utils.get_total_norm``, ``clip_grad_norm_``, ``clip_grads_with_norm_``,
``clip_grad_value_``) handle such gradients as they handle FSDP2's: the norm is reduced over
the group, and in-place scaling writes into the shard gradient the optimizer step reads.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


@functools.cache
def _mesh(process_group, device_type: str) -> DeviceMesh:
    # one 1-D mesh per process group and device type, kept for the group's life (no communication)
    return DeviceMesh.from_group(process_group, device_type)


def sharded_gradient(shard_grad: torch.Tensor, numel: int, group) -> DTensor:
    """The gradient of a parameter of ``numel`` elements, flattened, as a ``DTensor`` sharded
    over ``group`` (a ``CommGroup``) whose local tensor is a view of ``shard_grad`` (this rank's
    padded shard gradient) without the padding."""
    start = min(group.rank * shard_grad.numel(), numel)
    stop = min(start + shard_grad.numel(), numel)
    local = shard_grad[: stop - start]
    return DTensor.from_local(local, _mesh(group.group, shard_grad.device.type), [Shard(0)],
                              run_check=False, shape=torch.Size([numel]), stride=(1,))
