"""decode.py's engine rows: the whole Engine (scheduler, streams, runner "cuda_graph", overlap off
and on) decoding random prompts, free and, with grammar_service over gRPC (started as the engine
tests start it), every row constrained by decode.py's schema; its ms/step against the `free` graph
row is the host's share. `engine_rows` runs them all into the result. Assumes decode.py has put
the repository root on sys.path.
"""
from __future__ import annotations

import json
import os
import pathlib

import torch

from benchmarks._engine_batch import run_batch
from benchmarks._gpu_model import pages_per_row
from benchmarks._harness import PAGE_SIZE, engine_model_spec, log
from tests.integration.test_engine_support import start_grammar_service


def engine_rows(args, schema: dict, result: dict) -> None:
    """Every preset's engine rows, overlap off then on, into result["engine"] (failures into
    result["engine_errors"]: they must not lose the other rows)."""
    tmp = pathlib.Path(os.environ.get("TMPDIR", "/tmp"))
    result["engine"] = []
    grammar = None
    if not args.skip_engine_constrained:
        try:  # constrained engine rows need grammar_service over gRPC; free rows do not
            grammar = start_grammar_service(tmp, "bench_grammar")
        except Exception as exc:  # noqa: BLE001
            log(f"grammar_service (gRPC) failed to start, engine rows free only: {exc!r}")
            result.setdefault("engine_errors", []).append(f"grammar_service: {exc!r}")
    try:
        for preset in args.presets:
            spec = engine_model_spec(preset, args.tokenizer_dir, tmp / f"bench_model_{preset}")
            for overlap in (False, True):
                torch.cuda.empty_cache()
                try:
                    result["engine"] += engine_decode(preset, args.engine_batches, args.context,
                                                      args.engine_new_tokens, overlap, spec,
                                                      grammar.address if grammar and spec != f"random:{preset}"
                                                      else None, schema)
                except Exception as exc:  # noqa: BLE001 -- must not lose the main numbers
                    log(f"engine {preset} overlap={overlap} failed: {exc!r}")
                    result.setdefault("engine_errors", []).append(f"{preset} overlap={overlap}: {exc!r}")
    finally:
        if grammar is not None:
            grammar.stop()


def engine_decode(preset: str, batches: list[int], context: int, new_tokens: int, overlap: bool,
                  model_spec: str, grammar_address: str | None, schema: dict) -> list[dict]:
    """The whole Engine (scheduler, streams, runner "cuda_graph", `overlap` off or on): greedy
    decode of random prompts, free and (with grammar_service at `grammar_address`) every row
    constrained by `schema`: graph step + the host loop around it."""
    from generation_service.engine.engine import Engine, EngineConfig
    from grammar_contract.spec import GrammarSpec
    max_batch = max(batches)
    num_row_pages = pages_per_row(context + new_tokens + 8)
    client = None
    if grammar_address is not None:
        from grammar_contract.client import GrammarControlClient
        client = GrammarControlClient(grammar_address)
    engine = Engine(EngineConfig(model=model_spec, device="cuda", dtype="bfloat16", runner="cuda_graph",
                                 max_batch=max_batch, num_pages=1 + max_batch * num_row_pages,
                                 page_size=PAGE_SIZE, max_prompt_tokens=context, max_new_tokens_limit=new_tokens,
                                 prefill_chunk_tokens=max(512, context * max_batch), overlap=overlap), client)
    engine.start()
    rows = []
    grammar = GrammarSpec("json_schema", json.dumps(schema), any_whitespace=False)
    try:
        gen = torch.Generator().manual_seed(0)
        vocab = engine.model_config.vocab_size
        for batch in batches:
            for mode in ("free", "constrained") if client is not None else ("free",):
                try:
                    rows.append(_engine_run(engine, preset, batch, mode, context, new_tokens, overlap, gen, vocab,
                                            grammar if mode == "constrained" else None))
                except Exception as exc:  # noqa: BLE001 -- one mode's failure must not lose the others
                    log(f"engine {preset} b={batch} overlap={overlap} {mode} failed: {exc!r}")
                    rows.append({"preset": preset, "batch": batch, "mode": mode, "overlap": overlap,
                                 "error": repr(exc)})
                    if mode == "free":
                        raise
    finally:
        engine.stop()
        if client is not None:
            client.close()
    return rows


def _engine_run(engine, preset: str, batch: int, mode: str, context: int, new_tokens: int, overlap: bool,
                gen: torch.Generator, vocab: int, grammar) -> dict:
    """One batch through the engine (`run_batch`: timed from every row's first token to the last
    row's end). Constrained rows stop at the end of their document (GRAMMAR_COMPLETE) or at
    new_tokens, so tokens/s counts the tokens received, ms/step the engine steps taken."""
    from generation_service.engine.params import SamplingParams
    prompts = [tuple(torch.randint(0, vocab, (context,), generator=gen).tolist()) for _ in range(batch)]
    run = run_batch(engine, f"{preset}-{mode}-{overlap}-{batch}", prompts,
                    SamplingParams(max_new_tokens=new_tokens, ignore_eos=grammar is None), grammar=grammar,
                    timeout_s=300)
    w, steps = run.window, run.window.steps
    row = {"preset": preset, "batch": batch, "mode": mode, "overlap": overlap, "runner": "cuda_graph",
           "steps": steps, "graph_steps": w.graph_steps, "chained_steps": w.chained_steps,
           "ms_per_step": run.window_s / max(1, steps) * 1e3, "tokens_per_s": run.num_decoded / run.window_s,
           "tokens_decoded": run.num_decoded, "finish_reasons": run.finish_reasons, "errors": run.errors,
           "vocab_size": vocab}
    log(f"engine {preset} b={batch:3d} overlap={overlap!s:5s} {mode:11s} {row['ms_per_step']:8.3f} ms/step "
        f"{row['tokens_per_s']:9.1f} tok/s ({row['graph_steps']}/{steps} graph steps, "
        f"{row['chained_steps']} chained, {run.finish_reasons})")
    return row
