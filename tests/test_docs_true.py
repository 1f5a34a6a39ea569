"""What the reference says about itself is true of its files: every relative link resolves, every file path and
every `module.name` the docs, comments and docstrings name exists, and the sizes the README states are the files'."""
import ast
import importlib
import os
import re
import sys

import pytest
from common import ROOT

DOCS = ["README.md", "BENCHMARKS.md"] + [os.path.join("docs", n) for n in sorted(os.listdir(os.path.join(ROOT, "docs")))
                                         if n.endswith(".md")]
CODE = ["train.py", "model.py", "data.py", "launch.sh", "launch.sbatch"] + [
    os.path.join(d, n) for d in ("components", "bench", "tests") for n in sorted(os.listdir(os.path.join(ROOT, d)))
    if n.endswith((".py", ".sh"))]
# Our modules as the text names them, and where each lives
MODULES = {"train": "train", "model": "model", "data": "data", "disk": "components.disk", "plan": "components.plan",
           "agree": "components.agree", "metrics": "components.metrics", "checks": "components.checks",
           "offload": "components.offload", "sample": "components.sample", "faults": "components.faults", "processes": "components.processes",
           "checkpoint": None}  # no module of that name: a reference to it is stale
FILE = re.compile(r"(?<![\w./-])((?:components|bench|tests|docs|\.ci)/[\w./-]+\.(?:py|md|sh|json|cpp|png)|"
                  r"[\w-]+\.(?:py|sh|sbatch))(?![\w/])")
MODULE_NAME = re.compile(r"(?<![\w./-])(" + "|".join(MODULES) + r")\.([A-Za-z_]\w*)(?![\w.])")  # not model.layers.0


def text_of(path: str) -> str:
    """A doc's text, or a code file's comments and docstrings only (its code is checked by running it)."""
    with open(os.path.join(ROOT, path)) as f:
        source = f.read()
    if path.endswith((".sh", ".sbatch")):  # comments only: a Python snippet inside names its own variables
        return "\n".join(line.split("#", 1)[1] for line in source.splitlines() if "#" in line)
    if not path.endswith(".py"):
        return source
    docstrings = [ast.get_docstring(n) or "" for n in ast.walk(ast.parse(source))
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
    comments = [line.split("#", 1)[1] for line in source.splitlines() if "#" in line and not line.strip().startswith(("'", '"'))]
    return "\n".join(docstrings + comments)


def file_exists(name: str, where: str) -> bool:
    if "/" in name:
        return any(os.path.exists(os.path.join(base, name)) for base in (ROOT, os.path.dirname(os.path.join(ROOT, where))))
    return any(os.path.exists(os.path.join(ROOT, d, name)) for d in ("", "components", "bench", "tests", "docs", ".ci"))


def test_every_relative_link_resolves():
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text_of(path)):
            if not re.match(r"[a-z]+://|mailto:", target) and not os.path.exists(
                    os.path.join(ROOT, os.path.dirname(path), target)):
                broken.append(f"{path}: {target}")
    assert broken == []


def test_every_file_the_docs_and_comments_name_exists():
    missing = []
    for path in DOCS + CODE:
        for name in set(FILE.findall(text_of(path))):
            if not file_exists(name, path) and not name.startswith(("out/", "modeling_")):  # transformers' files
                missing.append(f"{path}: {name}")
    assert missing == []


def test_every_module_name_the_docs_and_comments_name_exists():
    sys.path.insert(0, ROOT)
    missing = []
    for path in DOCS + CODE:
        for module, name in sorted(set(MODULE_NAME.findall(text_of(path)))):
            if name in ("py", "md", "sh", "sbatch", "jsonl", "json", "safetensors"):
                continue
            where = MODULES[module]
            if where is None or not hasattr(importlib.import_module(where), name):
                missing.append(f"{path}: {module}.{name}")
    assert missing == []


def test_the_readme_states_train_pys_sections_as_they_are():
    with open(os.path.join(ROOT, "train.py")) as f:
        sections = re.findall(r"^# (\d+b?)\. ", f.read(), re.M)
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = " ".join(f.read().split())
    stated = re.search(r"`train\.py` — the story \(([a-z]+) sections\)", readme)
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight"]
    assert stated and words.index(stated.group(1)) == len(sections), (stated and stated.group(0), sections)


def test_the_core_passage_plugs_in_the_optimizer_offload_and_the_faults_outside_it():
    """The core, found by its names (from `class Unit` to `optimizer_step = `), branches on neither
    --offload_optimizer nor the tests' faults: they plug in through subclasses and the fault_hook seam."""
    with open(os.path.join(ROOT, "train.py")) as f:
        source = f.read()
    core = source[source.index("\nclass Unit:"):source.index("\noptimizer_step = ")].splitlines()
    assert len(core) > 300  # the step itself
    variation = re.compile(r"\bif\b.*(offload_optimizer|fault_hook|\.host\b|host_adds)")
    assert [line for line in core if variation.search(line)] == []
    assert [line for line in core if "O.finish_host_adds" in line or "O.refresh_compute_shards" in line] == []
