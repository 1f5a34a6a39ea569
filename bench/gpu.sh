#!/usr/bin/env bash
# The GPU benchmark (bench/gpu.py): correctness on the device, then ours vs transformers + FSDP2 on
# Llama-3-8B-shaped blocks at seq 8192. All local GPUs, one torchrun; stopped after 8 minutes whatever
# it is doing (what it printed by then stays).
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
# As launch.sh: NCCL's NVLS buffers off, the allocator's expandable segments on. On a GPU the correctness
# check then runs train.py's storage resize_(0)/resize_ trick under expandable segments (a wrong gather
# shows as a loss or gradient off the oracle), and each run's peak is what a launch.sh run would have.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
[ -n "${PYTORCH_ALLOC_CONF:-}${PYTORCH_CUDA_ALLOC_CONF:-}" ] || export PYTORCH_ALLOC_CONF=expandable_segments:True
export PYTHONUNBUFFERED=1
exec timeout --signal=TERM --kill-after=20 "${BENCH_TIMEOUT_S:-480}" \
    "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" bench/gpu.py "$@"
