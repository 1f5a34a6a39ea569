"""What each rank holds (counted tensor by tensor), --ac equivalence, HF round trips, and W-independence."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from common import ROOT, hf_model, learnable_tokens, read_metrics, run_train, save_hf, small_config

TINY = ["--seq_len=64", "--batch_size=12", "--micro_batch_size=1", "--dtype=float32"]


def run_worker(mode, tmp_path, nproc, flags):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "tests", "dist_worker.py"), mode, str(tmp_path), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(nproc)]


@pytest.mark.parametrize("world", [1, 3])
def test_each_rank_holds_one_wth_and_nothing_stays_gathered(tmp_path, world):
    results = run_worker("memory", tmp_path, world, TINY + ["--steps=2", "--ac=selective"])
    for r in results:
        # master + m + v + grad, fp32, each 1/W of the padded model: 16 bytes per parameter / W.
        assert r["persistent_bytes"] == 16 * r["padded_numel"] // world
        assert r["padded_numel"] - r["numel"] < world * len(r["shard_numel"])  # padding < W per unit
        # Every tensor alive in the process after two steps is persistent state: no full-size copy,
        # no leftover gathered buffer or gradient, nothing in the modules.
        assert r["live_tensor_bytes"] == r["persistent_bytes"], r
        assert r["gathered_after_step"] == [] and r["module_tensor_bytes"] == 0
        # At most the running unit and the prefetched one are gathered at any moment.
        assert r["most_gathered_at_once"] == 2
        # Reduce-scatters in flight are bounded (each holds a full-unit gradient): one, however many units
        # the model has; the hook waits for it before it casts the next unit's gradient.
        assert r["most_reduces_in_flight"] == 1 < r["n_units"]


def test_tied_model_gathers_at_most_three_units(tmp_path):
    cfg = small_config(tie_embeddings=True)
    init_dir = save_hf(hf_model(cfg), str(tmp_path / "init"))
    np.save(tmp_path / "tok.npy", np.random.default_rng(0).integers(0, cfg.vocab_size, 500).astype(np.int32))
    results = run_worker("memory", tmp_path, 2, ["--seq_len=16", "--batch_size=4", "--micro_batch_size=1",
                                                 "--dtype=float32", f"--init_from={init_dir}",
                                                 f"--data={tmp_path / 'tok.npy'}"])
    for r in results:
        assert r["live_tensor_bytes"] == r["persistent_bytes"] == 16 * r["padded_numel"] // 2
        assert r["most_gathered_at_once"] == 3  # head + the borrowed embedding + the prefetched block


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_activation_checkpointing_modes_give_the_same_gradients(tmp_path, dtype):
    results = run_worker("ac", tmp_path, 2, ["--seq_len=64", "--batch_size=4", "--micro_batch_size=2",
                                             f"--dtype={dtype}"])
    for r in results:
        assert r["none"]["grad_sq"] > 0
        assert len(r) == 7  # offload: --ac full --offload_activations true; "full 2 + none": --ac_blocks 2
        for mode in set(r) - {"none"}:
            assert r[mode]["loss"] == r["none"]["loss"]
            assert r[mode]["max_abs_diff"] == 0.0, (mode, r[mode])


def _hf_state(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


@pytest.mark.parametrize("dtype,world,sharded", [("float32", 3, True), ("bfloat16", 2, False)])
def test_hf_round_trip_is_identical(tmp_path, dtype, world, sharded):
    """--init_from then --export_hf (no training) gives back the same weights through from_pretrained,
    from a sharded checkpoint with an index to a sharded export, with sliced reads cutting rows."""
    cfg = small_config(dim=40, n_heads=5, n_kv_heads=1, ffn_dim=56)
    ref = hf_model(cfg).to(getattr(torch, dtype))
    ref.save_pretrained(tmp_path / "init", max_shard_size="20KB" if sharded else "5GB")
    assert os.path.isfile(tmp_path / "init" / "model.safetensors.index.json") == sharded
    run_train([f"--init_from={tmp_path / 'init'}", "--steps=0", f"--dtype={dtype}", f"--export_hf={tmp_path / 'out'}",
               f"--export_shard_gb={2e-5 if sharded else 5}", f"--out_dir={tmp_path}"], nproc=world)
    files = os.listdir(tmp_path / "out")
    assert ("model.safetensors.index.json" in files) == sharded and "config.json" in files
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f)["torch_dtype"] == dtype
    expected, got = ref.float().state_dict(), _hf_state(tmp_path / "out")
    assert set(got) == set(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_each_rank_reads_only_its_slice_of_the_checkpoint(tmp_path):
    """Sliced reads: rank r reads its 1/W of every tensor plus at most two partial rows per tensor, so
    no rank ever reads the whole model (the property that lets 70B load on 16 GPUs)."""
    cfg = small_config(dim=64, n_layers=3, ffn_dim=96, vocab_size=256)
    save_hf(hf_model(cfg), str(tmp_path / "init"))
    results = run_worker("load", tmp_path, 4, [f"--init_from={tmp_path / 'init'}", "--steps=0"])
    n_tensors = 2 + 9 * cfg.n_layers + 1
    for r in results:
        assert r["elements_read"] >= r["shard_elements"] - 4 * 8  # all of its slice (minus padding)
        assert r["elements_read"] <= r["shard_elements"] + 2 * n_tensors * cfg.ffn_dim
        assert r["elements_read"] < r["model_elements"] / 3


def test_initial_weights_and_batches_do_not_depend_on_world_size(tmp_path):
    """Seeded per-unit init on the full shape, and a batch order fixed by the seed: W=1 and W=3 export the
    same initial model and log the same first loss."""
    states, losses = [], []
    for world in (1, 3):
        out = tmp_path / f"w{world}"
        run_train(TINY + ["--steps=1", "--lr=1e-9", "--warmup_steps=0", f"--out_dir={out}",
                          f"--export_hf={out / 'hf'}", "--seed=7"], nproc=world)
        states.append(_hf_state(out / "hf"))
        losses.append(read_metrics(out)[0]["loss"])
    assert abs(losses[0] - losses[1]) < 1e-5 * losses[0]
    for name in states[0]:
        torch.testing.assert_close(states[0][name], states[1][name], rtol=0, atol=1e-6)


def test_fused_adamw_equals_the_written_out_reference():
    """train.adamw_step (PyTorch's fused kernel, decay by range) against adamw_step_reference (term for term,
    which the parity tests hold to torch.optim.AdamW): the same slices after three steps with clipping."""
    import model as M
    import train as T
    def units():  # build_units takes the parameters out of the model: one model each
        with torch.device("meta"):
            model = M.Llama(small_config(n_layers=1))
        return T.build_units(model, 1, 3, torch.device("cpu"), torch.float32)
    pair = [units(), units()]

    def state(unit):
        return dict(unit.optimizer_state, master_shard=unit.master_shard)
    gen = torch.Generator().manual_seed(0)
    for fused_unit, ref_unit in zip(*pair):
        for name in ("master_shard", "exp_avg", "exp_avg_sq"):
            value = torch.randn(fused_unit.shard_numel, generator=gen)
            value = value.abs() if name == "exp_avg_sq" else value
            state(fused_unit)[name].copy_(value)
            state(ref_unit)[name].copy_(value)
    # Some slice holds a norm weight (not decayed) between matrices (decayed).
    assert any(0 < sum(hi - lo for lo, hi in u.decay_ranges) < u.shard_numel for u in pair[0])
    cfg = T.TrainConfig(weight_decay=0.1)
    for step, scale in ((1, 1.0), (2, 0.5), (3, 1.0)):
        for fused_unit, ref_unit in zip(*pair):
            grad = torch.randn(fused_unit.shard_numel, generator=gen)
            fused_unit.grad_shard.copy_(grad * scale)  # train_step clips before the optimizer step
            ref_unit.grad_shard.copy_(grad * scale)
        T.adamw_step(pair[0], cfg, 1e-2, step)
        T.adamw_step_reference(pair[1], cfg, 1e-2, step)
    for fused_unit, ref_unit in zip(*pair):
        for name in ("master_shard", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state(fused_unit)[name], state(ref_unit)[name], rtol=1e-6, atol=1e-7)


def test_naive_step_equals_the_real_one(tmp_path):
    """train_step_naive (everything gathered, plain backward, reduce-scatter, AdamW written out) and
    train_step (gather/free per unit, prefetch, BackwardBoundary, async reduce-scatters, fused AdamW,
    selective checkpointing) from the same weights at W=2 with two micro-batches: the same losses, norms
    and slices for three steps, to fp32 rounding (the two AdamW kernels differ in the last bits)."""
    cfg = small_config()
    init_dir = save_hf(hf_model(cfg), str(tmp_path / "init"))
    data = learnable_tokens(str(tmp_path / "tok.npy"), cfg.vocab_size, n=2000)
    results = run_worker("naive", tmp_path, 2, ["--seq_len=32", "--batch_size=8", "--micro_batch_size=2",
                                                "--dtype=float32", "--lr=1e-2", "--warmup_steps=1", "--grad_clip=0.5",
                                                f"--init_from={init_dir}", f"--data={data}", f"--out_dir={tmp_path / 'out'}"])
    for r in results:
        real, naive = r["real"], r["naive"]
        assert real["grads_zero"] and naive["grads_zero"]
        for (loss, norm), (naive_loss, naive_norm) in zip(real["log"], naive["log"]):
            assert loss == pytest.approx(naive_loss, rel=1e-6) and norm == pytest.approx(naive_norm, rel=1e-5)
        assert max(norm for _, norm in real["log"]) > 0.5  # clipping is exercised
        for start, got, want in zip(r["start"], real["master"], naive["master"]):
            got, want, start = torch.tensor(got), torch.tensor(want), torch.tensor(start)
            # Per slice, as the parity tests compare weights: Adam's first steps move each weight by about
            # lr * sign(g), so a gradient within rounding of 0 may move either way in the two runs.
            assert (got - want).norm() / want.norm() < 1e-5, ((got - want).norm() / want.norm()).item()
            assert (got - start).norm() / start.norm() > 1e-3  # the steps moved the weights well beyond that
