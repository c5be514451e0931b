"""flexpipe+learned: FlexPipe's router whose weights learn (Hedge), rolled out against round-robin.

A routing policy (router.RoutingPolicy) made of the two policies it compares and the rollout that
decides between them (learning.py has the rules and why): each new request takes an arm - the
learned router or round-robin - by the RolloutController's stage; when it finishes, its latencies
against its SLO say whether it violated it, the controller counts that for its arm, and a request of
the learned arm updates the router's weights by Hedge from how each score term had ranked the plan
it went to. Every stage change is kept (`controller.events`) for the audit and the bench.

`slo(prompt_tokens, output_tokens) -> (ttft_s, tpot_s)` is the SLO a request is held to (the
caller's: a deployment's objectives, or bench.route's per-request rule).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

from scheduler.router.baselines import RoundRobin
from scheduler.router.decision import Decision
from scheduler.router.learning import HedgeConfig, RolloutConfig, RolloutController, advocacy, hedge_update
from scheduler.router.pool import Pool
from scheduler.router.request import RouteRequest
from scheduler.router.router import Router, RouterConfig, record_prefix

SloFn = Callable[[int, int], tuple[float, float]]


class LearnedRouter:
    name = "flexpipe+learned"

    def __init__(self, config: RouterConfig | None = None, *, rng: random.Random | None = None,
                 rollout: RolloutConfig | None = None, hedge: HedgeConfig | None = None,
                 slo: SloFn | None = None, start_s: float = 0.0) -> None:
        rng = rng or random.Random(0)
        self.router = Router(config, rng=random.Random(rng.random()))
        self.rr = RoundRobin(random.Random(rng.random()))
        self.controller = RolloutController(rollout or RolloutConfig(), start_s=start_s)  # the caller's clock
        self.hedge = hedge or HedgeConfig()
        self.slo: SloFn = slo or (lambda prompt, output: (float("inf"), float("inf")))
        self._n = 0
        # id(request) -> (request, arm, advocacy of the learned arm's pick); the request is kept so
        # its id is not reused while it runs
        self._open: dict[int, tuple[RouteRequest, str, dict[str, float] | None]] = {}
        self._arm: dict[int, str] = {}

    @property
    def weights(self) -> dict[str, float]:
        return self.router.weights()

    def route(self, req: RouteRequest, pool: Pool, now_s: float) -> Decision:
        self.controller.tick(now_s)
        self._n += 1
        arm = self.controller.arm(str(self._n))
        self._arm[id(req)] = arm
        return self.router.route(req, pool, now_s) if arm == "learned" else self.rr.route(req, pool, now_s)

    def admitted(self, decision: Decision, slot: int) -> None:
        # the prefix index follows where every request went, whichever arm chose it
        record_prefix(self.router.index, decision, slot)
        req = decision.request
        arm = self._arm.pop(id(req), "rr")
        adv = None
        if arm == "learned" and decision.scores:
            ok = decision.hard_ok if decision.relaxed or decision.fits_now is None else decision.fits_now
            cand = [int(i) for i in np.flatnonzero(ok)] if ok is not None else [int(i) for i in decision.order]
            adv = advocacy({k: v.tolist() for k, v in decision.scores.items()}, cand or [slot], slot)
        self._open[id(req)] = (req, arm, adv)

    def first_token(self, plan_id: str, now_s: float, ttft_s: float, predicted_s: float | None) -> None:
        self.router.first_token(plan_id, now_s, ttft_s, predicted_s)

    def forget(self, plan_id: str) -> None:
        self.router.forget(plan_id)

    def finished(self, req: RouteRequest, ttft_s: float, tpot_s: float | None, now_s: float) -> None:
        entry = self._open.pop(id(req), None)
        if entry is None or entry[0] is not req:
            return
        _, arm, adv = entry
        lim_ttft, lim_tpot = self.slo(req.prompt_tokens, req.max_tokens)
        violated = ttft_s > lim_ttft or (tpot_s is not None and tpot_s > lim_tpot)
        self.controller.finished(arm, violated)
        if adv is not None:
            self.router.set_weights(hedge_update(self.router.weights(), adv, violated, self.hedge))


__all__ = ["LearnedRouter"]
