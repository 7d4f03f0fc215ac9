"""`structgen generate`: stream one completion from a running server to stdout.

The text goes to stdout as it arrives; the guarantee report, finish reason, usage and the
server's schema validation go to stderr with --verbose. A failed call prints
"error: <STATUS>: <message>" to stderr and exits 1; an output the server found invalid
against its JSON Schema exits 3.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

DEFAULT_SERVER = "localhost:50051"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="stream a completion from a server",
                                   description=__doc__)
    parser.add_argument("prompt", help="prompt text ('-' reads standard input)")
    parser.add_argument("--server", default=None,
                        help=f"server address (default $STRUCTGEN_SERVER or {DEFAULT_SERVER})")
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE", help="JSON Schema file")
    constraint.add_argument("--regex", metavar="RE", help="regular expression the output matches")
    constraint.add_argument("--lark", metavar="FILE", help="Lark grammar file")
    constraint.add_argument("--choice", action="append", metavar="TEXT", help="an allowed output (repeat)")
    constraint.add_argument("--json-object", action="store_true", help="any JSON object")
    parser.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
    parser.add_argument("--max-tokens", type=int, default=0, help="0 = server default")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the server's)")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeat)")
    parser.add_argument("--compact", action="store_true", help="JSON without free whitespace")
    parser.add_argument("--strict", action="store_true", help="refuse schemas the grammar cannot fully enforce")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--token", default=None, help="bearer token (default $STRUCTGEN_TOKEN)")
    parser.add_argument("-v", "--verbose", action="store_true", help="report, usage and validation on stderr")
    parser.set_defaults(run=run)


def request_options(args: argparse.Namespace) -> dict:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    options: dict = {"messages": [{"role": "user", "content": prompt}]} if args.chat else {"prompt": prompt}
    if args.json_schema:
        options["json_schema"] = pathlib.Path(args.json_schema).read_text()
    elif args.lark:
        options["lark"] = pathlib.Path(args.lark).read_text()
    elif args.regex is not None:
        options["regex"] = args.regex
    elif args.choice:
        options["choices"] = args.choice
    elif args.json_object:
        options["json_object"] = True
    options.update(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, stop=args.stop, compact=args.compact,
                   strict=args.strict)
    return options


def run(args: argparse.Namespace, _rest) -> int:
    from structgen_client import Client, StructgenError
    address = args.server or os.environ.get("STRUCTGEN_SERVER") or DEFAULT_SERVER
    try:
        options = request_options(args)
    except OSError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    last = None
    try:
        token = args.token or os.environ.get("STRUCTGEN_TOKEN")
        with Client(address, timeout=args.timeout, token=token) as client:
            for chunk in client.generate(**options):
                if chunk.guarantee and args.verbose:
                    print(f"[guarantee] {chunk.guarantee}", file=sys.stderr)
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
    except StructgenError as error:
        print(f"\nerror: {error.code.name}: {error.details}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    if args.verbose and last is not None:
        print(f"[finish] {last.finish_reason} {last.usage}", file=sys.stderr)
    if last is not None and last.validation is not None:
        if args.verbose or not last.validation.valid:
            print(f"[validation] {last.validation}", file=sys.stderr)
        if not last.validation.valid:
            return 3
    return 0
