"""Which optimizer classes ``ZeroOptimizer`` runs on flat shards or whole parameters: the public path of
``zerocompile.optim.rules``, where the allow-list and its reasons live."""

from zerocompile.optim.rules import (ELEMENTWISE, NOT_ELEMENTWISE, REFUSED, WHOLE_PARAMETER, check_elementwise,
                                     check_optimizer_class, needs_whole_parameter)

__all__ = ["ELEMENTWISE", "NOT_ELEMENTWISE", "REFUSED", "WHOLE_PARAMETER", "check_elementwise",
           "check_optimizer_class", "needs_whole_parameter"]
