"""Sharded checkpoints: ``save_checkpoint``, ``load_checkpoint``, ``consolidated_state_dict``.

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory that loads at any world size
and any stage. One module per job:

- ``layout``: the format (DCP keys, the ``zerocompile`` metadata entry, a rank's part of a
  sharded tensor);
- ``files``: the directory on disk (atomic swap-in, leftovers of unfinished saves, reading
  DCP's metadata and small entries);
- ``checks``: what save and load refuse before touching anything;
- ``save``, ``load`` (with ``optimizer_load`` for the optimizer's entries), ``consolidate``.
"""

from __future__ import annotations

from zerocompile.checkpoint.consolidate import consolidated_state_dict, write_consolidated
from zerocompile.checkpoint.layout import EXTRA_KEY, FORMAT, META_KEY, MODEL, OPTIM_GROUPS, OPTIM_STATE
from zerocompile.checkpoint.load import load_checkpoint
from zerocompile.checkpoint.save import save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "consolidated_state_dict", "write_consolidated",
           "FORMAT", "MODEL", "OPTIM_STATE", "OPTIM_GROUPS", "META_KEY", "EXTRA_KEY"]
