"""The grid searches behind `costmodel.DEFAULT_EFFICIENCY` (`python -m bench.fidelity --fit`).

Holds `fit`, which fits the compute factors on the in-sample operator rows (`fit_compute`), then
the in-node send/recv factors (`fit_p2p`), then the link and all-reduce factors on the collective
rows scored together with the operator rows (`fit_links`), each minimising median + p90 relative
error (`_score`); and `leave_one_model_out`, which fits the compute factors on one in-sample model
and prints the errors on the other, a check that the factors carry to a model they never saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from bench._fidelity_rows import NETWORK_SETUPS, Row, rel_errors, summary
from scheduler import costmodel
from scheduler.costmodel import DEFAULT_EFFICIENCY, Efficiency
from scheduler.hardware import CATALOG


def fit_compute(comp: Sequence[Row]) -> tuple[float, float, float]:
    """(mfu, mbu, kernel_overhead_s) with the least median + p90 relative error on `comp`."""
    flops = np.array([r.flops for r in comp])
    nbytes = np.array([r.bytes_moved for r in comp])
    peak = np.array([CATALOG[r.spec_name].bf16_flops for r in comp])
    hbm = np.array([CATALOG[r.spec_name].hbm_bytes_per_s for r in comp])
    meas = np.array([r.measured_s for r in comp])
    best: tuple[float, float, float, float] | None = None
    for mfu in np.arange(0.60, 0.85, 0.005):
        tc = flops / (mfu * peak)
        for mbu in np.arange(0.60, 0.95, 0.01):
            tm = nbytes / (mbu * hbm)
            base = np.sqrt(tc * tc + tm * tm)
            for overhead in np.arange(0.0, 10.5e-6, 0.5e-6):
                e = np.abs(base + overhead - meas) / meas
                score = float(np.median(e) + np.percentile(e, 90))
                if best is None or score < best[0]:
                    best = (score, float(mfu), float(mbu), float(overhead))
    assert best is not None
    return best[1], best[2], best[3]


def _score(errors: np.ndarray) -> float:
    return float(np.median(errors) + np.percentile(errors, 90))


def fit_p2p(net: Sequence[Row], kernel_overhead_s: float, link_latency_s: float) -> tuple[float, float]:
    """(p2p_link_efficiency, p2p_latency_s) with the least median + p90 relative error on the
    in-node send/recv rows (a copy over the datasheet link: no ring, no reduction)."""
    p2p = [r for r in net if r.collective == "send_recv" and r.link is not None and not r.link.measured]
    if not p2p:
        return DEFAULT_EFFICIENCY.p2p_link_efficiency, DEFAULT_EFFICIENCY.p2p_latency_s
    size = np.array([r.x for r in p2p], dtype=float)
    bw = np.array([r.link.bytes_per_s for r in p2p if r.link is not None])
    meas = np.array([r.measured_s for r in p2p])
    best: tuple[float, float, float] | None = None
    for p2p_eff in np.arange(0.60, 1.0, 0.01):
        for lat in np.arange(0.0, 20.1e-6, 0.5e-6):
            pred = kernel_overhead_s + link_latency_s + lat + size / (p2p_eff * bw)
            score = _score(np.abs(pred - meas) / meas)
            if best is None or score < best[0]:
                best = (score, float(p2p_eff), float(lat))
    assert best is not None
    return best[1], best[2]


def fit_links(net: Sequence[Row], comp_errors: np.ndarray, mbu: float,
              kernel_overhead_s: float | None = None, p2p: tuple[float, float] | None = None
              ) -> tuple[float, float, float]:
    """(link_efficiency, link_latency_s, allreduce_latency_s) with the least median + p90
    relative error over the network rows together with the operator rows' errors (so the
    score is the one the report prints for all rows), by a coarse grid and then a fine one."""
    size = np.array([r.x for r in net], dtype=float)
    workers = np.array([r.workers for r in net], dtype=float)
    is_ar = np.array([r.collective == "all_reduce" for r in net])
    measured = np.array([r.link is not None and r.link.measured for r in net])
    bw = np.array([r.link.bytes_per_s if r.link is not None else 0.0 for r in net])
    lanes = np.array([r.lanes for r in net], dtype=float)
    probe = np.array([r.probe_latency_s for r in net])
    meas = np.array([r.measured_s for r in net])
    hbm = np.array([CATALOG[NETWORK_SETUPS[r.source][0]].hbm_bytes_per_s for r in net])
    share = (workers - 1) / workers * size
    reduce_s = costmodel.REDUCE_HBM_TOUCHES * share / (mbu * hbm)

    launch = DEFAULT_EFFICIENCY.kernel_overhead_s if kernel_overhead_s is None else kernel_overhead_s
    p2p_eff, p2p_lat = p2p if p2p is not None else (DEFAULT_EFFICIENCY.p2p_link_efficiency,
                                                     DEFAULT_EFFICIENCY.p2p_latency_s)

    def errors(link_eff: float, lat: float, ar_lat: float) -> np.ndarray:
        # one hop over the path (Path.latency of row_path's path); a copy adds one kernel launch
        # and the send/recv handshake
        hop = lat + np.where(measured, np.maximum(0.0, probe - launch - p2p_lat - lat), 0.0)
        copy = launch + p2p_lat + hop + size / np.where(measured, bw, p2p_eff * bw)
        ar = ar_lat + 2 * (workers - 1) * hop + 2 * share / (link_eff * lanes * bw) + reduce_s
        pred = np.where(is_ar, ar, copy)
        return np.concatenate([comp_errors, np.abs(pred - meas) / meas])

    def search(effs: np.ndarray, lats: np.ndarray, ar_lats: np.ndarray) -> tuple[float, float, float, float]:
        best: tuple[float, float, float, float] | None = None
        for link_eff in effs:
            for lat in lats:
                for ar_lat in ar_lats:
                    score = _score(errors(float(link_eff), float(lat), float(ar_lat)))
                    if best is None or score < best[0]:
                        best = (score, float(link_eff), float(lat), float(ar_lat))
        assert best is not None
        return best

    _, e0, l0, a0 = search(np.arange(0.50, 1.0, 0.04), np.arange(0.0, 31e-6, 3e-6), np.arange(0.0, 91e-6, 6e-6))
    _, e1, l1, a1 = search(np.arange(max(0.3, e0 - 0.04), min(1.0, e0 + 0.041), 0.01),
                           np.arange(max(0.0, l0 - 3e-6), l0 + 3.1e-6, 1e-6),
                           np.arange(max(0.0, a0 - 6e-6), a0 + 6.1e-6, 1e-6))
    return e1, l1, a1


def fit(rows: Sequence[Row]) -> Efficiency:
    """Least (median + p90) relative error over the in-sample rows, by grid search: compute
    factors on the operator rows, then link factors on the collective rows (scored together
    with the operator rows, as the report scores all rows)."""
    comp = [r for r in rows if r.in_sample and not r.collective]
    net = [r for r in rows if r.in_sample and r.collective and r.link is not None]
    mfu, mbu, overhead = fit_compute(comp)
    compute_eff = replace(DEFAULT_EFFICIENCY, mfu=mfu, mbu=mbu, kernel_overhead_s=overhead)
    p2p = fit_p2p(net, overhead, DEFAULT_EFFICIENCY.link_latency_s)
    link_eff, lat, ar_lat = fit_links(net, rel_errors(comp, compute_eff), mbu, overhead, p2p)
    return replace(
        compute_eff,
        mfu=round(mfu, 3),
        mbu=round(mbu, 3),
        kernel_overhead_s=round(overhead, 7),
        link_efficiency=round(link_eff, 3),
        link_latency_s=round(lat, 7),
        allreduce_latency_s=round(ar_lat, 7),
        p2p_link_efficiency=round(p2p[0], 3),
        p2p_latency_s=round(p2p[1], 7),
    )


def leave_one_model_out(rows: Sequence[Row]) -> list[dict[str, object]]:
    """Fit the compute factors on one in-sample model, predict the other(s): a check that the
    factors carry to a model they were not fitted on."""
    comp = [r for r in rows if r.in_sample and not r.collective]
    models = sorted({r.source for r in comp})
    out: list[dict[str, object]] = []
    if len(models) < 2:
        return out
    print("\nleave one model out (compute factors fitted on one model, errors on the other):")
    for held in models:
        train = [r for r in comp if r.source != held]
        test = [r for r in comp if r.source == held]
        mfu, mbu, overhead = fit_compute(train)
        eff = replace(DEFAULT_EFFICIENCY, mfu=mfu, mbu=mbu, kernel_overhead_s=overhead)
        s = summary(rel_errors(test, eff))
        print(f"  held out {held:<36} fit mfu {mfu:.3f} mbu {mbu:.3f} overhead {overhead * 1e6:.1f} us"
              f" -> median {s['median']:.1%}  p90 {s['p90']:.1%}")
        out.append({"held_out": held, "mfu": mfu, "mbu": mbu, "kernel_overhead_s": overhead, **s})
    return out
