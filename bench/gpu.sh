#!/usr/bin/env bash
# The GPU benchmark (bench/gpu.py): correctness on the device, then ours vs transformers + FSDP2 on
# Llama-3-8B-shaped blocks at seq 8192. All local GPUs, one torchrun; stopped after 8 minutes whatever
# it is doing (what it printed by then stays). Then, on one GPU, what --deterministic costs (up to 3 x 4 minutes),
# and a --profile trace of one step on all GPUs into out/gpu_profile/profile/ (up to 5 minutes; docs/profiling.md).
#
#   bash bench/gpu.sh                      # on an H100/H200 node: paste the table into BENCHMARKS.md
#   bash bench/gpu.sh --json out/gpu.json  # also every number as JSON
#   bash bench/gpu.sh --dry-run            # no GPU: the same code on CPU, 2 gloo processes, tiny shapes
# What only a GPU shows of issue 20's start-up hazards is in the "environment" line: the memory outside
# PyTorch's allocator (CUDA context + NCCL, NVLS off) against the planner's 1 GiB, whether the selective
# policy saves flash_attn's attention (flash_attn_unsaved: null) and whether flash_attn failed to import.
# Each eager run's peak is printed beside the peak the same flags reached under fake CUDA on a CPU
# (bench/gpu_fake_memory.json; `python bench/fake_memory.py --gpu_bench GPU:W` measures a missing one).
# The group is made by train.init_processes, bound to the GPU: a broken NCCL fails before correctness.
# --offload_optimizer (the "ours, --offload_optimizer true" run): host_zeroed_s and host_page_locked_s in its JSON
# are what zeroing and cudaHostRegister of the one host buffer took (plan.ASSUMPTIONS pinning predicts ~1-2 GB/s);
# its step time against "ours" is what the worker thread's adds, the copy stream and the bf16 copies up
# leave exposed; an Nsight trace (nsys profile) of it should show the copies down on a stream of their own.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [[ " $* " == *" --dry-run "* ]]; then
    NPROC=2
    export OMP_NUM_THREADS=1
else
    NPROC=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if [[ "$NPROC" -lt 1 ]]; then
        echo "error: bench/gpu.sh: no GPU found (nvidia-smi -L lists none); use --dry-run to check the script on CPU" >&2
        exit 2
    fi
fi
# As train.py sets them (agree.launch_settings): NCCL's NVLS buffers off, expandable segments on. On a GPU the correctness
# check then runs train.py's storage resize_(0)/resize_ trick under expandable segments (a wrong gather
# shows as a loss or gradient off the oracle), and each run's peak is what a launch.sh run would have.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
[ -n "${PYTORCH_ALLOC_CONF:-}${PYTORCH_CUDA_ALLOC_CONF:-}" ] || export PYTORCH_ALLOC_CONF=expandable_segments:True
export PYTHONUNBUFFERED=1
status=0
timeout --signal=TERM --kill-after=20 "${BENCH_TIMEOUT_S:-480}" \
    "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" bench/gpu.py "$@" || status=$?

# --deterministic's cost and effect (docs/operations.md, "What exact means where"; unmeasured so far): one GPU,
# Llama-3.2-1B at seq 8192 through train.py for 12 steps without it, then twice with it. Prints the median
# step time of steps 3-12 of each and whether the two deterministic runs' losses are equal bit for bit (and
# the plain run's against them). Not with --dry-run: on a CPU the kernels are deterministic already.
if [[ " $* " != *" --dry-run "* ]]; then
    WORK=$(mktemp -d)
    "$PYTHON" -c "import numpy as np, sys; np.save(sys.argv[1], np.random.default_rng(0).integers(0, 128000, 1_000_000).astype(np.uint32))" "$WORK/tokens.npy"
    for run in plain deterministic deterministic_again; do
        flag=false; [[ $run == plain ]] || flag=true
        CUDA_VISIBLE_DEVICES=0 timeout 240 "$PYTHON" train.py --model llama3.2-1b --data "$WORK/tokens.npy" --seq_len 8192 \
            --batch_size 2 --micro_batch_size 1 --steps 12 --warmup_steps 2 --eval_every 0 --deterministic "$flag" --out_dir "$WORK/$run" \
            >"$WORK/$run.log" 2>&1 || echo "bench/gpu.sh: --deterministic $flag failed: $(tail -n 1 "$WORK/$run.log")" >&2
    done
    # One step's torch.profiler trace on all local GPUs (docs/profiling.md: exposed all-gathers, the reduce-scatter
    # tail, the optimizer step): open out/gpu_profile/profile/step_3_rank_0.json in https://ui.perfetto.dev
    timeout 300 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" train.py --model llama3.2-1b \
        --data "$WORK/tokens.npy" --seq_len 8192 --batch_size "$NPROC" --micro_batch_size 1 --steps 3 --warmup_steps 1 \
        --eval_every 0 --profile 3 --out_dir out/gpu_profile --resume never --overwrite true >"$WORK/profile.log" 2>&1 \
        || echo "bench/gpu.sh: --profile failed: $(tail -n 1 "$WORK/profile.log")" >&2
    "$PYTHON" - "$WORK" <<'PY'
import json, os, statistics, sys
rows = {}
for run in ("plain", "deterministic", "deterministic_again"):
    path = os.path.join(sys.argv[1], run, "metrics.jsonl")
    rows[run] = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
if all(len(r) == 12 for r in rows.values()):
    median = {run: statistics.median(r["step_time_s"] for r in rs[2:]) for run, rs in rows.items()}
    loss = {run: [r["loss"] for r in rs] for run, rs in rows.items()}
    print(f"--deterministic (llama3.2-1b, seq 8192, 1 GPU): median step {median['plain']:.3f} s without, "
          f"{median['deterministic']:.3f} s with ({100 * (median['deterministic'] / median['plain'] - 1):+.1f}%) | "
          f"two runs with it bit-identical: {loss['deterministic'] == loss['deterministic_again']} | "
          f"without it, equal to them: {loss['plain'] == loss['deterministic']}")
else:
    print("--deterministic: not measured (a run failed; see above)")
PY
    rm -rf "$WORK"
fi
# Every rank runs the same job (issue 37) on real ranks: a plain torchrun of train.py (not launch.sh) on every local
# GPU, with NCCL's log: the preflight (agree.py) passes on a healthy node; the step line names the slowest rank; NCCL
# says NVLS is off (train.py set NCCL_NVLS_ENABLE=0 itself); and a tensor made after agree.launch_settings sits in an
# expandable segment (the allocator read PYTORCH_ALLOC_CONF after torch was imported, as train.py sets it).
if [[ " $* " != *" --dry-run "* ]]; then
    SAME=$(mktemp -d)
    NCCL_DEBUG=INFO timeout 180 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" train.py \
        --model tiny --steps 3 --eval_every 0 --batch_size "$((4 * NPROC))" --out_dir "$SAME/run" >"$SAME/log" 2>&1 \
        || echo "bench/gpu.sh: the plain torchrun failed: $(grep -m1 '^error' "$SAME/log")" >&2
    echo "same job: $(grep -c '^error' "$SAME/log") preflight errors | $(grep -m1 -o 'slowest rank.*' "$SAME/log" || echo 'no slowest-rank line')" \
         "| NCCL on NVLS: $(grep -m1 -io 'NVLS[^|]*' "$SAME/log" || echo 'nothing said')"
    "$PYTHON" -c "import torch; from components import agree; agree.launch_settings('$SAME/run')
x = torch.empty(1 << 20, device='cuda')
print('expandable segments after launch_settings:', any(s.get('is_expandable') for s in torch.cuda.memory_snapshot()))" \
        || echo "bench/gpu.sh: the expandable-segments check failed" >&2
    rm -rf "$SAME"
fi
# --async_save on a GPU (issue 27; nothing here ran on one yet): the stall of a save, synchronous vs in the
# background, where the copy is device to page-locked host memory (PCIe) instead of a memcpy, and the background
# write competes with the GPU's work only for host memory bandwidth and a CPU core. bench/async_save.py picks
# the device by itself (--device auto): its lines say the stall per save, the write and the step times each way.
if [[ " $* " != *" --dry-run "* ]]; then
    CUDA_VISIBLE_DEVICES=0 timeout 300 "$PYTHON" bench/async_save.py --out_dir "$(mktemp -d)/async" --steps 41 --ckpt_every 8 \
        | tail -n 3 || echo "bench/gpu.sh: bench/async_save.py failed" >&2
fi
exit "$status"
