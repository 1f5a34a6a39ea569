"""train.py's flags and every check of them that reads only the flags and the files they name. TrainConfig's
fields make the command line (parse_args; an unknown flag names the nearest one); check_config, check_param_groups
and the warnings say what is wrong or probably not meant, one line each, before any work; frozen_units and
lr_factors match --freeze's and --lr_mult's patterns against the model's Hugging Face names (train.build_units, the
planner and the checks use them); fault_hook is the tests' one way into the trainer. Presets are plain functions
in model.py. What checks.py adds: the machine (nodes, host memory, flash-attn) and what earlier runs left (an
--export_hf folder, a checkpoint's --data mix)."""
import argparse
import difflib
import os
import re
from dataclasses import dataclass, field, fields

import torch

import data as D
import model as M
from components import run_data

# The tests' fault injection (tests/faults.py: a rank killed, hung, slowed, or given a NaN loss) reaches the trainer
# through this one hook, None in every run the tests do not start: they set it before train.py runs
# (tests/fault_site/sitecustomize.py) and the trainer calls it at three points, fault_hook(where, step, rank[, obj]):
# 'step' (train.main, as each step starts), 'save' (each rank's checkpoint file written) and 'contact'
# (processes.make_group, before the first contact); tools/gpu_check.py at a fourth, 'matmul' (its check matmul). It
# sits here, at the bottom of components/, so that every caller can import it. docs/operations.md, "Faults".
fault_hook = None


def opt(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    model: str = opt("", f"preset: {', '.join(M.PRESETS)}; tiny when not given (ignored with --init_from a Hugging "
                         f"Face folder; with --init_from a checkpoint of ours, it must be that checkpoint's model)")
    init_from: str = opt("", "weights to start from: a Hugging Face Llama folder (config.json + *.safetensors), or one of "
                             "our checkpoints (a step_* folder, or an --out_dir: its latest) for a new phase: its "
                             "weights only, step 1, a fresh optimizer and data position, any world size")
    data: str = opt("sample", "a folder from tools/prepare.py, a 1-D .npy token file, or several weighted, "
                              "DIR[:WEIGHT][,DIR[:WEIGHT]...] (each global batch in those proportions); or 'sample' (the "
                              "built-in English + French corpus and tokenizer, built once under OUT_DIR/sample: two sources)")
    doc_mask: bool = opt(True, "packed documents do not attend to each other and RoPE restarts in each")
    eval_data: str = opt("auto", "held-out data like --data (several sources: eval_loss/NAME each, eval_loss their "
                                 "weighted mean); 'auto': the sample's held-out part with --data sample, else none")
    eval_every: int = opt(50, "evaluate every N steps and at the end (0: never)")
    eval_batches: int = opt(4, "global batches of --eval_data (of each of its sources) per evaluation (the same ones every time)")
    sample_prompts: str = opt("", "a .jsonl of prompts ({\"text\": ...} or a chat {\"messages\": [...]}): each evaluation "
                                  "also completes them greedily, prints them and appends them to OUT_DIR/samples.jsonl")
    sample_tokens: int = opt(64, "--sample_prompts: new tokens per prompt at most (fewer when an end id comes)")
    seq_len: int = opt(256, "tokens per training sequence")
    batch_size: int = opt(16, "global batch in sequences = world size x micro_batch_size x accumulation")
    micro_batch_size: int = opt(4, "sequences per rank per forward/backward")
    steps: int = opt(200, "optimizer steps (0: no training, e.g. to convert --init_from to --export_hf)")
    lr: float = opt(1e-3, "peak learning rate")
    warmup_steps: int = opt(20, "linear warmup steps")
    schedule: str = opt("cosine", "after warmup: 'cosine' (to 10%% of --lr at --steps) or 'constant'")
    freeze: str = opt("", "a regex (re.search) over the Hugging Face parameter names (model.layers.0.mlp.up_proj.weight, "
                          "lm_head.weight, as in --export_hf's folder): matching parameters are not trained, whole "
                          "units only (the embedding, a block, the head); may change on resume (docs/operations.md)")
    lr_mult: str = opt("", "'REGEX=FACTOR,...': the learning rate of parameters whose Hugging Face name matches REGEX is "
                           "--lr x FACTOR (the first pattern that matches wins); may change on resume")
    weight_decay: float = opt(0.1, "decoupled AdamW weight decay, on matrices only (not norms)")
    grad_clip: float = opt(1.0, "clip the global gradient L2 norm to this; 0 disables")
    adam_beta1: float = opt(0.9, "AdamW beta1 (decay of the gradient's running mean)")
    adam_beta2: float = opt(0.95, "AdamW beta2 (decay of the squared gradient's running mean)")
    adam_eps: float = opt(1e-8, "AdamW epsilon")
    dtype: str = opt("auto", "compute dtype: 'bfloat16', 'float32', or 'auto' (bfloat16 on GPUs, float32 on CPUs, "
                             "where bf16 matmuls are often emulated); master weights and optimizer state are fp32")
    reduce_dtype: str = opt("float32", "dtype of the gradient reduce-scatter, 'float32' or 'bfloat16'")
    ac: str = opt("selective", "activation checkpointing per block: 'none', 'full' or 'selective'")
    ac_blocks: int = opt(-1, "partial checkpointing: only the first N blocks use --ac, the others --ac_rest "
                             "(-1: every block uses --ac)")
    ac_rest: str = opt("none", "with --ac_blocks: the policy of the blocks after the first N, 'none' or 'selective'")
    offload_optimizer: bool = opt(False, "keep the fp32 master shards, the optimizer state and the fp32 gradient "
                                         "accumulators in pinned host memory and run the optimizer on the CPU; the GPU "
                                         "keeps a compute-dtype copy of its shards for the all-gathers")
    offload_activations: bool = opt(False, "with --ac full: keep each block's input in pinned CPU memory until "
                                           "backward, instead of on the GPU")
    ce_chunk: int = opt(1024, "tokens per cross-entropy chunk: fp32 logits exist for this many tokens at a time")
    prefetch: bool = opt(True, "all-gather the next unit while the current one computes")
    seed: int = opt(0, "seed for the initial weights and the data order")
    out_dir: str = opt("out", "folder for metrics.jsonl and checkpoints/")
    ckpt_every: int = opt(0, "save a checkpoint every N steps (0: only at the end); always one at the end")
    async_save: str = opt("auto", "'true': a save copies this rank's state to host memory and writes it in the background "
                                  "while training goes on; 'false': every rank waits for its write; 'auto': true on GPUs "
                                  "where the host memory fits, false on CPUs, whose cores would share training and writing")
    keep_ckpts: int = opt(3, "keep the newest K checkpoints (at least 2)")
    resume: str = opt("auto", "'auto': continue from the newest intact checkpoint in --out_dir; 'never'")
    overwrite: bool = opt(False, "with --resume never: delete --out_dir's checkpoints and metrics first (once per run: "
                                 "its restarts by torchrun or a SLURM requeue resume)")
    from_ckpt: str = opt("", "a checkpoint folder (or an --out_dir: its latest) to load instead of training "
                             "(use with --export_hf)")
    max_skipped_steps: int = opt(0, "steps with a non-finite loss or gradient norm to skip before stopping")
    timeout_min: float = opt(10.0, "a collective waiting longer than this (a dead or hung rank) ends the run")
    ckpt_timeout_min: float = opt(60.0, "the same for the collectives around a checkpoint save or resume, which wait for "
                                        "every rank's file (12 B per parameter / W, 53 GB per rank for 70B on 16 GPUs)")
    # NCCL forms a 16-GPU communicator in seconds and thousands of GPUs' in about a minute (its bootstrap, then the
    # rings and trees); three minutes is ample for a healthy start, and a hang (a wrong interface, PCIe ACS) is said
    # 7 minutes before --timeout_min's default would end it, after which a restart would hang the same way.
    first_contact_s: float = opt(180.0, "the process group's first contact (NCCL's set-up and one all-reduce) not done "
                                        "within this many seconds: every rank says what to check and exits 2")
    allow_low_memlock: bool = opt(False, "start although a node's locked-memory limit (ulimit -l) is under 1 GiB and its "
                                         "processes lack CAP_IPC_LOCK (the nodes talk without InfiniBand, or you know "
                                         "NCCL registers less)")
    allow_small_shm: bool = opt(False, "start although a node's /dev/shm has under 1 GiB free (NCCL_SHM_DISABLE=1 keeps "
                                       "NCCL out of it)")
    gpu_hour_usd: float = opt(0.0, "price of one GPU-hour: the step line and metrics.jsonl add dollars")
    tensorboard: bool = opt(False, "also log to OUT_DIR/tensorboard (needs the tensorboard package)")
    plot: str = opt("", "only plot: write DIR/metrics.png from DIR/metrics.jsonl (needs matplotlib; runs tools/plot.py DIR)")
    export_hf: str = opt("", "at the end, write a Hugging Face folder here")
    export_shard_gb: float = opt(5.0, "largest safetensors file of --export_hf, in GB")
    log_every: int = opt(1, "print a line every N steps (metrics.jsonl gets every step)")
    profile: int = opt(0, "write a torch.profiler trace of step N (its micro-batches, every unit's gather, free, forward, "
                          "recompute, backward and reduce-scatter named) to OUT_DIR/profile/step_N_rank_R.json, for "
                          "Perfetto or chrome://tracing (0: none)")
    device: str = opt("auto", "'auto' (CUDA when available), 'cuda' or 'cpu'")
    deterministic: bool = opt(False, "GPU kernels that give the same bits every run: torch's deterministic algorithms "
                                     "(CUBLAS_WORKSPACE_CONFIG=:4096:8 when unset) and flash-attn's deterministic "
                                     "backward; slower (docs/operations.md, 'What exact means where')")
    # The planner (tools/plan.py): memory, speed and cost per GPU predicted from the flags above, no GPU needed.
    plan: bool = opt(False, "only predict memory by part, fit, step time, tokens/s/GPU, MFU, hours, cost (runs "
                            "tools/plan.py with these flags)")
    nnodes: int = opt(1, "--plan: nodes")
    nproc_per_node: int = opt(8, "--plan: GPUs per node")
    gpu: str = opt("h100", "--plan: GPU type (see tools/plan.py GPUS)")
    nics_per_node: int = opt(0, "--plan: network adapters per node the collectives use (0: the --gpu's server, 8 on "
                                "HGX H100/H200 and DGX A100); the trainer times the fabric at start-up")
    nic_gbps: float = opt(0.0, "--plan: bus bandwidth of one such NIC in a collective, GB/s (0: the --gpu's, 45 for "
                               "NDR 400 Gb/s, 22 for HDR 200 Gb/s)")
    outside_gib: float = opt(1.25, "--plan: GPU memory outside PyTorch's allocator, GiB per GPU: the CUDA context "
                                   "and NCCL's buffers (docs/planning.md: outside_gib); the trainer measures it after "
                                   "set-up and prints the largest")
    train_tokens: float = opt(0.0, "--plan: tokens to train on, for hours and cost (0: one epoch of nothing)")
    plan_json: str = opt("", "--plan: also write the prediction as JSON here")
    fs_write_gbps: float = opt(0.45, "--plan: checkpoint bandwidth per rank of --out_dir's filesystem, every rank at "
                                     "once, GB/s: a save's and a restart's load (the default: measured on a local "
                                     "disk, BENCHMARKS.md; bench/checkpoint_io.py measures yours and prints this)")
    # Llama 3 (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions in 54 days on 16,384 H100s, i.e.
    # one per 54 x 24 x 16384 / 419 = 50,677 GPU-hours; for 16 GPUs 50,677 / 16 = 3,167 h. An assumption for
    # your cluster: a smaller site's failures per GPU may well be more frequent; pass what you observe.
    mtbf_hours: float = opt(3167.0, "--plan: mean time between failures of the whole job, hours, for the suggested "
                                    "--ckpt_every; the default is Llama 3's interruption rate per GPU scaled to 16 GPUs")


def parse_args(argv=None, description: str = "") -> TrainConfig:
    """The config from the command line (--steps 5 or --steps=5). A bad value or an unknown flag is a
    ValueError of one line; an unknown flag names the nearest one (unknown_flag_message)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="python train.py [--flag value ...]", exit_on_error=False)
    for f in fields(TrainConfig):
        shown = str(f.default).lower() if type(f.default) is bool else str(f.default) or "unset"
        help_text = f"{f.metadata['help']} (default: {shown.replace('%', '%%')})"  # argparse formats help with %
        if type(f.default) is bool:  # --prefetch false / --prefetch true / --plan (alone: true)
            parser.add_argument(f"--{f.name}", type=true_or_false, nargs="?", const=True, default=f.default,
                                help=help_text)
        else:
            parser.add_argument(f"--{f.name}", type=type(f.default), default=f.default, help=help_text)
    try:
        args, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ValueError(str(e)) from None
    if unknown:
        raise ValueError(unknown_flag_message(unknown, [f.name for f in fields(TrainConfig)]))
    return TrainConfig(**vars(args))


def true_or_false(text: str) -> bool:
    value = {"true": True, "1": True, "false": False, "0": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true, false, 1 or 0, got {text!r}")
    return value


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


def compute_dtype(flag: str, device: torch.device) -> torch.dtype:
    """--dtype on `device`: 'auto' is bfloat16 on a GPU, float32 on a CPU."""
    if flag == "auto":  # a CPU without native bf16 matmuls runs them ~16x slower than fp32 (measured)
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, flag)


def check_flags(cfg, world: int) -> list[str]:
    """The flags alone, one line each: what a run and the planner (tools/plan.py, at its world) both refuse."""
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
    return errors


def check_plan_flags(cfg, gpus: list[str]) -> list[str]:
    """--plan's own flags (tools/plan.py), one line each, then check_flags at the planned world size and the
    sampling flags; `gpus`: the GPU types the planner knows."""
    errors = [] if cfg.gpu in gpus else [f"--gpu: {cfg.gpu!r} is not one of {', '.join(gpus)}"]
    if cfg.dtype not in ("bfloat16", "auto"):  # auto is bfloat16 on GPUs
        errors.append(f"--dtype: the planner models bfloat16 compute only, got {cfg.dtype!r}")
    for name in ("nnodes", "nproc_per_node"):
        if getattr(cfg, name) < 1:
            errors.append(f"--{name}: must be >= 1, got {getattr(cfg, name)}")
    for name in ("nics_per_node", "nic_gbps", "outside_gib", "train_tokens"):
        if getattr(cfg, name) < 0:
            errors.append(f"--{name}: must be >= 0, got {getattr(cfg, name)}")
    for name, unit in (("fs_write_gbps", "GB/s per rank"), ("mtbf_hours", "hours between failures of the job")):
        if getattr(cfg, name) <= 0:
            errors.append(f"--{name}: must be > 0 ({unit}), got {getattr(cfg, name)}")
    return errors + check_flags(cfg, max(1, cfg.nnodes * cfg.nproc_per_node)) + check_sample_flags(cfg)


def check_config(cfg, world: int) -> list[str]:
    """Every problem with the flags and the files they name, as one line each, found before any process group exists
    (checks.check_run then looks at what earlier runs left: an --export_hf folder, a checkpoint's --data mix)."""
    errors = check_flags(cfg, world)
    trains = cfg.steps > 0 and not cfg.from_ckpt  # converting a checkpoint needs no batch and no data
    for flag in ("--data", "--eval_data") if trains else ():  # each source exists, each weight > 0
        try:
            run_data.sources(cfg, flag)
        except D.DataError as e:
            errors.append(str(e))
    for flag, path in (("--init_from", cfg.init_from), ("--from_ckpt", cfg.from_ckpt)):
        if path and not os.path.exists(path):
            errors.append(f"{flag}: {path} does not exist")
    if cfg.from_ckpt and not cfg.export_hf:
        errors.append("--from_ckpt: give --export_hf DIR too (a checkpoint is loaded to be exported)")
    try:  # writable now, not after a day of training
        os.makedirs(cfg.out_dir, exist_ok=True)
        probe = os.path.join(cfg.out_dir, f".write-test-{os.getpid()}-{os.urandom(4).hex()}")
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL))  # O_EXCL: never through a planted link
        os.remove(probe)
    except OSError as e:
        errors.append(f"--out_dir: {cfg.out_dir} is not writable ({e.strerror})")
    used = [n for n in ("checkpoints", "metrics.jsonl") if os.path.exists(os.path.join(cfg.out_dir, n))]
    if trains and cfg.resume == "never" and used and not cfg.overwrite:
        errors.append(f"--out_dir: {cfg.out_dir} already holds {' and '.join(used)}; --resume auto continues "
                      f"from it, --overwrite true deletes them")
    return errors + check_sample_flags(cfg)


def read_prompts(path: str) -> list[dict]:
    """The records of a prompts file, each {"text": str} or {"messages": [...]}; a bad line raises a
    DataError naming the flag, the file and the line."""
    where = f"--sample_prompts: {path}"
    if not os.path.isfile(path):
        raise D.DataError(f"{where} does not exist")
    with open(path, "rb") as f:
        records = [D.parse_record(raw, f"{where}:{n}", is_txt=False, trains=False)
                   for n, raw in enumerate(f, 1) if raw.strip()]
    if not records:
        raise D.DataError(f"{where} holds no prompt")
    return records


def check_sample_flags(cfg) -> list[str]:
    """The sampling flags and the prompts file, one line each, before any work (check_config calls this)."""
    errors = []
    if cfg.sample_tokens < 1:
        errors.append(f"--sample_tokens: must be >= 1, got {cfg.sample_tokens}")
    if not cfg.sample_prompts:
        return errors
    if cfg.eval_every == 0:
        errors.append("--sample_prompts: samples are taken at each evaluation, and --eval_every 0 never evaluates")
    try:
        read_prompts(cfg.sample_prompts)
        if cfg.data in ("sample", "") or os.path.exists(cfg.data):  # a missing --data has its own line
            tokenizer = run_data.run_tokenizer(cfg)
            if tokenizer is None:
                errors.append(f"--sample_prompts: no tokenizer to encode {cfg.sample_prompts} with: --data {cfg.data} "
                              f"is token ids without one (tools/prepare.py records it) and --init_from "
                              f"{cfg.init_from or '(not given)'} has no tokenizer.json")
            elif cfg.data != "sample" and not os.path.exists(tokenizer):
                errors.append(f"--sample_prompts: --data {cfg.data} was prepared with the tokenizer {tokenizer}, "
                              f"which does not exist here")
    except D.DataError as e:
        errors.append(str(e))
    return errors


def check_param_groups(cfg, mcfg: M.ModelConfig) -> list[str]:
    """--freeze and --lr_mult against the model's parameters (their Hugging Face names, hf_names): a bad
    pattern, one that matches nothing, a --freeze that splits a unit (units are frozen whole: one flat buffer has
    one gradient and one optimizer state) or freezes every unit. One line each."""
    if not (cfg.freeze or cfg.lr_mult):
        return []
    errors = []
    with torch.device("meta"):  # names only: allocates nothing (one model for both flags: 1 s at 70B)
        model = M.Llama(mcfg)
    if cfg.freeze:
        try:
            frozen, split = frozen_units(model, cfg.freeze)
        except re.error as e:
            return [f"--freeze: {cfg.freeze!r} is not a regular expression ({e})"]
        units = M.sharding_units(model)
        if split:
            names = dict(units)[split[0]]
            matched = [n for n in names if any(re.search(cfg.freeze, h) for h in hf_names(mcfg, n))]
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
            unmatched = lr_factors(model, cfg.lr_mult)[1]
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
    if "embed" in frozen_units(model, cfg.freeze)[0]:
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


def frozen_units(model: torch.nn.Module, freeze: str) -> tuple[list[str], list[str]]:
    """--freeze on `model` (a Llama, on the meta device or not): (the units frozen, the units the pattern splits).
    A unit is frozen when the regex matches (re.search) the Hugging Face name of every parameter in it; a unit
    where it matches some but not all is split (train.py refuses it: a unit is one flat buffer with one gradient
    and one optimizer state). With tied embeddings the head's weight is the embedding's, so `lm_head.weight`
    counts as a name of the embedding's parameter too."""
    if not freeze:
        return [], []
    pattern = re.compile(freeze)
    frozen, split = [], []
    for unit, names in M.sharding_units(model):
        matched = [any(pattern.search(h) for h in hf_names(model.cfg, n)) for n in names]
        if all(matched):
            frozen.append(unit)
        elif any(matched):
            split.append(unit)
    return frozen, split


def hf_names(cfg: M.ModelConfig, name: str) -> list[str]:
    """The Hugging Face names --freeze and --lr_mult match for our parameter `name`: with tied embeddings the
    embedding's weight is also the head's, `lm_head.weight`."""
    tied = cfg.tie_embeddings and name == "embed_tokens.weight"
    return [M.hf_name(name)] + (["lm_head.weight"] if tied else [])


def parse_lr_mult(spec: str) -> list[tuple[str, float]]:
    """--lr_mult 'REGEX=FACTOR,...' as [(regex, factor)], in order (a regex holds no ','). ValueError: one line
    naming --lr_mult."""
    rules = []
    for part in filter(None, spec.split(",")):
        regex, eq, factor = part.rpartition("=")
        try:
            rules.append((regex, float(factor)))
            re.compile(regex)
        except (ValueError, re.error) as e:
            raise ValueError(f"--lr_mult: {part!r} is not REGEX=FACTOR ({e})") from None
        if not eq or not regex or not rules[-1][1] >= 0:
            raise ValueError(f"--lr_mult: {part!r} is not REGEX=FACTOR with a regex and a factor >= 0")
    return rules


def lr_factors(model: torch.nn.Module, lr_mult: str) -> tuple[dict[str, float], list[str]]:
    """--lr_mult on `model` (a Llama): ({parameter name: its learning-rate factor}, the patterns that match no
    parameter). The first pattern that matches one of a parameter's Hugging Face names (hf_names) gives its
    factor; a parameter left out: 1."""
    rules = parse_lr_mult(lr_mult)
    if not rules:
        return {}, []
    factors, used = {}, set()
    for name, _ in model.named_parameters():
        rule = next((r for r in rules if any(re.search(r[0], h) for h in hf_names(model.cfg, name))), None)
        factors[name] = rule[1] if rule else 1.0
        used.add(rule)
    return factors, [regex for regex, factor in rules if (regex, factor) not in used]
