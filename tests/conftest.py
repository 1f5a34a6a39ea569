"""Fixtures shared by several test files."""
import gc
import os
import pwd
import shutil
import signal
import sys

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from components import out_dir as OD  # noqa: E402
import train as T  # noqa: E402
from common import run_train, with_built_sample  # noqa: E402


@pytest.fixture
def main_in_process(monkeypatch):
    """train.main at W=1 in this process: its exit code, with fail()'s os._exit turned into SystemExit; the
    signal handlers it installs are put back afterwards."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(os, "_exit", lambda code: sys.exit(code))
    environment = dict(os.environ)  # train.main sets launch.sh's GPU settings in its own environment (agree.py)

    def run(argv):
        with_built_sample(argv)
        try:
            T.main(argv)
        except SystemExit as e:
            return e.code
        return 0
    yield run
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    os.environ.clear()
    os.environ.update(environment)
    gc.unfreeze()  # train.main freezes set-up's objects and turns automatic collection off while it trains; a
    gc.enable()    # failed run leaves them so
    if dist.is_initialized():  # a failed run leaves its group
        dist.destroy_process_group()
    OD.group = None
    if OD.out_dir_lock is not None:
        OD.out_dir_lock.close()
    OD.out_dir_lock = OD.out_dir_claim = None


@pytest.fixture
def train_at(main_in_process, capfd):
    """train.py at `world` ranks: (its exit code, its stderr). One rank runs train.main in this process (no python
    start-up: main_in_process), more as processes (run_train: forked as torchrun would start them), where the
    processes are what is tested."""
    def run(args, world=1, timeout=600):
        if world > 1:
            proc = run_train(args, nproc=world, check=False, timeout=timeout)
            return proc.returncode, proc.stderr
        return main_in_process(args), capfd.readouterr().err
    return run


# The SLURM tier (tests/test_slurm.py, marker `slurm`): launch.sbatch under a real slurmctld, two slurmd and
# munge on this machine. It is a pytest run of its own (`.ci/run` starts it beside the main suite: it mostly waits
# on SLURM's time limits), so the README's command never needs SLURM; it skips the tier with one line saying how.
SLURM_TIER = "python -m pytest -q -m slurm tests"


def slurm_missing() -> str | None:
    """Why the SLURM tier cannot run here, or None."""
    missing = [c for c in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol") if shutil.which(c) is None]
    try:
        pwd.getpwnam("munge")
    except KeyError:
        missing.append("the munge user")
    if missing:
        return (f"the SLURM tier needs slurm-wlm and munge ({', '.join(missing)} not found): `bash .ci/run` installs "
                f"them and runs it, or `apt-get install -y slurm-wlm munge` then `{SLURM_TIER}`, as root")
    if os.geteuid() != 0:
        return f"the SLURM tier starts slurmctld, slurmd and munged: run `{SLURM_TIER}` as root"
    return None


# The forker's tier (marker `fork`): for every family, the oracle at W=1 and 2, a resume at another world size
# and the export; a subset of the main suite that a fork of model.py runs in about a minute (docs/forking.md).
FORK_TIER = "python -m pytest -q -m fork tests"


def pytest_configure(config):
    config.addinivalue_line("markers",
                            f"slurm: launch.sbatch under a real SLURM on this machine; its own tier: {SLURM_TIER}")
    config.addinivalue_line("markers", f"fork: the forker's tier, every family against its oracle: {FORK_TIER}")


def pytest_collection_modifyitems(config, items):
    tier = [item for item in items if item.get_closest_marker("slurm")]
    expression = config.getoption("markexpr") or ""
    if not tier:
        return
    if "slurm" not in expression or "not slurm" in expression:
        reason = f"the SLURM tier is a run of its own: {SLURM_TIER} (bash .ci/run runs it beside the main suite)"
    else:
        reason = slurm_missing()
    for item in tier if reason else []:
        item.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter):
    """The skip's reason once, even without -rs."""
    reasons = {report.longrepr[2] for report in terminalreporter.stats.get("skipped", [])
               if "slurm" in report.keywords and isinstance(report.longrepr, tuple)}
    for reason in sorted(reasons):
        terminalreporter.write_line(reason.removeprefix("Skipped: "))
