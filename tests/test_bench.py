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
    env = dict(os.environ, PYTHON=sys.executable)
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


def test_checkpoint_io_measures_a_folder_without_a_hugging_face_model(tmp_path):
    """bench/checkpoint_io.py on a preset initialised from the seed, one process: GB/s per rank for the
    folder given, the bytes the planner predicts for it, and nothing left behind in that folder."""
    sys.path.insert(0, ROOT)
    import model as M
    import plan as P
    out = tmp_path / "fs"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "checkpoint_io.py"), "--model", "tiny",
                           "--out_dir", str(out)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    predicted_gb = P.checkpoint_bytes_per_rank(M.PRESETS["tiny"](), 1) / 1e9
    assert f"W=1: {predicted_gb:.3f} GB per rank | save " in proc.stdout and "--fs_write_gbps" in proc.stdout
    assert not (out / "checkpoints").exists()
