"""--profile STEP: a torch.profiler trace of one step, whose named ranges show the ZeRO-3 schedule as it ran.

Two ranks (torchrun, gloo, CPU), the tiny preset, 2 micro-batches per rank; the trace of step 2 is read back
and each unit's ranges are checked in the order the step runs them, with --prefetch true and false."""
import json
import os
import subprocess
import sys

import pytest
from common import ROOT, learnable_tokens, run_train

sys.path.insert(0, os.path.join(ROOT, "bench"))

STAGES = ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]  # the tiny preset's units, in order
MICRO_BATCHES = 2  # --batch_size 4 = W 2 x --micro_batch_size 1 x 2


def step_ranges(path) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of train.py's record_function ranges, by start. On CPU, backward runs on the
    thread that called it: one thread holds them all (gloo's threads have ranges of their own, gloo:...)."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "user_annotation"]
    main = next(e["tid"] for e in events if e["name"] == "optimizer_step")
    return sorted((e["name"], e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == main and e.get("ph") == "X")


def occurrences(ranges, name) -> list[tuple[float, float]]:
    return [(start, end) for n, start, end in ranges if n == name]


def latest_before(ranges, name, t) -> tuple[float, float]:
    """The last `name` range started before time t."""
    before = [r for r in occurrences(ranges, name) if r[0] < t]
    assert before, f"no {name!r} before {t}"
    return before[-1]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """{prefetch: (stdout, [rank 0's ranges, rank 1's])}: one W=2 run each way, step 2 of 2 traced."""
    tmp = tmp_path_factory.mktemp("profile")
    tokens = learnable_tokens(str(tmp / "tokens.npy"), 512)
    result = {}
    for prefetch in (True, False):
        out = tmp / f"out_{prefetch}"
        proc = run_train(["--model=tiny", f"--data={tokens}", "--seq_len=32", "--batch_size=4", "--micro_batch_size=1",
                          "--steps=2", "--warmup_steps=1", "--eval_every=0", "--profile=2", f"--prefetch={prefetch}",
                          f"--out_dir={out}"], nproc=2)
        files = sorted((out / "profile").iterdir())
        assert [f.name for f in files] == ["step_2_rank_0.json", "step_2_rank_1.json"]
        result[prefetch] = proc.stdout, [step_ranges(f) for f in files], str(files[0])
    return result


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_trace_names_every_units_ranges_in_the_order_the_step_runs_them(traces, prefetch):
    stdout, by_rank, _ = traces[prefetch]
    assert "ui.perfetto.dev" in stdout and "chrome://tracing" in stdout
    for ranges in by_rank:
        names = [n for n, _, _ in ranges]
        assert names.count("grad_norm") == 1 and names.count("optimizer_step") == 1
        assert max(end for n, _, end in ranges if n.startswith(("forward", "backward", "reduce_scatter"))) < \
            occurrences(ranges, "optimizer_step")[0][0]
        for k, stage in enumerate(STAGES):
            forwards = occurrences(ranges, f"forward {stage}")
            backwards = occurrences(ranges, f"backward {stage} (enter)")
            issues = occurrences(ranges, f"reduce_scatter {stage} (issue)")
            assert len(forwards) == len(backwards) == len(issues) == MICRO_BATCHES, stage
            assert len(occurrences(ranges, f"reduce_scatter {stage} (wait)")) == MICRO_BATCHES, stage
            if 0 < k < len(STAGES) - 1:  # a block, under the default --ac selective: recomputed in its backward
                recomputes = occurrences(ranges, f"recompute {stage}")
                assert len(recomputes) == MICRO_BATCHES and all(
                    b[1] < r[0] for b, r in zip(backwards, recomputes)), stage
            for m, (f_start, f_end) in enumerate(forwards):
                # gathered before its forward: its last wait ended before the forward began, no free between
                wait = latest_before(ranges, f"gather {stage} (wait)", f_start)
                assert wait[1] <= f_start
                assert not [r for r in occurrences(ranges, f"free {stage}") if wait[1] <= r[0] < f_start], stage
                # its backward enters (after its forward), then its gradient's reduce-scatter is issued, before
                # the backward of the stage before it enters
                assert f_end < backwards[m][0] and backwards[m][1] <= issues[m][0], stage
                if k > 0:
                    assert issues[m][1] <= occurrences(ranges, f"backward {STAGES[k - 1]} (enter)")[m][0], stage
            if k == 0:
                continue
            # The gather of this stage for its forward: issued while the stage before computes (prefetch), or
            # only after it ended.
            for f_start, _ in forwards:
                issue = latest_before(ranges, f"gather {stage} (issue)", f_start)
                previous_forward = latest_before(ranges, f"forward {STAGES[k - 1]}", f_start)
                assert (issue[0] < previous_forward[1]) == prefetch, (stage, issue, previous_forward)
            # ... and for its backward (the embedding has none): issued as the stage after it enters backward, or
            # only as its own does.
            if k < len(STAGES) - 1:
                for own_enter, after_enter in zip(backwards, occurrences(ranges, f"backward {STAGES[k + 1]} (enter)")):
                    issue = latest_before(ranges, f"gather {stage} (issue)", own_enter[1])
                    assert (after_enter[0] <= issue[0] <= after_enter[1]) == prefetch, stage
                    assert (own_enter[0] <= issue[0] <= own_enter[1]) != prefetch, stage


def test_a_step_beyond_the_run_is_a_warning_and_a_negative_one_an_error(tmp_path):
    from components import flags
    import train as T
    cfg = T.parse_args([f"--out_dir={tmp_path}", "--steps=1", "--profile=3"])
    assert "--profile 3 is beyond --steps 1: no trace will be written" in flags.config_warnings(cfg)
    errors = flags.check_config(T.parse_args([f"--out_dir={tmp_path}", "--profile=-1"]), 1)
    assert "--profile: a step number >= 1 (0: no trace), got -1" in errors


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_schedule_pictures_bars_show_prefetch_as_the_trace_has_it(traces, prefetch):
    """bench/step_picture.py's lanes (docs/step_schedule.png): each all-gather bar runs from its issue to its
    wait's end; the next block's starts before this block's forward bar ends exactly when prefetching."""
    import step_picture
    ranges, _ = step_picture.trace_ranges(traces[prefetch][2])
    bars = step_picture.unit_bars(ranges)
    assert list(bars) == STAGES
    for k in range(1, len(STAGES) - 1):
        forwards = [b for b in bars[STAGES[k - 1]]["compute"] if b[2] == "forward"]
        gathers = [b for b in bars[STAGES[k]]["comm"] if b[2] == "gather"]
        backwards = [b for b in bars[STAGES[k]]["compute"] if b[2] == "backward"]
        assert len(forwards) == len(backwards) == MICRO_BATCHES and len(gathers) == 2 * MICRO_BATCHES  # fwd, bwd
        for m in range(MICRO_BATCHES):
            gather = gathers[2 * m]
            assert gather[1] <= [b for b in bars[STAGES[k]]["compute"] if b[2] == "forward"][m][0]
            assert (gather[0] < forwards[m][1]) == prefetch, (STAGES[k], gather, forwards[m])
            assert gathers[2 * m + 1][1] <= backwards[m][0]  # gathered again before its backward runs


@pytest.fixture(scope="module")
def shim():
    import fake_cuda
    try:
        return fake_cuda.build_shim(os.environ.get("FAKE_CUDA_BUILD_DIR",
                                                   os.path.join(os.path.expanduser("~"), ".cache", "llama-zero3")))
    except RuntimeError as e:
        pytest.skip(f"fake CUDA not available: {e}")


def test_the_memory_pictures_kinds_add_up_to_what_fake_cuda_counts(shim, tmp_path):
    """docs/step_memory.png's numbers, at 70B shapes with 2 blocks: at every event the kinds sum to the live
    bytes (none negative), their largest sum is the step's measured peak, at the end only the fp32 state is
    left, and each kind the step makes appears."""
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "step_picture.py"), "memory", "--layers", "2",
                           "--json", str(out), "--png", str(tmp_path / "memory.png")], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    kinds, samples = data["kinds"], data["samples"] + data["zoom"]["samples"]
    assert data["layers"] == 2 and data["world"] == 16
    assert all(min(s) >= 0 for s in samples)
    assert max(sum(s) for s in samples) == data["measured_peak_bytes"]
    state = kinds.index("fp32 state")
    assert data["end"] == [data["samples"][0][state] if i == state else 0 for i in range(len(kinds))]
    for kind in ("gathered weights", "activations", "gradients", "reduce buffers", "attention scratch"):
        assert max(s[kinds.index(kind)] for s in samples) > 0, kind
    # the planner's phases are drawn beside it: its peak within 1% of the measured one, as BENCHMARKS.md has it
    assert abs(data["plan"]["allocated_bytes"] / data["measured_peak_bytes"] - 1) < 0.01
