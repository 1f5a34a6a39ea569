"""Phases: a new run from one of our checkpoints' weights (--init_from a step_* folder or an --out_dir), with
a fresh optimizer, step 1, its own data position, world size and sequence length; the checkpoint is checked
before any work; --from_ckpt names the checkpoint it really read; every export carries the tokenizer of
the run's data. Multi-process gloo on CPU."""
import json
import os
import shutil

import pytest
import torch
from common import read_metrics, run_train
from safetensors.torch import load_file
from test_data import TEXTS

from tools import prepare as prep
from tools import tokenizer as TK
import train as T
from components.checks import check_run

TINY = ["--model=tiny", "--dtype=float32", "--eval_every=0", "--micro_batch_size=1"]


@pytest.fixture(scope="module")
def phase_one(tmp_path_factory):
    """Data prepared with a sentencepiece tokenizer of our own; run A: 2 steps at W=2, exported; then A's step-2
    checkpoint converted at W=1 with --from_ckpt given A's --out_dir, and run B: --init_from A's step folder at
    W=1 with --seq_len 32 and a learning rate too small to move any weight (Adam moves a weight by about lr;
    1e-30 is far below a float32 weight's last bit), exported."""
    root = tmp_path_factory.mktemp("phases")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in TEXTS * 40), encoding="utf-8")
    tokenizer = str(root / "tok.model")
    prep.train_tokenizer([str(corpus)], 400, tokenizer)
    data = str(root / "data")
    prep.prepare([str(corpus)], tokenizer, data, quiet=True)
    a, b = root / "a", root / "b"
    run_train(TINY + [f"--data={data}", "--steps=2", "--seq_len=16", "--batch_size=4", "--warmup_steps=1",
                      f"--out_dir={a}", f"--export_hf={a / 'hf'}"], nproc=2)
    step_folder = os.path.join(a, "checkpoints", "step_00000002")
    convert = run_train(["--dtype=float32", f"--from_ckpt={a}", f"--export_hf={root / 'a_converted'}",
                         f"--out_dir={root / 'convert'}"], nproc=1)
    phase_b = run_train(TINY[1:] + [f"--init_from={step_folder}", f"--data={data}", "--steps=1", "--seq_len=32",
                                    "--batch_size=2", "--lr=1e-30", "--weight_decay=0", "--warmup_steps=0",
                                    f"--out_dir={b}", f"--export_hf={b / 'hf'}"], nproc=1)
    return dict(root=root, data=data, tokenizer=tokenizer, a=a, convert=convert, b=b, phase_b=phase_b)


def weights(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


def test_from_ckpt_names_the_checkpoint_it_read_and_exports_the_tokenizer(phase_one):
    """--from_ckpt OUT_DIR follows OUT_DIR's latest and prints that step folder (today: a folder under the
    conversion's own --out_dir, which it never read); the conversion equals the run's own export; both hold
    the data's tokenizer, and config.json the tokenizer's end ids."""
    from transformers import AutoTokenizer
    a, root = phase_one["a"], phase_one["root"]
    step_folder = os.path.join(a, "checkpoints", "step_00000002")
    assert f"read checkpoint {step_folder} (step 2)" in phase_one["convert"].stdout
    assert "resumed from" not in phase_one["convert"].stdout
    own, converted = weights(a / "hf"), weights(root / "a_converted")
    assert own.keys() == converted.keys() and all(torch.equal(own[k], converted[k]) for k in own)
    tok = TK.Tokenizer(phase_one["tokenizer"])
    for folder in (a / "hf", root / "a_converted"):
        config = json.loads((folder / "config.json").read_text())
        generation = json.loads((folder / "generation_config.json").read_text())
        assert config["eos_token_id"] == generation["eos_token_id"] == [tok.eos_id, tok.piece_id("<|eot_id|>")]
        hf = AutoTokenizer.from_pretrained(str(folder))
        assert hf(TEXTS[2], add_special_tokens=False)["input_ids"] == tok.encode([TEXTS[2]], True)[0]


def test_a_new_phase_starts_from_the_checkpoint_weights_at_another_world_size_and_seq_len(phase_one):
    """Run B (the fixture's), from A's step folder at W=1 and seq 32 with lr 1e-30: step 1, and its export
    is exactly A's checkpoint, with A's tokenizer."""
    a, b, root = phase_one["a"], phase_one["b"], phase_one["root"]
    step_folder = os.path.join(a, "checkpoints", "step_00000002")
    assert (f"started from the weights of checkpoint {step_folder} (a new phase: step 1, a fresh optimizer and data "
            f"position); taken: embed, layers.0-3, head; new, initialised as a run from scratch (--seed 0): none\n"
            ) in phase_one["phase_b"].stdout
    assert [m["step"] for m in read_metrics(b)] == [1]
    assert json.load(open(b / "checkpoints" / "step_00000001" / "manifest.json"))["model"] == \
        json.load(open(os.path.join(step_folder, "manifest.json")))["model"]
    got, expected = weights(b / "hf"), weights(root / "a_converted")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    assert (b / "hf" / "tokenizer.json").read_bytes() == (a / "hf" / "tokenizer.json").read_bytes()


def flags(phase_one, tmp_path, *extra):
    return T.parse_args([f"--init_from={phase_one['a']}", f"--data={phase_one['data']}", "--steps=1",
                         f"--out_dir={tmp_path / 'out'}", *extra])


def copy_of_a(phase_one, tmp_path):
    copy = tmp_path / "a"
    shutil.copytree(phase_one["a"] / "checkpoints", copy / "checkpoints")
    return copy, copy / "checkpoints" / "step_00000002"


def test_bad_init_from_checkpoints_are_one_line_before_any_work(phase_one, tmp_path):
    """The checks every rank runs before any process group exists (checks.check_run)."""
    mcfg, source, errors = check_run(flags(phase_one, tmp_path, "--model=tiny"), 2)
    assert errors == [] and source == os.path.join(phase_one["a"], "checkpoints", "step_00000002")
    assert mcfg.vocab_size == 400 and mcfg.n_layers == 4  # the checkpoint's model: the data's vocabulary

    _, _, errors = check_run(flags(phase_one, tmp_path, "--model=llama3-8b"), 2)
    assert len(errors) == 1 and errors[0].startswith(
        f"--model: llama3-8b is not the model of --init_from {source}, which decides the model (its manifest.json): "
        f"they differ in dim 4096 vs 256, n_layers 32 vs 4")

    copy, step = copy_of_a(phase_one, tmp_path)
    os.truncate(step / "rank00001-of-00002.safetensors", 1000)
    _, _, errors = check_run(T.parse_args([f"--init_from={copy}", f"--out_dir={tmp_path / 'o'}", "--steps=0"]), 1)
    assert errors == [f"--init_from: checkpoint {step}: rank00001-of-00002.safetensors has 1000 bytes, the manifest "
                      f"says {json.load(open(step / 'manifest.json'))['files']['rank00001-of-00002.safetensors']['bytes']} "
                      f"(truncated?)"]

    (copy / "checkpoints" / "latest").write_text("step_00000009\n")
    _, _, errors = check_run(T.parse_args([f"--init_from={copy}", f"--out_dir={tmp_path / 'o'}", "--steps=0"]), 1)
    assert len(errors) == 1 and errors[0].startswith(f"--init_from: {copy / 'checkpoints' / 'latest'} names 'step_00000009'")

    (tmp_path / "neither").mkdir()
    _, _, errors = check_run(T.parse_args([f"--init_from={tmp_path / 'neither'}", f"--out_dir={tmp_path / 'o'}"]), 1)
    assert errors == [f"--init_from: {tmp_path / 'neither'} is neither a Hugging Face folder (no config.json) nor one "
                      f"of our checkpoints (no manifest.json, and no checkpoints/step_* folder in it)"]


def test_a_phase_on_data_of_another_tokenizer_is_refused(phase_one, tmp_path):
    corpus = tmp_path / "other.jsonl"
    corpus.write_text("".join(json.dumps({"text": t[::-1]}, ensure_ascii=False) + "\n" for t in TEXTS * 40),
                      encoding="utf-8")
    prep.train_tokenizer([str(corpus)], 400, str(tmp_path / "other.model"))
    prep.prepare([str(corpus)], str(tmp_path / "other.model"), str(tmp_path / "other"), quiet=True)
    _, _, errors = check_run(flags(phase_one, tmp_path, f"--data={tmp_path / 'other'}"), 1)
    assert len(errors) == 1 and errors[0].startswith(f"--data: {tmp_path / 'other'} was tokenized with "
                                                     f"{tmp_path / 'other.model'}, and the model of --init_from")


def test_a_damaged_init_from_checkpoint_stops_every_rank_before_the_first_step(phase_one, tmp_path):
    copy, step = copy_of_a(phase_one, tmp_path)
    path = step / "rank00000-of-00002.safetensors"
    with open(path, "r+b") as f:  # one flipped byte: the size is right, the SHA-256 is not
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    proc = run_train(TINY + [f"--init_from={copy}", f"--data={phase_one['data']}", "--steps=1", "--seq_len=16",
                             "--batch_size=2", f"--out_dir={tmp_path / 'out'}"], nproc=2, check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines and all(line.startswith("error: --init_from: checkpoint ") for line in lines), proc.stderr[-3000:]
    assert f"error: --init_from: checkpoint {step}: rank00000-of-00002.safetensors does not match its SHA-256 (damaged)" \
        in proc.stderr
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")
