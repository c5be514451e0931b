#!/usr/bin/env bash
# supervisord and supervisorctl for `make run`, with the control socket they share:
#   scripts/supervisor.sh daemon          start supervisord (scripts/run.sh does)
#   scripts/supervisor.sh ctl status      pid and uptime of each program (make status)
# The socket lives in /tmp under a name made from this checkout's path: a path inside the checkout
# passed AF_UNIX's 108-byte limit in a deep one (supervisord makes it absolute and adds its pid).
set -euo pipefail
cd "$(dirname "$0")/.."
FLEXPIPE_SUPERVISOR_SOCK="/tmp/flexpipe-supervisor-$(id -u)-$(pwd -P | sha256sum | cut -c1-12).sock"
export FLEXPIPE_SUPERVISOR_SOCK
case "${1:-}" in
  daemon) exec .venv/bin/supervisord -c scripts/supervisord.conf ;;
  ctl) shift; exec .venv/bin/supervisorctl -c scripts/supervisord.conf "$@" ;;
  *) echo "usage: $0 daemon | ctl COMMAND..." >&2; exit 2 ;;
esac
