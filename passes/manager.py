"""The pass manager: the ordered list of graph passes for a config, and how they run.

A pass is a function ``(gm, ctx, **knobs, **inputs) -> gm`` registered here with the graphs it
runs on (``dynamo``: Dynamo's torch-IR graph; ``joint``: AOTAutograd's joint graph,
before partitioning; ``forward`` / ``backward``: the partitioned graphs; ``inference``:
the one graph of a frame run without autograd), the stages it
applies to, what it requires and what it provides. The pipeline for a config is this
list in order, minus passes that do not apply and optional passes the user disabled
by name (``options={"passes": {"disable": [...]}}``). ``check_pipeline`` refuses a
config whose enabled passes require something no earlier enabled pass provides.

This registry is the one place that reads the backend's configuration for the passes: each
entry's ``bind`` picks the options its pass takes as keyword arguments (as torchtitan's
graph_trainer binds them with ``functools.partial``), so a pass sees its knobs as arguments
and never the whole config; the ``PassContext`` carries only what the frame shares (the group,
the graph kind, the parameters, the cost model, the results).

After each pass the graph is linted and recompiled, the pass is timed, and, when
dumping, the graph and a summary are recorded (``ctx.recorder``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch.fx

from zerocompile.errors import ZeroConfigError, unknown_key_message
from zerocompile.passes.context import PassContext

GRAPH_KINDS = ("dynamo", "joint", "forward", "backward", "inference")


@dataclass(frozen=True)
class GraphPass:
    """One registered pass."""

    name: str
    fn: Callable
    graph_kinds: tuple
    """Which graphs it runs on, a subset of ``GRAPH_KINDS``."""
    stages: tuple = (0, 1, 2, 3)
    requires: tuple = ()
    provides: tuple = ()
    optional: bool = True
    """Optional passes may be disabled by name; required ones carry the stage semantics."""
    enabled: Callable = lambda config: True
    """Whether the config asks for this pass (beyond its stage list and the disabled names)."""
    summary: str = ""
    """One line for docs and ``zerocompile show``."""
    required_because: str = ""
    """For a pass that is not optional: why it cannot be disabled (for the error)."""
    ensures: Callable | None = None
    """``ensures(gm, ctx, **knobs)``: a check of the graph after the pass ran, which raises when
    the graph breaks what the pass promises (``torch.fx.passes.infra``'s ``ensures``)."""
    bind: Callable = lambda config: {}
    """The pass's knobs: the keyword arguments it takes from the config (``config -> dict``)."""
    option: str = ""
    """For a pass an option asks for (``enabled``), that option's name: ``check_stages`` refuses
    the option at a stage the pass does not apply to, with ``stage_reason`` and ``otherwise``."""
    stage_reason: str = ""
    """Why the pass needs its stages (for the error)."""
    otherwise: str = ""
    """The other fix than changing the stage (for the error)."""


def _registry() -> list[GraphPass]:
    from zerocompile.passes.align_compute_dtypes import align_compute_dtypes
    from zerocompile.passes.all_reduce_gradients import all_reduce_gradients
    from zerocompile.passes.bucketing import bucketing
    from zerocompile.passes.cast_before_gather import cast_before_gather
    from zerocompile.passes.cast_forward_inputs import cast_forward_inputs
    from zerocompile.passes.hierarchical_partition import hierarchical_partition
    from zerocompile.passes.offload_activations import offload_activations
    from zerocompile.passes.plan_activations import plan_activations
    from zerocompile.passes.insert_param_collectives import insert_param_collectives
    from zerocompile.passes.point_to_point_collectives import point_to_point_collectives
    from zerocompile.passes.prefetch import prefetch
    from zerocompile.passes.quantize_gradient_reductions import quantize_gradient_reductions
    from zerocompile.passes.quantize_weight_gathers import quantize_weight_gathers
    from zerocompile.passes.recompute import recompute
    from zerocompile.passes.reduce_scatter_in_place import reduce_scatter_in_place
    from zerocompile.passes.reshard_after_forward import reshard_after_forward
    from zerocompile.passes.selective_unshard import selective_unshard
    from zerocompile.passes.tag_collectives import ensure_tagged, tag_collectives

    return [
        GraphPass("insert_param_collectives", insert_param_collectives, ("dynamo",),
                  provides=("param_collectives",), optional=False,
                  summary="parameters become shards plus the stage's collectives",
                  required_because="it implements the ZeRO stage itself (use stage=0 for plain data parallelism)"),
        GraphPass("cast_forward_inputs", cast_forward_inputs, ("dynamo",),
                  enabled=lambda config: config.sharding.param_dtype is not None,
                  bind=lambda config: {"param_dtype": config.sharding.param_dtype},
                  summary="cast floating-point inputs to param_dtype"),
        GraphPass("cast_before_gather", cast_before_gather, ("dynamo",), stages=(3,),
                  requires=("param_collectives",),
                  summary="cast shards to param_dtype before the all-gather, not after"),
        GraphPass("align_compute_dtypes", align_compute_dtypes, ("dynamo",), requires=("param_collectives",),
                  enabled=lambda config: config.sharding.param_dtype is not None,
                  bind=lambda config: {"param_dtype": config.sharding.param_dtype},
                  summary="cast float32 operands of mixed-dtype matrix products to param_dtype"),
        GraphPass("tag_collectives", tag_collectives, ("joint", "inference"), requires=("param_collectives",),
                  provides=("tags",), optional=False, ensures=ensure_tagged,
                  bind=lambda config: {"stage": config.sharding.stage},
                  summary="tag each parameter all-gather / gradient reduce-scatter with its role and parameter",
                  required_because="it only labels nodes, and the other passes find their collectives by its "
                                   "labels (disable those passes instead)"),
        GraphPass("selective_unshard", selective_unshard, ("joint",), stages=(3,), requires=("tags",),
                  provides=("unshard_plan",),
                  enabled=lambda config: config.passes.reshard_after_forward and config.passes.unshard_budget_mb != 0,
                  bind=lambda config: {"unshard_budget_mb": config.passes.unshard_budget_mb,
                                       "memory_limit_mb": config.passes.memory_limit_mb},
                  summary="keep the parameters worth keeping gathered from forward to backward"),
        GraphPass("reshard_after_forward", reshard_after_forward, ("joint",), stages=(3,), requires=("tags",),
                  provides=("resharded",), enabled=lambda config: config.passes.reshard_after_forward,
                  summary="re-gather the other parameters in backward instead of saving them"),
        GraphPass("hierarchical_partition", hierarchical_partition, ("joint", "forward", "backward"), stages=(3,),
                  requires=("tags", "resharded"), optional=False,
                  enabled=lambda config: config.passes.zero_hpz_partition_size > 1,
                  bind=lambda config: {"zero_hpz_partition_size": config.passes.zero_hpz_partition_size},
                  option="zero_hpz_partition_size", otherwise="or set it to 1",
                  stage_reason="it partitions the parameters the backward re-gathers",
                  summary="ZeRO++ hpZ: backward re-gathers from secondary shards within groups of k ranks",
                  required_because="it is what zero_hpz_partition_size asks for (set zero_hpz_partition_size=1 "
                                   "instead)"),
        GraphPass("recompute", recompute, ("joint",), requires=("tags",), provides=("recompute_plan",),
                  enabled=lambda config: config.passes.recompute != "none",
                  bind=lambda config: {"recompute": config.passes.recompute},
                  summary="recompute activations in backward instead of saving them"),
        GraphPass("plan_activations", plan_activations, ("joint",), requires=("tags",), optional=False,
                  enabled=lambda config: config.passes.offload_activations.enabled
                  and config.passes.offload_activations.budget_mb is not None,
                  bind=lambda config: {"settings": config.passes.offload_activations},
                  summary="choose per block among keeping, recomputing and offloading its saved activations "
                          "to fit offload_activations.budget_mb",
                  required_because="it is what offload_activations.budget_mb asks for (drop budget_mb to "
                                   "offload every saved activation instead)"),
        GraphPass("bucketing", bucketing, ("forward", "backward", "inference"), stages=(2, 3), requires=("tags",),
                  provides=("buckets",), enabled=lambda config: config.passes.bucket_mb > 0,
                  bind=lambda config: {"bucket_mb": config.passes.bucket_mb},
                  summary="coalesce consecutive all-gathers / reduce-scatters into flat buckets"),
        GraphPass("quantize_weight_gathers", quantize_weight_gathers, ("forward", "backward", "inference"),
                  stages=(3,), requires=("tags",), optional=False,
                  enabled=lambda config: config.passes.zero_quantized_weights,
                  option="zero_quantized_weights", otherwise="or drop it",
                  stage_reason="it quantizes the parameter all-gathers, which only stage 3 has",
                  summary="ZeRO++ qwZ: parameter all-gathers move int8 values and block scales",
                  required_because="it is what zero_quantized_weights asks for (set zero_quantized_weights=False "
                                   "instead)"),
        GraphPass("quantize_gradient_reductions", quantize_gradient_reductions, ("backward",),
                  stages=(2, 3), requires=("tags",), optional=False,
                  enabled=lambda config: config.passes.zero_quantized_gradients,
                  option="zero_quantized_gradients", otherwise="or drop it",
                  stage_reason="it quantizes the gradient reduce-scatters of the backward graphs",
                  bind=lambda config: {"zero_hpz_partition_size": config.passes.zero_hpz_partition_size},
                  summary="ZeRO++ qgZ: gradient reduce-scatters become int8 all-to-alls and a local sum",
                  required_because="it is what zero_quantized_gradients asks for (set "
                                   "zero_quantized_gradients=False instead)"),
        GraphPass("prefetch", prefetch, ("forward", "backward", "inference"), stages=(2, 3), requires=("tags",),
                  enabled=lambda config: config.passes.prefetch,
                  bind=lambda config: {"prefetch_mb": config.passes.prefetch_mb,
                                       "memory_limit_mb": config.passes.memory_limit_mb},
                  summary="issue all-gathers early and wait late, within the memory budget"),
        GraphPass("all_reduce_gradients", all_reduce_gradients, ("backward",), stages=(2,), requires=("tags",),
                  optional=False, enabled=lambda config: config.sharding.gradient_reduction != "reduce_scatter",
                  summary="gradient reduce-scatters become all-reduces (each rank keeps its slice) where "
                          "gradient_reduction chooses them as faster",
                  required_because="it is what gradient_reduction asks for (set gradient_reduction="
                                   "'reduce_scatter' instead)"),
        GraphPass("point_to_point_collectives", point_to_point_collectives, ("forward", "backward", "inference"),
                  stages=(2, 3), requires=("tags",), optional=False,
                  enabled=lambda config: config.sharding.parameter_gather != "all_gather"
                  or config.sharding.gradient_reduction in ("auto", "point_to_point", "shared_memory"),
                  bind=lambda config: {"copy_input": config.compiler.inner_compiler != "eager"},
                  summary="parameter all-gathers and gradient reduce-scatters become point-to-point transfers "
                          "(the same bytes and values) where parameter_gather / gradient_reduction choose them "
                          "as faster",
                  required_because="it is what parameter_gather / gradient_reduction ask for (set "
                                   "parameter_gather='all_gather' and gradient_reduction='reduce_scatter' instead)"),
        GraphPass("reduce_scatter_in_place", reduce_scatter_in_place, ("backward",), stages=(2, 3),
                  requires=("tags",),
                  summary="a CPU gradient bucket is reduce-scattered in its own memory, not from a copy of it "
                          "(gloo's reduce-scatter copies its input; so do point-to-point transfers under "
                          "inductor)"),
        GraphPass("offload_activations", offload_activations, ("forward", "backward"), optional=False,
                  enabled=lambda config: config.passes.offload_activations.enabled,
                  bind=lambda config: {"settings": config.passes.offload_activations},
                  summary="copy saved activations out after forward makes them and read them back ahead of "
                          "their use in backward",
                  required_because="it is what offload_activations asks for (set offload_activations=None "
                                   "instead)"),
    ]


def pass_names() -> list[str]:
    return [p.name for p in _registry()]


def registered_passes() -> list[GraphPass]:
    """Every registered pass, in pipeline order."""
    return _registry()


def check_disabled_passes(names: tuple) -> None:
    """Raise ``ZeroConfigError`` for an unknown or non-optional pass name."""
    known = {p.name: p for p in _registry()}
    for name in names:
        if name not in known:
            raise ZeroConfigError(unknown_key_message(name, list(known)).replace(
                "unknown option", "unknown pass in the disabled passes:"))
        if not known[name].optional:
            raise ZeroConfigError(f"pass '{name}' cannot be disabled: {known[name].required_because}")


def check_stages(config, passes: list | None = None) -> None:
    """Raise ``ZeroConfigError`` for an option that asks for a pass at a stage the pass does not
    apply to (the stage rules live in the registry, once)."""
    for p in _registry() if passes is None else passes:
        if p.option and config.sharding.stage not in p.stages and p.enabled(config):
            stages = " or ".join(str(s) for s in p.stages)
            raise ZeroConfigError(f"option '{p.option}' needs stage {stages} ({p.stage_reason}), not stage "
                                  f"{config.sharding.stage}; use stage={stages}, {p.otherwise}")


def _selected(config, graph_kind: str | None = None, passes: list | None = None) -> list[GraphPass]:
    out = []
    for p in _registry() if passes is None else passes:
        if graph_kind is not None and graph_kind not in p.graph_kinds:
            continue
        if config.sharding.stage in p.stages and p.name not in config.passes.disabled_passes and p.enabled(config):
            out.append(p)
    return out


def check_pipeline(config, passes: list | None = None) -> None:
    """Raise ``ZeroConfigError`` if an enabled pass requires what no earlier enabled pass
    provides. ``passes`` defaults to the registry (tests pass their own)."""
    every = _registry() if passes is None else passes
    provided: dict = {}
    for p in _selected(config, passes=every):
        for req in p.requires:
            if req not in provided:
                makers = [q.name for q in every if req in q.provides] or ["(none)"]
                raise ZeroConfigError(
                    f"pass '{p.name}' requires '{req}', which pass {' or '.join(repr(m) for m in makers)} "
                    f"provides, but that pass is disabled or does not apply to stage {config.sharding.stage}; "
                    f"enable it or also disable '{p.name}'")
        for cap in p.provides:
            provided[cap] = p.name


def pipeline(ctx: PassContext, graph_kind: str) -> list[GraphPass]:
    """The passes that run on ``graph_kind`` graphs for this context's config."""
    return _selected(ctx.config, graph_kind)


def run_passes(gm: torch.fx.GraphModule, ctx: PassContext, graph_kind: str, **inputs) -> torch.fx.GraphModule:
    """Run the pipeline for ``graph_kind`` on ``gm``: check requirements, lint and time each
    pass, and (when dumping) record the graph after each. The passes read and rewrite the
    graph, never the module's generated Python code, so that code is generated once, after
    the last pass (and after each pass when dumping, whose records include it): each
    generation costs as much as a small pass (6 of them took 0.2 s of a 4-layer HF Llama's
    5 s compile)."""
    ctx.graph_kind = graph_kind
    if ctx.recorder is not None:
        ctx.recorder.record(ctx.frame, graph_kind, "input", gm, 0.0)
    for p in pipeline(ctx, graph_kind):
        missing = [r for r in p.requires if r not in ctx.provided]
        if missing:
            raise RuntimeError(f"zerocompile: pass '{p.name}' requires {missing}, which no earlier pass provided")
        if ctx.progress is not None:
            ctx.progress(graph_kind, p.name)
        start = time.perf_counter()
        knobs = p.bind(ctx.config)
        gm = p.fn(gm, ctx, **knobs, **inputs) or gm
        gm.graph.lint()
        if p.ensures is not None:
            p.ensures(gm, ctx, **knobs)
        elapsed = time.perf_counter() - start
        ctx.provided.update(p.provides)
        ctx.logger.debug("[%s] %s graph after %s: %d nodes, %.1f ms", ctx.frame, graph_kind, p.name,
                         len(gm.graph.nodes), elapsed * 1e3)
        if ctx.recorder is not None:
            gm.recompile()
            ctx.recorder.record(ctx.frame, graph_kind, p.name, gm, elapsed)
    gm.recompile()
    return gm
