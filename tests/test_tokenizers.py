"""Every family's own tokenizer and chat template, on the files its publisher ships (tests/published_tokenizers.py:
Llama 3.1 Instruct, Qwen3, Gemma 3, Mistral Instruct v0.1, and a ChatML tokenizer whose BOS and EOS are the chat
markers). For each: a chat's prepared ids are apply_chat_template's for the whole conversation, its targets exactly
the replies and the markers that close them, plain text round-trips with the family's BOS and document end, and a
marker typed inside a message stays text. Then one family through prepare: Qwen3, whose tokenizer has no BOS."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from common import ROOT

import data as D
from tools import prepare as prep
from tools import tokenizer as TK
import published_tokenizers

# family: (the marker that closes a reply, what follows a plain-text document, whether a text starts with BOS)
FAMILIES = {
    "llama3_1": ("<|eot_id|>", "<|end_of_text|>", True),
    "qwen3": ("<|im_end|>", "<|endoftext|>", False),
    "chatml": ("<|im_end|>", "<|endoftext|>", False),
    "mistral": ("</s>", "</s>", True),
    "gemma3": ("<end_of_turn>", "<eos>", True),
}
ONE_TURN = [{"role": "user", "content": "Qu'est-ce qu'un bail commercial ?"},
            {"role": "assistant", "content": "Un contrat de location de locaux professionnels."}]
MULTI_TURN = ONE_TURN + [{"role": "user", "content": "And in English, briefly?"},
                         {"role": "assistant", "content": "A lease of business premises."},
                         {"role": "user", "content": "Merci."},
                         {"role": "assistant", "content": "Avec plaisir !"}]
WITH_SYSTEM = [{"role": "system", "content": "Tu es un juriste."}] + MULTI_TURN  # not Mistral v0.1's: it refuses one
TEXT = "Le preneur paie le loyer le 1er de chaque mois. The lessee pays 1,250.00 EUR. 😀"


def tokenizer(name: str) -> TK.Tokenizer:
    folder = published_tokenizers.folder(name)
    if folder is None:  # outside CI only: published_tokenizers.folder raises under CI
        pytest.skip(f"the published {name} tokenizer could not be fetched (python3 tests/published_tokenizers.py fetch)")
    return TK.Tokenizer(folder)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param, tokenizer(request.param)


def chats(name: str) -> list:
    return [ONE_TURN, MULTI_TURN] + ([] if name == "mistral" else [WITH_SYSTEM])


def reply_runs(ids: list, targets: list, tok: TK.Tokenizer) -> list:
    """The decoded text of each run of consecutive target tokens."""
    runs, current = [], []
    for i, target in zip(ids + [None], targets + [0]):
        if target:
            current.append(i)
        elif current:
            runs, current = runs + [tok.decode(current)], []
    return runs


def test_a_chat_is_stored_as_its_template_renders_the_whole_conversation(family):
    name, tok = family
    for chat in chats(name):
        ids, targets = prep.chat_ids(tok, chat)
        expected = tok.hf.apply_chat_template(chat, tokenize=True, return_dict=False)
        assert ids == list(expected), name
        assert len(targets) == len(ids)
        # nothing added: BOS only where the template writes one, never doubled; no document end after a chat
        assert ids.count(tok.bos_id) == (1 if FAMILIES[name][2] else 0) if tok.bos_id is not None else True


def test_the_targets_are_exactly_each_reply_and_the_marker_that_closes_it(family):
    name, tok = family
    closer = FAMILIES[name][0]
    for chat in chats(name):
        ids, targets = prep.chat_ids(tok, chat)
        replies = [m["content"] for m in chat if m["role"] == "assistant"]
        runs = reply_runs(ids, targets, tok)
        assert [run.strip() for run in runs] == [reply + closer for reply in replies], (name, runs)
    if name == "qwen3":  # the last reply's empty think block is context: the model is not taught to skip thinking
        ids, targets = prep.chat_ids(tok, MULTI_TURN)
        think = [i for i, t in zip(ids, targets) if tok.decode([i]) in ("<think>", "</think>")]
        assert len(think) == 2 and all(t == 0 for i, t in zip(ids, targets) if i in think)


def test_plain_text_is_the_familys_bos_tokens_and_document_end(family):
    name, tok = family
    _, end, has_bos = FAMILIES[name]
    ids = prep.text_ids(tok, [TEXT])[0]
    assert (ids[0] == tok.bos_id == tok.hf.bos_token_id) if has_bos else tok.prefix_ids == []
    assert ids[-1] == tok.doc_end_id == tok.piece_id(end)
    body = ids[len(tok.prefix_ids):-1]
    assert tok.decode(body) == TEXT and body == tok.hf(TEXT, add_special_tokens=False)["input_ids"]


def test_a_marker_typed_inside_a_message_stays_text(family):
    name, tok = family
    closer = FAMILIES[name][0]
    typed = f"Écris {closer} puis continue."
    chat = [{"role": "user", "content": typed}, {"role": "assistant", "content": typed}]
    ids, targets = prep.chat_ids(tok, chat)
    plain, _ = prep.chat_ids(tok, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}])
    control = tok.special_ids
    assert sum(i in control for i in ids) == sum(i in control for i in plain)  # only the template's markup
    assert tok.decode(ids).count(closer) == tok.decode(plain).count(closer) + 2
    assert [run.strip() for run in reply_runs(ids, targets, tok)] == [typed + closer]


def test_end_ids_stop_where_the_template_ends_a_reply(family):
    name, tok = family
    assert tok.piece_id(FAMILIES[name][0]) in tok.end_ids()


# -- one family through prepare and the reader ---------------------------------------------------------

def test_qwen3_chats_and_texts_prepare_without_a_bos_and_keep_each_conversation_whole(tmp_path):
    """Qwen3's tokenizer has no BOS and <|im_end|> for EOS: prepare takes it (it refused it before), a text ends with
    <|endoftext|>, a conversation is its rendering with each <|im_end|> inside it, and the recorded document starts
    are the conversations' own."""
    tok = tokenizer("qwen3")
    records = [{"messages": MULTI_TURN}, {"text": TEXT}, {"messages": ONE_TURN}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    out = str(tmp_path / "p")
    meta = prep.prepare([str(path)], published_tokenizers.folder("qwen3"), out, quiet=True, shard_tokens=50)
    assert (meta["bos_id"], meta["doc_end_id"]) == (None, tok.piece_id("<|endoftext|>"))
    assert meta["documents"] == 3 and len(meta["shards"]) > 1  # documents that cross shards
    data = D.TokenData(out)
    tokens, mask, starts = data.read(0, len(data))
    cuts = np.flatnonzero(starts).tolist()
    expected = [prep.chat_ids(tok, MULTI_TURN)[0], prep.text_ids(tok, [TEXT])[0], prep.chat_ids(tok, ONE_TURN)[0]]
    assert cuts == [0, len(expected[0]), len(expected[0]) + len(expected[1])]
    assert tokens.tolist() == sum(expected, [])
    assert tokens.tolist().count(tok.piece_id("<|im_end|>")) == 6 + 2  # EOS inside a conversation is no boundary
    assert mask[cuts[1]:cuts[2]].all() and mask[:cuts[1]].sum() == sum(prep.chat_ids(tok, MULTI_TURN)[1])


# -- bad input: one line naming the file and record, nothing half-written ------------------------------

def with_template(name: str, tmp_path, template: str):
    """A copy of family `name`'s published tokenizer folder with another chat template (skipped if not fetched)."""
    folder = published_tokenizers.folder(name)
    if folder is None:
        pytest.skip(f"the published {name} tokenizer could not be fetched")
    tok_dir = tmp_path / "tok"
    shutil.copytree(folder, tok_dir)
    config = json.load(open(tok_dir / "tokenizer_config.json"))
    json.dump(dict(config, chat_template=template), open(tok_dir / "tokenizer_config.json", "w"))
    return tok_dir


def write_chats(path, records) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


def test_an_assistant_turn_the_template_drops_is_one_line_naming_the_record(tmp_path):
    """A template that leaves out assistant replies (here: all but the last) would train on nothing for them; the
    record is named and no meta.json is written."""
    tok_dir = with_template("qwen3", tmp_path, (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"))
    path = write_chats(tmp_path / "c.jsonl", [{"messages": ONE_TURN}, {"messages": MULTI_TURN}])
    out = str(tmp_path / "p")
    with pytest.raises(D.DataError) as e:
        prep.prepare([path], str(tok_dir), out, quiet=True)
    assert str(e.value) == (f"{path}:2: message 2 (assistant): the chat template of {tok_dir} drops or rewrites its "
                            f"content, so its reply cannot be found in the rendering to be trained on")
    assert not os.path.exists(os.path.join(out, "meta.json"))
    meta = prep.prepare([path], str(tok_dir), out, quiet=True, skip_bad=True, overwrite=True)  # or skipped, counted
    assert (meta["documents"], meta["skipped_bad"]) == (1, 1)


def bare_tokenizer(folder) -> str:
    """A byte-level BPE with ChatML markers only: no BOS, and its eos_token <|im_end|> closes a turn."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 5, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(folder)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return str(folder)


def test_plain_text_with_neither_bos_nor_document_end_names_the_flag_to_pass(tmp_path):
    tok = bare_tokenizer(tmp_path / "bare")
    path = write_chats(tmp_path / "t.jsonl", [{"text": TEXT}, {"text": "Deux."}])
    out = str(tmp_path / "p")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "prepare.py"), "prepare", "--input", path, "--tokenizer", tok,
                           "--out", out], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: --tokenizer: {tok} has neither a BOS nor a document-end token; its eos_token '<|im_end|>' closes a "
        f"chat turn, so packed plain-text documents would run into each other: name the token its pretraining put "
        f"after a document with --doc_end TOKEN (or --doc_end none to pack them bare)"], proc.stderr
    assert not os.path.exists(os.path.join(out, "meta.json"))
    meta = prep.prepare([path], tok, out, quiet=True, overwrite=True, doc_end="<|im_start|>")
    assert meta["doc_end_id"] == TK.Tokenizer(tok).piece_id("<|im_start|>") and meta["bos_id"] is None
    with pytest.raises(D.DataError, match=r"^--doc_end: '<\|nope\|>' is not a token of --tokenizer "):
        TK.Tokenizer(tok, "<|nope|>")


# -- folders prepared before document starts were recorded ------------------------------------------------

def test_a_folder_prepared_before_document_starts_trains_with_the_boundaries_its_eos_implies(tmp_path):
    """Format 1 (llama-zero3-tokens/1: each document BOS + tokens + EOS, no docs files) is still read: its documents
    start after each eos_id, the same starts format 2 records for the same documents."""
    texts = write_chats(tmp_path / "t.jsonl", [{"text": f"Document {i}: " + TEXT[:20 + i]} for i in range(30)])
    model = str(tmp_path / "tok.model")
    prep.train_tokenizer([texts], 300, model)
    new, old = str(tmp_path / "new"), str(tmp_path / "old")
    prep.prepare([texts], model, new, quiet=True, shard_tokens=200)
    prep.prepare([texts], model, old, quiet=True, shard_tokens=200)
    meta = json.load(open(os.path.join(old, "meta.json")))
    for shard in meta["shards"]:  # as the format-1 prepare wrote it
        os.remove(os.path.join(old, shard.pop("docs")))
        shard.pop("n_documents")
    meta = {k: v for k, v in meta.items() if k != "doc_end_id"}
    json.dump(dict(meta, format=D.EOS_FORMAT), open(os.path.join(old, "meta.json"), "w"))
    a, b = D.TokenData(new), D.TokenData(old)
    for start, n in ((0, len(a)), (37, 150), (199, 5), (1, len(a) - 1)):
        (ta, _, sa), (tb, _, sb) = a.read(start, n), b.read(start, n)
        assert np.array_equal(ta, tb) and np.array_equal(sa, sb), (start, n)
    assert a.read(0, len(a))[2].sum() == 30


def test_a_templates_own_generation_blocks_are_its_targets(tmp_path):
    """A template that marks replies with {% generation %} (as SmolLM3's and OLMo's do) decides the targets itself:
    ours are transformers' own assistant mask for the same chat, on the same ids."""
    tok_dir = with_template("chatml", tmp_path, (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
        "{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endif %}{% endfor %}"))
    tok = TK.Tokenizer(str(tok_dir))
    for chat in (ONE_TURN, WITH_SYSTEM):
        ids, targets = prep.chat_ids(tok, chat)
        theirs = tok.hf.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == list(theirs["input_ids"]) and targets == list(theirs["assistant_masks"])
        assert [run for run in reply_runs(ids, targets, tok)] == [
            m["content"] + "<|im_end|>" for m in chat if m["role"] == "assistant"]
