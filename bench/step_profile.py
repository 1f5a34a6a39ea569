"""Three CPU measurements of the sharded step: prefetch on vs off, what each --ac policy keeps, and what
train.py's profiler ranges cost when no profiler runs.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/step_profile.py prefetch [--rounds 5]
    python bench/step_profile.py ac
    OMP_NUM_THREADS=1 python bench/step_profile.py ranges [--rounds 10] [--model tiny|bench]

ranges: one process (W = 1), rounds of steps alternating train.py's record_function ranges as they are and
replaced by a no-op (train.record_function is looked up at each call), median step time of each; and, since
a difference of microseconds drowns in a shared machine's noise, the cost of one range entered and left
(no profiler running) times the ranges one step enters, counted.

prefetch: one run at W = 2 (gloo), alternating rounds of steps with --prefetch true and false in the
same processes (train_step reads cfg.prefetch each step), so both see the same machine load. Median
step time of each.

ac: for each policy, a fresh process at W = 1 (a ~20M-parameter Llama, fp32, seq 1024, micro-batch 2)
measures (1) the bytes autograd saves for backward, through torch.autograd.graph.saved_tensors_hooks
(unique storages, the gathered parameter buffers excluded), which sees everything for `none` but not
what torch.utils.checkpoint keeps by itself (the block inputs, and selective's saved op outputs); (2) the
resident memory the forward leaves for backward and the step's peak, from /proc/self/status with glibc
told to return every block >= 64 KiB to the OS (MALLOC_MMAP_THRESHOLD_), so that resident memory follows
live tensors. (1) and (2) agree for `none`, which is what makes (2) trustworthy for the other two.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from components import hf  # noqa: E402
import model as M  # noqa: E402
from components import offload as O  # noqa: E402
import train as T  # noqa: E402

MODEL = dict(vocab_size=8192, dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=1024, max_seq_len=2048)


def write_inputs(folder: str, seq_len: int) -> tuple[str, str]:
    """An HF-style config.json for the model above (random init from it) and random tokens without EOS."""
    from transformers import LlamaConfig, LlamaForCausalLM
    mcfg = M.ModelConfig(**MODEL, bos_id=1, eos_id=2)
    init = os.path.join(folder, "init")
    if not os.path.isdir(init):
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**hf.config_to_hf(mcfg, torch.float32))).save_pretrained(init)
    tokens = os.path.join(folder, "tokens.npy")
    np.save(tokens, np.random.default_rng(0).integers(3, MODEL["vocab_size"], 200 * seq_len).astype(np.uint16))
    return init, tokens


def status_kib(key: str) -> int:
    return int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1])


def setup(flags: list):
    cfg = T.parse_args(flags)
    sharded, windows = T.setup(cfg)[:2]
    return cfg, sharded, windows


def alternating_step_times(cfg, sharded, windows, rounds: int, steps_per_round: int, switch, first_step: int) -> dict:
    """Step times with switch(True) and with switch(False), in alternating rounds of steps_per_round steps in the
    same processes, so both see the same machine load; round 0 warms up both and is not kept. The steps continue
    from `first_step` done. Returns {True: [s, ...], False: [s, ...]}."""
    times_s = {True: [], False: []}
    step = first_step
    for r in range(rounds + 1):
        for on in (True, False):
            switch(on)
            for _ in range(steps_per_round):
                t0 = time.perf_counter()
                T.train_step(cfg, sharded, windows, step + 1, step * cfg.batch_size)
                if r:
                    times_s[on].append(time.perf_counter() - t0)
                step += 1
    return times_s


def run_prefetch(folder: str, rounds: int, steps_per_round: int):
    cfg, sharded, windows = setup([
        f"--init_from={folder}/init", f"--data={folder}/tokens.npy", "--seq_len=512", "--batch_size=8",
        "--micro_batch_size=4", "--dtype=float32", "--ac=none", "--doc_mask=false", f"--out_dir={tempfile.gettempdir()}/step_profile_{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}",  # one for all ranks
        "--resume=never", "--overwrite=true"])
    def switch(prefetch):
        sharded.prefetch = prefetch
    times_s = alternating_step_times(cfg, sharded, windows, rounds, steps_per_round, switch, first_step=0)
    world, mcfg = sharded.world, sharded.model.cfg
    if sharded.rank == 0:
        on, off = statistics.median(times_s[True]), statistics.median(times_s[False])
        tokens = cfg.batch_size * cfg.seq_len
        print(f"W={world}, {M.count_params(mcfg)['total'] / 1e6:.1f}M params, fp32, micro 4 x 512, "
              f"{rounds} rounds x {steps_per_round} steps each way, alternating")
        print("| --prefetch | median step s | tokens/s per rank |\n|---|---:|---:|")
        for name, t in (("true", on), ("false", off)):
            print(f"| {name} | {t:.3f} | {tokens / t / world:,.0f} |")
        print(f"prefetch on / off step time: {on / off:.3f}")
    torch.distributed.destroy_process_group()


def measure_ac(folder: str, ac: str) -> dict:
    """One policy, in this (fresh) process: saved-tensor bytes, resident memory after forward, peak."""
    cfg, sharded, windows = setup([
        f"--init_from={folder}/init", f"--data={folder}/tokens.npy", "--seq_len=1024", "--batch_size=2",
        "--micro_batch_size=2", "--dtype=float32", f"--ac={ac}", "--doc_mask=false", "--prefetch=false",
        f"--out_dir={folder}/out-{ac}", "--resume=never", "--overwrite=true"])
    units = sharded.units
    T.train_step(cfg, sharded, windows, 1, 0)  # warm-up
    gathered = {u.gathered.untyped_storage().data_ptr() for u in units}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in gathered and storage.nbytes():
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    batch = T.micro_batches(cfg, sharded, windows, cfg.batch_size)[0]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak
    before_kib = status_kib("VmRSS")
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = sharded.loss(batch)
    after_forward_kib = status_kib("VmRSS")
    head = units[-1].padded_numel * 4  # the head stays gathered for its backward: not an activation
    loss.backward()
    T.finish_reduces(sharded.reduces_in_flight)
    if cfg.offload_optimizer:
        O.finish_host_adds(sharded.host_adds)
    step_s = time.perf_counter() - t0
    tokens = cfg.micro_batch_size * cfg.seq_len
    return dict(ac=ac, saved_by_hooks_bytes=sum(saved.values()),
                kept_after_forward_bytes=(after_forward_kib - before_kib) * 1024 - head,
                peak_over_start_bytes=(status_kib("VmHWM") - before_kib) * 1024, fwd_bwd_s=step_s, tokens=tokens,
                n_layers=sharded.model.cfg.n_layers)


def ac_main():
    folder = tempfile.mkdtemp(prefix="step_profile_")
    write_inputs(folder, 1024)
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    rows = []
    for ac in ("none", "selective", "full"):
        proc = subprocess.run([sys.executable, __file__, "ac-one", folder, ac], capture_output=True, text=True,
                              env=env, check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    mib = 2 ** 20
    print(f"W=1, {rows[0]['n_layers']} blocks, fp32, micro-batch 2 x 1024 tokens, CPU")
    print("| --ac | saved via hooks MiB | kept after forward MiB | per block per token B | peak MiB | fwd+bwd s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        per_block_token = r["kept_after_forward_bytes"] / r["n_layers"] / r["tokens"]
        print(f"| {r['ac']} | {r['saved_by_hooks_bytes'] / mib:.0f} | {r['kept_after_forward_bytes'] / mib:.0f} | "
              f"{per_block_token:,.0f} | {r['peak_over_start_bytes'] / mib:.0f} | {r['fwd_bwd_s']:.2f} |")


class NoRange:
    """record_function's stand-in for the step without ranges."""

    def __init__(self, name):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_ranges(folder: str, rounds: int, model: str, steps_per_round: int = 3):
    flags = [f"--data={folder}/tokens.npy", "--seq_len=512" if model == "bench" else "--seq_len=64",
             "--batch_size=4", "--micro_batch_size=2", "--dtype=float32", f"--out_dir={folder}/out",
             "--resume=never", "--overwrite=true"]
    cfg, sharded, windows = setup(flags + ([f"--init_from={folder}/init"] if model == "bench" else ["--model=tiny"]))
    real = T.record_function
    entered = []

    def counting(name):
        entered.append(name)
        return NoRange(name)
    T.record_function = counting
    T.train_step(cfg, sharded, windows, 1, 0)
    per_step = len(entered)
    def switch(ranges):
        T.record_function = real if ranges else NoRange
    times_s = alternating_step_times(cfg, sharded, windows, rounds, steps_per_round, switch, first_step=1)
    T.record_function = real
    n = 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        with real("gather layers.3 (issue)"):
            pass
    range_s = (time.perf_counter() - t0) / n
    on, off = statistics.median(times_s[True]), statistics.median(times_s[False])
    mcfg = sharded.model.cfg
    print(f"W=1, {M.count_params(mcfg)['total'] / 1e6:.1f}M params ({model}), fp32, 2 micro-batches of 2 x "
          f"{cfg.seq_len}, {rounds} rounds x {steps_per_round} steps each way, alternating; torch {torch.__version__}")
    print("| ranges | median step s |\n|---|---:|")
    print(f"| as in train.py | {on:.4f} |\n| no-op | {off:.4f} |")
    print(f"with / without: {on / off:.4f}; one range entered and left without a profiler: {range_s * 1e6:.2f} us, "
          f"x {per_step} ranges per step = {per_step * range_s * 1e3:.3f} ms = {100 * per_step * range_s / off:.3f}% "
          f"of the step")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "prefetch":
        rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 5
        # each rank writes the same seeded inputs into its own folder: nothing to coordinate
        folder = tempfile.mkdtemp(prefix=f"step_profile_rank{os.environ.get('RANK', '0')}_")
        write_inputs(folder, 512)
        run_prefetch(folder, rounds, steps_per_round=3)
    elif sys.argv[1] == "ranges":
        rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 10
        model = sys.argv[sys.argv.index("--model") + 1] if "--model" in sys.argv else "tiny"
        folder = tempfile.mkdtemp(prefix="step_profile_ranges_")
        if model == "bench":
            write_inputs(folder, 512)
        else:  # the tiny preset's vocabulary
            np.save(f"{folder}/tokens.npy", np.random.default_rng(0).integers(3, 512, 200 * 512).astype(np.uint16))
        run_ranges(folder, rounds, model)
    elif sys.argv[1] == "ac-one":
        print(json.dumps(measure_ac(sys.argv[2], sys.argv[3])))
        torch.distributed.destroy_process_group()
    else:
        ac_main()
    sys.stdout.flush()
    os._exit(0)
