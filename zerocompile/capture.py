"""Capture: from Dynamo's graph of one frame to a compiled, sharded callable.

1. Find the parameter inputs; create (or reuse) each one's shard state.
2. Run the Dynamo-graph passes (``insert_param_collectives``: parameters become shards
   plus collectives, per stage; ``cast_before_gather``).
3. AOTAutograd traces the joint forward/backward graph; our partitioner (``partitioner.py``)
   runs the joint-graph passes (tagging, selective unsharding, resharding, recompute), calls
   the min-cut partitioner, runs the forward and backward passes (bucketing, prefetch) and
   summarises the collectives and FLOPs of both graphs. A frame run without autograd gets one
   inference graph instead, which gets the tagging and forward passes.
4. The inner compiler (inductor or eager) compiles the graphs.
5. ``FrameRunner`` swaps each parameter argument for its shard tensors at call time
   and records the collectives and FLOPs for ``zerocompile.stats()``. ``FrameRunner.recompile``
   runs steps 2-4 again with other pass options (``zerocompile plan``'s trace reuse).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import torch
import torch.fx

from zerocompile import _torch_compat, compile_cache, env, inner_compilers, loss_scale
from zerocompile.config import ZeroConfig, options_needing_a_new_trace
from zerocompile.dump import recorder_for
from zerocompile.progress import compile_status
from zerocompile.passes.lowerings.comm_timers import insert_comm_timers
from zerocompile.passes.context import PassContext
from zerocompile.passes.analyses.cost_model import CostModel, cost_model_for, probe_offload
from zerocompile.partitioner import ZeroPartitioner
from zerocompile.passes.analyses.flop_count import evaluate, size_symbols
from zerocompile.passes.manager import pipeline, run_passes
from zerocompile.passes.lowerings.module_timers import insert_module_marks
from zerocompile.passes.lowerings.watch_collectives import watch_collectives
from zerocompile.runtime.accounting import CollectiveSummary
from zerocompile.runtime.session import PROCESS, ModelSession
from zerocompile.runtime.comm import CommGroup, is_fake_group, resolve_group
from zerocompile.runtime.reduction_choice import gradient_reduction
from zerocompile.runtime.eager_regions import (eager_only_parameters, install_eager_regions, outermost_first,
                                               regions_of)
from zerocompile.runtime.fingerprint import check_same_on_all_ranks, fingerprint
from zerocompile.runtime.sharded_param import ShardedParam, attach_state, detach_state, get_state, offloads_param
from zerocompile.runtime.zero_parameter import adopt

log = logging.getLogger("zerocompile")


class FrameRunner:
    """The callable Dynamo runs for a compiled frame."""

    def __init__(self, compiled, plans: list, partitioner: ZeroPartitioner, frame: str,
                 roots: list, source: "_TracedFrame"):
        self.session: ModelSession = source.session
        """The model's session: it counts this frame's collectives and FLOPs."""
        self.compiled = compiled
        self.plans = plans
        self.partitioner = partitioner
        self.frame = frame
        self._source = source
        self._flops_cache: dict = {}
        """The frame's FLOPs per call sizes, where its shapes are symbolic (``_flops``)."""
        self.script_options = None
        """The options the script compiled this frame with (before any override), set by the
        backend: ``recompile`` merges new pass options over them."""
        # The eager-fallback hooks are installed at the first run, not while Dynamo is still
        # tracing: a hook appearing mid-trace changes the path of Dynamo's restarted analysis
        self._roots_without_hooks = roots
        self._hook_roots = roots
        self._new_states = False      # a run sharded parameters: their modules need the hook
        self._checked = False
        self._position = None
        """``(EagerRegions, position)`` where this frame checks its place across ranks first."""
        self._regions = None
        """The ``EagerRegions`` of the frame's roots (set at the first run, which installs them)."""
        self._loss_scale = partitioner.ctx.config.step.loss_scale
        self.order = time.monotonic_ns()  # compile order, for frame_reports()
        self.dump_root = partitioner.ctx.config.observability.dump or env.dump_dir()
        """Where this frame's graphs are dumped (None: no dump); the optimizer step records there too."""
        PROCESS.add_frame(self.session, self)

    @property
    def roots(self) -> list:
        """The modules this frame's parameters were reached from (and those that called it)."""
        return self._hook_roots

    def _forward_summary(self) -> CollectiveSummary:
        """The collectives one run issues before backward: the partitioned forward's, or the
        inference graph's when AOTAutograd compiled the frame without autograd."""
        p = self.partitioner
        return p.forward_summary or p.inference_summary or CollectiveSummary()

    def report(self) -> dict:
        """This frame's pass results and collectives (``zerocompile.frame_reports()``)."""
        ctx = self.partitioner.ctx
        fw = self._forward_summary()
        return {"frame": self.frame, "compiled_at_ns": self.order, "stage": ctx.config.sharding.stage,
                "results": dict(ctx.results),
                "forward": {k: {"count": t.count, "bytes": t.bytes} for k, t in fw.totals.items()},
                "backward": {k: {"count": t.count, "bytes": t.bytes}
                             for k, t in self.partitioner.backward_summary.totals.items()}}

    @property
    def config(self) -> ZeroConfig:
        """The options this frame's graphs were compiled with."""
        return self.partitioner.ctx.config

    def recompile(self, cfg: ZeroConfig) -> None:
        """Run this frame's passes and inner compile again with ``cfg``, over the Dynamo graph it
        was traced from and with the same parameters and shard states; Dynamo's code and guards
        stay as they are. ``cfg`` may differ from the frame's options in ``PASS_OPTIONS`` only
        (``ValueError`` otherwise). ``zerocompile plan`` uses it to plan several option sets on
        one trace of a script (``zerocompile tune``)."""
        changed = options_needing_a_new_trace(self.config, cfg)
        if changed:
            raise ValueError(f"zerocompile [{self.frame}]: cannot recompile with other values of "
                             f"{', '.join(changed)}: they bind the parameters' shard states or the "
                             "compiler; only the pass options (config.PASS_OPTIONS) can change on one trace")
        compiled, partitioner = self._source.compile(cfg, self.plans, self.partitioner.ctx.gradient_reduction)
        self.session.config = cfg          # the step's bucket_mb is the model's (pass options only differ)
        # the old graphs go now: nothing of them is left to count in a plan of the new ones
        self.compiled, self.partitioner = compiled, partitioner
        self._loss_scale = cfg.step.loss_scale
        self._checked = False        # the new graphs' collectives are checked across ranks again
        self._flops_cache = {}

    def _flops(self, args) -> dict:
        """The FLOPs of this call's graphs (``forward``, ``backward``, ``recompute``): the frame's
        counts, evaluated at this call's sizes where shapes are symbolic (cached per sizes)."""
        flops = self.partitioner.ctx.results.get("flops") or {}
        if all(isinstance(v, int) for v in flops.values()):
            return flops
        bindings = {}
        for i, dim, name in self._source.size_symbols():
            arg = args[i]
            bindings[name] = int(arg if dim is None else arg.shape[dim])
        key = tuple(sorted(bindings.items()))
        if key not in self._flops_cache:
            self._flops_cache[key] = {k: evaluate(v, bindings) for k, v in flops.items()}
        return self._flops_cache[key]

    def _first_run(self) -> None:
        install_eager_regions(self._roots_without_hooks, self.session)
        self._roots_without_hooks = []
        summaries = [self._forward_summary(),
                     self.partitioner.backward_summary]
        sequences = [s.sequence for s in summaries]
        regions = self._regions = regions_of(self._hook_roots)
        with PROCESS.watch.scope(f"compiling {self.frame}"):   # the compile's last collectives, in a report
            if regions is not None and self.partitioner.ctx.group.world > 1 and any(len(seq) for seq in sequences):
                # a frame of a model with eager units: run inside an eager forward, the ranks check they run
                # the same frame before it issues collectives (runtime/eager_regions.py: check_position), also
                # before the check of its collectives below, which is one. The position is the frame's name,
                # not its collectives: ranks that compiled it differently get that check, which names the
                # first differing collective
                self._position = (regions, regions.frame_position(fingerprint([[self.frame]]), self.frame))
                self._check_position()
            # a frame without collectives cannot put the ranks out of step, and it may run on some ranks only (an
            # expert only some ranks' tokens reach, a recompile for a shape one rank met): a check would do that
            if any(len(seq) for seq in sequences):
                check_same_on_all_ranks(fingerprint(sequences), self.partitioner.ctx.group, self.frame, sequences,
                                        device=_frame_device(self.plans), session=self.session)
        self._checked = True

    def _state_of(self, arg, plan: ShardedParam) -> ShardedParam:
        """The shard state of the parameter Dynamo passed for the input traced as ``plan``'s."""
        if arg is plan.param:
            return plan
        if not isinstance(arg, torch.nn.Parameter):
            raise TypeError(
                f"zerocompile [{self.frame}]: this compiled frame was traced with parameter '{plan.name}' "
                f"{plan.shape} at this input, but was called with a {type(arg).__name__}; zerocompile maps "
                "inputs to parameters by object and cannot shard a plain tensor. Keep the input an "
                "nn.Parameter, or run torch._dynamo.reset() after changing the model's structure")
        state = get_state(arg)
        if state is None:
            # Dynamo runs this compiled code for every module its guards accept, not only the one
            # it was traced with (a loop of identical blocks with a graph break in it compiles each
            # block's frame once): a parameter first seen now, in the place of one traced like it
            # (same shape, dtype and requires_grad: Dynamo's guards checked them), is named after it
            state = self._source.new_state(arg, plan, self.partitioner.ctx)
            adopt(arg)
            self._new_states = True
        elif (state.shape, state.dtype, state.compute_dtype, state.stage, state.group.name) != (
                plan.shape, plan.dtype, plan.compute_dtype, plan.stage, plan.group.name):
            raise ValueError(
                f"zerocompile [{self.frame}]: parameter '{state.name}' {state.shape} ({state.dtype}, stage "
                f"{state.stage}) was passed where this compiled frame expects one like '{plan.name}' "
                f"{plan.shape} ({plan.dtype}, stage {plan.stage}); compile every model that shares "
                "parameters with the same options")
        return state

    def take_parameters(self, examples: list, names: list) -> None:
        """Another piece of a frame like this one's (``repeated_blocks.py``: the next layer) will
        run this compiled frame with ``examples`` in the places of its inputs: their parameters
        get their shard states now, named ``names`` (their own), and become ``ZeroParameter``s
        before Dynamo builds the frame's guards (which record their class)."""
        for ex, plan, name in zip(examples, self.plans, names):
            if plan is None or not isinstance(ex, torch.nn.Parameter):
                continue
            if get_state(ex) is None:
                self._source.new_state(ex, plan, self.partitioner.ctx, name=name)
                self._new_states = True
            adopt(ex)

    def _check_position(self) -> None:
        regions, position = self._position
        if regions.in_eager_forward:
            device = _frame_device(self.plans)
            with self.session.comms.timed(device, "eager position check"):
                regions.check_position(position, self.partitioner.ctx.group, device)

    def __call__(self, *args):
        if not self._checked:
            self._first_run()
        elif self._position is not None:
            self._check_position()
        new_args, states = [], []
        grad_mode = torch.is_grad_enabled()
        for arg, plan in zip(args, self.plans):
            if plan is None:
                new_args.append(arg)
                continue
            sp = self._state_of(arg, plan)
            if grad_mode:
                sp.grad_synced = False   # this run's backward adds local gradients
                sp.grad_reduced = False
            states.append(sp)
            new_args.extend(sp.graph_inputs())
        if self._new_states:
            # parameters first met now (another block run through this frame's code) were
            # freed just now: their modules get the eager unit hooks as the first run's did
            install_eager_regions(self._hook_roots, self.session)
            self._new_states = False
        regions = self._regions
        if regions is not None:
            regions.frame_runs(True)        # its ops are the frame's FLOPs, not the eager code's
        PROCESS.watch.running(self.frame, "forward" if grad_mode else "inference")
        try:
            out = self.compiled(*new_args)
        finally:
            if regions is not None:
                regions.frame_runs(False)
        if grad_mode and self._loss_scale is not None:
            loss_scale.install_frame_scaling(out, args, states, self._loss_scale, self.frame)
        self.session.record_summary(self._forward_summary())
        flops = self._flops(args)
        self.session.record_flops(flops.get("forward", 0), frame=self.order)
        bw = self.partitioner.backward_summary
        if any(t.count for t in bw.totals.values()) or flops.get("backward"):
            tensors = [t for t in (out if isinstance(out, (list, tuple)) else [out])
                       if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            stop = {id(a.grad_fn) for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None}
            node = _torch_compat.compiled_backward_node(tensors, stop)
            if node is not None:
                node.register_prehook(functools.partial(_backward_ran, self.session, bw, flops.get("backward", 0),
                                                        flops.get("recompute", 0), self.order, self.frame))
            elif tensors:
                log.warning("[%s] backward node not found: its collectives and FLOPs are missing from "
                            "zerocompile.stats()", self.frame)
        return out


def _backward_ran(session: ModelSession, summary: CollectiveSummary, flops: int, recompute: int, frame: int,
                  name: str, grads) -> None:
    """A compiled backward is about to run: its collectives and FLOPs count in the model's session."""
    PROCESS.watch.running(name, "backward")
    session.record_summary(summary)
    session.record_flops(flops, recompute, frame=frame, backward=True)


def frame_name(gm: torch.fx.GraphModule) -> str:
    """A Dynamo frame's name in logs, errors and dumps: ``frame <compile id>``."""
    compile_id = gm.meta.get("dynamo_compile_id")
    return f"frame {compile_id}" if compile_id is not None else "frame"


def _param_states(placeholders, sources, example_inputs, cfg: ZeroConfig, group: CommGroup, frame: str,
                  fallback: ModelSession | None = None):
    """The shard state of each placeholder (None for non-parameters), the root modules the
    frame's parameters were reached from, the ids of the parameters under those roots
    that eager-only modules own (kept full: see runtime/eager_regions.py), and the model's
    session (``runtime/session.py``: the one of its roots or parameters, else ``fallback``, else
    a new one)."""
    roots = {}
    for source in sources:
        root = _torch_compat.root_module(source) if source is not None else None
        if root is not None:
            roots[id(root)] = root
    for module in _torch_compat.modules_calling(list(roots.values())):
        roots.setdefault(id(module), module)
    eager_owned = set()
    for root in roots.values():
        eager_owned |= eager_only_parameters(root)
    session = PROCESS.session_for(outermost_first(roots.values()),
                                  [get_state(ex) for ex in example_inputs if isinstance(ex, torch.nn.Parameter)], cfg,
                                fallback)
    session.check_model_options(cfg, frame, "step", ("loss_scale",))   # before a shared parameter's own check
    plans = []
    for node, source, ex in zip(placeholders, sources, example_inputs):
        if not isinstance(ex, torch.nn.Parameter):
            plans.append(None)
            continue
        name = (source is not None and _torch_compat.param_fqn(source)) or node.name
        state = get_state(ex)
        if state is not None and state.provisional:
            state = _adopt_provisional(ex, state, cfg, group, keep_full=id(ex) in eager_owned, session=session)
        if state is None:
            state = _shard_parameter(ex, name, cfg, group, keep_full=id(ex) in eager_owned, session=session)
        else:
            _check_compatible(state, cfg, group, name)
        plans.append(state)
    _shard_model_parameters(roots.values(), cfg, group, eager_owned, session)
    session.check_model_options(cfg, frame, "step", ("gradient_clipping", "offload_optimizer", "overlap_reduction",
                                                      "allow_unsharded"))
    session.check_model_options(cfg, frame, "observability", ("monitor", "flops_profiler", "comms_logger"))
    return plans, list(roots.values()), eager_owned, session


def _shard_model_parameters(roots, cfg: ZeroConfig, group: CommGroup, eager_owned: set, session: ModelSession) -> None:
    """Shard every other parameter of the modules under ``roots`` (the frame's model and the
    modules whose ``forward`` called it), frozen ones included: those that eager code uses (the
    model's own forward when a graph break in its layer loop leaves it to eager, an eager root
    around compiled blocks, leaf modules, modules Dynamo skipped) are gathered and reduced by
    per-module hooks (``runtime/eager_regions.py``), and those a later frame uses find their
    state. The first frame of the model gives them their state, with its options; names are
    relative to the largest root (the model), in its ``named_parameters`` order, the same on
    every rank."""
    for root in outermost_first(roots):
        for name, param in root.named_parameters():
            if get_state(param) is None:
                _shard_parameter(param, name, cfg, group, keep_full=id(param) in eager_owned, session=session)


def _shard_parameter(param, name: str, cfg: ZeroConfig, group: CommGroup, keep_full: bool,
                     session: ModelSession) -> ShardedParam:
    """Create ``param``'s shard state (once per parameter, by the first frame that uses it), one
    of ``session``'s."""
    sharding = cfg.sharding
    compute = sharding.param_dtype if sharding.param_dtype is not None and param.is_floating_point() else param.dtype
    state = ShardedParam(param, name, sharding.stage, group, compute, sharding.reduce_dtype, keep_full=keep_full,
                         offload_param=cfg.step.offload_param)
    attach_state(param, state)
    session.add_state(state, group.world)
    return state


def _adopt_provisional(param, state: ShardedParam, cfg: ZeroConfig, group: CommGroup,
                       keep_full: bool, session: ModelSession) -> ShardedParam | None:
    """The first frame to use a parameter ``zerocompile.materialize`` sharded: where this
    frame shards it the same way (stage 3 over the same group, its shards in memory, not kept
    whole for an eager module) the state takes the frame's options; otherwise the full value is
    gathered back into the parameter (one all-gather: every rank compiles the same frames) and
    None is returned, so the frame shards it as any parameter."""
    same_layout = (cfg.sharding.stage == 3 and group.name == state.group.name and not keep_full
                   and not offloads_param(cfg.step.offload_param, state.device))
    if same_layout:
        wanted = cfg.sharding.param_dtype
        state.compute_dtype = wanted if wanted is not None and param.is_floating_point() else state.dtype
        state.reduce_dtype = cfg.sharding.reduce_dtype
        state.offload_param = cfg.step.offload_param
        state.provisional = False
        if state.session is not session:
            if state.session is not None:
                state.session.discard_state(state)
            session.add_state(state, group.world)
        return state
    full = state.full_from_shards()
    if state.session is not None:
        state.session.discard_state(state)
    detach_state(param)
    with _torch_compat.plain_tensor_ops(), torch.no_grad():
        param.untyped_storage().resize_(state.numel * param.element_size())
        param.copy_(full)
    return None


def _check_compatible(state: ShardedParam, cfg: ZeroConfig, group: CommGroup, name: str) -> None:
    want_compute = cfg.sharding.param_dtype or state.dtype
    for option in ("offload_optimizer", "offload_param", "gradient_clipping"):
        wanted = getattr(cfg.step, option)
        held = state.offload_param if option == "offload_param" else state.option("step", option, wanted)
        if held != wanted:
            raise ValueError(
                f"zerocompile: parameter '{name}' is already sharded with {option} "
                f"{held}, but this frame was compiled with {wanted}. "
                "Compile every model that shares parameters with the same options.")
    sharding = cfg.sharding
    if state.stage != sharding.stage or state.group.name != group.name or state.reduce_dtype != sharding.reduce_dtype \
            or (state.compute_dtype != want_compute and state.param.is_floating_point()):
        raise ValueError(
            f"zerocompile: parameter '{name}' is already sharded with stage {state.stage}, "
            f"param_dtype {state.compute_dtype}, reduce_dtype {state.reduce_dtype} on group "
            f"'{state.group.name}', but this frame was compiled with stage {cfg.sharding.stage}, param_dtype "
            f"{want_compute}, reduce_dtype {cfg.sharding.reduce_dtype} on group '{group.name}'. "
            "Compile every model that shares parameters with the same options.")


def compile_frame(gm: torch.fx.GraphModule, example_inputs, cfg: ZeroConfig, frame: str | None = None,
                  session: ModelSession | None = None):
    """Compile one Dynamo frame (or a piece of one: ``repeated_blocks.py``, named ``frame``, whose
    model's session is ``session`` where its parameters and modules name none) with ZeRO
    sharding; returns the callable Dynamo runs."""
    started = time.perf_counter()
    group = resolve_group(cfg.sharding.process_group)
    frame = frame or frame_name(gm)
    if _watched(cfg, group):
        # before the compile's own collectives: those of a frame compiled on some ranks only are watched too
        PROCESS.watch.configure(cfg.sharding.collective_timeout_s, cfg.sharding.collective_busy_limit_s)
    with PROCESS.watch.scope(f"compiling {frame}"):    # its collectives' label in a mismatch report
        runner = _compile_frame(gm, example_inputs, cfg, group, frame, session)
    runner.session.compile_seconds += time.perf_counter() - started
    return runner


def _watched(cfg: ZeroConfig, group: CommGroup) -> bool:
    """Whether the collective watchdog watches this frame's collectives."""
    return cfg.sharding.collective_timeout_s is not None and group.world > 1 and not is_fake_group(group)


def _compile_frame(gm: torch.fx.GraphModule, example_inputs, cfg: ZeroConfig, group: CommGroup, frame: str,
                   session: ModelSession | None = None):
    traced = _copy_graph_module(gm)
    placeholders = list(traced.graph.find_nodes(op="placeholder"))
    sources = [_torch_compat.placeholder_source(node) for node in placeholders]
    plans, roots, eager_owned, session = _param_states(placeholders, sources, example_inputs, cfg, group, frame,
                                                       session)
    if cfg.step.offload_param.device == "cpu" and any(sp is not None and sp.device.type == "cpu" for sp in plans):
        log.info("[%s] offload_param device 'cpu': the parameters are on the CPU, so their shards already "
                 "live in host memory; nothing to offload", frame)
    regions = regions_of(roots)
    if regions is not None and group.world > 1 and regions.in_eager_forward:
        # a compile may take collectives (the cost model's agreement): in a model with eager
        # units, the ranks check first that they all compile this frame (runtime/eager_regions.py)
        regions.check_position(regions.frame_position(fingerprint([[frame, "compile"]]), f"{frame} (compiling)"), group,
                               _frame_device(plans))
    source = _TracedFrame(traced, sources, eager_owned, frame, torch.is_grad_enabled(), session,
                          _torch_compat.dynamo_fake_mode())
    compiled, partitioner = source.compile(cfg, plans, _gradient_reduction(cfg, group, plans, frame), example_inputs)
    _adopt_parameters(plans, roots)
    return FrameRunner(compiled, plans, partitioner, frame, roots, source)


def _frame_summary(plans: list, cfg: ZeroConfig, grad_enabled: bool) -> str:
    """What a frame's compile line says it holds: its parameters and their elements, whether it
    trains, and the inner compiler."""
    params = [sp.param for sp in plans if sp is not None]
    numel = sum(p.numel() for p in params)
    size = f"{numel / 1e6:.2f}M" if numel >= 10**5 else f"{numel}"
    kind = "forward + backward" if grad_enabled else "inference"
    return f"{len(params)} parameters, {size} elements, {kind}, {cfg.compiler.inner_compiler}"


class _TracedFrame:
    """What a frame's compile starts from: a copy of Dynamo's graph, untouched by the passes,
    and its example inputs; ``FrameRunner.recompile`` compiles it again with other pass options."""

    def __init__(self, gm, sources, eager_owned: set, frame: str, grad_enabled: bool, session: ModelSession,
                 fake_mode=None):
        self.gm = gm
        self.session = session
        """The model's session: its comms logger and flops profiler time the graphs."""
        self.sources = sources
        self.eager_owned = eager_owned
        self.frame = frame
        self.grad_enabled = grad_enabled
        """Whether autograd was on when Dynamo traced it (AOTAutograd compiles a training or an
        inference graph by it)."""
        self.fake_mode = fake_mode
        """The fake mode of Dynamo's compile (None outside Dynamo): a later compile traces in it."""
        self.compiled_once = False
        self._size_symbols: list | None = None
        self._scalars: list = []
        """The example inputs that are not tensors (sizes Dynamo made inputs), for a later compile."""

    def compile(self, cfg: ZeroConfig, plans: list, reduction, example_inputs=None) -> tuple:
        """The passes and inner compile of a fresh copy of the graph with ``cfg``: the compiled
        callable and its partitioner. ``reduction``: the frame's ``ReductionChoice`` (or None).
        ``example_inputs``: Dynamo's, at the first compile; a later one makes its own."""
        if example_inputs is None:
            example_inputs = self._example_inputs(plans)
        else:
            self._scalars = [None if isinstance(ex, torch.Tensor) else ex for ex in example_inputs]
        group = resolve_group(cfg.sharding.process_group)
        frame = self.frame
        ctx = PassContext(config=cfg, group=group, frame=frame, recorder=recorder_for(cfg, group),
                          device=_frame_device(plans))
        ctx.gradient_reduction = reduction
        if reduction is not None:
            ctx.results["gradient_reduction"] = reduction.as_dict()
            if ctx.recorder is not None:
                ctx.recorder.note(frame, "gradient_reduction", reduction.as_dict())
        # the first compile runs inside Dynamo's; a later one (FrameRunner.recompile) as it ran
        again = _torch_compat.as_in_dynamo_compile(self.fake_mode) if self.compiled_once else contextlib.nullcontext()
        self.compiled_once = True
        shown = compile_status(frame, cfg.sharding.stage, _frame_summary(plans, cfg, self.grad_enabled))
        with again, shown as status, torch.set_grad_enabled(self.grad_enabled):
            ctx.progress = status.update
            try:
                return _passes_and_inner_compile(_copy_graph_module(self.gm), example_inputs, self.sources,
                                                 plans, ctx, cfg, status, self.session)
            finally:
                ctx.progress = None

    def _example_inputs(self, plans: list) -> list:
        """Inputs for a later compile: each parameter, Dynamo's fake tensor of every other tensor
        input (its placeholder's ``example_value``, in Dynamo's fake mode) and the scalars.
        Dynamo's example inputs are not kept: under ``plan`` the activations among them are
        fake tensors of plan's mode, which plan would count as alive."""
        placeholders = list(self.gm.graph.find_nodes(op="placeholder"))
        return [sp.param if sp is not None else scalar if scalar is not None else node.meta["example_value"]
                for node, sp, scalar in zip(placeholders, plans, self._scalars)]

    def size_symbols(self) -> list:
        """``flop_count.size_symbols`` of the frame's inputs (Dynamo's placeholders)."""
        if self._size_symbols is None:
            placeholders = self.gm.graph.find_nodes(op="placeholder")
            self._size_symbols = size_symbols([n.meta.get("example_value") for n in placeholders])
        return self._size_symbols

    def new_state(self, param, plan: ShardedParam, ctx: PassContext, name: str | None = None) -> ShardedParam:
        """The shard state of ``param``, first met where ``plan``'s parameter was traced, with the
        options the frame's graphs were compiled with (``ctx``); named ``name`` where its own
        name is known, else after ``plan``'s."""
        cfg = ctx.config
        state = _shard_parameter(param, name or plan.name, cfg, ctx.group, keep_full=id(param) in self.eager_owned,
                                 session=self.session)
        state.gradient_reduction = ctx.gradient_reduction
        return state


def _gradient_reduction(cfg: ZeroConfig, group: CommGroup, plans: list, frame: str):
    """Stages 1-3: the frame's ``ReductionChoice`` (``runtime/reduction_choice.py``; with
    ``"auto"`` timed on the group by the first such frame of the process, on every rank at the
    same point of its compile): how gradients are reduced (stages 1-2) and parameters gathered;
    at stages 1-2 also given to its parameters' shard states that have none (the step reads it).
    Stage 0: None."""
    if cfg.sharding.stage not in (1, 2, 3):
        return None
    # stage 3 has no all-reduce path: it reduce-scatters where gradient_reduction says all_reduce
    reduction = "reduce_scatter" if cfg.sharding.stage == 3 and cfg.sharding.gradient_reduction == "all_reduce" else \
        cfg.sharding.gradient_reduction
    choice = gradient_reduction(reduction, group, _frame_device(plans), cfg.sharding.parameter_gather,
                                saved=compile_cache.saved_choices(),
                                stage=cfg.sharding.stage)
    if cfg.sharding.stage == 3:
        choice = choice.without_all_reduce()
    if cfg.sharding.stage in (1, 2):
        for sp in plans:
            if sp is not None and sp.gradient_reduction is None:
                sp.gradient_reduction = choice
        log.info("[%s] gradient reduction: %s; parameter gather: %s", frame, choice.describe(),
                 choice.describe_gather())
    else:
        log.info("[%s] gradient reduction: %s; parameter gather: %s", frame, choice.describe(),
                 choice.describe_gather())
    return choice


def _passes_and_inner_compile(gm, example_inputs, sources, plans, ctx: PassContext, cfg: ZeroConfig, status,
                              session: ModelSession):
    """The frame's passes (Dynamo graph, then through AOTAutograd the joint, forward and backward
    graphs) and its inner compile; returns the compiled callable and the partitioner."""
    frame, group = ctx.frame, ctx.group
    kinds = [_torch_compat.input_kind(source, ex) for source, ex in zip(sources, example_inputs)]
    gm = run_passes(gm, ctx, "dynamo", plans=plans, input_kinds=kinds)
    new_inputs = []
    fake_mode = _torch_compat.fake_mode_of(example_inputs)
    for ex, sp in zip(example_inputs, plans):
        if sp is None:
            new_inputs.append(ex)
            ctx.primal_params.append(None)
            continue
        for t in sp.graph_inputs():
            # shards and replicas are new to Dynamo: give AOTAutograd static-shape fakes, or it
            # would invent size symbols no guard can be built for
            new_inputs.append(t if t is ex or fake_mode is None else fake_mode.from_tensor(t, static_shapes=True))
            ctx.primal_params.append(sp)
    partitioner = ZeroPartitioner(ctx)
    compiler, comms_logger, profiler = cfg.compiler, cfg.observability.comms_logger, cfg.observability.flops_profiler
    log.info("[%s] %d parameters (stage %d, world %d) -> %s", frame,
             sum(p is not None for p in plans), cfg.sharding.stage, group.world, compiler.inner_compiler)
    bypass = compile_cache.bypass_reason(compiler.inner_compiler, compiler.profile, ctx.recorder is not None,
                                         cfg.passes.zero_hpz_partition_size,
                                         comms_logger is not None or profiler is not None)
    lowerings = []
    if comms_logger is not None:
        session.comms.configure(comms_logger)
        lowerings.append(functools.partial(insert_comm_timers, log=session.comms, world=group.world, frame=frame))
    if profiler is not None:
        if profiler.profile_step == 1:     # the step compiling it is the one profiled
            session.module_times.arm(True)
        lowerings.append(functools.partial(insert_module_marks, times=session.module_times))
    watch = functools.partial(watch_collectives, frame=frame) if _watched(cfg, group) else None
    # the timers measure what ran between them: inductor keeps the graph's order
    keep_order = (comms_logger is not None and comms_logger.blocking) or profiler is not None
    key = None if bypass else compile_cache.frame_key(gm, new_inputs, group, partitioner.uuid())
    entry = _reused_entry_and_cost_model(key, ctx, bypass)
    status.compiling(f"AOTAutograd, {compiler.inner_compiler}")
    if compiler.inner_compiler == "eager":
        compiled = inner_compilers.compile_with_aot_eager(gm, new_inputs, partitioner, partitioner.inference,
                                                          debug_checks=compiler.debug_checks, lowerings=lowerings,
                                                          watch=watch)
        return compiled, partitioner
    cacheable = None if bypass else compile_cache.cacheable_functions(gm, partitioner.uuid())
    compiled = inner_compilers.compile_with_inductor(gm, new_inputs, partitioner, partitioner.inference,
                                                     cacheable_functions=cacheable, lowerings=lowerings,
                                                     keep_graph_order=keep_order, watch=watch)
    if not partitioner.ran and entry is not None:
        partitioner.restore(entry)
        log.info("[%s] compiled from torch's caches (zerocompile entry %s)", frame, key[:16])
    elif not partitioner.ran:
        # AOTAutograd's cache held the graphs but zerocompile's entry is not beside them (removed,
        # or another rank compiles anew): compile again without that cache, so the passes run
        log.info("[%s] AOTAutograd cache hit without zerocompile's entry: compiling anew", frame)
        compiled = inner_compilers.compile_with_inductor(gm, new_inputs, partitioner, partitioner.inference,
                                                         lowerings=lowerings, keep_graph_order=keep_order,
                                                         watch=watch)
    if key is not None and partitioner.ran:
        compile_cache.FrameCache.in_inductor_cache().save(key, partitioner.entry())
    return compiled, partitioner


def _reused_entry_and_cost_model(key: str | None, ctx: PassContext, bypass: str | None):
    """The frame's ``FrameEntry`` from an earlier compile (``key``), or None; sets the cost model
    the passes weigh: the entry's where every rank reuses its entry, else what the config asks
    (a probe is a collective, which every rank reaches, as the agreement before it)."""
    entry = None if key is None else compile_cache.FrameCache.in_inductor_cache().load(key)
    if bypass is not None:
        log.debug("[%s] compile caches not used: %s", ctx.frame, bypass)
    if not _needs_cost_model(ctx):
        return entry
    cfg = ctx.config
    # with inductor every rank takes part, even one that bypasses the caches (with no entry, so
    # all probe): whether a rank dumps, or has torch's caches on, is its own environment's
    if cfg.compiler.cost_model == "probe" and cfg.compiler.inner_compiler == "inductor" and not compile_cache.agree(
            entry, ctx.group, ctx.device):
        entry = None
    if entry is not None and entry.cost_model is not None:
        ctx.cost_model = CostModel.from_rates(entry.cost_model)
    else:
        ctx.cost_model = cost_model_for(cfg.compiler.cost_model, ctx.group, ctx.device)
        if cfg.compiler.cost_model == "probe" and "plan_activations" in _pipeline_names(ctx):
            # the planner weighs offloading by this rate; offloading everything does not need it
            ctx.cost_model = probe_offload(ctx.cost_model, ctx.group, cfg.passes.offload_activations, ctx.device)
    log.debug("[%s] cost model: %s", ctx.frame, ctx.cost_model)
    return entry


def _adopt_parameters(plans, roots) -> None:
    """Make the frame's parameters ``ZeroParameter``s now, once the frame has compiled and
    before Dynamo builds its guards: the guards record each parameter's class, so a class
    changed at the first run would fail them at the next call and compile every frame twice.

    The other plain parameters of the model change too (they carry no shard state until a
    frame uses them, and behave as plain parameters till then). Dynamo reuses a frame's code
    for every module its guards accept: when a graph break in a layer loop makes each layer's
    forward its own frame, layer 2 must arrive with the class layer 1 was compiled with, or
    each layer would compile anew (up to Dynamo's recompile limit, then run eagerly). "The
    model" is every module under ``roots``: the frame's own and the modules whose ``forward``
    called it (``_torch_compat.modules_calling``).
    """
    for sp in plans:
        if sp is not None:
            adopt(sp.param)
    for module in roots:
        for param in module.parameters():
            if type(param) is torch.nn.Parameter:
                adopt(param)


def _copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy we may rewrite: Dynamo reads its own graph again after the backend returns."""
    graph = torch.fx.Graph()
    value_map: dict = {}
    out = graph.graph_copy(gm.graph, value_map)
    graph.output(out)
    for old, new in value_map.items():
        if old.op == "placeholder":
            new._dynamo_source = getattr(old, "_dynamo_source", None)
    copy = torch.fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    return copy


def _pipeline_names(ctx: PassContext) -> set:
    return {p.name for kind in ("joint", "forward", "backward", "inference") for p in pipeline(ctx, kind)}


def _needs_cost_model(ctx: PassContext) -> bool:
    """Whether a pass in this config's pipeline weighs costs (and the probe is worth running)."""
    return bool(_pipeline_names(ctx) & {"prefetch", "selective_unshard", "recompute", "plan_activations"})


def _frame_device(plans) -> torch.device:
    """The device of the frame's parameters (where its collectives run); CPU if none."""
    return next((sp.device for sp in plans if sp is not None), torch.device("cpu"))
