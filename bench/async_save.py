"""How long a checkpoint save stops training, --async_save false vs true (a benchmark, not a test).

    python bench/async_save.py [--out_dir /tmp/async_bench] [--steps 40] [--ckpt_every 8]

One process (W = 1) trains a ~125M-parameter Llama-shaped model (fp32, sequences of 32 tokens, one per
step) twice, from the same seed: with synchronous saves, then with background saves, every --ckpt_every
steps, into --out_dir (put it on the filesystem to measure; it is emptied first and removed after). The model
is chosen so that a save (1.5 GB: fp32 master, m and v) takes several step times here. For each run it reads
train.py's own lines: the synchronous save's "in X s, training waiting", and the background save's copy to
host memory plus the wait for its commit (together, the stall); and metrics.jsonl's step times, split into the
steps that ran while a background write was in flight and the others. Prints the medians over the saves, and
the loop's wall time each way. The last step's save is synchronous in both runs and is left out.
"""
import argparse
import contextlib
import io
import json
import os
import re
import shutil
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import model as M  # noqa: E402
import train as T  # noqa: E402

SHAPE = dict(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048)


def run(mode: str, out_dir: str, data: str, steps: int, ckpt_every: int) -> dict:
    argv = ["--model=bench-async", "--dtype=float32", "--seq_len=32", "--batch_size=1", "--micro_batch_size=1",
            "--warmup_steps=2", f"--steps={steps}", f"--ckpt_every={ckpt_every}", "--keep_ckpts=2", "--eval_every=0", f"--data={data}",
            f"--out_dir={out_dir}", f"--async_save={mode}", "--resume=never", "--overwrite=true"]
    printed = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(printed):
        T.main(argv)
    wall_s = time.perf_counter() - t0
    text = printed.getvalue()
    sys.stdout.write(text)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        step_time_s = {m["step"]: m["step_time_s"] for m in map(json.loads, f) if "step_time_s" in m}
    if mode == "false":
        stalls = [float(s) for s in re.findall(r"saved checkpoint \S+ \(in ([\d.]+) s, training waiting\)", text)][:-1]
        writing_steps = set()
    else:
        copies = [float(s) for s in re.findall(r"copied to host memory in ([\d.]+) s", text)]
        commits = [float(s) for s in re.findall(r"training waited ([\d.]+) s for its commit", text)]
        stalls = [c + w for c, w in zip(copies, commits)]
        # The steps logged between a snapshot and its commit ran beside its background write (or part of it).
        writing_steps, in_flight = set(), False
        for line in text.splitlines():
            if re.match(r"checkpoint of step \d+: copied", line):
                in_flight = True
            elif re.match(r"saved checkpoint \S+ \(written in the background", line):
                in_flight = False
            elif in_flight and re.match(r"step (\d+)/", line):
                writing_steps.add(int(re.match(r"step (\d+)/", line).group(1)))
    inside = [t for s, t in step_time_s.items() if s in writing_steps]
    outside = [t for s, t in step_time_s.items() if s not in writing_steps and s > 1]
    return dict(stall_s=statistics.median(stalls), saves=len(stalls), wall_s=wall_s,
                step_s=statistics.median(outside), step_s_while_writing=statistics.median(inside) if inside else None,
                write_s=statistics.median(float(s) for s in re.findall(r"written in the background in ([\d.]+) s", text))
                if mode == "true" else None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir", default="/tmp/async_bench")
    parser.add_argument("--steps", type=int, default=41)
    parser.add_argument("--ckpt_every", type=int, default=8)
    a = parser.parse_args()
    M.PRESETS["bench-async"] = lambda: M.ModelConfig(**SHAPE)
    shutil.rmtree(a.out_dir, ignore_errors=True)
    os.makedirs(a.out_dir)
    data = os.path.join(a.out_dir, "tok.npy")
    np.save(data, np.random.default_rng(0).integers(0, SHAPE["vocab_size"], 200_000).astype(np.uint16))
    results = {mode: run(mode, os.path.join(a.out_dir, mode), data, a.steps, a.ckpt_every) for mode in ("false", "true")}
    sync, background = results["false"], results["true"]
    print(f"\n{M.count_params(M.ModelConfig(**SHAPE))['total'] / 1e6:.0f}M parameters, W=1, {a.steps} steps, a save "
          f"every {a.ckpt_every}; medians over {sync['saves']} saves")
    print(f"  --async_save false: stall per save {sync['stall_s']:.2f} s | step {sync['step_s']:.2f} s | "
          f"loop {sync['wall_s']:.0f} s")
    print(f"  --async_save true:  stall per save {background['stall_s']:.2f} s (copy + commit) | background write "
          f"{background['write_s']:.2f} s | step {background['step_s']:.2f} s, "
          f"{background['step_s_while_writing']:.2f} s while a write runs | loop {background['wall_s']:.0f} s")
    shutil.rmtree(a.out_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
