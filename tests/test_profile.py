"""--profile STEP: a torch.profiler trace of one step, whose named ranges show the ZeRO-3 schedule as it ran.

Two ranks (torchrun, gloo, CPU), the tiny preset, 2 micro-batches per rank; the trace of step 2 is read back
and each unit's ranges are checked in the order the step runs them, with --prefetch true and false."""
import json

import pytest
from common import learnable_tokens, run_train

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
        result[prefetch] = proc.stdout, [step_ranges(f) for f in files]
    return result


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_trace_names_every_units_ranges_in_the_order_the_step_runs_them(traces, prefetch):
    stdout, by_rank = traces[prefetch]
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
    import checks
    import train as T
    cfg = T.parse_args([f"--out_dir={tmp_path}", "--steps=1", "--profile=3"])
    assert "--profile 3 is beyond --steps 1: no trace will be written" in checks.config_warnings(cfg)
    errors = checks.check_config(T.parse_args([f"--out_dir={tmp_path}", "--profile=-1"]), 1)
    assert "--profile: a step number >= 1 (0: no trace), got -1" in errors
