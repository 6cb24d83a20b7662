"""The step's buckets: how big (``bucket_mb``) and which collective reduces them
(``gradient_reduction``), for the optimizer's own reductions (``grad_reduction.py``,
``early_reduction.py``) and its replicas' all-gathers (``update.py``)."""

from __future__ import annotations

DEFAULT_BUCKET_MB = 25.0


def bucket_bytes(states) -> int:
    """The bucket size of the step's collectives over parameters with shard states ``states``
    (None for a parameter no frame sharded): their model's ``bucket_mb`` option (its session's;
    0: one tensor per collective), the default where none has one."""
    mb = next((m for s in states if s is not None and (m := s.option("passes", "bucket_mb")) is not None),
              DEFAULT_BUCKET_MB)
    return int(mb * 2**20)


def reduction_chooser(states):
    """``choose(bucket bytes)`` of the step's reduction of gradients of ``states`` (one group):
    their frames' ``ReductionChoice`` (the same per group: ``runtime/reduction_choice.py``), or
    None (reduce-scatter) where none has one (stage 3)."""
    choice = next((sp.gradient_reduction for sp in states if sp.gradient_reduction is not None), None)
    return choice.kind_for if choice is not None else None
