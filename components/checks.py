"""What can be wrong before any work starts, found on every rank before any process group exists, as
one line each: the flags (flags.py), what earlier runs left (an --export_hf folder, a checkpoint's --data mix),
the model's config (a preset, config.json, or a checkpoint's manifest), the safetensors headers of --init_from,
and this machine (its node's processes, host memory, flash-attn). train.py's setup stops on the first list that
is not empty (check_run)."""
import os
import socket
import sys

import torch

import data as D
import model as M
from components import checkpoints, flags, hf
from components import offload as O
from components import out_dir as OD
from components import run_data


def check_nodes(env=os.environ) -> list[str]:
    """Every node must run as many processes as the others (one per GPU): a node that sees 7 GPUs would make
    the world 15 and the first error a --batch_size that is not a multiple of it, which never names the
    GPUs. torchrun gives each worker its node's count (LOCAL_WORLD_SIZE), the number of nodes
    (GROUP_WORLD_SIZE) and the world; they disagree exactly when the nodes' counts differ. No process group
    is needed, so this comes first, before the flags' checks."""
    try:
        local, nodes, world = (int(env[name]) for name in ("LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "WORLD_SIZE"))
    except (KeyError, ValueError):  # not under torchrun: one process, or a caller's own group
        return []
    if local * nodes == world:
        return []
    host = env.get("SLURMD_NODENAME") or socket.gethostname()
    return [f"this node ({host}) runs {local} of the {world} processes on {nodes} nodes, so the other "
            f"{'node runs' if nodes == 2 else f'{nodes - 1} nodes run'} {world - local}, not {local * (nodes - 1)}: "
            f"every node must run as many processes as the others, one per GPU (launch.sh starts one per GPU torch "
            f"sees, or NPROC_PER_NODE); check the GPUs of the node with fewer (nvidia-smi) and leave it out "
            f"(sbatch --exclude=NODE), or set NPROC_PER_NODE to the smaller count on every node"]


def check_resume_mix(cfg) -> list[str]:
    """A resume continues the --data mix its checkpoint was saved with; another mix is refused here, before
    any work (the loader checks again, with each source's windows, when it resumes)."""
    if cfg.steps == 0:  # a conversion reads no data
        return []
    try:
        candidates = checkpoints.candidates_on_disk(os.path.join(cfg.out_dir, "checkpoints")) if cfg.resume == "auto" else []
        state = OD.load_json(os.path.join(candidates[0], "manifest.json"))["data"]
        if not state:  # a conversion run saved none
            return []
    except (IndexError, OSError, ValueError, KeyError, TypeError, OD.CheckpointError):
        return []  # no checkpoint, or a damaged one: resume says so and falls back
    sources = run_data.sources(cfg, "--data")
    mismatch = D.mix_mismatch(state, [n for n, _, _ in sources], [w for _, _, w in sources])
    return [f"{mismatch} ({candidates[0]})"] if mismatch else []


def host_memory_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable from /proc/meminfo (Linux): what the kernel can give without swapping."""
    try:
        with open(meminfo) as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def cgroup_memory_limit(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup"):
    """(bytes, file) of the smallest memory limit on this process's cgroup and its ancestors, or None: a
    SLURM job's (--mem; a step's cgroup sits under its job's, which holds the limit), a container's. cgroup
    v2 ("0::PATH" in /proc/self/cgroup): ROOT/PATH/memory.max, "max" when none; v1 ("N:memory:PATH"):
    ROOT/memory/PATH/memory.limit_in_bytes, about 2**63 when none (the kernel's documentation,
    admin-guide/cgroup-v2.rst and cgroup-v1/memory.rst)."""
    try:
        with open(proc_cgroup) as f:
            entries = [line.strip().split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    found = None
    for _, controllers, path in entries:
        if controllers == "":
            folder, name = cgroup_root, "memory.max"
        elif "memory" in controllers.split(","):
            folder, name = os.path.join(cgroup_root, "memory"), "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # this cgroup, then each ancestor up to the root
            limit_file = os.path.join(folder, *parts[:depth], name)
            try:
                with open(limit_file) as f:
                    limit = f.read().strip()
            except OSError:
                continue
            if limit.isdigit() and int(limit) < 2**62 and (found is None or int(limit) < found[0]):
                found = (int(limit), limit_file)
    return found


def host_memory_limit(meminfo: str = "/proc/meminfo", proc_cgroup: str = "/proc/self/cgroup",
                      cgroup_root: str = "/sys/fs/cgroup"):
    """(bytes, what they are, in words): the smaller of the machine's available memory and this job's
    cgroup limit (a SLURM job granted less than the node has: --exclusive without --mem=0); None if neither
    is known."""
    available = host_memory_available_bytes(meminfo)
    cgroup = cgroup_memory_limit(proc_cgroup, cgroup_root)
    if cgroup and (available is None or cgroup[0] < available):
        return cgroup[0], f"this job's cgroup allows {cgroup[0] / 2**30:,.1f} GiB ({cgroup[1]})"
    if available is None:
        return None
    return available, f"this machine has {available / 2**30:,.1f} GiB available"


HOST_MEMORY_USABLE = 0.9  # pinned memory cannot be swapped: leave 10% to the rest of the machine


def rank_units(model: torch.nn.Module, frozen: list[str], world: int) -> list[tuple[int, bool]]:
    """(shard elements, trained) of each of a rank's units (model.sharding_units of `model`, which may be on the meta
    device), padded and sharded over `world` ranks as train.Unit does; `frozen`: the units --freeze freezes."""
    return [(-(-numel // world), name not in frozen) for name, numel in M.numels_by_unit(model).items()]


def staging_bytes(units: list[tuple[int, bool]]) -> int:
    """--async_save's staging buffer on one rank (checkpoints.BackgroundSave), in bytes, for `units` (rank_units):
    the fp32 tensors of its checkpoint file (checkpoints.saved_tensors: a unit's master, a trained one's optimizer
    state too), each at checkpoints.staging_offsets' aligned place."""
    return checkpoints.staging_offsets([4 * n for n, trained in units
                                        for _ in range(1 + len(M.OPTIMIZER_STATE) * trained)])[-1]


def host_bytes_per_rank(cfg, mcfg, world: int, planned: dict | None) -> dict | None:
    """What each rank pins by part, with the save's staging buffer ("async") and without ("sync"): --offload_optimizer's
    state (offload.host_state_bytes) and the staging buffer (staging_bytes), computed here from the model, the flags
    and `world`; --offload_activations' block inputs, the planner's, which measures a block (`planned`, the planner's
    figures: agree.planner_figures). None when those count and the planner could not say."""
    if cfg.offload_activations and planned is None:
        return None
    with torch.device("meta"):
        model = M.Llama(mcfg)
    units = rank_units(model, flags.frozen_units(model, cfg.freeze)[0], world)
    parts = dict(state=O.host_state_bytes(units) if cfg.offload_optimizer else 0,
                 activations=planned["host_bytes"]["sync"]["activations"] if cfg.offload_activations else 0)
    return {"async": dict(parts, staging=staging_bytes(units)), "sync": dict(parts, staging=0)}


def node_host_bytes(host_bytes: dict, world: int, async_save: bool) -> tuple[int, dict]:
    """(ranks on this node, the bytes they pin together by part): each rank's (`host_bytes`, host_bytes_per_rank:
    what offload.HostState and the staging buffer allocate, byte for byte) x LOCAL_WORLD_SIZE."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    parts = host_bytes["async" if async_save else "sync"]
    return local_world, {name: nbytes * local_world for name, nbytes in parts.items()}


def fits_host_memory(needed: int, limit) -> bool:
    return limit is None or needed <= HOST_MEMORY_USABLE * limit[0]


def async_save_on(cfg, host_bytes: dict | None, world: int, limit=None) -> tuple[bool, str | None]:
    """--async_save on this node, and, when 'auto' turns it off for lack of host memory, one line saying so.
    'true' and 'false' are what they say; 'auto' is off on CPU (the cores would share training and writing)
    and on for a CUDA run whose ranks on this node fit their staging buffers beside what they already pin
    (`limit`, host_memory_limit's when None, less 10%; on, as with no limit known, without `host_bytes`: the
    planner's block inputs of --offload_activations missing). The run's decision is every node's (agree.decide)."""
    if cfg.async_save != "auto":
        return cfg.async_save == "true", None
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if not cuda:
        return False, None
    if host_bytes is None:
        return True, None
    local_world, parts = node_host_bytes(host_bytes, world, async_save=True)
    limit = limit or host_memory_limit()
    if fits_host_memory(sum(parts.values()), limit):
        return True, None
    beside = (f" beside {(parts['state'] + parts['activations']) / 2**30:,.1f} GiB already offloaded"
              if parts["state"] + parts["activations"] else "")
    return False, (f"--async_save auto: off: the {local_world} rank(s) on this node would need "
                   f"{parts['staging'] / 2**30:,.1f} GiB of host memory for the save's staging buffer{beside}, and "
                   f"{limit[1]}; every save stalls training for its whole write")


def check_host_memory(cfg, host_bytes: dict | None, world: int, limit=None) -> list[str]:
    """What the node's ranks pin in host memory must fit in what the machine has now and what the job may use,
    or the kernel kills the job mid-run instead of this line: --offload_optimizer's fp32 state (and the block
    inputs of --offload_activations), and --async_save's staging buffer, a copy of each rank's checkpoint. Without
    `host_bytes` (--offload_activations' block inputs are the planner's, and its subprocess failed, and said so)
    nothing is checked."""
    if cfg.plan or host_bytes is None:
        return []
    limit = limit or host_memory_limit()
    asynchronous = async_save_on(cfg, host_bytes, world, limit)[0]  # 'auto' is on only where it fits
    if not cfg.offload_optimizer and not asynchronous:
        return []
    local_world, parts = node_host_bytes(host_bytes, world, asynchronous)
    needed = sum(parts.values())
    if fits_host_memory(needed, limit):
        return []
    fix = "ask SLURM for all of the node's memory (sbatch --mem=0), " if "cgroup" in limit[1] else ""
    state_bytes_per_param = 4 * O.state_tensors(True, M.OPTIMIZER_STATE)  # fp32 master, gradient, optimizer state
    gib = {name: nbytes / 2**30 for name, nbytes in parts.items()}
    if asynchronous:  # --async_save true
        drop = ["--async_save true"] + (["--offload_optimizer"] if cfg.offload_optimizer and fits_host_memory(
            needed - parts["state"], limit) else [])
        state = (f", {gib['state']:,.1f} GiB for --offload_optimizer's state ({state_bytes_per_param} B per parameter "
                 f"/ {world} ranks)" if cfg.offload_optimizer else "")
        activations = f", {gib['activations']:,.1f} GiB for offloaded block inputs" if gib["activations"] else ""
        return [f"--async_save true{' with --offload_optimizer' if cfg.offload_optimizer else ''}: the {local_world} "
                f"rank(s) on this node need {needed / 2**30:,.1f} GiB of host memory ({gib['staging']:,.1f} GiB for the "
                f"save's staging buffer{state}{activations}), and {limit[1]}; drop {' or '.join(drop)} (--async_save "
                f"auto turns it off where it does not fit), {fix}or use more nodes"]
    return [f"--offload_optimizer: the {local_world} rank(s) on this node need {needed / 2**30:,.1f} GiB of host memory "
            f"for their optimizer state ({state_bytes_per_param} B per parameter / {world} ranks, and "
            f"{'staging slots and offloaded block inputs' if cfg.offload_activations else 'staging slots'}), and "
            f"{limit[1]}; {fix}use more nodes, or train without --offload_optimizer"]


def flash_attn_import_problem(error: ImportError | None) -> str | None:
    """model.FLASH_ATTN_IMPORT_ERROR as one line; None when flash_attn imported or is simply not installed (SDPA
    is then meant). An install that does not import (built for another torch: "undefined symbol"; its CUDA
    extension missing) would otherwise fall back to SDPA silently."""
    if error is None or (isinstance(error, ModuleNotFoundError) and error.name == "flash_attn"):
        return None
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def check_flash_attn(cfg) -> list[str]:
    """On a CUDA machine, a flash_attn that is installed but does not import is an error, not a silent SDPA."""
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    problem = flash_attn_import_problem(M.FLASH_ATTN_IMPORT_ERROR)
    if not cuda or problem is None:
        return []
    return [f"flash_attn is installed but does not import ({problem}), so attention would "
            f"silently run on SDPA: reinstall it for this torch (pip install 'flash-attn>=2.7' --no-build-isolation), "
            f"or uninstall it (pip uninstall flash-attn) to use SDPA"]


def flash_attn_unsaved_warning(saved_ops) -> str | None:
    """flash_attn imports but the selective policy cannot save its attention: before 2.7 it calls its CUDA
    extension directly, with no torch op (flash_attn::_flash_attn_varlen_forward) for the policy to see,
    so --ac selective silently recomputes attention in backward."""
    if M.flash_attn_func is None:
        return None
    saved = {str(op) for op in saved_ops}
    missing = [name for name in ("_flash_attn_forward", "_flash_attn_varlen_forward")
               if f"flash_attn.{name}.default" not in saved]
    if not missing:
        return None
    version = getattr(sys.modules.get("flash_attn"), "__version__", "?")
    return (f"flash_attn {version} registers no torch op flash_attn::{missing[-1]} (2.7 and later do): --ac selective "
            f"cannot save attention's output and recomputes attention in backward; pip install 'flash-attn>=2.7' "
            f"--no-build-isolation")


def check_run(cfg, world: int):
    """Returns (model config, where the first weights come from, errors): the flags and the files they name
    (flags.check_config), what earlier runs left (an --export_hf folder, a checkpoint's --data mix), then the model
    and its first weights (hf.check_start)."""
    errors = check_nodes() or flags.check_config(cfg, world)  # what depends on the node: agree.read_facts
    if not errors and cfg.export_hf and OD.export_made(cfg.export_hf):
        errors.append(f"--export_hf: {cfg.export_hf} exists and is not empty; remove it or choose another")
    if not errors:
        errors += check_resume_mix(cfg)
    if errors:
        return None, None, errors
    return hf.check_start(cfg)
