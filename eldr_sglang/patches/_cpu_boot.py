"""Imported by ``eldr_sglang_cpu.pth`` (written by scripts/install_cpu.sh) at
interpreter start-up in the CPU venv; see ``cpu_compat.install_import_shims``."""

from eldr_sglang.patches.cpu_compat import install_import_shims

install_import_shims(torchvision=True)
