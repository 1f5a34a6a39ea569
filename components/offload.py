"""Two variations of train.py's step that move state to host memory, which a first reading can skip.

--offload_activations: with --ac full, each block's input waits for backward in pinned host memory
instead of on the GPU. A 70B model at seq 8192 keeps 80 block inputs of 128 MiB each per micro-batch:
10 GiB that leave the GPU for PCIe traffic which, on a side stream, overlaps the blocks' compute.
train.py's run_block is the only caller.

--offload_optimizer (below OffloadedCheckpoint): each unit's fp32 shards (master, gradient, optimizer
state) live in host memory and the optimizer runs on the CPU; the GPU keeps only a compute-dtype copy
of the master shard, 2 B instead of 16 B per parameter / W. It plugs into train.py as train.OffloadedUnit
(what the all-gather reads: gather_input; where a reduce-scattered gradient goes: add_grad, both through
`unit.host`, a HostOptimizer) and train.OffloadedModel (the host's last adds before the gradient norm, the
refresh after the update), which train.setup chooses."""
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

import model as M  # OPTIMIZER_STATE: the fp32 tensors each trained unit keeps


class OffloadedInput:
    """One block's input, kept in host memory for its backward, and its copy back to the device."""

    def __init__(self, host, previous):
        self.host = host
        self.previous = previous  # the input of the block that ran before, whose backward runs next
        self.device = None        # the copy back, once started
        self.ready = None         # CUDA: an event on the copy stream, recorded when that copy is done


def offloaded_checkpoint(x, run, trained: bool):
    """OffloadedCheckpoint on x, with autograd told that its backward must run when the block's weights train but x
    needs no gradient (the first trained block after a frozen prefix, --freeze). Autograd runs a Function's backward
    only if an input needs a gradient, and the weights are not inputs (the recompute reads them as views of the
    unit's buffer; passing the buffer itself would give it a second, empty gradient). An empty leaf that needs one
    stands in for them; nothing is saved for it and its gradient is None."""
    weights_train = torch.empty(0, device=x.device, requires_grad=trained and torch.is_grad_enabled())
    return OffloadedCheckpoint.apply(x, run, weights_train)


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
    def forward(ctx, x, run, weights_train=None):
        """`weights_train`: offloaded_checkpoint's stand-in for the block's weights (above)."""
        ctx.run, ctx.device, ctx.saved = run, x.device, None
        if any(ctx.needs_input_grad):  # a backward will come (evaluation runs under no_grad: none will)
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
        x = OffloadedCheckpoint.wait_copy_back(saved, ctx.device).requires_grad_(ctx.needs_input_grad[0])
        with torch.enable_grad():
            out = ctx.run(x)
        torch.autograd.backward(out, grad_out)  # the weights' gradients reach their unit's buffer through the recompute
        return x.grad, None, None

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

GRAD_SLOTS = 2  # reduce-scattered shards on their way to host memory at once (backward waits for a free slot)


def host_buffer_numel(shard_numels: list[int], tensors_per_unit: list[int]) -> int:
    """fp32 elements of a rank's one host buffer: each unit's state tensors (master, gradient, optimizer
    state: its `tensors_per_unit` x its shard), then GRAD_SLOTS staging slots as large as the largest shard."""
    return sum(c * n for c, n in zip(tensors_per_unit, shard_numels)) + GRAD_SLOTS * max(shard_numels)


def state_tensors(trained: bool, optimizer_state) -> int:
    """fp32 tensors of a unit's state in the host buffer: master, gradient and optimizer state (its names: a fork's
    unit may keep another list); a frozen unit's (--freeze) master shard only."""
    return (2 if trained else 1) + len(optimizer_state)


def host_state_bytes(units: list[tuple[int, bool]]) -> int:
    """--offload_optimizer's host buffer on one rank (HostState), in bytes: `units`, each (shard elements, trained)
    (checks.rank_units). What the run's host-memory check and plan.host_bytes_per_gpu count, byte for byte."""
    counts = [state_tensors(trained, M.OPTIMIZER_STATE if trained else ()) for _, trained in units]  # as train.Unit
    return 4 * host_buffer_numel([n for n, _ in units], counts)


PAGE_LOCKED = []  # (bytes, seconds) of each page_lock in this process


def page_lock(buffer: torch.Tensor, flag: str = "--offload_optimizer"):
    """Pins an ordinary (exactly sized) host tensor with cudaHostRegister. Not pin_memory=True: PyTorch's
    caching host allocator rounds every allocation up to a power of two, so a 70B block's 408 MiB shard at
    W=8 would take 512 MiB, and one 130 GiB buffer 256 GiB. Registered memory is what copies with
    non_blocking=True need to run without the host waiting (tests/fake_cuda.py replaces this)."""
    nbytes = buffer.numel() * buffer.element_size()
    start = time.perf_counter()
    error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0))
    PAGE_LOCKED.append((nbytes, time.perf_counter() - start))  # metrics.print_page_locking: per node, at start-up
    if error:
        raise RuntimeError(f"{flag}: cudaHostRegister of {nbytes / 2**30:,.1f} GiB of host memory failed "
                           f"(CUDA error {error}); is the locked-memory limit (ulimit -l) unlimited?")


def unlock(data_ptr: int):
    torch.cuda.cudart().cudaHostUnregister(data_ptr)


class HostState:
    """One rank's --offload_optimizer host memory and the machinery around it: a single page-locked fp32 buffer
    of which every unit's master, gradient and optimizer state shard is a view, GRAD_SLOTS staging slots for
    the copies between host and device, the copy stream they run on (not the compute stream), and the worker
    thread that adds the gradients into the host accumulators (not the thread that queues the GPU's work)."""

    def __init__(self, units: list, device: torch.device):
        # Each unit's own: master, gradient and optimizer state; a frozen unit's (--freeze) master shard only.
        tensors_per_unit = [state_tensors(u.trained, u.optimizer_state) for u in units]
        shards = [u.shard_numel for u in units]
        state_numel = sum(c * n for c, n in zip(tensors_per_unit, shards))
        start = time.perf_counter()
        self.buffer = torch.zeros(host_buffer_numel(shards, tensors_per_unit), dtype=torch.float32)
        self.zeroed_s, self.page_locked_s = time.perf_counter() - start, None  # start-up cost, for the log
        if device.type == "cuda":
            start = time.perf_counter()
            page_lock(self.buffer)
            self.page_locked_s = time.perf_counter() - start
            # Unregistered before the buffer's memory goes back (bench/gpu.py runs one model after another);
            # not at exit, where the process's memory goes anyway.
            weakref.finalize(self, unlock, self.buffer.data_ptr()).atexit = False
        views = iter(self.buffer[:state_numel].split([n for c, n in zip(tensors_per_unit, shards) for _ in range(c)]))
        for u in units:
            u.master_shard = next(views)
            u.grad_shard = next(views) if u.trained else self.buffer[:0]
            u.optimizer_state = {name: next(views) for name in u.optimizer_state}
        self.slots = list(self.buffer[state_numel:].view(GRAD_SLOTS, max(shards)))
        self.free_slots = list(range(GRAD_SLOTS))
        self.sent = [None] * GRAD_SLOTS  # CUDA: per slot, the event of the last copy up that reads it
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # One thread, so the adds run in the order the shards arrive (the same sums as on the device); it
        # uses as many CPU threads as the rank was given (optimizer_threads; torch's count is per thread).
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="host-adds", initializer=torch.set_num_threads,
                                         initargs=(torch.get_num_threads(),))


class HostOptimizer:
    """What --offload_optimizer adds to a unit whose fp32 shards are views of the rank's HostState: `compute_shard`,
    the device copy the all-gathers read, and the gradient shards on their way to the host."""

    def __init__(self, unit, state: HostState, host_adds: list):
        self.compute_shard = torch.zeros(unit.shard_numel, dtype=unit.gathered.dtype, device=unit.gathered.device)
        self.refreshed = None       # CUDA: the event of compute_shard's latest copy up, until a gather waited for it
        self.state = state          # the rank's one host buffer, its staging slots, copy stream and worker
        self.host_adds = host_adds  # shared by the model's units: (the worker's add, its slot, state), oldest first

    def gather_input(self) -> torch.Tensor:
        """compute_shard for an all-gather; after a refresh the compute stream first waits for its copy up
        (the GPU waits, not the host: the next step's forward starts while the later units' copies run)."""
        if self.refreshed is not None:
            torch.cuda.current_stream(self.compute_shard.device).wait_event(self.refreshed)
            self.refreshed = None
        return self.compute_shard

    def add_grad(self, unit, out: torch.Tensor):
        """A reduce-scattered shard is copied into a staging slot of host memory, on the copy stream without
        waiting (on CUDA), and added into the unit's accumulator by the worker thread once the copy is done:
        this thread goes on queuing backward. At most GRAD_SLOTS wait; when all slots are taken, the oldest
        add is waited for."""
        finish_host_adds(self.host_adds, keep=GRAD_SLOTS - 1)
        state = self.state
        slot = state.free_slots.pop(0)
        host = state.slots[slot].view(out.dtype)[:out.numel()]  # --reduce_dtype bfloat16: the slot's first half
        copied = None
        if out.is_cuda:
            state.copy_stream.wait_stream(torch.cuda.current_stream(out.device))  # after the reduce-scatter
            with torch.cuda.stream(state.copy_stream):
                host.copy_(out, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(state.copy_stream)
        else:
            host.copy_(out)
        # `out` stays alive until the worker has seen the copy done: its memory is not reused before
        self.host_adds.append((state.worker.submit(add_into, unit.grad_shard, host, copied, out), slot, state))


def add_into(accumulator: torch.Tensor, host: torch.Tensor, copied, out: torch.Tensor):
    """On the worker thread: waits for the copy down (CUDA), then adds the shard into the fp32 accumulator.
    A bf16 shard (--reduce_dtype bfloat16) is cast first: the same sum, ~4x faster than a mixed-dtype add_ on
    the CPU (BENCHMARKS.md, host AdamW)."""
    if copied is not None:
        copied.synchronize()
    accumulator.add_(host if host.dtype == accumulator.dtype else host.float())


def offload_optimizer(units: list, host_adds: list) -> HostState:
    """Every unit's fp32 state moved into the rank's one page-locked host buffer, and each unit's device copy."""
    state = HostState(units, units[0].gathered.device)
    for unit in units:
        unit.host = HostOptimizer(unit, state, host_adds)
    return state


def finish_host_adds(host_adds: list, keep: int = 0):
    """Waits for the oldest adds of the worker thread until `keep` remain (raising here what one raised) and
    frees their staging slots. With keep=0 every gradient is in its host accumulator."""
    while len(host_adds) > keep:
        done, slot, state = host_adds.pop(0)
        done.result()
        state.free_slots.append(slot)


def refresh_compute_shards(units: list):
    """After the optimizer (or a load) changed the host master shards: each is cast to the compute dtype on
    the host, into a staging slot, and crosses PCIe in those 2 B (not 4) on the copy stream; the CPU casts
    the next unit while one is copied. The host's cast rounds to nearest even, as the device's does: the
    same bits as the trainer without offload (tests/test_offload.py). The gathers wait for each unit's copy
    (HostOptimizer.gather_input). Called between steps, when no gradient is on its way down."""
    state, device = units[0].host.state, units[0].host.compute_shard.device
    assert len(state.free_slots) == GRAD_SLOTS, "a refresh while gradients are on their way to the host"
    if device.type != "cuda":
        for unit in units:
            unit.host.compute_shard.copy_(unit.master_shard)
        return
    state.copy_stream.wait_stream(torch.cuda.current_stream(device))  # the gathers that read the old copies
    for i, unit in enumerate(units):
        slot, shard = i % GRAD_SLOTS, unit.host.compute_shard
        if state.sent[slot] is not None:  # its previous copy up has read it
            state.sent[slot].synchronize()
        host = state.slots[slot].view(shard.dtype)[:shard.numel()]
        host.copy_(unit.master_shard)  # the cast, on the host
        with torch.cuda.stream(state.copy_stream):
            shard.copy_(host, non_blocking=True)
            state.sent[slot] = unit.host.refreshed = torch.cuda.Event()
            state.sent[slot].record(state.copy_stream)


def optimizer_threads(cfg, device: torch.device, local_world: int, cores: int) -> int | None:
    """--offload_optimizer on GPUs: the optimizer runs on the CPU, over 16 B per parameter / W, and torchrun
    gives each worker one thread (OMP_NUM_THREADS=1). Each rank takes its share of the node's cores."""
    if cfg.offload_optimizer and device.type == "cuda":
        if os.environ.get("ZERO3_NUMA_BINDING") == "exclusive":  # launch.sh: torchrun bound these cores to us alone
            return max(1, cores)
        return max(1, cores // local_world)
    return None
