"""eldr-sglang: expert-locality-aware decode routing for SGLang PD serving."""

__version__ = "0.1.0"
