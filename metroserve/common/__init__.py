"""Torch-free code every process shares: sampling parameters, request limits, stop rules, the
detokenizer, chat templates, tokenizer loading and the prefix-block hash. The gateway and the
scheduler import only this (and the rpc stubs), so they start fast and stay small."""
