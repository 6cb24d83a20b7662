"""The Dynamo backend ``"zero"`` (registered through the ``torch_dynamo_backends`` entry point)."""

from __future__ import annotations

import contextlib
import contextvars
import logging

from zerocompile import _torch_compat, env, repeated_blocks
from zerocompile.capture import compile_frame, frame_name
from zerocompile.collection_pause import collection_paused
from zerocompile.config import ZeroConfig, options_needing_a_new_trace
from zerocompile.deep_stack import on_a_deep_stack
from zerocompile.errors import CollectiveMismatchError, ZeroConfigError
from zerocompile.runtime.session import PROCESS

log = logging.getLogger("zerocompile")

# checkpointed regions (HF's gradient_checkpointing_enable()) compile, so their parameters shard
_torch_compat.trace_checkpointed_regions_with_side_effects()

_OVERRIDE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("zerocompile_options_override", default=None)
"""Options that override the script's in this context (``overriding_options``), or None."""


@contextlib.contextmanager
def overriding_options(options: dict):
    """While open, every ``backend="zero"`` compile in this context merges ``options`` over the
    script's own, as ``ZEROCOMPILE_OPTIONS`` does for a process (and in its place: the
    variable is not read meanwhile). ``zerocompile plan`` runs the script inside it."""
    token = _OVERRIDE.set(dict(options))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def zero_backend(gm, example_inputs, options=None, mode=None, **kwargs):
    """``torch.compile(model, backend="zero", options={...})`` calls this once per frame; Python's
    automatic garbage collection is paused meanwhile (``collection_pause.py``), and the compile
    runs on a deep stack, free of CPython's stack-chunk thrashing (``deep_stack.py``)."""
    with collection_paused():
        return on_a_deep_stack(_compile, gm, example_inputs, options, mode, **kwargs)


def _compile(gm, example_inputs, options, mode, **kwargs):
    """``zero_backend``'s work."""
    if kwargs:
        raise ZeroConfigError(f"unexpected backend arguments {sorted(kwargs)}; pass options={{...}}")
    if mode not in (None, "default"):
        raise ZeroConfigError(
            f"torch.compile mode={mode!r} is not supported by the 'zero' backend; "
            "use options={...} (see docs/config.md)")
    cfg = _with_environment_options(options)

    def compile_piece(piece_gm, piece_inputs, name=None, session=None):
        runner = compile_frame(piece_gm, piece_inputs, cfg, frame=name, session=session)
        runner.script_options = options
        return runner

    minimum = repeated_blocks.min_blocks(cfg.compiler.repeated_blocks)
    blocks = None if minimum is None else repeated_blocks.block_container(gm, minimum)
    try:
        if blocks is not None:
            # a deep model compiled whole: its identical layers compile once (repeated_blocks.py)
            blockwise = repeated_blocks.compile_blockwise(gm, list(example_inputs), *blocks, compile_piece,
                                                          frame_name(gm), cfg.sharding.param_dtype)
            if blockwise is not None:
                return blockwise
        return compile_piece(gm, example_inputs)
    except CollectiveMismatchError as err:
        # a compile's collectives parted (a frame compiled on some ranks only): the user's
        # ``except CollectiveMismatchError`` must see it, not Dynamo's BackendCompilerFailed
        raise _torch_compat.passed_through_dynamo(err) from None


def recompile_with_overriding_options(options: dict) -> int:
    """Inside ``overriding_options``: take ``options`` in the place of its options, for the frames
    compiled from now on and for every compiled frame alive, whose passes run again over its
    traced graph (``FrameRunner.recompile``). The new options may change only the pass options
    (``config.PASS_OPTIONS``) of each frame's; otherwise ``ZeroConfigError``, raised before any
    frame changes. Returns how many frames were recompiled. ``zerocompile plan`` plans several
    option sets on one trace of a script with it."""
    if _OVERRIDE.get() is None:
        raise RuntimeError("recompile_with_overriding_options needs an enclosing overriding_options()")
    runners = PROCESS.frames()
    configs = []
    for runner in runners:
        cfg = _merged(runner.script_options, options)
        changed = options_needing_a_new_trace(runner.config, cfg)
        if changed:
            raise ZeroConfigError(f"[{runner.frame}] {', '.join(changed)}: other than the frame was compiled with; "
                                  "only the pass options (config.PASS_OPTIONS) can change without tracing the "
                                  "script again")
        configs.append(cfg)
    _OVERRIDE.set(dict(options))
    with collection_paused():
        on_a_deep_stack(_recompile_all, runners, configs)
    return len(runners)


def _recompile_all(runners, configs) -> None:
    for runner, cfg in zip(runners, configs):
        runner.recompile(cfg)


def _with_environment_options(options):
    """The config of ``options`` updated with the options of an enclosing ``overriding_options``, else with
    the JSON object in ``ZEROCOMPILE_OPTIONS`` (set by ``zerocompile dump --options``): the
    override's keys win."""
    extra = _OVERRIDE.get()
    if extra is None:
        try:
            extra = env.options_override()
        except ValueError as err:
            raise ZeroConfigError(str(err)) from None
    if extra is None:
        return ZeroConfig.from_options(options)
    if extra:
        log.info("options from ZEROCOMPILE_OPTIONS override the script's: %s", sorted(extra))
    return _merged(options, extra)


def _merged(options, extra: dict) -> ZeroConfig:
    """The script's ``options`` (a dict, a DeepSpeed JSON file or a ``ZeroConfig``) with ``extra``
    parsed over them (each value parsed once; ``extra``'s win, DeepSpeed keys of the script's too)."""
    return ZeroConfig.from_options(options).with_options(extra)
