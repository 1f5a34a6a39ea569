"""The tokenizer: a sentencepiece .model or a Hugging Face folder / tokenizer.json, and each family's conventions
(its BOS, its document end, what closes a chat turn, its chat template). A tool: tools/prepare.py tokenizes with it,
tools/export_hf.py converts it, and a run asks it for its --sample_prompts' ids in a subprocess (the `prompts`
command: components/sample.py), never importing it.

    python tools/tokenizer.py prompts --tokenizer TOK < prompts.jsonl

`prompts` reads records (`{"text": ...}` or `{"messages": [...]}`, one a line) on stdin and prints one JSON object:
"prompt_ids" (each record as a prompt to sample from: Tokenizer.prompt_ids), "end_ids" (where generation stops:
Tokenizer.end_ids) and "decoder" ([kind, path]: what decodes the completions, sentencepiece's model file or
transformers' folder). An error is one line on stderr naming the prompt, exit code 2.
"""
import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: data.py
import data as D  # noqa: E402

CHAT_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")  # the header format of our own tokenizers
# What a family's pretraining put after a document (Llama 3; Qwen and GPT-2; Gemma, whose eos_token in an instruct
# tokenizer is <end_of_turn>), found by name; else the eos_token, unless that closes a chat turn (these).
DOC_END_PIECES = ("<|end_of_text|>", "<|endoftext|>", "<eos>")
TURN_END_PIECES = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|eom_id|>")


class Tokenizer:
    """The few things prepare and sampling need from either kind of tokenizer, and the family's conventions:
    `prefix_ids` (what the tokenizer puts before a text: BOS, or nothing, as Qwen), `doc_end_id` (what its
    pretraining put after a document, or None) and `eos_id` (the model's end of text: doc_end_id, else eos)."""

    def __init__(self, path: str, doc_end: str | None = None):
        self.path, self.jinja2_checked = path, False
        if path.endswith(".model") and os.path.isfile(path):
            import sentencepiece as spm
            self.kind, self.sp = "sentencepiece", spm.SentencePieceProcessor(model_file=path)
            self.vocab_size, self.chat_template, self.id_file = self.sp.get_piece_size(), None, path
            self.markup = sentencepiece_markup(self.sp)
            self.prefix_ids, suffix = ([self.sp.bos_id()] if self.sp.bos_id() >= 0 else []), []
            self.eos_token_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
        else:
            folder = path if os.path.isdir(path) else os.path.dirname(path)
            # the ids (the chat template aside): tokenizer.json, or a folder's sentencepiece tokenizer.model alone,
            # which transformers converts (Mistral 7B v0.1's published folder)
            self.id_file = next((os.path.join(folder, name) for name in ("tokenizer.json", "tokenizer.model")
                                 if os.path.isfile(os.path.join(folder, name))), "")
            if not (self.id_file and (os.path.isdir(path) or path.endswith("tokenizer.json"))):
                raise D.DataError(f"--tokenizer: {path} is not a sentencepiece .model, a tokenizer.json, "
                                f"or a folder holding one")
            from transformers import AutoTokenizer
            self.kind, self.hf = "huggingface", AutoTokenizer.from_pretrained(folder)
            self.vocab_size, self.eos_token_id = len(self.hf), self.hf.eos_token_id
            self.chat_template = getattr(self.hf, "chat_template", None)
            self.prefix_ids, suffix = added_around(self.hf("a")["input_ids"], self.encode(["a"], False)[0])
            # what closes a reply (tools/prepare.py's span_targets): read once, at up to 12 ms (Gemma 3's)
            self.special_ids = set(self.hf.all_special_ids) | {
                i for i, t in self.hf.added_tokens_decoder.items() if getattr(t, "special", False)}
        self.bos_id = self.prefix_ids[-1] if self.prefix_ids else None
        self.doc_end_id = self.find_doc_end(doc_end, suffix)
        self.eos_id = self.doc_end_id if self.doc_end_id is not None else self.eos_token_id
        with open(self.id_file, "rb") as f:  # the tokenizer's identity, recorded in meta.json
            self.sha256 = hashlib.sha256(f.read()).hexdigest()

    def find_doc_end(self, doc_end: str | None, suffix: list) -> int | None:
        """--doc_end's token ("none": no token), else the family's document end (DOC_END_PIECES), else what the
        tokenizer appends to a text, else its eos_token unless that closes a chat turn."""
        if doc_end == "none":
            return None
        if doc_end:
            if self.piece_id(doc_end) is None:
                raise D.DataError(f"--doc_end: {doc_end!r} is not a token of --tokenizer {self.path}")
            return self.piece_id(doc_end)
        found = [self.piece_id(p) for p in DOC_END_PIECES if self.piece_id(p) is not None]
        if found or suffix:
            return (found or suffix)[0]
        eos = self.eos_token_id
        return eos if eos is not None and self.piece(eos) not in TURN_END_PIECES else None

    def piece(self, i: int) -> str:
        return self.sp.id_to_piece(i) if self.kind == "sentencepiece" else self.hf.convert_ids_to_tokens(i)

    def encode(self, texts: list, specials: bool) -> list:
        """Token ids of each text, nothing added. `specials=False` reads a literal "<|eot_id|>" as text, so a
        document can never forge a control token; only chat markup is encoded with True."""
        if self.kind == "sentencepiece":
            ids = self.sp.encode(texts, num_threads=1)
            if specials or not self.markup:
                return ids
            return [self.spell_markup(t) if self.markup.search(t) else x for t, x in zip(texts, ids)]
        return self.hf(texts, add_special_tokens=False, split_special_tokens=not specials)["input_ids"]

    def spell_markup(self, text: str) -> list:
        """Sentencepiece matches its user-defined pieces (<|eot_id|>) in any text: a marker in a document is
        encoded one character at a time instead, which decodes to the same text."""
        ids = []
        for part in self.markup.split(text):  # the markers are kept, at odd indices
            is_marker = self.markup.fullmatch(part) is not None
            ids += [i for c in part for i in self.sp.encode(c)] if is_marker else self.sp.encode(part)
        return ids

    def piece_id(self, piece: str) -> int | None:
        """The id of a token spelled `piece` (a chat marker), or None when the vocabulary has none."""
        if self.kind == "sentencepiece":
            i = self.sp.piece_to_id(piece)
            return None if i == self.sp.unk_id() and piece != self.sp.id_to_piece(i) else i
        return self.hf.get_vocab().get(piece)

    def end_ids(self) -> list:
        """Where generation stops: the model's end of text, the tokenizer's eos_token, and the markers that close a
        chat turn which its template writes (<|im_end|>, <|eot_id|>, <end_of_turn>; the header format's <|eot_id|>)."""
        template = self.chat_template or "".join(CHAT_TOKENS)
        turns = [self.piece_id(p) for p in TURN_END_PIECES if p in template]
        return list(dict.fromkeys(i for i in [self.eos_id, self.eos_token_id, *turns] if i is not None))

    def decode(self, ids) -> str:
        return self.sp.decode(list(ids)) if self.kind == "sentencepiece" else self.hf.decode(list(ids))

    def missing_bos(self, ids: list) -> list:
        """The BOS a rendering needs in front: the tokenizer's, unless the rendering already begins with it (never
        doubled; none for a tokenizer without one)."""
        return self.prefix_ids if ids[:len(self.prefix_ids)] != self.prefix_ids else []

    def header_format_ids(self, messages: list) -> tuple[list, list]:
        """The Llama 3 header format (export_hf.HEADER_FORMAT_TEMPLATE) for a tokenizer without a template:
        BOS, then per message a header, its content and <|eot_id|>; markup only is encoded with special tokens."""
        ids, targets = list(self.prefix_ids), [0] * len(self.prefix_ids)
        for m in messages:
            target = int(m["role"] == "assistant")
            for text, is_target, markup in (("<|start_header_id|>", 0, True), (m["role"], 0, False),
                                            ("<|end_header_id|>\n\n", 0, True), (m["content"], target, False),
                                            ("<|eot_id|>", target, True)):
                piece = self.encode([text], markup)[0]
                ids, targets = ids + piece, targets + [is_target] * len(piece)
        return ids, targets

    def prompt_ids(self, record: dict) -> list:
        """A prompt to sample from: a text as a prepared document starts; a chat rendered for a reply (as
        apply_chat_template(add_generation_prompt=True) encodes it, else in the header format prepare writes)."""
        if "text" in record:
            return self.prefix_ids + self.encode([record["text"]], specials=False)[0]
        if self.chat_template:
            ids = self.encode([self.render_chat(record["messages"], add_generation_prompt=True)], specials=True)[0]
            return self.missing_bos(ids) + ids
        # the header of a reply: an empty assistant message's ids without its content and end of turn
        ids, _ = self.header_format_ids(record["messages"] + [{"role": "assistant", "content": ""}])
        return ids[:-len(self.encode(["<|eot_id|>"], True)[0])]

    def render_chat(self, messages: list, add_generation_prompt: bool = False) -> str:
        """The chat template's text: code that comes with the tokenizer, run in jinja2's sandbox, so whatever
        it raises is this chat's error, one line."""
        if not self.jinja2_checked:
            check_jinja2(importlib.metadata.version("jinja2"))
            self.jinja2_checked = True
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 (any error of the template's code)
            why = " ".join(f"{type(e).__name__}: {e}".split())
            raise D.DataError(f"the chat template of {self.path} failed on this chat ({why})") from None


def added_around(with_specials: list, plain: list) -> tuple[list, list]:
    """(what a tokenizer adds before a text, what after): `with_specials` is its encoding of a text with them,
    `plain` without."""
    for k in range(len(with_specials) - len(plain) + 1):
        if with_specials[k:k + len(plain)] == plain:
            return with_specials[:k], with_specials[k + len(plain):]
    return [], []


def version_tuple(version: str) -> tuple:
    """(major, minor, patch) of a release's version string (jinja2's)."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def check_jinja2(version: str):
    """Releases of jinja2 before 3.1.6 let a chat template escape the sandbox (CVE-2024-56326, CVE-2025-27516):
    an older one already installed is refused before the first template is rendered rather than trusted."""
    if version_tuple(version) < (3, 1, 6):
        raise D.DataError(f"chat templates need jinja2 >= 3.1.6 (this is {version}, whose sandbox a "
                        f"template can escape); pip install 'jinja2>=3.1.6'")


def sentencepiece_markup(sp):
    """A pattern matching the markup pieces (<|eot_id|>, <start_of_turn>, ...) of a sentencepiece model, or
    None. Its Python API does not say which pieces are user-defined (matched in any text): every normal
    piece of the form <...> is taken for one."""
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())
              if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i))]
    markup = sorted((p for p in pieces if len(p) > 2 and p.startswith("<") and p.endswith(">")), key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, markup)) + ")") if markup else None


# -- the command a run asks: its prompts' ids ---------------------------------------------------------------

def prompts_answer(tok: Tokenizer, lines) -> dict:
    """The `prompts` command's JSON (the module docstring) for the records on `lines`; an error names the prompt
    (its place among the non-blank lines, as the run counts its --sample_prompts)."""
    prompt_ids = []
    for n, raw in enumerate((line for line in lines if line.strip()), 1):
        record = D.parse_record(raw, f"prompt {n}", is_txt=False, trains=False)
        try:
            prompt_ids.append(tok.prompt_ids(record))
        except D.DataError as e:
            raise D.DataError(f"prompt {n}: {e}") from None
    decoder = [tok.kind, tok.path if tok.kind == "sentencepiece" else os.path.dirname(tok.id_file)]
    return dict(prompt_ids=prompt_ids, end_ids=tok.end_ids(), decoder=decoder)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prompts", help="the ids of the prompts on stdin (.jsonl), their end ids and decoder, as JSON")
    p.add_argument("--tokenizer", required=True, help="a sentencepiece .model, a tokenizer.json, or an HF folder")
    args = parser.parse_args(argv)
    try:
        print(json.dumps(prompts_answer(Tokenizer(args.tokenizer), sys.stdin.buffer)))
    except D.DataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
