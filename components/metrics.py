"""What the run reports: tokens/s/GPU, MFU, peak memory, ETA and dollars, to the terminal, metrics.jsonl
and (with --tensorboard) TensorBoard (tools/plot.py draws metrics.jsonl). Only rank 0 writes.

Conventions: tokens/s/GPU counts every token of the global batch (padding-free packing: all of them are
trained on) over the step's wall time, divided by the world size. MFU is that times the model FLOPs per
token (model.flops_per_token) over the GPU's dense BF16 peak (PEAK_BF16_FLOPS).
"""
import contextlib
import json
import linecache
import os
import resource
import signal
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

import model as M
from components import offload, out_dir as OD

# Dense BF16 peak FLOP/s by device name (no sparsity), checked in order; peak_flops: None for one not listed (a
# CPU). The planner (tools/plan.py) reads this table too.
PEAK_BF16_FLOPS = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("GH200", 989e12),
                   ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12), ("A10G", 125e12)]
# Page-locking --offload_optimizer's host state (zeroing and registering it), GB/s per rank: what the planner
# assumes for a restart's set-up (its ASSUMPTIONS), printed beside the rate measured at start-up.
HOST_PAGE_LOCKING_GBPS = 1.0

from components.out_dir import all_gather_flat  # a name here: bench/comm_volume.py counts these calls


def compute_clock(device):
    """Where a rank's own compute time starts: a CUDA event on its stream, or on a CPU this thread's CPU time.
    Not wall time: every collective waits for the slowest rank, so every rank's step takes as long as the slowest
    one's and the wall times name a rank at random (a rank slowed 1.2 s per step was named in 3 of 6 steps)."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start
    return time.thread_time()


def compute_seconds(start, device) -> float:
    """Seconds of this rank's own compute since compute_clock's `start`. On a CPU, CPU time: a rank blocked in a
    collective spends none. On a GPU, the events' elapsed time on the compute stream, which still counts the time
    that stream waits for a collective (a gather a slower rank holds up): a slow GPU, always busy, shows its whole
    time; the others less than theirs wherever prefetching hides their waits."""
    if device.type == "cuda":
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return time.thread_time() - start


def compute_s_by_rank(compute_s: float, device) -> list[float]:
    """Every rank's own compute time of the step, one all-gather: the step line names the slowest rank beside the
    median, so a slow GPU or node is named rather than averaged away."""
    by_rank = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    all_gather_flat(by_rank, torch.tensor([compute_s], dtype=torch.float64, device=device))
    return by_rank.tolist()


def nonfinite_line(e, sharded) -> str:
    """A skipped step's line (e: train.NonFiniteStep), naming the ranks whose own loss was not finite: one
    all-gather, on every rank (every rank raised the same NonFiniteStep: its values are summed over ranks)."""
    finite_by_rank = torch.zeros(sharded.world, device=sharded.device)
    all_gather_flat(finite_by_rank, e.local_finite.float().reshape(1))
    bad = [r for r, ok in enumerate(finite_by_rank.tolist()) if not ok]
    where = f" (from rank {', '.join(map(str, bad))})" if bad else ""
    return f"step {e.step}: loss {e.loss}, grad_norm {e.grad_norm}{where}; the optimizer step was skipped"


def stop_line(step: int, steps: int, stop_signals: list, stop_save_skipped: bool, export_hf: str) -> str:
    """What rank 0 says when a stop request ends the run at `step` (train.main saved it, or kept the save in flight)."""
    name = signal.Signals(stop_signals[0]).name if stop_signals else "a signal"
    if stop_save_skipped:
        then = ("; its newest checkpoint is the one just written in the background, so the stop did not "
                "save again: re-run the same command to continue")
    elif step < steps:
        then = "; re-run the same command to continue"
    elif export_hf:  # the export is not part of a stop's lead (docs/operations.md)
        then = f" (the last step): the export to {export_hf} was not made; the same command makes it"
    else:
        then = " (the last step): the run is finished"
    return f"stopping at step {step} on {name}{then}"


def peak_flops(device: torch.device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def reset_peak_mem(device: torch.device):
    """Called before each step, so mem_gb is that step's peak, not init's or an evaluation's. On CPU
    the process's peak resident memory cannot be reset: there mem_gb is the peak since start."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mem_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def device_memory_line(when: str, free_bytes: int, total_bytes: int, reserved_bytes: int, planned_gib: float | None,
                       planned_context_gib: float | None) -> str:
    """What the GPU holds now (torch.cuda.mem_get_info: every process, the CUDA context and NCCL included),
    split into PyTorch's allocator (reserved) and the rest, beside the planner's figure for this moment and
    its allowance for the rest. The rest over the allowance is what no flag of ours controls: NCCL (NVLS,
    see launch.sh), another process on the GPU."""
    used = total_bytes - free_bytes
    outside = used - reserved_bytes
    line = (f"GPU memory {when}: {used / 2**30:.2f} GiB in use of {total_bytes / 2**30:.2f} (mem_get_info), "
            f"{reserved_bytes / 2**30:.2f} reserved by PyTorch's allocator, {outside / 2**30:.2f} outside it "
            f"(CUDA context, NCCL, other processes)")
    if planned_gib is not None:
        line += f" | planned {planned_gib:.2f} GiB, {planned_context_gib:.2f} of it outside the allocator"
        if outside / 2**30 > planned_context_gib:
            line += f": {outside / 2**30 - planned_context_gib:.2f} GiB more than the planner allows"
    return line


def print_device_memory(sharded, when: str, planned: dict | None, figure: str):
    """Rank 0, on CUDA: device_memory_line now, beside the planner's `figure` of `planned` (its memory figures for
    the run as launched, agree.planner_figures; None on a GPU it does not know): "peak_gib" after a step."""
    device = sharded.device
    if sharded.rank != 0 or device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    print(device_memory_line(when, free, total, torch.cuda.memory_reserved(device),
                             planned and planned[figure], planned and planned["context_gib"]), flush=True)


def page_locking_line(by_rank: list[tuple[float, float]], hosts: list[str]) -> str | None:
    """Per node: the host memory its ranks page-locked (bytes, seconds each), the slowest rank's time and rate,
    beside the rate --plan's restart time assumes. None when nothing was page-locked."""
    if not any(nbytes for nbytes, _ in by_rank):
        return None
    nodes = []
    for host in dict.fromkeys(hosts):
        mine = [by_rank[r] for r, h in enumerate(hosts) if h == host]
        nbytes, slowest = max(mine, key=lambda m: m[1])
        nodes.append(f"{host}: {len(mine)} rank(s), {sum(b for b, _ in mine) / 1e9:,.1f} GB, the slowest rank "
                     f"{slowest:.1f} s ({nbytes / 1e9 / max(slowest, 1e-9):.2f} GB/s)")
    return (f"host memory page-locked at start-up (cudaHostRegister, on the path to step 1): {'; '.join(nodes)}; "
            f"--plan assumes {HOST_PAGE_LOCKING_GBPS:g} GB/s per rank for a restart's set-up")


def print_page_locking(sharded, hosts: list[str]):
    """Rank 0, on CUDA: page_locking_line over every rank's page-locking (one all-gather on every rank)."""
    if sharded.device.type != "cuda":
        return
    mine = torch.tensor([sum(b for b, _ in offload.PAGE_LOCKED), sum(t for _, t in offload.PAGE_LOCKED)],
                        dtype=torch.float64, device=sharded.device)
    everyone = torch.zeros(2 * sharded.world, dtype=torch.float64, device=sharded.device)
    all_gather_flat(everyone, mine)
    line = page_locking_line(list(zip(everyone[0::2].tolist(), everyone[1::2].tolist())), hosts)
    if line and sharded.rank == 0:
        print(line, flush=True)


def left_behind(sharded, step: int) -> str | None:
    """The step's invariant, checked after each one (a loop over the units' storage sizes: nothing measurable):
    every unit is free and no reduce-scatter is in flight. A unit left gathered (a fork whose backward never
    reaches a unit's boundary, e.g. frozen first blocks) would be taken by the next step's wait_gather as
    ready, and that step would compute with the weights from before this update: an error, not stale weights."""
    gathered = [u.name for u in sharded.units if u.state() != "free"]
    in_flight = [unit.name for unit, *_ in sharded.reduces_in_flight]
    if not gathered and not in_flight:
        return None
    what = "; ".join(part for part in (f"unit(s) {', '.join(gathered)} still gathered" if gathered else "",
                                       f"reduce-scatter(s) of {', '.join(in_flight)} in flight" if in_flight else "") if part)
    return (f"step {step} ended with {what}: every unit must be freed and every gradient reduced by the end of a step "
            f"(ShardedModel.on_backward frees a stage as backward leaves it, finish_reduces waits for the reduce-scatters); "
            f"the next step would read weights from before this update")


def where_in_code(e: BaseException) -> str:
    """The innermost line of the trainer's own files in `e`'s traceback: file:line in function (`statement`)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ours = [(os.path.relpath(frame.f_code.co_filename, root), frame, line)
            for frame, line in traceback.walk_tb(e.__traceback__)]
    ours = [o for o in ours if o[0] in ("train.py", "model.py", "data.py") or o[0].startswith("components" + os.sep)]
    if not ours:
        return "outside the trainer's code"
    path, frame, line = ours[-1]
    return f"{path}:{line} in {frame.f_code.co_name} (`{linecache.getline(frame.f_code.co_filename, line).strip()}`)"


def allocator_held(device) -> dict | None:
    """What PyTorch's allocator holds on the GPU now and held at most since the step began, bytes; None on a CPU."""
    if device.type != "cuda":
        return None
    return dict(allocated=torch.cuda.memory_allocated(device), reserved=torch.cuda.memory_reserved(device),
                peak=torch.cuda.max_memory_allocated(device))


def out_of_memory_line(e: BaseException, step: int, gathered: list[str], held: dict | None, planned: dict | None) -> str:
    """An out-of-memory error as one line: where (the code's line, the units gathered then), what the allocator held,
    what --plan predicted (`planned`: the planner's memory figures, agree.planner_figures), and what to change. A restart runs the same step into the
    same error, so the caller exits 2, not 1 (which torchrun and a requeue would repeat in a loop)."""
    line = (f"out of memory in step {step}, at {where_in_code(e)}, with {', '.join(gathered) or 'no unit'} gathered: "
            f"{next(iter(str(e).splitlines()), '').split('. GPU')[0].rstrip('.')}")
    if held:
        line += (f"; PyTorch's allocator held {held['allocated'] / 2**30:.2f} GiB ({held['reserved'] / 2**30:.2f} "
                 f"reserved, at most {held['peak'] / 2**30:.2f} in this step)")
    if planned:
        phases = ", ".join(f"{name} {gib:.2f}" for name, gib in planned["phases_gib"].items())
        line += (f"; --plan predicted {planned['peak_gib']:.2f} GiB at the peak ({planned['peak_phase']}; {phases}), "
                 f"{planned['context_gib']:.2f} of it outside the allocator")
    return (line + ". A restart would run out again: lower the peak (`--plan` with this run's flags names the nearest "
                   "configuration that fits: a smaller --micro_batch_size, --ac full, --offload_activations, ...)")


def fmt_time(seconds: float) -> str:
    seconds = int(seconds)
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def log_step(cfg, metrics: dict, f, epochs_by_source: dict | None = None, shown: tuple = ()):
    """One metrics.jsonl row, and the step line when due; `epochs_by_source` (once a source repeats) too, and
    the row's `shown` keys after the loss (what train_step's record holds besides loss and grad_norm)."""
    f.write(json.dumps(metrics) + "\n")
    f.flush()
    s = metrics["step"]
    if s % cfg.log_every == 0 or s == cfg.steps or "eval_loss" in metrics:
        mfu = "n/a" if metrics["mfu"] is None else f"{100 * metrics['mfu']:.1f}%"
        loss = "skipped" if metrics["loss"] is None else f"{metrics['loss']:.4f}"
        grad_norm = "skipped" if metrics["grad_norm"] is None else f"{metrics['grad_norm']:.3f}"
        print(f"step {s}/{cfg.steps} | loss {loss} | " +
              "".join(f"{key} {metrics[key]:.4f} | " for key in shown if metrics[key] is not None) +
              f"lr {metrics['lr']:.2e} | "
              f"grad_norm {grad_norm} | {metrics['tokens_per_sec_per_gpu']:,.0f} tok/s/gpu | "
              f"mfu {mfu} | mem {metrics['mem_gb']:.2f} GB | elapsed {fmt_time(metrics['elapsed_s'])} | "
              f"eta {fmt_time(metrics['eta_s'])}" +
              (f" | slowest rank {metrics['slowest_rank']} ({metrics['slowest_host']}) computes {metrics['compute_max_s']:.2f} "
               f"s, median {metrics['compute_median_s']:.2f} s" if "slowest_rank" in metrics else "") +
              (f" | ${metrics['cost_usd']:,.2f} of ${metrics['projected_cost_usd']:,.2f}" if "cost_usd" in metrics else "") +
              (f" | eval_loss {metrics['eval_loss']:.4f}" if "eval_loss" in metrics else "") +
              "".join(f" | {key} {value:.4f}" for key, value in metrics.items() if key.startswith("eval_loss/")) +
              (" | epochs " + ", ".join(f"{name} {e:.2f}" for name, e in epochs_by_source.items())
               if epochs_by_source else ""),
              flush=True)


class MetricsLog:
    """Rank 0's metrics: metrics.jsonl (one line per step; a resumed run keeps the lines of the steps it
    has already done, and only those), the step line, TensorBoard. Other ranks hold one and write nothing."""

    def __init__(self, cfg, mcfg, world: int, device, rank: int, start_step: int, steps: int, hosts=None):
        self.cfg, self.world, self.steps, self.start_step, self.hosts = cfg, world, steps, start_step, hosts
        self.tokens_per_step = cfg.batch_size * cfg.seq_len
        self.flops_per_token = M.flops_per_token(mcfg, cfg.seq_len)
        self.peak = peak_flops(device)
        self.file = self.tensorboard = None
        self.elapsed_before = 0.0  # time spent before a restart
        self.error = ""  # rank 0: why metrics.jsonl cannot be written (a full disk); train.py stops every rank on it
        self.error_cause = None  # the OSError behind it: processes.exit_code decides from it whether a restart may help
        if rank == 0 and steps:
            try:
                self.file, self.elapsed_before = open_metrics(cfg.out_dir, start_step)
            except OSError as e:
                self.unwritable(e)
        if rank == 0 and cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # processes.exit_code: a missing package repeats on a restart
                raise ImportError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
            self.tensorboard = SummaryWriter(os.path.join(cfg.out_dir, "tensorboard"))
        self.start = time.perf_counter()

    def step(self, step: int, record: dict, lr: float, step_time_s: float, mem_gb: float, eval_loss=None,
             progress=None, compute_s_by_rank=None):
        """Logs 1-based `step`. record: train_step's numbers by name, each logged (loss and grad_norm None for
        a skipped step). eval_loss: a number, or
        {"eval_loss": ..., "eval_loss/SOURCE": ...} (data.MixedWindows.losses); progress: the loader's
        windows_by_source and epochs_by_source (data.MixedWindows.progress); compute_s_by_rank: every
        rank's own compute time (compute_s_by_rank), whose slowest rank and median join the row when W > 1."""
        if self.file is None:
            return
        now = time.perf_counter() - self.start
        tokens_per_sec_per_gpu = self.tokens_per_step / step_time_s / self.world
        eta = now / (step - self.start_step) * (self.steps - step)
        metrics = dict(
            step=step, **record, lr=lr, tokens_per_sec_per_gpu=tokens_per_sec_per_gpu,
            mfu=None if self.peak is None else tokens_per_sec_per_gpu * self.flops_per_token / self.peak,
            mem_gb=mem_gb, step_time_s=step_time_s, elapsed_s=self.elapsed_before + now, eta_s=eta)
        if compute_s_by_rank and len(compute_s_by_rank) > 1:
            slowest = max(range(len(compute_s_by_rank)), key=compute_s_by_rank.__getitem__)
            metrics.update(slowest_rank=slowest, slowest_host=self.hosts[slowest] if self.hosts else "?",
                           compute_max_s=compute_s_by_rank[slowest],
                           compute_median_s=statistics.median(compute_s_by_rank))
        if progress is not None:
            metrics["windows_by_source"] = progress["windows_by_source"]
        if eval_loss is not None:
            metrics.update(eval_loss if isinstance(eval_loss, dict) else {"eval_loss": eval_loss})
        if self.cfg.gpu_hour_usd:  # GPU-hours so far (all restarts, downtime excluded) and at the end
            elapsed = metrics["elapsed_s"]
            metrics["cost_usd"] = elapsed / 3600 * self.world * self.cfg.gpu_hour_usd
            metrics["projected_cost_usd"] = (elapsed + eta) / 3600 * self.world * self.cfg.gpu_hour_usd
        epochs = (progress or {}).get("epochs_by_source", {})
        try:
            log_step(self.cfg, metrics, self.file, epochs if any(e > 1 for e in epochs.values()) else None,
                     tuple(key for key in record if key not in ("loss", "grad_norm")))
        except OSError as e:  # a torn last line is dropped on resume
            self.unwritable(e)
            return
        for key, value in metrics.items() if self.tensorboard else ():
            for name, number in (value.items() if isinstance(value, dict) else [(None, value)]):
                if key != "step" and isinstance(number, (int, float)):
                    self.tensorboard.add_scalar(f"{key}/{name}" if name else key, number, step)

    def unwritable(self, e: OSError):
        """Notes why metrics.jsonl cannot be written, for train.py's stop at the step boundary, and lets the file
        go. Closing it flushes what is still buffered, which fails again on a full disk: that second error is the
        same one, and must not escape as a traceback (the first is what the run stops on)."""
        if not self.error:
            self.error, self.error_cause = OD.unwritable(os.path.join(self.cfg.out_dir, "metrics.jsonl"), e), e
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()  # CPython closes the descriptor even when the flush raises
            self.file = None

    def close(self):
        """At the end of the run. An error here (the disk filled after the last step was logged) is a warning:
        the steps, the checkpoint and the export are done."""
        for f in (self.file, self.tensorboard):
            try:
                if f is not None:
                    f.close()
            except OSError as e:
                print(f"warning: --out_dir: {OD.write_error(os.path.join(self.cfg.out_dir, 'metrics.jsonl'), e)}",
                      file=sys.stderr, flush=True)
        self.file = self.tensorboard = None


def open_metrics(out_dir: str, start_step: int):
    """metrics.jsonl, keeping the lines of the steps a resumed run has already done (and only those)."""
    path = os.path.join(out_dir, "metrics.jsonl")
    kept = OD.keep_rows_up_to(path, start_step)
    elapsed_before = json.loads(kept[-1])["elapsed_s"] if kept else 0.0  # time spent before a restart
    return os.fdopen(OD.open_no_follow(path, os.O_WRONLY | os.O_APPEND), "a"), elapsed_before


@contextlib.contextmanager
def profile_step(cfg, step: int, rank: int, device: torch.device):
    """--profile STEP: a torch.profiler trace (Chrome JSON) of that optimizer step, its micro-batches included,
    written by each rank to OUT_DIR/profile/step_N_rank_R.json. train.py's record_function ranges name each
    unit's gather, free, forward, recompute, backward and reduce-scatter in it; CUDA kernels and NCCL
    collectives appear on their streams on GPUs. Any other step: nothing at all."""
    if step != cfg.profile:
        yield
        return
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities)
    prof.start()
    try:
        yield
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the step's kernels, not only their launches
        prof.stop()
        folder = os.path.join(cfg.out_dir, "profile")
        path = os.path.join(folder, f"step_{step}_rank_{rank}.json")
        try:
            os.makedirs(folder, exist_ok=True)
            prof.export_chrome_trace(path)
        except OSError as e:  # a trace is not worth the run
            print(f"warning: --profile: could not write {path} ({e.strerror}); training goes on", file=sys.stderr,
                  flush=True)
        else:
            if rank == 0:
                print(f"wrote a torch.profiler trace of step {step} to {folder}/step_{step}_rank_*.json (one per rank): "
                      f"open it in https://ui.perfetto.dev (Open trace file) or chrome://tracing; how to read it: "
                      f"docs/profiling.md", flush=True)


def host_start_up(state) -> str:
    """What allocating the offloaded state cost at start-up (docs/planning.md: pinning predicts it)."""
    locked = f", page-locked in {state.page_locked_s:.1f} s" if state.page_locked_s is not None else ""
    return f"; one buffer, zeroed in {state.zeroed_s:.1f} s{locked}"


def startup_line(cfg, sharded, start_step: int) -> str:
    """What runs where, printed once by rank 0 (and where a resumed run starts)."""
    mcfg, world, device = sharded.model.cfg, sharded.world, sharded.device
    state_gib = sum(u.persistent_bytes() for u in sharded.units) / 2**30
    device_gib = sum(u.persistent_bytes(on_device_only=True) for u in sharded.units) / 2**30
    where = (f"persistent state {device_gib:.3f} GiB/rank on {device.type}, {state_gib - device_gib:.3f} GiB/rank "
             f"in host memory (--offload_optimizer{host_start_up(sharded.units[0].host.state)})" if cfg.offload_optimizer else
             f"persistent state {state_gib:.3f} GiB/rank")
    line = (f"model {mcfg.n_layers}L d={mcfg.dim} {M.count_params(mcfg)['total'] / 1e6:.1f}M params | world {world} on "
            f"{device.type} | {len(sharded.units)} units | {where} | "
            f"batch {cfg.batch_size} x {cfg.seq_len} = {cfg.batch_size * cfg.seq_len:,} tokens/step | "
            f"accumulation {cfg.batch_size // (world * cfg.micro_batch_size)} | ac {cfg.ac} | {str(sharded.compute_dtype).removeprefix('torch.')} | "
            f"attention: {attention_kernel(device, sharded.compute_dtype, cfg.doc_mask)}")
    if cfg.doc_mask:  # the MFU convention (model.flops_per_token): the window's causal count, not each document's
        line += " | MFU counts attention over the whole window (causal), not per document: more than --doc_mask runs"
    if start_step:
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # torchrun's, on this node
        line += (f"\nresumed from {os.path.join(cfg.out_dir, 'checkpoints', f'step_{start_step:08d}')} at step "
                 f"{start_step}" + (f" (torchrun restart {restarts} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS')})"
                                    if restarts else ""))
    return line


def attention_kernel(device, dtype: torch.dtype, doc_mask: bool) -> str:
    """The kernel model.attention runs, in words (the startup line, bench/gpu.py's table): model.uses_flash's
    choice, and for SDPA model.sdpa_arguments' form of the call. With doc_mask, for rows that pack several
    documents; a row of one document runs the causal path. The SDPA kernel named is the one SDPA's default
    order picks for that call (flash, memory-efficient, math); bench/gpu.py asks torch which one it picks on
    the device, tests/test_attention.py checks the words against the calls."""
    device = torch.device(device)
    if M.uses_flash(device, dtype):
        return "flash_attn varlen (one sequence per document)" if doc_mask else "flash_attn"
    if device.type != "cuda":
        return f"SDPA ({device.type.upper()})"
    if not doc_mask and dtype in M.HALF_DTYPES:
        return "SDPA flash (grouped K/V, causal)"
    return f"SDPA memory-efficient (K/V expanded to H heads, {'block-diagonal mask' if doc_mask else 'causal'})"
