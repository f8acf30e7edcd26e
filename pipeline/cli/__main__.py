"""`python -m pipeline.cli ...`: the `pipeline` command, as earlier releases ran it."""

import sys

from pipeline.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
