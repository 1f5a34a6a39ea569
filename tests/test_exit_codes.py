"""Which failures stop a run for good (exit code 2: launch.sh stops torchrun's restarts and the job is not
requeued) and which a restart may fix (exit code 1): train.exit_code's allow-list, each case as it happens,
in-process at W=1 (tests/conftest.py's main_in_process) or on two rank threads (tests/ranks.py). Every one is
one line on stderr, no traceback; only exit code 2 writes ZERO3_FATAL_FILE."""
import errno
import os
import socket

import pytest
import torch
import torch.distributed as dist
from common import learnable_tokens, read_metrics, small_config, stand_in_unit
from ranks import run_ranks

import data as D
from components import checkpoints
from components import out_dir as OD
from components import metrics
import train as T


def tiny_run(tmp_path, *extra):
    data = learnable_tokens(str(tmp_path / "tok.npy"), 512, n=2000)
    return ["--model=tiny", "--dtype=float32", "--eval_every=0", "--seq_len=16", "--batch_size=2",
            "--micro_batch_size=1", "--warmup_steps=1", "--steps=4", "--ckpt_every=2", f"--data={data}",
            f"--out_dir={tmp_path / 'out'}", *extra]


@pytest.fixture
def fatal_file(tmp_path, monkeypatch):
    """launch.sh's ZERO3_FATAL_FILE: train.py writes its line there only when a restart would repeat it."""
    path = tmp_path / "fatal"
    monkeypatch.setenv("ZERO3_FATAL_FILE", str(path))
    return path


def only_line(stderr: str) -> str:
    """The one error line stderr holds, with no traceback around it."""
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and stderr.splitlines()[-1] == errors[0], stderr[-3000:]
    return errors[0]


class NobodyListed(Exception):
    """An exception type train.exit_code has never heard of."""


def raise_(e):
    def raising(*args, **kwargs):
        raise e
    return raising


OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is "
       "free. Process 4242 has 77.80 GiB memory in use.\nOf the allocated memory 0 bytes is allocated by PyTorch")
# NCCL's error as torch raises it when ibv_reg_mr cannot lock the InfiniBand buffers: the cause on its last line.
IBV_REG_MR = ("NCCL error in: /opt/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled system error "
              "(run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclSystemError: System call (e.g. socket, "
              "malloc) or external library call failed or device error. \nLast error:\nCall to ibv_reg_mr failed with "
              "error Cannot allocate memory")
GLOO = ("the checkpoint group (gloo: TCP between every pair of ranks) did not connect within 120 s (Timed out connecting "
        "to 10.0.0.2:41233): gloo listens on the address this host's name resolves to unless GLOO_SOCKET_IFNAME names "
        "the interface between the nodes; every node must reach the others on any TCP port")
HERE = f"rank 0 ({socket.gethostname()})"  # RANK unset: one process
# The exit-code policy (processes.py), case by case: where set-up meets it (a name train.setup calls), the exception,
# the exit code, the line.
START_UP = {
    "CUDA OOM, the GPU still held": ("build_sharded_model", torch.cuda.OutOfMemoryError(OOM), 1,
                                     f"OutOfMemoryError while starting on {HERE}: CUDA out of memory. Tried to allocate "
                                     "2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free. Process "
                                     "4242 has 77.80 GiB memory in use (at train.py:{line}); a restart may succeed"),
    "process group init": ("processes.make_group", RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled "
                                                                "system error (run with NCCL_DEBUG=INFO for details)"), 1,
                           f"RuntimeError while starting on {HERE}: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled "
                           "system error (run with NCCL_DEBUG=INFO for details) (at train.py:{line}); a restart may succeed"),
    "NCCL's cause on a later line": ("processes.make_group", RuntimeError(IBV_REG_MR), 1,
                                     f"RuntimeError while starting on {HERE}: NCCL error in: /opt/pytorch/torch/csrc/"
                                     "distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled system error (run with "
                                     "NCCL_DEBUG=INFO for details), NCCL version 2.21.5: Call to ibv_reg_mr failed with "
                                     "error Cannot allocate memory (at train.py:{line}); a restart may succeed"),
    "NCCL with no cause given": ("processes.make_group", RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:2023, internal "
                                                                      "error, NCCL version 2.21.5"), 1,
                                 f"RuntimeError while starting on {HERE}: NCCL error in: ProcessGroupNCCL.cpp:2023, "
                                 "internal error, NCCL version 2.21.5; run with NCCL_DEBUG=INFO for NCCL's own account "
                                 "of it (at train.py:{line}); a restart may succeed"),
    "an ECC error": ("build_sharded_model", RuntimeError("CUDA error: uncorrectable ECC error encountered\nCUDA kernel errors "
                                                  "might be asynchronously reported"), 1,
                     f"RuntimeError while starting on {HERE}: CUDA error: uncorrectable ECC error encountered (at "
                     "train.py:{line}); a restart may succeed"),
    "a type nobody listed": ("build_sharded_model", NobodyListed("something new"), 1,
                             f"NobodyListed while starting on {HERE}: something new (at train.py:{{line}}); a restart may "
                             "succeed"),
    "an I/O error": ("build_sharded_model", OSError(errno.EIO, os.strerror(errno.EIO), "/shared/x"), 1,
                     "OSError while starting: /shared/x: Input/output error; a restart may succeed"),
    # Shown to repeat: a restart would meet them again.
    "bad data": ("build_sharded_model", D.DataError("--data: x.npy has token id 700 at position 100"), 2,
                 "--data: x.npy has token id 700 at position 100"),
    "a resume under other flags": ("build_sharded_model", checkpoints.ResumeMismatch("--resume: checkpoint C was saved under other "
                                                                       "values"), 2,
                                   "--resume: checkpoint C was saved under other values"),
    "a full disk": ("build_sharded_model", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/shared/x"), 2,
                    "/shared/x: No space left on device (the filesystem is full, of bytes or of inodes: df -h and df -i "
                    "say which)"),
    "a missing package": ("build_sharded_model", ImportError("--tensorboard needs the tensorboard package: pip install "
                                                      "tensorboard"), 2,
                          "--tensorboard needs the tensorboard package: pip install tensorboard"),
    "an unreachable gloo address": ("OD.make_group", OD.GroupUnreachable(GLOO), 2, GLOO),  # configuration, not luck
}


def call_line(name: str) -> int:
    """The line in train.setup that calls `name`: the place the line names."""
    import inspect
    lines, first = inspect.getsourcelines(T.setup)
    return first + next(i for i, line in enumerate(lines) if f"{name}(" in line and "def " not in line)


@pytest.mark.parametrize("case", list(START_UP))
def test_a_start_up_fault_is_one_line_and_only_what_repeats_stops_for_good(main_in_process, tmp_path, monkeypatch,
                                                                           capsys, fatal_file, case):
    where, exception, code, line = START_UP[case]
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    owner, _, name = where.rpartition(".")
    monkeypatch.setattr(getattr(T, owner) if owner else T, name, raise_(exception))
    assert main_in_process(tiny_run(tmp_path)) == code
    assert only_line(capsys.readouterr().err) == f"error: {line.format(line=call_line(where))}"
    assert fatal_file.exists() == (code == 2)
    if code == 2:
        assert fatal_file.read_text() == f"error: {line}\n"


def test_a_bad_flag_still_stops_for_good(main_in_process, tmp_path, capsys, fatal_file):
    assert main_in_process(tiny_run(tmp_path, "--data=/nonexistent.npy")) == 2
    assert only_line(capsys.readouterr().err) == "error: --data: /nonexistent.npy does not exist"
    assert fatal_file.read_text() == "error: --data: /nonexistent.npy does not exist\n"


# -- a full disk in the loop: metrics.jsonl ---------------------------------------------------------------------

class FullDisk:
    """metrics.jsonl on a disk that fills at step `full_at`: the write fails with `code`, and so does the close
    (Python's close flushes what is still buffered, and meets the same full disk)."""

    def __init__(self, f, full_at: int, code: int):
        self.f, self.full_at, self.code, self.full = f, full_at, code, False

    def write(self, text):
        if f'"step": {self.full_at},' in text:
            self.full = True
        if self.full:
            raise OSError(self.code, os.strerror(self.code))
        return self.f.write(text)

    def flush(self):
        self.f.flush()

    def close(self):
        self.f.close()
        if self.full:
            raise OSError(self.code, os.strerror(self.code))


@pytest.mark.parametrize("code,exit_code", [(errno.ENOSPC, 2), (errno.EDQUOT, 2), (errno.EIO, 1)],
                         ids=["ENOSPC", "EDQUOT", "EIO"])
def test_metrics_on_a_full_disk_is_one_line_even_when_the_close_fails_too(main_in_process, tmp_path, monkeypatch,
                                                                          capsys, fatal_file, code, exit_code):
    """The close that failed again used to escape from MetricsLog.step: a traceback, exit code 1, a restart that
    met the same full disk, and only then the line. A full disk stops for good; EIO may pass."""
    real_open = metrics.open_metrics
    monkeypatch.setattr(metrics, "open_metrics", lambda *a: (lambda f, t: (FullDisk(f, 3, code), t))(*real_open(*a)))
    assert main_in_process(tiny_run(tmp_path)) == exit_code
    path = tmp_path / "out" / "metrics.jsonl"
    hint = {errno.ENOSPC: " (the filesystem is full, of bytes or of inodes: df -h and df -i say which)",
            errno.EDQUOT: " (the disk quota is used up: quota -s shows it)", errno.EIO: ""}[code]
    line = (f"error: --out_dir: cannot write {path}: {os.strerror(code)}{hint}; the run stops without saving: once the "
            f"file can be written, the same command resumes from the last checkpoint")
    assert only_line(capsys.readouterr().err) == line
    assert fatal_file.exists() == (exit_code == 2)
    assert [m["step"] for m in read_metrics(tmp_path / "out")] == [1, 2]
    assert (tmp_path / "out" / "checkpoints" / "latest").read_text() == "step_00000002\n"


# -- reading a checkpoint: an I/O error is retried, then named; never a rollback ----------------------------------

def units_of(rank: int, world: int = 2):
    """Two stand-ins for train.py's units of 6 elements: this rank's half, told apart by their master weights."""
    n = 6 // world
    return [stand_in_unit(f"u{i}", rank=rank, world=world,
                          master_shard=torch.arange(n * rank, n * rank + n, dtype=torch.float32) + 10 * i,
                          optimizer_state={"exp_avg": torch.zeros(n), "exp_avg_sq": torch.ones(n)})
            for i in range(2)]


def failing_open(monkeypatch, suffix: str, code: int, times: int):
    """open() in out_dir.py and checkpoints.py raises OSError(code) for a path ending in `suffix`, the first `times`
    times. Returns the list of the paths it failed."""
    failed = []

    def fake_open(path, *args, **kwargs):
        if os.fspath(path).endswith(suffix) and len(failed) < times:
            failed.append(os.fspath(path))
            raise OSError(code, os.strerror(code), os.fspath(path))
        return open(path, *args, **kwargs)
    for module in (OD, checkpoints):
        monkeypatch.setattr(module, "open", fake_open, raising=False)
    return failed


@pytest.fixture
def two_checkpoints(tmp_path, monkeypatch):
    """Steps 2 and 4 saved by two ranks (threads); `latest` names step 4."""
    monkeypatch.setattr(OD, "group", None)  # each rank thread's own default group
    monkeypatch.setattr(OD, "READ_WAITS_S", (0.0, 0.0))
    cfg = T.parse_args([f"--out_dir={tmp_path}", "--keep_ckpts=3"])

    def save(rank):
        for step in (2, 4):
            checkpoints.save_checkpoint(cfg, small_config(), units_of(rank), step, rank, 2, {"position": 10 * step})
    run_ranks(2, save)
    return cfg


def resume_on_two_ranks(cfg):
    def rank_resume(rank):
        units = units_of(rank)
        for u in units:
            u.master_shard.zero_()
        try:
            step = checkpoints.resume(cfg, small_config(), units, None, rank, checkpoints.candidates_on_disk(
                os.path.join(cfg.out_dir, "checkpoints")))
            return step, [u.master_shard.tolist() for u in units]
        except (OD.CheckpointError, OSError) as e:
            return e
    return run_ranks(2, rank_resume)


@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE], ids=["EIO", "ESTALE"])
def test_a_checkpoint_read_error_that_passes_is_retried(two_checkpoints, monkeypatch, capsys, code):
    failed = failing_open(monkeypatch, "step_00000004/rank00001-of-00002.safetensors", code, times=1)
    resumed = resume_on_two_ranks(two_checkpoints)
    assert len(failed) == 1  # rank 1 met it once, and read the file on the second try
    assert [r[0] for r in resumed] == [(4, 40), (4, 40)]
    assert [r[1] for r in resumed] == [[u.master_shard.tolist() for u in units_of(rank)] for rank in (0, 1)]
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE], ids=["EIO", "ESTALE"])
def test_a_checkpoint_read_error_that_lasts_is_named_and_never_rolls_back(two_checkpoints, monkeypatch, capsys, code):
    """Rank 1 cannot read its file of step 4; rank 0 read its own. Both stop (exit code 1: a restart may read it),
    neither resumes from step 2: falling back would silently throw away steps 3 and 4."""
    failed = failing_open(monkeypatch, "step_00000004/rank00001-of-00002.safetensors", code, times=100)
    resumed = resume_on_two_ranks(two_checkpoints)
    assert len(failed) == 3  # READ_WAITS_S: two waits, three tries
    ckpt = os.path.join(two_checkpoints.out_dir, "checkpoints", "step_00000004")
    assert all(isinstance(r, OD.CheckpointUnreadable) and T.exit_code(r) == 1 for r in resumed), resumed
    assert str(resumed[1]) == (f"checkpoint {ckpt}: cannot read {ckpt}/rank00001-of-00002.safetensors: "
                               f"{os.strerror(code)} (tried 3 times over 0 s); the older checkpoints were not used: a "
                               f"read error is not damage")
    assert str(resumed[0]) == (f"checkpoint {ckpt}: rank(s) 1 could not read it (their line names the file); the older "
                               f"checkpoints were not used: a read error is not damage")
    assert "previous checkpoint" not in capsys.readouterr().err


def test_a_checkpoint_read_error_at_resume_exits_1_naming_the_file(main_in_process, tmp_path, monkeypatch, capsys,
                                                                   fatal_file):
    """The whole run: the same command after a 4-step run, whose step-4 file cannot be read. One line, exit code 1,
    and nothing trained from the older step 2 (metrics.jsonl and the checkpoints as they were)."""
    assert main_in_process(tiny_run(tmp_path)) == 0
    capsys.readouterr()
    monkeypatch.setattr(OD, "READ_WAITS_S", (0.0,))
    failing_open(monkeypatch, "step_00000004/rank00000-of-00001.safetensors", errno.EIO, times=100)
    assert main_in_process(tiny_run(tmp_path, "--steps=6")) == 1
    ckpt = tmp_path / "out" / "checkpoints" / "step_00000004"
    assert only_line(capsys.readouterr().err) == (
        f"error: checkpoint {ckpt}: cannot read {ckpt}/rank00000-of-00001.safetensors: Input/output error (tried 2 "
        f"times over 0 s); the older checkpoints were not used: a read error is not damage")
    assert not fatal_file.exists()
    assert [m["step"] for m in read_metrics(tmp_path / "out")] == [1, 2, 3, 4]
    assert sorted(os.listdir(tmp_path / "out" / "checkpoints")) == ["latest", "step_00000002", "step_00000004"]


def test_a_damaged_checkpoint_still_falls_back(two_checkpoints, capsys):
    """Provably damaged content (a byte changed: the SHA-256 does not match) is what resume passes by, as before."""
    path = os.path.join(two_checkpoints.out_dir, "checkpoints", "step_00000004", "rank00001-of-00002.safetensors")
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\xff")
    assert [r[0] for r in resume_on_two_ranks(two_checkpoints)] == [(2, 20), (2, 20)]
    assert "does not match its SHA-256 (damaged)" in capsys.readouterr().err


@pytest.mark.parametrize("code,exit_code", [(errno.ENOSPC, 2), (errno.EIO, 1)], ids=["ENOSPC", "EIO"])
def test_a_save_that_fails_on_one_rank_gives_every_rank_its_exit_code(tmp_path, monkeypatch, code, exit_code):
    """Rank 1 cannot write its file; rank 0 only learns that it failed. Both raise with rank 1's errno, so both exit
    with the same code: a full disk stops every rank for good, an EIO is retried by every rank."""
    monkeypatch.setattr(OD, "group", None)
    cfg = T.parse_args([f"--out_dir={tmp_path}", "--keep_ckpts=3"])
    failing_open(monkeypatch, "rank00001-of-00002.safetensors", code, times=100)

    def save(rank):
        try:
            checkpoints.save_checkpoint(cfg, small_config(), units_of(rank), 2, rank, 2, None)
        except OD.CheckpointError as e:
            return e
    errors = run_ranks(2, save)
    assert [T.exit_code(e) for e in errors] == [exit_code, exit_code], errors
    assert f"rank 1 could not write {tmp_path}/checkpoints/.tmp-step_00000002/rank00001-of-00002.safetensors: " \
           f"{os.strerror(code)}" in str(errors[1])
    assert not os.path.exists(tmp_path / "checkpoints" / "step_00000002")
