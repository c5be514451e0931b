#!/usr/bin/env bash
# The fleet process of `make run`, chosen by ENGINE:
#   sim          the simulated fleet of $SCENARIO (agents.sim: one agent per node, over HTTP)
#   torch, vllm  one real agent daemon (python -m agents.node) per node of $SCENARIO, on this
#                machine: static probes describe each node's GPUs (CPU stand-ins named as the
#                scenario's cluster names them), each daemon has its own data port.
# supervisord stops this script with SIGTERM (Ctrl-C); it passes the signal on to every daemon it
# started and waits for them: each stops its engines before it exits, so nothing is left behind.
# Each agent keeps its own token under $FLEXPIPE_AGENT_TOKENS (make run: beside its database; agents.client): a restarted fleet
# registers again with it, without re-enrolling.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
# The agent API's own process (console/agent_asgi.py); the console's port serves the agent API too.
CONTROLLER="http://127.0.0.1:${FLEXPIPE_AGENT_PORT:-${FLEXPIPE_PORT:?FLEXPIPE_PORT is not set}}"
ENGINE="${ENGINE:-sim}"

case "$ENGINE" in
  sim)
    exec $PY -m agents.sim --scenario "$SCENARIO" --controller "$CONTROLLER" --token-dir "${FLEXPIPE_AGENT_TOKENS:-.run/agent-tokens}" ;;
  torch|vllm) ;;
  *)
    echo "fleet: ENGINE must be sim, torch or vllm; got '$ENGINE'" >&2; exit 2 ;;
esac
if [ "$ENGINE" = vllm ] && [ ! -x "${FLEXPIPE_VLLM_PYTHON:-.venv-vllm/bin/python}" ]; then
  echo "fleet: ENGINE=vllm needs vLLM's own venv: run 'make vllm-env' first (or set FLEXPIPE_VLLM_PYTHON)" >&2
  exit 2
fi

# "namespace node-id gpu-model gpu-count rack" for each node of the scenario
nodes="$($PY - "$SCENARIO" <<'PYEOF'
import sys
from agents.sim.scenario import load_scenario
s = load_scenario(sys.argv[1])
for n in s.nodes:
    print(s.name, n.id, n.gpu, n.gpus, n.rack or "-")
PYEOF
)"

pids=()
stop() {
  trap - TERM INT
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait
  exit "${1:-0}"
}
trap stop TERM INT

port=$($PY scripts/services.py free-port "${FLEXPIPE_DATA_PORT_BASE:-7070}")
vllm_port=8200
while read -r ns node gpu count rack; do
  [ -n "$node" ] || continue
  port=$($PY scripts/services.py free-port "$port")
  args=(--controller "$CONTROLLER" --backend "$ENGINE" --probe static --static-gpus "${count}x${gpu}"
        --gpu-namespace "$ns" --node-id "$node" --data-addr "127.0.0.1:${port}" --models-dir .run/models
        --vllm-port-base "$vllm_port" --token-file "${FLEXPIPE_AGENT_TOKENS:-.run/agent-tokens}/${node}.token")
  [ "$rack" = "-" ] || args+=(--rack "$rack")
  echo "fleet: $node (${count}x${gpu}, $ENGINE) data on 127.0.0.1:${port}"
  $PY -m agents.node "${args[@]}" &
  pids+=($!)
  port=$((port + 1))
  vllm_port=$((vllm_port + 20))
done <<< "$nodes"

# One daemon that dies takes the fleet down with it: supervisord starts the fleet again.
set +e
wait -n
status=$?
stop "$status"
