"""What each rank holds (counted tensor by tensor), --ac equivalence, HF round trips, and W-independence."""
import gc
import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from common import (DIST_WORKER, hf_model, learnable_tokens, live_tensor_bytes, run_script, run_train, save_hf,
                    small_config)
from ranks import config_and_data, run_ranks, sharded_model
import model as M
import train as T

TINY = ["--seq_len=64", "--batch_size=12", "--micro_batch_size=1", "--dtype=float32"]


@pytest.fixture(scope="module")
def tiny_tokens(tmp_path_factory) -> str:
    """--data for the tiny preset: learnable tokens in its vocabulary."""
    import model as M
    return learnable_tokens(str(tmp_path_factory.mktemp("data") / "tok.npy"), M.PRESETS["tiny"]().vocab_size)


def run_worker(mode, tmp_path, nproc, flags):
    proc = run_script(DIST_WORKER, [mode, str(tmp_path), *flags], nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(nproc)]


def memory(world: int, flags: list[str]) -> list[dict]:
    """Two train_steps on each of `world` ranks (threads of this process), counting how many units are
    gathered and how many reduce-scatters are in flight at once; then what stays alive after them."""
    cfg, mcfg, weights, windows = config_and_data(flags)
    units_of, most_gathered, most_reduces = {}, {}, {}
    original_start, original_finish = T.Unit.start_gather, T.finish_reduces

    def counting_start(unit):
        original_start(unit)
        rank = dist.get_rank()
        gathered_now = sum(u.state() != "free" for u in units_of[rank])
        most_gathered[rank] = max(most_gathered.get(rank, 0), gathered_now)

    def counting_finish(reduces_in_flight, keep=0):
        rank = dist.get_rank()
        most_reduces[rank] = max(most_reduces.get(rank, 0), len(reduces_in_flight))
        original_finish(reduces_in_flight, keep)

    def rank_steps(rank):
        sharded = sharded_model(cfg, mcfg, weights)
        units_of[rank] = sharded.units
        for step in (1, 2):
            T.train_step(cfg, sharded, windows, step, (step - 1) * cfg.batch_size)
        return sharded

    gc.collect()
    alive_before = live_tensor_bytes()
    T.Unit.start_gather, T.finish_reduces = counting_start, counting_finish
    try:
        ranks = run_ranks(world, rank_steps)
    finally:
        T.Unit.start_gather, T.finish_reduces = original_start, original_finish
    gc.collect()
    alive_bytes = live_tensor_bytes() - alive_before  # every rank's tensors: they share this process
    results = []
    for rank, sharded in enumerate(ranks):
        units, model = sharded.units, sharded.model
        results.append(dict(
            persistent_bytes=sum(u.persistent_bytes() for u in units),
            padded_numel=sum(u.padded_numel for u in units), numel=sum(u.numel for u in units),
            shard_numel=[u.shard_numel for u in units],
            gathered_after_step=[u.name for u in units if u.state() != "free" or u.gathered.grad is not None],
            module_tensor_bytes=sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()]),
            most_gathered_at_once=most_gathered[rank], most_reduces_in_flight=most_reduces[rank],
            n_units=len(units)))
    assert alive_bytes == sum(r["persistent_bytes"] for r in results), (alive_bytes, results)
    return results


@pytest.mark.parametrize("world", [1, 3])
def test_each_rank_holds_one_wth_and_nothing_stays_gathered(world, tiny_tokens):
    results = memory(world, TINY + ["--steps=2", "--ac=selective", f"--data={tiny_tokens}"])
    for r in results:
        # master + m + v + grad, fp32, each 1/W of the padded model: 16 bytes per parameter / W.
        assert r["persistent_bytes"] == 16 * r["padded_numel"] // world
        assert r["padded_numel"] - r["numel"] < world * len(r["shard_numel"])  # padding < W per unit
        # Every tensor alive after two steps is persistent state (memory() compares the bytes of every
        # tensor alive in the process with the ranks' state): no full-size copy, no leftover gathered
        # buffer or gradient, nothing in the modules.
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
    results = memory(2, ["--seq_len=16", "--batch_size=4", "--micro_batch_size=1", "--dtype=float32",
                         f"--init_from={init_dir}", f"--data={tmp_path / 'tok.npy'}", f"--out_dir={tmp_path}"])
    for r in results:
        assert r["persistent_bytes"] == 16 * r["padded_numel"] // 2
        assert r["most_gathered_at_once"] == 3  # head + the borrowed embedding + the prefetched block


@pytest.mark.parametrize("dtype,freeze", [("float32", ""), ("bfloat16", ""), ("float32", r"embed_tokens|layers\.0\.")],
                         ids=["float32", "bfloat16", "float32-frozen-prefix"])
def test_activation_checkpointing_modes_give_the_same_gradients(dtype, freeze, tiny_tokens):
    """The gradients of one step under each --ac setting, on each of 2 ranks: bit-identical to --ac none. With a
    frozen prefix (--freeze) the first trained block's input needs no gradient, and its weights still get theirs
    under every setting (--offload_activations' backward included)."""
    cfg, mcfg, weights, windows = config_and_data(["--seq_len=64", "--batch_size=4", "--micro_batch_size=2",
                                                   f"--dtype={dtype}", f"--data={tiny_tokens}", f"--freeze={freeze}"])
    modes = {"none": ("none", False, -1, "none"), "full": ("full", False, -1, "none"),
             "selective": ("selective", False, -1, "none"), "offload": ("full", True, -1, "none"),
             # partial checkpointing (--ac_blocks N --ac_rest R): the first N blocks --ac, the others R
             "full 2 + none": ("full", False, 2, "none"), "offload 1 + selective": ("full", True, 1, "selective"),
             "selective 3 + none": ("selective", False, 3, "none")}

    def rank_gradients(rank):
        sharded, grads = sharded_model(cfg, mcfg, weights), {}
        for mode, (policy, offload, ac_blocks, ac_rest) in modes.items():
            sharded.stages = T.make_stages(sharded.model, sharded.units, policy, offload, ac_blocks, ac_rest)
            losses, _ = T.forward_backward(cfg, sharded, windows, 1, 0)
            grads[mode] = ([u.grad_shard.clone() for u in sharded.units], losses["loss"].item())
            for u in sharded.units:
                u.grad_shard.zero_()
        return grads
    for grads in run_ranks(2, rank_gradients):
        base, base_loss = grads["none"]
        assert all(g.double().pow(2).sum().item() > 0 for g in base if g.numel()) and any(g.numel() for g in base)
        assert [g.numel() == 0 for g in base] == [n in ("embed", "layers.0") and bool(freeze)
                                                  for n, _ in M.sharding_units(M.Llama(mcfg))]
        for mode, (gs, loss) in grads.items():
            assert loss == base_loss, mode
            assert all(torch.equal(g, b) for g, b in zip(gs, base, strict=True)), mode


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


def test_initial_weights_and_batches_do_not_depend_on_world_size():
    """Seeded per-unit init on the full shape, and a batch order fixed by the seed: W=1 and W=3 start from
    the same weights (each unit's master shards gathered whole) and log the same first loss."""
    cfg, mcfg, weights, windows = config_and_data(TINY + ["--steps=1", "--lr=1e-9", "--warmup_steps=0", "--seed=7"])

    def first_weights_and_loss(rank):
        sharded = sharded_model(cfg, mcfg, weights)
        whole = {}
        for u in sharded.units:
            flat = torch.empty(u.padded_numel)
            T.all_gather_flat(flat, u.master_shard)
            whole[u.name] = flat[:u.numel]
        loss = T.train_step(cfg, sharded, windows, 1, 0)["loss"]
        return whole, loss
    (w1, loss1), (w3, loss3) = run_ranks(1, first_weights_and_loss)[0], run_ranks(3, first_weights_and_loss)[0]
    assert abs(loss1 - loss3) < 1e-5 * loss1
    assert w1.keys() == w3.keys() and len(w1) == mcfg.n_layers + 2
    for name in w1:
        torch.testing.assert_close(w1[name], w3[name], rtol=0, atol=1e-6)


def test_fused_adamw_equals_the_written_out_reference():
    """train.adamw_step (PyTorch's fused AdamW, decay by range) against adamw_step_reference (term for term,
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
    assert any(0 < sum(hi - lo for lo, hi, _, decays in u.ranges if decays) < u.shard_numel for u in pair[0])
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
    and shards for three steps, to fp32 rounding (the two AdamW kernels differ in the last bits).
    Both ranks run as threads of this process: a breakpoint in either step stops here."""
    cfg = small_config()
    init_dir = save_hf(hf_model(cfg), str(tmp_path / "init"))
    data = learnable_tokens(str(tmp_path / "tok.npy"), cfg.vocab_size, n=2000)
    cfg, mcfg, weights, windows = config_and_data([
        "--seq_len=32", "--batch_size=8", "--micro_batch_size=2", "--dtype=float32", "--lr=1e-2",
        "--warmup_steps=1", "--grad_clip=0.5", f"--init_from={init_dir}", f"--data={data}",
        f"--out_dir={tmp_path / 'out'}"])

    def naive_step(cfg, sharded, windows, step, position):
        batches = T.micro_batches(cfg, sharded, windows, position)
        return T.train_step_naive(cfg, sharded.units, sharded.model, batches, step)

    def rank_runs(rank):
        sharded = sharded_model(cfg, mcfg, weights)
        units = sharded.units
        start = [[u.master_shard.clone()] + [t.clone() for t in u.optimizer_state.values()] for u in units]
        result = dict(start=[u.master_shard.clone() for u in units])
        for name, step_fn in (("real", T.train_step), ("naive", naive_step)):
            for u, saved in zip(units, start):
                for t, value in zip([u.master_shard, *u.optimizer_state.values()], saved):
                    t.copy_(value)
                u.optimizer_steps = 0  # each unit's count for the bias corrections: both start at step 1
            log = [step_fn(cfg, sharded, windows, step, (step - 1) * cfg.batch_size) for step in (1, 2, 3)]
            result[name] = dict(log=log, master=[u.master_shard.clone() for u in units],
                                grads_zero=all(not u.grad_shard.any() for u in units))
        return result

    for r in run_ranks(2, rank_runs):
        real, naive = r["real"], r["naive"]
        assert real["grads_zero"] and naive["grads_zero"]
        for got, naive_got in zip(real["log"], naive["log"]):
            assert got["loss"] == pytest.approx(naive_got["loss"], rel=1e-6)
            assert got["grad_norm"] == pytest.approx(naive_got["grad_norm"], rel=1e-5)
        assert max(got["grad_norm"] for got in real["log"]) > 0.5  # clipping is exercised
        for start, got, want in zip(r["start"], real["master"], naive["master"]):
            # Per shard, as the parity tests compare weights: Adam's first steps move each weight by about
            # lr * sign(g), so a gradient within rounding of 0 may move either way in the two runs.
            assert (got - want).norm() / want.norm() < 1e-5, ((got - want).norm() / want.norm()).item()
            assert (got - start).norm() / start.norm() > 1e-3  # the steps moved the weights well beyond that


def test_a_units_views_survive_free_and_refill():
    """The trick under everything (the comment above train.Unit), on 2 ranks in this process: a block runs on
    views of the gathered buffer; free() releases the storage while the views, and those autograd saved,
    stay; a new all-gather refills it through .data; backward then reads the refilled weights without a
    version-counter error and gives the same gradient as a model that never freed anything."""
    import model as M
    cfg = small_config(n_layers=1)
    x = torch.randn(2, 8, cfg.dim, generator=torch.Generator().manual_seed(0))
    cos, sin = M.rope_cos_sin(cfg, torch.arange(8).expand(2, 8), torch.float32)

    def rank_check(rank):
        with torch.device("meta"):
            model = M.Llama(cfg)
        units = T.build_units(model, rank, dist.get_world_size(), torch.device("cpu"), torch.float32)
        T.hf.init_weights(T.TrainConfig(), cfg, units, None)
        block, unit = model.layers[0], units[1]
        states = [unit.state()]
        unit.wait_gather()
        states.append(unit.state())
        full_copy = unit.gathered.detach().clone()
        unit.set_views(unit.gathered)
        loss = block(x, cos, sin).square().sum()  # autograd saves views of the gathered buffer
        unit.free()
        weight = block.self_attn.q_proj.weight
        freed = (unit.state(), weight.shape, weight.untyped_storage().nbytes())
        unit.start_gather()
        states.append(unit.state())
        try:
            unit.free()  # while its all-gather is in flight: refused
            refused = False
        except RuntimeError:
            refused = True
        unit.wait_gather()
        loss.backward()  # reads the refilled storage
        reference = full_copy.requires_grad_()
        unit.set_views(reference)
        block(x, cos, sin).square().sum().backward()
        return states, freed, refused, torch.equal(unit.gathered.grad, reference.grad), unit.gathered.grad.abs().sum()

    for states, freed, refused, same_grad, grad_size in run_ranks(2, rank_check):
        assert states == ["free", "gathered", "gathering"]
        assert freed == ("free", (cfg.n_heads * cfg.head_dim, cfg.dim), 0)  # the view stays, its bytes go
        assert refused and same_grad and grad_size > 0


def test_the_naive_step_leaves_the_modules_where_it_found_them(tiny_tokens, tmp_path):
    """train_step_naive points every module at a full buffer of its own for the step; when it returns they
    point where they did, at views of each unit's freed `gathered` buffer, so its full buffers (the whole
    model and its gradient in the compute dtype) go with it, and the real step finds what it expects."""
    cfg, mcfg, weights, windows = config_and_data(TINY + [f"--data={tiny_tokens}", f"--out_dir={tmp_path}"])

    def rank_runs(rank):
        sharded = sharded_model(cfg, mcfg, weights)
        batches = T.micro_batches(cfg, sharded, windows, 0)
        T.train_step_naive(cfg, sharded.units, sharded.model, batches, 1)
        return [getattr(slot.module, slot.attr)._base is unit.gathered for unit in sharded.units for slot in unit.slots]

    for on_gathered in run_ranks(2, rank_runs):
        assert len(on_gathered) > 3 and all(on_gathered)


@pytest.mark.parametrize("returned", ["x", "x.view_as(x)"])
def test_backward_boundary_holds_whether_it_returns_its_input_or_a_view_of_it(returned):
    """What BackwardBoundary needs (the comment above train.Unit): its output's history must run through its
    node, so that its backward runs before the previous stage's. Returning the input as it is gives that:
    PyTorch's custom-function machinery returns an unmodified input as a new view of itself with the
    Function's node as its grad_fn (torch/csrc/autograd/custom_function.cpp, _process_backward_mode_ad);
    `x.view_as(x)`, what train.py used to return, gives the same. train.BackwardBoundary returns x itself."""
    from types import SimpleNamespace

    class Boundary(T.BackwardBoundary):
        @staticmethod
        def forward(ctx, x, on_backward):
            ctx.on_backward = on_backward
            return x if returned == "x" else x.view_as(x)

    order = []
    w = torch.randn(4, requires_grad=True)
    x = w * 2  # the previous stage's output
    x.register_hook(lambda grad: order.append("previous stage's backward"))
    y = Boundary.apply(x, lambda: order.append("boundary"))
    assert y is not x and y._base is x and y.grad_fn.next_functions[0][0] is x.grad_fn
    (y * 3).sum().backward()
    assert order == ["boundary", "previous stage's backward"]
    assert torch.equal(w.grad, torch.full((4,), 6.0))
    x = torch.randn(2)
    assert T.BackwardBoundary.forward(SimpleNamespace(), x, None) is x


@pytest.mark.parametrize("freeze,frozen,forward_only", [
    (r"embed_tokens|layers\.[01]\.", ["embed", "layers.0", "layers.1"], ["embed", "layers.0", "layers.1", "head"]),
    (r"layers\.1\.", ["layers.1"], ["embed", "head"])], ids=["prefix", "between"])
def test_a_frozen_unit_keeps_its_master_shard_alone_and_is_never_reduced(tiny_tokens, tmp_path, monkeypatch, freeze,
                                                                         frozen, forward_only):
    """--freeze at W=2, one step of two micro-batches per rank: a rank's persistent bytes are exactly 16 per trained
    and 4 per frozen element of its shards (padded as units pad); a frozen unit has no gradient shard, no
    optimizer state and no reduce-scatter, and its master shard is bit for bit what it was; a frozen prefix is
    gathered for forward only (no backward reaches it) and the step leaves every unit free; a frozen unit between
    trained ones is gathered again in backward (its input's gradient needs its weights)."""
    import model as M
    cfg, mcfg, weights, windows = config_and_data(["--seq_len=32", "--batch_size=4", "--micro_batch_size=1",
                                                   "--dtype=float32", f"--data={tiny_tokens}", f"--out_dir={tmp_path}",
                                                   f"--freeze={freeze}"])
    gathers, reduces = {}, {}
    original_start, original_reduce = T.Unit.start_gather, T.reduce_scatter_grad

    def counting_start(unit):
        key = (dist.get_rank(), unit.name)
        gathers[key] = gathers.get(key, 0) + (unit.state() == "free")
        original_start(unit)

    def counting_reduce(unit, *args):
        key = (dist.get_rank(), unit.name)
        reduces[key] = reduces.get(key, 0) + 1
        original_reduce(unit, *args)
    monkeypatch.setattr(T.Unit, "start_gather", counting_start)
    monkeypatch.setattr(T, "reduce_scatter_grad", counting_reduce)

    def rank_step(rank):
        sharded = sharded_model(cfg, mcfg, weights)
        before = [u.master_shard.clone() for u in sharded.units]
        T.train_step(cfg, sharded, windows, 1, 0)
        return dict(persistent=sum(u.persistent_bytes() for u in sharded.units), left=T.metrics.left_behind(sharded, 1),
                    unchanged=[u.name for u, b in zip(sharded.units, before) if torch.equal(u.master_shard, b)],
                    kept={u.name: (u.grad_shard.numel(), list(u.optimizer_state), u.gathered.requires_grad)
                          for u in sharded.units if u.name in frozen})

    with torch.device("meta"):
        model = M.Llama(mcfg)
    sizes = {unit: sum(p.numel() for n, p in model.named_parameters() if n in names)
             for unit, names in M.sharding_units(model)}
    expected = sum(-(-numel // 2) * (4 if unit in frozen else 16) for unit, numel in sizes.items())
    for rank, r in enumerate(run_ranks(2, rank_step)):
        assert r["persistent"] == expected, (r["persistent"], expected)
        assert r["left"] is None and r["unchanged"] == frozen
        assert r["kept"] == {unit: (0, [], False) for unit in frozen}
        assert {unit: reduces.get((rank, unit), 0) for unit in sizes} == {unit: 0 if unit in frozen else 2 for unit in sizes}
        assert {unit: gathers[(rank, unit)] for unit in sizes} == {unit: 2 if unit in forward_only else 4 for unit in sizes}
