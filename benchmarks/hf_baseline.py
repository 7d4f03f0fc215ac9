"""The baseline a user would otherwise pick: transformers generate() (eager) with xgrammar's
HF logits processor, on the same shapes as benchmarks/decode.py (random weights, bf16,
vocab 131072, Tekken tokenizer for the grammar). Called by decode.py in the same run.

Per-step time = (t(new_tokens + 1) - t(1)) / new_tokens, so the prompt's prefill cancels.
"""
from __future__ import annotations

import json
import pathlib
import time

import torch

VOCAB = 131072


def hf_baseline(cfg, preset: str, tokenizer_dir: str, schema: dict, batches: list[int], new_tokens: int,
                prompt_len: int, log=print) -> list[dict]:
    """transformers generate(), eager, with and without xgrammar's HF logits processor."""
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    hf_cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                         max_position_embeddings=4096, rms_norm_eps=cfg.rms_norm_eps,
                         rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
                         bos_token_id=1, eos_token_id=2, pad_token_id=11)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(hf_cfg).eval()
    torch.set_default_dtype(torch.float32)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(pathlib.Path(tokenizer_dir) / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=[2])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False)
    out = []
    for batch in batches:
        prompt = torch.randint(100, 100000, (batch, prompt_len), device="cuda")
        # free_min: min_new_tokens keeps every row to the end (run 1 measured this slower than
        # constrained, so it is kept apart); free: no logits processor at all.
        for mode in ("free_min", "free", "constrained"):
            def gen(n):
                kwargs = dict(max_new_tokens=n, min_new_tokens=n if mode == "free_min" else 0, do_sample=False,
                              pad_token_id=11, eos_token_id=2)
                if mode == "constrained":
                    kwargs["logits_processor"] = [LogitsProcessor(compiled)]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.no_grad():
                    seqs = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
                torch.cuda.synchronize()
                return time.perf_counter() - t0, seqs.shape[1] - prompt_len
            gen(2)  # warm up
            t1, _ = gen(1)
            tn, steps = gen(new_tokens + 1)
            per_step = (tn - t1) / max(1, steps - 1)
            out.append({"preset": preset, "batch": batch, "mode": mode, "decode_steps": steps - 1,
                        "ms_per_step": per_step * 1e3, "tokens_per_s": batch / per_step,
                        "generate_s": tn})
            log(f"HF {preset} b={batch:3d} {mode:11s} {per_step * 1e3:7.2f} ms/step {batch / per_step:8.1f} tok/s")
    del model
    torch.cuda.empty_cache()
    return out
