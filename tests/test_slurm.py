"""launch.sbatch under a real SLURM: munge, slurmctld and two slurmd (nodes n1 and n2) on this machine, and
a copy of launch.sbatch whose training is a small CPU run (one process per node, as tests/test_launch.py runs
launch.sh). The tier is a pytest run of its own: `python -m pytest -q -m slurm tests` (as root, with slurm-wlm
and munge installed; `bash .ci/run` installs them and runs it beside the main suite). Without them it is skipped.

The jobs are submitted together at the start and run side by side (each node has 4 CPUs to SLURM, each job
asks 1 per node), so the tier takes about as long as its longest job: a 2-minute allocation that ends at its
time limit, then one that finishes (3m22s and 3m31s in two runs on this 2-core machine). The cluster's
AuthInfo=cred_expire=5 (the smallest Slurm 22.05 accepts: 4 falls back to the default, 120) makes a
requeued job eligible 6 s after its requeue instead of 121 s (measured here): the job credential's lifetime
plus one second. Slurm checks time limits and --signal every 30 s, so a 2-minute job ends 120 to 150 s after
it starts, and its --signal comes up to 30 s earlier than asked.
"""
import os
import pwd
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from common import ROOT, free_port, model_and_tokens, read_metrics, run_train

pytestmark = pytest.mark.slurm

FLAGS = ["--seq_len=16", "--batch_size=8", "--micro_batch_size=2", "--dtype=float32", "--steps=16", "--lr=3e-3",
         "--warmup_steps=2", "--seed=4", "--timeout_min=5", "--ckpt_every=2"]
HOSTS_LINE = "127.0.0.1 n1 n2  # tests/test_slurm.py"
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}


def free_port_pair() -> int:
    """A port P with P + 1 free too (slurmd's Port=P-P+1 for n1 and n2)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port + 1)) != 0 and port + 1 < 65536:
                return port


def slurm_conf(folder: str, munge_socket: str) -> str:
    host = socket.gethostname().split(".")[0]
    slurmd_port = free_port_pair()
    return f"""ClusterName=zero3test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=5
StateSaveLocation={folder}/state
SlurmctldPidFile={folder}/slurmctld.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdSpoolDir={folder}/spool-%n
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmdLogFile={folder}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
KillWait=10
MinJobAge=3600
NodeName=n[1-2] NodeHostname={host} NodeAddr=127.0.0.1 Port={slurmd_port}-{slurmd_port + 1} CPUs=4 State=UNKNOWN
PartitionName=test Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
"""


def start_munged(folder: str) -> tuple[subprocess.Popen, str]:
    """munged as the munge user, with a fresh key and its socket in folder/munge (which munged wants owned
    by it and open to everyone for execute)."""
    munge = pwd.getpwnam("munge")
    home = os.path.join(folder, "munge")
    os.mkdir(home)
    os.chmod(home, 0o711)
    os.chown(home, munge.pw_uid, munge.pw_gid)
    key = os.path.join(home, "munge.key")
    subprocess.run(["dd", "if=/dev/urandom", f"of={key}", "bs=1024", "count=1"], check=True, capture_output=True)
    os.chown(key, munge.pw_uid, munge.pw_gid)
    os.chmod(key, 0o400)
    sock = os.path.join(home, "munge.socket")
    with open(os.path.join(folder, "munged.out"), "w") as log:
        proc = subprocess.Popen(["munged", "--foreground", f"--socket={sock}", f"--key-file={key}",
                                 f"--pid-file={home}/munged.pid", f"--log-file={home}/munged.log",
                                 f"--seed-file={home}/munged.seed"], user="munge", group="munge",
                                stdout=log, stderr=subprocess.STDOUT)
    wait_for(lambda: os.path.exists(sock) or proc.poll() is not None, 20, "munged's socket")
    assert proc.poll() is None, open(os.path.join(folder, "munged.out")).read()
    return proc, sock


def wait_for(ready, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if ready():
            return
        time.sleep(0.5)
    raise AssertionError(f"no {what} after {timeout} s")


def add_hosts_line() -> str:
    """n1 and n2 resolve to this machine (launch.sh's MASTER_ADDR is the job's first node name). Returns
    what it appended to /etc/hosts ("" when they already resolve there), for remove_hosts_line."""
    with open("/etc/hosts") as f:
        text = f.read()
    if any(line.split()[1:3] == ["n1", "n2"] for line in text.splitlines() if not line.startswith("#")):
        return ""
    added = ("" if text.endswith("\n") or not text else "\n") + HOSTS_LINE + "\n"
    with open("/etc/hosts", "a") as f:
        f.write(added)
    return added


def remove_hosts_line(added: str):
    with open("/etc/hosts") as f:
        text = f.read()
    if added and added in text:
        with open("/etc/hosts", "w") as f:
            f.write(text.replace(added, "", 1))


@pytest.fixture(scope="module")
def cluster():
    """The environment for SLURM's commands (SLURM_CONF naming the cluster's slurm.conf), while munged,
    slurmctld and slurmd -N n1, -N n2 run. Its folder is not under pytest's tmp_path: munged, as its own
    user, must reach its socket through every folder above it."""
    folder = tempfile.mkdtemp(prefix="zero3-slurm-")
    os.chmod(folder, 0o755)
    for sub in ("state", "spool-n1", "spool-n2"):
        os.mkdir(os.path.join(folder, sub))
    daemons = []
    added = add_hosts_line()
    try:
        munged, sock = start_munged(folder)
        daemons.append(munged)
        with open(os.path.join(folder, "slurm.conf"), "w") as f:
            f.write(slurm_conf(folder, sock))
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = os.path.join(folder, "slurm.conf")
        for name, cmd in [("slurmctld", ["slurmctld", "-D", "-i"]), ("slurmd-n1", ["slurmd", "-D", "-N", "n1"]),
                          ("slurmd-n2", ["slurmd", "-D", "-N", "n2"])]:
            with open(os.path.join(folder, f"{name}.out"), "w") as log:
                daemons.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))

        def idle():
            out = subprocess.run(["sinfo", "-h", "-o", "%T %D"], env=env, capture_output=True, text=True).stdout
            return out.split() == ["idle", "2"]
        wait_for(idle, 60, f"two idle nodes (logs in {folder})")
        yield env
        subprocess.run(["scancel", "--user", "root"], env=env, capture_output=True)
        wait_for(lambda: not subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True).stdout.strip(),
                 60, "end of the cluster's jobs")
    finally:
        for proc in reversed(daemons):
            proc.terminate()
        for proc in reversed(daemons):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        remove_hosts_line(added)
        shutil.rmtree(folder, ignore_errors=True)


def job_script(train_args: list[str], check: bool) -> str:
    """launch.sbatch as this cluster can run it: the GPU and whole-node lines dropped (--cpus-per-task,
    --time and --signal are given to sbatch, which overrides the script's), TRAIN_ARGS the small CPU run,
    and the network check kept only where `check` (it costs an allocation ~10 s)."""
    with open(os.path.join(ROOT, "launch.sbatch")) as f:
        script = f.read()
    for line in ("#SBATCH --gpus-per-node=", "#SBATCH --exclusive\n", "#SBATCH --mem="):
        assert line in script, f"launch.sbatch has no {line.strip()!r} line any more: update job_script"
    script = "".join(line for line in script.splitlines(keepends=True)
                     if not line.startswith(("#SBATCH --gpus-per-node=", "#SBATCH --exclusive", "#SBATCH --mem=")))
    start = script.index("TRAIN_ARGS=(\n")
    end = script.index("\n)\n", start) + 3
    script = script[:start] + f"TRAIN_ARGS=({shlex.join(train_args)})\n" + script[end:]
    check_line = "srun --kill-on-bad-exit=1 ./launch.sh --check\n"
    assert check_line in script
    return script if check else script.replace(check_line, ": the network check is skipped in this test\n")


def submit(cluster, folder, files, name: str, time_limit: str, signal_at: str | None = None, check=False,
           **env) -> dict:
    """sbatch a copy of launch.sbatch; returns {"id", "out" (its --out_dir), "log" (its output file)}. The
    script's --signal stays unless `signal_at` replaces it: with a time limit under its 600 s lead, the
    signal comes at once."""
    out, log = folder / "run", folder / "job.log"
    script = folder / "job.sbatch"
    script.write_text(job_script(FLAGS + files + [f"--out_dir={out}"], check))
    job_env = {k: v for k, v in cluster.items() if k not in ("NNODES", "MASTER_ADDR", "RDZV_ID")}
    job_env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", NPROC_PER_NODE="1", MASTER_PORT=str(free_port()), **env)
    options = [f"--job-name={name}", f"--time={time_limit}", "--cpus-per-task=1", f"--output={log}", f"--chdir={ROOT}"]
    if signal_at:
        options.append(f"--signal={signal_at}")
    job_id = subprocess.run(["sbatch", "--parsable", *options, str(script)], env=job_env, capture_output=True,
                            text=True, check=True).stdout.strip().split(";")[0]
    return {"id": job_id, "out": out, "log": log}


def job_info(cluster, job) -> dict:
    out = subprocess.run(["scontrol", "-o", "show", "job", job["id"]], env=cluster, capture_output=True,
                         text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def log_of(job) -> str:
    return job["log"].read_text() if job["log"].exists() else ""


def wait_until_final(cluster, job, timeout: float) -> dict:
    """The job's scontrol fields once it has ended for good: a final state seen twice, 3 s apart."""
    deadline, seen, info = time.time() + timeout, 0, {}
    while time.time() < deadline:
        info = job_info(cluster, job)
        seen = seen + 1 if info.get("JobState") in FINAL_STATES else 0
        if seen == 2:
            return info
        time.sleep(3)
    raise AssertionError(f"job {job['id']} is {info.get('JobState')} after {timeout} s:\n{log_of(job)[-4000:]}")


def losses(job) -> list[float]:
    return [m["loss"] for m in read_metrics(job["out"])]


def intact_checkpoints(out) -> list[str]:
    """The step folders of OUT/checkpoints, each checked to hold its manifest (written last, at the commit);
    `latest` must name one of them."""
    folder = out / "checkpoints"
    steps = sorted(p.name for p in folder.iterdir() if p.name.startswith("step_"))
    for step in steps:
        assert (folder / step / "manifest.json").exists(), f"{step} looks complete without its manifest"
    assert (folder / "latest").read_text().strip() in steps
    return steps


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return model_and_tokens(tmp_path_factory.mktemp("slurm-files"))


@pytest.fixture(scope="module")
def jobs(cluster, files, tmp_path_factory):
    """Every job of the tier, submitted at once so that they run side by side."""
    def folder(name):
        return tmp_path_factory.mktemp(name)
    outside = folder("outside")
    hung, passing, signal_folder = folder("hung"), folder("passing"), folder("signal")
    return {
        # (e) then (c): driven by the test (scontrol requeue, then scancel); each step 1 s.
        "outside": submit(cluster, outside, files, "outside", "30", ZERO3_FAULT="slow:1"),
        # (b): rank 0 hangs in step 3 (once); rank 1 waits in its collective (--timeout_min=5 outlasts the job).
        # The signal comes 80 to 110 s after the start, the time limit at 120 to 150 s.
        "hung": submit(cluster, hung, files, "hung", "2", "USR1@10", ZERO3_FAULT="hang:3:0",
                       ZERO3_FAULT_ONCE=str(hung / "fired")),
        # (a): the signal comes 30 to 60 s after the start, while step 2 takes 60 s (once: the next
        # allocation runs at full speed and finishes).
        "signal": submit(cluster, signal_folder, files, "signal", "2", "USR1@60", ZERO3_FAULT="hang:2::60",
                         ZERO3_FAULT_ONCE=str(signal_folder / "fired")),
        # (d), with the network check kept (it runs under SLURM here).
        "error": submit(cluster, folder("error"), files, "error", "30", check=True, ZERO3_FAULT="nan:2"),
        # A fault at start-up that a restart fixes: rank 0 killed in step 1 once, no torchrun restarts.
        "passing": submit(cluster, passing, files, "passing", "30", ZERO3_FAULT="kill_mid_step:1:0",
                          ZERO3_FAULT_ONCE=str(passing / "fired"), MAX_RESTARTS="0"),
    }


@pytest.fixture(scope="module")
def reference(jobs, files, tmp_path_factory):
    """Losses of an uninterrupted --standalone W=2 run of the same flags (computed while the jobs run)."""
    out = tmp_path_factory.mktemp("reference")
    run_train(FLAGS + files + [f"--out_dir={out}"], nproc=2)
    return [m["loss"] for m in read_metrics(out)]


def test_outside_requeue_resumes_exactly_and_scancel_stops_for_good(cluster, jobs, reference):
    """`scontrol requeue` from outside mid-step: the run saves at the step boundary within KillWait and the
    next allocation resumes from there, bit-exact. Then `scancel`: a clean stop (the trainer saves, nothing
    torn) and the job stays cancelled (the batch shell's SIGTERM trap must not requeue it)."""
    job = jobs["outside"]
    wait_for(lambda: (job["out"] / "metrics.jsonl").exists() and len(read_metrics(job["out"])) >= 3, 300,
             f"3 steps of job {job['id']}:\n{log_of(job)[-3000:]}")
    subprocess.run(["scontrol", "requeue", job["id"]], env=cluster, check=True)
    wait_for(lambda: "resumed from" in log_of(job), 180, f"a resumed allocation of job {job['id']}")
    resumed_at = int(log_of(job).split("resumed from")[1].split("at step ")[1].split()[0])
    assert resumed_at >= 3, log_of(job)[-3000:]
    wait_for(lambda: len(read_metrics(job["out"])) >= resumed_at + 2, 120, "2 steps after the resume")
    subprocess.run(["scancel", job["id"]], env=cluster, check=True)
    info = wait_until_final(cluster, job, 60)
    time.sleep(8)  # longer than a requeue's delay (cred_expire=5 + 1 s): a requeued job would be pending now
    info = job_info(cluster, job)
    log = log_of(job)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "1", (info, log[-3000:])
    assert "requeueing" not in log, log[-3000:]
    stops = [int(s.split()[0]) for s in log.split("stopping at step ")[1:]]
    assert len(stops) == 2 and stops[0] == resumed_at, log[-3000:]  # both ends saved at a step boundary
    assert intact_checkpoints(job["out"])[-1] == f"step_{stops[1]:08d}"
    assert losses(job) == reference[:stops[1]]


def test_time_limit_with_signal_saves_requeues_and_finishes(cluster, jobs, reference):
    """SLURM's --signal before the time limit: save, requeue, resume in a later allocation, finish."""
    job = jobs["signal"]
    info = wait_until_final(cluster, job, 480)
    log = log_of(job)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, (info, log[-4000:])
    assert "stopping at step" in log and f"requeueing job {job['id']}" in log, log[-4000:]
    assert "DUE TO TIME LIMIT" not in log, log[-4000:]  # each stop came before the limit
    assert (job["out"].parent / "fired").exists()
    assert "stopping at step 2 on SIGUSR1" in log, log[-4000:]
    assert "the run is finished: step 16 of 16" in log
    assert losses(job) == reference


def test_time_limit_while_the_run_cannot_stop_still_requeues(cluster, jobs, reference):
    """A rank hangs: the signal cannot be honoured and the time limit's SIGTERM finds the run still in its
    step. The job must still be requeued (launch.sbatch's trap) and finish from its last checkpoint."""
    job = jobs["hung"]
    info = wait_until_final(cluster, job, 480)
    log = log_of(job)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, (info, log[-4000:])
    assert (job["out"].parent / "fired").exists()
    assert "DUE TO TIME LIMIT" in log and "the time limit came before the run stopped" in log, log[-4000:]
    assert "at step 2" in log.split("resumed from")[-1], log[-4000:]  # the periodic checkpoint before the hang
    assert losses(job) == reference


def test_error_a_restart_repeats_is_not_requeued(cluster, jobs):
    job = jobs["error"]
    info = wait_until_final(cluster, job, 300)
    log = log_of(job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "2:0", "0"), (info, log[-4000:])
    assert "error: step 2: loss nan" in log and "not requeued" in log, log[-4000:]
    assert "all-reduce results correct on every rank, in both groups" in log, log[-4000:]  # the check ran first


def test_a_passing_start_up_fault_is_retried_in_the_next_allocation(cluster, jobs, reference):
    """Exit code 1 from an allocation that saved nothing (a fault at start-up, torchrun's restarts spent) is
    requeued, bounded by MAX_ALLOCATIONS_WITHOUT_PROGRESS; here the next allocation runs clean."""
    job = jobs["passing"]
    info = wait_until_final(cluster, job, 300)
    log = log_of(job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, log[-4000:])
    assert (job["out"].parent / "fired").exists()
    assert "allocations in a row without progress: 1" in log, log[-4000:]
    assert losses(job) == reference
    assert not (job["out"] / "allocations_without_progress").exists()  # progress reset the count
