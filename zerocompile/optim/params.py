"""The parameters of one ``ZeroOptimizer`` as zerocompile sees them: each one's shard state
(None where no compiled frame has used it), the tensor the inner optimizer updates for it, the
process group they are sharded over, the device they live on."""

from __future__ import annotations

import torch

from zerocompile.runtime.comm import CommGroup, resolve_group
from zerocompile.runtime.session import PROCESS
from zerocompile.runtime.sharded_param import get_state, states_of


def target_of(p: torch.Tensor) -> torch.Tensor:
    """The tensor the inner optimizer updates for ``p``: its shard (stages 1-3), else ``p``."""
    sp = get_state(p)
    return p if sp is None else sp.rules.optimizer_target(sp)


class OptimizerParams:
    """``param_groups`` (the optimizer's own list, read live) and the process group given to the
    optimizer (``default_group``: for parameters no compiled frame has sharded)."""

    def __init__(self, param_groups: list, default_group) -> None:
        self.param_groups = param_groups
        self.default_group = default_group
        self._session = None
        self.on_session: list = []
        """Called with the session once it is found (the optimizer joins it)."""
        self._pinned: tuple[list, list] | None = None
        """While ``pinned``: each parameter once and its shard state (or None), read at its start."""

    def pinned(self) -> "_Pinned":
        """A context within which the parameters and their shard states are those of its entry,
        read once instead of by every walk over them (an optimizer step walks them a dozen
        times; at thousands of small shards, and with the caches cold after an update of large
        ones, those walks cost more than the update). For the optimizer's step: nothing in it
        adds a parameter or shards one (only a compiled frame's capture, ``load_pretrained`` and
        ``add_param_group`` do). Nested uses keep the outer one's."""
        return _Pinned(self)

    def session(self):
        """The ``ModelSession`` of the model these parameters belong to (``runtime/session.py``),
        found from their shard states once the first frame has sharded them and kept from then
        on; before that, ``PROCESS.outside`` (nothing of a model ran yet). Parameters of two
        models (two sessions) are refused: one ``ZeroOptimizer`` per model."""
        if self._session is not None:
            return self._session
        found = {id(sp.session): sp for sp in self.states() if sp.session is not None}
        if len(found) > 1:
            names = ", ".join(f"'{sp.session.name}' (parameter '{sp.name}')" for sp in found.values())
            raise ValueError(f"ZeroOptimizer: its parameters belong to {len(found)} compiled models ({names}); "
                             "one ZeroOptimizer trains one model's parameters. Make one optimizer per model, or "
                             "compile the module that holds them all")
        if not found:
            return PROCESS.outside
        self._session = next(iter(found.values())).session
        for joined in self.on_session:
            joined(self._session)
        return self._session

    def __iter__(self):
        """Each parameter once, in param-group order."""
        return iter(self._pinned[0] if self._pinned is not None else self._unique())

    def pairs(self):
        """``(parameter, its shard state or None)`` for each parameter once, in param-group order."""
        return zip(*self.columns())

    def columns(self) -> tuple[list, list]:
        """``(parameters, their shard states or None)``: each parameter once, in param-group order."""
        if self._pinned is not None:
            return self._pinned
        params = self._unique()
        return params, states_of(params)

    def _unique(self) -> list:
        """Each parameter once, in param-group order (the first place of one listed twice)."""
        every = [p for group in self.param_groups for p in group["params"]]
        return list(dict(zip(map(id, every), every)).values())

    def states(self) -> list:
        """The shard state of each parameter that has one."""
        return [sp for sp in self.columns()[1] if sp is not None]

    def group_of(self, sp) -> CommGroup:
        """The process group of a parameter with shard state ``sp`` (None: not sharded)."""
        return sp.group if sp is not None else resolve_group(self.default_group)

    def layout_group(self) -> CommGroup:
        """The group the parameters are sharded over (the given one while none is sharded)."""
        for _, sp in self.pairs():
            if sp is not None:
                return sp.group
        return resolve_group(self.default_group)

    def device(self) -> torch.device:
        return next((target_of(p).device for p in self), torch.device("cpu"))

    def check_one_group(self) -> None:
        names = {sp.group.name for sp in self.states()}
        if len(names) > 1:
            raise ValueError(
                f"ZeroOptimizer: its parameters are sharded over different process groups "
                f"({sorted(names)}); use one ZeroOptimizer per data-parallel group")


class _Pinned:
    """``OptimizerParams.pinned``'s context (a plain class: every step enters one)."""

    __slots__ = ("params", "outer")

    def __init__(self, params: OptimizerParams) -> None:
        self.params = params
        self.outer = False

    def __enter__(self) -> None:
        self.outer = self.params._pinned is None
        if self.outer:
            self.params._pinned = self.params.columns()

    def __exit__(self, *exc) -> None:
        if self.outer:
            self.params._pinned = None
