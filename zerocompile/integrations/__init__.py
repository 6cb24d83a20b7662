"""Integrations with the tools people train Hugging Face models with (docs/integrations.md).

``zerocompile.integrations.accelerate.ZeroAccelerator``: an ``accelerate.Accelerator`` that
prepares a zerocompile model as it is (no DistributedDataParallel around it) and clips with
``ZeroOptimizer.clip_grad_norm_``. ``zerocompile.integrations.transformers.ZeroTrainer``: a
``transformers.Trainer`` that trains with zerocompile at any stage. Each module imports its
library when imported itself; neither is imported by ``import zerocompile``.
"""
