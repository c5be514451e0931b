"""Seeded request arrivals from a scenario's `workload` section.

Every deployment draws from its own `random.Random`, seeded from the scenario seed and the
deployment id, so adding a deployment never changes another one's arrivals, and every policy
of a replay sees exactly the same requests.

* `poisson`: a non-homogeneous Poisson process whose rate is the scenario's piecewise-linear
  `rate_rps`, sampled by thinning (Lewis and Shedler): candidates at the peak rate, each kept
  with probability rate(t) / peak.
* `trace`: the CSV rows as they are (rows at or after `duration_s` are left out).

Token counts: `lognormal` takes the mean of the distribution itself and the sigma of its log
(mu = ln(mean) - sigma^2 / 2), rounded and clipped to [1, max]; `fixed` and `uniform` as named.
A request never asks for more than its model's context window: like a server that caps
`max_tokens`, the prompt is cut to leave room for one output token and the output to what is
left of the window. The cut is counted (`clipped`) so a report can say it happened.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from agents.sim.scenario import Scenario
from agents.sim.scenario_load import DistSpec, WorkloadSpec
from scheduler.modelspec import model_spec


@dataclass(frozen=True)
class Arrival:
    """One request as the workload offers it."""

    t_s: float  # arrival time (simulated seconds)
    deployment: str  # which deployment it is for
    prompt_tokens: int  # prompt length
    output_tokens: int  # tokens it will generate before it stops
    priority: int = 0  # its priority class (lower is served first; scheduler.router.request)
    deadline_s: float | None = None  # first token wanted this long after arrival
    blocks: tuple[int, ...] = ()  # hashes of its prompt's 512-token blocks (a trace's hash_ids)


@dataclass(frozen=True)
class Workload:
    """Every arrival of a scenario, in time order, and how many had to be cut to the context."""

    arrivals: tuple[Arrival, ...]  # sorted by (t_s, deployment order)
    clipped: int  # requests whose prompt + output was cut to the model's context window

    def of(self, deployment: str) -> tuple[Arrival, ...]:
        return tuple(a for a in self.arrivals if a.deployment == deployment)


def sample_tokens(dist: DistSpec, rng: random.Random) -> int:
    """One draw of a token-count distribution (module docstring)."""
    if dist.dist == "fixed":
        return int(dist.value or 1)
    if dist.dist == "uniform":
        return rng.randint(int(dist.min or 1), int(dist.max or 1))
    mean = float(dist.mean or 1.0)
    sigma = float(dist.sigma or 0.0)
    mu = math.log(mean) - sigma * sigma / 2
    value = int(round(math.exp(rng.gauss(mu, sigma)))) if sigma > 0 else int(round(mean))
    return max(1, min(int(dist.max or value), value))


def poisson_times(spec: WorkloadSpec, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times in [0, duration_s) of a Poisson process with the spec's rate (thinning)."""
    peak = spec.max_rate_rps()
    if peak <= 0:
        return []
    times: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return times
        # the second draw is taken even when the rate is flat, so a rate edit elsewhere in the
        # timeline does not shift the draws of a flat stretch
        if rng.random() * peak < spec.rate_rps(t):
            times.append(t)


def deployment_rng(seed: int, deployment: str) -> random.Random:
    """The generator of one deployment's arrivals: a string seed is hashed with SHA-512 by
    `random.seed`, so it is the same in every process (unlike `hash()`)."""
    return random.Random(f"{seed}:arrivals:{deployment}")


def build_workload(scenario: Scenario, *, duration_s: float | None = None) -> Workload:
    """Every arrival of `scenario` up to `duration_s` (default: the scenario's), in time order."""
    horizon = scenario.duration_s if duration_s is None else duration_s
    order = {m.deployment: i for i, m in enumerate(scenario.models)}
    context = {m.deployment: model_spec(m.model).max_context_tokens for m in scenario.models}
    keyed: list[tuple[float, int, int, Arrival]] = []
    clipped = 0
    for w_index, spec in enumerate(scenario.workload):
        rng = deployment_rng(scenario.seed, f"{spec.deployment}#{w_index}")
        window = context[spec.deployment]
        rows: Sequence[tuple[float, int, int]]
        if spec.arrival == "trace":
            rows = [(r.t_s, r.prompt_tokens, r.output_tokens) for r in spec.trace if r.t_s < horizon]
        else:
            assert spec.prompt_tokens is not None and spec.output_tokens is not None  # noqa: S101 - loader
            rows = [(t, sample_tokens(spec.prompt_tokens, rng), sample_tokens(spec.output_tokens, rng))
                    for t in poisson_times(spec, horizon, rng)]
        for i, (t, prompt, output) in enumerate(rows):
            if prompt + output > window:
                clipped += 1
                prompt = min(prompt, window - 1)
                output = min(output, window - prompt)
            keyed.append((t, order[spec.deployment], w_index * 10_000_000 + i,
                          Arrival(t, spec.deployment, prompt, output)))
    keyed.sort(key=lambda k: (k[0], k[1], k[2]))
    return Workload(tuple(k[3] for k in keyed), clipped)
