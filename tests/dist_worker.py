"""Run under torchrun by the tests: checks that need the trainer's internals, one JSON file per rank.

    torchrun --nproc_per_node W tests/dist_worker.py MODE OUT_DIR [train.py flags...]
MODE is `load` (how much of the checkpoint each rank reads) or `sgd` (a whole run with SGD + momentum
swapped in for AdamW; writes no JSON). Checks of the step itself run in one process (tests/ranks.py).
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as M  # noqa: E402
import train as T  # noqa: E402


def sgd_momentum_step(units, cfg, lr, step):
    """torch.optim.SGD(momentum=0.9) on the slices (no dampening, no decay): the first step's buffer is
    the gradient itself, as 0.9 * 0 + g is."""
    for u in units:
        momentum = u.optimizer_state["momentum_buffer"]
        momentum.mul_(0.9).add_(u.grad_shard)
        u.master_shard.add_(momentum, alpha=-lr)


def load(flags):
    """Counts the elements each rank reads from the safetensors files during --init_from."""
    import safetensors
    read = [0]
    real_open = safetensors.safe_open

    class CountingSlice:
        def __init__(self, s):
            self.s = s

        def get_shape(self):
            return self.s.get_shape()

        def __getitem__(self, index):
            out = self.s[index]
            read[0] += out.numel()
            return out

    class CountingFile:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def get_slice(self, name):
            return CountingSlice(self.f.get_slice(name))

        def keys(self):
            return self.f.keys()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False
    safetensors.safe_open = CountingFile
    cfg = T.parse_args(flags)
    sharded = T.setup(cfg)[0]
    units, rank, world = sharded.units, sharded.rank, sharded.world
    return dict(elements_read=read[0], shard_elements=sum(u.shard_numel for u in units),
                model_elements=sum(u.numel for u in units), rank=rank, world=world)


if __name__ == "__main__":
    mode, out_dir, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
    if mode == "sgd":  # a second optimizer, swapped in where train.py says a fork swaps it; then a whole run
        M.OPTIMIZER_STATE, T.optimizer_step = ("momentum_buffer",), sgd_momentum_step
        T.main(flags)
        os._exit(0)
    if mode == "load":
        result = load(flags)
    with open(os.path.join(out_dir, f"rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()
    os._exit(0)  # no interpreter teardown: gloo's threads can abort it (see the end of train.py)
