"""zerocompile: ZeRO (stages 0-3) as a torch.compile backend.

    model = torch.compile(model, backend="zero", options={"stage": 3})
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-4)
"""

from zerocompile.backend import zero_backend
from zerocompile.checkpoint import consolidated_state_dict, load_checkpoint, save_checkpoint
from zerocompile.checkpoint.deepspeed_load import load_deepspeed_checkpoint
from zerocompile.comms_summary import log_summary
from zerocompile.config import ZeroConfig
from zerocompile.deep_stack import on_a_deep_stack
from zerocompile.deepspeed_training import initialize, training_settings
from zerocompile.errors import (CollectiveMismatchError, DeepSpeedCheckpointError, GradientNotGatheredError, LossScaleError, ParameterNotGatheredError, ParamIdentityError,
                                SwapFileError, UnshardedParametersError, ZeroConfigError)
from zerocompile.generation import generate
from zerocompile.optimizer import ZeroOptimizer
from zerocompile.optim.monitoring import close_monitors, log_metrics
from zerocompile.optim.onebit_adam import OneBitAdam          # DeepSpeed's 1-bit Adam (stage 0)
from zerocompile.optim.zero_one_adam import ZeroOneAdam       # DeepSpeed's 0/1 Adam (stage 0)
from zerocompile.pretrained import load_pretrained, materialize, save_pretrained
from zerocompile.runtime.leaf_modules import set_leaf_modules
from zerocompile.runtime.accounting import ZeroStats
from zerocompile.runtime.session import frame_reports, reset_stats, stats
from zerocompile.state_dict import full_state_dict, gathered_parameters

__all__ = [
    "ZeroConfig", "ZeroOptimizer", "ZeroStats", "close_monitors", "consolidated_state_dict", "frame_reports", "full_state_dict",
    "gathered_parameters", "generate", "initialize", "load_checkpoint", "load_deepspeed_checkpoint", "load_pretrained", "log_metrics", "log_summary",
    "materialize", "on_a_deep_stack",
    "reset_stats", "save_checkpoint", "save_pretrained", "set_leaf_modules", "stats", "training_settings",
    "zero_backend", "OneBitAdam", "ZeroOneAdam",
    # errors (zerocompile/errors.py)
    "CollectiveMismatchError", "DeepSpeedCheckpointError", "GradientNotGatheredError", "LossScaleError", "ParamIdentityError", "ParameterNotGatheredError",
    "SwapFileError", "UnshardedParametersError", "ZeroConfigError",
]
__version__ = "0.1.0"
