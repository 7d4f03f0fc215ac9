from generation_service.engine.events import FinishReason
from generation_service.engine.output import OutputProcessor

from tests.unit.engine.conftest import make_request


def ids(text):
    return [ord(c) for c in text]


def stream(processor, text, step=1):
    out, reason = [], None
    tokens = ids(text)
    for i in range(0, len(tokens), step):
        delta = processor.process(tokens[i:i + step], [])
        out.append(delta.text)
        if delta.finish_reason:
            reason = delta.finish_reason
            break
    return out, reason


def test_stop_string_is_never_streamed_and_prefixes_are_held_back(char_tokenizer):
    r = make_request(prompt=[65], stop_strings=("END",), max_new_tokens=50)
    p = OutputProcessor(r, char_tokenizer)
    pieces, reason = stream(p, "abc ENx EN dEND more")
    assert reason is FinishReason.STOP_STRING
    assert "".join(pieces) == "abc ENx EN d"
    assert "E" not in pieces[4]  # "E" was held back until "N", "x" showed it was no stop
    assert r.output_ids == ids("abc ENx EN dEND")  # tokens after the stop are not kept


def test_no_stop_string_ends_the_output_inside_its_first_min_tokens(char_tokenizer):
    r = make_request(prompt=[65], stop_strings=("x",), max_new_tokens=50, min_tokens=3)
    pieces, reason = stream(OutputProcessor(r, char_tokenizer), "axbxcx")
    assert (reason, "".join(pieces)) == (FinishReason.STOP_STRING, "axb")  # the x at index 3 stops it


def test_stop_string_inside_a_multi_token_step(char_tokenizer):
    r = make_request(prompt=[65], stop_strings=("xy",), max_new_tokens=50)
    pieces, reason = stream(OutputProcessor(r, char_tokenizer), "abxyzz", step=6)
    assert (pieces, reason) == (["ab"], FinishReason.STOP_STRING)


def test_max_tokens_and_stop_tokens(char_tokenizer):
    r = make_request(prompt=[65], max_new_tokens=3)
    pieces, reason = stream(OutputProcessor(r, char_tokenizer), "abcdef", step=2)
    assert (reason, "".join(pieces), r.num_generated) == (FinishReason.MAX_TOKENS, "abc", 3)
    r = make_request(prompt=[65], stop_token_ids=(ord("c"),))
    pieces, reason = stream(OutputProcessor(r, char_tokenizer), "abcdef")
    assert (reason, "".join(pieces)) == (FinishReason.STOP_TOKEN, "ab")
    r = make_request(prompt=[65])
    delta = OutputProcessor(r, char_tokenizer, eos_token_ids=(2,)).process([ord("a"), 2, ord("b")], [])
    assert (delta.token_ids, delta.text, delta.finish_reason) == ([ord("a"), 2], "a", FinishReason.STOP_TOKEN)
    r = make_request(prompt=[65], ignore_eos=True, max_new_tokens=3)
    delta = OutputProcessor(r, char_tokenizer, eos_token_ids=(2,)).process([2, 2, 2], [])
    assert delta.finish_reason is FinishReason.MAX_TOKENS


def test_only_text_that_can_start_a_stop_string_is_held_back(char_tokenizer):
    r = make_request(prompt=[65], stop_strings=("END", "xy"), max_new_tokens=50)
    pieces, reason = stream(OutputProcessor(r, char_tokenizer), "aDbyEcENdx!")
    assert reason is None
    # "D" and "y" end stop strings but start none: streamed at once; "E", "EN", "x" wait.
    assert pieces == ["a", "D", "b", "y", "", "Ec", "", "", "ENd", "", "x!"]


def test_streamed_text_matches_the_hold_back_rule_on_random_text(char_tokenizer):
    """Reference: after each token, everything but the longest suffix that starts a stop
    string is streamed; at the first match the text before it is, and the request stops."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        stops = tuple({"".join(rng.choices("ab\n", k=rng.randint(1, 3))) for _ in range(rng.randint(1, 3))})
        text = "".join(rng.choices("ab\nc", k=30))
        r = make_request(prompt=[65], stop_strings=stops, max_new_tokens=100)
        pieces, reason = stream(OutputProcessor(r, char_tokenizer), text)
        streamed = ""
        for k, piece in enumerate(pieces, start=1):
            streamed += piece
            seen = text[:k]
            match = min((i for s in stops if (i := seen.find(s)) >= 0), default=None)
            if match is not None:
                assert (streamed, reason, k) == (seen[:match], FinishReason.STOP_STRING, len(pieces))
                break
            held = max((n for s in stops for n in range(1, len(s)) if seen.endswith(s[:n])), default=0)
            assert streamed == seen[:k - held]
        else:
            assert reason is None
