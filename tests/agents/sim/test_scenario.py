from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from agents.schema import SchemaError
from agents.sim.rateseries import traces_dir
from agents.sim.scenario import baseline_stage_nodes, load_scenario, parse_scenario

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = sorted((ROOT / "scenarios").glob("*.yaml"))

BASE: dict[str, Any] = {
    "name": "t",
    "seed": 1,
    "duration_s": 600,
    "nodes": [
        {"id": "a1", "gpu": "H100-SXM", "gpus": 8, "nvlink": True, "rack": "A"},
        {"id": "b1", "gpu": "A100-80G", "gpus": 4, "nvlink": True, "free": 2},
    ],
    "network": {"intra_rack_gbps": 400, "inter_rack_gbps": 100},
    "models": [{"deployment": "chat", "model": "Llama-3-8B", "slo": {"ttft_ms": 500, "tpot_ms": 50},
                "baseline": {"tp": 2, "nodes": ["a1"]}}],
    "workload": [{"deployment": "chat", "arrival": "poisson", "rate_rps": 2,
                  "prompt_tokens": {"dist": "lognormal", "mean": 300, "sigma": 0.5, "max": 2048},
                  "output_tokens": {"dist": "fixed", "value": 100}}],
    "events": [{"at_s": 60, "kind": "preempt", "node": "a1", "gpus": 3, "duration_s": 100}],
}


def errors_of(mutate: Any) -> dict[str, str]:
    doc = copy.deepcopy(BASE)
    mutate(doc)
    with pytest.raises(SchemaError) as err:
        parse_scenario(doc)
    return err.value.errors


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_scenario_loads(path: Path) -> None:
    if "series:" in path.read_text() and not traces_dir().is_dir():
        pytest.skip(f"{path.name} reads a rate series from {traces_dir()}, which this checkout has not")
    scenario = load_scenario(path)
    assert scenario.nodes and scenario.models and scenario.workload


def test_a_valid_document_reads_with_its_defaults() -> None:
    s = parse_scenario(copy.deepcopy(BASE))
    assert s.time_scale == 1.0
    assert s.nodes[1].rack == "b1" and s.nodes[1].free == 2 and s.nodes[0].free == 8
    assert s.models[0].priority == 0 and s.models[0].baseline.pp == 1
    assert s.workload[0].rate_rps(123) == 2.0


@pytest.mark.parametrize("mutate,path,words", [
    (lambda d: d["events"].append({"at_s": 10, "kind": "fail", "node": "x9", "gpus": 1}), "events[1].node",
     "unknown node 'x9'"),
    (lambda d: d["nodes"][0].update(gpu="H900"), "nodes[0].gpu", "unknown GPU 'H900'"),
    (lambda d: d["nodes"][1].update(free=9), "nodes[1].free", "at most gpus"),
    (lambda d: d["nodes"].append(dict(d["nodes"][0])), "nodes[2].id", "duplicate"),
    (lambda d: d["models"][0].update(model="GPT-9"), "models[0].model", "unknown model"),
    (lambda d: d["models"][0]["slo"].pop("tpot_ms"), "models[0].slo.tpot_ms", "required"),
    (lambda d: d["models"][0]["baseline"].update(tp=16), "models[0].baseline.tp", "do not fit"),
    (lambda d: d["models"][0]["baseline"].update(nodes=["a1", "zz"]), "models[0].baseline.nodes[1]", "unknown node"),
    (lambda d: d["workload"][0].update(deployment="nope"), "workload[0].deployment", "unknown deployment"),
    (lambda d: d["workload"][0].update(rate_rps=[[0, 1], [0, 2]]), "workload[0].rate_rps[1]", "must increase"),
    (lambda d: d["workload"][0].update(rate_rps=-1), "workload[0].rate_rps", ">= 0"),
    (lambda d: d["workload"][0]["prompt_tokens"].update(dist="zipf"), "workload[0].prompt_tokens.dist", "one of"),
    (lambda d: d["workload"][0]["output_tokens"].update(spread=3), "workload[0].output_tokens.spread", "unknown key"),
    (lambda d: d["workload"][0].update(arrival="trace", trace="missing.csv"), "workload[0].trace", "cannot read"),
    (lambda d: d["events"][0].update(kind="explode"), "events[0].kind", "one of"),
    (lambda d: d["events"][0].update(gpus=9), "events[0].gpus", "only 8 GPUs"),
    (lambda d: d["events"][0].update(at_s=9999), "events[0].at_s", "within duration_s"),
    (lambda d: d["events"].append({"at_s": 5, "kind": "degrade_link", "a": "a1", "b": "a1", "gbps": 1}),
     "events[1].b", "must differ"),
    (lambda d: d.update(tiem_scale=2), "tiem_scale", "unknown key"),
    (lambda d: d.pop("network"), "network", "required"),
    (lambda d: d["network"].update(links=[{"a": "a1", "b": "q", "gbps": 5}]), "network.links[0].b", "unknown node"),
])
def test_every_error_names_its_key_path(mutate: Any, path: str, words: str) -> None:
    errors = errors_of(mutate)
    assert path in errors, errors
    assert words in errors[path]


def test_membership_follows_join_and_leave_in_time_order() -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["events"] = [
            {"at_s": 200, "kind": "preempt", "node": "c1", "gpus": 1},  # after c1 joined: fine
            {"at_s": 100, "kind": "join", "node": {"id": "c1", "gpu": "L40S", "gpus": 4, "nvlink": False}},
            {"at_s": 300, "kind": "leave", "node": "c1"},
            {"at_s": 400, "kind": "restore", "node": "c1"},  # after it left: unknown
            {"at_s": 50, "kind": "fail", "node": "c1", "gpus": 1},  # before it joined: unknown
        ]
    errors = errors_of(mutate)
    assert set(errors) == {"events[3].node", "events[4].node"}


def test_all_problems_are_reported_at_once() -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["seed"] = "seven"
        d["nodes"][0]["gpus"] = 0
        d["events"][0]["kind"] = "oops"
    assert {"seed", "nodes[0].gpus", "events[0].kind"} <= set(errors_of(mutate))


def test_a_trace_workload_reads_its_csv(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text("t_s,prompt_tokens,output_tokens\n0,10,5\n1.5,20,6\n")
    doc = copy.deepcopy(BASE)
    doc["workload"] = [{"deployment": "chat", "arrival": "trace", "trace": "t.csv"}]
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    s = load_scenario(tmp_path / "s.yaml")
    assert [r.prompt_tokens for r in s.workload[0].trace] == [10, 20]


def test_a_rate_series_is_compressed_scaled_to_its_peak_and_sits_at_window_middles(tmp_path: Path) -> None:
    (tmp_path / "r.csv").write_text("window_start_s,rate_rps\n600,100\n1200,400\n1800,200\n2400,900\n")
    doc = copy.deepcopy(BASE)
    doc["workload"][0]["rate_rps"] = {"series": "r.csv", "start_s": 0, "span_s": 1800, "compress": 10,
                                      "peak_rps": 8}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    w = load_scenario(tmp_path / "s.yaml").workload[0]
    # shifted to start at 0; the last window (2400 -> 1800 after the shift) is outside the span;
    # 600 trace seconds are 60 simulated ones; the span's peak (400) becomes 8 req/s
    assert w.rate_points == ((30.0, 2.0), (90.0, 8.0), (150.0, 4.0))


def test_a_bad_rate_series_names_its_key(tmp_path: Path) -> None:
    (tmp_path / "r.csv").write_text("t,rate\n0,1\n")
    for name, peak, key, words in (("r.csv", 1, "series", "header"), ("missing.csv", 1, "series", "cannot read"),
                                   ("r.csv", 0, "peak_rps", "greater than 0")):
        doc = copy.deepcopy(BASE)
        doc["workload"][0]["rate_rps"] = {"series": name, "span_s": 600, "peak_rps": peak}
        (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
        with pytest.raises(SchemaError) as err:
            load_scenario(tmp_path / "s.yaml")
        assert words in err.value.errors[f"workload[0].rate_rps.{key}"], err.value.errors


def test_a_file_that_is_not_yaml_says_where(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    with pytest.raises(SchemaError) as err:
        load_scenario(tmp_path / "bad.yaml")
    assert "line" in err.value.errors["(file)"]


def test_piecewise_rates_interpolate_and_hold_outside_their_points() -> None:
    doc = copy.deepcopy(BASE)
    doc["workload"][0]["rate_rps"] = [[100, 2], [200, 6]]
    w = parse_scenario(doc).workload[0]
    assert [w.rate_rps(t) for t in (0, 100, 150, 200, 999)] == [2, 2, 4, 6, 6]


def test_baseline_stages_fill_nodes_in_order_and_never_split_a_tp_group() -> None:
    s = parse_scenario(copy.deepcopy(BASE))
    from agents.sim.scenario import BaselineSpec

    assert baseline_stage_nodes(BaselineSpec(2, 3, ("a1", "b1")), {"a1": 5, "b1": 2}) == ["a1", "a1", "b1"]
    assert baseline_stage_nodes(BaselineSpec(4, 2, ("a1", "b1")), {"a1": 5, "b1": 2}) is None
    assert s.models[0].baseline.nodes == ("a1",)


# The rest of SCENARIOS.md, key by key: each rule the contract states has a case here.
@pytest.mark.parametrize("mutate,path,words", [
    (lambda d: d.pop("name"), "name", "required"),
    (lambda d: d.update(seed=True), "seed", ""),
    (lambda d: d.update(duration_s=0), "duration_s", ""),
    (lambda d: d.update(time_scale=0), "time_scale", ""),
    (lambda d: d.update(nodes=[]), "nodes", ""),
    (lambda d: d["nodes"][0].pop("nvlink"), "nodes[0].nvlink", "required"),
    (lambda d: d["nodes"][0].update(nvlink="yes"), "nodes[0].nvlink", ""),
    (lambda d: d["nodes"][0].update(colour="red"), "nodes[0].colour", "unknown key"),
    (lambda d: d["network"].pop("inter_rack_gbps"), "network.inter_rack_gbps", "required"),
    (lambda d: d["network"].update(links=[{"a": "a1", "b": "b1", "gbps": 0}]), "network.links[0].gbps", ""),
    (lambda d: d["models"].append(copy.deepcopy(d["models"][0])), "models[1].deployment", "duplicate"),
    (lambda d: d["models"][0].pop("baseline"), "models[0].baseline", "required"),
    (lambda d: d["models"][0]["baseline"].update(nodes=["a1", "a1"]), "models[0].baseline.nodes[1]", "twice"),
    (lambda d: d["models"][0].update(priority="high"), "models[0].priority", ""),
    (lambda d: d["workload"][0].update(arrival="burst"), "workload[0].arrival", "one of"),
    (lambda d: d["workload"][0].update(trace="t.csv"), "workload[0].trace", "unknown key"),
    (lambda d: d["workload"][0].update(rate_rps=[[0, 1], [5]]), "workload[0].rate_rps[1]", "pair"),
    (lambda d: d["workload"][0].update(output_tokens={"dist": "uniform", "min": 9, "max": 3}),
     "workload[0].output_tokens.max", ">= min"),
    (lambda d: d["workload"][0].update(output_tokens={"dist": "fixed"}), "workload[0].output_tokens.value", "required"),
    (lambda d: d["workload"][0]["prompt_tokens"].pop("max"), "workload[0].prompt_tokens.max", "required"),
    (lambda d: d["events"][0].pop("at_s"), "events[0].at_s", "required"),
    (lambda d: d["events"][0].update(duration_s=-5), "events[0].duration_s", ""),
    (lambda d: d["events"].append({"at_s": 5, "kind": "restore", "node": "zz"}), "events[1].node", "unknown node"),
    (lambda d: d["events"].append({"at_s": 5, "kind": "join", "node": {"id": "a1", "gpu": "L40S", "gpus": 4,
                                                                       "nvlink": False}}),
     "events[1].node", "already in the cluster"),
    (lambda d: d["events"].append({"at_s": 5, "kind": "join", "node": {"id": "c1", "gpu": "Z1", "gpus": 4,
                                                                       "nvlink": False}}),
     "events[1].node.gpu", "unknown GPU"),
    (lambda d: d["events"].append({"at_s": 5, "kind": "degrade_link", "a": "a1", "b": "b1"}),
     "events[1].gbps", "required"),
    (lambda d: d["events"].append({"at_s": 5, "kind": "leave", "node": "b1", "gpus": 2}), "events[1].gpus",
     "unknown key"),
])
def test_every_rule_of_the_contract_is_enforced_naming_its_key(mutate: Any, path: str, words: str) -> None:
    errors = errors_of(mutate)
    assert path in errors, errors
    assert words in errors[path]


def test_a_trace_with_wrong_columns_or_a_bad_row_names_the_trace_key(tmp_path: Path) -> None:
    for text, words in (("t,prompt,output\n0,1,1\n", "columns must be"),
                        ("t_s,prompt_tokens,output_tokens\n0,10,5\nx,1,1\n", "line 3"),
                        ("t_s,prompt_tokens,output_tokens\n5,10,5\n1,1,1\n", "must not decrease")):
        (tmp_path / "t.csv").write_text(text)
        doc = copy.deepcopy(BASE)
        doc["workload"] = [{"deployment": "chat", "arrival": "trace", "trace": "t.csv"}]
        with pytest.raises(SchemaError) as err:
            parse_scenario(doc, base_dir=tmp_path)
        assert words in err.value.errors["workload[0].trace"], err.value.errors
