"""A checkpoint made whole in one process, without a process group: ``consolidated_state_dict``
(the model's full state dict, read tensor by tensor behind a progress bar) and
``write_consolidated`` (it written to one ``.safetensors`` or ``torch.save`` file)."""

from __future__ import annotations

import json
import os
import uuid

import torch
import torch.distributed.checkpoint as dcp

from zerocompile.checkpoint.files import clean_path, read_metadata, read_small, single_process
from zerocompile.checkpoint.layout import META_KEY, MODEL
from zerocompile.progress import track


def consolidated_state_dict(path) -> dict:
    """The full model state dict of a checkpoint, read in this process without a process group:
    keys and shapes of the uncompiled ``model.state_dict()``, each parameter in the dtype it was
    saved in (the master dtype: fp32 under bf16 training). Tied keys share one tensor."""
    path = clean_path(path)
    metadata = read_metadata(path)
    meta = json.loads(read_small(path, metadata, [META_KEY])[META_KEY])
    state = {}
    keys = [key for key in meta["model_keys"] if key not in meta["tied"]]
    with single_process():
        # one tensor per load, so that a progress bar can follow a large checkpoint
        for key in track(keys, f"reading {os.path.basename(path)}"):
            md = metadata.state_dict_metadata[MODEL + key]
            one = {MODEL + key: torch.empty(md.size, dtype=md.properties.dtype)}
            dcp.load(one, storage_reader=dcp.FileSystemReader(path), no_dist=True)
            state.update(one)
    return {key: state[MODEL + meta["tied"].get(key, key)] for key in meta["model_keys"]}


def write_consolidated(path, out) -> dict:
    """Write ``consolidated_state_dict(path)`` to the file ``out``: safetensors when ``out`` ends in
    ``.safetensors`` (tied keys as separate copies; safetensors stores no shared tensors), else
    ``torch.save``. Returns the state dict written."""
    out = os.fspath(out)
    use_safetensors = out.endswith(".safetensors")
    if use_safetensors:
        try:
            from safetensors.torch import save_file
        except ImportError as err:
            raise ImportError("writing a .safetensors file needs the 'safetensors' package (pip install "
                              "'zerocompile[safetensors]', or pip install safetensors); or write a .pt file") from err
    state = consolidated_state_dict(path)
    tmp = f"{out}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        if use_safetensors:
            seen = set()
            flat = {}
            for key, value in state.items():
                flat[key] = value.clone() if id(value) in seen else value.contiguous()
                seen.add(id(value))
            save_file(flat, tmp, metadata={"format": "pt"})
        else:
            torch.save(state, tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return state
