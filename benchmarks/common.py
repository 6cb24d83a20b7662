"""Machinery shared by the benchmarks in this folder.

- ``load_example()``: the GPT and the data of ``examples/train_gpt.py``;
- ``optional_pass_names()``: the optional zerocompile passes a "no optional passes" run disables;
- ``CollectiveBytes``: a dispatch mode that counts every collective of a step (functional and
  c10d ops alike) with the bytes of its full buffer, the same way for every system;
- ``spawn_ranks()`` / ``rank_entry()``: start ``world`` local ranks, run a function in each
  inside an initialised process group and collect what each returns;
- ``all_ranks_ok()``, ``quantile()``, ``error_line()``: small helpers of the report.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import logging
import math
import os
import socket
import statistics
import tempfile
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from zerocompile.runtime.rank_exit import rank_teardown

MiB = 2**20
REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
log = logging.getLogger("benchmarks.common")


# --------------------------------------------------------------------------- model and passes
def load_example():
    """Import ``examples/train_gpt.py`` (the model and the data) as a module, registered in
    ``sys.modules`` (Dynamo imports a function's module by name when it resumes after a graph
    break)."""
    name = "zerocompile_example_train_gpt"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def gpt_forward_with_break(model, idx, targets, after: int):
    """The demo GPT's forward (``examples/train_gpt.py``) with a Dynamo graph break after block
    ``after`` (0-based): the compiled model runs as two frames, as models with a
    data-dependent branch or a print in the middle do."""
    import torch.nn.functional as F

    pos = torch.arange(idx.shape[1], device=idx.device)
    x = model.tok_emb(idx) + model.pos_emb(pos)
    for block in model.blocks[:after + 1]:
        x = block(x)
    torch._dynamo.graph_break()
    for block in model.blocks[after + 1:]:
        x = block(x)
    logits = model.lm_head(model.ln_f(x))
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def gpt_forward_breaking_in_loop(model, idx, targets):
    """The demo GPT's forward with a Dynamo graph break inside the block loop (after every
    block): torch 2.13 cannot resume inside a loop, so Dynamo runs this forward eagerly (the
    embeddings, final norm and head with it) and compiles each block's forward as a frame."""
    import torch.nn.functional as F

    pos = torch.arange(idx.shape[1], device=idx.device)
    x = model.tok_emb(idx) + model.pos_emb(pos)
    for block in model.blocks:
        x = block(x)
        torch._dynamo.graph_break()
    logits = model.lm_head(model.ln_f(x))
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def break_graph_in_loop(model):
    """Give the demo GPT ``model`` the forward of ``gpt_forward_breaking_in_loop``."""
    import types

    model.forward = types.MethodType(gpt_forward_breaking_in_loop, model)
    return model


def break_graph_after(model, after: int):
    """Give the demo GPT ``model`` a forward with a graph break after block ``after``."""
    import types

    if not 0 <= after < len(model.blocks) - 1:
        raise ValueError(f"--graph-break-after {after}: the model has {len(model.blocks)} blocks; "
                         f"give 0..{len(model.blocks) - 2}")
    model.graph_break_after = after
    model.forward = types.MethodType(_forward_with_break, model)
    return model


def _forward_with_break(model, idx, targets):
    return gpt_forward_with_break(model, idx, targets, model.graph_break_after)


def add_timed_gpt_arguments(parser) -> None:
    """The arguments of the scripts that time the demo GPT's steps system against system
    (``monitoring_overhead.py``, ``eager_flops_overhead.py``); ``apply_quick`` reads ``--quick``."""
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="times every system runs (in turn), for the drift")
    parser.add_argument("--inner-compiler", default="eager", choices=["eager", "inductor"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, 2 timed rounds (a smoke test)")


def apply_quick(args) -> None:
    """``--quick``: a tiny GPT, no warm-up, 2 timed rounds, one repeat."""
    if args.quick:
        args.layers, args.d_model, args.heads, args.vocab, args.seq_len, args.batch = 2, 64, 2, 256, 16, 2
        args.warmup, args.rounds, args.repeats = 0, 2, 1


def timed_gpt_steps(compiled, opt, example, args, rank: int, world: int) -> tuple[list, list]:
    """Train ``compiled`` (the demo GPT) for one step, ``args.warmup`` and ``args.rounds`` more on
    this rank's share of the example's batches; each step's milliseconds after a barrier, from
    the forward to ``zero_grad``. Returns the timed rounds' milliseconds and every step's loss."""
    table = example.successor_table(args.vocab)
    for _ in range(5):    # the first collectives of a process are slow
        dist.all_reduce(torch.zeros(1024))
    times, losses = [], []
    for step in range(1 + args.warmup + args.rounds):
        x, y = example.global_batch(step, args.batch * world, args.seq_len, table)
        x, y = x[rank * args.batch:(rank + 1) * args.batch], y[rank * args.batch:(rank + 1) * args.batch]
        dist.barrier()
        start = time.perf_counter()
        loss = compiled(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(loss.item())
    return times[1 + args.warmup:], losses


def systems_in_turn(systems, rank_main, args) -> dict:
    """Time each of ``systems`` with ``rank_main(rank, world, args, system)`` (which returns
    ``timed_gpt_steps``' ``step_ms`` and anything else) on 2 ranks of its own, the systems one
    after the other, ``args.repeats`` times (this machine's speed drifts). Per system:
    ``rounds_ms`` (each timed round's slowest rank, over every repeat), ``repeat_ms`` (each
    repeat's median), ``step_ms`` (the median of ``rounds_ms``), and rank 0's other results of
    the last repeat."""
    results = {system: {"rounds_ms": [], "repeat_ms": []} for system in systems}
    for _ in range(args.repeats):
        for system in systems:
            ranks = spawn_ranks(2, rank_main, (args, system))
            per_round = [max(r["step_ms"][i] for r in ranks) for i in range(args.rounds)]
            results[system]["rounds_ms"] += per_round
            results[system]["repeat_ms"].append(statistics.median(per_round))
            results[system].update({k: v for k, v in ranks[0].items() if k != "step_ms"})
    for r in results.values():
        r["step_ms"] = statistics.median(r["rounds_ms"])
    return results


def optional_pass_names() -> tuple[list[str], str | None]:
    """Every optional pass except ``cast_forward_inputs``, from the pass registry, and a note
    if the fallback (``pass_names()`` plus the ``optional`` flags of ``_registry()``) was used."""
    from zerocompile.passes import manager

    if hasattr(manager, "registered_passes"):
        passes, note = manager.registered_passes(), None
    else:
        passes = manager._registry()
        note = "zerocompile.passes.manager.registered_passes() is missing; used _registry()"
    names = [p.name for p in passes if p.optional and p.name != "cast_forward_inputs"]
    return names, note


# --------------------------------------------------------------------------- collective counting
def _collective_table() -> dict:
    """``(namespace, op) -> (kind, where)``: where the full buffer is, an argument name or
    ``"return"``. Covers the functional collectives and the c10d ops ``torch.distributed`` uses."""
    return {
        ("_c10d_functional", "all_gather_into_tensor"): ("all_gather", "return"),
        ("_c10d_functional", "all_gather_into_tensor_out"): ("all_gather", "out"),
        ("_c10d_functional", "all_gather_into_tensor_coalesced"): ("all_gather", "return"),
        ("_c10d_functional", "reduce_scatter_tensor"): ("reduce_scatter", "input"),
        ("_c10d_functional", "reduce_scatter_tensor_out"): ("reduce_scatter", "input"),
        ("_c10d_functional", "reduce_scatter_tensor_coalesced"): ("reduce_scatter", "inputs"),
        # zerocompile's all-to-all is ZeRO++'s quantized gradient reduce-scatter (qgZ): it sends
        # what a reduce-scatter of its input sends
        ("_c10d_functional", "all_to_all_single"): ("reduce_scatter", "input"),
        # zerocompile's point-to-point transfers (parameter_gather, gradient_reduction): the bytes of what they replace
        ("zerocompile", "all_gather_point_to_point"): ("all_gather", "return"),
        ("zerocompile", "all_gather_point_to_point_unpacked"): ("all_gather", "return"),
        ("zerocompile", "all_gather_point_to_point_out"): ("all_gather", "out"),
        ("zerocompile", "all_gather_point_to_point_into"): ("all_gather", "outs"),
        ("zerocompile", "reduce_scatter_point_to_point"): ("reduce_scatter", "x"),
        ("zerocompile", "reduce_scatter_point_to_point_into"): ("reduce_scatter", "xs"),
        ("zerocompile", "reduce_scatter_in_place"): ("reduce_scatter", "x"),   # a gradient bucket, in its own memory
        # the collective watchdog's forms of zerocompile's collectives (collective_timeout_s, the default)
        ("zerocompile", "watched_all_gather"): ("all_gather", "return"),
        ("zerocompile", "watched_all_gather_into"): ("all_gather", "out"),
        ("zerocompile", "watched_reduce_scatter"): ("reduce_scatter", "x"),
        ("zerocompile", "watched_all_to_all"): ("reduce_scatter", "x"),
        ("zerocompile", "watched_all_reduce"): ("all_reduce", "x"),
        ("zerocompile", "watched_all_reduce_"): ("all_reduce", "x"),
        ("_c10d_functional", "all_reduce"): ("all_reduce", "input"),
        ("_c10d_functional", "all_reduce_"): ("all_reduce", "input"),
        ("_c10d_functional", "all_reduce_coalesced"): ("all_reduce", "inputs"),
        ("_c10d_functional", "all_reduce_coalesced_"): ("all_reduce", "inputs"),
        ("c10d", "_allgather_base_"): ("all_gather", "output_tensor"),
        ("c10d", "allgather_"): ("all_gather", "output_tensors"),
        ("c10d", "allgather_coalesced_"): ("all_gather", "output_lists"),
        ("c10d", "allgather_into_tensor_coalesced_"): ("all_gather", "outputs"),
        ("c10d", "_reduce_scatter_base_"): ("reduce_scatter", "input_tensor"),
        ("c10d", "reduce_scatter_"): ("reduce_scatter", "input_tensors"),
        ("c10d", "reduce_scatter_tensor_coalesced_"): ("reduce_scatter", "inputs"),
        ("c10d", "allreduce_"): ("all_reduce", "tensors"),
        ("c10d", "allreduce_coalesced_"): ("all_reduce", "tensors"),
    }


_NOT_COLLECTIVES = {"wait_tensor", "barrier", "monitored_barrier_", "check_for_nan"}


def _argument(func, args, kwargs, name):
    """The value of argument ``name`` of an op call, positional or keyword."""
    if name in kwargs:
        return kwargs[name]
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) else arg.default_value
    raise KeyError(f"{func} has no argument {name!r}")


def _nbytes(value) -> int:
    """Bytes of every tensor in ``value`` (a pytree)."""
    return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


class CollectiveBytes(TorchDispatchMode):
    """Count the collectives run under this mode, by kind, with the bytes of their full buffers.

    Functional collectives (``torch.ops._c10d_functional``) and the c10d ops behind
    ``torch.distributed`` calls (``torch.ops.c10d``) are both counted; a collective is seen
    once (the mode is not active inside the op it is handling). Other ops of those
    namespaces are listed in ``unknown`` so that nothing is missed silently.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self):
        super().__init__()
        self.table = _collective_table()
        self.reset()

    def reset(self) -> None:
        """Forget everything counted so far."""
        self.totals = {k: {"count": 0, "bytes": 0} for k in ("all_gather", "reduce_scatter", "all_reduce")}
        self.ops: dict[str, int] = {}
        self.unknown: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        namespace = func.namespace
        op = func._schema.name.split("::")[1]
        if namespace in ("c10d", "_c10d_functional") or (namespace, op) in self.table:
            entry = self.table.get((namespace, op))
            if entry is not None:
                kind, where = entry
                buffer = out if where == "return" else _argument(func, args, kwargs, where)
                self.totals[kind]["count"] += 1
                self.totals[kind]["bytes"] += _nbytes(buffer)
                self.ops[str(func)] = self.ops.get(str(func), 0) + 1
            elif op not in _NOT_COLLECTIVES:
                self.unknown[str(func)] = self.unknown.get(str(func), 0) + 1
        return out

    def total_bytes(self) -> int:
        return sum(v["bytes"] for v in self.totals.values())



def two_in_flight(started) -> None:
    """Wait for what ``started`` yields (each yield has started one bucket's transfers: the
    tensor to ``wait_tensor``), the next bucket started before the previous one is waited for:
    two in flight, as zerocompile's step runs its buckets."""
    pending = []
    for waited in started:
        pending.append(waited)
        if len(pending) == 2:
            torch.ops._c10d_functional.wait_tensor(pending.pop(0))
    for waited in pending:
        torch.ops._c10d_functional.wait_tensor(waited)


def all_ranks_ok(ok: bool) -> bool:
    """Whether every rank says ok (a collective: call it outside any timed region)."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
    dist.all_reduce(flag)
    return int(flag.item()) == 0


# --------------------------------------------------------------------------- report helpers
def quantile(values: list, q: float) -> float:
    """Linear-interpolated quantile of ``values`` (0 <= q <= 1)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def error_line(error: str | None) -> str:
    """The line of a traceback that says what went wrong (the last one, less Dynamo's hints)."""
    lines = [line.strip() for line in (error or "").splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("Set TORCHDYNAMO_VERBOSE")]
    return lines[-1] if lines else "unknown error"


# --------------------------------------------------------------------------- spawning ranks
def free_port() -> int:
    """A TCP port that is free now on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_entry(rank: int, world: int, port: int, backend: str, timeout_s: float, threads: int,
               fn, fn_args: tuple, outdir: str) -> None:
    """Entry point of a spawned rank: initialise the process group, run ``fn(rank, world, *fn_args)``
    and write what it returns (a JSON-able dict) to ``outdir/<rank>.json``."""
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    with rank_teardown():   # a barrier, the group destroyed; after success os._exit(0)
        result = fn(rank, world, *fn_args)
        with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
            json.dump(result, f)


def spawn_ranks(world: int, fn, fn_args: tuple, backend: str = "gloo", timeout_s: float = 300.0,
                threads: int = 1) -> list[dict]:
    """Run ``fn(rank, world, *fn_args)`` in ``world`` spawned ranks; return their results in rank order.

    ``fn`` and ``fn_args`` must be picklable (a module-level function of the calling script is)."""
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(rank_entry, args=(world, free_port(), backend, timeout_s, threads, fn, fn_args, outdir),
                           nprocs=world, join=True, start_method="spawn")
        results = []
        for r in range(world):
            with open(os.path.join(outdir, f"{r}.json")) as f:
                results.append(json.load(f))
    return results
