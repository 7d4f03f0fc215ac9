"""The per-token kernels of a captured mixed step, each launch setting against the others (GPU).

A mixed step (engine/mixed_graphs.py) of the served 1B at c=128 holds ~100 decode rows and ~550
prompt tokens in a 768-slot graph; its kernel profile (`_roofline.py --mixed-kernels`) showed
two kernels far off their floors: RoPE + K/V write (`kernels/rotary.py`, one program per (token,
head)) and the tiled extend attention (`kernels/extend_attention.py`). This times, for the 1B
(head_dim 64) and 8B (head_dim 128) attention shapes:

- rope_write_kv at T tokens for every (heads per program, warps);
- extend_attention_tiles over one prompt chunk of P tokens after a cached prefix, inside a graph
  of `bucket` slots (its tile list padded as MixedGraphs pads it), for every (BLOCK_M, BLOCK_N,
  warps, stages) and the tile list's order (ascending m blocks, or the latest first).

Each time is a CUDA graph of 16 launches (a layer each, as in the step), median replay / 16.
`chosen`: the setting the kernels' wrappers now pick; for the extend kernel `old_setting` is the
one they picked before (ascending list, two stages; the grid's axes as now: kv heads first).

    python benchmarks/mixed_kernels.py --out benchmarks/results/mixed_kernels-h200.json
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks._gpu_timing import graph_ms  # noqa: E402
from benchmarks._harness import write_result  # noqa: E402

SHAPES = {"llama-3.2-1b": (32, 8, 64), "llama-3.1-8b": (32, 8, 128)}  # q heads, kv heads, head_dim
PAGE, LAYERS, MAX_ROWS = 16, 16, 128
ROPE_TOKENS = (1, 8, 32, 64, 128, 256, 512, 768, 2048)
ROPE_SETTINGS = [(h, w) for h in (1, 2, 4, 8, 16, 32) for w in (1, 2, 4, 8) if w <= max(1, h)]
# (prompt chunk, cached prefix, graph bucket)
EXTEND_CASES = ((404, 0, 512), (660, 0, 768), (1940, 0, 2048), (512, 1536, 768))
EXTEND_SETTINGS = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3), ("desc", "asc")))


def per_launch_us(fn) -> float:
    return graph_ms(lambda: [fn() for _ in range(LAYERS)], reps=20) * 1e3 / LAYERS


def bench_rope(shape: str) -> list[dict]:
    from generation_service.kernels.rotary import heads_per_program, rope_write_kv
    hq, hkv, d = SHAPES[shape]
    out = []
    for tokens in ROPE_TOKENS:
        qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
        cos, sin = (torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k_cache = torch.zeros(1 + -(-tokens // PAGE), PAGE, hkv, d, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(tokens, device="cuda") + PAGE
        chosen = heads_per_program(hq)
        for block_h, warps in ROPE_SETTINGS:
            us = per_launch_us(lambda: rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, hq, hkv, d,
                                                     block_h=block_h, num_warps=warps))
            out.append({"kernel": "rope_write_kv", "shape": shape, "tokens": tokens, "heads_per_program": block_h,
                        "num_warps": warps, "us": us, "chosen": (block_h, warps) == chosen})
        best = min((r for r in out if r["tokens"] == tokens and r["shape"] == shape), key=lambda r: r["us"])
        now = next(r for r in out if r["tokens"] == tokens and r["shape"] == shape and r["chosen"])
        one = next(r for r in out if r["tokens"] == tokens and r["shape"] == shape
                   and (r["heads_per_program"], r["num_warps"]) == (1, 1))
        print(f"rope {shape} T={tokens:5d}: one head a program {one['us']:6.1f} us, chosen {chosen} {now['us']:6.1f} us, "
              f"best ({best['heads_per_program']}, {best['num_warps']}) {best['us']:6.1f} us", flush=True)
    return out


def bench_extend(shape: str) -> list[dict]:
    from generation_service.engine.mixed_graphs import extend_block_m
    from generation_service.kernels.extend_attention import extend_attention_tiles, max_tiles, tile_array
    hq, hkv, d = SHAPES[shape]
    group = hq // hkv
    out = []
    for prompt, prefix, bucket in EXTEND_CASES:
        decode = bucket - prompt if bucket - prompt < MAX_ROWS else 0  # the decode rows the step holds
        pages = -(-(prefix + prompt) // PAGE)
        k_cache = torch.randn(1 + pages, PAGE, hkv, d, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(bucket, hq, d, device="cuda", dtype=torch.bfloat16)
        o = torch.zeros_like(q)
        table = torch.zeros(MAX_ROWS, pages, dtype=torch.int32, device="cuda")
        table[0] = torch.arange(1, 1 + pages, dtype=torch.int32)
        seq_lens, extend_lens = (torch.zeros(MAX_ROWS, dtype=torch.int32, device="cuda") for _ in range(2))
        seq_lens[0], extend_lens[0] = prefix + prompt, prompt
        start = torch.zeros(MAX_ROWS, dtype=torch.int64, device="cuda")
        start[0] = decode
        flops = 4.0 * hq * d * prompt * (prefix + (prompt + 1) / 2)
        default_m = extend_block_m(bucket, group)
        default_warps = 8 if default_m >= 128 else 4
        for block_m, block_n, warps, stages, order in EXTEND_SETTINGS:
            rows, blocks = tile_array([prompt], group, block_m)
            if order == "asc":
                rows, blocks = rows[::-1].copy(), blocks[::-1].copy()
            n = max_tiles(bucket, MAX_ROWS, group, block_m)
            tile_rows = torch.full((n,), -1, dtype=torch.int64, device="cuda")
            tile_blocks = torch.zeros(n, dtype=torch.int64, device="cuda")
            tile_rows[:len(rows)] = torch.from_numpy(rows)
            tile_blocks[:len(blocks)] = torch.from_numpy(blocks)
            case = {"kernel": "extend_attention_tiles", "shape": shape, "prompt": prompt, "prefix": prefix,
                    "bucket": bucket, "block_m": block_m, "block_n": block_n, "num_warps": warps,
                    "num_stages": stages, "order": order,
                    "old_setting": (block_m, block_n, warps, stages, order) == (default_m, 64, default_warps, 2, "asc"),
                    "chosen": (block_m, block_n, warps, stages, order) == (
                        default_m, 64, default_warps, 1 if d <= 64 else 2, "desc")}
            try:
                us = per_launch_us(lambda: extend_attention_tiles(
                    q, k_cache, v_cache, table, seq_lens, extend_lens, start, tile_rows, tile_blocks, d ** -0.5,
                    block_m, o, block_n=block_n, num_warps=warps, num_stages=stages))
                out.append({**case, "us": us, "tflops": flops / us / 1e6})
            except Exception as exc:  # a setting that does not fit (shared memory): recorded, skipped
                out.append({**case, "error": repr(exc)[:200]})
        mine = [r for r in out if (r["shape"], r["prompt"], r["prefix"]) == (shape, prompt, prefix) and "us" in r]
        best, was = min(mine, key=lambda r: r["us"]), next((r for r in mine if r["old_setting"]), None)
        now = next((r for r in mine if r["chosen"]), None)
        print(f"extend {shape} P={prompt} prefix={prefix} bucket={bucket}: old setting "
              f"{was['us'] if was else float('nan'):6.1f} us, chosen {now['us'] if now else float('nan'):6.1f} us; best {best['us']:6.1f} us ({best['tflops']:.0f} TFLOP/s) "
              f"at m={best['block_m']} n={best['block_n']} warps={best['num_warps']} stages={best['num_stages']} "
              f"{best['order']}", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--only", choices=("rope", "extend"), default=None)
    args = parser.parse_args()
    started = time.time()
    records = []
    for shape in args.shapes:
        if args.only in (None, "rope"):
            records += bench_rope(shape)
        if args.only in (None, "extend"):
            records += bench_extend(shape)
    write_result(args.out, {"benchmark": "mixed_kernels", "device": torch.cuda.get_device_name(),
                            "torch": torch.__version__, "command": " ".join(["mixed_kernels.py", *sys.argv[1:]]),
                            "seconds": time.time() - started, "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
