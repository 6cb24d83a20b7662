"""Dynamo: where a graph input came from (sources), the frame being compiled, its tracing
context and fake mode, its config, the frames it must never compile, how a backend's error
reaches the caller, and the modules that called the frame being compiled.

Part of ``zerocompile._torch_compat`` (see its docstring): each function says why it needs a
private API, and ``tests/test_torch_compat.py`` exercises it."""

from __future__ import annotations

import contextlib
import functools
import sys

import torch


def modules_calling(roots) -> list:
    """The modules on the Python stack (a frame's ``self``) that contain one of ``roots``, when
    called from a backend: the model whose ``forward`` called the compiled block being compiled
    (a model compiled block by block is one model, with one session).

    Why private: Dynamo does not tell a backend who called the frame it compiles; it compiles on
    the caller's stack, so the calling modules' ``forward`` frames are below the backend's. That
    Dynamo still compiles there is what ``tests/test_torch_compat.py`` checks.
    """
    wanted = {id(r) for r in roots}
    found, seen = [], set()
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if isinstance(owner, torch.nn.Module) and id(owner) not in seen:
            seen.add(id(owner))
            if any(id(m) in wanted for m in owner.modules()):
                found.append(owner)
        frame = frame.f_back
    return found


def fake_mode_of(inputs):
    """The FakeTensorMode Dynamo traced ``inputs`` with (``torch._guards``), or None."""
    return torch._guards.detect_fake_mode(inputs)


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
