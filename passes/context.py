"""The typed context every graph pass receives."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from zerocompile.runtime.comm import CommGroup

if TYPE_CHECKING:                       # passes take their options as arguments (passes/manager.py)
    from zerocompile.config import ZeroConfig


@dataclass
class PassContext:
    """What a pass may know about the frame it rewrites."""

    config: ZeroConfig
    """The backend's configuration. Only the pass manager reads it (to choose the passes and
    bind each one's options as arguments); a pass never does."""
    group: CommGroup
    """The data-parallel group (rank, world size, c10d name)."""
    frame: str
    """A name for the compiled frame, for logs and dumps."""
    graph_kind: str = "dynamo"
    """Which graph the pass sees: "dynamo" (torch IR from Dynamo), "joint" (AOTAutograd joint
    graph, before partitioning), "forward" or "backward" (after partitioning), or "inference"
    (the one graph of a frame run without autograd)."""
    provided: set = field(default_factory=set)
    """Capabilities provided by passes that already ran on this frame."""
    primal_params: list = field(default_factory=list)
    """Per input of the joint graph (its ``primals_*`` placeholders, in order): the
    ``ShardedParam`` whose shard or replica it is, or None."""
    num_fwd_outputs: int = 0
    """Number of real outputs of the forward (the rest of the joint outputs are gradients)."""
    device: object = None
    """The ``torch.device`` of the frame's parameters (where its collectives run)."""
    cost_model: object = None
    """The ``CostModel`` (``zerocompile.passes.analyses.cost_model``) the passes weigh decisions with."""
    gradient_reduction: object = None
    """Stages 1/2: the ``ReductionChoice`` (``runtime/reduction_choice.py``) of the frame's group:
    which collective reduces a gradient bucket of each size; None at other stages."""
    recorder: object = None
    """The ``DumpRecorder`` when dumping is on (``options={"dump": DIR}``), else None."""
    progress: object = None
    """Called as ``progress(graph_kind, pass_name)`` before each pass runs (the first step's
    status line, ``zerocompile/progress.py``), or None."""
    results: dict = field(default_factory=dict)
    """What passes report about this frame (e.g. ``results["selective_unshard"]``), for logs,
    dumps and tests."""
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("zerocompile.passes"))
