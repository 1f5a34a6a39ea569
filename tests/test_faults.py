"""Faults end cleanly: a NaN on one rank stops (or, if allowed, skips) the step on every rank; a rank
killed with SIGKILL ends the job quickly and torchrun's restart resumes it from the checkpoint."""
import os
import subprocess
import sys
import time

import pytest
from common import FAULT_SITE, ROOT, model_and_tokens, read_metrics, run_train

BASE = ["--seq_len=16", "--batch_size=8", "--micro_batch_size=2", "--dtype=float32", "--steps=6", "--lr=3e-3",
        "--warmup_steps=2", "--seed=4", "--timeout_min=1"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return model_and_tokens(tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def clean(files, tmp_path_factory):
    """The run without a fault, W=2: the losses the faulty runs are held to (read only)."""
    out = tmp_path_factory.mktemp("clean")
    run_train(BASE + files + [f"--out_dir={out}"], nproc=2)
    return read_metrics(out)


def test_nan_on_one_rank_stops_every_rank_naming_the_step(files, tmp_path):
    proc = run_train(BASE + files + [f"--out_dir={tmp_path}"], nproc=2, env={"ZERO3_FAULT": "nan:3:1"}, check=False)
    assert proc.returncode != 0
    assert "error: step 3: loss nan, grad_norm nan (from rank 1); the optimizer step was skipped" in proc.stderr
    assert "nothing from this step was saved" in proc.stderr
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]
    assert not os.path.exists(tmp_path / "checkpoints")  # the bad state is never checkpointed


def test_nan_step_is_skipped_when_allowed(files, clean, tmp_path):
    proc = run_train(BASE + files + [f"--out_dir={tmp_path / 'nan'}", "--max_skipped_steps=1"], nproc=2,
                     env={"ZERO3_FAULT": "nan:3:0"})
    assert "warning: step 3: loss nan" in proc.stderr
    got, ref = read_metrics(tmp_path / "nan"), clean
    assert got[2]["loss"] is None and got[2]["grad_norm"] is None
    assert [m["loss"] for m in got[:2]] == [m["loss"] for m in ref[:2]]
    # Step 3's update was skipped, so step 4 sees other weights than in the clean run -- but it trains on.
    assert got[3]["loss"] != ref[3]["loss"] and all(m["loss"] is not None for m in got[3:])


def test_killed_rank_ends_the_job_and_the_restart_resumes(files, clean, tmp_path):
    cmd = BASE + files + [f"--out_dir={tmp_path / 'run'}", "--ckpt_every=2"]
    t0 = time.time()
    proc = run_train(cmd, nproc=2, env={"ZERO3_FAULT": "kill_mid_step:3:1"}, check=False)
    assert proc.returncode != 0 and time.time() - t0 < 60  # the survivor did not wait out a hang
    # launch.sh starts the job again after a crash, and it resumes with no human.
    once = tmp_path / "fired"
    env = dict(os.environ, NPROC_PER_NODE="2", MAX_RESTARTS="1", PYTHON=sys.executable, OMP_NUM_THREADS="1",
               ZERO3_FAULT="kill_mid_step:5:0", ZERO3_FAULT_ONCE=str(once))
    proc = subprocess.run([os.path.join(ROOT, "launch.sh"), *cmd], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert once.exists() and "at step 4 (torchrun restart 1 of 1)" in proc.stdout
    assert [m["loss"] for m in read_metrics(tmp_path / "run")] == [m["loss"] for m in clean]


def test_hung_rank_ends_the_job_within_the_timeout(files, tmp_path):
    t0 = time.time()
    # Rank 1 sleeps 12 s in step 3, twice rank 0's 6 s collective timeout. Were the timeout not applied, rank 0
    # would wait and the run would finish (exit 0) once rank 1 woke. Not an hour: torchrun waits 30 s for a
    # rank that ignores its SIGTERM (a hung one does) before it kills it, whatever TORCH_ELASTIC_SHUTDOWN_TIMEOUT.
    proc = run_train(BASE + files + [f"--out_dir={tmp_path}", "--timeout_min=0.1"], nproc=2,
                     env={"ZERO3_FAULT": "hang:3:1:12"}, check=False, timeout=300)
    seconds = time.time() - t0
    assert proc.returncode != 0
    assert seconds < 60, seconds  # 6 s collective timeout, then torchrun stops the stuck rank
    assert "timed out" in proc.stderr.lower() or "timeout" in proc.stderr.lower(), proc.stderr[-2000:]


def test_a_leftover_fault_does_nothing_outside_the_tests(files, tmp_path):
    # A shell that kept ZERO3_FAULT from a test session: production runs must not honour it, or `nan:1`
    # looks exactly like a real divergence. Only tests/fault_site on PYTHONPATH installs the hook; the trainer never
    # reads ZERO3_FAULT. One process, no torchrun.
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *BASE, "--steps=2", "--warmup_steps=1", *files]
    outside = os.pathsep.join(p for p in os.environ["PYTHONPATH"].split(os.pathsep) if p != FAULT_SITE)
    proc = subprocess.run(cmd + [f"--out_dir={tmp_path / 'leftover'}"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", ZERO3_FAULT="nan:1", PYTHONPATH=outside))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ZERO3_FAULT" not in proc.stderr
    assert all(m["loss"] is not None for m in read_metrics(tmp_path / "leftover"))
    # Only train.py's own process installs the hook: torchrun's launcher (launch.sh quiets it after a fatal line, which
    # a torch imported before that would bypass) and every other python keep their start-up as it is.
    probe = subprocess.run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"], capture_output=True,
                           text=True, timeout=60, env=dict(os.environ, ZERO3_FAULT="nan:1"))
    assert probe.stdout.strip() == "False", probe.stdout + probe.stderr
    # Under the tests, a malformed value is one line before any work, not a traceback at step 1.
    proc = subprocess.run(cmd + [f"--out_dir={tmp_path / 'malformed'}"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", ZERO3_FAULT="nan:three"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: ZERO3_FAULT='nan:three' is not KIND:STEP[:RANK[:SECONDS]], slow:SECONDS, "
                                   "busy:RANK:SECONDS, slow_matmul:RANK:SECONDS, wrong_matmul:RANK or "
                                   "late_contact:RANK:SECONDS (tests/faults.py)"), proc.stderr[-3000:]
    assert not os.path.exists(tmp_path / "malformed" / "metrics.jsonl")


# -- a slow or broken rank named (issue 51) ---------------------------------------------------------------------

def test_a_rank_slowed_in_its_own_compute_is_named_the_slowest_in_every_step(files, tmp_path):
    """Rank 1 burns 0.4 s of CPU in every step's forward. The collectives make both ranks' wall times equal, so the
    wall time named a rank at random (a rank slowed 1.2 s per step was named in 3 of 6 steps); each rank's own
    compute time (CPU time of its training thread here; CUDA events on a GPU) names rank 1 in every step."""
    proc = run_train(BASE + files + [f"--out_dir={tmp_path}", "--eval_every=0"], nproc=2,
                     env={"ZERO3_FAULT": "busy:1:0.4"})
    rows = read_metrics(tmp_path)
    assert [row["slowest_rank"] for row in rows] == [1] * 6, [(row["compute_max_s"], row["compute_median_s"]) for row in rows]
    assert all(row["compute_max_s"] >= 0.4 for row in rows)
    named = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(named) == 6 and all(" | slowest rank 1 (" in line for line in named), proc.stdout[-2000:]


# A run checks each rank's device in a subprocess, tools/gpu_check.py, on GPUs only; ZERO3_GPU_CHECK_ON_CPU runs it on
# a CPU too, so that the fault reaches the tool and its facts reach the cross-rank decision as on a GPU.
DEVICE_CHECK = {"ZERO3_GPU_CHECK_ON_CPU": "1"}


def test_a_rank_whose_check_matmul_is_wrong_stops_every_rank_before_step_1_naming_it(files, tmp_path):
    """One entry of rank 1's health-check product is off by one, as a faulty GPU's would be: every rank prints the
    line naming rank 1, its host and the node to exclude, and exits 2 (a restart would run on the same device)."""
    proc = run_train(BASE + files + [f"--out_dir={tmp_path}"], nproc=2,
                     env={"ZERO3_FAULT": "wrong_matmul:1", **DEVICE_CHECK}, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: rank 1 (")]
    assert len(lines) == 2 and lines[0] == lines[1], proc.stderr[-3000:]  # said on each rank
    assert "CPU's check matmul (384 x 384, exact integers) gave a wrong result" in lines[0]
    assert "leave the node out (sbatch --exclude=" in lines[0]
    assert "step 1" not in proc.stdout and proc.first_failure["exit_code"] == 2


def test_a_rank_whose_check_matmul_is_slower_than_the_median_is_named_with_its_host(files, tmp_path):
    """Rank 1's health-check matmul burns 50 ms of CPU more each time: rank 0 warns, naming rank 1 and the node to
    exclude, before step 1; the run goes on (a slow GPU slows the job, it does not break it)."""
    proc = run_train(BASE + files + [f"--out_dir={tmp_path}", "--steps=1"], nproc=2,
                     env={"ZERO3_FAULT": "slow_matmul:1:0.05", **DEVICE_CHECK})
    [line] = [line for line in proc.stderr.splitlines() if "check matmul took" in line]
    assert line.startswith("warning: rank 1 (") and "over the ranks' median" in line, line
    assert "leave the node out (sbatch --exclude=" in line
    assert "step 1/1" in proc.stdout
