"""Disk faults and shared-filesystem locks on --out_dir, in-process at W=1 (one gloo group over a HashStore):
a full, read-only or forbidden disk at any point of a save, the metrics or the export is one line naming the
path and its cause, with `latest` and the previous checkpoint untouched; another run that takes the folder
is found at the next save; a lock a crashed node left is judged by what SLURM says of its job (a fake scontrol);
nothing is written through a symbolic link planted in the folder. A network error while the processes connect
exits 1, which torchrun retries."""
import json
import errno
import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from common import ROOT, free_port, learnable_tokens, read_metrics, run_script, small_config, stand_in_unit

from components import checkpoints
from components import out_dir as OD
from components import flags
from components import metrics
import train as T


@pytest.fixture
def one_process_group():
    """A W=1 group as `python train.py` makes it, and the checkpoint group; destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    OD.make_group(1.0)
    yield
    dist.destroy_process_group()
    OD.group = None
    if OD.out_dir_lock is not None:
        OD.out_dir_lock.close()
    OD.out_dir_lock = OD.out_dir_claim = None


def tiny_units():
    """Two stand-ins for train.py's units of 6 elements, told apart by their master weights."""
    return [stand_in_unit(f"u{i}", master_shard=torch.arange(6.0) + i,
                          optimizer_state={"exp_avg": torch.zeros(6), "exp_avg_sq": torch.ones(6)}) for i in range(2)]


def save(out, step, units=None):
    cfg = T.parse_args([f"--out_dir={out}", "--keep_ckpts=3"])
    return checkpoints.save_checkpoint(cfg, small_config(), units or tiny_units(), step, 0, 1, None)


def fault(monkeypatch, name, suffix, code):
    """os.NAME raises OSError(code) for a path (or an open file descriptor's path) ending in `suffix`."""
    real = getattr(os, name)

    def failing(target, *args, **kwargs):
        path = os.readlink(f"/proc/self/fd/{target}") if isinstance(target, int) else os.fspath(target)
        if path.endswith(suffix):
            raise OSError(code, os.strerror(code), *([path] if not isinstance(target, int) else []))
        return real(target, *args, **kwargs)
    monkeypatch.setattr(os, name, failing)


FAULTS = {  # where the save meets the fault, and what the line names
    "makedirs: disk full": ("makedirs", ".tmp-step_00000004", errno.ENOSPC,
                            "rank 0 could not create {tmp}: No space left on device (the filesystem is full, of "
                            "bytes or of inodes: df -h and df -i say which)"),
    "rank file: quota": ("fsync", "rank00000-of-00001.safetensors", errno.EDQUOT,
                         "rank 0 could not write {tmp}/rank00000-of-00001.safetensors: Disk quota exceeded (the "
                         "disk quota is used up: quota -s shows it)"),
    "manifest: forbidden": ("open", "manifest.json.tmp", errno.EACCES,
                            "rank 0 could not commit it: {tmp}/manifest.json.tmp: Permission denied (this user may "
                            "not write there)"),
    "latest: read-only": ("replace", "latest.tmp", errno.EROFS,
                          "rank 0 could not commit it: {root}/latest.tmp: Read-only file system (the filesystem is "
                          "mounted read-only)"),
}


@pytest.mark.parametrize("where", list(FAULTS))
def test_a_disk_fault_in_a_save_is_one_line_and_latest_stays(one_process_group, tmp_path, monkeypatch, where):
    root = tmp_path / "checkpoints"
    save(tmp_path, 2)
    name, suffix, code, why = FAULTS[where]
    fault(monkeypatch, name, suffix, code)
    with pytest.raises(OD.CheckpointError) as e:
        save(tmp_path, 4)
    monkeypatch.undo()
    why = why.format(tmp=root / ".tmp-step_00000004", root=root)
    assert str(e.value) == (f"checkpoint {root / 'step_00000004'} was not saved: {why}; {root / 'latest'} still "
                            f"names step_00000002, untouched")
    # Nothing half-written is left or counted: no temporary folder or file, no step_4 that `latest` skips.
    assert sorted(os.listdir(root)) == ["latest", "step_00000002"]
    assert (root / "latest").read_text() == "step_00000002\n" and checkpoints.is_complete(str(root / "step_00000002"))


# -- the out_dir's lock on shared filesystems ------------------------------------------------------------------

def claim(out):
    OD.claim_out_dir(str(out), 0, 1, torch.device("cpu"))


def test_a_run_that_took_the_folder_stops_the_next_save(one_process_group, tmp_path):
    """flock is node-local on Lustre with localflock or NFS with local_lock=flock: a run on another node
    takes the lock too and writes its token. This run's next save reads it and stops; nothing is written."""
    claim(tmp_path)
    save(tmp_path, 2)
    (tmp_path / ".lock").write_text("77 host node-b pid 4242 since 2026-01-02 03:04:05\n")
    with pytest.raises(OD.CheckpointError) as e:
        save(tmp_path, 4)
    assert str(e.value) == (
        f"--out_dir: {tmp_path} was taken by another run while this one held its lock: {tmp_path / '.lock'} now "
        f"names host node-b pid 4242 since 2026-01-02 03:04:05; flock on this filesystem does not keep nodes apart "
        f"(Lustre mounted with localflock, NFS with local_lock=flock or local_lock=all): mount it with '-o flock' "
        f"(Lustre) or local_lock=none (NFS), or give each run its own --out_dir. Step 4 was not saved; this run stops")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_00000002"]


def test_a_filesystem_without_flock_is_one_line_naming_the_mount_option(one_process_group, tmp_path, monkeypatch):
    def no_locks(f, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(OD.fcntl, "flock", no_locks)
    with pytest.raises(OD.CheckpointError) as e:
        claim(tmp_path)
    assert str(e.value) == (
        f"--out_dir: cannot lock {tmp_path / '.lock'}: No locks available: the filesystem of --out_dir does not "
        f"support flock (Lustre mounted without the flock option, NFS mounted with nolock); mount it with '-o flock' "
        f"(Lustre) or with the lock service running (NFS), or choose another --out_dir")


def hold_lock(path, holder: str):
    """`path` locked by another open file (flock conflicts within a process too), naming `holder`: what a lock
    left on NFS or Lustre by a crashed node looks like to the next run. Returns the file: keep it open."""
    import fcntl
    held = open(path, "w")
    held.write(f"5 {holder}\n")
    held.flush()
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return held


HOLDER = "host node-a pid 4242 since 2026-01-02 03:04:05"


def test_a_held_lock_is_refused_and_kept_naming_the_fix_for_a_stale_one(one_process_group, tmp_path):
    """A held lock is never taken over: its holder may be alive (a node cut off from the network), or gone with its
    lock kept by NFS or Lustre; the one line names both fixes, and a restart meets it again (exit code 2)."""
    lock = tmp_path / ".lock"
    with hold_lock(lock, HOLDER):
        with pytest.raises(OD.CheckpointError) as e:
            claim(tmp_path)
        assert lock.read_text() == f"5 {HOLDER}\n"  # kept
    assert T.exit_code(e.value) == 2
    assert str(e.value) == (f"--out_dir: {tmp_path} is in use by another run ({HOLDER}); wait for it to end or choose "
                            f"another --out_dir; if that run is gone (a crashed node's lock, which NFS or Lustre keeps "
                            f"a while), the lock is stale: delete {lock}")


def test_a_lock_file_that_cannot_be_made_is_one_line(one_process_group, tmp_path, monkeypatch):
    fault(monkeypatch, "open", ".lock", errno.EACCES)  # a folder of another user's, or one mounted read-only
    with pytest.raises(OD.CheckpointError) as e:
        claim(tmp_path)
    assert str(e.value) == (f"--out_dir: cannot create the lock file {tmp_path / '.lock'}: Permission denied (this "
                            f"user may not write there)")


def test_the_lock_is_never_taken_through_a_symbolic_link(one_process_group, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's file\n")
    os.makedirs(tmp_path / "out")
    os.symlink(victim, tmp_path / "out" / ".lock")
    with pytest.raises(OD.CheckpointError) as e:
        claim(tmp_path / "out")
    assert str(e.value) == (f"--out_dir: {tmp_path / 'out' / '.lock'} is a symbolic link; the lock is never taken "
                            f"through one: delete it")
    assert victim.read_text() == "someone else's file\n"


# -- the write probe, metrics.jsonl, and a start-up that meets the network -------------------------------------

def test_the_write_probe_never_writes_through_a_planted_link(tmp_path, monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's file\n")
    out = tmp_path / "out"
    os.makedirs(out)
    os.symlink(victim, out / f".write-test-{os.getpid()}")  # the name the probe had
    cfg = T.parse_args([f"--out_dir={out}", "--steps=0"])
    assert flags.check_config(cfg, 1) == []
    monkeypatch.setattr(os, "urandom", lambda n: bytes(n))  # the name it has now, planted too
    os.symlink(victim, out / f".write-test-{os.getpid()}-00000000")
    assert flags.check_config(cfg, 1) == [f"--out_dir: {out} is not writable (File exists)"]
    assert victim.read_text() == "someone else's file\n"


def tiny_run(tmp_path, *extra):
    data = learnable_tokens(str(tmp_path / "tok.npy"), 512, n=2000)
    return ["--model=tiny", "--dtype=float32", "--eval_every=0", "--seq_len=16", "--batch_size=2",
            "--micro_batch_size=1", "--warmup_steps=1", "--steps=4", "--ckpt_every=2", f"--data={data}",
            f"--out_dir={tmp_path / 'out'}", *extra]


def test_a_full_disk_under_metrics_stops_every_rank_with_one_line(main_in_process, tmp_path, monkeypatch, capsys):
    argv = tiny_run(tmp_path)
    real_log_step = metrics.log_step

    def full_at_step_3(cfg, row, f, *rest):
        if row["step"] == 3:
            f.write('{"step": 3, "lo')  # what fits before the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_log_step(cfg, row, f, *rest)
    monkeypatch.setattr(metrics, "log_step", full_at_step_3)
    assert main_in_process(argv) == 2
    path = tmp_path / "out" / "metrics.jsonl"
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: --out_dir: cannot write {path}: No space left on device (the filesystem is full, of bytes or of "
        f"inodes: df -h and df -i say which); the run stops without saving: once the file can be written, the same "
        f"command resumes from the last checkpoint")
    root = tmp_path / "out" / "checkpoints"
    assert sorted(os.listdir(root)) == ["latest", "step_00000002"]
    assert (root / "latest").read_text() == "step_00000002\n"
    monkeypatch.setattr(metrics, "log_step", real_log_step)
    assert main_in_process(argv) == 0  # space again: the same command resumes and the torn line is dropped
    assert [m["step"] for m in read_metrics(tmp_path / "out")] == [1, 2, 3, 4]


def test_a_network_error_while_starting_exits_1_for_torchrun_to_retry(tmp_path):
    """Rank 1 of 2 whose MASTER_ADDR:MASTER_PORT has no store yet (the first node still starting): torch
    raises DistNetworkError after --timeout_min. Exit code 1, and nothing in ZERO3_FATAL_FILE (which would
    stop launch.sh's restarts)."""
    port, fatal = free_port(), tmp_path / "fatal"
    env = dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               ZERO3_FATAL_FILE=str(fatal))
    proc = run_script(os.path.join(ROOT, "train.py"), ["--steps=0", "--timeout_min=0.02",
                                                       f"--out_dir={tmp_path / 'out'}"], env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert ours == [f"error: DistNetworkError while starting on rank 1 ({socket.gethostname()}): The client socket has "
                    f"timed out after 1200ms while "
                    f"trying to connect to (127.0.0.1, {port}); a restart may succeed"], proc.stderr[-3000:]
    assert not fatal.exists()


EXPORT_FAULTS = {
    "folder: disk full": ("makedirs", "hf.partial", errno.ENOSPC,
                          "cannot write {hf}.partial: No space left on device (the filesystem is full, of bytes or "
                          "of inodes: df -h and df -i say which)"),
    "weights: quota": ("fsync", "model.safetensors", errno.EDQUOT,
                       "cannot write {hf}.partial/model.safetensors: Disk quota exceeded (the disk quota is used up: "
                       "quota -s shows it)"),
}


@pytest.mark.parametrize("where", list(EXPORT_FAULTS))
def test_a_disk_fault_in_the_export_is_one_line_and_leaves_no_folder(main_in_process, tmp_path, monkeypatch, capsys,
                                                                     where):
    """tools/export_hf.py (what --export_hf and --from_ckpt run) meeting a full disk or quota: one line, exit code 2
    (it repeats on a restart: launch.sh stops), and neither the folder nor its .partial."""
    from tools import export_hf as X
    hf = tmp_path / "hf"
    assert main_in_process(tiny_run(tmp_path, "--steps=2")) == 0
    name, suffix, code, why = EXPORT_FAULTS[where]
    fault(monkeypatch, name, suffix, code)
    capsys.readouterr()
    assert X.main([str(tmp_path / "out"), str(hf), "--dtype=float32"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"error: --export_hf: {why.format(hf=hf)}"
    assert not os.path.exists(hf) and not os.path.exists(f"{hf}.partial")


# -- a checkpoint's manifest is input: its numbers are checked before any is used ------------------------------

def edit(manifest, change):
    change(manifest)
    return manifest


MANIFEST_EDITS = {  # what is changed, and the line that names it
    "shard_numel 0": (lambda m: m["units"]["u0"].update(shard_numel=0),
                      "units.u0.shard_numel is 0, expected 6: numel 6 over world_size 1, rounded up"),
    "shard_numel short": (lambda m: m["units"]["u1"].update(shard_numel=5),
                          "units.u1.shard_numel is 5, expected 6: numel 6 over world_size 1, rounded up"),
    "optimizer_steps negative": (lambda m: m["units"]["u1"].update(optimizer_steps=-1),
                                 "units.u1 is {'optimizer_steps': -1, 'trained': True}, expected optimizer_steps a "
                                 "whole number >= 0 and trained true or false"),
    "optimizer_state missing": (lambda m: m["units"]["u1"].pop("optimizer_state"),
                                "units.u1.optimizer_state is None, expected a list of the optimizer's state names"),
    "world_size 0": (lambda m: m.update(world_size=0), "world_size is 0, expected a whole number >= 1"),
    "step a string": (lambda m: m.update(step="2"), "step is '2', expected a whole number >= 0"),
    "a file outside": (lambda m: m.update(files={"../rank00000-of-00001.safetensors": {}}),
                       "files is ['../rank00000-of-00001.safetensors'], expected the 1 files "
                       "rank00000-of-00001.safetensors to rank00000-of-00001.safetensors"),
    "a frozen set outside": (lambda m: m.update(frozen={"folder": "../elsewhere", "files": {}}),
                             "frozen is {'folder': '../elsewhere', 'files': {}}, expected {\"folder\": "
                             "\"frozen-<hex digits>\", \"files\": the 1 rank files}"),
    "bytes negative": (lambda m: m["files"]["rank00000-of-00001.safetensors"].update(bytes=-1),
                       "files.rank00000-of-00001.safetensors is {'sha256': '{sha}', 'bytes': -1}, expected "
                       "{\"sha256\": \"...\", \"bytes\": a whole number}"),
}


@pytest.mark.parametrize("what", list(MANIFEST_EDITS))
def test_a_manifests_numbers_are_checked_before_use(one_process_group, tmp_path, what):
    import json
    path = save(tmp_path, 2)
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    sha = manifest["files"]["rank00000-of-00001.safetensors"]["sha256"]
    change, why = MANIFEST_EDITS[what]
    with pytest.raises(OD.CheckpointError) as e:
        checkpoints.load_checkpoint(path, edit(manifest, change), tiny_units())
    assert str(e.value) == (f"checkpoint {path}: manifest.json: {why.replace('{sha}', sha)} (a damaged or edited "
                            f"manifest)")


def test_a_rank_files_tensor_of_another_length_is_refused(one_process_group, tmp_path):
    """A rank file and manifest that agree (size, SHA-256) but whose tensors are shorter than shard_numel:
    reading past their end was a shape error out of the copy."""
    import json
    path = save(tmp_path, 2)
    fname = "rank00000-of-00001.safetensors"
    short = [(f"u{i}.{kind}", torch.zeros(5)) for i in range(2) for kind in ("master_shard", "exp_avg", "exp_avg_sq")]
    sha, nbytes = OD.write_safetensors_streaming(os.path.join(path, fname), short)
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    manifest["files"][fname] = {"sha256": sha, "bytes": nbytes}
    with pytest.raises(OD.CheckpointError) as e:
        checkpoints.load_checkpoint(path, manifest, tiny_units())
    assert str(e.value) == (f"checkpoint {path}: {fname} holds u0.master_shard with shape [5], the manifest's "
                            f"shard_numel says [6]")


def test_samples_jsonl_unwritable_is_kept_for_the_stop_not_raised(tmp_path, monkeypatch):
    """Rank 0's Sampler keeps the error, as MetricsLog does; train.py's stop all-reduce carries it to every rank."""
    from components import sample as S
    os.makedirs(tmp_path / "samples.jsonl")  # what cannot be appended to, whoever runs the test (root too)
    sampler = S.Sampler.__new__(S.Sampler)  # the prompts and tokenizer are not the point here
    sampler.rank, sampler.records, sampler.prompts, sampler.stop_ids = 0, [{"text": "hi"}], [[1, 5]], [2]
    sampler.max_new_tokens, sampler.decoder = 4, SimpleNamespace(decode=lambda ids: "x")
    sampler.path, sampler.error = str(tmp_path / "samples.jsonl"), ""
    monkeypatch.setattr(S, "generate", lambda *args: [[1, 5, 7]])
    sampler.sample(None, 3)
    assert sampler.error == (f"--out_dir: cannot write {tmp_path / 'samples.jsonl'}: Is a directory; the run stops "
                             f"without saving: once the file can be written, the same command resumes from the last "
                             f"checkpoint")


def test_each_unit_names_its_own_optimizer_state_in_the_manifest(main_in_process, tmp_path, capsys):
    """The manifest lists the optimizer state per unit (a fork's units need not keep the same); a manifest of a
    development build's form (one list at its top level) is refused in one line, as a damaged one, and resume uses
    the checkpoint before it; so is a unit whose saved state differs from what this run keeps for it, named."""
    cmd = tiny_run(tmp_path, "--ckpt_every=1", "--keep_ckpts=5")
    assert main_in_process(cmd[:] + ["--steps=2"]) == 0
    path = tmp_path / "out" / "checkpoints" / "step_00000002" / "manifest.json"
    saved = json.loads(path.read_text())
    assert {tuple(u["optimizer_state"]) for u in saved["units"].values()} == {("exp_avg", "exp_avg_sq")}
    for u in saved["units"].values():  # a development build's form: one list at the manifest's top level
        del u["optimizer_state"]
    path.write_text(json.dumps(dict(saved, optimizer_state=["exp_avg", "exp_avg_sq"])))
    assert main_in_process(cmd[:] + ["--steps=3"]) == 0
    out = capsys.readouterr()
    assert (f"warning: checkpoint {path.parent}: manifest.json: units.embed.optimizer_state is None, expected a list "
            f"of the optimizer's state names (a damaged or edited manifest)") in out.err, out.err
    assert "at step 1" in out.out
    path = tmp_path / "out" / "checkpoints" / "step_00000003" / "manifest.json"
    saved = json.loads(path.read_text())
    saved["units"]["layers.0"]["optimizer_state"] = ["momentum_buffer"]
    path.write_text(json.dumps(saved))
    assert main_in_process(cmd[:] + ["--steps=4"]) == 0
    out = capsys.readouterr()
    assert ("unit layers.0 was saved with optimizer state momentum_buffer, this run's optimizer keeps exp_avg, "
            "exp_avg_sq for it") in out.err + out.out
    assert "at step 2" in out.out


def test_a_resume_with_another_freeze_starts_fresh_state_or_drops_it_and_refuses_a_manifest_without_step_counts(
        tmp_path, one_process_group):
    """--freeze may change on resume: a unit trained in the checkpoint and frozen now reads its master shard alone; a
    unit frozen in the checkpoint and trained now starts with zero moments and its own step count at 0 (whatever a
    previous read left in them); a manifest without the per-unit step counts and `trained` (a development build's)
    is refused in one line."""
    path = save(tmp_path / "out", 4)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    assert [u["optimizer_steps"] for u in manifest["units"].values()] == [1, 1]

    def fresh(trained):  # this run's units: u1 frozen or trained, their state filled with something else
        units = tiny_units()
        for u, keeps in zip(units, trained):
            u.master_shard.fill_(7.0)
            u.optimizer_steps, u.trained = 9, keeps
            u.optimizer_state = {k: t.fill_(7.0) for k, t in u.optimizer_state.items()} if keeps else {}
        return units
    units = fresh([True, False])
    assert checkpoints.freeze_changes(manifest, units) == ([], ["u1"])
    checkpoints.load_checkpoint(path, manifest, units)
    assert torch.equal(units[1].master_shard, torch.arange(6.0) + 1) and units[1].optimizer_steps == 0
    assert torch.equal(units[0].optimizer_state["exp_avg_sq"], torch.ones(6)) and units[0].optimizer_steps == 1
    saving = tiny_units()  # saved while u1 was frozen (its master shard in a frozen set), trained now
    saving[1].trained, saving[1].optimizer_state, saving[1].optimizer_steps = False, {}, 0
    checkpoints.forget_frozen_set()
    frozen_path = save(tmp_path / "frozen", 4, saving)
    with open(os.path.join(frozen_path, "manifest.json")) as f:
        frozen_manifest = json.load(f)
    units = fresh([True, True])
    assert checkpoints.freeze_changes(frozen_manifest, units) == (["u1"], [])
    checkpoints.load_checkpoint(frozen_path, frozen_manifest, units)
    assert torch.equal(units[1].master_shard, torch.arange(6.0) + 1) and units[1].optimizer_steps == 0
    assert all(not t.any() for t in units[1].optimizer_state.values())
    for saved in manifest["units"].values():  # a development build's form: no per-unit step counts, no --freeze
        del saved["trained"], saved["optimizer_steps"]
    with pytest.raises(OD.CheckpointError) as e:
        checkpoints.load_checkpoint(path, manifest, fresh([True, True]))
    assert str(e.value) == (f"checkpoint {path}: manifest.json: units.u0 is {{'optimizer_steps': None, 'trained': "
                            f"None}}, expected optimizer_steps a whole number >= 0 and trained true or false (a damaged "
                            f"or edited manifest)")


def test_a_new_phase_reads_the_units_a_checkpoint_holds_and_a_resume_refuses_another_models(one_process_group, tmp_path):
    """A unit the checkpoint lacks (a fork's adapter, u2): a new phase (master_only) reads the others and leaves it
    to init_weights; a resume refuses it, as it refuses a unit of another size, in one line naming the unit (and
    both sizes), as a mismatch: an older checkpoint of the same run would be no better, so none is tried."""
    path = save(tmp_path / "out", 4)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    units = tiny_units() + [stand_in_unit("u2", master_shard=torch.full((6,), 7.0))]
    for u in units[:2]:
        u.master_shard.zero_()
    checkpoints.load_checkpoint(path, manifest, units, master_only=True)
    assert [u.master_shard.tolist() for u in units] == [list(range(6)), list(range(1, 7)), [7.0] * 6]
    with pytest.raises(OD.CheckpointError) as e:
        checkpoints.read_agreed(path, None, None, None, units)
    assert str(e.value) == (f"checkpoint {path}: unit u2 is missing (a resume continues the model that saved it; "
                            f"--init_from it starts a new phase, which initialises such units)")
    units[1].numel = 7
    with pytest.raises(OD.CheckpointError) as e:
        checkpoints.read_agreed(path, None, None, None, units[:2])
    assert str(e.value) == (f"checkpoint {path}: unit u1 has 6 parameters there and 7 in this model (another model, "
                            f"or another fork)")
