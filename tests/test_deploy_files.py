"""Docker cannot run on this machine: check the deployment files' structure and references instead."""

from __future__ import annotations

import configparser
import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


APP_SERVICES = ("migrate", "web", "agents", "gateway", "worker", "beat", "fleet")


def test_it_has_every_part_of_a_production_deployment(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {"postgres", "redis", "edge", *APP_SERVICES}


def test_the_gateway_runs_apart_from_the_console_behind_one_address(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["gateway"]["command"][-1] == "console.gateway.asgi:application"
    assert services["web"]["environment"]["FLEXPIPE_PROCESS"] == "console"  # its /v1 is the gateway's
    # only the edge publishes a port: web and gateway scale (--scale) without a port clash
    assert [svc.get("ports") for name, svc in services.items() if svc.get("ports")] == [["8000:8000"]]
    assert services["edge"]["ports"] == ["8000:8000"]
    conf = (ROOT / "deploy" / "nginx" / "flexpipe.conf").read_text()
    mount = services["edge"]["volumes"][0].split(":")
    assert mount[0] == "./deploy/nginx/flexpipe.conf" and mount[1].startswith("/etc/nginx/conf.d/")
    assert re.search(r"location /v1/ \{\s*set \$gateway gateway:8001;", conf)
    assert re.search(r"location / \{\s*set \$web web:8000;", conf)


def test_the_agent_api_runs_apart_from_the_pages_behind_the_same_address(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["agents"]["command"][-1] == "console.agent_asgi:application"
    conf = (ROOT / "deploy" / "nginx" / "flexpipe.conf").read_text()
    assert re.search(r"location /agent/v1/ \{\s*set \$agents agents:8002;", conf)
    assert "agents" in services["edge"]["depends_on"]
    # the simulated fleet reports through the edge, as agents on other hosts do
    command = services["fleet"]["command"]
    assert command[command.index("--controller") + 1] == "http://edge:8000"
    assert "edge" in services["fleet"]["depends_on"]


def test_app_services_share_the_image_and_reach_postgres_and_redis_by_service_name(compose: dict[str, Any]) -> None:
    for name in APP_SERVICES:
        svc = compose["services"][name]
        assert svc["build"] == "." and svc["image"] == "flexpipe:latest", name
        env = svc["environment"]
        db, redis = urlparse(env["DATABASE_URL"]), urlparse(env["REDIS_URL"])
        assert db.scheme == "postgres" and db.hostname == "postgres", name
        assert redis.hostname == "redis", name
        assert env["DEBUG"] == "0", name
        assert "SECRET_KEY" in env and "FLEXPIPE_ENROLL_TOKEN" in env, name


def test_every_dependency_names_a_service_and_a_condition(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in compose["services"], f"{name} depends on unknown {dep}"
            assert cond["condition"] in {"service_healthy", "service_completed_successfully"}
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in compose["services"][dep], f"{dep} needs a healthcheck"


def _module_of(command: list[str]) -> str | None:
    if command[:2] == ["python", "-m"]:
        return command[2]
    if command[0] == "daphne":
        return command[-1].split(":")[0]
    if command[0] == "celery":
        return command[command.index("-A") + 1] + ".celery"
    return None


def test_every_command_starts_something_that_exists(compose: dict[str, Any]) -> None:
    for name in APP_SERVICES:
        command = compose["services"][name]["command"]
        module = _module_of(command)
        if module in ("console.gateway.asgi", "console.agent_asgi"):  # the first to read the settings: its own process
            subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, check=True,
                           env={**os.environ, "DJANGO_SETTINGS_MODULE": "console.settings"})
        elif module:
            importlib.import_module(module if module != "agents.sim" else "agents.sim.__main__")
        else:
            assert command[:2] == ["python", "manage.py"], name
        for arg in command:
            if arg.endswith(".yaml"):
                assert (ROOT / arg).exists(), arg


def test_the_web_command_serves_the_asgi_application() -> None:
    from console.asgi import application

    assert application is not None


def test_the_dockerfile_builds_on_python_311_with_the_pinned_requirements() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11", text, re.M)
    assert "-r requirements.txt" in text and "COPY requirements.txt" in text


def supervised() -> dict[str, dict[str, str]]:
    """The programs of `make run`, as scripts/supervisord.conf has them."""
    conf = configparser.RawConfigParser()
    conf.read(ROOT / "scripts" / "supervisord.conf")
    return {name.split(":", 1)[1]: dict(conf[name]) for name in conf.sections() if name.startswith("program:")}


def test_make_run_supervises_the_same_six_processes_and_restarts_each() -> None:
    programs = supervised()
    assert set(programs) == {"web", "agents", "gateway", "worker", "beat", "fleet"}
    assert "console.asgi:application" in programs["web"]["command"]
    assert programs["web"]["environment"] == 'FLEXPIPE_PROCESS="console"'
    assert "console.gateway.asgi:application" in programs["gateway"]["command"]
    assert "$FLEXPIPE_GATEWAY_PORT" in programs["gateway"]["command"]
    assert "console.agent_asgi:application" in programs["agents"]["command"]
    assert "$FLEXPIPE_AGENT_PORT" in programs["agents"]["command"]
    assert "FLEXPIPE_AGENT_PORT" in (ROOT / "scripts" / "fleet.sh").read_text()  # where the fleet reports
    # the fleet by ENGINE: the simulated one (sim) or real agent daemons (torch, vllm)
    assert shlex.split(programs["fleet"]["command"]) == ["scripts/fleet.sh"]
    fleet = (ROOT / "scripts" / "fleet.sh").read_text()
    assert "-m agents.sim --scenario" in fleet and "-m agents.node" in fleet
    for name, program in programs.items():
        assert program["autorestart"] == "true", name  # a crash is not an outage (invariant 9)
        assert program["stopasgroup"] == program["killasgroup"] == "true", name
    assert "scripts/supervisor.sh daemon" in (ROOT / "scripts" / "run.sh").read_text()
    assert "supervisord -c scripts/supervisord.conf" in (ROOT / "scripts" / "supervisor.sh").read_text()


LONG_RUNNING = ("postgres", "redis", "edge", "web", "agents", "gateway", "worker", "beat", "fleet")


def test_every_long_running_service_restarts_and_has_a_health_check(compose: dict[str, Any]) -> None:
    for name in LONG_RUNNING:
        svc = compose["services"][name]
        assert svc.get("restart") in ("unless-stopped", "always"), name
        check = svc.get("healthcheck")
        assert check and check["test"][0] in ("CMD", "CMD-SHELL") and len(check["test"]) > 1, name
    assert compose["services"]["migrate"]["restart"] == "no"  # a one-shot job


def test_every_worker_consumes_the_queue_tasks_are_sent_to(compose: dict[str, Any]) -> None:
    # A worker on another queue starts fine and runs nothing: ticks and transitions would stall silently.
    # The queue as a deployment's settings have it (the test session points Celery at its own queue).
    env = {k: v for k, v in os.environ.items() if k != "FLEXPIPE_QUEUE"}
    queue = subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); from django.conf import settings; "
                               "print(settings.CELERY_TASK_DEFAULT_QUEUE)"],
        env={**env, "DJANGO_SETTINGS_MODULE": "console.settings"}, cwd=ROOT, capture_output=True, text=True,
        check=True).stdout.strip()
    for where, command in (("docker-compose worker", compose["services"]["worker"]["command"]),
                           ("supervisord.conf worker", shlex.split(supervised()["worker"]["command"]))):
        assert "-Q" in command, where
        assert command[command.index("-Q") + 1].split(",") == [queue], where
