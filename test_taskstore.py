"""Tests of taskstore.  Run: python3 -m unittest -v test_taskstore

Rules: standard library only (the interop classes import the official SDKs
and are skipped when they are missing); temporary directories only; tests
synchronise on facts (events, queues, lines a child prints, the store's
``wait``) and never on elapsed time; time rules run on a fake clock; every
blocking call has a timeout.
"""

import contextlib
import io
import json
import os
import queue
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import unittest

import taskstore
from taskstore import (CANCELLED, CANCELLING, FAILED, INPUT_REQUIRED, LOADING, QUEUED,
                       RUNNING, SUCCEEDED)

TIMEOUT = 10.0
HERE = os.path.dirname(os.path.abspath(__file__))
TASKSTORE_PY = os.path.join(HERE, "taskstore.py")


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


class StoreTestCase(unittest.TestCase):
    """A fresh store on a temporary file and a fake clock for every test."""

    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.dir = tmp.name
        self.path = os.path.join(self.dir, "tasks.db")
        self.clock = FakeClock()
        self.store = self.open_store()

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

    def test_get_of_unknown_id_raises_task_not_found(self):
        with self.assertRaises(taskstore.TaskNotFound) as cm:
            self.store.get("task_nope")
        self.assertEqual(str(cm.exception), "no task with id task_nope")

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

    def test_event_reads_use_the_index(self):
        plan = self.store._conn.execute(
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
        subprocess.run([sys.executable, "-c", script], check=True, timeout=TIMEOUT)
        self.assertEqual(out.get(timeout=TIMEOUT).status, CANCELLED)
        thread.join(TIMEOUT)

    def test_wait_times_out_with_the_current_task(self):
        task = self.store.create("k")
        self.assertEqual(self.store.wait(task.id, timeout=0.01, terminal=True).status, QUEUED)

    def test_close_wakes_waiters_and_later_calls_raise(self):
        task = self.store.create("k")
        started = threading.Event()
        out = queue.Queue()

        def waiter():
            started.set()
            try:
                self.store.wait(task.id, timeout=TIMEOUT, terminal=True)
            except taskstore.StoreClosed as exc:
                out.put(exc)

        thread = threading.Thread(target=waiter)
        thread.start()
        self.assertTrue(started.wait(TIMEOUT))
        # Wait until the waiter holds the condition: it then sits in wait().
        with self.store._lock:
            pass
        self.store.close()
        self.assertIsInstance(out.get(timeout=TIMEOUT), taskstore.StoreClosed)
        thread.join(TIMEOUT)
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


# ---------------------------------------------------------------------------
# Runner and handler context
# ---------------------------------------------------------------------------

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
        self.assertEqual(self.store._conn.execute("SELECT count(*) FROM processes").fetchone()[0], 0)


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
        self.assertEqual(store.reap()["events"], 6)
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
        self.store._conn.set_trace_callback(statements.append)
        counts = self.store.reap(batch_rows=300)
        self.store._conn.set_trace_callback(None)
        self.assertEqual(counts["tasks"], 1200)
        self.assertEqual(counts["events"], 2400)
        # 1,200 tasks at 300 per transaction: at least 4 transactions of tasks.
        self.assertGreaterEqual(statements.count("BEGIN IMMEDIATE"), 4 + 2)
        self.assertEqual(self.store.list(), ([], None))

    def test_a_long_event_log_is_reaped_in_slices(self):
        task = self.running_task(retention_ms=0)
        for i in range(1000):
            self.store.emit(task.id, "x")
        self.store.succeed(task.id, 1)
        counts = self.store.reap(batch_rows=300)
        self.assertEqual((counts["tasks"], counts["events"]), (1, 1003))

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


# ---------------------------------------------------------------------------
# Ownership, leases and recovery (in one process; kill -9 tests further down)
# ---------------------------------------------------------------------------

class OwnedTaskTestCase(StoreTestCase):
    """Helpers to make tasks owned by a runner registration, alive or dead."""

    _dead_pid = None

    def claimed(self, policy, owner, status=RUNNING, snapshot=None):
        task = self.store.create(f"k-{policy}-{status}", policy=policy)
        loading = (task.kind,) if status == LOADING else ()
        self.assertEqual(self.store._claim(owner, (task.kind,), loading).status,
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
            proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                                  capture_output=True, text=True, check=True, timeout=TIMEOUT)
            OwnedTaskTestCase._dead_pid = int(proc.stdout)
        pid = OwnedTaskTestCase._dead_pid
        owner = taskstore.new_id("proc", self.clock.ms)
        with self.store._writing():
            self.store._conn.execute(
                "INSERT INTO processes VALUES (?, ?, ?, ?, ?, ?)",
                (owner, pid, self.store._host, "1", self.clock.ms, self.clock.ms))
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

    def test_a_retried_task_runs_again_with_a_new_attempt(self):
        owner = self.dead_owner()
        task_id = self.claimed("retry", owner)
        self.store.recover()
        self.start_runner({self.store.get(task_id).kind: lambda ctx, p: ctx.attempt})
        self.assertEqual(self.finished(task_id).result, 2)
        self.assertContiguous(task_id)


# ---------------------------------------------------------------------------
# Races between the store's writers (issue 5, in one process)
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


class SqlParameterTests(StoreTestCase):
    """No caller-supplied text is ever formatted into SQL: it travels as parameters."""

    def test_user_text_never_appears_in_statement_text(self):
        marker = "ZQX'marker\"--"
        seen = []
        real = self.store._conn

        class Recording:
            def __getattr__(self, name):
                return getattr(real, name)

            def execute(self, sql, params=()):
                seen.append(sql)
                return real.execute(sql, params)

            def executemany(self, sql, params):
                seen.append(sql)
                return real.executemany(sql, params)

        self.store._conn = Recording()
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

    def test_migrations_bring_an_empty_file_to_the_current_version(self):
        with contextlib.closing(sqlite3.connect(self.path)) as conn:
            self.assertEqual(conn.execute("PRAGMA user_version").fetchone()[0],
                             taskstore.SCHEMA_VERSION)
            self.assertEqual(conn.execute("PRAGMA journal_mode").fetchone()[0], "wal")
            self.assertEqual(conn.execute("PRAGMA application_id").fetchone()[0],
                             taskstore.APPLICATION_ID)

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
        self.assertEqual(roomy._conn.execute("PRAGMA integrity_check").fetchone()[0], "ok")


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

    def test_sql_text_in_values_is_only_data(self):
        evil = "x'); DROP TABLE tasks; --"
        task = self.store.create(evil, {"q": evil}, principal=evil, meta={"m": evil})
        self.assertEqual(self.store.get(task.id, principal=evil).kind, evil)
        self.assertEqual(self.store.list(kind=evil, principal=evil)[0][0].id, task.id)


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
            out = subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True,
                                 text=True, timeout=TIMEOUT, check=True).stdout
            self.assertEqual(out.strip(), "1 []")

    def test_all_names_exist(self):
        for name in taskstore.__all__:
            self.assertTrue(hasattr(taskstore, name), name)

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


class AdminCommandTests(StoreTestCase):

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

# Scale knobs for slow or fast machines; the defaults are the numbers

RACE_ROUNDS = int(os.environ.get("TASKSTORE_TEST_RACE_ROUNDS", "1000"))
CLAIM_TASKS = int(os.environ.get("TASKSTORE_TEST_CLAIM_TASKS", "10000"))
IDEMPOTENT_KEYS = int(os.environ.get("TASKSTORE_TEST_IDEMPOTENT_KEYS", "200"))

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
with store._writing() as notices:
    now = store._now_ms()
    for task_id in ids:
        store._transition_locked(notices, task_id, taskstore.SUCCEED, now,
                                 fields={"result": taskstore.dumps({"blob": blob})})
    store._transition_locked(notices, queued, taskstore.CANCEL, now)
    say("in-transaction", json.dumps({"ids": ids, "queued": queued, "state": state,
                                      "wal": os.path.getsize(DB + "-wal")}))
    sys.stdin.readline()
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
# it can claim, and on ``stop`` prints the ids its handler ran.
CLAIM_SCRIPT = CHILD_PRELUDE + r"""
ran = []
lock = threading.Lock()

def record(ctx, payload):
    with lock:
        ran.append(ctx.task_id)
    return {"task": ctx.task_id, "pid": os.getpid()}

store = taskstore.TaskStore(DB, recover_on_open=False)
runner = taskstore.Runner(store, {"drain": record}, workers=2)
say("ready")
if sys.stdin.readline().strip() != "go":
    sys.exit("expected go")
runner.start()
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


class ChildProcess:
    """A ``python -c script`` child whose stdout lines are read with a timeout.

    The reader thread puts each line on a queue (None at end of file);
    ``close`` (registered with addCleanup) kills, reaps and joins everything.
    """

    def __init__(self, test, script, db, *args):
        self._stderr = tempfile.TemporaryFile("w+", encoding="utf-8")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, TASKSTORE_DIR, db, str(TIMEOUT), *map(str, args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
            encoding="utf-8")
        self.pid = self.proc.pid
        self._lines = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"child-{self.pid}-stdout",
                                        daemon=True)
        self._reader.start()
        test.addCleanup(self.close)

    def _read(self):
        with contextlib.suppress(ValueError, OSError):
            for line in self.proc.stdout:
                self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def stderr(self):
        self._stderr.seek(0)
        return self._stderr.read()[-3000:]

    def readline(self, timeout=TIMEOUT):
        """Return the child's next line; fail the test on timeout or end of output."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"child {self.pid} printed nothing for {timeout} s; "
                                 f"stderr:\n{self.stderr()}") from None
        if line is None:
            self._lines.put(None)
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
        lines = []
        while (line := self._lines.get(timeout=TIMEOUT)) is not None:
            lines.append(line)
        self._lines.put(None)
        return lines

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
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=TIMEOUT)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError, ValueError):
                stream.close()
        self._reader.join(TIMEOUT)
        self._stderr.close()


class MultiProcessTestCase(unittest.TestCase):
    """A temporary directory with one database file that children share."""

    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.path = os.path.join(tmp.name, "tasks.db")

    def open_store(self, **kwargs):
        kwargs.setdefault("poll_interval", 0.02)
        store = taskstore.TaskStore(self.path, **kwargs)
        self.addCleanup(store.close)
        return store

    def spawn(self, script, *args):
        return ChildProcess(self, script, self.path, *args)

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
class CrashRecoveryTests(MultiProcessTestCase):
    """kill -9 a child mid-task and mid-transaction, reopen the file, recover."""

    def crash_mid_task(self):
        """Run MID_TASK_SCRIPT until ``ready``, SIGKILL it, and return what it reported."""
        child = self.spawn(MID_TASK_SCRIPT)
        info = child.expect("ready")
        child.kill9(self)
        return info

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

    def test_kill_mid_transaction_leaves_the_state_before_it(self):
        count = 120
        child = self.spawn(MID_TRANSACTION_SCRIPT, count)
        info = child.expect("in-transaction")
        # The transaction outgrew the page cache, so its uncommitted pages are
        # already in the WAL file: the reopen must ignore them.
        self.assertGreater(info["wal"], 0)
        child.kill9(self)

        # The dead writer's lock is gone at once: a write with no busy wait.
        conn = sqlite3.connect(self.path, timeout=0, isolation_level=None)
        self.addCleanup(conn.close)
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        store = self.open_store(busy_timeout=0)
        self.assertEqual(store._conn.execute("PRAGMA integrity_check").fetchall(), [("ok",)])
        for task_id in info["ids"] + [info["queued"]]:
            self.assertEqual(self.dump(store, task_id), info["state"][task_id])
        self.assertEqual(store.get(info["ids"][0]).status, taskstore.RUNNING)
        self.assertEqual(store.get(info["queued"]).status, taskstore.QUEUED)
        self.assertEqual(self.sql("SELECT count(*) FROM events"), [(2 * count + 1,)])

        task = store.succeed(info["ids"][0], {"after": "crash"})
        self.assertEqual(task.status, taskstore.SUCCEEDED)
        self.assertEqual([e.seq for e in store.events(task.id)], [0, 1, 2])

    def test_kill_inside_raw_begin_immediate_leaves_the_state_before_it(self):
        child = self.spawn(RAW_TRANSACTION_SCRIPT)
        info = child.expect("in-transaction")
        child.kill9(self)

        conn = sqlite3.connect(self.path, timeout=0, isolation_level=None)
        self.addCleanup(conn.close)
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        store = self.open_store(busy_timeout=0)
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
        store._conn = PausingConnection(store._conn, "FROM processes", start_the_neighbour)
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

        class HookedStore(taskstore.TaskStore):
            def _open_schema(store, max_bytes):
                # Run the other process right after this one has read the
                # (still empty) file's application_id.
                real = store._conn
                store._conn = PausingConnection(real, "PRAGMA application_id",
                                                let_another_process_initialise_it)
                try:
                    return super()._open_schema(max_bytes)
                finally:
                    store._conn = real

        store = HookedStore(self.path, poll_interval=0.02)
        self.addCleanup(store.close)
        child = other["child"]
        child.finish(self)
        lines = [other["first"]] + child.remaining_lines()
        created = [line.split()[1] for line in lines if line.startswith("created ")]
        self.assertEqual(len(created), 1, lines)
        self.assertEqual(store.get(created[0]).kind, "first")
        self.assertEqual(store.create("second").status, taskstore.QUEUED)
        self.assertEqual(len(store.list()[0]), 2)


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
        self.assertGreaterEqual(sum(1 for part in ran if part), 2)   # it was a contest
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


if __name__ == "__main__":
    unittest.main()
