"""Generate through a real server: streaming, unary-style, token ids, chat, determinism."""
import asyncio

import pytest

from structgen_client import AsyncClient


def test_stream_arrives_in_pieces_and_adds_up(client):
    chunks = list(client.generate("The weather today is", max_tokens=12))
    assert len(chunks) >= 2, "tokens should stream, not arrive in one message"
    final = chunks[-1]
    assert final.finish_reason == "max_tokens" and all(c.finish_reason is None for c in chunks[:-1])
    token_ids = [t for c in chunks for t in c.token_ids]
    assert len(token_ids) == 12 == final.usage.completion_tokens
    assert final.usage.prompt_tokens == len(client.tokenize("The weather today is"))
    assert len({c.request_id for c in chunks}) == 1 and chunks[0].request_id


def test_unary_style_generate_text(client):
    completion = client.generate_text("Once upon a time", max_tokens=8, request_id="unary-1")
    assert completion.request_id == "unary-1"
    assert len(completion.token_ids) == 8 and completion.text
    assert completion.finish_reason == "max_tokens"


def test_token_ids_input_is_the_same_as_the_prompt(client):
    ids = client.tokenize("Count with me:")
    by_text = client.generate_text("Count with me:", max_tokens=6)
    by_ids = client.generate_text(token_ids=ids, max_tokens=6)
    assert by_ids.token_ids == by_text.token_ids  # greedy: same input, same output


def test_chat_input_uses_the_chat_template(client):
    messages = [{"role": "user", "content": "Say hello."}]
    ids = client.tokenize(messages=messages)
    completion = client.generate_text(messages=messages, max_tokens=5)
    assert completion.usage.prompt_tokens == len(ids) > len(client.tokenize("Say hello."))
    assert len(completion.token_ids) == 5


def test_server_default_max_tokens_applies(client, live_server):
    completion = client.generate_text("Hi", ignore_eos=True)
    assert completion.usage.completion_tokens == client.model_info().default_max_tokens == 16


def test_seeded_sampling_is_reproducible(client):
    first = client.generate_text("Pick a word:", max_tokens=8, temperature=1.0, seed=7)
    second = client.generate_text("Pick a word:", max_tokens=8, temperature=1.0, seed=7)
    assert first.token_ids == second.token_ids


def test_stop_string_ends_the_completion_without_it(client):
    free = client.generate_text("Hello", max_tokens=10)
    stop = free.text[len(free.text) // 2:][:3]
    if not stop.strip():
        pytest.skip("no usable stop string in this output")
    stopped = client.generate_text("Hello", max_tokens=10, stop=[stop])
    assert stopped.finish_reason == "stop_string"
    assert stop not in stopped.text and free.text.startswith(stopped.text)


def test_logprobs_come_with_each_token(client):
    completion = client.generate_text("Hi", max_tokens=3, num_logprobs=2)
    assert len(completion.logprobs) == 3
    for token_id, logprob in zip(completion.token_ids, completion.logprobs):
        assert logprob.token_id == token_id and logprob.logprob <= 0 and len(logprob.top) == 2


def test_async_client_streams(live_server):
    async def run():
        async with AsyncClient(live_server.address, timeout=60) as client:
            chunks = [c async for c in client.generate("Async hello", max_tokens=5)]
            info = await client.model_info()
            return chunks, info
    chunks, info = asyncio.run(run())
    assert chunks[-1].finish_reason == "max_tokens" and sum(len(c.token_ids) for c in chunks) == 5
    assert info.vocab_size > 0


def test_model_info_reports_the_configured_limits(client):
    info = client.model_info()
    assert info.max_new_tokens_limit == 64 and info.max_prompt_tokens == 512
    assert info.max_grammar_bytes == 65536 and info.max_message_bytes == 262144
    assert set(info.constraint_kinds) == {"json_schema", "regex", "lark", "structural_tag",
                                          "json_object", "choice"}


def test_speculative_settings_keep_greedy_output_and_report_drafts(client):
    prompt = "one two three one two three one two"
    plain = client.generate_text(prompt, max_tokens=24, ignore_eos=True)
    drafted = client.generate_text(prompt, max_tokens=24, ignore_eos=True, num_draft_tokens=3,
                                   proposer="ngram")
    assert drafted.token_ids == plain.token_ids  # verification never changes greedy output
    usage = drafted.usage
    assert usage.draft_tokens_proposed > 0 and 0 <= usage.draft_tokens_accepted <= usage.draft_tokens_proposed
    assert plain.usage.draft_tokens_proposed == 0


def test_a_repeated_prompt_prefix_is_served_from_the_prefix_cache(client):
    import secrets
    system = f"[{secrets.token_hex(4)}] Answer in one short sentence and stay polite. " * 6  # no earlier prompt's
    first = client.generate_text(system + "What is a cat?", max_tokens=8, ignore_eos=True)
    second = client.generate_text(system + "What is a dog?", max_tokens=8, ignore_eos=True)
    assert first.usage.cached_prompt_tokens == 0
    shared = len(client.tokenize(system))
    assert shared // 2 <= second.usage.cached_prompt_tokens <= shared < second.usage.prompt_tokens
    again = client.generate_text(system + "What is a cat?", max_tokens=8, ignore_eos=True)
    assert again.token_ids == first.token_ids  # greedy output as computed without the cache
    assert again.usage.cached_prompt_tokens >= second.usage.cached_prompt_tokens
    stats = client.engine_stats()
    assert stats.num_kv_pages_cached > 0 and stats.num_kv_pages_used == 0 and client.model_info().prefix_caching
