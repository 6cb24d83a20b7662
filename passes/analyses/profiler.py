"""Analysis: a cost model measured on the frame's own graph (``options={"profile": True}``).

``selective_unshard``, ``recompute``, ``prefetch`` and ``plan_activations`` weigh each node's
compute time against all-gather (and activation transfer) times. By default those times are estimates: FLOPs and bytes divided by four
probed rates (``cost_model.py``). With ``profile=True`` they are measured on the graph that
will run, once per compiled frame, before the joint-graph passes decide anything:

- **Compute.** Each distinct op of the joint graph (or the inference graph) is run on the
  frame's device and timed: best of ``repeats`` runs after a warm-up. Ops are distinct by
  target, argument shapes, strides and dtypes, and their other arguments, so a model of
  identical blocks times one block's ops, not all of them. The inputs are made for the
  timing (random floats, zero integers and booleans), never the user's tensors: dense ops
  take the same time whatever the values.
- **Communication.** Each distinct all-gather size of the graph, and one bucket of
  ``bucket_mb``, is gathered on the real group and timed. A least-squares fit of
  ``alpha + wire bytes / bandwidth`` to those points gives the sizes not measured (buckets,
  reduce-scatters, all-reduces).
- **Activation offload.** When the ``plan_activations`` pass will run (``offload_activations``
  with a ``budget_mb``), each distinct size of the saved storages it may offload (at most
  ``MAX_OFFLOAD_SIZES``, spread over the range) is copied out and read back through the very
  ops and store the ``offload_activations`` pass uses; half the round trip is the size's
  transfer time, and a fit of ``alpha + bytes * beta`` gives the sizes not measured. The
  regions this reserves in the swap file are the ones the real tensors of those sizes reuse.
- **Identical on every rank.** The ranks first check that they profile the same ops and
  sizes (the same graph), then all-gather their timings and keep the slowest rank's figure
  for each, so every rank makes the same decisions.

Not touched: the user's tensors, the random-number generators (forked around the
timing, so dropout masks stay those of an unprofiled run) and ``zerocompile.stats()``.
Ops that cannot be timed keep the estimate: zerocompile's own ops, ops that fail on
made-up values (data-dependent shapes), and on CUDA ops whose tensors would take more than
half the free memory. Where nothing can be timed (the meta device, the fake process group
of ``zerocompile dump`` and ``plan``, tensors under a fake mode) the profile is skipped
with a log line.

Op times are those of ATen ops run one by one, as the eager inner compiler runs them;
inductor fuses pointwise ops, so for it the measured time of an elementwise chain is an
upper bound.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time

import torch
import torch.distributed as dist
import torch.fx

from zerocompile import _torch_compat
from zerocompile.passes.analyses.cost_model import CostModel, synchronize
from zerocompile.passes.graph_utils import COLLECTIVE_OPS, concrete_int, tensor_nbytes
from zerocompile.passes.analyses.liveness import is_view, tensors_of
from zerocompile.runtime.comm import CommGroup, is_fake_group
from zerocompile.runtime.fingerprint import fingerprint

log = logging.getLogger("zerocompile")

_c10d = torch.ops._c10d_functional
MAX_GATHER_SIZES = 12
"""At most this many distinct all-gather sizes are timed per frame (spread over the range)."""
MAX_OFFLOAD_SIZES = 8
"""At most this many distinct saved-activation sizes are offloaded and reloaded per frame."""
_SLOW_OP_S = 0.1
"""An op whose warm-up run takes longer than this is timed once more, not ``repeats`` times."""


@dataclasses.dataclass(frozen=True)
class ProfiledCostModel(CostModel):
    """A ``CostModel`` whose node and all-gather times are measured where they could be;
    the rest are estimated from the rates (``alpha_s`` and ``bandwidth`` fitted to the
    measured all-gathers)."""

    op_seconds: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)
    """Measured seconds per op signature (``op_signature``)."""
    gather_seconds: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)
    """Measured seconds per all-gather output size in bytes."""
    offload_seconds: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)
    """Measured seconds to copy one saved tensor out (half its round trip) per size in bytes."""
    offload_fit: tuple | None = dataclasses.field(default=None, hash=False, compare=False)
    """``(alpha, beta)``: ``alpha + bytes * beta`` seconds one way, fitted to ``offload_seconds``;
    None with fewer than two sizes (the ``offload_gbps`` rate is used for unmeasured sizes)."""

    def node_time(self, node: torch.fx.Node) -> float:
        if node.op != "call_function" or node.target in COLLECTIVE_OPS or is_view(node):
            return 0.0
        signature = op_signature(node)
        measured = self.op_seconds.get(signature) if signature is not None else None
        return measured if measured is not None else super().node_time(node)

    def collective_time(self, kind: str, nbytes: int, world: int) -> float:
        if kind == "all_gather" and world > 1 and nbytes in self.gather_seconds:
            return self.gather_seconds[nbytes]
        return super().collective_time(kind, nbytes, world)

    def offload_time(self, nbytes: int) -> float:
        if nbytes in self.offload_seconds:
            return self.offload_seconds[nbytes]
        if self.offload_fit is not None:
            return self.offload_fit[0] + nbytes * self.offload_fit[1]
        return super().offload_time(nbytes)


# ----------------------------------------------------------------------------- signatures
def _arg_signature(a):
    if isinstance(a, torch.fx.Node):
        val = a.meta.get("val")
        if isinstance(val, torch.Tensor):
            return ("tensor", tuple(concrete_int(s) for s in val.shape),
                    tuple(concrete_int(s) for s in val.stride()), str(val.dtype), val.device.type)
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
            return ("scalar", repr(_concrete(val)))
        return None  # a value with no metadata: the op cannot be reproduced
    if isinstance(a, (list, tuple)):
        parts = tuple(_arg_signature(x) for x in a)
        return None if any(p is None for p in parts) else parts  # None: a node without metadata inside
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return repr(_concrete(a))
    return repr(a)


def op_signature(node: torch.fx.Node) -> tuple | None:
    """What identifies a node's op for timing: target, tensor shapes, strides, dtypes,
    devices and the other arguments; None if the node cannot be timed on its own."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    if node.target in COLLECTIVE_OPS or is_view(node) or node.target.namespace == "zerocompile":
        return None
    if not tensors_of(node.meta.get("val")):
        return None
    args = _arg_signature(tuple(node.args))
    kwargs = tuple(sorted((k, _arg_signature(v)) for k, v in node.kwargs.items()))
    if args is None or any(v is None for _, v in kwargs):
        return None
    return (str(node.target), args, kwargs)


def _concrete(x):
    if isinstance(x, torch.SymInt):
        return concrete_int(x)
    if isinstance(x, torch.SymFloat):
        hint = x.node.hint
        return float(hint) if hint is not None else 0.0
    if isinstance(x, torch.SymBool):
        hint = x.node.hint
        return bool(hint) if hint is not None else False
    return x


# ----------------------------------------------------------------------------- timing ops
def _made_up(val, generators: dict) -> torch.Tensor:
    """A real tensor with ``val``'s shape, strides, dtype and device: random floats, zero
    integers and booleans."""
    shape = [concrete_int(s) for s in val.shape]
    stride = [concrete_int(s) for s in val.stride()]
    out = torch.empty_strided(shape, stride, dtype=val.dtype, device=val.device)
    if out.dtype.is_floating_point or out.dtype.is_complex:
        gen = generators.get(out.device)
        if gen is None:
            gen = generators[out.device] = torch.Generator(out.device).manual_seed(0)
        out.normal_(generator=gen)
    else:
        out.zero_()
    return out


def _materialize(a, made: dict, generators: dict):
    if isinstance(a, torch.fx.Node):
        if a not in made:
            val = a.meta.get("val")
            made[a] = _made_up(val, generators) if isinstance(val, torch.Tensor) else _concrete(val)
        return made[a]
    if isinstance(a, (list, tuple)):
        return type(a)(_materialize(x, made, generators) for x in a)
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _concrete(a)
    return a


def _best_time(fn, device: torch.device, repeats: int, adaptive: bool = True) -> float:
    """Best of ``repeats`` timed runs after a warm-up run; ``adaptive``: one timed run when the
    warm-up was slow. Collectives pass ``adaptive=False``: every rank must run them the same
    number of times, and a decision on a local timing could differ between ranks (a hang)."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()  # warm-up
    synchronize(device)
    first = time.perf_counter() - t0
    best = math.inf
    for _ in range(1 if adaptive and first > _SLOW_OP_S else repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _node_bytes(node: torch.fx.Node) -> int:
    vals = [v for a in node.all_input_nodes for v in tensors_of(a.meta.get("val"))]
    vals += tensors_of(node.meta.get("val"))
    return sum(tensor_nbytes(v) for v in vals)


def _fits(node: torch.fx.Node, device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return _node_bytes(node) <= free // 2


def time_op(node: torch.fx.Node, repeats: int = 3) -> float | None:
    """Seconds one run of ``node``'s op takes on made-up inputs of its shapes (best of
    ``repeats`` after a warm-up), or None if it cannot run on them."""
    device = tensors_of(node.meta.get("val"))[0].device
    if not _fits(node, device):
        return None
    made: dict = {}
    generators: dict = {}
    try:
        args = _materialize(tuple(node.args), made, generators)
        kwargs = {k: _materialize(v, made, generators) for k, v in node.kwargs.items()}
        with torch.no_grad():
            return _best_time(lambda: node.target(*args, **kwargs), device, repeats)
    except Exception as err:  # noqa: BLE001 - e.g. a data-dependent op on made-up values
        log.debug("profile: %s (%s) could not be timed on made-up inputs (%s: %s); its estimate is used",
                  node.name, node.target, type(err).__name__, err)
        return None
    finally:
        made.clear()


# ----------------------------------------------------------------------------- all-gathers
def gather_sizes(graph: torch.fx.Graph, bucket_bytes: int, limit: int = MAX_GATHER_SIZES) -> list[int]:
    """The distinct all-gather output sizes (bytes) of ``graph``, plus ``bucket_bytes`` when
    > 0; at most ``limit`` of them, spread over the sorted range."""
    sizes = {tensor_nbytes(n.meta["val"]) for n in graph.nodes
             if n.target is _c10d.all_gather_into_tensor.default and isinstance(n.meta.get("val"), torch.Tensor)}
    if bucket_bytes > 0 and sizes:
        sizes.add(int(bucket_bytes))
    return _spread(sizes, limit)


def _spread(sizes, limit: int) -> list[int]:
    """At most ``limit`` of the positive ``sizes``, spread over their sorted range."""
    ordered = sorted(s for s in sizes if s > 0)
    if len(ordered) > limit:
        step = (len(ordered) - 1) / (limit - 1)
        ordered = sorted({ordered[round(i * step)] for i in range(limit)})
    return ordered


# ----------------------------------------------------------------------------- activation offload
def offload_sizes(graph: torch.fx.Graph, settings, device: torch.device, limit: int = MAX_OFFLOAD_SIZES) -> list[int]:
    """The distinct sizes (bytes) of the saved activations ``plan_activations`` may offload
    (``settings``: the ``offload_activations`` settings; none unless its planner runs and there
    is somewhere to move them), at most ``limit`` of them, spread over the sorted range."""
    from zerocompile.passes.offload_activations import offloadable_roots
    from zerocompile.passes.recompute import SavedBytesEstimator

    if settings is None or settings.budget_mb is None or (settings.device == "cpu" and device.type != "cuda"):
        return []
    estimator = SavedBytesEstimator(graph)
    roots = offloadable_roots(estimator.saved_roots({}), estimator.root_bytes, settings.min_kb * 1024)
    return _spread({estimator.root_bytes[r] for r in roots}, limit)


def time_offload(nbytes: int, settings, device: torch.device, repeats: int = 3) -> float:
    """Seconds to copy a saved tensor of ``nbytes`` out and back through the ops the
    ``offload_activations`` pass inserts (``settings``' store), best of ``repeats`` after a
    warm-up: the region it reserves in the store is the one the real tensor of that size
    reuses."""
    path = settings.nvme_path or ""
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)

    def round_trip():
        token = torch.ops.zerocompile.offload_activation(source, settings.device, path)
        back = torch.ops.zerocompile.reload_activation(token, settings.device, path, [nbytes], [1], torch.uint8,
                                                       device)
        torch.ops._c10d_functional.wait_tensor(back)

    return _best_time(round_trip, device, repeats, adaptive=False)


def _gather(x: torch.Tensor, group: CommGroup, works: list, out: torch.Tensor | None = None) -> torch.Tensor:
    """All-gather of the 1-D ``x``, waited for, through c10d's own call: the profile runs
    inside AOTAutograd, where ``torch.compiler.is_compiling()`` is true and the functional
    collectives of ``runtime/comm.py`` would take their traced path.

    The work is appended to ``works``, which the caller holds until the profile's last
    collective is done. In torch 2.13 a gloo work that drops the last C++ reference to a
    Python-owned tensor needs the GIL, and gloo's worker drops it while holding the lock
    that the next collective's enqueue takes, with the GIL held: gathers issued back to back
    deadlock (seen in ``benchmarks/run.py``). A work still referenced here is destroyed later,
    on this thread."""
    if out is None:
        out = x.new_empty(group.world * x.numel())
    work = dist.all_gather_single(out, x, group=group.group, async_op=True)
    works.append(work)
    work.wait()
    return out


def time_gather(nbytes: int, group: CommGroup, device: torch.device, repeats: int = 3,
                works: list | None = None) -> float:
    """Seconds of one all-gather whose output is ``nbytes`` (float32) on ``group``; see
    ``_gather`` for ``works``."""
    works = [] if works is None else works
    x = torch.zeros(max(1, math.ceil(nbytes / 4 / group.world)), device=device)
    out = x.new_empty(group.world * x.numel())
    return _best_time(lambda: _gather(x, group, works, out), device, repeats, adaptive=False)


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``seconds = alpha + wire_bytes * beta`` over ``(wire_bytes, seconds)``;
    None with fewer than two distinct sizes or a slope that is not positive."""
    if len({w for w, _ in points}) < 2:
        return None
    n = len(points)
    mean_w = sum(w for w, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    var = sum((w - mean_w) ** 2 for w, _ in points)
    beta = sum((w - mean_w) * (t - mean_t) for w, t in points) / var
    if beta <= 0:
        return None
    return max(mean_t - beta * mean_w, 1e-7), beta


# ----------------------------------------------------------------------------- the profile
def can_profile(group: CommGroup, device: torch.device, fake_params: bool = False) -> str | None:
    """Why nothing can be timed here, or None if it can."""
    if device.type == "meta":
        return "the parameters are on the meta device"
    if is_fake_group(group):
        return "the process group is torch's fake one (zerocompile dump / plan)"
    if fake_params:
        return "the parameters are fake tensors"
    return None


def _same_on_all_ranks(digest: int, group: CommGroup, device: torch.device, frame: str, works: list) -> None:
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    values = _gather(mine, group, works).tolist()
    differing = [r for r, v in enumerate(values) if v != values[0]]
    if differing:
        raise RuntimeError(
            f"zerocompile [{frame}]: profile: ranks {differing} are about to time other ops or all-gather sizes "
            f"than rank 0, so their graphs differ (different models, shapes or options per rank). Give every "
            f"rank the same model, batch shapes and options; set profile=False to see which collective differs")


def profile_graph(graph: torch.fx.Graph, base: CostModel, group: CommGroup, device: torch.device,
                  bucket_bytes: int = 0, frame: str = "frame", repeats: int = 3,
                  fake_params: bool = False, offload=None) -> tuple[CostModel, dict]:
    """Time ``graph``'s distinct ops and all-gather sizes (see the module docstring).

    Returns the cost model (``base`` unchanged when nothing can be timed) and a summary for
    ``frame_reports()``. Collective: every rank of ``group`` calls it with the same graph.
    ``fake_params``: the frame's parameters are fake tensors (a script run under a
    ``FakeTensorMode``), so there is nothing real to time on. ``offload``: the
    ``offload_activations`` settings, whose store times the sizes ``offload_sizes`` gives."""
    why_not = can_profile(group, device, fake_params)
    if why_not is not None:
        log.info("[%s] profile: skipped (%s); the passes use the estimates", frame, why_not)
        return base, {"skipped": why_not}
    # AOTAutograd calls the partitioner under its FakeTensorMode: step out of it to time
    with _torch_compat.real_tensors():
        return _profile(graph, base, group, device, bucket_bytes, frame, repeats, offload)


def _profile(graph, base, group, device, bucket_bytes, frame, repeats, offload) -> tuple[CostModel, dict]:
    start = time.perf_counter()
    works: list = []  # every collective's work, held until the last one is done (see _gather)
    first: dict = {}
    for node in graph.nodes:
        sig = op_signature(node)
        if sig is not None and sig not in first:
            first[sig] = node
    signatures = list(first)
    sizes = gather_sizes(graph, bucket_bytes) if group.world > 1 else []
    moved = offload_sizes(graph, offload, device)
    multi = group.world > 1
    if multi:
        _same_on_all_ranks(fingerprint([signatures, sizes, moved]), group, device, frame, works)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        op_times = [time_op(first[s], repeats) for s in signatures]
    gather_times = [time_gather(n, group, device, repeats, works) for n in sizes]
    offload_times = [time_offload(n, offload, device, repeats) / 2 for n in moved]
    mine = torch.tensor([-1.0 if t is None else t for t in op_times] + gather_times + offload_times,
                        dtype=torch.float64, device=device)
    if multi and mine.numel():
        # the slowest rank's figure for each (an op no rank could time stays -1)
        mine = _gather(mine, group, works).view(group.world, -1).amax(0)
    values = mine.cpu().tolist()
    works.clear()  # destroyed here, on this thread, now that no collective follows
    op_seconds = {s: v for s, v in zip(signatures, values) if v >= 0}
    gather_seconds = dict(zip(sizes, values[len(signatures):len(signatures) + len(sizes)]))
    offload_seconds = dict(zip(moved, values[len(signatures) + len(sizes):]))
    frac = (group.world - 1) / group.world if multi else 1.0
    fit = fit_alpha_beta([(n * frac, t) for n, t in gather_seconds.items()])
    rates = {} if fit is None else {"alpha_s": fit[0], "bandwidth": 1.0 / fit[1]}
    model = ProfiledCostModel(**{**{f.name: getattr(base, f.name) for f in dataclasses.fields(CostModel)},
                                 **rates}, op_seconds=op_seconds, gather_seconds=gather_seconds,
                              offload_seconds=offload_seconds,
                              offload_fit=fit_alpha_beta(list(offload_seconds.items())))
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    measured = sum(model.node_time(n) for n in nodes)
    estimated = sum(base.node_time(n) for n in nodes)
    summary = {
        "ops_timed": len(op_seconds), "ops_estimated": len(signatures) - len(op_seconds),
        "gather_sizes": len(sizes), "seconds": time.perf_counter() - start,
        "graph_compute_s": {"measured": measured, "estimated": estimated},
        "alpha_us": model.alpha_s * 1e6, "bandwidth_gbps": model.bandwidth / 1e9,
        "offload_sizes": len(moved),
        "offload_gbps": (sum(moved) / sum(offload_seconds.values()) / 1e9) if moved else None,
        "digest": hashlib.sha256(repr(sorted(map(repr, op_seconds.items())) + sorted(
            gather_seconds.items()) + sorted(offload_seconds.items())).encode()).hexdigest()[:16],
    }
    log.info("[%s] profile: timed %d distinct ops (%d kept estimates), %d all-gather sizes and %d activation "
             "offload sizes in %.2f s; the graph's compute measures %.3f s against an estimated %.3f s", frame,
             summary["ops_timed"], summary["ops_estimated"], len(sizes), len(moved), summary["seconds"], measured,
             estimated)
    return model, summary
