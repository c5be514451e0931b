"""The model spec the console plans a deployment's gears with: the built-in catalog, or the registry.

    spec_for(deployment | model version | name) -> scheduler.modelspec.ModelSpec
    requirements_for(deployment | model version) -> scheduler.requirements.Requirements
    planner_options(deployment | model version) -> PlannerOptions with them, or None (nothing required)

A name of scheduler.modelspec's catalog is that catalog entry (no database read). Any other model is
planned from what its registry version says: a version whose `architecture` is a catalog name gets
that entry under the version's own name (the name its gears and plans carry), one whose
`architecture` is a Hugging Face config.json gets `scheduler.modelspec.from_hf_config` of it - the
same parser that accepted it at registration (console/registry/architecture.py), so a config the
registry took always yields a spec. A deployment uses the version it serves; a bare name, the newest
version of that name. Nothing found: ValueError naming the model, as `model_spec` raises.

The version's `min_gpu_mem_bytes` and `engine` are its placement requirements: the planner keeps
its plans off GPUs and nodes that do not meet them, and an operator's gear there is refused
(scheduler/requirements.py). A deployment without a registry version requires nothing.

A version's architecture never changes (a version is its weights: console/registry/models.py), so
the spec of a version is kept per process by its id and digest.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from scheduler.modelspec import CATALOG, ModelSpec, from_hf_config, model_spec
from scheduler.planner import PlannerOptions
from scheduler.requirements import NONE, Requirements

_by_version: dict[tuple[int, str, str], ModelSpec] = {}  # (id, sha256, name) -> spec


def _catalog(name: str) -> ModelSpec | None:
    if name in CATALOG:
        return CATALOG[name]
    try:
        return model_spec(name)
    except ValueError:
        return None


def _of_version(version: Any, name: str) -> ModelSpec:
    key = (int(version.pk), str(version.sha256), name)
    hit = _by_version.get(key)
    if hit is not None:
        return hit
    arch = version.architecture
    if isinstance(arch, str):
        spec = model_spec(arch)  # (a name the registry checked against the catalog)
        spec = spec if spec.name == name else replace(spec, name=name)
    elif isinstance(arch, dict):
        try:
            spec = from_hf_config(arch, name=name)
        except ValueError as exc:
            raise ValueError(f"model {name!r}: the architecture of {version.name} {version.version} is not "
                             f"usable: {exc}") from None
    else:
        raise ValueError(f"model {name!r}: version {version.name} {version.version} has no architecture")
    _by_version[key] = spec
    return spec


def spec_for(target: Any) -> ModelSpec:
    """The spec to plan `target` with (module docstring): a Deployment, a ModelVersion or a model name."""
    from console.gearbox.models import Deployment
    from console.registry.models import ModelVersion

    if isinstance(target, ModelVersion):
        return _catalog(target.name) or _of_version(target, target.name)
    if isinstance(target, Deployment):
        found = _catalog(target.model_name)
        if found is not None:
            return found
        if target.model_version_id is not None:
            return _of_version(target.model_version, target.model_name)
        target = target.model_name
    if not isinstance(target, str):
        raise TypeError(f"spec_for: a Deployment, a ModelVersion or a name, not {type(target).__name__}")
    found = _catalog(target)
    if found is not None:
        return found
    newest = ModelVersion.objects.filter(name=target).exclude(status=ModelVersion.RETIRED).order_by(
        "-registered_at", "-id").first() or ModelVersion.objects.filter(name=target).order_by(
        "-registered_at", "-id").first()
    if newest is None:
        raise ValueError(f"unknown model {target!r}: not in the catalog ({', '.join(CATALOG)}) and no registry "
                         "version has that name")
    return _of_version(newest, target)


def requirements_for(target: Any) -> Requirements:
    """The placement requirements of a ModelVersion, or of the version a Deployment serves (module docstring)."""
    from console.gearbox.models import Deployment

    version = target.model_version if isinstance(target, Deployment) and target.model_version_id else target
    if isinstance(target, Deployment) and not target.model_version_id:
        return NONE
    return Requirements(min_gpu_mem_bytes=int(version.min_gpu_mem_bytes or 0), engine=version.engine or None,
                        source=f"{version.name} {version.version}")


def planner_options(target: Any) -> PlannerOptions | None:
    """PlannerOptions that carry `target`'s requirements; None when it requires nothing (the defaults)."""
    req = requirements_for(target)
    return PlannerOptions(requires=req) if req.any else None


__all__ = ["planner_options", "requirements_for", "spec_for"]
