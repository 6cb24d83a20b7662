"""``ZeroTrainer``: ``transformers.Trainer`` training with zerocompile, at any stage; and
``zero_trainer(cls)``, the same for any ``Trainer`` subclass (TRL's: ``integrations/trl.py``).

    trainer = ZeroTrainer(model=model, args=args, train_dataset=..., zero_options={"stage": 3})
    trainer.train()                  # or trainer.train(resume_from_checkpoint=True)

What it changes in ``Trainer`` (and why):

- the model the trainer holds once its ``__init__`` is done (TRL may load it from a name or wrap
  it in a ``PeftModel``) is compiled in place with ``backend="zero"`` and ``zero_options`` (HF's
  own ``torch_compile`` goes through Accelerate's ``TorchDynamoPlugin``, which does not know the
  backend), unless it was compiled in place already; it stays the user's ``PreTrainedModel``; the
  models TRL runs besides it (``FROZEN_MODEL_ATTRIBUTES``: a DPO reference, a reward model) are
  frozen and compiled at stage 3 for inference, each its own model (session);
- ``TrainingArguments(bf16=True)`` (TRL's default) computes in bfloat16 from float32 master
  shards (``param_dtype``), as DeepSpeed's ``bf16`` does under the Trainer; ``fp16=True`` is
  refused with the options to use (zerocompile's loss scaling is inside the compiled backward);
- its accelerator is a ``ZeroAccelerator`` (``zerocompile/integrations/accelerate.py``): no
  ``DistributedDataParallel`` around the model, and gradient clipping over all ranks; an
  Accelerate state that does not span the ranks (on CPUs, ``use_cpu=True`` missing) is refused;
- the optimizer is a ``ZeroOptimizer`` around the optimizer class and hyperparameters the
  ``TrainingArguments`` ask for (``optim``, ``learning_rate``, ``weight_decay`` and its
  no-decay groups, betas, epsilon);
- saving: ``save_model`` writes the Hugging Face layout from the shards on every rank
  (``zerocompile.save_pretrained``); a checkpoint's optimizer state goes to a sharded
  ``zerocompile.save_checkpoint`` directory (``zerocompile_state``) instead of rank 0's
  ``optimizer.pt`` (which would hold rank 0's shards only); resuming reads both back.

Gradient accumulation, learning-rate schedules, evaluation, logging, RNG state and the
data loaders (one shard of the data per rank) are the Trainer's own.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os

import torch
import transformers

import zerocompile
from zerocompile.config import ZeroConfig
from zerocompile.integrations.accelerate import STATE_DIR, ZeroAccelerator, check_spans_the_ranks
from zerocompile.option_sections import StepOptions
from zerocompile.optimizer import ZeroOptimizer

TRANSFORMERS_VERSIONS = (">=5.0", "<6")
"""The transformers versions this module is written and tested for (pyproject's extra)."""

SCHEDULER_NAME = "scheduler.pt"


def _unwrapped(optimizer):
    """The ZeroOptimizer inside accelerate's ``AcceleratedOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer)


FROZEN_MODEL_ATTRIBUTES = ("ref_model", "reward_model", "value_model", "teacher_model")
"""The attributes where TRL's trainers keep the models they run besides the one they train (DPO's
and GRPO's reference, a reward or value model, a distillation teacher): compiled as frozen stage-3
inference models, where TRL would call DeepSpeed's ``prepare_deepspeed`` for them."""


def _compiled(model) -> bool:
    return getattr(model, "_compiled_call_impl", None) is not None


class _ZeroTraining:
    """What ``zero_trainer`` adds to a ``transformers.Trainer`` subclass (the module docstring).
    First in the method order, before the trainer class."""

    def __init__(self, *args, zero_options=None, **kwargs):
        trainer_class = _trainer_class(type(self))
        names = [n for n, p in inspect.signature(trainer_class.__init__).parameters.items()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__}: {len(args)} positional arguments, but "
                            f"{trainer_class.__name__} takes at most {len(names)} ({', '.join(names)})")
        given = dict(zip(names, args))
        for name in set(given) & set(kwargs):
            raise TypeError(f"{type(self).__name__}: argument '{name}' given by position and by keyword")
        given.update(kwargs)
        model = given.get("model")
        if isinstance(model, torch.nn.Module) and _compiled(model) and zero_options is not None:
            raise ValueError(f"{type(self).__name__}: the model is compiled already; compile it with backend='zero' "
                             "and these options yourself, or pass zero_options and an uncompiled model")
        # every argument by keyword: a trainer's own positional order (DPOTrainer's second
        # parameter is ref_model) is its own
        super().__init__(**given)
        options = self.zero_config = _with_precision(zero_options if zero_options is not None else {"stage": 3},
                                                     self.args, type(self).__name__)
        # the model the trainer trains, as it holds it (TRL may load it from a name, or wrap it
        # in a PeftModel): compiled in place, so every reference to it sees the compiled module
        if isinstance(self.model, torch.nn.Module) and not _compiled(self.model):
            self.model.compile(backend="zero", options=options)
        elif getattr(self.args, "bf16", False):
            logging.getLogger("zerocompile").warning(
                "%s: the model was compiled before the trainer was built, so TrainingArguments(bf16=True) is not "
                "applied to it: compile it with options param_dtype='bfloat16', or pass an uncompiled model",
                type(self).__name__)
        for name in FROZEN_MODEL_ATTRIBUTES:
            other = getattr(self, name, None)
            if isinstance(other, torch.nn.Module) and other is not self.model and not _compiled(other):
                other.requires_grad_(False)
                other.eval()
                other.compile(backend="zero", options=frozen_model_options(options))

    # -- accelerator and optimizer ----------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # Trainer builds its Accelerator from many arguments in this method; ZeroAccelerator
        # adds no state, only two methods, so the instance takes the subclass's class
        if type(self.accelerator) is not ZeroAccelerator:
            self.accelerator.__class__ = ZeroAccelerator
        check_spans_the_ranks(self.accelerator, "ZeroTrainer", "use_cpu=True in the TrainingArguments")

    def create_optimizer(self, model=None):
        opt_model = self.model if model is None else model
        if self.optimizer is None:
            decay = set(self.get_decay_parameter_names(opt_model))
            named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                      {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
            groups = [g for g in groups if g["params"]]
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            self.optimizer = ZeroOptimizer(groups, optimizer_class=optimizer_cls, **optimizer_kwargs)
        return self.optimizer

    def _has_mixed_mesh_grads(self, model) -> bool:
        return False          # zerocompile's DTensor gradients (p.grad at stages 1-3) share one mesh

    # -- saving and resuming ----------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        zerocompile.save_pretrained(self.model, output_dir)          # every rank: a collective
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        zerocompile.save_checkpoint(os.path.join(output_dir, STATE_DIR), self.model, _unwrapped(self.optimizer))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        state = os.path.join(checkpoint, STATE_DIR)
        if not os.path.isdir(state):
            raise FileNotFoundError(f"ZeroTrainer: {checkpoint} has no {STATE_DIR} directory; it was not saved by "
                                    "a ZeroTrainer")
        # the optimizer state is loaded after the first forward and backward (training_step):
        # accelerate binds the optimizer to the parameters before they are sharded, and the
        # state must land on the shards
        self._zero_resume_state = state
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        state = getattr(self, "_zero_resume_state", None)
        if state is not None:
            self._zero_resume_state = None
            zerocompile.load_checkpoint(state, self.model, _unwrapped(self.optimizer))
        return loss

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        zerocompile.load_pretrained(self.model if model is None else model, resume_from_checkpoint)


def _with_precision(options, args, who: str) -> ZeroConfig:
    """``options`` with the mixed precision the ``TrainingArguments`` ask for: ``bf16=True`` (TRL's
    configs' default) computes in bfloat16 from float32 master shards, ``param_dtype="bfloat16"``
    (what DeepSpeed's ``bf16`` does under the Trainer; the Trainer's own autocast comes from
    Accelerate's model wrapper, which a ``ZeroAccelerator`` does not put on). ``fp16=True`` is
    refused: say it in the options, whose loss scaling is inside the compiled backward."""
    config = ZeroConfig.from_options(options)
    dtype = config.sharding.param_dtype
    if getattr(args, "fp16", False):
        raise ValueError(f"{who}: TrainingArguments(fp16=True): zerocompile computes in float16 with its own loss "
                         "scaling; pass zero_options={..., 'param_dtype': 'float16', 'loss_scale': 'dynamic'} and "
                         "fp16=False")
    if getattr(args, "bf16", False):
        if dtype is None:
            return config.with_options({"param_dtype": "bfloat16"})
        if dtype is not torch.bfloat16:
            raise ValueError(f"{who}: TrainingArguments(bf16=True) asks for bfloat16, but zero_options' param_dtype "
                             f"is {dtype}; set bf16=False, or param_dtype 'bfloat16'")
    return config


def frozen_model_options(options) -> ZeroConfig:
    """The options a trainer's frozen models (``FROZEN_MODEL_ATTRIBUTES``) are compiled with: the
    trained model's, at stage 3 (their parameters sharded, gathered block by block for the
    forward; TRL with DeepSpeed shards them only when the policy is at stage 3), with the
    parameter offload but none of the optimizer step's other options, and no monitor or flops
    profiler (both are written by an optimizer step, which a frozen model has not), as TRL's
    ``prepare_deepspeed`` drops the optimizer's sections."""
    config = ZeroConfig.from_options(options)
    observability = dataclasses.replace(config.observability, monitor=None, flops_profiler=None)
    return dataclasses.replace(config, sharding=dataclasses.replace(config.sharding, stage=3),
                               step=StepOptions(offload_param=config.step.offload_param), observability=observability)


def _trainer_class(cls: type) -> type:
    """The ``transformers.Trainer`` subclass ``zero_trainer`` made ``cls`` from."""
    mro = cls.__mro__
    return mro[mro.index(_ZeroTraining) + 1]


@functools.cache
def zero_trainer(cls: type) -> type:
    """``cls`` (``transformers.Trainer`` or a subclass: TRL's ``SFTTrainer``, ``DPOTrainer``,
    ``RewardTrainer``, your own) trained with zerocompile: the same arguments, plus
    ``zero_options=`` (the backend's options; default ``{"stage": 3}``), every one passed on to
    ``cls`` by keyword. The model the trainer trains is compiled in place with those options
    after ``cls.__init__`` (so a model TRL loads from a name or wraps in a ``PeftModel`` is the
    one compiled); the models TRL keeps besides it (``FROZEN_MODEL_ATTRIBUTES``) are frozen and
    compiled at stage 3 for inference; the accelerator, optimizer and saving are
    ``ZeroTrainer``'s (module docstring). One class per ``cls``::

        from trl import DPOTrainer
        ZeroDPOTrainer = zero_trainer(DPOTrainer)
        trainer = ZeroDPOTrainer(model=policy, ref_model=reference, args=config, train_dataset=pairs,
                                 processing_class=tokenizer, zero_options={"stage": 3})
    """
    if not isinstance(cls, type) or not issubclass(cls, transformers.Trainer):
        raise TypeError(f"zero_trainer takes transformers.Trainer or a subclass of it, got {cls!r}")
    if issubclass(cls, _ZeroTraining):
        return cls
    name = "ZeroTrainer" if cls is transformers.Trainer else f"Zero{cls.__name__}"
    made = type(name, (_ZeroTraining, cls), {
        "__module__": __name__, "__qualname__": name,
        "__doc__": f"``{cls.__module__}.{cls.__qualname__}`` trained with zerocompile (``zero_trainer``)."})
    return made


ZeroTrainer = zero_trainer(transformers.Trainer)
"""``transformers.Trainer`` trained with zerocompile (the module docstring)."""
