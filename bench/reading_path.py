"""What a reader visits following one optimizer step, measured by tracing it (the README's reading order).

    python bench/reading_path.py [train.py flags...]

Runs one train_step of the tiny preset on one CPU process with default flags (plus any given) and records,
in the order first called, every project function, method and lambda the step calls (Python's profiler
hook: files of this repository, not torch's or the tests'). Prints them, then the counting rule's totals:
the distinct top-level definitions (a class counts once for all its methods) per file, how many of train.py's
are defined above their first caller (read upward), and how many times the path changes file."""
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train as T  # noqa: E402


def top_level(qualname: str) -> str:
    return qualname.split(".")[0]


def trace_step(flags: list[str]) -> list[tuple[str, str, int, str]]:
    """(file, qualname, first line, caller's top-level definition) of each project callable, first call first."""
    with tempfile.TemporaryDirectory() as tmp:
        tokens = os.path.join(tmp, "tok.npy")
        np.save(tokens, (np.arange(20000) * 7 % 500).astype(np.uint16))
        cfg = T.parse_args(["--model=tiny", f"--data={tokens}", f"--out_dir={tmp}", "--seq_len=64",
                            "--batch_size=2", "--micro_batch_size=1", *flags])
        sharded, windows, _, _, position = T.setup(cfg)
        seen, order = set(), []

        def profile(frame, event, _arg):
            code = frame.f_code
            if event != "call" or not code.co_filename.startswith(ROOT) or "/tests/" in code.co_filename:
                return
            key = (os.path.relpath(code.co_filename, ROOT), code.co_qualname)
            if key not in seen:
                seen.add(key)
                caller = frame.f_back.f_code if frame.f_back else None
                caller_name = top_level(caller.co_qualname) if caller and caller.co_filename == code.co_filename else ""
                order.append((*key, code.co_firstlineno, caller_name))
        sys.setprofile(profile)
        try:
            T.train_step(cfg, sharded, windows, 1, position)
        finally:
            sys.setprofile(None)
        T.dist.destroy_process_group()
        T.disk.group = None
    return order


def main():
    order = trace_step(sys.argv[1:])
    print("first called  file:line  callable")
    for file, qualname, line, _ in order:
        print(f"  {file}:{line}  {qualname}")
    first_line = {}  # top-level definition -> (file, its first line)
    for file, qualname, line, _ in order:
        first_line.setdefault((file, top_level(qualname)), line)
    by_file = {}
    for file, name in first_line:
        by_file.setdefault(file, []).append(name)
    # Read upward: a train.py definition defined above the definition that first calls it.
    first_caller = {}
    for file, qualname, line, caller in order:
        first_caller.setdefault((file, top_level(qualname)), caller)
    upward = [name for (file, name), caller in first_caller.items()
              if file == "train.py" and caller and caller != name
              and first_line[(file, name)] < first_line.get((file, caller), 0)]
    files = [file for file, *_ in order]
    changes = sum(a != b for a, b in zip(files, files[1:]))
    print()
    for file, names in by_file.items():
        print(f"{file}: {len(names)} top-level definitions: {', '.join(names)}")
    print(f"train.py definitions above their first caller: {len(upward)} {upward}")
    print(f"file changes along the path (first calls): {changes}")


if __name__ == "__main__":
    main()
