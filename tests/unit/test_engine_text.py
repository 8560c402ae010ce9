"""`engine_text`, the rule the real-vLLM resampling test compares replies by, on the embedded model's tokenizer
(no engine needed, so it runs in the parallel pass)."""

from __future__ import annotations

from pathlib import Path

from tests.support.engine_text import engine_text


def test_engine_text_holds_back_a_character_cut_off_by_the_token_limit(embedded_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model)
    whole = tokenizer.encode("of this color \U0001f308", add_special_tokens=False)
    cut = tokenizer.encode("of this color", add_special_tokens=False)
    assert tokenizer.decode(whole[:-1]).endswith("\ufffd")  # the emoji spans several byte tokens
    assert engine_text(tokenizer, whole) == "of this color \U0001f308"
    assert engine_text(tokenizer, whole[:-1]) == tokenizer.decode(cut)
