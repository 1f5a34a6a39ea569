"""train.py's processes: torch.distributed set-up (NCCL on GPUs, gloo on CPU, also W = 1 without torchrun), and how
a run fails: one line on every rank, with the exit code that says whether a restart would meet it again."""
import datetime
import os
import signal
import sys
import traceback

import torch
import torch.distributed as dist

import data as D
from components import disk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def use_deterministic_kernels():
    """--deterministic. On a GPU some kernels sum in an order that varies from run to run (atomic adds):
    flash-attn's backward (its dQ), cuBLAS with several workspaces, SDPA's fused backwards. torch's
    deterministic mode picks an order-fixed kernel where one exists and raises where none does (SDPA's
    fused backwards take their deterministic path only in this strict mode, not with warn_only);
    model.attention passes it on to flash-attn (deterministic=True). cuBLAS is deterministic only with a
    fixed workspace, read from CUBLAS_WORKSPACE_CONFIG when cuBLAS first runs: set before any matmul
    (PyTorch's "Reproducibility" notes). On CPU the kernels are deterministic already."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def init_processes(cfg):
    """Returns (rank, world, device). Under torchrun RANK/WORLD_SIZE are set; plain `python train.py`
    gets a one-process group, so the code below never special-cases W = 1."""
    if cfg.deterministic:  # before the first matmul on a GPU, where cuBLAS reads its workspace setting
        use_deterministic_kernels()
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if use_cuda else "gloo"
    # A rank that dies or hangs must not leave the others waiting forever: every collective times out
    # after --timeout_min, and torch's default NCCL error handling (3: tear down without cleanup) turns that
    # into an exit, not a stuck process. Forcing the older mode 1 would make that exit slower.
    timeout = datetime.timedelta(minutes=cfg.timeout_min)
    # device_id: NCCL connects here (eagerly), so a broken NCCL set-up fails at start, not at the first step.
    bound = {"device_id": device} if use_cuda else {}
    if not dist.is_initialized():  # else made by a caller that runs several trainings in one process (bench/)
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout, **bound)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **bound)
    return dist.get_rank(), dist.get_world_size(), device


def compute_dtype(flag: str, device: torch.device) -> torch.dtype:
    if flag == "auto":  # a CPU without native bf16 matmuls runs them ~16x slower than fp32 (measured)
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, flag)



def fail(message: str, exit_code: int = 2, together: bool = False):
    """One line, on every rank, and the exit code: never a traceback wall or a hang. Exit code 2 (the default:
    a line our own checks wrote, a bad flag) says a restart would meet the same error, so launch.sh, which gives
    us ZERO3_FATAL_FILE, stops torchrun from restarting when the line appears there. Exit code 1 (exit_code(e)
    of anything not shown to repeat) is left to torchrun's restarts and then to a requeue. `together`: every
    rank fails here (a decision they all took): none exits before all have said it, since torchrun stops the
    others at the first exit."""
    sys.stderr.write(f"error: {message}\n")  # one write: ranks sharing a terminal or pipe do not interleave lines
    sys.stderr.flush()
    sys.stdout.flush()
    if exit_code == 2 and os.environ.get("ZERO3_FATAL_FILE"):
        with open(os.environ["ZERO3_FATAL_FILE"], "a") as f:
            f.write(f"error: {message}\n")
    if together:
        dist.barrier()
    os._exit(exit_code)  # no interpreter teardown (see the end of train.py)


# Exit code 2 stops the run for good (launch.sh stops torchrun's restarts, launch.sbatch does not requeue): only
# for what a restart is shown to repeat. Everything else, an exception type nobody listed here included, exits 1:
# a restart may fix it (torchrun restarts the workers, then the allocation is requeued, a bounded number of times).
# That covers NCCL/gloo errors at set-up, CUDA out of memory because a previous attempt's process still holds
# the GPU, an ECC error, a lock a crashed node left (disk.OutDirHeld), a checkpoint read failing with EIO/ESTALE.
REPEATS_ON_RESTART = (
    ValueError, KeyError,  # a bad flag or value; a config.json or weight file this code does not load
    ImportError,           # a package a flag needs
    D.DataError,           # bad or missing data
    FileNotFoundError,     # a file a flag names is not there
    disk.CheckpointError,  # checkpoints all damaged, a resume under other flags, an out_dir not shared by all ranks
)                          # (but its subclass OutDirHeld, and its os_errno when it has one: below)


def exit_code(e: BaseException) -> int:
    """2 if `e` will happen again on a restart, else 1 (REPEATS_ON_RESTART). An OSError, or a CheckpointError
    caused by one, repeats when the disk is full, over quota, read-only or forbidden (disk.LASTING_ERRNOS)."""
    if isinstance(e, disk.OutDirHeld):
        return 1
    os_errno = e.os_errno if isinstance(e, disk.CheckpointError) else getattr(e, "errno", None)
    if os_errno and isinstance(e, (OSError, disk.CheckpointError)) and not isinstance(e, FileNotFoundError):
        return 2 if os_errno in disk.LASTING_ERRNOS else 1
    return 2 if isinstance(e, REPEATS_ON_RESTART) else 1


def error_line(e: BaseException, when: str) -> str:
    """fail()'s line for `e`: our own errors' messages as they are; anything else with its type (and, for an
    exception not from torch.distributed, which names its peer itself, the line of code that raised it), so
    that no traceback is needed to find it."""
    if isinstance(e, OSError) and e.filename and e.strerror:  # the system's words, and what usually fixes it
        line = disk.write_error(e.filename, e)
        return line if exit_code(e) == 2 else f"{type(e).__name__} {when}: {line}; a restart may succeed"
    if exit_code(e) == 2 or isinstance(e, (disk.CheckpointError, disk.CheckpointUnreadable)):
        return str(e).strip("'\"")
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), "").rstrip(".")
    place = ""
    if not isinstance(e, dist.DistError) and e.__traceback__ is not None:  # the innermost frame of ours
        frames = traceback.extract_tb(e.__traceback__)
        ours = [f for f in frames if os.path.dirname(os.path.abspath(f.filename)) == ROOT]  # train.py, model.py, data.py
        frame = (ours or frames)[-1]
        place = f" (at {os.path.basename(frame.filename)}:{frame.lineno})"
    return f"{type(e).__name__} {when}: {text}{place}; a restart may succeed"


def catch_stop_signals() -> list:
    """Preemption: SIGUSR1 (what launch.sh forwards), SIGTERM (SLURM, torchrun) or SIGINT (Ctrl-C) means
    "save and stop". Noted in the returned list; at the next step boundary all ranks agree through an
    all-reduce, save, and exit 0, so a signal seen by one rank stops every rank. The same request often
    arrives several times (the job's every process is signalled, and torchrun forwards it again): repeats
    are ignored, so nothing interrupts the save."""
    stop_signals = []

    def on_signal(sig, _frame):  # only a note: printing here could interrupt a print in progress
        stop_signals.append(sig)
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return stop_signals
