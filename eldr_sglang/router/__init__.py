"""ELDR router: late-binding PD dispatch for SGLang (``python -m eldr_sglang.router``).

``Router`` and ``start_router`` are loaded on first use, so importing one router
module does not load them all."""

from typing import Any

__all__ = ["Router", "start_router"]


def __getattr__(name: str) -> Any:
    if name == "Router":
        from eldr_sglang.router.app import Router

        return Router
    if name == "start_router":
        from eldr_sglang.router.http.serve import start_router

        return start_router
    raise AttributeError(f"module 'eldr_sglang.router' has no attribute {name!r}")
