"""Memory the planner promises is memory the code uses: the full-unit gradients alive when the reduce-scatter
hook casts and launches a unit's gradient, counted tensor by tensor, against plan_memory.reduce_hook_bytes.

Run as a script under torchrun by the test (one JSON file per rank):
    torchrun --nproc_per_node 2 tests/test_memory.py OUT_DIR [train.py flags...]
"""
import json
import os
import sys

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import run_script  # noqa: E402

# The moments the hook holds the most: right after the cast, and as it allocates the reduce-scatter's output.
HOOK_MOMENTS = {torch.ops.aten._to_copy.default, torch.ops.aten.empty.memory_format}


class LiveUnitGradients(TorchDispatchMode):
    """Sees the output of every op (autograd's backward ops included) and remembers, weakly, each storage
    the size of a whole unit; `measuring` turns on counting the bytes of those still alive at HOOK_MOMENTS.
    A weak reference to the storage itself: whoever holds it (Python, autograd, a collective) keeps it alive."""

    def __init__(self):
        super().__init__()
        self.unit_numels = set()
        self.storages = {}     # data_ptr -> (weak reference, bytes)
        self.measuring = False
        self.most_alive = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # New memory only: a view or an in-place result shares its input's storage (a weight piece of a
        # gathered buffer can be the size of another unit).
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() in self.unit_numels:
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs:
                    self.storages[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        if self.measuring and func in HOOK_MOMENTS:
            alive = sum(nbytes for ref, nbytes in self.storages.values() if not ref.expired())
            self.most_alive = max(self.most_alive, alive)
        return out


def worker(out_dir, flags):
    import torch.distributed as dist
    import train as T
    tracker, hooks = LiveUnitGradients(), []
    original_hook = T.reduce_scatter_grad

    def measured_hook(unit, reduces_in_flight, reduce_dtype, gathered):
        tracker.measuring, tracker.most_alive = True, 0
        original_hook(unit, reduces_in_flight, reduce_dtype, gathered)
        tracker.measuring = False
        hooks.append(dict(unit=unit.name, numel=unit.padded_numel, most_alive_bytes=tracker.most_alive))
    T.reduce_scatter_grad = measured_hook  # before setup: ShardedModel registers the hook it finds then
    cfg = T.parse_args(flags)
    sharded, windows = T.setup(cfg)[:2]
    units, rank = sharded.units, sharded.rank
    tracker.unit_numels = {u.padded_numel for u in units}
    with tracker:
        T.forward_backward(cfg, sharded, windows, 1, 0)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(dict(hooks=hooks, n_units=len(units), unit_numels=sorted(tracker.unit_numels)), f)
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype,reduce_dtype", [("bfloat16", "float32"), ("float32", "float32")])
def test_gradients_alive_in_the_reduce_hook_are_what_the_planner_counts(tmp_path, dtype, reduce_dtype):
    import numpy as np
    from tools import plan as P
    from tools import plan_memory as PM
    np.save(tmp_path / "tok.npy", (np.arange(400) * 7 % 500).astype(np.uint16))
    flags = ["--model=tiny", f"--data={tmp_path / 'tok.npy'}", "--seq_len=16", "--batch_size=4",
             "--micro_batch_size=1", "--ac=none", "--eval_every=0", f"--dtype={dtype}",
             f"--reduce_dtype={reduce_dtype}", f"--out_dir={tmp_path}"]
    proc = run_script(os.path.abspath(__file__), [str(tmp_path), *flags], nproc=2)
    assert proc.returncode == 0, proc.stderr[-5000:]
    compute_bytes, reduce_bytes = (getattr(torch, d).itemsize for d in (dtype, reduce_dtype))
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            r = json.load(f)
        # Every unit's hook ran once per micro-batch (2 of them): head first, blocks, embedding last.
        assert len(r["hooks"]) == 2 * r["n_units"] and r["hooks"][0]["unit"] == "head"
        for hook in r["hooks"]:
            # Nothing but this unit's gradient (and its copy in the reduce dtype): the previous unit's
            # reduce-scatter, with its whole gradient, is finished before the cast.
            expected = PM.reduce_hook_bytes(hook["numel"], compute_bytes, reduce_bytes)
            assert hook["most_alive_bytes"] == expected, (hook, expected)


def test_offload_prefetches_the_previous_blocks_input_and_keeps_the_gradients(monkeypatch):
    """--offload_activations on the CPU: each block's backward starts the copy back of the block before it
    (on CUDA it overlaps this block's recompute); gradients equal --ac full's, bit for bit."""
    import model as M
    from components import offload as O
    from common import small_config
    from torch.utils.checkpoint import checkpoint
    cfg = small_config(n_layers=3)
    torch.manual_seed(0)
    model = M.Llama(cfg).float()
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    cos, sin = M.rope_cos_sin(cfg, torch.arange(16).expand(2, 16), torch.float32)
    events, saved = [], []

    class NumberedInput(O.OffloadedInput):  # numbered by the block that saved it
        def __init__(self, host, previous):
            super().__init__(host, previous)
            self.block = len(saved) % cfg.n_layers
            saved.append(self)
    monkeypatch.setattr(O, "OffloadedInput", NumberedInput)
    start_copy_back = O.OffloadedCheckpoint.start_copy_back

    def recorded_copy_back(inp, device):
        events.append(("copy back", inp.block, "starts" if inp.device is None else "started already"))
        start_copy_back(inp, device)
    monkeypatch.setattr(O.OffloadedCheckpoint, "start_copy_back", staticmethod(recorded_copy_back))

    def loss(wrap):
        h = model.embed(tokens)
        for i, block in enumerate(model.layers):
            def run(x, i=i, block=block):
                events.append(("run", i))
                return block(x, cos, sin, None)
            h = wrap(run, h)
        return model.head_loss(h, tokens)["ce"]

    def gradients():
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        return grads
    loss(lambda run, h: checkpoint(run, h, use_reentrant=False)).backward()
    full_ac = gradients()
    offloaded = lambda run, h: O.OffloadedCheckpoint.apply(h, run)  # noqa: E731
    expected = [("run", 0), ("run", 1), ("run", 2),                                            # forward
                ("copy back", 2, "starts"), ("copy back", 1, "starts"), ("run", 2),                  # block 2
                ("copy back", 1, "started already"), ("copy back", 0, "starts"), ("run", 1),         # block 1
                ("copy back", 0, "started already"), ("run", 0)]                                     # block 0
    first = loss(offloaded)
    events.clear()
    first.backward()
    assert events == expected[3:]
    assert all(torch.equal(a, b) for a, b in zip(gradients(), full_ac))
    # A second micro-batch while the first one's graph is still referenced (as forward_backward's `loss`):
    # its first block has no previous input to prefetch.
    events.clear()
    loss(offloaded).backward()
    assert events == expected
    assert all(torch.equal(a, b) for a, b in zip(gradients(), full_ac))
    with torch.no_grad():  # evaluation: no backward will come, nothing is kept
        loss(offloaded)
    assert len(saved) == 2 * cfg.n_layers and O.OffloadedCheckpoint.latest is None


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2:])
    os._exit(0)  # no interpreter teardown: gloo's threads can abort it (see the end of train.py)
