"""The out_dir a run owns (one run per folder, its lock, --overwrite once, a finished export's folder), and what the
modules that write into it share: small file helpers (atomic and durable writes, reads tried again, safetensors
written as a stream), the errors they raise, and the gloo group their collectives run in (make_group). Below
checkpoints.py and hf.py, which import it; it imports nothing of theirs.

  out_dir/.lock                                      rank 0's flock for the whole run: one run per out_dir
  out_dir/.overwritten                               the run that --overwrite'd the folder (overwrite_once)
  out_dir/checkpoints/                               checkpoints.py's
"""
import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import stat
import sys
import time

import torch
import torch.distributed as dist

# ================================================================================================
# What checkpoints.py and hf.py share: the errors, the checkpoint group and its collectives
# ================================================================================================

# torch 2.13 renames the collective; accept both names. One definition: train.py's ZeRO-3 and the checkpoints'
# collectives (out_dir's claim, checkpoints, hf's export, metrics, agree) use this one.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_json(value, device) -> list:
    """`value` (anything JSON holds) from every rank, in rank order, through two all-gathers: the sizes, then
    the bytes (JSON, not pickle: nothing a peer sends is ever unpickled)."""
    world = dist.get_world_size()
    data = torch.tensor(list(json.dumps(value, sort_keys=True).encode()), dtype=torch.uint8, device=device)
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    all_gather_flat(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device))
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    everyone = torch.zeros(world * longest, dtype=torch.uint8, device=device)
    all_gather_flat(everyone, padded)
    rows = everyone.view(world, longest).cpu()
    return [json.loads(bytes(rows[r, :n].tolist())) for r, n in enumerate(sizes.tolist())]

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


class CheckpointUnreadable(OSError):
    """A checkpoint file that could not be read after READ_WAITS_S's retries (EIO, ESTALE: not a missing file).
    An OSError, not a CheckpointError: nothing takes it for damage, so resume never rolls back past it."""

    def __str__(self):
        return self.strerror


# A write error a restart meets again (processes.exit_code: exit 2): the disk is full of bytes or inodes, over quota,
# read-only, forbidden, or the file over its size limit (write_error's hints). Any other (EIO, ESTALE) may pass.
LASTING_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)


def raise_unless_done(done: torch.Tensor, message: str):
    """Rank 0's [done, errno of what stopped it], broadcast: unless done, every rank raises `message` with that errno,
    so all exit with the same code (processes.exit_code)."""
    dist.broadcast(done, src=0, group=group)
    if not done[0]:
        raise CheckpointError(message, os_errno=done[1].item() or None)


# ================================================================================================
# Small file helpers
# ================================================================================================

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


def write_text_atomic(path: str, text: str):
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


def keep_rows_up_to(path: str, step: int) -> list[str]:
    """A resumed run's metrics.jsonl or samples.jsonl keeps the rows of the steps it has already done (step <=
    `step`), and returns them: the steps after are done again. A line torn by a crash or a full disk (only ever the
    last one) is dropped, with a warning."""
    kept = []
    if step and os.path.isfile(path):
        with open(path) as f:
            for line in filter(str.strip, f):
                try:
                    if json.loads(line)["step"] <= step:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):
                    print(f"warning: {os.path.basename(path)}: dropping a torn line ({line.strip()[:60]!r})",
                          file=sys.stderr, flush=True)
    with create_file(path + ".tmp") as f:  # never through a link planted under the name
        f.writelines(kept)
    os.replace(path + ".tmp", path)
    return kept


def fsync_dir(path: str):
    """A rename is durable only once its folder is on disk: else a power loss can bring back the old name."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


# ================================================================================================
# The out_dir
# ================================================================================================

# One run per --out_dir, in a folder every rank sees. Rank 0 holds an exclusive flock on OUT_DIR/.lock for the
# whole run (the kernel drops it when the process dies, kill -9 included), and writes a random token into it that
# every rank must read back: a node-local --out_dir fails here, not at the first save. Where flock is node-local,
# a run on another node takes the lock too: rank 0 reads the token back before every save (check_out_dir_claim).
out_dir_lock = None   # rank 0's open .lock file: closing it would release the lock
out_dir_claim = None  # rank 0's (out_dir, token) while it holds the lock


def read_lock(path: str) -> tuple[str, str]:
    """(token, holder) written in a .lock file: holder is take_lock's "host H pid P since T"; ("", "")
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


def take_lock(path: str) -> tuple[int, str, int | None]:
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


def claim_out_dir(out_dir: str, rank: int, world: int, device):
    """Rank 0 takes OUT_DIR/.lock (take_lock) and every rank reads its token back: a folder held by another run, or
    not one folder for all ranks, stops the run here. A held lock is never taken over: its holder may be alive (a
    node cut off from the network), and the line names the fix for a stale one (a crashed node's lock, which NFS
    keeps until the client's lease ends and Lustre until the client is evicted)."""
    global out_dir_lock, out_dir_claim
    if out_dir_lock is not None:  # a caller running several trainings in one process (bench/): the last one ended
        out_dir_lock.close()
        out_dir_lock = out_dir_claim = None
    path = os.path.join(out_dir, ".lock")
    claim, error = torch.zeros(2, dtype=torch.int64, device=device), ""  # take_lock's token and errno (or 0)
    if rank == 0:
        token, error, os_errno = take_lock(path)
        claim[0], claim[1] = token, os_errno or 0
        out_dir_claim = (out_dir, token) if token > 0 else None
    dist.broadcast(claim, src=0)
    token = claim[0].item()
    if token == -1:
        raise CheckpointError(error or f"--out_dir: rank 0 could not lock {path} (its error says why)",
                              os_errno=claim[1].item() or None)
    token_seen, holder = read_lock(path)
    if token == 0:
        raise CheckpointError(f"--out_dir: {out_dir} is in use by another run ({holder}); wait for it to end or "
                              f"choose another --out_dir; if that run is gone (a crashed node's lock, which NFS or "
                              f"Lustre keeps a while), the lock is stale: delete {path}")
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
    write_text_atomic(os.path.join(out_dir, OVERWRITE_MARKER),
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


def export_made(folder: str) -> bool:
    """Whether an --export_hf folder is there (export_hf renames FOLDER.partial once complete; an empty one is not)."""
    return os.path.isdir(folder) and bool(os.listdir(folder))

