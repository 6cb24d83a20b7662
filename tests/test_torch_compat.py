"""The private torch APIs zerocompile uses (zerocompile/_torch_compat.py). If a torch upgrade
changes them, these tests fail first and say which one."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from zerocompile import _torch_compat


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    def forward(self, x):
        return self.blocks[0](x).sum()


def test_placeholder_sources_names_and_root_module_from_a_dynamo_compile():
    seen = {}
    model = Outer()

    def backend(gm, example_inputs, **_):
        for node, ex in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
            source = _torch_compat.placeholder_source(node)
            assert source is not None, "Dynamo no longer records node.meta['grapharg'].source"
            if isinstance(ex, torch.nn.Parameter):
                seen[_torch_compat.param_fqn(source)] = _torch_compat.root_module(source)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(torch.randn(3, 2))
    assert set(seen) == {"blocks.0.weight", "blocks.0.bias"}, seen
    assert all(root is model for root in seen.values()), "InstructionTranslator.current_tx().f_locals changed"


def test_a_backend_compiles_on_the_callers_stack_so_the_calling_modules_are_found():
    """Dynamo compiles a block's frame on the stack of the model whose ``forward`` called it:
    ``modules_calling`` finds the model from the backend (a model compiled block by block is one
    model)."""
    seen = []

    class Block(torch.nn.Module):          # a frame of torch.nn's own code is not compiled
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.linear(x).relu()

    def backend(gm, example_inputs, **_):
        seen.append(_torch_compat.modules_calling([model.blocks[0]]))
        return gm.forward

    model = Outer()
    model.blocks[0] = Block()
    torch._dynamo.reset()
    model.blocks[0].compile(backend=backend)
    model(torch.randn(3, 2))
    assert seen and any(m is model for m in seen[0]), \
        "Dynamo no longer compiles a frame on its caller's stack (the model's forward is not below the backend)"
    assert _torch_compat.modules_calling([torch.nn.Linear(1, 1)]) == []
    torch._dynamo.reset()


def test_inside_call_of_sees_a_models_call_compiled_or_not_and_its_graph_breaks():
    """Eager code a graph break leaves inside a compiled model's call (``torch.compile(model)``
    or ``model.compile()``) runs with the model's ``Module.__call__`` frames on the stack; after
    the call returns they are gone."""
    seen = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

        def forward(self, x):
            y = self.linear(x)
            torch._dynamo.graph_break()
            seen.append(_torch_compat.inside_call_of([self]))
            return y.sum()

    for how in ("eager", "torch.compile", "model.compile"):
        torch._dynamo.reset()
        model = Model()
        if how == "model.compile":
            model.compile(backend="eager")
            call = model
        else:
            call = torch.compile(model, backend="eager") if how == "torch.compile" else model
        seen.clear()
        call(torch.randn(3, 2))
        assert seen == [True], (how, seen)
        assert not _torch_compat.inside_call_of([model])
    torch._dynamo.reset()


def test_zero_grad_of_modules_and_optimizers_reads_each_grad_itself():
    """``nn.Module.zero_grad`` and ``torch.optim.Optimizer.zero_grad`` read ``p.grad`` from a
    frame named ``zero_grad`` (what a ``ZeroParameter``'s ``grad`` answers with the tensor that
    holds the gradient); another reader is not one."""
    seen = []

    class Recording(torch.nn.Parameter):
        @property
        def grad(self):
            seen.append(_torch_compat.called_from_zero_grad())
            return torch._C.TensorBase.grad.__get__(self)

        @grad.setter
        def grad(self, value):
            torch._C.TensorBase.grad.__set__(self, value)

    layer = torch.nn.Linear(2, 2)
    layer.weight = Recording(layer.weight.detach())
    layer(torch.randn(1, 2)).sum().backward()
    layer.zero_grad()
    torch.optim.SGD(layer.parameters(), lr=0.1).zero_grad()
    assert seen and all(seen), "Module.zero_grad / Optimizer.zero_grad no longer read p.grad themselves"
    assert layer.weight.grad is None and seen[-1] is False


def test_root_object_outside_a_compile_is_none():
    assert _torch_compat.frame_root_object("self") is None


def test_inductor_custom_partitioner_hook_and_autograd_cache_switch_exist():
    from torch._inductor import config

    assert hasattr(config, "custom_partitioner_fn"), "inductor dropped config.custom_partitioner_fn"
    assert hasattr(torch._functorch.config, "enable_autograd_cache")
    assert callable(getattr(_torch_compat.PartitionerBase, "uuid", None))


def test_min_cut_partition_honours_recompute_tags():
    from functorch.compile import aot_function, make_boxed_func
    from torch.utils.checkpoint import CheckpointPolicy

    graphs = {}

    def partition(joint, inputs, **kwargs):
        for node in joint.graph.nodes:
            if node.target is torch.ops.aten.cos.default:
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                node.meta["ac_graph_id"] = 100000
        fw, bw = _torch_compat.min_cut_partition(joint, inputs, **kwargs)
        graphs["bw"] = bw
        return fw, bw

    def boxed(graph, _inputs):
        return make_boxed_func(graph.forward)

    fn = aot_function(lambda x: (x.cos() * x).sum(), fw_compiler=boxed, bw_compiler=boxed, partition_fn=partition)
    fn(torch.randn(4, requires_grad=True)).backward()
    assert any(n.target is torch.ops.aten.cos.default for n in graphs["bw"].graph.nodes), \
        "the partitioner no longer recomputes MUST_RECOMPUTE nodes in backward"


def test_fake_process_group_of_n_ranks():
    import pytest
    import torch.distributed as dist

    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        _torch_compat.init_fake_process_group(0)
    _torch_compat.init_fake_process_group(8)
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (0, 8)
        c10d = torch.ops._c10d_functional
        out = c10d.wait_tensor(c10d.all_gather_into_tensor(torch.arange(3.0), 8, dist.group.WORLD.group_name))
        assert out.shape == (24,), "the fake group's all-gather no longer returns world_size x the input"
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def test_process_group_functions_live_in_torch_distributed_and_distributed_c10d():
    """``zerocompile.script_runner`` replaces ``init_process_group`` and
    ``destroy_process_group`` in these modules (tests/test_cli.py runs it): each must hold
    them, the same function under both names."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    modules = _torch_compat.process_group_function_modules()
    assert modules == (dist, distributed_c10d)
    for name in ("init_process_group", "destroy_process_group"):
        assert getattr(dist, name) is getattr(distributed_c10d, name), \
            f"torch.distributed.{name} is no longer distributed_c10d.{name}"


def test_dcp_saves_and_loads_through_the_checkpointable_protocol(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    from zerocompile.runtime.dcp_shards import ShardView

    full = torch.arange(35.0).view(5, 7)
    view = _torch_compat.storageless_tensor(ShardView, (5, 7), torch.float32, torch.device("cpu"))
    assert (view.shape, view.dtype, type(view)) == ((5, 7), torch.float32, ShardView)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # "assuming the intent is to save in a single process"
        dcp.save({"w": ShardView(full.reshape(-1).clone(), (5, 7), 0)}, checkpoint_id=str(tmp_path), no_dist=True)
        # elements [3, 30): three boxes (the end of row 0, rows 1-3, the start of row 4)
        flat = torch.zeros(27)
        dcp.load({"w": ShardView(flat, (5, 7), 3)}, checkpoint_id=str(tmp_path), no_dist=True)
        whole = torch.zeros(5, 7)
        dcp.load({"w": whole}, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(flat, full.reshape(-1)[3:30]), \
        "DCP no longer loads through __create_chunk_list__ / __get_tensor_shard__"
    assert torch.equal(whole, full), "DCP no longer saves through __create_write_items__"


def test_module_state_dict_detaches_each_parameter_in_save_to_state_dict():
    """``Module.state_dict()`` takes ``param.detach()`` inside ``_save_to_state_dict`` (what a
    freed ``ZeroParameter`` answers with its sharded value)."""
    seen = []

    class Recording(torch.nn.Parameter):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "detach":
                seen.append(_torch_compat.called_from_module_state_dict())
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    layer = torch.nn.Linear(2, 2)
    layer.weight = Recording(layer.weight.detach())
    layer.state_dict()
    assert seen == [True], "Module.state_dict() no longer calls param.detach() in _save_to_state_dict"
    layer.weight.detach()
    assert seen == [True, False]


def test_plain_tensor_ops_skips_subclass_torch_function():
    calls = []

    class Spy(torch.nn.Parameter):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            calls.append(func)
            with _torch_compat.plain_tensor_ops():
                return func(*args, **(kwargs or {}))

    p = Spy(torch.ones(3))
    assert p.sum().item() == 3 and calls
    calls.clear()
    with _torch_compat.plain_tensor_ops():
        assert p.sum().item() == 3
    assert calls == [], "DisableTorchFunctionSubclass no longer bypasses __torch_function__"


def test_inside_dynamo_trace_is_true_only_while_dynamo_compiles():
    seen = []

    def backend(gm, example_inputs):
        seen.append(_torch_compat.inside_dynamo_trace())
        return gm

    assert not _torch_compat.inside_dynamo_trace()
    torch._dynamo.reset()
    torch.compile(lambda x: x + 1, backend=backend)(torch.ones(2))
    assert seen == [True], "torch._guards.TracingContext is no longer set during a Dynamo compile"


def test_a_compile_run_again_traces_in_dynamos_fake_mode_with_the_callers_modes_off():
    """``FrameRunner.recompile`` compiles a frame's graph again after Dynamo is done: it needs the
    fake mode Dynamo traced with (``dynamo_fake_mode``), and AOTAutograd must find that mode, not
    one the caller has active (plan's), nor see the caller's dispatch modes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

    modes = []

    def backend(gm, example_inputs):
        modes.append(_torch_compat.dynamo_fake_mode())
        return gm

    assert _torch_compat.dynamo_fake_mode() is None
    torch._dynamo.reset()
    torch.compile(lambda x: x * 2, backend=backend)(torch.ones(2))
    dynamo_mode = modes[0]
    assert isinstance(dynamo_mode, FakeTensorMode), "TracingContext.fake_mode is no longer Dynamo's fake mode"

    class Caller(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    callers = FakeTensorMode()
    with callers, Caller():
        with _torch_compat.as_in_dynamo_compile(dynamo_mode):
            assert _get_current_dispatch_mode_stack() == [], "_disable_current_modes no longer clears the stack"
            assert torch._guards.detect_fake_mode() is dynamo_mode, "AOTAutograd would not find Dynamo's mode"
        assert len(_get_current_dispatch_mode_stack()) == 2      # the caller's modes are back


def test_custom_node_meta_reaches_the_joint_graph_forward_and_backward():
    """``passes/analyses/param_identity.py`` relies on AOTAutograd copying ``node.meta["custom"]`` of a
    Dynamo-graph node to the nodes traced from it, and to their backward (by ``seq_nr``)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition

    joint = {}

    def partition(graph, inputs, **kwargs):
        joint["gm"] = graph
        return default_partition(graph, inputs, **kwargs)

    def backend(gm, example_inputs):
        node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.tanh)
        node.meta["custom"] = {"zerocompile_param": {"index": 0, "name": "w"}}
        boxed = lambda g, _: make_boxed_func(g.forward)  # noqa: E731
        return aot_autograd(fw_compiler=boxed, bw_compiler=boxed, partition_fn=partition)(gm, example_inputs)

    torch._dynamo.reset()
    fn = torch.compile(lambda x, w: (x * torch.tanh(w)).sum(), backend=backend)
    fn(torch.randn(3), torch.randn(3, requires_grad=True)).backward()
    marked = {n.target for n in joint["gm"].graph.nodes if "zerocompile_param" in (n.meta.get("custom") or {})}
    aten = torch.ops.aten
    assert aten.tanh.default in marked, "node.meta['custom'] no longer reaches the traced forward nodes"
    assert aten.tanh_backward.default in marked, "node.meta['custom'] no longer reaches the backward nodes"


def test_collective_backend_group_timeout_pending_collectives_and_traced_tensors():
    import datetime
    import socket

    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        name = dist.group.WORLD.group_name
        assert _torch_compat.collective_backend(name, torch.device("cpu")) == "gloo"
        assert _torch_compat.collective_backend("no such group", "cpu") is None
        assert _torch_compat.process_group_named(name) is dist.group.WORLD, "functional group names no longer resolve"
        assert _torch_compat.group_timeout_s(dist.group.WORLD) == 30.0, "a gloo group's timeout is no longer readable"
        c10d = torch.ops._c10d_functional
        before = _torch_compat.pending_collectives()
        out = c10d.all_reduce(torch.ones(2), "sum", name)
        assert _torch_compat.pending_collectives() == before + 1, "the work registry no longer counts a started collective"
        c10d.wait_tensor(out)
        assert _torch_compat.pending_collectives() == before
        # the collective watchdog's store clients: a second client of the default store sees its keys
        client = _torch_compat.new_default_store_client(5.0)
        assert client is not None, "the default group's store is no longer reachable as a TCPStore"
        client.set("zerocompile-test/key", "value")
        assert _torch_compat.new_default_store_client().get("zerocompile-test/key") == b"value"
    finally:
        dist.destroy_process_group()
    assert not _torch_compat.is_traced_tensor(torch.ones(1))
    with FakeTensorMode() as mode:
        assert _torch_compat.is_traced_tensor(mode.from_tensor(torch.ones(1)))
        assert _torch_compat.is_graph_value(mode.from_tensor(torch.ones(1)))
    seen = []
    make_fx(lambda x: seen.append((_torch_compat.is_traced_tensor(x), _torch_compat.is_graph_value(x))) or x + 1)(
        torch.ones(1))
    assert seen == [(True, True)], "make_fx tracing of plain tensors is no longer detected"
    assert not _torch_compat.is_graph_value(torch.ones(1))


def test_an_error_passed_through_dynamo_reaches_the_caller_unwrapped():
    from zerocompile.errors import CollectiveMismatchError

    def backend(gm, inputs):
        raise _torch_compat.passed_through_dynamo(CollectiveMismatchError("parted", {0: None}, "the cause"))

    torch._dynamo.reset()
    with pytest.raises(CollectiveMismatchError, match="^parted") as err:
        torch.compile(lambda x: x * 2, backend=backend)(torch.ones(2))
    assert err.value.cause == "the cause" and err.value.reports == {0: None}
    assert type(err.value).__name__ == "CollectiveMismatchError", "Dynamo wrapped the backend's error"
    torch._dynamo.reset()


def test_register_work_makes_wait_tensor_call_a_python_work():
    waited = []

    class Work(torch._C._distributed_c10d.Work):
        def wait(self, timeout=None):
            waited.append(timeout)
            return True

    out = torch.ones(2)
    _torch_compat.register_work(out, Work())
    torch.ops._c10d_functional.wait_tensor(out)
    assert len(waited) == 1, "wait_tensor no longer calls a registered Python Work's wait"


def test_register_pending_makes_wait_tensor_wait_and_raise():
    """``wait_tensor`` of a tensor registered with a future returns once another thread has
    filled it and completed the future, and raises the error the future was set with."""
    import threading
    import time

    wait = torch.ops._c10d_functional.wait_tensor
    t, done = torch.zeros(3), torch.futures.Future()
    _torch_compat.register_pending(t, done)
    assert _torch_compat.pending_collectives() >= 1

    def fill():
        time.sleep(0.1)
        t.fill_(5.0)
        done.set_result(None)

    threading.Thread(target=fill).start()
    assert torch.equal(wait(t), torch.full((3,), 5.0)), "wait_tensor no longer waits for a registered Work"
    u, failed = torch.zeros(3), torch.futures.Future()
    _torch_compat.register_pending(u, failed)
    threading.Thread(target=lambda: failed.set_exception(OSError("the read failed"))).start()
    with pytest.raises(OSError, match="the read failed"):
        wait(u)


def test_register_pending_works_makes_wait_tensor_wait_for_each():
    """``wait_tensor`` of a tensor registered with several ``Work``s waits for every one."""
    class Recorded(torch._C._distributed_c10d.Work):
        def __init__(self, log, name):
            super().__init__()
            self.log, self.name = log, name

        def wait(self, timeout=None):
            self.log.append(self.name)
            return True

    log, t = [], torch.zeros(2)
    _torch_compat.register_pending_works(t, [Recorded(log, "a"), Recorded(log, "b")])
    torch.ops._c10d_functional.wait_tensor(t)
    assert log == ["a", "b"], "wait_tensor no longer calls a registered Python Work's wait"
    # several tensors filled by the same transfers: the first wait waits for each once, the
    # others find them done (a gloo send waited for twice blocks)
    log, many = [], [torch.zeros(2), torch.zeros(3), torch.zeros(4)]
    _torch_compat.register_pending_works(many, [Recorded(log, "a"), Recorded(log, "b")], then=lambda: log.append("then"))
    for t in many[::-1]:
        torch.ops._c10d_functional.wait_tensor(t)
    assert log == ["a", "b", "then"], log


def test_profiled_allocations_has_every_allocation_and_free_with_its_block_and_op():
    """What ``AllocatorPeak`` reads from the profiler: each allocation and free of the CPU allocator,
    in order, with its size, its block's address and the op that made it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.empty(1 << 20)
        b = torch.ones(1 << 18)
        del a
        c = b * 2
        del b, c
    events = [e for e in _torch_compat.profiled_allocations(prof) if abs(e[1]) >= 1 << 18]
    assert [e[1] for e in events] == [4 << 20, 1 << 20, -(4 << 20), 1 << 20, -(1 << 20), -(1 << 20)], events
    assert [e[0] for e in events] == sorted(e[0] for e in events)
    assert events[0][2] == events[2][2] and events[0][3] == "aten::empty", events
    assert events[3][3] == "aten::mul" and {events[4][2], events[5][2]} == {events[1][2], events[3][2]}, events


def test_never_a_frame_skips_the_frame_and_keeps_the_inlining():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @_torch_compat.never_a_frame
    def marked(x):
        return torch.sin(x) * 2

    def unmarked(x):
        return torch.sin(x) * 2

    def looping(fn):
        def outer(x):
            for _ in range(2):       # a graph break in a loop: Dynamo skips outer, runs it eagerly
                x = fn(x)
                torch._dynamo.graph_break()
            return x
        return outer

    x = torch.randn(3)
    torch._dynamo.reset()
    torch.compile(looping(unmarked), backend=backend)(x)
    assert len(graphs) == 1          # the control: called from eager code, a function is a frame
    graphs.clear()
    torch._dynamo.reset()
    out = torch.compile(looping(marked), backend=backend)(x)
    assert graphs == [] and torch.allclose(out, torch.sin(torch.sin(x) * 2) * 2)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    out = torch.compile(lambda t: marked(t) + 1, backend=backend)(x)
    assert len(graphs) == 1 and not counters["graph_break"]     # inlined into the traced frame
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.sin in targets and torch.allclose(out, torch.sin(x) * 2 + 1)


def test_held_by_autograd_sees_every_holder_a_graph_keeps():
    """``held_by_autograd`` reads ``Tensor._use_count()``: a parameter alone, detached or used
    without grad is held by nothing; the ``AccumulateGrad`` node of a graph that used it, a saved
    frozen weight and the base of a saved view each hold it until the graph is gone."""
    param = torch.nn.Parameter(torch.randn(4, 3))
    frozen = torch.nn.Parameter(torch.randn(4, 3), requires_grad=False)
    x = torch.randn(2, 3, requires_grad=True)
    assert not _torch_compat.held_by_autograd(param)
    with torch.no_grad():
        torch.nn.functional.linear(x, param)
    detached, storage = param.detach(), param.untyped_storage()
    assert not _torch_compat.held_by_autograd(param)
    rows = torch.nn.functional.embedding(torch.tensor([0, 2]), param)   # saves no weight: AccumulateGrad
    assert _torch_compat.held_by_autograd(param)
    rows.sum().backward()
    del rows
    assert not _torch_compat.held_by_autograd(param)
    out = torch.nn.functional.linear(x, frozen)                         # a saved frozen weight
    assert _torch_compat.held_by_autograd(frozen)
    del out
    view_out = x @ frozen.t()                                           # a saved view of it
    assert _torch_compat.held_by_autograd(frozen)
    del view_out
    assert not _torch_compat.held_by_autograd(frozen) and detached is not None and storage is not None


def test_grad_scaler_hands_unscaling_to_an_optimizer_that_takes_grad_scaler():
    """ZeroOptimizer relies on GradScaler's contract with ``_step_supports_amp_scaling``
    optimizers: step(grad_scaler=scaler) is called, the optimizer records what it found in the
    scaler's per-optimizer state, and update() reads it from there."""
    ready, unscaled, stepped = _torch_compat.grad_scaler_stages()
    seen = {}

    class Opt(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            state = _torch_compat.grad_scaler_state(grad_scaler, self)
            seen["stage"] = state["stage"]
            seen["scale"] = _torch_compat.grad_scaler_scale(grad_scaler).item()
            state["found_inf_per_device"] = {torch.device("cpu"): torch.ones(())}
            state["stage"] = unscaled

    p = torch.nn.Parameter(torch.ones(2))
    opt = Opt([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(p.sum()).backward()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        scaler.step(opt)
    assert seen == {"stage": ready, "scale": 8.0}, "GradScaler no longer passes grad_scaler= to step"
    assert _torch_compat.grad_scaler_state(scaler, opt)["stage"] is stepped
    scaler.update()
    assert scaler.get_scale() == 4.0, "GradScaler.update() no longer reads found_inf_per_device"


def test_unscale_and_check_and_compiled_backward_node():
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf")])]
    found = torch.zeros(())
    _torch_compat.unscale_and_check_(grads, found, torch.full((), 0.5))
    assert grads[0].tolist() == [1.0, 2.0] and found.item() == 1.0
    from functorch.compile import aot_function, nop

    out = aot_function(lambda x: (x * 2).sum(), fw_compiler=nop)(torch.ones(2, requires_grad=True))
    assert _torch_compat.is_compiled_backward_node(out.grad_fn), out.grad_fn.name()
    assert not _torch_compat.is_compiled_backward_node((torch.ones(1, requires_grad=True) * 2).grad_fn)


def test_real_tensors_steps_out_of_an_active_fake_mode():
    """The profile times ops inside AOTAutograd's partitioner, which runs under a FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert _torch_compat.is_fake_tensor(torch.empty(2))
        with _torch_compat.real_tensors():
            t = torch.ones(2) * 3
            assert not _torch_compat.is_fake_tensor(t), "unset_fake_temporarily no longer leaves the fake mode"
            assert t.tolist() == [3.0, 3.0]
        assert _torch_compat.is_fake_tensor(torch.empty(2))                # and the mode is back


def test_storage_owners_and_active_dispatch_modes():
    """graph_replay keys a run by the owners of each input's storage, and finds itself among
    the active dispatch modes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    t = torch.empty(4)
    storage = t.untyped_storage()
    owners = _torch_compat.storage_owners(storage)
    view = t[1:]
    assert _torch_compat.storage_owners(storage) == owners + 1, "_storage_Use_Count no longer counts tensors"
    del view
    assert _torch_compat.storage_owners(storage) == owners

    class Marker(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    marker = Marker()
    assert marker not in _torch_compat.active_dispatch_modes()
    with marker:
        assert any(m is marker for m in _torch_compat.active_dispatch_modes()), \
            "_get_current_dispatch_mode_stack no longer lists the active modes"
    assert marker not in _torch_compat.active_dispatch_modes()


def test_checkpointed_region_with_a_side_effect_compiles_as_one_graph():
    """With zerocompile loaded, a ``torch.utils.checkpoint`` region whose Python code sets and
    resets an outside object's attribute (what HF's ``kernels`` wrapper does in attention) is one
    graph with the checkpoint higher-order op, not a graph break that runs it eagerly."""
    import zerocompile.backend  # noqa: F401 - loading the backend sets Dynamo's switch

    assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint is True

    class Holder:
        value = None

    holder = Holder()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def _body(self, x):
            old, holder.value = holder.value, "inside"
            try:
                return torch.relu(self.lin(x))
            finally:
                holder.value = old

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self._body, x, use_reentrant=False).sum()

    graphs = []

    def backend(gm, example_inputs, **_):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(Block(), backend=backend)(torch.randn(2, 3, requires_grad=True)).backward()
    assert len(graphs) == 1, f"{len(graphs)} graphs: the checkpointed region did not trace"
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert any("tag_activation_checkpoint" in t for t in targets), targets
    assert holder.value is None


def test_rng_higher_order_ops_reach_a_mode_that_supports_them():
    """A dispatch mode with ``supports_higher_order_operators`` receives activation
    checkpointing's ``run_and_save_rng_state`` (torch's name and argument order), which
    ``op_run_by`` unwraps; other calls are not higher-order ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Mode(TorchDispatchMode):
        supports_higher_order_operators = True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if _torch_compat.is_higher_order_op(func):
                seen.append(_torch_compat.op_run_by(func, args, kwargs or {}, out))
            return out

    x = torch.randn(4)
    with Mode():
        state, y = torch.ops.higher_order.run_and_save_rng_state(torch.ops.aten.rand_like.default, x)
        torch.ops.higher_order.run_with_rng_state(state, torch.ops.aten.rand_like.default, x)
    assert [s[0] for s in seen] == [torch.ops.aten.rand_like.default] * 2, seen
    assert seen[0][1][0] is x and seen[0][3] is y and seen[1][1][0] is x
    assert not _torch_compat.is_higher_order_op(torch.ops.aten.add.Tensor)
    assert _torch_compat.op_run_by(torch.ops.higher_order.tag_activation_checkpoint, (), {}, None) is None


def test_autograd_cache_refuses_our_functions_unless_vouched_for(tmp_path, monkeypatch):
    """``autograd_cache`` is how AOTAutograd's cache accepts graphs that call
    ``runtime/param_ops.py``'s functions (zerocompile/compile_cache.py); if torch renames the
    config or the check, restarts silently compile cold: this fails instead."""
    from zerocompile.runtime.param_ops import gather_param

    graph = torch.fx.Graph()
    graph.output(graph.call_function(gather_param, (graph.placeholder("shard"), 6, (2, 3), torch.float32,
                                                    torch.float32, 2, "0")))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    reason = _torch_compat.autograd_cache_bypass_reason(gm)
    assert reason is not None and "gather_param" in reason, reason
    with _torch_compat.autograd_cache({"zerocompile.runtime.param_ops.gather_param": "digest"}):
        assert _torch_compat.autograd_cache_bypass_reason(gm) is None
    assert _torch_compat.autograd_cache_bypass_reason(gm) is not None
    assert _torch_compat.compile_caches_enabled()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "c"))
    assert _torch_compat.inductor_cache_dir() == str(tmp_path / "c")


def test_boxed_python_code_empties_the_input_list_and_drops_each_value_after_its_last_use():
    """``inner_compiler="eager"`` runs its graphs as FX's generated code in the boxed calling
    convention (``torch.fx.graph._BoxedCodeGen``): the inputs list is emptied, and an input is
    freed right after its last use, while the graph still runs (a stage-3 parameter gathered
    and used early must not live to the end)."""
    import weakref

    seen = {}

    def probe(x):
        gc_ref = seen["ref"]
        seen["alive_at_probe"] = gc_ref() is not None
        return x * 2

    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    first = graph.call_function(torch.add, (a, 1))          # a's last use
    later = graph.call_function(probe, (b,))
    graph.output(graph.call_function(torch.add, (first, later)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    code = _torch_compat.boxed_python_code(gm)
    x, y = torch.ones(3), torch.full((3,), 2.0)
    seen["ref"] = weakref.ref(x)
    args = [x, y]
    del x
    out = code(args)
    assert args == [], "the boxed code no longer empties its inputs list"
    assert seen["alive_at_probe"] is False, "the generated code no longer drops an input after its last use"
    assert torch.equal(out, torch.full((3,), 6.0))


def test_preserving_version_keeps_the_version_counter():
    """ShardedParam.materialize writes gathered values into a parameter an autograd graph saved."""
    from zerocompile import _torch_compat

    w = torch.randn(3, requires_grad=True)
    out = (w * w).sum()          # saves w
    before = w._version
    with torch.no_grad(), _torch_compat.preserving_version(w):
        w.copy_(w.detach().clone())
    assert w._version == before
    out.backward()               # would raise "modified by an inplace operation" otherwise
    assert w.grad is not None


def test_queue_end_of_backward_runs_after_the_backward():
    from zerocompile import _torch_compat

    order = []
    w = torch.randn(3, requires_grad=True)
    y = w * 2
    def hook(grad):
        _torch_compat.queue_end_of_backward(lambda: order.append("end"))
        order.append("hook")

    y.register_hook(hook)
    w.register_post_accumulate_grad_hook(lambda p: order.append("accumulated"))
    y.sum().backward()
    assert order == ["hook", "accumulated", "end"]


def test_step_with_hooks_leaves_the_step_unwrapped_and_runs_torchs_hooks():
    """torch's ``Optimizer`` leaves a ``step`` marked by ``step_with_hooks`` as it is (its
    ``hooked`` attribute), the global and the optimizer's own step hooks are where ``run_step``
    reads them, and ``profiler_enabled`` says whether a profiler records."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    from torch.profiler import profile

    class Marked(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        @_torch_compat.step_with_hooks
        def step(self, closure=None):
            calls.append("step")

    marked = Marked.step
    calls = []
    opt = Marked([torch.nn.Parameter(torch.zeros(1))])
    assert Marked.step is marked, "torch's Optimizer wrapped a step marked hooked"
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global pre")),
               register_optimizer_step_post_hook(lambda o, a, k: calls.append("global post"))]
    try:
        opt.step()
    finally:
        for h in handles:
            h.remove()
    assert calls == ["global pre", "pre", "step", "post", "global post"], calls
    # with no hook and no profiler the step runs alone (run_step's short path); one hook of any
    # of the four kinds takes the whole path again
    calls.clear()
    bare = Marked([torch.nn.Parameter(torch.zeros(1))])
    bare.step()
    assert calls == ["step"], calls
    handle = register_optimizer_step_post_hook(lambda o, a, k: calls.append("global post"))
    try:
        bare.step()
    finally:
        handle.remove()
    assert calls == ["step", "step", "global post"], calls
    assert not _torch_compat.profiler_enabled()
    with profile():
        assert _torch_compat.profiler_enabled()
    assert not _torch_compat.profiler_enabled()
