"""--async_save: the checkpoint a background write makes is the synchronous save's, byte for byte; training
is unchanged by it; a crash or a full disk during the background write is as safe as during a synchronous
save; a stop while a write is in flight keeps that write instead of saving again."""
import errno
import json
import os
import signal
import time

import pytest
from common import learnable_tokens, read_metrics, run_train

from components import checkpoints
from components import out_dir as OD
import train as T

BASE = ["--model=tiny", "--seq_len=16", "--batch_size=4", "--micro_batch_size=1", "--dtype=float32", "--steps=6",
        "--lr=3e-3", "--warmup_steps=2", "--seed=1", "--eval_every=0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return learnable_tokens(str(tmp_path_factory.mktemp("async") / "tok.npy"), 512, n=4000)


def args(data, out, *extra):
    return BASE + [f"--data={data}", f"--out_dir={out}", *extra]


def manifest(out, step):
    with open(os.path.join(out, "checkpoints", f"step_{step:08d}", "manifest.json")) as f:
        return json.load(f)


def losses(out):
    return [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(out)]


def ckpts(out):
    return sorted(n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("step_"))


def latest(out):
    with open(os.path.join(out, "checkpoints", "latest")) as f:
        return f.read().strip()


@pytest.fixture(scope="module")
def never_saves(data, tmp_path_factory):
    """W=2, no save before the last step: the losses and final state every other run must reproduce."""
    out = tmp_path_factory.mktemp("never")
    run_train(args(data, out, "--ckpt_every=0"), nproc=2)
    return out


def test_a_background_save_is_the_synchronous_save_byte_for_byte(data, never_saves, tmp_path):
    """Saves at every step, W=2. Rank 1's write of step 2 takes 3 s longer, so the save of step 3 waits for it
    (at most one in flight) while rank 0 trains on: each checkpoint's rank files (their SHA-256 and size) and
    data position equal a synchronous run's, and the losses and the last state equal a run that never saved."""
    sync, background = tmp_path / "sync", tmp_path / "background"
    run_train(args(data, sync, "--ckpt_every=1", "--keep_ckpts=10", "--async_save=false"), nproc=2)
    proc = run_train(args(data, background, "--ckpt_every=1", "--keep_ckpts=10", "--async_save=true"), nproc=2,
                     env={"ZERO3_FAULT": "slow_save:2:1:3"})
    for step in range(1, 7):
        assert manifest(background, step)["files"] == manifest(sync, step)["files"], step
        assert manifest(background, step)["data"] == manifest(sync, step)["data"], step
    assert manifest(background, 6)["files"] == manifest(never_saves, 6)["files"]
    assert losses(background) == losses(sync) == losses(never_saves)
    assert "checkpoint of step 1: copied to host memory in" in proc.stdout
    # the staging buffer was made in a thread beside the first steps, not before step 1: said once, at the first save
    assert proc.stdout.count("(the staging buffer was made beside the first steps in ") == 1
    waited = [line for line in proc.stdout.splitlines() if "step_00000002 (written in the background" in line]
    assert len(waited) == 1 and float(waited[0].split("training waited ")[1].split(" s")[0]) >= 2.0, waited


def test_a_rank_killed_in_its_background_write_leaves_the_previous_checkpoint(data, never_saves, tmp_path):
    """Rank 1 dies right after writing its file of step 4, in the writer thread, while step 5 trains: no commit,
    `latest` still names step 2, the partial folder has no manifest; the same command resumes from the step-2
    checkpoint (written in the background) and ends bit for bit where the run that never saved did."""
    cmd = args(data, tmp_path, "--ckpt_every=2", "--async_save=true")
    proc = run_train(cmd, nproc=2, env={"ZERO3_FAULT": "kill_in_save:4:1"}, check=False)
    assert proc.returncode != 0
    assert latest(tmp_path) == "step_00000002" and ckpts(tmp_path) == ["step_00000002"]
    assert not os.path.exists(tmp_path / "checkpoints" / ".tmp-step_00000004" / "manifest.json")
    assert not checkpoints.is_complete(str(tmp_path / "checkpoints" / ".tmp-step_00000004"))
    proc = run_train(cmd, nproc=2)
    assert "at step 2" in proc.stdout
    assert losses(tmp_path) == losses(never_saves)
    assert manifest(tmp_path, 6)["files"] == manifest(never_saves, 6)["files"]


@pytest.fixture
def failing_write(monkeypatch):
    """The write of step 2's rank file fails with ENOSPC, as a full disk would."""
    real = OD.write_safetensors_streaming

    def full(path, tensors, metadata=None):
        if "step_00000002" in path:
            with open(path, "wb") as f:
                f.write(b"\0" * 100)  # what fitted
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, tensors, metadata)
    monkeypatch.setattr(OD, "write_safetensors_streaming", full)


def test_a_full_disk_in_the_background_write_is_the_synchronous_line_and_exit_2(data, main_in_process, failing_write,
                                                                                 tmp_path, capsys):
    """The same one line and exit code as a synchronous save's, at the step boundary after the write failed
    (step 3, while the next save would be at step 4), and nothing saved."""
    codes, lines = {}, {}
    for mode in ("false", "true"):
        out = tmp_path / mode
        codes[mode] = main_in_process(args(data, out, "--ckpt_every=2", f"--async_save={mode}"))
        lines[mode] = capsys.readouterr().err.strip().splitlines()[-1].replace(str(out), "OUT")
        assert ckpts(out) == [] and not os.path.exists(out / "checkpoints" / "latest")
        assert [m["step"] for m in read_metrics(out)] == ([1, 2] if mode == "false" else [1, 2, 3])
    assert codes == {"false": 2, "true": 2}
    assert lines["true"] == lines["false"]
    assert lines["true"].startswith("error: checkpoint OUT/checkpoints/step_00000002 was not saved: rank 0 could "
                                    "not write") and "No space left on device" in lines["true"]


@pytest.fixture
def stop_at(monkeypatch):
    """stop_at(step, slow_write_step, wait_s): a SIGUSR1 during `step` (after sleeping wait_s), and the rank file
    of `slow_write_step` written 2 s late."""
    real_step, real_write = T.train_step, OD.write_safetensors_streaming

    def arm(stop_step, slow_write_step, wait_s=0.0):
        def train_step(cfg, sharded, windows, step, position):
            if step == stop_step:
                time.sleep(wait_s)
                os.kill(os.getpid(), signal.SIGUSR1)
            return real_step(cfg, sharded, windows, step, position)

        def write(path, tensors, metadata=None):
            if slow_write_step and f"step_{slow_write_step:08d}" in path:
                time.sleep(2.0)
            return real_write(path, tensors, metadata)
        monkeypatch.setattr(T, "train_step", train_step)
        monkeypatch.setattr(OD, "write_safetensors_streaming", write)
    yield arm
    monkeypatch.setattr(T, "train_step", real_step)
    monkeypatch.setattr(OD, "write_safetensors_streaming", real_write)


def test_a_stop_during_a_background_write_keeps_it_and_resumes_exactly(data, main_in_process, stop_at, tmp_path,
                                                                       capsys):
    """A stop at step 5 while step 4's write still runs: that write is finished, no stop save is taken (the
    stated rule), and the same command redoes step 5 and ends where an uninterrupted run ends. A stop at step
    3, when step 2's write is long done, saves step 3 (synchronously) as it always did."""
    whole = tmp_path / "whole"
    assert main_in_process(args(data, whole, "--ckpt_every=0")) == 0
    out = tmp_path / "stopped"
    cmd = args(data, out, "--ckpt_every=2", "--async_save=true")
    stop_at(5, slow_write_step=4)
    assert main_in_process(cmd) == 0
    stdout = capsys.readouterr().out
    assert "stopping at step 5 on SIGUSR1; its newest checkpoint is the one just written in the background" in stdout
    assert ckpts(out) == ["step_00000002", "step_00000004"] and latest(out) == "step_00000004"
    stop_at(None, slow_write_step=None)
    assert main_in_process(cmd) == 0
    assert "at step 4" in capsys.readouterr().out
    assert losses(out) == losses(whole)
    assert manifest(out, 6)["files"] == manifest(whole, 6)["files"]

    out = tmp_path / "idle"
    stop_at(3, slow_write_step=None, wait_s=1.0)
    assert main_in_process(args(data, out, "--ckpt_every=2", "--async_save=true")) == 0
    assert "stopping at step 3 on SIGUSR1; re-run the same command to continue" in capsys.readouterr().out
    assert ckpts(out) == ["step_00000002", "step_00000003"] and latest(out) == "step_00000003"


def test_background_saves_of_offloaded_state_are_the_synchronous_saves(data, main_in_process, tmp_path):
    """--offload_optimizer: the state a save copies already lives in host memory, and the host optimizer
    updates it in place; the background checkpoints still equal the synchronous ones, step for step."""
    runs = {}
    for mode in ("false", "true"):
        runs[mode] = tmp_path / mode
        extra = ["--ckpt_every=1", "--keep_ckpts=10", "--steps=4", "--offload_optimizer=true", f"--async_save={mode}"]
        assert main_in_process(args(data, runs[mode], *extra)) == 0
    for step in range(1, 5):
        assert manifest(runs["true"], step)["files"] == manifest(runs["false"], step)["files"], step
    assert losses(runs["true"]) == losses(runs["false"])


def test_background_saves_of_frozen_units_are_the_synchronous_saves(data, main_in_process, tmp_path, monkeypatch):
    """--freeze: a frozen unit's staged state is its master shard alone, written by the run's first save into the
    frozen set every checkpoint names (and not again after a resume that keeps --freeze and W); and the manifest's
    per-unit step counts are the snapshot's, not those of the later step at which the background save commits."""
    frozen_writes, write = [], OD.write_safetensors_streaming

    def counting_write(path, *args, **kwargs):  # a frozen set's files, as a save writes them
        if f"{os.sep}{checkpoints.FROZEN_TMP}{os.sep}" in path:
            frozen_writes.append(path)
        return write(path, *args, **kwargs)
    monkeypatch.setattr(OD, "write_safetensors_streaming", counting_write)
    runs = {}
    for mode in ("false", "true"):
        runs[mode] = tmp_path / mode
        extra = ["--ckpt_every=1", "--keep_ckpts=10", r"--freeze=embed_tokens|layers\.0\.", f"--async_save={mode}"]
        assert main_in_process(args(data, runs[mode], *extra, "--steps=4")) == 0
        assert main_in_process(args(data, runs[mode], *extra, "--steps=6")) == 0  # resumes at step 4
    assert len(frozen_writes) == 2  # one set a run, at its first save
    for step in range(1, 7):
        assert manifest(runs["true"], step)["files"] == manifest(runs["false"], step)["files"], step
        assert manifest(runs["true"], step)["units"] == manifest(runs["false"], step)["units"], step
        assert manifest(runs["true"], step)["frozen"] == manifest(runs["false"], step)["frozen"], step
        assert manifest(runs["true"], step)["units"]["layers.1"]["optimizer_steps"] == step
    assert [n for n in os.listdir(runs["true"] / "checkpoints") if n.startswith("frozen-")] == [
        manifest(runs["true"], 1)["frozen"]["folder"]]
    assert manifest(runs["true"], 6)["units"]["embed"] == dict(manifest(runs["true"], 6)["units"]["embed"],
                                                               trained=False, optimizer_state=[], optimizer_steps=0)
    assert losses(runs["true"]) == losses(runs["false"])


def test_the_staging_buffer_is_what_the_planner_counts_and_is_taken_once(data, main_in_process, monkeypatch, tmp_path):
    """The buffer BackgroundSave allocates is what the run's start-up check counts (checks.host_bytes_per_rank) and
    plan.staging_bytes_per_rank's, byte for byte (at W=1 here; the planner's own test checks its formula against
    real units at W=3), taken once and reused by every save."""
    from components import checks
    from tools import plan
    made, copied_into, models = [], [], []
    real_init, real_start, real_setup = checkpoints.BackgroundSave.__init__, checkpoints.BackgroundSave.start, T.setup

    def init(self, units, device):
        real_init(self, units, device)
        made.append(self)

    def start(self, *a, **k):
        real_start(self, *a, **k)
        copied_into.append(self.staged[0][1].data_ptr())

    def setup(cfg):
        result = real_setup(cfg)
        models.append(result[0].model.cfg)
        return result
    monkeypatch.setattr(checkpoints.BackgroundSave, "__init__", init)
    monkeypatch.setattr(checkpoints.BackgroundSave, "start", start)
    monkeypatch.setattr(T, "setup", setup)
    assert main_in_process(args(data, tmp_path, "--ckpt_every=1", "--async_save=true")) == 0
    assert len(made) == 1 and len(copied_into) == 5  # steps 1..5 in the background, step 6 at the end
    assert made[0].staging.numel() == plan.staging_bytes_per_rank(models[0], 1)
    run_count = checks.host_bytes_per_rank(T.TrainConfig(async_save="true"), models[0], 1, None)["async"]["staging"]
    assert made[0].staging.numel() == run_count
    assert set(copied_into) == {made[0].staging.data_ptr()}



def test_a_staging_buffer_that_cannot_be_made_stops_every_rank_at_the_first_save(data, main_in_process, monkeypatch,
                                                                                 tmp_path, capsys):
    """The staging buffer is made off the path to step 1, in a thread; if that fails (host memory, the locked-memory
    limit), the first save says so on every rank (an all-reduce over the checkpoint group first: no rank waits in a
    collective the others left) and the run stops, exit 2: a restart would meet the same limit."""
    def failing(self, tensors, device):
        self.prepare_error, self.prepared_s = RuntimeError("cudaHostRegister of 49.3 GiB failed (CUDA error 2)"), 0.0
    monkeypatch.setattr(checkpoints.BackgroundSave, "prepare", failing)
    assert main_in_process(args(data, tmp_path, "--ckpt_every=2", "--async_save=true")) == 2
    err = capsys.readouterr().err
    assert ("error: --async_save: 1 rank(s) could not make the staging buffer: cudaHostRegister of 49.3 GiB failed "
            "(CUDA error 2)") in err, err[-2000:]
    assert not os.path.exists(os.path.join(tmp_path, "checkpoints", "step_00000002"))
