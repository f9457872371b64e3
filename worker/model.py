"""One decoder for the families metroserve serves, over one flat batch of tokens (no padding).

Llama, Mistral, Qwen2/2.5, Qwen3, Phi-3 and Gemma 2/3 are the same pre-norm decoder with a few
switches (`Family`): biases on the attention projections, RMSNorm of each query and key head, a
weight offset in RMSNorm, the MLP's activation, a scaled embedding, norms on both sides of each
sublayer, sliding-window layers, a query scale and tanh soft-capping of attention and final logits.
Each switch matches Hugging Face's modeling code for that family numerically (same op order).
Q/K/V and gate/up projections are fused into one matmul each, and logits are computed only for the
rows that are sampled.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from metroserve.worker import onednn
from metroserve.worker.attention import AttentionBackend, BatchLayout
from metroserve.worker.fused_decode import FusedDecode
from metroserve.worker.kv_cache import KVCache
from metroserve.worker.quantization import QuantizedWeight

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class Family:
    """What a model family changes in the shared decoder (defaults: Llama)."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + weight): Gemma stores weight - 1
    activation: str = "silu"  # of the gate: silu, or gelu_pytorch_tanh (Gemma)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    sandwich_norms: bool = False  # norms after attention and MLP too (Gemma 2/3)


# model_type -> its family; config fields (attention_bias, mlp_bias) may add biases on top.
FAMILIES = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(qk_norm=True),
    "phi3": Family(),
    "gemma2": Family(norm_offset=1.0, activation="gelu_pytorch_tanh", embed_scale=True, sandwich_norms=True),
    "gemma3_text": Family(qk_norm=True, norm_offset=1.0, activation="gelu_pytorch_tanh", embed_scale=True,
                          sandwich_norms=True),
}


@dataclass
class Rope:
    theta: float
    scaling: dict | None = None  # linear or llama3 scaling parameters; None: plain RoPE


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: Rope  # of full-attention layers
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    family: Family = field(default_factory=Family)
    mlp_bias: bool = False
    layer_types: list[str] = field(default_factory=list)  # per layer: FULL or SLIDING
    sliding_window: int | None = None  # tokens a SLIDING layer's query sees, itself included
    local_rope: Rope | None = None  # of sliding layers when it differs (Gemma 3)
    rotary_dim: int = 0  # leading dims of each head that RoPE rotates (Phi-3's partial rotary)
    query_scale: float | None = None  # attention scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type", "llama")
        if model_type == "gemma3":  # a multimodal checkpoint: serve its text model
            raise ValueError("model_type 'gemma3' is Gemma 3's vision-language model; serve a text-only "
                             "checkpoint (model_type gemma3_text)")
        if model_type not in FAMILIES:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
        family = FAMILIES[model_type]
        if raw.get("attention_bias"):  # Llama, Qwen3, Gemma: every attention projection
            family = Family(**{**family.__dict__, "qkv_bias": True, "o_bias": True})
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        full_rope, local_rope, partial = _ropes(raw)
        num_layers = raw["num_hidden_layers"]
        window = raw.get("sliding_window")
        layer_types = _layer_types(raw, model_type, num_layers, window)
        eos = raw.get("eos_token_id")
        query_scalar = raw.get("query_pre_attn_scalar")
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope=full_rope,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", model_type.startswith("gemma")),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            family=family,
            mlp_bias=bool(raw.get("mlp_bias")),
            layer_types=layer_types,
            sliding_window=window if SLIDING in layer_types else None,
            local_rope=local_rope,
            rotary_dim=int(head_dim * partial),
            query_scale=query_scalar ** -0.5 if query_scalar else None,
            attn_softcap=raw.get("attn_logit_softcapping"),
            final_softcap=raw.get("final_logit_softcapping"),
        )


def _rope(params: dict, default_theta: float) -> Rope:
    """A Rope from rope_parameters (transformers 5) or rope_scaling (4.x) entries."""
    params = dict(params)
    theta = float(params.pop("rope_theta", default_theta))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")
    return Rope(theta, None if kind == "default" else params)


def _ropes(raw: dict[str, Any]) -> tuple[Rope, Rope | None, float]:
    """(full layers' RoPE, sliding layers' RoPE when it differs, partial rotary factor)."""
    theta = float(raw.get("rope_theta", 10000.0))
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if FULL in params:  # Gemma 3, transformers 5: one entry per layer type
        return _rope(params[FULL], theta), _rope(params[SLIDING], theta), partial
    rest = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
    local = raw.get("rope_local_base_freq")  # Gemma 3, transformers 4.x
    return _rope(rest, theta), Rope(float(local)) if local else None, partial


def _layer_types(raw: dict[str, Any], model_type: str, num_layers: int, window: int | None) -> list[str]:
    """Per layer: FULL or SLIDING, as transformers decides it for the family."""
    if not window:
        return [FULL] * num_layers
    if raw.get("layer_types"):
        return list(raw["layer_types"])
    if model_type in ("mistral", "phi3"):
        return [SLIDING] * num_layers
    if model_type in ("qwen2", "qwen3"):
        first = raw.get("max_window_layers", num_layers) if raw.get("use_sliding_window") else num_layers
        return [SLIDING if i >= first else FULL for i in range(num_layers)]
    if model_type == "gemma2":
        return [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
    if model_type == "gemma3_text":
        pattern = raw.get("sliding_window_pattern", 6)
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    return [FULL] * num_layers


def rope_inv_freq(rope: Rope, dim: int) -> torch.Tensor:
    """Inverse frequencies of a `dim`-wide rotation with the rope's scaling, as transformers computes them."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = rope.scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind is None:
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    assert kind == "llama3", kind  # _rope admits no other
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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset  # the norm multiplies by offset + weight (Gemma: 1)
        self.kernels = None  # the compiled CPU kernels, when the model runs on them (use_cpu_kernels)
        self.kernel_weight: torch.Tensor | None = None  # offset + weight, for the kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of x; with a residual, first residual += x (in place) and the norm is of that sum."""
        if self.kernels is not None:
            if residual is None:
                return self.kernels.rms_norm(x, self.kernel_weight, self.eps)
            return self.kernels.add_rms_norm(x, residual, self.kernel_weight, self.eps)
        if residual is not None:
            x = residual.add_(x)
        weight = self.weight.float() + self.offset if self.offset else self.weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), weight, self.eps).to(x.dtype)


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


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), through the weight's pre-packed oneDNN copy when it has one (pack_cpu_weights).
    A bfloat16 weight under float32 activations (matmul_dtype) multiplies x rounded to bfloat16 and
    returns float32."""
    kept = weight if packed is None else packed
    if kept.dtype != x.dtype:
        out = linear(x.to(kept.dtype), weight, packed).float()
        return out if bias is None else out.add_(bias)
    if packed is None:
        return F.linear(x, weight, bias)
    return onednn.linear(x, packed, bias)


# Up to this many rows (decode steps), a projection runs through the compiled kernel's panels: on a
# 2-core Zen 4 with SmolLM2's shapes they were as fast as oneDNN or faster up to 128 rows (7-34% at
# 45), and oneDNN's blocked GEMM was up to 10% faster at 512.
PANEL_MAX_ROWS = 256


class Linear(nn.Linear):
    """A projection that multiplies through its pre-packed weights when it has them: quantized
    blocks (worker/quantization.py; the float weight is then gone), the compiled kernel's panels
    for small batches (use_cpu_kernels), oneDNN's packing (pack_cpu_weights)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.packed: torch.Tensor | None = None
        self.panels: torch.Tensor | None = None
        self.kernels = None
        self.quantized: QuantizedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            out = self.quantized(x)
            return out if self.bias is None else out.add_(self.bias)
        if self.kernels is not None and x.shape[0] <= PANEL_MAX_ROWS:
            out = self.kernels.packed_linear(x, self.panels, self.out_features)
            return out if self.bias is None else out.add_(self.bias)
        return linear(x, self.weight, self.packed, self.bias)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str):
        super().__init__()
        fam = cfg.family
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.sliding_window: int | None = cfg.sliding_window if layer_type == SLIDING else None
        self.rope_key: str = SLIDING if layer_type == SLIDING and cfg.local_rope is not None else FULL
        # Only what differs from the backends' defaults, so every backend takes the plain call.
        self.attention_options: dict[str, float] = {}
        if cfg.query_scale is not None:
            self.attention_options["scale"] = cfg.query_scale
        if cfg.attn_softcap:
            self.attention_options["softcap"] = cfg.attn_softcap
        self.activation = fam.activation

        def norm(dim: int) -> RMSNorm:
            return RMSNorm(dim, cfg.rms_norm_eps, fam.norm_offset)

        self.input_layernorm = norm(cfg.hidden_size)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, fam.qkv_bias)
        self.q_norm = norm(cfg.head_dim) if fam.qk_norm else None
        self.k_norm = norm(cfg.head_dim) if fam.qk_norm else None
        self.o_proj = Linear(self.q_size, cfg.hidden_size, fam.o_bias)
        self.post_attention_layernorm = norm(cfg.hidden_size)
        self.pre_feedforward_layernorm = norm(cfg.hidden_size) if fam.sandwich_norms else None
        self.post_feedforward_layernorm = norm(cfg.hidden_size) if fam.sandwich_norms else None
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)
        self.kernels = None  # the compiled CPU kernels, when the model runs on them (use_cpu_kernels)

    def forward(self, layer: int, x: torch.Tensor, residual: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionBackend, kv_cache: KVCache,
                metadata: object) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (or the embeddings, with residual None). Each residual add
        is fused into the norm after it; returns (this layer's MLP output, residual stream so far)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        q, k, v = self._qkv(self.qkv_proj(h), *rope)
        o = self.o_proj(attn.forward(layer, q, k, v, kv_cache, metadata, **self.attention_options))
        if self.pre_feedforward_layernorm is not None:  # Gemma: norm the attention output, then add and norm
            h = self.pre_feedforward_layernorm(self.post_attention_layernorm(o), residual)
        else:
            h = self.post_attention_layernorm(o, residual)
        out = self.down_proj(self._act(self.gate_up_proj(h)))
        if self.post_feedforward_layernorm is not None:
            out = self.post_feedforward_layernorm(out)
        return out, residual

    def _qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split the fused projection into q [T, H, D], k and v [T, Hkv, D]; q and k per-head normed
        (when the family does) and rotated."""
        t = qkv.shape[0]
        qk_size = self.q_size + self.kv_size
        if self.q_norm is not None and self.k_norm is not None:
            qkv[:, : self.q_size] = self.q_norm(qkv[:, : self.q_size].reshape(-1, self.head_dim)).view(t, -1)
            qkv[:, self.q_size : qk_size] = self.k_norm(
                qkv[:, self.q_size : qk_size].reshape(-1, self.head_dim)).view(t, -1)
        # Q and K are adjacent in the fused output: one RoPE pass rotates both.
        rotated = self.num_heads + self.num_kv_heads
        qk = qkv[:, :qk_size].view(t, rotated, self.head_dim)
        if self.kernels is not None and self.rotary_dim == self.head_dim:
            self.kernels.rotary_embedding(qkv, rotated, self.head_dim, cos, sin)
        elif self.rotary_dim == self.head_dim:
            qk = apply_rope(qk, cos[:, None, :], sin[:, None, :])
        else:  # partial rotary: the leading rotary_dim of each head turn, the rest pass through
            qk = qk.clone()
            qk[..., : self.rotary_dim] = apply_rope(qk[..., : self.rotary_dim], cos[:, None, :], sin[:, None, :])
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu" and self.kernels is not None:
            return self.kernels.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.activation == "silu":
            return F.silu(gate, inplace=True).mul_(up)
        return F.gelu(gate, approximate="tanh").mul_(up)


# A step's attention metadata per sliding window (None: full attention), from prepare_attention.
AttentionMetadata = dict[int | None, object]


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers = [DecoderLayer(cfg, cfg.layer_types[i] if cfg.layer_types else FULL) for i in range(cfg.num_layers)]
        self.layers = nn.ModuleList(layers)
        # Per layer: (its RoPE, its window) - the step's cos/sin and attention metadata it takes.
        self.layer_inputs: list[tuple[str, int | None]] = [(layer.rope_key, layer.sliding_window) for layer in layers]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.family.norm_offset)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head_packed: torch.Tensor | None = None
        self.lm_head_quantized: QuantizedWeight | None = None
        self.windows: list[int | None] = sorted({w for _, w in self.layer_inputs}, key=lambda w: w or 0)
        self.inv_freq: dict[str, torch.Tensor] = {}  # per rope key; computed, not loaded (init_rope)
        self.fused_decode: FusedDecode | None = None  # the layers in one C++ call for decode steps (use_cpu_kernels)

    def init_rope(self, device: torch.device) -> None:
        dim = self.cfg.rotary_dim
        self.inv_freq = {FULL: rope_inv_freq(self.cfg.rope, dim).to(device)}
        if self.cfg.local_rope is not None:
            self.inv_freq[SLIDING] = rope_inv_freq(self.cfg.local_rope, dim).to(device)

    def prepare_attention(self, attn: AttentionBackend, layout: BatchLayout) -> AttentionMetadata:
        """The backend's metadata for this step, once per sliding window the layers use."""
        return {w: attn.prepare(layout, sliding_window=w) for w in self.windows}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch; K/V of every token land in the pool."""
        x = self.embed_tokens(input_ids)
        if self.cfg.family.embed_scale:  # HF rounds the factor to the activations' dtype first
            x = x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=x.dtype)
        ropes = {}
        for key, inv_freq in self.inv_freq.items():
            freqs = positions.float()[:, None] * inv_freq[None, :]
            ropes[key] = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)  # [T, rotary_dim / 2]
        if (self.fused_decode is not None and x.shape[0] <= PANEL_MAX_ROWS
                and all(getattr(m, "decode_only", False) for m in metadata.values())):
            out, stream = self.fused_decode.forward(x, *ropes[FULL], kv_cache, next(iter(metadata.values())))
            return stream.add_(out)
        residual = None
        for i, (layer, (rope, window)) in enumerate(zip(self.layers, self.layer_inputs)):
            x, residual = layer(i, x, residual, ropes[rope], attn, kv_cache, metadata[window])
        assert residual is not None, "a model has at least one layer"
        return residual.add_(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_quantized is not None:
            logits = self.lm_head_quantized(self.norm(hidden))
        else:
            logits = linear(self.norm(hidden), self.lm_head_weight(), self.lm_head_packed).float()
        return softcap(logits, self.cfg.final_softcap) if self.cfg.final_softcap else logits

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_cpu_weights(self, matmul_dtype: torch.dtype | None = None) -> None:
        """On CPU in float32 or bfloat16, keep oneDNN pre-packed copies of every projection and the
        vocabulary head; with matmul_dtype bfloat16 under float32 weights, bfloat16 copies instead,
        and the float32 weights are released (the embedding table stays: lookups need it).

        torch's default CPU matmul (MKL sgemm) re-packs the weight on every call, which at decode
        batch sizes (a few to a few dozen rows) costs about as much as the product itself. On a
        2-core Zen 4, 64 rows: qkv 99 -> 145 GFLOPS, down 79 -> 105, gate/up 102 -> 186, the
        49152-row head 81 -> 182; even 2048-row prefill chunks gain (gate/up 147 -> 213). In
        bfloat16 oneDNN multiplies with AMX tiles or AVX512-BF16 dot products where the CPU has them
        (float32 accumulation); its packed layout is what those kernels read. Costs one more copy
        of the weights (none with matmul_dtype); call again after changing them."""
        weight = self.embed_tokens.weight
        cast = matmul_dtype or weight.dtype
        if (weight.device.type != "cpu" or cast not in (torch.float32, torch.bfloat16)
                or not onednn.available()
                or (cast == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported())):
            if cast != weight.dtype:  # no oneDNN bfloat16 here (AVX2 CPUs): plain bfloat16 matmuls, slower
                for module in (*self.layers.modules(), self.lm_head):
                    if isinstance(module, nn.Linear) and getattr(module, "quantized", None) is None:
                        module.weight = nn.Parameter(module.weight.detach().to(cast), requires_grad=False)
            return

        def pack(w: torch.Tensor) -> torch.Tensor:  # in the layout oneDNN picks for 64-row inputs
            return onednn.pack(w.detach().to(cast), 64)

        for module in self.layers.modules():
            if isinstance(module, Linear) and module.quantized is None:
                module.packed = pack(module.weight)
                if cast != weight.dtype:
                    module.weight = None  # type: ignore[assignment]
        if self.lm_head_quantized is None:
            self.lm_head_packed = pack(self.lm_head_weight())
            if cast != weight.dtype and self.lm_head is not None:
                self.lm_head.weight = None  # type: ignore[assignment]

    def use_cpu_kernels(self, kernels) -> None:
        """Run RMSNorm (with the residual add before it), RoPE and SiLU-and-multiply through the compiled
        CPU kernels (worker/cpu_kernels.py): one pass each instead of 3-6 torch ops; and projections of
        up to PANEL_MAX_ROWS rows through the kernels' panel GEMM, which keeps one more packed copy of
        the layers' weights (csrc/packed_linear.cpp); and decode steps' layers in one C++ call where
        they are Llama's (worker/fused_decode.py). CPU float32 only; call again after changing weights."""
        weight = self.embed_tokens.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError(f"the CPU kernels run float32 on CPU, not {weight.dtype} on {weight.device}")
        for module in self.modules():
            if isinstance(module, (RMSNorm, DecoderLayer)):
                module.kernels = kernels
            if isinstance(module, RMSNorm):
                module.kernel_weight = (module.weight.detach() + module.offset).contiguous()
            # Only float32 weights get panels: a quantized or bfloat16-packed projection keeps its own path.
            if (isinstance(module, Linear) and module.quantized is None and module.weight is not None
                    and module.weight.dtype == torch.float32):
                module.kernels = kernels
                module.panels = kernels.pack_linear_weight(module.weight.detach())
        self.fused_decode = FusedDecode.for_layers(kernels, list(self.layers), one_rope=self.cfg.local_rope is None)

    def resident_bytes(self) -> int:
        """Bytes of every tensor the model holds (weights, their packed and quantized copies, RoPE
        tables), each storage counted once: what it keeps resident, the KV pool aside. Walks the
        modules: call at load, not per step."""
        storages: dict[int, int] = {}
        for module in self.modules():
            for value in (*vars(module).values(), *module._parameters.values(), *module._buffers.values()):
                tensors = [p.packed for p in value.parts] if isinstance(value, QuantizedWeight) else [value]
                for t in tensors:
                    if not isinstance(t, torch.Tensor):
                        continue
                    if t.is_mkldnn:  # oneDNN's packed copies: an opaque tensor without a storage
                        storages[id(t)] = t.numel() * t.element_size()
                    else:
                        storage = t.untyped_storage()
                        storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def projection_sources(self) -> dict[str, list[list[str]]]:
        """Each projection (module name; "lm_head" for the vocabulary head) -> the ways a checkpoint
        may store its rows: lists of tensor names whose rows it holds in order (its fused shards,
        or the fused tensor itself, as Phi-3 stores it)."""
        sources: dict[str, list[list[str]]] = {}
        for i in range(self.cfg.num_layers):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            sources[f"layers.{i}.qkv_proj"] = [[f"{attn}.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")],
                                               [f"{attn}.qkv_proj.weight"]]
            sources[f"layers.{i}.o_proj"] = [[f"{attn}.o_proj.weight"]]
            sources[f"layers.{i}.gate_up_proj"] = [[f"{mlp}.{p}.weight" for p in ("gate_proj", "up_proj")],
                                                   [f"{mlp}.gate_up_proj.weight"]]
            sources[f"layers.{i}.down_proj"] = [[f"{mlp}.down_proj.weight"]]
        sources["lm_head"] = [["model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"]]
        return sources

    def projection_weight(self, name: str) -> torch.Tensor:
        """The float weight of projection `name` (a key of projection_sources)."""
        if name == "lm_head":
            return self.lm_head_weight()
        module = self.get_submodule(name)
        assert isinstance(module, Linear)
        return module.weight

    def set_quantized(self, name: str, weight: QuantizedWeight) -> None:
        """Serve projection `name` (a key of projection_sources) from `weight`; its float weight is
        released (a tied head's is the embedding table, which lookups still need)."""
        if name == "lm_head":
            self.lm_head_quantized = weight
            if self.lm_head is not None:
                self.lm_head.weight = None  # type: ignore[assignment]
            return
        module = self.get_submodule(name)
        assert isinstance(module, Linear) and weight.out_features == module.out_features, name
        module.quantized = weight
        module.weight = None  # type: ignore[assignment]

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
            # layers.N.{self_attn,mlp}.X.{weight,bias}: our layers have no submodule level.
            layer = self.layers[int(parts[1])]
            assert isinstance(layer, DecoderLayer)
            if parts[3] in self._FUSED:
                fused, shard = self._FUSED[parts[3]]
                sizes = ([layer.q_size, layer.kv_size, layer.kv_size] if fused == "qkv_proj"
                         else [self.cfg.intermediate_size] * 2)
                offset = sum(sizes[:shard])
                target = f"layers.{parts[1]}.{fused}.{parts[4]}"
                if target not in params:
                    return None
                params[target].data[offset : offset + sizes[shard]].copy_(tensor)
                return f"{target}[{shard}]"
            parts = parts[:2] + parts[3:]
        target = ".".join(parts)
        if target not in params:
            return None
        params[target].data.copy_(tensor)
        return target

    def missing_loads(self, loaded: set[str]) -> set[str]:
        """What load_hf_tensor has yet to fill, given what it filled: a fused parameter is complete
        when all its shards were filled, or it was filled whole (Phi-3 checkpoints store it fused)."""
        shards: dict[str, int] = {}
        for name in loaded:
            if name.endswith("]"):
                base = name[: name.rindex("[")]
                shards[base] = shards.get(base, 0) + 1
        complete = {base for base, n in shards.items() if n == (3 if ".qkv_proj." in base else 2)}
        return {name for name, _ in self.named_parameters()} - loaded - complete
