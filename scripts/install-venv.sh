#!/usr/bin/env bash
# Create the project's virtual environment at DIR and install the pinned requirements.txt into it.
#     scripts/install-venv.sh DIR        (the Makefile runs it through scripts/cached-venv.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
dir="$1"
PYTHON="${PYTHON:-python3.11}"
test -x "$dir/bin/python" || "$PYTHON" -m venv "$dir"
echo "installing requirements into $dir (first run: about a minute)"
"$dir/bin/python" -m pip install -q --disable-pip-version-check -r requirements.txt 2>&1 | grep -v "is ignored" || true
"$dir/bin/python" -c "import django, celery, channels, torch" || { echo "requirements failed to install"; exit 1; }
