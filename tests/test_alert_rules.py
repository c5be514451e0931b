"""deploy/prometheus/alerts.yml passes promtool's checks and its unit tests (alerts_test.yml).

promtool comes with Debian's `prometheus` package (.ci/run installs it). Without it these tests skip,
saying so; tests/console/metrics/test_alerts.py still walks every rule through the console's parser.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

RULES_DIR = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")

needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus; .ci/run does)")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=120, check=False)


@needs_promtool
def test_promtool_accepts_the_alert_rules() -> None:
    out = promtool("check", "rules", "alerts.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 7 rules found" in out.stdout, out.stdout


@needs_promtool
def test_each_alert_fires_on_its_scripted_series_and_not_on_the_healthy_one() -> None:
    out = promtool("test", "rules", "alerts_test.yml")
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_the_unit_tests_cover_every_alert() -> None:
    import yaml

    rules = yaml.safe_load((RULES_DIR / "alerts.yml").read_text())
    names = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    tests = yaml.safe_load((RULES_DIR / "alerts_test.yml").read_text())["tests"]
    fired = {t["alertname"] for case in tests for t in case.get("alert_rule_test", []) if t["exp_alerts"]}
    quiet = {t["alertname"] for case in tests for t in case.get("alert_rule_test", []) if not t["exp_alerts"]}
    assert fired == names and quiet == names, (names - fired, names - quiet)


@needs_promtool
def test_promtool_refuses_a_broken_rule(tmp_path: Path) -> None:
    """The check is not a formality: a rule with a bad expression fails it."""
    bad = tmp_path / "bad.yml"
    bad.write_text("groups:\n  - name: x\n    rules:\n      - alert: Broken\n        expr: flexpipe_gpus >\n")
    out = subprocess.run([PROMTOOL or "promtool", "check", "rules", str(bad)], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode != 0 and "Broken" in out.stdout + out.stderr
