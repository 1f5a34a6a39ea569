"""What the reference says about itself is true of its files: every relative link resolves, every file path and
every `module.name` the docs, comments and docstrings name exists, and the sizes the README states are the files'."""
import ast
import importlib
import dataclasses
import os
import re
import sys

import pytest
from common import ROOT

DOCS = ["README.md", "BENCHMARKS.md"] + [os.path.join("docs", n) for n in sorted(os.listdir(os.path.join(ROOT, "docs")))
                                         if n.endswith(".md")]
CODE = ["train.py", "model.py", "data.py", "launch.sh", "launch.sbatch"] + [
    os.path.join(d, n) for d in ("components", "tools", "bench", "tests") for n in sorted(os.listdir(os.path.join(ROOT, d)))
    if n.endswith((".py", ".sh"))]
# Our modules as the text names them, and where each lives
MODULES = {"train": "train", "model": "model", "data": "data", "disk": None, "out_dir": "components.out_dir",
           "checkpoints": "components.checkpoints", "hf": "components.hf", "plan": "tools.plan", "plan_memory": "tools.plan_memory",
           "agree": "components.agree", "metrics": "components.metrics", "checks": "components.checks",
           "offload": "components.offload", "sample": "components.sample", "faults": "faults", "processes": "components.processes",
           "flags": "components.flags", "config": None, "run_data": "components.run_data", "sample_corpus": "tools.sample_corpus",
           "gpu_check": "tools.gpu_check", "export_hf": "tools.export_hf",
           "tokenizer_export": None, "checkpoint": None}  # no module of that name: a reference to it is stale
FILE = re.compile(r"(?<![\w./-])((?:components|tools|bench|tests|docs|\.ci)/[\w./-]+\.(?:py|md|sh|json|cpp|png)|"
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
    return any(os.path.exists(os.path.join(ROOT, d, name)) for d in ("", "components", "tools", "bench", "tests", "docs", ".ci"))


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


# The flags the core passage reads: the step's own arithmetic and schedule. Every other flag of TrainConfig is a
# variation or outside the step, and the core must not read it.
CORE_FLAGS = {"adam_beta1", "adam_beta2", "adam_eps", "weight_decay", "lr", "warmup_steps", "schedule", "steps",
              "batch_size", "micro_batch_size", "doc_mask", "ce_chunk", "grad_clip", "prefetch", "reduce_dtype"}
# Each variation that reaches the core, and the name it reaches it by (the comment above `class Slot` says so).
VARIATIONS = {"freeze": "trained", "lr_mult": "ranges", "ac": "run_block", "offload_activations": "offload",
              "offload_optimizer": "OffloadedModel", "profile": "record_function"}


def test_the_core_passage_reads_no_variation_flag_and_says_where_each_plugs_in():
    """The core, found by its names (from `class Unit` to `optimizer_step = `), reads only CORE_FLAGS of the 58
    flags, branches on neither --offload_optimizer nor the tests' faults (subclasses; a hook in the loop), and the
    comment above it names every variation with the field or class it arrives by, which exists."""
    from components.flags import TrainConfig
    with open(os.path.join(ROOT, "train.py")) as f:
        source = f.read()
    core = source[source.index("\nclass Unit:"):source.index("\noptimizer_step = ")]
    flags = {field.name for field in dataclasses.fields(TrainConfig)}
    assert len(core.splitlines()) > 300  # the step itself
    assert CORE_FLAGS <= flags and set(VARIATIONS) <= flags - CORE_FLAGS
    assert set(re.findall(r"\bcfg\.(\w+)", core)) <= CORE_FLAGS
    variation = re.compile(r"\bif\b.*(offload_optimizer|fault_hook|\.host\b|host_adds)")
    assert [line for line in core.splitlines() if variation.search(line)] == []
    assert "O.finish_host_adds" not in core and "O.refresh_compute_shards" not in core and not re.search(r"\bfault", core)
    comment = " ".join(source[source.index("# The core, from `class Unit`"):source.index("\nclass Slot")].split())
    for flag, point in VARIATIONS.items():
        said = re.search(rf"--{flag}\b[^;.]*\b{point}\b", comment.replace("# ", ""))
        assert said and re.search(rf"\b(def|class) {point}\b|\.{point}\b|\b{point}\(", source), (flag, point)


def test_the_readmes_naive_step_is_as_long_as_it_says():
    """README.md says "ZeRO-3 in about N lines" of train_step_naive: N within 10% of the function's length."""
    with open(os.path.join(ROOT, "train.py")) as f:
        tree = ast.parse(f.read())
    naive = next(node for node in tree.body if getattr(node, "name", "") == "train_step_naive")
    with open(os.path.join(ROOT, "README.md")) as f:
        stated = [int(n) for n in re.findall(r"ZeRO-3 in about (\d+) lines", " ".join(f.read().split()))]
    length = naive.end_lineno - naive.lineno + 1
    assert stated and all(abs(n - length) <= 0.1 * length for n in stated), (stated, length)
