"""Replay NVML from a recording: the NVML source the probe uses where no GPU is (tests, demos).

A recording is JSON (format "flexpipe-nvml-recording/1") holding what NVML answered on a node:

    {"format": "flexpipe-nvml-recording/1", "provenance": "...", "driver_version": "550.90.07",
     "devices": [{"index": 0, "uuid": "GPU-...", "name": "NVIDIA H100 80GB HBM3",
                  "pci_bus_id": "00000000:18:00.0", "memory_bus_width": 5120,
                  "max_mem_clock_mhz": 2619, "max_pcie_link_generation": 5,
                  "max_pcie_link_width": 16,
                  "nvlinks": [{"link": 0, "state": 1, "remote_pci_bus_id": "00000000:05:00.0",
                               "remote_device_type": 2}, ...]}, ...],
     "samples": [{"events": [{"uuid": "GPU-...", "xid": 79}],
                  "devices": {"GPU-...": {"memory": {"total": ..., "free": ..., "used": ...},
                                          "utilization": {"gpu": 97, "memory": 41},
                                          "temperature_gpu": 58,
                                          "ecc_volatile_uncorrected": 0}}}, ...]}

Any answer may instead be `{"nvml_error": "NOT_SUPPORTED"}` (a pynvml NVML_ERROR_* name): the
call then raises that pynvml.NVMLError, as the real library does. A sample's events are
delivered by the event set when the replay reaches that sample (`advance()`); a device's
`nvlinks` list ends where the real GPU's links end (a higher link raises INVALID_ARGUMENT).
`{"init_error": "LIBRARY_NOT_FOUND"}` at the top replays a machine without a driver.

`record(nvml)` writes this format from a live NVML (`python -m agents.probes.nvml --record F`),
so a fixture can come from a real node.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

FORMAT = "flexpipe-nvml-recording/1"


def _nvml_error(name: str, path: str) -> pynvml.NVMLError:
    code = getattr(pynvml, f"NVML_ERROR_{name}", None)
    if not isinstance(code, int):
        raise ValueError(f"{path}.nvml_error: unknown NVML error {name!r} (pynvml has no NVML_ERROR_{name})")
    return pynvml.NVMLError(code)


def _answer(value: Any, path: str) -> Any:
    """The recorded answer, or raise the recorded NVML error."""
    if isinstance(value, dict) and "nvml_error" in value:
        raise _nvml_error(str(value["nvml_error"]), path)
    return value


def _need(obj: Any, key: str, path: str) -> Any:
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: must be an object")
    if key not in obj:
        raise ValueError(f"{path}.{key}: is required")
    return obj[key]


@dataclass(frozen=True)
class _Handle:
    index: int


class _Struct:
    """Stands in for pynvml's ctypes structures: the same attribute names."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


class RecordedNvml:
    """pynvml's functions (the ones the probe calls), answering from a recording."""

    def __init__(self, recording: dict[str, Any]) -> None:
        if recording.get("format") != FORMAT:
            raise ValueError(f"format: must be {FORMAT!r}; got {recording.get('format')!r}")
        self._rec = recording
        self._devices: list[dict[str, Any]] = list(recording.get("devices", []))
        for i, dev in enumerate(self._devices):
            if _need(dev, "index", f"devices[{i}]") != i:
                raise ValueError(f"devices[{i}].index: must be {i} (devices are listed in index order)")
            for key in ("uuid", "name", "pci_bus_id"):
                _need(dev, key, f"devices[{i}]")
        self._samples: list[dict[str, Any]] = list(recording.get("samples", []))
        if not self._samples and "init_error" not in recording:
            raise ValueError("samples: a recording needs at least one sample")
        self._sample = 0
        self._initialised = 0
        self._event_sets: dict[int, set[int]] = {}  # event set id -> registered device indexes
        self._queues: dict[int, list[Any]] = {}
        self.calls: dict[str, int] = {}  # how often each function ran (tests look)
        for n in range(len(self._samples)):
            self._events_of(n)  # a bad event fails here, not in the middle of a test

    @classmethod
    def from_file(cls, path: str | Path) -> RecordedNvml:
        with open(path) as fh:
            return cls(json.load(fh))

    # -- replay control ---------------------------------------------------------------------
    @property
    def sample_index(self) -> int:
        return self._sample

    def advance(self) -> None:
        """Move to the next sample; its events become pending in every event set."""
        if self._sample + 1 >= len(self._samples):
            raise IndexError(f"samples: the recording has {len(self._samples)}; no sample after #{self._sample}")
        self._sample += 1
        self._queue_events(self._sample)

    def _events_of(self, n: int) -> list[_Struct]:
        uuids = {d["uuid"]: i for i, d in enumerate(self._devices)}
        out = []
        for j, ev in enumerate(self._samples[n].get("events", [])):
            path = f"samples[{n}].events[{j}]"
            uuid = _need(ev, "uuid", path)
            if uuid not in uuids:
                raise ValueError(f"{path}.uuid: no device {uuid!r} in the recording")
            out.append(_Struct(device=_Handle(uuids[uuid]),
                               eventType=ev.get("event_type", pynvml.nvmlEventTypeXidCriticalError),
                               eventData=int(_need(ev, "xid", path)), gpuInstanceId=0xFFFFFFFF,
                               computeInstanceId=0xFFFFFFFF))
        return out

    def _queue_events(self, n: int) -> None:
        # Only sets that exist now get them: NVML delivers no event from before a registration.
        for data in self._events_of(n):
            for set_id, registered in self._event_sets.items():
                if data.device.index in registered:
                    self._queues[set_id].append(data)

    def _call(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if name != "nvmlInit" and self._initialised == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def _dev(self, handle: Any) -> tuple[dict[str, Any], str]:
        if not isinstance(handle, _Handle) or not 0 <= handle.index < len(self._devices):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._devices[handle.index], f"devices[{handle.index}]"

    def _state(self, handle: Any) -> tuple[dict[str, Any], str]:
        dev, _ = self._dev(handle)
        path = f"samples[{self._sample}].devices.{dev['uuid']}"
        state = _need(_need(self._samples[self._sample], "devices", f"samples[{self._sample}]"),
                      dev["uuid"], f"samples[{self._sample}].devices")
        return _answer(state, path), path

    # -- pynvml's functions ------------------------------------------------------------------
    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        self._call("nvmlInit")
        if "init_error" in self._rec:
            raise _nvml_error(str(self._rec["init_error"]), "init_error")
        self._initialised += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self._call("nvmlShutdown")
        self._initialised -= 1

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        self._call("nvmlSystemGetDriverVersion")
        return str(_need(self._rec, "driver_version", ""))

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self._call("nvmlDeviceGetCount")
        return len(self._devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:  # noqa: N802
        self._call("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self._devices):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetUUID(self, handle: Any) -> str:  # noqa: N802
        self._call("nvmlDeviceGetUUID")
        dev, path = self._dev(handle)
        return str(_answer(dev["uuid"], f"{path}.uuid"))

    def nvmlDeviceGetName(self, handle: Any) -> str:  # noqa: N802
        self._call("nvmlDeviceGetName")
        dev, path = self._dev(handle)
        return str(_answer(dev["name"], f"{path}.name"))

    def nvmlDeviceGetPciInfo(self, handle: Any) -> _Struct:  # noqa: N802
        self._call("nvmlDeviceGetPciInfo")
        dev, path = self._dev(handle)
        bus = str(_answer(dev["pci_bus_id"], f"{path}.pci_bus_id"))
        return _Struct(busId=bus.encode(), busIdLegacy=bus[-12:].encode())

    def _static_int(self, handle: Any, key: str) -> int:
        dev, path = self._dev(handle)
        return int(_answer(dev.get(key, {"nvml_error": "NOT_SUPPORTED"}), f"{path}.{key}"))

    def nvmlDeviceGetMemoryBusWidth(self, handle: Any) -> int:  # noqa: N802
        self._call("nvmlDeviceGetMemoryBusWidth")
        return self._static_int(handle, "memory_bus_width")

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, clock_type: int) -> int:  # noqa: N802
        self._call("nvmlDeviceGetMaxClockInfo")
        if clock_type != pynvml.NVML_CLOCK_MEM:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # only the memory clock is kept
        return self._static_int(handle, "max_mem_clock_mhz")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:  # noqa: N802
        self._call("nvmlDeviceGetMaxPcieLinkGeneration")
        return self._static_int(handle, "max_pcie_link_generation")

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:  # noqa: N802
        self._call("nvmlDeviceGetMaxPcieLinkWidth")
        return self._static_int(handle, "max_pcie_link_width")

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> _Struct:  # noqa: N802
        self._call("nvmlDeviceGetMemoryInfo")
        state, path = self._state(handle)
        mem = _answer(_need(state, "memory", path), f"{path}.memory")
        return _Struct(total=int(mem["total"]), free=int(mem["free"]), used=int(mem["used"]))

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> _Struct:  # noqa: N802
        self._call("nvmlDeviceGetUtilizationRates")
        state, path = self._state(handle)
        util = _answer(_need(state, "utilization", path), f"{path}.utilization")
        return _Struct(gpu=int(util["gpu"]), memory=int(util["memory"]))

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:  # noqa: N802
        self._call("nvmlDeviceGetTemperature")
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        state, path = self._state(handle)
        return int(_answer(_need(state, "temperature_gpu", path), f"{path}.temperature_gpu"))

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int:  # noqa: N802
        self._call("nvmlDeviceGetTotalEccErrors")
        if (error_type, counter_type) != (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # only this counter is kept
        state, path = self._state(handle)
        key = "ecc_volatile_uncorrected"
        return int(_answer(state.get(key, {"nvml_error": "NOT_SUPPORTED"}), f"{path}.{key}"))

    def _link(self, handle: Any, link: int) -> tuple[dict[str, Any], str]:
        dev, path = self._dev(handle)
        links = _answer(dev.get("nvlinks", {"nvml_error": "NOT_SUPPORTED"}), f"{path}.nvlinks")
        for j, lk in enumerate(links):
            if lk.get("link") == link:
                return lk, f"{path}.nvlinks[{j}]"
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # past the GPU's last link

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:  # noqa: N802
        self._call("nvmlDeviceGetNvLinkState")
        lk, path = self._link(handle, link)
        return int(_answer(_need(lk, "state", path), f"{path}.state"))

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Any, link: int) -> _Struct:  # noqa: N802
        self._call("nvmlDeviceGetNvLinkRemotePciInfo")
        lk, path = self._link(handle, link)
        bus = str(_answer(_need(lk, "remote_pci_bus_id", path), f"{path}.remote_pci_bus_id"))
        return _Struct(busId=bus.encode(), busIdLegacy=bus[-12:].encode())

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:  # noqa: N802
        self._call("nvmlDeviceGetNvLinkRemoteDeviceType")
        lk, path = self._link(handle, link)
        return int(_answer(lk.get("remote_device_type", {"nvml_error": "FUNCTION_NOT_FOUND"}),
                           f"{path}.remote_device_type"))

    def nvmlEventSetCreate(self) -> int:  # noqa: N802
        self._call("nvmlEventSetCreate")
        set_id = len(self._event_sets) + 1
        self._event_sets[set_id] = set()
        self._queues[set_id] = []
        return set_id

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: int) -> None:  # noqa: N802
        self._call("nvmlDeviceRegisterEvents")
        dev, path = self._dev(handle)
        _answer(dev.get("events", True), f"{path}.events")  # {"nvml_error": ...} when unsupported
        if event_set not in self._event_sets:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._event_sets[event_set].add(handle.index)

    def nvmlEventSetWait_v2(self, event_set: int, timeout_ms: int) -> _Struct:  # noqa: N802
        self._call("nvmlEventSetWait_v2")
        queue = self._queues.get(event_set)
        if queue is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not queue:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)  # a recording never blocks
        return queue.pop(0)

    def nvmlEventSetFree(self, event_set: int) -> None:  # noqa: N802
        self._call("nvmlEventSetFree")
        self._event_sets.pop(event_set, None)
        self._queues.pop(event_set, None)


# -- recording a live NVML -----------------------------------------------------------------


def _try(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        for name in dir(pynvml):
            if name.startswith("NVML_ERROR_") and getattr(pynvml, name) == getattr(exc, "value", None):
                return {"nvml_error": name.removeprefix("NVML_ERROR_")}
        return {"nvml_error": "UNKNOWN"}


def _bus(value: Any) -> Any:
    if isinstance(value, dict):
        return value
    bus = value.busId
    return bus.decode() if isinstance(bus, bytes) else bus


def record(nvml: Any, provenance: str = "recorded with python -m agents.probes.nvml --record") -> dict[str, Any]:
    """One sample of what `nvml` (initialised) answers, in the replay format."""
    def text(v: Any) -> Any:
        return v.decode() if isinstance(v, bytes) else v

    devices = []
    gpu_states: dict[str, Any] = {}
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        uuid = text(nvml.nvmlDeviceGetUUID(h))
        links = []
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            state = _try(nvml.nvmlDeviceGetNvLinkState, h, link)
            if isinstance(state, dict) and state["nvml_error"] == "INVALID_ARGUMENT":
                break
            entry: dict[str, Any] = {"link": link, "state": state}
            if state == pynvml.NVML_FEATURE_ENABLED:
                entry["remote_pci_bus_id"] = _bus(_try(nvml.nvmlDeviceGetNvLinkRemotePciInfo, h, link))
                entry["remote_device_type"] = _try(nvml.nvmlDeviceGetNvLinkRemoteDeviceType, h, link)
            links.append(entry)
        # A GPU without NVLink answers NOT_SUPPORTED for every link: keep that as one answer.
        states = {json.dumps(lk["state"], sort_keys=True) for lk in links}
        nvlinks: Any = links
        if len(states) == 1 and isinstance(links[0]["state"], dict):
            nvlinks = links[0]["state"]
        devices.append({
            "index": i,
            "uuid": uuid,
            "name": text(nvml.nvmlDeviceGetName(h)),
            "pci_bus_id": _bus(nvml.nvmlDeviceGetPciInfo(h)),
            "memory_bus_width": _try(nvml.nvmlDeviceGetMemoryBusWidth, h),
            "max_mem_clock_mhz": _try(nvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_MEM),
            "max_pcie_link_generation": _try(nvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
            "max_pcie_link_width": _try(nvml.nvmlDeviceGetMaxPcieLinkWidth, h),
            "nvlinks": nvlinks,
        })
        mem = _try(nvml.nvmlDeviceGetMemoryInfo, h)
        util = _try(nvml.nvmlDeviceGetUtilizationRates, h)
        gpu_states[uuid] = {
            "memory": mem if isinstance(mem, dict) else {"total": mem.total, "free": mem.free, "used": mem.used},
            "utilization": util if isinstance(util, dict) else {"gpu": util.gpu, "memory": util.memory},
            "temperature_gpu": _try(nvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU),
            "ecc_volatile_uncorrected": _try(nvml.nvmlDeviceGetTotalEccErrors, h,
                                             pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                             pynvml.NVML_VOLATILE_ECC),
        }
    return {
        "format": FORMAT,
        "provenance": provenance,
        "driver_version": text(nvml.nvmlSystemGetDriverVersion()),
        "devices": devices,
        "samples": [{"events": [], "devices": gpu_states}],
    }
