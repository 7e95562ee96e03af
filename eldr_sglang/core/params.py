"""Typed, validated parameter sets of the decode-routing policies and the step-time law.

Each policy declares its parameters once, as a frozen :class:`Params` dataclass
(``PolicySpec.params``): each field's name, type and default, and with :func:`param` its
bounds and a one-line description; :func:`check_fields` (run by ``Params.__post_init__``)
checks every field against its bounds, the one check of every policy parameter. Values come
as text (``--policy-param cost_band=0.05``), as numbers (a YAML or JSON config file) or
as the dataclass itself (code); :func:`parse_params` turns them into the dataclass or
raises a one-line ``ValueError`` that names the field. One builder
(:func:`~eldr_sglang.core.policies.base.build_policy`) takes them for the router, the
co-located router, the simulator and the benchmarks.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from functools import lru_cache
from typing import Any, Iterable, Mapping, Optional, Sequence, Union


def param(default: Any, low: Optional[float] = None, doc: str = "") -> Any:
    """A parameter field: its ``default``, its lower bound ``low`` (None: any finite value;
    an ``int`` field defaults to >= 1) and a one-line description (help texts, the README's
    policy table)."""
    return field(default=default, metadata={"low": low, "doc": doc})


def param_of(params: type, name: str, default: Any) -> Any:
    """A field declared as ``params``' field ``name`` (its bounds and description), with
    another default: a parameter set that embeds another's fields declares them once."""
    f = next(f for f in fields(params) if f.name == name)
    return field(default=default, metadata=dict(f.metadata))


@dataclass(frozen=True)
class Params:
    """Base of the policies' parameter sets: ``__post_init__`` checks every field against the
    bounds it declares (:func:`check_fields`)."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class NoParams(Params):
    """A policy without parameters."""


def check_number(name: str, value: Any, low: Optional[float] = 0.0, *, optional: bool = False) -> None:
    """``value`` must be a finite number >= ``low`` (any finite number if ``low`` is None; or
    None when ``optional``); ValueError naming ``name``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (low is not None and value < low):
        bound = "" if low is None else f" >= {low:g}"
        raise ValueError(f"{name}: expected a finite number{bound}, got {value!r}")


def check_int(name: str, value: Any, low: int = 1) -> None:
    """``value`` must be an integer >= ``low``; ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _kind(hint: Any) -> tuple[Any, bool]:
    """(the type, optional) of a field's annotation: ``Optional[float]`` -> (float, True)."""
    args = typing.get_args(hint)
    if (typing.get_origin(hint) in (Union, types.UnionType)) and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return hint, False


@lru_cache(maxsize=None)
def bounds(params: type) -> dict[str, tuple[Any, bool, Optional[float]]]:
    """name -> (type, optional, lower bound) of every field of a parameter dataclass."""
    hints = _hints(params)
    out = {}
    for f in fields(params):
        kind, optional = _kind(hints[f.name])
        low = f.metadata.get("low")
        out[f.name] = (kind, optional, 1 if low is None and kind is int else low)
    return out


def check_fields(obj: Any) -> None:
    """Every field of the parameter dataclass ``obj`` within the bounds it declares (an
    ``int`` field: an integer; a ``float`` field: a finite number); ValueError naming the
    field. The one range check of the policies' parameters."""
    for name, (kind, optional, low) in bounds(type(obj)).items():
        value = getattr(obj, name)
        if kind is int and not (optional and value is None):
            check_int(name, value, int(low))
        elif kind is float:
            check_number(name, value, low, optional=optional)


def param_docs(params: type) -> dict[str, str]:
    """name -> the one-line description a field declares (empty if none)."""
    return {f.name: f.metadata.get("doc", "") for f in fields(params)}


def param_names(params: type) -> tuple[str, ...]:
    """The parameter names of a parameter dataclass, in declaration order."""
    return tuple(f.name for f in fields(params))


def _typed(name: str, hint: Any, raw: Any) -> Any:
    """``raw`` (text, number or None) as ``hint`` (float, int, Optional[...]); ValueError
    naming ``name``."""
    kind, optional = _kind(hint)
    if optional and (raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none", "null"))):
        return None
    if isinstance(raw, bool):
        raise ValueError(f"{name}: expected {kind.__name__}, got {raw!r}")
    text = raw.strip() if isinstance(raw, str) else raw
    try:
        if kind is int:
            if isinstance(text, float) and not text.is_integer():
                raise ValueError
            return int(text)
        if kind is float:
            value = float(text)
            if not math.isfinite(value):
                raise ValueError
            return value
    except (TypeError, ValueError):
        what = "an integer" if kind is int else "a finite number"
        raise ValueError(f"{name}: expected {what}, got {raw!r}") from None
    return raw


def parse_params(policy: str, params: type, values: Any = None) -> Any:
    """``values`` (a mapping of name -> text or number, an instance of ``params``, or None)
    as ``params``; ValueError naming the field (an unknown name lists the known ones)."""
    if values is None:
        return params()
    if is_dataclass(values) and not isinstance(values, type):
        if isinstance(values, params):
            return values
        raise ValueError(f"{policy} takes {params.__name__} parameters, got {type(values).__name__}")
    known = param_names(params)
    hints = _hints(params)
    kw = {}
    for name, raw in dict(values).items():
        if name not in known:
            raise ValueError(f"{name}: {policy} has no parameter {name!r} "
                             f"({'its parameters: ' + ', '.join(known) if known else 'it takes none'})")
        kw[name] = _typed(name, hints[name], raw)
    return params(**kw)


def params_for(params: type, values: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """The entries of ``values`` that ``params`` declares (the others belong to other policies)."""
    known = set(param_names(params))
    return {k: v for k, v in (values or {}).items() if k in known}


def split_assignments(items: Iterable[str], what: str = "policy_param") -> dict[str, str]:
    """``["NAME=VALUE", ...]`` as a dict (a later NAME wins); ValueError naming ``what``."""
    out: dict[str, str] = {}
    for item in items:
        name, eq, value = str(item).partition("=")
        name = name.strip().replace("-", "_")
        if not eq or not name:
            raise ValueError(f"{what}: expected NAME=VALUE, got {item!r}")
        out[name] = value.strip()
    return out


def check_params(specs: Sequence[Any], values: Mapping[str, Any]) -> None:
    """Every name in ``values`` is a parameter of at least one of ``specs`` (PolicySpecs), and
    its value is valid for each that declares it; ValueError naming the field."""
    for name in values:
        owners = [s for s in specs if name in param_names(s.params)]
        if not owners:
            known = sorted({n for s in specs for n in param_names(s.params)})
            names = " or ".join(s.name for s in specs)
            raise ValueError(f"{name}: {names} has no parameter {name!r} "
                             f"({'its parameters: ' + ', '.join(known) if known else 'it takes none'})")
    for s in specs:
        parse_params(s.name, s.params, params_for(s.params, values))
