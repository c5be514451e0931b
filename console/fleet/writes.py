"""The agent API's hot paths in plain SQL: a report's read of its node with its GPUs, its claim
and its write of what changed; a long poll's first read (issue 19).

Django's ORM builds each query's SQL in Python for every call, and instantiates a model per row
with the machinery for deferred fields and related objects: for a report of one changed GPU that
was most of the agent API's CPU (bench.control_plane at 800 agents: one core saturated, a report
~15 ms of it; py-spy --gil: the compiler's as_sql and the joined read's model rows on top).
bulk_update, for instance, writes each field as a CASE WHEN over the rows' ids. Here each
statement is a fixed parameterised string - the same SQL on PostgreSQL and SQLite but for the
read's row lock and commit setting, names quoted from the models - and the values read go through the converters Django's compiler would apply,
so they arrive as the ORM would give them. executemany is pipelined by psycopg: one round trip.
Each statement is built once per kind of database (`_sql`), and a function looks the connection up
once (django.db.connection is a proxy that finds the thread's connection at every attribute).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, models
from django.db.backends.base.base import BaseDatabaseWrapper

from console.fleet.models import AgentCommand, Gpu, GpuSample, Node

STATE_FIELDS = ("mem_used_bytes", "mem_total_bytes", "sm_util", "temperature_c", "healthy", "allocatable",
                "xid_errors", "ecc_errors", "updated_at")


def _in_model_order(model: type[models.Model], names: set[str]) -> tuple[str, ...]:
    # Model.from_db takes a subset of the fields in the model's own order
    return tuple(f.name for f in model._meta.concrete_fields if f.name in names)


# What a report reads: of its node, the live payload, the token check, whether it was schedulable,
# what the lost-plans check judges by (not `engines`, which it replaces); of each GPU, its state and
# the live payload (not custom_spec).
NODE_READ = _in_model_order(Node, {"id", "node_id", "hostname", "rack", "token_hash", "epoch", "registered_at",
                                   "reported_at", "schedulable", "unschedulable_reason", "lost_plans"})
GPU_READ = _in_model_order(Gpu, {"id", "node", "uuid", "index", "model", "nvlink_group", "mem_total_bytes",
                                 "mem_used_bytes", "sm_util", "temperature_c", "healthy", "allocatable",
                                 "xid_errors", "ecc_errors", "updated_at"})
# What a long poll reads: its node's id and name (the doorbell is rung by name), the open commands
POLL_NODE_READ = ("id", "node_id")
COMMAND_READ = tuple(f.name for f in AgentCommand._meta.concrete_fields)
POLL_LIMIT = 100  # commands handed out by one answer; the rest go in the next
SAMPLE_FIELDS = ("gpu", "at", "mem_used_bytes", "sm_util", "temperature_c", "healthy", "allocatable")


def _db() -> BaseDatabaseWrapper:
    return connections[DEFAULT_DB_ALIAS]


def _cols(db: BaseDatabaseWrapper, model: type[models.Model], names: Sequence[str], alias: str = "") -> list[str]:
    prefix = f"{alias}." if alias else ""
    return [prefix + db.ops.quote_name(model._meta.get_field(n).column) for n in names]


def _table(db: BaseDatabaseWrapper, model: type[models.Model]) -> str:
    return str(db.ops.quote_name(model._meta.db_table))


_statements: dict[tuple[str, str], str] = {}  # (vendor, statement) -> SQL


def _sql(db: BaseDatabaseWrapper, statement: str) -> str:
    """The statement's SQL for this kind of database, built the first time it is asked for."""
    key = (db.vendor, statement)
    if key not in _statements:
        _statements[key] = _build(db, statement)
    return _statements[key]


def _build(db: BaseDatabaseWrapper, statement: str) -> str:
    if statement in ("read", "read+async"):
        node_pk, gpu_node = _cols(db, Node, ("id",), "n")[0], _cols(db, Gpu, ("node",), "g")[0]
        setting = "set_config('synchronous_commit', 'off', true), " if statement == "read+async" else ""
        lock = " FOR UPDATE OF n" if db.features.has_select_for_update_of else ""
        return (f"SELECT {setting}{', '.join(_cols(db, Node, NODE_READ, 'n') + _cols(db, Gpu, GPU_READ, 'g'))} "  # noqa: S608 - names from the models
                f"FROM {_table(db, Node)} n LEFT JOIN {_table(db, Gpu)} g ON {gpu_node} = {node_pk} "
                f"AND {_cols(db, Gpu, ('present',), 'g')[0]} = %s WHERE {node_pk} = %s{lock}")
    if statement == "poll":
        node_pk, token = _cols(db, Node, ("id", "token_hash"), "n")
        cmd_pk, cmd_node, state = _cols(db, AgentCommand, ("id", "node", "state"), "c")
        return (f"SELECT {', '.join(_cols(db, Node, POLL_NODE_READ, 'n') + _cols(db, AgentCommand, COMMAND_READ, 'c'))} "  # noqa: S608 - names from the models
                f"FROM {_table(db, Node)} n LEFT JOIN {_table(db, AgentCommand)} c ON {cmd_node} = {node_pk} "
                f"AND {cmd_pk} > %s AND {state} IN ({', '.join(['%s'] * len(AgentCommand.OPEN_STATES))}) "
                f"WHERE {token} = %s ORDER BY {node_pk}, {cmd_pk} LIMIT {POLL_LIMIT}")
    if statement == "claim":
        sets = ", ".join(f"{c} = %s" for c in _cols(db, Node, ("last_seq", "last_seen_at", "reported_at", "engines")))
        prev, reported, pk, token, epoch, seq = _cols(
            db, Node, ("prev_reported_at", "reported_at", "id", "token_hash", "epoch", "last_seq"))
        return (f"UPDATE {_table(db, Node)} SET {prev} = {reported}, {sets} "  # noqa: S608 - names from the model
                f"WHERE {pk} = %s AND {token} = %s AND {epoch} = %s AND {seq} < %s")
    if statement == "gpu_states":
        sets = ", ".join(f"{c} = %s" for c in _cols(db, Gpu, STATE_FIELDS))
        return f"UPDATE {_table(db, Gpu)} SET {sets} WHERE {_cols(db, Gpu, ('id',))[0]} = %s"  # noqa: S608
    if statement == "samples":
        return (f"INSERT INTO {_table(db, GpuSample)} ({', '.join(_cols(db, GpuSample, SAMPLE_FIELDS))}) "  # noqa: S608
                f"VALUES ({', '.join(['%s'] * len(SAMPLE_FIELDS))})")
    raise ValueError(f"statement: unknown {statement!r}")


class _Rows:
    """Rows of one model read in plain SQL, made into instances as the ORM makes them."""

    def __init__(self, db: BaseDatabaseWrapper, model: type[models.Model], names: Sequence[str]) -> None:
        self.db, self.model = db, model
        self.attnames = [model._meta.get_field(n).attname for n in names]
        # per column, the expression and the converters Django's compiler applies (SQLCompiler.get_converters)
        self.columns = []
        for name in names:
            col = model._meta.get_field(name).get_col(model._meta.db_table)
            self.columns.append((col, db.ops.get_db_converters(col) + col.get_db_converters(db)))

    def instance(self, values: Sequence[Any]) -> Any:
        converted = []
        for (col, converters), value in zip(self.columns, values, strict=True):
            for convert in converters:
                value = convert(value, col, self.db)
            converted.append(value)
        # saved, from this database; a field not read is deferred (read if touched)
        return self.model.from_db(self.db.alias, self.attnames, converted)


def node_with_gpus(pk: int, *, commit_async: bool = False) -> tuple[Node | None, list[Gpu]]:
    """The node's row - locked until the transaction ends, where the database locks rows - and its
    present GPUs, in one query; each GPU's `node` is that row. `commit_async`: on PostgreSQL the
    same query also tells this transaction not to wait for its WAL flush (set_config, is_local:
    SET LOCAL without a round trip of its own; the caller says why it may)."""
    db = _db()
    setting = commit_async and db.vendor == "postgresql"
    with db.cursor() as cursor:
        cursor.execute(_sql(db, "read+async" if setting else "read"), [True, pk])
        rows = [row[1:] if setting else row for row in cursor.fetchall()]
    if not rows:
        return None, []
    split = len(NODE_READ)
    node = _Rows(db, Node, NODE_READ).instance(rows[0][:split])
    reader = _Rows(db, Gpu, GPU_READ)
    gpus = []
    for row in rows:
        if row[split] is None:  # the outer join's row of a node with no present GPU
            continue
        gpu = reader.instance(row[split:])
        gpu.node = node
        gpus.append(gpu)
    return node, gpus


def node_with_open_commands(token_hash: str, after: int) -> tuple[Node | None, list[AgentCommand]]:
    """The node of this token hash (its id and node_id; other fields are deferred) and its open
    commands past `after`, oldest first, at most POLL_LIMIT: one query, where a poll's start took
    two (the node by its token, then its commands). None when no node has the hash."""
    db = _db()
    with db.cursor() as cursor:
        cursor.execute(_sql(db, "poll"), [after, *AgentCommand.OPEN_STATES, token_hash])
        rows = cursor.fetchall()
    if not rows:
        return None, []
    split = len(POLL_NODE_READ)
    node = _Rows(db, Node, POLL_NODE_READ).instance(rows[0][:split])
    reader = _Rows(db, AgentCommand, COMMAND_READ)
    commands = []
    for row in rows:
        if row[0] != node.pk or row[split] is None:  # another node of the same hash; no open command
            continue
        cmd = reader.instance(row[split:])
        cmd.node = node
        commands.append(cmd)
    return node, commands


def claim_report(pk: int, *, token_hash: str, epoch: int, seq: int, now: datetime, engines: list[Any]) -> bool:
    """Accept report `seq` of this epoch for the node if it is newer than the last accepted and the
    token is still the node's: one conditional update (the claim). Whether it claimed."""
    db = _db()
    stamp = db.ops.adapt_datetimefield_value(now)
    with db.cursor() as cursor:
        cursor.execute(_sql(db, "claim"), [
            seq, stamp, stamp, Node._meta.get_field("engines").get_db_prep_value(engines, db),
            pk, token_hash, epoch, seq])
        return cursor.rowcount == 1


def store_changed_gpus(rows: list[Gpu], *, now: datetime) -> None:
    """Write STATE_FIELDS of these rows (their in-memory values; updated_at = now) and a history
    sample of each (bounded by the beat's fleet.prune_history, console/fleet/retention.py)."""
    if not rows:
        return
    db = _db()
    stamp = db.ops.adapt_datetimefield_value(now)
    with db.cursor() as cursor:
        cursor.executemany(_sql(db, "gpu_states"), [
            (r.mem_used_bytes, r.mem_total_bytes, r.sm_util, r.temperature_c, r.healthy, r.allocatable,
             r.xid_errors, r.ecc_errors, stamp, r.pk) for r in rows])
        cursor.executemany(_sql(db, "samples"), [
            (r.pk, stamp, r.mem_used_bytes, r.sm_util, r.temperature_c, r.healthy, r.allocatable) for r in rows])
