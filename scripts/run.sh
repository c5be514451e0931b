#!/usr/bin/env bash
# Start the whole system in the foreground: web (daphne: the console), the gateway (daphne: the OpenAI
# API, its own process), the agent API (daphne: agent protocol v1, its own process), Celery worker and beat, the fleet
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
# The demo runs with DEBUG on (tracebacks in the browser, the development SECRET_KEY); settings
# refuse that key without it. Anything but a demo on this machine: DEBUG=0 and a SECRET_KEY.
export DEBUG="${DEBUG:-1}"
PORT="${FLEXPIPE_PORT:-$($PY scripts/services.py free-port 8000)}"
export FLEXPIPE_PORT="$PORT"
# The gateway's own process (console/gateway/asgi.py): the OpenAI API, apart from the agents' API.
GATEWAY_PORT="${FLEXPIPE_GATEWAY_PORT:-$($PY scripts/services.py free-port $((PORT + 1)))}"
export FLEXPIPE_GATEWAY_PORT="$GATEWAY_PORT"
export FLEXPIPE_GATEWAY_URL="${FLEXPIPE_GATEWAY_URL:-http://127.0.0.1:${GATEWAY_PORT}}"
# The agent API's own process (console/agent_asgi.py): the fleet reports there, apart from the pages.
AGENT_PORT="${FLEXPIPE_AGENT_PORT:-$($PY scripts/services.py free-port $((GATEWAY_PORT + 1)))}"
export FLEXPIPE_AGENT_PORT="$AGENT_PORT"
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

# One SQLite database per engine and scenario under .run/: another scenario or engine starts from a
# clean slate (and switching back finds that run as it was); FRESH=1 starts this one over.
# Agents keep their own tokens beside the database that enrolled them (the join token re-enrolls no
# node): a token kept for another database would be unknown to this one.
if [ -z "${DATABASE_URL:-}" ]; then
  RUN_NAME="${ENGINE}-$(basename "$SCENARIO" .yaml)"
  DB=".run/db-${RUN_NAME}.sqlite3"
  export FLEXPIPE_AGENT_TOKENS="${FLEXPIPE_AGENT_TOKENS:-.run/agent-tokens-${RUN_NAME}}"
  [ "${FRESH:-0}" = 0 ] || { rm -rf "$DB" "$FLEXPIPE_AGENT_TOKENS"; echo "FRESH=1: starting over with an empty $DB"; }
  export DATABASE_URL="sqlite:///$PWD/$DB"
fi
export FLEXPIPE_AGENT_TOKENS="${FLEXPIPE_AGENT_TOKENS:-.run/agent-tokens}"
$PY manage.py migrate --noinput -v 0
$PY manage.py ensure_demo_operator
# The scenario's deployments and their baseline gears (idempotent); the gearbox brings them up.
$PY manage.py load_scenario_deployments "$SCENARIO"
# Agents keep their own token under $FLEXPIPE_AGENT_TOKENS (the join token re-enrolls no node): a
# node of this database whose agent kept none gets one issued now - make run is the local fleet's operator.
$PY manage.py ensure_agent_tokens "$SCENARIO" "$FLEXPIPE_AGENT_TOKENS"
if [ "$ENGINE" = sim ]; then
  # The simulated engines answer the OpenAI API through the gateway: a small tokenizer made here (never
  # downloaded) gives prompts their token counts and the simulator's tokens their ids.
  [ -s .run/models/sim-tokenizer/tokenizer.json ] || $PY -m agents.engines.torch.weights --tokenizer-only .run/models/sim-tokenizer >/dev/null
  export FLEXPIPE_SIM_TOKENIZER=.run/models/sim-tokenizer FLEXPIPE_GATEWAY_TOKENIZERS="*=$PWD/.run/models/sim-tokenizer"
else
  # Real engines load real weights: make the tiny model (deterministic, no download) and register
  # it, so prepare_plan carries its SHA256 and the gateway finds its tokenizer.
  [ -s .run/models/tiny-llama/model.safetensors ] || $PY -m agents.engines.torch.weights .run/models/tiny-llama
  $PY manage.py register_local_model tiny-llama .run/models/tiny-llama --engine "$ENGINE" --deploy
fi

echo
echo "  FlexPipe console:  http://127.0.0.1:${PORT}/   (Ctrl-C stops everything)"
echo "  OpenAI gateway:    ${FLEXPIPE_GATEWAY_URL}/v1   (its own process)"
echo "  Agent API:         http://127.0.0.1:${AGENT_PORT}/agent/v1   (its own process; the fleet reports here)"
echo "  Redis:             ${REDIS_URL}"
echo "  Fleet:             ${ENGINE} agents for ${SCENARIO}"
echo "  Database:          ${DATABASE_URL}"
[ "$DEBUG" = 0 ] || echo "  Debug:             on, for this demo only (DEBUG=0 and a SECRET_KEY for anything else)"
echo "  Processes:         make status   (restarts: .run/supervisord.log)"
echo
# In the background, so this shell can pass SIGTERM on (a foreground child would hold it back);
# Ctrl-C reaches supervisord itself too. Its programs run in process groups of their own.
scripts/supervisor.sh daemon &
supervisor=$!
trap 'kill -TERM "$supervisor" 2>/dev/null; wait "$supervisor"; exit 130' INT TERM
wait "$supervisor"
