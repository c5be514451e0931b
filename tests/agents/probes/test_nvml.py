"""The NVML probe, replayed from a recording of an 8x H100 SXM node; and the real no-GPU exit."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agents.probes import NoGpuError, open_probe
from agents.probes.gpu_names import CATALOG_NAMES, catalog_name
from agents.probes.nvml import NvLink, NvmlProbe, main, nvlink_groups
from agents.probes.nvml_replay import FORMAT, RecordedNvml, record
from agents.protocol import RegisterRequest, Report, parse_register, parse_report

FIXTURE = Path(__file__).parent / "fixtures" / "nvml_hgx_h100_8gpu.json"
REPO = Path(__file__).resolve().parents[3]
GiB = 2**30


@pytest.fixture
def recording() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


@pytest.fixture
def h100(recording: dict[str, Any]) -> tuple[NvmlProbe, RecordedNvml]:
    source = RecordedNvml(recording)
    probe = NvmlProbe.open(source)
    yield probe, source
    probe.close()


def _device(index: int, name: str, bus: str, nvlinks: Any, **extra: Any) -> dict[str, Any]:
    return {"index": index, "uuid": f"GPU-test-{index}", "name": name, "pci_bus_id": f"00000000:{bus}:00.0",
            "nvlinks": nvlinks, **extra}


def _idle(total: int, ecc: Any = 0) -> dict[str, Any]:
    return {"memory": {"total": total, "free": total, "used": 0}, "utilization": {"gpu": 0, "memory": 0},
            "temperature_gpu": 30, "ecc_volatile_uncorrected": ecc}


def _recording(devices: list[dict[str, Any]], total: int = 80 * GiB, **extra: Any) -> dict[str, Any]:
    return {"format": FORMAT, "driver_version": "550.90.07", "devices": devices,
            "samples": [{"events": [], "devices": {d["uuid"]: _idle(total) for d in devices}}], **extra}


# -- registration: GPU list and NVLink groups ------------------------------------------------


def test_it_lists_the_eight_h100s_under_their_catalog_name(h100: tuple[NvmlProbe, RecordedNvml]) -> None:
    probe, _ = h100
    gpus = probe.gpus()
    assert [g.index for g in gpus] == list(range(8))
    assert {g.model for g in gpus} == {"H100-SXM"}
    assert {g.mem_total_bytes for g in gpus} == {81559 * 2**20}
    assert len({g.uuid for g in gpus}) == 8
    assert all(g.custom_spec is None for g in gpus)
    assert probe.driver_version == "550.90.07"


def test_all_gpus_behind_the_nvswitches_form_one_group(h100: tuple[NvmlProbe, RecordedNvml]) -> None:
    probe, _ = h100
    assert {g.nvlink_group for g in probe.gpus()} == {"nvl0"}
    # GPU 7 has link 11 down: 17 active links, still in the group through the other switches.
    per_gpu = {i: sum(1 for lk in probe.links if lk.gpu_index == i) for i in range(8)}
    assert per_gpu == {0: 18, 1: 18, 2: 18, 3: 18, 4: 18, 5: 18, 6: 18, 7: 17}
    assert {lk.remote_type for lk in probe.links} == {"switch"}


def test_its_gpu_list_is_what_the_controller_accepts(h100: tuple[NvmlProbe, RecordedNvml]) -> None:
    probe, source = h100
    req = RegisterRequest("dgx-h100-01", "dgx-h100-01", "test", probe.gpus(), backends=("vllm",))
    assert parse_register(req.to_dict()).gpus == probe.gpus()
    for seq in (1, 2, 3):
        report = Report("dgx-h100-01", 1, seq, probe.report())
        assert parse_report(report.to_dict()).gpus == report.gpus
        if seq < 3:
            source.advance()


def test_nvlink_bridged_pairs_make_two_groups() -> None:
    # Four PCIe A100s with NVLink bridges over pairs (0-1, 2-3): each link's far end is a GPU.
    def bridged(peer_bus: str) -> list[dict[str, Any]]:
        return [{"link": k, "state": 1, "remote_pci_bus_id": f"00000000:{peer_bus}:00.0",
                 "remote_device_type": pynvml.NVML_NVLINK_DEVICE_TYPE_GPU} for k in range(4)]

    buses = ["17", "31", "B1", "CA"]
    peers = ["31", "17", "CA", "B1"]
    devices = [_device(i, "NVIDIA A100 80GB PCIe", buses[i], bridged(peers[i])) for i in range(4)]
    with NvmlProbe.open(RecordedNvml(_recording(devices))) as probe:
        assert [g.nvlink_group for g in probe.gpus()] == ["nvl0", "nvl0", "nvl1", "nvl1"]


def test_gpus_without_nvlink_have_no_group() -> None:
    no_link = {"nvml_error": "NOT_SUPPORTED"}
    devices = [_device(i, "NVIDIA L40S", bus, no_link) for i, bus in enumerate(["01", "02"])]
    with NvmlProbe.open(RecordedNvml(_recording(devices, total=46068 * 2**20))) as probe:
        gpus = probe.gpus()
        assert [g.nvlink_group for g in gpus] == [None, None]
        assert [g.model for g in gpus] == ["L40S", "L40S"]
        assert probe.links == ()


def test_a_link_to_a_cpu_or_a_foreign_gpu_joins_nothing() -> None:
    bus = {"A": 0, "B": 1, "C": 2}
    links = [
        NvLink(0, 0, "CPU0", "cpu"),
        NvLink(1, 0, "CPU0", "cpu"),  # both reach the same CPU: still no GPU peer
        NvLink(2, 0, "OTHER-NODE", "gpu"),  # a GPU of another node
    ]
    assert nvlink_groups(links, bus) == {}
    # An unknown far end that is not a local GPU is taken for a switch: 0 and 2 share it.
    assert nvlink_groups([NvLink(0, 0, "SW", "unknown"), NvLink(2, 3, "SW", "unknown")], bus) == {0: "nvl0", 2: "nvl0"}


def test_group_names_follow_the_lowest_gpu_index() -> None:
    bus = {f"b{i}": i for i in range(6)}
    links = [NvLink(5, 0, "b4", "gpu"), NvLink(1, 0, "b0", "gpu"), NvLink(2, 0, "S", "switch"),
             NvLink(3, 0, "S", "switch")]
    assert nvlink_groups(links, bus) == {0: "nvl0", 1: "nvl0", 2: "nvl1", 3: "nvl1", 4: "nvl2", 5: "nvl2"}


def test_an_unknown_gpu_gets_a_custom_spec_from_what_nvml_tells() -> None:
    dev = _device(0, "NVIDIA GeForce RTX 4090", "01", {"nvml_error": "NOT_SUPPORTED"},
                  memory_bus_width=384, max_mem_clock_mhz=10501, max_pcie_link_generation=4,
                  max_pcie_link_width=16)
    with NvmlProbe.open(RecordedNvml(_recording([dev], total=24564 * 2**20))) as probe:
        (gpu,) = probe.gpus()
    assert gpu.model == "NVIDIA GeForce RTX 4090"
    spec = gpu.custom_spec
    assert spec is not None and spec["name"] == gpu.model
    assert spec["mem_bytes"] == 24564 * 2**20
    assert spec["hbm_bytes_per_s"] == pytest.approx(1.008e12, rel=1e-3)  # the datasheet's 1,008 GB/s
    assert spec["host_link_bytes_per_s"] == pytest.approx(31.5e9, rel=1e-2)  # PCIe Gen4 x16, one way
    assert "bf16_flops" not in spec and "bf16_flops" in spec["note"]
    assert spec["confidence"] == "low"


def test_a_custom_spec_leaves_out_what_nvml_does_not_support() -> None:
    dev = _device(0, "NVIDIA T4", "01", {"nvml_error": "NOT_SUPPORTED"})  # no bus width, no PCIe info
    with NvmlProbe.open(RecordedNvml(_recording([dev], total=15360 * 2**20))) as probe:
        spec = probe.gpus()[0].custom_spec
    assert spec is not None
    assert "hbm_bytes_per_s" not in spec and "host_link_bytes_per_s" not in spec
    assert spec["mem_bytes"] == 15360 * 2**20


@pytest.mark.parametrize(("nvml_name", "catalog"), [
    ("NVIDIA H100 80GB HBM3", "H100-SXM"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA A100-SXM4-80GB", "A100-80G"),
    ("NVIDIA A100-SXM4-40GB", "A100-40G"),
    ("A100-SXM4-40GB", "A100-40G"),  # drivers before R470 had no "NVIDIA " prefix
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA A10G", "A10G"),
    ("NVIDIA H100 PCIe", None),  # another board: other clocks and links, not the SXM entry
    ("NVIDIA H200 NVL", None),
    ("NVIDIA A100 80GB PCIe", None),
])
def test_nvml_names_map_to_catalog_names(nvml_name: str, catalog: str | None) -> None:
    assert catalog_name(nvml_name) == catalog
    if catalog is not None:
        assert catalog in CATALOG_NAMES


def test_catalog_names_exist_in_the_scheduler_catalog() -> None:
    hardware = pytest.importorskip("scheduler.hardware", reason="scheduler/hardware.py is on another branch")
    assert set(CATALOG_NAMES) <= set(hardware.CATALOG)


# -- reports: load, XID health, ECC -----------------------------------------------------------


def test_reports_carry_memory_utilisation_and_temperature(h100: tuple[NvmlProbe, RecordedNvml]) -> None:
    probe, _ = h100
    reports = probe.report()
    assert [r.uuid for r in reports] == [g.uuid for g in probe.gpus()]
    busy, idle = reports[0], reports[7]
    assert busy.mem_used_bytes == 74562 * 2**20 and busy.sm_util == pytest.approx(0.97)
    assert busy.temperature_c == 58.0
    assert idle.mem_used_bytes == 4 * 2**20 and idle.sm_util == 0.0 and idle.temperature_c == 34.0
    assert all(r.healthy and r.xid_errors == 0 and r.ecc_errors == 0 for r in reports)
    assert probe.health_reasons() == {}


def test_a_critical_xid_makes_its_gpu_unhealthy_for_good(h100: tuple[NvmlProbe, RecordedNvml]) -> None:
    probe, source = h100
    probe.report()
    source.advance()  # XID 79 on GPU 3, XID 94 + 1 uncorrectable ECC on GPU 6, XID 13 on GPU 1
    reports = probe.report()
    healthy = [r.healthy for r in reports]
    assert healthy == [True, True, True, False, True, True, False, True]
    assert [r.xid_errors for r in reports] == [0, 1, 0, 1, 0, 0, 1, 0]
    lost = reports[3]
    assert lost.mem_used_bytes == 0 and lost.mem_total_bytes == 81559 * 2**20
    reasons = probe.health_reasons()
    assert set(reasons) == {reports[3].uuid, reports[6].uuid}
    assert reasons[reports[3].uuid][0] == "XID 79: GPU has fallen off the bus"
    assert "GPU is lost" in reasons[reports[3].uuid][1]
    assert "XID 94: contained ECC error" in reasons[reports[6].uuid]
    assert reports[6].ecc_errors == 1
    source.advance()  # no new events: the verdicts stay
    later = probe.report()
    assert [r.healthy for r in later] == healthy
    assert [r.xid_errors for r in later] == [0, 1, 0, 1, 0, 0, 1, 0]


def test_uncorrectable_ecc_alone_makes_a_gpu_unhealthy(recording: dict[str, Any]) -> None:
    rec = copy.deepcopy(recording)
    uuid5 = rec["devices"][5]["uuid"]
    rec["samples"][1] = copy.deepcopy(rec["samples"][0])  # a quiet sample, but for GPU 5:
    rec["samples"][1]["devices"][uuid5] = {**rec["samples"][0]["devices"][uuid5], "ecc_volatile_uncorrected": 2}
    source = RecordedNvml(rec)
    with NvmlProbe.open(source) as probe:
        probe.report()
        source.advance()
        reports = probe.report()
        assert [r.index for r in probe.gpus() if not reports[r.index].healthy] == [5]
        assert reports[5].ecc_errors == 2 and reports[5].xid_errors == 0
        assert probe.health_reasons()[uuid5] == ["2 uncorrectable ECC error(s) since the driver loaded"]


def test_ecc_not_supported_counts_as_none() -> None:
    dev = _device(0, "NVIDIA L40S", "01", {"nvml_error": "NOT_SUPPORTED"})
    rec = _recording([dev])
    rec["samples"][0]["devices"][dev["uuid"]]["ecc_volatile_uncorrected"] = {"nvml_error": "NOT_SUPPORTED"}
    with NvmlProbe.open(RecordedNvml(rec)) as probe:
        (report,) = probe.report()
    assert report.healthy and report.ecc_errors == 0


def test_a_gpu_that_refuses_event_registration_still_reports() -> None:
    devices = [_device(0, "NVIDIA A10G", "1E", {"nvml_error": "NOT_SUPPORTED"}, events={"nvml_error": "NOT_SUPPORTED"})]
    rec = _recording(devices, total=23028 * 2**20)
    rec["samples"].append({"events": [{"uuid": "GPU-test-0", "xid": 79}], "devices": rec["samples"][0]["devices"]})
    source = RecordedNvml(rec)
    with NvmlProbe.open(source) as probe:
        source.advance()
        (report,) = probe.report()
    assert report.healthy and report.xid_errors == 0  # the event never reached an unsubscribed GPU


def test_close_frees_the_event_set_and_shuts_nvml_down(recording: dict[str, Any]) -> None:
    source = RecordedNvml(recording)
    probe = NvmlProbe.open(source)
    probe.close()
    probe.close()  # twice is harmless
    assert source.calls["nvmlEventSetFree"] == 1 and source.calls["nvmlShutdown"] == 1
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        source.nvmlDeviceGetCount()


# -- no GPU -----------------------------------------------------------------------------------


def test_a_machine_without_a_driver_raises_no_gpu_error() -> None:
    source = RecordedNvml({"format": FORMAT, "init_error": "DRIVER_NOT_LOADED"})
    with pytest.raises(NoGpuError, match=r"^no NVIDIA GPU/driver found: Driver Not Loaded$"):
        NvmlProbe.open(source)


def test_a_driver_without_gpus_raises_no_gpu_error() -> None:
    source = RecordedNvml(_recording([]) | {"samples": [{"events": [], "devices": {}}]})
    with pytest.raises(NoGpuError, match="the driver reports 0 GPUs"):
        NvmlProbe.open(source)
    assert source.calls["nvmlShutdown"] == 1


def _has_gpu() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_the_command_exits_2_with_one_line_when_there_is_no_gpu() -> None:
    # On this machine (no GPU) it is the real path: pynvml cannot load libnvidia-ml.
    proc = subprocess.run([sys.executable, "-m", "agents.probes.nvml"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    if _has_gpu():
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("driver ")
        return
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("no NVIDIA GPU/driver found: ")


def test_open_probe_nvml_uses_the_real_library_by_default() -> None:
    if _has_gpu():
        open_probe("nvml").close()
    else:
        with pytest.raises(NoGpuError, match="^no NVIDIA GPU/driver found: NVML Shared Library Not Found$"):
            open_probe("nvml")


def test_open_probe_refuses_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match="probe: must be one of nvml, static; got 'dcgm'"):
        open_probe("dcgm")


# -- the command's JSON and the recorder -------------------------------------------------------


def test_json_output_shows_gpus_reports_and_health(recording: dict[str, Any],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json"], nvml=RecordedNvml(recording)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["driver_version"] == "550.90.07"
    assert [g["model"] for g in out["gpus"]] == ["H100-SXM"] * 8
    assert len(out["reports"]) == 8 and out["unhealthy"] == {}
    assert len(out["nvlinks"]) == 8 * 18 - 1


def test_the_recorder_writes_what_the_replay_reads(recording: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "rec.json"
    assert main(["--record", str(out)], nvml=RecordedNvml(recording)) == 0
    again = json.loads(out.read_text())
    assert again["devices"] == recording["devices"]
    assert again["samples"][0]["devices"] == recording["samples"][0]["devices"]
    with NvmlProbe.open(RecordedNvml.from_file(out)) as probe, \
            NvmlProbe.open(RecordedNvml(recording)) as original:
        assert probe.gpus() == original.gpus()
        assert probe.report() == original.report()


def test_the_recorder_keeps_nvml_errors() -> None:
    dev = _device(0, "NVIDIA L40S", "01", {"nvml_error": "NOT_SUPPORTED"})
    source = RecordedNvml(_recording([dev]))
    source.nvmlInit()
    rec = record(source)
    assert rec["devices"][0]["memory_bus_width"] == {"nvml_error": "NOT_SUPPORTED"}
    assert rec["devices"][0]["nvlinks"] == {"nvml_error": "NOT_SUPPORTED"}  # every link, kept as one answer


def test_a_bad_recording_names_the_field(recording: dict[str, Any]) -> None:
    rec = copy.deepcopy(recording)
    del rec["devices"][2]["pci_bus_id"]
    with pytest.raises(ValueError, match=r"^devices\[2\]\.pci_bus_id: is required$"):
        RecordedNvml(rec)
    rec = copy.deepcopy(recording)
    rec["samples"][1]["events"][0]["uuid"] = "GPU-nope"
    with pytest.raises(ValueError, match=r"samples\[1\]\.events\[0\]\.uuid: no device 'GPU-nope'"):
        RecordedNvml(rec)
    with pytest.raises(ValueError, match="unknown NVML error 'WHATEVER'"):
        RecordedNvml({"format": FORMAT, "init_error": "WHATEVER"}).nvmlInit()
