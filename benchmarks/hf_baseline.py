"""The baseline a user would otherwise pick: transformers generate() (eager) with xgrammar's
HF logits processor, on the same shapes as benchmarks/decode.py (random weights, bf16,
vocab 131072, Tekken tokenizer for the grammar). Called by decode.py in the same run.

Per-step time = (t(new_tokens + 1) - t(1)) / new_tokens, so the prompt's prefill cancels.

Modes (each row records its `settings`; a failing mode is an `error` row, the others stay):
- free:            no logits processor; rows may stop at EOS (greedy random weights rarely do);
- free_min:        `min_new_tokens = n` (every row runs the full length) through transformers'
                   own processors;
- free_min_index:  the same guarantee through `SuppressEosUntil` (one slice fill per EOS id
                   while too short): what min_new_tokens costs when done cheaply;
- constrained:     xgrammar's HF LogitsProcessor (JSON schema);
- constrained_min: xgrammar + `min_new_tokens = n`: same prompts, same lengths as free_min
                   (fails if a document ends before n tokens: EOS is then the only legal
                   token, forbidden, and xgrammar's accept asserts; recorded as an error).

Warm-up: each mode first generates the full length once. A 2-token warm-up left the first
mode of each batch several times slower, whichever mode came first: a cold pass over new KV
lengths, not the min-length processors, which the diagnostic row (`min_processor_ms`) times
apart (`diag_min_processors` in benchmarks/results/decode-h200.json). The issue's quoted
baseline (17 tok/s free at 8B B=1) matches such a cold pass.
"""
from __future__ import annotations

import json
import math
import pathlib
import time

import torch

from benchmarks._harness import VOCAB  # decode.py puts the repository root on sys.path
MODES = ("free", "free_min", "free_min_index", "constrained", "constrained_min")
SETTINGS = {  # what each mode passes to generate()
    "free": {"min_new_tokens": None, "logits_processor": None},
    "free_min": {"min_new_tokens": "transformers (min_new_tokens=n)", "logits_processor": None},
    "free_min_index": {"min_new_tokens": "SuppressEosUntil (slice fill)", "logits_processor": None},
    "constrained": {"min_new_tokens": None, "logits_processor": "xgrammar.contrib.hf.LogitsProcessor"},
    "constrained_min": {"min_new_tokens": "transformers (min_new_tokens=n)",
                        "logits_processor": "xgrammar.contrib.hf.LogitsProcessor"},
}


def suppress_eos_until(prompt_len: int, min_new_tokens: int, eos_ids: list[int]):
    """A transformers LogitsProcessor: EOS ids at -inf until min_new_tokens are generated,
    by slice fills on the scores (no isin, no host sync)."""
    from transformers import LogitsProcessor

    class SuppressEosUntil(LogitsProcessor):
        def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
            if input_ids.shape[-1] - prompt_len < min_new_tokens:
                for t in eos_ids:
                    scores[:, t] = -math.inf
            return scores

    return SuppressEosUntil()


def min_processor_ms(batch: int, prompt_len: int, eos_id: int, reps: int = 20, device: str = "cuda") -> float:
    """transformers' two min-length processors (as min_new_tokens adds them) on (batch, VOCAB)
    float32 scores on the device, per call pair, synchronized."""
    from transformers.generation.logits_process import MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor
    eos = torch.tensor([eos_id], device=device)
    procs = [MinLengthLogitsProcessor(prompt_len + 1000, eos), MinNewTokensLengthLogitsProcessor(prompt_len, 1000, eos)]
    ids = torch.zeros(batch, prompt_len + 1, dtype=torch.long, device=device)
    scores = torch.randn(batch, VOCAB, device=device)
    times = []
    for _ in range(reps + 3):
        _sync(device)
        t0 = time.perf_counter()
        for proc in procs:
            scores = proc(ids, scores)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times[3:])[reps // 2] * 1e3


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def hf_baseline(cfg, preset: str, tokenizer_dir: str, schema: dict, batches: list[int], new_tokens: int,
                prompt_len: int, log=print, device: str = "cuda") -> list[dict]:
    """transformers generate(), eager, with and without xgrammar's HF logits processor
    (device "cpu": a smoke test of the modes on a tiny config)."""
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
    with torch.device(device):
        model = LlamaForCausalLM(hf_cfg).eval()
    torch.set_default_dtype(torch.float32)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(pathlib.Path(tokenizer_dir) / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=[2])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False)
    out = []
    for batch in batches:
        prompt = torch.randint(100, 100000, (batch, prompt_len), device=device)
        for mode in MODES:
            def gen(n):
                kwargs = dict(max_new_tokens=n, do_sample=False, pad_token_id=11, eos_token_id=2)
                processors = []
                if mode.startswith("constrained"):
                    processors.append(LogitsProcessor(compiled))  # one per generate() call
                if mode in ("free_min", "constrained_min"):
                    kwargs["min_new_tokens"] = n
                elif mode == "free_min_index":
                    processors.append(suppress_eos_until(prompt_len, n, [2]))
                if processors:
                    kwargs["logits_processor"] = processors
                _sync(device)
                t0 = time.perf_counter()
                with torch.no_grad():
                    seqs = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
                _sync(device)
                return time.perf_counter() - t0, seqs.shape[1] - prompt_len
            row = {"preset": preset, "batch": batch, "mode": mode, "settings": SETTINGS[mode]}
            try:  # one mode's failure (e.g. xgrammar rejecting a forced token) must not lose the others
                gen(new_tokens + 1)  # warm up over every KV length timed below
                t1, _ = gen(1)
                tn, steps = gen(new_tokens + 1)
            except Exception as exc:  # noqa: BLE001
                row["error"] = repr(exc)[:500]
                log(f"HF {preset} b={batch:3d} {mode:15s} failed: {exc!r}")
                out.append(row)
                continue
            per_step = (tn - t1) / max(1, steps - 1)
            row.update(decode_steps=steps - 1, ms_per_step=per_step * 1e3, tokens_per_s=batch / per_step,
                       generate_s=tn)
            out.append(row)
            log(f"HF {preset} b={batch:3d} {mode:15s} {per_step * 1e3:7.2f} ms/step {batch / per_step:8.1f} tok/s")
        try:
            diag = {"preset": preset, "batch": batch, "mode": "diag_min_processors",
                    "min_processor_ms": min_processor_ms(batch, prompt_len, 2, device=device)}
            log(f"HF {preset} b={batch:3d} transformers' two min-length processors alone: "
                f"{diag['min_processor_ms']:.2f} ms per step")
        except Exception as exc:  # noqa: BLE001
            diag = {"preset": preset, "batch": batch, "mode": "diag_min_processors", "error": repr(exc)[:500]}
        out.append(diag)
    model = None  # noqa: F841 -- frees the weights before the next preset
    if device == "cuda":
        torch.cuda.empty_cache()
    return out
