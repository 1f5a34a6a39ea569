"""Host (CPU) AdamW throughput, for the planner's --offload_optimizer: elements/s of PyTorch's fused AdamW
(torch._fused_adamw_, the kernel train.adamw_step runs) on fp32 CPU tensors, and of the host-side gradient
accumulation (fp32 accumulator += the reduce-scattered shard as it arrives from the GPU).

    python bench/host_adamw.py [--sizes 16e6,64e6,256e6] [--repeats 3] [--json out/host_adamw.json]

For each size: the four fp32 tensors of a shard (params, grads, exp_avg, exp_avg_sq) and a step tensor,
lr 1e-5, betas 0.9/0.95, eps 1e-8, weight_decay 0, timed with torch.get_num_threads() threads and with 1.
"State touched" counts what the update reads and writes: params, grads, exp_avg, exp_avg_sq read (16 B)
and params, exp_avg, exp_avg_sq written (12 B), 28 B per element. The accumulation reads the accumulator
and a bf16 shard and writes the accumulator: 10 B per element; "staged" casts the shard into a
preallocated fp32 buffer first and adds that (same-dtype add_). The best of --repeats runs is reported
(after one warm-up), so a run disturbed by other processes on the machine does not count.
"""

import argparse
import json
import platform
import time

import torch

ADAMW_BYTES = 28       # read p, g, m, v (4 x 4 B), write p, m, v (3 x 4 B)
ACCUMULATE_BYTES = 10  # read the fp32 accumulator and the bf16 shard, write the accumulator


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch page faults, thread pool start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(numel: int, threads: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    params, grads, exp_avg, exp_avg_sq = (torch.rand(numel, dtype=torch.float32) for _ in range(4))
    step = torch.zeros((), dtype=torch.float32)

    def adamw():
        step.add_(1)
        torch._fused_adamw_([params], [grads], [exp_avg], [exp_avg_sq], [], [step], lr=1e-5, beta1=0.9,
                            beta2=0.95, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)

    adamw_s = best_seconds(adamw, repeats)
    incoming = grads.to(torch.bfloat16)  # the reduce-scattered shard, --reduce_dtype bfloat16
    accumulate_s = best_seconds(lambda: grads.add_(incoming), repeats)
    staging = exp_avg_sq  # a preallocated fp32 buffer: cast into it first, then a same-dtype add
    staged_s = best_seconds(lambda: grads.add_(staging.copy_(incoming)), repeats)
    return dict(numel=numel, threads=threads, adamw_s=adamw_s, adamw_elements_per_s=numel / adamw_s,
                adamw_gb_per_s=ADAMW_BYTES * numel / adamw_s / 1e9, accumulate_s=accumulate_s,
                accumulate_elements_per_s=numel / accumulate_s,
                accumulate_gb_per_s=ACCUMULATE_BYTES * numel / accumulate_s / 1e9, accumulate_staged_s=staged_s,
                accumulate_staged_elements_per_s=numel / staged_s)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16e6,64e6,256e6", help="elements per shard, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="", help="write the results here")
    args = parser.parse_args()
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    all_threads = torch.get_num_threads()
    runs = []
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{all_threads} threads available", flush=True)
    print("| elements | threads | AdamW s | AdamW elements/s | AdamW GB/s (28 B/el) | accumulate elements/s "
          "| accumulate GB/s (10 B/el) | staged accumulate elements/s |", flush=True)
    print("|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for numel in sizes:
        for threads in sorted({all_threads, 1}, reverse=True):
            r = measure(numel, threads, args.repeats)
            runs.append(r)
            print(f"| {numel / 1e6:.0f}M | {threads} | {r['adamw_s']:.3f} | {r['adamw_elements_per_s'] / 1e6:,.0f}M "
                  f"| {r['adamw_gb_per_s']:.1f} | {r['accumulate_elements_per_s'] / 1e6:,.0f}M "
                  f"| {r['accumulate_gb_per_s']:.1f} | {r['accumulate_staged_elements_per_s'] / 1e6:,.0f}M |",
                  flush=True)
    torch.set_num_threads(all_threads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, threads_available=all_threads, runs=runs), f, indent=1)
        print(f"wrote {args.json}", flush=True)


if __name__ == "__main__":
    main()
