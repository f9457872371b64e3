"""Speculative decoding: proposers draft tokens, the target verifies them in one forward, exactly.

- config.py: SpeculativeConfig (``--speculative-config``)
- speculator.py: which sequences draft each step, fallbacks, counters
- ngram_proposer.py: prompt-lookup drafts
- draft_proposer.py: a smaller model's drafts, with its KV pool in step with the target's
- rejection_sampler.py: greedy and rejection-sampling verification
"""
