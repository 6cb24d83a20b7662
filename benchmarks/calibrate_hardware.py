"""Measure this machine's rates and write them as a hardware profile for ``zerocompile plan
--hardware FILE`` and ``zerocompile tune --hardware FILE``. Launch it as the training job is
launched (one process per GPU, or per CPU rank), on the machines you will train on::

    torchrun --nproc-per-node 8 benchmarks/calibrate_hardware.py --out my_cluster.json
    torchrun --nproc-per-node 2 benchmarks/calibrate_hardware.py --backend gloo --out here.json

Every rank measures with the cost model's probe (``zerocompile.passes.analyses.cost_model.probe``): a
matmul and a memory-bound copy on the rank's device, and all-gathers of two sizes on the whole
group (latency and bandwidth solved from them); every rank takes the slowest rank's figures.
``--nvme-path DIR`` also times the activation offload tier there (``offload_gbps``). Rank 0
writes the profile: those rates, ``ranks_per_node`` (the launch's local world size), the device
memory in GiB (``memory_gb``, CUDA only; ``--memory-gb`` for CPU ranks) and a name. The
all-gathers of one node measure the links inside it; for a multi-node profile, run it across
two nodes (``torchrun --nnodes 2 ...``) so ``bandwidth_gbps`` is the network's, and set
``intra_node_gbps`` from a single-node run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the hardware profile JSON to write")
    parser.add_argument("--backend", default=None, help="nccl on GPUs (default), gloo on CPUs")
    parser.add_argument("--nvme-path", default=None, help="also time activation offload files here")
    parser.add_argument("--memory-gb", type=float, default=None, help="device memory per rank, GiB (CPU ranks)")
    parser.add_argument("--name", default=None)
    args = parser.parse_args()

    from zerocompile.passes.analyses.cost_model import probe, probe_offload
    from zerocompile.runtime.comm import resolve_group
    from zerocompile.runtime.offload_settings import parse_activation_offload

    cuda = torch.cuda.is_available()
    backend = args.backend or ("nccl" if cuda else "gloo")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = resolve_group()
    cost = probe(group, device)
    if args.nvme_path:
        cost = probe_offload(cost, group, parse_activation_offload({"device": "nvme", "nvme_path": args.nvme_path}),
                             device)
    rates = cost.as_dict()
    memory = args.memory_gb
    if memory is None and device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory / 2**30
    profile = {"name": args.name or f"calibrated-{socket.gethostname()}",
               "description": f"measured by benchmarks/calibrate_hardware.py on {dist.get_world_size()} ranks "
                              f"({backend}, {device.type})",
               "flops_per_s": rates["flops_per_s"], "memory_gbps": rates["memory_gbps"],
               "bandwidth_gbps": rates["bandwidth_gbps"], "alpha_us": rates["alpha_us"],
               "offload_gbps": rates["offload_gbps"],
               "ranks_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
               "gradient_reduction": "reduce_scatter" if backend == "nccl" else "all_reduce"}
    if memory:
        profile["memory_gb"] = round(memory, 2)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(profile, f, indent=2)
        print(json.dumps(profile))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
