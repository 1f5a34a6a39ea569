"""The built-in sample (--data sample, the default): English and French text already on the machine, no network
(docs/data.md, "The built-in sample"). Built once per --out_dir, by a run in a subprocess (run_data.build_sample:
the trainer never imports this file) or by hand:

    python tools/sample_corpus.py out/sample     # corpus, tokenizer and shards, without training
"""
import argparse
import ast
import fcntl
import gettext
import glob
import json
import os
import sys
import sysconfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: data.py, tools/
import data as D  # noqa: E402
from components.run_data import SAMPLE_SOURCES, sample_is_built  # noqa: E402  (what a run reads of the sample)
from tools import prepare as prep  # noqa: E402


def message_catalogs(locale_dir: str = "/usr/share/locale/fr/LC_MESSAGES"):
    """(English, French) messages of the system's French gettext catalogs (coreutils, grep, apt, ...)."""
    for path in sorted(glob.glob(os.path.join(locale_dir, "*.mo"))):
        try:
            with open(path, "rb") as f:
                catalog = gettext.GNUTranslations(f)._catalog
        except (OSError, ValueError, UnicodeDecodeError):  # unreadable or not a catalog: skip it
            continue
        for msgid in sorted(catalog, key=str):
            english, french = (msgid[0] if isinstance(msgid, tuple) else msgid), catalog[msgid]
            if english.strip() and french.strip() and english != french:
                yield english.strip(), french.strip()


def python_docstrings(max_chars: int = 2_000_000):
    """English: docstrings of the Python standard library, read with `ast` (nothing is imported)."""
    stdlib, total = sysconfig.get_paths()["stdlib"], 0
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "site-packages", "idlelib"))
        for fname in sorted(f for f in filenames if f.endswith(".py")):
            try:
                with open(os.path.join(dirpath, fname), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) > 200:
                        yield doc
                        total += len(doc)
                        if total >= max_chars:
                            return


def write_jsonl(path: str, records: list):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def write_sample_corpus(folder: str, doc_chars: int = 2000):
    """Per source of SAMPLE_SOURCES, NAME.jsonl and the held-out eval_NAME.jsonl (every 50th document);
    text.jsonl and eval_text.jsonl, both sources (what the tokenizer is trained on); chat.jsonl, translation
    requests answered in French."""
    os.makedirs(folder, exist_ok=True)
    pairs = list(message_catalogs())
    if not pairs:
        print("warning: no French message catalogs under /usr/share/locale/fr; the sample is English only",
              file=sys.stderr)
    docs, en, fr = [], [], []
    for english, french in pairs:  # consecutive messages of one catalog make a document
        en.append(english)
        fr.append(french)
        if sum(map(len, fr)) >= doc_chars:
            docs += [("messages", "\n\n".join(en)), ("messages", "\n\n".join(fr))]
            en, fr = [], []
    docs += [("docstrings", doc) for doc in python_docstrings()]
    for name in ["text"] + [name for name, _ in SAMPLE_SOURCES]:
        for prefix, held_out in (("", False), ("eval_", True)):
            write_jsonl(os.path.join(folder, f"{prefix}{name}.jsonl"), [
                {"text": doc} for i, (source, doc) in enumerate(docs)
                if name in ("text", source) and (i % 50 == 49) == held_out])
    write_jsonl(os.path.join(folder, "chat.jsonl"), [
        {"messages": [{"role": "system", "content": "You translate software messages into French."},
                      {"role": "user", "content": f"Translate into French:\n\n{english}"},
                      {"role": "assistant", "content": french}]}
        for english, french in pairs[::20] if 40 <= len(english) <= 400])


def build_sample(folder: str, vocab_size: int = 4096, quiet: bool = True) -> str:
    """The corpus, its tokenizer and each source's prepared train/NAME and eval/NAME under `folder`, built once:
    later runs and the other ranks (waiting on the lock) find them there."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not sample_is_built(folder):
            write_sample_corpus(folder)
            text, tokenizer = os.path.join(folder, "text.jsonl"), os.path.join(folder, "tokenizer.model")
            prep.train_tokenizer([text], vocab_size, tokenizer)
            for name, _ in SAMPLE_SOURCES:
                for part, prefix in (("train", ""), ("eval", "eval_")):
                    prep.prepare([os.path.join(folder, f"{prefix}{name}.jsonl")], tokenizer,
                                 os.path.join(folder, part, name), overwrite=True, quiet=quiet)
    return folder


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="where to build it (a run's is OUT_DIR/sample)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines: warnings and errors only")
    args = parser.parse_args(argv)
    try:
        build_sample(args.folder, quiet=args.quiet)
    except (D.DataError, OSError) as e:  # one line, which a run building the sample repeats as its error
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if not args.quiet:
        print(f"built the sample in {args.folder}", file=sys.stderr)


if __name__ == "__main__":
    main()
