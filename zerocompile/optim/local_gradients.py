"""``ZeroOptimizer`` with an inner optimizer that averages gradients itself (1-bit Adam and
0/1 Adam, ``zerocompile_reduces_gradients = True``; see ``compressed_momentum.py``).

Such an optimizer updates whole parameters from its own compressed average of the momentum, so
it runs where DeepSpeed offers it: at stage 0, without ``offload_optimizer``, with torch's code
(no fused kernel). This module builds it (``build``: the checks, then ``bind_group``), answers
``GradReducer``'s question of whether the coming step wants local gradients
(``takes_local_gradients``), and says why gradient clipping cannot run in its compression
phase (``clipping_error``)."""

from __future__ import annotations

import logging

from zerocompile.runtime.offload_settings import OffloadSettings

log = logging.getLogger("zerocompile")


def reduces_gradients(optimizer_class_or_inner) -> bool:
    """The class (or instance) averages gradients itself."""
    return bool(getattr(optimizer_class_or_inner, "zerocompile_reduces_gradients", False))


def check_stage0(params, name: str) -> None:
    """Raise ``ValueError`` when a parameter is sharded (stages 1-3) or its frame offloads the
    optimizer state. ``params``: the optimizer's ``OptimizerParams``."""
    for sp in params.states():
        if sp.rules.shards_master:
            raise ValueError(
                f"ZeroOptimizer: {name} runs at stage 0 only (DeepSpeed offers 1-bit Adam and 0/1 Adam at stage 0 "
                f"only): it averages each whole parameter's momentum over the ranks, but parameter '{sp.name}' is "
                f"sharded at stage {sp.stage}. Compile the model with options={{'stage': 0}} (DeepSpeed: "
                "zero_optimization.stage 0), or use torch.optim.AdamW at stages 1-3")
        offload = sp.option("step", "offload_optimizer", OffloadSettings())
        if offload != OffloadSettings():
            raise ValueError(f"ZeroOptimizer: {name} cannot offload its optimizer state (offload_optimizer="
                             f"{offload.device!r} on parameter '{sp.name}'); drop the option")


def build(optimizer_class: type, choice: str, groups: list[dict], params, defaults: dict):
    """The inner optimizer of a class that averages gradients itself, over ``groups`` (whose
    params are the targets: the parameters themselves at stage 0), bound to the parameters'
    group. ``choice``: the ``kernel`` argument (``"fused"`` is refused: there is no fused kernel)."""
    name = optimizer_class.__name__
    check_stage0(params, name)
    if choice == "fused":
        raise ValueError(f"ZeroOptimizer(kernel='fused'): {name} has no fused kernel; use kernel='auto' or 'torch'")
    inner = optimizer_class(groups, **defaults)
    inner.bind_group(params.layout_group(), params.session())
    log.info("ZeroOptimizer: %s steps with torch's kernels and averages the momentum compressed after its "
             "warm-up (runtime/compressed_allreduce.py)", name)
    return inner


def takes_local_gradients(binding) -> bool:
    """Whether the gradients of the coming step stay local (``GradReducer`` skips their
    all-reduce): the bound inner optimizer (``binding``: the optimizer's ``InnerBinding``)
    averages gradients itself and says so. Checks again that no parameter was sharded since
    it bound."""
    inner = binding.inner
    if inner is None or not reduces_gradients(inner):
        return False
    check_stage0(binding.params, type(inner).__name__)
    return bool(inner.takes_local_gradients())


def clipping_error(inner) -> RuntimeError:
    """The error of clipping in a step whose gradients are local (1-bit Adam's compression phase)."""
    return RuntimeError(
        f"ZeroOptimizer: {type(inner).__name__} is past its warm-up, so this step's gradients are each rank's own "
        "(never all-reduced) and their global norm is not known; DeepSpeed clips each rank's local gradient "
        "instead, which changes the compressed momentum differently per rank. Clip only during the warm-up "
        "(check opt.inner.takes_local_gradients()), or drop gradient_clipping / clip_grad_norm_")
