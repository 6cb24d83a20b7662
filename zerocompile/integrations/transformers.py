"""``ZeroTrainer``: ``transformers.Trainer`` training with zerocompile, at any stage.

    trainer = ZeroTrainer(model=model, args=args, train_dataset=..., zero_options={"stage": 3})
    trainer.train()                  # or trainer.train(resume_from_checkpoint=True)

What it changes in ``Trainer`` (and why):

- the model is compiled in place with ``backend="zero"`` and ``zero_options`` (HF's own
  ``torch_compile`` goes through Accelerate's ``TorchDynamoPlugin``, which does not know the
  backend), unless it was compiled in place already; it stays the user's ``PreTrainedModel``;
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

import os

import torch
import transformers

import zerocompile
from zerocompile.integrations.accelerate import STATE_DIR, ZeroAccelerator, check_spans_the_ranks
from zerocompile.optimizer import ZeroOptimizer

TRANSFORMERS_VERSIONS = (">=5.0", "<6")
"""The transformers versions this module is written and tested for (pyproject's extra)."""

SCHEDULER_NAME = "scheduler.pt"


def _unwrapped(optimizer):
    """The ZeroOptimizer inside accelerate's ``AcceleratedOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer)


class ZeroTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` for zerocompile (see the module docstring)."""

    def __init__(self, model=None, args=None, *rest, zero_options=None, **kwargs):
        if model is not None and getattr(model, "_compiled_call_impl", None) is None:
            model.compile(backend="zero", options=zero_options if zero_options is not None else {"stage": 3})
        elif zero_options is not None:
            raise ValueError("ZeroTrainer: the model is compiled already; compile it with backend='zero' and "
                             "these options yourself, or pass zero_options and an uncompiled model")
        super().__init__(model, args, *rest, **kwargs)

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
