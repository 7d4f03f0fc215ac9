"""Our loader + paged decoder against transformers on tiny random checkpoints, fp32."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_reference import hf_step_logits, save_hf_checkpoint
from generation_service.model.loader import load_model
from generation_service.model.reference_generate import greedy_generate

TINY = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

FAMILIES = {
    # Llama 3.1-style: llama3 rope scaling (short original context so all three bands are hit), untied.
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_parameters=LLAMA3_ROPE)),
    # Llama 2-style with tied embeddings, attention and MLP biases, linear rope scaling.
    "llama-bias-tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                        dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                             rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    # Mistral with a sliding window shorter than the longest prompt.
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=8)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    # Qwen3: q/k norm, head_dim (32) independent of hidden_size / num_heads (16).
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32)),
}
PROMPTS = [[1, 5, 9, 200, 3], [7, 7, 8, 9, 10, 11, 12, 400, 13, 14, 999], list(range(20, 37))]
NUM_STEPS = 16
TOLERANCE = 1e-4


def make_hf_model(family: str, dtype=torch.float32):
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(1234)
    model = model_class(config_class(**TINY | extra)).eval()
    if family in ("qwen2", "llama-bias-tied"):  # transformers zero-inits biases; make them matter
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.1)
    return model.to(dtype)


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    hf_model = make_hf_model(request.param)
    folder = save_hf_checkpoint(hf_model, tmp_path_factory.mktemp(request.param))
    return request.param, folder, hf_model


def assert_matches(result, hf_model, prompts):
    """Logits of prefill and every decode step within TOLERANCE of transformers', same greedy ids."""
    for row, prompt in enumerate(prompts):
        reference = hf_step_logits(hf_model, prompt, result.output_ids[row])
        ours = torch.stack([result.prefill_logits[row]] + [step[row] for step in result.step_logits])
        diffs = (ours - reference).abs().amax(dim=-1).tolist()
        assert max(diffs) < TOLERANCE, f"row {row}: max abs diff per step {diffs}"
        assert reference.argmax(dim=-1).tolist() == result.output_ids[row]


def test_config_is_read_as_family(checkpoint):
    family, folder, _ = checkpoint
    config = load_model(str(folder)).config
    assert config.qk_norm == (family == "qwen3")
    assert config.attention_bias == (family in ("qwen2", "llama-bias-tied"))
    assert config.sliding_window == (8 if family == "mistral" else None)
    assert config.tie_word_embeddings == (family in ("qwen2", "llama-bias-tied"))


@pytest.mark.parametrize("page_size, prefill_chunk, num_padding_rows", [
    (4, None, 0),  # pages smaller than every prompt, whole-prompt prefill
    (4, 6, 2),  # chunked prefill across page boundaries, padding rows in every decode step
])
def test_batched_greedy_matches_transformers(checkpoint, page_size, prefill_chunk, num_padding_rows):
    _, folder, hf_model = checkpoint
    loaded = load_model(str(folder))
    result = greedy_generate(loaded.model, loaded.config, PROMPTS, NUM_STEPS, page_size=page_size,
                             prefill_chunk=prefill_chunk, num_padding_rows=num_padding_rows)
    assert len(result.output_ids[0]) == NUM_STEPS
    assert_matches(result, hf_model, PROMPTS)


def test_single_request_matches_transformers(checkpoint):
    _, folder, hf_model = checkpoint
    loaded = load_model(str(folder))
    result = greedy_generate(loaded.model, loaded.config, PROMPTS[2:], NUM_STEPS, page_size=3)
    assert_matches(result, hf_model, PROMPTS[2:])


def test_sharded_checkpoint_loads(tmp_path):
    hf_model = make_hf_model("llama3")
    save_hf_checkpoint(hf_model, tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_model(str(tmp_path))
    result = greedy_generate(loaded.model, loaded.config, PROMPTS[:1], 4, page_size=4)
    assert_matches(result, hf_model, PROMPTS[:1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tracks_transformers(tmp_path, dtype):
    hf_model = make_hf_model("qwen3")
    save_hf_checkpoint(hf_model, tmp_path)
    loaded = load_model(str(tmp_path), dtype=dtype)
    assert next(loaded.model.parameters()).dtype == dtype
    result = greedy_generate(loaded.model, loaded.config, PROMPTS, 1, page_size=4)
    assert result.prefill_logits.dtype == torch.float32
    for row, prompt in enumerate(PROMPTS):
        reference = hf_model.to(dtype)(torch.tensor([prompt])).logits[0, -1].float()
        scale = reference.abs().max().item()
        assert (result.prefill_logits[row] - reference).abs().max().item() < 0.05 * scale
