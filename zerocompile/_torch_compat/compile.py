"""AOTAutograd, inductor and their caches: the partitioner zerocompile plugs in, the
compilers it calls, the cache switches and the boxed code of a graph.

Part of ``zerocompile._torch_compat`` (see its docstring): each function says why it needs a
private API, and ``tests/test_torch_compat.py`` exercises it."""

from __future__ import annotations

import contextlib

import torch
from torch._inductor.custom_graph_pass import CustomPartitionerFn


# Why private: inductor accepts a custom partitioner only as a ``CustomPartitionerFn`` (it
# hashes its ``uuid()`` into the FX-graph cache key); ZeroPartitioner subclasses it.
PartitionerBase = CustomPartitionerFn


def min_cut_partition(joint_gm, joint_inputs, **kwargs):
    """AOTAutograd's min-cut partitioner (``torch._functorch.partitioners``), which honours
    ``node.meta["recompute"]`` tags."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    kwargs.pop("compiler", None)
    return min_cut_rematerialization_partition(joint_gm, joint_inputs, **kwargs)


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


def boxed_python_code(gm: torch.fx.GraphModule):
    """``gm``'s generated Python code in the boxed calling convention: a function of one list of
    inputs that empties the list, then drops each value (inputs included) after its last use.
    Private (``torch.fx.graph._BoxedCodeGen``): FX's public code generator takes the inputs as
    arguments, whose caller's references keep every input alive for the whole graph."""
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    return gm.forward
