"""MockEngine: the worker's engine with the model replaced by a clock (``metroserve worker --engine mock``).

For capacity planning and router testing without GPUs: the worker service and its protocol run for
real, and so does the KV bookkeeping (the same Batcher and BlockManager as the engine, so chunked
prefill, prefix-cache hits, preemption by recompute and block events behave as there). Only the
forward pass is simulated: each step sleeps for

    step_fixed_s + prefill_token_s * (prompt chunk tokens) + decode_seq_s * (decoding sequences)

on the event loop (no CPU burnt, so a benchmark's CPU numbers measure the service), and the tokens
come from a generator:

- greedy requests (temperature 0): a hash of the last few token ids and the position, mod
  vocab_size, so the output is a function of the token history alone. A request migrated to
  another mock worker with ``resume_token_ids`` continues with exactly the tokens it would have
  produced where it started;
- sampled requests: a per-sequence ``random.Random``, seeded from ``params.seed`` (then a resumed
  request continues identically too) or else from the engine seed and the request id.

The stop rules are the engine's (``common.stop_rules``: stop_token_ids, EOS, min_tokens, ignore_eos,
max_tokens, the context length); stop strings are the gateway's, as for any worker without text.
n > 1 forks after the prompt's last chunk, as in the engine. Logprobs are synthetic: the chosen
token ranks first with a probability in [0.5, 0.95), alternatives take geometric shares of the rest.
Not modelled: text, speculative decoding, logit_bias / penalties / top-k/p (sampled tokens are
uniform over the vocabulary), engine metrics (``metrics_collector`` returns None).

Cost per step is the bookkeeping, about 7 us of CPU per decoding sequence (120 us for a step of 16,
outputs included), plus a hash per filled KV block. Not thread-safe: every method runs on the
event loop that the step task runs on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from metroserve.common.block_hash import BlockHash
from metroserve.common.request_limits import RequestLimits
from metroserve.common.sampling_params import SamplingParams
from metroserve.common.stop_rules import append_token
from metroserve.worker.batcher import Batcher, ScheduledBatch
from metroserve.worker.block_manager import BlockManager
from metroserve.worker.metrics import EngineStats, KVPeak, engine_stats
from metroserve.worker.outputs import make_request_output
from metroserve.worker.sequence import Request, Sequence, SequenceStatus
from metroserve.worker.step_sink import EngineDeadError, StepResult, StepSink

logger = logging.getLogger(__name__)

# A greedy token depends on this many preceding ids (and its position): enough that different
# prompts diverge, few enough to cost next to nothing per token.
_CONTEXT = 4
_MASK64 = (1 << 64) - 1


@dataclass
class MockEngineOptions:
    """The simulated engine. Defaults: the project's default model, SmolLM2-135M (vocabulary 49152,
    22.5 KiB of bf16 KV per token), on a 24 GB GPU of the L4 / A10G class at 0.9 utilisation,
    which leaves ~18 GiB for KV: 52428 blocks of 16 tokens. Step times are rough figures for that
    pair: ~4 ms per step (weights read plus launch overheads), 10 us per prompt token (compute),
    50 us per decoding sequence (its KV read at ~1K context)."""

    num_blocks: int = 52428
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    vocab_size: int = 49152
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # or "priority", as the engine's
    seed: int = 0  # for sampled requests that give none
    step_fixed_s: float = 0.004
    prefill_token_s: float = 10e-6
    decode_seq_s: float = 50e-6
    # The id the stop rules treat as EOS. The generator draws it like any other id (1 / vocab_size
    # per token), so a small vocabulary exercises min_tokens / ignore_eos; None: no EOS at all.
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (a prompt token and an output token), "
                             f"got {self.max_model_len}")
        for name in ("step_fixed_s", "prefill_token_s", "decode_seq_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.eos_token_id is not None and not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(f"eos_token_id must be in [0, {self.vocab_size}), got {self.eos_token_id}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")

    def step_time(self, num_prefill_tokens: int, num_decode_seqs: int) -> float:
        """Seconds one simulated forward takes."""
        return self.step_fixed_s + self.prefill_token_s * num_prefill_tokens + self.decode_seq_s * num_decode_seqs


def greedy_token(token_ids: list[int], vocab_size: int) -> int:
    """The greedy next token: a 64-bit mix of the last _CONTEXT ids and the position, mod vocab_size.
    The same in every process (plain integer arithmetic, no salted hash)."""
    x = len(token_ids) * 0x9E3779B97F4A7C15
    for t in token_ids[-_CONTEXT:]:
        x = ((x ^ t) * 0xBF58476D1CE4E5B9) & _MASK64
    return (x ^ (x >> 31)) % vocab_size


def synthetic_logprobs(token: int, num_top: int, vocab_size: int) -> dict[int, float]:
    """{chosen: logprob} plus the next num_top - 1 ids as the runners-up: a valid distribution's top-N
    (probabilities sum below 1, the chosen one ranks first)."""
    p = 0.5 + 0.45 * ((token * 2654435761) % 1000) / 1000
    out = {token: math.log(p)}
    rest, half = math.log1p(-p), math.log(0.5)
    for i in range(1, min(num_top, vocab_size)):
        out[(token + i) % vocab_size] = rest + i * half
    return out


@dataclass
class _Abort:
    request_id: str
    finish_reasons: list[str] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)


class MockEngine:
    """The batched AsyncEngine interface (submit / abort, one StepResult per step) over a simulated model.

    The step task starts on the running loop at the first submit(). ``sleep`` is the simulated
    forward's wait (tests pass a recorder)."""

    def __init__(self, options: MockEngineOptions, sink: StepSink,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self.options = o = options
        self._sink = sink
        self._sleep = sleep
        self._block_manager = BlockManager(o.num_blocks, o.block_size, o.enable_prefix_caching, record_events=True)
        self._batcher = Batcher(self._block_manager, o.max_num_batched_tokens, o.max_num_seqs, o.scheduling_policy)
        self._eos_token_ids = () if o.eos_token_id is None else (o.eos_token_id,)
        self._requests: dict[str, Request] = {}  # submitted and not yet reported finished
        self._pending: list[Request | _Abort] = []  # applied between steps, in order
        self._rngs: dict[Sequence, random.Random] = {}  # sampled sequences' generators
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._error: EngineDeadError | None = None
        self._kv_peak = KVPeak()

    # -- the service's interface ------------------------------------------------------------

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, priority: int = 0,
               cache_salt: str | None = None, resume_token_ids: Seq[int] = ()) -> None:
        """Queue a request whose outputs go to the sink. Not checked against limits: the scheduler
        admitted it against them. resume_token_ids: output produced elsewhere before a migration;
        it counts as output (max_tokens) but is not sent again. Raises ValueError for an id in use."""
        if self._error is not None:
            raise self._error
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.structured_outputs is not None:  # its tokens are synthetic: they could not match a grammar
            raise ValueError("the mock engine does not simulate structured outputs")
        request = Request(request_id, None, list(prompt_token_ids), params, priority=priority, cache_salt=cache_salt)
        if resume_token_ids:
            seq = request.seqs[0]
            seq.token_ids.extend(resume_token_ids)
            seq.num_emitted_tokens = request.num_resumed_tokens = len(resume_token_ids)
            if seq.logprobs is not None:  # placeholders, never sent: keep positions aligned
                seq.logprobs.extend({} for _ in resume_token_ids)
        self._requests[request_id] = request
        self._pending.append(request)
        self._ensure_task()
        self._wakeup.set()

    def abort(self, request_id: str, finish_reasons: Seq[str] = (), num_tokens: Seq[int] = ()) -> None:
        """End a request before the next step; its finished output reaches the sink first. Per sequence
        index: finish_reasons (missing or empty: "abort") and num_tokens (output the client got; what
        was generated past it is dropped). Unknown or already finished ids are ignored."""
        if request_id in self._requests:
            self._pending.append(_Abort(request_id, list(finish_reasons), list(num_tokens)))
            self._wakeup.set()

    @property
    def limits(self) -> RequestLimits:
        o = self.options
        return RequestLimits(vocab_size=o.vocab_size, max_model_len=o.max_model_len, max_num_seqs=o.max_num_seqs,
                             block_size=o.block_size, num_blocks=o.num_blocks)

    def stats(self) -> EngineStats:
        return engine_stats(self._batcher, self._kv_peak)

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every block the prefix cache holds now (a worker's first report after connecting)."""
        return list(self._block_manager.cached.keys())

    def metrics_collector(self, labels: dict[str, str]) -> None:
        """The mock serves no engine metrics (the scheduler's per-worker metrics still cover it)."""
        return None

    async def shutdown(self) -> None:
        """Stop the step loop; later submits raise EngineDeadError. The sink is not told."""
        self._error = self._error or EngineDeadError("engine shut down")
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # -- the step loop ----------------------------------------------------------------------

    def _ensure_task(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while True:
                # Cleared before reading _pending: a submit made while we await below sets it again.
                self._wakeup.clear()
                ended = self._apply_pending()
                if ended:  # aborted requests: the sink hears of them before the next step
                    await self._publish(ended)
                if not self._batcher.has_work:
                    await self._wakeup.wait()
                    continue
                batch = self._batcher.schedule_step()
                self._kv_peak.observe(self._batcher, batch)
                await self._sleep(self._step_time(batch))
                await self._publish(self._advance(batch))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug: fail every request rather than hang them
            logger.exception("mock engine step loop failed")
            self._error = EngineDeadError(f"engine step loop failed: {e!r}")
            self._requests.clear()
            self._sink.failed(self._error)

    def _apply_pending(self) -> list[Request]:
        """Apply queued submits and aborts in order; returns the requests the aborts ended."""
        pending, self._pending = self._pending, []
        ended: list[Request] = []
        for item in pending:
            if isinstance(item, Request):
                self._batcher.add(item.seqs[0])
                continue
            request = self._requests.pop(item.request_id, None)
            if request is None:
                continue  # it finished in a step since the abort was queued: already reported
            request.aborted = True
            for seq in request.seqs:
                if not seq.finished:
                    given = item.finish_reasons[seq.index] if seq.index < len(item.finish_reasons) else ""
                    self._end(seq, given or "abort")
                if seq.index < len(item.num_tokens):
                    seq.keep_output(item.num_tokens[seq.index])
            self._record_finished(request, time.time())
            ended.append(request)
        return ended

    def _step_time(self, batch: ScheduledBatch) -> float:
        """A sequence computing just its last token decodes; every other token scheduled (prompt
        chunks, recompute after preemption, resumed output) is prefill work."""
        num_decode = num_prefill = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens:
                num_decode += 1
            else:
                num_prefill += n
        return self.options.step_time(num_prefill, num_decode)

    def _advance(self, batch: ScheduledBatch) -> list[Request]:
        """The forward's effects: computed tokens, a token for each sequence at its end, forks, finishes.
        Returns the requests that got tokens or finished."""
        bm = self._block_manager
        sampled: list[Sequence] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.num_computed_tokens + n < seq.num_tokens:
                continue  # a prefill chunk with more to come
            sampled.append(seq)
            if seq.request.params.n > len(seq.request.seqs):
                sampled += self._batcher.fork(seq, n)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            bm.cache_full_blocks(seq)
        now = time.time()
        touched: dict[str, Request] = {}
        for seq in sampled:
            request = seq.request
            touched[request.request_id] = request
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if request.needs_prompt_logprobs:
                self._score_prompt(request)
            if request.params.max_tokens == 0:
                self._end(seq, "length")
            else:
                self._append_token(seq, self._next_token(seq))
        for request in touched.values():
            if request.finished:
                del self._requests[request.request_id]
                self._record_finished(request, now)
        return list(touched.values())

    def _next_token(self, seq: Sequence) -> int:
        params, vocab = seq.request.params, self.options.vocab_size
        if params.greedy:
            return greedy_token(seq.token_ids, vocab)
        rng = self._rngs.get(seq)
        if rng is None:
            request = seq.request
            base = f"seed {params.seed}" if params.seed is not None else f"{self.options.seed} {request.request_id}"
            rng = self._rngs[seq] = random.Random(f"{base} {seq.index}")
            for _ in range(seq.num_output_tokens):  # resumed output: continue the stream where it was
                rng.randrange(vocab)
        return rng.randrange(vocab)

    def _score_prompt(self, request: Request) -> None:
        """Synthetic logprobs for prompt tokens 1.. (the engine's come from the prefill's logits)."""
        assert request.prompt_logprobs is not None and request.params.prompt_logprobs is not None
        request.prompt_logprobs.extend(synthetic_logprobs(t, request.params.prompt_logprobs, self.options.vocab_size)
                                       for t in request.prompt_token_ids[1:])

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        params = seq.request.params
        if seq.logprobs is not None:
            assert params.logprobs is not None, "a sequence keeps logprobs only when its request asks"
            logprobs = synthetic_logprobs(token, params.logprobs, self.options.vocab_size)
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token]
        finish = append_token(token, seq.num_output_tokens, params, None, self._eos_token_ids, seq.num_tokens,
                              self.options.max_model_len)
        if finish is not None:
            seq.stop_reason = finish.stop_reason
            self._end(seq, finish.reason)

    def _end(self, seq: Sequence, reason: str) -> None:
        self._batcher.remove(seq)  # frees its blocks
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._rngs.pop(seq, None)

    def _record_finished(self, request: Request, now: float) -> None:
        m = request.metrics
        m.finished_time = now
        m.num_generation_tokens = sum(s.num_output_tokens for s in request.seqs) - request.num_resumed_tokens

    async def _publish(self, requests: list[Request]) -> None:
        """One StepResult: the requests' deltas, the block events since the last one, the stats."""
        outputs = [make_request_output(request, delta=True) for request in requests]
        stored, removed = self._block_manager.take_events()
        flushed = self._sink.step_done(StepResult(outputs, stored, removed, self.stats()))
        if flushed is not None:
            await flushed


# -- command line ---------------------------------------------------------------------------

def add_mock_engine_args(parser: argparse.ArgumentParser) -> None:
    """The --mock-* flags. Pool shape and batching come from the engine's own flags when the parser
    has them (--block-size, --max-num-seqs, --max-num-batched-tokens, --max-model-len,
    --enable-prefix-caching, --scheduling-policy, --seed: EngineConfig.add_cli_args)."""
    d = MockEngineOptions()
    g = parser.add_argument_group("mock engine (--engine mock: a simulated model; the engine flags above set "
                                  "block size, batch limits, context length, prefix caching and seed)")
    g.add_argument("--mock-num-blocks", type=int, default=d.num_blocks,
                   help="KV blocks in the simulated pool (default: SmolLM2-135M's KV in ~18 GiB)")
    g.add_argument("--mock-vocab-size", type=int, default=d.vocab_size,
                   help="token ids are drawn from [0, this); match the gateway's tokenizer "
                        "(default: SmolLM2's 49152)")
    g.add_argument("--mock-eos-token-id", type=int, default=d.eos_token_id,
                   help="the id that ends a sequence (drawn like any other id); default: none")
    g.add_argument("--mock-step-fixed-ms", type=float, default=d.step_fixed_s * 1e3,
                   help="simulated step time, fixed part, in ms")
    g.add_argument("--mock-prefill-token-us", type=float, default=d.prefill_token_s * 1e6,
                   help="simulated step time per prompt token computed, in us")
    g.add_argument("--mock-decode-seq-us", type=float, default=d.decode_seq_s * 1e6,
                   help="simulated step time per decoding sequence, in us")


# The engine's own flags (EngineConfig.add_cli_args) the mock takes; the others have no meaning here.
ENGINE_FLAGS_USED = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "enable_prefix_caching", "scheduling_policy", "seed")


def mock_options_from_args(args: argparse.Namespace) -> MockEngineOptions:
    """Options from add_mock_engine_args' flags, plus the engine flags the parser has (unset: defaults)."""
    d = MockEngineOptions()
    engine = {name: getattr(args, name, None) for name in ENGINE_FLAGS_USED}
    return MockEngineOptions(
        num_blocks=args.mock_num_blocks,
        vocab_size=args.mock_vocab_size,
        **{name: getattr(d, name) if value is None else value for name, value in engine.items()},
        step_fixed_s=args.mock_step_fixed_ms / 1e3,
        prefill_token_s=args.mock_prefill_token_us / 1e6,
        decode_seq_s=args.mock_decode_seq_us / 1e6,
        eos_token_id=args.mock_eos_token_id,
    )
