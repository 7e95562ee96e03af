"""Shipped cluster descriptions (``eldr_sglang/deploy/presets/*.yaml``) and YAML loading."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .spec import DescriptionError


def preset_names() -> list[str]:
    folder = resources.files(__package__).joinpath("presets")
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def preset_text(name: str) -> str:
    if name not in preset_names():
        raise DescriptionError(f"preset: unknown preset {name!r} (known: {preset_names()})")
    return resources.files(__package__).joinpath("presets", f"{name}.yaml").read_text()


def load_description(path: str | None = None, preset: str | None = None) -> Any:
    """The YAML document of a description file or a preset; DescriptionError when unreadable."""
    if preset is not None:
        text, source = preset_text(preset), f"preset {preset}"
    else:
        try:
            text, source = Path(path).read_text(), str(path)
        except OSError as exc:
            raise DescriptionError(f"description: cannot read {path} ({exc.strerror})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise DescriptionError(f"description: {source} is not valid YAML ({exc})") from None
