"""The collaborators of ``zerocompile.optimizer.ZeroOptimizer``, one job each.

- ``params``: the optimizer's parameters as zerocompile sees them (shard states, targets, group).
- ``kernels``: which inner optimizer updates the tensors (zerocompile's fused Adam, torch's
  fused / foreach kernels, the class as configured, or offloaded state).
- ``binding``: the inner optimizer bound to the targets, and state waiting for it to bind.
- ``grad_reduction``: the gradients the compiled graphs did not reduce, reduced in the step.
- ``scaling``: loss scaling (``torch.amp.GradScaler`` and the ``loss_scale`` option), overflow.
- ``clipping``: ``clip_grad_norm_``, the ``gradient_clipping`` option, the deferred coefficient.
- ``update``: the inner optimizer's update of the shards and the refresh of the replicas.
- ``state_io``: ``state_dict`` / ``load_state_dict`` and checkpoint state (``param_state``,
  ``state_dict_values``).
- ``rules``: which optimizer classes run on flat shards, which on whole parameters, which are refused.
- ``whole_param``: a whole-parameter optimizer (Muon, Adafactor, ...) stepped at owner ranks, the
  pieces moved by all-to-alls; ``owners``: which rank owns each parameter.
- ``grouped``: param groups that name their own optimizer class, one inner optimizer per class.
- ``onebit_adam``, ``zero_one_adam`` (sharing ``compressed_momentum``): DeepSpeed's 1-bit Adam and
  0/1 Adam, inner optimizers that average the momentum themselves, compressed, at stage 0;
  ``local_gradients``: how ``ZeroOptimizer`` builds them and skips its gradient all-reduce for them.

None of them imports ``zerocompile.optimizer``: it owns them and delegates to them.
"""
