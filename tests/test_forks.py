"""A fork's new parameters from a Hugging Face folder: --init_from a folder that lacks a fork's units takes the units
it holds and initialises the others by model.init_parameter (the fork's init hook), one line naming both; a folder
lacking any of the family's own tensors (config.json says 4 blocks, the files hold 2) is refused. The forks are
tests/dist_worker.py's: LoRA (B zero: it starts as the base model) and DoRA (its magnitude the base weight's row
norms, gathered from another unit), against oracles computed here in fp32. Multi-process gloo on CPU."""
import json
import math
import os

import pytest
import torch
from common import (DIST_WORKER, hf_model, learnable_tokens, ours_from_hf, read_metrics, run_script, run_train, save_hf,
                    small_config)
from ranks import run_ranks
from safetensors.torch import load_file, save_file

import model as M
from components import hf
import train as T

FLAGS = ["--seq_len=16", "--batch_size=4", "--micro_batch_size=2", "--dtype=float32", "--seed=3", "--warmup_steps=0",
         "--eval_every=0"]
BASE = r"layers\.\d+\.(?!.*(lora_|magnitude))|embed_tokens|norm|lm_head"  # all but the adapters: frozen


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A Llama saved by transformers (the base model, its oracle) and tokens to train on."""
    root = tmp_path_factory.mktemp("forks")
    ref = hf_model(small_config(), seed=5)
    return dict(root=root, ref=ref, init=save_hf(ref, str(root / "init")),
                data=learnable_tokens(str(root / "tokens.npy"), 97, n=3000, eos_id=2))


def run_fork(mode: str, folder, out: str, nproc: int, *flags):
    proc = run_script(DIST_WORKER, [mode, out, *FLAGS, f"--init_from={folder['init']}", f"--data={folder['data']}",
                                    f"--out_dir={out}", f"--freeze={BASE}", *flags], nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc


def started_line(proc) -> list:
    return [line for line in proc.stdout.splitlines() if line.startswith("started from the weights")]


def fork(monkeypatch, block, units, init):
    """The fork's three changes to model.py."""
    monkeypatch.setattr(M, "Block", block)
    monkeypatch.setattr(M, "sharding_units", units)
    monkeypatch.setattr(M, "init_parameter", init)


def fork_units(args: list):
    """The units of one rank of W=1 (in a process group of one: run_ranks) as train.setup starts them from `args`."""
    cfg = T.parse_args(args)
    mcfg, weights, errors = hf.check_start(cfg)
    assert errors == [], errors
    units = T.build_sharded_model(cfg, mcfg, 0, 1, torch.device("cpu")).units
    line = hf.init_weights(cfg, mcfg, units, weights)
    return mcfg, units, line


def whole(units) -> dict:
    """Our name -> the whole fp32 tensor, from units of one process."""
    return {slot.name: unit.master_shard[slot.offset:slot.offset + math.prod(slot.shape)].view(slot.shape)
            for unit in units for slot in unit.slots}


def test_a_lora_fork_starts_from_a_hugging_face_folder_as_the_base_model_and_trains(folder, monkeypatch):
    """The folder's units taken, the adapters new (one line); the fork's logits before any step are the base model's
    bit for bit (B zero: lora_init_parameter); at W=2 it trains the adapters, its first loss the plain model's."""
    from dist_worker import LoraBlock, lora_init_parameter, lora_units
    from test_parity import checkpoint_weights
    root, init = folder["root"], folder["init"]
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = ours_from_hf(small_config(), folder["ref"])(tokens)
    fork(monkeypatch, LoraBlock, lora_units, lora_init_parameter)
    mcfg, units, line = run_ranks(1, lambda rank: fork_units([f"--init_from={init}", f"--out_dir={root / 'x'}"]))[0]
    assert line == (f"started from the weights of Hugging Face folder {init}; taken: embed, layers.0-1, head; new, "
                    f"initialised as a run from scratch (--seed 0): layers.0-1.lora")
    model = M.Llama(mcfg)
    model.load_state_dict(whole(units), strict=True)
    assert torch.equal(model(tokens), plain)

    proc = run_fork("lora", folder, str(root / "lora"), 2, "--steps=2", "--lr=1e-2")
    assert started_line(proc) == [
        f"started from the weights of Hugging Face folder {init}; taken: embed, layers.0-1, head; new, initialised as "
        f"a run from scratch (--seed 3): layers.0-1.lora"]
    run_train([*FLAGS, f"--init_from={init}", f"--data={folder['data']}", f"--out_dir={root / 'plain'}", "--steps=1"],
              nproc=2)
    fork_metrics, plain_metrics = read_metrics(root / "lora"), read_metrics(root / "plain")
    assert [m["step"] for m in fork_metrics] == [1, 2] and fork_metrics[0]["loss"] == plain_metrics[0]["loss"]
    got = checkpoint_weights(os.path.join(root, "lora", "checkpoints", "step_00000002"), units)
    oracle = dict(folder["ref"].named_parameters())
    assert all(torch.equal(got[name], oracle[name]) for name in oracle)  # the base: frozen
    assert all(got[name].abs().min() > 0 for name in got if name.endswith("lora_b"))  # the adapters: trained


@pytest.mark.parametrize("world", [1, 2])
def test_a_dora_forks_magnitudes_start_as_the_norms_of_the_base_weights_rows(folder, world, monkeypatch):
    """The DoRA fork (dist_worker.DoraBlock) from the folder at W: each magnitude is its base weight's row norms, the
    oracle's (transformers' weights of the folder, fp32) exactly: dora_init_parameter reads that weight from another
    unit (weight_of: all-gathered). One step at lr 1e-30 moves nothing but B (zero before it)."""
    from dist_worker import DoraBlock, dora_init_parameter, dora_units
    from test_parity import checkpoint_weights
    out = str(folder["root"] / f"dora{world}")
    proc = run_fork("dora", folder, out, world, "--steps=1", "--lr=1e-30", "--weight_decay=0")
    assert started_line(proc) == [
        f"started from the weights of Hugging Face folder {folder['init']}; taken: embed, layers.0-1, head; new, "
        f"initialised as a run from scratch (--seed 3): layers.0-1.dora"]
    fork(monkeypatch, DoraBlock, dora_units, dora_init_parameter)
    cfg = T.parse_args([f"--init_from={folder['init']}", f"--out_dir={out}"])
    units = T.build_sharded_model(cfg, hf.model_config(cfg), 0, 1, torch.device("cpu")).units
    got = checkpoint_weights(os.path.join(out, "checkpoints", "step_00000001"), units)
    oracle = dict(folder["ref"].named_parameters())
    magnitudes = [name for name in got if name.endswith(".magnitude")]
    assert len(magnitudes) == 4
    for name in magnitudes:
        assert torch.equal(got[name], oracle[name.removesuffix("magnitude") + "weight"].detach().norm(dim=1)), name
    assert all(got[name].abs().max() < 1e-28 for name in got if name.endswith("lora_b"))
    seeded = whole(run_ranks(1, lambda rank: fork_units([f"--init_from={folder['init']}", f"--out_dir={out}",
                                                           "--seed=3"]))[0][1])  # A: the unit's seeded draws
    assert all(torch.equal(got[M.hf_name(n)], seeded[n]) for n in seeded if n.endswith("lora_a"))


def test_a_folder_lacking_blocks_of_the_family_or_part_of_a_forks_unit_is_refused(folder, tmp_path, monkeypatch):
    """config.json says 4 blocks, the files hold 2: blocks 2-3 are the family's, never a fork's new units (refused as
    a plain model refuses them). A fork's unit the files hold in part (block 1's lora_b lost) is a damaged folder;
    whole, it is taken."""
    from dist_worker import LoraBlock, lora_init_parameter, lora_units
    fork(monkeypatch, LoraBlock, lora_units, lora_init_parameter)
    short = tmp_path / "short"
    save_hf(folder["ref"], str(short))
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=4)))
    args = [f"--out_dir={tmp_path / 'out'}", "--steps=1"]
    assert hf.check_start(T.parse_args([f"--init_from={short}", *args]))[2] == [
        f"--init_from: tensor model.layers.2.input_layernorm.weight (and 17 more) is missing from the safetensors "
        f"files in {short}"]

    partial = tmp_path / "partial"
    save_hf(folder["ref"], str(partial))
    tensors = load_file(str(partial / "model.safetensors"))
    tensors |= {"model.layers.0.lora_a": torch.zeros(2, 32), "model.layers.0.lora_b": torch.zeros(32, 2),
                "model.layers.1.lora_a": torch.zeros(2, 32)}
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    assert hf.check_start(T.parse_args([f"--init_from={partial}", *args]))[2] == [
        f"--init_from: tensor model.layers.1.lora_b of unit layers.1.lora is missing from the safetensors files in "
        f"{partial}, which hold its other tensors: a damaged folder (a fork's new parameters start from it only as "
        f"whole units of their own: model.sharding_units)"]
    save_file(tensors | {"model.layers.1.lora_b": torch.zeros(32, 2)}, str(partial / "model.safetensors"),
              metadata={"format": "pt"})  # a fork's own folder, its adapters whole under their names: taken
    assert hf.check_start(T.parse_args([f"--init_from={partial}", *args]))[2] == []


def test_a_dora_forks_export_is_a_plain_llama_that_computes_the_fork(folder, monkeypatch, capsys):
    """The export hook (model.hf_tensors) of the DoRA fork merges each adapter into the projection it adapts: after
    two steps at W=2 (B no longer zero), tools/export_hf.py makes a folder LlamaForCausalLM loads as is, whose logits
    are the fork's, computed from the checkpoint's weights (1e-5). Without the hook the adapter's tensors would be
    written under their own names, which the export check refuses in one line (from_pretrained would drop them)."""
    from transformers import LlamaForCausalLM
    from dist_worker import DoraBlock, dora_hf_tensors, dora_init_parameter, dora_units
    from tools import export_hf as X
    out = str(folder["root"] / "dora-export")
    run_fork("dora", folder, out, 2, "--steps=2", "--lr=1e-2", "--weight_decay=0")
    capsys.readouterr()
    assert X.main([out, str(folder["root"] / "unmerged"), "--dtype=float32"]) == 2  # a restart repeats it
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        "error: --export_hf: tensor model.layers.0.self_attn.q_proj.lora_a (and 11 more) of this model is not in the "
        "LlamaForCausalLM that transformers builds from the exported config.json")
    monkeypatch.setattr(M, "hf_tensors", dora_hf_tensors)
    assert X.main([out, str(folder["root"] / "merged"), "--dtype=float32"]) == 0
    fork(monkeypatch, DoraBlock, dora_units, dora_init_parameter)
    path = os.path.join(out, "checkpoints", "step_00000002")
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    reader = X.CheckpointReader(path, manifest, set())
    ours = M.Llama(M.ModelConfig(**manifest["model"])).float()
    ours.load_state_dict({name: reader.weight_of(name) for name, _ in ours.named_parameters()})
    assert reader.weight_of("layers.0.self_attn.q_proj.lora_b").abs().max() > 0  # the adapters trained
    theirs = LlamaForCausalLM.from_pretrained(str(folder["root"] / "merged"), torch_dtype=torch.float32)
    tokens = torch.arange(1, 33).view(2, 16) % 97
    with torch.no_grad():
        assert torch.allclose(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
