#!/usr/bin/env bash
# Start the whole system in the foreground: web (daphne), Celery worker and beat, the fleet
# (ENGINE=sim: the simulated fleet; ENGINE=torch|vllm: real engine agents, scripts/fleet.sh).
# supervisord (scripts/supervisord.conf) runs them and restarts any that exits. Ctrl-C (or SIGTERM)
# stops every process it started: supervisord stops its programs, then the private Redis (when no
# REDIS_URL answered) is stopped on the way out.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
mkdir -p .run

export REDIS_URL="$($PY scripts/services.py redis)"
# The private Redis under .run/ is ours to stop; a REDIS_URL that answered is someone else's.
if [ -s .run/redis.port ] && [ "$REDIS_URL" = "redis://127.0.0.1:$(cat .run/redis.port)/0" ]; then
  trap '$PY scripts/services.py stop-redis' EXIT
fi
export DJANGO_SETTINGS_MODULE=console.settings
PORT="${FLEXPIPE_PORT:-$($PY scripts/services.py free-port 8000)}"
export FLEXPIPE_PORT="$PORT"
# The join token the simulated agents enroll with: made once, kept under .run/.
if [ -z "${FLEXPIPE_ENROLL_TOKEN:-}" ]; then
  [ -s .run/enroll-token ] || $PY -c "import secrets; print('fpj_' + secrets.token_urlsafe(24))" > .run/enroll-token
  export FLEXPIPE_ENROLL_TOKEN="$(cat .run/enroll-token)"
fi
export ENGINE="${ENGINE:-sim}"
case "$ENGINE" in
  sim) export SCENARIO="${SCENARIO:-scenarios/demo.yaml}" ;;
  torch|vllm) export SCENARIO="${SCENARIO:-scenarios/torch.yaml}" ;;
  *) echo "ENGINE must be sim, torch or vllm; got '$ENGINE'" >&2; exit 2 ;;
esac

$PY manage.py migrate --noinput -v 0
$PY manage.py ensure_demo_operator
# The scenario's deployments and their baseline gears (idempotent); the gearbox brings them up.
$PY manage.py load_scenario_deployments "$SCENARIO"
# Agents keep their own token under .run/agent-tokens/ (the join token re-enrolls no node): a node
# of this database whose agent kept none gets one issued now - make run is the local fleet's operator.
$PY manage.py ensure_agent_tokens "$SCENARIO" .run/agent-tokens
if [ "$ENGINE" != sim ]; then
  # Real engines load real weights: make the tiny model (deterministic, no download) and register
  # it, so prepare_plan carries its SHA256 and the gateway finds its tokenizer.
  [ -s .run/models/tiny-llama/model.safetensors ] || $PY -m agents.engines.torch.weights .run/models/tiny-llama
  $PY manage.py register_local_model tiny-llama .run/models/tiny-llama --engine "$ENGINE"
fi

echo
echo "  FlexPipe console:  http://127.0.0.1:${PORT}/   (Ctrl-C stops everything)"
echo "  Redis:             ${REDIS_URL}"
echo "  Fleet:             ${ENGINE} agents for ${SCENARIO}"
echo "  Processes:         .venv/bin/supervisorctl -c scripts/supervisord.conf status   (restarts: .run/supervisord.log)"
echo
# In the background, so this shell can pass SIGTERM on (a foreground child would hold it back);
# Ctrl-C reaches supervisord itself too. Its programs run in process groups of their own.
.venv/bin/supervisord -c scripts/supervisord.conf &
supervisor=$!
trap 'kill -TERM "$supervisor" 2>/dev/null; wait "$supervisor"; exit 130' INT TERM
wait "$supervisor"
