#!/usr/bin/env bash
# Install eldr-sglang with real SGLang 0.5.23 on a CPU-only x86_64 machine.
#
# Idempotent: a stamp file records what was installed; re-running with nothing
# changed returns in seconds. Every step names itself when it fails.
# GPU users do not need this script: `pip install "eldr-sglang[sglang]"`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ELDR_VENV:-$ROOT/.venv}"
PY="${ELDR_PYTHON:-python3.11}"
LOCK="$ROOT/requirements/cpu-lock.txt"
STAMP="$VENV/.eldr-install-stamp"
APT_PKGS=(libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200 libnuma1 prometheus)

step() { CURRENT_STEP="$1"; echo "==> [install] $1"; }
trap 'echo "!! [install] step failed: ${CURRENT_STEP:-setup} (see the output above)" >&2' ERR

fingerprint() {
  cat "$LOCK" "$ROOT/pyproject.toml" "$ROOT/scripts/install_cpu.sh" | sha256sum | cut -d' ' -f1
}

step "check Debian packages: mooncake libraries, prometheus (promtool) (${APT_PKGS[*]})"
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  step "apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(fingerprint)" ] && [ -x "$VENV/bin/python" ]; then
  echo "==> [install] up to date ($VENV)"
  exit 0
fi

step "create virtual environment $VENV with $PY"
command -v "$PY" >/dev/null || { echo "!! $PY not found; set ELDR_PYTHON" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

# A constraint file keeps every later pip call from replacing the CPU torch.
CONSTRAINTS="$VENV/eldr-constraints.txt"
echo "torch==2.13.0" > "$CONSTRAINTS"
export PIP_CONSTRAINT="$CONSTRAINTS"

step "install torch 2.13.0 (CPU build)"
"$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
  || "${PIP[@]}" install "torch==2.13.0"
"$VENV/bin/python" -c "import torch; assert not torch.version.cuda, 'a CUDA build of torch was installed'"

step "install sglang==0.5.23 and sglang-router==0.3.2 without their CUDA dependency tree"
"${PIP[@]}" install --no-deps "sglang==0.5.23" "sglang-router==0.3.2"

step "install the pinned light dependencies (requirements/cpu-lock.txt, --no-deps)"
"${PIP[@]}" install --no-deps -r "$LOCK"

step "install eldr-sglang (editable, --no-deps)"
"${PIP[@]}" install --no-deps --no-build-isolation -e "$ROOT" 2>/dev/null \
  || "${PIP[@]}" install --no-deps -e "$ROOT"

step "add the CPU import shims (sgl_kernel stand-in, torchvision op schemas) as a .pth start-up file"
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import eldr_sglang.patches._cpu_boot" > "$SITE/eldr_sglang_cpu.pth"

step "smoke-import sglang, the stand-ins and the project"
"$VENV/bin/python" - <<'EOF'
import sglang.srt.configs, sglang.srt.disaggregation.mooncake.conn, sglang.srt.server_args, sglang_router, mooncake  # noqa: F401
import sklearn, scipy, aiohttp, orjson, matplotlib, uvloop, httptools  # noqa: F401
import eldr_sglang
print("    sglang", sglang.__version__, "| eldr_sglang", eldr_sglang.__version__)
EOF

fingerprint > "$STAMP"
echo "==> [install] done: $VENV ($(du -sh "$VENV" | cut -f1))"
