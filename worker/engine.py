"""LLMEngine: requests in, one scheduled model step at a time, tokens out.

step() = Batcher.schedule_step -> ModelRunner.execute -> append tokens, check stop conditions,
free finished sequences' blocks. The same engine backs the offline ``LLM`` and the
``AsyncEngine`` that the worker service wraps.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Sequence as Seq
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from metroserve.common.block_hash import BlockHash
from metroserve.common.detokenizer import IncrementalDetokenizer
from metroserve.common.request_limits import RequestLimits, check_request
from metroserve.common.sampling_params import SamplingParams
from metroserve.common.stop_rules import append_token
from metroserve.common.tokenizer import load_tokenizer
from metroserve.worker.attention import make_attention_backend
from metroserve.worker.batcher import Batcher
from metroserve.worker.block_manager import BlockManager
from metroserve.worker.config import EngineConfig, parse_size
from metroserve.worker.cpu_allocator import keep_freed_memory
from metroserve.worker.cpu_kernels import has_native_bfloat16
from metroserve.worker.gpu_memory import kv_budget_bytes, profile_step_peak
from metroserve.worker.kv_cache import KVCache
from metroserve.worker.metrics import EngineMetrics, EngineStats, KVPeak, engine_stats
from metroserve.worker.model_files import resolve_model_dir
from metroserve.worker.model_loader import load_model
from metroserve.worker.model_runner import ModelRunner
from metroserve.worker.sampler import Sampler
from metroserve.worker.sequence import Request, Sequence, SequenceStatus
from metroserve.worker.spec_decode.config import SpeculativeConfig
from metroserve.worker.spec_decode.draft_proposer import DraftModelProposer
from metroserve.worker.spec_decode.speculator import Speculator

if TYPE_CHECKING:
    from metroserve.worker.structured_output import StructuredOutputs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, detokenize: bool = True, record_block_events: bool = False,
                 **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # Triton launches and graph captures use the current device
        dtype_name = (config.dtype if config.dtype != "auto"
                      else "bfloat16" if self.device.type == "cuda" else "float32")
        self.dtype = _DTYPES[dtype_name]
        # bfloat16 on CPU: the weights and their matmuls (oneDNN: AMX or AVX512-BF16 where the CPU has
        # them), while activations, the KV pool and attention stay float32 in the compiled kernels.
        matmul_dtype = None
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            self.dtype, matmul_dtype = torch.float32, torch.bfloat16
            if not has_native_bfloat16():
                logger.warning("--dtype bfloat16: this CPU has neither AMX nor AVX512-BF16, so bfloat16 "
                               "matmuls are converted to float32 and run slower than --dtype float32")
        self.model_dir = resolve_model_dir(config.model)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.model = load_model(self.model_dir, self.dtype, self.device, config.quantization, matmul_dtype,
                                config.quantized_activations)
        self.tokenizer = load_tokenizer(self.model_dir)
        mcfg = self.model.cfg
        self.model_config = mcfg
        if config.max_model_len is not None and config.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings {mcfg.max_position_embeddings}")
        self.max_model_len = config.max_model_len or mcfg.max_position_embeddings
        self.eos_token_ids = self._eos_token_ids()
        self.detokenize = detokenize
        spec_config = SpeculativeConfig.parse(config.speculative_config)
        self.drafter = None
        if spec_config is not None and spec_config.method == "draft_model":
            draft_dtype = _DTYPES[spec_config.draft_dtype or dtype_name]  # the dtype asked, not the activations
            # The compiled CPU kernels are float32 only: a draft in another dtype picks its own backend.
            draft_backend = config.attention_backend if config.attention_backend in ("torch", "triton") else "auto"
            assert spec_config.model is not None, "SpeculativeConfig requires a model for draft_model"
            self.drafter = DraftModelProposer(spec_config.model, self.tokenizer.get_vocab(), draft_dtype, self.device,
                                              draft_backend)

        bs = config.block_size
        self.attention = make_attention_backend(config.attention_backend, bs, self.device, self.dtype, mcfg.num_heads,
                                                mcfg.num_kv_heads, mcfg.head_dim)
        self.kv_cache_dtype = self._kv_cache_dtype()
        num_blocks = config.num_gpu_blocks_override or self._num_blocks_for_budget()
        if num_blocks < 1:
            raise ValueError("the KV cache budget does not fit a single block; raise --kv-cache-memory "
                             "or --gpu-memory-utilization")
        # Every layer sliding (Mistral, Phi-3): blocks behind the window go back to the pool early,
        # unless a draft model (which may attend to everything) shares the block tables.
        window = self.model.windows[0] if len(self.model.windows) == 1 and self.drafter is None else None
        self.kv_cache = KVCache(mcfg.num_layers, num_blocks + (window is not None), bs, mcfg.num_kv_heads,
                                mcfg.head_dim, self.kv_cache_dtype, self.device)
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching, record_block_events, window)
        self.batcher = Batcher(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs,
                               config.scheduling_policy)
        sampler = Sampler(self.eos_token_ids, self.device, config.seed)
        if self.drafter is not None:
            self.drafter.init_cache(num_blocks, bs, sampler)
        graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            # Imported here: Triton is only needed on CUDA (or in its interpreter, for tests).
            from metroserve.worker.attention.triton import TritonAttention
            from metroserve.worker.cuda_graphs import CudaGraphRunner

            if isinstance(self.attention, TritonAttention):
                graphs = CudaGraphRunner(self.model, self.kv_cache, self.attention, config.max_num_seqs,
                                         -(-self.max_model_len // bs), self.device)
                graphs.capture()
        self.runner = ModelRunner(self.model, self.kv_cache, self.attention, sampler, self.device, self.drafter, graphs)
        self.speculator = Speculator(spec_config, self.max_model_len) if spec_config is not None else None
        self.requests: dict[str, Request] = {}
        self._structured_outputs: StructuredOutputs | None = None
        self.metrics = None if config.disable_log_stats else EngineMetrics()
        self._kv_peak = KVPeak()

    # -- set-up helpers ----------------------------------------------------------------------

    def _eos_token_ids(self) -> list[int]:
        ids = set(self.model_config.eos_token_ids)
        gen_cfg = Path(self.model_dir) / "generation_config.json"
        if gen_cfg.exists():
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    def _kv_cache_dtype(self) -> torch.dtype:
        """--kv-cache-dtype: auto is the activations' dtype. bfloat16 under float32 activations needs
        attention that widens the pool as it reads it: the compiled CPU kernels do; the torch and
        Triton backends attend in the pool's dtype, so there it is refused."""
        if self.config.kv_cache_dtype == "auto" or _DTYPES[self.config.kv_cache_dtype] == self.dtype:
            return self.dtype
        from metroserve.worker.attention.cpu import CpuAttention

        if not isinstance(self.attention, CpuAttention):
            raise ValueError(f"--kv-cache-dtype {self.config.kv_cache_dtype} with {self.dtype} activations needs "
                             f"the compiled CPU attention kernels (--attention-backend cpu on CPU); this engine "
                             f"runs {type(self.attention).__name__}")
        return _DTYPES[self.config.kv_cache_dtype]

    def _num_blocks_for_budget(self) -> int:
        mcfg = self.model_config
        per_block = KVCache.bytes_per_block(mcfg.num_layers, self.config.block_size, mcfg.num_kv_heads,
                                            mcfg.head_dim, self.kv_cache_dtype)
        if self.drafter is not None:  # the draft's pool has the same blocks
            per_block += self.drafter.bytes_per_block(self.config.block_size)
        if self.device.type == "cuda":
            peak = profile_step_peak(self.model, self.attention, self.config.max_num_batched_tokens,
                                     self.max_model_len, self.config.max_num_seqs, self.config.block_size, self.dtype,
                                     self.device)
            budget = kv_budget_bytes(peak, self.config.gpu_memory_utilization, self.device)
        else:
            budget = parse_size(self.config.kv_cache_memory)
        # Blocks beyond what max_num_seqs full-length sequences could hold would never be used.
        useful = self.config.max_num_seqs * -(-self.max_model_len // self.config.block_size)
        return min(int(budget // per_block), useful)

    # -- requests ----------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len,
                             max_num_seqs=self.config.max_num_seqs, block_size=self.block_manager.block_size,
                             num_blocks=self.block_manager.num_blocks)

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the problem; nothing about a bad request reaches the batch."""
        check_request(prompt_token_ids, params, self.limits)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None,
                    resume_token_ids: Seq[int] = (), validated: bool = False) -> Request:
        """Queue a request. resume_token_ids: output it already produced elsewhere (a migrated request);
        they count as output (max_tokens, penalties) but are not streamed again. validated: the
        caller already checked it against these limits (LLM.generate, AsyncEngine, or the
        scheduler's admission for a worker): it is not checked again."""
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        if not validated:
            self.validate_request(token_ids, params)
        request = Request(request_id, prompt if isinstance(prompt, str) else None, token_ids, params,
                          arrival_time=arrival_time or time.time(), priority=priority, cache_salt=cache_salt)
        self._attach_detokenizer(request.seqs[0])
        self._attach_grammar(request.seqs[0], list(resume_token_ids))
        if resume_token_ids:
            seq = request.seqs[0]
            seq.token_ids.extend(resume_token_ids)
            seq.num_emitted_tokens = len(resume_token_ids)
            request.num_resumed_tokens = len(resume_token_ids)
            if seq.logprobs is not None:  # placeholders, never emitted: keep positions aligned
                seq.logprobs.extend({} for _ in resume_token_ids)
        self.requests[request_id] = request
        self.batcher.add(request.seqs[0])
        return request

    def abort_request(self, request_id: str, finish_reasons: Seq[str] = (),
                      num_tokens: Seq[int] = ()) -> Request | None:
        """Stop a request now and free its blocks; returns it, or None if unknown. Per sequence index:
        finish_reasons ("stop": the gateway found a stop string; missing or empty: "abort") and
        num_tokens (the output the client got: tokens generated past it are dropped, so counts
        and spans say what the client received; missing: keep all)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        request.aborted = True
        for seq in request.seqs:
            if not seq.finished:
                self.batcher.remove(seq)
                given = finish_reasons[seq.index] if seq.index < len(finish_reasons) else ""
                self._finish(seq, given or "abort")
            if seq.index < len(num_tokens):
                seq.keep_output(num_tokens[seq.index])
        self._record_finished(request, time.time())
        return request

    def take_kv_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(stored, removed) prefix-cache block hashes since the last call (record_block_events)."""
        return self.block_manager.take_events()

    def cached_block_hashes(self) -> list[BlockHash]:
        return list(self.block_manager.cached.keys())

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def next_step_computes_prompt(self) -> bool:
        """Whether the next step may compute prompt tokens: a request waits, or a running one is
        still in its prefill (a later chunk, or a migrated request's resume). Such a step can take
        seconds on a CPU (2,048 tokens of SmolLM2-135M: 6.5 s on one Zen 2 core); a decode step
        computes one token (plus drafts) per sequence. O(running sequences)."""
        b = self.batcher
        return bool(b.waiting) or any(s.is_prefilling for s in b.running)

    def _attach_detokenizer(self, seq: Sequence) -> None:
        if self.detokenize:
            p = seq.request.params
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, p.stop_strings, p.include_stop_str_in_output,
                                                     p.skip_special_tokens)

    @property
    def structured_outputs(self) -> StructuredOutputs:
        """Built on the first constrained request: xgrammar and its vocabulary tables cost time and memory."""
        if self._structured_outputs is None:
            from metroserve.worker.structured_output import StructuredOutputs

            self._structured_outputs = StructuredOutputs(self.tokenizer, self.model_config.vocab_size,
                                                         self.eos_token_ids)
            self.runner.structured_outputs = self._structured_outputs
        return self._structured_outputs

    def _attach_grammar(self, seq: Sequence, resume_token_ids: list[int]) -> None:
        """Raises GrammarError (a ValueError) when the grammar engine rejects the constraint."""
        spec = seq.request.params.structured_outputs
        if spec is not None:
            seq.grammar = self.structured_outputs.matcher(spec, resume_token_ids)

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """One model step. Returns the requests that got new tokens or finished."""
        if self.speculator is not None:
            self.speculator.plan(self.batcher.running)
        batch = self.batcher.schedule_step()
        if not batch:
            return []
        self._kv_peak.observe(self.batcher, batch)
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_only: list[Sequence] = []  # max_tokens 0: the prompt was scored, nothing is sampled
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.num_computed_tokens + n < seq.num_tokens + seq.num_lookahead_tokens:
                continue  # a prefill chunk with more to come: nothing to sample yet
            if seq.request.params.max_tokens == 0:
                prompt_only.append(seq)
                continue
            sample_rows.append(i)
            sample_seqs.append(seq)
            request = seq.request
            if request.params.n > len(request.seqs):
                for child in self.batcher.fork(seq, n):
                    self._attach_detokenizer(child)
                    self._attach_grammar(child, [])
                    sample_rows.append(i)
                    sample_seqs.append(child)
        out = self.runner.execute(batch, sample_rows, sample_seqs)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if not seq.num_lookahead_tokens:
                seq.num_computed_tokens += n
                self.block_manager.cache_full_blocks(seq)
                self.block_manager.release_out_of_window(seq)

        for seq, entries in out.prompt_logprobs:
            assert seq.request.prompt_logprobs is not None, "only requests that ask get prompt logprobs"
            seq.request.prompt_logprobs.extend(entries)

        now = time.time()
        touched: dict[str, Request] = {}
        first_latencies: list[float] = []
        token_gaps: list[float] = []
        num_first_prompt = num_generated = 0
        for seq in prompt_only:  # their one output, the prompt's logprobs, counts as the first token's
            touched[seq.request.request_id] = seq.request
            seq.request.metrics.first_token_time = now
            first_latencies.append(now - seq.request.arrival_time)
            num_first_prompt += len(seq.request.prompt_token_ids)
            self._end(seq, "length")
        for seq, tokens, logprobs in zip(sample_seqs, out.token_ids, out.logprobs):
            request = seq.request
            touched[request.request_id] = request
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
                first_latencies.append(now - request.arrival_time)
                num_first_prompt += len(request.prompt_token_ids)
            elif seq.last_token_time is not None:
                token_gaps.append(now - seq.last_token_time)
            seq.last_token_time = now
            num_before = seq.num_tokens
            if seq.num_lookahead_tokens:
                self._append_verified(seq, tokens)
            else:
                self._append_token(seq, tokens[0], logprobs)
            num_generated += seq.num_tokens - num_before
        if self.metrics is not None:
            self.metrics.record_step(sum(batch.num_new_tokens), num_generated, num_first_prompt, first_latencies,
                                     token_gaps)
        for request in touched.values():
            if request.finished:
                self.requests.pop(request.request_id, None)
                self._record_finished(request, now)
        return list(touched.values())

    def _record_finished(self, request: Request, now: float) -> None:
        m = request.metrics
        m.finished_time = now
        m.num_generation_tokens = sum(s.num_output_tokens for s in request.seqs) - request.num_resumed_tokens
        if self.metrics is not None:
            self.metrics.record_finished(request, now)

    def _append_verified(self, seq: Sequence, tokens: list[int]) -> None:
        """A speculating sequence's accepted drafts plus the target's own next token."""
        assert self.speculator is not None, "only the speculator gives a sequence lookahead tokens"
        self.speculator.record(seq, len(seq.spec_token_ids), len(tokens) - 1)
        # K/V are valid for the previous last token and the accepted drafts, not for rejected ones.
        seq.num_computed_tokens += len(tokens)
        seq.clear_spec()
        for token in tokens:
            self._append_token(seq, token, None)
            if seq.finished:
                return
        self.block_manager.cache_full_blocks(seq)
        self.block_manager.trim(seq)
        self.block_manager.release_out_of_window(seq)

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> None:
        seq.token_ids.append(token)
        if logprobs is not None:
            assert seq.logprobs is not None, "the sampler returns logprobs only to requests that ask for them"
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token]
        finish = append_token(token, seq.num_output_tokens, seq.request.params, seq.detokenizer,
                              self.eos_token_ids, seq.num_tokens, self.max_model_len)
        if seq.grammar is not None:
            accepted = seq.grammar.accept_token(token)
            assert accepted, "the sampler only picks tokens the grammar allows"
            if finish is None and seq.grammar.is_terminated():  # its stop token, with ignore_eos
                self._end(seq, "stop")
        if finish is not None:
            seq.stop_reason = finish.stop_reason
            self._end(seq, finish.reason)

    def _end(self, seq: Sequence, reason: str) -> None:
        self.batcher.remove(seq)
        self._finish(seq, reason)

    @staticmethod
    def _finish(seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def stats(self) -> EngineStats:
        spec = replace(self.speculator.stats) if self.speculator is not None else None
        return engine_stats(self.batcher, self._kv_peak, spec)
