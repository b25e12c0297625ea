"""xgrammar's view of a GGUF tokenizer: the text each token id adds to the output.

The vocabulary is handed over as RAW bytes: each token's piece exactly as our detokenizer emits
it (llama.cpp's token_to_piece), whatever the tokenizer kind. So SentencePiece pieces with `▁`,
byte-fallback `<0xXX>` tokens and byte-level BPE's `Ġ` characters need no decoding on xgrammar's
side, and the grammar constrains exactly the text the user receives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar

    from app.engine.text.tokenizer import Tokenizer


def build_tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgrammar.TokenizerInfo:
    """`vocab_size` is the width of the model's logits, which may exceed the tokenizer's (Gemma 3:
    262,144): the ids past the tokenizer, like control tokens (decoded as nothing), are special
    tokens to xgrammar and never allowed, so constrained rows mask them."""
    import xgrammar as xgr

    n = min(tokenizer.vocab_size, vocab_size)
    # skip_special_tokens: control and unknown tokens become empty, which marks them special.
    pieces = [tokenizer.token_to_bytes(i, skip_special_tokens=True) for i in range(n)]
    stop = sorted(t for t in tokenizer.stop_token_ids if t < n)
    return xgr.TokenizerInfo(pieces, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop)
