"""The data plane of a node: running plans (PlanHost) and the HTTP server in front of them.

    server = DataServer("0.0.0.0", 7070).start()          # the node's data_addr
    host = PlanHost(deployment="chat", plan=plan.to_dict(), model_dir=d, layout=None,
                    weights_sha256=sha)
    host.start(); server.add(host)                         # prepare_plan (on the leader)
    host.freeze(v) / host.thaw() / host.move(moves, v) / host.release(drain_s, fallback)
    host.report()                                          # -> agents.protocol.EngineReport

The gateway sends token ids (it tokenizes) to POST /data/v1/generate on the plan leader's data
address and reads NDJSON; server.py documents the endpoints. A hand-over sends the sequence's
KVState (kvtransfer frame: KV for migrate, tokens only for replay) from the old leader's
PlanHost to the new leader's data server (POST /data/v1/accept): agent to agent, never through
the controller. The old stream then ends with {"moved": {target_addr, target_plan,
routing_version}} and the reader continues at the target with
GET /data/v1/sequences/<id>/stream?from=<tokens it has>.

VllmPlanHost is the same face over one supervised vLLM OpenAI server per plan; its hand-overs
are replay only (vllm_host.py says why).

A plan whose stages span nodes runs each stage on its own node: the leader's engine asks each
member at POST /data/v1/stages to start the workers of its GPUs (stages.py; the engine side is
agents/engines/torch/remote.py). Only the leader's PlanHost serves requests and moves KV.
"""

from agents.dataplane.errors import (
    DataPlaneError,
    Frozen,
    NotHere,
    Refused,
    Saturated,
    StaleLease,
    UnknownPlan,
)
from agents.dataplane.host import PlanHost, layout_for_plan
from agents.dataplane.hosting import HostedPlan
from agents.dataplane.server import DataServer
from agents.dataplane.stream import SeqStream
from agents.dataplane.vllm_host import VllmPlanHost
from agents.engines.vllm.spec import vllm_spec_for_plan

__all__ = [
    "DataPlaneError",
    "DataServer",
    "Frozen",
    "HostedPlan",
    "NotHere",
    "PlanHost",
    "Refused",
    "Saturated",
    "SeqStream",
    "StaleLease",
    "UnknownPlan",
    "VllmPlanHost",
    "layout_for_plan",
    "vllm_spec_for_plan",
]
