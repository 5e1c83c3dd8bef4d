"""Speculative decoding: a proposer guesses a decoding sequence's next tokens, and the
target model checks all of them in the same batched step (the scheduler grants the
sequence 1 + k tokens, each attending over its cached KV as a decode token would).
The accepted prefix and one token more are kept; the rejected tokens' KV is dropped.

    config.py    speculative_config (vLLM's dict) -> SpeculativeConfig, checked
    ngram.py     prompt lookup: the tokens that followed the last n-gram's latest match
    draft.py     a draft model's greedy tokens, batched, over its own KV cache
    draft_loader.py  a draft model checked against the engine's (vocabulary, context,
                 memory) and loaded
    speculator.py  which sequences speculate this step, verification, KV rollback
"""
