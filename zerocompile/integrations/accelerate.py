"""``ZeroAccelerator``: HF Accelerate with a zerocompile model.

A plain ``Accelerator`` wraps every model it prepares in ``DistributedDataParallel`` when it
runs on several processes, and its ``clip_grad_norm_`` clips each rank's local gradients. With
zerocompile both are wrong: zerocompile already reduces the gradients (in its compiled
backward at stages 2-3, in ``ZeroOptimizer.step()`` at stages 0-1), and at stages 2-3 each
rank holds only a shard of each gradient, so the norm must be taken over all ranks. For
training, ``ZeroAccelerator`` changes exactly these two methods:

- ``prepare_model`` returns the model as it is (registered with the accelerator and moved to
  its device if nothing is sharded yet, never wrapped);
- ``clip_grad_norm_(parameters, max_norm)`` calls ``clip_grad_norm_`` of the prepared
  ``ZeroOptimizer`` that holds those parameters: the global norm, as one process would compute
  it on the whole batch.

It also makes three more things right:

- ``get_state_dict`` (and so ``save_model``) gathers a zerocompile model's full state on the
  main process, one tensor at a time, as Accelerate's DeepSpeed ZeRO-3 path does; Accelerate's
  own would read the model's sharded ``state_dict()``;

- construction refuses an Accelerate state that does not span the ranks torch.distributed
  runs: on a machine without GPUs, Accelerate started without ``cpu=True`` sets itself up
  with ``distributed_type`` NO (one process, no data sharding) while zerocompile shards over
  every rank, so every rank would train on the same batches;
- ``save_state`` / ``load_state`` write and read each zerocompile model, with the prepared
  ``ZeroOptimizer`` that holds its parameters, as a sharded ``zerocompile.save_checkpoint``
  directory (``zerocompile_state`` inside the output directory, ``zerocompile_state_<i>`` for
  the i-th such model); Accelerate's own files (``model.safetensors``, ``optimizer.bin``) would
  hold one rank's shards, or fail at stage 3. RNG, scheduler, data loader, step and custom
  states are saved and loaded by Accelerate as always.

Everything else (data loader sharding, gradient accumulation, ``backward``, schedulers,
``gather`` for metrics) is Accelerate's own. Mixed precision is zerocompile's
(``param_dtype``, ``loss_scale``): build the accelerator with ``mixed_precision="no"``.
"""

from __future__ import annotations

import contextlib
import os

import accelerate
import torch
import torch.distributed as dist
from accelerate.utils import DistributedType

from zerocompile.checkpoint import load_checkpoint, save_checkpoint
from zerocompile.optimizer import ZeroOptimizer
from zerocompile.runtime.sharded_param import get_state
from zerocompile.state_dict import full_state_dict

ACCELERATE_VERSIONS = (">=1.10", "<2")
"""The accelerate versions this module is written and tested for (pyproject's extra)."""

STATE_DIR = "zerocompile_state"
"""The sharded checkpoint (model and optimizer) inside a ``save_state`` or Trainer checkpoint directory."""


def check_spans_the_ranks(accelerator: accelerate.Accelerator, who: str, cpu_flag: str) -> None:
    """Raise if ``accelerator`` does not run as one of all the processes torch.distributed runs
    (or torchrun started: ``WORLD_SIZE``). Every rank decides alone, from its own state, so
    every rank raises and none waits in a collective."""
    if dist.is_available() and dist.is_initialized():
        world, source = dist.get_world_size(), "torch.distributed runs"
    else:
        world, source = int(os.environ.get("WORLD_SIZE", "1")), "WORLD_SIZE says"
    if world > 1 and (accelerator.distributed_type == DistributedType.NO or accelerator.num_processes != world):
        raise RuntimeError(
            f"{who}: {source} {world} processes, but Accelerate set itself up with distributed_type "
            f"{accelerator.distributed_type.value} over {accelerator.num_processes} process(es): it neither shards "
            f"the data nor treats the ranks as one job, so every rank would train on the same batches while "
            f"zerocompile shards the model over {world} ranks. On a machine without GPUs pass {cpu_flag} (or set "
            f"ACCELERATE_USE_CPU=1 in the environment, as `accelerate launch --cpu` does) so that Accelerate runs "
            f"as MULTI_CPU over the {world} ranks; if an Accelerator or PartialState was built earlier in this "
            f"process without it, that state is kept: build it with the flag, or set the variable before it. "
            f"Accelerate also needs the launcher's RANK, WORLD_SIZE and LOCAL_RANK in the environment (torchrun or "
            f"accelerate launch set them).")


def zero_optimizer_of(optimizers, parameters) -> ZeroOptimizer | None:
    """The ``ZeroOptimizer`` among ``optimizers`` (prepared or not) that holds ``parameters``."""
    wanted = {id(p) for p in parameters}
    for opt in optimizers:
        inner = getattr(opt, "optimizer", opt)        # accelerate's AcceleratedOptimizer wraps it
        if isinstance(inner, ZeroOptimizer):
            held = {id(p) for group in inner.param_groups for p in group["params"]}
            if wanted & held:
                return inner
    return None


def _state_dir(index: int) -> str:
    return STATE_DIR if index == 0 else f"{STATE_DIR}_{index}"


class ZeroAccelerator(accelerate.Accelerator):
    """An ``Accelerator`` for zerocompile models (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_spans_the_ranks(self, "ZeroAccelerator", "cpu=True to ZeroAccelerator(...)")

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False):
        if model not in self._models:
            self._models.append(model)
        if device_placement is None:
            device_placement = self.device_placement
        if device_placement and not any(get_state(p) is not None for p in model.parameters()):
            model.to(self.device)        # before the first forward shards it; never after
        return model

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        opt = zero_optimizer_of(self._optimizers, parameters)
        if opt is None:
            raise ValueError("ZeroAccelerator.clip_grad_norm_: no prepared ZeroOptimizer holds these parameters; "
                             "prepare your zerocompile.ZeroOptimizer with accelerator.prepare(...) first")
        return opt.clip_grad_norm_(max_norm, norm_type)

    # -- the full model: get_state_dict / save_model --------------------------------------
    def get_state_dict(self, model, unwrap=True):
        """The full state dict of a zerocompile model on the main process, None on the others
        (as Accelerate's DeepSpeed ZeRO-3 path returns it): gathered one tensor at a time, in
        the parameters' own dtype; a collective. Accelerate's own for other models.
        ``save_model`` writes it (Hugging Face's layout; ``from_pretrained`` reads it with the
        model's config)."""
        if not any(get_state(p) is not None for p in model.parameters()):
            return super().get_state_dict(model, unwrap)
        full = full_state_dict(model)       # rank 0 (the main process) gets the tensors
        return full if self.is_main_process else None

    # -- save_state / load_state -------------------------------------------------------
    def _zero_models(self) -> list[tuple[torch.nn.Module, ZeroOptimizer | None]]:
        """The prepared models zerocompile holds (compiled with backend='zero' and run, or held by a
        prepared ZeroOptimizer), each with the prepared ZeroOptimizer of its parameters."""
        pairs, held = [], set()
        for model in self._models:
            opt = zero_optimizer_of(self._optimizers, model.parameters())
            if opt is not None or any(get_state(p) is not None for p in model.parameters()):
                pairs.append((model, opt))
                if opt is not None:
                    held.add(id(opt))
        for opt in self._optimizers:
            inner = getattr(opt, "optimizer", opt)
            if isinstance(inner, ZeroOptimizer) and id(inner) not in held:
                raise ValueError("ZeroAccelerator: a prepared ZeroOptimizer holds parameters of no prepared model; "
                                 "pass its model to accelerator.prepare(...) too, so that save_state / load_state "
                                 "can write and read them together as a sharded checkpoint")
        return pairs

    @contextlib.contextmanager
    def _without(self, pairs):
        """Accelerate's own saving and loading, with zerocompile's models and optimizers left out."""
        models, optimizers = self._models, self._optimizers
        zero_models = {id(m) for m, _ in pairs}
        zero_opts = {id(o) for _, o in pairs if o is not None}
        self._models = [m for m in models if id(m) not in zero_models]
        self._optimizers = [o for o in optimizers if id(getattr(o, "optimizer", o)) not in zero_opts]
        try:
            yield
        finally:
            self._models, self._optimizers = models, optimizers

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs):
        """Accelerate's ``save_state``, with each zerocompile model and its ``ZeroOptimizer`` saved
        as a sharded checkpoint (``zerocompile_state``) in the same directory. A collective."""
        pairs = self._zero_models()
        with self._without(pairs):
            location = super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        for index, (model, opt) in enumerate(pairs):
            save_checkpoint(os.path.join(location, _state_dir(index)), model, opt)
        return location

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs):
        """Accelerate's ``load_state``, with each zerocompile model and its ``ZeroOptimizer`` read
        back from the sharded checkpoint ``save_state`` wrote. A collective."""
        pairs = self._zero_models()
        found = []

        def resolved(models, where):    # where Accelerate reads from (automatic naming resolved), before it reads
            for index in range(len(pairs)):
                if not os.path.isdir(os.path.join(where, _state_dir(index))):
                    raise FileNotFoundError(
                        f"ZeroAccelerator.load_state: {where} has no {_state_dir(index)} directory for zerocompile "
                        f"model {index}; it was not written by ZeroAccelerator.save_state with the same models "
                        "prepared")
            found.append(where)

        handle = self.register_load_state_pre_hook(resolved)
        try:
            with self._without(pairs):
                super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        finally:
            handle.remove()
        for index, (model, opt) in enumerate(pairs):
            load_checkpoint(os.path.join(found[0], _state_dir(index)), model, opt)
