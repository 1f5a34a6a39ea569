"""Every rank runs the same job: what a rank reads from its own machine is agreed before any rank acts on it.

A two-node run is 16 processes on two machines that do not see the same world: the host memory free, a
shared filesystem that shows a new checkpoint to one node seconds after the other (NFS and Lustre cache what
they listed), the packages installed, the limits a job inherits. Code that acts on what its own rank sees
splits the job: a rank that saves in the background skips the all-gather that a synchronous rank waits in
(a hang at the first save, hours in); a rank that still reads the previous `latest` loads step 400 while
the others load 500, and the run trains on from both.

So each such fact is read on every rank (read_facts), gathered over the rendezvous store before NCCL exists
(gather_over_store), and decided from the whole list by the same function on every rank (decide): the same decision everywhere, or the same
refusal on every rank, one line per problem naming the ranks and hosts, before any weights are read. The
checkpoint to resume from is agreed the same way once the out_dir is claimed (resume_candidates).
docs/operations.md, "What every rank agrees on", lists the facts and the rule for each.
"""
import errno
import glob
import hashlib
import ipaddress
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion  # torch's own version comparison (packaging's rules)

import model as M
from components import checkpoints, checks, run_data
from components import out_dir as OD

GIB = 2**30
# NCCL registers its InfiniBand buffers with the HCA (ibv_reg_mr), which counts against the locked-memory limit;
# jobs often inherit 64 KiB (or systemd's 8 MiB) from slurmd, and NCCL's set-up then fails. NVIDIA's containers
# and NCCL's troubleshooting page ask for unlimited (docker --ulimit memlock=-1).
MEMLOCK_LEAST_BYTES = 1 * GIB
# NCCL's shared-memory transport and its proxy between a node's ranks live in /dev/shm: a container's default
# 64 MiB fails NCCL's set-up with 8 GPUs (NVIDIA: docker --shm-size=1g, or --ipc=host).
SHM_LEAST_BYTES = 1 * GIB
# How long a checkpoint that some ranks see and others do not yet (a quick restart on NFS or Lustre, whose
# attribute caches hold a listing for up to 60 s by default: nfs(5) acdirmax) is waited for, and how often
# every rank looks again. Past it, the newest checkpoint every rank sees is used, with one line saying so.
CHECKPOINT_WAIT_S = 90.0
CHECKPOINT_POLL_S = 3.0
# A GPU short of free memory at start-up is looked at again for this long before decide refuses it: a previous
# attempt's process (torchrun's restart, a requeue onto the same node) still exiting gives its memory back within
# seconds of its end; still held after a minute, it is another job's, or a process that cannot exit.
GPU_RELEASE_WAIT_S = 60.0
GPU_RELEASE_POLL_S = 2.0
# A rank whose weights took longer than this many times the other ranks' median, and at least LOAD_NOTE_LEAST_S longer,
# is named after the load (loads_waited): its node's disk or mount is worth a look before the next restart.
LOAD_NOTE_FACTOR = 2.0
LOAD_NOTE_LEAST_S = 5.0
# Environment variables every rank must hold alike: NCCL reads NCCL_* (and /etc/nccl.conf, NCCL_CONF_FILE's
# default) when a communicator is made, torch's process group TORCH_NCCL_*, the allocator its setting. One node
# with another NCCL_PROTO, NCCL_IB_HCA or NCCL_ALGO is a hang or a crash at the first collective (NVIDIA/nccl#1328).
NCCL_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_")
ALLOC_CONF_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
NCCL_CONF = "/etc/nccl.conf"
# What a content digest reads of a large file: SAMPLED_CHUNKS pieces of SAMPLED_CHUNK_BYTES at evenly spaced
# offsets, the first and the last included (1 MiB per file: 30 MiB for a 70B folder's 30 files, not 140 GB);
# a file up to SAMPLED_WHOLE_BYTES is read whole.
SAMPLED_CHUNKS = 16
SAMPLED_CHUNK_BYTES = 64 * 2**10
SAMPLED_WHOLE_BYTES = 4 * 2**20
# The capability that lets a process lock memory past ulimit -l (capabilities(7): CAP_IPC_LOCK, bit 14; the
# kernel's mlock and InfiniBand's ib_umem_get both skip the limit for it): root containers often have it.
CAP_IPC_LOCK_BIT = 14


# Flags that name files or folders: a node may reach the same ones by another path (its own mount point, a copy
# on local disk). What they hold is compared instead: the model (config.json), the data (windows per source),
# the out_dir (out_dir.claim_out_dir: rank 0's lock file, seen by every rank).
FILE_FLAGS = ("init_from", "data", "eval_data", "from_ckpt", "out_dir", "export_hf", "sample_prompts", "plan_json",
              "plot")


# -- one all-gather of what each rank read ---------------------------------------------------------------

def gather_over_store(store, name: str, value, rank: int, world: int, device) -> list:
    """`value` from every rank, in rank order, through the rendezvous store (processes.rendezvous): a key per rank,
    each rank waiting for all of them for the store's timeout (--timeout_min). No process group, so no NCCL: what
    the ranks read reaches every rank whatever NCCL's state. Without a store (a caller's group: bench/), over the
    group (gather_json). A rank that never sends is named; the line's exit code is 1 (it may come on a restart)."""
    if store is None:
        return OD.gather_json(value, device)
    store.set(f"{name}/{rank}", json.dumps(value, sort_keys=True))
    keys = [f"{name}/{r}" for r in range(world)]
    try:
        store.wait(keys)
    except (RuntimeError, dist.DistError) as e:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise RuntimeError(f"rank(s) {', '.join(map(str, missing))} of {world} did not reach start-up's agreement "
                           f"({name}) within --timeout_min ({type(e).__name__}): their own output says why") from None
    return [json.loads(store.get(key)) for key in keys]


def who(ranks: list[int], hosts: list[str]) -> str:
    """'rank 3 (node0)', 'ranks 8-15 (node1)', 'ranks 0-3, 9 (node0, node1)'."""
    spans, start = [], ranks[0]
    for previous, rank in zip(ranks, ranks[1:] + [None]):
        if rank != previous + 1:
            spans.append(f"{start}-{previous}" if previous > start else f"{start}")
            start = rank
    named = ", ".join(dict.fromkeys(hosts[r] for r in ranks))
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(spans)} ({named})"


def by_value(values: list) -> list[tuple]:
    """[(value, [ranks that hold it]), ...] in order of first appearance."""
    groups = {}
    for rank, value in enumerate(values):
        groups.setdefault(json.dumps(value, sort_keys=True), (value, []))[1].append(rank)
    return list(groups.values())


def differing(what: str, values: list, hosts: list[str], fix: str) -> list[str]:
    """One line when the ranks' values differ, naming each value and the ranks that hold it; none when all agree."""
    groups = by_value(values)
    if len(groups) < 2:
        return []
    return [f"{what} differs between ranks: " + "; ".join(f"{value} on {who(ranks, hosts)}" for value, ranks in groups)
            + f"; {fix}"]


def said_by(lines_by_rank: list[list[str]], hosts: list[str]) -> list[str]:
    """Each distinct line once: as it is when every rank said it, else after the ranks and hosts that did."""
    lines = list(dict.fromkeys(line for lines in lines_by_rank for line in lines))
    out = []
    for line in lines:
        ranks = [r for r, lines in enumerate(lines_by_rank) if line in lines]
        out.append(line if len(ranks) == len(hosts) else f"{who(ranks, hosts)}: {line}")
    return out


# -- what a rank reads from its own machine --------------------------------------------------------------

def host_name(env=os.environ) -> str:
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def network_namespace() -> str:
    """Which loopback this rank shares: its kernel (boot id) and network namespace. Ranks with the same one reach
    each other on 127.0.0.1, whatever their host names (SLURM's nodes on one machine); ranks with another need the
    network between them: gloo's address, InfiniBand's locked memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return host_name()


def gloo_address(hostname: str, env=os.environ) -> str | None:
    """The address gloo (the checkpoint group, out_dir.make_group) listens on, or None when GLOO_SOCKET_IFNAME
    chooses the interface. As ProcessGroupGloo's createDefaultDevice: the first address the hostname resolves to
    that a socket can bind, else the loopback address. Many images map the hostname to 127.0.1.1 in /etc/hosts."""
    if env.get("GLOO_SOCKET_IFNAME"):
        return None
    try:
        infos = socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
    except OSError:
        return "127.0.0.1"
    for family, _, _, _, address in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((address[0], 0))
            return address[0]
        except OSError:
            continue
    return "127.0.0.1"


def memlock_bytes() -> int:
    """The locked-memory limit (ulimit -l) in bytes; -1 for unlimited."""
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    return -1 if soft == resource.RLIM_INFINITY else soft


def shm_free_bytes(path: str = "/dev/shm") -> int | None:
    """What /dev/shm has free now. Free, not its size: NCCL's segments need free space, and a /dev/shm of 64 GiB
    that earlier jobs' leftover segments fill fails as a 64 MiB one does; the size only bounds what is free."""
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_frsize * stats.f_bavail


def can_lock_any_memory(status: str = "/proc/self/status") -> bool:
    """Whether this process holds CAP_IPC_LOCK in its effective set (CapEff, hex), which lifts ulimit -l."""
    try:
        with open(status) as f:
            line = next((line for line in f if line.startswith("CapEff:")), "CapEff: 0")
    except OSError:
        return False
    return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK_BIT & 1)


def nccl_settings(env=os.environ) -> dict:
    """Every NCCL_*, TORCH_NCCL_* and allocator variable this rank runs with, by name."""
    return {name: value for name, value in sorted(env.items())
            if name.startswith(NCCL_ENV_PREFIXES) or name in ALLOC_CONF_NAMES}


def file_sha256(path: str) -> str | None:
    """A file's SHA-256 (16 hex digits, out_dir.sha256_file's), or None when it is absent."""
    try:
        return OD.sha256_file(path)[:16]
    except OSError:
        return None


def files_under(path: str) -> list[str]:
    """A file, or every file in a folder (recursively), sorted."""
    if not os.path.isdir(path):
        return [path]
    return sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names)


def sampled_sha256(paths: list[str]) -> str | None:
    """What these files hold, without reading them whole: per file, its name (relative to its folder), size and
    SAMPLED_CHUNKS pieces at evenly spaced offsets (the whole file up to SAMPLED_WHOLE_BYTES). A copy cut short,
    another revision or another file under the same name differs; a flipped byte between the pieces does not.
    None when a file cannot be read (the run's own checks say which)."""
    digest = hashlib.sha256()
    try:
        for path in paths:
            size = os.path.getsize(path)
            digest.update(f"{os.path.basename(path)}\0{size}\0".encode())
            with open(path, "rb") as f:
                if size <= SAMPLED_WHOLE_BYTES:
                    digest.update(f.read())
                    continue
                for i in range(SAMPLED_CHUNKS):
                    f.seek(i * (size - SAMPLED_CHUNK_BYTES) // (SAMPLED_CHUNKS - 1))
                    digest.update(f.read(SAMPLED_CHUNK_BYTES))
    except OSError:
        return None
    return digest.hexdigest()[:16]


def safetensors_header(path: str) -> bytes:
    """A .safetensors file's header: its first 8 bytes give the JSON's length (little-endian), the JSON names
    every tensor with its dtype, shape and byte offsets (the safetensors format)."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return f.read(min(length, 100 * 2**20))


def weights_digests(folder: str) -> dict | None:
    """--init_from's weights as a Hugging Face folder holds them: its *.safetensors files' headers, whole (every
    tensor's name, dtype, shape and offsets), and a sampled digest of the files (sampled_sha256). None for a
    folder without safetensors (a checkpoint of ours: its config and manifests are compared when it is read)."""
    paths = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not paths:
        return None
    try:
        headers = hashlib.sha256(b"".join(os.path.basename(p).encode() + b"\0" + safetensors_header(p)
                                          for p in paths)).hexdigest()[:16]
    except OSError:
        headers = None
    return dict(headers=headers, sampled=sampled_sha256(paths))


def input_digests(cfg) -> dict:
    """What --eval_data, --sample_prompts and --init_from hold, as this rank reads them (FILE_FLAGS: their paths
    are not compared)."""
    eval_paths = [p for _, path, _ in run_data.sources(cfg, "--eval_data") for p in files_under(path)] \
        if cfg.eval_every and cfg.steps else []
    return dict(eval_data=sampled_sha256(eval_paths) if eval_paths else None,
                sample_prompts=file_sha256(cfg.sample_prompts) if cfg.sample_prompts else None,
                init_from=weights_digests(cfg.init_from) if cfg.init_from and os.path.isdir(cfg.init_from) else None)


def gpu_driver(version_file: str = "/proc/driver/nvidia/version") -> str | None:
    """The NVIDIA kernel driver's version ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  ..."), or
    None where no NVIDIA driver is loaded."""
    try:
        with open(version_file) as f:
            words = f.readline().split()
    except OSError:
        return None
    return next((w for w in words if w[:1].isdigit() and "." in w), None)


def flash_attn_version() -> str | None:
    """The flash-attn that attention runs on, or None (SDPA)."""
    if M.flash_attn_func is None:
        return None
    return str(getattr(sys.modules.get("flash_attn"), "__version__", "unknown version"))


# -- the planner's figures for this run: tools/plan.py, asked in a subprocess ----------------------------------

PLANNER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "plan.py")
PLANNER_TIMEOUT_S = 600  # its nearest fit (before_step_one) tries many configurations; the figures take seconds


def gpu_name(device) -> str | None:
    """This rank's GPU as CUDA names it (the planner knows GPUs by that name); None on a CPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def ask_planner(cfg, mcfg, world: int, local_world: int, device_name: str, outside_gib: float | None = None):
    """tools/plan.py's run_figures for this run, from a subprocess (the planner imports train.py; the trainer never
    imports it): a JSON request on its stdin, its answer on its stdout. A failure is one warning line and None: the
    run goes on without the planner's figures, as on a GPU the planner does not know."""
    request = dict(flags=asdict(cfg), model=asdict(mcfg), world=world, local_world=local_world,
                   device_name=device_name, outside_gib=outside_gib)
    try:
        proc = subprocess.run([sys.executable, PLANNER, "--run_figures"], input=json.dumps(request), text=True,
                              capture_output=True, timeout=PLANNER_TIMEOUT_S)
        if proc.returncode == 0:
            return json.loads(proc.stdout)
        why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    except (OSError, subprocess.SubprocessError, ValueError) as e:  # ValueError: JSON that does not parse
        why = f"{type(e).__name__}: {e}"
    print(f"warning: the planner's figures for this run are missing ({PLANNER} --run_figures: {why}); the run goes "
          f"on without them", file=sys.stderr, flush=True)
    return None


def planner_figures(store, cfg, mcfg, rank: int, world: int, device) -> dict | None:
    """The planner's figures for this run (ask_planner), asked by rank 0 alone and shared over the store the ranks
    met in, when rank 0's run reads one: on a GPU (the free-memory check, the lines beside the plan), or for a CPU's
    host-memory check that counts --offload_activations' block inputs (the rest: checks.host_bytes_per_rank). None
    otherwise, or when the planner could not say. Every rank takes part: none is left waiting on another."""
    name = gpu_name(device)
    needed = name is not None or (cfg.offload_activations and (cfg.offload_optimizer or cfg.async_save == "true"))
    mine = (ask_planner(cfg, mcfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", 1)), name or "")
            if rank == 0 and needed else None)
    return gather_over_store(store, "planner", mine, rank, world, device)[0]


def gpu_memory(device, planned_memory: dict | None) -> dict | None:
    """What this rank's GPU has free now (every process's use, the CUDA context and NCCL's buffers counted), and
    what the run will ask PyTorch's allocator for at its peak (`planned_memory`: the planner's figures for the run,
    its peak less its allowance for the context; None on a GPU it does not know)."""
    if device.type != "cuda":
        return None
    need = None if planned_memory is None else (planned_memory["peak_gib"] - planned_memory["context_gib"]) * GIB
    deadline_s = time.monotonic() + GPU_RELEASE_WAIT_S
    while True:
        try:
            free, total = torch.cuda.mem_get_info(device)
        except RuntimeError as e:  # a GPU in a bad state: said by decide on every rank, not raised on this one alone
            return dict(index=device.index, error=next(iter(str(e).splitlines()), type(e).__name__))
        reserved = torch.cuda.memory_reserved(device)
        if need is None or free + reserved >= need or time.monotonic() >= deadline_s:
            return dict(index=device.index, free=free, total=total, reserved=reserved, need=need)
        time.sleep(GPU_RELEASE_POLL_S)  # a previous attempt's process still exiting (processes.py's policy)


def code_sha256() -> str:
    """The trainer's own code (train.py, model.py, data.py, components/): a node whose checkout is another version
    would run another step."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(root, "*.py")) + glob.glob(os.path.join(root, "components", "*.py"))):
        with open(path, "rb") as f:
            digest.update(os.path.relpath(path, root).encode() + b"\0" + f.read())
    return digest.hexdigest()[:16]


def read_facts(cfg, mcfg, world: int, device, planned: dict | None, warnings: list[str], windows=None) -> dict:
    """Everything this rank reads from its own machine that changes what the ranks run, with the problems and
    warnings it finds alone (a broken flash-attn, the node's host memory): the rest is decide's, over all ranks.
    The flags, the model (config.json, the data's tokenizer) and the data (windows per source) are read from each
    node's own files too: a node that was given another command, or another copy of a file, would train another job.
    `planned`: the planner's figures for the run (planner_figures), or None."""
    limit = checks.host_memory_limit()
    host_bytes = checks.host_bytes_per_rank(cfg, mcfg, world, planned)
    async_fits, async_note = checks.async_save_on(cfg, host_bytes, world, limit)
    problems = checks.check_flash_attn(cfg) + checks.check_host_memory(cfg, host_bytes, world, limit)
    host = host_name()
    cuda = device.type == "cuda"
    return dict(host=host, netns=network_namespace(), code=code_sha256(), flags=asdict(cfg), model=asdict(mcfg),
                data=windows and [source.n_windows for source in windows.sources], inputs=input_digests(cfg),
                torch=torch.__version__, flash_attn=flash_attn_version(),
                nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                driver=gpu_driver() if cuda else None, gpu_model=torch.cuda.get_device_name(device) if cuda else None,
                env=nccl_settings(), nccl_conf=file_sha256(NCCL_CONF),
                gloo=gloo_address(host), memlock=memlock_bytes(), ipc_lock=can_lock_any_memory(),
                shm_free=shm_free_bytes(), gpu=gpu_memory(device, planned and planned["memory"]), async_save=async_fits,
                problems=problems, warnings=warnings + ([async_note] if async_note else []))


# -- decided the same on every rank, from every rank's facts -----------------------------------------------

def decide(facts: list[dict]) -> tuple[list[str], list[str], bool]:
    """(problems, warnings, --async_save) from every rank's facts: the same on every rank, since every rank has the
    same list. A problem stops the run before any weights are read (exit 2); a warning is printed once by rank 0."""
    hosts = [f["host"] for f in facts]
    other_job = differing("the trainer's code (train.py, model.py, data.py, components/)", [f["code"] for f in facts],
                          hosts, "the same checkout on every node")
    other_job += differing("--data (windows per source)", [f["data"] for f in facts], hosts, "the same files on every node")
    for name in (n for n in facts[0]["flags"] if n not in FILE_FLAGS):
        other_job += differing(f"--{name}", [f["flags"].get(name) for f in facts], hosts, "the same command on every node")
    for name in facts[0]["model"]:
        other_job += differing(f"the model's {name}", [f["model"].get(name) for f in facts], hosts,
                               "the same --init_from (config.json) and data (its tokenizer) on every node")
    for what, key in (("--eval_data (a sampled digest of its files)", "eval_data"),
                      ("--sample_prompts (its SHA-256)", "sample_prompts")):
        other_job += differing(what, [f["inputs"][key] for f in facts], hosts, "the same files on every node")
    weights = [f["inputs"]["init_from"] or {} for f in facts]
    other_job += differing("--init_from's safetensors headers (tensor names, dtypes, shapes, offsets)",
                           [w.get("headers") for w in weights], hosts, "the same model files on every node")
    other_job += differing(f"--init_from's weights (a digest of {SAMPLED_CHUNKS} pieces of each file)",
                           [w.get("sampled") for w in weights], hosts, "the same model files on every node (a copy "
                           "cut short or another revision?)")
    problems = said_by([f["problems"] for f in facts], hosts)
    if other_job:  # a node running another job: the rest of what it read is not comparable
        return other_job + problems, [], False
    for key, what in (("torch", "torch"), ("nccl", "NCCL"), ("flash_attn", "flash-attn")):
        problems += differing(what, [f[key] or "not installed" for f in facts], hosts, f"install the same {what} on every node")
    problems += differing("the GPU driver", [f["driver"] for f in facts], hosts, "the same NVIDIA driver on every node")
    problems += differing("the GPU model", [f["gpu_model"] for f in facts], hosts,
                          "one GPU model for the whole job (sbatch --constraint, or --exclude the other nodes)")
    for name in sorted({name for f in facts for name in f["env"]}):
        problems += differing(f"the environment variable {name}", [f["env"].get(name, "unset") for f in facts], hosts,
                              "export the same NCCL and allocator settings on every node")
    problems += differing(f"{NCCL_CONF} (its SHA-256)", [f["nccl_conf"] or "absent" for f in facts], hosts,
                          f"the same {NCCL_CONF} on every node, or none")
    cuda = all(f["nccl"] for f in facts)
    allowed = facts[0]["flags"]
    ranks_on = {host: hosts.count(host) for host in hosts}
    apart = len({f["netns"] for f in facts}) > 1  # some ranks reach others only over the network
    for rank, f in enumerate(facts):
        mine = [r for r, host in enumerate(hosts) if host == f["host"]]
        if rank != mine[0]:  # a node's facts once, from its first rank (its other ranks read the same machine)
            continue
        if apart and f["gloo"] and ipaddress.ip_address(f["gloo"].split("%")[0]).is_loopback:
            problems.append(f"{who(mine, hosts)}: the hostname {f['host']} resolves to {f['gloo']}, a loopback address: "
                            f"gloo (the checkpoint group: every save and resume) would listen there and no rank on "
                            f"another node could connect; set GLOO_SOCKET_IFNAME to the interface between the nodes "
                            f"(as NCCL_SOCKET_IFNAME, e.g. eth0), or map the hostname to its address in /etc/hosts")
        low_memlock = 0 <= f["memlock"] < MEMLOCK_LEAST_BYTES and not f["ipc_lock"]  # CAP_IPC_LOCK lifts the limit
        if cuda and apart and low_memlock and not allowed.get("allow_low_memlock"):
            problems.append(f"{who(mine, hosts)}: the locked-memory limit is {f['memlock'] / 2**20:g} MiB (ulimit -l) "
                            f"and the process lacks CAP_IPC_LOCK: NCCL cannot register its InfiniBand buffers; run with "
                            f"`ulimit -l unlimited` (SLURM: LimitMEMLOCK=infinity in slurmd's systemd unit, or "
                            f"PropagateResourceLimitsExcept=MEMLOCK in slurm.conf; containers: --ulimit memlock=-1), "
                            f"or --allow_low_memlock if the nodes talk without InfiniBand")
        small_shm = f["shm_free"] is not None and f["shm_free"] < SHM_LEAST_BYTES
        if cuda and ranks_on[f["host"]] > 1 and small_shm and not allowed.get("allow_small_shm"):
            problems.append(f"{who(mine, hosts)}: /dev/shm has {f['shm_free'] / 2**20:g} MiB free: NCCL's shared memory "
                            f"between the node's {ranks_on[f['host']]} ranks needs more (a container: --shm-size=1g or "
                            f"more, or --ipc=host; a full one: earlier jobs' leftover files, ls /dev/shm), or "
                            f"--allow_small_shm if NCCL_SHM_DISABLE=1 keeps NCCL out of it")
    for rank, f in enumerate(facts):
        gpu = f["gpu"]
        if gpu and "error" in gpu:
            problems.append(f"{who([rank], hosts)}: GPU {gpu['index']} cannot say its free memory ({gpu['error']}): "
                            f"nvidia-smi -q shows its state; leave the node out (sbatch --exclude={hosts[rank]})")
        elif gpu and gpu["need"] is not None and gpu["free"] + gpu["reserved"] < gpu["need"]:
            held = (gpu["total"] - gpu["free"] - gpu["reserved"]) / GIB
            problems.append(f"{who([rank], hosts)}: GPU {gpu['index']} has {gpu['free'] / GIB:.1f} GiB free of "
                            f"{gpu['total'] / GIB:.1f}, and the run needs {gpu['need'] / GIB:.1f} GiB for PyTorch at its "
                            f"peak (--plan's, less the context); {held:.1f} GiB are held outside this process's "
                            f"allocator, still after {GPU_RELEASE_WAIT_S:g} s: another job's process on the GPU "
                            f"(nvidia-smi names it), or one that cannot exit; leave the node out (sbatch "
                            f"--exclude={hosts[rank]})")
    warnings = said_by([f["warnings"] for f in facts], hosts)
    return problems, warnings, all(f["async_save"] for f in facts)


# -- the checkpoint to resume from ------------------------------------------------------------------------

def checkpoint_view(root: str) -> dict:
    """What this rank sees of checkpoints/: the name in `latest`, the step_* folders, those whose manifest reads; or
    the error listing them raised (every rank raises it, agreed_checkpoints: not this rank alone, while the others
    wait in the next collective)."""
    try:
        folders = [os.path.basename(p) for p in checkpoints.list_checkpoints(root)]
    except OSError as e:
        return dict(latest=None, folders=[], complete=[], error=[e.errno or 0, f"{e.filename or root}: {e.strerror or e}"])
    complete = [name for name in folders if checkpoints.is_complete(os.path.join(root, name))]
    return dict(latest=checkpoints.latest_name(root), folders=folders, complete=complete, error=None)


def settled(views: list[dict]) -> bool:
    """Every rank sees the same (a `latest` that names no folder, seen so by every rank, is the operator's edit:
    agreed_checkpoints refuses it at once)."""
    return all(v == views[0] for v in views)


def agreed_checkpoints(root: str, views: list[dict], hosts: list[str]) -> tuple[list[str], str | None]:
    """(the checkpoints to try, newest first; a line when the ranks' views differ): those every rank sees, up to
    the oldest `latest` any rank reads (editing `latest` rolls a run back; a rank that still reads the previous
    one holds the others there too). A `latest` no rank sees as a folder is an error, as with one rank."""
    failed = [(r, v["error"]) for r, v in enumerate(views) if v.get("error")]
    if failed:
        os_errno, line = failed[0][1]
        raise OD.CheckpointError(f"{who([r for r, _ in failed], hosts)} cannot list the checkpoints: {line}",
                                   os_errno=os_errno or None)
    named = [v["latest"] for v in views if v["latest"]]
    if named and not any(name in v["folders"] for name in named for v in views):
        raise OD.CheckpointError(f"{os.path.join(root, 'latest')} names {named[0]!r}, which is not a folder in {root}; "
                                   f"write the name of a step_* folder there, or delete it to use the newest")
    common = set(views[0]["folders"]).intersection(*(v["folders"] for v in views))
    names = sorted((n for n in common if not named or n <= min(named)), reverse=True)
    if settled(views):
        return [os.path.join(root, n) for n in names], None
    seen = "; ".join(f"{who(ranks, hosts)} see{'s' if len(ranks) == 1 else ''} latest {view['latest'] or '(none)'} and "
                     f"{', '.join(view['folders']) or 'no checkpoint'}" for view, ranks in by_value(views))
    newest = [v["complete"][0] for v in views if v["complete"]]
    if not names and newest:  # some rank sees a checkpoint that another never did: not a view to start afresh from
        raise OD.CheckpointError(f"the ranks do not see the same checkpoints after {CHECKPOINT_WAIT_S:g} s ({seen}), and "
                                   f"none is seen by every rank; a restart looks again", os_errno=errno.ESTALE)  # exit 1
    return ([os.path.join(root, n) for n in names],
            f"the ranks do not see the same checkpoints after {CHECKPOINT_WAIT_S:g} s ({seen}): resuming from the newest "
            f"one every rank sees, {names[0] if names else 'none (a fresh start)'}")


def resume_candidates(root: str, rank: int, hosts: list[str], device) -> list[str]:
    """The checkpoints checkpoints.resume tries, the same list on every rank: every rank's view gathered, and gathered
    again every CHECKPOINT_POLL_S while they differ, for at most CHECKPOINT_WAIT_S (counted in rounds, so every
    rank stops looking at the same round)."""
    views = OD.gather_json(checkpoint_view(root), device)
    for _ in range(int(CHECKPOINT_WAIT_S / CHECKPOINT_POLL_S)):
        if settled(views):
            break
        time.sleep(CHECKPOINT_POLL_S)
        views = OD.gather_json(checkpoint_view(root), device)
    paths, note = agreed_checkpoints(root, views, hosts)
    if note and rank == 0:
        print(f"warning: {note}", file=sys.stderr, flush=True)
    return paths


# -- after the weights are read --------------------------------------------------------------------------

def loads_waited(started_s: float, rank: int, hosts: list[str]) -> str | None:
    """Every rank waits here for the others' weights (--init_from, a resume), on the checkpoint group, whose
    timeout is --ckpt_timeout_min: a node that reads slowly (a cold network filesystem, a slow disk) is waited for,
    not cut off by the step's --timeout_min at the first collective after it. Each rank's load seconds (since
    `started_s`, time.perf_counter) are gathered in that wait; the line naming the slowest rank when it took more
    than LOAD_NOTE_FACTOR x the other ranks' median, or None."""
    seconds = torch.zeros(len(hosts), dtype=torch.float64)
    OD.all_gather_flat(seconds, torch.tensor([time.perf_counter() - started_s], dtype=torch.float64),
                         group=OD.group)
    seconds = seconds.tolist()
    slowest = max(range(len(seconds)), key=lambda r: seconds[r])
    others = seconds[:slowest] + seconds[slowest + 1:]  # beside the rest: at W = 2 the median holds the slowest
    median = statistics.median(others) if others else seconds[slowest]
    if seconds[slowest] < max(LOAD_NOTE_FACTOR * median, median + LOAD_NOTE_LEAST_S):
        return None
    return (f"{who([slowest], hosts)} read its weights in {seconds[slowest]:.1f} s, the other ranks' median "
            f"{median:.1f} s: the others waited for it (--ckpt_timeout_min); its node's disk or filesystem mount is "
            f"worth a look")


# -- before step 1: the plan's assumptions measured on the run's own GPUs and fabric ---------------------------

# The start-up all-gather below this fraction of the plan's bus bandwidth is a warning, and `--check` fails: NCCL
# on TCP sockets instead of InfiniBand, or without GPUDirect RDMA, runs 3-5x slower and says nothing itself.
FABRIC_LEAST_FRACTION = 0.5
FABRIC_TIMED_GATHERS = 3  # after one to warm up


def gather_bus_gbps(sharded) -> tuple[str, float]:
    """(the largest unit, the bus bandwidth of its all-gather, GB/s), the same on every rank: gathered as training
    gathers it, once to warm up, then three times; the median, and of the ranks' medians the slowest (a collective
    is as fast as its slowest rank). nccl-tests' convention: what each rank's link carries, bytes x (W - 1) / W."""
    unit = max(sharded.units, key=lambda u: u.padded_numel)
    seconds = []
    for _ in range(1 + FABRIC_TIMED_GATHERS):
        if sharded.device.type == "cuda":
            torch.cuda.synchronize(sharded.device)
        t0 = time.perf_counter()
        unit.wait_gather()
        if sharded.device.type == "cuda":
            torch.cuda.synchronize(sharded.device)
        seconds.append(time.perf_counter() - t0)
        unit.free()
    slowest = torch.tensor([statistics.median(seconds[1:])], dtype=torch.float64, device=sharded.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    nbytes = unit.padded_numel * unit.gathered.element_size()
    return unit.name, nbytes * (sharded.world - 1) / sharded.world / slowest.item() / 1e9


def fabric_warning(measured_gbps: float, planned_gbps: float | None, what: str) -> str | None:
    """The warning for a fabric under FABRIC_LEAST_FRACTION of the plan (`what`: the measurement, named)."""
    if planned_gbps is None or measured_gbps >= FABRIC_LEAST_FRACTION * planned_gbps:
        return None
    return (f"{what} ran at {measured_gbps:.1f} GB/s bus bandwidth, under {FABRIC_LEAST_FRACTION:.0%} of the plan's "
            f"{planned_gbps:.0f} (--nics_per_node x --nic_gbps, capped by NVLink): NCCL may be on TCP sockets instead of "
            f"InfiniBand, without GPUDirect RDMA, or on the wrong HCAs. Run with NCCL_DEBUG=INFO and look for NET/IB (not "
            f"NET/Socket) and GDRDMA in its channel lines; NCCL_IB_HCA names the compute NICs. The plan's step time, "
            f"--ckpt_every and signal lead assume the planned figure")


def outside_allocator_problems(outside: list[float], totals: list[float], need_bytes: float, hosts: list[str],
                               peak_phase: str) -> list[str]:
    """A line for each rank whose GPU cannot hold the planned peak of PyTorch's allocator (`need_bytes`, in
    `peak_phase`) beside what it holds outside the allocator, measured."""
    return [f"{who([r], hosts)}: the planned peak, {need_bytes / GIB:.2f} GiB in PyTorch's allocator ({peak_phase}), "
            f"beside the {outside[r] / GIB:.2f} GiB its GPU holds outside it (CUDA context, NCCL, other processes: "
            f"measured after set-up), needs {(need_bytes + outside[r]) / GIB:.2f} GiB of its {totals[r] / GIB:.2f}"
            for r in range(len(outside)) if need_bytes + outside[r] > totals[r]]


def gpu_now(device) -> dict | None:
    """This rank's GPU as CUDA names it, and what it holds outside PyTorch's allocator now (bytes); None on a CPU."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return dict(name=gpu_name(device), outside=total - free - torch.cuda.memory_reserved(device),
                total=total)


def nearest_fit_words(answer: dict | None, outside_gib: float) -> str:
    """The planner's nearest fit at the measured figure (`answer`: its run_figures; None: it could not answer)."""
    if answer is None or answer["nearest_fit"] is None:
        return ("; no configuration --plan tries fits at that figure" if answer else
                "; the planner could not name a configuration that fits at that figure (its warning says why)")
    return (f"; the nearest configuration that fits at --outside_gib {outside_gib:.2f}: {answer['nearest_fit']} "
            f"(--plan with it prints the rest)")


def before_step_one(cfg, sharded, hosts: list[str], planned: dict | None) -> list[str]:
    """Each GPU's health (read_health: a GPU that computes wrongly or reports uncorrectable errors is a problem
    naming its host; a slow one, skewed clocks, the allocator setting not in effect are warnings), then what --plan
    assumed, measured on the run's own GPUs and fabric after set-up (its collectives have made NCCL's buffers),
    printed by rank 0 beside the plan's figures: the bus bandwidth of a unit's all-gather (a
    warning under FABRIC_LEAST_FRACTION of the plan's), and what each GPU holds outside PyTorch's allocator (the
    largest of the ranks). Returns the problems, the same on every rank: a GPU that cannot hold the planned peak
    beside what it holds, with the nearest configuration that fits at the measured figure (the planner's, asked by
    rank 0). `planned`: the planner's memory figures for the run (planner_figures), or None."""
    device, world = sharded.device, sharded.world
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    unhealthy, health_warnings = decide_health(OD.gather_json(read_health(device), device), hosts)
    gpu = gpu_now(device)
    lines, problems = [f"warning: {warning}" for warning in health_warnings], []
    if world > 1:
        unit, gbps = gather_bus_gbps(sharded)
        what = f"the all-gather of {unit} over {world} ranks"
        lines.append(f"{what}: {gbps:.1f} GB/s bus bandwidth (measured at start-up)"
                     + (f", the plan's {planned['bus_gbps']:.0f}" if planned else ""))
        warning = fabric_warning(gbps, planned and planned["bus_gbps"], what)
        lines += [f"warning: {warning}"] if warning else []
    if gpu:
        everyone = torch.zeros(2 * world, dtype=torch.float64, device=device)
        OD.all_gather_flat(everyone, torch.tensor([gpu["outside"], gpu["total"]], dtype=torch.float64, device=device))
        outside, totals = everyone[0::2].tolist(), everyone[1::2].tolist()
        r = max(range(world), key=lambda i: outside[i])
        lines.append(f"GPU memory outside PyTorch's allocator after set-up (CUDA context, NCCL): largest "
                     f"{outside[r] / GIB:.2f} GiB ({who([r], hosts)})"
                     + (f"; the plan allows {planned['context_gib']:.2f} (--outside_gib)" if planned else ""))
        if planned:
            need = (planned["peak_gib"] - planned["context_gib"]) * GIB
            problems = outside_allocator_problems(outside, totals, need, hosts, planned["peak_phase"])
        if problems:
            answer = (ask_planner(cfg, sharded.model.cfg, world, local_world, gpu["name"], outside[r] / GIB)
                      if sharded.rank == 0 else None)
            problems[-1] += nearest_fit_words(OD.gather_json(answer, device)[0], outside[r] / GIB)  # rank 0's answer
    for line in lines if sharded.rank == 0 else []:
        print(line, file=sys.stderr if line.startswith("warning") else sys.stdout, flush=True)
    return unhealthy + problems


# -- before step 1: each GPU's health, the clocks, the allocator's setting --------------------------------------

# A GPU whose check matmul is this fraction slower than the ranks' median is named: every collective waits for
# it, so one throttled GPU (power or thermal capping, a degraded PCIe link) slows every rank's every step.
HEALTH_SLOWER_FRACTION = 0.2
# torchrun's rendezvous stamps each node's heartbeat with that node's clock and drops a node whose last heartbeat
# looks older than keep_alive_interval x keep_alive_max_attempt (5 s x 3 in torch 2.13's dynamic_rendezvous):
# clocks 10 s apart make a live node look dead at the next restart. Named from a few seconds on.
CLOCK_SKEW_MOST_S = 5.0
# Each rank's device check (tools/gpu_check.py, a tool: the trainer runs it, never imports it). Its time: python and
# torch starting beside the node's other ranks, CUDA's context, nvidia-smi (60 s at most), a few matmuls.
GPU_CHECK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "gpu_check.py")
GPU_CHECK_TIMEOUT_S = 180


def device_health(device) -> dict:
    """tools/gpu_check.py's facts of this rank's device (the check matmul, ECC and row remapping, the allocator setting,
    what is wrong with it: its device_facts), run with --json in a subprocess, as the planner's figures are (ask_planner).
    On a CPU none (no GPU to check; ZERO3_GPU_CHECK_ON_CPU=1, which the tests set, runs it there too). A failure is a
    warning, said once by rank 0 with the ranks it names (decide_health), and the run goes on without them."""
    if device.type != "cuda" and not os.environ.get("ZERO3_GPU_CHECK_ON_CPU"):
        return dict(warnings=[])
    try:
        proc = subprocess.run([sys.executable, GPU_CHECK, "--device", str(device), "--json"], text=True,
                              capture_output=True, timeout=GPU_CHECK_TIMEOUT_S)
        if proc.returncode == 0:
            return json.loads(proc.stdout)[0]
        why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:  # ValueError: JSON that does not parse
        why = f"{type(e).__name__}: {e}"
    return dict(warnings=[f"the device health check is missing ({GPU_CHECK}: {why}); the run goes on without it"])


def meet(device):
    """One all-reduce of one number, waited for: every rank leaves it after the last one arrived."""
    token = torch.zeros(1, device=device)
    dist.all_reduce(token)
    token.item()


def read_clock(device) -> dict:
    """This rank's wall clock, read at (nearly) the same moment on every rank: after one meeting that lines the
    ranks up, and right after a second, timed one. A rank leaves a meeting after the last rank arrived and at most
    the meeting's own duration later than any other, so the readings are simultaneous to within the second
    meeting's longest duration (meet_s, gathered): what a skew is measured to within."""
    meet(device)
    t0 = time.perf_counter()
    meet(device)
    meet_s = time.perf_counter() - t0
    return dict(clock_s=time.time(), meet_s=meet_s)


def read_health(device) -> dict:
    """What this rank says before step 1: its GPU's facts (device_health; none on a CPU), then its clock."""
    return dict(device_health(device), **read_clock(device))


def decide_health(health: list[dict], hosts: list[str]) -> tuple[list[str], list[str]]:
    """(problems, warnings) from every rank's read_health: a wrong result, uncorrectable ECC errors or a row remap
    pending or failed is a problem naming the rank, host and device (leave the node out: it fails every attempt);
    a matmul more than HEALTH_SLOWER_FRACTION slower than the median (of the ranks whose device was checked), a
    clock skew over CLOCK_SKEW_MOST_S beyond what the reading can tell, the allocator setting not in effect and a
    device check that failed are warnings."""
    problems, warnings = [], []
    exclude = lambda r: f"leave the node out (sbatch --exclude={hosts[r]})"  # noqa: E731
    checked = {r: h for r, h in enumerate(health) if "matmul_ms" in h}  # none on a CPU, nor where the check failed
    for r, h in checked.items():  # the tool's words for what is wrong with its device (gpu_check.device_problems)
        problems += [f"{who([r], hosts)}: {what}; {exclude(r)} and {then}" for what, then in h["problems"]]
    median_ms = statistics.median(h["matmul_ms"] for h in checked.values()) if checked else 0.0
    for r, h in checked.items():
        if h["matmul_ms"] > (1 + HEALTH_SLOWER_FRACTION) * median_ms:
            warnings.append(f"{who([r], hosts)}: {h['what']}'s check matmul took {h['matmul_ms']:.1f} ms, "
                            f"{h['matmul_ms'] / median_ms - 1:.0%} over the ranks' median {median_ms:.1f} ms: every "
                            f"collective waits for it, so every step runs at its pace; {exclude(r)}, or see its "
                            f"throttle reasons (nvidia-smi -q -d PERFORMANCE)")
    clocks = [h["clock_s"] for h in health]
    skew_s, within_s = max(clocks) - min(clocks), max(h["meet_s"] for h in health)
    if skew_s - within_s > CLOCK_SKEW_MOST_S:
        nodes = ", ".join(f"{host} {clocks[hosts.index(host)] - min(clocks):+.1f} s" for host in dict.fromkeys(hosts))
        warnings.append(f"the ranks' clocks differ by {skew_s:.1f} s (measured to within {within_s:.2f} s): {nodes} "
                        f"(each node's first rank, from the earliest clock); torchrun's rendezvous compares heartbeats "
                        f"stamped by each node's clock and drops a node whose last one looks 15 s old, so a restart "
                        f"can lose a live node; sync the clocks (chronyc tracking, timedatectl)")
    return problems, warnings + said_by([h["warnings"] for h in health], hosts)


# -- the settings launch.sh used to make, made by train.py itself ---------------------------------------------

# The first torch release that honours PYTORCH_ALLOC_CONF alone for CUDA's expandable segments (launch_settings).
ALLOC_CONF_ONE_NAME_FROM = (2, 11)


def launch_settings(out_dir: str, env=os.environ, torch_version: str = torch.__version__):
    """GPU memory and diagnosis settings, in train.py's own environment before CUDA or NCCL read them, so that the
    design card's plain `torchrun ... train.py` runs as launch.sh does. A value the user exported is kept.
    - NCCL_NVLS_ENABLE=0. NVLS (NVLink SHARP, on NVSwitch systems: H100/H200 HGX) binds multicast buffers outside
      PyTorch's allocator, 1 GiB or more per communicator (NCCL's log: "NVLS Bind mem ... size 1073741824"), beyond
      the planner's allowance; NVIDIA's own launchers turn it off (NeMo-Framework-Launcher#127, JAX-Toolbox#383).
      ZeRO-3's all-gathers and reduce-scatters run at NVLink bandwidth on NCCL's ring and P2P paths without it.
    - PYTORCH_ALLOC_CONF=expandable_segments:True: a unit's gathered buffer comes and goes every step, and freed
      blocks of one size no longer strand reserved memory the next size cannot use. Safe with train.py's storage
      resize_(0)/resize_: a CUDA storage's resize_ allocates, copies and frees through the same allocator; FSDP2
      frees its unsharded parameters the same way and torchtitan runs with this setting. Read when CUDA's
      allocator starts (the first CUDA tensor), after this. PYTORCH_CUDA_ALLOC_CONF is its deprecated name, and
      the only one some torch versions the requirements allow honour for expandable segments (pytorch/pytorch#183387:
      2.9.1 ignores the new name's expandable_segments; verified fixed in 2.11): below ALLOC_CONF_ONE_NAME_FROM the
      value is set under both names (torch then warns once that the old name is deprecated). read_health's device
      check reads the setting back once CUDA has started and warns when it is not in effect.
    - NCCL's flight recorder: the last 2000 collectives per rank, dumped when the watchdog times one out, into
      OUT_DIR/nccl_trace/rank_<N> (every node shares it, and it outlives the job) instead of torch's default
      /tmp/nccl_trace_rank_<N>, which many sites wipe; `torchfrtrace OUT_DIR/nccl_trace` names the collective and
      the ranks that never joined it. The folder is made here on GPUs (torch's writer does not make folders)."""
    def default(name, value, *older_names):
        if not any(env.get(n) for n in (name, *older_names)):
            env[name] = value
    default("NCCL_NVLS_ENABLE", "0")
    default("PYTORCH_ALLOC_CONF", "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF")
    if TorchVersion(torch_version) < ALLOC_CONF_ONE_NAME_FROM and env.get("PYTORCH_ALLOC_CONF"):
        default("PYTORCH_CUDA_ALLOC_CONF", env["PYTORCH_ALLOC_CONF"])
    default("TORCH_FR_BUFFER_SIZE", "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE")
    default("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    trace = os.path.join(os.path.abspath(out_dir), "nccl_trace")
    default("TORCH_FR_DUMP_TEMP_FILE", os.path.join(trace, "rank_"), "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if torch.cuda.is_available() and env.get("TORCH_FR_DUMP_TEMP_FILE", "").startswith(trace):
        try:
            os.makedirs(trace, exist_ok=True)
        except OSError:  # an --out_dir that cannot be written: the out_dir's claim says so, in one line
            pass
