"""LLM: the offline API. ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import cast

from tqdm.auto import tqdm

from metroserve.common.chat import ChatTemplateOptions, chat_prompt_ids
from metroserve.common.sampling_params import SamplingParams
from metroserve.worker.config import EngineConfig
from metroserve.worker.engine import LLMEngine
from metroserve.worker.outputs import RequestOutput, make_request_output

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order.

        Every request is validated before any runs, so one bad prompt raises ValueError naming it
        and leaves the engine untouched.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [cast(Prompt, prompts)]  # one prompt: text or token ids
        else:
            batch = list(cast(Seq[Prompt], prompts))
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(f"got {len(params)} sampling params for {len(batch)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(batch)
        if len(priorities) != len(batch):
            raise ValueError(f"got {len(priorities)} priorities for {len(batch)} prompts")
        engine = self.engine
        token_ids = [engine.tokenize(p) for p in batch]
        for i, (ids, p) in enumerate(zip(token_ids, params)):
            try:
                engine.validate_request(ids, p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        ids_in_order = []
        for prompt, ids, p, prio in zip(batch, token_ids, params, priorities):
            self._counter += 1
            request = engine.add_request(ids, p, request_id=f"offline-{self._counter}", priority=prio,
                                         validated=True)
            request.prompt = prompt if isinstance(prompt, str) else None
            ids_in_order.append(request.request_id)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(batch), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for request in engine.step():
                    if request.finished:
                        done[request.request_id] = make_request_output(request)
                        bar.update(1)
        return [done[r] for r in ids_in_order]

    def chat(self, messages: list[Message] | Seq[list[Message]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if messages and isinstance(messages[0], dict):
            conversations = [cast(list[Message], messages)]  # one conversation
        else:
            conversations = list(cast(Seq[list[Message]], messages))
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        return chat_prompt_ids(self.engine.tokenizer, messages, ChatTemplateOptions(add_generation_prompt))
