"""`structgen generate`: stream one completion from a running server to stdout.

The text goes to stdout as it arrives; the guarantee report, finish reason, usage and the
server's schema validation go to stderr with --verbose. With --reasoning the model reasons
first: its reasoning streams to stderr, what follows it to stdout. With --tools (a JSON file:
a list of tools, each {"name", "description", "parameters"}) the prompt is a chat turn and
each parsed tool call is printed to stdout as one JSON line {"id", "name", "arguments"}.
A failed call prints "error: <STATUS>: <message>" to stderr and exits 1; an output or a tool
call the server found invalid against its JSON Schema exits 3, as does an output that
max_tokens cut short inside a JSON document or a tool call; a bad flag exits 2; Ctrl-C
cancels the request and exits 130.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

DEFAULT_SERVER = "localhost:50051"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def bounded(kind: type, low: float, high: float | None = None, *, open_low: bool = False):
    """An argparse type: ``kind`` in [low, high] (or (low, high] with open_low)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        too_low = value <= low if open_low else value < low
        if too_low or (high is not None and value > high):
            bounds = f"{'>' if open_low else '>='} {low}" + (f" and <= {high}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value
    return parse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="stream a completion from a server",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", help="prompt text ('-' reads standard input)")
    parser.add_argument("--server", default=None,
                        help=f"server address (default $STRUCTGEN_SERVER or {DEFAULT_SERVER})")
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE", help="JSON Schema file the output validates against")
    constraint.add_argument("--regex", metavar="RE", help="regular expression the output matches")
    constraint.add_argument("--lark", metavar="FILE", help="Lark grammar file")
    constraint.add_argument("--structural-tag", metavar="FILE",
                            help="structural tag file (JSON): free text with constrained regions")
    constraint.add_argument("--choice", action="append", metavar="TEXT", help="an allowed output (repeat)")
    constraint.add_argument("--json-object", action="store_true", help="any JSON object")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as one user message, formatted by the model's chat template")
    parser.add_argument("--tools", metavar="FILE",
                        help="JSON file with a list of tools the model may call (implies --chat)")
    parser.add_argument("--tool-choice", default=None, metavar="CHOICE",
                        help="none, auto, required, or a tool's name (default: auto with --tools)")
    parser.add_argument("--reasoning", action=argparse.BooleanOptionalAction, default=None,
                        help="let the model reason first (its reasoning goes to stderr); --no-reasoning turns "
                             "the chat template's reasoning off (default: the template's)")
    parser.add_argument("--reasoning-max-tokens", type=bounded(int, 0), default=None, metavar="N",
                        help="with --reasoning: at most N reasoning tokens, then the answer is forced")
    parser.add_argument("--max-tokens", type=bounded(int, 0), default=0,
                        help="most tokens to generate (default 0 = the server's default)")
    parser.add_argument("--temperature", type=bounded(float, 0), default=None,
                        help="0 = greedy (default: the server's)")
    parser.add_argument("--top-k", type=bounded(int, 0), default=None,
                        help="sample from the k most likely tokens, 0 = off (default: the server's)")
    parser.add_argument("--top-p", type=bounded(float, 0, 1, open_low=True), default=None,
                        help="nucleus sampling mass in (0, 1] (default: the server's)")
    parser.add_argument("--seed", type=bounded(int, 0), default=None, help="sampling seed (default: random)")
    _add_logits_flags(parser)
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop when the output contains TEXT (repeat)")
    parser.add_argument("--compact", action="store_true", help='JSON with "," and ":" and no whitespace '
                        '(default: single-line JSON, ", " and ": ")')
    parser.add_argument("--max-whitespace", type=bounded(int, 0), default=None, metavar="N",
                        help="JSON: whitespace where the model puts it, at most N characters in a row")
    parser.add_argument("--any-whitespace", action="store_true",
                        help="JSON: whitespace where the model puts it, uncapped (unless --max-whitespace)")
    parser.add_argument("--strict", action="store_true", help="refuse schemas the grammar cannot fully enforce")
    parser.add_argument("--timeout", type=bounded(float, 0, open_low=True), default=None,
                        help="deadline in seconds (default: none)")
    parser.add_argument("--token", default=None, help="bearer token (default $STRUCTGEN_TOKEN)")
    parser.add_argument("-v", "--verbose", action="store_true", help="report, usage and validation on stderr")
    parser.set_defaults(run=run)


def _add_logits_flags(parser: argparse.ArgumentParser) -> None:
    """The logits processing of the request's SamplingParams (OpenAI's ranges); off when unset."""
    parser.add_argument("--frequency-penalty", type=bounded(float, -2, 2), default=None, metavar="X",
                        help="minus X per time a token was generated, in [-2, 2]")
    parser.add_argument("--presence-penalty", type=bounded(float, -2, 2), default=None, metavar="X",
                        help="minus X for every token generated at least once, in [-2, 2]")
    parser.add_argument("--repetition-penalty", type=bounded(float, 0, 10, open_low=True), default=None,
                        metavar="X", help="prompt and output tokens' logits / X (negative ones x X), in (0, 10]")
    parser.add_argument("--logit-bias", type=_logit_bias, action="append", default=[], metavar="ID=BIAS",
                        help="add BIAS in [-100, 100] to token ID's logit (repeat)")
    parser.add_argument("--min-p", type=bounded(float, 0, 1), default=None,
                        help="drop tokens below min-p x the top token's probability, in [0, 1]")
    parser.add_argument("--min-tokens", type=bounded(int, 0), default=None, metavar="N",
                        help="no end-of-sequence, stop token or stop string before N tokens")


def _logit_bias(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        pair = int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS, e.g. 42=-100, got {text!r}") from None
    if not -100 <= pair[1] <= 100:
        raise argparse.ArgumentTypeError(f"the bias must be in [-100, 100], got {text}")
    return pair


def _read_tools(path: str) -> list:
    """The --tools file: a JSON list of tools (OpenAI's {"type": "function", ...} shape too)."""
    try:
        tools = json.loads(pathlib.Path(path).read_text())
    except ValueError as error:
        raise OSError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and "name" in t.get("function", t) for t in tools):
        raise OSError(f"{path}: expected a JSON list of tools, each with a name")
    return tools


def request_options(args: argparse.Namespace) -> dict:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    chat = args.chat or args.tools is not None
    options: dict = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    if args.tools is not None:
        options["tools"] = _read_tools(args.tools)
    if args.tool_choice is not None:
        options["tool_choice"] = args.tool_choice
    if args.reasoning is not None or args.reasoning_max_tokens is not None:
        options.update(reasoning=args.reasoning is not False, reasoning_max_tokens=args.reasoning_max_tokens)
    if args.json_schema:
        options["json_schema"] = pathlib.Path(args.json_schema).read_text()
    elif args.lark:
        options["lark"] = pathlib.Path(args.lark).read_text()
    elif args.structural_tag:
        options["structural_tag"] = pathlib.Path(args.structural_tag).read_text()
    elif args.regex is not None:
        options["regex"] = args.regex
    elif args.choice:
        options["choices"] = args.choice
    elif args.json_object:
        options["json_object"] = True
    options.update(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, stop=args.stop, compact=args.compact,
                   max_whitespace=args.max_whitespace, any_whitespace=args.any_whitespace, strict=args.strict,
                   frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
                   repetition_penalty=args.repetition_penalty, logit_bias=dict(args.logit_bias) or None,
                   min_p=args.min_p, min_tokens=args.min_tokens)
    return options


class _Output:
    """stdout for the streamed text, remembering whether a line is left open."""

    def __init__(self) -> None:
        self.line_open = False

    def write(self, text: str) -> None:
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
            self.line_open = not text.endswith("\n")

    def end_line(self) -> None:
        if self.line_open:
            self.write("\n")


def run(args: argparse.Namespace, _rest) -> int:
    from structgen_client import Client, StructgenError
    address = args.server or os.environ.get("STRUCTGEN_SERVER") or DEFAULT_SERVER
    try:
        options = request_options(args)
    except OSError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.reasoning is False and args.reasoning_max_tokens is not None:
        print("error: --reasoning-max-tokens needs --reasoning", file=sys.stderr)
        return 2
    out, last, calls = _Output(), None, []
    try:
        token = args.token or os.environ.get("STRUCTGEN_TOKEN")
        with Client(address, timeout=args.timeout, token=token) as client:
            for chunk in client.generate(**options):
                if chunk.guarantee and args.verbose:
                    print(f"[guarantee] {chunk.guarantee}", file=sys.stderr)
                if chunk.reasoning_text:
                    sys.stderr.write(chunk.reasoning_text)
                    sys.stderr.flush()
                out.write(chunk.text)
                for call in chunk.tool_calls:
                    out.end_line()
                    out.write(json.dumps({"id": call.id, "name": call.name,
                                          "arguments": call.parsed_arguments}, ensure_ascii=False) + "\n")
                    calls.append(call)
                last = chunk
    except StructgenError as error:
        out.end_line()
        print(f"error: {error.code.name}: {error.details}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # leaving the client closed its channel: the server cancels the request
        out.end_line()
        return EXIT_INTERRUPTED
    out.end_line()
    if args.verbose and last is not None:
        print(f"[finish] {last.finish_reason} {last.usage}", file=sys.stderr)
    invalid_calls = [call for call in calls if call.validation is not None and not call.validation.valid]
    for call in invalid_calls:
        print(f"[tool call {call.id} {call.name}] {call.validation}", file=sys.stderr)
    validation = last.validation if last is not None else None
    if validation is not None and (args.verbose or not (validation.valid or validation.truncated)):
        print(f"[validation] {validation}", file=sys.stderr)
    if last is not None and _report_cut(last):
        return 3
    return 3 if invalid_calls or (validation is not None and not validation.valid) else 0


def _report_cut(last) -> bool:
    """Says so on stderr when max_tokens cut a tool call or the JSON document short."""
    cut = ("a tool call" if last.incomplete_tool_call else
           "the JSON document" if last.validation is not None and last.validation.truncated else "")
    if cut:
        tokens = last.usage.completion_tokens if last.usage is not None else "max"
        print(f"error: {cut} was cut short at {tokens} tokens (max_tokens); raise --max-tokens to let it finish",
              file=sys.stderr)
    return bool(cut)
