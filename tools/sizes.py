"""The trainer's sizes, as README.md's table states them: the lesson (what a student reads to learn the step),
the trainer's import closure (every module `python train.py` imports, inside functions included: what a run
is), train.py, data.py, the largest module of the closure, and where train.py's first ZeRO-3 definition stands.
Tools (this folder), tests/ and bench/ are above the trainer and never imported by it: they do not count.

    python tools/sizes.py [CHECKOUT]    # the table, in Markdown (of another checkout: to compare)

The lesson is read in README.md's reading order: model.py (the model), train.py from the top to section 3's
banner (shard, step, around the step), and data.py's windows (from `class Windows` on: what a micro-batch is).
"""
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LESSON = [("model.py", None, None), ("train.py", None, "# 3. Loop"), ("data.py", "class Windows", None)]


def module_path(name: str) -> str | None:
    """The file of project module `name` ('train', 'components.disk', the package 'components'), or None for a
    module outside the project."""
    path = os.path.join(ROOT, *name.split("."))
    return next((p for p in (path + ".py", os.path.join(path, "__init__.py")) if os.path.isfile(p)), None)


def imported_modules(path: str) -> set[str]:
    """The project modules one file imports, anywhere in it: `import model as M`, `from components import hf`,
    `from components.flags import TrainConfig`."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if module_path(name)}
    return found


def closure(start: str = "train") -> list[str]:
    """Every project module `start` imports, directly or through another, itself included, in the order met."""
    seen, todo = [start], [start]
    while todo:
        for name in sorted(imported_modules(module_path(todo.pop()))):
            if name not in seen:
                seen.append(name)
                todo.append(name)
    return seen


def lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def lesson_lines() -> int:
    """Lines of the lesson: each LESSON file between its first line starting with `begin` (or the top) and its
    first line containing `end` (or the bottom)."""
    total = 0
    for name, begin, end in LESSON:
        text = lines(os.path.join(ROOT, name))
        lo = next(i for i, line in enumerate(text) if line.startswith(begin)) if begin else 0
        hi = next(i for i, line in enumerate(text) if end in line) if end else len(text)
        total += hi - lo
    return total


def sizes() -> dict:
    modules = {name: len(lines(module_path(name))) for name in closure()}
    largest = max((name for name in modules if name != "train"), key=modules.get)
    train = lines(os.path.join(ROOT, "train.py"))
    first_definition = next(i + 1 for i, line in enumerate(train) if line.startswith("class Unit"))
    return dict(lesson=lesson_lines(), closure=sum(modules.values()), modules=len(modules), train=modules["train"],
                data=modules["data"], largest=(largest, modules[largest]), first_definition=first_definition)


def table(s: dict) -> str:
    largest, largest_lines = s["largest"]
    return "\n".join([
        "| measure | lines | budget |",
        "|---|---:|---:|",
        f"| the lesson (model.py, train.py sections 1-2b, data.py's windows) | {s['lesson']:,} | 1,500 |",
        f"| the trainer's import closure ({s['modules']} modules) | {s['closure']:,} | 6,500 |",
        f"| train.py | {s['train']:,} | 1,000 |",
        f"| train.py's first ZeRO-3 definition (`class Unit`), at line | {s['first_definition']} | 200 |",
        f"| data.py | {s['data']:,} | 900 |",
        f"| the largest other module ({largest.replace('.', '/')}.py) | {largest_lines:,} | 900 |",
    ])


if __name__ == "__main__":
    ROOT = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    print(table(sizes()))
