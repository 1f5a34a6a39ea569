"""The planner: memory per GPU, fit, step time, tokens/s/GPU, MFU, hours and dollars, from the flags alone.

    python tools/plan.py --model llama3-70b --nnodes 2 --nproc_per_node 8 --gpu h100 --seq_len 8192 \\
        --batch_size 64 --micro_batch_size 1 --ac full --offload_activations true --train_tokens 15e9 \\
        --gpu_hour_usd 2.00 [--plan_json plan.json]

(`python train.py --plan ...` runs this file with the same flags.) A tool, above the trainer: it imports train.py
and runs its code; the trainer never imports it. A run asks it for its own figures before step 1 in a subprocess
(`--run_figures`, a JSON request on stdin: run_figures; agree.ask_planner), docs/planning.md says why.

Everything printed is a prediction. Memory: the buffers alive at the moments a step peaks (train.py sections 1
and 2), each block by its --ac policy, and what --offload_optimizer and --offload_activations pin on the host;
what a block keeps, the state and the optimizer's temporaries are measured by running train.py's code under
fake tensors ("Reading the code"). Time: FLOPs / (peak x an efficiency from published runs) against the
collectives' bytes, plus --offload_optimizer's PCIe copies and CPU update. Also a checkpoint's save and load,
the stop's lead before a time limit (`stop_lead_time`), the saves' cost and interval (`checkpoint_interval`),
the fewest --ac blocks that fit (`partial_checkpointing`) and the nearest configuration that fits
(`nearest_fit`). Every constant is in GPUS or ASSUMPTIONS, its source in docs/planning.md; `plan()` returns them all.
"""

import dataclasses
import itertools
import json
import math
import os
import sys


if __name__ == "__main__":  # run as a script: the repository's modules, as from its root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as M  # noqa: E402
import train as T  # noqa: E402
from components import checks, hf  # noqa: E402
from components import out_dir as OD  # noqa: E402
from components import flags  # noqa: E402
from components import metrics  # noqa: E402
from components import offload as O  # noqa: E402
from tools.plan_memory import (  # noqa: E402  the memory model: tools/plan_memory.py
    COMPUTE_BYTES, FRAGMENTATION, GIB, READINGS, REDUCE_BYTES, Unplannable, block_kept_bytes, block_numels,
    block_training, frozen_unit_names, memory_by_phase, meta_model, offloaded_blocks, padded, policies_per_block,
    saved_bytes_per_element, unit_names, unit_numels, unit_state_bytes_per_param,
)

ADAMW_HOST_BYTES = 28       # torch._fused_adamw_: read param, grad, exp_avg, exp_avg_sq; write three of them


# Bandwidths are achievable per-GPU bus bandwidths for large messages, below the nominal link rate.
GPUS = {
    "h100": dict(device_name="NVIDIA H100 80GB HBM3", memory_mib=81559, family="h100",
                 hbm_gbps=3350, nvlink_gbps=360, nics_per_node=8, nic_gbps=45, pcie_gbps=40,
                 host_memory_gib_per_node=2048, host_cores_per_node=112, host_memory_gbps_per_node=614),
    "h100-pcie": dict(device_name="NVIDIA H100 PCIe", memory_mib=81559, family="h100",
                      hbm_gbps=2000, nvlink_gbps=40, nics_per_node=4, nic_gbps=45, pcie_gbps=40,
                      host_memory_gib_per_node=1024, host_cores_per_node=64, host_memory_gbps_per_node=614),
    "h200": dict(device_name="NVIDIA H200", memory_mib=143771, family="h100",
                 hbm_gbps=4800, nvlink_gbps=360, nics_per_node=8, nic_gbps=45, pcie_gbps=40,
                 host_memory_gib_per_node=2048, host_cores_per_node=112, host_memory_gbps_per_node=614),
    "a100": dict(device_name="NVIDIA A100-SXM4-80GB", memory_mib=81920, family="a100",
                 hbm_gbps=2039, nvlink_gbps=230, nics_per_node=8, nic_gbps=22, pcie_gbps=20,
                 host_memory_gib_per_node=2048, host_cores_per_node=128, host_memory_gbps_per_node=410),
    "a100-40gb": dict(device_name="NVIDIA A100-SXM4-40GB", memory_mib=40960, family="a100",
                      hbm_gbps=1555, nvlink_gbps=230, nics_per_node=8, nic_gbps=22, pcie_gbps=20,
                      host_memory_gib_per_node=1024, host_cores_per_node=128, host_memory_gbps_per_node=410),
}

# The constants the model assumes, by the names the code reads. What each one is and its source, one row per
# key, are in docs/planning.md ("What the planner assumes", which tests/test_plan.py holds to these keys and
# values), with the sources of GPUS' figures and how each part is modelled, which the docstrings here cite by name.
ASSUMPTIONS = {
    "host_usable_fraction": 0.9,        # of a node's host memory; the rest: the OS, loaders, page cache
    "host_memory_efficiency": 0.7,      # of the nominal DRAM bandwidth, reached by streaming kernels
    # MEASURED by bench/host_adamw.py on the development machine, 1 thread, 256M elements, 2026-12-03
    # (BENCHMARKS.md, "CPU: host AdamW and gradient accumulation")
    "host_adamw_per_core": 7.43e8,      # elements/s of torch._fused_adamw_, fp32: 20.8 GB/s of state touched
    "host_accumulate_per_core": 2.25e8,  # elements/s of the fp32 accumulator.add_(bf16 shard)
    "host_cpu_efficiency": 0.5,         # of that per-core rate, on the cores a GPU's process gets
    "host_update_extra_bytes": 18,      # host bytes per element besides AdamW's: norm, clipping, bf16 cast
    "fragmentation": FRAGMENTATION,     # allocator slack on everything but the persistent state
    "selective_recompute_time": 0.03,   # --ac selective's recompute, a fraction of the step
    "attention_efficiency": {"h100": 0.35, "a100": 0.50},  # of peak, FlashAttention-2 forward + backward
    "sample_chars_per_token": 4,        # --sample_prompts: the planner has no tokenizer
    "checkpoint_header_bytes_per_tensor": 128,  # a bound, each tensor's entry in the safetensors header
    "stop_margin": 1.25,                # on the stop's predicted worst case
    "restart_setup_s": 120,             # a restart's set-up before its load
    "host_page_locking_gbps": metrics.HOST_PAGE_LOCKING_GBPS,  # the start-up line prints it beside the measured rate
    "async_write_slowdown": 1.05,       # the steps beside a background write (1.51 measured on 2 shared cores)
}

def host_bytes_per_gpu(mcfg: M.ModelConfig, cfg, world: int, async_save: bool | None = None) -> dict:
    """Pinned host memory per GPU by part, as allocated (docs/planning.md: pinning): --offload_optimizer's state,
    --offload_activations' block inputs, --async_save's staging buffer. `async_save`: None, as planned."""
    frozen = frozen_unit_names(mcfg, cfg)
    state = O.host_state_bytes(rank_units(mcfg, frozen, world)) if cfg.offload_optimizer else 0  # the run's count
    activations = (sum(pinned_allocation_bytes(b) for b, off in block_kept_bytes(mcfg, cfg) if off)
                   if cfg.offload_activations else 0)
    async_save = async_save_planned(mcfg, cfg) if async_save is None else async_save
    staging = staging_bytes_per_rank(mcfg, world, frozen) if async_save else 0
    return dict(state=state, activations=activations, staging=staging)


def staging_bytes_per_rank(mcfg: M.ModelConfig, world: int, frozen: list | tuple = (), later: bool = False) -> int:
    """--async_save's staging buffer on each rank, exactly: the run's own count (checks.staging_bytes); `later`: what
    a save after the first copies into it (not the frozen units', written once: checkpoints.py)."""
    return checks.staging_bytes([(n, trained) for n, trained in rank_units(mcfg, frozen, world) if trained or not later])


def rank_units(mcfg: M.ModelConfig, frozen: list | tuple, world: int) -> list[tuple[int, bool]]:
    """(shard elements, trained) of each of a rank's units: the run's own reading (checks.rank_units)."""
    key = ("rank units", repr(mcfg), tuple(frozen), world, M.sharding_units)
    if key not in READINGS:
        READINGS[key] = checks.rank_units(meta_model(mcfg), list(frozen), world)
    return READINGS[key]


def async_save_planned(mcfg: M.ModelConfig, cfg) -> bool:
    """--async_save for the GPU run planned: 'auto' is on where the node's host memory fits it."""
    if cfg.async_save != "auto":
        return cfg.async_save == "true"
    return host_fits(mcfg, cfg, async_save=True)


def pinned_allocation_bytes(nbytes: float) -> int:
    """What pin_memory=True takes for `nbytes`: the caching host allocator's power of two (docs/planning.md:
    pinning)."""
    return 1 << max(0, math.ceil(nbytes) - 1).bit_length() if nbytes else 0


def host_usable_gib_per_node(cfg) -> float:
    return GPUS[cfg.gpu]["host_memory_gib_per_node"] * ASSUMPTIONS["host_usable_fraction"]


def host_fits(mcfg: M.ModelConfig, cfg, async_save: bool | None = None) -> bool:
    """What a node's GPUs pin together (host_bytes_per_gpu) fits in its usable host memory."""
    world = cfg.nnodes * cfg.nproc_per_node
    pinned_gib = sum(host_bytes_per_gpu(mcfg, cfg, world, async_save).values()) / GIB
    return pinned_gib * cfg.nproc_per_node <= host_usable_gib_per_node(cfg)


# ----------------------------------------------------------------------------------------------
# Time
# ----------------------------------------------------------------------------------------------

def executed_flops(mcfg: M.ModelConfig, seq_len: int, ac, chunked_ce: bool) -> tuple[float, float]:
    """(matmul, attention) FLOPs per token computed: the MFU count plus recompute, both of the active parameters (a
    routed block's experts a token runs: model.count_params). `ac`: one policy for every block, or each block's
    (policies_per_block)."""
    counts = M.count_params(mcfg)
    idle_per_block = (counts["total"] - counts["active"]) // mcfg.n_layers  # experts a token skips
    block_numel = max(block_numels(mcfg)) - idle_per_block
    attention = 12 * mcfg.n_layers * mcfg.n_heads * mcfg.head_dim * seq_len
    matmul = M.flops_per_token(mcfg, seq_len) - attention
    if mcfg.tie_embeddings:  # the head's matmul reads the embedding, which 6(N - emb) leaves out
        matmul += 6 * counts["embedding"]
    if chunked_ce:  # each cross-entropy chunk recomputes its logits in backward
        matmul += 2 * counts["embedding"]
    full = mcfg.n_layers if ac == "full" else 0 if isinstance(ac, str) else list(ac).count("full")
    if full:  # one more forward of each `full` block
        matmul += 2 * full * block_numel
        attention += attention / 3 * (full / mcfg.n_layers)
    return matmul, attention


def frozen_flops_skipped(mcfg: M.ModelConfig, cfg) -> tuple[float, list[bool]]:
    """(matmul FLOPs per token --freeze leaves out of executed_flops' 6 per parameter, each block: runs a backward?).
    A frozen parameter computes no weight gradient (2 of its 6); a block that trains nothing and whose input needs
    no gradient (a frozen prefix) runs no backward at all (4 of 6), nor a recompute; the frozen head's weight
    gradient, and with tied embeddings the embedding's, are not computed either."""
    frozen = frozen_unit_names(mcfg, cfg)
    backward = [trained or input_grad for trained, input_grad, _ in block_training(mcfg, cfg)]
    numels = dict(zip(unit_names(mcfg), unit_numels(mcfg)))
    skipped = sum(n * (2 if backward[M.block_of(name)] else 4) for name, n in numels.items()
                  if name in frozen and M.block_of(name) is not None)
    if "head" in frozen:  # the final norm and the untied lm_head
        skipped += 2 * numels["head"]
    if "embed" in frozen and mcfg.tie_embeddings:  # the head's matmul reads the embedding: its weight gradient
        skipped += 2 * numels["embed"]
    return skipped, backward


def gpu_peak_flops(gpu: dict) -> float:
    """The dense BF16 peak of a GPU of GPUS (metrics.PEAK_BF16_FLOPS, by its CUDA name)."""
    return next(flops for key, flops in metrics.PEAK_BF16_FLOPS if key in gpu["device_name"])


# Published runs the matmul efficiency is derived from: (GPU family, model dim, tokens/s/GPU, matmul and
# attention FLOPs executed per token (recompute included), time factor, source). Both H100 runs are
# FSDP full shard with 16,384 tokens per micro-batch; they also differ in power cap, HBM and software,
# and we interpolate between them in the model dim only. A measurement of this trainer replaces them.
def published_anchors() -> list:
    llama8b, llama70b = M.PRESETS["llama3.1-8b"](), M.PRESETS["llama3-70b"]()
    sel = 1 + ASSUMPTIONS["selective_recompute_time"]
    mpt70b_mm = 6 * 64.86e9 + 2 * 12 * 8192**2 * 80  # 6N (tied head included) + one more forward of the blocks
    mpt70b_attn = (12 + 4) * 80 * 8192 * 2048
    return [
        ("h100", 4096, 5762, *executed_flops(llama8b, 8192, "selective", False), sel,
         "torchtitan docs/performance.md: Llama 3.1 8B, 8 H100 (500 W, 96 GB HBM2e), FSDP2, selective AC, "
         "seq 8192, local batch 2, no torch.compile: 5,762 tok/s/GPU (33.7% MFU by model.flops_per_token)"),
        ("h100", 8192, 1039, mpt70b_mm, mpt70b_attn, 1.0,
         "llm-foundry scripts/train/benchmarking: MPT-70B, 64 H100 80GB, FULL_SHARD, full AC, seq 2048, "
         "micro-batch 8: 1,039 tok/s/GPU, 42.57% MFU"),
        ("a100", 4096, 2973, *executed_flops(llama8b, 8192, "selective", False), sel,
         "torchtitan docs/performance.md: Llama 3 8B, 64 A100 80GB, FSDP2, selective op AC, batch 1: 2,973"),
        ("a100", 8192, 331, *executed_flops(llama70b, 8192, "full", False), 1.0,
         "torchtitan docs/performance.md: Llama 3 70B, 64 A100 80GB, FSDP2, full AC, batch 1: 331"),
    ]


def matmul_efficiency(family: str, dim: int) -> float:
    """Fraction of peak the matmuls reach: solved from each anchor (its attention at attention_efficiency, the
    rest matmul), linear in the model dim between the two anchors, constant outside them."""
    attn_eff = ASSUMPTIONS["attention_efficiency"][family]
    points = []
    for fam, d, tok_s, mm, attn, factor, _ in published_anchors():
        if fam == family:
            peak = gpu_peak_flops(GPUS[fam])
            matmul_s = 1 / tok_s / factor - attn / (attn_eff * peak)
            points.append((d, mm / (matmul_s * peak)))
    (d0, e0), (d1, e1) = sorted(points)
    return e0 + (e1 - e0) * (min(max(dim, d0), d1) - d0) / (d1 - d0)


def bus_gbps(gpu: dict, cfg) -> float:
    """A collective's bus bandwidth over the run's GPUs, GB/s per GPU (docs/planning.md: network)."""
    if cfg.nnodes == 1:
        return gpu["nvlink_gbps"]
    nics = min(cfg.nics_per_node or gpu["nics_per_node"], cfg.nproc_per_node)
    return min(gpu["nvlink_gbps"], nics * (cfg.nic_gbps or gpu["nic_gbps"]))


def collective_bytes_per_micro_step(mcfg: M.ModelConfig, cfg, world: int) -> tuple[float, float]:
    """(all-gather, reduce-scatter) bytes of the full buffers, one forward + backward. Blocks are gathered
    twice, but a frozen prefix's once (no backward: --freeze); the head stays gathered across the turn; the
    embedding's backward needs no weights (the tied head gathers it once more instead). Every trained unit's
    gradient is reduce-scattered once; a frozen unit has none."""
    numels, frozen = [padded(n, world) for n in unit_numels(mcfg)], frozen_unit_names(mcfg, cfg)
    emb, head = numels[0], numels[-1]
    backward = [trained or input_grad for trained, input_grad, _ in block_training(mcfg, cfg)]
    blocks = sum((1 + backward[i]) * n for i, n in enumerate(block_numels(mcfg, world)))
    gathers = emb * (2 if mcfg.tie_embeddings else 1) + blocks + head
    reduced = sum(n for name, n in zip(unit_names(mcfg), numels) if name not in frozen)
    return COMPUTE_BYTES * gathers, REDUCE_BYTES[cfg.reduce_dtype] * reduced


def first_trained_numel(mcfg: M.ModelConfig, cfg, world: int) -> int:
    """The padded elements of the first unit that trains: backward's last reduce-scatter (the embedding's without
    --freeze); 0 when none trains."""
    frozen = frozen_unit_names(mcfg, cfg)
    return next((padded(n, world) for name, n in zip(unit_names(mcfg), unit_numels(mcfg)) if name not in frozen), 0)


def host_elements_per_s(gpu: dict, nproc_per_node: int, per_core: float, bytes_per_element: int) -> float:
    """Elements/s one GPU's share of the host processes (docs/planning.md: offload_optimizer)."""
    cores = gpu["host_cores_per_node"] / nproc_per_node
    compute = per_core * cores * ASSUMPTIONS["host_cpu_efficiency"]
    bandwidth = host_gbps_per_gpu(gpu, nproc_per_node) * 1e9 / bytes_per_element
    return min(compute, bandwidth)


def host_gbps_per_gpu(gpu: dict, nproc_per_node: int) -> float:
    return gpu["host_memory_gbps_per_node"] * ASSUMPTIONS["host_memory_efficiency"] / nproc_per_node


def offload_optimizer_time(mcfg: M.ModelConfig, cfg, gpu: dict, world: int) -> dict:
    """--offload_optimizer per step per GPU (docs/planning.md: offload_optimizer): the PCIe copies both ways, the
    host's gradient accumulation and its update. Gradients come down and AdamW runs for the trained units only
    (--freeze); every unit's compute-dtype copy goes up (offload.refresh_compute_shards)."""
    frozen = frozen_unit_names(mcfg, cfg)
    slice_numel = sum(padded(n, world) for n in unit_numels(mcfg)) / world
    trained_numel = sum(padded(n, world) for name, n in zip(unit_names(mcfg), unit_numels(mcfg))
                        if name not in frozen) / world
    rbytes = REDUCE_BYTES[cfg.reduce_dtype]
    micro_steps = cfg.batch_size // (world * cfg.micro_batch_size)
    host_gbps = host_gbps_per_gpu(gpu, cfg.nproc_per_node)
    pcie = 1e9 * min(gpu["pcie_gbps"], host_gbps)
    d2h_bytes, h2d_bytes = rbytes * trained_numel, COMPUTE_BYTES * slice_numel  # per micro-batch / per step
    accumulate = host_elements_per_s(gpu, cfg.nproc_per_node, ASSUMPTIONS["host_accumulate_per_core"],
                                     4 + rbytes + 4)
    adamw = host_elements_per_s(gpu, cfg.nproc_per_node, ASSUMPTIONS["host_adamw_per_core"], ADAMW_HOST_BYTES)
    extra_s = ASSUMPTIONS["host_update_extra_bytes"] * slice_numel / (1e9 * host_gbps)
    cast_s = (4 + COMPUTE_BYTES) * slice_numel / (1e9 * host_gbps)  # part of extra_s: the copies up overlap it
    last_numel = first_trained_numel(mcfg, cfg, world) / world  # backward's last gradient
    return dict(pcie_d2h_gb=micro_steps * d2h_bytes / 1e9, pcie_h2d_gb=h2d_bytes / 1e9,
                d2h_s_per_micro=d2h_bytes / pcie, h2d_s=h2d_bytes / pcie,
                h2d_exposed_s=max(0.0, h2d_bytes / pcie - cast_s),
                last_unit_tail_s=last_numel * rbytes / pcie + last_numel / accumulate,
                accumulate_s_per_micro=trained_numel / accumulate,
                host_adamw_s=trained_numel / adamw, host_extra_s=extra_s,
                host_adamw_elements_per_s_per_gpu=adamw, host_accumulate_elements_per_s_per_gpu=accumulate)


def step_time(mcfg: M.ModelConfig, cfg, gpu: dict, world: int) -> dict:
    """Seconds per optimizer step: per micro-batch, compute against the collectives and the offload copies
    (docs/planning.md: overlap, offload_overlap); then AdamW, on the GPU or on the CPU with the exposed PCIe copies."""
    peak = gpu_peak_flops(gpu)
    tokens = cfg.micro_batch_size * cfg.seq_len
    skipped, backward = frozen_flops_skipped(mcfg, cfg)
    policies = [p if b else "none" for p, b in zip(policies_per_block(mcfg, cfg), backward)]  # no backward: no recompute
    matmul, attention = executed_flops(mcfg, cfg.seq_len, policies, 0 < cfg.ce_chunk < tokens)
    matmul -= skipped
    attention -= 8 * mcfg.n_heads * mcfg.head_dim * cfg.seq_len * backward.count(False)  # backward: 8 of its 12
    attn_eff = ASSUMPTIONS["attention_efficiency"][gpu["family"]]
    compute_s = tokens * (matmul / matmul_efficiency(gpu["family"], mcfg.dim) + attention / attn_eff) / peak
    selective = policies.count("selective")
    if selective:  # the share of the blocks running selective
        compute_s *= 1 + ASSUMPTIONS["selective_recompute_time"] * (selective / mcfg.n_layers)
    bandwidth = 1e9 * bus_gbps(gpu, cfg)
    ring = (world - 1) / world  # each GPU sends and receives (W-1)/W of the full buffer
    comm_s = ring * sum(collective_bytes_per_micro_step(mcfg, cfg, world)) / bandwidth
    n_offloaded = offloaded_blocks(mcfg, cfg)
    block_input_bytes = max(b for b, _ in block_kept_bytes(mcfg, cfg)[:n_offloaded]) if n_offloaded else 0
    offload_s = 2 * n_offloaded * block_input_bytes / (1e9 * gpu["pcie_gbps"]) if n_offloaded else 0.0
    # Exposed: the last block's offloaded input coming back, and, with --prefetch, the embedding's first
    # all-gather and the last reduce-scatter, the first trained unit's (without, the collectives are all in the sum).
    ends_bytes = (padded(unit_numels(mcfg)[0], world) * COMPUTE_BYTES
                  + first_trained_numel(mcfg, cfg, world) * REDUCE_BYTES[cfg.reduce_dtype])
    exposed_s = block_input_bytes / (1e9 * gpu["pcie_gbps"]) if n_offloaded else 0.0
    if cfg.prefetch:
        exposed_s += ring * ends_bytes / bandwidth
        micro_s = max(compute_s, comm_s, offload_s) + exposed_s
    else:  # the offload copies run on their own stream either way
        micro_s = max(compute_s + comm_s, offload_s) + exposed_s
    micro_steps = cfg.batch_size // (world * cfg.micro_batch_size)
    host = dict(pcie_d2h_gb=0.0, pcie_h2d_gb=0.0, pcie_d2h_s=0.0, pcie_h2d_s=0.0, pcie_exposed_s=0.0,
                host_accumulate_s=0.0)
    if cfg.offload_optimizer:
        o = offload_optimizer_time(mcfg, cfg, gpu, world)
        # The shards come down and are accumulated while backward runs: everything but one plain forward.
        backward_s = compute_s * (1 - M.flops_per_token(mcfg, cfg.seq_len) / 3 / (matmul + attention))
        d2h_exposed = max(0.0, max(o["d2h_s_per_micro"], o["accumulate_s_per_micro"]) - backward_s)
        optimizer_s = o["host_adamw_s"] + o["host_extra_s"]
        host = dict(pcie_d2h_gb=o["pcie_d2h_gb"], pcie_h2d_gb=o["pcie_h2d_gb"],
                    pcie_d2h_s=micro_steps * o["d2h_s_per_micro"], pcie_h2d_s=o["h2d_s"],
                    pcie_exposed_s=micro_steps * d2h_exposed + o["last_unit_tail_s"] + o["h2d_exposed_s"],
                    host_accumulate_s=micro_steps * o["accumulate_s_per_micro"],
                    host_adamw_elements_per_s_per_gpu=o["host_adamw_elements_per_s_per_gpu"])
    else:  # the update reads and writes every fp32 shard of the trained units once (docs/planning.md: adamw)
        frozen = frozen_unit_names(mcfg, cfg)
        state_bytes = sum(b * padded(n, world) for b, n, name in zip(unit_state_bytes_per_param(mcfg, cfg),
                                                                      unit_numels(mcfg), unit_names(mcfg))
                          if name not in frozen) / world
        optimizer_s = 2 * state_bytes / (0.8e9 * gpu["hbm_gbps"])
    # What bounds a micro-batch: the longest of what runs at once (with --prefetch), else compute + collectives
    parts = dict(compute=compute_s, collectives=comm_s, offload=offload_s) if cfg.prefetch else \
        {"compute + collectives": compute_s + comm_s, "offload": offload_s}
    return dict(step_time_s=micro_steps * micro_s + optimizer_s + host["pcie_exposed_s"],
                bound=max(parts, key=parts.get), compute_s=micro_steps * compute_s,
                comm_s=micro_steps * comm_s, offload_s=micro_steps * offload_s,
                exposed_s=micro_steps * exposed_s, optimizer_s=optimizer_s,
                micro_steps=micro_steps, bandwidth_gbps=bandwidth / 1e9, matmul_flops_per_token=matmul,
                attention_flops_per_token=attention, **host)


def sampling_time(mcfg: M.ModelConfig, cfg, gpu: dict, world: int, n_prompts: int, prompt_tokens: int) -> dict:
    """Seconds --sample_prompts adds to each evaluation (docs/planning.md: sampling), the bytes it all-gathers per GPU
    and the KV cache each rank holds (every rank runs every prompt)."""
    numels = [padded(n, world) for n in unit_numels(mcfg)]
    gathered_bytes = COMPUTE_BYTES * (sum(numels) + (numels[0] if mcfg.tie_embeddings else 0))  # tied: the head
    bandwidth = 1e9 * bus_gbps(gpu, cfg)
    gather_s = (world - 1) / world * gathered_bytes / bandwidth
    prefill_flops = 2 * M.count_params(mcfg)["active"] * n_prompts * prompt_tokens
    prefill_s = prefill_flops / (gpu_peak_flops(gpu) * matmul_efficiency(gpu["family"], mcfg.dim))
    decode_s = n_prompts * gathered_bytes / (0.8e9 * gpu["hbm_gbps"])
    pass_s = [max(gather_s, s) if cfg.prefetch else gather_s + s for s in (prefill_s, decode_s)]
    kv_per_token = 2 * mcfg.n_layers * mcfg.n_kv_heads * mcfg.head_dim * COMPUTE_BYTES
    kv_bytes = kv_per_token * n_prompts * (prompt_tokens + cfg.sample_tokens)
    return dict(sampling_s=pass_s[0] + (cfg.sample_tokens - 1) * pass_s[1],
                sampling_gathered_gb=cfg.sample_tokens * gathered_bytes / 1e9, sampling_gather_s_per_pass=gather_s,
                sampling_prefill_s=prefill_s, sampling_decode_s_per_pass=decode_s, sampling_kv_cache_gib=kv_bytes / GIB,
                sampling_prompts=n_prompts, sampling_prompt_tokens=prompt_tokens)


def prompt_sizes(cfg) -> tuple[int, int]:
    """(prompts, tokens of the longest) of --sample_prompts, the tokens estimated from characters."""
    records = flags.read_prompts(cfg.sample_prompts)
    chars = max(len(r["text"]) if "text" in r else sum(len(m["content"]) for m in r["messages"]) for r in records)
    return len(records), -(-chars // ASSUMPTIONS["sample_chars_per_token"])


# ----------------------------------------------------------------------------------------------
# Checkpoints, and the stop before a time limit
# ----------------------------------------------------------------------------------------------

def checkpoint_bytes_per_rank(mcfg: M.ModelConfig, world: int, frozen: list | tuple = (), later: bool = False) -> int:
    """What checkpoints.save_checkpoint writes on each rank: every unit's saved shards (saved_bytes_per_element;
    gradients are not saved) and the safetensors headers (checkpoint_header_bytes_per_tensor each, a bound). Frozen
    units' go into a file of their own (the frozen set), which only the run's first save writes: a `later` save
    writes the trained units' alone."""
    sizes = [(n, saved_bytes_per_element(name in frozen)) for name, n in zip(unit_names(mcfg), unit_numels(mcfg))
             if not (later and name in frozen)]
    data = sum(sum(per_element) * padded(n, world) // world for n, per_element in sizes)
    tensors = sum(len(per_element) for _, per_element in sizes)
    files = 2 if frozen and not later else 1
    return 8 * files + ASSUMPTIONS["checkpoint_header_bytes_per_tensor"] * tensors + data


def save_stall_s(asynchronous: bool, every: int, step_time_s: float, save_s: float, copy_s: float) -> float:
    """What one periodic save every `every` steps stalls the run: synchronous, the whole write; asynchronous, the
    copy to host memory, the steps beside the write made slower and any wait for the write before it."""
    if not asynchronous:
        return save_s
    slower_s = (ASSUMPTIONS["async_write_slowdown"] - 1) * min(save_s, every * step_time_s)
    return copy_s + slower_s + max(0.0, save_s - every * step_time_s)


def stop_lead_time(mcfg: M.ModelConfig, cfg, step_time_s: float, sampling_s: float = 0.0) -> dict:
    """How long before a time limit a stop request must arrive for the run to reach a step boundary and save
    (docs/planning.md: stop_worst_case, stop_margin), rounded up to a minute for launch.sbatch's --signal=USR1@N.
    `sampling_s`: what --sample_prompts adds to each evaluation. Also the final export, outside the lead."""
    gpu, world = GPUS[cfg.gpu], cfg.nnodes * cfg.nproc_per_node
    asynchronous, frozen = async_save_planned(mcfg, cfg), frozen_unit_names(mcfg, cfg)
    # The run's first save writes the frozen units' set (--freeze) too: the worst case here (a stop before any save)
    ckpt_bytes = checkpoint_bytes_per_rank(mcfg, world, frozen)
    later_bytes = checkpoint_bytes_per_rank(mcfg, world, frozen, later=True)  # each save after it
    save_s, later_save_s = ckpt_bytes / (1e9 * cfg.fs_write_gbps), later_bytes / (1e9 * cfg.fs_write_gbps)
    load_s = save_s  # a restart reads back what a save wrote, at the same rate per rank: the frozen set too
    # An asynchronous save's copy into the staging buffer (docs/planning.md: async_save_copy): host to host with
    # --offload_optimizer (each byte read and written), else over PCIe
    host_gbps = host_gbps_per_gpu(gpu, cfg.nproc_per_node)
    copy_gbps = host_gbps / 2 if cfg.offload_optimizer else min(gpu["pcie_gbps"], host_gbps)
    copy_s = staging_bytes_per_rank(mcfg, world, frozen) / (1e9 * copy_gbps)
    later_copy_s = staging_bytes_per_rank(mcfg, world, frozen, later=True) / (1e9 * copy_gbps)
    periodic_save_s = (save_stall_s(asynchronous, cfg.ckpt_every, step_time_s, save_s, copy_s)
                       if cfg.ckpt_every else 0.0)
    state_bytes = host_bytes_per_gpu(mcfg, cfg, world, asynchronous)["state"]  # the staging buffer: beside step 1
    page_locking_s = state_bytes / 1e9 / ASSUMPTIONS["host_page_locking_gbps"]
    restart_setup_s = ASSUMPTIONS["restart_setup_s"] + page_locking_s
    restart_s = restart_setup_s + load_s
    before_step_s = max(periodic_save_s, restart_s)  # one or the other: a restart ends the save in progress
    eval_s = cfg.eval_batches * step_time_s + sampling_s if cfg.eval_every else 0.0
    lead_s = ASSUMPTIONS["stop_margin"] * (before_step_s + step_time_s + eval_s + save_s)
    export_bytes = COMPUTE_BYTES * M.count_params(mcfg)["total"]
    export_read_bytes = 4 * M.count_params(mcfg)["total"]  # tools/export_hf.py reads the fp32 master weights back
    return dict(checkpoint_gb_per_rank=ckpt_bytes / 1e9, save_s=save_s, load_s=load_s, async_save=asynchronous,
                later_checkpoint_gb_per_rank=later_bytes / 1e9, later_save_s=later_save_s,
                later_save_copy_s=later_copy_s,
                save_copy_s=copy_s, periodic_save_s=periodic_save_s, page_locking_s=page_locking_s,
                restart_setup_s=restart_setup_s, restart_s=restart_s,
                before_step_s=before_step_s, eval_s=eval_s, stop_lead_s=lead_s,
                signal_lead_s=60 * math.ceil(lead_s / 60),
                export_gb=export_bytes / 1e9, export_read_gb=export_read_bytes / 1e9,
                export_s=(export_read_bytes + export_bytes) / world / (1e9 * cfg.fs_write_gbps))  # 1/W per rank


def checkpoint_interval(cfg, step_time_s: float, save_s: float, restart_s: float, copy_s: float,
                        asynchronous: bool, once_s: float = 0.0) -> dict:
    """What the saves at --ckpt_every cost, synchronous and asynchronous (save_stall_s; the run's last write is
    waited for), and the interval that balances them against the work a failure loses, for the mode the run
    uses (docs/planning.md: checkpoint_interval). `save_s`, `copy_s`: a save after the first; `once_s`: what the
    first writes besides (the frozen units' set, --freeze), counted once as a stall."""
    steps = math.ceil(cfg.train_tokens / (cfg.batch_size * cfg.seq_len)) if cfg.train_tokens else cfg.steps
    train_s = steps * step_time_s
    mtbf_s = 3600 * cfg.mtbf_hours
    every = cfg.ckpt_every or max(steps, 1)  # --ckpt_every 0: one save, at the end
    # Young (1974), "A first order approximation to the optimum checkpoint interval": the work between saves
    # that minimises saving + lost work is sqrt(2 x save x MTBF); Daly (2006), "A higher order estimate of the
    # optimum checkpoint interval for restart dumps", refines it for saves not small against the MTBF. The
    # write a failure also loses, asynchronous, is the same at every interval: it does not move the optimum.
    slower_s = (ASSUMPTIONS["async_write_slowdown"] - 1) * save_s  # the steps beside a write
    young_daly_steps = math.sqrt(2 * (copy_s + slower_s if asynchronous else save_s) * mtbf_s) / step_time_s
    write_steps = math.ceil(save_s / step_time_s) if asynchronous else 1  # at most one save in flight
    suggested_ckpt_every = max(1, write_steps, round(young_daly_steps))

    def saves(interval: int) -> int:
        return math.ceil(steps / interval) if steps else 0

    def stalled_s(interval: int, mode: bool) -> float:  # the last save's write waited for
        once = once_s if saves(interval) else 0.0
        if not mode or not saves(interval):
            return saves(interval) * save_s + once
        return (saves(interval) - 1) * save_stall_s(True, interval, step_time_s, save_s, copy_s) + save_s + once

    def fraction(mode: bool) -> float:  # of the run spent saving
        return stalled_s(every, mode) / (train_s + stalled_s(every, mode)) if train_s else 0.0

    def cost(interval: int) -> dict:  # the saves + failures x (half an interval [+ the write] + restart)
        lost_per_failure_s = interval * step_time_s / 2 + (save_s if asynchronous else 0.0) + restart_s
        overhead_s = stalled_s(interval, asynchronous) + train_s / mtbf_s * lost_per_failure_s
        return dict(lost_per_failure_s=lost_per_failure_s, overhead_fraction=overhead_s / train_s if train_s else 0.0)

    now, best = cost(every), cost(suggested_ckpt_every)
    async_stall_s = save_stall_s(True, every, step_time_s, save_s, copy_s)
    return dict(save_stall_s=async_stall_s if asynchronous else save_s, sync_save_stall_s=save_s,
                async_write_wait_s=max(0.0, save_s - every * step_time_s),
                async_slower_s=(ASSUMPTIONS["async_write_slowdown"] - 1) * min(save_s, every * step_time_s),
                async_save_stall_s=async_stall_s, run_steps=steps, saves=saves(every),
                save_fraction=fraction(asynchronous), sync_save_fraction=fraction(False),
                async_save_fraction=fraction(True), young_daly_ckpt_every=young_daly_steps, write_steps=write_steps,
                suggested_ckpt_every=suggested_ckpt_every, lost_per_failure_s=now["lost_per_failure_s"],
                overhead_fraction=now["overhead_fraction"], suggested_lost_per_failure_s=best["lost_per_failure_s"],
                suggested_overhead_fraction=best["overhead_fraction"])


# ----------------------------------------------------------------------------------------------
# The plan, the checks, the table
# ----------------------------------------------------------------------------------------------

def fit_and_speed(mcfg: M.ModelConfig, cfg) -> dict:
    """Peak GPU memory, fit and speed of one configuration: what plan() and the searches below share."""
    gpu, world = GPUS[cfg.gpu], cfg.nnodes * cfg.nproc_per_node
    phases = memory_by_phase(mcfg, cfg, world)
    peak_phase = max(phases, key=lambda p: sum(phases[p].values()))
    peak_gib = sum(phases[peak_phase].values()) / GIB
    usable_gib = gpu["memory_mib"] / 1024
    time = step_time(mcfg, cfg, gpu, world)
    tokens_per_sec_per_gpu = cfg.batch_size * cfg.seq_len / time["step_time_s"] / world
    return dict(phases=phases, peak_phase=peak_phase, peak_gib=peak_gib, usable_gib=usable_gib,
                fits=peak_gib <= usable_gib, time=time, tokens_per_sec_per_gpu=tokens_per_sec_per_gpu,
                mfu=tokens_per_sec_per_gpu * M.flops_per_token(mcfg, cfg.seq_len) / gpu_peak_flops(gpu))


def as_launched(cfg, world: int, local_world: int, device_name: str):
    """cfg as the planner sees the run launched (W ranks, local_world per node, the GPU's CUDA name), or None for
    a GPU the planner does not know."""
    gpu = next((key for key, g in GPUS.items() if g["device_name"] == device_name), None)
    if gpu is None:
        return None
    return dataclasses.replace(cfg, gpu=gpu, nnodes=max(1, world // local_world), nproc_per_node=local_world)


def run_memory_gib(mcfg: M.ModelConfig, cfg, world: int, local_world: int, device_name: str) -> dict | None:
    """The planner's figures for a run as launched, printed beside the measured ones: the state, the peak, its
    phase and each phase's total, the part outside PyTorch's allocator (--outside_gib), the bus bandwidth."""
    run = as_launched(cfg, world, local_world, device_name)
    if run is None:
        return None
    try:
        r = fit_and_speed(mcfg, run)
    except Unplannable:  # --plan says why; the run goes on without the planner's figures, as on an unknown GPU
        return None
    return dict(state_gib=r["phases"][r["peak_phase"]]["state"] / GIB + cfg.outside_gib, peak_gib=r["peak_gib"],
                context_gib=cfg.outside_gib, peak_phase=r["peak_phase"], bus_gbps=bus_gbps(GPUS[run.gpu], run),
                phases_gib={name: sum(parts.values()) / GIB for name, parts in r["phases"].items()})


def partial_checkpointing(mcfg: M.ModelConfig, cfg) -> dict | None:
    """The smallest --ac_blocks that fits in GPU and host memory (the most blocks on --ac_rest); None when --ac
    and --ac_rest are the same policy or nothing fits even with every block on --ac."""
    if cfg.ac == cfg.ac_rest:
        return None
    for k in range(mcfg.n_layers + 1):
        trial = dataclasses.replace(cfg, ac_blocks=k)
        r = fit_and_speed(mcfg, trial)
        if r["fits"] and host_fits(mcfg, trial):
            return dict(ac_blocks=k, ac=cfg.ac, ac_rest=cfg.ac_rest, peak_gib_per_gpu=r["peak_gib"],
                        step_time_s=r["time"]["step_time_s"], tokens_per_sec_per_gpu=r["tokens_per_sec_per_gpu"],
                        mfu=r["mfu"])
    return None


def plan(mcfg: M.ModelConfig, cfg) -> dict:
    """The whole prediction for one configuration, as plain numbers (what --plan_json writes). Hours and
    dollars only for a configuration that fits, in GPU and in host memory (None otherwise)."""
    gpu, world = GPUS[cfg.gpu], cfg.nnodes * cfg.nproc_per_node
    r = fit_and_speed(mcfg, cfg)
    phases, peak_phase, time = r["phases"], r["peak_phase"], r["time"]
    fits_host = host_fits(mcfg, cfg)
    hours = cfg.train_tokens / (r["tokens_per_sec_per_gpu"] * world) / 3600 if r["fits"] and fits_host else None
    host = host_bytes_per_gpu(mcfg, cfg, world)
    host_gib_per_gpu = sum(host.values()) / GIB
    sampling = sampling_time(mcfg, cfg, gpu, world, *prompt_sizes(cfg)) if cfg.sample_prompts else {}
    stop = stop_lead_time(mcfg, cfg, time["step_time_s"], sampling.get("sampling_s", 0.0))
    assumptions = dict(ASSUMPTIONS, gpu=dict(gpu, peak_bf16_flops=gpu_peak_flops(gpu)),
                       matmul_efficiency=matmul_efficiency(gpu["family"], mcfg.dim),  # from these anchors
                       anchors=[a[-1] for a in published_anchors() if a[0] == gpu["family"]])
    return dict(
        model=cfg.init_from or cfg.model or "tiny", params=M.count_params(mcfg)["total"],
        active_params=M.count_params(mcfg)["active"], experts=[mcfg.experts_per_token, mcfg.n_experts], world=world,
        gpu=cfg.gpu,
        state_gib_per_gpu=phases[peak_phase]["state"] / GIB, peak_gib_per_gpu=r["peak_gib"], peak_phase=peak_phase,
        usable_gib=r["usable_gib"], fits=r["fits"],
        memory_gib={k: v / GIB for k, v in phases[peak_phase].items()},
        memory_by_phase_gib={p: {k: v / GIB for k, v in parts.items()} for p, parts in phases.items()},
        **time, tokens_per_sec_per_gpu=r["tokens_per_sec_per_gpu"], mfu=r["mfu"],
        hours=hours, cost_usd=None if hours is None else hours * world * cfg.gpu_hour_usd,
        block_policies=policies_per_block(mcfg, cfg), offload_optimizer=cfg.offload_optimizer,
        host_gib_per_gpu=host_gib_per_gpu, host_gib_by_part_per_gpu={k: v / GIB for k, v in host.items()},
        host_gib_per_node=host_gib_per_gpu * cfg.nproc_per_node, host_usable_gib_per_node=host_usable_gib_per_node(cfg),
        host_fits=fits_host, async_save_drop=async_save_drop_hint(mcfg, cfg), **sampling, **stop,
        **checkpoint_interval(cfg, time["step_time_s"], stop["later_save_s"], stop["restart_s"],
                              stop["later_save_copy_s"], stop["async_save"], stop["save_s"] - stop["later_save_s"]),
        partial_checkpointing=partial_checkpointing(mcfg, cfg), assumptions=assumptions)


# ----------------------------------------------------------------------------------------------
# A configuration that does not fit: the nearest one that does
# ----------------------------------------------------------------------------------------------

def memory_savers(cfg) -> list[list[dict]]:
    """The flag changes that lower memory and cfg does not have yet, each a list of alternatives: a smaller
    micro-batch (each size that divides the batch, nearest first), then one change each."""
    world = cfg.nnodes * cfg.nproc_per_node
    smaller = [dict(micro_batch_size=m) for m in range(cfg.micro_batch_size - 1, 0, -1)
               if cfg.batch_size % (world * m) == 0]
    changes = [change for change in (dict(ac="full", ac_blocks=-1), dict(offload_activations=True),
                                     dict(reduce_dtype="bfloat16"), dict(offload_optimizer=True))
               if any(getattr(cfg, k) != v for k, v in change.items())]
    if cfg.async_save == "true":  # host memory: 'auto' keeps the staging buffer only where it fits
        changes.append(dict(async_save="auto"))
    return ([smaller] if smaller else []) + [[change] for change in changes]


def nearest_fit(mcfg: M.ModelConfig, cfg):
    """The configuration nearest to cfg that fits in GPU and host memory: the fewest memory_savers (of those, the
    most tokens/s/GPU), with partial checkpointing where every block on --ac leaves room; on cfg's nodes, else
    on 2, 4 or 8 times as many. None when nothing tried fits."""
    for nnodes in (cfg.nnodes, 2 * cfg.nnodes, 4 * cfg.nnodes, 8 * cfg.nnodes):
        base = dataclasses.replace(cfg, nnodes=nnodes)
        savers = memory_savers(base)
        for n_changes in range(len(savers) + 1):
            fitting = []
            for chosen in itertools.combinations(savers, n_changes):
                for changes in itertools.product(*chosen):
                    trial = dataclasses.replace(base, **{k: v for change in changes for k, v in change.items()})
                    if flags.check_flags(trial, trial.nnodes * trial.nproc_per_node):
                        continue  # not a configuration the trainer accepts
                    if not (fit_and_speed(mcfg, trial)["fits"] and host_fits(mcfg, trial)):
                        continue
                    best = partial_checkpointing(mcfg, trial) if trial.ac_blocks == -1 else None
                    if best and best["ac_blocks"] < mcfg.n_layers:
                        trial = dataclasses.replace(trial, ac_blocks=best["ac_blocks"])
                    fitting.append(trial)
            if fitting:
                return max(fitting, key=lambda c: fit_and_speed(mcfg, c)["tokens_per_sec_per_gpu"])
    return None


def changed_flags(cfg, other) -> str:
    """The flags of `other` that differ from cfg's, as they would be typed (--ac_rest with --ac_blocks)."""
    names = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(other, f.name)]
    if "ac_blocks" in names and other.ac_blocks >= 0 and "ac_rest" not in names:
        names.insert(names.index("ac_blocks") + 1, "ac_rest")
    values = {name: getattr(other, name) for name in names}
    return " ".join(f"--{name} {str(v).lower() if isinstance(v, bool) else v}" for name, v in values.items())


def not_fitting_message(mcfg: M.ModelConfig, cfg, p: dict, nearest) -> str:
    """--plan's error line for a configuration that does not fit: what does not, and the nearest that does."""
    what = []
    if not p["fits"]:
        what.append(f"peak {p['peak_gib_per_gpu']:.1f} GiB per GPU ({p['peak_phase']}) of {p['usable_gib']:.1f}")
    if not p["host_fits"]:
        what.append(f"{p['host_gib_per_node']:,.0f} GiB of host memory per node of "
                    f"{p['host_usable_gib_per_node']:,.0f} usable")
    message = f"--plan: this configuration does not fit: {' and '.join(what)} (predicted)"
    if p["async_save_drop"]:
        message += f"; {p['async_save_drop']}"
    if nearest is None:
        return (message + "; nothing the planner tried fits (a smaller --micro_batch_size, --ac full, "
                          "--offload_activations, --reduce_dtype bfloat16, --offload_optimizer, up to 8 x --nnodes)")
    q = plan(mcfg, nearest)
    cost = f", {q['hours']:,.0f} h = ${q['cost_usd']:,.0f}" if cfg.train_tokens else ""
    return (message + f"; the nearest that fits: {changed_flags(cfg, nearest)} (peak {q['peak_gib_per_gpu']:.1f} "
                      f"GiB, {q['tokens_per_sec_per_gpu']:,.0f} tokens/s/GPU{cost}, predicted)")


def async_save_drop_hint(mcfg: M.ModelConfig, cfg) -> str | None:
    """--async_save true whose staging buffer does not fit the node's host memory beside what is offloaded:
    which flag to drop, --async_save or --offload_optimizer, by which of the two then fits; None otherwise."""
    if cfg.async_save != "true" or host_fits(mcfg, cfg):
        return None
    world = cfg.nnodes * cfg.nproc_per_node
    staging_gib = staging_bytes_per_rank(mcfg, world, frozen_unit_names(mcfg, cfg)) * cfg.nproc_per_node / GIB
    candidates = [("--async_save true", dataclasses.replace(cfg, async_save="false"))]
    if cfg.offload_optimizer:
        candidates.append(("--offload_optimizer", dataclasses.replace(cfg, offload_optimizer=False)))
    drop = [flag for flag, other in candidates if host_fits(mcfg, other) and fit_and_speed(mcfg, other)["fits"]]
    beside = " beside --offload_optimizer's state" if cfg.offload_optimizer else ""
    does_not_fit = f"--async_save true: its staging buffer ({staging_gib:,.0f} GiB per node) does not fit{beside}"
    if not drop:
        either = "--async_save true or --offload_optimizer" if cfg.offload_optimizer else "--async_save true"
        return f"{does_not_fit}, and dropping {either} alone does not make this configuration fit"
    return (f"{does_not_fit}: drop {' or '.join(drop)} (--async_save auto turns it off where it does not fit; saves "
            f"then stall for the whole write)")


def seconds(s: float) -> str:
    """A duration for the table: whole seconds, with a decimal under 10 s (an asynchronous save's copy)."""
    return f"{s:.1f}" if s < 10 else f"{s:.0f}"


def table(p: dict, cfg) -> str:
    """The plan as the lines --plan prints: memory, speed, then checkpoint_lines and what to change."""
    phases, gpu, n_blocks = p["memory_by_phase_gib"], GPUS[cfg.gpu], len(p["block_policies"])
    names = list(phases)
    n_ac = n_blocks if cfg.ac_blocks < 0 else min(cfg.ac_blocks, n_blocks)
    ac = f"ac {cfg.ac}" + (" + offload" if cfg.offload_activations else "")
    if n_ac < n_blocks:
        ac += f" x {n_ac} blocks, {cfg.ac_rest} x {n_blocks - n_ac}"
    lines = [f"{p['model']}: {p['params'] / 1e9:.2f}B params | {cfg.nnodes} x {cfg.nproc_per_node} {cfg.gpu} "
             f"(W={p['world']}) | seq {cfg.seq_len} x micro {cfg.micro_batch_size}, batch {cfg.batch_size} "
             f"({p['micro_steps']} accumulation) | {ac} | reduce {cfg.reduce_dtype} | prefetch "
             f"{'on' if cfg.prefetch else 'off'} | ce_chunk {cfg.ce_chunk}"
             + (" | optimizer offloaded to the CPU" if cfg.offload_optimizer else ""),
             "", f"{'memory per GPU, GiB (predicted)':34}" + "".join(f"{n:>19}" for n in names)]
    for part in phases[names[0]]:
        label = "state (bf16 copy; fp32 on host)" if part == "state" and cfg.offload_optimizer else part
        lines.append(f"  {label:32}" + "".join(f"{phases[n][part]:19.2f}" for n in names))
    lines.append(f"  {'total':32}" + "".join(f"{sum(phases[n].values()):19.2f}" for n in names))
    verdict = "fits" if p["fits"] else "DOES NOT FIT"
    lines.append(f"peak {p['peak_gib_per_gpu']:.2f} GiB ({p['peak_phase']}) of {p['usable_gib']:.2f} GiB: {verdict}")
    if p["host_gib_per_node"]:
        parts = p["host_gib_by_part_per_gpu"]
        lines.append(f"host memory per node (pinned, predicted): {p['host_gib_per_node']:,.1f} GiB = "
                     f"{cfg.nproc_per_node} x {p['host_gib_per_gpu']:.1f} GiB per GPU (optimizer state "
                     f"{parts['state']:.1f}, offloaded activations {parts['activations']:.1f}, --async_save staging "
                     f"{parts['staging']:.1f}) of {p['host_usable_gib_per_node']:,.0f} GiB usable "
                     f"({100 * ASSUMPTIONS['host_usable_fraction']:.0f}% of {gpu['host_memory_gib_per_node']:,} "
                     f"GiB assumed per node): " + ("fits" if p["host_fits"] else "DOES NOT FIT in host memory"))
    network = (f"{min(cfg.nics_per_node or gpu['nics_per_node'], cfg.nproc_per_node)} NICs x "
               f"{cfg.nic_gbps or gpu['nic_gbps']:g} GB/s per node, capped by NVLink {gpu['nvlink_gbps']}"
               if cfg.nnodes > 1 else "NVLink")
    optimizer = (f"AdamW on the CPU {p['optimizer_s']:.2f} s, PCIe exposed {p['pcie_exposed_s']:.2f} s"
                 if cfg.offload_optimizer else f"AdamW {p['optimizer_s']:.2f} s")
    lines += ["",
              f"step (predicted): compute {p['compute_s']:.2f} s, collectives {p['comm_s']:.2f} s at "
              f"{p['bandwidth_gbps']:.0f} GB/s (bus bandwidth, {network}), offload copies {p['offload_s']:.2f} s, "
              f"exposed {p['exposed_s']:.2f} s, {optimizer} -> {p['step_time_s']:.2f} s per step, bound by "
              f"{p['bound']}",
              f"tokens/s/GPU {p['tokens_per_sec_per_gpu']:,.0f} | MFU {100 * p['mfu']:.1f}% | matmul efficiency "
              f"{p['assumptions']['matmul_efficiency']:.3f} (from published runs, see --plan_json assumptions)"]
    if p["experts"][1]:  # a routed block (model.ModelConfig's n_experts, experts_per_token)
        lines.append(f"routed blocks: each token runs {p['experts'][0]} of {p['experts'][1]} experts, so MFU, step "
                     f"time and recompute count {p['active_params'] / 1e9:.2f}B active parameters of "
                     f"{p['params'] / 1e9:.2f}B; memory holds every expert, each block's activations measured on its "
                     f"fixed-shape path (model.FIXED_SHAPES)")
    if cfg.offload_optimizer:
        lines.append(f"optimizer offload per step per GPU (predicted): PCIe down {p['pcie_d2h_gb']:.1f} GB "
                     f"({p['pcie_d2h_s']:.2f} s) and host accumulation {p['host_accumulate_s']:.2f} s, both during "
                     f"backward (worker thread); PCIe up {p['pcie_h2d_gb']:.1f} GB ({p['pcie_h2d_s']:.2f} s, during "
                     f"the host's bf16 cast); exposed PCIe and host adds {p['pcie_exposed_s']:.2f} s; CPU update "
                     f"{p['optimizer_s']:.2f} s at {p['host_adamw_elements_per_s_per_gpu'] / 1e9:.2f}G elements/s "
                     f"per GPU (extrapolated from a per-core rate measured on a 2-core machine, see ASSUMPTIONS)")
    if cfg.offload_activations:
        lines.append("offload copies: assumed to overlap the compute on a side stream, each block's backward "
                     "prefetching the previous block's input; the last block's copy back is exposed")
    if cfg.sample_prompts:
        share = (f", {100 * p['sampling_s'] / (cfg.eval_every * p['step_time_s']):.1f}% of the {cfg.eval_every} "
                 f"steps between evaluations" if cfg.eval_every else "")
        lines.append(f"--sample_prompts per evaluation (predicted): {p['sampling_prompts']} prompts of ~"
                     f"{p['sampling_prompt_tokens']} tokens, {cfg.sample_tokens} passes over the model, each "
                     f"all-gathering {p['sampling_gathered_gb'] / cfg.sample_tokens:,.1f} GB ("
                     f"{p['sampling_gather_s_per_pass']:.2f} s) against {p['sampling_decode_s_per_pass']:.2f} s of "
                     f"weight reads per new token (prefill {p['sampling_prefill_s']:.2f} s) -> {p['sampling_s']:,.1f} s"
                     f"{share}; KV cache {p['sampling_kv_cache_gib']:.2f} GiB per GPU")
    lines += checkpoint_lines(p, cfg)
    if p["hours"] is not None and cfg.train_tokens:
        lines.append(f"{cfg.train_tokens:,.0f} tokens: {p['hours']:,.0f} h ({p['hours'] / 24:.1f} days) on "
                     f"{p['world']} GPUs = ${p['cost_usd']:,.0f} at ${cfg.gpu_hour_usd:.2f}/GPU-hour")
    best = p["partial_checkpointing"]
    if best and best["ac_blocks"] < n_blocks:
        hours = cfg.train_tokens / (best["tokens_per_sec_per_gpu"] * p["world"]) / 3600
        cost = f", {hours:,.0f} h = ${hours * p['world'] * cfg.gpu_hour_usd:,.0f}" if cfg.train_tokens else ""
        change = p["step_time_s"] / best["step_time_s"] - 1
        lines.append(f"recommended partial checkpointing (predicted): --ac_blocks {best['ac_blocks']} --ac_rest "
                     f"{best['ac_rest']} ({best['ac_blocks']} blocks --ac {best['ac']}, "
                     f"{n_blocks - best['ac_blocks']} --ac_rest {best['ac_rest']}), the fewest --ac blocks "
                     f"that fit: peak {best['peak_gib_per_gpu']:.2f} GiB, {best['step_time_s']:.2f} s per step, "
                     f"tokens/s/GPU {best['tokens_per_sec_per_gpu']:,.0f}, MFU {100 * best['mfu']:.1f}%{cost}; "
                     + ("the setting given" if best["ac_blocks"] == n_ac else
                        f"{abs(100 * change):.1f}% {'faster' if change >= 0 else 'slower'} than as given"))
    elif best:
        lines.append(f"partial checkpointing: every block needs --ac {cfg.ac} to fit (--ac_rest {cfg.ac_rest} "
                     f"on even one block does not fit)")
    elif cfg.ac != cfg.ac_rest:
        lines.append(f"partial checkpointing: nothing fits, even with every block on --ac {cfg.ac}")
    if not p["host_fits"]:
        pinned = " and ".join(name for name, on in (("optimizer state", cfg.offload_optimizer),
                                                     ("activations", cfg.offload_activations),
                                                     ("the save's staging buffer", p["async_save"])) if on)
        drop = p["async_save_drop"] or "more nodes divide it; see ASSUMPTIONS host_memory_gib_per_node"
        lines.append(f"host memory: {p['host_gib_per_node']:,.1f} GiB per node needed, "
                     f"{p['host_usable_gib_per_node']:,.0f} usable: what is pinned ({pinned}) DOES NOT FIT in host "
                     f"memory ({drop})")
    return "\n".join(lines)


def checkpoint_lines(p: dict, cfg) -> list[str]:
    """The table's lines on saves: the stop's lead, the save stall, the suggested interval, the final export."""
    locking = f", the set-up page-locking {p['page_locking_s']:.0f} s of host memory" if p["page_locking_s"] else ""
    restart = f"a late restart's set-up + load ({p['restart_setup_s']:.0f} + {p['load_s']:.0f} s{locking})"
    waits = p["async_write_wait_s"]
    if p["async_save"]:
        periodic = (f"a periodic save's stall ({seconds(p['periodic_save_s'])} s: the copy to host memory, the steps "
                    f"beside its write{', and the wait for the write before it' if waits else ''})")
        write = f"one write {p['save_s']:.0f} s (the one in flight finished, or the stop's own save)"
    else:
        periodic = f"a periodic save in progress ({p['periodic_save_s']:.0f} s)"
        write = f"the stop's save {p['save_s']:.0f} s"
    before = f"the longer of {periodic} and {restart}" if cfg.ckpt_every else restart
    evaluation = f"its evaluation {p['eval_s']:.0f} s, " if cfg.eval_every else ""
    every = f"--ckpt_every {cfg.ckpt_every}" if cfg.ckpt_every else "--ckpt_every 0 (a save at the end only)"
    mode = "asynchronous" if p["async_save"] else "synchronous"
    wait = (f", {p['async_slower_s']:.1f} s of steps slower beside the write (x "
            f"{ASSUMPTIONS['async_write_slowdown']}, async_write_slowdown)"
            + (f" and {waits:.0f} s waiting for the write before it" if waits else ""))
    raised = (f", raised to the {p['write_steps']} steps a write takes: at most one save in flight"
              if p["suggested_ckpt_every"] > round(p["young_daly_ckpt_every"]) else "")
    write_lost = f"the write's {p['later_save_s']:.0f} s (a snapshot counts once written) + " if p["async_save"] else ""
    size = f"{p['checkpoint_gb_per_rank']:.1f} GB per rank, {p['save_s']:.0f} s to save or load"
    once = ""
    if p["later_save_s"] < p["save_s"]:  # --freeze: the frozen units' set is written by the first save alone
        size = (f"the run's first save {p['checkpoint_gb_per_rank']:.1f} GB per rank with the frozen units' set "
                f"(--freeze: written once), {p['save_s']:.0f} s to save or load; each later save "
                f"{p['later_checkpoint_gb_per_rank']:.1f} GB, {p['later_save_s']:.0f} s")
        once = f"; the first save's frozen set {p['save_s'] - p['later_save_s']:.0f} s more, once"
    lines = [f"checkpoint (predicted): {size} at {cfg.fs_write_gbps:g} GB/s per rank (--fs_write_gbps; "
             f"bench/checkpoint_io.py --out_dir measures yours) | a stop request needs {p['stop_lead_s']:.0f} s before "
             f"a time limit ({before}, the step "
             f"{p['step_time_s']:.0f} s, {evaluation}{write}, x {ASSUMPTIONS['stop_margin']}): "
             f"#SBATCH --signal=USR1@{p['signal_lead_s']}",
             f"save stall per save (predicted): synchronous {p['sync_save_stall_s']:.0f} s (every GPU waiting for the "
             f"write), asynchronous {seconds(p['async_save_stall_s'])} s (the copy of "
             f"{p['later_checkpoint_gb_per_rank']:.1f} GB to host memory{wait}; the write goes on in the background"
             f"{once}); this run's saves are {mode} (--async_save {cfg.async_save}) | {every}: {p['saves']:,} saves in "
             f"{p['run_steps']:,} steps = {100 * p['save_fraction']:.2f}% of the run spent saving at "
             f"{cfg.fs_write_gbps:g} GB/s per rank (synchronous {100 * p['sync_save_fraction']:.2f}%, asynchronous "
             f"{100 * p['async_save_fraction']:.2f}%, the last save's write waited for)",
             f"suggested --ckpt_every {p['suggested_ckpt_every']} (Young/Daly: sqrt(2 x {seconds(p['save_stall_s'])} "
             f"s {mode} stall x {cfg.mtbf_hours:g} h MTBF) / {p['step_time_s']:.1f} s per step{raised}; --mtbf_hours: "
             f"the default is Llama 3's interruption rate scaled to 16 GPUs, an assumption for your cluster)",
             f"work lost per failure (predicted): {p['lost_per_failure_s'] / 3600:.2f} h at {every}, "
             f"{p['suggested_lost_per_failure_s'] / 3600:.2f} h at --ckpt_every {p['suggested_ckpt_every']} (half an "
             f"interval + {write_lost}a restart's {p['restart_s']:.0f} s) | expected overhead, saves + lost work: "
             f"{100 * p['overhead_fraction']:.2f}% of the training time now, "
             f"{100 * p['suggested_overhead_fraction']:.2f}% at the suggested interval"]
    if cfg.export_hf:  # after the last step's save: the lead's time left at the least, unless stopped in that step
        enough = "enough" if p["export_s"] <= p["signal_lead_s"] else "NOT enough: a time limit could cut it"
        lines.append(f"final export (predicted): the checkpoint's {p['export_read_gb']:.1f} GB of fp32 weights read and "
                     f"{p['export_gb']:.1f} GB of bf16 weights written, 1/{cfg.nnodes * cfg.nproc_per_node} by each rank "
                     f"(tools/export_hf.py), {p['export_s']:.0f} s at {cfg.fs_write_gbps:g} GB/s; not in the stop's "
                     f"lead: it runs after the last step's save, which, ending before the stop request, leaves "
                     f"{p['signal_lead_s']} s ({enough}). A stop request during the last step saves it without "
                     f"exporting; the same command run again (launch.sbatch requeues it) exports it, in one process "
                     f"(docs/operations.md)")
    return lines


def run_host_bytes(mcfg: M.ModelConfig, cfg, world: int) -> dict:
    """host_bytes_per_gpu with the save's staging buffer ("async") and without ("sync"): what the run's host-memory
    checks read (checks.check_host_memory), which decide --async_save auto from them."""
    return {"async": host_bytes_per_gpu(mcfg, cfg, world, True), "sync": host_bytes_per_gpu(mcfg, cfg, world, False)}


def run_figures(request: dict) -> dict:
    """What a run needs from the planner before step 1 (agree.ask_planner sends `request`: the run's flags and model
    as JSON, its world, ranks per node and CUDA device name): its memory figures as launched (run_memory_gib, None on
    a GPU the planner does not know), the host bytes each rank pins with and without --async_save's staging buffer
    (host_bytes_per_gpu, for checks.check_host_memory), and, when the request has the GPU memory measured outside
    the allocator (`outside_gib`), the flags of the nearest configuration that fits at that figure, or None."""
    cfg, mcfg = T.TrainConfig(**request["flags"]), M.ModelConfig(**request["model"])
    world, local_world, name = request["world"], request["local_world"], request["device_name"]
    figures = dict(memory=run_memory_gib(mcfg, cfg, world, local_world, name),
                   host_bytes=run_host_bytes(mcfg, cfg, world))
    if request.get("outside_gib") is not None:
        run = dataclasses.replace(as_launched(cfg, world, local_world, name), outside_gib=request["outside_gib"])
        nearest = nearest_fit(mcfg, run)
        figures["nearest_fit"] = changed_flags(run, nearest) if nearest else None
    return figures


def main(cfg) -> str | None:
    """`python tools/plan.py` (or `train.py --plan`): check the flags, print the table, write --plan_json. Returns
    None, or the one error line the command ends with (exit code 2): bad flags, or a configuration that does not
    fit (GPU or host memory), naming the nearest that does."""
    errors = flags.check_plan_flags(cfg, list(GPUS))
    if not errors:
        try:
            mcfg = hf.model_config(cfg)
            errors += M.check_model_config(mcfg)
        except OD.CheckpointError as e:  # --init_from one of our checkpoints: its manifest
            errors.append(str(e))
        except (OSError, KeyError, json.JSONDecodeError) as e:
            errors.append(f"--init_from: cannot read config.json: {e}")
        except ValueError as e:  # config.json describes a model this code does not build
            errors.append(f"--init_from: {e}")
    if errors:
        return "; ".join(errors)
    try:
        p = plan(mcfg, cfg)
    except Unplannable as e:
        return f"--plan: {e}"
    print(table(p, cfg), flush=True)
    fits = p["fits"] and p["host_fits"]
    nearest = None if fits else nearest_fit(mcfg, cfg)
    p["nearest_fit"] = changed_flags(cfg, nearest) if nearest else None
    if cfg.plan_json:
        with open(cfg.plan_json, "w") as f:
            json.dump(p, f, indent=1)
        print(f"wrote {cfg.plan_json}", flush=True)
    if not fits:  # exit 2: no hours or dollars for it, and what would fit instead
        return not_fitting_message(mcfg, cfg, p, nearest)
    return None


def command(argv: list[str]):
    """`python tools/plan.py FLAGS` (and `train.py --plan FLAGS`): main, its error line and exit code as train.py
    says them (fail)."""
    try:
        flags = T.parse_args(argv)
    except ValueError as e:  # a bad flag: one line
        T.fail(str(e))
    error = main(flags)
    if error:
        T.fail(error)


if __name__ == "__main__":
    if sys.argv[1:] == ["--run_figures"]:  # a run's request (agree.ask_planner): JSON in, JSON out
        json.dump(run_figures(json.load(sys.stdin)), sys.stdout)
    else:
        command(sys.argv[1:])
