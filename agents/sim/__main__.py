"""python -m agents.sim --scenario S --controller URL: run a scenario's simulated fleet live."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from agents.schema import SchemaError
from agents.sim.live import LiveFleet, parse_fault, wait_for_controller
from agents.sim.scenario import load_scenario

STREAM_TICK_S = 0.02  # wall seconds between passes while a stream is open


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agents.sim", description=__doc__)
    parser.add_argument("--scenario", required=True, help="scenario YAML (see docs/scenarios.md)")
    parser.add_argument("--controller", required=True, help="console base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--join-token", default=os.environ.get("FLEXPIPE_ENROLL_TOKEN", ""),
                        help="the cluster's join token (default: $FLEXPIPE_ENROLL_TOKEN)")
    parser.add_argument("--token-dir", default=None,
                        help="folder where each agent keeps its own token once enrolled (NODE.token), so a "
                             "restarted fleet registers again without re-enrolling")
    parser.add_argument("--report-interval", type=float, default=None,
                        help="seconds between reports when nothing changes (default: what the controller asks)")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="simulated seconds per wall second (default: the scenario's time_scale)")
    parser.add_argument("--duration", type=float, default=None, help="stop after this many wall seconds")
    parser.add_argument("--tick", type=float, default=0.25, help="wall seconds between passes")
    parser.add_argument("--wait-for-controller", type=float, default=120.0,
                        help="seconds to wait for the controller to answer at start")
    parser.add_argument("--fault", action="append", default=[], metavar="NODE:KIND:ACTION[:TIMES]",
                        help="make NODE's next TIMES (1) commands of KIND (a command kind or *) fail, hang or "
                             "lose_gpus half way; repeatable")
    parser.add_argument("--long-poll", type=float, default=10.0,
                        help="seconds an agent's command poll waits on the controller")
    parser.add_argument("--tokenizer", default=os.environ.get("FLEXPIPE_SIM_TOKENIZER") or None,
                        help="serve the data plane (the gateway's OpenAI API answered by the simulator), with the "
                             "token ids of this tokenizer folder (default: $FLEXPIPE_SIM_TOKENIZER; none: no data plane)")
    parser.add_argument("--data-port", type=int, default=0, help="the data plane's port (0: any free one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s fleet %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the events

    if not args.join_token:
        print("agents.sim: --join-token or FLEXPIPE_ENROLL_TOKEN is required (the agents enroll with it)",
              file=sys.stderr)
        return 2
    for name in ("report_interval", "time_scale", "tick"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            print(f"agents.sim: --{name.replace('_', '-')} must be > 0", file=sys.stderr)
            return 2
    try:
        faults = [parse_fault(f) for f in args.fault]
    except ValueError as exc:
        print(f"agents.sim: {exc}", file=sys.stderr)
        return 2
    try:
        scenario = load_scenario(args.scenario)
    except SchemaError as exc:
        print(f"agents.sim: {args.scenario}:", file=sys.stderr)
        for path, reason in exc.errors.items():
            print(f"  {path}: {reason}", file=sys.stderr)
        return 2

    wait_for_controller(args.controller, args.wait_for_controller)
    if args.tokenizer and not os.path.exists(args.tokenizer):
        print(f"agents.sim: --tokenizer {args.tokenizer}: no such file or folder", file=sys.stderr)
        return 2
    fleet = LiveFleet(scenario, args.controller, args.join_token, report_interval_s=args.report_interval,
                      time_scale=args.time_scale, faults=faults, long_poll_s=args.long_poll, tokenizer=args.tokenizer,
                      data_port=args.data_port, token_dir=Path(args.token_dir) if args.token_dir else None)
    logging.getLogger("agents.sim").info("%s: %d nodes, time x%g%s", scenario.name, len(scenario.nodes),
                                         fleet.time_scale, f", data plane on {fleet.data.server.address}"
                                         if fleet.data is not None and fleet.data.server is not None else "")
    started = time.monotonic()
    try:
        while args.duration is None or time.monotonic() - started < args.duration:
            fleet.step()
            # while the gateway streams from the simulator, pass often: tokens leave close to their sim time
            time.sleep(min(args.tick, STREAM_TICK_S) if fleet.streaming else args.tick)
    except KeyboardInterrupt:
        pass
    finally:
        fleet.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
