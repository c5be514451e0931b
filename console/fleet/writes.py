"""A report's hot path in plain SQL: reading its node with its GPUs, claiming it, writing what
changed (issue 19).

Django's ORM builds each query's SQL in Python for every call, and instantiates a model per row
with the machinery for deferred fields and related objects: for a report of one changed GPU that
was most of the agent API's CPU (bench.control_plane at 800 agents: one core saturated, a report
~15 ms of it; py-spy --gil: the compiler's as_sql and the joined read's model rows on top).
bulk_update, for instance, writes each field as a CASE WHEN over the rows' ids. Here each
statement is a fixed parameterised string - the same SQL on PostgreSQL and SQLite, names quoted
from the models - and the values read go through the converters Django's compiler would apply,
so they arrive as the ORM would give them. executemany is pipelined by psycopg: one round trip.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.db import connection, models

from console.fleet.models import Gpu, GpuSample, Node

STATE_FIELDS = ("mem_used_bytes", "mem_total_bytes", "sm_util", "temperature_c", "healthy", "allocatable",
                "xid_errors", "ecc_errors", "updated_at")
# What a report reads: of its node, the live payload, the token check, whether it was schedulable,
# what the lost-plans check judges by (not `engines`, which it replaces); of each GPU, its state and
# the live payload (not custom_spec).
def _in_model_order(model: type[models.Model], names: set[str]) -> tuple[str, ...]:
    # Model.from_db takes a subset of the fields in the model's own order
    return tuple(f.name for f in model._meta.concrete_fields if f.name in names)


NODE_READ = _in_model_order(Node, {"id", "node_id", "hostname", "rack", "token_hash", "epoch", "registered_at",
                                   "reported_at", "schedulable", "unschedulable_reason", "lost_plans"})
GPU_READ = _in_model_order(Gpu, {"id", "node", "uuid", "index", "model", "nvlink_group", "mem_total_bytes",
                                 "mem_used_bytes", "sm_util", "temperature_c", "healthy", "allocatable",
                                 "xid_errors", "ecc_errors", "updated_at"})
SAMPLE_FIELDS = ("gpu", "at", "mem_used_bytes", "sm_util", "temperature_c", "healthy", "allocatable")


def _q(name: str) -> str:
    return connection.ops.quote_name(name)


def _cols(model: type[models.Model], names: Sequence[str], alias: str = "") -> list[str]:
    prefix = f"{alias}." if alias else ""
    return [prefix + _q(model._meta.get_field(n).column) for n in names]


def _loader(model: type[models.Model], names: Sequence[str]) -> list[tuple[Any, list[Any]]]:
    """Per column, the expression and the converters Django's compiler applies to it (SQLCompiler.get_converters)."""
    out = []
    for name in names:
        col = model._meta.get_field(name).get_col(model._meta.db_table)
        out.append((col, connection.ops.get_db_converters(col) + col.get_db_converters(connection)))
    return out


def _instance(model: type[models.Model], names: Sequence[str], loader: list[tuple[Any, list[Any]]],
              values: Sequence[Any]) -> Any:
    converted = []
    for (col, converters), value in zip(loader, values, strict=True):
        for convert in converters:
            value = convert(value, col, connection)
        converted.append(value)
    # as the ORM's rows: saved, from this database; a field not read is deferred (read if touched)
    return model.from_db(connection.alias, [model._meta.get_field(n).attname for n in names], converted)


def node_with_gpus(pk: int, *, commit_async: bool = False) -> tuple[Node | None, list[Gpu]]:
    """The node's row - locked until the transaction ends, where the database locks rows - and its
    present GPUs, in one query; each GPU's `node` is that row. `commit_async`: on PostgreSQL the
    same query also tells this transaction not to wait for its WAL flush (set_config, is_local:
    SET LOCAL without a round trip of its own; the caller says why it may)."""
    node_t, gpu_t = _q(Node._meta.db_table), _q(Gpu._meta.db_table)
    gpu_node, gpu_present = _q(Gpu._meta.get_field("node").column), _q(Gpu._meta.get_field("present").column)
    lock = " FOR UPDATE OF n" if connection.features.has_select_for_update_of else ""
    setting = ("set_config('synchronous_commit', 'off', true), "
               if commit_async and connection.vendor == "postgresql" else "")
    first = 1 if setting else 0
    sql = (f"SELECT {setting}{', '.join(_cols(Node, NODE_READ, 'n') + _cols(Gpu, GPU_READ, 'g'))} "  # noqa: S608 - names from the models
           f"FROM {node_t} n LEFT JOIN {gpu_t} g ON g.{gpu_node} = n.{_q(Node._meta.pk.column)} AND g.{gpu_present} = %s "
           f"WHERE n.{_q(Node._meta.pk.column)} = %s{lock}")
    with connection.cursor() as cursor:
        cursor.execute(sql, [True, pk])
        rows = [row[first:] for row in cursor.fetchall()]
    if not rows:
        return None, []
    split = len(NODE_READ)
    node = _instance(Node, NODE_READ, _loader(Node, NODE_READ), rows[0][:split])
    gpu_loader = _loader(Gpu, GPU_READ)
    gpus = []
    for row in rows:
        if row[split] is None:  # the outer join's row of a node with no present GPU
            continue
        gpu = _instance(Gpu, GPU_READ, gpu_loader, row[split:])
        gpu.node = node
        gpus.append(gpu)
    return node, gpus


def claim_report(pk: int, *, token_hash: str, epoch: int, seq: int, now: datetime, engines: list[Any]) -> bool:
    """Accept report `seq` of this epoch for the node if it is newer than the last accepted and the
    token is still the node's: one conditional update (the claim). Whether it claimed."""
    f = Node._meta.get_field
    stamp = connection.ops.adapt_datetimefield_value(now)
    sets = ", ".join(f"{c} = %s" for c in _cols(Node, ("last_seq", "last_seen_at", "reported_at", "engines")))
    prev, reported = _cols(Node, ("prev_reported_at", "reported_at"))
    pk_col, token_col, epoch_col, seq_col = _cols(Node, ("id", "token_hash", "epoch", "last_seq"))
    sql = (f"UPDATE {_q(Node._meta.db_table)} SET {prev} = {reported}, {sets} "  # noqa: S608 - names from the model
           f"WHERE {pk_col} = %s AND {token_col} = %s AND {epoch_col} = %s AND {seq_col} < %s")
    with connection.cursor() as cursor:
        cursor.execute(sql, [seq, stamp, stamp, f("engines").get_db_prep_value(engines, connection),
                             pk, token_hash, epoch, seq])
        return cursor.rowcount == 1


def update_gpu_states(rows: list[Gpu], *, now: datetime) -> None:
    """Write STATE_FIELDS of these rows (their in-memory values; updated_at = now)."""
    if not rows:
        return
    stamp = connection.ops.adapt_datetimefield_value(now)
    params = [(r.mem_used_bytes, r.mem_total_bytes, r.sm_util, r.temperature_c, r.healthy, r.allocatable,
               r.xid_errors, r.ecc_errors, stamp, r.pk) for r in rows]
    sets = ", ".join(f"{c} = %s" for c in _cols(Gpu, STATE_FIELDS))
    sql = f"UPDATE {_q(Gpu._meta.db_table)} SET {sets} WHERE {_q(Gpu._meta.pk.column)} = %s"  # noqa: S608 - names from the model
    with connection.cursor() as cursor:
        cursor.executemany(sql, params)


def insert_samples(rows: list[Gpu], *, now: datetime) -> None:
    """A history sample of each of these rows' state at `now` (bounded by the beat's
    fleet.prune_history, console/fleet/retention.py)."""
    if not rows:
        return
    stamp = connection.ops.adapt_datetimefield_value(now)
    sql = (f"INSERT INTO {_q(GpuSample._meta.db_table)} ({', '.join(_cols(GpuSample, SAMPLE_FIELDS))}) "  # noqa: S608
           f"VALUES ({', '.join(['%s'] * len(SAMPLE_FIELDS))})")
    with connection.cursor() as cursor:
        cursor.executemany(sql, [(r.pk, stamp, r.mem_used_bytes, r.sm_util, r.temperature_c, r.healthy, r.allocatable)
                                 for r in rows])
