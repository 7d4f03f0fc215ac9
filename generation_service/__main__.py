"""`python -m generation_service [flags]` is `structgen serve [flags]`."""
import sys

from structgen.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
