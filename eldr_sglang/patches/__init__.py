"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``eldr``)."""

from __future__ import annotations


def register() -> None:
    """Called by SGLang's ``load_plugins()`` in every server process."""
    from eldr_sglang.patches import cpu_compat

    if not cpu_compat.cuda_available():
        cpu_compat.install_import_shims()
        cpu_compat.register_hooks()
