"""--init_from loads a plain Llama or nothing. Qwen2 (q/k/v biases), Gemma (GELU, 1 + w norms) and Mistral
name their tensors as Llama does, so without these checks their weights load and train as a Llama without a
word. Each folder here is a tiny saved LlamaForCausalLM with its config.json or weight files edited."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from common import hf_model, save_hf, small_config

from components import hf
import model as M


@pytest.fixture(scope="module")
def llama_folders(tmp_path_factory):
    """A tiny Llama saved as one model.safetensors, and the same saved in several shards with an index."""
    root = tmp_path_factory.mktemp("hf")
    ref = hf_model(small_config(), seed=3)
    single = save_hf(ref, str(root / "single"))
    sharded = str(root / "sharded")
    ref.save_pretrained(sharded, safe_serialization=True, max_shard_size="10KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    return single, sharded


def edit_config(folder: str, **changes):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)


def edit_weights(folder: str, add=(), drop=(), file="model.safetensors"):
    path = os.path.join(folder, file)
    tensors = load_file(path)
    for name in drop:
        del tensors[name]
    for name, shape in add:
        tensors[name] = torch.randn(shape)
    save_file(tensors, path, metadata={"format": "pt"})


def qwen2(folder):  # what a Qwen2 folder differs in: its config.json names, and q/k/v biases
    edit_config(folder, model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    edit_weights(folder, add=[(f"model.layers.{i}.self_attn.{p}_proj.bias", (n,))
                              for i in range(2) for p, n in (("q", 32), ("k", 16), ("v", 16))])


def truncate(folder, file="model.safetensors"):
    path = os.path.join(folder, file)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def file_lacks_what_index_promises(folder):
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    edit_weights(folder, drop=["model.norm.weight"], file=weight_map["model.norm.weight"])


CASES = [  # (id, which folder, edit, what the one line says)
    ("qwen2", 0, qwen2, "--init_from: config.json: model_type 'qwen2' (architectures Qwen2ForCausalLM) is not a family this code "
     "builds; known: model_type 'llama' with LlamaForCausalLM"),  # and the other families: test_model.py
    ("gemma-like activation", 0, lambda d: edit_config(d, hidden_act="gelu_pytorch_tanh"),
     "--init_from: config.json: hidden_act 'gelu_pytorch_tanh' is not supported (only silu)"),
    ("attention_bias", 0, lambda d: edit_config(d, attention_bias=True),
     "--init_from: config.json: attention_bias true is not supported"),
    ("bias tensors", 0, lambda d: edit_weights(d, add=[("model.layers.0.self_attn.q_proj.bias", (32,)),
                                                       ("model.layers.1.self_attn.q_proj.bias", (32,))]),
     "model.safetensors holds model.layers.0.self_attn.q_proj.bias (and 1 more), which the LlamaForCausalLM "
     "described by config.json does not have: this is not a plain llama checkpoint"),
    ("rotary inv_freq", 0, lambda d: edit_weights(d, add=[("model.layers.0.self_attn.rotary_emb.inv_freq", (4,))]),
     "model.safetensors holds model.layers.0.self_attn.rotary_emb.inv_freq, which the LlamaForCausalLM"),
    ("lm_head beside tied embeddings", 0, lambda d: edit_config(d, tie_word_embeddings=True),
     "model.safetensors holds lm_head.weight, which the LlamaForCausalLM described by config.json does not have: "
     "this is not a plain llama checkpoint; config.json has tie_word_embeddings true"),
    ("truncated file", 0, truncate,
     "model.safetensors is not a readable safetensors file (Error while deserializing header: incomplete metadata, "
     "file not fully covered); download it again"),
    ("shard lacks a tensor", 1, file_lacks_what_index_promises,
     "--init_from: tensor model.norm.weight is missing from the safetensors files in"),
]


@pytest.mark.parametrize("which,edit,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_with_one_line(tmp_path, llama_folders, which, edit, message, train_at):
    """Every rank checks before any process group exists, the same code at any W: one case runs two ranks as
    processes (run_train), the others one rank in this process."""
    folder = shutil.copytree(llama_folders[which], tmp_path / "model")
    edit(str(folder))
    flags = [f"--init_from={folder}", "--steps=0", f"--out_dir={tmp_path / 'out'}"]
    code, stderr = train_at(flags, 2 if edit is qwen2 else 1, timeout=180)
    assert code != 0, "a folder that is not a plain Llama was loaded as one"
    # torchrun stops the other rank as soon as one exits: one or two lines.
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert 1 <= len(lines) <= 2 and all(message in line for line in lines), stderr[-3000:]
    assert 'train.py", line' not in stderr  # no traceback out of the trainer


@pytest.mark.parametrize("changes", [
    dict(model_type="mistral", architectures=["MistralForCausalLM"]),
    dict(model_type="gemma", architectures=["GemmaForCausalLM"], hidden_activation="gelu_pytorch_tanh"),
    dict(architectures=["LlamaForSequenceClassification"]),
    dict(model_type=None),
    dict(mlp_bias=True),
    dict(attention_dropout=0.1),
], ids=["mistral", "gemma", "classifier head", "no model_type", "mlp_bias", "attention_dropout"])
def test_config_that_is_not_plain_llama_is_refused(changes):
    config = hf.config_to_hf(small_config(), torch.float32)
    hf.config_from_hf(config)  # the plain Llama form is accepted...
    with pytest.raises(ValueError, match="^config.json: .* not"):  # ...and one change away from it is not
        hf.config_from_hf({k: v for k, v in dict(config, **changes).items() if v is not None})


def write_index(folder, weight_map):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return os.path.join(folder, "model.safetensors.index.json")


@pytest.mark.parametrize("name", ["../outside.safetensors", "ABSOLUTE", "sub/model.safetensors", "..", 5])
def test_a_weight_map_file_name_must_be_a_file_in_the_folder(tmp_path, name):
    """The index comes with a downloaded folder: a name in it that leads elsewhere (to a real safetensors
    file there, which reading would accept) is refused before any file is opened, as one line."""
    save_file({"model.norm.weight": torch.ones(4)}, str(tmp_path / "outside.safetensors"))
    name = str(tmp_path / "outside.safetensors") if name == "ABSOLUTE" else name
    folder = str(tmp_path / "model")
    index = write_index(folder, {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                 "model.norm.weight": name})
    with pytest.raises(ValueError) as e:
        hf.hf_file_of_tensors(folder)
    assert str(e.value) == (f"--init_from: {index} names {name!r} as the file of model.norm.weight, which is not "
                            f"a file name in {folder} (a '/' or '..'); download the model again")


def test_an_index_that_is_not_a_json_object_is_one_line(tmp_path):
    folder = str(tmp_path / "model")
    index = write_index(folder, {})
    open(index, "w").write("[]")
    with pytest.raises(ValueError, match=f"^--init_from: {index} is not a safetensors index"):
        hf.hf_file_of_tensors(folder)


def test_files_that_are_links_as_in_the_hub_cache_are_read(llama_folders, tmp_path):
    """huggingface_hub's cache: snapshots/<commit>/ holds links into ../../blobs/, one per file."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    os.makedirs(blobs)
    os.makedirs(snapshot)
    for name in os.listdir(llama_folders[1]):
        shutil.copy(os.path.join(llama_folders[1], name), blobs / f"blob-{name}")
        os.symlink(f"../../blobs/blob-{name}", snapshot / name)
    files = hf.hf_file_of_tensors(str(snapshot))
    assert files == {k: str(snapshot / os.path.basename(v)) for k, v in hf.hf_file_of_tensors(llama_folders[1]).items()}
