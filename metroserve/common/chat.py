"""Chat messages -> prompt token ids with the model's chat template: one implementation for the
offline LLM.chat and the gateway's /v1/chat/completions, so both send the model the same tokens."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ChatTemplateOptions:
    """vLLM's chat request fields that shape the prompt."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message stays open for the model to go on
    add_special_tokens: bool = False  # the template already holds any BOS it wants
    chat_template: str | None = None  # instead of the tokenizer's own
    template_kwargs: dict = field(default_factory=dict)  # extra variables for the template (chat_template_kwargs)
    tools: list[dict] | None = None  # function definitions the template renders


def chat_prompt_ids(tokenizer, messages: list[dict], options: ChatTemplateOptions | None = None) -> list[int]:
    options = options or ChatTemplateOptions()
    if not (options.chat_template or tokenizer.chat_template):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=options.add_generation_prompt,
        continue_final_message=options.continue_final_message, chat_template=options.chat_template,
        tools=options.tools, **options.template_kwargs)
    return tokenizer.encode(text, add_special_tokens=options.add_special_tokens)
