"""`python -m grammar_service [--listen unix:///path.sock] ...`"""
import sys

from structgen.cli import disable_grpc_fork_handlers

disable_grpc_fork_handlers()  # NOTE: before grammar_service.server imports grpc

from grammar_service.server import main  # noqa: E402

sys.exit(main())
