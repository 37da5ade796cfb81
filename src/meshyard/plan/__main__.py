"""``python -m meshyard.plan``: the ``meshyard plan`` command on its own."""

import sys

from meshyard.plan.cli import run

if __name__ == "__main__":
    sys.exit(run())
