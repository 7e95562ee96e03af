#!/usr/bin/env bash
# Optional: NVIDIA Dynamo (ai-dynamo 1.6.1, CPU wheels) in its OWN virtualenv, for the
# Dynamo integration's tests and benchmark (docs/INTEGRATIONS.md).
#
# Never into the project's .venv: ai-dynamo's [sglang] extra pins another sglang
# (0.5.21) and its dependencies would move ours. ai-dynamo 1.6.1 also requires
# `aisimulate`, which PyPI serves only as a placeholder that downloads from NVIDIA's
# own index: only Dynamo's planner imports it, so ai-dynamo is installed without
# dependencies and its other requirements are installed by name.
#
# Idempotent (a stamp file); exit status 0 when Dynamo imports afterwards.
# Settings: ELDR_DYNAMO_VENV (default .cache/dynamo-venv), ELDR_PYTHON (python3.11).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ELDR_DYNAMO_VENV:-$ROOT/.cache/dynamo-venv}"
PY="${ELDR_PYTHON:-python3.11}"
STAMP="$VENV/.eldr-dynamo-stamp"
VERSION="1.6.1"
DEPS=("aiohttp>=3.14.3,<4.0" "certifi>=2026.10.19" "kubernetes>=32.0.1,<33.0.0" "msgspec>=0.19.0"
      "prometheus-client>=0.23.1,<1.0" "pyzmq>=26.0.0" "redis>=6.2.0,<9.0.0" "tqdm>=4.0.0"
      "transformers>=4.56.0" "typing-extensions>=4.10.0" "zstandard>=0.23.0,<1.0"
      "pydantic>=2.10.6,<=2.13.5" "uvloop>=0.21.0")

fingerprint() { { echo "$VERSION"; printf '%s\n' "${DEPS[@]}"; } | sha256sum | cut -d' ' -f1; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(fingerprint)" ] && \
   "$VENV/bin/python" -c "import dynamo.frontend, dynamo.mocker" 2>/dev/null; then
  echo "==> [dynamo] up to date ($VENV)"
  exit 0
fi
echo "==> [dynamo] virtualenv $VENV ($PY)"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
echo "==> [dynamo] ai-dynamo==$VERSION ai-dynamo-runtime==$VERSION (no dependencies)"
"$VENV/bin/python" -m pip install -q --no-deps "ai-dynamo==$VERSION" "ai-dynamo-runtime==$VERSION"
echo "==> [dynamo] their requirements, less aisimulate (planner only, not on PyPI)"
"$VENV/bin/python" -m pip install -q "${DEPS[@]}"
"$VENV/bin/python" -c "import dynamo.frontend, dynamo.mocker, importlib.metadata as m; print('==> [dynamo] ai-dynamo', m.version('ai-dynamo'))"
fingerprint > "$STAMP"
