"""`structgen`: one command line for serving, the grammar sidecar, generating and the demo.

    structgen serve     generation_service (+ a supervised grammar_service child)
    structgen grammar   grammar_service alone (the Kubernetes sidecar)
    structgen health    exit 0 if a server (either process) reports SERVING; alias grammar-health
    structgen generate  stream one completion from a running server to stdout
    structgen demo      start a server, run a JSON-Schema request, validate it, stop
    structgen fetch-model  fetch a built-in model into the cache now (make setup runs it)
    structgen calibrate-self-spec  choose the layers self-speculative drafts skip (once per model)

Each subcommand lives in structgen/commands/ and imports heavy modules (torch) only when run.
"""
from __future__ import annotations

import argparse
import os
import sys

from structgen.commands import calibrate_self_spec, demo, fetch_model, generate, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="structgen", description=__doc__.split("\n\n")[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_parser(subparsers)
    grammar = subparsers.add_parser(
        "grammar", add_help=False, help="run grammar_service alone (flags go to it; --help lists them)")
    grammar.set_defaults(run=_run_grammar)
    health = subparsers.add_parser("health", aliases=["grammar-health"],
                                   help="exit 0 if the server at --address answers grpc.health.v1 SERVING")
    health.add_argument("--address", required=True, help="e.g. unix:///run/structgen/grammar.sock")
    health.add_argument("--timeout-s", type=float, default=3.0)
    health.set_defaults(run=_run_grammar_health)
    generate.add_parser(subparsers)
    demo.add_parser(subparsers)
    fetch_model.add_parser(subparsers)
    calibrate_self_spec.add_parser(subparsers)
    for subparser in subparsers.choices.values():  # so a bad flag is reported with its usage
        subparser.set_defaults(parser=subparser)
    return parser


def _run_grammar_health(args: argparse.Namespace, _rest) -> int:
    from structgen.supervisor import wait_healthy
    if wait_healthy(args.address, args.timeout_s):
        print(f"{args.address}: SERVING")
        return 0
    print(f"{args.address}: not SERVING within {args.timeout_s:g} s (down, starting or draining)", file=sys.stderr)
    return 1


def _run_grammar(args: argparse.Namespace, rest: list[str]) -> int:
    import os

    from generation_service.settings import SERVE_SETTINGS
    from grammar_service.server import main as grammar_main
    from grammar_service.settings import GRAMMAR_SETTINGS
    from structgen.settings import unknown_variables
    for name in unknown_variables(os.environ, SERVE_SETTINGS, GRAMMAR_SETTINGS):
        print(f"structgen grammar: warning: {name} is set but no structgen setting reads it", file=sys.stderr)
    return grammar_main(rest) or 0


def disable_grpc_fork_handlers() -> None:
    """Turn off gRPC core's fork handlers; call before grpc is first imported.

    Our processes fork to exec a child (subprocess, multiprocessing), or before they have any
    gRPC object (the grammar template, grammar_service's worker forker): a child never uses
    gRPC state it inherited. gRPC's handlers still run around each fork and, when a fork meets
    gRPC threads starting up, have left a parent's poller with a closed epoll descriptor (the
    process then aborts). An explicit setting in the environment is kept."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")


def passive_cpu_waits() -> None:
    """OpenMP threads that wait for work sleep instead of spinning; call before torch is imported.

    On CPU a forward's parallel regions wait for every torch thread; with threads spinning on all
    cores, a compile worker that takes one core leaves a descheduled thread behind every region:
    tokens came far slower while a grammar compiled, and no faster alone
    (tests/integration/test_real_schemas.py's slow-compile test on 2 cores). An explicit setting
    in the environment is kept."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before a command took over SIGINT (start-up imports)
        # serve stops cleanly on SIGINT (exit 0) whenever it comes; other commands are interrupted
        return 0 if argv[:1] == ["serve"] else generate.EXIT_INTERRUPTED


def _main(argv: list[str]) -> int:
    disable_grpc_fork_handlers()
    passive_cpu_waits()
    parser = build_parser()
    if argv[:1] == ["grammar"]:  # everything after `grammar` belongs to grammar_service
        return _run_grammar(argparse.Namespace(), argv[1:])
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.run(args, [])


if __name__ == "__main__":
    sys.exit(main())
