"""`python -m pipeline.cli ...`: the `pipeline` command, as earlier releases ran it."""

import sys

from pipeline.cli.main import main

sys.exit(main())
