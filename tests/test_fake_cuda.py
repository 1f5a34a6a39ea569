"""The CUDA path of train_step, run on fake CUDA (tests/fake_cuda.py): every CUDA branch the flags select
runs, every collective is one NCCL would accept, attention takes the kernel metrics.attention_kernel names,
and the peak device memory is what plan.py predicts for the same flags.

Each scenario is one optimizer step as rank 0 of W in a fresh process (the shim must be loaded before
torch); they cover --ac none/selective/full, partial checkpointing, both offloads, --doc_mask, the
flash_attn stand-in on and off and both --reduce_dtype, at W = 2..4, and the two-node 70B recipe's flags
at 70B widths (4 blocks: the widths decide the memory per block, not the depth). FORKS: changes a researcher
makes (a block that keeps more, another optimizer, Qwen3's QK-norm, frozen units, LoRA and DoRA adapters), each
planned within 2% of its step with no edit to plan.py, which runs the fork's code in the same process."""
import json
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fake_cuda  # noqa: E402

# 1B-ish widths, 3 blocks: large enough that every part plan.py counts is visible, small enough to be quick.
SMALL = dict(vocab_size=32000, dim=1024, n_layers=3, n_heads=8, n_kv_heads=2, head_dim=128, ffn_dim=3584,
             max_seq_len=8192, bos_id=1, eos_id=2)
WIDE_70B = dict(vocab_size=128256, dim=8192, n_layers=4, n_heads=64, n_kv_heads=8, head_dim=128, ffn_dim=28672,
                max_seq_len=8192, bos_id=128000, eos_id=128001)

# (name, model, W, flash_attn stand-in, flags, relative tolerance against the planner)
SCENARIOS = [
    ("ac none, SDPA flash, fp32 reduce", SMALL, 2, False,
     "--seq_len 2048 --batch_size 4 --micro_batch_size 1 --ac none --doc_mask false", 0.05),
    ("ac selective, doc mask on SDPA memory-efficient, bf16 reduce", SMALL, 3, False,
     "--seq_len 2048 --batch_size 6 --micro_batch_size 1 --ac selective --doc_mask true --reduce_dtype bfloat16", 0.05),
    ("ac full, activations offloaded, flash_attn varlen", SMALL, 4, True,
     "--seq_len 2048 --batch_size 8 --micro_batch_size 1 --ac full --offload_activations true --doc_mask true", 0.05),
    ("optimizer and activations offloaded, partial checkpointing, flash_attn", SMALL, 2, True,
     "--seq_len 2048 --batch_size 4 --micro_batch_size 1 --ac full --offload_activations true --ac_blocks 2 "
     "--ac_rest selective --offload_optimizer true --doc_mask false --reduce_dtype bfloat16", 0.05),
    ("the two-node 70B recipe's flags at 70B widths", WIDE_70B, 16, True,
     "--seq_len 8192 --batch_size 16 --micro_batch_size 1 --ac full --offload_activations true "
     "--reduce_dtype bfloat16", 0.02),
]

# Qwen3-32B's widths (its config.json, model.PRESETS["qwen3-32b"]), 4 blocks: QK-norm, head_dim 128 != 5120 / 64.
WIDE_QWEN3_32B = dict(vocab_size=151936, dim=5120, n_layers=4, n_heads=64, n_kv_heads=8, head_dim=128, ffn_dim=25600,
                      norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960, bos_id=151643, eos_id=151645, family="qwen3",
                      qk_norm=True)

# Forks the planner must see with no edit to it (issue 30): (name, model, W, flash_attn stand-in, flags,
# tolerance, fake_cuda.VARIANTS entry applied in the run's process before the step and the plan, or "",
# why it cannot run yet or ""). Each one's bytes are what a hand count beside the code would miss.
FORKS = [
    ("a block that keeps one more tensor (fp32 soft-capped attention output)", WIDE_70B, 16, True,
     "--seq_len 8192 --batch_size 16 --micro_batch_size 1 --ac none --reduce_dtype bfloat16", 0.02,
     "soft-capped attention", ""),
    ("an optimizer with one state tensor (SGD with momentum)", WIDE_70B, 16, True,
     "--seq_len 8192 --batch_size 16 --micro_batch_size 1 --ac full --offload_activations true "
     "--reduce_dtype bfloat16", 0.02, "sgd momentum", ""),
    ("an optimizer whose one state tensor is bf16 (SGD, momentum in bf16)", WIDE_70B, 16, True,
     "--seq_len 8192 --batch_size 16 --micro_batch_size 1 --ac full --offload_activations true "
     "--reduce_dtype bfloat16", 0.02, "sgd momentum in bf16", ""),
    ("Qwen3's QK-norm at 32B widths", WIDE_QWEN3_32B, 16, True,
     "--seq_len 8192 --batch_size 16 --micro_batch_size 1 --ac none --reduce_dtype bfloat16", 0.02, "", ""),
    # Frozen units (--freeze): master shards only, no gradient, no backward for the frozen prefix. The planner's
    # numbers alone: tests/test_plan.py::test_frozen_units_are_planned.
    ("frozen embedding and first two blocks, the recipe's offloaded activations", WIDE_70B, 16, True,
     "--seq_len 8192 --batch_size 16 --micro_batch_size 1 --ac full --offload_activations true --reduce_dtype bfloat16 "
     r"--freeze model\.(embed_tokens|layers\.[01])\.", 0.02, "", ""),
    # A block as two units, the first frozen: a frozen base beside a trained unit in each block's stage.
    ("each block two units, its attention frozen", WIDE_70B, 16, True,
     "--seq_len 8192 --batch_size 16 --micro_batch_size 1 --ac full --offload_activations true --reduce_dtype bfloat16 "
     "--freeze self_attn|input_layernorm", 0.02, "two units per block", ""),
    # Adapters beside a frozen base, the head frozen too (issue 52): each block's adapters a unit of their own on q_proj
    # and v_proj. No gradient or reduce buffer for a frozen head or block unit; DoRA keeps its base outputs.
    ("LoRA on q_proj and v_proj, everything else frozen", WIDE_70B, 16, True,
     "--seq_len 8192 --batch_size 16 --micro_batch_size 1 --ac full --reduce_dtype bfloat16 "
     "--freeze ^(?!.*lora_)", 0.02, "lora", ""),
    ("DoRA on q_proj and v_proj, everything else frozen", WIDE_70B, 16, True,
     "--seq_len 8192 --batch_size 16 --micro_batch_size 1 --ac none --reduce_dtype bfloat16 "
     "--freeze ^(?!.*lora_)", 0.02, "dora", ""),
]

O_GRAD_SLOTS = 2  # offload.GRAD_SLOTS (offload.py is not imported here: the shim loads before torch)

KERNEL_COUNTERS = {  # metrics.attention_kernel's words -> what tests/fake_cuda.py counts when it runs
    "flash_attn varlen": "attention: flash_attn varlen", "flash_attn": "attention: flash_attn",
    "SDPA flash": "attention: SDPA flash", "SDPA memory-efficient": "attention: SDPA memory-efficient"}


@pytest.fixture(scope="module")
def shim():
    build_dir = os.environ.get("FAKE_CUDA_BUILD_DIR", os.path.join(os.path.expanduser("~"), ".cache", "llama-zero3"))
    try:
        return fake_cuda.build_shim(build_dir)
    except RuntimeError as e:
        pytest.skip(f"fake CUDA not available: {e}")


def selected(request, param: str, cases: list) -> list:
    """The cases this session runs (`-k` selects by name): a fixture that runs them all at once runs only these."""
    names = {item.callspec.params[param][0] for item in request.session.items
             if hasattr(item, "callspec") and param in item.callspec.params}
    return [case for case in cases if case[0] in names]


@pytest.fixture(scope="module")
def results(shim, tmp_path_factory, request):
    """Each selected scenario in its own process, two at a time (each is one single-threaded process)."""
    out = tmp_path_factory.mktemp("fake_cuda")

    def run(scenario):
        name, model, world, flash, flags, _ = scenario
        return name, fake_cuda.run(shim, str(out / f"{SCENARIOS.index(scenario)}.json"), flags.split(), world,
                                   flash=flash, model_json=json.dumps(model))
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, selected(request, "scenario", SCENARIOS)))


@pytest.fixture(scope="module")
def fork_results(shim, tmp_path_factory, request):
    """Each selected fork that can run, in its own process, two at a time."""
    out = tmp_path_factory.mktemp("fake_cuda_forks")
    ready = [f for f in selected(request, "fork", FORKS) if not f[7]]

    def run(fork):
        name, model, world, flash, flags, _, variant, _ = fork
        return name, fake_cuda.run(shim, str(out / f"{FORKS.index(fork)}.json"), flags.split(), world, flash=flash,
                                   model_json=json.dumps(model), variant=variant)
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, ready))


@pytest.mark.parametrize("fork", FORKS, ids=[f[0] for f in FORKS])
def test_a_fork_is_planned_within_2_percent(fork_results, fork):
    """The peak device memory of a fork's step at 70B-class widths is what plan.py predicts, in the same process,
    for the same code: the planner runs the fork's block and optimizer (plan_memory.read_block, train.Unit readings)."""
    name, model, world, flash, flags, tolerance, variant, pending = fork
    if pending:
        pytest.skip(pending)
    r = fork_results[name]
    ratio = r["peak_bytes"] / r["plan"]["allocated_bytes"]
    assert math.isclose(ratio, 1, rel_tol=tolerance), (ratio, r["peak_by_phase"], r["plan"]["allocated_by_phase"])


def flag(flags: str, name: str, default: str) -> str:
    words = flags.split()
    return words[words.index(name) + 1] if name in words else default


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_cuda_branches_collectives_attention_and_memory(results, scenario):
    name, model, world, flash, flags, tolerance = scenario
    r, used = results[name], results[name]["used"]
    layers, n_units = model["n_layers"], model["n_layers"] + 2
    micro_batches = int(flag(flags, "--batch_size", "16")) // (world * int(flag(flags, "--micro_batch_size", "4")))
    policies = ([flag(flags, "--ac", "selective")] * int(flag(flags, "--ac_blocks", str(layers)))
                + [flag(flags, "--ac_rest", "none")] * layers)[:layers]
    offloaded = policies.count("full") if flag(flags, "--offload_activations", "false") == "true" else 0

    # Collectives (each checked as NCCL checks it, in the run): per micro-batch every unit is all-gathered for
    # forward and every block again for backward (the head stays gathered, the embedding's backward needs no
    # weights), every unit's gradient reduce-scattered once; every asynchronous one waited for.
    assert used["all-gather started"] == used["all-gather waited"] == micro_batches * (n_units + layers)
    assert used["reduce-scatter started"] == used["reduce-scatter waited"] == micro_batches * n_units
    assert used["host reads"] == 1  # the step's one sync: (loss, grad norm) for the clip and the skip decision

    # Attention: the kernel metrics.attention_kernel names for these flags, and only that one.
    kernel = next(counter for words, counter in KERNEL_COUNTERS.items() if r["attention_kernel"].startswith(words))
    assert {k for k in used if k.startswith("attention: ")} == {kernel}, (r["attention_kernel"], used)
    assert used[kernel] >= micro_batches * layers

    # --offload_activations: each offloaded block's input goes to pinned memory on the copy stream and comes
    # back on it, the compute stream waiting for an event; record_stream keeps both copies' memory.
    offload_optimizer = flag(flags, "--offload_optimizer", "false") == "true"
    if offloaded:
        assert used["stream created"] == 1 + offload_optimizer  # --offload_optimizer has its own (below)
        assert used["record_stream"] == 2 * offloaded * micro_batches
    else:
        assert used.get("stream created", 0) - offload_optimizer == used.get("record_stream", 0) == 0
    # --offload_optimizer: the fp32 state in one page-locked buffer of exactly the planner's bytes (not
    # pin_memory=True allocations, which PyTorch rounds up to a power of two each);
    # each reduce-scattered slice copied down without waiting and added once its event has passed; the bf16
    # copies of the slices refreshed from pinned memory.
    # Both refreshes (the first weights', and the step's after its update) send each unit's slice up in the
    # compute dtype (cast on the host) on the copy stream; each slot's previous copy up is waited for before
    # the host casts into it again (all but the last GRAD_SLOTS); the first gather of each unit after a
    # refresh makes the compute stream wait for that unit's copy. The slices' adds are the worker's tasks.
    side = "on a side stream"
    dtype = flag(flags, "--reduce_dtype", "float32")
    if offload_optimizer:
        assert used["host buffers page-locked"] == 1
        assert used["host bytes page-locked"] == r["plan"]["host_bytes"]["state"]
        activations_down = offloaded * micro_batches if dtype == "bfloat16" else 0  # block inputs, bf16
        assert used[f"async copies device to host {dtype} {side}"] == n_units * micro_batches + activations_down
        assert used["tasks for the host worker"] == n_units * micro_batches
        assert used[f"async copies host to device bfloat16 {side}"] == 2 * n_units + offloaded * micro_batches
        assert used.get(f"async copies host to device float32 {side}", 0) == 0  # not the fp32 master
        assert used["code run on a side stream"] == 2 * offloaded * micro_batches + n_units * micro_batches + 2 * n_units
        assert used["event synchronized"] == n_units * micro_batches + 2 * n_units - O_GRAD_SLOTS
        assert used["event recorded"] - used["event synchronized"] == offloaded * micro_batches + O_GRAD_SLOTS
        assert used["stream waits for event"] == offloaded * micro_batches + n_units
    else:
        assert used.get("event synchronized", 0) == used.get("host buffers page-locked", 0) == 0
        assert used.get("code run on a side stream", 0) == used.get("record_stream", 0) == 2 * offloaded * micro_batches
        assert used.get("event recorded", 0) == used.get("stream waits for event", 0) == offloaded * micro_batches

    # Peak device memory: what plan.py predicts for the same flags, attention and W.
    ratio = r["peak_bytes"] / r["plan"]["allocated_bytes"]
    assert math.isclose(ratio, 1, rel_tol=tolerance), (ratio, r["peak_by_phase"], r["plan"]["allocated_by_phase"])


def test_a_collective_nccl_would_refuse_fails_the_run():
    import torch
    device = torch.device("meta")  # the check itself is device-agnostic; the runs use cuda:0
    gather_out, shard = torch.empty(8, device=device), torch.empty(4, device=device)
    fake_cuda.check_collective("all-gather", gather_out, shard, world=2, device=device)
    with pytest.raises(AssertionError, match="not W = 3"):
        fake_cuda.check_collective("all-gather", gather_out, shard, world=3, device=device)
    with pytest.raises(AssertionError, match="output torch.bfloat16, input torch.float32"):
        fake_cuda.check_collective("reduce-scatter", torch.empty(4, dtype=torch.bfloat16, device=device),
                                   gather_out, world=2, device=device)
    with pytest.raises(AssertionError, match="not the rank's CUDA device"):
        fake_cuda.check_collective("all-gather", gather_out, torch.empty(4), world=2, device=device)


def test_no_compiler_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler") as e:
        fake_cuda.build_shim(str(tmp_path))
    assert "\n" not in str(e.value)
