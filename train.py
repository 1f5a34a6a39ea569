"""Full-parameter Llama fine-tuning with a hand-written FSDP full shard (ZeRO-3).

Read top to bottom; the sections follow the data (the flags and the process group are set up in components/flags.py
and components/processes.py, read when needed):
  1. shard       each sharding unit's parameters as one flat buffer, this rank's fp32 shard of it, and
                 the trick that lets modules use a buffer that comes and goes (the comment above Unit)
  2. step        the naive ZeRO-3 step first (train_step_naive, its helpers below it), then the real one
                 from the top down: gather just before use, free right after (the head: after its
                 backward), re-gather in backward, reduce-scatter, AdamW on the shards. From `class Unit`
                 to `optimizer_step` no variation's flag is read: each arrives as a field or a subclass
  2b. around     the sharded model's set-up, where the variations are chosen (build_sharded_model), evaluation
  3. loop        weights (seeded, or sharded reads of a Hugging Face folder or a checkpoint),
                 set-up, the training loop, saving and stopping

What is not the story lives beside it: model.py, data.py (tokenizers, token files, the window order), and components/
(which never imports this file: checks, agreement across ranks, state on disk, metrics, offload, samples,
the tests' fault hook; README.md, "Files", says which holds what). tools/ (the planner, the plot, data
preparation) imports this file, never the reverse.

Launch: `python train.py --model tiny --steps 100` (one process), `./launch.sh` (torchrun on every local GPU, several
nodes, SLURM: README.md); `python train.py --help`: the flags; `python train.py --plan ...`: what fits, what it costs.
"""

from __future__ import annotations  # annotations may name what is defined further down

import gc
import math
import os
import signal
import subprocess
import sys
import time
from functools import partial
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.optim.adamw import adamw  # torch.optim.AdamW's functional form: the fast step's kernel
from torch.profiler import record_function  # named ranges for --profile; ~11 us each without a profiler (BENCHMARKS.md)
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import model as M
from components import agree  # what each rank reads from its own machine, agreed by every rank before it acts
from components import checkpoints, hf  # our checkpoints; the model's config and first weights, Hugging Face folders
from components import out_dir as OD  # the out_dir's lock, the checkpoint group, all_gather_flat (below)
from components.out_dir import all_gather_flat
from components import metrics, sample  # what each step reports; completions at each evaluation
from components import offload as O  # --offload_activations and --offload_optimizer
from components import run_data  # the run's data from --data and --eval_data (data.py reads the tokens)
from components import flags  # the flags: TrainConfig, their checks, --freeze and --lr_mult; the tests' fault_hook
from components.checks import check_run, flash_attn_unsaved_warning  # inputs
from components.flags import TrainConfig, compute_dtype, config_warnings, param_group_warnings
from components import processes  # the ranks met, the process group made on the store they met in
from components.processes import catch_stop_signals, error_line, exit_code, fail


def parse_args(argv=None) -> TrainConfig:
    return flags.parse_args(argv, __doc__)


# torch 2.13 renames the two collectives ZeRO-3 is made of; accept both names (all_gather_flat: out_dir.py's, shared).
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ================================================================================================
# 1. Shard: one flat buffer per unit, split W ways
# ================================================================================================

# Where the design comes from: ZeRO stage 3 (Rajbhandari et al., 2019, arXiv:1910.02054) partitions
# parameters, gradients and optimizer state across the W data-parallel ranks and gathers each layer's
# parameters only while it runs; PyTorch FSDP (Zhao et al., 2023, arXiv:2304.11277) is its production
# form. A Unit below is FSDP1's FlatParameter: one flat buffer per unit, sharded evenly, one all-gather
# and one reduce-scatter each. What it gives up against FSDP2 (a DTensor shard per parameter): one dtype
# per unit (no fp32 norms beside bf16 matrices), and freezing single parameters (--freeze freezes whole
# units: every element of a trained unit gets a gradient shard and optimizer state); in return the
# collectives need no copy-in/copy-out. Learning rates are per element (--lr_mult: Unit.ranges).
#
# Sharding units: the embedding, each decoder block, and the head (final norm + lm_head). A block is
# the natural unit: it is the piece of compute a gathered buffer is alive for, and all blocks have
# the same size, so the buffers in flight are bounded by two blocks. The embedding and the head are
# separate units because they are the two largest tensors (128K x 8192 each for 70B) and are used at
# opposite ends of the step.
#
# Per parameter, persistent and split W ways: fp32 master + fp32 gradient + the optimizer's state (AdamW:
# m and v, fp32) = 16 B / W; a frozen unit's (--freeze) is its master alone, 4 B / W. Transient: the
# compute-dtype buffer of the unit(s) running and the one being prefetched, and full-unit gradients on
# their way to the reduce-scatter.
#
# The trick everything below rests on: modules use a buffer that comes and goes.
#   - The model is built on the meta device (shapes, no memory). Each Unit deletes its modules'
#     parameters; while the unit runs, `set_views` points each attribute (`q_proj.weight`, ...) at a view
#     of one flat leaf tensor, `gathered`, which requires grad. Autograd sums every view's gradient into
#     one flat `gathered.grad`, and one hook per unit sees the unit's whole gradient at once.
#   - `free` is `gathered.untyped_storage().resize_(0)`: the memory goes back to the allocator, but the
#     tensor, its views, and the views autograd saved for backward (a matmul saves its weight) stay valid
#     objects on that same, now empty, storage. Gathering again resizes the storage and all-gathers into
#     it through `.data`, which writes without bumping autograd's version counter: the saved views, and
#     the block a recompute (activation checkpointing) runs again, read the refilled weights, and
#     autograd does not report them as modified.
#   - What must hold: (1) a unit is refilled, with the same values, before anything in its backward reads
#     it: BackwardBoundary (section 2) gathers it as autograd enters its stage; (2) a stage's output is the
#     only path from one stage to the next, so autograd cannot reach a stage's backward except through
#     that boundary; (3) the weights do not change between a forward and its backward (the optimizer runs
#     after all micro-batches). Break (2), e.g. by passing a tensor from block 3 to block 7, and block 3's
#     backward could read a freed buffer.
#   - BackwardBoundary returns its input as it is; PyTorch's custom-function machinery hands the next stage a
#     new tensor on x's memory whose history runs through the boundary (an unmodified input returned as-is
#     is returned as a view of itself, torch/csrc/autograd/custom_function.cpp, _process_backward_mode_ad),
#     while x keeps its own. What the boundary needs is only that its output is not marked
#     non-differentiable, so that the output's gradient edge is the boundary's node.
#   - With tied embeddings the head stage uses the embedding unit's weight too. The head's contribution
#     to its gradient waits in autograd (a full embedding-sized gradient, compute dtype) until the
#     embedding stage's backward adds its own; then the embedding unit's hook fires once, with the sum.
#   - A reduce-scatter in flight is a tuple (unit, work, out, grad): `grad`, the unit's full gradient in
#     --reduce_dtype, is the collective's input and must stay alive until it completes; `out` is this
#     rank's summed shard, added into grad_shard then.
#
# The core, from `class Unit` to `optimizer_step` (the end of section 2), reads none of the variations' flags:
# each reaches it as a field or a subclass that section 2b's build_sharded_model sets. --freeze: a unit's
# `trained` (no gradient hook, no optimizer state; backward ends in the first trained stage); --lr_mult: a unit's
# `ranges`, which the optimizer reads; --ac: a stage's policy, which run_block applies; --offload_activations: a
# stage's `offload`, which run_block hands to offload.py; --offload_optimizer: OffloadedUnit and OffloadedModel,
# which override gather_input, add_grad, grad_norm and update. --profile records the record_function ranges
# every run passes through (~11 us each, nothing kept without a profiler); the tests' faults hook into the loop.

class Slot(NamedTuple):
    """One parameter's place in its unit's flat buffer."""
    module: torch.nn.Module
    attr: str       # the attribute on `module`, e.g. "weight"
    name: str       # its name in the model, e.g. "layers.3.self_attn.q_proj.weight"
    shape: tuple
    offset: int     # first element in the flat buffer


class Unit:
    """A sharding unit: its parameters' slots in a flat buffer, this rank's shards (fp32 master, gradient,
    optimizer state), and the gathered buffer whose views the modules use while the unit runs.
    --offload_optimizer's extension point: a subclass (OffloadedUnit, section 2b) overrides gather_input
    (what the all-gather reads) and add_grad (where a reduce-scattered shard goes)."""

    def __init__(self, name, model, param_names, rank, world, device, compute_dtype, state_device=None, trained=True,
                 lr_factors=None):
        self.name = name
        self.slots = []
        offset = 0
        for full_name in param_names:
            module_path, _, attr = full_name.rpartition(".")
            module = model.get_submodule(module_path)
            shape = tuple(getattr(module, attr).shape)
            self.slots.append(Slot(module, attr, full_name, shape, offset))
            offset += math.prod(shape)
            delattr(module, attr)  # between uses the attribute is a view of a freed buffer: see above
        self.numel = offset
        # Pad to a multiple of W: all_gather_into_tensor / reduce_scatter_tensor need equal shards.
        # The padding is never viewed by a module, so its gradient is exactly zero and it stays zero.
        self.padded_numel = -(-offset // world) * world
        self.shard_numel = self.padded_numel // world
        self.shard_start = rank * self.shard_numel  # this rank's shard of the flat buffer

        # The fp32 state, on `state_device` (default: the device); a frozen unit's (--freeze): its master shard only.
        f32 = dict(dtype=torch.float32, device=state_device or device)
        self.trained, self.optimizer_steps = trained, 0  # the unit's own step count (bias corrections), as torch's
        self.master_shard = torch.zeros(self.shard_numel, **f32)
        self.grad_shard = torch.zeros(self.shard_numel if trained else 0, **f32)
        self.optimizer_state = {name: torch.zeros(self.shard_numel, **f32) for name in M.OPTIMIZER_STATE} if trained else {}
        self.ranges = shard_ranges(self, lr_factors or {}) if trained else []  # what the optimizer steps over

        # The gathered buffer: full padded size, compute dtype, storage allocated only while gathered.
        self.gathered = torch.empty(self.padded_numel, dtype=compute_dtype, device=device, requires_grad=trained)
        self._storage_bytes = self.gathered.untyped_storage().nbytes()
        self.set_views(self.gathered)  # from now on each module attribute is a view of it (a view needs the storage)
        self.gathered.untyped_storage().resize_(0)
        self._gather_work = None     # in-flight all-gather
        self._send = None            # its input, kept alive until it completes

    # -- gather / free, in the order the step first calls them ---------------------------------
    def wait_gather(self):
        """Makes the unit readable: issues its all-gather now if none was prefetched (start_gather), then
        waits for it."""
        with record_function(f"gather {self.name} (wait)"):
            if self.state() == "free":  # not prefetched: issued only now
                self.start_gather()
            if self._gather_work is not None:
                self._gather_work.wait()
                self._gather_work, self._send = None, None

    def start_gather(self):
        """Launches the all-gather of this unit into its buffer; returns at once (async)."""
        if self.state() != "free":
            return
        # A trace's ranges must nest, so an async collective gets two: its issue here, its wait in wait_gather.
        with record_function(f"gather {self.name} (issue)"):
            self.gathered.untyped_storage().resize_(self._storage_bytes)
            self._send = self.gather_input()
            self._gather_work = all_gather_flat(self.gathered.data, self._send, async_op=True)  # .data: see above

    def state(self) -> str:
        """"free" (no storage), "gathering" (storage allocated, all-gather in flight: not yet readable)
        or "gathered" (the full buffer, ready for the modules)."""
        if self.gathered.untyped_storage().nbytes() == 0:
            return "free"
        return "gathering" if self._gather_work is not None else "gathered"

    def gather_input(self) -> torch.Tensor:
        """This rank's shard in the compute dtype, on the device: bf16 over the wire is half the bytes."""
        return self.master_shard.to(self.gathered.dtype)

    def set_views(self, buffer: torch.Tensor):
        """Points each module attribute at its piece of `buffer` (the gathered one, or the naive step's).
        Called with autograd on, so gradients flow from every use back into `buffer.grad`. One split, not
        a slice per parameter: a slice's backward pads its gradient with zeros to the whole unit, so a unit
        of n parameters would briefly hold ~3 units of gradient; split's backward concatenates once (2)."""
        sizes = [math.prod(slot.shape) for slot in self.slots]
        pieces = torch.split(buffer, sizes + [self.padded_numel - self.numel])
        for slot, piece in zip(self.slots, pieces):
            setattr(slot.module, slot.attr, piece.view(slot.shape))

    def free(self):
        if self._gather_work is not None:  # an error, not an assert: `python -O` must not skip it
            raise RuntimeError(f"{self.name}: freed while its all-gather is in flight")
        with record_function(f"free {self.name}"):
            self.gathered.untyped_storage().resize_(0)

    def add_grad(self, out: torch.Tensor):
        """Adds a reduce-scattered gradient shard into grad_shard (accumulation over micro-batches, fp32)."""
        self.grad_shard.add_(out)

    def persistent_bytes(self, on_device_only: bool = False) -> int:
        """Bytes this rank keeps between steps: the fp32 shards, all of them on the device."""
        return sum(t.numel() * t.element_size() for t in (self.master_shard, self.grad_shard,
                                                           *self.optimizer_state.values()))


# ================================================================================================
# 2. Step: the naive ZeRO-3 step, then the real one from the top down
# ================================================================================================
#
# The forward is a list of stages (embedding, each block, head + loss). Each stage's units are gathered
# just before it runs and freed right after, except the head's: backward starts there, so they stay
# gathered from the head's forward into its backward. A BackwardBoundary after each stage gathers its
# units again when backward reaches it, and each unit's gradient is reduce-scattered as soon as autograd
# completes it.
#
# train_step_naive comes first, with the helpers it shares with the real step below it: the same
# arithmetic with every unit gathered at once. Then the real step from the top down, each definition
# below its caller: train_step -> forward_backward -> micro_batches -> ShardedModel (loss, run_stage,
# on_backward) -> the stages -> BackwardBoundary -> reduce_scatter_grad -> finish_reduces -> the optimizer.

def train_step_naive(cfg, units: list[Unit], model: M.Llama, batches: list[dict], step: int) -> dict:
    """ZeRO-3 with nothing overlapped and nothing freed early, to read first: each unit all-gathered
    into a full buffer, a plain forward and backward over this rank's micro-batches, each unit's gradient
    reduce-scattered to its owner, AdamW written out term for term. The same arithmetic as train_step
    (tests/test_sharding.py holds them equal), but every rank holds the whole model and its whole gradient
    in the compute dtype while it runs. train_step adds: one unit gathered at a time (prefetching the next),
    freed after forward and gathered again in backward (BackwardBoundary), each reduce-scatter started as
    soon as its unit's gradient is complete, activation checkpointing, a fused optimizer kernel, skipping
    non-finite steps."""
    views = [[getattr(slot.module, slot.attr) for slot in unit.slots] for unit in units]  # put back at the end
    trained = [u for u in units if u.trained]  # a frozen unit (--freeze) has no gradient and no optimizer state
    full = {}
    for unit in units:
        full[unit.name] = torch.empty(unit.padded_numel, dtype=unit.gathered.dtype, device=unit.gathered.device)
        all_gather_flat(full[unit.name], unit.gather_input())
        full[unit.name].requires_grad_(unit.trained)
        unit.set_views(full[unit.name])
    device = batches[0]["tokens"].device
    loss_sum = torch.zeros((), device=device)
    for batch in batches:
        x = model.embed(batch["tokens"])
        for block in model.layers:
            x = block(x, batch["cos"], batch["sin"], batch["layout"])
        loss = sum(model.head_loss(x, batch["targets"], cfg.ce_chunk).values()) / batch["n_tokens"]
        loss.backward()  # gradients accumulate into full[...].grad over the micro-batches
        loss_sum += loss.detach().float()
    for unit in trained:
        out = torch.empty(unit.shard_numel, device=device)
        reduce_scatter_flat(out, full[unit.name].grad.float(), op=dist.ReduceOp.SUM)
        unit.grad_shard.copy_(out)
    dist.all_reduce(loss_sum)
    grad_norm = global_grad_norm(units, device)
    scale = min(1.0, cfg.grad_clip / (grad_norm.item() + 1e-6)) if cfg.grad_clip > 0 else 1.0
    for unit in units:
        unit.grad_shard.mul_(scale)
    adamw_step_reference(trained, cfg, lr_at(cfg, step), step)
    for unit in units:
        unit.grad_shard.zero_()
    for unit, kept in zip(units, views):  # the modules point where they did, not into `full`, which goes now
        for slot, view in zip(unit.slots, kept):
            setattr(slot.module, slot.attr, view)
    return dict(loss=loss_sum.item(), grad_norm=grad_norm.item())


def global_grad_norm(units: list[Unit], device: torch.device) -> torch.Tensor:
    """L2 norm over all ranks' shards: local sum of squares, one all-reduce of one scalar. The padding's
    gradient is exactly zero, so it adds nothing."""
    sq = torch.stack([torch.linalg.vector_norm(u.grad_shard) for u in units]).square().sum().to(device)
    dist.all_reduce(sq)
    return sq.sqrt()


def adamw_step_reference(units: list[Unit], cfg: TrainConfig, lr: float, step: int):
    """torch.optim.AdamW's update, term for term, on the trained units' shards: adamw_step's readable form (held equal
    by tests/test_sharding.py). A group per --lr_mult factor; each unit counts its own steps, as torch each parameter's."""
    beta1, beta2 = cfg.adam_beta1, cfg.adam_beta2
    for u in units:
        u.optimizer_steps += 1
        bias_correction1, bias_correction2 = 1 - beta1 ** u.optimizer_steps, 1 - beta2 ** u.optimizer_steps
        exp_avg, exp_avg_sq = u.optimizer_state["exp_avg"], u.optimizer_state["exp_avg_sq"]
        for lo, hi, factor, decays in u.ranges:  # decoupled decay (matrices only), at the group's lr, first, as torch
            if decays:
                u.master_shard[lo:hi].mul_(1 - lr * factor * cfg.weight_decay)
        exp_avg.lerp_(u.grad_shard, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(u.grad_shard, u.grad_shard, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(cfg.adam_eps)
        for lo, hi, factor, _ in u.ranges:
            u.master_shard[lo:hi].addcdiv_(exp_avg[lo:hi], denom[lo:hi], value=-lr * factor / bias_correction1)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup to --lr, then cosine to 10% of --lr at --steps (or constant). step is 1-based."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    min_lr = 0.1 * cfg.lr
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1 + math.cos(math.pi * progress))


def train_step(cfg, sharded: ShardedModel, windows, step: int, position: int) -> dict:
    """One optimizer step (1-based `step`): accumulate, clip, update. Returns the step's numbers by name, floats:
    loss, its terms when there are several, grad_norm; the step line, metrics.jsonl and TensorBoard log each.
    A non-finite loss or gradient norm (both already summed over ranks, so every rank sees the same
    value and takes the same branch) skips the update: the weights and optimizer state stay as they were."""
    units = sharded.units
    losses, local_finite = forward_backward(cfg, sharded, windows, step, position)
    with record_function("grad_norm"):
        grad_norm = sharded.grad_norm()
    # The step's one host sync: the clip factor and the skip decision need the numbers on the host.
    record = dict(zip([*losses, "grad_norm"], torch.stack([*losses.values(), grad_norm.float()]).tolist()))
    loss, grad_norm = record["loss"], record["grad_norm"]
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        for u in units:
            u.grad_shard.zero_()
        raise NonFiniteStep(step, loss, grad_norm, local_finite)
    if cfg.grad_clip > 0:  # as torch.nn.utils.clip_grad_norm_: multiply by min(1, clip / (norm + 1e-6))
        scale = min(1.0, cfg.grad_clip / (grad_norm + 1e-6))
        if scale != 1.0:
            with record_function("clip"):
                for u in units:
                    u.grad_shard.mul_(scale)
    with record_function("optimizer_step"):
        sharded.update(cfg, lr_at(cfg, step), step)
    for u in units:
        u.grad_shard.zero_()
    return record


class NonFiniteStep(Exception):
    """A step skipped; `local_finite`: whether this rank's own loss was finite (metrics.nonfinite_line names the ranks)."""

    def __init__(self, step: int, loss: float, grad_norm: float, local_finite: torch.Tensor):
        super().__init__(f"step {step}: loss {loss}, grad_norm {grad_norm}; the optimizer step was skipped")
        self.step, self.loss, self.grad_norm, self.local_finite = step, loss, grad_norm, local_finite


def forward_backward(cfg, sharded: ShardedModel, windows, step: int, position: int):
    """All micro-batches of (1-based) `step`: gradients summed into each unit's grad_shard. Returns the
    global batch's mean loss and its terms (model.Llama.head_loss), {"loss": ..., "loss/ce": ..., ...}, 0-d
    tensors identical on every rank, and whether this rank's own loss was finite."""
    sums = 0
    for batch in micro_batches(cfg, sharded, windows, position):
        loss, terms = sharded.loss(batch)
        loss.backward()  # the reduce-scatters start inside, unit by unit (reduce_scatter_grad)
        sharded.end_backward()
        finish_reduces(sharded.reduces_in_flight)
        terms = terms if len(terms) > 1 else {}  # a lone term is the loss itself
        sums = sums + torch.stack([loss.detach(), *terms.values()]).float()
    local_finite = torch.isfinite(sums[0])  # read only if the step goes bad: reading it waits for the GPU
    dist.all_reduce(sums)  # the loss and its terms in one all-reduce
    return dict(zip(["loss", *(f"loss/{name}" for name in terms)], sums)), local_finite


def micro_batches(cfg, sharded: ShardedModel, windows, position: int) -> list[dict]:
    """This rank's micro-batches of the global batch that starts at window `position`."""
    accum = cfg.batch_size // (sharded.world * cfg.micro_batch_size)
    arrays = [windows.micro_batch(position, j, sharded.rank, sharded.world, cfg.micro_batch_size) for j in range(accum)]
    # The loss is the mean over every target token of the global batch, so each rank divides its summed
    # loss by the global count -- not by the number of micro-batches, which would make results depend on W.
    n_tokens = M.to_device(np.array(sum((t != -100).sum() for _, t, _ in arrays), dtype=np.float32), sharded.device)
    dist.all_reduce(n_tokens)
    return [dict(M.make_batch(sharded.model.cfg, inputs, targets, doc_starts, cfg.doc_mask, sharded.device,
                              sharded.compute_dtype), n_tokens=n_tokens) for inputs, targets, doc_starts in arrays]


class ShardedModel:
    """The model (on meta: its weights are views the units set), its units in the order they run and the
    stages of the forward (build_sharded_model, section 2b, makes the three), and the queue of reduce-scatters
    in flight. --offload_optimizer's extension point: a subclass (OffloadedModel) adds to grad_norm and update."""

    def __init__(self, cfg: TrainConfig, model: M.Llama, units: list[Unit], stages: list[Stage], rank: int,
                 world: int, device: torch.device):
        self.model, self.units, self.stages = model, units, stages
        self.rank, self.world, self.device, self.compute_dtype = rank, world, device, units[0].gathered.dtype
        self.trained_units = [u for u in units if u.trained]  # those with a gradient and an optimizer (--freeze)
        self.reduces_in_flight = []
        for unit in self.trained_units:  # each unit's gradient is reduce-scattered as soon as autograd completes it
            unit.gathered.register_post_accumulate_grad_hook(
                partial(reduce_scatter_grad, unit, self.reduces_in_flight, getattr(torch, cfg.reduce_dtype)))
        self.first_trained = first_trained_stage(stages)
        self.prefetch, self.ce_chunk = cfg.prefetch, cfg.ce_chunk

    def loss(self, batch: dict) -> torch.Tensor:
        """Forward through all stages, each gathered just before it runs and followed by a BackwardBoundary
        that gathers it again for backward. Each is freed right after it runs, except the last (the head):
        backward starts there, so it stays gathered into its backward. Returns this rank's loss (already
        divided by the global token count), which backward starts from, and its terms by name, detached."""
        x = batch["tokens"]
        for k, stage in enumerate(self.stages):
            for unit in stage.forward_units:
                unit.wait_gather()
                unit.set_views(unit.gathered)
            if self.prefetch and k + 1 < len(self.stages):  # the next all-gather overlaps this compute
                for unit in self.stages[k + 1].forward_units:
                    unit.start_gather()
            with record_function(f"forward {stage.forward_units[0].name}"):  # a stage is named by its first unit
                x = self.run_stage(k, x, batch)
            if k + 1 < len(self.stages):
                for unit in stage.forward_units:
                    unit.free()
            else:  # the head's loss terms: the loss is their sum
                terms, x = x, sum(x.values())
            x = BackwardBoundary.apply(x, partial(self.on_backward, k))
        return x, {name: term.detach() for name, term in terms.items()}

    def run_stage(self, k: int, x: torch.Tensor, batch: dict) -> torch.Tensor:
        """Stage k's forward: the embedding, a block (under its checkpointing policy), or the head and the loss's terms."""
        if k == 0:
            return self.model.embed(x)
        if k == len(self.stages) - 1:
            terms = self.model.head_loss(x, batch["targets"], self.ce_chunk)
            return {name: term / batch["n_tokens"] for name, term in terms.items()}
        stage = self.stages[k]
        return run_block(self.model.layers[k - 1], stage.ac, x, batch["cos"], batch["sin"], batch["layout"], stage.offload,
                         stage.forward_units[0].name, any(u.trained for u in stage.forward_units))

    def on_backward(self, k: int):
        """Backward has finished stage k + 1 and is about to run stage k. In a trace, stage k's backward runs
        from this range to the next `backward ... (enter)`: a range cannot span autograd's nodes."""
        with record_function(f"backward {self.stages[k].forward_units[0].name} (enter)"):
            if k + 1 < len(self.stages):
                for unit in self.stages[k + 1].backward_units:
                    unit.free()
            for unit in self.stages[k].backward_units:
                unit.wait_gather()
            if self.prefetch and k > 0:
                for unit in self.stages[k - 1].backward_units:
                    unit.start_gather()

    def end_backward(self):
        """After a micro-batch's backward: frees the stage it ended in. on_backward frees each stage as backward
        leaves it, but nothing leaves the first trained stage: the embedding's (no backward units), or after a
        frozen prefix (--freeze) the first block that trains, which backward gathered and no boundary frees."""
        for unit in self.stages[self.first_trained].backward_units:
            unit.free()

    def grad_norm(self) -> torch.Tensor:
        """The global norm of this step's gradient shards."""
        return global_grad_norm(self.units, self.device)

    def update(self, cfg: TrainConfig, lr: float, step: int):
        """The optimizer's step on the shards of every unit that trains (a frozen one has no state: --freeze)."""
        optimizer_step(self.trained_units, cfg, lr, step)


class Stage(NamedTuple):
    forward_units: list          # gathered for its forward
    backward_units: list         # gathered again for its backward
    ac: str = "none"             # a block's activation checkpointing (M.block_policies)
    offload: bool = False        # a block's input kept in host memory (--offload_activations)


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


def run_block(block, ac: str, x, cos, sin, layout, offload: bool = False, name: str = "block", trained: bool = True):
    if ac == "none":
        return block(x, cos, sin, layout)

    def ranged(*args):
        """The block's forward in a range: `recompute NAME` when checkpointing runs it again in backward (autograd
        is then running a node), `checkpointed NAME` the first time. Both times, because the selective policy
        replays the forward's ops in backward and refuses one the forward did not run. Not under torch.compile,
        whose backward graph recomputes by itself."""
        if torch.compiler.is_compiling():
            return block(*args)
        in_backward = torch._C._current_autograd_node() is not None
        with record_function(f"{'recompute' if in_backward else 'checkpointed'} {name}"):
            return block(*args)
    if offload:  # --offload_activations' extension point: `full`, the block's input kept in host memory (offload.py)
        return O.offloaded_checkpoint(x, lambda h: ranged(h, cos, sin, layout), trained)
    if ac == "full":  # save only the block's input; recompute the whole block in backward
        return checkpoint(ranged, x, cos, sin, layout, use_reentrant=False)
    def keep_saved_ops(ctx, op, *args, **kwargs):  # --ac selective: keep SAVED_OPS' outputs, recompute the rest
        return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE
    return checkpoint(ranged, x, cos, sin, layout, use_reentrant=False,
                      context_fn=partial(create_selective_checkpoint_contexts, keep_saved_ops))


class BackwardBoundary(torch.autograd.Function):
    """Identity between two stages. Its backward runs when the gradient w.r.t. this stage's output is
    complete, i.e. just after the next stage's backward and just before this stage's backward: the
    moment to free the next stage's buffers, gather this stage's, and prefetch the previous one's."""

    @staticmethod
    def forward(ctx, x, on_backward):
        ctx.on_backward = on_backward
        return x  # autograd returns it as a new view whose history runs through here (the comment above Unit)

    @staticmethod
    def backward(ctx, grad):
        ctx.on_backward()
        return grad, None


MAX_REDUCES_IN_FLIGHT = 1  # full-unit gradients in --reduce_dtype left reducing while the next unit's backward runs


def reduce_scatter_grad(unit: Unit, reduces_in_flight: list, reduce_dtype: torch.dtype, gathered: torch.Tensor):
    """Autograd hook on `unit.gathered` (ShardedModel registers it): this micro-batch's gradient of the
    whole unit is in gathered.grad. Sum it over ranks into each rank's shard (reduce-scatter) and drop the
    full gradient. In fp32 by default: summing W bf16 gradients in bf16 would round away small contributions.
    Asynchronous, so the previous unit's backward overlaps it, but at most MAX_REDUCES_IN_FLIGHT at a
    time: each holds a full-unit gradient, and an unbounded queue would hold the whole model's.
    The oldest one is waited for *before* the cast, not after the launch: otherwise its gradient, this
    one in the compute dtype and its copy in the reduce dtype would be alive together (3 units where
    tools/plan_memory.py's reduce_hook_bytes counts 2). On GPUs this costs no overlap: NCCL runs a group's collectives
    one after another on one stream, so the new reduce-scatter could not start before the old one
    ends anyway."""
    finish_reduces(reduces_in_flight, keep=MAX_REDUCES_IN_FLIGHT - 1)
    with record_function(f"reduce_scatter {unit.name} (issue)"):  # and its wait in finish_reduces
        grad = gathered.grad.to(reduce_dtype)  # the same tensor, no copy, when the dtypes match
        gathered.grad = None
        out = torch.empty(unit.shard_numel, dtype=reduce_dtype, device=grad.device)
        work = reduce_scatter_flat(out, grad, op=dist.ReduceOp.SUM, async_op=True)
    reduces_in_flight.append((unit, work, out, grad))


def finish_reduces(reduces_in_flight: list, keep: int = 0):
    """Waits for the oldest reduce-scatters until `keep` remain; adds each result into its unit's shard
    (Unit.add_grad) and lets its full-unit gradient go."""
    while len(reduces_in_flight) > keep:
        unit, work, out, _ = reduces_in_flight.pop(0)
        with record_function(f"reduce_scatter {unit.name} (wait)"):
            work.wait()
            unit.add_grad(out)


def adamw_step(units: list[Unit], cfg: TrainConfig, lr: float, step: int):
    """adamw_step_reference through torch's own AdamW (its functional form, fused=True: the kernel
    torch.optim.AdamW(fused=True) runs), one pass over the four shards instead of eight and two temporaries,
    decay included. One call per group of ranges: the same --lr_mult factor, and decayed (matrices) or not (norms)."""
    groups = {}  # (lr factor, decays) -> [[master, grad, exp_avg, exp_avg_sq, steps so far] of one range of a shard]
    for u in units:
        for lo, hi, factor, decays in u.ranges:  # a step count per range: torch adds 1 to each tensor it is given
            steps_so_far = torch.full((), float(u.optimizer_steps), device=u.master_shard.device)
            shards = (u.master_shard, u.grad_shard, u.optimizer_state["exp_avg"], u.optimizer_state["exp_avg_sq"])
            groups.setdefault((factor, decays), []).append([t[lo:hi] for t in shards] + [steps_so_far])
        u.optimizer_steps += 1
    for (factor, decays), group in groups.items():
        master, grad, exp_avg, exp_avg_sq, steps = map(list, zip(*group))
        adamw(master, grad, exp_avg, exp_avg_sq, [], steps, fused=True, amsgrad=False,
              lr=lr * factor, beta1=cfg.adam_beta1, beta2=cfg.adam_beta2, eps=cfg.adam_eps,
              weight_decay=cfg.weight_decay if decays else 0.0, maximize=False)


# The optimizer: a fork swaps it here and in M.OPTIMIZER_STATE, the names of the fp32 tensors each unit keeps
# per element of its shard (Unit makes them; checkpoints, memory accounting and the planner iterate over them;
# model.py holds them so that components/, which never import this file, read the same ones). Any
# elementwise optimizer works on shards unchanged: each element sees the same arithmetic as in the whole tensor.
optimizer_step = adamw_step


# ================================================================================================
# 2b. Around the step: the sharded model's set-up, the variations' plug-ins, evaluation
# ================================================================================================
#
# ShardedModel's set-up: the model on meta, its units and its stages (what ShardedModel.loss runs), made once.
# The variations are chosen here, not in the core: --freeze and --lr_mult set each unit's `trained` and
# `ranges`, --offload_activations a stage's `offload`, --offload_optimizer the classes (OffloadedModel below).

def build_sharded_model(cfg: TrainConfig, mcfg: M.ModelConfig, rank: int, world: int, device: torch.device):
    with torch.device("meta"):  # shapes only: construction allocates nothing
        model = M.Llama(mcfg)
    unit_class, model_class = (OffloadedUnit, OffloadedModel) if cfg.offload_optimizer else (Unit, ShardedModel)
    units = build_units(model, rank, world, device, compute_dtype(cfg.dtype, device), unit_class, cfg.freeze, cfg.lr_mult)
    stages = make_stages(model, units, cfg.ac, cfg.offload_activations, cfg.ac_blocks, cfg.ac_rest)
    return model_class(cfg, model, units, stages, rank, world, device)


def build_units(model: M.Llama, rank, world, device, compute_dtype, unit_class=Unit, freeze: str = "",
                lr_mult: str = "") -> list[Unit]:
    """One Unit per M.sharding_units entry: embed, layers.0 .. layers.{L-1}, head -- in the order they run;
    those --freeze freezes whole (flags.frozen_units), each parameter with its --lr_mult factor (flags.lr_factors)."""
    frozen, lr_factors = flags.frozen_units(model, freeze)[0], flags.lr_factors(model, lr_mult)[0]
    return [unit_class(g, model, p, rank, world, device, compute_dtype, trained=g not in frozen, lr_factors=lr_factors)
            for g, p in M.sharding_units(model)]


def make_stages(model: M.Llama, units: list[Unit], ac: str, offload: bool = False, ac_blocks: int = -1,
                ac_rest: str = "none") -> list[Stage]:
    """The embedding, each block, the head (ShardedModel.run_stage runs them). A block's stage holds every unit
    model.sharding_units names for it (one, or a fork's several: `layers.3`, `layers.3.lora`). The embedding's
    backward only needs the token ids, so it is not gathered again for backward. With tied embeddings the head
    also needs the embedding unit (its weight is the head's)."""
    embed, head = units[0], units[-1]
    blocks = [[u for u in units[1:-1] if M.block_of(u.name) == i] for i in range(len(model.layers))]
    head_units = [head, embed] if model.cfg.tie_embeddings else [head]
    policies = M.block_policies(len(blocks), ac, ac_blocks, ac_rest)
    # --offload_activations moves what `full` keeps
    stages = ([Stage([embed], [])] + [Stage(block, block, policy, offload and policy == "full")
                                       for block, policy in zip(blocks, policies)] + [Stage(head_units, head_units)])
    # A frozen prefix (--freeze) has no backward: nothing in it or before it requires grad, so autograd never
    # reaches it (and ShardedModel.end_backward frees the first trained stage, which no boundary then frees).
    first = first_trained_stage(stages)
    return [stage._replace(backward_units=[]) for stage in stages[:first]] + stages[first:]


def shard_ranges(unit: Unit, lr_factors: dict) -> list[tuple]:
    """Unit's ranges: (lo, hi, learning-rate factor, decays) pieces of this rank's shard, one per run of parameters
    with the same --lr_mult factor (1 without it) and the same weight decay (matrices decay; norm weights, 1-D, not)."""
    ranges = []
    for slot in unit.slots:
        lo = max(slot.offset, unit.shard_start) - unit.shard_start
        hi = min(slot.offset + math.prod(slot.shape), unit.shard_start + unit.shard_numel) - unit.shard_start
        factor, decays = lr_factors.get(slot.name, 1.0), len(slot.shape) >= 2
        if lo >= hi:
            continue
        if ranges and ranges[-1][1:] == (lo, factor, decays):  # contiguous, the same group: one piece
            ranges[-1] = (ranges[-1][0], hi, factor, decays)
        else:
            ranges.append((lo, hi, factor, decays))
    return ranges


def first_trained_stage(stages: list[Stage]) -> int:
    """The first stage with a unit that trains: 0 without --freeze."""
    return next(k for k, stage in enumerate(stages) if any(u.trained for u in stage.forward_units))


# --offload_optimizer (offload.py): every unit's fp32 state lives in host memory and the optimizer runs
# on the CPU; the device keeps a compute-dtype copy of each shard. The set-up chooses OffloadedModel,
# whose units are OffloadedUnits: the core's extension points, overridden, and no branch in the core.

class OffloadedUnit(Unit):
    """A Unit whose fp32 shards are views of the rank's host buffer (offload.offload_optimizer places them and
    sets `host`, an offload.HostOptimizer): the all-gather reads `host`'s compute-dtype device copy, and a
    reduce-scattered shard is copied to host memory and added there, on a worker thread."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, state_device=torch.device("meta"), **kwargs)  # no device memory: offload.py places it
        self.host = None

    def gather_input(self) -> torch.Tensor:
        return self.host.gather_input()

    def add_grad(self, out: torch.Tensor):
        self.host.add_grad(self, out)

    def persistent_bytes(self, on_device_only: bool = False) -> int:
        """The fp32 shards (in host memory) and the device copy, which is all `on_device_only` counts."""
        copy = self.host.compute_shard.numel() * self.host.compute_shard.element_size()
        return copy if on_device_only else super().persistent_bytes() + copy


class OffloadedModel(ShardedModel):
    """ShardedModel with OffloadedUnits: the step's gradient norm first waits for the host's last adds (they
    run on a worker thread while backward goes on), and its update, on the CPU, is followed by the refresh
    of the device copies."""

    def __init__(self, *args):
        super().__init__(*args)
        self.host_adds = []  # the worker thread's adds into the host accumulators, in flight
        O.offload_optimizer(self.units, self.host_adds)

    def grad_norm(self) -> torch.Tensor:
        O.finish_host_adds(self.host_adds)
        return super().grad_norm()

    def update(self, cfg: TrainConfig, lr: float, step: int):
        super().update(cfg, lr, step)
        O.refresh_compute_shards(self.units)  # the updated host master shards back to the device, in the compute dtype


def evaluate(cfg, sharded: ShardedModel, eval_windows) -> float:
    """Mean loss over the first --eval_batches global batches of the held-out data's first epoch: a
    seeded sample of its windows, the same every time. The same gathers as training's forward, no backward."""
    loss_sum, n_tokens = torch.zeros((), device=sharded.device), torch.zeros((), device=sharded.device)
    with torch.no_grad():
        for i in range(cfg.eval_batches):
            for batch in micro_batches(cfg, sharded, eval_windows, i * cfg.batch_size):
                loss_sum += sharded.loss(dict(batch, n_tokens=1.0))[0].float()  # the sum, not the mean
                for unit in sharded.stages[-1].forward_units:  # kept gathered for a backward that won't come
                    unit.free()
                n_tokens += (batch["targets"] != -100).sum()
    dist.all_reduce(loss_sum)
    dist.all_reduce(n_tokens)
    return (loss_sum / n_tokens).item()


# ================================================================================================
# 3. Loop: weights, set-up, training, saving and stopping
# ================================================================================================

def setup(cfg: TrainConfig):
    """Everything before the first step: checks, data, processes, the sharded model, its weights (from
    a checkpoint, --init_from or the seed). Returns (sharded, windows, eval_windows, step, position, agreed):
    the last step done (0 on a fresh start), the data position after it, and what every rank agreed on
    (agree.py): {"async_save": bool, "hosts": each rank's host, "planned": the planner's memory figures or None}."""
    mcfg, weights, errors = check_run(cfg, int(os.environ.get("WORLD_SIZE", 1)))  # checks.py
    if errors:
        fail("; ".join(errors))

    windows = eval_windows = None
    if cfg.steps > 0:
        mcfg, windows, eval_windows = run_data.open_data(cfg, mcfg)

    device = processes.pick_device(cfg)
    store, rank, world = processes.rendezvous(cfg)  # torchrun's store: the ranks met, NCCL not yet touched
    planned = agree.planner_figures(store, cfg, mcfg, rank, world, device)  # tools/plan.py's, asked by rank 0 alone
    # What each rank reads from its own machine (host memory, packages, limits, its GPU), gathered over the store and
    # decided the same on every rank: one line per problem on every rank before NCCL or any weights (agree.py).
    warnings = config_warnings(cfg) + param_group_warnings(cfg, mcfg)  # allowed, but probably not meant
    unsaved = flash_attn_unsaved_warning(SAVED_OPS) if "selective" in (cfg.ac, cfg.ac_rest) else None
    facts = agree.gather_over_store(store, "facts", agree.read_facts(cfg, mcfg, world, device, planned,
                                     warnings + ([unsaved] if unsaved else []), windows), rank, world, device)
    problems, warnings, async_save = agree.decide(facts)
    if problems:
        processes.fail_before_group("\nerror: ".join(problems), store, rank, world)
    for warning in warnings if rank == 0 else []:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    agreed = dict(async_save=async_save, hosts=[f["host"] for f in facts], planned=planned and planned["memory"])
    processes.make_group(cfg, store, rank, world, device, agreed["hosts"])  # its first contact under --first_contact_s
    OD.make_group(cfg.ckpt_timeout_min)  # saves and resumes wait longer: their own group (out_dir.py)
    threads = O.optimizer_threads(cfg, device, int(os.environ.get("LOCAL_WORLD_SIZE", 1)), len(os.sched_getaffinity(0)))
    if threads:
        torch.set_num_threads(threads)
    OD.claim_out_dir(cfg.out_dir, rank, world, device)
    sharded = build_sharded_model(cfg, mcfg, rank, world, device)
    ckpt_root = os.path.join(cfg.out_dir, "checkpoints")
    if cfg.resume == "never" and cfg.overwrite and rank == 0:  # once per run: its restarts resume (out_dir.py)
        kept = OD.overwrite_once(cfg.out_dir)
        if kept:
            print(kept, flush=True)
    dist.barrier()
    # A checkpoint in --out_dir wins over --init_from: re-running the same command continues the run.
    # After --overwrite, what is left is this run's own: a restart's checkpoints (overwrite_once).
    resumes = cfg.resume == "auto" or cfg.overwrite
    candidates = agree.resume_candidates(ckpt_root, rank, agreed["hosts"], device) if resumes else []  # every rank's
    step, position, load_started_s = 0, 0, time.perf_counter()
    if candidates:
        step, position = checkpoints.resume(cfg, mcfg, sharded.units, windows, rank, candidates)
    else:
        started = hf.init_weights(cfg, mcfg, sharded.units, weights)  # seeded per unit: the same at any W
        if started and rank == 0:  # the units taken from --init_from, and those new to it
            print(started, flush=True)
    slow_load = agree.loads_waited(load_started_s, rank, agreed["hosts"])  # every rank's weights read: --ckpt_timeout_min
    if slow_load and rank == 0:
        print(f"warning: {slow_load}", file=sys.stderr, flush=True)
    if cfg.offload_optimizer:  # the device copies of the host master shards just filled
        O.refresh_compute_shards(sharded.units)
    return sharded, windows, eval_windows, step, position, agreed


GC_EVERY_STEPS = 50  # Python's garbage collection, at the same step on every rank (main)


def save(cfg, sharded: ShardedModel, saving, step: int, data_state, background: bool):
    """A checkpoint of `step`: written in the background (--async_save: training stalls only for the copy to
    host memory), or now, every rank waiting for the whole write."""
    t0 = time.perf_counter()
    try:
        if background:
            first = saving.saves == 0  # its staging buffer was made in the background since start-up
            saving.start(cfg, sharded.units, step, sharded.rank, sharded.world, data_state)
            message = (f"checkpoint of step {step}: copied to host memory in {time.perf_counter() - t0:.2f} s, "
                       f"writing in the background" + (f" (the staging buffer was made beside the first steps in "
                                                       f"{saving.prepared_s:.1f} s, off the path to step 1)" if first else ""))
        else:
            path = checkpoints.save_checkpoint(cfg, sharded.model.cfg, sharded.units, step, sharded.rank, sharded.world, data_state)
            message = f"saved checkpoint {path} (in {time.perf_counter() - t0:.2f} s, training waiting)"
    except OD.CheckpointError as e:
        fail(str(e), exit_code(e))
    if sharded.rank == 0:
        print(message, flush=True)


def main(argv=None):
    cfg = start(argv)  # the flags; --plan, --plot and a finished run's command again end here
    if cfg is None:
        return
    owns_group = not dist.is_initialized()  # a caller's group (bench/) is the caller's to destroy
    try:
        sharded, windows, eval_windows, start_step, position, agreed = setup(cfg)
        steps = cfg.steps
        log = metrics.MetricsLog(cfg, sharded.model.cfg, sharded.world, sharded.device, sharded.rank, start_step, steps,
                                 agreed["hosts"])
        sampler = (sample.Sampler(cfg, sharded.model.cfg, sharded.rank, start_step, sharded.device)
                   if cfg.sample_prompts and steps else None)
    except Exception as e:  # a node or its port not up yet, a GPU still held, bad data: one line, exit_code's code
        fail(error_line(e, "while starting"), exit_code(e))
    saving = before_step_one(cfg, sharded, agreed, start_step, steps)
    stop_signals, skipped = catch_stop_signals(), []

    for step in range(start_step + 1, steps + 1):
        t0 = time.perf_counter()
        record, compute_s = timed_step(cfg, sharded, windows, step, position, skipped, agreed["planned"])
        position += cfg.batch_size  # windows consumed: the data loader's state
        step_time_s, mem_gb = time.perf_counter() - t0, metrics.peak_mem_bytes(sharded.device) / 1e9
        eval_loss = None
        if eval_windows is not None and (step % cfg.eval_every == 0 or step == steps):
            eval_loss = eval_windows.losses(partial(evaluate, cfg, sharded))  # each source's, and their weighted mean
        compute_s_by_rank = metrics.compute_s_by_rank(compute_s, sharded.device)  # the slowest rank named, not averaged
        log.step(step, record, lr_at(cfg, step), step_time_s, mem_gb, eval_loss, windows.progress(position),
                 compute_s_by_rank)
        if step == start_step + 1:
            metrics.print_device_memory(sharded, f"after step {step}", agreed["planned"], "peak_gib")
        if sampler and (step % cfg.eval_every == 0 or step == steps):
            sampler.sample(sharded, step)  # greedy completions of --sample_prompts (sample.py)
        if save_or_stop(cfg, sharded, saving, step, steps, windows.state(position) if windows else None,
                        stop_signals, log, sampler):
            break
    else:  # not stopped by a signal
        export(cfg, sharded, max(start_step, steps), saving)  # --steps 0 after a resume: the step it resumed
    log.close()
    gc.unfreeze()
    gc.enable()
    if owns_group:
        dist.destroy_process_group()  # every group, the checkpoint group too
        OD.group = None


def start(argv=None):
    """The run's flags, after what ends before any process group: --plot and --plan run their tools and exit with
    their code; a finished run's command again returns None (checkpoints.unless_finished: said, or its missing export made)."""
    # launch.sh starts torchrun with SIGTERM and SIGINT blocked, so that torchrun never acts on them, and the
    # workers inherit the mask: unblocked, they end a worker still starting up, as under a plain torchrun.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM, signal.SIGINT])
    sys.stderr.reconfigure(line_buffering=True, write_through=False)  # a print one write: ranks' lines never mix
    try:
        cfg = parse_args(argv)
    except ValueError as e:
        fail(str(e))
    agree.launch_settings(cfg.out_dir)  # NVLS off, expandable segments, NCCL's flight recorder: before CUDA starts
    if cfg.plot or cfg.plan:  # a tool above the trainer (tools/: never imported here), run as a command: its exit code
        tool = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools", "plot.py" if cfg.plot else "plan.py")
        sys.exit(subprocess.call([sys.executable, tool, *([cfg.plot] if cfg.plot else argv or sys.argv[1:])]))
    cfg = checkpoints.unless_finished(cfg)  # a finished run's command again: None, or the flags that export it
    if cfg and cfg.from_ckpt:  # a checkpoint to export, no training: tools/export_hf.py, run once (rank 0 of torchrun)
        code, error = hf.export_alone(cfg, processes.pick_device(cfg))
        return fail(error, code) if code else None
    return cfg


def before_step_one(cfg, sharded: ShardedModel, agreed: dict, start_step: int, steps: int):
    """What the first step waits for: the start-up line, what --plan assumed measured on the run's own GPUs and
    fabric, --async_save's staging buffer (returned: a checkpoints.BackgroundSave, or None), the garbage collector's
    schedule."""
    if sharded.rank == 0:
        print(metrics.startup_line(cfg, sharded, start_step), flush=True)
    # What --plan assumed, measured before step 1: the fabric's bandwidth, the GPU memory outside the allocator
    problems = agree.before_step_one(cfg, sharded, agreed["hosts"], agreed["planned"]) if steps > start_step else []
    if problems:
        fail("\nerror: ".join(problems), together=True)
    # --async_save: the staging buffer, taken now ('auto' is on for GPUs where every node fits it: agree.decide);
    # only periodic saves are written in the background, so a run without them needs none.
    background = agreed["async_save"] and cfg.ckpt_every and steps > start_step
    saving = checkpoints.BackgroundSave(sharded.units, sharded.device) if background else None
    metrics.print_page_locking(sharded, agreed["hosts"])  # --offload_optimizer's state, the staging buffer: timed
    # Python's garbage collector runs when allocations pass a threshold: at another moment on each rank, and every
    # collective then waits for the rank that paused. Off while training; a collection every GC_EVERY_STEPS steps,
    # at the same step on every rank instead (torchtitan does the same). What set-up made is frozen out of those
    # collections, which then walk only what training made since (bench/gc_pauses.py measures both ways).
    gc.collect()
    gc.freeze()
    gc.disable()
    return saving


def timed_step(cfg, sharded: ShardedModel, windows, step: int, position: int, skipped: list, planned: dict | None):
    """train_step with what surrounds it in the loop: the garbage collection due, the tests' faults, --profile, the
    one-line ends of a step that runs out of memory or leaves a unit gathered, and a non-finite step skipped (counted
    in `skipped`, up to --max_skipped_steps; `planned`: the planner's memory figures, for the out-of-memory line).
    Returns (the step's record, this rank's own compute seconds)."""
    rank, device = sharded.rank, sharded.device
    metrics.reset_peak_mem(device)
    if step % GC_EVERY_STEPS == 0:
        gc.collect()
    if flags.fault_hook:  # the tests' faults: a rank killed, hung, slowed or given a NaN loss in this step
        flags.fault_hook("step", step, rank, sharded.model)
    compute_from = metrics.compute_clock(device)  # this rank's own compute, not the wall time collectives equalise
    try:
        with metrics.profile_step(cfg, step, rank, device):  # --profile STEP: a trace of this one
            record = train_step(cfg, sharded, windows, step, position)
    except torch.OutOfMemoryError as e:  # the same step runs out again after a restart: exit 2, and what to change
        fail(metrics.out_of_memory_line(e, step, [u.name for u in sharded.units if u.state() != "free"],
                                        metrics.allocator_held(device), planned))
    except NonFiniteStep as nonfinite:
        e = metrics.nonfinite_line(nonfinite, sharded)  # which rank's loss went bad: an all-gather, on every rank
        skipped.append(step)
        if len(skipped) > cfg.max_skipped_steps:
            fail(f"{e}; stopping after {len(skipped)} such step(s) (--max_skipped_steps {cfg.max_skipped_steps}); "
                 f"nothing from this step was saved")
        if rank == 0:
            print(f"warning: {e} ({len(skipped)} of at most {cfg.max_skipped_steps})", file=sys.stderr, flush=True)
        record = dict(loss=None, grad_norm=None)  # null in metrics.jsonl
    compute_s = metrics.compute_seconds(compute_from, device)
    leftover = metrics.left_behind(sharded, step)  # a fork's bug, named rather than training on stale weights
    if leftover:
        fail(leftover)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return record, compute_s


def save_or_stop(cfg, sharded: ShardedModel, saving, step: int, steps: int, data_state, stop_signals, log,
                 sampler) -> bool:
    """The end of each step: saves what is due and returns whether the run stops (a stop signal on any rank).
    One all-reduce first, so that every rank takes the same decisions: a stop signal on any rank; rank 0 unable to
    write metrics.jsonl or samples.jsonl (the exit code of its error, so that every rank exits with it);
    --async_save: a rank still writing the save in flight, a rank whose write failed."""
    unwritten = log if log.error else sampler if sampler and sampler.error else None
    stop = torch.tensor([bool(stop_signals), exit_code(unwritten.error_cause) if unwritten else 0,
                         bool(saving and saving.writing()), bool(saving and saving.failed())],
                        dtype=torch.float32, device=sharded.device)
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    signalled, unwritable, writing, write_failed = stop.tolist()
    if unwritable:
        fail(unwritten.error if unwritten else "--out_dir: rank 0 cannot write its metrics (its error says why); the "
             "run stops without saving", int(unwritable))
    save_due = bool(signalled) or step == steps or (cfg.ckpt_every and step % cfg.ckpt_every == 0)
    in_flight = saving is not None and saving.pending is not None
    if in_flight and (not writing or write_failed or save_due):  # its write is done, failed, or must be: committed
        try:  # after every rank's write; the wait, measured, is how long training stalled
            path, wait_s, write_s = saving.finish(cfg, sharded.model.cfg, sharded.rank, sharded.world)
        except OD.CheckpointError as e:
            fail(str(e), exit_code(e))
        if sharded.rank == 0:
            print(f"saved checkpoint {path} (written in the background in {write_s:.2f} s; training waited "
                  f"{wait_s:.2f} s for its commit)", flush=True)
    # A stop while a rank still writes keeps that save (docs/operations.md, "The stop save"): the steps since
    # its snapshot took less time than its write, so redoing them after the restart costs less than saving
    # again now. Otherwise the stop saves now. Either way at most one write follows the signal (the planner's
    # lead counts one). The last step always saves: it ends the run.
    stop_save_skipped = signalled and writing and step < steps
    if save_due and not stop_save_skipped:
        save(cfg, sharded, saving, step, data_state, background=saving is not None and not signalled and step < steps)
    if signalled and sharded.rank == 0:
        print(metrics.stop_line(step, steps, stop_signals, stop_save_skipped, cfg.export_hf), flush=True)
    return bool(signalled)


def export(cfg, sharded: ShardedModel, step: int, saving):
    """--export_hf after the last step, from its checkpoint (saved now if this run saved none: --steps 0) by
    tools/export_hf.py, each rank writing its share of the files (hf.export_checkpoint); a failure is one line."""
    if not cfg.export_hf:
        return
    path = checkpoints.save_paths(cfg, step)[2]
    if step == 0:  # decided alike on every rank, not from what each one's view of the filesystem shows
        save(cfg, sharded, saving, step, None, background=False)
    code, error = hf.export_checkpoint(path, cfg, sharded.compute_dtype, sharded.rank, sharded.world)
    if code:
        fail(error, code)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # in the loop, where no step boundary caught it: this rank's line; a collective ends the others
        fail(error_line(e, "while training"), exit_code(e))
    # Exit without interpreter teardown. After a clean run and destroy_process_group(), gloo's threads
    # occasionally abort the process while C++ statics are destroyed (SIGABRT, "terminate called without
    # an active exception"; seen about 1 run in 20 on a loaded 2-core CPU). Under torchrun with
    # --max-restarts a non-zero exit after a finished run would start it again.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
