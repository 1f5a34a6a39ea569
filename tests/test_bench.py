"""bench/gpu.sh stays runnable without a GPU: its --dry-run runs the same code on CPU (2 gloo processes,
tiny shapes) -- the device correctness check against transformers, ours eager and compiled, and the
transformers + FSDP2 baseline -- and must report every run."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from common import ROOT


def test_gpu_benchmark_dry_run_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ, PYTHON=sys.executable, BENCH_PARTS_JSONL=str(tmp_path / "parts.jsonl"))
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu.sh"), "--dry-run", "--steps", "3",
                           "--json", str(out)], capture_output=True, text=True, env=env, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads(out.read_text())
    check = results["correctness"]
    assert check["ok"] and check["float32"]["worst_rel"] <= 1e-4 and check["bfloat16"]["worst_rel"] <= 2e-2
    runs = results["runs"]
    assert set(runs) == {"ours", "ours, --prefetch false", "ours, --offload_optimizer true",
                         "ours + torch.compile per block", "transformers + FSDP2"}
    for name, run in runs.items():
        assert "error" not in run, (name, run)
        assert run["tokens_per_sec_per_gpu"] > 0 and len(run["losses"]) == 3
    assert runs["ours + torch.compile per block"]["loss_vs_eager_rel"] <= 2e-2
    assert runs["ours, --offload_optimizer true"]["loss_vs_eager_rel"] == 0.0  # on CPU: the same arithmetic
    assert "| ours | " in proc.stdout and "| transformers + FSDP2 | " in proc.stdout
    assert "| peak GiB | fake-CUDA GiB |" in proc.stdout  # a dry run (CPU) has no fake-CUDA figure: n/a
    # The script's own record, written as each part ends (a run stopped half-way still says what it measured)
    part = json.loads((tmp_path / "parts.jsonl").read_text().splitlines()[0])
    assert part["part"] == "gpu_py" and part["exit"] == 0 and part["budget_s"] <= 330
    assert any(line.startswith("| ours | ") for line in part["lines"])


def test_one_runs_failure_is_agreed_on_and_one_that_strands_the_others_stops_the_benchmark(tmp_path):
    """A run that fails on every rank is recorded as failed on all of them and the next runs; a run that fails
    on rank 1 alone leaves rank 0 inside its collectives: rank 1 does not find rank 0 at the agreement and
    ends the benchmark with one line (torchrun stops rank 0) instead of every later run hanging."""
    out = tmp_path / "gpu.json"
    env = dict(os.environ, PYTHON=sys.executable, BENCH_PARTS_JSONL=str(tmp_path / "parts.jsonl"))
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu.sh"), "--dry-run", "--steps", "1", "--no-compile",
                           "--no-baseline", "--json", str(out), "--agree_timeout_s", "5",
                           "--inject_failure", "ours, --prefetch false@0,1",
                           "--inject_failure", "ours, --offload_optimizer true@1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert ("error: bench/gpu.py: rank 1: ours, --offload_optimizer true: RuntimeError: injected failure "
            "(--inject_failure) on rank 1; not every rank reached the end of the run within 5 s") in proc.stderr
    runs = json.loads(out.read_text())["runs"]
    assert runs["ours"]["tokens_per_sec_per_gpu"] > 0
    assert runs["ours, --prefetch false"] == {"error": "failed on rank(s) [0, 1]: RuntimeError: injected failure "
                                                       "(--inject_failure) on rank 0"}


def test_the_compiled_benchmark_keeps_the_blocks_checkpoint_inside_the_compiled_region():
    """bench/gpu.py's compiled run compiles train.run_block whole: the block's forward graph runs once per
    step and the backward graph holds only the gradients' matmuls (2 per forward matmul, 7 in a block): the
    selective policy saved the forward's. Compiling the block alone (what the benchmark did) leaves the
    checkpoint outside: backward runs the compiled forward again, as --ac full."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu as G
    import model as M
    import torch
    import train as T
    from common import small_config
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def counting_backend(record):
        def forward_compiler(gm, _):
            def counted(*args):
                record["forward_runs"] += 1
                return gm(*args)
            return make_boxed_func(counted)

        def backward_compiler(gm, _):
            record["backward_matmuls"] += sum(n.target == torch.ops.aten.mm.default for n in gm.graph.nodes)
            return make_boxed_func(gm.forward)
        return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)

    cfg = small_config()
    x = torch.randn(1, 16, cfg.dim, requires_grad=True)
    cos, sin = M.rope_cos_sin(cfg, torch.arange(16)[None], torch.float32)
    inside, outside = (dict(forward_runs=0, backward_matmuls=0) for _ in range(2))
    torch._dynamo.reset()
    run_block = G.compiled_run_block(backend=counting_backend(inside))
    run_block(M.Block(cfg), "selective", x, cos, sin, None).sum().backward()
    assert inside == dict(forward_runs=1, backward_matmuls=14)
    torch._dynamo.reset()
    block = M.Block(cfg)
    block.compile(backend=counting_backend(outside))
    T.run_block(block, "selective", x, cos, sin, None).sum().backward()
    assert outside["forward_runs"] == 2  # the checkpoint around the compiled block recomputed all of it
    torch._dynamo.reset()


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has GPUs")
def test_gpu_benchmark_without_a_gpu_says_so():
    env = dict(os.environ, PATH="/usr/bin:/bin")  # no nvidia-smi
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu.sh")], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 2 and "no GPU found" in proc.stderr


def test_gpu_benchmark_sizes_the_model_to_the_gpu():
    """As many 8B-shaped layers as the planner fits in 90% of the card, with the baseline's whole logits."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu as G
    sizes = {}
    for gpu, mib in (("h200", 143771), ("h100", 81559)):
        memory = mib * 2**20
        layers = G.layers_that_fit(8192, 1, memory, gpu)
        for n, fits in ((layers, True), (layers + 1, False)):  # the next layer does not fit
            total = G.planned_peak_bytes(n, 8192, 1, gpu) + G.baseline_extra_bytes(G.bench_model(n, dry=False), 8192)
            assert (total <= 0.9 * memory) == fits, (gpu, n, total)
        sizes[gpu] = layers
    assert sizes["h200"] > sizes["h100"] >= 4
    assert G.layers_that_fit(8192, 8, 81559 * 2**20, "h100") == 32  # one node: the whole 8B
    assert G.planner_gpu("NVIDIA H200") == "h200" and G.planner_gpu("NVIDIA H100 80GB HBM3") == "h100"


def test_gpu_benchmark_shows_the_fake_cuda_peak_measured_for_its_own_flags():
    """bench/gpu.py prints beside each eager run's peak the peak bench/fake_memory.py --gpu_bench measured for
    the same run under fake CUDA. Each recorded row must still be that run: gpu.py's flags for it today, and
    the layer count gpu.py chooses on that GPU (a change to either makes the row stale: measure again)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu as G
    from tools import plan as P
    rows = json.load(open(G.FAKE_MEMORY_JSON))
    measured = {(r["gpu"], r["world"], r["run"], r["flash"]) for r in rows}
    for gpu, world in (("h100", 8), ("h200", 1)):  # an H100 node; the H200 this project may be lent
        assert {(gpu, world, name, flash) for name in G.ours_runs(world) for flash in (True, False)} <= measured
    for r in rows:
        assert r["layers"] == G.layers_that_fit(r["seq_len"], r["world"], P.GPUS[r["gpu"]]["memory_mib"] * 2**20,
                                                r["gpu"]), r
        assert r["flags"] == G.ours_flags("OUT_DIR", "TOKENS", r["seq_len"], r["world"], G.ACCUM, G.WARMUP + 5,
                                          "cuda", G.OURS_RUNS[r["run"]]), r
        assert G.fake_cuda_peak_gib(r["run"], r["layers"], r["seq_len"], r["world"], r["flash"]) == r["measured_gib"]
        assert 0.9 < r["measured_gib"] / r["planned_gib"] < 1.05, r  # and it is the planner's order of size
    assert G.fake_cuda_peak_gib("ours", 3, 8192, 8, True) is None  # not measured: gpu.py says how to measure it


def test_checkpoint_io_measures_a_folder_without_a_hugging_face_model(tmp_path):
    """bench/checkpoint_io.py on a preset initialised from the seed, one process: GB/s per rank for the
    folder given, the bytes the planner predicts for it, and nothing left behind in that folder."""
    sys.path.insert(0, ROOT)
    import model as M
    from tools import plan as P
    out = tmp_path / "fs"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "checkpoint_io.py"), "--model", "tiny",
                           "--out_dir", str(out)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    predicted_gb = P.checkpoint_bytes_per_rank(M.PRESETS["tiny"](), 1) / 1e9
    assert f"W=1: {predicted_gb:.3f} GB per rank | save " in proc.stdout and "--fs_write_gbps" in proc.stdout
    # The rate to plan with is the lower of save and load: the planner times the stop's save and a restart's load at it.
    save, load, planned = (float(proc.stdout.split(key)[1].split()[0]) for key in ("| save ", "| load ", "--fs_write_gbps "))
    assert planned == min(save, load) and "page cache dropped" in proc.stdout, proc.stdout
    assert not (out / "checkpoints").exists()


def test_comm_volume_counts_the_zero3_schedule():
    """bench/comm_volume.py counts every collective of 3 steps and a save at W=2, tied and untied, and finds
    each one the ZeRO-3 schedule predicts (BENCHMARKS.md quotes its tables)."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.join(ROOT, "bench", "comm_volume.py")], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("all equal, nothing model-sized outside the steps: True") == 2, proc.stdout[-3000:]


def test_gpu_benchmark_gives_each_part_what_is_left_of_its_budget_and_records_it(tmp_path):
    """bench/gpu.sh fits one device call: a part with under 20 s of BENCH_BUDGET_S left is skipped, said, and recorded."""
    parts = tmp_path / "parts.jsonl"
    env = dict(os.environ, PYTHON=sys.executable, BENCH_PARTS_JSONL=str(parts), BENCH_BUDGET_S="15")
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu.sh"), "--dry-run"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 0 and "bench/gpu.sh: gpu_py: skipped, " in proc.stderr, proc.stderr[-2000:]
    assert json.loads(parts.read_text()) == dict(part="gpu_py", exit=-1, seconds=0, budget_s=json.loads(
        parts.read_text())["budget_s"], lines=[])


def test_launch_check_fails_under_half_the_plans_bus_bandwidth(monkeypatch):
    """--check's verdict is the start-up warning's: a GPU the planner knows, under half the plan's bus bandwidth."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import comm_check
    import torch
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda")
    line = comm_check.fabric_problem(12.0, cuda, 16, 8)  # 2 nodes: 8 NICs x 45 GB/s, capped by NVLink's 360
    assert line.startswith("the largest all-reduce ran at 12.0 GB/s bus bandwidth, under 50% of the plan's 360")
    assert comm_check.fabric_problem(250.0, cuda, 16, 8) is None
    assert comm_check.fabric_problem(0.5, torch.device("cpu"), 2, 2) is None  # gloo: no plan to compare with
