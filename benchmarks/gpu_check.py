"""``make gpu-check``: the GPU paths, on a machine with a CUDA device, in one short script.

1. The Triton fused Adam kernel (``runtime/triton_adam.py``) against
   ``torch.optim.AdamW(fused=True)`` on CUDA tensors: float32, bfloat16 and float16, odd
   sizes, decoupled and L2 weight decay.
2. ``ZeroOptimizer(AdamW)`` on CUDA parameters picks the Triton kernel (``opt.kernel``).
3. A world-size-1 NCCL stage-3 training run of the demo GPT compiled with inductor (Triton
   code generation), against the same model trained by plain torch: losses and parameters,
   step time, and ``torch.cuda.max_memory_allocated`` of each; and the same run with
   ``offload_optimizer={"device": "cpu"}`` (ZeRO-Offload), and with ``offload_param`` as well
   (parameter shards in host memory, fetched by the graph), each of which must be bitwise the
   run without offload, with its ``max_memory_allocated``.
4. Step time, achieved TFLOP/s and MFU (against the card's dense bfloat16 peak) of the demo GPT
   and a 1B Llama in bfloat16, each compiled whole, under plain ``torch.compile``, FSDP2
   (``fully_shard`` and per-block compile) and zerocompile stage 3 on the same GPU (world size 1,
   NCCL), with ``max_memory_allocated`` and the memory held after a step against the model-state
   formula. Meant to finish in under 8 minutes on one H100.

Without a CUDA device it says so and exits 0. ``--device cpu`` runs the same checks on the
CPU instead (gloo, the Triton interpreter, the eager inner compiler) to test the script
itself. Exit status 1 if a check fails. Results also go to ``--out`` as JSON.

    make gpu-check
    .venv/bin/python benchmarks/gpu_check.py --device cpu     # dry run of the script here
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import math
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_triton_kernel(device: str) -> dict:
    from zerocompile.runtime import triton_adam

    out = {}
    g = torch.Generator().manual_seed(0)
    tol = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-5, rtol=1.6e-2),
           torch.float16: dict(atol=1e-5, rtol=2e-3)}           # float32 ulps / one 16-bit ulp
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for decoupled in (True, False):
            # odd sizes across several blocks; the CPU dry run's interpreter is slow on the largest
            sizes = (1, 1023, 1025, 300_007 if device == "cuda" else 5_003)
            params = [torch.randn(n, generator=g).to(device=device, dtype=dtype) for n in sizes]
            grads = [((torch.rand(n, generator=g) + 0.5) * torch.randn(n, generator=g).sign()).to(device=device, dtype=dtype)
                     for n in sizes]
            ref = [p.clone().requires_grad_() for p in params]
            cls = torch.optim.AdamW if decoupled else torch.optim.Adam
            opt = cls(ref, lr=1e-2, weight_decay=0.05, fused=True)
            ps = [p.clone() for p in params]
            ms = [torch.zeros_like(p) for p in params]
            vs = [torch.zeros_like(p) for p in params]
            steps = [torch.zeros((), dtype=torch.float32) for _ in params]
            for _ in range(3):
                for r, gr in zip(ref, grads):
                    r.grad = gr.clone()
                opt.step()
                triton_adam.adam_step(ps, grads, ms, vs, steps, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                                      weight_decay=0.05, decoupled=decoupled, maximize=False)
            worst = max((p.float() - r.detach().float()).abs().max().item() for p, r in zip(ps, ref))
            ok = all(torch.allclose(p, r.detach(), **tol[dtype]) for p, r in zip(ps, ref))
            out[f"{dtype}-{'AdamW' if decoupled else 'Adam'}"] = {"max_abs_diff": worst, "ok": ok}
    return out


def check_zero_optimizer_kernel(device: str) -> dict:
    import zerocompile

    p = torch.nn.Parameter(torch.ones(8, device=device))
    opt = zerocompile.ZeroOptimizer([p], torch.optim.AdamW, lr=0.1)
    p.grad = torch.ones(8, device=device)
    opt.step()
    expected = "triton" if device == "cuda" else "cpp"
    return {"kernel": opt.kernel, "ok": opt.kernel == expected}


def _demo_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt_example", ROOT / "examples" / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GPT


def _train(model, opt, batches, device: str, compiled=None) -> dict:
    fn = compiled if compiled is not None else model
    return _train_fn(lambda x: fn(x, x), opt, batches, device)


def check_stage3_step(device: str, steps: int) -> dict:
    import torch.distributed as dist

    import zerocompile

    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    try:
        GPT = _demo_gpt()
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, 512, (4, 64), generator=g).to(device) for _ in range(steps)]
        torch.manual_seed(0)
        ref = GPT(vocab=512, seq_len=64, d_model=128, n_layers=4, n_heads=4).to(device)
        plain = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True), batches, device)
        inner = "inductor" if device == "cuda" else "eager"
        runs, states = {}, {}
        # optimizer offload: to host memory on a GPU (ZeRO-Offload), to a swap file in the CPU dry run
        offload = {"device": "cpu"} if device == "cuda" else {"device": "nvme", "nvme_path": tempfile.mkdtemp()}
        variants = (("zerocompile_stage3", {}), ("zerocompile_stage3_offload", {"offload_optimizer": offload}),
                    ("zerocompile_stage3_offload_all", {"offload_optimizer": offload, "offload_param": offload}))
        for name, extra in variants:
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = GPT(vocab=512, seq_len=64, d_model=128, n_layers=4, n_heads=4).to(device)
            compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": inner, **extra})
            opt = zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.AdamW, lr=1e-3)
            runs[name] = _train(model, opt, batches, device, compiled)
            runs[name].update(kernel=opt.kernel, offload=opt.offload)
            states[name] = zerocompile.full_state_dict(compiled)
        zero, off = runs["zerocompile_stage3"], runs["zerocompile_stage3_offload"]
        state = states["zerocompile_stage3"]
        diff = max((state[k].float() - v.float()).abs().max().item() for k, v in ref.state_dict().items())
        loss_diff = max(abs(a - b) for a, b in zip(zero["losses"], plain["losses"]))
        offload_same = all(runs[name]["losses"] == zero["losses"] and all(
            torch.equal(states[name][k], v) for k, v in state.items())
            for name in ("zerocompile_stage3_offload", "zerocompile_stage3_offload_all"))
        return {"backend": backend, "inner_compiler": inner, "plain": plain, **runs,
                "max_param_diff": diff, "max_loss_diff": loss_diff, "offload_bitwise_equal": offload_same,
                "ok": diff < 1e-3 and loss_diff < 1e-3 and offload_same and off["offload"] == offload["device"]}
    finally:
        dist.barrier()
        dist.destroy_process_group()


PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "L40S": 362.1}
"""Dense bfloat16 peak TFLOP/s of the card by name (the denominator of MFU); other cards get no MFU."""


def _peak_tflops(device: str) -> float | None:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def _llama(size: str):
    import transformers

    shape = {"1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256),
             "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256)}[size]
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, attn_implementation="sdpa",
                                                                  use_cache=False))


def check_step_time(device: str, steps: int) -> dict:
    """Step time, MFU and memory of the demo GPT and a 1B Llama (bfloat16 on a GPU), each compiled
    whole: plain ``torch.compile`` (one process, torch's fused AdamW), FSDP2 (``fully_shard`` per
    block and root, each block compiled) and zerocompile stage 3 (``repeated_blocks`` compiles the
    layers once), world size 1 (NCCL). FLOPs per step from ``FlopCounterMode`` on one step."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.utils.flop_counter import FlopCounterMode

    import zerocompile

    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    peak = _peak_tflops(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    inner = "inductor" if device == "cuda" else "eager"
    backend = "inductor" if device == "cuda" else "aot_eager"
    out = {}
    try:
        GPT = _demo_gpt()
        workloads = {
            "demo_gpt": ((lambda: GPT(vocab=512, seq_len=256, d_model=512, n_layers=8, n_heads=8)) if device == "cuda"
                         else (lambda: GPT(vocab=512, seq_len=64, d_model=64, n_layers=8, n_heads=4)), 512,
                         (8, 256) if device == "cuda" else (2, 64), lambda m: m.blocks, lambda m, x: m(x, x)),
            "llama_1b": (lambda: _llama("1b" if device == "cuda" else "tiny"), 128256 if device == "cuda" else 256,
                         (1, 2048) if device == "cuda" else (1, 32), lambda m: m.model.layers,
                         lambda m, x: m(input_ids=x, labels=x).loss),
        }
        for name, (build, vocab, shape, blocks_of, loss_of) in workloads.items():
            g = torch.Generator().manual_seed(0)
            batches = [torch.randint(0, vocab, shape, generator=g).to(device) for _ in range(steps)]
            rows = {}
            torch.manual_seed(0)
            with torch.device(device):
                eager = build().to(dtype)
            with FlopCounterMode(display=False) as counter:
                loss_of(eager, batches[0]).backward()
            flops = counter.get_total_flops()        # one eager step of the same model: every system's
            eager = None
            for system in ("torch.compile", "fsdp2", "zerocompile_stage3"):
                torch._dynamo.reset()
                torch.manual_seed(0)
                with torch.device(device):
                    model = build().to(dtype)
                psi = sum(p.numel() for p in model.parameters())
                if system == "torch.compile":
                    fn = torch.compile(model, backend=backend)
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
                elif system == "fsdp2":
                    for block in blocks_of(model):
                        block.compile(backend=backend)
                        fully_shard(block)
                    fully_shard(model)
                    fn = model
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
                else:
                    fn = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": inner})
                    opt = zerocompile.ZeroOptimizer(fn.parameters(), torch.optim.AdamW, lr=1e-4)
                run = _train_fn(functools.partial(loss_of, fn), opt, batches, device)
                run["tflops_per_step"] = flops / 1e12
                run["achieved_tflops"] = flops / 1e12 / (run["ms_per_step"] / 1e3)
                run["mfu"] = run["achieved_tflops"] / peak if peak else None
                if device == "cuda":
                    # world size 1: parameters, gradients (freed by zero_grad) and two moments whole;
                    # model state after the step = params + moments, against 3 x Psi x bytes
                    run["memory_allocated_after_step_mib"] = torch.cuda.memory_allocated() / 2**20
                    run["model_state_formula_mib"] = 3 * psi * dtype.itemsize / 2**20
                run["params"] = psi
                rows[system] = run
                model = fn = opt = None
                if device == "cuda":
                    torch.cuda.empty_cache()
            base = rows["torch.compile"]["ms_per_step"]
            for run in rows.values():
                run["x_torch_compile"] = run["ms_per_step"] / base
            rows["zero_x_fsdp2"] = rows["zerocompile_stage3"]["ms_per_step"] / rows["fsdp2"]["ms_per_step"]
            out[name] = rows
        # the same training: every system's losses within bfloat16's rounding of torch.compile's
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        out["ok"] = all(all(math.isfinite(v) and abs(v - ref) <= tol * abs(ref)
                            for r in (rows["fsdp2"], rows["zerocompile_stage3"])
                            for v, ref in zip(r["losses"], rows["torch.compile"]["losses"]))
                        for rows in out.values())
        return out
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _train_fn(loss_fn, opt, batches, device: str) -> dict:
    """``_train`` for a loss function of the batch alone."""
    losses, times = [], []
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for x in batches:
        start = time.perf_counter()
        loss = loss_fn(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.float().item())
    out = {"losses": losses, "first_step_s": times[0], "ms_per_step": 1e3 * sorted(times[1:])[len(times[1:]) // 2]}
    if device == "cuda":
        out["max_memory_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a dry run of the same checks on the CPU (gloo, Triton interpreter)")
    p.add_argument("--steps", type=int, default=6, help="training steps of the stage-3 check")
    p.add_argument("--out", type=Path, default=RESULTS / "gpu_check.json")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}, CUDA build: "
              f"{torch.version.cuda or 'none'}); nothing to check")
        return 0
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    checks = [("triton_kernel", check_triton_kernel), ("zero_optimizer_kernel", check_zero_optimizer_kernel),
              ("stage3_step", lambda d: check_stage3_step(d, args.steps)),
              ("step_time", lambda d: check_step_time(d, max(args.steps, 4)))]
    failed = []
    for name, fn in checks:
        try:
            res = fn(args.device)
        except Exception as err:  # noqa: BLE001 - report every check
            res = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        ok = res["ok"] if "ok" in res else all(v["ok"] for v in res.values())
        results[name] = res
        if not ok:
            failed.append(name)
        print(f"{name}: {'ok' if ok else 'FAILED'}")
        print("  " + json.dumps(res, default=str)[:2000])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {args.out}; {'all checks passed' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
