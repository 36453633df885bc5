"""`python -m skmq.cli ...`, the same as the `skmq` command."""

import sys

from skmq.cli import main

sys.exit(main())
