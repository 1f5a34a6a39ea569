"""Nothing lost in --out_dir: one run per folder, a folder every rank sees, retention that never deletes
what resume needs, `latest` that resume reads, exports and metrics that survive a crash, and launch.sh
paths that stay the caller's. Multi-process gloo on CPU."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from common import ROOT, model_and_tokens, read_metrics, run_train
from test_launch import free_port, wait_all, wait_for_steps

from components import checkpoints  # noqa: E402
from components import out_dir as OD  # noqa: E402
import train as T  # noqa: E402

BASE = ["--seq_len=16", "--batch_size=8", "--micro_batch_size=2", "--dtype=float32", "--steps=6", "--lr=3e-3",
        "--warmup_steps=2", "--seed=4", "--timeout_min=1"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return model_and_tokens(tmp_path_factory.mktemp("outdir"))


# The resume tests go on from a copy of one finished W=2 run of these flags (saves at steps 2, 4 and 6).
SAVING = ["--ckpt_every=2", "--keep_ckpts=3"]


@pytest.fixture(scope="module")
def finished(files, tmp_path_factory):
    """ROOT/run: a finished W=2 run of BASE + SAVING; ROOT/hf: its export (several files and an index).
    Read only: a test that goes on from the run copies it (copy_of_finished)."""
    root = tmp_path_factory.mktemp("finished")
    run_train(BASE + files + SAVING + [f"--out_dir={root / 'run'}", f"--export_hf={root / 'hf'}",
                                       "--export_shard_gb=0.000005"], nproc=2)
    return root


def copy_of_finished(finished, files, out) -> list[str]:
    """The finished run's folder copied to `out` (its .lock and all); returns the flags that continue it there."""
    shutil.copytree(finished / "run", out, dirs_exist_ok=True)
    return BASE + files + SAVING + [f"--out_dir={out}"]


def start_alone(args, **kwargs) -> subprocess.Popen:
    """`python train.py ARGS` started, not waited for: one process, no torchrun (common.run_train waits for one)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **kwargs.pop("env", {}))
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], env=env, cwd=ROOT, text=True,
                            **kwargs)


def ckpts(out):
    return sorted(n for n in os.listdir(out / "checkpoints") if n.startswith("step_"))


def test_a_second_run_on_the_same_out_dir_stops_naming_the_first(files, tmp_path):
    """The first run, which holds the folder's lock (rank 0 holds it, whatever the world size), is one
    process; the second is W=2, so that every rank's refusal shows."""
    cmd = BASE + files + [f"--out_dir={tmp_path}"]
    with open(tmp_path.parent / f"{tmp_path.name}.first.log", "w") as log:
        # It stops mid-step 2 for five minutes: still running.
        first = start_alone(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(ZERO3_FAULT="hang:2::300"))
        try:
            wait_for_steps(tmp_path, 1)
            second = run_train(cmd, nproc=2, check=False)
            assert second.returncode != 0  # torchrun's 1 for a worker's exit code 2
            assert f"error: --out_dir: {tmp_path} is in use by another run (host " in second.stderr
            assert second.stderr.count("is in use by another run") == 2  # every rank says it
            # The lock dies with its holder, kill -9 included: the same command then continues the run.
            assert first.poll() is None
        finally:
            first.kill()  # SIGKILL
            first.wait()
    run_train(cmd + ["--steps=2"])
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]


def test_an_out_dir_that_is_not_shared_fails_before_the_first_step(files, tmp_path):
    """Two ranks whose --out_dir is not one folder (each node its own local disk; here two paths): two
    `python train.py` joined through MASTER_ADDR/MASTER_PORT as torchrun's workers are, without torchrun
    (launch.sh's exit 2 for a worker's exit 2 is test_launch.py's test_errors_a_restart_repeats_are_not_retried)."""
    port = free_port()
    with open(tmp_path / "a.log", "w") as la, open(tmp_path / "b.log", "w") as lb:
        ranks = [start_alone(BASE + files + [f"--out_dir={tmp_path / name}"], stdout=log, stderr=subprocess.STDOUT,
                             env=dict(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
                 for rank, (name, log) in enumerate((("a", la), ("b", lb)))]
        codes = wait_all(ranks, 180)
    logs = (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()
    assert codes == [2, 2], logs[-4000:]
    assert "is not one folder for all ranks: rank(s) 1 do not see" in logs
    assert not any((tmp_path / name / "metrics.jsonl").exists() for name in "ab")


def test_retention_keeps_the_new_save_whatever_else_is_in_the_folder(files, finished, tmp_path):
    root, cmd = tmp_path / "checkpoints", copy_of_finished(finished, files, tmp_path)  # saved 2, 4, 6
    for name in ("step_99999998", "step_99999999"):  # damaged or foreign, numbered above anything saved
        os.makedirs(root / name)
    os.makedirs(root / ".tmp-step_00000777")  # a crashed save's leftover
    # Rank 0 deletes, whatever the world size: one process resumes at step 6, which `latest` names.
    run_train(cmd + ["--steps=8", "--ckpt_every=1", "--keep_ckpts=2"])
    assert ckpts(tmp_path) == ["step_00000007", "step_00000008", "step_99999998", "step_99999999"]
    assert (root / "latest").read_text().strip() == "step_00000008"
    assert not (root / ".tmp-step_00000777").exists()


def test_a_retention_error_is_a_warning(tmp_path, monkeypatch, capsys):
    for step in (1, 2, 3):
        os.makedirs(tmp_path / f"step_{step:08d}")
        (tmp_path / f"step_{step:08d}" / "manifest.json").write_text(json.dumps({"format": checkpoints.CKPT_FORMAT}))

    def busy(path):
        raise OSError(16, "Device or resource busy", path)
    monkeypatch.setattr(checkpoints.shutil, "rmtree", busy)
    checkpoints.remove_old_checkpoints(str(tmp_path), 2, str(tmp_path / "step_00000003"))
    err = capsys.readouterr().err
    assert "warning: retention could not delete" in err and "step_00000001" in err, err


def test_retention_deletes_a_frozen_set_once_no_checkpoint_left_names_it(tmp_path):
    """--freeze's frozen sets (checkpoints.py): one a kept checkpoint names stays; one named only by deleted checkpoints,
    or by none (a save that stopped before its commit), goes; a manifest that cannot be read may name any: all stay."""
    for step, frozen in ((1, "frozen-a"), (2, "frozen-b"), (3, "frozen-b"), (4, None)):
        os.makedirs(tmp_path / f"step_{step:08d}")
        (tmp_path / f"step_{step:08d}" / "manifest.json").write_text(
            json.dumps({"format": checkpoints.CKPT_FORMAT, **({"frozen": {"folder": frozen}} if frozen else {})}))
    for name in ("frozen-a", "frozen-b", "frozen-c", "step_00000005"):  # step 5: an unfinished save
        os.makedirs(tmp_path / name)
    checkpoints.remove_old_checkpoints(str(tmp_path), 3, str(tmp_path / "step_00000004"))
    assert sorted(os.listdir(tmp_path)) == ["frozen-b", "step_00000002", "step_00000003", "step_00000004",
                                            "step_00000005"]
    (tmp_path / "step_00000003" / "manifest.json").write_text("{")
    os.makedirs(tmp_path / "frozen-d")
    checkpoints.remove_old_checkpoints(str(tmp_path), 3, str(tmp_path / "step_00000004"))
    assert "frozen-d" in os.listdir(tmp_path)


def test_latest_is_where_resume_starts(files, finished, tmp_path):
    cmd = copy_of_finished(finished, files, tmp_path)
    first = read_metrics(tmp_path)
    (tmp_path / "checkpoints" / "latest").write_text("step_00000004\n")  # roll back two steps
    proc = run_train(cmd + ["--steps=8"], nproc=2)
    assert "at step 4" in proc.stdout
    again = read_metrics(tmp_path)
    assert [m["step"] for m in again] == list(range(1, 9))
    # Steps 5 and 6 ran again from step 4's state: the same losses (the cosine schedule differs, so only step 5's lr is equal).
    assert again[4]["loss"] == first[4]["loss"]
    (tmp_path / "checkpoints" / "latest").write_text("step_00000099\n")
    proc = run_train(cmd + ["--steps=9"], check=False)  # refused before any step, at any world size
    assert proc.returncode == 2 and "latest names 'step_00000099', which is not a folder" in proc.stderr


def test_a_torn_metrics_line_does_not_block_resume(files, finished, tmp_path):
    cmd = copy_of_finished(finished, files, tmp_path)  # saved step 6
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 4.4')  # a longer run's crash or full disk came mid-line, after step 6's save
    proc = run_train(cmd + ["--steps=8"])  # rank 0 reads metrics.jsonl, whatever the world size
    assert "dropping a torn line" in proc.stderr
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6, 7, 8]


def test_export_never_mixes_a_stale_partial_export_with_a_new_one(finished, tmp_path):
    """The finished run's export (made with no .partial about) against the same weights exported again, from
    its last checkpoint (--from_ckpt, one process: only rank 0 writes an export), over a stale .partial."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    clean, hf = finished / "hf", tmp_path / "hf"
    os.makedirs(f"{hf}.partial")  # an earlier export of other weights that crashed
    save_file({"lm_head.weight": torch.zeros(97, 32)}, f"{hf}.partial/model.safetensors")
    run_train(["--dtype=float32", f"--from_ckpt={finished / 'run'}", f"--out_dir={tmp_path / 'b'}",
               f"--export_hf={hf}", "--export_shard_gb=0.000005"])  # several files and an index
    assert not (hf / "model.safetensors").exists() and (hf / "model.safetensors.index.json").exists()
    tokens = torch.arange(12).view(1, 12)
    logits = [AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32)(tokens).logits for p in (clean, hf)]
    assert torch.equal(logits[0], logits[1])


def test_launch_keeps_relative_paths_the_callers_and_checks_its_numbers(files, tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", NPROC_PER_NODE="1")  # paths, not ranks
    proc = subprocess.run([os.path.join(ROOT, "launch.sh"), *BASE, *files, "--steps=1", "--out_dir=run1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run1" / "metrics.jsonl").exists() and not os.path.exists(os.path.join(ROOT, "run1"))
    proc = subprocess.run([os.path.join(ROOT, "launch.sh")], cwd=tmp_path, env=dict(env, MAX_RESTARTS="three"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == "launch.sh: MAX_RESTARTS must be a whole number, got 'three'"


def test_the_trainer_unpickles_nothing_it_receives():
    """all_gather_object / broadcast_object_list pickle on one rank and unpickle on another: a rank (or
    anything that reaches the store's port) could run code in its peers. Only tensor collectives here."""
    for name in ("train.py", "model.py", "data.py"):
        with open(os.path.join(ROOT, name)) as f:
            source = f.read()
        assert "_object(" not in source and "object_list(" not in source, name


def test_a_committing_rename_is_followed_by_an_fsync_of_its_folder(tmp_path, monkeypatch):
    """os.replace is durable only once the folder holding the new name is on disk: write_atomic (the
    manifest, `latest`) fsyncs the file and then its folder."""
    synced, real_fsync = [], os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)
    monkeypatch.setattr(os, "fsync", recording_fsync)
    OD.write_text_atomic(str(tmp_path / "latest"), "step_00000001\n")
    assert synced == [str(tmp_path / "latest.tmp"), str(tmp_path)]


def file_times(root) -> dict:
    return {os.path.join(d, n): os.stat(os.path.join(d, n)).st_mtime_ns for d, _, names in os.walk(root) for n in names}


def test_rerunning_a_finished_run_says_so_and_touches_nothing(files, tmp_path):
    """launch.sh again, or a requeued job, after the last step: one line, exit 0, and no step, save, metrics
    line or export over the first one. One process (`python train.py`), the cheapest run there is. The first
    run's --warmup_steps is above --steps: rank 0 warns, once."""
    cmd = [*BASE, *files, "--steps=2", "--warmup_steps=20", f"--out_dir={tmp_path}", f"--export_hf={tmp_path / 'hf'}"]
    first = run_train(cmd, timeout=300)
    assert first.stderr.count("warning: --warmup_steps 20 is not below --steps 2: the whole run is warmup") == 1
    before = file_times(tmp_path)
    again = run_train(cmd, timeout=300)
    assert again.stdout.splitlines() == [f"already at step 2 of 2 ({tmp_path / 'checkpoints' / 'step_00000002'}); "
                                         f"raise --steps to continue"]
    assert file_times(tmp_path) == before
    # The checkpoint and what the message says when --steps is below it, decided from the manifest alone
    # (an --export_hf not yet made is exported from that checkpoint: test_export.py):
    ckpt = tmp_path / "checkpoints" / "step_00000002"
    args = BASE + files + [f"--out_dir={tmp_path}"]
    assert checkpoints.finished_run(T.parse_args(args + ["--steps=1"])) == (
        str(ckpt), f"already at step 2, beyond --steps 1 ({ckpt}); raise --steps to continue")
    for more in (["--steps=3"], ["--steps=0"], ["--steps=2", "--resume=never", "--overwrite"],
                 ["--steps=2", f"--from_ckpt={ckpt}", f"--export_hf={tmp_path / 'new'}"]):
        assert checkpoints.finished_run(T.parse_args(args + more)) is None, more


def test_a_restart_after_overwrite_resumes_instead_of_deleting_the_run(files, tmp_path):
    """--resume never --overwrite true, then a crash: torchrun's restart (launch.sh's MAX_RESTARTS) runs the
    same command again, and it must resume from the run's checkpoints, not delete them and start at step 1."""
    out = tmp_path / "run"
    os.makedirs(out / "checkpoints" / "step_00000099")  # an earlier run's, for the first attempt to delete
    (out / "metrics.jsonl").write_text('{"step": 99}\n')
    once = tmp_path / "fired"
    env = dict(os.environ, NPROC_PER_NODE="2", MAX_RESTARTS="1", PYTHON=sys.executable, OMP_NUM_THREADS="1",
               ZERO3_FAULT="kill_mid_step:5:0", ZERO3_FAULT_ONCE=str(once))
    cmd = BASE + files + [f"--out_dir={out}", "--ckpt_every=2", "--resume=never", "--overwrite=true"]
    proc = subprocess.run([os.path.join(ROOT, "launch.sh"), *cmd], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and once.exists(), proc.stderr[-3000:]
    assert "at step 4 (torchrun restart 1 of 1)" in proc.stdout, proc.stdout[-3000:]
    assert "--overwrite: nothing deleted: this is restart 1 of the run (torchrun rendezvous " in proc.stdout
    assert ckpts(out) == ["step_00000002", "step_00000004", "step_00000006"]  # step_99 went in the first attempt
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4, 5, 6]


def test_overwrite_happens_once_per_run_whoever_restarts_it(tmp_path):
    """The decision, for each way a run is started again (in-process: no training)."""
    def used():
        os.makedirs(tmp_path / "checkpoints" / "step_00000004", exist_ok=True)
        (tmp_path / "metrics.jsonl").write_text("{}\n")

    def overwrites(**env) -> bool:
        used()
        kept = OD.overwrite_once(str(tmp_path), env)
        deleted = not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
        assert deleted == (kept is None), kept
        return deleted
    torchrun = dict(TORCHELASTIC_RUN_ID="r1")
    assert overwrites(**torchrun, TORCHELASTIC_RESTART_COUNT="0")      # the first attempt
    assert not overwrites(**torchrun, TORCHELASTIC_RESTART_COUNT="1")  # torchrun's restart of it
    assert overwrites(TORCHELASTIC_RUN_ID="r2", TORCHELASTIC_RESTART_COUNT="1")  # another run's restart
    assert overwrites(**torchrun, TORCHELASTIC_RESTART_COUNT="0")      # the same command afresh, by hand
    slurm = dict(SLURM_JOB_ID="77", TORCHELASTIC_RUN_ID="77")
    assert overwrites(**slurm, SLURM_RESTART_COUNT="0")
    assert not overwrites(**slurm, SLURM_RESTART_COUNT="1")  # requeued: a new torchrun, its restart count 0
    assert not overwrites(**slurm, SLURM_RESTART_COUNT="1", TORCHELASTIC_RESTART_COUNT="2")
    assert overwrites(SLURM_JOB_ID="78", SLURM_RESTART_COUNT="1")  # a requeue of a job that never overwrote
    assert overwrites()  # plain python train.py: no restarts
