"""`structgen demo`: start a server with the default model on a free port, send a
JSON-Schema request, stream the answer, validate it with jsonschema, print the result, stop.

Exits 0 only if the output is valid JSON that validates against the schema.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "curious", "sleepy"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}
# Sent as a chat message: the default model is an instruct model and answers in its template.
QUESTION = "Describe a fictional person as JSON with a name, an age and a mood (happy, curious or sleepy)."
READY_MARK = "listening on "


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="start a server, run a JSON-Schema request, validate it",
                                   description=__doc__)
    parser.add_argument("--model", default=None, help="model for the demo server (default: built-in)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("-v", "--verbose", action="store_true", help="show the server's log")
    parser.set_defaults(run=run)


def start_server(model: str | None, timeout_s: float, log_file) -> tuple[subprocess.Popen, str]:
    """`structgen serve --port 0` as a child; returns it and its address once it listens."""
    argv = [sys.executable, "-m", "structgen.cli", "serve", "--port", "0", "--host", "127.0.0.1"]
    argv += ["--model", model] if model else []
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log_file, text=True,
                               env=os.environ.copy())
    found: list[str] = []
    ready = threading.Event()

    def read_stdout() -> None:
        for line in process.stdout:
            if READY_MARK in line and not found:
                found.append(line.split(READY_MARK, 1)[1].split()[0])
                ready.set()
        ready.set()  # stdout closed: the server exited

    threading.Thread(target=read_stdout, daemon=True).start()
    if not ready.wait(timeout_s) or not found:
        process.kill()
        raise RuntimeError(f"the demo server did not start (exit code {process.poll()})")
    return process, found[0]


def _log_tail(log_file, num_chars: int = 4000) -> str:
    if log_file is None:
        return ""
    log_file.flush()
    with open(log_file.name, errors="replace") as file:
        return file.read()[-num_chars:]


def run(args, _rest) -> int:
    import jsonschema

    from structgen_client import Client, StructgenError
    print("demo: starting a server with the default model ...", flush=True)
    log_file = None if args.verbose else tempfile.NamedTemporaryFile("w+", prefix="structgen-demo-", suffix=".log")
    try:
        process, address = start_server(args.model, args.startup_timeout_s, log_file)
    except RuntimeError as error:
        print(f"demo: FAILED: {error}\n{_log_tail(log_file)}", file=sys.stderr)
        return 1
    try:
        print(f"demo: server at {address}\ndemo: question {QUESTION!r}\ndemo: schema {json.dumps(SCHEMA)}\n"
              "demo: output: ", end="", flush=True)
        text, last = [], None
        with Client(address, timeout=300) as client:
            for chunk in client.generate(messages=[{"role": "user", "content": QUESTION}], json_schema=SCHEMA,
                                         max_tokens=args.max_tokens, compact=True):
                text.append(chunk.text)
                print(chunk.text, end="", flush=True)
                last = chunk
        output = "".join(text)
        print(f"\ndemo: finish reason {last.finish_reason}, usage {last.usage}")
        value = json.loads(output)
        jsonschema.validate(value, SCHEMA)
        print(f"demo: VALID against the schema: {json.dumps(value, ensure_ascii=False)}")
        return 0
    except (StructgenError, ValueError, jsonschema.ValidationError) as error:
        print(f"\ndemo: FAILED: {error}\n{_log_tail(log_file)}", file=sys.stderr)
        return 1
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
        print(f"demo: server stopped (exit code {process.poll()})")
        if log_file is not None:
            log_file.close()
