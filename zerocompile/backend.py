"""The Dynamo backend ``"zero"`` (registered through the ``torch_dynamo_backends`` entry point)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os

from zerocompile import _torch_compat, env
from zerocompile.capture import compile_frame
from zerocompile.config import ZeroConfig
from zerocompile.errors import ZeroConfigError

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
    """``torch.compile(model, backend="zero", options={...})`` calls this once per frame."""
    if kwargs:
        raise ZeroConfigError(f"unexpected backend arguments {sorted(kwargs)}; pass options={{...}}")
    if mode not in (None, "default"):
        raise ZeroConfigError(
            f"torch.compile mode={mode!r} is not supported by the 'zero' backend; "
            "use options={...} (see docs/config.md)")
    cfg = ZeroConfig.from_options(_with_environment_options(options))
    return compile_frame(gm, example_inputs, cfg)


def _with_environment_options(options):
    """``options`` updated with the options of an enclosing ``overriding_options``, else with
    the JSON object in ``ZEROCOMPILE_OPTIONS`` (set by ``zerocompile dump --options``): the
    override's keys win."""
    extra = _OVERRIDE.get()
    if extra is None:
        try:
            extra = env.options_override()
        except ValueError as err:
            raise ZeroConfigError(str(err)) from None
    if extra is None:
        return options
    if isinstance(options, (str, os.PathLike)):          # a DeepSpeed JSON file
        options = ZeroConfig.from_options(options)
    if isinstance(options, ZeroConfig):
        options = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    merged = {**(options or {}), **extra}
    if extra:
        log.info("options from ZEROCOMPILE_OPTIONS override the script's: %s", sorted(extra))
    return merged
