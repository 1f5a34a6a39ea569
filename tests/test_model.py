"""Model parity: our Llama (Qwen3) computes the same logits as transformers' LlamaForCausalLM (Qwen3ForCausalLM),
fp32, <= 1e-5."""
import pytest
import torch
from common import M, hf_model, ours_from_hf, small_config
from components import hf


SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("scaling", [None, SCALING])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_logits_match_hf(tied, scaling, kv_heads):
    cfg = small_config(tie_embeddings=tied, rope_scaling=scaling, n_kv_heads=kv_heads)
    ref = hf_model(cfg)
    ours = ours_from_hf(cfg, ref)
    tokens = torch.randint(0, cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(tokens).logits
        got = ours(tokens)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def qwen3_config(**overrides) -> M.ModelConfig:
    """A small Qwen3: QK-norm, and a head_dim (12) that is not dim / n_heads (8), as in Qwen3-0.6B (128 vs 64)."""
    return small_config(family="qwen3", qk_norm=True, head_dim=12, norm_eps=1e-6, **overrides)


def olmo2_config(**overrides) -> M.ModelConfig:
    """A small OLMo-2: norms after attention and the MLP, QK-norm over the whole projections."""
    return small_config(family="olmo2", **M.FAMILIES["olmo2"]["model_fields"], **overrides)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("make_config,hf_class", [(qwen3_config, "Qwen3ForCausalLM"), (olmo2_config, "Olmo2ForCausalLM")],
                         ids=["qwen3", "olmo2"])
def test_each_familys_logits_match_hf(tied, make_config, hf_class):
    cfg = make_config(tie_embeddings=tied)
    ref = hf_model(cfg)
    assert type(ref).__name__ == hf_class
    ours = ours_from_hf(cfg, ref)  # strict: every tensor (q_norm, post_feedforward_layernorm) is named as HF's
    tokens = torch.randint(0, cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), ref(tokens).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make_config", [small_config, qwen3_config, olmo2_config], ids=["llama", "qwen3", "olmo2"])
def test_every_norm_gives_transformers_bits_in_bf16(make_config):
    """In bf16 the order of an RMSNorm's last two operations shows: OLMo-2's multiplies by its weight in fp32 and
    then casts, Llama's and Qwen3's cast first. Every norm of ours (each block's, the QK-norms, the final one)
    gives transformers' bits for the same module on the same bf16 input."""
    cfg = make_config()
    ref = hf_model(cfg)
    ours = ours_from_hf(cfg, ref).to(torch.bfloat16)
    ref = ref.to(torch.bfloat16)
    norms = [(name, module) for name, module in ours.named_modules() if isinstance(module, M.RMSNorm)]
    assert any(name == "norm" for name, _ in norms) and len(norms) >= 2 * cfg.n_layers + 1
    for name, module in norms:
        x = torch.randn(4, module.weight.numel(), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(module(x), ref.model.get_submodule(name)(x)), name


def test_each_family_round_trips_through_its_config_json():
    """config_to_hf writes the family's model_type and class, transformers' config class reads it, and
    config_from_hf gives the same ModelConfig back; the keys only the family has (its row's config_keys) are kept
    as config.json gives them and written back without the source folder (a checkpoint's export); a family's
    options another family lacks are refused."""
    import transformers
    for cfg in (small_config(), qwen3_config(), olmo2_config()):
        family = M.FAMILIES[cfg.family]
        config = hf.config_to_hf(cfg, torch.float32)
        assert config["model_type"] == cfg.family and config["architectures"] == [family["hf_class"]]
        assert hf.config_from_hf(config) == cfg
        read = getattr(transformers, family["hf_config_class"]).from_dict(config)
        assert (read.head_dim, read.num_key_value_heads) == (cfg.head_dim, cfg.n_kv_heads)
        assert {key: config[key] for key in family["config_keys"]} == family["config_keys"]
    qwen3 = hf.config_to_hf(qwen3_config(), torch.float32)
    published = dict(qwen3, max_window_layers=7, sliding_window=4096)  # inert while use_sliding_window is false
    exported = hf.config_to_hf(hf.config_from_hf(published), torch.float32)
    assert (exported["max_window_layers"], exported["sliding_window"]) == (7, 4096)
    assert M.PRESETS["qwen3-8b"]().family_keys == dict(use_sliding_window=False, sliding_window=None, max_window_layers=36)
    assert hf.check_hf_config(dict(qwen3, rope_scaling=dict(rope_type="yarn", factor=4.0))) == [
        "rope type 'yarn' is not supported for qwen3 (only default)"]
    assert hf.check_hf_config(dict(qwen3, use_sliding_window=True)) == [
        "use_sliding_window true is not supported (only full attention)"]
    # By meaning, not as one string: a fork that adds a family (a row of M.FAMILIES) changes the list, not this test.
    [refused] = hf.check_hf_config(dict(qwen3, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"]))
    said, known = refused.split("; known: ")
    assert said == "model_type 'qwen3_moe' (architectures Qwen3MoeForCausalLM) is not a family this code builds"
    assert known.split(", ") == [f"model_type {name!r} with {family['hf_class']}" for name, family in M.FAMILIES.items()]
    assert {"llama", "qwen3"} <= set(M.FAMILIES)


def _published_form(cfg):
    d = hf.config_to_hf(cfg, torch.float32)
    assert "rope_parameters" not in d and d["rope_scaling"]["rope_type"] == "llama3"
    return d


def _rope_parameters_form(cfg):
    d = hf.config_to_hf(cfg, torch.float32)
    d["rope_parameters"] = dict(d.pop("rope_scaling"), rope_theta=d.pop("rope_theta"))
    return d


@pytest.mark.parametrize("make_form", [_published_form, _rope_parameters_form])
def test_both_config_json_forms(make_form):
    cfg = small_config(rope_scaling=SCALING, rope_theta=50000.0)
    hf_dict = make_form(cfg)
    parsed = hf.config_from_hf(hf_dict)
    assert parsed == cfg
    ref = hf_model(parsed, hf_config=hf_dict)
    ours = ours_from_hf(parsed, ref)
    tokens = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), ref(tokens).logits, rtol=1e-5, atol=1e-5)


def test_presets_have_published_sizes():
    total = {name: M.count_params(f())["total"] for name, f in M.PRESETS.items()}
    assert round(total["llama3-8b"] / 1e9, 2) == 8.03
    assert round(total["llama3-70b"] / 1e9, 2) == 70.55
    assert round(total["llama3.2-1b"] / 1e9, 2) == 1.24
    assert round(total["llama3.2-3b"] / 1e9, 2) == 3.21
    # Qwen3 (its report's Table 1 and model cards: 0.6B, 1.7B, 4.0B, 8.2B, 14.8B, 32.8B)
    assert [round(total[f"qwen3-{s}"] / 1e9, 1) for s in ("0.6b", "1.7b", "4b", "8b", "14b", "32b")] == [
        0.6, 1.7, 4.0, 8.2, 14.8, 32.8]
    for cfg in (M.tiny(), qwen3_config(), qwen3_config(tie_embeddings=True)):
        assert M.count_params(cfg)["total"] == sum(p.numel() for p in M.Llama(cfg).parameters())


def test_a_routed_models_active_parameters_are_its_published_count():
    """ModelConfig's n_experts and experts_per_token (an MoE fork's): count_params counts every expert in "total"
    and the experts_per_token a token runs in "active", what flops_per_token (MFU) counts. Mixtral-8x7B's shapes
    (its config.json: 8 experts, 2 per token; Jiang et al. 2024): 46.7B parameters, 12.9B active."""
    mixtral = M.ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                            n_experts=8, experts_per_token=2)
    counts = M.count_params(mixtral)
    assert (round(counts["total"] / 1e9, 1), round(counts["active"] / 1e9, 1)) == (46.7, 12.9)
    assert counts["total"] - counts["active"] == 32 * 6 * 3 * 4096 * 14336  # 6 idle experts of 3 matrices per block
    assert M.flops_per_token(mixtral, 4096) == 6 * (counts["active"] - counts["embedding"]) + 12 * 32 * 4096 * 4096
    dense = M.PRESETS["llama3-8b"]()
    assert M.count_params(dense)["active"] == M.count_params(dense)["total"]


def test_bad_shapes_are_reported():
    assert "n_kv_heads=3 must divide n_heads=4" in M.check_model_config(small_config(n_kv_heads=3))[0]
    assert "n_heads=5 must divide dim=32" in M.check_model_config(small_config(n_heads=5, n_kv_heads=1))[0]


def test_lr_schedule_warms_up_then_cosines_to_ten_percent():
    import train as T
    cfg = T.TrainConfig(lr=1.0, warmup_steps=10, steps=110, schedule="cosine")
    assert T.lr_at(cfg, 1) == 0.1 and T.lr_at(cfg, 10) == 1.0
    assert abs(T.lr_at(cfg, 60) - 0.55) < 1e-12 and abs(T.lr_at(cfg, 110) - 0.1) < 1e-12
    assert all(T.lr_at(cfg, s) > T.lr_at(cfg, s + 1) for s in range(10, 110))
    assert T.lr_at(T.TrainConfig(lr=2.0, warmup_steps=0, schedule="constant"), 50) == 2.0


def test_default_dtype_is_bf16_on_gpus_and_fp32_on_cpus():
    """--dtype auto (the default): a CPU without native bf16 matmuls runs bf16 about 16x slower than
    fp32, which made the default job take over an hour on a 2-core machine."""
    import torch
    import train as T
    assert T.TrainConfig().dtype == "auto"
    assert T.compute_dtype("auto", torch.device("cuda", 0)) is torch.bfloat16
    assert T.compute_dtype("auto", torch.device("cpu")) is torch.float32
    assert T.compute_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    assert T.compute_dtype("float32", torch.device("cuda", 0)) is torch.float32


def test_partial_checkpointing_gives_each_block_its_policy():
    import train as T
    assert M.block_policies(4, "full") == ["full"] * 4
    assert M.block_policies(4, "full", 1, "selective") == ["full", "selective", "selective", "selective"]
    assert M.block_policies(4, "selective", 0) == ["none"] * 4
    assert M.block_policies(4, "full", 9) == ["full"] * 4
