# SPDX-License-Identifier: MIT
"""The PostgreSQL side of the benchmark: the store's PostgreSQL engine against raw psycopg.

``bench/bench.py --db postgresql://...`` (or ``--start-postgres``) runs these
workloads instead of the SQLite ones; this module, and psycopg with it, is
imported only then.  Every workload runs 3 times, each time in two fresh
databases made for it (``CREATE DATABASE ... TEMPLATE template0``, dropped
afterwards): one for the store, one for the raw baseline, so that each side
starts from an empty database and neither sees the other's tables.  The
baseline's schema is defined here: the store's tables and indexes, as far as
the raw side needs them.  The server's settings are left as they are
(``synchronous_commit``, ``fsync``): nothing is bought with durability.

Run as a script (``python3 bench/pg.py worker store|raw URL``), this file is
one worker process of the ``workers_*`` workloads.
"""

import contextlib
import glob
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psycopg                                          # noqa: E402

import taskstore                                        # noqa: E402
from taskstore import TaskStore                         # noqa: E402

KIND = "bench"
KINDS = (KIND,)
FILL_BATCH = 1000           # tasks per create_many (or raw executemany) while filling
RESULT = {"ok": True}       # the small result every task succeeds with
WORKERS_TARGET = 2.5        # workers_4's rate as a multiple of workers_1's
START_TIMEOUT_S = 120       # a worker process says "ready" within this, or the run fails
SLOWEST_RATE = 5            # ... and drains at no fewer tasks a second than this
DB_PREFIX = "taskstore_bench_"

# The raw baseline's schema: the store's tasks table (the same columns and
# types as the engine's: 64-bit integers, text in byte order, ``COLLATE "C"``,
# so that ``ORDER BY id`` is creation order), its events table (a row per
# change, keyed by task and sequence number), and the same indexes, which a
# write to them maintains.
_T = 'TEXT COLLATE "C"'
RAW_SCHEMA = (
    f"""CREATE TABLE tasks (
        id {_T} PRIMARY KEY,
        kind {_T} NOT NULL,
        status {_T} NOT NULL CHECK (status IN ('queued', 'loading', 'running',
            'input_required', 'cancelling', 'succeeded', 'failed', 'cancelled')),
        payload {_T}, result {_T}, error {_T}, status_message {_T},
        progress DOUBLE PRECISION, progress_total DOUBLE PRECISION,
        principal {_T},
        policy {_T} NOT NULL CHECK (policy IN ('fail', 'retry', 'resume')),
        attempt BIGINT NOT NULL DEFAULT 1,
        ttl_ms BIGINT, retention_ms BIGINT,
        created_at BIGINT NOT NULL, updated_at BIGINT NOT NULL,
        finished_at BIGINT, purge_at BIGINT,
        owner {_T},
        last_seq BIGINT NOT NULL DEFAULT 0,
        first_seq BIGINT NOT NULL DEFAULT 0,
        version BIGINT NOT NULL DEFAULT 0,
        meta {_T}, input_request {_T}, input_answer {_T}, snapshot {_T})""",
    "CREATE INDEX tasks_queue ON tasks (kind, id) WHERE status = 'queued'",
    "CREATE INDEX tasks_principal ON tasks (principal, id) WHERE principal IS NOT NULL",
    "CREATE INDEX tasks_owner ON tasks (owner) WHERE owner IS NOT NULL",
    "CREATE INDEX tasks_purge ON tasks (purge_at) WHERE purge_at IS NOT NULL",
    f"""CREATE TABLE events (
        task_id {_T} NOT NULL, seq BIGINT NOT NULL, type {_T} NOT NULL,
        data {_T} NOT NULL, created_at BIGINT NOT NULL,
        PRIMARY KEY (task_id, seq))""",
)
_RAW_INSERT_TASK = ("INSERT INTO tasks (id, kind, status, payload, policy, created_at, updated_at) "
                    "VALUES (%s, %s, 'queued', %s, 'fail', %s, %s)")
_RAW_INSERT_EVENT = "INSERT INTO events (task_id, seq, type, data, created_at) VALUES (%s, %s, %s, %s, %s)"
# The claim: the oldest queued task of the kinds, locked, skipping the rows
# other workers have locked, moved on in the same statement.
_RAW_CLAIM = ("UPDATE tasks SET status = 'loading', owner = %s, updated_at = %s, "
              "last_seq = last_seq + 1, version = version + 1 "
              "WHERE id = (SELECT id FROM tasks WHERE status = 'queued' AND kind = ANY(%s) "
              "ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED) "
              "RETURNING id, attempt, last_seq")
_RAW_START = ("UPDATE tasks SET status = 'running', updated_at = %s, "
              "last_seq = last_seq + 1, version = version + 1 "
              "WHERE id = %s AND status = 'loading' AND attempt = %s RETURNING last_seq")
# A worker's claim (a Runner's: no loading phase), straight to running.
_RAW_CLAIM_RUNNING = _RAW_CLAIM.replace("status = 'loading'", "status = 'running'")
_RAW_SUCCEED = ("UPDATE tasks SET status = 'succeeded', result = %s, updated_at = %s, "
                "finished_at = %s, last_seq = last_seq + 1, version = version + 1 "
                "WHERE id = %s AND status = 'running' AND attempt = %s")


def _status_event(status, previous):
    return json.dumps({"status": status, "from": previous}, separators=(",", ":"))


_EV_LOADING = _status_event("loading", "queued")
_EV_RUNNING = _status_event("running", "loading")
_EV_CLAIMED_RUNNING = _status_event("running", "queued")
_RAW_RESULT = json.dumps(RESULT, separators=(",", ":"))


def is_postgres_url(text):
    """Whether *text* names a PostgreSQL database (``postgresql://`` or ``postgres://``)."""
    return isinstance(text, str) and text.startswith(("postgresql://", "postgres://"))


def _now_ms():
    return int(time.time() * 1000)


def _raw_id(now):
    return f"task_{now:013d}{secrets.token_hex(10)}"


# -- the raw baseline's operations: one transaction each ------------------------

def raw_create(conn, i):
    """One task: its row (its ``created`` event is the row, as the store's), one transaction."""
    now = _now_ms()
    task_id = _raw_id(now)
    conn.execute(_RAW_INSERT_TASK, (task_id, KIND, '{"i":%d}' % i, now, now))
    conn.commit()


def raw_fill(conn, count):
    """Queue *count* tasks (rows only, as the store's), FILL_BATCH per transaction."""
    with conn.cursor() as cur:
        for first in range(0, count, FILL_BATCH):
            now = _now_ms()
            ids = [_raw_id(now) for _ in range(first, min(count, first + FILL_BATCH))]
            cur.executemany(_RAW_INSERT_TASK, [(task_id, KIND, '{"i":%d}' % (first + k), now, now)
                                               for k, task_id in enumerate(ids)])
            conn.commit()


def _raw_succeed(conn, task_id, attempt, now):
    """The guarded ``UPDATE`` to succeeded (the store's finish writes no event row)."""
    if conn.execute(_RAW_SUCCEED, (_RAW_RESULT, now, now, task_id, attempt)).rowcount != 1:
        raise RuntimeError(f"raw succeed of {task_id} moved nothing")


def raw_drain(conn, owner, on_success=None):
    """Claim, start and succeed queued tasks until none is left; return how many.

    Three transactions a task, each a guarded UPDATE and its event row, as
    the store's claim, start and succeed (but succeed's event is its row, as
    the store's: a plain finish from running).
    """
    done = 0
    while True:
        now = _now_ms()
        row = conn.execute(_RAW_CLAIM, (owner, now, list(KINDS))).fetchone()
        if row is None:
            conn.commit()
            return done
        task_id, attempt, seq = row
        conn.execute(_RAW_INSERT_EVENT, (task_id, seq, "status", _EV_LOADING, now))
        conn.commit()
        now = _now_ms()
        (seq,) = conn.execute(_RAW_START, (now, task_id, attempt)).fetchone()
        conn.execute(_RAW_INSERT_EVENT, (task_id, seq, "status", _EV_RUNNING, now))
        conn.commit()
        now = _now_ms()
        _raw_succeed(conn, task_id, attempt, now)
        conn.commit()
        done += 1
        if on_success is not None:
            on_success()


def raw_work(conn, owner, on_success=None):
    """A worker's loop, as a ``Runner`` worker's: each finish claims the next, one transaction.

    A first claim (straight to ``running``, with its event) commits on
    its own; then each task's guarded ``UPDATE`` to succeeded (its event
    is its row, as the store's), the next claim and its event share one
    commit.  Returns how many tasks it finished.
    """
    def claim(now):
        row = conn.execute(_RAW_CLAIM_RUNNING, (owner, now, list(KINDS))).fetchone()
        if row is not None:
            conn.execute(_RAW_INSERT_EVENT, (row[0], row[2], "status", _EV_CLAIMED_RUNNING, now))
        return row
    done, row = 0, claim(_now_ms())
    conn.commit()
    while row is not None:
        task_id, attempt, _ = row
        now = _now_ms()
        _raw_succeed(conn, task_id, attempt, now)
        row = claim(now)
        conn.commit()
        done += 1
        if on_success is not None:
            on_success()
    return done


# -- the store's side: the same work through its public verbs -------------------

def store_fill(store, count):
    """Queue *count* tasks through ``create_many``, FILL_BATCH per call."""
    for first in range(0, count, FILL_BATCH):
        store.create_many(KIND, [{"i": i} for i in range(first, min(count, first + FILL_BATCH))])


def store_drain(store, owner, on_success=None):
    """Claim (as ``loading``), ``start`` and ``succeed`` queued tasks until none is left."""
    done = 0
    while True:
        task = store.claim(KINDS, owner=owner, loading_kinds=KINDS)
        if task is None:
            return done
        store.start(task.id, attempt=task.attempt)
        store.succeed(task.id, RESULT, attempt=task.attempt)
        done += 1
        if on_success is not None:
            on_success()


def store_work(store, owner, on_success=None):
    """A worker's loop, as a ``Runner`` worker's: a ``claim``, then each ``succeed`` claims the next.

    The next claim runs in the finish's transaction (``claim_next``): one
    commit a task.  Returns how many tasks it finished.
    """
    done, task = 0, store.claim(KINDS, owner=owner)
    while task is not None:
        _, task = store.succeed(task.id, RESULT, attempt=task.attempt,
                                claim_next={"kinds": KINDS, "owner": owner})
        done += 1
        if on_success is not None:
            on_success()
    return done


def open_store(url):
    """Open the store on *url*; fail clearly when this taskstore.py has no PostgreSQL engine."""
    try:
        store = TaskStore(url)
    except taskstore.TaskStoreError as exc:
        hint = "" if hasattr(taskstore, "PostgresEngine") else \
            " (this taskstore.py seems to have no PostgreSQL engine)"
        raise RuntimeError(f"taskstore.py could not open {url}: {exc}{hint}") from exc
    if type(getattr(store, "_engine", None)) is getattr(taskstore, "SQLiteEngine", None):
        store.close()
        raise RuntimeError("this taskstore.py has no PostgreSQL engine")
    return store


# -- a throwaway server ---------------------------------------------------------

def server_bindir():
    """The directory of PostgreSQL's ``initdb`` and ``pg_ctl``, or None when none is installed."""
    candidates = []
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(os.path.dirname(initdb))
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                         key=lambda d: [int(p) if p.isdigit() else p
                                        for p in d.split("/")[-2].split(".")], reverse=True)
    for d in candidates:
        if all(os.access(os.path.join(d, b), os.X_OK) for b in ("initdb", "pg_ctl", "postgres")):
            return d
    return None


def cannot_start_server():
    """Why ``throwaway_server`` cannot run here (a sentence), or None when it can."""
    if server_bindir() is None:
        return "no PostgreSQL server binaries (initdb, pg_ctl) were found"
    if os.geteuid() == 0:
        import pwd
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "as root, the server must run as the postgres user, which does not exist"
        if shutil.which("runuser") is None:
            return "as root, the server is started with runuser, which is not installed"
    return None


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def throwaway_server(bindir=None, settings=()):
    """Start a PostgreSQL server in a temporary directory; yield its URL; stop and remove it.

    As root, the server runs as the ``postgres`` user (PostgreSQL refuses to
    run as root) and the directory is handed to that user.  Default
    settings, but for where it listens (127.0.0.1 on a free port, and its
    Unix socket in the temporary directory) and *settings*: ``name=value``
    strings, each given to the server as ``-c name=value``.
    """
    reason = None if bindir else cannot_start_server()
    if reason is not None:
        raise RuntimeError(f"cannot start a PostgreSQL server: {reason}")
    bindir = bindir or server_bindir()
    as_user = []
    base = tempfile.mkdtemp(prefix="taskstore-bench-pg-")
    try:
        if os.geteuid() == 0:
            import pwd
            user = pwd.getpwnam("postgres")
            os.chown(base, user.pw_uid, user.pw_gid)
            as_user = ["runuser", "-u", "postgres", "--"]
        data, log = os.path.join(base, "data"), os.path.join(base, "server.log")

        def run(*argv):
            out = subprocess.run(as_user + list(argv), stdin=subprocess.DEVNULL,
                                 capture_output=True, text=True, timeout=300)
            if out.returncode != 0:
                raise RuntimeError(f"{os.path.basename(argv[0])} failed: "
                                   f"{(out.stderr or out.stdout).strip()[-2000:]}")
        run(os.path.join(bindir, "initdb"), "-D", data, "-A", "trust", "-U", "postgres",
            "-E", "UTF8", "--no-instructions")
        port = _free_port()
        try:
            run(os.path.join(bindir, "pg_ctl"), "-D", data, "-l", log, "-w", "start", "-o",
                f"-p {port} -k {base} -c listen_addresses=127.0.0.1"
                + "".join(f" -c {setting}" for setting in settings))
        except RuntimeError as exc:
            tail = ""
            with contextlib.suppress(OSError), open(log, encoding="utf-8", errors="replace") as f:
                tail = f.read()[-2000:]
            raise RuntimeError(f"{exc}\n{tail}") from None
        try:
            yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
        finally:
            run(os.path.join(bindir, "pg_ctl"), "-D", data, "-m", "fast", "-w", "stop")
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- the workloads --------------------------------------------------------------

def _with_database(url, name):
    """*url* with its database replaced by *name*."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path="/" + name))


class PgBench:
    """The PostgreSQL workloads; each returns (taskstore ops/s, raw ops/s)."""

    def __init__(self, url, n=5000):
        self.url = url
        self.n = n
        self.notes = {}
        self.raw_first = False      # run_bench flips it between repetitions
        self.admin = psycopg.connect(url, autocommit=True)
        self.server_version = self.admin.execute("SHOW server_version").fetchone()[0]
        self.settings = dict(self.admin.execute(
            "SELECT name, setting FROM pg_settings WHERE name IN "
            "('synchronous_commit', 'fsync', 'full_page_writes', 'wal_level')").fetchall())
        self._can_checkpoint = True

    def close(self):
        self.admin.close()

    @contextlib.contextmanager
    def _databases(self):
        """Two fresh empty databases, the store's and the raw side's; yield their URLs."""
        tag = secrets.token_hex(4)
        names = [f"{DB_PREFIX}{tag}_store", f"{DB_PREFIX}{tag}_raw"]
        made = []
        try:
            for name in names:
                self.admin.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
                made.append(name)
            yield [_with_database(self.url, name) for name in names]
        finally:
            for name in made:
                try:
                    self.admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                except psycopg.errors.SyntaxError:          # before PostgreSQL 13
                    self.admin.execute(f'DROP DATABASE IF EXISTS "{name}"')

    def _raw_connect(self, url):
        conn = psycopg.connect(url)
        for statement in RAW_SCHEMA:
            conn.execute(statement)
        conn.commit()
        return conn

    def _quiet(self):
        """Write out dirty pages now, so that no checkpoint falls into either timing."""
        if self._can_checkpoint:
            try:
                self.admin.execute("CHECKPOINT")
            except psycopg.errors.InsufficientPrivilege:
                self._can_checkpoint = False

    @staticmethod
    def _rate(count, fn):
        start = time.perf_counter()
        fn()
        return count / max(time.perf_counter() - start, 1e-9)

    def _pair(self, ours, theirs):
        """Time ``ours()`` and ``theirs()`` (each returns a rate), in alternating order."""
        if self.raw_first:
            self._quiet()
            theirs_rate = theirs()
            self._quiet()
            return ours(), theirs_rate
        self._quiet()
        ours_rate = ours()
        self._quiet()
        return ours_rate, theirs()

    def create(self):
        """Workload: ``create()`` one task per call vs a raw INSERT of the row and its event."""
        with self._databases() as (store_url, raw_url), \
                contextlib.closing(open_store(store_url)) as store, \
                contextlib.closing(self._raw_connect(raw_url)) as raw:
            return self._pair(
                lambda: self._rate(self.n, lambda: [store.create(KIND, {"i": i})
                                                    for i in range(self.n)]),
                lambda: self._rate(self.n, lambda: [raw_create(raw, i) for i in range(self.n)]))

    def lifecycle(self):
        """Workload: one worker claims, starts and succeeds n queued tasks vs raw SQL."""
        with self._databases() as (store_url, raw_url), \
                contextlib.closing(open_store(store_url)) as store, \
                contextlib.closing(self._raw_connect(raw_url)) as raw:
            store_fill(store, self.n)
            raw_fill(raw, self.n)
            owner = store.register_process()
            counts = []

            def ours():
                return self._rate(self.n, lambda: counts.append(store_drain(store, owner)))

            def theirs():
                return self._rate(self.n, lambda: counts.append(raw_drain(raw, "proc_bench")))
            rates = self._pair(ours, theirs)
        if counts != [self.n, self.n]:
            raise RuntimeError(f"lifecycle drained {counts} tasks, not {self.n} a side")
        return rates

    def _workers(self, processes):
        with self._databases() as (store_url, raw_url):
            with contextlib.closing(open_store(store_url)) as store:
                store_fill(store, self.n)
            with contextlib.closing(self._raw_connect(raw_url)) as raw:
                raw_fill(raw, self.n)
            rates = self._pair(lambda: self.n / self.drain_with_processes("store", store_url,
                                                                          processes),
                               lambda: self.n / self.drain_with_processes("raw", raw_url,
                                                                          processes))
        return rates

    def workers_1(self):
        """Workload: 1 worker process drains n queued tasks; raw: 1 process of raw SQL."""
        return self._workers(1)

    def workers_4(self):
        """Workload: 4 worker processes drain n queued tasks; raw: 4 processes of raw SQL."""
        return self._workers(4)

    def worker_argv(self, side, url):
        """The command of one worker process of *side* on *url* (bench/peers.py adds a side)."""
        return [sys.executable, os.path.abspath(__file__), "worker", side, url]

    def drain_with_processes(self, side, url, processes):
        """Drain the queued tasks at *url* with *processes* worker processes; return the seconds.

        Each process opens its own store (or raw connection) and prints
        ``ready``; once all have, each is told ``go`` on its stdin and the
        clock starts.  Each drains until its claim finds nothing, then
        prints how many tasks it finished, the monotonic time of its last
        success (the clock is the system's, shared by the processes) and the
        CPU time it spent since ``go``: the time runs from ``go`` to the last
        of those successes, the n-th.
        """
        argv = self.worker_argv(side, url)
        logs = [tempfile.TemporaryFile() for _ in range(processes)]
        procs = []
        try:
            for log in logs:
                procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                              stderr=log, text=True))

            def expect(proc, log, word):
                line = _readline_within(proc.stdout, START_TIMEOUT_S if word == "ready"
                                        else START_TIMEOUT_S + self.n / SLOWEST_RATE)
                if not line.startswith(word):
                    log.seek(0)
                    raise RuntimeError(f"a {side} worker said {line!r}, not {word!r}: "
                                       f"{log.read().decode(errors='replace')[-2000:]}")
                return line.split()[1:]
            for proc, log in zip(procs, logs):
                expect(proc, log, "ready")
            start = time.monotonic()
            for proc in procs:
                proc.stdin.write("go\n")
                proc.stdin.flush()
            done, last, cpu = 0, start, 0.0
            for proc, log in zip(procs, logs):
                count, when, spent = expect(proc, log, "drained")
                done += int(count)
                cpu += float(spent)
                if int(count):
                    last = max(last, float(when))
            if done != self.n:
                raise RuntimeError(f"{processes} {side} workers finished {done} tasks, not {self.n}")
            self.notes.setdefault(f"workers_{processes}_{side}_cpu_ms", []).append(
                cpu * 1000 / self.n)
            return max(last - start, 1e-9)
        finally:
            for proc in procs:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                proc.stdout.close()
            for log in logs:
                log.close()


def _readline_within(stream, timeout):
    """Read one line from *stream*, or raise TimeoutError after *timeout* seconds."""
    out = []
    reader = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not out:
        raise TimeoutError(f"no line within {timeout:.0f} s")
    return out[0]


# name: (method, target ratio to raw); None: no target.  workers_4 has its own
# target: its rate as a multiple of workers_1's (WORKERS_TARGET).
PG_WORKLOADS = {
    "create": ("create", 0.5),
    "lifecycle": ("lifecycle", 0.4),
    "workers_1": ("workers_1", None),
    "workers_4": ("workers_4", None),
}


def run_bench(url, n=5000, repeat=3, only=None):
    """Run the PostgreSQL workloads against *url*; return a JSON-ready dict of medians and ratios."""
    bench = PgBench(url, n)
    results, medians = {}, {}
    try:
        for name, (method, target) in PG_WORKLOADS.items():
            if only and name not in only:
                continue
            runs = []
            for rep in range(repeat):
                bench.raw_first = rep % 2 == 1      # ours first, then raw first, ...
                runs.append(getattr(bench, method)())
            ours = sorted(r[0] for r in runs)[len(runs) // 2]
            theirs = sorted(r[1] for r in runs)[len(runs) // 2]
            medians[name] = (ours, theirs)
            results[name] = {"taskstore_ops_per_s": round(ours, 1),
                             "raw_ops_per_s": round(theirs, 1),
                             "ratio": round(ours / theirs, 3), "target_ratio": target,
                             "meets_target": None if target is None else ours / theirs >= target}
            for side in ("store", "raw"):
                cpu = sorted(bench.notes.get(f"{name}_{side}_cpu_ms", []))
                if cpu:
                    key = "taskstore" if side == "store" else "raw"
                    results[name][f"{key}_worker_cpu_ms_per_task"] = round(cpu[len(cpu) // 2], 3)
        if "workers_1" in medians and "workers_4" in medians:
            one, four = medians["workers_1"], medians["workers_4"]
            scaling = four[0] / one[0]
            results["workers_4"].update({
                "vs_workers_1": round(scaling, 3), "raw_vs_workers_1": round(four[1] / one[1], 3),
                "target_vs_workers_1": WORKERS_TARGET, "meets_target": scaling >= WORKERS_TARGET})
    finally:
        bench.close()
    return {"n": n, "engine": "postgresql", "repeat": repeat, "python": sys.version.split()[0],
            "postgresql": bench.server_version, "psycopg": psycopg.__version__,
            "settings": bench.settings, "cpus": os.cpu_count(), "workloads": results}


def bench_table(report):
    """Render run_bench's report as the rows of the table ``bench.py`` prints."""
    rows = []
    for name, w in report["workloads"].items():
        target = "-" if w["target_ratio"] is None else f">= {w['target_ratio']:.2f}"
        if "target_vs_workers_1" in w:
            target = (f"{w['vs_workers_1']:.2f}x workers_1 >= {w['target_vs_workers_1']:.2f}x "
                      f"(raw: {w['raw_vs_workers_1']:.2f}x)")
        met = {None: "-", True: "yes", False: "NO"}[w["meets_target"]]
        rows.append((name, f"{w['taskstore_ops_per_s']:,.0f}", f"{w['raw_ops_per_s']:,.0f}",
                     f"{w['ratio']:.2f}", target, met))
    return rows


def _worker_main(side, url):
    """One worker process: open, say ``ready``, wait for ``go``, drain, report."""
    last = [None]

    def mark():
        last[0] = time.monotonic()
    if side == "store":
        store = open_store(url)
        owner = store.register_process()
        drain, closer = (lambda: store_work(store, owner, mark)), store.close
    else:
        conn = psycopg.connect(url)
        owner = f"proc_raw_{os.getpid()}"
        drain, closer = (lambda: raw_work(conn, owner, mark)), conn.close
    try:
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return 1
        # CPU from "go" on, all threads: what draining costs, not the start-up
        # (imports, connecting), which would weigh 4 times as much a task with
        # 4 processes each draining a quarter.
        cpu = time.process_time()
        count = drain()
        cpu = time.process_time() - cpu
        print(f"drained {count} {last[0]!r} {cpu!r}", flush=True)
    finally:
        closer()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "worker" and sys.argv[2] in ("store", "raw"):
        sys.exit(_worker_main(sys.argv[2], sys.argv[3]))
    sys.exit("usage: pg.py worker store|raw URL  (run the benchmark with bench/bench.py --db URL)")
