"""Fault injection, for the tests only. The trainer holds one hook, components/flags.py's fault_hook (None in every
run the tests do not start), and calls it at three points: the start of each step, each rank's checkpoint file
written, the process group's first contact; tools/gpu_check.py, the device health check a run runs in a
subprocess, calls it at a fourth, its check matmul. install() sets it to `hook` when ZERO3_FAULT is set:
tests/fault_site/sitecustomize.py at the start of python for train.py and tools/gpu_check.py (tests/common.py puts
that folder first on PYTHONPATH for every process the tests start: plain python, torchrun, launch.sh, SLURM jobs),
and tests/warm_start.py in each run it forks. The trainer never imports this file, so a ZERO3_FAULT left over in a
shell does nothing to a real run. The step itself holds no seam: the mid-step faults strike from a forward hook
(PyTorch's own extension point) on the model's final norm, the head's first module.

    ZERO3_FAULT=KIND:STEP[:RANK[:SECONDS]]   (every rank when RANK is left out or empty; STEP is 1-based)
      kill_mid_step  SIGKILL in the middle of step STEP: its forward done, before its first backward
      nan            this rank's loss of step STEP becomes NaN before backward, as an overflow would
      hang           this rank sleeps in step STEP: SECONDS, or an hour; its peers' collectives time out
      kill_in_save   SIGKILL after writing this rank's file of step STEP's checkpoint, before the commit
                     (--async_save: in the writer thread, while the next steps train)
      slow_save      that file takes SECONDS longer to write (--async_save: the writer thread sleeps)
    ZERO3_FAULT=slow:SECONDS                 every step takes SECONDS longer (at its start)
    ZERO3_FAULT=busy:RANK:SECONDS            every step, rank RANK burns SECONDS of CPU in its forward (its own
                                             compute time rises; the step line names it)
    ZERO3_FAULT=slow_matmul:RANK:SECONDS     before step 1, rank RANK's health-check matmul burns SECONDS of CPU
                                             more each time (tools/gpu_check.py, with RANK from its environment;
                                             a run on a CPU runs it with ZERO3_GPU_CHECK_ON_CPU=1)
    ZERO3_FAULT=wrong_matmul:RANK            before step 1, one entry of rank RANK's health-check product is off by 1
    ZERO3_FAULT=late_contact:RANK:SECONDS    rank RANK reaches the process group's first contact SECONDS late
                                             (processes.make_group: a rank hung before NCCL's set-up)
    ZERO3_FAULT_ONCE=FILE                    a fault fires once: FILE records that it did, so a restarted
                                             job runs clean
"""
import os
import signal
import sys
import time

MID_STEP = ("kill_mid_step", "nan", "hang")
IN_SAVE = ("kill_in_save", "slow_save")
ON_RANK = dict(busy=2, slow_matmul=2, wrong_matmul=1, late_contact=2)  # KIND:RANK[:SECONDS]: fields after KIND


def burn_cpu(seconds: float):
    """Busy for `seconds` of this thread's CPU time: a slower GPU or CPU, as a rank's own compute time sees it
    (a sleep would add wall time only, which collectives equalise across ranks)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def spec_error(value: str) -> str | None:
    """What is wrong with a ZERO3_FAULT value, as one line, or None when hook can read it."""
    spec = value.split(":")
    usage = (f"ZERO3_FAULT={value!r} is not KIND:STEP[:RANK[:SECONDS]], slow:SECONDS, busy:RANK:SECONDS, "
             f"slow_matmul:RANK:SECONDS, wrong_matmul:RANK or late_contact:RANK:SECONDS (tests/faults.py)")
    try:
        if spec[0] == "slow":
            return None if len(spec) == 2 and float(spec[1]) >= 0 else usage
        if spec[0] in ON_RANK:
            return None if len(spec) == 1 + ON_RANK[spec[0]] and int(spec[1]) >= 0 and float(spec[-1]) >= 0 else usage
        if spec[0] not in MID_STEP + IN_SAVE or not 2 <= len(spec) <= 4 or int(spec[1]) < 1:
            return usage
        if len(spec) > 2 and spec[2]:
            int(spec[2])
        if len(spec) > 3:
            float(spec[3])
    except ValueError:
        return usage
    return None


def install(env=os.environ):
    """flags.fault_hook = hook when ZERO3_FAULT is set. A malformed value is one line and exit 2 before any work,
    not a traceback at the step it names."""
    value = env.get("ZERO3_FAULT", "")
    if not value:
        return
    error = spec_error(value)
    if error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        os._exit(2)  # not SystemExit: raised at python's start-up (sitecustomize), it ends in a fatal error
    from components import flags  # the repository is on sys.path: sitecustomize and warm_start.py put it there
    flags.fault_hook = hook


def hook(where: str, step: int, rank: int, model=None):
    """where: 'step' (train.main, as each step starts; `model`: the sharded model's modules), 'save', 'matmul'
    (gpu_check.timed_matmul; `model`: the product, on that rank) or 'contact' (processes.make_group, before the first
    contact; `step` is 0)."""
    spec = os.environ.get("ZERO3_FAULT", "").split(":")
    kind = spec[0]
    if where == "contact":
        if kind == "late_contact" and int(spec[1]) == rank:
            time.sleep(float(spec[2]))
        return
    if kind == "slow":
        if where == "step":
            time.sleep(float(spec[1]))
        return
    if kind in ON_RANK:
        if int(spec[1]) != rank:
            return
        if where == "matmul" and kind == "slow_matmul":
            burn_cpu(float(spec[2]))
        if where == "matmul" and kind == "wrong_matmul":
            model.view(-1)[0] += 1
        if where == "step" and kind == "busy":  # in the forward, as the step's own compute

            def busy(module, args, output):
                handle.remove()
                burn_cpu(float(spec[2]))
            handle = model.norm.register_forward_hook(busy)
        return
    if kind not in (MID_STEP if where == "step" else IN_SAVE) or int(spec[1]) != step:
        return
    if len(spec) > 2 and spec[2] and int(spec[2]) != rank:
        return
    once = os.environ.get("ZERO3_FAULT_ONCE")
    if once:
        if os.path.exists(once):
            return
        open(once, "w").close()
    seconds = float(spec[3]) if len(spec) > 3 else None
    if where == "save":
        if kind == "kill_in_save":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(seconds or 0.0)  # slow_save
        return

    def strike(module, args, output):  # in the step: the head's forward, every block gathered and run, before backward
        handle.remove()
        if kind == "kill_mid_step":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "hang":
            time.sleep(seconds if seconds is not None else 3600)
        return output * float("nan") if kind == "nan" else output  # NaN: the loss, its gradients and the norm follow
    handle = model.norm.register_forward_hook(strike)
