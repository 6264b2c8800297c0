# SPDX-License-Identifier: MIT
"""The scale benchmark: every verb on an empty store against a store that holds history.

Run it from the repository root::

    python3 bench/scale.py                          # SQLite, 1,000,000 finished tasks
    python3 bench/scale.py --n 200000 --json out.json
    python3 bench/scale.py --engine postgres --n 50000   # a throwaway PostgreSQL server

Three stores are open in one process: an empty one, one holding N finished
tasks (``--n``) and one holding ``--queued`` queued tasks (a few batches of
each priority, and a tenth of them delayed past the run: the claim must
find the next ready task by its index, whatever waits around it).  Each is filled
through the public API only, as a server's runners would have filled it:
``create_many`` in small batches of one kind and one principal (a mix of a
few of each), each task owned by the filling runner's registration from
the start (``owner=``, as the MCP server creates them), then per task
``start`` and its outcome (mostly ``succeed``; some ``fail``; a few
cancelled while running), with a retention of 24 hours as a server grants
by default, so every finished task has a ``purge_at`` and is kept.  A
finished task has 3 or 4 events (``created`` and a plain succeed are its
row; the ``status`` of its start; a cancel adds one).  The fill does not ``claim``: on
PostgreSQL 15 a claim's plan walks the whole table in id order (see the
plans this prints), so a fill by claims slows down with every task; the
claim row of the table measures it.
Several threads fill (one store each on PostgreSQL, one shared store on
SQLite, whose group commit serves them together), each a registered
runner released when the fill ends.

Then the same cycle of verbs runs on the three stores in turn, in a
rotating order, ``--reps`` times; each call is timed on its own, and the
table shows the median and the 99th percentile per verb and store, and the
ratio of each filled store's figure to the empty store's.  A ratio above
1.5 is flagged: the verb's cost grows with what the store holds.  Last, on
the store of finished tasks, "reap at volume": the clock jumps past every
task's retention and one ``reap()`` deletes all of them; its total time,
rate and longest transaction are reported, with the reap's own statements
in each transaction, and the waits of a one-row write made beside it
meanwhile, on a connection of its own: on SQLite it takes the file's write
lock between the reap's transactions, a lock that favours no waiter, so its
longest wait is what a mass reap makes other processes' writes wait; on
PostgreSQL the server makes every commit wait while it flushes a checkpoint,
and that writer shows how much of the reap's longest was that.

No figure is traded for durability: the stores run with their defaults
(SQLite ``synchronous=normal``; PostgreSQL's own settings).  The machine
may be shared: its load average is printed with the figures.
"""

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import random
import re
import sqlite3
import sys
import tempfile
import threading
import time

# The module under test is the one in the folder above this one.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import taskstore                                        # noqa: E402
from taskstore import TaskStore                         # noqa: E402

RETENTION_MS = 24 * 3600 * 1000       # a server's default (the HTTP server's --retention)
KINDS = ("report", "render", "email")
KIND_WEIGHTS = (5, 3, 2)
PRINCIPALS = tuple(f"user{i:02d}" for i in range(20))
FILL_BATCH = 50             # tasks per create_many while filling: one kind, one principal
FILL_THREADS = 4            # fill threads (PostgreSQL: a store, so a connection, each)
FAIL_SHARE = 0.07           # of the filled tasks: failed ...
CANCEL_SHARE = 0.03         # ... cancelled while running; the rest succeeded
SAMPLE_IDS = 2000           # ids of filled tasks kept for "get (an older task)"
# The PostgreSQL server's settings the report shows (PostgresSide.versions).
PG_SETTINGS_SHOWN = ("shared_buffers", "max_wal_size", "checkpoint_timeout", "wal_init_zero")
RATIO_FLAG = 1.5            # a filled store's figure above this multiple of the empty one's
DEAD_TASKS = 3              # tasks the dead owner of "recover (a dead owner)" holds
BESIDE_GAP_S = 0.005        # between two writes beside the reap at volume (reap_at_volume)
# The probe: the tasks the cycle makes, and the filters of the list rows.
# The filters select the probe tasks (the newest of their kind) and a share
# of the filled ones; the two "none match" rows select (almost) nothing.
PROBE_KIND = KINDS[0]
PROBE_PRINCIPAL = PRINCIPALS[0]
PAYLOAD = {"topic": "quarterly figures", "pages": 12, "format": "pdf"}
RESULT = {"ok": True, "url": "https://example.invalid/r/0123456789abcdef", "pages": 12}
ERROR = {"code": "E_UPSTREAM", "message": "the upstream service answered 503"}
LIST_LIMIT = 20
# The queued store: each batch's priority (most the default), and the share
# of batches that wait for a time (a week: never due during a run).
QUEUED_PRIORITIES = (0, 0, 0, 1, 5)
DELAYED_SHARE = 0.1
DELAY_S = 7 * 24 * 3600

# verb row names, in the table's order
VERBS = (
    "create", "get", "get (an older task)", "summary", "events",
    "list", "list status=succeeded", f"list kind={PROBE_KIND}",
    f"list principal={PROBE_PRINCIPAL}", "list status=running (few or none match)",
    "list kind=rare (none match)",
    "wait (finished task)", "wait (woken by a change)",
    "claim", "start", "succeed", "fail", "cancel (queued)", "cancel (running)",
    "heartbeat", "cancelling_owned", "recover (nothing to do)",
    f"recover (a dead owner, {DEAD_TASKS} tasks)", "reap (nothing to do)", "open",
)


def percentile(values, q):
    """The *q* quantile (0..1) of *values*: the smallest value with at least q of them at or below."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _fmt(seconds):
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"


def _loadavg():
    with contextlib.suppress(OSError, AttributeError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


# -- the engines: where the three stores live ----------------------------------

class SQLiteSide:
    """Three SQLite files in a temporary directory."""

    name = "sqlite"

    def __init__(self, directory):
        self.dir = directory
        self.shared_fill_store = True       # group commit serves the fill threads together

    def target(self, name):
        return os.path.join(self.dir, f"{name}.db")

    def open(self, target, **kwargs):
        return TaskStore(target, **kwargs)

    def after_fill(self, target, store):
        store.checkpoint()

    def size(self, target, store):
        """File and WAL bytes after a checkpoint."""
        store.checkpoint()
        sizes = {}
        for suffix in ("", "-wal"):
            with contextlib.suppress(OSError):
                sizes["file" if not suffix else "wal"] = os.path.getsize(target + suffix)
        sizes["total"] = sum(sizes.values())
        return sizes

    def versions(self):
        return {"sqlite": sqlite3.sqlite_version}

    def explain(self, target, sql, params):
        with contextlib.closing(sqlite3.connect(target)) as conn:
            # The store's own SQL function (the reaper's and recovery's purge_at):
            # a stand-in of the same arity, for the plan only.
            conn.create_function("taskstore_purge_at", 4, lambda *args: None)
            return [r[-1] for r in conn.execute("EXPLAIN QUERY PLAN " + sql)]

    @staticmethod
    def suspect(plan):
        return any((line.startswith("SCAN ") and not line.startswith("SCAN range_rows"))
                   or "TEMP B-TREE" in line for line in plan)

    @contextlib.contextmanager
    def writer_beside(self, target):
        """A one-row write transaction in a table of its own, on a connection of its own.

        On SQLite it takes the file's write lock like any writer, so its
        wait is what a reap transaction makes other writers wait.
        """
        conn = sqlite3.connect(target, timeout=60, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("CREATE TABLE IF NOT EXISTS scale_beside (n INTEGER)")

        def write():
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO scale_beside VALUES (1)")
            conn.execute("COMMIT")
        try:
            yield write
        finally:
            conn.execute("DROP TABLE scale_beside")
            conn.close()


class PostgresSide:
    """Three databases on one PostgreSQL server (a throwaway one, or --db's)."""

    name = "postgres"

    def __init__(self, url, pg):
        self.pg = pg
        self.url = url
        self.admin = pg.psycopg.connect(url, autocommit=True)
        self.made = []
        self.shared_fill_store = False      # a store is one connection: one each

    def target(self, name):
        db = f"{self.pg.DB_PREFIX}scale_{os.getpid()}_{name}"
        self.admin.execute(f'DROP DATABASE IF EXISTS "{db}"')
        self.admin.execute(f'CREATE DATABASE "{db}" TEMPLATE template0')
        self.made.append(db)
        return self.pg._with_database(self.url, db)

    def open(self, target, **kwargs):
        return TaskStore(target, **kwargs)

    def after_fill(self, target, store):
        # What autovacuum does after a fill this size, done now so that every
        # run measures with the same statistics.
        with contextlib.closing(self.pg.psycopg.connect(target, autocommit=True)) as conn:
            conn.execute("VACUUM ANALYZE")

    def size(self, target, store):
        with contextlib.closing(self.pg.psycopg.connect(target, autocommit=True)) as conn:
            database, tasks, events = conn.execute(
                "SELECT pg_database_size(current_database()), "
                "pg_total_relation_size('tasks'), pg_total_relation_size('events')").fetchone()
        return {"database": database, "tasks": tasks, "events": events, "total": tasks + events}

    def versions(self):
        # The settings a mass reap's longest transaction depends on.  With
        # wal_init_zero on (the default), the backend whose write reaches a
        # WAL segment not made yet first fills its 16 MB with zeros, holding
        # the lock every commit waits for: at 200,000 tasks the reap's longest
        # transaction took 63-68 ms and a one-row write beside it 57-62 ms;
        # off, 26 and 7-8 ms.  With 1 GB of shared buffers instead of 128 MB,
        # a million-task reap's longest took 27-29 ms instead of 78-95 on
        # 2026-12-03, but 116 ms on 2026-12-08's VM (docs/postgres.md).
        settings = {name: self.admin.execute(f"SHOW {name}").fetchone()[0]
                    for name in PG_SETTINGS_SHOWN}
        return {"postgresql": self.admin.execute("SHOW server_version").fetchone()[0],
                "psycopg": self.pg.psycopg.__version__, "postgresql_settings": settings}

    def explain(self, target, sql, params):
        with contextlib.closing(self.pg.psycopg.connect(target)) as conn:
            try:
                return [r[0] for r in conn.execute("EXPLAIN " + sql, params or None).fetchall()]
            finally:
                conn.rollback()

    @staticmethod
    def suspect(plan):
        return any("Seq Scan" in line or line.lstrip(" ->").startswith("Sort") for line in plan)

    @contextlib.contextmanager
    def writer_beside(self, target):
        """A one-row write in a table of its own, one statement (autocommit) on its own
        connection: it shares nothing with the reap but the server, its WAL and its disk."""
        conn = self.pg.psycopg.connect(target, autocommit=True)
        conn.execute("CREATE TABLE IF NOT EXISTS scale_beside (n BIGINT)")
        try:
            yield lambda: conn.execute("INSERT INTO scale_beside VALUES (1)")
        finally:
            conn.execute("DROP TABLE scale_beside")
            conn.close()

    def close(self):
        for db in self.made:
            with contextlib.suppress(Exception):
                self.admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        self.admin.close()


# -- filling -------------------------------------------------------------------

class Fill:
    """Fill a store through its public verbs; note what it took."""

    def __init__(self, side, target, seed=1):
        self.side = side
        self.target = target
        self.seed = seed
        self.sample = []          # ids of filled tasks, a random sample of SAMPLE_IDS
        self.lock = threading.Lock()
        self.report = {}

    def _keep(self, rng, tasks, seen):
        with self.lock:
            for task in tasks:
                seen[0] += 1
                if len(self.sample) < SAMPLE_IDS:
                    self.sample.append(task.id)
                else:
                    k = rng.randrange(seen[0])
                    if k < SAMPLE_IDS:
                        self.sample[k] = task.id

    def finished(self, n, threads=FILL_THREADS, progress=None):
        """N finished tasks, *threads* runners claiming and finishing them."""
        side = self.side
        shared = side.open(self.target) if side.shared_fill_store else None
        stores = [shared or side.open(self.target) for _ in range(threads)]
        quotas = [n // threads + (1 if i < n % threads else 0) for i in range(threads)]
        done, seen, errors = [0], [0], []
        started = time.perf_counter()
        step = max(1, n // 10)

        def work(i):
            store, rng = stores[i], random.Random(self.seed * 1000 + i)
            proc = store.register_process()
            procs.append((store, proc))
            try:
                left = quotas[i]
                while left:
                    size = min(FILL_BATCH, left)
                    kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
                    tasks = store.create_many(
                        kind, [dict(PAYLOAD, n=left - k) for k in range(size)],
                        retention_ms=RETENTION_MS, principal=rng.choice(PRINCIPALS),
                        owner=proc)
                    self._keep(rng, tasks, seen)
                    for task in tasks:
                        task = store.start(task.id)
                        roll = rng.random()
                        if roll < CANCEL_SHARE:
                            store.cancel(task.id, reason="the user cancelled it")
                            store.confirm_cancel(task.id, attempt=task.attempt)
                        elif roll < CANCEL_SHARE + FAIL_SHARE:
                            store.fail(task.id, ERROR, attempt=task.attempt)
                        else:
                            store.succeed(task.id, RESULT, attempt=task.attempt)
                    left -= size
                    with self.lock:
                        before, done[0] = done[0], done[0] + size
                        if progress and before // step != done[0] // step:
                            rate = done[0] / (time.perf_counter() - started)
                            progress(f"  filled {done[0]:,} of {n:,} ({rate:,.0f} tasks/s)")
            except BaseException as exc:       # reported by the main thread
                errors.append(exc)
                raise
        procs = []
        # Daemons: an interrupted run ends (and stops its server) without them.
        pool = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        fill_s = time.perf_counter() - started
        if errors:
            raise errors[0]
        # A runner stopping releases its registration (its tasks are all finished).
        release = time.perf_counter()
        for store, proc in procs:
            store.release(proc)
        release_s = time.perf_counter() - release
        for store in {id(s): s for s in stores}.values():
            store.close()
        self.report = {"tasks": n, "threads": threads, "seconds": round(fill_s, 2),
                       "tasks_per_s": round(n / max(fill_s, 1e-9), 1),
                       "release_all_runners_s": round(release_s, 3)}
        return self.report

    def queued(self, q):
        """Q queued tasks, in create_many batches of one kind, principal, priority and delay."""
        rng = random.Random(self.seed)
        store = self.side.open(self.target)
        started = time.perf_counter()
        seen = [0]
        try:
            for first in range(0, q, FILL_BATCH):
                size = min(FILL_BATCH, q - first)
                tasks = store.create_many(
                    rng.choices(KINDS, KIND_WEIGHTS)[0],
                    [dict(PAYLOAD, n=first + k) for k in range(size)],
                    retention_ms=RETENTION_MS, principal=rng.choice(PRINCIPALS),
                    priority=rng.choice(QUEUED_PRIORITIES),
                    delay=DELAY_S if rng.random() < DELAYED_SHARE else None)
                self._keep(rng, tasks, seen)
        finally:
            store.close()
        seconds = time.perf_counter() - started
        self.report = {"tasks": q, "seconds": round(seconds, 2),
                       "tasks_per_s": round(q / max(seconds, 1e-9), 1)}
        return self.report


# -- the cycle of verbs ----------------------------------------------------------

class Probe:
    """One store under measurement: the store, its runner registration, its samples."""

    def __init__(self, name, side, target, store, sample_ids):
        self.name = name
        self.side = side
        self.target = target
        self.store = store
        self.proc = store.register_process()
        self.older = list(sample_ids)    # ids "get (an older task)" picks from
        self.samples = {verb: [] for verb in VERBS}
        self.rng = random.Random(7)
        self.dead = 0

    def timed(self, verb, fn):
        start = time.perf_counter()
        out = fn()
        self.samples[verb].append(time.perf_counter() - start)
        return out

    def cycle(self):
        """Every verb once (the writes leave nothing queued behind on the empty store)."""
        store, proc, t = self.store, self.proc, self.timed
        # The first commit after a pause costs more (here about 250 us on
        # SQLite, the same on every store: a 10 ms sleep before the cycle
        # shows it too).  A runner heartbeats every second anyway; so does
        # this one, untimed, before the verbs, so that create is measured
        # on a store that is writing, as every other verb is.
        store.heartbeat(proc)
        created = t("create", lambda: store.create(
            PROBE_KIND, PAYLOAD, retention_ms=RETENTION_MS, principal=PROBE_PRINCIPAL))
        if len(self.older) < SAMPLE_IDS:
            self.older.append(created.id)
        task = t("claim", lambda: store.claim(KINDS, owner=proc, loading_kinds=KINDS))
        t("start", lambda: store.start(task.id, attempt=task.attempt))
        self.woken(task)
        t("succeed", lambda: store.succeed(task.id, RESULT, attempt=task.attempt))
        t("get", lambda: store.get(task.id))
        older = self.rng.choice(self.older)
        t("get (an older task)", lambda: store.get(older))
        t("summary", lambda: store.summary(task.id))
        t("events", lambda: store.events(task.id))
        t("wait (finished task)", lambda: store.wait(task.id, timeout=10, terminal=True))
        # The other moves start from tasks of their own, owned from their
        # creation and started (not claimed: one claim a cycle is measured,
        # and on PostgreSQL a claim costs what the table holds).
        task = self.running()
        t("fail", lambda: store.fail(task.id, ERROR, attempt=task.attempt))
        queued = store.create(PROBE_KIND, PAYLOAD, retention_ms=RETENTION_MS,
                              principal=PROBE_PRINCIPAL)
        t("cancel (queued)", lambda: store.cancel(queued.id))
        task = self.running()
        t("cancel (running)", lambda: store.cancel(task.id))
        owned = t("cancelling_owned", lambda: store.cancelling_owned(proc))
        assert task.id in owned, "the cancel check missed a cancelling task"
        store.confirm_cancel(task.id, attempt=task.attempt)
        t("heartbeat", lambda: store.heartbeat(proc))
        t("recover (nothing to do)", store.recover)
        # A runner that died holding a few tasks: a registration that never
        # existed (or is gone) is provably dead.
        self.dead += 1
        dead = f"proc_scale_dead_{self.name}_{self.dead}"
        for task in store.create_many(PROBE_KIND, [PAYLOAD] * DEAD_TASKS, owner=dead,
                                      retention_ms=RETENTION_MS, principal=PROBE_PRINCIPAL):
            store.start(task.id)
        moved = t(f"recover (a dead owner, {DEAD_TASKS} tasks)", store.recover)
        assert moved >= DEAD_TASKS, f"recover moved {moved} tasks, not {DEAD_TASKS}"
        t("reap (nothing to do)", store.reap)
        # A server opening the store: recovery at open, as the default does.
        opened = t("open", lambda: self.side.open(self.target))
        opened.close()
        # The lists last: a list that reads the whole table (a filter that
        # selects fewer rows than the limit, where no index serves it) would
        # otherwise evict the pages the verbs after it need.
        t("list", lambda: store.list(limit=LIST_LIMIT))
        t("list status=succeeded", lambda: store.list(status="succeeded", limit=LIST_LIMIT))
        t(f"list kind={PROBE_KIND}", lambda: store.list(kind=PROBE_KIND, limit=LIST_LIMIT))
        t(f"list principal={PROBE_PRINCIPAL}",
          lambda: store.list(principal=PROBE_PRINCIPAL, limit=LIST_LIMIT))
        t("list status=running (few or none match)",
          lambda: store.list(status="running", limit=LIST_LIMIT))
        t("list kind=rare (none match)", lambda: store.list(kind="rare", limit=LIST_LIMIT))

    def running(self, owner=None):
        """A new probe task, owned by *owner* (this probe's runner) from its creation, started."""
        task = self.store.create(PROBE_KIND, PAYLOAD, retention_ms=RETENTION_MS,
                                 principal=PROBE_PRINCIPAL, owner=owner or self.proc)
        return self.store.start(task.id)

    def woken(self, task):
        """A waiter on the running *task*; the time from a change's start to its waking."""
        store, woke = self.store, []
        current = store.get(task.id)

        def waiter():
            store.wait(task.id, since_version=current.version, timeout=30)
            woke.append(time.perf_counter())
        thread = threading.Thread(target=waiter)
        thread.start()
        # Until the waiter is registered (peeking at the store's count): from
        # then on no commit passes it by, whether it sleeps yet or reads.
        deadline = time.monotonic() + 30
        while not store._waiters.watchers and time.monotonic() < deadline:
            time.sleep(0)
        start = time.perf_counter()
        store.set_progress(task.id, progress=0.5, total=1.0, attempt=task.attempt)
        thread.join(30)
        if woke:
            self.samples["wait (woken by a change)"].append(woke[0] - start)


def summarise(samples):
    return {"median_s": percentile(samples, 0.5), "p99_s": percentile(samples, 0.99),
            "count": len(samples)} if samples else None


def compare(empty, filled):
    """The rows of one table: per verb, both stores' figures and the ratios."""
    rows = {}
    for verb in VERBS:
        e, f = summarise(empty.samples[verb]), summarise(filled.samples[verb])
        if e is None or f is None:
            continue
        # Rounded as shown, and judged as shown: a row never reads 1.50x and flagged.
        ratio_median = round(f["median_s"] / max(e["median_s"], 1e-9), 2)
        ratio_p99 = round(f["p99_s"] / max(e["p99_s"], 1e-9), 2)
        rows[verb] = {"empty": e, "filled": f, "ratio_median": ratio_median,
                      "ratio_p99": ratio_p99,
                      "flat": ratio_median <= RATIO_FLAG and ratio_p99 <= RATIO_FLAG}
    return rows


def print_table(title, rows, label):
    print(f"\n{title}")
    headers = ("VERB", "EMPTY MEDIAN", "EMPTY P99", f"{label} MEDIAN", f"{label} P99",
               "RATIO MEDIAN", "RATIO P99", "")
    body = []
    for verb, r in rows.items():
        body.append((verb, _fmt(r["empty"]["median_s"]), _fmt(r["empty"]["p99_s"]),
                     _fmt(r["filled"]["median_s"]), _fmt(r["filled"]["p99_s"]),
                     f"{r['ratio_median']:.2f}x", f"{r['ratio_p99']:.2f}x",
                     "" if r["flat"] else f"<-- over {RATIO_FLAG}x"))
    widths = [max(len(str(row[i])) for row in [headers, *body]) for i in range(len(headers))]
    for row in [headers, *body]:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())


# -- reaping at volume -------------------------------------------------------------

def _run_queue_ms(path):
    """Milliseconds a thread or process has waited for a CPU (Linux schedstat), or None."""
    try:
        with open(path) as f:
            return int(f.read().split()[1]) / 1e6
    except (OSError, ValueError, IndexError):
        return None


def reap_at_volume(store, count, side, target):
    """Move the clock past every retention; time one reap() and each of its transactions.

    Each transaction's wait for a CPU is read too (Linux ``schedstat``: this
    thread's, and the PostgreSQL server backend's when it runs on this
    host): on a loaded machine the longest transactions are mostly that
    wait, not the reap's statements, and the report says how much.  So are
    the reap's own statements in each (the time its batch takes, which the
    reaper keeps within its budget: the rest is the commit and the lock),
    and a one-row write beside it on *target*, every few milliseconds
    (*side*'s ``writer_beside``): on PostgreSQL a commit that waits
    while the server flushes a checkpoint makes every writer's commit wait
    as long, and the writer beside shows how much of a reap transaction's
    time was that.
    """
    engine = store._engine
    original = engine.write
    durations, waits, statements, beside, rows = [], [], [], [], []
    paths = [f"/proc/self/task/{threading.get_native_id()}/schedstat"]
    raw = getattr(engine.conn, "raw", None)
    if raw is not None:
        paths.append(f"/proc/{raw.info.backend_pid}/schedstat")

    def timed_write(body):
        before = [_run_queue_ms(path) for path in paths]
        start = time.perf_counter()
        try:
            result = original(body)
            statements.append(result[2])        # the body's own time (_reap's counting)
            rows.append({k: n for k, n in result[1].items()      # what the batch deleted
                         if n and k != "reached"})               # (not where it reached)
            return result
        finally:
            durations.append(time.perf_counter() - start)
            after = [_run_queue_ms(path) for path in paths]
            if None not in before + after:
                waits.append(sum(after) - sum(before))
    engine.write = timed_write          # this bench's wrapper, on this instance only
    error = None
    done, failed = threading.Event(), []

    def write_beside(write):
        try:
            while not done.wait(BESIDE_GAP_S):
                begun = time.perf_counter()
                write()
                beside.append(time.perf_counter() - begun)
        except Exception as exc:                    # reported, never a silent gap
            failed.append(f"{type(exc).__name__}: {exc}")
    with side.writer_beside(target) as write:
        thread = threading.Thread(target=write_beside, args=(write,))
        try:
            later = int(time.time() * 1000) + RETENTION_MS + 3600 * 1000
            thread.start()
            start = time.perf_counter()
            try:
                counts = store.reap(now=later)
            except taskstore.TaskStoreError as exc:     # a figure too: what failed, and when
                error = f"{type(exc).__name__}: {exc}"
                counts = {"tasks": None, "events": None}
            seconds = time.perf_counter() - start
        finally:
            done.set()
            thread.join(60)
            del engine.write
    if error is not None:
        return {"filled": count, "error": error, "seconds": round(seconds, 3),
                "counts": counts, "transactions": len(durations),
                "longest_transaction_ms": round(max(durations, default=0) * 1000, 2),
                "last_transaction_ms": round(durations[-1] * 1000, 2) if durations else None}
    if failed:
        raise RuntimeError(f"the write beside the reap failed: {failed[0]}")
    # The longest transaction's place in the pass: what it deleted, and its wait for a CPU.
    longest = max(range(len(durations)), key=durations.__getitem__) if durations else None
    report = {"filled": count, "counts": counts, "seconds": round(seconds, 3),
              "tasks_per_s": round(counts["tasks"] / max(seconds, 1e-9), 1),
              "transactions": len(durations),
              "longest_transaction_ms": round(max(durations, default=0) * 1000, 2),
              "median_transaction_ms": round(percentile(durations, 0.5) * 1000, 2)
              if durations else None}
    if statements:
        report.update({"longest_statements_ms": round(max(statements), 2),
                       "median_statements_ms": round(percentile(statements, 0.5), 2)})
    if durations and len(rows) == len(durations):
        # Which transaction was the longest, and what it deleted: a stall at
        # the start of a step, or amid it, points at different causes.
        report.update({"longest_transaction_at": longest + 1,
                       "longest_transaction_rows": rows[longest]})
    report["beside_writes"] = len(beside)
    if beside:
        report.update({"beside_longest_ms": round(max(beside) * 1000, 2),
                       "beside_median_ms": round(percentile(beside, 0.5) * 1000, 2)})
    if durations and len(waits) == len(durations):
        less = [d * 1000 - w for d, w in zip(durations, waits)]
        report.update({"longest_transaction_run_queue_ms": round(waits[longest], 2),
                       "run_queue_share": round(sum(waits) / (sum(durations) * 1000), 3),
                       "longest_less_run_queue_ms": round(max(less), 2),
                       "median_less_run_queue_ms": round(percentile(less, 0.5), 2)})
    return report


# -- the run ---------------------------------------------------------------------

def run(side, n, queued, reps, threads, say=print):
    """Fill, measure, reap; return the report (JSON-ready)."""
    report = {"engine": side.name, "n": n, "queued": queued, "reps": reps,
              "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                          "platform": platform.platform(), **side.versions(),
                          "loadavg_start": _loadavg()},
              "list_filters": {
                  "status": "succeeded", "kind": PROBE_KIND, "principal": PROBE_PRINCIPAL,
                  "limit": LIST_LIMIT,
                  "note": f"each filter selects the probe tasks (kind {PROBE_KIND}, principal "
                          f"{PROBE_PRINCIPAL}, the newest) and a share of the filled ones "
                          f"(kinds {'/'.join(KINDS)} weighted {KIND_WEIGHTS}, "
                          f"{len(PRINCIPALS)} principals); status=running and kind=rare "
                          "select (almost) nothing"}}
    targets = {name: side.target(name) for name in ("empty", "finished", "queued")}
    say(f"filling {n:,} finished tasks ({threads} threads) ...")
    fill = Fill(side, targets["finished"])
    report["fill_finished"] = fill.finished(n, threads, progress=say)
    say(f"  {n:,} in {report['fill_finished']['seconds']} s "
        f"({report['fill_finished']['tasks_per_s']:,.0f} tasks/s); releasing the fill's "
        f"runners took {report['fill_finished']['release_all_runners_s']} s")
    finished_sample = fill.sample
    say(f"filling {queued:,} queued tasks ...")
    qfill = Fill(side, targets["queued"], seed=2)
    report["fill_queued"] = qfill.queued(queued)
    say(f"  {queued:,} in {report['fill_queued']['seconds']} s")
    stores = {}
    try:
        for name in targets:
            stores[name] = side.open(targets[name])
            side.after_fill(targets[name], stores[name])
        report["sizes"] = {name: side.size(targets[name], stores[name]) for name in targets}
        for name, count in (("finished", n), ("queued", queued)):
            sizes = report["sizes"]
            report["sizes"][f"{name}_bytes_per_task"] = round(
                (sizes[name]["total"] - sizes["empty"]["total"]) / max(count, 1), 1)
        probes = {"empty": Probe("empty", side, targets["empty"], stores["empty"], []),
                  "finished": Probe("finished", side, targets["finished"], stores["finished"],
                                    finished_sample),
                  "queued": Probe("queued", side, targets["queued"], stores["queued"],
                                  qfill.sample)}
        order = list(probes)
        say(f"measuring: {reps} cycles of every verb on each store, in turn ...")
        started = time.perf_counter()
        for rep in range(reps):
            for name in order[rep % 3:] + order[:rep % 3]:     # whoever goes first rotates
                probes[name].cycle()
            if reps >= 10 and (rep + 1) % (reps // 10) == 0:
                say(f"  {rep + 1} of {reps} cycles ({time.perf_counter() - started:.0f} s)")
        report["finished"] = compare(probes["empty"], probes["finished"])
        report["queued_table"] = compare(probes["empty"], probes["queued"])
        report["plans"] = plans(side, probes["finished"])
        say(f"reaping {n:,} expired tasks at once ...")
        report["reap_at_volume"] = reap_at_volume(stores["finished"], n, side,
                                                  targets["finished"])
    finally:
        for store in stores.values():
            store.close()
    report["machine"]["loadavg_end"] = _loadavg()
    return report


def plans(side, probe):
    """Run one cycle on *probe*'s store, noting each verb's statements; return their plans.

    ``{verb: [{"sql", "plan", "suspect"}]}``, each statement once.  A plan
    is suspect where it reads a whole table or sorts what it read (SQLite:
    ``SCAN`` of a table, a temporary B-tree; PostgreSQL: ``Seq Scan``,
    ``Sort``): a cost that may grow with the rows the store holds.  The
    plans are read on the same database, by a connection of its own; the
    statements the verbs ran are captured by peeking at the engine's
    connection (SQLite's trace callback; on PostgreSQL wrappers of the
    connection's execute and of the engine's ``_list_rows``, which sends
    the lists unprepared), in this bench only.
    """
    verb, seen = [None], {}
    timed = probe.timed

    def noting(name, fn):
        verb[0] = name
        try:
            return fn()                 # not a sample: this cycle is traced
        finally:
            verb[0] = None

    def note(sql, params=None):
        if verb[0] and not sql.lstrip().upper().startswith(
                ("BEGIN", "COMMIT", "ROLLBACK", "PRAGMA", "SAVEPOINT", "RELEASE", "SET",
                 "START", "NOTIFY", "LISTEN", "SELECT PG_NOTIFY")):
            seen.setdefault((verb[0], sql), params)
    engine = probe.store._engine
    conn = engine.conn
    probe.timed = noting
    if side.name == "sqlite":
        conn.set_trace_callback(note)       # statements with their values written in
    else:
        execute, list_rows = conn.execute, engine._list_rows

        def traced(sql, params=()):
            note(sql, params)
            return execute(sql, params)

        def traced_list(sql, params):       # sent unprepared, past conn.execute
            note(sql, params)
            return list_rows(sql, params)
        conn.execute, engine._list_rows = traced, traced_list
    try:
        probe.cycle()
    finally:
        probe.timed = timed
        if side.name == "sqlite":
            conn.set_trace_callback(None)
        else:
            del conn.execute, engine._list_rows
    out = {}
    for (name, sql), params in seen.items():
        try:
            plan = side.explain(probe.target, sql, params)
        except Exception as exc:            # a statement EXPLAIN cannot take: say so
            plan = [f"(no plan: {type(exc).__name__})"]
        out.setdefault(name, []).append({"sql": sql, "plan": plan,
                                         "suspect": side.suspect(plan)})
    return out


def print_report(report):
    m = report["machine"]
    engine = f"SQLite {m['sqlite']}" if report["engine"] == "sqlite" else (
        f"PostgreSQL {m['postgresql']} (psycopg {m['psycopg']}; " + ", ".join(
            f"{name} {value}" for name, value in m["postgresql_settings"].items()) + ")")
    print(f"\ntaskstore scale: {engine}, Python {m['python']}, {m['cpus']} CPUs, "
          f"{m['platform']}; load average {m['loadavg_start']} at the start, "
          f"{m['loadavg_end']} at the end (the machine may be shared)")
    ff, fq = report["fill_finished"], report["fill_queued"]
    print(f"fill: {ff['tasks']:,} finished tasks in {ff['seconds']} s "
          f"({ff['tasks_per_s']:,.0f} tasks/s, {ff['threads']} threads; releasing the "
          f"runners after: {ff['release_all_runners_s']} s); {fq['tasks']:,} queued tasks in "
          f"{fq['seconds']} s")
    lf = report["list_filters"]
    print(f"list rows: limit {lf['limit']}; {lf['note']}")
    print(f"medians and 99th percentiles of {report['reps']} calls per verb and store; "
          f"ratios over {RATIO_FLAG}x flagged")
    print_table(f"{report['n']:,} finished tasks against the empty store",
                report["finished"], "N")
    print_table(f"{report['queued']:,} queued tasks against the empty store",
                report["queued_table"], "Q")
    s = report["sizes"]
    what = "file + WAL after a checkpoint" if report["engine"] == "sqlite" else \
        "tasks + events relations, indexes and TOAST included"
    print(f"\nsize ({what}): empty {s['empty']['total']:,} bytes; "
          f"{report['n']:,} finished: {s['finished']['total']:,} bytes, "
          f"{s['finished_bytes_per_task']:,.0f} bytes a task; {report['queued']:,} queued: "
          f"{s['queued']['total']:,} bytes, {s['queued_bytes_per_task']:,.0f} bytes a task")
    r = report["reap_at_volume"]
    if "error" in r:
        print(f"reap at volume: {r['filled']:,} tasks expired at once; reap() FAILED after "
              f"{r['seconds']} s and {r['transactions']} transactions (the last "
              f"{r['last_transaction_ms']} ms, the longest {r['longest_transaction_ms']} ms): "
              f"{r['error']}")
    else:
        print(f"reap at volume: {r['counts']['tasks']:,} tasks and {r['counts']['events']:,} "
              f"events expired at once, reaped in {r['seconds']} s ({r['tasks_per_s']:,.0f} tasks/s), "
              f"{r['transactions']} transactions, longest {r['longest_transaction_ms']} ms, "
              f"median {r['median_transaction_ms']} ms")
        if "longest_transaction_at" in r:
            deleted = ", ".join(f"{n:,} {kind}" for kind, n in
                                r["longest_transaction_rows"].items()) or "nothing"
            print(f"  the longest was transaction {r['longest_transaction_at']:,} of "
                  f"{r['transactions']:,}; it deleted {deleted}")
        if "longest_statements_ms" in r:
            print(f"  the reap's own statements: longest {r['longest_statements_ms']} ms, median "
                  f"{r['median_statements_ms']} ms (the rest of a transaction is its lock and "
                  f"commit)")
        if r.get("beside_writes"):
            print(f"  a one-row write beside it, every {BESIDE_GAP_S * 1000:.0f} ms: "
                  f"{r['beside_writes']:,} writes, longest {r['beside_longest_ms']} ms, median "
                  f"{r['beside_median_ms']} ms (a wait the database made every writer share)")
        if "run_queue_share" in r:
            print(f"  waiting for a CPU: {r['longest_transaction_run_queue_ms']} ms of the longest, "
                  f"{r['run_queue_share']:.0%} of all; less that wait, the longest "
                  f"{r['longest_less_run_queue_ms']} ms, median {r['median_less_run_queue_ms']} ms")
    flagged = sorted({verb for table in ("finished", "queued_table")
                      for verb, row in report[table].items() if not row["flat"]})
    print(f"not flat (over {RATIO_FLAG}x): {', '.join(flagged) or 'none'}")
    suspects = [(verb, p) for verb, statements in report["plans"].items()
                for p in statements if p["suspect"]]
    print(f"\nstatements whose plan reads a whole table or sorts (on the store of finished "
          f"tasks; every verb's plans are in the JSON): {len(suspects) or 'none'}")
    for verb, p in suspects:
        sql = p["sql"]
        if sql.startswith("SELECT") and len(sql) > 160 and " FROM " in sql:
            sql = "SELECT ..." + sql[sql.index(" FROM "):]      # the columns are not the point
        sql = sql if len(sql) <= 200 else sql[:197] + "..."
        print(f"  {verb}: {sql}\n    -> {' / '.join(line.strip() for line in p['plan'])}")


def _pg_setting(text):
    """``--pg-setting``'s argument type: ``name=value``, a PostgreSQL setting's name."""
    name, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[a-z_]+", name) or not value or any(
            c.isspace() or c in "'\"\\" for c in value):
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (a setting of the server), "
                                         f"not {text!r}")
    return text


def _load_pg():
    """Import bench/pg.py (and psycopg with it): only for a PostgreSQL run."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pg.py")
    spec = importlib.util.spec_from_file_location("taskstore_bench_pg", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_parser():
    """Return the argparse parser of ``bench/scale.py``."""
    parser = argparse.ArgumentParser(
        prog="bench/scale.py",
        description="Time every verb on an empty store and on stores holding N finished "
                    "and Q queued tasks, in one run; print medians, 99th percentiles and "
                    "their ratios.")
    parser.add_argument("--n", type=taskstore._at_least(1), default=1_000_000, metavar="N",
                        help="finished tasks in the filled store (default: %(default)s)")
    parser.add_argument("--queued", type=taskstore._at_least(1), default=100_000, metavar="Q",
                        help="queued tasks in the queued store (default: %(default)s)")
    parser.add_argument("--engine", choices=("sqlite", "postgres"), default="sqlite",
                        help="SQLite files in a temporary directory, or databases on a "
                             "throwaway PostgreSQL server (default: %(default)s)")
    parser.add_argument("--db", metavar="URL",
                        help="with --engine postgres: use this server (a role with CREATEDB) "
                             "instead of starting one")
    parser.add_argument("--pg-setting", type=_pg_setting, action="append", default=[],
                        metavar="NAME=VALUE",
                        help="with --engine postgres: start the throwaway server with this "
                             "setting, e.g. shared_buffers=1GB; repeat for more (default: "
                             "the server's defaults)")
    parser.add_argument("--reps", type=taskstore._at_least(2), default=300, metavar="R",
                        help="cycles of every verb on each store (default: %(default)s)")
    parser.add_argument("--threads", type=taskstore._at_least(1), default=FILL_THREADS, metavar="T",
                        help="threads filling the store of finished tasks (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE",
                        help="also write the whole report, machine-readable, to FILE")
    return parser


def main(argv=None):
    """Run the scale benchmark the command line asks for; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.db and args.engine != "postgres":
        parser.error("--db applies to --engine postgres")
    if args.pg_setting and (args.engine != "postgres" or args.db):
        parser.error("--pg-setting applies to the throwaway server of --engine postgres")

    def say(text):
        print(text, file=sys.stderr, flush=True)
    # Recovery logs each dead owner it meets, and the cycle makes one each
    # time: a handler of its own keeps the lines off stderr.
    logging.getLogger("taskstore").addHandler(logging.NullHandler())
    if args.engine == "sqlite":
        with tempfile.TemporaryDirectory(prefix="taskstore-scale-") as d:
            report = run(SQLiteSide(d), args.n, args.queued, args.reps, args.threads, say)
    else:
        try:
            pg = _load_pg()
        except ImportError as exc:
            print(f"bench/scale.py: the PostgreSQL engine needs psycopg 3 ({exc}): "
                  f"pip install 'psycopg[binary]'", file=sys.stderr)
            return 2
        try:
            with (pg.throwaway_server(settings=args.pg_setting) if not args.db
                  else contextlib.nullcontext(args.db)) as url:
                side = PostgresSide(url, pg)
                try:
                    report = run(side, args.n, args.queued, args.reps, args.threads, say)
                finally:
                    side.close()
        except (RuntimeError, OSError, pg.psycopg.Error) as exc:
            print(f"bench/scale.py: {exc}", file=sys.stderr)
            return 1
    print_report(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)      # in the table's order
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
