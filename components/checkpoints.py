"""Our own checkpoints: each rank writes its shards, rank 0 commits atomically (save_checkpoint, or BackgroundSave
for --async_save); retention; --freeze's frozen sets; resume at any world size, each manifest checked first; a new
phase's weights (load_weights) and a finished run's command again (unless_finished).

All this file needs of train.py's units: `name`, `numel`, `padded_numel`, `shard_numel`, `shard_start`,
`slots` (each parameter's place in the unit's flat buffer), `master_shard`, `optimizer_state` (a dict
of fp32 tensors shaped like master_shard, named by the optimizer; empty for a frozen unit), `trained` (False:
frozen by --freeze) and `optimizer_steps` (the unit's own count for AdamW's bias corrections).

  out_dir/checkpoints/step_00000100/manifest.json   step, configs, world size, file checksums
                     /step_00000100/rank00000-of-00016.safetensors  that rank's master and optimizer shards
  out_dir/checkpoints/frozen-<digest>/rank00000-of-00016.safetensors  --freeze: the frozen units' master shards,
                                                     written once a run, named by the checkpoints that use them
  out_dir/checkpoints/latest                         "step_00000100", replaced atomically
  out_dir/checkpoints/.tmp-step_00000200/            a save in progress: never loaded
"""
import contextlib
import errno
import hashlib
import itertools
import json
import os
import re
import shutil
import sys
import threading
import time
import weakref
from dataclasses import asdict, fields, replace

import torch
import torch.distributed as dist

import data as D
import model as M
from components import offload as O  # page_lock: the staging buffer of --async_save
from components import out_dir as OD  # the lock's claim, the file helpers, the checkpoint group
from components import flags  # fault_hook: the tests' faults (tests/faults.py)
from components import run_data  # flag_meaning: what --data names
from components.out_dir import CheckpointError, CheckpointUnreadable

# ================================================================================================
#
# 4 bytes per parameter per saved tensor / W per rank: 12 with AdamW (master, exp_avg, exp_avg_sq). Only
# safetensors and JSON are read back: nothing is ever unpickled. The step draws no random numbers, so there is no
# RNG state to keep: the data position (windows consumed so far) is the data loader's whole state.

CKPT_FORMAT = "llama-zero3-checkpoint/1"

# Resuming with other flags: the manifest's TrainConfig ("train") and model ("model") are compared with this run's
# (config_changes). Every TrainConfig field is in exactly one list below (a new flag needs a decision).
RESUME_MUST_MATCH = {  # the saved state means something else under another value: an error, no fallback
    "init_from": "the weights this run started from (a resume reads the checkpoint's, not these)",
    "data": "the token stream the saved data position counts in",
    "seq_len": "the windows the saved data position counts",
    "seed": "the data order",
    "doc_mask": "what each token attends to",
}
RESUME_MAY_CHANGE = (  # the training goes on differently from here, deliberately: a warning on rank 0
    "steps", "lr", "warmup_steps", "schedule", "weight_decay", "grad_clip", "adam_beta1", "adam_beta2", "adam_eps",
    "batch_size", "dtype", "reduce_dtype", "eval_data", "eval_every", "eval_batches",
    "freeze", "lr_mult",  # progressive unfreezing: a unit that starts training starts a fresh optimizer state
)
RESUME_NOT_COMPARED = (  # how the run runs (memory, speed, logs, where it writes), not what it trains; and
    # --model, whose model (manifest "model") is compared field by field instead
    "model", "micro_batch_size", "ac", "ac_blocks", "ac_rest", "offload_optimizer", "offload_activations", "ce_chunk",
    "prefetch", "out_dir", "ckpt_every", "keep_ckpts", "resume", "overwrite", "from_ckpt", "max_skipped_steps",
    "timeout_min", "ckpt_timeout_min", "first_contact_s", "allow_low_memlock", "allow_small_shm", "gpu_hour_usd",
    "tensorboard", "plot", "export_hf", "export_shard_gb", "log_every", "device", "sample_prompts", "sample_tokens", "plan", "nnodes", "nproc_per_node", "gpu",
    "train_tokens", "plan_json", "fs_write_gbps", "mtbf_hours", "nics_per_node", "nic_gbps", "outside_gib", "async_save",
    "profile",
    "deterministic",  # which kernels compute the same sums (in what order), not what is trained
)
PATH_FLAGS = ("init_from", "data", "eval_data")  # compared by what they name (flag_meaning), not by their spelling


class ResumeMismatch(CheckpointError):
    """An intact checkpoint saved under flags a resume must keep: an older one would be no better."""


def rank_file(rank: int, world: int) -> str:
    return f"rank{rank:05d}-of-{world:05d}.safetensors"


def saved_tensors(unit) -> list:
    return [("master_shard", unit.master_shard)] + list(unit.optimizer_state.items())


# Each tensor's place in BackgroundSave's host buffer is a multiple of this: every view is aligned for any dtype.
STAGING_ALIGN_BYTES = 64


def staging_offsets(nbytes: list[int]) -> list[int]:
    """Where each tensor of `nbytes` starts in BackgroundSave's host buffer, then the buffer's size."""
    return list(itertools.accumulate((-(-n // STAGING_ALIGN_BYTES) * STAGING_ALIGN_BYTES for n in nbytes), initial=0))


def rank_file_tensors(units: list) -> list:
    return [(f"{u.name}.{kind}", t) for u in units for kind, t in saved_tensors(u)]


# --freeze: a frozen unit's master shard never changes during a run, so the first save writes the frozen units' into
# a set of rank files of their own, checkpoints/frozen-<digest of those files>/, and the later checkpoints' manifests
# refer to it ("frozen": its folder, its files' size and SHA-256) instead of writing them again: for a 70B run whose
# base is frozen, most of the bytes. A save writes a new set when this process holds no set of its frozen units at
# its world size (its first save; another --freeze or W after a resume). Retention deletes a set no checkpoint names.
FROZEN_TMP = "frozen"  # a set being written: inside the save's .tmp-step_N folder until its commit
frozen_set = None      # rank 0: the set on disk this process's frozen weights are in: root, world, units, folder, files


def split_frozen(units: list, tensors: list, writes_frozen: bool) -> tuple[list, list | None]:
    """`tensors` (rank_file_tensors' names: the units' own, or their staged copies) split into what this rank's file
    holds and what its file of the frozen set holds (the frozen units' master shards), None when the save refers to
    a set written before."""
    frozen = {f"{u.name}.master_shard" for u in units if not u.trained}
    own = [(name, t) for name, t in tensors if name not in frozen]
    return own, [(name, t) for name, t in tensors if name in frozen] if writes_frozen else None


def frozen_set_kept(root: str, world: int, frozen_names: list) -> bool:
    """Rank 0: whether the frozen units' weights are in a set this save can refer to: the one this process wrote or
    resumed from, for the same units at the same world size, its files still there at their size."""
    global frozen_set
    kept = frozen_set
    if kept and (kept["root"], kept["world"], kept["units"]) == (os.path.realpath(root), world, frozen_names) and all(
            OD.file_size(os.path.join(root, kept["folder"], fname)) == expect["bytes"]
            for fname, expect in kept["files"].items()):
        return True
    frozen_set = None
    return False


def forget_frozen_set():
    """A run that starts from other weights (hf.init_weights) has no set of its own yet: its first save writes one."""
    global frozen_set
    frozen_set = None


def commit_frozen_set(root: str, tmp: str, world: int, units: dict, files: dict | None) -> dict | None:
    """Rank 0, before the manifest that names it: the manifest's "frozen", None without frozen units. The set this
    save wrote (`files`) is moved to checkpoints/frozen-<digest>/ and made durable first (a folder of that name holds
    the same bytes: it is kept); else the save refers to the set frozen_set_kept found."""
    global frozen_set
    names = [name for name, saved in units.items() if not saved["trained"]]
    if not names:
        return None
    if files is not None:
        written = os.path.join(tmp, FROZEN_TMP)
        check_written(written, files)
        folder = "frozen-" + hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
        if os.path.isdir(os.path.join(root, folder)):
            shutil.rmtree(written)
        else:
            OD.fsync_dir(written)
            os.replace(written, os.path.join(root, folder))
            OD.fsync_dir(root)  # on disk before any manifest names it: never a checkpoint without its frozen set
        frozen_set = dict(root=os.path.realpath(root), world=world, units=names, folder=folder, files=files)
    return {"folder": frozen_set["folder"], "files": frozen_set["files"]}


def check_written(folder: str, files: dict):
    for fname, expect in files.items():
        if os.path.getsize(os.path.join(folder, fname)) != expect["bytes"]:
            raise OSError(errno.EIO, f"{fname} has the wrong size on disk")


def unit_records(units) -> dict:
    """The manifest's "units", taken with the snapshot (a background save commits after later steps)."""
    return {u.name: {"numel": u.numel, "shard_numel": u.shard_numel, "optimizer_state": list(u.optimizer_state),
                     "trained": u.trained, "optimizer_steps": u.optimizer_steps,
                     "params": [[slot.name, list(slot.shape)] for slot in u.slots]} for u in units}  # the export's layout


def checkpoint_manifest(cfg, mcfg, units: dict, step, world, data_state, files, frozen=None) -> dict:
    return {"format": CKPT_FORMAT, "step": step, "world_size": world, "model": asdict(mcfg),
            "train": asdict(cfg), "resolved": {key: flag_meaning(key, getattr(cfg, key)) for key in PATH_FLAGS},
            "files": files, "units": units, "data": data_state, **({"frozen": frozen} if frozen else {})}


def save_checkpoint(cfg, mcfg, units, step, rank, world, data_state):
    """Every rank writes its file into a temporary folder; rank 0 checks every file, writes the manifest, renames
    the folder and points `latest` at it. A failure anywhere leaves `latest` and the older checkpoints untouched.
    Three parts, which --async_save (BackgroundSave) runs apart: prepare, write, commit."""
    tmp, writes_frozen = prepare_save(cfg, step, rank, world, [u.name for u in units if not u.trained])
    own, frozen = split_frozen(units, rank_file_tensors(units), writes_frozen)
    report, my_error = write_rank_file(tmp, own, step, rank, world, frozen)
    return commit_save(cfg, mcfg, unit_records(units), step, rank, world, data_state, report, my_error, writes_frozen)


def save_paths(cfg, step: int) -> tuple[str, str, str]:
    root = os.path.join(cfg.out_dir, "checkpoints")
    name = f"step_{step:08d}"
    return root, os.path.join(root, f".tmp-{name}"), os.path.join(root, name)



def prepare_save(cfg, step: int, rank: int, world: int, frozen_names: list) -> tuple[str, bool]:
    """Rank 0 checks the folder is still this run's, makes the temporary folder and decides whether the save writes
    a frozen set (frozen_set_kept): (the folder, that decision) on every rank; the broadcast is the barrier no rank
    writes before."""
    root, tmp, final = save_paths(cfg, step)
    ready = torch.zeros(3, dtype=torch.int64)  # raise_unless_done's two, and whether the save writes a frozen set
    error = f"checkpoint {final} was not saved: rank 0 could not prepare it (its error says why)"
    if rank == 0:
        try:
            OD.check_out_dir_claim(cfg.out_dir, step)
            shutil.rmtree(tmp, ignore_errors=True)
            ready[2] = bool(frozen_names) and not frozen_set_kept(root, world, frozen_names)
            os.makedirs(os.path.join(tmp, FROZEN_TMP) if ready[2] else tmp)
            ready[0] = 1
        except CheckpointError as e:
            error = str(e)
        except OSError as e:
            error = f"checkpoint {final} was not saved: rank 0 could not create {OD.write_error(tmp, e)}{kept_note(root)}"
            ready[1] = e.errno or errno.EIO
    OD.raise_unless_done(ready, error)
    return tmp, bool(ready[2])


REPORT_LEN = 68  # write_rank_file's numbers


def write_rank_file(tmp: str, tensors: list, step: int, rank: int, world: int,
                    frozen: list | None = None) -> tuple[torch.Tensor, str]:
    """This rank's file, and what it tells rank 0 as numbers (nothing is pickled): written or not, the size, the
    SHA-256 as 32 bytes, a failed write's errno, then the size and SHA-256 of its file of the frozen set when the
    save writes one (`frozen`: its tensors); the error's text stays here. No collective: a thread may run it."""
    report, my_error = torch.zeros(REPORT_LEN, dtype=torch.int64), ""
    writes = [(os.path.join(tmp, rank_file(rank, world)), tensors, 1)]
    if frozen is not None:
        writes.append((os.path.join(tmp, FROZEN_TMP, rank_file(rank, world)), frozen, 35))
    try:
        for path, file_tensors, at in writes:
            sha256, nbytes = OD.write_safetensors_streaming(path, file_tensors)
            report[at], report[at + 1:at + 33] = nbytes, torch.tensor(list(bytes.fromhex(sha256)))
        report[0] = 1
        if flags.fault_hook:  # tests only (tests/faults.py): a rank killed or slowed while it saves
            flags.fault_hook("save", step, rank)
    except Exception as e:  # an OSError by its errno; anything else as EIO (not shown to repeat: exit code 1)
        report.zero_()
        report[34] = getattr(e, "errno", None) or errno.EIO
        cause = OD.write_error(path, e) if isinstance(e, OSError) else f"{path}: {type(e).__name__}: {e}"
        my_error = f"rank {rank} could not write {cause}"
    return report, my_error


def file_records(reports: torch.Tensor, world: int, at: int) -> dict:
    """The manifest's size and SHA-256 of each rank's file, from the reports' numbers at `at`."""
    return {rank_file(r, world): {"sha256": bytes(reports[r, at + 1:at + 33].tolist()).hex(), "bytes": int(reports[r, at])}
            for r in range(world)}


def commit_save(cfg, mcfg, units: dict, step, rank, world, data_state, report: torch.Tensor, my_error: str,
                writes_frozen: bool) -> str:
    """Rank 0 gathers every rank's report and, when all wrote, commits: each file's size checked, a frozen set
    written (commit_frozen_set), the manifest, the rename to step_N, `latest`, retention. Returns the checkpoint's
    path on every rank."""
    root, tmp, final = save_paths(cfg, step)
    reports = torch.zeros(world, REPORT_LEN, dtype=torch.int64)
    OD.all_gather_flat(reports.view(-1), report, group=OD.group)
    unwritten = [r for r in range(world) if not reports[r, 0]]
    saved = torch.zeros(2, dtype=torch.int64)  # [saved, the errno of what stopped it], as raise_unless_done's
    if unwritten:
        saved[1] = next((reports[r, 34] for r in unwritten if reports[r, 34]), 0)
        my_error = my_error or f"rank(s) {', '.join(map(str, unwritten))} could not write their files"
    elif rank == 0:
        files = file_records(reports, world, 1)
        try:
            check_written(tmp, files)
            frozen = commit_frozen_set(root, tmp, world, units, file_records(reports, world, 35) if writes_frozen else None)
            manifest = checkpoint_manifest(cfg, mcfg, units, step, world, data_state, files, frozen)
            OD.write_text_atomic(os.path.join(tmp, "manifest.json"), json.dumps(manifest, indent=1))
            shutil.rmtree(final, ignore_errors=True)  # a re-save of a step (after a fallback)
            os.replace(tmp, final)
            try:
                OD.fsync_dir(root)
                OD.write_text_atomic(os.path.join(root, "latest"), os.path.basename(final) + "\n")
            except OSError:
                if latest_name(root) != os.path.basename(final):  # complete, but `latest` does not name it: not saved
                    with contextlib.suppress(OSError):
                        os.replace(final, tmp)  # removed below with the rest of a failed save
                raise
            saved[0] = 1
        except OSError as e:
            my_error = f"rank 0 could not commit it: {OD.write_error(tmp, e)}"
            saved[1] = e.errno or errno.EIO
    if rank == 0 and saved[0]:
        remove_old_checkpoints(root, cfg.keep_ckpts, final)
    elif rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    OD.raise_unless_done(saved, f"checkpoint {final} was not saved: {my_error or 'rank 0 could not commit it'}"
                            + kept_note(root))
    return final


class BackgroundSave:
    """--async_save: a checkpoint that stalls training only for a copy into `staging`, one host buffer (page-locked
    on CUDA), from which a thread writes the file while training goes on. The commit (commit_save) is collective:
    the training thread runs it at the first step boundary where train.py's per-step all-reduce says every rank's
    write is done. One save in flight at most; until its commit it is a .tmp-step_* folder, which nothing loads."""

    def __init__(self, units: list, device: torch.device):
        # Zeroed (no page faults in the first copy) and page-locked in a thread while the first steps train: tens of
        # GB at ~1 GB/s is a minute off the path to step 1. checks.staging_bytes counts these bytes.
        self.staging = self.staged = self.prepare_error = None
        self.preparing = threading.Thread(target=self.prepare, args=(rank_file_tensors(units), device),
                                          name="staging-buffer", daemon=True)
        self.preparing.start()
        self.device, self.saves = device, 0
        self.pending = None   # the save in flight: its step, data position and unit records
        self.writer = None    # the thread writing it
        self.written = None   # what the writer left: (report, error text, seconds it took)

    def prepare(self, tensors: list, device: torch.device):
        t0 = time.perf_counter()
        try:
            nbytes = [t.numel() * t.element_size() for _, t in tensors]
            offsets = staging_offsets(nbytes)
            self.staging = torch.zeros(offsets[-1], dtype=torch.uint8)
            if device.type == "cuda":
                O.page_lock(self.staging, "--async_save")
                weakref.finalize(self, O.unlock, self.staging.data_ptr()).atexit = False
            self.staged = [(name, self.staging[start:start + n].view(t.dtype).view(t.shape))
                           for (name, t), start, n in zip(tensors, offsets, nbytes)]
        except Exception as e:  # raised by the first save, in the training thread
            self.prepare_error = e
        self.prepared_s = time.perf_counter() - t0

    def start(self, cfg, units: list, step: int, rank: int, world: int, data_state):
        self.preparing.join()  # the staging buffer, made in the background since start-up: every rank says if it was
        failed = torch.tensor([int(self.prepare_error is not None)])
        dist.all_reduce(failed, group=OD.group)
        if failed.item():  # the same on a restart (host memory, the locked-memory limit): exit 2, on every rank
            raise CheckpointError(f"--async_save: {failed.item()} rank(s) could not make the staging buffer"
                                  + (f": {self.prepare_error}" if self.prepare_error else ""))
        tmp, writes_frozen = prepare_save(cfg, step, rank, world, [u.name for u in units if not u.trained])
        self.saves += 1
        own, frozen = split_frozen(units, self.staged, writes_frozen)
        written = {name for name, _ in own + (frozen or [])}  # a frozen set written before is not copied again
        for (name, staged), (_, t) in zip(self.staged, rank_file_tensors(units)):
            if name in written:
                staged.copy_(t, non_blocking=True)
        if self.device.type == "cuda":  # the next optimizer step overwrites what is being copied
            torch.cuda.current_stream(self.device).synchronize()
        self.pending = dict(step=step, data_state=data_state, units=unit_records(units), writes_frozen=writes_frozen)
        self.written = None
        self.writer = threading.Thread(target=self.write, args=(tmp, own, frozen, step, rank, world),
                                       name="checkpoint-writer", daemon=True)  # a rank that fails mid-write exits
        self.writer.start()                                                    # without waiting for it

    def write(self, tmp: str, own: list, frozen: list | None, step: int, rank: int, world: int):
        t0 = time.perf_counter()
        report, error = write_rank_file(tmp, own, step, rank, world, frozen)
        self.written = (report, error, time.perf_counter() - t0)

    def writing(self) -> bool:
        return self.writer is not None and self.writer.is_alive()

    def failed(self) -> bool:
        return self.written is not None and not self.written[0][0]

    def finish(self, cfg, mcfg, rank: int, world: int) -> tuple[str, float, float]:
        """Waits for this rank's write and commits the save in flight (collective). Returns (its path, seconds
        training waited here, seconds this rank's write took)."""
        t0 = time.perf_counter()
        self.writer.join()
        (report, error, write_s), pending = self.written, self.pending
        self.pending = self.writer = self.written = None
        path = commit_save(cfg, mcfg, pending["units"], pending["step"], rank, world, pending["data_state"], report, error,
                           pending["writes_frozen"])
        return path, time.perf_counter() - t0, write_s  # the wait: for this rank's write, then for the slowest's


def latest_name(root: str) -> str | None:
    try:
        with open(os.path.join(root, "latest")) as f:
            return f.read().strip()
    except OSError:
        return None


def kept_note(root: str) -> str:
    """What a failed save leaves to resume from: `latest` and the checkpoint it names are not touched."""
    name = latest_name(root)
    return f"; {os.path.join(root, 'latest')} still names {name}, untouched" if name else ""


def list_checkpoints(root: str) -> list[str]:
    """Folders named step_*, newest first. Whether each is complete is for check_manifest to say."""
    if not os.path.isdir(root):
        return []
    names = sorted((n for n in os.listdir(root) if n.startswith("step_")), reverse=True)
    return [os.path.join(root, n) for n in names if os.path.isdir(os.path.join(root, n))]


def candidates_on_disk(root: str) -> list[str]:
    """The checkpoints resume tries, newest first, from the one `latest` names: editing `latest` to an older step_*
    rolls the run back to it (newer folders are overwritten as the run passes their steps again)."""
    paths = list_checkpoints(root)
    latest = latest_name(root)
    if not latest:  # none, or unreadable: from the newest, as agree.agreed_checkpoints decides it
        return paths
    if not os.path.isdir(os.path.join(root, latest)):
        raise CheckpointError(f"{os.path.join(root, 'latest')} names {latest!r}, which is not a folder in {root}; "
                              f"write the name of a step_* folder there, or delete it to use the newest")
    return [p for p in paths if os.path.basename(p) <= latest]  # zero-padded names sort as steps


def finished_run(cfg) -> tuple[str, str] | None:
    """(the checkpoint, what to say) when the one a resume would start from is already at --steps: a finished run's
    command run again (a requeued job) trains and saves nothing (train.main). Only manifests are read."""
    if cfg.resume != "auto" or cfg.from_ckpt or cfg.steps == 0:  # --steps 0 exports the newest checkpoint
        return None
    try:
        candidates = candidates_on_disk(os.path.join(cfg.out_dir, "checkpoints"))
    except (CheckpointError, OSError):
        return None  # setup says what is wrong
    for path in candidates:
        try:
            step = check_manifest(path, None, None, None)["step"]
        except (CheckpointError, AttributeError, KeyError, TypeError):
            continue  # damaged: resume passes it by too
        except OSError:
            return None  # unreadable now (CheckpointUnreadable): resume says so
        if not isinstance(step, int) or step < cfg.steps:
            return None
        done = f" of {cfg.steps}" if step == cfg.steps else f", beyond --steps {cfg.steps}"
        return path, f"already at step {step}{done} ({path}); raise --steps to continue"
    return None


def unless_finished(cfg):
    """cfg, unless the one checkpoint a resume would start from is already at --steps (a finished run's command run
    again: a requeued job, the operator). Then rank 0 says so and it returns None: nothing to train or save; or,
    when that run's --export_hf is missing, the flags that make it."""
    finished = finished_run(cfg)
    if not finished:
        return cfg
    checkpoint, message = finished
    rank0 = os.environ.get("RANK", "0") == "0"
    if not cfg.export_hf or OD.export_made(cfg.export_hf):
        if rank0:
            print(message, flush=True)
        return None
    # A stop request in the last step saved it and skipped the export (train.main's loop): this command, run
    # again, makes it, as `--from_ckpt CHECKPOINT --export_hf DIR` does: tools/export_hf.py, one process (rank 0's).
    # --init_from goes (the checkpoint's manifest names it, for the export's config and tokenizer: export_origin),
    # and what only training reads (--data, --batch_size against the world size) is not checked
    # (flags.check_config's `trains`). Every rank decides alone, before any collective, from the same files on
    # the shared filesystem; only another export to DIR completing at this very moment could split them (a
    # second run of this out_dir is refused by its lock): the ranks that go on then time out at set-up (exit 1,
    # --timeout_min), and their restart finds the export made.
    if rank0:
        print(f"{message}; its export to {cfg.export_hf} was not made (a stop in the last step?): making it now",
              flush=True)
    return replace(cfg, from_ckpt=checkpoint, init_from="")




def is_complete(path: str) -> bool:
    """A readable manifest of this format. An unreadable one counts as not complete: retention neither counts nor
    deletes what it cannot read, and never raises in the middle of a save."""
    try:
        check_manifest(path, None, None, None)
        return True
    except (CheckpointError, OSError):
        return False


def remove_old_checkpoints(root: str, keep: int, just_saved: str):
    """Retention: keeps the checkpoint just saved and the newest complete ones, `keep` in all, and deletes older
    complete ones. Folders without a complete manifest are neither counted nor deleted, so they never push out the
    save just made. Then the frozen sets no step_* folder left names (unless a manifest left cannot be read). A
    failure here (an NFS .nfsXXXX file open elsewhere) is a warning: the checkpoint is saved."""
    complete = [p for p in list_checkpoints(root) if p != just_saved and is_complete(p)]
    for old in complete[keep - 1:]:
        remove_folder(old)
    for old in unnamed_frozen_sets(root):  # after the checkpoints: one that could not be deleted keeps its set
        remove_folder(old)


def remove_folder(path: str):
    try:
        shutil.rmtree(path)
    except OSError as e:
        print(f"warning: retention could not delete {path}: {e.strerror or e}; it stays", file=sys.stderr, flush=True)


def unnamed_frozen_sets(root: str) -> list[str]:
    """The frozen-* folders no step_* folder's manifest names; none when a manifest cannot be read (it may name one)."""
    named = set()
    try:
        for path in list_checkpoints(root):
            with contextlib.suppress(FileNotFoundError):  # an unfinished save names none
                named.add((OD.load_json(os.path.join(path, "manifest.json")).get("frozen") or {}).get("folder"))
        return [os.path.join(root, n) for n in sorted(os.listdir(root)) if n.startswith("frozen-") and n not in named]
    except (OSError, ValueError, AttributeError):
        return []


# A mismatch is the operator's to resolve; nothing here suggests a command that deletes checkpoints.
WAY_FORWARD = ("Restore those flags to continue this run, or start a new phase from this checkpoint's weights "
               "(step 1, a fresh optimizer and data position) in another folder: --init_from {path} --out_dir NEW_DIR")


def check_manifest(path: str, cfg, mcfg, windows) -> dict:
    manifest_path = os.path.join(path, "manifest.json")
    if OD.file_size(manifest_path) is None:
        raise CheckpointError(f"checkpoint {path}: no manifest.json (an unfinished save)")
    try:
        manifest = OD.read_retrying(OD.load_json, manifest_path)
    except (FileNotFoundError, ValueError) as e:  # not JSON: damaged (a read error raises CheckpointUnreadable)
        raise CheckpointError(f"checkpoint {path}: manifest.json is unreadable ({e})") from None
    if manifest.get("format") != CKPT_FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {manifest.get('format')!r}, expected {CKPT_FORMAT!r}")
    if cfg is not None:
        check_manifest_configs(path, manifest, cfg)
        must, _ = config_changes(manifest, cfg, mcfg)
        if must:
            raise ResumeMismatch(f"--resume: checkpoint {path} (step {manifest.get('step')}) was saved under other "
                                 f"values of what a resume must keep: {'; '.join(must)}. {WAY_FORWARD.format(path=path)}")
    if cfg is not None and windows is not None and manifest["data"] is not None:
        try:
            windows.check_state(manifest["data"])
        except D.DataError as e:  # the same --data path holds other tokens now: no older checkpoint fits either
            raise ResumeMismatch(f"--resume: checkpoint {path}: {e}. {WAY_FORWARD.format(path=path)}") from None
    return manifest


def flag_meaning(key: str, value):
    """What a path flag names, whatever its spelling (the manifest's "resolved"): --init_from's real path; a mix's
    [real path, normalised weight] per source (run_data.resolved_mix); None for a mix that does not parse here."""
    if not isinstance(value, str) or value in ("", "sample", "auto"):
        return value
    if key == "init_from":
        return os.path.realpath(value)
    try:
        return run_data.resolved_mix(value, f"--{key}")
    except D.DataError:  # a source that is gone: only the same spelling is the same value
        return None


def same_value(key: str, saved, current, saved_meaning) -> bool:
    """Whether a flag saved as `saved` and now `current` mean the same; a path flag by what it names. `saved_meaning`:
    what the saving run resolved (the manifest's "resolved"; None where its mix did not parse: read from here)."""
    if saved == current:
        return True
    if key not in PATH_FLAGS or not isinstance(saved, str) or not isinstance(current, str):
        return False
    if saved_meaning is None:
        saved_meaning = flag_meaning(key, saved)
    current_meaning = flag_meaning(key, current)
    if saved_meaning is None or current_meaning is None or type(saved_meaning) is not type(current_meaning):
        return False
    if isinstance(saved_meaning, str):  # --init_from's path; "sample", "auto" mean only themselves
        return key == "init_from" and same_path(saved_meaning, current_meaning)
    return len(saved_meaning) == len(current_meaning) and all(  # a mix: source by source, in order
        same_path(path, now_path) and weight == now_weight
        for (path, weight), (now_path, now_weight) in zip(saved_meaning, current_meaning))


def same_path(saved: str, current: str) -> bool:
    """One file or folder: the same real path, or the same inode under another mount (a bind mount)."""
    try:
        return saved == current or os.path.samefile(saved, current)
    except OSError:
        return False


def check_manifest_configs(path: str, manifest: dict, cfg):
    """The manifest holds every field config_changes compares: each of this run's flags ("train"), the model's
    fields and no other ("model"), and what its path flags named ("resolved"). One line naming what it lacks."""
    sections = {"train": [f.name for f in fields(cfg)], "model": [f.name for f in fields(M.ModelConfig)],
                "resolved": list(PATH_FLAGS)}
    for section, names in sections.items():
        saved = manifest.get(section)
        lacks = [n for n in names if n not in saved] if isinstance(saved, dict) else names
        extra = sorted(set(saved) - set(names)) if section == "model" and isinstance(saved, dict) else []
        if lacks or extra:
            raise CheckpointError(f"checkpoint {path}: manifest.json: {section} "
                                  + (f"lacks {', '.join(lacks)}" if lacks else f"has {', '.join(extra)}, which this "
                                     f"model does not") + " (saved by another version of this code)")


def config_changes(manifest: dict, cfg, mcfg) -> tuple[list[str], list[str]]:
    """What differs between the manifest and this run's flags and model: (what a resume must keep, each "--flag was
    A, now B (why)"; what may change, each "--flag A -> B"). The manifest holds each (check_manifest_configs)."""
    saved, resolved = manifest["train"], manifest["resolved"]  # resolved: the path flags only
    must, may = [], []
    for key, why in RESUME_MUST_MATCH.items():
        if not same_value(key, saved[key], getattr(cfg, key), resolved.get(key)):
            must.append(f"--{key} was {saved[key]!r}, now {getattr(cfg, key)!r} ({why})")
    saved_mcfg = asdict(M.ModelConfig(**manifest["model"]))
    model_diff = [f"{k} was {saved_mcfg[k]}, now {v}" for k, v in asdict(mcfg).items() if saved_mcfg[k] != v]
    if model_diff:
        must.append(f"the model (from --model, --init_from's config.json, --data's tokenizer): {', '.join(model_diff)}")
    for key in RESUME_MAY_CHANGE:
        if not same_value(key, saved[key], getattr(cfg, key), resolved.get(key)):
            may.append(f"--{key} {saved[key]} -> {getattr(cfg, key)}")
    return must, may


def check_manifest_numbers(path: str, manifest: dict):
    """The numbers a load computes with, checked before use: a manifest may be edited or damaged (a shard_numel of 0
    divides by zero; a wrong one reads the wrong elements)."""
    def refuse(field, value, expected):
        raise CheckpointError(f"checkpoint {path}: manifest.json: {field} is {value!r}, expected {expected} "
                              f"(a damaged or edited manifest)")

    def whole(value, least):
        return type(value) is int and value >= least
    step, world, units, files = (manifest.get(k) for k in ("step", "world_size", "units", "files"))
    if not whole(step, 0):
        refuse("step", step, "a whole number >= 0")
    if not whole(world, 1):
        refuse("world_size", world, "a whole number >= 1")
    if not isinstance(units, dict) or not units:
        refuse("units", units, "an object with each unit's numel and shard_numel")
    for name, saved in units.items():
        if not isinstance(saved, dict):
            refuse(f"units.{name}", saved, "an object with the unit's numel and shard_numel")
        numel = saved.get("numel")
        if not whole(numel, 1):
            refuse(f"units.{name}.numel", numel, "a whole number >= 1")
        if not whole(saved.get("optimizer_steps"), 0) or type(saved.get("trained")) is not bool:
            refuse(f"units.{name}", {k: saved.get(k) for k in ("optimizer_steps", "trained")},
                   "optimizer_steps a whole number >= 0 and trained true or false")
        state = saved.get("optimizer_state")
        if not (isinstance(state, list) and all(isinstance(k, str) for k in state)):
            refuse(f"units.{name}.optimizer_state", state, "a list of the optimizer's state names")
        if saved.get("shard_numel") != -(-numel // world) or type(saved["shard_numel"]) is not int:
            refuse(f"units.{name}.shard_numel", saved.get("shard_numel"),
                   f"{-(-numel // world)}: numel {numel} over world_size {world}, rounded up")
    rank_files = {rank_file(r, world) for r in range(world)}
    if not isinstance(files, dict) or set(files) != rank_files:
        refuse("files", sorted(files)[:2] if isinstance(files, dict) else files,
               f"the {world} files {rank_file(0, world)} to {rank_file(world - 1, world)}")
    frozen = manifest.get("frozen")  # the frozen set it names (--freeze), a folder beside it: never a path elsewhere
    if frozen is None and not all(saved["trained"] for saved in units.values()):
        refuse("frozen", frozen, "the frozen set that holds the units saved frozen")
    if frozen is not None and not (isinstance(frozen, dict) and re.fullmatch(r"frozen-[0-9a-f]+", str(frozen.get("folder")))
                                   and isinstance(frozen.get("files"), dict) and set(frozen["files"]) == rank_files):
        refuse("frozen", frozen, f'{{"folder": "frozen-<hex digits>", "files": the {world} rank files}}')
    listed = [(f"files.{f}", e) for f, e in files.items()] + [(f"frozen.files.{f}", e) for f, e in
                                                              (frozen or {"files": {}})["files"].items()]
    for field, expect in listed:
        if not (isinstance(expect, dict) and whole(expect.get("bytes"), 0) and isinstance(expect.get("sha256"), str)):
            refuse(field, expect, '{"sha256": "...", "bytes": a whole number}')


def trained_when_saved(manifest: dict, name: str) -> bool:
    return manifest["units"][name]["trained"]


def freeze_changes(manifest: dict, units: list) -> tuple[list[str], list[str]]:
    """--freeze changed on resume: (the units that start training; the units frozen now)."""
    started = [u.name for u in units if u.trained and not trained_when_saved(manifest, u.name)]
    stopped = [u.name for u in units if not u.trained and trained_when_saved(manifest, u.name)]
    return started, stopped


def unit_file(manifest: dict, name: str, fname: str) -> tuple[str, dict | None]:
    """Where unit `name`'s part of rank file `fname` is, relative to the checkpoint's folder (load_checkpoint), and
    the manifest's size and SHA-256 of it: in the frozen set the manifest names for a unit frozen when saved."""
    frozen = manifest.get("frozen")  # every unit frozen when saved is in it (check_manifest_numbers)
    if not trained_when_saved(manifest, name):
        return os.path.join("..", frozen["folder"], fname), frozen["files"].get(fname)
    return fname, manifest["files"].get(fname)


def check_file_size(path: str, fname: str, expect: dict | None):
    size = OD.file_size(os.path.join(path, fname))
    if expect is None or size is None:
        raise CheckpointError(f"checkpoint {path}: {fname} is missing")
    if size != expect["bytes"]:
        raise CheckpointError(f"checkpoint {path}: {fname} has {size} bytes, the manifest says {expect['bytes']} "
                              f"(truncated?)")


def load_checkpoint(path: str, manifest: dict, units: list, master_only: bool = False, verified: set | None = None):
    """Fills this rank's shards from the checkpoint, whatever world size saved it: a unit's flat layout does not
    depend on W, so a new shard [a, b) is read from the old rank files that cover it, each checked against the
    manifest's size and SHA-256 first (once: `verified`, the files checked so far, for a reader of a unit at a
    time, tools/export_hf.py). `master_only`: the fp32 master shards alone (a new phase, an export)."""
    from safetensors import safe_open
    check_manifest_numbers(path, manifest)
    old_world = manifest["world_size"]
    # Optimizer state is read for the units that train now and trained then (--freeze may have changed): a unit
    # that starts training starts from zero state and its own first step, as a parameter new to a torch optimizer.
    # A new phase (master_only) may add units (a fork's adapter): init_weights initialises those; a resume may not.
    units = [u for u in units if u.name in manifest["units"]] if master_only else units
    with_state = set()
    for unit in units:
        saved = manifest["units"].get(unit.name)
        if saved is None:  # another model's code (a fork's unit): no older checkpoint has it either
            raise ResumeMismatch(f"checkpoint {path}: unit {unit.name} is missing (a resume continues the model that "
                                 f"saved it; --init_from it starts a new phase, which initialises such units)")
        if saved["numel"] != unit.numel:
            raise ResumeMismatch(f"checkpoint {path}: {unit_sizes(unit.name, saved['numel'], unit.numel)}")
        if master_only or not (unit.trained and trained_when_saved(manifest, unit.name)):
            unit.optimizer_steps = 0
            for tensor in unit.optimizer_state.values():
                tensor.zero_()  # what a fall-back from a checkpoint that had it read goes too
            continue
        saved_state = saved["optimizer_state"]
        if saved_state != list(unit.optimizer_state):
            raise CheckpointError(f"checkpoint {path}: unit {unit.name} was saved with optimizer state "
                                  f"{', '.join(saved_state) or 'none'}, this run's optimizer keeps "
                                  f"{', '.join(unit.optimizer_state) or 'none'} for it")
        with_state.add(unit.name)
        unit.optimizer_steps = saved["optimizer_steps"]
    verified = set() if verified is None else verified
    for unit in units:
        old_shard = manifest["units"][unit.name]["shard_numel"]
        lo, hi = unit.shard_start, min(unit.shard_start + unit.shard_numel, unit.numel)
        for old_rank in range(lo // old_shard, -(-hi // old_shard)) if lo < hi else []:
            fname, expect = unit_file(manifest, unit.name, rank_file(old_rank, old_world))
            fpath = os.path.join(path, fname)
            if fname not in verified:
                check_file_size(path, fname, expect)
                if OD.read_retrying(OD.sha256_file, fpath) != expect["sha256"]:
                    raise CheckpointError(f"checkpoint {path}: {fname} does not match its SHA-256 (damaged)")
                verified.add(fname)
            a, b = max(lo, old_rank * old_shard), min(hi, (old_rank + 1) * old_shard)
            with safe_open(fpath, framework="pt") as f:
                for kind, tensor in saved_tensors(unit) if unit.name in with_state else saved_tensors(unit)[:1]:
                    key = f"{unit.name}.{kind}"
                    if key not in f.keys() or f.get_slice(key).get_shape() != [old_shard]:
                        raise CheckpointError(f"checkpoint {path}: {fname} holds {key} with shape "
                                              f"{f.get_slice(key).get_shape() if key in f.keys() else 'none (missing)'}, "
                                              f"the manifest's shard_numel says [{old_shard}]")
                    piece = f.get_slice(key)[a - old_rank * old_shard:b - old_rank * old_shard]
                    tensor[a - unit.shard_start:b - unit.shard_start] = piece.to(tensor.device)


USABLE, DAMAGED, MISMATCHED, UNREADABLE = range(4)  # what a rank found reading a checkpoint


def read_agreed(path: str, cfg, mcfg, windows, units, master_only: bool = False) -> tuple[dict, str, list[int]]:
    """This rank's shards from the checkpoint `path` (check_manifest, load_checkpoint), every rank's outcome gathered:
    (the manifest, this rank's error, the ranks that cannot use it): one rank's damaged file rejects it for all.
    Other flags, or a read error on any rank, raise on every rank: never a fallback to an older checkpoint. Each
    rank's step and manifest SHA-256 are gathered too: ranks that read other bytes under one name (a node caching
    an older folder) stop before a step trains on a mix of two checkpoints."""
    error, code, os_errno, manifest = "", USABLE, 0, {}
    try:
        manifest = check_manifest(path, cfg, mcfg, windows)
        load_checkpoint(path, manifest, units, master_only=master_only)
    except ResumeMismatch as e:  # intact, but saved under other flags: no older checkpoint is better
        error, code = str(e), MISMATCHED
    except CheckpointUnreadable as e:  # read_retrying's: tried again already
        error, code, os_errno = f"checkpoint {path}: {e}", UNREADABLE, e.errno or errno.EIO
    except (CheckpointError, ValueError, KeyError, FileNotFoundError) as e:  # provably damaged content
        error, code = (str(e) if isinstance(e, CheckpointError) else f"checkpoint {path}: unreadable ({e})"), DAMAGED
    except OSError as e:  # safetensors' own reads, after the hash matched: not damage either
        error, code, os_errno = f"checkpoint {path}: cannot read it: {e.strerror or e}", UNREADABLE, e.errno or errno.EIO
    digest = int(hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:15], 16)
    by_rank = torch.zeros(dist.get_world_size(), 4, dtype=torch.int64)
    OD.all_gather_flat(by_rank.view(-1), torch.tensor([code, os_errno, manifest.get("step", -1), digest]), group=OD.group)
    codes = by_rank[:, 0].tolist()
    failed = [r for r, found in enumerate(codes) if found != USABLE]
    if MISMATCHED in codes:
        raise CheckpointError(error or f"checkpoint {path}: rank(s) {', '.join(map(str, failed))} cannot use it")
    if UNREADABLE in codes:
        ranks = [r for r in failed if codes[r] == UNREADABLE]
        if code != UNREADABLE:
            error = (f"checkpoint {path}: rank(s) {', '.join(map(str, ranks))} could not read it (their line names "
                     f"the file)")
        raise CheckpointUnreadable(int(by_rank[ranks[0], 1]), f"{error}; the older checkpoints were not used: a read "
                                                              f"error is not damage")
    read = by_rank[:, 2:].tolist()
    if not failed and any(row != read[0] for row in read):
        steps = ", ".join(f"rank {r}: step {step}" for r, (step, _) in enumerate(read))
        raise CheckpointError(f"checkpoint {path}: the ranks read different manifests ({steps}; SHA-256 differs "
                              f"too): this filesystem showed the ranks different files; a restart reads again",
                              os_errno=errno.ESTALE)
    return manifest, error, failed


def resume(cfg, mcfg, units, windows, rank, candidates: list[str]) -> tuple[int, int]:
    """Loads the newest intact checkpoint among `candidates`, agreed by every rank (read_agreed): (its step, data
    position). A damaged one is reported and the previous one tried."""
    global frozen_set
    for path in candidates:
        manifest, error, failed = read_agreed(path, cfg, mcfg, windows, units)
        if not failed:
            frozen = manifest.get("frozen")  # the frozen units' weights were read from it: later saves may name it
            frozen_set = frozen and dict(frozen, root=os.path.realpath(os.path.dirname(path)), world=manifest["world_size"],
                                         units=[n for n in manifest["units"] if not trained_when_saved(manifest, n)])
            if rank == 0:  # what goes on differently from here: a warning each
                step, changed = manifest["step"] + 1, config_changes(manifest, cfg, mcfg)[1]
                started, stopped = freeze_changes(manifest, units)
                if changed:
                    print(f"warning: resuming from {path} with changed flags: {', '.join(changed)}; the run continues "
                          f"under the new values from step {step}", file=sys.stderr, flush=True)
                if started:
                    print(f"warning: --freeze: unit(s) {', '.join(started)} start training at step {step} with a fresh "
                          f"optimizer state (zero moments, their own step count from 1)", file=sys.stderr, flush=True)
                if stopped:
                    print(f"warning: --freeze: unit(s) {', '.join(stopped)} are frozen from step {step}; their saved "
                          f"optimizer state is dropped", file=sys.stderr, flush=True)
            data = manifest["data"] or {"position": 0}  # a conversion run (--steps 0) saved no data state
            return manifest["step"], data["position"]
        if error:
            print(f"warning: {error}", file=sys.stderr, flush=True)
        if rank == 0:
            print(f"warning: not using {path}; trying the previous checkpoint", file=sys.stderr, flush=True)
    root = os.path.join(cfg.out_dir, "checkpoints")
    raise CheckpointError(f"no intact checkpoint in {root}: each one is damaged (the warnings above say how); nothing "
                          f"was deleted. Repair or restore them, or start this run again in another --out_dir")


# ================================================================================================
# Phases: a new run from one of our checkpoints' weights (--init_from); an export reads one itself (tools/export_hf.py)
# ================================================================================================

def find_checkpoint(path: str) -> str | None:
    """The step_* folder `path` means: itself (it holds manifest.json), or for an --out_dir the one its `latest`
    names (else its newest complete one). None when it is neither."""
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    root = os.path.join(path, "checkpoints")
    candidates = candidates_on_disk(root)  # `latest` first; it names a complete checkpoint (saved before it)
    if os.path.isfile(os.path.join(root, "latest")) or not candidates:
        return candidates[0] if candidates else None
    return next((p for p in candidates if is_complete(p)), candidates[0])


def unit_sizes(name: str, saved_numel: int, numel: int) -> str:
    return f"unit {name} has {saved_numel} parameters there and {numel} in this model (another model, or another fork)"


def unit_list(names: list[str]) -> str:
    """Unit names for one line, each run of consecutive blocks' units as one: `embed, layers.0-31.lora, head`."""
    runs = {}  # a name with its block number left out ("layers.{}.lora") -> [[first block, last block], ...]
    for name in names:
        block = M.block_of(name)
        if block is None:
            runs[name] = None
            continue
        blocks = runs.setdefault("layers.{}" + name[len(f"layers.{block}"):], [])
        if blocks and blocks[-1][1] == block - 1:
            blocks[-1][1] = block
        else:
            blocks.append([block, block])
    return ", ".join(key if blocks is None else ", ".join(key.format(f"{a}-{b}" if b > a else a) for a, b in blocks)
                     for key, blocks in runs.items())


def check_units(path: str, manifest: dict, numels: dict):
    """The units of this model (`numels`: name -> parameters) against the checkpoint's, for a new phase (--init_from).
    Refused: a unit of another size; a unit the checkpoint holds that this model lacks (its trained weights would be
    dropped: the checkpoint of a fork run without it, or units named otherwise). A unit the checkpoint lacks (a fork's
    adapter) the new phase initialises as a run from scratch does (hf.init_weights)."""
    saved = manifest["units"]
    for name, numel in numels.items():
        if name in saved and saved[name]["numel"] != numel:
            raise CheckpointError(f"checkpoint {path}: {unit_sizes(name, saved[name]['numel'], numel)}")
    dropped = [n for n in saved if n not in numels]
    if dropped:
        raise CheckpointError(f"checkpoint {path} holds unit(s) {unit_list(dropped)}, which this model does not have: "
                              f"their trained weights would be dropped; run the code (the fork) that saved them")


def check_checkpoint_files(path: str, flag: str, numels: dict):
    """What is cheap to check of a checkpoint before any work: its manifest, every rank file's size, the frozen
    set's it names too (their SHA-256 as they are read: load_weights), and its units against this model's
    (`numels`, check_units)."""
    try:
        manifest = check_manifest(path, None, None, None)
        check_manifest_numbers(path, manifest)  # before a file name of its is joined to a path
        frozen = manifest.get("frozen") or {"folder": "", "files": {}}
        for fname, expect in manifest["files"].items():
            check_file_size(path, fname, expect)
        for fname, expect in frozen["files"].items():
            check_file_size(path, os.path.join("..", frozen["folder"], fname), expect)
        check_units(path, manifest, numels)
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{flag}: checkpoint {path}: manifest.json lacks {e}") from None
    except CheckpointError as e:
        raise CheckpointError(f"{flag}: {e}") from None



def load_weights(path: str, units: list, flag: str) -> dict:
    """The fp32 master shards of the checkpoint `path`, re-sharded for this world size, no optimizer state
    (--init_from: a new phase), agreed by every rank (read_agreed), of the units it holds (check_units
    decided before any work which units it may lack). Returns its manifest."""
    try:
        manifest, error, failed = read_agreed(path, None, None, None, units, master_only=True)
    except CheckpointUnreadable as e:
        raise CheckpointUnreadable(e.errno, f"{flag}: {e.strerror}") from None
    if failed:
        raise CheckpointError(f"{flag}: " + (error or f"checkpoint {path}: rank(s) {', '.join(map(str, failed))} "
                                                      f"cannot use it"))
    return manifest


