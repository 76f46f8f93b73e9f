"""``python -m bench``: run the benchmarks (:mod:`bench.suite`)."""

import sys

from bench.suite import main

sys.exit(main())
