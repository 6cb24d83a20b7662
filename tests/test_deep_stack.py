"""``zerocompile.deep_stack``: calls run where no chunk boundary of CPython's frame stack lies
under them (CPython issue gh-142183), with nothing else changed."""

from __future__ import annotations

import resource
import sys
import threading
from unittest import mock

import pytest
import torch

from zerocompile import capture, deep_stack
from zerocompile.deep_stack import on_a_deep_stack
from zerocompile.script_runner import run_script


def _on_the_deep_stack() -> bool:
    """Whether a frame of ``on_a_deep_stack`` is under the caller's."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is deep_stack._DEEP_CODE:
            return True
        frame = frame.f_back
    return False


def test_it_is_the_call_itself_arguments_result_and_exceptions():
    assert on_a_deep_stack(divmod, 17, 5) == (3, 2)
    assert on_a_deep_stack(dict, fn=1, args=2, kwargs=3) == {"fn": 1, "args": 2, "kwargs": 3}
    assert on_a_deep_stack(_on_the_deep_stack) and not _in_a_thread(_on_the_deep_stack)
    with pytest.raises(ZeroDivisionError) as caught:
        on_a_deep_stack(lambda: 1 / 0)
    assert caught.traceback[-1].name == "<lambda>"      # the error is raised where it was, unwrapped


def test_the_tests_themselves_run_on_the_deep_stack():
    """conftest.py's ``pytest_pyfunc_call`` wrapper (and ``dist_utils``'s ranks)."""
    assert _on_the_deep_stack()


def _leaf(i):
    return i


def _loop_at(depth: int, calls: int) -> int:
    """Minor page faults of ``calls`` calls of a small function, ``depth`` frames further down."""
    if depth:
        return _loop_at(depth - 1, calls)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for i in range(calls):
        _leaf(i)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def _worst(calls: int = 2000) -> int:
    """The most page faults the loop takes at any depth from 0 to 299: where a chunk boundary
    lies between the loop's frame and its callee's, every call maps (and faults on) a new chunk."""
    return max(_loop_at(depth, calls) for depth in range(300))


def _in_a_thread(fn):
    """``fn()`` in a new thread: a stack of its own, which starts in a fresh chunk (this test runs on
    the deep stack already, conftest.py)."""
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_no_loop_under_it_maps_a_chunk_per_call():
    """At every depth from 0 to 299 a loop of 2000 calls under ``on_a_deep_stack`` takes a handful
    of page faults; on a plain stack, on the Pythons that have the thrashing (3.11 and 3.12 here),
    it takes one per call at some depth, which is what this measures."""
    deep = _in_a_thread(lambda: on_a_deep_stack(_worst))
    assert deep < 50, deep
    if sys.version_info < (3, 13):
        plain = _in_a_thread(_worst)
        assert plain >= 2000, plain


def test_the_backend_compiles_on_the_deep_stack(fake_world):
    """Each ``backend="zero"`` compile runs on the deep stack whatever calls it (here a thread, whose
    stack is plain)."""
    seen = []
    real = capture.compile_frame

    def spy(*args, **kwargs):
        seen.append(_on_the_deep_stack())
        return real(*args, **kwargs)

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    with mock.patch("zerocompile.backend.compile_frame", spy):
        _in_a_thread(lambda: compiled(torch.randn(4, 8)).sum().backward())
    assert seen == [True]


def test_a_script_plan_runs_is_on_the_deep_stack(tmp_path):
    """The scripts ``plan``, ``tune``, ``measure`` and ``dump`` run in their process are run from
    ``on_a_deep_stack``: Dynamo's tracing of the script's model too."""
    script = tmp_path / "script.py"
    out = tmp_path / "out.txt"
    script.write_text("import sys\nfrom zerocompile import deep_stack\n"
                      "f = sys._getframe()\n"
                      "while f is not None and f.f_code is not deep_stack._DEEP_CODE:\n    f = f.f_back\n"
                      f"open({str(out)!r}, 'w').write(str(f is not None))\n")
    assert _in_a_thread(lambda: run_script(script, [], {}, world_size=2)) == 0
    assert out.read_text() == "True"
