#!/usr/bin/env bash
# Runs train.py under torchrun on what this machine (or job) has. Extra arguments go to train.py.
#
#   ./launch.sh                          tiny preset on the built-in sample: all local GPUs, else 2 CPU processes
#   ./launch.sh --model llama3-8b ...    any train.py flags
#   NNODES=2 MASTER_ADDR=node0 ./launch.sh --init_from /models/Llama-3-70B-Instruct ...
#                                        run the same command on every node (c10d rendezvous on MASTER_ADDR)
#   srun --nodes 2 --ntasks-per-node 1 ./launch.sh ...
#                                        under SLURM: NNODES and MASTER_ADDR come from the job (launch.sbatch)
#   ./launch.sh --check                  all-reduce bus bandwidth across the same ranks, in the training backend
#                                        (NCCL on GPUs) and in gloo, the checkpoint group's (bench/comm_check.py)
# Overridable: NPROC_PER_NODE, NNODES, MASTER_ADDR, MASTER_PORT (29500), RDZV_ID, MAX_RESTARTS (3), PYTHON,
# RDZV_JOIN_TIMEOUT_S (1800), RDZV_READ_TIMEOUT_S (300).
# Under SLURM, NNODES is the job's (an exported NNODES that differs from SLURM_NNODES is an error: each node
# would otherwise wait for a different number of nodes), as are MASTER_ADDR (an exported one that is not a
# node of the job is ignored, with a warning) and RDZV_ID (always SLURM_JOB_ID), and one task per node is
# required. RDZV_ID, the name of the rendezvous on MASTER_ADDR, is otherwise derived from --out_dir's
# absolute path: two runs on one MASTER_ADDR never join each other's rendezvous, and every node of one run
# must name the same --out_dir. Every node must run as many processes as the others (train.py checks).
#
# Restarts are torchrun's own (--max-restarts): when a rank dies, every node's torchrun stops its workers,
# meets the others again in the same rendezvous and starts them; train.py resumes from the newest intact
# checkpoint in --out_dir. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is what makes that work: with the store
# shared between torchrun and the workers (the default since torch 2.5), a restarted process group reads
# the previous attempt's addresses from it and dials a dead port (gloo "connectFullMesh failed ...
# Connection refused"; NCCL the same, pytorch/pytorch#135712 and #167288). With it, each attempt's rank 0
# hosts a fresh store.
# A failure a restart cannot fix (train.py exits 2: a bad flag, bad data, a non-finite loss) is not retried:
# train.py writes its error line to $ZERO3_FATAL_FILE and this script stops torchrun and exits 2.
#
# Stopping (preemption, Ctrl-C): SIGTERM, SIGINT or SIGUSR1 to this script, to its process group, or to
# every process of the job (SLURM signals every process of a job step) ends in one "save and stop" request
# to the workers, and exit code 0 once they saved. torchrun runs in its own process group, ignores SIGUSR1
# and has SIGTERM and SIGINT blocked, so it never acts on them: it would pass them to the workers, SIGKILL
# them 30 s later (mid-save: torch before pytorch/pytorch#172596, merged March 2026, has no
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT) and exit 1 even when they saved (torch 2.13 too). This script passes the
# request on as SIGUSR1 to the workers (every half second: a worker still starting up cannot act on it
# yet), and train.py saves at the next step boundary and exits 0; it ignores repeats. The workers inherit
# the mask; train.py unblocks both signals first thing. Nothing kills the workers while they save (a 70B
# save is 53 GB per rank).
#
# InfiniBand / RoCE. NCCL uses InfiniBand by itself when it finds the HCAs; set these when it does not:
#   NCCL_IB_HCA=mlx5_0,mlx5_1,...  the HCAs to use     NCCL_SOCKET_IFNAME=eth0  the bootstrap interface
#   NCCL_IB_GID_INDEX=3            RoCE v2 only        NCCL_DEBUG=INFO  the log says NET/IB (good) or NET/Socket (TCP)
# The checkpoint collectives run in a gloo group (CPU, TCP), which picks the interface the hostname resolves
# to (127.0.1.1 on many nodes): set GLOO_SOCKET_IFNAME=eth0 (an exact interface name, or a comma-separated
# list; not NCCL's prefix syntax) beside NCCL_SOCKET_IFNAME. All of these pass through from the environment
# to every worker; `--check` exercises both groups. A collective stuck longer than --timeout_min (a dead or
# hung peer) ends the process: torch's default NCCL error handling does that, nothing to set.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)  # train.py's folder; relative paths in the flags stay the caller's
PYTHON=${PYTHON:-python3}

if [ -n "${SLURM_JOB_ID:-}" ]; then
  if [ -n "${NNODES:-}" ] && [ "$NNODES" != "${SLURM_NNODES:-1}" ]; then
    echo "launch.sh: NNODES=$NNODES, but this SLURM job has SLURM_NNODES=${SLURM_NNODES:-1} nodes; unset NNODES" \
         "(under SLURM it comes from the job) or submit the job with --nodes $NNODES" >&2
    exit 2
  fi
  NNODES=${SLURM_NNODES:-1}
  # One launch.sh per node: its torchrun starts the node's processes. Two tasks on a node would start two
  # torchruns there, each with all of the node's GPUs.
  if [ -n "${SLURM_NTASKS:-}" ] && [ "$SLURM_NTASKS" != "$NNODES" ]; then
    echo "launch.sh: this SLURM step runs $SLURM_NTASKS tasks on $NNODES node(s); launch.sh must run once per node" \
         "(its torchrun starts one process per GPU): srun --ntasks-per-node=1 ./launch.sh, or #SBATCH --ntasks-per-node=1" >&2
    exit 2
  fi
  # MASTER_ADDR and RDZV_ID are the job's. Both come through sbatch's copy of the submitting shell's
  # environment too: an old node's name, or RDZV_ID=manual left from a run by hand, would have the nodes
  # wait for a rendezvous nobody hosts, or meet another run's. Ignored, with a warning: the job's own are
  # always right, and refusing would stop an unattended requeue chain for a leftover. A MASTER_ADDR that is
  # one of the job's nodes (by name, short name, or an address one of them resolves to) is kept.
  is_job_node() {
    local node addresses node_addresses
    for node in $job_nodes; do
      if [ "$1" = "$node" ] || [ "${1%%.*}" = "$node" ]; then return 0; fi
    done
    addresses=$(getent ahosts "$1" | awk '{print $1}') || return 1
    for node in $job_nodes; do
      node_addresses=$(getent ahosts "$node" | awk '{print $1}') || continue
      if grep -qxF "$addresses" <<<"$node_addresses"; then return 0; fi
    done
    return 1
  }
  if job_nodes=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null) && [ -n "$job_nodes" ]; then
    first_node=${job_nodes%%$'\n'*}
    if [ -n "${MASTER_ADDR:-}" ] && ! is_job_node "$MASTER_ADDR"; then
      echo "launch.sh: ignoring MASTER_ADDR=$MASTER_ADDR from the environment: it is not a node of SLURM job" \
           "$SLURM_JOB_ID ($SLURM_JOB_NODELIST); the rendezvous is on its first node, $first_node" >&2
      MASTER_ADDR=$first_node
    fi
    MASTER_ADDR=${MASTER_ADDR:-$first_node}
  elif [ -z "${MASTER_ADDR:-}" ]; then  # no scontrol (a container without SLURM's commands)
    echo "launch.sh: cannot list this SLURM job's nodes (scontrol show hostnames '${SLURM_JOB_NODELIST:-}' failed);" \
         "set MASTER_ADDR to the job's first node" >&2
    exit 2
  fi
  if [ -n "${RDZV_ID:-}" ] && [ "$RDZV_ID" != "$SLURM_JOB_ID" ]; then
    echo "launch.sh: ignoring RDZV_ID=$RDZV_ID from the environment (left from a run by hand?): under SLURM the" \
         "rendezvous is the job's, $SLURM_JOB_ID" >&2
  fi
  RDZV_ID=$SLURM_JOB_ID
fi
NNODES=${NNODES:-1}
MAX_RESTARTS=${MAX_RESTARTS:-3}
# torchrun's c10d rendezvous waits join_timeout (600 s by default) for every node and each store read
# read_timeout (60 s; torch/distributed/elastic/rendezvous: dynamic_rendezvous.create_handler,
# c10d_rendezvous_backend): a node that starts late (a container image pulled, a virtualenv imported from a
# busy shared filesystem, a node booted by the scheduler) fails the others' rendezvous at 60 s or 10 min,
# and each restart meets the same late node. Longer waits cost nothing when every node is on time.
RDZV_JOIN_TIMEOUT_S=${RDZV_JOIN_TIMEOUT_S:-1800}
RDZV_READ_TIMEOUT_S=${RDZV_READ_TIMEOUT_S:-300}
for name in NNODES MAX_RESTARTS RDZV_JOIN_TIMEOUT_S RDZV_READ_TIMEOUT_S ${NPROC_PER_NODE:+NPROC_PER_NODE}; do
  [[ "${!name}" =~ ^[0-9]+$ ]] || { echo "launch.sh: $name must be a whole number, got '${!name}'" >&2; exit 2; }
done
read -r GPUS NUMA_OK < <("$PYTHON" -c "import importlib.util, torch
print(torch.cuda.device_count(), int(importlib.util.find_spec('torch.numa.binding') is not None))")
NPROC_PER_NODE=${NPROC_PER_NODE:-$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 2)}
if [ "$GPUS" -eq 0 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread per CPU process: 2 processes on 2 cores
fi

OUT_DIR=out  # --out_dir's absolute path (train.py's default: out), for the rendezvous id
previous=
for arg in "$@"; do
  [ "$previous" = --out_dir ] && OUT_DIR=$arg
  case "$arg" in --out_dir=*) OUT_DIR=${arg#--out_dir=} ;; esac
  previous=$arg
done
case "$OUT_DIR" in /*) ;; *) OUT_DIR="$PWD/$OUT_DIR" ;; esac

# GPU memory and diagnosis (NVLS off, expandable segments, NCCL's flight recorder dumping into OUT_DIR/nccl_trace):
# train.py sets them itself before CUDA starts (components/agree.py launch_settings), so that a plain torchrun
# gets them too; an exported value wins there.
# NUMA: torchrun (torch 2.9+) binds each worker to CPUs of its GPU's NUMA node (numactl); "exclusive" splits
# that node's physical cores evenly between its GPUs, the cores per GPU the planner's CPU update assumes
# (tools/plan.py host_cores_per_node / GPUs per node); offload.optimizer_threads then uses all of the rank's own.
# NUMA_BINDING=none turns it off (node, socket: see torch/numa/binding.py).
NUMA_BINDING=${NUMA_BINDING:-exclusive}
BIND=()
if [ "$GPUS" -gt 0 ] && [ "$NUMA_OK" = 1 ] && [ "$NUMA_BINDING" != none ] && command -v numactl >/dev/null; then
  BIND=(--numa-binding "$NUMA_BINDING")
  export ZERO3_NUMA_BINDING=$NUMA_BINDING
fi

if [ "$NNODES" -gt 1 ]; then
  : "${MASTER_ADDR:?set MASTER_ADDR (address of the first node) for a multi-node run}"
  if [ -z "${RDZV_ID:-}" ]; then  # one per run: a hash of --out_dir's absolute path
    RDZV_ID=llama-zero3-$(printf '%s' "$OUT_DIR" | cksum | cut -d ' ' -f 1)
  fi
  RENDEZVOUS=(--nnodes "$NNODES" --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}"
              --rdzv_id "$RDZV_ID"
              --rdzv_conf "join_timeout=$RDZV_JOIN_TIMEOUT_S,read_timeout=$RDZV_READ_TIMEOUT_S")
else
  RENDEZVOUS=(--standalone)
fi

if [ "${1:-}" = "--check" ]; then
  exec "$PYTHON" -m torch.distributed.run "${RENDEZVOUS[@]}" --nproc_per_node "$NPROC_PER_NODE" "$HERE/bench/comm_check.py"
fi

export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
ZERO3_FATAL_FILE=$(mktemp "${TMPDIR:-/tmp}/launch-fatal.XXXXXX")
export ZERO3_FATAL_FILE
# `|| true`: under SLURM a job step's SIGTERM (srun --kill-on-bad-exit after the other node exited 2) can land
# while rm runs; with set -e the killed rm would turn this script's exit code 2 into 143, and launch.sbatch
# would retry an error a restart repeats.
trap 'rm -f "$ZERO3_FATAL_FILE" || true' EXIT

# torchrun with SIGTERM and SIGINT blocked (see "Stopping" above): a signal mask, unlike a handler, survives
# into torchrun's own signal.signal calls. And torchrun quiet once train.py has written its fatal line:
# stopping it (SIGHUP, below) would otherwise print its log and a 30-line SignalException traceback after
# the trainer's one line, and on two nodes the other node's torchrun its store client's C++ stack traces
# when this one's rendezvous store goes away. Python's writes are checked as they are made (torchrun's
# log handlers are made after sys.stderr is replaced); a thread points torchrun's descriptor 2 at
# /dev/null within 50 ms for what its C++ code writes. The workers keep their own descriptor 2 (they are
# started before the fatal line), so nothing they print passes through this or waits for it. What torchrun
# prints before this node's line is left as it is (the other node's store gone while this node's workers
# were still on their way to the same error: its warnings, then the error line, last).
TORCHRUN_QUIET_AFTER_FATAL='import os, runpy, signal, sys, threading, time
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM, signal.SIGINT])
def fatal():
    try:
        return os.path.getsize(os.environ["ZERO3_FATAL_FILE"]) > 0
    except OSError:
        return False
class QuietAfterFatal:
    def __init__(self, stream):
        self.stream = stream
    def write(self, text):
        return len(text) if fatal() else self.stream.write(text)
    def __getattr__(self, name):
        return getattr(self.stream, name)
def quiet_descriptor_after_fatal():
    while not fatal():
        time.sleep(0.05)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
sys.stderr = QuietAfterFatal(sys.stderr)
threading.Thread(target=quiet_descriptor_after_fatal, daemon=True).start()
runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)'
set -m  # the next background job gets its own process group: a signal to ours does not reach torchrun
( trap '' USR1; exec "$PYTHON" -c "$TORCHRUN_QUIET_AFTER_FATAL" "${RENDEZVOUS[@]}" \
    --nproc_per_node "$NPROC_PER_NODE" ${BIND[@]+"${BIND[@]}"} --max-restarts "$MAX_RESTARTS" "$HERE/train.py" "$@" ) &
TORCHRUN=$!
set +m
echo "launch.sh: torchrun is pid $TORCHRUN; to stop at once, without saving: pkill -9 -P $TORCHRUN; kill -9 $TORCHRUN" >&2

STOPPING=0
request_stop() {
  [ "$STOPPING" -eq 1 ] || echo "launch.sh: stop requested; train.py saves at the next step boundary and exits" >&2
  STOPPING=1
}
trap request_stop TERM INT USR1

while kill -0 "$TORCHRUN" 2>/dev/null; do
  if [ "$STOPPING" -eq 1 ]; then  # again each turn: workers still starting up ignore it until they can save
    pkill -USR1 -P "$TORCHRUN" || true
  fi
  if [ -s "$ZERO3_FATAL_FILE" ]; then  # train.py failed in a way a restart repeats: stop torchrun's restarts
    kill -HUP "$TORCHRUN" 2>/dev/null || true  # torchrun handles SIGHUP as it would SIGTERM: stops its workers
    wait "$TORCHRUN" 2>/dev/null || true
    # A node to leave out (a GPU that is broken or another job's: the line says `sbatch --exclude=HOST`), kept in
    # OUT_DIR/exclude_hosts, which every node shares, for launch.sbatch's message.
    EXCLUDE=$(grep -o 'sbatch --exclude=[^ );,]*' "$ZERO3_FATAL_FILE" | sed 's/.*=//' | sort -u || true)
    if [ -n "$EXCLUDE" ]; then
      { mkdir -p "$OUT_DIR" && echo "$EXCLUDE" >> "$OUT_DIR/exclude_hosts"; } || true
    fi
    # The line, in OUT_DIR/fatal_errors too: srun reports the largest of the nodes' exit codes, and the 143 of a
    # node it ended (--kill-on-bad-exit) would hide this node's 2 from launch.sbatch, which then requeues.
    { mkdir -p "$OUT_DIR" && cat "$ZERO3_FATAL_FILE" >> "$OUT_DIR/fatal_errors"; } || true
    echo "launch.sh: train.py stopped with an error a restart would repeat (above); not restarting" >&2
    exit 2
  fi
  sleep 0.5 || true  # a signal to our process group ends the sleep too
done
status=0
wait "$TORCHRUN" || status=$?
exit "$status"
