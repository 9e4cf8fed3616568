import pytest

from liteinfer.engine.detokenizer import IncrementalDetokenizer


def run(tokenizer, text, stop, include=False, flush=True):
    """Feeds `text` one token at a time; returns (streamed deltas joined, detokenizer)."""
    prompt_ids = tokenizer.encode("Q:", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, True, stop, include)
    out = ""
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        out += detok.step([token_id])
        if detok.stop_reason is not None:
            break
    if flush and detok.stop_reason is None:
        out += detok.flush()
    return out, detok


def test_stop_string_across_token_boundaries_is_trimmed(smollm2_tokenizer):
    text = "The answer is 42. STOPPING now, more text"
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert "STOP" not in [smollm2_tokenizer.decode([i]).strip() for i in ids]  # really spans tokens
    out, detok = run(smollm2_tokenizer, text, ["STOP"])
    assert out == detok.text == "The answer is 42. "
    assert detok.stop_reason == "STOP"


def test_include_stop_str_in_output(smollm2_tokenizer):
    out, detok = run(smollm2_tokenizer, "The answer is 42. STOPPING now", ["STOP"], include=True)
    assert out == detok.text == "The answer is 42. STOP"
    assert detok.stop_reason == "STOP"


def test_earliest_of_several_stop_strings_wins(smollm2_tokenizer):
    text = "alpha beta gamma delta"
    out, detok = run(smollm2_tokenizer, text, ["delta", "beta", "gamma"])
    assert out == detok.text == "alpha "
    assert detok.stop_reason == "beta"


def test_earliest_stop_string_wins_within_one_step(smollm2_tokenizer):
    tok = smollm2_tokenizer
    detok = IncrementalDetokenizer(tok, [], True, ["delta", "beta"], False)
    assert detok.step(tok.encode("alpha beta gamma delta", add_special_tokens=False)) == "alpha "
    assert detok.stop_reason == "beta"


def test_stop_string_completed_first_wins_over_a_longer_one_begun_earlier(smollm2_tokenizer):
    # Generation ends as soon as "beta" is complete; "lpha beta gamma" never gets the chance.
    out, detok = run(smollm2_tokenizer, "alpha beta gamma", ["lpha beta gamma", "beta"])
    assert out == detok.text == "alpha "
    assert detok.stop_reason == "beta"


def test_stop_string_not_found(smollm2_tokenizer):
    text = "Nothing to see here, STO"
    out, detok = run(smollm2_tokenizer, text, ["STOP"])
    assert out == detok.text == text
    assert detok.stop_reason is None


def test_partial_match_is_held_back_then_released_by_flush(smollm2_tokenizer):
    out, detok = run(smollm2_tokenizer, "Wait for ST", ["STOP"], flush=False)
    assert out == "Wait for "  # "ST" could still become "STOP"
    assert detok.text == "Wait for ST"
    assert detok.flush() == "ST"
    assert detok.flush() == ""


def test_partial_match_released_once_it_cannot_match(smollm2_tokenizer):
    out, detok = run(smollm2_tokenizer, "Wait for STAR and more", ["STOP"], flush=False)
    assert out == detok.text == "Wait for STAR and more"


def test_no_hold_back_when_tail_starts_no_stop_string(smollm2_tokenizer):
    tok = smollm2_tokenizer
    detok = IncrementalDetokenizer(tok, [], True, ["###", "STOP"], False)
    deltas = [detok.step([i]) for i in tok.encode("Hello there world", add_special_tokens=False)]
    assert deltas == ["Hello", " there", " world"]


def test_no_hold_back_when_including_stop_string(smollm2_tokenizer):
    out, detok = run(smollm2_tokenizer, "Wait for ST", ["STOP"], include=True, flush=False)
    assert out == "Wait for ST"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_with_multi_byte_characters(smollm2_tokenizer, include):
    out, detok = run(smollm2_tokenizer, "Done 😀🎉 extra", ["😀🎉"], include=include)
    expected = "Done 😀🎉" if include else "Done "
    assert out == detok.text == expected
    assert "\ufffd" not in out
