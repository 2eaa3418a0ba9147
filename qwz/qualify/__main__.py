"""``python -m qwz.qualify``: the same CLI as ``qwz-qualify``."""

import sys

from qwz.qualify.cli import main

if __name__ == "__main__":
    sys.exit(main())
