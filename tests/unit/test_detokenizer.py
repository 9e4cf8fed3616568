import pytest

from liteinfer.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "Emoji: 😀🎉 and a family 👨‍👩‍👧 in a row",
    "日本語のテキストと中文文本",
    "Accents: café, naïve, Ærøskøbing, Łódź",
    "  leading spaces and\nnew lines\n\n",
]


def detokenizer(tokenizer, prompt="Say something:", skip_special_tokens=True):
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens, [], False)


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_full_decode(smollm2_tokenizer, text):
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    detok = detokenizer(smollm2_tokenizer)
    deltas = [detok.step([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == smollm2_tokenizer.decode(ids) == text
    assert detok.text == text
    assert detok.stop_reason is None


def test_multi_byte_characters_are_held_until_complete(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("日本", add_special_tokens=False)
    assert len(ids) > 2  # byte-level BPE splits these characters over several tokens
    detok = detokenizer(smollm2_tokenizer)
    deltas = [detok.step([i]) for i in ids]
    assert "" in deltas
    assert [d for d in deltas if d] == ["日", "本"]


def test_several_tokens_per_step(smollm2_tokenizer):
    text = TEXTS[1]
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    detok = detokenizer(smollm2_tokenizer)
    deltas = [detok.step(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_first_token_keeps_its_leading_space(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(" there", add_special_tokens=False)
    detok = detokenizer(smollm2_tokenizer, prompt="Hello")
    assert detok.step(ids) == " there"


def test_prompt_ending_mid_character_does_not_leak_into_output(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("Hi 😀 there", add_special_tokens=False)
    split = next(n for n in range(1, len(ids)) if smollm2_tokenizer.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(smollm2_tokenizer, ids[:split], True, [], False)
    out = "".join(detok.step([i]) for i in ids[split:])
    assert "Hi" not in out
    assert out == smollm2_tokenizer.decode(ids[split:])


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(smollm2_tokenizer, skip):
    tok = smollm2_tokenizer
    ids = tok.encode("<|im_start|>assistant\nHi there<|im_end|>", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids
    prompt = tok.encode("<|im_start|>user\nhello<|im_end|>\n", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, skip, [], False)
    out = "".join(detok.step([i]) for i in ids)
    assert out == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in out) is not skip
