#!/usr/bin/env bash
# Runs train.py under torchrun on what this machine (or job) has. Extra arguments go to train.py.
#
#   ./launch.sh                          tiny preset on the built-in sample: all local GPUs, else 2 CPU processes
#   ./launch.sh --model llama3-8b ...    any train.py flags
#   NNODES=2 MASTER_ADDR=node0 ./launch.sh --init_from /models/Llama-3-70B-Instruct ...
#                                        run the same command on every node (c10d rendezvous on MASTER_ADDR)
#   srun --nodes 2 --ntasks-per-node 1 ./launch.sh ...
#                                        under SLURM: NNODES and MASTER_ADDR come from the job
# Overridable: NPROC_PER_NODE, NNODES, MASTER_ADDR, MASTER_PORT (29500), RDZV_ID, PYTHON.
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

exec "$PYTHON" -m torch.distributed.run "${RENDEZVOUS[@]}" --nproc_per_node "$NPROC_PER_NODE" train.py "$@"
