"""The model registry: one row per model version, keyed by the SHA256 of its weights (seed 004, 3.1, 5.3).

Identity: (name, version) names a version; its weights are the ones whose SHA256 was registered.
The same name with other weights is another version (another row), never an edit of this one.

    status        meaning                                                  next
    verifying     a local file is being hashed by the `registry.verify_weights` task   verified | quarantined
    awaiting_agent  remote weights: the first agent that loads them hashes them and reports  verified | quarantined
    verified      an observed digest matched the registered one            quarantined (a later mismatch)
    quarantined   an observed digest did not match, or the file could not be read: never loaded
    retired       taken out of service by an admin (terminal)

Every transition goes through console/registry/actions.py, which writes the audit row.
"""

from __future__ import annotations

from django.db import models

VERIFYING, AWAITING_AGENT, VERIFIED, QUARANTINED, RETIRED = (
    "verifying", "awaiting_agent", "verified", "quarantined", "retired")
STATUSES = (VERIFYING, AWAITING_AGENT, VERIFIED, QUARANTINED, RETIRED)


class ModelVersion(models.Model):
    VERIFYING, AWAITING_AGENT, VERIFIED, QUARANTINED, RETIRED = VERIFYING, AWAITING_AGENT, VERIFIED, QUARANTINED, RETIRED
    STATUSES = STATUSES
    # States an observed digest can still move (a retired version is out of service: reports are ignored).
    CHECKABLE = (VERIFYING, AWAITING_AGENT, VERIFIED)
    VLLM, TORCH = "vllm", "torch"
    ENGINES = (VLLM, TORCH)

    name = models.CharField(max_length=128)
    version = models.CharField(max_length=64)
    engine = models.CharField(max_length=16, choices=[(e, e) for e in ENGINES])
    # A name of scheduler.modelspec's catalog (a JSON string) or a Hugging Face config.json (an object).
    architecture = models.JSONField()
    weights_uri = models.CharField(max_length=1024)  # file:///..., /abs/path, http(s)://, s3://, hf://
    sha256 = models.CharField(max_length=64, db_index=True)  # registered digest: 64 lowercase hex
    tokenizer = models.CharField(max_length=1024)  # this model's own tokenizer: a path, a URI or a name
    max_context = models.PositiveIntegerField()  # tokens
    min_gpu_mem_bytes = models.PositiveBigIntegerField()  # the smallest GPU memory it may be placed on
    warmup_tokens = models.PositiveIntegerField()  # tokens to generate after loading, before serving

    status = models.CharField(max_length=16, choices=[(s, s) for s in STATUSES], db_index=True)
    status_detail = models.CharField(max_length=500, blank=True, default="")  # why the status is what it is
    weights_bytes = models.PositiveBigIntegerField(null=True, blank=True)  # size of a local weights file
    registered_at = models.DateTimeField()
    registered_by = models.CharField(max_length=160)  # audit actor: "user:alice"
    verified_at = models.DateTimeField(null=True, blank=True)  # when a digest last matched
    verified_by = models.CharField(max_length=160, blank=True, default="")  # "system:registry", "agent:a1"
    observed_sha256 = models.CharField(max_length=64, blank=True, default="")  # the digest that did not match
    quarantined_at = models.DateTimeField(null=True, blank=True)
    quarantined_by = models.CharField(max_length=160, blank=True, default="")
    retired_at = models.DateTimeField(null=True, blank=True)
    retired_by = models.CharField(max_length=160, blank=True, default="")

    class Meta:
        ordering = ["name", "-registered_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["name", "version"], name="registry_unique_name_version"),
            # Same name and same weights twice would be one entity under two version labels.
            models.UniqueConstraint(fields=["name", "sha256"], name="registry_unique_name_sha256"),
            models.CheckConstraint(condition=models.Q(status__in=STATUSES), name="registry_status_known"),
        ]

    def __str__(self) -> str:
        return f"{self.name}@{self.version} ({self.sha256[:12]}, {self.status})"
