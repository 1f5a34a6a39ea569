"""A warm start for the tests' runs of train.py and tests/dist_worker.py (common.run_script, run_train): one python
process per test session imports what train.py imports, then forks each run's processes from itself instead of
starting python for each.

Why: a `python train.py` spends ~3 s of CPU before its first line of work (torch ~1.3 s, torch._dynamo ~1.5 s,
which torch.utils.checkpoint and the planner's meta tensors import on first use), and torchrun's agent ~1.6 s
more; the suite runs a few hundred of them on two cores. A fork of this process starts in milliseconds.

A run here is what it is under `python script` or `torchrun --standalone --nproc_per_node=N script`: the script
runs as __main__ (runpy) in its own process, with its own environment, cwd and output files. At N >= 2 each rank
gets the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...) and meets the others through
rank 0's TCPStore; when a rank fails, the others get SIGTERM, then SIGKILL, and the run exits 1, as under
torchrun's agent. What is not here is torchrun itself (restarts, its store, its summary) and python's start-up:
the tests of those (test_launch, test_faults, test_errors' unknown flag, the SLURM tier) start real processes.

Protocol, one JSON line each way on stdin/stdout: {"script", "args", "nproc", "env", "cwd", "stdout", "stderr",
"report", "timeout"} in; {"returncode": the code, or null when the run passed its timeout and was killed} out.
One run at a time.
"""
import json
import os
import runpy
import signal
import socket
import sys
import time

import faults  # tests/faults.py: installed at a python's start by tests/fault_site/sitecustomize.py; here, per fork

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGENT_MONITOR_INTERVAL_S = 0.1  # torchrun's agent looks at its workers this often (--monitor-interval)
AGENT_STOP_GRACE_S = 30  # then SIGTERM to every worker left, SIGKILL after this


def warm_up():
    """What train.py and its components import, and torch._dynamo, imported once here; no tensor op runs, so no
    thread pool exists to break in a fork."""
    sys.path[0] = ROOT  # as `python train.py` sets it
    import torch._dynamo  # noqa: F401
    import transformers  # noqa: F401  (the export check and tokenizers)
    import components.checkpoints, components.hf, components.sample, data, model  # noqa: F401,E401


def run_script(script: str, args: list[str], env: dict):
    """This process becomes `python script *args` with `env`: never returns."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(script)
        faults.install(env)  # what tests/fault_site/sitecustomize.py does when python starts
        runpy.run_path(script, run_name="__main__")  # train.py's __main__ ends in os._exit
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(script: str, args: list[str], nproc: int, env: dict, report: str) -> int:
    """torchrun --standalone --nproc_per_node=nproc: one forked process per rank; the first rank that fails stops
    the others (SIGTERM, SIGKILL after the grace) and the run exits 1. Its rank and exit code (torchrun's "root
    cause") go to the file `report`."""
    port, run_id = free_port(), f"warm{os.getpid()}"
    rank_of = {}  # pid: rank
    for rank in range(nproc):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                        GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc),
                        ROLE_NAME="default", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                        TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID=run_id)
        rank_env.setdefault("OMP_NUM_THREADS", "1")
        pid = os.fork()
        if pid == 0:
            run_script(script, args, rank_env)
        rank_of[pid] = rank
    running = list(rank_of)
    while running:
        time.sleep(AGENT_MONITOR_INTERVAL_S)
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
            running.remove(pid)
            if os.waitstatus_to_exitcode(status) != 0:
                with open(report, "w") as f:
                    json.dump(dict(rank=rank_of[pid], exit_code=os.waitstatus_to_exitcode(status)), f)
                stop(running)
                return 1
    return 0


def stop(pids: list[int]):
    """SIGTERM to each rank left, SIGKILL to those alive after the grace; all reaped."""
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + AGENT_STOP_GRACE_S
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if os.waitpid(pid, os.WNOHANG) == (0, 0)]
        time.sleep(0.02)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def launch(request: dict, channels) -> int:
    """Forks the run (its own process group, so a timeout kills all of it); returns its pid."""
    pid = os.fork()
    if pid:
        return pid
    os.setpgid(0, 0)
    for channel in channels:  # the test's pipes are not the run's
        os.close(channel.fileno())
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(request["cwd"])
    if request["nproc"] == 1:
        run_script(request["script"], request["args"], request["env"])
    code = 1
    try:
        code = agent(request["script"], request["args"], request["nproc"], request["env"], request["report"])
    finally:
        os._exit(code)


def serve():
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)  # a run's stdin; its stdout and stderr are its own files (launch)
    os.dup2(2, 1)
    warm_up()
    for line in requests:
        request = json.loads(line)
        pid = launch(request, (requests, replies))
        replies.write(json.dumps({"returncode": wait(pid, request["timeout"])}) + "\n")


def wait(pid: int, timeout_s: float) -> int | None:
    """The run's exit code, or None after killing its process group at `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.02)


if __name__ == "__main__":
    serve()
