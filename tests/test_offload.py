"""--offload_optimizer: the fp32 master shards, optimizer state and gradient accumulators in host memory,
the optimizer on the CPU, a compute-dtype copy of the shards on the device. On CPU the arithmetic must be
the same bit for bit as without it, at any W, and checkpoints must move between the two either way."""
import os
import re

import pytest
from common import model_and_tokens, read_metrics, run_train, small_config, stopped_at

BASE = ["--seq_len=16", "--batch_size=12", "--micro_batch_size=2", "--dtype=float32", "--steps=6", "--lr=3e-3",
        "--warmup_steps=2", "--seed=1", "--ckpt_every=3", "--eval_every=0"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return model_and_tokens(tmp_path_factory.mktemp("offload"))


@pytest.fixture(scope="module")
def plain(files, tmp_path_factory):
    """Without offload, W=2, 6 steps, saves at 3 and 6, exported."""
    out = tmp_path_factory.mktemp("plain")
    run_train(BASE + files + [f"--out_dir={out}", f"--export_hf={out / 'hf'}"], nproc=2)
    return out


@pytest.fixture(scope="module")
def offloaded(files, tmp_path_factory):
    """The same run with --offload_optimizer: its stdout, and its out_dir (checkpoints at 3 and 6, exported)."""
    out = tmp_path_factory.mktemp("offloaded")
    proc = run_train(BASE + files + [f"--out_dir={out}", f"--export_hf={out / 'hf'}", "--offload_optimizer=true"],
                     nproc=2)
    return proc, out


def exported(out):
    from safetensors.torch import load_file
    return load_file(os.path.join(out, "hf", "model.safetensors"))


def same_run(got_out, want_out):
    got, want = read_metrics(got_out), read_metrics(want_out)
    assert [(m["step"], m["loss"], m["grad_norm"]) for m in got] == [(m["step"], m["loss"], m["grad_norm"]) for m in want]
    got_w, want_w = exported(got_out), exported(want_out)
    assert got_w.keys() == want_w.keys() and all((got_w[k] == want_w[k]).all() for k in want_w)


def test_an_offloaded_run_is_the_run_without_offload_bit_for_bit(plain, offloaded):
    """Through torchrun at W=2: the logged losses and norms and the exported weights (so set-up's first
    refresh, the checkpoint saves and the export with offload too)."""
    proc, out = offloaded
    assert "in host memory" in proc.stdout  # the start-up line says where the state is
    same_run(out, plain)
    assert read_metrics(out)[-1]["loss"] < read_metrics(out)[0]["loss"]  # it trained


@pytest.mark.parametrize("world,reduce_dtype,freeze", [(1, "float32", ""), (2, "float32", ""), (3, "float32", ""),
                                                       (2, "bfloat16", ""), (2, "float32", r"embed_tokens|layers\.0\.")],
                         ids=["w1", "w2", "w3", "w2-bf16", "w2-frozen-prefix"])
def test_offloaded_optimizer_steps_are_bit_identical(files, tmp_path, world, reduce_dtype, freeze):
    """The step at each W (ranks as threads of this process, tests/ranks.py): six steps with and without
    offload give the same losses and norms and, after them, the same master shards and optimizer state, bit
    for bit. bfloat16: the reduce-scattered shards reach host memory in bf16 and are cast before the add. A frozen
    prefix (--freeze): its units keep their master shard alone in the host buffer, never changed."""
    import torch
    from ranks import config_and_data, run_ranks, sharded_model
    import train as T

    def six_steps(offload):
        flags = BASE + files + [f"--reduce_dtype={reduce_dtype}", f"--offload_optimizer={offload}",
                                f"--out_dir={tmp_path / offload}", f"--freeze={freeze}"]
        cfg, mcfg, weights, windows = config_and_data(flags)

        def rank_steps(rank):
            sharded = sharded_model(cfg, mcfg, weights)
            log = [T.train_step(cfg, sharded, windows, step, (step - 1) * cfg.batch_size)
                   for step in range(1, cfg.steps + 1)]
            return log, [torch.cat([u.master_shard, *u.optimizer_state.values()]) for u in sharded.units], [
                (u.master_shard.numel(), u.grad_shard.numel(), len(u.optimizer_state)) for u in sharded.units if not u.trained]
        return run_ranks(world, rank_steps)
    without, offloaded = six_steps("false"), six_steps("true")
    for (want_log, want_state, _), (got_log, got_state, frozen) in zip(without, offloaded, strict=True):
        assert got_log == want_log
        assert [(grad, state) for _, grad, state in frozen] == ([(0, 0)] * 2 if freeze else [])
        assert len(got_state) == len(want_state) and all(torch.equal(g, w) for g, w in zip(got_state, want_state))
    assert offloaded[0][0][-1]["loss"] < offloaded[0][0][0]["loss"]  # it trained


@pytest.mark.parametrize("first,then", [("true", "false"), ("false", "true")], ids=["offloaded->device", "device->offloaded"])
def test_checkpoints_move_between_offloaded_and_not(files, plain, offloaded, tmp_path, first, then):
    """Saved at step 3 one way (the 6-step run's checkpoint), resumed to step 6 the other way: the run is the
    uninterrupted one, bit for bit."""
    saved_by = offloaded[1] if first == "true" else plain
    out = stopped_at(saved_by, tmp_path / "run", 3)  # as a run killed in step 4 leaves it
    proc = run_train(BASE + files + [f"--out_dir={out}", f"--export_hf={out / 'hf'}", f"--offload_optimizer={then}"],
                     nproc=2)
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    same_run(out, plain)


def test_offload_without_the_host_memory_for_it_stops_at_once(tmp_path):
    """Llama-3-70B's optimizer state is over 1 TB on one rank: one line before any allocation, not an
    OOM-kill mid-run."""
    proc = run_train(["--model=llama3-70b", "--offload_optimizer=true", "--steps=1", f"--out_dir={tmp_path}"],
                     nproc=1, check=False, timeout=120)
    assert proc.returncode != 0
    # the model the run builds: the preset's shapes with the built-in sample's vocabulary (run_data.open_data)
    need = re.search(r"error: --offload_optimizer: the 1 rank\(s\) on this node need ([\d,.]+) GiB of host memory",
                     proc.stderr)
    assert need and float(need.group(1).replace(",", "")) > 1000, proc.stderr
    assert "GiB available; use more nodes, or train without --offload_optimizer" in proc.stderr


def test_the_host_buffer_sizes_each_unit_by_its_own_optimizer_state():
    """A fork's units need not all keep the same optimizer state (a unit under another optimizer, or none):
    the host buffer lays each unit out by its own state list, not the first unit's, and is exactly
    host_buffer_numel of those counts."""
    import torch
    import model as M
    import train as T
    from components import offload as O
    with torch.device("meta"):
        model = M.Llama(small_config())
    units = T.build_units(model, 0, 2, torch.device("cpu"), torch.float32, T.OffloadedUnit)
    units[1].optimizer_state = {"momentum_buffer": None}  # one state tensor here, two elsewhere
    units[2].optimizer_state = {}                          # none at all
    state = O.offload_optimizer(units, host_adds=[])
    counts = [2 + len(u.optimizer_state) for u in units]
    assert state.buffer.numel() == O.host_buffer_numel([u.shard_numel for u in units], counts)
    views = [t for u in units for t in (u.master_shard, u.grad_shard, *u.optimizer_state.values())]
    assert all(t.numel() == u.shard_numel for u in units for t in (u.master_shard, u.grad_shard, *u.optimizer_state.values()))
    starts = sorted(t.data_ptr() for t in views)  # disjoint, back to back
    assert len(set(starts)) == len(views) and sum(t.numel() for t in views) == sum(c * u.shard_numel for c, u in zip(counts, units))


def test_offloaded_state_lives_in_host_memory(tmp_path):
    """What each tensor is: fp32 master, gradient and AdamW state off the compute device, the compute-dtype
    shard on it (on CPU both are the CPU: the counts and dtypes are what can be checked)."""
    import torch
    import model as M
    import train as T
    with torch.device("meta"):
        model = M.Llama(small_config())
    from components import offload as O
    units = T.build_units(model, 0, 2, torch.device("cpu"), torch.bfloat16, T.OffloadedUnit)
    O.offload_optimizer(units, host_adds=[])
    for u in units:
        assert u.host.compute_shard.dtype == torch.bfloat16 and u.host.compute_shard.numel() == u.shard_numel
        assert u.master_shard.dtype == u.grad_shard.dtype == torch.float32
        assert set(u.optimizer_state) == set(M.OPTIMIZER_STATE)
        assert u.persistent_bytes(on_device_only=True) == 2 * u.shard_numel
        assert u.persistent_bytes() == (16 + 2) * u.shard_numel
        u.master_shard.fill_(1.5)
    O.refresh_compute_shards(units)
    for u in units:
        assert (u.host.compute_shard == 1.5).all() and u.gather_input() is u.host.compute_shard


def test_the_host_state_is_one_buffer_of_exactly_the_planners_bytes():
    """Pinned memory from pin_memory=True is rounded up to a power of two per allocation (a 70B block's 408 MiB
    shard at W=8 takes 512 MiB): the state is one buffer, registered as it is, every unit's fp32 tensor a view
    of it, and the start-up check (checks.host_bytes_per_rank) and plan.py count its bytes exactly, staging slots
    included."""
    import dataclasses
    import torch
    import model as M
    from components import offload as O
    from tools import plan as P
    from tools import plan_memory as PM
    import train as T
    mcfg, world = small_config(), 3
    with torch.device("meta"):
        model = M.Llama(mcfg)
    units = T.build_units(model, 0, world, torch.device("cpu"), torch.bfloat16, T.OffloadedUnit)
    state = O.offload_optimizer(units, host_adds=[])
    buffer = state.buffer
    assert buffer.is_contiguous() and buffer.dtype == torch.float32
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * 4
    for u in units:
        for t in (u.master_shard, u.grad_shard, *u.optimizer_state.values()):
            assert t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
            assert start <= t.data_ptr() and t.data_ptr() + t.numel() * 4 <= end and t.numel() == u.shard_numel
    assert any(u.padded_numel != u.numel for u in units)  # the padding is counted too
    cfg = dataclasses.replace(T.TrainConfig(offload_optimizer=True), nnodes=1, nproc_per_node=world)
    assert P.host_bytes_per_gpu(mcfg, cfg, world)["state"] == buffer.numel() * buffer.element_size()
    from components import checks  # the run's own count, which a CPU run's check reads without asking the planner
    assert checks.host_bytes_per_rank(cfg, mcfg, world, None)["sync"]["state"] == buffer.numel() * buffer.element_size()
    # 70B at W=8: exact where pin_memory=True would take 512 MiB per 408 MiB block shard
    big, cfg8 = M.PRESETS["llama3-70b"](), dataclasses.replace(cfg, nproc_per_node=8)
    block_slice = PM.unit_numels(big)[1] * 4 // 8
    assert P.pinned_allocation_bytes(block_slice) == 512 * 2**20 and 400 * 2**20 < block_slice < 410 * 2**20
    exact = 4 * O.host_buffer_numel([PM.padded(n, 8) // 8 for n in PM.unit_numels(big)], [4] * len(PM.unit_numels(big)))
    assert P.host_bytes_per_gpu(big, cfg8, 8)["state"] == exact < 133 * 2**30
    rounded = sum(4 * P.pinned_allocation_bytes(4 * (PM.padded(n, 8) // 8)) for n in PM.unit_numels(big))
    assert rounded > 1.2 * exact  # what one pin_memory=True tensor per state shard would have taken


def cpu_units(world=1):
    import torch
    import model as M
    import train as T
    with torch.device("meta"):
        model = M.Llama(small_config())
    return T.build_units(model, 0, world, torch.device("cpu"), torch.bfloat16, T.OffloadedUnit)


def test_gradients_are_added_on_a_worker_thread_not_the_one_queuing_backward(monkeypatch):
    """The adds into the host accumulators (44.8 s per step at 70B on one node) run on the rank's worker
    thread: add_grad returns while the worker is still busy, in arrival order (the device's sums, bit for
    bit, bf16 shards cast first), and an error there is raised on the main thread when it waits."""
    import threading
    import torch
    from components import offload as O
    units, host_adds = cpu_units(), []
    O.offload_optimizer(units, host_adds)
    release, threads, real_add = threading.Event(), [], O.add_into

    def held_add(*args):
        threads.append(threading.current_thread())
        assert release.wait(30)
        real_add(*args)
    monkeypatch.setattr(O, "add_into", held_add)
    u = units[1]
    g1, g2 = torch.randn(u.shard_numel), torch.randn(u.shard_numel).to(torch.bfloat16)
    u.host.add_grad(u, g1.clone())
    u.host.add_grad(u, g2.clone())  # returns although the first add has not run: the worker holds it
    assert len(host_adds) == O.GRAD_SLOTS == 2 and (u.grad_shard == 0).all()
    release.set()
    O.finish_host_adds(host_adds)
    assert len(threads) == 2 and threading.main_thread() not in threads
    assert torch.equal(u.grad_shard, torch.zeros(u.shard_numel).add_(g1).add_(g2.float()))
    assert not host_adds and len(u.host.state.free_slots) == O.GRAD_SLOTS

    monkeypatch.setattr(O, "add_into", lambda *args: 1 / 0)
    u.host.add_grad(u, g1.clone())
    with pytest.raises(ZeroDivisionError):
        O.finish_host_adds(host_adds)


def test_the_host_cast_to_bf16_rounds_as_the_device_does():
    """The refreshed weights cross PCIe in bf16, cast on the host (offload.refresh_compute_shards): that cast
    must give the bits the device's cast gives (CUDA's __float2bfloat16_rn: round to nearest, ties to even,
    the formula below from cuda_bf16.hpp), ties, subnormals, overflow to inf and signs included; NaN stays NaN
    (its payload may differ). The refresh itself writes exactly those bits into the device copy."""
    import torch
    from components import offload as O
    special = torch.tensor([0.0, -0.0, 1.0, -1.5, float("inf"), float("-inf"), 3.4028235e38, -3.4028235e38,
                            1e-40, -1e-45, 1.17549435e-38], dtype=torch.float32)
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x3F80_7FFF, 0x3F80_8001, 0x7F7F_8000, 0x0000_8000, 0x8001_8000],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([special, ties, torch.randn(100_000) * torch.logspace(-30, 30, 100_000)])
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    device_bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    assert torch.equal(x.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF, device_bits)
    assert torch.tensor([float("nan")]).to(torch.bfloat16).isnan().all()

    units = cpu_units()
    O.offload_optimizer(units, host_adds=[])
    for u in units:
        u.master_shard.copy_(x[:u.shard_numel])
    O.refresh_compute_shards(units)
    for u in units:
        got = u.host.compute_shard.view(torch.int16).to(torch.int64) & 0xFFFF
        assert torch.equal(got, device_bits[:u.shard_numel])


def test_a_host_buffer_cuda_cannot_page_lock_is_one_line(monkeypatch):
    """cudaHostRegister refuses (e.g. a locked-memory limit below the buffer): train.main turns this
    RuntimeError into one line, exit code 1 (a previous attempt may still hold the memory), on every rank,
    before the first step."""
    from types import SimpleNamespace
    import torch
    from components import offload as O
    monkeypatch.setattr(torch.cuda, "cudart", lambda: SimpleNamespace(cudaHostRegister=lambda ptr, nbytes, flags: 2))
    with pytest.raises(RuntimeError) as e:
        O.page_lock(torch.zeros(2**18))
    assert str(e.value) == ("--offload_optimizer: cudaHostRegister of 0.0 GiB of host memory failed (CUDA error 2); "
                            "is the locked-memory limit (ulimit -l) unlimited?")


def test_the_cpu_update_gets_its_share_of_the_cores():
    """On GPUs torchrun runs each worker with one thread; the offloaded update would then use one core of
    the node's ~100. Each rank takes cores / ranks on the node; on CPU runs nothing changes."""
    import torch
    from components import offload as O
    import train as T
    offload, plain = T.TrainConfig(offload_optimizer=True), T.TrainConfig()
    assert O.optimizer_threads(offload, torch.device("cuda", 0), 8, 112) == 14
    assert O.optimizer_threads(offload, torch.device("cuda", 0), 8, 4) == 1
    assert O.optimizer_threads(plain, torch.device("cuda", 0), 8, 112) is None
    assert O.optimizer_threads(offload, torch.device("cpu"), 2, 2) is None
