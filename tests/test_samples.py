"""--sample_prompts: greedy completions at each evaluation through the sharded model, equal to transformers'
generate on the same weights; the prompts rendered as prepare and apply_chat_template render them; nothing
left gathered or cached after; bad prompts files refused before any work; the planner's prediction."""
import gc
import json
import os
import shutil

import pytest
import torch
from common import hf_model, learnable_tokens, ours_from_hf, run_train, save_hf, small_config
from common import live_tensor_bytes, read_metrics
from test_data import TEXTS, hf_tokenizer, write_jsonl

from components import out_dir as OD
from components import flags
from tools import prepare as prep
from tools import tokenizer as TK
import data as D
import model as M
from tools import plan as P
from tools import plan_memory as PM
from components import sample as S
import train as T

PROMPTS = [{"text": "Le contrat est"},
           {"messages": [{"role": "system", "content": "You are a legal assistant."},
                         {"role": "user", "content": "Traduis : the lessee shall pay the rent."}]}]
GENERATION_PROMPT = "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"


def hf_generate(ref, prompt_ids: list, max_new_tokens: int, eos_ids: list) -> list:
    """transformers' greedy generate: the new ids, ending with the end id when one came."""
    ids = torch.tensor([prompt_ids])
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                       eos_token_id=eos_ids, pad_token_id=eos_ids[0])
    return out[0, len(prompt_ids):].tolist()


def load_hf(folder):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def test_kv_cache_gives_the_full_forwards_logits():
    """Attention with a cache, fed a prompt, then 2 tokens, then 1 at a time: the logits of one causal
    forward over the whole sequence (GQA, RoPE at each token's position)."""
    cfg = small_config()
    model = ours_from_hf(cfg, hf_model(cfg, seed=1))
    tokens = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    full = model(tokens)
    caches = [M.KVCache(9, cfg, torch.float32, "cpu") for _ in model.layers]
    pieces = []
    with torch.no_grad():
        for lo, hi in [(0, 5), (5, 7), (7, 8), (8, 9)]:
            cos, sin = M.rope_cos_sin(cfg, torch.arange(lo, hi)[None], torch.float32)
            h = model.embed(tokens[:, lo:hi])
            for block, cache in zip(model.layers, caches):
                h = block(h, cos, sin, cache=cache)
            pieces.append(model.logits(h))
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def sentencepiece_run(tmp_path_factory):
    """A sentencepiece tokenizer of our own (Llama 3 header chats, no template), a folder prepared with it, and
    a tied model of its vocabulary saved as a Hugging Face folder."""
    root = tmp_path_factory.mktemp("sp")
    text = write_jsonl(root / "text.jsonl", [{"text": t} for t in TEXTS * 30])
    prep.train_tokenizer([text], 300, str(root / "tok.model"))
    prep.prepare([text], str(root / "tok.model"), str(root / "data"), quiet=True)
    cfg = small_config(vocab_size=300, bos_id=1, eos_id=2, tie_embeddings=True)
    init = save_hf(hf_model(cfg, seed=5), str(root / "init"))
    return dict(root=root, init=init, data=str(root / "data"), prompts=write_jsonl(root / "prompts.jsonl", PROMPTS))


@pytest.mark.parametrize("two_units", [False, True], ids=["a unit per block", "two units per block"])
def test_sharded_decoding_equals_generate_stops_at_end_ids_and_leaves_nothing_behind(sentencepiece_run, tmp_path,
                                                                                   monkeypatch, two_units):
    """In process, W = 1, tied head: the prompts as prepare writes them, the completions of transformers'
    generate, stopping at the end ids; afterwards no unit gathered, no cache, no tensor more than before. The
    same for a fork that shards each block as two units (tests/dist_worker.py): sampling runs the model's stages."""
    monkeypatch.delenv("RANK", raising=False)
    if two_units:
        from dist_worker import two_units_per_block
        monkeypatch.setattr(M, "sharding_units", two_units_per_block)
    r = sentencepiece_run
    cfg = T.parse_args([f"--init_from={r['init']}", f"--data={r['data']}", f"--sample_prompts={r['prompts']}",
                        "--sample_tokens=10", "--steps=1", "--seq_len=16", "--batch_size=2", "--micro_batch_size=2",
                        "--dtype=float32", "--device=cpu", f"--out_dir={tmp_path}"])
    sharded = T.setup(cfg)[0]
    try:
        assert len(sharded.units) == (2 if two_units else 1) * sharded.model.cfg.n_layers + 2
        sampler = S.Sampler(cfg, sharded.model.cfg, 0, 0, sharded.device)
        tok = TK.Tokenizer(sampler.tokenizer_path)  # the tool's, as the sampler asked it
        assert tok.path == str(r["root"] / "tok.model")  # the tokenizer meta.json records
        # The text is the start of a prepared document; the chat is what prepare writes before a reply.
        assert sampler.prompts[0] == [tok.bos_id] + tok.sp.encode(PROMPTS[0]["text"])
        reply = {"role": "assistant", "content": "Le preneur paie le loyer."}
        raw = json.dumps({"messages": PROMPTS[1]["messages"] + [reply]}).encode()
        prepared = prep.encode_batch([("chat.jsonl", 1, raw)], with_mask=True, skip_bad=False, tok=tok)[0].tolist()
        n = len(sampler.prompts[1])
        assert prepared[:n] == sampler.prompts[1] and tok.decode(prepared[n:-1]) == reply["content"]  # then <|eot_id|>
        assert sampler.stop_ids == [2, tok.sp.piece_to_id("<|eot_id|>")]  # end of text, end of a chat turn

        before = live_tensor_bytes()
        completions = S.generate(sharded, sampler.prompts, 10, set(sampler.stop_ids))
        gc.collect()
        assert [u.name for u in sharded.units if u.state() != "free"] == []
        assert not [o for o in gc.get_objects() if isinstance(o, M.KVCache)]
        assert live_tensor_bytes() == before

        ref = load_hf(r["init"])
        for ids, completion in zip(sampler.prompts, completions):
            assert completion == hf_generate(ref, ids, 10, sampler.stop_ids)
        # Stop at an id the first completion produces mid-way: both stop there, the id included.
        first = completions[0]
        k = max(i for i, t in enumerate(first[:-1]) if t not in first[:i])
        stopped = S.generate(sharded, sampler.prompts, 10, {first[k]})
        assert stopped[0] == first[:k + 1] == hf_generate(ref, sampler.prompts[0], 10, [first[k]])
        assert stopped[1] == hf_generate(ref, sampler.prompts[1], 10, [first[k]])
    finally:
        T.dist.destroy_process_group()
        OD.group = None


@pytest.fixture(scope="module")
def hf_tokenizer_run(tmp_path_factory):
    """An --init_from folder with its tokenizer (tokenizer.json, a chat template with a generation prompt),
    and token ids in a bare .npy: the tokenizer can only come from --init_from."""
    root = tmp_path_factory.mktemp("hf")
    tok_dir = hf_tokenizer(root / "tok")
    config_path = os.path.join(tok_dir, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["chat_template"] += GENERATION_PROMPT
    with open(config_path, "w") as f:
        json.dump(config, f)
    cfg = small_config(vocab_size=300, bos_id=0, eos_id=1)
    init = save_hf(hf_model(cfg, seed=7), str(root / "init"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok_dir, name), init)
    return dict(root=root, init=init, data=learnable_tokens(str(root / "tok.npy"), 300, n=2000),
                prompts=write_jsonl(root / "prompts.jsonl", PROMPTS))


def test_samples_at_each_evaluation_at_w2_equal_generate_on_the_exported_weights(hf_tokenizer_run, tmp_path):
    """torchrun, W = 2, fp32: two steps, an evaluation after each. samples.jsonl has a row per prompt and
    evaluation with the step; the last ones are transformers' generate on the exported weights, for the
    prompts as its tokenizer renders them (apply_chat_template with the generation prompt)."""
    from transformers import AutoTokenizer
    r = hf_tokenizer_run
    out, export = tmp_path / "out", tmp_path / "export"
    proc = run_train([f"--init_from={r['init']}", f"--data={r['data']}", f"--sample_prompts={r['prompts']}",
                      "--sample_tokens=12", "--steps=2", "--eval_every=1", "--seq_len=16", "--batch_size=4",
                      "--micro_batch_size=2", "--dtype=float32", f"--out_dir={out}", f"--export_hf={export}"], nproc=2)
    assert proc.stdout.count("samples at step 1 (2 prompts") == 1 and proc.stdout.count("samples at step 2 (2 prompts") == 1
    with open(out / "samples.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [(row["step"], row["prompt"]) for row in rows] == [(s, p.get("text", p.get("messages"))) for s in (1, 2) for p in PROMPTS]

    tok = AutoTokenizer.from_pretrained(r["init"])
    eos_ids = [tok.eos_token_id, tok.convert_tokens_to_ids("<|eot_id|>")]
    prompt_ids = [[tok.bos_token_id] + tok(PROMPTS[0]["text"], add_special_tokens=False)["input_ids"],
                  tok.apply_chat_template(PROMPTS[1]["messages"], add_generation_prompt=True)["input_ids"]]
    ref = load_hf(str(export))
    for ids, row in zip(prompt_ids, rows[2:]):
        assert row["ids"] == hf_generate(ref, ids, 12, eos_ids)
        assert row["completion"] == tok.decode(row["ids"][:-1] if row["ids"][-1] in eos_ids else row["ids"])
    assert any(len(row["ids"]) > 1 for row in rows)  # decode steps ran, not only the prefill


def test_a_prompt_the_tokenizer_cannot_encode_stops_every_rank_with_one_line(hf_tokenizer_run, tmp_path):
    """torchrun, W = 2: rank 0 asks tools/tokenizer.py for the prompts' ids and every rank gets its answer, so a
    chat template that fails on a prompt stops each rank with the same line naming --sample_prompts, before step 1."""
    r = hf_tokenizer_run
    init = shutil.copytree(r["init"], tmp_path / "init")
    config = json.loads((init / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ raise_exception('no chats here') }}"
    (init / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    proc = run_train([f"--init_from={init}", f"--data={r['data']}", f"--sample_prompts={r['prompts']}", "--steps=2",
                      "--eval_every=1", "--seq_len=16", "--batch_size=4", "--micro_batch_size=2", "--dtype=float32",
                      f"--out_dir={out}"], nproc=2, check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    expected = (f"error: --sample_prompts: {r['prompts']}: prompt 2: the chat template of {init} failed on this chat "
                f"(TemplateError: no chats here)")
    assert 1 <= len(lines) <= 2 and set(lines) == {expected}, proc.stderr[-3000:]  # torchrun may stop one first
    assert 'train.py", line' not in proc.stderr and read_metrics(str(out)) == []  # no traceback, no step


def test_a_resumed_run_keeps_the_samples_of_the_steps_it_has_done(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(dict(step=s, prompt="p", completion="c", ids=[3])) + "\n" for s in (2, 4, 6))
                    + '{"step": 8, "prom')  # torn by a crash
    OD.keep_rows_up_to(str(path), 4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [2, 4]
    OD.keep_rows_up_to(str(path), 0)  # a fresh start
    assert path.read_text() == ""


@pytest.fixture
def bad_prompts(tmp_path):
    def write(text):
        path = tmp_path / f"prompts{len(list(tmp_path.glob('prompts*')))}.jsonl"
        path.write_text(text)
        return str(path)
    return write


def test_bad_sampling_input_is_one_line_naming_the_flag_and_file(tmp_path, bad_prompts, hf_tokenizer_run):
    """What flags.py finds before any process group exists."""
    def errors(*args, data=hf_tokenizer_run["data"], init=hf_tokenizer_run["init"]):
        args = [f"--data={data}", f"--init_from={init}", f"--out_dir={tmp_path / 'out'}", *args]
        return "\n".join(flags.check_config(T.parse_args(args), 1))
    good = bad_prompts('{"text": "Le contrat"}\n')
    assert errors(f"--sample_prompts={good}") == ""
    missing = str(tmp_path / "nope.jsonl")
    assert errors(f"--sample_prompts={missing}") == f"--sample_prompts: {missing} does not exist"
    path = bad_prompts('{"text": "ok"}\n{"text": "Le contrat\n')
    assert errors(f"--sample_prompts={path}").startswith(f"--sample_prompts: {path}:2: not valid JSON (")
    path = bad_prompts('{"text": "ok"}\n\n{"prompt": "Le contrat"}\n')
    assert errors(f"--sample_prompts={path}") == (f'--sample_prompts: {path}:3: expected {{"text": str}} or '
                                                   f'{{"messages": [{{"role": str, "content": str}}, ...]}}')
    assert errors(f"--sample_prompts={good}", "--sample_tokens=0") == "--sample_tokens: must be >= 1, got 0"
    assert errors(f"--sample_prompts={good}", "--eval_every=0") == (
        "--sample_prompts: samples are taken at each evaluation, and --eval_every 0 never evaluates")
    # A bare .npy and an --init_from without tokenizer.json: nothing to encode the prompts with.
    no_tokenizer = save_hf(hf_model(small_config(vocab_size=300)), str(tmp_path / "no_tok"))
    assert errors(f"--sample_prompts={good}", init=no_tokenizer) == (
        f"--sample_prompts: no tokenizer to encode {good} with: --data {hf_tokenizer_run['data']} is token ids "
        f"without one (tools/prepare.py records it) and --init_from {no_tokenizer} has no tokenizer.json")


def test_planner_states_what_sampling_adds_per_evaluation_for_70b(tmp_path):
    """Each of --sample_tokens passes gathers the whole model once: 64 x 141 GB per GPU buffer for 70B. Across
    two nodes (every NIC at once, capped by NVLink) as on one node, eight prompts' weight reads or the gathers."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"text": "x" * 1024}] * 8)  # ~256 tokens each
    flags = ["--model=llama3-70b", "--nproc_per_node=8", "--gpu=h100", "--seq_len=8192", "--batch_size=64",
             "--micro_batch_size=1", "--ac=full", "--offload_activations=true", "--reduce_dtype=bfloat16",
             f"--sample_prompts={prompts}", "--eval_every=200"]
    mcfg = M.PRESETS["llama3-70b"]()
    model_bytes = 2 * sum(PM.padded(n, 16) for n in PM.unit_numels(mcfg))
    two = P.plan(mcfg, T.parse_args(flags + ["--nnodes=2"]))
    assert two["sampling_prompts"] == 8 and two["sampling_prompt_tokens"] == 256
    assert two["sampling_gathered_gb"] == pytest.approx(64 * model_bytes / 1e9)
    assert two["sampling_gather_s_per_pass"] == pytest.approx(15 / 16 * model_bytes / 360e9)  # 8 NICs, NVLink's cap
    assert two["sampling_s"] == pytest.approx(64 * max(two["sampling_gather_s_per_pass"],
                                                       two["sampling_decode_s_per_pass"]), rel=0.01)
    one = P.plan(mcfg, T.parse_args(flags + ["--nnodes=1", "--offload_optimizer=true"]))
    assert one["sampling_decode_s_per_pass"] > one["sampling_gather_s_per_pass"]
    assert one["sampling_kv_cache_gib"] == pytest.approx(2 * 80 * 8 * 128 * 2 * 8 * (256 + 64) / 2**30)
    line = next(line for line in P.table(two, T.parse_args(flags + ["--nnodes=2"])).splitlines()
                if line.startswith("--sample_prompts"))
    assert "(predicted): 8 prompts of ~256 tokens, 64 passes" in line and f"{two['sampling_s']:,.1f} s" in line
