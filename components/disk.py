"""State on disk: the out_dir a run owns, its own checkpoints (save, retention, resume at any world size),
and Hugging Face folders (import by partial reads, export one unit at a time).

All this file needs of train.py's units: `name`, `numel`, `padded_numel`, `shard_numel`, `shard_start`,
`slots` (each parameter's place in the unit's flat buffer), `master_shard`, `optimizer_state` (a dict
of fp32 tensors shaped like master_shard, named by the optimizer; empty for a frozen unit), `trained` (False:
frozen by --freeze) and `optimizer_steps` (the unit's own count for AdamW's bias corrections).

  out_dir/.lock                                      rank 0's flock for the whole run: one run per out_dir
  out_dir/checkpoints/step_00000100/manifest.json   step, configs, world size, file checksums
                     /step_00000100/rank00000-of-00016.safetensors  that rank's master and optimizer shards
  out_dir/checkpoints/frozen-<digest>/rank00000-of-00016.safetensors  --freeze: the frozen units' master shards,
                                                     written once a run, named by the checkpoints that use them
  out_dir/checkpoints/latest                         "step_00000100", replaced atomically
  out_dir/checkpoints/.tmp-step_00000200/            a save in progress: never loaded
"""
import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict, fields, replace

import torch
import torch.distributed as dist

import data as D
import model as M
from components import flags  # fault_hook: the tests' faults (a rank killed or slowed while it saves)
from components import offload as O  # page_lock: the staging buffer of --async_save
from components import run_data  # what --data names: its mix, the folder recording its tokenizer
from components import tokenizer_export  # export_tokenizer: the tokenizer's files

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # as in train.py

# The collectives of a checkpoint save wait for every rank's file, which can take longer than
# --timeout_min (53 GB per rank for 70B on 16 GPUs). They run in their own group: gloo, so on the CPU and
# outside NCCL's watchdog, with --ckpt_timeout_min. Made once per process group by make_group.
group = None


GLOO_CONNECT_TIMEOUT_S = 120.0


def make_group(timeout_min: float):
    """gloo connects every pair of ranks when a group is made, waiting up to its timeout (an hour of silence behind
    a firewall): a group made and dropped with GLOO_CONNECT_TIMEOUT_S first makes that one line."""
    global group
    if group is not None:
        return
    try:  # new_group is itself collective: every rank makes it, in the same order
        probe = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=GLOO_CONNECT_TIMEOUT_S))
        # A rank whose own connections are made may not destroy the group before the others' are: they would
        # see "Connection closed by peer" (seen on a loaded machine). The barrier returns once every rank has it.
        dist.barrier(group=probe)
        dist.destroy_process_group(probe)
    except (RuntimeError, dist.DistError) as e:
        cause = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise GroupUnreachable(f"the checkpoint group (gloo: TCP between every pair of ranks) did not connect within "
                           f"{GLOO_CONNECT_TIMEOUT_S:g} s ({cause}): gloo listens on the address this host's name "
                           f"resolves to unless GLOO_SOCKET_IFNAME names the interface between the nodes; every node "
                           f"must reach the others on any TCP port") from None
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_min))


class GroupUnreachable(RuntimeError):
    """The checkpoint group's gloo could not connect, after every rank met in the store: an interface or a firewall,
    which a restart meets again (processes.exit_code: 2)."""


class CheckpointError(Exception):
    """A checkpoint or out_dir that must not be used; the message names the folder and the problem. `os_errno`: the
    errno of the OSError behind it, if any (agreed by every rank), for processes.exit_code."""

    def __init__(self, message: str, os_errno: int | None = None):
        super().__init__(message)
        self.os_errno = os_errno


class OutDirHeld(CheckpointError):
    """--out_dir's lock is held by a run that may be gone (a crashed node's lock, kept by NFS or Lustre until the
    holder's lease ends) and nothing proves it: the lock is kept, and a restart may find it free."""


class CheckpointUnreadable(OSError):
    """A checkpoint file that could not be read after READ_WAITS_S's retries (EIO, ESTALE: not a missing file).
    An OSError, not a CheckpointError: nothing takes it for damage, so resume never rolls back past it."""

    def __str__(self):
        return self.strerror


# A write error a restart meets again (processes.exit_code: exit 2): the disk is full of bytes or inodes, over quota,
# read-only, forbidden, or the file over its size limit (write_error's hints). Any other (EIO, ESTALE) may pass.
LASTING_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)


# ================================================================================================
# The out_dir
# ================================================================================================

# One run per --out_dir, in a folder every rank sees. Rank 0 holds an exclusive flock on OUT_DIR/.lock for the
# whole run (the kernel drops it when the process dies, kill -9 included), and writes a random token into it that
# every rank must read back: a node-local --out_dir fails here, not at the first save. Where flock is node-local,
# a run on another node takes the lock too: rank 0 reads the token back before every save (check_out_dir_claim).
out_dir_lock = None   # rank 0's open .lock file: closing it would release the lock
out_dir_claim = None  # rank 0's (out_dir, token) while it holds the lock


def write_error(path: str, e: OSError) -> str:
    """`path: the system's words (what usually fixes it)`: one line for an OSError met writing to disk."""
    hint = {errno.ENOSPC: "the filesystem is full, of bytes or of inodes: df -h and df -i say which",
            errno.EDQUOT: "the disk quota is used up: quota -s shows it",
            errno.EROFS: "the filesystem is mounted read-only",
            errno.EACCES: "this user may not write there", errno.EPERM: "this user may not write there",
            errno.EFBIG: "over the file size limit: ulimit -f"}.get(e.errno)
    return f"{e.filename or path}: {e.strerror or e}" + (f" ({hint})" if hint else "")


def unwritable(path: str, e: OSError) -> str:
    """The line that stops a run whose metrics.jsonl or samples.jsonl cannot be written (train.py's stop all-reduce)."""
    return (f"--out_dir: cannot write {write_error(path, e)}; the run stops without saving: once the file can be "
            f"written, the same command resumes from the last checkpoint")


def open_no_follow(path: str, flags: int):
    """os.open in a folder others may write to, never through a symbolic link planted under the name: ELOOP."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


def create_file(path: str):
    """A new file at `path` for a temporary write: a leftover of a crash, or a link, is removed first."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return os.fdopen(open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w")


def read_lock(path: str) -> tuple[str, str]:
    """(token, holder) written in a .lock file: holder is take_lock's "host H pid P since T[ job J restart R]"; ("", "")
    when there is none or it cannot be read."""
    try:
        with os.fdopen(open_no_follow(path, os.O_RDONLY)) as f:
            token, _, holder = f.read().strip().partition(" ")
    except OSError:
        return "", ""
    return token, holder


def env_count(env, name: str) -> int:
    count = env.get(name, "0")
    return int(count) if count.isdigit() else 0


def take_lock(path: str, env) -> tuple[int, str, int | None]:
    """Rank 0: the exclusive flock on `path`, holding a new random token. Returns (token, "", None), (0, "", None)
    when another process holds the lock, or (-1, why the lock could not be taken, its errno)."""
    global out_dir_lock
    try:
        f = os.fdopen(open_no_follow(path, os.O_RDWR | os.O_CREAT), "r+")
    except OSError as e:
        if e.errno == errno.ELOOP:
            return -1, f"--out_dir: {path} is a symbolic link; the lock is never taken through one: delete it", None
        return -1, f"--out_dir: cannot create the lock file {write_error(path, e)}", e.errno
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return 0, "", None
    except OSError as e:  # ENOLCK, ENOSYS, EOPNOTSUPP: the filesystem does not lock
        f.close()
        return -1, (f"--out_dir: cannot lock {path}: {e.strerror or e}: the filesystem of --out_dir does not support "
                    f"flock (Lustre mounted without the flock option, NFS mounted with nolock); mount it with '-o flock' "
                    f"(Lustre) or with the lock service running (NFS), or choose another --out_dir"), None
    token = int.from_bytes(os.urandom(6), "little") + 1
    holder = f"host {socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
    if env.get("SLURM_JOB_ID"):  # what held_lock_verdict judges a lock by
        holder += f" job {env['SLURM_JOB_ID']} restart {env_count(env, 'SLURM_RESTART_COUNT')}"
    try:
        f.truncate(0)
        f.write(f"{token} {holder}\n")
        f.flush()
        os.fsync(f.fileno())
    except OSError as e:
        f.close()
        return -1, f"--out_dir: cannot write the lock file {write_error(path, e)}", e.errno
    out_dir_lock = f
    return token, "", None


def holder_fields(holder: str) -> dict:
    return dict(re.findall(r"\b(host|pid|job|restart) (\S+)", holder))


# A lock outlives its holder where the filesystem keeps a crashed node's flock (NFS until the client's lease
# ends, Lustre until the client is evicted): a requeued job would find its own folder "in use". So a held lock is
# judged by what SLURM says of its job, never by its age: a node cut off but alive keeps its folder while it runs.
SLURM_ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
               "BOOT_FAIL", "DEADLINE")
SLURM_ALIVE = ("RUNNING", "PENDING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
               "CONFIGURING", "SIGNALING", "STOPPED", "SPECIAL_EXIT", "RESV_DEL_HOLD", "STAGE_OUT")  # will run again
# Anything else (COMPLETING: ending right now; a word this list does not know) is unclear: a restart asks again.


def slurm_job_state(job: str) -> str | None:
    """SLURM job `job`'s state (RUNNING, TIMEOUT, ...), "GONE" when SLURM no longer knows it (purged MinJobAge after
    it ended), None when scontrol cannot be asked or its answer is unclear."""
    if not job.isdigit():
        return None
    try:
        proc = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return "GONE" if "Invalid job id" in proc.stderr else None
    states = {state for line in proc.stdout.splitlines() if re.search(rf"\bJobId={job}\b", line)
              for state in re.findall(r"\bJobState=(\w+)", line)}
    return states.pop() if len(states) == 1 else None


def held_lock_verdict(holder: str, env=os.environ) -> tuple[str, str]:
    """Whether the run a held lock's `holder` names still runs, and why: "gone" (its SLURM job ended, or it is this
    job before a requeue), "alive" (its job runs or will, or a live process of this host) or "unclear"."""
    held = holder_fields(holder)
    job, pid = held.get("job"), held.get("pid", "")
    if held.get("host") == socket.gethostname() and pid.isdigit() and os.path.isdir(f"/proc/{pid}"):
        return "alive", f"process {pid} runs on this host"  # a lock of this host's dies with its holder
    if job and job == env.get("SLURM_JOB_ID"):
        held_restart, our_restart = held.get("restart", ""), env_count(env, "SLURM_RESTART_COUNT")
        if held_restart.isdigit() and our_restart > int(held_restart):
            return "gone", (f"it is this SLURM job {job} before its requeue (restart {held_restart}, now {our_restart}): "
                            f"SLURM ended that allocation")
        return "unclear", f"it is this allocation of SLURM job {job}, an earlier attempt of which may still be ending"
    if not job:
        return "unclear", "it recorded no SLURM job to ask about"
    state = slurm_job_state(job)
    if state == "GONE" or state in SLURM_ENDED:
        return "gone", f"SLURM job {job} " + ("is no longer known to SLURM" if state == "GONE" else f"is {state}")
    if state in SLURM_ALIVE:
        return "alive", f"SLURM job {job} is {state}"
    return "unclear", f"scontrol show job {job} " + ("cannot be asked here" if state is None else f"says {state}")


def claim_lock(path: str, env) -> tuple[int, str, int | None]:
    """Rank 0: take_lock's (token, error, errno), a held lock judged (held_lock_verdict): 0 and why for a live
    holder, -2 and why for one that may have ended (kept: a restart may find it free). A gone run's lock is taken
    over: its file replaced (flock belongs to the old inode, which the dead holder keeps), if it still holds what
    was judged; a holder alive after all sees another token at its next save and stops (check_out_dir_claim)."""
    token, error, os_errno = take_lock(path, env)
    if token != 0:
        return token, error, os_errno
    seen = read_lock(path)
    verdict, why = held_lock_verdict(seen[1], env)
    if verdict != "gone":
        return (0 if verdict == "alive" else -2), why, None
    if read_lock(path) != seen:  # another contender took it first: it keeps it
        return -2, why, None
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        return -1, f"--out_dir: cannot replace the lock file {write_error(path, e)}", e.errno
    token, error, os_errno = take_lock(path, env)
    if token > 0:
        print(f"--out_dir: took over {path} from {seen[1]}: {why}", flush=True)
    return (-2, why, None) if token == 0 else (token, error, os_errno)


def claim_out_dir(out_dir: str, rank: int, world: int, device, env=os.environ):
    global out_dir_lock, out_dir_claim
    if out_dir_lock is not None:  # a caller running several trainings in one process (bench/): the last one ended
        out_dir_lock.close()
        out_dir_lock = out_dir_claim = None
    path = os.path.join(out_dir, ".lock")
    claim, error = torch.zeros(2, dtype=torch.int64, device=device), ""  # claim_lock's token and errno (or 0)
    if rank == 0:
        token, error, os_errno = claim_lock(path, env)
        claim[0], claim[1] = token, os_errno or 0
        out_dir_claim = (out_dir, token) if token > 0 else None
    dist.broadcast(claim, src=0)
    token = claim[0].item()
    if token == -1:
        raise CheckpointError(error or f"--out_dir: rank 0 could not lock {path} (its error says why)",
                              os_errno=claim[1].item() or None)
    token_seen, holder = read_lock(path)
    why = f": {error}" if error else ""  # rank 0's judgement (held_lock_verdict)
    if token == 0:
        raise CheckpointError(f"--out_dir: {out_dir} is in use by another run ({holder}{why}); wait for it to end or "
                              f"choose another --out_dir")
    if token == -2:  # how to tell a live holder from a stale lock
        held = holder_fields(holder)
        gone = "that run is gone"
        if "host" in held and "pid" in held:
            gone = f"no process {held['pid']} runs on {held['host']}"
        raise OutDirHeld(f"--out_dir: {out_dir} is locked by a run that may have ended ({holder}{why}); the lock is kept "
                         f"and a restart may find it free; if {gone}, the lock is stale: delete {path}")
    seen_by_rank = torch.zeros(world, dtype=torch.int64, device=device)
    all_gather_flat(seen_by_rank, torch.tensor([int(token_seen == str(token))], device=device))
    blind = [r for r, seen in enumerate(seen_by_rank.tolist()) if not seen]
    if blind:
        raise CheckpointError(f"--out_dir: {out_dir} is not one folder for all ranks: rank(s) "
                              f"{', '.join(map(str, blind))} do not see the {path} that rank 0 wrote; use a folder on "
                              f"a filesystem every node mounts")
    root = os.path.join(out_dir, "checkpoints")
    for name in os.listdir(root) if rank == 0 and os.path.isdir(root) else []:  # the holder clears crashed saves
        if name.startswith(".tmp-step_"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# --resume never --overwrite true deletes the folder's checkpoints and metrics once per run: a restart of that run
# (torchrun's --max-restarts, a SLURM requeue) resumes what it saved since, instead of deleting days of training.
# The same command started afresh by hand has no restart count: it overwrites again.
OVERWRITE_MARKER = ".overwritten"


def overwrite_once(out_dir: str, env=os.environ) -> str | None:
    """Rank 0, --resume never --overwrite true: deletes OUT_DIR's checkpoints and metrics.jsonl and records this run
    as the one that did; or, in a restart of that run, deletes nothing and returns the line that says so."""
    run = ""  # what stays the same across this run's restarts: the SLURM job (a requeue keeps its id), else
    if env.get("SLURM_JOB_ID"):  # torchrun's rendezvous id (launch.sh's RDZV_ID; a uuid per `torchrun --standalone`)
        run = f"SLURM job {env['SLURM_JOB_ID']}"
    elif env.get("TORCHELASTIC_RUN_ID"):
        run = f"torchrun rendezvous {env['TORCHELASTIC_RUN_ID']}"
    restarts = max(env_count(env, name) for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
    try:
        marker = load_json(os.path.join(out_dir, OVERWRITE_MARKER))
    except (OSError, ValueError):
        marker = None
    if run and restarts and isinstance(marker, dict) and marker.get("run") == run:
        return (f"--overwrite: nothing deleted: this is restart {restarts} of the run ({run}) that overwrote {out_dir} "
                f"at {marker.get('time')}; it resumes from its own checkpoints")
    shutil.rmtree(os.path.join(out_dir, "checkpoints"), ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out_dir, "metrics.jsonl"))
    # Written after the deletion: a crash between the two overwrites again on the restart, never the reverse.
    write_atomic(os.path.join(out_dir, OVERWRITE_MARKER),
                 json.dumps({"run": run, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                             "host": socket.gethostname(), "pid": os.getpid()}) + "\n")
    return None


def check_out_dir_claim(out_dir: str, step: int):
    """Rank 0, before each save: OUT_DIR/.lock still holds this run's token, or another run took the folder (flock
    is node-local there) and this one stops before either writes over the other's saves."""
    if out_dir_claim is None or out_dir_claim[0] != out_dir:  # no claim: a test or tool saving on its own
        return
    path = os.path.join(out_dir, ".lock")
    token, holder = read_lock(path)
    if token != str(out_dir_claim[1]):
        raise CheckpointError(
            f"--out_dir: {out_dir} was taken by another run while this one held its lock: {path} now names "
            f"{holder or 'nothing readable'}; flock on this filesystem does not keep nodes apart (Lustre mounted with "
            f"localflock, NFS with local_lock=flock or local_lock=all): mount it with '-o flock' (Lustre) or "
            f"local_lock=none (NFS), or give each run its own --out_dir. Step {step} was not saved; this run stops")

# ================================================================================================
# Own checkpoints: each rank writes its shards; rank 0 commits atomically; resume re-shards for any W
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


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_safetensors_streaming(path: str, tensors: list, metadata: dict | None = None) -> tuple[str, int]:
    """Writes [(name, tensor)] as safetensors (u64 header length, JSON header, raw data), one tensor at a time, not
    the rank's whole state in host memory, hashing the bytes as written: (sha256, size). Mode: the umask's."""
    header, offset = ({"__metadata__": metadata} if metadata else {}), 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format aligns the data to 8 bytes
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (len(header_bytes).to_bytes(8, "little"), header_bytes):
            f.write(chunk)
            digest.update(chunk)
        for _, t in tensors:
            data = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()  # bf16 too: as bytes
            f.write(data)
            digest.update(data)
        f.flush()
        os.fsync(f.fileno())  # on disk before rank 0 may call the checkpoint (or the export) complete
    return digest.hexdigest(), 8 + len(header_bytes) + offset


# Reading a checkpoint back. Only content that is provably damaged (a hash that does not match, a file of the
# wrong size or missing, a manifest that does not parse) makes resume fall back to an older checkpoint. Any other
# read error (EIO, ESTALE: a disk or a network filesystem having a moment) is tried again, then stops the run with
# the file named and exit code 1: a restart may read it, and falling back would silently throw away the newest
# steps. (A fault of a memory-mapped read is SIGBUS, not an OSError: safetensors reads happen after the hash.)
READ_WAITS_S = (1.0, 3.0, 10.0)  # between the tries of a read that failed


def read_retrying(read, path: str):
    """read(path), tried again READ_WAITS_S apart after an OSError that may pass, then CheckpointUnreadable.
    A missing file (FileNotFoundError: damage) and an error that lasts (EACCES) are not retried."""
    for tries, wait_s in enumerate((*READ_WAITS_S, None), 1):
        try:
            return read(path)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                raise FileNotFoundError(e.errno, e.strerror, path) from None
            if wait_s is None or e.errno in LASTING_ERRNOS:
                waited = f" (tried {tries} times over {sum(READ_WAITS_S[:tries - 1]):g} s)" if tries > 1 else ""
                raise CheckpointUnreadable(e.errno or errno.EIO, f"cannot read {path}: {e.strerror or e}{waited}") from None
            time.sleep(wait_s)


def file_size(path: str) -> int | None:
    """The size of the file `path`, None when there is none (os.path.isfile would say "none" for EIO too: damage)."""
    try:
        st = read_retrying(os.stat, path)
    except FileNotFoundError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def load_json(path: str):
    with open(path) as f:
        return json.load(f)


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def write_atomic(path: str, text: str):
    """Write beside, fsync, rename over: a reader sees the old file or the new one, never half of one."""
    tmp = path + ".tmp"
    try:
        with create_file(tmp) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):  # a full disk leaves no half-written .tmp behind
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path))


def fsync_dir(path: str):
    """A rename is durable only once its folder is on disk: else a power loss can bring back the old name."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def saved_tensors(unit) -> list:
    return [("master_shard", unit.master_shard)] + list(unit.optimizer_state.items())


# Each tensor's place in BackgroundSave's host buffer is a multiple of this: every view is aligned for any dtype.
STAGING_ALIGN_BYTES = 64


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
            file_size(os.path.join(root, kept["folder"], fname)) == expect["bytes"]
            for fname, expect in kept["files"].items()):
        return True
    frozen_set = None
    return False


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
            fsync_dir(written)
            os.replace(written, os.path.join(root, folder))
            fsync_dir(root)  # on disk before any manifest names it: never a checkpoint without its frozen set
        frozen_set = dict(root=os.path.realpath(root), world=world, units=names, folder=folder, files=files)
    return {"folder": frozen_set["folder"], "files": frozen_set["files"]}


def check_written(folder: str, files: dict):
    for fname, expect in files.items():
        if os.path.getsize(os.path.join(folder, fname)) != expect["bytes"]:
            raise OSError(errno.EIO, f"{fname} has the wrong size on disk")


def unit_records(units) -> dict:
    """The manifest's "units", taken with the snapshot (a background save commits after later steps)."""
    return {u.name: {"numel": u.numel, "shard_numel": u.shard_numel, "optimizer_state": list(u.optimizer_state),
                     "trained": u.trained, "optimizer_steps": u.optimizer_steps} for u in units}


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


def raise_unless_done(done: torch.Tensor, message: str, kept_in: str = ""):
    """Rank 0's [done, errno of what stopped it], broadcast: unless done, every rank raises `message` with that errno,
    so all exit with the same code (processes.exit_code). `kept_in`: checkpoints/, whose untouched `latest` to name."""
    dist.broadcast(done, src=0, group=group)
    if not done[0]:
        raise CheckpointError(message + (kept_note(kept_in) if kept_in else ""), os_errno=done[1].item() or None)


def prepare_save(cfg, step: int, rank: int, world: int, frozen_names: list) -> tuple[str, bool]:
    """Rank 0 checks the folder is still this run's, makes the temporary folder and decides whether the save writes
    a frozen set (frozen_set_kept): (the folder, that decision) on every rank; the broadcast is the barrier no rank
    writes before."""
    root, tmp, final = save_paths(cfg, step)
    ready = torch.zeros(3, dtype=torch.int64)  # raise_unless_done's two, and whether the save writes a frozen set
    error = f"checkpoint {final} was not saved: rank 0 could not prepare it (its error says why)"
    if rank == 0:
        try:
            check_out_dir_claim(cfg.out_dir, step)
            shutil.rmtree(tmp, ignore_errors=True)
            ready[2] = bool(frozen_names) and not frozen_set_kept(root, world, frozen_names)
            os.makedirs(os.path.join(tmp, FROZEN_TMP) if ready[2] else tmp)
            ready[0] = 1
        except CheckpointError as e:
            error = str(e)
        except OSError as e:
            error = f"checkpoint {final} was not saved: rank 0 could not create {write_error(tmp, e)}{kept_note(root)}"
            ready[1] = e.errno or errno.EIO
    raise_unless_done(ready, error)
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
            sha256, nbytes = write_safetensors_streaming(path, file_tensors)
            report[at], report[at + 1:at + 33] = nbytes, torch.tensor(list(bytes.fromhex(sha256)))
        report[0] = 1
        if flags.fault_hook:
            flags.fault_hook("save", step, rank)
    except Exception as e:  # an OSError by its errno; anything else as EIO (not shown to repeat: exit code 1)
        report.zero_()
        report[34] = getattr(e, "errno", None) or errno.EIO
        cause = write_error(path, e) if isinstance(e, OSError) else f"{path}: {type(e).__name__}: {e}"
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
    all_gather_flat(reports.view(-1), report, group=group)
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
            write_atomic(os.path.join(tmp, "manifest.json"), json.dumps(manifest, indent=1))
            shutil.rmtree(final, ignore_errors=True)  # a re-save of a step (after a fallback)
            os.replace(tmp, final)
            try:
                fsync_dir(root)
                write_atomic(os.path.join(root, "latest"), os.path.basename(final) + "\n")
            except OSError:
                if latest_name(root) != os.path.basename(final):  # complete, but `latest` does not name it: not saved
                    with contextlib.suppress(OSError):
                        os.replace(final, tmp)  # removed below with the rest of a failed save
                raise
            saved[0] = 1
        except OSError as e:
            my_error = f"rank 0 could not commit it: {write_error(tmp, e)}"
            saved[1] = e.errno or errno.EIO
    if rank == 0 and saved[0]:
        remove_old_checkpoints(root, cfg.keep_ckpts, final)
    elif rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    raise_unless_done(saved, f"checkpoint {final} was not saved: {my_error or 'rank 0 could not commit it'}", root)
    return final


class BackgroundSave:
    """--async_save: a checkpoint that stalls training only for a copy into `staging`, one host buffer (page-locked
    on CUDA), from which a thread writes the file while training goes on. The commit (commit_save) is collective:
    the training thread runs it at the first step boundary where train.py's per-step all-reduce says every rank's
    write is done. One save in flight at most; until its commit it is a .tmp-step_* folder, which nothing loads."""

    def __init__(self, units: list, device: torch.device):
        # Zeroed (no page faults in the first copy) and page-locked in a thread while the first steps train: tens of
        # GB at ~1 GB/s is a minute off the path to step 1. plan.staging_bytes_per_rank counts these bytes.
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
            offsets = [0]
            for n in nbytes:
                offsets.append(offsets[-1] + -(-n // STAGING_ALIGN_BYTES) * STAGING_ALIGN_BYTES)
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
        dist.all_reduce(failed, group=group)
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


def resume_candidates(root: str) -> list[str]:
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
        candidates = resume_candidates(os.path.join(cfg.out_dir, "checkpoints"))
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
    if not cfg.export_hf or export_made(cfg.export_hf):
        if rank0:
            print(message, flush=True)
        return None
    # A stop request in the last step saved it and skipped the export (train.main's loop): this command, run
    # again, makes it, as `--from_ckpt CHECKPOINT --export_hf DIR` does: the weights only, at any world size.
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


def export_made(folder: str) -> bool:
    """Whether an --export_hf folder is there (export_hf renames FOLDER.partial once complete; an empty one is not)."""
    return os.path.isdir(folder) and bool(os.listdir(folder))


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
                named.add((load_json(os.path.join(path, "manifest.json")).get("frozen") or {}).get("folder"))
        return [os.path.join(root, n) for n in sorted(os.listdir(root)) if n.startswith("frozen-") and n not in named]
    except (OSError, ValueError, AttributeError):
        return []


# A mismatch is the operator's to resolve; nothing here suggests a command that deletes checkpoints.
WAY_FORWARD = ("Restore those flags to continue this run, or start a new phase from this checkpoint's weights "
               "(step 1, a fresh optimizer and data position) in another folder: --init_from {path} --out_dir NEW_DIR")


def check_manifest(path: str, cfg, mcfg, windows) -> dict:
    manifest_path = os.path.join(path, "manifest.json")
    if file_size(manifest_path) is None:
        raise CheckpointError(f"checkpoint {path}: no manifest.json (an unfinished save)")
    try:
        manifest = read_retrying(load_json, manifest_path)
    except (FileNotFoundError, ValueError) as e:  # not JSON: damaged (a read error raises CheckpointUnreadable)
        raise CheckpointError(f"checkpoint {path}: manifest.json is unreadable ({e})") from None
    if manifest.get("format") != CKPT_FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {manifest.get('format')!r}, expected {CKPT_FORMAT!r}")
    if cfg is not None:
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


def same_value(key: str, saved, current, saved_meaning=None) -> bool:
    """Whether a flag saved as `saved` and now `current` mean the same; a path flag by what it names. `saved_meaning`:
    what the saving run resolved (None before "resolved": relative paths are read from this run's folder)."""
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


def config_changes(manifest: dict, cfg, mcfg) -> tuple[list[str], list[str]]:
    """What differs between the manifest and this run's flags and model: (what a resume must keep, each "--flag was
    A, now B (why)"; what may change, each "--flag A -> B"). A field the manifest lacks counts as its default."""
    saved = {f.name: f.default for f in fields(cfg)} | (manifest.get("train") or {})
    resolved = manifest.get("resolved") or {}
    must, may = [], []
    for key, why in RESUME_MUST_MATCH.items():
        if not same_value(key, saved[key], getattr(cfg, key), resolved.get(key)):
            must.append(f"--{key} was {saved[key]!r}, now {getattr(cfg, key)!r} ({why})")
    known = {f.name for f in fields(M.ModelConfig)}  # a model saved before a field existed has its default
    # family_keys, saved since 2026-12-07: before, the run read them from the same source as this one
    saved_model = {"family_keys": mcfg.family_keys} | (manifest.get("model") or {})
    saved_mcfg = asdict(M.ModelConfig(**{k: v for k, v in saved_model.items() if k in known}))
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
        if not whole(saved.get("optimizer_steps", 0), 0) or type(saved.get("trained", True)) is not bool:
            refuse(f"units.{name}", {k: saved.get(k) for k in ("optimizer_steps", "trained")},
                   "optimizer_steps a whole number >= 0 and trained true or false")
        if saved.get("shard_numel") != -(-numel // world) or type(saved["shard_numel"]) is not int:
            refuse(f"units.{name}.shard_numel", saved.get("shard_numel"),
                   f"{-(-numel // world)}: numel {numel} over world_size {world}, rounded up")
    rank_files = {rank_file(r, world) for r in range(world)}
    if not isinstance(files, dict) or set(files) != rank_files:
        refuse("files", sorted(files)[:2] if isinstance(files, dict) else files,
               f"the {world} files {rank_file(0, world)} to {rank_file(world - 1, world)}")
    frozen = manifest.get("frozen")  # the frozen set it names (--freeze), a folder beside it: never a path elsewhere
    if frozen is not None and not (isinstance(frozen, dict) and re.fullmatch(r"frozen-[0-9a-f]+", str(frozen.get("folder")))
                                   and isinstance(frozen.get("files"), dict) and set(frozen["files"]) == rank_files):
        refuse("frozen", frozen, f'{{"folder": "frozen-<hex digits>", "files": the {world} rank files}}')
    listed = [(f"files.{f}", e) for f, e in files.items()] + [(f"frozen.files.{f}", e) for f, e in
                                                              (frozen or {"files": {}})["files"].items()]
    for field, expect in listed:
        if not (isinstance(expect, dict) and whole(expect.get("bytes"), 0) and isinstance(expect.get("sha256"), str)):
            refuse(field, expect, '{"sha256": "...", "bytes": a whole number}')


def trained_when_saved(manifest: dict, name: str) -> bool:
    return manifest["units"][name].get("trained", True)  # a manifest saved before --freeze: every unit trained


def freeze_changes(manifest: dict, units: list) -> tuple[list[str], list[str]]:
    """--freeze changed on resume: (the units that start training; the units frozen now)."""
    started = [u.name for u in units if u.trained and not trained_when_saved(manifest, u.name)]
    stopped = [u.name for u in units if not u.trained and trained_when_saved(manifest, u.name)]
    return started, stopped


def unit_file(manifest: dict, name: str, fname: str) -> tuple[str, dict | None]:
    """Where unit `name`'s part of rank file `fname` is, relative to the checkpoint's folder (load_checkpoint), and
    the manifest's size and SHA-256 of it: in the frozen set the manifest names for a unit frozen when saved."""
    frozen = manifest.get("frozen")
    if frozen and not trained_when_saved(manifest, name):
        return os.path.join("..", frozen["folder"], fname), frozen["files"].get(fname)
    return fname, manifest["files"].get(fname)


def check_file_size(path: str, fname: str, expect: dict | None):
    size = file_size(os.path.join(path, fname))
    if expect is None or size is None:
        raise CheckpointError(f"checkpoint {path}: {fname} is missing")
    if size != expect["bytes"]:
        raise CheckpointError(f"checkpoint {path}: {fname} has {size} bytes, the manifest says {expect['bytes']} "
                              f"(truncated?)")


def load_checkpoint(path: str, manifest: dict, units: list, master_only: bool = False):
    """Fills this rank's shards from the checkpoint, whatever world size saved it: a unit's flat layout does not
    depend on W, so a new shard [a, b) is read from the old rank files that cover it, each checked against the
    manifest's size and SHA-256 first. `master_only`: the fp32 master shards alone (a new phase)."""
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
        # Per unit (a manifest saved before 2026-12-05 names one list for all units, at its top level, and no step
        # count: every unit took every step).
        saved_state = saved.get("optimizer_state", manifest.get("optimizer_state", ["exp_avg", "exp_avg_sq"]))
        if saved_state != list(unit.optimizer_state):
            raise CheckpointError(f"checkpoint {path}: unit {unit.name} was saved with optimizer state "
                                  f"{', '.join(saved_state) or 'none'}, this run's optimizer keeps "
                                  f"{', '.join(unit.optimizer_state) or 'none'} for it")
        with_state.add(unit.name)
        unit.optimizer_steps = saved.get("optimizer_steps", manifest["step"])
    verified = set()
    for unit in units:
        old_shard = manifest["units"][unit.name]["shard_numel"]
        lo, hi = unit.shard_start, min(unit.shard_start + unit.shard_numel, unit.numel)
        for old_rank in range(lo // old_shard, -(-hi // old_shard)) if lo < hi else []:
            fname, expect = unit_file(manifest, unit.name, rank_file(old_rank, old_world))
            fpath = os.path.join(path, fname)
            if fname not in verified:
                check_file_size(path, fname, expect)
                if read_retrying(sha256_file, fpath) != expect["sha256"]:
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
    all_gather_flat(by_rank.view(-1), torch.tensor([code, os_errno, manifest.get("step", -1), digest]), group=group)
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
# Phases: a new run from one of our checkpoints' weights (--init_from), or a checkpoint to export (--from_ckpt)
# ================================================================================================

def find_checkpoint(path: str) -> str | None:
    """The step_* folder `path` means: itself (it holds manifest.json), or for an --out_dir the one its `latest`
    names (else its newest complete one). None when it is neither."""
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    root = os.path.join(path, "checkpoints")
    candidates = resume_candidates(root)  # `latest` first; it names a complete checkpoint (saved before it)
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


def check_units(path: str, manifest: dict, numels: dict, flag: str):
    """The units of this model (`numels`: name -> parameters) against the checkpoint's, for a new phase (--init_from)
    or an export (--from_ckpt). Refused: a unit of another size; a unit the checkpoint holds that this model lacks
    (its trained weights would be dropped: the checkpoint of a fork run without it, or units named otherwise);
    for an export, a unit the checkpoint lacks. A new phase initialises those as a run from scratch (init_weights)."""
    saved = manifest["units"]
    for name, numel in numels.items():
        if name in saved and saved[name]["numel"] != numel:
            raise CheckpointError(f"checkpoint {path}: {unit_sizes(name, saved[name]['numel'], numel)}")
    dropped, lacking = [n for n in saved if n not in numels], [n for n in numels if n not in saved]
    if dropped:
        raise CheckpointError(f"checkpoint {path} holds unit(s) {unit_list(dropped)}, which this model does not have: "
                              f"their trained weights would be dropped; run the code (the fork) that saved them")
    if lacking and flag == "--from_ckpt":
        raise CheckpointError(f"checkpoint {path} lacks unit(s) {unit_list(lacking)} of this model: an export would "
                              f"hold weights never trained; export it with the code (the fork) that saved it")


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
        check_units(path, manifest, numels, flag)
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{flag}: checkpoint {path}: manifest.json lacks {e}") from None
    except CheckpointError as e:
        raise CheckpointError(f"{flag}: {e}") from None


def init_unit_random(unit, index: int, seed: int, std: float):
    """HF's init (normal(0, std) matrices, ones for norms) on the unit's full shape from the unit's own
    generator, then keep this rank's shard: the same weights for every W."""
    device = unit.gathered.device  # the same numbers with and without --offload_optimizer
    gen = torch.Generator(device=device).manual_seed(seed * 100003 + index)
    full = torch.zeros(unit.padded_numel, dtype=torch.float32, device=device)
    for slot in unit.slots:
        piece = full[slot.offset:slot.offset + math.prod(slot.shape)]
        piece.fill_(1.0) if len(slot.shape) == 1 else piece.normal_(0.0, std, generator=gen)
    unit.master_shard.copy_(full[unit.shard_start:unit.shard_start + unit.shard_numel])


def init_weights(cfg, mcfg: M.ModelConfig, units: list, weights: dict | str | None) -> str | None:
    """Seeded random weights (`weights` None); this rank's shards of an --init_from Hugging Face folder (`weights`
    {HF tensor name: file}); or of one of our checkpoints (`weights` its folder: a new phase, a fresh optimizer),
    where the units it lacks (a fork's adapter) are initialised as a run from scratch initialises them: returns
    which units were taken and which are new, for the phase's line."""
    global frozen_set
    frozen_set = None  # the first save writes the frozen units' set
    if weights is None:
        for i, unit in enumerate(units):
            init_unit_random(unit, i, cfg.seed, mcfg.init_std)
    elif isinstance(weights, str):
        saved = load_weights(weights, units, "--init_from")["units"]  # the manifest every rank read: agreed
        new = [(i, unit) for i, unit in enumerate(units) if unit.name not in saved]
        for i, unit in new:
            init_unit_random(unit, i, cfg.seed, mcfg.init_std)
        return (f"taken: {unit_list([u.name for u in units if u.name in saved])}; new, initialised as a run from "
                f"scratch (--seed {cfg.seed}): {unit_list([u.name for _, u in new]) or 'none'}")
    else:
        open_files = {}
        for unit in units:
            load_unit_from_hf(unit, weights, open_files)


def load_weights(path: str, units: list, flag: str) -> dict:
    """The fp32 master shards of the checkpoint `path`, re-sharded for this world size, no optimizer state
    (--init_from: a new phase; --from_ckpt), agreed by every rank (read_agreed), of the units it holds (check_units
    decided before any work which units it may lack). Returns its manifest."""
    try:
        manifest, error, failed = read_agreed(path, None, None, None, units, master_only=True)
    except CheckpointUnreadable as e:
        raise CheckpointUnreadable(e.errno, f"{flag}: {e.strerror}") from None
    if failed:
        raise CheckpointError(f"{flag}: " + (error or f"checkpoint {path}: rank(s) {', '.join(map(str, failed))} "
                                                      f"cannot use it"))
    return manifest


# The model a run builds, from the files its flags name (components/checks.py and the planner both ask).

def checkpoint_source(cfg) -> str | None:
    """The checkpoint folder --from_ckpt means, or --init_from when not a Hugging Face folder (find_checkpoint)."""
    flag, path = ("--from_ckpt", cfg.from_ckpt) if cfg.from_ckpt else ("--init_from", cfg.init_from)
    if not path or (flag == "--init_from" and os.path.isfile(os.path.join(path, "config.json"))):
        return None
    if not os.path.isdir(path):
        raise CheckpointError(f"{flag}: {path} is not a folder")
    try:
        found = find_checkpoint(path)
    except CheckpointError as e:
        raise CheckpointError(f"{flag}: {e}") from None
    if found is None:
        neither = "a Hugging Face folder (no config.json) nor " if flag == "--init_from" else ""
        raise CheckpointError(f"{flag}: {path} is neither {neither}one of our checkpoints (no manifest.json, and no "
                              f"checkpoints/step_* folder in it)")
    return found


# What a preset takes from the prepared data's tokenizer (run_data.open_data), so a checkpoint of a preset differs
# from the preset there; any other difference means another model.
DATA_DECIDES = ("vocab_size", "bos_id", "eos_id")


def model_config(cfg) -> M.ModelConfig:
    """The model: a checkpoint's manifest's (a --model beside --init_from must be the same), an --init_from folder's
    config.json, or a preset."""
    checkpoint = checkpoint_source(cfg)
    if checkpoint:
        flag = "--from_ckpt" if cfg.from_ckpt else "--init_from"
        try:
            mcfg = M.ModelConfig(**load_json(os.path.join(checkpoint, "manifest.json"))["model"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{flag}: checkpoint {checkpoint}: manifest.json has no readable model ({e})") from None
        if cfg.model and not cfg.from_ckpt:
            preset, saved = asdict(M.PRESETS[cfg.model]()), asdict(mcfg)
            diff = [f"{k} {preset[k]} vs {v}" for k, v in saved.items() if k not in DATA_DECIDES and preset[k] != v]
            if diff:
                raise CheckpointError(f"--model: {cfg.model} is not the model of --init_from {checkpoint}, which "
                                      f"decides the model (its manifest.json): they differ in {', '.join(diff)}; "
                                      f"leave out --model")
        return mcfg
    if cfg.init_from:
        return config_from_hf(load_json(os.path.join(cfg.init_from, "config.json")))
    return M.PRESETS[cfg.model or "tiny"]()


# ================================================================================================
# Hugging Face folders: import by partial reads, export one unit at a time
# ================================================================================================

# config.json, both forms seen in the wild: the published Llama 3.x one (`rope_theta` + `rope_scaling`) and
# transformers 5's (`rope_parameters`). Written in the published form, which every transformers version reads.

def hf_rope(hf: dict) -> tuple[dict, str]:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return rope, rope.get("rope_type", rope.get("type", "default"))


def check_hf_config(hf: dict) -> list[str]:
    """What in a config.json says it is not a model this code builds (model.FAMILIES), one line each: Qwen2, Gemma
    and Mistral name their tensors as Llama does, and would load, and train as another model, without a word."""
    model_type, architectures = hf.get("model_type"), hf.get("architectures") or []
    family = M.FAMILIES.get(model_type)
    if family is None or architectures not in ([], [family["hf_class"]]):
        known = ", ".join(f"model_type {t!r} with {f['hf_class']}" for t, f in M.FAMILIES.items())
        return [f"model_type {model_type!r} (architectures {', '.join(architectures) or 'not given'}) is not a "
                f"family this code builds; known: {known}"]
    problems = []  # a config.json of a known family with options this code does not implement
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    for bias in ("attention_bias", "mlp_bias"):
        if hf.get(bias, False):
            problems.append(f"{bias} true is not supported (this model has no biases)")
    if hf.get("attention_dropout", 0.0):
        problems.append(f"attention_dropout {hf['attention_dropout']} is not supported (only 0.0)")
    if hf.get("use_sliding_window", False):
        problems.append("use_sliding_window true is not supported (only full attention)")
    rope_type = hf_rope(hf)[1]
    if rope_type not in family["rope_types"]:
        problems.append(f"rope type {rope_type!r} is not supported for {model_type} (only {' and '.join(family['rope_types'])})")
    return problems


def config_from_hf(hf: dict) -> M.ModelConfig:
    """Either form of config.json; anything but a family of model.FAMILIES, as it is published, is refused
    (check_hf_config), never approximated."""
    problems = check_hf_config(hf)
    if problems:
        raise ValueError("config.json: " + "; ".join(problems))
    rope, rope_type = hf_rope(hf)
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = None
    if rope_type == "llama3":
        scaling = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                         "original_max_position_embeddings")}
    eos = hf.get("eos_token_id", 2)
    family = M.FAMILIES[hf["model_type"]]
    return M.ModelConfig(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or 0, ffn_dim=hf["intermediate_size"], norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta), rope_scaling=scaling, max_seq_len=hf.get("max_position_embeddings", 8192),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), bos_id=hf.get("bos_token_id", 1),
        eos_id=eos[0] if isinstance(eos, list) else eos, pad_id=hf.get("pad_token_id"),
        init_std=hf.get("initializer_range", 0.02), family=hf["model_type"], **family["model_fields"],
        family_keys={key: hf[key] for key in family["config_keys"] if key in hf})


# A source config.json's keys for what config_to_hf writes in another spelling (transformers 5 writes
# `rope_parameters` and `dtype`): dropped, so the two spellings cannot disagree.
HF_RESPELLED = ("rope_parameters", "rope_scaling", "rope_theta", "dtype", "torch_dtype")


def config_to_hf(cfg: M.ModelConfig, dtype: torch.dtype, source: dict | None = None, eos_ids: list | None = None) -> dict:
    """The published form of cfg's family. `source`: the --init_from config.json, whose other fields are kept, and
    its end-id list when it starts with cfg.eos_id (Llama 3.1 Instruct's three; training needs only the first).
    `eos_ids`: the tokenizer's end ids, for a model without a source."""
    family = M.FAMILIES[cfg.family]
    ours = {
        "architectures": [family["hf_class"]], "model_type": cfg.family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling, rope_type="llama3") if cfg.rope_scaling else None,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "initializer_range": cfg.init_std, "use_cache": True, "torch_dtype": str(dtype).removeprefix("torch."),
        **cfg.family_keys,
    }
    if cfg.pad_id is not None:
        ours["pad_token_id"] = cfg.pad_id
    if eos_ids and eos_ids[0] == cfg.eos_id:
        ours["eos_token_id"] = list(eos_ids) if len(eos_ids) > 1 else cfg.eos_id
    source = source or {}
    source_eos = source.get("eos_token_id")
    if isinstance(source_eos, list) and source_eos and source_eos[0] == cfg.eos_id:
        ours["eos_token_id"] = source_eos
    return dict({k: v for k, v in source.items() if k not in HF_RESPELLED}, **ours)


def hf_file_of_tensors(folder: str) -> dict:
    """{HF tensor name: safetensors file}, from the files' own headers (the index only says which files there are):
    a file lacking what the index promises shows as a missing tensor, a damaged one is found before any training."""
    from safetensors import SafetensorError, safe_open
    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(index):
        try:
            tensor_files = list(load_json(index)["weight_map"].items())  # (tensor name, file name)
        except (ValueError, KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"--init_from: {index} is not a safetensors index ({e!r}); download it again") from None
        for name, fname in tensor_files:  # a file of this folder (links are fine: the Hub's cache is made of them)
            if not D.is_plain_name(fname):
                raise ValueError(f"--init_from: {index} names {fname!r} as the file of {name}, which is not a file "
                                 f"name in {folder} (a '/' or '..'); download the model again")
        paths = sorted({os.path.join(folder, fname) for _, fname in tensor_files})
    elif os.path.isfile(single):
        paths = [single]
    else:
        raise FileNotFoundError(f"--init_from: neither model.safetensors nor model.safetensors.index.json in {folder}")
    files = {}
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--init_from: {path} is named in {index} but does not exist")
        try:  # safe_open checks the header covers the file: a truncated download or an HTML page fails here
            with safe_open(path, framework="pt") as f:
                files.update({name: path for name in f.keys()})
        except SafetensorError as e:
            raise ValueError(f"--init_from: {path} is not a readable safetensors file ({e}); download it "
                             f"again") from None
    return files


def check_hf_tensors(files: dict, mcfg: M.ModelConfig, folder: str):
    """The files hold exactly the parameters of config.json's model: an extra tensor (a Qwen2 q_proj.bias, a rotary
    inv_freq, lm_head.weight beside tied embeddings) is refused, never dropped: the weights are another model's."""
    with torch.device("meta"):  # names only: allocates nothing
        expected = {M.hf_name(name) for name, _ in M.Llama(mcfg).named_parameters()}
    missing, unexpected = sorted(expected - files.keys()), sorted(files.keys() - expected)
    if missing:
        raise ValueError(f"--init_from: tensor {missing[0]}{more(missing)} is missing from the safetensors files "
                         f"in {folder}")
    if unexpected:
        hint = ""
        if "lm_head.weight" in unexpected and mcfg.tie_embeddings:
            hint = "; config.json has tie_word_embeddings true: set it false if lm_head.weight is the model's own"
        raise ValueError(f"--init_from: {files[unexpected[0]]} holds {unexpected[0]}{more(unexpected)}, which the "
                         f"{M.FAMILIES[mcfg.family]['hf_class']} described by config.json does not have: this is not "
                         f"a plain {mcfg.family} checkpoint{hint}")


def more(names: list) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def load_unit_from_hf(unit, files: dict, open_files: dict):
    """Reads only this rank's shard of each parameter: at most one extra row on each side, then cut away."""
    from safetensors import safe_open
    lo_shard, hi_shard = unit.shard_start, unit.shard_start + unit.shard_numel
    for slot in unit.slots:
        name, shape, offset = slot.name, slot.shape, slot.offset
        lo, hi = max(offset, lo_shard), min(offset + math.prod(shape), hi_shard)
        if lo >= hi:
            continue
        key = M.hf_name(name)  # in `files`: check_hf_tensors found every one there
        if files[key] not in open_files:
            open_files[files[key]] = safe_open(files[key], framework="pt")
        tensor_slice = open_files[files[key]].get_slice(key)
        if tuple(tensor_slice.get_shape()) != shape:
            raise ValueError(f"--init_from: {key} in {files[key]} has shape {tuple(tensor_slice.get_shape())}, "
                             f"config.json implies {shape}")
        a, b = lo - offset, hi - offset  # flat range within this parameter
        row = math.prod(shape[1:])       # elements per row (1 for a 1-D norm weight)
        r0, r1 = a // row, -(-b // row)
        rows = tensor_slice[r0:r1].reshape(-1)
        unit.master_shard[lo - lo_shard:hi - lo_shard] = rows[a - r0 * row:b - r0 * row].float()


def gather_full_unit(unit) -> torch.Tensor:
    """The whole unit in fp32 on every rank (transient: one unit)."""
    full = torch.empty(unit.padded_numel, dtype=torch.float32, device=unit.gathered.device)
    all_gather_flat(full, unit.master_shard.to(full.device))  # from host memory with --offload_optimizer
    return full


def check_export_tensors(config: dict, shapes: dict):
    """What transformers builds from `config` (on the meta device) saves exactly the tensors `shapes` names:
    from_pretrained drops a tensor it does not know with a warning, serving a fork's model as another."""
    import transformers
    family = M.FAMILIES[config["model_type"]]
    with torch.device("meta"):
        hf = getattr(transformers, family["hf_class"])(getattr(transformers, family["hf_config_class"]).from_dict(config))
    built = {name: tuple(t.shape) for name, t in hf_saved_tensors(hf).items()}
    extra, missing = sorted(shapes.keys() - built.keys()), sorted(built.keys() - shapes.keys())
    reshaped = sorted(n for n in shapes.keys() & built.keys() if tuple(shapes[n]) != built[n])
    where = f"the {family['hf_class']} that transformers builds from the exported config.json"
    if extra:
        raise ValueError(f"--export_hf: tensor {extra[0]}{more(extra)} of this model is not in {where}: from_pretrained "
                         f"would drop it and serve another model; a model with parameters its family lacks cannot be "
                         f"exported as one (config_to_hf describes what the export is; model.FAMILIES the families)")
    if missing:
        raise ValueError(f"--export_hf: {where} has {missing[0]}{more(missing)}, which this model lacks")
    if reshaped:
        raise ValueError(f"--export_hf: tensor {reshaped[0]}{more(reshaped)} has shape {tuple(shapes[reshaped[0]])} "
                         f"here and {built[reshaped[0]]} in {where}")


def hf_saved_tensors(hf) -> dict:
    """The tensors save_pretrained writes for the transformers model `hf` (on the meta device too), by their names
    on disk: tied embeddings once, and transformers 5's in-memory fusions undone (Mixtral's experts are one
    tensor in memory, a weight per expert on disk, as other readers of the folder expect)."""
    tensors = dict(hf.named_parameters())  # tied embeddings: listed once
    try:
        from transformers.core_model_loading import revert_weight_conversion  # transformers 5
    except ImportError:
        return tensors  # transformers 4 saves what it holds
    return revert_weight_conversion(hf, tensors)


def export_origin(train: dict, depth: int = 0) -> dict:
    """Where an export's other files come from, for the run whose TrainConfig is `train`: {"hf_folder": the Hugging
    Face folder its first weights came from or None, "tokenizer": run_tokenizer's}. A run from one of our
    checkpoints (a phase, --from_ckpt) has the origin of the run that saved it, through the manifests."""
    init = train.get("from_ckpt") or train.get("init_from") or ""
    if init and not os.path.isfile(os.path.join(init, "config.json")) and depth < 100:
        try:
            return export_origin(load_json(os.path.join(find_checkpoint(init), "manifest.json"))["train"], depth + 1)
        except (CheckpointError, OSError, ValueError, KeyError, TypeError):
            pass  # that run's folder is gone: what this run's own --data says
    hf_folder = init if init and os.path.isfile(os.path.join(init, "config.json")) else None
    return {"hf_folder": hf_folder, "tokenizer": run_tokenizer(train)}


def run_tokenizer(train: dict) -> dict | None:
    """The tokenizer that prepared a run's --data, as its meta.json records it ({path, kind, sha256}), or None."""
    folder = run_data.first_prepared_folder(train.get("data") or "", train.get("out_dir") or "")  # a mix: one tokenizer
    try:
        tokenizer = load_json(os.path.join(folder, "meta.json"))["tokenizer"]
        return {k: tokenizer[k] for k in ("path", "kind", "sha256")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def export_tokenizer(origin: dict, folder: str) -> tuple[list | None, str]:
    """The tokenizer's files into `folder`: an --init_from folder's copied, else --data's written
    (tokenizer_export.write_hf_tokenizer), else none and a warning. Returns (its end ids or None, what was written)."""
    source = origin.get("hf_folder")
    if source and any(os.path.isfile(os.path.join(source, n)) for n in ("tokenizer.json", "tokenizer.model")):
        copied = tokenizer_export.copy_hf_tokenizer_files(source, folder)
        return None, f"tokenizer files copied from {source}: {', '.join(copied)}"
    tokenizer = origin.get("tokenizer")
    why = "--data is a token .npy, which names no tokenizer"
    if tokenizer:
        try:
            end_ids = tokenizer_export.write_hf_tokenizer(tokenizer["path"], tokenizer["sha256"], folder)
            return end_ids, f"tokenizer from {tokenizer['path']}"
        except D.DataError as e:
            why = str(e)
    print(f"warning: --export_hf: no tokenizer files in the export ({why}); copy the tokenizer's files into it "
          f"before loading it with AutoTokenizer", file=sys.stderr, flush=True)
    return None, "no tokenizer"


def source_json(source: str | None, name: str):
    path = os.path.join(source or "", name)
    return load_json(path) if source and os.path.isfile(path) else None


def finish_export(folder: str, mcfg: M.ModelConfig, dtype: torch.dtype, origin: dict, shapes: dict) -> str:
    """Everything of an export but the weights: the tokenizer, config.json, generation_config.json (the --init_from
    folder's, sampling defaults included; else the BOS and end ids) and check_export_tensors. Returns the note."""
    end_ids, tokenizer_note = export_tokenizer(origin, folder)
    source = origin.get("hf_folder")
    config = config_to_hf(mcfg, dtype, source=source_json(source, "config.json"), eos_ids=end_ids)
    check_export_tensors(config, shapes)
    generation = source_json(source, "generation_config.json") or {"bos_token_id": config["bos_token_id"],
                                                                   "eos_token_id": config["eos_token_id"]}
    for name, content in (("config.json", config), ("generation_config.json", generation)):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(content, f, indent=2)
    return tokenizer_note


def export_hf(units: list, mcfg: M.ModelConfig, out: str, dtype: torch.dtype, shard_gb: float, rank: int,
              origin: dict) -> str:
    """A folder that from_pretrained and AutoTokenizer load as is: model*.safetensors (+ index), and finish_export's
    files. Written to OUT.partial and renamed: it appears complete or not at all. Rank 0 holds one file's tensors
    at a time. Returns (rank 0) the tokenizer note; a failure raises CheckpointError on every rank, leaving none."""
    shapes = {M.hf_name(slot.name): slot.shape for unit in units for slot in unit.slots}
    files, size, bytes_per = [[]], 0, torch.tensor([], dtype=dtype).element_size()
    for unit in units:  # files of at most shard_gb, planned first so each can be named "-0000i-of-0000n"
        if files[-1] and size + unit.numel * bytes_per > shard_gb * 1e9:
            files.append([])
            size = 0
        files[-1].append(unit)
        size += unit.numel * bytes_per
    tmp = out.rstrip("/") + ".partial"
    # [written, errno]: rank 0's first write error stops its writing, not its gathering, so no rank waits for it
    written, error = torch.tensor([1, 0]), ""
    if rank == 0:  # a fresh folder: a crashed export's model.safetensors must not sit beside a new index
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            written[:] = torch.tensor([0, e.errno or errno.EIO])
            error = f"--export_hf: cannot create {write_error(tmp, e)}"
    weight_map, total_bytes = {}, 0
    for i, file_units in enumerate(files):
        fname = "model.safetensors" if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        tensors = []
        for unit in file_units:
            full = gather_full_unit(unit)
            if rank == 0:
                for slot in unit.slots:
                    piece = full[slot.offset:slot.offset + math.prod(slot.shape)].view(slot.shape)
                    tensors.append((M.hf_name(slot.name), piece.to(dtype).cpu().clone()))
            del full
        if rank == 0 and written[0]:
            try:
                write_safetensors_streaming(os.path.join(tmp, fname), tensors, metadata={"format": "pt"})
                weight_map.update({name: fname for name, _ in tensors})
                total_bytes += sum(t.numel() * t.element_size() for _, t in tensors)
            except OSError as e:
                written[:] = torch.tensor([0, e.errno or errno.EIO])
                error = f"--export_hf: cannot write {write_error(os.path.join(tmp, fname), e)}"
                shutil.rmtree(tmp, ignore_errors=True)
        # Paced per file: the other ranks wait here, on the CPU (gloo, --ckpt_timeout_min), while rank 0 writes,
        # and queue the next file's all-gathers only then. Queued all at once, the last ones would wait on the
        # GPU for rank 0's whole ~140 GB (70B) and NCCL's watchdog would end them after --timeout_min.
        others = f"--export_hf: rank 0 could not write {fname} of {out} (its error says why)"
        raise_unless_done(written, error or others)
    done, note = torch.zeros(2, dtype=torch.int64), ""
    if rank == 0:
        try:
            if len(files) > 1:
                with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                    json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=2)
            note = finish_export(tmp, mcfg, dtype, origin, shapes)
            if os.path.isdir(out):
                os.rmdir(out)  # checked empty before training started
            os.replace(tmp, out)  # the folder appears complete or not at all
            fsync_dir(os.path.dirname(os.path.abspath(out)))
            done[0] = 1
        except (OSError, ValueError) as e:
            error = str(e) if isinstance(e, ValueError) else f"--export_hf: cannot write {write_error(tmp, e)}"
            done[1] = (e.errno or errno.EIO) if isinstance(e, OSError) else 0
            shutil.rmtree(tmp, ignore_errors=True)
    raise_unless_done(done, error or f"--export_hf: rank 0 could not write {out} (its error says why)")
    return note
