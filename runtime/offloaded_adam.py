"""``OffloadedAdam``: ``FusedAdam`` whose moments live off the device between steps.

With ``offload_optimizer={"device": "nvme", ...}`` the moments (``exp_avg``, ``exp_avg_sq``) of
the offloaded parameters live in a per-rank swap file (``runtime/swap_file.py``); with
``"cpu"`` and CUDA parameters they live in host memory. The step streams each flat target
through ``buffer_count`` host buffers of one tile each (``_tile_elems``: sized to the offloaded
state, at most ``buffer_size`` elements), tile by tile: while one
tile is updated by the fused C++ kernel (the same ``zerocompile::fused_adam_step`` as without
offload, so the numbers are the same bit for bit), the next tiles are being read and the
previous one written. CUDA parameters and gradients are copied through host buffers too
(ZeRO-Offload: the update runs on the CPU).

``ratio`` offloads the first parameters (in param-group order) up to that fraction of the
state bytes; the others keep resident state and step together as in ``FusedAdam``.

The optimizer state's layout is torch's: ``state_dict()`` reads the moments back, and
``load_state_dict()`` writes them out again, so checkpoints are the same with and without
offload. The moments of offloaded parameters are not in ``self.state`` (only ``step``);
``param_state(p)`` gives the whole state of one parameter.
"""

from __future__ import annotations

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


class _Slot:
    """One buffer of the pipeline: a tile of each moment (and of parameter and gradient when
    they are not host tensors), with the transfers still using it."""

    def __init__(self, tile_bytes: int, pin: bool):
        self.tile_bytes = tile_bytes
        self.pin = pin
        self.bufs: dict[str, torch.Tensor] = {}      # created on first use: "param"/"grad" for CUDA only
        self.reads: list = []
        self.writes: list = []

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
            log.info("zerocompile: optimizer state of %d of %d parameters (%.0f%% of %d bytes) offloaded to %s",
                     len(chosen), len(params), 100 * used / max(total, 1), 2 * total, self.settings.device)
        return self._offloaded

    def _swapfile(self) -> SwapFile:
        if self._swap is None:
            s = self.settings
            self._swap = SwapFile(s.nvme_path, self._name, threads=s.threads, block_bytes=s.block_size)
        return self._swap

    def _key(self, p, moment: str):
        return (id(p), moment)

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
                swap = self._swapfile()
                swap.reserve(self._key(p, moment), p.numel() * p.element_size())
                buf = aligned_empty(p.numel(), p.dtype)
                buf.copy_(value)
                swap.write(self._key(p, moment), buf).wait()
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
                value = aligned_empty(p.numel(), p.dtype)
                self._swapfile().read(self._key(p, moment), value).wait()
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
    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0, only=None, copies: dict | None = None):
        """As ``FusedAdam.step``; ``copies`` are written for the parameters with resident state
        only: the entries of the others are removed from the dict (the caller casts those)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        offloaded = self._plan()
        for group in self.param_groups:
            self._check(group)
        for group in _groups_of(self.param_groups, only):
            resident = {**group, "params": [p for p in group["params"] if p not in offloaded]}
            self._step_group(resident, grad_scale, copies)  # FusedAdam's path
            tiles = []
            for p in group["params"]:
                if p not in offloaded or p.grad is None:
                    continue
                if copies:
                    copies.pop(id(p), None)
                self._ensure_state(p, moments=False)       # the moments live in files or host memory
                if self.settings.device == "nvme":
                    for moment in MOMENTS:
                        self._swapfile().reserve(self._key(p, moment), p.numel() * p.element_size())
                tiles += [(p, a, min(a + self._tile_elems(), p.numel())) for a in range(0, p.numel(), self._tile_elems())]
            if tiles:
                self._stream(group, tiles, grad_scale)
                for p in dict.fromkeys(p for p, _, _ in tiles):
                    self.state[p]["step"] += 1
                    offloaded[p]["fresh"] = False
        return loss

    def _tile_elems(self) -> int:
        """Elements per tile: sized to what the buffers serve, ``1 / (8 * buffer_count)`` of the
        offloaded elements (so the ``buffer_count`` buffers hold about an eighth of the
        offloaded state), at least ``MIN_TILE`` and at most ``buffer_size``, in whole pages of
        every dtype (2048 elements: 8 KiB of fp32, 4 KiB of 16-bit). Fixed once the
        parameters to offload are chosen (the first step)."""
        pages = lambda n: -(-n // 2048) * 2048      # noqa: E731
        cap = max(2048, pages(self.settings.buffer_size))
        total = sum(p.numel() for p in (self._offloaded or {}))
        share = pages(total // (TILE_FRACTION * self.settings.buffer_count))
        return min(cap, max(MIN_TILE, share))

    def _ensure_slots(self, tiles: list) -> None:
        """The pipeline's buffers, once: ``buffer_count`` slots of one tile (the largest any
        offloaded parameter needs, at most ``buffer_size`` elements) of up to 4 bytes per element."""
        if not self._slots:
            largest = min(self._tile_elems(), max(p.numel() for p in self._offloaded))
            tile_bytes = -(-largest // 2048) * 2048 * 4
            assert tile_bytes % PAGE == 0
            pin = any(self._pin(p) for p, _, _ in tiles)
            self._slots = [_Slot(tile_bytes, pin) for _ in range(self.settings.buffer_count)]

    def buffer_bytes(self) -> int:
        """Bytes of the pipeline's host buffers (allocated on the first step)."""
        return sum(b.untyped_storage().nbytes() for s in self._slots for b in s.bufs.values())

    def _stream(self, group: dict, tiles: list, grad_scale: float) -> None:
        self._ensure_slots(tiles)
        h = hyperparameters(group, grad_scale)
        args = (h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"], h["decoupled"], h["maximize"],
                h["grad_scale"])
        n = len(self._slots)
        offloaded = self._offloaded
        nvme = self.settings.device == "nvme"

        def moments_of(i):
            p, a, b = tiles[i]
            slot = self._slots[i % n]
            entry = offloaded[p]
            if not nvme:
                return [entry["host"].setdefault(m, _zeros_host(p, self._pin(p)))[a:b] for m in MOMENTS]
            return [slot.view(m, p.dtype, b - a) for m in MOMENTS]

        def start_reads(i):
            p, a, b = tiles[i]
            slot = self._slots[i % n]
            slot.wait("writes")
            if not nvme:
                return
            views = moments_of(i)
            if offloaded[p]["fresh"]:
                for v in views:
                    v.zero_()
                return
            slot.reads = [self._swapfile().read(self._key(p, m), v, start=a * p.element_size())
                          for m, v in zip(MOMENTS, views)]

        for i in range(min(n - 1, len(tiles))):
            start_reads(i)
        for i, (p, a, b) in enumerate(tiles):
            slot = self._slots[i % n]
            slot.wait("reads")
            m, v = moments_of(i)
            flat, grad = p.detach().view(-1), p.grad.detach().reshape(-1)
            on_host = p.device.type == "cpu"
            p_tile = flat[a:b] if on_host else slot.view("param", p.dtype, b - a).copy_(flat[a:b])
            g_tile = grad[a:b] if on_host else slot.view("grad", grad.dtype, b - a).copy_(grad[a:b])
            step = self.state[p]["step"].clone()          # incremented once per parameter, after all tiles
            torch.ops.zerocompile.fused_adam_step([p_tile], [g_tile.contiguous()], [m], [v], [step], [], *args)
            if not on_host:
                flat[a:b].copy_(p_tile)
            if nvme:
                slot.writes = [self._swapfile().write(self._key(p, name), t, start=a * p.element_size())
                               for name, t in zip(MOMENTS, (m, v))]
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
