#!/usr/bin/env bash
# The GPU benchmark, in one call of at most BENCH_BUDGET_S seconds (default 540: a 9-minute device session), the
# most valuable measurements first, each part given what is left of the budget (and no more than its own cap):
#   0. each GPU's health by hand (tools/gpu_check.py: the check matmul, ECC and row remapping, one line per GPU), the
#      first contact between the GPUs (NCCL's set-up within --first_contact_s; its watchdog firing on a late rank)
#      and each GPU's health check before step 1, which the run runs per rank in a subprocess (issue 51).
#   1. bench/gpu.py on all local GPUs: correctness against the oracle on the device, then each run's peak memory
#      beside the plan's and the fake-CUDA figure, then our step against transformers + FSDP2 (Llama-3-8B-shaped
#      blocks, seq 8192). Its --json is rewritten after each run, so a stopped benchmark still reports.
#   2. start-up as the planner assumed it (issue 38), a plain torchrun of train.py (not launch.sh) on every local GPU
#      with --offload_optimizer and --async_save: the all-gather's bus bandwidth beside the plan's, the largest
#      memory outside PyTorch's allocator at this many ranks beside --outside_gib, the page-locking rate per node
#      beside host_page_locking_gbps (the --offload_optimizer state, before step 1; the --async_save staging buffer,
#      made beside the first steps, at the first save); and what issue 37 asked of it (no preflight error, the
#      slowest rank named, NVLS off, expandable segments in effect).
#   3. bench/async_save.py: a save's stall and the steps beside its write (plan.ASSUMPTIONS async_write_slowdown).
#   4. --deterministic's cost (Llama-3.2-1B, one GPU, 3 short runs), 5. a --profile trace of one step
#      (out/gpu_profile/profile/, docs/profiling.md).
# Every part appends one JSON line (part, exit code, seconds, its budget, its result lines) to BENCH_PARTS_JSONL
# (default out/gpu_parts.jsonl) as it ends: a run stopped half-way still says what it measured.
#
#   bash bench/gpu.sh                      # on an H100/H200 node: paste the tables into BENCHMARKS.md
#   bash bench/gpu.sh --json out/gpu.json  # also every number of part 1 as JSON
#   bash bench/gpu.sh --dry-run            # no GPU: part 1 on CPU, 2 gloo processes, tiny shapes
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DRY=false; [[ " $* " == *" --dry-run "* ]] && DRY=true
if $DRY; then
    NPROC=2
    export OMP_NUM_THREADS=1
else
    NPROC=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if [[ "$NPROC" -lt 1 ]]; then
        echo "error: bench/gpu.sh: no GPU found (nvidia-smi -L lists none); use --dry-run to check the script on CPU" >&2
        exit 2
    fi
fi
# As train.py sets them (agree.launch_settings): NCCL's NVLS buffers off, expandable segments on.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
[ -n "${PYTORCH_ALLOC_CONF:-}${PYTORCH_CUDA_ALLOC_CONF:-}" ] || export PYTORCH_ALLOC_CONF=expandable_segments:True
export PYTHONUNBUFFERED=1
BUDGET_S=${BENCH_BUDGET_S:-540}
PARTS=${BENCH_PARTS_JSONL:-out/gpu_parts.jsonl}
mkdir -p "$(dirname "$PARTS")"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# part NAME CAP_S PATTERN CMD...: runs CMD under min(CAP_S, what is left of the budget), skipped under 20 s; prints
# and records the lines of its output that match PATTERN (grep -E), its exit code and its time.
part() {
    local name=$1 cap=$2 pattern=$3; shift 3
    local left=$((BUDGET_S - SECONDS - 5)) t0=$SECONDS code=0
    local limit=$((cap < left ? cap : left))
    if [[ $limit -lt 20 ]]; then
        echo "bench/gpu.sh: $name: skipped, ${left} s of the ${BUDGET_S} s budget left" >&2
        code=-1
    else
        timeout --signal=TERM --kill-after=15 "$limit" "$@" >"$WORK/$name.log" 2>"$WORK/$name.err" || code=$?
        grep -E "$pattern" "$WORK/$name.log" || true
        grep -E "^error|^warning|$pattern" "$WORK/$name.err" >&2 || true
        [[ $code -eq 0 ]] || echo "bench/gpu.sh: $name: exit $code after $((SECONDS - t0)) s" >&2
    fi
    "$PYTHON" - "$PARTS" "$name" "$code" "$((SECONDS - t0))" "$limit" "$pattern" "$WORK/$name.log" "$WORK/$name.err" <<'PY'
import json, os, re, sys
out, name, code, seconds, limit, pattern, *logs = sys.argv[1:]
lines = [line.rstrip() for log in logs if os.path.exists(log) for line in open(log, errors="replace")
         if re.search(pattern, line)]
with open(out, "a") as f:
    f.write(json.dumps(dict(part=name, exit=int(code), seconds=int(seconds), budget_s=int(limit), lines=lines)) + "\n")
PY
    return 0
}

# 0. The first contact between the GPUs and each GPU's health before step 1 (issue 51): what only real GPUs show,
#    first. Each GPU's check by hand (tools/gpu_check.py: one line per GPU, exit 1 on a wrong result or an ECC or
#    row-remapping problem); NCCL's communicator formed within --first_contact_s on every local GPU, the check
#    matmul's times and results as the run's ranks read them (the same tool, one subprocess per rank), ECC and row
#    remapping read, the slowest rank named by its own compute (CUDA events); then the
#    watchdog firing on real NCCL (the GIL released inside ProcessGroupNCCL's eager init): the last rank reaches
#    the first contact 120 s late, and every other rank must print the line naming it and exit 2 within ~30 s.
if ! $DRY; then
    part gpu_check 60 '^GPU|^error|^warning' "$PYTHON" tools/gpu_check.py
    part first_contact 120 'first contact|check matmul|ECC|row remap|slowest rank|expandable|^error|^warning' \
        "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" train.py --model tiny --steps 3 \
        --eval_every 0 --first_contact_s 60 --out_dir "$WORK/first_contact"
    part late_contact 90 'first contact|never reached|^error' env PYTHONPATH="$PWD/tests/fault_site${PYTHONPATH:+:$PYTHONPATH}" \
        ZERO3_FAULT="late_contact:$((NPROC - 1)):120" "$PYTHON" -m torch.distributed.run --standalone \
        --nproc_per_node "$NPROC" train.py --model tiny --steps 1 --eval_every 0 --first_contact_s 20 \
        --out_dir "$WORK/late_contact"
fi

# 1. Correctness, memory against the plan, speed against FSDP2 (bench/gpu.py stops starting timed runs near its budget).
status=0
part gpu_py 330 '.' "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" bench/gpu.py \
    --budget_s 300 "$@"
status=$("$PYTHON" -c "import json,sys; print(max(0, [json.loads(l) for l in open(sys.argv[1])][-1]['exit']))" "$PARTS")
$DRY && exit "$status"

"$PYTHON" -c "import numpy as np, sys; np.save(sys.argv[1], np.random.default_rng(0).integers(0, 128000, 1_000_000).astype(np.uint32))" "$WORK/tokens.npy"
# 2. Start-up measured (the planner's assumptions) and the same job on every rank.
part startup 120 'all-gather of|outside PyTorch|page-locked|staging buffer|slowest rank|^error|^warning|NVLS|expandable' \
    env NCCL_DEBUG=INFO "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" train.py \
    --model llama3.2-1b --data "$WORK/tokens.npy" --seq_len 4096 --batch_size "$NPROC" --micro_batch_size 1 --steps 4 \
    --warmup_steps 1 --eval_every 0 --ckpt_every 2 --async_save true --offload_optimizer true --out_dir "$WORK/startup"
part expandable 30 'expandable' "$PYTHON" -c "import torch; from components import agree; agree.launch_settings('$WORK/x')
x = torch.empty(1 << 20, device='cuda')
print('expandable segments after launch_settings:', any(s.get('is_expandable') for s in torch.cuda.memory_snapshot()))"
# 3. A save's stall on a GPU, and the steps beside the write.
part async_save 150 'stall|write|step' env CUDA_VISIBLE_DEVICES=0 "$PYTHON" bench/async_save.py \
    --out_dir "$WORK/async" --steps 41 --ckpt_every 8
# 4. --deterministic's cost and effect (docs/operations.md, "What exact means where"): Llama-3.2-1B, one GPU.
for run in plain deterministic deterministic_again; do
    flag=false; [[ $run == plain ]] || flag=true
    part "$run" 60 '^step 12/' env CUDA_VISIBLE_DEVICES=0 "$PYTHON" train.py --model llama3.2-1b --data "$WORK/tokens.npy" \
        --seq_len 8192 --batch_size 2 --micro_batch_size 1 --steps 12 --warmup_steps 2 --eval_every 0 \
        --deterministic "$flag" --out_dir "$WORK/$run"
done
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
    print("--deterministic: not measured (a run failed or the budget ran out; see above)")
PY
# 5. One step's torch.profiler trace on all local GPUs: open out/gpu_profile/profile/step_3_rank_0.json in Perfetto.
part profile 90 'wrote|^error' "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" train.py \
    --model llama3.2-1b --data "$WORK/tokens.npy" --seq_len 8192 --batch_size "$NPROC" --micro_batch_size 1 --steps 3 \
    --warmup_steps 1 --eval_every 0 --profile 3 --out_dir out/gpu_profile --resume never --overwrite true
echo "bench/gpu.sh: ${SECONDS} s of the ${BUDGET_S} s budget; every part's lines in $PARTS"
exit "$status"
