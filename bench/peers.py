# SPDX-License-Identifier: MIT
"""taskstore against the peers a user would install instead, at equal durability, in one run.

Run it from the repository root::

    python3 bench/peers.py                    # SQLite (huey) and PostgreSQL (procrastinate)
    python3 bench/peers.py --skip-postgres    # the SQLite side only
    python3 bench/peers.py --runs 3 --n 2000 --json

The script makes a throwaway virtual environment (``python -m venv`` in a
temporary directory, removed afterwards; ``--venv DIR`` keeps one to reuse),
installs the pinned peers into it with pip (``PEERS``; with PostgreSQL also
the store's own ``postgres`` extra, psycopg's binary implementation, which
procrastinate then uses too), and runs the measurements inside it, in one process for the store and the peers alike
(the store is this checkout's taskstore.py).  A registry that cannot be
reached or an install that fails stops the run with an error: nothing is
skipped silently.

The SQLite side runs the store at ``synchronous="full"`` and huey's
``SqliteHuey(fsync=True)`` (``PRAGMA synchronous=2``, FULL: every commit
synced), each on a fresh file in WAL mode.  The PostgreSQL side starts a
throwaway server (bench/pg.py's ``throwaway_server``) and runs the store's
PostgreSQL engine and procrastinate in fresh databases of it, with the
server's default settings (``synchronous_commit=on``).  Handlers return at
once; every workload starts each run from an empty file or database.  A third
side runs beside the two: the physical limit, raw sqlite3 or raw psycopg doing
the store's rows at the same concurrency.  The sides alternate run by run
(store, peer, raw; then raw, peer, store).  Rates are tasks per second; the
table shows their medians, the ratio of each run, the limit's ratio to the
peer, and the issue's target, met when every run meets it (or, in a run where
the target lies beyond the limit, reaches 0.95x the limit).  The row
``runner_4/runner_1`` is the store's runner scaling, its 4 workers' rate over
its 1 worker's: its limit is raw sqlite3's own 4-thread over 1-thread ratio in
the same runs, under the same rule.  docs/performance.md ("Against the
peers") describes each workload on each side.  On PostgreSQL a line a
workload adds the server's CPU per task on each side (all the throwaway
server's processes, read from ``/proc`` on Linux, connecting included): the
other half of the work the client's CPU column leaves out.
"""

import argparse
import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# This checkout's taskstore (standard library only; the peers are imported
# only inside the throwaway environment).
sys.path.insert(0, ROOT)
import taskstore                                        # noqa: E402

# The peers, pinned: the versions the figures were measured with.
HUEY = "huey==3.5.4"
PROCRASTINATE = "procrastinate==3.10.0"
PEERS = (HUEY, PROCRASTINATE)


def store_postgres_extra():
    """The store's own PostgreSQL requirements: pyproject.toml's ``postgres`` extra.

    What a user of the PostgreSQL engine installs (``pip install
    "taskstore[postgres]"``: psycopg with its binary implementation), so it
    goes into the environment beside procrastinate, which then uses the same
    psycopg.  Without it the environment held only what procrastinate
    requires, psycopg's pure-Python implementation, whose cost per statement
    fell on both sides, most on the side that sends the most statements.
    """
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        for line in f:
            if line.startswith("postgres = ["):
                return json.loads(line.split("=", 1)[1])        # a TOML list of strings
    raise SetupError("pyproject.toml has no postgres extra")

PAYLOAD_RESULT = {"ok": True}   # what every handler returns, at once
FRAME_TASKS = 1000              # tasks of the WAL-frame count (at most n)
PG_THREADS = 8                  # enqueue_8: threads of one process
PG_PROCESSES = 4                # workers_4: worker processes on each side

# workload: (side, target ratio store/peer, what the target means).  None: no target.
TARGETS = {
    "create": ("sqlite", 1.0),
    "lifecycle": ("sqlite", 1.0),
    "concurrent": ("sqlite", 1.3),
    "runner_1": ("sqlite", 1.2),
    "runner_4": ("sqlite", 1.2),
    "enqueue_1": ("postgresql", None),
    "enqueue_8": ("postgresql", 2.0),
    "workers_4": ("postgresql", 2.0),
}
# The store's runner_4 rate as a multiple of its runner_1 rate (or 0.95x raw
# sqlite3's own runner_4/runner_1 ratio, where that lies below: _scaling).
RUNNER_SCALING_TARGET = 2.0


# -- the parent: a throwaway virtual environment ---------------------------------

class SetupError(Exception):
    """The peers could not be installed: the run stops with this message."""


def _run_quiet(argv, what, timeout=900):
    out = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise SetupError(f"{what} failed (exit {out.returncode}):\n"
                         f"{(out.stderr or out.stdout).strip()[-3000:]}")
    return out.stdout


def make_venv(path, packages):
    """Create a virtual environment at *path* (unless it has one) and pip-install *packages*."""
    python = os.path.join(path, "bin", "python")
    if not os.path.exists(python):
        _run_quiet([sys.executable, "-m", "venv", path], f"python -m venv {path}")
    try:
        _run_quiet([python, "-m", "pip", "install", "--disable-pip-version-check",
                    "--no-input", *packages], f"pip install {' '.join(packages)}")
    except subprocess.TimeoutExpired:
        raise SetupError(f"pip install {' '.join(packages)} did not finish within 15 minutes "
                         f"(is the package registry reachable?)") from None
    return python


# -- the SQLite side -------------------------------------------------------------

def _load(name):
    """Import ``bench/<name>.py`` as a module (its workloads' helpers are reused here)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"taskstore_bench_{name}",
                                                  os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Timed:
    """The wall-clock rate and the process's CPU per task of one timed part."""

    def __init__(self, count):
        self.count = count

    def __enter__(self):
        self.cpu, self.start = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = max(time.perf_counter() - self.start, 1e-9)
        self.cpu_us = (time.process_time() - self.cpu) * 1e6 / max(self.count, 1)
        self.rate = self.count / self.seconds


def wal_frames(db_path, checkpoint, work):
    """Run *work*() and return the WAL frames it appended (and the page size).

    The method: ``checkpoint()`` empties the WAL (``wal_checkpoint(TRUNCATE)``),
    then a connection of our own holds a read transaction begun on the empty
    WAL.  A checkpoint must lock out such a reader before it copies
    anything, so while it stays open no checkpoint (the store's background
    one, SQLite's automatic one, huey's) copies a frame and the WAL never
    restarts: every commit appends its frames, and the file's growth is
    ``frames * (page_size + 24)`` after its 32-byte header.  This is a pass of
    its own, not a timed one: a WAL that is never checkpointed would change
    the timing.
    """
    wal = db_path + "-wal"
    checkpoint()
    pin = sqlite3.connect(db_path, isolation_level=None)
    try:
        page = pin.execute("PRAGMA page_size").fetchone()[0]
        pin.execute("BEGIN")
        pin.execute("SELECT count(*) FROM sqlite_master").fetchone()
        before = os.path.getsize(wal) if os.path.exists(wal) else 0
        if before > 32:
            raise RuntimeError(f"{wal} was not empty after a TRUNCATE checkpoint ({before} bytes)")
        work()
        after = os.path.getsize(wal)
        pin.execute("COMMIT")
    finally:
        pin.close()
    return max(after - 32, 0) // (page + 24), page


class SqliteSide:
    """The SQLite workloads: the store at ``synchronous="full"`` against ``SqliteHuey(fsync=True)``.

    Each method runs one side once on a fresh file and returns a dict with
    ``rate`` (tasks/s) and ``cpu_us`` (the process's CPU per task).
    """

    def __init__(self, n):
        import huey
        self.huey_module = huey
        self.taskstore = taskstore
        self.n = n
        self.bench_module = _load("bench")                      # its baseline's table
        self.bench = self.bench_module.Bench(n=n, sync="full")  # its backlog and drain loops

    # the store ---------------------------------------------------------------

    @contextlib.contextmanager
    def _store(self):
        with tempfile.TemporaryDirectory(prefix="taskstore-peers-") as d, \
                self.taskstore.TaskStore(os.path.join(d, "store.db"),
                                         synchronous="full") as store:
            yield store

    def store(self, workload):
        with self._store() as store:
            if workload == "create":
                with _Timed(self.n) as t:
                    for i in range(self.n):
                        store.create("bench", {"i": i})
                return {"rate": t.rate, "cpu_us": t.cpu_us}
            self.bench._backlog(store)
            if workload.startswith("runner_"):
                cpu = time.process_time()
                seconds = self.bench.run_backlog(store, int(workload.split("_")[1]))
                return {"rate": self.n / max(seconds, 1e-9),
                        "cpu_us": (time.process_time() - cpu) * 1e6 / self.n}
            with _Timed(self.n) as t:
                if workload == "lifecycle":
                    self.bench.bare_drain(store)
                else:
                    self.bench.drain_concurrently(store, 2)
            return {"rate": t.rate, "cpu_us": t.cpu_us}

    # raw sqlite3: the physical limit ------------------------------------------

    _RAW_CLAIM = ("UPDATE t SET status = 'running' WHERE id = (SELECT id FROM t "
                  "WHERE status = 'queued' AND kind = 'bench' ORDER BY rowid LIMIT 1) "
                  "RETURNING id")
    _RAW_FINISH = "UPDATE t SET status = 'succeeded', result = ? WHERE id = ? AND status = 'running'"
    THREADS = {"lifecycle": 1, "concurrent": 2, "runner_1": 1, "runner_4": 4}

    def raw(self, workload):
        """The same rows with raw sqlite3 at the same concurrency, synchronous=FULL.

        bench/bench.py's baseline table (a row a task and one index on
        status and kind): create is one INSERT a transaction; the drains
        are a claim (one UPDATE ... RETURNING of the oldest queued row) and
        a finish (one guarded UPDATE), by as many threads as the store's
        workers, each with its own connection; a thread's finish and its
        next claim share one transaction, as the store's workers' do.  The
        threads take turns at a lock for each transaction, as huey's do:
        SQLite has one writer at a time, and its busy handler, which would
        otherwise sort them out, sleeps (up to 100 ms a try) where a lock
        hands over at once.
        """
        bench = self.bench_module
        with tempfile.TemporaryDirectory(prefix="taskstore-peers-raw-") as d:
            path = os.path.join(d, "raw.db")
            conns = [bench._raw_connect(path, "full")
                     for _ in range(self.THREADS.get(workload, 1))]
            try:
                if workload == "create":
                    with _Timed(self.n) as t:
                        for i in range(self.n):
                            bench._raw_insert(conns[0], i)
                    return {"rate": t.rate, "cpu_us": t.cpu_us}
                conn = conns[0]
                conn.execute("BEGIN IMMEDIATE")
                conn.executemany("INSERT INTO t VALUES (?, 'bench', 'queued', ?, NULL, ?)",
                                 [(f"task_{i:020d}", '{"i":%d}' % i, i) for i in range(self.n)])
                conn.execute("COMMIT")
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                done, lock = [], threading.Lock()
                # The store's workers, bare or a runner's, finish a task and
                # claim the next in one transaction (claim_next): so do the raw ones.

                def drain(c):
                    count, row = 0, None
                    while True:
                        with lock:
                            c.execute("BEGIN IMMEDIATE")
                            if row is not None:
                                c.execute(self._RAW_FINISH, ('{"ok":true}', row[0]))
                                count += 1
                            row = c.execute(self._RAW_CLAIM).fetchone()
                            c.execute("COMMIT")
                        if row is None:
                            done.append(count)
                            return
                with _Timed(self.n) as t:
                    pool = [threading.Thread(target=drain, args=(c,)) for c in conns]
                    for thread in pool:
                        thread.start()
                    for thread in pool:
                        thread.join()
                if sum(done) != self.n:
                    raise RuntimeError(f"raw {workload} finished {sum(done)} of {self.n} rows")
                return {"rate": t.rate, "cpu_us": t.cpu_us}
            finally:
                for c in conns:
                    c.close()

    def store_frames(self, count):
        """WAL frames per task of the store's create, of one thread draining those tasks
        (``lifecycle``), and of ``Runner(workers=1)`` draining as many more (``runner_1``)."""
        with self._store() as store:
            path = store._engine.path
            checkpoint = store.checkpoint
            create, page = wal_frames(path, checkpoint, lambda: [
                store.create("bench", {"i": i}) for i in range(count)])
            drain, _ = wal_frames(path, checkpoint, lambda: self.bench.bare_drain(store))
            again = self.bench_module.Bench(n=count, sync="full")
            again._backlog(store)
            runner, _ = wal_frames(path, checkpoint, lambda: again.run_backlog(store, 1))
            drained = len(store.list(status="succeeded", limit=2 * count + 1)[0])
        if drained != 2 * count:
            raise RuntimeError(f"the store's frame count drained {drained} tasks, not {2 * count}")
        return {"create": create / count, "lifecycle": drain / count, "runner_1": runner / count,
                "page_size": page}

    # huey ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _huey(self):
        with tempfile.TemporaryDirectory(prefix="taskstore-peers-huey-") as d:
            path = os.path.join(d, "huey.db")
            h = self.huey_module.SqliteHuey("bench", filename=path, fsync=True)

            @h.task(name="bench")
            def bench(i):
                return PAYLOAD_RESULT
            try:
                yield h, bench, path
            finally:
                h.storage.close()

    def _huey_backlog(self, h, bench, count):
        # The backlog, outside the timing: the rows huey's enqueue writes,
        # 1,000 to a transaction (huey has no batch enqueue).
        storage = h.storage
        for first in range(0, count, 1000):
            with storage.db(commit=True) as curs:
                for i in range(first, min(count, first + 1000)):
                    curs.execute("insert into task (queue, data, priority) values (?, ?, ?)",
                                 (storage.name, storage.to_blob(h.serialize_task(bench.s(i))), 0))

    @staticmethod
    def _huey_drain(h):
        while True:
            task = h.dequeue()
            if task is None:
                return
            h.execute(task)

    def peer(self, workload):
        with self._huey() as (h, bench, _path):
            if workload == "create":
                with _Timed(self.n) as t:
                    for i in range(self.n):
                        bench(i)
            elif workload in ("lifecycle", "concurrent"):
                self._huey_backlog(h, bench, self.n)
                with _Timed(self.n) as t:
                    if workload == "lifecycle":
                        self._huey_drain(h)
                    else:
                        pool = [threading.Thread(target=self._huey_drain, args=(h,))
                                for _ in range(2)]
                        for thread in pool:
                            thread.start()
                        for thread in pool:
                            thread.join()
            else:
                self._huey_backlog(h, bench, self.n)
                seconds, cpu_us = self._huey_consume(h, int(workload.split("_")[1]))
                return {"rate": self.n / seconds, "cpu_us": cpu_us}
            left = h.pending_count() if workload != "create" else 0
        if left:
            raise RuntimeError(f"huey's {workload} left {left} tasks queued")
        return {"rate": t.rate, "cpu_us": t.cpu_us}

    def _huey_consume(self, h, workers):
        """Drain the backlog with huey's consumer of *workers* threads; (seconds, CPU us a task).

        The consumer is huey's own (``create_consumer``, thread workers,
        periodic tasks off); a ``SIGNAL_COMPLETE`` handler counts finished
        tasks (huey emits it after storing the result) and wakes this thread
        at the n-th.  The time runs from ``start()`` to then, as the store's
        runner's; the graceful stop is left out on both sides.
        """
        signals = self.huey_module.signals
        done, lock, count = threading.Event(), threading.Lock(), [0]

        @h.signal(signals.SIGNAL_COMPLETE)
        def completed(signal_name, task, *args):
            with lock:
                count[0] += 1
                if count[0] >= self.n:
                    done.set()
        consumer = h.create_consumer(workers=workers, worker_type="thread", periodic=False,
                                     check_worker_health=False)
        saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            cpu, start = time.process_time(), time.perf_counter()
            consumer.start()
            if not done.wait(max(60.0, self.n / 10)):
                raise TimeoutError(f"huey's consumer finished {count[0]} of {self.n} tasks")
            seconds = time.perf_counter() - start
            cpu_us = (time.process_time() - cpu) * 1e6 / self.n
        finally:
            consumer.stop(graceful=True)
            for s, handler in saved.items():
                signal.signal(s, handler)
        return max(seconds, 1e-9), cpu_us

    def peer_frames(self, count):
        """WAL frames per task of huey's enqueue and of its one-worker dequeue and execute."""
        with self._huey() as (h, bench, path):
            def checkpoint():
                with h.storage.db() as curs:
                    curs.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            create, page = wal_frames(path, checkpoint, lambda: [bench(i) for i in range(count)])
            if h.pending_count() != count:
                raise RuntimeError(f"huey queued {h.pending_count()} tasks, not {count}")
            drain, _ = wal_frames(path, checkpoint, lambda: self._huey_drain(h))
            if h.pending_count() or h.result_count() != count:
                raise RuntimeError(f"huey's frame count left {h.pending_count()} tasks queued "
                                   f"and {h.result_count()} results")
        return {"create": create / count, "lifecycle": drain / count, "page_size": page}


# -- the PostgreSQL side ---------------------------------------------------------

def _procrastinate_app(url, pool_size, on_job=None):
    """A procrastinate App on *url* with a pool of *pool_size* and its task ``bench``.

    The task is a coroutine that returns at once (after calling *on_job*,
    if given): procrastinate's cheapest kind, run on the worker's loop.
    """
    import procrastinate
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(
        conninfo=url, min_size=pool_size, max_size=pool_size))

    @app.task(name="bench")
    async def bench(i):
        if on_job is not None:
            on_job()
    return app, bench


def _pg_bench_class(pg):
    class PeersPg(pg.PgBench):
        """bench/pg.py's workloads' frame, with procrastinate as a third kind of worker."""

        def worker_argv(self, side, url):
            if side == "procrastinate":
                return [sys.executable, os.path.abspath(__file__), "--procrastinate-worker", url]
            return super().worker_argv(side, url)
    return PeersPg


def _proc_stat(pid):
    """The fields of ``/proc/<pid>/stat`` after the command's name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _parent_pid(pid):
    """The parent of process *pid* (a backend's: the postmaster), or None without ``/proc``."""
    fields = _proc_stat(pid)
    return None if fields is None else int(fields[1])


class PostgresSide:
    """The PostgreSQL workloads: the store's PostgreSQL engine against procrastinate.

    Each run makes fresh databases on the server (bench/pg.py's
    ``_databases``, twice): the store's, procrastinate's (its schema applied
    with its own ``schema_manager``) and the raw side's (bench/pg.py's
    schema); the fourth stays unused.
    """

    def __init__(self, url, n):
        self.pg = _load("pg")
        self.n = n
        self.bench = _pg_bench_class(self.pg)(url, n)
        self.server_version = self.bench.server_version
        self.settings = self.bench.settings
        backend = self.bench.admin.execute("SELECT pg_backend_pid()").fetchone()[0]
        self.postmaster = _parent_pid(backend)

    def close(self):
        self.bench.close()

    def server_cpu_s(self):
        """CPU seconds the throwaway server's processes have used so far, or None off Linux.

        The postmaster and its children (the backends of every side, the WAL
        writer, the checkpointer...), from ``/proc``; the postmaster's
        ``cutime``/``cstime`` hold the backends that have exited (a
        connection closed), so a difference over a timed part counts all the
        server did meanwhile, connecting the worker processes included.
        """
        if self.postmaster is None:
            return None
        tick, total = os.sysconf("SC_CLK_TCK"), 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            fields = _proc_stat(pid)
            if fields is None or self.postmaster not in (int(pid), int(fields[1])):
                continue
            total += sum(int(f) for f in fields[11:15])     # utime stime cutime cstime
        return total / tick

    def run(self, workload, reverse):
        """One run of *workload* on the three sides; ``(store, peer, raw)`` results.

        The store, procrastinate, then raw psycopg, or the other way round
        when *reverse*; a CHECKPOINT before each, so that none pays for
        another's dirty pages.
        """
        with self.bench._databases() as (store_url, peer_url), \
                self.bench._databases() as (raw_url, _unused):
            app, task = _procrastinate_app(peer_url, PG_THREADS)
            app.open()
            try:
                app.schema_manager.apply_schema()
                with contextlib.closing(self.pg.open_store(store_url)) as store, \
                        contextlib.closing(self.bench._raw_connect(raw_url)) as raw:
                    if workload == "workers_4":
                        self.pg.store_fill(store, self.n)
                        for first in range(0, self.n, 1000):
                            task.batch_defer(*({"i": i} for i in
                                               range(first, min(self.n, first + 1000))))
                        self.pg.raw_fill(raw, self.n)
                    sides = [("store", lambda: self._store(workload, store, store_url)),
                             ("peer", lambda: self._peer(workload, task, peer_url)),
                             ("raw", lambda: self._raw(workload, raw, raw_url))]
                    if reverse:
                        sides.reverse()
                    out = {}
                    for name, fn in sides:
                        self.bench._quiet()
                        server = self.server_cpu_s()
                        out[name] = fn()
                        if server is not None:
                            out[name]["server_cpu_us"] = \
                                (self.server_cpu_s() - server) * 1e6 / self.n
            finally:
                app.close()
        return out["store"], out["peer"], out["raw"]

    def _raw(self, workload, conn, url):
        """Raw psycopg: bench/pg.py's baseline (the store's rows, one transaction a create; its
        drain)."""
        if workload == "workers_4":
            return self._drain("raw", url)
        threads = 1 if workload == "enqueue_1" else PG_THREADS
        conns = [conn] + [self.pg.psycopg.connect(url) for _ in range(threads - 1)]
        try:
            with _Timed(self.n) as t:
                self._threads(self.n, threads,
                              lambda k, i: self.pg.raw_create(conns[k], i))
        finally:
            for c in conns[1:]:
                c.close()
        return {"rate": t.rate, "cpu_us": t.cpu_us}

    def _drain(self, side, url):
        """``workers_4`` on *side*: PG_PROCESSES worker processes drain the backlog at *url*."""
        seconds = self.bench.drain_with_processes(side, url, PG_PROCESSES)
        return {"rate": self.n / seconds,
                "cpu_us": self.bench.notes[f"workers_{PG_PROCESSES}_{side}_cpu_ms"][-1] * 1000}

    def _threads(self, count, threads, one):
        """Call ``one(k, i)`` for i in range(count), split over *threads* threads (k: the thread)."""
        share = [count // threads + (1 if k < count % threads else 0) for k in range(threads)]
        errors = []

        def work(k, first, size):
            try:
                for i in range(first, first + size):
                    one(k, i)
            except BaseException as exc:        # noqa: B036 - reported below
                errors.append(exc)
        pool = [threading.Thread(target=work, args=(k, sum(share[:k]), share[k]))
                for k in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
        if errors:
            raise errors[0]

    def _store(self, workload, store, url):
        if workload == "workers_4":
            return self._drain("store", url)
        threads = 1 if workload == "enqueue_1" else PG_THREADS
        with _Timed(self.n) as t:
            self._threads(self.n, threads, lambda k, i: store.create(self.pg.KIND, {"i": i}))
        return {"rate": t.rate, "cpu_us": t.cpu_us}

    def _peer(self, workload, task, url):
        if workload == "workers_4":
            return self._drain("procrastinate", url)
        threads = 1 if workload == "enqueue_1" else PG_THREADS
        with _Timed(self.n) as t:
            self._threads(self.n, threads, lambda k, i: task.defer(i=i))
        return {"rate": t.rate, "cpu_us": t.cpu_us}


def procrastinate_worker(url):
    """One procrastinate worker process, in bench/pg.py's protocol: ready, go, drained.

    ``run_worker_async(wait=False)`` is procrastinate's own loop, which
    returns once the queue is empty; concurrency 1, as each of the store's
    worker processes.  The moment it returns (all its jobs finished in the
    database; the pool not yet closed) stands for the last success.
    """
    import asyncio
    done = [0]

    def count():
        done[0] += 1
    app, _task = _procrastinate_app(url, 2, count)

    async def drain():
        async with app.open_async():
            print("ready", flush=True)
            line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            if line.strip() != "go":
                return None
            cpu = time.process_time()
            await app.run_worker_async(wait=False, concurrency=1, install_signal_handlers=False)
            return time.monotonic(), time.process_time() - cpu
    out = asyncio.run(drain())
    if out is None:
        return 1
    print(f"drained {done[0]} {out[0]!r} {out[1]!r}", flush=True)
    return 0


# -- one run of everything, inside the virtual environment -----------------------

def _median(values):
    values = sorted(values)
    return values[len(values) // 2] if len(values) % 2 else \
        (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2


def _meets(value, target, limit):
    """One run's verdict: *value* reaches *target*, or 0.95x *limit* where *target* lies beyond it.

    *limit* is the physical limit's figure in the same terms (raw sqlite3
    or raw psycopg in the same run): a target the limit itself does not
    reach cannot be asked of the store, and becomes 0.95x the limit.
    """
    return value >= target or (target > limit and value >= 0.95 * limit)


def _summarise(name, runs, target):
    """Medians and per-run ratios of ``runs``, a list of (store, peer, raw) results.

    The raw side is the physical limit: a target the limit itself does not
    reach in a run (``target * peer > raw``) becomes 0.95x the limit there.
    """
    ratios = [s["rate"] / p["rate"] for s, p, _ in runs]
    limits = [r["rate"] / p["rate"] for _, p, r in runs]
    met = None
    if target is not None:
        met = all(_meets(ratio, target, limit) for ratio, limit in zip(ratios, limits))
    return {"taskstore_per_s": round(_median([s["rate"] for s, _, _ in runs]), 1),
            "peer_per_s": round(_median([p["rate"] for _, p, _ in runs]), 1),
            "raw_per_s": round(_median([r["rate"] for _, _, r in runs]), 1),
            "ratio": round(_median(ratios), 3), "ratios": [round(x, 3) for x in ratios],
            "raw_ratio": round(_median(limits), 3), "raw_ratios": [round(x, 3) for x in limits],
            "taskstore_vs_raw": [round(s["rate"] / r["rate"], 3) for s, _, r in runs],
            "taskstore_cpu_us": round(_median([s["cpu_us"] for s, _, _ in runs]), 1),
            "peer_cpu_us": round(_median([p["cpu_us"] for _, p, _ in runs]), 1),
            "raw_cpu_us": round(_median([r["cpu_us"] for _, _, r in runs]), 1),
            **{f"{side}_server_cpu_us": round(_median([run[k]["server_cpu_us"] for run in runs]), 1)
               for k, side in enumerate(("taskstore", "peer", "raw"))
               if all("server_cpu_us" in run[k] for run in runs)},
            "target": target, "target_beyond_limit": None if target is None else
            any(target * p["rate"] > r["rate"] for _, p, r in runs),
            "met": met}


def _scaling(ones, fours):
    """The runner's scaling, runner_4 over runner_1 run by run, for each side, and its verdict.

    *ones* and *fours* are the two workloads' (store, peer, raw) results,
    run by run.  Raw sqlite3's own ratio in a run is the physical limit
    (its 4 threads and its 1 on the same rows, on this machine's cores and
    disk): where ``RUNNER_SCALING_TARGET`` lies beyond it, the target is
    0.95x raw's ratio in that run (``_meets``).
    """
    ratios = [[four[i]["rate"] / one[i]["rate"] for one, four in zip(ones, fours)]
              for i in range(3)]
    target = RUNNER_SCALING_TARGET
    return {"taskstore": [round(x, 3) for x in ratios[0]],
            "huey": [round(x, 3) for x in ratios[1]],
            "raw": [round(x, 3) for x in ratios[2]], "target": target,
            "target_beyond_limit": any(target > limit for limit in ratios[2]),
            "met": all(_meets(x, target, limit) for x, limit in zip(ratios[0], ratios[2]))}


def _log(text):
    print(f"peers: {text}", file=sys.stderr, flush=True)


def measure(n, runs, pg_n, skip_postgres, only=None):
    """Run every workload *runs* times, alternating the sides; return the JSON-ready report."""
    from importlib.metadata import version
    report = {"n": n, "runs": runs, "python": sys.version.split()[0],
              "sqlite": sqlite3.sqlite_version, "cpus": os.cpu_count(),
              "load": [round(x, 2) for x in os.getloadavg()],
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "huey": version("huey"), "workloads": {}}
    sqlite = SqliteSide(n)
    raw = {}
    for name in ("create", "lifecycle", "concurrent", "runner_1", "runner_4"):
        if only and name not in only:
            continue
        pairs = []
        for run in range(runs):
            order = ("store", "peer", "raw") if run % 2 == 0 else ("raw", "peer", "store")
            got = {side: getattr(sqlite, side)(name) for side in order}
            pairs.append((got["store"], got["peer"], got["raw"]))
            _log(f"{name} run {run + 1}: taskstore {got['store']['rate']:,.0f}/s, "
                 f"huey {got['peer']['rate']:,.0f}/s, raw sqlite3 {got['raw']['rate']:,.0f}/s")
        raw[name] = pairs
        report["workloads"][name] = dict(side="sqlite", peer="huey",
                                         **_summarise(name, pairs, TARGETS[name][1]))
    if "runner_1" in raw and "runner_4" in raw:
        report["runner_scaling"] = _scaling(raw["runner_1"], raw["runner_4"])
    if not only or {"create", "lifecycle"} & set(only):
        count = min(n, FRAME_TASKS)
        report["wal_frames_per_task"] = {"tasks": count, "taskstore": sqlite.store_frames(count),
                                         "huey": sqlite.peer_frames(count)}
    if not skip_postgres:
        pg = _load("pg")
        with pg.throwaway_server() as url:
            side = PostgresSide(url, pg_n)
            try:
                report["postgresql"] = side.server_version
                report["pg_settings"] = side.settings
                report["pg_n"] = pg_n
                report["procrastinate"] = version("procrastinate")
                report["psycopg"] = f"{side.pg.psycopg.__version__} ({side.pg.psycopg.pq.__impl__})"
                for name in ("enqueue_1", "enqueue_8", "workers_4"):
                    if only and name not in only:
                        continue
                    pairs = []
                    for run in range(runs):
                        pairs.append(side.run(name, reverse=run % 2 == 1))
                        _log(f"{name} run {run + 1}: taskstore {pairs[-1][0]['rate']:,.0f}/s, "
                             f"procrastinate {pairs[-1][1]['rate']:,.0f}/s, "
                             f"raw psycopg {pairs[-1][2]['rate']:,.0f}/s")
                    report["workloads"][name] = dict(
                        side="postgresql", peer="procrastinate",
                        **_summarise(name, pairs, TARGETS[name][1]))
            finally:
                side.close()
    report["taskstore_version"] = getattr(taskstore, "__version__", None)
    report["load_end"] = [round(x, 2) for x in os.getloadavg()]
    return report


# -- the table ---------------------------------------------------------------------

def _target_text(target, beyond):
    return f">= {target:.1f}x" + (" or 0.95 raw" if beyond else "")


def table_rows(report):
    """The rows of the printed table: one a workload, and the runner's scaling.

    The scaling row's RATIO is the store's runner_4 over its runner_1, its
    LIMIT raw sqlite3's 4 threads over its 1 thread in the same runs.
    """
    rows = []
    for name, w in report["workloads"].items():
        target = "-"
        if w["target"] is not None:
            target = _target_text(w["target"], w["target_beyond_limit"])
        met = {None: "-", True: "yes", False: "NO"}[w["met"]]
        rows.append((name, w["peer"], f"{w['taskstore_per_s']:,.0f}", f"{w['peer_per_s']:,.0f}",
                     f"{w['raw_per_s']:,.0f}", f"{w['ratio']:.2f}x",
                     " ".join(f"{r:.2f}" for r in w["ratios"]), f"{w['raw_ratio']:.2f}x",
                     f"{w['taskstore_cpu_us']:,.0f}", f"{w['peer_cpu_us']:,.0f}", target, met))
    scaling = report.get("runner_scaling")
    if scaling:
        s = scaling["taskstore"]
        rows.append(("runner_4/runner_1", "-", "", "", "", f"{_median(s):.2f}x",
                     " ".join(f"{r:.2f}" for r in s), f"{_median(scaling['raw']):.2f}x", "", "",
                     _target_text(scaling["target"], scaling["target_beyond_limit"]),
                     "yes" if scaling["met"] else "NO"))
    return rows


def print_report(report):
    load = ", ".join(f"{x:.2f}" for x in report["load"])
    if report.get("load_end"):
        load += " at the start, " + ", ".join(f"{x:.2f}" for x in report["load_end"]) + " at the end"
    print(f"taskstore against its peers: {report['date']}, {report['cpus']} CPUs, load {load}; "
          f"Python {report['python']}, SQLite {report['sqlite']} (synchronous=FULL both), "
          f"huey {report['huey']}"
          + (f"; PostgreSQL {report['postgresql']}, procrastinate {report['procrastinate']}, "
             f"psycopg {report.get('psycopg', '?')}" if "postgresql" in report else ""))
    print(f"n={report['n']}" + (f" (PostgreSQL n={report['pg_n']})" if "pg_n" in report else "")
          + f", {report['runs']} runs alternating; medians; RATIO = taskstore/peer (RUNS: each "
          "run's); LIMIT = raw/peer (raw sqlite3 or psycopg, the same rows at the same "
          "concurrency; for runner_4/runner_1, raw's own 4-thread/1-thread ratio); MET = every "
          "run meets the target, or 0.95x the limit where the target is beyond it")
    rows = table_rows(report)
    headers = ("WORKLOAD", "PEER", "TASKSTORE/S", "PEER/S", "RAW/S", "RATIO", "RUNS",
               "LIMIT", "TS CPU US", "PEER CPU US", "TARGET", "MET")
    widths = [max(len(h), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    for row in [headers, *rows]:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())
    for name, w in report["workloads"].items():
        if "taskstore_server_cpu_us" in w:
            print(f"PostgreSQL server CPU per task ({name}, all its processes, medians): "
                  f"taskstore {w['taskstore_server_cpu_us']:,.0f} us, {w['peer']} "
                  f"{w['peer_server_cpu_us']:,.0f} us, raw psycopg {w['raw_server_cpu_us']:,.0f} us")
    frames = report.get("wal_frames_per_task")
    if frames:
        for side in ("taskstore", "huey"):
            f = frames[side]
            page = f["page_size"]
            print(f"WAL frames per task ({side}, {page}-byte pages, {frames['tasks']} tasks): "
                  + ", ".join(f"{name} {f[name]:.2f} ({f[name] * (page + 24) / 1024:.1f} KiB)"
                              for name in ("create", "lifecycle", "runner_1") if name in f))


# -- the command line ----------------------------------------------------------------

def build_parser():
    """Return the argparse parser of ``bench/peers.py``."""
    parser = argparse.ArgumentParser(
        prog="bench/peers.py",
        description="Install the pinned peers (%s) into a throwaway virtual environment and "
                    "measure them against taskstore in the same run, at equal durability, "
                    "alternating the stores run by run." % ", ".join(PEERS))
    parser.add_argument("--runs", type=taskstore._at_least(1), default=3, metavar="N",
                        help="runs of every workload, alternating which side goes first "
                             "(default: %(default)s)")
    parser.add_argument("--n", type=taskstore._at_least(1), default=5000, metavar="N",
                        help="tasks per SQLite workload (default: %(default)s)")
    parser.add_argument("--pg-n", type=taskstore._at_least(1), default=2000, metavar="N",
                        help="tasks per PostgreSQL workload (default: %(default)s)")
    parser.add_argument("--skip-postgres", action="store_true",
                        help="run the SQLite side only (no PostgreSQL server, no procrastinate)")
    parser.add_argument("--workloads", metavar="NAME[,NAME...]",
                        help="only these workloads, of: " + ", ".join(TARGETS))
    parser.add_argument("--venv", metavar="DIR",
                        help="make (or reuse) the virtual environment here and keep it "
                             "(default: a temporary one, removed afterwards)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object instead of the table")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--procrastinate-worker", metavar="URL", help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    """Run what the command line asks for; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.procrastinate_worker:
        return procrastinate_worker(args.procrastinate_worker)
    only = None
    if args.workloads:
        only = [w.strip() for w in args.workloads.split(",") if w.strip()]
        unknown = [w for w in only if w not in TARGETS]
        if unknown or not only:
            parser.error(f"unknown workload: {', '.join(unknown) or args.workloads!r}")
    if args.inside:
        sys.path.insert(0, ROOT)
        # procrastinate warns that the App lives in the main module (this
        # script): true, and harmless for a benchmark that defines its task here.
        import logging
        logging.getLogger("procrastinate").setLevel(logging.ERROR)
        report = measure(args.n, args.runs, args.pg_n, args.skip_postgres, only)
        print(json.dumps(report))
        return 0
    if not args.skip_postgres:
        pg_reason = _server_missing()
        if pg_reason:
            print(f"bench/peers.py: cannot start a PostgreSQL server: {pg_reason} "
                  f"(--skip-postgres runs the SQLite side only)", file=sys.stderr)
            return 2
    packages = [HUEY] if args.skip_postgres else [*PEERS, *store_postgres_extra()]
    base = None if args.venv else tempfile.mkdtemp(prefix="taskstore-peers-venv-")
    try:
        venv = args.venv or os.path.join(base, "venv")
        _log(f"installing {', '.join(packages)} into {venv}")
        try:
            python = make_venv(venv, packages)
        except SetupError as exc:
            print(f"bench/peers.py: cannot install the peers: {exc}", file=sys.stderr)
            return 2
        inner = [python, os.path.abspath(__file__), "--inside", "--runs", str(args.runs),
                 "--n", str(args.n), "--pg-n", str(args.pg_n)]
        if args.skip_postgres:
            inner.append("--skip-postgres")
        if args.workloads:
            inner += ["--workloads", args.workloads]
        out = subprocess.run(inner, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        if out.returncode != 0:
            print(f"bench/peers.py: the measurement failed (exit {out.returncode})",
                  file=sys.stderr)
            return 1
        report = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        if base is not None:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0


def _server_missing():
    """Why no throwaway PostgreSQL server can start here, or None (checked before installing)."""
    import glob
    if not (shutil.which("initdb") or glob.glob("/usr/lib/postgresql/*/bin/initdb")):
        return "no PostgreSQL server binaries (initdb, pg_ctl) were found"
    return None


if __name__ == "__main__":
    sys.exit(main())
