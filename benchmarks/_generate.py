"""Output validity over sampled generations with the built-in tiny-random model (benchmarks/schemas.py).

The in-process Engine (CPU, model "tiny-random") with a real grammar_service subprocess on a
unix socket, started as the engine integration tests start it, with the service's defaults
(compile_timeout_s 10, max_grammar_bytes 1 MiB: its refusals count as `errors`). Per backend, every schema
gets `num` requests (temperature 1.0, seeds 0..num-1, GrammarSpec(backend=<name>)); all of
a backend's requests are submitted at once and batched by the engine. Each output that
finished (EOS or grammar complete) is validated with structgen.schema_validation; an output
cut by max_new_tokens is counted apart (it is not complete JSON, neither valid nor
invalid); a violation of a keyword the stream's guarantee report did not list is counted in
`unreported_violations`, as the random walks do (reported_keywords + unexplained_violations).
"""
from __future__ import annotations

import pathlib
import shutil
import tempfile
import time
from typing import Iterable

PROMPT = "The {name} configuration as JSON:\n"


def reported_keywords(keywords: Iterable[str]) -> set[str]:
    """The keywords a guarantee report covers: one report of `if` covers the conditional."""
    reported = set(keywords)
    return reported | ({"then", "else"} if "if" in reported else set())


def judge(schema_text: str, output: str, unenforced: Iterable[str]) -> dict:
    """A finished output: valid?, its violations' schema pointers, and those the report does not explain."""
    from structgen.schema_validation import unexplained_violations, validate_output

    check = validate_output(schema_text, output)
    return {"valid": check.valid, "violations": [i.schema_pointer for i in check.issues][:10],
            "unreported": [] if check.valid else unexplained_violations(schema_text, output,
                                                                         reported_keywords(unenforced))}


def run_generations(corpus, compiled: dict[str, set[str]], num: int, max_new_tokens: int,
                    max_batch: int = 32, timeout_s: float = 600) -> dict[str, dict[str, dict]]:
    """{backend: {schema: row}} for the schemas each backend compiled (`compiled[backend]`)."""
    from generation_service.engine.events import FinishReason
    from generation_service.engine.params import GenerationRequest, SamplingParams
    from grammar_contract.spec import GrammarSpec
    from tests.integration.test_engine_support import collect, make_engine, start_grammar_service

    folder = pathlib.Path(tempfile.mkdtemp(prefix="structgen-bench-gen-"))
    service = start_grammar_service(folder, "bench-grammar")
    engine = None
    rows: dict[str, dict[str, dict]] = {}
    try:
        engine = make_engine(service.address, model="tiny-random", max_batch=max_batch)
        for backend, names in compiled.items():
            rows[backend] = {}
            started = time.perf_counter()
            streams = {}
            for schema in corpus:
                if schema.name not in names:
                    continue
                prompt = tuple(engine.tokenizer.encode(PROMPT.format(name=schema.name)))
                grammar = GrammarSpec("json_schema", schema.text, backend=backend)
                streams[schema.name] = [engine.submit(GenerationRequest(
                    f"{backend}-{schema.name}-{seed}", prompt,
                    SamplingParams(temperature=1.0, seed=seed, max_new_tokens=max_new_tokens), grammar=grammar))
                    for seed in range(num)]
            for schema in corpus:
                if schema.name not in streams:
                    continue
                gens, report = [], None
                for seed, stream in enumerate(streams[schema.name]):
                    result = collect(stream, timeout_s=timeout_s)
                    report = report or result.guarantee
                    gen = {"seed": seed, "num_tokens": len(result.token_ids),
                           "finish_reason": result.finish_reason.value if result.finish_reason else None}
                    if result.error is not None:
                        gen["error"] = f"{getattr(result.error, 'status', '')}: {result.error}"[:300]
                    elif result.finish_reason in (FinishReason.STOP_TOKEN, FinishReason.GRAMMAR_COMPLETE,
                                                  FinishReason.BUDGET_CLOSED):
                        unenforced = [u.keyword for u in result.guarantee.unenforced] if result.guarantee else []
                        gen.update(judge(schema.text, result.text, unenforced))
                    else:
                        gen["cut"] = True
                        gen["tail"] = result.text[-80:]
                    gens.append(gen)
                rows[backend][schema.name] = {
                    "generations": gens,
                    "report_backend": report.backend if report else None,
                    "report_unenforced": [[u.keyword, u.pointer] for u in report.unenforced] if report else None,
                    "service_compile_ms": report.compile_ms if report else None}
            rows[backend]["_wall_s"] = time.perf_counter() - started
    finally:
        if engine is not None:
            engine.stop()
        service.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def summarize_generations(rows: dict[str, dict]) -> dict:
    gens = [g for name, row in rows.items() if not name.startswith("_") for g in row["generations"]]
    finished = [g for g in gens if "valid" in g]
    return {"num_schemas": sum(1 for n in rows if not n.startswith("_")), "num": len(gens),
            "finished": len(finished), "valid": sum(1 for g in finished if g["valid"]),
            "invalid": sum(1 for g in finished if not g["valid"]),
            "cut_by_max_tokens": sum(1 for g in gens if g.get("cut")),
            "errors": sum(1 for g in gens if "error" in g),
            "unreported_violations": sum(len(g["unreported"]) for g in finished),
            "outputs_with_unreported_violations": sum(1 for g in finished if g["unreported"]),
            "wall_s": rows.get("_wall_s")}
