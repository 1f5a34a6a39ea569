"""Bad input gets one clear line naming the flag or file, on every rank, before any work: never a hang."""
import os
import subprocess
import sys
from dataclasses import fields

import numpy as np
import pytest
import torch
from common import ROOT, run_train

from components import flags
import train as T


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
    (["--init_from=/nonexistent"], "--init_from: /nonexistent does not exist"),
    (["--data=/nonexistent.npy"], "--data: /nonexistent.npy does not exist"),
    (["--ac=some"], "--ac: 'some' is not one of none, full, selective"),
    (["--dtype=float16"], "--dtype: 'float16' is not one of auto, bfloat16, float32"),
    (["--seq_len=0"], "--seq_len: must be >= 1"),
    (["--out_dir=/proc/version/out"], "--out_dir: /proc/version/out is not writable"),
    (["--keep_ckpts=1"], "--keep_ckpts must be >= 2"),
    (["--resume=maybe"], "--resume: 'maybe' is not one of auto, never"),
    (["--from_ckpt=/nonexistent"], "--from_ckpt: /nonexistent does not exist"),
]


@pytest.mark.parametrize("flags,message", CASES, ids=[c[0][0].split("=")[0] for c in CASES])
def test_bad_flags(tmp_path, flags, message, train_at):
    """One rank in this process (W=2 only where the line names W: each rank checks the flags itself before any
    collective, the same code at any W; launch and torchrun are tested elsewhere)."""
    out = [] if any(f.startswith("--out_dir") for f in flags) else [f"--out_dir={tmp_path}"]
    code, stderr = train_at(flags + out, 2 if "world size" in message else 1, timeout=120)
    assert code != 0
    # torchrun stops the other rank as soon as one exits, so one or two ranks get to print -- the same line.
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert 1 <= len(lines) <= 2 and all(message in line for line in lines), stderr[-3000:]
    assert 'train.py", line' not in stderr  # no traceback out of the trainer, only the line


# A token file train.py cannot use: one rank in this process (test_bad_flags says why).
def test_token_beyond_vocabulary(tmp_path, tokens, train_at):
    path = tokens(np.r_[np.zeros(100, np.int32), 700, np.zeros(100, np.int32)])
    code, stderr = train_at([f"--data={path}", f"--out_dir={tmp_path}"])
    assert code != 0
    assert f"--data: {path} has token id 700 at position 100, outside the model's vocabulary [0, 512)" in stderr


def test_data_shorter_than_one_window(tmp_path, tokens, train_at):
    path = tokens(np.arange(10, dtype=np.uint16))
    code, stderr = train_at([f"--data={path}", "--seq_len=16", f"--out_dir={tmp_path}"])
    assert code != 0 and "has 10 tokens; at least seq_len + 1 = 17 are needed" in stderr


def test_not_a_token_array(tmp_path, tokens, train_at):
    path = tokens(np.zeros((4, 4), np.float32))
    code, stderr = train_at([f"--data={path}", f"--out_dir={tmp_path}"])
    assert code != 0 and "must be a 1-D integer array" in stderr


# -- the command line, as a newcomer meets it (in-process: train.parse_args, flags.config_warnings) ------------

def test_help_shows_every_flags_default(capsys):
    with pytest.raises(SystemExit) as e:
        T.parse_args(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    assert text.count("(default: ") == len(fields(T.TrainConfig))
    for expected in ["--steps STEPS optimizer steps (0: no training, e.g. to convert --init_from to --export_hf) "
                     "(default: 200)",
                     "--lr LR peak learning rate (default: 0.001)",
                     "--prefetch [PREFETCH] all-gather the next unit while the current one computes (default: true)",
                     "--init_from INIT_FROM weights to start from: a Hugging Face Llama folder (config.json + "
                     "*.safetensors), or one of our checkpoints",
                     "any world size (default: unset)",
                     "after warmup: 'cosine' (to 10% of --lr at --steps) or 'constant' (default: cosine)"]:
        assert expected in text


@pytest.mark.parametrize("argv,message", [
    (["--max_steps", "5"], "unrecognized flag --max_steps; did you mean --steps?"),
    (["--max_steps=5"], "unrecognized flag --max_steps; did you mean --steps?"),
    (["--preset", "llama3-8b"], "unrecognized flag --preset; did you mean --model?"),
    (["--learning_rate=1e-4"], "unrecognized flag --learning_rate; did you mean --lr?"),
    (["--seqlen", "512"], "unrecognized flag --seqlen; did you mean --seq_len?"),
    (["--out-dir", "x"], "unrecognized flag --out-dir; did you mean --out_dir?"),
    (["--zzz", "1"], "unrecognized flag --zzz; python train.py --help lists the flags"),
    (["--steps", "5", "10"], "unexpected argument '10': flags are --name value or --name=value"),
    (["--steps", "five"], "argument --steps: invalid int value: 'five'"),
    (["--prefetch", "maybe"], "argument --prefetch: expected true, false, 1 or 0, got 'maybe'"),
])
def test_a_bad_or_unknown_flag_is_one_line_naming_the_nearest(argv, message):
    with pytest.raises(ValueError) as e:
        T.parse_args(argv)
    assert str(e.value) == message


def test_both_flag_spellings_still_parse():
    assert T.parse_args(["--steps=5", "--lr", "1e-4"]).steps == 5
    assert T.parse_args(["--steps", "5"]).steps == 5
    cfg = T.parse_args(["--prefetch", "false", "--plan", "--doc_mask=0"])
    assert (cfg.prefetch, cfg.plan, cfg.doc_mask) == (False, True, False)


def test_an_unknown_flag_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--max_steps", "5"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: unrecognized flag --max_steps; did you mean --steps?"]


def test_warmup_as_long_as_the_run_is_a_warning_not_an_error(tmp_path):
    cfg = T.parse_args(["--steps=10", "--warmup_steps=20", f"--out_dir={tmp_path}"])
    assert flags.check_config(cfg, 1) == []
    assert flags.config_warnings(cfg) == [
        "--warmup_steps 20 is not below --steps 10: the whole run is warmup; the learning rate rises to 0.0005 at "
        "the last step (--lr 0.001) and never follows --schedule cosine; lower --warmup_steps"]
    assert flags.config_warnings(T.parse_args(["--steps=20", "--warmup_steps=20"]))[0].startswith(
        "--warmup_steps 20 is not below --steps 20: the whole run is warmup; the learning rate rises to 0.001 at the "
        "last step (--lr 0.001)")
    assert flags.config_warnings(T.parse_args(["--steps=21", "--warmup_steps=20"])) == []
    assert flags.config_warnings(T.parse_args(["--steps=0", "--warmup_steps=20"])) == []  # a conversion


@pytest.mark.parametrize("leave", ["gathered", "reducing"])
def test_a_step_that_leaves_a_unit_gathered_or_reducing_stops_with_one_line(main_in_process, monkeypatch, tmp_path,
                                                                            capsys, leave):
    """A fork's bug (frozen first blocks whose backward never runs, so their stage is never freed) would let the
    next step's wait_gather take a unit gathered before the update as ready: stale weights, silently. The loop
    checks after every step that every unit is free and no reduce-scatter is in flight, and stops with one line."""
    import numpy as np
    import train as T
    tokens = tmp_path / "tok.npy"
    np.save(tokens, (np.arange(4000) * 7 % 500).astype(np.uint16))
    real_step = T.train_step

    def buggy_step(cfg, sharded, windows, step, position):
        result = real_step(cfg, sharded, windows, step, position)
        if step == 2 and leave == "gathered":
            sharded.units[1].wait_gather()  # layers.0 gathered again and never freed
        if step == 2 and leave == "reducing":
            sharded.reduces_in_flight.append((sharded.units[-1], None, None, None))
        return result
    monkeypatch.setattr(T, "train_step", buggy_step)
    code = main_in_process(["--model=tiny", f"--data={tokens}", f"--out_dir={tmp_path / 'out'}", "--seq_len=16",
                            "--batch_size=2", "--micro_batch_size=1", "--steps=4", "--eval_every=0"])
    assert code == 2
    what = ("unit(s) layers.0 still gathered" if leave == "gathered" else "reduce-scatter(s) of head in flight")
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: step 2 ended with {what}: every unit")


# -- --freeze and --lr_mult: one line each, before any work (flags.check_param_groups) ----------------------------

PARAM_GROUP_CASES = [
    (["--freeze=embed|q_proj"], "--freeze: 'embed|q_proj' splits unit layers.0 (and 3 more unit(s)): it matches "
                                "model.layers.0.self_attn.q_proj.weight but not model.layers.0.input_layernorm.weight; "
                                "units are frozen whole"),
    (["--freeze=(layers"], "--freeze: '(layers' is not a regular expression (missing ), unterminated subpattern"),
    (["--freeze=lora_A"], "--freeze: 'lora_A' matches no parameter (Hugging Face names, as in --export_hf's folder"),
    (["--freeze=weight"], "--freeze: 'weight' freezes every unit: nothing would train"),
    (["--lr_mult=lm_head"], "--lr_mult: 'lm_head' is not REGEX=FACTOR"),
    (["--lr_mult=lm_head=fast"], "--lr_mult: 'lm_head=fast' is not REGEX=FACTOR (could not convert string to float"),
    (["--lr_mult=lm_head=-1"], "--lr_mult: 'lm_head=-1' is not REGEX=FACTOR with a regex and a factor >= 0"),
    (["--lr_mult=(=2"], "--lr_mult: '(=2' is not REGEX=FACTOR (missing ), unterminated subpattern"),
    (["--lr_mult=lm_head=0.1,lora_B=2"], "--lr_mult: pattern 'lora_B' matches no parameter"),
]


@pytest.mark.parametrize("argv,message", PARAM_GROUP_CASES, ids=[" ".join(c[0]) for c in PARAM_GROUP_CASES])
def test_a_bad_freeze_or_lr_mult_is_one_line_naming_the_flag(argv, message):
    import model as M
    errors = flags.check_param_groups(T.parse_args(argv), M.PRESETS["tiny"]())
    assert len(errors) == 1 and errors[0].startswith(message), errors


def test_whole_units_freeze_and_lr_groups_by_element_pass_the_checks():
    import model as M
    cfg = T.parse_args([r"--freeze=embed_tokens|layers\.[01]\.", r"--lr_mult=mlp\.up_proj=0.5,norm=0"])
    assert flags.check_param_groups(cfg, M.PRESETS["tiny"]()) == []
    with torch.device("meta"):
        assert flags.frozen_units(M.Llama(M.PRESETS["tiny"]()), cfg.freeze) == (["embed", "layers.0", "layers.1"], [])


def test_freezing_a_tied_embedding_says_the_head_is_frozen_too():
    """With tied embeddings the head's lm_head.weight is the embedding's: freezing one freezes the other, and a
    pattern for either name matches it (flags.hf_names)."""
    import model as M
    tied = M.PRESETS["llama3.2-1b"]()
    for pattern in ("embed_tokens", "lm_head"):
        cfg = T.parse_args([f"--freeze={pattern}"])
        assert flags.check_param_groups(cfg, tied) == []
        assert flags.param_group_warnings(cfg, tied) == [
            f"--freeze '{pattern}' freezes the embedding, and with tied embeddings (tie_word_embeddings) its weight "
            f"is also the head's lm_head.weight: the head's weight is frozen too"]
    untied = T.parse_args(["--freeze=embed_tokens"])
    assert flags.param_group_warnings(untied, M.PRESETS["tiny"]()) == []


def test_a_freeze_that_splits_a_unit_stops_train_py_with_one_line(tmp_path):
    proc = run_train(["--model=tiny", "--freeze=mlp", f"--out_dir={tmp_path}"], check=False, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: --freeze: 'mlp' splits unit layers.0 (and 3 more unit(s)): it matches model.layers.0.mlp.gate_proj.weight "
        "but not model.layers.0.input_layernorm.weight; units are frozen whole (the embedding, each block, the head: "
        "model.norm.weight with lm_head.weight): match all of a unit's parameters or none"]
