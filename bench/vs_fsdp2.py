"""This trainer's sharded step against transformers + PyTorch FSDP2 on the same model, data and machine.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/vs_fsdp2.py [--steps 3] [--rounds 5]
        [--profile] [--timers]

One torchrun run, both trainers built in the same two processes on the one gloo process group:
  ours    train.py's setup / make_stages / train_step, loaded with --init_from from a folder that a
          seeded transformers LlamaForCausalLM wrote with save_pretrained;
  theirs  LlamaForCausalLM.from_pretrained(that folder, attn_implementation="sdpa"), fully_shard on
          each decoder layer and then the root, MixedPrecisionPolicy(bf16 params, fp32 reduce),
          torch.optim.AdamW with the same lr schedule, betas, eps, decay on matrices only, grad clip 1.
~20M parameters (untied), fp32 master weights, bf16 compute, W = 2, micro-batch 4 x 256, one micro-batch
per step (batch 8), no activation checkpointing, the same seeded random-token windows in the same order.
Both start from the same weights, so their step-1 losses must agree (bf16 noise: 2e-2).

Timing: 2 warm-up steps each, then R rounds of (N steps ours, N steps theirs), alternating so that
both see the same machine load; median step time of each. ratio = tokens/s ours / tokens/s theirs.
--profile: afterwards, one torch.profiler step of each on rank 0, the top ops by self CPU time.
--timers: afterwards, 10 steps of ours with wall-clock timers around train.py's parts (forward +
backward, and inside it the waits for reduce-scatters; gradient norm; AdamW), mean per step on rank 0.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from components import hf  # noqa: E402
import data as D  # noqa: E402
import model as M  # noqa: E402
import train as T  # noqa: E402

# 8 x 1.73M per block + 2 x 3.15M embedding and head = 20.1M parameters.
MODEL = dict(vocab_size=8192, dim=384, n_layers=8, n_heads=6, n_kv_heads=2, ffn_dim=1152, max_seq_len=2048)
SEQ_LEN, MICRO, BATCH = 256, 4, 8
LOSS_TOLERANCE = 2e-2  # bf16 compute: the two step-1 losses differ by rounding only


def write_inputs(folder: str) -> tuple[str, str]:
    """The seeded HF model folder and a seeded random-token .npy (no EOS: one document per window)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.disable_progress_bar()  # one bar per rank per save/load
    mcfg = M.ModelConfig(**MODEL, bos_id=1, eos_id=2)
    init = os.path.join(folder, "init")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**hf.config_to_hf(mcfg, torch.float32))).save_pretrained(init)
    tokens = os.path.join(folder, "tokens.npy")
    np.save(tokens, np.random.default_rng(0).integers(3, MODEL["vocab_size"], 400 * SEQ_LEN).astype(np.uint16))
    return init, tokens


def build_ours(folder: str, init: str, tokens: str, total_steps: int):
    cfg = T.parse_args([
        f"--init_from={init}", f"--data={tokens}", "--doc_mask=false", f"--seq_len={SEQ_LEN}",
        f"--batch_size={BATCH}", f"--micro_batch_size={MICRO}", "--dtype=bfloat16", "--reduce_dtype=float32",
        "--ac=none", f"--steps={total_steps}", "--lr=3e-4", "--warmup_steps=2", "--eval_every=0",
        f"--out_dir={tempfile.gettempdir()}/vs_fsdp2_{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}",  # one for all ranks
        "--resume=never", "--overwrite=true"])
    sharded, windows = T.setup(cfg)[:2]

    def step_fn(step: int):  # 0-based here, 1-based in train.py
        record = T.train_step(cfg, sharded, windows, step + 1, step * cfg.batch_size)
        return record["loss"], record["grad_norm"]
    return cfg, sharded.model.cfg, step_fn


def build_theirs(cfg, init: str, tokens: str):
    """transformers + FSDP2 on the default (gloo) process group, the same hyperparameters as ours."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(init, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # Decay on matrices only, as ours (train.py adamw_step): norm weights are 1-D.
    groups = [dict(params=[p for p in model.parameters() if p.ndim >= 2], weight_decay=cfg.weight_decay),
              dict(params=[p for p in model.parameters() if p.ndim < 2], weight_decay=0.0)]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    windows = D.TokenWindows(D.TokenData(tokens), SEQ_LEN, cfg.seed)
    rank, world = dist.get_rank(), dist.get_world_size()

    def step_fn(step: int):
        inputs, targets, _ = windows.micro_batch(step * cfg.batch_size, 0, rank, world, MICRO)
        for g in opt.param_groups:
            g["lr"] = T.lr_at(cfg, step + 1)
        logits = model(input_ids=torch.from_numpy(inputs), use_cache=False).logits
        # This rank's mean; FSDP2's reduce-scatter averages over ranks: the global mean, as ours.
        loss = F.cross_entropy(logits.float().flatten(0, 1), torch.from_numpy(targets).flatten())
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the same scalars ours returns
        return loss.item(), grad_norm.full_tensor().item()
    return step_fn


def timed(step_fn, step: int) -> float:
    t0 = time.perf_counter()
    step_fn(step)
    return time.perf_counter() - t0


def profile_one_step(name: str, step_fn, step: int, rank: int):
    """Both ranks record (so the profiler's overhead slows both alike); rank 0 prints."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step_fn(step)
    if rank == 0:
        print(f"\n### profile: {name}, one step, rank 0, top ops by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48))


def time_parts_of_ours(step_fn, first_step: int, rank: int, steps: int = 10):
    """Wraps train.py's functions, which train_step and the reduce-scatter hook look up at call time."""
    spent_s = {}
    for name in ("forward_backward", "finish_reduces", "global_grad_norm", "optimizer_step"):
        def timed_part(*args, _fn=getattr(T, name), _name=name, **kwargs):
            t0 = time.perf_counter()
            out = _fn(*args, **kwargs)
            spent_s[_name] = spent_s.get(_name, 0.0) + time.perf_counter() - t0
            return out
        setattr(T, name, timed_part)
    total_s = sum(timed(step_fn, first_step + i) for i in range(steps))
    if rank == 0:
        print(f"\n### ours, mean of {steps} steps, rank 0: step {1e3 * total_s / steps:.1f} ms; "
              + ", ".join(f"{name} {1e3 * t / steps:.1f} ms" for name, t in spent_s.items())
              + " (finish_reduces: waiting for reduce-scatters, inside forward_backward)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3, help="timed steps per framework per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--timers", action="store_true")
    args = parser.parse_args()
    warmup = 2
    # Each rank writes the same seeded inputs into its own folder: nothing to coordinate before the group.
    folder = tempfile.mkdtemp(prefix=f"vs_fsdp2_rank{os.environ.get('RANK', '0')}_")
    init, tokens = write_inputs(folder)
    total_steps = warmup + args.rounds * args.steps + (1 if args.profile else 0) + (10 if args.timers else 0)
    cfg, mcfg, ours = build_ours(folder, init, tokens, total_steps)
    theirs = build_theirs(cfg, init, tokens)
    rank, world = dist.get_rank(), dist.get_world_size()

    first = {name: fn(0) for name, fn in (("ours", ours), ("theirs", theirs))}  # (loss, grad_norm) of step 1
    for fn in (ours, theirs):
        fn(1)
    times_s = {"ours": [], "theirs": []}
    step = warmup
    for _ in range(args.rounds):
        for name, fn in (("ours", ours), ("theirs", theirs)):
            times_s[name] += [timed(fn, step + i) for i in range(args.steps)]
        step += args.steps
    if args.profile:
        profile_one_step("ours", ours, step, rank)
        profile_one_step("theirs", theirs, step, rank)
        step += 1
    if args.timers:
        time_parts_of_ours(ours, step, rank)

    if rank == 0:
        report(first, times_s, mcfg, world, args)
    loss_gap = abs(first["ours"][0] - first["theirs"][0])
    dist.destroy_process_group()
    return 1 if loss_gap > LOSS_TOLERANCE else 0


def report(first: dict, times_s: dict, mcfg, world: int, args):
    n_params = M.count_params(mcfg)["total"]
    tokens_per_step = BATCH * SEQ_LEN
    print(f"\nW={world} gloo, {n_params / 1e6:.2f}M params ({n_params:,}, untied), bf16 compute, fp32 reduce, "
          f"micro-batch {MICRO} x {SEQ_LEN}, batch {BATCH}, --ac none; {args.rounds} rounds x {args.steps} "
          f"steps each, alternating, after 2 warm-up steps each; torch {torch.__version__}")
    gap = abs(first["ours"][0] - first["theirs"][0])
    print(f"step-1 loss: ours {first['ours'][0]:.5f}, theirs {first['theirs'][0]:.5f}, |diff| {gap:.2e} "
          f"({'OK' if gap <= LOSS_TOLERANCE else 'FAIL'}, tolerance {LOSS_TOLERANCE}); step-1 grad norm: "
          f"ours {first['ours'][1]:.4f}, theirs {first['theirs'][1]:.4f}")
    median_s = {name: statistics.median(t) for name, t in times_s.items()}
    print("\n| trainer | median step s | min | max | tokens/s per rank |\n|---|---:|---:|---:|---:|")
    for name, label in (("ours", "ours (train.py)"), ("theirs", "transformers + FSDP2")):
        t = times_s[name]
        print(f"| {label} | {median_s[name]:.3f} | {min(t):.3f} | {max(t):.3f} | "
              f"{tokens_per_step / median_s[name] / world:,.0f} |")
    print(f"\nratio ours/theirs (tokens/s): {median_s['theirs'] / median_s['ours']:.3f} (goal >= 1.2)")


if __name__ == "__main__":
    exit_code = main()
    # As train.py: skip interpreter teardown, where gloo's threads occasionally abort a finished process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
