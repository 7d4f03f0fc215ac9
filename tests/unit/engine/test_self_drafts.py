"""The self-speculative proposer (engine/self_drafts.py): drafts from the draft layers over the
request's own K/V, never touching the K/V of its cached tokens; refusals name why."""
from __future__ import annotations

import pytest
import torch

from generation_service.engine.errors import InvalidRequestError
from generation_service.engine.kv_cache import KVCache
from generation_service.engine.params import GenerationRequest
from generation_service.engine.request import Request
from generation_service.engine.runner import ModelRunner
from generation_service.engine.self_drafts import SelfDraftProposer
from generation_service.model.forward_batch import build_forward_batch
from generation_service.model.layer_skip import LayerSkipChoice, store_choice
from generation_service.model.loader import load_model

PAGE_SIZE = 4


def choice(key: str, skip: tuple[int, ...]) -> LayerSkipChoice:
    return LayerSkipChoice(key, skip, 0.5, 4, 1.0, skip, (0.5,), 8, "", 0.0)


@pytest.fixture(scope="module")
def model(tiny_random_model_path):
    return load_model(f"random:{tiny_random_model_path}", seed=3).model  # untied, varied text


@pytest.fixture(scope="module")
def tiny_random_model_path(tmp_path_factory):
    import json

    from generation_service.model.tiny_random_model import ensure_tiny_random_model
    source = ensure_tiny_random_model(tmp_path_factory.mktemp("cache") / "tiny-random-v2")
    config = json.loads((source / "config.json").read_text())
    config.update(tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("untied") / "config.json"
    path.write_text(json.dumps(config))
    return path


def prefilled(model, prompt: list[int]) -> tuple[Request, KVCache]:
    """A request whose prompt but its last token is cached, as a decode row finds it."""
    config = model.config
    kv = KVCache(config.num_layers, 16, PAGE_SIZE, config.num_kv_heads, config.head_dim, torch.float32, "cpu")
    request = Request(GenerationRequest("r", tuple(prompt)), frozenset(), 0)
    request.pages = [1, 2, 3]
    request.num_cached = len(prompt) - 1
    model(build_forward_batch([prompt[:-1]], [0], [request.pages]), kv)
    return request, kv


def reserve_pages(request: Request, num_tokens: int) -> bool:
    while len(request.pages) * PAGE_SIZE < num_tokens:
        request.pages.append(len(request.pages) + 1)
    return True


@torch.inference_mode()
def test_drafts_are_the_draft_layers_greedy_continuation_and_leave_cached_kv_alone(model):
    prompt = [5, 17, 300, 42, 9, 77, 1000, 23, 8]
    request, kv = prefilled(model, prompt)
    cached_k = [k[1:3].clone() for k in kv.k]  # pages of positions 0..7: the cached tokens
    proposer = SelfDraftProposer(model, ModelRunner(model, kv, model.config.vocab_size).draft_logits, reserve_pages, "m", "m", "eager")
    proposer.use(choice("m", (1, 2)))
    drafts = proposer.propose(request, 5)
    assert len(drafts) == 5 and len(request.pages) * PAGE_SIZE >= len(prompt) + 5
    assert all(torch.equal(before, after[1:3]) for before, after in zip(cached_k, kv.k))
    for i, draft in enumerate(drafts):  # the draft layers over the full model's context K/V, in one extend
        scratch_request, scratch = prefilled(model, prompt)
        reserve_pages(scratch_request, len(prompt) + i)
        extend = build_forward_batch([prompt[-1:] + drafts[:i]], [len(prompt) - 1], [scratch_request.pages])
        assert int(model(extend, scratch, (0, 3))[-1].argmax()) == draft
    # the verify forward over [last token, drafts] gives what it gives without any draft written
    verify = build_forward_batch([prompt[-1:] + drafts], [len(prompt) - 1], [request.pages], logits="all")
    clean_request, clean_kv = prefilled(model, prompt)
    reserve_pages(clean_request, len(prompt) + len(drafts))
    clean_kv_pages = build_forward_batch([prompt[-1:] + drafts], [len(prompt) - 1], [clean_request.pages], logits="all")
    assert torch.equal(model(verify, kv), model(clean_kv_pages, clean_kv))


def test_drafting_stops_at_eos_and_without_pages(model):
    prompt = [5, 17, 300, 42, 9]
    request, kv = prefilled(model, prompt)
    proposer = SelfDraftProposer(model, ModelRunner(model, kv, model.config.vocab_size).draft_logits, reserve_pages, "m", "m", "eager")
    proposer.use(choice("m", (2,)))
    first = proposer.propose(request, 1)
    request.eos_token_ids = frozenset(first)
    assert proposer.propose(request, 4) == first
    refusing = SelfDraftProposer(model, ModelRunner(model, kv, model.config.vocab_size).draft_logits, lambda r, n: False, "m", "m", "eager")
    refusing.use(choice("m", (2,)))
    assert refusing.propose(request, 4) == []


def test_refusals_name_the_runner_and_the_missing_calibration(model, tmp_path, monkeypatch):
    monkeypatch.setenv("STRUCTGEN_CACHE", str(tmp_path))
    sharded = SelfDraftProposer(model, None, reserve_pages, "m", "m", "tensor_parallel")
    with pytest.raises(InvalidRequestError, match="runner is 'tensor_parallel'.*without tensor parallelism"):
        sharded.check_ready()
    eager = SelfDraftProposer(model, None, reserve_pages, "m", "default", "eager")
    with pytest.raises(InvalidRequestError, match="structgen calibrate-self-spec --model default"):
        eager.check_ready()
    store_choice(choice("m", (1,)))
    eager.check_ready()  # the calibration is read at the first request after it is stored
    assert eager.layer_ids == (0, 2, 3)
