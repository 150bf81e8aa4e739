"""``python -m jaxlp.cli ...``: the command line."""

import sys

from jaxlp.cli import main

sys.exit(main())
