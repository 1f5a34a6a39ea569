"""The tests' own helpers on the trainer's paths: ours_from_hf reads a Hugging Face model by the names on disk, as
--init_from does; a stand-in unit carries every field the trainer's disk code reads of a unit."""
import os
import re

import torch
import torch.nn.functional as F
from common import ROOT, hf_model, ours_from_hf, small_config, stand_in_unit

import model as M
from components import hf

MIXTRAL = dict(hf_class="MixtralForCausalLM", hf_config_class="MixtralConfig", model_fields={}, rope_types=("default",),
               config_keys=dict(num_local_experts=8, num_experts_per_tok=2))


class Expert(torch.nn.Module):
    def __init__(self, cfg: M.ModelConfig):
        super().__init__()
        self.w1 = torch.nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w2 = torch.nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down
        self.w3 = torch.nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoe(torch.nn.Module):
    """Mixtral's routed MLP under its names on disk: each token through its top-k experts, weighted by their
    renormalised router probabilities (computed densely: every expert on every token, weight 0 where unrouted)."""

    def __init__(self, cfg: M.ModelConfig):
        super().__init__()
        self.top_k = cfg.family_keys["num_experts_per_tok"]
        self.gate = torch.nn.Linear(cfg.dim, cfg.family_keys["num_local_experts"], bias=False)
        self.experts = torch.nn.ModuleList(Expert(cfg) for _ in range(cfg.family_keys["num_local_experts"]))

    def forward(self, x):
        probs = torch.softmax(self.gate(x).float(), -1)
        top, index = torch.topk(probs, self.top_k, -1)
        weights = torch.zeros_like(probs).scatter(-1, index, top / top.sum(-1, keepdim=True)).to(x.dtype)
        return sum(weights[..., e:e + 1] * expert(x) for e, expert in enumerate(self.experts))


class MixtralBlock(M.Block):
    """A fork's block: Llama's attention, Mixtral's `block_sparse_moe` for the MLP."""

    def __init__(self, cfg: M.ModelConfig):
        super().__init__(cfg)
        del self.mlp
        self.block_sparse_moe = SparseMoe(cfg)

    def mlp(self, h):  # what Block.forward calls: the routed MLP, under Mixtral's name for it
        return self.block_sparse_moe(h)


def test_ours_from_hf_reads_a_forks_weights_by_their_names_on_disk(monkeypatch):
    """transformers 5 holds each Mixtral layer's experts fused in memory (mlp.experts.gate_up_proj) and writes a weight
    per expert on disk (block_sparse_moe.experts.E.w1.weight), which --init_from reads: ours_from_hf reads those, so a
    Mixtral fork of model.Block gets transformers' logits (ref.state_dict()'s in-memory names fit no fork of ours)."""
    monkeypatch.setitem(M.FAMILIES, "mixtral", MIXTRAL)
    monkeypatch.setattr(M, "Block", MixtralBlock)
    cfg = hf.config_from_hf(dict(hf.config_to_hf(small_config(), torch.float32), model_type="mixtral",
                                 architectures=["MixtralForCausalLM"], num_local_experts=3))
    ref = hf_model(cfg, seed=4)
    assert "model.layers.0.mlp.experts.gate_up_proj" in ref.state_dict()  # transformers 5's in-memory names
    ours = ours_from_hf(cfg, ref)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), ref(tokens).logits, rtol=1e-5, atol=1e-5)


def unit_fields_read() -> set:
    """What components/checkpoints.py's docstring lists of a unit, and every `unit.FIELD` or `u.FIELD` that
    checkpoints.py and hf.py read."""
    fields = set()
    for path in ("checkpoints.py", "hf.py"):
        with open(os.path.join(ROOT, "components", path)) as f:
            source = f.read()
        fields |= set(re.findall(r"\bu(?:nit)?\.([a-z_]+)\b(?!\()", source))  # fields, not methods
    with open(os.path.join(ROOT, "components", "checkpoints.py")) as f:
        listed = re.search(r"All this file needs of train\.py's units: (.*?)\n\n", f.read(), re.S).group(1)
    return fields | set(re.findall(r"`([a-z_]+)`", listed))


def test_a_stand_in_unit_carries_every_field_the_trainers_disk_code_reads():
    """tests' stand-ins for train.py's units (common.stand_in_unit) have what checkpoints.py's interface lists (`name`
    among them) and every field checkpoints.py and hf.py read, so a test of either exercises the code as a run does;
    a shard of a padded unit is its own rank's."""
    required = unit_fields_read()
    assert {"name", "numel", "slots", "master_shard", "optimizer_state"} <= required
    unit = stand_in_unit("u1", numel=7, rank=1, world=2)
    assert required <= set(vars(unit)), required - set(vars(unit))
    assert (unit.padded_numel, unit.shard_numel, unit.shard_start, len(unit.master_shard)) == (8, 4, 4, 4)
    assert set(unit.optimizer_state) == set(M.OPTIMIZER_STATE)
