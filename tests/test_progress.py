"""Progress bars (``zerocompile/progress.py``): drawn on stderr when forced or watched, never
changing what is iterated; ``zerocompile consolidate`` and ``load_pretrained`` show theirs."""

from __future__ import annotations

import torch

import zerocompile
from models import make_batch, make_model
from zerocompile.cli import main
from zerocompile.progress import track


def test_track_yields_everything_and_draws_only_when_enabled(monkeypatch, capsys):
    monkeypatch.setenv("ZEROCOMPILE_PROGRESS", "1")
    assert list(track(range(5), "counting sheep")) == [0, 1, 2, 3, 4]
    assert "counting sheep" in capsys.readouterr().err
    monkeypatch.setenv("ZEROCOMPILE_PROGRESS", "0")
    assert list(track(iter(range(3)), "quiet", total=3)) == [0, 1, 2]
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("ZEROCOMPILE_PROGRESS")                # not a terminal under pytest: no bar
    assert list(track([1, 2], "unwatched")) == [1, 2]
    assert capsys.readouterr().err == ""


def test_consolidate_and_load_pretrained_show_progress(tmp_path, monkeypatch, capsys):
    model = torch.compile(make_model("gpt"), backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    model(*make_batch("gpt", 0, 2)).backward()
    zerocompile.save_checkpoint(str(tmp_path / "ckpt"), model)
    monkeypatch.setenv("ZEROCOMPILE_PROGRESS", "1")
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "full.pt")]) == 0
    assert "reading ckpt" in capsys.readouterr().err
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert set(full) == set(make_model("gpt").state_dict())
    fresh = make_model("gpt", seed=3)
    zerocompile.load_pretrained(fresh, tmp_path / "full.pt")
    assert "loading full.pt" in capsys.readouterr().err
    for key, value in full.items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_the_first_step_says_which_frame_compiled(monkeypatch, capsys):
    """Forced (a launcher piping stderr): one line per frame once it compiled, nothing per pass;
    off, or unwatched (not a terminal), nothing."""
    monkeypatch.setenv("ZEROCOMPILE_PROGRESS", "1")
    torch._dynamo.reset()
    model = torch.compile(make_model("tied"), backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    model(*make_batch("tied", 0, 2)).backward()        # two frames: a graph break before the head
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("zerocompile:")]
    assert len(lines) == 2 and all("compiled frame" in line and "(stage 3, " in line for line in lines), lines
    # what compiled: the body's frame holds the embeddings and blocks, the head's frame the tied weight
    assert all("forward + backward, eager) in " in line and " parameters, " in line for line in lines), lines
    for setting in ("0", None):
        if setting is None:
            monkeypatch.delenv("ZEROCOMPILE_PROGRESS")
        else:
            monkeypatch.setenv("ZEROCOMPILE_PROGRESS", setting)
        torch._dynamo.reset()
        model = torch.compile(make_model("tied"), backend="zero", options={"stage": 3, "inner_compiler": "eager"})
        model(*make_batch("tied", 0, 2)).backward()
        assert "zerocompile: compil" not in capsys.readouterr().err


def test_the_status_line_names_the_frame_graph_and_pass():
    from zerocompile.progress import CompileStatus

    status = CompileStatus("frame 0/0", 3)
    assert status.text().startswith("zerocompile: compiling frame 0/0: tracing (")
    status.update("backward", "bucketing")
    assert "frame 0/0: backward graph, bucketing (" in status.text() and status.text().endswith(" s)")
