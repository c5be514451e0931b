"""Deployments, the gearbox's decisions, and transitions with their steps (state only).

The rules live in scheduler/ (gearbox.decide, transition.Executor); the writes in actions.py
and in ports.py (the Django implementations of the transition ports). What each model holds:

* `Deployment` - one model served by the cluster: SLO, priority, mode (auto | advisory |
  pinned | emergency), baseline gear (the emergency target), current gear (what a finished
  transition left), pinned gear (the gear a pin or an emergency holds), the versioned routing
  table (version + routes: plan, weight, frozen, nodes) that the gateway and the simulated fleet
  route by, a pending emergency request, the load window the gearbox decides on, the registry
  version it serves, whether it is latency-critical, its back-off after refused PREPAREs, a
  staged switch on its way, its replica bounds and scale-to-zero idle time, and who created it.
* `Decision` - every decision the gearbox made, switch or not: trigger, outcome, the hysteresis
  factor, candidates with gain / cost / threshold, the full scheduler Decision, and in advisory
  mode its approval. A "stay" that repeats the deployment's last decision (same trigger, gear and
  reasons) is counted on that row - `repeats`, `last_at`, and the latest figures - not stored
  again (issue 19: a ~6.7 KB row per tick while nothing changed; actions.do_record_decision).
* `Transition` - one gear change: seq (strictly increasing per deployment), kind (auto |
  approved | manual | emergency | rollout), phase and step, from/to gear, the Decision that caused
  it, the registry version its new plans load, what moved, and `record`: the executor's
  TransitionRecord (the source of truth for resuming it). At most one is active per deployment:
  the database enforces it (a partial unique index), whatever the code does.
* `TransitionStep` - one attempt of one step, with its timing, outcome, error and result.
* `GpuReservation` - the ledger PREPARE books: memory a deployment's plan holds on a GPU.
* `Job` - a fine-tune or batch job on the same GPUs (priority 1): what it wants, its state, the
  GPUs it holds, its progress (scheduler/pool/jobs.py).
* `ServingSample` - what the engines of a deployment's routed plans reported, summed, once per report
  (the tick stores it): the serving charts' history (the last hour is kept).
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

ACTIVE_PHASES = ("prepare", "switch", "cleanup", "rollback")
PHASES = ACTIVE_PHASES + ("done", "rolled_back")


class Deployment(models.Model):
    AUTO, ADVISORY, PINNED, EMERGENCY = "auto", "advisory", "pinned", "emergency"
    MODES = [(m, m) for m in (AUTO, ADVISORY, PINNED, EMERGENCY)]

    name = models.CharField(max_length=64, unique=True)  # the deployment id (scenario `deployment`)
    model_name = models.CharField(max_length=128)  # scheduler.modelspec catalog name
    ttft_ms = models.FloatField()
    tpot_ms = models.FloatField()
    priority = models.IntegerField(default=0)  # higher is served first
    mode = models.CharField(max_length=16, choices=MODES, default=AUTO)
    baseline_gear = models.JSONField()  # Gear.to_dict(): the static plan, the emergency target
    baseline_by = models.CharField(max_length=160, blank=True, default="")  # an operator who set it (kept by loaders)
    current_gear = models.JSONField(null=True, blank=True)  # null: nothing runs yet
    pinned_gear = models.JSONField(null=True, blank=True)  # set while pinned: the gear held (emergency: its target)
    routing_version = models.PositiveBigIntegerField(default=0)  # bumped by every routing commit
    routing = models.JSONField(default=list)  # [Route.to_dict()]: plan, weight, frozen, nodes
    last_transition_seq = models.PositiveBigIntegerField(default=0)  # claimed by a conditional update
    emergency_requested_at = models.DateTimeField(null=True, blank=True)  # pending emergency downshift
    emergency_reason = models.TextField(blank=True, default="")
    emergency_actor = models.CharField(max_length=160, blank=True, default="")
    deleting_since = models.DateTimeField(null=True, blank=True)  # being drained, then deleted (lifecycle.py)
    load_window = models.JSONField(default=dict)  # gearbox.LoadWindow samples
    # the registry version its plans load and the gateway tokenizes for; null: none registered (nothing
    # to check). Only a rollout (or the first binding, before anything runs) changes it: registering
    # a version changes nothing that serves.
    model_version = models.ForeignKey("registry.ModelVersion", null=True, blank=True, on_delete=models.PROTECT,
                                      related_name="deployments")
    latency_critical = models.BooleanField(default=False)  # keep its plans off blocks that keep shrinking
    # bounds of its pool scaling (scheduler/pool): how many replicas of its plan it may run; 0 lets it
    # scale to zero after `idle_to_zero_s` without requests (null: never)
    min_replicas = models.PositiveIntegerField(default=1)
    max_replicas = models.PositiveIntegerField(default=8)
    idle_to_zero_s = models.FloatField(null=True, blank=True)
    # scaled to zero (console/gearbox/zero.py): since when its gear is released (null: not at zero), and
    # since when the gateway holds a request for it (null: none held - nothing wakes it)
    zero_since = models.DateTimeField(null=True, blank=True)
    wake_requested_at = models.DateTimeField(null=True, blank=True)
    # who created it through the API or the console (null: a scenario file, or the user was removed)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    # scheduler.backoff.Backoff.to_dict() after refused PREPAREs, with "seq": the last transition folded in
    backoff = models.JSONField(default=dict)
    # a staged switch on its way (scheduler.staging): the gear its second stage goes to once the
    # transition `staged_seq` is done, and the kind that transition had (auto, manual, emergency)
    staged_gear = models.JSONField(null=True, blank=True)
    staged_seq = models.PositiveBigIntegerField(default=0)
    staged_kind = models.CharField(max_length=16, blank=True, default="")
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        ordering = ["-priority", "name"]
        constraints = [
            models.CheckConstraint(condition=models.Q(min_replicas__lte=models.F("max_replicas")),
                                   name="gearbox_replicas_ordered"),
            models.CheckConstraint(condition=models.Q(max_replicas__gte=1), name="gearbox_max_replicas_positive"),
            models.CheckConstraint(condition=models.Q(idle_to_zero_s__isnull=True) | models.Q(idle_to_zero_s__gte=0),
                                   name="gearbox_idle_to_zero_not_negative"),
        ]

    def __str__(self) -> str:
        return self.name


class Decision(models.Model):
    """One gearbox decision (DESIGN.md invariant 5: explainable and audited)."""

    NONE, PENDING, APPROVED, SUPERSEDED = "", "pending", "approved", "superseded"
    APPROVALS = [(a, a or "none") for a in (NONE, PENDING, APPROVED, SUPERSEDED)]

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="decisions")
    at = models.DateTimeField(db_index=True)
    trigger = models.CharField(max_length=16)  # periodic | topology | load | emergency | manual
    outcome = models.CharField(max_length=16)  # switch | stay | advise | deferred | blocked
    factor = models.FloatField()  # the hysteresis factor applied
    current_gear_id = models.CharField(max_length=40, blank=True, default="")
    target_gear_id = models.CharField(max_length=40, blank=True, default="")
    candidates = models.JSONField(default=list)  # [{gear_id, shape, gain_tokens, cost_tokens, threshold_tokens, ...}]
    reasons = models.JSONField(default=list)
    decision = models.JSONField()  # scheduler.gearbox.Decision.to_dict()
    actor = models.CharField(max_length=160)  # who asked: system:gearbox, user:alice
    note = models.TextField(blank=True, default="")  # what became of it (e.g. not started: lost a race)
    approval = models.CharField(max_length=16, choices=APPROVALS, blank=True, default=NONE)
    approved_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                    related_name="+")
    approved_at = models.DateTimeField(null=True, blank=True)
    repeats = models.PositiveIntegerField(default=1)  # ticks that decided this, the first included
    last_at = models.DateTimeField(null=True, blank=True)  # the last of them (null: rows from before repeats)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["deployment", "-id"], name="gearbox_decision_newest")]


class Transition(models.Model):
    AUTO, APPROVED, MANUAL, EMERGENCY, ROLLOUT = "auto", "approved", "manual", "emergency", "rollout"
    KINDS = [(k, k) for k in (AUTO, APPROVED, MANUAL, EMERGENCY, ROLLOUT)]

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="transitions")
    seq = models.PositiveBigIntegerField()
    kind = models.CharField(max_length=16, choices=KINDS)
    phase = models.CharField(max_length=16, choices=[(p, p) for p in PHASES])
    step = models.CharField(max_length=32, blank=True, default="")  # the step running or last run
    attempt = models.PositiveIntegerField(default=0)
    version = models.PositiveBigIntegerField(default=1)  # every save is conditional on it
    from_gear = models.JSONField(null=True, blank=True)
    to_gear = models.JSONField()
    decision = models.ForeignKey(Decision, null=True, blank=True, on_delete=models.SET_NULL,
                                 related_name="transitions")
    record = models.JSONField()  # scheduler.transition.TransitionRecord.to_dict()
    error = models.TextField(blank=True, default="")
    abort_reason = models.TextField(blank=True, default="")  # an operator asked it to roll back
    actor = models.CharField(max_length=160)  # who started it
    # the registry version its new plans load: the deployment's, or (a rollout) the one rolled out
    model_version = models.ForeignKey("registry.ModelVersion", null=True, blank=True, on_delete=models.PROTECT,
                                      related_name="transitions")
    kv_bytes_migrated = models.PositiveBigIntegerField(default=0)
    tokens_replayed = models.PositiveBigIntegerField(default=0)
    seqs_migrated = models.PositiveIntegerField(default=0)
    seqs_replayed = models.PositiveIntegerField(default=0)
    seqs_finished = models.PositiveIntegerField(default=0)
    seqs_failed = models.PositiveIntegerField(default=0)
    stall_s_max = models.FloatField(default=0.0)
    wake_at = models.DateTimeField(null=True, blank=True, db_index=True)  # advance again by then (timeouts)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(fields=["deployment", "seq"], name="gearbox_transition_unique_seq"),
            # DESIGN.md invariant 3, held by the database: one active transition per deployment
            models.UniqueConstraint(fields=["deployment"], condition=models.Q(phase__in=ACTIVE_PHASES),
                                    name="gearbox_one_active_transition"),
        ]

    @property
    def active(self) -> bool:
        return self.phase in ACTIVE_PHASES

    def __str__(self) -> str:
        return f"{self.deployment_id}#{self.seq} {self.phase}"


class TransitionStep(models.Model):
    """One attempt of one step of a transition."""

    transition = models.ForeignKey(Transition, on_delete=models.CASCADE, related_name="steps")
    step = models.CharField(max_length=32)
    phase = models.CharField(max_length=16)
    attempt = models.PositiveIntegerField()
    state = models.CharField(max_length=16)  # running | ok | failed | abandoned
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    note = models.TextField(blank=True, default="")  # what it decided to do
    error = models.TextField(blank=True, default="")
    reason = models.CharField(max_length=32, blank=True, default="")  # preempted | timeout | failed | ...
    commands = models.JSONField(default=list)  # keys of the agent commands it sent
    result = models.JSONField(default=dict)

    class Meta:
        ordering = ["id"]
        constraints = [models.UniqueConstraint(fields=["transition", "step", "attempt"],
                                               name="gearbox_step_unique_attempt")]


class GpuReservation(models.Model):
    """Memory a deployment's plan holds on a GPU (booked in PREPARE, dropped in CLEANUP/ROLLBACK)."""

    gpu_uuid = models.CharField(max_length=128, db_index=True)
    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="reservations")
    plan_id = models.CharField(max_length=40)
    mem_bytes = models.PositiveBigIntegerField()
    transition_seq = models.PositiveBigIntegerField()
    created_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["gpu_uuid", "deployment", "plan_id"],
                                               name="gearbox_reservation_unique")]


class ServingSample(models.Model):
    """One point of a deployment's serving history (console/gearbox/ticks.py stores them)."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="serving_samples")
    at = models.DateTimeField()  # when the newest of the summed reports arrived
    tokens_per_s = models.FloatField()  # output tokens/s, summed over the routed plans
    ttft_p50_ms = models.FloatField(null=True, blank=True)  # worst over the plans
    ttft_p95_ms = models.FloatField(null=True, blank=True)
    tpot_p95_ms = models.FloatField(null=True, blank=True)
    running = models.PositiveIntegerField(default=0)
    waiting = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["at"]
        indexes = [models.Index(fields=["deployment", "at"], name="gearbox_serving_at")]


class Job(models.Model):
    """A fine-tune or batch job on the inference pool (scheduler/pool/jobs.py: the rules; seed 004
    sections 2.1 and 5.2): it holds whole GPUs at a low priority and yields them, after a
    checkpoint within `grace_s`, to a deployment of higher priority; it resumes when GPUs are free.
    Created and deleted through /api/v1/jobs (console/gearbox/jobs.py). The tick admits it onto
    free GPUs and asks it to yield (console/gearbox/job_admission.py); its runner, outside
    FlexPipe, reads it and acknowledges its checkpoints (POST /api/v1/jobs/<name>/checkpointed).
    Its fields are scheduler.pool.jobs.JobState's, the times as datetimes."""

    QUEUED, RUNNING, YIELDING, CHECKPOINTED, DONE = "queued", "running", "yielding", "checkpointed", "done"
    STATES = [(s, s) for s in (QUEUED, RUNNING, YIELDING, CHECKPOINTED, DONE)]
    HOLDING = (RUNNING, YIELDING)

    name = models.CharField(max_length=64, unique=True)
    gpus = models.PositiveIntegerField()  # GPUs it wants, all of them or none
    gpu_model = models.CharField(max_length=64, blank=True, default="")  # a catalog GPU model; "": any
    priority = models.IntegerField(default=1)  # below the deployments that may take its GPUs (inference: 10)
    grace_s = models.FloatField(default=30.0)  # how long it may take to release its GPUs once asked
    checkpoint_s = models.FloatField(default=20.0)  # how long writing its checkpoint takes
    work_gpu_s = models.FloatField()  # its total work, GPU-seconds
    progress_gpu_s = models.FloatField(default=0.0)  # done so far (its last checkpoint while it waits)
    saved_gpu_s = models.FloatField(default=0.0)  # the work its last checkpoint holds (a resume starts there)
    running_since = models.DateTimeField(null=True, blank=True)  # running: when it (re)started from saved_gpu_s
    yield_by = models.DateTimeField(null=True, blank=True)  # yielding: its GPUs are freed then at the latest
    taken_by = models.CharField(max_length=64, blank=True, default="")  # yielding: the deployment that asked
    lost_gpu_s = models.FloatField(default=0.0)  # work lost so far (deadlines missed, GPUs lost)
    done_at = models.DateTimeField(null=True, blank=True)
    state = models.CharField(max_length=16, choices=STATES, default=QUEUED)
    gpu_uuids = models.JSONField(default=list)  # what it holds (running, yielding)
    yields = models.PositiveIntegerField(default=0)
    # SHA-256 of its runner's token (console/gearbox/runner.py); the token itself is shown once
    runner_token_hash = models.CharField(max_length=64, blank=True, default="", db_index=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        ordering = ["created_at", "name"]
        constraints = [
            models.CheckConstraint(condition=models.Q(gpus__gte=1), name="gearbox_job_gpus_positive"),
            models.CheckConstraint(condition=models.Q(work_gpu_s__gt=0), name="gearbox_job_work_positive"),
        ]

    def __str__(self) -> str:
        return self.name
