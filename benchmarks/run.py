"""``make bench``: zerocompile ZeRO stages 1-3 against DDP, FSDP2 and DeepSpeed on the same workloads.

Run it on this machine's CPUs (the script spawns ``--world-size`` gloo ranks itself)::

    python benchmarks/run.py                       # every workload and system, 2 gloo ranks
    python benchmarks/run.py --quick               # tiny model, 3 steps, every system (smoke test)
    python benchmarks/run.py --workloads gpt-4m --systems fsdp2 zero3
    python benchmarks/run.py --device cuda         # NCCL, one GPU per rank (untested here)

Every system trains the same model from the same seed on the same per-rank batch at every
step, in fp32 with ``torch.optim.AdamW`` and the same hyperparameters; the systems that step a
torch optimizer themselves (DDP, FSDP2, DeepSpeed with a client optimizer) use its fused kernel
(``fused=True``), zerocompile its own fused kernel (``ZeroOptimizer``'s default):

- ``floor``: the compute floor: each rank trains the model alone on its own micro-batch with the
  same inner compiler (``torch.compile`` with inductor or aot_eager) and torch's fused AdamW, no
  process group in the step: what a data-parallel step cannot go below here. Its losses are not
  compared (no gradient averaging); stages 1-3 are reported as ratios to its step time;
- ``ddp``: ``DistributedDataParallel``;
- ``fsdp2``: ``fully_shard`` on each block and then the root, eager;
- ``fsdp2-compile``: the same with each block compiled in place (``block.compile()``) before
  ``fully_shard``, the per-block compile FSDP2's documentation and torchtitan use;
- ``ds-zero1`` / ``ds-zero2`` / ``ds-zero3``: a DeepSpeed engine (eager) at that ZeRO stage with
  a client AdamW (skipped, with the reason, if DeepSpeed is missing or fails to initialise);
- ``zero1`` / ``zero2`` / ``zero3``: ``torch.compile(model, backend="zero", options={"stage": k})``
  with the default passes and ``zerocompile.ZeroOptimizer(AdamW)``;
- ``zero1-overlap``: stage 1 with ``overlap_reduction=True``: the reduction runs during the
  last backward, bucket by bucket, instead of in the step (DDP's overlap);
- ``zero3-profile``: stage 3 with ``profile=True``: the passes weigh times measured on the
  frame's graph when it compiles, not the estimates;
- ``zero3-qwz``: stage 3 with ZeRO++'s quantized weight gathers and gradient reductions
  (``zero_quantized_weights`` and ``zero_quantized_gradients``): not exact, so its losses
  are checked against the reference within ``APPROXIMATE``'s 2% instead of ``--rtol``;
- ``zero3-nopass``: stage 3 with every optional pass of the registry disabled (except
  ``cast_forward_inputs``, which fp32 does not run anyway);
- ``zero3-offload``: stage 3 with ``offload_optimizer={"device": "nvme", ...}`` into a
  temporary directory per rank (the moments stream through the fused kernel from a swap file);
- ``zero3-infinity``: the same with ``offload_param`` into that directory as well (the
  parameter shards live in files, fetched by the graph before each all-gather);
- ``ds-zero3-offload`` / ``ds-zero3-infinity``: DeepSpeed ZeRO-3 with its optimizer offload to
  the CPU (ZeRO-Offload, its CPU Adam; on a CPU model the state stays in the same memory) or to
  NVMe (ZeRO-Infinity; needs DeepSpeed's async_io op, i.e. libaio: skipped with the reason
  where it does not build).

The systems live side by side in every rank and take turns, one step each per round with
the first system rotating, so drift in the machine's speed hits all alike. Round 0 is the
first step (the compile, where there is one); then ``warmup`` untimed rounds; then timed
rounds; then two measurement rounds under dispatch modes (a ``LiveStorageTracker`` per system
for the peak live bytes of a step and the model-state bytes held after ``step()``, and
``common.CollectiveBytes`` for the bytes communicated). Losses are compared step by step with
the reference (FSDP2 eager); a system that differs by more than the tolerance is reported as
diverged and gets no speed figures.

Results: ``<out>/latest.json``, ``<out>/latest.md`` (one table per workload, also printed) and
``<out>/latest.png``. See ``benchmarks/README.md`` for how to read them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_harness as harness  # noqa: E402
from common import MiB, RESULTS, all_ranks_ok, error_line, load_example, spawn_ranks, two_in_flight  # noqa: E402

SYSTEMS = ("floor", "ddp", "ddp-compile", "fsdp2", "fsdp2-compile", "ds-zero1", "ds-zero2", "ds-zero3", "ds-zero3-offload",
           "ds-zero3-infinity", "zero1", "zero1-overlap", "zero2", "zero3", "zero3-profile", "zero3-qwz", "zero3-nopass",
           "zero3-offload", "zero3-infinity")
LABELS = {
    "floor": "compute floor (one rank alone, no collectives)", "ddp": "DDP", "ddp-compile": "DDP + torch.compile", "fsdp2": "FSDP2 eager", "fsdp2-compile": "FSDP2 + per-block compile",
    "ds-zero1": "DeepSpeed ZeRO-1", "ds-zero2": "DeepSpeed ZeRO-2", "ds-zero3": "DeepSpeed ZeRO-3",
    "ds-zero3-offload": "DeepSpeed ZeRO-3 + ZeRO-Offload (CPU Adam)",
    "ds-zero3-infinity": "DeepSpeed ZeRO-3 + ZeRO-Infinity (NVMe)",
    "zero1": "zerocompile stage 1", "zero1-overlap": "zerocompile stage 1, overlap_reduction",
    "zero2": "zerocompile stage 2", "zero3": "zerocompile stage 3",
    "zero3-profile": "zerocompile stage 3, profile=True",
    "zero3-qwz": "zerocompile stage 3, ZeRO++ qwZ + qgZ",
    "zero3-nopass": "zerocompile stage 3, no opt. passes",
    "zero3-offload": "zerocompile stage 3, NVMe optimizer offload",
    "zero3-infinity": "zerocompile stage 3, NVMe optimizer + parameter offload",
}
STAGE = {"floor": 0, "ddp": 0, "ddp-compile": 0, "fsdp2": 3, "fsdp2-compile": 3, "ds-zero1": 1, "ds-zero2": 2, "ds-zero3": 3,
         "ds-zero3-offload": 3, "ds-zero3-infinity": 3,
         "zero1": 1, "zero1-overlap": 1, "zero2": 2, "zero3": 3, "zero3-profile": 3, "zero3-qwz": 3, "zero3-nopass": 3, "zero3-offload": 3, "zero3-infinity": 3}
APPROXIMATE = {"zero3-qwz": 0.02}
UNCHECKED = ("floor",)
"""Systems whose losses are not the data-parallel run's: the compute floor trains each rank's model
on its own micro-batch alone (no gradient averaging), so its losses are not compared."""
"""Systems that change the numbers on purpose (quantized communication), with the largest
relative loss difference from the reference that is not a divergence (issue 11: 2%)."""
OFFLOADED = ("zero3-offload", "ds-zero3-infinity", "zero3-infinity")
PARAMS_OFFLOADED = ("zero3-infinity",)
AGAINST_FLOOR = ("zero1", "zero1-overlap", "zero2", "zero3")
"""The systems the footer compares with the compute floor (and the transfer floor)."""
"""Systems whose optimizer state lives in a swap file (a temporary directory per rank): their
model-state formula is parameters and gradients only, 8 Psi / N."""
REFERENCE = "fsdp2"
WORKLOADS = ("gpt-4m", "gpt-40m", "llama", "gpt-tiny")
DEFAULT_WORKLOADS = ("gpt-4m", "gpt-40m", "llama")
DS_BUCKET = 25 * 2**20 // 4   # elements: 25 MiB of fp32
log = logging.getLogger("bench")


# --------------------------------------------------------------------------- workloads
def workload_spec(name: str, quick: bool) -> dict:
    """Model and run sizes of one workload. ``inner_compiler`` None means ``--inner-compiler``."""
    if quick or name == "gpt-tiny":
        return dict(name=name, kind="llama" if name == "llama" else "gpt", vocab=256, seq_len=32, d_model=64,
                    n_layers=2, n_heads=2, batch=2, warmup=0, steps=2, inner_compiler="eager")
    if name == "gpt-4m":
        return dict(name=name, kind="gpt", vocab=4096, seq_len=128, d_model=256, n_layers=4, n_heads=4,
                    batch=4, warmup=3, steps=20, inner_compiler=None)
    if name == "gpt-40m":
        # inductor compiles a 12-block model for 5 compiled systems too slowly on 2 cores for
        # `make bench` to fit in 20 minutes from a cold cache: the big workload runs eager
        return dict(name=name, kind="gpt", vocab=8192, seq_len=128, d_model=512, n_layers=12, n_heads=8,
                    batch=2, warmup=1, steps=6, inner_compiler="eager")
    if name == "llama":
        return dict(name=name, kind="llama", vocab=4096, seq_len=128, d_model=256, n_layers=4, n_heads=4,
                    batch=4, warmup=3, steps=20, inner_compiler=None)
    raise ValueError(f"unknown workload {name!r}")


class LlamaLM(nn.Module):
    """A randomly initialised ``LlamaForCausalLM`` that returns the mean next-token loss of
    ``(idx, targets)``, like the demo GPT."""

    def __init__(self, spec: dict):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["d_model"],
                             intermediate_size=int(spec["d_model"] * 8 / 3) // 8 * 8,
                             num_hidden_layers=spec["n_layers"], num_attention_heads=spec["n_heads"],
                             num_key_value_heads=spec["n_heads"], max_position_embeddings=spec["seq_len"],
                             tie_word_embeddings=False, attn_implementation="sdpa")
        self.model = LlamaForCausalLM(config)

    def forward(self, idx, targets):
        logits = self.model(input_ids=idx, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def make_model(spec: dict, example) -> nn.Module:
    """The workload's model, initialised from the current torch seed."""
    if spec["kind"] == "llama":
        return LlamaLM(spec)
    return example.GPT(spec["vocab"], spec["seq_len"], spec["d_model"], spec["n_layers"], spec["n_heads"])


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks (what FSDP2 shards, and compiles, one by one)."""
    return model.model.model.layers if isinstance(model, LlamaLM) else model.blocks


def workload_available(name: str) -> str | None:
    """Why a workload cannot run here, or None."""
    if name == "llama":
        try:
            import transformers  # noqa: F401
        except ImportError:
            return "transformers is not installed"
    return None


def deepspeed_missing() -> str | None:
    """Why DeepSpeed cannot be used here, or None."""
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: skip it
        return f"deepspeed could not be imported: {type(exc).__name__}: {exc}"
    return None


# --------------------------------------------------------------------------- systems
@dataclass
class System(harness.System):
    """A system of this benchmark: a DeepSpeed engine steps itself, and a measured step records
    the model-state bytes held after the optimizer step."""

    state_bytes: list = field(default_factory=list)
    swap_dir: str | None = None
    """The temporary nvme_path of an offloading system (removed after the run)."""

    def train_step(self, x, y, measure: bool) -> torch.Tensor:
        """One optimizer step: forward, backward, step, zero_grad. With ``measure``, records the
        live bytes after the optimizer step (the model state) first. Returns the detached loss."""
        if self.name.startswith("ds-"):
            loss = self.model(x, y)
            self.model.backward(loss)
            self.model.step()   # zeroes the gradients itself
        else:
            loss = self.model(x, y)
            loss.backward()
            self.opt.step()
        if measure:
            self.state_bytes.append(self.tracker.settled_live_bytes())
        if self.opt is not None:
            self.opt.zero_grad()
        return loss.detach()


def build_system(name: str, args, spec: dict, example, device: torch.device, disabled: list[str]) -> System:
    """Build one system from the seed, under its own live-storage tracker."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import zerocompile
    from zerocompile.runtime.memory_tracker import LiveStorageTracker

    inner = spec["inner_compiler"] or args.inner_compiler
    system = System(name, tracker=LiveStorageTracker(exact_peak=True, track_inputs=True))
    hyper = dict(lr=args.lr, weight_decay=args.weight_decay)
    # torch's fastest AdamW for the systems that step a torch optimizer: the fairest peer of
    # zerocompile's fused kernel (torch's default on CPU is the slower for-loop)
    torch_opt = dict(hyper, fused=True)
    with system.tracker:
        torch.manual_seed(args.seed)
        model = make_model(spec, example).to(device)
        if name == "floor":
            # the physical floor of a data-parallel step here: the same training step of one rank's
            # micro-batch with the same inner compiler, and no collective at all
            system.model = torch.compile(model, backend="aot_eager" if inner == "eager" else "inductor")
            system.opt = torch.optim.AdamW(model.parameters(), **torch_opt)
        elif name in ("ddp", "ddp-compile"):
            system.model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
            if name == "ddp-compile":
                # the like-for-like peer of zerocompile's stages 0-2: the same inner compiler on
                # DDP's model (Dynamo's DDPOptimizer splits the graph at DDP's buckets)
                system.model = torch.compile(system.model, backend="aot_eager" if inner == "eager" else "inductor")
            system.opt = torch.optim.AdamW(model.parameters(), **torch_opt)
        elif name in ("fsdp2", "fsdp2-compile"):
            for block in blocks_of(model):
                if name == "fsdp2-compile":
                    block.compile(backend="aot_eager" if inner == "eager" else "inductor")
                fully_shard(block)
            fully_shard(model)
            system.model = model
            system.opt = torch.optim.AdamW(model.parameters(), **torch_opt)
        elif name.startswith("ds-"):
            import deepspeed

            config = {"train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 1,
                      # buckets of 25 MiB of fp32, zerocompile's default bucket_mb: DeepSpeed's default of
                      # 5e8 elements allocates a 1.9 GiB buffer that would dwarf every other figure
                      "zero_optimization": {"stage": STAGE[name], "reduce_bucket_size": DS_BUCKET,
                                            "allgather_bucket_size": DS_BUCKET,
                                            "stage3_prefetch_bucket_size": DS_BUCKET},
                      # DeepSpeed clips gradients to norm 1.0 unless told otherwise; no other system clips
                      "gradient_clipping": 0.0,
                      # a torch optimizer is "untested" to DeepSpeed's ZeRO; it works
                      "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
            if name in ("ds-zero3-offload", "ds-zero3-infinity"):
                # DeepSpeed's offload runs its own CPU Adam (built on first use), configured here
                offload = {"device": "cpu"}
                if name == "ds-zero3-infinity":
                    system.swap_dir = tempfile.mkdtemp(prefix="zerocompile-bench-ds-swap-")
                    offload = {"device": "nvme", "nvme_path": system.swap_dir}
                config["zero_optimization"]["offload_optimizer"] = offload
                config["optimizer"] = {"type": "AdamW", "params": hyper}
                engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            else:
                engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), **torch_opt),
                                                       config=config)
            system.model = engine
        else:
            options = {"stage": STAGE[name], "inner_compiler": inner}
            if name == "zero3-nopass":
                options["passes"] = {"disable": list(disabled)}
            if name == "zero3-profile":
                options["profile"] = True
            if name == "zero3-qwz":
                options.update(zero_quantized_weights=True, zero_quantized_gradients=True)
            if name == "zero1-overlap":
                options["overlap_reduction"] = True
            if name in OFFLOADED:
                system.swap_dir = tempfile.mkdtemp(prefix="zerocompile-bench-swap-")
                options["offload_optimizer"] = {"device": "nvme", "nvme_path": system.swap_dir}
            if name in PARAMS_OFFLOADED:
                options["offload_param"] = {"device": "nvme", "nvme_path": system.swap_dir}
            system.model = torch.compile(model, backend="zero", options=options)
            system.opt = zerocompile.ZeroOptimizer(system.model.parameters(), optimizer_class=torch.optim.AdamW,
                                                   **hyper)
    return system


def disk_floor_ms(nbytes: int, rounds: int = 3) -> float:
    """What the disk alone costs an offloaded optimizer step: every rank at once reads ``nbytes``
    (its optimizer state's moments, 8 Psi/N for fp32 AdamW) from a swap file and writes as many
    to another, both in flight together, through zerocompile's ``SwapFile`` with the offload's
    default threads and request size (``O_DIRECT`` where the filesystem allows), as the step's
    tiles are read and written. The median over ``rounds`` of this rank's ms. No offloaded step
    whose file I/O runs inside the step can cost less than this over the same step without
    offload."""
    from zerocompile.runtime.offload_settings import OffloadSettings
    from zerocompile.runtime.swap_file import SwapFile, aligned_empty

    settings = OffloadSettings()               # the offload's defaults: threads, request size
    n = nbytes // 4
    times = []
    with tempfile.TemporaryDirectory(prefix="zerocompile-bench-floor-") as directory:
        swap = SwapFile(directory, "floor", threads=settings.threads, block_bytes=settings.block_size)
        try:
            source, target = aligned_empty(n, torch.float32), aligned_empty(n, torch.float32)
            source.fill_(1.0)
            for key in ("in", "out"):
                swap.reserve(key, n * 4)
            swap.write("in", source).wait()
            for _ in range(rounds):
                dist.barrier()
                start = time.perf_counter()
                reading, writing = swap.read("in", target), swap.write("out", source)
                reading.wait()
                writing.wait()
                times.append(time.perf_counter() - start)
        finally:
            swap.close()
    return statistics.median(times) * 1e3


def param_file_floor_ms(shard_numels: list[int], rounds: int = 3) -> float:
    """What the shard files alone cost a step with ``offload_param`` on top of the moments'
    ``disk_floor_ms``: every rank at once reads each of its fp32 parameter shards (``shard_numels``
    elements each, one file per parameter, zerocompile's own ``ShardFile``) three times (the
    forward's gather, the backward's re-gather, the optimizer step's read-back) and writes each
    once (the step's write-back), on the offload's default threads, one file per transfer. The
    median over ``rounds`` of this rank's ms."""
    from concurrent.futures import ThreadPoolExecutor

    from zerocompile.runtime.offload_settings import OffloadSettings
    from zerocompile.runtime.param_offload import ShardFile

    threads = OffloadSettings().threads
    times = []
    with tempfile.TemporaryDirectory(prefix="zerocompile-bench-param-floor-") as directory:
        files = [ShardFile(directory, f"p{i}", torch.zeros(n)) for i, n in enumerate(shard_numels)]
        buffers = [torch.empty(n) for n in shard_numels]
        with ThreadPoolExecutor(threads) as pool:
            for _ in range(rounds):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(3):
                    list(pool.map(lambda fb: fb[0].read_into(fb[1]), zip(files, buffers)))
                list(pool.map(lambda fb: fb[0].write(fb[1]), zip(files, buffers)))
                times.append(time.perf_counter() - start)
        for f in files:
            f.close()
    return statistics.median(times) * 1e3


def transfer_floor_ms(numel: int, world: int, rounds: int = 3) -> dict:
    """What the step's transfers alone cost where every rank is on this host: the fp32
    parameters (``numel`` elements, ``DEFAULT_BUCKET_MB`` buckets, two in flight) all-gathered
    and their gradients reduce-scattered through the ranks' shared-memory segment in place
    (zerocompile's fastest forms here: the replica receives into itself, rows are sent from the
    gradient; ``benchmarks/collectives.py``), every rank at once, with no compute beside them.
    On this machine the copies in and out of the segment are made by the same cores that
    compute, so they cannot hide behind it: a step that moves these bytes costs at least the
    compute floor plus them. ``{"gather": ms, "reduce_scatter": ms}``, medians over ``rounds``
    of this rank's ms; stage 3 moves two gathers and one reduce-scatter a step, stages 1-2 one
    of each."""
    from zerocompile.optim.buckets import DEFAULT_BUCKET_MB
    from zerocompile.runtime import point_to_point  # noqa: F401  (registers the ops)

    rank, group_name, ops = dist.get_rank(), dist.group.WORLD.group_name, torch.ops.zerocompile
    per_bucket = max(world, int(DEFAULT_BUCKET_MB * 2**20) // 4 // world * world)
    buckets = [torch.randn(-(-min(per_bucket, numel - start) // world) * world)
               for start in range(0, numel, per_bucket)]
    shards = [b.new_empty(b.numel() // world) for b in buckets]

    def gather():
        for b in buckets:
            ops.all_gather_point_to_point_into([b.view(world, -1)[rank]], [b], world, group_name, True)
            yield b

    def reduce_scatter():
        for b, shard in zip(buckets, shards):
            ops.reduce_scatter_point_to_point_into([b], [shard], world, group_name, True)
            yield shard

    times = {"gather": [], "reduce_scatter": []}
    for r in range(rounds + 1):                     # the first round warms up
        for name, started in (("gather", gather), ("reduce_scatter", reduce_scatter)):
            dist.barrier()
            start = time.perf_counter()
            two_in_flight(started())
            if r:
                times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def rank_main(rank: int, world: int, args, spec: dict) -> dict:
    """Everything one rank does for one workload; returns its figures."""
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    example = load_example()
    disabled, note, pass_error = harness.listed_passes()
    # every compiled system compiles the same model code (GPT.forward), one more version each:
    # past Dynamo's recompile limit (8) the next would silently run uncompiled, so the limit is
    # raised above the number of systems
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(args.systems))
    torch.manual_seed(args.seed)
    psi = sum(p.numel() for p in make_model(spec, example).parameters())
    ds_reason = deepspeed_missing() if any(n.startswith("ds-") for n in args.systems) else None

    systems = []
    for name in args.systems:
        if name.startswith("ds-") and ds_reason:
            systems.append(System(name, skipped=ds_reason))
            continue
        try:
            systems.append(build_system(name, args, spec, example, device, disabled))
        except Exception:  # noqa: BLE001
            error = traceback.format_exc()
            log.error("rank %d: building %s failed:\n%s", rank, name, error)
            if name.startswith("ds-"):
                systems.append(System(name, skipped="DeepSpeed failed to initialise: " + error_line(error)))
            else:
                systems.append(System(name, error=error))
        if not all_ranks_ok(systems[-1].error is None and systems[-1].skipped is None) \
                and systems[-1].error is None and systems[-1].skipped is None:
            systems[-1].error = "failed to build on another rank"
    if pass_error is not None:
        for s in systems:
            if s.name.startswith("zero") and s.error is None:
                s.error = "could not list the optional passes:\n" + pass_error

    harness.run_rounds(systems, example, rank, world, vocab=spec["vocab"], batch=spec["batch"],
                       seq_len=spec["seq_len"], warmup=spec["warmup"], steps=spec["steps"], device=device,
                       label=spec["name"])
    for s in systems:
        if s.swap_dir is not None:
            s.opt = s.model = None                 # the optimizer deletes its swap file when collected
            shutil.rmtree(s.swap_dir, ignore_errors=True)
    floor_ms = param_floor = None
    if any(s.name in OFFLOADED and s.name.startswith("zero") and s.error is None for s in systems):
        floor_ms = disk_floor_ms(8 * psi // world)
    if any(s.name in PARAMS_OFFLOADED and s.error is None for s in systems):
        param_floor = param_file_floor_ms([-(-p.numel() // world) for p in make_model(spec, example).parameters()])
    transfers = None
    # a collective: every rank measures it or none (all_ranks_ok agrees on whether the systems ran everywhere)
    if device.type == "cpu" and world > 1 and all_ranks_ok(
            any(s.name == "floor" and s.error is None for s in systems)
            and any(s.name in AGAINST_FLOOR and s.error is None for s in systems)):
        transfers = transfer_floor_ms(psi, world)

    return {
        "psi": psi, "disabled_passes": disabled, "pass_note": note, "disk_floor_ms": floor_ms,
        "param_file_floor_ms": param_floor, "transfer_floor_ms": transfers,
        "systems": {s.name: {"error": s.error, "skipped": s.skipped, "first_s": s.first_s, "step_ms": s.step_ms,
                             "losses": s.losses, "peak_bytes": s.peak_bytes,
                             "allocator_peak_bytes": s.allocator_peak_bytes, "state_bytes": s.state_bytes,
                             "comm": s.comm}
                    for s in systems},
    }


# --------------------------------------------------------------------------- report
def state_formula(stage: int, psi: int, world: int, offloaded: bool = False, params_offloaded: bool = False) -> float:
    """Model-state bytes per rank of fp32 AdamW at a ZeRO stage (the formulas of zerocompile's
    tests); with the optimizer state offloaded, stage 3 holds parameters and gradients, 8 Psi/N;
    with the parameters offloaded as well, the gradients, 4 Psi/N."""
    if params_offloaded:
        return 4 * psi / world
    if offloaded:
        return 8 * psi / world
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / world, 2: 4 * psi + 12 * psi / world, 3: 16 * psi / world}[stage]


def comm_formula(stage: int, psi: int, world: int) -> float:
    """Bytes each rank sends per step with ring collectives: 2Psi fp32 elements (all-reduce, or
    reduce-scatter + all-gather) at stages 0-2, 3Psi at stage 3, times (N-1)/N."""
    return (3 if stage == 3 else 2) * 4 * psi * (world - 1) / world


def wire_bytes(totals: dict, world: int) -> float:
    """Ring-algorithm bytes sent per rank from full-buffer totals: an all-reduce counts twice."""
    return (world - 1) / world * (totals["all_gather"]["bytes"] + totals["reduce_scatter"]["bytes"]
                                  + 2 * totals["all_reduce"]["bytes"])


def summarise(ranks: list[dict], args, world: int) -> dict:
    """Combine the ranks' figures of one workload: per step the slowest rank's time, peaks,
    state and comm the max over ranks, the loss check against the reference, the ratios."""
    psi = ranks[0]["psi"]
    names = list(ranks[0]["systems"])
    ok = [n for n in names if all(r["systems"][n]["error"] is None and r["systems"][n]["skipped"] is None
                                  for r in ranks)]
    # never the compute floor, whose ranks train apart on their own micro-batches
    comparable = [n for n in ok if n not in UNCHECKED]
    reference = REFERENCE if REFERENCE in ok else ("ddp" if "ddp" in ok else (comparable[0] if comparable else None))
    out = {}
    for name in names:
        per_rank = [r["systems"][name] for r in ranks]
        entry = {"label": LABELS[name], "stage": STAGE[name], "status": "ok", "error": None}
        skipped = [p["skipped"] for p in per_rank if p["skipped"]]
        errors = [p["error"] for p in per_rank if p["error"]]
        if skipped:
            entry.update(status="skipped", error=skipped[0])
            out[name] = entry
            continue
        if errors:
            entry.update(status="failed", error=errors[0])
            out[name] = entry
            continue
        totals = [p["comm"]["totals"] for p in per_rank]
        entry.update(
            **harness.step_figures(per_rank),
            state_bytes=max(p["state_bytes"][-1] for p in per_rank),
            state_formula_bytes=state_formula(STAGE[name], psi, world, offloaded=name in OFFLOADED,
                                              params_offloaded=name in PARAMS_OFFLOADED),
            **harness.comm_figures(per_rank),
            comm_wire_bytes=max(wire_bytes(t, world) for t in totals),
            comm_formula_bytes=comm_formula(STAGE[name], psi, world),
            losses=[p["losses"] for p in per_rank],
        )
        entry["state_ratio"] = entry["state_bytes"] / entry["state_formula_bytes"]
        entry["comm_ratio"] = (entry["comm_wire_bytes"] / entry["comm_formula_bytes"]
                               if entry["comm_formula_bytes"] else None)
        out[name] = entry
    floors = [r.get("disk_floor_ms") for r in ranks]
    floor = max(floors) if all(f is not None for f in floors) else None
    params = [r.get("param_file_floor_ms") for r in ranks]
    param_floor = max(params) if all(f is not None for f in params) else None
    transfers = [r.get("transfer_floor_ms") for r in ranks]
    transfer = ({k: max(t[k] for t in transfers) for k in transfers[0]}
                if transfers and all(t is not None for t in transfers) else None)
    measured_floors = {"disk_floor_ms": floor, "param_file_floor_ms": param_floor, "transfer_floor_ms": transfer}
    if reference is None:
        return {"psi": psi, "reference": None, "systems": out, **measured_floors}
    ref = out[reference]
    for name, entry in out.items():
        if entry["status"] != "ok":
            continue
        worst = harness.max_rel_loss_diff(entry["losses"], ref["losses"])
        entry["max_rel_loss_diff"] = worst
        if name not in UNCHECKED and not worst <= APPROXIMATE.get(name, args.rtol):
            entry["status"] = "diverged"
        entry.update(harness.speed_ratios(entry, ref))
    return {"psi": psi, "reference": reference, "systems": out, **measured_floors}


def format_markdown(workload: str, spec: dict, result: dict, world: int) -> str:
    """The markdown table of one workload (see benchmarks/README.md for how to read it)."""
    inner = spec["inner_compiler"]
    lines = [f"### {workload}: Ψ = {result['psi'] / 1e6:.2f}M parameters, {world} ranks, "
             f"{spec['batch']} x {spec['seq_len']} tokens/rank/step, inner compiler {inner}, "
             f"{spec['steps']} timed steps after 1 + {spec['warmup']}",
             "",
             f"| system | median ms/step (min–max) | first step s | × {LABELS[result['reference'] or REFERENCE]} | "
             "peak MiB/rank | model-state MiB (formula) | comm MiB/step (formula) | loss ok |",
             "|---|---|---|---|---|---|---|---|"]
    for name, e in result["systems"].items():
        if e["status"] in ("skipped", "failed"):
            lines.append(f"| {e['label']} | {e['status'].upper()}: {error_line(e['error'])[:150].replace('|', '/')} "
                         "| | | | | | |")
            continue
        mem = (f"{e['allocator_peak_bytes'] / MiB:.1f} | {e['state_bytes'] / MiB:.1f} "
               f"({e['state_formula_bytes'] / MiB:.1f}) | {e['comm_wire_bytes'] / MiB:.1f} "
               f"({e['comm_formula_bytes'] / MiB:.1f})")
        check = f"{'yes' if e['status'] == 'ok' else 'NO'} ({e['max_rel_loss_diff']:.0e})"
        if name in UNCHECKED:
            check = "not compared (each rank alone)"
        if e["status"] == "diverged":
            lines.append(f"| {e['label']} | DIVERGED | | | {mem} | {check} |")
            continue
        lines.append(f"| {e['label']} | {e['median_ms']:.1f} ({e['min_ms']:.1f}–{e['max_ms']:.1f}) | "
                     f"{e['first_step_s']:.2f} | ×{e['ms_ratio']:.2f} | {mem} | {check} |")
    compute = result["systems"].get("floor", {})
    if compute.get("status") == "ok":
        transfer = result.get("transfer_floor_ms")
        ratios, with_transfers = [], []
        for n, e in result["systems"].items():
            if n not in AGAINST_FLOOR or e.get("status") != "ok":
                continue
            ratios.append(f"{e['label']} ×{e['median_ms'] / compute['median_ms']:.2f}")
            if transfer is not None:
                floor_ms = compute["median_ms"] + (2 if n == "zero3" else 1) * transfer["gather"] + \
                    transfer["reduce_scatter"]
                with_transfers.append(f"{e['label']} ×{e['median_ms'] / floor_ms:.2f} of {floor_ms:.1f} ms")
        lines += ["", f"Compute floor: {compute['median_ms']:.1f} ms per step (one rank's micro-batch, same compiler, "
                  f"torch's fused AdamW on the whole model, no collectives). Against it: {', '.join(ratios)}."]
        if transfer is not None:
            gather, scatter = transfer["gather"], transfer["reduce_scatter"]
            lines.append(f"Transfer floor (`transfer_floor_ms`): the fp32 parameters all-gathered once through the "
                         f"ranks' shared memory in place take {gather:.1f} ms, their gradients reduce-scattered "
                         f"{scatter:.1f} ms (every rank at once, nothing else running, slowest rank); the copies "
                         f"are made by the cores that compute, so a step that moves these bytes here costs at least "
                         f"the compute floor plus them (stage 3: two gathers and a reduce-scatter, stages 1-2: one "
                         f"of each). Against compute floor + transfers: {', '.join(with_transfers)}.")
    floor = result.get("disk_floor_ms")
    param_floor = result.get("param_file_floor_ms")
    if floor is not None:
        lines += ["", f"Disk floor: every rank at once reading and writing its {8 * result['psi'] / world / 1e6:.0f} MB "
                  f"of moments (8Ψ/N) through a swap file takes {floor:.1f} ms (`disk_floor_ms`, slowest rank)."]
        if param_floor is not None:
            lines.append(f"Parameter files: every rank at once reading each of its fp32 shards (4Ψ/N, one file per "
                         f"parameter) three times and writing it once takes {param_floor:.1f} ms more "
                         f"(`param_file_floor_ms`): the forward's, the backward's and the step's reads, the step's write.")
        base = result["systems"].get("zero3", {})
        for name in ("zero3-offload", "zero3-infinity"):
            e = result["systems"].get(name, {})
            if e.get("status") == "ok" and base.get("status") == "ok":
                own = floor + (param_floor if name == "zero3-infinity" and param_floor is not None else 0.0)
                which = "both floors" if name == "zero3-infinity" and param_floor is not None else "the floor"
                lines.append(f"{e['label']}: {e['median_ms'] - base['median_ms']:.1f} ms over stage 3's step "
                             f"(×{e['median_ms'] / base['median_ms']:.2f}); stage 3 plus {which} would be "
                             f"×{(base['median_ms'] + own) / base['median_ms']:.2f}.")
    return "\n".join(lines)


def plot(results: dict, specs: dict, path: Path) -> str | None:
    """Step time and peak memory per system, one pair of panels per workload; None when
    written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    names = [w for w, r in results.items() if r.get("systems")]
    if not names:
        return "no results to plot"
    fig, axes = plt.subplots(len(names), 2, figsize=(13, 3.8 * len(names)), squeeze=False)
    for row, workload in enumerate(names):
        entries = [(name, e) for name, e in results[workload]["systems"].items() if e["status"] in ("ok", "diverged")]
        labels = [e["label"] for _, e in entries]
        speed = [e["median_ms"] if e["status"] == "ok" else 0.0 for _, e in entries]
        lo = [e["median_ms"] - e["min_ms"] if e["status"] == "ok" else 0.0 for _, e in entries]
        hi = [e["max_ms"] - e["median_ms"] if e["status"] == "ok" else 0.0 for _, e in entries]
        axes[row][0].barh(labels, speed, xerr=[lo, hi], color="tab:blue")
        axes[row][0].set_title(f"{workload}: median step time (min–max), ms")
        axes[row][0].invert_yaxis()
        axes[row][1].barh(labels, [e["allocator_peak_bytes"] / MiB for _, e in entries], color="tab:orange")
        axes[row][1].set_title(f"{workload}: peak MiB per rank (CPU allocator)")
        axes[row][1].invert_yaxis()
        axes[row][1].set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: gloo ranks; cuda: NCCL, one GPU per rank")
    p.add_argument("--inner-compiler", default="inductor", choices=("inductor", "eager"),
                   help="what compiles zerocompile's graphs and FSDP2's blocks (eager: aot_eager), for the "
                        "workloads that do not fix it (gpt-40m and --quick use eager)")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=None,
                   help="workloads to run (default: gpt-4m gpt-40m llama; with --quick: gpt-tiny; --quick shrinks "
                        "any workload to the tiny sizes)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="systems to run")
    p.add_argument("--quick", action="store_true", help="tiny model, 3 steps, every system: a smoke test")
    harness.add_training_options(p, reference="the reference", timeout_s=600.0)
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for latest.json, latest.md, latest.png")
    args = p.parse_args(argv)
    if args.workloads is None:
        args.workloads = ["gpt-tiny"] if args.quick else list(DEFAULT_WORKLOADS)
    if args.world_size < 1:
        p.error("--world-size must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    harness.prepare_main()
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    backend = "nccl" if args.device == "cuda" else "gloo"
    started = time.time()
    load_before = os.getloadavg()
    results, specs, tables = {}, {}, []
    disabled = None
    for workload in args.workloads:
        spec = workload_spec(workload, args.quick)
        spec["inner_compiler"] = spec["inner_compiler"] or args.inner_compiler
        specs[workload] = spec
        why = workload_available(workload)
        if why:
            log.warning("skipping workload %s: %s", workload, why)
            results[workload] = {"skipped": why}
            continue
        log.info("%s: spawning %d %s ranks (%s inner compiler)", workload, args.world_size, backend,
                 spec["inner_compiler"])
        t0 = time.time()
        ranks = spawn_ranks(args.world_size, rank_main, (args, spec), backend=backend, timeout_s=args.timeout,
                            threads=args.threads)
        results[workload] = summarise(ranks, args, args.world_size)
        results[workload]["wall_s"] = time.time() - t0
        disabled = ranks[0]["disabled_passes"]
        table = format_markdown(workload, spec, results[workload], args.world_size)
        tables.append(table)
        print("\n" + table + "\n", flush=True)

    notes = [
        f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(started))} UTC at commit {harness.git_commit()}, "
        f"torch {torch.__version__}.",
        f"{args.world_size} {backend} ranks x {args.threads} thread(s) on {os.cpu_count()} CPUs, fp32 AdamW "
        f"(lr {args.lr}, weight decay {args.weight_decay}); load average before {load_before[0]:.1f}.",
        "ms/step: median over timed steps of the slowest rank (min–max); × is the ratio of medians to the "
        "reference. first step: includes compilation where there is one.",
        "peak: largest bytes allocated by the CPU allocator during one step (AllocatorPeak: the live tensor "
        "storages when the step began, plus the largest rise the profiler's allocator events show, "
        "inductor's own buffers included), highest rank.",
        "model state: live bytes right after the optimizer step (before zero_grad), against the ZeRO formula "
        "16Ψ / 8Ψ+8Ψ/N / 4Ψ+12Ψ/N / 16Ψ/N (FSDP2 = stage 3, DDP = stage 0; 8Ψ/N with the optimizer state "
        "offloaded, 4Ψ/N with the parameters too, plus buffers). DeepSpeed frees its "
        "gradients inside step(), so its figure holds none; DeepSpeed keeps its 25 MiB buckets.",
        "comm: bytes each rank sends per step with ring collectives, (N-1)/N x (all-gather + reduce-scatter "
        "+ 2 x all-reduce full buffers) from one dispatch-mode counter, against 2x4Ψ(N-1)/N (stages 0-2) "
        "or 3x4Ψ(N-1)/N (stage 3).",
        f"loss ok: largest relative loss difference from the reference over all steps and ranks, tolerance "
        f"{args.rtol:g} ({', '.join(f'{LABELS[n]}: {t:g}' for n, t in APPROXIMATE.items())}, which quantizes "
        "its communication on purpose). A system that diverges gets no speed figures. The comm formula of a "
        "quantized system is the unquantized one.",
        f"zerocompile stage 3, no opt. passes disables: {disabled}.",
    ]
    for workload, result in results.items():
        for name, e in result.get("systems", {}).items():
            if e.get("comm_unknown_ops"):
                notes.append(f"{workload}/{name} ran collectives the counter does not size: {e['comm_unknown_ops']}")
    wall = time.time() - started
    notes.append(f"wall time {wall:.0f} s.")
    print("\n".join("- " + n for n in notes))

    args.out.mkdir(parents=True, exist_ok=True)
    md = "# zerocompile benchmark\n\n" + "\n\n".join(tables) + "\n\n" + "\n".join("- " + n for n in notes) + "\n"
    (args.out / "latest.md").write_text(md)
    why = plot(results, specs, args.out / "latest.png")
    if why:
        log.warning("no plot: %s", why)
    payload = {
        **harness.result_header("run", args, argv),
        "workloads": {w: {"spec": specs[w], **results[w]} for w in results},
        "disabled_passes": disabled,
        "wall_s": wall,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }
    with open(args.out / "latest.json", "w") as f:
        json.dump(payload, f, indent=1)
    log.info("wrote %s, %s, %s", args.out / "latest.json", args.out / "latest.md", args.out / "latest.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
