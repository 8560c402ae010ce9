"""The text vLLM returns for a reply's token ids, for tests that compare the two."""

from __future__ import annotations

from typing import Any


def engine_text(tokenizer: Any, token_ids: list[int]) -> str:
    """The text the engine returns for `token_ids`: their decoding, less any trailing tokens that only hold part of
    a character. A reply cut off by `max_tokens` inside a multi-byte character (an emoji is several byte tokens)
    decodes to a trailing U+FFFD, and vLLM's detokenizer holds those tokens' text back."""
    for end in range(len(token_ids), max(len(token_ids) - 4, 0) - 1, -1):
        text: str = tokenizer.decode(token_ids[:end], skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            return text
    raise AssertionError(f"{token_ids} decode to replacement characters only")
