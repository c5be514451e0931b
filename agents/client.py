"""HTTP client side of agent protocol v1 (see agents/protocol/), used by every agent."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from agents.protocol import (
    Ack,
    Command,
    GpuReport,
    RegisterRequest,
    RegisterResponse,
    Report,
    parse_command,
    parse_register_response,
)


class ControllerError(RuntimeError):
    """The controller refused a request. `errors` maps a field path to the reason."""

    def __init__(self, status: int, errors: dict[str, str], detail: str = "") -> None:
        self.status = status
        self.errors = errors
        self.detail = detail
        where = "; ".join(f"{k}: {v}" for k, v in errors.items()) or detail
        super().__init__(f"controller answered {status}: {where}")


def load_token(path: Path | None) -> str | None:
    """The agent token kept at `path` by an earlier enrollment, or None."""
    if path is None:
        return None
    try:
        token = path.read_text().strip()
    except OSError:
        return None
    return token or None


def save_token(path: Path, token: str) -> None:
    """Keep the agent's own token (mode 0600, replaced atomically): a restarted agent registers with
    it, since the join token re-enrolls an existing node only with an operator's approval."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(tmp, path)


FULL_REPORT_EVERY = 10  # a full report after at most this many (agents/protocol/, delta reports)


class DeltaReports:
    """Turns an agent's full reports into delta ones (agents/protocol/, delta reports).

    It remembers the GPU states of the last report the controller accepted; `shape` lists only what
    differs from them, and says "full" after a registration (a new epoch), after a failure
    (`forget`) and every `every` reports."""

    def __init__(self, every: int = FULL_REPORT_EVERY) -> None:
        if every < 1:
            raise ValueError(f"every: must be at least 1; got {every}")
        self.every = every
        self._accepted: dict[str, GpuReport] = {}
        self._epoch: int | None = None
        self._deltas_sent = 0  # accepted delta reports since the last full one

    def shape(self, report: Report) -> Report:
        if (report.epoch != self._epoch or not self._accepted or self._deltas_sent + 1 >= self.every
                or {g.uuid for g in report.gpus} != set(self._accepted)):
            return replace(report, full=True)
        return replace(report, full=False, gpus=tuple(g for g in report.gpus if self._accepted[g.uuid] != g))

    def accepted(self, report: Report, sent: Report) -> None:
        """The controller took `sent` (what shape made of `report`)."""
        self._accepted = {g.uuid: g for g in report.gpus}
        self._epoch = report.epoch
        self._deltas_sent = 0 if sent.full else self._deltas_sent + 1

    def forget(self) -> None:
        self._accepted, self._epoch, self._deltas_sent = {}, None, 0


class AgentClient:
    """One agent's connection to the controller. Not thread-safe: one per agent thread.

    `token` is the join token or the agent's own one; with `token_file` the agent's own token, once
    enrollment handed it out, is kept there and used from then on (also by the next process).
    """

    def __init__(self, base_url: str, token: str, *, timeout_s: float = 10.0,
                 transport: httpx.BaseTransport | None = None, token_file: Path | None = None,
                 delta_reports: bool = True) -> None:
        self.base_url = base_url.rstrip("/")
        self.deltas: DeltaReports | None = DeltaReports() if delta_reports else None
        self.token_file = token_file
        self.token = load_token(token_file) or token
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None,
              timeout_s: float | None = None) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"}
        kwargs: dict[str, Any] = {"headers": headers, "json": json, "params": params}
        if timeout_s is not None:
            kwargs["timeout"] = timeout_s
        resp = self._http.request(method, path, **kwargs)
        if resp.status_code >= 400:
            try:
                body = resp.json()
            except ValueError:
                body = {}
            errors = body.get("errors", {}) if isinstance(body, dict) else {}
            detail = body.get("detail", resp.text[:200]) if isinstance(body, dict) else resp.text[:200]
            raise ControllerError(resp.status_code, errors, detail)
        return resp.json()

    def register(self, request: RegisterRequest) -> RegisterResponse:
        if self.deltas is not None:
            self.deltas.forget()  # a new epoch: its first report is a full one
        resp = parse_register_response(self._call("POST", "/agent/v1/register", json=request.to_dict()))
        if resp.agent_token:
            # Enrollment hands out the agent's own token: from now on use it, never the join token.
            self.token = resp.agent_token
            if self.token_file is not None:
                save_token(self.token_file, resp.agent_token)
        return resp

    def report(self, report: Report) -> int:
        """Send a full report - as a delta one when the controller has the rest (DeltaReports)."""
        if self.deltas is None:
            return int(self._call("POST", "/agent/v1/report", json=report.to_dict())["accepted"])
        sent = self.deltas.shape(report)
        try:
            body = self._call("POST", "/agent/v1/report", json=sent.to_dict())
        except ControllerError as exc:
            self.deltas.forget()
            if exc.status == 400 and "full" in exc.errors:
                self.deltas = None  # an older controller: full reports from now on
                return self.report(report)
            raise
        except BaseException:
            self.deltas.forget()  # did it arrive? the next report says everything
            raise
        self.deltas.accepted(report, sent)
        return int(body["accepted"])

    def pull_commands(self, after: int = 0, wait_s: float = 0.0) -> list[Command]:
        body = self._call(
            "GET",
            "/agent/v1/commands",
            params={"after": after, "wait": wait_s},
            timeout_s=wait_s + 10.0,
        )
        return [parse_command(c) for c in body.get("commands", [])]

    def routing(self) -> dict[str, Any]:
        """The deployments' routing tables (GET /agent/v1/routing; console.gearbox.agent_api)."""
        body: dict[str, Any] = self._call("GET", "/agent/v1/routing")
        return body

    def ack(self, command_id: int, ack: Ack) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/agent/v1/commands/{command_id}/ack", json=ack.to_dict())
        return result
