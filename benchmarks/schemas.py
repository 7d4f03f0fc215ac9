"""Real-world schemas per grammar backend: compile time, keywords not enforced, output validity.

Corpus: benchmarks/corpus.py (>= 20 schemas shipped by installed packages). Per backend
(xgrammar, llguidance) and schema, on a real tokenizer (default: Mistral v3, 32k):
- `compile_ms`: the backend's compile as grammar_service runs it (JSON Schema, any
  whitespace), in a worker process killed past `--compile-timeout` (xgrammar cannot be
  interrupted otherwise);
- `unenforced`: what the backend's keyword analysis reports (the guarantee report);
- validity over `--walks` sampled generations: **random walks under the backend's mask**,
  not the model (the built-in tiny-random model has random weights and a 32000-token
  vocabulary; its samples are random walks too, only slower). Each step samples among the
  allowed tokens: EOS with p=0.5 when allowed, else a structural token (quotes, brackets,
  digits, true/false/null) with p=0.6 when one is allowed, else uniformly. Every finished
  output is checked with structgen.schema_validation.validate_output; a violation of a
  keyword the backend did *not* report is counted in `unreported_violations` (must be 0:
  the guarantee report is honest);
- `fill_us`: batch_fill time per token along the walks (p50, p90), `first_fill_us`;
- validity over `--generations` sampled generations **with the built-in tiny-random model**
  (benchmarks/_generate.py): the in-process Engine and a real grammar_service subprocess,
  temperature 1.0, seeds 0..N-1, `--gen-max-tokens` new tokens, for each schema the backend
  compiled above; finished outputs valid / invalid, outputs cut by max tokens counted apart,
  and violations the stream's guarantee report does not explain (same check as the walks).
  `--no-generations` skips it.
Per backend: compile median/p90/max, errors, timeouts, keyword counts, validity totals;
per schema: `auto`'s choice (grammar_service.auto_choice.rank with measured compile times).

    .venv/bin/python benchmarks/schemas.py --machine ci-2core        # ~10 min on 2 cores
writes benchmarks/results/schemas-<machine>.json and prints a table.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import platform
import random
import sys
import time
from collections import Counter

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # tests/: the real tokenizers

from benchmarks._generate import PROMPT, judge, run_generations, summarize_generations  # noqa: E402
from benchmarks._harness import (  # noqa: E402
    WorkerProcess, default_machine, nearest_rank, utc_now, versions, write_result,
)
from benchmarks.corpus import load_corpus  # noqa: E402

BACKENDS = ("xgrammar", "llguidance")
STRUCTURAL_CHARS = set('"{}[],:0123456789.-')


# --- worker process: one backend, schemas one by one -----------------------------------------
class _Walker:
    def __init__(self, backend_name: str, tokenizer_name: str, vocab_size: int):
        import numpy as np
        from tokenizers import Tokenizer

        from grammar_service.backends import load_backend_class
        from grammar_service.tokenizer import load_tokenizer
        from real_tokenizers import tokenizer_dir

        folder = str(tokenizer_dir(tokenizer_name))
        self.data, _ = load_tokenizer(folder, vocab_size)
        self.backend = load_backend_class(backend_name)(self.data, num_compile_threads=1, num_fill_threads=1)
        self.tokenizer = Tokenizer.from_file(f"{folder}/tokenizer.json")
        self.np = np
        self.stop_ids = set(self.data.stop_token_ids)
        self.is_structural = np.zeros(vocab_size, dtype=bool)
        for token_id, piece in enumerate(self.data.encoded_vocab):
            text = piece.replace("\u2581", " ").replace("\u0120", " ").strip()
            self.is_structural[token_id] = bool(text) and (
                set(text) <= STRUCTURAL_CHARS or text in ("true", "false", "null"))

    def run(self, name: str, text: str, num_walks: int, max_tokens: int, seed: int, walk_budget_s: float) -> dict:
        from grammar_contract.spec import GrammarSpec
        from grammar_service.backends.base import GrammarCompileError

        spec = GrammarSpec("json_schema", text)
        unenforced = self.backend.unenforced_keywords(spec)
        result = {"schema": name, "unenforced": [[u.keyword, u.pointer] for u in unenforced]}
        started = time.perf_counter()
        try:
            compiled = self.backend.compile(spec)
        except GrammarCompileError as exc:
            result.update(compile_error=str(exc)[:300], compile_ms=(time.perf_counter() - started) * 1e3)
            return result
        result["compile_ms"] = (time.perf_counter() - started) * 1e3
        rng = random.Random(f"{seed}-{name}")
        walks, fill_s, first_fill_s = [], [], []
        deadline = time.perf_counter() + walk_budget_s
        for _ in range(num_walks):
            ids, finished, fills, problem = self._walk(compiled, rng, max_tokens, deadline)
            fill_s.extend(fills[1:])
            first_fill_s.extend(fills[:1])
            walk = {"num_tokens": len(ids), "finished": finished, "problem": problem}
            if finished:
                output = self.tokenizer.decode(ids, skip_special_tokens=False)
                walk.update(judge(text, output, [u.keyword for u in unenforced]))
            walks.append(walk)
        result.update(walks=walks, fill_us=[s * 1e6 for s in fill_s], first_fill_us=[s * 1e6 for s in first_fill_s])
        return result

    def _walk(self, compiled, rng: random.Random, max_tokens: int, deadline: float):
        np, backend = self.np, self.backend
        matcher = backend.new_matcher(compiled)
        masks = np.zeros((1, self.data.mask_words), dtype=np.int32)
        ids, fills = [], []
        for _ in range(max_tokens):
            if time.perf_counter() > deadline:
                return ids, False, fills, "walk time budget"
            started = time.perf_counter()
            backend.batch_fill([matcher], masks, [0])
            fills.append(time.perf_counter() - started)
            bits = np.unpackbits(masks[0].view(np.uint8), bitorder="little")[: self.data.vocab_size]
            allowed = np.flatnonzero(bits)
            if len(allowed) == 0:
                return ids, False, fills, "empty mask"
            stops = [t for t in allowed if t in self.stop_ids]
            structural = allowed[self.is_structural[allowed]]
            if stops and (rng.random() < 0.5 or len(allowed) == len(stops)):
                token = stops[0]
            elif len(structural) and rng.random() < 0.6:
                token = int(structural[rng.randrange(len(structural))])
            else:
                token = int(allowed[rng.randrange(len(allowed))])
            if not backend.batch_accept([matcher], [token])[0]:
                return ids, False, fills, f"token {token} allowed by the mask but refused"
            if token in self.stop_ids:
                return ids, True, fills, ""
            ids.append(token)
        return ids, False, fills, "max tokens"


def _worker(conn, backend_name: str, tokenizer_name: str, vocab_size: int) -> None:
    walker = _Walker(backend_name, tokenizer_name, vocab_size)
    conn.send("ready")
    while True:
        task = conn.recv()
        if task is None:
            return
        conn.send(walker.run(*task))


class _Pool:
    """One worker process per backend; a schema past its timeout kills and restarts it."""

    def __init__(self, backend: str, args):
        self.args = args
        self.worker = WorkerProcess(f"{backend} worker", _worker, (backend, args.tokenizer, args.vocab_size), 120)

    def run(self, name: str, text: str) -> dict:
        a = self.args
        self.worker.send((name, text, a.walks, a.max_tokens, a.seed, a.walk_timeout))
        budget = a.compile_timeout + a.walk_timeout + 10  # the walks stop themselves at walk_timeout
        if self.worker.conn.poll(budget):
            return self.worker.conn.recv()
        self.worker.kill()
        return {"schema": name, "timeout_s": a.compile_timeout,
                "compile_error": f"compile did not finish within {a.compile_timeout:g} s"}

    def close(self):
        self.worker.close()


# --- aggregation ---------------------------------------------------------------------------
def summarize(backend: str, rows: list[dict]) -> dict:
    compiled = [r["compile_ms"] for r in rows if "compile_error" not in r]
    walks = [w for r in rows for w in r.get("walks", [])]
    finished = [w for w in walks if w["finished"]]
    fills = [f for r in rows for f in r.get("fill_us", [])]
    first = [f for r in rows for f in r.get("first_fill_us", [])]
    keywords = Counter(k for r in rows for k, _ in r.get("unenforced", ()))
    return {
        "backend": backend,
        "num_schemas": len(rows),
        "num_compiled": len(compiled),
        "compile_errors": {r["schema"]: r["compile_error"] for r in rows if "compile_error" in r},
        "compile_ms": {"median": nearest_rank(compiled, 0.5), "p90": nearest_rank(compiled, 0.9),
                       "max": max(compiled, default=None), "total": sum(compiled)},
        "num_schemas_fully_enforced": sum(1 for r in rows if "unenforced" in r and not r["unenforced"]),
        "unenforced_keywords": dict(keywords.most_common()),
        "walks": {"num": len(walks), "finished": len(finished),
                  "valid": sum(1 for w in finished if w["valid"]),
                  "invalid": sum(1 for w in finished if not w["valid"]),
                  "unreported_violations": sum(len(w["unreported"]) for w in finished),
                  "mask_accept_mismatches": sum(1 for w in walks if "refused" in w["problem"]),
                  "empty_masks": sum(1 for w in walks if w["problem"] == "empty mask")},
        "fill_us": {"p50": nearest_rank(fills, 0.5), "p90": nearest_rank(fills, 0.9), "num": len(fills)},
        "first_fill_us": {"p50": nearest_rank(first, 0.5), "p90": nearest_rank(first, 0.9)},
    }


def auto_choice(by_backend: dict[str, dict]) -> dict:
    from grammar_contract.report import UnenforcedKeyword
    from grammar_service.auto_choice import Candidate, num_gaps, rank

    candidates = []
    for name, row in by_backend.items():
        unenforced = tuple(UnenforcedKeyword(k, p) for k, p in row["unenforced"]) if "unenforced" in row else ()
        candidates.append(Candidate(name, unenforced, row.get("compile_error", ""), 0))
    # measured speed decides ties here (the service ranks llguidance first: ms vs seconds)
    speed = sorted(candidates, key=lambda c: by_backend[c.backend].get("compile_ms", 1e12))
    candidates = [Candidate(c.backend, c.unenforced, c.error, speed.index(c)) for c in candidates]
    choice = rank(candidates)
    if choice.reason.startswith("auto: no backend"):
        return {"backend": None, "reason": choice.reason}
    chosen = by_backend[choice.backend]
    return {"backend": choice.backend, "reason": choice.reason, "compile_ms": chosen.get("compile_ms"),
            "gaps": {c.backend: num_gaps(c.unenforced) for c in candidates}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--machine", default=default_machine())
    parser.add_argument("--tokenizer", default="mistral_32k", choices=["mistral_32k", "tekken_131k"])
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--schemas", nargs="*", default=None, help="corpus names (default: all)")
    parser.add_argument("--walks", type=int, default=4, help="random walks per schema and backend")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--compile-timeout", type=float, default=30.0)
    parser.add_argument("--walk-timeout", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-schemas", type=int, default=None, help="only the first N corpus schemas")
    parser.add_argument("--generations", type=int, default=3, help="default-model generations per schema and backend")
    parser.add_argument("--gen-max-tokens", type=int, default=256, help="max_new_tokens of each generation")
    parser.add_argument("--no-generations", action="store_true", help="skip the default-model generations")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from real_tokenizers import VOCAB_SIZES

    args.vocab_size = VOCAB_SIZES[args.tokenizer]
    corpus = [s for s in load_corpus() if args.schemas is None or s.name in args.schemas][:args.max_schemas]
    started, load_at_start = time.time(), os.getloadavg()
    pools = {b: _Pool(b, args) for b in args.backends}
    rows: dict[str, dict[str, dict]] = {b: {} for b in args.backends}
    print(f"{'schema':26s} {'KiB':>6s} " + " ".join(f"{b + ' ms':>13s} {'gaps':>4s} {'ok/fin':>7s}" for b in args.backends))
    for schema in corpus:
        line = f"{schema.name:26s} {schema.size_bytes / 1024:6.0f} "
        for backend, pool in pools.items():
            row = rows[backend][schema.name] = pool.run(schema.name, schema.text)
            row["size_bytes"] = schema.size_bytes
            fin = [w for w in row.get("walks", []) if w["finished"]]
            ms = "error" if "compile_error" in row else f"{row['compile_ms']:.1f}"
            line += f"{ms:>13s} {len(row.get('unenforced', [])):4d} {sum(w['valid'] for w in fin):3d}/{len(fin):<3d} "
        print(line, flush=True)
    for pool in pools.values():
        pool.close()
    per_schema = {s.name: {b: rows[b][s.name] for b in args.backends} for s in corpus}
    if len(args.backends) > 1:
        for name, by_backend in per_schema.items():
            by_backend["auto"] = auto_choice(by_backend)
    summary = {b: summarize(b, list(rows[b].values())) for b in args.backends}
    if not args.no_generations and args.generations > 0:
        compiled = {b: {n for n, r in rows[b].items() if "compile_error" not in r} for b in args.backends}
        generated = run_generations(corpus, compiled, args.generations, args.gen_max_tokens)
        for b, by_schema in generated.items():
            summary[b]["generations"] = summarize_generations(by_schema)
            for name, row in by_schema.items():
                if not name.startswith("_"):
                    rows[b][name]["default_model"] = row
    for b, s in summary.items():
        c, w, f = s["compile_ms"], s["walks"], s["fill_us"]
        print(f"{b:11s} compiled {s['num_compiled']}/{s['num_schemas']}  compile ms median {c['median']:.1f} "
              f"p90 {c['p90']:.1f} max {c['max']:.1f}  walks valid {w['valid']}/{w['finished']} finished "
              f"(unreported violations {w['unreported_violations']})  fill us p50 {f['p50'] or 0:.0f} p90 {f['p90'] or 0:.0f}")
        if "generations" in s:
            g = s["generations"]
            print(f"{'':11s} tiny-random model: {g['num']} generations, valid {g['valid']}/{g['finished']} finished, "
                  f"{g['cut_by_max_tokens']} cut by max tokens, {g['errors']} errors, "
                  f"unreported violations {g['unreported_violations']}")
    for by_backend in per_schema.values():  # keep the file readable: drop the raw timing lists
        for row in by_backend.values():
            for key in ("fill_us", "first_fill_us"):
                if key in row:
                    row[key] = {"p50": nearest_rank(row[key], 0.5), "p90": nearest_rank(row[key], 0.9)}
    out = write_result(args.out or ROOT / "benchmarks" / "results" / f"schemas-{args.machine}.json", {
        "benchmark": "schemas", "machine": args.machine, "cpu_count": os.cpu_count(),
        "platform": platform.platform(), "tokenizer": args.tokenizer, "vocab_size": args.vocab_size,
        "versions": versions(("xgrammar", "llguidance", "jsonschema")),
        "validity_method": "random walks under each backend's mask (see the module docstring)",
        "walks_per_schema": args.walks, "max_tokens": args.max_tokens,
        "generation_method": None if args.no_generations or args.generations <= 0 else (
            "built-in tiny-random model (random weights, 32k Mistral tokenizer), in-process Engine on CPU + "
            "grammar_service subprocess; temperature 1.0, seeds 0..N-1, prompt "
            f"{PROMPT!r}; cut = finish_reason max_tokens"),
        "generations_per_schema": 0 if args.no_generations else args.generations,
        "generation_max_new_tokens": args.gen_max_tokens,
        "compile_timeout_s": args.compile_timeout, "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(), "wall_s": time.time() - started,
        "created": utc_now(),
        "corpus": [{"name": s.name, "package": s.package, "path": s.path, "size_bytes": s.size_bytes} for s in corpus],
        "summary": summary, "schemas": per_schema})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
