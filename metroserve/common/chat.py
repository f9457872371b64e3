"""Chat messages -> prompt token ids with the model's chat template: one implementation for the
offline LLM.chat and the gateway's /v1/chat/completions, so both send the model the same tokens."""

from __future__ import annotations


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    # The template already holds any BOS it wants; don't add special tokens twice.
    return tokenizer.encode(text, add_special_tokens=False)
