"""manage.py register_local_model NAME DIR [--model-version V] [--engine torch|vllm] [--deploy]: register a
model folder on this machine (idempotent).

For `make run ENGINE=torch|vllm`: the registry keys weights by SHA256, so prepare_plan carries the
digest and every agent checks the weights it loads against it; the gateway tokenizes with the
folder's tokenizer. Registering the same folder again changes nothing. Registering changes nothing
that serves either: `--deploy` also binds the version to each deployment of the model that serves
none yet and runs nothing (its first gear loads it); a deployment that serves another version is
left alone (roll this one out from the console: Registry, Roll out).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from agents.engines.torch.weights import WEIGHTS_FILE, sha256_file
from console.registry.actions import Refused, VersionSpec, do_register_model_version


class Command(BaseCommand):
    help = "Register a local model folder (weights, config, tokenizer) in the model registry. Idempotent."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("name", help="the model's catalog name, e.g. tiny-llama")
        parser.add_argument("dir", help="the model folder (model.safetensors, config.json, tokenizer.json)")
        parser.add_argument("--model-version", default="local")
        parser.add_argument("--engine", default="torch", choices=("torch", "vllm"))
        parser.add_argument("--warmup-tokens", type=int, default=8)
        parser.add_argument("--deploy", action="store_true",
                            help="bind it to the model's deployments that serve no version and run nothing yet")

    def handle(self, *args: Any, **options: Any) -> None:
        folder = Path(options["dir"]).resolve()
        weights = folder / WEIGHTS_FILE
        if not weights.is_file():
            raise CommandError(f"dir: {weights} does not exist")
        config = json.loads((folder / "config.json").read_text())
        spec = VersionSpec(
            name=options["name"], version=options["model_version"], engine=options["engine"],
            architecture=options["name"], weights_uri=str(weights), sha256=sha256_file(weights),
            tokenizer=str(folder), max_context=int(config.get("max_position_embeddings", 2048)),
            min_gpu_mem_bytes=1, warmup_tokens=options["warmup_tokens"])
        try:
            reg = do_register_model_version(spec, actor="system:make-run")
        except Refused as exc:
            raise CommandError("; ".join(f"{k}: {v}" for k, v in exc.errors.items())) from None
        v = reg.version
        self.stdout.write(f"{v.name} {v.version}: {'registered' if reg.created else 'already registered'} "
                          f"(sha256 {v.sha256[:16]}..., {v.status})")
        if options["deploy"]:
            from console.gearbox.models import Deployment
            from console.gearbox.rollout import do_rollout_version

            for dep in Deployment.objects.filter(model_name=v.name, model_version__isnull=True,
                                                current_gear__isnull=True):
                state, _ = do_rollout_version(dep, v, actor="system:make-run")
                self.stdout.write(f"{dep.name}: {state} to {v.name} {v.version}")
