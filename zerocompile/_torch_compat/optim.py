"""torch.optim's step wrapper, run by ``ZeroOptimizer.step`` itself.

torch's ``Optimizer.__init__`` wraps each class's ``step`` once (``profile_hook_step``): a
profiler range ``Optimizer.step#Class.step`` around the step hooks (global and the optimizer's
own, ``register_step_pre_hook``/``register_step_post_hook``) and the step. The range is entered
whether or not a profiler runs, and entering and leaving it costs 0.1-0.2 ms once the update has
streamed the caches out (measured in ``benchmarks/optimizer_step.py``'s setting: 2-4% of a 16.8M
element step). ``ZeroOptimizer`` therefore opts out of the wrapping (``step_with_hooks``) and runs
the same hooks, in the same order with the same arguments, through ``run_step``, entering the
range only while a profiler records.
"""

from __future__ import annotations

import contextlib
import functools
from itertools import chain

import torch
from torch.optim import optimizer as torch_optimizer


def step_with_hooks(func):
    """Decorate a ``ZeroOptimizer``-like class's ``step``: torch's ``Optimizer`` leaves it
    unwrapped, and each call runs through ``run_step`` (hooks, and the profiler range while a
    profiler records). A subclass that overrides ``step`` gets torch's own wrapper on its
    method; calling this one from it (``super().step()``) then runs the step alone, so no hook
    runs twice.

    Why private: ``Optimizer._patch_step_function`` wraps ``cls.step`` unless it has the
    attribute ``hooked``, which it sets on the wrapper it installs."""

    @functools.wraps(func)
    def step(*args, **kwargs):
        optimizer = args[0]
        if type(optimizer).step is not step:      # a subclass's step, wrapped by torch, called this
            return func(*args, **kwargs)
        return run_step(optimizer, func, args, kwargs)

    step.hooked = True
    return step


def profiler_enabled() -> bool:
    """Whether a profiler records on this thread (``torch.profiler.profile``, the autograd
    profiler, an on-demand Kineto trace).

    Why private: ``torch._C._autograd._profiler_enabled`` is what torch's own profiler code
    asks; there is no public query."""
    return torch._C._autograd._profiler_enabled()


def run_step(optimizer, func, args: tuple, kwargs: dict):
    """``func(*args, **kwargs)`` (``args[0]`` is ``optimizer``) as torch's step wrapper runs it:
    the global and then the optimizer's pre-hooks (each may return new ``(args, kwargs)``), the
    step, ``optimizer._optimizer_step_code()`` (the profiler's Python tracer hooks it), the
    optimizer's and then the global post-hooks, all inside the profiler range
    ``Optimizer.step#Class.step`` while a profiler records.

    Why private: the global hooks live in ``torch.optim.optimizer._global_optimizer_pre_hooks``
    and ``_global_optimizer_post_hooks``, an optimizer's own in its ``_optimizer_step_pre_hooks``
    and ``_optimizer_step_post_hooks``; torch's wrapper reads them there."""
    pre = (torch_optimizer._global_optimizer_pre_hooks, optimizer._optimizer_step_pre_hooks)
    post = (optimizer._optimizer_step_post_hooks, torch_optimizer._global_optimizer_post_hooks)
    recording = profiler_enabled()
    if not (recording or any(pre) or any(post)):
        # the common case, nothing to run around the step: no context, no chains (the step's
        # Python is a few percent of a large update's time once the update has streamed the
        # caches out, and every object touched then is a cache miss)
        out = func(*args, **kwargs)
        optimizer._optimizer_step_code()
        return out
    scope = (torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step")
             if recording else contextlib.nullcontext())
    with scope:
        for pre_hook in chain(*(hooks.values() for hooks in pre)):
            result = pre_hook(optimizer, args, kwargs)
            if result is not None:
                if isinstance(result, tuple) and len(result) == 2:
                    args, kwargs = result
                else:
                    raise RuntimeError(f"{func} must return None or a tuple of (new_args, new_kwargs), but got "
                                       f"{result}.")
        out = func(*args, **kwargs)
        optimizer._optimizer_step_code()
        for post_hook in chain(*(hooks.values() for hooks in post)):
            post_hook(optimizer, args, kwargs)
    return out
