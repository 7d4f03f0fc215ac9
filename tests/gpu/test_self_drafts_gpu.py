"""Self-speculative drafts (proposer "self", engine/self_drafts.py) on the GPU, on both runners
(eager: the model's own forward drafts; CUDA-graph: a captured one-row graph of the draft layers,
and the verify graphs verify):
drafts from the model's draft layers, verified by the full model, give the greedy tokens of no
speculation up to bf16 near ties, and drafts that random weights reject roll back leaving
nothing behind. A "draft" of every layer is the full model's own greedy token, so the verify
must accept nearly all of them: that shows accepted drafts, not only rejected ones, keep the
tokens. (Random weights: no speed-up is claimed from them.)"""
from __future__ import annotations

import pytest

from gpu_helpers import NEW_TOKENS, PROMPTS, TOKENIZER_DIR, check_greedy_rows, check_settled, engine_config
from generation_service.engine.params import GenerationRequest, SamplingParams, SpeculativeParams
from generation_service.model.layer_skip import LayerSkipChoice

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (TOKENIZER_DIR / "tokenizer.json").is_file(),
                                                  reason="no Tekken tokenizer")]
SKIP_LAYER_1 = LayerSkipChoice("random", (1,), 0.0, 4, 1.0, (1, 0), (0.0,), 0, "", 0.0)  # of the 2 layers
SKIP_NONE = LayerSkipChoice("random", (), 1.0, 4, 1.0, (1, 0), (0.0,), 0, "", 0.0)     # drafts = the full model


@pytest.mark.parametrize("runner", ["eager", "cuda_graph"])
@pytest.mark.parametrize("choice", [SKIP_LAYER_1, SKIP_NONE], ids=["skip-layer-1", "skip-none"])
def test_self_drafts_on_the_gpu_keep_the_greedy_tokens(model_spec, runner, choice):
    from generation_service.engine.engine import Engine
    from tests.integration.test_engine_support import run_all, wait_settled
    engine = Engine(engine_config(model_spec, runner, max_draft_tokens=4))
    engine.start()
    try:
        engine.proposers["self"].use(choice)

        def requests(prefix: str, num_drafts: int) -> list[GenerationRequest]:
            return [GenerationRequest(f"{prefix}{i}", tuple(engine.tokenizer.encode(prompt)),
                                      SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                                      speculative=SpeculativeParams(num_draft_tokens=num_drafts, proposer="self"))
                    for i, prompt in enumerate(PROMPTS)]
        plain = run_all(engine, requests("plain", 0))
        drafted = run_all(engine, requests("self", 4))
        stats = wait_settled(engine)
        for result in plain + drafted:
            assert result.error is None and len(result.token_ids) == NEW_TOKENS, result.error
        num_identical = check_greedy_rows(engine, PROMPTS, plain, drafted)
        proposed = sum(result.usage.draft_tokens_proposed for result in drafted)
        accepted = sum(result.usage.draft_tokens_accepted for result in drafted)
        print(f"self drafts ({runner}, skip {list(choice.skip_layers)}, cuda): {num_identical}/{len(PROMPTS)} rows "
              f"identical to no speculation; drafts accepted {accepted}/{proposed}")
        assert proposed > 0
        if not choice.skip_layers:  # the full model drafting itself: only bf16 near ties are rejected
            assert accepted >= 0.8 * proposed, (accepted, proposed)
        check_settled(stats)
    finally:
        engine.stop()
