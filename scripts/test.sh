#!/usr/bin/env bash
# Run the test suite against this machine's PostgreSQL and Redis when they answer (CI has both);
# SQLite and a private Redis otherwise. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
mkdir -p .run artifacts

export REDIS_URL="$($PY scripts/services.py redis --prefer-standard)"
PG="$($PY scripts/services.py postgres)"
if [ -n "$PG" ]; then export DATABASE_URL="$PG"; else unset DATABASE_URL; fi
# DEBUG is off in tests (as in production), so the settings need a key that is not the demo's.
export SECRET_KEY="${SECRET_KEY:-tests-only-$(head -c 18 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
echo "tests: database ${DATABASE_URL:-sqlite (no PostgreSQL answered)}, redis ${REDIS_URL}"
# Two workers: the machine has 2 cores, and the engine and browser tests wait on processes.
exec $PY -m pytest -n "${PYTEST_WORKERS:-2}" "$@"
