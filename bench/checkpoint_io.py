"""Checkpoint save and load throughput, GB/s per rank, on the filesystem of --out_dir (a benchmark, not a test).

    torchrun --standalone --nproc_per_node 8 bench/checkpoint_io.py --model llama3.2-3b --out_dir /shared/ckpt_io

Every rank of the job writes its file at once, as a save does: checkpoints.save_checkpoint itself (the same file
layout, one safetensors file per rank of the fp32 master + m + v slices, 12 B/param/W, SHA-256, fsync,
rank 0's commit), three times, then loads it back three times as a resume does (SHA-256 check + sliced
reads), each file first dropped from this node's page cache (posix_fadvise DONTNEED) so that the load
reads the filesystem, as a restart on a fresh node would. Prints the best of each, timed on rank 0 after
the collective that ends it (so, the slowest rank's), and the `train.py --plan --fs_write_gbps` to pass:
the lower of the two rates, because the planner times both the stop's save and a late restart's load at
it (plan.stop_lead_time).

Run it as training runs: on --out_dir's filesystem, with training's ranks per node (torchrun
--nproc_per_node 8), on as many nodes as training where you can (torchrun --nnodes 2 --rdzv_endpoint ...:
16 writers at once on a shared filesystem), and a model big enough that a save takes tens of seconds (a
small one measures caches and latency, not bandwidth). Any train.py model flag works: a --model preset is
initialised from the seed (no Hugging Face folder needed), --init_from DIR loads one. The benchmark
refuses a folder that already holds checkpoints/ and removes what it wrote.
"""
import os
import shutil
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from components import checkpoints  # noqa: E402
import train as T  # noqa: E402


def drop_from_page_cache(path: str):
    """Ask the kernel to forget the file's cached pages (they are on disk: the save fsynced them), so the
    next read goes to the filesystem. A hint: a network filesystem's server keeps its own cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


cfg = T.parse_args(sys.argv[1:] + ["--steps=0"])
ckpt_root = os.path.join(cfg.out_dir, "checkpoints")
if os.path.exists(ckpt_root):  # every rank sees it (or --out_dir is not shared: setup says so next)
    T.fail(f"--out_dir: {ckpt_root} exists; this benchmark deletes what it writes there, so point it at "
           f"a folder without checkpoints (on the filesystem to measure)")
sharded = T.setup(cfg)[0]
mcfg, units, rank, world = sharded.model.cfg, sharded.units, sharded.rank, sharded.world
local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
save_s, load_s = [], []
for _ in range(3):
    if rank == 0:
        shutil.rmtree(ckpt_root, ignore_errors=True)
    dist.barrier()
    t0 = time.perf_counter()
    path = checkpoints.save_checkpoint(cfg, mcfg, units, 1, rank, world, None)  # ends in rank 0's broadcast
    save_s.append(time.perf_counter() - t0)
    manifest = checkpoints.check_manifest(path, None, None, None)
    drop_from_page_cache(os.path.join(path, checkpoints.rank_file(rank, world)))  # the file this rank reads back
    dist.barrier()
    t0 = time.perf_counter()
    checkpoints.load_checkpoint(path, manifest, units)
    dist.barrier()
    load_s.append(time.perf_counter() - t0)
nbytes = manifest["files"][checkpoints.rank_file(rank, world)]["bytes"]  # this rank's file, as written
if rank == 0:
    shutil.rmtree(ckpt_root, ignore_errors=True)
    save_gbps, load_gbps = nbytes / min(save_s) / 1e9, nbytes / min(load_s) / 1e9
    print(f"W={world}: {nbytes / 1e9:.3f} GB per rank | save {save_gbps:.2f} GB/s per rank "
          f"({min(save_s):.2f} s, incl. fsync and commit) | load {load_gbps:.2f} GB/s per rank "
          f"({min(load_s):.2f} s, page cache dropped, incl. SHA-256) | plan with --fs_write_gbps "
          f"{min(save_gbps, load_gbps):.2f} (the lower: the planner times the stop's save and a restart's load "
          f"at it; measured at W={world}, {local_world} per node)", flush=True)
dist.destroy_process_group()
os._exit(0)  # as train.py: no interpreter teardown after destroy_process_group
