"""The private torch APIs zerocompile depends on, in one package, a module per torch area:

- ``compile``: AOTAutograd, inductor and their caches;
- ``dynamo``: Dynamo's sources, frames, tracing context, config and errors, and the modules that
  called a compiled frame;
- ``tensors``: tracing stand-ins, tensor subclasses, dispatch modes, storages, the profiler;
- ``autograd``: autograd's engine and nodes, version counters, ``Module.state_dict``'s and
  ``zero_grad``'s callers;
- ``amp``: ``torch.amp.GradScaler``;
- ``optim``: torch.optim's step wrapper (hooks, profiler range);
- ``c10d``: process groups, works and stores.

Everything is re-exported here, so the package is used as ``_torch_compat.name``. Each function
says why it needs a private API. ``tests/test_torch_compat.py`` exercises every one of them
directly, so a torch upgrade that changes them fails there, loudly, rather than somewhere deep in
a training run.
"""

from zerocompile._torch_compat.c10d import (  # noqa: F401  (re-exported)
    DEFAULT_GROUP_TIMEOUT_S, collective_backend, group_timeout_s, init_fake_process_group, pending_collectives,
    new_default_store_client, process_group_function_modules, process_group_named, register_pending,
    register_pending_works, register_work)
from zerocompile._torch_compat.compile import (  # noqa: F401  (re-exported)
    PartitionerBase, min_cut_partition, without_autograd_cache, autograd_cache, autograd_cache_bypass_reason,
    compile_caches_enabled, inductor_cache_dir, inductor_compilers, aot_autograd, boxed_python_code)
from zerocompile._torch_compat.dynamo import (  # noqa: F401  (re-exported)
    modules_calling, fake_mode_of, placeholder_source, source_path, param_fqn, input_kind, frame_root_object, root_module,
    inside_dynamo_trace, dynamo_fake_mode, as_in_dynamo_compile, never_a_frame,
    trace_checkpointed_regions_with_side_effects, passed_through_dynamo)
from zerocompile._torch_compat.tensors import (  # noqa: F401  (re-exported)
    is_traced_tensor, is_graph_value, real_tensors, is_fake_tensor, storage_owners, active_dispatch_modes,
    plain_tensor_ops, storageless_tensor, is_higher_order_op, rng_wrapped_op, op_run_by, no_dispatch,
    profiled_allocations)
from zerocompile._torch_compat.autograd import (  # noqa: F401  (re-exported)
    called_from_module_state_dict, called_from_zero_grad, inside_call_of, held_by_autograd, preserving_version, queue_end_of_backward,
    is_compiled_backward_node, compiled_backward_node)
from zerocompile._torch_compat.amp import (  # noqa: F401  (re-exported)
    grad_scaler_state, grad_scaler_scale, grad_scaler_stages, unscale_and_check_)
from zerocompile._torch_compat.optim import (  # noqa: F401  (re-exported)
    step_with_hooks, profiler_enabled, run_step)
