"""``python -m eldr_sglang.router``: see :mod:`eldr_sglang.router.cli`."""

from eldr_sglang.router.cli import main

if __name__ == "__main__":
    main()
