"""The NVML probe: a node's NVIDIA GPUs as nvidia-ml-py (`pynvml`) sees them.

    python -m agents.probes.nvml            # one line per GPU
    python -m agents.probes.nvml --json     # GpuInfo + GpuReport + health reasons, as JSON
    python -m agents.probes.nvml --record F # a recording of what NVML returned (nvml_replay format)

With no GPU or no driver it exits with status 2 and one line: "no NVIDIA GPU/driver found: ...".

What it reads (NVML API reference, https://docs.nvidia.com/deploy/nvml-api/):
- static, at open: UUID, name (mapped to our catalog, gpu_names.py), memory size, PCI bus id,
  and the NVLink links (state, remote PCI bus id, remote device type) for the peer groups;
- per report: memory used, utilisation, temperature, the volatile uncorrectable ECC count,
  and the XID events the driver queued since the last report (an NVML event set registered
  for `nvmlEventTypeXidCriticalError`, polled with a zero timeout).

The NVML functions come from a *source* object with pynvml's names and behaviour: pynvml itself
on a GPU machine, or `agents.probes.nvml_replay.RecordedNvml` replaying a recording in tests.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import pynvml

from agents.probes import NoGpuError
from agents.probes.gpu_names import catalog_name
from agents.protocol import GpuInfo, GpuReport

# XIDs after which the GPU must not get new work until it is reset (or the node rebooted).
# Source: NVIDIA Xid catalog, https://docs.nvidia.com/deploy/xid-errors/ ("Resolution Bucket
# (Immediate Action)": RESET_GPU / RESTART_BM / WORKFLOW_*). Application-level XIDs such as
# 13 (graphics engine exception), 31 (MMU fault), 43 (GPU stopped processing a channel) and
# 45 (preemptive cleanup) are counted but leave the GPU healthy: the faulting process dies,
# the GPU stays usable.
CRITICAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded (reset to apply)",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}

# PCIe raw rate per lane (GT/s) and line-code efficiency, by generation. Source: PCI-SIG
# specifications (Gen1-2 8b/10b; Gen3-5 128b/130b; Gen6 FLIT mode, 242 of 256 bytes carry data).
_PCIE_GTS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
_PCIE_EFFICIENCY = {1: 0.8, 2: 0.8, 3: 128 / 130, 4: 128 / 130, 5: 128 / 130, 6: 242 / 256}

_MAX_EVENTS_PER_POLL = 10_000  # a storm of events must not keep one report from finishing


@dataclass
class _Device:
    index: int
    handle: Any
    uuid: str
    name: str
    bus_id: str
    mem_total_bytes: int
    xid_errors: int = 0
    ecc_errors: int = 0  # the last volatile uncorrectable ECC count read
    critical: list[str] = field(default_factory=list)  # why it is unhealthy, oldest first
    read_error: str | None = None  # the last NVML error reading its state, if any
    events_supported: bool = True


@dataclass(frozen=True)
class NvLink:
    """One active NVLink of a local GPU, as NVML reports it."""

    gpu_index: int
    link: int
    remote_bus_id: str
    remote_type: str  # "gpu", "switch", "cpu" (IBM NPU) or "unknown"


def normalise_bus_id(value: str | bytes) -> str:
    """PCI bus id in NVML's 'DDDDDDDD:BB:DD.F' form, upper-case (NVML mixes both widths of domain)."""
    text = value.decode() if isinstance(value, bytes) else value
    text = text.strip().upper()
    domain, sep, rest = text.partition(":")
    if not sep or rest.count(":") != 1:
        raise ValueError(f"pci bus id: expected DOMAIN:BUS:DEVICE.FUNCTION, got {text!r}")
    return f"{int(domain, 16):08X}:{rest}"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _is(exc: pynvml.NVMLError, *codes: int) -> bool:
    return getattr(exc, "value", None) in codes


def _handle_key(handle: Any) -> Any:
    # pynvml hands out a fresh ctypes pointer object per call; the address is the identity.
    if isinstance(handle, ctypes._Pointer):
        return ("ptr", ctypes.cast(handle, ctypes.c_void_p).value)
    return ("obj", handle)


class NvmlProbe:
    """A node's NVIDIA GPUs through an NVML source. Use `NvmlProbe.open()`; `close()` when done."""

    def __init__(self, nvml: Any, devices: list[_Device], driver_version: str, links: list[NvLink],
                 event_set: Any) -> None:
        self._nvml = nvml
        self._devices = devices
        self.driver_version = driver_version
        self.links = tuple(links)
        self._event_set = event_set
        self._by_handle = {_handle_key(d.handle): d for d in devices}
        self._by_uuid = {d.uuid: d for d in devices}
        self._groups = nvlink_groups(links, {d.bus_id: d.index for d in devices})
        self._closed = False

    # -- opening ----------------------------------------------------------------------------
    @classmethod
    def open(cls, nvml: Any = None) -> NvmlProbe:
        """Initialise NVML, enumerate the GPUs, map their NVLinks, subscribe to XID events.

        Raises NoGpuError (one line) when NVML cannot start or sees no GPU.
        """
        if nvml is None:
            nvml = pynvml
        try:
            nvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NoGpuError(f"no NVIDIA GPU/driver found: {exc}") from None
        try:
            count = nvml.nvmlDeviceGetCount()
            if count == 0:
                raise NoGpuError("no NVIDIA GPU/driver found: the driver reports 0 GPUs")
            driver = _text(nvml.nvmlSystemGetDriverVersion())
            devices = [cls._read_device(nvml, i) for i in range(count)]
            links = read_nvlinks(nvml, devices)
            event_set = cls._subscribe(nvml, devices)
        except BaseException:
            nvml.nvmlShutdown()
            raise
        return cls(nvml, devices, driver, links, event_set)

    @staticmethod
    def _read_device(nvml: Any, index: int) -> _Device:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        return _Device(
            index=index,
            handle=handle,
            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
            name=_text(nvml.nvmlDeviceGetName(handle)),
            bus_id=normalise_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId),
            mem_total_bytes=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
        )

    @staticmethod
    def _subscribe(nvml: Any, devices: list[_Device]) -> Any:
        event_set = nvml.nvmlEventSetCreate()
        for d in devices:
            try:
                nvml.nvmlDeviceRegisterEvents(d.handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
            except pynvml.NVMLError as exc:
                # Some virtualised GPUs refuse event registration; health then rests on ECC and
                # on whether the GPU can still be read.
                if not _is(exc, pynvml.NVML_ERROR_NOT_SUPPORTED):
                    raise
                d.events_supported = False
        return event_set

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._nvml.nvmlEventSetFree(self._event_set)
        finally:
            self._nvml.nvmlShutdown()

    def __enter__(self) -> NvmlProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- registration -----------------------------------------------------------------------
    def gpus(self) -> tuple[GpuInfo, ...]:
        out = []
        for d in self._devices:
            model = catalog_name(d.name)
            custom = None
            if model is None:
                model = d.name[:64]
                custom = self._custom_spec(d, model)
            out.append(GpuInfo(d.uuid, d.index, model, d.mem_total_bytes, self._groups.get(d.index), custom))
        return tuple(out)

    def _custom_spec(self, d: _Device, model: str) -> dict[str, Any]:
        """What NVML can tell about a GPU the catalog lacks: memory size and bandwidth, host link.

        NVML does not report tensor throughput, so `bf16_flops` is missing and the controller
        cannot plan on this GPU until someone supplies it (catalog entry or static probe file).
        """
        spec: dict[str, Any] = {
            "name": model,
            "mem_bytes": d.mem_total_bytes,
            "confidence": "low",
            "source": f"NVML on the node (driver {self.driver_version})",
            "note": (f"{d.name!r} is not in the FlexPipe catalog; NVML reports memory size, bus width "
                     "and clock, and the PCIe link, but not tensor throughput: add bf16_flops (the "
                     "datasheet's dense BF16 FLOP/s) in the catalog or a static probe file"),
        }
        nvml = self._nvml
        try:
            bus_bits = int(nvml.nvmlDeviceGetMemoryBusWidth(d.handle))
            mem_mhz = int(nvml.nvmlDeviceGetMaxClockInfo(d.handle, pynvml.NVML_CLOCK_MEM))
            # NVML's memory clock is half the data rate for HBM and GDDR alike (two transfers
            # per clock): H100 SXM 5120 bit x 2619 MHz x 2 / 8 = 3.35 TB/s, its datasheet figure.
            if bus_bits > 0 and mem_mhz > 0:
                spec["hbm_bytes_per_s"] = bus_bits / 8 * mem_mhz * 1e6 * 2
        except pynvml.NVMLError:
            pass
        try:
            gen = int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(d.handle))
            lanes = int(nvml.nvmlDeviceGetMaxPcieLinkWidth(d.handle))
            if gen in _PCIE_GTS and lanes > 0:
                spec["host_link_bytes_per_s"] = _PCIE_GTS[gen] * 1e9 * lanes * _PCIE_EFFICIENCY[gen] / 8
        except pynvml.NVMLError:
            pass
        return spec

    # -- reports ----------------------------------------------------------------------------
    def report(self) -> tuple[GpuReport, ...]:
        self.poll_events()
        return tuple(self._report_one(d) for d in self._devices)

    def _report_one(self, d: _Device) -> GpuReport:
        nvml = self._nvml
        try:
            mem = nvml.nvmlDeviceGetMemoryInfo(d.handle)
            util = nvml.nvmlDeviceGetUtilizationRates(d.handle)
            temp_c = float(nvml.nvmlDeviceGetTemperature(d.handle, pynvml.NVML_TEMPERATURE_GPU))
            ecc = self._uncorrected_ecc(d)
        except pynvml.NVMLError as exc:
            # A GPU that cannot be read (fallen off the bus, needs a reset) is still reported,
            # as unhealthy, so the controller moves work off it rather than losing track of it.
            d.read_error = f"NVML cannot read it: {exc}"
            return GpuReport(d.uuid, 0, d.mem_total_bytes, 0.0, 0.0, healthy=False,
                             xid_errors=d.xid_errors, ecc_errors=d.ecc_errors)
        d.read_error = None
        d.ecc_errors = ecc
        used = min(int(mem.used), d.mem_total_bytes)
        healthy = not d.critical and ecc == 0
        return GpuReport(
            uuid=d.uuid,
            mem_used_bytes=used,
            mem_total_bytes=d.mem_total_bytes,
            sm_util=min(max(float(util.gpu) / 100.0, 0.0), 1.0),
            temperature_c=temp_c,
            healthy=healthy,
            xid_errors=d.xid_errors,
            ecc_errors=ecc,
        )

    def _uncorrected_ecc(self, d: _Device) -> int:
        # Volatile = since the driver loaded: an uncorrectable error stays counted until the GPU
        # is reset, which is exactly how long the GPU should stay out of service.
        try:
            return int(self._nvml.nvmlDeviceGetTotalEccErrors(
                d.handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC))
        except pynvml.NVMLError as exc:
            if _is(exc, pynvml.NVML_ERROR_NOT_SUPPORTED):
                return 0  # ECC off or absent (GDDR boards): nothing to count
            raise

    def poll_events(self) -> int:
        """Take every XID event the driver queued since the last poll; returns how many.

        Invariant: a critical XID marks its GPU unhealthy for the rest of this probe's life (the
        agent's): recovering needs a reset, and a reset GPU comes back with a fresh agent start.
        """
        taken = 0
        while taken < _MAX_EVENTS_PER_POLL:
            try:
                event = self._nvml.nvmlEventSetWait_v2(self._event_set, 0)
            except pynvml.NVMLError as exc:
                if _is(exc, pynvml.NVML_ERROR_TIMEOUT):
                    break
                raise
            taken += 1
            if not int(event.eventType) & pynvml.nvmlEventTypeXidCriticalError:
                continue
            device = self._device_of(event.device)
            if device is None:
                continue
            xid = int(event.eventData)
            device.xid_errors += 1
            if xid in CRITICAL_XIDS:
                device.critical.append(f"XID {xid}: {CRITICAL_XIDS[xid]}")
        return taken

    def _device_of(self, handle: Any) -> _Device | None:
        found = self._by_handle.get(_handle_key(handle))
        if found is not None:
            return found
        try:
            return self._by_uuid.get(_text(self._nvml.nvmlDeviceGetUUID(handle)))
        except pynvml.NVMLError:
            return None

    def health_reasons(self) -> dict[str, list[str]]:
        """Why each unhealthy GPU is unhealthy (as of the last report), by UUID."""
        out: dict[str, list[str]] = {}
        for d in self._devices:
            reasons = list(d.critical)
            if d.ecc_errors:
                reasons.append(f"{d.ecc_errors} uncorrectable ECC error(s) since the driver loaded")
            if d.read_error:
                reasons.append(d.read_error)
            if reasons:
                out[d.uuid] = reasons
        return out


def read_nvlinks(nvml: Any, devices: list[_Device]) -> list[NvLink]:
    """Every active NVLink of every GPU, with what is at its far end."""
    local = {d.bus_id for d in devices}
    links: list[NvLink] = []
    for d in devices:
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                state = nvml.nvmlDeviceGetNvLinkState(d.handle, link)
            except pynvml.NVMLError as exc:
                if _is(exc, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                    break  # past this GPU's last link
                if _is(exc, pynvml.NVML_ERROR_NOT_SUPPORTED):
                    continue  # no NVLink here, or this link is fused off
                break  # the GPU cannot be read: it has no usable links
            if state != pynvml.NVML_FEATURE_ENABLED:
                continue
            try:
                remote = normalise_bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(d.handle, link).busId)
            except pynvml.NVMLError:
                continue  # an active link we cannot place joins nothing
            links.append(NvLink(d.index, link, remote, _remote_type(nvml, d.handle, link, remote, local)))
    return links


def _remote_type(nvml: Any, handle: Any, link: int, remote: str, local: set[str]) -> str:
    try:
        code = nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
    except pynvml.NVMLError:
        code = None  # drivers before R460 lack the call
    named = {
        pynvml.NVML_NVLINK_DEVICE_TYPE_GPU: "gpu",
        pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH: "switch",
        pynvml.NVML_NVLINK_DEVICE_TYPE_IBMNPU: "cpu",
    }.get(code)
    if named is not None:
        return named
    return "gpu" if remote in local else "unknown"


def nvlink_groups(links: list[NvLink], bus_to_index: dict[str, int]) -> dict[int, str]:
    """GPU index -> NVLink group name, by union-find over the active links.

    Nodes are local GPUs and the NVSwitches their links reach. A link to a local GPU joins the
    two GPUs; a link to a switch joins the GPU to that switch, so every GPU behind the same
    switches lands in one group (HGX boards: all eight). A link to a CPU or to a GPU outside
    this node joins nothing. A remote of unknown type that is not a local GPU is taken for a
    switch: on x86 nodes an NVSwitch is the only other thing an NVLink reaches.
    Groups of one GPU get no name (nothing to share a link with). Names are "nvl0", "nvl1", ...
    in the order of each group's lowest GPU index, so they are stable across restarts.
    """
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    index_to_bus = {i: b for b, i in bus_to_index.items()}
    for lk in links:
        me = "gpu:" + index_to_bus[lk.gpu_index]
        if lk.remote_bus_id in bus_to_index and lk.remote_type in ("gpu", "unknown"):
            union(me, "gpu:" + lk.remote_bus_id)
        elif lk.remote_type in ("switch", "unknown"):
            union(me, "switch:" + lk.remote_bus_id)
    members: dict[str, list[int]] = {}
    for bus, index in bus_to_index.items():
        key = "gpu:" + bus
        if key in parent:
            members.setdefault(find(key), []).append(index)
    groups = sorted((sorted(m) for m in members.values() if len(m) > 1), key=lambda m: m[0])
    return {index: f"nvl{n}" for n, m in enumerate(groups) for index in m}


# -- command line --------------------------------------------------------------------------


def _describe(probe: NvmlProbe) -> dict[str, Any]:
    reports = probe.report()
    return {
        "driver_version": probe.driver_version,
        "gpus": [asdict(g) for g in probe.gpus()],
        "reports": [asdict(r) for r in reports],
        "unhealthy": probe.health_reasons(),
        "nvlinks": [asdict(lk) for lk in probe.links],
    }


def main(argv: list[str] | None = None, nvml: Any = None) -> int:
    parser = argparse.ArgumentParser(description="Show this node's NVIDIA GPUs as the FlexPipe agent sees them.")
    parser.add_argument("--json", action="store_true", help="print GPUs, reports and health as JSON")
    parser.add_argument("--record", metavar="PATH", help="write a recording of NVML's answers (tests replay it)")
    args = parser.parse_args(argv)
    try:
        probe = NvmlProbe.open(nvml)
    except NoGpuError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except pynvml.NVMLError as exc:
        print(f"NVML failed while reading the GPUs: {exc}", file=sys.stderr)
        return 1
    with probe:
        if args.record:
            from agents.probes.nvml_replay import record

            with open(args.record, "w") as fh:
                json.dump(record(probe._nvml), fh, indent=1)
                fh.write("\n")
        described = _describe(probe)
    if args.json:
        print(json.dumps(described, indent=2))
        return 0
    print(f"driver {described['driver_version']}")
    for g, r in zip(described["gpus"], described["reports"], strict=True):
        state = "healthy" if r["healthy"] else "UNHEALTHY " + "; ".join(described["unhealthy"].get(g["uuid"], []))
        print(f"{g['index']}: {g['model']:<10} {g['uuid']} group={g['nvlink_group'] or '-'} "
              f"mem {r['mem_used_bytes'] / 2**30:.1f}/{g['mem_total_bytes'] / 2**30:.1f} GiB "
              f"util {r['sm_util']:.0%} {r['temperature_c']:.0f} C {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
