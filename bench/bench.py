# SPDX-License-Identifier: MIT
"""The taskstore benchmark: the store against raw SQLite, measured in one run.

Run it from the repository root::

    python3 bench/bench.py                  # the table (about 15 minutes at the default n)
    python3 bench/bench.py --n 500 --json   # smaller and faster; one JSON object for scripts
    python3 bench/bench.py --sync full      # both sides with synchronous=FULL
    python3 bench/bench.py --db postgresql://user@host:5432/db   # the PostgreSQL engine
    python3 bench/bench.py --start-postgres # the same on a throwaway server of its own

Every workload runs 3 times on a temporary file, against a raw-sqlite3 (or
standard-library) baseline measured in the same run with the same
``synchronous`` setting; we report medians and ratios.  Durability is never
traded for speed: the store runs exactly as the README promises.  The data a
workload starts from is made through the store's own verbs (``create_many``
and transitions), never written into its tables, so it is data the store
could have made itself.

With ``--db postgresql://...`` (or ``--start-postgres``) the PostgreSQL
workloads of ``bench/pg.py`` run instead, against raw psycopg; that module,
and psycopg, are imported only then.
"""

import argparse
import contextlib
import http.client
import json
import os
import re
import secrets
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time

# The module under test is the one in the folder above this one, whatever the
# current directory: a checkout measures its own taskstore.py.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import taskstore                                        # noqa: E402
from taskstore import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, TaskStore, dumps   # noqa: E402

# The owner of the tasks the reap and recover workloads start from: a
# registration that never existed, so recovery finds their owner dead.
DEAD_OWNER = "proc_bench_dead"
FILL_BATCH = 1000          # tasks per create_many while filling (its docstring's advice)
FILL_THREADS = 4           # callers moving the filled tasks on: group commit serves them together
# The bare worker loop's next claim, made by each finish (``claim_next``), as a Runner's.
BARE_CLAIM = {"kinds": ("bench",), "owner": "proc_bench"}


def _raw_connect(path, sync):
    # The store's file settings: its page size, WAL, the same synchronous.
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA page_size={taskstore.PAGE_SIZE}")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={sync.upper()}")
    conn.execute("CREATE TABLE IF NOT EXISTS t (id TEXT PRIMARY KEY, kind TEXT, status TEXT, "
                 "payload TEXT, result TEXT, created_at INTEGER)")
    conn.execute("CREATE INDEX IF NOT EXISTS t_status ON t (status, kind)")
    return conn


def _raw_insert(conn, i):
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO t VALUES (?, 'bench', 'queued', ?, NULL, ?)",
                 (f"task_{i:020d}{secrets.token_hex(8)}", '{"i":%d}' % i, i))
    conn.execute("COMMIT")


def _raw_lifecycle(conn, count):
    """The raw lifecycle loop: INSERT, UPDATE to running, UPDATE to succeeded, each committed."""
    for i in range(count):
        task_id = f"task_{i:020d}{secrets.token_hex(8)}"
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO t VALUES (?, 'bench', 'queued', ?, NULL, ?)",
                     (task_id, '{"i":%d}' % i, i))
        conn.execute("COMMIT")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("UPDATE t SET status = 'running' WHERE id = ? AND status = 'queued'",
                     (task_id,))
        conn.execute("COMMIT")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("UPDATE t SET status = 'succeeded', result = ? WHERE id = ? "
                     "AND status = 'running'", ('{"ok":true}', task_id))
        conn.execute("COMMIT")


def _rss_bytes():
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource   # not Linux: peak RSS is the best the platform tells
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Bench:
    """The workloads; each returns (taskstore ops/s, raw ops/s)."""

    def __init__(self, n=5000, sync="normal"):
        self.n = n
        self.sync = sync
        self.notes = {}
        self.program = None     # {"mcp"|"http": command prefix}; None: taskstore.py
        self.raw_first = False  # run_bench flips it between repetitions (see _pair)
        # CPU seconds per operation of the last _rate (both sides: the process's
        # CPU, every thread of it, so a store's background work counts too),
        # and the (ours, theirs) pairs _pair measured in this workload's runs.
        self.cpu_per_op = None
        self.cpu_pairs = []

    @contextlib.contextmanager
    def _files(self):
        with tempfile.TemporaryDirectory(prefix="taskstore-bench-") as d:
            yield os.path.join(d, "store.db"), os.path.join(d, "raw.db")

    def _store(self, path, **kwargs):
        return TaskStore(path, synchronous=self.sync, **kwargs)

    def _rate(self, count, fn):
        """Run *fn* (which does *count* operations); return operations per second.

        Also notes the process's CPU time per operation (``cpu_per_op``): the
        time the Python above the database costs shows there, where a fast
        disk or a busy machine blurs the wall clock.
        """
        cpu, start = time.process_time(), time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        self.cpu_per_op = (time.process_time() - cpu) / max(count, 1)
        return count / max(elapsed, 1e-9)

    def _pair(self, store, ours, theirs):
        """Measure ``ours()`` and ``theirs()`` (each returns a rate) in turn; return both.

        Between the two, the store checkpoints, so that its background
        checkpoint never runs into the other measurement.  Which goes first
        alternates from one repetition to the next: whatever the first of
        two measurements pays (the fill's pages still being written out, a
        colder cache) then weighs on both sides alike.
        """
        if self.raw_first:
            theirs_rate, theirs_cpu = theirs(), self.cpu_per_op
            store.checkpoint()
            ours_rate, ours_cpu = ours(), self.cpu_per_op
        else:
            ours_rate, ours_cpu = ours(), self.cpu_per_op
            store.checkpoint()
            theirs_rate, theirs_cpu = theirs(), self.cpu_per_op
        self.cpu_pairs.append((ours_cpu, theirs_cpu))
        return ours_rate, theirs_rate

    def create(self):
        """Workload: one create per call vs one raw INSERT per transaction."""
        with self._files() as (spath, rpath), self._store(spath) as store, \
                contextlib.closing(_raw_connect(rpath, self.sync)) as raw:
            return self._pair(
                store, lambda: self._rate(self.n, lambda: [store.create("bench", {"i": i})
                                                           for i in range(self.n)]),
                lambda: self._rate(self.n, lambda: [_raw_insert(raw, i) for i in range(self.n)]))

    def create_many(self, size=100):
        """Workload: create_many of 100 tasks vs raw: 100 INSERTs per transaction."""
        calls = max(1, self.n // size)

        def raw_run(raw):
            for c in range(calls):
                raw.execute("BEGIN IMMEDIATE")
                raw.executemany("INSERT INTO t VALUES (?, 'bench', 'queued', ?, NULL, ?)", [
                    (f"task_{c:010d}{i:010d}{secrets.token_hex(8)}", '{"i":%d}' % i, i)
                    for i in range(size)])
                raw.execute("COMMIT")

        with self._files() as (spath, rpath), self._store(spath) as store, \
                contextlib.closing(_raw_connect(rpath, self.sync)) as raw:
            return self._pair(
                store, lambda: self._rate(calls * size, lambda: [
                    store.create_many("bench", [{"i": i} for i in range(size)])
                    for _ in range(calls)]),
                lambda: self._rate(calls * size, lambda: raw_run(raw)))

    def lifecycle(self):
        """Workload: create, claim, succeed vs raw INSERT and two guarded UPDATEs."""
        def ours_run(store):
            self._store_lifecycle(store, self.n)

        with self._files() as (spath, rpath), self._store(spath) as store, \
                contextlib.closing(_raw_connect(rpath, self.sync)) as raw:
            return self._pair(store, lambda: self._rate(self.n, lambda: ours_run(store)),
                              lambda: self._rate(self.n, lambda: _raw_lifecycle(raw, self.n)))

    def _store_lifecycle(self, store, count):
        """The store's own bare lifecycle loop (as ``lifecycle``): create, claim, succeed."""
        for i in range(count):
            task = store.create("bench", {"i": i})
            store.claim(("bench",), owner="proc_bench")
            store.succeed(task.id, {"ok": True})

    def _backlog(self, store):
        """Queue n tasks through ``create_many``, outside the timing; return them."""
        tasks = []
        for first in range(0, self.n, FILL_BATCH):
            tasks += store.create_many("bench", [{"i": i} for i in
                                                 range(first, min(self.n, first + FILL_BATCH))])
        store.checkpoint()
        return tasks

    def run_backlog(self, store, workers):
        """Drain the store's queued backlog with a public ``Runner`` of *workers*; return the seconds.

        The handler returns a small result at once.  A listener counts the
        tasks that reach ``succeeded`` and wakes this thread at the n-th.
        The time runs from ``start()`` to that moment: ``stop()``, which
        waits for idle workers to notice (up to the store's poll interval),
        is shutdown, not throughput, and is left out.
        """
        done, lock, count = threading.Event(), threading.Lock(), [0]

        def listener(task, change):
            if change == "status" and task.status == SUCCEEDED:
                with lock:
                    count[0] += 1
                    if count[0] >= self.n:
                        done.set()
        store.add_listener(listener)
        runner = taskstore.Runner(store, {"bench": lambda ctx, payload: {"ok": True}},
                                  workers=workers)
        try:
            start = time.perf_counter()
            runner.start()
            if not done.wait(max(60.0, self.n / 10)):
                raise TimeoutError(f"the runner finished {count[0]} of {self.n} tasks")
            return time.perf_counter() - start
        finally:
            runner.stop()
            store.remove_listener(listener)

    def bare_drain(self, store):
        """The store's bare loop over a backlog, in this thread, until none is left.

        What a ``Runner`` worker does for each task, without the runner: a
        first ``claim`` (which takes the task to ``running``), then each
        ``succeed``, with the same small result, claims the next task in
        its own transaction (``claim_next``): one commit a task.
        """
        task = store.claim(("bench",), owner="proc_bench")
        while task is not None:
            _, task = store.succeed(task.id, {"ok": True}, claim_next=BARE_CLAIM)

    def _runner(self, workers):
        """Workload: a Runner of *workers* draining n queued tasks vs the raw lifecycle loop.

        Each drain starts from a backlog of n tasks queued just before it
        (outside the timing).  With one worker the store's bare loop
        (``bare_drain``) drains a backlog of its own in the same store, and
        its rate is the runner's yardstick (``vs_bare_lifecycle``): the same
        work, claim and succeed per task, without the runner.  Which of the
        two goes first alternates with the repetitions, as in ``_pair``.
        """
        name = f"runner_{workers}"
        with self._files() as (spath, rpath), self._store(spath) as store, \
                contextlib.closing(_raw_connect(rpath, self.sync)) as raw:
            def runner():
                self._backlog(store)
                cpu = time.process_time()
                rate = self.n / max(self.run_backlog(store, workers), 1e-9)
                self.cpu_per_op = (time.process_time() - cpu) / self.n
                return rate

            def bare():
                self._backlog(store)
                return self._rate(self.n, lambda: self.bare_drain(store))
            bare_rate = bare() if workers == 1 and self.raw_first else None
            rates = self._pair(store, runner,
                               lambda: self._rate(self.n, lambda: _raw_lifecycle(raw, self.n)))
            if workers == 1:
                if bare_rate is None:
                    bare_rate = bare()
                self.notes.setdefault(f"{name}_vs_bare_lifecycle", []).append(rates[0] / bare_rate)
        return rates

    def runner_1(self):
        """Workload: Runner(workers=1) draining n queued tasks vs the raw lifecycle loop."""
        return self._runner(1)

    def runner_4(self):
        """Workload: Runner(workers=4) draining n queued tasks vs the raw lifecycle loop."""
        return self._runner(4)

    def drain_concurrently(self, store, threads):
        """*threads* threads each run ``bare_drain``'s loop until the queue is empty."""
        pool = [threading.Thread(target=self.bare_drain, args=(store,)) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()

    def _concurrent_lifecycle(self, threads):
        with self._files() as (spath, rpath), self._store(spath) as store, \
                contextlib.closing(_raw_connect(rpath, self.sync)) as raw:
            self._backlog(store)
            return self._pair(
                store, lambda: self._rate(self.n, lambda: self.drain_concurrently(store, threads)),
                lambda: self._rate(self.n, lambda: _raw_lifecycle(raw, self.n)))

    def concurrent_lifecycle_1(self):
        """Workload: 1 thread claiming and succeeding n queued tasks vs the raw lifecycle loop."""
        return self._concurrent_lifecycle(1)

    def concurrent_lifecycle_2(self):
        """Workload: 2 threads claiming and succeeding n queued tasks vs the raw lifecycle loop."""
        return self._concurrent_lifecycle(2)

    def concurrent_lifecycle_4(self):
        """Workload: 4 threads claiming and succeeding n queued tasks vs the raw lifecycle loop."""
        return self._concurrent_lifecycle(4)

    def concurrent_create(self, threads=8):
        """Workload: 8 threads creating vs raw single-thread INSERTs."""
        per = max(1, self.n // threads)

        def ours_run(store):
            def work():
                for i in range(per):
                    store.create("bench", {"i": i})
            pool = [threading.Thread(target=work) for _ in range(threads)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()

        with self._files() as (spath, rpath), self._store(spath) as store, \
                contextlib.closing(_raw_connect(rpath, self.sync)) as raw:
            return self._pair(
                store, lambda: self._rate(per * threads, lambda: ours_run(store)),
                lambda: self._rate(self.n, lambda: [_raw_insert(raw, i) for i in range(self.n)]))

    def get(self):
        """Workload: get by id vs raw SELECT by primary key."""
        with self._files() as (spath, rpath), self._store(spath) as store, \
                contextlib.closing(_raw_connect(rpath, self.sync)) as raw:
            ids = [store.create("bench", {"i": i}).id for i in range(min(self.n, 2000))]
            raw_ids = []
            for i in range(len(ids)):
                _raw_insert(raw, i)
            raw_ids = [r[0] for r in raw.execute("SELECT id FROM t")]
            picks = [ids[i % len(ids)] for i in range(self.n)]
            raw_picks = [raw_ids[i % len(raw_ids)] for i in range(self.n)]
            store.checkpoint()
            return self._pair(
                store, lambda: self._rate(self.n, lambda: [store.get(i) for i in picks]),
                lambda: self._rate(self.n, lambda: [
                    raw.execute("SELECT * FROM t WHERE id = ?", (i,)).fetchone()
                    for i in raw_picks]))

    def event_replay(self, events=1000):
        """Workload: read a 1,000-event log vs raw SELECT of the same rows."""
        reps = max(3, self.n // 100)
        with self._files() as (spath, rpath), self._store(spath) as store, \
                contextlib.closing(_raw_connect(rpath, self.sync)) as raw:
            task = store.create("bench")
            store.start(task.id)
            for i in range(events - 2):
                store.emit(task.id, "delta", {"i": i, "text": "word "})
            raw.execute("CREATE TABLE e (task_id TEXT, seq INTEGER, type TEXT, data TEXT, "
                        "created_at INTEGER, PRIMARY KEY (task_id, seq)) WITHOUT ROWID")
            log = store.events(task.id)
            assert len(log) == events
            raw.execute("BEGIN")       # the same rows: same keys, same data, same times
            raw.executemany("INSERT INTO e VALUES (?, ?, ?, ?, ?)", log)
            raw.execute("COMMIT")
            store.checkpoint()
            return self._pair(
                store, lambda: self._rate(reps, lambda: [store.events(task.id)
                                                         for _ in range(reps)]),
                lambda: self._rate(reps, lambda: [raw.execute(
                    "SELECT seq, type, data, created_at FROM e WHERE task_id = ? AND seq >= 0 "
                    "ORDER BY seq", (task.id,)).fetchall() for _ in range(reps)]))

    def _fill(self, store, raw, count, finished):
        """Make *count* tasks, 1 stored event each, in both files, outside the timing.

        The store's tasks are made by its own verbs: ``create_many`` queues
        them (event 0, ``created``, is the row: the log stores none), then
        each moves once (event 1, a ``status``).  Unfinished (*finished*
        false): ``start`` takes each to ``running`` under a dead owner, as a
        runner that then died left them.
        Finished:
        ``cancel`` ends each while still queued, and a retention of zero
        makes every one due for purging from that moment (small rows, as a
        purge mostly meets).  The raw file gets rows of the same sizes and
        the store's own event texts, written as plainly as SQL allows.
        Returns the store's tasks as ``create_many`` made them.
        """
        tasks = []
        for first in range(0, count, FILL_BATCH):
            tasks += store.create_many(
                "bench", [None] * min(FILL_BATCH, count - first),
                owner=None if finished else DEAD_OWNER,
                retention_ms=0 if finished else None)
        move, status = (store.cancel, CANCELLED) if finished else (store.start, RUNNING)
        # Finished tasks end one by one, in creation order, so that they fall
        # due in that order, as tasks that ran for similar times do; starting
        # is spread over threads that group commit serves together.
        threads = 1 if finished else FILL_THREADS

        def move_on(part):
            for task in part:
                move(task.id)
        pool = [threading.Thread(target=move_on, args=(tasks[i::threads],))
                for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        moved = dumps({"status": status, "from": QUEUED})
        events, raw_rows = [], []
        for task in tasks:
            events.append((task.id, 1, "status", moved, task.created_at))
            raw_rows.append((task.id, "bench", "x", "{}", None, task.created_at))
        raw.execute("CREATE TABLE e (task_id TEXT, seq INTEGER, type TEXT, data TEXT, "
                    "created_at INTEGER, PRIMARY KEY (task_id, seq)) WITHOUT ROWID")
        raw.execute("BEGIN")
        raw.executemany("INSERT INTO t VALUES (?, ?, ?, ?, ?, ?)", raw_rows)
        raw.executemany("INSERT INTO e VALUES (?, ?, ?, ?, ?)", events)
        raw.execute("COMMIT")
        return tasks

    def reap(self):
        """Workload: purge 20*n expired tasks vs raw DELETE of the same rows."""
        count = self.n * 20
        with self._files() as (spath, rpath), self._store(spath) as store, \
                contextlib.closing(_raw_connect(rpath, self.sync)) as raw:
            self._fill(store, raw, count, finished=True)
            store.checkpoint()

            def raw_run():
                # The same rows, chosen by a condition as any purge chooses
                # them (an unconditional DELETE would truncate whole tables,
                # which no retention rule can do).
                now = int(time.time() * 1000)
                raw.execute("BEGIN IMMEDIATE")
                raw.execute("DELETE FROM e WHERE task_id IN (SELECT id FROM t WHERE created_at <= ?)",
                            (now,))
                raw.execute("DELETE FROM t WHERE created_at <= ?", (now,))
                raw.execute("COMMIT")

            rates = self._pair(
                store, lambda: self._timed_transactions("reap", store, count, store.reap),
                lambda: self._rate(count, raw_run))
            assert store._engine.conn.execute("SELECT count(*) FROM tasks").fetchone()[0] == 0
            assert raw.execute("SELECT count(*) FROM t").fetchone()[0] == 0
        return rates

    def _timed_transactions(self, name, store, count, fn):
        """Return fn's rate over *count*; note the longest write transaction it ran."""
        longest, begun = [0.0], []

        def trace(sql):
            if sql == "BEGIN IMMEDIATE":
                begun.append(time.perf_counter())
            elif sql == "COMMIT" and begun:
                longest[0] = max(longest[0], time.perf_counter() - begun[-1])

        store._engine.conn.set_trace_callback(trace)
        try:
            rate = self._rate(count, fn)
        finally:
            store._engine.conn.set_trace_callback(None)
        key = f"{name}_longest_transaction_ms"
        self.notes[key] = max(self.notes.get(key, 0), round(longest[0] * 1000, 2))
        return rate

    def recover(self):
        """Workload: recover 20*n tasks of a dead owner vs raw bulk UPDATE."""
        count = self.n * 20
        with self._files() as (spath, rpath), \
                self._store(spath, recover_on_open=False) as store, \
                contextlib.closing(_raw_connect(rpath, self.sync)) as raw:
            self._fill(store, raw, count, finished=False)
            store.checkpoint()

            def raw_run():
                raw.execute("BEGIN IMMEDIATE")
                raw.execute("UPDATE t SET status = 'failed' WHERE status = 'x'")
                raw.execute("COMMIT")

            rates = self._pair(
                store, lambda: self._timed_transactions("recover", store, count, store.recover),
                lambda: self._rate(count, raw_run))
            assert store._engine.conn.execute("SELECT count(*) FROM tasks WHERE status = ?",
                                       (FAILED,)).fetchone()[0] == count
        return rates

    def memory(self, threads=4):
        """Create and complete n * 200 tasks (1,000,000 at the default n); return RSS growth in MB.

        *threads* callers each create a task, claim one and finish it, as a
        busy service would; group commit serves them together.
        """
        count = self.n * 200
        per = -(-count // threads)

        def cycle(store, rounds):
            for i in range(rounds):
                store.create("bench")
                task = store.claim(("bench",), owner="proc_bench")
                if task is not None:
                    store.succeed(task.id, i)

        with self._files() as (spath, _), self._store(spath) as store:
            cycle(store, min(count, 1000))               # warm up caches and code paths
            before = _rss_bytes()
            pool = [threading.Thread(target=cycle, args=(store, per)) for _ in range(threads)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
            growth = _rss_bytes() - before
            done = store._engine.conn.execute("SELECT count(*) FROM tasks WHERE status = ?",
                                       (SUCCEEDED,)).fetchone()[0]
        self.notes["memory_tasks"] = per * threads
        self.notes["memory_completed"] = done
        return growth / 1e6, None

    # -- the two servers: round trips through a real child process --------------

    def _program(self, command):
        """The command line of taskstore's *command* (``mcp`` or ``http``)."""
        if self.program and command in self.program:
            return [*self.program[command], command]
        return [sys.executable, os.path.abspath(taskstore.__file__), command]

    def _round_trips(self):
        return max(50, self.n // 10)

    @staticmethod
    def _within(timeout, fn):
        """Run *fn* in a thread; return its value, or raise TimeoutError after *timeout* s."""
        out = []

        def run():
            try:
                out.append((True, fn()))
            except Exception as exc:            # handed to the caller below
                out.append((False, exc))
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(timeout)
        if not out:
            raise TimeoutError(f"no answer within {timeout} s")
        if not out[0][0]:
            raise out[0][1]
        return out[0][1]

    @staticmethod
    def _stop(proc):
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stderr is not None:
            with contextlib.suppress(OSError):
                proc.stderr.close()

    @classmethod
    def _alternating(cls, reps, ours, theirs, rounds=10):
        """Time ``ours(k)`` and ``theirs(k)`` in alternating batches; return their rates.

        Both servers are up for the whole measurement and take turns, so a
        change in the machine's load or in how the scheduler places the two
        processes weighs on both sides alike (round trips between processes
        swing by a factor of several on a shared virtual machine).
        """
        batch = max(1, reps // rounds)
        spent = [0.0, 0.0]
        for _ in range(rounds):
            for side, fn in enumerate((ours, theirs)):
                start = time.perf_counter()
                fn(batch)
                spent[side] += time.perf_counter() - start
        return batch * rounds / max(spent[0], 1e-9), batch * rounds / max(spent[1], 1e-9)

    def mcp_roundtrip(self):
        """Sequential ``tasks/get`` over stdio against a stdlib line-echo child."""
        argv = self._program("mcp")
        reps = self._round_trips()

        def rpc(proc, message):
            proc.stdin.write(dumps(message).encode() + b"\n")
            proc.stdin.flush()
            while "id" in message:
                line = proc.stdout.readline()
                if not line:
                    raise EOFError("the server closed stdout")
                reply = json.loads(line)
                if reply.get("id") == message["id"]:
                    return reply
            return None

        with self._files() as (spath, _):
            proc = subprocess.Popen(argv + ["--db", spath], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            echo = subprocess.Popen([sys.executable, "-c", _ECHO_CHILD], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE)
            try:
                def start():
                    rpc(proc, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                        "protocolVersion": "2025-11-25", "capabilities": {},
                        "clientInfo": {"name": "taskstore-bench", "version": taskstore.__version__}}})
                    rpc(proc, {"jsonrpc": "2.0", "method": "notifications/initialized"})
                    reply = rpc(proc, {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
                        "name": "sleep_then_echo", "arguments": {"seconds": 0, "text": "x"},
                        "task": {"ttl": 60000}}})
                    return reply["result"]["task"]["taskId"]
                task_id = self._within(60, start)
                requests = [{"jsonrpc": "2.0", "id": 3 + i, "method": "tasks/get",
                             "params": {"taskId": task_id}} for i in range(reps)]
                for child in (proc, echo):                           # warm up
                    rpc(child, requests[0])
                ours, theirs = self._alternating(
                    reps, lambda k: [rpc(proc, r) for r in requests[:k]],
                    lambda k: [rpc(echo, r) for r in requests[:k]])
                reply = rpc(proc, {**requests[0], "id": 0})
                if "result" not in reply:
                    raise ValueError(f"tasks/get failed: {reply.get('error')}")
            except (OSError, ValueError, KeyError, TypeError, EOFError, TimeoutError) as exc:
                self.notes["mcp_roundtrip"] = f"skipped: the mcp server did not answer ({exc})"
                return None
            finally:
                self._stop(proc)
                self._stop(echo)
        return ours, theirs

    def http_roundtrip(self):
        """Sequential ``GET /lmsp/v1/tasks/{id}`` on one keep-alive connection vs http.server."""
        argv = self._program("http")
        reps = self._round_trips()

        def serve(argv):
            """Start a server that says where it listens on stderr; return (proc, host, port)."""
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE)

            def listening():
                for line in proc.stderr:
                    found = re.search(rb"listening on http://([^\s:/]+|\[[^\]]+\]):(\d+)", line)
                    if found:
                        return found.group(1).decode().strip("[]"), int(found.group(2))
                raise EOFError("the server exited before listening")
            try:
                host, port = self._within(60, listening)
            except BaseException:
                self._stop(proc)
                raise
            # Keep reading its log, so a chatty server never blocks on a full pipe.
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, host, port

        def get_all(conn, path, count):
            for _ in range(count):
                conn.request("GET", path)
                response = conn.getresponse()
                response.read()
                if response.status != 200:
                    raise ValueError(f"GET answered {response.status}")

        with self._files() as (spath, _):
            procs = []
            try:
                proc, host, port = serve(argv + ["--db", spath, "--port", "0"])
                procs.append(proc)
                base, base_host, base_port = serve([sys.executable, "-c", _HTTP_CHILD])
                procs.append(base)
                conn = http.client.HTTPConnection(host, port, timeout=60)
                conn.request("POST", "/lmsp/v1/tasks", body=dumps(
                    {"type": "response", "input": {"model": "m", "input": "hi"}}),
                    headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                created = json.loads(response.read())
                if response.status >= 300:
                    raise ValueError(f"POST answered {response.status}")
                path = f"/lmsp/v1/tasks/{created['id']}"
                base_conn = http.client.HTTPConnection(base_host, base_port, timeout=60)
                get_all(conn, path, reps // 10)                      # warm up
                get_all(base_conn, path, reps // 10)
                ours, theirs = self._alternating(reps, lambda k: get_all(conn, path, k),
                                                 lambda k: get_all(base_conn, path, k))
                conn.close()
                base_conn.close()
            except (OSError, ValueError, KeyError, TypeError, EOFError, TimeoutError,
                    http.client.HTTPException) as exc:
                self.notes["http_roundtrip"] = f"skipped: the http server did not answer ({exc})"
                return None
            finally:
                for proc in procs:
                    self._stop(proc)
        return ours, theirs


# The baselines' children: the least a process can do for a line / a request.
_ECHO_CHILD = """import sys
for line in sys.stdin.buffer:
    sys.stdout.buffer.write(line)
    sys.stdout.buffer.flush()
"""
_HTTP_CHILD = """import http.server, sys
BODY = b'{"id":"task_x","object":"task","status":"queued"}'
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True      # headers and body in two writes: no 40 ms ACK wait
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(f"baseline: listening on http://127.0.0.1:{server.server_port}", file=sys.stderr, flush=True)
server.serve_forever()
"""

BENCH_WORKLOADS = {
    # name: (method, target ratio); None: no target of this kind (see the tables below)
    "create": ("create", 0.6),
    "create_many": ("create_many", None),
    "lifecycle": ("lifecycle", 0.5),
    "concurrent_create": ("concurrent_create", 1.0),
    "runner_1": ("runner_1", None),
    "runner_4": ("runner_4", None),
    "concurrent_lifecycle_1": ("concurrent_lifecycle_1", None),
    "concurrent_lifecycle_2": ("concurrent_lifecycle_2", None),
    "concurrent_lifecycle_4": ("concurrent_lifecycle_4", None),
    "get": ("get", 0.5),
    "event_replay": ("event_replay", 0.5),
    "reap": ("reap", 1 / 3),
    "recover": ("recover", 1 / 3),
    "mcp_roundtrip": ("mcp_roundtrip", 0.3),
    "http_roundtrip": ("http_roundtrip", 0.7),
}
# With --sync full these targets replace the ones above (a commit is an fsync:
# group commit, which shares one among writers, is what the concurrent ones measure).
FULL_TARGETS = {"lifecycle": 0.85, "concurrent_create": 2.0, "runner_4": 2.0,
                "concurrent_lifecycle_4": 2.0}
# With --sync normal: more workers must not be slower than one; the ratio must be at
# least that of the single-worker workload of the same run (same raw baseline).
SINGLE_WORKER = {"runner_4": "runner_1", "concurrent_lifecycle_4": "concurrent_lifecycle_1"}
# runner_1's target: its rate as a multiple of the store's bare loop (vs_bare_lifecycle).
RUNNER_VS_BARE_TARGET = 0.9
MEMORY_TARGET_MB = 50


def run_bench(n=5000, sync="normal", repeat=3, only=None, memory=True, program=None):
    """Run the benchmark; return a JSON-ready dict of medians and ratios.

    *program* (``{"mcp": [python, "run.py"], ...}``: a command prefix per
    subcommand) runs the mcp/http round trips against another entry point;
    by default taskstore.py.
    """
    bench = Bench(n, sync)
    bench.program = program
    results = {}
    for name, (method, target) in BENCH_WORKLOADS.items():
        if only and name not in only:
            continue
        runs, bench.cpu_pairs = [], []
        for rep in range(repeat):
            bench.raw_first = rep % 2 == 1      # ours first, then raw first, ...
            runs.append(getattr(bench, method)())
        runs = [r for r in runs if r is not None]
        if sync == "full" and name in FULL_TARGETS:
            target = FULL_TARGETS[name]
        if target is not None:
            target = round(target, 3)
        if not runs:
            results[name] = {"skipped": bench.notes.get(name, "skipped"), "target_ratio": target}
            continue
        ours = sorted(r[0] for r in runs)[len(runs) // 2]
        theirs = sorted(r[1] for r in runs)[len(runs) // 2]
        results[name] = {"taskstore_ops_per_s": round(ours, 1), "raw_ops_per_s": round(theirs, 1),
                         "ratio": round(ours / theirs, 3), "target_ratio": target,
                         "meets_target": None if target is None else ours / theirs >= target}
        cpu = [pair for pair in bench.cpu_pairs if None not in pair]
        if cpu:
            # Medians of CPU microseconds per operation, each side on its own.
            results[name]["taskstore_cpu_us"] = round(
                sorted(p[0] for p in cpu)[len(cpu) // 2] * 1e6, 1)
            results[name]["raw_cpu_us"] = round(sorted(p[1] for p in cpu)[len(cpu) // 2] * 1e6, 1)
        if name == "runner_1" and bench.notes.get("runner_1_vs_bare_lifecycle"):
            bare = sorted(bench.notes["runner_1_vs_bare_lifecycle"])
            results[name]["vs_bare_lifecycle"] = round(bare[len(bare) // 2], 3)
            results[name]["target_vs_bare"] = RUNNER_VS_BARE_TARGET
            results[name]["meets_target"] = bare[len(bare) // 2] >= RUNNER_VS_BARE_TARGET
        single = SINGLE_WORKER.get(name)
        if sync == "normal" and single in results and "ratio" in results[single]:
            # Not below the single worker: that workload's ratio, measured in this run.
            results[name]["target_ratio"] = results[single]["ratio"]
            results[name]["target_of"] = single
            results[name]["meets_target"] = results[name]["ratio"] >= results[single]["ratio"]
        if name in ("reap", "recover"):
            results[name]["longest_transaction_ms"] = bench.notes[f"{name}_longest_transaction_ms"]
            results[name]["meets_target"] = results[name]["meets_target"] and \
                bench.notes[f"{name}_longest_transaction_ms"] <= 50
    if memory and (not only or "memory" in only):
        growth, _ = bench.memory()
        results["memory"] = {"tasks": bench.notes["memory_tasks"],
                             "completed": bench.notes["memory_completed"],
                             "rss_growth_mb": round(growth, 1), "target_mb": MEMORY_TARGET_MB,
                             "meets_target": growth < MEMORY_TARGET_MB}
    return {"n": n, "sync": sync, "repeat": repeat, "python": sys.version.split()[0],
            "sqlite": sqlite3.sqlite_version, "cpus": os.cpu_count(), "workloads": results}


def bench_table(report):
    """Render run_bench's report as the rows of the table ``main`` prints."""
    rows = []
    for name, w in report["workloads"].items():
        if name == "memory":
            rows.append((name, f"{w['tasks']:,} tasks", "-", f"+{w['rss_growth_mb']} MB RSS",
                         "-", "-", f"< {w['target_mb']} MB",
                         "yes" if w["meets_target"] else "NO"))
        else:
            target = "-" if w["target_ratio"] is None else f">= {w['target_ratio']:.2f}"
            if "skipped" in w:
                rows.append((name, "-", "-", "-", "-", "-", target, w["skipped"]))
                continue
            if "longest_transaction_ms" in w:
                target += f", longest txn {w['longest_transaction_ms']} ms <= 50"
            if "target_of" in w:
                target = f">= {w['target_ratio']:.2f} ({w['target_of']}'s ratio)"
            if "vs_bare_lifecycle" in w:
                if "target_vs_bare" in w:
                    target = (f">= {w['target_vs_bare']:.2f}x the store's bare loop "
                              f"({w['vs_bare_lifecycle']:.2f}x)")
                else:
                    target += f" ({w['vs_bare_lifecycle']:.2f}x the store's bare loop)"
            met = {None: "-", True: "yes", False: "NO"}[w["meets_target"]]
            cpu = ("-", "-") if "taskstore_cpu_us" not in w else (
                f"{w['taskstore_cpu_us']:,.1f}", f"{w['raw_cpu_us']:,.1f}")
            rows.append((name, f"{w['taskstore_ops_per_s']:,.0f}", f"{w['raw_ops_per_s']:,.0f}",
                         f"{w['ratio']:.2f}", *cpu, target, met))
    return rows



def _print_table(rows, headers):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    for row in [headers, *rows]:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())


def build_parser():
    """Return the argparse parser of ``bench/bench.py``."""
    parser = argparse.ArgumentParser(
        prog="bench/bench.py",
        description="Run every workload 3 times on a temporary file and print the median "
                    "operations per second of taskstore and of its raw-SQLite (or stdlib) "
                    "baseline, and their ratio.")
    parser.add_argument("--n", type=taskstore._at_least(1), default=5000, metavar="N",
                        help="operations per workload; reap/recover use 20*N tasks, memory "
                             "200*N (default: %(default)s)")
    parser.add_argument("--sync", choices=("normal", "full"), default=None,
                        help="synchronous mode of both the store and the baseline "
                             "(SQLite only; default: normal)")
    parser.add_argument("--db", metavar="URL",
                        help="run the PostgreSQL workloads on this server (a postgresql:// or "
                             "postgres:// URL; the role needs CREATEDB: every workload runs "
                             "in fresh databases it creates and drops) instead of SQLite's")
    parser.add_argument("--start-postgres", action="store_true",
                        help="start a throwaway PostgreSQL server in a temporary directory for "
                             "the run (default settings), run the PostgreSQL workloads on it, "
                             "then stop and remove it")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object instead of a table (default: table)")
    parser.add_argument("--workloads", type=_workload_names, metavar="NAME[,NAME...]",
                        help="run only these workloads, comma-separated, of: "
                             f"{', '.join([*BENCH_WORKLOADS, 'memory'])} (default: all)")
    return parser


def _workload_names(text):
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in BENCH_WORKLOADS and name != "memory"]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown workload: {', '.join(unknown) or repr(text)}")
    return names


def _load_pg():
    """Import bench/pg.py (and psycopg with it): only for a PostgreSQL run."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pg.py")
    spec = importlib.util.spec_from_file_location("taskstore_bench_pg", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _main_postgres(parser, args):
    if args.sync is not None:
        parser.error("--sync applies to SQLite only (PostgreSQL runs with its own settings)")
    if args.db and args.start_postgres:
        parser.error("--db and --start-postgres exclude each other")
    try:
        pg = _load_pg()
    except ImportError as exc:
        print(f"bench/bench.py: the PostgreSQL benchmark needs psycopg 3 ({exc}): "
              f"pip install 'psycopg[binary]'", file=sys.stderr)
        return 2
    try:
        with (pg.throwaway_server() if args.start_postgres
              else contextlib.nullcontext(args.db)) as url:
            report = pg.run_bench(url, n=args.n)
    except (RuntimeError, OSError, pg.psycopg.Error) as exc:
        print(f"bench/bench.py: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(dumps(report))
        return 0
    settings = ", ".join(f"{k}={v}" for k, v in sorted(report["settings"].items()))
    print(f"taskstore bench: n={report['n']} PostgreSQL {report['postgresql']} ({settings}) "
          f"(medians of {report['repeat']} runs; Python {report['python']}, "
          f"psycopg {report['psycopg']}, {report['cpus']} CPUs)")
    _print_table(pg.bench_table(report),
                 ("WORKLOAD", "TASKSTORE OPS/S", "RAW OPS/S", "RATIO", "TARGET", "MET"))
    return 0


def main(argv=None):
    """Run the benchmark the command line asks for; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.db is not None or args.start_postgres:
        if args.db is not None and not args.db.startswith(("postgresql://", "postgres://")):
            parser.error("--db takes a postgresql:// or postgres:// URL (the SQLite "
                         "benchmark runs on temporary files of its own)")
        return _main_postgres(parser, args)
    report = run_bench(n=args.n, sync=args.sync or "normal", only=args.workloads)
    if args.json:
        print(dumps(report))
        return 0
    print(f"taskstore bench: n={report['n']} sync={report['sync']} "
          f"(medians of {report['repeat']} runs; Python {report['python']}, "
          f"SQLite {report['sqlite']}, {report['cpus']} CPUs)")
    _print_table(bench_table(report),
                 ("WORKLOAD", "TASKSTORE OPS/S", "RAW OPS/S", "RATIO", "TASKSTORE CPU US/OP",
                  "RAW CPU US/OP", "TARGET", "MET"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
