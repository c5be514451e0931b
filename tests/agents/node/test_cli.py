"""`python -m agents.node` as an operator starts it: what it refuses, and how."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from agents.node.cli import DEFAULT_BUCKET_EDGES, length_buckets, parser
from agents.node.gpuspec import is_spec, spec_document
from agents.probes.static import parse_static
from agents.sim.cluster import SimCluster
from agents.sim.scenario import load_scenario
from scheduler.buckets import LengthBuckets

ROOT = Path(__file__).resolve().parents[3]


def run_node(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agents.node", "--controller", "http://127.0.0.1:9", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_nvml_without_a_gpu_exits_2_with_one_line() -> None:
    done = run_node("--token", "fpj_x", "--backend", "torch", "--probe", "nvml")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("no NVIDIA GPU/driver found:"), done.stderr


@pytest.mark.parametrize(("args", "says"), [
    (["--probe", "static", "--static-gpus", "2xB999"], "'B999' is not in the catalog"),
    (["--probe", "static"], "--probe static needs --static-gpus"),
    (["--probe", "static", "--static-gpus", "no/such/file.json"], "neither a spec"),
    (["--probe", "static", "--static-gpus", "1xA100-80G", "--data-addr", "nohost"], "--data-addr 'nohost'"),
    (["--probe", "static", "--static-gpus", "1xA100-80G", "--length-buckets", "16,x"], "--length-buckets '16,x'"),
    (["--probe", "static", "--static-gpus", "1xA100-80G", "--length-buckets", "64,16"],
     "--length-buckets '64,16': edges: must be increasing"),
])
def test_a_bad_start_exits_2_naming_the_option(args: list[str], says: str) -> None:
    done = run_node("--token", "fpj_x", "--backend", "torch", *args)
    assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_without_a_token_it_says_which_option_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEXPIPE_ENROLL_TOKEN", raising=False)
    done = run_node("--backend", "torch", "--probe", "static", "--static-gpus", "1xA100-80G")
    assert done.returncode == 2 and "--token" in done.stderr


def test_a_spec_names_the_gpus_as_the_simulated_cluster_of_the_same_scenario_does() -> None:
    scenario = load_scenario(ROOT / "scenarios" / "demo.yaml")
    cluster = SimCluster(scenario, random.Random(scenario.seed))
    infos, reports = parse_static(spec_document("4xA100-80G", "a100-b", namespace=scenario.name))
    assert [g.uuid for g in infos] == [g.uuid for g in cluster.nodes["a100-b"].gpus]
    assert {g.nvlink_group for g in infos} == {g.nvlink_group for g in cluster.nodes["a100-b"].gpus}
    assert all(r.healthy and r.mem_used_bytes == 0 for r in reports)


def test_a_spec_is_told_apart_from_a_file() -> None:
    assert is_spec("2xA100-80G") and is_spec("2xA100-80G,1xL40S")
    assert not is_spec("node.yaml") and not is_spec("") and not is_spec("2x")
    two = spec_document("2xA100-80G,1xL40S", "n")["gpus"]
    assert [g["nvlink_group"] if "nvlink_group" in g else None for g in two] == ["n-nvl0", "n-nvl0", None]


def test_length_buckets_alone_are_the_default_ones_and_edges_halve_the_share_per_bucket() -> None:
    args = parser().parse_args(["--controller", "http://c", "--backend", "torch", "--probe", "static",
                                "--length-buckets"])
    assert length_buckets(args.length_buckets) == LengthBuckets() and args.length_buckets == DEFAULT_BUCKET_EDGES
    assert length_buckets("16,64,256") == LengthBuckets(edges=(16, 64, 256), shares=(1.0, 0.5, 0.25, 0.125))
    assert parser().parse_args(["--controller", "http://c", "--backend", "torch", "--probe", "static"]).length_buckets is None
