"""Checkpoint save and load throughput, GB/s per rank, on the filesystem of --out_dir (a benchmark, not a test).

    torchrun --standalone --nproc_per_node 8 bench/checkpoint_io.py --model llama3.2-3b --out_dir /shared/ckpt_io

Saves a model's training state (fp32 master + m + v slices, 12 B/param/W) with checkpoint.save_checkpoint
three times and loads it back three times (SHA-256 verification included, as on every resume); prints the
best of each. Any train.py model flag works: a --model preset is initialised from the seed (no Hugging Face
folder needed), --init_from DIR loads one. Point --out_dir at the filesystem your runs write to, with as
many ranks per node as training has (they write at once), and a model big enough that a save takes
seconds: the save's GB/s per rank is what `train.py --plan --fs_write_gbps` wants. The benchmark refuses
a folder that already holds checkpoints/ and removes what it wrote.
"""
import os
import shutil
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import disk  # noqa: E402
import train as T  # noqa: E402

cfg = T.parse_args(sys.argv[1:] + ["--steps=0"])
ckpt_root = os.path.join(cfg.out_dir, "checkpoints")
if os.path.exists(ckpt_root):  # every rank sees it (or --out_dir is not shared: setup says so next)
    T.fail(f"--out_dir: {ckpt_root} exists; this benchmark deletes what it writes there, so point it at "
           f"a folder without checkpoints (on the filesystem to measure)")
sharded = T.setup(cfg)[0]
mcfg, units, rank, world = sharded.model.cfg, sharded.units, sharded.rank, sharded.world
save_s, load_s = [], []
for _ in range(3):
    if rank == 0:
        shutil.rmtree(ckpt_root, ignore_errors=True)
    dist.barrier()
    t0 = time.perf_counter()
    path = disk.save_checkpoint(cfg, mcfg, units, 1, rank, world, None)
    save_s.append(time.perf_counter() - t0)
    manifest = disk.check_manifest(path, None, mcfg, None)
    dist.barrier()
    t0 = time.perf_counter()
    disk.load_checkpoint(path, manifest, units)
    dist.barrier()
    load_s.append(time.perf_counter() - t0)
nbytes = manifest["files"][disk.rank_file(rank, world)]["bytes"]  # this rank's file, as written
if rank == 0:
    shutil.rmtree(ckpt_root, ignore_errors=True)
    save_gbps = nbytes / min(save_s) / 1e9
    print(f"W={world}: {nbytes / 1e9:.3f} GB per rank | save {save_gbps:.2f} GB/s per rank "
          f"({min(save_s):.2f} s, incl. fsync and commit) | load {nbytes / min(load_s) / 1e9:.2f} GB/s per rank "
          f"({min(load_s):.2f} s, incl. SHA-256) | plan with --fs_write_gbps {save_gbps:.2f} "
          f"(at W={world}, {int(os.environ.get('LOCAL_WORLD_SIZE', 1))} per node)", flush=True)
dist.destroy_process_group()
os._exit(0)  # as train.py: no interpreter teardown after destroy_process_group
