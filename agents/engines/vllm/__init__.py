"""The vLLM adapter: one supervised vLLM OpenAI server per plan, its metrics, drain and switch.

vLLM runs in its own virtualenv (.venv-vllm, scripts/make-vllm-venv.sh) as a separate process;
this package runs in the agent's environment and needs only httpx and prometheus-client.
"""

from __future__ import annotations

from agents.engines.vllm.engine import (
    DrainResult,
    EngineError,
    EngineState,
    EngineStatus,
    NotAdmitting,
    RestartPolicy,
    VllmEngine,
)
from agents.engines.vllm.metrics import Histogram, VllmMetrics, engine_report, parse_metrics
from agents.engines.vllm.replay import (
    Completion,
    InFlightSequence,
    ReplayResult,
    replay_all,
    replay_body,
    replay_sequence,
    stream_completion,
)
from agents.engines.vllm.spec import VllmPlanSpec, build_command, build_env, default_vllm_python
from agents.engines.vllm.switch import SwitchResult, switch_plan

__all__ = [
    "Completion",
    "DrainResult",
    "EngineError",
    "EngineState",
    "EngineStatus",
    "Histogram",
    "InFlightSequence",
    "NotAdmitting",
    "ReplayResult",
    "RestartPolicy",
    "SwitchResult",
    "VllmEngine",
    "VllmMetrics",
    "VllmPlanSpec",
    "build_command",
    "build_env",
    "default_vllm_python",
    "engine_report",
    "parse_metrics",
    "replay_all",
    "replay_body",
    "replay_sequence",
    "stream_completion",
    "switch_plan",
]
