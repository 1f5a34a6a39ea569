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
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest
from common import ROOT, model_and_tokens, read_metrics, run_train

import checks  # noqa: E402
import plan as P  # noqa: E402
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_launch(args, log, **env) -> subprocess.Popen:
    """./launch.sh in a session of its own (so its process group can be signalled as a scheduler does)."""
    full_env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", **env)
    return subprocess.Popen([LAUNCH, *args], stdout=log, stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=True)


def start_node(args, port, log, **env) -> subprocess.Popen:
    return start_launch(args, log, NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NPROC_PER_NODE="1",
                        RDZV_ID="test", **env)


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


def test_restart_across_nodes(files, reference, tmp_path):
    """A rank on node A is killed mid-step while node B, which hosts the rendezvous store, is busy for 20 s
    (as an NCCL rank is until its collective times out). Both nodes must come back and finish, bit-exact."""
    port, out = free_port(), tmp_path / "run"
    args = BASE + files + [f"--out_dir={out}"]
    with open(tmp_path / "a.log", "w") as la, open(tmp_path / "b.log", "w") as lb:
        node_b = start_node(args, port, lb, ZERO3_FAULT="hang:3::20",
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
    assert "not restarting" in text


def worker_pids(launch_pid):
    torchrun = subprocess.run(["pgrep", "-P", str(launch_pid), "-f", "torch.distributed.run"],
                              capture_output=True, text=True).stdout.split()
    assert len(torchrun) == 1, torchrun
    workers = subprocess.run(["pgrep", "-P", torchrun[0]], capture_output=True, text=True).stdout.split()
    return [int(torchrun[0])], [int(w) for w in workers]


@pytest.mark.parametrize("sig,to", [(signal.SIGTERM, "group"), (signal.SIGUSR1, "group"),
                                    (signal.SIGUSR1, "every process")])
def test_preemption_saves_and_exits_zero(files, reference, tmp_path, sig, to):
    """A scheduler's stop request while the workers are mid-step, each step longer than torchrun's grace
    period (TORCH_ELASTIC_SHUTDOWN_TIMEOUT=1 here: a 70B step plus a 53 GB save are longer than its 30 s
    default). 'group': kill -SIG -PGID of launch.sh, as a terminal or `kill -- -PID` does; 'every
    process': launch.sh, torchrun and each worker, as SLURM's --signal does."""
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
    stopped = int(text.split("stopping at step ")[1].split()[0])
    assert 2 <= stopped < 6, text[-3000:]
    assert (out / "checkpoints" / f"step_{stopped:08d}" / "manifest.json").exists()
    with open(tmp_path / "rerun.log", "w") as log:
        assert wait_all([start_launch(args, log, NPROC_PER_NODE="2")], 180) == [0]
    assert [m["loss"] for m in read_metrics(out)] == reference


def sbatch_train_args() -> list[str]:
    with open(os.path.join(ROOT, "launch.sbatch")) as f:
        text = f.read()
    return shlex.split(text.split("TRAIN_ARGS=(")[1].split(")")[0], comments=True)


def sbatch_setting(name: str) -> int:
    with open(os.path.join(ROOT, "launch.sbatch")) as f:
        return int(next(line.split("=")[1] for line in f if line.startswith(f"#SBATCH --{name}=")))


def test_sbatch_runs_the_readme_recipe_and_it_fits():
    args = sbatch_train_args()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    command = readme.split("NNODES=2 MASTER_ADDR=node0 ./launch.sh --init_from")[1].split("\n\n")[0]
    assert ["--init_from"] + shlex.split(command.replace("\\\n", " ")) == args
    # The planner on exactly these flags, at the job's size; Meta-Llama-3-70B-Instruct is the llama3-70b preset.
    i = args.index("--init_from")
    flags = args[:i] + ["--model", "llama3-70b"] + args[i + 2:]
    flags += ["--nnodes", str(sbatch_setting("nodes")), "--nproc_per_node", str(sbatch_setting("gpus-per-node")),
              "--gpu", "h100", "--plan"]
    cfg = T.parse_args(flags)
    prediction = P.plan(checks.model_config(cfg), cfg)
    assert prediction["fits"], prediction


def test_sbatch_stops_when_the_check_fails(tmp_path):
    """`set -eu`: a failed `srun ./launch.sh --check` must not go on to train. srun is a stand-in here
    that fails the check and records what it was asked to run."""
    (tmp_path / "srun").write_text('#!/bin/bash\necho "$@" >> "$SRUN_LOG"\n[ "$2" != --check ]\n')
    (tmp_path / "srun").chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", SRUN_LOG=str(tmp_path / "calls"))
    proc = subprocess.run(["bash", os.path.join(ROOT, "launch.sbatch")], env=env, cwd=ROOT, capture_output=True)
    assert proc.returncode != 0
    assert (tmp_path / "calls").read_text().splitlines() == ["./launch.sh --check"]
