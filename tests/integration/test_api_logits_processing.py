"""Penalties, logit_bias, min_p and min_tokens through the session's real server: over gRPC
(the Python client) and over HTTP (the official openai SDK), checked against what OpenAI's /
vLLM's definitions predict from the model's own log-probabilities."""
from __future__ import annotations

import openai
import pytest

from structgen_client.errors import InvalidArgumentError

PROMPT = "The list of colors: red, green, blue, red, green, blue, red,"
IDS = {"structgen": {"return_token_ids": True}}


@pytest.fixture(scope="module")
def api(live_server) -> openai.OpenAI:
    with openai.OpenAI(base_url=live_server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def eos_ids(client) -> set[int]:
    return set(client.model_info().eos_token_ids)


def greedy(client, **options):
    return client.generate_text(PROMPT, temperature=0.0, max_tokens=10, ignore_eos=True, **options)


def http_ids(api, **options) -> list[int]:
    model = api.models.list().data[0].id
    extra = options.pop("extra_body", {})
    completion = api.completions.create(model=model, prompt=PROMPT, temperature=0.0, max_tokens=10,
                                        extra_body={**extra, **IDS}, **options)
    return completion.choices[0].model_extra["structgen"]["token_ids"]


def test_logit_bias_minus_100_never_emits_the_token_and_plus_100_forces_it(client, api):
    free = greedy(client).token_ids
    banned = free[0]
    for ids in (greedy(client, logit_bias={banned: -100}).token_ids, http_ids(api, logit_bias={str(banned): -100})):
        assert banned not in ids and len(ids) == 10
    forced = client.tokenize(" purple")[0]
    assert greedy(client, logit_bias={forced: 100}).token_ids == (forced,) * 10
    assert http_ids(api, logit_bias={str(forced): 100}) == [forced] * 10


def test_min_tokens_holds_the_end_token_back(client, api, eos_ids):
    eos = min(eos_ids)
    # EOS forced by its bias: the completion ends at once, or right after min_tokens tokens
    assert client.generate_text(PROMPT, max_tokens=10, logit_bias={eos: 100}).token_ids == (eos,)
    held = client.generate_text(PROMPT, max_tokens=10, logit_bias={eos: 100}, min_tokens=4)
    assert held.finish_reason == "stop_token" and len(held.token_ids) == 5
    assert not eos_ids & set(held.token_ids[:4]) and held.token_ids[4] == eos
    model = api.models.list().data[0].id
    choice = api.completions.create(model=model, prompt=PROMPT, max_tokens=10, logit_bias={str(eos): 100},
                                    extra_body={"min_tokens": 4, **IDS}).choices[0]
    assert choice.finish_reason == "stop" and tuple(choice.model_extra["structgen"]["token_ids"]) == held.token_ids
    # a stop token id is held back alike
    stop = client.tokenize(" purple")[0]
    stopped = client.generate_text(PROMPT, max_tokens=10, stop_token_ids=[stop], logit_bias={stop: 100},
                                   min_tokens=3)
    assert stopped.token_ids[3:] == (stop,) and stop not in stopped.token_ids[:3]


def picks(result, penalty_of) -> list[int]:
    """The reference's greedy pick at each step of `result`, from the model's logprobs it
    returned (before the processing): argmax(logprob - penalty_of(token, generated before))
    over the top 20. Penalties only lower scores, so the top 20 hold the pick whenever one of
    them is not yet generated."""
    chosen = []
    for index, logprob in enumerate(result.logprobs):
        before = result.token_ids[:index]
        assert not {token for token, _ in logprob.top} <= set(before)
        scores = {token: value - penalty_of(token, before) for token, value in logprob.top}
        chosen.append(max(scores, key=scores.get))
    return chosen


@pytest.mark.parametrize("name,prompt,penalty_of", [
    ("presence_penalty", "I like to eat apples and", lambda token, before: 2.0 * (token in before)),
    ("frequency_penalty", PROMPT, lambda token, before: 2.0 * before.count(token)),
], ids=["presence", "frequency"])
def test_a_penalty_changes_greedy_output_as_the_reference_predicts(client, api, name, prompt, penalty_of):
    plain = client.generate_text(prompt, max_tokens=20, ignore_eos=True, temperature=0.0, num_logprobs=20)
    predicted = picks(plain, penalty_of)
    first = next((i for i, (a, b) in enumerate(zip(predicted, plain.token_ids)) if a != b), None)
    assert first is not None, "no step of this prompt's greedy output changes under the penalty"
    penalized = client.generate_text(prompt, max_tokens=20, ignore_eos=True, temperature=0.0, num_logprobs=20,
                                     **{name: 2.0})
    assert penalized.token_ids[:first] == plain.token_ids[:first] and penalized.token_ids[first] == predicted[first]
    assert picks(penalized, penalty_of) == list(penalized.token_ids)  # every later step too
    model = api.models.list().data[0].id
    http = api.completions.create(model=model, prompt=prompt, temperature=0.0, max_tokens=20, **{name: 2.0},
                                  extra_body={"structgen": {"ignore_eos": True, "return_token_ids": True}})
    assert tuple(http.choices[0].model_extra["structgen"]["token_ids"]) == penalized.token_ids


def test_out_of_range_values_are_invalid_argument_saying_the_range(client):
    with pytest.raises(InvalidArgumentError, match=r"sampling.repetition_penalty must be in \(0, 10\]"):
        client.generate_text(PROMPT, max_tokens=4, repetition_penalty=0.0)
    with pytest.raises(InvalidArgumentError, match="min_tokens 9 exceeds the max_tokens in effect"):
        client.generate_text(PROMPT, max_tokens=4, min_tokens=9)
    assert client.generate_text(PROMPT, max_tokens=3).token_ids  # and the server keeps serving
