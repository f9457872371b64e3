"""Llama-family decoder over one flat batch of tokens from many sequences (no padding).

Matches Hugging Face's LlamaForCausalLM numerically (same op order in RMSNorm, RoPE, SwiGLU),
with Q/K/V and gate/up projections fused into one matmul each, and logits computed only for the
rows that are sampled.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from metroserve.worker.attention import AttentionBackend
from metroserve.worker.kv_cache import KVCache


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: list[int]

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        raw = json.loads((Path(path) / "config.json").read_text())
        archs = raw.get("architectures") or ["LlamaForCausalLM"]
        if raw.get("model_type", "llama") != "llama" and "LlamaForCausalLM" not in archs:
            raise ValueError(f"{path}: only Llama-family models are supported, "
                             f"got model_type={raw.get('model_type')!r}")
        # transformers 5 writes rope_parameters; 4.x wrote rope_theta + rope_scaling.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        eos = raw.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        heads = raw["num_attention_heads"]
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope or None,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies with the config's scaling (default, linear, llama3), as transformers computes them."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind is None:
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = None  # the compiled CPU kernels, when the model runs on them (use_cpu_kernels)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of x; with a residual, first residual += x (in place) and the norm is of that sum."""
        if self.kernels is not None:
            if residual is None:
                return self.kernels.rms_norm(x, self.weight, self.eps)
            return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = residual.add_(x)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [T, heads, D] in HF Llama's half-split layout; cos, sin: [T, 1, D/2].

    x1 * cos - x2 * sin | x2 * cos + x1 * sin is exactly HF's x * cos + rotate_half(x) * sin
    (cos and sin repeat across the halves there), written into one output without the concat.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(x1, cos, out=out[..., :half])
    out[..., :half] -= x2 * sin
    torch.mul(x2, cos, out=out[..., half:])
    out[..., half:] += x1 * sin
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T, through the weight's pre-packed oneDNN copy when it has one (pack_cpu_weights)."""
    if packed is None:
        return F.linear(x, weight)
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


# Up to this many rows (decode steps), a projection runs through the compiled kernel's panels: on a
# 2-core Zen 4 with SmolLM2's shapes they were as fast as oneDNN or faster up to 128 rows (7-34% at
# 45), and oneDNN's blocked GEMM was up to 10% faster at 512.
PANEL_MAX_ROWS = 256


class Linear(nn.Linear):
    """A bias-free projection that multiplies through its pre-packed weights when it has them: the
    compiled kernel's panels for small batches (use_cpu_kernels), oneDNN's packing (pack_cpu_weights)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.packed: torch.Tensor | None = None
        self.panels: torch.Tensor | None = None
        self.kernels = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.shape[0] <= PANEL_MAX_ROWS:
            return self.kernels.packed_linear(x, self.panels, self.out_features)
        return linear(x, self.weight, self.packed)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.kernels = None  # the compiled CPU kernels, when the model runs on them (use_cpu_kernels)

    def forward(self, layer: int, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend, kv_cache: KVCache, metadata: object) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (or the embeddings, with residual None). Each residual add
        is fused into the norm after it; returns (this layer's MLP output, residual stream so far)."""
        t = x.shape[0]
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        qkv = self.qkv_proj(h)
        # Q and K are adjacent in the fused output: one RoPE pass rotates both.
        rotated = self.num_heads + self.num_kv_heads
        if self.kernels is not None:
            self.kernels.rotary_embedding(qkv, rotated, self.head_dim, cos, sin)
            qk = qkv[:, : self.q_size + self.kv_size].view(t, rotated, self.head_dim)
        else:
            qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(t, rotated, self.head_dim),
                            cos[:, None, :], sin[:, None, :])
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        h = self.post_attention_layernorm(self.o_proj(attn.forward(layer, q, k, v, kv_cache, metadata)), residual)
        gate_up = self.gate_up_proj(h)
        if self.kernels is not None:
            return self.down_proj(self.kernels.silu_and_mul(gate_up)), residual
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up)), residual


class LlamaForCausalLM(nn.Module):
    inv_freq: torch.Tensor  # a buffer (register_buffer): computed from the config, not loaded

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.lm_head_packed: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, kv_cache: KVCache,
                metadata: object) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch; K/V of every token land in the pool."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        x = self.embed_tokens(input_ids)
        cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)  # [T, head_dim / 2]
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(i, x, residual, cos, sin, attn, kv_cache, metadata)
        assert residual is not None, "a model has at least one layer"
        return residual.add_(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(self.norm(hidden), self.lm_head_weight(), self.lm_head_packed).float()

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_cpu_weights(self) -> None:
        """On CPU in float32, keep oneDNN pre-packed copies of every projection and the vocabulary head.

        torch's default CPU matmul (MKL sgemm) re-packs the weight on every call, which at decode
        batch sizes (a few to a few dozen rows) costs about as much as the product itself. On a
        2-core Zen 4, 64 rows: qkv 99 -> 145 GFLOPS, down 79 -> 105, gate/up 102 -> 186, the
        49152-row head 81 -> 182; even 2048-row prefill chunks gain (gate/up 147 -> 213). Costs
        one more copy of the weights; call again after changing them."""
        weight = self.embed_tokens.weight
        if (weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available()
                or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
            return
        pack = torch.ops.mkldnn._reorder_linear_weight  # packed in the layout oneDNN picks for 64-row inputs
        for module in self.layers.modules():
            if isinstance(module, Linear):
                module.packed = pack(module.weight.detach(), 64)
        self.lm_head_packed = pack(self.lm_head_weight().detach(), 64)

    def use_cpu_kernels(self, kernels) -> None:
        """Run RMSNorm (with the residual add before it), RoPE and SiLU-and-multiply through the compiled
        CPU kernels (worker/cpu_kernels.py): one pass each instead of 3-6 torch ops; and projections of
        up to PANEL_MAX_ROWS rows through the kernels' panel GEMM, which keeps one more packed copy of
        the layers' weights (csrc/packed_linear.cpp). CPU float32 only; call again after changing weights."""
        weight = self.embed_tokens.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError(f"the CPU kernels run float32 on CPU, not {weight.dtype} on {weight.device}")
        for module in self.modules():
            if isinstance(module, (RMSNorm, DecoderLayer, Linear)):
                module.kernels = kernels
            if isinstance(module, Linear):
                module.panels = kernels.pack_linear_weight(module.weight.detach())

    # Checkpoint projections that land in a fused parameter: name -> (fused name, shard index).
    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_hf_tensor(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]) -> str | None:
        """Copy one HF-named checkpoint tensor into its place.

        Returns the name of what it filled ("layers.3.qkv_proj.weight[1]" for a fused shard), or
        None for a tensor this model has no place for (e.g. lm_head of a tied model).
        """
        parts = name.removeprefix("model.").split(".")
        if parts[0] == "layers" and len(parts) == 5:
            # layers.N.{self_attn,mlp}.X.weight: our layers have no submodule level.
            layer = self.layers[int(parts[1])]
            assert isinstance(layer, DecoderLayer)
            if parts[3] in self._FUSED:
                fused, shard = self._FUSED[parts[3]]
                sizes = ([layer.q_size, layer.kv_size, layer.kv_size] if fused == "qkv_proj"
                         else [self.cfg.intermediate_size] * 2)
                offset = sum(sizes[:shard])
                getattr(layer, fused).weight.data[offset : offset + sizes[shard]].copy_(tensor)
                return f"layers.{parts[1]}.{fused}.weight[{shard}]"
            parts = parts[:2] + parts[3:]
        target = ".".join(parts)
        if target not in params:
            return None
        params[target].data.copy_(tensor)
        return target

    def expected_loads(self) -> set[str]:
        """Every name load_hf_tensor must have filled for the model to be complete."""
        names: set[str] = set()
        for name, _ in self.named_parameters():
            if name.endswith("qkv_proj.weight"):
                names.update(f"{name}[{i}]" for i in range(3))
            elif name.endswith("gate_up_proj.weight"):
                names.update(f"{name}[{i}]" for i in range(2))
            else:
                names.add(name)
        return names
