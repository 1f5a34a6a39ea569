"""Two pictures of one optimizer step, for docs/profiling.md.

    python bench/step_picture.py memory [--layers N] [--png docs/step_memory.png] [--json FILE]
    python bench/step_picture.py schedule [--png docs/step_schedule.png] [--traces DIR]
    python bench/step_picture.py draw-memory FILE.json [--png PNG]

memory: the two-node 70B recipe (launch.sbatch's TRAIN_ARGS, as bench/fake_memory.py runs it, flash-attn
stand-in) as rank 0 of 16 under fake CUDA (tests/fake_cuda.py: train.py's own step, no tensor has memory),
with every device allocation and free of the step recorded and put in one of these kinds by where it was
made (the rules are `kind_of_allocation`'s, and they approximate; see there):
  fp32 state          master, gradient, exp_avg, exp_avg_sq shards (allocated before the step)
  gathered weights    the units' gathered bf16 buffers, and each all-gather's input (the shard cast to bf16)
  activations         what forward and checkpointing's recompute make (saved tensors, block inputs back from
                      host memory, logits of the head's forward, the batch's inputs)
  gradients           what backward makes: activation gradients, weight gradients, a unit's flat gradient
                      until its reduce-scatter takes it
  reduce buffers      the reduce-scatter's input in --reduce_dtype and its output shard
  attention scratch   the attention backward kernel's workspace (modelled by tests/fake_cuda.py, not measured)
  other               the optimizer's and the gradient norm's temporaries
It draws the bytes of each kind over the step (x: allocation events in order, not time: nothing runs) with
the planner's three phases (plan_memory.memory_by_phase, allocated bytes without the CUDA context and the
fragmentation it adds) and its predicted peak marked. --layers N runs the 70B model with N of its 80
blocks (every shape the same), to be quicker; the picture says so. Without matplotlib it writes FILE.json
and says how to draw it (draw-memory, on a machine that has matplotlib).

schedule: train.py --profile 2 at W = 2 on this CPU (torchrun, gloo, the tiny preset, 2 micro-batches), with
--prefetch true and false; one lane per unit from rank 0's trace: its forward, recompute and backward on
top, its all-gathers (issue to wait) and reduce-scatters (issue to wait) as bars below. --traces DIR
draws step_2_rank_0.json of DIR/prefetch_true and DIR/prefetch_false instead (a GPU run's, for example).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)

import fake_cuda  # noqa: E402  (imports no torch: the memory child loads the shim before torch)

GIB = 2**30
KINDS = ["fp32 state", "gathered weights", "activations", "gradients", "reduce buffers", "attention scratch", "other"]
COLORS = ["#9e9e9e", "#1f77b4", "#2ca02c", "#d62728", "#ff7f0e", "#8c564b", "#e377c2"]


# ------------------------------------------------------------------------------------------------
# memory: a recording DeviceMemory, run inside tests/fake_cuda.py's child
# ------------------------------------------------------------------------------------------------

SITES = {  # a function on the Python stack when the allocation is made -> its kind (first found, innermost first)
    "start_gather": "gathered weights", "reduce_scatter_grad": "reduce buffers",
    "to_host": "activations", "start_copy_back": "activations", "wait_copy_back": "activations",
    "micro_batches": "activations", "global_grad_norm": "other", "optimizer_step": "other", "adamw_step": "other",
}


def kind_of_allocation(where: str) -> str:
    """The kind of a device allocation made now. Before the step: the fp32 state (the gathered buffers, made
    then too, are re-kinded when resized: RecordingMemory.resized). Then the innermost SITES function on the
    stack; else by what autograd is doing: outside backward (forward) an activation; inside backward with
    grad mode on (checkpointing's recompute) an activation; inside backward with it off a gradient. So a
    tensor made in backward to compute a gradient but not itself one (a cast, a recomputed softmax chunk of
    the head) counts as a gradient: an approximation."""
    import torch
    if where == "setup":
        return "fp32 state"
    frame = sys._getframe(2)
    while frame is not None:
        kind = SITES.get(frame.f_code.co_name)
        if kind and frame.f_code.co_filename.startswith(ROOT):
            return kind
        frame = frame.f_back
    if torch._C._current_autograd_node() is None or torch.is_grad_enabled():
        return "activations"
    return "gradients"


class RecordingMemory(fake_cuda.DeviceMemory):
    """tests/fake_cuda.py's DeviceMemory, also keeping the live bytes of each kind after every change."""
    instance = None

    def __init__(self):
        super().__init__()
        RecordingMemory.instance = self
        self.kind = {}                        # id(storage) -> its kind
        self.counted = {}                     # id(storage) -> bytes counted in by_kind
        self.by_kind = dict.fromkeys(KINDS, 0)
        self.samples, self.phases = [], []   # [bytes of each kind], and (sample index, phase) at each change

    def sync(self, key):
        entry = self.live.get(key)
        nbytes = entry[1] if entry else 0
        kind = self.kind.get(key, "other")
        self.by_kind[kind] += nbytes - self.counted.get(key, 0)
        if entry:
            self.counted[key] = nbytes
        else:
            self.counted.pop(key, None)
            self.kind.pop(key, None)

    def sample(self):
        if self.where != "setup":
            if not self.phases or self.phases[-1][1] != self.where:
                self.phases.append((len(self.samples), self.where))
            self.samples.append([self.by_kind[k] + (self.workspace if k == "attention scratch" else 0) for k in KINDS])

    def add(self, storage, label):
        key = id(storage)
        if key not in self.live:
            self.kind[key] = kind_of_allocation(self.where)
        super().add(storage, label)
        self.sync(key)
        self.sample()

    def drop(self, key):
        super().drop(key)
        self.sync(key)
        self.sample()

    def resized(self, storage):
        key = id(storage)
        if key in self.live and self.kind.get(key) != "gathered weights":  # only the units' gathered buffers are resized
            counted = self.counted.get(key, 0)  # made before the step, counted as state until now
            self.by_kind[self.kind.get(key, "other")] -= counted
            self.by_kind["gathered weights"] += counted
            self.kind[key] = "gathered weights"
        super().resized(storage)
        self.sync(key)
        self.sample()

    def accumulated_in_place(self, old, new, label):
        super().accumulated_in_place(old, new, label)
        self.sync(id(old))
        self.sync(id(new))
        self.sample()

    def check_taken_over(self):
        key = self.taken_over[1] if self.taken_over else None
        super().check_taken_over()
        if key is not None:
            self.sync(key)

    def update_peak(self):
        super().update_peak()
        if self.workspace:  # a kernel's scratch, alive only while it runs
            self.sample()


def decimate(samples: list, phases: list, most: int = 6000) -> tuple[list, list]:
    """At most `most` samples, each bucket kept by its largest total: the peaks stay."""
    if len(samples) <= most:
        return samples, phases
    size = -(-len(samples) // most)
    kept = [max(samples[i:i + size], key=sum) for i in range(0, len(samples), size)]
    return kept, [(i // size, phase) for i, phase in phases]


def memory_child(argv: list[str]):
    """Inside the fresh process: tests/fake_cuda.py's child with the recording memory, then its samples."""
    series_json = argv.pop(0)
    fake_cuda.DeviceMemory = RecordingMemory
    fake_cuda.child(argv)
    memory = RecordingMemory.instance
    samples, phases = decimate(memory.samples, memory.phases)
    # ... and every event around the peak, for the close-up
    top = max(range(len(memory.samples)), key=lambda i: sum(memory.samples[i]))
    lo, hi = max(0, top - 2500), min(len(memory.samples), top + 1500)
    zoom_phases = [(max(i, lo), p) for (i, p), (j, _) in zip(memory.phases, memory.phases[1:] + [(hi, "")]) if j > lo and i < hi]
    with open(series_json, "w") as f:
        json.dump(dict(kinds=KINDS, samples=samples, phases=phases, events=len(memory.samples), end=memory.samples[-1],
                       zoom=dict(first=lo, samples=memory.samples[lo:hi], phases=zoom_phases)), f)


def run_memory(layers: int, build_dir: str, json_path: str, command: str) -> dict:
    import fake_memory as FM
    title, flags, world = FM.recipes()["two-node"]
    shim = fake_cuda.build_shim(build_dir)
    model_args = []
    if layers:
        import dataclasses
        from components import hf
        import train as T
        mcfg = dataclasses.replace(hf.model_config(T.parse_args(flags)), n_layers=layers)
        model_args = ["--model_json", json.dumps(dataclasses.asdict(mcfg))]
    with tempfile.TemporaryDirectory() as tmp:
        out, series = os.path.join(tmp, "out.json"), os.path.join(tmp, "series.json")
        cmd = [sys.executable, os.path.abspath(__file__), "memory-child", series, out, "--shim", shim, "--world",
               str(world), "--rank", "0", "--flash", *model_args, "--", *flags]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"error: the fake-CUDA step failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        result, recorded = json.load(open(out)), json.load(open(series))
    data = dict(recorded, command=command, title=title, flags=flags, world=world, layers=result["model"]["n_layers"],
                measured_peak_bytes=result["peak_bytes"], plan=result["plan"], seconds=result["seconds"])
    with open(json_path, "w") as f:
        json.dump(data, f)
    return data


def stack(ax, x, samples, floor_gib: float):
    ax.stackplot(x, *[[s[i] / GIB for s in samples] for i in range(len(KINDS))], labels=KINDS, colors=COLORS,
                 linewidth=0)
    ax.set_ylim(floor_gib, None)


def draw_memory(data: dict, png: str, command: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    samples, plan = data["samples"], data["plan"]
    state_gib = samples[0][0] / GIB
    floor = max(0.0, state_gib - 3)  # the fp32 state is constant: the axis starts just below its top
    measured = data["measured_peak_bytes"] / GIB
    ceiling = max(measured, max(plan["allocated_by_phase"].values()) / GIB) + 1.5
    fig, (whole, close) = plt.subplots(2, 1, figsize=(13, 9.5), height_ratios=(1, 1.1))
    stack(whole, range(len(samples)), samples, floor)
    # Backward of each micro-batch: shaded from the head's backward to the end of the embedding's.
    phases = data["phases"] + [(len(samples), "end")]
    start = None
    for (i, phase), (j, _) in zip(phases, phases[1:]):
        if phase == "head backward" and start is None:
            start = i
        if phase == "embed backward":
            whole.axvspan(start, j, color="#000000", alpha=0.06, linewidth=0)
            whole.text((start + j) / 2, floor + 0.2, "backward", ha="center", va="bottom", fontsize=8)
            start = None
    whole.set_xlim(0, len(samples))
    whole.set_xlabel(f"the whole step: its {data['events']:,} allocation and free events in order (not time), "
                     f"each point the largest of ~{-(-data['events'] // len(samples))}")
    zoom = data["zoom"]
    zx = range(zoom["first"], zoom["first"] + len(zoom["samples"]))
    stack(close, zx, zoom["samples"], floor)
    for i, phase in zoom["phases"]:
        close.axvline(i, color="white", linewidth=0.6)
        if phase.endswith("backward") and i + 150 < zx[-1]:
            close.text(i + 20, ceiling - 0.3, phase.replace(" backward", ""), rotation=90, va="top", fontsize=7)
    close.set_xlim(zx[0], zx[-1])
    close.set_xlabel("close-up around the peak, every event: the head's and the last blocks' backward of one "
                     "micro-batch (labels: the stage whose backward runs)")
    styles = iter([(0, (1, 1)), (0, (4, 2)), (0, (6, 2, 1, 2))])
    for phase, nbytes in sorted(plan["allocated_by_phase"].items(), key=lambda p: -p[1]):
        peak = phase == plan["peak_phase"]
        style = "-" if peak else next(styles)
        for ax in (whole, close):
            ax.axhline(nbytes / GIB, color="black", linestyle=style, linewidth=1.2 if peak else 0.9,
                       label=f"planned, {phase}: {nbytes / GIB:.2f} GiB" + (" (the predicted peak)" if peak else ""))
    for ax in (whole, close):
        ax.axhline(measured, color="#d62728", linewidth=0.8, label=f"measured peak: {measured:.2f} GiB")
        ax.set_ylim(floor, ceiling)
        ax.set_ylabel(f"GiB allocated (from {floor:.0f})")
    close.legend(loc="lower left", fontsize=8, ncol=3, framealpha=0.95)
    layers = data["layers"]
    model = "Llama-3-70B" if layers == 80 else f"Llama-3-70B's shapes with {layers} of its 80 blocks"
    whole.set_title(f"One optimizer step of rank 0 of {data['world']}: {model}, {data['title']}; measured under fake "
                    f"CUDA (no GPU),\ndevice bytes as torch.cuda.memory_allocated counts them, by kind; the fp32 state "
                    f"({state_gib:.1f} GiB) fills the axis below {floor:.0f} GiB", fontsize=10)
    fig.text(0.01, 0.005, command, fontsize=7, family="monospace")
    fig.tight_layout(rect=(0, 0.015, 1, 1))
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# schedule: lanes per unit from a --profile trace
# ------------------------------------------------------------------------------------------------

def trace_ranges(path: str) -> tuple[list, list]:
    """(train.py's ranges on the step's thread, gloo's collective ranges on its threads): (name, start, end) in
    ms from the first range."""
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "user_annotation" and e.get("ph") == "X"]
    main = next(e["tid"] for e in events if e["name"] == "optimizer_step")
    t0 = min(e["ts"] for e in events if e["tid"] == main)
    spans = sorted((e["name"], (e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3) for e in events)
    ours = [s for s, e in zip(spans, sorted(events, key=lambda e: (e["name"], e["ts"]))) if e["tid"] == main]
    ours.sort(key=lambda s: s[1])
    others = sorted((s for s, e in zip(spans, sorted(events, key=lambda e: (e["name"], e["ts"]))) if e["tid"] != main),
                    key=lambda s: s[1])
    return ours, others


def unit_bars(ranges: list) -> dict:
    """{unit: {"compute": [(start, end, kind)], "comm": [(start, end, kind)]}}: forward and recompute as
    ranged; backward from the end of its `backward U (enter)` to the next `backward ... (enter)` (or, for the
    last stage of a micro-batch, the end of its reduce-scatter's issue); a collective from its issue's start
    to its wait's end."""
    bars, issued = {}, {}
    enters = [(s, e, n.split()[1]) for n, s, e in ranges if n.startswith("backward ")]
    for n, s, e in ranges:
        if n.endswith("(issue)"):
            issued.setdefault(tuple(n.split()[:2]), []).append(s)
    for n, s, e in ranges:
        if n.split()[0] not in ("forward", "recompute", "gather", "reduce_scatter"):
            continue  # backward: below; grad_norm, clip, optimizer_step: their own lane; checkpointed: inside forward
        verb, unit = n.split()[:2]
        lane = bars.setdefault(unit, {"compute": [], "comm": []})
        if verb in ("forward", "recompute"):
            lane["compute"].append((s, e, verb))
        elif n.endswith("(wait)"):  # from the oldest issue begun before the wait ended (inside it, without prefetch)
            pending = issued.get((verb, unit), [])
            if pending and pending[0] <= e:
                lane["comm"].append((pending.pop(0), e, verb))
            # else a unit still gathered (the head, from its forward into its backward): nothing was issued
    for k, (s, e, unit) in enumerate(enters):
        nxt = next((s2 for s2, _, u2 in enters[k + 1:k + 2]), None)
        if unit == "embed" or nxt is None:
            nxt = next((s2 for n2, s2, _ in ranges if n2 == f"reduce_scatter {unit} (issue)" and s2 > e), e)
        bars[unit]["compute"].append((e, nxt, "backward"))
    return bars


def run_schedule_traces(folder: str):
    import numpy as np
    tokens = os.path.join(folder, "tokens.npy")
    np.save(tokens, np.random.default_rng(0).integers(3, 512, 20000).astype(np.uint16))
    for prefetch in ("true", "false"):
        out = os.path.join(folder, f"prefetch_{prefetch}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.join(ROOT, "train.py"), "--model=tiny", f"--data={tokens}", "--seq_len=64", "--batch_size=4",
               "--micro_batch_size=1", "--steps=2", "--warmup_steps=1", "--eval_every=0", "--profile=2",
               f"--prefetch={prefetch}", f"--out_dir={out}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"error: train.py --profile failed:\n{proc.stderr[-3000:]}")
        os.replace(os.path.join(out, "profile", "step_2_rank_0.json"), os.path.join(folder, f"prefetch_{prefetch}.json"))


def draw_schedule(folder: str, png: str, command: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = dict(forward="#2ca02c", recompute="#98df8a", backward="#d62728", gather="#1f77b4", reduce_scatter="#ff7f0e")
    fig, axes = plt.subplots(2, 1, figsize=(14, 8))
    for ax, prefetch in zip(axes, ("true", "false")):
        path = os.path.join(folder, f"prefetch_{prefetch}", "profile", "step_2_rank_0.json")
        if not os.path.exists(path):
            path = os.path.join(folder, f"prefetch_{prefetch}.json")
        ranges, gloo = trace_ranges(path)
        bars = unit_bars(ranges)
        units = list(bars)
        for row, unit in enumerate(units):
            y = len(units) - row
            for s, e, kind in sorted(bars[unit]["compute"], key=lambda b: b[2] != "backward"):  # recompute on top
                ax.barh(y + 0.18, e - s, left=s, height=0.34, color=colors[kind], linewidth=0)
            for s, e, kind in bars[unit]["comm"]:
                ax.barh(y - 0.18, e - s, left=s, height=0.34, color=colors[kind], linewidth=0)
        step = [(s, e) for n, s, e in ranges if n in ("grad_norm", "clip", "optimizer_step")]
        for s, e in step:
            ax.barh(0, e - s, left=s, height=0.5, color="#7f7f7f", linewidth=0)
        for n, s, e in gloo:
            ax.barh(-1, max(e - s, 0.05), left=s, height=0.5, color="#17becf", linewidth=0)
        ax.set_yticks(range(-1, len(units) + 1),
                      ["gloo threads", "grad norm, clip, AdamW"] + [units[len(units) - y] for y in range(1, len(units) + 1)])
        ax.set_title(f"--prefetch {prefetch}: rank 0 of 2, one step (2 micro-batches), tiny preset on a 2-core CPU",
                     fontsize=10)
        ax.set_xlabel("ms from the step's first range")
        ax.set_xlim(0, max(e for _, _, e in ranges) * 1.01)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in list(colors.values()) + ["#17becf"]]
    fig.legend(handles, ["forward", "recompute (--ac selective)", "backward", "all-gather: issue to wait",
                         "reduce-scatter: issue to wait", "gloo runs a collective"], loc="upper right", fontsize=8, ncol=3)
    fig.text(0.01, 0.005, command, fontsize=7, family="monospace")
    fig.tight_layout(rect=(0, 0.02, 1, 0.95))
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main():
    if sys.argv[1:2] == ["memory-child"]:
        return memory_child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("memory", "schedule", "draw-memory"))
    parser.add_argument("json_in", nargs="?", default="", help="draw-memory: the JSON `memory` wrote")
    parser.add_argument("--layers", type=int, default=0, help="memory: blocks of the 70B model (0: all 80)")
    parser.add_argument("--png", default="")
    parser.add_argument("--json", default="", help="memory: keep the recorded numbers here")
    parser.add_argument("--traces", default="", help="schedule: draw these traces instead of making them")
    parser.add_argument("--build_dir", default=os.path.join(os.path.expanduser("~"), ".cache", "llama-zero3"))
    args = parser.parse_args()
    command = "python bench/step_picture.py " + " ".join(sys.argv[1:])
    try:
        import matplotlib  # noqa: F401
        has_matplotlib = True
    except ImportError:
        has_matplotlib = False
    if args.what == "schedule":
        png = args.png or os.path.join(ROOT, "docs", "step_schedule.png")
        folder = args.traces or tempfile.mkdtemp(prefix="step_schedule_")
        if not args.traces:
            run_schedule_traces(folder)
        if not has_matplotlib:
            return print(f"no matplotlib: the traces are in {folder}; open them in https://ui.perfetto.dev, or draw them "
                         f"with `python bench/step_picture.py schedule --traces {folder}` where matplotlib is installed")
        draw_schedule(folder, png, command)
        return print(f"wrote {png}")
    png = args.png or os.path.join(ROOT, "docs", "step_memory.png")
    if args.what == "draw-memory":
        data = json.load(open(args.json_in))
    else:
        json_path = args.json or (os.path.splitext(png)[0] + ".json" if not has_matplotlib else
                                  os.path.join(tempfile.mkdtemp(prefix="step_memory_"), "step_memory.json"))
        data = run_memory(args.layers, args.build_dir, json_path, command)
        plan = data["plan"]
        print(f"measured peak {data['measured_peak_bytes'] / GIB:.2f} GiB, planned {plan['allocated_bytes'] / GIB:.2f} "
              f"GiB ({plan['peak_phase']}); {data['events']:,} allocation events; {data['seconds']:.0f} s in the "
              f"fake-CUDA process; numbers in {json_path}")
        if not has_matplotlib:
            return print(f"no matplotlib: draw them with `python bench/step_picture.py draw-memory {json_path}` where it "
                         f"is installed (the JSON holds each kind's bytes per event, the phases and the planner's figures)")
    draw_memory(data, png, data.get("command", command))  # the command that measured it
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
