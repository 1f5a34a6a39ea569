#!/usr/bin/env bash
# Runs train.py under torchrun on what this machine (or job) has. Extra arguments go to train.py.
#
#   ./launch.sh                          tiny preset on the built-in sample: all local GPUs, else 2 CPU processes
#   ./launch.sh --model llama3-8b ...    any train.py flags
#   NNODES=2 MASTER_ADDR=node0 ./launch.sh --init_from /models/Llama-3-70B-Instruct ...
#                                        run the same command on every node (c10d rendezvous on MASTER_ADDR)
#   srun --nodes 2 --ntasks-per-node 1 ./launch.sh ...
#                                        under SLURM: NNODES and MASTER_ADDR come from the job (launch.sbatch)
#   ./launch.sh --check                  all-reduce bus bandwidth across the same ranks (bench/comm_check.py)
# Overridable: NPROC_PER_NODE, NNODES, MASTER_ADDR, MASTER_PORT (29500), RDZV_ID, MAX_RESTARTS (3), PYTHON.
#
# Restarts: when a rank crashes, torchrun stops the others and exits non-zero; this script then starts
# torchrun again, up to MAX_RESTARTS times, and train.py resumes from the newest intact checkpoint in
# --out_dir, so no human is needed. (A loop here rather than torchrun's own --max-restarts: each attempt
# gets a fresh rendezvous store; with torch 2.13's restarts the new gloo group was seen dialling the
# dead attempt's address. Bad flags fail fast and are printed again on each attempt.)
#
# InfiniBand / RoCE. NCCL uses InfiniBand by itself when it finds the HCAs; set these when it does not:
#   NCCL_IB_HCA=mlx5_0,mlx5_1,...  the HCAs to use     NCCL_SOCKET_IFNAME=eth0  the bootstrap interface
#   NCCL_IB_GID_INDEX=3            RoCE v2 only        NCCL_DEBUG=INFO  the log says NET/IB (good) or NET/Socket (TCP)
# They pass through from the environment. TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (set below unless given)
# makes a collective that times out (--timeout_min) end the process instead of hanging it.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

if [ -n "${SLURM_JOB_ID:-}" ]; then
  NNODES=${NNODES:-${SLURM_NNODES:-1}}
  MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
  RDZV_ID=${RDZV_ID:-$SLURM_JOB_ID}
fi
NNODES=${NNODES:-1}
GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
NPROC_PER_NODE=${NPROC_PER_NODE:-$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 2)}
if [ "$GPUS" -eq 0 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread per CPU process: 2 processes on 2 cores
fi

if [ "$NNODES" -gt 1 ]; then
  : "${MASTER_ADDR:?set MASTER_ADDR (address of the first node) for a multi-node run}"
  RENDEZVOUS=(--nnodes "$NNODES" --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}"
              --rdzv_id "${RDZV_ID:-llama-zero3}")
else
  RENDEZVOUS=(--standalone)
fi

export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
if [ "${1:-}" = "--check" ]; then
  exec "$PYTHON" -m torch.distributed.run "${RENDEZVOUS[@]}" --nproc_per_node "$NPROC_PER_NODE" bench/comm_check.py
fi
MAX_RESTARTS=${MAX_RESTARTS:-3}
for attempt in $(seq 0 "$MAX_RESTARTS"); do
  status=0
  "$PYTHON" -m torch.distributed.run "${RENDEZVOUS[@]}" --nproc_per_node "$NPROC_PER_NODE" train.py "$@" || status=$?
  [ "$status" -eq 0 ] && exit 0
  [ "$attempt" -lt "$MAX_RESTARTS" ] && echo "launch.sh: torchrun exited with $status; restart $((attempt + 1)) of $MAX_RESTARTS" >&2
done
exit "$status"
