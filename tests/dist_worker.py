"""Run under torchrun by the tests: checks that need the trainer's internals, one JSON file per rank.

    torchrun --nproc_per_node W tests/dist_worker.py MODE OUT_DIR [train.py flags...]
MODE is `memory` (what each rank holds during and after a step), `ac` (gradients under each --ac),
`naive` (train_step against train_step_naive), `load` (how much of the checkpoint each rank reads) or
`sgd` (a whole run with SGD + momentum swapped in for AdamW; writes no JSON).
"""
import gc
import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train as T  # noqa: E402


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable by the garbage collector."""
    seen, total = set(), 0
    warnings.simplefilter("ignore", FutureWarning)  # isinstance() pokes deprecated torch attributes
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
            storage = obj.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def memory(cfg, sharded, windows):
    units, model = sharded.units, sharded.model
    most_gathered = [0]
    original_start = T.Unit.start_gather

    def counting_start(self):
        original_start(self)
        most_gathered[0] = max(most_gathered[0], sum(u.state() != "free" for u in units))
    T.Unit.start_gather = counting_start
    most_reduces = [0]
    original_finish = T.finish_reduces

    def counting_finish(reduces_in_flight, keep=0):
        most_reduces[0] = max(most_reduces[0], len(reduces_in_flight))
        original_finish(reduces_in_flight, keep)
    T.finish_reduces = counting_finish
    for step in (1, 2):
        T.train_step(cfg, sharded, windows, step, (step - 1) * cfg.batch_size)
    gc.collect()
    return dict(
        persistent_bytes=sum(u.persistent_bytes() for u in units),
        padded_numel=sum(u.padded_numel for u in units), numel=sum(u.numel for u in units),
        shard_numel=[u.shard_numel for u in units],
        gathered_after_step=[u.name for u in units if u.state() != "free" or u.gathered.grad is not None],
        module_tensor_bytes=sum(t.untyped_storage().nbytes() for t in list(model.parameters()) + list(model.buffers())),
        live_tensor_bytes=live_tensor_bytes(), most_gathered_at_once=most_gathered[0],
        most_reduces_in_flight=most_reduces[0], n_units=len(units),
        largest_unit_numel=max(u.padded_numel for u in units))


def ac(cfg, sharded, windows):
    units = sharded.units
    grads = {}
    modes = {"none": ("none", False, -1, "none"), "full": ("full", False, -1, "none"),
             "selective": ("selective", False, -1, "none"), "offload": ("full", True, -1, "none"),
             # partial checkpointing (--ac_blocks N --ac_rest R): the first N blocks --ac, the others R
             "full 2 + none": ("full", False, 2, "none"), "offload 1 + selective": ("full", True, 1, "selective"),
             "selective 3 + none": ("selective", False, 3, "none")}
    for mode, (policy, offload, ac_blocks, ac_rest) in modes.items():
        sharded.stages = T.make_stages(sharded.model, units, policy, cfg.ce_chunk, offload, ac_blocks, ac_rest)
        loss, _ = T.forward_backward(cfg, sharded, windows, 1, 0)
        grads[mode] = ([u.grad_shard.clone() for u in units], loss.item())
        for u in units:
            u.grad_shard.zero_()
    base = grads["none"][0]
    return {mode: dict(loss=loss, grad_sq=sum(g.double().pow(2).sum().item() for g in gs),
                       max_abs_diff=max((g - b).abs().max().item() for g, b in zip(gs, base)))
            for mode, (gs, loss) in grads.items()}


def naive(cfg, sharded, windows):
    """train_step and train_step_naive, three steps each from the same weights: what each returns and
    this rank's slices after them (and before, to show the steps moved them)."""
    units = sharded.units
    start = [[u.master_shard.clone()] + [t.clone() for t in u.optimizer_state.values()] for u in units]
    result = dict(start=[u.master_shard.tolist() for u in units])
    def naive_step(cfg, sharded, windows, step, position):
        return T.train_step_naive(cfg, sharded.units, sharded.model, T.micro_batches(cfg, sharded, windows, position), step)
    for name, step_fn in (("real", T.train_step), ("naive", naive_step)):
        for u, saved in zip(units, start):
            for t, value in zip([u.master_shard, *u.optimizer_state.values()], saved):
                t.copy_(value)
        log = [step_fn(cfg, sharded, windows, step, (step - 1) * cfg.batch_size) for step in (1, 2, 3)]
        result[name] = dict(log=log, master=[u.master_shard.tolist() for u in units],
                            grads_zero=all(not u.grad_shard.any() for u in units))
    return result


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
        T.OPTIMIZER_STATE, T.optimizer_step = ("momentum_buffer",), sgd_momentum_step
        T.main(flags)
        os._exit(0)
    if mode == "load":
        result = load(flags)
    else:
        cfg = T.parse_args(flags)
        sharded, windows, _, _, _ = T.setup(cfg)
        result = {"memory": memory, "ac": ac, "naive": naive}[mode](cfg, sharded, windows)
    with open(os.path.join(out_dir, f"rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()
    os._exit(0)  # no interpreter teardown: gloo's threads can abort it (see the end of train.py)
