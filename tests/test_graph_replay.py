"""``zerocompile.graph_replay``: ``zerocompile plan`` replays graph runs identical to an earlier
one instead of executing them. Its figures must be exactly those of executing every run: the
zoo below is planned both ways, each in a fresh process, and every figure compared; the replay's own
checks (which graphs it may skip, a replay whose inputs die differently) are tested directly."""

from __future__ import annotations

import json
import operator
import os
import textwrap
from pathlib import Path
from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dist_utils import cli_child, start_cli, start_fresh
from zerocompile.graph_replay import GraphReplay, replayable_graph
from zerocompile.plan import StepTimer
from zerocompile.passes.analyses.cost_model import CostModel
from zerocompile.runtime.memory_tracker import LiveStorageTracker

REPO = Path(__file__).resolve().parent.parent

# Blocks of two sizes, alternating; each block has a graph break in the middle (two frames per
# block); the script keeps every block's output (as HF's output_hidden_states does), and, at
# one block, an eager op saves a block's input for backward (a reference only C++ holds).
STACK = textwrap.dedent("""
    import datetime, json, sys
    import torch, torch.distributed as dist
    import zerocompile
    options = json.loads(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    class Block(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.up, self.down = torch.nn.Linear(48, width), torch.nn.Linear(width, 48)
            self.norm = torch.nn.LayerNorm(48)
        def forward(self, x):
            h = torch.relu(self.up(self.norm(x)))
            torch._dynamo.graph_break()
            return x + self.down(h)
    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block(96 if i % 2 else 64) for i in range(4))
            self.scale = torch.nn.Parameter(torch.ones(48))
            self.out = torch.nn.Linear(48, 7)
        def forward(self, x):
            kept = []
            for i, block in enumerate(self.blocks):
                x = block(x)
                kept.append(x)
                if i == 2:
                    x = x * self.scale
            return self.out(x).square().mean() + 0.01 * sum(k.mean() for k in kept)
    model = Stack()
    for block in model.blocks:
        block.compile(backend="zero", options=options)
    model.out.compile(backend="zero", options=options)
    opt = zerocompile.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        loss = model(torch.randn(5, 48, generator=g))
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    dist.destroy_process_group()
""")

# Tied embedding and head, two frozen blocks, one block used twice (shared parameters), a
# forward hook that rescales a block's output and a pre-hook that shifts another's input.
TIED = textwrap.dedent("""
    import datetime, json, sys
    import torch, torch.distributed as dist
    import zerocompile
    options = json.loads(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(48, 96), torch.nn.Linear(96, 48)
            self.norm = torch.nn.LayerNorm(48)
        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.proj = torch.nn.LayerNorm(48), torch.nn.Linear(48, 32, bias=False)
        def forward(self, x, tokens):
            return torch.nn.functional.cross_entropy(self.proj(self.norm(x)).flatten(0, 1), tokens.flatten())
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 48)
            blocks = [Block() for _ in range(5)]
            self.blocks = torch.nn.ModuleList(blocks + [blocks[0]])
            self.head = Head()
            self.head.proj.weight = self.emb.weight
        def forward(self, tokens):
            x = self.emb(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x, tokens)
    model = Tied()
    for i in (1, 3):
        model.blocks[i].requires_grad_(False)
    model.blocks[2].register_forward_hook(lambda mod, args, out: 0.5 * out)
    model.blocks[4].register_forward_pre_hook(lambda mod, args: (args[0] + 1.0,))
    for block in model.blocks[:5]:
        block.compile(backend="zero", options=options)
    model.head.compile(backend="zero", options=options)
    opt = zerocompile.ZeroOptimizer([p for p in model.parameters() if p.requires_grad], torch.optim.AdamW, lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        loss = model(torch.randint(0, 32, (4, 6), generator=g))
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    dist.destroy_process_group()
""")

VOLATILE = {"wall_s", "graph_runs"}


def _plan(script: str, args: list, world: int, replay: bool, folder: Path) -> tuple:
    """``zerocompile plan --json`` in a process of its own (as the CLI is used: nothing of an
    earlier plan's models is left to count), forked from the fork server, which has imported
    torch, transformers and zerocompile (a new interpreter per plan spent ~5 s of CPU on
    that, 10 plans here); the process and the paths of its stdout and stderr."""
    argv = ["plan", "--world-size", str(world), "--hardware", "cpu", "--json",
            *([] if replay else ["--no-replay"]), "--", script, *args]
    name = f"{Path(script).stem}-{world}-{replay}-{len(list(folder.iterdir()))}"
    out, err = folder / f"{name}.out", folder / f"{name}.err"
    return start_cli(argv, out, err, REPO), out, err


def test_plan_with_replay_equals_plan_without_on_a_zoo(tmp_path):
    """Every figure of ``plan`` (peak live bytes, model state, collective counts and bytes,
    estimated compute, communication and step time, frames) is identical with replay and
    without, on HF Llama blocks at stage 3 with full recompute; on a stack of blocks of two
    sizes with a graph break inside each block, every block's output kept by the script and a
    block's output scaled by an eager op; and on a model with a tied embedding and head,
    frozen blocks, a block used twice and forward hooks; and replay did replace runs."""
    stack, tied = tmp_path / "stack.py", tmp_path / "tied.py"
    stack.write_text(STACK)
    tied.write_text(TIED)
    llama = str(REPO / "benchmarks" / "train_llama.py")
    tiny = ["--size", "tiny", "--layers", "2", "--seq", "16", "--steps", "2"]     # the second layer replays
    cases = [
        (llama, [*tiny, "--options", '{"stage": 3, "inner_compiler": "eager"}'], 8),
        # the stack's scale (used only by the eager loop) and its head (an nn.Linear compiled on
        # its own) run in eager code: sharded all the same (runtime/eager_regions.py)
        (str(stack), ['{"stage": 3, "inner_compiler": "eager", "allow_unsharded": true}'], 4),
        (str(stack), ['{"stage": 2, "inner_compiler": "eager"}'], 2),
        (str(tied), ['{"stage": 3, "inner_compiler": "eager"}'], 4),
        (str(tied), ['{"stage": 3, "inner_compiler": "eager", "recompute": "full"}'], 2),
    ]
    folder = tmp_path / "plans"
    folder.mkdir()
    for script, args, world in cases:
        case = f"{Path(script).name} {args[-1]} on {world} ranks"
        runs = [_plan(script, args, world, replay, folder) for replay in (True, False)]
        reports = []
        for run, out, err in runs:
            run.join(timeout=600)
            assert run.exitcode == 0, (case, run.exitcode, err.read_text()[-4000:])
            reports.append(json.loads(out.read_text().splitlines()[0]))
        replayed, executed = reports
        assert replayed["measured_step"] == 2, case
        assert replayed["graph_runs"]["replayed"] > 0, case
        assert executed["graph_runs"] == {}, case
        assert {k: v for k, v in replayed.items() if k not in VOLATILE} == \
            {k: v for k, v in executed.items() if k not in VOLATILE}, case
        assert replayed["peak_bytes_per_rank"] > replayed["model_state_bytes_per_rank"] > 0, case
        if script == str(stack) and "stage\": 3" in args[-1]:
            # scale: used by the eager loop; out: an nn.Linear compiled on its own, which Dynamo runs
            # eagerly: both sharded by the model's first frame (before: kept whole, 3 reported)
            assert replayed["unsharded_params"] == {"count": 0, "elements": 0, "names": []}, case


def _spoiled_plan_child(argv: list, out_path: str, err_path: str, environ: dict) -> None:
    """``dist_utils.cli_child`` with every replay's check forced to fail (in this child process only)."""
    replay = GraphReplay._replay

    def spoiled(self, record, args):
        out = replay(self, record, args)
        self.mismatch = "forced by the test"
        return out

    GraphReplay._replay = spoiled
    cli_child(argv, out_path, err_path, environ, str(REPO))


def test_a_plan_whose_replay_cannot_vouch_for_its_figures_fails_and_names_the_fix(tmp_path):
    """When a replay's inputs die differently from the recorded run's (forced here), plan
    fails with one line saying so and naming --no-replay, instead of printing figures."""
    args = ["--size", "tiny", "--layers", "2", "--seq", "16", "--steps", "2"]
    out, err = tmp_path / "plan.out", tmp_path / "plan.err"
    run = start_fresh(_spoiled_plan_child, ["plan", "--world-size", "4", "--json", "--",
                                            str(REPO / "benchmarks" / "train_llama.py"), *args],
                      str(out), str(err), dict(os.environ))
    run.join(timeout=600)
    done = SimpleNamespace(returncode=run.exitcode, stdout=out.read_text(), stderr=err.read_text())
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1] == (
        "zerocompile plan: error: forced by the test, so its figures may be wrong; plan again without "
        "replay (--no-replay, or replay=False)")


# ------------------------------------------------------------------------- the replay itself
def _execute(gm):
    interpreter = torch.fx.Interpreter(gm, garbage_collect_values=True)

    def execute(args):
        try:
            return interpreter.boxed_run(args)
        finally:
            interpreter.env = {}
    return execute


def _block(x, w):
    h = torch.ops.aten.mm.default(x, w)
    r = torch.ops.aten.relu.default(h)
    return (torch.ops.aten.add.Tensor(r, 1.0), torch.ops.aten.t.default(w))


def test_only_graphs_of_pure_ops_are_replayable():
    gm = torch.fx.symbolic_trace(_block)
    assert replayable_graph(gm)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.add_.Tensor, (x, 1.0)))
    assert not replayable_graph(torch.fx.GraphModule({}, graph))              # writes its input
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(operator.add, (x, 1.0)))
    assert not replayable_graph(torch.fx.GraphModule({}, graph))              # not an op
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output((graph.call_function(torch.ops.aten.relu.default, (x,)),))
    assert replayable_graph(torch.fx.GraphModule({}, graph))
    # a gradient bucket the graph packs itself and reduces in place: nothing outside the run sees
    # the write (passes/reduce_scatter_in_place.py); the same op on a graph input is a write to it
    from zerocompile.runtime import bucket_ops, in_place_reduction  # noqa: F401  (register the ops)

    for own_bucket in (True, False):
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        bucket = graph.call_function(torch.ops.zerocompile.pack_gradients.default, ([x], 2)) if own_bucket else x
        graph.call_function(torch.ops.zerocompile.reduce_scatter_in_place.default, (bucket, "sum", 2, "0", "reduce_scatter"))
        graph.output((graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (bucket,)),))
        assert replayable_graph(torch.fx.GraphModule({}, graph)) is own_bucket


def test_replay_gives_the_outputs_peak_and_clock_of_an_execution():
    """Runs of one graph on inputs alike: the first is executed, the second replayed; outputs
    have the metadata and aliasing of an execution's, and the tracker's peak and the timer's
    clock move exactly as executing both runs moves them."""
    gm = torch.fx.symbolic_trace(_block)
    figures = []
    for replay in (True, False):
        fake = FakeTensorMode()
        tracker = LiveStorageTracker(track_inputs=True, fake_mode=fake)
        timer = StepTimer(CostModel(), world=2)
        replayer = GraphReplay(tracker, timer)
        replayer.measuring = True
        execute = _execute(gm)
        outs = []
        with fake, replayer, tracker, timer:
            ws = [torch.empty(16, 32) for _ in range(3)]
            for w in ws:
                args = [torch.empty(8, 16), w]
                outs.append(replayer.run(gm, execute, args) if replay else execute(args))
                assert args == []                                              # boxed: cleared
            peak, now, live = tracker.peak, timer.now, tracker.current
        figures.append((peak, now, live, replayer.replayed if replay else None))
        for out, w in zip(outs, ws):
            assert type(out) is tuple and out[0].shape == (8, 32) and out[0].stride() == (32, 1)
            assert out[1].shape == (32, 16) and out[1].untyped_storage()._cdata == w.untyped_storage()._cdata
    (peak_r, now_r, live_r, replayed), (peak_e, now_e, live_e, _) = figures
    assert replayed == 2
    assert (peak_r, now_r, live_r) == (peak_e, now_e, live_e)
    assert now_r > 0 and peak_r > live_r


def _measured_block():
    """``_block`` traced, and a measuring ``GraphReplay`` with its tracker in a fresh fake mode."""
    gm = torch.fx.symbolic_trace(_block)
    fake = FakeTensorMode()
    tracker = LiveStorageTracker(track_inputs=True, fake_mode=fake)
    replayer = GraphReplay(tracker, None)
    replayer.measuring = True
    return gm, fake, tracker, replayer, _execute(gm)


def test_an_input_only_autograd_holds_gets_a_signature_of_its_own():
    """An input that autograd saved (a reference from C++) survives the run, where the same
    input held by nothing else dies in it: the signature tells the two apart (torch keeps a
    Python reference to a tensor C++ holds), so the second run is executed, not replayed."""
    gm, fake, tracker, replayer, execute = _measured_block()
    with fake, replayer, tracker:
        w = torch.empty(16, 32)
        replayer.run(gm, execute, [torch.empty(8, 16), w])                    # x dies in it
        scale = torch.ones(8, 16, requires_grad=True)
        x = torch.empty(8, 16)
        held = scale * x                                                       # autograd saves x
        args = [x, w]
        del x
        replayer.run(gm, execute, args)
        replayer.run(gm, execute, [torch.empty(8, 16), w])                    # like the first
    assert (replayer.executed, replayer.replayed, replayer.mismatch) == (2, 1, None)
    del held


def test_a_replay_whose_inputs_die_differently_reports_a_mismatch():
    """After each replay the inputs that died are compared with the recorded run's; if they
    differ (here: the record is altered to say an input survived), the replay says it cannot
    vouch for the peak, and replay stops."""
    gm, fake, tracker, replayer, execute = _measured_block()
    with fake, replayer, tracker:
        w = torch.empty(16, 32)
        replayer.run(gm, execute, [torch.empty(8, 16), w])
        (record,) = replayer._records.values()
        assert record.dead == {0}
        record.dead = frozenset()
        replayer.run(gm, execute, [torch.empty(8, 16), w])
        assert replayer.replayed == 1
        assert replayer.mismatch == "a replayed graph run freed inputs [0] where the recorded run freed []"
        replayer.run(gm, execute, [torch.empty(8, 16), w])
    assert (replayer.executed, replayer.replayed) == (2, 1)


def test_runs_on_real_tensors_are_executed():
    """A real (not fake) input is never replayed: every run executes."""
    gm = torch.fx.symbolic_trace(_block)
    replayer = GraphReplay()
    execute = _execute(gm)
    calls = []

    def counted(args):
        calls.append(1)
        return execute(args)
    with replayer:
        for _ in range(3):
            replayer.run(gm, counted, [torch.randn(8, 16), torch.randn(16, 32)])
    assert len(calls) == 3 and replayer.replayed == 0 and replayer.executed == 3
