"""Which optimizer classes ``ZeroOptimizer`` may run on flat shards: the public path of
``zerocompile.optim.rules``, where the allow-list and its reasons live."""

from zerocompile.optim.rules import ELEMENTWISE, NOT_ELEMENTWISE, check_elementwise

__all__ = ["ELEMENTWISE", "NOT_ELEMENTWISE", "check_elementwise"]
