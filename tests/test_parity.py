"""Training parity: train.py at W = 1, 2, 3, 4 (fp32, gloo) against one process of transformers'
LlamaForCausalLM + torch.optim.AdamW on the same batches: per-step loss within 1e-5 relative, logged
grad norm within 1e-4, final weights within 1e-4 relative per tensor (a fork noisier than that: under twice its
oracle's own eager-vs-SDPA distance, within_oracle_noise). The data packs several documents
into some rows; the oracle runs each document alone, which is what --doc_mask (the default) promises."""
import functools
import json
import math
import os
import re
import shutil
from typing import Callable, NamedTuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from common import (DIST_WORKER, hf_model, learnable_tokens, read_metrics, run_script, run_train, save_hf, small_config,
                    stopped_at)

import data as D
from tools import prepare as prep
from tools import tokenizer as TK
import model as M
from components import checkpoints, hf
from components.checks import check_run
import train as T

STEPS, SEQ, BATCH, CLIP = 4, 16, 12, 0.5
ARGS = dict(seq_len=SEQ, batch_size=BATCH, steps=STEPS, lr=1e-2, warmup_steps=2, schedule="cosine",
            weight_decay=0.1, grad_clip=CLIP, dtype="float32", seed=3)


def split_at_eos(row: torch.Tensor, eos_id: int) -> list:
    """The documents of one packed row: a new one starts after each EOS."""
    cuts = [0] + [t + 1 for t in range(len(row) - 1) if row[t] == eos_id] + [len(row)]
    return [(a, b) for a, b in zip(cuts, cuts[1:])]


def prepared_document_starts(folder: str) -> set:
    """Every position where a document of a prepared folder starts, read from its meta.json and docs files
    directly (not through data.TokenData, which the trainer uses)."""
    with open(os.path.join(folder, "meta.json")) as f:
        shards = json.load(f)["shards"]
    starts, offset = set(), 0
    for shard in shards:
        starts.update(offset + int(p) for p in np.load(os.path.join(folder, shard["docs"])))
        offset += shard["n_tokens"]
    return starts


def split_at_starts(window_start: int, length: int, starts: set) -> list:
    """The documents of one packed row that begins at `window_start` of the sequence, cut where documents start."""
    cuts = [0] + [t for t in range(1, length) if window_start + t in starts] + [length]
    return [(a, b) for a, b in zip(cuts, cuts[1:])]


class Reference(NamedTuple):
    losses: list
    norms: list
    state: dict
    again: Callable  # the same oracle with transformers' SDPA attention: its own distance from itself (check_weights)


def reference_run(init_dir, data_path, doc_mask: bool, optimizer: str = "adamw", args: dict = ARGS,
                  frozen=lambda step, name: False, lr_mult=(), attention: str = "eager", z_loss: float = 0.0,
                  fork=lambda ref: None) -> Reference:
    """The oracle: one process, whole global batch at once, HF model, torch AdamW. With doc_mask, each
    packed document runs through HF alone (its own positions from 0, nothing else to attend to).
    `frozen(step, name)`: requires_grad=False for that step's forward and backward; `lr_mult`: [(regex,
    factor)], a parameter group each (the first regex that matches a parameter's name wins); `z_loss`: PaLM's
    z-loss term with that coefficient (tests/dist_worker.py's fork); `fork(ref)`: a fork's change to the model."""
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32, attn_implementation=attention)
    fork(ref)
    params = dict(ref.named_parameters())
    groups = {}  # (lr factor, decayed) -> parameters
    for name, p in params.items():
        factor = next((f for regex, f in lr_mult if re.search(regex, name)), 1.0)
        groups.setdefault((factor, p.ndim >= 2), []).append(p)
    if optimizer == "adamw":
        opt = torch.optim.AdamW([{"params": ps, "factor": factor, "weight_decay": args["weight_decay"] if decayed else 0.0}
                                 for (factor, decayed), ps in groups.items()], lr=args["lr"], betas=(0.9, 0.95), eps=1e-8)
    else:  # tests/dist_worker.py's sgd_momentum_step
        opt = torch.optim.SGD(ref.parameters(), lr=args["lr"], momentum=0.9)
    cfg = T.TrainConfig(**args)
    seq, batch = args["seq_len"], args["batch_size"]
    windows = D.TokenWindows(D.TokenData(data_path), seq, args["seed"])
    starts = prepared_document_starts(data_path) if os.path.isdir(data_path) else None
    losses, norms, n_split = [], [], 0
    for step in range(args["steps"]):
        inputs, targets, _ = (torch.from_numpy(a) for a in windows.micro_batch(step * batch, 0, 0, 1, batch))
        loss = 0.0
        for name, p in params.items():
            p.requires_grad_(not frozen(step + 1, name))
        for row in range(batch):
            if not doc_mask:
                docs = [(0, seq)]
            elif starts is not None:  # a prepared folder: where its record says documents start
                docs = split_at_starts(windows._window_start(step * batch + row), seq, starts)
            else:  # bare token ids: after each EOS
                docs = split_at_eos(inputs[row], ref.config.eos_token_id)
            n_split += len(docs) > 1
            for a, b in docs:
                logits = ref(inputs[row:row + 1, a:b]).logits[0]
                loss = loss + torch.nn.functional.cross_entropy(logits.float(), targets[row, a:b], reduction="sum")
                kept = targets[row, a:b] != -100
                loss = loss + z_loss * torch.logsumexp(logits.float(), -1)[kept].square().sum()
        loss = loss / (targets != -100).sum()  # the mean over the global batch's target tokens
        opt.zero_grad()  # to None: a frozen parameter has no gradient, so AdamW and the clip skip it
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), args["grad_clip"]).item())
        for group in opt.param_groups:
            group["lr"] = T.lr_at(cfg, step + 1) * group.get("factor", 1.0)
        opt.step()
        losses.append(loss.item())
    assert not doc_mask or n_split >= 4, "the data must pack several documents into some rows"
    again = functools.cache(lambda: reference_run(init_dir, data_path, doc_mask, optimizer, args, frozen, lr_mult, "sdpa",
                                                  z_loss, fork))
    return Reference(losses, norms, {k: v.detach().clone() for k, v in ref.state_dict().items()}, again)


def family_setup(root, cfg: M.ModelConfig):
    """A folder of `cfg`'s family as transformers saves it, tokens and the oracle's run on them."""
    init_dir = save_hf(hf_model(cfg, seed=5), str(root / "init"))
    data_path = learnable_tokens(str(root / "tokens.npy"), cfg.vocab_size, n=3000, eos_id=cfg.eos_id)
    return root, init_dir, data_path, reference_run(init_dir, data_path, doc_mask=True)


def llama_config(tied: bool = False) -> M.ModelConfig:
    return small_config(tie_embeddings=tied, rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                               original_max_position_embeddings=8))


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def setup(request, tmp_path_factory):
    return family_setup(tmp_path_factory.mktemp("tied" if request.param else "untied"), llama_config(request.param))


@pytest.fixture(scope="module")
def llama_setup(tmp_path_factory):
    return family_setup(tmp_path_factory.mktemp("llama"), llama_config())


def check_against_reference(out, reference, clip=CLIP):
    got = read_metrics(out)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    check_steps(got, reference)
    assert max(reference.norms) > clip, "the test must exercise clipping"
    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf"), dtype=torch.float32).state_dict()
    check_weights(exported, reference)
    return exported


def within_oracle_noise(what, distance: float, floor: float, own_distance: Callable[[], float]):
    """`distance` (relative, ours from the oracle's) under `floor`, or under twice `own_distance()`: the oracle's
    distance from itself (eager against SDPA attention, Reference.again), run only when the floor is passed. A fork
    whose arithmetic is noisier than the floor (post-norm blocks, routing that flips on near-ties) is held to its
    oracle's noise, never to a fixed number below it; a run within the floor passes without it."""
    if distance >= floor:
        own = own_distance()
        assert distance < 2 * own, (*what, distance, own)


def scalar_distance(got: float, ref: float) -> float:
    """math.isclose's relative distance: the difference over the larger magnitude."""
    return abs(got - ref) / max(abs(got), abs(ref)) if got != ref else 0.0


def check_steps(got: list, reference: Reference):
    """Each step's loss within 1e-5 relative of the oracle's and its grad norm within 1e-4, or within the oracle's
    noise (within_oracle_noise); `got`: metrics.jsonl's rows."""
    assert len(got) == len(reference.losses)
    for i, m in enumerate(got):
        for key, field, floor in (("loss", "losses", 1e-5), ("grad_norm", "norms", 1e-4)):
            ref = getattr(reference, field)[i]
            within_oracle_noise((m["step"], key, m[key], ref), scalar_distance(m[key], ref), floor,
                                lambda: scalar_distance(getattr(reference.again(), field)[i], ref))


def check_weights(state: dict, reference: Reference, floor: float = 1e-4):
    """Each tensor within `floor` relative of the oracle's, or within its noise (within_oracle_noise)."""
    assert set(state) == set(reference.state)
    for name, ref_w in reference.state.items():
        within_oracle_noise((name,), ((state[name] - ref_w).norm() / ref_w.norm()).item(), floor,
                            lambda: ((reference.again().state[name] - ref_w).norm() / ref_w.norm()).item())


# Each world size also runs one option that must not change the arithmetic: cross-entropy in chunks that do
# not divide the micro-batch, selective checkpointing, no prefetch. One launch each, as each costs seconds.
@pytest.mark.parametrize("world,micro,flags", [pytest.param(1, 2, ["--ac=none"], marks=pytest.mark.fork),
                                               pytest.param(2, 2, ["--ac=none"], marks=pytest.mark.fork),
                                               (3, 1, ["--ce_chunk=5", "--ac=none"]),
                                               (4, 1, ["--ac=selective", "--ce_chunk=7", "--prefetch=false"])],
                         ids=["w1", "w2", "w3-chunked-ce", "w4-selective-noprefetch"])
def test_training_matches_hf(setup, world, micro, flags, train_at):
    root, init_dir, data_path, reference = setup
    out = str(root / f"w{world}")
    args = [f"--{k}={v}" for k, v in ARGS.items()]
    code, stderr = train_at(args + [f"--init_from={init_dir}", f"--data={data_path}", f"--micro_batch_size={micro}",
                                    f"--out_dir={out}", f"--export_hf={out}/hf", *flags], world)
    assert code == 0, stderr[-6000:]
    check_against_reference(out, reference)


@pytest.fixture(scope="module")
def qwen3_setup(tmp_path_factory):
    """A small Qwen3 (QK-norm; head_dim 12, not dim / n_heads = 8) and its oracle, Qwen3ForCausalLM + AdamW."""
    return family_setup(tmp_path_factory.mktemp("qwen3"),
                        small_config(family="qwen3", qk_norm=True, head_dim=12, norm_eps=1e-6))


@pytest.fixture(scope="module")
def olmo2_setup(tmp_path_factory):
    """A small OLMo-2 (norms after attention and the MLP, QK-norm over the whole projections) and its oracle,
    Olmo2ForCausalLM + AdamW."""
    return family_setup(tmp_path_factory.mktemp("olmo2"), small_config(family="olmo2", **M.FAMILIES["olmo2"]["model_fields"]))


FAMILIES = ["llama", "qwen3", "olmo2"]  # each with its NAME_setup fixture: the forker's tier (marker fork) runs them all


@pytest.mark.fork
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("family", FAMILIES[1:])  # Llama's: test_training_matches_hf
def test_each_family_trains_as_its_oracle(family, world, request, train_at):
    """The same tolerances as Llama's; the export is a folder of the family that from_pretrained loads with exactly
    the oracle's tensors (check_against_reference: the same names, the same values) and the config the run started
    from (Qwen3's head_dim 12 included)."""
    root, init_dir, data_path, reference = request.getfixturevalue(f"{family}_setup")
    out = str(root / f"w{world}")
    args = [f"--{k}={v}" for k, v in ARGS.items()]
    code, stderr = train_at(args + [f"--init_from={init_dir}", f"--data={data_path}", "--micro_batch_size=2",
                                    "--ac=selective", f"--out_dir={out}", f"--export_hf={out}/hf"], world)
    assert code == 0, stderr[-6000:]
    check_against_reference(out, reference)
    with open(os.path.join(out, "hf", "config.json")) as f, open(os.path.join(init_dir, "config.json")) as g:
        exported, started = json.load(f), json.load(g)
    assert exported["model_type"] == family
    assert {key: exported[key] for key in ("architectures", "head_dim")} == {key: started[key] for key in ("architectures", "head_dim")}


@pytest.mark.fork
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_resumes_at_another_world_size_and_trains_as_its_oracle(family, request, main_in_process):
    """Steps 1-2 at W=2 under torchrun, saved; steps 3-4 resumed from that checkpoint at W=1 in this process: the
    losses, norms and exported weights are the oracle's. For a fork's family, its own tensors saved at one world
    size, re-sliced and restored at another (a row per family here: the forker's tier, docs/forking.md)."""
    root, init_dir, data_path, reference = request.getfixturevalue(f"{family}_setup")
    first, resumed = str(root / "resume-w2"), str(root / "resume-w1")
    args = [f"--{k}={v}" for k, v in ARGS.items()] + [f"--init_from={init_dir}", f"--data={data_path}",
                                                      "--micro_batch_size=2"]
    run_train(args + ["--ckpt_every=2", f"--out_dir={first}"], nproc=2)
    stopped_at(first, resumed, 2)
    assert main_in_process(args + [f"--out_dir={resumed}", f"--export_hf={resumed}/hf"]) == 0
    check_against_reference(resumed, reference)


QWEN3_CHATS = [  # multi-turn: each reply must see its question, and nothing of the conversation packed before it
    [{"role": "user", "content": f"Article {i} ?"}, {"role": "assistant", "content": f"Bail {i % 7}."},
     {"role": "user", "content": "Et ensuite ?"}, {"role": "assistant", "content": f"Loyer {i % 5} euros."}]
    for i in range(40)]


def test_qwen3_trains_on_chats_prepared_with_its_own_tokenizer_as_its_oracle(tmp_path, train_at):
    """Issue 49: multi-turn chats prepared with Qwen3's published tokenizer (no BOS; <|im_end|>, its EOS, closes every
    turn) train a tiny Qwen3 at W=2 as Qwen3ForCausalLM + AdamW does running each conversation alone: its turns
    attend to each other, no two conversations attend across, the loss is on the replies only. The export stops
    generation where the template ends a reply, and so do the samples."""
    import published_tokenizers
    from components import sample
    folder = published_tokenizers.folder("qwen3")
    if folder is None:
        pytest.skip("the published qwen3 tokenizer could not be fetched (python3 tests/published_tokenizers.py fetch)")
    tok = TK.Tokenizer(folder)
    chats, data_dir = tmp_path / "chats.jsonl", str(tmp_path / "data")
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in QWEN3_CHATS), encoding="utf-8")
    prep.prepare([str(chats)], folder, data_dir, quiet=True)
    im_end = tok.piece_id("<|im_end|>")
    cfg = small_config(family="qwen3", qk_norm=True, head_dim=12, norm_eps=1e-6, vocab_size=tok.vocab_size,
                       bos_id=tok.piece_id("<|endoftext|>"), eos_id=im_end, max_seq_len=128)
    init_dir = save_hf(hf_model(cfg, seed=5), str(tmp_path / "init"))  # a published folder: weights and tokenizer
    for name in os.listdir(folder):
        shutil.copyfile(os.path.join(folder, name), os.path.join(init_dir, name))
    args = dict(ARGS, seq_len=48, batch_size=4, grad_clip=0.05)
    reference = reference_run(init_dir, data_dir, doc_mask=True, args=args)
    out = str(tmp_path / "w2")
    code, stderr = train_at([f"--{k}={v}" for k, v in args.items()] + [
        f"--init_from={init_dir}", f"--data={data_dir}", "--micro_batch_size=1", "--eval_every=0", f"--out_dir={out}",
        f"--export_hf={out}/hf"], 2)
    assert code == 0, stderr[-6000:]
    check_against_reference(out, reference, clip=args["grad_clip"])
    # each document the oracle ran is one whole conversation: it starts the template's way
    starts = sorted(prepared_document_starts(data_dir))
    tokens = D.TokenData(data_dir).read(0, len(D.TokenData(data_dir)))[0]
    assert len(starts) == len(QWEN3_CHATS) and all(tok.decode(tokens[p:p + 1]) == "<|im_start|>" for p in starts)
    with open(os.path.join(out, "hf", "generation_config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    assert im_end in (eos if isinstance(eos, list) else [eos])
    assert im_end in sample.end_ids(T.TrainConfig(init_from=init_dir), cfg, tok.end_ids())


def test_a_pad_token_id_leaves_its_embedding_row_as_transformers_does(tmp_path, main_in_process):
    """config.json's pad_token_id makes transformers' embedding nn.Embedding(padding_idx=pad): a lookup of that id
    adds nothing to its row's gradient; AdamW's weight decay still shrinks the row, which transformers' own init leaves
    at zero and a trained checkpoint need not (set here). Ours reads it (config_from_hf), trains at W=1 and W=2 as the
    oracle does with the pad id among the inputs, the pad row bit for bit, and writes it back in the export."""
    cfg = small_config()
    data_path = learnable_tokens(str(tmp_path / "tokens.npy"), cfg.vocab_size, n=3000)
    windows = D.TokenWindows(D.TokenData(data_path), SEQ, ARGS["seed"])
    inputs = torch.cat([torch.from_numpy(windows.micro_batch(step * BATCH, 0, 0, 1, BATCH)[0]).flatten()
                        for step in range(STEPS)])
    counts = torch.bincount(inputs, minlength=cfg.vocab_size)
    counts[[cfg.bos_id, cfg.eos_id]] = 0
    pad = int(counts.argmax())  # the id the steps look up most: its row would move most if it took gradients
    assert counts[pad] >= 3
    hf_config = dict(hf.config_to_hf(cfg, torch.float32), pad_token_id=pad)
    ref = hf_model(cfg, seed=5, hf_config=hf_config)
    with torch.no_grad():
        ref.model.embed_tokens.weight[pad] = ref.model.embed_tokens.weight[(pad + 1) % cfg.vocab_size]
    init_dir = save_hf(ref, str(tmp_path / "init"))
    reference = reference_run(init_dir, data_path, doc_mask=True)
    embedding = "model.embed_tokens.weight"
    assert not torch.equal(reference.state[embedding][pad], ref.model.embed_tokens.weight[pad])  # decayed
    args = [f"--{k}={v}" for k, v in ARGS.items()] + [f"--init_from={init_dir}", f"--data={data_path}",
                                                      "--micro_batch_size=2", "--ac=none"]
    w1, w2 = str(tmp_path / "w1"), str(tmp_path / "w2")
    assert main_in_process(args + [f"--out_dir={w1}", f"--export_hf={w1}/hf"]) == 0
    run_train(args + [f"--out_dir={w2}", f"--export_hf={w2}/hf"], nproc=2)
    for out in (w1, w2):
        assert torch.equal(check_against_reference(out, reference)[embedding][pad], reference.state[embedding][pad])
        with open(os.path.join(out, "hf", "config.json")) as f:
            assert json.load(f)["pad_token_id"] == pad


def test_the_weight_tolerance_is_the_oracles_own_noise_above_1e_4():
    """check_weights: 1e-4 relative, or under twice the oracle's eager-vs-SDPA distance where that is larger."""
    ones = torch.ones(100)
    quiet = Reference([], [], {"w": ones}, lambda: Reference([], [], {"w": ones * (1 + 1e-6)}, None))
    noisy = Reference([], [], {"w": ones}, lambda: Reference([], [], {"w": ones * (1 + 1e-3)}, None))
    check_weights({"w": ones * (1 + 5e-5)}, quiet)
    check_weights({"w": ones * (1 + 1.5e-3)}, noisy)
    for state, reference in (({"w": ones * (1 + 2e-4)}, quiet), ({"w": ones * (1 + 3e-3)}, noisy)):
        with pytest.raises(AssertionError):
            check_weights(state, reference)


def test_the_loss_and_grad_norm_tolerances_are_the_oracles_own_noise_above_theirs():
    """check_steps: each step's loss within 1e-5 relative and grad norm within 1e-4, or under twice the oracle's
    eager-vs-SDPA distance where that is larger; the oracle's second run happens only past the fixed bound."""
    def unmeasured():
        raise AssertionError("the oracle's noise was measured for a run within the fixed bounds")
    quiet = Reference([4.0], [2.0], {}, lambda: Reference([4.0 * (1 + 1e-7)], [2.0 * (1 + 1e-6)], {}, None))
    noisy = Reference([4.0], [2.0], {}, lambda: Reference([4.0 * (1 + 1e-3)], [2.0 * (1 + 1e-2)], {}, None))
    check_steps([dict(step=1, loss=4.0 * (1 + 9e-6), grad_norm=2.0 * (1 - 9e-5))], Reference([4.0], [2.0], {}, unmeasured))
    check_steps([dict(step=1, loss=4.0 * (1 + 1.5e-3), grad_norm=2.0 * (1 - 1.5e-2))], noisy)
    for loss, norm, reference in ((1 + 2e-5, 1, quiet), (1, 1 + 2e-4, quiet), (1 + 3e-3, 1, noisy), (1, 1 + 3e-2, noisy)):
        with pytest.raises(AssertionError):
            check_steps([dict(step=1, loss=4.0 * loss, grad_norm=2.0 * norm)], reference)


def test_without_doc_mask_matches_hf_on_whole_rows(setup):
    """--doc_mask false: each row is one sequence, as transformers sees it without document boundaries."""
    root, init_dir, data_path, _ = setup
    out = str(root / "nodocmask")
    args = [f"--{k}={v}" for k, v in ARGS.items()]
    run_train(args + [f"--init_from={init_dir}", f"--data={data_path}", "--micro_batch_size=3", "--doc_mask=false",
                      f"--out_dir={out}", f"--export_hf={out}/hf", "--ac=none"], nproc=2)
    check_against_reference(out, reference_run(init_dir, data_path, doc_mask=False))


@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16"])
def test_bf16_training_tracks_the_fp32_reference(setup, reduce_dtype):
    """BF16 compute with FP32 master weights: the same run at W=2 stays within bf16 rounding of the fp32
    oracle (2e-2 relative on each step's loss), with either reduce-scatter dtype."""
    root, init_dir, data_path, (ref_losses, *_) = setup
    out = str(root / f"bf16-{reduce_dtype}")
    args = [f"--{k}={v}" for k, v in dict(ARGS, dtype="bfloat16").items()]
    run_train(args + [f"--init_from={init_dir}", f"--data={data_path}", "--micro_batch_size=2",
                      f"--reduce_dtype={reduce_dtype}", f"--out_dir={out}"], nproc=2)
    got = [m["loss"] for m in read_metrics(out)]
    assert ref_losses[-1] < ref_losses[0] - 0.05  # the run learns, so tracking it means something
    for loss, ref in zip(got, ref_losses):
        assert math.isclose(loss, ref, rel_tol=2e-2), (got, ref_losses)


def test_a_second_optimizer_swapped_in_one_place_trains_like_torch(tmp_path):
    """The optimizer is two names: train.optimizer_step and model.OPTIMIZER_STATE. SGD with momentum
    swapped in through them (tests/dist_worker.py, mode sgd) trains at W=2 like transformers +
    torch.optim.SGD: same losses, norms and final weights; its checkpoint holds its own state."""
    cfg = small_config()
    init_dir = save_hf(hf_model(cfg, seed=5), str(tmp_path / "init"))
    data_path = learnable_tokens(str(tmp_path / "tokens.npy"), cfg.vocab_size, n=3000)
    sgd_args = dict(ARGS, lr=1.0, weight_decay=0.0)
    reference = reference_run(init_dir, data_path, doc_mask=True, optimizer="sgd", args=sgd_args)
    out = str(tmp_path / "sgd")
    args = [f"--{k}={v}" for k, v in sgd_args.items()]
    proc = run_script(DIST_WORKER, ["sgd", out, *args, f"--init_from={init_dir}", f"--data={data_path}",
                                    "--micro_batch_size=2", f"--out_dir={out}", f"--export_hf={out}/hf"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert reference[0][-1] < reference[0][0] - 0.05  # SGD learns here, so matching it means something
    check_against_reference(out, reference)
    ckpt = os.path.join(out, "checkpoints", f"step_{STEPS:08d}")
    with open(os.path.join(ckpt, "manifest.json")) as f:
        assert {tuple(u["optimizer_state"]) for u in json.load(f)["units"].values()} == {("momentum_buffer",)}
    from safetensors import safe_open
    with safe_open(os.path.join(ckpt, "rank00000-of-00002.safetensors"), framework="pt") as f:
        assert {key.rsplit(".", 1)[1] for key in f.keys()} == {"master_shard", "momentum_buffer"}


def test_a_loss_term_a_fork_adds_is_trained_and_logged_by_name(tmp_path):
    """A fork adds PaLM's z-loss as one line in model.Llama._loss_terms (tests/dist_worker.py, mode zloss). At W=2
    it trains as the oracle with the same term does (losses, norms, weights), and with no other edit the step's
    record carries loss/ce and loss/z_loss (their sum the loss) into metrics.jsonl, the step line and TensorBoard."""
    from dist_worker import Z_LOSS
    cfg = small_config()
    init_dir = save_hf(hf_model(cfg, seed=5), str(tmp_path / "init"))
    data_path = learnable_tokens(str(tmp_path / "tokens.npy"), cfg.vocab_size, n=3000)
    reference = reference_run(init_dir, data_path, doc_mask=True, z_loss=Z_LOSS)
    out = str(tmp_path / "zloss")
    args = [f"--{k}={v}" for k, v in ARGS.items()]
    proc = run_script(DIST_WORKER, ["zloss", out, *args, f"--init_from={init_dir}", f"--data={data_path}",
                                    "--micro_batch_size=2", "--log_every=1", "--tensorboard=true", f"--out_dir={out}",
                                    f"--export_hf={out}/hf"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-5000:]
    check_against_reference(out, reference)
    rows = read_metrics(out)
    for row in rows:
        assert row["loss/z_loss"] > 0.1 * row["loss"]  # large enough that training without it would not match
        assert math.isclose(row["loss/ce"] + row["loss/z_loss"], row["loss"], rel_tol=1e-6)
        assert f"loss/ce {row['loss/ce']:.4f} | loss/z_loss {row['loss/z_loss']:.4f} |" in proc.stdout
    with open(os.path.join(out, "tensorboard.jsonl")) as f:
        scalars = [json.loads(line) for line in f]
    assert [(s["step"], s["value"]) for s in scalars if s["tag"] == "loss/z_loss"] == [
        (row["step"], row["loss/z_loss"]) for row in rows]


ATTENTION = r"self_attn|input_layernorm"  # two_units_per_block's first unit of each block, whole


def test_a_fork_with_two_units_per_block_trains_as_its_oracle_and_is_planned_exactly(llama_setup, monkeypatch):
    """A fork whose model.sharding_units splits each block into two units (tests/dist_worker.py,
    two_units_per_block), the first frozen (--freeze): a frozen base and a trained unit in every block's stage.
    At W=1 and 2 it trains as the oracle with those parameters frozen (losses, norms, exported weights); each
    block's stage gathers both its units; --plan's state is what the run's units hold, at a W with padding."""
    from tools import plan as P
    from dist_worker import two_units_per_block
    root, init_dir, data_path, _ = llama_setup
    reference = reference_run(init_dir, data_path, doc_mask=True, frozen=lambda step, name: bool(re.search(ATTENTION, name)))
    args = [f"--{k}={v}" for k, v in ARGS.items()] + [f"--init_from={init_dir}", f"--data={data_path}",
                                                      "--micro_batch_size=2", f"--freeze={ATTENTION}", "--ac=full"]
    for world in (1, 2):
        out = str(root / f"two-units-w{world}")
        proc = run_script(DIST_WORKER, ["two_units", out, *args, f"--out_dir={out}", f"--export_hf={out}/hf"],
                          nproc=world)
        assert proc.returncode == 0, proc.stderr[-5000:]
        check_against_reference(out, reference)
    monkeypatch.setattr(M, "sharding_units", two_units_per_block)
    cfg = T.parse_args(args + ["--nproc_per_node=3"])
    mcfg = hf.model_config(cfg)
    sharded = T.build_sharded_model(cfg, mcfg, 0, 3, torch.device("cpu"))
    blocks = sharded.stages[1:-1]
    assert [[(u.name, u.trained) for u in stage.forward_units] for stage in blocks] == [
        [(f"layers.{i}.attention", False), (f"layers.{i}.mlp", True)] for i in range(mcfg.n_layers)]
    assert all(stage.backward_units == stage.forward_units for stage in blocks)
    assert any(u.padded_numel != u.numel for u in sharded.units)
    planned = P.plan(mcfg, cfg)["state_gib_per_gpu"] * 2**30
    assert planned == sum(u.persistent_bytes() for u in sharded.units)


def with_adapters(weights: dict):
    """The oracle's change for tests/dist_worker.py's LoraBlock: each decoder layer's output h + B(A(h))."""
    def fork(ref):
        for i, layer in enumerate(ref.model.layers):
            for name in ("lora_a", "lora_b"):
                layer.register_parameter(name, torch.nn.Parameter(weights[f"model.layers.{i}.{name}"].clone()))
            layer.register_forward_hook(lambda m, args, h: h + F.linear(F.linear(h, m.lora_a), m.lora_b))
    return fork


def checkpoint_weights(ckpt: str, units: list) -> dict:
    """Hugging Face name -> fp32 master weight, read from the rank files of a checkpoint saved at any W (a frozen
    unit's from the frozen set it names: checkpoints.unit_file), laid out as `units` (one process's Units of the same
    model) lay them out."""
    from safetensors.torch import load_file
    manifest = json.load(open(os.path.join(ckpt, "manifest.json")))
    files = functools.cache(lambda fname: load_file(os.path.join(ckpt, fname)))
    state = {}
    for unit in units:
        flat = torch.cat([files(checkpoints.unit_file(manifest, unit.name, checkpoints.rank_file(r, manifest["world_size"]))[0])
                          [f"{unit.name}.master_shard"] for r in range(manifest["world_size"])])
        state |= {M.hf_name(s.name): flat[s.offset:s.offset + math.prod(s.shape)].view(s.shape) for s in unit.slots}
    return state


BASE = r"layers\.\d+\.(?!lora)|norm|lm_head"  # the blocks (not their adapters) and the head: all but the embedding


def test_a_phase_that_adds_an_adapter_unit_takes_the_checkpoint_and_trains_as_its_oracle(llama_setup, monkeypatch,
                                                                                       main_in_process):
    """A plain run at W=1 (in this process) with the embedding frozen saves a checkpoint; a new phase from it
    (--init_from) in a fork that adds an adapter unit to each block (tests/dist_worker.py, LoraBlock) trains the
    embedding and the adapters with the rest frozen: --freeze changed both ways (the embedding's optimizer state was
    never saved). One line names the units taken and new; at W=2 it trains as the oracle does from the exported
    checkpoint with the adapters at the fork's init (what a run of the fork from scratch makes, built here); the
    frozen units keep the checkpoint's master weights bit for bit. Refused before any work, in one line: the phase's
    checkpoint by the plain model (the adapters would be dropped), and the plain one by a fork that puts the adapter
    inside each block's unit (another size)."""
    from dist_worker import BLOCK_UNITS, LoraBlock, lora_init_parameter, lora_units
    root, init_dir, data_path, _ = llama_setup
    plain, phase = root / "phase-plain", str(root / "phase-lora")
    assert main_in_process([f"--{k}={v}" for k, v in ARGS.items()] + [
        f"--init_from={init_dir}", f"--data={data_path}", "--micro_batch_size=2", "--steps=1", "--freeze=embed_tokens",
        f"--out_dir={plain}", f"--export_hf={plain / 'hf'}"]) == 0
    ckpt = str(plain / "checkpoints" / "step_00000001")
    args = [f"--{k}={v}" for k, v in ARGS.items()] + [f"--init_from={ckpt}", f"--data={data_path}",
                                                      "--micro_batch_size=2", f"--freeze={BASE}", f"--out_dir={phase}"]
    proc = run_script(DIST_WORKER, ["lora", phase, *args], nproc=2)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert [line for line in proc.stdout.splitlines() if "started from the weights" in line] == [
        f"started from the weights of checkpoint {ckpt} (a new phase: step 1, a fresh optimizer and data position); "
        f"taken: embed, layers.0-1, head; new, initialised as a run from scratch (--seed 3): layers.0-1.lora"]

    monkeypatch.setattr(M, "Block", LoraBlock)
    monkeypatch.setattr(M, "sharding_units", lora_units)
    monkeypatch.setattr(M, "init_parameter", lora_init_parameter)
    cfg = T.parse_args(args)
    mcfg = hf.model_config(cfg)
    units = T.build_sharded_model(cfg, mcfg, 0, 1, torch.device("cpu")).units
    hf.init_weights(cfg, mcfg, units, None)  # a run of the fork from scratch: its adapters are the fork's init
    adapters = {M.hf_name(s.name): unit.master_shard[s.offset:s.offset + math.prod(s.shape)].view(s.shape)
                for unit in units if unit.name.endswith(".lora") for s in unit.slots}
    reference = reference_run(str(plain / "hf"), data_path, doc_mask=True, frozen=lambda step, name: bool(re.search(
        BASE, name)), fork=with_adapters(adapters))
    check_steps(read_metrics(phase), reference)
    got = checkpoint_weights(os.path.join(phase, "checkpoints", f"step_{STEPS:08d}"), units)
    check_weights(got, reference)
    saved = checkpoint_weights(ckpt, [u for u in units if not u.name.endswith(".lora")])
    assert all(torch.equal(got[name], w) for name, w in saved.items() if re.search(BASE, name))

    def refused(*flags):
        return check_run(T.parse_args([*flags, f"--data={data_path}", f"--out_dir={root / 'x'}"]), 2)[2]
    monkeypatch.setattr(M, "sharding_units", BLOCK_UNITS)  # the adapter inside each block's unit
    inside = refused(f"--init_from={ckpt}")
    monkeypatch.undo()
    dropped = refused(f"--init_from={phase}")
    block = json.load(open(os.path.join(ckpt, "manifest.json")))["units"]["layers.0"]["numel"]
    assert (inside, dropped) == (
        [f"--init_from: checkpoint {ckpt}: unit layers.0 has {block} parameters there and {block + 2 * 2 * 32} in this "
         f"model (another model, or another fork)"],
        [f"--init_from: checkpoint {os.path.join(phase, 'checkpoints', f'step_{STEPS:08d}')} holds unit(s) "
         f"layers.0-1.lora, which this model does not have: their trained weights would be dropped; run the code "
         f"(the fork) that saved them"])


FREEZE_THEN, FREEZE_NOW = r"embed_tokens|layers\.0\.", "embed_tokens"  # progressive unfreezing: block 0 from step 3
LR_MULT = r"lm_head=0.5,layers\.1\.mlp=2"  # the second splits block 1: factors work element by element


def test_frozen_units_and_lr_groups_match_torch_across_a_resume_that_unfreezes(setup, main_in_process, capsys):
    """--freeze and --lr_mult against the oracle with requires_grad=False and torch AdamW parameter groups: steps
    1-2 with the embedding and block 0 frozen, then a resume that unfreezes block 0 (fresh moments, its own step
    count from 1, as torch's lazily made per-parameter state), at W=1 in this process and, from the same step-2
    checkpoint, at W=2 under torchrun. The same tolerances as the parity tests above; the frozen embedding is
    exported bit for bit as it was loaded. Tied: the head's weight, the embedding's, is frozen with it (said so)."""
    root, init_dir, data_path, _ = setup
    tied = "untied" not in root.name
    groups_args = dict(ARGS, grad_clip=0.2)  # frozen units' gradients are not in the norm: clip below what is left
    reference = reference_run(init_dir, data_path, doc_mask=True, args=groups_args,
                              lr_mult=[(r"lm_head", 0.5), (r"layers\.1\.mlp", 2.0)],
                              frozen=lambda step, name: bool(re.search(FREEZE_THEN if step <= 2 else FREEZE_NOW, name)))
    w1, w2 = str(root / "freeze-w1"), str(root / "freeze-w2")
    args = [f"--{k}={v}" for k, v in groups_args.items()] + [f"--init_from={init_dir}", f"--data={data_path}",
                                                              "--micro_batch_size=2", f"--lr_mult={LR_MULT}"]
    assert main_in_process(args + ["--steps=2", f"--freeze={FREEZE_THEN}", "--ac=full", f"--out_dir={w1}"]) == 0
    stopped_at(w1, w2, 2)
    capsys.readouterr()
    assert main_in_process(args + [f"--freeze={FREEZE_NOW}", f"--out_dir={w1}", f"--export_hf={w1}/hf"]) == 0
    err = capsys.readouterr().err
    assert ("warning: --freeze: unit(s) layers.0 start training at step 3 with a fresh optimizer state (zero "
            "moments, their own step count from 1)") in err, err
    assert ("with tied embeddings (tie_word_embeddings) its weight is also the head's lm_head.weight: the head's "
            "weight is frozen too") in err if tied else "frozen too" not in err
    proc = run_train(args + [f"--freeze={FREEZE_NOW}", "--ac=selective", f"--out_dir={w2}", f"--export_hf={w2}/hf"],
                     nproc=2)
    assert "unit(s) layers.0 start training at step 3" in proc.stderr
    from safetensors.torch import load_file
    initial = load_file(os.path.join(init_dir, "model.safetensors"))["model.embed_tokens.weight"]
    for out in (w1, w2):
        check_against_reference(out, reference, clip=groups_args["grad_clip"])
        assert torch.equal(load_file(os.path.join(out, "hf", "model.safetensors"))["model.embed_tokens.weight"], initial)
