"""The agent daemon of a real GPU node (DESIGN.md: agents/node).

    python -m agents.node --controller URL --token T --backend torch|vllm --probe nvml|static
                          [--node-id ID] [--data-addr HOST:PORT] [--static-gpus SPEC]

It enrolls with the cluster's join token (and from then on uses its own agent token), reports its
GPUs from the probe and the engine reports of its plans on the controller's interval, long-polls
the transition commands of agent protocol v1 and runs each on the engine backend - the same wire
as the simulated fleet (agents/sim/live.py), with real engines behind it. daemon.py holds the
agent, plan_commands.py and node_commands.py the handlers of its commands, state.py what they
share, plans.py the engine backends, gpuspec.py the static GPUs of `--static-gpus`, cli.py the
command line.
"""

from __future__ import annotations

from agents.node.daemon import AGENT_VERSION, NodeAgent, PlanSlot, default_node_id

__all__ = ["AGENT_VERSION", "NodeAgent", "PlanSlot", "default_node_id"]
