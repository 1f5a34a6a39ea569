"""tools/prepare.py prepare throughput (tokens/s) with 1 and 2 workers vs a plain single-process encode loop.

    python bench/prepare_throughput.py [--mb 50] [--workers 1 2] [--repeats 2]

The corpus is the built-in sample's text.jsonl repeated to at least --mb MB, the tokenizer the sample's
(sentencepiece BPE, 4,096 pieces). The loop reads the same lines and encodes one document per call, as
a first script would; prepare's tokens/s counts BOS + EOS too, and so does the loop. Runs alternate
(loop, prepare w1, prepare w2, ...) and each figure is the best of --repeats.
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import prepare as prep  # noqa: E402
from tools import sample_corpus  # noqa: E402


def encode_loop(path, tokenizer_path):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=tokenizer_path)
    n = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            n += len(sp.encode(json.loads(line)["text"])) + 2
    return n


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=50)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "prepare_bench"))
    args = parser.parse_args()
    sample = sample_corpus.build_sample(os.path.join(args.dir, "sample"))
    corpus, tokenizer = os.path.join(args.dir, "corpus.jsonl"), os.path.join(sample, "tokenizer.model")
    if not os.path.isfile(corpus) or os.path.getsize(corpus) < args.mb * 1e6:
        text = open(os.path.join(sample, "text.jsonl"), encoding="utf-8").read()
        with open(corpus, "w", encoding="utf-8") as f:
            for _ in range(int(-(-args.mb * 1e6 // len(text.encode())))):
                f.write(text)
    size_mb = os.path.getsize(corpus) / 1e6
    best = {}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        n = encode_loop(corpus, tokenizer)
        best["loop"] = max(best.get("loop", 0), n / (time.perf_counter() - t0))
        for w in args.workers:
            t0 = time.perf_counter()
            meta = prep.prepare([corpus], tokenizer, os.path.join(args.dir, f"out-w{w}"), workers=w, overwrite=True, quiet=True)
            best[f"prepare w{w}"] = max(best.get(f"prepare w{w}", 0), meta["tokens"] / (time.perf_counter() - t0))
            assert meta["tokens"] == n, (meta["tokens"], n)
    print(f"corpus {size_mb:.0f} MB, {n:,} tokens, {os.cpu_count()} CPU cores")
    print("| run | tokens/s | vs loop |\n|---|---:|---:|")
    for name, rate in best.items():
        print(f"| {name} | {rate:,.0f} | {rate / best['loop']:.2f}x |")


if __name__ == "__main__":
    main()
