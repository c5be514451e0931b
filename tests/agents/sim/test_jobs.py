"""Fine-tune and batch jobs in the simulator (agents/sim/jobs.py) under the FlexPipe policy: a
priority-10 deployment takes a priority-1 job's GPUs, the job checkpoints, releases and resumes."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from agents.schema import SchemaError
from agents.sim.fleet import FleetSim
from agents.sim.run import run_policy
from agents.sim.scenario import parse_scenario
from scheduler.plan import MEM_FRACTION

BASE: dict[str, Any] = {
    "name": "jobs-test", "seed": 5, "duration_s": 900,
    "nodes": [{"id": "a1", "gpu": "H100-SXM", "gpus": 1, "nvlink": True, "rack": "A"},
              {"id": "a2", "gpu": "H100-SXM", "gpus": 4, "nvlink": True, "rack": "A"}],
    "network": {"intra_rack_gbps": 400, "inter_rack_gbps": 100},
    "models": [{"deployment": "chat", "model": "Llama-3-8B", "slo": {"ttft_ms": 2000, "tpot_ms": 100},
                "priority": 10, "baseline": {"tp": 1, "nodes": ["a1"]}}],
    "workload": [{"deployment": "chat", "arrival": "poisson", "rate_rps": 2,
                  "prompt_tokens": {"dist": "fixed", "value": 256}, "output_tokens": {"dist": "fixed", "value": 64}}],
    # chat's only GPU goes to another tenant at 100 s, back at 300 s
    "events": [{"at_s": 100, "kind": "preempt", "node": "a1", "gpus": 1, "duration_s": 200}],
    "jobs": [{"name": "ft", "at_s": 10, "gpus": 4, "work_gpu_s": 4 * 400, "grace_s": 30, "checkpoint_s": 20}],
}


def scenario(**changes: Any):  # type: ignore[no-untyped-def]
    data = copy.deepcopy(BASE)
    data.update(changes)
    return parse_scenario(data)


def test_a_priority_10_deployment_takes_a_priority_1_jobs_gpus_which_checkpoints_and_resumes() -> None:
    seen: dict[str, FleetSim] = {}
    out = run_policy(scenario(), "flexpipe", inspect=lambda sim: seen.setdefault("sim", sim))
    sim = seen["sim"]
    ft = out["jobs"]["ft"]
    assert ft["yields"] == 1 and ft["lost_gpu_s"] == 0  # its 20 s checkpoint fits its 30 s grace
    assert ft["state"] == "done" and ft["progress"] == 1.0  # resumed once GPUs were free, then finished
    assert out["gpus_reclaimed_from_jobs"] == 4 and out["job_gpu_hours"] > 0
    assert out["lost"] == 0 and out["memory_violations"] == [] and out["sequence_violations"] == []
    assert out["peak_gpu_mem_fraction"] <= MEM_FRACTION
    # the job's booking came off a2's GPUs before chat's plan booked them: 20 s after the ask
    a2 = {sim.cluster.gpu_uuid("a2", i) for i in range(4)}
    booked = [(e.t_s, e.plan_id) for e in sim.memory_log.events if e.kind == "mem_booked" and a2 & {g[0] for g in e.gpus}]
    first_job, first_chat = booked[0], next(b for b in booked if not b[1].startswith("job/"))
    assert first_job == (10.0, "job/ft")
    assert first_chat[0] >= 100.0 + 20.0
    assert any(b[1] == "job/ft" and b[0] > first_chat[0] for b in booked)  # it resumed later


def test_without_a_higher_priority_the_job_keeps_its_gpus() -> None:
    data = copy.deepcopy(BASE)
    data["models"][0]["priority"] = 1
    out = run_policy(parse_scenario(data), "flexpipe")
    assert out["jobs"]["ft"]["yields"] == 0 and out["gpus_reclaimed_from_jobs"] == 0
    assert out["jobs"]["ft"]["done_s"] == 10.0 + 400.0  # never interrupted
    assert out["memory_violations"] == []
    blocked = [d for d in out["decisions"] if d["outcome"] == "blocked" and 100 < d["t_s"] < 300]
    assert blocked and not [d for d in out["decisions"] if d["outcome"] == "switch" and d["t_s"] < 300]


def test_the_run_is_deterministic() -> None:
    a, b = (run_policy(scenario(), "flexpipe") for _ in range(2))
    assert a["jobs"] == b["jobs"] and a["goodput_rps"] == b["goodput_rps"]


@pytest.mark.parametrize(("job", "field"), [
    ({"gpus": 0}, "jobs[0].gpus"),
    ({"work_gpu_s": 0}, "jobs[0].work_gpu_s"),
    ({"gpu": "B300"}, "jobs[0].gpu"),
    ({"grace_s": 900}, "jobs[0].grace_s"),
    ({"at_s": 5000}, "jobs[0].at_s"),
    ({"colour": "red"}, "jobs[0].colour"),
])
def test_a_bad_job_is_refused_naming_its_field(job: dict[str, Any], field: str) -> None:
    jobs = [{**BASE["jobs"][0], **job}]
    with pytest.raises(SchemaError) as err:
        scenario(jobs=jobs)
    assert field in str(err.value)
