"""Attention without flash_attn, and a micro-batch's set-up without host syncs.

No GPU here, so the CUDA decisions are tested as decisions: the model runs on CPU tensors that say they
are CUDA (`is_cuda` patched), and the arguments F.scaled_dot_product_attention receives are checked
against what SDPA's CUDA kernels accept (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, torch
2.11 to 2.13): a call that neither the flash nor the memory-efficient kernel takes runs the math kernel,
which holds the B x H x T x T scores. Transformers' LlamaForCausalLM stays the oracle for the results."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from common import ROOT, hf_model, init_processes, ours_from_hf, small_config
from torch.utils._python_dispatch import TorchDispatchMode

from components import metrics
import model as M

SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


def cuda_kernel_that_accepts(call: dict):
    """'flash', 'memory-efficient' or None (the math kernel): SDPA's CUDA constraints that these shapes meet
    or miss. Flash: no mask, bf16/fp16, grouped K/V only with enable_gqa. Memory-efficient: any of the
    three dtypes, the same head count for q, k and v, and a mask (if any) in the query's dtype or bool,
    broadcastable to (B, H, T, T), with stride 1 in its last dimension; its other strides multiples of 8
    elements, or SDPA pads a copy of it on every call."""
    q, k, v, mask = call["query"], call["key"], call["value"], call.get("attn_mask")
    same_heads = q.shape[1] == k.shape[1] == v.shape[1]
    if mask is None and q.dtype in (torch.bfloat16, torch.float16) and (same_heads or call.get("enable_gqa")):
        return "flash"
    if not same_heads:
        return None
    if mask is not None:
        B, H, T, _ = q.shape
        shape_ok = mask.dim() == 4 and mask.shape[0] in (1, B) and mask.shape[1] in (1, H) and mask.shape[2:] == (T, T)
        aligned = mask.stride(-1) == 1 and all(s % 8 == 0 for s in mask.stride()[:-1])
        if not (shape_ok and aligned and mask.dtype in (q.dtype, torch.bool)):
            return None
    return "memory-efficient"


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every F.scaled_dot_product_attention call's arguments, by name; the real SDPA still computes."""
    calls, real = [], F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append(dict(zip(SDPA_PARAMETERS, args), **kwargs))
        return real(*args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return calls


@pytest.fixture
def cuda_like(monkeypatch):
    """CPU tensors that answer is_cuda = True: attention() takes its CUDA decisions on them. flash_attn is
    absent, as on the project's GPU machine."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(M, "flash_attn_func", None)


def packed_batch(cfg):
    """Two rows: three documents (5, 9, 10 tokens) and two (13, 11)."""
    lengths = [[5, 9, 10], [13, 11]]
    tokens = torch.randint(3, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    starts = torch.zeros(2, 24, dtype=torch.bool)
    for row, lens in enumerate(lengths):
        starts[row, np.cumsum([0] + lens[:-1])] = True
    return tokens, starts, lengths


def test_cuda_sdpa_calls_suit_a_kernel_without_dense_scores(sdpa_calls, cuda_like):
    """Packed documents (mask) and whole rows (causal), bf16 and fp32, GQA (8 heads, 2 KV heads): every
    call is one the flash or memory-efficient kernel takes. Today's packed path (mask + enable_gqa) and
    fp32 causal path (enable_gqa) are neither."""
    cfg = small_config(dim=64, n_heads=8, n_kv_heads=2)  # head_dim 8: the memory-efficient kernel's alignment
    tokens, starts, _ = packed_batch(cfg)
    for dtype in (torch.bfloat16, torch.float32):
        model = M.Llama(cfg).to(dtype)
        with torch.no_grad():
            for doc_starts in (starts, None):
                sdpa_calls.clear()
                model(tokens, doc_starts=doc_starts)
                assert len(sdpa_calls) == cfg.n_layers
                for call in sdpa_calls:
                    kernel = cuda_kernel_that_accepts(call)
                    where = (dtype, "packed" if doc_starts is not None else "causal", call["key"].shape,
                             call.get("enable_gqa"), None if call.get("attn_mask") is None else call["attn_mask"].dtype)
                    assert kernel is not None, where
                    if call.get("attn_mask") is not None:
                        assert not call.get("enable_gqa") and call["key"].shape[1] == call["query"].shape[1], where
                    # The kernel the startup log and the benchmark name is the one that takes the call.
                    described = metrics.attention_kernel("cuda", dtype, doc_mask=doc_starts is not None)
                    assert kernel in described, (described, kernel)


def test_cuda_expanded_path_matches_transformers(sdpa_calls, monkeypatch):
    """fp32, the CUDA path forced on CPU tensors: K/V repeated to 4 heads and the additive block-diagonal
    mask give each packed document transformers' logits for that document alone (1e-5), and the same
    logits as the CPU path (grouped K/V, enable_gqa)."""
    cfg = small_config()
    ref = hf_model(cfg, seed=1)
    ours = ours_from_hf(cfg, ref)
    tokens, starts, lengths = packed_batch(cfg)
    with torch.no_grad():
        alone = [[ref(tokens[row:row + 1, a:b]).logits[0] for a, b in zip(np.cumsum([0] + lens[:-1]), np.cumsum(lens))]
                 for row, lens in enumerate(lengths)]
        whole_rows_ref = ref(tokens).logits
        on_cpu = ours(tokens, doc_starts=starts)
        assert all(c["key"].shape[1] == cfg.n_kv_heads and c["enable_gqa"] for c in sdpa_calls)  # the CPU path
        sdpa_calls.clear()
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # from here, the CUDA path
        monkeypatch.setattr(M, "flash_attn_func", None)
        packed, whole_rows = ours(tokens, doc_starts=starts), ours(tokens)
    assert all(c["key"].shape[1] == cfg.n_heads and not c["enable_gqa"] for c in sdpa_calls), \
        "the CUDA path must repeat K/V to the query's heads"
    for row, lens in enumerate(lengths):
        for doc_logits, a, b in zip(alone[row], np.cumsum([0] + lens[:-1]), np.cumsum(lens)):
            torch.testing.assert_close(packed[row, a:b], doc_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole_rows, whole_rows_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed, on_cpu, rtol=1e-6, atol=1e-6)


def test_attention_kernel_says_which_path_runs(monkeypatch):
    monkeypatch.setattr(M, "flash_attn_func", None)
    bf16, fp32 = torch.bfloat16, torch.float32
    assert metrics.attention_kernel("cuda", bf16, doc_mask=True) == \
        "SDPA memory-efficient (K/V expanded to H heads, block-diagonal mask)"
    assert metrics.attention_kernel("cuda", bf16, doc_mask=False) == "SDPA flash (grouped K/V, causal)"
    assert metrics.attention_kernel("cuda", fp32, doc_mask=False) == "SDPA memory-efficient (K/V expanded to H heads, causal)"
    assert metrics.attention_kernel(torch.device("cpu"), bf16, doc_mask=True) == "SDPA (CPU)"
    monkeypatch.setattr(M, "flash_attn_func", lambda *a, **k: None)  # flash_attn importable
    assert metrics.attention_kernel("cuda", bf16, doc_mask=True) == "flash_attn varlen (one sequence per document)"
    assert metrics.attention_kernel("cuda", bf16, doc_mask=False) == "flash_attn"
    # flash_attn runs bf16/fp16 only
    assert metrics.attention_kernel("cuda", fp32, doc_mask=True).startswith("SDPA memory-efficient")


def test_selective_checkpointing_keeps_every_attention_forward():
    """flash_attn's ops exist only where it is installed (not here): a fresh process registers stand-ins
    under their names (flash_attn::_flash_attn_forward, flash_attn::_flash_attn_varlen_forward, as
    flash_attn >= 2.6 registers them) before importing train, and SAVED_OPS must hold both, with SDPA's
    flash, memory-efficient and cuDNN forwards. Without the varlen one, packed documents under flash_attn
    are recomputed in backward."""
    script = (
        "import json, torch\n"
        "for name in ('_flash_attn_forward', '_flash_attn_varlen_forward'):\n"
        "    torch.library.define(f'flash_attn::{name}', '(Tensor q) -> Tensor')\n"
        "import train\n"
        "print(json.dumps(sorted(str(op) for op in train.SAVED_OPS)))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    expected = {"flash_attn._flash_attn_forward.default", "flash_attn._flash_attn_varlen_forward.default",
                "aten._scaled_dot_product_flash_attention.default",
                "aten._scaled_dot_product_efficient_attention.default",
                "aten._scaled_dot_product_cudnn_attention.default", "aten.mm.default"}
    assert expected <= saved, expected - saved


# -- a micro-batch's set-up never waits for the GPU ------------------------------------------------

# Ops that copy a device value to the host, or whose output size depends on device values: each makes
# the host wait for the GPU (item(), bool(), int() all go through _local_scalar_dense).
SYNCING_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
               "aten.unique_consecutive.default", "aten._unique2.default"}


class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def eos_starts(inputs: np.ndarray, eos_id: int) -> np.ndarray:
    """Document starts by the EOS convention (data.TokenData's for EOS-ended data): row starts and after each EOS."""
    starts = np.ones(inputs.shape, dtype=bool)
    starts[:, 1:] = inputs[:, :-1] == eos_id
    return starts


def reference_layout(inputs: np.ndarray, eos_id: int):
    """Per-token positions, document ids and the flattened boundaries, by walking the rows."""
    positions, doc_ids, boundaries = np.zeros(inputs.shape, int), np.zeros(inputs.shape, int), []
    for b, row in enumerate(inputs):
        doc, pos = 0, 0
        for t in range(len(row)):
            if t > 0 and row[t - 1] == eos_id:
                doc, pos = doc + 1, 0
            if pos == 0:
                boundaries.append(b * len(row) + t)
            positions[b, t], doc_ids[b, t], pos = pos, doc, pos + 1
    return positions, doc_ids, boundaries + [inputs.size]


@pytest.mark.parametrize("flash", [False, True], ids=["sdpa-mask", "flash-varlen"])
def test_make_batch_builds_the_layout_on_the_host_without_syncs(monkeypatch, flash):
    """The layout comes from the numpy token ids (document_layout is handed numpy), no op that would make
    the host wait for a GPU runs, and the result is the layout of the packed documents."""
    monkeypatch.setattr(M, "uses_flash", lambda device, dtype: flash)  # the varlen layout, on CPU tensors
    handed, real_layout = [], M.document_layout

    def recording_layout(starts, *args, **kwargs):
        handed.append(type(starts))
        return real_layout(starts, *args, **kwargs)
    monkeypatch.setattr(M, "document_layout", recording_layout)
    mcfg = small_config()
    inputs = np.array([[5, 6, 2, 7, 8, 9, 2, 4, 4, 3, 3, 3],
                       [5, 6, 7, 8, 2, 9, 9, 2, 2, 4, 3, 3]], dtype=np.int64)
    targets = np.roll(inputs, -1, axis=1)
    recorder = OpRecorder()
    with recorder:
        ctx = M.make_batch(mcfg, inputs, targets, eos_starts(inputs, 2), True, torch.device("cpu"), torch.float32)
    assert not SYNCING_OPS & set(recorder.ops), SYNCING_OPS & set(recorder.ops)
    assert handed == [np.ndarray]
    positions, doc_ids, boundaries = reference_layout(inputs, eos_id=2)
    layout = ctx["layout"]
    assert layout.positions.tolist() == positions.tolist()
    if flash:
        assert layout.cu_seqlens.tolist() == boundaries and layout.cu_seqlens.dtype == torch.int32
        assert layout.max_seqlen == max(np.diff(boundaries)) and isinstance(layout.max_seqlen, int)
    else:
        T_ = inputs.shape[1]
        allowed = (doc_ids[:, :, None] == doc_ids[:, None, :]) & np.tri(T_, dtype=bool)
        assert (layout.mask[:, 0] == 0).tolist() == allowed.tolist()  # additive: 0 where allowed, -inf elsewhere
    cos, sin = M.rope_cos_sin(mcfg, torch.from_numpy(positions), torch.float32)
    assert torch.equal(ctx["cos"], cos) and torch.equal(ctx["sin"], sin)
    assert ctx["tokens"].tolist() == inputs.tolist() and ctx["targets"].tolist() == targets.tolist()


def test_make_batch_of_whole_rows_has_no_layout_and_no_syncs():
    inputs = np.arange(3, 27, dtype=np.int64).reshape(2, 12)  # no EOS: one document per row
    recorder = OpRecorder()
    with recorder:
        ctx = M.make_batch(small_config(), inputs, inputs, eos_starts(inputs, 2), True, torch.device("cpu"), torch.float32)
    assert not SYNCING_OPS & set(recorder.ops), SYNCING_OPS & set(recorder.ops)
    assert ctx["layout"] is None
    cos, _ = M.rope_cos_sin(small_config(), torch.arange(12).expand(2, 12), torch.float32)
    assert torch.equal(ctx["cos"], cos)


def test_rope_inverse_frequencies_reach_the_device_without_a_blocking_copy(monkeypatch):
    """rope_cos_sin copies inv_freq through to_device (pinned and asynchronous on CUDA); a plain
    .to(device) from the host in every forward is a host-device sync. The values stay Hugging Face's
    (computed on the CPU)."""
    cfg = small_config(rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=16))
    copied, real = [], M.to_device
    monkeypatch.setattr(M, "to_device", lambda array, device: copied.append(array) or real(array, device))
    positions = torch.arange(10).expand(2, 10)
    cos, sin = M.rope_cos_sin(cfg, positions, torch.float32)
    expected = M.rope_inv_freq(cfg)
    assert len(copied) == 1 and torch.equal(copied[0], expected)
    emb = torch.cat((positions[..., None].float() * expected,) * 2, dim=-1)
    assert torch.equal(cos, emb.cos()) and torch.equal(sin, emb.sin())


def test_benchmark_reports_the_attention_kernel_and_host_syncs():
    """bench/gpu.py: the warnings CUDA's sync debug mode raises inside a step are counted where they come
    from (simulated here: no CUDA), other warnings pass through, and the table shows the attention kernel
    and the syncs per step."""
    import warnings
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu as G
    with pytest.warns(UserWarning, match="unrelated"):
        with G.host_syncs(cuda=False) as places:
            warnings.warn("called a synchronizing CUDA operation")
            warnings.warn("unrelated")
    assert len(places) == 1 and places[0].startswith("test_attention.py:"), places
    run = dict(tokens_per_sec_per_gpu=1000.0, mfu=0.4, peak_gib=50.0, step_s=1.5, host_syncs_per_step=[7, 7, 9],
               fake_cuda_peak_gib=49.04)
    results = dict(date="d", world=1, layers=2, params=1e9, seq_len=8192, accum=2, baseline_attention="sdpa",
                   environment=dict(torch="2.11", transformers="5"), runs={"ours": run},
                   attention={"whole rows": metrics.attention_kernel("cuda", torch.bfloat16, False),
                              "packed documents": "SDPA memory-efficient (K/V expanded to H heads, block-diagonal "
                                                  "mask); SDPA picks EFFICIENT_ATTENTION"},
                   correctness=dict(float32=dict(worst_rel=1e-6), bfloat16=dict(worst_rel=1e-3)),
                   planned=dict(gpu="h200", tokens_per_sec_per_gpu=900.0, mfu=0.3, peak_gib_per_gpu=60.0))
    text = G.table(results)
    assert "SDPA picks EFFICIENT_ATTENTION" in text and "host syncs/step" in text
    assert "| ours | 1,000 | 40.0% | 50.0 | 49.0 | 1.500 | 7 |" in text  # the peak beside fake CUDA's


@pytest.fixture
def deterministic_off_after():
    """torch's deterministic mode and CUBLAS_WORKSPACE_CONFIG as they were before the test."""
    was_on, workspace = torch.are_deterministic_algorithms_enabled(), os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    yield
    torch.use_deterministic_algorithms(was_on)
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    if workspace is not None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace


def test_deterministic_reaches_flash_attn_and_torch(monkeypatch, deterministic_off_after):
    """--deterministic: processes.pick_device (common.init_processes) turns torch's deterministic algorithms on and sets cuBLAS's fixed
    workspace (only where unset), and both flash-attn calls (whole rows, packed documents) get
    deterministic=True; without the flag, False. flash-attn is faked: it records its keyword arguments."""
    import torch.distributed as dist
    from components import out_dir as OD
    import train as T
    calls = []

    def fake_flash(q, *args, **kwargs):
        calls.append(kwargs.get("deterministic"))
        return torch.zeros_like(q)
    monkeypatch.setattr(M, "uses_flash", lambda device, dtype: True)
    monkeypatch.setattr(M, "flash_attn_func", fake_flash)
    monkeypatch.setattr(M, "flash_attn_varlen_func", fake_flash)
    cfg = small_config()
    _, starts, _ = packed_batch(cfg)
    q = torch.randn(2, 24, 4, 8)
    kv = torch.randn(2, 24, 2, 8)
    layout = M.document_layout(starts)  # uses_flash: the varlen form, cu_seqlens
    assert layout.cu_seqlens is not None
    for flag, workspace_before, workspace_after in (("false", None, None), ("true", None, ":4096:8"),
                                                   ("true", ":16:8", ":16:8")):
        torch.use_deterministic_algorithms(False)
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        if workspace_before:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace_before
        init_processes(T.parse_args(["--deterministic", flag, "--device", "cpu"]))
        dist.destroy_process_group()
        OD.group = None
        assert torch.are_deterministic_algorithms_enabled() == (flag == "true")
        assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == workspace_after
        calls.clear()
        M.attention(q, kv, kv)
        M.attention(q, kv, kv, layout)
        assert calls == [flag == "true"] * 2, (flag, calls)


def test_deterministic_trains_the_same_on_cpu_and_is_not_compared_on_resume(tmp_path):
    """On CPU the kernels are deterministic already: --deterministic (torch's strict mode, which raises on an op
    without a deterministic kernel) trains bit for bit as without it, packed documents included. A run
    stopped without it resumes with it, exactly and without a changed-flag warning (checkpoints.RESUME_NOT_COMPARED:
    it chooses kernels, not what is trained)."""
    from common import read_metrics, run_train, stopped_at
    flags = ["--model", "tiny", "--steps", "4", "--ckpt_every", "2", "--seq_len", "64", "--batch_size", "4",
             "--micro_batch_size", "2", "--eval_every", "0"]
    run_train(flags + ["--out_dir", str(tmp_path / "plain")])
    plain = [r["loss"] for r in read_metrics(str(tmp_path / "plain"))]
    resumed = stopped_at(str(tmp_path / "plain"), str(tmp_path / "resumed"), 2)
    proc = run_train(flags + ["--out_dir", str(resumed), "--deterministic", "true"])
    assert "deterministic" not in proc.stderr, proc.stderr[-2000:]
    assert [r["loss"] for r in read_metrics(str(resumed))] == plain
