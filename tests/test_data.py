"""The data pipeline: tokenizers, prepare (order, shards, masks, bad input), packing with document masks,
the window order and its resumable state, and training on a prepared folder."""
import concurrent.futures
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from common import ROOT, hf_model, ours_from_hf, read_metrics, run_train, small_config

import data as D
from tools import tokenizer as TK
import model as M
from components import run_data as RD

TEXTS = ["Le contrat est résilié de plein droit à défaut de paiement.",
         "The lessee shall pay the rent on the first day of each month.",
         "Article 3 — Les parties conviennent que le présent accord est régi par le droit français. 😀",
         "Interest accrues at 4.5% per annum, compounded monthly."]
CHATS = [[{"role": "system", "content": "You are a legal assistant."},
          {"role": "user", "content": "Traduis : the contract is void."},
          {"role": "assistant", "content": "Le contrat est nul."}],
         [{"role": "user", "content": "What is a lease?"},
          {"role": "assistant", "content": "A contract granting use of property."},
          {"role": "user", "content": "Merci !"},
          {"role": "assistant", "content": "Avec plaisir."}]]


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return str(path)


def run_prepare(*args, check=True):
    """python tools/prepare.py ARGS, as a user types it."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "prepare.py"), *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(proc.stderr)
    return proc


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    text = write_jsonl(root / "text.jsonl", [{"text": t} for t in TEXTS * 30])
    txt = root / "one.txt"
    txt.write_text("Un document entier dans un fichier .txt.\nSur deux lignes.", encoding="utf-8")
    chat = write_jsonl(root / "chat.jsonl", [{"messages": c} for c in CHATS * 10])
    sp_model = str(root / "tok.model")
    run_prepare("train-tokenizer", "--input", text, str(txt), "--vocab_size", "400", "--out", sp_model)
    return dict(root=root, text=text, txt=str(txt), chat=chat, sp=sp_model, hf=hf_tokenizer(root / "hf"))


def hf_tokenizer(folder):
    """A small byte-level BPE in the Hugging Face format, with Llama 3's special tokens, its BOS post-processor and a
    chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok.train_from_iterator(TEXTS * 5, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(  # BOS before a text, as Llama 3's tokenizer.json adds it
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    os.makedirs(folder)
    tok.save(str(folder / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                "{{ m['content'] | trim }}<|eot_id|>{% endfor %}")  # trim, as Llama 3's template
    with open(folder / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": template,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return str(folder)


def documents(folder):
    """(tokens, mask) of each document of a prepared folder, split where its record says documents start."""
    data = D.TokenData(folder)
    tokens, mask, starts = data.read(0, len(data))
    cuts = np.flatnonzero(starts)[1:]
    return [(t, m) for t, m in zip(np.split(tokens, cuts), np.split(mask if mask is not None else tokens, cuts))]


# -- tokenizers -----------------------------------------------------------------------------------

def test_trained_tokenizer_round_trips_any_utf8_and_keeps_chat_markers_whole(corpus):
    tok = TK.Tokenizer(corpus["sp"])
    text = "Ça coûte 12,50 € — naïve façade, ÆØÅ, 東京, 😀\n\n  indented"
    ids = tok.encode([text], specials=False)[0]
    assert tok.decode(ids) == text
    assert tok.sp.unk_id() not in ids  # byte fallback, never <unk>
    for marker in TK.CHAT_TOKENS:
        assert len(tok.encode([marker], specials=True)[0]) == 1
    first = open(corpus["sp"], "rb").read()
    run_prepare("train-tokenizer", "--input", corpus["text"], corpus["txt"], "--vocab_size", "400", "--out", corpus["sp"])
    assert open(corpus["sp"], "rb").read() == first  # a re-run gives the same model


# -- prepare --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["sp", "hf"])
def test_prepare_writes_each_document_as_bos_tokens_eos_in_input_order(corpus, tmp_path, kind):
    out = str(tmp_path / "p")
    run_prepare("prepare", "--input", corpus["text"], corpus["txt"], "--tokenizer", corpus[kind], "--out", out,
               "--shard_tokens", "500")
    tok = TK.Tokenizer(corpus[kind])
    expected = []
    for doc in TEXTS * 30 + [open(corpus["txt"], encoding="utf-8").read()]:
        expected += [tok.bos_id, *tok.encode([doc], specials=False)[0], tok.eos_id]
    meta = json.load(open(os.path.join(out, "meta.json")))
    data = D.TokenData(out)
    assert data.read(0, len(data))[0].tolist() == expected
    assert meta["tokens"] == len(expected) and meta["documents"] == 121 and meta["vocab_size"] == tok.vocab_size
    assert meta["tokenizer"]["sha256"] == tok.sha256 and meta["dtype"] == "uint16"
    assert len(meta["shards"]) == -(-len(expected) // 500) > 1  # several shards, read back as one sequence
    assert all(np.load(os.path.join(out, s["tokens"])).dtype == np.uint16 for s in meta["shards"])


def test_two_workers_write_the_same_bytes_as_one(corpus, tmp_path):
    outs = []
    for workers in (1, 2):
        out = str(tmp_path / f"w{workers}")
        run_prepare("prepare", "--input", corpus["chat"], corpus["text"], "--tokenizer", corpus["sp"], "--out", out,
                   "--workers", str(workers), "--shard_tokens", "700")
        outs.append(out)
    names = sorted(os.listdir(outs[0]))
    assert names == sorted(os.listdir(outs[1])) and "mask-00000.npy" in names
    for name in names:
        assert open(os.path.join(outs[0], name), "rb").read() == open(os.path.join(outs[1], name), "rb").read(), name


def test_data_py_prepare_runs_the_tool(corpus, tmp_path):
    """`python data.py prepare ...`, the command from before tools/, runs tools/prepare.py: the same bytes."""
    args = ["prepare", "--input", corpus["chat"], corpus["text"], "--tokenizer", corpus["sp"], "--shard_tokens", "700"]
    run_prepare(*args, "--out", str(tmp_path / "tool"))
    subprocess.run([sys.executable, os.path.join(ROOT, "data.py"), *args, "--out", str(tmp_path / "data")],
                   check=True, capture_output=True, timeout=300)
    names = sorted(os.listdir(tmp_path / "tool"))
    assert names == sorted(os.listdir(tmp_path / "data")) and "meta.json" in names
    for name in names:
        assert (tmp_path / "tool" / name).read_bytes() == (tmp_path / "data" / name).read_bytes(), name


@pytest.mark.parametrize("kind", ["sp", "hf"])
def test_chat_masks_cover_exactly_the_assistant_replies(corpus, tmp_path, kind):
    out = str(tmp_path / "chat")
    run_prepare("prepare", "--input", corpus["chat"], "--tokenizer", corpus[kind], "--out", out)
    tok = TK.Tokenizer(corpus[kind])
    docs = documents(out)
    assert len(docs) == 2 * 10
    for (tokens, mask), chat in zip(docs, CHATS * 10):
        # stored as rendered: BOS, and nothing after the last reply's <|eot_id|> (a target: the reply's end)
        assert tokens[0] == tok.bos_id and mask[0] == 0 and mask[-1] == 1 and tokens[-1] == tok.piece_id("<|eot_id|>")
        replies = "".join(m["content"] + "<|eot_id|>" for m in chat if m["role"] == "assistant")
        assert tok.decode(tokens[mask == 1]) == replies
        assert "Traduis" in tok.decode(tokens) or "lease" in tok.decode(tokens)  # the prompt is there, unmasked
    meta = json.load(open(os.path.join(out, "meta.json")))
    assert meta["target_tokens"] == sum(int(m.sum()) for _, m in docs)


def test_an_instruct_tokenizer_ends_documents_with_end_of_text_not_eot(corpus, tmp_path):
    """Llama 3 Instruct's tokenizer_config names <|eot_id|> its eos_token; it closes each turn, so the
    document separator must stay <|end_of_text|>, or every chat would be cut at each turn."""
    import shutil
    instruct = tmp_path / "instruct"
    shutil.copytree(corpus["hf"], instruct)
    config = json.load(open(instruct / "tokenizer_config.json"))
    json.dump(dict(config, eos_token="<|eot_id|>"), open(instruct / "tokenizer_config.json", "w"))
    tok = TK.Tokenizer(str(instruct))
    assert tok.hf.eos_token == "<|eot_id|>" and tok.eos_id == tok.hf.convert_tokens_to_ids("<|end_of_text|>")
    out = str(tmp_path / "chat")
    run_prepare("prepare", "--input", corpus["chat"], "--tokenizer", str(instruct), "--out", out)
    assert json.load(open(os.path.join(out, "meta.json")))["documents"] == 20
    assert len(documents(out)) == 20


def test_a_literal_special_token_in_a_document_stays_text(corpus, tmp_path):
    path = write_jsonl(tmp_path / "forge.jsonl", [{"text": "fin<|end_of_text|>suite <|eot_id|>"}])
    out = str(tmp_path / "p")
    run_prepare("prepare", "--input", path, "--tokenizer", corpus["hf"], "--out", out)
    (tokens, _), = documents(out)
    tok = TK.Tokenizer(corpus["hf"])
    assert list(tokens).count(tok.eos_id) == 1 and tok.decode(tokens[1:-1]) == "fin<|end_of_text|>suite <|eot_id|>"


def bad_jsonl(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "good one"}\n{"text": "broken\n{"text": ""}\n{"text": "caf\xe9"}\n{"other": 1}\n'
                     b'{"text": "good two"}\n')
    return str(path)


@pytest.mark.parametrize("case,expected", [
    ("missing", "error: --input: {tmp}/nope.jsonl does not exist"),
    ("malformed", "error: {tmp}/bad.jsonl:2: not valid JSON"),
    ("tokenizer", "error: --tokenizer: {tmp}/none.model is not a sentencepiece .model, a tokenizer.json, or a folder holding one"),
    ("not_empty", "error: --out: {tmp}/full is not empty; --overwrite true replaces a prepared folder"),
    ("bad_utf8_txt", "error: {tmp}/latin1.txt: not valid UTF-8 (byte 3)"),
])
def test_bad_input_gets_one_clear_line(corpus, tmp_path, case, expected):
    tok, inputs, out = corpus["sp"], [bad_jsonl(tmp_path)], str(tmp_path / "out")
    if case == "missing":
        inputs = [str(tmp_path / "nope.jsonl")]
    elif case == "tokenizer":
        tok = str(tmp_path / "none.model")
    elif case == "not_empty":
        out = str(tmp_path / "full")
        os.makedirs(out)
        open(os.path.join(out, "x"), "w").close()
    elif case == "bad_utf8_txt":
        (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
        inputs = [str(tmp_path / "latin1.txt")]
    proc = run_prepare("prepare", "--input", *inputs, "--tokenizer", tok, "--out", out, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected.format(tmp=tmp_path)), proc.stderr
    assert not os.path.exists(os.path.join(out, "meta.json"))  # stopped: nothing looks complete


def test_skip_bad_skips_and_counts_each_bad_document(corpus, tmp_path):
    out = str(tmp_path / "out")
    proc = run_prepare("prepare", "--input", bad_jsonl(tmp_path), "--tokenizer", corpus["sp"], "--out", out, "--skip_bad")
    meta = json.load(open(os.path.join(out, "meta.json")))
    assert meta["documents"] == 2 and meta["skipped_bad"] == 4  # broken JSON, empty, bad UTF-8, no text
    assert "2 documents" in proc.stderr and "4 bad documents skipped" in proc.stderr
    tok = TK.Tokenizer(corpus["sp"])
    assert [tok.decode(t[1:-1]) for t, _ in documents(out)] == ["good one", "good two"]


def test_an_unfinished_prepare_is_refused_for_training(corpus, tmp_path):
    out = str(tmp_path / "out")
    path = tmp_path / "late.jsonl"  # a bad line after a shard was already written
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 200) + "{oops\n")
    proc = run_prepare("prepare", "--input", str(path), "--tokenizer", corpus["sp"], "--out", out,
                      "--shard_tokens", "100", check=False)
    assert proc.returncode == 2 and os.path.exists(os.path.join(out, "tokens-00000.npy"))
    assert not os.path.exists(os.path.join(out, "meta.json"))
    with pytest.raises(D.DataError, match="has no meta.json: not a prepared folder, or its prepare did not finish"):
        D.TokenData(out)


# -- document masking -----------------------------------------------------------------------------

def test_document_mask_gives_each_document_its_own_logits():
    """Three documents packed in a row (and a second row with one boundary): the logits of each equal
    transformers' on that document alone."""
    torch.manual_seed(0)
    cfg = small_config()
    ref = hf_model(cfg, seed=1)
    ours = ours_from_hf(cfg, ref)
    lengths = [[5, 9, 10], [13, 11]]
    tokens = torch.randint(3, cfg.vocab_size, (2, 24))
    starts = torch.zeros(2, 24, dtype=torch.bool)
    for row, lens in enumerate(lengths):
        starts[row, np.cumsum([0] + lens[:-1])] = True
    with torch.no_grad():
        packed = ours(tokens, doc_starts=starts)
        unmasked = ours(tokens)
        for row, lens in enumerate(lengths):
            begin = 0
            for n in lens:
                alone = ref(tokens[row:row + 1, begin:begin + n]).logits[0]
                torch.testing.assert_close(packed[row, begin:begin + n], alone, rtol=1e-5, atol=1e-5)
                begin += n
    assert (packed - unmasked).abs().max() > 1e-3  # the mask changes what later documents see


def test_document_layout_positions_and_varlen_boundaries(monkeypatch):
    starts = torch.tensor([[1, 0, 0, 1, 0], [1, 0, 1, 1, 0]], dtype=torch.bool)
    mask = M.document_layout(starts).mask[:, 0]  # SDPA's (here: no flash_attn, CPU)
    monkeypatch.setattr(M, "uses_flash", lambda device, dtype: True)  # flash_attn's, on CPU tensors
    layout = M.document_layout(starts)
    assert layout.positions.tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 0, 1]]
    assert layout.cu_seqlens.tolist() == [0, 3, 5, 7, 8, 10] and layout.max_seqlen == 3 and layout.mask is None
    assert mask[0, 4].tolist() == [False, False, False, True, True] and mask[1, 2].tolist() == [False, False, True, False, False]


# -- order and loader state -----------------------------------------------------------------------

@pytest.fixture
def windows(tmp_path):
    path = str(tmp_path / "t.npy")
    np.save(path, np.arange(1000, dtype=np.uint16))
    return D.TokenWindows(D.TokenData(path), seq_len=8, seed=3)


def test_global_batch_is_the_same_for_any_world_size_and_micro_batch(windows):
    B = 12
    for position in (0, 12, 120, 11 * 12):  # 124 windows: the last ones cross into the second epoch
        whole = windows.micro_batch(position, 0, 0, 1, B)[0]
        for world, micro in [(2, 6), (3, 2), (4, 1), (2, 3)]:
            accum = B // (world * micro)
            rows = {}
            for rank in range(world):
                for j in range(accum):  # rank r's slot in the global batch is (j * W + r) * micro
                    rows[(j * world + rank) * micro] = windows.micro_batch(position, j, rank, world, micro)[0]
            assert np.array_equal(np.concatenate([rows[k] for k in sorted(rows)]), whole), (position, world, micro)


def test_epochs_reshuffle_and_cover_every_window(windows):
    n = windows.n_windows
    first = [windows.micro_batch(i, 0, 0, 1, 1)[0][0, 0] // 8 for i in range(n)]
    second = [windows.micro_batch(n + i, 0, 0, 1, 1)[0][0, 0] // 8 for i in range(n)]
    assert sorted(first) == sorted(second) == list(range(n)) and first != second


def test_saved_loader_state_restores_the_exact_next_batch(windows, tmp_path):
    state = json.loads(json.dumps(windows.state(36)))  # as a checkpoint stores it
    fresh = D.TokenWindows(D.TokenData(str(tmp_path / "t.npy")), seq_len=8, seed=3)
    position = fresh.check_state(state)
    for j in range(3):
        assert np.array_equal(fresh.micro_batch(position, j, 1, 2, 2)[0], windows.micro_batch(36, j, 1, 2, 2)[0])
    np.save(str(tmp_path / "other.npy"), np.arange(990, dtype=np.uint16))
    with pytest.raises(D.DataError, match="the checkpoint's data had n_windows 124, this run's has 123"):
        D.TokenWindows(D.TokenData(str(tmp_path / "other.npy")), seq_len=8, seed=3).check_state(state)


def test_masked_targets_are_excluded(corpus, tmp_path):
    out = str(tmp_path / "chat")
    run_prepare("prepare", "--input", corpus["chat"], "--tokenizer", corpus["sp"], "--out", out)
    data = D.TokenData(out)
    w = D.TokenWindows(data, seq_len=32, seed=0)
    inputs, targets, _ = w.micro_batch(0, 0, 0, 1, 4)
    for row in range(4):
        tokens, mask, _ = data.read(w._window_start(row) + 1, 32)
        assert np.array_equal(targets[row], np.where(mask == 1, tokens, -100))
    assert (targets == -100).any() and (targets != -100).any()


# -- training on prepared data --------------------------------------------------------------------

def test_training_on_a_prepared_folder_takes_its_vocabulary_and_logs_eval_loss(corpus, tmp_path):
    train_dir, eval_dir = str(tmp_path / "train"), str(tmp_path / "eval")
    run_prepare("prepare", "--input", corpus["chat"], "--tokenizer", corpus["sp"], "--out", train_dir)
    run_prepare("prepare", "--input", corpus["text"], "--tokenizer", corpus["sp"], "--out", eval_dir)
    out = str(tmp_path / "run")
    run_train(["--data", train_dir, "--eval_data", eval_dir, "--eval_every", "2", "--eval_batches", "2",
               "--steps", "3", "--seq_len", "32", "--batch_size", "4", "--micro_batch_size", "1",
               "--out_dir", out, "--export_hf", f"{out}/hf"], nproc=2)
    metrics = read_metrics(out)
    assert [("eval_loss" in m) for m in metrics] == [False, True, True]
    assert all(np.isfinite(m["eval_loss"]) for m in metrics[1:])
    config = json.load(open(os.path.join(out, "hf", "config.json")))
    tok = TK.Tokenizer(corpus["sp"])  # the end ids: EOS, and <|eot_id|> (it closes a chat turn): the export's too
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (400, 1, [2, tok.piece_id("<|eot_id|>")])


def test_a_model_with_another_vocabulary_is_refused(corpus, tmp_path):
    prepared = str(tmp_path / "p")
    run_prepare("prepare", "--input", corpus["text"], "--tokenizer", corpus["sp"], "--out", prepared)
    init = str(tmp_path / "init")
    hf_model(small_config()).save_pretrained(init)  # vocabulary 97
    proc = run_train(["--init_from", init, "--data", prepared, "--out_dir", str(tmp_path / "o")], check=False)
    assert proc.returncode != 0
    assert f"error: --data: {prepared} was tokenized with a 400-token vocabulary; the model's has 97" in proc.stderr


def test_the_builtin_sample_is_english_and_french_in_two_sources(tmp_path):
    """Built as a run builds it, by the tool in a subprocess (run_data.build_sample), by two ranks at once: one
    builds it, the other waits on its lock."""
    folder = str(tmp_path / "sample")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(RD.build_sample, folder) for _ in range(2)]:
            future.result()
    assert RD.sample_is_built(folder)
    metas = {name: json.load(open(os.path.join(folder, "train", name, "meta.json"))) for name in ("messages", "docstrings")}
    assert sum(m["documents"] for m in metas.values()) > 1000 and sum(m["tokens"] for m in metas.values()) > 1_000_000
    assert all(m["tokens"] > 200_000 for m in metas.values())
    docs = [json.loads(line)["text"] for line in open(os.path.join(folder, "text.jsonl"), encoding="utf-8")]
    french = sum(" le " in d and ("é" in d or "è" in d) for d in docs)
    english = sum(" the " in d for d in docs)
    assert french > 300 and english > 300, (french, english)
    docstrings = [json.loads(line)["text"] for line in open(os.path.join(folder, "docstrings.jsonl"), encoding="utf-8")]
    assert not any(" le " in d and ("é" in d or "è" in d) for d in docstrings)  # the English source
    assert all(os.path.isfile(os.path.join(folder, "eval", name, "meta.json")) for name in ("messages", "docstrings"))
    mtime = os.path.getmtime(os.path.join(folder, "train", "messages", "meta.json"))
    RD.build_sample(folder)  # cached: not rebuilt
    assert os.path.getmtime(os.path.join(folder, "train", "messages", "meta.json")) == mtime


def test_a_sample_that_cannot_be_built_stops_the_run_with_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    folder = str(tmp_path / "file" / "sample")
    with pytest.raises(D.DataError) as e:
        RD.build_sample(folder)
    assert str(e.value) == (f"--data sample: could not build the built-in sample in {folder}: "
                            f"[Errno 20] Not a directory: '{folder}'")


def test_a_loader_shared_by_threads_gives_each_the_same_windows():
    """tests/ranks.py runs ranks as threads of one process, sharing one loader. The epoch's permutation is
    replaced whole, so a thread never reads a half-updated one (it read None or the last epoch's order)."""
    import threading

    class Tokens:  # stands in for TokenData: a window "reads" its start
        path = "tokens"

        def __len__(self):
            return 1001

        def read(self, start, n):
            return start
    shared, positions = D.TokenWindows(Tokens(), 10, 0), range(100 * 50)  # 100 windows an epoch, 50 epochs
    expected = [D.TokenWindows(Tokens(), 10, 0).window(p) for p in positions]
    wrong = []

    def read_all():
        for p in positions:
            try:
                if shared.window(p) != expected[p]:
                    wrong.append(p)
            except TypeError as e:
                wrong.append(repr(e))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=read_all) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert wrong == []
