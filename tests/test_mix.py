"""Two corpora, weighted, each evaluated (issue 19, part 3): --data A:0.6,B:0.4 mixes each global batch in
those proportions, the same windows for any W and micro-batch; the loader's state resumes exactly and
refuses another mix; --eval_data logs each source's loss and their weighted mean; bad input is one line."""
import json
import os
import types

import numpy as np
import pytest
from common import learnable_tokens, read_metrics, run_train, small_config, stopped_at
from test_data import corpus  # noqa: F401 (a fixture)

from components import checks, flags
import data as D
from tools import prepare as prep
from components import metrics
from components import run_data
from tools import plot
import train

SEQ = 8


def mix(spec: str, seed: int = 3) -> "D.MixedWindows":
    sources = D.parse_sources(spec, "--data")
    return D.MixedWindows([n for n, _, _ in sources], [D.TokenWindows(D.TokenData(p), SEQ, seed) for _, p, _ in sources],
                          [w for _, _, w in sources])


@pytest.fixture
def two_files(tmp_path, monkeypatch):
    """fr.npy (1000 tokens: 124 windows) and en.npy (500 tokens, ids from 1000: 62 windows)."""
    np.save(tmp_path / "fr.npy", np.arange(1000, dtype=np.uint16))
    np.save(tmp_path / "en.npy", np.arange(500, dtype=np.uint16) + 1000)
    monkeypatch.chdir(tmp_path)  # the specs below name the files relatively, as a user would
    return tmp_path


def test_each_global_batch_holds_the_sources_in_proportion_the_same_for_any_world_size(two_files):
    m, B = mix("fr.npy:0.6,en.npy:0.4"), 12
    fr, en = m.sources
    for position in range(0, 40 * B, B):  # past en's first epoch (62 windows)
        whole = m.micro_batch(position, 0, 0, 1, B)[0]
        from_en = int((whole[:, 0] >= 1000).sum())
        assert abs(from_en - 0.4 * B) <= 1, (position, from_en)  # 4.8 of 12: 4 or 5 (6 or 7 of 16, ...)
        for world, micro in [(2, 6), (3, 2), (4, 1), (2, 3)]:
            rows = {}
            for rank in range(world):
                for j in range(B // (world * micro)):
                    rows[(j * world + rank) * micro] = m.micro_batch(position, j, rank, world, micro)[0]
            assert np.array_equal(np.concatenate([rows[k] for k in sorted(rows)]), whole), (position, world, micro)
    # Each source in its own seeded order, epoch after epoch: en's windows are en's TokenWindows' in order.
    en_rows = [m.micro_batch(i, 0, 0, 1, 1)[0][0] for i in range(400) if m.micro_batch(i, 0, 0, 1, 1)[0][0, 0] >= 1000]
    assert [r[0] for r in en_rows] == [en.micro_batch(i, 0, 0, 1, 1)[0][0, 0] for i in range(len(en_rows))]
    assert m.progress(400) == dict(windows_by_source={"fr": 240, "en": 160},
                                   epochs_by_source={"fr": 240 / 124, "en": 160 / 62})


def test_one_source_is_todays_loader_and_its_old_checkpoint_state_resumes(two_files):
    today, one = D.TokenWindows(D.TokenData("fr.npy"), SEQ, 3), mix("fr.npy")
    for position in (0, 12, 120, 132):
        for j, rank in [(0, 0), (1, 1), (2, 0)]:
            assert all(np.array_equal(a, b) for a, b in zip(one.micro_batch(position, j, rank, 2, 3),
                                                            today.micro_batch(position, j, rank, 2, 3)))
    old_state = json.loads(json.dumps(today.state(36)))  # what a checkpoint from before mixing holds
    assert "sources" not in old_state and one.check_state(old_state) == 36
    assert D.mix_mismatch(old_state, ["en"], [1]) is None  # one source: its folder may have moved or been renamed
    with pytest.raises(D.DataError, match=r"the mix \(one source\):1, this run's is fr:0.5,en:0.5"):
        mix("fr.npy,en.npy").check_state(old_state)


def test_a_saved_mix_state_continues_exactly_and_another_mix_is_refused_naming_both(two_files):
    m = mix("fr.npy:0.6,en.npy:0.4")
    state = json.loads(json.dumps(m.state(36)))  # as a checkpoint stores it
    assert [(s["name"], s["weight"], s["position"]) for s in state["sources"]] == [("fr", "3/5", 22), ("en", "2/5", 14)]
    fresh = mix("fr.npy:3,en.npy:2")  # the same proportions, written otherwise
    position = fresh.check_state(state)
    for j in range(3):
        assert np.array_equal(fresh.micro_batch(position, j, 1, 2, 2)[0], m.micro_batch(36, j, 1, 2, 2)[0])
    with pytest.raises(D.DataError, match=r"^--data: the checkpoint was trained on the mix fr:0.6,en:0.4, this run's "
                                          r"is fr:0.5,en:0.5: a new mix is a new phase \(--init_from"):
        mix("fr.npy,en.npy").check_state(state)
    with pytest.raises(D.DataError, match=r"the mix fr:0.6,en:0.4, this run's is fr:0.6,fr-2:0.4"):
        mix("fr.npy:0.6,fr.npy:0.4").check_state(state)


def test_names_are_the_folder_or_file_name_and_repeats_are_numbered(two_files):
    os.makedirs("a/train")
    os.makedirs("b/train")
    assert [(n, str(w)) for n, _, w in D.parse_sources("a/train/:0.6,b/train:0.3,fr.npy", "--data")] == \
        [("train", "3/5"), ("train-2", "3/10"), ("fr", "1")]


def test_chat_masks_work_in_a_mix(corpus, tmp_path):  # noqa: F811
    chat, text = str(tmp_path / "chat"), str(tmp_path / "text")
    prep.prepare([corpus["chat"]], corpus["sp"], chat, quiet=True)
    prep.prepare([corpus["text"]], corpus["sp"], text, quiet=True)
    sources = D.parse_sources(f"{chat}:1,{text}:1", "--data")
    m = D.MixedWindows(["chat", "text"], [D.TokenWindows(D.TokenData(p), 32, 0) for _, p, _ in sources], [1, 1])
    _, targets, _ = m.micro_batch(0, 0, 0, 1, 8)
    for row in range(8):
        k, own = m.source_of(row)
        tokens, mask, _ = m.sources[k].window(own)
        assert np.array_equal(targets[row], tokens[1:] if mask is None else np.where(mask[1:] == 1, tokens[1:], -100))
        assert (targets[row] == -100).any() == (k == 0)  # the chat's prompts are masked, the text's nothing


def config(**flags) -> train.TrainConfig:
    return train.TrainConfig(**dict(dict(seq_len=SEQ, batch_size=4, micro_batch_size=1, steps=2, seed=3), **flags))


@pytest.mark.parametrize("spec,line", [
    ("fr.npy:0.6,en.npy:heavy", "--data: the weight 'heavy' of en.npy is not a positive number"),
    ("fr.npy:0.6,en.npy:-0.4", "--data: the weight '-0.4' of en.npy is not a positive number"),
    ("fr.npy:0.6,de.npy:0.4", "--data: de.npy does not exist"),
])
def test_a_bad_weight_or_a_missing_source_is_one_line_naming_the_flag_and_file(two_files, spec, line):
    assert flags.check_config(config(data=spec), 1) == [line]
    assert flags.check_config(config(data="fr.npy", eval_data=spec), 1) == [line.replace("--data", "--eval_data")]


def test_a_source_with_another_vocabulary_is_refused_naming_the_flag_and_file(corpus, tmp_path):  # noqa: F811
    prepared = str(tmp_path / "p")
    prep.prepare([corpus["text"]], corpus["sp"], prepared, quiet=True)  # vocabulary 400
    tokens = learnable_tokens(str(tmp_path / "t.npy"), 97)
    mcfg = small_config()  # vocabulary 97, as from --init_from
    with pytest.raises(D.DataError, match=rf"^--eval_data: {prepared} was tokenized with a 400-token vocabulary; "
                                          rf"the model's has 97$"):
        run_data.open_data(config(data=tokens, eval_data=f"{tokens}:0.5,{prepared}:0.5", init_from="x"), mcfg)


def test_the_plot_draws_each_sources_eval_loss(tmp_path):
    rows = [dict(step=s, loss=3.0 / s, lr=1e-3, tokens_per_sec_per_gpu=1.0, mfu=None, mem_gb=1.0,
                 windows_by_source={"fr": 3 * s, "en": 2 * s}, **({"eval_loss": 2.0, "eval_loss/fr": 1.5, "eval_loss/en": 2.75}
                                                                if s % 2 == 0 else {})) for s in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import matplotlib.axes
    labels = []
    original = matplotlib.axes.Axes.plot
    matplotlib.axes.Axes.plot = lambda self, *a, label=None, **k: labels.append(label) or original(self, *a, label=label, **k)
    try:
        plot.plot_metrics(str(tmp_path))
    finally:
        matplotlib.axes.Axes.plot = original
    assert {"eval_loss", "eval_loss/en", "eval_loss/fr"} <= set(labels)


# -- one W=2 run, stopped and continued ----------------------------------------------------------

TRAIN = ["--seq_len=16", "--batch_size=12", "--micro_batch_size=2", "--dtype=float32", "--lr=3e-3", "--warmup_steps=1",
         "--schedule=constant", "--seed=1", "--model=tiny", "--eval_every=2", "--eval_batches=1", "--ckpt_every=2"]


def test_a_mix_stopped_and_continued_logs_what_an_uninterrupted_run_logs(tmp_path):
    vocab = 512  # the tiny preset's
    fr = learnable_tokens(str(tmp_path / "fr.npy"), vocab, n=3000, seed=1)
    en = learnable_tokens(str(tmp_path / "en.npy"), vocab, n=200, seed=2)  # 12 windows: repeats within 4 steps
    mixes = [f"--data={fr}:0.6,{en}:0.4", f"--eval_data={fr}:0.6,{en}:0.4"]
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    proc = run_train(TRAIN + mixes + ["--steps=4", f"--out_dir={whole}"], nproc=2)
    expected = read_metrics(whole)
    windows = [m["windows_by_source"] for m in expected]
    assert [w["fr"] + w["en"] for w in windows] == [12, 24, 36, 48] and windows[-1] == {"fr": 29, "en": 19}
    for m in expected[1::2]:
        assert m["eval_loss"] == pytest.approx(0.6 * m["eval_loss/fr"] + 0.4 * m["eval_loss/en"], rel=1e-12)
    step4 = next(line for line in proc.stdout.splitlines() if line.startswith("step 4/4"))
    assert "| eval_loss/fr " in step4 and "| eval_loss/en " in step4 and "| epochs fr 0.16, en 1.58" in step4

    # Stopped after step 2: the out_dir as that run leaves it, its step-2 checkpoint and metrics lines (a
    # --steps 2 run's, but for the --steps the manifest records), then continued by another launch.
    stopped_at(whole, parts, 2)
    proc = run_train(TRAIN + mixes + ["--steps=4", f"--out_dir={parts}"], nproc=2)  # continues from step 2
    assert "at step 2" in proc.stdout
    got = read_metrics(parts)
    keys = ("step", "loss", "grad_norm", "windows_by_source", "eval_loss", "eval_loss/fr", "eval_loss/en")
    assert [{k: m.get(k) for k in keys} for m in got] == [{k: m.get(k) for k in keys} for m in expected]

    # Continuing it with another mix: one line before any work (the checks every rank runs first).
    errors = checks.check_resume_mix(config(data=f"{fr}:0.5,{en}:0.5", out_dir=parts, steps=6))
    assert errors == [f"--data: the checkpoint was trained on the mix fr:0.6,en:0.4, this run's is fr:0.5,en:0.5: a new "
                      f"mix is a new phase (--init_from the checkpoint starts one from its weights) "
                      f"({os.path.join(parts, 'checkpoints', 'step_00000004')})"]
    assert checks.check_resume_mix(config(data=f"{fr}:3,{en}:2", out_dir=parts, steps=6)) == []  # the same mix


def test_each_sources_eval_loss_and_windows_reach_metrics_jsonl_the_console_and_tensorboard(tmp_path, capsys):
    import torch
    log = metrics.MetricsLog(config(out_dir=str(tmp_path)), small_config(), 1, torch.device("cpu"), 0, 0, 2)
    scalars = []
    log.tensorboard = types.SimpleNamespace(add_scalar=lambda key, value, step: scalars.append(key), close=lambda: None)
    progress = dict(windows_by_source={"fr": 3, "en": 2}, epochs_by_source={"fr": 0.5, "en": 1.5})
    log.step(1, dict(loss=2.0, grad_norm=1.0), 1e-3, 0.1, 1.0, {"eval_loss": 2.0, "eval_loss/fr": 1.5, "eval_loss/en": 2.75}, progress)
    log.close()
    row = read_metrics(str(tmp_path))[0]
    assert row["windows_by_source"] == {"fr": 3, "en": 2} and (row["eval_loss/fr"], row["eval_loss/en"]) == (1.5, 2.75)
    assert "| eval_loss 2.0000 | eval_loss/fr 1.5000 | eval_loss/en 2.7500 | epochs fr 0.50, en 1.50" in capsys.readouterr().out
    assert {"eval_loss", "eval_loss/fr", "eval_loss/en", "windows_by_source/fr", "windows_by_source/en"} <= set(scalars)
