"""Bytes each collective moves per training step, counted, against what the ZeRO-3 schedule needs.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/comm_volume.py

Runs train.py's own loop (train.main) for a few steps of a small Llama, untied and then tied, with
gradient accumulation (batch 8 = W 2 x micro-batch 2 x 2 accumulation steps), and counts every call of
the collectives it uses: train.all_gather_flat and train.reduce_scatter_flat (which Unit looks up at call
time, and metrics.all_gather_flat: every rank's step time), and torch.distributed.all_reduce, all_gather_object,
broadcast_object_list and barrier. Each call
is labelled by the unit it moves (embed, block, head: their padded sizes differ) and by the phase it
happens in: the step (train_step), the loop around it, the final checkpoint save, or set-up.

Bytes are the full buffer of the collective, per rank: the gathered unit of an all-gather, the whole
gradient entering a reduce-scatter, the tensor of an all-reduce. On the wire each rank sends and
receives (W - 1) / W of an all-gather's or reduce-scatter's buffer with a ring algorithm.

Expected, per micro-batch, from the shapes alone: each block gathered twice (forward, and again for its
backward) in the compute dtype (bf16); the embedding once (its backward needs only the token ids); the
head once (it stays gathered from its forward into its backward); one reduce-scatter of every unit's
gradient in the reduce dtype (fp32). Tied embeddings: the head stage uses the embedding unit a second
time, so the embedding is gathered twice in forward (and not for backward); autograd sums both uses into
one gradient, so it is reduce-scattered once. Per step: all-reduces of three fp32 scalars (token count,
loss, squared gradient norm) in the step; in the loop, one all-reduce (the stop flags) and an all-gather of
each rank's step time. Any difference, or a model-sized collective outside the steps (but the one unit's gathers
that time the fabric before step 1: agree.gather_bus_gbps), fails the run (exit 1).
"""
import collections
import os
import pickle
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from components import agree, hf  # noqa: E402
import model as M  # noqa: E402
import train as T  # noqa: E402

# Odd width and vocabulary, so that every unit's size is odd and W = 2 pads each by one element.
MODEL = dict(vocab_size=257, dim=75, n_layers=3, n_heads=3, n_kv_heads=1, head_dim=16, ffn_dim=101, max_seq_len=64)
SEQ_LEN, MICRO, BATCH, STEPS = 32, 2, 8, 3
BF16_BYTES, FP32_BYTES = 2, 4

calls = collections.Counter()   # (phase, collective, what, dtype) -> calls
bytes_ = collections.Counter()  # the same key -> bytes
state = dict(phase="setup", depth=0, labels={})


# ------------------------------------------------------------------------------------------------
# Counting: wrap each collective; only the outermost call counts (all_gather_object calls others)
# ------------------------------------------------------------------------------------------------

def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def describe_gather(output, input, *args, **kwargs):
    return state["labels"].get(output.numel(), f"{output.numel()} elements"), dtype_name(output), tensor_bytes(output)


def describe_reduce_scatter(output, input, *args, **kwargs):
    return state["labels"].get(input.numel(), f"{input.numel()} elements"), dtype_name(input), tensor_bytes(input)


def describe_all_reduce(tensor, *args, **kwargs):
    what = "scalar" if tensor.numel() == 1 else f"{tensor.numel()} elements"
    return what, dtype_name(tensor), tensor_bytes(tensor)


def describe_object(object_list, obj=None, *args, **kwargs):
    payload = object_list if obj is None else obj  # broadcast_object_list sends the list itself
    return "python object", "pickle", len(pickle.dumps(payload))


def counting(collective: str, original, describe):
    def wrapper(*args, **kwargs):
        if state["depth"] == 0:
            what, dtype, n_bytes = describe(*args, **kwargs)
            key = (state["phase"], collective, what, dtype)
            calls[key] += 1
            bytes_[key] += n_bytes
        state["depth"] += 1
        try:
            return original(*args, **kwargs)
        finally:
            state["depth"] -= 1
    return wrapper


def in_phase(phase: str, original):
    """Calls `original` with the counter's phase set to `phase`; back to the loop afterwards."""
    def wrapper(*args, **kwargs):
        state["phase"] = phase
        try:
            return original(*args, **kwargs)
        finally:
            state["phase"] = "loop"
    return wrapper


def install_counters():
    T.all_gather_flat = counting("all_gather_flat", T.all_gather_flat, describe_gather)
    T.metrics.all_gather_flat = counting("all_gather_flat", T.metrics.all_gather_flat, describe_gather)
    T.reduce_scatter_flat = counting("reduce_scatter_flat", T.reduce_scatter_flat, describe_reduce_scatter)
    dist.all_reduce = counting("all_reduce", dist.all_reduce, describe_all_reduce)
    dist.all_gather_object = counting("all_gather_object", dist.all_gather_object, describe_object)
    dist.broadcast_object_list = counting("broadcast_object_list", dist.broadcast_object_list, describe_object)
    dist.barrier = counting("barrier", dist.barrier, lambda *a, **k: ("-", "-", 0))
    T.train_step = in_phase("step", T.train_step)
    T.checkpoints.save_checkpoint = in_phase("save", T.checkpoints.save_checkpoint)


# ------------------------------------------------------------------------------------------------
# What the schedule needs, from the shapes alone
# ------------------------------------------------------------------------------------------------

def padded(numel: int, world: int) -> int:
    return -(-numel // world) * world


def unit_numels(mcfg: M.ModelConfig, world: int) -> dict:
    d, hd = mcfg.dim, mcfg.head_dim
    block = 2 * d * mcfg.n_heads * hd + 2 * d * mcfg.n_kv_heads * hd + 3 * d * mcfg.ffn_dim + 2 * d
    head = d + (0 if mcfg.tie_embeddings else mcfg.vocab_size * d)  # final norm (+ lm_head)
    return {"embed": padded(mcfg.vocab_size * d, world), "block": padded(block, world), "head": padded(head, world)}


def expected_per_step(mcfg: M.ModelConfig, world: int) -> dict:
    """(phase, collective, what, dtype) -> (calls, bytes) for one optimizer step."""
    numel = unit_numels(mcfg, world)
    accum = BATCH // (world * MICRO)
    embed_gathers = 2 if mcfg.tie_embeddings else 1  # tied: the head's forward gathers it again
    gathers = {"embed": embed_gathers, "block": 2 * mcfg.n_layers, "head": 1}
    reduces = {"embed": 1, "block": mcfg.n_layers, "head": 1}
    out = {}
    for unit in numel:
        n_gather, n_reduce = accum * gathers[unit], accum * reduces[unit]
        out[("step", "all_gather_flat", unit, "bfloat16")] = (n_gather, n_gather * numel[unit] * BF16_BYTES)
        out[("step", "reduce_scatter_flat", unit, "float32")] = (n_reduce, n_reduce * numel[unit] * FP32_BYTES)
    out[("step", "all_reduce", "scalar", "float32")] = (3, 3 * FP32_BYTES)  # n_tokens, loss, grad norm^2
    # stop signal, rank 0 cannot write metrics, a rank still writing / failed to write a background save
    out[("loop", "all_reduce", "4 elements", "float32")] = (1, 4 * FP32_BYTES)
    # every rank's step time (metrics.compute_s_by_rank: the step line names the slowest rank by its own compute time)
    out[("loop", "all_gather_flat", f"{world} elements", "float64")] = (1, world * 8)
    return out


# ------------------------------------------------------------------------------------------------
# One run of train.main, and its check
# ------------------------------------------------------------------------------------------------

def write_inputs(folder: str, tied: bool) -> tuple[str, str, M.ModelConfig]:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.disable_progress_bar()
    mcfg = M.ModelConfig(**MODEL, tie_embeddings=tied, bos_id=1, eos_id=2)
    init = os.path.join(folder, "init")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**hf.config_to_hf(mcfg, torch.float32))).save_pretrained(init)
    tokens = os.path.join(folder, "tokens.npy")
    np.save(tokens, np.random.default_rng(0).integers(3, MODEL["vocab_size"], 100 * SEQ_LEN).astype(np.uint16))
    return init, tokens, mcfg


def run(tied: bool, init: str, tokens: str, mcfg: M.ModelConfig) -> tuple[list, bool]:
    world = int(os.environ.get("WORLD_SIZE", 1))
    state["labels"] = {n: unit for unit, n in unit_numels(mcfg, world).items()}
    calls.clear()
    bytes_.clear()
    state["phase"] = "setup"
    # The checkpoint folder must be one folder for all ranks (rank 0 commits it); the run id is theirs.
    out_dir = os.path.join(tempfile.gettempdir(), f"comm_volume_{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}",
                           "tied" if tied else "untied")
    T.main([f"--init_from={init}", f"--data={tokens}", "--doc_mask=false", f"--seq_len={SEQ_LEN}",
            f"--batch_size={BATCH}", f"--micro_batch_size={MICRO}", f"--steps={STEPS}", "--dtype=bfloat16",
            "--reduce_dtype=float32", "--eval_every=0", f"--log_every={STEPS}", f"--out_dir={out_dir}",
            "--resume=never", "--overwrite=true"])
    return compare(mcfg, world)


def compare(mcfg: M.ModelConfig, world: int) -> tuple[list, bool]:
    """Rows (key, measured calls, expected calls, measured bytes, expected bytes) per step, and whether
    all of them agree and nothing model-sized ran outside the steps."""
    expected = expected_per_step(mcfg, world)
    per_step = ("step", "loop")
    keys = sorted(set(expected) | {k for k in calls if k[0] in per_step})
    rows, ok = [], True
    for key in keys:
        want_calls, want_bytes = expected.get(key, (0, 0))
        got_calls, got_bytes = calls[key] / STEPS, bytes_[key] / STEPS
        ok &= (got_calls, got_bytes) == (want_calls, want_bytes)
        rows.append((key, got_calls, want_calls, got_bytes, want_bytes))
    for key in calls:
        if key[0] not in per_step:
            ok &= key[1] not in ("all_gather_flat", "reduce_scatter_flat") or (  # model-sized traffic, but for the
                key[1] == "all_gather_flat" and calls[key] == 1 + agree.FABRIC_TIMED_GATHERS)  # fabric's timing
            rows.append((key, calls[key], None, bytes_[key], None))
    return rows, ok


def print_table(title: str, rows: list, ok: bool):
    print(f"\n### {title}: W=2, batch {BATCH} = 2 x micro {MICRO} x 2 accumulation steps, seq {SEQ_LEN}, "
          f"bf16 gathers, fp32 reduce-scatters; per optimizer step (mean of {STEPS})")
    print("| phase | collective | unit / tensor | dtype | calls | expected | bytes | expected bytes | |")
    print("|---|---|---|---|---:|---:|---:|---:|---|")
    for (phase, collective, what, dtype), got_c, want_c, got_b, want_b in rows:
        if want_c is None:  # outside the steps: once per run, reported, not expected
            print(f"| {phase} (once) | {collective} | {what} | {dtype} | {got_c:g} | | {got_b:,.0f} | | |")
            continue
        mark = "ok" if (got_c, got_b) == (want_c, want_b) else "MISMATCH"
        print(f"| {phase} | {collective} | {what} | {dtype} | {got_c:g} | {want_c:g} | {got_b:,.0f} | "
              f"{want_b:,.0f} | {mark} |")
    print(f"all equal, nothing model-sized outside the steps: {ok}")


def summary(mcfg: M.ModelConfig, world: int) -> str:
    """The schedule's gathered bytes against the plain 'two gathers of everything' count."""
    numel = unit_numels(mcfg, world)
    model = numel["embed"] + mcfg.n_layers * numel["block"] + numel["head"]
    gathered = sum(bytes_[k] for k in calls if k[:2] == ("step", "all_gather_flat")) / STEPS
    accum = BATCH // (world * MICRO)
    return (f"per micro-batch: gathered {gathered / accum:,.0f} B = {gathered / accum / (model * BF16_BYTES):.3f} "
            f"x the padded model in bf16 ({model * BF16_BYTES:,} B); plain ZeRO-3 gathers 2.000 x")


def main() -> int:
    install_counters()
    failed = False
    # Per rank, the same seeded files, all written before the process group exists: with a group,
    # transformers' save_pretrained writes on rank 0 only.
    inputs = {tied: write_inputs(tempfile.mkdtemp(prefix=f"comm_volume_rank{os.environ.get('RANK', '0')}_"), tied)
              for tied in (False, True)}
    # Both runs share one group: train.main uses a group that exists and leaves it to its maker (a
    # second init_process_group on the same torchrun store would read the first one's stale addresses).
    cfg = T.parse_args(["--device=cpu"])
    store, rank, world = T.processes.rendezvous(cfg)  # the group as train.setup makes it, no facts agreed
    T.processes.make_group(cfg, store, rank, world, T.processes.pick_device(cfg),
                           [T.agree.host_name()] * world)
    for tied in (False, True):
        rows, ok = run(tied, *inputs[tied])
        failed |= not ok
        if int(os.environ.get("RANK", 0)) == 0:
            mcfg = M.ModelConfig(**MODEL, tie_embeddings=tied)
            numel = unit_numels(mcfg, 2)
            print_table(f"{'tied' if tied else 'untied'} embeddings, {M.count_params(mcfg)['total']:,} params, "
                        f"padded units: embed {numel['embed']:,}, block {numel['block']:,} x {mcfg.n_layers}, "
                        f"head {numel['head']:,}", rows, ok)
            print(summary(mcfg, 2))
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # as train.py: no interpreter teardown, where gloo's threads occasionally abort
