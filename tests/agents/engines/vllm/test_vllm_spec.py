"""Plan spec -> vLLM command line and environment, for TP/PP/GPU-id combinations."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from agents.engines.vllm import VllmPlanSpec, build_command, build_env, default_vllm_python
from agents.schema import SchemaError

from .conftest import VLLM_PYTHON

PY = "/opt/vllm/bin/python"


def spec(**overrides: Any) -> VllmPlanSpec:
    values: dict[str, Any] = {"plan_id": "llama-70b:p3", "model_dir": "/models/llama", "served_model_name": "llama",
                              "port": 8100, "max_model_len": 8192}
    values.update(overrides)
    return VllmPlanSpec(**values)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_a_single_gpu_plan() -> None:
    s = spec(gpu_ids=("3",))
    assert build_command(s, PY) == [
        PY, "-m", "vllm.entrypoints.openai.api_server",
        "--model", "/models/llama", "--served-model-name", "llama",
        "--host", "127.0.0.1", "--port", "8100", "--dtype", "auto", "--max-model-len", "8192",
        "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1",
        "--enable-prefix-caching", "--scheduling-policy", "priority", "--disable-uvicorn-access-log",
        "--enable-server-load-tracking",
    ]
    env = build_env(s, base={"PATH": "/usr/bin"})
    assert env == {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                   "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


@pytest.mark.parametrize(("tp", "pp", "gpus"), [
    (2, 1, ("0", "1")),
    (4, 1, ("4", "5", "6", "7")),
    (2, 2, ("0", "1", "2", "3")),
    (1, 4, ("0", "2", "4", "6")),  # PP across GPUs that are not neighbours
    (8, 1, tuple(str(i) for i in range(8))),
])
def test_tensor_and_pipeline_parallel_plans(tp: int, pp: int, gpus: tuple[str, ...]) -> None:
    s = spec(tensor_parallel_size=tp, pipeline_parallel_size=pp, gpu_ids=gpus)
    argv = build_command(s, PY)
    assert flag(argv, "--tensor-parallel-size") == str(tp)
    assert flag(argv, "--pipeline-parallel-size") == str(pp)
    # vLLM numbers the visible GPUs 0..n-1 in the order given: TP ranks fill stage 0 first.
    assert build_env(s, base={})["CUDA_VISIBLE_DEVICES"] == ",".join(gpus)
    assert s.world_size == tp * pp == len(gpus)


def test_a_server_schedules_by_the_requests_priority_unless_told_fcfs() -> None:
    assert flag(build_command(spec(), PY), "--scheduling-policy") == "priority"
    assert flag(build_command(spec(scheduling_policy="fcfs"), PY), "--scheduling-policy") == "fcfs"
    with pytest.raises(ValueError, match="scheduling_policy: must be one of priority, fcfs"):
        spec(scheduling_policy="lottery")


def test_gpus_can_be_named_by_uuid() -> None:
    uuids = ("GPU-7e10671b-7c3d-2d50-f9e1-cad8e9c27573", "GPU-0c1af854-8a6b-67a8-7858-645fc29d795d")
    s = spec(tensor_parallel_size=2, gpu_ids=uuids)
    assert build_env(s, base={})["CUDA_VISIBLE_DEVICES"] == ",".join(uuids)


def test_a_plan_without_gpus_hides_every_gpu() -> None:
    # The CPU build ignores it; a CUDA build started by mistake must not grab a shared node's GPUs.
    env = build_env(spec(), base={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert env["CUDA_VISIBLE_DEVICES"] == ""


def test_options_go_after_ours_and_extra_args_last() -> None:
    s = spec(enable_prefix_caching=False, enforce_eager=True, server_load_tracking=False, gpu_memory_utilization=0.92, max_num_seqs=64,
             seed=7, dtype="bfloat16", host="0.0.0.0", extra_args=("--kv-cache-dtype", "fp8"),
             env=(("VLLM_CPU_KVCACHE_SPACE", "4"),))
    argv = build_command(s, PY)
    assert "--no-enable-prefix-caching" in argv and "--enable-prefix-caching" not in argv
    assert "--enforce-eager" in argv and "--enable-server-load-tracking" not in argv
    assert flag(argv, "--gpu-memory-utilization") == "0.92"
    assert flag(argv, "--max-num-seqs") == "64" and flag(argv, "--seed") == "7"
    assert flag(argv, "--dtype") == "bfloat16" and flag(argv, "--host") == "0.0.0.0"
    assert argv[-2:] == ["--kv-cache-dtype", "fp8"]
    assert build_env(s, base={})["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_the_length_split_goes_to_vllms_token_budget_and_long_prefill_cap() -> None:
    argv = build_command(spec(max_num_batched_tokens=8192, long_prefill_token_threshold=2048), PY)
    assert flag(argv, "--max-num-batched-tokens") == "8192" and flag(argv, "--long-prefill-token-threshold") == "2048"
    assert "--long-prefill-token-threshold" not in build_command(spec(), PY)
    with pytest.raises(SchemaError) as err:
        VllmPlanSpec.from_dict({**spec().to_dict(), "long_prefill_token_threshold": 10**6})
    assert "long_prefill_token_threshold" in err.value.errors


def test_the_python_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXPIPE_VLLM_PYTHON", "/srv/vllm/bin/python3")
    assert default_vllm_python() == "/srv/vllm/bin/python3"
    assert build_command(spec())[0] == "/srv/vllm/bin/python3"
    monkeypatch.delenv("FLEXPIPE_VLLM_PYTHON")
    assert default_vllm_python().endswith("/.venv-vllm/bin/python")


def test_a_plan_payload_round_trips() -> None:
    s = spec(tensor_parallel_size=2, gpu_ids=("0", "1"), seed=1, env=(("A", "b"),))
    assert VllmPlanSpec.from_dict(s.to_dict()) == s
    # GPU indexes may arrive as JSON numbers.
    d = s.to_dict() | {"gpu_ids": [0, 1]}
    assert VllmPlanSpec.from_dict(d).gpu_ids == ("0", "1")


def _errors(body: Any) -> dict[str, str]:
    with pytest.raises(SchemaError) as info:
        VllmPlanSpec.from_dict(body)
    return info.value.errors


def test_a_bad_payload_names_every_field() -> None:
    errors = _errors({"plan_id": "p/1", "model_dir": "", "port": 70000, "dtype": "fp4",
                      "tensor_parallel_size": 0, "gpu_ids": [True], "env": {"X": 1}, "colour": "red"})
    assert errors == {
        "model_dir": "must not be empty",
        "served_model_name": "is required",
        "port": "must be <= 65535; got 70000",
        "max_model_len": "is required",
        "tensor_parallel_size": "must be >= 1; got 0",
        "dtype": "must be one of auto, bfloat16, float16, float32, half, float; got 'fp4'",
        "gpu_ids[0]": "must be a GPU index or UUID",
        "env.X": "must be a string",
        "colour": "unknown key",
    }


def test_the_gpu_count_must_match_tp_times_pp() -> None:
    body = spec().to_dict() | {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "gpu_ids": ["0", "1", "2"]}
    assert _errors(body) == {"gpu_ids": "tensor_parallel_size 2 x pipeline_parallel_size 2 needs 4 GPUs; got 3"}


def test_gpu_ids_must_be_distinct_cuda_names() -> None:
    body = spec().to_dict() | {"tensor_parallel_size": 3, "gpu_ids": ["0", "0", "cuda:1"]}
    errors = _errors(body)
    assert errors["gpu_ids[1]"] == "duplicates gpu_ids[0]"
    assert errors["gpu_ids[2]"] == "must be a CUDA device index or a GPU/MIG UUID; got 'cuda:1'"


def test_the_adapter_owns_the_gpu_variables() -> None:
    body = spec().to_dict() | {"env": {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "1BAD": "x"}}
    assert _errors(body) == {"env.CUDA_VISIBLE_DEVICES": "is set by the adapter from gpu_ids",
                             "env.1BAD": "is not a valid environment variable name"}


def test_a_spec_built_in_code_is_checked_too() -> None:
    with pytest.raises(ValueError, match=r"^gpu_ids: tensor_parallel_size 2 x pipeline_parallel_size 1 needs 2"):
        spec(tensor_parallel_size=2, gpu_ids=("0",))
    with pytest.raises(ValueError, match=r"^plan_id: must be 1-128 letters"):
        spec(plan_id="")


@pytest.mark.vllm
@pytest.mark.timeout(120)
def test_vllm_itself_accepts_the_command_lines() -> None:
    """vLLM's own argument parser (of the pinned version) reads our flags as we mean them."""
    plans = [
        spec(),
        spec(tensor_parallel_size=2, pipeline_parallel_size=2, gpu_ids=("0", "1", "2", "3"),
             enable_prefix_caching=False, gpu_memory_utilization=0.92, max_num_seqs=32, seed=3,
             dtype="float32", enforce_eager=True, max_num_batched_tokens=4096, long_prefill_token_threshold=2048),
        spec(tensor_parallel_size=8, gpu_ids=tuple(str(i) for i in range(8)), dtype="bfloat16"),
    ]
    argvs = [build_command(p, VLLM_PYTHON)[3:] for p in plans]
    script = (
        "import json, sys\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args\n"
        "parser = make_arg_parser(FlexibleArgumentParser())\n"
        "out = []\n"
        "for argv in json.load(sys.stdin):\n"
        "    a = parser.parse_args(argv)\n"
        "    validate_parsed_serve_args(a)\n"
        "    out.append([a.model, a.served_model_name, a.host, a.port, a.dtype, a.max_model_len,\n"
        "                a.tensor_parallel_size, a.pipeline_parallel_size, a.enable_prefix_caching,\n"
        "                a.enforce_eager, a.gpu_memory_utilization, a.max_num_seqs, a.seed,\n"
        "                a.enable_server_load_tracking, a.max_num_batched_tokens, a.long_prefill_token_threshold])\n"
        "print('PARSED ' + json.dumps(out))\n"
    )
    proc = subprocess.run([VLLM_PYTHON, "-c", script], input=json.dumps(argvs), capture_output=True, text=True,
                          timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads(proc.stdout.split("PARSED ", 1)[1])
    assert parsed[0][:14] == ["/models/llama", ["llama"], "127.0.0.1", 8100, "auto", 8192, 1, 1, True, False,
                              0.92, None, 0, True]
    assert parsed[1] == ["/models/llama", ["llama"], "127.0.0.1", 8100, "float32", 8192, 2, 2, False, True,
                         0.92, 32, 3, True, 4096, 2048]
    assert parsed[2][4:8] == ["bfloat16", 8192, 8, 1]
