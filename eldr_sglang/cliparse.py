"""``ArgumentParser`` whose errors are one line: ``PROG: error: MESSAGE``, exit status 2.

The console scripts' usage texts run to dozens of lines; an operator who mistyped one
value needs the message naming the flag or field, not the usage (``--help`` has it)."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def fail(prog: str, message: str) -> NoReturn:
    """The same line for an error found after parsing."""
    sys.stderr.write(f"{prog}: error: {' '.join(message.split())}\n")
    sys.exit(2)
