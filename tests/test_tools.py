"""The tools around training: --plot, ./launch.sh --check, --gpu_hour_usd."""
import os
import subprocess
import sys

import pytest
from common import ROOT, read_metrics, run_train

TINY = ["--seq_len=32", "--batch_size=4", "--micro_batch_size=2", "--steps=3", "--warmup_steps=1"]


def test_plot_writes_a_png_of_the_metrics(tmp_path):
    pytest.importorskip("matplotlib")
    run_train(TINY + [f"--out_dir={tmp_path}", "--gpu_hour_usd=2.0"], nproc=2)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--plot", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "metrics.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_so(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; sys.path.insert(0, sys.argv[1]); import train; "
            "train.main(['--plot', sys.argv[2]])")
    proc = subprocess.run([sys.executable, "-c", code, ROOT, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "error: --plot needs matplotlib: pip install matplotlib" in proc.stderr


def test_cost_is_logged_per_gpu_hour(tmp_path):
    proc = run_train(TINY + [f"--out_dir={tmp_path}", "--gpu_hour_usd=2.0"], nproc=2)
    rows = read_metrics(tmp_path)
    for r in rows:  # 2 GPUs x $2/h over the elapsed time; projected = elapsed + ETA
        assert abs(r["cost_usd"] - r["elapsed_s"] / 3600 * 2 * 2.0) < 1e-9
        assert abs(r["projected_cost_usd"] - (r["elapsed_s"] + r["eta_s"]) / 3600 * 2 * 2.0) < 1e-9
    assert rows[-1]["projected_cost_usd"] == rows[-1]["cost_usd"] and " | $" in proc.stdout


def test_launch_check_measures_all_reduce_bandwidth():
    env = dict(os.environ, NPROC_PER_NODE="2", PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run([os.path.join(ROOT, "launch.sh"), "--check"], capture_output=True, text=True, env=env,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all-reduce over 2 ranks (gloo" in proc.stdout and "all-reduce results correct on every rank" in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if "bus bandwidth" in line]
    assert len(lines) == 3 and all(float(line.split()[-2]) > 0 for line in lines)
