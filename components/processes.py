"""train.py's processes: torch.distributed set-up (NCCL on GPUs, gloo on CPU, also W = 1 without torchrun), and how
a run fails: one line on every rank, with the exit code that says whether a restart would meet it again."""
import contextlib
import datetime
import os
import signal
import sys
import threading
import traceback

import torch
import torch.distributed as dist

import data as D
from components import agree, flags
from components import out_dir as OD

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


def pick_device(cfg) -> torch.device:
    """This rank's device: CUDA's LOCAL_RANK-th GPU (made current), or the CPU."""
    if cfg.deterministic:  # before the first matmul on a GPU, where cuBLAS reads its workspace setting
        use_deterministic_kernels()
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    return device


def rendezvous(cfg):
    """(store, rank, world): the ranks met, no process group yet. Under torchrun, the TCPStore its variables name
    (MASTER_ADDR:MASTER_PORT, rank 0's); plain `python train.py` gets a one-process store, so the code below never
    special-cases W = 1. The store reaches every rank whatever NCCL's state: start-up's facts travel over it
    (agree.gather_over_store) before NCCL is touched, and the process group is then made on it (make_group).
    Each attempt meets in a store of its own: torchrun makes a new one for every rendezvous round (torch's
    distributed/rendezvous.py says so), so no key of an earlier attempt is there. Not a prefix by
    TORCHELASTIC_RESTART_COUNT: that is each node's own count, and a node whose workers were restarted only
    because another node's failed (its agent does not count those) would wait under another prefix than the
    failed node's, forever. A caller that made the group itself (bench/) gets no store: the facts use its group."""
    if dist.is_initialized():
        return None, dist.get_rank(), dist.get_world_size()
    timeout = datetime.timedelta(minutes=cfg.timeout_min)
    if "RANK" in os.environ:
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    else:
        store, rank, world = dist.HashStore(), 0, 1
    store.set_timeout(timeout)  # every get and wait on it: a rank that never comes is waited for this long
    return dist.PrefixStore("zero3", store), rank, world


def make_group(cfg, store, rank: int, world: int, device: torch.device, hosts: list[str]):
    """The process group, on the store the ranks met in: NCCL on GPUs, gloo on CPUs. Its first contact
    (init_process_group and one small all-reduce) runs under --first_contact_s (first_contact)."""
    if store is None:  # a caller's group (rendezvous)
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    # A rank that dies or hangs must not leave the others waiting forever: every collective times out
    # after --timeout_min, and torch's default NCCL error handling (3: tear down without cleanup) turns that
    # into an exit, not a stuck process. Forcing the older mode 1 would make that exit slower.
    timeout = datetime.timedelta(minutes=cfg.timeout_min)
    # device_id: NCCL connects here (eagerly), so a broken NCCL set-up fails at start, not at the first step.
    bound = {"device_id": device} if device.type == "cuda" else {}
    if flags.fault_hook:  # tests only: a rank that reaches the first contact late (tests/faults.py)
        flags.fault_hook("contact", 0, rank)
    with first_contact(cfg, store, rank, world, backend, hosts):
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **bound)
        one = torch.ones(1, device=device)
        dist.all_reduce(one)
        one.item()  # on a GPU the all-reduce is queued: this waits for it


@contextlib.contextmanager
def first_contact(cfg, store, rank: int, world: int, backend: str, hosts: list[str]):
    """The block runs under a deadline, --first_contact_s: NCCL's first contact hangs rather than fails when its
    set-up is wrong (a wrong interface, ACS on a PCIe switch, an HCA it cannot use), and would be waited for as
    long as any collective (--timeout_min), then restarted into the same hang. Past the deadline a watchdog
    thread prints one line on every rank that came, naming the ranks that never did, and exits 2. Each rank
    marks its arrival in the store first; the watchdog reads the store through a client of its own (the block
    may hold this one's in a blocking get) and waits, briefly, for every rank that came to have said its line
    (none exits before, since torchrun stops the others at the first exit)."""
    own = store.clone()
    store.set(f"contact/{rank}", "came")

    def timed_out():
        came = [r for r in range(world) if own.check([f"contact/{r}"])]
        absent = [r for r in range(world) if r not in came]
        say(first_contact_line(cfg, backend, rank, hosts, absent), 2)
        each_said(own, "contact_said", rank, came)  # every rank that came times out at about the same moment
        os._exit(2)
    watchdog = threading.Timer(cfg.first_contact_s, timed_out)
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()


def first_contact_line(cfg, backend: str, rank: int, hosts: list[str], absent: list[int]) -> str:
    """The watchdog's line: who never came, and what to check."""
    here = f"rank {rank} ({hosts[rank]})"
    who = (f"{agree.who(absent, hosts)} never reached it (hung or slow before it: its own output says where)"
           if absent else "every rank reached it, so the ranks could not connect")
    if backend == "nccl":
        check = ("check the interface NCCL chose (NCCL_DEBUG=INFO prints it: 'NET/Socket : Using ...', 'NET/IB : "
                 "Using ...') against NCCL_SOCKET_IFNAME, NCCL_IB_HCA (ibstat lists the HCAs), PCIe ACS and GPUDirect "
                 "RDMA (ACS on the PCIe switches stalls peer-to-peer: NCCL's troubleshooting page), a run with "
                 f"NCCL_DEBUG=INFO, and the flight recorder's dump in {os.path.join(cfg.out_dir, 'nccl_trace')}")
    else:
        check = "check GLOO_SOCKET_IFNAME (the interface between the nodes) and the firewall between them"
    return (f"{here}: the process group's first contact ({backend}: init_process_group and one all-reduce) did not "
            f"complete within --first_contact_s {cfg.first_contact_s:g}: {who}; {check}. A restart would hang the "
            f"same way")


def fail(message: str, exit_code: int = 2, together: bool = False):
    """One line, on every rank, and the exit code: never a traceback wall or a hang. Exit code 2 (the default:
    a line our own checks wrote, a bad flag) says a restart would meet the same error, so launch.sh, which gives
    us ZERO3_FATAL_FILE, stops torchrun from restarting when the line appears there. Exit code 1 (exit_code(e)
    of anything not shown to repeat) is left to torchrun's restarts and then to a requeue. `together`: every
    rank fails here (a decision they all took): none exits before all have said it, since torchrun stops the
    others at the first exit."""
    say(message, exit_code)
    if together:
        dist.barrier()
    os._exit(exit_code)  # no interpreter teardown (see the end of train.py)


def fail_before_group(message: str, store, rank: int, world: int, exit_code: int = 2):
    """fail(together=True) before the process group exists: the ranks meet in the store instead."""
    say(message, exit_code)
    each_said(store, "refused", rank, range(world))
    os._exit(exit_code)


def say(message: str, exit_code: int):
    """fail's line: on stderr, and in launch.sh's ZERO3_FATAL_FILE when a restart would repeat it."""
    sys.stderr.write(f"error: {message}\n")  # one write: ranks sharing a terminal or pipe do not interleave lines
    sys.stderr.flush()
    sys.stdout.flush()
    if exit_code == 2 and os.environ.get("ZERO3_FATAL_FILE"):
        with open(os.environ["ZERO3_FATAL_FILE"], "a") as f:
            f.write(f"error: {message}\n")


SAID_WAIT_S = 10.0  # how long a rank that said its line waits for the others that say theirs at the same moment


def each_said(store, name: str, rank: int, ranks):
    """Marks that this rank said its line and waits, at most SAID_WAIT_S, until each of `ranks` has: none exits
    first (torchrun stops the others at the first exit, maybe before they said theirs). A store gone (its host,
    rank 0, exited) ends the wait: the line is said either way."""
    try:
        store.set(f"{name}/{rank}", "said")
        store.wait([f"{name}/{r}" for r in ranks], datetime.timedelta(seconds=SAID_WAIT_S))
    except (RuntimeError, dist.DistError):
        pass


# The exit-code policy, one rule: 2 when a restart would meet the same problem (the command, the data, the
# configuration, a node's set-up: its limits, an address the others cannot reach, a GPU that is broken or that
# another job holds); 1 when it may pass. Exit code 2 stops the run for good (launch.sh stops torchrun's restarts,
# launch.sbatch does not requeue); 1 is left to torchrun's restarts, then to a requeue, a bounded number of times.
# - agree.decide's refusals: 2, all of them. A GPU short of free memory is first waited for (agree.gpu_memory: a
#   previous attempt's process still exiting frees it within seconds); still held after that, it is another
#   job's, or a process that cannot exit: 2, naming the host to leave out (sbatch --exclude=HOST).
# - the first contact not made within --first_contact_s (make_group): 2, a restart would hang the same way.
# - the checkpoint group's gloo unable to connect once every rank has met in the store (out_dir.GroupUnreachable):
#   2, an interface or a firewall. The store itself not reachable yet (DistNetworkError): 1, its node may still
#   be starting.
# - an exception: 2 for the types listed below, else 1 (exit_code), an exception type nobody listed included:
#   NCCL/gloo errors at set-up, CUDA out of memory at start-up, an ECC error, a checkpoint read failing with
#   EIO/ESTALE.
REPEATS_ON_RESTART = (
    ValueError, KeyError,  # a bad flag or value; a config.json or weight file this code does not load
    ImportError,           # a package a flag needs
    D.DataError,           # bad or missing data
    FileNotFoundError,     # a file a flag names is not there
    OD.CheckpointError,  # checkpoints all damaged, a resume under other flags, an out_dir not shared by all ranks
    OD.GroupUnreachable, # the checkpoint group's gloo cannot connect: an interface, a firewall
)                          # (but a CheckpointError's os_errno, when it has one: below)


def exit_code(e: BaseException) -> int:
    """2 if `e` will happen again on a restart, else 1 (REPEATS_ON_RESTART). An OSError, or a CheckpointError
    caused by one, repeats when the disk is full, over quota, read-only or forbidden (out_dir.LASTING_ERRNOS)."""
    os_errno = e.os_errno if isinstance(e, OD.CheckpointError) else getattr(e, "errno", None)
    if os_errno and isinstance(e, (OSError, OD.CheckpointError)) and not isinstance(e, FileNotFoundError):
        return 2 if os_errno in OD.LASTING_ERRNOS else 1
    return 2 if isinstance(e, REPEATS_ON_RESTART) else 1


def error_line(e: BaseException, when: str) -> str:
    """fail()'s line for `e`: our own errors' messages as they are; anything else with its type, the rank and host
    that met it, the cause NCCL or torch gave on a later line (nccl_cause), and (for an exception not from
    torch.distributed, which names its peer itself) the line of code that raised it, so that no traceback is
    needed to find it."""
    if isinstance(e, OSError) and e.filename and e.strerror:  # the system's words, and what usually fixes it
        line = OD.write_error(e.filename, e)
        return line if exit_code(e) == 2 else f"{type(e).__name__} {when}: {line}; a restart may succeed"
    if exit_code(e) == 2 or isinstance(e, (OD.CheckpointError, OD.CheckpointUnreadable)):
        return str(e).strip("'\"")
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = (lines[0] if lines else "").rstrip(".")
    cause = nccl_cause(lines[1:])
    if cause:
        text += f": {cause}"
    elif "NCCL" in text and "NCCL_DEBUG" not in text and not os.environ.get("NCCL_DEBUG"):
        text += "; run with NCCL_DEBUG=INFO for NCCL's own account of it"
    place = ""
    if not isinstance(e, dist.DistError) and e.__traceback__ is not None:  # the innermost frame of ours
        frames = traceback.extract_tb(e.__traceback__)
        ours = [f for f in frames if os.path.dirname(os.path.abspath(f.filename)) == ROOT]  # train.py, model.py, data.py
        frame = (ours or frames)[-1]
        place = f" (at {os.path.basename(frame.filename)}:{frame.lineno})"
    here = f"rank {os.environ.get('RANK', '0')} ({agree.host_name()})"
    return f"{type(e).__name__} {when} on {here}: {text}{place}; a restart may succeed"


def nccl_cause(later_lines: list[str]) -> str | None:
    """The cause NCCL gives below its first line, or None. NCCL's errors, as torch raises them, read:
        NCCL error in: .../ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO ...)
        ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error.
        Last error:
        Call to ibv_reg_mr failed with error Cannot allocate memory
    The line after `Last error:` is the cause (that error ends it, or its text on the same line); without one,
    the nccl*Error line names the class of error."""
    for i, line in enumerate(later_lines):
        if line.startswith("Last error:"):
            rest = line.removeprefix("Last error:").strip() or " ".join(later_lines[i + 1:i + 2])
            if rest:
                return rest.rstrip(".")
    return next((line.rstrip(".") for line in later_lines if line.startswith("nccl") and "Error" in line.split(":")[0]),
                None)


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
