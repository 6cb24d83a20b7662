"""Param groups that name their own optimizer class, and whole-parameter optimizers.

``ZeroOptimizer(params, optimizer_class=torch.optim.Muon, ...)`` or a param group
``{"params": ..., "optimizer_class": torch.optim.AdamW, "lr": ...}`` beside others: the groups
are split by (class, whole parameter or not), each part gets its inner optimizer (element-wise
ones from ``kernels.InnerOptimizerBuilder``: zerocompile's fused kernels where they apply;
whole-parameter ones a ``WholeParameterOptimizer``), and ``GroupedOptimizer`` presents them as
one inner optimizer with the param groups in the order given. With one element-wise class for
every group the inner optimizer is built exactly as before (no ``GroupedOptimizer``).
"""

from __future__ import annotations

import torch

from zerocompile.optim.buckets import bucket_bytes
from zerocompile.optim.kernels import InnerOptimizerBuilder
from zerocompile.optim.rules import needs_whole_parameter
from zerocompile.optim.whole_param import OWN_KEYS, WholeParameterOptimizer, placeholder

WHOLE_PARAMETER_KERNEL = "whole_parameter"
"""``ZeroOptimizer.kernel`` of a part run by ``WholeParameterOptimizer`` (the class's own code)."""


def group_class(group: dict, default_class: type) -> type:
    """The optimizer class of param group ``group`` (its ``optimizer_class``, else the default)."""
    return group.get("optimizer_class", default_class)


def class_defaults(optimizer_class: type, shape=(2, 2)) -> dict:
    """``optimizer_class``'s own defaults, read from an instance over one placeholder tensor."""
    probe = placeholder(shape, torch.float32, "cpu").requires_grad_(False)
    return dict(optimizer_class([probe]).defaults)


class GroupedBuilder:
    """Builds the inner optimizer of groups that may name different classes. ``default_class``,
    ``choice`` (kernel), ``defaults`` and ``resolved``: as ``InnerOptimizerBuilder``'s, for the
    groups that name no class; ``whole_parameter``: the constructor's flag for those groups."""

    def __init__(self, default_class: type, choice: str, defaults: dict, resolved: dict,
                 whole_parameter: bool) -> None:
        self.default_class = default_class
        self.choice = choice
        self.defaults = defaults
        self.resolved = resolved
        self.whole_parameter = whole_parameter
        self.bound_parts: list[tuple[type, bool]] = []
        """The (class, whole parameter) parts of the groups the last ``build`` bound."""

    def part_of(self, group: dict) -> tuple[type, bool]:
        """(class, runs on whole parameters) of param group ``group``."""
        cls = group_class(group, self.default_class)
        flag = group.get("whole_parameter", self.whole_parameter if cls is self.default_class else False)
        return cls, needs_whole_parameter(cls, flag)

    def element_builder(self, cls: type) -> InnerOptimizerBuilder:
        if cls is self.default_class:
            return InnerOptimizerBuilder(cls, self.choice, self.defaults, self.resolved)
        return InnerOptimizerBuilder(cls, self.choice, {}, class_defaults(cls))

    def build(self, groups: list[dict], params):
        """The inner optimizer over ``groups`` (params: the targets) and its kernel name."""
        parts: dict[tuple[type, bool], list[int]] = {}
        for i, group in enumerate(groups):
            parts.setdefault(self.part_of(group), []).append(i)
        if len(parts) > 1 and any(getattr(cls, "zerocompile_reduces_gradients", False) for cls, _ in parts):
            raise ValueError("ZeroOptimizer: a 1-bit optimizer (OneBitAdam, ZeroOneAdam) averages the gradients of "
                             "every parameter it holds itself; it cannot share a ZeroOptimizer with param groups of "
                             "other classes. Give it a ZeroOptimizer of its own, over all the model's parameters")
        clean = [{k: v for k, v in g.items() if k not in OWN_KEYS} for g in groups]
        built = []
        for (cls, whole), indices in parts.items():
            sub = [clean[i] for i in indices]
            if whole:
                self._check_no_offload(cls, sub, params)
                defaults = self.defaults if cls is self.default_class else {}
                inner = WholeParameterOptimizer(sub, cls, defaults, params, bucket_bytes(params.states()))
                built.append((inner, indices, WHOLE_PARAMETER_KERNEL))
            else:
                inner, kernel = self.element_builder(cls).build(sub, params)
                built.append((inner, indices, kernel))
        self.bound_parts = list(parts)
        if len(built) == 1:
            return built[0][0], built[0][2]
        kernels = "+".join(dict.fromkeys(k for _, _, k in built))
        return GroupedOptimizer([(inner, indices) for inner, indices, _ in built], len(groups)), kernels

    def unaddable_reason(self, kernel: str | None, group: dict) -> str | None:
        """Why the bound inner optimizer (of kernel ``kernel``) cannot take ``group``, or None:
        a whole-parameter optimizer or several classes are fixed when the optimizer binds (owners,
        parts); one element-wise class takes groups of that class its kernel supports."""
        cls, whole = self.part_of(group)
        if whole or len(self.bound_parts) > 1 or self.bound_parts[0][1]:
            return ("this optimizer runs a whole-parameter optimizer or several optimizer classes, whose owners "
                    "and parts are fixed when it binds (its first step); give every param group to the constructor")
        if (cls, whole) != self.bound_parts[0]:
            return (f"the group's optimizer_class {cls.__name__} is not the {self.bound_parts[0][0].__name__} this "
                    "optimizer bound; give every param group to the constructor")
        kernels = (kernel or "").split("+")
        fused = next((k for k in kernels if k in ("cpp", "triton")), None)
        reason = self.element_builder(cls).unaddable_reason(fused, {k: v for k, v in group.items() if k not in OWN_KEYS})
        if reason is None:
            return None
        return (f"the fused Adam kernel this optimizer uses cannot update this group ({reason}); build the "
                "ZeroOptimizer with kernel='torch' to add such groups")

    @staticmethod
    def _check_no_offload(cls: type, groups: list[dict], params) -> None:
        devices = {t.device.type for g in groups for t in g["params"]}
        settings = InnerOptimizerBuilder._offload_settings(params.states(), devices)
        if settings is not None:
            raise ValueError(
                f"ZeroOptimizer: offload_optimizer={settings.device!r} is not supported for {cls.__name__}, which "
                "runs on whole parameters at owner ranks: its state is already 1/N per rank. Drop the "
                "offload_optimizer option, or keep it for an element-wise optimizer in a ZeroOptimizer of its own")


class GroupedOptimizer:
    """Several inner optimizers as one: ``parts`` is ``[(optimizer, indices)]``, each part's
    param groups being the groups at ``indices`` of the whole list (``count`` groups)."""

    def __init__(self, parts: list, count: int) -> None:
        self.parts = parts
        self.param_groups: list = [None] * count
        self._parts_by_target: dict = {}        # id(target) -> the part that steps it
        for inner, indices in parts:
            for j, i in enumerate(indices):
                self.param_groups[i] = inner.param_groups[j]
                for t in inner.param_groups[j]["params"]:
                    self._parts_by_target[id(t)] = inner
        self.defaults: dict = {}

    @property
    def state(self) -> dict:
        """Every part's state, keyed by target."""
        out = {}
        for inner, _ in self.parts:
            out.update(inner.state)
        return out

    def step(self, closure=None):
        for inner, _ in self.parts:
            inner.step()

    def _part_of_target(self, target):
        return self._parts_by_target.get(id(target))

    def holds_whole_state(self, target) -> bool:
        inner = self._part_of_target(target)
        return inner is not None and getattr(inner, "holds_whole_state", lambda t: False)(target)

    def load_state_dict(self, state_dict: dict) -> None:
        """Split torch's layout over all groups into each part's own (positions renumbered)."""
        for inner, indices in self.parts:
            state, groups, mine = {}, [], 0
            for i in indices:
                saved = state_dict["param_groups"][i]
                ids = []
                for key in saved["params"]:
                    if key in state_dict["state"]:
                        state[mine] = state_dict["state"][key]
                    ids.append(mine)
                    mine += 1
                groups.append({**saved, "params": ids})
            inner.load_state_dict({"state": state, "param_groups": groups})

    def add_param_group(self, group: dict) -> None:
        raise ValueError("ZeroOptimizer.add_param_group: this optimizer runs several optimizer classes; "
                         "give every param group to the constructor")

    def zero_grad(self, set_to_none: bool = True) -> None:
        for inner, _ in self.parts:
            inner.zero_grad(set_to_none)


def check_group_shapes(group: dict, cls: type, whole: bool, defaults: dict) -> None:
    """Fail now, not at the first step, where a whole-parameter class refuses a parameter of the
    group (Muon takes 2-D parameters only): the class is built over placeholders of the
    parameters' shapes, which hold no memory."""
    if not whole:
        return
    hyper = {k: v for k, v in group.items() if k != "params" and k not in OWN_KEYS}
    tensors = [placeholder(p.shape, torch.float32, "cpu") for p in group["params"]]
    try:
        cls([{**hyper, "params": tensors}], **defaults)
    except (TypeError, ValueError, RuntimeError) as err:
        shapes = sorted({tuple(p.shape) for p in group["params"]})
        raise ValueError(f"ZeroOptimizer: {cls.__name__} refuses a parameter of this param group (shapes "
                         f"{shapes[:6]}): {err}. Give it only the parameters it takes (for Muon, the 2-D hidden "
                         "weight matrices) and the others to a param group or ZeroOptimizer with AdamW") from err


def nested_optimizers(inner) -> list:
    """``inner`` and every optimizer inside it (a ``GroupedOptimizer``'s parts, a
    ``WholeParameterOptimizer``'s user optimizer): the steps that are part of one ``ZeroOptimizer`` step."""
    if inner is None:
        return []
    out = [inner]
    if isinstance(inner, GroupedOptimizer):
        for part, _ in inner.parts:
            out += nested_optimizers(part)
    elif isinstance(inner, WholeParameterOptimizer):
        out.append(inner.inner)
    return out


def owner_of(inner, target) -> int | None:
    """The owner rank of ``target`` where a whole-parameter optimizer inside ``inner`` steps it,
    else None."""
    if isinstance(inner, WholeParameterOptimizer):
        return inner.owner_of(target) if inner.has(target) else None
    if isinstance(inner, GroupedOptimizer):
        part = inner._part_of_target(target)
        return owner_of(part, target) if part is not None else None
    return None
