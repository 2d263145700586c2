"""``python -m leakaudit``: the same as the ``leakaudit`` command."""
import sys

from leakaudit.evaluator.cli import main

sys.exit(main())
