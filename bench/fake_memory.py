"""Peak GPU memory of the README's recipes at their real shapes, measured under fake CUDA, against plan.py.

    python bench/fake_memory.py [--only two-node,one-node,8b] [--flash both|on|off] [--json OUT]
                                [--build_dir DIR]
    python bench/fake_memory.py --gpu_bench h100:8,h200:1   # bench/gpu.py's runs: bench/gpu_fake_memory.json

Each recipe runs one optimizer step of train.py's own ShardedModel and train_step as rank 0 of its W, in
a fresh process, on a CPU-only torch (tests/fake_cuda.py: no tensor has memory, no kernel runs; device
bytes are counted as torch.cuda.memory_allocated counts them). MEASURED UNDER FAKE CUDA, NOT ON A GPU:
what the trainer allocates, tensor by tensor, with the attention kernels' choice and their scratch memory
modelled (tests/fake_cuda.py says how); not the CUDA context, NCCL's buffers or the caching allocator's
fragmentation, which the planner adds as assumptions (plan.ASSUMPTIONS) and this report adds the same way
to say whether the recipe fits.

Recipes: the two-node 70B recipe exactly as launch.sbatch's TRAIN_ARGS give it, the one-node 70B offload
recipe exactly as the README's `./launch.sh` command gives it (--init_from Meta-Llama-3-70B-Instruct is
the llama3-70b preset), and Llama-3-8B at seq 8192 on 8 GPUs with the defaults otherwise. "flash on":
with the flash_attn stand-in (the planner's assumption); "off": SDPA, whose memory-efficient kernel runs
--doc_mask with K/V expanded and a T x T mask.
"""
import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import fake_cuda  # noqa: E402
from tools import plan as P  # noqa: E402
from train import TrainConfig  # noqa: E402

GIB = 2**30


def sbatch_recipe() -> tuple[list[str], int]:
    """launch.sbatch's TRAIN_ARGS and its world size (nodes x GPUs per node)."""
    with open(os.path.join(ROOT, "launch.sbatch")) as f:
        text = f.read()
    args = shlex.split(text.split("TRAIN_ARGS=(")[1].split(")")[0], comments=True)
    setting = {line.split("=")[0][len("#SBATCH --"):]: line.split("=")[1].strip()
               for line in text.splitlines() if line.startswith("#SBATCH --") and "=" in line}
    return args, int(setting["nodes"]) * int(setting["gpus-per-node"])


def readme_one_node_recipe() -> tuple[list[str], int]:
    """docs/operations.md's one-node command (`./launch.sh --init_from ... --offload_optimizer true ...`), W = 8."""
    with open(os.path.join(ROOT, "docs", "operations.md")) as f:
        readme = f.read()
    commands = ["--init_from" + c.split("\n\n")[0] for c in readme.split("    ./launch.sh --init_from")[1:]]
    command = next(c for c in commands if "--offload_optimizer true" in c)
    return shlex.split(command.replace("\\\n", " ")), 8


def as_preset(args: list[str]) -> list[str]:
    """--init_from Meta-Llama-3-70B-Instruct is the llama3-70b preset (no file is read)."""
    if "--init_from" not in args:
        return args
    i = args.index("--init_from")
    return args[:i] + ["--model", "llama3-70b"] + args[i + 2:]


def recipes() -> dict:
    two_node, w2 = sbatch_recipe()
    one_node, w1 = readme_one_node_recipe()
    return {"two-node": ("70B, 2 x 8 H100: launch.sbatch", as_preset(two_node), w2),
            "one-node": ("70B, 1 x 8 H100, optimizer offload: docs/operations.md", as_preset(one_node), w1),
            "8b": ("Llama-3-8B, 8 GPUs, seq 8192, defaults", ["--model", "llama3-8b", "--seq_len", "8192",
                                                            "--batch_size", "16", "--micro_batch_size", "1"], 8)}


def gpu_bench_rows(spec: str, flash: bool, shim: str, tmp: str) -> list[dict]:
    """bench/gpu.py's eager runs of ours as it would time them on `spec` = GPU:W[:LAYERS] (layers: as many as
    gpu.py chooses for that GPU's memory), measured under fake CUDA; gpu.py prints them beside its peaks."""
    import dataclasses
    import gpu as G  # bench/gpu.py: its flags and layer choice, not a copy of them
    gpu, world, *layers = spec.split(":")
    world, seq_len = int(world), 8192
    layers = int(layers[0]) if layers else G.layers_that_fit(seq_len, world, P.GPUS[gpu]["memory_mib"] * 2**20, gpu)
    model_json = json.dumps(dataclasses.asdict(G.bench_model(layers, dry=False)))
    rows = []
    for name in G.ours_runs(world):
        flags = G.ours_flags("OUT_DIR", "TOKENS", seq_len, world, G.ACCUM, G.WARMUP + 5, "cuda", G.OURS_RUNS[name])
        r = fake_cuda.run(shim, os.path.join(tmp, "out.json"), flags, world, flash=flash, model_json=model_json)
        rows.append(dict(run=name, gpu=gpu, layers=layers, seq_len=seq_len, world=world, flash=flash, flags=flags,
                         measured_gib=r["peak_bytes"] / GIB, planned_gib=r["plan"]["allocated_bytes"] / GIB,
                         measured_at=max(r["peak_by_phase"], key=r["peak_by_phase"].get)))
        print(f"gpu.py on {spec}: {name:32} flash {'on ' if flash else 'off'} {layers} layers W={world}: "
              f"{rows[-1]['measured_gib']:.2f} GiB measured, {rows[-1]['planned_gib']:.2f} planned", flush=True)
    return rows


def margins(r: dict) -> dict:
    """The measured peak with what torch does not count added as the planner adds it: CUDA context and
    NCCL (an assumption), and allocator fragmentation on everything but the persistent state."""
    context = TrainConfig().outside_gib * GIB  # --outside_gib's default, an assumption
    fragmentation = P.ASSUMPTIONS["fragmentation"] * (r["peak_bytes"] - r["state_bytes"])
    total = r["peak_bytes"] + context + fragmentation
    usable = P.GPUS["h100"]["memory_mib"] * 2**20
    return dict(with_margins_gib=total / GIB, usable_gib=usable / GIB, fits=total <= usable,
                headroom_gib=(usable - total) / GIB)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="two-node,one-node,8b")
    parser.add_argument("--flash", default="both", choices=("both", "on", "off"))
    parser.add_argument("--json", default="")
    parser.add_argument("--gpu_bench", default="", metavar="GPU:W[:LAYERS],...", help="instead of the recipes: "
                        "bench/gpu.py's runs on these GPUs (plan.GPUS keys) and W, merged into bench/gpu_fake_memory.json")
    parser.add_argument("--build_dir", default=os.path.join(os.path.expanduser("~"), ".cache", "llama-zero3"))
    args = parser.parse_args()
    shim = fake_cuda.build_shim(args.build_dir)
    flashes = {"both": (True, False), "on": (True,), "off": (False,)}[args.flash]
    if args.gpu_bench:
        return write_gpu_bench(args.gpu_bench, flashes, shim)
    rows, table = [], recipes()
    print(f"measured under fake CUDA, not on a GPU | {datetime.date.today()} | {platform.node()} | "
          f"{platform.processor() or platform.machine()}", flush=True)
    print(f"{'recipe':46} {'flash':5} {'W':>3} {'measured GiB':>12} {'plan GiB':>9} {'ratio':>6} "
          f"{'+ margins':>9} {'fits 80GB':>9} {'peak at':>22} {'s':>5}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            title, flags, world = table[name]
            for flash in flashes:
                t0 = time.time()
                r = fake_cuda.run(shim, os.path.join(tmp, "out.json"), flags, world, flash=flash)
                m = margins(r)
                where = max(r["peak_by_phase"], key=r["peak_by_phase"].get)
                row = dict(recipe=name, title=title, flags=flags, world=world, flash=flash,
                           measured_gib=r["peak_bytes"] / GIB, planned_gib=r["plan"]["allocated_bytes"] / GIB,
                           ratio=r["peak_bytes"] / r["plan"]["allocated_bytes"], planned_phase=r["plan"]["peak_phase"],
                           measured_at=where, alive_at_peak_gib=[[n / GIB, label] for n, label in r["alive_at_peak"]],
                           seconds=time.time() - t0, **m)
                rows.append(row)
                print(f"{title:46} {'on' if flash else 'off':5} {world:3d} {row['measured_gib']:12.2f} "
                      f"{row['planned_gib']:9.2f} {row['ratio']:6.3f} {m['with_margins_gib']:9.2f} "
                      f"{'yes' if m['fits'] else 'NO':>9} {where:>22} {row['seconds']:5.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def write_gpu_bench(specs: str, flashes, shim: str):
    """Measures each spec and keeps them in bench/gpu_fake_memory.json, replacing rows of the same key."""
    import gpu as G
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in specs.split(","):
            for flash in flashes:
                rows += gpu_bench_rows(spec, flash, shim, tmp)
    new = {G.fake_memory_key(r) for r in rows}
    old = json.load(open(G.FAKE_MEMORY_JSON)) if os.path.exists(G.FAKE_MEMORY_JSON) else []
    for r in rows:
        r["date"] = str(datetime.date.today())
    with open(G.FAKE_MEMORY_JSON, "w") as f:
        json.dump([r for r in old if G.fake_memory_key(r) not in new] + rows, f, indent=1)


if __name__ == "__main__":
    main()
