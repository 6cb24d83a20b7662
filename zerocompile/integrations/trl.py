"""TRL's trainers trained with zerocompile: ``zero_trainer`` (``integrations/transformers.py``)
of TRL's ``SFTTrainer``, ``DPOTrainer`` and ``RewardTrainer``, ready to import::

    from zerocompile.integrations.trl import ZeroDPOTrainer
    trainer = ZeroDPOTrainer(model=policy, ref_model=reference, args=DPOConfig(..., bf16=False),
                             train_dataset=pairs, processing_class=tokenizer, zero_options={"stage": 3})

Each takes its TRL class's arguments, by keyword or in that class's order, plus ``zero_options``.
Any other TRL trainer: ``zero_trainer(trl.KTOTrainer)``. See docs/integrations.md, TRL.
"""

from __future__ import annotations

import trl

from zerocompile.integrations.transformers import zero_trainer

TRL_VERSIONS = (">=1.16", "<2")
"""The TRL versions this module is written and tested for (pyproject's ``trl`` extra)."""

ZeroSFTTrainer = zero_trainer(trl.SFTTrainer)
ZeroDPOTrainer = zero_trainer(trl.DPOTrainer)
ZeroRewardTrainer = zero_trainer(trl.RewardTrainer)
