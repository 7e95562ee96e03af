"""Per-decode-server expert placement; same as ``python -m eldr_sglang.placement``."""

import sys

from eldr_sglang.placement.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
