"""Training data as a run reads it: a prepared folder read back as one token sequence (TokenData, read_meta), its
windows in a resumable order (TokenWindows) and sources mixed by weight (MixedWindows); and a record as the tools
and --sample_prompts read one (parse_record).

A prepared folder holds token shards, each with the positions where its documents start (a text is the family's
BOS + tokens + document end; a chat is its template's rendering, as is), a loss mask for chats (each assistant
reply and the marker that closes it), and meta.json, written last. Training reads windows of `seq_len + 1` tokens
in a seeded order whose whole state is one position P, the same for any world size; mixes interleave sources by
weight. The formats, the order and the mixes in full: docs/data.md. Writing a folder is a tool's work, never a
run's: tools/prepare.py (tokenize and pack; `python data.py prepare ...` runs it), tools/sample_corpus.py (the
built-in sample); the tokenizer is tools/tokenizer.py's, which a run asks for its prompts' ids in a subprocess
(components/sample.py). Around this data path, in components/: a run's data from its flags (run_data.py).
"""

import fractions
import json
import math
import os
import sys

import numpy as np

META_FORMAT = "llama-zero3-tokens/2"  # document starts are data: each shard's docs-*.npy (docs/data.md)
EOS_FORMAT = "llama-zero3-tokens/1"   # before: a document started after each eos_id (still read, so still trained)


class DataError(ValueError):
    """Bad data: the message names the flag or file (and line) and what is wrong."""


# -- a record: a .jsonl line or a .txt file (tools/prepare.py's documents, --sample_prompts' prompts) --------

def parse_record(raw: bytes, where: str, is_txt: bool, trains: bool = True) -> dict:
    """{"text": str} or {"messages": [...]} from a .jsonl line or a .txt file. `trains=False`: a prompt to
    sample from (--sample_prompts), which need not hold an assistant reply."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not valid UTF-8 (byte {e.start})") from None
    if is_txt:
        record = {"text": line}
    else:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        if not record["text"].strip():
            raise DataError(f"{where}: empty document")
        return {"text": record["text"]}
    messages = record.get("messages") if isinstance(record, dict) else None
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise DataError(f'{where}: expected {{"text": str}} or {{"messages": [{{"role": str, "content": str}}, ...]}}')
    if trains and not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise DataError(f"{where}: a chat with no assistant content trains nothing")
    return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages]}


class TokenData:
    """Token shards (and loss masks) read as one sequence; memory-mapped, so only what is sliced is read."""

    def __init__(self, path: str, flag: str = "--data"):
        self.path, self.flag = path, flag
        self.meta = read_meta(path, flag) if os.path.isdir(path) else None
        # Where documents start: each shard's docs file (format 2), else after each EOS (format 1; a bare .npy
        # after the model's EOS, which run_data.open_data sets here)
        self.eos_id = self.meta["eos_id"] if self.meta and self.meta["format"] == EOS_FORMAT else None
        records = self.meta["shards"] if self.meta else [dict(tokens=path, mask=None, n_tokens=None)]
        folder = path if self.meta else ""
        self.shards, self.shard_paths, self.doc_starts = [], [os.path.join(folder, r["tokens"]) for r in records], []
        for record, tokens_path in zip(records, self.shard_paths):
            tokens = self._open(tokens_path, flag)
            mask = self._open(os.path.join(folder, record["mask"]), flag) if record["mask"] else None
            if record["n_tokens"] not in (None, len(tokens)) or (mask is not None and len(mask) != len(tokens)):
                raise DataError(f"{flag}: {tokens_path} has {len(tokens)} tokens, meta.json says {record['n_tokens']}")
            if record.get("docs"):
                self.doc_starts.append(self._doc_starts(os.path.join(folder, record["docs"]), record, len(tokens)))
            self.shards.append((tokens, mask))
        self.starts = np.cumsum([0] + [len(t) for t, _ in self.shards])

    def _doc_starts(self, path: str, record: dict, n_tokens: int) -> np.ndarray:
        """A shard's document starts, held to what meta.json records: sorted positions inside the shard."""
        starts = np.asarray(self._open(path, self.flag))
        if len(starts) != record["n_documents"] or (len(starts) and (starts[0] < 0 or starts[-1] >= n_tokens
                                                                       or (np.diff(starts) <= 0).any())):
            raise DataError(f"{self.flag}: {path} does not hold {record['n_documents']} increasing positions "
                            f"within its shard's {n_tokens} tokens: it changed after prepare "
                            f"(run tools/prepare.py prepare again)")
        return starts

    @staticmethod
    def _open(path: str, flag: str) -> np.ndarray:
        if not os.path.isfile(path):
            raise DataError(f"{flag}: {path} does not exist")
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise DataError(f"{flag}: {path} is not a .npy array ({e})") from None
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise DataError(f"{flag}: {path} must be a 1-D integer array, got shape {array.shape} {array.dtype}")
        return array

    def __len__(self):
        return int(self.starts[-1])

    def read(self, start: int, n: int):
        """Tokens [start, start + n) as int64, their mask (None without one), and where documents start in them
        (bool), across shards."""
        tokens, masks, doc_starts, end, first = [], [], np.zeros(n, dtype=bool), start + n, start
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < end:
            lo, hi = start - self.starts[k], min(end, self.starts[k + 1]) - self.starts[k]
            shard_tokens, shard_mask = self.shards[k]
            tokens.append(np.asarray(shard_tokens[lo:hi], dtype=np.int64))
            if shard_mask is not None:
                masks.append(np.asarray(shard_mask[lo:hi]))
            if self.doc_starts:
                docs = self.doc_starts[k]
                inside = docs[np.searchsorted(docs, lo):np.searchsorted(docs, hi)]
                doc_starts[inside + self.starts[k] - first] = True
            start, k = self.starts[k] + hi, k + 1
        tokens = np.concatenate(tokens)
        if not self.doc_starts and self.eos_id is not None:  # the EOS convention: a document after each EOS
            doc_starts[1:] = tokens[:-1] == self.eos_id
            if first > 0:
                k = int(np.searchsorted(self.starts, first - 1, side="right")) - 1
                doc_starts[0] = self.shards[k][0][first - 1 - self.starts[k]] == self.eos_id
            else:
                doc_starts[0] = True
        return tokens, (np.concatenate(masks) if masks else None), doc_starts

    def check_vocab(self, vocab_size: int):
        """An id outside [0, vocab_size) would index past the embedding mid-step: refuse it before training, in
        one pass over every shard (about a second per GB from the page cache), which also holds each shard to
        the largest id meta.json records for it: a shard changed after prepare shows."""
        if self.meta and self.meta["vocab_size"] != vocab_size:
            raise DataError(f"{self.flag}: {self.path} was tokenized with a {self.meta['vocab_size']:,}-token "
                            f"vocabulary; the model's has {vocab_size:,}")
        for k, ((tokens, _), path) in enumerate(zip(self.shards, self.shard_paths)):
            most = np.iinfo(tokens.dtype).max
            if vocab_size - 1 > most:  # Llama 3's ids saved as uint16: the larger ones wrapped, the rest look valid
                raise DataError(f"{self.flag}: {path} holds {tokens.dtype.name} ids (at most {most:,}) but the model's "
                                f"vocabulary has {vocab_size:,} tokens: larger ids wrapped when it was saved; save "
                                f"the ids as uint32, or tokenize with tools/prepare.py prepare")
            largest = check_ids(tokens, vocab_size, path, self.flag)
            recorded = self.meta["shards"][k]["max_token_id"] if self.meta else largest
            if largest != recorded:
                raise DataError(f"{self.flag}: {path} holds ids up to {largest}, but meta.json records "
                                f"{recorded}: the shard changed after prepare (run tools/prepare.py prepare again)")


def check_ids(tokens: np.ndarray, vocab_size: int, path: str, flag: str, chunk: int = 1 << 24) -> int:
    """The largest id, once every id is in [0, vocab_size); in chunks, so a memory-mapped shard is never loaded."""
    largest = -1
    for start in range(0, len(tokens), chunk):
        part = tokens[start:start + chunk]
        lo, hi = int(part.min()), int(part.max())
        if lo < 0 or hi >= vocab_size:
            bad = hi if hi >= vocab_size else lo
            raise DataError(f"{flag}: {path} has token id {bad} at position {start + int(np.argmax(part == bad))}, "
                            f"outside the model's vocabulary [0, {vocab_size}); tokenize with the model's "
                            f"tokenizer (tools/prepare.py prepare)")
        largest = max(largest, hi)
    return largest


def read_meta(folder: str, flag: str) -> dict:
    """meta.json of a prepared folder, checked for what training reads: a torn or hand-edited file is named with
    its problem, never a KeyError mid-setup. Its shards must be in the folder (prepare never writes a link)."""
    meta_path = os.path.join(folder, "meta.json")
    if not os.path.isfile(meta_path):
        raise DataError(f"{flag}: {folder} has no meta.json: not a prepared folder, or its prepare "
                        f"did not finish (run tools/prepare.py prepare again)")
    def bad(problem: str):
        return DataError(f"{flag}: {meta_path} {problem}; run tools/prepare.py prepare again")
    try:
        with open(meta_path, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise bad(f"is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise bad("is not a JSON object")
    if meta.get("format") not in (META_FORMAT, EOS_FORMAT):
        raise bad(f"has format {meta.get('format')!r}, not {META_FORMAT}")
    old = meta["format"] == EOS_FORMAT  # its documents end at eos_id, which it must name
    for key in ("vocab_size", "bos_id", "eos_id"):  # a tokenizer without BOS (Qwen) prepares format 2
        value = meta.get(key)
        if not (isinstance(value, int) and not isinstance(value, bool) or value is None and key == "bos_id" and not old):
            raise bad(f"has no integer {key!r}")
    tokenizer = meta.get("tokenizer")
    if not (isinstance(tokenizer, dict) and all(isinstance(tokenizer.get(k), str) for k in ("path", "kind", "sha256"))):
        raise bad("has no 'tokenizer' with 'path', 'kind' and 'sha256'")
    shards = meta.get("shards")
    if not isinstance(shards, list) or not shards:
        raise bad("lists no shards ('shards' must be a non-empty list)")
    for i, record in enumerate(shards):
        if not (isinstance(record, dict) and isinstance(record.get("tokens"), str)
                and (record.get("mask") is None or isinstance(record["mask"], str))
                and all(isinstance(record.get(k), int) for k in ("n_tokens", "max_token_id"))):
            raise bad(f"shard {i} needs 'tokens' (a file name), 'mask' (a file name or null), "
                      f"'n_tokens' and 'max_token_id' (integers)")
        if not old and not (isinstance(record.get("docs"), str) and isinstance(record.get("n_documents"), int)):
            raise bad(f"shard {i} needs 'docs' (a file name) and 'n_documents' (an integer)")
        for key, name in (("tokens", record["tokens"]), ("mask", record["mask"]), ("docs", record.get("docs"))):
            if name is not None and not is_plain_name(name):
                raise bad(f"shard {i} names {name!r} as its {key} file, which is not a file name in {folder} "
                          f"(a '/' or '..')")
            path, real_folder = os.path.join(folder, name or ""), os.path.realpath(folder)
            real_path = os.path.realpath(path)
            if name and os.path.islink(path) and os.path.commonpath([real_path, real_folder]) != real_folder:
                raise DataError(f"{flag}: {path} is a link to {real_path}, outside {folder}: a prepared folder's "
                                f"shards must be in it (copy the file in)")
    if len({record["mask"] is None for record in shards}) > 1:
        raise bad("has shards with a mask and shards without")
    return meta


def is_plain_name(name) -> bool:
    """A file name from a folder's own JSON (meta.json's shards, a safetensors index's weight_map in hf.py) names
    a file in that folder, which is downloaded and copied: one path component, not '.' or '..', no NUL."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


class Windows:
    """What TokenWindows and MixedWindows share: a micro-batch from `window(position)`."""

    def micro_batch(self, position: int, accum_index: int, rank: int, world: int, micro: int):
        """(inputs, targets, doc_starts) (micro, seq_len): this rank's rows of the global batch at `position`, the m
        windows at P + (j*W + r)*m for rank r; targets a mask excludes are -100; doc_starts True where an input
        token begins a document (--doc_mask's boundaries)."""
        first = position + (accum_index * world + rank) * micro
        rows = [self.window(first + i) for i in range(micro)]
        tokens = np.stack([t for t, _, _ in rows])
        inputs, targets = tokens[:, :-1], tokens[:, 1:].copy()
        for row, (_, mask, _) in enumerate(rows):
            if mask is not None:
                targets[row, mask[1:] == 0] = -100
        doc_starts = np.stack([starts[:-1] for _, _, starts in rows])
        doc_starts[:, 0] = True  # each row starts a document of its own: it sees nothing before it
        return inputs, targets, doc_starts


class TokenWindows(Windows):
    """Windows of `seq_len + 1` tokens in a seeded, per-epoch order (see the module docstring)."""

    def __init__(self, data: TokenData, seq_len: int, seed: int):
        self.data, self.seq_len, self.seed = data, seq_len, seed
        self.n_windows = (len(data) - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"{data.flag}: {data.path} has {len(data)} tokens; at least seq_len + 1 = "
                            f"{seq_len + 1} are needed")
        self._order = (-1, None)  # (epoch, its permutation): one permutation in memory, 8 bytes a window

    def _window_start(self, position: int) -> int:
        epoch, pos = divmod(position, self.n_windows)
        order = self._order  # read and replaced whole: readers on several threads never see a half update
        if order[0] != epoch:
            order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_windows))
            self._order = order
        return int(order[1][pos]) * self.seq_len

    def window(self, position: int):
        return self.data.read(self._window_start(position), self.seq_len + 1)

    def state(self, position: int) -> dict:
        """What a checkpoint stores after `position` windows."""
        return dict(position=position, n_windows=self.n_windows, seq_len=self.seq_len, seed=self.seed,
                    tokens=len(self.data))

    def check_state(self, state: dict) -> int:
        """The position to continue from, if `state` was saved by a loader over the same windows."""
        for key in ("n_windows", "seq_len", "seed", "tokens"):
            if state[key] != self.state(0)[key]:
                raise DataError(f"--data: the checkpoint's data had {key} {state[key]}, this run's has "
                                f"{self.state(0)[key]}: the order would not continue where it stopped")
        return state["position"]


# -- mixing sources: --data fr:0.6,en:0.4 ------------------------------------------------------------------
#
# A fixed schedule, not a random draw: the first n positions hold counts(n)[k] windows of source k, rounded
# source by source (round(n * w0), then round(rest * w1 / (w1 + w2 + ...)), ..., the last the rest). From n to
# n + 1 one count grows: position n is that source's window counts(n)[k], in its own order. A function of n
# alone: the same windows for any W and micro-batch size, and every batch holds each share within a window or two.

def split_source(item: str) -> tuple[str, str]:
    """(path, weight text) of one `PATH[:WEIGHT]`: a path that exists as written keeps its colons."""
    if ":" in item and not os.path.exists(item):
        path, _, weight_text = item.rpartition(":")
        return path, weight_text
    return item, "1"


def parse_sources(spec: str, flag: str) -> list[tuple[str, str, fractions.Fraction]]:
    """[(name, path, weight)] of `PATH[:WEIGHT][,...]` (no weight: 1), named by the folder or the file without
    its extension; a repeated name gets -2, -3, ..."""
    sources, names = [], set()
    for item in spec.split(","):
        path, weight_text = split_source(item)
        if not path.strip():
            raise DataError(f"{flag}: {spec!r} has an empty source (expected PATH[:WEIGHT][,PATH[:WEIGHT]...])")
        try:
            weight = fractions.Fraction(weight_text.strip())
        except (ValueError, ZeroDivisionError):
            weight = None
        if weight is None or weight <= 0:
            raise DataError(f"{flag}: the weight {weight_text!r} of {path} is not a positive number")
        if not os.path.exists(path):
            raise DataError(f"{flag}: {path} does not exist")
        base = os.path.basename(os.path.normpath(path))
        name = base if os.path.isdir(path) else os.path.splitext(base)[0]
        unique, k = name, 1
        while unique in names:
            k += 1
            unique = f"{name}-{k}"
        names.add(unique)
        sources.append((unique, path, weight))
    return sources


def describe_mix(names: list, weights: list) -> str:
    return ",".join(f"{name}:{float(weight):g}" for name, weight in zip(names, weights))


def saved_sources(state: dict) -> list[dict]:
    """A checkpoint's data state's sources; a state from before mixing (no "sources") is one source."""
    return state.get("sources") or [dict(state, name=None, weight="1")]


def mix_mismatch(state: dict, names: list, weights: list) -> str | None:
    """Why a run whose mix is `names` and `weights` cannot continue from the data state `state`, or None."""
    saved = saved_sources(state)
    total = sum(fractions.Fraction(w) for w in weights)
    weights = [fractions.Fraction(w) / total for w in weights]
    saved_weights = [fractions.Fraction(s["weight"]) for s in saved]
    # One source has no mix to change: its folder may have moved (TokenWindows.check_state compares its tokens)
    same_names = len(names) == 1 or all(s["name"] in (None, name) for s, name in zip(saved, names))
    if len(saved) == len(names) and same_names and saved_weights == weights:
        return None
    saved_names = [s["name"] or "(one source)" for s in saved]
    return (f"--data: the checkpoint was trained on the mix {describe_mix(saved_names, saved_weights)}, this run's "
            f"is {describe_mix(names, weights)}: a new mix is a new phase (--init_from the checkpoint starts one "
            f"from its weights)")


class MixedWindows(Windows):
    """The windows of one or more sources (TokenWindows), interleaved by weight (the comment above)."""

    def __init__(self, names: list, sources: list, weights: list):
        self.names, self.sources = names, sources
        total = sum(weights)
        self.weights = [fractions.Fraction(w) / total for w in weights]  # normalised
        denominator = math.lcm(*(w.denominator for w in self.weights))
        self.shares = [int(w * denominator) for w in self.weights]  # integers: exact rounding on any machine
        self.rest = [sum(self.shares[k:]) for k in range(len(self.shares))]
        self.seq_len = sources[0].seq_len

    def counts(self, n: int) -> list[int]:
        """Windows of each source among the first n positions of the mix."""
        out, rest = [], n
        for share, total in zip(self.shares[:-1], self.rest[:-1]):
            count = (rest * share + total // 2) // total
            out.append(count)
            rest -= count
        return out + [rest]

    def source_of(self, position: int) -> tuple[int, int]:
        """(source index, that source's own position) of the window at mix position `position`."""
        before, after = self.counts(position), self.counts(position + 1)
        k = next(k for k in range(len(self.sources)) if after[k] > before[k])  # the one count that grows
        return k, before[k]

    def window(self, position: int):
        k, own_position = self.source_of(position)
        return self.sources[k].window(own_position)

    def progress(self, position: int) -> dict:
        """Windows drawn and epochs per source after `position` windows, for the metrics."""
        counts = self.counts(position)
        return dict(windows_by_source=dict(zip(self.names, counts)),
                    epochs_by_source={n: c / s.n_windows for n, c, s in zip(self.names, counts, self.sources)})

    def losses(self, evaluate) -> dict:
        """{"eval_loss": the weighted mean, "eval_loss/NAME": each source's}, evaluate(source) its mean loss."""
        by_source = [evaluate(source) for source in self.sources]
        if len(by_source) == 1:
            return {"eval_loss": by_source[0]}
        mean = sum(float(w) * loss for w, loss in zip(self.weights, by_source))
        return {"eval_loss": mean, **{f"eval_loss/{n}": loss for n, loss in zip(self.names, by_source)}}

    def state(self, position: int) -> dict:
        """What a checkpoint stores after `position` windows (each source's own position too, for reading)."""
        return dict(position=position, sources=[
            dict(name=name, weight=str(weight), **source.state(count))
            for name, weight, source, count in zip(self.names, self.weights, self.sources, self.counts(position))])

    def check_state(self, state: dict) -> int:
        """The position to continue from, if `state` was saved over the same mix and windows (or one source)."""
        saved = saved_sources(state)
        mismatch = mix_mismatch(state, self.names, self.weights)
        if mismatch:
            raise DataError(mismatch)
        position = state["position"]
        for name, source, s, count in zip(self.names, self.sources, saved, self.counts(position)):
            try:
                source.check_state(dict(s, position=count))
            except DataError as e:
                raise DataError(f"{e} (source {name}: {source.data.path})" if len(saved) > 1 else str(e)) from None
        return position


if __name__ == "__main__":  # the commands that write data are tools/prepare.py's: run it, not imported here
    tool = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools", "prepare.py")
    os.execv(sys.executable, [sys.executable, tool, *sys.argv[1:]])
