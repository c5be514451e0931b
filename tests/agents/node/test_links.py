"""The node agent's link probe (agents/node/links.py): the arithmetic, and one real probe over a data server."""

from __future__ import annotations

from agents.dataplane import DataServer
from agents.node.links import METHOD, LinkProber, link_from_timings


def test_bandwidth_counts_the_bulk_time_less_the_round_trip_and_keeps_the_best_round() -> None:
    rep = link_from_timings("b1", 100_000_000, [0.101, 0.2, 0.09], [0.001, 0.002], 1.7e9)
    assert rep is not None and rep.peer == "b1" and rep.method == METHOD and rep.measured_at == 1.7e9
    assert rep.bw_gbps == round(100_000_000 * 8 / 0.089 / 1e9, 4)
    assert rep.latency_us == 500.0  # half the fastest round trip
    assert link_from_timings("b1", 10, [0.001], [0.002], 0.0) is None  # nothing left once the RTT is off


def test_it_measures_a_peer_over_its_data_server_and_forgets_peers_no_longer_named() -> None:
    with DataServer() as server:
        prober = LinkProber(bulk_bytes=1 << 20, rounds=2, pings=2, interval_s=600.0)
        prober.tell({"b1": server.address, "c1": "127.0.0.1:9"})  # c1 does not answer
        got = prober.probe()
        assert [r.peer for r in got] == ["b1"] and got[0].bw_gbps > 0
        assert [r.peer for r in prober.reports()] == ["b1"]
        assert not prober.due()  # probed just now: the next round in interval_s
        prober.tell({"c1": "127.0.0.1:9"})
        assert prober.reports() == ()
