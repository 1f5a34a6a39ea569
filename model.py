"""Llama 3 (and Qwen3, a Llama with a norm on each head's query and key), computed exactly as Hugging Face
`transformers`' `LlamaForCausalLM` (`Qwen3ForCausalLM`) computes it. FAMILIES says what differs.

Read top to bottom: config and presets, RoPE (with the llama3 frequency scaling), then the layers:
RMSNorm, packed documents kept apart (DocumentLayout), attention (FlashAttention-2 where it applies,
PyTorch SDPA elsewhere: uses_flash), the decoder block, the model; last, what the rest of the trainer
reads from a config alone (counts, FLOPs, shape checks, checkpointing policies, the optimizer's state).
Parameter names are Hugging Face's minus the leading "model.", and HF's q/k layout already suits its
`rotate_half` RoPE, used here: import and export (components/hf.py, with config.json) are a rename, never
a permutation.

Nothing here knows about sharding: train.py calls the forward's three pieces (`embed`, each block,
`head_loss`) with its gather/free around each; `Llama.forward` strings them together in one process, which
is what the tests compare against HF. components/sample.py runs the same blocks with a KVCache each.
"""

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


try:  # FlashAttention-2: CUDA only, optional. Without it, SDPA; checks.py refuses an install that does not import.
    from flash_attn import flash_attn_func, flash_attn_varlen_func
    FLASH_ATTN_IMPORT_ERROR = None
except ImportError as e:
    flash_attn_func = flash_attn_varlen_func = None
    FLASH_ATTN_IMPORT_ERROR = e


# ----------------------------------------------------------------------------------------------
# Config and presets
# ----------------------------------------------------------------------------------------------

@dataclass
class ModelConfig:
    vocab_size: int = 512
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 0              # 0 means dim // n_heads
    ffn_dim: int = 768
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: dict | None = None  # llama3 frequency scaling (its keys: llama3()); None for plain RoPE
    max_seq_len: int = 8192
    tie_embeddings: bool = False
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int | None = None      # config.json's pad_token_id: lookups give its embedding row no gradient
    init_std: float = 0.02
    family: str = "llama"          # config.json's model_type: a key of FAMILIES
    qk_norm: bool = False          # an RMSNorm on the query and key before RoPE: each head's (Qwen3) or ...
    qk_norm_whole: bool = False    # ... the whole projection's, every head at once (OLMo-2)
    norm_after: bool = False       # each sublayer's output normalised before its residual add (OLMo-2), not its input
    norm_weight_fp32: bool = False  # an RMSNorm multiplies by its weight in fp32, then casts (OLMo-2)
    # A fork's MoE (Mixtral's num_local_experts, num_experts_per_tok): n_experts MLPs of ffn_dim and a router
    # (dim x n_experts) per block, experts_per_token run per token (count_params' "active"). 0, 0: one dense MLP.
    n_experts: int = 0
    experts_per_token: int = 0
    # config.json's keys only its family has (FAMILIES' config_keys; the row's value for one not given): read by
    # hf.config_from_hf, written back in the export. This model computes with none; a fork's may (Mixtral's experts).
    family_keys: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        self.family_keys = {**FAMILIES[self.family]["config_keys"], **self.family_keys}


# True while the planner measures a block on fake tensors, which hold shapes, not values (tools/plan_memory.py): a
# block whose shapes depend on the data (an MoE's routing) takes a path with fixed shapes then (docs/forking.md).
FIXED_SHAPES = False

# The model families this code builds, keyed by config.json's model_type. Everything else is shared: the
# block (attention with grouped K/V and RoPE, SwiGLU MLP, the norms before or after each: norm_after), the tensor
# names (Hugging Face's; a QK-norm's are self_attn.q_norm.weight and self_attn.k_norm.weight), the ModelConfig
# fields config.json maps to (hf.config_from_hf). Per family: the transformers classes that build it (the
# oracle in tests/, the check of an export), what its ModelConfig sets, the RoPE forms its config.json may use,
# and the config.json keys only it has, each with its value where config.json says none (ModelConfig.family_keys:
# read, kept, written back). A config.json of another model_type is refused naming these (hf.check_hf_config).
FAMILIES = {
    "llama": dict(hf_class="LlamaForCausalLM", hf_config_class="LlamaConfig", model_fields=dict(qk_norm=False),
                  rope_types=("default", "llama3"), config_keys=dict(mlp_bias=False, pretraining_tp=1)),
    # Qwen3 (Yang et al. 2025, "Qwen3 Technical Report"; transformers' modeling_qwen3.py): QK-norm, head_dim
    # given explicitly (128, whatever dim / n_heads is), no q/k/v bias, no sliding window in the dense models
    # (max_window_layers: where sliding would start, were it on; Qwen3Config's 28 where config.json says none).
    "qwen3": dict(hf_class="Qwen3ForCausalLM", hf_config_class="Qwen3Config", model_fields=dict(qk_norm=True),
                  rope_types=("default",),
                  config_keys=dict(use_sliding_window=False, sliding_window=None, max_window_layers=28)),
    # OLMo 2 (OLMo et al. 2024, "2 OLMo 2 Furious"; transformers' modeling_olmo2.py): each sublayer's output
    # normalised (post_attention_layernorm, post_feedforward_layernorm), QK-norm over the whole projections, the
    # norms' weights applied in fp32.
    "olmo2": dict(hf_class="Olmo2ForCausalLM", hf_config_class="Olmo2Config",
                  model_fields=dict(qk_norm=True, qk_norm_whole=True, norm_after=True, norm_weight_fp32=True),
                  rope_types=("default",), config_keys=dict()),
}


def tiny() -> ModelConfig:
    """~3.4M parameters: trains on a laptop CPU in minutes. With prepared data (the built-in sample
    included) the vocabulary and BOS/EOS ids are the data tokenizer's (train.py, run_data.open_data)."""
    return ModelConfig(vocab_size=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768,
                       rope_theta=10000.0, max_seq_len=1024, bos_id=256, eos_id=257)


def llama3(rope_factor: float = 0.0, **shape) -> ModelConfig:
    """Llama 3's vocabulary, BOS/EOS ids and 8 K/V heads. 3.1 and 3.2 stretch RoPE from 8192 positions to
    131072 by `rope_factor` (llama3 frequency scaling); 3.0 has none."""
    scaling = dict(factor=rope_factor, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    return ModelConfig(vocab_size=128256, n_kv_heads=8, rope_scaling=scaling if rope_factor else None,
                       max_seq_len=131072 if rope_factor else 8192, bos_id=128000, eos_id=128001, **shape)


def qwen3(**shape) -> ModelConfig:
    """Qwen3's vocabulary, ids and head shape, as its dense models' config.json (Hugging Face Qwen/Qwen3-0.6B ...
    Qwen/Qwen3-32B, April 2025) give them: 8 K/V heads of 128, RMSNorm eps 1e-6, RoPE theta 1e6 over 40,960
    positions, max_window_layers its number of layers, <|endoftext|> as BOS and <|im_end|> as EOS (the
    post-trained models'; the -Base models end with <|endoftext|>, 151643: their config.json says so, and
    --init_from reads it)."""
    return ModelConfig(vocab_size=151936, n_kv_heads=8, head_dim=128, norm_eps=1e-6, rope_theta=1e6,
                       max_seq_len=40960, bos_id=151643, eos_id=151645, family="qwen3", qk_norm=True,
                       family_keys=dict(max_window_layers=shape["n_layers"]), **shape)


LLAMA3_8B = dict(dim=4096, n_layers=32, n_heads=32, ffn_dim=14336)
LLAMA3_70B = dict(dim=8192, n_layers=80, n_heads=64, ffn_dim=28672)
PRESETS = {
    "tiny": tiny,
    "llama3.2-1b": lambda: llama3(32.0, dim=2048, n_layers=16, n_heads=32, ffn_dim=8192, tie_embeddings=True),
    "llama3.2-3b": lambda: llama3(32.0, dim=3072, n_layers=28, n_heads=24, ffn_dim=8192, tie_embeddings=True),
    "llama3-8b": lambda: llama3(**LLAMA3_8B),
    "llama3.1-8b": lambda: llama3(8.0, **LLAMA3_8B),
    "llama3-70b": lambda: llama3(**LLAMA3_70B),
    "llama3.1-70b": lambda: llama3(8.0, **LLAMA3_70B),
    # Qwen3 dense (the Qwen3 report's Table 1: layers, heads, tied embeddings; config.json: the widths).
    "qwen3-0.6b": lambda: qwen3(dim=1024, n_layers=28, n_heads=16, ffn_dim=3072, tie_embeddings=True),
    "qwen3-1.7b": lambda: qwen3(dim=2048, n_layers=28, n_heads=16, ffn_dim=6144, tie_embeddings=True),
    "qwen3-4b": lambda: qwen3(dim=2560, n_layers=36, n_heads=32, ffn_dim=9728, tie_embeddings=True),
    "qwen3-8b": lambda: qwen3(dim=4096, n_layers=36, n_heads=32, ffn_dim=12288),
    "qwen3-14b": lambda: qwen3(dim=5120, n_layers=40, n_heads=40, ffn_dim=17408),
    "qwen3-32b": lambda: qwen3(dim=5120, n_layers=64, n_heads=64, ffn_dim=25600),
}


# ----------------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------------

def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama 3.1's scaling: long wavelengths are slowed by `factor`, short ones
    kept, and the band between interpolated smoothly."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if not cfg.rope_scaling:
        return inv_freq
    s = cfg.rope_scaling
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen = old_len / s["low_freq_factor"]
    high_freq_wavelen = old_len / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s["factor"], inv_freq)
    smooth = (old_len / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    smoothed = (1 - smooth) * scaled / s["factor"] + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def to_device(array, device) -> torch.Tensor:
    """A numpy array or CPU tensor as a tensor on `device`. To CUDA from pinned memory and asynchronously:
    a copy from ordinary (pageable) memory makes the host wait until the GPU has done all the work queued
    before it."""
    tensor = torch.as_tensor(array).contiguous()
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def rope_cos_sin(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sin (B, T, head_dim) in `dtype`, computed in fp32 from integer positions (B, T). Recomputed each
    forward: tiny next to a block, where a cached buffer would be one more tensor to shard or replicate. The
    inverse frequencies come from the CPU, as HF computes them, through to_device (no host wait)."""
    freqs = positions[..., None].float() * to_device(rope_inv_freq(cfg), positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """x: (B, T, H, D); cos, sin: (B, T, D)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weight_fp32: bool = False):
        super().__init__()
        self.eps, self.weight_fp32 = eps, weight_fp32
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Statistics in fp32 whatever the compute dtype, then back: this is what HF does (OLMo-2 casts back after
        # the weight, Llama and Qwen3 before it).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype) if self.weight_fp32 else self.weight * x32.to(x.dtype)


class DocumentLayout(NamedTuple):
    """Packed documents, as attention reads them: RoPE positions restarting at 0 in each document, and either
    the documents' boundaries in the flattened B*T tokens (flash_attn_varlen_func) or SDPA's document_mask."""
    positions: torch.Tensor              # (B, T) int64
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    mask: torch.Tensor | None = None


def document_layout(starts, device="cpu", dtype: torch.dtype = torch.bool) -> DocumentLayout:
    """The layout on `device` for `starts` ((B, T) bool, numpy or CPU: data.TokenData's document starts), in the form the kernel for the
    compute `dtype` reads (uses_flash). Computed on the host, which has the token ids: on the GPU, nonzero()
    and int() would make the host wait. Only the T x T mask is built on the device, from each token's
    document index: copying it would move B*T*T elements instead of B*T."""
    starts = np.asarray(starts, dtype=bool)
    B, T = starts.shape
    t = np.broadcast_to(np.arange(T), (B, T))
    positions = to_device(t - np.maximum.accumulate(np.where(starts, t, 0), axis=1), device)
    if uses_flash(device, dtype):
        cu_seqlens = np.append(np.flatnonzero(starts), B * T).astype(np.int32)
        return DocumentLayout(positions, cu_seqlens=to_device(cu_seqlens, device),
                              max_seqlen=int(np.diff(cu_seqlens).max()))
    doc = to_device(starts.cumsum(axis=1), device)
    return DocumentLayout(positions, mask=document_mask(doc, dtype))


def document_mask(doc: torch.Tensor, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """(B, 1, T, T) from each token's document index doc (B, T): query t sees key s in its document, s <= t.
    Bool (True: sees), or additive in a floating `dtype` (0 or -inf), as CUDA's memory-efficient SDPA kernel
    reads it: in the compute dtype, each row starting at a multiple of 8 elements (rows padded in memory, the
    padding sliced off). Otherwise SDPA converts and pads the mask again in every layer's forward and backward."""
    B, T = doc.shape
    allowed = (doc[:, :, None] == doc[:, None, :]) & torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
    if dtype == torch.bool:
        return allowed[:, None]
    padded_rows = torch.full((B, 1, T, -(-T // 8) * 8), float("-inf"), dtype=dtype, device=doc.device)
    return padded_rows[..., :T].masked_fill_(allowed[:, None], 0.0)


def make_batch(cfg: ModelConfig, inputs: np.ndarray, targets: np.ndarray, doc_starts: np.ndarray, doc_mask: bool,
               device, dtype: torch.dtype) -> dict:
    """One micro-batch's forward inputs besides the weights: tokens, RoPE's cos/sin at each token's position,
    the document layout (with doc_mask: a document starts where `doc_starts`, the data's own record, says; no token
    id is read as a boundary), targets. Built on the host and copied with to_device, so the host never waits for
    the GPU: it queues this micro-batch as the last runs."""
    layout = None
    if doc_mask:
        starts = np.asarray(doc_starts, dtype=bool)
        if starts[:, 1:].any():  # one document per row: plain causal attention is the same and faster
            layout = document_layout(starts, device, dtype)
    tokens = to_device(inputs, device)
    positions = layout.positions if layout else torch.arange(tokens.shape[1], device=device).expand_as(tokens)
    cos, sin = rope_cos_sin(cfg, positions, dtype)
    return dict(tokens=tokens, cos=cos, sin=sin, layout=layout, targets=to_device(targets, device))


HALF_DTYPES = (torch.bfloat16, torch.float16)


def uses_flash(device, dtype: torch.dtype) -> bool:
    """The kernel: FlashAttention-2 where it imports, on CUDA, in bf16/fp16 (it takes grouped K/V as they
    are, and each packed document as a sequence of its own); PyTorch's SDPA everywhere else, called as
    sdpa_arguments says. A batch's DocumentLayout is built for the same choice."""
    return flash_attn_func is not None and torch.device(device).type == "cuda" and dtype in HALF_DTYPES


def attention(q, k, v, layout: DocumentLayout | None = None):
    """Causal grouped-query attention. q: (B, T, H, D); k, v: (B, T, KV, D). Returns (B, T, H, D).
    With a `layout` (document_layout), no token attends to another document."""
    B, T, H, D = q.shape
    if uses_flash(q.device, q.dtype):
        # --deterministic (processes.use_deterministic_kernels) turns torch's switch on: flash-attn's own follows it
        # (its backward's dQ is otherwise summed with atomic adds; the forward is always deterministic).
        deterministic = torch.are_deterministic_algorithms_enabled()
        if layout is None:  # handles GQA itself, (B, T, H, D) layout
            return flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
        cu, n = layout.cu_seqlens, layout.max_seqlen  # each document is its own sequence
        out = flash_attn_varlen_func(q.reshape(B * T, H, D), k.reshape(B * T, -1, D), v.reshape(B * T, -1, D),
                                     cu, cu, n, n, causal=True, deterministic=deterministic)
        return out.view(B, T, H, D)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))   # SDPA wants (B, H, T, D)
    mask = None if layout is None else layout.mask
    return F.scaled_dot_product_attention(**sdpa_arguments(q, k, v, mask)).transpose(1, 2)


def sdpa_arguments(q, k, v, mask=None, causal: bool = True) -> dict:
    """F.scaled_dot_product_attention's arguments for q (B, H, T, D), k, v (B, KV, S, D) and a mask (None:
    causal, or none at all with causal=False), in a form a fused kernel takes. On CUDA (torch 2.11 to 2.13)
    SDPA's flash kernel takes grouped K/V but no mask, bf16/fp16 only; its memory-efficient kernel takes a
    mask and fp32 but not grouped K/V; the math kernel, which takes anything, holds the B x H x T x T scores
    (8 GiB per layer for Llama-3-8B at T = 8192 in fp32): an OOM. So there K/V are repeated to H heads for
    a mask or fp32, 2 x (H - KV) x T x D elements per layer (recomputed in backward under --ac selective).
    On CPU, SDPA takes a mask with grouped K/V as they are."""
    H = q.shape[1]
    if q.is_cuda and (mask is not None or q.dtype not in HALF_DTYPES):
        k, v = (x.repeat_interleave(H // x.shape[1], dim=1) for x in (k, v))  # what HF's repeat_kv does
    return dict(query=q, key=k, value=v, attn_mask=mask, is_causal=causal and mask is None,
                enable_gqa=k.shape[1] != H)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # QK-norm before RoPE keeps attention logits bounded: Qwen3 normalises each head (one weight of head_dim
        # shared by the heads), OLMo-2 the whole projection at once. Identity (no parameters) for Llama.
        self.q_groups, self.k_groups = (1, 1) if cfg.qk_norm_whole else (cfg.n_heads, cfg.n_kv_heads)
        q_size, k_size = (cfg.n_heads * cfg.head_dim // self.q_groups, cfg.n_kv_heads * cfg.head_dim // self.k_groups)
        self.q_norm = RMSNorm(q_size, cfg.norm_eps, cfg.norm_weight_fp32) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(k_size, cfg.norm_eps, cfg.norm_weight_fp32) if cfg.qk_norm else nn.Identity()

    def forward(self, x, cos, sin, layout=None, cache=None):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.q_groups, -1)).view(B, T, self.n_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(B, T, self.k_groups, -1)).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # sampling (KVCache, below): these T tokens also see every earlier one
            return self.o_proj(cache.attention(q, k, v).reshape(B, T, -1))
        return self.o_proj(attention(q, k, v, layout).reshape(B, T, -1))


class KVCache:
    """One block's keys and values for one sequence while sampling: the prompt's, then one more token's per
    step. Allocated for the whole sequence at once, so a step copies one token's K/V in, not the whole
    cache; it exists only while sample.generate runs. Attention (above) hands it its q, k, v (the `cache` argument
    training never passes); components/sample.py makes one per block and prompt."""

    def __init__(self, max_tokens: int, cfg: ModelConfig, dtype: torch.dtype, device):
        self.k = torch.empty(1, max_tokens, cfg.n_kv_heads, cfg.head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0  # tokens held

    def attention(self, q, k, v):
        """Appends the T new tokens' k, v (1, T, KV, D), and returns their queries' (q: (1, T, H, D)) causal
        attention over all S tokens held. Query t is at position S - T + t and sees keys 0 .. S - T + t. One
        new token (T = 1) sees every key: no mask at all, which is_causal would get wrong (SDPA aligns its
        causal mask to the top left when T < S)."""
        end = self.length + k.shape[1]
        self.k[:, self.length:end], self.v[:, self.length:end] = k, v
        self.length = end
        T, S = q.shape[1], end
        mask = None if T == 1 else torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        q, k, v = (t.transpose(1, 2) for t in (q, self.k[:, :end], self.v[:, :end]))
        return F.scaled_dot_product_attention(**sdpa_arguments(q, k, v, mask, causal=False)).transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm_after = cfg.norm_after
        if not cfg.norm_after:  # Llama, Qwen3: each sublayer's input normalised (HF's names and order)
            self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_weight_fp32)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_weight_fp32)
        self.mlp = MLP(cfg)
        if cfg.norm_after:  # OLMo-2: each sublayer's output, before the residual add
            self.post_feedforward_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_weight_fp32)

    def forward(self, x, cos, sin, layout=None, cache=None):
        if self.norm_after:
            h = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, layout, cache))
            return h + self.post_feedforward_layernorm(self.mlp(h))
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, layout, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # padding_idx as transformers' model has it: a lookup of the pad id adds nothing to that row's gradient.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim, padding_idx=cfg.pad_id)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_weight_fp32)
        # Tied (Llama 3.2 1B/3B): the head reuses embed_tokens.weight and has no weight of its own.
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    # The three pieces of the forward. train.py calls them one at a time, gathering each piece's
    # parameters just before and freeing them just after.
    def embed(self, tokens):
        return self.embed_tokens(tokens)

    def head_weight(self):
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, h):
        return F.linear(self.norm(h), self.head_weight())

    def head_loss(self, h, targets, chunk: int = 0) -> dict:
        """The loss terms by name, each summed over targets != -100 in fp32: cross-entropy ("ce"; HF upcasts
        logits before the loss), and whatever a fork adds in _loss_terms (a z-loss, an auxiliary loss). The
        trainer backpropagates their sum and logs each (train.forward_backward). Summed, not averaged: the
        trainer divides by the token count of the whole global batch.
        With `chunk`, `chunk` tokens at a time, each chunk checkpointed: its fp32 logits (chunk x vocab)
        are dropped after its forward and recomputed in backward, so the whole (tokens x vocab) fp32
        logits -- 4 GiB for 8192 tokens of Llama 3's 128K vocabulary -- never exist at once."""
        h, targets = self.norm(h).flatten(0, -2), targets.reshape(-1)
        if not chunk or chunk >= len(targets):
            return self._loss_terms(h, targets)
        chunks = [torch.utils.checkpoint.checkpoint(self._loss_terms, h[i:i + chunk], targets[i:i + chunk],
                                                    use_reentrant=False) for i in range(0, len(targets), chunk)]
        return {name: sum(terms[name] for terms in chunks) for name in chunks[0]}

    def _loss_terms(self, h_normed, targets) -> dict:
        logits = F.linear(h_normed, self.head_weight()).float()
        terms = {"ce": F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")}
        return terms  # a fork's term is one line above: docs/forking.md, "A loss"

    def forward(self, tokens, doc_starts=None):
        """Logits for (B, T) tokens, all in one process: the unsharded reference path. With `doc_starts`
        (B, T) bool, packed documents do not see each other (see document_layout)."""
        dtype = self.embed_tokens.weight.dtype
        layout = None if doc_starts is None else document_layout(doc_starts.cpu().numpy(), tokens.device, dtype)
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens) if layout is None else layout.positions
        h = self.embed(tokens)
        cos, sin = rope_cos_sin(self.cfg, positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, layout)
        return self.logits(h)


def count_params(cfg: ModelConfig) -> dict:
    """Parameter counts from the shapes alone (no model needed): total, embedding, and active: those a token runs
    through, each routed block's experts_per_token experts of n_experts (n_experts 0: all of them)."""
    d, hd = cfg.dim, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2
    qk_norm = ((cfg.n_heads + cfg.n_kv_heads) * hd if cfg.qk_norm_whole else 2 * hd) if cfg.qk_norm else 0
    expert, router = 3 * d * cfg.ffn_dim, d * cfg.n_experts
    block = attn + expert * max(1, cfg.n_experts) + router + 2 * d + qk_norm
    embedding = cfg.vocab_size * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    total = embedding + cfg.n_layers * block + d + head
    idle = cfg.n_layers * expert * (cfg.n_experts - cfg.experts_per_token)
    return {"total": total, "embedding": embedding, "active": total - idle}



def flops_per_token(mcfg: ModelConfig, seq_len: int) -> float:
    """6 * (N - embedding) + 12 * L * d * T, N the active parameters (count_params): weights' matmuls forward and
    backward, plus attention's QK^T and AV over the whole window of T tokens, causal mask not discounted (the PaLM /
    torchtitan convention). With --doc_mask attention runs within each packed document, fewer FLOPs than this count:
    MFU still counts the window (the startup line says so), so it overstates the attention work done by up to
    T / (mean document length) on that part. MFU's numerator (components/metrics.py) and the planner's compute
    (tools/plan.py)."""
    counts = count_params(mcfg)
    return 6 * (counts["active"] - counts["embedding"]) + 12 * mcfg.n_layers * mcfg.n_heads * mcfg.head_dim * seq_len


def check_model_config(cfg: ModelConfig) -> list[str]:
    """Shape problems as messages (empty when fine): heads must divide the width, KV heads the heads."""
    errors = []
    if min(cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim) < 1:
        errors.append("model: vocab_size, dim, n_layers, n_heads, n_kv_heads and ffn_dim must all be >= 1")
    elif cfg.n_heads % cfg.n_kv_heads:
        errors.append(f"model: n_kv_heads={cfg.n_kv_heads} must divide n_heads={cfg.n_heads}")
    elif cfg.dim % cfg.n_heads:
        errors.append(f"model: n_heads={cfg.n_heads} must divide dim={cfg.dim}")
    if cfg.head_dim % 2:
        errors.append(f"model: head_dim={cfg.head_dim} must be even for RoPE")
    if cfg.pad_id is not None and not 0 <= cfg.pad_id < cfg.vocab_size:
        errors.append(f"model: pad_token_id {cfg.pad_id} is not a token id (vocab_size {cfg.vocab_size})")
    return errors


# ----------------------------------------------------------------------------------------------
# What train.py's training and the planner (tools/plan.py) both read: which blocks are recomputed how,
# and which optimizer state each parameter keeps. They live here, below both, because the planner must not
# import train.py (README "Files": the layers): one truth for the two.
# ----------------------------------------------------------------------------------------------

def block_policies(n_layers: int, ac: str, ac_blocks: int = -1, ac_rest: str = "none") -> list[str]:
    """Each block's checkpointing policy: --ac for the first --ac_blocks blocks (all with -1), --ac_rest
    for the others. Memory freed elsewhere (--offload_optimizer) becomes less recompute this way."""
    n = n_layers if ac_blocks < 0 else min(ac_blocks, n_layers)
    return [ac] * n + [ac_rest] * (n_layers - n)


def hf_name(name: str) -> str:
    """A parameter's Hugging Face name (the exported folder's, and what --freeze and --lr_mult match, flags.py): ours
    under `model.`, the untied head's `lm_head.weight` as it is."""
    return name if name.startswith("lm_head.") else "model." + name


def sharding_units(model: nn.Module) -> list[tuple[str, list[str]]]:
    """(unit name, its parameters' names) in the order they run: embed, layers.0 .. layers.{L-1}, head (the final
    norm and the untied lm_head). train.build_units shards these; the planner and --freeze's check read them. A
    fork may shard a block as several units, `layers.{i}.NAME` (block_of; train.make_stages gathers them together)."""
    names = [n for n, _ in model.named_parameters()]
    units = [("embed", ["embed_tokens.weight"])]
    units += [(f"layers.{i}", [n for n in names if n.startswith(f"layers.{i}.")]) for i in range(len(model.layers))]
    return units + [("head", [n for n in names if n.startswith(("norm.", "lm_head."))])]


def numels_by_unit(model: nn.Module) -> dict[str, int]:
    """{unit: its parameters} of sharding_units (a fork's units too), read from `model` (the meta device's will do)."""
    params = dict(model.named_parameters())
    return {name: sum(params[n].numel() for n in names) for name, names in sharding_units(model)}


def block_of(unit: str) -> int | None:
    """The block a unit belongs to: 3 for `layers.3` and for a fork's `layers.3.lora`; None for embed and head."""
    return int(unit.split(".")[1]) if unit.startswith("layers.") else None


# The fp32 tensors the optimizer keeps per element of each unit's shard, beside the master weights and the
# gradient: train.Unit makes them, train.optimizer_step updates them, checkpoints save them. Names, not code,
# so they can sit this low; the planner (tools/plan.py, which imports train.py) measures their bytes by running
# train.Unit and train.optimizer_step. A fork that swaps the optimizer changes this line and
# train.optimizer_step.
OPTIMIZER_STATE = ("exp_avg", "exp_avg_sq")


# ----------------------------------------------------------------------------------------------
# A fork's parameters: how one starts when the starting weights lack it (a run from scratch; a unit new to an
# --init_from checkpoint or Hugging Face folder; hf.init_unit_random calls it on every rank alike), and what the
# export writes for it (tools/export_hf.py): docs/forking.md.
# ----------------------------------------------------------------------------------------------

def init_parameter(name: str, full: torch.Tensor, std: float, generator: torch.Generator, weight_of) -> None:
    """Fills `full`, parameter `name`'s whole fp32 tensor: ones for a 1-D norm weight, else normal(0, std) from the
    unit's own `generator` (Hugging Face's rule; the same at any W). `weight_of(other)` is another parameter's whole
    fp32 tensor, all-gathered from its unit: one taken from the starting weights or earlier in the list. A LoRA fork
    adds `if name.endswith("lora_b"): return full.zero_()`, a DoRA fork its magnitude's
    `full.copy_(weight_of(name.removesuffix("magnitude") + "weight").norm(dim=1))`."""
    full.fill_(1.0) if full.dim() == 1 else full.normal_(0.0, std, generator=generator)


def hf_tensors(name: str, tensor: torch.Tensor, weight_of) -> dict:
    """What the export writes for parameter `name`, and what its check (hf.check_export_tensors) holds against the
    family's class: {Hugging Face name: tensor}. `weight_of(other)`: another parameter's whole tensor. A fork whose
    adapter merges into the weight it adapts returns {} for the adapter's parameters and the merged weight for the
    base's (DoRA: m * (W + B A) / ||W + B A||, row by row); a tensor the family lacks is refused by the check."""
    return {hf_name(name): tensor}
