"""Candidate gears for one deployment on one snapshot, each with its estimates.

Filter -> build -> score, pruned so that the work grows with the number of atomic blocks
(in fact with the number of distinct block *shapes*), not with the number of GPUs:

1. Filter blocks: usable memory per GPU (92% rule - or less on a node whose engine takes a
   fixed share, capabilities.py - others' use, what this deployment would give back), and -
   for latency-critical deployments - stability (blocks that keep shrinking are left out,
   seed 000 section 4.1). Plans a node's engine cannot run (its modes, TP sizes, PP, mixed TP,
   spanning nodes) are never built; `Candidates.excluded` says which were left out and why.
2. Units (single plans): TP groups only inside one block, sized from the memory floor up
   (the minimum TP is the smallest that holds weights plus the minimum KV reserve); a block
   hosts as many disjoint groups as fit. PP chains of whole groups across blocks whose
   links pass `min_pp_link_gbps`; prefill/decode splits across two blocks whose link passes
   `min_kv_link_gbps`. Blocks of the same shape are interchangeable, so each unit *type* is
   estimated once.
3. Gears: for each unit type, as many replicas on distinct blocks as the load needs
   (`headroom` x offered rate), plus one mixed gear that fills the load greedily with the
   most efficient units of any type - several plans side by side on different blocks.
   Routing weights follow capacity.
4. Score: goodput (output tokens/s within the SLO), then fewer GPUs, then stability.

No fit -> `Candidates.infeasible` says why and what to relax.

Modules: `options` (PlannerOptions, Candidates), `units` (block rooms, units and their types,
PP chains, prefill/decode splits, no-fit reasons), `sizing` (SLO rates, gear estimates,
routing weights) and `candidates` (`plan_candidates` and its named steps).
"""

from __future__ import annotations

from scheduler.planner.candidates import clear_caches, plan_candidates
from scheduler.planner.options import DEFAULT_OPTIONS, Candidate, Candidates, PlannerOptions
from scheduler.planner.sizing import SLO_ATTAINMENT, _slo_rate
from scheduler.planner.units import MAX_CHAINS_PER_LENGTH, UnitKind

__all__ = ["Candidate", "Candidates", "DEFAULT_OPTIONS", "MAX_CHAINS_PER_LENGTH", "PlannerOptions", "SLO_ATTAINMENT",
           "UnitKind", "_slo_rate", "clear_caches", "plan_candidates"]
