"""Run a user's training script in this process as rank 0 of torch's fake process group of N
ranks: ``zerocompile dump --world-size N`` and ``zerocompile plan``.

The script runs as ``__main__`` (``runpy``), with ``sys.argv = [SCRIPT, *ARGS]``, its own
directory first on ``sys.path`` and ``RANK=0``, ``LOCAL_RANK=0``, ``WORLD_SIZE=N`` in the
environment, as under torchrun. The group exists before the script starts; the script's own
``dist.init_process_group(...)`` joins it and its ``dist.destroy_process_group()`` is left to
the runner (``script_process_group``), so scripts run unmodified. Environment,
``sys.argv`` and ``sys.path`` are restored and the group destroyed afterwards.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import runpy
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

from zerocompile import _torch_compat
from zerocompile.deep_stack import on_a_deep_stack


class ScriptRunError(Exception):
    """The script cannot be run in this process (a process group already exists)."""


def run_script(script: Path, script_args: list, env_updates: dict, world_size: int,
               around: contextlib.AbstractContextManager | None = None,
               stop: type[BaseException] | None = None) -> int:
    """Run ``script`` on a fake group of ``world_size`` ranks; return its exit code.

    ``around`` is entered once the group exists and left after the script ends (``plan``'s
    fake-tensor mode and measurements). An exception of class ``stop`` raised inside the
    script ends it with exit code 0 (``plan`` stops a script after the steps it measures).
    """
    if dist.is_initialized():
        raise ScriptRunError("a process group is already initialised in this process")
    env_updates = {**env_updates, "WORLD_SIZE": str(world_size), "RANK": "0", "LOCAL_RANK": "0"}
    saved_env = {key: os.environ.get(key) for key in env_updates}
    saved_argv, saved_path = sys.argv, list(sys.path)
    os.environ.update(env_updates)
    sys.argv = [str(script), *script_args]
    sys.path.insert(0, str(Path(script).parent))
    code = 0
    try:
        with script_process_group(world_size), (around or contextlib.nullcontext()):
            try:
                # the whole script, Dynamo's tracing included, free of stack-chunk thrashing
                on_a_deep_stack(runpy.run_path, str(script), run_name="__main__")
            except BaseException as exc:
                if stop is None or not isinstance(exc, stop):
                    raise
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 130
    except Exception:  # noqa: BLE001 - the script's own failure: show its traceback, as python would
        traceback.print_exc()
        code = 1
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return code


@contextlib.contextmanager
def script_process_group(world_size: int):
    """The fake group of ``world_size`` ranks (this process rank 0) for a user's script run in
    this process, destroyed on exit. While it is open, ``torch.distributed.init_process_group``
    joins the existing group instead of creating one (its backend and init method are ignored;
    a ``world_size`` or ``rank`` that disagrees is an error) and ``destroy_process_group()`` of
    the default group does nothing.

    Why this replaces two public torch functions for the duration: an unmodified training
    script (the one launched with torchrun) creates its own group with ``gloo`` or ``nccl``,
    and torch has no setting that sends that call to the fake backend. Both names
    (``torch.distributed.X`` and ``torch.distributed.distributed_c10d.X``, the same function:
    ``_torch_compat.process_group_function_modules``) are restored on exit;
    ``tests/test_cli.py`` checks both.
    """
    _torch_compat.init_fake_process_group(world_size)
    original_init, original_destroy = dist.init_process_group, dist.destroy_process_group

    def init_process_group(*args, **kwargs):
        asked = inspect.signature(original_init).bind(*args, **kwargs).arguments
        asked_world, rank = asked.get("world_size", -1), asked.get("rank", -1)
        if asked_world not in (-1, None, world_size) or rank not in (-1, None, 0):
            raise ValueError(
                f"the script asks for rank {rank} of {asked_world} ranks, but it runs as rank 0 of the "
                f"fake process group of {world_size} ranks (--world-size {world_size}); take rank and world "
                "size from the RANK and WORLD_SIZE environment variables, as under torchrun")

    def destroy_process_group(group=None):
        if group is not None and group is not dist.group.WORLD:
            original_destroy(group)

    modules = _torch_compat.process_group_function_modules()
    names = ("init_process_group", "destroy_process_group")
    saved = {(module, name): getattr(module, name) for module in modules for name in names}
    for module in modules:
        module.init_process_group = init_process_group
        module.destroy_process_group = destroy_process_group
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
        if dist.is_initialized():
            original_destroy()
