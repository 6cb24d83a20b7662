"""The pass manager: the ordered list of graph passes for a config, and how they run.

A pass is a function ``(gm, ctx, **inputs) -> gm`` registered here with the graph it
runs on, what it requires and what it provides. The pipeline for a config is this
list in order, minus passes that do not apply to the stage and optional passes the
user disabled by name (``options={"disabled_passes": [...]}``). After each pass the
graph is linted and recompiled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.fx

from zerocompile.passes.context import PassContext


@dataclass(frozen=True)
class GraphPass:
    """One registered pass."""

    name: str
    fn: Callable
    graph_kind: str  # "dynamo" or "joint"
    stages: tuple = (0, 1, 2, 3)
    requires: tuple = ()
    provides: tuple = ()
    optional: bool = True
    """Optional passes may be disabled by name; required ones carry the stage semantics."""
    enabled: Callable = lambda config: True
    """Whether the config asks for this pass (beyond its stage list and ``disabled_passes``)."""


def _registry() -> list[GraphPass]:
    from zerocompile.passes.cast_forward_inputs import cast_forward_inputs
    from zerocompile.passes.insert_param_collectives import insert_param_collectives
    from zerocompile.passes.reshard_after_forward import reshard_after_forward

    return [
        GraphPass("insert_param_collectives", insert_param_collectives, "dynamo",
                  provides=("param_collectives",), optional=False),
        GraphPass("cast_forward_inputs", cast_forward_inputs, "dynamo",
                  enabled=lambda config: config.param_dtype is not None),
        GraphPass("reshard_after_forward", reshard_after_forward, "joint", stages=(3,),
                  requires=("param_collectives",), provides=("resharded",),
                  enabled=lambda config: config.reshard_after_forward),
    ]


def pass_names() -> list[str]:
    return [p.name for p in _registry()]


def check_disabled_passes(names: tuple) -> None:
    """Raise ``ZeroConfigError`` for an unknown or non-optional pass name."""
    from zerocompile.config import ZeroConfigError, _unknown_key_message

    known = {p.name: p for p in _registry()}
    for name in names:
        if name not in known:
            raise ZeroConfigError(_unknown_key_message(name, list(known)).replace(
                "unknown option", "unknown pass in 'disabled_passes':"))
        if not known[name].optional:
            raise ZeroConfigError(
                f"pass '{name}' cannot be disabled: it implements the ZeRO stage itself "
                "(use stage=0 for plain data parallelism)")


def pipeline(ctx: PassContext, graph_kind: str) -> list[GraphPass]:
    """The passes that run on ``graph_kind`` graphs for this context's config."""
    cfg = ctx.config
    out = []
    for p in _registry():
        if p.graph_kind != graph_kind or cfg.stage not in p.stages or p.name in cfg.disabled_passes:
            continue
        if p.enabled(cfg):
            out.append(p)
    return out


def run_passes(gm: torch.fx.GraphModule, ctx: PassContext, graph_kind: str, **inputs) -> torch.fx.GraphModule:
    """Run the pipeline for ``graph_kind`` on ``gm``, checking requirements, linting after each."""
    ctx.graph_kind = graph_kind
    for p in pipeline(ctx, graph_kind):
        missing = [r for r in p.requires if r not in ctx.provided]
        if missing:
            raise RuntimeError(f"zerocompile: pass '{p.name}' requires {missing}, which no earlier pass provided")
        gm = p.fn(gm, ctx, **inputs) or gm
        gm.graph.lint()
        gm.recompile()
        ctx.provided.update(p.provides)
        ctx.logger.debug("[%s] after %s: %d nodes", ctx.frame, p.name, len(gm.graph.nodes))
    return gm
