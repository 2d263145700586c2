"""``python -m leakaudit``: the same as the ``leakaudit`` command."""
import sys

from leakaudit.evaluator.cli import main

if __name__ == "__main__":  # not on import (the documentation's API page inspects every module of the package)
    sys.exit(main())
