"""Python's garbage collector while training: automatic (Python's allocation thresholds) against train.py's
control (off while training, a collection every GC_EVERY_STEPS steps, at the same step on every rank).

    OMP_NUM_THREADS=1 python bench/gc_pauses.py [--steps 100]

Runs train.main in this process twice with the default flags (the tiny preset, the built-in sample), one rank, and
records every collection with gc.callbacks from the first step to the end of the run: how many ran, their total
and their longest pause, beside the median and longest step. At W ranks each rank pauses at moments of its own,
and every collective waits for the rank that paused: what a step loses is the longest of the W ranks' pauses that
fell in it, not their mean.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train as T  # noqa: E402


def run(mode: str, steps: int, out_dir: str) -> dict:
    pauses, state = [], {"training": False, "start": 0.0}

    def on_collection(phase, info):
        if phase == "start":
            state["start"] = time.perf_counter()
        elif state["training"]:
            pauses.append((info["generation"], time.perf_counter() - state["start"]))
    real_step, real_disable, real_every = T.train_step, gc.disable, T.GC_EVERY_STEPS

    def train_step(*args):
        state["training"] = True
        return real_step(*args)
    T.train_step = train_step
    if mode == "automatic":  # train.py's control undone: Python's thresholds decide
        gc.disable, T.GC_EVERY_STEPS = (lambda: None), 10**9
    gc.callbacks.append(on_collection)
    try:
        T.main(["--steps", str(steps), "--eval_every", "0", "--out_dir", out_dir, "--log_every", str(steps)])
    finally:
        gc.callbacks.remove(on_collection)
        T.train_step, gc.disable, T.GC_EVERY_STEPS = real_step, real_disable, real_every
        gc.unfreeze()
        gc.enable()
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        step_s = [json.loads(line)["step_time_s"] for line in f]
    by_generation = {g: sum(1 for gen, _ in pauses if gen == g) for g in (0, 1, 2)}
    return dict(mode=mode, steps=steps, collections=len(pauses), by_generation=by_generation,
                pause_total_ms=1e3 * sum(p for _, p in pauses), pause_longest_ms=1e3 * max((p for _, p in pauses), default=0),
                step_median_s=statistics.median(step_s), step_longest_s=max(step_s))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="gc_pauses_")
    rows = [run(mode, args.steps, os.path.join(work, mode)) for mode in ("automatic", "controlled")]
    print(f"| collector | collections in {args.steps} steps (gen 0/1/2) | pauses, total | longest pause | "
          f"median step | longest step |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        g = r["by_generation"]
        print(f"| {r['mode']} | {r['collections']} ({g[0]}/{g[1]}/{g[2]}) | {r['pause_total_ms']:.1f} ms | "
              f"{r['pause_longest_ms']:.2f} ms | {r['step_median_s']:.3f} s | {r['step_longest_s']:.3f} s |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # as train.py: no interpreter teardown
