"""What can be wrong before any work starts, found on every rank before any process group exists, as
one line each: the flags, the model's config (a preset, config.json, or a checkpoint's manifest), and
the safetensors headers of --init_from. train.py's setup stops on the first list that is not empty."""
import difflib
import json
import os
import re
import socket
import sys
from dataclasses import asdict

import torch

import data as D
import model as M
from components import checkpoints, hf
from components import out_dir as OD
from components import plan as P
from components import run_data
from components import sample


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


def check_config(cfg, world: int) -> list[str]:
    """Every problem with the flags, as one line each, found before any process group exists."""
    errors = []
    choices = dict(schedule=("cosine", "constant"), dtype=("auto", "bfloat16", "float32"),
                   reduce_dtype=("float32", "bfloat16"), ac=("none", "full", "selective"),
                   device=("auto", "cuda", "cpu"), resume=("auto", "never"), async_save=("auto", "true", "false"))
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            errors.append(f"--{name}: {getattr(cfg, name)!r} is not one of {', '.join(allowed)}")
    for name in ("seq_len", "batch_size", "micro_batch_size", "log_every"):
        if getattr(cfg, name) < 1:
            errors.append(f"--{name}: must be >= 1, got {getattr(cfg, name)}")
    if cfg.profile < 0:
        errors.append(f"--profile: a step number >= 1 (0: no trace), got {cfg.profile}")
    if cfg.steps < 0:
        errors.append(f"--steps: must be >= 0 (0 only converts --init_from to --export_hf), got {cfg.steps}")
    trains = cfg.steps > 0 and not cfg.from_ckpt  # converting a checkpoint needs no batch and no data
    if trains and cfg.batch_size >= 1 and cfg.micro_batch_size >= 1 and cfg.batch_size % (world * cfg.micro_batch_size):
        errors.append(f"--batch_size: {cfg.batch_size} is not a multiple of world size x --micro_batch_size "
                      f"= {world} x {cfg.micro_batch_size} = {world * cfg.micro_batch_size}")
    if cfg.lr <= 0 or cfg.warmup_steps < 0 or cfg.weight_decay < 0 or cfg.grad_clip < 0:
        errors.append("--lr must be > 0 and --warmup_steps, --weight_decay, --grad_clip >= 0")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(cfg, name) < 1:
            errors.append(f"--{name}: must be in [0, 1), got {getattr(cfg, name)}")
    if cfg.adam_eps <= 0:
        errors.append(f"--adam_eps: must be > 0, got {cfg.adam_eps}")
    if cfg.model and cfg.model not in M.PRESETS:
        errors.append(f"--model: unknown preset {cfg.model!r}; known: {', '.join(M.PRESETS)}")
    for flag in ("--data", "--eval_data") if trains else ():  # each source exists, each weight > 0
        try:
            run_data.sources(cfg, flag)
        except D.DataError as e:
            errors.append(str(e))
    if cfg.eval_data == "sample" and cfg.data != "sample":
        errors.append("--eval_data: 'sample' evaluates the built-in sample's tokens; use it with --data sample")
    if cfg.ac_rest not in ("none", "selective") or cfg.ac_blocks < -1:
        errors.append(f"--ac_rest must be none or selective and --ac_blocks >= -1, got {cfg.ac_rest!r}, {cfg.ac_blocks}")
    if cfg.offload_activations and cfg.ac != "full":
        errors.append(f"--offload_activations: offloads what --ac full keeps (each block's input); got --ac {cfg.ac}")
    if cfg.eval_every < 0 or cfg.eval_batches < 1 or cfg.ce_chunk < 0:
        errors.append("--eval_every and --ce_chunk must be >= 0, --eval_batches >= 1")
    if cfg.max_skipped_steps < 0 or cfg.timeout_min <= 0 or cfg.gpu_hour_usd < 0:
        errors.append("--max_skipped_steps and --gpu_hour_usd must be >= 0, --timeout_min > 0")
    if cfg.ckpt_timeout_min <= 0:
        errors.append(f"--ckpt_timeout_min: must be > 0, got {cfg.ckpt_timeout_min}")
    if cfg.first_contact_s <= 0:
        errors.append(f"--first_contact_s: must be > 0, got {cfg.first_contact_s:g}")
    if cfg.keep_ckpts < 2 or cfg.ckpt_every < 0:
        errors.append(f"--keep_ckpts must be >= 2 and --ckpt_every >= 0, got {cfg.keep_ckpts}, {cfg.ckpt_every}")
    for flag, path in (("--init_from", cfg.init_from), ("--from_ckpt", cfg.from_ckpt)):
        if path and not os.path.exists(path):
            errors.append(f"{flag}: {path} does not exist")
    if cfg.from_ckpt and not cfg.export_hf:
        errors.append("--from_ckpt: give --export_hf DIR too (a checkpoint is loaded to be exported)")
    try:  # writable now, not after a day of training
        os.makedirs(cfg.out_dir, exist_ok=True)
        probe = os.path.join(cfg.out_dir, f".write-test-{os.getpid()}-{os.urandom(4).hex()}")
        os.close(OD.open_no_follow(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL))  # a new file, never a planted link
        os.remove(probe)
    except OSError as e:
        errors.append(f"--out_dir: {cfg.out_dir} is not writable ({e.strerror})")
    used = [n for n in ("checkpoints", "metrics.jsonl") if os.path.exists(os.path.join(cfg.out_dir, n))]
    if trains and cfg.resume == "never" and used and not cfg.overwrite:
        errors.append(f"--out_dir: {cfg.out_dir} already holds {' and '.join(used)}; --resume auto continues "
                      f"from it, --overwrite true deletes them")
    if cfg.export_hf and OD.export_made(cfg.export_hf):
        errors.append(f"--export_hf: {cfg.export_hf} exists and is not empty; remove it or choose another")
    if trains and not errors:
        errors += check_resume_mix(cfg)
    return errors + sample.check_flags(cfg)


def check_resume_mix(cfg) -> list[str]:
    """A resume continues the --data mix its checkpoint was saved with; another mix is refused here, before
    any work (the loader checks again, with each source's windows, when it resumes)."""
    try:
        candidates = checkpoints.resume_candidates(os.path.join(cfg.out_dir, "checkpoints")) if cfg.resume == "auto" else []
        state = OD.load_json(os.path.join(candidates[0], "manifest.json"))["data"]
        if not state:  # a conversion run saved none
            return []
    except (IndexError, OSError, ValueError, KeyError, TypeError, OD.CheckpointError):
        return []  # no checkpoint, or a damaged one: resume says so and falls back
    sources = run_data.sources(cfg, "--data")
    mismatch = D.mix_mismatch(state, [n for n, _, _ in sources], [w for _, _, w in sources])
    return [f"{mismatch} ({candidates[0]})"] if mismatch else []  # --sample_prompts and --sample_tokens


def check_param_groups(cfg, mcfg: M.ModelConfig) -> list[str]:
    """--freeze and --lr_mult against the model's parameters (their Hugging Face names, model.hf_names): a bad
    pattern, one that matches nothing, a --freeze that splits a unit (units are frozen whole: one flat buffer has
    one gradient and one optimizer state) or freezes every unit. One line each."""
    if not (cfg.freeze or cfg.lr_mult):
        return []
    errors = []
    with torch.device("meta"):  # names only: allocates nothing (one model for both flags: 1 s at 70B)
        model = M.Llama(mcfg)
    if cfg.freeze:
        try:
            frozen, split = M.frozen_units(model, cfg.freeze)
        except re.error as e:
            return [f"--freeze: {cfg.freeze!r} is not a regular expression ({e})"]
        units = M.sharding_units(model)
        if split:
            names = dict(units)[split[0]]
            matched = [n for n in names if any(re.search(cfg.freeze, h) for h in M.hf_names(mcfg, n))]
            other = next(n for n in names if n not in matched)
            more = f" (and {len(split) - 1} more unit(s))" if len(split) > 1 else ""
            return [f"--freeze: {cfg.freeze!r} splits unit {split[0]}{more}: it matches {M.hf_name(matched[0])} but "
                    f"not {M.hf_name(other)}; units are frozen whole (the embedding, each block, the head: "
                    f"model.norm.weight with lm_head.weight): match all of a unit's parameters or none"]
        if not frozen and not split:
            errors.append(f"--freeze: {cfg.freeze!r} matches no parameter (Hugging Face names, as in --export_hf's "
                          f"folder: model.embed_tokens.weight, model.layers.0.mlp.up_proj.weight, lm_head.weight)")
        elif len(frozen) == len(units):
            errors.append(f"--freeze: {cfg.freeze!r} freezes every unit: nothing would train")
    if cfg.lr_mult:
        try:
            unmatched = M.lr_factors(model, cfg.lr_mult)[1]
        except ValueError as e:
            return errors + [str(e)]
        if unmatched:
            errors.append(f"--lr_mult: pattern {unmatched[0]!r} matches no parameter (Hugging Face names, as in "
                          f"--export_hf's folder: model.layers.0.mlp.up_proj.weight, lm_head.weight)")
    return errors


def param_group_warnings(cfg, mcfg: M.ModelConfig) -> list[str]:
    """What --freeze does beyond what it names, one line each (rank 0 prints them)."""
    if not (cfg.freeze and mcfg.tie_embeddings):
        return []
    with torch.device("meta"):
        model = M.Llama(mcfg)
    if "embed" in M.frozen_units(model, cfg.freeze)[0]:
        return [f"--freeze {cfg.freeze!r} freezes the embedding, and with tied embeddings (tie_word_embeddings) "
                f"its weight is also the head's lm_head.weight: the head's weight is frozen too"]
    return []


def config_warnings(cfg) -> list[str]:
    """Flags that are allowed but probably not meant, one line each (rank 0 prints them)."""
    warnings = []
    if cfg.steps > 0 and not cfg.from_ckpt and cfg.warmup_steps >= cfg.steps:  # lr_at never leaves warmup
        warnings.append(f"--warmup_steps {cfg.warmup_steps} is not below --steps {cfg.steps}: the whole run is warmup; "
                        f"the learning rate rises to {cfg.lr * cfg.steps / cfg.warmup_steps:g} at the last step "
                        f"(--lr {cfg.lr:g}) and never follows --schedule {cfg.schedule}; lower --warmup_steps")
    if cfg.profile > cfg.steps:
        warnings.append(f"--profile {cfg.profile} is beyond --steps {cfg.steps}: no trace will be written")
    return warnings


# What other trainers (Hugging Face Trainer, nanoGPT, Megatron-LM) call some of these flags: an unknown
# flag is looked up here first, then by spelling.
OTHER_TRAINERS_FLAGS = {
    "max_steps": "steps", "max_iters": "steps", "train_iters": "steps", "num_train_epochs": "steps",
    "preset": "model", "model_name_or_path": "init_from", "load": "init_from",
    "learning_rate": "lr", "warmup_iters": "warmup_steps", "lr_warmup_iters": "warmup_steps",
    "lr_scheduler_type": "schedule", "max_grad_norm": "grad_clip", "clip_grad": "grad_clip",
    "per_device_train_batch_size": "micro_batch_size", "global_batch_size": "batch_size",
    "gradient_accumulation_steps": "batch_size", "block_size": "seq_len", "seq_length": "seq_len",
    "max_seq_length": "seq_len", "output_dir": "out_dir", "save": "out_dir", "save_steps": "ckpt_every",
    "save_interval": "ckpt_every", "save_total_limit": "keep_ckpts", "logging_steps": "log_every",
    "log_interval": "log_every", "eval_steps": "eval_every", "eval_interval": "eval_every",
    "gradient_checkpointing": "ac", "resume_from_checkpoint": "resume", "bf16": "dtype",
}


def unknown_flag_message(unknown: list[str], known: list[str]) -> str:
    """One line for what the command line parser did not recognize (`unknown`, as parse_known_args
    returns it: an unknown flag, with its value after it when not written --flag=value)."""
    flag = next((arg for arg in unknown if arg.startswith("-")), None)
    if flag is None:
        return f"unexpected argument {unknown[0]!r}: flags are --name value or --name=value"
    flag = flag.split("=", 1)[0]
    name = flag.lstrip("-").replace("-", "_")  # --out-dir: the dashes of other tools
    nearest = (OTHER_TRAINERS_FLAGS.get(name) or (name if name in known else None)
               or next(iter(difflib.get_close_matches(name, known, n=1)), None))
    if nearest:
        return f"unrecognized flag {flag}; did you mean --{nearest}?"
    return f"unrecognized flag {flag}; python train.py --help lists the flags"


def check_export(mcfg: M.ModelConfig) -> list[str]:
    """--export_hf: what transformers builds from this model's config.json must be this model, found now
    rather than after the training (hf.check_export_tensors; export_hf checks again)."""
    with torch.device("meta"):
        shapes = {M.hf_name(n): tuple(p.shape) for n, p in M.Llama(mcfg).named_parameters()}
    try:
        hf.check_export_tensors(hf.config_to_hf(mcfg, torch.float32), shapes)
    except ValueError as e:
        return [str(e)]
    return []


def check_phase_tokenizer(cfg, checkpoint: str) -> list[str]:
    """A new phase from one of our checkpoints trains on data of the model's tokenizer: the one that
    prepared the data of the run that saved it (or of its own origin), when both are known."""
    theirs = hf.export_origin(OD.load_json(os.path.join(checkpoint, "manifest.json"))["train"])["tokenizer"]
    ours = hf.tokenizer_record(asdict(cfg))
    if ours and theirs and ours["sha256"] != theirs["sha256"]:
        return [f"--data: {cfg.data} was tokenized with {ours['path']}, and the model of --init_from {checkpoint} was "
                f"trained on data tokenized with {theirs['path']}, another tokenizer; prepare the data with that one"]
    return []


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


def node_host_bytes(cfg, mcfg: M.ModelConfig, world: int, async_save: bool) -> tuple[int, dict]:
    """(ranks on this node, the bytes they pin together by part): the planner's count (plan.host_bytes_per_gpu,
    what offload.HostState and the save's staging buffer allocate, byte for byte) x LOCAL_WORLD_SIZE."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    parts = P.host_bytes_per_gpu(mcfg, cfg, world, async_save)
    return local_world, {name: nbytes * local_world for name, nbytes in parts.items()}


def fits_host_memory(needed: int, limit) -> bool:
    return limit is None or needed <= HOST_MEMORY_USABLE * limit[0]


def async_save_on(cfg, mcfg: M.ModelConfig, world: int, limit=None) -> tuple[bool, str | None]:
    """--async_save on this node, and, when 'auto' turns it off for lack of host memory, one line saying so.
    'true' and 'false' are what they say; 'auto' is off on CPU (the cores would share training and writing)
    and on for a CUDA run whose ranks on this node fit their staging buffers beside what they already pin
    (`limit`, host_memory_limit's when None, less 10%). The run's decision is every node's (agree.decide)."""
    if cfg.async_save != "auto":
        return cfg.async_save == "true", None
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if not cuda:
        return False, None
    local_world, parts = node_host_bytes(cfg, mcfg, world, async_save=True)
    limit = limit or host_memory_limit()
    if fits_host_memory(sum(parts.values()), limit):
        return True, None
    beside = (f" beside {(parts['state'] + parts['activations']) / 2**30:,.1f} GiB already offloaded"
              if parts["state"] + parts["activations"] else "")
    return False, (f"--async_save auto: off: the {local_world} rank(s) on this node would need "
                   f"{parts['staging'] / 2**30:,.1f} GiB of host memory for the save's staging buffer{beside}, and "
                   f"{limit[1]}; every save stalls training for its whole write")


def check_host_memory(cfg, mcfg: M.ModelConfig, world: int, state_bytes_per_param: int, limit=None) -> list[str]:
    """What the node's ranks pin in host memory must fit in what the machine has now and what the job may use,
    or the kernel kills the job mid-run instead of this line: --offload_optimizer's fp32 state (and the block
    inputs of --offload_activations), and --async_save's staging buffer, a copy of each rank's checkpoint."""
    if cfg.plan:
        return []
    limit = limit or host_memory_limit()
    asynchronous = async_save_on(cfg, mcfg, world, limit)[0]  # 'auto' is on only where it fits
    if not cfg.offload_optimizer and not asynchronous:
        return []
    local_world, parts = node_host_bytes(cfg, mcfg, world, asynchronous)
    needed = sum(parts.values())
    if fits_host_memory(needed, limit):
        return []
    fix = "ask SLURM for all of the node's memory (sbatch --mem=0), " if "cgroup" in limit[1] else ""
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
    """Returns (model config, where the first weights come from, errors). The weights: None (seeded),
    {HF tensor name: file} (an --init_from Hugging Face folder), or a checkpoint folder (--from_ckpt, or
    --init_from one of ours: its manifest and file sizes checked here, its SHA-256 as it is read)."""
    errors = check_nodes() or check_config(cfg, world)  # what depends on the node: agree.read_facts
    mcfg = weights = None
    if not errors:
        try:
            weights = hf.checkpoint_source(cfg)
            mcfg = hf.model_config(cfg)
        except OD.CheckpointError as e:
            errors.append(str(e))
        except (KeyError, json.JSONDecodeError) as e:
            errors.append(f"--init_from: cannot read config.json: {e}")
        except ValueError as e:  # config.json describes a model this code does not build
            errors.append(f"--init_from: {e}")
    if mcfg is not None:
        errors += M.check_model_config(mcfg) or check_param_groups(cfg, mcfg)
    if not errors and weights is not None:
        try:
            checkpoints.check_checkpoint_files(weights, "--from_ckpt" if cfg.from_ckpt else "--init_from",
                                        {name: numel for name, numel, _ in P.model_units(mcfg)})
        except OD.CheckpointError as e:
            errors.append(str(e))
    if not errors and weights is not None and cfg.init_from and cfg.steps > 0 and not cfg.from_ckpt:
        errors += check_phase_tokenizer(cfg, weights)
    if not errors and cfg.init_from and weights is None and not cfg.from_ckpt:
        try:  # headers only: a bad weight file is one line here, not a traceback at load
            weights = hf.hf_file_of_tensors(cfg.init_from)
            hf.check_hf_tensors(weights, mcfg, cfg.init_from)
        except (ValueError, FileNotFoundError) as e:
            errors.append(str(e))
    if not errors and cfg.export_hf:
        errors += check_export(mcfg)
    return mcfg, weights, errors
