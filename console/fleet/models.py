"""What the agents last told us: nodes, their GPUs, a bounded history, measured links and
collective curves, the blocks' trajectories, commands.

State only: the rules that change it live in actions.py (one transaction each, conditional
updates where two writers may race), and the scheduling logic in scheduler/.
"""

from __future__ import annotations

from django.db import models


class Node(models.Model):
    """A host with GPUs and one agent."""

    node_id = models.CharField(max_length=64, unique=True)
    hostname = models.CharField(max_length=255)
    agent_version = models.CharField(max_length=64)
    rack = models.CharField(max_length=64, blank=True, default="")
    backends = models.JSONField(default=list)  # engine backends the agent can run
    # backend -> what its engine can run (scheduler.capabilities.EngineCaps.to_dict()); {}: not reported
    capabilities = models.JSONField(default=dict)
    data_addr = models.CharField(max_length=255, blank=True, default="")  # where peers send it KV cache
    # sha256 of the agent's own token: the token itself is shown once, at enrollment, and never stored.
    token_hash = models.CharField(max_length=64, db_index=True)
    epoch = models.PositiveIntegerField(default=0)  # bumped by each registration
    last_seq = models.PositiveBigIntegerField(default=0)  # last accepted report seq in this epoch
    registered_at = models.DateTimeField()
    last_seen_at = models.DateTimeField(null=True, blank=True)
    # The last two accepted reports (not registrations): every GPU of the node was reported then - a
    # delta report lists only the GPUs that changed - and their interval is what `engines` counts over.
    reported_at = models.DateTimeField(null=True, blank=True)
    prev_reported_at = models.DateTimeField(null=True, blank=True)
    schedulable = models.BooleanField(default=True)
    unschedulable_reason = models.CharField(max_length=200, blank=True, default="")
    engines = models.JSONField(default=list)  # latest EngineReports, as sent
    # Plans the deployments' routing placed here that the agent did not list when it registered
    # last (it restarted without them) or in its last report that listed its plans (they died under
    # it): plan_id -> that epoch. The gearbox drops them from its gears
    # (console.gearbox.actions.drop_lost_plans). `lost_at`: when that list was worked out - a plan
    # prepared here again after it is alive, not lost (null: at `registered_at`, before this field).
    lost_plans = models.JSONField(default=dict)
    lost_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["node_id"]

    def __str__(self) -> str:
        return self.node_id


# What a GPU is to us right now, in this order of precedence (the Overview page uses the same words):
#   unhealthy    its last report said it is broken (XID needing a reset, uncorrectable ECC, failed check)
#   unreachable  its node missed the heartbeat: what we know of it is stale, so it is not capacity
#   tenant       healthy, but its owner lent it to another tenant (not allocatable to us)
#   ours         healthy, allocatable, on a node that reports: the planner may use it
GPU_UNHEALTHY, GPU_UNREACHABLE, GPU_TENANT, GPU_OURS = "unhealthy", "unreachable", "tenant", "ours"
GPU_STATES = (GPU_OURS, GPU_TENANT, GPU_UNHEALTHY, GPU_UNREACHABLE)
GPU_STATE_Q = {
    GPU_UNHEALTHY: models.Q(healthy=False),
    GPU_UNREACHABLE: models.Q(healthy=True, node__schedulable=False),
    GPU_TENANT: models.Q(healthy=True, node__schedulable=True, allocatable=False),
    GPU_OURS: models.Q(healthy=True, node__schedulable=True, allocatable=True),
}


def gpu_state(*, healthy: bool, allocatable: bool, node_schedulable: bool) -> str:
    if not healthy:
        return GPU_UNHEALTHY
    if not node_schedulable:
        return GPU_UNREACHABLE
    return GPU_OURS if allocatable else GPU_TENANT


class Gpu(models.Model):
    """One GPU: its static facts from registration and its latest reported state."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    uuid = models.CharField(max_length=128, unique=True)
    index = models.PositiveSmallIntegerField()
    model = models.CharField(max_length=64)
    mem_total_bytes = models.PositiveBigIntegerField()
    nvlink_group = models.CharField(max_length=64, blank=True, default="")
    custom_spec = models.JSONField(null=True, blank=True)
    present = models.BooleanField(default=True)  # False once a registration no longer lists it
    # Latest report; null until the first one arrives.
    mem_used_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    sm_util = models.FloatField(null=True, blank=True)
    temperature_c = models.FloatField(null=True, blank=True)
    healthy = models.BooleanField(default=True)
    allocatable = models.BooleanField(default=True)
    xid_errors = models.PositiveIntegerField(default=0)
    ecc_errors = models.PositiveIntegerField(default=0)
    # When a report last changed this row's state (a report that repeats it writes nothing here: the
    # node's reported_at says it was seen then).
    updated_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["node__node_id", "index"]
        constraints = [
            models.UniqueConstraint(fields=["node", "index"], condition=models.Q(present=True),
                                    name="fleet_gpu_unique_present_index"),
        ]

    def __str__(self) -> str:
        return f"{self.node_id}:{self.index} {self.model}"

    @property
    def state(self) -> str:
        return gpu_state(healthy=self.healthy, allocatable=self.allocatable, node_schedulable=self.node.schedulable)


class GpuSample(models.Model):
    """One reported state of one GPU; the newest FLEXPIPE_GPU_HISTORY per GPU are kept (console/fleet/retention.py)."""

    gpu = models.ForeignKey(Gpu, on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField()
    mem_used_bytes = models.PositiveBigIntegerField()
    sm_util = models.FloatField()
    temperature_c = models.FloatField()
    healthy = models.BooleanField()
    allocatable = models.BooleanField()

    class Meta:
        indexes = [models.Index(fields=["gpu", "-id"], name="fleet_sample_gpu_newest")]


class NodeLink(models.Model):
    """What a node measured to a peer: the latest per pair (console.fleet.links ages them out)."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="links")
    peer = models.CharField(max_length=64)
    bw_gbps = models.FloatField()
    latency_us = models.FloatField(null=True, blank=True)  # one-way, microseconds; null: not measured
    measured_at = models.DateTimeField()  # when the agent measured it (its report's stamp, never in the future)
    method = models.CharField(max_length=64, blank=True, default="")  # how, e.g. dataplane-bulk

    class Meta:
        constraints = [models.UniqueConstraint(fields=["node", "peer"], name="fleet_link_unique_pair")]


class CollectiveCurve(models.Model):
    """A collective a node timed over a sweep of message sizes (the shape of nccl-tests): the
    latest per (node, op, scope, peer, ranks). The cost model prefers it to its physical model."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="collectives")
    op = models.CharField(max_length=16)  # all_reduce | send_recv
    scope = models.CharField(max_length=8)  # intra (GPUs of this node) | inter (this node and `peer`)
    peer = models.CharField(max_length=64, blank=True, default="")
    ranks = models.PositiveIntegerField()
    backend = models.CharField(max_length=16, blank=True, default="")  # nccl | gloo
    points = models.JSONField(default=list)  # [[message bytes, seconds], ...] by size
    measured_at = models.DateTimeField()
    method = models.CharField(max_length=64, blank=True, default="")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["node", "op", "scope", "peer", "ranks"],
                                               name="fleet_collective_unique")]


class BlockTrajectory(models.Model):
    """One atomic block's size over time (scheduler.topology.FragmentHistory, bounded): what the
    gearbox reads to keep latency-critical plans off blocks that keep shrinking."""

    block_id = models.CharField(max_length=160, unique=True)
    points = models.JSONField(default=list)  # [[t_s, size], ...], increasing t_s
    updated_at = models.DateTimeField()


class AgentCommand(models.Model):
    """A control message for one agent, delivered by long poll and acknowledged by the agent.

    `key` makes issuing idempotent: a transition step that is re-run after a crash issues the
    same key and gets the existing command back instead of a duplicate.
    """

    PENDING, DELIVERED, RUNNING, OK, FAILED = "pending", "delivered", "running", "ok", "failed"
    STATES = [(s, s) for s in (PENDING, DELIVERED, RUNNING, OK, FAILED)]
    OPEN_STATES = (PENDING, DELIVERED, RUNNING)

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="commands")
    key = models.CharField(max_length=200, unique=True)
    kind = models.CharField(max_length=64)
    payload = models.JSONField(default=dict)
    deployment = models.CharField(max_length=64, blank=True, default="")
    transition_seq = models.PositiveBigIntegerField(null=True, blank=True)
    step = models.CharField(max_length=64, blank=True, default="")
    state = models.CharField(max_length=16, choices=STATES, default=PENDING)
    created_at = models.DateTimeField()
    delivered_at = models.DateTimeField(null=True, blank=True)
    acked_at = models.DateTimeField(null=True, blank=True)
    detail = models.TextField(blank=True, default="")
    result = models.JSONField(default=dict)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["node", "state", "id"], name="fleet_cmd_node_open")]
