"""Print the policy table generated from the policy registry, or keep a file's copy current.

    python -m tools.policy_table                   # print it
    python -m tools.policy_table --write README.md # rewrite the part between the markers
    python -m tools.policy_table --check README.md # exit 1 if that part is stale

The markers are ``<!-- policy-table:start -->`` and ``<!-- policy-table:end -->``; a file
without them is left alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eldr_sglang.core.policies.table import END, START, policy_table, with_table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="FILE", help="rewrite the table between the markers in FILE")
    group.add_argument("--check", metavar="FILE", help="exit 1 if the table between the markers in FILE is stale")
    args = ap.parse_args(argv)
    path = args.write or args.check
    if path is None:
        sys.stdout.write(policy_table())
        return 0
    text = Path(path).read_text()
    if START not in text or END not in text:
        print(f"{path}: no {START} ... {END} markers; nothing to do", file=sys.stderr)
        return 0
    new = with_table(text)
    if args.check:
        if new != text:
            print(f"{path}: policy table is stale; run python -m tools.policy_table --write {path}", file=sys.stderr)
            return 1
        return 0
    if new != text:
        Path(path).write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
