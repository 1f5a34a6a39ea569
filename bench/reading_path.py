"""What a reader visits following one optimizer step, measured by tracing it (the README's reading path).

    python bench/reading_path.py [--json] [train.py flags...]

The rule (README, "Reading order"): one process on the CPU, train.py's default flags (the tiny preset, the
built-in sample as --data, whose windows contain document ends, so the document-mask path runs), and every
project function and method executed from the train_step call to its return (the optimizer's update is its
last work), recorded with Python's profiler hook. Project: the files of this repository, tests excluded,
named by their path from the repository's root. Counted, at function/method level (a class is not counted;
its methods are):
  - callables: distinct functions, methods and nested functions (comprehensions excluded), per file;
  - file switches: how often the path of first calls changes file;
  - callees above their caller: distinct (caller, callee) pairs in one file where the callee's definition
    starts above its caller's (the reader must turn back);
  - the core passage: train.py's lines from `class Unit` to the statement naming the optimizer
    (`optimizer_step = ...`), and the train.py callables the step runs outside it.
tests/test_reading_path.py holds the README's figures equal to these."""
import ast
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train as T  # noqa: E402

SKIPPED = ("<module>", "<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>")


def trace_step(flags: list[str]) -> tuple[list[dict], list[tuple]]:
    """The callables of one train_step, first call first ({file, qualname, line}), and every call edge between
    two of them ((caller's file, qualname, line), (callee's file, qualname, line)), first seen first."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = T.parse_args([f"--out_dir={tmp}", *flags])
        sharded, windows, _, _, position, _ = T.setup(cfg)
        seen, order, edges = set(), [], {}

        def ours(code) -> bool:
            return (code.co_filename.startswith(ROOT + os.sep) and os.sep + "tests" + os.sep not in code.co_filename
                    and code.co_name not in SKIPPED)

        def key(code) -> tuple:
            return os.path.relpath(code.co_filename, ROOT), code.co_qualname, code.co_firstlineno

        def profile(frame, event, _arg):
            if event != "call" or not ours(frame.f_code):
                return
            callee = key(frame.f_code)
            if callee not in seen:
                seen.add(callee)
                order.append(dict(file=callee[0], qualname=callee[1], line=callee[2]))
            caller = frame.f_back
            while caller is not None and caller.f_code.co_name in SKIPPED:  # a comprehension's frame: its function's
                caller = caller.f_back
            if caller is not None and ours(caller.f_code):
                edges.setdefault((key(caller.f_code), callee), None)
        sys.setprofile(profile)
        try:
            T.train_step(cfg, sharded, windows, 1, position)
        finally:
            sys.setprofile(None)
        T.dist.destroy_process_group()
        T.disk.group = None
    return order, list(edges)


def core_passage() -> tuple[int, int]:
    """train.py's lines from `class Unit` to the statement that names the optimizer (`optimizer_step = ...`)."""
    with open(os.path.join(ROOT, "train.py")) as f:
        tree = ast.parse(f.read())
    start = next(node.lineno for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Unit")
    end = next(node.end_lineno for node in tree.body if isinstance(node, ast.Assign)
               and any(getattr(target, "id", None) == "optimizer_step" for target in node.targets))
    return start, end


def measure(flags: list[str] = ()) -> dict:
    order, edges = trace_step(list(flags))
    by_file = {}
    for c in order:
        by_file[c["file"]] = by_file.get(c["file"], 0) + 1
    files = [c["file"] for c in order]
    upward = sorted({(callee[0], f"{caller[1]} -> {callee[1]}") for caller, callee in edges
                     if caller[0] == callee[0] and callee[2] < caller[2]})
    above_by_file = {}
    for file, _ in upward:
        above_by_file[file] = above_by_file.get(file, 0) + 1
    start, end = core_passage()
    outside = [c["qualname"] for c in order if c["file"] == "train.py" and not start <= c["line"] <= end]
    return dict(callables=len(order), by_file=by_file, file_switches=sum(a != b for a, b in zip(files, files[1:])),
                above_caller=len(upward), above_caller_by_file=above_by_file,
                above_caller_pairs=[f"{file}: {pair}" for file, pair in upward], core_start=start, core_end=end,
                core_lines=end - start + 1, outside_core=outside, order=[f"{c['file']}:{c['line']} {c['qualname']}" for c in order])


def main():
    args = sys.argv[1:]
    as_json = "--json" in args
    result = measure([a for a in args if a != "--json"])
    if as_json:
        print(json.dumps(result))
        return
    print("first called  file:line  callable")
    for line in result["order"]:
        print(f"  {line}")
    print()
    print(f"callables: {result['callables']} ({', '.join(f'{n} in {f}' for f, n in result['by_file'].items())})")
    print(f"file switches along the path (first calls): {result['file_switches']}")
    print(f"callees above their caller: {result['above_caller']} "
          f"({', '.join(f'{n} in {f}' for f, n in result['above_caller_by_file'].items())})")
    for pair in result["above_caller_pairs"]:
        print(f"  {pair}")
    print(f"core passage: train.py lines {result['core_start']}-{result['core_end']} ({result['core_lines']} lines)")
    print(f"train.py callables the step runs outside it: {len(result['outside_core'])} {result['outside_core']}")


if __name__ == "__main__":
    main()
