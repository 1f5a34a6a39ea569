"""Two variations of train.py's step that move state to host memory, which a first reading can skip.

--offload_activations: with --ac full, each block's input waits for backward in pinned host memory
instead of on the GPU. A 70B model at seq 8192 keeps 80 block inputs of 128 MiB each per micro-batch:
10 GiB that leave the GPU for PCIe traffic which, on a side stream, overlaps the blocks' compute.
train.py's run_block is the only caller.

--offload_optimizer (below OffloadedCheckpoint): each unit's fp32 shards (master, gradient, optimizer
state) live in host memory and the optimizer runs on the CPU; the GPU keeps only a compute-dtype copy
of the master shard, 2 B instead of 16 B per parameter / W. train.Unit asks `unit.host` in two places:
what the all-gather reads (gather_input) and where a reduce-scattered gradient goes (finish_reduces)."""
import os

import torch


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


# ------------------------------------------------------------------------------------------------
# --offload_optimizer
# ------------------------------------------------------------------------------------------------

GRAD_SLOTS = 2  # reduce-scattered slices on their way to host memory at once (backward waits for a free slot)


def host_buffer_numel(shard_numels: list[int], tensors_per_unit: int) -> int:
    """fp32 elements of a rank's one host buffer: each unit's state tensors (master, gradient, optimizer
    state: `tensors_per_unit` x its shard), then GRAD_SLOTS staging slots as large as the largest shard. What
    plan.host_bytes_per_gpu and checks.check_host_memory count, byte for byte."""
    return tensors_per_unit * sum(shard_numels) + GRAD_SLOTS * max(shard_numels)


def page_lock(buffer: torch.Tensor):
    """Pins an ordinary (exactly sized) host tensor with cudaHostRegister. Not pin_memory=True: PyTorch's
    caching host allocator rounds every allocation up to a power of two, so a 70B block's 408 MiB shard at
    W=8 would take 512 MiB, and one 130 GiB buffer 256 GiB. Registered memory is what copies with
    non_blocking=True need to run without the host waiting (tests/fake_cuda.py replaces this)."""
    nbytes = buffer.numel() * buffer.element_size()
    error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0))
    if error:
        raise RuntimeError(f"--offload_optimizer: cudaHostRegister of {nbytes / 2**30:,.1f} GiB of host memory failed "
                           f"(CUDA error {error}); is the memory locked-memory limit (ulimit -l) unlimited?")


class HostState:
    """One rank's --offload_optimizer host memory: a single page-locked fp32 buffer of which every unit's
    master, gradient and optimizer state shard is a view, and GRAD_SLOTS staging slots for the copies between
    host and device."""

    def __init__(self, units: list, device: torch.device):
        tensors_per_unit = 2 + len(units[0].optimizer_state)
        shards = [u.shard_numel for u in units]
        self.buffer = torch.zeros(host_buffer_numel(shards, tensors_per_unit), dtype=torch.float32)
        if device.type == "cuda":
            page_lock(self.buffer)
        views = iter(self.buffer[:tensors_per_unit * sum(shards)].split(
            [n for n in shards for _ in range(tensors_per_unit)]))
        for u in units:
            u.master_shard, u.grad_shard = next(views), next(views)
            u.optimizer_state = {name: next(views) for name in u.optimizer_state}
        self.free_slots = list(self.buffer[tensors_per_unit * sum(shards):].view(GRAD_SLOTS, max(shards)))


class HostOptimizer:
    """What --offload_optimizer adds to a unit whose fp32 shards are views of the rank's HostState: `compute_shard`,
    the device copy the all-gathers read, and the gradient shards on their way to the host."""

    def __init__(self, unit, state: HostState, host_adds: list):
        self.compute_shard = torch.zeros(unit.shard_numel, dtype=unit.gathered.dtype, device=unit.gathered.device)
        self.state = state          # the rank's one host buffer and its staging slots
        self.host_adds = host_adds  # shared by the model's units: (unit, host copy, device shard, copied event, slot)

    def add_grad(self, unit, out: torch.Tensor):
        """A reduce-scattered shard is copied into a staging slot of host memory without waiting (on CUDA) and
        added there later, by finish_host_adds: the host thread keeps queuing backward meanwhile. At most
        GRAD_SLOTS copies wait: the oldest is finished first when all slots are taken."""
        finish_host_adds(self.host_adds, keep=GRAD_SLOTS - 1)
        slot = self.state.free_slots.pop(0)
        host = slot.view(out.dtype)[:out.numel()]  # --reduce_dtype bfloat16: the slot's first half, as bf16
        host.copy_(out, non_blocking=True)
        copied = torch.cuda.Event() if out.is_cuda else None
        if copied is not None:
            copied.record()
        self.host_adds.append((unit, host, out, copied, slot))  # `out` stays alive until the copy has read it


def offload_optimizer(units: list, host_adds: list) -> HostState:
    """Every unit's fp32 state moved into the rank's one page-locked host buffer, and each unit's device copy."""
    state = HostState(units, units[0].gathered.device)
    for unit in units:
        unit.host = HostOptimizer(unit, state, host_adds)
    return state


def finish_host_adds(host_adds: list, keep: int = 0):
    """Waits for the oldest gradient copies to host memory until `keep` remain, adds each into its unit's
    host accumulator (fp32, as on the device) and frees its staging slot."""
    while len(host_adds) > keep:
        unit, host, _, copied, slot = host_adds.pop(0)
        if copied is not None:
            copied.synchronize()
        # A bf16 shard (--reduce_dtype bfloat16) is cast first: the same sum, ~4x faster than a mixed-dtype
        # add_ on the CPU (BENCHMARKS.md, host AdamW), and this runs while backward is being queued.
        unit.grad_shard.add_(host if host.dtype == unit.grad_shard.dtype else host.float())
        unit.host.state.free_slots.append(slot)


def refresh_compute_shards(units: list):
    """After the optimizer (or a load) changed the host master shards: each crosses PCIe in fp32 and is cast
    on the device, so the cast is the same arithmetic as without offload."""
    for unit in units:
        unit.host.compute_shard.copy_(unit.master_shard.to(unit.host.compute_shard.device, non_blocking=True))


def optimizer_threads(cfg, device: torch.device, local_world: int, cores: int) -> int | None:
    """--offload_optimizer on GPUs: the optimizer runs on the CPU, over 16 B per parameter / W, and torchrun
    gives each worker one thread (OMP_NUM_THREADS=1). Each rank takes its share of the node's cores."""
    if cfg.offload_optimizer and device.type == "cuda":
        if os.environ.get("ZERO3_NUMA_BINDING") == "exclusive":  # launch.sh: torchrun bound these cores to us alone
            return max(1, cores)
        return max(1, cores // local_world)
    return None
