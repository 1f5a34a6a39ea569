"""launch.sh as a cluster runs it. Two launch.sh on this machine with NNODES=2, MASTER_ADDR=127.0.0.1 and
one process each are two nodes to torchrun, the c10d rendezvous and gloo: the tests run the job that way,
kill a rank on one node while the other is slow to notice, stop it with the signals a scheduler sends,
and feed it errors a restart cannot fix.

Why launch.sh uses torchrun's own restarts with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torch 2.13, gloo).
Each failing command below was run on this machine with the flags of BASE, node B started first (it
hosts the rendezvous store) with ZERO3_FAULT=hang:3::20, node A with ZERO3_FAULT=kill_mid_step:3:
  - a fresh torchrun per attempt, one --rdzv_id (the previous launch.sh):
        NNODES=2 MASTER_ADDR=127.0.0.1 NPROC_PER_NODE=1 MAX_RESTARTS=3 ./launch.sh ...   (on each node)
    node A's torchrun exits and closes the rendezvous; B still hosts the store while its worker sleeps,
    so A's next three torchruns end at once in RendezvousClosedError and B waits for A forever.
  - torchrun's own restarts with the store shared (the default):
        torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:PORT
                 --rdzv_id x --max-restarts 2 train.py ...
    every restarted attempt fails in init_process_group: "Gloo connectFullMesh failed ... Connection
    refused": the new group reads the dead attempt's addresses from the shared store
    (pytorch/pytorch#135712, #167288; NCCL fails the same way).
  - the same with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 finishes, resuming bit-exact: test_restart_across_nodes.
"""
import functools
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest
from common import ROOT, free_port, model_and_tokens, read_metrics, run_train

from components import checks  # noqa: E402
from components import hf  # noqa: E402
from components import offload as O  # noqa: E402
from tools import plan as P  # noqa: E402
import train as T  # noqa: E402

LAUNCH = os.path.join(ROOT, "launch.sh")
BASE = ["--seq_len=16", "--batch_size=8", "--micro_batch_size=2", "--dtype=float32", "--steps=6", "--lr=3e-3",
        "--warmup_steps=2", "--seed=4", "--timeout_min=1", "--ckpt_every=2"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return model_and_tokens(tmp_path_factory.mktemp("launch"))


@pytest.fixture(scope="module")
def reference(files, tmp_path_factory):
    """Losses of an uninterrupted --standalone W=2 run of the same flags."""
    out = tmp_path_factory.mktemp("reference")
    run_train(BASE + files + [f"--out_dir={out}"], nproc=2)
    return [m["loss"] for m in read_metrics(out)]


def start_launch(args, log, **env) -> subprocess.Popen:
    """./launch.sh in a session of its own (so its process group can be signalled as a scheduler does)."""
    full_env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", **env)
    return subprocess.Popen([LAUNCH, *args], stdout=log, stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=True)


def start_node(args, port, log, **env) -> subprocess.Popen:
    env = {"NPROC_PER_NODE": "1", **env}
    return start_launch(args, log, NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDZV_ID="test", **env)


def wait_all(procs, timeout):
    """Exit codes; any process still running at the deadline is killed (with its whole group) and
    reported as None, so a hung job fails the test instead of hanging it."""
    deadline, codes = time.time() + timeout, []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1, deadline - time.time())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return codes


def wait_for_steps(out_dir, n, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(out_dir / "metrics.jsonl") and len(read_metrics(out_dir)) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps in {out_dir} after {timeout} s")


def wait_for_port(port, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on {port}")


def test_two_nodes_equal_one_node_bit_for_bit(files, reference, tmp_path):
    port, out = free_port(), tmp_path / "run"
    with open(tmp_path / "a.log", "w") as la, open(tmp_path / "b.log", "w") as lb:
        nodes = [start_node(BASE + files + [f"--out_dir={out}"], port, log) for log in (la, lb)]
        codes = wait_all(nodes, 240)
    assert codes == [0, 0], (tmp_path / "a.log").read_text()[-3000:] + (tmp_path / "b.log").read_text()[-3000:]
    assert [m["loss"] for m in read_metrics(out)] == reference


def test_the_tests_forked_runs_end_as_torchruns_do(files, tmp_path):
    """The suite forks its W >= 2 runs from a warm python (tests/warm_start.py); `reference` is one, and the test
    above matches it with real torchrun's losses. Here a refusal under both: the same error line (from each rank that
    says it before the launcher stops the others), the first rank to end exits with 2 (torchrun's root cause), and
    the run with 1."""
    flags = BASE + files + ["--lr=-1", f"--out_dir={tmp_path}"]
    real = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.join(ROOT, "train.py"), *flags], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    forked = run_train(flags, nproc=2, check=False)
    errors = [{line for line in proc.stderr.splitlines() if line.startswith("error:")} for proc in (real, forked)]
    assert errors[0] == errors[1] and len(errors[0]) == 1, (real.stderr[-2000:], forked.stderr[-2000:])
    assert real.returncode == forked.returncode == 1
    assert re.search(r"exitcode\s*: 2\b", real.stderr) and forked.first_failure["exit_code"] == 2


def test_restart_across_nodes(files, reference, tmp_path):
    """A rank on node A is killed mid-step while node B, which hosts the rendezvous store, is busy for 10 s
    (as an NCCL rank is until its collective times out). Both nodes must come back and finish, bit-exact."""
    port, out = free_port(), tmp_path / "run"
    args = BASE + files + [f"--out_dir={out}"]
    with open(tmp_path / "a.log", "w") as la, open(tmp_path / "b.log", "w") as lb:
        node_b = start_node(args, port, lb, ZERO3_FAULT="hang:3::10",
                            ZERO3_FAULT_ONCE=str(tmp_path / "b.fired"))
        wait_for_port(port)  # B's torchrun hosts the store
        node_a = start_node(args, port, la, ZERO3_FAULT="kill_mid_step:3", ZERO3_FAULT_ONCE=str(tmp_path / "a.fired"))
        codes = wait_all([node_a, node_b], 300)
    logs = (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()
    assert codes == [0, 0], logs[-6000:]
    assert (tmp_path / "a.fired").exists() and (tmp_path / "b.fired").exists()
    assert "resumed from" in logs and "at step 2" in logs
    assert [m["loss"] for m in read_metrics(out)] == reference


@pytest.mark.parametrize("fault,error", [
    ({}, "error: --lr must be > 0"),
    ({"ZERO3_FAULT": "nan:3:1"}, "error: step 3: loss nan"),
])
def test_errors_a_restart_repeats_are_not_retried(files, tmp_path, fault, error):
    args = BASE + files + [f"--out_dir={tmp_path}"] + (["--lr=-1"] if not fault else [])
    with open(tmp_path / "log", "w") as log:
        proc = start_launch(args, log, NPROC_PER_NODE="2", MAX_RESTARTS="3", **fault)
        codes = wait_all([proc], 180)
    text = (tmp_path / "log").read_text()
    assert codes == [2], text[-3000:]
    # From one attempt only: at most once per rank (torchrun may stop the second rank before it prints).
    assert 1 <= text.count(error) <= 2, text[-3000:]
    assert_last_words(text, error)


# What torchrun itself prints when it is stopped, or when the other node's store goes away: its log lines
# (W1204 12:00:00.000 ...), its SignalException traceback, and its store client's C++ warnings with their frames.
TORCHRUN_NOISE = re.compile(r"^[WEI]\d{4} |^\[[WEI]\d{4}|Traceback|SignalException|Exception raised from|^frame #", re.M)


def assert_last_words(log: str, error: str):
    """The trainer's error line is the last thing printed but launch.sh's one-line note right after it,
    and nothing of torchrun's own is printed at all."""
    lines = [line for line in log.splitlines() if line.strip()]
    assert lines[-1] == "launch.sh: train.py stopped with an error a restart would repeat (above); not restarting", log
    assert lines[-2].startswith(error), log
    assert not TORCHRUN_NOISE.search(log), log


def test_a_node_with_fewer_gpus_is_named_and_its_error_is_the_last_word(files, tmp_path):
    """Node A runs 1 process, node B 2 (as a node with 7 GPUs beside one with 8 would): a world of 3, where
    the first error used to be --batch_size's (8 is not a multiple of 3 x 2), naming no GPU count. Every
    rank names its node's count instead, before any work, and on both nodes that line is the last word:
    the node whose torchrun hosts the store (B) stops it, and A's torchrun says nothing about it."""
    port = free_port()
    args = BASE + files + [f"--out_dir={tmp_path / 'run'}"]
    with open(tmp_path / "a.log", "w") as la, open(tmp_path / "b.log", "w") as lb:
        node_b = start_node(args, port, lb, NPROC_PER_NODE="2")
        wait_for_port(port)
        node_a = start_node(args, port, la)
        codes = wait_all([node_a, node_b], 120)
    logs = {node: (tmp_path / f"{node}.log").read_text() for node in "ab"}
    assert codes == [2, 2], logs
    host = socket.gethostname()
    assert_last_words(logs["a"], f"error: this node ({host}) runs 1 of the 3 processes on 2 nodes, so the other "
                                 f"node runs 2, not 1: every node must run as many processes as the others")
    assert_last_words(logs["b"], f"error: this node ({host}) runs 2 of the 3 processes on 2 nodes, so the other "
                                 f"node runs 1, not 2")


def worker_pids(launch_pid):
    torchrun = subprocess.run(["pgrep", "-P", str(launch_pid), "-f", "torch.distributed.run"],
                              capture_output=True, text=True).stdout.split()
    assert len(torchrun) == 1, torchrun
    workers = subprocess.run(["pgrep", "-P", torchrun[0]], capture_output=True, text=True).stdout.split()
    return [int(torchrun[0])], [int(w) for w in workers]


@pytest.mark.parametrize("sig,to", [(signal.SIGTERM, "group"), (signal.SIGUSR1, "group"),
                                    (signal.SIGUSR1, "every process"), (signal.SIGTERM, "every process")],
                         ids=["TERM-group", "USR1-group", "USR1-every-process", "TERM-every-process"])
def test_preemption_saves_and_exits_zero(files, reference, tmp_path, sig, to):
    """A scheduler's stop request while the workers are mid-step, each step longer than torchrun's grace
    period (TORCH_ELASTIC_SHUTDOWN_TIMEOUT=1 here: a 70B step plus a 53 GB save are longer than its 30 s
    default, which torch before 2026 does not let one change). 'group': kill -SIG -PGID of launch.sh, as a
    terminal or `kill -- -PID` does; 'every process': launch.sh, torchrun and each worker, as SLURM does
    with --signal (USR1) and at preemption or a time limit (TERM). Each must save and exit 0 (afterok
    depends on it). The resume after the stop is checked once, for SLURM's --signal: it does not depend on
    which signal stopped the run."""
    out = tmp_path / "run"
    args = BASE + files + [f"--out_dir={out}", "--ckpt_every=0"]
    with open(tmp_path / "log", "w") as log:
        proc = start_launch(args, log, NPROC_PER_NODE="2", ZERO3_FAULT="slow:1", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="1")
        wait_for_steps(out, 2)
        if to == "group":
            os.killpg(proc.pid, sig)
        else:
            torchrun, workers = worker_pids(proc.pid)
            assert len(workers) == 2
            for pid in [proc.pid] + torchrun + workers:
                os.kill(pid, sig)
        codes = wait_all([proc], 120)
    text = (tmp_path / "log").read_text()
    assert codes == [0], text[-3000:]
    assert "SignalException" not in text, text[-3000:]  # torchrun never acted on the signal
    stopped = int(text.split("stopping at step ")[1].split()[0])
    assert 2 <= stopped < 6, text[-3000:]
    assert (out / "checkpoints" / f"step_{stopped:08d}" / "manifest.json").exists()
    if (sig, to) == (signal.SIGUSR1, "every process"):
        with open(tmp_path / "rerun.log", "w") as log:
            assert wait_all([start_launch(args, log, NPROC_PER_NODE="2")], 180) == [0]
        assert [m["loss"] for m in read_metrics(out)] == reference


def sbatch_train_args() -> list[str]:
    with open(os.path.join(ROOT, "launch.sbatch")) as f:
        text = f.read()
    return shlex.split(text.split("TRAIN_ARGS=(")[1].split(")")[0], comments=True)


def sbatch_setting(name: str) -> str:
    with open(os.path.join(ROOT, "launch.sbatch")) as f:
        return next(line.split("=", 1)[1].strip() for line in f if line.startswith(f"#SBATCH --{name}="))


def sbatch_config():
    """The planner's flags for exactly launch.sbatch's TRAIN_ARGS, at the job's size;
    Meta-Llama-3-70B-Instruct is the llama3-70b preset."""
    args = sbatch_train_args()
    i = args.index("--init_from")
    flags = args[:i] + ["--model", "llama3-70b"] + args[i + 2:]
    flags += ["--nnodes", sbatch_setting("nodes"), "--nproc_per_node", sbatch_setting("gpus-per-node"),
              "--gpu", "h100", "--plan"]
    return T.parse_args(flags)


def sbatch_plan() -> dict:
    cfg = sbatch_config()
    return P.plan(hf.model_config(cfg), cfg)


def test_sbatch_runs_the_readme_recipe_and_it_fits():
    args = sbatch_train_args()
    with open(os.path.join(ROOT, "docs", "operations.md")) as f:
        readme = f.read()
    command = readme.split("NNODES=2 MASTER_ADDR=node0 ./launch.sh --init_from")[1].split("\n\n")[0]
    assert ["--init_from"] + shlex.split(command.replace("\\\n", " ")) == args
    prediction = sbatch_plan()
    assert prediction["fits"] and prediction["host_fits"], prediction


def test_sbatch_stop_signal_comes_early_enough_to_save():
    """SLURM's --signal=USR1@N must leave time for what the planner says a stop takes for TRAIN_ARGS: the
    longer of a periodic save in progress and a late restart's set-up + load, the step, its evaluation and
    the stop's own save (53 GB per rank); the final export is not part of it."""
    signal_name, lead_s = sbatch_setting("signal").split("@")
    assert signal_name == "USR1"
    assert int(lead_s) >= sbatch_plan()["stop_lead_s"]


def test_sbatch_plan_prints_the_save_stall_and_a_suggested_interval():
    """--plan on TRAIN_ARGS says what its --ckpt_every 200 costs, synchronous and asynchronous (--async_save
    auto: on, the node's host memory fits the staging buffer), and which interval Young/Daly suggests."""
    cfg = sbatch_config()
    p = P.plan(hf.model_config(cfg), cfg)
    text = P.table(p, cfg)
    assert p["async_save"] and p["save_copy_s"] < 2 < p["async_save_stall_s"] < 10 < 100 < p["sync_save_stall_s"]
    assert (f"save stall per save (predicted): synchronous {p['sync_save_stall_s']:.0f} s (every GPU waiting for the "
            f"write), asynchronous {p['async_save_stall_s']:.1f} s (the copy of 52.9 GB to host memory, "
            f"{p['async_slower_s']:.1f} s of steps slower beside the write (x 1.05, async_write_slowdown); the write "
            f"goes on in the background); this run's saves are asynchronous (--async_save auto) | --ckpt_every 200: "
            f"{p['saves']} saves in 28,600 steps = {100 * p['save_fraction']:.2f}% of the run spent saving at 0.45 GB/s "
            f"per rank (synchronous {100 * p['sync_save_fraction']:.2f}%") in text
    assert (f"suggested --ckpt_every {p['suggested_ckpt_every']} (Young/Daly: sqrt(2 x "
            f"{p['async_save_stall_s']:.1f} s asynchronous stall x 3167 h MTBF)") in text
    assert (f"work lost per failure (predicted): {p['lost_per_failure_s'] / 3600:.2f} h at --ckpt_every 200, "
            f"{p['suggested_lost_per_failure_s'] / 3600:.2f} h at --ckpt_every {p['suggested_ckpt_every']}") in text
    assert "expected overhead, saves + lost work: " in text


def run_sbatch(tmp_path, saved_before: int, saved_after: int, exit_code: int, check_fails: bool = False,
               without_progress: str | None = None, exports: bool = True, fatal_line: str = ""):
    """launch.sbatch with stand-ins for srun and scontrol that record their arguments. The srun stand-in
    fails the network check if asked, and 'trains' by pointing OUT_DIR/checkpoints/latest at step
    saved_after and exiting with exit_code, and at the last step writes the --export_hf folder when
    `exports`. --out_dir is moved into tmp_path; `without_progress`, when given, is what earlier allocations
    left in OUT_DIR/allocations_without_progress; `fatal_line`, what a node's launch.sh wrote to OUT_DIR/fatal_errors.
    Returns (exit code, stdout + stderr, srun's calls, scontrol's calls)."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    if without_progress is not None:
        (out / "allocations_without_progress").write_text(without_progress)
    if saved_before:
        (out / "checkpoints" / "latest").write_text(f"step_{saved_before:08d}\n")
    (tmp_path / "srun").write_text(f"""#!/bin/bash
echo "$@" >> {tmp_path}/srun.calls
case "$*" in *--check*) exit {int(check_fails)} ;; esac
echo step_{saved_after:08d} > {out}/checkpoints/latest
{f"mkdir -p {out}/hf && touch {out}/hf/config.json" if exports and saved_after >= 28600 else ""}
{f"echo '{fatal_line}' >> {out}/fatal_errors" if fatal_line else ""}
exit {exit_code}
""")
    (tmp_path / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/scontrol.calls\n')
    for stand_in in ("srun", "scontrol"):
        (tmp_path / stand_in).chmod(0o755)
    with open(os.path.join(ROOT, "launch.sbatch")) as f:
        script = f.read().replace("/shared/runs/llama70b-ft", str(out))
    (tmp_path / "job.sbatch").write_text(script)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", SLURM_JOB_ID="777")
    proc = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=30)
    calls = [(tmp_path / f"{name}.calls").read_text().splitlines() if (tmp_path / f"{name}.calls").exists() else []
             for name in ("srun", "scontrol")]
    return proc.returncode, proc.stdout + proc.stderr, *calls


@pytest.mark.parametrize("saved_before,saved_after,exit_code,without_progress,requeued,count_after", [
    (400, 12400, 0, None, True, None),      # stopped before the time limit with steps left: continue
    (28400, 28600, 0, None, False, None),   # --steps reached
    (400, 600, 2, None, False, None),       # an error a restart repeats
    (400, 600, 1, "400 2\n", True, None),   # torchrun's restarts gave up, but the run moved forward: count reset
    (400, 400, 1, None, True, "400 1"),     # nothing saved beyond where it started: a passing fault? once more
    (400, 400, 1, "200 2\n", True, "400 1"),  # the count is of allocations in a row at this step
    (400, 400, 1, "400 1\n", True, "400 2"),
    (400, 400, 1, "400 2\n", False, "400 3"),  # the third allocation in a row without progress: stuck, stop
])
def test_sbatch_requeues_itself_until_the_run_is_done(tmp_path, saved_before, saved_after, exit_code,
                                                      without_progress, requeued, count_after):
    code, log, srun_calls, scontrol_calls = run_sbatch(tmp_path, saved_before, saved_after, exit_code,
                                                       without_progress=without_progress)
    assert code == exit_code, log
    assert scontrol_calls == (["requeue 777"] if requeued else []), log
    count_file = tmp_path / "run" / "allocations_without_progress"
    assert (count_file.read_text().strip() if count_file.exists() else None) == count_after, log
    if not requeued and count_after:
        assert "3 allocations in a row saved no checkpoint beyond step 400" in log, log
    # Both steps end every node's task when one fails (a bad flag on one node must not leave the other
    # waiting in the rendezvous until it times out).
    assert srun_calls == ["--kill-on-bad-exit=1 ./launch.sh --check",
                          "--kill-on-bad-exit=1 ./launch.sh " + " ".join(sbatch_train_args()).replace(
                              "/shared/runs/llama70b-ft", str(tmp_path / "run"))]
    if saved_after >= 28600:
        assert "the run is finished: step 28600 of 28600" in log


@pytest.mark.parametrize("saved_before,exit_code,without_progress,requeued,says", [
    (28400, 0, None, True, "saved step 28600 of 28600 (exit code 0; allocations in a row without progress: 0); "
                           "requeueing job 777 to make its --export_hf"),
    (28600, 1, None, True, "saved step 28600 of 28600 (exit code 1; allocations in a row without progress: 1); "
                           "requeueing job 777 to make its --export_hf"),  # a passing fault in the export: again
    (28600, 1, "28600 2\n", False, "3 allocations in a row saved no checkpoint beyond step 28600 (exit code 1); "
                                   "not requeued"),  # the export failed three times: stuck, stop
    (28600, 2, None, False, "stopped by an error a restart would repeat (above); not requeued"),
], ids=["stopped in the last step", "the export failed once", "the export failed three times", "a full disk"])
def test_sbatch_requeues_a_run_whose_last_step_was_saved_without_its_export(tmp_path, saved_before, exit_code,
                                                                           without_progress, requeued, says):
    """A stop request in the last step saves it and skips the final --export_hf (not part of the stop's lead):
    the run is not finished until the export is there, and the requeued command makes it (train.py). An
    allocation that only had the export to make and did not make it counts as one without progress."""
    code, log, _, scontrol_calls = run_sbatch(tmp_path, saved_before, 28600, exit_code, exports=False,
                                              without_progress=without_progress)
    assert code == exit_code and f"launch.sbatch: {says}" in log, log
    assert scontrol_calls == (["requeue 777"] if requeued else []), log
    assert "the run is finished" not in log


def test_sbatch_does_not_requeue_an_error_a_restart_repeats_on_one_node_whatever_srun_reports(tmp_path):
    """One node's train.py stops with an error a restart repeats (exit 2, its line in OUT_DIR/fatal_errors), and
    srun ends the other node's task (--kill-on-bad-exit), which exits 143: srun reports 143, the largest. The job
    is not requeued (before: requeued, up to three allocations without progress). A fatal line of an earlier
    allocation does not count: launch.sbatch clears the file."""
    code, log, _, scontrol_calls = run_sbatch(tmp_path, 400, 400, 143, fatal_line="error: --data: bad (the line)")
    assert code == 2 and "stopped by an error a restart would repeat (above); not requeued" in log, log
    assert scontrol_calls == [], log
    (tmp_path / "run" / "fatal_errors").write_text("error: an earlier allocation's\n")
    code, log, _, scontrol_calls = run_sbatch(tmp_path / "again", 400, 600, 1)
    assert code == 1 and scontrol_calls == ["requeue 777"], log


def test_sbatch_stops_when_the_check_fails(tmp_path):
    """`set -eu`: a failed `srun ./launch.sh --check` must not go on to train."""
    code, log, srun_calls, scontrol_calls = run_sbatch(tmp_path, 0, 0, 0, check_fails=True)
    assert code != 0 and scontrol_calls == []
    assert srun_calls == ["--kill-on-bad-exit=1 ./launch.sh --check"], log


def fake_python(tmp_path) -> str:
    """A stand-in for $PYTHON: reports $FAKE_GPUS GPUs (none by default) and a torchrun with --numa-binding,
    and writes the arguments it is run with (torchrun's) to $ARGS_FILE, one per line, and its environment
    to $ARGS_FILE.env."""
    path = tmp_path / "python"
    path.write_text('#!/bin/bash\ncase "$*" in *device_count*) echo "${FAKE_GPUS:-0} 1"; exit 0 ;; esac\n'
                    'printf "%s\\n" "$@" > "$ARGS_FILE"\nenv > "$ARGS_FILE.env"\n')
    path.chmod(0o755)
    return str(path)


def launch_dry(tmp_path, args, **env):
    """./launch.sh with the stand-in python, from tmp_path: (exit code, stderr, the arguments torchrun got)."""
    args_file = tmp_path / "torchrun.args"
    args_file.unlink(missing_ok=True)
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("SLURM_") and k not in ("NNODES", "MASTER_ADDR", "RDZV_ID", "NPROC_PER_NODE")}
    proc = subprocess.run([LAUNCH, *args], env=dict(clean, PYTHON=fake_python(tmp_path), ARGS_FILE=str(args_file), **env),
                          cwd=tmp_path, capture_output=True, text=True, timeout=30)
    return proc.returncode, proc.stderr, args_file.read_text().splitlines() if args_file.exists() else []


def flag_value(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_rendezvous_is_one_per_run_and_nodes_are_the_jobs(tmp_path):
    """Without SLURM the rendezvous id comes from --out_dir, so two runs on one MASTER_ADDR stay apart while
    every node of one run (same --out_dir, however it is spelt) meets the others; under SLURM it is the job
    id, and an exported NNODES other than the job's is refused before anything starts."""
    two_nodes = dict(NNODES="2", MASTER_ADDR="127.0.0.1")
    ids = {}
    for name, args in (("run_a", ["--out_dir", "run_a"]), ("run_a=", ["--out_dir=run_a"]),
                       ("run_a absolute", ["--lr", "1e-4", "--out_dir", str(tmp_path / "run_a")]),
                       ("run_b", ["--out_dir", "run_b"]), ("default", []), ("check", ["--check"])):
        code, err, torchrun = launch_dry(tmp_path, args, **two_nodes)
        assert code == 0, err
        ids[name] = flag_value(torchrun, "--rdzv_id")
    assert ids["run_a"] == ids["run_a="] == ids["run_a absolute"]
    assert len({ids["run_a"], ids["run_b"], ids["default"]}) == 3
    assert ids["check"] == ids["default"]  # --check has no --out_dir: train.py's default, out
    slurm = dict(SLURM_JOB_ID="4242", SLURM_NNODES="2", MASTER_ADDR="127.0.0.1")
    code, err, torchrun = launch_dry(tmp_path, ["--out_dir", "run_a"], **slurm)
    assert code == 0 and flag_value(torchrun, "--rdzv_id") == "4242" and flag_value(torchrun, "--nnodes") == "2", err
    code, err, torchrun = launch_dry(tmp_path, ["--out_dir", "run_a"], NNODES="1", **slurm)
    assert code == 2 and torchrun == [], err
    assert err.strip().splitlines() == ["launch.sh: NNODES=1, but this SLURM job has SLURM_NNODES=2 nodes; unset "
                                        "NNODES (under SLURM it comes from the job) or submit the job with --nodes 1"]


def test_the_rendezvous_waits_for_a_node_that_starts_late(tmp_path):
    """torchrun's defaults (a 60 s store read, 600 s to join) fail every node when one starts late (an image
    pulled, a virtualenv read from a busy filesystem), at every restart: launch.sh passes longer ones, by hand and
    under SLURM (launch.sbatch runs launch.sh), and a malformed override is refused before torchrun starts."""
    for env in (dict(NNODES="2", MASTER_ADDR="127.0.0.1"), slurm_job(tmp_path, "n1 n2")):
        code, err, torchrun = launch_dry(tmp_path, [], **env)
        assert code == 0, err
        assert flag_value(torchrun, "--rdzv_conf") == "join_timeout=1800,read_timeout=300"
    code, err, torchrun = launch_dry(tmp_path, [], NNODES="2", MASTER_ADDR="127.0.0.1", RDZV_JOIN_TIMEOUT_S="3600")
    assert code == 0 and flag_value(torchrun, "--rdzv_conf") == "join_timeout=3600,read_timeout=300", err
    code, err, torchrun = launch_dry(tmp_path, [], NNODES="2", MASTER_ADDR="127.0.0.1", RDZV_READ_TIMEOUT_S="5m")
    assert code == 2 and torchrun == [] and "RDZV_READ_TIMEOUT_S must be a whole number, got '5m'" in err, err

def slurm_job(tmp_path, nodes: str, **env) -> dict:
    """The environment of one task of SLURM job 4242 on `nodes` (a stand-in scontrol lists them), one task
    per node, and `env` (what the submitting shell exported)."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\n[ "$1 $2 $3" = "show hostnames n[1-2]" ] && printf "%s\\n" {nodes}\n')
    (bin_dir / "scontrol").chmod(0o755)
    count = str(len(nodes.split()))
    return dict(dict(SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="n[1-2]", SLURM_NNODES=count, SLURM_NTASKS=count,
                     PATH=f"{bin_dir}:{os.environ['PATH']}"), **env)


def test_under_slurm_the_rendezvous_is_the_jobs_whatever_the_shell_exported(tmp_path):
    """sbatch copies the submitting shell's environment: a MASTER_ADDR that is not a node of the job (an old
    node) and an RDZV_ID left from a run by hand are ignored with a warning each; the job's first node and
    its id are used. A MASTER_ADDR that is a node of the job (by name, short name, or address) is kept. Two
    tasks on a node (two torchruns with all its GPUs each) are refused with the fix."""
    launched = "launch.sh: torchrun is pid"
    code, err, torchrun = launch_dry(tmp_path, [], **slurm_job(tmp_path, "n1 n2"))
    assert code == 0 and [line for line in err.splitlines() if not line.startswith(launched)] == [], err
    assert flag_value(torchrun, "--rdzv_endpoint") == "n1:29500" and flag_value(torchrun, "--rdzv_id") == "4242"
    code, err, torchrun = launch_dry(tmp_path, [], **slurm_job(tmp_path, "n1 n2", MASTER_ADDR="old-node", RDZV_ID="manual"))
    assert code == 0, err
    assert flag_value(torchrun, "--rdzv_endpoint") == "n1:29500" and flag_value(torchrun, "--rdzv_id") == "4242"
    assert [line for line in err.splitlines() if not line.startswith(launched)] == [
        "launch.sh: ignoring MASTER_ADDR=old-node from the environment: it is not a node of SLURM job 4242 (n[1-2]); "
        "the rendezvous is on its first node, n1",
        "launch.sh: ignoring RDZV_ID=manual from the environment (left from a run by hand?): under SLURM the "
        "rendezvous is the job's, 4242"]
    for kept, nodes in (("n2", "n1 n2"), ("n2.cluster.example", "n1 n2"), ("127.0.0.1", "n1 localhost")):
        code, err, torchrun = launch_dry(tmp_path, [], **slurm_job(tmp_path, nodes, MASTER_ADDR=kept))
        assert code == 0 and "ignoring" not in err and flag_value(torchrun, "--rdzv_endpoint") == f"{kept}:29500", err
    code, err, torchrun = launch_dry(tmp_path, [], **slurm_job(tmp_path, "n1 n2", SLURM_NTASKS="16"))
    assert code == 2 and torchrun == [], err
    assert err.strip().splitlines() == [
        "launch.sh: this SLURM step runs 16 tasks on 2 node(s); launch.sh must run once per node (its torchrun starts "
        "one process per GPU): srun --ntasks-per-node=1 ./launch.sh, or #SBATCH --ntasks-per-node=1"]


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_the_host_memory_check_reads_the_jobs_cgroup_limit(tmp_path, monkeypatch, version):
    """A SLURM job granted less memory than the node has (--exclusive without --mem=0) is held to its cgroup's
    limit, set on the job's cgroup above the step's own: the check compares with the smaller of that limit and
    the machine's available memory, and names the one it used. Paths as on SLURM's cgroup v2 and v1 plugins."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       2147483648 kB\nMemAvailable:   2000000000 kB\n")  # ~1.9 TiB available
    job = "system.slice/slurmstepd.scope/job_7" if version == "v2" else "slurm/uid_0/job_7"
    folder, name = (tmp_path, "memory.max") if version == "v2" else (tmp_path / "memory", "memory.limit_in_bytes")
    (folder / job / "step_0").mkdir(parents=True)
    (tmp_path / "cgroup").write_text(f"0::/{job}/step_0\n" if version == "v2" else f"4:memory:/{job}/step_0\n1:cpu:/\n")
    (folder / job / "step_0" / name).write_text("max\n" if version == "v2" else "9223372036854771712\n")
    limit = functools.partial(checks.host_memory_limit, meminfo=str(meminfo), proc_cgroup=str(tmp_path / "cgroup"),
                              cgroup_root=str(tmp_path))
    monkeypatch.setattr(checks, "host_memory_limit", limit)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = T.parse_args(["--model=llama3-8b", "--offload_optimizer=true", f"--out_dir={tmp_path / 'out'}"])
    host_bytes = P.run_host_bytes(hf.model_config(cfg), cfg, 16)  # the planner's, as agree.planner_figures brings them
    assert checks.check_host_memory(cfg, host_bytes, 16) == []  # no limit on the job: 8 ranks' ~8 GiB each fit
    (folder / job / name).write_text(f"{64 * 2**30}\n")
    [line] = checks.check_host_memory(cfg, host_bytes, 16)
    assert line.startswith("--offload_optimizer: the 8 rank(s) on this node need "), line
    assert line.endswith(f"and this job's cgroup allows 64.0 GiB ({folder / job / name}); ask SLURM for all of the "
                         f"node's memory (sbatch --mem=0), use more nodes, or train without --offload_optimizer"), line


def launch_env(tmp_path) -> dict:
    """The environment the last launch_dry's torchrun got."""
    return dict(line.split("=", 1) for line in (tmp_path / "torchrun.args.env").read_text().splitlines() if "=" in line)


def test_launch_leaves_the_gpu_settings_to_train_py(tmp_path, monkeypatch):
    """NVLS, the allocator and NCCL's flight recorder are train.py's to set (agree.launch_settings, tests/test_agree.py),
    so that a plain torchrun gets them too: launch.sh passes through only what the user exported."""
    settings = ("NCCL_NVLS_ENABLE", "PYTORCH_ALLOC_CONF", "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE")
    for name in settings:
        monkeypatch.delenv(name, raising=False)
    code, err, torchrun = launch_dry(tmp_path, [], FAKE_GPUS="8")
    env = launch_env(tmp_path)
    assert code == 0, err
    for name in settings:
        assert name not in env, name


def test_launch_binds_each_rank_to_its_gpus_cores(tmp_path):
    """On GPUs, with a torchrun that has --numa-binding and numactl present, each rank gets its own share of its
    GPU's NUMA node ("exclusive"), and offload.optimizer_threads is told so; NUMA_BINDING=none, no numactl, or no
    GPU: no binding."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "numactl").write_text("#!/bin/sh\n")
    (bin_dir / "numactl").chmod(0o755)
    with_numactl = f"{bin_dir}:{os.environ['PATH']}"
    code, err, torchrun = launch_dry(tmp_path, [], FAKE_GPUS="8", PATH=with_numactl)
    env = launch_env(tmp_path)
    assert code == 0, err
    assert flag_value(torchrun, "--numa-binding") == "exclusive" and env["ZERO3_NUMA_BINDING"] == "exclusive"
    assert torchrun.index("--numa-binding") < torchrun.index(os.path.join(ROOT, "train.py"))
    for unbound in (dict(FAKE_GPUS="8", PATH=with_numactl, NUMA_BINDING="none"), dict(FAKE_GPUS="0", PATH=with_numactl),
                    dict(FAKE_GPUS="8", PATH="/usr/bin:/bin")):
        code, err, torchrun = launch_dry(tmp_path, [], **unbound)
        assert code == 0 and "--numa-binding" not in torchrun and "ZERO3_NUMA_BINDING" not in launch_env(tmp_path), unbound


def test_sbatch_cpus_are_the_planners_cores_and_each_rank_uses_its_share():
    """launch.sbatch asks for the cores the planner's CPU update assumes (plan.GPUS host_cores_per_node); a rank
    bound to its own cores (launch.sh, NUMA "exclusive") uses them all, an unbound one its share of the node's."""
    import torch
    assert int(sbatch_setting("cpus-per-task")) == P.GPUS["h100"]["host_cores_per_node"]
    offload = T.TrainConfig(offload_optimizer=True)
    per_gpu = P.GPUS["h100"]["host_cores_per_node"] // int(sbatch_setting("gpus-per-node"))
    assert O.optimizer_threads(offload, torch.device("cuda", 0), 8, 112) == per_gpu
    os.environ["ZERO3_NUMA_BINDING"] = "exclusive"
    try:
        assert O.optimizer_threads(offload, torch.device("cuda", 0), 8, per_gpu) == per_gpu
    finally:
        del os.environ["ZERO3_NUMA_BINDING"]


def test_exit_code_2_survives_the_job_steps_sigterm_while_launch_exits(tmp_path):
    """Under SLURM, when one node's launch.sh exits 2, srun --kill-on-bad-exit sends SIGTERM to every process
    of the step, and it can land on another node's launch.sh while that one is exiting 2 too, in its EXIT
    trap's rm. Under set -e the killed rm made the exit code 143, srun reported 143, and launch.sbatch
    retried an error a restart repeats (seen in tests/test_slurm.py). Here torchrun's stand-in writes the
    fatal file, and an rm that waits lets SIGTERM reach the group at that moment: the exit code stays 2."""
    python = tmp_path / "python"  # torchrun's stand-in; like torchrun it stops on SIGHUP, even if the suite was
    # started with SIGHUP ignored (nohup, some CI runners): a bash stand-in cannot undo that, and launch.sh then
    # waited out its sleep, past this test's deadline on a loaded machine
    python.write_text(f'#!{sys.executable}\nimport os, signal, sys, time\n'
                      'if "device_count" in " ".join(sys.argv):\n    print("0 1")\n    sys.exit(0)\n'
                      'signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))\n'
                      'open(os.environ["ZERO3_FATAL_FILE"], "w").write("error: a fatal error\\n")\ntime.sleep(30)\n')
    (tmp_path / "rm").write_text(f'#!/bin/bash\ntouch {tmp_path}/in_rm\nsleep 3\nexec /bin/rm "$@"\n')
    for stand_in in (python, tmp_path / "rm"):
        stand_in.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in ("NNODES", "MASTER_ADDR", "RDZV_ID", "NPROC_PER_NODE")}
    env.update(PYTHON=str(python), PATH=f"{tmp_path}:{os.environ['PATH']}")
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen([LAUNCH, "--steps=5"], env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.time() + 30
        while not (tmp_path / "in_rm").exists() and time.time() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "in_rm").exists(), (tmp_path / "log").read_text()
        os.killpg(proc.pid, signal.SIGTERM)
        codes = wait_all([proc], 30)
    assert codes == [2], (tmp_path / "log").read_text()


def test_a_node_an_exit_2_line_says_to_leave_out_is_kept_for_launch_sbatch(tmp_path):
    """An error line that says `sbatch --exclude=HOST` (a GPU broken or held by another job, agree.py) leaves HOST in
    OUT_DIR/exclude_hosts, which launch.sbatch names instead of requeueing onto the same node; launch.sh exits 2."""
    python = tmp_path / "python"  # torchrun's stand-in: train.py's fatal line, then a wait that SIGHUP ends
    python.write_text(f'#!{sys.executable}\nimport os, signal, sys, time\n'
                      'if "device_count" in " ".join(sys.argv):\n    print("0 1")\n    sys.exit(0)\n'
                      'signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))\n'
                      'open(os.environ["ZERO3_FATAL_FILE"], "w").write("error: rank 3 (node7): GPU 3 cannot say its '
                      'free memory (CUDA error); leave the node out (sbatch --exclude=node7)\\n")\ntime.sleep(30)\n')
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in ("NNODES", "MASTER_ADDR", "RDZV_ID", "NPROC_PER_NODE")}
    out = tmp_path / "out"
    proc = subprocess.run([LAUNCH, "--steps=5", f"--out_dir={out}"], env=dict(env, PYTHON=str(python)), cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert (out / "exclude_hosts").read_text().split() == ["node7"]
    script = open(os.path.join(ROOT, "launch.sbatch")).read()  # and launch.sbatch reads that file, by that name
    assert 'exclude_file="$(train_flag out_dir out)/exclude_hosts"' in script and "sbatch --exclude=$excluded" in script
