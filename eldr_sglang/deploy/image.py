"""The container image the Kubernetes manifests run: SGLang's official image of the
pinned version with this package installed (the repository's ``Dockerfile``).

One image per GPU vendor; :func:`default_image` is the tag ``deploy k8s`` writes into
the manifests and :func:`build_command` the ``docker build`` that makes it."""

from __future__ import annotations

from eldr_sglang import __version__

SGLANG_VERSION = "0.5.23"
# SGLang's official images (Docker Hub lmsysorg/sglang) of that version, per vendor
BASE_IMAGES = {"cuda": f"lmsysorg/sglang:v{SGLANG_VERSION}",
               "rocm": f"lmsysorg/sglang:v{SGLANG_VERSION}-rocm720-mi30x"}
DEFAULT_VENDOR = "cuda"  # the Dockerfile's BASE_IMAGE default
REPOSITORY = "eldr-sglang"


def default_image(vendor: str) -> str:
    """``eldr-sglang:<package version>-<vendor>``."""
    if vendor not in BASE_IMAGES:
        raise ValueError(f"vendor: {vendor!r} is not one of {sorted(BASE_IMAGES)}")
    return f"{REPOSITORY}:{__version__}-{vendor}"


def build_command(vendor: str) -> str:
    """The ``docker build`` (run in the repository root) that makes :func:`default_image`."""
    arg = "" if vendor == DEFAULT_VENDOR else f" --build-arg BASE_IMAGE={BASE_IMAGES[vendor]}"
    return f"docker build{arg} -t {default_image(vendor)} ."
