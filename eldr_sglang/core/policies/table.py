"""The registry as a markdown table (the README's policy table): one row per policy, its
aliases, what it chooses and its parameters with their defaults, all read from the
:class:`~.base.PolicySpec` s and their parameter sets (``python -m tools.policy_table``)."""

from __future__ import annotations

from dataclasses import fields

from eldr_sglang.core.policies.base import FAMILIES, policy_spec, policies_of

START, END = "<!-- policy-table:start -->", "<!-- policy-table:end -->"


def _value(v) -> str:
    return "none" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def policy_table() -> str:
    """The table, cost policies first, then similarity, label and the balancers (registration
    order within a family)."""
    rows = ["| policy | family | chooses | parameters (default) |", "|---|---|---|---|"]
    for name in [n for family in reversed(FAMILIES) for n in policies_of(family)]:
        spec = policy_spec(name)
        title = f"`{name}`" + (f" ({', '.join(f'`{a}`' for a in spec.aliases)})" if spec.aliases else "")
        prm = ", ".join(f"`{f.name}` ({_value(f.default)})" for f in fields(spec.params)) or "–"
        rows.append(f"| {title} | {spec.family} | {spec.summary} | {prm} |")
    return "\n".join(rows) + "\n"


def with_table(text: str) -> str:
    """``text`` with the part between :data:`START` and :data:`END` replaced by the table
    (unchanged if it has no such markers)."""
    if START not in text or END not in text:
        return text
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{policy_table()}{END}{tail}"
