"""``ZeroOptimizer``: any element-wise torch optimizer on this rank's shards.

Modelled on ``torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class,
**defaults)``. It is a ``torch.optim.Optimizer`` whose ``param_groups`` hold the
user's parameters (so LR schedulers and ``add_param_group`` work as usual); an inner
``optimizer_class`` instance holds the real state and updates the shards. It binds
lazily: it may be built before the first forward, when no parameter is sharded yet.

Per optimizer step, by stage:

- stage 0 (and parameters no compiled frame has used): full gradients, all-reduced
  (averaged) once per step; the inner optimizer updates full parameters.
- stage 1: full gradients accumulated locally are reduce-scattered into the shards (or
  all-reduced, each rank keeping its slice, where the ``gradient_reduction`` option chooses
  that: ``runtime/reduction_choice.py``); the shards are updated and all-gathered into the
  replicas; the shard gradients are dropped (the full gradients stay until ``zero_grad``).
- stage 2: shard gradients come reduce-scattered (or all-reduced and sliced, as at stage 1)
  from the backward graph; the shards are updated and all-gathered into the replicas.
- stage 3: shard gradients come from the backward graph; the shards are updated; the
  next forward gathers them.

Loss scaling (float16), two ways, both with one rule: the step is skipped on every rank when
any rank has a non-finite gradient (the flag is all-reduced with MAX), and the scale moves
the same way everywhere.

- ``torch.amp.GradScaler`` / FSDP's ``ShardedGradScaler``, unchanged: ``ZeroOptimizer`` has
  ``_step_supports_amp_scaling``, so ``scaler.step(opt)`` calls ``opt.step(grad_scaler=scaler)``
  and leaves the unscaling to it. The step reduces the gradients, divides them by the scale
  where the inner optimizer reads them (the shard gradients at stages 1-3, the averaged full
  gradients at stage 0), checks them, and records the all-reduced flag in the scaler's
  per-optimizer state, which is what ``scaler.update()`` reads.
- The ``loss_scale`` backend option (``zerocompile/loss_scale.py``): the compiled backward
  scales; the optimizer owns the scaler (``opt.loss_scale``), divides the gradients that
  stay scaled (those in shards and 16-bit replicas) after reducing them, checks, skips and
  updates the scale.

``ZeroOptimizer`` is the surface; the work is done by its collaborators in ``zerocompile/optim/``
(see that package's docstring), which never import this module.
"""

from __future__ import annotations

import functools
import time
import weakref

import torch
from torch.optim import Optimizer

from zerocompile import _torch_compat, loss_scale
from zerocompile.optim import local_gradients, update
from zerocompile.optim.binding import InnerBinding
from zerocompile.optim.clipping import GradClipper
from zerocompile.optim.grad_reduction import GradReducer, clear_gradients, parameter_names
from zerocompile.optim.grouped import (GroupedBuilder, check_group_shapes, class_defaults, group_class,
                                       nested_optimizers, owner_of)
from zerocompile.optim.kernels import KERNEL_CHOICES
from zerocompile.optim.param_state import ParamState
from zerocompile.optim.params import OptimizerParams
from zerocompile.optim.rules import check_class_argument, check_optimizer_class, needs_whole_parameter
from zerocompile.optim.whole_param import placeholder
from zerocompile.optim.scaling import LossScaling, check_one_scaler
from zerocompile.optim.state_io import StateIO
from zerocompile.optim.step_record import StepRecord, optimizer_name
from zerocompile.optim.monitoring import StepMonitor
from zerocompile.runtime.session import PROCESS
from zerocompile.runtime.comm import CommGroup
from zerocompile.runtime.sharded_param import get_state

__all__ = ["KERNEL_CHOICES", "ParamState", "ZeroOptimizer"]


class ZeroOptimizer(Optimizer):
    """``ZeroOptimizer(params, optimizer_class=torch.optim.AdamW, lr=..., ...)``.

    ``optimizer_class`` (see ``zerocompile.optimizer_rules``) is either element-wise, run on this
    rank's flat shards: one of the allow-listed torch classes, or any class with
    ``assume_elementwise=True``, your promise that it updates every element from that element's
    value, gradient and state alone and never depends on a parameter's shape; or a
    whole-parameter optimizer, run on whole parameters each at one owner rank
    (``zerocompile/optim/whole_param.py``): ``torch.optim.Muon``, ``torch.optim.Adafactor``, or
    any class with ``whole_parameter=True``, your statement that it updates each parameter from
    that parameter alone (its values, gradient and state) and skips parameters without a gradient.

    A param group may name its own class: ``{"params": ..., "optimizer_class": torch.optim.AdamW,
    "lr": ...}`` (and ``"whole_parameter": True`` for a class of yours); its hyperparameters are
    its own keys and that class's defaults, not the keyword arguments given here, which are for
    ``optimizer_class``."""

    _step_supports_amp_scaling = True
    """``torch.amp.GradScaler.step`` passes itself to ``step(grad_scaler=...)``, which unscales
    the gradients where they live (see the module docstring)."""

    def __init__(self, params, optimizer_class=torch.optim.AdamW, process_group=None, *,
                 assume_elementwise: bool = False, whole_parameter: bool = False, kernel: str = "auto",
                 **defaults):
        check_class_argument(optimizer_class)
        check_optimizer_class(optimizer_class, assume_elementwise, whole_parameter)
        if kernel not in KERNEL_CHOICES:
            raise ValueError(f"ZeroOptimizer: kernel={kernel!r} is invalid; allowed: "
                             f"{', '.join(repr(k) for k in KERNEL_CHOICES)}")
        self.optimizer_class = optimizer_class
        self.skipped_steps = 0
        """Optimizer steps skipped because some rank's gradients were not finite."""
        self._collected_through = 0      # compile order of the newest frame whose garbage was collected
        self._held: set[int] = set()
        """``id`` of each parameter this optimizer steps (``holds``)."""
        super().__init__(params, defaults)   # add_param_group claims each group once the scaler exists
        scaler = loss_scale.LossScaler()       # the loss_scale option's, configured by the first frame
        for group in self.param_groups:
            self._claim(group)
        # a meta parameter zerocompile has not sharded has no values (sharded ones are fine: a
        # model run on meta inputs end to end, as a plan does)
        meta = [tuple(p.shape) for g in self.param_groups for p in g["params"] if p.is_meta and get_state(p) is None]
        if meta:
            raise ValueError(f"ZeroOptimizer: {len(meta)} parameters are on the meta device (the first has shape "
                             f"{meta[0]}), so the model was built under torch.device('meta') and has no values yet. "
                             "Give it values first: zerocompile.materialize(model) (its own init, shard by shard) or "
                             "zerocompile.load_pretrained(model, path), before compiling and training it")
        whole = needs_whole_parameter(optimizer_class, whole_parameter)
        try:  # fail now, not at the first step, on a bad hyperparameter
            probe = optimizer_class([placeholder((2, 2) if whole else (1,), torch.float32, "cpu")], **defaults)
        except (TypeError, ValueError) as err:
            raise type(err)(f"ZeroOptimizer: {optimizer_class.__name__} rejects {defaults}: {err}") from err
        # the class's own defaults filled in
        builder = GroupedBuilder(optimizer_class, kernel, self.defaults, dict(probe.defaults), whole_parameter)
        for group in self.param_groups:
            check_group_shapes(group, *builder.part_of(group), defaults if group_class(
                group, optimizer_class) is optimizer_class else {})
        self._params_view = OptimizerParams(self.param_groups, process_group)
        self._binding = InnerBinding(self._params_view, builder)
        self._clipper = GradClipper(self._params_view)
        # the collaborators hold no reference to the optimizer: one dropped is freed at once
        self._scaling = LossScaling(self._params_view, scaler, self._clipper)
        self._reducer = GradReducer(self._params_view, self._scaling,
                                    functools.partial(local_gradients.takes_local_gradients, self._binding))
        self._state_io = StateIO(self._binding, self._scaling, optimizer_class, self.defaults)
        self.created_ns = time.monotonic_ns()      # names it in the dump's optimizer_steps.json
        self._step_record = StepRecord()
        self._monitor = StepMonitor(self._params_view, self._params_view.layout_group)
        PROCESS.optimizers.add(self)
        me = weakref.ref(self)       # the optimizer joins its model's session once its parameters are sharded
        self._params_view.on_session.append(lambda session: session.optimizers.add(me()))

    # ------------------------------------------------------------------ binding and parameters
    def _bind(self) -> None:
        self._state_io.bind()
        self._params_view.session()     # found once the first frame sharded the parameters; refuses two models'

    def _params(self):
        return iter(self._params_view)

    def _layout_group(self) -> CommGroup:
        return self._params_view.layout_group()

    def _claim(self, group: dict) -> None:
        """This optimizer steps the group's parameters (``holds``): the frames using them read
        its loss scaler's scale, and a read of their ``p.grad`` reduces the gradients first."""
        for p in group["params"]:
            self._held.add(id(p))

    def holds(self, param: torch.Tensor) -> bool:
        """Whether this optimizer steps ``param`` (``PROCESS.optimizer_of``: the newest optimizer
        that holds a parameter is the one that steps it)."""
        return id(param) in self._held

    @property
    def scaler(self) -> loss_scale.LossScaler:
        """The ``loss_scale`` option's scaler this optimizer unscales with (the frames using its
        parameters scale by it)."""
        return self._scaling.scaler

    def read_gradients(self) -> None:
        """What a read of ``p.grad`` of one of its parameters calls first
        (``runtime/zero_parameter.py``): the gradients reduced, and a clipping coefficient still
        deferred applied, so the reader sees the values the step would use."""
        self._reduce_gradients()
        self._apply_deferred()

    def add_param_group(self, param_group: dict) -> None:
        own_class = param_group.get("optimizer_class") if isinstance(param_group, dict) else None
        if own_class is not None and own_class is not self.__dict__.get("optimizer_class"):
            check_class_argument(own_class, where="a param group's 'optimizer_class'")
            check_optimizer_class(own_class, False, bool(param_group.get("whole_parameter", False)))
            # its own class's defaults, not the keyword arguments given for optimizer_class
            shape = (2, 2) if needs_whole_parameter(own_class, param_group.get("whole_parameter", False)) else (1,)
            param_group = {**class_defaults(own_class, shape), **param_group}
        super().add_param_group(param_group)
        if "_binding" not in self.__dict__:    # in Optimizer.__init__: __init__ claims the groups after it
            return
        self._claim(self.param_groups[-1])
        if self._binding.inner is not None:
            self._binding.add_group(self.param_groups[-1])

    @property
    def kernel(self) -> str | None:
        """How the inner optimizer updates the tensors, chosen when it binds (None before):
        ``"cpp"`` / ``"triton"`` (zerocompile's fused Adam kernels, ``runtime/fused_adam.py``),
        ``"torch_fused"`` / ``"torch_foreach"`` (the class's own ``fused=True`` /
        ``foreach=True``), ``"torch"`` (the class as configured), or ``"whole_parameter"`` (a
        whole-parameter optimizer's own code at the owner ranks); param groups of several classes
        give one name per class joined by ``+`` (``"whole_parameter+cpp"``)."""
        return self._binding.kernel

    @property
    def inner(self):
        """The wrapped optimizer (None until the first step binds it): the ``optimizer_class``
        instance over the targets, a ``WholeParameterOptimizer`` for a whole-parameter class, or a
        ``GroupedOptimizer`` of one per class when param groups name several."""
        return self._binding.inner

    def inner_optimizers(self) -> list:
        """Every optimizer this one steps inside its own ``step()`` (the inner optimizer, and for
        several classes or a whole-parameter one, the optimizers inside it); empty before binding."""
        return nested_optimizers(self._binding.inner)

    @property
    def state(self) -> dict:
        """Per-parameter optimizer state, keyed by *your* parameters: the inner optimizer's state
        of each one's target (this rank's shard at stages 1-3). Read-only view."""
        return self._binding.state_view()

    @state.setter
    def state(self, value) -> None:
        # torch.optim.Optimizer.__init__ assigns an empty state; ours lives in the inner optimizer
        pass

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return self._binding.state_bytes()

    def offloaded_bytes(self) -> int:
        """Bytes of optimizer state held off the device (host memory or swap file), by offload."""
        return self._binding.offloaded_bytes()

    def offload_buffer_bytes(self) -> int:
        """Bytes of the optimizer offload pipeline's host buffers (0 without ``offload_optimizer``)."""
        return self._binding.offload_buffer_bytes()

    @property
    def offload(self) -> str | None:
        """``"cpu"`` or ``"nvme"`` where the optimizer state is offloaded, else None (also before binding)."""
        return self._binding.offload()

    def _step_name(self) -> str:
        """How the dump's optimizer_steps.json names this optimizer (its classes)."""
        classes = list(dict.fromkeys(group_class(g, self.optimizer_class).__name__ for g in self.param_groups))
        return optimizer_name(self, classes)

    def holds_whole_state(self, p) -> bool:
        """Whether ``p``'s optimizer state is kept whole, in ``p``'s shape (a whole-parameter
        optimizer's: at ``p``'s owner rank only when ``p`` is sharded), never cut into shards."""
        return id(p) in self.whole_state_parameters()

    def whole_state_parameters(self) -> set[int]:
        """``id`` of each parameter whose optimizer state is kept whole (``holds_whole_state``)."""
        return {id(p) for group in self.param_groups if self._binding.builder.part_of(group)[1]
                for p in group["params"]}

    def owners(self) -> dict[str, int]:
        """``{parameter name: rank}`` of each sharded parameter a whole-parameter optimizer (Muon,
        Adafactor, ...) steps whole at one owner rank, which alone holds its optimizer state;
        empty before the optimizer binds (the first step) and without such parameters."""
        inner = self._binding.inner
        if inner is None:
            return {}
        owned = [(p, owner) for _, p, target in self._binding.pairs()
                 if (owner := owner_of(inner, target)) is not None and target is not p]
        return dict(zip(parameter_names([p for p, _ in owned]), [owner for _, owner in owned]))

    def unsharded_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """``(name, parameter)`` of each trainable parameter no compiled frame has used (kept
        whole on every rank, with its gradient and optimizer state); ``zerocompile plan``
        reports them."""
        params = [p for p in self._params() if get_state(p) is None and p.requires_grad]
        return list(zip(parameter_names(params), params))

    # ------------------------------------------------------------------ gradients
    def _reduce_gradients(self) -> None:
        self._reducer.reduce()

    def _apply_deferred(self, ids=None) -> None:
        self._clipper.apply_deferred(ids)

    def _end_step(self) -> None:
        self._reducer.reduced = False
        self._reducer.early.step_ended()
        self._scaling.end_step()
        self._clipper.end_step()

    # ------------------------------------------------------------------ loss scaling
    @property
    def loss_scale(self) -> float | None:
        """The current scale of the ``loss_scale`` backend option: what the compiled backward
        multiplies gradients by. None while no frame compiled with the option uses this
        optimizer's parameters."""
        return self._scaling.current_scale()

    def loss_scaler_state(self) -> dict | None:
        """The ``loss_scale`` option's scaler state (scale, iteration, last overflow, hysteresis
        left; JSON-serialisable), or None where no frame compiled with the option uses this
        optimizer's parameters. ``state_dict`` and ``zerocompile.save_checkpoint`` include it."""
        return self._scaling.state()

    def load_loss_scaler_state(self, state: dict) -> None:
        """Restore what ``loss_scaler_state`` returned (at once: the next backward uses it)."""
        self._scaling.scaler.load_state_dict(state)

    # ------------------------------------------------------------------ public API
    @_torch_compat.step_with_hooks      # torch's step hooks; its profiler range only while a profiler records
    def step(self, closure=None, grad_scaler=None):
        """Reduce gradients, update this rank's shards, refresh replicas (stages 1/2).

        With loss scaling (``grad_scaler``, which ``torch.amp.GradScaler.step(opt)`` passes, or
        the ``loss_scale`` backend option) the gradients are unscaled first, and the update is
        skipped on every rank when any rank's gradients are not finite."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # no autograd inside, as torch.no_grad() would make it (as a decorator it costs a dozen Python
        # calls, each a cache miss after an update that streamed the caches out)
        enabled = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        try:
            with PROCESS.watch.scope("optimizer step"):    # its collectives' label in a mismatch report
                self._step(grad_scaler)
            self._monitor.after_step(self)          # the monitors' figures (the monitor option), rank 0 writes
        finally:
            torch.set_grad_enabled(enabled)
        return loss

    def _step(self, grad_scaler) -> None:
        self._step_record.begin()
        self._bind()
        with self._params_view.pinned():      # nothing in a step shards a parameter: read them once
            self._update(grad_scaler)
        self._collected_through = update.collect_compile_garbage(self._collected_through)
        self._step_record.end(self._step_name, self._layout_group())
        # what the model's compiled graphs ran since its last step is this step's
        PROCESS.step_ended(self._params_view.session(), id(self))

    def _update(self, grad_scaler) -> None:
        """The step between binding and its records: reduce, check, clip, update, end."""
        self._binding.sync_hyperparameters()
        scaler = self._scaling.loss_scaler()
        check_one_scaler(grad_scaler, scaler)
        if grad_scaler is not None:
            overflow = bool(self._scaling.unscale_with(grad_scaler, self, self._reducer.reduce).item())
        elif scaler is not None:
            self._reduce_gradients()
            overflow = bool(self._scaling.overflow(None).item())
        else:
            self._reduce_gradients()
            overflow = False
        if overflow:
            self._apply_deferred()      # the gradients stay as clipping left them
            self.skipped_steps += 1
            update.skip_update(self._params_view)
        else:
            max_norm = self._clipper.configured_bound()   # the gradient_clipping option
            if max_norm is not None:
                self.clip_grad_norm_(max_norm)
            # each all-gather bucket stepped while the previous one travels, where that applies
            states = update.shard_states(self._params_view)       # read by both, made once
            if not update.step_pipelined(self._binding.inner, self._params_view, states, self._clipper):
                copies = {}     # id(shard) -> the updated shard in the compute dtype, written by the kernel
                update.step_inner(self._binding.inner, states, self._clipper, copies)
                update.after_step(self._params_view, copies)
        if scaler is not None:
            scaler.update(overflow)
        self._end_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients wherever zerocompile keeps them (parameters, replicas, shards)."""
        self._end_step()
        clear_gradients(self._params_view, set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, grad_scaler=None) -> torch.Tensor:
        """Clip gradients by their global norm over all ranks; return that norm (before clipping).

        With a ``torch.amp.GradScaler``, pass it as ``grad_scaler``: the gradients are unscaled
        first, as ``scaler.unscale_(opt)`` would (which cannot reach gradients kept in shards),
        and ``scaler.step(opt)`` then does not unscale again. With the ``loss_scale`` option the
        gradients are unscaled here by themselves. A model compiled with the ``gradient_clipping``
        option is not clipped again by the step that follows."""
        self._bind()
        with self._params_view.pinned():
            return self._clip(max_norm, norm_type, grad_scaler)

    def _clip(self, max_norm: float, norm_type: float, grad_scaler) -> torch.Tensor:
        """``clip_grad_norm_`` once bound, with the parameters pinned."""
        self._clipper.clipped_to = float(max_norm)
        if grad_scaler is not None and grad_scaler.is_enabled():
            self._binding.sync_hyperparameters()
            check_one_scaler(grad_scaler, self._scaling.loss_scaler())
            self._scaling.unscale_with(grad_scaler, self, self._reducer.reduce)
        else:
            self._scaling.clipped_scaled = True
        self._reduce_gradients()
        norm = self._clipper.clip(max_norm, norm_type, self._binding.inner)
        self._monitor.grad_norm = norm
        return norm

    def state_dict(self) -> dict:
        """torch's layout (``state`` keyed by each parameter's position in the param groups,
        ``param_groups`` with those positions as ``params``), sharded state as DTensors (see
        ``zerocompile.optim.state_dict_values``), plus a ``"zerocompile"`` entry (optimizer class,
        rank, world size, the ``loss_scale`` option's scaler state). No communication.

        Before the optimizer binds (no step yet, nothing loaded: what ``accelerate.prepare``
        reads) it holds no state: the param groups' hyperparameters only (``"shapes": None`` in
        the ``"zerocompile"`` entry), and reading it binds nothing, so the first forward still
        decides what each parameter's shard is."""
        return self._state_io.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict in torch's layout: what ``state_dict()`` gave (on this rank, or
        filled by ``dcp.load``), or what torch's ``set_optimizer_state_dict`` passes. Saved
        parameters map to yours by position in the param groups, as in torch."""
        self._state_io.load_state_dict(state_dict)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict:
        """``{param: ParamState}`` for each of your parameters that has optimizer state, for
        ``zerocompile.save_checkpoint``. State loaded by ``load_checkpoint_state`` and not bound
        yet comes back as it was loaded. No communication."""
        return self._state_io.checkpoint_state()

    def load_checkpoint_state(self, states: dict, hyperparameters: list) -> None:
        """Replace all optimizer state with ``states`` (``{param: ParamState}``) and update each
        param group with its dict in ``hyperparameters`` (``zerocompile.load_checkpoint``).

        Applied at once if the optimizer is bound, else when it binds; whole element-wise
        tensors are then cut into this rank's shards. No communication."""
        self._state_io.load_checkpoint_state(states, hyperparameters)
