"""ELDR router: late-binding PD dispatch for SGLang (``python -m eldr_sglang.router``)."""

from eldr_sglang.router.app import Router, start_router

__all__ = ["Router", "start_router"]
