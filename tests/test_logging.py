"""The ``zerocompile`` logger under torch's logging controls: ``TORCH_LOGS="+zerocompile"``
(debug; ``TORCH_LOGS="zerocompile"`` is torch's spelling of the same at info) and
``torch._logging.set_logs(modules=...)`` at info and debug.

torch accepts any importable module's name in ``TORCH_LOGS`` and in ``set_logs(modules=...)``
(its documented way to log a module that did not register an alias), and zerocompile logs
to the one logger named after its package, so no registration (a private torch API) is
needed. These tests fail if torch stops accepting module names there."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent("""
    import logging, sys
    import torch
    import zerocompile
    def compile_one():
        torch._dynamo.reset()
        model = torch.compile(torch.nn.Linear(4, 2), backend="zero", options={"stage": 3, "inner_compiler": "eager"})
        model(torch.randn(3, 4)).sum().backward()
    compile_one()
    if sys.argv[1] == "api":        # after a compile that logged as TORCH_LOGS says, the API sets the level
        for level in ("INFO", "DEBUG"):
            print(f"--- set_logs {level}", file=sys.stderr, flush=True)
            torch._logging.set_logs(modules={"zerocompile": getattr(logging, level)})
            compile_one()
""")


def _run(settings: str | None, how: str = "env") -> str:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    if settings is not None:
        env["TORCH_LOGS"] = settings
    done = subprocess.run([sys.executable, "-c", _SCRIPT, how], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def test_torch_logs_controls_the_zerocompile_logger():
    """Two fresh processes (about 12 s of CPU each): ``TORCH_LOGS="+zerocompile"`` logs the debug
    lines; without ``TORCH_LOGS`` a compile is quiet, then ``set_logs`` at INFO gives the info line
    only and at DEBUG the debug lines too."""
    debug = _run("+zerocompile")
    assert "joint graph after tag_collectives" in debug           # a pass manager debug line
    assert "2 parameters (stage 3, world 1) -> eager" in debug     # and the info line
    quiet, info, api = _run(None, how="api").split("--- set_logs ")
    assert "-> eager" not in quiet and "after tag_collectives" not in quiet
    assert info.startswith("INFO") and "2 parameters (stage 3, world 1) -> eager" in info
    assert "joint graph after tag_collectives" not in info
    assert api.startswith("DEBUG") and "joint graph after tag_collectives" in api
