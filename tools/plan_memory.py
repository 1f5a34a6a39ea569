"""The planner's memory model (tools/plan.py reads it): what each moment of a step holds on a GPU, by part, with
what a block keeps for backward, the state and the optimizer's temporaries measured by running train.py's own code
under fake tensors ("Reading the code" below). docs/planning.md says how each part is modelled; tools/plan.py adds
time, cost, host memory, the fit and the report."""

import contextlib
import dataclasses
import gc
import weakref

import numpy as np
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import model as M
import train as T
from components import flags

GIB = 2**30
COMPUTE_BYTES = 2                                 # bf16: gathered weights, their gradients, activations
REDUCE_BYTES = {"bfloat16": 2, "float32": 4}      # by --reduce_dtype
FRAGMENTATION = 0.10                              # allocator slack on everything but the persistent state (ASSUMPTIONS)

# ----------------------------------------------------------------------------------------------
# Reading the code: what a block keeps for backward, what its backward brings back, what the optimizer keeps
# ----------------------------------------------------------------------------------------------
#
# The trainer's own code (train.run_block, train.Unit, train.optimizer_step) runs under FakeTensorMode, where
# ops make shapes and autograd nodes and allocate nothing, and each storage an op creates is counted until it
# dies (LiveStorages): after a block's forward, what is alive besides its output is what autograd keeps for
# backward, whoever keeps it. A fork is read the same way (docs/planning.md, "What is measured").

class LiveStorages(TorchDispatchMode):
    """Bytes of the storages the ops under it create, alive now and at their peak (`at_peak`: [weakref, bytes]
    each, compared by identity: an id may be reused once its storage dies); those in `known` (the weights, whose
    views ops save, and the inputs) are not counted."""

    def __init__(self, known: list):
        super().__init__()
        self.known = {id(s) for s in known}
        self.live = {}  # id(storage) -> [weakref, bytes]
        self.current_bytes = self.peak_bytes = 0
        self.at_peak = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage, key = t.untyped_storage(), id(t.untyped_storage())
                if key not in self.live and key not in self.known:
                    self.live[key] = [weakref.ref(storage, lambda _, key=key: self.drop(key)), storage.nbytes()]
                    self.current_bytes += storage.nbytes()
                    if self.current_bytes > self.peak_bytes:
                        self.restart_peak()
        return out

    def drop(self, key):
        entry = self.live.pop(key, None)
        if entry:
            self.current_bytes -= entry[1]

    def restart_peak(self):
        self.peak_bytes, self.at_peak = self.current_bytes, [list(v) for v in self.live.values()]


@contextlib.contextmanager
def attention_as_on_the_gpu(kernel: str):
    """model.attention as the GPU machines run it (docs/planning.md: attention). "flash": flash-attn or SDPA's flash
    kernel, as on the CPU. "efficient": SDPA's memory-efficient kernel with --doc_mask's mask and K/V repeated
    to the query's heads (model.sdpa_arguments on CUDA), its aten op called as CUDA's SDPA calls it."""
    if kernel == "flash":
        yield
        return
    def efficient(q, k, v, layout=None):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, layout.mask, True)[0]
        return out.transpose(1, 2)
    real, M.attention = M.attention, efficient
    try:
        yield
    finally:
        M.attention = real


READINGS = {}  # what the planner measured, by what it ran: the arguments and the code


def read_block(mcfg: M.ModelConfig, policy: str, micro_batch: int, seq_len: int, kernel: str = "flash",
               offload: bool = False, trained: bool = True, input_grad: bool = True, frozen=frozenset()) -> dict:
    """One block's forward and backward as train.run_block runs them: bytes kept for backward (`kept`), and at
    its backward's peak its weights' gradients (`gradients`) and the rest (`backward`). `trained`: its weights
    take gradients, but those named in `frozen` (a block of several units, some frozen); `input_grad`: its input
    needs one (False in a frozen prefix)."""
    code = (T.run_block, M.attention, M.Block.forward, M.Attention.forward, M.MLP.forward,
            M.RMSNorm.forward)  # what a test or a fork swaps in one process gets a reading of its own
    key = (repr(mcfg), policy, micro_batch, seq_len, kernel, offload, trained, input_grad, frozen, code)
    if key not in READINGS:
        gc.disable()  # the cycle collector would free what cycles made here hold at moments that depend on
        # the process's history: off while measuring, the readings are the same in any process
        M.FIXED_SHAPES = True  # fake tensors hold no values: a routed block takes its fixed-shape path
        try:
            READINGS[key] = measure_block(mcfg, policy, micro_batch, seq_len, kernel, offload, trained, input_grad,
                                          frozen)
        except (DynamicOutputShapeException, DataDependentOutputException) as e:
            raise Unplannable(f"the block's forward makes a tensor whose shape depends on the data ({e.func}: an "
                              f"MoE's routing, say), which the planner cannot run on fake tensors; give the block a "
                              f"path with fixed shapes under model.FIXED_SHAPES, which the planner sets while it "
                              f"measures (docs/forking.md, \"A block whose shapes depend on the data\")") from None
        finally:
            M.FIXED_SHAPES = False
            gc.enable()
    return READINGS[key]


class Unplannable(ValueError):
    """A fork whose block the planner cannot measure: --plan refuses it in one line (exit 2)."""


def measure_block(mcfg, policy, micro_batch, seq_len, kernel, offload, trained, input_grad, frozen) -> dict:
    """read_block's measurement, uncached. The output's gradient (memory_by_phase counts it) is not in `backward`."""
    with torch.device("meta"):
        block = M.Block(mcfg)
    with FakeTensorMode(allow_non_fake_inputs=True), attention_as_on_the_gpu(kernel):
        for name, p in list(block.named_parameters()):  # bf16 fake weights, as train.Unit points them at its buffer
            module, _, attr = name.rpartition(".")
            weight = torch.nn.Parameter(torch.empty(p.shape, dtype=torch.bfloat16),
                                        requires_grad=trained and name not in frozen)
            setattr(block.get_submodule(module), attr, weight)
        x_in = torch.empty(micro_batch, seq_len, mcfg.dim, dtype=torch.bfloat16, requires_grad=input_grad)
        if kernel == "flash":
            layout = None
            positions = torch.arange(seq_len).expand(micro_batch, seq_len)
        else:  # the mask SDPA reads, for 4 documents per row (its size does not depend on them)
            starts = np.zeros((micro_batch, seq_len), dtype=bool)
            starts[:, ::max(1, seq_len // 4)] = True
            layout = M.document_layout(starts, "cpu", torch.bfloat16)
            positions = layout.positions
        cos, sin = M.rope_cos_sin(mcfg, positions, torch.bfloat16)
        inputs = [x_in, cos, sin] + ([layout.mask] if layout else [])
        live = LiveStorages([t.untyped_storage() for t in list(block.parameters()) + inputs])
        with live:
            x = x_in * 1  # the block's input as the trainer's: made by the step before it, not a leaf
            out = T.run_block(block, policy, x, cos, sin, layout, offload, trained=trained)
            del x
            kept = live.current_bytes - out.untyped_storage().nbytes()
            grad_out = torch.empty_like(out)
            live.restart_peak()
            before = live.current_bytes
            if out.requires_grad:
                out.backward(grad_out)
        weight_grads = [p.grad.untyped_storage() for p in block.parameters() if p.grad is not None]
        gradients = sum(b for ref, b in live.at_peak if any(ref() is g for g in weight_grads))
    return dict(kept=kept, gradients=gradients, backward=live.peak_bytes - before - gradients)


def state_bytes_per_param(frozen: bool = False) -> float:
    """Persistent bytes per parameter of a unit's shard, read from a train.Unit: 16 B with AdamW (fp32 master,
    gradient, optimizer state), a frozen unit's master alone."""
    unit = meta_unit(frozen)
    return unit.persistent_bytes() / unit.shard_numel


def saved_bytes_per_element(frozen: bool = False) -> list[int]:
    """Bytes per element of each tensor in a unit's checkpoint file (master, optimizer state): [4, 4, 4] with
    AdamW, [4] for a frozen unit."""
    unit = meta_unit(frozen)
    return [t.element_size() for t in (unit.master_shard, *unit.optimizer_state.values())]


def meta_unit(frozen: bool):
    """A tiny model's head as a train.Unit on the meta device, trained or frozen."""
    key = ("unit", T.Unit, T.Unit.__init__, M.OPTIMIZER_STATE, frozen)
    if key not in READINGS:
        READINGS[key] = fake_units(M.tiny(), 1, torch.device("meta"), trained=not frozen)[-1]
    return READINGS[key]


def fake_units(mcfg: M.ModelConfig, world: int, device=torch.device("cpu"), trained: bool = True) -> list:
    """train.Unit's embedding, one block and head of `mcfg`, as rank 0 of `world` (on the CPU: under FakeTensorMode)."""
    with torch.device("meta"):
        model = M.Llama(dataclasses.replace(mcfg, n_layers=1))
    return [T.Unit(name, model, names, 0, world, device, torch.bfloat16, trained=trained)
            for name, names in M.sharding_units(model)]


def unit_kind(name: str) -> str:
    """A unit's name as block 0's (`layers.7.lora`: `layers.0.lora`): fake_units builds one block."""
    block = M.block_of(name)
    return name if block is None else "layers.0" + name.removeprefix(f"layers.{block}")


def optimizer_temporary_bytes(mcfg: M.ModelConfig, cfg, world: int) -> int:
    """What train.optimizer_step allocates beside the state at its peak, on rank 0's shards of the embedding, a
    block and the head (fused AdamW: next to nothing): of those that train, as the trainer steps them (--freeze)."""
    trained = {unit_kind(name) for name in unit_names(mcfg) if name not in frozen_unit_names(mcfg, cfg)}
    key = ("optimizer", repr(mcfg), world, T.optimizer_step, T.Unit.__init__, M.OPTIMIZER_STATE,
           M.sharding_units, tuple(sorted(trained)))
    if key not in READINGS:
        with FakeTensorMode(allow_non_fake_inputs=True):
            units = [u for u in fake_units(mcfg, world) if unit_kind(u.name) in trained]
            live = LiveStorages([t.untyped_storage() for u in units
                                 for t in (u.master_shard, u.grad_shard, u.gathered, *u.optimizer_state.values())])
            with live:
                T.optimizer_step(units, cfg, cfg.lr, 1)
        READINGS[key] = live.peak_bytes
    return READINGS[key]


# ----------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------

def meta_model(mcfg: M.ModelConfig) -> M.Llama:
    """`mcfg`'s model on the meta device (shapes only), built once per config and model code."""
    key = ("model", repr(mcfg), M.Llama, M.Block)
    if key not in READINGS:
        with torch.device("meta"):
            READINGS[key] = M.Llama(mcfg)
    return READINGS[key]


def model_units(mcfg: M.ModelConfig) -> list[tuple[str, int, list[str]]]:
    """(name, parameters, their names) of each sharding unit in train.build_units' order, as model.sharding_units
    names them for the model built on the meta device: a fork's units too (a block may be one unit or several)."""
    key = ("units", repr(mcfg), M.sharding_units, M.Llama, M.Block)
    if key not in READINGS:
        model = meta_model(mcfg)
        numels = M.numels_by_unit(model)
        READINGS[key] = [(name, numels[name], names) for name, names in M.sharding_units(model)]
    return READINGS[key]


def unit_numels(mcfg: M.ModelConfig) -> list[int]:
    return [n for _, n, _ in model_units(mcfg)]


def unit_names(mcfg: M.ModelConfig) -> list[str]:
    return [name for name, _, _ in model_units(mcfg)]


def block_numels(mcfg: M.ModelConfig, world: int = 1) -> list[int]:
    """Each block's parameters, its units' together (train.make_stages gathers them as one stage), padded for W."""
    by_block = [0] * mcfg.n_layers
    for name, n, _ in model_units(mcfg):
        if M.block_of(name) is not None:
            by_block[M.block_of(name)] += padded(n, world)
    return by_block


def padded(numel: int, world: int) -> int:
    return -(-numel // world) * world


def grad_peak_numel(unit_numel: int) -> int:
    """Most compute-dtype gradient elements alive in one unit's backward: its parameters' (split views of
    `gathered`, Unit.set_views), and split's backward concatenating them."""
    return 2 * unit_numel


def reduce_hook_bytes(unit_numel: int, compute_bytes: int, reduce_bytes: int) -> int:
    """Full-unit gradient bytes alive as train.reduce_scatter_grad casts a unit's gradient: gathered.grad and its
    copy in the reduce dtype (none if the same). The previous unit's reduce-scatter finished first."""
    copy = reduce_bytes if reduce_bytes != compute_bytes else 0
    return (compute_bytes + copy) * unit_numel


def in_flight_reduce_bytes(unit_numel: int, reduce_bytes: int, world: int) -> float:
    """A reduce-scatter in flight: its input, the unit's whole gradient, and its output, this rank's shard."""
    return reduce_bytes * unit_numel * (1 + 1 / world)


def unit_gradient_bytes(unit_numel: int, in_flight_numel: int, reduce_bytes: int, world: int) -> dict:
    """Gradient bytes of one unit's backward by part, at the larger of its two moments (docs/planning.md:
    gradient_accumulation)."""
    concat = dict(gradients=COMPUTE_BYTES * grad_peak_numel(unit_numel),
                  reduce_buffers=in_flight_reduce_bytes(in_flight_numel, reduce_bytes, world))
    cast_total = reduce_hook_bytes(unit_numel, COMPUTE_BYTES, reduce_bytes)
    cast = dict(gradients=COMPUTE_BYTES * unit_numel,
                reduce_buffers=cast_total - COMPUTE_BYTES * unit_numel + reduce_bytes * unit_numel / world)
    return max(concat, cast, key=lambda parts: sum(parts.values()))


def policies_per_block(mcfg: M.ModelConfig, cfg) -> list[str]:
    """Each block's policy, the trainer's own rule (model.block_policies: --ac for the first --ac_blocks)."""
    return M.block_policies(mcfg.n_layers, cfg.ac, cfg.ac_blocks, cfg.ac_rest)


def offloaded_blocks(mcfg: M.ModelConfig, cfg) -> int:
    """Blocks whose input --offload_activations keeps in pinned host memory: those running --ac (full)."""
    if not cfg.offload_activations:
        return 0
    return mcfg.n_layers if cfg.ac_blocks < 0 else min(cfg.ac_blocks, mcfg.n_layers)


def frozen_unit_names(mcfg: M.ModelConfig, cfg) -> list[str]:
    """The units --freeze freezes (flags.frozen_units, what train.py freezes)."""
    key = ("frozen", repr(mcfg), cfg.freeze, M.sharding_units)
    if key not in READINGS:
        READINGS[key] = flags.frozen_units(meta_model(mcfg), cfg.freeze)[0] if cfg.freeze else []
    return READINGS[key]


def block_training(mcfg: M.ModelConfig, cfg) -> list[tuple[bool, bool, frozenset]]:
    """(trained, its input needs a gradient, its parameters in frozen units) of each block: a block trains when
    one of its units does; no input needs a gradient before the first trained unit."""
    frozen = frozen_unit_names(mcfg, cfg)
    trained, frozen_params = [False] * mcfg.n_layers, [set() for _ in range(mcfg.n_layers)]
    for name, _, params in model_units(mcfg):
        i = M.block_of(name)
        if i is None:
            continue
        if name in frozen:
            frozen_params[i].update(p.split(".", 2)[2] for p in params)  # layers.3.mlp.up_proj.weight: mlp.up_...
        else:
            trained[i] = True
    return [(t, "embed" not in frozen or any(trained[:i]), frozenset(frozen_params[i]) if t else frozenset())
            for i, t in enumerate(trained)]


def block_readings(mcfg: M.ModelConfig, cfg, kernel: str = "flash") -> list[tuple[dict, bool]]:
    """(read_block's bytes, offloaded?) of each block in forward order, by its policy, offload and training."""
    n_offloaded = offloaded_blocks(mcfg, cfg)
    blocks = [(policy, i < n_offloaded, *training)
              for i, (policy, training) in enumerate(zip(policies_per_block(mcfg, cfg), block_training(mcfg, cfg)))]
    readings = {b: read_block(mcfg, b[0], cfg.micro_batch_size, cfg.seq_len, kernel, *b[1:]) for b in set(blocks)}
    return [(readings[b], b[1]) for b in blocks]


def block_kept_bytes(mcfg: M.ModelConfig, cfg, kernel: str = "flash") -> list[tuple[int, bool]]:
    """(bytes kept for backward, offloaded?) of each block, in forward order."""
    return [(r["kept"], off) for r, off in block_readings(mcfg, cfg, kernel)]


def saved_activation_bytes(mcfg: M.ModelConfig, cfg, blocks: int, kernel: str = "flash") -> float:
    """What the first `blocks` blocks keep for backward on the GPU; of the offloaded ones ~2 are in transit."""
    kept = block_kept_bytes(mcfg, cfg, kernel)[:blocks]
    offloaded = [b for b, off in kept if off and b]
    return sum(b for b, off in kept if not off) + sum(offloaded[:2])


def recompute_peak_bytes(mcfg: M.ModelConfig, cfg, kernel: str = "flash") -> dict:
    """The worst block's backward at its peak: what blocks 0..i keep (backward runs last to first) and what
    block i's backward adds (read_block)."""
    worst, on_gpu, offloaded = dict(activations=0, gradients=0), 0, []
    for r, off in block_readings(mcfg, cfg, kernel):  # saved_activation_bytes(i + 1), incrementally
        if off:
            offloaded += [r["kept"]] if r["kept"] else []
        else:
            on_gpu += r["kept"]
        if r["kept"] or r["gradients"]:  # it runs a backward
            parts = dict(activations=on_gpu + sum(offloaded[:2]) + r["backward"], gradients=r["gradients"])
            worst = max(worst, parts, key=lambda p: sum(p.values()))
    return worst


def ce_chunk_tokens(cfg) -> int:
    tokens = cfg.micro_batch_size * cfg.seq_len
    return min(cfg.ce_chunk, tokens) if cfg.ce_chunk else tokens


def logits_bytes(mcfg: M.ModelConfig, cfg) -> float:
    """One cross-entropy chunk at its softmax's backward (model.Llama.head_loss): the fp32 log-softmax output,
    its gradient and the logits' fp32 gradient."""
    return ce_chunk_tokens(cfg) * mcfg.vocab_size * (4 + 4 + 4)


def head_backward_bytes(mcfg: M.ModelConfig, cfg, head: int, emb: int, world: int) -> dict:
    """The head's backward at the worst of its moments: a chunk's softmax backward (beside the weight gradient
    of the chunks before it), its weight-gradient matmul (two weight gradients, then added), and the hook
    (unit_gradient_bytes; tied, the matmul's gradient waits in the embedding unit). A frozen unit has none."""
    cbytes, rbytes = COMPUTE_BYTES, REDUCE_BYTES[cfg.reduce_dtype]
    frozen = frozen_unit_names(mcfg, cfg)
    emb_trained, head_trained = "embed" not in frozen, "head" not in frozen
    weight = mcfg.vocab_size * mcfg.dim * (emb_trained if mcfg.tie_embeddings else head_trained)
    earlier_chunks = 1 if cfg.micro_batch_size * cfg.seq_len > ce_chunk_tokens(cfg) else 0
    softmax = dict(gradients=cbytes * weight * earlier_chunks, reduce_buffers=0, logits=logits_bytes(mcfg, cfg))
    matmul = dict(gradients=cbytes * weight * (1 + earlier_chunks), reduce_buffers=0,
                  logits=cbytes * ce_chunk_tokens(cfg) * mcfg.vocab_size)
    hook = (dict(gradients=cbytes * (2 * emb * emb_trained + 2 * head * head_trained), reduce_buffers=0)
            if mcfg.tie_embeddings else unit_gradient_bytes(head, 0, rbytes, world) if head_trained
            else dict(gradients=0, reduce_buffers=0))
    return max(softmax, matmul, dict(hook, logits=0), key=lambda parts: sum(parts.values()))


def unit_state_bytes_per_param(mcfg: M.ModelConfig, cfg) -> list[float]:
    """Each unit's persistent bytes per parameter of its shard (state_bytes_per_param), frozen or trained."""
    frozen = frozen_unit_names(mcfg, cfg)
    per_param = {f: state_bytes_per_param(f) for f in (False, True)}
    return [per_param[name in frozen] for name in unit_names(mcfg)]


def memory_by_phase(mcfg: M.ModelConfig, cfg, world: int, flash_attn: bool | None = None) -> dict:
    """Bytes per GPU by part at the moments memory peaks in a step. `flash_attn`: whether flash-attn imports on
    the GPUs; None, for --plan: each moment the larger of the two, all its parts from one (docs/planning.md:
    attention)."""
    if flash_attn is None:
        both = [memory_by_phase(mcfg, cfg, world, flash) for flash in (True, False)]
        return {p: max((b[p] for b in both), key=lambda parts: sum(parts.values())) for p in both[0]}
    numels = unit_numels(mcfg)
    emb, block, head = padded(numels[0], world), max(block_numels(mcfg, world)), padded(numels[-1], world)
    cbytes, rbytes = COMPUTE_BYTES, REDUCE_BYTES[cfg.reduce_dtype]
    tied, layers, tokens = mcfg.tie_embeddings, mcfg.n_layers, cfg.micro_batch_size * cfg.seq_len
    kernel = "efficient" if cfg.doc_mask and not flash_attn else "flash"  # attention_as_on_the_gpu
    # SDPA's mask, micro_batch x T x T (rows padded to 8), for each micro-batch of the step (train.micro_batches)
    micro_steps = max(1, cfg.batch_size // (world * cfg.micro_batch_size))
    mask_bytes = micro_steps * cfg.micro_batch_size * cfg.seq_len * (-(-cfg.seq_len // 8) * 8) * cbytes
    mask = mask_bytes * (kernel == "efficient")
    prefetched = block if cfg.prefetch else 0  # the previous unit's all-gather, started as this one runs
    # ... and its input, this rank's shard cast to the compute dtype (train.Unit.gather_input), alive until it
    # completes; --offload_optimizer gathers from the compute-dtype copy the state keeps, no cast
    sending = 0 if cfg.offload_optimizer else prefetched / world
    # a block's largest unit with a gradient (a block may be several units, some frozen: model.sharding_units)
    frozen = frozen_unit_names(mcfg, cfg)
    block_unit = max((padded(n, world) for name, n, _ in model_units(mcfg)
                      if M.block_of(name) is not None and name not in frozen), default=0)
    # the head's gradient is reduced while the last block runs backward; a frozen unit has none to reduce
    in_flight = max(head * ("head" not in frozen), block_unit)
    reduce_buffers = in_flight_reduce_bytes(in_flight, rbytes, world)
    # tied: the head's part of the embedding gradient waits for the embedding's (none if it is frozen)
    waiting = cbytes * emb * (tied and "embed" not in frozen)
    # --offload_optimizer: the fp32 state lives in host memory; the GPU keeps a compute-dtype copy of its shards
    per_param = [cbytes] * len(numels) if cfg.offload_optimizer else unit_state_bytes_per_param(mcfg, cfg)
    state = sum(b * padded(n, world) for b, n in zip(per_param, numels)) / world

    def phase(gathered, gradients, reduce, activations, logits=0.0, optimizer=0.0):
        dynamic = dict(gathered_weights=cbytes * gathered, gradients=gradients, reduce_buffers=reduce,
                       activations=activations, logits=logits, optimizer_temporaries=optimizer)
        return dict(state=state, context_and_nccl=cfg.outside_gib * GIB, **dynamic,
                    fragmentation=FRAGMENTATION * sum(dynamic.values()))

    head_parts = head_backward_bytes(mcfg, cfg, head, emb, world)
    block_grads = (unit_gradient_bytes(block_unit, in_flight, rbytes, world)
                   if block_training(mcfg, cfg)[-1][0] else dict(gradients=0, reduce_buffers=0))  # frozen: none
    # final norm: fp32 input, output, and normalized (for its weight's gradient: none if the head is frozen)
    head_saved = tokens * (4 + 2 + 2 * ("head" not in frozen)) * mcfg.dim
    input_gradient = tokens * cbytes * mcfg.dim  # the gradient of the stage's input, on its way to the stage before
    saved = saved_activation_bytes(mcfg, cfg, layers, kernel)
    recompute = recompute_peak_bytes(mcfg, cfg, kernel)
    return {
        "head backward": phase(head + emb * tied + prefetched + sending, head_parts["gradients"],
                               head_parts["reduce_buffers"], saved + head_saved + input_gradient + mask,
                               head_parts["logits"]),
        "block recompute": phase(block + prefetched + sending, recompute["gradients"] + waiting, reduce_buffers,
                                 recompute["activations"] + input_gradient + mask),
        "block gradient sum": phase(block + prefetched + sending, block_grads["gradients"] + waiting,
                                    block_grads["reduce_buffers"],
                                    # its own saved tensors are gone; its input's gradient is not
                                    saved_activation_bytes(mcfg, cfg, layers - 1, kernel) + input_gradient + mask),
        # after the last micro-batch: every unit free, the optimizer's own temporaries
        "optimizer step": phase(0, 0, 0, 0, optimizer=0 if cfg.offload_optimizer else
                                optimizer_temporary_bytes(mcfg, cfg, world)),
    }
