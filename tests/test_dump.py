"""The graph-dump recorder (zerocompile/dump.py) on hand-built FX graphs: files, index,
and summaries equal to what the analyses give for the same graph."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from zerocompile.config import ZeroConfig
from zerocompile.dump import DumpRecorder, recorder_for, safe_name
from zerocompile.env import DUMP_ENV
from zerocompile.runtime.accounting import COLLECTIVE_KINDS
from zerocompile.passes.analyses.collective_summary import summarize_collectives
from zerocompile.passes.graph_utils import set_tag
from zerocompile.passes.analyses.liveness import simulate
from zerocompile.runtime.comm import CommGroup

c10d = torch.ops._c10d_functional


def _collective_graph():
    """Gather a shard, use it, reduce-scatter a gradient-like tensor (fake group, 2 ranks)."""
    def fn(shard, x):
        full = c10d.wait_tensor(c10d.all_gather_into_tensor(shard, 2, "fake"))
        y = (x @ full[:12].view(4, 3)).relu()
        g = c10d.wait_tensor(c10d.reduce_scatter_tensor(full * 2, "sum", 2, "fake"))
        total = c10d.wait_tensor(c10d.all_reduce(y.sum() + g.sum(), "sum", "fake"))
        return total

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(8), torch.randn(2, 4))
    for node in gm.graph.nodes:
        if node.target is c10d.all_gather_into_tensor.default:
            set_tag(node, role="param_gather", param="w")
        if node.target is c10d.reduce_scatter_tensor.default:
            set_tag(node, role="grad_reduce_scatter", params=["w", "b"], bucket=0)
    return gm


def _tiny_graph():
    """(x * 2 + 1).sum() on a float32 4x4 input: every tensor's bytes are known by hand."""
    return make_fx(lambda x: (x * 2 + 1).sum(), tracing_mode="fake")(torch.randn(4, 4))


def _index(root, rank=0):
    with open(os.path.join(root, f"rank{rank}", "index.json")) as f:
        return json.load(f)


def test_files_and_index_layout(tmp_path):
    gm = _collective_graph()
    rec = DumpRecorder(tmp_path, rank=1, world=2, options={"stage": 3, "param_dtype": torch.bfloat16})
    rec.record("frame 0/0", "forward", "input", gm, 0.0)
    rec.record("frame 0/0", "forward", "bucketing", gm, 0.0125)
    rec.record("frame 0/0", "backward", "input", gm, 0.0)

    index = _index(tmp_path, rank=1)
    assert (index["rank"], index["world"]) == (1, 2)
    assert index["options"] == {"stage": 3, "param_dtype": "bfloat16"}
    assert list(index["frames"]) == ["frame 0/0"]
    frame = index["frames"]["frame 0/0"]
    assert frame["dir"] == "frame_0_0"
    assert set(frame["graphs"]) == {"forward", "backward"}
    steps = frame["graphs"]["forward"]
    assert [(s["index"], s["pass"]) for s in steps] == [(0, "input"), (1, "bucketing")]
    assert steps[1]["code"] == "frame_0_0/forward/01_bucketing.py"
    assert steps[1]["nodes_file"] == "frame_0_0/forward/01_bucketing.json"
    assert steps[1]["time_s"] == pytest.approx(0.0125)
    assert frame["graphs"]["backward"][0]["code"] == "frame_0_0/backward/00_input.py"

    rank_dir = tmp_path / "rank1"
    assert (rank_dir / steps[1]["code"]).read_text() == gm.code
    nodes = json.loads((rank_dir / steps[1]["nodes_file"]).read_text())["nodes"]
    assert len(nodes) == steps[1]["nodes"] == len(gm.graph.nodes)
    by_name = {n["name"]: n for n in nodes}
    gather = by_name["all_gather_into_tensor"]
    assert gather["op"] == "call_function"
    assert gather["target"] == "_c10d_functional.all_gather_into_tensor.default"
    assert gather["inputs"] == ["shard_1"]
    assert (gather["role"], gather["params"], gather["bytes"]) == ("param_gather", ["w"], 16 * 4)
    assert gather["collective"] == "all_gather"
    rs = by_name["reduce_scatter_tensor"]
    assert (rs["role"], rs["params"], rs["bucket"], rs["bytes"]) == ("grad_reduce_scatter", ["w", "b"], 0, 8 * 4)
    assert by_name["mm"]["role"] is None and by_name["mm"]["params"] == []
    assert by_name["output"]["op"] == "output"
    # no temporary files are left behind by the atomic writes
    assert not [p for p in rank_dir.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_index_summaries_equal_the_analyses(tmp_path, kind):
    gm = _collective_graph()
    DumpRecorder(tmp_path, 0, 2).record("frame 1/0", kind, "input", gm, 0.0)
    step = _index(tmp_path)["frames"]["frame 1/0"]["graphs"][kind][0]

    summary = summarize_collectives(gm.graph)
    assert step["collectives"] == {k: {"count": t.count, "bytes": t.bytes,
                                       "dtypes": sorted({d for kind, d, _ in summary.sequence if kind == k})}
                                   for k, t in summary.totals.items()}
    assert step["collectives"]["all_gather"] == {"count": 1, "bytes": 64, "dtypes": ["float32"]}
    assert step["collectives"]["reduce_scatter"] == {"count": 1, "bytes": 64, "dtypes": ["float32"]}
    assert step["collectives"]["all_reduce"] == {"count": 1, "bytes": 4, "dtypes": ["float32"]}

    liveness = simulate(gm.graph, count_inputs=(kind == "backward"))
    assert (step["peak_bytes"], step["peak_node"]) == (liveness.peak, liveness.peak_node)
    assert step["peak_breakdown"] == liveness.peak_breakdown
    nodes = json.loads((tmp_path / "rank0" / step["nodes_file"]).read_text())["nodes"]
    assert [n["live"] for n in nodes] == liveness.live
    assert [n["name"] for n in nodes] == liveness.nodes


def test_exact_peak_of_a_tiny_graph(tmp_path):
    # forward (inputs not counted): mul allocates 64 B; add allocates 64 B while mul's
    # buffer is still read -> 128 B; then mul dies, sum allocates 4 B (68 B), add dies.
    rec = DumpRecorder(tmp_path, 0, 1)
    rec.record("frame", "forward", "input", _tiny_graph(), 0.0)
    rec.record("frame", "backward", "input", _tiny_graph(), 0.0)
    graphs = _index(tmp_path)["frames"]["frame"]["graphs"]
    fw, bw = graphs["forward"][0], graphs["backward"][0]
    assert (fw["peak_bytes"], fw["peak_node"]) == (128, "add")
    nodes = json.loads((tmp_path / "rank0" / fw["nodes_file"]).read_text())["nodes"]
    assert [(n["name"], n["bytes"], n["live"]) for n in nodes] == [
        ("x_1", 64, 0), ("mul", 64, 64), ("add", 64, 128), ("sum_1", 4, 68), ("output", 0, 4)]
    # backward counts the 64-byte input, which is live together with mul's output
    assert (bw["peak_bytes"], bw["peak_node"]) == (128, "mul")
    assert fw["collectives"] == {k: {"count": 0, "bytes": 0, "dtypes": []} for k in COLLECTIVE_KINDS}


def test_collectives_without_shape_metadata_are_recorded_as_unknown(tmp_path):
    gm = _collective_graph()
    for node in gm.graph.nodes:
        if node.target is c10d.all_gather_into_tensor.default:
            del node.meta["val"]
    with pytest.raises(RuntimeError):
        summarize_collectives(gm.graph)
    DumpRecorder(tmp_path, 0, 2).record("frame 0/0", "dynamo", "input", gm, 0.0)
    step = _index(tmp_path)["frames"]["frame 0/0"]["graphs"]["dynamo"][0]
    assert step["collectives"] is None
    assert step["nodes"] == len(gm.graph.nodes)


def test_a_failing_write_warns_once_and_never_raises(tmp_path, caplog):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the dump directory should be")
    rec = DumpRecorder(blocker, 0, 1)
    with caplog.at_level(logging.WARNING, logger="zerocompile"):
        rec.record("frame 0/0", "dynamo", "input", _tiny_graph(), 0.0)
        rec.record("frame 0/0", "dynamo", "pass", _tiny_graph(), 0.0)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "could not write the graph dump" in warnings[0].getMessage()


def test_recorders_of_one_process_share_the_index_and_old_runs_are_replaced(tmp_path):
    a, b = DumpRecorder(tmp_path, 0, 2), DumpRecorder(tmp_path, 0, 2)
    a.record("frame 0/0", "dynamo", "input", _tiny_graph(), 0.0)
    b.record("frame 1/0", "dynamo", "input", _tiny_graph(), 0.0)
    b.record("frame 0/0", "joint", "input", _tiny_graph(), 0.0)
    a.record("frame 0/0", "dynamo", "insert_param_collectives", _tiny_graph(), 0.0)
    frames = _index(tmp_path)["frames"]
    assert set(frames) == {"frame 0/0", "frame 1/0"}
    assert [s["pass"] for s in frames["frame 0/0"]["graphs"]["dynamo"]] == ["input", "insert_param_collectives"]
    assert [s["pass"] for s in frames["frame 0/0"]["graphs"]["joint"]] == ["input"]

    # an index another process wrote (an earlier run) is not merged into
    index = _index(tmp_path)
    index["pid"] = -1
    (tmp_path / "rank0" / "index.json").write_text(json.dumps(index))
    DumpRecorder(tmp_path, 0, 2).record("frame 2/0", "dynamo", "input", _tiny_graph(), 0.0)
    assert list(_index(tmp_path)["frames"]) == ["frame 2/0"]


def test_frame_names_become_safe_distinct_directories(tmp_path):
    assert safe_name("frame 0/0") == "frame_0_0"
    assert safe_name("frame") == "frame"
    assert safe_name("../..") == "frame"
    rec = DumpRecorder(tmp_path, 0, 1)
    rec.record("frame 0/0", "dynamo", "input", _tiny_graph(), 0.0)
    rec.record("frame_0_0", "dynamo", "input", _tiny_graph(), 0.0)
    frames = _index(tmp_path)["frames"]
    assert frames["frame 0/0"]["dir"] == "frame_0_0"
    assert frames["frame_0_0"]["dir"] == "frame_0_0_2"


def test_bad_rank_or_world_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="rank must be an int >= 0"):
        DumpRecorder(tmp_path, -1, 2)
    with pytest.raises(ValueError, match="world must be an int > rank"):
        DumpRecorder(tmp_path, 2, 2)


def test_recorder_for_uses_the_option_then_the_environment(tmp_path, monkeypatch):

    group = CommGroup(rank=3, world=4, name="fake")
    monkeypatch.delenv(DUMP_ENV, raising=False)
    bf16 = ZeroConfig.from_options({"param_dtype": "bf16"})
    assert recorder_for(bf16, group) is None

    monkeypatch.setenv(DUMP_ENV, str(tmp_path / "env"))
    rec = recorder_for(bf16, group)
    assert (rec.root, rec.rank, rec.world) == (tmp_path / "env", 3, 4)
    # the options recorded flat, by the names users give, every one of them
    assert set(rec.options) == set(bf16.flat())
    assert (rec.options["dump"], rec.options["param_dtype"], rec.options["process_group"]) == \
        (None, "bfloat16", None)

    group_stand_in = object()          # the option's check wants a ProcessGroup: built past it
    opt = bf16.with_options({"dump": str(tmp_path / "opt")})
    opt = dataclasses.replace(opt, sharding=dataclasses.replace(opt.sharding, process_group=group_stand_in))
    rec = recorder_for(opt, group)
    assert rec.root == tmp_path / "opt"
    rec.record("frame 0/0", "dynamo", "input", _tiny_graph(), 0.0)
    options = json.loads((tmp_path / "opt" / "rank3" / "index.json").read_text())["options"]
    assert options["dump"] == str(tmp_path / "opt") and options["process_group"].startswith("<object")
