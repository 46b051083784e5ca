"""``python -m commsched.demo`` (what ``make demo`` runs) is ``commsched demo``."""

import sys

from commsched.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
