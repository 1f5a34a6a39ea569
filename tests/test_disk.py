"""Disk faults and shared-filesystem locks on --out_dir, in-process at W=1 (one gloo group over a HashStore):
a full, read-only or forbidden disk at any point of a save, the metrics or the export is one line naming the
path and its cause, with `latest` and the previous checkpoint untouched; another run that takes the folder
is found at the next save; nothing is written through a symbolic link planted in the folder."""
import errno
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from common import small_config

import checkpoint as C
import train as T


@pytest.fixture
def one_process_group():
    """A W=1 group as `python train.py` makes it, and the checkpoint group; destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    C.make_group(1.0)
    yield
    dist.destroy_process_group()
    C.group = None
    if C.out_dir_lock is not None:
        C.out_dir_lock.close()
    C.out_dir_lock = C.out_dir_claim = None


def tiny_units():
    """What save_checkpoint reads of train.py's units: a name, sizes, the fp32 slices."""
    return [SimpleNamespace(name=f"u{i}", numel=6, shard_numel=6, master_shard=torch.arange(6.0) + i,
                            optimizer_state={"exp_avg": torch.zeros(6), "exp_avg_sq": torch.ones(6)})
            for i in range(2)]


def save(out, step):
    cfg = T.parse_args([f"--out_dir={out}", "--keep_ckpts=3"])
    return C.save_checkpoint(cfg, small_config(), tiny_units(), step, 0, 1, None)


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
    with pytest.raises(C.CheckpointError) as e:
        save(tmp_path, 4)
    monkeypatch.undo()
    why = why.format(tmp=root / ".tmp-step_00000004", root=root)
    assert str(e.value) == (f"checkpoint {root / 'step_00000004'} was not saved: {why}; {root / 'latest'} still "
                            f"names step_00000002, untouched")
    # Nothing half-written is left or counted: no temporary folder or file, no step_4 that `latest` skips.
    assert sorted(os.listdir(root)) == ["latest", "step_00000002"]
    assert (root / "latest").read_text() == "step_00000002\n" and C.is_complete(str(root / "step_00000002"))


# -- the out_dir's lock on shared filesystems ------------------------------------------------------------------

def claim(out):
    C.claim_out_dir(str(out), 0, 1, torch.device("cpu"))


def test_a_run_that_took_the_folder_stops_the_next_save(one_process_group, tmp_path):
    """flock is node-local on Lustre with localflock or NFS with local_lock=flock: a run on another node
    takes the lock too and writes its token. This run's next save reads it and stops; nothing is written."""
    claim(tmp_path)
    save(tmp_path, 2)
    (tmp_path / ".lock").write_text("77 host node-b pid 4242 since 2026-01-02 03:04:05\n")
    with pytest.raises(C.CheckpointError) as e:
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
    monkeypatch.setattr(C.fcntl, "flock", no_locks)
    with pytest.raises(C.CheckpointError) as e:
        claim(tmp_path)
    assert str(e.value) == (
        f"--out_dir: cannot lock {tmp_path / '.lock'}: No locks available: the filesystem of --out_dir does not "
        f"support flock (Lustre mounted without the flock option, NFS mounted with nolock); mount it with '-o flock' "
        f"(Lustre) or with the lock service running (NFS), or choose another --out_dir")


def test_a_held_lock_names_its_holder_and_how_to_clear_a_stale_one(one_process_group, tmp_path):
    import fcntl
    with open(tmp_path / ".lock", "w") as held:  # another open file: flock conflicts within a process too
        held.write("5 host node-a pid 4242 since 2026-01-02 03:04:05\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(C.CheckpointError) as e:
            claim(tmp_path)
    assert str(e.value) == (
        f"--out_dir: {tmp_path} is in use by another run (host node-a pid 4242 since 2026-01-02 03:04:05); wait for "
        f"it to end or choose another --out_dir; if no process 4242 runs on node-a, the lock is stale: delete "
        f"{tmp_path / '.lock'}")


def test_the_lock_is_never_taken_through_a_symbolic_link(one_process_group, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's file\n")
    os.makedirs(tmp_path / "out")
    os.symlink(victim, tmp_path / "out" / ".lock")
    with pytest.raises(C.CheckpointError) as e:
        claim(tmp_path / "out")
    assert str(e.value) == (f"--out_dir: {tmp_path / 'out' / '.lock'} is a symbolic link; the lock is never taken "
                            f"through one: delete it")
    assert victim.read_text() == "someone else's file\n"
