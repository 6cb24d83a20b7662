"""The private torch APIs zerocompile depends on, in one place.

Each function says why it needs a private API. ``tests/test_torch_compat.py``
exercises every one of them directly, so a torch upgrade that changes them fails
there, loudly, rather than somewhere deep in a training run.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from zerocompile._torch_compat.c10d import (  # noqa: F401  (re-exported)
    DEFAULT_GROUP_TIMEOUT_S, collective_backend, group_timeout_s, init_fake_process_group, pending_collectives,
    new_default_store_client, process_group_function_modules, process_group_named, register_pending,
    register_pending_works, register_work)

# Why private: inductor accepts a custom partitioner only as a ``CustomPartitionerFn`` (it
# hashes its ``uuid()`` into the FX-graph cache key); ZeroPartitioner subclasses it.
PartitionerBase = CustomPartitionerFn


def min_cut_partition(joint_gm, joint_inputs, **kwargs):
    """AOTAutograd's min-cut partitioner (``torch._functorch.partitioners``), which honours
    ``node.meta["recompute"]`` tags."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    kwargs.pop("compiler", None)
    return min_cut_rematerialization_partition(joint_gm, joint_inputs, **kwargs)


def fake_mode_of(inputs):
    """The FakeTensorMode Dynamo traced ``inputs`` with (``torch._guards``), or None."""
    return torch._guards.detect_fake_mode(inputs)


@contextlib.contextmanager
def without_autograd_cache():
    """AOTAutograd's cache off for a compile.

    Why private: ``torch._functorch.config``. For the eager inner compiler, for frames that
    bypass zerocompile's compile cache, and for a frame compiled again because a hit had no
    zerocompile entry beside it (a hit skips the partitioner; ``zerocompile/compile_cache.py``).
    The inductor FX-graph cache underneath still applies."""
    with torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@contextlib.contextmanager
def autograd_cache(cacheable_functions: dict):
    """AOTAutograd's cache as torch configures it (on by default) for a compile whose Dynamo
    graph calls the plain Python functions named in ``cacheable_functions``
    (``"module.name" -> a digest of their source``), which its cacheability check would
    otherwise refuse.

    Why private: ``torch._inductor.config.unsafe_marked_cacheable_functions`` is the one way
    to vouch for a function in the graph; the digests become part of the cache key (inductor
    hashes its config), so an edited function misses. ``autograd_cache_bypass_reason`` runs
    the same check, for tests."""
    with torch._inductor.config.patch(unsafe_marked_cacheable_functions={
            **torch._inductor.config.unsafe_marked_cacheable_functions, **cacheable_functions}):
        yield


def autograd_cache_bypass_reason(gm: torch.fx.GraphModule) -> str | None:
    """Why AOTAutograd's cache would refuse ``gm`` (under the current config), or None.

    Why private: ``torch._functorch._aot_autograd.autograd_cache.check_cacheable`` is that check."""
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_cacheable

    try:
        check_cacheable(gm)
    except BypassAOTAutogradCache as err:
        return str(err)
    return None


def compile_caches_enabled() -> bool:
    """Whether inductor's FX-graph cache and AOTAutograd's cache are both on (the config
    flags and ``TORCHINDUCTOR_FORCE_DISABLE_CACHES``).

    Why private: ``torch._inductor.config`` and ``torch._functorch.config`` hold the flags."""
    return bool(torch._inductor.config.fx_graph_cache and torch._functorch.config.enable_autograd_cache
                and not torch.compiler.config.force_disable_caches)


def inductor_cache_dir() -> str:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``, else a per-user folder in
    the temporary directory).

    Why private: ``torch._inductor.runtime.cache_dir_utils.cache_dir`` resolves it."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def inductor_compilers():
    """Inductor's ``(compile_fx, compile_fx_inner)``.

    Why private: ``torch._inductor.compile_fx`` is where inductor takes a custom partitioner
    (``config_patches={"custom_partitioner_fn": ...}``) and an ``inner_compile`` hook."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    return compile_fx, compile_fx_inner


def aot_autograd(**kwargs):
    """AOTAutograd as a Dynamo backend with our compilers and partitioner.

    Why private: ``torch._dynamo.backends.common.aot_autograd`` is the only entry that takes a
    ``partition_fn`` and boxed forward/backward/inference compilers."""
    from torch._dynamo.backends.common import aot_autograd as make

    return make(**kwargs)


def is_traced_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tracing stand-in (a fake or functional tensor of Dynamo or
    AOTAutograd, or a tensor under make_fx's proxy mode) rather than real data.

    Why private: ``torch._subclasses.fake_tensor.is_fake`` sees through functional wrappers, and
    ``torch.fx.experimental.proxy_tensor.get_proxy_mode`` is the only way to know make_fx is
    recording ops on plain tensors.
    """
    from torch._subclasses.fake_tensor import is_fake
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return is_fake(t) or get_proxy_mode() is not None or torch.compiler.is_compiling()


def is_graph_value(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor or make_fx records ops on it: a value of a graph being
    traced. Unlike ``is_traced_tensor``, False for the real tensors a backend works on while
    Dynamo compiles (``torch.compiler.is_compiling()``: a compile-time probe's collectives are
    real ones). Private for the reasons ``is_traced_tensor`` gives."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return is_fake(t) or get_proxy_mode() is not None


@contextlib.contextmanager
def real_tensors():
    """Step out of an active ``FakeTensorMode`` (AOTAutograd's, around the partitioner), so
    that tensors made inside are real (the profile times ops on them).

    Why private: ``torch._subclasses.fake_tensor.unset_fake_temporarily`` is the only way
    out of a fake mode a caller entered; no public API leaves one.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield


def is_fake_tensor(t) -> bool:
    """Whether ``t`` is a ``FakeTensor`` made by a user's ``FakeTensorMode`` (``zerocompile plan``
    runs a whole script under one): it has shapes and a storage size but no values.

    Why private: ``torch._subclasses.fake_tensor.FakeTensor`` is the only class of such tensors.
    """
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def storage_owners(storage) -> int:
    """How many owners ``storage`` has (tensors on it, and ``storage`` itself while it is
    referenced): ``zerocompile.graph_replay`` keys a graph run by it.

    Why private: ``torch._C._storage_Use_Count`` is the only way to read it; Python's own
    reference count sees only the one Python object.
    """
    return torch._C._storage_Use_Count(storage._cdata)


def active_dispatch_modes() -> list:
    """The ``TorchDispatchMode`` instances active on this thread, outermost first
    (``zerocompile.graph_replay`` looks for its own among them).

    Why private: ``torch.utils._python_dispatch._get_current_dispatch_mode_stack`` is the only
    way to list them; autograd's worker threads inherit the stack, which a ``ContextVar`` would not.
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()


def placeholder_source(node: torch.fx.Node):
    """The Dynamo ``Source`` of a placeholder of a Dynamo graph, or None.

    Why private: Dynamo records where each graph input came from (e.g.
    ``L['self']._modules['l1']._parameters['weight']``) only in ``node.meta["grapharg"]``;
    we need it to name parameters in errors and to find the module that owns them.
    """
    grapharg = node.meta.get("grapharg")
    return getattr(grapharg, "source", None)


def source_path(source) -> list:
    """The chain of a Dynamo source from its root local, e.g. ``[('local', 'self'), ('key', 'l1'), ...]``.

    Why private: Source classes live in ``torch._dynamo.source``; we read only their
    ``base`` / ``member`` / ``index`` / ``local_name`` attributes.
    """
    path = []
    while source is not None:
        if hasattr(source, "local_name") and getattr(source, "base", None) is None:
            path.append(("local", source.local_name))
        elif hasattr(source, "member"):
            path.append(("attr", source.member))
        elif hasattr(source, "index"):
            path.append(("key", source.index))
        source = getattr(source, "base", None)
    return list(reversed(path))


def param_fqn(source) -> str | None:
    """A readable dotted name for a parameter source (``blocks.0.attn.weight``)."""
    names = []
    for kind, value in source_path(source):
        if kind == "local":
            continue
        if kind == "attr" and value in ("_modules", "_parameters", "_buffers"):
            continue
        names.append(str(value))
    return ".".join(names) or None


def input_kind(source, example) -> str:
    """"param", "buffer", "input" (reached from the frame's locals by indexing only: a user
    argument or an activation handed over at a graph break) or "other" (e.g. a plain tensor
    attribute of a module)."""
    if isinstance(example, torch.nn.Parameter):
        return "param"
    path = source_path(source) if source is not None else []
    if ("attr", "_buffers") in path:
        return "buffer"
    if path and path[0][0] == "local" and all(kind == "key" for kind, _ in path[1:]):
        return "input"
    return "other"


def frame_root_object(local_name: str):
    """The object bound to ``local_name`` in the frame Dynamo is compiling, or None.

    Why private: a Dynamo backend receives the graph, not the module; the frame's locals
    are reachable only through the current ``InstructionTranslator``. We use them to find
    the modules that own stage-3 parameters, to gather those on demand in eager code.
    """
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - not inside a Dynamo compile
        return None
    if tx is None:
        return None
    return getattr(tx, "f_locals", {}).get(local_name)


def root_module(source):
    """The ``nn.Module`` bound to the frame local a parameter source starts from, or None."""
    path = source_path(source)
    if not path or path[0][0] != "local":
        return None
    obj = frame_root_object(path[0][1])
    return obj if isinstance(obj, torch.nn.Module) else None


def plain_tensor_ops():
    """A context in which tensor subclasses' ``__torch_function__`` is skipped (ops see plain
    tensors), for zerocompile's own work on ``ZeroParameter`` objects.

    Why private: ``torch._C.DisableTorchFunctionSubclass`` is what ``torch.Tensor.__torch_function__``
    itself uses; Dynamo traces it, so ``ZeroParameter.__torch_function__`` compiles to nothing.
    """
    return torch._C.DisableTorchFunctionSubclass()


def called_from_module_state_dict(depth: int = 6) -> bool:
    """Whether a ``Module.state_dict()`` is the caller, within ``depth`` frames: its
    ``_save_to_state_dict`` takes ``param.detach()`` of each parameter (``keep_vars=False``),
    and a ``ZeroParameter`` whose storage is freed answers that with its sharded value.

    Why private: ``torch.nn.Module._save_to_state_dict`` is the (documented, overridable) method
    that writes a module's own entries; its name, and that it calls ``detach`` on each
    parameter, are what ``tests/test_torch_compat.py`` checks.
    """
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == "_save_to_state_dict":
            return True
        frame = frame.f_back
    return False


def inside_dynamo_trace() -> bool:
    """Whether Dynamo is compiling a frame right now (its builder reads ``p.grad`` of every
    parameter it wraps, which must not raise).

    Why private: ``torch._guards.TracingContext`` is set for the duration of a Dynamo compile;
    ``torch.compiler.is_compiling()`` is True only in the traced user code, not in Dynamo's own.
    """
    return torch._guards.TracingContext.try_get() is not None


def dynamo_fake_mode():
    """The fake mode of the Dynamo compile running now (``FrameRunner.recompile`` compiles the
    frame's graph again in it later), or None outside one.

    Why private: ``torch._guards.TracingContext`` holds it; a backend's example inputs may carry
    another (``zerocompile plan``'s parameters are fake tensors of plan's own mode).
    """
    context = torch._guards.TracingContext.try_get()
    return None if context is None else context.fake_mode


@contextlib.contextmanager
def as_in_dynamo_compile(fake_mode):
    """Run a backend's compile again as Dynamo ran it: with no dispatch mode active (a script's
    modes, plan's among them, see none of it) and, when ``fake_mode`` is not None, in a tracing
    context of that fake mode, so AOTAutograd traces with it and not with a mode of the caller
    (the fake tensors of a graph's metadata would otherwise belong to plan's mode, which counts
    them as the script's).

    Why private: ``torch._guards.tracing``/``TracingContext`` are how Dynamo gives AOTAutograd its
    fake mode, and ``torch.utils._python_dispatch._disable_current_modes`` is how it compiles
    with the user's modes off; there is no public way to do either.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        if fake_mode is None:
            yield
            return
        with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
            yield


def held_by_autograd(param: torch.Tensor) -> bool:
    """Whether a C++ owner besides the Python object holds ``param``'s tensor: an autograd graph
    that eager code built from it (the ``AccumulateGrad`` node of a parameter that requires grad,
    a saved tensor, the base of a saved view). Freeing the parameter's storage then would leave
    that graph's backward reading an empty storage.

    Why private: ``Tensor._use_count()`` is the reference count of the ``TensorImpl``; the Python
    object holds one reference, and every autograd holder of the tensor one more. No public API
    asks whether a live graph uses a leaf tensor. ``tests/test_torch_compat.py`` checks the count
    for each holder.
    """
    return param._use_count() > 1


def storageless_tensor(cls, shape, dtype, device):
    """A tensor of subclass ``cls`` with ``shape``, ``dtype`` and ``device`` but no storage
    (``zerocompile.runtime.dcp_shards.ShardView``: a shard as torch.distributed.checkpoint sees it).

    Why private: ``torch.Tensor._make_wrapper_subclass`` is how tensor subclasses without their
    own data are built (DTensor, LocalShardsWrapper). DCP asks such an object for its chunks
    through the ``_Checkpointable`` dunder protocol (``torch/distributed/_checkpointable.py``:
    ``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``), which
    ``ShardView`` implements; ``tests/test_torch_compat.py`` checks DCP still calls it.
    """
    return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)


def preserving_version(tensor: torch.Tensor):
    """A context in which writes into ``tensor`` keep its version counter: a parameter gathered
    back between an eager forward that saved it and its backward (``ShardedParam.materialize``)
    holds the values autograd saved, as FSDP2 restores its unsharded parameters. Why private:
    ``torch.autograd._unsafe_preserve_version_counter`` is the one API (tested)."""
    return torch.autograd._unsafe_preserve_version_counter(tensor)


def queue_end_of_backward(callback) -> None:
    """Run ``callback()`` once the running backward has finished (call it from a hook inside
    it). Why private: the engine's ``queue_callback`` is reached through
    ``torch.autograd.Variable._execution_engine`` only, as FSDP2 does (tested)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def never_a_frame(fn):
    """Mark ``fn`` so that Dynamo never compiles it as a frame of its own: called from eager
    code (a frame Dynamo skipped, e.g. for a graph break inside a loop), it and everything it
    calls run eagerly. Dynamo still inlines it into a frame it is tracing.

    For ``ZeroParameter.__torch_function__``: an eager op on a sharded parameter inside a
    compiled model's call would otherwise become a compiled frame whose input is the parameter
    (sharding it, and at stage 2 returning a view of the replica, whose gradient went nowhere).

    Why private: ``torch.compiler.disable`` and ``torch._dynamo.skip`` mark the function
    itself, and Dynamo then refuses to inline it (a graph break at every parameter op). The
    per-code frame strategy that ``skip`` is built on (``set_code_exec_strategy``, read only
    when a frame starts) is the one switch that skips the frame and keeps the inlining;
    ``tests/test_torch_compat.py`` checks both halves.
    """
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    return fn


def is_compiled_backward_node(node) -> bool:
    """Whether an autograd node is the backward of an AOTAutograd-compiled function.

    Why private: AOTAutograd runs a compiled graph through an ``autograd.Function`` subclass
    named ``CompiledFunction``; its node's name is the only mark it leaves on the autograd
    graph.
    """
    return "CompiledFunction" in node.name()


def compiled_backward_node(tensors, stop=frozenset()):
    """The compiled backward node of one run of a compiled frame, reached from the run's
    output ``tensors`` (breadth first: outputs are the compiled function's own or views
    AOTAutograd rebuilt on top of them) without entering the nodes whose ids are in ``stop``
    (the ``grad_fn``s of the run's inputs: an output that aliases an input would otherwise
    lead to an earlier frame's node). None if there is none."""
    seen = set()
    frontier = [t.grad_fn for t in tensors]
    while frontier:
        node = frontier.pop(0)
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen.add(id(node))
        if is_compiled_backward_node(node):
            return node
        frontier.extend(fn for fn, _ in node.next_functions)
    return None


# torch.amp.GradScaler. Why private: GradScaler passes itself as ``grad_scaler=`` to an
# optimizer with ``_step_supports_amp_scaling`` (the contract torch's own fused optimizers
# were built on) and leaves the unscaling to it; the optimizer then has to record in the
# scaler's per-optimizer state what it found, which is what ``update()`` reads. ZeroOptimizer
# must unscale itself: its gradients live in flat shards that GradScaler cannot see.
def grad_scaler_state(scaler, optimizer) -> dict:
    """The scaler's record for ``optimizer`` this iteration: ``{"stage": OptState, "found_inf_per_device": {device: tensor}}``."""
    return scaler._per_optimizer_states[id(optimizer)]


def grad_scaler_scale(scaler) -> torch.Tensor:
    """The scaler's current scale (a one-element float32 tensor on its device)."""
    scale = scaler._scale
    if scale is None:
        raise RuntimeError("GradScaler: no scale yet; call scaler.scale(loss) before the step")
    return scale


def grad_scaler_stages():
    """``(READY, UNSCALED, STEPPED)`` of ``torch.amp.grad_scaler.OptState``."""
    from torch.amp.grad_scaler import OptState

    return OptState.READY, OptState.UNSCALED, OptState.STEPPED


def unscale_and_check_(grads: list, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply ``grads`` (one device and dtype) by ``inv_scale`` in place and set
    ``found_inf`` to 1 if any is not finite (what GradScaler.unscale_ runs).

    Why private: ``torch._amp_foreach_non_finite_check_and_unscale_`` is GradScaler's own fused
    kernel (one launch per device and dtype on GPUs)."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def trace_checkpointed_regions_with_side_effects() -> None:
    """Let Dynamo trace a ``torch.utils.checkpoint`` region whose Python code has side effects
    (HF's attention forward sets and resets a context variable of the ``kernels`` package),
    applying them once, in the forward, instead of replaying them in the recomputation.

    Without it Dynamo gives up on such a region and runs ``torch.utils.checkpoint`` eagerly,
    which disables Dynamo for everything inside (``@torch._disable_dynamo``): the region's
    parameters are then used by no compiled frame and stay whole on every rank. Called once,
    when the ``zero`` backend is loaded (``torch.compile(backend="zero")`` loads it before
    tracing anything), so it holds for every frame zerocompile compiles.

    Why private: ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`` is the
    switch Dynamo's own error message names; ``tests/test_torch_compat.py`` checks it still makes
    such a region one graph.
    """
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def is_higher_order_op(func) -> bool:
    """Whether a ``__torch_dispatch__`` call is for a higher-order operator (activation
    checkpointing's ``run_and_save_rng_state`` / ``run_with_rng_state``, ``wrap_with_*``, ...).

    Why private: ``torch._ops.HigherOrderOperator`` is their class; a dispatch mode receives
    them only when it sets ``supports_higher_order_operators = True`` (otherwise torch raises
    "no rule registered for HigherOrderOperator ... and mode ..."), and then gets the operator
    with itself popped: calling it runs it on the modes below.
    """
    return isinstance(func, torch._ops.HigherOrderOperator)


def rng_wrapped_op(func, args):
    """``(op, op_args)`` of the one op a higher-order operator runs under a saved RNG state:
    ``run_and_save_rng_state(op, *args)`` returns ``(rng_state, op(*args))``,
    ``run_with_rng_state(rng_state, op, *args)`` returns ``op(*args)`` (how AOTAutograd
    functionalizes random ops in a recomputed region). None for other operators.

    Why private: the operators are ``torch._prims.rng_prims``' and their argument order is
    theirs; ``tests/test_torch_compat.py`` checks it.
    """
    name = getattr(func, "_name", None)
    if name == "run_and_save_rng_state":
        return args[0], tuple(args[1:])
    if name == "run_with_rng_state":
        return args[1], tuple(args[2:])
    return None


def op_run_by(func, args, kwargs, out):
    """``(op, op_args, op_kwargs, op_out)`` of the op ``rng_wrapped_op`` finds, for a call that
    returned ``out``; None for other operators."""
    wrapped = rng_wrapped_op(func, args)
    if wrapped is None:
        return None
    op, op_args = wrapped
    return op, op_args, kwargs, out[1] if func._name == "run_and_save_rng_state" else out


def no_dispatch():
    """A context in which ops skip every ``TorchDispatchMode`` (plan's fake mode included): graph
    replay makes a real RNG state as ``torch.get_rng_state()`` would.

    Why private: ``torch.utils._mode_utils.no_dispatch`` is torch's own way to do this.
    """
    from torch.utils._mode_utils import no_dispatch as torch_no_dispatch

    return torch_no_dispatch()


def boxed_python_code(gm: torch.fx.GraphModule):
    """``gm``'s generated Python code in the boxed calling convention: a function of one list of
    inputs that empties the list, then drops each value (inputs included) after its last use.
    Private (``torch.fx.graph._BoxedCodeGen``): FX's public code generator takes the inputs as
    arguments, whose caller's references keep every input alive for the whole graph."""
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    return gm.forward


def profiled_allocations(prof) -> list[tuple[int, int, int, str]]:
    """The CPU allocator's allocations and frees that ``prof`` (a finished
    ``torch.profiler.profile(profile_memory=True)``) recorded, in time order: ``(time_ns,
    nbytes, address, op)``, ``nbytes`` negative for a free, ``op`` the innermost op running then
    ("" outside any).

    Why private: the public ``prof.events()`` keeps only some of the ``[memory]`` events, and
    none says which block it allocates or frees; the profiler's event tree
    (``kineto_results.experimental_event_tree()``, whose allocation events carry
    ``alloc_size`` and ``ptr``) has every one."""
    from torch._C._profiler import _EventType

    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.typed[0] == _EventType.Allocation:
            fields = event.typed[1]
            parent = event.parent
            out.append((event.start_time_ns, fields.alloc_size, fields.ptr, parent.name if parent is not None else ""))
    out.sort(key=lambda a: a[0])
    return out


def passed_through_dynamo(err: Exception) -> Exception:
    """``err`` (raised while a backend compiles) as an exception Dynamo passes to the caller as
    it is, instead of wrapping it in ``BackendCompilerFailed``: an instance of a subclass of
    ``type(err)`` (same name, message and attributes), so ``except type(err)`` catches it.

    Why private: ``torch._dynamo.exc.ShortenTraceback`` is the only kind of backend exception
    Dynamo re-raises unwrapped (``OutputGraph._call_user_compiler``)."""
    cls = _passing_class(type(err))
    out = Exception.__new__(cls)
    out.__dict__.update(err.__dict__)
    out.args = err.args
    out.first_useful_frame = None
    return out


@functools.cache
def _passing_class(cls: type) -> type:
    from torch._dynamo.exc import ShortenTraceback

    return type(cls.__name__, (cls, ShortenTraceback), {"__module__": cls.__module__,
                                                        "__qualname__": cls.__qualname__})
