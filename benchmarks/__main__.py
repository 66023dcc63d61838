"""Entry point of ``python -m benchmarks``."""

import sys

from .run import main

sys.exit(main())
