"""Request-level routing: each request to the plan of its deployment that suits it - filter ->
score -> pick, one module per plugin, the Kubernetes scheduler framework's shape (seed 003's
topology-aware router).

    filters   prefilter          serves the model, open, takes the request's priority class
              memory_bound       weights + KV x (prompt + max_tokens) + activations <= 92% per GPU
    scores    prefix_affinity    its prompt blocks cached there (GPU tier 1.0, host tier less)
              topology_affinity  long prompts to dense, NVLinked plans; short / low priority to cheap
              predicted_latency  queue + prefill + decode on that plan's hardware (costmodel)
    reorder   jitter             plans whose TTFT runs far beyond prediction go to a retry pool
    pick      pick               weighted sum (weights in settings), ties to the least loaded,
                                 the top-K to retry on a backend failure

One router for the gateway (console/gateway/routing.py) and the simulators (agents/sim/fleet.py:
the replays, the live fleet and the tests' worlds). Every decision can explain itself (`Decision.explain`). Pure: no Django,
no I/O, no clock; deterministic for a seed. `baselines` holds the policies bench.route compares.
"""

from scheduler.router.baselines import ROUTING_POLICIES, make_router
from scheduler.router.decision import Decision
from scheduler.router.pool import PlanFacts, PlanLoad, Pool, plan_facts
from scheduler.router.request import BLOCK_TOKENS, RouteRequest, block_hashes
from scheduler.router.router import Router, RouterConfig, RouterWeights, RoutingPolicy

__all__ = [
    "BLOCK_TOKENS", "ROUTING_POLICIES", "Decision", "PlanFacts", "PlanLoad", "Pool", "RouteRequest", "Router",
    "RouterConfig", "RouterWeights", "RoutingPolicy", "block_hashes", "make_router", "plan_facts",
]
