"""A "stay" that repeats the last decision is counted, not stored again (issue 19).

Every tick decides for every deployment; while nothing changes that is the same "stay" again and
again - before, a ~6.7 KB Decision row and an audit entry each time. Now actions.do_record_decision
asks `repeat_of` whether the deployment's newest row says the same thing; if so it bumps that row's
`repeats` and `last_at` and refreshes its figures (the row explains the latest tick of its run),
and writes no audit entry. The next decision that differs is stored and audited as always, and its
audit entry names the run it ends (`ends_run`, from `ended_run`): the audit still says what was
decided and for how long (DESIGN.md invariant 5).

The same thing: outcome "stay" both times, the same trigger, current and target gear, actor, an
empty note, no approval, and the same reasons once their figures are set aside ("gain 812 tokens
vs threshold 950" and "gain 790 tokens vs threshold 950" are one reason under a load that
breathes; "TP4", "2x TP2" and GPU names keep their digits).

Measured (one settled deployment, 100 periodic ticks, each committed, PostgreSQL 15 on the 2-core
dev machine): before, 100 Decision rows, 100 audit entries and the decision table 8 -> 120 KiB;
now 0 new rows (one row's repeats 1 -> 101), 0 audit entries, the table stays at 8 KiB (the
updates are HOT: no indexed column changes).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from console.gearbox.models import Decision, Deployment

# a figure standing on its own: not part of a name (TP4, a1-0, PP2xTP4, TP2+4, 10.0.0.1:7070)
_FIGURE = re.compile(r"(?<![\w.+\-:/])\d+(?:\.\d+)?%?(?![\w.+\-:/])")
_FIELDS = ("id", "trigger", "outcome", "current_gear_id", "target_gear_id", "actor", "note", "approval",
           "reasons", "repeats", "at", "last_at")


def reasons_key(reasons: Iterable[object]) -> tuple[str, ...]:
    """The reasons with their figures set aside (module docstring)."""
    return tuple(_FIGURE.sub("#", str(r)) for r in reasons)


def newest(dep: Deployment) -> Decision | None:
    """The deployment's newest decision, the fields a comparison needs (index gearbox_decision_newest)."""
    return Decision.objects.filter(deployment=dep).order_by("-id").only(*_FIELDS).first()


def repeat_of(last: Decision | None, row: dict[str, Any]) -> bool:
    """Whether a decision about to be stored as `row` (Decision's fields) repeats `last`."""
    if last is None or row["outcome"] != "stay" or last.outcome != "stay":
        return False
    same = ("trigger", "current_gear_id", "target_gear_id", "actor", "note", "approval")
    return (all(getattr(last, f) == row[f] for f in same) and row["note"] == "" and row["approval"] == ""
            and reasons_key(last.reasons if isinstance(last.reasons, list) else []) == reasons_key(row["reasons"]))


def ended_run(last: Decision | None) -> dict[str, Any] | None:
    """What the audit entry of a new decision says about the run of repeats it ends (None: no run)."""
    if last is None or last.repeats <= 1:
        return None
    return {"decision_id": last.pk, "repeats": last.repeats, "from": last.at.isoformat(),
            "until": (last.last_at or last.at).isoformat()}
