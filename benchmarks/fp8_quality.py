"""FP8 quality (issue 47's target): the built-in real model quantized with `--quantization fp8`
against the same model in BF16, teacher-forced over a fixed text set: top-1 agreement (the
share of positions whose argmax is the BF16 model's) and perplexity; also with FP8 KV pages.

The text set: the calibration passages the self-speculative ranking reads
(generation_service/model/calibration/default.txt) and the realistic JSON documents of the
grammar benchmarks (benchmarks/_documents.py), each text one forward. Runs anywhere: the CPU
computes the FP8 layers' fp32 reference (what the GPU GEMMs compute, up to summation order).

    .venv/bin/python benchmarks/fp8_quality.py --machine ci-2core
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._documents import DOCUMENTS  # noqa: E402
from benchmarks._harness import code_commit, command_line, default_machine, log, write_result  # noqa: E402
from generation_service.engine.kv_cache import KVCache, kv_cache_dtype  # noqa: E402
from generation_service.model.forward_batch import build_forward_batch  # noqa: E402
from generation_service.model.loader import load_model  # noqa: E402
from generation_service.model.quantization.linear import Fp8Linear  # noqa: E402

CALIBRATION = ROOT / "generation_service" / "model" / "calibration" / "default.txt"
TARGET_AGREEMENT, TARGET_PPL_RATIO = 0.98, 1.02
MAX_TOKENS = 1024  # a text longer than this is cut (one forward each)


def texts() -> list[str]:
    passages = [p.strip() for p in CALIBRATION.read_text().split("===") if p.strip()]
    return passages + [json.dumps(document, indent=1) for _, document in DOCUMENTS]


@torch.no_grad()
def logits_of(loaded, ids: list[int], kv_dtype: str) -> torch.Tensor:
    """(len, vocab) fp32 logits of every position, one forward over fresh pages."""
    config, page_size = loaded.config, 16
    num_pages = 2 + len(ids) // page_size
    dtype = kv_cache_dtype(kv_dtype, loaded.model.model.embed_tokens.weight.dtype)
    kv = KVCache(config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim, dtype, "cpu")
    batch = build_forward_batch([ids], [0], [list(range(1, num_pages))], logits="all")
    return loaded.model(batch, kv).float()


def score(reference: list[torch.Tensor], candidate: list[torch.Tensor], targets: list[list[int]]) -> dict:
    """Top-1 agreement with the reference and both perplexities over every predicted position."""
    agree = total = 0
    nll = {"reference": 0.0, "candidate": 0.0}
    for ref, cand, ids in zip(reference, candidate, targets):
        agree += int((ref[:-1].argmax(-1) == cand[:-1].argmax(-1)).sum())
        total += len(ids) - 1
        target = torch.tensor(ids[1:])
        for name, logits in (("reference", ref), ("candidate", cand)):
            nll[name] += float(torch.nn.functional.cross_entropy(logits[:-1], target, reduction="sum"))
    ppl_ref, ppl = math.exp(nll["reference"] / total), math.exp(nll["candidate"] / total)
    return {"positions": total, "top1_agreement": agree / total, "perplexity_bf16": ppl_ref,
            "perplexity": ppl, "perplexity_ratio": ppl / ppl_ref,
            "meets_target": agree / total >= TARGET_AGREEMENT and ppl / ppl_ref <= TARGET_PPL_RATIO}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--machine", default=default_machine())
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    bf16 = load_model(args.model, dtype="bfloat16")
    fp32 = load_model(args.model, dtype="float32")
    fp8 = load_model(args.model, dtype="bfloat16", quantization="fp8")
    w8a16 = load_model(args.model, dtype="bfloat16", quantization="fp8")
    for layer in w8a16.model.modules():  # the decode graphs' GEMVs: FP8 weights, bf16 activations
        if isinstance(layer, Fp8Linear):
            layer.activation = "none"
    ids = [bf16.tokenizer.encode(text)[:MAX_TOKENS] for text in texts()]
    started = time.perf_counter()
    reference = [logits_of(bf16, t, "auto") for t in ids]
    variants = {"float32 (control: bf16 rounding alone)": [logits_of(fp32, t, "auto") for t in ids],
                "fp8 weights": [logits_of(fp8, t, "auto") for t in ids],
                "fp8 weights, bf16 activations (decode GEMVs)": [logits_of(w8a16, t, "auto") for t in ids],
                "fp8 weights + fp8 kv cache": [logits_of(fp8, t, "fp8") for t in ids],
                "bf16 weights + fp8 kv cache": [logits_of(bf16, t, "fp8") for t in ids]}
    results = {name: score(reference, logits, ids) for name, logits in variants.items()}
    for name, result in results.items():
        log(f"{name}: top-1 agreement {result['top1_agreement']:.4f} over {result['positions']} positions, "
            f"perplexity {result['perplexity']:.3f} vs {result['perplexity_bf16']:.3f} "
            f"(x{result['perplexity_ratio']:.4f}){'' if result['meets_target'] else '  MISSES the target'}")
    out = write_result(args.out or ROOT / "benchmarks" / "results" / f"fp8_quality-{args.machine}.json",
                       {"machine": args.machine, "model": args.model, "texts": len(ids),
                        "targets": {"top1_agreement": TARGET_AGREEMENT, "perplexity_ratio": TARGET_PPL_RATIO},
                        "results": results, "seconds": round(time.perf_counter() - started, 1),
                        "command": command_line("benchmarks/fp8_quality.py"), "code_commit": code_commit()},
                       indent=2)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
