"""The README's reading-path figures are measured, not written by hand: bench/reading_path.py traces one
train_step by the rule the README states (default flags, the built-in sample, whose windows contain document
ends), and its figures must be the README's. The core passage it reports must stay what the README promises:
within ~450 lines, holding every train.py callable the step runs but the fault seam's default, with no branch
on a variation in it."""
import json
import os
import re
import subprocess
import sys

import pytest
from common import ROOT


@pytest.fixture(scope="module")
def measured():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "reading_path.py"), "--json"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_readme_states_the_measured_reading_path(measured):
    readme = " ".join(open(os.path.join(ROOT, "README.md")).read().split())
    section = readme[readme.index("## Reading order"):readme.index("## How the sharding works")]
    expected = [f"{measured['callables']} functions and methods",
                *(f"{n} in `{file}`" for file, n in measured["by_file"].items()),
                f"{measured['file_switches']} file switches",
                f"{measured['above_caller']} places where a callee sits above its caller",
                f"{measured['above_caller_by_file'].get('train.py', 0)} of them in `train.py`",
                f"`train.py` lines {measured['core_start']}-{measured['core_end']} ({measured['core_lines']} lines)",
                *(f"`{name}`" for name in measured["outside_core"])]
    missing = [phrase for phrase in expected if phrase not in section]
    assert not missing, (missing, measured)


def test_the_core_passage_is_one_pass_without_the_variations(measured):
    assert measured["core_lines"] <= 450, measured["core_lines"]
    assert measured["outside_core"] == ["no_fault"], measured["outside_core"]  # the fault seam's default (section 4b)
    assert measured["by_file"]["train.py"] > 10  # the step's own code is traced
    with open(os.path.join(ROOT, "train.py")) as f:
        core = f.read().splitlines()[measured["core_start"] - 1:measured["core_end"]]
    variation = re.compile(r"\bif\b.*(offload_optimizer|fault_hook|\.host\b|host_adds)")
    assert [line for line in core if variation.search(line)] == []
    assert [line for line in core if "O.finish_host_adds" in line or "O.refresh_compute_shards" in line] == []
