"""Checkpoint save and load throughput, GB/s per rank (a benchmark, not a test).

    torchrun --standalone --nproc_per_node 2 bench/checkpoint_io.py --init_from DIR --out_dir /tmp/ckpt_io

Saves the state of the model in --init_from (fp32 master + m + v slices, 12 B/param/W) three times
and loads it back three times (SHA-256 verification included, as on every resume); prints the best of
each. Run bench/hf_import_memory.sh first for a 248M-parameter HF folder.
"""
import os
import shutil
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import checkpoint as C  # noqa: E402
import train as T  # noqa: E402

cfg = T.parse_args(sys.argv[1:] + ["--steps=0"])
sharded = T.setup(cfg)[0]
mcfg, units, rank, world = sharded.model.cfg, sharded.units, sharded.rank, sharded.world
nbytes = sum((1 + len(u.optimizer_state)) * u.shard_numel * 4 for u in units)
save_s, load_s = [], []
for _ in range(3):
    shutil.rmtree(os.path.join(cfg.out_dir, "checkpoints"), ignore_errors=True) if rank == 0 else None
    dist.barrier()
    t0 = time.perf_counter()
    path = C.save_checkpoint(cfg, mcfg, units, 1, rank, world, None)
    save_s.append(time.perf_counter() - t0)
    manifest = C.check_manifest(path, None, mcfg, None)
    dist.barrier()
    t0 = time.perf_counter()
    C.load_checkpoint(path, manifest, units)
    dist.barrier()
    load_s.append(time.perf_counter() - t0)
if rank == 0:
    print(f"W={world}: {nbytes / 1e9:.3f} GB per rank | save {nbytes / min(save_s) / 1e9:.2f} GB/s per rank "
          f"({min(save_s):.2f} s, incl. fsync and commit) | load {nbytes / min(load_s) / 1e9:.2f} GB/s per rank "
          f"({min(load_s):.2f} s, incl. SHA-256)")
dist.destroy_process_group()
