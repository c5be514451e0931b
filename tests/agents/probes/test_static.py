"""The static probe: GPUs from a JSON/YAML file, validated with errors that name the key path."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from agents.probes import open_probe
from agents.probes.static import StaticProbe, parse_static
from agents.protocol import RegisterRequest, Report, parse_register, parse_report
from agents.schema import SchemaError

YAML_NODE = """\
# two A100s on one NVLink bridge, and a GPU the catalog lacks
gpus:
  - uuid: GPU-a
    index: 0
    model: A100-80G
    mem_total_gib: 80
    nvlink_group: nvl0
  - uuid: GPU-b
    index: 1
    model: A100-80G
    mem_total_bytes: 85899345920
    nvlink_group: nvl0
    state: {mem_used_bytes: 1073741824, sm_util: 0.5, temperature_c: 55}
  - uuid: GPU-c
    index: 2
    model: MI300X
    mem_total_gib: 192
    custom_spec:
      name: MI300X
      bf16_flops: 1.307e15
      mem_bytes: 206158430208
      hbm_bytes_per_s: 5.3e12
      host_link_bytes_per_s: 6.4e10
"""


def _write(tmp_path: Path, doc: Any, name: str = "node.json") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def _errors(doc: Any) -> dict[str, str]:
    with pytest.raises(SchemaError) as info:
        parse_static(doc)
    return info.value.errors


def test_it_reads_a_yaml_node(tmp_path: Path) -> None:
    probe = open_probe("static", static_path=_write(tmp_path, YAML_NODE, "node.yaml"))
    gpus = probe.gpus()
    assert [g.uuid for g in gpus] == ["GPU-a", "GPU-b", "GPU-c"]
    assert gpus[0].mem_total_bytes == gpus[1].mem_total_bytes == 80 * 2**30
    assert [g.nvlink_group for g in gpus] == ["nvl0", "nvl0", None]
    assert gpus[2].custom_spec is not None and gpus[2].custom_spec["name"] == "MI300X"
    reports = probe.report()
    assert reports[0].healthy and reports[0].sm_util == 0.0 and reports[0].mem_used_bytes == 0
    assert (reports[1].mem_used_bytes, reports[1].sm_util, reports[1].temperature_c) == (2**30, 0.5, 55.0)
    # What the probe says is what the controller accepts.
    assert parse_register(RegisterRequest("n1", "n1", "t", gpus).to_dict()).gpus == gpus
    assert parse_report(Report("n1", 1, 1, reports).to_dict()).gpus == reports


def test_it_names_every_bad_key_at_once() -> None:
    errors = _errors({"gpus": [
        {"uuid": "GPU-a", "index": 0, "model": "A100-80G", "mem_total_gib": 80,
         "state": {"sm_util": 2.0, "healthy": "yes", "colour": "red"}},
        {"uuid": "GPU-a", "index": -1, "model": "A100-80G", "mem_total_bytes": "80GB"},
    ], "rack": "r1"})
    assert errors == {
        "gpus[0].state.sm_util": "must be <= 1.0; got 2.0",
        "gpus[0].state.healthy": "must be true or false, not a string",
        "gpus[0].state.colour": "unknown key",
        "gpus[1].index": "must be >= 0; got -1",
        "gpus[1].mem_total_bytes": "must be an integer, not a string",
        "gpus[1].uuid": "duplicates gpus[0].uuid",
        "rack": "unknown key",
    }


def test_memory_is_given_exactly_once() -> None:
    both = {"uuid": "g", "index": 0, "model": "L40S", "mem_total_gib": 48, "mem_total_bytes": 48 * 2**30}
    assert _errors({"gpus": [both]}) == {"gpus[0].mem_total_gib": "give mem_total_bytes or mem_total_gib, not both"}
    neither = {"uuid": "g", "index": 0, "model": "L40S"}
    assert _errors({"gpus": [neither]}) == {"gpus[0].mem_total_bytes": "is required (or mem_total_gib)"}


def test_an_unknown_model_needs_a_custom_spec() -> None:
    errors = _errors({"gpus": [{"uuid": "g", "index": 0, "model": "MI300X", "mem_total_gib": 192}]})
    assert errors["gpus[0].model"].startswith("not in the catalog (H200, H100-SXM,")
    assert "custom_spec" in errors["gpus[0].model"]
    mismatch = {"uuid": "g", "index": 0, "model": "MI300X", "mem_total_gib": 192, "custom_spec": {"name": "MI250"}}
    assert _errors({"gpus": [mismatch]}) == {
        "gpus[0].custom_spec": "its name must equal model ('MI300X'); got 'MI250'"}


def test_used_memory_cannot_exceed_the_gpu() -> None:
    gpu = {"uuid": "g", "index": 0, "model": "A10G", "mem_total_gib": 24,
           "state": {"mem_used_bytes": 25 * 2**30}}
    errors = _errors({"gpus": [gpu]})
    assert errors == {"gpus[0].state.mem_used_bytes":
                      f"must not exceed the GPU's memory ({24 * 2**30} bytes); got {25 * 2**30}"}


@pytest.mark.parametrize(("doc", "path", "reason"), [
    ([], "(document)", "must be an object, not a list"),
    ({}, "gpus", "is required"),
    ({"gpus": []}, "gpus", "must have at least 1 item"),
    ({"gpus": ["GPU-0"]}, "gpus[0]", "must be an object, not a string"),
    ({"gpus": [{"uuid": "g", "index": 0, "model": "L40S", "mem_total_gib": 48, "state": 3}]},
     "gpus[0].state", "must be an object, not an integer"),
])
def test_shapes_that_are_wrong(doc: Any, path: str, reason: str) -> None:
    assert _errors(doc)[path] == reason


def test_unreadable_and_malformed_files_say_which_file(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match=r"\(file\): cannot read .*missing.json"):
        StaticProbe(tmp_path / "missing.json")
    with pytest.raises(SchemaError, match=r"\(file\): .*bad.json is not valid JSON"):
        StaticProbe(_write(tmp_path, "{gpus: [", "bad.json"))
    with pytest.raises(SchemaError, match=r"\(file\): .*bad.yaml is not valid YAML"):
        StaticProbe(_write(tmp_path, "gpus: [\n  - {", "bad.yaml"))


def test_reports_follow_edits_of_the_file(tmp_path: Path) -> None:
    doc = {"gpus": [{"uuid": "g0", "index": 0, "model": "H100-SXM", "mem_total_gib": 80},
                    {"uuid": "g1", "index": 1, "model": "H100-SXM", "mem_total_gib": 80}]}
    path = _write(tmp_path, doc)
    probe = StaticProbe(path)
    assert [r.healthy for r in probe.report()] == [True, True]
    # The operator takes GPU 1 out of service; GPUs listed in another order are fine.
    doc["gpus"] = [doc["gpus"][1] | {"state": {"healthy": False, "xid_errors": 1}}, doc["gpus"][0]]
    _write(tmp_path, doc)
    os.utime(path, ns=(1, 10**18))  # a new mtime even on filesystems with coarse timestamps
    reports = probe.report()
    assert [(r.uuid, r.healthy, r.xid_errors) for r in reports] == [("g0", True, 0), ("g1", False, 1)]


def test_a_file_that_changes_the_set_of_gpus_is_refused(tmp_path: Path) -> None:
    doc = {"gpus": [{"uuid": "g0", "index": 0, "model": "L40S", "mem_total_gib": 48}]}
    path = _write(tmp_path, doc)
    probe = StaticProbe(path)
    before = probe.report()
    doc["gpus"].append({"uuid": "g1", "index": 1, "model": "L40S", "mem_total_gib": 48})
    _write(tmp_path, doc)
    os.utime(path, ns=(1, 10**18))
    with pytest.raises(SchemaError, match="gpus: the set of GPUs changed since registration"):
        probe.report()
    assert probe.gpus()[0].uuid == "g0" and len(probe.gpus()) == 1
    assert before == (probe._reports)  # the last good state is kept


def test_open_probe_static_needs_a_path() -> None:
    with pytest.raises(ValueError, match="static_path: the static probe needs a file"):
        open_probe("static")


def test_the_command_checks_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agents.probes.static import main

    good = _write(tmp_path, YAML_NODE, "node.yaml")
    assert main([str(good)]) == 0
    assert [g["uuid"] for g in json.loads(capsys.readouterr().out)["gpus"]] == ["GPU-a", "GPU-b", "GPU-c"]
    bad = _write(tmp_path, {"gpus": [{"uuid": "g", "index": 0, "model": "L40S"}]}, "bad.json")
    assert main([str(bad)]) == 1
    assert capsys.readouterr().err == f"{bad}: gpus[0].mem_total_bytes: is required (or mem_total_gib)\n"
