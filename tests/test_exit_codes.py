"""Which failures stop a run for good (exit code 2: launch.sh stops torchrun's restarts and the job is not
requeued) and which a restart may fix (exit code 1): train.exit_code's allow-list, each case as it happens,
in-process at W=1 (tests/conftest.py's main_in_process) or on two rank threads (tests/ranks.py). Every one is
one line on stderr, no traceback; only exit code 2 writes ZERO3_FATAL_FILE."""
import errno
import os

import pytest
import torch
from common import learnable_tokens, read_metrics

import data as D
import disk
import metrics
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
START_UP = {  # where set-up meets it (train.py's name), the exception, the exit code, the line
    "CUDA OOM, the GPU still held": ("ShardedModel", torch.cuda.OutOfMemoryError(OOM), 1,
                                     "OutOfMemoryError while starting: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 "
                                     "has a total capacity of 79.19 GiB of which 1.06 GiB is free. Process 4242 has 77.80 "
                                     "GiB memory in use (at train.py:{line}); a restart may succeed"),
    "process group init": ("init_processes", RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system "
                                                          "error (run with NCCL_DEBUG=INFO for details)"), 1,
                           "RuntimeError while starting: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system "
                           "error (run with NCCL_DEBUG=INFO for details) (at train.py:{line}); a restart may succeed"),
    "an ECC error": ("ShardedModel", RuntimeError("CUDA error: uncorrectable ECC error encountered\nCUDA kernel errors "
                                                  "might be asynchronously reported"), 1,
                     "RuntimeError while starting: CUDA error: uncorrectable ECC error encountered (at train.py:{line}); "
                     "a restart may succeed"),
    "a type nobody listed": ("ShardedModel", NobodyListed("something new"), 1,
                             "NobodyListed while starting: something new (at train.py:{line}); a restart may succeed"),
    "an I/O error": ("ShardedModel", OSError(errno.EIO, os.strerror(errno.EIO), "/shared/x"), 1,
                     "OSError while starting: /shared/x: Input/output error; a restart may succeed"),
    # Shown to repeat: a restart would meet them again.
    "bad data": ("ShardedModel", D.DataError("--data: x.npy has token id 700 at position 100"), 2,
                 "--data: x.npy has token id 700 at position 100"),
    "a resume under other flags": ("ShardedModel", disk.ResumeMismatch("--resume: checkpoint C was saved under other "
                                                                       "values"), 2,
                                   "--resume: checkpoint C was saved under other values"),
    "a full disk": ("ShardedModel", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/shared/x"), 2,
                    "/shared/x: No space left on device (the filesystem is full, of bytes or of inodes: df -h and df -i "
                    "say which)"),
    "a missing package": ("ShardedModel", ImportError("--tensorboard needs the tensorboard package: pip install "
                                                      "tensorboard"), 2,
                          "--tensorboard needs the tensorboard package: pip install tensorboard"),
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
    monkeypatch.setattr(T, where, raise_(exception))
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
