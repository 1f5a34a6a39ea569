"""The data tool: tokenize and pack corpora into the prepared folders a run reads (data.py), and train a
sentencepiece tokenizer on your text. The trainer never imports this file.

    python tools/prepare.py train-tokenizer --input a.txt b.jsonl --vocab_size 32000 --out tok.model
    python tools/prepare.py prepare --input corpus/*.jsonl --tokenizer /models/Llama-3.1-8B-Instruct \\
        --out data/ --workers 8

Inputs: `.txt` (a document per file), `.jsonl` of `{"text": ...}` or of chats `{"messages": [{"role": ...,
"content": ...}, ...]}` (a document per line). Output: token shards, each with the positions where its documents
start (a text is the family's BOS + tokens + document end; a chat is its template's rendering, as is), a loss mask
for chats (each assistant reply and the marker that closes it), and meta.json, written last. The format in full:
docs/data.md.
"""

import argparse
import bisect
import collections
import concurrent.futures
import itertools
import json
import multiprocessing
import os
import re
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: data.py, tools/
import data as D  # noqa: E402
from tools import tokenizer as TK  # noqa: E402


# -- a tokenizer of your own ----------------------------------------------------------------------------

def train_tokenizer(inputs: list, vocab_size: int, out: str):
    """A sentencepiece BPE model. Byte fallback: any UTF-8 encodes without <unk>; identity normalization and
    no dummy prefix: decode(encode(text)) == text, also piece by piece; the chat markers are single pieces."""
    import sentencepiece as spm
    if not out.endswith(".model"):
        raise D.DataError(f"--out: {out} must end in .model")
    if vocab_size < 1:
        raise D.DataError(f"--vocab_size: must be >= 1, got {vocab_size}")
    def lines():  # sentencepiece drops "sentences" over 4 KB: feed it lines, not whole documents
        for _, doc in parse_records(read_records(inputs, collections.Counter()), False, collections.Counter()):
            for text in [doc["text"]] if "text" in doc else [m["content"] for m in doc["messages"]]:
                yield from (line for line in text.split("\n") if line.strip())
    prefix = out[:-len(".model")] + ".tmp"  # the model records its prefix: no pid, so re-runs are identical
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines(), model_prefix=prefix, vocab_size=vocab_size, model_type="bpe",
            byte_fallback=True, character_coverage=0.9995, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            user_defined_symbols=list(TK.CHAT_TOKENS), normalization_rule_name="identity",
            remove_extra_whitespaces=False, add_dummy_prefix=False, split_digits=True, num_threads=1, minloglevel=2)
    except RuntimeError as e:  # a failed check in sentencepiece's C++
        raise D.DataError(sentencepiece_error(str(e), vocab_size)) from None
    os.replace(prefix + ".model", out)
    os.remove(prefix + ".vocab")


def sentencepiece_error(message: str, vocab_size: int) -> str:
    """sentencepiece's training error (its C++ source line, then the reason) as one line naming the flag."""
    reason = message.rsplit("] ", 1)[-1].strip()
    too_many = re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", reason)
    if too_many:
        return (f"--vocab_size: {vocab_size:,} is more pieces than --input yields; at most {too_many[1]} can be "
                f"learned from it (use --vocab_size {too_many[1]} or less, or give more text)")
    too_few = re.search(r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)", reason)
    if too_few:
        return (f"--vocab_size: {vocab_size:,} is fewer pieces than --input's characters, the 256 byte pieces and "
                f"the markers need ({too_few[1]}); use --vocab_size {too_few[1]} or more")
    return f"--input: sentencepiece could not train a tokenizer: {reason or message}"


# -- reading inputs: documents in input order, one at a time, bad ones named by file and line -------------

def read_records(inputs: list, counts: collections.Counter, max_document_mb: float = 64):
    """(path, line number, raw bytes) of every document in input order (a .txt file is line 0), unparsed: the
    workers parse. A document over `max_document_mb` is refused before it is read whole."""
    max_bytes = int(max_document_mb * (1 << 20))
    def too_large(where: str):
        return D.DataError(f"{where}: a document over --max_document_mb {max_document_mb:g} MB; split it into "
                           f"smaller documents, or raise the limit")
    for path in inputs:
        if not os.path.isfile(path):
            raise D.DataError(f"--input: {path} does not exist")
        if not path.endswith((".txt", ".jsonl")):
            raise D.DataError(f"--input: {path}: expected a .txt or .jsonl file")
    for path in inputs:
        with open(path, "rb") as f:
            if path.endswith(".txt"):
                if os.path.getsize(path) > max_bytes:
                    raise too_large(path)
                raw = f.read()
                counts["bytes_read"] += len(raw)
                yield path, 0, raw
                continue
            for n, line in enumerate(iter(lambda: f.readline(max_bytes + 1), b""), 1):
                if len(line.rstrip(b"\r\n")) > max_bytes:  # cut short at max_bytes + 1
                    raise too_large(f"{path}:{n}")
                counts["bytes_read"] += len(line)
                if line.strip():
                    yield path, n, line


def parse_records(records, skip_bad: bool, counts: collections.Counter):
    """(where, document) from raw records; a bad one raises (naming file:line) or, with skip_bad, is counted."""
    for path, n, raw in records:
        where = f"{path}:{n}" if n else path
        try:
            yield where, D.parse_record(raw, where, is_txt=not n)
        except D.DataError:
            if not skip_bad:
                raise
            counts["skipped_bad"] += 1


# -- a document's ids and targets: a text as the family's pretraining saw one, a chat as its template renders it ---

PLACEHOLDER = "\x00{}\x00"  # rendered in message i's place to find where its content goes
GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def check_plain_text(tok: TK.Tokenizer):
    """Packed plain-text documents need a token between them that the model was taught to read as one."""
    if not tok.prefix_ids and tok.doc_end_id is None:
        eos = f"; its eos_token {tok.piece(tok.eos_token_id)!r} closes a chat turn" if tok.eos_token_id is not None else ""
        raise D.DataError(f"--tokenizer: {tok.path} has neither a BOS nor a document-end token{eos}, so packed "
                          f"plain-text documents would run into each other: name the token its pretraining put "
                          f"after a document with --doc_end TOKEN (or --doc_end none to pack them bare)")


def text_ids(tok: TK.Tokenizer, texts: list) -> list:
    """Each plain-text document as the family's pretraining saw one: its BOS (if any), tokens, its end (if any)."""
    end = [tok.doc_end_id] if tok.doc_end_id is not None else []
    return [tok.prefix_ids + ids + end for ids in tok.encode(texts, specials=False)]


def chat_ids(tok: TK.Tokenizer, messages: list) -> tuple[list, list]:
    """(ids, targets) of one conversation, rendered whole by its chat template (else the header format) and
    stored as rendered; targets are 1 on each assistant turn's content and the marker that closes it."""
    if not tok.chat_template:
        return tok.header_format_ids(messages)
    for m in messages:
        if tok.encode([m["role"]], True) != tok.encode([m["role"]], False):  # the role is inside markup
            raise D.DataError(f"a chat message's role {m['role']!r} holds a control token of --tokenizer {tok.path}")
    text = tok.render_chat(messages)
    spans = content_spans(tok, messages, text)
    for i, (m, span) in enumerate(zip(messages, spans)):
        if m["role"] == "assistant" and m["content"].strip() and span is None:
            raise D.DataError(f"message {i + 1} (assistant): the chat template of {tok.path} drops or rewrites its "
                              f"content, so its reply cannot be found in the rendering to be trained on")
    found = [span for span in spans if span is not None]
    # One encode of the whole rendering gives exactly apply_chat_template's ids; a control token typed inside a
    # message is kept as text instead: then the markup and each message's content are encoded apart.
    contents = [text[lo:hi] for lo, hi in found]
    forged = contents and tok.encode(contents, True) != tok.encode(contents, False)
    cuts = sorted({0, len(text), *(x for span in found for x in span)}) if forged else [0, len(text)]
    ids, starts = [], []
    for lo, hi in zip(cuts, cuts[1:]):
        enc = tok.hf(text[lo:hi], add_special_tokens=False, split_special_tokens=(lo, hi) in found,
                     return_offsets_mapping=True)
        ids += enc["input_ids"]
        starts += [lo + a for a, _ in enc["offset_mapping"]]
    if GENERATION_TAG.search(tok.chat_template):  # the template marks the replies itself, closers included
        targets = span_targets(tok, ids, starts, generation_spans(tok, messages, text), closed=False)
    else:
        replies = [span for m, span in zip(messages, spans) if span and m["role"] == "assistant"]
        targets = span_targets(tok, ids, starts, replies, closed=True)
    bos = tok.missing_bos(ids)
    return bos + ids, [0] * len(bos) + targets


def span_targets(tok: TK.Tokenizer, ids: list, starts: list, spans: list, closed: bool) -> list:
    """1 for each token that starts inside a span, and (`closed`) the markup after it up to and including
    its first control token (<|im_end|>, <|eot_id|>, <end_of_turn>, </s>): what ends the reply is learned."""
    targets = [0] * len(ids)
    for lo, hi in spans:
        k = bisect.bisect_left(starts, lo)
        while k < len(ids) and starts[k] < hi:
            targets[k], k = 1, k + 1
        j = k
        while closed and j < len(ids) and ids[j] not in tok.special_ids:
            j += 1
        if closed and j < len(ids) and tok.decode(ids[k:j]).strip() == "":
            targets[k:j + 1] = [1] * (j + 1 - k)
    return targets


def content_spans(tok: TK.Tokenizer, messages: list, text: str) -> list:
    """(start, end) of each message's content in the whole rendering `text`, None where it is not there.
    Rendering a placeholder in each message's place gives the markup around the contents exactly (the content
    itself may also occur in the markup: a reply "user"); where the template changes its markup with the
    content, each content is found in order instead."""
    probe = tok.render_chat([dict(m, content=PLACEHOLDER.format(i)) for i, m in enumerate(messages)])
    parts = re.split("\x00(\\d+)\x00", probe)  # markup, index, markup, index, ..., markup
    order = [int(i) for i in parts[1::2]]
    spans, cursor = [None] * len(messages), 0
    if order == sorted(set(order)):
        for k, markup in enumerate(parts[0::2]):
            if not text.startswith(markup, cursor):
                break
            cursor += len(markup)
            if k == len(order):
                return spans if cursor == len(text) else find_contents(messages, text)
            i, after = order[k], parts[2 * k + 2]
            content = next((c for c in trimmed(messages[i]["content"])
                            if text.startswith(c, cursor) and text.startswith(after, cursor + len(c))), None)
            if content is None:
                break
            spans[i], cursor = (cursor, cursor + len(content)), cursor + len(content)
    return find_contents(messages, text)


def find_contents(messages: list, text: str) -> list:
    """Each message's content (or its trimmed form) found in order in `text`, None where it is not."""
    spans, cursor = [], 0
    for m in messages:
        hits = [(text.find(c, cursor), c) for c in trimmed(m["content"]) if c]
        hits = [(at, c) for at, c in hits if at >= 0]
        if not hits:
            spans.append(None)
            continue
        at, c = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
        spans.append((at, at + len(c)))
        cursor = at + len(c)
    return spans


def trimmed(content: str) -> list:
    """A message's content as a template may print it: whole, or trimmed as templates do (`| trim`, strip)."""
    return list(dict.fromkeys([content, content.strip(), content.strip("\n"), content.lstrip(), content.rstrip()]))


def generation_spans(tok: TK.Tokenizer, messages: list, text: str) -> list:
    """The character spans of `text` (the rendering) that the template's own {% generation %} blocks mark, as
    transformers finds them for apply_chat_template(return_assistant_tokens_mask=True)."""
    from transformers.utils.chat_template_utils import render_jinja_template
    try:
        rendered, indices = render_jinja_template(conversations=[messages], chat_template=tok.chat_template,
                                                  return_assistant_tokens_mask=True, **tok.hf.special_tokens_map)
    except Exception as e:  # noqa: BLE001 (any error of the template's code)
        raise D.DataError(f"the chat template of {tok.path} failed on this chat ({type(e).__name__}: {e})") from None
    if rendered[0] != text or not indices[0]:
        raise D.DataError(f"the {{% generation %}} blocks of {tok.path}'s chat template mark no reply in this chat")
    return [tuple(span) for span in indices[0]]


# -- prepare: tokenize in worker processes, write shards in input order -----------------------------------

_worker_tokenizer = None


def _init_worker(tokenizer_path: str, doc_end: str | None):
    global _worker_tokenizer
    _worker_tokenizer = TK.Tokenizer(tokenizer_path, doc_end)


def encode_batch(records: list, with_mask: bool, skip_bad: bool, tok: TK.Tokenizer | None = None):
    """Parse and tokenize a batch of raw records (a worker's job). Returns the documents' tokens (a text as
    text_ids writes it, a chat as chat_ids renders it), their mask when with_mask (a text's tokens
    are all targets, a chat's its assistant replies), each kept document's length, and the counts kept and skipped."""
    tok = tok or _worker_tokenizer
    counts = collections.Counter()
    docs = list(parse_records(records, skip_bad, counts))
    encoded = [None] * len(docs)  # (ids, targets: None for all) of each document, None if skipped
    texts = [i for i, (_, doc) in enumerate(docs) if "text" in doc]
    for i, ids in zip(texts, text_ids(tok, [docs[i][1]["text"] for i in texts]) if texts else []):
        encoded[i] = ids, None
    for i, (where, doc) in enumerate(docs):
        if "text" in doc:
            continue
        if not with_mask:
            raise D.DataError(f"{where}: a chat, but the first record of every input is plain text, so no "
                              f"loss mask is being written; give chats their own .jsonl file")
        try:
            encoded[i] = chat_ids(tok, doc["messages"])
        except D.DataError as e:
            if not skip_bad:
                raise D.DataError(f"{where}: {e}") from None
            counts["skipped_bad"] += 1
    for (where, _), enc in zip(docs, encoded):  # an id the model will not have: never write it
        if enc and enc[0] and max(enc[0]) >= tok.vocab_size:
            raise D.DataError(f"{where}: --tokenizer {tok.path} encodes it to id {max(enc[0])}, outside its own "
                              f"vocabulary [0, {tok.vocab_size})")
    kept = [enc for enc in encoded if enc is not None]
    lengths = [len(ids) for ids, _ in kept]
    tokens = np.fromiter(itertools.chain.from_iterable(ids for ids, _ in kept), dtype=np.uint32, count=sum(lengths))
    mask = None
    if with_mask:
        mask = np.fromiter(itertools.chain.from_iterable([1] * len(ids) if targets is None else targets
                                                         for ids, targets in kept), dtype=np.uint8, count=sum(lengths))
    return tokens, mask, lengths, counts["skipped_bad"]


def is_chat_input(path: str) -> bool:
    """Whether a .jsonl file holds chats, from its first record (chat files need a loss mask)."""
    if not path.endswith(".jsonl"):
        return False
    with open(path, "rb") as f:
        first = next((line for line in f if line.strip()), b"{}")
    try:
        record = json.loads(first)
    except (ValueError, UnicodeDecodeError):
        return False  # the workers report it with its line number
    return isinstance(record, dict) and "messages" in record


def batches_of(records, max_records: int = 256, max_bytes: int = 1 << 20):
    """Records grouped for the workers: big enough to amortize the hand-off, small enough to stream."""
    batch, size = [], 0
    for record in records:
        batch.append(record)
        size += len(record[2])
        if len(batch) >= max_records or size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def write_atomic(path: str, write):
    """A file appears under its name only once complete: `write(f)` elsewhere, fsync, rename."""
    with open(path + ".tmp", "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


class ShardWriter:
    """Cuts the token stream into shards of exactly `shard_tokens` (the last one shorter); beside each, where the
    documents that start in it start (docs-*.npy: positions within the shard, as Megatron's document index)."""

    def __init__(self, out: str, dtype, shard_tokens: int, with_mask: bool):
        self.out, self.dtype, self.shard_tokens, self.with_mask = out, dtype, shard_tokens, with_mask
        self.tokens, self.masks, self.n_buffered, self.shards = [], [], 0, []
        self.written, self.doc_starts = 0, []  # tokens in shards so far; starts (absolute) not yet written

    def add(self, tokens: np.ndarray, mask, lengths: list):
        if len(tokens) and int(tokens.max()) > np.iinfo(self.dtype).max:  # astype would wrap it silently
            raise D.DataError(f"--out: token id {int(tokens.max())} does not fit the shards' "
                              f"{np.dtype(self.dtype).name}; the tokenizer's vocabulary is larger than it says")
        first = self.written + self.n_buffered
        self.doc_starts += (first + np.cumsum([0] + lengths[:-1])).tolist() if lengths else []
        self.tokens.append(tokens.astype(self.dtype))
        self.masks.append(mask)
        self.n_buffered += len(tokens)
        while self.n_buffered >= self.shard_tokens:
            self.write(self.shard_tokens)

    def write(self, n: int):
        tokens = np.concatenate(self.tokens)
        name = f"tokens-{len(self.shards):05d}.npy"
        write_atomic(os.path.join(self.out, name), lambda f: np.save(f, tokens[:n]))
        inside = bisect.bisect_left(self.doc_starts, self.written + n)  # sorted: the starts in this shard come first
        starts = np.array(self.doc_starts[:inside], dtype=np.int64) - self.written
        del self.doc_starts[:inside]
        docs = name.replace("tokens-", "docs-")
        write_atomic(os.path.join(self.out, docs), lambda f: np.save(f, starts))
        record = dict(tokens=name, mask=None, docs=docs, n_tokens=int(n), n_documents=len(starts),
                      max_token_id=int(tokens[:n].max()))
        if self.with_mask:
            mask, record["mask"] = np.concatenate(self.masks), name.replace("tokens-", "mask-")
            write_atomic(os.path.join(self.out, record["mask"]), lambda f: np.save(f, mask[:n]))
            self.masks = [mask[n:]]
        self.tokens, self.n_buffered, self.written = [tokens[n:]], len(tokens) - n, self.written + n
        self.shards.append(record)

    def close(self):
        if self.n_buffered:
            self.write(self.n_buffered)


def show_progress(counts, total_bytes: int, t0: float, state: dict, final: bool = False):
    """One status line on stderr: redrawn in place on a terminal, every 10 s in a log file."""
    now, tty = time.perf_counter(), sys.stderr.isatty()
    if not final and now - state.get("last", t0) < (0.5 if tty else 10.0):
        return
    state["last"] = now
    line = (f"prepare: {counts['documents']:,} documents | {counts['tokens']:,} tokens | "
            f"{counts['tokens'] / max(now - t0, 1e-9):,.0f} tokens/s | "
            f"{100 * counts['bytes_read'] / max(total_bytes, 1):.0f}% of input read")
    print(("\r" if tty else "") + line, end="\n" if final or not tty else "", file=sys.stderr, flush=True)


def prepare(inputs: list, tokenizer: str, out: str, workers: int = 1, skip_bad: bool = False,
            overwrite: bool = False, shard_tokens: int = 100_000_000, quiet: bool = False,
            max_document_mb: float = 64, doc_end: str | None = None) -> dict:
    """Tokenizes `inputs` into shards under `out`, in input order whatever `workers` is; returns meta.json's content."""
    tok = TK.Tokenizer(tokenizer, doc_end)
    if tok.eos_id is None:
        raise D.DataError(f"--tokenizer: {tokenizer} has no end-of-text token (no eos_token and no document end); "
                          f"name one with --doc_end TOKEN")
    for path in inputs:
        if not os.path.isfile(path):
            raise D.DataError(f"--input: {path} does not exist")
    if workers < 1 or shard_tokens < 1 or max_document_mb <= 0:
        raise D.DataError("--workers and --shard_tokens must be >= 1, --max_document_mb > 0")
    if os.path.isdir(out) and os.listdir(out):
        if not overwrite:
            raise D.DataError(f"--out: {out} is not empty; --overwrite true replaces a prepared folder")
        if os.path.exists(os.path.join(out, "meta.json")):
            os.remove(os.path.join(out, "meta.json"))  # first: from here on the folder is incomplete
        for name in os.listdir(out):
            if name.startswith(("tokens-", "mask-", "docs-")) and name.endswith((".npy", ".tmp")):
                os.remove(os.path.join(out, name))
    os.makedirs(out, exist_ok=True)
    with_mask = any(is_chat_input(p) for p in inputs)
    if not all(is_chat_input(p) for p in inputs):
        check_plain_text(tok)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    writer = ShardWriter(out, dtype, shard_tokens, with_mask)
    counts, state, t0 = collections.Counter(), {}, time.perf_counter()
    total_bytes = sum(os.path.getsize(p) for p in inputs)
    batches = batches_of(read_records(inputs, counts, max_document_mb))
    if workers == 1:
        results, pool = (encode_batch(b, with_mask, skip_bad, tok) for b in batches), None
    else:  # fork: workers start in milliseconds; each loads its own tokenizer. Not multiprocessing.Pool:
        # it replaces a worker that dies (killed for memory) and waits forever for the batch it held.
        pool = concurrent.futures.ProcessPoolExecutor(workers, multiprocessing.get_context("fork"),
                                                      _init_worker, (tokenizer, doc_end))
        results = ordered_results(pool, batches, with_mask, skip_bad, max_in_flight=2 * workers)
    try:
        for tokens, mask, lengths, skipped in results:
            writer.add(tokens, mask, lengths)
            counts["documents"] += len(lengths)
            counts["skipped_bad"] += skipped
            counts["tokens"] += len(tokens)
            counts["target_tokens"] += int(mask.sum()) if mask is not None else len(tokens)
            if not quiet:
                show_progress(counts, total_bytes, t0, state)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)  # at most the batches already being tokenized
    if counts["documents"] == 0:
        raise D.DataError(f"--input: no documents in {', '.join(inputs)}")
    writer.close()
    meta = dict(format=D.META_FORMAT, vocab_size=tok.vocab_size, bos_id=tok.bos_id, eos_id=tok.eos_id,
                doc_end_id=tok.doc_end_id, dtype=np.dtype(dtype).name, documents=counts["documents"],
                tokens=counts["tokens"], target_tokens=counts["target_tokens"], skipped_bad=counts["skipped_bad"],
                convention=("documents start where each shard's docs file says (positions within the shard); a "
                            "text is its BOS (bos_id, if any) + tokens + its end (doc_end_id, if any), a chat its "
                            "template's rendering as is; eos_id is the model's end of text"),
                tokenizer=dict(path=tokenizer, kind=tok.kind, sha256=tok.sha256),
                inputs=list(inputs), shards=writer.shards)
    # last: its presence means the folder is complete
    write_atomic(os.path.join(out, "meta.json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))
    if not quiet:
        show_progress(counts, total_bytes, t0, state, final=True)
    return meta


def ordered_results(pool, batches, with_mask: bool, skip_bad: bool, max_in_flight: int):
    """Results in submission order, at most `max_in_flight` batches queued (Pool.imap would queue the corpus)."""
    in_flight = collections.deque()
    for batch in batches:
        in_flight.append((batch, pool.submit(encode_batch, batch, with_mask, skip_bad)))
        if len(in_flight) >= max_in_flight:
            yield batch_result(*in_flight.popleft())
    while in_flight:
        yield batch_result(*in_flight.popleft())


def batch_result(batch: list, future):
    """A worker's result; a worker that died (SIGKILL, the OOM killer) is an error, never a hang."""
    try:
        return future.result()
    except concurrent.futures.process.BrokenProcessPool:
        path, n, _ = batch[0]
        raise D.DataError(f"--workers: a worker process died (killed, perhaps for memory) while tokenizing "
                          f"{path}:{n} or after it; nothing is finished (no meta.json): run prepare again, "
                          f"with fewer --workers if memory is short") from None


# -- command line ----------------------------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train-tokenizer", help="train a sentencepiece BPE tokenizer (byte fallback)")
    p.add_argument("--input", nargs="+", required=True)
    p.add_argument("--vocab_size", type=int, required=True, help="pieces (the error says how many a corpus yields)")
    p.add_argument("--out", required=True, help="PATH.model")
    p = sub.add_parser("prepare", help="tokenize and pack into .npy shards + meta.json")
    p.add_argument("--input", nargs="+", required=True)
    p.add_argument("--tokenizer", required=True, help="a sentencepiece .model, a tokenizer.json, or an HF folder")
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--skip_bad", action="store_true", help="skip and count bad documents instead of stopping")
    p.add_argument("--overwrite", action="store_true", help="replace the prepared folder at --out")
    p.add_argument("--shard_tokens", type=int, default=100_000_000)
    p.add_argument("--max_document_mb", type=float, default=64, help="refuse a document larger than this")
    p.add_argument("--doc_end", default=None, help="the token after each plain-text document (default: the family's, "
                   "<|end_of_text|>, <|endoftext|> or a non-chat eos_token); 'none' for no token")
    args = parser.parse_args(argv)
    try:
        if args.command == "train-tokenizer":
            train_tokenizer(args.input, args.vocab_size, args.out)
            print(f"wrote {args.out} ({args.vocab_size:,} pieces)", file=sys.stderr)
        else:
            meta = prepare(args.input, args.tokenizer, args.out, args.workers, args.skip_bad, args.overwrite,
                           args.shard_tokens, max_document_mb=args.max_document_mb, doc_end=args.doc_end)
            print(f"wrote {len(meta['shards'])} shard(s) to {args.out}: {meta['documents']:,} documents, "
                  f"{meta['tokens']:,} tokens, {meta['skipped_bad']:,} bad documents skipped", file=sys.stderr)
    except D.DataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
