"""train.py's flags: one dataclass, TrainConfig, whose fields make the command line (parse_args). Presets are plain
functions in model.py; every flag's value is checked in checks.py before any work."""
import argparse
from dataclasses import dataclass, field, fields

import model as M
from components.checks import unknown_flag_message


def opt(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    model: str = opt("", f"preset: {', '.join(M.PRESETS)}; tiny when not given (ignored with --init_from a Hugging "
                         f"Face folder; with --init_from a checkpoint of ours, it must be that checkpoint's model)")
    init_from: str = opt("", "weights to start from: a Hugging Face Llama folder (config.json + *.safetensors), or one of "
                             "our checkpoints (a step_* folder, or an --out_dir: its latest) for a new phase: its "
                             "weights only, step 1, a fresh optimizer and data position, any world size")
    data: str = opt("sample", "a folder from data.py prepare, a 1-D .npy token file, or several weighted, "
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
    ValueError of one line; an unknown flag names the nearest one (checks.py)."""
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
