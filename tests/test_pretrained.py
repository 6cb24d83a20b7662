"""Big models: ``materialize`` (meta-device init shard by shard), ``load_pretrained`` (each rank
reads its own chunks) and ``save_pretrained`` (the Hugging Face layout from the shards), on 2
gloo ranks against single-process references: the same initial weights bit for bit, the same
training losses as ``from_pretrained`` in one process, files ``transformers`` reads back, and
per-rank live bytes during loading below (full model / N) + the largest tensor."""

from __future__ import annotations

import os

import pytest
import torch

import zerocompile
from census import StorageCensus
from dist_utils import run_ranks
from harness import train_on_rank_slices
from models import GPT, make_batch, make_model

transformers = pytest.importorskip("transformers")

LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
STEPS = 3


def _meta_llama():
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def _batch():
    return torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(1))


def _train_llama(model, rank=0, world=1):
    """AdamW steps on a fixed batch, each rank on its share; the mean losses."""
    opt = (zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2) if world > 1
           else torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = _batch()
    return train_on_rank_slices(lambda x, y: model(input_ids=x, labels=y).loss, opt, [(ids, ids)] * STEPS,
                                rank, world)


def _sizes(model):
    params = {id(p): p for p in model.parameters()}.values()
    full = sum(p.numel() * p.element_size() for p in params)
    return full, max(p.numel() * p.element_size() for p in params), sum(
        b.numel() * b.element_size() for b in model.buffers())


def _llama_runs(rank, world, src, dst):
    out = {}
    # meta init, shard by shard
    torch.manual_seed(0)
    model = _meta_llama()
    census = StorageCensus(exact_peak=True)
    with census:
        zerocompile.materialize(model)
    out["materialize_peak"] = census.peak
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    out["initial"] = zerocompile.full_state_dict(compiled)
    out["materialized_losses"] = _train_llama(compiled, rank, world)
    # other options than the provisional stage-3 layout: stage 2 (gathered back once), bf16
    for name, options in (("stage 2", {"stage": 2}), ("bf16", {"stage": 3, "param_dtype": "bfloat16"})):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _meta_llama()
        zerocompile.materialize(model)
        compiled = torch.compile(model, backend="zero", options={"inner_compiler": "eager", **options})
        out[name] = _train_llama(compiled, rank, world)
    # pretrained weights straight into shards
    torch._dynamo.reset()
    model = _meta_llama()
    census = StorageCensus(exact_peak=True)
    with census:
        zerocompile.load_pretrained(model, src)
    out["load_peak"] = census.peak
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    out["loaded_losses"] = _train_llama(compiled, rank, world)
    zerocompile.save_pretrained(compiled, dst, max_shard_size=20_000)
    out["trained"] = zerocompile.full_state_dict(compiled)
    again = _meta_llama()
    zerocompile.load_pretrained(again, dst)            # the sharded layout, with its index
    out["reloaded"] = zerocompile.full_state_dict(again)
    # ranks seeded differently: refused on every rank
    torch.manual_seed(rank)
    try:
        zerocompile.materialize(_meta_llama())
        out["unseeded"] = ""
    except ValueError as err:
        out["unseeded"] = str(err)
    return out


def test_an_hf_llama_from_meta_and_from_pretrained_trains_like_one_process(tmp_path):
    """A tied HF Llama built on the meta device: ``materialize`` on 2 ranks gives bitwise the
    weights of the same init on one process and trains like them; ``load_pretrained`` from an
    HF ``save_pretrained`` directory trains like ``from_pretrained`` in one process;
    ``save_pretrained`` writes a sharded directory ``from_pretrained`` reads back as the trained
    weights, and ``load_pretrained`` reads it back too. Live bytes per rank stay below half the
    model plus its largest tensor. Compiled at stage 2 (the provisional stage-3 shards gathered
    back once), the materialised model trains the same; with bf16 compute (the provisional
    shards take the frame's param_dtype; HF's RMSNorm needs align_compute_dtypes) within 2%."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    reference.save_pretrained(src)
    loaded_ref = _train_llama(transformers.LlamaForCausalLM.from_pretrained(src))
    torch.manual_seed(0)
    one_process = _meta_llama()
    zerocompile.materialize(one_process)
    initial_ref = zerocompile.full_state_dict(one_process)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    plain.load_state_dict(initial_ref)
    materialized_ref = _train_llama(plain)
    full, largest, buffers = _sizes(reference)

    results = run_ranks(_llama_runs, 2, src, dst)
    for r in results:
        for got, want in ((r["materialized_losses"], materialized_ref), (r["loaded_losses"], loaded_ref)):
            assert got == pytest.approx(want, rel=1e-5), (got, want)
        assert r["materialize_peak"] <= full / 2 + largest + buffers, (r["materialize_peak"], full, largest)
        assert r["load_peak"] <= full / 2 + largest + buffers, (r["load_peak"], full, largest)
        assert "the ranks initialised different values" in r["unseeded"], r["unseeded"]
        assert r["stage 2"] == pytest.approx(materialized_ref, rel=1e-5), r["stage 2"]
        assert r["bf16"] == pytest.approx(materialized_ref, rel=2e-2) and r["bf16"] != materialized_ref, r["bf16"]
    initial, trained, reloaded = results[0]["initial"], results[0]["trained"], results[0]["reloaded"]
    assert initial and set(initial) == set(initial_ref)
    for key, value in initial_ref.items():
        assert torch.equal(initial[key], value), key
    assert os.path.exists(os.path.join(dst, "model.safetensors.index.json"))
    back = transformers.LlamaForCausalLM.from_pretrained(dst).state_dict()
    for key, value in trained.items():
        assert torch.equal(back[key], value), key
        assert torch.equal(reloaded[key], value), key
    assert not torch.equal(trained["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])


def _gpt_runs(rank, world, paths):
    """For each layout, the test GPT loaded from its file on the meta device and trained at stage 3
    in float32; the first layout also with bf16 compute (the cast of the provisional shards comes
    after the loading, which is the same for both layouts)."""
    out = {}
    for i, (layout, path) in enumerate(paths.items()):
        for name, extra in (("fp32", {}), ("bf16", {"param_dtype": "bfloat16"}))[:2 if i == 0 else 1]:
            torch._dynamo.reset()
            with torch.device("meta"):
                model = GPT()
            zerocompile.load_pretrained(model, path)
            compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager", **extra})
            opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-3)
            # the bf16 loss is averaged over ranks in float32
            out[layout, name] = train_on_rank_slices(lambda x, y: compiled(x, y).float(), opt,
                                                     [make_batch("gpt", step, 8) for step in range(STEPS)], rank,
                                                     world)
    return out


LAYOUTS = ["save_pretrained", "torch.save"]


@pytest.fixture(scope="module")
def gpt_loaded(tmp_path_factory, once_per_run):
    """Both layouts written in one process, loaded and trained in one group of 2 ranks; the
    single-process reference on the whole batch, computed once per pytest run."""
    return once_per_run("test_pretrained.gpt_loaded", lambda: _gpt_loaded(tmp_path_factory.mktemp("gpt_layouts")))


def _gpt_loaded(folder):
    model = make_model("gpt")
    paths = {"save_pretrained": str(folder / "gpt"), "torch.save": str(folder / "gpt.pt")}
    zerocompile.save_pretrained(model, paths["save_pretrained"])
    listing = sorted(os.listdir(paths["save_pretrained"]))
    torch.save(model.state_dict(), paths["torch.save"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    want = []
    for step in range(STEPS):
        loss = model(*make_batch("gpt", step, 8))
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    return listing, want, run_ranks(_gpt_runs, 2, paths)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_test_gpt_loads_into_shards(gpt_loaded, layout):
    """The test GPT (tied head) built on the meta device, loaded on 2 ranks at stage 3 from a
    ``zerocompile.save_pretrained`` directory (written in one process: ``model.safetensors``,
    the tied head once) or a ``torch.save`` state dict, trains like the same weights on one
    process on the whole batch (within 2% with bf16 compute, run for the first layout: the
    provisional shards take the frame's param_dtype after loading, whatever the file's layout)."""
    listing, want, results = gpt_loaded
    if layout == "save_pretrained":
        assert listing == ["model.safetensors"]
    for r in results:
        assert r[layout, "fp32"] == pytest.approx(want, rel=1e-5), (r[layout, "fp32"], want)
        if (layout, "bf16") in r:
            assert r[layout, "bf16"] == pytest.approx(want, rel=2e-2) and r[layout, "bf16"] != want, \
                (r[layout, "bf16"], want)


def test_bad_files_and_inits_are_named(tmp_path):
    """Missing and unexpected keys are listed; a tied name may be missing when its partner is
    there; a wrong shape names both; an init that leaves a parameter unset names it; a
    ZeroOptimizer over meta parameters says to materialize first; one process, uncompiled
    models load by plain copies."""
    model = make_model("gpt")
    state = model.state_dict()
    path = tmp_path / "gpt.pt"
    torch.save({k: v for k, v in state.items() if k != "head.weight"}, path)      # tied to wte.weight
    fresh = make_model("gpt", seed=1)
    zerocompile.load_pretrained(fresh, path)
    for key, value in state.items():
        assert torch.equal(fresh.state_dict()[key], value), key
    torch.save({**{k: v for k, v in state.items() if k not in ("ln_f.weight", "head.weight")}, "extra": torch.zeros(1)},
               path)
    with pytest.raises(KeyError, match=r"missing keys \['ln_f.weight'\], unexpected keys \['extra'\]"):
        zerocompile.load_pretrained(make_model("gpt"), path)
    torch.save({**state, "wpe.weight": torch.zeros(3, 3)}, path)
    with pytest.raises(ValueError, match=r"'wpe.weight' has shape \(3, 3\) in .* the model's 'wpe.weight' has \(16, 64\)"):
        zerocompile.load_pretrained(make_model("gpt"), path)
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        zerocompile.load_pretrained(make_model("gpt"), tmp_path / "nothing.safetensors.missing")

    class Scaled(torch.nn.Module):        # a parameter its own module never initialises
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.empty(4))
            self.lin = torch.nn.Linear(4, 4)

    with torch.device("meta"):
        bad = Scaled()
    with pytest.raises(ValueError, match=r"2 parameters are on the meta device .* zerocompile.materialize\(model\)"):
        zerocompile.ZeroOptimizer(bad.lin.parameters())     # compiled or not: a meta model has no values
    with pytest.raises(ValueError, match=r"parameter 'scale' \(Scaled\) is not initialised by the init function"):
        zerocompile.materialize(bad, device="cpu")
    with torch.device("meta"):
        ok = Scaled()
    zerocompile.materialize(ok, init=lambda m: torch.nn.init.ones_(m.scale) if isinstance(m, Scaled)
                            else m.reset_parameters(), device="cpu")
    assert torch.equal(zerocompile.full_state_dict(ok)["scale"], torch.ones(4))
