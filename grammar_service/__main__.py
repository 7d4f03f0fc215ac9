"""`python -m grammar_service [--listen unix:///path.sock] ...`"""
import sys

from grammar_service.server import main

sys.exit(main())
