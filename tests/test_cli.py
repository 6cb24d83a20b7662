"""The ``zerocompile`` command line (zerocompile/cli/): ``show`` on dumps recorded from
hand-built graphs, every error path, and ``dump`` end to end (as a subprocess, and on fake groups through ``main()``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dist_utils import run_cli
from zerocompile.cli import human_bytes, main
from zerocompile.dump import DumpRecorder
from zerocompile.passes.graph_utils import set_tag

c10d = torch.ops._c10d_functional
REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 300


# ------------------------------------------------------------------ a dump from hand-built graphs
def _gather_graph():
    def fn(shard, x):
        full = c10d.wait_tensor(c10d.all_gather_into_tensor(shard, 2, "fake"))
        y = (x @ full[:12].view(4, 3)).relu()
        g = c10d.wait_tensor(c10d.reduce_scatter_tensor(full * 2, "sum", 2, "fake"))
        return y.sum() + g.sum()

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(8), torch.randn(2, 4))
    for node in gm.graph.nodes:
        if node.target is c10d.all_gather_into_tensor.default:
            set_tag(node, role="param_gather", param="w")
        if node.target is c10d.reduce_scatter_tensor.default:
            set_tag(node, role="grad_reduce_scatter", param="w")
    return gm


def _bucketed_graph():
    """Like _gather_graph, plus a bucket copy and an all-reduce: a different code for diffs."""
    def fn(shard, x):
        bucket = torch.cat([shard, shard])
        full = c10d.wait_tensor(c10d.all_gather_into_tensor(bucket, 2, "fake"))
        y = (x @ full[:12].view(4, 3)).relu()
        total = c10d.wait_tensor(c10d.all_reduce(y.sum(), "sum", "fake"))
        return total

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(8), torch.randn(2, 4))
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.cat.default:
            set_tag(node, role="bucket_pack", params=["w", "b"], bucket=0)
        if node.target is c10d.all_gather_into_tensor.default:
            set_tag(node, role="bucket_gather", params=["w", "b"], bucket=0)
    return gm


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    """rank 0: frame 0/0 with forward (input, bucketing) and backward (input); frame 1/0 with
    a dynamo graph. rank 1: frame 0/0 forward (input)."""
    root = tmp_path_factory.mktemp("dump")
    rec = DumpRecorder(root, 0, 2, {"stage": 3, "inner_compiler": "eager"})
    rec.record("frame 0/0", "forward", "input", _gather_graph(), 0.0)
    rec.record("frame 0/0", "forward", "bucketing", _bucketed_graph(), 0.0125)
    rec.record("frame 0/0", "backward", "input", _gather_graph(), 0.0)
    rec.record("frame 1/0", "dynamo", "input", _gather_graph(), 0.0)
    DumpRecorder(root, 1, 2).record("frame 0/0", "forward", "input", _gather_graph(), 0.0)
    return root


def _index(root, rank=0):
    return json.loads((Path(root) / f"rank{rank}" / "index.json").read_text())


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _rows(out: str) -> list:
    """The body rows of rich tables in ``out``, as lists of stripped cells."""
    return [[c.strip() for c in line.strip().strip("│").split("│")]
            for line in out.splitlines() if line.startswith("│")]


# ------------------------------------------------------------------ show
def test_show_prints_one_table_per_graph_with_the_index_figures(dump, capsys):
    code, out, err = _run(capsys, "show", dump)
    assert code == 0, err
    for title in ("rank 0 | frame 0/0 | forward graph", "rank 0 | frame 0/0 | backward graph",
                  "rank 0 | frame 1/0 | dynamo graph"):
        assert title in out
    assert "inner_compiler=\"eager\"" in out      # stage 3 is the default: not listed
    steps = _index(dump)["frames"]["frame 0/0"]["graphs"]["forward"]
    rows = _rows(out)
    assert rows[0] == ["0", "input", str(steps[0]["nodes"]), "1 / 64 B", "1 / 64 B", "0",
                       human_bytes(steps[0]["peak_bytes"]), "0.0"]
    assert rows[1] == ["1", "bucketing", str(steps[1]["nodes"]), "1 / 128 B", "0", "1 / 4 B",
                       human_bytes(steps[1]["peak_bytes"]), "12.5"]
    assert len(rows) == 4                           # forward x2, backward, dynamo

    code, out, _ = _run(capsys, "show", dump, "--rank", "1")
    assert code == 0 and "rank 1 | frame 0/0 | forward graph" in out and len(_rows(out)) == 1


def test_show_prints_the_gradient_reduction_a_frame_recorded(tmp_path, capsys):
    from zerocompile.runtime.reduction_choice import ReductionChoice

    choice = ReductionChoice(sizes=(1 << 18, 1 << 24), kinds=("all_reduce", "reduce_scatter"), source="measured",
                             ms=((0.5, 0.25), (4.0, 6.0)), gather_kinds=("all_gather", "point_to_point"),
                             gather_ms=((0.3, 0.4), (9.0, 3.0)))
    rec = DumpRecorder(tmp_path, 0, 2, {"stage": 2})
    rec.note("frame 0/0", "gradient_reduction", choice.as_dict())
    rec.record("frame 0/0", "backward", "input", _gather_graph(), 0.0)
    rec.record("frame 1/0", "backward", "input", _gather_graph(), 0.0)     # no choice recorded: no line
    assert _index(tmp_path)["frames"]["frame 0/0"]["notes"]["gradient_reduction"]["kinds"] == [
        "all_reduce", "reduce_scatter"]
    code, out, err = _run(capsys, "show", tmp_path)
    assert code == 0, err
    lines = [line for line in out.splitlines() if "gradient reduction" in line]
    assert lines == ["frame 0/0: gradient reduction: measured; 256 KiB all_reduce: reduce_scatter "
                     "0.50 ms, all_reduce 0.25 ms; 16 MiB reduce_scatter: reduce_scatter 4.00 ms, all_reduce 6.00 ms"]
    lines = [line for line in out.splitlines() if "parameter gather" in line]
    assert lines == ["frame 0/0: parameter gather: measured; 256 KiB all_gather: all_gather 0.30 ms, "
                     "point_to_point 0.40 ms; 16 MiB point_to_point: all_gather 9.00 ms, point_to_point 3.00 ms"]


@pytest.mark.parametrize("frame", ["frame 0/0", "frame_0_0", "0/0"])
def test_show_after_prints_that_steps_code(dump, capsys, frame):
    code, out, err = _run(capsys, "show", dump, "--frame", frame, "--graph", "fw", "--after", "input")
    assert code == 0, err
    assert _gather_graph().code.strip() in out
    assert "aten.cat" not in out


def test_show_frame_and_graph_alone_print_the_last_steps_code(dump, capsys):
    code, out, err = _run(capsys, "show", dump, "--frame", "0/0", "--graph", "forward")
    assert code == 0, err
    assert "rank 0 | frame 0/0 | forward graph" in out and "backward graph" not in out
    assert "01 after bucketing (last step)" in out
    assert _bucketed_graph().code.strip() in out


def test_show_diff_across_a_pass(dump, capsys):
    code, out, err = _run(capsys, "show", dump, "--frame", "frame_0_0", "--graph", "forward", "--diff", "bucketing")
    assert code == 0, err
    assert "--- frame 0/0 forward 00 after input" in out
    assert "+++ frame 0/0 forward 01 after bucketing" in out
    assert any(line.startswith("+") and "aten.cat.default" in line for line in out.splitlines())
    assert any(line.startswith("-") and "reduce_scatter_tensor" in line for line in out.splitlines())
    # without --frame/--graph: every graph where the pass ran (here the same one)
    code, out_all, _ = _run(capsys, "show", dump, "--diff", "bucketing")
    assert code == 0 and out_all.count("+++ ") == 1


def _fake_dot(bin_dir: Path) -> None:
    """A `dot` that writes a stub SVG to the path after -o (so no graphviz is needed)."""
    bin_dir.mkdir()
    script = bin_dir / "dot"
    script.write_text(textwrap.dedent("""\
        #!/bin/sh
        out=""
        while [ $# -gt 0 ]; do
          if [ "$1" = "-o" ]; then out="$2"; shift; fi
          shift
        done
        echo '<svg xmlns="http://www.w3.org/2000/svg"></svg>' > "$out"
        """))
    script.chmod(0o755)


def test_show_svg_with_graphviz(dump, capsys, tmp_path, monkeypatch):
    _fake_dot(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    out_svg = tmp_path / "g.svg"
    code, out, err = _run(capsys, "show", dump, "--frame", "0/0", "--graph", "fw", "--svg", out_svg)
    assert code == 0, err
    assert out_svg.read_text().startswith("<svg")
    dot = (tmp_path / "g.dot").read_text()
    assert dot.startswith('digraph "zerocompile"')
    lines = dot.splitlines()
    # the last step (after bucketing) is drawn, coloured by role
    assert any('"cat" [' in line and "#b7e4c7" in line for line in lines)                     # bucket copy
    assert any('"all_gather_into_tensor" [' in line and "#8ecae6" in line for line in lines)  # param gather
    assert any('"wait_tensor" [' in line and "#d9d9d9" in line for line in lines)             # wait
    assert '"shard_1" -> "cat";' in dot
    # --after picks the step
    code, _, err = _run(capsys, "show", dump, "--frame", "0/0", "--graph", "fw", "--after", "input",
                        "--svg", out_svg)
    assert code == 0, err
    assert any('"reduce_scatter_tensor" [' in line and "#ffb703" in line
               for line in (tmp_path / "g.dot").read_text().splitlines())


def test_show_svg_without_graphviz_still_writes_the_dot_file(dump, capsys, tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code, out, err = _run(capsys, "show", dump, "--frame", "1/0", "--svg", tmp_path / "g.svg")
    assert code == 1
    assert len(err.strip().splitlines()) == 1
    assert "install graphviz" in err and "apt install graphviz" in err and str(tmp_path / "g.dot") in err
    assert (tmp_path / "g.dot").read_text().startswith("digraph")
    assert not (tmp_path / "g.svg").exists()


def test_show_memory_writes_a_png(dump, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "mem.png"
    code, out, err = _run(capsys, "show", dump, "--frame", "0/0", "--graph", "bw", "--memory", png)
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    peak = _index(dump)["frames"]["frame 0/0"]["graphs"]["backward"][0]["peak_bytes"]
    assert f"peak {human_bytes(peak)}" in out


def test_show_memory_without_matplotlib_is_one_line(dump, capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)     # makes the import fail
    code, _, err = _run(capsys, "show", dump, "--frame", "1/0", "--memory", tmp_path / "m.png")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "matplotlib" in err


# ------------------------------------------------------------------ errors
SHOW_ERRORS = [
    (["--rank", "5"], "rank 5 is not in the dump", "available ranks: 0, 1"),
    (["--frame", "9/9"], "has no frame '9/9'", "frame 0/0 (frame_0_0), frame 1/0 (frame_1_0)"),
    (["--frame", "1/0", "--graph", "bw"], "has no backward graph", "available: dynamo"),
    (["--graph", "joint"], "has no joint graph", "available: backward, dynamo, forward"),
    (["--graph", "forwards"], "invalid choice: 'forwards'", "'fw'"),
    (["--after", "nope"], "--after nope: no such step", "steps recorded: input, bucketing"),
    (["--diff", "nope"], "--diff nope: no such step", "steps recorded: input, bucketing"),
    (["--diff", "input"], "nothing to diff", "--after input"),
    (["--diff", "bucketing", "--after", "input"], "--diff cannot be combined", "--memory"),
    (["--svg", "x.svg"], "--svg draws one graph", "--frame 'frame 0/0' --graph forward"),
    (["--frame", "0/0", "--memory", "x.png"], "--memory draws one graph", "--graph backward"),
    (["--rank", "x"], "invalid int value: 'x'", "zerocompile show --help"),
]


@pytest.mark.parametrize("extra,first,second", SHOW_ERRORS, ids=[" ".join(e[0]) for e in SHOW_ERRORS])
def test_show_errors_are_one_line_with_exit_code_2(dump, capsys, extra, first, second):
    code, out, err = _run(capsys, "show", dump, *extra)
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("zerocompile show: error:") and first in err and second in err
    assert "Traceback" not in err + out


def test_show_bad_directories(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "broken" / "rank0").mkdir(parents=True)
    (tmp_path / "broken" / "rank0" / "index.json").write_text("{not json")
    cases = [(tmp_path / "missing", "no such directory"),
             (tmp_path / "empty", "is not a zerocompile dump"),
             (tmp_path / "file", "is not a directory"),
             (tmp_path / "broken", "cannot read dump index")]
    for path, message in cases:
        code, out, err = _run(capsys, "show", path)
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, (path, err)
        assert "Traceback" not in err + out


def test_no_subcommand_or_unknown_one(capsys):
    assert _run(capsys)[0] == 2
    code, _, err = _run(capsys, "shw")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "invalid choice: 'shw'" in err


def test_dump_argument_errors(capsys, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('never run')\n")
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep me")
    cases = [
        (["--options", "{bad"], "--options is not valid JSON"),
        (["--options", "[1, 2]"], "--options must be a JSON object"),
        (["--options", '{"stag": 3}'], "unknown option 'stag'; did you mean 'stage'?"),
        (["--options", '{"stage": 7}'], "option 'stage' = 7 is invalid"),
        (["--options", '{"process_group": null}'], "cannot set 'process_group'"),
        (["--options", '{"dump": "elsewhere"}'], "give the directory with --out"),
        (["--world-size", "0"], "--world-size must be >= 1"),
        (["--world-size", "two"], "invalid int value: 'two'"),
        (["--out", tmp_path / "a_file"], "is a file, not a directory"),
        (["--out", tmp_path / "busy"], "is not empty and holds no zerocompile dump"),
    ]
    for extra, message in cases:
        code, out, err = _run(capsys, "dump", *extra, "--", script)
        assert code == 2, (extra, err)
        assert len(err.strip().splitlines()) == 1 and message in err, (extra, err)
        assert "never run" not in out
    assert (tmp_path / "busy" / "notes.txt").read_text() == "keep me"
    code, _, err = _run(capsys, "dump", "--out", tmp_path / "o")
    assert code == 2 and "no script given" in err and len(err.strip().splitlines()) == 1
    code, _, err = _run(capsys, "dump", "--out", tmp_path / "o", "--", tmp_path / "missing.py")
    assert code == 2 and "no such script" in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------ dump, end to end
def _cli(*argv, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROCOMPILE_DUMP", "ZEROCOMPILE_OPTIONS")}
    return subprocess.run([sys.executable, "-m", "zerocompile", *map(str, argv)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)


def _cli_forked(*argv, cwd) -> subprocess.CompletedProcess:
    """``_cli`` in a child of the fork server (``dist_utils.run_cli``: ``main(argv)`` with torch and
    zerocompile already imported, the same environment): a process of its own without the ~5 s
    of a new interpreter's imports. ``python -m zerocompile`` itself runs in the test below."""
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROCOMPILE_DUMP", "ZEROCOMPILE_OPTIONS")}
    return run_cli([str(a) for a in argv], cwd, env, timeout=TIMEOUT)


RECORDING_STUB = """\
import json, os, sys

world = 1
if "--record" in sys.argv:      # torch only when needed: the subprocess case stays fast
    import torch
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx
    from zerocompile.dump import DumpRecorder

    world = dist.get_world_size() if dist.is_initialized() else 1
    gm = make_fx(lambda x: (x * 2).sum(), tracing_mode="fake")(torch.randn(4))
    DumpRecorder(os.environ["ZEROCOMPILE_DUMP"], 0, world).record("frame 0/0", "dynamo", "input", gm, 0.0)
print("SEEN " + json.dumps({"argv": sys.argv[1:], "name": __name__, "world": world,
      "env": {k: os.environ.get(k) for k in ("ZEROCOMPILE_DUMP", "ZEROCOMPILE_OPTIONS", "WORLD_SIZE", "RANK",
                                             "LOCAL_RANK")}}))
sys.exit(int(sys.argv[1]))
"""


def _seen(stdout: str) -> dict:
    return json.loads(next(line for line in stdout.splitlines() if line.startswith("SEEN "))[5:])


def test_dump_runs_the_script_as_a_subprocess_or_on_a_fake_group(tmp_path):
    """The CLI's own machinery, independent of the backend: environment, argv, exit codes,
    replacing an earlier dump."""
    script = tmp_path / "stub.py"
    script.write_text(RECORDING_STUB)
    (tmp_path / "d" / "rank3").mkdir(parents=True)              # an earlier dump
    (tmp_path / "d" / "rank3" / "index.json").write_text('{"frames": {}}')
    done = _cli_forked("dump", "--out", "d", "--options", '{"stage": 2}', "--", script, "3", "--flag", cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert _seen(done.stdout) == {
        "argv": ["3", "--flag"], "name": "__main__", "world": 1,
        "env": {"ZEROCOMPILE_DUMP": str(tmp_path / "d"), "ZEROCOMPILE_OPTIONS": '{"stage": 2}',
                "WORLD_SIZE": None, "RANK": None, "LOCAL_RANK": None}}
    assert "replacing the previous dump" in done.stdout and not (tmp_path / "d" / "rank3").exists()
    assert "exited with code 3" in done.stdout and "nothing was recorded" in done.stdout

    done = _cli_forked("dump", "--out", "d", "--world-size", "16", "--", script, "0", "--record", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = _seen(done.stdout)
    assert seen["world"] == 16 and seen["name"] == "__main__" and seen["argv"] == ["0", "--record"]
    assert seen["env"] == {"ZEROCOMPILE_DUMP": str(tmp_path / "d"), "ZEROCOMPILE_OPTIONS": None,
                           "WORLD_SIZE": "16", "RANK": "0", "LOCAL_RANK": "0"}
    assert _index(tmp_path / "d")["world"] == 16
    assert _rows(done.stdout) == [["0", "1", "1", "1"]]        # rank, frames, graphs, steps
    assert f"dump written to {tmp_path / 'd'}" in done.stdout


def test_dump_says_so_when_nothing_was_recorded(tmp_path, capsys):
    script = tmp_path / "idle.py"
    script.write_text("print('no model here')\n")
    code, out, err = _run(capsys, "dump", "--out", tmp_path / "d", "--", script)
    assert code == 0, err
    assert "nothing was recorded" in out and 'torch.compile(model, backend="zero"' in out


TRAIN_SCRIPT = """\
import torch
import torch.nn as nn
import zerocompile


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.l1(x))
        {graph_break}
        return self.l2(h).pow(2).mean()


torch.manual_seed(0)
model = Tiny()
compiled = torch.compile(model, backend="zero", options={{"stage": 3, "inner_compiler": "eager"}})
opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
loss = compiled(torch.randn(4, 8))
loss.backward()
opt.step()
opt.zero_grad()
print("TRAINED", loss.item())
"""


def _check_steps(index: dict) -> None:
    for entry in index["frames"].values():
        assert set(entry["graphs"]) == {"dynamo", "joint", "forward", "backward"}, entry["graphs"].keys()
        for steps in entry["graphs"].values():
            assert steps[0]["pass"] == "input"
            assert [s["index"] for s in steps] == list(range(len(steps)))


def test_dump_end_to_end_as_a_subprocess_with_options(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT.format(graph_break=""))
    done = _cli("dump", "--out", "d", "--options", '{"bucket_mb": 0}', "--", script, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TRAINED" in done.stdout
    index = _index(tmp_path / "d")
    assert index["world"] == 1 and list(index["frames"]) == ["frame 0/0"]
    assert index["options"]["stage"] == 3 and index["options"]["bucket_mb"] == 0   # ZEROCOMPILE_OPTIONS merged
    _check_steps(index)
    code, out, err = _run(capsys, "show", tmp_path / "d")
    assert code == 0 and "rank 0 | frame 0/0 | backward graph" in out, err


def test_a_scripts_init_process_group_joins_the_fake_group():
    """Inside ``script_process_group`` (the group ``dump --world-size`` and ``plan`` run a
    script on), a script's own ``init_process_group`` (any backend) joins the fake group and
    ``destroy_process_group()`` waits for the runner; a rank or world size that disagrees is an
    error. Both torch names are restored afterwards, and the group is gone."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from zerocompile.script_runner import script_process_group

    originals = (dist.init_process_group, dist.destroy_process_group,
                 distributed_c10d.init_process_group, distributed_c10d.destroy_process_group)
    with script_process_group(16):
        dist.init_process_group("nccl", init_method="env://", world_size=16, rank=0)
        distributed_c10d.init_process_group(backend="gloo")
        dist.destroy_process_group()
        assert dist.is_initialized() and dist.get_world_size() == 16
        with pytest.raises(ValueError, match="asks for rank 3 of 16 ranks, but it runs as rank 0"):
            dist.init_process_group("gloo", rank=3, world_size=16)
        with pytest.raises(ValueError, match="asks for rank 0 of 8 ranks"):
            dist.init_process_group("gloo", world_size=8, rank=0)
    assert not dist.is_initialized()
    assert (dist.init_process_group, dist.destroy_process_group, distributed_c10d.init_process_group,
            distributed_c10d.destroy_process_group) == originals, "the torch functions were not restored"


def _dump_in_process(capsys, monkeypatch, tmp_path, *argv):
    """``zerocompile dump --world-size N`` through ``main()`` in this process, as the CLI runs it
    (the script on a fake group in the CLI's own process): a subprocess would import torch and
    zerocompile again (~5-8 s). ``python -m zerocompile`` itself is run as a subprocess above."""
    for name in ("ZEROCOMPILE_DUMP", "ZEROCOMPILE_OPTIONS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    torch.compiler.reset()
    try:
        return _run(capsys, "dump", *argv)
    finally:
        torch.compiler.reset()


def test_dump_end_to_end_with_a_graph_break_on_64_fake_ranks(tmp_path, capsys, monkeypatch):
    script = tmp_path / "train_break.py"
    script.write_text(TRAIN_SCRIPT.format(graph_break="torch._dynamo.graph_break()"))
    code, out, err = _dump_in_process(capsys, monkeypatch, tmp_path, "--out", "d", "--world-size", "64", "--", script)
    assert code == 0, out + err
    assert "TRAINED" in out
    index = _index(tmp_path / "d")
    assert index["world"] == 64 and list(index["frames"]) == ["frame 0/0", "frame 1/0"]
    _check_steps(index)
    # stage 3 gathers each parameter padded to a multiple of 64 elements, in fp32:
    # l1 (128 + 16 -> 64) and l2 (64 + 4 -> 64) elements
    for frame, numel in (("frame 0/0", 128 + 64), ("frame 1/0", 64 + 64)):
        forward_input = index["frames"][frame]["graphs"]["forward"][0]
        assert forward_input["collectives"]["all_gather"] == {"count": 2, "bytes": 4 * numel, "dtypes": ["float32"]}
    code, out, err = _run(capsys, "show", tmp_path / "d", "--frame", "1/0", "--graph", "bw", "--after", "input")
    assert code == 0 and "reduce_scatter_tensor" in out, err


def test_dump_train_gpt_example_on_64_fake_ranks(tmp_path, capsys, monkeypatch):
    code, out, err = _dump_in_process(capsys, monkeypatch, tmp_path, "--out", "d", "--world-size", "64", "--",
                                      REPO / "examples" / "train_gpt.py", "--steps", "1", "--inner-compiler", "eager",
                                      "--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--vocab", "64",
                                      "--seq-len", "16")
    assert code == 0, out + err
    assert "64 rank(s)" in out and "step   0 |" in out
    index = _index(tmp_path / "d")
    assert index["world"] == 64 and len(index["frames"]) == 1
    _check_steps(index)


def test_console_script_is_installed(dump):
    exe = Path(sys.executable).parent / "zerocompile"
    if not exe.exists():
        pytest.skip("the zerocompile console script is not installed (pip install -e .)")
    done = subprocess.run([str(exe), "show", str(dump), "--rank", "1"], capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0 and "rank 1 | frame 0/0 | forward graph" in done.stdout, done.stderr
