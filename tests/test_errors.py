"""Bad input gets one clear line naming the flag or file, on every rank, before any work: never a hang."""
import numpy as np
import pytest
from common import run_train


@pytest.fixture
def tokens(tmp_path):
    def make(values, name="tok.npy"):
        path = tmp_path / name
        np.save(path, np.asarray(values))
        return str(path)
    return make


CASES = [
    (["--batch_size=10", "--micro_batch_size=4"], "--batch_size: 10 is not a multiple of world size x --micro_batch_size = 2 x 4 = 8"),
    (["--model=llama9"], "--model: unknown preset 'llama9'"),
    (["--init_from=/nonexistent"], "--init_from: /nonexistent/config.json does not exist"),
    (["--data=/nonexistent.npy"], "--data: /nonexistent.npy does not exist"),
    (["--ac=some"], "--ac: 'some' is not one of none, full, selective"),
    (["--dtype=float16"], "--dtype: 'float16' is not one of auto, bfloat16, float32"),
    (["--seq_len=0"], "--seq_len: must be >= 1"),
    (["--out_dir=/proc/version/out"], "--out_dir: /proc/version/out is not writable"),
    (["--keep_ckpts=1"], "--keep_ckpts must be >= 2"),
    (["--resume=maybe"], "--resume: 'maybe' is not one of auto, never"),
    (["--from_ckpt=/nonexistent"], "--from_ckpt: /nonexistent/manifest.json does not exist"),
]


@pytest.mark.parametrize("flags,message", CASES, ids=[c[0][0].split("=")[0] for c in CASES])
def test_bad_flags(tmp_path, flags, message):
    out = [] if any(f.startswith("--out_dir") for f in flags) else [f"--out_dir={tmp_path}"]
    proc = run_train(flags + out, nproc=2, check=False, timeout=120)
    assert proc.returncode != 0
    # Each rank checks the flags itself before any collective; torchrun stops the other rank as soon as
    # one exits, so one or two ranks get to print -- the same single line.
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert 1 <= len(lines) <= 2 and all(message in line for line in lines), proc.stderr[-3000:]
    assert 'train.py", line' not in proc.stderr  # no traceback out of the trainer, only the line


def test_token_beyond_vocabulary(tmp_path, tokens):
    path = tokens(np.r_[np.zeros(100, np.int32), 700, np.zeros(100, np.int32)])
    proc = run_train([f"--data={path}", f"--out_dir={tmp_path}"], check=False, timeout=120)
    assert proc.returncode != 0
    assert f"--data: {path} has token id 700 at position 100, outside the model's vocabulary [0, 512)" in proc.stderr


def test_data_shorter_than_one_window(tmp_path, tokens):
    path = tokens(np.arange(10, dtype=np.uint16))
    proc = run_train([f"--data={path}", "--seq_len=16", f"--out_dir={tmp_path}"], check=False, timeout=120)
    assert proc.returncode != 0 and "has 10 tokens; at least seq_len + 1 = 17 are needed" in proc.stderr


def test_not_a_token_array(tmp_path, tokens):
    path = tokens(np.zeros((4, 4), np.float32))
    proc = run_train([f"--data={path}", f"--out_dir={tmp_path}"], check=False, timeout=120)
    assert proc.returncode != 0 and "must be a 1-D integer array" in proc.stderr
