# syntax=docker/dockerfile:1
# eldr-sglang on SGLang's official image: SGLang 0.5.23 with its CUDA or ROCm stack, plus
# this package (router, deploy tools, the engine plugin through sglang.srt.plugins).
#
#   docker build -t eldr-sglang:0.1.0-cuda .
#   docker build --build-arg BASE_IMAGE=lmsysorg/sglang:v0.5.23-rocm720-mi30x -t eldr-sglang:0.1.0-rocm .
#
# The tags are what `python -m eldr_sglang.deploy k8s` writes into the manifests; tags and
# base images come from eldr_sglang/deploy/image.py (tests/unit/test_dockerfile.py checks
# that this file agrees).
ARG BASE_IMAGE=lmsysorg/sglang:v0.5.23
FROM ${BASE_IMAGE}

ARG SGLANG_VERSION=0.5.23
WORKDIR /opt/eldr-sglang
COPY pyproject.toml README.md ./
COPY eldr_sglang ./eldr_sglang

# The [sglang] extra pins sglang==0.5.23, so pip keeps the image's SGLang, torch and GPU
# libraries and adds only the light dependencies; the build fails on another SGLang.
RUN python3 -m pip install --no-cache-dir ".[sglang]" \
 && python3 -c "import importlib.metadata as m; v = m.version('sglang'); assert v == '${SGLANG_VERSION}', 'SGLang ' + v; assert any(e.name == 'eldr' for e in m.entry_points(group='sglang.srt.plugins')), 'eldr plugin not registered'; import eldr_sglang.router.cli, eldr_sglang.deploy"

# Kubernetes runs each container's own command (an engine or the router); this is for `docker run`.
WORKDIR /workspace
CMD ["python3", "-m", "eldr_sglang.router", "--help"]
