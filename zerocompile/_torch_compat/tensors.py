"""Tensors and dispatch: tracing stand-ins (fake, functional, proxy), tensor subclasses,
dispatch modes, storages, higher-order operators, and the profiler's allocation events.

Part of ``zerocompile._torch_compat`` (see its docstring): each function says why it needs a
private API, and ``tests/test_torch_compat.py`` exercises it."""

from __future__ import annotations

import contextlib

import torch


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


def plain_tensor_ops():
    """A context in which tensor subclasses' ``__torch_function__`` is skipped (ops see plain
    tensors), for zerocompile's own work on ``ZeroParameter`` objects.

    Why private: ``torch._C.DisableTorchFunctionSubclass`` is what ``torch.Tensor.__torch_function__``
    itself uses; Dynamo traces it, so ``ZeroParameter.__torch_function__`` compiles to nothing.
    """
    return torch._C.DisableTorchFunctionSubclass()


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
