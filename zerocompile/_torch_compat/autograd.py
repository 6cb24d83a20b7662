"""Autograd and ``nn.Module``: who holds a tensor, version counters, the engine's end-of-backward
callback, the compiled backward's node, and the callers torch does not name (``Module.state_dict``,
``zero_grad``).

Part of ``zerocompile._torch_compat`` (see its docstring): each function says why it needs a
private API, and ``tests/test_torch_compat.py`` exercises it."""

from __future__ import annotations

import sys

import torch


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


def called_from_zero_grad() -> bool:
    """Whether the caller of the function that calls this (a parameter's ``grad`` property) is
    a ``zero_grad``: ``nn.Module.zero_grad``, ``torch.optim.Optimizer.zero_grad`` or a wrapper's
    method of that name. Those only test ``p.grad is not None`` and then set it to None or zero
    it in place.

    Why private: torch has no hook on ``zero_grad`` and does not tell a ``grad`` property who
    reads it; the frame's function name is the one sign. ``tests/test_torch_compat.py`` checks
    that torch's two ``zero_grad``s still read ``p.grad`` themselves.
    """
    frame = sys._getframe(2)
    return frame is not None and frame.f_code.co_name == "zero_grad"


def inside_call_of(modules) -> bool:
    """Whether one of ``modules`` is being called (``module(...)``) on this thread: its
    ``Module.__call__`` frame is on the Python stack, compiled or not (a graph break's eager code
    runs between the compiled graphs of that call).

    Why private: ``Module.__call__`` runs as ``_wrapped_call_impl`` and ``_call_impl`` (also as the
    code Dynamo compiles); their names and their ``self`` are the one sign, and torch has no hook
    that runs at a compiled call's end. ``tests/test_torch_compat.py`` checks both names.
    """
    wanted = {id(m) for m in modules}
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in ("_wrapped_call_impl", "_call_impl") and id(frame.f_locals.get("self")) in wanted:
            return True
        frame = frame.f_back
    return False


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
