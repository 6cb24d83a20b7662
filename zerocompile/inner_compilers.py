"""The inner compilers: what turns the rewritten forward and backward graphs into code.

``compile_with_inductor`` (C++/Triton kernels) and ``compile_with_aot_eager`` (the graphs run
op by op, as FX's generated code) both call AOTAutograd with zerocompile's partitioner, and
both hand their graphs to ``runnable`` first (collectives lowered for their backend, checked).
``CheckedInterpreter`` is the eager runner of the ``debug_checks`` option. The private torch
entry points they use are shims in ``_torch_compat`` (``_torch_compat/compile.py``).
"""

from __future__ import annotations

import functools

import torch

from zerocompile import _torch_compat, graph_replay
from zerocompile.collection_pause import collection_resumed
from zerocompile.runtime import param_offload
from zerocompile.runtime.comm import check_collectives_runnable, lower_collectives_for_backend


def compile_with_inductor(gm, example_inputs, partitioner, on_inference=None, cacheable_functions=None,
                          lowerings=(), keep_graph_order=False, watch=None):
    """Inductor's ``compile_fx`` with our partitioner (its ``custom_partitioner_fn`` config
    hook). ``on_inference(graph_module)`` rewrites an inference graph (a frame run without
    autograd, which no partitioner sees) before inductor compiles it, through
    ``compile_fx``'s ``inner_compile`` argument.

    ``cacheable_functions`` (``compile_cache.cacheable_functions``): AOTAutograd's cache on, with
    these functions of the graph vouched for; a hit calls no partitioner. None: the cache off.
    ``lowerings``: functions of a final graph given to ``runnable`` (the comms logger's and the
    flops profiler's timers). ``keep_graph_order``: inductor's peak-memory reordering off, so its
    kernels run in the graph's order (no kernel between a blocking collective and its timer's
    end; segments of one module together). ``watch``: as ``runnable``'s."""
    compile_fx, compile_fx_inner = _torch_compat.inductor_compilers()

    def inner_compile(graph, inputs, **kwargs):
        if kwargs.get("is_inference") and on_inference is not None:
            graph = on_inference(graph)
        kind = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
        graph = runnable(graph, lowerings, watch, kind)
        with collection_resumed():       # inductor's code generation, with the collector as torch runs it
            return compile_fx_inner(graph, inputs, **kwargs)

    caching = (_torch_compat.without_autograd_cache() if cacheable_functions is None
               else _torch_compat.autograd_cache(cacheable_functions))
    with caching:
        return compile_fx(gm, example_inputs, inner_compile=inner_compile,
                          config_patches={"custom_partitioner_fn": partitioner,
                                          **({"reorder_for_peak_memory": False} if keep_graph_order else {})})


def compile_with_aot_eager(gm, example_inputs, partitioner, on_inference=None, debug_checks=False,
                           lowerings=(), watch=None):
    """AOTAutograd with our partitioner; the forward and backward graphs run op by op.

    ``on_inference(graph_module)`` rewrites an inference graph (no autograd) before it runs.
    Graphs run as FX's generated Python code in the boxed calling convention
    (``_torch_compat.boxed_python_code``), which drops each value, inputs included, after its
    last use, so a gathered stage-3 parameter is freed right after its last use, as with
    inductor, with no interpreter between the ops (``torch.fx.Interpreter`` added a few
    percent to a 40M-parameter GPT's forward on this project's machine).
    ``debug_checks``: run them through ``CheckedInterpreter`` instead (slower; see there).
    ``lowerings``, ``watch``: as for ``compile_with_inductor``.
    """
    def boxed(graph, _inputs, kind="forward"):
        graph = runnable(graph, lowerings, watch, kind)
        if debug_checks:
            interpreter = CheckedInterpreter(graph, garbage_collect_values=True)

            def execute(args):
                try:
                    return interpreter.boxed_run(args)
                finally:
                    # the interpreter keeps its last environment (the outputs, i.e. saved
                    # activations or gradients) until the next run: drop it now
                    interpreter.env = {}
        else:
            execute = _torch_compat.boxed_python_code(graph)

        def run(args):
            # under ``zerocompile plan`` a run identical to an earlier one is replayed, not rerun
            replay = graph_replay.active()
            return execute(args) if replay is None else replay.run(graph, execute, args)

        run._boxed_call = True
        return run

    def inference(graph, inputs):
        return boxed(on_inference(graph) if on_inference is not None else graph, inputs, "inference")

    with _torch_compat.without_autograd_cache():
        return _torch_compat.aot_autograd(fw_compiler=boxed, bw_compiler=functools.partial(boxed, kind="backward"),
                                          inference_compiler=inference,
                                          partition_fn=partitioner, keep_inference_input_mutations=True)(
            gm, example_inputs)


def runnable(gm: torch.fx.GraphModule, lowerings=(), watch=None, kind: str = "forward") -> torch.fx.GraphModule:
    """``gm`` with its collectives in the form that is safe to run on their process group's
    backend (``runtime/comm.py``: all-gathers on gloo), checked; what both inner compilers get.
    Each of ``lowerings(graph)`` then rewrites it (returning how many nodes it added), and last
    ``watch(graph, kind)`` (``kind``: ``forward``, ``backward`` or ``inference``) puts the
    collective watchdog's ops in place of the collectives (``passes/lowerings/watch_collectives.py``)."""
    changed = lower_collectives_for_backend(gm.graph)
    for lowering in lowerings:
        changed += lowering(gm.graph)
    if watch is not None:
        changed += watch(gm.graph, kind)
    if changed:
        gm.graph.lint()
        gm.recompile()
    check_collectives_runnable(gm.graph)
    return gm


class CheckedInterpreter(torch.fx.Interpreter):
    """``torch.fx.Interpreter`` with the checks of the ``debug_checks`` option, each raising a
    Python error that names the graph node instead of crashing in native code:

    - before every op, no tensor argument has a storage smaller than its size, stride and
      offset require (a storage freed with ``untyped_storage().resize_(0)``, e.g. a stage-3
      parameter, read by an op would be a use-after-free);
    - every functional collective the graph starts is waited for before the graph returns.
    """

    def run(self, *args, **kwargs):
        pending = _torch_compat.pending_collectives()
        out = super().run(*args, **kwargs)
        left = _torch_compat.pending_collectives() - pending
        if left > 0:
            raise RuntimeError(
                f"zerocompile debug_checks: graph returned with {left} collective(s) started and not "
                "waited for (every all_gather/reduce_scatter/all_reduce needs its wait_tensor in the "
                "same graph); a pass moved or dropped a wait")
        return out

    def run_node(self, n: torch.fx.Node):
        if n.op == "call_function":
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            sources = {id(self.env[i]): i.name for i in n.all_input_nodes if i in self.env}
            if _reads_no_storage(n):
                args = args[1:]
            for value in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(value, torch.Tensor):
                    _check_storage_covers(value, n, sources.get(id(value), "an argument"))
        return super().run_node(n)


def _reads_no_storage(node: torch.fx.Node) -> bool:
    """The node's first argument is a shard whose values the op reads from a file, not from its
    (freed) storage: ``zerocompile::fetch_shard`` (``runtime/param_offload.py``)."""
    return node.target is param_offload.fetch_shard or node.target is torch.ops.zerocompile.fetch_shard.default


def _check_storage_covers(t: torch.Tensor, node: torch.fx.Node, name: str) -> None:
    if t.layout is not torch.strided or t.is_meta or t.numel() == 0:
        return
    try:
        have = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # no storage (wrapper subclass)
        return
    last = t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    need = (last + 1) * t.element_size()
    if have < need:
        raise RuntimeError(
            f"zerocompile debug_checks: node '{node.name}' ({node.format_node()}) reads '{name}' "
            f"(shape {tuple(t.shape)}, stride {t.stride()}, offset {t.storage_offset()}, {t.dtype}), "
            f"which needs {need} bytes of storage, but its storage holds {have}: it was freed or "
            "shrunk (untyped_storage().resize_) while the graph still uses it")
