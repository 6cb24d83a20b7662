"""What one ``ZeroOptimizer.step()`` communicated, written to the graph dump when one is on.

The step's collectives run eagerly, outside every compiled graph: the gradient reduction the
step does (stages 0-1), the replicas' all-gather (stages 1-2), a whole-parameter optimizer's
all-to-alls, 1-bit Adam's compressed momentum. When the compiled frames dump their graphs
(``options={"dump": DIR}`` or ``ZEROCOMPILE_DUMP``), each step's counts and bytes by kind go to
``DIR/rank{R}/optimizer_steps.json`` (``zerocompile.dump.record_optimizer_step``), and
``zerocompile show DIR`` prints them beside the graphs."""

from __future__ import annotations

from zerocompile.dump import record_optimizer_step
from zerocompile.runtime.session import PROCESS, comm_counts, dump_roots


class StepRecord:
    """Counts around one step: ``begin()`` before it, ``end(name, group)`` after it."""

    def __init__(self) -> None:
        self.roots: list = []
        self.before: dict = {}

    def begin(self) -> None:
        self.roots = dump_roots()
        self.before = comm_counts() if self.roots else {}

    def end(self, name_of, group) -> None:
        """Write the step's collectives (those whose count moved) to every dump root.
        ``name_of()``: the optimizer's name, asked only when a dump records it; ``group``: the
        optimizer's ``CommGroup`` (its rank names the dump's rank directory)."""
        if not self.roots:
            return
        name = name_of()
        after = comm_counts()
        moved = {kind: {"count": count - self.before.get(kind, (0, 0))[0],
                        "bytes": nbytes - self.before.get(kind, (0, 0))[1]}
                 for kind, (count, nbytes) in after.items() if count != self.before.get(kind, (0, 0))[0]}
        for root in self.roots:
            record_optimizer_step(root, group.rank, group.world, name, moved)
        self.roots = []


def optimizer_name(optimizer, classes: list[str]) -> str:
    """``"ZeroOptimizer k (Class+Class)"``: ``k`` its position among the optimizers alive, by
    creation (the same on every rank when every rank builds them in the same order)."""
    alive = sorted(PROCESS.optimizers, key=lambda o: o.created_ns)
    k = next((i for i, o in enumerate(alive) if o is optimizer), len(alive))
    return f"ZeroOptimizer {k} ({'+'.join(classes)})"
