"""train.train_step on fake CUDA: the trainer's CUDA path, run as one rank of W on a CPU-only torch.

    python tests/fake_cuda.py OUT.json [--rank R] [--world W] [--flash] [--model_json JSON] -- TRAIN_FLAGS

runs one optimizer step of train.py's own ShardedModel and train_step with --device cuda, as rank R of W,
at any shape (70B included: no tensor has memory), and writes what ran and how much device memory it
held to OUT.json. Build the shim first (`build_shim`, what tests/test_fake_cuda.py and bench/fake_memory.py
do): it must be loaded before `import torch`, so every run is a fresh process.

What is real: train.py, model.py and offload.py unmodified (gather/free through storage resize, prefetch,
backward boundaries, checkpointing, the reduce-scatter hooks, fused AdamW, both offloads), autograd, and
every op's output shape, dtype and device (FakeTensorMode). What stands in:
  - CUDA itself: tests/fake_cuda_shim.cpp (a device guard and hooks; no kernel runs, nothing is computed);
  - streams, events and record_stream: FakeStream / FakeEvent below, which count what they are asked;
  - NCCL: torch's fake process group, which moves nothing; `check_collective` adds the checks NCCL makes
    (shapes, dtypes, device) and fails the run on a collective NCCL would refuse;
  - the attention kernels. On fake CUDA, SDPA can only take its math path (the CPU build cannot choose a
    CUDA kernel), which holds B x H x T x T scores: `modelled_sdpa` makes the choice CUDA's SDPA makes
    (flash for unmasked bf16/fp16, memory-efficient for a mask with K/V at full heads, math otherwise) and
    calls that kernel's own aten op, whose meta function gives its outputs and whose autograd node saves
    what the real one saves. `--flash` installs a stand-in `flash_attn` package whose ops have the real
    ones' names and signatures (flash-attn 2.7), so the varlen path and the selective policy's saved ops
    run. Backward kernels' scratch memory (fp32 dq accumulators, expanded dk/dv) is a MODEL, see
    `kernel_workspace_bytes`;
  - data: `Windows`, token ids without meaning (with --doc_mask, several documents per row), and the one
    host read of the step (`.tolist()`), answered with plausible numbers.
Device memory is counted as torch.cuda.memory_allocated counts it (`DeviceMemory`): each storage an op
creates on the device, rounded up to 512 B, until it is freed or resized (the gathered buffers are
resized). Two things a CPU build does differently from a CUDA one are put back as CUDA does them, or
they would add 1.4 GiB and 2 GiB at 70B that no GPU allocates: silu_backward takes a composite fallback
on a CUDA tensor (6 ops and their temporaries instead of one kernel: `install_cuda_stand_ins`), and
autograd sums two gradients of one tensor out of place for a FakeTensor, in place for a plain tensor
(`DeviceMemory.accumulated_in_place`). Not modelled: the caching allocator's fragmentation, CUDA/NCCL's
own memory, memory a record_stream keeps until its stream catches up.
"""
import argparse
import collections
import contextlib
import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import weakref

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHIM_SOURCE = os.path.join(HERE, "fake_cuda_shim.cpp")


# ------------------------------------------------------------------------------------------------
# The shim: built in one process, loaded before `import torch` in another
# ------------------------------------------------------------------------------------------------

def build_shim(build_dir: str) -> str:
    """Compiles tests/fake_cuda_shim.cpp against the installed torch's headers and libraries, once per
    source and torch version (cached in build_dir). Returns the .so's path; raises RuntimeError with one
    line when there is no compiler or it fails."""
    import torch  # only for its paths and ABI: this process never loads the shim
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler or not shutil.which(compiler):
        raise RuntimeError(f"no C++ compiler ({compiler or 'g++ or $CXX'}) to build tests/fake_cuda_shim.cpp")
    with open(SHIM_SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + torch.__version__.encode() + torch.__file__.encode()).hexdigest()[:16]
    path = os.path.join(build_dir, f"fake_cuda_{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(build_dir, exist_ok=True)
    torch_dir = os.path.dirname(torch.__file__)
    tmp = f"{path}.{os.getpid()}.tmp"
    cmd = [compiler, "-shared", "-fPIC", "-O1", "-std=c++20", "-w",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           f"-I{torch_dir}/include", SHIM_SOURCE, f"-L{torch_dir}/lib", "-lc10", "-ltorch_cpu",
           f"-Wl,-rpath,{torch_dir}/lib", "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{compiler} could not build tests/fake_cuda_shim.cpp: "
                           f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    os.replace(tmp, path)  # atomic: two builds at once leave one good file
    return path


def run(shim: str, out_json: str, train_flags: list[str], world: int, rank: int = 0, flash: bool = False,
        model_json: str = "", timeout: float = 1800, variant: str = "") -> dict:
    """One fake-CUDA step in a fresh process (the shim must be loaded before torch is). Returns OUT.json."""
    cmd = [sys.executable, os.path.abspath(__file__), out_json, "--shim", shim, "--world", str(world),
           "--rank", str(rank)] + (["--flash"] if flash else []) + (["--model_json", model_json] if model_json else [])
    cmd += ["--variant", variant] if variant else []
    proc = subprocess.run(cmd + ["--"] + train_flags, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"fake-CUDA step failed ({proc.returncode}): {' '.join(train_flags)}\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    with open(out_json) as f:
        return json.load(f)


# Everything below runs in the child process, after load_shim().
used = collections.Counter()  # what the step asked of CUDA and NCCL: the tests' evidence that a branch ran


def load_shim(path: str):
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # its static registrations run now, before torch asks


# ------------------------------------------------------------------------------------------------
# Streams, events, pinned memory
# ------------------------------------------------------------------------------------------------

class FakeEvent:
    def __init__(self, *args, **kwargs):
        used["event created"] += 1
        self.recorded = False

    def record(self, stream=None):
        used["event recorded"] += 1
        self.recorded = True

    def synchronize(self):
        assert self.recorded, "an event is waited for before it was recorded (CUDA returns at once: a race)"
        used["event synchronized"] += 1

    def query(self):
        return True


class FakeStream:
    def __init__(self, device=None, priority=0):
        import torch
        used["stream created"] += 1
        self.device = torch.device(device if device is not None else "cuda:0")

    def wait_stream(self, other):
        assert isinstance(other, FakeStream)
        used["stream waits for stream"] += 1

    def wait_event(self, event):
        assert isinstance(event, FakeEvent) and event.recorded, "a stream waits for an event never recorded"
        used["stream waits for event"] += 1

    def synchronize(self):
        used["stream synchronized"] += 1


class Streams:
    """torch.cuda.current_stream / torch.cuda.stream: the default stream until a `with stream(s)`."""

    def __init__(self):
        self.default, self.current = FakeStream(), None
        used["stream created"] -= 1  # the default stream is not one the code made

    def current_stream(self, device=None):
        return self.current or self.default

    @contextlib.contextmanager
    def stream(self, s):
        used["code run on a side stream"] += 1
        previous, self.current = self.current, s
        try:
            yield
        finally:
            self.current = previous


class InlineWorker:
    """offload.HostState's worker thread, run in place: each task as it is submitted (the real thread is
    exercised by the CPU runs, tests/test_offload.py)."""

    def __init__(self, *args, initializer=None, initargs=(), **kwargs):
        pass

    def submit(self, fn, *args):
        import concurrent.futures
        used["tasks for the host worker"] += 1
        done = concurrent.futures.Future()
        done.set_result(fn(*args))
        return done


def record_stream(tensor, stream):
    assert tensor.is_cuda and isinstance(stream, FakeStream), "record_stream needs a CUDA tensor and stream"
    used["record_stream"] += 1


CUDA_KERNELS = None  # a torch.library.Library("aten", "IMPL"), alive as long as its registrations
STREAMS = None       # the Streams stand-in: which stream code runs on


def no_kernel(*args, **kwargs):
    raise RuntimeError("fake CUDA has no kernels: this op should have been answered by FakeTensorMode")


def install_cuda_stand_ins():
    global CUDA_KERNELS
    import torch
    import torch._subclasses.fake_impls as fake_impls
    import torch._subclasses.fake_tensor as fake_tensor
    # FakeTensorMode creates one real tensor on a new device "to initialise the context": there is none.
    fake_tensor.init_gpu_context = lambda device: None
    CUDA_KERNELS = torch.library.Library("aten", "IMPL")
    global STREAMS
    streams = STREAMS = Streams()
    torch.cuda.Stream, torch.cuda.Event = FakeStream, FakeEvent
    torch.cuda.current_stream, torch.cuda.stream = streams.current_stream, streams.stream
    torch.cuda.synchronize = lambda device=None: used.update(["device synchronized"])
    torch.Tensor.record_stream = record_stream

    # x.pin_memory(): FakeTensorMode has no implementation; a fake CPU tensor of the same shape is one.
    def fake_pin_memory(mode, func, x, device=None):
        with fake_tensor.in_kernel_invocation_manager(mode):
            meta = torch.empty(x.shape, dtype=x.dtype, device="meta")
        return fake_tensor.FakeTensor(mode, meta, torch.device("cpu"))
    fake_impls.op_implementations_dict[torch.ops.aten._pin_memory.default] = fake_pin_memory
    # An op with a CPU kernel and a composite fallback (silu_backward) has a CUDA kernel too in a CUDA build;
    # in this CPU build a CUDA tensor would take the fallback, decomposed into 6 ops and their temporaries
    # (+3 x 448 MiB in a 70B block's backward). Registering a CUDA kernel restores one op; FakeTensorMode
    # answers it before any kernel runs.
    for name in torch._C._dispatch_get_all_op_names():
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        if name.startswith("aten::") and has(name, "CPU") and has(name, "CompositeImplicitAutograd"):
            CUDA_KERNELS.impl(name[len("aten::"):], no_kernel, "CUDA")


def install_host_read(values: list):
    """The step's one host read, `.tolist()` of its record (the loss, any loss terms, grad_norm last): fake
    tensors have no values. Answered with plausible numbers (a grad norm above --grad_clip, so the clipping
    branch runs too; the loss for each term); each read, `.item()` included, is counted."""
    from torch._subclasses.fake_tensor import FakeTensor

    def tolist(t):
        used["host reads"] += 1
        assert t.dim() == 1 and t.numel() >= len(values), f"an unexpected host read of {tuple(t.shape)}"
        return values[:1] * (t.numel() - 1) + values[-1:]

    def item(t):
        used["host reads"] += 1
        return values[0]
    FakeTensor.tolist, FakeTensor.item = tolist, item


# ------------------------------------------------------------------------------------------------
# Device memory, as torch.cuda.memory_allocated counts it
# ------------------------------------------------------------------------------------------------

def allocated(nbytes: int) -> int:
    return -(-nbytes // 512) * 512  # the caching allocator's block rounding


class DeviceMemory:
    """Live bytes on the (fake) CUDA device: every storage seen in an op's output on CUDA, from then until
    it dies, resized (UntypedStorage.resize_, which no dispatch mode sees, is wrapped) or not. Keeps the
    peak, the peak of each phase of the step, and at the peak what was alive: (bytes, what made it, where)."""

    def __init__(self):
        self.live = {}           # id(storage) -> [weakref, bytes, label]
        self.current = self.peak = 0
        self.at_peak = []
        self.peak_by_phase = {}  # "layers.79 backward" -> most bytes alive while it ran
        self.where = "setup"     # the step's phase, set by the stage wrappers (`label_phases`)
        self.workspace, self.workspace_label = 0, ""  # a kernel's scratch memory while it runs
        self.taken_over = None   # (weakref, key) of a gradient an accumulation was counted in place of
        self.snapshot_phase, self.at_phase_peak = None, []  # also what was alive at one phase's peak

    def add(self, storage, label: str):
        key = id(storage)
        if key in self.live:
            return
        nbytes = allocated(storage.nbytes())
        self.live[key] = [weakref.ref(storage, lambda _, key=key: self.drop(key)), nbytes, label]
        self.current += nbytes
        self.update_peak()

    def drop(self, key):
        entry = self.live.pop(key, None)
        if entry:
            self.current -= entry[1]

    def resized(self, storage):
        entry = self.live.get(id(storage))
        if entry:
            nbytes = allocated(storage.nbytes())
            self.current += nbytes - entry[1]
            entry[1] = nbytes
            self.update_peak()

    def accumulated_in_place(self, old, new, label: str):
        """Autograd summing two gradients of one tensor (old + new, `old` held by nothing else) adds in
        place on a plain tensor, but allocates a third tensor for a FakeTensor (any tensor subclass). Counted
        as on CUDA: the sum takes over old's memory. Checked at the next op: if old is still alive after
        all (held elsewhere), CUDA would have allocated too, and its bytes are counted again."""
        entry = self.live.get(id(old))
        if entry is None:
            return self.add(new, label)
        self.check_taken_over()
        entry[1], freed = 0, entry[1]
        self.current -= freed
        self.add(new, label)
        self.taken_over = (weakref.ref(old), id(old), freed)

    def check_taken_over(self):
        if self.taken_over:
            ref, key, nbytes = self.taken_over
            self.taken_over = None
            if ref() is not None and key in self.live:
                used["accumulations counted out of place after all"] += 1
                self.live[key][1] = nbytes
                self.current += nbytes
                self.update_peak()

    def update_peak(self):
        now = self.current + self.workspace
        if now > self.peak_by_phase.get(self.where, 0):
            self.peak_by_phase[self.where] = now
            if self.where == self.snapshot_phase:
                self.at_phase_peak = [(nbytes, label) for _, nbytes, label in self.live.values() if nbytes]
        if now > self.peak:
            self.peak = now
            self.at_peak = [(nbytes, label) for _, nbytes, label in self.live.values() if nbytes]
            if self.workspace:
                self.at_peak.append((self.workspace, f"{self.workspace_label} @{self.where}"))


def kernel_workspace_bytes(func, args) -> tuple[int, str]:
    """Scratch memory a CUDA attention backward allocates and frees inside the kernel (a MODEL, from the
    kernels' sources, not measured): FlashAttention-2's backward (flash_attn's and the one SDPA vendors)
    accumulates dq in fp32 (B x T x H x D, T rounded up to 128) and, when K/V have fewer heads than Q,
    computes dk and dv at all H heads (bf16) before summing them; the memory-efficient kernel accumulates
    dq in fp32 too."""
    import torch
    name = str(func)
    if "flash_attn_backward" in name or "flash_attn_varlen_backward" in name:  # (dout, q, k, ...), (B,T,H,D) or (BT,H,D)
        q, k = args[1], args[2]
        tokens, heads, dim = q.numel() // (q.shape[-1] * q.shape[-2]), q.shape[-2], q.shape[-1]
        kv_heads = k.shape[-2]
    elif func in (torch.ops.aten._scaled_dot_product_flash_attention_backward.default,
                  torch.ops.aten._scaled_dot_product_efficient_attention_backward.default):  # (grad, q, k, ...), (B,H,T,D)
        q, k = args[1], args[2]
        tokens, heads, dim, kv_heads = q.shape[0] * q.shape[2], q.shape[1], q.shape[3], k.shape[1]
    else:
        return 0, ""
    rounded = -(-tokens // 128) * 128
    workspace = 4 * rounded * heads * dim
    if kv_heads != heads and "efficient" not in name:
        workspace += 2 * 2 * tokens * heads * dim
    return allocated(workspace), f"workspace of {name}"


def is_gradient_accumulation(func, args, out) -> bool:
    """The autograd engine summing two gradients of one tensor: old + new, in backward, with grad mode
    off (a checkpoint's recompute runs with it on), both dense and alike. In this model's backward no
    derivative formula adds two tensors itself (checked: the adds seen come from nodes whose formulas
    have none: PowBackward0, MulBackward0, ViewBackward0, ToCopyBackward0, MmBackward0)."""
    import torch
    if func is not torch.ops.aten.add.Tensor or torch.is_grad_enabled() or torch._C._current_autograd_node() is None:
        return False
    old, new = args[0], args[1]
    return (isinstance(new, torch.Tensor) and old.is_cuda and old.shape == new.shape == out.shape
            and old.dtype == out.dtype and old.is_contiguous() and len(args) == 2)


def copy_kind(direction: str, dtype) -> str:
    """e.g. "async copies host to device bfloat16 on a side stream": what crossed PCIe, and on which stream."""
    return f"async copies {direction} {str(dtype)[6:]}" + (" on a side stream" if STREAMS.current is not None else "")


def make_memory_mode(memory: DeviceMemory, pinned: weakref.WeakSet):
    """The dispatch mode that feeds DeviceMemory and counts host<->device copies (and checks that those
    meant to be asynchronous read or write pinned host memory: from pageable memory CUDA waits)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    aten = torch.ops.aten

    def host_side_pinned(t):
        return t.untyped_storage() in pinned

    class MemoryMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            memory.check_taken_over()
            workspace, label = kernel_workspace_bytes(func, args)
            if workspace:
                memory.workspace, memory.workspace_label = workspace, label
                memory.update_peak()
            out = func(*args, **kwargs)
            memory.workspace = 0
            if kwargs.get("pin_memory") or func is aten._pin_memory.default:  # a factory's pin_memory=True, x.pin_memory()
                used["pinned host allocations"] += 1
                pinned.add(out.untyped_storage())
            if func is aten._to_copy.default and kwargs.get("non_blocking"):
                src, device = args[0], kwargs.get("device")
                if src.device.type == "cpu" and device is not None and device.type == "cuda":
                    assert host_side_pinned(src), "an asynchronous host-to-device copy from pageable memory"
                    used["async copies host to device"] += 1
                    used[copy_kind("host to device", src.dtype)] += 1
            if func is aten.copy_.default and (args[2:] or [kwargs.get("non_blocking")])[0]:
                dst, src = args[0], args[1]
                if dst.device.type != src.device.type:
                    host = dst if dst.device.type == "cpu" else src
                    assert host_side_pinned(host), "an asynchronous copy between host and device in pageable memory"
                    used["async copies " + ("device to host" if host is dst else "host to device")] += 1
                    used[copy_kind("device to host" if host is dst else "host to device", src.dtype)] += 1
            if is_gradient_accumulation(func, args, out):
                used["gradient accumulations counted in place"] += 1
                memory.accumulated_in_place(args[0].untyped_storage(), out.untyped_storage(),
                                            f"{func} {tuple(out.shape)} {str(out.dtype)[6:]} @{memory.where}")
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                    memory.add(t.untyped_storage(), f"{func} {tuple(t.shape)} {str(t.dtype)[6:]} @{memory.where}")
            return out
    return MemoryMode()


def watch_resizes(memory: DeviceMemory):
    import torch
    real_resize = torch.UntypedStorage.resize_

    def resize_(storage, size):
        out = real_resize(storage, size)
        memory.resized(storage)
        return out
    torch.UntypedStorage.resize_ = resize_


# ------------------------------------------------------------------------------------------------
# Collectives, with the checks NCCL makes
# ------------------------------------------------------------------------------------------------

def check_collective(name: str, out, inp, world: int, device):
    """What NCCL refuses (torch's ProcessGroupNCCL checks): tensors off the rank's CUDA device,
    non-contiguous, of different dtypes, or whose sizes are not W to 1."""
    import torch
    for t in (out, inp):
        assert isinstance(t, torch.Tensor) and t.device == device, \
            f"{name}: a tensor on {t.device}, not the rank's CUDA device"
        assert t.is_contiguous(), f"{name}: a non-contiguous tensor"
    assert out.dtype == inp.dtype, f"{name}: output {out.dtype}, input {inp.dtype}"
    big, small = (out, inp) if name == "all-gather" else (inp, out)
    assert big.numel() == world * small.numel(), \
        f"{name}: {big.numel()} elements is not W = {world} x {small.numel()}"


def install_checked_collectives(train_module, world: int):
    import torch
    import torch.distributed as dist
    real_gather, real_scatter, real_all_reduce = (train_module.all_gather_flat, train_module.reduce_scatter_flat,
                                                  dist.all_reduce)

    class Work:
        def __init__(self, work, name):
            self.work, self.name = work, name
            used[f"{name} started"] += 1

        def wait(self):
            used[f"{self.name} waited"] += 1
            return self.work.wait()

    def collective(name, real):
        def checked(out, inp, *args, async_op=False, **kwargs):
            check_collective(name, out, inp, world, torch.device("cuda", 0))
            used[f"{name} bytes"] += (out if name == "all-gather" else inp).numel() * out.element_size()
            work = real(out, inp, *args, async_op=async_op, **kwargs)
            if not async_op:
                used[f"{name} sync"] += 1
                return work
            return Work(work, name)
        return checked

    def all_reduce(tensor, *args, **kwargs):
        assert tensor.device == torch.device("cuda", 0), f"all-reduce: a tensor on {tensor.device} (NCCL: CUDA only)"
        used["all-reduce"] += 1
        return real_all_reduce(tensor, *args, **kwargs)
    train_module.all_gather_flat = collective("all-gather", real_gather)
    train_module.reduce_scatter_flat = collective("reduce-scatter", real_scatter)
    dist.all_reduce = all_reduce


# ------------------------------------------------------------------------------------------------
# Attention kernels
# ------------------------------------------------------------------------------------------------

def install_sdpa_model():
    """F.scaled_dot_product_attention on CUDA tensors: the kernel CUDA's SDPA picks for these arguments
    (torch 2.13, sm90, no dropout, head dim <= 256): flash for no mask and bf16/fp16 (grouped K/V
    allowed), memory-efficient for a mask or fp32 with K/V at the query's head count, math otherwise.
    A model of torch's choice, the same rules model.sdpa_arguments encodes; not asked of a GPU."""
    import torch
    import torch.nn.functional as F
    real_sdpa, aten = F.scaled_dot_product_attention, torch.ops.aten

    def modelled_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False):
        if not query.is_cuda:
            return real_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                             scale=scale, enable_gqa=enable_gqa)
        same_heads = key.shape[1] == query.shape[1]
        if attn_mask is None and query.dtype in (torch.bfloat16, torch.float16) and query.shape[-1] <= 256:
            used["attention: SDPA flash"] += 1
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
        if same_heads:
            used["attention: SDPA memory-efficient"] += 1
            return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, query.requires_grad,
                                                                dropout_p, is_causal, scale=scale)[0]
        used["attention: SDPA math"] += 1
        return real_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)
    F.scaled_dot_product_attention = modelled_sdpa


def install_flash_attn_stand_in():
    """A `flash_attn` package for fake CUDA: flash_attn_func and flash_attn_varlen_func as flash-attn 2.7
    writes them (an autograd.Function around torch ops named flash_attn::_flash_attn_forward etc., which
    save q, k, v, out and the softmax log-sum-exp), with shapes-only kernels. Installed before model.py is
    imported; train.py then finds the ops for the selective policy as it would find flash-attn's."""
    import types
    import torch
    lib = "flash_attn"
    common = ("float dropout_p, float softmax_scale, bool causal, SymInt window_size_left, "
              "SymInt window_size_right, float softcap, Tensor? alibi_slopes")
    torch.library.define(f"{lib}::_flash_attn_forward", f"(Tensor q, Tensor k, Tensor v, {common}, "
                         "bool return_softmax) -> (Tensor, Tensor, Tensor, Tensor)")
    torch.library.define(f"{lib}::_flash_attn_varlen_forward", f"(Tensor q, Tensor k, Tensor v, "
                         "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
                         f"{common}, bool return_softmax) -> (Tensor, Tensor, Tensor, Tensor)")
    torch.library.define(f"{lib}::_flash_attn_backward", "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
                         "Tensor softmax_lse, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, "
                         f"{common}, bool deterministic) -> Tensor")
    torch.library.define(f"{lib}::_flash_attn_varlen_backward", "(Tensor dout, Tensor q, Tensor k, Tensor v, "
                         "Tensor out, Tensor softmax_lse, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, "
                         "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
                         f"{common}, bool deterministic) -> Tensor")

    def forward_outputs(q, lse_shape):
        return (torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32), q.new_empty(0),
                q.new_empty(2, dtype=torch.int64))

    @torch.library.register_fake(f"{lib}::_flash_attn_forward")
    def _(q, k, v, *args):
        B, T, H, _ = q.shape
        return forward_outputs(q, (B, H, T))

    @torch.library.register_fake(f"{lib}::_flash_attn_varlen_forward")
    def _(q, k, v, cu_q, cu_k, max_q, max_k, *args):
        return forward_outputs(q, (q.shape[1], q.shape[0]))

    for name in ("_flash_attn_backward", "_flash_attn_varlen_backward"):
        torch.library.register_fake(f"{lib}::{name}")(
            lambda dout, q, *args: q.new_empty((q.shape[-2], q.numel() // (q.shape[-1] * q.shape[-2])),
                                               dtype=torch.float32))  # softmax_d
    ops = torch.ops.flash_attn

    class FlashAttnFunc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, varlen):
            scale = q.shape[-1] ** -0.5
            rest = (0.0, scale, True, -1, -1, 0.0, None)
            if varlen is None:
                used["attention: flash_attn"] += 1
                out, lse, _, _ = ops._flash_attn_forward(q, k, v, *rest, False)
            else:
                used["attention: flash_attn varlen"] += 1
                out, lse, _, _ = ops._flash_attn_varlen_forward(q, k, v, *varlen, *rest, False)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.varlen, ctx.rest = varlen, rest
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            if ctx.varlen is None:
                ops._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, *ctx.rest, False)
            else:
                ops._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, *ctx.varlen, *ctx.rest, False)
            return dq, dk, dv, None

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **kwargs):
        assert causal and dropout_p == 0.0
        return FlashAttnFunc.apply(q, k, v, None)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, **kwargs):
        assert causal and dropout_p == 0.0
        return FlashAttnFunc.apply(q, k, v, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    sys.modules["flash_attn"] = types.SimpleNamespace(flash_attn_func=flash_attn_func,
                                                      flash_attn_varlen_func=flash_attn_varlen_func,
                                                      __version__="2.7.4 (fake-CUDA stand-in)")


# ------------------------------------------------------------------------------------------------
# Forks: a change a researcher makes to model.py or train.py, applied before the step and the plan
# ------------------------------------------------------------------------------------------------

def soft_capped_attention(M, T):
    """A fork's Block that soft-caps each attention output in fp32 (as Gemma 2 caps its logits): tanh keeps
    its fp32 output for backward, one tensor more than model.Block keeps."""
    import torch

    def forward(self, x, cos, sin, layout=None, cache=None):
        a = self.self_attn(self.input_layernorm(x), cos, sin, layout, cache)
        h = x + (30 * torch.tanh(a.float() / 30)).to(x.dtype)
        return h + self.mlp(self.post_attention_layernorm(h))
    M.Block.forward = forward


def sgd_momentum(M, T):
    """The optimizer swapped where train.py says a fork swaps it: SGD with momentum, one state tensor
    (tests/dist_worker.py's, which the parity tests check against torch.optim.SGD)."""
    sys.path.insert(0, HERE)
    import dist_worker
    M.OPTIMIZER_STATE, T.optimizer_step = ("momentum_buffer",), dist_worker.sgd_momentum_step


def sgd_bf16_momentum(M, T):
    """SGD with momentum whose buffer a fork keeps in bf16 to save memory: train.Unit's optimizer state
    made in bf16 instead of fp32 (2 B per parameter instead of 4; the optimizer's names are unchanged)."""
    import torch
    sgd_momentum(M, T)
    make_unit = T.Unit.__init__

    def init(self, *args, **kwargs):
        make_unit(self, *args, **kwargs)
        self.optimizer_state = {name: torch.zeros_like(t, dtype=torch.bfloat16) for name, t in self.optimizer_state.items()}
    T.Unit.__init__ = init


def two_units_per_block(M, T):
    """Each block sharded as two units, its attention and its MLP (tests/dist_worker.py's fork): the trainer's
    stages and the planner both read the model's unit list."""
    sys.path.insert(0, HERE)
    import dist_worker
    M.sharding_units = dist_worker.two_units_per_block


ADAPTER_RANK, ADAPTER_SCALE = 16, 2.0  # peft's r and lora_alpha / r


def adapted_projections(M, make_linear):
    """Each block's q_proj and v_proj made by `make_linear`, keeping their Hugging Face names; their adapters'
    parameters (`lora_` names) sharded as a unit of their own, `layers.i.lora` (tests/dist_worker.py's lora_units)."""
    sys.path.insert(0, HERE)
    import dist_worker
    make_attention = M.Attention.__init__

    def init(self, cfg):
        make_attention(self, cfg)
        self.q_proj, self.v_proj = (make_linear(p.in_features, p.out_features) for p in (self.q_proj, self.v_proj))
    M.Attention.__init__, M.sharding_units = init, dist_worker.lora_units


def lora(M, T):
    """LoRA (Hu et al. 2021) as peft's LoraLayer runs it: W x + scale * B(A x) on q_proj and v_proj."""
    import torch
    import torch.nn.functional as F

    class LoraLinear(torch.nn.Linear):
        def __init__(self, n_in, n_out):
            super().__init__(n_in, n_out, bias=False)
            self.lora_a = torch.nn.Parameter(torch.empty(ADAPTER_RANK, n_in))
            self.lora_b = torch.nn.Parameter(torch.empty(n_out, ADAPTER_RANK))

        def forward(self, x):
            return super().forward(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * ADAPTER_SCALE
    adapted_projections(M, LoraLinear)


def dora(M, T):
    """DoRA (Liu et al. 2024) as peft's DoraLinearLayer runs it: LoRA's B and A and a magnitude m per output,
    m / ||W + scale * B A|| (the norm detached, the paper's section 4.3) times the base output and the adapter's."""
    import torch
    import torch.nn.functional as F

    class DoraLinear(torch.nn.Linear):
        def __init__(self, n_in, n_out):
            super().__init__(n_in, n_out, bias=False)
            self.lora_a = torch.nn.Parameter(torch.empty(ADAPTER_RANK, n_in))
            self.lora_b = torch.nn.Parameter(torch.empty(n_out, ADAPTER_RANK))
            self.lora_magnitude = torch.nn.Parameter(torch.empty(n_out))

        def forward(self, x):
            base = super().forward(x)
            with torch.no_grad():
                norm = torch.linalg.norm(self.weight + ADAPTER_SCALE * (self.lora_b @ self.lora_a), dim=1)
            scale = (self.lora_magnitude / norm).view(1, -1)
            adapter = F.linear(F.linear(x, self.lora_a), self.lora_b)
            return base + ((scale - 1) * base + scale * adapter * ADAPTER_SCALE)
    adapted_projections(M, DoraLinear)


VARIANTS = {"soft-capped attention": soft_capped_attention, "sgd momentum": sgd_momentum,
            "sgd momentum in bf16": sgd_bf16_momentum, "two units per block": two_units_per_block,
            "lora": lora, "dora": dora}


# ------------------------------------------------------------------------------------------------
# The step
# ------------------------------------------------------------------------------------------------

class Windows:
    """train.micro_batches' view of the data: (inputs, targets, doc_starts) of (micro, seq_len). With
    `documents` > 1, each row packs that many documents, starting at irregular places (the data's own record of
    where documents start, as data.TokenData gives it), so --doc_mask builds a layout."""

    def __init__(self, seq_len: int, vocab_size: int, documents: int):
        self.seq_len, self.vocab_size, self.documents = seq_len, vocab_size, documents

    def micro_batch(self, position, accum_index, rank, world, micro):
        import numpy as np
        rng = np.random.default_rng([position, accum_index, rank])
        tokens = rng.integers(0, self.vocab_size, size=(micro, self.seq_len + 1))
        doc_starts = np.zeros((micro, self.seq_len), dtype=bool)
        doc_starts[:, 0] = True
        if self.documents > 1:  # document starts at irregular places, the first well inside the row
            for row in range(micro):
                doc_starts[row, np.sort(rng.choice(np.arange(8, self.seq_len - 8), self.documents - 1, replace=False))] = True
        return tokens[:, :-1], tokens[:, 1:].copy(), doc_starts


def label_phases(sharded, memory: DeviceMemory):
    """Names the stage running (forward) or about to run its backward in DeviceMemory's labels."""
    names = ["embed"] + [f"layers.{i}" for i in range(len(sharded.stages) - 2)] + ["head"]

    run_stage = sharded.run_stage

    def run_stage_labelled(k, x, batch):
        memory.where = f"{names[k]} forward"
        return run_stage(k, x, batch)
    sharded.run_stage = run_stage_labelled
    on_backward = sharded.on_backward

    def on_backward_labelled(k):
        on_backward(k)
        memory.where = f"{names[k]} backward"
    sharded.on_backward = on_backward_labelled


def by_label(alive: list) -> list:
    """[bytes, label] summed over tensors of the same label, largest first."""
    total = collections.Counter()
    for nbytes, label in alive:
        total[label] += nbytes
    return sorted(([n, label] for label, n in total.items()), reverse=True)


def planned(mcfg, cfg, world: int, flash_attn: bool) -> dict:
    """plan.py's memory by phase for the same flags, with the bytes torch would count as allocated: every
    part but CUDA/NCCL's own and the allocator's slack."""
    import dataclasses
    from tools import plan as P  # it runs train.py's blocks and optimizer, a fork's (--variant) included
    from tools import plan_memory as PM  # it runs train.py's blocks and optimizer, a fork's (--variant) included
    cfg = dataclasses.replace(cfg, nnodes=1, nproc_per_node=world)
    phases = PM.memory_by_phase(mcfg, cfg, world, flash_attn)
    allocated_by_phase = {p: sum(v for k, v in parts.items() if k not in ("context_and_nccl", "fragmentation"))
                          for p, parts in phases.items()}
    peak_phase = max(allocated_by_phase, key=allocated_by_phase.get)
    return dict(phases=phases, allocated_by_phase=allocated_by_phase, peak_phase=peak_phase,
                allocated_bytes=allocated_by_phase[peak_phase], host_bytes=P.host_bytes_per_gpu(mcfg, cfg, world))


def child(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("out_json")
    parser.add_argument("--shim", required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--flash", action="store_true")
    parser.add_argument("--model_json", default="", help="a model.ModelConfig as JSON, instead of --model's preset")
    parser.add_argument("--documents", type=int, default=4, help="documents per row (--doc_mask)")
    parser.add_argument("--variant", default="", choices=[""] + list(VARIANTS),
                        help="a fork's change (VARIANTS), applied before the step and the plan, which both see it")
    parser.add_argument("--snapshot", default="", help="also record what is alive at this phase's peak, e.g. "
                                                       "'layers.79 backward'")
    args, train_flags = parser.parse_known_args(argv)
    train_flags = [f for f in train_flags if f != "--"]
    t0 = time.time()
    load_shim(args.shim)
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    install_cuda_stand_ins()
    install_sdpa_model()
    if args.flash:
        install_flash_attn_stand_in()
    sys.path.insert(0, ROOT)
    import model as M
    from components import hf
    from components import metrics
    from components import offload as O
    import train as T
    assert (M.flash_attn_func is not None) == args.flash
    if args.variant:
        VARIANTS[args.variant](M, T)
    install_checked_collectives(T, args.world)
    cfg = T.parse_args(train_flags + ["--device", "cuda"])
    mcfg = M.ModelConfig(**json.loads(args.model_json)) if args.model_json else hf.model_config(cfg)
    install_host_read([2.5, 2 * cfg.grad_clip if cfg.grad_clip else 1.0])  # loss, grad norm: clipped
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world)
    memory, pinned = DeviceMemory(), weakref.WeakSet()

    def fake_page_lock(buffer, flag=""):  # cudaHostRegister: the buffer is pinned as it is, no rounding
        used["host buffers page-locked"] += 1
        used["host bytes page-locked"] += buffer.numel() * buffer.element_size()
        pinned.add(buffer.untyped_storage())
    O.page_lock, O.unlock = fake_page_lock, lambda data_ptr: used.update(["host buffers unlocked"])
    O.ThreadPoolExecutor = InlineWorker  # FakeTensorMode is one state for all threads: no op may run concurrently
    memory.snapshot_phase = args.snapshot
    watch_resizes(memory)
    device = torch.device("cuda", 0)
    with FakeTensorMode(allow_non_fake_inputs=True), make_memory_mode(memory, pinned):
        sharded = T.build_sharded_model(cfg, mcfg, args.rank, args.world, device)
        if cfg.offload_optimizer:
            O.refresh_compute_shards(sharded.units)
        state_bytes = memory.current
        label_phases(sharded, memory)
        windows = Windows(cfg.seq_len, mcfg.vocab_size, args.documents if cfg.doc_mask else 1)
        memory.where = "step"
        T.train_step(cfg, sharded, windows, 1, 0)
    dtype = T.compute_dtype(cfg.dtype, device)
    result = dict(flags=train_flags, world=args.world, rank=args.rank, flash=args.flash, model=vars(mcfg),
                  peak_bytes=memory.peak, state_bytes=state_bytes, end_bytes=memory.current,
                  peak_by_phase=memory.peak_by_phase,
                  alive_at_peak=by_label(memory.at_peak), alive_at_phase_peak=by_label(memory.at_phase_peak),
                  attention_kernel=metrics.attention_kernel(device, dtype, cfg.doc_mask),
                  used=dict(used), plan=planned(mcfg, cfg, args.world, args.flash), seconds=time.time() - t0,
                  units=[dict(name=u.name, padded_numel=u.padded_numel, shard_numel=u.shard_numel) for u in sharded.units])
    with open(args.out_json, "w") as f:
        json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    child(sys.argv[1:])
