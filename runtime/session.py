"""One ``ModelSession`` per compiled model, and the few things of the process that no model owns.

A session is made when a model's first frame is compiled (or when ``zerocompile.materialize``
shards it first) and holds what belongs to that model: its compiled frames, its parameters'
shard states, the ``ZeroOptimizer``\\ s over them, the collectives and FLOPs its graphs and its
optimizer step ran, its comms logger and flops profiler figures, and where its training steps
end. Frames find their model's session through their parameters' shard states (``sp.session``)
or their root modules (``Process.session_for``); an optimizer through its parameters, once
(``ZeroOptimizer`` refuses parameters of two sessions). Several models in one process (an RLHF
policy, its frozen reference and a reward model) each keep their own settings and figures.

``PROCESS`` is the only module-level registry of the package (``tests/test_architecture.py``
checks that): the sessions alive, the collective watchdog (one per rank: it follows this
rank's position in every collective of the group, whichever model issued it), the
shared-memory channels, ``zerocompile.log_metrics``' values waiting for the next step, the
timer sites of the compiled graphs, and the collectives issued outside any model.
``stats()`` sums every session (like ``torch.cuda.memory_stats()``, per process);
``stats(model)`` gives one model's.
"""

from __future__ import annotations

import itertools
import time
import weakref

import torch

from zerocompile.runtime.accounting import (COLLECTIVE_KINDS, COMPRESSED_KINDS, CollectiveSummary, CollectiveTotals,
                                            ZeroStats, ring_wire_bytes)
from zerocompile.runtime.collective_watch import CollectiveWatch
from zerocompile.runtime.comms_log import CommsLog
from zerocompile.runtime.module_times import ModuleTimes


class ModelSession:
    """What belongs to one compiled model (see the module docstring)."""

    def __init__(self, name: str, sites: "TimerSites", config=None) -> None:
        self.name = name
        """The model's class name (``ModelSession`` of a frame with no module: ``"frames"``)."""
        self.created_ns = time.monotonic_ns()
        self.config = config
        """The options (``ZeroConfig``) of the model's first compiled frame; None for a session
        made by ``zerocompile.materialize`` until a frame is compiled."""
        self.world_size = 1
        self.comm = {k: CollectiveTotals() for k in COLLECTIVE_KINDS + COMPRESSED_KINDS}
        self.states: "weakref.WeakSet" = weakref.WeakSet()
        """The shard states of the model's parameters."""
        self.optimizers: "weakref.WeakSet" = weakref.WeakSet()
        """The ``ZeroOptimizer``\\ s over the model's parameters (added when each first binds)."""
        self.frames: "weakref.WeakSet" = weakref.WeakSet()
        """The model's compiled frames alive (``FrameRunner``)."""
        self.flops = {"flops": 0, "recompute": 0}
        """FLOPs the model's graphs and eager code ran since its last step ended."""
        self.step_flops = {"flops": 0, "recompute": 0}
        """The same, of the last step (``end_step``)."""
        self.calls: dict = {}
        """Forward and backward runs per compiled frame (by ``FrameRunner.order``) since the last step."""
        self.step_calls: dict = {}
        """The same, of the last step."""
        self.eager_modules: dict = {}
        """FLOPs of eager code since the last step, ``{(module path, type): [forward, backward]}``
        (``runtime/eager_flops.py``); included in ``flops``."""
        self.step_eager_modules: dict = {}
        """The same, of the last step."""
        self.comms = CommsLog(new_site=lambda: sites.new(self.comms))
        """The comms logger's settings, call sites and timings (``comms_logger`` option)."""
        self.module_times = ModuleTimes(new_site=lambda: sites.new(self.module_times))
        """The flops profiler's per-module latencies (``flops_profiler`` option)."""
        self.compile_seconds = 0.0
        """Seconds spent in ``compile_frame`` for this model since the last reset."""
        self.last_stepped = 0
        """``id`` of the optimizer whose step ended last (``end_step``)."""
        self.step_serial = 0
        """Which of the process's training steps this model's last step was (``Process.step_ended``):
        models whose steps ended together share it."""
        self.held_until_step_end: list = []
        """Shard states eager code outside every module's forward gathered (``EagerRegions.borrow``),
        each held once, released when the step ends."""

    def __repr__(self) -> str:
        return f"ModelSession({self.name!r}, {len(self.frames)} frames, {len(self.states)} parameters)"

    # ------------------------------------------------------------------ counting
    def record(self, kind: str, nbytes: int, count: int = 1) -> None:
        """``count`` eager collectives of ``kind`` over the data-parallel group, ``nbytes`` in all."""
        self.comm[kind].count += count
        self.comm[kind].bytes += nbytes
        self.comm[kind].wire_bytes += ring_wire_bytes(kind, nbytes, self.world_size)
        self.comms.counted(kind, nbytes, self.world_size)

    def record_summary(self, summary: CollectiveSummary) -> None:
        for kind, tot in summary.totals.items():
            self.comm[kind].add(tot)

    def record_flops(self, flops: int, recompute: int = 0, frame: int | None = None, backward: bool = False) -> None:
        """A compiled graph's run: its FLOPs, of which ``recompute`` recomputed forward ops;
        ``frame`` (its ``FrameRunner.order``) counts the run among that frame's forward or
        backward runs of the step (the flops profiler's per-module figures)."""
        self.flops["flops"] += flops
        self.flops["recompute"] += recompute
        if frame is not None:
            self.calls.setdefault(frame, [0, 0])[int(backward)] += 1

    def record_eager_flops(self, module: tuple, flops: int, backward: bool) -> None:
        """FLOPs of an eager op (``runtime/eager_flops.py``) run for ``module`` (``(path, type)``),
        in its forward or its backward."""
        self.flops["flops"] += flops
        self.eager_modules.setdefault(module, [0, 0])[int(backward)] += flops

    def end_step(self, optimizer: int = 0) -> bool:
        """An optimizer step of this model ended (``optimizer``: its ``id``): what ran since the
        last one is the step's. Another optimizer stepping right after (no compiled graph ran in
        between: Muon for the matrices and AdamW beside it) ends the same training step, which
        keeps its figures. Returns whether a step ended."""
        if not self.calls and optimizer != self.last_stepped:
            self.last_stepped = optimizer
            return False
        self.last_stepped = optimizer
        self._close_step()
        return True

    def _close_step(self) -> None:
        held, self.held_until_step_end = self.held_until_step_end, []
        for state in held:
            state.unhold()
        self.step_flops, self.flops = self.flops, {"flops": 0, "recompute": 0}
        self.step_calls, self.calls = self.calls, {}
        self.step_eager_modules, self.eager_modules = self.eager_modules, {}
        self.module_times.step_ended()

    def reset(self) -> None:
        self.comm = {k: CollectiveTotals() for k in COLLECTIVE_KINDS + COMPRESSED_KINDS}
        self.flops = {"flops": 0, "recompute": 0}
        self.step_flops = {"flops": 0, "recompute": 0}
        self.calls, self.step_calls = {}, {}
        self.eager_modules, self.step_eager_modules = {}, {}
        self.comms.reset()
        self.compile_seconds = 0.0

    def check_model_options(self, config, frame: str, section: str, names) -> None:
        """A frame of this model compiled with ``config``: its options ``names`` of ``section``
        must be the model's (its first frame's). They are the options of the model's optimizer
        step (``step``: ``loss_scale``, ``gradient_clipping``, ``offload_optimizer``,
        ``allow_unsharded``), read from the session (``ShardedParam.option``): one step scales,
        clips and offloads one way (a scaled and an unscaled gradient summed into one tensor could
        not be told apart); and what the model writes about itself (``observability``:
        ``monitor``, ``flops_profiler``, ``comms_logger``): one writer per model. Enforced here,
        once per compile, not by the optimizer."""
        for name in names:
            mine, model = getattr(getattr(config, section), name), getattr(getattr(self.config, section), name)
            if mine != model:
                raise ValueError(
                    f"zerocompile [{frame}]: this frame of model '{self.name}' was compiled with {name} {mine!r}, "
                    f"but the model's frames so far with {model!r}: a model's frames (and models that share "
                    f"parameters) cannot use different {name} options; compile them all with the same options")

    # ------------------------------------------------------------------ membership
    def add_state(self, state, world: int) -> None:
        """A shard state of this model's (made by a frame's compile or ``materialize``)."""
        state.session = self
        self.states.add(state)
        self.world_size = world

    def discard_state(self, state) -> None:
        self.states.discard(state)

    def frames_using(self, states) -> list:
        """This model's compiled frames that use any of ``states`` (shard states), compile order."""
        ids = {id(sp) for sp in states}
        return sorted((r for r in list(self.frames) if any(id(sp) in ids for sp in r.plans if sp is not None)),
                      key=lambda r: r.order)


class TimerSites:
    """The timer ops' call sites (``runtime/timer_ops.py``), unique in the process: a compiled
    graph's timer names its site by number, and the number names the comms logger or flops
    profiler (of one session) that registered it."""

    def __init__(self) -> None:
        self._owners: dict = {}
        self._next = itertools.count()

    def new(self, owner) -> int:
        index = next(self._next)
        self._owners[index] = weakref.ref(owner)
        return index

    def owner(self, index: int):
        """The ``CommsLog`` or ``ModuleTimes`` of site ``index``, None once it is gone."""
        ref = self._owners.get(index)
        return None if ref is None else ref()


class Process:
    """This process's sessions and what no model owns (see the module docstring)."""

    def __init__(self) -> None:
        self.sessions: "weakref.WeakSet" = weakref.WeakSet()
        self._by_module: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        """A model's root modules -> its session (kept alive by the model)."""
        self.sites = TimerSites()
        self.outside = ModelSession("outside any model", self.sites)
        """Collectives issued outside any model's session (a checkpoint's checks before any compile)."""
        self.optimizers: "weakref.WeakSet" = weakref.WeakSet()
        """Every ``ZeroOptimizer`` alive, bound to a session or not yet."""
        self.pending_metrics: dict = {}
        """``zerocompile.log_metrics``' values waiting for the next ``ZeroOptimizer.step()``."""
        self.channels: "weakref.WeakSet" = weakref.WeakSet()
        """Shared-memory channels alive (``runtime/shared_memory.py``): their segments' bytes."""
        self.watch = CollectiveWatch()
        """The collective watchdog (``collective_timeout_s`` option): this rank's position."""
        self.watch.board.counts = self.calls_since_step
        self.steps_ended = 0
        """Training steps ended in this process, by any model (``ModelSession.step_serial``)."""
        self._services: dict = {}
        self.frames_epoch = 0
        """Moves whenever a compiled frame is made or freed (``add_frame``): what readers of the
        frames alive on every optimizer step key their answers by (``frames_digest``)."""
        self._digest: tuple = (-1, 0, [])

    def add_frame(self, session: ModelSession, runner) -> None:
        """``runner`` (a ``FrameRunner``) is a compiled frame of ``session``'s model, alive
        until it is freed."""
        session.frames.add(runner)
        self._frames_changed()
        weakref.finalize(runner, self._frames_changed).atexit = False

    def _frames_changed(self) -> None:
        self.frames_epoch += 1

    def frames_digest(self) -> tuple[int, list]:
        """``(newest order, dump roots)`` of the compiled frames alive: the compile order
        (``FrameRunner.order``) of the newest (0 if none) and their dump directories
        (``options={"dump": DIR}`` or ``ZEROCOMPILE_DUMP``), each once, sorted; computed again
        only after a frame was made or freed (each optimizer step asks: walking every frame of
        every session then cost as much as a small update)."""
        epoch, newest, roots = self._digest
        if epoch != self.frames_epoch:
            epoch = self.frames_epoch
            frames = self.frames()
            newest = max((r.order for r in frames), default=0)
            roots = sorted({root for r in frames if (root := getattr(r, "dump_root", None))})
            self._digest = (epoch, newest, roots)
        return newest, roots

    def service(self, cls):
        """The process's one ``cls()``, made at its first use: the state of a runtime module that
        no model owns and that custom ops reach by their arguments (``activation_offload.Stores``,
        ``shared_memory.OpenChannels``), kept here with the sessions. A service may report figures
        of the process for ``stats()`` (``process_figures()``: ``{ZeroStats field: value}``)."""
        found = self._services.get(cls)
        if found is None:
            found = self._services[cls] = cls()
        return found

    # ------------------------------------------------------------------ finding sessions
    def session_for(self, roots: list, states: list, config=None, fallback=None) -> ModelSession:
        """The session of a frame reached from the modules ``roots`` (outermost first) whose
        parameters have the shard states ``states`` (None where not sharded yet): the session
        of the first root that has one, else of the first state that has one, else ``fallback``
        (the session of the frame a piece was cut from), else a new one. Every root is then the
        session's."""
        session = next((s for root in roots if (s := self._by_module.get(root)) is not None), None)
        if session is None:
            session = next((sp.session for sp in states if sp is not None and sp.session is not None), None)
        if session is None:
            session = fallback
        if session is None:
            name = type(roots[0]).__name__ if roots else "frames"
            session = ModelSession(name, self.sites, config)
            self.sessions.add(session)
        if session.config is None:
            session.config = config
        for root in roots:
            self._by_module.setdefault(root, session)
        return session

    def session_of_model(self, model) -> ModelSession | None:
        """The session of ``model`` (a module, or what ``torch.compile`` returned): the one of its
        parameters' shard states, else the one its module is registered with; None if none."""
        params = {id(p) for p in model.parameters()}
        for session in self.all()[:-1]:
            if any(id(sp.param) in params for sp in list(session.states)):
                return session
        for module in model.modules():
            session = self._by_module.get(module)
            if session is not None:
                return session
        return None

    def optimizer_of(self, param):
        """The ``ZeroOptimizer`` that steps ``param``: the newest of those alive that hold it
        (``holds``), or None. A read of ``param.grad`` asks it to reduce the gradients first, and
        a compiled backward scales by its loss scaler."""
        for optimizer in sorted(self.optimizers, key=lambda o: -o.created_ns):
            if optimizer.holds(param):
                return optimizer
        return None

    def all(self) -> list:
        """Every session alive, oldest first, and last the collectives outside any model."""
        return sorted(self.sessions, key=lambda s: s.created_ns) + [self.outside]

    def frames(self) -> list:
        """Every compiled frame alive, in compile order."""
        return sorted((r for s in list(self.sessions) for r in list(s.frames)), key=lambda r: r.order)

    # ------------------------------------------------------------------ steps
    def step_ended(self, session: ModelSession, optimizer: int) -> None:
        """``optimizer`` (its ``id``) of ``session`` finished a step: the session's step ends
        (``ModelSession.end_step``), and so does that of each model no optimizer trains (a
        frozen reference or reward model run within the step), so that its FLOPs are per step too."""
        if not session.end_step(optimizer):
            return
        self.steps_ended += 1
        session.step_serial = self.steps_ended
        for other in list(self.sessions):
            if other is not session and not other.optimizers and other.calls:
                other._close_step()
                other.step_serial = self.steps_ended
        self.watch.step_ended()

    def calls_since_step(self) -> dict:
        """Forward and backward runs per frame since each model's last step (read by the
        collective watchdog's responder thread)."""
        out: dict = {}
        for session in list(self.sessions):
            out.update(session.calls.copy())
        return out

    def reset(self) -> None:
        for session in self.all():
            session.reset()


PROCESS = Process()


def snapshot(sessions: list, optimizers=()) -> ZeroStats:
    """``ZeroStats`` of ``sessions`` together (with the process's shared-memory and activation
    offload figures, which no model owns), and of ``optimizers`` besides theirs (those that have
    not joined a session yet: over parameters no compiled frame used). The FLOPs per step are
    those of the newest training step: of the sessions whose last step ended in it (an RLHF
    policy's step and the frozen reference run within it; not a model trained earlier)."""
    params: dict[int, int] = {}
    grads: dict[int, int] = {}
    offloaded_params = 0
    comm = {k: CollectiveTotals() for k in COLLECTIVE_KINDS + COMPRESSED_KINDS}
    by_id: dict = {id(opt): opt for opt in optimizers}
    flops = {"flops": 0, "recompute": 0}
    compile_seconds, world, latency = 0.0, 1, []
    for session in sessions:
        for state in list(session.states):
            p, g = state.storages()
            params.update(p)
            grads.update(g)
            if state.shard_file is not None:
                offloaded_params += state.shard_file.nbytes
        for kind, totals in session.comm.items():
            comm[kind].add(totals)
        for opt in list(session.optimizers):
            by_id[id(opt)] = opt
        compile_seconds += session.compile_seconds
        world = max(world, session.world_size)
        latency += session.comms.rows()
    newest = max((s.step_serial for s in sessions), default=0)
    for session in sessions:
        if session.step_serial == newest:
            for key in flops:
                flops[key] += session.step_flops[key]
    opts = list(by_id.values())
    return ZeroStats(
        **{k: CollectiveTotals(v.count, v.bytes, v.wire_bytes) for k, v in comm.items()},
        world_size=world,
        param_bytes=sum(params.values()),
        grad_bytes=sum(grads.values()),
        optimizer_state_bytes=sum(opt.state_bytes() for opt in opts),
        offloaded_bytes=sum(opt.offloaded_bytes() for opt in opts),
        offloaded_param_bytes=offloaded_params,
        offload_buffer_bytes=sum(opt.offload_buffer_bytes() for opt in opts),
        shared_memory_bytes=sum(channel.nbytes for channel in list(PROCESS.channels)),
        **process_figures(),
        flops_per_step=flops["flops"],
        recompute_flops_per_step=flops["recompute"],
        compile_seconds=compile_seconds,
        comm_latency=latency,
    )


def process_figures() -> dict:
    """The ``ZeroStats`` figures of the process's services (``Process.service``), summed."""
    out: dict = {}
    for found in list(PROCESS._services.values()):
        for key, value in getattr(found, "process_figures", dict)().items():
            out[key] = out.get(key, 0) + value
    return out


def _sessions(model) -> list:
    if model is None:
        return PROCESS.all()
    session = PROCESS.session_of_model(model)
    if session is None:
        raise ValueError(f"zerocompile: {type(model).__name__} has no zerocompile session: compile it with "
                         "torch.compile(model, backend='zero') and run it (or zerocompile.materialize it) first")
    return [session]


def stats(model: torch.nn.Module | None = None) -> ZeroStats:
    """Collectives since the last ``reset_stats()`` and bytes held now, for this rank: of every
    model of the process together, or of ``model`` (compiled with ``backend="zero"``) alone."""
    return snapshot(_sessions(model), list(PROCESS.optimizers) if model is None else ())


def reset_stats(model: torch.nn.Module | None = None) -> None:
    """Zero the collective and FLOP counters of every model, or of ``model`` (memory figures are
    always current)."""
    for session in _sessions(model):
        session.reset()


def frame_reports() -> list[dict]:
    """What the pass pipeline decided for each compiled frame still alive in this process:
    ``{"frame", "compiled_at_ns" (``time.monotonic_ns()`` at compile), "stage", "results",
    "forward", "backward"}`` where ``results`` holds each
    pass's report (buckets formed, parameters kept gathered, blocks recomputed, bytes
    saved for backward...) and ``forward`` / ``backward`` the collectives per run."""
    return [runner.report() for runner in PROCESS.frames()]


def frame_roots(session: ModelSession | None = None) -> list:
    """The modules each compiled frame alive (of ``session``, or of every session) was reached
    from (``FrameRunner.roots``), frame by frame; a module several frames share comes once per frame."""
    runners = PROCESS.frames() if session is None else list(session.frames)
    return [root for runner in runners for root in runner.roots]


def newest_frame_order() -> int:
    """The compile order (``FrameRunner.order``) of the newest compiled frame alive, 0 if none."""
    return PROCESS.frames_digest()[0]


def simulated_peak_bytes(states) -> int:
    """The largest simulated transient peak of the compiled frames alive that use any of the
    shard states ``states`` (their reports' ``simulated_peak_bytes``), 0 if none."""
    states = list(states)
    sessions = {id(sp.session): sp.session for sp in states if sp.session is not None}
    frames = [r for s in sessions.values() for r in s.frames_using(states)]
    return max((r.report()["results"].get("simulated_peak_bytes", 0) for r in frames), default=0)


def comm_counts() -> dict:
    """``{kind: (count, bytes)}`` of every collective kind counted so far (eager and graphs, every session)."""
    totals = {k: CollectiveTotals() for k in COLLECTIVE_KINDS + COMPRESSED_KINDS}
    for session in PROCESS.all():
        for kind, t in session.comm.items():
            totals[kind].add(t)
    return {k: (v.count, v.bytes) for k, v in totals.items()}


def dump_roots() -> list:
    """The dump directories of the compiled frames alive (``options={"dump": DIR}`` or
    ``ZEROCOMPILE_DUMP``), each once."""
    return list(PROCESS.frames_digest()[1])
