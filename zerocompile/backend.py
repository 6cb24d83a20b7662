"""The Dynamo backend ``"zero"`` (registered through the ``torch_dynamo_backends`` entry point)."""

from __future__ import annotations

from zerocompile.capture import compile_frame
from zerocompile.config import ZeroConfig, ZeroConfigError


def zero_backend(gm, example_inputs, options=None, mode=None, **kwargs):
    """``torch.compile(model, backend="zero", options={...})`` calls this once per frame."""
    if kwargs:
        raise ZeroConfigError(f"unexpected backend arguments {sorted(kwargs)}; pass options={{...}}")
    if mode not in (None, "default"):
        raise ZeroConfigError(
            f"torch.compile mode={mode!r} is not supported by the 'zero' backend; "
            "use options={...} (see docs/config.md)")
    cfg = ZeroConfig.from_options(options)
    return compile_frame(gm, example_inputs, cfg)
