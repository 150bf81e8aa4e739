"""``python -m jaxlp ...``: the command line (see :mod:`jaxlp.cli`)."""

import sys

from jaxlp.cli import main

if __name__ == "__main__":
    sys.exit(main())
