"""Checkpoints: atomic saves, bit-exact resume after kill -9, resume at another W, damage, full disk,
SIGTERM, retention, consolidation to a Hugging Face folder. Multi-process gloo on CPU."""
import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, fields, replace

import pytest
import torch
from common import ROOT, hf_model, learnable_tokens, read_metrics, run_train, save_hf, small_config, stopped_at
from ranks import config_and_data, run_ranks, sharded_model

from components import checkpoints  # noqa: E402
from components import out_dir as OD  # noqa: E402

BASE = ["--seq_len=16", "--batch_size=12", "--micro_batch_size=1", "--dtype=float32", "--steps=6",
        "--lr=3e-3", "--warmup_steps=2", "--seed=1"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    cfg = small_config()
    init = save_hf(hf_model(cfg, seed=2), str(root / "init"))
    other = save_hf(hf_model(small_config(n_layers=3)), str(root / "other"))
    data = learnable_tokens(str(root / "tok.npy"), cfg.vocab_size)
    return dict(init=init, other=other, data=data)


def args(files, out, *extra):
    return BASE + [f"--init_from={files['init']}", f"--data={files['data']}", f"--out_dir={out}", *extra]


@pytest.fixture(scope="module")
def baseline(files, tmp_path_factory):
    """An uninterrupted 6-step run at W=2: the losses and final weights every resume must reproduce. It saves
    every step, keeping 2 (test_retention_and_consolidation): the other runs save at other steps, so a save
    that changed the training would show in their bit-for-bit comparisons."""
    out = tmp_path_factory.mktemp("baseline")
    run_train(args(files, out, "--ckpt_every=1", "--keep_ckpts=2", f"--export_hf={out / 'hf'}"), nproc=2)
    return read_metrics(out), out


def ckpts(out):
    root = os.path.join(out, "checkpoints")
    return sorted(n for n in os.listdir(root) if n.startswith("step_"))


def latest(out):
    return open(os.path.join(out, "checkpoints", "latest")).read().strip()


def exported(path):
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors"))


def same_losses(got, expected, rel=0.0):
    assert [m["step"] for m in got] == [m["step"] for m in expected]
    for g, e in zip(got, expected):
        assert abs(g["loss"] - e["loss"]) <= rel * abs(e["loss"]), (g["step"], g["loss"], e["loss"])
        assert abs(g["grad_norm"] - e["grad_norm"]) <= max(rel, 0) * 10 * abs(e["grad_norm"]), g["step"]


@pytest.fixture(scope="module")
def killed_mid_step_5(files, tmp_path_factory):
    """A W=2 run with a save every 2 steps, killed (SIGKILL) in the middle of step 5: `latest` is step 4. Copied
    by each test that resumes it (at W=2 bit for bit, at W=3 within float32 noise)."""
    out = tmp_path_factory.mktemp("killed")
    proc = run_train(args(files, out, "--ckpt_every=2"), nproc=2, env={"ZERO3_FAULT": "kill_mid_step:5"}, check=False)
    assert proc.returncode != 0 and latest(out) == "step_00000004"
    return out


def copy_of(folder, tmp_path):
    shutil.copytree(folder, tmp_path / "run")
    return tmp_path / "run"


def test_kill9_mid_step_then_resume_is_bit_for_bit(files, baseline, killed_mid_step_5, tmp_path):
    expected, base_out = baseline
    out = copy_of(killed_mid_step_5, tmp_path)
    proc = run_train(args(files, out, "--ckpt_every=2", f"--export_hf={out / 'hf'}"), nproc=2)  # resumes by itself
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout
    same_losses(read_metrics(out), expected)  # metrics.jsonl holds steps 1..6 once each, exactly equal
    a, b = exported(out / "hf"), exported(base_out / "hf")
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_kill9_during_a_save_leaves_the_previous_checkpoint(files, baseline, tmp_path):
    expected, _ = baseline
    cmd = args(files, tmp_path, "--ckpt_every=2")
    proc = run_train(cmd, nproc=2, env={"ZERO3_FAULT": "kill_in_save:4:1"}, check=False)
    assert proc.returncode != 0
    assert latest(tmp_path) == "step_00000002" and ckpts(tmp_path) == ["step_00000002"]
    assert not os.path.exists(tmp_path / "checkpoints" / ".tmp-step_00000004" / "manifest.json")
    run_train(cmd, nproc=2)
    same_losses(read_metrics(tmp_path), expected)


def resumes_within_float32_noise(cmd, expected, out, world, saved_step):
    proc = run_train(cmd, nproc=world)
    assert f"at step {saved_step}" in proc.stdout
    same_losses(read_metrics(out), expected, rel=1e-5)  # another reduction order: float32 noise only


def test_resume_at_another_world_size_4_to_2(files, baseline, tmp_path):
    """Fewer ranks: a new shard is read from two old rank files."""
    cmd = args(files, tmp_path, "--ckpt_every=3")
    assert run_train(cmd, nproc=4, env={"ZERO3_FAULT": "kill_mid_step:4"}, check=False).returncode != 0
    assert latest(tmp_path) == "step_00000003"
    resumes_within_float32_noise(cmd, baseline[0], tmp_path, 2, saved_step=3)


def test_resume_at_another_world_size_2_to_3(files, baseline, killed_mid_step_5, tmp_path):
    """More ranks, W=3 not a multiple of 2: new shards straddle the old files' boundaries."""
    out = copy_of(killed_mid_step_5, tmp_path)
    resumes_within_float32_noise(args(files, out, "--ckpt_every=2"), baseline[0], out, 3, saved_step=4)


@pytest.fixture(scope="module")
def three_checkpoints_once(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("three")
    run_train(args(files, out, "--ckpt_every=2"), nproc=2)
    assert ckpts(out) == ["step_00000002", "step_00000004", "step_00000006"]
    return out


@pytest.fixture
def three_checkpoints(files, three_checkpoints_once, tmp_path):
    """A copy of one 6-step run with a save every 2 steps, for each test to damage as it likes."""
    out = tmp_path / "run"
    shutil.copytree(three_checkpoints_once, out)
    return args(files, out, "--ckpt_every=2"), out / "checkpoints" / "step_00000006"


def flip_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))


DAMAGE = {
    "flipped byte": (lambda d: flip_byte(d / "rank00001-of-00002.safetensors"), "does not match its SHA-256"),
    "truncated": (lambda d: os.truncate(d / "rank00000-of-00002.safetensors", 1000), "(truncated?)"),
    "missing rank file": (lambda d: os.remove(d / "rank00001-of-00002.safetensors"), "rank00001-of-00002.safetensors is missing"),
    "no manifest": (lambda d: os.remove(d / "manifest.json"), "no manifest.json (an unfinished save)"),
}


def resume_on_two_ranks(cmd) -> list:
    """What train.setup's resume returns, (step, data position) or the CheckpointError it raises, on each of
    two ranks in this process (tests/ranks.py): the same collectives, candidates and messages as a W=2 launch."""
    cfg, mcfg, weights, windows = config_and_data(cmd)
    root = os.path.join(cfg.out_dir, "checkpoints")

    def rank_resume(rank):
        sharded = sharded_model(cfg, mcfg, weights)
        try:
            return checkpoints.resume(cfg, mcfg, sharded.units, windows, rank, checkpoints.candidates_on_disk(root))
        except OD.CheckpointError as e:  # each rank's own, to compare
            return e
    return run_ranks(2, rank_resume)


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_previous(three_checkpoints, kind, monkeypatch, capsys):
    """Each kind of damage, in-process at W=2: the ranks agree to pass the newest by (a file of rank 1 is
    read by rank 1 only), say why, and resume from step 4. test_a_damaged_newest_checkpoint_... below is
    one real W=2 launch of this, which trains on from there."""
    cmd, newest = three_checkpoints
    damage, message = DAMAGE[kind]
    damage(newest)
    monkeypatch.setattr(OD, "group", None)  # each rank thread's own default group, not another test's
    resumed = resume_on_two_ranks(cmd + ["--steps=7"])
    stderr = capsys.readouterr().err
    assert f"checkpoint {newest}" in stderr and message in stderr, stderr[-3000:]
    assert "trying the previous checkpoint" in stderr
    assert resumed[0] == resumed[1] and resumed[0][0] == 4


FREEZE = r"--freeze=embed_tokens|layers\."  # every block and the embedding frozen: the head alone trains


@pytest.fixture(scope="module")
def frozen_run(files, tmp_path_factory):
    """A W=2 run with every unit but the head frozen, saving every 2 steps and keeping 2 checkpoints, exported."""
    out = tmp_path_factory.mktemp("frozen")
    run_train(args(files, out, FREEZE, "--ckpt_every=2", "--keep_ckpts=2", f"--export_hf={out / 'hf'}"), nproc=2)
    return out


def frozen_set_of(out) -> str:
    (name,) = [n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("frozen-")]
    return name


def test_frozen_units_are_saved_once_and_resume_bit_for_bit(files, frozen_run, tmp_path):
    """--freeze: the frozen units' master shards are written by the first save into a frozen-* folder, which
    each later checkpoint names instead of holding them; retention keeps it while a kept checkpoint names it.
    Resumed from step 4 (with that folder), the run is the uninterrupted one bit for bit, its step-6 state included."""
    from safetensors import safe_open
    root, the_set = frozen_run / "checkpoints", frozen_set_of(frozen_run)
    assert ckpts(frozen_run) == ["step_00000004", "step_00000006"]  # step 2 wrote the set and is gone; the set stays
    manifests = {step: json.load(open(root / f"step_{step:08d}" / "manifest.json")) for step in (4, 6)}
    for step, manifest in manifests.items():
        assert manifest["frozen"]["folder"] == the_set and manifest["frozen"] == manifests[6]["frozen"]
        with safe_open(root / f"step_{step:08d}" / "rank00001-of-00002.safetensors", framework="pt") as f:
            assert sorted(f.keys()) == ["head.exp_avg", "head.exp_avg_sq", "head.master_shard"]
    with safe_open(root / the_set / "rank00001-of-00002.safetensors", framework="pt") as f:
        assert sorted(f.keys()) == ["embed.master_shard", "layers.0.master_shard", "layers.1.master_shard"]
    rank_bytes = sum(e["bytes"] for e in manifests[6]["files"].values())
    frozen_bytes = sum(e["bytes"] for e in manifests[6]["frozen"]["files"].values())
    assert rank_bytes < 0.6 * frozen_bytes  # 12 B x 3,136 head parameters vs 4 B x 18,592 frozen ones
    resumed = stopped_at(frozen_run, tmp_path / "resumed", 4)
    run_train(args(files, resumed, FREEZE, "--ckpt_every=2", "--keep_ckpts=2", f"--export_hf={resumed / 'hf'}"),
              nproc=2)
    same_losses(read_metrics(resumed), read_metrics(frozen_run))
    a, b = exported(resumed / "hf"), exported(frozen_run / "hf")
    assert all(torch.equal(a[k], b[k]) for k in b)
    again = json.load(open(resumed / "checkpoints" / "step_00000006" / "manifest.json"))
    assert again["files"] == manifests[6]["files"] and again["frozen"] == manifests[6]["frozen"]
    assert frozen_set_of(resumed) == the_set


def test_a_frozen_set_resumes_at_another_world_size_and_the_next_save_writes_a_set_for_it(files, frozen_run,
                                                                                          tmp_path):
    """The W=2 run resumed from step 4 at W=3: new shards straddle the set's files; the frozen weights come out
    bit for bit and the losses within float32 noise. Its first save writes a set of W=3 files; retention keeps the
    W=2 set while step 4, which names it, is kept."""
    resumed = stopped_at(frozen_run, tmp_path / "resumed", 4)
    resumes_within_float32_noise(args(files, resumed, FREEZE, "--ckpt_every=2", "--keep_ckpts=2",
                                      f"--export_hf={resumed / 'hf'}"), read_metrics(frozen_run), resumed, 3, 4)
    a, b = exported(resumed / "hf"), exported(frozen_run / "hf")
    frozen_names = [k for k in b if k.startswith(("model.embed_tokens.", "model.layers."))]
    assert frozen_names and all(torch.equal(a[k], b[k]) for k in frozen_names)
    root = resumed / "checkpoints"
    manifests = {step: json.load(open(root / f"step_{step:08d}" / "manifest.json")) for step in (4, 6)}
    assert manifests[4]["frozen"]["folder"] == frozen_set_of(frozen_run) != manifests[6]["frozen"]["folder"]
    assert sorted(manifests[6]["frozen"]["files"]) == [f"rank{r:05d}-of-00003.safetensors" for r in range(3)]
    assert sorted(n for n in os.listdir(root) if n.startswith("frozen-")) == sorted(
        m["frozen"]["folder"] for m in manifests.values())


def test_a_damaged_or_missing_frozen_file_is_refused_naming_it(files, frozen_run, tmp_path, monkeypatch, capsys):
    """Each checkpoint that names a damaged frozen set is passed by as a damaged rank file makes it, naming the
    file; here both name it, so nothing is left to resume from. --init_from checks its files' sizes first."""
    out = copy_of(frozen_run, tmp_path)
    the_set, newest = frozen_set_of(out), out / "checkpoints" / "step_00000006"
    flip_byte(out / "checkpoints" / the_set / "rank00001-of-00002.safetensors")
    monkeypatch.setattr(OD, "group", None)  # each rank thread's own default group
    resumed = resume_on_two_ranks(args(files, out, FREEZE, "--steps=7"))
    stderr = capsys.readouterr().err
    assert (f"checkpoint {newest}: ../{the_set}/rank00001-of-00002.safetensors does not match its SHA-256 (damaged)"
            in stderr), stderr[-3000:]
    assert f"not using {newest}; trying the previous checkpoint" in stderr
    assert all(isinstance(e, OD.CheckpointError) and str(e).startswith("no intact checkpoint") for e in resumed)
    os.remove(out / "checkpoints" / the_set / "rank00000-of-00002.safetensors")
    with pytest.raises(OD.CheckpointError) as e:
        checkpoints.check_checkpoint_files(str(newest), "--init_from", {name: unit["numel"] for name, unit in json.load(
            open(newest / "manifest.json"))["units"].items()})  # this model's units: the checkpoint's
    assert str(e.value) == f"--init_from: checkpoint {newest}: ../{the_set}/rank00000-of-00002.safetensors is missing"


def test_a_frozen_sets_checkpoint_exports_at_another_world_size_and_the_format_before_it_is_refused(
        frozen_run, tmp_path, main_in_process, capsys):
    """--from_ckpt (the master shards alone, as --init_from reads a checkpoint) at W=1 reads each unit from the two
    W=2 files that cover it, the frozen set's too: the export is the run's own. A checkpoint of a development
    build's format before frozen sets (every unit in the rank files, no "frozen") is refused in one line."""
    from safetensors.torch import load_file, save_file
    step6 = frozen_run / "checkpoints" / "step_00000006"
    old = tmp_path / "old" / "checkpoints" / "step_00000006"
    shutil.copytree(step6, old)
    manifest = json.load(open(old / "manifest.json"))
    the_set = step6.parent / manifest.pop("frozen")["folder"]
    for fname in manifest["files"]:
        save_file({**load_file(old / fname), **load_file(the_set / fname)}, old / fname)
        manifest["files"][fname] = {"sha256": OD.sha256_file(old / fname), "bytes": os.path.getsize(old / fname)}
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert main_in_process(["--dtype=float32", f"--from_ckpt={step6}", f"--export_hf={tmp_path / 'new'}-hf",
                            f"--out_dir={tmp_path / 'new'}-convert"]) == 0
    a, b = exported(f"{tmp_path / 'new'}-hf"), exported(frozen_run / "hf")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
    capsys.readouterr()
    assert main_in_process(["--dtype=float32", f"--from_ckpt={old}", f"--export_hf={tmp_path / 'old'}-hf",
                            f"--out_dir={tmp_path / 'old'}-convert"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: --from_ckpt: checkpoint {old}: manifest.json: frozen is None, expected the frozen set that holds the "
        f"units saved frozen (a damaged or edited manifest)")
    assert not os.path.exists(f"{tmp_path / 'old'}-hf")


class Planted:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):  # unpickling it creates the file `marker`
        return (open, (self.marker, "w"))


def plant_pickles(folder, marker):
    for name in ("optimizer.pt", "rank00000-of-00002.pt", "pytorch_model.bin", "state.pkl"):
        with open(folder / name, "wb") as f:
            pickle.dump(Planted(marker), f)


@pytest.fixture(scope="module")
def fell_back(files, three_checkpoints_once, tmp_path_factory):
    """One real W=2 resume (--steps 7) of a copy of the three checkpoints, the newest damaged (a flipped byte
    in rank 1's file), and pickle files planted in it and in the one it falls back to."""
    root = tmp_path_factory.mktemp("fell_back")
    out, marker = root / "run", root / "pickle_ran"
    shutil.copytree(three_checkpoints_once, out)
    newest = out / "checkpoints" / "step_00000006"
    DAMAGE["flipped byte"][0](newest)
    for folder in (newest, out / "checkpoints" / "step_00000004"):
        plant_pickles(folder, marker)
    proc = run_train(args(files, out, "--ckpt_every=2", "--steps=7"), nproc=2)
    return proc, out, newest, marker


def test_a_damaged_newest_checkpoint_falls_back_and_trains_on(fell_back):
    proc, out, newest, _ = fell_back
    assert f"checkpoint {newest}" in proc.stderr and DAMAGE["flipped byte"][1] in proc.stderr, proc.stderr[-3000:]
    assert "trying the previous checkpoint" in proc.stderr and "at step 4" in proc.stdout
    assert latest(out) == "step_00000007" and read_metrics(out)[-1]["step"] == 7


def test_resume_with_another_model_or_seq_len_names_each_and_never_falls_back(files, three_checkpoints, monkeypatch,
                                                                             main_in_process, capsys):
    """In-process: the refusal comes before any step. At W=2 (two rank threads) both ranks stop with the same
    error; train.main (W=1) prints it as its one line and exits non-zero."""
    cmd, newest = three_checkpoints
    changed = [a for a in cmd if not a.startswith(("--init_from", "--seq_len"))] + [
        f"--init_from={files['other']}", "--seq_len=32", "--steps=7"]  # --steps 7: a resume, not a finished run
    monkeypatch.setattr(OD, "group", None)  # each rank thread's own default group
    by_rank = resume_on_two_ranks(changed)
    assert all(isinstance(e, OD.CheckpointError) for e in by_rank) and str(by_rank[0]) == str(by_rank[1]), by_rank
    assert main_in_process(changed) != 0
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {by_rank[0]}"], stderr[-3000:]
    assert errors[0].startswith(f"error: --resume: checkpoint {newest} (step 6) was saved under other values of what a "
                                f"resume must keep: --init_from was '{files['init']}', now '{files['other']}' (")
    assert "--seq_len was 16, now 32 (" in errors[0] and "the model (" in errors[0] and "n_layers was 2, now 3" in errors[0]
    assert errors[0].endswith(f"--init_from {newest} --out_dir NEW_DIR")
    # The checkpoints are intact: no walk back through older ones, and nothing that would delete them.
    assert "not using" not in stderr and "step_00000004" not in stderr and "--overwrite" not in stderr
    assert ckpts(newest.parent.parent) == ["step_00000002", "step_00000004", "step_00000006"]


def test_every_flag_is_either_kept_warned_about_or_not_compared_on_resume():
    import train as T
    decided = list(checkpoints.RESUME_MUST_MATCH) + list(checkpoints.RESUME_MAY_CHANGE) + list(checkpoints.RESUME_NOT_COMPARED)
    assert sorted(decided) == sorted(f.name for f in fields(T.TrainConfig))  # each once: a new flag needs a decision


def saved_manifest(folder, cfg, mcfg, drop_train=(), drop_model=()):
    os.makedirs(folder, exist_ok=True)
    manifest = {  # what checkpoint_manifest writes, without units
        "format": checkpoints.CKPT_FORMAT, "step": 6, "world_size": 2, "files": {}, "data": None,
        "train": {k: v for k, v in asdict(cfg).items() if k not in drop_train},
        "model": {k: v for k, v in asdict(mcfg).items() if k not in drop_model},
        "resolved": {k: checkpoints.flag_meaning(k, getattr(cfg, k)) for k in checkpoints.PATH_FLAGS}}
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    return str(folder)


def test_changed_flags_are_an_error_or_a_warning_naming_old_and_new(files, tmp_path):
    """In-process: the comparison resume makes before it loads anything."""
    import train as T
    cfg = T.parse_args(args(files, tmp_path))
    mcfg = small_config()
    path = saved_manifest(tmp_path / "step_00000006", cfg, mcfg)
    may = replace(cfg, lr=3e-2, steps=9, eval_every=5, micro_batch_size=2, ac="full")
    assert checkpoints.check_manifest(path, may, mcfg, None)["step"] == 6  # may change: no error
    assert checkpoints.config_changes(json.load(open(os.path.join(path, "manifest.json"))), may, mcfg) == (
        [], ["--steps 6 -> 9", "--lr 0.003 -> 0.03", "--eval_every 50 -> 5"])  # how it runs: not even a warning
    for key, value in (("seed", 2), ("data", str(tmp_path / "other.npy")), ("doc_mask", False), ("init_from", path)):
        with pytest.raises(checkpoints.ResumeMismatch) as e:
            checkpoints.check_manifest(path, replace(cfg, **{key: value}), mcfg, None)
        message = str(e.value)
        assert f"--{key} was {getattr(cfg, key)!r}, now {value!r} (" in message and "\n" not in message
        assert "Restore those flags to continue this run" in message and "--overwrite" not in message
    with pytest.raises(checkpoints.ResumeMismatch, match="the model .*: dim was 32, now 64"):
        checkpoints.check_manifest(path, cfg, replace(mcfg, dim=64, head_dim=16), None)
    # The same file under another spelling is the same --data.
    assert checkpoints.config_changes(json.load(open(os.path.join(path, "manifest.json"))),
                            replace(cfg, data=files["data"].replace("/tok.npy", "/./tok.npy")), mcfg) == ([], [])
    # A manifest that lacks a field (a development build's, before the field existed): refused in one line.
    old = saved_manifest(tmp_path / "step_00000004", cfg, mcfg, drop_train=("doc_mask", "adam_eps", "eval_every"),
                         drop_model=("tie_embeddings", "head_dim"))
    with pytest.raises(OD.CheckpointError) as e:
        checkpoints.check_manifest(old, cfg, mcfg, None)
    assert str(e.value) == (f"checkpoint {old}: manifest.json: train lacks doc_mask, eval_every, adam_eps (saved by "
                            f"another version of this code)")
    qwen3 = small_config(family="qwen3", qk_norm=True, family_keys=dict(max_window_layers=7))
    old = saved_manifest(tmp_path / "step_00000005", cfg, qwen3, drop_model=("family_keys",))
    with pytest.raises(OD.CheckpointError, match=r"manifest.json: model lacks family_keys \(saved by another version"):
        checkpoints.check_manifest(old, cfg, qwen3, None)


@pytest.fixture
def one_process_group():
    import torch.distributed as dist
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    OD.make_group(1.0)
    yield
    if made:
        dist.destroy_process_group()
        OD.group = None


def test_a_folder_of_only_damaged_checkpoints_is_left_to_the_operator(files, tmp_path, one_process_group, capsys):
    import train as T
    cfg = T.parse_args(args(files, tmp_path))
    root = tmp_path / "checkpoints"
    for name in ("step_00000002", "step_00000004"):
        os.makedirs(root / name)  # no manifest.json: unfinished saves
    with pytest.raises(OD.CheckpointError) as e:
        checkpoints.resume(cfg, small_config(), [], None, 0, checkpoints.candidates_on_disk(str(root)))
    assert str(e.value) == (f"no intact checkpoint in {root}: each one is damaged (the warnings above say how); "
                            f"nothing was deleted. Repair or restore them, or start this run again in another --out_dir")
    assert "step_00000004: no manifest.json" in capsys.readouterr().err
    assert ckpts(tmp_path) == ["step_00000002", "step_00000004"]


def test_planted_pickle_is_never_unpickled(fell_back, tmp_path):
    proc, _, _, marker = fell_back
    with open(tmp_path / "check", "wb") as f:  # the payload works when unpickled
        pickle.dump(Planted(tmp_path / "ran"), f)
    pickle.load(open(tmp_path / "check", "rb"))
    assert (tmp_path / "ran").exists()
    # The run read the damaged checkpoint holding them, then resumed from the other, which holds them too.
    assert "at step 4" in proc.stdout and not marker.exists()


def test_full_disk_keeps_latest_and_says_so(three_checkpoints):
    cmd, newest = three_checkpoints
    out = newest.parent.parent

    def small_disk():  # files may not grow past 100 KB: a checkpoint file is ~190 KB
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    full = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            os.path.join(ROOT, "train.py"), *cmd, "--steps=10"]  # resumes at step 6; the save of step 8 fails
    proc = subprocess.run(full, capture_output=True, text=True, timeout=300, preexec_fn=small_disk,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0
    assert f"error: checkpoint {out / 'checkpoints' / 'step_00000008'} was not saved" in proc.stderr
    assert "File too large" in proc.stderr
    assert latest(out) == "step_00000006" and ckpts(out) == ["step_00000002", "step_00000004", "step_00000006"]
    assert not os.path.exists(out / "checkpoints" / ".tmp-step_00000008")


def test_sigterm_on_one_rank_saves_and_exits_zero(files, baseline, tmp_path):
    expected, _ = baseline
    cmd = args(files, tmp_path)
    full = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            os.path.join(ROOT, "train.py"), *cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1", ZERO3_FAULT="slow:0.5")
    proc = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "metrics.jsonl").exists():
        time.sleep(0.2)
    while time.time() < deadline and len(open(tmp_path / "metrics.jsonl").readlines()) < 2:
        time.sleep(0.2)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2
    os.kill(int(workers[-1]), signal.SIGTERM)  # one rank only: the all-reduce must stop both
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    stopped = int(stdout.split("stopping at step ")[1].split()[0])
    assert 2 <= stopped < 6 and latest(tmp_path) == f"step_{stopped:08d}"
    run_train(cmd, nproc=2)
    same_losses(read_metrics(tmp_path), expected)


def test_retention_and_consolidation(baseline, tmp_path):
    _, base_out = baseline
    assert ckpts(base_out) == ["step_00000005", "step_00000006"]
    # Any checkpoint to a Hugging Face folder, here at W=1: the same weights as the run's own export.
    run_train([f"--from_ckpt={base_out / 'checkpoints' / 'step_00000006'}", f"--export_hf={tmp_path / 'hf'}",
                     "--dtype=float32", f"--out_dir={tmp_path / 'convert'}"])
    a, b = exported(tmp_path / "hf"), exported(base_out / "hf")
    assert all(torch.equal(a[k], b[k]) for k in b)
    with open(tmp_path / "hf" / "config.json") as f:
        assert json.load(f)["num_hidden_layers"] == 2


def test_resume_never_refuses_a_used_folder(files, baseline, tmp_path):
    _, base_out = baseline
    # Refused by checks.py before any process group or step, the same at any W: one process.
    proc = run_train(args(files, base_out, "--resume=never"), check=False)
    assert proc.returncode != 0 and "--resume auto continues from it, --overwrite true deletes them" in proc.stderr
    out = copy_of(base_out, tmp_path)  # a used folder: 6 steps' metrics and 2 checkpoints
    run_train(args(files, out, "--steps=2", "--resume=never", "--overwrite=true"), nproc=2)
    assert [m["step"] for m in read_metrics(out)] == [1, 2]


def test_a_save_slower_than_the_timeout_completes(files, tmp_path):
    # Rank 1's file takes 9 s longer than rank 0's, 1.5 times --timeout_min (6 s, which still ends a hung step:
    # tests/test_faults.py): the ranks enter the save together (a broadcast), so rank 0 waits those 9 s in the
    # save's all-gather. Its collectives wait up to --ckpt_timeout_min instead, and the run ends well.
    t0 = time.time()
    proc = run_train(args(files, tmp_path, "--steps=2", "--timeout_min=0.1"), nproc=2,
                     env={"ZERO3_FAULT": "slow_save:2:1:9"}, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.time() - t0 >= 9  # the slow write happened
    assert latest(tmp_path) == "step_00000002"
    assert os.path.isfile(tmp_path / "checkpoints" / "step_00000002" / "manifest.json")
