"""Close on budget: are JSON-Schema outputs complete and valid at small max_tokens?

Through a real `structgen serve` (the built-in default model, CPU) over gRPC with the Python
client, every output validated by the server against its full schema:
1. each schema's shortest output, in tokens: a request with max_tokens 1 is refused
   (INVALID_ARGUMENT) naming it ("set max_tokens to at least N");
2. the first `--schemas` schemas of the wide corpus (benchmarks/corpus.py, its order) whose
   shortest output is `--min-shortest`..`--max-shortest` tokens and whose guarantee report
   lists no unenforced keyword (those can make an output invalid however it closes);
3. per schema, `--seeds` sampled requests (temperature 1.0) at max_tokens ceil(1.2 N), 2 N and
   4 N, and one request with max_tokens unset (the server's default, 256).
Reported per budget: outputs valid / invalid / cut (finish max_tokens) / refused / other
errors, and how many ended `budget_closed` (the masks steered them to close).

    .venv/bin/python benchmarks/budget_close.py --machine ci-2core
    # the same requests against another server (e.g. code before closing on budget), reusing
    # the schemas and shortest outputs of a run:
    .venv/bin/python benchmarks/budget_close.py --server HOST:PORT --schemas-from RESULT.json --out OTHER.json
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import pathlib
import re
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "clients" / "python"))

from benchmarks._harness import (  # noqa: E402
    ServeProcess, code_commit, command_line, default_machine, log, serve_command, write_result,
)
from benchmarks.corpus import load_wide_corpus  # noqa: E402
from structgen_client import Client  # noqa: E402
from structgen_client.errors import InvalidArgumentError, StructgenError  # noqa: E402

PROMPT = "The {name} configuration as JSON:\n"
FACTORS = (1.2, 2.0, 4.0)
_AT_LEAST = re.compile(r"set max_tokens to at least (\d+)")


def shortest_output(client: Client, text: str) -> int | None:
    """The schema's shortest output in tokens, as the server's refusal of max_tokens 1 names it."""
    try:
        client.generate_text("x", json_schema=text, max_tokens=1)
    except InvalidArgumentError as exc:
        found = _AT_LEAST.search(str(exc))
        return int(found.group(1)) if found else None
    except StructgenError:
        return None
    return 1


def pick_schemas(client: Client, args) -> list[dict]:
    picked = []
    for schema in load_wide_corpus():
        if len(picked) == args.schemas:
            break
        if schema.size_bytes > args.max_schema_bytes:
            continue
        n = shortest_output(client, schema.text)
        if n is None or not args.min_shortest <= n <= args.max_shortest:
            continue
        unenforced = unenforced_keywords(client, schema.text, n)
        log(f"{schema.name}: shortest output {n} tokens; unenforced {unenforced or 'none'}")
        if not unenforced:  # a keyword the grammar does not enforce can make an output invalid
            picked.append({"name": schema.name, "text": schema.text, "shortest": n})
    return picked


def unenforced_keywords(client: Client, text: str, max_tokens: int) -> list[str]:
    """The keywords the guarantee report (the stream's first message) lists as not enforced."""
    with client.generate("x", json_schema=text, max_tokens=max_tokens) as stream:
        for chunk in stream:
            if chunk.guarantee is not None:
                return [f"{u.keyword} at {u.pointer}" for u in chunk.guarantee.unenforced]
    return []


def one_request(client: Client, schema: dict, max_tokens: int | None, seed: int) -> dict:
    row = {"schema": schema["name"], "max_tokens": max_tokens, "seed": seed}
    try:
        done = client.generate_text(PROMPT.format(name=schema["name"]), json_schema=schema["text"],
                                    max_tokens=max_tokens or 0, temperature=1.0, seed=seed)
    except InvalidArgumentError as exc:
        return {**row, "outcome": "refused", "error": str(exc)[:300]}
    except StructgenError as exc:
        return {**row, "outcome": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
    row.update(finish_reason=done.finish_reason, num_tokens=len(done.token_ids))
    if done.finish_reason == "max_tokens":
        row.update(outcome="cut", tail=done.text[-60:])
    else:
        status = done.validation.status if done.validation is not None else "missing"
        row.update(outcome="valid" if status == "valid" else "invalid", validation=status)
        if status != "valid":
            row["errors"] = [f"{path}: {message}"[:200] for path, message in done.validation.errors][:3]
    return row


def summarize(rows: list[dict]) -> dict:
    out = {}
    for label in [f"{f}x" for f in FACTORS] + ["unset"]:
        group = [r for r in rows if r["budget"] == label]
        counts = {k: sum(1 for r in group if r["outcome"] == k) for k in ("valid", "invalid", "cut", "refused", "error")}
        counts["budget_closed"] = sum(1 for r in group if r.get("finish_reason") == "budget_closed")
        out[label] = {"requests": len(group), **counts}
    return out


def run(client: Client, schemas: list[dict], seeds: int, workers: int) -> list[dict]:
    jobs = []
    for schema in schemas:
        for factor in FACTORS:
            budget = math.ceil(factor * schema["shortest"])
            jobs += [(schema, budget, f"{factor}x", seed) for seed in range(seeds)]
        jobs.append((schema, None, "unset", 0))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(one_request, client, schema, budget, seed) for schema, budget, _, seed in jobs]
        rows = [{**f.result(), "budget": label} for f, (_, _, label, _) in zip(futures, jobs)]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", help="address of a running server (default: start one)")
    parser.add_argument("--schemas-from", help="a result file whose schemas and shortest outputs to reuse")
    parser.add_argument("--schemas", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--min-shortest", type=int, default=5)
    parser.add_argument("--max-shortest", type=int, default=60)
    parser.add_argument("--max-schema-bytes", type=int, default=200_000)
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--machine", default=default_machine())
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    server = None
    if args.server is None:
        folder = pathlib.Path(tempfile.mkdtemp(prefix="structgen-bench-budget-"))
        server = ServeProcess(serve_command("--port", "0"), folder / "serve.log")
        args.server = server.address
    started = time.perf_counter()
    try:
        with Client(args.server, timeout=1800) as client:
            client.wait_ready(600)
            if args.schemas_from:
                schemas = json.loads(pathlib.Path(args.schemas_from).read_text())["schemas"]
                by_name = {s.name: s.text for s in load_wide_corpus()}
                schemas = [{**s, "text": by_name[s["name"]]} for s in schemas]
            else:
                schemas = pick_schemas(client, args)
            rows = run(client, schemas, args.seeds, args.workers)
    finally:
        if server is not None:
            server.stop()
    summary = summarize(rows)
    log(json.dumps(summary, indent=1))
    out = args.out or ROOT / "benchmarks" / "results" / f"budget_close-{args.machine}.json"
    write_result(out, {"command": command_line("benchmarks/budget_close.py", argv), "code_commit": code_commit(),
                       "machine": args.machine, "wall_s": round(time.perf_counter() - started, 1),
                       "schemas": [{"name": s["name"], "shortest": s["shortest"]} for s in schemas],
                       "summary": summary, "requests": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
