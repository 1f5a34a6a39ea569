"""What a resume compares (issue 26, part 4): docs/operations.md's table "What a resume compares" is read
here and each row exercised against checkpoints.config_changes on a manifest written by checkpoints.checkpoint_manifest;
path flags are compared by what they name (real paths, mixes by exact normalised weights, in order), not by
their spelling. One in-process run resumes a respelled mix from another folder for real."""
import json
import math
import os
import re
import types
from dataclasses import fields, replace

import numpy as np
import pytest
from common import ROOT, learnable_tokens, read_metrics, small_config, stand_in_unit, stopped_at

import data as D
from components import checkpoints
from components import out_dir as OD
import train as T

MIX = "fr.npy:0.6,en.npy:0.4"


def resume_table() -> list[tuple[str, str, str]]:
    """(flags, what happens, why) of each row of the table under "What a resume compares"."""
    with open(os.path.join(ROOT, "docs", "operations.md")) as f:
        text = f.read()
    rows, started = [], False
    for line in text[text.index("**What a resume compares**"):].splitlines()[1:]:
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in line.strip("|").split("|")]
            if cells[0] != "flags" and not set(cells[0]) <= set("-"):
                rows.append(tuple(cells))
        elif started:
            return rows
    return rows


ROWS = resume_table()


def kind(row) -> str:
    return re.search(r"\*\*(.+?)\*\*", row[1]).group(1)


def flags_named(cell: str) -> set[str]:
    return set(re.findall(r"`--(\w+)`", cell))


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A run's folder: fr.npy, en.npy, a folder DIR and LINK, a symbolic link to it; the tests start in it."""
    run = tmp_path / "data"
    (run / "DIR").mkdir(parents=True)
    np.save(run / "fr.npy", np.arange(100, dtype=np.uint16))
    np.save(run / "en.npy", np.arange(50, dtype=np.uint16))
    os.symlink(run / "DIR", run / "LINK")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(run)
    return run


def manifest_of(cfg) -> dict:
    """What checkpoints.checkpoint_manifest writes for `cfg` (one unit), through JSON as a resume reads it."""
    unit = stand_in_unit("u0", optimizer_state={"exp_avg": None}, optimizer_steps=6)
    return json.loads(json.dumps(checkpoints.checkpoint_manifest(cfg, small_config(), checkpoints.unit_records([unit]), 6, 1, None, {})))


def base_config() -> T.TrainConfig:
    return T.TrainConfig(data=MIX, eval_data=MIX, init_from="DIR")


def another_value(key: str, value):
    """A value of flag `key` other than `value` (for the path flags, one that names other files)."""
    other = {"data": "fr.npy:1,en.npy:1", "eval_data": "en.npy", "init_from": "fr.npy"}
    if key in other:
        return other[key]
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    return f"{value}-other"


def respellings(cell: str) -> list[tuple[str, str]]:
    """(the resume's spelling, the saved one) of each "`A` ... for `B`" in a table cell."""
    return re.findall(r"`([^`]+)`[^`|]*? for `([^`]+)`", cell)


@pytest.mark.parametrize("row", ROWS, ids=[kind(r) for r in ROWS])
def test_the_resume_table_holds(row, folder, tmp_path, monkeypatch):
    cfg, mcfg = base_config(), small_config()
    saved = manifest_of(cfg)
    all_flags = {f.name for f in fields(T.TrainConfig)}
    if kind(row) == "refused" and "model" in row[0]:  # the flags a resume must keep, and the model
        assert flags_named(row[0]) - {"model"} == set(checkpoints.RESUME_MUST_MATCH)
        for key in checkpoints.RESUME_MUST_MATCH:
            must, may = checkpoints.config_changes(saved, replace(cfg, **{key: another_value(key, getattr(cfg, key))}), mcfg)
            assert len(must) == 1 and must[0].startswith(f"--{key} was {getattr(cfg, key)!r}, now ") and may == [], key
        must, _ = checkpoints.config_changes(saved, cfg, replace(mcfg, n_layers=3))
        assert must == ["the model (from --model, --init_from's config.json, --data's tokenizer): n_layers was 2, now 3"]
    elif kind(row) == "a warning":
        assert flags_named(row[0]) == set(checkpoints.RESUME_MAY_CHANGE)
        for key in checkpoints.RESUME_MAY_CHANGE:
            value, new = getattr(cfg, key), another_value(key, getattr(cfg, key))
            assert checkpoints.config_changes(saved, replace(cfg, **{key: new}), mcfg) == ([], [f"--{key} {value} -> {new}"])
    elif kind(row) == "not compared":
        assert flags_named(row[0]) <= set(checkpoints.RESUME_NOT_COMPARED)
        assert set(checkpoints.RESUME_NOT_COMPARED) == all_flags - set(checkpoints.RESUME_MUST_MATCH) - set(checkpoints.RESUME_MAY_CHANGE)
        for key in checkpoints.RESUME_NOT_COMPARED:
            assert checkpoints.config_changes(saved, replace(cfg, **{key: another_value(key, getattr(cfg, key))}), mcfg) == (
                [], []), key
    elif kind(row) in ("the same value", "another mix"):
        pairs = respellings(row[0])
        assert len(pairs) >= (6 if kind(row) == "the same value" else 1), pairs
        for spelled, then in pairs:
            for key in checkpoints.PATH_FLAGS if ":" not in spelled + then else ("data", "eval_data"):
                saved = manifest_of(replace(cfg, **{key: then}))  # saved by a run started in /data (the folder)
                now = spelled.replace("/data/", f"{folder}/")
                if now != spelled:  # an absolute spelling: resumed from another folder
                    monkeypatch.chdir(tmp_path / "elsewhere")
                changes = checkpoints.config_changes(saved, replace(cfg, **{key: now}), small_config())
                if kind(row) == "the same value":
                    assert changes == ([], []), (key, now, then)
                elif key == "data":
                    assert len(changes[0]) == 1 and changes[0][0].startswith(f"--data was {then!r}, now {now!r}"), changes
                else:
                    assert changes == ([], [f"--eval_data {then} -> {now}"])
                monkeypatch.chdir(folder)
    else:  # a source of a mix under another name: the config agrees (the same file), the loader's check refuses
        assert kind(row) == "refused" and "another name" in row[0], row
        os.symlink("fr.npy", "french.npy")
        renamed = "french.npy:0.6,en.npy:0.4"
        assert checkpoints.config_changes(saved, replace(cfg, data=renamed), mcfg) == ([], [])
        sources = D.parse_sources(renamed, "--data")
        windows = D.MixedWindows([n for n, _, _ in sources], [D.TokenWindows(D.TokenData(p), 8, 1) for _, p, _ in sources],
                                 [w for _, _, w in sources])
        state = D.MixedWindows(["fr", "en"], windows.sources, [3, 2]).state(10)
        with pytest.raises(D.DataError, match=r"^--data: the checkpoint was trained on the mix fr:0.6,en:0.4, this "
                                              r"run's is french:0.6,en:0.4"):
            windows.check_state(state)
        one = D.MixedWindows(["french"], windows.sources[:1], [1])
        assert one.check_state(D.MixedWindows(["fr"], windows.sources[:1], [1]).state(10)) == 10  # one: no name kept


def test_the_table_has_every_row_the_test_checks():
    assert sorted(kind(r) for r in ROWS) == sorted(
        ["refused", "a warning", "not compared", "the same value", "another mix", "refused"])


def test_a_manifest_without_resolved_paths_is_refused_in_one_line(folder):
    """A development build's manifest kept no resolved paths: refused, as a damaged one, never read as this run's."""
    cfg = replace(base_config(), data=MIX)
    old = manifest_of(cfg)
    del old["resolved"]
    with pytest.raises(OD.CheckpointError) as e:
        checkpoints.check_manifest_configs("DIR", old, cfg)
    assert str(e.value) == ("checkpoint DIR: manifest.json: resolved lacks init_from, data, eval_data (saved by another "
                            "version of this code)")
    checkpoints.check_manifest_configs("DIR", manifest_of(cfg), cfg)  # what this code writes has every field


def test_weights_are_compared_exactly_not_within_a_tolerance(folder):
    """0.333333 is 1/3 within a relative tolerance of 1e-6, but the schedule of its integer shares departs from
    1/3's within the 1.83M windows of the 70B recipe (MixedWindows.counts): a float comparison would pass a
    mix that draws other windows. Equal fractions are equal shares, the same schedule."""
    cfg = replace(base_config(), data="fr.npy:1,en.npy:2")
    nearly = "fr.npy:0.333333,en.npy:0.666667"
    fake = types.SimpleNamespace(seq_len=8, data=types.SimpleNamespace(meta=None))
    exact, close = (D.MixedWindows(["fr", "en"], [fake, fake], [w for _, _, w in D.parse_sources(spec, "--data")])
                    for spec in (cfg.data, nearly))
    assert all(math.isclose(float(a), float(b), rel_tol=1e-6) for a, b in zip(exact.weights, close.weights))
    windows_70b = 28600 * 64
    assert any(exact.counts(n) != close.counts(n) for n in range(1, windows_70b, 7))
    must, _ = checkpoints.config_changes(manifest_of(cfg), replace(cfg, data=nearly), small_config())
    assert len(must) == 1 and must[0].startswith(f"--data was {cfg.data!r}, now {nearly!r}")
    assert checkpoints.config_changes(manifest_of(cfg), replace(cfg, data="fr.npy:0.5,en.npy:1"), small_config()) == ([], [])


TINY = ["--model=tiny", "--dtype=float32", "--eval_every=0", "--seq_len=16", "--batch_size=4", "--micro_batch_size=1",
        "--warmup_steps=1", "--seed=1", "--ckpt_every=2"]


def test_a_respelled_mix_from_another_folder_resumes_and_a_reordered_one_is_refused(main_in_process, tmp_path,
                                                                                     monkeypatch, capsys):
    """In-process, W=1: started in the data's folder with relative paths, continued from another folder with
    absolute ones and the weights scaled: the same losses as a run never stopped; the sources reordered: refused."""
    run = tmp_path / "data"
    run.mkdir()
    learnable_tokens(str(run / "fr.npy"), 512, n=1500, seed=1)
    learnable_tokens(str(run / "en.npy"), 512, n=600, seed=2)
    (tmp_path / "elsewhere").mkdir()
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    monkeypatch.chdir(run)
    assert main_in_process(TINY + [f"--data={MIX}", "--steps=4", f"--out_dir={whole}"]) == 0
    stopped_at(whole, parts, 2)  # as the run stopped after step 2 leaves its folder
    monkeypatch.chdir(tmp_path / "elsewhere")
    capsys.readouterr()
    respelled = f"--data={run}/fr.npy:3,{run}/./en.npy:2"
    assert main_in_process(TINY + [respelled, "--steps=4", f"--out_dir={parts}"]) == 0
    out, err = capsys.readouterr()
    assert "at step 2" in out and "changed flags" not in err, err[-2000:]
    keys = ("step", "loss", "grad_norm", "windows_by_source")
    assert [{k: m[k] for k in keys} for m in read_metrics(parts)] == [{k: m[k] for k in keys} for m in read_metrics(whole)]
    reordered = f"--data={run}/en.npy:0.4,{run}/fr.npy:0.6"
    assert main_in_process(TINY + [reordered, "--steps=6", f"--out_dir={parts}"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --data: the checkpoint was trained on the mix fr:0.6,en:0.4, this run's is en:0.4,fr:0.6: "
                      f"a new mix is a new phase (--init_from the checkpoint starts one from its weights) "
                      f"({os.path.join(parts, 'checkpoints', 'step_00000004')})"]
