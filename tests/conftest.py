"""Fixtures shared by several test files."""
import os
import signal
import sys

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import disk  # noqa: E402
import train as T  # noqa: E402


@pytest.fixture
def main_in_process(monkeypatch):
    """train.main at W=1 in this process: its exit code, with fail()'s os._exit turned into SystemExit; the
    signal handlers it installs are put back afterwards."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(os, "_exit", lambda code: sys.exit(code))

    def run(argv):
        try:
            T.main(argv)
        except SystemExit as e:
            return e.code
        return 0
    yield run
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    if dist.is_initialized():  # a failed run leaves its group
        dist.destroy_process_group()
    disk.group = None
    if disk.out_dir_lock is not None:
        disk.out_dir_lock.close()
    disk.out_dir_lock = disk.out_dir_claim = None
