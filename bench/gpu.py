"""The GPU benchmark: correctness on the device first, then tokens/s/GPU, MFU and peak memory of this
trainer against transformers + PyTorch FSDP2 on the same model. `bench/gpu.sh` runs it (all local GPUs);
`bash bench/gpu.sh --dry-run` runs the same code on CPU (2 gloo processes, tiny shapes) in under a minute.

    bash bench/gpu.sh [--layers L] [--steps N] [--no-compile] [--no-baseline] [--json FILE]

1. correctness  a small Llama (GQA, packed documents, so the varlen/mask path runs), 4 steps of
                train.py's train_step at W = all GPUs against transformers' LlamaForCausalLM +
                torch.optim.AdamW in one process, the same weights and windows: fp32 losses and
                gradient norms within 1e-4 (relative), bf16 compute's losses within 2e-2 of the fp32
                oracle. A failure stops the run: a fast wrong answer is not a result.
2. ours         Llama-3-8B-shaped blocks (dim 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256),
                as many layers as the planner says fit next to the baseline's extra logits, seq 8192,
                micro-batch 1 x 2 accumulation steps per GPU, BF16, --ac selective, fp32 reduce; with
                W >= 2 also with --prefetch false (what overlapping the all-gathers buys), and with
                --offload_optimizer true (the optimizer in host memory: PCIe copies and the CPU update).
3. ours compiled  the same with torch.compile on each block, its checkpoint inside the compiled region
                (train.run_block compiled whole), so the selective policy decides what the compiled
                backward recomputes (kept in train.py only if it measures faster; until then it lives here).
4. baseline     LlamaForCausalLM with the same shapes (attention: flash_attention_2 when flash_attn
                imports, else sdpa), the same selective policy through checkpoint_wrapper, fully_shard
                per layer then the root, MixedPrecisionPolicy(bf16, fp32), fused AdamW.
Each: 2 warm-up steps, then --steps timed steps (synchronized); the median. MFU = tokens/s/GPU x
model.flops_per_token / the device's dense BF16 peak (metrics.PEAK_BF16_FLOPS). Peak memory is
torch.cuda.max_memory_allocated over the timed steps, shown beside the peak of the same flags, model and W
measured under fake CUDA on a CPU (bench/fake_memory.py --gpu_bench, kept in bench/gpu_fake_memory.json): where
they differ, the GPU has something the fake step does not model. The timed steps run under CUDA's sync debug mode
("warn"): the table counts the times per step the host waited for the GPU, the JSON says where. The
attention kernel is metrics.attention_kernel's words and, where that is SDPA, the backend SDPA's own
dispatch (torch._fused_sdp_choice) picks for attention()'s arguments at these shapes. Results print as
they come (a run stopped by gpu.sh's 8-minute limit keeps what it printed) and, at the end, as a
Markdown table for BENCHMARKS.md. A run that fails (an OOM, a compiler error) is agreed on by every rank
before the next starts (agree_on_failure); one whose failure left other ranks inside its collectives ends
the benchmark with one line, instead of every later run hanging.
"""
import argparse
import contextlib
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from components import hf  # noqa: E402
from components import checks  # noqa: E402
import data as D  # noqa: E402
from components import metrics  # noqa: E402
import model as M  # noqa: E402
from tools import plan as P  # noqa: E402
from tools import plan_memory as PM  # noqa: E402
import train as T  # noqa: E402

GIB = 2**30
# Llama 3 8B's block and vocabulary; the layer count is chosen to fit. --dry-run shrinks every width.
SHAPE_8B = dict(vocab_size=128256, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, max_seq_len=8192)
SHAPE_DRY = dict(vocab_size=1024, dim=128, n_heads=4, n_kv_heads=2, ffn_dim=448, max_seq_len=256)
CHECK_MODEL = dict(vocab_size=1024, dim=256, n_layers=3, n_heads=8, n_kv_heads=2, ffn_dim=512, max_seq_len=512,
                   bos_id=1, eos_id=2)
CHECK_SEQ, CHECK_STEPS, CHECK_LR = 128, 4, 2e-3  # each step moves the loss; a wrong update shows (beta2 0.99: 9.5x the tolerance)
FP32_TOL, BF16_TOL = 1e-4, 2e-2


def log(rank: int, *args):
    if rank == 0:
        print(*args, flush=True)


def shared_out_dir(name: str) -> str:
    """An --out_dir that is one folder for all ranks (train.py checks): the inputs are per rank, this is not."""
    return os.path.join(tempfile.gettempdir(), f"gpu_bench_{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}", name)


def train_flags(folder: str, tokens: str, seq_len: int, batch: int, micro: int, steps: int, dtype: str,
                ac: str, device: str, extra=(), lr: float = 1e-3) -> list:
    return [f"--data={tokens}", f"--seq_len={seq_len}", f"--batch_size={batch}", f"--micro_batch_size={micro}",
            f"--steps={steps}", f"--dtype={dtype}", f"--ac={ac}", f"--device={device}", "--eval_every=0",
            f"--lr={lr}", "--warmup_steps=1", "--weight_decay=0.1", "--grad_clip=1.0",
            f"--out_dir={folder}", "--resume=never", "--overwrite=true", *extra]


ACCUM, WARMUP = 2, 2  # micro-batches per GPU per step; untimed steps before the timed ones
# The timed runs of ours: name -> the flags each adds to ours_flags.
OURS_RUNS = {"ours": [], "ours, --prefetch false": ["--prefetch=false"],
             "ours, --offload_optimizer true": ["--offload_optimizer=true"]}


def ours_runs(world: int) -> list[str]:
    """The runs of ours main times at `world` GPUs: with one GPU the all-gathers are local copies, nothing for
    --prefetch to overlap. --offload_optimizer: the optimizer in host memory and on the CPU (issue 14), what
    the copies and the CPU update cost per step."""
    return [name for name in OURS_RUNS if world > 1 or "prefetch" not in name]


def ours_flags(folder: str, tokens: str, seq_len: int, world: int, accum: int, steps: int, device: str,
               extra=()) -> list:
    """What main times: micro-batch 1 x `accum` per GPU, bf16, --ac selective, one document per row.
    bench/fake_memory.py --gpu_bench measures the same flags under fake CUDA."""
    return train_flags(folder, tokens, seq_len, accum * world, 1, steps, "bfloat16", "selective", device,
                       ["--model=bench", "--doc_mask=false", *extra])


FAKE_MEMORY_JSON = os.path.join(ROOT, "bench", "gpu_fake_memory.json")


def fake_memory_key(row: dict) -> tuple:
    """What identifies a FAKE_MEMORY_JSON row: the run of ours, the model's depth, seq_len, W, flash-attn or not."""
    return row["run"], row["layers"], row["seq_len"], row["world"], row["flash"]


def fake_cuda_peak_gib(name: str, layers: int, seq_len: int, world: int, flash: bool) -> float | None:
    """This run's peak as bench/fake_memory.py --gpu_bench measured it under fake CUDA on a CPU (the same
    flags, model and W; flash-attn or SDPA as here), from FAKE_MEMORY_JSON; None if not measured."""
    if not os.path.exists(FAKE_MEMORY_JSON):
        return None
    with open(FAKE_MEMORY_JSON) as f:
        rows = json.load(f)
    key = fake_memory_key(dict(run=name, layers=layers, seq_len=seq_len, world=world, flash=flash))
    return next((r["measured_gib"] for r in rows if fake_memory_key(r) == key), None)


EAGER_RUN_BLOCK = T.run_block


def compiled_run_block(backend: str = "inductor"):
    """train.run_block compiled whole: the block's checkpoint and its selective policy inside the compiled
    region, so torch.compile's partitioner saves what the policy names (the matmuls, attention) and the
    backward graph recomputes only the rest. Compiling the block alone (block.compile()) left the checkpoint
    outside it: backward ran the compiled forward again, all of it, as --ac full would (tests/test_bench.py
    counts the forward graph's runs)."""
    return torch.compile(EAGER_RUN_BLOCK, backend=backend)


def build_ours(flags: list, compile_blocks: bool = False):
    """train.py's own set-up and step; returns (mcfg, units, step_fn(step) -> (loss, grad_norm))."""
    cfg = T.parse_args(flags)
    sharded, windows = T.setup(cfg)[:2]
    T.run_block = compiled_run_block() if compile_blocks else EAGER_RUN_BLOCK  # what the block stages call

    def step_fn(step: int):  # 0-based here, 1-based in train.py
        record = T.train_step(cfg, sharded, windows, step + 1, step * cfg.batch_size)
        return record["loss"], record["grad_norm"]
    return sharded.model.cfg, sharded.units, step_fn


def release(units):
    """Drops a finished run's state so the next one has the memory (the module attributes are views of
    the freed buffers and hold nothing; main empties the CUDA cache after each run)."""
    for u in units:
        u.master_shard = u.grad_shard = u.gathered = u.host = None
        u.optimizer_state = {}
    units.clear()


# ------------------------------------------------------------------------------------------------
# 1. Correctness on the device
# ------------------------------------------------------------------------------------------------

def write_check_inputs(folder: str) -> tuple[str, str]:
    """A seeded HF model folder (random norm weights, so a wrong norm shows) and learnable tokens with an
    EOS every 20-60 tokens, so rows pack several documents."""
    from transformers import LlamaConfig, LlamaForCausalLM
    mcfg = M.ModelConfig(**CHECK_MODEL)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(**hf.config_to_hf(mcfg, torch.float32)))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    init = os.path.join(folder, "init")
    ref.save_pretrained(init)
    rng = np.random.default_rng(0)
    tokens = np.cumsum(rng.integers(1, 4, size=40 * (CHECK_SEQ + 1))) % (mcfg.vocab_size - 3) + 3
    ends = np.cumsum(rng.integers(20, 60, size=len(tokens) // 20))
    tokens[ends[ends < len(tokens)]] = mcfg.eos_id
    path = os.path.join(folder, "check_tokens.npy")
    np.save(path, tokens.astype(np.uint16))
    return init, path


def oracle_steps(init: str, tokens: str, batch: int, device) -> list:
    """[(loss, grad_norm)] of transformers + torch.optim.AdamW, one process, the whole global batch; each
    packed document through the model alone (what --doc_mask promises)."""
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32, attn_implementation="sdpa").to(device)
    decay = [p for p in ref.parameters() if p.ndim >= 2]
    no_decay = [p for p in ref.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.1), dict(params=no_decay, weight_decay=0.0)],
                            lr=CHECK_LR, betas=(0.9, 0.95), eps=1e-8)
    cfg = T.parse_args(train_flags("", tokens, CHECK_SEQ, batch, 1, CHECK_STEPS, "float32", "none", "cpu", lr=CHECK_LR))
    windows = D.TokenWindows(D.TokenData(tokens), CHECK_SEQ, cfg.seed)
    steps = []
    for step in range(CHECK_STEPS):
        inputs, targets = (torch.from_numpy(a.astype(np.int64)).to(device)
                           for a in windows.micro_batch(step * batch, 0, 0, 1, batch)[:2])
        loss = 0.0
        for row in range(batch):
            cuts = [0] + [t + 1 for t in range(CHECK_SEQ - 1) if inputs[row, t] == CHECK_MODEL["eos_id"]] + [CHECK_SEQ]
            for a, b in zip(cuts, cuts[1:]):
                logits = ref(inputs[row:row + 1, a:b]).logits[0]
                loss = loss + F.cross_entropy(logits.float(), targets[row, a:b], reduction="sum")
        loss = loss / targets.numel()
        opt.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        for group in opt.param_groups:
            group["lr"] = T.lr_at(cfg, step + 1)
        opt.step()
        steps.append((loss.item(), grad_norm.item()))
    return steps


def correctness(folder: str, device: str) -> dict:
    """Before the process group exists (build_ours makes it): every rank runs the small oracle itself."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    init, tokens = write_check_inputs(folder)
    batch = 2 * world
    oracle_device = torch.device("cpu") if device == "cpu" else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    reference = oracle_steps(init, tokens, batch, oracle_device)
    result = dict(oracle=reference)
    for dtype, tol in (("float32", FP32_TOL), ("bfloat16", BF16_TOL)):
        flags = train_flags(shared_out_dir(dtype), tokens, CHECK_SEQ, batch, 1, CHECK_STEPS, dtype,
                            "selective", device, [f"--init_from={init}", "--ce_chunk=50"], lr=CHECK_LR)
        _, units, step_fn = build_ours(flags)
        ours = [step_fn(step) for step in range(CHECK_STEPS)]
        release(units)
        worst = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(ours, reference))
        worst_norm = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(ours, reference))
        # The bar is the losses; in fp32 the gradient norms must agree as closely (the update
        # before step 2 depends on them), in bf16 they are reported.
        ok = worst <= tol and (dtype == "bfloat16" or worst_norm <= tol)
        result[dtype] = dict(steps=ours, worst_rel=worst, worst_grad_norm_rel=worst_norm, tolerance=tol, ok=ok)
        log(rank, f"correctness {dtype}: losses ours {[round(x[0], 6) for x in ours]} vs transformers "
                  f"{[round(x[0], 6) for x in reference]}: worst relative difference {worst:.1e}, grad norms "
                  f"{worst_norm:.1e} ({'OK' if ok else 'FAIL'}, tolerance {tol:g})")
    result["ok"] = result["float32"]["ok"] and result["bfloat16"]["ok"]
    return result


# ------------------------------------------------------------------------------------------------
# 2-4. Timed runs
# ------------------------------------------------------------------------------------------------

def bench_model(layers: int, dry: bool) -> M.ModelConfig:
    return M.ModelConfig(**(SHAPE_DRY if dry else SHAPE_8B), n_layers=layers, bos_id=1, eos_id=2)


def baseline_extra_bytes(mcfg: M.ModelConfig, tokens: int) -> int:
    """What the baseline holds that ours does not: whole logits (bf16, their fp32 copy, its gradient,
    the bf16 gradient) instead of 1024-token chunks."""
    return tokens * mcfg.vocab_size * (2 + 4 + 4 + 2)


def planned_peak_bytes(layers: int, seq_len: int, world: int, gpu: str) -> float:
    """plan.py's peak memory per GPU for our run of `layers` 8B-shaped layers (the flags main times)."""
    cfg = T.parse_args(["--seq_len", str(seq_len), "--micro_batch_size", "1", "--batch_size", str(2 * world),
                        "--ac", "selective", "--nproc_per_node", str(world), "--gpu", gpu])
    phases = PM.memory_by_phase(bench_model(layers, dry=False), cfg, world)
    return max(sum(parts.values()) for parts in phases.values())


def layers_that_fit(seq_len: int, world: int, memory_bytes: int, gpu: str) -> int:
    """The most 8B-shaped layers (up to 32, the real 8B) whose planned peak, plus the baseline's whole
    logits, stays under 90% of the GPU's memory."""
    def fits(layers):
        extra = baseline_extra_bytes(bench_model(layers, dry=False), seq_len)
        return planned_peak_bytes(layers, seq_len, world, gpu) + extra <= 0.9 * memory_bytes
    return max([layers for layers in range(1, 33) if fits(layers)], default=1)


def planner_gpu(device_name: str) -> str:
    """plan.GPUS's key for this device (its bandwidths and peak), by the name CUDA reports."""
    return next((key for key, g in P.GPUS.items() if g["device_name"] == device_name),
                "h200" if "H200" in device_name else "h100")


def write_random_tokens(folder: str, vocab: int, seq_len: int, windows: int) -> str:
    """Random ids, no EOS: every row is one document, as in the published throughput runs."""
    path = os.path.join(folder, "bench_tokens.npy")
    np.save(path, np.random.default_rng(0).integers(3, vocab, windows * (seq_len + 1)).astype(np.uint32))
    return path


@contextlib.contextmanager
def host_syncs(cuda: bool):
    """Yields a list that, after the block, holds "file:line" for each time the host waited for the GPU
    inside it (CUDA's sync debug mode warns at each; other warnings are shown as usual). On CPU: empty."""
    places = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield places
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchronizing" in str(w.message):
            places.append(f"{os.path.basename(w.filename)}:{w.lineno}")
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def timed_steps(step_fn, warmup: int, steps: int, device) -> dict:
    cuda = device.type == "cuda"
    for step in range(warmup):
        step_fn(step)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times_s, losses, syncs = [], [], []
    for step in range(warmup, warmup + steps):
        t0 = time.perf_counter()
        with host_syncs(cuda) as places:
            loss, _ = step_fn(step)
        if cuda:
            torch.cuda.synchronize(device)
        times_s.append(time.perf_counter() - t0)
        losses.append(loss)
        syncs.append(places)
    peak = torch.cuda.max_memory_allocated(device) if cuda else metrics.peak_mem_bytes(device)
    return dict(step_s=statistics.median(times_s), times_s=times_s, losses=losses, peak_gib=peak / GIB,
                host_syncs_per_step=[len(p) for p in syncs] if cuda else None,
                host_sync_places=dict(Counter(p for places in syncs for p in places)))


def summarize(name: str, run: dict, mcfg, seq_len: int, tokens_per_step_per_gpu: int, device, rank: int) -> dict:
    run["tokens_per_sec_per_gpu"] = tokens_per_step_per_gpu / run["step_s"]
    peak = metrics.peak_flops(device)
    flops = M.flops_per_token(mcfg, seq_len)
    run["mfu"] = None if peak is None else run["tokens_per_sec_per_gpu"] * flops / peak
    mfu = "n/a" if run["mfu"] is None else f"{100 * run['mfu']:.1f}%"
    fake = run.get("fake_cuda_peak_gib")
    log(rank, f"{name}: median step {run['step_s']:.3f} s, {run['tokens_per_sec_per_gpu']:,.0f} tok/s/GPU, "
              f"MFU {mfu}, peak {run['peak_gib']:.1f} GiB" + (f" (under fake CUDA: {fake:.1f} GiB)" if fake else "")
              + f", losses {[round(x, 3) for x in run['losses']]}")
    if not all(math.isfinite(x) for x in run["losses"]):
        raise RuntimeError(f"{name}: non-finite loss {run['losses']}")
    return run


def baseline_attention(device) -> str:
    return "flash_attention_2" if M.flash_attn_func is not None and device.type == "cuda" else "sdpa"


def build_baseline(mcfg: M.ModelConfig, seq_len: int, accum: int, device, lr_cfg):
    """transformers LlamaForCausalLM + FSDP2 + fused AdamW, the same shapes, policy and hyperparameters."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    from transformers import LlamaConfig, LlamaForCausalLM
    hf_cfg = LlamaConfig(**hf.config_to_hf(mcfg, torch.float32))
    hf_cfg._attn_implementation = baseline_attention(device)
    torch.manual_seed(0)
    with torch.device(device):  # random init on the device: fast, and the same bytes as ours (fp32)
        model = LlamaForCausalLM(hf_cfg)
    model.train()
    def keep_saved_ops(ctx, op, *args, **kwargs):  # train.run_block's selective policy
        return CheckpointPolicy.MUST_SAVE if op in T.SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE
    policy = partial(create_selective_checkpoint_contexts, keep_saved_ops)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=policy)
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    groups = [dict(params=[p for p in model.parameters() if p.ndim >= 2], weight_decay=0.1),
              dict(params=[p for p in model.parameters() if p.ndim < 2], weight_decay=0.0)]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    rng = np.random.default_rng(1 + dist.get_rank())  # random windows, like ours (no EOS)

    def step_fn(step: int):
        for g in opt.param_groups:
            g["lr"] = T.lr_at(lr_cfg, step + 1)
        total = torch.zeros((), device=device)
        for _ in range(accum):
            ids = torch.from_numpy(rng.integers(3, mcfg.vocab_size, (1, seq_len + 1))).to(device)
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten()) / accum
            loss.backward()
            total += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        return total.item(), grad_norm.full_tensor().item()
    return model, opt, step_fn


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------

def environment(device) -> dict:
    import transformers
    env = dict(torch=torch.__version__, transformers=transformers.__version__, device=str(device),
               world=dist.get_world_size(), flash_attn=M.flash_attn_func is not None,
               # On a GPU: does the selective policy save flash_attn's attention (2.7+), did it fail to import,
               # and what sits outside PyTorch's allocator after the correctness run (CUDA context, NCCL with
               # NCCL_NVLS_ENABLE as gpu.sh sets it) against the planner's --outside_gib.
               flash_attn_unsaved=checks.flash_attn_unsaved_warning(T.SAVED_OPS),
               flash_attn_import_problem=checks.flash_attn_import_problem(M.FLASH_ATTN_IMPORT_ERROR))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        env.update(gpu=torch.cuda.get_device_name(device), memory_gib=total / GIB,
                   outside_allocator_gib=(total - free - torch.cuda.memory_reserved(device)) / GIB,
                   nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"), alloc_conf=os.environ.get("PYTORCH_ALLOC_CONF"),
                   cuda=torch.version.cuda, peak_bf16_tflops=(metrics.peak_flops(device) or 0) / 1e12)
    return env


def attention_report(device, mcfg: M.ModelConfig, seq_len: int) -> dict:
    """The attention ours runs in bf16, for whole rows (the timed runs: --doc_mask false, no EOS) and for
    packed documents (the correctness check): metrics.attention_kernel's words and, where that is SDPA, the
    backend SDPA's dispatch picks for attention()'s arguments at the timed runs' shapes (two documents)."""
    report = {}
    for case, doc_mask in (("whole rows", False), ("packed documents", True)):
        kernel = metrics.attention_kernel(device, torch.bfloat16, doc_mask)
        if kernel.startswith("SDPA"):
            H, KV, D = mcfg.n_heads, mcfg.n_kv_heads, mcfg.head_dim
            q = torch.zeros(1, H, seq_len, D, dtype=torch.bfloat16, device=device, requires_grad=True)
            k = v = torch.zeros(1, KV, seq_len, D, dtype=torch.bfloat16, device=device)
            doc = (torch.arange(seq_len, device=device) >= seq_len // 2).long()[None]
            mask = M.document_mask(doc, torch.bfloat16) if doc_mask else None
            choice = torch._fused_sdp_choice(**M.sdpa_arguments(q, k, v, mask))
            kernel += f"; SDPA picks {torch.nn.attention.SDPBackend(choice).name}"
        report[case] = kernel
    return report


def agree_on_failure(run: int, error: str, timeout_s: float) -> list[int]:
    """The ranks on which run number `run` failed, known to every rank before any starts the next. Through
    the rendezvous store (TCP, no collective) under timeout_s: a rank whose failure (an OOM on one rank)
    left the others waiting inside a collective of that run does not find their answers, and raises
    DistStoreError instead of starting a run they would never join. (A gloo barrier cannot do this: its
    send waits for the absent rank without a timeout.)"""
    store, world = dist.distributed_c10d._get_default_store(), dist.get_world_size()
    keys = [f"gpu_bench/run{run}/rank{r}" for r in range(world)]
    store.set(keys[dist.get_rank()], error or "ok")
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    return [r for r, key in enumerate(keys) if store.get(key) != b"ok"]


def injected_failures(specs: list[str], rank: int) -> set[str]:
    """--inject_failure RUN@RANKS (tests): the runs that raise on this rank before they start."""
    return {spec.rsplit("@", 1)[0] for spec in specs if str(rank) in spec.rsplit("@", 1)[1].split(",")}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny shapes: checks the script end to end")
    parser.add_argument("--layers", type=int, default=0, help="8B-shaped layers (0: as many as fit)")
    parser.add_argument("--seq_len", type=int, default=0, help="0: 8192 (64 with --dry-run)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (after 2 warm-up steps)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile run")
    parser.add_argument("--no-baseline", action="store_true", help="skip transformers + FSDP2")
    parser.add_argument("--json", default="", help="also write every result here")
    parser.add_argument("--budget_s", type=float, default=450, help="start no timed run after budget_s - 100 s "
                        "(gpu.sh kills everything at 480 s)")
    parser.add_argument("--agree_timeout_s", type=float, default=60, help="how long ranks wait for each other "
                        "after a run before a failure that left some inside a collective ends the benchmark")
    parser.add_argument("--inject_failure", action="append", default=[], metavar="RUN@RANKS",
                        help="tests only: RUN raises on these ranks (comma-separated) before it starts")
    args = parser.parse_args()
    dry = args.dry_run
    seq_len = args.seq_len or (64 if dry else 8192)
    device_flag = "cpu" if dry else "cuda"
    folder = tempfile.mkdtemp(prefix=f"gpu_bench_rank{os.environ.get('RANK', '0')}_")
    started = time.perf_counter()

    # 1. Correctness (its first train.setup makes the process group; every later one reuses it).
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    check = correctness(folder, device_flag)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if dry else torch.device("cuda", torch.cuda.current_device())
    results = dict(date=time.strftime("%Y-%m-%d"), environment=environment(device), correctness=check)
    log(rank, "environment: " + json.dumps(results["environment"]))
    if not check["ok"]:
        log(rank, "correctness FAILED: nothing is timed")
        return 1

    # 2-4. Timed runs on the 8B-shaped model.
    gpu = planner_gpu(torch.cuda.get_device_name(device) if device.type == "cuda" else "")
    if args.layers or dry:
        layers = args.layers or 2
    else:
        layers = layers_that_fit(seq_len, world, torch.cuda.mem_get_info(device)[1], gpu)
    mcfg = bench_model(layers, dry)
    accum, warmup = ACCUM, WARMUP
    results.update(attention=attention_report(device, mcfg, seq_len), baseline_attention=baseline_attention(device))
    log(rank, f"attention: ours {json.dumps(results['attention'])}, transformers {results['baseline_attention']}")
    tokens = write_random_tokens(folder, mcfg.vocab_size, seq_len, (warmup + args.steps) * accum * world + 4)
    M.PRESETS["bench"] = lambda: bench_model(layers, dry)
    n_params = M.count_params(mcfg)["total"]
    log(rank, f"model: {layers} Llama-3-8B-shaped layers{' (dry run: tiny widths)' if dry else ''}, "
              f"{n_params / 1e9:.2f}B parameters; seq {seq_len}, micro-batch 1 x {accum} accumulation steps per "
              f"GPU, W={world}")
    results.update(layers=layers, params=n_params, seq_len=seq_len, accum=accum, world=world, runs={})
    tokens_per_step_per_gpu = accum * seq_len
    flags = ours_flags(shared_out_dir("ours"), tokens, seq_len, world, accum, warmup + args.steps, device_flag)
    # What plan.py predicts for this run (on CPU, as if on an H100: the dry run only checks the call).
    planned = P.plan(mcfg, T.parse_args(flags + [f"--nproc_per_node={world}", f"--gpu={gpu}"]))
    results["planned"] = dict(gpu=gpu, **{k: planned[k] for k in ("tokens_per_sec_per_gpu", "mfu", "peak_gib_per_gpu")})
    log(rank, f"planner's prediction for ours ({gpu}): {planned['tokens_per_sec_per_gpu']:,.0f} tok/s/GPU, "
              f"MFU {100 * planned['mfu']:.1f}%, peak {planned['peak_gib_per_gpu']:.1f} GiB")

    def ours(name: str, compiled: bool = False):
        mcfg_run, units, step_fn = build_ours(flags + OURS_RUNS.get(name, []), compile_blocks=compiled)
        host = units[0].host.state if getattr(units[0], "host", None) else None  # --offload_optimizer: its one host buffer
        run = timed_steps(step_fn, warmup, args.steps, device)
        if host:  # what zeroing and page-locking it took (docs/planning.md: pinning predicts the rate)
            run.update(host_buffer_gib=host.buffer.numel() * 4 / 2**30, host_zeroed_s=host.zeroed_s,
                       host_page_locked_s=host.page_locked_s)
        release(units)
        if compiled:  # one graph for all blocks (they share code); more means recompiles
            run["graphs_compiled"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        elif not dry:  # beside the peak: what fake CUDA measured for the same flags (eager only)
            flash = M.uses_flash(device, torch.bfloat16)
            run["fake_cuda_peak_gib"] = fake_cuda_peak_gib(name, layers, seq_len, world, flash)
            if run["fake_cuda_peak_gib"] is None:
                log(rank, f"{name}: no fake-CUDA measurement of these flags in {FAKE_MEMORY_JSON} (make one on any "
                          f"CPU: python bench/fake_memory.py --gpu_bench {gpu}:{world}:{layers} "
                          f"--flash {'on' if flash else 'off'})")
        return summarize(name, run, mcfg_run, seq_len, tokens_per_step_per_gpu, device, rank)

    def baseline():
        model, opt, step_fn = build_baseline(mcfg, seq_len, accum, device, T.parse_args(flags))
        return summarize("transformers + FSDP2", timed_steps(step_fn, warmup, args.steps, device), mcfg, seq_len,
                         tokens_per_step_per_gpu, device, rank)

    runs = [(name, partial(ours, name)) for name in ours_runs(world)]
    runs += [] if args.no_baseline else [("transformers + FSDP2", baseline)]
    compiled = "ours + torch.compile per block"  # last: its compile time is the least predictable
    runs += [] if args.no_compile else [(compiled, partial(ours, compiled, compiled=True))]
    for index, (name, run) in enumerate(runs):
        # gpu.sh stops everything at 8 minutes; a run that could not finish by then is not started.
        # The decision must be the same on every rank: rank 0's clock decides.
        late = torch.tensor(float(time.perf_counter() - started > args.budget_s - 100), device=device)
        dist.broadcast(late, 0)
        if late.item():
            results["runs"][name] = dict(error=f"skipped: under 100 s left of --budget_s {args.budget_s}")
        else:
            error = ""
            try:  # one failed variant (an OOM, a compiler error) must not cost the others' numbers
                if name in injected_failures(args.inject_failure, rank):
                    raise RuntimeError(f"injected failure (--inject_failure) on rank {rank}")
                results["runs"][name] = run()
            except Exception as e:  # noqa: BLE001 -- reported, and the run goes on
                error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            try:
                failed = agree_on_failure(index, error, args.agree_timeout_s)
            except dist.DistStoreError as e:  # a rank is still inside this run's collectives: nothing can follow
                print(f"error: bench/gpu.py: rank {rank}: {name}: {error or 'finished'}; not every rank reached the "
                      f"end of the run within {args.agree_timeout_s:g} s (one is waiting in a collective another "
                      f"left): stopping (the runs before are in --json) [{str(e).splitlines()[0][:200]}]",
                      file=sys.stderr, flush=True)
                os._exit(1)  # torchrun stops the other ranks; a normal exit would wait on their collectives
            if failed:
                results["runs"][name] = dict(error=f"failed on rank(s) {failed}" + (f": {error}" if error else ""))
        if "error" in results["runs"][name]:
            log(rank, f"{name}: {results['runs'][name]['error']}")
        if rank == 0 and args.json:  # after each run: what was measured survives a kill
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    eager, offloaded = results["runs"]["ours"], results["runs"].get("ours, --offload_optimizer true", {})
    if "losses" in eager and "losses" in offloaded:  # the same arithmetic, the update on the CPU
        offloaded["loss_vs_eager_rel"] = max(abs(a - b) / abs(a) for a, b in zip(eager["losses"], offloaded["losses"]))
    eager, compiled = results["runs"]["ours"], results["runs"].get("ours + torch.compile per block", {})
    if "losses" in eager and "losses" in compiled:  # the same data and weights: compile must not change them
        gap = max(abs(a - b) / abs(a) for a, b in zip(eager["losses"], compiled["losses"]))
        compiled["loss_vs_eager_rel"] = gap
        log(rank, f"torch.compile vs eager, the same steps: worst relative loss difference {gap:.1e} "
                  f"({'OK' if gap <= BF16_TOL else 'FAIL'}, tolerance {BF16_TOL:g})")
    results["elapsed_s"] = time.perf_counter() - started

    if rank == 0:
        print("\n" + table(results), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    failed = [name for name, r in results["runs"].items() if "error" in r or r.get("loss_vs_eager_rel", 0) > BF16_TOL]
    return 1 if failed else 0


def table(results: dict) -> str:
    env, attention = results["environment"], results["attention"]
    head = (f"{results['date']}, {env.get('gpu', 'CPU (dry run)')} x {results['world']}, torch {env['torch']}, "
            f"transformers {env['transformers']}; attention, ours: {attention['whole rows']} (packed documents: "
            f"{attention['packed documents']}), transformers: {results['baseline_attention']}; "
            f"{results['layers']} layers ({results['params'] / 1e9:.2f}B parameters), seq {results['seq_len']}, "
            f"micro-batch 1 x {results['accum']}, bf16, --ac selective, fp32 reduce; median of the timed steps; "
            f"correctness fp32 {results['correctness']['float32']['worst_rel']:.1e}, "
            f"bf16 {results['correctness']['bfloat16']['worst_rel']:.1e}")
    rows = ["| run | tokens/s/GPU | MFU | peak GiB | fake-CUDA GiB | step s | host syncs/step |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    p = results["planned"]
    rows.append(f"| ours, predicted by plan.py ({p['gpu']}) | {p['tokens_per_sec_per_gpu']:,.0f} | {100 * p['mfu']:.1f}% | "
                f"{p['peak_gib_per_gpu']:.1f} | | | |")
    for name, r in results["runs"].items():
        if "error" in r:
            rows.append(f"| {name} | {r['error'][:120]} | | | | | |")
            continue
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        syncs = "n/a" if r["host_syncs_per_step"] is None else f"{statistics.median(r['host_syncs_per_step']):g}"
        fake = "n/a" if r.get("fake_cuda_peak_gib") is None else f"{r['fake_cuda_peak_gib']:.1f}"
        rows.append(f"| {name} | {r['tokens_per_sec_per_gpu']:,.0f} | {mfu} | {r['peak_gib']:.1f} | {fake} | "
                    f"{r['step_s']:.3f} | {syncs} |")
    return head + "\n\n" + "\n".join(rows)


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # as train.py: no interpreter teardown (gloo's threads occasionally abort it)
