"""Full-parameter Llama fine-tuning with a hand-written FSDP full shard (ZeRO-3).

Read top to bottom; the sections follow the data:
  1. config      one dataclass; the command line is generated from its fields
  2. processes   torch.distributed set-up (NCCL on GPUs, gloo on CPU, also W=1 without torchrun)
  3. shard       each sharding unit's parameters as one flat fp32 tensor split W ways
  4. init        materialise one unit at a time: seeded init, or sliced reads of a Hugging Face folder
  5. step        gather -> compute -> free, forward and backward; reduce-scatter; AdamW on the slices;
                 evaluation
  6. checkpoints each rank its slices, rank 0 commits atomically; resume at any world size
  7. export      a Hugging Face folder written one unit at a time
  8. loop        data, logging (tokens/s/GPU, MFU, memory, ETA), the training loop

The data (tokenize, pack, the window order) is data.py; the planner (`--plan`: memory, speed and cost
predicted without a GPU) is plan.py.

Launch recipes (the flags are in TrainConfig below; `python train.py --help` lists them):

  one process, CPU or one GPU:
      python train.py --model tiny --steps 100
  one node, 8 GPUs:
      torchrun --standalone --nproc_per_node 8 train.py --model llama3-8b --init_from /models/Llama-3-8B ...
  two nodes x 8 GPUs (run on each node, NODE_RANK 0 and 1):
      torchrun --nnodes 2 --nproc_per_node 8 --node_rank $NODE_RANK --rdzv_backend c10d \\
          --rdzv_endpoint $MASTER_ADDR:29500 train.py --init_from /models/Llama-3-70B-Instruct ...
  SLURM (one task per node; launch.sh reads SLURM_* and calls torchrun):
      srun --nodes 2 --ntasks-per-node 1 ./launch.sh --init_from /models/Llama-3-70B-Instruct ...
  before any of these, what fits and what it costs (no GPU needed):
      python train.py --plan --model llama3-70b --nnodes 2 --nproc_per_node 8 --seq_len 8192 ...
"""

import argparse
import datetime
import hashlib
import json
import math
import os
import resource
import shutil
import signal
import sys
import time
import dataclasses
import fcntl
import socket
from dataclasses import asdict, dataclass, field, fields
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import data as D
import model as M


# ================================================================================================
# 1. Config
# ================================================================================================

def opt(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    model: str = opt("tiny", f"preset: {', '.join(M.PRESETS)} (ignored with --init_from)")
    init_from: str = opt("", "Hugging Face Llama folder (config.json + *.safetensors) to start from")
    data: str = opt("sample", "a folder from data.py prepare, a 1-D .npy token file, or 'sample' (the built-in "
                              "English + French corpus and tokenizer, built once under OUT_DIR/sample)")
    doc_mask: bool = opt(True, "packed documents do not attend to each other and RoPE restarts in each")
    eval_data: str = opt("auto", "held-out data like --data; 'auto': the sample's held-out part with --data "
                                 "sample, else none")
    eval_every: int = opt(50, "evaluate every N steps and at the end (0: never)")
    eval_batches: int = opt(4, "global batches of --eval_data per evaluation (the same ones every time)")
    seq_len: int = opt(256, "tokens per training sequence")
    batch_size: int = opt(16, "global batch in sequences = world size x micro_batch_size x accumulation")
    micro_batch_size: int = opt(4, "sequences per rank per forward/backward")
    steps: int = opt(200, "optimizer steps (0: no training, e.g. to convert --init_from to --export_hf)")
    lr: float = opt(1e-3, "peak learning rate")
    warmup_steps: int = opt(20, "linear warmup steps")
    schedule: str = opt("cosine", "after warmup: 'cosine' (to 10%% of --lr at --steps) or 'constant'")
    weight_decay: float = opt(0.1, "decoupled AdamW weight decay, on matrices only (not norms)")
    grad_clip: float = opt(1.0, "clip the global gradient L2 norm to this; 0 disables")
    dtype: str = opt("bfloat16", "compute dtype, 'bfloat16' or 'float32' (master weights and optimizer "
                                 "state are always fp32)")
    reduce_dtype: str = opt("float32", "dtype of the gradient reduce-scatter, 'float32' or 'bfloat16'")
    ac: str = opt("selective", "activation checkpointing per block: 'none', 'full' or 'selective'")
    offload_activations: bool = opt(False, "with --ac full: keep each block's input in pinned CPU memory until "
                                           "backward, instead of on the GPU")
    ce_chunk: int = opt(1024, "tokens per cross-entropy chunk: fp32 logits exist for this many tokens at a time")
    prefetch: bool = opt(True, "all-gather the next unit while the current one computes")
    seed: int = opt(0, "seed for the initial weights and the data order")
    out_dir: str = opt("out", "folder for metrics.jsonl and checkpoints/")
    ckpt_every: int = opt(0, "save a checkpoint every N steps (0: only at the end); always one at the end")
    keep_ckpts: int = opt(3, "keep the newest K checkpoints (at least 2)")
    resume: str = opt("auto", "'auto': continue from the newest intact checkpoint in --out_dir; 'never'")
    overwrite: bool = opt(False, "with --resume never: delete --out_dir's checkpoints and metrics first")
    from_ckpt: str = opt("", "a checkpoint folder to load instead of training (use with --export_hf)")
    max_skipped_steps: int = opt(0, "steps with a non-finite loss or gradient norm to skip before stopping")
    timeout_min: float = opt(10.0, "a collective waiting longer than this (a dead or hung rank) ends the run")
    ckpt_timeout_min: float = opt(60.0, "the same for the collectives around a checkpoint save or resume, which wait for "
                                        "every rank's file (12 B per parameter / W, 53 GB per rank for 70B on 16 GPUs)")
    gpu_hour_usd: float = opt(0.0, "price of one GPU-hour: the step line and metrics.jsonl add dollars")
    tensorboard: bool = opt(False, "also log to OUT_DIR/tensorboard (needs the tensorboard package)")
    plot: str = opt("", "only plot: write DIR/metrics.png from DIR/metrics.jsonl (needs matplotlib)")
    export_hf: str = opt("", "at the end, write a Hugging Face folder here")
    export_shard_gb: float = opt(5.0, "largest safetensors file of --export_hf, in GB")
    log_every: int = opt(1, "print a line every N steps (metrics.jsonl gets every step)")
    device: str = opt("auto", "'auto' (CUDA when available), 'cuda' or 'cpu'")
    # The planner (plan.py): memory, speed and cost per GPU predicted from the flags above, no GPU needed.
    plan: bool = opt(False, "only predict memory by part, fit, step time, tokens/s/GPU, MFU, hours, cost")
    nnodes: int = opt(1, "--plan: nodes")
    nproc_per_node: int = opt(8, "--plan: GPUs per node")
    gpu: str = opt("h100", "--plan: GPU type (see plan.py GPUS)")
    train_tokens: float = opt(0.0, "--plan: tokens to train on, for hours and cost (0: one epoch of nothing)")
    plan_json: str = opt("", "--plan: also write the prediction as JSON here")


def parse_args(argv=None) -> TrainConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(TrainConfig):
        kind = type(f.default)
        if kind is bool:  # --prefetch false / --prefetch true / --plan (alone: true)
            kind = lambda s: {"true": True, "1": True, "false": False, "0": False}[s.lower()]  # noqa: E731
            parser.add_argument(f"--{f.name}", type=kind, nargs="?", const=True, default=f.default,
                                help=f.metadata["help"])
            continue
        parser.add_argument(f"--{f.name}", type=kind, default=f.default, help=f.metadata["help"])
    return TrainConfig(**vars(parser.parse_args(argv)))


def check_config(cfg: TrainConfig, world: int) -> list[str]:
    """Every problem with the flags, as one line each, found before any process group exists."""
    errors = []
    choices = dict(schedule=("cosine", "constant"), dtype=("bfloat16", "float32"),
                   reduce_dtype=("float32", "bfloat16"), ac=("none", "full", "selective"),
                   device=("auto", "cuda", "cpu"), resume=("auto", "never"))
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            errors.append(f"--{name}: {getattr(cfg, name)!r} is not one of {', '.join(allowed)}")
    for name in ("seq_len", "batch_size", "micro_batch_size", "log_every"):
        if getattr(cfg, name) < 1:
            errors.append(f"--{name}: must be >= 1, got {getattr(cfg, name)}")
    if cfg.steps < 0:
        errors.append(f"--steps: must be >= 0 (0 only converts --init_from to --export_hf), got {cfg.steps}")
    trains = cfg.steps > 0 and not cfg.from_ckpt  # converting a checkpoint needs no batch and no data
    if trains and cfg.batch_size >= 1 and cfg.micro_batch_size >= 1 and cfg.batch_size % (world * cfg.micro_batch_size):
        errors.append(f"--batch_size: {cfg.batch_size} is not a multiple of world size x --micro_batch_size "
                      f"= {world} x {cfg.micro_batch_size} = {world * cfg.micro_batch_size}")
    if cfg.lr <= 0 or cfg.warmup_steps < 0 or cfg.weight_decay < 0 or cfg.grad_clip < 0:
        errors.append("--lr must be > 0 and --warmup_steps, --weight_decay, --grad_clip >= 0")
    if not cfg.init_from and cfg.model not in M.PRESETS:
        errors.append(f"--model: unknown preset {cfg.model!r}; known: {', '.join(M.PRESETS)}")
    if cfg.init_from and not os.path.isfile(os.path.join(cfg.init_from, "config.json")):
        errors.append(f"--init_from: {os.path.join(cfg.init_from, 'config.json')} does not exist")
    for name in ("data", "eval_data"):
        path = getattr(cfg, name)
        if trains and path not in ("sample", "auto", "") and not os.path.exists(path):
            errors.append(f"--{name}: {path} does not exist")
    if cfg.eval_data == "sample" and cfg.data != "sample":
        errors.append("--eval_data: 'sample' evaluates the built-in sample's tokens; use it with --data sample")
    if cfg.offload_activations and cfg.ac != "full":
        errors.append(f"--offload_activations: offloads what --ac full keeps (each block's input); got --ac {cfg.ac}")
    if cfg.eval_every < 0 or cfg.eval_batches < 1 or cfg.ce_chunk < 0:
        errors.append("--eval_every and --ce_chunk must be >= 0, --eval_batches >= 1")
    if cfg.max_skipped_steps < 0 or cfg.timeout_min <= 0 or cfg.gpu_hour_usd < 0:
        errors.append("--max_skipped_steps and --gpu_hour_usd must be >= 0, --timeout_min > 0")
    if cfg.ckpt_timeout_min <= 0:
        errors.append(f"--ckpt_timeout_min: must be > 0, got {cfg.ckpt_timeout_min}")
    if cfg.keep_ckpts < 2 or cfg.ckpt_every < 0:
        errors.append(f"--keep_ckpts must be >= 2 and --ckpt_every >= 0, got {cfg.keep_ckpts}, {cfg.ckpt_every}")
    if cfg.from_ckpt and not os.path.isfile(os.path.join(cfg.from_ckpt, "manifest.json")):
        errors.append(f"--from_ckpt: {os.path.join(cfg.from_ckpt, 'manifest.json')} does not exist")
    if cfg.from_ckpt and not cfg.export_hf:
        errors.append("--from_ckpt: give --export_hf DIR too (a checkpoint is loaded to be exported)")
    try:  # writable now, not after a day of training
        os.makedirs(cfg.out_dir, exist_ok=True)
        probe = os.path.join(cfg.out_dir, f".write-test-{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        errors.append(f"--out_dir: {cfg.out_dir} is not writable ({e.strerror})")
    used = [n for n in ("checkpoints", "metrics.jsonl") if os.path.exists(os.path.join(cfg.out_dir, n))]
    if trains and cfg.resume == "never" and used and not cfg.overwrite:
        errors.append(f"--out_dir: {cfg.out_dir} already holds {' and '.join(used)}; --resume auto continues "
                      f"from it, --overwrite true deletes them")
    if cfg.export_hf and os.path.isdir(cfg.export_hf) and os.listdir(cfg.export_hf):
        errors.append(f"--export_hf: {cfg.export_hf} exists and is not empty; remove it or choose another")
    return errors


def model_config(cfg: TrainConfig) -> M.ModelConfig:
    if cfg.from_ckpt:
        with open(os.path.join(cfg.from_ckpt, "manifest.json")) as f:
            return M.ModelConfig(**json.load(f)["model"])
    if cfg.init_from:
        with open(os.path.join(cfg.init_from, "config.json")) as f:
            return M.config_from_hf(json.load(f))
    return M.PRESETS[cfg.model]()


# ================================================================================================
# 2. Processes
# ================================================================================================

# The collectives of a checkpoint save wait for every rank's file, which can take longer than
# --timeout_min (53 GB per rank for 70B on 16 GPUs). They run in their own group: gloo, so on the CPU and
# outside NCCL's watchdog, with --ckpt_timeout_min. Made once per process group, by init_processes.
checkpoint_group = None


def init_processes(cfg: TrainConfig):
    """Returns (rank, world, device). Under torchrun RANK/WORLD_SIZE are set; plain `python train.py`
    gets a one-process group, so the code below never special-cases W = 1."""
    global checkpoint_group
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
    if not dist.is_initialized():  # else made by a caller that runs several trainings in one process (bench/)
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    if checkpoint_group is None:  # new_group is itself collective: every rank makes it here, in this order
        checkpoint_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=cfg.ckpt_timeout_min))
    return dist.get_rank(), dist.get_world_size(), device


# torch 2.13 renames the two collectives ZeRO-3 is made of; accept both names.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# One run per --out_dir, in a folder every rank sees. Rank 0 holds an exclusive lock on OUT_DIR/.lock for
# the whole run (the kernel drops it when the process dies, kill -9 included), and writes a random token
# into it that every rank must read back: a node-local --out_dir fails here, not at the first save.
out_dir_lock = None  # rank 0's open .lock file: closing it would release the lock


def claim_out_dir(out_dir: str, rank: int, world: int, device):
    global out_dir_lock
    if out_dir_lock is not None:  # a caller running several trainings in one process (bench/): the last one ended
        out_dir_lock.close()
        out_dir_lock = None
    path = os.path.join(out_dir, ".lock")
    token = torch.zeros((), dtype=torch.int64, device=device)  # stays 0 if rank 0 cannot take the lock
    if rank == 0:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            value = int.from_bytes(os.urandom(6), "little") + 1
            f.seek(0)
            f.truncate()
            f.write(f"{value} host {socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            f.flush()
            os.fsync(f.fileno())
            out_dir_lock = f
            token.fill_(value)
        except BlockingIOError:
            f.close()
    dist.broadcast(token, src=0)
    try:
        with open(path) as f:
            token_seen, _, holder = f.read().strip().partition(" ")
    except OSError:
        token_seen, holder = "", ""
    if token.item() == 0:
        fail(f"--out_dir: {out_dir} is in use by another run ({holder}); wait for it to end or choose another --out_dir")
    seen_by_rank = torch.zeros(world, dtype=torch.int64, device=device)
    all_gather_flat(seen_by_rank, torch.tensor([int(token_seen == str(token.item()))], device=device))
    blind = [r for r, seen in enumerate(seen_by_rank.tolist()) if not seen]
    if blind:
        fail(f"--out_dir: {out_dir} is not one folder for all ranks: rank(s) {', '.join(map(str, blind))} do not see "
             f"the {path} that rank 0 wrote; use a folder on a filesystem every node mounts")
    if rank == 0:  # the lock holder clears what crashed saves left behind
        root = os.path.join(out_dir, "checkpoints")
        for name in os.listdir(root) if os.path.isdir(root) else []:
            if name.startswith(".tmp-step_"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# ================================================================================================
# 3. Shard: one flat fp32 tensor per unit, split W ways
# ================================================================================================
#
# Sharding units: the embedding, each decoder block, and the head (final norm + lm_head). A block is
# the natural unit: it is the piece of compute a gathered buffer is alive for, and all blocks have
# the same size, so the buffers in flight are bounded by two blocks. The embedding and the head are
# separate units because they are the two largest tensors (128K x 8192 each for 70B) and are used at
# opposite ends of the step. With tied embeddings the head has only the norm and borrows the
# embedding unit's weight, which the head's backward gathers again.
#
# Per parameter, persistent and split W ways: fp32 master + AdamW m + v + fp32 gradient = 16 B / W.
# Transient: the compute-dtype gathered buffer of the unit(s) running and the one being prefetched.

class Unit:
    """A sharding unit: its parameters' places in a flat buffer, this rank's slices, and the gathered
    buffer whose views the modules use while the unit runs."""

    def __init__(self, name, model, param_names, rank, world, device, compute_dtype, reduce_dtype, reduces_in_flight):
        self.name = name
        self.slots = []  # (module, attribute, full name, shape, offset in the flat buffer)
        offset = 0
        for full_name in param_names:
            module_path, _, attr = full_name.rpartition(".")
            module = model.get_submodule(module_path)
            shape = tuple(getattr(module, attr).shape)
            self.slots.append((module, attr, full_name, shape, offset))
            offset += math.prod(shape)
            # The module keeps no parameter of its own: between uses the attribute is a view of a
            # freed buffer, so nothing of the full model survives outside the gathered unit.
            delattr(module, attr)
        self.numel = offset
        # Pad to a multiple of W: all_gather_into_tensor / reduce_scatter_tensor need equal slices.
        # The padding is never viewed by a module, so its gradient is exactly zero and it stays zero.
        self.padded_numel = -(-offset // world) * world
        self.shard_numel = self.padded_numel // world
        self.shard_start = rank * self.shard_numel  # this rank's slice of the flat buffer

        f32 = dict(dtype=torch.float32, device=device)
        self.master_shard = torch.zeros(self.shard_numel, **f32)
        self.exp_avg = torch.zeros(self.shard_numel, **f32)
        self.exp_avg_sq = torch.zeros(self.shard_numel, **f32)
        self.grad_shard = torch.zeros(self.shard_numel, **f32)
        self.reduce_dtype = reduce_dtype
        # Weight decay goes on matrices only (norm weights are 1-D): slices of this rank's shard.
        self.decay_ranges = []
        for _, _, _, shape, off in self.slots:
            lo, hi = max(off, self.shard_start), min(off + math.prod(shape), self.shard_start + self.shard_numel)
            if len(shape) >= 2 and lo < hi:
                self.decay_ranges.append((lo - self.shard_start, hi - self.shard_start))

        # The gathered buffer: a leaf tensor of the full padded size in the compute dtype, whose storage
        # is allocated only while the unit is gathered (storage resized to 0 in between, tensor
        # metadata kept). Autograd accumulates the unit's whole gradient into gathered.grad, one flat
        # tensor, and the hook below fires once that gradient is complete.
        self.gathered = torch.empty(self.padded_numel, dtype=compute_dtype, device=device, requires_grad=True)
        self._storage_bytes = self.gathered.untyped_storage().nbytes()
        self.gathered.untyped_storage().resize_(0)
        self.gathered.register_post_accumulate_grad_hook(self._reduce_scatter_grad)
        self._gather_work = None     # in-flight all-gather
        self._send = None            # its input, kept alive until it completes
        self.reduces_in_flight = reduces_in_flight  # shared by all units, see _reduce_scatter_grad

    # -- gather / free ---------------------------------------------------------------------------
    def is_gathered(self) -> bool:
        return self.gathered.untyped_storage().nbytes() > 0

    def start_gather(self):
        """Launches the all-gather of this unit into its buffer; returns at once (async)."""
        if self.is_gathered():
            return
        self.gathered.untyped_storage().resize_(self._storage_bytes)
        self._send = self.master_shard.to(self.gathered.dtype)  # bf16 over the wire: half the bytes
        # `.data` writes into the same storage without bumping autograd's version counter: the views
        # saved for backward are then valid again once the buffer is refilled before the unit's backward.
        self._gather_work = all_gather_flat(self.gathered.data, self._send, async_op=True)

    def wait_gather(self):
        if not self.is_gathered():
            self.start_gather()
        if self._gather_work is not None:
            self._gather_work.wait()
            self._gather_work, self._send = None, None

    def free(self):
        """Releases the gathered buffer. Tensors autograd saved still point at its storage; backward
        refills that same storage before it reads them."""
        assert self._gather_work is None, f"{self.name}: freed while its all-gather is in flight"
        self.gathered.untyped_storage().resize_(0)

    def set_views(self):
        """Points each module attribute at its piece of the gathered buffer. Called in forward with
        autograd on, so gradients flow from every use back into `gathered.grad`. One split, not a slice
        per parameter: a slice's backward pads its gradient with zeros to the whole unit, so a unit of
        n parameters would briefly hold ~3 units of gradient; split's backward concatenates once (2)."""
        sizes = [math.prod(shape) for _, _, _, shape, _ in self.slots]
        pieces = torch.split(self.gathered, sizes + [self.padded_numel - self.numel])
        for (module, attr, _, shape, _), piece in zip(self.slots, pieces):
            setattr(module, attr, piece.view(shape))

    # -- gradients ---------------------------------------------------------------------------------
    def _reduce_scatter_grad(self, gathered):
        """Autograd hook: this micro-batch's gradient of the whole unit is in gathered.grad. Sum it over
        ranks into each rank's slice (reduce-scatter) and drop the full gradient. In fp32 by default:
        summing W bf16 gradients in bf16 would round away small contributions.
        Asynchronous, so the previous unit's backward overlaps it, but at most MAX_REDUCES_IN_FLIGHT at a
        time: each holds a full-unit gradient, and an unbounded queue would hold the whole model's.
        The oldest one is waited for *before* the cast, not after the launch: otherwise its gradient, this
        one in the compute dtype and its copy in the reduce dtype would be alive together (3 units where
        plan.reduce_hook_bytes counts 2). On GPUs this costs no overlap: NCCL runs a group's collectives
        one after another on one stream, so the new reduce-scatter could not start before the old one
        ends anyway, and the next unit's backward waited for the old one already (after the launch)."""
        finish_reduces(self.reduces_in_flight, keep=MAX_REDUCES_IN_FLIGHT - 1)
        grad = gathered.grad.to(self.reduce_dtype)  # the same tensor, no copy, when the dtypes match
        gathered.grad = None
        out = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=grad.device)
        work = reduce_scatter_flat(out, grad, op=dist.ReduceOp.SUM, async_op=True)
        self.reduces_in_flight.append((self, work, out, grad))

    def persistent_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.master_shard, self.exp_avg, self.exp_avg_sq, self.grad_shard))


MAX_REDUCES_IN_FLIGHT = 1  # full-unit gradients in --reduce_dtype left reducing while the next unit's backward runs


def finish_reduces(reduces_in_flight: list, keep: int = 0):
    """Waits for the oldest reduce-scatters until `keep` remain; adds each result into its unit's slice
    (accumulation over micro-batches, always fp32) and lets its full-unit gradient go."""
    while len(reduces_in_flight) > keep:
        unit, work, out, _ = reduces_in_flight.pop(0)
        work.wait()
        unit.grad_shard.add_(out)


def build_units(model: M.Llama, rank, world, device, compute_dtype, reduce_dtype) -> list[Unit]:
    """embed, layers.0 .. layers.{L-1}, head -- in the order they run."""
    names = [n for n, _ in model.named_parameters()]
    groups = [("embed", ["embed_tokens.weight"])]
    groups += [(f"layers.{i}", [n for n in names if n.startswith(f"layers.{i}.")]) for i in range(len(model.layers))]
    groups += [("head", [n for n in names if n.startswith(("norm.", "lm_head."))])]
    reduces_in_flight = []
    return [Unit(g, model, p, rank, world, device, compute_dtype, reduce_dtype, reduces_in_flight) for g, p in groups]


# ================================================================================================
# 4. Init: one unit at a time, never the whole model
# ================================================================================================

def init_unit_random(unit: Unit, index: int, seed: int, std: float):
    """HF's init (normal(0, std) matrices, ones for norms) on the unit's full shape from the unit's own
    generator, then keep this rank's slice: the same weights for every W."""
    gen = torch.Generator(device=unit.master_shard.device).manual_seed(seed * 100003 + index)
    full = torch.zeros(unit.padded_numel, dtype=torch.float32, device=unit.master_shard.device)
    for _, _, _, shape, offset in unit.slots:
        piece = full[offset:offset + math.prod(shape)]
        piece.fill_(1.0) if len(shape) == 1 else piece.normal_(0.0, std, generator=gen)
    unit.master_shard.copy_(full[unit.shard_start:unit.shard_start + unit.shard_numel])


def hf_file_of_tensors(folder: str) -> dict:
    """{HF tensor name: safetensors file}, from the headers of the files themselves (only the headers are
    read): the index only says which files there are, so a file that lacks what the index promises shows
    as a missing tensor, and a damaged file is found here, before any process group exists."""
    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                paths = sorted({os.path.join(folder, v) for v in json.load(f)["weight_map"].values()})
        except (ValueError, KeyError, AttributeError) as e:
            raise ValueError(f"--init_from: {index} is not a safetensors index ({e!r}); download it again") from None
    elif os.path.isfile(single):
        paths = [single]
    else:
        raise FileNotFoundError(f"--init_from: neither model.safetensors nor model.safetensors.index.json in {folder}")
    files = {}
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--init_from: {path} is named in {index} but does not exist")
        files.update({name: path for name in hf_tensor_names(path)})
    return files


def hf_tensor_names(path: str) -> list[str]:
    """The names in one safetensors file's header. safe_open checks that the header covers the whole
    file, so a truncated download, or an HTML error page saved under the name, fails here as one line."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except SafetensorError as e:
        raise ValueError(f"--init_from: {path} is not a readable safetensors file ({e}); download it again") from None


def check_hf_tensors(files: dict, mcfg: M.ModelConfig, folder: str):
    """The files must hold exactly the parameters of the Llama that config.json describes. A tensor the
    model lacks (a Qwen2 q_proj.bias, an old conversion's rotary inv_freq, an lm_head.weight beside tied
    embeddings) is refused, never dropped: each is a sign the weights are not that model's."""
    with torch.device("meta"):  # names only: allocates nothing
        expected = {hf_name(name) for name, _ in M.Llama(mcfg).named_parameters()}
    missing, unexpected = sorted(expected - files.keys()), sorted(files.keys() - expected)
    if missing:
        raise ValueError(f"--init_from: tensor {missing[0]}{more(missing)} is missing from the safetensors files "
                         f"in {folder}")
    if unexpected:
        hint = ""
        if "lm_head.weight" in unexpected and mcfg.tie_embeddings:
            hint = "; config.json has tie_word_embeddings true: set it false if lm_head.weight is the model's own"
        raise ValueError(f"--init_from: {files[unexpected[0]]} holds {unexpected[0]}{more(unexpected)}, which the "
                         f"Llama described by config.json does not have: this is not a plain Llama checkpoint{hint}")


def more(names: list) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else "model." + name


def load_unit_from_hf(unit: Unit, files: dict, open_files: dict):
    """Reads only this rank's slice of each parameter (safetensors reads slices without loading the
    tensor): at most one extra row on each side of the slice is read, then cut away."""
    from safetensors import safe_open
    lo_shard, hi_shard = unit.shard_start, unit.shard_start + unit.shard_numel
    for _, _, name, shape, offset in unit.slots:
        lo, hi = max(offset, lo_shard), min(offset + math.prod(shape), hi_shard)
        if lo >= hi:
            continue
        key = hf_name(name)
        if key not in files:
            raise KeyError(f"--init_from: tensor {key} is missing from the checkpoint")
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


# ================================================================================================
# 5. Step: the sharded forward/backward and AdamW on the slices
# ================================================================================================

class BackwardBoundary(torch.autograd.Function):
    """Identity between two stages. Its backward runs when the gradient w.r.t. this stage's output is
    complete, i.e. just after the next stage's backward and just before this stage's backward: the
    moment to free the next stage's buffers, gather this stage's, and prefetch the previous one's."""

    @staticmethod
    def forward(ctx, x, on_backward):
        ctx.on_backward = on_backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.on_backward()
        return grad, None


# Selective checkpointing: keep what is expensive to recompute (the matmuls' and attention's outputs),
# recompute what is cheap and memory-hungry (norms, RoPE, SiLU * up, residual adds, casts).
SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}
ATTENTION_FORWARD_OPS = {  # namespace: the attention kernels' forward ops, those this build has are kept
    "aten": ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"),
    "flash_attn": ("_flash_attn_forward",           # flash_attn_func: one sequence per row
                   "_flash_attn_varlen_forward"),   # flash_attn_varlen_func: packed documents
}
for _namespace, _names in ATTENTION_FORWARD_OPS.items():
    for _name in _names:
        if hasattr(getattr(torch.ops, _namespace), _name):
            SAVED_OPS.add(getattr(getattr(torch.ops, _namespace), _name).default)


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class OffloadedInput:
    """One block's input, kept in host memory for its backward, and its copy back to the device."""

    def __init__(self, host, previous):
        self.host = host
        self.previous = previous  # the input of the block that ran before, whose backward runs next
        self.device = None        # the copy back, once started
        self.ready = None         # CUDA: an event on the copy stream, recorded when that copy is done


class OffloadedCheckpoint(torch.autograd.Function):
    """--ac full with --offload_activations: like full checkpointing, but the block's input waits for
    backward in pinned CPU memory, so a 70B model's 80 block inputs (128 MiB each at seq 8192) leave
    the GPU. Forward runs without a graph; backward copies the input back, recomputes the block with
    autograd on and backpropagates through it (the gradients reach the unit's buffer as usual).

    On CUDA the copies run on a side stream, so they overlap the blocks' compute instead of adding to
    it: forward's copy to the host starts as the block starts computing; each block's backward first
    starts the copy back of the previous block's input (whose backward runs next), so only the last
    block of a micro-batch waits for its own. In backward at most two block inputs are on the GPU: this
    block's and the one arriving. On the CPU the same steps are plain copies."""

    latest = None        # the OffloadedInput of the latest forward: the next block's `previous`
    copy_streams = {}    # CUDA device -> its side stream for the copies

    @staticmethod
    def forward(ctx, x, run):
        ctx.run, ctx.device, ctx.saved = run, x.device, None
        if ctx.needs_input_grad[0]:  # a backward will come (evaluation runs under no_grad: none will)
            ctx.saved = OffloadedInput(OffloadedCheckpoint.to_host(x), previous=OffloadedCheckpoint.latest)
            OffloadedCheckpoint.latest = ctx.saved
        with torch.no_grad():
            return run(x)

    @staticmethod
    def backward(ctx, grad_out):
        saved, ctx.saved = ctx.saved, None
        if OffloadedCheckpoint.latest is saved:  # the last block: the next forward's first has no previous
            OffloadedCheckpoint.latest = None
        OffloadedCheckpoint.start_copy_back(saved, ctx.device)  # started by the next block's backward, but the last's
        if saved.previous is not None:  # prefetch: it arrives while this block recomputes and backpropagates
            OffloadedCheckpoint.start_copy_back(saved.previous, ctx.device)
            saved.previous = None
        x = OffloadedCheckpoint.wait_copy_back(saved, ctx.device).requires_grad_()
        with torch.enable_grad():
            out = ctx.run(x)
        torch.autograd.backward(out, grad_out)
        return x.grad, None

    @staticmethod
    def copy_stream(device):
        if device not in OffloadedCheckpoint.copy_streams:
            OffloadedCheckpoint.copy_streams[device] = torch.cuda.Stream(device)
        return OffloadedCheckpoint.copy_streams[device]

    @staticmethod
    def to_host(x):
        if not x.is_cuda:
            return x.detach().clone()
        host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)  # pinned: asynchronous copies
        stream = OffloadedCheckpoint.copy_stream(x.device)
        stream.wait_stream(torch.cuda.current_stream(x.device))  # x is written by the compute queued so far
        with torch.cuda.stream(stream):
            host.copy_(x, non_blocking=True)
        x.record_stream(stream)  # the allocator keeps x's memory until the copy has read it
        return host

    @staticmethod
    def start_copy_back(saved, device):
        """Launches the copy of `saved` back to `device`, unless it is started already."""
        if saved.device is not None:
            return
        if device.type != "cuda":
            saved.device, saved.host = saved.host.to(device), None
            return
        stream = OffloadedCheckpoint.copy_stream(device)
        saved.device = torch.empty(saved.host.shape, dtype=saved.host.dtype, device=device)  # for the compute stream
        stream.wait_stream(torch.cuda.current_stream(device))  # whatever used this memory before is done
        with torch.cuda.stream(stream):
            saved.device.copy_(saved.host, non_blocking=True)
            saved.ready = torch.cuda.Event()
            saved.ready.record(stream)
        saved.device.record_stream(stream)  # not reused before the copy is done, even if never waited for
        saved.host = None  # the pinned allocator keeps this memory until the copy is done

    @staticmethod
    def wait_copy_back(saved, device):
        """The input on the device; the compute stream waits for its copy (not the host)."""
        if saved.ready is not None:
            torch.cuda.current_stream(device).wait_event(saved.ready)
        return saved.device


def run_block(block, ac: str, x, cos, sin, layout, offload: bool = False):
    if offload:
        return OffloadedCheckpoint.apply(x, lambda h: block(h, cos, sin, layout))
    if ac == "none":
        return block(x, cos, sin, layout)
    if ac == "full":  # save only the block's input; recompute the whole block in backward
        return checkpoint(block, x, cos, sin, layout, use_reentrant=False)
    return checkpoint(block, x, cos, sin, layout, use_reentrant=False,
                      context_fn=partial(create_selective_checkpoint_contexts, _selective_policy))


def make_stages(model: M.Llama, units: list[Unit], ac: str, ce_chunk: int, offload: bool = False):
    """The forward as a list of (function, units it needs in forward, units it needs in backward).
    The embedding's backward only needs the token ids, so it is not gathered again for backward."""
    embed, blocks, head = units[0], units[1:-1], units[-1]
    head_units = [head, embed] if model.cfg.tie_embeddings else [head]
    stages = [(lambda x, ctx: model.embed(x), [embed], [])]
    for i, unit in enumerate(blocks):
        stages.append((lambda x, ctx, i=i: run_block(model.layers[i], ac, x, ctx["cos"], ctx["sin"], ctx["layout"], offload),
                       [unit], [unit]))
    stages.append((lambda x, ctx: model.head_loss(x, ctx["targets"], ce_chunk) / ctx["n_tokens"], head_units, head_units))
    return stages


def _on_backward(stages, k, prefetch):
    """Backward has finished stage k + 1 and is about to run stage k."""
    if k + 1 < len(stages):
        for unit in stages[k + 1][2]:
            unit.free()
    for unit in stages[k][2]:
        unit.wait_gather()
    if prefetch and k > 0:
        for unit in stages[k - 1][2]:
            unit.start_gather()


def sharded_loss(stages, tokens, ctx, prefetch: bool):
    """Forward through all stages, each gathered just before it runs and freed right after, and each
    wrapped so that its backward gathers it again. Returns this rank's loss (already divided by the
    global token count). The last stage stays gathered: its backward starts right away."""
    x = tokens
    for k, (run, fwd_units, _) in enumerate(stages):
        for unit in fwd_units:
            unit.wait_gather()
            unit.set_views()
        if prefetch and k + 1 < len(stages):  # the next unit's all-gather overlaps this unit's compute
            for unit in stages[k + 1][1]:
                unit.start_gather()
        x = run(x, ctx)
        if k + 1 < len(stages):
            for unit in fwd_units:
                unit.free()
        x = BackwardBoundary.apply(x, partial(_on_backward, stages, k, prefetch))
    return x


def global_grad_norm(units: list[Unit]) -> torch.Tensor:
    """L2 norm over all ranks' slices: local sum of squares, one all-reduce of one scalar. The padding's
    gradient is exactly zero, so it adds nothing."""
    sq = torch.stack([torch.linalg.vector_norm(u.grad_shard) for u in units]).square().sum()
    dist.all_reduce(sq)
    return sq.sqrt()


BETA1, BETA2, EPS = 0.9, 0.95, 1e-8


def adamw_step_reference(units: list[Unit], cfg: TrainConfig, lr: float, step: int, grad_scale: float):
    """torch.optim.AdamW's update, term for term, on this rank's slices (step is 1-based). The readable
    version of adamw_step below; tests/test_sharding.py holds the two equal."""
    bias_correction1, bias_correction2 = 1 - BETA1 ** step, 1 - BETA2 ** step
    for u in units:
        grad = u.grad_shard.mul_(grad_scale) if grad_scale != 1.0 else u.grad_shard
        for lo, hi in u.decay_ranges:  # decoupled decay, before the Adam update, as torch does
            u.master_shard[lo:hi].mul_(1 - lr * cfg.weight_decay)
        u.exp_avg.lerp_(grad, 1 - BETA1)
        u.exp_avg_sq.mul_(BETA2).addcmul_(grad, grad, value=1 - BETA2)
        denom = (u.exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(EPS)
        u.master_shard.addcdiv_(u.exp_avg, denom, value=-lr / bias_correction1)
        u.grad_shard.zero_()


def adamw_step(units: list[Unit], cfg: TrainConfig, lr: float, step: int, grad_scale: float):
    """The same update in one pass over the four slices: PyTorch's fused AdamW kernel (what
    torch.optim.AdamW(fused=True) runs), instead of the reference's seven passes and two temporaries.
    Decay stays outside it because it applies to matrices only, not to whole slices."""
    for u in units:
        if grad_scale != 1.0:
            u.grad_shard.mul_(grad_scale)
        for lo, hi in u.decay_ranges:
            u.master_shard[lo:hi].mul_(1 - lr * cfg.weight_decay)
    step_tensor = torch.full((), float(step), device=units[0].master_shard.device)  # bias corrections use it
    torch._fused_adamw_([u.master_shard for u in units], [u.grad_shard for u in units], [u.exp_avg for u in units],
                        [u.exp_avg_sq for u in units], [], [step_tensor] * len(units), lr=lr, beta1=BETA1,
                        beta2=BETA2, weight_decay=0.0, eps=EPS, amsgrad=False, maximize=False)
    for u in units:
        u.grad_shard.zero_()


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup to --lr, then cosine to 10% of --lr at --steps (or constant). step is 1-based."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    min_lr = 0.1 * cfg.lr
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1 + math.cos(math.pi * progress))


def batch_context(cfg, mcfg, windows, inputs, targets, device, dtype, n_tokens) -> dict:
    """What every stage of one micro-batch needs besides its input: RoPE's cos/sin at each token's
    position, the document layout (a new document starts after each EOS), the targets. Decided and
    built on the host from the numpy arrays, then copied without waiting (M.to_device): nothing here
    makes the host wait for the GPU, so it can queue this micro-batch while the last one still runs."""
    eos_id = windows.data.eos_id if windows.data.eos_id is not None else mcfg.eos_id
    layout = None
    if cfg.doc_mask:
        starts = M.document_starts(inputs, eos_id)
        if starts[:, 1:].any():  # one document per row: plain causal attention is the same and faster
            layout = M.document_layout(starts, M.uses_flash(device, dtype), device, dtype)
    tokens = M.to_device(inputs, device)
    positions = layout["positions"] if layout else torch.arange(tokens.shape[1], device=device).expand_as(tokens)
    cos, sin = M.rope_cos_sin(mcfg, positions, dtype)
    return dict(tokens=tokens, cos=cos, sin=sin, layout=layout, targets=M.to_device(targets, device),
                n_tokens=n_tokens)


def forward_backward(cfg, units, stages, windows, step, position, rank, world, device, mcfg):
    """All micro-batches of optimizer step `step` (0-based): gradients summed into each unit's
    grad_shard. Returns the global batch's mean loss (identical on every rank) and whether this rank's
    own part of it was finite."""
    accum = cfg.batch_size // (world * cfg.micro_batch_size)
    batches = [windows.micro_batch(position, j, rank, world, cfg.micro_batch_size) for j in range(accum)]
    # The loss is the mean over every target token of the global batch, so each rank divides its summed
    # loss by the global count -- not by the number of micro-batches, which would make results depend on W.
    n_tokens = M.to_device(np.array(sum((t != -100).sum() for _, t in batches), dtype=np.float32), device)
    dist.all_reduce(n_tokens)
    loss_sum = torch.zeros((), device=device)
    for inputs, targets in batches:
        ctx = batch_context(cfg, mcfg, windows, inputs, targets, device, units[0].gathered.dtype, n_tokens)
        loss = sharded_loss(stages, ctx["tokens"], ctx, cfg.prefetch)
        if fault_planned("nan", step + 1, rank):  # as an overflow would: NaN loss and gradients
            loss = loss * float("nan")
        loss.backward()
        finish_reduces(units[0].reduces_in_flight)
        inject_fault("kill_mid_step", step + 1, rank)
        time.sleep(fault_seconds("hang", step + 1, rank, default=3600))  # a stuck rank: its peers' collectives time out
        loss_sum += loss.detach().float()
    local_finite = torch.isfinite(loss_sum)  # read only if the step goes bad: reading it waits for the GPU
    dist.all_reduce(loss_sum)
    return loss_sum, local_finite


class NonFiniteStep(Exception):
    pass


def train_step(cfg, units, stages, windows, step, position, rank, world, device, mcfg):
    """One optimizer step (0-based `step`): accumulate, clip, AdamW. Returns (loss, grad_norm) floats.
    A non-finite loss or gradient norm (both already summed over ranks, so every rank sees the same
    value and takes the same branch) skips the update: the weights and AdamW state stay as they were."""
    loss, local_finite = forward_backward(cfg, units, stages, windows, step, position, rank, world, device, mcfg)
    grad_norm = global_grad_norm(units)
    # The step's one host sync: the clip factor and the skip decision need both numbers on the host.
    loss, grad_norm = torch.stack([loss.float(), grad_norm.float()]).tolist()
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        for u in units:
            u.grad_shard.zero_()
        finite_by_rank = torch.zeros(world, device=device)
        all_gather_flat(finite_by_rank, local_finite.float().reshape(1))
        bad = [r for r, ok in enumerate(finite_by_rank.tolist()) if not ok]
        where = f" (from rank {', '.join(map(str, bad))})" if bad else ""
        raise NonFiniteStep(f"step {step + 1}: loss {loss}, grad_norm {grad_norm}{where}; "
                            f"the optimizer step was skipped")
    scale = 1.0
    if cfg.grad_clip > 0:  # as torch.nn.utils.clip_grad_norm_: multiply by min(1, clip / (norm + 1e-6))
        scale = min(1.0, cfg.grad_clip / (grad_norm + 1e-6))
    adamw_step(units, cfg, lr_at(cfg, step + 1), step + 1, scale)
    return loss, grad_norm


def evaluate(cfg, units, stages, eval_windows, rank, world, device, mcfg) -> float:
    """Mean loss over the first --eval_batches global batches of the held-out data's first epoch: a
    seeded sample of its windows, the same every time. The same gathers as training's forward, no backward."""
    loss_sum, n_tokens = torch.zeros((), device=device), torch.zeros((), device=device)
    accum = cfg.batch_size // (world * cfg.micro_batch_size)
    with torch.no_grad():
        for i in range(cfg.eval_batches):
            for j in range(accum):
                inputs, targets = eval_windows.micro_batch(i * cfg.batch_size, j, rank, world, cfg.micro_batch_size)
                ctx = batch_context(cfg, mcfg, eval_windows, inputs, targets, device, units[0].gathered.dtype, 1.0)
                loss_sum += sharded_loss(stages, ctx["tokens"], ctx, cfg.prefetch).float()
                for unit in stages[-1][1]:  # training keeps the head gathered for its backward; no backward here
                    unit.free()
                n_tokens += (ctx["targets"] != -100).sum()
    dist.all_reduce(loss_sum)
    dist.all_reduce(n_tokens)
    return (loss_sum / n_tokens).item()


# ================================================================================================
# 6. Checkpoints: each rank writes its slices; rank 0 commits atomically; resume re-slices for any W
# ================================================================================================
#
# out_dir/checkpoints/step_00000100/manifest.json            step, configs, world size, file checksums
#                                  /rank00000-of-00016.safetensors  that rank's master, exp_avg, exp_avg_sq
# out_dir/checkpoints/latest                                 "step_00000100", replaced atomically
# out_dir/checkpoints/.tmp-step_00000200/                    a save in progress: never loaded
#
# 12 bytes per parameter / W per rank (gradients are zero at a step boundary and not saved). Only
# safetensors and JSON are read back: nothing is ever unpickled. The training step draws no random
# numbers (no dropout; the data order is a function of seed, epoch and step), so there is no RNG state
# to keep: the step number is the data loader's whole state.

CKPT_FORMAT = "llama-zero3-checkpoint/1"
RESUME_MUST_MATCH = ("seq_len", "seed")  # the windows and their order depend on these


class CheckpointError(Exception):
    """A checkpoint that must not be used; the message names the folder and the problem."""


def rank_file(rank: int, world: int) -> str:
    return f"rank{rank:05d}-of-{world:05d}.safetensors"


def write_safetensors_streaming(path: str, tensors: list) -> tuple[str, int]:
    """Writes [(name, 1-D fp32 tensor)] in the safetensors format (u64 header length, JSON header,
    raw little-endian data), one tensor at a time, so host memory holds one tensor and not the rank's
    whole state; hashes the bytes as they are written. Returns (sha256, size)."""
    header, offset = {}, 0
    for name, t in tensors:
        header[name] = {"dtype": "F32", "shape": [t.numel()], "data_offsets": [offset, offset + 4 * t.numel()]}
        offset += 4 * t.numel()
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format aligns the data to 8 bytes
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (len(header_bytes).to_bytes(8, "little"), header_bytes):
            f.write(chunk)
            digest.update(chunk)
        for _, t in tensors:
            data = t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
            f.write(data)
            digest.update(data)
        f.flush()
        os.fsync(f.fileno())  # on disk before rank 0 may call the checkpoint complete
    return digest.hexdigest(), 8 + len(header_bytes) + offset


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def write_atomic(path: str, text: str):
    """Write beside, fsync, rename over: a reader sees the old file or the new one, never half of one."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def fsync_dir(path: str):
    """A rename is durable only once its folder is on disk: without this, a power loss right after a
    save can bring back the old name."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_manifest(cfg, mcfg, units, step, world, data_state, files) -> dict:
    return {"format": CKPT_FORMAT, "step": step, "world_size": world, "model": asdict(mcfg),
            "train": asdict(cfg), "files": files,
            "units": {u.name: {"numel": u.numel, "shard_numel": u.shard_numel} for u in units},
            "data": data_state}


def save_checkpoint(cfg, mcfg, units, step, rank, world, data_state):
    """Every rank writes its file into a temporary folder; rank 0 checks that every rank succeeded and
    every file has its size, writes the manifest, renames the folder to its final name and points
    `latest` at it. A failure anywhere leaves `latest` and the older checkpoints untouched."""
    root = os.path.join(cfg.out_dir, "checkpoints")
    name = f"step_{step:08d}"
    tmp, final = os.path.join(root, f".tmp-{name}"), os.path.join(root, name)
    group = checkpoint_group  # its own timeout: see init_processes
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier(group=group)
    # What each rank tells rank 0, as numbers (nothing crosses the wire pickled): written or not, the
    # file's size, its SHA-256 as 32 byte values. An error's text stays with the rank that met it.
    report, my_error = torch.zeros(34, dtype=torch.int64), ""
    try:
        tensors = [(f"{u.name}.{kind}", getattr(u, kind)) for u in units for kind in ("master_shard", "exp_avg", "exp_avg_sq")]
        sha256, nbytes = write_safetensors_streaming(os.path.join(tmp, rank_file(rank, world)), tensors)
        report[0], report[1], report[2:] = 1, nbytes, torch.tensor(list(bytes.fromhex(sha256)))
        inject_fault("kill_in_save", step, rank)
        time.sleep(fault_seconds("slow_save", step, rank))
    except OSError as e:
        report.zero_()
        my_error = f"rank {rank} could not write {os.path.join(tmp, rank_file(rank, world))}: {e.strerror or e}"
    reports = torch.zeros(world, 34, dtype=torch.int64)
    all_gather_flat(reports.view(-1), report, group=group)
    unwritten = [r for r in range(world) if not reports[r, 0]]
    saved = torch.zeros((), dtype=torch.int64)
    if rank == 0 and not unwritten:
        try:
            files = {rank_file(r, world): {"sha256": bytes(reports[r, 2:].tolist()).hex(), "bytes": int(reports[r, 1])}
                     for r in range(world)}
            for fname, expect in files.items():
                if os.path.getsize(os.path.join(tmp, fname)) != expect["bytes"]:
                    raise OSError(f"{fname} has the wrong size on disk")
            manifest = checkpoint_manifest(cfg, mcfg, units, step, world, data_state, files)
            write_atomic(os.path.join(tmp, "manifest.json"), json.dumps(manifest, indent=1))
            shutil.rmtree(final, ignore_errors=True)  # a re-save of a step (after a fallback)
            os.replace(tmp, final)
            fsync_dir(root)
            write_atomic(os.path.join(root, "latest"), name + "\n")
            saved.fill_(1)
        except OSError as e:
            my_error = f"rank 0 could not commit it: {e.strerror or e}" + (f" ({e.filename})" if e.filename else "")
    if rank == 0 and saved:
        remove_old_checkpoints(root, cfg.keep_ckpts, final)
    elif rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.broadcast(saved, src=0, group=group)
    if not saved:
        why = my_error or (f"rank(s) {', '.join(map(str, unwritten))} could not write their files" if unwritten
                           else "rank 0 could not commit it")
        raise CheckpointError(f"checkpoint {final} was not saved: {why}")
    return final


def list_checkpoints(root: str) -> list[str]:
    """Folders named step_*, newest first. Whether each is complete is for check_manifest to say."""
    if not os.path.isdir(root):
        return []
    names = sorted((n for n in os.listdir(root) if n.startswith("step_")), reverse=True)
    return [os.path.join(root, n) for n in names if os.path.isdir(os.path.join(root, n))]


def resume_candidates(root: str) -> list[str]:
    """The checkpoints resume tries, newest first, starting at the one `latest` names: editing `latest`
    to an older step_* rolls the run back to it (newer folders are then ignored, and overwritten as the
    run passes their steps again)."""
    paths = list_checkpoints(root)
    if not os.path.isfile(os.path.join(root, "latest")):
        return paths
    with open(os.path.join(root, "latest")) as f:
        latest = f.read().strip()
    if not os.path.isdir(os.path.join(root, latest)):
        raise CheckpointError(f"{os.path.join(root, 'latest')} names {latest!r}, which is not a folder in {root}; "
                              f"write the name of a step_* folder there, or delete it to use the newest")
    return [p for p in paths if os.path.basename(p) <= latest]  # zero-padded names sort as steps


def is_complete(path: str) -> bool:
    try:
        check_manifest(path, None, None, None)  # a readable manifest of this format
        return True
    except CheckpointError:
        return False


def remove_old_checkpoints(root: str, keep: int, just_saved: str):
    """Retention: keeps the checkpoint just saved and the newest complete ones, `keep` in all, and deletes
    older complete ones. Folders without a complete manifest (a damaged or foreign step_* folder) are
    neither counted nor deleted, so they can never push out the save just made. A failure here (an NFS
    .nfsXXXX file still open elsewhere) is a warning: the checkpoint itself is saved."""
    complete = [p for p in list_checkpoints(root) if p != just_saved and is_complete(p)]
    for old in complete[keep - 1:]:
        try:
            shutil.rmtree(old)
        except OSError as e:
            print(f"warning: retention could not delete {old}: {e.strerror or e}; it stays", file=sys.stderr, flush=True)


def check_manifest(path: str, cfg, mcfg, windows) -> dict:
    manifest_path = os.path.join(path, "manifest.json")
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"checkpoint {path}: no manifest.json (an unfinished save)")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: manifest.json is unreadable ({e})") from None
    if manifest.get("format") != CKPT_FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {manifest.get('format')!r}, expected {CKPT_FORMAT!r}")
    if mcfg is not None and manifest["model"] != asdict(mcfg):
        diff = [k for k, v in asdict(mcfg).items() if manifest["model"].get(k) != v]
        raise CheckpointError(f"checkpoint {path}: saved for another model (differs in {', '.join(diff)})")
    if cfg is not None:
        for key in RESUME_MUST_MATCH:
            if manifest["train"][key] != getattr(cfg, key):
                raise CheckpointError(f"checkpoint {path}: saved with --{key} {manifest['train'][key]}, "
                                      f"this run has {getattr(cfg, key)} (the data order would change)")
        if windows is not None and manifest["data"] is not None:
            try:
                windows.check_state(manifest["data"])
            except D.DataError as e:
                raise CheckpointError(f"checkpoint {path}: {e}") from None
    return manifest


def load_checkpoint(path: str, manifest: dict, units: list[Unit]):
    """Fills this rank's slices from the checkpoint, whatever world size saved it: the flat layout of a
    unit does not depend on W, so a new slice [a, b) is read from the old rank files that cover it.
    Each file read is checked against the manifest's size and SHA-256 first."""
    from safetensors import safe_open
    old_world = manifest["world_size"]
    for unit in units:
        saved = manifest["units"].get(unit.name)
        if saved is None or saved["numel"] != unit.numel:
            raise CheckpointError(f"checkpoint {path}: unit {unit.name} is missing or has another size")
    verified = set()
    for unit in units:
        old_shard = manifest["units"][unit.name]["shard_numel"]
        lo, hi = unit.shard_start, min(unit.shard_start + unit.shard_numel, unit.numel)
        for old_rank in range(lo // old_shard, -(-hi // old_shard)) if lo < hi else []:
            fname = rank_file(old_rank, old_world)
            fpath = os.path.join(path, fname)
            if fname not in verified:
                expect = manifest["files"].get(fname)
                if expect is None or not os.path.isfile(fpath):
                    raise CheckpointError(f"checkpoint {path}: {fname} is missing")
                if os.path.getsize(fpath) != expect["bytes"]:
                    raise CheckpointError(f"checkpoint {path}: {fname} has {os.path.getsize(fpath)} bytes, "
                                          f"the manifest says {expect['bytes']} (truncated?)")
                if sha256_file(fpath) != expect["sha256"]:
                    raise CheckpointError(f"checkpoint {path}: {fname} does not match its SHA-256 (damaged)")
                verified.add(fname)
            a, b = max(lo, old_rank * old_shard), min(hi, (old_rank + 1) * old_shard)
            with safe_open(fpath, framework="pt") as f:
                for kind in ("master_shard", "exp_avg", "exp_avg_sq"):
                    piece = f.get_slice(f"{unit.name}.{kind}")[a - old_rank * old_shard:b - old_rank * old_shard]
                    getattr(unit, kind)[a - unit.shard_start:b - unit.shard_start] = piece.to(unit.master_shard.device)


def resume(cfg, mcfg, units, windows, rank, candidates: list[str], fallback: bool) -> tuple[int, int]:
    """Loads the newest intact checkpoint among `candidates`; returns its step and data position. All ranks agree on each
    candidate (a damaged file seen by one rank rejects it for all), and with `fallback` an unusable
    checkpoint is reported and the previous one tried."""
    for path in candidates:
        error = ""
        try:
            manifest = check_manifest(path, cfg if fallback else None, mcfg, windows)
            load_checkpoint(path, manifest, units)
        except (CheckpointError, OSError, ValueError, KeyError) as e:
            error = str(e) if isinstance(e, CheckpointError) else f"checkpoint {path}: unreadable ({e})"
        # Every rank must agree: a flag per rank (reading 53 GB can outlast --timeout_min: the checkpoint group).
        failed_by_rank = torch.zeros(dist.get_world_size(), dtype=torch.int64)
        all_gather_flat(failed_by_rank, torch.tensor([int(bool(error))]), group=checkpoint_group)
        failed = [r for r, bad in enumerate(failed_by_rank.tolist()) if bad]
        if not failed:
            data = manifest["data"] or {"position": 0}  # a conversion run (--steps 0) saved no data state
            return manifest["step"], data["position"]
        if error:
            print(f"warning: {error}", file=sys.stderr, flush=True)
        if not fallback:
            raise CheckpointError(error or f"checkpoint {path}: rank(s) {', '.join(map(str, failed))} cannot use it")
        if rank == 0:
            print(f"warning: not using {path}; trying the previous checkpoint", file=sys.stderr, flush=True)
    raise CheckpointError(f"no intact checkpoint in {os.path.join(cfg.out_dir, 'checkpoints')}; "
                          f"--resume never --overwrite true starts over")


def fault_planned(kind: str, step: int, rank: int) -> bool:
    """Fault injection for the tests, from ZERO3_FAULT=KIND:STEP[:RANK[:SECONDS]] (every rank when RANK is
    left out or empty): kill_mid_step (SIGKILL in the middle of the step), kill_in_save (during that step's
    save), nan (this rank's loss becomes NaN), hang (this rank sleeps mid-step, SECONDS or an hour), and
    slow_save (that rank's checkpoint file of that step takes SECONDS longer to write). With ZERO3_FAULT_ONCE=FILE a
    fault fires once: FILE records that it did, so a restarted job runs clean. ZERO3_FAULT=slow:0.5 makes
    every step half a second slower."""
    spec = os.environ.get("ZERO3_FAULT", "").split(":")
    if spec[0] == "slow" and kind == "kill_mid_step":
        time.sleep(float(spec[1]))
    if spec[0] != kind or int(spec[1]) != step or (len(spec) > 2 and spec[2] and int(spec[2]) != rank):
        return False
    once = os.environ.get("ZERO3_FAULT_ONCE")
    if once:
        if os.path.exists(once):
            return False
        open(once, "w").close()
    return True


def inject_fault(kind: str, step: int, rank: int):
    if fault_planned(kind, step, rank):
        os.kill(os.getpid(), signal.SIGKILL)


def fault_seconds(kind: str, step: int, rank: int, default: float = 0.0) -> float:
    """The SECONDS of ZERO3_FAULT=KIND:STEP:RANK:SECONDS (`default` without them) when that fault is
    planned here, else 0."""
    if not fault_planned(kind, step, rank):
        return 0.0
    spec = os.environ["ZERO3_FAULT"].split(":")
    return float(spec[3]) if len(spec) > 3 else default


# ================================================================================================
# 7. Export: a Hugging Face folder, one unit at a time
# ================================================================================================

def gather_full_unit(unit: Unit) -> torch.Tensor:
    """The whole unit in fp32 on every rank (transient: one unit)."""
    full = torch.empty(unit.padded_numel, dtype=torch.float32, device=unit.master_shard.device)
    all_gather_flat(full, unit.master_shard)
    return full


def export_hf(units: list[Unit], mcfg: M.ModelConfig, out: str, dtype: torch.dtype, shard_gb: float, rank: int):
    """config.json + model*.safetensors (+ index when sharded), loadable by from_pretrained. Units are
    grouped into files of at most `shard_gb`; rank 0 holds at most one file's tensors at a time."""
    from safetensors.torch import save_file
    max_bytes = int(shard_gb * 1e9)
    bytes_per = torch.tensor([], dtype=dtype).element_size()
    files, size = [[]], 0
    for unit in units:  # plan the files first so each can be named "-0000i-of-0000n"
        if files[-1] and size + unit.numel * bytes_per > max_bytes:
            files.append([])
            size = 0
        files[-1].append(unit)
        size += unit.numel * bytes_per
    tmp = out.rstrip("/") + ".partial"
    if rank == 0:  # a fresh folder: a crashed export's model.safetensors must not sit beside a new index
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    weight_map, total_bytes = {}, 0
    for i, file_units in enumerate(files):
        fname = "model.safetensors" if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        tensors = {}
        for unit in file_units:
            full = gather_full_unit(unit)
            if rank == 0:
                for _, _, name, shape, offset in unit.slots:
                    tensors[hf_name(name)] = full[offset:offset + math.prod(shape)].view(shape).to(dtype).cpu().clone()
            del full
        if rank == 0:
            save_file(tensors, os.path.join(tmp, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in tensors})
            total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
    if rank == 0:
        if len(files) > 1:
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(M.config_to_hf(mcfg, dtype), f, indent=2)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": mcfg.bos_id, "eos_token_id": mcfg.eos_id}, f, indent=2)
        if os.path.isdir(out):
            os.rmdir(out)  # checked empty before training started
        os.replace(tmp, out)  # the folder appears complete or not at all
    dist.barrier()


# ================================================================================================
# 8. Loop: data, metrics, training
# ================================================================================================

# Dense BF16 peak FLOP/s by device name (no sparsity). Checked in order; None means unknown (CPU).
PEAK_BF16_FLOPS = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("GH200", 989e12),
                   ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12), ("A10G", 125e12)]


def peak_flops(device: torch.device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def flops_per_token(mcfg: M.ModelConfig, seq_len: int) -> float:
    """6 * (N - embedding) + 12 * L * d * T: weights' matmuls forward and backward, plus attention's
    QK^T and AV, causal mask not discounted (the PaLM / torchtitan convention)."""
    counts = M.count_params(mcfg)
    return 6 * (counts["total"] - counts["embedding"]) + 12 * mcfg.n_layers * mcfg.n_heads * mcfg.head_dim * seq_len


def reset_peak_mem(device: torch.device):
    """Called before each step, so mem_gb is that step's peak, not init's or an evaluation's. On CPU
    the process's peak resident memory cannot be reset: there mem_gb is the peak since start."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mem_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def fmt_time(seconds: float) -> str:
    seconds = int(seconds)
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def log_step(cfg, metrics: dict, f):
    f.write(json.dumps(metrics) + "\n")
    f.flush()
    s = metrics["step"]
    if s % cfg.log_every == 0 or s == cfg.steps or "eval_loss" in metrics:
        mfu = "n/a" if metrics["mfu"] is None else f"{100 * metrics['mfu']:.1f}%"
        loss = "skipped" if metrics["loss"] is None else f"{metrics['loss']:.4f}"
        grad_norm = "skipped" if metrics["grad_norm"] is None else f"{metrics['grad_norm']:.3f}"
        print(f"step {s}/{cfg.steps} | loss {loss} | lr {metrics['lr']:.2e} | "
              f"grad_norm {grad_norm} | {metrics['tokens_per_sec_per_gpu']:,.0f} tok/s/gpu | "
              f"mfu {mfu} | mem {metrics['mem_gb']:.2f} GB | elapsed {fmt_time(metrics['elapsed_s'])} | "
              f"eta {fmt_time(metrics['eta_s'])}" +
              (f" | ${metrics['cost_usd']:,.2f} of ${metrics['projected_cost_usd']:,.2f}" if "cost_usd" in metrics else "") +
              (f" | eval_loss {metrics['eval_loss']:.4f}" if "eval_loss" in metrics else ""),
              flush=True)


def fail(message: str):
    """One line, on every rank, and exit code 2: never a traceback wall or a hang. These errors come back
    on a restart (a bad flag, bad data, a non-finite loss), so launch.sh, which gives us ZERO3_FATAL_FILE,
    stops torchrun from restarting when the line appears there."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if os.environ.get("ZERO3_FATAL_FILE"):
        with open(os.environ["ZERO3_FATAL_FILE"], "a") as f:
            f.write(f"error: {message}\n")
    os._exit(2)  # no interpreter teardown (see the end of this file)


def setup(cfg: TrainConfig):
    """Everything before the first step: checks, processes, the model on meta, shards, init, data."""
    world_env = int(os.environ.get("WORLD_SIZE", 1))
    errors = check_config(cfg, world_env)
    mcfg = None
    if not errors:
        try:
            mcfg = model_config(cfg)
        except (KeyError, json.JSONDecodeError) as e:
            errors.append(f"--init_from: cannot read config.json: {e}")
        except ValueError as e:  # config.json describes a model this code does not build
            errors.append(f"--init_from: {e}")
    if mcfg is not None:
        errors += M.check_model_config(mcfg)
    hf_files = None
    if not errors and cfg.init_from and not cfg.from_ckpt:
        try:  # headers only, on every rank: a bad weight file is one line here, not a traceback at load
            hf_files = hf_file_of_tensors(cfg.init_from)
            check_hf_tensors(hf_files, mcfg, cfg.init_from)
        except (ValueError, FileNotFoundError) as e:
            errors.append(str(e))
    if errors:
        fail("; ".join(errors))

    windows = eval_windows = None
    if cfg.steps > 0 and not cfg.from_ckpt:
        mcfg, windows, eval_windows = open_data(cfg, mcfg)

    rank, world, device = init_processes(cfg)
    claim_out_dir(cfg.out_dir, rank, world, device)
    compute_dtype = getattr(torch, cfg.dtype)
    with torch.device("meta"):  # shapes only: construction allocates nothing
        model = M.Llama(mcfg)
    units = build_units(model, rank, world, device, compute_dtype, getattr(torch, cfg.reduce_dtype))
    ckpt_root = os.path.join(cfg.out_dir, "checkpoints")
    if cfg.resume == "never" and cfg.overwrite and rank == 0:
        shutil.rmtree(ckpt_root, ignore_errors=True)
        if os.path.exists(os.path.join(cfg.out_dir, "metrics.jsonl")):
            os.remove(os.path.join(cfg.out_dir, "metrics.jsonl"))
    dist.barrier()
    # A checkpoint wins over --init_from: re-running the same command continues the run.
    candidates = [cfg.from_ckpt] if cfg.from_ckpt else resume_candidates(ckpt_root) if cfg.resume == "auto" else []
    start_step = start_position = 0
    if candidates:
        start_step, start_position = resume(cfg, mcfg, units, windows, rank, candidates, fallback=not cfg.from_ckpt)
    elif cfg.init_from:
        open_files = {}
        for unit in units:
            load_unit_from_hf(unit, hf_files, open_files)
        open_files.clear()
    else:
        for i, unit in enumerate(units):
            init_unit_random(unit, i, cfg.seed, mcfg.init_std)
    return mcfg, model, units, windows, eval_windows, rank, world, device, start_step, start_position


def open_data(cfg: TrainConfig, mcfg: M.ModelConfig):
    """The training windows and the held-out ones (or None). A preset takes its vocabulary and BOS/EOS
    ids from the prepared data's tokenizer; a model from --init_from must match it."""
    data_path, eval_path = cfg.data, None if cfg.eval_data in ("auto", "") else cfg.eval_data
    if cfg.data == "sample":
        folder = os.path.join(cfg.out_dir, "sample")
        if not os.path.isfile(os.path.join(folder, "eval", "meta.json")) and os.environ.get("RANK", "0") == "0":
            print(f"building the built-in sample (corpus, tokenizer, shards) in {folder}", flush=True)
        D.build_sample(folder)
        data_path = os.path.join(folder, "train")
        if cfg.eval_data in ("auto", "sample"):
            eval_path = os.path.join(folder, "eval")
    data = D.TokenData(data_path, "--data")
    if data.meta and not cfg.init_from:
        mcfg = dataclasses.replace(mcfg, vocab_size=data.meta["vocab_size"], bos_id=data.meta["bos_id"],
                                   eos_id=data.meta["eos_id"])
    if data.meta and cfg.init_from and data.meta["tokenizer"]["kind"] == "huggingface":
        model_tokenizer = os.path.join(cfg.init_from, "tokenizer.json")
        if os.path.isfile(model_tokenizer) and D.Tokenizer(cfg.init_from).sha256 != data.meta["tokenizer"]["sha256"]:
            raise D.DataError(f"--data: {data_path} was tokenized with {data.meta['tokenizer']['path']}, whose "
                              f"tokenizer.json differs from {model_tokenizer}")
    data.check_vocab(mcfg.vocab_size, "--data")
    windows = D.TokenWindows(data, cfg.seq_len, cfg.seed, flag="--data")
    eval_windows = None
    if eval_path and cfg.eval_every:
        eval_data = D.TokenData(eval_path, "--eval_data")
        if data.meta and eval_data.meta and eval_data.meta["tokenizer"]["sha256"] != data.meta["tokenizer"]["sha256"]:
            raise D.DataError(f"--eval_data: {eval_path} was tokenized with another tokenizer than --data {data_path}")
        eval_data.check_vocab(mcfg.vocab_size, "--eval_data")
        eval_windows = D.TokenWindows(eval_data, cfg.seq_len, cfg.seed, flag="--eval_data")
    return mcfg, windows, eval_windows


def open_metrics(cfg, start_step: int):
    """metrics.jsonl, keeping the lines of the steps a resumed run has already done (and only those)."""
    path = os.path.join(cfg.out_dir, "metrics.jsonl")
    kept = []
    if start_step and os.path.isfile(path):
        with open(path) as f:
            rows = [(line, parse_metrics_line(line)) for line in f if line.strip()]
        kept = [line for line, row in rows if row is not None and row["step"] <= start_step]
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)
    elapsed_before = json.loads(kept[-1])["elapsed_s"] if kept else 0.0  # time spent before a restart
    return open(path, "a"), elapsed_before


def parse_metrics_line(line: str):
    """A metrics.jsonl row, or None for a line torn by a crash or a full disk (only ever the last one)."""
    try:
        return json.loads(line)
    except ValueError:
        print(f"warning: metrics.jsonl: dropping a torn line ({line.strip()[:60]!r})", file=sys.stderr, flush=True)
        return None


def plot_metrics(out_dir: str) -> str:
    """Loss (and eval loss), LR, tokens/s/GPU, MFU and memory against the step, as one PNG."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        fail("--plot needs matplotlib: pip install matplotlib")
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        fail(f"--plot: {path} does not exist")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    panels = [("loss", ["loss", "eval_loss"]), ("learning rate", ["lr"]),
              ("tokens/s/GPU", ["tokens_per_sec_per_gpu"]), ("MFU", ["mfu"]), ("peak memory (GB)", ["mem_gb"])]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.2 * len(panels)), sharex=True)
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), label=key, marker="." if len(points) < 50 else None)
            elif key == keys[0]:
                ax.text(0.5, 0.5, "not recorded (MFU needs a GPU with a known peak)" if key == "mfu"
                        else "not recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend()
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    png = os.path.join(out_dir, "metrics.png")
    fig.savefig(png, dpi=100)
    return png


def open_tensorboard(cfg):
    if not cfg.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        fail("--tensorboard needs the tensorboard package: pip install tensorboard")
    return SummaryWriter(os.path.join(cfg.out_dir, "tensorboard"))


def main(argv=None):
    cfg = parse_args(argv)
    if cfg.plot:
        print(f"wrote {plot_metrics(cfg.plot)}")
        return
    if cfg.plan:
        import plan
        plan.main(cfg)
        return
    owns_group = not dist.is_initialized()  # a caller's group (bench/) is the caller's to destroy
    try:
        mcfg, model, units, windows, eval_windows, rank, world, device, start_step, position = setup(cfg)
    except (D.DataError, KeyError, ValueError, FileNotFoundError, CheckpointError) as e:
        fail(str(e).strip("'\""))
    stages = make_stages(model, units, cfg.ac, cfg.ce_chunk, cfg.offload_activations)
    counts = M.count_params(mcfg)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    peak = peak_flops(device)
    steps = 0 if cfg.from_ckpt else cfg.steps
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        state_gib = sum(u.persistent_bytes() for u in units) / 2**30
        print(f"model {mcfg.n_layers}L d={mcfg.dim} {counts['total'] / 1e6:.1f}M params | world {world} on "
              f"{device.type} | {len(units)} units | persistent state {state_gib:.3f} GiB/rank | "
              f"batch {cfg.batch_size} x {cfg.seq_len} = {tokens_per_step:,} tokens/step | "
              f"accumulation {cfg.batch_size // (world * cfg.micro_batch_size)} | ac {cfg.ac} | {cfg.dtype} | "
              f"attention: {M.attention_kernel(device, getattr(torch, cfg.dtype), cfg.doc_mask)}", flush=True)
        if start_step:
            restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # torchrun's, on this node
            print(f"resumed from {os.path.join(cfg.out_dir, 'checkpoints', f'step_{start_step:08d}')} "
                  f"at step {start_step}" + (f" (torchrun restart {restarts} of "
                  f"{os.environ.get('TORCHELASTIC_MAX_RESTARTS')})" if restarts else ""), flush=True)
    metrics_file, elapsed_before = open_metrics(cfg, start_step) if rank == 0 and steps else (None, 0.0)
    tensorboard = open_tensorboard(cfg) if rank == 0 else None

    # Preemption: SIGUSR1 (what launch.sh forwards), SIGTERM (SLURM, torchrun) or SIGINT (Ctrl-C) means
    # "save and stop". Noted here; at the next step boundary all ranks agree through an all-reduce, save,
    # and exit 0, so a signal seen by one rank stops every rank. The same request often arrives several
    # times (the job's every process is signalled, and torchrun forwards it again): repeats are ignored,
    # so nothing interrupts the save.
    stop_signals = []
    def on_signal(sig, _frame):  # only a note: printing here could interrupt a print in progress
        stop_signals.append(sig)
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    start, stopped, skipped = time.perf_counter(), False, 0
    for step in range(start_step, steps):
        reset_peak_mem(device)
        t0 = time.perf_counter()
        done = step + 1
        try:
            loss, grad_norm = train_step(cfg, units, stages, windows, step, position, rank, world, device, mcfg)
        except NonFiniteStep as e:
            skipped += 1
            if skipped > cfg.max_skipped_steps:
                fail(f"{e}; stopping after {skipped} such step(s) (--max_skipped_steps {cfg.max_skipped_steps}); "
                     f"nothing from this step was saved")
            if rank == 0:
                print(f"warning: {e} ({skipped} of at most {cfg.max_skipped_steps})", file=sys.stderr, flush=True)
            loss = grad_norm = None  # null in metrics.jsonl
        position += cfg.batch_size  # windows consumed: the data loader's state
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        mem_gb = peak_mem_bytes(device) / 1e9  # before evaluation, which is not the step
        eval_loss = None
        if eval_windows is not None and (done % cfg.eval_every == 0 or done == steps):
            eval_loss = evaluate(cfg, units, stages, eval_windows, rank, world, device, mcfg)
        elapsed = elapsed_before + time.perf_counter() - start
        if rank == 0:
            tokens_per_sec_per_gpu = tokens_per_step / dt / world
            eta = (time.perf_counter() - start) / (done - start_step) * (steps - done)
            metrics = dict(
                step=done, loss=loss, lr=lr_at(cfg, done), grad_norm=grad_norm,
                tokens_per_sec_per_gpu=tokens_per_sec_per_gpu,
                mfu=None if peak is None else tokens_per_sec_per_gpu * flops_per_token(mcfg, cfg.seq_len) / peak,
                mem_gb=mem_gb, step_time_s=dt, elapsed_s=elapsed, eta_s=eta)
            if eval_loss is not None:
                metrics["eval_loss"] = eval_loss
            if cfg.gpu_hour_usd:  # GPU-hours so far (all restarts, downtime excluded) and at the end
                metrics["cost_usd"] = elapsed / 3600 * world * cfg.gpu_hour_usd
                metrics["projected_cost_usd"] = (elapsed + eta) / 3600 * world * cfg.gpu_hour_usd
            log_step(cfg, metrics, metrics_file)
            for key, value in metrics.items() if tensorboard else ():
                if key != "step" and value is not None:
                    tensorboard.add_scalar(key, value, done)
        stop = torch.tensor(float(bool(stop_signals)), device=device)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item() or done == steps or (cfg.ckpt_every and done % cfg.ckpt_every == 0):
            try:
                path = save_checkpoint(cfg, mcfg, units, done, rank, world, windows.state(position) if windows else None)
            except CheckpointError as e:
                fail(str(e))
            if rank == 0:
                print(f"saved checkpoint {path}", flush=True)
        if stop.item():
            if rank == 0:
                print(f"stopping at step {done} on {signal.Signals(stop_signals[0]).name if stop_signals else 'a signal'}; "
                      f"re-run the same command to continue", flush=True)
            stopped = True
            break
    if cfg.export_hf and not stopped:
        export_hf(units, mcfg, cfg.export_hf, getattr(torch, cfg.dtype), cfg.export_shard_gb, rank)
        if rank == 0:
            print(f"exported a Hugging Face folder to {cfg.export_hf}", flush=True)
    if metrics_file:
        metrics_file.close()
    if tensorboard:
        tensorboard.close()
    if owns_group:
        global checkpoint_group
        dist.destroy_process_group()  # every group, the checkpoint group too
        checkpoint_group = None


if __name__ == "__main__":
    main()
    # Exit without interpreter teardown. After a clean run and destroy_process_group(), gloo's threads
    # occasionally abort the process while C++ statics are destroyed (SIGABRT, "terminate called without
    # an active exception"; seen about 1 run in 20 on a loaded 2-core CPU). Under torchrun with
    # --max-restarts a non-zero exit after a finished run would start it again.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
