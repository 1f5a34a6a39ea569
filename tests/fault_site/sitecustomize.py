"""Python imports this file as it starts whenever its folder is on PYTHONPATH, as tests/common.py puts it for every
process the tests start: with ZERO3_FAULT set, tests/faults.py's hook becomes the trainer's fault_hook before
train.py runs, however it is started (python, torchrun, launch.sh, a SLURM job), and before tools/gpu_check.py runs
(the health check's matmul, which a run runs in that subprocess). Without ZERO3_FAULT: nothing."""
import os
import sys

# Only in the processes that run train.py or tools/gpu_check.py (sys.argv is known before the script runs): torchrun's
# own launcher, launch.sh's helpers and the other tools stay as they are. Installing imports torch (components.flags),
# and torch's log handlers, made before launch.sh quiets torchrun after a fatal line, would print torchrun's shutdown
# lines after it.
if os.environ.get("ZERO3_FAULT") and os.path.basename(getattr(sys, "argv", [""])[0]) in ("train.py", "gpu_check.py"):
    TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [TESTS, os.path.dirname(TESTS)]  # tests/ for faults.py, the repository for components.flags
    import faults
    faults.install()
    sys.path.remove(TESTS)  # the run itself imports nothing from tests/
