"""A plan switch with vLLM: shadow server, replay of the in-flight sequences, old server stopped.

The three phases map onto calls the agent makes as the controller's commands arrive; this
helper runs them in one go for callers that own both plans (the agent on one node, the bench):

    PREPARE  new = VllmEngine(new_spec); new.start()             (the old plan keeps serving)
    SWITCH   seqs = collect_inflight()   (the gateway freezes the old plan and hands over what it
                                          holds: prompt ids + ids generated so far)
             results = replay_all(new.base_url, ..., seqs)
    CLEANUP  old.stop()                  (its sequences now live on the new plan)

If PREPARE fails, nothing was switched: the old plan still serves and the error is raised.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agents.engines.vllm.engine import EngineError, RestartPolicy, VllmEngine
from agents.engines.vllm.replay import InFlightSequence, ReplayResult, replay_all
from agents.engines.vllm.spec import VllmPlanSpec


@dataclass(frozen=True)
class SwitchResult:
    engine: VllmEngine  # the new plan's engine, serving
    results: list[ReplayResult]  # one per collected sequence, in order
    prepare_s: float  # shadow start until it served
    replay_s: float  # collect + replay of every sequence to its end


def switch_plan(new_spec: VllmPlanSpec, collect_inflight: Callable[[], Sequence[InFlightSequence]], *,
                old: VllmEngine | None = None, python: str | None = None,
                log_dir: str | Path | None = None, policy: RestartPolicy | None = None,
                stop_old: bool = True, old_grace_s: float = 20.0) -> SwitchResult:
    t0 = time.monotonic()
    new = VllmEngine(new_spec, python=python, log_dir=log_dir, policy=policy)
    try:
        new.start()
    except EngineError:
        new.stop(grace_s=5.0)
        raise
    t1 = time.monotonic()
    results = replay_all(new.base_url, new_spec.served_model_name, collect_inflight(),
                         admission=new.check_admission)
    t2 = time.monotonic()
    if old is not None and stop_old:
        old.stop(grace_s=old_grace_s)
    return SwitchResult(new, results, t1 - t0, t2 - t1)
