"""`.ci/run` itself, run on a tiny folder of tests: a failing test of either tier fails CI and is named (issue 48:
a failing main tier once passed CI, since the tier ran in a subshell on the left of `||`)."""
import os
import subprocess
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PASSING = "def test_passes():\n    assert 1 + 1 == 2\n"
FAILING = "def test_fails():\n    assert 1 + 1 == 3, 'one and one are not three'\n"
SLURM_PASSING = "import pytest\n\n@pytest.mark.slurm\ndef test_slurm_passes():\n    assert True\n"
SLURM_FAILING = "import pytest\n\n@pytest.mark.slurm\ndef test_slurm_fails():\n    assert False, 'the SLURM tier failed'\n"
BROKEN = "def test_never_collected(:\n    pass\n"


def run_ci(tmp_path, files: dict[str, str]) -> subprocess.CompletedProcess:
    """`.ci/run`, installs skipped, on a folder holding `files` (name -> source) and a pytest.ini naming the marker."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slurm: the SLURM tier\n")
    for name, source in files.items():
        (tmp_path / name).write_text(textwrap.dedent(source))
    env = {**os.environ, "CI_INSTALL": "0", "CI_TESTS": str(tmp_path)}
    return subprocess.run(["bash", os.path.join(ROOT, ".ci", "run")], env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("files, failed_test, total", [
    ({"test_a.py": PASSING, "test_b.py": FAILING, "test_s.py": SLURM_PASSING},
     "test_b.py::test_fails", "total: 2 passed, 1 failed, 0 skipped"),
    ({"test_a.py": PASSING, "test_s.py": SLURM_FAILING},
     "test_s.py::test_slurm_fails", "total: 1 passed, 1 failed, 0 skipped"),
    ({"test_a.py": PASSING, "test_broken.py": BROKEN, "test_s.py": SLURM_PASSING},
     "test_broken.py", "total: 0 passed, 2 failed, 0 skipped"),
], ids=["main-tier-test-fails", "slurm-tier-test-fails", "main-tier-collection-error"])
def test_ci_fails_when_a_test_fails_and_names_it(tmp_path, files, failed_test, total):
    proc = run_ci(tmp_path, files)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    summary = out[out.index("---- CI summary ----"):]
    assert any(line.startswith(("FAILED", "ERROR")) and failed_test in line for line in summary.splitlines()), out
    assert total in summary.splitlines(), out
    assert "CI failed" in summary, out


def test_ci_passes_when_every_test_passes(tmp_path):
    proc = run_ci(tmp_path, {"test_a.py": PASSING, "test_s.py": SLURM_PASSING})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "total: 2 passed, 0 failed, 0 skipped" in out.splitlines(), out
    assert "main tier (exit status 0): " in out and "SLURM tier (exit status 0): " in out, out
