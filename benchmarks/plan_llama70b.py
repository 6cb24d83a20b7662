"""``zerocompile plan`` on Llama-3-70B for 1024 ranks, against the ZeRO-3 formulas and the
planner's own targets (issue 10): model state and bytes per step within 2% of the formulas,
in under 30 s of wall time on this machine, with a peak RSS under 8 GiB.

    python benchmarks/plan_llama70b.py [--world-size 1024] [--hardware h100] [--out benchmarks/results]

It runs ``zerocompile plan --json`` on ``benchmarks/train_llama.py --size 70b --steps 2 --compile
whole`` (HF ``LlamaForCausalLM`` compiled whole with ``torch.compile(model, backend="zero")``, as
users write it, bfloat16, stage 3, ``recompute="full"``, sequence 4096, one sequence per rank;
``--compile blocks``: the same compiled block by block by hand, results ``*_blocks``) in a subprocess, times it and reads its peak RSS, and compares the report with formulas
computed from the model's shape alone (Psi = number of parameters, N = ranks):

- parameters 2 Psi / N, gradients 2 Psi / N (bfloat16), AdamW's two moments 4 Psi / N
  (bfloat16, like the parameters they update): model state 8 Psi / N;
- all-gathers 2 x 2 Psi (every parameter in forward, and again in backward: the recompute
  and the gradients use the same gather), reduce-scatters 4 Psi (gradients reduced in fp32).

Results: ``<out>/plan_llama70b.json`` and ``.md``. ``--checkpointing reentrant|non_reentrant``
plans the same script with HF's ``gradient_checkpointing_enable()`` on every decoder layer
(``train_llama.py --checkpointing``): the same formulas hold, since the checkpointed layers
compile and shard (results: ``plan_llama70b_checkpointing.json`` and ``.md``).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from train_llama import SIZES  # noqa: E402


def llama_params(shape: dict) -> int:
    """Parameters of HF LlamaForCausalLM with this shape (untied head, no biases)."""
    h, f, v, layers = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h      # q, o; k, v; gate, up, down; 2 norms
    return 2 * v * h + layers * per_layer + h                    # embedding, head; final norm


_FLOOR = """
import sys, time
start = time.perf_counter()
import torch, transformers
sys.path.insert(0, {bench!r})
from train_llama import SIZES
from torch._subclasses.fake_tensor import FakeTensorMode
torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True   # as the zero backend sets it
imported = time.perf_counter()
with FakeTensorMode(allow_non_fake_inputs=True):
    torch.set_default_dtype(torch.bfloat16)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES["70b"], attn_implementation="sdpa",
                                                                   use_cache=False))
    torch.set_default_dtype(torch.float32)
    if {checkpointing!r} != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": {checkpointing!r} == "reentrant"}})
    built = time.perf_counter()
    ids = torch.randint(0, 128256, (1, 4096))
    traced = torch.compile(model, backend=lambda gm, example_inputs: gm.forward)(input_ids=ids, labels=ids)
print(imported - start, built - imported, time.perf_counter() - built)
"""


def dynamo_floor(checkpointing: str) -> dict:
    """What no backend can save: the imports, building the model on fake tensors, and Dynamo's trace
    of the whole model plus one fake forward, with a backend that compiles nothing (a fresh process)."""
    done = subprocess.run([sys.executable, "-c", _FLOOR.format(bench=str(REPO / "benchmarks"),
                                                               checkpointing=checkpointing)],
                          capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    imports, build, trace = (float(v) for v in done.stdout.split()[-3:])
    return {"imports_s": imports, "build_s": build, "dynamo_trace_and_forward_s": trace}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=1024)
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--checkpointing", choices=("none", "reentrant", "non_reentrant"), default="none",
                        help="HF gradient checkpointing of every decoder layer (train_llama.py --checkpointing)")
    parser.add_argument("--compile", choices=("whole", "blocks"), default="whole",
                        help="the script as users write it (torch.compile of the whole HF model), or compiled "
                             "block by block by hand (train_llama.py --compile blocks; results *_blocks)")
    args = parser.parse_args()
    extra = ([] if args.checkpointing == "none" else ["--checkpointing", args.checkpointing]) + \
        ["--compile", args.compile]
    name = "plan_llama70b" + ("" if args.checkpointing == "none" else "_checkpointing") + \
        ("_blocks" if args.compile == "blocks" else "")

    cmd = [sys.executable, "-m", "zerocompile", "plan", "--world-size", str(args.world_size), "--hardware",
           args.hardware, "--json", "--", str(REPO / "benchmarks" / "train_llama.py"), "--size", "70b", "--steps", "2", *extra]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - start
    rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20     # ru_maxrss is in KiB
    if done.returncode != 0:
        print(done.stderr[-4000:], file=sys.stderr)
        return 1
    report = json.loads(done.stdout.splitlines()[0])

    psi, n = llama_params(SIZES["70b"]), args.world_size
    by_kind, comm = report["model_state_bytes_by_kind"], report["comm_by_kind"]
    rows = [
        ("parameters", report["num_params"], psi),
        ("model state per rank, bytes", report["model_state_bytes_per_rank"], 8 * psi / n),
        ("  parameters", by_kind["params"], 2 * psi / n),
        ("  gradients", by_kind["grads"], 2 * psi / n),
        ("  optimizer state", by_kind["optimizer_state"], 4 * psi / n),
        ("all-gather bytes per step", comm["all_gather"]["bytes"], 2 * 2 * psi),
        ("reduce-scatter bytes per step", comm["reduce_scatter"]["bytes"], 4 * psi),
    ]
    rows.append(("parameters kept whole (unsharded)", report["unsharded_params"]["count"], 0))
    within = all(abs(got / want - 1) <= 0.02 if want else got == want for _, got, want in rows)
    how = "compiled whole, as users write it" if args.compile == "whole" else "compiled block by block by hand"
    lines = [f"# zerocompile plan: Llama-3-70B on {n} ranks ({args.hardware}), {how}", "",
             f"`zerocompile plan --world-size {n} --hardware {args.hardware} --json -- benchmarks/train_llama.py "
             f"--size 70b --steps 2{' ' + ' '.join(extra) if extra else ''}`", "",
             "| figure | plan | formula | plan / formula |", "|---|---:|---:|---:|"]
    lines += [f"| {label} | {got:,.0f} | {want:,.0f} | {got / want if want else float(got == want):.4f} |"
              for label, got, want in rows]
    lines += ["", "| target | measured | met |", "|---|---:|---|",
              f"| within 2% of the formulas | {max(abs(g / w - 1) for _, g, w in rows if w):.2%} | {within} |",
              f"| wall time < 30 s | {wall:.1f} s | {wall < 30} |",
              f"| peak RSS < 8 GiB | {rss_gib:.2f} GiB | {rss_gib < 8} |", ""]
    floor = dynamo_floor(args.checkpointing) if args.compile == "whole" else None
    if floor is not None:
        lines += [f"Floor of the whole-model script (a fresh process, backend that compiles nothing): imports "
                  f"{floor['imports_s']:.1f} s, the model built on fake tensors {floor['build_s']:.1f} s, Dynamo's trace "
                  f"of all {SIZES['70b']['num_hidden_layers']} layers and one fake forward "
                  f"{floor['dynamo_trace_and_forward_s']:.1f} s: "
                  f"{sum(floor.values()):.1f} s of the {wall:.1f} s.", ""]
    lines += [f"peak live bytes per rank: {report['peak_bytes_per_rank'] / 2**30:.2f} GiB; estimated step "
              f"{report['estimated_step_s']:.2f} s (compute {report['estimated_compute_s']:.2f} s, communication "
              f"{report['estimated_comm_s']:.2f} s); the script ran {report['wall_s']:.1f} s of the {wall:.1f} s."]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps(
        {"command": cmd[1:], "wall_s": wall, "peak_rss_gib": rss_gib, "report": report, "floor": floor,
         "formulas": {label: want for label, _, want in rows}}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
