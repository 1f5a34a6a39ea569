"""Training data: token files, the window order, and a small built-in sample.

`--data FILE.npy` is a 1-D array of token ids (any integer dtype), documents separated by the model's
EOS id. Training windows are `seq_len + 1` consecutive tokens (inputs and targets shifted by one),
starting every `seq_len` tokens. The order is a seeded permutation of all windows, drawn anew each
epoch, and the stream of windows wraps around epochs, so any file with at least `seq_len + 1` tokens
trains for any number of steps.

Global batch k is windows k*B .. k*B + B - 1 of that stream whatever the world size W and micro-batch
size m; rank r takes, in accumulation step j, the m windows starting at k*B + (j*W + r)*m. The order is
therefore a function of (seed, data, step) alone, which is what makes a resume exact: the loader's
whole state is the step number.

    python data.py sample --out sample.npy    # writes the built-in sample (byte tokens) as .npy
"""

import argparse
import ast
import os
import sys
import sysconfig

import numpy as np

# Byte-level tokens for the built-in sample: ids 0..255 are bytes, then BOS and EOS. The `tiny`
# preset (vocabulary 512) uses the same ids.
SAMPLE_BOS, SAMPLE_EOS = 256, 257


class DataError(ValueError):
    """Bad data: the message names the file and what is wrong."""


def load_tokens(path: str) -> np.ndarray:
    if not os.path.isfile(path):
        raise DataError(f"--data: {path} does not exist")
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise DataError(f"--data: {path} is not a .npy array ({e})") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"--data: {path} must be a 1-D integer array, got shape {tokens.shape} {tokens.dtype}")
    return tokens


def check_vocab(tokens: np.ndarray, vocab_size: int, name: str, chunk: int = 1 << 24):
    """A token id outside [0, vocab_size) would index past the embedding: refuse before training.
    Scans in chunks so a memory-mapped file is never read whole into memory."""
    for start in range(0, len(tokens), chunk):
        part = tokens[start:start + chunk]
        lo, hi = int(part.min()), int(part.max())
        if lo < 0 or hi >= vocab_size:
            bad = hi if hi >= vocab_size else lo
            pos = start + int(np.argmax(part == bad))
            raise DataError(f"--data: {name} has token id {bad} at position {pos}, outside the model's "
                            f"vocabulary [0, {vocab_size})")


class TokenWindows:
    """Windows of `seq_len + 1` tokens in a seeded, per-epoch order (see the module docstring)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, name: str = "data"):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"--data: {name} has {len(tokens)} tokens; at least seq_len + 1 = {seq_len + 1} "
                            f"are needed")
        self._epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:  # one permutation in memory at a time: 8 bytes a window
            self._epoch = epoch
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
        return self._perm

    def window(self, stream_index: int) -> np.ndarray:
        """The window at position `stream_index` of the endless, epoch-by-epoch shuffled stream."""
        epoch, pos = divmod(stream_index, self.n_windows)
        start = int(self._permutation(epoch)[pos]) * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)

    def micro_batch(self, step: int, accum_index: int, rank: int, world: int, micro: int, batch: int):
        """(inputs, targets) as int64 arrays (micro, seq_len) for optimizer step `step` (0-based)."""
        first = step * batch + (accum_index * world + rank) * micro
        rows = np.stack([self.window(first + i) for i in range(micro)])
        return rows[:, :-1], rows[:, 1:]


# ----------------------------------------------------------------------------------------------
# The built-in sample: text already on every machine with Python, tokenized as bytes
# ----------------------------------------------------------------------------------------------

def sample_documents(max_bytes: int = 2_000_000):
    """Docstrings of the Python standard library, read with `ast` (nothing is imported or run), in a
    fixed order: the same documents on every machine with the same Python."""
    stdlib = sysconfig.get_paths()["stdlib"]
    total = 0
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "site-packages", "idlelib"))
        for fname in sorted(filenames):
            if not fname.endswith(".py"):
                continue
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
                        if total >= max_bytes:
                            return


def sample_tokens(max_bytes: int = 2_000_000) -> np.ndarray:
    """BOS + UTF-8 bytes + EOS for each sample document, as one uint16 array."""
    parts = []
    for doc in sample_documents(max_bytes):
        parts.append(np.array([SAMPLE_BOS, *doc.encode("utf-8"), SAMPLE_EOS], dtype=np.uint16))
    return np.concatenate(parts)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sample", help="write the built-in sample as a .npy token file")
    p.add_argument("--out", required=True)
    p.add_argument("--max_bytes", type=int, default=2_000_000)
    args = parser.parse_args(argv)
    tokens = sample_tokens(args.max_bytes)
    np.save(args.out, tokens)
    print(f"wrote {len(tokens):,} tokens to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
