"""Leaf modules: modules whose parameters are gathered together, at the module's entry.

A module whose forward runs parts of itself only for some inputs (a mixture of experts
whose experts run only when the router sends them tokens) issues data-dependent
collectives if each part gathers its own parameters: one rank gathers expert 2, the other
does not, and the ranks' collective sequences part. ``zerocompile.set_leaf_modules(model,
[MoEBlock])`` (DeepSpeed's ``set_z3_leaf_modules``) makes each such module one unit:

- its ``forward`` runs eagerly, outside Dynamo (a graph break at its call; nothing inside
  it is compiled, as with ``torch.compiler.disable``), so no compiled frame inside it issues
  collectives of its own;
- on entry it gathers all of its parameters (and its submodules'), whatever the routing,
  in one fixed order: every rank issues the same all-gathers;
- its parameters are sharded like any other (the first compiled frame whose model holds
  the module shards them, ``capture._param_states``); they are one eager unit
  (``runtime/eager_regions.py``): gathered for the leaf's forward, freed after it, gathered
  again right before its backward and freed after that, as DeepSpeed does. At stages 2 and 3
  their gradients are reduce-scattered when the backward ends (at stages 0 and 1 by
  ``ZeroOptimizer.step()``), zeros where a rank's data did not reach a parameter.

The cost: at most the leaves running now are whole, and the leaf's own compute runs eagerly.
"""

from __future__ import annotations

import torch

from zerocompile.runtime.sharded_param import get_state

_LEAF = "_zerocompile_leaf"
"""Attribute on a leaf module: its name in the model (nothing is set on its parameters:
``leaf_parameters`` finds them from the modules)."""
EAGER_UNIT = "_zerocompile_eager_unit"
"""Attribute on a module: its ``EagerUnit`` (``runtime/eager_regions.py``), once installed."""


def set_leaf_modules(model: torch.nn.Module, classes) -> list[str]:
    """Make every module of ``model`` that is an instance of one of ``classes`` a leaf module
    (see the module docstring); return their names. Call it before the first compiled
    forward. Raises if no module of ``model`` is of those classes."""
    classes = tuple(classes) if isinstance(classes, (list, tuple, set)) else (classes,)
    if not classes or not all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in classes):
        raise TypeError(f"zerocompile.set_leaf_modules: expected a list of nn.Module classes, got {classes!r}")
    marked = []
    for name, module in model.named_modules():
        if isinstance(module, classes):
            _make_leaf(module, name)
            marked.append(name)
    if not marked:
        raise ValueError(
            f"zerocompile.set_leaf_modules: no module of {model.__class__.__name__} is a "
            f"{' or '.join(c.__name__ for c in classes)}")
    return marked


def is_leaf(module: torch.nn.Module) -> bool:
    return getattr(module, _LEAF, None) is not None


def leaf_parameters(roots) -> dict:
    """``{id(param): the name of its leaf module}`` for every parameter of a leaf module under
    ``roots`` (a parameter of leaves nested in one another: the outermost one's)."""
    out: dict = {}
    for root in roots:
        for module in root.modules():
            name = getattr(module, _LEAF, None)
            if name is not None:
                for param in module.parameters():
                    out.setdefault(id(param), name)
    return out


def _make_leaf(module: torch.nn.Module, name: str) -> None:
    if is_leaf(module):
        return
    original = module.forward

    @torch.compiler.disable
    def forward(*args, **kwargs):
        unit = getattr(module, EAGER_UNIT, None)
        if unit is None:        # before the model's first compiled frame: no shard states, or gathered
            gather_leaf_parameters(module)
            return original(*args, **kwargs)
        return unit.run(original, args, kwargs)

    module.forward = forward
    setattr(module, _LEAF, name)


def gather_leaf_parameters(module: torch.nn.Module) -> None:
    """Gather every freed parameter of ``module`` and its submodules, in ``parameters()``
    order (the same on every rank): an all-gather each, none for those gathered already.
    They stay gathered until the optimizer step (before the leaf's unit exists)."""
    for param in module.parameters():
        state = get_state(param)
        if state is not None:
            state.materialize()


def leaf_modules(root: torch.nn.Module):
    """``(name, module)`` of each outermost leaf module under ``root`` (names relative to it)."""
    skip = []
    for name, module in root.named_modules():
        if any(name.startswith(prefix) for prefix in skip):
            continue
        if is_leaf(module):
            skip.append(f"{name}." if name else "")
            yield name, module
