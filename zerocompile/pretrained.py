"""Big models: meta-device init shard by shard, pretrained weights read straight into shards,
and the Hugging Face layout written from the shards.

``materialize(model)``: a model built under ``torch.device("meta")`` gets real parameters,
one module at a time: the module's own parameters and buffers are allocated whole (for a
moment), initialised by the module's own init (HF's ``_init_weights`` for a ``PreTrainedModel``,
else ``reset_parameters()``), and each parameter is then cut to this rank's stage-3 chunk and
its full storage freed. Peak memory per rank: the shards made so far plus one module's
parameters. Every rank runs the same init with the same random state, so the values are those
of the same init on one process (``tests/test_pretrained.py``); a final all-gather of a
checksum refuses ranks that initialised differently (seed every rank the same).

The shards carry a *provisional* state (stage 3 over the default group, default options):
the first compiled frame that uses a parameter adopts it with its own options, or, for
another stage or group, gathers it back whole once and shards it its own way.

``load_pretrained(model, path)``: each rank reads only its own chunk of each parameter
(safetensors slices, or a ``torch.load(mmap=True)`` file), straight into the shards;
a meta model is materialised first (for its buffers: parameters come from the file).
``save_pretrained(model, directory)``: the Hugging Face layout (``model.safetensors`` or
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``, and the model's
``config.json``), written by rank 0 one tensor at a time as the ranks gather it.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import struct
import sys
from pathlib import Path

import torch

from zerocompile import _torch_compat
from zerocompile.checkpoint.layout import param_names
from zerocompile.progress import track
from zerocompile.runtime.session import PROCESS, ModelSession
from zerocompile.runtime.comm import CommGroup, all_gather_flat, chunk_size, resolve_group
from zerocompile.runtime.param_offload import resident_shards
from zerocompile.runtime.sharded_param import ShardedParam, attach_state, get_state
from zerocompile.runtime.zero_parameter import adopt
from zerocompile.state_dict import _unwrap

log = logging.getLogger("zerocompile")

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


# ============================================================================ materialize
def default_init(module: torch.nn.Module):
    """The init ``materialize`` runs on each module: HF's ``_init_weights`` of the root when it
    has one (a ``PreTrainedModel``), else each module's ``reset_parameters()`` where defined."""
    hf_init = getattr(module, "_init_weights", None)
    if callable(hf_init):
        return hf_init

    def reset(mod: torch.nn.Module) -> None:
        if callable(getattr(mod, "reset_parameters", None)):
            mod.reset_parameters()
    return reset


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _own_chunk(full: torch.Tensor, group: CommGroup) -> torch.Tensor:
    chunk = chunk_size(full.numel(), group.world)
    out = torch.zeros(chunk, dtype=full.dtype, device=full.device)
    start, stop = group.rank * chunk, min((group.rank + 1) * chunk, full.numel())
    if stop > start:
        out[: stop - start].copy_(full.reshape(-1)[start:stop])
    return out


def _provisional_shard(param: torch.nn.Parameter, name: str, chunk: torch.Tensor, group: CommGroup,
                       session: ModelSession) -> ShardedParam:
    state = ShardedParam(param, name, 3, group, param.dtype, chunk=chunk, provisional=True)
    attach_state(param, state)
    adopt(param)
    session.add_state(state, group.world)
    return state


def materialize(model: torch.nn.Module, init=None, *, device=None, process_group=None) -> torch.nn.Module:
    """Give a model built on the ``meta`` device its parameters as stage-3 shards and its
    buffers whole, module by module (see the module docstring). Collective: every rank must
    call it, with the same random state. ``init(module)`` initialises one module's own
    parameters and buffers (default: ``default_init``); ``device``: where parameters and
    buffers go (default: the current CUDA device, else the CPU). Parameters and buffers not on
    the meta device are left as they are. Returns ``model``."""
    _materialize(_unwrap(model), init, device, process_group, fill=True)
    return model


def _materialize(module, init, device, process_group, fill: bool) -> None:
    group = resolve_group(process_group)
    device = torch.device(device) if device is not None else _default_device()
    init = init if init is not None else default_init(module)
    names = param_names(module)
    session = PROCESS.session_for([module], [])       # the model's, which its first compiled frame takes
    done: dict[int, torch.nn.Parameter] = {}
    checksum = torch.zeros(1, dtype=torch.float64)
    for mod_name, mod in module.named_modules():
        fresh = []
        for key, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) in done:
                mod._parameters[key] = done[id(p)]
            elif p.is_meta:
                new = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                         requires_grad=p.requires_grad)
                done[id(p)] = new
                mod._parameters[key] = new
                fresh.append((names.get(p, f"{mod_name}.{key}".lstrip(".")), new))
        buffers = []
        for key, b in list(mod._buffers.items()):
            if b is not None and b.is_meta:
                mod._buffers[key] = torch.empty(b.shape, dtype=b.dtype, device=device)
                buffers.append((f"{mod_name}.{key}".lstrip("."), mod._buffers[key]))
        if not fresh and not buffers:
            continue
        run_init = fill or bool(buffers)   # load_pretrained: only the buffers need the init
        if run_init:
            with torch.no_grad():
                for _, t in fresh + buffers:
                    if t.is_floating_point():
                        t.fill_(math.nan)      # what init leaves NaN, it did not initialise
                init(mod)
        sums = {}
        for name, t in (fresh if fill else []) + buffers:
            # a sum in float64 (no copy of the tensor): NaN if any element is NaN
            sums[id(t)] = torch.sum(t.detach(), dtype=torch.float64) if t.is_floating_point() else None
            if sums[id(t)] is not None and math.isnan(sums[id(t)].item()):
                kind = "parameter" if any(t is f for _, f in fresh) else "buffer"
                raise ValueError(
                    f"zerocompile.materialize: {kind} '{name}' ({type(mod).__name__}) is not initialised by the "
                    "init function (NaN left where it should have written); give materialize(init=fn) that sets "
                    "every parameter and buffer of the module it is given, or define reset_parameters() on "
                    f"{type(mod).__name__}")
        for name, p in fresh:
            with torch.no_grad():
                if run_init:
                    if sums.get(id(p)) is not None:
                        checksum += sums[id(p)].cpu()
                    chunk = _own_chunk(p.detach(), group)
                else:                  # never written: the file fills the chunk
                    chunk = torch.zeros(chunk_size(p.numel(), group.world), dtype=p.dtype, device=device)
            _provisional_shard(p, name, chunk, group, session)
    if group.world > 1 and fill:
        sums = all_gather_flat(checksum.to(device), group.world, group.name).cpu()
        if not torch.equal(sums, sums[:1].expand_as(sums)):
            raise ValueError(f"zerocompile.materialize: the ranks initialised different values (checksums "
                             f"{sums.tolist()}); seed every rank the same (torch.manual_seed) before materialize")


# ============================================================================ reading files
class _Source:
    """Tensors of a safetensors file, a sharded safetensors directory, or a torch.save file,
    read by name; ``flat_range`` reads only the rows that hold elements ``[start, stop)``."""

    def __init__(self, path):
        self.path = Path(path)
        self._open: dict = {}
        self._torch = None
        if self.path.is_dir():
            index = self.path / "model.safetensors.index.json"
            single = self.path / "model.safetensors"
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                self.where = {k: self.path / f for k, f in weight_map.items()}
            elif single.is_file():
                self.where = {k: single for k in self._keys_of(single)}
            else:
                raise FileNotFoundError(f"zerocompile.load_pretrained: {self.path} holds neither "
                                        "model.safetensors nor model.safetensors.index.json")
        elif self.path.suffix == ".safetensors":
            self.where = {k: self.path for k in self._keys_of(self.path)}
        elif self.path.is_file():
            self._torch = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
            if not isinstance(self._torch, dict):
                raise ValueError(f"zerocompile.load_pretrained: {self.path} holds a {type(self._torch).__name__}, "
                                 "not a state dict")
            self.where = {k: self.path for k in self._torch}
        else:
            raise FileNotFoundError(f"zerocompile.load_pretrained: no such file or directory: {self.path}")

    @staticmethod
    def _keys_of(path: Path) -> list:
        with _safe_open()(path, framework="pt") as f:
            return list(f.keys())

    def _slice(self, name: str):
        safe_open = _safe_open()
        file = self.where[name]
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt")
        return self._open[file].get_slice(name)

    def shape(self, name: str) -> tuple:
        if self._torch is not None:
            return tuple(self._torch[name].shape)
        return tuple(self._slice(name).get_shape())

    def full(self, name: str) -> torch.Tensor:
        if self._torch is not None:
            return self._torch[name].clone()
        return self._slice(name)[:]

    def flat_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        if self._torch is not None:
            return self._torch[name].reshape(-1)[start:stop].clone()
        shape = self.shape(name)
        if len(shape) == 0:
            return self._slice(name)[:].reshape(-1)[start:stop]
        row = math.prod(shape[1:])
        first, last = start // row, -(-stop // row)
        rows = self._slice(name)[first:last].reshape(-1)
        return rows[start - first * row: stop - first * row]


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError as err:
        raise ImportError("reading .safetensors files needs the 'safetensors' package (pip install "
                          "'zerocompile[safetensors]', or pip install safetensors)") from err
    return safe_open


def _entries(module: torch.nn.Module) -> dict:
    """``{name: tensor}`` of the state dict's parameters and persistent buffers (the objects,
    tied names sharing one)."""
    return dict(module.state_dict(keep_vars=True))


def load_pretrained(model: torch.nn.Module, path, *, strict: bool = True) -> torch.nn.Module:
    """Load the weights at ``path`` into ``model``, each rank reading only what it keeps.

    ``path``: a ``.safetensors`` file, a directory as ``save_pretrained`` writes it (one
    ``model.safetensors`` or shards with ``model.safetensors.index.json``), or a ``torch.save``
    state dict. Collective: every rank must call it. A model on the meta device is
    materialised first (its buffers by its init; its parameters then come from the file).
    Names must match the model's ``state_dict()`` exactly; a name the model ties to another
    (one tensor, two names, as HF ties embeddings) may be missing from the file when the other
    is there. With ``strict`` a missing or unexpected key raises ``KeyError`` listing them all.
    Returns ``model``."""
    module = _unwrap(model)
    if any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers()):
        _materialize(module, None, None, None, fill=False)
    source = _Source(path)
    entries = _entries(module)
    aliases: dict[int, list] = {}
    for name, t in entries.items():
        aliases.setdefault(id(t), []).append(name)
    missing = [n for n in entries if n not in source.where and not any(a in source.where for a in aliases[id(entries[n])])]
    unexpected = [k for k in source.where if k not in entries]
    if strict and (missing or unexpected):
        raise KeyError(f"zerocompile.load_pretrained({path}): missing keys {missing}, unexpected keys {unexpected}")
    loaded = set()
    with torch.no_grad(), _torch_compat.plain_tensor_ops():
        for name, t in track(list(entries.items()), f"loading {Path(path).name}"):
            if id(t) in loaded:
                continue
            key = next((a for a in [name, *aliases[id(t)]] if a in source.where), None)
            if key is None:
                continue
            if source.shape(key) != tuple(t.shape):
                raise ValueError(f"zerocompile.load_pretrained: '{key}' has shape {source.shape(key)} in {path}, "
                                 f"the model's '{name}' has {tuple(t.shape)}")
            _load_one(t, key, source)
            loaded.add(id(t))
    return model


def _load_one(t: torch.Tensor, key: str, source: _Source) -> None:
    state = get_state(t)
    if state is not None and state.rules.number == 3 and state.storage_freed and not state.materialized:
        start = state.group.rank * state.chunk
        stop = min(start + state.chunk, state.numel)
        with resident_shards([state]):
            state.shard.zero_()
            if stop > start:
                state.shard[: stop - start].copy_(source.flat_range(key, start, stop))
        return
    full = source.full(key)
    if state is not None:
        state.write_full(full.to(state.dtype).view(state.shape))
    else:
        t.copy_(full)


# ============================================================================ writing files
def _parse_size(size) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = str(size).strip().upper()
    for unit, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _header(tensors: list, dtype_of) -> bytes:
    header, offset = {}, 0
    for name, t in tensors:
        dtype = dtype_of(t)
        nbytes = t.numel() * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def save_pretrained(model: torch.nn.Module, directory, *, max_shard_size="5GB", dtype: torch.dtype | None = None,
                    process_group=None) -> None:
    """Write ``model``'s weights in the Hugging Face layout to ``directory`` (and its
    ``config.json`` and ``generation_config.json`` when it has them), from the shards.

    Collective: every rank must call it; the ranks gather one tensor at a time and rank 0
    writes it, so no rank holds more than one full tensor. Tied names (one tensor under two
    names) are written once, under the first name, as HF does. ``dtype``: cast floating-point
    tensors (e.g. ``torch.bfloat16``); default: as held (parameters in their master dtype).
    Files over ``max_shard_size`` (bytes or ``"5GB"``) are split, with an index."""
    module = _unwrap(model)
    group = resolve_group(process_group)
    if _is_peft_model(module):
        _save_peft_adapter(module, directory, group, dtype)
        return
    entries, seen = [], set()
    for name, t in _entries(module).items():
        if id(t) not in seen:
            seen.add(id(t))
            entries.append((name, t))

    def dtype_of(t):
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    limit, files, current, size = _parse_size(max_shard_size), [], [], 0
    for name, t in entries:
        nbytes = t.numel() * dtype_of(t).itemsize
        if current and size + nbytes > limit:
            files.append(current)
            current, size = [], 0
        current.append((name, t))
        size += nbytes
    if current or not files:
        files.append(current)
    directory = Path(directory)
    writer = group.rank == 0
    if writer:
        directory.mkdir(parents=True, exist_ok=True)
    names = ["model.safetensors"] if len(files) == 1 else \
        [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    total = 0
    bar = iter(track(range(len(entries)), f"saving to {directory.name}") if writer else range(len(entries)))
    for file_name, tensors in zip(names, files):
        out = open(directory / file_name, "wb") if writer else None
        try:
            if out is not None:
                out.write(_header(tensors, dtype_of))
            for _, t in tensors:
                full = _full_value(t, dtype_of(t))
                total += full.numel() * full.element_size()
                if out is not None:
                    out.write(_raw_bytes(full))
                del full
                next(bar, None)
        finally:
            if out is not None:
                out.close()
    if writer:
        if len(files) > 1:
            weight_map = {n: f for f, ts in zip(names, files) for n, _ in ts}
            (directory / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        for attr in ("config", "generation_config"):
            config = getattr(module, attr, None)
            if config is not None and callable(getattr(config, "save_pretrained", None)):
                config.save_pretrained(directory)
    if group.world > 1:
        torch.distributed.barrier(group.group)       # every rank returns once the files are written


def _is_peft_model(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a PEFT ``PeftModel`` (PEFT imported only when a model may be one)."""
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(module, PeftModel)


def _save_peft_adapter(model, directory, group, dtype) -> None:
    """``PeftModel.save_pretrained(directory)`` of a model zerocompile shards: each adapter's files
    (``adapter_model.safetensors`` and ``adapter_config.json``, as PEFT writes them in one
    process). The tensors PEFT keeps for an adapter (its ``get_peft_model_state_dict``, asked
    with stand-ins, so the frozen base model is never gathered) are gathered one at a time on
    every rank, and rank 0 hands them to PEFT's own ``save_pretrained``."""
    from peft.utils import get_peft_model_state_dict

    entries = _entries(model)
    stand_ins = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in entries.items()}
    name_of = {id(t): name for name, t in stand_ins.items()}
    wanted = []
    for adapter in model.peft_config:
        kept = get_peft_model_state_dict(model, state_dict=stand_ins, adapter_name=adapter)
        wanted += [name_of[id(t)] for t in kept.values() if id(t) in name_of and name_of[id(t)] not in wanted]
    full = {}
    for name in wanted:
        t = entries[name]
        value = _full_value(t, dtype if dtype is not None and t.is_floating_point() else t.dtype)
        if group.rank == 0:
            full[name] = value
    if group.rank == 0:
        model.save_pretrained(str(directory), state_dict=full, is_main_process=True)
    if group.world > 1:
        torch.distributed.barrier(group.group)       # every rank returns once the files are written


def _raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes in memory order (little-endian on every platform torch runs on), as
    safetensors stores them; through ctypes, so that numpy is not needed."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size()) if flat.numel() else b""


def _full_value(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    state = get_state(t)
    with torch.no_grad(), _torch_compat.plain_tensor_ops():
        if state is not None:
            return state.full_from_shards(dtype)
        return t.detach().to(dtype)
