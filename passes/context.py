"""The typed context every graph pass receives."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from zerocompile.config import ZeroConfig
from zerocompile.runtime.comm import CommGroup


@dataclass
class PassContext:
    """What a pass may know about the frame it rewrites."""

    config: ZeroConfig
    """The backend's configuration."""
    group: CommGroup
    """The data-parallel group (rank, world size, c10d name)."""
    frame: str
    """A name for the compiled frame, for logs and dumps."""
    graph_kind: str = "dynamo"
    """Which graph the pass sees: "dynamo" (torch IR from Dynamo) or "joint" (AOTAutograd joint graph)."""
    provided: set = field(default_factory=set)
    """Capabilities provided by passes that already ran on this frame."""
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("zerocompile.passes"))
