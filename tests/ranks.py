"""Several ranks in one process, one thread each, on torch's threaded process group (the one torch's own
distributed tests use). No torchrun and no subprocess: a breakpoint in train.py's train_step stops rank 0's
thread in a debugger (`pytest tests/test_sharding.py -k naive --pdb`, or `breakpoint()` in the code).

For tests of the step itself. The out_dir, checkpoints and the launcher are tested through torchrun (one
process per rank), because there the processes are the point."""
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch.testing._internal.distributed import multi_threaded_pg

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as M  # noqa: E402
from components import checks  # noqa: E402
from components import offload as O  # noqa: E402
from components import run_data  # noqa: E402
import train as T  # noqa: E402


def run_ranks(world: int, fn) -> list:
    """fn(rank) on ranks 0 .. world-1, each in its own thread, inside one process group of `world` ranks.
    Returns [fn(0), fn(1), ...]. An exception on any rank stops the others' collectives and is raised here."""
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # each thread registers its own group names
    multi_threaded_pg._install_threaded_pg()
    store, results, errors = dist.HashStore(), [None] * world, []

    def rank_main(rank: int):
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: B036 -- reported below; the other ranks must not wait for this one
            errors.append((rank, e))
            multi_threaded_pg.ProcessLocalGroup.exception_handle(e)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    threads = [threading.Thread(target=rank_main, args=(rank,), name=f"rank{rank}") for rank in range(world)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        multi_threaded_pg.ProcessLocalGroup.reset()
        multi_threaded_pg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    real = [(rank, e) for rank, e in errors if not isinstance(e, SystemExit)]  # SystemExit: stopped by another
    if real:
        raise real[0][1]
    return results


def config_and_data(flags: list[str]):
    """The config, model config and training windows train.setup would make, made once in the calling thread
    (the built-in sample is built there, not by W threads at once)."""
    cfg = T.parse_args(flags)
    mcfg, weights, errors = checks.check_run(cfg, 1)
    assert not errors, errors
    mcfg, windows, _ = run_data.open_data(cfg, mcfg)
    return cfg, mcfg, weights, windows


def sharded_model(cfg, mcfg, weights) -> T.ShardedModel:
    """This rank's ShardedModel with its first weights (seeded, or its shards of --init_from), as train.setup
    makes it (inside run_ranks: the rank and world come from the thread's group)."""
    sharded = T.build_sharded_model(cfg, mcfg, dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    T.hf.init_weights(cfg, mcfg, sharded.units, weights)
    if cfg.offload_optimizer:
        O.refresh_compute_shards(sharded.units)
    return sharded
