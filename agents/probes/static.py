"""The static probe: a node's GPUs described in a JSON or YAML file.

For agents on machines where NVML cannot run (no driver in the container, a non-NVIDIA
accelerator, a laptop demo) and for tests. The file:

    gpus:
      - uuid: GPU-a100-0            # unique on the node
        index: 0
        model: A100-80G              # a catalog name, or the name of custom_spec
        mem_total_gib: 80            # or mem_total_bytes: 85899345920 (exactly one of them)
        nvlink_group: nvl0           # optional: GPUs with the same group share an NVLink domain
        custom_spec: {...}           # optional: datasheet figures of a GPU outside the catalog
        state:                       # optional: what reports say (default: idle, healthy)
          mem_used_bytes: 0
          sm_util: 0.0
          temperature_c: 30.0
          healthy: true
          allocatable: true
          xid_errors: 0
          ecc_errors: 0

Every problem is reported with its key path (`gpus[1].state.sm_util: must be <= 1.0; got 2.0`),
all at once, by the readers of agents/schema.py. `report()` re-reads the file when it changed,
so an operator (or a test) can mark a GPU unhealthy by editing it; the set of GPUs is fixed at
registration, and a file that changes it is refused until the agent registers again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from agents.probes.gpu_names import CATALOG_NAMES
from agents.protocol import GpuInfo, GpuReport
from agents.schema import ObjectReader, SchemaError, read_document

_MAX_GPUS = 64
_MAX_MEM_BYTES = 4 * 1024**4  # as agents/protocol/: catches GiB-vs-bytes slips


def _read_file(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SchemaError({"(file)": f"cannot read {path}: {exc.strerror or exc}"}, "static probe file") from None
    is_yaml = path.suffix.lower() in (".yaml", ".yml")
    try:
        return yaml.safe_load(text) if is_yaml else json.loads(text)
    except (ValueError, yaml.YAMLError) as exc:  # json.JSONDecodeError is a ValueError
        kind = "YAML" if is_yaml else "JSON"
        raise SchemaError({"(file)": f"{path} is not valid {kind}: {' '.join(str(exc).split())}"},
                          "static probe file") from None


def parse_static(doc: Any) -> tuple[tuple[GpuInfo, ...], tuple[GpuReport, ...]]:
    """Validate a decoded static-probe document; raise SchemaError naming every bad key."""
    r, problems = read_document(doc)
    infos: list[GpuInfo] = []
    reports: list[GpuReport] = []
    seen_uuid: dict[str, str] = {}
    seen_index: dict[int, str] = {}
    glist = r.list("gpus", min_len=1, max_len=_MAX_GPUS)
    if glist is not None:
        for g in glist.objects():
            info, report = _gpu(g, seen_uuid, seen_index)
            if info is not None and report is not None:
                infos.append(info)
                reports.append(report)
    r.done()
    problems.raise_if_any("static probe file")
    return tuple(infos), tuple(reports)


def _gpu(g: ObjectReader, seen_uuid: dict[str, str],
         seen_index: dict[int, str]) -> tuple[GpuInfo | None, GpuReport | None]:
    uuid = g.str("uuid", max_len=128)
    index = g.int("index", min=0, max=_MAX_GPUS - 1)
    model = g.str("model", max_len=64)
    mem_bytes = g.int("mem_total_bytes", None, min=1, max=_MAX_MEM_BYTES)
    mem_gib = g.num("mem_total_gib", None, min=0.0, exclusive_min=True, max=_MAX_MEM_BYTES / 2**30)
    group = g.str("nvlink_group", None, max_len=64)
    custom = g.raw("custom_spec", None)
    if custom is not None and not isinstance(custom, dict):
        g.fail("custom_spec", "must be an object")
        custom = None
    if g.has("mem_total_bytes") and g.has("mem_total_gib"):
        g.fail("mem_total_gib", "give mem_total_bytes or mem_total_gib, not both")
    elif not g.has("mem_total_bytes") and not g.has("mem_total_gib"):
        g.fail("mem_total_bytes", "is required (or mem_total_gib)")
    mem_total = mem_bytes if mem_bytes is not None else (round(mem_gib * 2**30) if mem_gib is not None else None)
    if model is not None:
        if custom is not None:
            if custom.get("name", model) != model:
                g.fail("custom_spec", f"its name must equal model ({model!r}); got {custom.get('name')!r}")
        elif model not in CATALOG_NAMES:
            g.fail("model", f"not in the catalog ({', '.join(CATALOG_NAMES)}); "
                            "to use another GPU, add custom_spec with its datasheet figures")
    state = _state(g, mem_total)
    g.done()
    if uuid is not None:
        if uuid in seen_uuid:
            g.fail("uuid", f"duplicates {seen_uuid[uuid]}")
            uuid = None
        else:
            seen_uuid[uuid] = g.child_path("uuid")
    if index is not None:
        if index in seen_index:
            g.fail("index", f"duplicates {seen_index[index]}")
            index = None
        else:
            seen_index[index] = g.child_path("index")
    if None in (uuid, index, model, mem_total) or state is None:
        return None, None
    assert uuid is not None and index is not None and model is not None and mem_total is not None  # noqa: S101
    info = GpuInfo(uuid, index, model, mem_total, group, custom)
    return info, GpuReport(uuid=uuid, mem_total_bytes=mem_total, **state)


def _state(g: ObjectReader, mem_total: int | None) -> dict[str, Any] | None:
    defaults: dict[str, Any] = {"mem_used_bytes": 0, "sm_util": 0.0, "temperature_c": 30.0, "healthy": True,
                                "allocatable": True, "xid_errors": 0, "ecc_errors": 0}
    s = g.obj("state", None)
    if s is None:
        return defaults if g.ok else None
    values = {
        "mem_used_bytes": s.int("mem_used_bytes", 0, min=0, max=_MAX_MEM_BYTES),
        "sm_util": s.num("sm_util", 0.0, min=0.0, max=1.0),
        "temperature_c": s.num("temperature_c", 30.0, min=-50.0, max=200.0),
        "healthy": s.bool("healthy", True),
        "allocatable": s.bool("allocatable", True),
        "xid_errors": s.int("xid_errors", 0, min=0),
        "ecc_errors": s.int("ecc_errors", 0, min=0),
    }
    s.done()
    used = values["mem_used_bytes"]
    if used is not None and mem_total is not None and used > mem_total:
        s.fail("mem_used_bytes", f"must not exceed the GPU's memory ({mem_total} bytes); got {used}")
        return None
    if not s.ok or None in values.values():
        return None
    return values


class StaticProbe:
    """GPUs from a file. `gpus()` is fixed at construction; `report()` follows edits of the file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._mtime_ns = self._stat()
        self._gpus, self._reports = parse_static(_read_file(self.path))

    def _stat(self) -> int:
        try:
            return os.stat(self.path).st_mtime_ns
        except OSError:
            return -1

    def gpus(self) -> tuple[GpuInfo, ...]:
        return self._gpus

    def report(self) -> tuple[GpuReport, ...]:
        mtime = self._stat()
        if mtime != self._mtime_ns:
            gpus, reports = parse_static(_read_file(self.path))
            if {g.uuid for g in gpus} != {g.uuid for g in self._gpus}:
                raise SchemaError({"gpus": "the set of GPUs changed since registration; restart the agent "
                                           "to register the new set"}, "static probe file")
            self._mtime_ns = mtime
            order = {g.uuid: i for i, g in enumerate(self._gpus)}
            self._reports = tuple(sorted(reports, key=lambda rep: order[rep.uuid]))
        return self._reports

    def close(self) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    """`python -m agents.probes.static FILE`: check a node file and show what the agent would send."""
    import argparse
    import sys
    from dataclasses import asdict

    parser = argparse.ArgumentParser(description="Check a static probe file (JSON or YAML).")
    parser.add_argument("file")
    args = parser.parse_args(argv)
    try:
        probe = StaticProbe(args.file)
    except SchemaError as exc:
        for path, reason in exc.errors.items():
            print(f"{args.file}: {path}: {reason}", file=sys.stderr)
        return 1
    print(json.dumps({"gpus": [asdict(g) for g in probe.gpus()],
                      "reports": [asdict(r) for r in probe.report()]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
