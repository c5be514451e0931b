"""A node agent in a process of its own, driven over stdin/stdout: the other machine of a test.

    python -m tests.agents.node.remote_node NODE_ID MODELS_DIR DATA_ADDR

Reads one command a line ({"id", "kind", "payload"} as JSON) and answers each with its ack
({"id", "status", "detail", "result"}); prints {"ready": pid} first. The agent and its engine
backend are the real ones (agents.node.daemon.NodeAgent, TorchBackend); only the controller is
replaced by the pipe, so worker processes this node starts are children of this process.
"""

from __future__ import annotations

import json
import os
import sys

from agents.node.daemon import NodeAgent
from agents.node.gpuspec import SpecProbe
from agents.node.plans import ModelStore, TorchBackend
from agents.protocol import Command


def main() -> None:
    node_id, models_dir, data_addr = sys.argv[1:4]
    backend = TorchBackend(ModelStore(models_dir), data_addr, num_kv_blocks=64)
    backend.server()  # answer the stages endpoint from the start (409 until a plan is prepared)
    agent = NodeAgent(controller="http://127.0.0.1:9", join_token="fpj_unused", probe=SpecProbe("2xA100-80G", node_id),
                      backend=backend, backend_name="torch", node_id=node_id, data_addr=data_addr)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            ack = agent.handle(Command(id=msg["id"], kind=msg["kind"], payload=msg["payload"],
                                       deployment=msg["payload"].get("deployment", ""), transition_seq=1,
                                       step="test"))
            print(json.dumps({"id": msg["id"], "status": ack.status, "detail": ack.detail, "result": ack.result}),
                  flush=True)
    finally:
        agent.close()


if __name__ == "__main__":
    main()
