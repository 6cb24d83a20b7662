"""``OffloadedAdam``: ``FusedAdam`` whose moments live off the device between steps.

With ``offload_optimizer={"device": "nvme", ...}`` the moments (``exp_avg``, ``exp_avg_sq``) of
the offloaded parameters live in a per-rank swap file (``runtime/swap_file.py``); with
``"cpu"`` and CUDA parameters they live in host memory. In the file each param group's
offloaded parameters of one dtype are one flat run per moment (``_Layout``: each parameter at an
offset rounded up to ``ALIGN`` elements, so every parameter and every tile starts on a page, as
``O_DIRECT`` wants), and the step streams that run through ``buffer_count`` host buffers of one
tile each (``_tile_elems``: sized to the offloaded state, at most ``buffer_size`` elements),
tile by tile, a tile spanning as many parameters as it holds: one read and one write per
moment and tile, however small the parameters (a request per parameter made a model of many
biases and norms wait on the disk's latency: 45 ms against 21 for the same 2.1M elements in one
tensor). While one tile is updated by the fused C++ kernel (the same
``zerocompile::fused_adam_step`` as without offload, one call over the tile's pieces, so the
numbers are the same bit for bit), the next tiles are being read and the previous one written.
CUDA parameters and gradients are copied through host buffers too (ZeRO-Offload: the update
runs on the CPU).

``ratio`` offloads the first parameters (in param-group order) up to that fraction of the
state bytes; the others keep resident state and step together as in ``FusedAdam``.

The optimizer state's layout is torch's: ``state_dict()`` reads the moments back, and
``load_state_dict()`` writes them out again, so checkpoints are the same with and without
offload. The moments of offloaded parameters are not in ``self.state`` (only ``step``);
``param_state(p)`` gives the whole state of one parameter.
"""

from __future__ import annotations

import bisect
import logging

import torch

from zerocompile.runtime.fused_adam import FusedAdam, _groups_of, hyperparameters
from zerocompile.runtime.offload_settings import OffloadSettings
from zerocompile.runtime.swap_file import PAGE, SwapFile, aligned_empty

log = logging.getLogger("zerocompile")

MOMENTS = ("exp_avg", "exp_avg_sq")


TILE_FRACTION = 8
"""The buffers hold about ``1 / TILE_FRACTION`` of the offloaded state (``_tile_elems``)."""
MIN_TILE = 1 << 16
"""The smallest tile, in elements (256 KiB of fp32), unless ``buffer_size`` is smaller."""
ALIGN = 2048
"""Parameters start at multiples of this many elements in a layout, and tiles are multiples of
it: a page boundary for every element size from 2 bytes (``O_DIRECT`` transfers start on one)."""


class _Layout:
    """One param group's offloaded parameters of one dtype, as one flat run per moment in the
    swap file: ``offset[p]`` (elements, a multiple of ``ALIGN``) and ``size`` (elements, the
    last parameter's end rounded up to ``ALIGN``); ``key`` names its regions with the moment."""

    def __init__(self, key: tuple, params: list):
        self.key, self.params, self.offset = key, params, {}
        self.starts = []                     # offset of each of ``params``, ascending
        at = 0
        for p in params:
            self.offset[p] = at
            self.starts.append(at)
            at += -(-p.numel() // ALIGN) * ALIGN
        self.size = at
        self.dtype = params[0].dtype
        self.itemsize = params[0].element_size()

    def pieces(self, start: int, end: int) -> list:
        """``(p, a, b)`` for each parameter with elements in ``[start, end)`` of the run: its
        elements ``a:b``, at ``offset[p] + a`` in the run. Only the parameters that can overlap
        are looked at (a step asks for every tile: a scan of all would cost tiles x parameters)."""
        out = []
        for i in range(max(bisect.bisect_right(self.starts, start) - 1, 0), len(self.params)):
            p, o = self.params[i], self.starts[i]
            if o >= end:
                break
            a, b = max(start - o, 0), min(end - o, p.numel())
            if a < b:
                out.append((p, a, b))
        return out


class _Slot:
    """One buffer of the pipeline: a tile of each moment (and of parameter and gradient when
    they are not host tensors), with the transfers still using it."""

    def __init__(self, tile_bytes: int, pin: bool):
        self.tile_bytes = tile_bytes
        self.pin = pin
        self.bufs: dict[str, torch.Tensor] = {}      # created on first use: "param"/"grad" for CUDA only
        self.reads: list = []
        self.writes: list = []
        self.zero_after_read: list = []      # moments of never-stepped pieces, zeroed once read

    def view(self, name: str, dtype: torch.dtype, n: int) -> torch.Tensor:
        if name not in self.bufs:
            self.bufs[name] = aligned_empty(self.tile_bytes, torch.uint8, pin_memory=self.pin)
        view = self.bufs[name].view(dtype)
        if n > view.numel():
            raise RuntimeError(f"OffloadedAdam: a tile of {n} elements does not fit a buffer of {view.numel()}")
        return view[:n]

    def wait(self, which: str) -> None:
        for t in getattr(self, which):
            t.wait()
        setattr(self, which, [])


class OffloadedAdam(FusedAdam):
    """``FusedAdam`` with offloaded moments (see the module docstring)."""

    def __init__(self, params, settings: OffloadSettings, name: str, **hyper):
        super().__init__(params, **hyper)
        if settings.device not in ("cpu", "nvme"):
            raise ValueError(f"OffloadedAdam: device {settings.device!r}; 'cpu' or 'nvme'")
        self.settings = settings
        self._name = name
        self._swap: SwapFile | None = None
        self._offloaded: dict | None = None       # param -> {"fresh": bool, "host": {moment: tensor}}
        self._layouts: dict[tuple, _Layout] = {}   # (group index, dtype) -> its run in the file
        self._layout_of: dict = {}                 # param -> its _Layout
        self._slots: list[_Slot] = []

    # ------------------------------------------------------------------ which, where
    def _plan(self) -> dict:
        """Decide once which parameters are offloaded: the first ones up to ``ratio`` of the bytes."""
        if self._offloaded is None:
            params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
            total = sum(p.numel() * p.element_size() for p in params)
            budget, used, chosen = self.settings.ratio * total, 0, {}
            for p in params:
                if used >= budget - 1e-9 * total:
                    break
                chosen[p] = {"fresh": True, "host": {}}
                used += p.numel() * p.element_size()
            self._offloaded = chosen
            for gi, group in enumerate(self.param_groups):
                by_dtype: dict = {}
                for p in group["params"]:
                    if p in chosen:
                        by_dtype.setdefault(p.dtype, []).append(p)
                for dtype, members in by_dtype.items():
                    layout = _Layout((gi, str(dtype).removeprefix("torch.")), members)
                    self._layouts[layout.key] = layout
                    self._layout_of.update(dict.fromkeys(members, layout))
            log.info("zerocompile: optimizer state of %d of %d parameters (%.0f%% of %d bytes) offloaded to %s",
                     len(chosen), len(params), 100 * used / max(total, 1), 2 * total, self.settings.device)
        return self._offloaded

    def _swapfile(self) -> SwapFile:
        """The swap file, made on first use with a region per layout and moment."""
        if self._swap is None:
            s = self.settings
            self._swap = SwapFile(s.nvme_path, self._name, threads=s.threads, block_bytes=s.block_size)
            self._plan()
            for layout in self._layouts.values():
                for moment in MOMENTS:
                    self._swap.reserve((layout.key, moment), layout.size * layout.itemsize)
        return self._swap

    def _place(self, p, values: dict[str, torch.Tensor]) -> None:
        """Move moments ``values`` (tensors of ``p``'s size) to where ``p``'s state lives."""
        entry = self._plan()[p]
        for moment in MOMENTS:
            value = values[moment].detach().reshape(-1).to(p.dtype)
            if self.settings.device == "cpu":
                host = torch.empty(p.numel(), dtype=p.dtype, pin_memory=self._pin(p))
                host.copy_(value)
                entry["host"][moment] = host
            else:
                layout = self._layout_of[p]
                buf = aligned_empty(p.numel(), p.dtype)
                buf.copy_(value)
                self._swapfile().write((layout.key, moment), buf,
                                       start=layout.offset[p] * p.element_size()).wait()
        entry["fresh"] = False

    def _pin(self, p) -> bool:
        return self.settings.pin_memory and p.device.type == "cuda"

    def param_state(self, p) -> dict:
        """The whole state of ``p`` (moments read back for offloaded parameters, in ``p``'s shape)."""
        state = self.state.get(p)
        if not state:
            return {}
        entry = (self._offloaded or {}).get(p)
        if entry is None or "exp_avg" in state:
            return dict(state)
        out = dict(state)
        for moment in MOMENTS:
            if entry["fresh"]:
                value = torch.zeros(p.numel(), dtype=p.dtype)
            elif self.settings.device == "cpu":
                value = entry["host"][moment].clone()
            else:
                layout = self._layout_of[p]
                value = aligned_empty(p.numel(), p.dtype)
                self._swapfile().read((layout.key, moment), value, start=layout.offset[p] * p.element_size()).wait()
                value = value.clone()
            out[moment] = value.view(p.shape).to(p.device)
        return out

    def offloaded_bytes(self) -> int:
        """Bytes of optimizer state held off the device (host memory or file)."""
        return sum(2 * p.numel() * p.element_size() for p, e in (self._offloaded or {}).items() if not e["fresh"])

    # ------------------------------------------------------------------ state dicts
    def state_dict(self) -> dict:
        offloaded = [p for p in (self._offloaded or {}) if self.state.get(p)]
        saved = {p: self.state[p] for p in offloaded}
        try:
            for p in offloaded:
                self.state[p] = self.param_state(p)
            return super().state_dict()
        finally:
            for p, state in saved.items():
                self.state[p] = state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for p in self._plan():
            state = self.state.get(p)
            if state and "exp_avg" in state:
                self._place(p, state)
                for moment in MOMENTS:
                    del state[moment]

    # ------------------------------------------------------------------ the step
    def update(self, grad_scale: float = 1.0, only=None, copies: dict | None = None) -> None:
        """As ``FusedAdam.update`` (``step`` calls it); ``copies`` are written for the parameters
        with resident state only: the entries of the others are removed from the dict (the
        caller casts those)."""
        offloaded = self._plan()
        for group in self.param_groups:
            self._check(group)
        for gi, group in enumerate(_groups_of(self.param_groups, only)):
            resident = {**group, "params": [p for p in group["params"] if p not in offloaded]}
            self._step_group(resident, grad_scale, copies)  # FusedAdam's path
            stepped = []
            for p in group["params"]:
                if p not in offloaded or p.grad is None:
                    continue
                if copies:
                    copies.pop(id(p), None)
                self._ensure_state(p, moments=False)       # the moments live in files or host memory
                stepped.append(p)
            if not stepped:
                continue
            tiles, wanted, size = [], set(stepped), self._tile_elems()
            for layout in self._layouts.values():
                if layout.key[0] != gi:
                    continue
                for start in range(0, layout.size, size):
                    end = min(start + size, layout.size)
                    pieces = [piece for piece in layout.pieces(start, end) if piece[0] in wanted]
                    if pieces:
                        tiles.append((layout, start, end, pieces))
            self._stream(group, tiles, grad_scale)
            for p in stepped:
                self.state[p]["step"] += 1
                offloaded[p]["fresh"] = False

    def _tile_elems(self) -> int:
        """Elements per tile: sized to what the buffers serve, ``1 / (8 * buffer_count)`` of the
        offloaded elements (so the ``buffer_count`` buffers hold about an eighth of the
        offloaded state), at least ``MIN_TILE`` and at most ``buffer_size``, and never more
        than a ``buffer_count``-th of the offloaded elements (a small model's buffers together
        never outgrow the state they stream), in whole pages of every dtype (``ALIGN``
        elements: 8 KiB of fp32, 4 KiB of 16-bit). Fixed once the parameters to offload are
        chosen (the first step)."""
        pages = lambda n: -(-n // ALIGN) * ALIGN      # noqa: E731
        cap = max(ALIGN, pages(self.settings.buffer_size))
        total = sum(p.numel() for p in (self._offloaded or {}))
        share = pages(total // (TILE_FRACTION * self.settings.buffer_count))
        return min(cap, max(MIN_TILE, share), max(ALIGN, pages(-(-total // self.settings.buffer_count))))

    def _ensure_slots(self, tiles: list) -> None:
        """The pipeline's buffers, once: ``buffer_count`` slots of one tile (the largest any
        layout needs, at most ``buffer_size`` elements) of up to 4 bytes per element."""
        if not self._slots:
            largest = min(self._tile_elems(), max(layout.size for layout in self._layouts.values()))
            tile_bytes = -(-largest // ALIGN) * ALIGN * 4
            assert tile_bytes % PAGE == 0
            pin = any(self._pin(p) for _, _, _, pieces in tiles for p, _, _ in pieces)
            self._slots = [_Slot(tile_bytes, pin) for _ in range(self.settings.buffer_count)]

    def buffer_bytes(self) -> int:
        """Bytes of the pipeline's host buffers (allocated on the first step)."""
        return sum(b.untyped_storage().nbytes() for s in self._slots for b in s.bufs.values())

    def _stream(self, group: dict, tiles: list, grad_scale: float) -> None:
        """Step ``tiles`` (``(layout, start, end, pieces)``: elements ``start:end`` of a layout's
        run, and the parameters' pieces in it that have gradients) through the slots: the reads
        of the next ``buffer_count - 1`` tiles in flight while one is updated and the previous
        one is written."""
        self._ensure_slots(tiles)
        h = hyperparameters(group, grad_scale)
        args = (h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"], h["decoupled"], h["maximize"],
                h["grad_scale"])
        n = len(self._slots)
        offloaded = self._offloaded
        nvme = self.settings.device == "nvme"

        def runs_of(i) -> list:
            """Tile ``i``'s ``[exp_avg, exp_avg_sq]`` runs in its slot's buffers (nvme)."""
            layout, start, end, _ = tiles[i]
            return [self._slots[i % n].view(m, layout.dtype, end - start) for m in MOMENTS]

        def moments_of(i) -> list:
            """Per piece of tile ``i``, its ``[exp_avg, exp_avg_sq]``: views of the slot's buffers
            (nvme), or of the host tensors."""
            layout, start, end, pieces = tiles[i]
            if not nvme:
                return [[offloaded[p]["host"].setdefault(m, _zeros_host(p, self._pin(p)))[a:b] for m in MOMENTS]
                        for p, a, b in pieces]
            runs = runs_of(i)
            return [[run[layout.offset[p] + a - start : layout.offset[p] + b - start] for run in runs]
                    for p, a, b in pieces]

        def start_reads(i) -> None:
            layout, start, end, pieces = tiles[i]
            slot = self._slots[i % n]
            slot.wait("writes")
            if not nvme:
                return
            runs = runs_of(i)
            if all(offloaded[p]["fresh"] for p, _, _ in layout.pieces(start, end)):
                # nothing in the run was ever written (the write back covers all of it, also
                # the parameters not stepped now): no read
                for run in runs:
                    run.zero_()
                return
            slot.reads = [self._swapfile().read((layout.key, m), run, start=start * layout.itemsize)
                          for m, run in zip(MOMENTS, runs)]
            slot.zero_after_read = [views for views, (p, _, _) in zip(moments_of(i), pieces) if offloaded[p]["fresh"]]

        for i in range(min(n - 1, len(tiles))):
            start_reads(i)
        for i, (layout, start, end, pieces) in enumerate(tiles):
            slot = self._slots[i % n]
            slot.wait("reads")
            for views in slot.zero_after_read:        # never stepped: zero, whatever the file held
                for v in views:
                    v.zero_()
            slot.zero_after_read = []
            moments = moments_of(i)
            p_tiles, g_tiles, steps, back = [], [], [], []
            for (p, a, b), _ in zip(pieces, moments):
                flat, grad = p.detach().view(-1), p.grad.detach().reshape(-1)
                at = layout.offset[p] + a - start
                if p.device.type == "cpu":
                    p_tiles.append(flat[a:b])
                    g_tiles.append(grad[a:b].contiguous())
                else:
                    p_tiles.append(slot.view("param", p.dtype, end - start)[at : at + b - a].copy_(flat[a:b]))
                    g_tiles.append(slot.view("grad", grad.dtype, end - start)[at : at + b - a].copy_(grad[a:b]))
                    back.append((flat[a:b], p_tiles[-1]))
                steps.append(self.state[p]["step"].clone())   # incremented once per parameter, after all tiles
            torch.ops.zerocompile.fused_adam_step(p_tiles, g_tiles, [m for m, _ in moments], [v for _, v in moments],
                                                  steps, [], *args)
            for target, source in back:
                target.copy_(source)
            if nvme:
                slot.writes = [self._swapfile().write((layout.key, m), run, start=start * layout.itemsize)
                               for m, run in zip(MOMENTS, runs_of(i))]
            if i + n - 1 < len(tiles):
                start_reads(i + n - 1)
        for slot in self._slots:
            slot.wait("writes")

    def close(self) -> None:
        """Delete the swap file (also done at exit)."""
        if self._swap is not None:
            self._swap.close()
            self._swap = None


def _zeros_host(p, pin: bool) -> torch.Tensor:
    return torch.zeros(p.numel(), dtype=p.dtype, pin_memory=pin)
