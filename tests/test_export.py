"""--export_hf writes a folder a server loads as is: the weights, config.json and generation_config.json with
the source's end ids and sampling defaults, the tokenizer (copied from an --init_from folder, or converted
from a sentencepiece model of our own to the same ids), files with the process's umask, and never a model
that transformers would load as another one (a fork's extra parameter)."""
import json
import os
import shutil
import signal
import stat
import subprocess
import sys

import pytest
import torch
from common import ROOT, hf_model, learnable_tokens, ours_from_hf, save_hf, small_config
from test_data import CHATS, TEXTS, hf_tokenizer

import data as D
from tools import prepare as prep
from tools import tokenizer as TK
from tools import export_hf as X

# Each kind of text the ids must agree on: French, English, chat markup, digits and whitespace runs,
# symbols, emoji, CJK (byte fallback: not in a 400-piece vocabulary) and control characters.
SAMPLES = TEXTS + [
    "<|start_header_id|>user<|end_header_id|>\n\nTraduis : the contract is void.<|eot_id|>",
    "x<|eot_id|>y  <|end_header_id|>",
    "  deux  espaces\tet\ttabs\n\n\r\n 12345 67.890 ",
    "☃ ℃ ½ ‰ 😀 中文 한국어 \x00\x07 end",
]


def run_python(args, umask=None, check=True):
    """train.py in one process (no torchrun: W = 1), with the given umask."""
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), umask=-1 if umask is None else umask)
    if check and proc.returncode != 0:
        raise AssertionError(proc.stderr[-4000:])
    return proc


def test_a_sentencepiece_tokenizer_exports_to_the_same_ids(tmp_path):
    """data.py's own tokenizer (byte fallback, identity normalization, the chat markers as pieces), written
    for transformers: AutoTokenizer encodes every sample to data.py's ids, adds BOS as prepare does, decodes
    back, renders chats as data.py did, and the end ids are EOS then <|eot_id|>."""
    from transformers import AutoTokenizer
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in TEXTS * 30), encoding="utf-8")
    model = str(tmp_path / "tok.model")
    prep.train_tokenizer([str(corpus)], 400, model)
    tok = TK.Tokenizer(model)
    out = tmp_path / "hf"
    out.mkdir()
    end_ids = X.write_hf_tokenizer(model, tok.sha256, str(out))
    loaded = AutoTokenizer.from_pretrained(str(out))
    for text in SAMPLES:
        ids = tok.encode([text], True)[0]
        assert loaded(text, add_special_tokens=False)["input_ids"] == ids, text
        assert loaded(text)["input_ids"] == [tok.bos_id] + ids  # a prompt starts as every training document does
        assert loaded.decode(ids) == text
    assert any(i in tok.sp.encode("中") for i in range(3, 259))  # byte fallback was exercised
    assert end_ids == [tok.eos_id, tok.piece_id("<|eot_id|>")] and loaded.eos_token_id == tok.eos_id
    for chat in CHATS:  # the exported template renders a chat as prepare stored it, id for id
        rendered = loaded.apply_chat_template(chat, tokenize=False)
        assert loaded(rendered, add_special_tokens=False)["input_ids"] == prep.chat_ids(tok, chat)[0]


def test_a_changed_tokenizer_is_not_exported(tmp_path):
    model = tmp_path / "tok.model"
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(TEXTS * 20), encoding="utf-8")
    prep.train_tokenizer([str(corpus)], 300, str(model))
    with pytest.raises(D.DataError, match="has changed since it prepared --data"):
        X.write_hf_tokenizer(str(model), "0" * 64, str(tmp_path))
    with pytest.raises(D.DataError, match="is not there"):
        X.write_hf_tokenizer(str(tmp_path / "gone.model"), "0" * 64, str(tmp_path))


def test_without_a_tokenizer_the_export_says_so_in_one_line(tmp_path, capsys):
    """A run on a bare .npy names no tokenizer: the export holds none, and one warning line says so."""
    from components import hf
    origin = hf.export_origin({"init_from": "", "data": str(tmp_path / "tokens.npy"), "out_dir": str(tmp_path)})
    assert origin == {"hf_folder": None, "tokenizer": None}
    assert X.export_tokenizer(origin, str(tmp_path)) == (None, "no tokenizer")
    assert capsys.readouterr().err == ("warning: --export_hf: no tokenizer files in the export (--data is a token .npy, "
                                       "which names no tokenizer); copy the tokenizer's files into it before loading "
                                       "it with AutoTokenizer\n")


@pytest.fixture(scope="module")
def instruct_folder(tmp_path_factory):
    """A tiny Llama saved the way Llama-3.1-Instruct is: three end ids in config.json, a generation_config.json
    with sampling defaults, and a tokenizer (tokenizer.json, tokenizer_config.json with a chat template,
    special_tokens_map.json)."""
    root = tmp_path_factory.mktemp("instruct")
    cfg = small_config(rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=8))
    ref = hf_model(cfg, seed=4)
    folder = save_hf(ref, str(root / "model"))
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config.update(eos_token_id=[2, 5, 7], pad_token_id=0)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    generation = {"bos_token_id": 1, "eos_token_id": [2, 5, 7], "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(generation, f)
    tokenizer = hf_tokenizer(root / "tokenizer")
    for name in os.listdir(tokenizer):
        shutil.copyfile(os.path.join(tokenizer, name), os.path.join(folder, name))
    with open(os.path.join(folder, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, f)
    return folder, cfg, ref, generation


def test_an_export_from_a_hugging_face_folder_is_a_complete_model_folder(instruct_folder, tmp_path):
    """--init_from X --steps 0 --export_hf OUT, under umask 027: OUT holds X's tokenizer files, config.json
    with X's three end ids and its other fields, X's generation_config.json, every file mode 0640; and
    transformers' model loaded from OUT computes the logits ours computes from X."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, cfg, ref, generation = instruct_folder
    out = tmp_path / "hf"
    proc = run_python(["train.py", f"--init_from={folder}", "--steps=0", "--dtype=float32", f"--export_hf={out}",
                       f"--out_dir={tmp_path / 'run'}"], umask=0o027)
    for name in os.listdir(out):
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o640, name  # safetensors' save_file made 0600
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o750
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / name).read_bytes() == open(os.path.join(folder, name), "rb").read(), name
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == [2, 5, 7] and config["pad_token_id"] == 0
    assert json.loads((out / "generation_config.json").read_text()) == generation
    assert f"exported a Hugging Face folder to {out} (tokenizer files copied from {folder}" in proc.stdout
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer("Le contrat")["input_ids"] == AutoTokenizer.from_pretrained(folder)("Le contrat")["input_ids"]
    assert "<|start_header_id|>" in tokenizer.apply_chat_template(CHATS[0], tokenize=False)
    tokens = torch.arange(20).view(2, 10) * 4 % cfg.vocab_size
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert loaded.generation_config.eos_token_id == [2, 5, 7] and loaded.generation_config.temperature == 0.6
    with torch.no_grad():
        theirs, ours = loaded(tokens).logits, ours_from_hf(cfg, ref)(tokens)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


FORK = """
import sys
sys.path.insert(0, {root!r})
import model as M
import train


class QKNormAttention(M.Attention):  # a fork's change: a norm on the queries, a parameter a Llama lacks
    def __init__(self, cfg):
        super().__init__(cfg)
        self.q_norm = M.RMSNorm(cfg.head_dim, cfg.norm_eps)


M.Attention = QKNormAttention
train.main(sys.argv[1:])
"""


def test_a_fork_with_a_parameter_llama_lacks_is_refused_before_any_work(tmp_path):
    """Loaded by transformers, such an export drops q_norm with a warning and computes another model: the
    check that LlamaForCausalLM, built from the exported config.json on the meta device, has exactly the
    exported tensors refuses it, before the first step (not after days of training), and no folder appears."""
    out = tmp_path / "hf"
    proc = run_python(["-c", FORK.format(root=ROOT), "--model=tiny", "--steps=0", f"--export_hf={out}",
                       f"--out_dir={tmp_path / 'run'}"], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ("error: --export_hf: tensor model.layers.0.self_attn.q_norm.weight (and 3 more) of this model is not in "
            "the LlamaForCausalLM that transformers builds from the exported config.json") in proc.stderr
    assert not out.exists() and not os.path.exists(f"{out}.partial")


def test_a_fork_familys_row_carries_its_config_keys_and_its_export_is_held_to_the_tensors_on_disk(monkeypatch, tmp_path):
    """A fork's family is a row of model.FAMILIES and no line of hf.py: Mixtral's row names its config.json keys
    (with the values a model without them gets), config_from_hf keeps a config.json's, config_to_hf writes them back.
    The export check holds an export to the tensors save_pretrained writes, which transformers 5 renames in memory
    (each layer's experts fused into one tensor; a weight per expert on disk, as servers read them): on-disk names
    pass, in-memory ones are refused."""
    import transformers
    from safetensors import safe_open
    from components import hf
    import model as M
    monkeypatch.setitem(M.FAMILIES, "mixtral", dict(hf_class="MixtralForCausalLM", hf_config_class="MixtralConfig",
                                                    model_fields={}, rope_types=("default",),
                                                    config_keys=dict(num_local_experts=8, num_experts_per_tok=2)))
    config = dict(hf.config_to_hf(small_config(), torch.float32), model_type="mixtral",
                  architectures=["MixtralForCausalLM"], num_local_experts=3)
    cfg = hf.config_from_hf(config)
    assert cfg.family_keys == dict(num_local_experts=3, num_experts_per_tok=2)
    config = hf.config_to_hf(cfg, torch.float32)
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (3, 2)
    oracle = transformers.MixtralForCausalLM(transformers.MixtralConfig.from_dict(config))
    oracle.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        on_disk = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert "model.layers.0.block_sparse_moe.experts.2.w1.weight" in on_disk
    hf.check_export_tensors(config, on_disk)
    in_memory = {name: tuple(p.shape) for name, p in oracle.named_parameters()}
    if in_memory != on_disk:  # transformers 5 (4 holds what it saves)
        with pytest.raises(ValueError, match=r"^--export_hf: tensor model\.layers\.0\.mlp\.experts\.down_proj"):
            hf.check_export_tensors(config, in_memory)


def test_an_export_that_fails_is_one_line_on_every_rank_and_leaves_no_folder(tmp_path):
    """tools/export_hf.py makes --export_hf from the last step's checkpoint, each rank writing its share of the files
    (--part): when they fail, every rank stops with a line (here an OUT.partial that is a file, exit 1) and no
    folder appears. The same command then makes it from that checkpoint, one process (a finished run's export), a
    file of --export_shard_gb at a time. A full disk at the tool's second file is one line, exit code 2 (it repeats
    on a restart), no folder."""
    from common import run_train
    from safetensors.torch import load_file
    data = learnable_tokens(str(tmp_path / "tok.npy"), 256, n=2000)
    out = tmp_path / "hf"
    command = [f"--data={data}", "--model=tiny", "--dtype=float32", "--seq_len=16", "--batch_size=4",
               "--micro_batch_size=2", "--steps=2", "--warmup_steps=1", "--eval_every=0", "--export_shard_gb=0.00002",
               f"--out_dir={tmp_path / 'run'}", f"--export_hf={out}"]
    (tmp_path / "hf.partial").write_text("not a folder")
    proc = run_train(command, nproc=2, check=False)
    said = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1 and sorted(said) == [
        f"error: --export_hf: cannot write {out}.partial: File exists",
        "error: --export_hf: rank 0 could not write its part (its line says why)"], proc.stderr[-3000:]
    assert not out.exists()
    os.remove(tmp_path / "hf.partial")
    assert "making it now" in run_train(command, nproc=2).stdout
    files = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(files) > 2 and sorted(set(weight_map.values())) == files
    assert sum(len(load_file(out / n)) for n in files) == len(weight_map)
    full = tmp_path / "full"
    fault = (f"import sys, errno; sys.path.insert(0, {ROOT!r}); from tools import export_hf as X; from components import "
             f"out_dir as OD; real = OD.write_safetensors_streaming\n"
             f"def write(path, *a, **k):\n    if path.endswith({files[1]!r}): raise OSError(errno.ENOSPC, "
             f"'No space left on device', path)\n    return real(path, *a, **k)\n"
             f"OD.write_safetensors_streaming = write; sys.exit(X.main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", fault, str(tmp_path / "run"), str(full), "--shard_gb=0.00002"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1].startswith(
        f"error: --export_hf: cannot write {full}.partial/{files[1]}: No space left on device (the filesystem is full")
    assert not full.exists() and not os.path.exists(f"{full}.partial")


def folder_files(root) -> dict:
    """Every file under `root` (its path relative to `root`) and its modification time."""
    return {os.path.relpath(os.path.join(d, n), root): os.stat(os.path.join(d, n)).st_mtime_ns
            for d, _, names in os.walk(root) for n in names}


def stop_flags(folder, cfg, root) -> list[str]:
    from common import learnable_tokens
    data = learnable_tokens(str(root / "tok.npy"), cfg.vocab_size, n=2000)
    return [f"--init_from={folder}", f"--data={data}", "--dtype=float32", "--seq_len=16", "--batch_size=4",
            "--micro_batch_size=4", "--steps=3", "--warmup_steps=1", "--eval_every=0", "--export_shard_gb=0.000005"]


def same_export(a, b):
    """Two --export_hf folders hold the same files: the same tensors, byte-equal other files."""
    from safetensors.torch import load_file
    names = sorted(os.listdir(a))
    assert sorted(os.listdir(b)) == names and "model.safetensors.index.json" in names
    for name in names:
        if name.endswith(".safetensors"):
            theirs, ours = load_file(a / name), load_file(b / name)
            assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs), name
        else:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_a_stop_in_the_last_step_leaves_the_export_to_the_same_command(instruct_folder, main_in_process, tmp_path,
                                                                       monkeypatch, capsys):
    """A stop request (SIGUSR1, a time limit's) during the last step saves it and skips the final export, which
    is not part of a stop's lead: rank 0 says so, and the same command run again (a requeue) makes the export
    from the finished checkpoint alone, over a crashed export's DIR.partial, equal tensor for tensor and file
    for file to an uninterrupted run's; run once more, it says the run is finished and writes nothing. Before,
    the re-run only printed how to export by hand, and an unattended run ended without its export."""
    import train as T
    folder, cfg, _, _ = instruct_folder
    flags = stop_flags(folder, cfg, tmp_path)
    uninterrupted, stopped = tmp_path / "a", tmp_path / "b"
    assert main_in_process(flags + [f"--out_dir={uninterrupted}", f"--export_hf={uninterrupted / 'hf'}"]) == 0
    command = flags + [f"--out_dir={stopped}", f"--export_hf={stopped / 'hf'}"]
    real_train_step = T.train_step

    def signalled_in_step_3(cfg, sharded, windows, step, position):
        if step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)  # what launch.sh forwards before the time limit
        return real_train_step(cfg, sharded, windows, step, position)
    monkeypatch.setattr(T, "train_step", signalled_in_step_3)
    capsys.readouterr()
    assert main_in_process(command) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"stopping at step 3 on SIGUSR1 (the last step): the export to {stopped / 'hf'} was not made; the same "
        f"command makes it")
    assert not (stopped / "hf").exists()
    assert (stopped / "checkpoints" / "latest").read_text() == "step_00000003\n"

    monkeypatch.setattr(T, "train_step", real_train_step)
    os.makedirs(f"{stopped / 'hf'}.partial")  # an earlier export attempt that crashed
    (stopped / "hf.partial" / "model.safetensors").write_bytes(b"torn")
    run_before = folder_files(stopped)
    assert main_in_process(command) == 0
    out = capsys.readouterr().out.splitlines()
    ckpt = stopped / "checkpoints" / "step_00000003"
    assert out[0] == (f"already at step 3 of 3 ({ckpt}); raise --steps to continue; its export to {stopped / 'hf'} "
                      f"was not made (a stop in the last step?): making it now")
    assert f"read checkpoint {ckpt} (step 3)" in out
    assert out[-1].startswith(f"exported a Hugging Face folder to {stopped / 'hf'} (tokenizer files copied from "
                              f"{folder}")
    assert not os.path.exists(f"{stopped / 'hf'}.partial")
    after = folder_files(stopped)
    kept = [k for k in run_before if k.startswith(("checkpoints", "metrics"))]  # .lock: this run's claim
    assert len(kept) >= 4 and {k: after[k] for k in kept} == {k: run_before[k] for k in kept}  # no step, save, log
    assert sorted(k for k in after if k.startswith(("checkpoints", "metrics"))) == sorted(kept)
    same_export(uninterrupted / "hf", stopped / "hf")

    exported = folder_files(stopped)
    assert main_in_process(command) == 0
    assert capsys.readouterr().out.splitlines() == [f"already at step 3 of 3 ({ckpt}); raise --steps to continue"]
    assert folder_files(stopped) == exported


def test_a_finished_run_without_its_export_exports_at_another_world_size(instruct_folder, main_in_process, tmp_path):
    """The export of a finished run whose --export_hf is missing needs only its checkpoint's weights: the same
    command at W=2 makes it (--batch_size 4 of --micro_batch_size 4, which W=2 cannot train with, is not
    refused), equal to the W=1 run's own export."""
    from common import run_train
    folder, cfg, _, _ = instruct_folder
    flags = stop_flags(folder, cfg, tmp_path)
    done, again = tmp_path / "a", tmp_path / "b"
    assert main_in_process(flags + [f"--out_dir={done}", f"--export_hf={done / 'hf'}"]) == 0
    shutil.copytree(done, again, ignore=shutil.ignore_patterns("hf"))
    proc = run_train(flags + [f"--out_dir={again}", f"--export_hf={again / 'hf'}"], nproc=2)
    assert f"exported a Hugging Face folder to {again / 'hf'}" in proc.stdout
    same_export(done / "hf", again / "hf")
