"""The per-stage rules (runtime/stages.py) on one parameter, rank 1 of 4 ranks (no
communication: building a state and asking it questions only slices tensors)."""

from __future__ import annotations

import pytest
import torch

from zerocompile.runtime import param_ops
from zerocompile.runtime.comm import CommGroup, chunk_size
from zerocompile.runtime.sharded_param import ShardedParam
from zerocompile.runtime.stages import stage_rules

GROUP = CommGroup(rank=1, world=4, name="test")


def _state(stage, compute_dtype=torch.float32):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(3, 5))     # 15 elements: chunk 4, padded to 16
    value = param.detach().clone()
    return ShardedParam(param, "w", stage, GROUP, compute_dtype), value


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_each_stage_builds_what_its_rules_say(stage, compute_dtype):
    sp, value = _state(stage, compute_dtype)
    rules = stage_rules(stage)
    assert sp.rules is rules and rules.number == stage
    inputs = sp.graph_inputs()
    assert len(inputs) == len(rules.input_suffixes)
    own = value.reshape(-1)[4:8]                       # rank 1's chunk of the flat parameter
    if rules.shards_master:
        assert sp.shard.shape == (4,) and torch.equal(sp.shard, own) and sp.shard.requires_grad
        assert rules.optimizer_target(sp) is sp.shard
    else:
        assert sp.shard is None and rules.optimizer_target(sp) is sp.param
    holder = rules.grad_holder(sp)
    assert any(holder is t for t in (*inputs, sp.param))   # the backward reaches it from the graph
    if rules.keeps_replica:
        assert sp.replica.dtype == compute_dtype
        torch.testing.assert_close(sp.replica, value.to(compute_dtype), rtol=0, atol=0)
        assert sp.replica.requires_grad == rules.reduces_in_step   # stage 1 accumulates into it
    freed = stage == 3 or (rules.keeps_replica and compute_dtype != torch.float32)
    assert sp.storage_freed == freed and sp.param_is_master == (not freed and stage != 3)
    # exactly one place reduces the gradient
    assert [rules.reduces_in_step, rules.reduces_in_backward, not rules.shards_master].count(True) == 1
    assert rules.output_alias_drops_grad == (stage == 2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_write_full_reaches_every_copy(stage):
    sp, _ = _state(stage)
    new = torch.arange(15.0).view(3, 5)
    sp.write_full(new)
    if sp.rules.shards_master:
        assert torch.equal(sp.shard.detach(), torch.arange(4.0, 8.0))
    if sp.rules.keeps_replica:
        assert torch.equal(sp.replica.detach(), new)
    if sp.param_is_master:
        with torch.no_grad():
            assert torch.equal(sp.param.detach().clone(), new)


def test_stage_three_with_offload_param_keeps_the_shard_in_its_file(tmp_path):
    """``Stage3Offload``: the shard keeps its identity and shape but no storage; its values are in
    its file (rank 1's chunk); the graph inputs are the shard and the file's number; writing the
    full parameter lands in the file; stage rules refuse offload below stage 3."""
    from zerocompile.runtime.offload_settings import OffloadSettings
    from zerocompile.runtime.param_offload import resident_shards
    from zerocompile.runtime.stages import Stage3Offload

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(3, 5))
    value = param.detach().clone()
    sp = ShardedParam(param, "w", 3, GROUP, torch.float32,
                      offload_param=OffloadSettings(device="nvme", nvme_path=str(tmp_path)))
    assert isinstance(sp.rules, Stage3Offload) and sp.rules.input_suffixes == ("_shard", "_file")
    shard, number = sp.graph_inputs()
    assert shard is sp.shard and shard.shape == (4,) and shard.untyped_storage().nbytes() == 0
    assert number.dtype == torch.int64 and int(number) == sp.shard_file.number
    stored = torch.empty(4)
    sp.shard_file.read_into(stored)
    assert torch.equal(stored, value.reshape(-1)[4:8])
    with resident_shards([sp]):
        assert torch.equal(sp.shard.detach(), value.reshape(-1)[4:8])
    assert sp.shard.untyped_storage().nbytes() == 0
    sp.write_full(torch.arange(15.0).view(3, 5))
    sp.shard_file.read_into(stored)
    assert torch.equal(stored, torch.arange(4.0, 8.0)) and sp.shard.untyped_storage().nbytes() == 0
    with pytest.raises(ValueError, match="offload_param needs stage 3"):
        stage_rules(2, offload_param=True)


@pytest.mark.parametrize("numel, world, chunk", [
    (0, 1, 1), (0, 4, 1), (1, 1, 1), (1, 4, 1), (3, 4, 1), (4, 4, 1), (5, 4, 2), (15, 4, 4), (16, 4, 4),
    (17, 4, 5), (7, 1, 7), (2**53 + 1, 2, 2**52 + 1)])
def test_chunk_size_is_the_ceiling_share_and_at_least_one(numel, world, chunk):
    assert chunk_size(numel, world) == chunk
    assert chunk * world >= numel and (numel == 0 or (chunk - 1) * world < numel)


@pytest.mark.parametrize("stage", [2, 3])
def test_an_empty_parameter_gets_a_one_element_shard_and_a_gradient_of_its_size(stage):
    """The shard's size and that of the gradient the backward reduce-scatters into it come from
    one formula (``chunk_size``), also for a parameter of no elements."""
    group = CommGroup(rank=0, world=1, name="test")
    sp = ShardedParam(torch.nn.Parameter(torch.zeros(0, 3)), "empty", stage, group, torch.float32)
    assert sp.chunk == 1 and sp.padded_numel == 1 and sp.shard.shape == (1,)
    if stage == 3:
        out = param_ops.gather_param(sp.shard, 0, (0, 3), torch.float32, torch.float32, 1, group.name)
    else:
        out = param_ops.replica_with_sharded_grad(sp.shard, sp.replica, 0, torch.float32, 1, group.name)
    assert out.shape == (0, 3)
    out.sum().backward()
    assert sp.shard.grad.shape == sp.shard.shape
    # what the backward returns, before autograd sums a gradient of 0 elements to the shard's shape
    grad = param_ops._reduce_scatter_grad(torch.zeros(0, 3), 0, torch.float32, torch.float32, 1, group.name)
    assert grad.shape == sp.shard.shape
