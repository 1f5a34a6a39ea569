"""The tokenizer of an --export_hf folder (disk.export_tokenizer): what transformers' AutoTokenizer loads for the
tokenizer that prepared --data. A Hugging Face tokenizer's files are copied; a data.py sentencepiece model is
converted, and checked to encode as sentencepiece does (docs/data.md, "Hugging Face import and export")."""
import json
import os
import shutil
import tempfile

import data as D

# The Llama 3 header format (data.Tokenizer.chat_segments) as a chat template, for the export of a sentencepiece
# tokenizer: a server then renders chats as they were trained.
HEADER_FORMAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
                          "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
                          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# A Hugging Face tokenizer's files: what an export copies from an --init_from folder, when there.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                      "chat_template.jinja", "chat_template.json", "added_tokens.json")
# English, French, chat markup, digits, whitespace runs, symbols, emoji, CJK and a control character: an
# exported tokenizer must encode this exactly as the one that prepared the data (write_hf_tokenizer).
ENCODING_PROBE = ("The lessee shall pay 1,250.00 EUR on the 1st. Le bailleur a résilié le contrat à défaut de "
                  "paiement ; « Où est-il ? » <|start_header_id|>user<|end_header_id|>\n\nBonjour\t  !<|eot_id|> "
                  "x<|eot_id|>y  ☃ ℃ ½ 😀 中文 \x00 \r\n end")


def copy_hf_tokenizer_files(folder: str, out: str) -> list:
    """Copies the HF_TOKENIZER_FILES `folder` has into `out` (contents only: modes follow the umask)."""
    names = [n for n in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]
    for name in names:
        shutil.copyfile(os.path.join(folder, name), os.path.join(out, name))
    return names


def write_hf_tokenizer(path: str, sha256: str, out: str) -> list:
    """Writes into `out` what transformers' AutoTokenizer loads for the tokenizer meta.json records (`path`,
    `sha256`): a Hugging Face tokenizer's files are copied, a sentencepiece model converted. Returns its end ids."""
    if not os.path.exists(path):
        raise D.DataError(f"the tokenizer that prepared --data, {path}, is not there")
    tok = D.Tokenizer(path)
    if tok.sha256 != sha256:
        raise D.DataError(f"{path} has changed since it prepared --data (another SHA-256)")
    if tok.kind == "huggingface":
        copy_hf_tokenizer_files(path if os.path.isdir(path) else os.path.dirname(path), out)
    else:
        sentencepiece_to_hf(tok, out)
    return tok.end_ids()


def sentencepiece_to_hf(tok: D.Tokenizer, out: str):
    """tokenizer.json and tokenizer_config.json for a sentencepiece model, converted by transformers (it needs
    protobuf), with BOS added as prepare adds it and the header format's chat template. A conversion that
    does not encode ENCODING_PROBE as sentencepiece does gives no tokenizer, never a wrong one. The one
    difference left: a literal "<s>" in text is the control token to transformers, text to sentencepiece."""
    from transformers import AutoTokenizer
    sp = tok.sp
    config = {"tokenizer_class": "TokenizersBackend", "bos_token": sp.id_to_piece(sp.bos_id()),
              "eos_token": sp.id_to_piece(sp.eos_id()), "unk_token": sp.id_to_piece(sp.unk_id()),
              "add_bos_token": True, "add_eos_token": False}
    if all(tok.piece_id(t) is not None for t in D.CHAT_TOKENS):
        config["chat_template"] = HEADER_FORMAT_TEMPLATE
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(tok.path, os.path.join(tmp, "tokenizer.model"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump(config, f)
        try:
            hf = AutoTokenizer.from_pretrained(tmp)
        except Exception as e:  # noqa: BLE001 (what fails depends on the transformers version: name it, go on)
            raise D.DataError(f"transformers could not convert {tok.path} ({type(e).__name__}: {e}; it needs the "
                              f"protobuf package)") from None
    if hf(ENCODING_PROBE)["input_ids"] != [sp.bos_id()] + tok.encode([ENCODING_PROBE], True)[0]:
        raise D.DataError(f"transformers' conversion of {tok.path} encodes differently from sentencepiece")
    hf.save_pretrained(out)
