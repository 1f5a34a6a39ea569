"""The tools around training: tools/plot.py (--plot), ./launch.sh --check, --gpu_hour_usd."""
import os
import shutil
import subprocess
import sys

import pytest
from common import ROOT, read_metrics, run_train

TINY = ["--seq_len=32", "--batch_size=4", "--micro_batch_size=2", "--steps=3", "--warmup_steps=1"]


@pytest.fixture(scope="module")
def priced_run(tmp_path_factory):
    """A W=2 run priced at $2 per GPU-hour: its out_dir and CompletedProcess (read only)."""
    out = tmp_path_factory.mktemp("priced")
    return out, run_train(TINY + [f"--out_dir={out}", "--gpu_hour_usd=2.0"], nproc=2)


def test_plot_writes_a_png_of_the_metrics(priced_run, tmp_path):
    """train.py --plot, which runs tools/plot.py: the run's metrics, copied so the run's folder stays as it was."""
    pytest.importorskip("matplotlib")
    shutil.copy(priced_run[0] / "metrics.jsonl", tmp_path)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--plot", str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout == f"wrote {tmp_path / 'metrics.png'}\n", proc.stderr
    with open(tmp_path / "metrics.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_so(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; sys.path.insert(0, sys.argv[1]); from tools import plot; "
            "sys.exit(plot.main([sys.argv[2]]))")
    proc = subprocess.run([sys.executable, "-c", code, ROOT, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "error: --plot needs matplotlib: pip install matplotlib" in proc.stderr


def test_cost_is_logged_per_gpu_hour(priced_run):
    out, proc = priced_run
    rows = read_metrics(out)
    for r in rows:  # 2 GPUs x $2/h over the elapsed time; projected = elapsed + ETA
        assert abs(r["cost_usd"] - r["elapsed_s"] / 3600 * 2 * 2.0) < 1e-9
        assert abs(r["projected_cost_usd"] - (r["elapsed_s"] + r["eta_s"]) / 3600 * 2 * 2.0) < 1e-9
    assert rows[-1]["projected_cost_usd"] == rows[-1]["cost_usd"] and " | $" in proc.stdout


def test_launch_check_measures_all_reduce_bandwidth():
    """In the training group and in a gloo group like the checkpoint group (on CPU both are gloo, two groups
    all the same), on the interface GLOO_SOCKET_IFNAME names."""
    env = dict(os.environ, NPROC_PER_NODE="2", PYTHON=sys.executable, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run([os.path.join(ROOT, "launch.sh"), "--check"], capture_output=True, text=True, env=env,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all-reduce over 2 ranks (gloo, 2 per node)" in proc.stdout
    assert "all-reduce over 2 ranks in the checkpoint group (gloo, CPU, GLOO_SOCKET_IFNAME=lo)" in proc.stdout
    assert "all-reduce results correct on every rank, in both groups" in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if "bus bandwidth" in line]
    assert len(lines) == 4 and all(float(line.split()[-2]) > 0 for line in lines)


def test_mem_gb_is_each_steps_own_peak(tmp_path, monkeypatch):
    """The peak is reset before every step and read before evaluation, so mem_gb is the step's peak: not
    init's full-unit fp32 tensor, nor an evaluation's. (On a GPU that is reset_peak_memory_stats; on
    CPU the recorded order of the calls is what can be checked.)"""
    import signal as S
    from components import metrics
    import train as T
    from common import learnable_tokens
    data = learnable_tokens(str(tmp_path / "tok.npy"), 512, n=3000)
    calls = []
    real_step, real_eval = T.train_step, T.evaluate
    monkeypatch.setattr(metrics, "reset_peak_mem", lambda device: calls.append("reset"))
    monkeypatch.setattr(metrics, "peak_mem_bytes", lambda device: calls.append("read") or 0)
    monkeypatch.setattr(T, "train_step", lambda *a: calls.append("step") or real_step(*a))
    monkeypatch.setattr(T, "evaluate", lambda *a: calls.append("eval") or real_eval(*a))
    monkeypatch.delenv("RANK", raising=False)
    handlers = {s: S.getsignal(s) for s in (S.SIGUSR1, S.SIGTERM, S.SIGINT)}
    try:
        T.main(TINY + [f"--data={data}", f"--eval_data={data}", "--eval_every=2", "--eval_batches=1",
                       "--device=cpu", f"--out_dir={tmp_path / 'out'}"])
    finally:
        for s, h in handlers.items():
            S.signal(s, h)
    assert calls == ["reset", "step", "read"] + ["reset", "step", "read", "eval"] * 2
