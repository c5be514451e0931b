"""A report's GPU rows written in plain SQL: the hot path of ingestion (issue 19).

Django's bulk_update writes each field as a CASE WHEN over the rows' ids, and builds that
expression tree in Python for every report: for one changed GPU it was a quarter of the web
process's CPU at 200 agents (py-spy --gil, bench.control_plane). One parameterised UPDATE per row,
sent with executemany (psycopg pipelines them: one round trip on PostgreSQL), costs a few
microseconds to build and is the same SQL on SQLite.
"""

from __future__ import annotations

from datetime import datetime

from django.db import connection

from console.fleet.models import Gpu

STATE_FIELDS = ("mem_used_bytes", "mem_total_bytes", "sm_util", "temperature_c", "healthy", "allocatable",
                "xid_errors", "ecc_errors", "updated_at")


def _update_sql() -> str:
    meta = Gpu._meta
    q = connection.ops.quote_name
    cols = ", ".join(f"{q(meta.get_field(f).column)} = %s" for f in STATE_FIELDS)
    return f"UPDATE {q(meta.db_table)} SET {cols} WHERE {q(meta.pk.column)} = %s"  # noqa: S608 - names from the model


def update_gpu_states(rows: list[Gpu], *, now: datetime) -> None:
    """Write STATE_FIELDS of these rows (their in-memory values; updated_at = now)."""
    if not rows:
        return
    stamp = connection.ops.adapt_datetimefield_value(now)
    params = [(r.mem_used_bytes, r.mem_total_bytes, r.sm_util, r.temperature_c, r.healthy, r.allocatable,
               r.xid_errors, r.ecc_errors, stamp, r.pk) for r in rows]
    with connection.cursor() as cursor:
        cursor.executemany(_update_sql(), params)
