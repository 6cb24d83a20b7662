"""Sharded parameters in code Dynamo leaves to eager: per-module hooks, as FSDP2 does it.

A parameter's sharding never depends on what Dynamo compiled. Compiled frames gather and
reduce inside their graphs; eager code (the model's own ``forward`` when a graph break inside
its layer loop makes Dynamo give up on it, an eager root with compiled blocks, leaf modules,
modules Dynamo skipped) runs each module's parameters through one lifetime:

- **forward**: a forward pre-hook gathers the module's own parameters (``recurse=False``; a
  leaf module's: all of them) whose storage is freed, and the forward post-hook frees them
  again. A parameter that a module's forward uses without owning it (``F.linear(x,
  self.wte.weight)`` in the model's forward, after the embedding freed it) is gathered on
  demand by ``ZeroParameter`` and belongs to the innermost module whose forward is running.
- **backward**: the post-hook registers a hook on the forward's outputs
  (``register_multi_grad_hook``, mode ``"any"``) that gathers the same parameters again right
  before the module's backward, and a hook on its inputs (mode ``"all"``) frees them once the
  gradients of the inputs exist, i.e. after the module's backward; whatever a backward did not
  free that way (inputs that need no gradient: token ids) is freed when the backward ends
  (a callback queued on the autograd engine).
- **gradients**: at stages 2 and 3 the gradients eager code accumulates into parameters
  are reduce-scattered into their shards during the backward: a module's own parameters when its
  backward ends, the rest when the whole backward ends, every rank in the same order
  (``runtime/eager_grads.py``). So ``p.grad`` of every sharded parameter is the same ``DTensor``
  of the shard, wherever it ran.
- **FLOPs**: while an eager unit's forward runs, its ops are counted for its module
  (``runtime/eager_flops.py``), so ``stats().flops_per_step`` covers eager code.

Every rank must run the same eager code (each gather is a collective); so it must for FSDP2
and DeepSpeed. Gathers are counted per parameter (``ShardedParam.hold`` / ``unhold``), so a
parameter shared by several modules (a tied embedding and head) is freed when the last use
ends. All of this is eager only: under Dynamo tracing the hooks return at once
(``torch.compiler.is_compiling()``), and they are never Dynamo frames of their own
(``_torch_compat.never_a_frame``; eager code inside a compiled model's call runs under
Dynamo's frame callback).

A module whose ``forward`` is ``torch.compiler.disable``d and that a compiled frame calls runs
inside the frame's graph break, where Dynamo inlined ``Module.__call__`` and its hooks at trace
time: no hook runs there, so such parameters are kept whole (``ShardedParam.keep_full``, as
DeepSpeed's persistent parameters; ``eager_only_parameters``).
"""

from __future__ import annotations

import torch
from torch.autograd.graph import register_multi_grad_hook

from zerocompile import _torch_compat
from zerocompile.errors import CollectiveMismatchError
from zerocompile.runtime.session import PROCESS
from zerocompile.runtime.comm import all_gather_flat, is_fake_group
from zerocompile.runtime.eager_flops import EagerFlops
from zerocompile.runtime.eager_grads import EagerGradients
from zerocompile.runtime.grad_participation import participation_error
from zerocompile.runtime.leaf_modules import EAGER_UNIT as _UNIT, is_leaf, leaf_modules
from zerocompile.runtime.raw_grad import raw_grad
from zerocompile.runtime.sharded_param import ShardedParam, get_state

_REGIONS = "_zerocompile_eager_regions"


class _Call:
    """One eager run of a unit's module: what it holds gathered, in forward and in backward."""

    __slots__ = ("unit", "states", "borrowed", "in_backward", "handles", "provisional")

    def __init__(self, unit: "EagerUnit", provisional: bool = False):
        self.unit = unit
        self.provisional = provisional
        """A caller root's run that began before its unit existed (the step that compiled the
        frames): its forward-end hook does not run (``Module.__call__`` read the hooks when it
        began), so the run ends at the end of the next backward or the unit's next run."""
        self.states: list[ShardedParam] = []
        """What this run's forward gathered (held until the forward ends)."""
        self.borrowed: list[ShardedParam] = []
        """Parameters of other modules its forward used (gathered on demand)."""
        self.in_backward = False
        self.handles: list = []

    def needed(self) -> list[ShardedParam]:
        return self.unit.states() + self.borrowed


class EagerUnit:
    """The parameters one module's eager forward gathers: its own (a leaf module's: all of
    its own and its submodules')."""

    def __init__(self, module: torch.nn.Module, regions: "EagerRegions", name: str):
        self.module = module
        self.regions = regions
        self.name = name
        self.index = -1
        """Its place in ``EagerRegions.units`` once installed."""
        self.gathers = True
        """Its forward gathers (stage 3), so the ranks check their place first; False for a unit
        that only counts its FLOPs (a caller root or a leaf module at stages 0-2)."""
        params = module.parameters(recurse=is_leaf(module))
        unique = {id(p): p for p in params}
        self.params = list(unique.values())

    def states(self) -> list[ShardedParam]:
        return [sp for p in self.params if (sp := get_state(p)) is not None]

    def run(self, forward, args, kwargs):
        """``forward(*args, **kwargs)`` as this unit's module run: a leaf module's forward
        wrapper (``runtime/leaf_modules.py``), which runs eagerly even inside a compiled frame,
        where no module hook runs."""
        self.regions.enter(self, args, kwargs)
        try:
            output = forward(*args, **kwargs)
        except BaseException:
            self.regions.abandon(self)
            raise
        self.regions.leave(self, output)
        return output


class EagerRegions:
    """The eager units of one model (hung off its root module): the forward stack of units
    running now, and the runs whose backward is still to free what it gathered."""

    def __init__(self):
        self.active: list[_Call] = []
        self.units: list[EagerUnit] = []
        """In the order they were installed, the same on every rank (``EagerUnit.index``)."""
        self.roots: list[torch.nn.Module] = []
        self.frame_names: dict[int, str] = {}
        self.open_backward: list[_Call] = []
        self.callback_queued = False
        self.grads = EagerGradients()
        """The stage-2/3 gradients eager code accumulates (``runtime/eager_grads.py``)."""
        self.counted_modules: set[int] = set()
        """Modules whose parameters ``grads.owners`` counted."""
        self.needs_flush = False
        """An eager unit ran a forward with autograd on since the last flush: the next backward
        ends with the agreement and reduction, on every rank."""
        self.flops = EagerFlops(self._record_flops)
        """Counts the FLOPs of the eager forwards (``runtime/eager_flops.py``), entered while
        one runs (``counting``)."""
        self.counting = False
        self._session = None

    def session(self):
        """The model's ``ModelSession`` (``runtime/session.py``; given when the regions are
        installed, else its parameters' shard states'): it counts and times what the eager units
        gather and the FLOPs they run. ``PROCESS.outside`` before any has one."""
        if self._session is None:
            self._session = next((sp.session for unit in self.units for sp in unit.states()
                                  if sp.session is not None), None)
        return self._session or PROCESS.outside

    def _record_flops(self, module: tuple, flops: int, backward: bool) -> None:
        """``EagerFlops``' counts go where the compiled graphs' do (the model's session)."""
        self.session().record_eager_flops(module, flops, backward)

    # -- forward --------------------------------------------------------------------------
    def enter(self, unit: EagerUnit, args, kwargs) -> None:
        self._end_provisional(unit)
        call = _Call(unit)
        call.states = unit.states()
        freed = [sp for sp in call.states if sp.values_freed()]
        if freed and freed[0].group.world > 1:
            with self.session().comms.timed(freed[0].device, "eager forward gather"):
                self.check_position(unit.index, freed[0].group, freed[0].device)
                _hold(call.states)
        else:
            _hold(call.states)
        self.active.append(call)
        self._count_for(unit)
        if torch.is_grad_enabled():
            self.needs_flush = True
            inputs = _tensors_needing_grad((args, kwargs))
            if inputs:
                call.handles.append(register_multi_grad_hook(
                    inputs, lambda grads, call=call: self._after_backward(call), mode="all"))

    def leave(self, unit: EagerUnit, output) -> None:
        call = self._pop(unit)
        if call is None:
            return
        self._count_for(self.active[-1].unit if self.active else None)
        if torch.is_grad_enabled():
            outputs = _tensors_needing_grad(output)
            if outputs:
                call.handles.append(register_multi_grad_hook(
                    outputs, lambda grad, call=call: self._before_backward(call), mode="any"))
            else:
                self._remove_handles(call)
        for sp in call.states + call.borrowed:
            sp.unhold()

    def check_position(self, position: int, group, device) -> None:
        """Before an eager forward gathers (``position``: its unit's index), and before each
        compiled frame of a model with eager units runs (``frame_position``), the ranks check
        that they are at the same place (one all-gather of an int64). A module that runs on
        some ranks only (an expert only some ranks' tokens reach) would otherwise make them
        issue different collectives, which hang or abort the transport. Raises on every rank,
        naming the module to make a leaf."""
        if is_fake_group(group) or device.type == "meta":
            return      # zerocompile plan: no rank to disagree with
        every = all_gather_flat(torch.tensor([position], dtype=torch.int64, device=device), group.world, group.name)
        self.session().record("all_gather", every.numel() * every.element_size())
        ids = every.tolist()
        if len(set(ids)) == 1:
            return
        # the ranks that moved on run a unit installed later, or a frame: the earliest unit is
        # what they skipped
        units = [i for i in ids if i < len(self.units)]
        if not units:
            cause = ("a module whose forward runs on some ranks only (an expert reached by some ranks' tokens only) "
                     "makes them gather different parameters. Mark the module that routes a leaf module: "
                     "zerocompile.set_leaf_modules(model, [TheModuleClass])")
            raise CollectiveMismatchError(
                "zerocompile: the ranks run different compiled frames at stage 3 ("
                + ", ".join(f"rank {r}: {self.frame_names.get(i, 'a frame this rank never ran')}" for r, i in enumerate(ids))
                + "): " + cause, cause=cause)
        skipped = self.units[min(units)]
        ranks = [r for r, i in enumerate(ids) if i == skipped.index]
        names = [f"{skipped.name}.{n}" if skipped.name else n
                 for n, _ in skipped.module.named_parameters(recurse=is_leaf(skipped.module))]
        raise participation_error(names, [f"ranks {ranks}"] * len(names), self.roots,
                                  "are gathered by eager code on some ranks only, at stage 3")

    @property
    def in_eager_forward(self) -> bool:
        """An eager unit's forward is running (units exist only where something is gathered):
        a compiled frame run or compiled now is inside eager code, which may run on some ranks
        only, so the ranks check their position first (``check_position``). A model compiled
        whole never is."""
        return any(call.unit.gathers for call in self.active)

    def _count_for(self, unit: "EagerUnit | None") -> None:
        """Count the eager ops that run from now for ``unit``'s module (None: no eager forward
        runs; the counting stops)."""
        counter = self.flops
        if counter.pending:
            counter.settle()
        if any(call.provisional for call in self.active):
            # the step that compiled the frames: its forward end is not seen, and the counting
            # must start and stop in the forward (a mode left in a backward's callback stays on)
            unit = None
        if unit is None:
            if self.counting:
                self.counting = False
                counter.__exit__(None, None, None)
            return
        counter.module = (unit.name, type(unit.module).__name__)
        if not self.counting:
            self.counting = True
            counter.__enter__()

    def frame_runs(self, running: bool) -> None:
        """A compiled frame starts (``True``) or ends running: its ops are its own FLOPs, and
        they run without the counting mode (a mode would route each of them through Python)."""
        if not self.counting:
            return
        if running:
            if self.flops.pending:
                self.flops.settle()
            self.flops.__exit__(None, None, None)
        else:
            self.flops.__enter__()

    def frame_position(self, fingerprint: int, name: str) -> int:
        """The position ``check_position`` compares for a compiled frame (apart from the units')."""
        position = (1 << 62) | fingerprint
        self.frame_names[position] = name
        return position

    def abandon(self, unit: EagerUnit) -> None:
        """The unit's forward raised: free what it gathered."""
        call = self._pop(unit)
        self._count_for(self.active[-1].unit if self.active else None)
        if call is not None:
            self._remove_handles(call)
            for sp in call.states + call.borrowed:
                sp.unhold()

    def _end_provisional(self, unit: "EagerUnit | None" = None) -> None:
        """End the provisional runs (``_Call.provisional``) of ``unit`` (None: of every unit)."""
        ended = [c for c in self.active if c.provisional and (unit is None or c.unit is unit)]
        if not ended:
            return
        self.active = [c for c in self.active if c not in ended]
        for call in ended:
            for sp in call.states + call.borrowed:
                sp.unhold()
        self._count_for(self.active[-1].unit if self.active else None)

    def _pop(self, unit: EagerUnit) -> _Call | None:
        for i in range(len(self.active) - 1, -1, -1):
            if self.active[i].unit is unit:
                return self.active.pop(i)
        return None     # its forward began before the unit existed (the step that compiled the frames)

    def borrow(self, sp: ShardedParam) -> bool:
        """Gather ``sp`` for the innermost module whose eager forward is running (a parameter it
        uses without owning it). Where no eager forward runs but the model is being called (the
        code a graph break leaves between a compiled frame's graphs: TRL's fused LM head reads
        ``lm_head.weight`` in an autograd function Dynamo cannot trace), it is gathered for the
        model's step: held until the step ends (``ModelSession.held_until_step_end``: its
        ``ZeroOptimizer.step()``, or for a model no optimizer trains the step of the one that
        trains), since the eager autograd may keep it, or a view of it, for the backward. False
        outside the model's call (code of one rank reading a parameter must not start a
        collective the others never join: ``ParameterNotGatheredError`` says what to do)."""
        if not self.active:
            session = self.session()
            if session is PROCESS.outside or not _torch_compat.inside_call_of(self.roots):
                return False
            with session.comms.timed(sp.device, "eager gather outside a module"):
                _hold([sp])
            session.held_until_step_end.append(sp)
            return True
        call = self.active[-1]
        with self.session().comms.timed(sp.device, "eager forward gather"):
            _hold([sp])
        call.borrowed.append(sp)
        return True

    # -- backward -------------------------------------------------------------------------
    @_torch_compat.never_a_frame
    def _before_backward(self, call: _Call) -> None:
        if call.in_backward:
            return
        call.in_backward = True
        needed = call.needed()
        with self.session().comms.timed(needed[0].device if needed else torch.device("cpu"), "eager backward gather"):
            _hold(needed)
        self.open_backward.append(call)
        self.queue_end_of_backward()

    @_torch_compat.never_a_frame
    def _after_backward(self, call: _Call) -> None:
        if not call.in_backward:
            return
        self._close(call)
        if call in self.open_backward:
            self.open_backward.remove(call)
        self.grads.module_backward_ended(call.unit.states())

    def _close(self, call: _Call) -> None:
        call.in_backward = False
        for sp in call.needed():
            sp.unhold()
        self._remove_handles(call)

    @staticmethod
    def _remove_handles(call: _Call) -> None:
        for handle in call.handles:
            handle.remove()
        call.handles = []

    def queue_end_of_backward(self) -> None:
        if self.callback_queued:
            return
        self.callback_queued = True
        _torch_compat.queue_end_of_backward(self._end_of_backward)

    @_torch_compat.never_a_frame
    def _end_of_backward(self) -> None:
        self.callback_queued = False
        calls, self.open_backward = self.open_backward, []
        for call in calls:
            self._close(call)
        self._end_provisional()
        if self.needs_flush or self.grads.pending():
            self.needs_flush = False
            self.grads.backward_ended()

    def gradient_accumulated(self, sp: ShardedParam) -> None:
        """Eager code accumulated a gradient into ``sp``'s parameter (post-accumulate-grad hook)."""
        self.grads.accumulated_into(sp)
        self.queue_end_of_backward()


def _hold(states) -> None:
    """``hold`` each state, counting the all-gathers that gathers for ``zerocompile.stats()``."""
    for sp in states:
        if sp.values_freed() and sp.group.world > 1:
            (sp.session or PROCESS.outside).record("all_gather", sp.padded_numel * sp.param.element_size())
        sp.hold()


def _tensors_needing_grad(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree)
            if isinstance(t, torch.Tensor) and t.requires_grad]


# -- hooks (module-level functions: Dynamo inlines them, as never-a-frame code) -----------------
@_torch_compat.never_a_frame
def _pre_forward(module, args, kwargs):
    if torch.compiler.is_compiling():
        return None
    unit = getattr(module, _UNIT, None)
    if unit is not None:
        unit.regions.enter(unit, args, kwargs)
    return None


@_torch_compat.never_a_frame
def _post_forward(module, args, kwargs, output):
    if torch.compiler.is_compiling():
        return None
    unit = getattr(module, _UNIT, None)
    if unit is not None:
        unit.regions.leave(unit, output)
    return None


@_torch_compat.never_a_frame
def _gradient_accumulated(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of a stage-2/3 parameter (see the module docstring)."""
    sp = get_state(param)
    if sp is not None and sp.eager_regions is not None and raw_grad(param) is not None:
        sp.eager_regions.gradient_accumulated(sp)


def install_eager_regions(roots, session=None) -> None:
    """Give every module under ``roots`` that owns a sharded parameter the eager unit hooks
    (once per module), and every stage-2/3 parameter the gradient hook (once per parameter).
    The units of all ``roots`` share one ``EagerRegions`` (the first root's, or a new one), which
    counts in ``session`` (the model's ``ModelSession``) where it has none yet."""
    roots = list(roots)
    if not roots:
        return
    regions = regions_of(roots) or EagerRegions()
    if regions._session is None:
        regions._session = session
    for root in outermost_first(roots):
        if getattr(root, _REGIONS, None) is None:
            object.__setattr__(root, _REGIONS, regions)
        if all(r is not root for r in regions.roots):
            regions.roots.append(root)
        inside_leaf = set()
        for _, leaf in leaf_modules(root):
            inside_leaf.update(id(m) for m in leaf.modules() if m is not leaf)
        # a root whose forward called another root's frame runs eagerly around it: it is a unit even
        # without parameters of its own, so what its forward uses of other modules is gathered for it
        # (torch.compile's wrapper, whose forward is Dynamo's own, is not)
        caller = getattr(root, "_orig_mod", None) is None and any(
            other is not root and any(m is other for m in root.modules()) for other in roots)
        # at stage 3 such a unit gathers; at stages 0-2 it counts its forward's FLOPs only
        # (runtime/eager_flops.py), as a leaf module's unit does
        sharded = any((sp := get_state(p)) is not None and sp.storage_freed for p in root.parameters())
        for name, module in root.named_modules():
            if id(module) in inside_leaf or getattr(module, _UNIT, None) is not None:
                continue
            unit = EagerUnit(module, regions, name)
            states = unit.states()
            if id(module) not in regions.counted_modules:
                regions.counted_modules.add(id(module))
                for sp in states:
                    regions.grads.owners[id(sp)] += 1
            for sp in states:
                sp.eager_regions = regions
                _hook_gradient(sp, regions)
            unit.gathers = any(sp.storage_freed for sp in states) or (caller and module is root and sharded)
            if not unit.gathers and not (caller and module is root) and not is_leaf(module):
                continue        # nothing to gather (stages 0-2): no module hook, which would change what Dynamo compiles
            unit.index = len(regions.units)
            regions.units.append(unit)
            object.__setattr__(module, _UNIT, unit)
            if caller and module is root:
                # its forward is running now (it called the frame being installed): it counts as
                # entered, provisionally, since Module.__call__ read its (then absent) hooks when
                # the forward began (_Call.provisional)
                regions.active.append(_Call(unit, provisional=True))
            if not is_leaf(module):      # a leaf's forward wrapper runs the unit (EagerUnit.run)
                module.register_forward_pre_hook(_pre_forward, with_kwargs=True)
                module.register_forward_hook(_post_forward, with_kwargs=True)


def outermost_first(roots) -> list:
    """``roots`` with the model first: by parameters held, then by modules held (a wrapper such as
    PEFT's ``PeftModel`` holds the same parameters as the model it wraps, and one module more);
    torch.compile's ``OptimizedModule`` after the module it compiles (its names say ``_orig_mod``)."""
    return sorted(roots, key=lambda m: (getattr(m, "_orig_mod", None) is not None, -sum(1 for _ in m.parameters()),
                                        -sum(1 for _ in m.modules())))


def regions_of(roots) -> EagerRegions | None:
    """The ``EagerRegions`` installed for ``roots`` (None if none)."""
    return next((r for root in roots if (r := getattr(root, _REGIONS, None)) is not None), None)


def _hook_gradient(sp: ShardedParam, regions: EagerRegions) -> None:
    # with the model's loss_scale option the gradients eager code leaves wait for the step (the compiled
    # backward leaves the shard gradient scaled)
    if sp.eager_grad_hook or not sp.rules.reduces_in_backward or not sp.requires_grad or \
            sp.option("step", "loss_scale") is not None:
        return
    with _torch_compat.plain_tensor_ops():
        sp.param.register_post_accumulate_grad_hook(_gradient_accumulated)
    sp.eager_grad_hook = True
    regions.grads.add(sp)


def _runs_eagerly(module: torch.nn.Module) -> bool:
    # a leaf module's forward is disabled too, but it gathers its parameters itself on entry
    # (EagerUnit.run): they are sharded like any other
    return bool(getattr(module.forward, "_torchdynamo_disable", False)) and not is_leaf(module)


def eager_only_parameters(root: torch.nn.Module) -> set:
    """ids of the parameters owned by modules under ``root`` (or their children) whose
    ``forward`` Dynamo never compiles (``torch.compiler.disable``)."""
    out = set()
    for module in root.modules():
        if _runs_eagerly(module):
            out.update(id(p) for p in module.parameters())
    return out
