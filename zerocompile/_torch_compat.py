"""The private torch APIs zerocompile depends on, in one place.

Each function says why it needs a private API. ``tests/test_torch_compat.py``
exercises every one of them directly, so a torch upgrade that changes them fails
there, loudly, rather than somewhere deep in a training run.
"""

from __future__ import annotations

import torch


def placeholder_source(node: torch.fx.Node):
    """The Dynamo ``Source`` of a placeholder of a Dynamo graph, or None.

    Why private: Dynamo records where each graph input came from (e.g.
    ``L['self']._modules['l1']._parameters['weight']``) only in ``node.meta["grapharg"]``;
    we need it to name parameters in errors and to find the module that owns them.
    """
    grapharg = node.meta.get("grapharg")
    return getattr(grapharg, "source", None)


def source_path(source) -> list:
    """The chain of a Dynamo source from its root local, e.g. ``[('local', 'self'), ('key', 'l1'), ...]``.

    Why private: Source classes live in ``torch._dynamo.source``; we read only their
    ``base`` / ``member`` / ``index`` / ``local_name`` attributes.
    """
    path = []
    while source is not None:
        if hasattr(source, "local_name") and getattr(source, "base", None) is None:
            path.append(("local", source.local_name))
        elif hasattr(source, "member"):
            path.append(("attr", source.member))
        elif hasattr(source, "index"):
            path.append(("key", source.index))
        source = getattr(source, "base", None)
    return list(reversed(path))


def param_fqn(source) -> str | None:
    """A readable dotted name for a parameter source (``blocks.0.attn.weight``)."""
    names = []
    for kind, value in source_path(source):
        if kind == "local":
            continue
        if kind == "attr" and value in ("_modules", "_parameters", "_buffers"):
            continue
        names.append(str(value))
    return ".".join(names) or None


def frame_root_object(local_name: str):
    """The object bound to ``local_name`` in the frame Dynamo is compiling, or None.

    Why private: a Dynamo backend receives the graph, not the module; the frame's locals
    are reachable only through the current ``InstructionTranslator``. We use them to find
    the modules that own stage-3 parameters, to gather those on demand in eager code.
    """
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - not inside a Dynamo compile
        return None
    if tx is None:
        return None
    return getattr(tx, "f_locals", {}).get(local_name)


def root_module(source):
    """The ``nn.Module`` bound to the frame local a parameter source starts from, or None."""
    path = source_path(source)
    if not path or path[0][0] != "local":
        return None
    obj = frame_root_object(path[0][1])
    return obj if isinstance(obj, torch.nn.Module) else None
