# SPDX-License-Identifier: MIT
"""taskstore: a durable task store in one file, standard library only.

Long-running work (a report, a CI run, a model generation) gets a life of its
own: the caller gets a task id at once, polls or streams its progress, fetches
the result later, can cancel it, and nothing is lost when the process crashes.
One state machine, on SQLite or on PostgreSQL, speaks two protocols: the
MCP "tasks" methods over stdio JSON-RPC and the LMSP 1.0 task routes over
HTTP with resumable server-sent events.

Theory of operation
-------------------
The file reads in three parts.  The kernel: the lifecycle tables, errors,
the data model, the ``Engine`` interface and the SQLite engine, the store,
the runner; a reader who stops there has met the whole machine.  The
fronts: the MCP server and the LMSP HTTP server.  The appendices: the
PostgreSQL engine, the task board page, the OpenAI backend, the terminal
watch and the command line.  Layers::

    stdio lines (MCP JSON-RPC)          HTTP requests (LMSP routes, SSE)
           |                                      |
      MCP server                            LMSP server      protocol vocabularies,
           \\                                    /             wire shapes, errors
            +----------- Runner ------------+                worker threads, handler
                            |                                context, leases
                        TaskStore                            the verbs and rules: transitions,
                            |                                events, retention, recovery
                     Engine (a class)                        the interface the store calls
                      /            \\
             SQLiteEngine        PostgresEngine              SQLite (the default, stdlib):
                                                             BEGIN IMMEDIATE, WAL, group commit,
               lifecycle tables                              pid liveness.  PostgreSQL (psycopg,
                                                             for a postgresql:// URL): SKIP LOCKED,
                                                             LISTEN/NOTIFY, leases in server time

One lifecycle, two vocabularies.  The store keeps one status set, the union
of what both protocols need; each front shows it in its own words through
one function (``mcp_status``, ``lmsp_status``)::

    queued --> loading --> running <--> input_required
      |           |           |  \\            |
      |           |           |   +--> succeeded / failed
      |           +-----------+------> cancelling --> cancelled
      +------------------------------> cancelled / failed

Every status change goes through ``TRANSITIONS`` (a literal dict) and one
compare-and-set ``UPDATE ... WHERE id=? AND status=?`` inside one write
transaction that also appends the task's event-log row.  Terminal states
never change: the first committed transition wins.

Threads.  A ``TaskStore`` owns its engine: one connection, one lock; after
every commit the writing thread wakes this process's waiters, and waiters
re-read the database every ``poll_interval`` to see other processes' writes
(on PostgreSQL, LISTEN/NOTIFY wakes them at once).  A ``Runner`` owns its
worker threads and one maintenance thread (heartbeat, coalesced progress,
cancel detection).  The optional reaper thread belongs to the store.
Nothing runs at import.

Run it::

    python3 taskstore.py http        # LMSP routes on 127.0.0.1:8765
    python3 taskstore.py mcp         # MCP server on stdin/stdout
    python3 taskstore.py tasks list  # inspect ./taskstore.db

Vendoring: copy this file; it needs only the standard library (Python 3.10+,
SQLite 3.31+).  Keep this header; bump only ``__version__``.
"""

__version__ = "0.1.0"
# The library.  The command line (main, build_parser, each command's parser and
# runner) is not in it: ``from taskstore import *`` in a notebook gets the store
# and the servers, not argparse plumbing.  pyproject.toml's console script names
# taskstore:main directly.
__all__ = [
    "TaskStore", "Task", "TaskSummary", "Event", "Runner", "TaskContext", "Reaper",
    "TaskStoreError", "InvalidParams", "InvalidCursor", "TaskNotFound", "TaskExpired",
    "InvalidTransition", "NotCancelable", "IdempotencyMismatch", "EventsExpired",
    "StoreClosed", "StoreUnavailable", "TaskFailed", "Cancelled", "Retry",
    "TRANSITIONS", "STATES", "TERMINAL_STATES", "CANCELLED_STATES", "POLICIES", "next_state",
    "FAILURE", "RERUNNABLE",
    "RESTART", "RESTART_KEEPS_SNAPSHOT", "LATE_OUTCOME", "LATE_RESULT_KEPT",
    "mcp_status", "lmsp_status", "to_jsonrpc_error", "to_problem", "problem_object",
    "fingerprint", "new_id", "is_task_id", "iso_time",
    "QUEUED", "LOADING", "RUNNING", "INPUT_REQUIRED", "CANCELLING", "SUCCEEDED",
    "FAILED", "CANCELLED",
    # Periodic tasks and metrics
    "Schedules", "Schedule", "Cron", "Metrics", "METRICS_PATH",
    # MCP server (section 9)
    "McpServer", "McpDispatcher", "McpWork", "McpTool", "ToolContext", "McpError",
    "ParseError", "InvalidRequest", "MethodNotFound", "ServerBusy", "add_demo_tools",
    "text_result", "mcp_task_to_wire", "check_arguments",
    "MCP_PROTOCOL_VERSION", "MCP_TASK_KIND", "RELATED_TASK",
    "mcp_task_to_modern_wire", "MissingClientCapability",
    "UnsupportedProtocolVersion", "MCP_MODERN_VERSION", "MCP_SUPPORTED_VERSIONS", "TASKS_EXTENSION",
    "ElicitationMismatch", "elicitation_problems",
    "MCP_CANCELLED_MESSAGE", "InputRequired", "McpInputRounds", "LOG_LEVELS",
    "MCP_REQUEST_STATE_TTL_MS",
    # LMSP HTTP server (section 10)
    "LMSPApp", "LMSPServer", "EventStream", "Reply", "ResponseOutput", "DemoBackend",
    "OpenAIBackend", "BackendError", "response_handler", "request_text", "demo_chunks", "task_object",
    "response_object", "lmsp_event", "task_error_problem", "parse_idempotency_key",
    "Unauthorized", "RouteNotFound", "MethodNotAllowed", "PayloadTooLarge", "UnsupportedMediaType", "UnsupportedCapability",
    "ServiceUnavailable", "Forbidden",
    # MCP over Streamable HTTP (section 10)
    "McpHttp", "McpStream", "HeaderMismatch", "NotAcceptable", "SessionNotFound", "MCP_PATH",
]

# =============================================================================
# 1. Imports
# =============================================================================
# Standard library only, one per line.  Globals with state: the logger (set up
# by the command line, never here) and _LIVE_PROCESS_IDS (section 6 says why).

import argparse
import base64
import contextlib
import datetime
import email.utils
import functools
import hashlib
import hmac
import http.client
import http.server
import io
import ipaddress
import itertools
import json
import logging
import math
import os
import queue
import random
import re
import secrets
import select
import shutil
import signal
import socket
import sqlite3
import stat
import sys
import threading
import time
import traceback
import typing
import urllib.parse

logger = logging.getLogger(__name__)

# =============================================================================
# 2. Constants
# =============================================================================
# Status and event names are plain strings: stored unchanged in SQLite and
# compared unchanged in code.  Defaults are the documented ones; every one of
# them is a constructor argument or a command-line option, never a setting.

QUEUED = "queued"
LOADING = "loading"
RUNNING = "running"
INPUT_REQUIRED = "input_required"
CANCELLING = "cancelling"
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"

# Events: the names of the moves.  Each public verb fires the event of its name.
CLAIM = "claim"                    # a runner takes a queued task
START = "start"                    # the work begins producing
REQUIRE_INPUT = "require_input"    # the work waits for the requestor
PROVIDE_INPUT = "provide_input"    # the requestor answered
SUCCEED = "succeed"
FAIL = "fail"
CANCEL = "cancel"
CONFIRM_CANCEL = "confirm_cancel"  # the work has stopped after a cancel
REQUEUE = "requeue"                # restart (retry / resume), or a failed attempt with more left
EVENTS = (CLAIM, START, REQUIRE_INPUT, PROVIDE_INPUT, SUCCEED, FAIL, CANCEL,
          CONFIRM_CANCEL, REQUEUE)

POLICIES = ("fail", "retry", "resume")

SCHEMA_VERSION = 6
APPLICATION_ID = 0x7A5C5701        # PRAGMA application_id: "this is a taskstore file"
# The page size of a new file (one made before keeps its own).  A lifecycle
# task dirties about ten pages in small commits, and SQLite copies and
# checksums each whole page into the WAL: at 2,048 bytes instead of the
# default 4,096 a lifecycle task takes 12 us less CPU (71 against 84 us,
# bench.py lifecycle, sync normal, 2 cores) and create 2-3 us less, for
# about 1 us more a task in bulk recovery and 0.3 us in reaping, and 2% more
# file.  At 1,024 recovery doubled.
PAGE_SIZE = 2048

DEFAULT_DB = "taskstore.db"
DEFAULT_BUSY_TIMEOUT_S = 10.0
DEFAULT_POLL_INTERVAL_S = 0.1
DEFAULT_LEASE_S = 30.0
DEFAULT_HEARTBEAT_S = 1.0
DEFAULT_PROGRESS_INTERVAL_S = 0.1
DEFAULT_REAP_INTERVAL_S = 60.0
DEFAULT_MAX_TTL_MS = 24 * 3600 * 1000
DEFAULT_TOMBSTONE_MS = 24 * 3600 * 1000
LATE_FINISH_GRACE_MS = 60 * 1000   # a task finishing after its TTL is kept this much longer
REAP_BATCH_ROWS = 500              # tasks one reap transaction may delete, at most
REAP_FIRST_BATCH = 50              # ... and the first one of a store (then it adapts)
REAP_BUDGET_MS = 25                # the most a reap batch's statements may take (see _reap)
RELEASE_BATCH = 2000               # tasks one recovery transaction may move, at most
PROMOTE_BATCH = 500                # delayed tasks one claim makes ready, at most
DEFAULT_PRIORITY = 0
# A retry policy's defaults (``Retry``): seconds, and a fraction of the delay.
DEFAULT_RETRY_BASE_S = 1.0
DEFAULT_RETRY_FACTOR = 2.0
DEFAULT_RETRY_CAP_S = 300.0
DEFAULT_RETRY_JITTER = 0.1

# =============================================================================
# 3. Lifecycle tables
# =============================================================================
# The whole lifecycle as data, decided here and nowhere else: which status
# change is legal (TRANSITIONS; a missing cell means "illegal"), which event
# recovery fires (RESTART), what a repeat cancel does (CANCELLED_STATES) and
# what becomes of an outcome reported late (LATE_OUTCOME).  The store
# (section 7) and the runner (section 8) apply them; the store enforces each
# move with a compare-and-set in the same transaction as the event row.  The
# README shows each table as the functions at the end of this section render it.

# fmt: off
#                   event            -> next state
TRANSITIONS = {
    QUEUED:         {CLAIM:          LOADING,
                     START:          RUNNING,
                     FAIL:           FAILED,
                     CANCEL:         CANCELLED},
    LOADING:        {START:          RUNNING,
                     FAIL:           FAILED,
                     CANCEL:         CANCELLING,
                     REQUEUE:        QUEUED},
    RUNNING:        {REQUIRE_INPUT:  INPUT_REQUIRED,
                     SUCCEED:        SUCCEEDED,
                     FAIL:           FAILED,
                     CANCEL:         CANCELLING,
                     REQUEUE:        QUEUED},
    INPUT_REQUIRED: {PROVIDE_INPUT:  RUNNING,
                     SUCCEED:        SUCCEEDED,
                     FAIL:           FAILED,
                     CANCEL:         CANCELLING,
                     REQUEUE:        QUEUED},
    CANCELLING:     {CONFIRM_CANCEL: CANCELLED},
    SUCCEEDED:      {},
    FAILED:         {},
    CANCELLED:      {},
}
# fmt: on
STATES = tuple(TRANSITIONS)
TERMINAL_STATES = frozenset(s for s, row in TRANSITIONS.items() if not row)
UNFINISHED_STATES = tuple(s for s in STATES if s not in TERMINAL_STATES)
ACTIVE_STATES = (LOADING, RUNNING, INPUT_REQUIRED, CANCELLING)  # owned by a runner

# Recovery: the event fired at an unfinished task whose process is gone, by
# its status and its restart policy (``create(policy=...)``).  None: the task
# stays queued and only loses its owner, for any runner to claim.  A cancel
# that was under way completes whatever the policy; ``fail`` fails even a
# queued task whose creator vouched for it (``create(owner=...)``), as a
# started one would; ``retry`` and ``resume`` queue the work again (``retry``
# from the beginning, ``resume`` from its last snapshot: RESTART_KEEPS_SNAPSHOT).
# fmt: off
#                   policy:  fail            retry           resume
RESTART = {
    QUEUED:         {"fail": FAIL,           "retry": None,           "resume": None},
    LOADING:        {"fail": FAIL,           "retry": REQUEUE,        "resume": REQUEUE},
    RUNNING:        {"fail": FAIL,           "retry": REQUEUE,        "resume": REQUEUE},
    INPUT_REQUIRED: {"fail": FAIL,           "retry": REQUEUE,        "resume": REQUEUE},
    CANCELLING:     {"fail": CONFIRM_CANCEL, "retry": CONFIRM_CANCEL, "resume": CONFIRM_CANCEL},
}
# fmt: on
# Whether a requeued task keeps the snapshot its last run saved, by policy.
RESTART_KEEPS_SNAPSHOT = {"retry": False, "resume": True}

# A failure: the event fired when a handler raises (or a worker calls
# ``fail(..., retryable=True)``), by whether the error allows a retry
# (``TaskFailed(..., retry=False)`` does not) and whether the task has
# attempts left under its retry policy (``create(retry=...)``, or the
# runner's default for its kind; none: one attempt).  A requeued task waits
# out its backoff queued, with a not-before time, and runs again as attempt
# + 1, from the beginning.  This is not RESTART: a crash and a failure are
# different events; both count attempts, and only a failure is bounded by
# ``max_attempts`` (a crash requeues under policy retry / resume as before).
# fmt: off
#                   attempts:        left            none left
FAILURE = {
    "retryable":    {"left":         REQUEUE,        "none left": FAIL},
    "no retry":     {"left":         FAIL,           "none left": FAIL},
}
# fmt: on

# Dead letters: the statuses a task may be run again from (``rerun``), as a
# new task that carries the next attempt number; the old one stays as it
# ended (a terminal status never changes).
RERUNNABLE = frozenset({FAILED})

# A repeat cancel: a task in one of these statuses was cancelled already, and
# a cancel changes nothing in the store.  It returns the task unchanged (LMSP:
# cancel is idempotent), or, for a caller that refuses repeats (MCP shows both
# as the terminal "cancelled"), is NotCancelable like a finished task.
CANCELLED_STATES = frozenset({CANCELLING, CANCELLED})

# A late outcome: the handler reported it (the event the runner fired: succeed,
# fail, or confirm_cancel when it stopped on its cancel signal), but the task
# had moved meanwhile.  Row: that outcome; column: the status found on a second
# read, same attempt; cell: the event fired instead.  A missing cell drops the
# outcome (the task finished or was requeued without us).  A cancel committed
# before the outcome wins; a success's value is kept as the cancelled task's
# partial result (LATE_RESULT_KEPT), never as a success.  A handler that says
# it was cancelled when nobody cancelled it has failed.
# fmt: off
#                   status found     -> event fired
LATE_OUTCOME = {
    SUCCEED:        {CANCELLING:     CONFIRM_CANCEL},
    FAIL:           {CANCELLING:     CONFIRM_CANCEL},
    CONFIRM_CANCEL: {LOADING:        FAIL,
                     RUNNING:        FAIL,
                     INPUT_REQUIRED: FAIL,
                     CANCELLING:     CONFIRM_CANCEL},
}
# fmt: on
LATE_RESULT_KEPT = frozenset({SUCCEED})


def next_state(task_id, state, event):
    """Return the status *event* moves a task in *state* to.

    Raises:
        InvalidTransition: the table has no cell for (state, event).
    """
    try:
        return TRANSITIONS[state][event]
    except KeyError:
        if event == CANCEL and (state in TERMINAL_STATES or state in CANCELLED_STATES):
            raise NotCancelable(task_id, state) from None
        raise InvalidTransition(task_id, state, event) from None


def _markdown_table(corner, columns, rows):
    """Render ``{row: {column: cell}}`` as a markdown table; a missing cell is ``-``."""
    lines = [f"| {corner} | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, row in rows.items():
        lines.append(f"| {name} | " + " | ".join(str(row.get(c) or "-") for c in columns) + " |")
    return "\n".join(lines)


def transition_table_markdown():
    """Render TRANSITIONS as the markdown table the README shows."""
    return _markdown_table("status", EVENTS, TRANSITIONS)


def restart_table_markdown():
    """Render RESTART (and RESTART_KEEPS_SNAPSHOT) as the markdown table the README shows."""
    rows = {status: {p: RESTART[status][p] or "stays queued" for p in POLICIES}
            for status in RESTART}
    rows["requeued, keeps its snapshot"] = {
        p: {True: "yes", False: "no"}.get(RESTART_KEEPS_SNAPSHOT.get(p)) for p in POLICIES}
    return _markdown_table("status \\ policy", POLICIES, rows)


def repeat_cancel_markdown():
    """Render what a cancel does in each status (TRANSITIONS and CANCELLED_STATES)."""
    columns = ("cancel", "cancel, repeats refused")
    rows = {}
    for status, row in TRANSITIONS.items():
        if CANCEL in row:
            rows[status] = dict.fromkeys(columns, f"-> {row[CANCEL]}")
        elif status in CANCELLED_STATES:
            rows[status] = {columns[0]: "unchanged", columns[1]: "NotCancelable"}
        else:
            rows[status] = dict.fromkeys(columns, "NotCancelable")
    return _markdown_table("status", columns, rows)


def late_outcome_markdown():
    """Render LATE_OUTCOME (and LATE_RESULT_KEPT) as the markdown table the README shows."""
    columns = [s for s in STATES if any(s in row for row in LATE_OUTCOME.values())]
    rows = {}
    for outcome, row in LATE_OUTCOME.items():
        kept = " (result kept)" if outcome in LATE_RESULT_KEPT else ""
        rows[outcome] = {s: row[s] + (kept if row[s] == CONFIRM_CANCEL else "")
                         for s in columns if s in row}
    return _markdown_table("outcome \\ found", columns, rows)


def failure_table_markdown():
    """Render FAILURE as a markdown table (the README's lifecycle tables show it)."""
    return _markdown_table("error \\ attempts", ("left", "none left"), FAILURE)


def lifecycle_tables_markdown():
    """Render the recovery, repeat-cancel, late-outcome and failure tables, each under a line."""
    return "\n\n".join((
        "What recovery fires for an unfinished task whose process is gone, by status and "
        "restart policy (`taskstore.RESTART`):", restart_table_markdown(),
        "What a cancel does, by status; a repeat cancel changes nothing in the store "
        "(`taskstore.CANCELLED_STATES`):", repeat_cancel_markdown(),
        "What the runner does with an outcome its handler reports after the task moved, by the "
        "status it finds (`taskstore.LATE_OUTCOME`); a missing cell drops the outcome:",
        late_outcome_markdown(),
        "What a handler's failure does, by whether its error may be retried and the attempts "
        "its retry policy leaves (`taskstore.FAILURE`; without a policy, none are left):",
        failure_table_markdown()))


# =============================================================================
# 4. Errors
# =============================================================================
# One exception tree.  Each class carries, as data, how every front end
# reports it: the LMSP code and HTTP status, the JSON-RPC code.  The two
# functions at the end of this section are the only readers of that data.
# Messages are part of the API; internal details (tracebacks, SQL) never go
# into them.

ECHO_CHARS = 80    # characters of an id or name from outside that an error message repeats


def _echo(text, limit=ECHO_CHARS):
    """Return *text*, an id or name from outside, fit to repeat inside an error message.

    Anything may arrive where an id belongs: non-ASCII, lone surrogates,
    control characters, megabytes.  Each character that is not printable
    ASCII is written as its Python escape (``\\xe9``, ``\\ud800``, ``\\n``),
    and what is shown stops at *limit* characters: one short printable line
    that every encoder, log and terminal takes as it is.
    """
    text = text if isinstance(text, str) else repr(text)
    if len(text) <= limit and text.isascii() and text.isprintable():
        return text
    shown, size = [], 0
    for char in text:
        if not (char.isascii() and char.isprintable()):
            char = char.encode("unicode_escape").decode("ascii")
        if size + len(char) > limit:
            return f"{''.join(shown)}... ({len(text)} characters)"
        shown.append(char)
        size += len(char)
    return "".join(shown)


class TaskStoreError(Exception):
    """Base class of every error this module raises on purpose.

    An instance may set ``jsonrpc_data`` (a dict): its keys are added to the
    JSON-RPC error's ``data`` (MCP's -32021 and -32022 need that).
    """

    code = "internal_error"
    http_status = 500
    jsonrpc_code = -32603
    param = None

    def __init__(self, message="internal error", *, param=None):
        super().__init__(message)
        if param is not None:
            self.param = param


class InvalidParams(TaskStoreError):
    """A caller passed a bad value; ``param`` names the field."""

    code = "invalid_request"
    http_status = 400
    jsonrpc_code = -32602


class InvalidCursor(InvalidParams):
    """A pagination or event cursor is not one this store issued."""

    def __init__(self, message="invalid cursor", *, param="cursor"):
        super().__init__(message, param=param)


class TaskNotFound(TaskStoreError):
    """No task with this id (or it belongs to another principal)."""

    code = "task_not_found"
    http_status = 404
    jsonrpc_code = -32602

    def __init__(self, task_id, message=None):
        super().__init__(message or f"no task with id {_echo(task_id)}")
        self.task_id = task_id


class TaskExpired(TaskNotFound):
    """The task existed but was deleted when its retention ended."""

    def __init__(self, task_id):
        super().__init__(task_id, f"task {_echo(task_id)} has expired")


class InvalidTransition(TaskStoreError):
    """The transition table has no cell for this (status, event) pair."""

    code = "invalid_transition"
    http_status = 409
    jsonrpc_code = -32602

    def __init__(self, task_id, state, event):
        super().__init__(f"cannot {event} task {task_id}: it is {state}")
        self.task_id, self.state, self.event = task_id, state, event


class NotCancelable(InvalidTransition):
    """Cancel of a task that already succeeded or failed (or, repeats refused, was cancelled)."""

    code = "task_not_cancelable"

    def __init__(self, task_id, state):
        TaskStoreError.__init__(
            self, f"cannot cancel task {task_id}: it is already {state}")
        self.task_id, self.state, self.event = task_id, state, CANCEL


class IdempotencyMismatch(TaskStoreError):
    """The idempotency key was used before with a different request."""

    code = "idempotency_key_reused"
    http_status = 422
    jsonrpc_code = -32602

    def __init__(self, key):
        super().__init__(f"idempotency key '{_echo(key)}' was already used with a different "
                         "request")
        self.key = key


class EventsExpired(TaskStoreError):
    """The requested events were pruned by event retention."""

    code = "event_history_expired"
    http_status = 410
    jsonrpc_code = -32602

    def __init__(self, task_id, first_seq):
        super().__init__(f"events of task {task_id} before {first_seq} are no longer kept")
        self.task_id, self.first_seq = task_id, first_seq


class StoreClosed(TaskStoreError):
    """The store was closed; no further calls are possible."""

    code = "service_unavailable"
    http_status = 503

    def __init__(self, message="the task store is closed"):
        super().__init__(message)


class StoreUnavailable(TaskStoreError):
    """The database file cannot be used: not ours, newer, read-only, full, locked."""

    code = "service_unavailable"
    http_status = 503


class MissingDependency(StoreUnavailable):
    """The database needs a package that is not installed (the message says how to add it)."""


class TaskFailed(Exception):
    """Raised by a handler to fail its task with a chosen error.

    ``error`` is a JSON object with at least ``code`` and ``message``;
    ``result`` is an optional JSON value stored with the failure (an MCP
    ``isError`` tool result, for example).
    """

    def __init__(self, error, result=None, *, retry=True):
        if isinstance(error, str):
            error = {"code": "task_failed", "message": error}
        super().__init__(error.get("message", "task failed"))
        self.error, self.result = error, result
        # False: fail at once, whatever attempts the retry policy has left.
        self.retry = bool(retry)


class Cancelled(Exception):
    """Raised inside a handler (by ``ctx.check()`` or ``ctx.ask()``) once its task is cancelled."""


_REASONS = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            405: "Method Not Allowed", 409: "Conflict", 410: "Gone",
            413: "Content Too Large", 415: "Unsupported Media Type",
            422: "Unprocessable Content", 500: "Internal Server Error",
            501: "Not Implemented", 503: "Service Unavailable"}


def _describe(exc):
    """Return (TaskStoreError class data, message) for any exception."""
    if isinstance(exc, TaskStoreError):
        return exc, str(exc)
    # Anything else is a bug: the caller logs the traceback, the client gets
    # a generic sentence and nothing of the exception's text.
    return TaskStoreError, "internal error"


def to_jsonrpc_error(exc):
    """Map an exception to a JSON-RPC error object ``{"code", "message", "data"}``."""
    info, message = _describe(exc)
    data = {"type": info.code}
    if info.param is not None:
        data["param"] = info.param
    data.update(getattr(info, "jsonrpc_data", None) or {})
    return {"code": info.jsonrpc_code, "message": message, "data": data}


def to_problem(exc):
    """Map an exception to ``(http_status, problem)``, an RFC 9457 problem object."""
    info, message = _describe(exc)
    return info.http_status, problem_object(info.http_status, info.code, message, info.param)


def problem_object(status, code, detail, param=None):
    """Build an RFC 9457 problem object with the LMSP ``code``."""
    body = {"type": "about:blank", "title": _REASONS.get(status, "Error"),
            "status": status, "code": code, "detail": detail}
    if param is not None:
        body["param"] = param
    return body


# =============================================================================
# 5. Data model
# =============================================================================
# Frozen value objects read from the database, the two status vocabularies,
# ids, cursors, JSON and time helpers, and parameter validation.  Nothing here
# touches the database.

# One lifecycle, two vocabularies: one stored status set, the union of what
# both protocols need.  These two dicts are the only place the protocols'
# words for a stored status are decided.
MCP_STATUS = {QUEUED: "working", LOADING: "working", RUNNING: "working",
              INPUT_REQUIRED: "input_required", CANCELLING: "cancelled",
              SUCCEEDED: "completed", FAILED: "failed", CANCELLED: "cancelled"}
LMSP_STATUS = {QUEUED: "queued", LOADING: "loading", RUNNING: "running",
               INPUT_REQUIRED: "running", CANCELLING: "cancelling",
               SUCCEEDED: "succeeded", FAILED: "failed", CANCELLED: "cancelled"}


def mcp_status(task):
    """Return the MCP word for a task's status (a Task or a stored status)."""
    return MCP_STATUS[getattr(task, "status", task)]


def lmsp_status(task):
    """Return the LMSP word for a task's status (a Task or a stored status)."""
    return LMSP_STATUS[getattr(task, "status", task)]


class Task(typing.NamedTuple):
    """One task as stored.  Times are epoch milliseconds from the store's clock.

    A named tuple: cheap to build (reads are on every request path) and
    immutable.  ``payload``, ``result``, ``error``, ``meta``,
    ``input_request`` and ``input_answer`` are decoded JSON.
    """

    id: str
    kind: str
    status: str
    payload: object
    result: object
    error: object
    status_message: object
    progress: object
    progress_total: object
    principal: object
    policy: str
    attempt: int
    ttl_ms: object
    retention_ms: object
    created_at: int
    updated_at: int
    finished_at: object
    purge_at: object
    owner: object
    last_seq: int
    first_seq: int
    version: int
    meta: dict
    input_request: object
    input_answer: object
    run_at: object           # not before this (epoch ms), or None: as soon as a worker is free
    priority: int            # higher first; then oldest first
    retry: object            # the retry policy (``Retry``'s fields as a dict), or None
    replayed: bool = False

    @property
    def max_attempts(self):
        """How many attempts a failure may use (1 without a retry policy)."""
        return 1 if self.retry is None else self.retry["max_attempts"]

    @property
    def terminal(self):
        """True once the task can never change again."""
        return self.status in TERMINAL_STATES

    def to_dict(self):
        """Return the task as a plain JSON-ready dict (the admin view)."""
        return self._asdict()


class TaskSummary(typing.NamedTuple):
    """A task without its payload, result, metadata and input: what a status poll needs.

    ``TaskStore.summary`` reads it.  Each field means what Task's field of
    the same name means; ``error`` is decoded.  A client polling a task asks
    for its status again and again, and reading and decoding the whole row
    for that was most of what answering it cost.
    """

    id: str
    kind: str
    status: str
    status_message: object
    progress: object
    progress_total: object
    error: object
    principal: object
    ttl_ms: object
    created_at: int
    updated_at: int
    finished_at: object
    last_seq: int
    version: int

    terminal = Task.terminal


class Event(typing.NamedTuple):
    """One row of a task's event log; ``seq`` counts from 0 without gaps.

    ``data_json`` is the event's data as stored (compact JSON text), and
    ``data`` decodes it on each access into a fresh value the caller may
    keep or change.  So reading a log costs what reading its rows costs, and
    a stream can send ``data_json`` as it is.
    """

    task_id: str
    seq: int
    type: str
    data_json: str
    created_at: int

    @property
    def data(self):
        """The event's data, decoded (a dict for every event the store writes)."""
        return _loads(self.data_json)


_TASK_COLUMNS = Task._fields[:-1]
_JSON_INDEXES = tuple(i for i, name in enumerate(_TASK_COLUMNS) if name in (
    "payload", "result", "error", "meta", "input_request", "input_answer", "retry"))
_SELECT_TASK = "SELECT " + ", ".join(_TASK_COLUMNS) + " FROM tasks"
_ERROR_INDEX = TaskSummary._fields.index("error")
_TASK_INDEX = {name: i for i, name in enumerate(_TASK_COLUMNS)}   # a Task's field -> position
(_STATUS_INDEX, _UPDATED_AT_INDEX, _LAST_SEQ_INDEX, _VERSION_INDEX, _FINISHED_AT_INDEX,
 _INPUT_REQUEST_INDEX, _PURGE_AT_INDEX, _RUN_AT_INDEX) = (_TASK_INDEX[name] for name in (
    "status", "updated_at", "last_seq", "version", "finished_at", "input_request", "purge_at",
    "run_at"))


def _task_from_row(row, replayed=False):
    # Unpacked by position (the order of _TASK_COLUMNS) and built with
    # tuple.__new__: this runs on every read, and the generic loop over the
    # JSON columns cost as much as the SELECT.
    (task_id, kind, status, payload, result, error, status_message, progress, progress_total,
     principal, policy, attempt, ttl_ms, retention_ms, created_at, updated_at, finished_at,
     purge_at, owner, last_seq, first_seq, version, meta, input_request, input_answer,
     run_at, priority, retry) = row
    return _new_tuple(Task, (
        task_id, kind, status,
        None if payload is None else _loads(payload),
        None if result is None else _loads(result),
        None if error is None else _loads(error),
        status_message, progress, progress_total, principal, policy, attempt, ttl_ms,
        retention_ms, created_at, updated_at, finished_at, purge_at, owner, last_seq,
        first_seq, version,
        {} if meta is None else _loads(meta),
        None if input_request is None else _loads(input_request),
        None if input_answer is None else _loads(input_answer),
        run_at, priority, None if retry is None else _loads(retry),
        replayed))


_new_tuple = tuple.__new__


def _queue_fields(task):
    """What a front shows of a task's place in the queue: ``{}`` for a plain task.

    ``run_at`` (epoch ms) while it waits for its time, ``attempt`` from
    its second (or with a retry policy) and ``max_attempts`` with a retry
    policy, ``priority`` when not the default.  Each front renames them.
    """
    fields = {}
    if task.run_at is not None and task.status == QUEUED:    # a cancelled one will never run
        fields["run_at"] = task.run_at
    if task.retry is not None:
        fields["attempt"], fields["max_attempts"] = task.attempt, task.max_attempts
    elif task.attempt > 1:
        fields["attempt"] = task.attempt
    if task.priority != DEFAULT_PRIORITY:
        fields["priority"] = task.priority
    return fields


def _summary_from_row(row):
    """A TaskSummary from its row (TaskSummary's columns, in order); only ``error`` is JSON."""
    if row[_ERROR_INDEX] is None:
        return _new_tuple(TaskSummary, row)
    row = list(row)
    row[_ERROR_INDEX] = _loads(row[_ERROR_INDEX])
    return _new_tuple(TaskSummary, row)

# One encoder for the whole module: json.dumps() with options builds a new one
# per call, and the hot paths serialise several values per operation.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_DECODER = json.JSONDecoder()


def _loads(text):
    """Decode JSON text this module stored (compact, from ``dumps``).

    ``raw_decode`` skips what ``json.loads`` checks for arbitrary input
    (type, leading and trailing whitespace): a third of the cost.  Never use
    it on input from outside.
    """
    return _DECODER.raw_decode(text)[0]


def dumps(value):
    """Serialise a JSON value compactly; NaN and infinities are refused."""
    return _ENCODER.encode(value)


def _storable(text, param):
    """Return *text* if SQLite can store it as UTF-8 (no lone surrogates), else raise."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidParams(f"{param} contains text that is not valid Unicode "
                                "(a lone surrogate)", param=param) from None
    return text


def _json_param(value, param):
    """Serialise *value* for storing, or raise InvalidParams naming *param*.

    Whatever the store keeps as JSON passes here, and is held to
    ``MAX_JSON_DEPTH``: how deep ``json`` can go depends on the Python
    version (3.13 writes 2,000 levels that 3.11 cannot read back).
    """
    try:
        text = _storable(dumps(value), param)
    except RecursionError:
        raise InvalidParams(f"{param} is nested deeper than {MAX_JSON_DEPTH} levels",
                            param=param) from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, InvalidParams):
            raise
        raise InvalidParams(f"{param} is not JSON-serialisable ({exc})", param=param) from None
    # As in _json_problem: MAX_JSON_DEPTH levels need as many brackets, so
    # the text usually proves the walk needless.
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH:
        problem = _json_problem(value)
        if problem is not None:
            raise InvalidParams(f"{param} {problem}", param=param)
    return text


# One nesting limit for all JSON: from outside (an MCP message, an LMSP body)
# and everything the store keeps (payloads, results, metadata, snapshots,
# events, input requests and answers).  A real value needs a handful of
# levels; deeper ones would meet a recursion limit that differs between Python
# versions, so a file written on one could not be read on another.
MAX_JSON_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


def _json_problem(value, limit=MAX_JSON_DEPTH, text=None):
    """Say what makes a JSON value unusable, or return None (an iterative walk).

    Deeper than *limit* levels, later code could hit the recursion limit; an
    unpaired surrogate (``"\\ud800"``) cannot be encoded, stored or echoed.
    *text*, the bytes *value* was decoded from, often proves there is
    nothing to find without the walk: in ASCII without NUL bytes (json
    reads UTF-16 and -32 too, and UTF-8 with surrogates passed through) a
    surrogate needs a ``\\u`` escape, and *limit* levels need as many brackets.
    """
    if text is not None and text.isascii() and b"\\u" not in text and b"\0" not in text \
            and text.count(b"{") + text.count(b"[") <= limit:
        return None
    # Level by level: one list.extend per container, no tuple per item.
    level, depth, strings = [value], 1, []
    while level:
        deeper = []
        for item in level:
            if isinstance(item, str):
                strings.append(item)
            elif isinstance(item, (dict, list, tuple)) and item:    # tuples: json's lists
                if depth > limit:
                    return f"is nested deeper than {limit} levels"
                if isinstance(item, dict):
                    strings.extend(item)
                    deeper.extend(item.values())
                else:
                    deeper.extend(item)
        level, depth = deeper, depth + 1
    # str(): a value the store is given may have keys json turns into text (1, None).
    if _SURROGATE.search("".join(map(str, strings))):
        return "holds an unpaired surrogate (a string escape \\ud800-\\udfff)"
    return None


def fingerprint(value):
    """SHA-256 of a JSON value serialised canonically (sorted keys, no spaces)."""
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    # surrogatepass: a lone surrogate still hashes, deterministically.
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


def iso_time(ms):
    """Format epoch milliseconds as an RFC 3339 UTC timestamp with milliseconds."""
    if ms is None:
        return None
    seconds, millis = divmod(int(ms), 1000)
    return f"{_iso_seconds(seconds)}.{millis:03d}Z"


@functools.lru_cache(maxsize=1024)
def _iso_seconds(seconds):
    # Cached: a task's two timestamps are formatted on every poll of it.
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_FROM_CROCKFORD = str.maketrans(_CROCKFORD, "0123456789abcdefghijklmnopqrstuv")
ID_RE = re.compile(r"\A[a-z][a-z0-9]{0,15}_[0-9A-HJKMNP-TV-Z]{36}\Z")


# Every pair of Crockford characters, indexed by the 10 bits they encode.
_CROCKFORD_PAIRS = tuple(a + b for a in _CROCKFORD for b in _CROCKFORD)


def _base32(number, length):
    """Encode a non-negative integer below 32**length as *length* (even) Crockford characters."""
    # Two characters per lookup: base64.b32encode is a Python loop too, and
    # this was a tenth of a create.
    return "".join([_CROCKFORD_PAIRS[(number >> shift) & 1023]
                    for shift in range(5 * length - 10, -1, -10)])


def new_id(prefix, now_ms):
    """Return ``prefix_`` + 36 characters: 48 bits of time, then 132 random bits.

    The time part (milliseconds) makes ids sort by creation, so keyset
    pagination is stable; the random bits come from ``secrets``, so an id
    cannot be guessed (the last 26 characters are 130 of them).  Crockford
    base 32 keeps the order of the bits in the order of the characters.
    """
    return prefix + "_" + _base32(((now_ms & (2**48 - 1)) << 132) | secrets.randbits(132), 36)


def is_task_id(value):
    """True when *value* has the shape of an id this module issues."""
    return isinstance(value, str) and ID_RE.match(value) is not None


def _encode_cursor(task_id):
    return base64.urlsafe_b64encode(dumps({"v": 1, "before": task_id}).encode()).decode().rstrip("=")


def _decode_cursor(cursor):
    if not isinstance(cursor, str) or not cursor or len(cursor) > 200:
        raise InvalidCursor()
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        data = json.loads(raw)
        before = data["before"]
    except (ValueError, TypeError, KeyError):
        raise InvalidCursor() from None
    if data.get("v") != 1 or not is_task_id(before):
        raise InvalidCursor()
    return before


def _check_int(value, param, minimum=0, allow_none=True, maximum=2**63 - 1):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise InvalidParams(f"{param} must be an integer from {minimum} to {maximum}",
                            param=param)
    return value


def _check_str(value, param, allow_none=True, max_len=1024):
    if value is None and allow_none:
        return None
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise InvalidParams(f"{param} must be a non-empty string of at most {max_len} characters",
                            param=param)
    return _storable(value, param)


def _as_tuple(value, param, allowed=None):
    if value is None:
        return None
    values = (value,) if isinstance(value, str) else tuple(dict.fromkeys(value))
    for v in values:
        if not isinstance(v, str) or (allowed is not None and v not in allowed):
            raise InvalidParams(f"unknown {param} {_echo(repr(v))}", param=param)
    return values


def _purge_at(now, created_at, ttl_ms, retention_ms):
    """When a task finishing at *now* may be purged: the one formula (SQL calls it too).

    MCP: expiry is createdAt + ttl, but a result that arrives after it stays
    fetchable for a grace period.  LMSP: retention counts from the terminal
    status.  Neither: kept until deleted.
    """
    if ttl_ms is not None:
        return created_at + ttl_ms if now < created_at + ttl_ms else now + LATE_FINISH_GRACE_MS
    if retention_ms is not None:
        return now + retention_ms
    return None


class Schedule(typing.NamedTuple):
    """A periodic task, as ``store.schedules.list()`` lists it.  Times are epoch ms."""

    name: str
    kind: str
    payload: object
    every_ms: typing.Optional[int]      # the fixed period, or None (then cron)
    cron: typing.Optional[str]          # the cron expression (UTC), or None
    paused: bool
    next_at: int                        # the start of the next period to fire
    last_due: typing.Optional[int]      # the period the last firing was for
    last_fired_at: typing.Optional[int]  # when it fired (minus last_due: its lag)
    last_task: typing.Optional[str]     # the task it created
    fired: int                          # periods fired so far
    created_at: int
    updated_at: int
    options: dict                       # create's options for its tasks (policy, ttl_ms, ...)


# The schedules table's columns, in Schedule's order (options is the JSON text).
_SCHEDULE_COLUMNS = Schedule._fields


class Retry(typing.NamedTuple):
    """A retry policy: how often a failing task runs, and how long it waits between runs.

    The wait before attempt n + 1 is ``min(cap, base * factor ** (n - 1))``
    seconds, less a random part of at most ``jitter`` of it (so that tasks
    that failed together do not all come back together).  ``create(retry=)``
    takes one (or a dict of its fields, or just ``max_attempts``); a
    ``Runner`` takes defaults per kind.
    """

    max_attempts: int
    base: float = DEFAULT_RETRY_BASE_S
    factor: float = DEFAULT_RETRY_FACTOR
    cap: float = DEFAULT_RETRY_CAP_S
    jitter: float = DEFAULT_RETRY_JITTER

    def delay_ms(self, attempt, rand=random.random):
        """The wait, in ms, after attempt *attempt* (from 1) failed."""
        delay = min(self.cap, self.base * self.factor ** min(attempt - 1, 64))
        return int(delay * (1.0 - self.jitter * rand()) * 1000)


def _number(value, param, minimum, maximum=1e9):
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not minimum <= value <= maximum:
        raise InvalidParams(f"{param} must be a number from {minimum} to {maximum:g}",
                            param=param)
    return float(value)


def _retry_param(value, param="retry"):
    """A ``Retry`` from what ``create(retry=)`` takes (Retry, dict, int), or None."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = {"max_attempts": value}
    elif isinstance(value, Retry):
        value = value._asdict()
    if not isinstance(value, dict):
        raise InvalidParams(f"{param} must be a retry policy (max_attempts, base, factor, cap, "
                            "jitter) or a number of attempts", param=param)
    unknown = set(value) - set(Retry._fields)
    if unknown:
        raise InvalidParams(f"{param} has no field {_echo(repr(sorted(unknown)[0]))}",
                            param=f"{param}.{sorted(unknown)[0]}")
    if "max_attempts" not in value:
        raise InvalidParams(f"{param}.max_attempts is required", param=f"{param}.max_attempts")
    _check_int(value["max_attempts"], f"{param}.max_attempts", minimum=1, allow_none=False,
               maximum=10_000)
    fields = {name: _number(value[name], f"{param}.{name}", low, high)
              for name, low, high in (("base", 0, 1e7), ("factor", 1, 100), ("cap", 0, 1e7),
                                      ("jitter", 0, 1)) if name in value}
    return Retry(value["max_attempts"], **fields)


def _time_param(value, param):
    """Epoch ms from a ``run_at``: epoch seconds (a number) or an RFC 3339 timestamp."""
    if isinstance(value, bool):
        value = None
    if isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value < 1e11:
        return int(value * 1000)
    if isinstance(value, str) and len(value) <= 64:
        text = value.strip()
        if text[-1:] in ("Z", "z"):
            text = text[:-1] + "+00:00"
        try:
            moment = datetime.datetime.fromisoformat(text)
        except ValueError:
            moment = None
        if moment is not None and moment.tzinfo is not None:
            return int(moment.timestamp() * 1000)
    raise InvalidParams(f"{param} must be epoch seconds or an RFC 3339 time with its offset "
                        f"(2026-12-03T15:00:00Z), not {_echo(repr(value))}", param=param)


def _not_before(now, run_at, delay):
    """``create``'s not-before time in epoch ms from *run_at* or *delay* (seconds), or None."""
    if run_at is not None and delay is not None:
        raise InvalidParams("give run_at or delay, not both", param="delay")
    if delay is not None:
        return now + int(_number(delay, "delay", 0, 1e9) * 1000)
    if run_at is not None:
        return _time_param(run_at, "run_at")
    return None


# =============================================================================
# 6. Engines: the interface, and SQLite
# =============================================================================
# Rules:
# - Everything that is SQLite's lives here: the connection and its lock, the
#   schema and its migrations, ``BEGIN IMMEDIATE`` transactions, group
#   commit, WAL checkpoints, bulk jobs, and whether a process on this host is
#   alive.  The store (section 7) decides; the engine reads and writes what
#   it is told, and decides nothing about the lifecycle.
# - The store calls an engine only through ``Engine``, the interface written
#   as a class: every method, its signature, what it returns and what it
#   expects held.  ``SQLiteEngine`` and the PostgreSQL engine (section 11)
#   both implement it, siblings; a test holds them and the store to it.
# - SQL both engines run is written once, in ``_SqlEngine`` and its
#   ``_Statements``, and the schema in ``SCHEMA``: the few words the two
#   databases say differently (the placeholder, locking clauses, the upsert,
#   the clock; column types) come from each engine's ``_Dialect`` and
#   ``_SchemaWords``.  Nothing of SQLite's is inherited by PostgreSQL.
# - An engine is built with ``(path, synchronous=, busy_timeout=, max_bytes=,
#   readonly=)`` and raises StoreUnavailable when the database cannot serve.
#   ``open_engine``, at the end of this section, picks the engine for a path
#   or URL: the only place the kernel names the PostgreSQL engine.


class Registration(typing.NamedTuple):
    """A process registration, as ``Engine.processes()`` gives it on every engine.

    Each engine fills the field its liveness rule reads (``owner_dead``)
    and leaves the other None: SQLite has no clock of its own, PostgreSQL
    cannot see another host's pids.
    """

    id: str                  # the registration's id (a task's owner)
    pid: int
    host: str
    proc_start: typing.Optional[str]   # the pid's start time on its host (SQLite), or None
    heartbeat_at: int        # epoch ms of the last heartbeat, by the clock that wrote it
    age_ms: typing.Optional[int]       # ms since, by the database's clock (PostgreSQL), or None


class Engine:
    """What the store (section 7) calls on a database: the whole seam, in code.

    The store decides; an engine reads and writes what it is told.  Times
    (``now``) are epoch milliseconds.  Rows are plain tuples in the column
    order each method names, the same on every engine.

    Attributes (the store reads the first four):
        lock: the ``threading.Lock`` that guards the engine.  Methods
            whose names end in ``_locked`` and every data method below
            expect it held, and data methods that write run inside a body
            given to ``write`` (which holds it and opens the transaction),
            unless a method says otherwise.
        readonly: whether the database was opened for reading only (every
            write raises StoreUnavailable).
        shared: whether other hosts share the database; then a live
            process also recovers dead ones' tasks with every heartbeat.
        moves_unread: whether ``move_unread`` saves anything (a round
            trip): then the store tries it where a caller vouches for a
            task's status.
        path: the database's name for messages (a URL without its password).

    A selector (``owner_batch``) is the engine's own description of a set
    of tasks; the store passes it back unread.
    """

    lock = None
    readonly = False
    shared = False
    moves_unread = False
    path = None

    # -- transactions ----------------------------------------------------------

    def transaction(self):
        """Context for one write transaction (lock held): committed on exit, or rolled back.

        Raises StoreClosed once ``shut()``, StoreUnavailable for a database
        error.  Transactions never nest.
        """
        raise NotImplementedError

    def reading(self):
        """Context that takes the lock for reads; yields the engine.

        Raises StoreClosed once ``shut()``; a database error inside becomes
        StoreUnavailable.
        """
        raise NotImplementedError

    def shut(self):
        """Refuse new work (lock held): ``transaction()`` and ``reading()`` raise StoreClosed."""
        raise NotImplementedError

    def write(self, body):
        """Run ``body()`` in a write transaction, the lock held; return its result once committed.

        Other threads' bodies may share the transaction and its commit
        (group commit, the engine's own business); a body's error is raised
        here, and its own writes are never committed half-done.  The body
        runs the engine's data methods and nothing that waits for another
        thread.  An engine may run a body again when the database broke its
        uncommitted transaction off (PostgreSQL, for a deadlock), so a body
        leaves no trace outside the database before ``write`` returns.
        Called without the lock.
        """
        raise NotImplementedError

    def changes(self):
        """Rows written on the engine's connection so far: did a body write anything? (write's)"""
        raise NotImplementedError

    def bulk(self):
        """Context for a long job of many transactions (reap, recovery); takes the lock itself."""
        raise NotImplementedError

    def checkpoint(self):
        """Copy the log into the database file now (lock held); ``(log pages, copied pages)``."""
        raise NotImplementedError

    def close(self):
        """Stop the engine's threads and close the connection (the caller stopped all writers)."""
        raise NotImplementedError

    def on_remote(self, callback):
        """Call ``callback(kind, ids)`` for other processes' commits, from now on.

        Kinds: ``changed``, ``queued``, ``delayed`` (queued with a
        not-before time), ``cancelling``, ``schedules`` (a schedule changed;
        no ids), and ``lost`` (news may have been missed: re-read
        everything).  An engine with no such
        news (SQLite) never calls it: its waiters poll.  Called once, at open.
        """
        raise NotImplementedError

    # -- tasks -----------------------------------------------------------------

    def read_task(self, task_id):
        """The Task, or None.  In a write transaction, its row is the caller's until commit."""
        raise NotImplementedError

    def task_row_at(self, task_id, now, summary=False):
        """The task's row (``Task``'s or ``TaskSummary``'s columns), then ``expired``; or None.

        ``expired``, the last column, is 1 if the task had expired at *now*, else 0.
        """
        raise NotImplementedError

    def tombstoned(self, task_id):
        """Whether *task_id* names a task that was purged (its tombstone has not expired)."""
        raise NotImplementedError

    def insert_tasks(self, rows, events):
        """Insert new tasks and the ``created`` events the log stores.

        *rows*: ``(id, kind, status, payload, status_message, principal,
        policy, ttl_ms, retention_ms, created_at, updated_at, meta, owner)``,
        each followed by ``(run_at, priority, retry, attempt)`` unless every
        row is plain; *events*: ``(task_id, data, created_at)``, one for each
        task that is not plain (a plain task's is its row: schema 5), so
        often none.
        """
        raise NotImplementedError

    def move_task(self, task_id, status, values, event_json, now):
        """Compare-and-set one task from *status* to the columns *values*; append its status event.

        ``values["last_seq"]`` is the event's seq; *event_json* None: the
        log stores no event (the row is the event: schema 6).  Returns
        whether the task was in *status* (False: nothing was written).
        """
        raise NotImplementedError

    def move_unread(self, task_id, status, values, event_json, now, attempt):
        """``move_task`` without the row read first: the row as written, or None.

        The compare-and-set is the same, guarded by *attempt* too unless it
        is None; the engine counts the seq (``last_seq + 1``) and, when
        *values* end the task (``finished_at``), its ``purge_at`` from the
        row, by the one formula.  Returns the row as written (``Task``'s
        columns), or None when the task was not in *status* (nothing was
        written); an engine without ``moves_unread`` returns None at once.
        On None the caller reads the task and moves it as always.
        """
        raise NotImplementedError

    def move_tasks(self, selector, status, values, event_json, now, *, ids=False, policy=None,
                   bump_attempt=False, finish=False):
        """Set-based ``move_task``: every task of *selector* in *status*; ``(moved, ids or None)``.

        *ids*: also return the moved ids.  *policy*: only the tasks with
        that restart policy.  *bump_attempt*: count a new attempt.
        *finish*: the move ends the tasks (``finished_at``, ``purge_at`` by
        the one formula, no input request).  ``moved`` is -1 if the tasks
        changed under the transaction (it cannot happen; the caller raises).
        """
        raise NotImplementedError

    def restart_groups(self, selector):
        """``[(status, policy, count)]`` of *selector*'s tasks."""
        raise NotImplementedError

    def disown(self, selector, statuses):
        """Clear the owner of *selector*'s tasks in *statuses*."""
        raise NotImplementedError

    def list_tasks(self, now, statuses, kinds, principal, before, limit, error_code=None):
        """Rows (``Task``'s columns) of unexpired tasks, newest first, ids below *before*.

        *statuses*, *kinds*: None for any; *principal*, *error_code* (the
        code in the task's error, compared as text): None for any.
        """
        raise NotImplementedError

    def event_bounds(self, task_id, now):
        """``(principal, last_seq, first_seq, expired, kind, created_at, status, finished_at)``
        at *now*, or None."""
        raise NotImplementedError

    def read_events(self, task_id, start, limit):
        """``[(seq, type, data, created_at)]`` from seq *start* on, at most *limit* (None: all)."""
        raise NotImplementedError

    def tasks_past(self, last_seqs):
        """``{task_id: Task or None}`` of the tasks whose ``last_seq`` is past *last_seqs*'s.

        None: the task no longer exists.  Takes the lock (``reading()``),
        500 ids at a time, so that a long list never holds up writers.
        """
        raise NotImplementedError

    def load_snapshot(self, task_id):
        """``(True, snapshot text or None)`` for a task, ``(False, None)`` when there is none."""
        raise NotImplementedError

    def set_progress(self, task_id, values, statuses, attempt, now):
        """Write the columns *values* if the task is in *statuses* (and *attempt*); if it was."""
        raise NotImplementedError

    def event_head(self, task_id):
        """``(status, last_seq, attempt)``, or None.

        In a write transaction, the row is the caller's until commit.
        """
        raise NotImplementedError

    def append_event(self, task_id, seq, etype, data_json, snapshot_json, now):
        """Append event *seq*, now the task's ``last_seq`` (and *snapshot_json* its snapshot)."""
        raise NotImplementedError

    def save_snapshot(self, task_id, snapshot_json, statuses, attempt):
        """Write the task's snapshot if it is in *statuses* (and *attempt*); whether it was."""
        raise NotImplementedError

    def may_have_queued(self, kinds, gen):
        """Whether a queued task of *kinds* may exist; takes the lock itself, never the write lock.

        *gen* is the store's count of work queued in its process: unchanged
        since ``oldest_queued`` last found none, a cheap read answers.
        """
        raise NotImplementedError

    def oldest_queued(self, kinds, gen):
        """``(Task, limit)``: the next ready task of *kinds* this transaction may claim, or None.

        Next: the highest priority, then the oldest.  *limit* is the most
        tasks of its kind that may run at once (``kind_limits``), or None.
        When there is none, notes *gen* (unless None).
        """
        raise NotImplementedError

    def running_of_kind(self, kind):
        """``(running, limit)``: the tasks of *kind* claimed and unfinished, and its limit now.

        Called in a claim's transaction; where other processes claim at the
        same time (PostgreSQL) it locks the kind's limit first, so that two
        claims of a limited kind count one after the other.
        """
        raise NotImplementedError

    def promote_due(self, now, limit):
        """Make up to *limit* delayed tasks due at *now* ready (``run_at`` NULL); how many."""
        raise NotImplementedError

    def next_due(self):
        """The earliest not-before time (epoch ms) of a delayed queued task, or None.  Reads."""
        raise NotImplementedError

    def set_kind_limit(self, kind, max_running, now):
        """Store (or with None, remove) the most tasks of *kind* that may run at once."""
        raise NotImplementedError

    def kind_limits(self):
        """``{kind: max_running}`` of every limit stored.  Reads."""
        raise NotImplementedError

    def idempotency_get(self, scope, key):
        """``(fingerprint, task_id, expires_at)`` of a key, or None.

        In a write transaction, a second writer of the same key waits here
        until the first commits.
        """
        raise NotImplementedError

    def idempotency_put(self, scope, key, fingerprint, task_id, now, expires_at):
        """Record a key (replacing an expired one)."""
        raise NotImplementedError

    def secret(self, name, make, now):
        """The value of the store's secret *name*; in a write, made with ``make()`` if absent."""
        raise NotImplementedError

    # -- processes -------------------------------------------------------------

    def register(self, proc_id, now):
        """Register this process as *proc_id*, its heartbeat at *now* (or the database's clock)."""
        raise NotImplementedError

    def heartbeat(self, proc_id, now):
        """Renew the registration; False when it is gone."""
        raise NotImplementedError

    def unregister(self, proc_id):
        """Delete the registration."""
        raise NotImplementedError

    def processes(self):
        """``{proc_id: Registration}`` of every registered process."""
        raise NotImplementedError

    def recovery_view(self, now, lease_ms):
        """``(processes(), {dead owner: [(status, policy)]})``, read in one snapshot.

        The dead owners (``owner_dead`` at *now*) are the registered ones and
        the owners named by unfinished tasks; each maps to the distinct
        ``(status, policy)`` pairs of its unfinished tasks (none: a dead
        registration holding nothing).  What this reads grows with the
        processes and the work in flight, never with the tasks kept.
        """
        raise NotImplementedError

    def cancelling_of(self, owner):
        """The set of ids of the owner's cancelling tasks."""
        raise NotImplementedError

    def owner_batch(self, owner, after, size, statuses):
        """``(selector, last id or None)``: the owner's next *size* unfinished tasks after *after*.

        The selector holds those of them in *statuses*; None as the last
        id: this was the last batch.
        """
        raise NotImplementedError

    @staticmethod
    def owner_dead(proc, now, lease_ms):
        """Whether the ``Registration`` *proc* (or None: nobody registered) is dead at *now*.

        Dead: unregistered, its lease expired, or (where the engine can
        tell) its process is gone.  A registration of this very process is
        alive while a runner holds it (``_LIVE_PROCESS_IDS``).  Needs no lock.
        """
        raise NotImplementedError

    # -- retention -------------------------------------------------------------

    def reap_tasks_once(self, now, budget, counts, tombstone_ms, since=None):
        """Delete a batch of expired tasks and their events, leaving tombstones.

        A batch is at most *budget* tasks and ``10 * budget`` event rows (a
        longer log goes in slices); *counts* ``["tasks"]`` and ``["events"]``
        grow by what was deleted.  Returns ``(more, ids, reached)``: whether
        there may be more, the ids deleted, and the ``purge_at`` the batch
        reached, which the pass's next batch gets as *since* (None for the
        first): every task due before it is gone, or another reaper's.
        """
        raise NotImplementedError

    def prune_events_once(self, finished_before, budget, counts, since=None):
        """Prune one batch of events of tasks finished by *finished_before*: ``(more, reached)``.

        A batch takes at most *budget* steps of a walk of the tasks that
        still have events, in id order, from the id *since* (None: the
        first), and deletes at most ``10 * budget`` event rows; *counts*
        ``["events"]`` grows by them.  *reached* is where the pass's next
        batch starts (the *since* it gets).  A pass reads what it prunes,
        not what was pruned before.
        """
        raise NotImplementedError

    def delete_expired(self, table, now, limit):
        """Drop up to *limit* expired rows of ``idempotency`` or ``tombstones``; how many."""
        raise NotImplementedError

    # -- schedules and metrics -------------------------------------------------

    def schedule_rows(self, name):
        """Rows (``Schedule``'s columns) of schedule *name*, or of all (None) by name."""
        raise NotImplementedError

    def schedule_put(self, row):
        """Insert schedule *row* (``Schedule``'s columns), replacing one of the same name."""
        raise NotImplementedError

    def schedule_update(self, name, values, next_at):
        """Set the columns *values* of schedule *name*; whether it was there.

        *next_at*: only while its ``next_at`` is that (the compare-and-set
        of a firing), unless None.
        """
        raise NotImplementedError

    def schedule_delete(self, name):
        """Delete schedule *name*; whether it was there."""
        raise NotImplementedError

    def schedules_due(self, now, limit):
        """Rows (``Schedule``'s columns) of unpaused schedules due at *now*, soonest first."""
        raise NotImplementedError

    def next_schedule_at(self):
        """The earliest ``next_at`` of the unpaused schedules, or None."""
        raise NotImplementedError

    def unfinished_counts(self):
        """``[(kind, status, count, oldest created_at)]`` of the unfinished tasks.

        Read through the partial indexes of queued tasks and of the work in
        flight: the cost grows with the tasks waiting and running, never
        with the finished ones kept.
        """
        raise NotImplementedError


# Tunables of the write path (section 2 holds the documented defaults).
# Rows written between background checkpoints (~1,800 WAL pages).  Every
# checkpoint syncs the WAL and the file whatever it copies, and a lifecycle
# task rewrites the same few hot pages: 1,000 rows instead of 500 measured
# 4.6 us less CPU per lifecycle task (84.9 against 89.5, 5 runs each, two
# passes) at the same throughput, and the largest WAL about the same (4,800
# pages against 4,500: the backstop below bounds it either way).
CHECKPOINT_ROWS = 1000
WAL_BACKSTOP_PAGES = 4000          # SQLite's own inline checkpoint, if the background one lags
CHECKPOINT_TAIL_PAGES = 64         # at most this much is left for the checkpoint under the lock
WAL_KEEP_BYTES = 32 * 1024 * 1024  # the WAL file is cut back to this when it restarts
GROUP_ROUNDS = 8                   # transactions a group-commit leader runs before handing over
GROUP_DELAY_S = 0.002              # longest a leader waits for company, only under contention


def _one_of(column, values):
    # "a = 'x' OR a = 'y'", not "a IN ('x', 'y')": SQLite builds a temporary
    # table for an IN list on every INSERT and UPDATE that checks it, which
    # made the CHECK cost more than the rest of the INSERT.
    return " OR ".join(f"{column} = '{value}'" for value in values)


class _SchemaWords(typing.NamedTuple):
    """The words one database spells its own way in ``SCHEMA``'s statements.

    Everything else in the schema (tables, columns, keys, defaults, checks,
    indexes and their WHERE clauses) is the same text on every engine.
    """

    text: str             # a string column; ids must sort by bytes (ORDER BY id: creation order)
    integer: str          # a 64-bit integer column
    real: str             # a double-precision column
    without_rowid: str    # ends a CREATE TABLE whose primary key is how the rows are stored


# The schema, written once for both engines: SCHEMA[n] takes a database from
# version n-1 to n.  Each engine renders it with its words (_schema_ddl): this
# section's _SQLITE_WORDS give MIGRATIONS, section 11's give PG_MIGRATIONS.
# {statuses} and {policies} are the CHECKs' lists, the same on both.  SQLite
# keeps the text of each CREATE in sqlite_master, so SQLite's words must
# render these statements byte for byte as earlier versions wrote them
# (hence a lone {without_rowid} is indented one space short: SQLite's word
# starts with one).  A released version's statements never change; a
# change is a new version.
SCHEMA = {
    1: (
        # WITHOUT ROWID: the id is the table's key, so a create writes one
        # B-tree for the row instead of a rowid table plus an id index.
        """CREATE TABLE tasks (
        id {text} PRIMARY KEY,
        kind {text} NOT NULL,
        status {text} NOT NULL CHECK ({statuses}),
        payload {text}, result {text}, error {text}, status_message {text},
        progress {real}, progress_total {real},
        principal {text},
        policy {text} NOT NULL CHECK ({policies}),
        attempt {integer} NOT NULL DEFAULT 1,
        ttl_ms {integer}, retention_ms {integer},
        created_at {integer} NOT NULL, updated_at {integer} NOT NULL,
        finished_at {integer}, purge_at {integer},
        owner {text},
        last_seq {integer} NOT NULL DEFAULT 0,
        first_seq {integer} NOT NULL DEFAULT 0,
        version {integer} NOT NULL DEFAULT 0,
        meta {text}, input_request {text}, input_answer {text}, snapshot {text}){without_rowid}""",
        # Partial indexes: only the rows a query looks for pay for an index entry.
        "CREATE INDEX tasks_queue ON tasks (kind, id) WHERE status = 'queued'",
        "CREATE INDEX tasks_principal ON tasks (principal, id) WHERE principal IS NOT NULL",
        "CREATE INDEX tasks_owner ON tasks (owner) WHERE owner IS NOT NULL",
        "CREATE INDEX tasks_purge ON tasks (purge_at) WHERE purge_at IS NOT NULL",
        """CREATE TABLE events (
        task_id {text} NOT NULL, seq {integer} NOT NULL, type {text} NOT NULL,
        data {text} NOT NULL, created_at {integer} NOT NULL,
        PRIMARY KEY (task_id, seq)){without_rowid}""",
        """CREATE TABLE idempotency (
        scope {text} NOT NULL, key {text} NOT NULL, fingerprint {text} NOT NULL,
        task_id {text} NOT NULL, created_at {integer} NOT NULL, expires_at {integer},
        PRIMARY KEY (scope, key)){without_rowid}""",
        "CREATE INDEX idempotency_expiry ON idempotency (expires_at) WHERE expires_at IS NOT NULL",
        """CREATE TABLE tombstones (
        id {text} PRIMARY KEY, deleted_at {integer} NOT NULL, expires_at {integer} NOT NULL)
       {without_rowid}""",
        "CREATE INDEX tombstones_expiry ON tombstones (expires_at)",
        """CREATE TABLE processes (
        id {text} PRIMARY KEY, pid {integer} NOT NULL, host {text} NOT NULL,
        proc_start {text}, started_at {integer} NOT NULL, heartbeat_at {integer} NOT NULL)
       {without_rowid}""",
    ),
    # Version 2: an owner's cancelling tasks, found without reading its history.
    # Each runner asks with every heartbeat (cancelling_of), and through
    # tasks_owner that read every task the owner had run that the store still
    # keeps (a day's worth by default), under the lock.  This index holds
    # cancelling tasks only: a claim or a finish never writes to it.
    2: ("CREATE INDEX tasks_cancelling ON tasks (owner) WHERE status = 'cancelling'",),
    # Version 3: no read grows with the tasks kept.  tasks_owner held every
    # task any owner had run that the store still keeps (a day's worth by
    # default), and recovery read all of it to learn which owners hold
    # unfinished work: 572 ms at a million finished tasks, with every
    # reaper pass and, on PostgreSQL, every heartbeat.  tasks_active holds
    # the work in flight and nothing else ({active}, _ACTIVE below): a task
    # enters it when claimed or started and leaves it when it finishes.
    # Recovery finds owners there, the heartbeat's cancel check an owner's
    # cancelling tasks (so tasks_cancelling goes), and list a status in
    # flight.  tasks_unsuccessful lets list find failed and cancelled tasks
    # among a million succeeded ones; only a task that ends so writes to it.
    # Queries use a partial index only when their WHERE repeats its
    # condition: both databases prove it usable from the query's own terms.
    3: ("DROP INDEX tasks_owner",
        "DROP INDEX tasks_cancelling",
        "CREATE INDEX tasks_active ON tasks (owner, id) WHERE {active}",
        "CREATE INDEX tasks_unsuccessful ON tasks (id) WHERE {unsuccessful}"),
    # Version 4: delays, priorities, retries and limits per kind.  A queued
    # task with a not-before time (run_at) waits in tasks_delayed, ordered by
    # that time, until a claim finds it due and makes it ready (run_at NULL);
    # the ready ones wait in tasks_ready, which a claim reads in its order:
    # by kind, higher priority first, then oldest.  Only a queued task has a
    # run_at (a task leaving the queue drops it: _transition_locked,
    # _Recovery), so tasks_delayed's condition needs no status, which every
    # status change would evaluate: 14 of SQLite's steps per lifecycle task.
    # A plain task (no delay, no retry policy, the default priority) costs
    # what it cost in version 3: one entry in the queue index, the new
    # columns at their defaults.
    # kind_limits holds the most tasks of a kind that may run at once; a
    # claim of a limited kind locks its row and counts.
    # And every filter of list walks an index of its own, newest
    # first, and stops at its page: a kind in tasks_kind (one entry a task,
    # written at create and never moved; a create appends at its kind's
    # end: kept newest first, 0.6 more WAL frames a create went to
    # splitting the kind's first page), a finished status
    # in tasks_finished (one entry a task, written when it finishes; it takes
    # over tasks_unsuccessful's job).  Before, a filter by kind or by
    # "succeeded" walked every task newer than its matches: 1,000 times the
    # empty store's time for a rare kind among a million tasks kept, and 68
    # times for "succeeded" behind 100,000 queued tasks.
    # secrets: keys the store keeps for its fronts, made once and shared by
    # every process and replica on the database.  MCP signs the requestState
    # of its input rounds with one ("mcp.request_state"), so any replica can
    # verify a state another issued.  Never shown, never rotated by the store.
    # schedules: periodic tasks (Schedules.add).  One row per schedule;
    # next_at is the start of the next period to fire, and schedules_due
    # finds the due ones, and the next time a runner wakes, without reading
    # paused schedules.
    4: ("ALTER TABLE tasks ADD COLUMN run_at {integer}",
        "ALTER TABLE tasks ADD COLUMN priority {integer} NOT NULL DEFAULT 0",
        "ALTER TABLE tasks ADD COLUMN retry {text}",
        "DROP INDEX tasks_queue",
        "CREATE INDEX tasks_ready ON tasks (kind, priority DESC, id) "
        "WHERE status = 'queued' AND run_at IS NULL",
        "CREATE INDEX tasks_delayed ON tasks (run_at) WHERE run_at IS NOT NULL",
        """CREATE TABLE kind_limits (
        kind {text} PRIMARY KEY, max_running {integer} NOT NULL CHECK (max_running >= 0),
        updated_at {integer} NOT NULL){without_rowid}""",
        "DROP INDEX tasks_unsuccessful",
        "CREATE INDEX tasks_finished ON tasks (status, id) WHERE {finished}",
        "CREATE INDEX tasks_kind ON tasks (kind, id)",
        """CREATE TABLE secrets (
        name {text} PRIMARY KEY, value {text} NOT NULL, created_at {integer} NOT NULL)
       {without_rowid}""",
        """CREATE TABLE schedules (
        name {text} PRIMARY KEY,
        kind {text} NOT NULL, payload {text},
        every_ms {integer}, cron {text},
        paused {integer} NOT NULL DEFAULT 0,
        next_at {integer} NOT NULL,
        last_due {integer}, last_fired_at {integer}, last_task {text},
        fired {integer} NOT NULL DEFAULT 0,
        created_at {integer} NOT NULL, updated_at {integer} NOT NULL,
        options {text}){without_rowid}""",
        "CREATE INDEX schedules_due ON schedules (next_at) WHERE paused = 0"),
    # Version 5: a plain task's ``created`` event is its row.  Its data is
    # the kind alone and its time the row's created_at, so the log stores
    # it only when it says more (a delay, a priority, a rerun); reading
    # from seq 0, a log whose first row is not seq 0 starts with the row's
    # (_EventLog.read).  A create then writes three B-trees, not four:
    # 4.4 us less CPU a create, 3.8 a lifecycle task (bench.py, sync
    # normal, 2 cores, 6 alternating pairs), and a WAL frame less.  No
    # statement changes; the version keeps an older taskstore, which would
    # show no created event, from opening a file this one wrote.  Its
    # files' stored events read as before.
    5: (),
    # Version 6: a plain finish's ``status`` event is its row.  A task that
    # finishes from running with no message and no error says, in its row,
    # all its last event would: the status, the seq (last_seq) and the time
    # (finished_at); "from" is running (_ROW_LOGGED_FROM).  So the log does
    # not store it, and reading past the last stored event of a finished
    # task makes it (_EventLog.read).  A lifecycle task then writes one
    # event row, not two, and 12.5 WAL frames, not 14.3: 3.3 us less CPU
    # (bench.py, sync normal, 2 cores, 6 alternating pairs: 49.8 -> 46.5
    # us above raw).  As for version 5, no statement; the version keeps an
    # older taskstore from opening a file whose finished tasks it would
    # show without their last event.
    6: (),
}


# The rows of tasks_active, the work in flight: tasks claimed or started and
# not finished, whoever runs them, and queued tasks vouched for a runner
# (``create(owner=...)``).  A query for an owner's tasks, or for a status in
# flight, repeats this text, or no index serves it.
_ACTIVE = f"({_one_of('status', ACTIVE_STATES)} OR status = '{QUEUED}' AND owner IS NOT NULL)"
# A claim's candidate carries its kind's limit (None: no limit) in the same
# statement: a probe of kind_limits' key, so a plain claim costs no statement more.
_LIMIT_COLUMN = "(SELECT max_running FROM kind_limits AS l WHERE l.kind = tasks.kind)"
# The rows of tasks_unsuccessful (version 3).
_UNSUCCESSFUL = f"({_one_of('status', (FAILED, CANCELLED))})"
# The rows of tasks_finished.
_FINISHED = f"({_one_of('status', [s for s in STATES if s in TERMINAL_STATES])})"


# A finishing task's purge_at, from its row: _purge_at in SQL ({p}: now).
_PURGE_AT_SQL = ("purge_at = CASE WHEN ttl_ms IS NULL AND retention_ms IS NULL THEN NULL "
                 "ELSE taskstore_purge_at({p}, created_at, ttl_ms, retention_ms) END")


def _schema_ddl(words):
    """``SCHEMA`` in one engine's words (a ``_SchemaWords``): {version: statements}."""
    fill = dict(words._asdict(), statuses=_one_of("status", STATES),
                policies=_one_of("policy", POLICIES), active=_ACTIVE,
                unsuccessful=_UNSUCCESSFUL, finished=_FINISHED)
    return {version: tuple(ddl.format_map(fill) for ddl in statements)
            for version, statements in SCHEMA.items()}


_SQLITE_WORDS = _SchemaWords(text="TEXT", integer="INTEGER", real="REAL",
                             without_rowid=" WITHOUT ROWID")
# Forward migrations: MIGRATIONS[n] takes a file from version n-1 to n.  A
# file at version v gets MIGRATIONS[v+1..SCHEMA_VERSION] in one transaction.
MIGRATIONS = _schema_ddl(_SQLITE_WORDS)


_WRITABLE_COLUMNS = frozenset(_TASK_COLUMNS) | {"snapshot"}
_HOST = socket.gethostname
# The registrations of the runners alive in this process, whatever store they
# registered through: module-level state on purpose, the one besides the
# logger.  Several stores in one process may share a database (a server's
# MCP and HTTP fronts, an embedding application, the tests), and recovery in
# any of them must know every runner of the process: a registration with
# this process's pid is alive only while a runner holds it (``owner_dead``),
# and a store that knew only its own runners would take another store's
# live tasks for a dead process's.  ``TaskStore.register_process`` adds an
# id, ``release`` (a runner stopping, or recovery) removes it; set.add and
# set.discard are atomic, so it needs no lock.
_LIVE_PROCESS_IDS = set()


def _id_time_key(ms):
    """The time part of ids made at *ms*: an id made before then has a lower one (``new_id``)."""
    return _base32((ms & (2**48 - 1)) << 132, 36)[:10]


def _id_after(task_id):
    """The least string above *task_id*: the next id, inclusive (ids never extend one another)."""
    return task_id + "\x01"


def _reap_take(rows, budget):
    """How many of a reap batch's rows ``(id, _, event count, ...)`` fit ``10 * budget`` events."""
    take, events = 0, 0
    for row in rows:
        count = row[2]
        if events + count > 10 * budget:
            break
        take += 1
        events += count
    return take


def _proc_stat(pid):
    """Return (state, start time) of *pid* from Linux ``/proc``, or None when unknown.

    The start time together with the pid names one process for good: a pid
    reused by a later process has another start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
        fields = stat[stat.rindex(")") + 2:].split()
        return fields[0], fields[19]
    except (OSError, ValueError, IndexError):
        return None


def _proc_start(pid):
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


def _pid_alive(pid, proc_start):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    stat = _proc_stat(pid)
    if stat is None:
        return True                # no /proc: the pid answers, that is all we know
    if stat[0] in ("Z", "X"):
        return False               # exited, not yet reaped by its parent: it runs nothing
    return proc_start is None or stat[1] == proc_start


class _Checkpointer(threading.Thread):
    """Copies the WAL back into the database file, off the writers' path.

    SQLite's automatic checkpoint runs inside the COMMIT that crosses 1,000
    WAL pages, and with ``synchronous=NORMAL`` it is where the WAL and the
    database file are fsynced: the unlucky writer flushes about 4 MB, and
    that was over a third of a lone create's average time.  This thread runs
    the same checkpoint on its own connection while writers go on.  What a
    commit makes durable, and when, does not change: a commit is in the WAL
    before it returns, and the WAL is synced at each checkpoint as before.

    A checkpoint that copied everything it saw is followed by a short second
    pass under the engine's lock, which copies what was committed meanwhile:
    then the next writer restarts the WAL from its beginning and the file
    stays small.  Should this thread lag, SQLite's own inline checkpoint at
    ``WAL_BACKSTOP_PAGES`` still bounds the WAL.  Failures are logged, never
    raised: a checkpoint can always be done later.
    """

    def __init__(self, engine):
        super().__init__(name="taskstore-checkpointer", daemon=True)
        self.engine = engine
        self._wake = threading.Event()
        self._stopping = False
        self.passes = 0                         # checkpoints finished (tests wait on it)
        self._passed = threading.Condition()
        self._conn = sqlite3.connect(engine.path, isolation_level=None, check_same_thread=False)
        self._conn.execute(f"PRAGMA synchronous={engine.synchronous.upper()}")

    def poke(self):
        """Ask for a checkpoint soon (cheap; many pokes make one checkpoint)."""
        self._wake.set()

    def run(self):
        engine, conn = self.engine, self._conn
        try:
            while True:
                self._wake.wait()
                self._wake.clear()
                if self._stopping:
                    return
                try:
                    if self._copy_all():
                        with engine.lock:
                            if engine.closed:
                                return
                            conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                except sqlite3.Error as exc:
                    logger.warning("background checkpoint of %s failed: %s", engine.path, exc)
                with self._passed:
                    self.passes += 1
                    self._passed.notify_all()
        finally:
            conn.close()

    def wait_for_pass(self, count, timeout):
        """Block until *count* checkpoints have finished; return whether they had."""
        with self._passed:
            return self._passed.wait_for(lambda: self.passes >= count, timeout)

    def _copy_all(self, passes=2, small=CHECKPOINT_TAIL_PAGES):
        """Checkpoint until what arrived during the last pass is *small*; True if it got there.

        Each pass copies what was committed while the one before ran, so
        they shrink quickly; the short pass under the lock then has little
        left to sync.  False when a reader holds old pages (the WAL cannot
        restart then anyway) or writers keep ahead.  Two passes, not more:
        each syncs the WAL and the file, and while one took 1-3 ms a lone
        writer committed 100 to 500 pages, so a third or fourth pass seldom
        got under *small* and only cost its syncs (two instead of four: about
        about 4 us less CPU per lifecycle task, 91.5 against 95.7 us, 5 runs
        each on a 2-core machine; the same throughput).
        """
        seen = 0
        for _ in range(passes):
            busy, log, copied = self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            if busy or log <= 0 or copied != log:
                return False
            if log - seen <= small:
                return True
            seen = log
        return False

    def stop(self, timeout=10.0):
        """Stop after the checkpoint in progress, if any; close the connection."""
        self._stopping = True
        self._wake.set()
        if self.is_alive():
            self.join(timeout)
        else:
            self._conn.close()


class _GroupOp:
    """One write waiting for its group commit (see ``_GroupCommit.write``)."""

    __slots__ = ("body", "result", "error", "done", "wake", "next")

    def __init__(self, body):
        self.body = body        # body(): one write's statements, run in a shared transaction
        self.result = None
        self.error = None
        self.done = False       # committed (or failed): result or error is final
        self.wake = None        # the lock this writer sleeps on, its own, while it sleeps
        self.next = None        # the writer it wakes once awake (see _GroupCommit._wake)


class _GroupCommit:
    """An engine's ``write``: many threads' writes share one transaction and one commit.

    A write is a body, ``body()``: the statements of one verb, which the
    engine runs with its lock held inside a ``transaction()``; ``write``
    returns the body's result once that transaction has committed, or
    raises its error.  Nothing here knows what a body does, and nothing
    calls back into the store: what a write tells this process's waiters
    and listeners is the caller's business, after ``write`` returns.

    The first writer to arrive becomes the leader and runs every body queued
    by then in one transaction (``_run_batch``: each body gets its own result
    or error); the others wait until that transaction has committed.  Under
    contention, writers that queue while the leader runs the bodies join the
    open transaction before its commit (``_join_late``): the writers the last
    commit released come back one at a time, and their way back overlaps
    the leader's work instead of preceding it.  Bodies queued while the
    leader commits (the commit releases the GIL, so they do arrive) go in
    the leader's next transaction, up to ``GROUP_ROUNDS`` transactions,
    instead of waiting for a new leader to wake up.  A lone writer (no
    leader, the engine's lock free) writes without queueing and pays
    nothing more.  Nobody returns before its change is committed.
    """

    def __init__(self, engine, commit_syncs=True):
        # The engine's lock, transaction() and changes() (did a body write anything?).
        self._engine = engine
        # Whether a commit waits for the disk (an fsync): only then is company
        # worth waiting for (see _join_late).
        self._commit_syncs = commit_syncs
        # Its own lock, because the leader holds the engine's lock while the
        # others wait.  (Each waiting member sleeps on a lock of its own.)
        self._group = threading.Lock()                     # the queue and who leads
        self._gather = threading.Condition(self._group)   # a leader waiting for company
        self._group_queue = []
        self._group_leading = False
        self._group_gathering = 0     # while a leader waits for company: how many it wants
        self._group_last = 1          # size of the last batch: > 1 means contention

    def write(self, body):
        """Run ``body()`` in a batch (see ``_run_batch``); return its result or raise its error.

        Most writes meet no other writer (a single worker, a server at rest).
        One that finds no leader, no contention just now (the last batch was
        of one) and the engine's lock free writes alone: its body in a
        transaction of its own, without an op to queue or a batch to run and
        wake, whose bookkeeping cost as much as a SELECT.  The engine's lock
        is what orders it with the others: a writer that arrives meanwhile
        finds the lock taken and goes the general way (``_write_queued``),
        leading a batch that starts once the lone write has committed.
        """
        engine = self._engine
        # Read without the group's lock: a leader that starts meanwhile waits
        # for the engine's lock like any other writer, and a stale read only
        # sends this writer the general way.
        if not self._group_leading and self._group_last == 1 and engine.lock.acquire(False):
            try:
                with engine.transaction():
                    return body()
            finally:
                engine.lock.release()
        return self._write_queued(body)

    def _write_queued(self, body):
        """``write`` among other writers: queue, then wait for the leader or lead a batch."""
        op = _GroupOp(body)
        with self._group:
            self._group_queue.append(op)
            if len(self._group_queue) == self._group_gathering:
                self._gather.notify()       # the company the leader waits for is here
            if self._group_leading:
                op.wake = threading.Lock()      # its own: a commit wakes exactly its writers
                op.wake.acquire()
            else:
                self._group_leading = True
        if op.wake is not None:
            self._wait_woken(op)    # until committed (done), or handed the lead
        if not op.done:
            self._lead_groups()
        if op.error is not None:
            raise op.error
        return op.result

    @staticmethod
    def _wait_woken(op):
        """Wait on *op*'s own lock; once awake, wake the next writer of its batch."""
        op.wake.acquire()
        op.wake = None              # awake: a batch it leads must not count it as asleep
        if op.next is not None:
            op.next.wake.release()

    def _lead_groups(self):
        """As the leader: commit what is queued, batch after batch; then hand the lead on."""
        group = self._group
        with group:
            batch, self._group_queue = self._group_queue, []
        rounds = 0
        try:
            while batch:
                self._run_batch(batch, self._join_late)
                rounds += 1
                with group:
                    self._group_last = len(batch)
                    done, batch = batch, ()
                    if self._group_queue and rounds < GROUP_ROUNDS:
                        batch, self._group_queue = self._group_queue, []
                    else:
                        self._hand_over_locked()
                self._wake(done)
        finally:
            if batch:                       # interrupted: never leave waiters behind
                for member in batch:
                    if member.error is None:
                        member.result, member.error = None, StoreUnavailable(
                            "the group commit was interrupted")
                with group:
                    self._hand_over_locked()
                self._wake(batch)

    def _run_batch(self, batch, more=None):
        """Run *batch*'s bodies in one transaction, the lock held; store each result or error.

        *more* (the leader's ``_join_late``), once the bodies have run, gives
        the writers that queued meanwhile: they join the batch (the list
        grows in place) and the same transaction, until it returns none.

        A body raises a TaskStoreError only before its first write (create's
        idempotency checks do), so a failing body has nothing to undo and
        fails alone without a savepoint per body.  A body that wrote and
        then raised would break that rule: the whole batch is rolled back and
        every member gets the error, so nothing half-done is ever committed.
        """
        engine = self._engine
        changes = engine.changes
        try:
            with engine.lock:
                with engine.transaction():
                    ran = 0
                    while True:
                        for op in batch[ran:]:
                            before = changes()
                            try:
                                op.result = op.body()
                            except TaskStoreError as exc:
                                if len(batch) == 1 or changes() != before:
                                    raise
                                op.error = exc
                        ran = len(batch)
                        late = None if more is None else more(ran)
                        if not late:
                            break
                        batch.extend(late)
        except BaseException as exc:
            for op in batch:
                if op.error is None:
                    op.result, op.error = None, exc
            if not isinstance(exc, Exception):
                raise

    def _hand_over_locked(self):
        # The oldest queued writer leads next; with none, the next to arrive does.
        if self._group_queue:
            self._group_queue[0].wake.release()
        else:
            self._group_leading = False

    @staticmethod
    def _wake(members):
        """Mark *members* done and wake the ones asleep, in a chain.

        Only the first is woken here; each, once awake, wakes the next
        (``_wait_woken``).  Woken all at once, they would only queue for the
        GIL, to run one at a time anyway, each paying a second thread switch.
        """
        sleepers = []
        for member in members:
            member.done = True
            if member.wake is not None:
                sleepers.append(member)
        for member, after in zip(sleepers, sleepers[1:]):
            member.next = after
        if sleepers:
            sleepers[0].wake.release()

    def _join_late(self, size):
        """Under contention, the writers that join the leader's open batch of *size*; [] for none.

        PostgreSQL's ``commit_delay``/``commit_siblings`` idea: when the last
        batch had company, the writers its commit released are coming back,
        and the next commit should serve them all instead of one.  The
        leader does not wait for them before it starts: it runs the bodies
        queued so far (inside SQLite, which releases the GIL, so the others
        come back meanwhile), then takes whoever queued since, and waits
        for the rest (at most ``GROUP_DELAY_S``) only if they are not all
        there yet and a commit is an fsync: a commit that only writes costs
        less than the wait and the thread switches would save.  A lone
        writer (last batch of one) never waits.
        """
        if size >= self._group_last and not self._group_queue:
            return None             # alone, or all there: nothing to take (a lone writer's case)
        with self._group:
            want = self._group_last
            if size >= want:
                return self._take_locked()
            missing = want - size
            if len(self._group_queue) < missing and self._commit_syncs:
                deadline = time.monotonic() + GROUP_DELAY_S
                # Woken once, when the last of them queues: a wake-up per
                # arrival would cost as much as the wait saves.
                self._group_gathering = missing
                try:
                    while len(self._group_queue) < missing:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            self._group_last = size + len(self._group_queue)  # fewer writers now
                            break
                        self._gather.wait(remaining)
                finally:
                    self._group_gathering = 0
            return self._take_locked()

    def _take_locked(self):
        batch, self._group_queue = self._group_queue, []
        return batch


class _Transaction:
    """``SQLiteEngine.transaction()``: BEGIN IMMEDIATE, then COMMIT or ROLLBACK.

    A class rather than a generator: it runs on every write, and one object
    per engine, reused, costs a fraction of a generator context.  The lock
    the caller holds makes reuse safe: transactions never nest.
    """

    __slots__ = ("engine",)

    def __init__(self, engine):
        self.engine = engine

    def __enter__(self):
        if self.engine.closed:
            raise StoreClosed()
        try:
            self.engine._run("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise self.engine._unavailable(exc) from None

    def __exit__(self, kind, exc, tb):
        engine = self.engine
        conn = engine.conn
        try:
            if kind is None:
                engine._run("COMMIT")
            elif conn.in_transaction:
                conn.execute("ROLLBACK")
        except sqlite3.Error as error:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            raise engine._unavailable(error) from None
        if kind is not None:
            if issubclass(kind, sqlite3.Error):
                raise engine._unavailable(exc) from None
            return False
        if conn.total_changes - engine._checkpoint_mark >= CHECKPOINT_ROWS:
            engine._checkpoint_soon_locked()
        return False


class _Reads:
    """``SQLiteEngine.reading()``: the lock; StoreClosed once shut; StoreUnavailable for errors.

    A class, not a generator, for the reason ``_Transaction`` is one.
    """

    __slots__ = ("engine", "lock")

    def __init__(self, engine):
        self.engine = engine
        self.lock = engine.lock

    def __enter__(self):
        self.lock.acquire()
        if self.engine.closed:
            self.lock.release()
            raise StoreClosed()
        return self.engine

    def __exit__(self, kind, exc, tb):
        self.lock.release()
        if kind is not None and issubclass(kind, sqlite3.Error):
            raise self.engine._unavailable(exc) from None
        return False


class _Dialect(typing.NamedTuple):
    """What one database says differently in the SQL both engines run (``_Statements``)."""

    param: str               # a parameter's placeholder
    no_limit: object         # LIMIT's parameter for "every row"
    batch_lock: str          # ends a retention batch's SELECT: what other processes' reapers skip
    snapshot_begin: str      # opens one read snapshot (recovery_view)
    registration_age: str    # processes()'s age_ms: by the database's clock, or NULL
    upsert_replaces: bool    # True: INSERT OR REPLACE; False: INSERT ... ON CONFLICT DO UPDATE
    # How a recovery batch names its owner when the batch's key range holds
    # little but its tasks (owner_batch); None: always by the owner index.
    owner_in_range: typing.Optional[str]
    indexed_by: str          # FROM tasks by the index {} (list_tasks): SQLite is told which
    row_lock: str            # ends a SELECT of a row the transaction is about to rely on
    error_code: str          # the code in a task's error (JSON text), as text
    # Where a walk of tasks_finished (status, id) starts, at the first task of
    # {status} after the id {after} (prune_walk's leap): the terms that make
    # each planner seek there, whatever its statistics say.
    finished_after: str
    # list_tasks on PostgreSQL, which plans each list with its values
    # (PostgresEngine._list_rows): a principal alone is a page of
    # tasks_principal, by a range as a kind's; a status's equality is left to
    # imply tasks_active's or tasks_finished's condition, not repeated.
    principal_page: bool = False
    status_implies_index: bool = False


class _Statements:
    """The fixed statements both engines run, written once, in a dialect's words.

    Built once per engine class.  Statements whose shape depends on the
    call (a list of ids, of columns) are built by ``_SqlEngine``'s methods.
    """

    def __init__(self, d):
        p = d.param
        # Expired: the one rule, in SQL (its parameter is now, in epoch ms).
        # Only a terminal task has a purge_at, so an unfinished task never
        # expires, and a late finisher's grace period is in its purge_at.
        # reap() deletes exactly these rows, in batches; until it does, every
        # read (get, list, events, wait, cancel) answers as if it had: expiry
        # shows when it happens, not when the reaper comes by.
        self.expired = expired = f"purge_at IS NOT NULL AND purge_at <= {p}"
        self.read_task = f"{_SELECT_TASK} WHERE id = {p}"
        # A task and whether it has expired (the row's last column, 1 or 0 on
        # every engine: PostgreSQL's comparison alone is a bool): (now, id).
        flag = f"CASE WHEN {expired} THEN 1 ELSE 0 END"
        self.task_at = f"SELECT {', '.join(_TASK_COLUMNS)}, {flag} FROM tasks WHERE id = {p}"
        self.summary_at = (f"SELECT {', '.join(TaskSummary._fields)}, {flag} "
                           f"FROM tasks WHERE id = {p}")
        self.tombstoned = f"SELECT 1 FROM tombstones WHERE id = {p}"
        self.event_bounds = (f"SELECT principal, last_seq, first_seq, {flag}, kind, created_at, "
                             f"status, finished_at FROM tasks WHERE id = {p}")
        self.event_head = f"SELECT status, last_seq, attempt FROM tasks WHERE id = {p}"
        self.load_snapshot = f"SELECT snapshot FROM tasks WHERE id = {p}"
        self.insert_tasks = (
            "INSERT INTO tasks (id, kind, status, payload, status_message, principal, policy, "
            "ttl_ms, retention_ms, created_at, updated_at, meta, owner) "
            f"VALUES ({', '.join([p] * 13)})")
        # A task with a delay, a priority, a retry policy or a later attempt.
        self.insert_tasks_full = (
            "INSERT INTO tasks (id, kind, status, payload, status_message, principal, policy, "
            "ttl_ms, retention_ms, created_at, updated_at, meta, owner, run_at, priority, retry, "
            f"attempt) VALUES ({', '.join([p] * 17)})")
        self.insert_created = ("INSERT INTO events (task_id, seq, type, data, created_at) "
                               f"VALUES ({p}, 0, 'created', {p}, {p})")
        self.insert_event = ("INSERT INTO events (task_id, seq, type, data, created_at) "
                             f"VALUES ({p}, {p}, {p}, {p}, {p})")
        self.append_event = (f"UPDATE tasks SET last_seq = {p}, updated_at = {p}, "
                             f"version = version + 1 WHERE id = {p}")
        self.append_event_snapshot = (f"UPDATE tasks SET last_seq = {p}, updated_at = {p}, "
                                      f"version = version + 1, snapshot = {p} WHERE id = {p}")
        self.read_events = ("SELECT seq, type, data, created_at FROM events "
                            f"WHERE task_id = {p} AND seq >= {p} ORDER BY seq LIMIT {p}")
        self.idempotency_get = ("SELECT fingerprint, task_id, expires_at FROM idempotency "
                                f"WHERE scope = {p} AND key = {p}")
        key_row = ("idempotency (scope, key, fingerprint, task_id, created_at, expires_at) "
                   f"VALUES ({', '.join([p] * 6)})")
        self.idempotency_put = (
            f"INSERT OR REPLACE INTO {key_row}" if d.upsert_replaces else
            f"INSERT INTO {key_row} ON CONFLICT (scope, key) DO UPDATE SET "
            "fingerprint = EXCLUDED.fingerprint, task_id = EXCLUDED.task_id, "
            "created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at")
        self.secret_get = f"SELECT value FROM secrets WHERE name = {p}"
        secret_row = f"secrets (name, value, created_at) VALUES ({p}, {p}, {p})"
        # Two replicas making the first one at once: the first insert wins, and
        # both read it back.  (An error would fail the whole group commit.)
        self.secret_put = (f"INSERT OR IGNORE INTO {secret_row}" if d.upsert_replaces else
                           f"INSERT INTO {secret_row} ON CONFLICT (name) DO NOTHING")
        self.unregister = f"DELETE FROM processes WHERE id = {p}"
        self.processes = (f"SELECT id, pid, host, proc_start, heartbeat_at, "
                          f"{d.registration_age} FROM processes")
        # An owner's tasks are found through tasks_active, whose condition
        # (_ACTIVE) each of these repeats: they read the work in flight only.
        owned = f"owner = {p} AND {_ACTIVE}"
        self.cancelling_of = f"SELECT id FROM tasks WHERE {owned} AND status = '{CANCELLING}'"
        self.owner_batch_end = (f"SELECT id FROM tasks WHERE {owned} AND id > {p} "
                                f"ORDER BY id LIMIT 1 OFFSET {p}")
        self.owner_last = f"SELECT max(id) FROM tasks WHERE {owned} AND id > {p}"
        self.owned_groups = f"SELECT DISTINCT status, policy FROM tasks WHERE {owned}"
        # Every owner named by an unfinished task, one index probe each: the
        # next owner after the last found (a skip scan of tasks_active, which
        # neither database does on its own for DISTINCT).
        self.owners = (
            "WITH RECURSIVE owners (owner) AS ("
            f"SELECT min(owner) FROM tasks WHERE {_ACTIVE} "
            "UNION ALL SELECT (SELECT min(owner) FROM tasks "
            f"WHERE owner > owners.owner AND {_ACTIVE}) FROM owners WHERE owner IS NOT NULL) "
            "SELECT owner FROM owners WHERE owner IS NOT NULL")
        self.range_count = (f"SELECT count(*) FROM (SELECT 1 FROM tasks WHERE id > {p} "
                            f"AND id <= {p} LIMIT {p}) AS range_rows")
        # Events to prune are found without an index of their own (one more
        # entry for every task that finishes: +9.8% WAL frames a lifecycle
        # task).  The tasks that still have events are the distinct task_ids
        # of the events' primary key, walked one index probe a step, in id
        # order, from a start (params: start, the cutoff's id time key, the
        # most rows).  What is pruned has no events: the walk never sees it.
        # Ids sort by creation time within a prefix (new_id), and no task
        # finished before it was created, so at the first id of a prefix
        # made after the cutoff the walk jumps to the next prefix ("`"
        # follows "_", which ends every prefix).  At an unfinished task it
        # leaps to the first finished task after it (tasks_finished, a probe
        # a status): the tasks between are unfinished too, however many (a
        # backlog, each with its events).
        walk, terminal = "walk.id", [s for s in STATES if s in TERMINAL_STATES]
        leap = "(SELECT min(leap) FROM (" + " UNION ALL ".join(
            f"SELECT (SELECT id FROM {d.indexed_by.format('tasks_finished')} WHERE "
            f"{d.finished_after.format(status=status, after=walk, finished=_FINISHED)} "
            "ORDER BY status, id LIMIT 1) AS leap" for status in terminal) + ") AS leaps)"
        self.prune_walk = (
            "WITH RECURSIVE walk (id, n) AS ("
            f"SELECT (SELECT min(task_id) FROM events WHERE task_id >= {p}), 1 "
            "UNION ALL SELECT CASE "
            f"WHEN length({walk}) >= 38 AND substr({walk}, length({walk}) - 35, 10) >= {p} "
            f"THEN (SELECT min(task_id) FROM events "
            f"WHERE task_id > substr({walk}, 1, length({walk}) - 37) || '`') "
            f"WHEN (SELECT status FROM tasks WHERE id = {walk}) NOT IN "
            f"({', '.join(repr(s) for s in terminal)}) THEN {leap} "
            f"ELSE (SELECT min(task_id) FROM events WHERE task_id > {walk}) END, n + 1 "
            f"FROM walk WHERE {walk} IS NOT NULL AND n < {p}) "
            "SELECT walk.id, t.status, t.finished_at, t.first_seq, t.last_seq "
            "FROM walk LEFT JOIN tasks AS t ON t.id = walk.id WHERE walk.id IS NOT NULL "
            "ORDER BY walk.id")
        self.delete_events_before = f"DELETE FROM events WHERE task_id = {p} AND seq < {p}"
        # Never lowers first_seq: reapers of several processes may prune the
        # same task at once, in slices of their own sizes.
        self.set_first_seq = f"UPDATE tasks SET first_seq = {p} WHERE id = {p} AND first_seq < {p}"
        self.delete_expired = {
            table: (f"DELETE FROM {table} WHERE ({key}) IN (SELECT {key} FROM {table} "
                    f"WHERE expires_at <= {p} LIMIT {p}{d.batch_lock})")
            for table, key in (("idempotency", "scope, key"), ("tombstones", "id"))}
        # Schedules (section 7's end), and the unfinished tasks' counts for
        # /metrics: queued ones through tasks_ready and tasks_delayed, the
        # rest through tasks_active (each WHERE repeats its index's
        # condition; SQLite is told the index, or it would group by kind
        # through tasks_kind, which holds every task).
        columns = ", ".join(_SCHEDULE_COLUMNS)
        self.schedule_rows = f"SELECT {columns} FROM schedules ORDER BY name"
        self.schedule_row = f"SELECT {columns} FROM schedules WHERE name = {p}"
        self.schedules_due = (f"SELECT {columns} FROM schedules WHERE paused = 0 "
                              f"AND next_at <= {p} ORDER BY next_at LIMIT {p}")
        self.next_schedule_at = "SELECT min(next_at) FROM schedules WHERE paused = 0"
        self.schedule_delete = f"DELETE FROM schedules WHERE name = {p}"
        schedule_row = f"schedules ({columns}) VALUES ({', '.join([p] * len(_SCHEDULE_COLUMNS))})"
        self.schedule_put = (
            f"INSERT OR REPLACE INTO {schedule_row}" if d.upsert_replaces else
            f"INSERT INTO {schedule_row} ON CONFLICT (name) DO UPDATE SET " + ", ".join(
                f"{name} = EXCLUDED.{name}" for name in _SCHEDULE_COLUMNS[1:]))
        # The queued count is read from the index alone: the oldest of a
        # kind is its first id (ids sort by creation), whose row gives its
        # time (min(created_at) read every queued row: 127 ms against 68 ms
        # with 100,000 queued, SQLite).
        self.unfinished_counts = (
            "SELECT queue.kind, 'queued', queue.n, tasks.created_at FROM (SELECT kind, "
            f"count(*) AS n, min(id) AS first FROM {d.indexed_by.format('tasks_ready')} "
            f"WHERE status = '{QUEUED}' AND run_at IS NULL "
            "GROUP BY kind) AS queue JOIN tasks ON tasks.id = queue.first",
            # Delayed tasks are queued, but wait by design: no age.
            f"SELECT kind, 'queued', count(*), NULL FROM {d.indexed_by.format('tasks_delayed')} "
            "WHERE run_at IS NOT NULL GROUP BY kind",
            f"SELECT kind, status, count(*), min(created_at) FROM {d.indexed_by.format('tasks_active')} "
            f"WHERE {_ACTIVE} AND status <> '{QUEUED}' GROUP BY kind, status")
        # Delays and limits (schema 4).  The delayed tasks are found through
        # tasks_delayed, whose condition each of these repeats (only a queued
        # task has a run_at: see SCHEMA[4]).
        delayed = "run_at IS NOT NULL"
        self.next_due = f"SELECT min(run_at) FROM tasks WHERE {delayed}"
        self.promote_due = (
            "UPDATE tasks SET run_at = NULL, version = version + 1 WHERE id IN ("
            f"SELECT id FROM tasks WHERE {delayed} AND run_at <= {p} ORDER BY run_at "
            f"LIMIT {p}{d.batch_lock})")
        # The limit row locked (PostgreSQL) before the count: claims of one
        # limited kind count one after the other, in every process.
        self.kind_limit = (f"SELECT max_running FROM kind_limits WHERE kind = {p}"
                           + d.row_lock)
        # The work in flight of a kind, through tasks_active (its condition repeated).
        self.running_of_kind = (f"SELECT count(*) FROM {d.indexed_by.format('tasks_active')} WHERE kind = {p} "
                                f"AND {_ACTIVE} AND ({_one_of('status', ACTIVE_STATES)})")
        self.limit_column = _LIMIT_COLUMN
        self.delete_kind_limit = f"DELETE FROM kind_limits WHERE kind = {p}"
        limit_row = f"kind_limits (kind, max_running, updated_at) VALUES ({p}, {p}, {p})"
        self.put_kind_limit = (
            f"INSERT OR REPLACE INTO {limit_row}" if d.upsert_replaces else
            f"INSERT INTO {limit_row} ON CONFLICT (kind) DO UPDATE SET "
            "max_running = EXCLUDED.max_running, updated_at = EXCLUDED.updated_at")


class _SqlEngine(Engine):
    """What both engines do the same way: their shared statements and the Python around them.

    An engine sets ``_dialect`` and ``_sql`` (its ``_Statements``) on its
    class; on each instance ``conn``, a connection whose ``execute(sql,
    params)`` returns a cursor (iterable, ``fetchone``, ``fetchall``,
    ``rowcount``) and which has sqlite3's ``executemany`` and
    ``total_changes``, ``closed``, ``_move_sql`` (an empty dict) and
    ``_empty_gen`` (see ``may_have_queued``).  An engine with more to do
    around a statement (lock a row, tell other processes) overrides the
    method and calls this one.  Locking is as ``Engine`` says.
    """

    _dialect = None
    _sql = None

    def _marks(self, values):
        return ", ".join([self._dialect.param] * len(values))

    def shut(self):
        """Refuse new work (lock held): transaction() and reading() raise StoreClosed from now."""
        self.closed = True

    def changes(self):
        """Rows written on this connection so far (a body that wrote moved it)."""
        return self.conn.total_changes

    # -- tasks -----------------------------------------------------------------

    def task_row_at(self, task_id, now, summary=False):
        return self.conn.execute(self._sql.summary_at if summary else self._sql.task_at,
                                 (now, task_id)).fetchone()

    def tombstoned(self, task_id):
        return self.conn.execute(self._sql.tombstoned, (task_id,)).fetchone() is not None

    def insert_tasks(self, rows, events):
        """Insert task rows and their stored ``created`` events (a statement per table).

        In a group commit of several creates, each statement is also a moment
        the leader hands the GIL to the threads waiting for it, so fewer is faster.
        """
        self.conn.executemany(
            self._sql.insert_tasks if len(rows[0]) == 13 else self._sql.insert_tasks_full, rows)
        if events:
            self.conn.executemany(self._sql.insert_created, events)

    def _move_statement(self, values):
        """``move_task``'s compare-and-set of the columns of *values*: few combinations, each
        built once."""
        names = tuple(values)
        sql = self._move_sql.get(names)
        if sql is None:
            assert _WRITABLE_COLUMNS.issuperset(names), names    # names are ours, never input
            p = self._dialect.param
            sets = ", ".join(f"{name} = {p}" for name in names)
            sql = self._move_sql[names] = (f"UPDATE tasks SET {sets}, version = version + 1 "
                                           f"WHERE id = {p} AND status = {p}")
        return sql

    def _unread_move(self, task_id, status, values, attempt):
        """``move_unread``'s compare-and-set and its parameters: ``(sql, args)``.

        The seq and the purge time come from the row; each combination of
        columns (and of the attempt's guard) is built once.  In the shared
        words, for an engine with ``moves_unread`` (PostgreSQL).
        """
        names, finish = tuple(values), "finished_at" in values
        key = (names, attempt is not None)
        sql = self._move_sql.get(key)
        if sql is None:
            assert _WRITABLE_COLUMNS.issuperset(names), names    # names are ours, never input
            p = self._dialect.param
            sets = [f"{name} = {p}" for name in names] + ["last_seq = last_seq + 1"]
            if finish:
                sets.append(_PURGE_AT_SQL.format(p=p))
            guard = f" AND attempt = {p}" if attempt is not None else ""
            sql = self._move_sql[key] = (
                f"UPDATE tasks SET {', '.join(sets)}, version = version + 1 "
                f"WHERE id = {p} AND status = {p}{guard} RETURNING {', '.join(_TASK_COLUMNS)}")
        args = [*values.values(), values["finished_at"]] if finish else [*values.values()]
        args += (task_id, status) if attempt is None else (task_id, status, attempt)
        return sql, args

    def _guard(self, selector, status, policy):
        """``(where, args)`` of *selector*'s tasks in *status* (and with *policy*, unless None)."""
        where, args = selector
        p = self._dialect.param
        if policy is None:
            return f"({where}) AND status = {p}", (*args, status)
        return f"({where}) AND status = {p} AND policy = {p}", (*args, status, policy)

    def move_tasks(self, selector, status, values, event_json, now, *, ids=False, policy=None,
                   bump_attempt=False, finish=False):
        guard, args = self._guard(selector, status, policy)
        p = self._dialect.param
        moved_ids = None
        if ids:
            moved_ids = [r[0] for r in self.conn.execute(
                f"SELECT id FROM tasks WHERE {guard}", args)]
        sets = [f"updated_at = {p}", "last_seq = last_seq + 1", "version = version + 1"]
        params = [now]
        for name, value in values.items():
            assert name in _WRITABLE_COLUMNS, name       # names are ours, never input
            sets.append(f"{name} = {p}")
            params.append(value)
        if bump_attempt:
            sets.append("attempt = attempt + 1")
        if finish:
            sets += [f"finished_at = {p}", "input_request = NULL", _PURGE_AT_SQL.format(p=p)]
            params += [now, now]
        inserted = self.conn.execute(
            "INSERT INTO events (task_id, seq, type, data, created_at) "
            f"SELECT id, last_seq + 1, 'status', {p}, {p} FROM tasks WHERE {guard}",
            (event_json, now, *args)).rowcount
        updated = self.conn.execute(f"UPDATE tasks SET {', '.join(sets)} WHERE {guard}",
                                    (*params, *args)).rowcount
        if updated != inserted:      # cannot happen inside the write transaction
            return -1, moved_ids
        return inserted, moved_ids

    def restart_groups(self, selector):
        where, args = selector
        return self.conn.execute(
            f"SELECT status, policy, count(*) FROM tasks WHERE {where} GROUP BY status, policy",
            args).fetchall()

    def disown(self, selector, statuses):
        where, args = selector
        self.conn.execute(f"UPDATE tasks SET owner = NULL WHERE ({where}) AND status IN "
                          f"({self._marks(statuses)})", (*args, *statuses))

    def list_tasks(self, now, statuses, kinds, principal, before, limit, error_code=None):
        # Each filter walks an index that holds its matches in id order and
        # stops at the page: statuses in flight in tasks_active (a few rows,
        # sorted), each kind in tasks_kind, each finished status in
        # tasks_finished, a principal in tasks_principal.  Several kinds or
        # statuses are a page from each, merged: no index orders them
        # together (past 32 kinds, one walk by id: SQLite caps a compound
        # SELECT at 500 parts).  Statuses are literals (the store checked
        # them), in the partial indexes' own form, which is how the planners
        # see that those indexes hold every match.  A page asks for its kind
        # as a range, ordered by it: with "=", PostgreSQL takes the column
        # for a constant, which the primary key's order serves too, and told
        # by its statistics that the value is common it walks the primary
        # key instead, over every newer task of other values when the
        # matches are old; this order only the index gives (as the claim's,
        # PostgresEngine._each_kind).  On PostgreSQL (principal_page) a
        # principal alone is such a page of tasks_principal: a principal
        # that is a twentieth of a million tasks was walked by the primary
        # key.  SQLite, told the index, seeks its equality itself.
        if kinds == () or statuses == ():
            return []
        p, indexed_by = self._dialect.param, self._dialect.indexed_by
        where, args = [f"NOT ({self._sql.expired})"], [now]
        source, pages = "tasks", [("", "", ())]     # one page, by the primary key
        alone = (self._dialect.principal_page and principal is not None
                 and statuses is None and kinds is None)
        if statuses is not None:
            where.append(f"({_one_of('status', statuses)})")
        if principal is not None and not alone:
            where.append(f"principal = {p}")
            args.append(principal)
        if error_code is not None:
            where.append(f"{self._dialect.error_code} = {p}")
            args.append(str(error_code))
        if before is not None:
            where.append(f"id < {p}")
            args.append(before)
        repeat = not self._dialect.status_implies_index
        if statuses is not None and set(statuses) <= set(ACTIVE_STATES):
            where += [_ACTIVE] if repeat else []
            source = indexed_by.format("tasks_active")
        elif kinds is not None and len(kinds) <= 32:
            source, pages = indexed_by.format("tasks_kind"), [
                (f" AND kind >= {p} AND kind <= {p}", "kind DESC, ", (kind, kind))
                for kind in kinds]
            kinds = None                        # each page has its own
        elif statuses is not None and set(statuses) <= TERMINAL_STATES:
            where += [_FINISHED] if repeat else []
            source, pages = indexed_by.format("tasks_finished"), [
                (f" AND status >= '{status}' AND status <= '{status}'", "status DESC, ", ())
                for status in statuses]
        elif alone:
            source, pages = indexed_by.format("tasks_principal"), [
                (f" AND principal >= {p} AND principal <= {p}", "principal DESC, ",
                 (principal, principal))]
        if kinds is not None:
            where.append(f"kind IN ({self._marks(kinds)})")
            args.extend(kinds)
        selects = [f"SELECT {', '.join(_TASK_COLUMNS)} FROM {source} WHERE {' AND '.join(where)}"
                   f"{term} ORDER BY {order}id DESC LIMIT {p}" for term, order, _ in pages]
        params = [value for _, _, values in pages for value in (*args, *values, limit)]
        if len(selects) == 1:
            return self._list_rows(selects[0], params)
        sql = " UNION ALL ".join(f"SELECT * FROM ({select}) AS page{n}"
                                 for n, select in enumerate(selects))
        return self._list_rows(f"{sql} ORDER BY id DESC LIMIT {p}", (*params, limit))

    def _list_rows(self, sql, params):
        """The rows of one of list_tasks' statements (PostgreSQL: planned with its values)."""
        return self.conn.execute(sql, params).fetchall()

    def event_bounds(self, task_id, now):
        return self.conn.execute(self._sql.event_bounds, (now, task_id)).fetchone()

    def read_events(self, task_id, start, limit):
        return self.conn.execute(self._sql.read_events, (
            task_id, start, self._dialect.no_limit if limit is None else limit)).fetchall()

    def tasks_past(self, last_seqs):
        # 500 ids at a time, so that a long list never holds up writers.
        ids, moved = list(last_seqs), {}
        for start in range(0, max(len(ids), 1), 500):
            chunk = ids[start:start + 500]
            with self.reading():
                seqs = dict(self.conn.execute(
                    f"SELECT id, last_seq FROM tasks WHERE id IN ({self._marks(chunk)})", chunk))
                for task_id in chunk:
                    seq = seqs.get(task_id)
                    if seq is None or seq > last_seqs[task_id]:
                        moved[task_id] = None if seq is None else self.read_task(task_id)
        return moved

    def load_snapshot(self, task_id):
        row = self.conn.execute(self._sql.load_snapshot, (task_id,)).fetchone()
        return (False, None) if row is None else (True, row[0])

    def set_progress(self, task_id, values, statuses, attempt, now):
        p = self._dialect.param
        sets = [f"updated_at = {p}", "version = version + 1"] + [f"{n} = {p}" for n in values]
        sql = (f"UPDATE tasks SET {', '.join(sets)} WHERE id = {p} "
               f"AND status IN ({self._marks(statuses)})")
        args = [now, *values.values(), task_id, *statuses]
        if attempt is not None:
            sql += f" AND attempt = {p}"
            args.append(attempt)
        return self.conn.execute(sql, args).rowcount == 1

    def event_head(self, task_id):
        return self.conn.execute(self._sql.event_head, (task_id,)).fetchone()

    def append_event(self, task_id, seq, etype, data_json, snapshot_json, now):
        if snapshot_json is None:
            self.conn.execute(self._sql.append_event, (seq, now, task_id))
        else:
            self.conn.execute(self._sql.append_event_snapshot, (seq, now, snapshot_json, task_id))
        self.conn.execute(self._sql.insert_event, (task_id, seq, etype, data_json, now))

    def save_snapshot(self, task_id, snapshot_json, statuses, attempt):
        p = self._dialect.param
        sql = (f"UPDATE tasks SET snapshot = {p} WHERE id = {p} "
               f"AND status IN ({self._marks(statuses)})")
        args = [snapshot_json, task_id, *statuses]
        if attempt is not None:
            sql += f" AND attempt = {p}"
            args.append(attempt)
        return self.conn.execute(sql, args).rowcount == 1

    # The status is a literal, not a parameter: only then can SQLite use the
    # partial index (tasks_ready's condition, repeated) instead of a table
    # scan.  And SQLite is told to: tasks_kind holds the same kinds with
    # their finished tasks too, which the claim would step over.
    def _queued(self, kinds):
        return (f"FROM {self._dialect.indexed_by.format('tasks_ready')} "
                f"WHERE status = '{QUEUED}' AND run_at IS NULL "
                f"AND kind IN ({self._marks(kinds)})")
    def running_of_kind(self, kind):
        limit = self.conn.execute(self._sql.kind_limit, (kind,)).fetchone()
        running = self.conn.execute(self._sql.running_of_kind, (kind,)).fetchone()[0]
        return running, None if limit is None else limit[0]

    def promote_due(self, now, limit):
        return self.conn.execute(self._sql.promote_due, (now, limit)).rowcount

    def next_due(self):
        return self.conn.execute(self._sql.next_due).fetchone()[0]

    def set_kind_limit(self, kind, max_running, now):
        if max_running is None:
            self.conn.execute(self._sql.delete_kind_limit, (kind,))
        else:
            self.conn.execute(self._sql.put_kind_limit, (kind, max_running, now))

    def kind_limits(self):
        return dict(self.conn.execute("SELECT kind, max_running FROM kind_limits ORDER BY kind"))

    def may_have_queued(self, kinds, gen):
        """Whether a queued task of *kinds* may exist, without the write lock.

        *gen* is the store's count of work queued in its process.  Unchanged
        since ``oldest_queued`` last found none, a cheap read (taking the
        lock) answers, so idle polling never takes the write lock; changed,
        there is most likely something to take, and the answer is True.
        """
        if gen != self._empty_gen:
            return True
        with self.reading():
            return self.conn.execute(*self._any_queued(kinds)).fetchone() is not None

    def _any_queued(self, kinds):
        """``may_have_queued``'s statement and parameters."""
        return f"SELECT 1 {self._queued(kinds)} LIMIT 1", kinds

    def idempotency_get(self, scope, key):
        return self.conn.execute(self._sql.idempotency_get, (scope, key)).fetchone()

    def idempotency_put(self, scope, key, fingerprint, task_id, now, expires_at):
        self.conn.execute(self._sql.idempotency_put,
                          (scope, key, fingerprint, task_id, now, expires_at))

    def secret(self, name, make, now):
        row = self.conn.execute(self._sql.secret_get, (name,)).fetchone()
        if row is None and make is not None:
            self.conn.execute(self._sql.secret_put, (name, make(), now))
            row = self.conn.execute(self._sql.secret_get, (name,)).fetchone()
        return None if row is None else row[0]

    # -- processes -------------------------------------------------------------

    def unregister(self, proc_id):
        self.conn.execute(self._sql.unregister, (proc_id,))

    def processes(self):
        return {r[0]: Registration._make(r) for r in self.conn.execute(self._sql.processes)}

    def recovery_view(self, now, lease_ms):
        conn, sql = self.conn, self._sql
        # One read transaction, one snapshot: read apart, a runner that
        # registers and claims between the two reads looks unregistered.
        conn.execute(self._dialect.snapshot_begin)
        try:
            procs = self.processes()
            owners = procs.keys() | {row[0] for row in conn.execute(sql.owners)}
            # Only the dead owners' tasks are read: the live ones' are theirs.
            dead = {owner: conn.execute(sql.owned_groups, (owner,)).fetchall()
                    for owner in owners if self.owner_dead(procs.get(owner), now, lease_ms)}
        finally:
            conn.execute("COMMIT")
        return procs, dead

    def cancelling_of(self, owner):
        return {r[0] for r in self.conn.execute(self._sql.cancelling_of, (owner,))}

    def owner_batch(self, owner, after, size, statuses):
        """Select the owner's next tasks in *statuses*: ``(selector, last id or None)``.

        A batch is a key range of the tasks_active index: this owner's ids
        after the previous batch, up to the size-th one (a walk of the
        index alone, with no row read), so the statements find it with no
        id list built in Python.  Where the range holds fewer than twice
        *size* rows, whoever owns them, the statements walk it in the table
        (the dialect's ``owner_in_range``), else the owner's entries in the
        index.  None: this is the last batch.
        """
        conn, sql, p = self.conn, self._sql, self._dialect.param
        last = conn.execute(sql.owner_batch_end, (owner, after, size - 1)).fetchone()
        column, bound = "owner", None if last is None else last[0]
        in_range = self._dialect.owner_in_range
        if in_range is not None:
            if bound is None:       # the last batch ends at the owner's last task
                bound = conn.execute(sql.owner_last, (owner, after)).fetchone()[0]
            # Fewer than twice size rows in the range, counted by a walk of
            # at most that many keys.  A runner's tasks are usually most of
            # the ids of their time (one runner, or a few taking turns), and
            # a walk of a full batch's range then costs no more than the
            # lookups it saves (a row walked about 0.35 us, one looked up
            # from the index about 0.8 us).
            if bound is not None and conn.execute(
                    sql.range_count, (after, bound, 2 * size)).fetchone()[0] < 2 * size:
                column = in_range
        # The statuses are this module's constants, written as literals; by
        # the index, the statement repeats the index's condition (_ACTIVE).
        wanted = f"status IN ({', '.join(repr(s) for s in statuses)})"
        owned = (f"{column} = {p} AND {wanted} AND id > {p}" if column == in_range else
                 f"owner = {p} AND {_ACTIVE} AND {wanted} AND id > {p}")
        selector = ((owned, (owner, after)) if bound is None else
                    (owned + f" AND id <= {p}", (owner, after, bound)))
        return selector, None if last is None else last[0]

    # -- retention -------------------------------------------------------------

    def _reap_slice(self, task_id, first, budget, counts):
        """Delete the oldest ``10 * budget`` events of one task: a very long log
        goes in slices, so no transaction runs long.  Returns True: there is more."""
        cut = first + 10 * budget
        counts["events"] += self.conn.execute(
            self._sql.delete_events_before, (task_id, cut)).rowcount
        self.conn.execute(self._sql.set_first_seq, (cut, task_id, cut))
        return True

    def prune_events_once(self, finished_before, budget, counts, since=None):
        # A walk of up to *budget* steps (_Statements.prune_walk) from
        # *since*; each task it meets that finished by the cutoff loses its
        # events, within 10 * budget event rows (a long log in slices).  So
        # a pass reads what it prunes, the tasks created before the cutoff
        # and finished after it, a step for each run of unfinished ones and
        # each prefix: not what was pruned before.
        bound = _id_time_key(finished_before + 1)
        rows = self.conn.execute(self._sql.prune_walk, (since or "", bound, budget)).fetchall()
        spent = 0
        for task_id, status, finished_at, first_seq, last_seq in rows:
            if (status not in TERMINAL_STATES or finished_at > finished_before
                    or first_seq > last_seq or task_id[-36:-26] >= bound):
                continue            # unfinished, finished later, pruned, or made after the cutoff
            cut = min(last_seq + 1, first_seq + max(1, 10 * budget - spent))
            # The task's row first, as a reaper of tasks locks it (no deadlock
            # between the two); a reaper in another process that moved it as
            # far already, or deleted the task, leaves nothing to do.
            if self.conn.execute(self._sql.set_first_seq, (cut, task_id, cut)).rowcount:
                counts["events"] += self.conn.execute(
                    self._sql.delete_events_before, (task_id, cut)).rowcount
            spent += cut - first_seq
            if cut <= last_seq:
                return True, task_id                # its next slice starts the next batch
            if spent >= 10 * budget:
                return True, _id_after(task_id)
        if len(rows) < budget:
            return False, None                      # the walk reached its end
        return True, _id_after(rows[-1][0])

    def delete_expired(self, table, now, limit):
        return self.conn.execute(self._sql.delete_expired[table], (now, limit)).rowcount

    # -- schedules and metrics -------------------------------------------------

    def schedule_rows(self, name):
        if name is None:
            return self.conn.execute(self._sql.schedule_rows, ()).fetchall()
        return self.conn.execute(self._sql.schedule_row, (name,)).fetchall()

    def schedule_put(self, row):
        self.conn.execute(self._sql.schedule_put, tuple(row))

    def schedule_update(self, name, values, next_at):
        p = self._dialect.param
        for column in values:
            assert column in _SCHEDULE_COLUMNS, column      # names are ours, never input
        sql = (f"UPDATE schedules SET {', '.join(f'{column} = {p}' for column in values)} "
               f"WHERE name = {p}")
        args = [*values.values(), name]
        if next_at is not None:
            sql += f" AND next_at = {p} AND paused = 0"
            args.append(next_at)
        return self.conn.execute(sql, args).rowcount == 1

    def schedule_delete(self, name):
        return self.conn.execute(self._sql.schedule_delete, (name,)).rowcount == 1

    def schedules_due(self, now, limit):
        return self.conn.execute(self._sql.schedules_due, (now, limit)).fetchall()

    def next_schedule_at(self):
        return self.conn.execute(self._sql.next_schedule_at, ()).fetchone()[0]

    def unfinished_counts(self):
        counts = {}         # a kind's ready and delayed tasks are one queued count
        for sql in self._sql.unfinished_counts:
            for kind, status, count, oldest in self.conn.execute(sql, ()).fetchall():
                _, _, before, aged = counts.get((kind, status), (kind, status, 0, None))
                counts[kind, status] = (kind, status, before + count,
                                        aged if oldest is None else oldest)
        return list(counts.values())


class SQLiteEngine(_SqlEngine):
    """The default engine: one SQLite file in WAL mode, one connection, one lock.

    Args:
        path: the database file (created when missing).
        synchronous: ``"normal"`` or ``"full"`` (see ``TaskStore``).
        busy_timeout: seconds to wait for another process's write lock.
        max_bytes: cap on the database size (SQLite ``max_page_count``).
        readonly: open for reading only; any write raises StoreUnavailable.

    Raises:
        StoreUnavailable: the file is not a taskstore database, was written
            by a newer version, is read-only, or cannot be opened.
    """

    shared = False
    _dialect = _Dialect(
        param="?", no_limit=-1,
        batch_lock="",                  # a writer here has the file to itself
        snapshot_begin="BEGIN",         # SQLite's read transaction is one snapshot
        registration_age="NULL",        # no clock of its own: owner_dead judges by the caller's
        upsert_replaces=True,
        # The unary plus keeps SQLite's planner, which has no statistics, off
        # tasks_active, so each statement walks the range in the table itself
        # instead of looking every row up from the index, about half the
        # cost a row.
        owner_in_range="+owner",
        # Without statistics SQLite would rather walk every task newest first
        # than sort the few in flight, or a kind's tasks in its index.
        indexed_by="tasks INDEXED BY {}",
        row_lock="",                    # the write lock is the file's
        error_code="CAST(json_extract(error, '$.code') AS TEXT)",
        # The status alone proves the partial index usable (one arm of its OR).
        finished_after="status = '{status}' AND id > {after}")
    _sql = _Statements(_dialect)

    def __init__(self, path, *, synchronous="normal", busy_timeout=DEFAULT_BUSY_TIMEOUT_S,
                 max_bytes=None, readonly=False):
        self.path = os.fspath(path)
        self.synchronous = synchronous
        self.readonly = bool(readonly)
        self._busy_timeout = float(busy_timeout)
        self.lock = threading.Lock()
        self.closed = False
        # With synchronous=NORMAL a WAL commit is a write, not an fsync.
        self._group = _GroupCommit(self, commit_syncs=synchronous == "full")
        self._move_sql = {}
        self._oldest_sql = {}         # oldest_queued's statement, by the number of kinds
        self._transaction = _Transaction(self)
        self._reads = _Reads(self)
        self._checkpointer = None
        self._checkpoint_mark = 0     # conn.total_changes at the last checkpoint request
        self._bulk_depth = 0
        # The work generation oldest_queued last found none at.  It starts
        # equal to a fresh store's generation, so even a new store's first
        # claim probes before it takes the write lock: on SQLite an idle
        # worker must never hold up another process's writers.
        self._empty_gen = 0
        self.conn = None
        # sqlite3 keeps 128 prepared statements by default, fewer than the
        # store's verbs use between them (every list filter, move and claim
        # has its own text), so a server using them all prepared statements
        # again and again.  bench/scale.py, 2,000 tasks, 600 calls a verb,
        # 2026-12-03, this 2-core VM: with 128, succeed 66 us, wait (woken)
        # 114 us, list by principal 135 us, list status=running 49 us, reap
        # with nothing to do 81 us; with 512, 47, 66, 98, 21 and 60 us
        # (1,024 measured the same as 512).
        connect = functools.partial(sqlite3.connect, timeout=busy_timeout, isolation_level=None,
                                    check_same_thread=False, cached_statements=512)
        try:
            if self.readonly:
                if not os.path.exists(self.path):
                    raise StoreUnavailable(f"{self.path}: no such store file")
                uri = "file:" + urllib.parse.quote(os.path.abspath(self.path)) + "?mode=ro"
                self.conn = connect(uri, uri=True)
            else:
                self.conn = connect(self.path)
            self._open_schema(max_bytes)
            # The statements of a verb's transaction (BEGIN, the claim's
            # read, the compare-and-set and its event, COMMIT) run on one
            # cursor, made once: conn.execute makes a cursor per statement,
            # about 0.1 us each, 1.2 us of a lifecycle task's 12 statements.
            # Only for statements read at once (fetchone, rowcount), under
            # the lock, so that no statement cuts off another's rows.
            self._run = self.conn.cursor().execute
        except sqlite3.Error as exc:
            if self.conn is not None:
                self.conn.close()
            raise self._unavailable(exc) from None
        except BaseException:
            if self.conn is not None:
                self.conn.close()
            raise

    # -- opening ---------------------------------------------------------------

    def _open_schema(self, max_bytes):
        conn = self.conn
        try:
            conn.execute("PRAGMA schema_version").fetchone()
        except sqlite3.DatabaseError:
            raise StoreUnavailable(f"{self.path} is not a SQLite database") from None
        # One read transaction: another process may initialise the file
        # between two separate reads (application_id 0, yet tables exist).
        conn.execute("BEGIN")
        try:
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        finally:
            conn.execute("COMMIT")
        if app_id != APPLICATION_ID:
            if tables:
                raise StoreUnavailable(f"{self.path} is a SQLite database but not a taskstore one")
        elif version > SCHEMA_VERSION:
            raise StoreUnavailable(
                f"{self.path} was written by a newer taskstore (schema {version}; "
                f"this version reads up to {SCHEMA_VERSION})")
        if self.readonly:
            if app_id != APPLICATION_ID or version != SCHEMA_VERSION:
                raise StoreUnavailable(f"{self.path}: read-only, and not at schema "
                                       f"{SCHEMA_VERSION}")
            return
        if not tables:
            conn.execute(f"PRAGMA page_size={PAGE_SIZE}")    # before anything is written
        mode = self._switch_to_wal(conn, self._busy_timeout)
        if mode.lower() != "wal":
            raise StoreUnavailable(f"{self.path}: cannot switch to WAL mode (is it read-only?)")
        conn.execute(f"PRAGMA synchronous={'FULL' if self.synchronous == 'full' else 'NORMAL'}")
        conn.execute("PRAGMA foreign_keys=ON")
        # Speed without risk: these change neither what is on disk nor when.
        conn.execute("PRAGMA temp_store=MEMORY")          # GROUP BY / sort scratch space
        conn.execute(f"PRAGMA wal_autocheckpoint={WAL_BACKSTOP_PAGES}")   # see _Checkpointer
        # A bulk job (reaping a million tasks) defers checkpoints and grows the
        # WAL past a gigabyte; SQLite reuses the file from its start, but
        # keeps its size on disk unless told to cut it when it restarts.
        conn.execute(f"PRAGMA journal_size_limit={WAL_KEEP_BYTES}")
        conn.create_function("taskstore_purge_at", 4, _purge_at, deterministic=True)
        if max_bytes is not None:
            page = conn.execute("PRAGMA page_size").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count={max(1, int(max_bytes) // page)}")
        if version < SCHEMA_VERSION or app_id != APPLICATION_ID:
            conn.execute("BEGIN IMMEDIATE")
            try:
                # Re-read inside the write lock: another process may have
                # migrated the file while we looked.
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                for step in range(version + 1, SCHEMA_VERSION + 1):
                    for ddl in MIGRATIONS[step]:
                        conn.execute(ddl)
                conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    @staticmethod
    def _switch_to_wal(conn, busy_timeout):
        """Put the file in WAL mode (a no-op once it is); return the journal mode.

        Switching a new file rewrites its header: SQLite reads it in a read
        transaction, then upgrades that to a write.  When another process is
        initialising the same file, holding its write lock, the upgrade fails
        at once with "database is locked": SQLite never runs the busy handler
        for an upgrade (two readers waiting to write would deadlock).  So on
        that error this waits where SQLite does wait, for the whole file in a
        fresh ``BEGIN EXCLUSIVE`` (up to the busy timeout, then the same
        error), and tries again; by then the other process has switched the
        file itself.  The race is SQLite's, the same on every Python version.
        """
        deadline = time.monotonic() + busy_timeout
        while True:
            try:
                return conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            except sqlite3.OperationalError as exc:
                if "database is locked" not in str(exc) or time.monotonic() >= deadline:
                    raise
            conn.execute("BEGIN EXCLUSIVE")
            conn.execute("ROLLBACK")

    def _unavailable(self, exc):
        """Turn a sqlite3 error into a StoreUnavailable naming the file (never SQL)."""
        text = str(exc)
        if "readonly" in text or "read-only" in text:
            text = "the database is read-only"
        elif "full" in text:
            text = "the database or disk is full"
        elif "locked" in text or "busy" in text:
            text = "the database is locked by another process (busy timeout exceeded)"
        elif "not a database" in text:
            text = "not a SQLite database"
        else:
            text = f"database error: {exc.__class__.__name__}: {text.splitlines()[0] if text else ''}"
        return StoreUnavailable(f"{self.path}: {text}")

    # -- transactions ----------------------------------------------------------

    def transaction(self):
        """One ``BEGIN IMMEDIATE`` transaction (lock held by the caller): committed, or rolled back."""
        return self._transaction

    def reading(self):
        """Hold the lock for reads whose sqlite3 errors become StoreUnavailable; yield the engine."""
        return self._reads

    def write(self, body):
        """Run *body* through the engine's group commit (``_GroupCommit.write``)."""
        return self._group.write(body)

    def on_remote(self, callback):
        """Never call *callback*: SQLite tells nobody of a commit, so waiters poll the file."""

    def _checkpoint_soon_locked(self):
        self._checkpoint_mark = self.conn.total_changes
        if self._bulk_depth:
            return                   # a bulk job checkpoints once, at its end
        if self._checkpointer is None:
            try:
                self._checkpointer = _Checkpointer(self)
            except sqlite3.Error as exc:
                logger.warning("no background checkpoints for %s: %s", self.path, exc)
                self._checkpoint_mark = float("inf")      # SQLite's inline ones remain
                return
            self._checkpointer.start()
        self._checkpointer.poke()

    @contextlib.contextmanager
    def bulk(self):
        """Checkpoint the WAL once after a bulk job instead of after every 1,000 pages.

        Reap and recovery write many small transactions; checkpoints during
        the job would copy the same pages back to the database file again
        and again.  Checkpoints move committed data between two durable
        files, so deferring them changes nothing a crash can lose; the WAL
        just grows for the length of the job, and the background checkpoint
        at its end shrinks it back.
        """
        with self.lock:
            if self.closed:
                raise StoreClosed()
            self._bulk_depth += 1
            if self._bulk_depth == 1:
                self.conn.execute("PRAGMA wal_autocheckpoint=0")
        try:
            yield
        finally:
            with self.lock:
                self._bulk_depth -= 1
                if self._bulk_depth == 0 and not self.closed:
                    try:
                        self.conn.execute(f"PRAGMA wal_autocheckpoint={WAL_BACKSTOP_PAGES}")
                    except sqlite3.Error as exc:
                        logger.warning("cannot restore automatic checkpoints: %s", exc)
                    self._checkpoint_soon_locked()

    def checkpoint(self):
        """Copy the whole WAL into the database file now (lock held); ``(log, copied)``.

        While another connection checkpoints (the background checkpointer's
        passes run outside the lock), SQLite answers busy at once, without
        its busy handler, and (-1, -1): this asks again, every millisecond,
        up to the busy timeout.
        """
        if self.readonly:
            raise StoreUnavailable(f"{self.path}: opened read-only")
        deadline = time.monotonic() + self._busy_timeout
        try:
            while True:
                busy, log, copied = self.conn.execute(
                    "PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                if not busy or time.monotonic() >= deadline:
                    break
                time.sleep(0.001)
        except sqlite3.Error as exc:
            raise self._unavailable(exc) from None
        self._checkpoint_mark = self.conn.total_changes
        return log, copied

    def close(self):
        """Stop the checkpointer and close the connection (the caller stopped all writers)."""
        with self.lock:
            self.closed = True
            checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is not None:
            checkpointer.stop()
        with self.lock:
            self.conn.close()

    # -- tasks -----------------------------------------------------------------

    def read_task(self, task_id):
        row = self._run(self._sql.read_task, (task_id,)).fetchone()
        return None if row is None else _task_from_row(row)

    def move_task(self, task_id, status, values, event_json, now):
        """Compare-and-set one task from *status* to *values*; append its status event.

        *values* are the columns to write (``last_seq`` among them: the
        event's seq); *event_json* None: no event row.  Returns False when
        the task was not in *status*.
        """
        if self._run(self._move_statement(values), (*values.values(), task_id, status)
                     ).rowcount != 1:
            return False
        if event_json is None:
            return True
        self._run(
            "INSERT INTO events (task_id, seq, type, data, created_at) VALUES (?, ?, 'status', ?, ?)",
            (task_id, values["last_seq"], event_json, now))
        return True

    # In-process a row's read is cheap, and UPDATE ... RETURNING is not: a
    # lifecycle task took 608,000 instructions with it against 587,000 with
    # the read and the move (callgrind, 1,000 tasks, SQLite 3.40), and SQLite
    # before 3.35 has no RETURNING.  So moves_unread is False: the store
    # reads first.
    def move_unread(self, task_id, status, values, event_json, now, attempt):
        """None: the store reads the task and moves it (``moves_unread`` is False)."""
        return None

    def oldest_queued(self, kinds, gen):
        """``(Task, limit)`` of the next ready task of *kinds*, or None (then noting *gen*)."""
        sql = self._oldest_sql.get(len(kinds))
        if sql is None:
            sql = self._oldest_sql[len(kinds)] = (
                f"SELECT {', '.join(_TASK_COLUMNS)}, {self._sql.limit_column} "
                f"{self._queued(kinds)} ORDER BY priority DESC, id LIMIT 1")
        row = self._run(sql, kinds).fetchone()
        if row is None:
            if gen is not None:
                self._empty_gen = gen
            return None
        return _task_from_row(row[:-1]), row[-1]

    # -- processes -------------------------------------------------------------

    def register(self, proc_id, now):
        pid = os.getpid()
        self.conn.execute(
            "INSERT INTO processes (id, pid, host, proc_start, started_at, heartbeat_at) "
            "VALUES (?, ?, ?, ?, ?, ?)", (proc_id, pid, _HOST(), _proc_start(pid), now, now))

    def heartbeat(self, proc_id, now):
        return self.conn.execute("UPDATE processes SET heartbeat_at = ? WHERE id = ?",
                                 (now, proc_id)).rowcount == 1

    @staticmethod
    def owner_dead(proc, now, lease_ms):
        """Is the ``Registration`` *proc* (or None) dead at *now*, by the caller's clock?

        Dead: nobody is registered to heartbeat it; its lease expired (dead or
        cut off, either way not running it); or, on this host, its pid is
        gone or now belongs to a later process.  A registration of this very
        process is alive while a runner holds it (``_LIVE_PROCESS_IDS``); one
        on another host lives as long as its lease.
        """
        if proc is None:
            return True
        if proc.heartbeat_at + lease_ms < now:
            return True
        if proc.host != _HOST():
            return False
        if proc.pid == os.getpid() and proc.proc_start == _proc_start(proc.pid):
            return proc.id not in _LIVE_PROCESS_IDS
        return not _pid_alive(proc.pid, proc.proc_start)

    # -- retention -------------------------------------------------------------

    def reap_tasks_once(self, now, budget, counts, tombstone_ms, since=None):
        """Delete one batch of expired tasks with their events; ``(more, ids, reached)``.

        A batch is at most *budget* tasks and ``10 * budget`` event rows; a
        longer event log is deleted in slices over several transactions.
        The batch is a key range of the ``tasks_purge`` index, ``(purge_at,
        id) <= (last of the batch)``, so each of the three set-based
        statements finds it by the index, with no id list built in Python.
        *since* is not needed: a delete takes the rows out of the index.
        """
        rows = self.conn.execute(
            f"SELECT id, purge_at, last_seq - first_seq + 1 FROM tasks WHERE {self._sql.expired} "
            "ORDER BY purge_at, id LIMIT ?", (now, budget)).fetchall()
        take = _reap_take(rows, budget)
        if not take and rows:
            first = self.conn.execute("SELECT first_seq FROM tasks WHERE id = ?",
                                      (rows[0][0],)).fetchone()[0]
            return self._reap_slice(rows[0][0], first, budget, counts), (), rows[0][1]
        if take:
            batch = "purge_at IS NOT NULL AND (purge_at, id) <= (?, ?)"
            last = rows[take - 1][1], rows[take - 1][0]
            counts["events"] += self.conn.execute(
                f"DELETE FROM events WHERE task_id IN (SELECT id FROM tasks WHERE {batch})",
                last).rowcount
            self.conn.execute(
                "INSERT OR REPLACE INTO tombstones (id, deleted_at, expires_at) "
                f"SELECT id, ?, ? FROM tasks WHERE {batch}", (now, now + tombstone_ms, *last))
            deleted = self.conn.execute(f"DELETE FROM tasks WHERE {batch}", last).rowcount
            if deleted != take:      # the range is exactly the rows read: same transaction
                raise StoreUnavailable(f"{self.path}: reap batch changed under the write lock")
            counts["tasks"] += deleted
        return (len(rows) == budget or take < len(rows), [row[0] for row in rows[:take]],
                rows[take - 1][1] if take else since)


PG_URL_SCHEMES = ("postgresql://", "postgres://")


def is_postgres_url(path):
    """Whether *path* names a PostgreSQL database rather than a SQLite file."""
    return isinstance(path, str) and path.startswith(PG_URL_SCHEMES)


def open_engine(path, **options):
    """The engine for *path*: PostgresEngine (section 11) for a PostgreSQL URL, else SQLiteEngine."""
    if is_postgres_url(path):
        return PostgresEngine(path, **options)
    return SQLiteEngine(path, **options)


# =============================================================================
# 7. The store
# =============================================================================
# Rules:
# - The verbs and the rules, written once: transitions, the event log,
#   idempotency, retention, recovery decisions, waiting.  Everything that is
#   SQLite's or PostgreSQL's is the engine's (sections 6 and 11), reached only
#   through the methods of ``Engine`` (section 6); no SQL text lives here.
# - One write path.  A verb builds a body (its statements: the engine's data
#   methods) and hands it to the engine's ``write``, which runs it with the
#   engine's lock held in one transaction and returns its result once
#   committed (perhaps in a group commit with other threads' bodies: that
#   is the engine's business).  Reads take the lock through the engine's
#   ``reading()``.  Helpers whose names end in ``_locked`` run inside a
#   body or a read.  The lock is not re-entrant.
# - Every status change goes through ``_transition_locked`` (or, for
#   recovery, ``_Recovery``'s set-based moves), which asks the lifecycle
#   tables (section 3) and appends the event row in the same transaction.
#   A failure's retry is ``FAILURE``'s decision, a ``requeue`` like a
#   restart's; a delay is a not-before time in the task's row, which the
#   claim honours (it makes due tasks ready in its own transaction), so a
#   delayed task survives a crash and runs once.
# - What a write tells this process has one shape, ``_Change(task, change)``,
#   the task as written.  Once ``write`` has returned, the writing thread
#   hands its changes to ``_Waiters.committed``: waiters wake, idle workers
#   wake when work was queued, then the listeners run.  Other processes see
#   the change on their next poll, or at once when the engine tells of
#   other processes' commits (``on_remote``: PostgreSQL does).
# - Listeners, cancel events and anything else that calls out run after the
#   commit and outside every lock.
# - ``now`` arguments are epoch milliseconds; the clock is a ``time.time``-like
#   function in seconds, injectable for tests.
# - The reaper thread (at the end of this section) belongs to the store.
# - ``TaskStore`` is the public verbs.  A verb whose rules are a job of their
#   own hands it to the room that holds them, a class below the store with
#   that one job: ``_Queue`` (delays, priorities and limits per kind: the
#   claim), ``_Retries`` (a failure's retry, dead letters run again),
#   ``_Inputs`` (input requests, whole or in parts), ``_EventLog`` (events,
#   snapshots, progress), ``_Recovery`` (the tasks of owners that stopped),
#   ``Schedules`` (periodic tasks; public, as ``store.schedules``); waiting
#   is ``_Waiters``'s, retention ``_reap``'s.

_MISSING = object()
# The statuses that take an answer to an input request: the table's say.
_TAKES_INPUT = tuple(state for state, row in TRANSITIONS.items() if PROVIDE_INPUT in row)
_JSON_COLUMNS = frozenset(_TASK_COLUMNS[i] for i in _JSON_INDEXES)
_PRINCIPAL_INDEX = _TASK_COLUMNS.index("principal")
_SUMMARY_PRINCIPAL_INDEX = TaskSummary._fields.index("principal")
_RECOVERABLE = (QUEUED, *ACTIVE_STATES)   # an owner's tasks recovery hands to their policy


def _describe_recovery(tally):
    """Say what recovery did, per policy: ``2 failed (policy fail), 1 queued again (retry)``."""
    words = {"fail": "failed (policy fail)", "retry": "queued again (policy retry)",
             "resume": "queued again (policy resume)",
             CANCELLING: "cancelled (a cancel was under way)"}
    return ", ".join(f"{tally[key]} {words[key]}" for key in (*POLICIES, CANCELLING)
                     if tally.get(key))


def _status_data(status, new, message, error):
    data = {"status": new, "from": status}
    if message is not None:
        data["message"] = message
    if error is not None:
        data["error"] = error
    return data


# A finish from this status with no message and no error is logged by its row
# (schema 6): _transition_locked stores no event for it, _EventLog.read makes it.
_ROW_LOGGED_FROM = RUNNING


@functools.lru_cache(maxsize=64)
def _plain_status_json(status, new):
    """A ``status`` event's data with no message and no error, as stored: serialised once."""
    return dumps(_status_data(status, new, None, None))



class _NewTask(typing.NamedTuple):
    """A validated ``create``: what ``_insert_tasks_locked`` makes a row and a Task of."""

    kind: str
    payload: object
    payload_json: str
    ttl_ms: object
    retention_ms: object
    policy: str
    principal: object
    meta: object
    meta_json: object
    prefix: str
    status_message: object
    owner: object
    plain: bool = True            # no delay, priority, retry policy or rerun: version 3's row
    run_at: object = None
    priority: int = DEFAULT_PRIORITY
    retry: object = None          # a Retry, or None
    retry_json: object = None
    rerun_of: object = None       # dead letters: the failed task this one runs again


def _payload(payload, param):
    """Return ``(payload_json, payload)``: the stored text and the caller's own copy."""
    payload_json = _json_param(payload, param)
    try:
        # The Task we return carries its own copy, parsed here, at the
        # caller's depth (a payload nested near the limit parses now or never).
        return payload_json, _loads(payload_json)
    except RecursionError:
        raise InvalidParams(f"{param} is nested too deeply", param=param) from None


def _new_task(max_ttl_ms, kind, payload, ttl_ms, retention_ms, policy, principal, meta, prefix,
              status_message, owner, param="payload", *, now=None, run_at=None, delay=None,
              priority=DEFAULT_PRIORITY, retry=None):
    """Validate create's arguments; return the ``_NewTask`` to insert.

    *run_at* / *delay* become a not-before time in epoch ms (None when it
    is not after *now*: the task is ready at once, as a plain one).
    """
    not_before = retry_json = None
    plain = run_at is None and delay is None and retry is None and priority.__class__ is int \
        and priority == DEFAULT_PRIORITY
    if not plain:                         # checked only when given: creates are the hot path
        not_before = _not_before(now, run_at, delay)
        if not_before is not None and not_before <= now:
            not_before = None
        _check_int(priority, "priority", minimum=-2**31, allow_none=False, maximum=2**31 - 1)
        retry = _retry_param(retry)
        retry_json = None if retry is None else dumps(retry._asdict())
        plain = not_before is None and retry is None and priority == DEFAULT_PRIORITY
    _check_str(kind, "kind", allow_none=False, max_len=200)
    payload_json, payload = _payload(payload, param)
    _check_str(owner, "owner", max_len=200)
    ttl_ms = _check_int(ttl_ms, "ttl_ms")
    retention_ms = _check_int(retention_ms, "retention_ms")
    if ttl_ms is not None and retention_ms is not None:
        raise InvalidParams("give ttl_ms or retention_ms, not both", param="ttl_ms")
    if ttl_ms is not None and max_ttl_ms is not None:
        ttl_ms = min(ttl_ms, max_ttl_ms)
    if policy not in POLICIES:
        raise InvalidParams(f"policy must be one of {', '.join(POLICIES)}", param="policy")
    _check_str(principal, "principal")
    _check_str(status_message, "status_message", max_len=100_000)
    if meta is not None and not isinstance(meta, dict):
        raise InvalidParams("meta must be a JSON object", param="meta")
    meta_json = None if meta is None else _json_param(meta, "meta")
    if prefix != "task" and (not isinstance(prefix, str)
                             or not re.fullmatch(r"[a-z][a-z0-9]{0,15}", prefix)):
        raise InvalidParams("prefix must be 1-16 lowercase letters and digits", param="prefix")
    return _NewTask(kind, payload, payload_json, ttl_ms, retention_ms, policy, principal,
                    meta, meta_json, prefix, status_message, owner, plain, not_before,
                    priority, retry, retry_json)


@functools.lru_cache(maxsize=256)
def _created_data(kind):
    """The data of a ``created`` event, as stored: a few kinds, each serialised once."""
    return dumps({"kind": kind})


def _created_data_of(spec):
    """A ``created`` event's data: the kind, and what is not plain (delay, priority, rerun)."""
    data = {"kind": spec.kind}
    if spec.run_at is not None:
        data["run_at"] = spec.run_at
    if spec.priority != DEFAULT_PRIORITY:
        data["priority"] = spec.priority
    if spec.rerun_of is not None:
        data["rerun_of"] = spec.rerun_of
    return dumps(data)


def _create_once(store, spec, idempotency):
    """``TaskStore.create``'s body under an idempotency key: a new Task, or the key's task id.

    A replay writes nothing, so its task is read after the write
    (``_replayed``), not in it: inside a write PostgreSQL locks the rows it
    reads, and a replay holding the key's lock while it waited for the task's
    row deadlocked with another process whose batch held that row (its
    runner's claim) and wanted the key's lock for the next create with it.
    """
    try:
        scope, key, fprint, expires_in_ms = idempotency
    except (TypeError, ValueError):
        raise InvalidParams("idempotency is (scope, key, fingerprint, expires_in_ms)",
                            param="idempotency") from None
    for name, value in (("scope", scope), ("key", key), ("fingerprint", fprint)):
        _check_str(value, f"idempotency {name}", allow_none=False)
    _check_int(expires_in_ms, "idempotency expires_in_ms")

    def body():
        now = int(store.clock() * 1000)
        row = store._engine.idempotency_get(scope, key)
        if row is not None and (row[2] is None or row[2] > now):
            if row[0] != fprint:
                raise IdempotencyMismatch(key)
            return row[1]
        task = _insert_tasks_locked(store, (spec,), now)[0]
        store._engine.idempotency_put(scope, key, fprint, task.id, now,
                                     None if expires_in_ms is None else now + expires_in_ms)
        return task
    return body


def _replayed(store, task_id):
    """The task an idempotency key names, as a replay (``replayed=True``), read on its own."""
    with store._engine.reading():
        try:
            task = store._get_locked(task_id)
        except TaskNotFound:
            raise TaskExpired(task_id) from None
    return task._replace(replayed=True)


def _insert_tasks_locked(store, specs, now=None, attempt=1):
    """Insert new queued tasks (``_NewTask``s) and what they log; return their Tasks.

    The engine writes the lot at once (``insert_tasks``).
    """
    now = int(store.clock() * 1000) if now is None else now
    tasks, rows, events = [], [], []
    # A plain task (no delay, retry policy or priority, a first attempt)
    # writes the columns it wrote before version 4; the others write theirs.
    # (A batch's specs share their options: the first speaks for all.)
    plain = specs[0].plain and attempt == 1
    for spec in specs:
        (kind, payload, payload_json, ttl_ms, retention_ms, policy, principal, meta,
         meta_json, prefix, status_message, owner, _, run_at, priority, retry, retry_json,
         _) = spec
        task_id = store._ids.next(prefix, now)
        row = (task_id, kind, QUEUED, payload_json, status_message, principal, policy,
               ttl_ms, retention_ms, now, now, meta_json, owner)
        if plain:
            rows.append(row)            # its created event is the row (schema 5)
        else:
            rows.append((*row, run_at, priority, retry_json, attempt))
            events.append((task_id, _created_data_of(spec), now))
        # Built here rather than read back: the row is exactly this.
        tasks.append(_new_tuple(Task, (
            task_id, kind, QUEUED, payload, None, None, status_message, None, None,
            principal, policy, attempt, ttl_ms, retention_ms, now, now, None, None, owner, 0,
            0, 0, {} if meta is None else _loads(meta_json), None, None, run_at, priority,
            None if retry is None else retry._asdict(), False)))
    store._engine.insert_tasks(rows, events)
    return tasks


def _transition_locked(store, task, event, now, *, attempt=None, fields=None, message=None,
                       error=None, assume=None):
    """Move one task by *event*: the path of every single status change; return the new Task.

    Every new task comes from ``_insert_tasks_locked``; every single
    status change comes from here, whoever asks: the verbs, the claim, a
    retry, an answer to an input request (recovery's set-based moves are
    the same moves, made for many tasks at once: ``_Recovery``).

    *task* is the task as read in the caller's transaction (so it is
    current: nobody else can write meanwhile), or its id (then it is read
    here).  The table decides; the engine's compare-and-set
    (``move_task``: the row changes only if it is still in the status we
    read) writes the move and appends the ``status`` event, whose
    sequence number the row read already tells (a plain finish from
    running appends none: its row is the event, ``_ROW_LOGGED_FROM``).
    The returned Task is the row as written.  *attempt* guards against a
    stale worker: a task requeued since it claimed it is not its to move.

    *assume* (with an id): the status the caller expects the task in (a
    worker's task is running when it succeeds).  Where a read costs a round
    trip (``moves_unread``: PostgreSQL), the table decides the move from it
    and the compare-and-set tries it without reading the row first
    (``move_unread``); a task found in any other status is read and decided
    as always.
    """
    engine = store._engine
    if isinstance(task, str):
        task_id = task
        if assume is not None and engine.moves_unread:
            new = next_state(task_id, assume, event)
            values, event_json = _move_values(assume, new, now, fields, message, error)
            if assume == QUEUED and new != QUEUED:
                values["run_at"] = None      # only a queued task has a not-before time
            row = engine.move_unread(task_id, assume, values, event_json, now, attempt)
            if row is not None:
                if new in TERMINAL_STATES:
                    store._waiters.cancel_events.pop(task_id, None)
                return _task_from_row(row)
        task = engine.read_task(task_id)
        if task is None:
            raise TaskNotFound(task_id)
    task_id, status = task.id, task.status
    new = next_state(task_id, status, event)
    if attempt is not None and attempt != task.attempt:
        raise InvalidTransition(task_id, f"{status} (attempt {task.attempt})", event)
    values, event_json = _move_values(status, new, now, fields, message, error)
    # The Task as written, built here rather than read back: the row read
    # with what the move writes set over it by position (the JSON columns
    # decoded: the Task's own copy), and the same values by name for the
    # engine's compare-and-set, with what only the row tells.
    row = list(task)
    row[_STATUS_INDEX] = new
    row[_UPDATED_AT_INDEX] = now
    row[_LAST_SEQ_INDEX] = values["last_seq"] = task.last_seq + 1
    row[_VERSION_INDEX] = task.version + 1
    if fields:
        for name, value in fields.items():
            if name in _TASK_INDEX:      # not the snapshot: no Task field shows it
                row[_TASK_INDEX[name]] = value if value is None or name not in _JSON_COLUMNS \
                    else _loads(value)
    if task.run_at is not None and new != QUEUED:
        # Only a queued task has a not-before time (tasks_delayed holds no other).
        values["run_at"] = row[_RUN_AT_INDEX] = None
    terminal = new in TERMINAL_STATES
    if terminal:
        row[_FINISHED_AT_INDEX] = now
        row[_INPUT_REQUEST_INDEX] = None
        values["purge_at"] = row[_PURGE_AT_INDEX] = _purge_at(
            now, task.created_at, task.ttl_ms, task.retention_ms)
    # The compare-and-set: cannot fail inside the transaction; the guard is the rule.
    if not engine.move_task(task_id, status, values, event_json, now):
        raise InvalidTransition(task_id, status, event)
    if terminal:
        store._waiters.cancel_events.pop(task_id, None)
    return _new_tuple(Task, row)


def _move_values(status, new, now, fields, message, error):
    """A move's columns by name, as far as they do not depend on the row, and its event's data.

    The event is None for a plain finish from running: the row is the
    event (schema 6).
    """
    values = {"status": new, "updated_at": now}
    if fields:
        values.update(fields)
    terminal = new in TERMINAL_STATES
    if terminal:
        values["finished_at"] = now
        values["input_request"] = None
    if message is None and error is None:
        # A plain finish from running is logged by its row (schema 6): no event row.
        event_json = None if terminal and status == _ROW_LOGGED_FROM \
            else _plain_status_json(status, new)
    else:
        event_json = dumps(_status_data(status, new, message, error))
    return values, event_json


class _IdSequence:
    """Task ids of one store: ids made in the same millisecond still sort in creation order.

    ULID's monotonic rule: within a millisecond the random part counts up.
    ``last`` keeps that part as a number, so it is never parsed back.
    """

    def __init__(self):
        self.last = None

    def next(self, prefix, now):
        """Return the next id with *prefix* at *now* (epoch ms); the caller serialises calls."""
        last = self.last
        if last is not None and last[0] == now and last[1] == prefix:
            # Count up by a random step of 64 bits or more, never by 1: one id
            # must not give away its neighbours (MCP: ids are bearer tokens).
            number = last[3] + 2**64 + secrets.randbits(64)
            if number < 2**130:
                self.last = (now, prefix, last[2], number)
                return last[2] + _base32(number, 26)
        task_id = new_id(prefix, now)        # a new millisecond, or the count ran out
        self.last = (now, prefix, task_id[:-26],
                     int(task_id[-26:].translate(_FROM_CROCKFORD), 32))
        return task_id


class _Change(typing.NamedTuple):
    """What a committed write tells this process: one task as the write left it.

    ``change`` is ``created``, ``status``, ``progress``, ``input`` (a part of
    an input request answered) or ``event``; ``task``
    is the Task as written, read or built inside the write's transaction.
    A verb's body returns its changes with its result, and the verb hands
    them to ``_Waiters.committed`` once the engine's ``write`` has returned:
    each becomes one ``listener(task, change)`` call.
    """

    task: Task
    change: str


class _Waiters:
    """This process's waiters, listeners and cancel events, and what each commit tells them.

    A commit in this process is told here by the thread that wrote it, once
    the engine's ``write`` has returned (``committed``): the commit count
    moves on, waiters wake, idle workers wake when work was queued, then the
    listeners run, outside every lock, in the writer's thread.  Another
    process's commit is told by the engine's ``on_remote`` (``told``), or
    found by the waiters' own ``poll_interval`` re-reads.  The cancel events
    (``cancel_events``: task id -> ``threading.Event``) are how work this
    process runs learns of its cancel: set after a cancel commits here, or
    when the engine tells of one elsewhere.

    A waiter first registers (``watching``), then notes ``commits`` before
    each read and sleeps only if it has not moved since (``await_commit``);
    an idle worker does the same with ``work_gen``.  So a commit that lands
    between a read and the sleep is never missed, and a writer that finds
    nobody watching (most writes) has nobody to tell and takes no lock:
    whoever starts watching later reads after that commit.  One lock, this
    object's own, guards the counts and both conditions; it is never held
    while the engine's lock is taken, nor taken while the engine's is held.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)   # a commit (or news of one elsewhere)
        self.work = threading.Condition(self.lock)      # a task may have become queued
        self.commits = 0
        self.work_gen = 0
        self.watchers = 0         # threads in wait() or wait_any() (see watching)
        self.work_waiting = 0     # idle workers asleep: a notify nobody waits for is skipped
        self.closed = False
        self.listeners = []
        # Another process queued a delayed task: the store's hint of when the
        # next one is due (_Queue.due) must be read again.
        self.delays_changed = False
        # Plain dict operations, atomic without the lock: ``cancel_event``
        # must never wait for a group-commit leader (its comment says why).
        self.cancel_events = {}

    def committed(self, changes=(), queued=False):
        """A write of this process committed: wake who waits (idle workers too if *queued*),
        then call the listeners with each of *changes* (``_Change``s)."""
        if queued or self.watchers:
            with self.lock:
                self.commits += 1
                if queued:
                    self.work_gen += 1
                    if self.work_waiting:
                        self.work.notify_all()
                if self.watchers:
                    self.changed.notify_all()
        if self.listeners:
            for task, change in changes:
                for listener in list(self.listeners):
                    try:
                        listener(task, change)
                    except Exception:
                        logger.exception("task listener %r failed", listener)

    def told(self, kind, ids):
        """Another process committed (the engine's ``on_remote``): wake who waits here.

        Waiters re-read; idle runners look for work when something became
        queued; work this process runs learns of its cancel at once.
        ``lost``: news may have been missed, so all of it.
        """
        with self.lock:
            self.commits += 1
            if kind in ("delayed", "lost"):
                self.delays_changed = True
            if kind in (QUEUED, "delayed", "lost"):
                self.work_gen += 1
                self.work.notify_all()
            self.changed.notify_all()
        if kind == CANCELLING:
            for task_id in ids:
                self.cancel_set(task_id)

    def cancel_event(self, task_id):
        """The task's cancel event, made on first use."""
        # Without the store's lock: dict.get and setdefault are atomic, and the
        # lock would order nothing more (a cancel committed before the event
        # exists is noticed by the runner's maintenance either way).  A runner
        # asks for it between its claim and its write, and must not wait for a
        # group-commit leader that holds the lock while it waits for that write.
        event = self.cancel_events.get(task_id)
        if event is None:
            event = self.cancel_events.setdefault(task_id, threading.Event())
        return event

    def cancel_set(self, task_id):
        """Set the task's cancel event, if work here asked for one."""
        event = self.cancel_events.get(task_id)
        if event is not None:
            event.set()

    @contextlib.contextmanager
    def watching(self):
        """Context of a waiter (``wait``, ``wait_any``): from now on every commit is told."""
        with self.lock:
            self.watchers += 1
        try:
            yield
        finally:
            with self.lock:
                self.watchers -= 1

    def until(self, read, done, timeout, poll_interval):
        """The waiter's loop: ``read()`` until ``done(value)``, or *timeout* s; the last value.

        Each read comes after the commit count was noted, and the sleep
        between two reads ends at the next commit (``await_commit``), so
        no commit between a read and the sleep is missed.  ``wait`` and
        ``wait_any`` are this loop.  Raises StoreClosed when the store was
        closed meanwhile.
        """
        deadline = time.monotonic() + timeout
        with self.watching():
            while True:
                seen = self.commits          # before the read: see the class's docstring
                value = read()
                if done(value) or not self.await_commit(seen, deadline, poll_interval):
                    return value

    def await_commit(self, seen, deadline, poll_interval):
        """Sleep until a commit after *seen* (a ``commits`` value), *poll_interval* or *deadline*.

        For a waiter inside ``watching``.  Returns False at once when
        *deadline* has passed.  Raises StoreClosed when the store was closed
        meanwhile.
        """
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        with self.lock:
            if self.commits == seen and not self.closed:
                self.changed.wait(min(remaining, poll_interval))
            if self.closed:
                raise StoreClosed()
        return True

    def wait_for_work(self, seen, timeout):
        """``TaskStore.wait_for_work``: sleep unless ``work_gen`` moved past *seen*; return it."""
        with self.lock:
            if seen == self.work_gen and not self.closed:
                self.work_waiting += 1
                try:
                    self.work.wait(timeout)
                finally:
                    self.work_waiting -= 1
            return self.work_gen

    def wake_workers(self):
        """End every ``wait_for_work`` now; the generation moves on."""
        with self.lock:
            self.work_gen += 1
            self.work.notify_all()

    def close(self):
        """Wake everyone for good: waits raise StoreClosed.  Returns False if already closed."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            self.changed.notify_all()
            self.work.notify_all()
            return True


class TaskStore:
    """A durable task store on a SQLite file or a PostgreSQL database.

    Several ``TaskStore`` objects, in one process or many, may share a
    SQLite file; processes on several hosts share a PostgreSQL database
    (a ``postgresql://`` URL, through psycopg).  Example::

        store = TaskStore("tasks.db")
        task = store.create("report", {"topic": "q3"})
        store.get(task.id).status          # 'queued'

    Args:
        path: the SQLite file (created when missing), or a
            ``postgresql://`` URL of an existing database.
        clock: a ``time.time``-like function (seconds); tests pass a fake.
        synchronous: SQLite's ``"normal"`` (default; a process crash
            loses nothing committed, a power loss may lose the last
            transactions) or ``"full"`` (every commit is on disk before it
            returns).  On PostgreSQL durability is the server's.
        busy_timeout: seconds to wait for another process's write lock.
        poll_interval: seconds between re-reads while waiting, to see other
            processes' writes.
        max_ttl_ms: the largest TTL ``create`` grants (None: no cap).
        event_retention_ms: prune the events of finished tasks this long after
            they finished (None: keep them as long as the task).
        tombstone_ms: how long a purged id answers "expired" rather than
            "not found".
        lease_s: a runner whose heartbeat is older than this is dead.
        max_bytes: cap on the database size (SQLite only: ``max_page_count``).
        recover_on_open: run ``recover()`` when opening.
        readonly: open for reading only (the admin read commands do); any
            write raises StoreUnavailable.

    Raises:
        StoreUnavailable: the database is not a taskstore database, was
            written by a newer version, is read-only, or cannot be opened
            (MissingDependency: a PostgreSQL URL without psycopg).
    """

    def __init__(self, path=DEFAULT_DB, *, clock=time.time, synchronous="normal",
                 busy_timeout=DEFAULT_BUSY_TIMEOUT_S, poll_interval=DEFAULT_POLL_INTERVAL_S,
                 max_ttl_ms=DEFAULT_MAX_TTL_MS, event_retention_ms=None,
                 tombstone_ms=DEFAULT_TOMBSTONE_MS, lease_s=DEFAULT_LEASE_S,
                 max_bytes=None, recover_on_open=True, readonly=False):
        if synchronous not in ("normal", "full"):
            raise InvalidParams("synchronous must be 'normal' or 'full'", param="synchronous")
        self.path = os.fspath(path)
        self.clock = clock
        self.synchronous = synchronous
        self.poll_interval = float(poll_interval)
        self.max_ttl_ms = _check_int(max_ttl_ms, "max_ttl_ms")
        self.event_retention_ms = _check_int(event_retention_ms, "event_retention_ms")
        self.tombstone_ms = _check_int(tombstone_ms, "tombstone_ms", allow_none=False)
        self.lease_ms = int(lease_s * 1000)
        self._engine = engine = open_engine(path, synchronous=synchronous,
                                            busy_timeout=busy_timeout, max_bytes=max_bytes,
                                            readonly=readonly)
        self.readonly = engine.readonly
        self._waiters = _Waiters()
        self._reaper = None
        self._reap_batches = {}     # kind of reap step: the batch size it last reached (_reap)
        self._ids = _IdSequence()
        self._recovery = _Recovery(self)
        self.schedules = Schedules(self)    # periodic tasks: store.schedules.add(...)
        self._queue = _Queue(self)          # delays, priorities, limits per kind: the claim
        self._retries = _Retries(self)      # a failure's retry, and dead letters run again
        self._inputs = _Inputs(self)        # input requests, whole or in parts
        self._log = _EventLog(self)         # events, snapshots, progress: no status change
        engine.on_remote(self._told)
        if recover_on_open and not self.readonly:
            self.recover()

    # -- plumbing --------------------------------------------------------------

    def _get_locked(self, task_id, principal=None, decode=True, summary=False):
        """The task as *principal* may see it, else the right error; *decode* False: its row.

        *summary*: the row holds TaskSummary's columns instead of Task's.
        """
        if not isinstance(task_id, str):
            raise InvalidParams("task id must be a string", param="task_id")
        if not task_id.isascii():
            raise TaskNotFound(task_id)     # never an id; the message escapes it
        row = self._engine.task_row_at(task_id, int(self.clock() * 1000), summary)
        if row is None or (principal is not None and row[
                _SUMMARY_PRINCIPAL_INDEX if summary else _PRINCIPAL_INDEX] != principal):
            if row is None and self._engine.tombstoned(task_id):
                raise TaskExpired(task_id)
            raise TaskNotFound(task_id)
        if row[-1]:
            raise TaskExpired(task_id)     # not reaped yet, expired all the same
        if not decode:
            return row[:-1]
        return _summary_from_row(row[:-1]) if summary else _task_from_row(row[:-1])

    def _move(self, task_id, event, *, principal=None, attempt=None, fields=None, error=None,
              claim_next=None, assume=None):
        """Run one transition, committed before it returns; return the new Task.

        With *claim_next*, ``(Task, claimed)``: see ``succeed``.  *assume*:
        see ``_transition_locked`` (a principal's task is read first).
        """
        now = int(self.clock() * 1000)
        task, claimed, more = self._queue.write(lambda: _transition_locked(
            self, task_id if principal is None else self._get_locked(task_id, principal),
            event, now, attempt=attempt, fields=fields, error=error, assume=assume), claim_next)
        self._waiters.committed((_Change(task, "status"), *more), task.status == QUEUED)
        return task if claim_next is None else (task, claimed)

    def _told(self, kind, ids):
        """Another process committed (the engine's ``on_remote``): tell who waits here.

        A schedule's change wakes the runners' schedulers (``Schedules``);
        the rest is the waiters' (``_Waiters.told``); ``lost`` news may have
        been either.
        """
        if kind in ("schedules", "lost"):
            self.schedules.written()
        if kind != "schedules":
            self._waiters.told(kind, ids)

    # -- creating and reading --------------------------------------------------

    def create(self, kind, payload=None, *, ttl_ms=None, retention_ms=None, policy="fail",
               principal=None, meta=None, idempotency=None, prefix="task", status_message=None,
               owner=None, run_at=None, delay=None, priority=DEFAULT_PRIORITY, retry=None):
        """Create a queued task, persisted with its first event before this returns.

        Args:
            kind: the task type; a runner claims the kinds it has handlers for.
            payload: any JSON value, handed to the handler.
            ttl_ms: MCP-style retention counted from creation, capped at
                ``max_ttl_ms``; the granted value is ``Task.ttl_ms``.
            retention_ms: LMSP-style retention counted from the terminal status.
            policy: what a restart does to the unfinished task: ``fail``,
                ``retry`` or ``resume``.
            principal: the owner; reads with another principal see nothing.
            meta: a JSON object kept for the adapters (never shown raw).
            idempotency: ``(scope, key, fingerprint, expires_in_ms)``: the
                same scope and key return the first task (``replayed=True``).
            owner: a runner registration (``Runner.process_id``) that answers
                for the task while it is still queued: if that process dies
                first, recovery applies the policy (``fail``: failed with
                ``CRASH_RECOVERY``) instead of leaving the task for anyone.
                MCP uses it; by default a queued task belongs to no one.
            run_at, delay: not before then: epoch seconds or an RFC 3339
                time, or a delay in seconds.  The task is queued at once,
                and no claim takes it earlier (``Task.run_at``).
            priority: an integer; higher is claimed first, then oldest first.
            retry: a retry policy (``Retry``, a dict of its fields, or a
                number of attempts): a failing handler's task runs again
                after a backoff, up to ``max_attempts`` in all.

        Raises:
            InvalidParams: a bad argument (``param`` names it).
            IdempotencyMismatch: the key was used with another fingerprint.
            TaskExpired: the key's task was already purged.
        """
        spec = _new_task(self.max_ttl_ms, kind, payload, ttl_ms, retention_ms, policy, principal,
                         meta, prefix, status_message, owner,
                         now=None if run_at is None and delay is None else
                         int(self.clock() * 1000),
                         run_at=run_at, delay=delay, priority=priority, retry=retry)
        if idempotency is None:
            task = self._engine.write(lambda: _insert_tasks_locked(self, (spec,))[0])
        else:
            task = self._engine.write(_create_once(self, spec, idempotency))
            if isinstance(task, str):
                return _replayed(self, task)        # nothing written
        if task.run_at is not None:
            self._queue.delayed(task.run_at)
        self._waiters.committed((_Change(task, "created"),), queued=True)
        return task

    def create_many(self, kind, payloads, *, ttl_ms=None, retention_ms=None, policy="fail",
                    principal=None, meta=None, prefix="task", status_message=None, owner=None,
                    run_at=None, delay=None, priority=DEFAULT_PRIORITY, retry=None):
        """Create one queued task per item of *payloads*, all in one transaction.

        The batch API: the tasks share *kind* and the options (as in
        ``create``), and are committed together, each with its first event,
        before this returns: all of them or, on an error, none.  Returns
        their Tasks in the order of *payloads*.  One commit for the lot is
        what makes it cheaper per task than ``create``; a very large batch
        holds the write lock for as long as it takes, so split it in the
        thousands if other writers must not wait.

        Raises:
            InvalidParams: a bad argument; for a bad payload ``param`` is
                ``payloads[i]``.  Nothing is created.
        """
        if not isinstance(payloads, (list, tuple)):
            raise InvalidParams("payloads must be a list of JSON values", param="payloads")
        if not payloads:
            return []
        first = _new_task(self.max_ttl_ms, kind, payloads[0], ttl_ms, retention_ms, policy,
                          principal, meta, prefix, status_message, owner, param="payloads[0]",
                          now=int(self.clock() * 1000), run_at=run_at, delay=delay,
                          priority=priority, retry=retry)
        specs = [first]
        for i, payload in enumerate(payloads[1:], 1):
            payload_json, payload = _payload(payload, f"payloads[{i}]")
            specs.append(first._replace(payload=payload, payload_json=payload_json))
        tasks = self._engine.write(lambda: _insert_tasks_locked(self, specs))
        self._queue.delayed(first.run_at)
        self._waiters.committed((_Change(task, "created") for task in tasks), queued=True)
        return tasks

    def get(self, task_id, *, principal=None):
        """Return the task.

        Raises:
            TaskNotFound: no such task, or it belongs to another principal.
            TaskExpired: its retention is over (``reap`` has deleted it, or
                will: the answer is the same either way), for a while after.
        """
        with self._engine.reading():
            row = self._get_locked(task_id, principal, decode=False)
        return _task_from_row(row)       # decoded outside the lock

    def summary(self, task_id, *, principal=None):
        """Return the task's ``TaskSummary``: ``get`` without the payload, result, meta and input.

        For polling a task's status: it reads and decodes a fraction of what
        ``get`` does.  Raises what ``get`` raises.
        """
        with self._engine.reading():
            row = self._get_locked(task_id, principal, decode=False, summary=True)
        return _summary_from_row(row)

    def list(self, *, status=None, kind=None, principal=None, limit=50, cursor=None,
             error_code=None):
        """Return ``(tasks, next_cursor)``, newest first; filters combine with AND.

        *status* and *kind* take one value or several.  *error_code* lists
        failed tasks whose error has that code (dead letters).  ``next_cursor`` is
        None on the last page.  Expired tasks are never listed, reaped or not.

        Raises:
            InvalidParams: a bad filter or limit.
            InvalidCursor: *cursor* is not one this method returned.
        """
        statuses = _as_tuple(status, "status", STATES)
        kinds = _as_tuple(kind, "kind")
        _check_str(principal, "principal")
        limit = _check_int(limit, "limit", minimum=1, allow_none=False)
        before = None if cursor is None else _decode_cursor(cursor)
        if error_code is not None:
            if isinstance(error_code, bool) or not isinstance(error_code, (str, int)) \
                    or len(str(error_code)) > 200:
                raise InvalidParams("error_code must be a string or an integer",
                                    param="error_code")
            # Only a failed task has an error code; the list walks the failed ones.
            statuses = tuple(s for s in statuses or (FAILED,) if s == FAILED)
            if not statuses:
                return [], None
        with self._engine.reading() as engine:
            rows = engine.list_tasks(int(self.clock() * 1000), statuses, kinds, principal,
                                     before, limit + 1, error_code=error_code)
        tasks = [_task_from_row(r) for r in rows[:limit]]
        return tasks, (_encode_cursor(tasks[-1].id) if len(rows) > limit else None)

    def unfinished(self):
        """``[(kind, status, count, oldest created_at)]`` of the tasks not finished yet.

        For monitoring (``/metrics``): read through the indexes of queued
        tasks and of the work in flight, so it costs what is waiting and
        running, never the finished tasks kept.
        """
        with self._engine.reading() as engine:
            return engine.unfinished_counts()

    def events(self, task_id, *, after=None, limit=None, principal=None):
        """Return the task's events with ``seq > after`` (all when *after* is None), in order.

        Raises:
            TaskNotFound, TaskExpired: as ``get``.
            InvalidCursor: *after* is negative or beyond the last event.
            EventsExpired: the events asked for were pruned.
        """
        return self._log.read(task_id, after, limit, principal)

    def wait(self, task_id, *, timeout, since_version=None, terminal=False, principal=None):
        """Block until the task changes or ends, then return it.

        Returns when ``task.version != since_version`` (any visible change),
        or, with ``terminal=True``, when the task is terminal (with neither,
        at once); on *timeout*
        (seconds) it returns the task as it is.  A write in this process
        wakes it at once; another process's write within ``poll_interval``.

        Raises:
            TaskNotFound, TaskExpired: as ``get``.
            StoreClosed: the store was closed while waiting.
        """
        def read():
            with self._engine.reading():
                return self._get_locked(task_id, principal)

        def done(task):
            return (terminal and task.terminal) or (
                since_version is not None and task.version != since_version) or (
                since_version is None and not terminal)
        return self._waiters.until(read, done, timeout, self.poll_interval)

    def wait_any(self, last_seqs, *, timeout):
        """Block until some of the tasks have events the caller has not seen; return them.

        *last_seqs* maps task ids to the last event ``seq`` the caller has
        handled.  Returns ``{task_id: Task}`` for every task whose ``last_seq``
        is past it (``None`` for a task that no longer exists) as soon as
        there is one, or ``{}`` after *timeout* seconds.  Like ``wait``, a
        write in this process wakes it at once and another process's write
        is seen within ``poll_interval``: no busy polling, whatever the count,
        and a long list never holds up writers (see the engine's ``tasks_past``).

        Raises:
            StoreClosed: the store was closed while waiting.
        """
        return self._waiters.until(lambda: self._engine.tasks_past(last_seqs), bool, timeout,
                                   self.poll_interval)

    def load_snapshot(self, task_id):
        """Return the task's last saved snapshot, or None."""
        return self._log.load_snapshot(task_id)

    def secret(self, name):
        """Return the store's secret *name* (64 hex digits), made on first use.

        The same value for every process and replica on this database, so a
        front may sign what it hands a client (MCP's ``requestState``) and
        any of them verify it.  Made from ``secrets.token_hex(32)`` by the
        first caller and kept in the ``secrets`` table; a read-only store
        that has none raises StoreUnavailable.
        """
        with self._engine.reading() as engine:
            value = engine.secret(name, None, None)
        if value is None:
            if self.readonly:
                raise StoreUnavailable(f"the store has no secret {name!r} and is read-only")
            now = int(self.clock() * 1000)
            value = self._engine.write(
                lambda: self._engine.secret(name, lambda: secrets.token_hex(32), now))
        return value

    # -- moving tasks ----------------------------------------------------------

    def cancel(self, task_id, *, principal=None, reason=None, refuse_repeat=False):
        """Cancel a task and return it.

        A queued task is ``cancelled`` at once; a loading, running or
        input_required one becomes ``cancelling`` until its work stops.
        Cancelling a cancelling or cancelled task (``CANCELLED_STATES``)
        returns it unchanged, or with *refuse_repeat* raises NotCancelable
        (MCP 2025-11-25 shows both as the terminal ``cancelled``).  The
        task's in-process cancel event is set after the commit.

        Raises:
            NotCancelable: the task already succeeded or failed, or it was
                cancelled already and *refuse_repeat* is true.
            TaskNotFound, TaskExpired: as ``get``.
        """
        _check_str(reason, "reason", max_len=10000)
        now = int(self.clock() * 1000)

        def body():
            task = self._get_locked(task_id, principal)
            if refuse_repeat or task.status not in CANCELLED_STATES:
                return _transition_locked(self, task, CANCEL, now, message=reason), True
            return task, False
        task, moved = self._engine.write(body)
        self._waiters.committed((_Change(task, "status"),) if moved else ())
        if task.status == CANCELLING:
            self._waiters.cancel_set(task_id)
        return task

    def succeed(self, task_id, result=None, *, attempt=None, claim_next=None):
        """Finish a running task with a JSON *result* (used by the runner).

        *claim_next* (a worker that goes on: ``claim``'s keyword arguments
        as a dict) claims its next task in the same transaction, after the
        move, so one commit serves both; the return is then ``(task,
        claimed)``, claimed None when there was none.  A move refused
        claims nothing.  ``fail`` and ``confirm_cancel`` take it too.
        """
        return self._move(task_id, SUCCEED, attempt=attempt, claim_next=claim_next,
                          fields={"result": _json_param(result, "result")}, assume=RUNNING)

    def fail(self, task_id, error, *, result=None, attempt=None, retryable=False, retry=None,
             claim_next=None):
        """Fail a task with *error* ``{"code", "message", ...}`` and an optional result.

        With *retryable* (the runner passes it for a handler that raised),
        ``FAILURE`` decides: a task with attempts left under its retry policy
        (its own, else *retry*, the runner's default for its kind) goes back
        to ``queued`` with a not-before time (the backoff) and the next
        attempt number, *error* in its event; otherwise it fails, with the
        number of attempts in its error when it had a policy.  Returns the task.
        """
        if not isinstance(error, dict) or not isinstance(error.get("message"), str) \
                or not isinstance(error.get("code"), (str, int)):
            raise InvalidParams("error must be an object with a code and a message", param="error")
        fields = {"error": _json_param(error, "error"), "status_message": error["message"],
                  "result": None if result is None else _json_param(result, "result")}
        if not retryable and retry is None:
            return self._move(task_id, FAIL, attempt=attempt, error=error, fields=fields,
                              claim_next=claim_next)
        return self._retries.fail(task_id, error, fields, attempt, retryable, retry, claim_next)

    def rerun(self, task_id, *, principal=None, run_at=None, delay=None):
        """Dead letters: run a failed task again, as a new queued task; return it.

        The new task has the old one's kind, payload, options and retry
        policy, the next attempt number (``attempt + 1``), and its
        ``created`` event names the old one (``rerun_of``).  The old task
        keeps its status and history: a terminal status never changes, so
        no client that saw it fail sees it run again.  ``RERUNNABLE`` says
        which statuses may be run again.

        Raises:
            InvalidTransition: the task did not fail.
            TaskNotFound, TaskExpired: as ``get``.
        """
        return self._retries.rerun(task_id, principal, run_at, delay)

    def start(self, task_id, *, attempt=None):
        """Move a queued or loading task to ``running`` (used by the runner)."""
        return self._move(task_id, START, attempt=attempt)

    def confirm_cancel(self, task_id, *, result=None, attempt=None, claim_next=None):
        """Move a ``cancelling`` task to ``cancelled`` once its work stopped.

        *result* keeps what the work produced before it stopped (LMSP shows
        the partial response of a cancelled task).
        """
        fields = None if result is None else {"result": _json_param(result, "result")}
        return self._move(task_id, CONFIRM_CANCEL, attempt=attempt, fields=fields,
                          claim_next=claim_next)

    def require_input(self, task_id, request, *, attempt=None):
        """Park a running task in ``input_required`` with a JSON *request* for the requestor."""
        return self._inputs.ask(task_id, request, attempt)

    def provide_input(self, task_id, answer, *, principal=None):
        """Answer the pending input request; the task goes back to ``running``.

        A request in parts (``{"parts": {key: request, ...}}``: several
        questions asked at once) is answered part by part: *answer*
        ``{"parts": {key: answer, ...}}`` answers any of the parts still
        pending and the others are ignored (answered already, or never
        asked).  Until the last part is answered the task stays
        ``input_required``, its ``input_request`` holding only the parts
        still pending and its ``input_answer`` those answered (a write, not
        a status change: no event); the last one moves it to ``running``
        with every part's answer.  Either way it is the table's
        ``provide_input`` that decides whether the task takes an answer.

        Raises:
            InvalidTransition: the task is not waiting for input (already
                answered, cancelled, or finished).
        """
        return self._inputs.answer(task_id, answer, principal)

    # -- work's records, and listeners -----------------------------------------

    def set_progress(self, task_id, *, progress=None, total=None, message=_MISSING,
                     attempt=None):
        """Record progress and/or the status message of an unfinished task.

        Not a status change, so it appends no event; it bumps ``version`` so
        waiters see it.  Returns False when the task has already ended.
        """
        return self._log.progress(task_id, progress, total, message, attempt)

    def emit(self, task_id, etype, data=None, *, snapshot=_MISSING, attempt=None):
        """Append one event (and optionally save a snapshot) atomically; return its seq.

        Allowed while the task is loading, running, waiting for input or
        cancelling.  Saving the snapshot in the same transaction as the event
        is what lets ``resume`` continue without repeating output.

        Raises:
            InvalidTransition: the task has ended (or was requeued).
        """
        return self._log.append(task_id, etype, data, snapshot, attempt)

    def save_snapshot(self, task_id, snapshot, *, attempt=None):
        """Save a JSON snapshot the task can resume from after a restart."""
        self._log.save_snapshot(task_id, snapshot, attempt)

    def cancel_event(self, task_id):
        """Return the ``threading.Event`` set when this task is cancelled (in this process)."""
        return self._waiters.cancel_event(task_id)

    def add_listener(self, listener):
        """Call ``listener(task, change)`` after every committed change.

        *change* is ``created``, ``status``, ``progress`` or ``event``.  It
        runs in the writer's thread, after the commit, outside the lock: keep
        it short and never let it block.  *task* is the task as that change
        wrote it; two writers' calls may come in either order (a newer
        ``version`` is the newer news).
        """
        self._waiters.listeners.append(listener)

    def remove_listener(self, listener):
        """Stop calling *listener*."""
        with contextlib.suppress(ValueError):
            self._waiters.listeners.remove(listener)

    # -- runners: claiming, limits per kind, ownership -------------------------

    def claim(self, kinds, *, owner, loading_kinds=()):
        """Claim the oldest queued task of *kinds* for *owner*; return it, or None when there is none.

        The claimed task is ``loading`` if its kind is in *loading_kinds*
        (its worker says when the work runs, with ``start``), else
        ``running``.  *owner* is a registration from ``register_process``:
        while it heartbeats the task is its own; once it is dead, recovery
        applies the task's restart policy.  Each queued task is claimed
        exactly once, whatever the number of workers and processes.  A
        worker moves the task on with ``start``, ``emit``, ``set_progress``,
        ``require_input`` and finishes it with ``succeed``, ``fail`` or,
        after a cancel, ``confirm_cancel``, each with ``attempt=task.attempt``.
        Does not block (see ``wait_for_work``).

        Raises:
            StoreClosed, StoreUnavailable: the store cannot be used.
        """
        return self._queue.claim(kinds, owner, loading_kinds)

    def wait_for_work(self, seen, timeout):
        """Block until a task may have become queued in this process; return a generation.

        Pass the generation the last call returned (None at first): the call
        returns at once if work was queued since, else waits at most
        *timeout* seconds.  A create in this process wakes it at once; work
        queued by another process is only seen by the next ``claim``, so
        keep *timeout* short (the runner uses ``poll_interval``).  Returns
        at once once the store is closed (the next ``claim`` raises).  A
        delayed task this store knows of cuts the wait short at its time.
        """
        return self._waiters.wait_for_work(seen, self._queue.wait_s(timeout))

    def wake_workers(self):
        """End every ``wait_for_work`` now (a runner stopping): each returns a new generation.

        The generation moves on, so a worker about to wait returns at once too.
        """
        self._waiters.wake_workers()

    def set_kind_limit(self, kind, max_running):
        """At most *max_running* tasks of *kind* run at once, in every process (None: no limit).

        Stored in the database, so every process sharing it agrees; each
        claim of a limited kind counts the kind's running tasks in its own
        transaction.  Tasks already running above a lowered limit run on.
        """
        self._queue.set_limit(kind, max_running)

    def kind_limits(self):
        """``{kind: max_running}``: every limit per kind stored."""
        return self._queue.limits()

    def register_process(self):
        """Register this process as a task owner; return its registration id."""
        now = int(self.clock() * 1000)
        proc_id = new_id("proc", now)
        self._engine.write(lambda: self._engine.register(proc_id, now))
        self._waiters.committed()
        _LIVE_PROCESS_IDS.add(proc_id)
        return proc_id

    def heartbeat(self, proc_id):
        """Renew the lease of a registration; False when it was declared dead meanwhile.

        On a database other hosts share (PostgreSQL), a live heartbeat also
        runs ``recover()``: a dead process's tasks are recovered within the
        lease plus one heartbeat, not at the reaper's next pass.
        """
        now = int(self.clock() * 1000)
        alive = self._engine.write(lambda: self._engine.heartbeat(proc_id, now))
        self._waiters.committed()
        if alive and self._engine.shared:
            # The lease was renewed whatever happens here: an outage now is
            # the next heartbeat's to meet, and its recover() tries again.
            with contextlib.suppress(StoreUnavailable):
                self.recover()
        return alive

    def cancelling_owned(self, owner):
        """Return the ids of the tasks *owner* holds that are ``cancelling``.

        A worker polls this (the runner does with each heartbeat) to learn
        of cancels made in other processes; within this process
        ``cancel_event`` is set at once.
        """
        with self._engine.reading() as engine:
            return engine.cancelling_of(owner)

    def release(self, proc_id, reason="the process running this task stopped", *, present=None,
                tally=None):
        """Apply the restart policy to every unfinished task *proc_id* owns; unregister it.

        A runner calls this when it shuts down; ``recover`` calls it for
        owners that died, with *present*: the ``(status, policy)`` pairs of
        the owner's unfinished tasks as it just read them, so no batch has to
        count them again.  (A pair that appears later, say a client's cancel
        meanwhile, is left to the next ``recover``: the task still names the
        owner, whose registration is gone by then.)  Works set-based, in
        transactions of at most ``RELEASE_BATCH`` tasks.  Returns how many
        tasks it moved; *tally*, a dict, gets how many of them each policy
        moved added to it (key ``cancelling`` for cancels completed).
        """
        return self._recovery.release(proc_id, reason, present, tally)

    def recover(self, now=None):
        """Apply the restart policy to unfinished tasks whose owner is provably dead.

        Dead means: its registration is gone, its heartbeat lease expired, or
        (same host) its pid is gone or belongs to a later process.  Tasks of
        live owners, in this process or another, are never touched.  Runs at
        open (unless disabled) and with every reaper pass; idempotent.
        Returns how many tasks it moved.
        """
        return self._recovery.recover(now)

    def awaiting_recovery(self, tasks, now=None):
        """Return the ids of *tasks* that the next ``recover()`` will hand to their policy.

        Those are the unfinished tasks whose owner is provably dead, by the
        very rule recovery applies (the engine's ``owner_dead``); until some process
        runs ``recover()`` (any server opening the file, its reaper, or
        ``taskstore tasks recover``) they still show the status they had
        when their process died.
        """
        return self._recovery.awaiting(tasks, now)

    # -- retention -------------------------------------------------------------

    def reap(self, now=None, *, batch_rows=REAP_BATCH_ROWS):
        """Delete what retention says is over, at most *batch_rows* tasks per transaction.

        Terminal tasks past ``purge_at`` go with their events and leave a
        tombstone; events of finished tasks past ``event_retention_ms`` are
        pruned; expired idempotency keys and tombstones are dropped.
        Unfinished tasks are never deleted.  Returns counts per kind.
        """
        return _reap(self, int(self.clock() * 1000) if now is None else now, batch_rows)

    def checkpoint(self):
        """Copy the whole WAL into the database file now, and empty the WAL.

        Checkpoints normally happen in the background (``_Checkpointer``);
        call this before copying the file, or to measure something on a
        quiet disk.  It waits (up to the busy timeout) for a checkpoint or a
        reader in progress.  Returns ``(wal_pages, copied_pages)`` as SQLite
        reports them.
        """
        with self._engine.reading() as engine:
            return engine.checkpoint()

    def start_reaper(self, interval=DEFAULT_REAP_INTERVAL_S):
        """Start the opt-in reaper thread: ``reap()`` and ``recover()`` every *interval* s.

        ``close()`` stops it.  Returns the thread.
        """
        with self._waiters.lock:
            if self._waiters.closed:
                raise StoreClosed()
            if self._reaper is None:
                self._reaper = Reaper(self, interval)
                self._reaper.start()
            return self._reaper

    # -- closing ---------------------------------------------------------------

    def close(self):
        """Wake every waiter, stop the reaper, close the connection.  Idempotent.

        Later calls raise StoreClosed.
        """
        if not self._waiters.close():
            return
        with self._engine.lock:
            self._engine.shut()
        with self._waiters.lock:
            reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.stop()
        self._engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Queue:
    """What a claim takes, and when: delays, priorities and limits per kind (``TaskStore.claim``).

    The claim itself lives here (``_Claim``, one body for ``claim`` and for
    a worker's claim in its finish's transaction, ``write``): it makes due
    delayed tasks ready, takes the oldest task of the highest priority
    among the kinds asked for, and passes over a kind whose limit is
    reached, all in one transaction.  So do the limits per kind (rows of
    ``kind_limits``) and the hint of when a delayed task may next be due
    (``due_at``): a claim reads the delayed tasks only once one may be due,
    and an idle worker's sleep ends by then.
    """

    def __init__(self, store):
        self.store = store
        # When a delayed task may next be due (epoch ms): a hint, never the
        # rule (the claim reads run_at itself).  It is lowered by this
        # process's own delayed creates and retries, and re-read from the
        # database at most every poll_interval (other processes' delays).
        self.due_at = 0

    def delayed(self, run_at):
        """A task of this process waits until *run_at*: the next due check comes no later."""
        if run_at is not None and run_at < self.due_at:
            self.due_at = run_at

    def due(self, now):
        """Whether a delayed task may be due at *now*; the hint re-read when it is stale."""
        store = self.store
        if now < self.due_at and not store._waiters.delays_changed:
            return False
        store._waiters.delays_changed = False
        with store._engine.reading() as engine:
            due = engine.next_due()
        self.due_at = min(math.inf if due is None else due, now + int(store.poll_interval * 1000))
        return due is not None and due <= now

    def wait_s(self, timeout):
        """How long ``wait_for_work`` may sleep: *timeout*, cut short by the next delayed task."""
        due_in = (self.due_at - self.store.clock() * 1000) / 1000
        return max(0.0, min(timeout, due_in))

    def claim(self, kinds, owner, loading_kinds):
        """``TaskStore.claim``: one transaction; the claimed Task, or None."""
        claim = _Claim(self, kinds, owner, loading_kinds)
        if not claim.wanted:
            return None
        task = self.store._engine.write(claim.take)
        self.store._waiters.committed(claim.told(task))
        return task

    def write(self, body, claim_next):
        """Run a worker's finish, *body*; with *claim_next* its next claim after it, in one body.

        *claim_next* is None, or ``claim``'s keyword arguments: then the
        claim runs in the same transaction as the finish, after its move
        (so a kind's limit counts the finished task out), and one commit
        serves both.  A move that raises writes nothing and claims nothing.
        Returns ``(body's result, the claimed Task or None, the claim's
        _Changes)``; the caller tells the waiters, the finish's changes first.
        """
        engine = self.store._engine
        if claim_next is None:
            return engine.write(body), None, ()
        claim = _Claim(self, **claim_next)
        task, claimed = engine.write(lambda: (body(), claim.take()))
        return task, claimed, claim.told(claimed)

    def set_limit(self, kind, max_running):
        """``TaskStore.set_kind_limit``: store the limit, then wake idle workers of this process."""
        store = self.store
        _check_str(kind, "kind", allow_none=False, max_len=200)
        _check_int(max_running, "max_running", maximum=2**31 - 1)
        now = int(store.clock() * 1000)
        store._engine.write(lambda: store._engine.set_kind_limit(kind, max_running, now))
        store._waiters.committed(queued=True)        # a raised limit: idle workers look again

    def limits(self):
        """``{kind: max_running}``: every limit per kind stored."""
        with self.store._engine.reading() as engine:
            return engine.kind_limits()


class _Claim:
    """One claim (``_Queue.claim``, or a worker's next after its finish: ``_Queue.write``).

    Made before the transaction: the clock read, whether delayed tasks may
    be due (then the claim makes them ready first), and whether a task may
    be queued at all (``wanted``: without one the claim writes nothing).
    ``take`` is the claim's statements, in the write's transaction;
    ``told``, once it has committed, the changes to tell the waiters.
    """

    __slots__ = ("queue", "kinds", "owner", "loading_kinds", "now", "due", "wanted")

    def __init__(self, queue, kinds, owner, loading_kinds=()):
        store = queue.store
        waiters = store._waiters
        self.queue, self.kinds, self.owner, self.loading_kinds = queue, kinds, owner, loading_kinds
        self.now = now = int(store.clock() * 1000)
        self.due = bool(kinds) and (now >= queue.due_at or waiters.delays_changed) \
            and queue.due(now)
        self.wanted = self.due or bool(kinds) and store._engine.may_have_queued(
            kinds, waiters.work_gen)

    def take(self):
        """The claim, inside a write transaction: the claimed Task, or None."""
        if not self.wanted:
            return None
        store, now = self.queue.store, self.now
        engine = store._engine
        if self.due:
            engine.promote_due(now, PROMOTE_BATCH)
        wanted, gen = self.kinds, store._waiters.work_gen
        while wanted:
            found = engine.oldest_queued(wanted, gen)
            if found is None:
                return None
            task, limit = found
            # A limited kind: its running tasks counted in this very
            # transaction (on PostgreSQL, its limit row locked first).
            if limit is not None:
                running, limit = engine.running_of_kind(task.kind)
            if limit is None or running < limit:
                return _transition_locked(
                    store, task, CLAIM if task.kind in self.loading_kinds else START, now,
                    fields={"owner": self.owner})
            wanted, gen = tuple(k for k in wanted if k != task.kind), None
        return None

    def told(self, task):
        """After the commit: the claim's changes (none when it took nothing)."""
        if self.due:
            self.queue.due_at = self.now        # more may be due: the next claim reads again
        return () if task is None else (_Change(task, "status"),)


class _Retries:
    """A failure that may run again: ``FAILURE``'s retry with backoff, and dead letters rerun.

    ``TaskStore.fail`` for a handler that raised (or under a retry policy)
    asks the table whether the task goes back to ``queued`` after a
    backoff or fails for good; ``TaskStore.rerun`` runs a failed task (a
    dead letter) again as a new task.  Either way the task that runs again
    has the next attempt number and, when delayed, a not-before time that
    the claim (``_Queue``) honours.
    """

    def __init__(self, store):
        self.store = store

    def fail(self, task_id, error, fields, attempt, retryable, retry, claim_next):
        """``TaskStore.fail`` with a retry to decide: one transaction; the Task as written.

        With *claim_next*, ``(Task, claimed)``: ``_Queue.write``.
        """
        store = self.store
        default = _retry_param(retry)
        now = int(store.clock() * 1000)

        def body():
            task = store._engine.read_task(task_id)
            if task is None:
                raise TaskNotFound(task_id)
            policy = default if task.retry is None else Retry(**task.retry)
            left = policy is not None and task.attempt < policy.max_attempts
            event = FAILURE["retryable" if retryable else "no retry"][
                "left" if left else "none left"]
            if event == REQUEUE:
                run_at = now + policy.delay_ms(task.attempt)
                message = (f"attempt {task.attempt} of {policy.max_attempts} failed; "
                           f"attempt {task.attempt + 1} not before {iso_time(run_at)}")
                again = {"owner": None, "run_at": run_at, "attempt": task.attempt + 1,
                         "input_request": None, "input_answer": None, "progress": None,
                         "progress_total": None, "status_message": message}
                if not RESTART_KEEPS_SNAPSHOT.get(task.policy, False):
                    again["snapshot"] = None        # the next attempt starts from the beginning
                return _transition_locked(store, task, REQUEUE, now, attempt=attempt,
                                          fields=again, message=message, error=error)
            failed, shown = fields, error
            if policy is not None and retryable:      # the last attempt: say how many there were
                shown = dict(error, attempts=task.attempt)
                failed = dict(fields, error=_json_param(shown, "error"))
            return _transition_locked(store, task, FAIL, now, attempt=attempt, fields=failed,
                                      error=shown)
        task, claimed, more = store._queue.write(body, claim_next)
        requeued = task.status == QUEUED
        if requeued:
            store._waiters.cancel_events.pop(task_id, None)    # not the next attempt's
            store._queue.delayed(task.run_at)
        store._waiters.committed((_Change(task, "status"), *more), requeued)
        return task if claim_next is None else (task, claimed)

    def rerun(self, task_id, principal, run_at, delay):
        """``TaskStore.rerun``: the new queued Task, inserted in one transaction."""
        store = self.store
        now = int(store.clock() * 1000)
        not_before = _not_before(now, run_at, delay)

        def body():
            old = store._get_locked(task_id, principal)
            if old.status not in RERUNNABLE:
                raise InvalidTransition(task_id, old.status, "rerun")
            retry = None if old.retry is None else Retry(**old.retry)
            spec = _NewTask(
                old.kind, old.payload, dumps(old.payload), old.ttl_ms, old.retention_ms,
                old.policy, old.principal, old.meta or None,
                dumps(old.meta) if old.meta else None, old.id.rpartition("_")[0], None, None,
                False, None if not_before is None or not_before <= now else not_before,
                old.priority,
                retry, None if retry is None else dumps(retry._asdict()), old.id)
            return _insert_tasks_locked(store, (spec,), now, attempt=old.attempt + 1)[0]
        task = store._engine.write(body)
        store._queue.delayed(task.run_at)
        store._waiters.committed((_Change(task, "created"),), queued=True)
        return task


class _Inputs:
    """Input requests: a running task asks (``require_input``), the requestor answers.

    An answer is whole, or, for a request in parts (``{"parts": {key:
    request}}``), part by part: the task waits until its last part is
    answered.  Whether a task takes an answer is the table's
    ``provide_input``; a part answered before the last is a write, not a
    status change.
    """

    def __init__(self, store):
        self.store = store

    def ask(self, task_id, request, attempt):
        """``TaskStore.require_input``: park the running task with *request*; the Task."""
        if not isinstance(request, dict):
            raise InvalidParams("request must be a JSON object", param="request")
        return self.store._move(task_id, REQUIRE_INPUT, attempt=attempt, fields={
            "input_request": _json_param(request, "request"), "input_answer": None})

    def answer(self, task_id, answer, principal):
        """``TaskStore.provide_input``: answer the request, whole or some of its parts; the Task."""
        parts = answer.get("parts") if isinstance(answer, dict) else None
        if isinstance(parts, dict):
            return self._answer_parts(task_id, parts, principal)
        return self.store._move(task_id, PROVIDE_INPUT, principal=principal, fields={
            "input_answer": _json_param(answer, "answer"), "input_request": None})

    def _answer_parts(self, task_id, parts, principal):
        """``provide_input`` for a request in parts; one transaction."""
        store = self.store
        engine = store._engine
        now = int(store.clock() * 1000)

        def body():
            task = store._get_locked(task_id, principal)
            next_state(task.id, task.status, PROVIDE_INPUT)     # waiting for input, or refused
            pending = (task.input_request or {}).get("parts")
            if not isinstance(pending, dict):
                raise InvalidParams("the task's input request is not in parts", param="answer")
            given = {key: value for key, value in parts.items() if key in pending}
            answered = {**((task.input_answer or {}).get("parts") or {}), **given}
            left = {key: value for key, value in pending.items() if key not in given}
            if not left:
                task = _transition_locked(store, task, PROVIDE_INPUT, now, fields={
                    "input_answer": _json_param({"parts": answered}, "answer"),
                    "input_request": None})
                return task, (_Change(task, "status"),)
            if given and engine.set_progress(task.id, {
                    "input_request": _json_param({"parts": left}, "request"),
                    "input_answer": _json_param({"parts": answered}, "answer")},
                    _TAKES_INPUT, None, now):
                task = engine.read_task(task.id)
                return task, (_Change(task, "input"),)
            return task, ()
        task, changes = engine.write(body)
        store._waiters.committed(changes)
        return task


class _EventLog:
    """The event log, and what work records beside its status: events, snapshots, progress.

    None of these is a status change (those are ``_transition_locked``'s,
    which appends their ``status`` events itself).  ``emit`` appends an
    event with the task's next sequence number, a snapshot with it or alone
    (``save_snapshot``), so that ``resume`` continues where the work was;
    progress and the status message bump the task's ``version`` and append
    nothing.  Each write is allowed only while the task is unfinished (an
    event or a snapshot: while it is active) and, given an *attempt*, only
    to that attempt.
    """

    def __init__(self, store):
        self.store = store

    def read(self, task_id, after, limit, principal):
        """``TaskStore.events``: the task's events after *after*, in one read."""
        store = self.store
        if after is not None and (isinstance(after, bool) or not isinstance(after, int) or after < 0):
            raise InvalidCursor("after must be a non-negative integer", param="after")
        limit = _check_int(limit, "limit", minimum=1)
        with store._engine.reading() as engine:
            row = engine.event_bounds(task_id, int(store.clock() * 1000))
            if row is None or (principal is not None and row[0] != principal) or row[3]:
                store._get_locked(task_id, principal)       # raises the right not-found error
            _, last_seq, first_seq, _, kind, created_at, status, finished_at = row
            if after is not None and after > last_seq:
                raise InvalidCursor(f"after {after} is beyond the last event {last_seq}",
                                    param="after")
            start = 0 if after is None else after + 1
            if start < first_seq:
                raise EventsExpired(task_id, first_seq)
            rows = engine.read_events(task_id, start, limit)
        # The events a row stands for, where the log holds none: a plain
        # task's created event (schema 5) and a plain finish from running
        # (schema 6), which is the last event, so only a read that reached
        # the end of the stored log can lack it.
        made = []
        if not start and (not rows or rows[0][0]):
            made.append((0, "created", _created_data(kind), created_at))
        made += rows
        if status in TERMINAL_STATES and start <= last_seq \
                and (not made or made[-1][0] < last_seq) and (limit is None or len(rows) < limit):
            made.append((last_seq, "status", _plain_status_json(_ROW_LOGGED_FROM, status),
                         finished_at))
        rows = made[:limit]
        # The data stays JSON text until someone reads Event.data.
        return [_new_tuple(Event, (task_id, *row)) for row in rows]

    def append(self, task_id, etype, data, snapshot, attempt):
        """``TaskStore.emit``: one event (and the snapshot) in one transaction; its seq."""
        store = self.store
        _check_str(etype, "type", allow_none=False, max_len=200)
        data_json = _json_param({} if data is None else data, "data")
        snap = None if snapshot is _MISSING else _json_param(snapshot, "snapshot")
        now = int(store.clock() * 1000)

        def body():
            row = store._engine.event_head(task_id)
            if row is None:
                raise TaskNotFound(task_id)
            if row[0] not in ACTIVE_STATES or (attempt is not None and row[2] != attempt):
                raise InvalidTransition(task_id, row[0], "emit")
            store._engine.append_event(task_id, row[1] + 1, etype, data_json, snap, now)
            return row[1] + 1, self._as_written_locked(task_id, "event")
        seq, changes = store._engine.write(body)
        store._waiters.committed(changes)
        return seq

    def save_snapshot(self, task_id, snapshot, attempt):
        """``TaskStore.save_snapshot``: one transaction."""
        store = self.store
        snap = _json_param(snapshot, "snapshot")

        def body():
            if not store._engine.save_snapshot(task_id, snap, ACTIVE_STATES, attempt):
                raise InvalidTransition(task_id, "not active", "save_snapshot")
        store._engine.write(body)
        store._waiters.committed()

    def load_snapshot(self, task_id):
        """``TaskStore.load_snapshot``: the snapshot, decoded, or None."""
        store = self.store
        with store._engine.reading() as engine:
            found, snapshot = engine.load_snapshot(task_id)
        if not found:
            raise TaskNotFound(task_id)
        return None if snapshot is None else _loads(snapshot)

    def progress(self, task_id, progress, total, message, attempt):
        """``TaskStore.set_progress``: one transaction; whether the task took it."""
        store = self.store
        now = int(store.clock() * 1000)
        values = {}
        if progress is not None:
            values["progress"] = float(progress)
            values["progress_total"] = None if total is None else float(total)
        if message is not _MISSING:
            values["status_message"] = message

        def body():
            if store._engine.set_progress(task_id, values, UNFINISHED_STATES, attempt, now):
                return True, self._as_written_locked(task_id, "progress")
            return False, ()
        changed, changes = store._engine.write(body)
        store._waiters.committed(changes)
        return changed

    def _as_written_locked(self, task_id, change):
        """The ``_Change`` of a write that did not build the Task: read back, if anyone listens."""
        store = self.store
        if not store._waiters.listeners:
            return ()
        return (_Change(store._engine.read_task(task_id), change),)


class _Recovery:
    """Recovery: the restart table (``RESTART``) applied to the tasks of owners that stopped.

    A runner's ``release`` at shutdown, and ``recover`` for owners that died
    without one, move the owner's unfinished tasks set-based, in
    transactions of at most ``RELEASE_BATCH`` tasks; each move is the one
    ``_transition_locked`` would make (``next_state``), with the same
    compare-and-set guard.  TaskStore's ``release``, ``recover`` and
    ``awaiting_recovery`` are this class's.
    """

    def __init__(self, store):
        self.store = store

    def release(self, proc_id, reason, present, tally):
        """``TaskStore.release``: move the owner's tasks batch by batch; unregister it."""
        _LIVE_PROCESS_IDS.discard(proc_id)
        store, engine = self.store, self.store._engine
        # Batches come from the engine (``owner_batch``).  A task this loop
        # could miss would still name the owner, whose registration is gone:
        # the next recover() releases it.
        moved, after, tally = 0, "", {} if tally is None else tally

        def body():
            selector, last = engine.owner_batch(proc_id, after, RELEASE_BATCH, _RECOVERABLE)
            if present is None:
                rows = engine.restart_groups(selector)
            else:
                rows = [(status, policy, None) for status, policy in present]
            # Counted afresh by each run of the body (PostgreSQL may run it
            # again): only the committed run's counts go into the tally.
            counted = {}
            done = self._restart_locked(now, reason, selector, rows, counted)
            if last is None:
                engine.unregister(proc_id)
            return done, last, counted
        with engine.bulk():
            while True:
                now = int(store.clock() * 1000)
                (done, requeued, changes), after, counted = engine.write(body)
                store._waiters.committed(changes, queued=requeued)
                for key, count in counted.items():
                    tally[key] = tally.get(key, 0) + count
                moved += done
                if after is None:
                    return moved

    def _restart_locked(self, now, reason, selector, rows, tally):
        """Apply the restart table to the tasks *selector* selects: ``(moved, requeued, changes)``.

        *rows*: ``[(status, policy, count)]`` of those tasks (count None: not
        counted).  Set-based: recovery moves 100,000 tasks in a few
        statements, not 100,000 round trips.  *tally* gets the moves added per
        policy (``cancelling`` for the cancels completed).  *changes* are the
        moved tasks as written, read only when someone listens.
        """
        store, engine = self.store, self.store._engine
        # Tasks that get the same event and the same fields move together,
        # one status at a time; confirm_cancel writes the same whatever the policy.
        plan, disown = {}, set()
        for status, policy, count in rows:
            event = RESTART[status][policy]
            if event is None:
                disown.add(status)
                continue
            key = (event, None if event == CONFIRM_CANCEL else policy, status)
            plan[key] = None if None in (count, plan.get(key, 0)) else plan.get(key, 0) + count
        moved, requeued, moved_ids = 0, False, []
        for (event, policy, status), count in plan.items():
            new = next_state("(several)", status, event)
            fields, error, requeue = {"status": new}, None, new == QUEUED
            if event == CONFIRM_CANCEL:
                message = reason
            elif requeue:
                message = f"requeued ({policy}): {reason}"
                fields.update(owner=None, input_request=None, input_answer=None,
                              status_message=None)
                if not RESTART_KEEPS_SNAPSHOT[policy]:
                    fields["snapshot"] = None      # retry starts from the beginning
            else:
                message = (f"CRASH_RECOVERY: {reason} before it "
                           f"{'started' if status == QUEUED else 'finished'}")
                error = {"code": "server_restarted", "message": message}
                fields.update(error=dumps(error), status_message=message)
            if status == QUEUED:
                fields["run_at"] = None     # only a queued task has a not-before time
            done, ids = engine.move_tasks(
                selector, status, fields, dumps(_status_data(status, new, message, error)), now,
                ids=bool(store._waiters.listeners or store._waiters.cancel_events), policy=policy,
                bump_attempt=requeue, finish=new in TERMINAL_STATES)
            # One event per moved task, and as many as counted: cannot fail
            # inside the transaction; the guard is the rule.
            if done < 0 or count not in (None, done):
                raise InvalidTransition("(several)", status, event)
            moved_ids += ids or ()
            if new in TERMINAL_STATES or requeue:
                # Terminal: no cancel to signal.  Requeued: the next attempt
                # must not inherit the cancel (or stop) of the one before.
                for task_id in ids or ():
                    store._waiters.cancel_events.pop(task_id, None)
            requeued = requeued or (requeue and done > 0)
            key = CANCELLING if event == CONFIRM_CANCEL else policy
            tally[key] = tally.get(key, 0) + done
            moved += done
        if disown:
            # The task stays where it is for any runner; only its owner goes.
            engine.disown(selector, sorted(disown))
        changes = [_Change(engine.read_task(task_id), "status") for task_id in moved_ids
                   ] if store._waiters.listeners else ()
        return moved, requeued, changes

    def recover(self, now):
        """``TaskStore.recover``: release every provably dead owner; return the tasks moved."""
        store = self.store
        now = int(store.clock() * 1000) if now is None else now
        with store._engine.reading() as engine:
            _, dead = engine.recovery_view(now, store.lease_ms)
        moved, tally = 0, {}
        for proc_id in sorted(dead):
            moved += store.release(proc_id, "the process running this task stopped",
                                   present=dead[proc_id], tally=tally)
        if moved:
            # Once per pass, whoever runs it (a server opening the file, its
            # reaper, the admin command): a crash should never pass unseen.
            logger.warning("recovered %d %s of dead processes: %s", moved,
                           "task" if moved == 1 else "tasks", _describe_recovery(tally))
        return moved

    def awaiting(self, tasks, now):
        """``TaskStore.awaiting_recovery``: the ids of *tasks* whose owner is provably dead."""
        store = self.store
        now = int(store.clock() * 1000) if now is None else now
        owned = [t for t in tasks if t.owner is not None and t.status in _RECOVERABLE]
        if not owned:
            return set()
        with store._engine.reading() as engine:
            procs = engine.processes()
        dead = {owner for owner in {t.owner for t in owned}
                if engine.owner_dead(procs.get(owner), now, store.lease_ms)}
        return {t.id for t in owned if t.owner in dead}


def _reap(store, now, batch_rows):
    """``TaskStore.reap``: delete what retention says is over, batch by batch; the counts.

    Each kind of deletion (tasks with their events, pruned events, expired
    idempotency keys, expired tombstones) runs in transactions of its own,
    sized by ``_next_reap_batch`` to stay within ``REAP_BUDGET_MS``: a
    store's first batch of a kind is small and doubles while it is fast,
    and the size each kind reached is where the next ``reap`` starts.
    The budget is half of the 50 ms a reap transaction is promised, the
    other half for its commit and a loaded machine: a batch of 500 tasks
    with 5 events each takes about 2 ms on SQLite and 10 ms on PostgreSQL
    (2 cores), so it binds only when tasks weigh more (long logs, large
    results) or the machine is slower.
    """
    engine, waiters = store._engine, store._waiters
    counts = {"tasks": 0, "events": 0, "idempotency": 0, "tombstones": 0}

    # Where the last committed batch of a step reached: tasks, the purge_at
    # (reap_tasks_once); events, the id its walk goes on from (prune_events_once).
    reached = {}

    def reap_tasks(counted, size):
        more, deleted, counted["reached"] = engine.reap_tasks_once(
            now, size, counted, store.tombstone_ms, since=reached.get("tasks"))
        for task_id in deleted:
            store._waiters.cancel_events.pop(task_id, None)
        return more

    def prune_events(counted, size):
        more, counted["reached"] = engine.prune_events_once(
            now - store.event_retention_ms, size, counted, since=reached.get("events"))
        return more
    steps = {"tasks": reap_tasks}
    if store.event_retention_ms is not None:
        steps["events"] = prune_events
    for table in ("idempotency", "tombstones"):
        def delete(counted, size, table=table):
            deleted = engine.delete_expired(table, now, size)
            counted[table] += deleted
            return deleted == size
        steps[table] = delete

    def counting(step, size):
        # A body may run more than once (PostgreSQL runs a transaction it
        # ended to break a deadlock again): each run counts afresh, and
        # only the committed run's counts are added.  It times its own
        # statements, which its size governs: not the wait for the lock,
        # nor the commit (on PostgreSQL a sync whatever the batch).
        def body():
            begun, counted = store.clock(), dict.fromkeys(counts, 0)
            more = step(counted, size)
            return more, counted, (store.clock() - begun) * 1000
        return body
    sizes = store._reap_batches
    with engine.bulk():
        for kind, step in steps.items():
            size = min(batch_rows, sizes.get(kind, REAP_FIRST_BATCH))
            more = True
            while more:
                more, counted, took_ms = engine.write(counting(step, size))  # one transaction
                size = _next_reap_batch(size, took_ms, batch_rows, more)
                waiters.committed()
                if "reached" in counted:
                    reached[kind] = counted.pop("reached")
                for name, count in counted.items():
                    counts[name] += count
            sizes[kind] = size
    return counts


def _next_reap_batch(size, took_ms, most, full):
    """The next batch size of a reap step whose batch of *size* rows took *took_ms*; at most *most*.

    A batch over ``REAP_BUDGET_MS`` shrinks the next in proportion; a
    *full* one (there may be more) within half of it doubles the next,
    which keeps that one within the budget as long as a batch's time grows
    with its rows (no faster).  A batch that found less than its size says
    nothing of a full one's time: the size stays.
    """
    if took_ms > REAP_BUDGET_MS:
        return max(1, int(size * REAP_BUDGET_MS / took_ms))
    if full and took_ms <= REAP_BUDGET_MS / 2:
        return min(most, 2 * size)
    return min(most, size)


def _reap_report(counts, seconds):
    """What a reap deleted and how fast, in words: the reaper's log line and ``tasks reap``'s."""
    kinds = ", ".join(f"{count} {kind}" for kind, count in counts.items())
    rate = f" ({counts['tasks'] / seconds:,.0f} tasks/s)" if counts["tasks"] and seconds > 0 else ""
    return f"reaped {kinds} in {seconds:.3f} s{rate}"


# -- the reaper thread --------------------------------------------------------
# The store never starts this thread on its own: the command line does, or the
# embedding application through ``store.start_reaper()``.  A failing pass is
# logged and the next one tries again; ``stop`` returns within one pass.  A pass
# that deleted anything logs what and how fast at INFO (``_reap_report``).

class Reaper(threading.Thread):
    """A daemon thread running ``store.reap()`` and ``store.recover()`` every *interval* s."""

    def __init__(self, store, interval=DEFAULT_REAP_INTERVAL_S):
        super().__init__(name="taskstore-reaper", daemon=True)
        self.store = store
        self.interval = interval
        self._stop_event = threading.Event()

    def run(self):
        """Run a pass every ``interval`` seconds until ``stop``."""
        while not self._stop_event.wait(self.interval):
            self.run_once()

    def run_once(self):
        """One pass; errors are logged, never raised."""
        try:
            self.store.recover()
            begun = time.monotonic()
            counts = self.store.reap()
            if any(counts.values()):
                logger.info("%s", _reap_report(counts, time.monotonic() - begun))
        except StoreClosed:
            self._stop_event.set()
        except Exception:
            logger.exception("reaper pass failed")

    def stop(self, timeout=10.0):
        """Stop the thread and wait for it (at most *timeout* s)."""
        self._stop_event.set()
        if self is not threading.current_thread():
            self.join(timeout)


# -- schedules: cron, periods, and firing -------------------------------------
# A schedule (``Schedules.add``) is a row of the ``schedules`` table: a
# kind, a payload and either a fixed period (``every``) or a standard 5-field
# cron expression, with ``next_at``, the start of the next period to fire.
# Periods are UTC: a cron expression is read in UTC, and ``every=N`` periods
# start at multiples of N seconds since the epoch, so every process computes
# the same boundaries whatever its time zone.  Firing a period is one write
# transaction: a compare-and-set moves ``next_at`` on from the period read
# (another process that read the same period moves nothing and creates
# nothing), and the task is created through ``create``'s idempotency path
# with the schedule and the period as its key.  A period found due long
# after its time fires once, and ``next_at`` moves past now: missed periods
# run once, not once each.

# The fields of a cron expression: (name, lowest, highest, names for values).
_CRON_FIELDS = (
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day of month", 1, 31, {}),
    ("month", 1, 12, {name: i for i, name in enumerate(
        "JAN FEB MAR APR MAY JUN JUL AUG SEP OCT NOV DEC".split(), 1)}),
    ("day of week", 0, 7, {name: i for i, name in enumerate(
        "SUN MON TUE WED THU FRI SAT".split())}),
)
_MONTH_DAYS = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)     # the most each month has
SCHEDULE_KEY_MS = 24 * 3600 * 1000      # how long a period's idempotency key is kept
SCHEDULE_FIRE_BATCH = 100               # due schedules one firing transaction takes, at most


def _cron_value(text, field):
    name, low, high, names = _CRON_FIELDS[field]
    value = names.get(text.upper())
    if value is None:
        if not text.isdigit() or not text.isascii():
            raise ValueError(f"{name}: {_echo(repr(text))} is not a number" + (
                " or a name" if names else ""))
        value = int(text)
    if not low <= value <= high:
        raise ValueError(f"{name}: {value} is out of range {low}-{high}")
    return value


def _cron_field(text, field):
    """The set of values one cron field allows (``*``, lists, ranges, steps, names)."""
    name, low, high, _ = _CRON_FIELDS[field]
    values = set()
    for item in text.split(","):
        spec, slash, step = item.partition("/")
        if slash:
            if not step.isdigit() or not step.isascii() or int(step) == 0:
                raise ValueError(f"{name}: step {_echo(repr(step))} is not a positive number")
            step = int(step)
        else:
            step = 1
        if spec == "*":
            first, last = low, high
        elif "-" in spec:
            a, _, b = spec.partition("-")
            first, last = _cron_value(a, field), _cron_value(b, field)
            if first > last:
                raise ValueError(f"{name}: range {_echo(repr(spec))} runs backwards")
        else:
            first = _cron_value(spec, field)
            last = high if slash else first          # "5/15": from 5 on, every 15
        values.update(range(first, last + 1, step))
    if field == 4 and 7 in values:                   # 7 is Sunday too
        values.discard(7)
        values.add(0)
    return frozenset(values)


class Cron(typing.NamedTuple):
    """A parsed 5-field cron expression (minute hour day-of-month month day-of-week), in UTC.

    ``Cron.parse("*/5 * * * *").next_after(ms)`` is the first minute after
    *ms* (epoch milliseconds) that the expression matches.  Each field
    takes ``*``, a number, a range ``a-b``, a step ``*/n``, ``a-b/n`` or
    ``a/n``, and comma-separated lists of these; months and days of the
    week also take names (``JAN``, ``MON``; 0 and 7 are both Sunday).  As in
    cron, when both day fields are restricted (neither starts with ``*``)
    a day matches if either does; otherwise both must.
    """

    text: str
    minutes: frozenset
    hours: frozenset
    days: frozenset
    months: frozenset
    weekdays: frozenset
    any_day: bool          # the day-of-month field starts with "*"
    any_weekday: bool      # the day-of-week field starts with "*"

    @classmethod
    def parse(cls, text):
        """Parse *text*; raise InvalidParams (``param="cron"``) naming what is wrong."""
        if not isinstance(text, str) or len(text) > 1000:
            raise InvalidParams("cron must be a string of 5 fields, at most 1,000 characters",
                                param="cron")
        fields = text.split()
        try:
            if len(fields) != 5:
                raise ValueError(f"expected 5 fields (minute hour day-of-month month "
                                 f"day-of-week), got {len(fields)}")
            sets = [_cron_field(f, i) for i, f in enumerate(fields)]
        except ValueError as exc:
            raise InvalidParams(f"cron {_echo(repr(text))}: {exc}", param="cron") from None
        cron = cls(" ".join(fields), *sets, fields[2].startswith("*"),
                   fields[4].startswith("*"))
        if cron.any_weekday and not any(day <= _MONTH_DAYS[month - 1] for month in cron.months
                                        for day in cron.days):
            raise InvalidParams(f"cron {_echo(repr(text))}: no month has that day",
                                param="cron")
        return cron

    def _day_matches(self, when):
        day = when.day in self.days
        weekday = (when.weekday() + 1) % 7 in self.weekdays      # cron: Sunday is 0
        if self.any_day or self.any_weekday:
            return day and weekday
        return day or weekday

    def next_after(self, ms):
        """The first matching minute strictly after epoch ms *ms*, in epoch ms (UTC)."""
        when = datetime.datetime.fromtimestamp(ms // 60_000 * 60 + 60, datetime.timezone.utc)
        # Each step moves to the start of the next month, day, hour or minute
        # that may match; parse() refused expressions that never do, and a
        # leap day is at most 8 years (2,900 day steps) away.
        while True:
            if when.month not in self.months:
                year, month = divmod(when.year * 12 + when.month, 12)     # the next month
                when = when.replace(year=year, month=month + 1, day=1, hour=0, minute=0)
            elif not self._day_matches(when):
                when = (when + datetime.timedelta(days=1)).replace(hour=0, minute=0)
            elif when.hour not in self.hours:
                when = (when + datetime.timedelta(hours=1)).replace(minute=0)
            elif when.minute not in self.minutes:
                when += datetime.timedelta(minutes=1)
            else:
                return int(when.timestamp()) * 1000


def _schedule_from_row(row):
    values = list(row)
    values[2] = _loads(values[2])
    values[5] = bool(values[5])
    values[13] = _loads(values[13]) if values[13] else {}
    return Schedule(*values)


def _schedule_next(every_ms, cron, after):
    """The start of the first period strictly after epoch ms *after*."""
    if every_ms is not None:
        return (after // every_ms + 1) * every_ms
    return Cron.parse(cron).next_after(after)


def _schedule_period(every, cron):
    """Validate ``schedule``'s period: ``(every_ms, cron text)``, exactly one of them set."""
    if (every is None) == (cron is None):
        raise InvalidParams("give every (seconds) or cron, not both and not neither",
                            param="every" if every is not None else "cron")
    if cron is not None:
        return None, Cron.parse(cron).text
    if isinstance(every, datetime.timedelta):
        every = every.total_seconds()
    # Seconds, from a millisecond to 2**53 ms (about 285,000 years).
    return int(round(_number(every, "every", 0.001, 2**53 / 1000) * 1000)), None


class Schedules:
    """The store's periodic tasks (``store.schedules``): define, list, pause, resume, remove, fire.

    One room for everything a schedule is: its verbs, the firing of due
    periods (``fire``: what runners call at each period's start), and who in
    this process waits for a schedule to change (``watch``).  The rows live
    in the database (the ``schedules`` table), so every process sharing it
    sees the same schedules and fires each period once between them.
    """

    def __init__(self, store):
        self._store = store
        self._watchers = []     # watch: runners' scheduler threads

    def add(self, name, kind, payload=None, *, every=None, cron=None, policy="fail",
            ttl_ms=None, retention_ms=None):
        """Create a task of *kind* with *payload* once per period, from now on; return the Schedule.

        Give *every* (seconds, or a ``timedelta``: periods start at its
        multiples since the epoch) or *cron* (5 fields, UTC, see ``Cron``).
        A runner creates each period's task at the period's start (see
        ``fire``): exactly one task per period, however many
        processes run.  *policy*, *ttl_ms* and *retention_ms* are the
        tasks' ``create`` options.  Defining an existing name again replaces
        its kind, payload and options and keeps its paused state; its next
        period stays unless the period itself changed.

        Raises:
            InvalidParams: a bad argument (``param`` names it): both or
                neither of *every* and *cron*, ``every <= 0``, a malformed
                cron expression or a field out of range.  Nothing is written.
        """
        store = self._store
        _check_str(name, "name", allow_none=False, max_len=200)
        every_ms, cron_text = _schedule_period(every, cron)
        spec = _new_task(store.max_ttl_ms, kind, payload, ttl_ms, retention_ms, policy, None,
                         None, "task", None, None)
        options = {key: value for key, value in (("policy", policy), ("ttl_ms", ttl_ms),
                                                 ("retention_ms", retention_ms))
                   if value is not None and (key, value) != ("policy", "fail")}

        def body():
            now = int(store.clock() * 1000)
            rows = store._engine.schedule_rows(name)
            old = _schedule_from_row(rows[0]) if rows else None
            if old is not None and (old.every_ms, old.cron) == (every_ms, cron_text):
                next_at = old.next_at
            else:
                next_at = _schedule_next(every_ms, cron_text, now)
            row = (name, kind, spec.payload_json, every_ms, cron_text,
                   int(old is not None and old.paused), next_at,
                   *(old[7:11] if old else (None, None, None, 0)),
                   now if old is None else old.created_at, now, dumps(options))
            store._engine.schedule_put(row)
            return _schedule_from_row(row)
        return self.written(store._engine.write(body))

    def list(self):
        """Every schedule (``Schedule``), by name."""
        with self._store._engine.reading() as engine:
            rows = engine.schedule_rows(None)
        return [_schedule_from_row(row) for row in rows]

    def pause(self, name):
        """Stop firing schedule *name* (its periods pass unfired); return the Schedule.

        Raises:
            InvalidParams: no schedule has that name (``param="name"``).
        """
        return self._set(name, lambda old, now: {"paused": 1, "updated_at": now})

    def resume(self, name):
        """Fire schedule *name* again, from its next period after now; return the Schedule.

        The periods that passed while it was paused are not fired.  A
        schedule that is not paused is left as it is.

        Raises:
            InvalidParams: no schedule has that name (``param="name"``).
        """
        return self._set(name, lambda old, now: {} if not old.paused else {
            "paused": 0, "updated_at": now,
            "next_at": _schedule_next(old.every_ms, old.cron, now)})

    def remove(self, name):
        """Delete schedule *name* (the tasks it created stay).

        Raises:
            InvalidParams: no schedule has that name (``param="name"``).
        """
        engine = self._store._engine
        _check_str(name, "name", allow_none=False, max_len=200)
        if not engine.write(lambda: engine.schedule_delete(name)):
            raise InvalidParams(f"no schedule named {_echo(repr(name))}", param="name")
        self.written()

    def _set(self, name, change):
        """Change schedule *name* by ``change(old, now) -> values`` in one write; the Schedule."""
        store, engine = self._store, self._store._engine
        _check_str(name, "name", allow_none=False, max_len=200)

        def body():
            rows = engine.schedule_rows(name)
            if not rows:
                raise InvalidParams(f"no schedule named {_echo(repr(name))}", param="name")
            old = _schedule_from_row(rows[0])
            values = change(old, int(store.clock() * 1000))
            if values:
                engine.schedule_update(name, values, None)
            return _schedule_from_row(engine.schedule_rows(name)[0])
        return self.written(engine.write(body))

    def next_at(self):
        """The start (epoch ms) of the soonest period of an unpaused schedule, or None."""
        with self._store._engine.reading() as engine:
            return engine.next_schedule_at()

    def fire(self, now=None):
        """Create the task of every schedule whose period has started; return the new Tasks.

        One transaction.  Each due schedule fires once, for the period its
        ``next_at`` names, and moves on to its first period after *now*:
        after downtime the missed periods run once, not once each.  Another
        process firing the same schedule at the same time creates nothing
        (the compare-and-set on ``next_at``, then the period's idempotency
        key ``schedule``/``name@period``).  *now*: epoch ms, else the clock.
        Runners call this at each fire time (``Runner``).
        """
        store = self._store
        now = int(store.clock() * 1000) if now is None else now
        tasks = store._engine.write(lambda: self._fire_due(now))
        if tasks:
            store._waiters.committed((_Change(task, "created") for task in tasks), queued=True)
        return tasks

    def _fire_due(self, now):
        """The body of one firing transaction: fire every schedule due at *now*; its new Tasks.

        Per due schedule: the compare-and-set on ``next_at`` first, so that of
        two processes that read the same period one fires and the other writes
        nothing; then the task, through ``create``'s idempotency path, keyed
        by the schedule's name and the period; then the task's id on the row.
        """
        store = self._store
        engine, created = store._engine, []
        for row in engine.schedules_due(now, SCHEDULE_FIRE_BATCH):
            schedule = _schedule_from_row(row)
            after = _schedule_next(schedule.every_ms, schedule.cron, now)
            if not engine.schedule_update(schedule.name, {
                    "next_at": after, "last_due": schedule.next_at, "last_fired_at": now,
                    "fired": schedule.fired + 1, "updated_at": now}, schedule.next_at):
                continue
            options = schedule.options
            spec = _new_task(store.max_ttl_ms, schedule.kind, schedule.payload,
                             options.get("ttl_ms"), options.get("retention_ms"),
                             options.get("policy", "fail"), None,
                             {"schedule": schedule.name, "due_at": schedule.next_at}, "task",
                             None, None)
            key = f"{schedule.name}@{schedule.next_at}"
            task = _create_once(store, spec, ("schedule", key, fingerprint(key),
                                              SCHEDULE_KEY_MS))()
            engine.schedule_update(schedule.name, {
                "last_task": task if isinstance(task, str) else task.id}, None)
            if not isinstance(task, str):
                created.append(task)
        return created

    def watch(self, callback):
        """Call ``callback()`` after each change of a schedule made through this store.

        A runner's scheduler thread uses it to wake when the next fire time
        may have moved.  ``unwatch`` undoes it.
        """
        self._watchers.append(callback)

    def unwatch(self, callback):
        """Stop calling *callback* (``watch``)."""
        with contextlib.suppress(ValueError):
            self._watchers.remove(callback)

    def written(self, result=None):
        """A schedule changed (here, or in another process): wake who watches; return *result*."""
        for callback in list(self._watchers):
            callback()
        return result


# =============================================================================
# 8. Runner and handler context
# =============================================================================
# Rules:
# - A runner registers its process, claims queued tasks of the kinds it has
#   handlers for (others stay queued for another process), and moves them
#   through loading and running by the store's verbs, never by SQL.
# - Every move a worker makes carries the attempt it claimed, so a worker
#   whose task was recovered and requeued meanwhile cannot touch it.
# - A worker that goes on claims its next task in the transaction of its
#   last one's finish (the verbs' ``claim_next``): a backlog drains at one
#   commit per task.  A stopping worker, or one whose finish is refused,
#   claims nothing with it.
# - One maintenance thread per runner heartbeats the lease, writes coalesced
#   progress, and notices cancels made by other processes.
# - Every write for a running task goes through ``Runner._hold``: a short
#   outage of the store (StoreUnavailable: a full disk, a lock held past the
#   busy timeout) is ridden out, not turned into a failed task, for as long
#   as the runner's lease lives.
# - A handler's return value is the result; ``TaskFailed`` fails the task
#   with the handler's error; any other exception fails it with a generic
#   error (the traceback goes to the log only).  Either failure is the
#   store's ``fail(retryable=True)``, where ``FAILURE`` (section 3) queues the
#   task again after its backoff while its retry policy has attempts left
#   (``TaskFailed(..., retry=False)`` never does).

# The longest a runner's scheduler sleeps before it reads the schedules again:
# how late it learns of a schedule another process added or changed.
SCHEDULE_CHECK_S = 5.0
_HOLD_FIRST_S = 0.05    # the wait before a write the store refused is tried again,
_HOLD_MAX_S = 1.0       # doubling up to this


class TaskContext:
    """What a handler gets: its task, the cancel signal, and ways to report.

    While the store refuses writes for a moment (StoreUnavailable), ``emit``,
    ``save_snapshot``, ``ask`` and ``running`` wait and retry until it takes
    them again; ``progress`` and ``status`` never wait: the newest value is
    kept and written once the store is back.  A report that can never be
    written (the runner stops, or its lease ran out during the outage)
    raises ``Cancelled``, and ``cancelled`` is set.

    Attributes:
        task_id, kind, payload, attempt: of the claimed task (attempt counts
            runs from 1; a retry or resume after a restart raises it).
        cancelled: a ``threading.Event`` set when the task is cancelled, the
            runner shuts down or its lease is lost; check it often and return
            when it is set.
    """

    def __init__(self, runner, task):
        self._runner = runner
        self._store = runner.store
        self.task = task
        self.task_id = task.id
        self.kind = task.kind
        self.payload = task.payload
        self.attempt = task.attempt
        self.cancelled = self._store.cancel_event(task.id)
        self._loading = task.status == LOADING
        self._lock = threading.Lock()
        self._pending = {}          # coalesced progress/status not yet written
        self._last_flush = 0.0
        self._flushing = threading.Lock()   # one progress write at a time: newest wins
        self._abandoned = False     # the runner's lease is gone: write nothing more

    def is_cancelled(self):
        """True once the task was cancelled (or the runner is stopping)."""
        return self.cancelled.is_set()

    def check(self):
        """Raise ``Cancelled`` if the task was cancelled; a handy call inside loops."""
        if self.cancelled.is_set():
            raise Cancelled(self.task_id)

    def running(self):
        """Say that loading is over and the work runs (``loading -> running``).

        Called implicitly by the first report, emit, snapshot or question.
        """
        if self._loading:
            self._loading = False
            # Cancelled (or requeued) while loading: the next report or the
            # runner's finish will notice; starting is no longer ours to do.
            with contextlib.suppress(InvalidTransition):
                self._runner._hold(self, self._store.start, self.task_id, attempt=self.attempt)

    def progress(self, progress, total=None, message=_MISSING):
        """Report progress (and optionally a status message); coalesced.

        Writes at most one transaction per ``progress_interval_s``; the
        runner writes the last value within one interval, and always before
        the task's final status.  Never waits for the store: while it
        refuses writes only the newest value is kept.
        """
        self.running()
        with self._lock:
            self._pending["progress"] = progress
            self._pending["total"] = total
            if message is not _MISSING:
                self._pending["message"] = message
        self._maybe_flush()

    def status(self, message):
        """Set the human status message (MCP ``statusMessage``); coalesced like progress."""
        self.running()
        with self._lock:
            self._pending["message"] = message
        self._maybe_flush()

    def _maybe_flush(self):
        if time.monotonic() - self._last_flush >= self._runner.progress_interval_s:
            self._flush(hold=False)

    def flush(self):
        """Write pending progress now, waiting out a store outage (the runner calls it)."""
        self._flush(hold=True)

    def _flush(self, hold):
        """Write the pending progress; *hold* False: while the store refuses writes, keep it pending."""
        if not hold and self._runner._refusing:
            return                  # an outage: the newest value waits in _pending
        if not self._flushing.acquire(blocking=hold):
            return                  # another thread is writing it
        try:
            with self._lock:
                pending, self._pending = self._pending, {}
                self._last_flush = time.monotonic()
            if not pending:
                return
            write = functools.partial(
                self._store.set_progress, self.task_id, progress=pending.get("progress"),
                total=pending.get("total"), message=pending.get("message", _MISSING),
                attempt=self.attempt)
            if hold:
                self._runner._hold(self, write)
                return
            try:
                write()
            except StoreUnavailable:
                with self._lock:    # put it back under anything newer
                    pending.update(self._pending)
                    self._pending = pending
        finally:
            self._flushing.release()

    def emit(self, etype, data=None, *, snapshot=_MISSING):
        """Append an event to the task's log (with an optional snapshot, atomically); return its seq."""
        self.running()
        return self._runner._hold(self, self._store.emit, self.task_id, etype, data,
                                  snapshot=snapshot, attempt=self.attempt)

    def save_snapshot(self, snapshot):
        """Save a JSON snapshot to resume from after a restart (policy ``resume``)."""
        self.running()
        self._runner._hold(self, self._store.save_snapshot, self.task_id, snapshot,
                           attempt=self.attempt)

    def load_snapshot(self):
        """Return the last saved snapshot (after a resume), or None."""
        return self._store.load_snapshot(self.task_id)

    def ask(self, request, timeout=None):
        """Ask the requestor for input and return the answer.

        The task is ``input_required`` with *request* (a JSON object the
        adapter understands, e.g. an MCP elicitation) until someone calls
        ``store.provide_input``.

        Raises:
            Cancelled: the task was cancelled (or the runner stops) meanwhile.
            TimeoutError: no answer within *timeout* seconds.
        """
        self.running()
        self.flush()
        self._runner._hold(self, self._store.require_input, self.task_id, request,
                           attempt=self.attempt)
        deadline = None if timeout is None else time.monotonic() + timeout
        version = None
        while True:
            if self.cancelled.is_set():
                raise Cancelled(self.task_id)
            step = self._store.poll_interval
            if deadline is not None:
                step = min(step, deadline - time.monotonic())
                if step <= 0:
                    raise TimeoutError(f"no input for task {self.task_id} within {timeout} s")
            task = self._store.wait(self.task_id, timeout=step, since_version=version)
            version = task.version
            if task.attempt != self.attempt or task.status in (CANCELLING, *TERMINAL_STATES):
                raise Cancelled(self.task_id)
            if task.status == RUNNING:
                return task.input_answer


class Runner:
    """A pool of worker threads that runs the store's queued tasks.

    Example::

        def report(ctx, payload):
            for i in range(10):
                ctx.check()
                ctx.progress(i, 10)
            return {"text": "done"}

        with TaskStore("tasks.db") as store, Runner(store, {"report": report}):
            ...

    A claimed task goes straight to ``running``; a handler with a real
    loading phase (a model to load, say) sets ``handler.has_loading_phase =
    True``: its tasks are ``loading`` until it calls ``ctx.running()`` (or
    reports anything).

    Running work rides out a short outage of the store.  While the store
    refuses writes (``StoreUnavailable``: a full disk, a lock held past the
    busy timeout), the runner holds each running task's writes (events,
    snapshots, the final status, an input request) and retries them, 50 ms
    doubling to 1 s apart, in their order; progress keeps only its newest
    value; the heartbeat keeps trying, and one WARNING says the store
    refuses writes.  A held write gives up, writing nothing, only when the
    runner stops (``stop`` applies the restart policy, if the store lets it)
    or when the runner's lease is gone: the outage outlasted ``lease_s``
    since the last heartbeat, or the heartbeat found the registration
    declared dead.  Then every running handler's ``cancelled`` is set, its
    reports raise ``Cancelled``, and recovery applies each task's restart
    policy (the runner releases the old registration itself once the store
    takes writes, and goes on under a new one): a task never ends twice.
    Refusals of another kind are not waited out: a result the store cannot
    keep fails the task, a task cancelled or recovered meanwhile keeps what
    happened to it (``LATE_OUTCOME``), and ``StoreClosed`` ends the runner.

    A handler that raises fails its task, unless the task has attempts
    left under its retry policy (``create(retry=...)``, else this runner's
    default for its kind): then it is queued again, to run after its
    backoff (``FAILURE``).  ``TaskFailed(..., retry=False)`` fails at once.

    Args:
        handlers: ``{kind: handler(ctx, payload) -> result}``.
        workers: how many tasks run at once.
        heartbeat_s: how often the lease is renewed and other processes'
            cancels are noticed.
        progress_interval_s: at most one progress write per task per interval.
        schedules: fire the store's schedules (``store.schedules``).
            Every runner does, in every process: a thread sleeps until the
            soonest period starts and then fires it (``Schedules.fire``),
            and the one task per period is the store's guarantee, not an
            election's, so no runner waits for a leader's lease to run out
            when its process dies.  Each wake costs one indexed read, a due
            period one short write per runner (all but the first write
            nothing).  A schedule changed through this store wakes it at
            once, and on PostgreSQL one changed by another process too (a
            notification); on SQLite that is seen within ``SCHEDULE_CHECK_S``.
        retry: ``{kind: retry policy}`` (a ``Retry``, a dict of its fields,
            or a number of attempts): the policy of a task of that kind
            created without one.
    """

    def __init__(self, store, handlers=None, *, workers=4, heartbeat_s=DEFAULT_HEARTBEAT_S,
                 progress_interval_s=DEFAULT_PROGRESS_INTERVAL_S, schedules=True, retry=None):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise InvalidParams("workers must be an integer >= 1", param="workers")
        if retry is not None and not isinstance(retry, dict):
            raise InvalidParams("retry must map kinds to retry policies", param="retry")
        self.retry = {kind: _retry_param(policy, f"retry[{kind!r}]")
                      for kind, policy in (retry or {}).items()}
        self.store = store
        self.handlers = dict(handlers or {})
        self.workers = workers
        self.heartbeat_s = heartbeat_s
        self.progress_interval_s = progress_interval_s
        self.process_id = None
        self._lock = threading.Lock()
        self._active = {}            # task id -> TaskContext
        self._refusing = set()       # writers (contexts, "heartbeat") the store refuses now
        self._complained = False     # a store outage is logged once, not every try
        self._lease_at = 0           # store-clock ms of the last heartbeat that went through
        self._lost = False           # the lease is gone: register anew before claiming
        self._threads = []
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self.schedules = schedules
        self._schedules_moved = threading.Event()   # set: read the next fire time again

    def register(self, kind, handler):
        """Add a handler for *kind* (claimed from the next poll on)."""
        self.handlers[kind] = handler

    def start(self):
        """Register the process and start the threads; return self."""
        if self._threads:
            raise InvalidParams("runner already started", param="runner")
        self._lease_at = self._now_ms()
        self.process_id = self.store.register_process()
        for i in range(self.workers):
            self._threads.append(threading.Thread(
                target=self._work, name=f"taskstore-worker-{i}", daemon=True))
        self._maintenance = threading.Thread(target=self._maintain, name="taskstore-runner",
                                             daemon=True)
        if self.schedules:
            self.store.schedules.watch(self._schedules_moved.set)
            self._threads.append(threading.Thread(target=self._fire, daemon=True,
                                                  name="taskstore-scheduler"))
        for thread in self._threads + [self._maintenance]:
            thread.start()
        return self

    def active(self):
        """Return the ids of the tasks this runner is running now."""
        with self._lock:
            return sorted(self._active)

    def stop(self, timeout=2.0):
        """Stop claiming, signal running handlers, and release what is left.

        Handlers get ``timeout`` seconds to return after their ``cancelled``
        event is set; writes held during a store outage give up at once.
        Then every task this runner still owns (and every one
        whose handler was interrupted by the stop) gets its restart policy at
        once, exactly as after a crash: ``fail`` tasks are ``failed`` with a
        ``CRASH_RECOVERY`` message, ``retry``/``resume`` tasks are queued
        again, ``cancelling`` ones are ``cancelled``.  Idempotent.
        """
        if self._stopping.is_set() or not self._threads:
            self._stopping.set()
            return
        self._stopping.set()
        self.store.wake_workers()      # idle workers would otherwise sleep out poll_interval
        self._schedules_moved.set()    # and the scheduler its wait for the next period
        self.store.schedules.unwatch(self._schedules_moved.set)
        with self._lock:
            for ctx in self._active.values():
                ctx.cancelled.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._stopped.set()
        self._maintenance.join(timeout)
        try:
            self.store.release(self.process_id, "the process running this task shut down")
        except StoreClosed:
            pass
        except StoreUnavailable as exc:
            # A full disk: the registration stays, so the next process to
            # open the file sees this one dead and applies the policies then.
            logger.error("could not release this runner's tasks at shutdown: %s", exc)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- riding out an outage ---------------------------------------------------

    def _now_ms(self):
        return int(self.store.clock() * 1000)

    def _hold(self, ctx, write, *args, **kwargs):
        """Perform one store write for *ctx*'s running task; ride out an outage.

        On StoreUnavailable the write is tried again, ``_HOLD_FIRST_S``
        doubling to ``_HOLD_MAX_S`` apart, until it goes through.  Raises
        ``Cancelled``, having written nothing, once the runner stops or its
        lease is gone (recovery owns the task then).  Every other error
        (InvalidTransition, InvalidParams, StoreClosed) is the caller's.
        """
        delay = _HOLD_FIRST_S
        try:
            while True:
                if ctx._abandoned or self._stopping.is_set():
                    raise Cancelled(ctx.task_id)
                try:
                    written = write(*args, **kwargs)
                except StoreUnavailable as exc:
                    self._refused(ctx, exc)
                else:
                    self._accepted(ctx)
                    return written
                if self._stopping.wait(delay):
                    raise Cancelled(ctx.task_id)
                delay = min(delay * 2, _HOLD_MAX_S)
                if self._lease_gone():
                    self._lose_lease("the store refused writes for longer than the lease")
        finally:
            self._gave_up(ctx)

    def _lease_gone(self):
        """Has the lease run out since the last heartbeat that went through?"""
        return self._now_ms() > self._lease_at + self.store.lease_ms

    def _complain(self, exc):
        with self._lock:
            first, self._complained = not self._complained, True
        if first:
            logger.warning("the store refuses writes: %s (holding the running tasks' writes "
                           "and retrying quietly)", exc)

    def _refused(self, writer, exc):
        with self._lock:
            self._refusing.add(writer)
        self._complain(exc)

    def _accepted(self, writer):
        """*writer*'s write went through: the outage is over once nobody is refused."""
        if writer not in self._refusing:    # every write but those after a refusal: no lock
            return
        with self._lock:
            if writer not in self._refusing:
                return
            self._refusing.discard(writer)
            over = not self._refusing and self._complained
            if over:
                self._complained = False
        if over:
            logger.info("the store takes writes again")

    def _gave_up(self, writer):
        if writer in self._refusing:
            with self._lock:
                self._refusing.discard(writer)

    def _abandon(self, ctx):
        """Stop *ctx*'s work and write nothing more for it: recovery owns its task."""
        ctx._abandoned = True
        ctx.cancelled.set()     # requeued, the task's next attempt gets a fresh event

    def _lose_lease(self, why):
        """The registration is dead (or may be treated so): stop all running work."""
        with self._lock:
            if self._lost:
                return
            self._lost = True
            contexts = list(self._active.values())
        logger.error("runner lease was lost (%s): stopping %d running %s; recovery applies "
                     "their restart policies", why, len(contexts),
                     "task" if len(contexts) == 1 else "tasks")
        for ctx in contexts:
            self._abandon(ctx)

    def _register_again(self):
        """After a lost lease: release the old registration's tasks, then register anew."""
        self.store.release(self.process_id, "the process running this task lost its lease")
        self._lease_at = self._now_ms()
        self.process_id = self.store.register_process()
        self._lost = False

    def _beat(self):
        """Renew the lease, riding out an outage; True when it went through."""
        if "heartbeat" in self._refusing and self._lease_gone():
            self._lose_lease("the store refused the heartbeat for longer than the lease")
            return False
        now = self._now_ms()
        try:
            alive = self.store.heartbeat(self.process_id)
        except StoreUnavailable as exc:
            self._refused("heartbeat", exc)
            return False
        self._accepted("heartbeat")
        if not alive:
            # Declared dead: our tasks were recovered elsewhere.
            self._lose_lease("the registration was declared dead")
            return False
        self._lease_at = now
        return True

    # -- threads ---------------------------------------------------------------

    def _claim_next(self):
        """``claim``'s keyword arguments for this runner's next task."""
        return {"kinds": tuple(self.handlers), "owner": self.process_id,
                "loading_kinds": tuple(k for k, h in self.handlers.items()
                                       if getattr(h, "has_loading_phase", False))}

    def _work(self):
        seen = None
        task = None         # claimed already, by the last task's finish: run it whatever comes
        while task is not None or not self._stopping.is_set():
            if task is None:
                if self._lost:              # the maintenance thread registers anew
                    self._stopping.wait(self.store.poll_interval)
                    continue
                try:
                    task = self.store.claim(**self._claim_next())
                except StoreClosed:
                    return
                except TaskStoreError as exc:
                    self._complain(exc)
                    task = None
                else:
                    if task is not None and not self._refusing:
                        self._complained = False
                if task is None:
                    try:
                        seen = self.store.wait_for_work(seen, self.store.poll_interval)
                    except StoreClosed:
                        return
                    continue
            task = self._run(task)

    def _fire(self):
        """The scheduler thread: sleep until the soonest period starts, then fire what is due."""
        while not self._stopping.is_set():
            self._schedules_moved.clear()
            wait = SCHEDULE_CHECK_S
            try:
                next_at = self.store.schedules.next_at()
                if next_at is not None and next_at <= self._now_ms():
                    self.store.schedules.fire()
                    continue
                if next_at is not None:
                    wait = min(wait, (next_at - self._now_ms()) / 1000)
            except StoreClosed:
                return
            except StoreUnavailable as exc:       # an outage: tried again after a wait
                self._complain(exc)
            except Exception:
                logger.exception("firing schedules failed")
            self._schedules_moved.wait(max(wait, 0.001))

    def _run(self, task):
        """Run *task*'s handler and finish it; return the next task claimed with it, or None."""
        ctx = TaskContext(self, task)
        with self._lock:
            self._active[task.id] = ctx
            if self._stopping.is_set():     # stop() ran between our claim and here
                ctx.cancelled.set()
            lost = self._lost or task.owner != self.process_id
        if lost:                            # claimed under a registration lost meanwhile
            self._abandon(ctx)
        try:
            handler = self.handlers[task.kind]
            try:
                outcome = ("succeed", handler(ctx, task.payload))
            except TaskFailed as exc:
                outcome = ("fail", exc.error, exc.result, exc.retry)
            except Cancelled:
                outcome = ("cancelled",)
            except Exception:
                logger.error("handler for %s task %s raised:\n%s", task.kind, task.id,
                             traceback.format_exc())
                outcome = ("fail", {"code": "internal_error",
                                    "message": "the task's handler raised an exception"},
                           None, True)
            return self._finish(ctx, outcome)
        except (StoreClosed, Cancelled):
            pass                            # stopping, or the lease is gone: nothing to write
        except Exception:
            logger.exception("finishing task %s failed", task.id)
        finally:
            with self._lock:
                self._active.pop(task.id, None)
        return None

    def _finish(self, ctx, outcome):
        """Write *outcome*; return the worker's next task, claimed in the same transaction, or None.

        A worker that goes on (not stopping, its lease not lost) claims its
        next task with the finish (``claim_next``): a backlog drains at one
        commit per task.  When the finish is refused (a late outcome), or
        claimed nothing, the worker claims the ordinary way.
        """
        store, task_id, attempt = self.store, ctx.task_id, ctx.attempt
        if self._stopping.is_set() or ctx._abandoned or self._lost:
            # Interrupted by shutdown, or the lease is gone (its contexts
            # are abandoned, this one too): the restart policy decides
            # (stop(), recovery).
            return None
        hold = functools.partial(self._hold, ctx)
        # Progress to write before the final status, or a write of it under
        # way (the maintenance thread's, which swaps _pending out first).
        if ctx._pending or ctx._flushing.locked():
            ctx.flush()
        claim_next = self._claim_next()
        try:
            if outcome[0] == "succeed" and not ctx._loading:
                # The common case, checked by succeed itself: it serialises
                # the result before any write, so a value the store refuses
                # leaves the task as it was, and fails it below.
                try:
                    return hold(store.succeed, task_id, outcome[1], attempt=attempt,
                                claim_next=claim_next)[1]
                except InvalidParams:
                    pass
            if outcome[0] != "cancelled":
                # The store's own check (JSON, storable, MAX_JSON_DEPTH) before
                # any move: a value it refuses fails the task instead of
                # leaving it running.
                names = ("result",) if outcome[0] == "succeed" else ("error", "result")
                try:
                    for name, value in zip(names, outcome[1:]):
                        _json_param(value, name)
                except InvalidParams as exc:
                    logger.error("handler for task %s returned what the store cannot keep: %s",
                                 task_id, exc)
                    outcome = ("fail", {"code": "internal_error",
                                        "message": "the task's handler returned a value "
                                                   "the store cannot keep"},
                               None, False)
            if outcome[0] == "succeed":
                ctx.running()
                return hold(store.succeed, task_id, outcome[1], attempt=attempt,
                            claim_next=claim_next)[1]
            if outcome[0] == "fail":
                # FAILURE decides: queued again after a backoff, or failed.
                return hold(store.fail, task_id, outcome[1], result=outcome[2], attempt=attempt,
                            retryable=outcome[3], retry=self.retry.get(ctx.kind),
                            claim_next=claim_next)[1]
            return hold(store.confirm_cancel, task_id, attempt=attempt,
                        claim_next=claim_next)[1]
        except InvalidTransition:
            # Someone moved the task first: LATE_OUTCOME says what happens now.
            try:
                task = store.get(task_id)
            except TaskNotFound:            # finished by another and expired already
                logger.debug("late outcome of task %s ignored: it has expired", task_id)
                return None
            reported = {"succeed": SUCCEED, "fail": FAIL}.get(outcome[0], CONFIRM_CANCEL)
            event = LATE_OUTCOME[reported].get(task.status) if task.attempt == attempt else None
            if event == CONFIRM_CANCEL:
                hold(store.confirm_cancel, task_id, attempt=attempt, result=outcome[1] if (
                    reported in LATE_RESULT_KEPT) else None)
            elif event == FAIL:
                hold(store.fail, task_id, {"code": "internal_error",
                                           "message": "the handler stopped as cancelled "
                                                      "without a cancel"},
                     attempt=attempt)
            else:
                logger.debug("late outcome of task %s ignored: it is %s", task_id, task.status)
        return None

    def _maintain(self):
        last_beat = time.monotonic()
        while not self._stopped.wait(self.progress_interval_s):
            try:
                if self._lost:
                    self._register_again()
                with self._lock:
                    contexts = list(self._active.values())
                for ctx in contexts:
                    with contextlib.suppress(InvalidTransition, TaskNotFound):
                        ctx._flush(hold=False)
                # A refused heartbeat is tried again at once (every interval).
                if "heartbeat" in self._refusing or \
                        time.monotonic() - last_beat >= self.heartbeat_s:
                    last_beat = time.monotonic()
                    if self._beat():
                        for task_id in self.store.cancelling_owned(self.process_id):
                            with self._lock:
                                ctx = self._active.get(task_id)
                            if ctx is not None:
                                ctx.cancelled.set()
            except StoreClosed:
                return
            except StoreUnavailable as exc:
                self._complain(exc)
            except Exception:
                logger.exception("runner maintenance failed")


# =============================================================================
# 9. MCP server (stdio JSON-RPC)
# =============================================================================
# The MCP adapter, for both eras of MCP tasks over one store:
#   2025-11-25 ("legacy"): the initialize handshake and the core tasks methods;
#   2026-07-28 ("modern"): no handshake, every request carries its version and
#     capabilities in params._meta, tasks are the io.modelcontextprotocol/tasks
#     extension (SEP-2663).
# The first request of a connection picks its era and the era is then locked:
# a client speaks one era for its whole life, so a request of the other era
# is a mistake to refuse, not to guess about.  The tasks wire format is the
# public specification's
# (https://modelcontextprotocol.io/specification/2025-11-25/basic/utilities/tasks).
# One lifecycle, two wire projections: mcp_task_to_wire (legacy Task) and
# mcp_task_to_modern_wire (modern CreateTaskResult / DetailedTask) are the only
# producers of a task's wire shape.
# Two layers, as for LMSP in section 10: McpDispatcher decides (one decoded
# message in, the messages to send and the blocking work to run out; no
# streams, no threads), McpServer moves lines (a reader thread, two bounded
# pools that run the dispatcher's work, past which a request is refused, and
# the only writer of the output stream).  The dispatcher is a composition of
# parts with one job each: McpEras (the era and envelope of a request, the
# handshakes), McpTaskMethods (tasks/*), McpToolCalls (the tools, tools/call),
# McpInputRounds (2026-07-28 input rounds: InputRequiredResult and its signed
# requestState), McpClientRequests (our requests to the client) and
# McpTaskNotices (what the client hears about its tasks).  Rules: each era has
# one method table (McpDispatcher.methods), method -> handler and where it
# runs (the reader, the waiting pool or the write pool), and nothing else
# decides either; no
# SQL and no store locking here; every read of a task goes through
# McpTaskMethods.task; errors reach the client only through to_jsonrpc_error,
# which carries each class's extra data (or, for tasks/result, as the error
# stored when the task failed); the reader thread never waits for work; in
# the modern era the server never sends a request: a tool's question is an
# InputRequiredResult inline, inputRequests in a task; nothing lasts between
# two rounds of an inline call but what the client carries in requestState.

MCP_PROTOCOL_VERSION = "2025-11-25"
# Older revisions are served the way the 1.x SDK serves them: same
# capabilities, and a task request is still honoured (a client on an older
# revision that asks for a task has read a newer one).
MCP_PROTOCOL_VERSIONS = (MCP_PROTOCOL_VERSION, "2025-06-18", "2025-03-26", "2024-11-05")
MCP_TASK_KIND = "mcp.tools/call"        # the store kind of every task this adapter creates
RELATED_TASK = "io.modelcontextprotocol/related-task"
DRAFT_TASK_KEY = "modelcontextprotocol.io/task"   # SEP-1686 draft opt-in, in params._meta
TASK_SUPPORT = ("forbidden", "optional", "required")
DEFAULT_MCP_TTL_MS = 3600 * 1000
DEFAULT_MCP_POLL_INTERVAL_MS = 500
DEFAULT_MCP_PAGE_SIZE = 50
DEFAULT_MAX_LINE_BYTES = 4 * 1024 * 1024
# Where a request runs, as the method tables (McpDispatcher.methods) say.  On
# the transport's reader thread, answered by McpDispatcher.receive itself in
# arrival order: what neither waits for work nor writes.  The rest comes back
# as McpWork (its kind is the place) for two bounded pools, so that it never
# holds up the reader: what waits for work (a tasks/result for an unfinished
# task, a tools/call run inline) on the waiting pool; what may write (and so
# wait for a busy file) on the write pool.  Past either one's limit a request
# is refused at once with ServerBusy.
_READER = "reader"
_WAITING = "wait"
_WRITING = "write"
DEFAULT_MCP_MAX_WAITING = 64            # waiting requests served at once (--max-waiting)
MCP_WRITE_THREADS = 8                   # threads of the write pool
MCP_WRITE_BACKLOG = 1024                # write requests that may wait in line for one
MAX_SAFE_INTEGER = 2**53 - 1            # the largest ttl granted when there is no cap
SHUTDOWN_GRACE_S = 1.0                  # running work gets this long at EOF/SIGTERM
_MCP_TERMINAL = frozenset(MCP_STATUS[s] for s in TERMINAL_STATES)  # cancelling shows cancelled
# The statusMessage of a task MCP shows as cancelled, whatever its work said last.
MCP_CANCELLED_MESSAGE = "The task was cancelled."
_UNSET = object()
_NO_RESPONSE = object()                 # an inline call cancelled by the client gets no answer
# The 2026-07-28 era (the tasks extension).  The era is named by its version.
MCP_MODERN_VERSION = "2026-07-28"
_LISTEN_WAKE_S = 0.5        # how soon a subscriptions/listen notices its end (cancel, EOF)
MCP_MODERN_VERSIONS = (MCP_MODERN_VERSION,)      # versions served through the _meta envelope
MCP_SUPPORTED_VERSIONS = (MCP_MODERN_VERSION, MCP_PROTOCOL_VERSION)   # server/discover, -32022
TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
META_PROTOCOL_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CLIENT_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
META_SERVER_INFO = "io.modelcontextprotocol/serverInfo"
_LESSON_ID_KEYS = ("taskId", "id")     # the lesson-era methods also take the lesson's "id"
# 2026-07-28 dropped these methods; the -32601 says where their answer went.
_MODERN_REPLACED = {"initialize": "that era has no handshake: send server/discover",
                    "tasks/result": "poll tasks/get: it carries the result (or error) inline",
                    "tasks/status": "use tasks/get",
                    "tasks/list": "it has no listing; keep the task ids tools/call returns"}
_LEGACY = MCP_PROTOCOL_VERSION          # era names: the version each era is named after
_MODERN = MCP_MODERN_VERSION
META_LOG_LEVEL = "io.modelcontextprotocol/logLevel"
# MCP's log levels, least severe first (RFC 5424's, as MCP names them).
LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")
# What a tool may ask the client, and the client capability each needs.
_INPUT_CAPABILITY = {"elicitation/create": "elicitation", "sampling/createMessage": "sampling",
                     "roots/list": "roots"}
_INPUT_KEY = {"elicitation/create": "elicit", "sampling/createMessage": "sample",
              "roots/list": "roots"}            # a question's default key: elicit-1, sample-2 ...
# 2026-07-28 MRTR: how long a requestState is good for.  A retry comes back as
# soon as the user has answered; an hour bounds what a leaked state is worth.
MCP_REQUEST_STATE_TTL_MS = 3600 * 1000
_REQUEST_STATE_SECRET = "mcp.request_state"     # the store secret that signs it


class ParseError(TaskStoreError):
    """A line that is not JSON (or not UTF-8)."""

    code = "parse_error"
    http_status = 400
    jsonrpc_code = -32700


class InvalidRequest(TaskStoreError):
    """A message that is not a JSON-RPC 2.0 request, a batch, or a line too long."""

    code = "invalid_request"
    http_status = 400
    jsonrpc_code = -32600


class MethodNotFound(TaskStoreError):
    """An unknown method, or a tools/call that breaks the tool's taskSupport."""

    code = "method_not_found"
    http_status = 404
    jsonrpc_code = -32601


class ServerBusy(TaskStoreError):
    """A request refused at once because its pool is full (-32005); the client may retry.

    -32005 is in JSON-RPC's range for server-defined errors; Ethereum's
    JSON-RPC uses it for "limit exceeded" too.
    """

    code = "server_busy"
    http_status = 503
    jsonrpc_code = -32005


class McpError(TaskStoreError):
    """A JSON-RPC error with a chosen code.

    Raise it from a tool to end the call with that error: inline it is the
    answer to ``tools/call``; as a task the error is stored, the task is
    ``failed``, and ``tasks/result`` replays it.  ``elicit`` raises it when the
    client answers with an error or cannot elicit.
    """

    code = "mcp_error"

    def __init__(self, jsonrpc_code, message):
        super().__init__(message)
        self.jsonrpc_code = jsonrpc_code


class ElicitationMismatch(McpError):
    """The user accepted, but what the client sent does not fit the requested schema.

    ``ToolContext.elicit`` raises it (-32602) instead of handing the tool
    content it did not ask for; ``answer`` is the ElicitResult as received
    and ``problems`` says what did not match.  A tool may catch it and ask
    again or make do; uncaught, its message is the tool's answer:
    "the answer did not match the requested schema: 'answer' must be a
    string, not 42".
    """

    def __init__(self, answer, problems):
        super().__init__(-32602, "the answer did not match the requested schema: "
                                 + "; ".join(problems))
        self.answer, self.problems = answer, list(problems)


class MissingClientCapability(TaskStoreError):
    """2026-07-28: the request needs a client capability it did not declare (-32021).

    ``jsonrpc_data`` (``requiredCapabilities``) goes into the error's ``data``.
    """

    code = "missing_required_client_capability"
    http_status = 400
    jsonrpc_code = -32021

    def __init__(self, message="Missing required client capability", required=None):
        super().__init__(message)
        self.jsonrpc_data = {"requiredCapabilities":
                             required or {"extensions": {TASKS_EXTENSION: {}}}}


class UnsupportedProtocolVersion(TaskStoreError):
    """A protocol version this server does not serve (-32022), naming those it does."""

    code = "unsupported_protocol_version"
    http_status = 400
    jsonrpc_code = -32022

    def __init__(self, requested, supported):
        super().__init__(f"Unsupported protocol version: {_echo(repr(requested))}; "
                         f"supported: {', '.join(supported)}")
        self.jsonrpc_data = {"supported": list(supported), "requested": requested}


class InputRequired(Exception):
    """Ends an inline 2026-07-28 tool run that asked for what its request did not bring.

    ``ToolContext`` raises it; the dispatcher answers the ``tools/call``
    with an ``InputRequiredResult`` asking *requests* (key -> ``{method,
    params}``).  A tool must let it through (not catch it).
    """

    def __init__(self, requests):
        super().__init__(f"input required: {', '.join(requests)}")
        self.requests = requests


def _input_request_wire(request):
    """The ``InputRequest`` a stored or asked question shows on the 2026-07-28 wire."""
    params = dict(request.get("params") or {})
    if request["method"] == "elicitation/create":
        params.setdefault("mode", "form")
    return {"method": request["method"], "params": params}


def _input_result(method, key, answer):
    """The result in *answer* (``{"result"}`` or ``{"error"}``) to question *key*, checked.

    Raises:
        McpError: the client answered with an error.
        InvalidParams: the result is not what *method* answers.
    """
    if not isinstance(answer, dict):
        raise McpError(-32603, f"{_INPUT_KEY[method]} failed: no answer to {key!r}")
    if "error" in answer:
        error = answer["error"] if isinstance(answer["error"], dict) else {}
        code = error.get("code")
        raise McpError(code if isinstance(code, int) and not isinstance(code, bool) else -32603,
                       f"{method} failed: {error.get('message', 'error')}")
    result = answer.get("result")
    fits = isinstance(result, dict) and {
        "elicitation/create": lambda: result.get("action") in ("accept", "decline", "cancel"),
        "sampling/createMessage": lambda: "content" in result,
        "roots/list": lambda: isinstance(result.get("roots"), list)}[method]()
    if not fits:
        what = {"elicitation/create": "an ElicitResult", "roots/list": "a ListRootsResult",
                "sampling/createMessage": "a CreateMessageResult"}[method]
        raise InvalidParams(f"the answer to {key!r} is not {what}: {_shown(result)}",
                            param="inputResponses")
    return result


def _error_message(msg_id, exc):
    """Return the JSON-RPC error response to request *msg_id* for *exc*."""
    return {"jsonrpc": "2.0", "id": msg_id, "error": to_jsonrpc_error(exc)}


class _StoredError(Exception):
    """Carries a JSON-RPC error object stored with a failed task, replayed as is."""

    def __init__(self, error):
        super().__init__(error.get("message", ""))
        self.error = error


def text_result(text, is_error=False):
    """Return a CallToolResult holding one text block."""
    return {"content": [{"type": "text", "text": text}], "isError": bool(is_error)}


def mcp_task_to_wire(task, poll_interval_ms):
    """Return the MCP ``Task`` object for a stored task.

    The only producer of the Task's camelCase keys: tasks/get, tasks/cancel,
    tasks/list, CreateTaskResult and notifications/tasks/status all use it.
    """
    wire = {"taskId": task.id, "status": mcp_status(task),
            "createdAt": iso_time(task.created_at), "lastUpdatedAt": iso_time(task.updated_at),
            "ttl": task.ttl_ms, "pollInterval": poll_interval_ms}
    message = _mcp_status_message(task, wire["status"])
    if message:
        wire["statusMessage"] = message
    _mcp_queue_meta(task, wire)
    return wire


MCP_QUEUE_META = "taskstore/queue"      # the Task's _meta key of its place in the queue


def _mcp_queue_meta(task, wire):
    """Add a delayed, retried or prioritised task's queue fields under ``_meta`` (MCP allows it)."""
    fields = _queue_fields(task) if isinstance(task, Task) else None
    if fields:
        if "run_at" in fields:
            fields["run_at"] = iso_time(fields["run_at"])
        wire["_meta"] = {MCP_QUEUE_META: {
            {"run_at": "runAt", "max_attempts": "maxAttempts"}.get(k, k): v
            for k, v in fields.items()}}


def _mcp_status_message(task, status):
    """The statusMessage of a task MCP shows as *status*: a cancelled one says so.

    The stored message is the work's last report ("step 1/30"), or the
    failure's message; once cancelled, that report is no longer the news.
    """
    if status == "cancelled":
        return MCP_CANCELLED_MESSAGE
    return task.status_message or (task.error or {}).get("message")


def mcp_task_to_modern_wire(task, poll_interval_ms, *, created=False):
    """Return the 2026-07-28 projection of a stored task (tasks extension).

    The only producer of the modern task shapes: the flat ``CreateTaskResult``
    (*created*: ``resultType "task"``, no outcome) and the ``DetailedTask`` of
    tasks/get (``resultType "complete"``, with ``result`` when completed,
    ``error`` when failed, ``inputRequests`` when input_required).  Statuses
    follow the extension, not 2025-11-25: a tool result (``isError`` included)
    is ``completed``; only a JSON-RPC error (or a crash) is ``failed``.
    """
    status = mcp_status(task)
    error = task.error or {}
    if status == "failed" and isinstance(task.result, dict):
        status = "completed"                # stored failed: the tool's own isError result
    wire = {"resultType": "task" if created else "complete", "taskId": task.id,
            "status": status, "createdAt": iso_time(task.created_at),
            "lastUpdatedAt": iso_time(task.updated_at), "ttlMs": task.ttl_ms,
            "pollIntervalMs": poll_interval_ms}
    message = _mcp_status_message(task, status)
    if message:
        wire["statusMessage"] = message
    _mcp_queue_meta(task, wire)
    if created:
        return wire
    if status == "completed":
        wire["result"] = dict(task.result)
    elif status == "failed":
        code = error.get("code")
        if isinstance(code, int) and not isinstance(code, bool):
            wire["error"] = dict(error)     # the JSON-RPC error the tool raised
        else:                               # CRASH_RECOVERY and other store failures
            wire["error"] = {"code": -32603, "message": message or "task failed"}
    elif status == "input_required":
        wire["inputRequests"] = {}
        request = task.input_request if isinstance(task.input_request, dict) else {}
        parts = request.get("parts")
        if isinstance(parts, dict):         # the questions still pending (ToolContext.ask)
            wire["inputRequests"] = {key: _input_request_wire(part)
                                     for key, part in parts.items()}
        elif isinstance(request.get("method"), str):
            # One question, as rows written before questions came in parts
            # hold it; one written before keys existed gets a fixed one.
            wire["inputRequests"][request.get("key") or "input"] = _input_request_wire(request)
    return wire


def _create_task_result(task, poll_interval_ms, legacy):
    """Return the CreateTaskResult; the lesson's ``_meta.task`` mirror when *legacy*."""
    wire = mcp_task_to_wire(task, poll_interval_ms)
    result = {"task": wire}
    if legacy:
        result["_meta"] = {"task": {"id": wire["taskId"], "state": wire["status"],
                                    "ttl": wire["ttl"]}}
    return result


def _task_payload(task):
    """Return what tasks/result answers for a task MCP shows as terminal.

    Returns ``(result, None)`` for a CallToolResult carrying the related-task
    ``_meta``, or ``(None, error)`` for a JSON-RPC error the work raised.
    """
    status = mcp_status(task)
    error = task.error or {}
    if status == "completed":
        result = dict(task.result)
    elif status == "cancelled":
        # A cancelled task still answers a CallToolResult, never a bare {_meta}:
        # clients validate the result's shape before they look at the status.
        result = text_result(f"Task {task.id} was cancelled", is_error=True)
    elif isinstance(task.result, dict):
        result = dict(task.result)          # the tool's own isError result
    elif isinstance(error.get("code"), int) and not isinstance(error.get("code"), bool):
        return None, error                  # a JSON-RPC error: replay it
    else:                                   # e.g. CRASH_RECOVERY: report the failure
        result = text_result(task.status_message or error.get("message") or "task failed",
                             is_error=True)
    result["_meta"] = {**(result.get("_meta") or {}), RELATED_TASK: {"taskId": task.id}}
    return result, None


def _as_call_tool_result(value):
    """Turn a handler's return value into a CallToolResult."""
    if isinstance(value, str):
        return text_result(value)
    if isinstance(value, dict) and isinstance(value.get("content"), list):
        return value
    result = text_result(dumps(value))
    if isinstance(value, dict):
        result["structuredContent"] = value
    return result


def _type_ok(value, json_type):
    if json_type in ("number", "integer") and isinstance(value, bool):
        return False
    if json_type == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    expected = {"string": str, "number": (int, float), "boolean": bool, "object": dict,
                "array": list, "null": type(None)}.get(json_type)
    return expected is None or isinstance(value, expected)


def check_arguments(tool, arguments):
    """Check *arguments* against the tool's input schema (``required`` and ``type``).

    Raises:
        InvalidParams: naming the first offending field.
    """
    schema = tool.input_schema
    for name in schema.get("required", ()):
        if name not in arguments:
            raise InvalidParams(f"Invalid arguments for tool {tool.name}: "
                                f"missing required argument '{name}'", param=name)
    properties = schema.get("properties") or {}
    for name, value in arguments.items():
        json_type = (properties.get(name) or {}).get("type")
        if json_type is None:
            continue
        types = json_type if isinstance(json_type, list) else [json_type]
        if not any(_type_ok(value, t) for t in types):
            raise InvalidParams(f"Invalid arguments for tool {tool.name}: argument '{name}' "
                                f"must be of type {' or '.join(types)}", param=name)


def _shown(value):
    """A JSON value as a message shows it: compact, and cut short when long."""
    try:
        text = dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:39] + "\u2026"


def _valid_date(text, pattern):
    try:
        time.strptime(text, pattern)
    except ValueError:
        return False
    return True


# The string formats MCP elicitation allows, each a test of the whole string.
_ELICIT_FORMATS = {
    "email": lambda v: re.fullmatch(r"[^@\s]+@[^@\s]+", v) is not None,
    "uri": lambda v: re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*:\S*", v) is not None,
    "date": lambda v: re.fullmatch(r"\d{4}-\d\d-\d\d", v) is not None
                      and _valid_date(v, "%Y-%m-%d"),
    "date-time": lambda v: re.fullmatch(
        r"\d{4}-\d\d-\d\d[Tt]\d\d:\d\d:\d\d(\.\d+)?([Zz]|[+-]\d\d:\d\d)", v) is not None
                           and _valid_date(v[:19].upper(), "%Y-%m-%dT%H:%M:%S"),
}


def _choices(schema):
    """The allowed values of an enum schema (``enum``, or ``oneOf``/``anyOf`` of ``const``)."""
    if isinstance(schema.get("enum"), list):
        return schema["enum"]
    for key in ("oneOf", "anyOf"):
        options = schema.get(key)
        if isinstance(options, list) and all(isinstance(o, dict) and "const" in o
                                              for o in options):
            return [o["const"] for o in options]
    return None


def _value_problems(schema, value):
    """What in one answered *value* breaks its property *schema*; [] when it fits."""
    kind = schema.get("type")
    if kind == "array":                     # a multi-select enum
        if not isinstance(value, list):
            return [f"must be an array, not {_shown(value)}"]
        problems = []
        if isinstance(schema.get("minItems"), int) and len(value) < schema["minItems"]:
            problems.append(f"must have at least {schema['minItems']} items, not {len(value)}")
        if isinstance(schema.get("maxItems"), int) and len(value) > schema["maxItems"]:
            problems.append(f"must have at most {schema['maxItems']} items, not {len(value)}")
        items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        allowed = _choices(items)
        for item in value:
            if not isinstance(item, str) or (allowed is not None and item not in allowed):
                problems.append(f"has {_shown(item)}, which is not one of "
                                f"{', '.join(_shown(a) for a in allowed or ())}")
        return problems
    if isinstance(value, (dict, list)) or value is None or (
            isinstance(kind, str) and not _type_ok(value, kind)):
        what = {"integer": "an integer"}.get(kind, f"a {kind}" if isinstance(kind, str)
                                             else "a string, a number or a boolean")
        return [f"must be {what}, not {_shown(value)}"]
    allowed = _choices(schema)
    if allowed is not None and value not in allowed:
        return [f"must be one of {', '.join(_shown(a) for a in allowed)}, not {_shown(value)}"]
    problems = []
    if isinstance(value, str):
        if isinstance(schema.get("minLength"), int) and len(value) < schema["minLength"]:
            problems.append(f"must be at least {schema['minLength']} characters long")
        if isinstance(schema.get("maxLength"), int) and len(value) > schema["maxLength"]:
            problems.append(f"must be at most {schema['maxLength']} characters long")
        check = _ELICIT_FORMATS.get(schema.get("format"))
        if check is not None and not check(value):
            article = "an" if schema["format"] == "email" else "a"
            problems.append(f"must be {article} {schema['format']}, not {_shown(value)}")
    elif not isinstance(value, bool):
        for key, word, broken in (("minimum", "at least", lambda m: value < m),
                                  ("maximum", "at most", lambda m: value > m)):
            limit = schema.get(key)
            if isinstance(limit, (int, float)) and not isinstance(limit, bool) and broken(limit):
                problems.append(f"must be {word} {_shown(limit)}, not {_shown(value)}")
    return problems


def elicitation_problems(schema, content):
    """Return what in *content* does not fit *schema*, a requested elicitation schema.

    MCP restricts ``requestedSchema`` to a flat object of primitive
    properties; this checks what that subset can say: ``required``, each
    property's ``type`` (string, number, integer, boolean, or an array of
    enum strings for a multi-select), ``enum`` (or ``oneOf``/``anyOf`` of
    ``const``), ``minLength``/``maxLength``, ``format`` (email, uri, date,
    date-time), ``minimum``/``maximum``, ``minItems``/``maxItems``, and
    ``additionalProperties: false``.  Other keywords are ignored.  Returns
    a list of sentences, empty when the content fits.
    """
    if not isinstance(schema, dict):
        return []
    if not isinstance(content, dict):
        return [f"content must be an object, not {_shown(content)}"]
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    problems = [f"missing required field {name!r}" for name in required
                if isinstance(name, str) and name not in content]
    for name, value in content.items():
        prop = properties.get(name)
        if isinstance(prop, dict):
            problems += [f"{name!r} {problem}" for problem in _value_problems(prop, value)]
        elif schema.get("additionalProperties") is False:
            problems.append(f"unexpected field {name!r}")
    return problems


def _task_request(params):
    """Return ``(ttl, legacy, optional)`` when *params* ask for a task, else None.

    ``ttl`` is ``_UNSET`` when the request names none.  The specification's
    form wins over the older ones a client may still send: ``params.task``,
    then the lesson's ``_meta.task``, then
    the SEP draft's ``_meta["modelcontextprotocol.io/task"]`` (its
    ``keepAlive`` is the TTL hint; its client-chosen ``taskId`` is ignored).
    ``optional`` is True when the lesson's form leaves the choice to the
    server (``required: false`` or ``optional: true``): a tool that supports
    tasks becomes one, a forbidden tool runs inline.
    """
    task = params.get("task")
    if task is not None:
        if not isinstance(task, dict):
            raise InvalidParams("task must be an object", param="task")
        return task.get("ttl", _UNSET), False, False
    meta = params.get("_meta")
    if not isinstance(meta, dict):
        return None
    lesson = meta.get("task")
    if isinstance(lesson, dict):
        optional = lesson.get("required") is False or (
            lesson.get("optional") is True and lesson.get("required") is not True)
        return lesson.get("ttl", _UNSET), True, optional
    draft = meta.get(DRAFT_TASK_KEY)
    if isinstance(draft, dict):
        return draft.get("keepAlive", _UNSET), True, False
    return None


def _message_kind(message):
    """Classify a decoded message as "request", "notification" or "response".

    Raises:
        InvalidRequest: not a JSON-RPC 2.0 message (a batch is not accepted).
    """
    if isinstance(message, list):
        raise InvalidRequest("batches are not supported")
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
        raise InvalidRequest("not a JSON-RPC 2.0 message")
    has_id = "id" in message
    msg_id = message.get("id")
    if has_id and (isinstance(msg_id, bool) or not isinstance(msg_id, (str, int))):
        raise InvalidRequest("id must be a string or an integer")
    if "method" in message:
        if not isinstance(message["method"], str):
            raise InvalidRequest("method must be a string")
        return "request" if has_id else "notification"
    if has_id and ("result" in message or "error" in message):
        return "response"
    raise InvalidRequest("not a JSON-RPC 2.0 request")


class _LineReader:
    """Split a binary stream into lines of at most *limit* bytes (newline excluded).

    Reads in chunks (``read1`` when the stream has it, else ``read``), so a
    raw unbuffered stdin works: no Python-level lock is held while blocked,
    which lets the interpreter exit while the reader thread still waits.  A
    longer line is dropped as it arrives, never held in memory whole.
    """

    def __init__(self, stream, limit):
        self._read = getattr(stream, "read1", stream.read)
        self._limit = limit
        self._buffer = bytearray()

    def next(self):
        """Return ``(line, too_long)``; ``(None, False)`` at EOF."""
        skipping = False
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end + 1])
                del self._buffer[:end + 1]
                if skipping or end > self._limit:
                    return b"", True
                return line, False
            if len(self._buffer) > self._limit:
                skipping = True
                self._buffer.clear()
            chunk = self._read(65536)
            if not chunk:
                line, self._buffer = bytes(self._buffer), bytearray()
                if skipping or len(line) > self._limit:
                    return b"", True
                return (line, False) if line else (None, False)
            self._buffer += chunk


class _Pool:
    """Threads for requests: *size* run at once, *backlog* more wait in line, the rest are refused.

    A thread starts when a request finds none free and then stays for the
    next one (at most *size* ever exist); ``close`` ends them.  ``submit``
    never blocks, so the reader thread that calls it never waits.
    """

    def __init__(self, size, backlog, name):
        self.size, self.backlog, self.name = size, backlog, name
        self._lock = threading.Lock()
        self._jobs = queue.SimpleQueue()
        self._busy = 0                  # submitted and not finished: running or in line
        self._threads = []

    def submit(self, job):
        """Run ``job()`` on a thread of the pool; return False (and run nothing) when full."""
        with self._lock:
            if self._busy >= self.size + self.backlog:
                return False
            self._busy += 1
            if len(self._threads) < min(self._busy, self.size):
                thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                try:
                    thread.start()
                except RuntimeError:    # the system has no thread left to give
                    self._busy -= 1
                    return False
                self._threads.append(thread)
        self._jobs.put(job)
        return True

    def _work(self):
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:           # a bug in one request must not cost a thread
                logger.exception("mcp request failed")
            finally:
                with self._lock:
                    self._busy -= 1

    def close(self, deadline):
        """Let the threads finish what was submitted, then end; wait until *deadline*."""
        with self._lock:
            threads = list(self._threads)
        for _ in threads:
            self._jobs.put(None)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


class McpTool(typing.NamedTuple):
    """A tool the server offers: ``handler(ctx, arguments)`` returns the result.

    The handler returns a string (one text block), a CallToolResult dict (with
    ``content``; ``isError: true`` makes a task ``failed``) or any other JSON
    value (sent as text plus ``structuredContent``).  It raises ``McpError``
    to answer with a JSON-RPC error; any other exception becomes an
    ``isError`` result with a generic text (the traceback goes to the log).

    ``prepare(ctx, arguments)``, when given, runs first, before the call is
    decided to run inline or as a task, and asks what the work needs to
    know up front (``ctx.elicit`` ...): in 2026-07-28 its questions are
    input rounds on the ``tools/call`` itself, before any task exists.
    What it returns (a JSON value) is the handler's ``ctx.prepared``, kept
    in the task's payload when the call becomes a task.

    ``retry``, ``priority`` and ``delay`` are the queue options of the tasks
    its calls create (``create``'s): MCP clients send no queue options, so
    the server decides them per tool.  A call run inline has none.  With a
    retry policy, an ``isError`` result (or an exception, which becomes
    one) runs the tool again after the backoff; a JSON-RPC error (an
    ``McpError`` the tool raised) fails at once.
    """

    name: str
    handler: object
    description: str
    input_schema: dict
    task_support: str
    prepare: object = None
    retry: object = None                # a Retry, or None: one attempt
    priority: int = DEFAULT_PRIORITY
    delay: object = None                # seconds a task of this tool waits first, or None

    def to_wire(self, era=_LEGACY):
        """Return the ``tools/list`` entry (2026-07-28 has no ``execution``)."""
        wire = {"name": self.name, "description": self.description,
                "inputSchema": self.input_schema}
        if era == _LEGACY:
            wire["execution"] = {"taskSupport": self.task_support}
        return wire


class ToolContext:
    """What a tool handler receives besides its arguments.

    ``task_id`` is the task's id when the call runs as a task, None inline.
    ``cancelled`` is a ``threading.Event`` set when the task is cancelled (or
    the inline request is cancelled by ``notifications/cancelled``); long work
    waits on it instead of sleeping, so it stops at once.  ``era`` is the MCP
    version whose client made the call (``"2025-11-25"`` or ``"2026-07-28"``);
    tools rarely need it: the same handler serves both eras.  ``prepared``
    is what the tool's ``prepare`` returned (None without one).

    Asking the client (``elicit``, ``sample``, ``list_roots``, several at
    once with ``ask``) works in every case, each era its own way: in
    2025-11-25 the question goes out as a request to the client and the
    call waits for the answer; in a 2026-07-28 task it waits in the store
    (``inputRequests`` on tasks/get, answered with tasks/update); in an
    inline 2026-07-28 call it ends this run of the handler with an
    ``InputRequiredResult``, and the client's retry (with ``inputResponses``
    and the signed ``requestState``) runs the handler again from the start,
    this time with the answers: the same questions under the same keys
    get them at once.  So a handler asks the same questions in the same
    order on every run, and does nothing it cannot repeat before it has
    its answers (``InputRequired``, which ends the run, must not be caught).
    """

    def __init__(self, dispatcher, *, task_ctx=None, progress_token=None, era=_LEGACY,
                 capabilities=None, answers=None, log_level=None, prepared=None):
        self._dispatcher = dispatcher
        self._task_ctx = task_ctx
        self._progress_token = progress_token
        self.task_id = task_ctx.task_id if task_ctx is not None else None
        self.cancelled = task_ctx.cancelled if task_ctx is not None else threading.Event()
        if task_ctx is not None:            # a task: what its creating request said
            era = task_ctx.task.meta.get("era", _LEGACY)
            capabilities = task_ctx.task.meta.get("capabilities")
            payload = task_ctx.task.payload
            prepared = payload.get("prepared") if isinstance(payload, dict) else None
        self.era = era
        self.prepared = prepared
        self._capabilities = capabilities   # modern: the request's clientCapabilities
        self._answers = answers or {}       # modern inline: key -> the client's answer
        self.used = {}                      # modern inline: the answers this run used
        self._asked = 0                     # questions asked so far: default keys count them
        self._log_level = log_level         # modern inline: the request's logLevel

    @property
    def client_capabilities(self):
        """The capabilities the client declared: its request's (2026-07-28), or initialize's."""
        if self.era == _MODERN:
            return self._capabilities or {}
        return self._dispatcher.client_capabilities

    def is_cancelled(self):
        """True once the work should stop."""
        return self.cancelled.is_set()

    def progress(self, value, total=None, message=None):
        """Report progress; as a task *message* also becomes the statusMessage.

        The client hears ``notifications/progress`` when its request carried a
        ``progressToken`` (for a task: until the task is terminal).
        """
        if self._task_ctx is not None:
            if message is None:
                self._task_ctx.progress(value, total=total)
            else:
                self._task_ctx.progress(value, total=total, message=message)
        elif self._progress_token is not None:
            self._dispatcher.notices.progress(self._progress_token, value, total, message, None)

    def log(self, level, data, logger=None):
        """Send the client a log message (``notifications/message``); return whether it went.

        *level* is one of ``LOG_LEVELS`` (``"debug"`` ... ``"emergency"``);
        *data* any JSON value.  It goes out when the client asked for that
        level or a lower one: in 2025-11-25 with ``logging/setLevel`` (all
        levels until it does), in 2026-07-28 with its request's
        ``_meta["io.modelcontextprotocol/logLevel"]`` (without it, none).
        A 2026-07-28 task sends none (the tasks extension has no place for
        them); a 2025-11-25 task only to the client that created it, with
        the related-task ``_meta``.

        Raises:
            InvalidParams: *level* is not a log level.
        """
        if level not in LOG_LEVELS:
            raise InvalidParams(f"level must be one of {', '.join(LOG_LEVELS)}", param="level")
        if self.era == _MODERN:
            wanted = None if self._task_ctx is not None else self._log_level
        else:
            wanted = self._dispatcher.eras.log_level
            if self._task_ctx is not None and \
                    self._task_ctx.task.meta.get("session") != self._dispatcher._session:
                wanted = None               # its client is not connected here
        if wanted is None or LOG_LEVELS.index(level) < LOG_LEVELS.index(wanted):
            return False
        params = {"level": level, "data": data}
        if logger is not None:
            params["logger"] = logger
        if self._task_ctx is not None:
            params["_meta"] = {RELATED_TASK: {"taskId": self.task_id}}
        self._dispatcher.notices.notify("notifications/message", params)
        return True

    def elicit(self, message, requested_schema, *, key=None):
        """Ask the user through the client (``elicitation/create``); return the ElicitResult.

        Returns ``{"action": "accept"|"decline"|"cancel", "content": {...}}``.
        As a task, the task is ``input_required`` until the answer arrives,
        then ``working`` again.  *key* names the question in an inline
        2026-07-28 call's ``inputRequests`` (by default ``elicit-<n>``, n
        counting this run's questions).

        Raises:
            McpError: the client answered with an error, or (2025-11-25) did
                not declare elicitation.
            MissingClientCapability: (2026-07-28) the client did not declare it.
            ElicitationMismatch: (an McpError) the user accepted, but the content
                does not fit *requested_schema*; its message says what did not.
            Cancelled: the task (or inline request) was cancelled while waiting.
        """
        result = self._ask_one("elicitation/create", {"message": message,
                                                      "requestedSchema": requested_schema}, key)
        if result.get("action") == "accept":
            # Accepted content the tool did not ask for is a mistake to name, never
            # to pass on as if the user had answered (or had not).
            problems = elicitation_problems(requested_schema, result.get("content", {}))
            if problems:
                raise ElicitationMismatch(result, problems)
        return result

    def sample(self, messages, max_tokens, *, key=None, **params):
        """Ask the client's model (``sampling/createMessage``); return the CreateMessageResult.

        *messages* is the SamplingMessage list, or a string (one user
        message); *params* adds the request's other fields (``systemPrompt``,
        ``temperature`` ...).  Asked as ``elicit`` asks (*key*: ``sample-<n>``).
        """
        if isinstance(messages, str):
            messages = [{"role": "user", "content": {"type": "text", "text": messages}}]
        return self._ask_one("sampling/createMessage",
                             {"messages": messages, "maxTokens": max_tokens, **params}, key)

    def list_roots(self, *, key=None):
        """Ask the client for its roots (``roots/list``); return the list of Root objects."""
        return self._ask_one("roots/list", {}, key)["roots"]

    def ask(self, requests):
        """Ask the client several things at once; return ``{key: result}``.

        *requests* maps a key to ``{"method": ..., "params": {...}}``, the
        method one of ``elicitation/create``, ``sampling/createMessage`` and
        ``roots/list``.  All go out together (one ``InputRequiredResult``,
        one ``input_required`` with several ``inputRequests``, or several
        requests to the client at once) and this returns when all are
        answered.  Each result is the client's, checked for its shape (an
        ElicitResult is not checked against its schema here: ``elicit`` does).

        Raises:
            InvalidParams: a method that cannot be asked, or an answer of
                the wrong shape.
            McpError, MissingClientCapability, Cancelled: as ``elicit``.
        """
        if not isinstance(requests, dict) or not requests:
            raise InvalidParams("requests must be a non-empty object", param="requests")
        wire = {}
        for key, request in requests.items():
            method = request.get("method") if isinstance(request, dict) else None
            capability = _INPUT_CAPABILITY.get(method)
            if not isinstance(key, str) or capability is None:
                raise InvalidParams(f"cannot ask the client {_echo(repr(method))} under "
                                    f"{_echo(repr(key))}", param="requests")
            if capability not in self.client_capabilities:
                if self.era == _MODERN:
                    raise MissingClientCapability(f"the client does not support {capability}",
                                                  {capability: {}})
                raise McpError(-32601, f"the client does not support {capability}")
            wire[key] = {"method": method, "params": dict(request.get("params") or {})}
        self._asked += len(wire)
        if self._task_ctx is not None:
            answers = self._ask_in_task(wire)
        elif self.era == _MODERN:
            answers = self._answered(wire)
        else:
            answers = self._dispatcher.requests.ask(wire, self.cancelled)
        return {key: _input_result(wire[key]["method"], key, answers[key]) for key in wire}

    def _ask_one(self, method, params, key):
        key = key if key is not None else f"{_INPUT_KEY[method]}-{self._asked + 1}"
        return self.ask({key: {"method": method, "params": params}})[key]

    def _answered(self, wire):
        """2026-07-28 inline: the answers the request brought, or end this run asking for them."""
        missing = {key: request for key, request in wire.items() if key not in self._answers}
        if missing:
            raise InputRequired(missing)
        for key in wire:
            self.used[key] = self._answers[key]
        return {key: {"result": self._answers[key]} for key in wire}

    def _ask_in_task(self, wire):
        """A task waits in the store for the answers (``input_required``)."""
        if self.era == _LEGACY and \
                self._task_ctx.task.meta.get("session") != self._dispatcher._session:
            # Claimed from a file shared with another server: its client is not ours.
            raise McpError(-32603, "the client that created this task is not connected here")
        # A key is unique for the task's life: never reused after an answer.
        minted = {f"{key}-{secrets.token_hex(8)}": key for key in wire}
        answer = self._task_ctx.ask({"parts": {m: wire[key] for m, key in minted.items()}})
        parts = answer.get("parts") if isinstance(answer, dict) else None
        parts = parts if isinstance(parts, dict) else {}
        return {key: parts.get(m) for m, key in minted.items()}


class McpWork(typing.NamedTuple):
    """Work a request needs that may block, described for the transport to run.

    ``McpDispatcher.receive`` returns one instead of a response when the
    method table places the request on a pool: ``kind`` "wait" (the waiting
    pool: a tasks/result for an unfinished task, a tools/call run inline) or
    "write" (the write pool: anything else that may write to a file that may
    be busy); or when an answer to one of our requests must be handed to the
    work that waits for it (``kind`` "answer").  The transport calls ``run()``
    on a thread of its choosing and sends the messages it returns; ``msg_id``
    is the request's id, for the error the transport sends if it refuses the
    work (ServerBusy), None for an answer.
    """

    kind: str
    msg_id: object
    run: object


class _McpRequest(typing.NamedTuple):
    """One request as its handler sees it: the era that serves it, and its checked envelope.

    ``params`` is a dict (``{}`` when the request had none);
    ``capabilities`` is this very request's clientCapabilities in
    2026-07-28, None in 2025-11-25 (where ``initialize`` declared them once).
    """

    id: object
    method: str
    params: dict
    era: str
    capabilities: object


def _enveloped(message):
    """True when *message* carries the 2026-07-28 envelope (``params._meta`` naming its version).

    What chooses the era of a request, on stdio (``McpEras.select``) and
    over HTTP (``McpHttp``, where an enveloped request needs no session).
    """
    params = message.get("params")
    meta = params.get("_meta") if isinstance(params, dict) else None
    return isinstance(meta, dict) and META_PROTOCOL_VERSION in meta


def _declares_tasks(capabilities):
    """True when this very 2026-07-28 request declares the tasks extension.

    Never remembered from an earlier request: in 2026-07-28 each request
    carries its own capabilities, and a client may drop the extension.
    """
    extensions = capabilities.get("extensions")
    return isinstance(extensions, dict) and TASKS_EXTENSION in extensions


class McpEras:
    """Choose the era of each request, open its envelope, and answer the handshakes.

    The first request picks the era for the whole connection (``era``):
    ``initialize`` -> 2025-11-25; a request whose ``params._meta`` names
    ``io.modelcontextprotocol/protocolVersion`` -> 2026-07-28.  Anything else
    before either is served as 2025-11-25 was before this server knew two
    eras, without locking.  ``open`` turns a request of the chosen era into
    an ``_McpRequest`` and finds its row in that era's method table;
    ``finish`` puts the era's envelope on a result.
    """

    def __init__(self, mcp):
        self._mcp = mcp                     # the dispatcher: server_info, list_tasks
        self.era = None                     # "2025-11-25" or "2026-07-28" once chosen
        self.client_capabilities = {}       # 2025-11-25: what initialize declared
        self.log_level = "debug"            # 2025-11-25: logging/setLevel's (all until then)
        self._lock = threading.Lock()

    def select(self, message):
        """Return the era that serves *message*, locking the connection's era.

        ``initialize`` locks 2025-11-25; a request carrying the 2026-07-28
        envelope (``params._meta`` with a served protocolVersion) locks
        2026-07-28.  An envelope naming a version not served is -32022 and
        locks nothing, so the client may still retry or fall back to
        ``initialize``.

        Raises:
            UnsupportedProtocolVersion: -32022 (also ``initialize`` once modern).
            InvalidRequest: -32600, an envelope after ``initialize`` or a
                request without one once modern.
        """
        params = message.get("params")
        enveloped = _enveloped(message)
        if not enveloped and self.era == _LEGACY:
            return _LEGACY                  # final once chosen: no lock for every request
        with self._lock:
            if enveloped:
                if self.era == _LEGACY:
                    raise InvalidRequest("this connection began with initialize (MCP "
                                         "2025-11-25): params._meta must not carry "
                                         f"{META_PROTOCOL_VERSION}")
                version = params["_meta"][META_PROTOCOL_VERSION]
                if version not in MCP_MODERN_VERSIONS:
                    raise UnsupportedProtocolVersion(
                        version, MCP_MODERN_VERSIONS if self.era == _MODERN
                        else MCP_SUPPORTED_VERSIONS)
                if self.era is None:
                    logger.info("mcp era %s, chosen by %s", _MODERN, message.get("method"))
                self.era = _MODERN
                return _MODERN
            if self.era == _MODERN:
                if message.get("method") == "initialize":
                    raise UnsupportedProtocolVersion(
                        params.get("protocolVersion") if isinstance(params, dict) else None,
                        MCP_MODERN_VERSIONS)
                raise InvalidRequest("this connection speaks MCP 2026-07-28: every request "
                                     f"carries params._meta[{META_PROTOCOL_VERSION!r}]")
            if message.get("method") == "initialize":
                if self.era is None:
                    logger.info("mcp era %s, chosen by initialize", _LEGACY)
                self.era = _LEGACY
            return _LEGACY

    def open(self, message, era, table):
        """Return ``(request, row)``: *message* as an ``_McpRequest`` of *era*, its *table* row.

        Raises:
            InvalidParams: 2026-07-28 without clientCapabilities; params not an object.
            MethodNotFound: a method *table* does not hold (in 2026-07-28, one the
                era dropped says where its answer went).
        """
        method, params = message.get("method"), message.get("params")
        capabilities = None
        if era == _MODERN:
            capabilities = params["_meta"].get(META_CLIENT_CAPABILITIES)
            if not isinstance(capabilities, dict):
                raise InvalidParams(f"params._meta[{META_CLIENT_CAPABILITIES!r}] must be an "
                                    "object", param=META_CLIENT_CAPABILITIES)
            if params["_meta"].get(META_LOG_LEVEL, "debug") not in LOG_LEVELS:
                raise InvalidParams(f"params._meta[{META_LOG_LEVEL!r}] must be one of "
                                    f"{', '.join(LOG_LEVELS)}", param=META_LOG_LEVEL)
        row = table.get(method) if isinstance(method, str) else None
        if row is None:
            hint = _MODERN_REPLACED.get(method) if era == _MODERN and isinstance(method, str) \
                else None
            if hint is not None:
                raise MethodNotFound(f"method not found: {_echo(method)} is not part of "
                                     f"MCP {_MODERN}; {hint}")
            raise MethodNotFound(f"method not found: {_echo(method)}")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise InvalidParams("params must be an object", param="params")
        return _McpRequest(message.get("id"), method, params, era, capabilities), row

    def finish(self, request, result):
        """Return *result* in its era's envelope (2026-07-28: ``resultType``, serverInfo)."""
        if request.era != _MODERN or result is _NO_RESPONSE:
            return result
        result = dict(result)
        result.setdefault("resultType", "complete")
        result["_meta"] = {**(result.get("_meta") or {}), META_SERVER_INFO: self._mcp.server_info}
        return result

    # -- the handshakes: method handlers of both eras ---------------------------

    def initialize(self, request):
        """2025-11-25 ``initialize``: remember the client's capabilities, declare ours."""
        params = request.params
        requested = params.get("protocolVersion")
        version = requested if requested in MCP_PROTOCOL_VERSIONS else MCP_PROTOCOL_VERSION
        capabilities = params.get("capabilities")
        self.client_capabilities = capabilities if isinstance(capabilities, dict) else {}
        tasks = {"cancel": {}, "requests": {"tools": {"call": {}}}}
        if self._mcp.list_tasks:
            tasks["list"] = {}
        return {"protocolVersion": version,
                "capabilities": {"tools": {"listChanged": False}, "logging": {}, "tasks": tasks},
                "serverInfo": self._mcp.server_info}

    @staticmethod
    def ping(request):
        """2025-11-25 ``ping``."""
        return {}

    def set_log_level(self, request):
        """2025-11-25 ``logging/setLevel``: the least severe level the client hears from now on."""
        level = request.params.get("level")
        if level not in LOG_LEVELS:
            raise InvalidParams(f"level must be one of {', '.join(LOG_LEVELS)}", param="level")
        self.log_level = level
        return {}

    @staticmethod
    def discover(request):
        """2026-07-28 ``server/discover``."""
        # Everything a modern client checks, answered at once: a client that hears
        # nothing waits out a 10 s probe before it falls back to initialize.
        return {"supportedVersions": list(MCP_SUPPORTED_VERSIONS),
                "capabilities": {"tools": {"listChanged": False}, "logging": {},
                                 "extensions": {TASKS_EXTENSION: {}}},
                "ttlMs": 0, "cacheScope": "private"}


class McpTaskMethods:
    """The tasks/* methods of both eras: read, wait for, cancel, list and answer for a task.

    Every method reads the task it names through ``task`` (one
    ``TaskStore.get``) and shows it through its era's one projection
    (``mcp_task_to_wire``, ``mcp_task_to_modern_wire``).  2025-11-25's
    tasks/status, tasks/result and tasks/cancel also take the lesson's
    ``id`` for ``taskId``.
    """

    def __init__(self, mcp):
        self._mcp = mcp     # the dispatcher: store, poll_interval_ms, page_size, closing

    def task(self, params, keys=("taskId",)):
        """Return the MCP task *params* name (under the first of *keys* present).

        Raises:
            InvalidParams: no id, or not a string.
            TaskNotFound: no such task, or one another adapter created.
            TaskExpired: the task has expired.
        """
        task_id = next((params[key] for key in keys if key in params), None)
        if not isinstance(task_id, str):
            raise InvalidParams("taskId must be a string", param="taskId")
        task = self._mcp.store.get(task_id, principal=self._mcp.principal)
        if task.kind != MCP_TASK_KIND:      # another adapter's task is not an MCP task
            raise TaskNotFound(task_id)
        return task

    # -- 2025-11-25 --------------------------------------------------------------

    def get(self, request):
        """tasks/get: the Task."""
        return mcp_task_to_wire(self.task(request.params), self._mcp.poll_interval_ms)

    def status(self, request):
        """tasks/status, the lesson's poll method: tasks/get plus its id/state mirror fields."""
        wire = mcp_task_to_wire(self.task(request.params, _LESSON_ID_KEYS),
                                self._mcp.poll_interval_ms)
        return {**wire, "id": wire["taskId"], "state": wire["status"]}

    def finished(self, request):
        """True when the task a tasks/result names is one MCP shows as finished.

        Reads the task as ``result`` does, so the method table and the
        handler never disagree about which task that is.

        Raises what ``task`` raises.
        """
        return mcp_status(self.task(request.params, _LESSON_ID_KEYS)) in _MCP_TERMINAL

    def result(self, request):
        """tasks/result: wait until the task is finished; answer its outcome."""
        task = self.task(request.params, _LESSON_ID_KEYS)
        closing = self._mcp.closing
        # cancel_inline(request id) ends the wait (HTTP: its client left); no answer then.
        with self._mcp.calls.cancellable(request.id, threading.Event()) as cancelled:
            while mcp_status(task) not in _MCP_TERMINAL:
                if closing.is_set():
                    raise StoreClosed("the server is shutting down")
                if cancelled.is_set():
                    return _NO_RESPONSE
                # Bounded waits so that shutdown is noticed; in-process changes wake it at once.
                task = self._mcp.store.wait(task.id, timeout=0.25, since_version=task.version)
        if closing.is_set():
            # Stopping, and read after the stop began: what the task shows now may be the
            # shutdown's own CRASH_RECOVERY, so every answer not given yet is this one.
            raise StoreClosed("the server is shutting down")
        result, error = _task_payload(task)
        if error is not None:
            raise _StoredError(error)
        return result

    def cancel(self, request):
        """tasks/cancel: the cancelled Task; a task MCP shows as terminal is -32602."""
        task = self.task(request.params, _LESSON_ID_KEYS)
        try:
            # 2025-11-25: a cancel of a task in a terminal status is -32602, and
            # what counts is what MCP shows: cancelling is "cancelled" too.
            task = self._mcp.store.cancel(task.id, refuse_repeat=True)
        except NotCancelable as exc:
            # Same error class, MCP's word for the status in its message.
            raise NotCancelable(task.id, mcp_status(exc.state)) from None
        return mcp_task_to_wire(task, self._mcp.poll_interval_ms)

    def list(self, request):
        """tasks/list: a page of Tasks, newest first, and the next page's cursor."""
        mcp = self._mcp
        tasks, next_cursor = mcp.store.list(kind=MCP_TASK_KIND, limit=mcp.page_size,
                                            cursor=request.params.get("cursor"),
                                            principal=mcp.principal)
        result = {"tasks": [mcp_task_to_wire(t, mcp.poll_interval_ms) for t in tasks]}
        if next_cursor is not None:
            result["nextCursor"] = next_cursor
        return result

    # -- 2026-07-28 (the io.modelcontextprotocol/tasks extension) ----------------

    def _modern_task(self, request, legacy_ok):
        """Return the task a modern tasks/* request names, after the -32021 gate.

        A request that does not declare the extension but declares the
        legacy ``tasks`` capability may read or cancel (``legacy_ok``) a task
        created in the 2025-11-25 era, so a client that upgrades mid-task
        still reaches it; anything else undeclared is -32021.
        """
        capabilities = request.capabilities
        if _declares_tasks(capabilities):
            return self.task(request.params)
        if legacy_ok and isinstance(capabilities.get("tasks"), dict):
            with contextlib.suppress(TaskStoreError):
                task = self.task(request.params)
                if task.meta.get("era", _LEGACY) == _LEGACY:
                    return task
        raise MissingClientCapability()

    def get_modern(self, request):
        """tasks/get: the DetailedTask (its result, error or input requests inline)."""
        return mcp_task_to_modern_wire(self._modern_task(request, legacy_ok=True),
                                       self._mcp.poll_interval_ms)

    def update(self, request):
        """tasks/update: hand the task the answers to its input requests; an empty ack."""
        # Answers for outstanding keys are stored -- and so retired -- before the
        # ack, so a client that polls after the ack never sees the question again;
        # unknown, stale or repeated keys are ignored (a retry must be harmless).
        task = self._modern_task(request, legacy_ok=False)
        responses = request.params.get("inputResponses")
        if not isinstance(responses, dict):
            raise InvalidParams("inputResponses must be an object", param="inputResponses")
        pending = mcp_task_to_modern_wire(task, self._mcp.poll_interval_ms).get(
            "inputRequests", {})
        given = {}
        for key, response in responses.items():
            if key not in pending:
                continue
            if not isinstance(response, dict):
                raise InvalidParams(f"inputResponses[{key!r}] must be an object",
                                    param="inputResponses")
            given[key] = {"result": response}
        if not given:
            return {}
        in_parts = isinstance((task.input_request or {}).get("parts"), dict)
        try:                                # all the answers given, in one write
            self._mcp.store.provide_input(
                task.id, {"parts": given} if in_parts else next(iter(given.values())))
        except InvalidTransition:           # answered, cancelled or ended meanwhile
            logger.debug("input for %s dropped: it is no longer waiting", task.id)
        return {}

    def cancel_modern(self, request):
        """tasks/cancel: an empty ack, whatever the task's status."""
        # A plain ack: a terminal task stays as it is and is no error, because
        # the client cannot know whether the task ended before its cancel arrived.
        task = self._modern_task(request, legacy_ok=True)
        if not task.terminal:
            with contextlib.suppress(NotCancelable):
                self._mcp.store.cancel(task.id)
        return {}


class McpToolCalls:
    """The tools: their registry, tools/list, and tools/call run inline or as a task.

    ``plan`` is the one place that decides how a call runs (inline, or as a
    task, or refused); the method table places the call by it and ``call``
    runs it by it.  A task runs later on a Runner, through ``run_task``.
    """

    def __init__(self, mcp):
        self._mcp = mcp     # the dispatcher: store, owner, ttl settings, session, notices
        self.tools = {}
        self._lock = threading.Lock()
        self._inline = {}                   # client request id -> its cancel event (cancellable)

    def add_tool(self, name, handler, *, description="", input_schema=None,
                 task_support="forbidden", prepare=None, retry=None,
                 priority=DEFAULT_PRIORITY, delay=None):
        """Register a tool; see ``McpTool`` for the handler's (and *prepare*'s) contract.

        *retry* (a ``Retry``, its fields as a dict, or a number of attempts),
        *priority* and *delay* (seconds) are given to every task a call of
        the tool creates, in both eras and on every transport.

        Raises:
            InvalidParams: *task_support* is not forbidden, optional or
                required; a bad retry policy, priority or delay (named).
        """
        if task_support not in TASK_SUPPORT:
            raise InvalidParams(f"task_support must be one of {', '.join(TASK_SUPPORT)}",
                                param="task_support")
        _check_int(priority, "priority", minimum=-2**31, allow_none=False, maximum=2**31 - 1)
        if delay is not None:
            _number(delay, "delay", 0, 1e9)
        tool = McpTool(name, handler, description,
                       input_schema if input_schema is not None else {"type": "object"},
                       task_support, prepare, _retry_param(retry), priority, delay)
        self.tools[name] = tool
        return tool

    def list(self, request):
        """tools/list, in the request's era (2026-07-28 adds its cache hints)."""
        result = {"tools": [t.to_wire(request.era) for t in self.tools.values()]}
        if request.era == _MODERN:
            result.update(ttlMs=0, cacheScope="private")
        return result

    def plan(self, request):
        """Decide how a tools/call runs: return ``(tool, arguments, task)``.

        *task* is None for a call run inline, else ``(ttl, legacy)``: the ttl
        asked for (``_UNSET`` when none) and whether the answer carries the
        lesson's ``_meta.task`` mirror.

        Raises:
            InvalidParams: an unknown tool, or arguments that break its schema.
            MethodNotFound: 2025-11-25, a call that breaks the tool's taskSupport.
            MissingClientCapability: 2026-07-28, a task-only tool without the extension.
        """
        params = request.params
        name = params.get("name")
        tool = self.tools.get(name) if isinstance(name, str) else None
        if tool is None:
            raise InvalidParams(f"Unknown tool: {_echo(name)}", param="name")
        arguments = params.get("arguments")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise InvalidParams("arguments must be an object", param="arguments")
        if request.era == _MODERN:
            # The extension lets the server decide, so params.task is never read: a
            # client declaring the extension gets a task for every tool that is not
            # "forbidden".
            declared = _declares_tasks(request.capabilities)
            if not declared and tool.task_support == "required":
                raise MissingClientCapability(f"Tool {tool.name} runs only as a task: "
                                              f"declare the {TASKS_EXTENSION} extension")
            check_arguments(tool, arguments)
            inline = not declared or tool.task_support == "forbidden"
            return tool, arguments, None if inline else (_UNSET, False)
        task = _task_request(params)
        if task is not None and task[2] and tool.task_support == "forbidden":
            task = None                     # the lesson's "the server decides": inline
        # taskSupport violations are -32601 (the specification's word), never a tool
        # result: the model must not read them as the tool's answer.
        if task is not None and tool.task_support == "forbidden":
            raise MethodNotFound(f"Tool {tool.name} does not support task-augmented execution")
        if task is None and tool.task_support == "required":
            raise MethodNotFound(f"Tool {tool.name} requires task-augmented execution")
        check_arguments(tool, arguments)
        return tool, arguments, None if task is None else task[:2]

    def call(self, request):
        """tools/call: the tool's CallToolResult inline, or the created task.

        In 2026-07-28 a call whose tool (or its ``prepare``) asks for what
        the request did not bring answers an ``InputRequiredResult``
        instead (``McpInputRounds``); before a task is created, never after.
        """
        tool, arguments, task = self.plan(request)
        meta = request.params.get("_meta")
        meta = meta if isinstance(meta, dict) else {}
        token = meta.get("progressToken")
        answers = self._mcp.rounds.answers(request, tool, arguments) \
            if request.era == _MODERN else None
        ctx = ToolContext(self._mcp, progress_token=token, era=request.era,
                          capabilities=request.capabilities, answers=answers,
                          log_level=meta.get(META_LOG_LEVEL))
        with self.cancellable(request.id, ctx.cancelled):
            try:
                if tool.prepare is not None:
                    ctx.prepared, broken = self._prepare(tool, ctx, arguments)
                    if broken is not None:
                        return broken
                if task is None:
                    result = self._invoke(tool, ctx, arguments)
            except Cancelled:
                return _NO_RESPONSE
            except InputRequired as exc:
                return self._mcp.rounds.input_required(request, tool, arguments, ctx, exc)
        if task is None:                    # MCP: a request the client cancelled gets no answer
            return _NO_RESPONSE if ctx.is_cancelled() else result
        mcp = self._mcp
        ttl, legacy = task
        meta = {"session": mcp._session, "progressToken": token, "legacy": legacy,
                "era": request.era}
        if request.era == _MODERN:          # polled: no progress notifications
            meta.update(progressToken=None, capabilities=request.capabilities)
        payload = {"name": tool.name, "arguments": arguments}
        if tool.prepare is not None:
            payload["prepared"] = ctx.prepared
        created = mcp.store.create(MCP_TASK_KIND, payload,
                                   ttl_ms=self._grant_ttl(ttl), meta=meta, owner=mcp.owner,
                                   principal=mcp.principal, retry=tool.retry,
                                   priority=tool.priority, delay=tool.delay)
        # Committed: a tasks/get for this id resolves from now on.
        if request.era == _MODERN:
            return mcp_task_to_modern_wire(created, mcp.poll_interval_ms, created=True)
        mcp.notices.follow(created.id)      # another process may run it: follow its events
        return _create_task_result(created, mcp.poll_interval_ms, legacy)

    def _grant_ttl(self, requested):
        """Return the ttl granted: the default when absent, capped, null only if allowed.

        The specification lets the receiver override a requested ttl; a cap
        keeps one client from pinning rows in the file forever.
        """
        mcp = self._mcp
        cap = mcp.max_ttl_ms

        def capped(ttl):
            return ttl if cap is None or ttl is None else min(ttl, cap)
        if requested is _UNSET:
            return capped(mcp.default_ttl_ms)
        if requested is None:
            return None if mcp.allow_unlimited_ttl else capped(cap or mcp.default_ttl_ms)
        if isinstance(requested, bool) or not isinstance(requested, (int, float)) \
                or (isinstance(requested, float) and not math.isfinite(requested)):
            raise InvalidParams("task.ttl must be a number of milliseconds or null", param="ttl")
        if requested < 1:
            # 0 would expire the task before the client could read it: refused, not rounded up.
            raise InvalidParams(f"task.ttl must be at least 1 millisecond, not {requested!r}",
                                param="ttl")
        granted = capped(int(requested))
        if granted > MAX_SAFE_INTEGER:      # a huge int fits neither JSON clients nor SQLite
            raise InvalidParams(f"task.ttl must be at most {MAX_SAFE_INTEGER}", param="ttl")
        return granted

    @contextlib.contextmanager
    def cancellable(self, request_id, cancelled):
        """While inside, ``cancel_inline(request_id)`` sets the event *cancelled*.

        For the requests that run until the client lets go of them: an
        inline tool call, a subscriptions/listen.
        """
        with self._lock:
            self._inline[request_id] = cancelled
        try:
            yield cancelled
        finally:
            with self._lock:
                self._inline.pop(request_id, None)

    def cancel_inline(self, request_id=_UNSET):
        """Cancel the inline call of client request *request_id* (all of them when not given)."""
        with self._lock:
            if request_id is _UNSET:
                calls = list(self._inline.values())
            else:
                calls = [self._inline[request_id]] if request_id in self._inline else []
        for cancelled in calls:
            cancelled.set()

    @staticmethod
    def _invoke(tool, ctx, arguments):
        try:
            value = tool.handler(ctx, arguments)
        except (TaskStoreError, Cancelled, InputRequired):
            raise
        except Exception:
            logger.exception("tool %s failed", tool.name)
            return text_result(f"Tool {tool.name} failed with an internal error", is_error=True)
        return _as_call_tool_result(value)

    @staticmethod
    def _prepare(tool, ctx, arguments):
        """Run the tool's ``prepare``: ``(prepared, None)``, or ``(None, the isError answer)``."""
        try:
            return tool.prepare(ctx, arguments), None
        except (TaskStoreError, Cancelled, InputRequired):
            raise
        except Exception:
            logger.exception("tool %s failed to prepare", tool.name)
            return None, text_result(f"Tool {tool.name} failed with an internal error",
                                     is_error=True)

    def run_task(self, task_ctx, payload):
        """Runner handler for kind ``mcp.tools/call``: run the tool, map its outcome."""
        tool = self.tools.get(payload.get("name"))
        if tool is None:        # e.g. a task queued by a server with other tools
            raise TaskFailed({"code": -32602, "message": f"Unknown tool: {payload.get('name')}"},
                             retry=False)
        ctx = ToolContext(self._mcp, task_ctx=task_ctx)    # progress goes out via on_change
        try:
            result = self._invoke(tool, ctx, payload.get("arguments") or {})
        except TaskStoreError as exc:
            # A JSON-RPC error: stored as such so that tasks/result replays it.  The
            # tool's deliberate answer, not a failure a retry could mend.
            raise TaskFailed(to_jsonrpc_error(exc), retry=False) from None
        if result.get("isError"):
            texts = [c.get("text") for c in result.get("content", ()) if c.get("type") == "text"]
            error = {"code": "tool_error", "message": texts[0] if texts else "tool error"}
            raise TaskFailed(error, result=result)
        return result


class McpInputRounds:
    """2026-07-28 multi-round tool calls (MRTR): ``InputRequiredResult`` and its retry.

    A ``tools/call`` whose tool asks for what the request did not bring is
    answered with ``{"resultType": "input_required", "inputRequests":
    {key: {method, params}}, "requestState": ...}``; the client asks its
    user (or model, or roots), then sends the same call again with
    ``inputResponses`` (key -> its answer) and that ``requestState``, and
    the tool runs again with the answers (``ToolContext``).  Nothing is
    kept between the rounds but what the client carries: the answers of
    earlier rounds travel in the ``requestState``, signed (HMAC-SHA256)
    with the store's secret ``mcp.request_state`` (``TaskStore.secret``),
    so that any replica on the same database verifies what another one
    issued, and a state altered, expired (``MCP_REQUEST_STATE_TTL_MS``) or
    issued for another call (tool, arguments, principal) is refused with
    -32602.  Extra ``inputResponses`` keys are ignored; a missing one is
    asked again.
    """

    def __init__(self, mcp):
        self._mcp = mcp     # the dispatcher: store, principal

    def answers(self, request, tool, arguments):
        """The answers a call brings: its ``inputResponses`` over its verified ``requestState``.

        Raises:
            InvalidParams: ``inputResponses`` not an object of objects, or a
                ``requestState`` that fails its check.
        """
        params = request.params
        responses = params.get("inputResponses", {})
        if not isinstance(responses, dict) or \
                not all(isinstance(value, dict) for value in responses.values()):
            raise InvalidParams("inputResponses must be an object mapping each key to the "
                                "client's result", param="inputResponses")
        token = params.get("requestState")
        if token is None:
            return dict(responses)
        if not isinstance(token, str):
            raise InvalidParams("requestState must be a string", param="requestState")
        state = self._open(token)
        if state.get("call") != self._call(tool, arguments):
            raise InvalidParams("requestState was issued for another call", param="requestState")
        if state.get("exp", 0) < self._now():
            raise InvalidParams("requestState has expired: call the tool again without it",
                                param="requestState")
        return {**responses, **state.get("answers", {})}

    def input_required(self, request, tool, arguments, ctx, exc):
        """The ``InputRequiredResult`` for a run that ended asking *exc*'s questions."""
        state = {"call": self._call(tool, arguments),
                 "exp": self._now() + MCP_REQUEST_STATE_TTL_MS, "answers": ctx.used}
        return {"resultType": "input_required",
                "inputRequests": {key: _input_request_wire(question)
                                  for key, question in exc.requests.items()},
                "requestState": self._seal(state)}

    def _call(self, tool, arguments):
        """What a state is bound to: the tool, its arguments and the caller (a digest)."""
        return hashlib.sha256(json.dumps([tool.name, arguments, self._mcp.principal],
                                         sort_keys=True).encode()).hexdigest()

    def _now(self):
        return int(self._mcp.store.clock() * 1000)

    def _mac(self, body):
        key = bytes.fromhex(self._mcp.store.secret(_REQUEST_STATE_SECRET))
        return hmac.new(key, b"mcp.request_state\0" + body, hashlib.sha256).digest()

    def _seal(self, state):
        body = dumps(state).encode()
        return ".".join(base64.urlsafe_b64encode(part).decode().rstrip("=")
                        for part in (body, self._mac(body)))

    def _open(self, token):
        """The state *token* carries, if this store signed it (else InvalidParams)."""
        try:
            body, mac = (base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
                         for part in token.split("."))
            if hmac.compare_digest(mac, self._mac(body)):
                state = json.loads(body)
                if isinstance(state, dict) and isinstance(state.get("answers"), dict):
                    return state
        except ValueError:                  # not two Base64 parts (binascii.Error is one)
            pass
        raise InvalidParams("requestState failed its integrity check: it was altered, or "
                            "another server issued it", param="requestState")


class McpClientRequests:
    """The requests this server sends its client (2025-11-25: elicitation, sampling, roots).

    Each request waits in ``_pending`` under its id until its answer arrives
    (through ``McpDispatcher.receive``, which hands it to ``answer``) or its
    task ends (``forget_task``).  The ids are "srv-1", "srv-2", ...: a space
    of their own, so that a server request's id never equals one of the
    client's ids, neither in a log nor in a client's matching of answers.
    """

    def __init__(self, mcp):
        self._mcp = mcp                     # the dispatcher: send, closing
        self._lock = threading.Lock()
        self._pending = {}                  # our request id -> (task id or None, callback)
        self._sent = 0

    def send(self, method, params, callback, task_id=None):
        """Send a request; ``callback(response)`` will get its answer.  Return its id.

        *task_id* names the task the request is for, so that it is forgotten
        when the task ends.
        """
        with self._lock:
            self._sent += 1
            request_id = f"srv-{self._sent}"
            self._pending[request_id] = (task_id, callback)
        self._mcp.send({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})
        return request_id

    def ask(self, requests, cancelled):
        """Send *requests* (key -> ``{method, params}``) at once; block until all are answered.

        Returns key -> the client's response (with its ``result`` or
        ``error``).  Runs on the thread of the work that asks (an inline
        tool call).

        Raises:
            Cancelled: *cancelled* was set, or the connection ends, before the answers.
        """
        answers = queue.Queue()
        sent = [self.send(request["method"], request["params"],
                          functools.partial(lambda key, response: answers.put((key, response)),
                                            key))
                for key, request in requests.items()]
        got = {}
        while len(got) < len(sent):
            try:
                key, response = answers.get(timeout=0.1)
                got[key] = response
            except queue.Empty:
                if cancelled.is_set() or self._mcp.closing.is_set():
                    with self._lock:
                        for request_id in sent:
                            self._pending.pop(request_id, None)
                    raise Cancelled() from None
        return got

    def answer(self, response):
        """Return the work that hands *response* to its request's callback ([] if none waits)."""
        with self._lock:
            entry = self._pending.pop(response["id"], None)
        if entry is None:
            self._not_awaited(response["id"])
            return []
        callback = entry[1]

        def run():                          # it may write to the store: work
            callback(response)
            return []
        return [McpWork("answer", None, run)]

    def forget_task(self, task_id):
        """Drop the requests for *task_id*: a finished task's question can never be used."""
        with self._lock:
            for request_id in [k for k, v in self._pending.items() if v[0] == task_id]:
                del self._pending[request_id]

    def _not_awaited(self, msg_id):
        """Log a response that no request of ours waits for: a late answer, or a mistake."""
        number = msg_id[4:] if isinstance(msg_id, str) and msg_id.startswith("srv-") else ""
        if number.isdigit() and number[0] != "0" and int(number) <= self._sent:
            # Ours, no longer awaited: answered already, or its task ended first.
            logger.info("dropped an answer to request %r: it was answered already or its "
                        "task ended", msg_id)
        else:
            logger.warning("dropped an answer to id %r: this server sent no request with that "
                           "id (its requests have string ids \"srv-1\", \"srv-2\", ...)", msg_id)


class McpTaskNotices:
    """Tell the client about its 2025-11-25 tasks: status, progress and input requests.

    Status notifications follow each task's event log, told once and in
    order whether this process moved the task (``on_change``, the store
    listener) or another one did (``moved``, from whoever follows
    ``followed()``).  A 2026-07-28 task is polled, or followed through
    ``listen`` (``subscriptions/listen``), the only way anything about it is pushed.
    """

    def __init__(self, mcp):
        self._mcp = mcp             # the dispatcher: store, send, session, requests
        # Set whenever a task joins those followed, so that whoever follows
        # them stops sleeping.
        self.follow_wake = threading.Event()
        self._notify_lock = threading.Lock()    # one teller at a time; taken before _lock
        self._lock = threading.Lock()           # guards the dicts and set below; never held long
        self._sent = {}             # task id -> (version, MCP status, progress) notified
        self._told = {}             # task id -> (last event seq handled, MCP status told)
        self._followed = set()      # this session's tasks not yet told terminal

    def follow(self, task_id):
        """Follow a task this session created, wherever it runs."""
        with self._lock:
            self._followed.add(task_id)
        self.follow_wake.set()

    def on_change(self, task, change):
        """Store listener: tell this session's client about its tasks (through ``send``)."""
        mcp = self._mcp
        if task.kind != MCP_TASK_KIND or task.meta.get("session") != mcp._session:
            return
        if task.meta.get("era", _LEGACY) != _LEGACY:
            # A 2026-07-28 task is polled; nothing about it is pushed (no status
            # notifications, no progress, never a request): that era's clients
            # have no channel for server-initiated messages.
            return
        status = mcp_status(task)
        token = task.meta.get("progressToken")
        with self._notify_lock:
            with self._lock:
                version, sent, progress = self._sent.get(task.id, (0, "working", None))
                # Listeners of two writers may run out of order: only newer news counts.
                fresh = task.version > version
                # MCP: progress must increase, and it stops at the terminal status
                # (which the follower may have told already).
                new_progress = (change == "progress" and token is not None
                                and task.progress is not None and status not in _MCP_TERMINAL
                                and self._told.get(task.id, (0, ""))[1] not in _MCP_TERMINAL
                                and (progress is None or task.progress > progress))
                if fresh:
                    self._sent[task.id] = (task.version, status,
                                           task.progress if new_progress else progress)
            if status in _MCP_TERMINAL:     # a pending input request can never be used
                mcp.requests.forget_task(task.id)
            if not fresh:
                return
            self._tell_status(task)
            if change == "status" and task.status == INPUT_REQUIRED and task.input_request:
                self._send_input_request(task)
            if new_progress:
                self.progress(token, task.progress, task.progress_total,
                              task.status_message, task.id)

    def _tell_status(self, task):
        """Send ``notifications/tasks/status`` for each MCP status change of *task* not told yet.

        *task* is the task as read after a commit.  The changes are its
        ``status`` events past the last one handled: one new event is *task*
        itself; several (another process moved the task, or a listener ran
        late) are read from its event log and told in order, the last one as
        *task*, the others as their event says.  Once a terminal status is
        told nothing more is.  The caller holds ``_notify_lock``.
        """
        seq, told = self._told.get(task.id, (0, "working"))
        if task.last_seq <= seq:
            return
        steps = [task]
        if task.last_seq > seq + 1 and told not in _MCP_TERMINAL:
            try:
                events = self._mcp.store.events(task.id, after=seq)
            except TaskStoreError:          # pruned or purged meanwhile: the task says it all
                events = ()
            changes = [e for e in events if e.type == "status" and e.seq <= task.last_seq]
            steps = [task._replace(status=e.data["status"], updated_at=e.created_at,
                                   status_message=e.data.get("message"),
                                   error=e.data.get("error"))
                     for e in changes[:-1]] + [task]
        for step in steps:
            status = mcp_status(step)
            if status != told and told not in _MCP_TERMINAL:
                told = status
                self.notify("notifications/tasks/status",
                             mcp_task_to_wire(step, self._mcp.poll_interval_ms))
        with self._lock:
            self._told[task.id] = (task.last_seq, told)
            if told in _MCP_TERMINAL:
                self._followed.discard(task.id)

    def followed(self):
        """Return ``{task id: last event seq told}`` for this session's unfinished tasks.

        The store listener (``on_change``) sees this process's commits only;
        whoever follows these tasks (the transport's follower thread) waits on
        the store for events past those seqs and hands what moved to ``moved``.
        ``follow_wake`` is set when a task joins them.
        """
        with self._lock:
            return {task_id: self._told.get(task_id, (0, ""))[0]
                    for task_id in self._followed}

    def moved(self, tasks):
        """Tell the client about its tasks that another process moved.

        *tasks* maps task id -> the task as read now (None: purged), as
        ``TaskStore.wait_any`` returns it; the news goes out through
        ``_tell_status`` as the listener's does, so nothing is told twice.
        """
        for task_id, task in tasks.items():
            if task is None:                # purged: nothing more will happen to it
                with self._lock:
                    self._followed.discard(task_id)
                continue
            with self._notify_lock:
                self._tell_status(task)

    def _send_input_request(self, task):
        """Send the task's question(s) to the client, each a request of ours."""
        parts = task.input_request.get("parts")
        if isinstance(parts, dict):         # several at once: each answer is one part's
            for key, request in parts.items():
                self._send_question(task, request, key)
        else:
            self._send_question(task, task.input_request, None)

    def _send_question(self, task, request, key):
        params = dict(request.get("params") or {})
        params["_meta"] = {**(params.get("_meta") or {}), RELATED_TASK: {"taskId": task.id}}
        store = self._mcp.store

        def answered(response):
            answer = ({"error": response["error"]} if "error" in response
                      else {"result": response.get("result")})
            try:
                store.provide_input(task.id, answer if key is None else {"parts": {key: answer}})
            except TaskStoreError as exc:   # cancelled meanwhile: the answer is moot
                logger.debug("input for %s dropped: %s", task.id, exc)

        self._mcp.requests.send(request["method"], params, answered, task_id=task.id)

    def listen(self, request):
        """2026-07-28 ``subscriptions/listen``: notifications/tasks for the task ids it accepts.

        Acknowledges first (``notifications/subscriptions/acknowledged``,
        naming the ids accepted: the caller's MCP tasks; an unknown or
        another principal's id is left out, never named), then sends each
        accepted task's DetailedTask (``notifications/tasks``) whenever its
        events move, until it is cancelled or the connection ends; the
        answer comes only then.  It waits on the store's events
        (``TaskStore.wait_any``), so a change made by another process or
        replica is told as one made here.  Progress and log messages never
        go on it (the extension forbids them there).

        Raises:
            InvalidParams: a filter that is not an object, or ids not strings.
            MissingClientCapability: task ids without the tasks extension (-32021).
        """
        mcp = self._mcp
        filters = request.params.get("notifications", {})
        task_ids = filters.get("taskIds", []) if isinstance(filters, dict) else None
        if not isinstance(task_ids, list) or not all(isinstance(t, str) for t in task_ids):
            raise InvalidParams("notifications.taskIds must be an array of task ids",
                                param="notifications")
        if task_ids and not _declares_tasks(request.capabilities):
            raise MissingClientCapability()
        watched = {}                        # task id -> last event seq told
        for task_id in dict.fromkeys(task_ids):
            with contextlib.suppress(TaskStoreError):
                watched[task_id] = mcp.tasks.task({"taskId": task_id}).last_seq
        tag = {"io.modelcontextprotocol/subscriptionId": request.id}
        self.notify("notifications/subscriptions/acknowledged",
                     {"notifications": {"taskIds": list(watched)}, "_meta": tag})
        with mcp.calls.cancellable(request.id, threading.Event()) as cancelled:
            while not (cancelled.is_set() or mcp.closing.is_set()):
                if not watched:             # nothing more can happen: wait for the end
                    cancelled.wait(_LISTEN_WAKE_S)
                    continue
                for task_id, task in mcp.store.wait_any(watched, timeout=_LISTEN_WAKE_S).items():
                    if task is None:        # purged: nothing more will happen to it
                        del watched[task_id]
                        continue
                    watched[task_id] = task.last_seq
                    wire = mcp_task_to_modern_wire(task, mcp.poll_interval_ms)
                    del wire["resultType"]          # a notification, not a result
                    self.notify("notifications/tasks", {**wire, "_meta": tag})
                    if wire["status"] in _MCP_TERMINAL:
                        del watched[task_id]
        return {"_meta": tag}

    def progress(self, token, value, total, message, task_id):
        """Send ``notifications/progress`` for *token* (of task *task_id*, or an inline call)."""
        params = {"progressToken": token, "progress": value}
        if total is not None:
            params["total"] = total
        if message:
            params["message"] = message
        if task_id is not None:
            params["_meta"] = {RELATED_TASK: {"taskId": task_id}}
        self.notify("notifications/progress", params)

    def notify(self, method, params):
        """Send the client a notification (``ToolContext.log`` sends its messages here)."""
        self._mcp.send({"jsonrpc": "2.0", "method": method, "params": params})


class McpDispatcher:
    """The MCP protocol over a TaskStore, for both eras of MCP tasks, without I/O.

    ``receive(message)`` takes one decoded JSON-RPC message and returns what
    to do: the messages to send at once (dicts) and ``McpWork`` for the
    transport to run.  Messages that arise later on their own (progress and
    status notifications, our elicitation requests "srv-N") go to ``send``,
    a callable the transport supplies; by default they collect in
    ``outbox``.  Nothing here reads or writes a stream or starts a thread;
    what blocks (``McpWork.run``, ``handle_request`` of a waiting method,
    a tool asking its user) blocks the caller's thread only.

    ``methods`` holds each era's method table: method -> (handler, where it
    runs).  The first request picks the era for the whole connection
    (``era``, see ``McpEras``): ``initialize`` -> 2025-11-25 (core tasks: a
    task-augmented ``tools/call``); a request whose ``params._meta`` names
    ``io.modelcontextprotocol/protocolVersion`` -> 2026-07-28 (the
    ``io.modelcontextprotocol/tasks`` extension: the server makes a task of
    every non-forbidden tool call of a client that declares it).  Either way
    a task is a store task (kind ``mcp.tools/call``); a Runner given
    ``run_task`` as that kind's handler runs it, and ``owner`` is that
    Runner's ``process_id``.  The work is shared among parts, each with one
    job: ``eras`` (McpEras), ``tasks`` (McpTaskMethods), ``calls``
    (McpToolCalls), ``rounds`` (McpInputRounds), ``requests``
    (McpClientRequests) and ``notices`` (McpTaskNotices).

    Example (no pipes, no threads)::

        dispatcher = McpDispatcher(store)
        add_demo_tools(dispatcher)
        dispatcher.receive({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        # -> [{"jsonrpc": "2.0", "id": 1, "result": {"tools": [...]}}]
        [work] = dispatcher.receive({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                                     "params": {"name": "echo", "arguments": {"text": "hi"}}})
        work.run()      # blocks while the tool runs (McpWork "wait")
        # -> [{"jsonrpc": "2.0", "id": 2, "result": {"content": [...], "isError": false}}]
    """

    def __init__(self, store, *, default_ttl_ms=DEFAULT_MCP_TTL_MS, max_ttl_ms=None,
                 allow_unlimited_ttl=False, poll_interval_ms=DEFAULT_MCP_POLL_INTERVAL_MS,
                 list_tasks=True, page_size=DEFAULT_MCP_PAGE_SIZE, name="taskstore",
                 version=__version__, send=None, principal=None, tools=None):
        self.store = store
        # Whose tasks this connection reaches: None on stdio (the file is the
        # boundary), the bearer token's principal over HTTP.
        self.principal = principal
        self.default_ttl_ms = default_ttl_ms
        self.max_ttl_ms = max_ttl_ms if max_ttl_ms is not None else store.max_ttl_ms
        self.allow_unlimited_ttl = allow_unlimited_ttl
        self.poll_interval_ms = poll_interval_ms
        self.list_tasks = list_tasks
        self.page_size = page_size
        self.server_info = {"name": name, "version": version}
        self.outbox = []
        self.send = send if send is not None else self.outbox.append
        self.owner = None                   # the Runner's process_id, recorded on each task
        # Set when the connection ends: waits (tasks/result, a tool's question)
        # give up, and the transport stops sending anything but answers.
        self.closing = threading.Event()
        # Tasks created here carry this id in their meta, so that only this
        # connection's client hears their notifications and input requests.
        self._session = secrets.token_hex(8)
        self.eras = McpEras(self)
        self.tasks = McpTaskMethods(self)
        self.calls = McpToolCalls(self)
        self.rounds = McpInputRounds(self)
        self.requests = McpClientRequests(self)
        self.notices = McpTaskNotices(self)
        if tools is not None:               # another front's registry, shared: one set of tools
            self.calls.tools = tools
        # The method tables: the only place that says what answers a method and
        # where it runs.  A method an era's table lacks is -32601.
        self.methods = {
            #   method              handler                       where it runs
            _LEGACY: {
                "initialize":      (self.eras.initialize,         _READER),
                "ping":            (self.eras.ping,               _READER),
                "logging/setLevel": (self.eras.set_log_level,     _READER),
                "tools/list":      (self.calls.list,              _READER),
                "tools/call":      (self.calls.call,              self._call_runs),
                "tasks/get":       (self.tasks.get,               _READER),
                "tasks/status":    (self.tasks.status,            _READER),
                "tasks/result":    (self.tasks.result,            self._result_runs),
                "tasks/cancel":    (self.tasks.cancel,            _WRITING),
                "tasks/list":      (self.tasks.list,              _READER),
            },
            _MODERN: {      # no initialize, ping, tasks/result, tasks/status, tasks/list
                "server/discover": (self.eras.discover,           _READER),
                "tools/list":      (self.calls.list,              _READER),
                "tools/call":      (self.calls.call,              self._call_runs),
                "tasks/get":       (self.tasks.get_modern,        _READER),
                "tasks/update":    (self.tasks.update,            _WRITING),
                "tasks/cancel":    (self.tasks.cancel_modern,     _WRITING),
                "subscriptions/listen": (self.notices.listen,     _WAITING),
            },
        }
        if not list_tasks:
            del self.methods[_LEGACY]["tasks/list"]

    # Where a method's place depends on its params: decided by the same call
    # its handler makes, so that the table and the handler never disagree.

    def _call_runs(self, request):
        """tools/call: inline it waits for its tool; creating a task writes.

        A 2025-11-25 tool with a ``prepare`` waits as an inline call does: it
        may ask its user before the task exists.
        """
        try:
            tool, _, task = self.calls.plan(request)
        except TaskStoreError:
            return _READER                  # refused: its error at once
        if task is None or (tool.prepare is not None and request.era == _LEGACY):
            return _WAITING
        return _WRITING

    def _result_runs(self, request):
        """tasks/result: it waits while its task is unfinished; then it is a read."""
        try:
            finished = self.tasks.finished(request)
        except TaskStoreError:
            return _READER                  # its error at once
        return _READER if finished else _WAITING

    # -- the parts' state, as this class has always shown it --------------------

    era = property(lambda self: self.eras.era, doc="The connection's era (None until chosen).")
    client_capabilities = property(lambda self: self.eras.client_capabilities,
                                   doc="2025-11-25: the capabilities initialize declared.")
    tools = property(lambda self: self.calls.tools, doc="Tool name -> McpTool.")
    follow_wake = property(lambda self: self.notices.follow_wake,
                           doc="Set whenever a task joins those ``followed()`` returns.")

    def add_tool(self, name, handler, **options):
        """Register a tool (``McpToolCalls.add_tool``); see ``McpTool`` for its contract."""
        return self.calls.add_tool(name, handler, **options)

    def tool(self, name=None, **options):
        """Decorator form of ``add_tool``; the name defaults to the function's."""
        def register(handler):
            self.add_tool(name or handler.__name__, handler,
                          description=options.pop("description", handler.__doc__ or ""),
                          **options)
            return handler
        return register

    def run_task(self, task_ctx, payload):
        """Runner handler for kind ``mcp.tools/call`` (``McpToolCalls.run_task``)."""
        return self.calls.run_task(task_ctx, payload)

    def on_change(self, task, change):
        """Store listener: tell this session's client about its tasks (``McpTaskNotices``)."""
        self.notices.on_change(task, change)

    def followed(self):
        """Return ``{task id: last event seq told}`` (``McpTaskNotices.followed``)."""
        return self.notices.followed()

    def moved(self, tasks):
        """Tell the client about its tasks another process moved (``McpTaskNotices.moved``)."""
        self.notices.moved(tasks)

    # -- messages in, messages out ---------------------------------------------

    def receive_line(self, line):
        """Decode one line (bytes, without caring for its newline) and ``receive`` it.

        A line that is not JSON gets -32700, one that JSON cannot carry
        safely (too deep, an unpaired surrogate) -32600, both with id null:
        the id itself may be unusable.
        """
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):    # bad UTF-8; RecursionError: a nesting bomb
            return [_error_message(None, ParseError("parse error: not JSON"))]
        problem = _json_problem(message, text=line)
        if problem is not None:
            return [_error_message(None, InvalidRequest(f"the message {problem}"))]
        return self.receive(message)

    def too_long(self, limit):
        """Return the answer to a line longer than *limit* bytes (dropped unread)."""
        return [_error_message(None, InvalidRequest(f"message exceeds {limit} bytes"))]

    def receive(self, message):
        """Take one decoded message; return the messages to send now and the work to run.

        Each item is a JSON-RPC message (a dict, to send as it is) or an
        ``McpWork``.  A request is placed as its era's method table says: on
        the reader it is answered here and now, in arrival order; otherwise it
        comes back as work for the pool named.  A notification returns
        nothing; a response to one of our requests returns the work that
        hands it to whoever waits for it.
        """
        try:
            kind = _message_kind(message)
        except InvalidRequest as exc:
            msg_id = message.get("id") if isinstance(message, dict) else None
            valid_id = isinstance(msg_id, (str, int)) and not isinstance(msg_id, bool)
            return [_error_message(msg_id if valid_id else None, exc)]
        if kind == "response":
            return self.requests.answer(message)
        if kind == "notification":
            self._notification(message)
            return []
        # The era and the place are decided here, in arrival order, not on the work's thread.
        try:
            request, handler, where = self._route(message)
            if callable(where):
                where = where(request)
        except Exception as exc:
            return [self._error(message["id"], message["method"], exc)]
        if where == _READER:
            return self._answer(request, handler)
        return [McpWork(where, request.id, lambda: self._answer(request, handler))]

    def handle_request(self, message, era=_UNSET):
        """Answer one decoded JSON-RPC request here and now; return the response (None: none).

        Blocks while the method does (``tasks/result``, inline tool calls),
        wherever its table says it runs.  *era* is what the era choice said
        for this message (made here when not given).
        """
        try:
            request, handler, _ = self._route(message, era)
        except Exception as exc:
            return self._error(message.get("id"), message.get("method"), exc)
        answer = self._answer(request, handler)
        return answer[0] if answer else None

    def _route(self, message, era=_UNSET):
        """Return ``(request, handler, where it runs)`` for a request; raise what refuses it."""
        if era is _UNSET:
            era = self.eras.select(message)
        if isinstance(era, Exception):
            raise era
        request, (handler, where) = self.eras.open(message, era, self.methods[era])
        return request, handler, where

    def _answer(self, request, handler):
        """Run *handler* for *request*; return ``[response]``, or ``[]`` when it gets none."""
        try:
            result = self.eras.finish(request, handler(request))
        except _StoredError as exc:
            return [{"jsonrpc": "2.0", "id": request.id, "error": exc.error}]
        except Exception as exc:
            return [self._error(request.id, request.method, exc)]
        if result is _NO_RESPONSE:
            return []
        return [{"jsonrpc": "2.0", "id": request.id, "result": result}]

    @staticmethod
    def _error(msg_id, method, exc):
        if not isinstance(exc, TaskStoreError):
            logger.exception("internal error in %s", method)
        return _error_message(msg_id, exc)

    def _notification(self, message):
        params = message.get("params") if isinstance(message.get("params"), dict) else {}
        if message["method"] == "notifications/cancelled":
            # Only inline calls: MCP forbids notifications/cancelled for tasks.
            request_id = params.get("requestId")
            if isinstance(request_id, (str, int)):      # e.g. a list: unhashable
                self.calls.cancel_inline(request_id)
        # notifications/initialized and anything unknown need nothing.

    def close(self):
        """End the connection's waits: inline calls are cancelled, waits give up.

        Safe to call more than once; the transport calls it at EOF.
        """
        self.closing.set()
        self.calls.cancel_inline()
        self.notices.follow_wake.set()


class McpServer:
    """An MCP server on stdio: an McpDispatcher, its Runner, and the threads that move lines.

    Register tools with ``add_tool`` or the ``tool`` decorator, then call
    ``serve()``: it reads one JSON-RPC message per line from *infile* and
    writes one per line to *outfile* until EOF or ``stop()``.  What each
    message means and what answers it is ``dispatcher``'s business (see
    McpDispatcher, which also says how the era is chosen); this class only
    reads lines, runs the work the dispatcher describes on the bounded thread
    pool its method table names (``max_waiting``; past either pool's limit a
    request is refused at once with ServerBusy), follows this session's tasks
    in other processes, and writes.  Tasks are run by this server's Runner (*workers* threads; it
    renews this process's lease every *heartbeat_s* seconds).

    Example::

        store = TaskStore("my.db")
        server = McpServer(store)

        @server.tool(input_schema={"type": "object", "required": ["text"],
                                   "properties": {"text": {"type": "string"}}},
                     task_support="optional")
        def shout(ctx, args):
            return args["text"].upper()

        server.serve()          # stdin/stdout until EOF
        store.close()
    """

    def __init__(self, store, *, default_ttl_ms=DEFAULT_MCP_TTL_MS, max_ttl_ms=None,
                 allow_unlimited_ttl=False, poll_interval_ms=DEFAULT_MCP_POLL_INTERVAL_MS,
                 list_tasks=True, page_size=DEFAULT_MCP_PAGE_SIZE, workers=4,
                 max_line_bytes=DEFAULT_MAX_LINE_BYTES, name="taskstore", version=__version__,
                 shutdown_grace_s=SHUTDOWN_GRACE_S, max_waiting=DEFAULT_MCP_MAX_WAITING,
                 heartbeat_s=DEFAULT_HEARTBEAT_S):
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
            raise InvalidParams("max_waiting must be an integer >= 1", param="max_waiting")
        self.store = store
        self.dispatcher = McpDispatcher(
            store, default_ttl_ms=default_ttl_ms, max_ttl_ms=max_ttl_ms,
            allow_unlimited_ttl=allow_unlimited_ttl, poll_interval_ms=poll_interval_ms,
            list_tasks=list_tasks, page_size=page_size, name=name, version=version,
            send=self._send)
        self.max_line_bytes = max_line_bytes
        self.shutdown_grace_s = shutdown_grace_s
        self.max_waiting = max_waiting
        self.runner = Runner(store, {MCP_TASK_KIND: self.dispatcher.run_task}, workers=workers,
                             heartbeat_s=heartbeat_s)
        # The dispatcher's closing event is ours: EOF, a broken output or stop()
        # end the waits it runs for us as well as our loops.
        self._stop = self.dispatcher.closing
        self._stop_requested = False
        self._out = None
        self._write_lock = threading.Lock()
        self._waiting = _Pool(max_waiting, 0, "taskstore-mcp-waiting")
        self._writes = _Pool(MCP_WRITE_THREADS, MCP_WRITE_BACKLOG, "taskstore-mcp-write")

    # The protocol's state and tool registry live in the dispatcher; these
    # keep the server's older attributes and methods working.
    era = property(lambda self: self.dispatcher.era)
    tools = property(lambda self: self.dispatcher.tools)
    client_capabilities = property(lambda self: self.dispatcher.client_capabilities)

    def add_tool(self, name, handler, **options):
        """Register a tool (``McpDispatcher.add_tool``)."""
        return self.dispatcher.add_tool(name, handler, **options)

    def tool(self, name=None, **options):
        """Decorator form of ``add_tool`` (``McpDispatcher.tool``)."""
        return self.dispatcher.tool(name, **options)

    def handle_request(self, message, era=_UNSET):
        """Answer one decoded request here and now (``McpDispatcher.handle_request``)."""
        return self.dispatcher.handle_request(message, era)

    def serve(self, infile=None, outfile=None):
        """Serve one client on *infile*/*outfile* (binary; default stdin/stdout); once.

        Returns after EOF on *infile* or ``stop()``, once running work has
        been given ``shutdown_grace_s`` and the Runner has applied each
        unfinished task's restart policy (so no later process sees it working).
        """
        self._out = outfile if outfile is not None else sys.stdout.buffer
        if infile is None:
            # A raw stdin: the reader thread blocks in read() holding no lock, so
            # the interpreter can exit while it still waits (after SIGTERM).  Not
            # closed, for the same reason; closefd=False leaves fd 0 alone.
            infile = open(sys.stdin.fileno(), "rb", buffering=0, closefd=False)
        self.store.add_listener(self._on_change)
        self.runner.start()
        self.dispatcher.owner = self.runner.process_id
        reader = threading.Thread(target=self._read_loop, args=(infile,),
                                  name="taskstore-mcp-reader", daemon=True)
        reader.start()
        follower = threading.Thread(target=self._follow, name="taskstore-mcp-follower",
                                    daemon=True)
        follower.start()
        try:
            # A timed wait, so that stop()'s flag is seen promptly.
            while not self._stop.wait(0.1) and not self._stop_requested:
                pass
        finally:
            self.dispatcher.close()         # inline calls stop with the tasks
            # Runner.stop releases this runner's tasks: started ones and the
            # session's still-queued ones (created with owner=) get their
            # policy, so none shows as working with nobody to run it.
            self.runner.stop(timeout=self.shutdown_grace_s)
            deadline = time.monotonic() + 0.5
            for pool in (self._waiting, self._writes):
                pool.close(deadline)
            follower.join(max(0.0, deadline - time.monotonic()))
            self.store.remove_listener(self._on_change)
            with self._write_lock:
                self._out = None
            logger.info("mcp server stopped")

    def stop(self):
        """Ask ``serve()`` to return; safe from any thread and from a signal handler.

        It only sets a flag (a signal handler must not take a lock the main
        thread may hold); ``serve()`` notices it within 0.1 s.
        """
        self._stop_requested = True

    def _read_loop(self, infile):
        lines = _LineReader(infile, self.max_line_bytes)
        try:
            while not self._stop.is_set():
                line, too_long = lines.next()
                if line is None:
                    break
                if too_long:
                    self._deliver(self.dispatcher.too_long(self.max_line_bytes))
                elif line.strip():
                    self._deliver(self.dispatcher.receive_line(line))
        except Exception:                   # a broken stream must not go unnoticed
            logger.exception("mcp reader failed")
        finally:
            self._stop.set()

    def _deliver(self, items):
        """Send the dispatcher's messages; run its work on the pool its kind names.

        The kind is the place the dispatcher's method table gave the request:
        nothing here decides where a request runs.
        """
        for item in items:
            if not isinstance(item, McpWork):
                self._send(item)
            elif item.kind == "answer":     # rare, and must never be refused
                threading.Thread(target=self._run, args=(item,), daemon=True,
                                 name="taskstore-mcp-answer").start()
            else:
                pool = {_WAITING: self._waiting, _WRITING: self._writes}[item.kind]
                if not pool.submit(functools.partial(self._run, item)):
                    self._send(_error_message(item.msg_id, self._busy(pool)))

    def _busy(self, pool):
        if pool is self._waiting:
            return ServerBusy(f"too many requests are waiting: at most {pool.size} at "
                              "once (tasks/result for an unfinished task, tools/call "
                              "run inline); try again later")
        return ServerBusy(f"too many requests in progress: at most {pool.size} "
                          f"at once and {pool.backlog} in line; try again later")

    def _run(self, work):
        for message in work.run():
            self._send(message)

    def _on_change(self, task, change):
        if self._out is not None:           # only while serving: nobody to tell otherwise
            self.dispatcher.on_change(task, change)

    def _follow(self):
        """Tell the client about its tasks when another process moves them (a thread).

        Waits on the store for events past those told (``wait_any``: woken by
        this process's commits, re-reading every ``poll_interval`` for the
        others') and hands them to the dispatcher.  With no task to follow it
        sleeps until ``follow_wake``.
        """
        dispatcher = self.dispatcher
        while not self._stop.is_set():
            seen = dispatcher.followed()
            if not seen:
                dispatcher.follow_wake.wait()
                dispatcher.follow_wake.clear()
                continue
            try:
                moved = self.store.wait_any(seen, timeout=self.store.poll_interval)
            except StoreClosed:
                return
            except TaskStoreError as exc:   # a file that is locked or full: look again later
                logger.warning("cannot follow this session's tasks: %s", exc)
                self._stop.wait(self.store.poll_interval)
                continue
            dispatcher.moved(moved)

    def _send(self, message):
        """Write one message as one line; the only writer of the output stream."""
        if "method" in message and self._stop.is_set():
            # After EOF the client has gone (or is going): no more notifications
            # or requests of ours, only the answers still owed.
            return
        try:
            data = dumps(message).encode("utf-8") + b"\n"
        except (TypeError, ValueError):
            logger.exception("unserialisable message")
            if "id" not in message or "method" in message:
                return
            data = dumps(_error_message(message["id"], RuntimeError())).encode("utf-8") + b"\n"
        with self._write_lock:
            if self._out is None:
                return
            try:
                self._out.write(data)
                self._out.flush()
            except (OSError, ValueError):   # the client went away
                logger.info("mcp output closed")
                self._stop.set()


# -- demo tools (their contract is in the README; clients and tests rely on it) --

def _demo_sleep_then_echo(ctx, args):
    # Any number is valid input; a lock cannot wait longer than TIMEOUT_MAX (~292 years).
    if ctx.cancelled.wait(min(max(0.0, args["seconds"]), threading.TIMEOUT_MAX)):
        raise Cancelled()
    return args["text"]


def _demo_generate_report(ctx, args):
    seconds = max(0.0, args["seconds"])
    steps = max(1, math.ceil(seconds))      # one step per second at most
    for step in range(steps):
        ctx.progress(step, steps, f"step {step + 1}/{steps}")    # step i/n: working on it
        if ctx.cancelled.wait(seconds / steps):     # wakes at once on cancel
            raise Cancelled()
    ctx.progress(steps, steps, f"all {steps} steps done")
    return f"Report on {args['topic']!r}: {steps} sections written."


def _demo_fail_with_error(ctx, args):
    return text_result(args["message"], is_error=True)


def _demo_echo(ctx, args):
    return args["text"]


def _demo_ask_user(ctx, args):
    try:
        answer = ctx.elicit(args["question"], {
            "type": "object", "required": ["answer"],
            "properties": {"answer": {"type": "string", "title": args["question"]}}})
    except (McpError, MissingClientCapability) as exc:     # ElicitationMismatch too: its
        return text_result(str(exc), is_error=True)         # message says what did not match
    if answer.get("action") != "accept":
        return text_result(f"the user did not answer ({answer.get('action', 'no action')})",
                           is_error=True)
    return answer["content"]["answer"]


def _schema(**properties):
    return {"type": "object", "required": list(properties),
            "properties": {name: {"type": t} for name, t in properties.items()}}


def add_demo_tools(server):
    """Register the demo tools: sleep_then_echo, generate_report, fail_with_error, echo, ask_user."""
    server.add_tool("sleep_then_echo", _demo_sleep_then_echo, task_support="optional",
                    description="Wait `seconds`, then return `text`.",
                    input_schema=_schema(seconds="number", text="string"))
    server.add_tool("generate_report", _demo_generate_report, task_support="required",
                    description="Work for `seconds` on a report about `topic`, "
                                "reporting `step i/n` progress; stops at once on cancel.",
                    input_schema=_schema(topic="string", seconds="number"))
    server.add_tool("fail_with_error", _demo_fail_with_error, task_support="optional",
                    description="Return an isError result whose text is `message`.",
                    input_schema=_schema(message="string"))
    server.add_tool("echo", _demo_echo, task_support="forbidden",
                    description="Return `text` (never as a task).",
                    input_schema=_schema(text="string"))
    server.add_tool("ask_user", _demo_ask_user, task_support="optional",
                    description="Ask the user `question` through elicitation; return the answer.",
                    input_schema=_schema(question="string"))


# =============================================================================
# 10. LMSP HTTP server
# =============================================================================
# The LMSP 1.0 task routes under /lmsp/v1 (create, list, get, cancel and a
# resumable event stream; the README lists them) over the standard library's
# http.server.  Rules: this section never writes SQL and never decides a
# status; it validates, calls the store, and projects.  The task object, the
# response object and the event projection are each built by ONE function
# (task_object, response_object, lmsp_event).  Errors become problem objects
# only through to_problem(); LMSP-only failures are TaskStoreError subclasses.
# Task ids are checked with is_task_id() before the store is asked anything.
# Backends only stream text; ResponseOutput turns that text into the OpenAI
# Responses event shapes, so every backend streams the same events.

LMSP_VERSION = "1.0"
LMSP_PREFIX = "/lmsp/v1"
DEFAULT_HTTP_HOST = "127.0.0.1"
DEFAULT_HTTP_PORT = 8765
DEFAULT_MAX_BODY = 1024 * 1024
DEFAULT_RETENTION_S = 24 * 3600
DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEFAULT_MAX_STREAMS = 256
DEFAULT_MAX_CONNECTIONS = 512   # each is a thread and a file descriptor (1024 is a common limit)
DEFAULT_KEEPALIVE_S = 15.0
RETRY_AFTER_S = 1           # a 503's Retry-After: outages and full servers pass quickly
DEFAULT_DEMO_DELAY_S = 0.02
HTTP_SHUTDOWN_GRACE_S = 3.0  # at SIGTERM running backends get this long, then the policies apply
DEFAULT_BACKEND_URL = "http://127.0.0.1:11434/v1"   # Ollama's OpenAI-compatible API
_STREAM_WAKE_S = 0.5        # how soon an idle event stream notices a server shutdown
_EVENT_BATCH = 500          # events read from the store per query while streaming
_CHUNK_LINE_LIMIT = 4096    # a chunk-size line with its extensions, in a chunked request body
_MAX_TRAILERS = 100         # trailer lines after a chunked body (http.server's header limit)
# CORS for --allow-origin: what a page may send, and the headers it may read.
_CORS_ALLOW_HEADERS = ("Authorization, Content-Type, Idempotency-Key, Last-Event-ID, "
                       "Mcp-Session-Id, MCP-Protocol-Version, Mcp-Method, Mcp-Name")
_CORS_EXPOSE_HEADERS = "Location, Idempotent-Replayed, Mcp-Session-Id"
_CORS_MAX_AGE_S = 600
FINAL_EVENTS = frozenset(("response.completed", "response.incomplete",
                          "response.failed", "response.cancelled"))
_BOARD_LIMIT = 50           # tasks the board (GET /) and its change stream show, newest first
_CHANGES_GAP_S = 0.1        # a change stream re-reads the list at most this often (bursts coalesce)
# The HTTP status in a failed task's problem: 503 when a server restart ended
# it (nothing was wrong with the request, so trying again may work), 500 for
# any other failure.
_TASK_ERROR_STATUS = {"server_restarted": 503}


class Unauthorized(TaskStoreError):
    """Missing or wrong bearer token (answered with ``WWW-Authenticate: Bearer``)."""

    code = "unauthorized"
    http_status = 401
    jsonrpc_code = -32600                # for /mcp: the request is refused


class Forbidden(TaskStoreError):
    """A browser request from a page this server does not serve or allow (``--allow-origin``),
    or a ``Host`` that is not a loopback name on a loopback server (DNS rebinding)."""

    code = "forbidden"
    http_status = 403
    jsonrpc_code = -32600                # for /mcp: the request is refused


class RouteNotFound(TaskStoreError):
    """No LMSP route has this path."""

    code = "not_found"
    http_status = 404


class MethodNotAllowed(TaskStoreError):
    """The path is known but not with this method; ``allow`` lists the methods it takes."""

    code = "method_not_allowed"
    http_status = 405
    jsonrpc_code = -32600                # for /mcp: the request is refused

    def __init__(self, method, allow):
        super().__init__(f"method {_echo(method)} is not allowed here; use {', '.join(allow)}")
        self.allow = allow


class PayloadTooLarge(TaskStoreError):
    """The request body is larger than ``--max-body``."""

    code = "payload_too_large"
    http_status = 413
    jsonrpc_code = -32600                # for /mcp: the request is refused


class UnsupportedMediaType(TaskStoreError):
    """A request body whose Content-Type is not JSON."""

    code = "unsupported_media_type"
    http_status = 415
    jsonrpc_code = -32600                # for /mcp: the request is refused


class UnsupportedCapability(InvalidParams):
    """The request needs something the configured backend cannot do."""

    code = "unsupported_capability"


class ServiceUnavailable(TaskStoreError):
    """The server is shutting down or at its limit of concurrent event streams."""

    code = "service_unavailable"
    http_status = 503


class BackendError(TaskStoreError):
    """Raised by a backend when the model fails; the task becomes ``failed`` (backend_error)."""

    code = "backend_error"
    http_status = 500


# -- Wire shapes: the task object, the response object, the event projection --

def task_error_problem(error):
    """Return the problem object a failed task shows for its stored error ``{"code", "message"}``."""
    code = error.get("code", "internal_error")
    status = _TASK_ERROR_STATUS.get(code, 500)
    return problem_object(status, code, error.get("message") or "task failed")


def response_object(task, status=None):
    """Return the LMSP response object of *task*.

    With *status* it is the empty response in that status (the snapshot of a
    response still being produced, or the skeleton a backend fills in);
    without it, the final response of a terminal task: the backend's stored
    result, plus the ``error`` problem when it failed, or ``cancelled``.
    """
    payload = task.payload if isinstance(task.payload, dict) else {}
    base = {"id": task.meta.get("response_id"), "object": "response",
            "created_at": task.created_at // 1000, "status": status,
            "model": payload.get("model"), "output": [], "usage": None,
            "error": None, "incomplete_details": None}
    if status is None:
        if isinstance(task.result, dict):
            base.update(task.result)
        if task.status == FAILED:
            base.update(status="failed", error=task_error_problem(task.error or {}))
        elif task.status == CANCELLED:
            base["status"] = "cancelled"
    return base


def schedule_object(schedule):
    """A schedule as ``GET /lmsp/v1/schedules`` shows it (times RFC 3339, periods in seconds)."""
    return {"object": "schedule", "name": schedule.name, "kind": schedule.kind,
            "payload": schedule.payload,
            "every_seconds": None if schedule.every_ms is None else schedule.every_ms / 1000,
            "cron": schedule.cron, "paused": schedule.paused,
            "next_at": iso_time(schedule.next_at), "last_due": iso_time(schedule.last_due),
            "last_fired_at": iso_time(schedule.last_fired_at),
            "last_task_id": schedule.last_task, "fired": schedule.fired}


def task_object(task):
    """Return the LMSP task object of *task*: what create, get, list and cancel answer with."""
    status = lmsp_status(task)
    return {"id": task.id, "object": "task", "type": "response", "status": status,
            "created_at": task.created_at // 1000, "updated_at": task.updated_at // 1000,
            "response_id": task.meta.get("response_id"),
            "events_url": f"{LMSP_PREFIX}/tasks/{task.id}/events",
            "on_restart": task.policy,
            "response": response_object(task) if status == "succeeded" else None,
            "error": task_error_problem(task.error or {}) if status == "failed" else None,
            # This profile's queue fields, only where a task has them (run_at in seconds).
            **{k: v / 1000 if k == "run_at" else v for k, v in _queue_fields(task).items()}}


# What a create body may carry besides A.1's fields: this profile's queue options.
LMSP_QUEUE_OPTIONS = ("run_at", "delay", "priority", "retry")


def create_options(body):
    """The queue options of a create body (``run_at``, ``delay``, ``priority``, ``retry``).

    Passed to the store as they are: it checks them, and a bad one is a
    400 naming the field, with nothing created.
    """
    return {name: body[name] for name in LMSP_QUEUE_OPTIONS if name in body}


# What a rerun body may carry (this profile's extension): when the new task may run.
LMSP_RERUN_OPTIONS = ("run_at", "delay")


def rerun_options(body):
    """The options of a rerun body (``POST /lmsp/v1/tasks/{id}/rerun``): ``run_at``, ``delay``.

    An empty body (or none) reruns at once.  Any other field is a 400
    naming it; the store checks the values (a bad one is a 400 naming it).
    """
    if not isinstance(body, dict):
        raise InvalidParams("the body must be a JSON object")
    for name in body:
        if name not in LMSP_RERUN_OPTIONS:
            raise InvalidParams(f"a rerun takes only run_at or delay, not {_echo(repr(name))}",
                                param=name)
    return {name: body[name] for name in LMSP_RERUN_OPTIONS if name in body}


# Stored status -> LMSP stream event.  succeeded is decided by the response.
_STATUS_EVENTS = {"queued": "response.queued", "loading": "response.loading",
                  "running": "response.in_progress", "cancelling": "response.cancelling",
                  "failed": "response.failed", "cancelled": "response.cancelled"}


def lmsp_event(task, event):
    """Project one stored event of *task* to the stream's ``(sse_event_name, data)``.

    One stored event is one SSE event with the same sequence number.  Event 0
    (``created``) is ``response.created``; status events become the lifecycle
    events (``response.loading`` and ``response.cancelling`` are this
    project's extensions, ``response.queued`` marks a requeue after a
    restart); a final event carries the final response, so *task* must
    already be terminal for it.  Events a backend emitted pass unchanged.
    """
    head = {"type": None, "sequence_number": event.seq}
    if event.type == "created":
        return _with_type(head, "response.created", response=response_object(task, "queued"))
    if event.type != "status":
        return _with_type(head, event.type, **event.data)
    word = LMSP_STATUS[event.data["status"]]
    if word in ("succeeded", "failed", "cancelled"):
        response = response_object(task)
        name = ("response.incomplete" if response["status"] == "incomplete"
                else "response.completed" if word == "succeeded" else _STATUS_EVENTS[word])
        return _with_type(head, name, response=response)
    snapshot = response_object(task, "queued" if word == "queued" else "in_progress")
    return _with_type(head, _STATUS_EVENTS[word], response=snapshot)


def _with_type(head, name, **fields):
    data = dict(head, **fields)
    data["type"], data["sequence_number"] = name, head["sequence_number"]
    return name, data


def sse_frame(name, data):
    """Encode one server-sent event.

    Its id is the event's sequence number: a client that reconnects sends the
    last one it saw as ``Last-Event-ID`` and resumes right after it.
    """
    return (f"id: {data['sequence_number']}\nevent: {name}\ndata: {dumps(data)}\n\n").encode()


# -- Request validation (pure functions) --

_VISIBLE_ASCII = re.compile(r"\A[\x21-\x7e]{1,255}\Z")
_SF_STRING = re.compile(r'\A"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"\Z')   # RFC 8941


def parse_idempotency_key(values):
    """Return the key of the ``Idempotency-Key`` header values, or None without one.

    A bare token and an RFC 8941 quoted string name the same key: clients
    send either, and one request must not become two because of quoting.

    Raises:
        InvalidParams: several headers, an unbalanced quote, a bad character,
            or a key outside 1..255 visible ASCII characters.
    """
    if not values:
        return None
    value = values[0].strip(" \t")
    quoted = _SF_STRING.match(value)
    if quoted:
        value = re.sub(r"\\(.)", r"\1", quoted.group(1))
    if len(values) > 1 or not _VISIBLE_ASCII.match(value) or (not quoted and '"' in value):
        raise InvalidParams("Idempotency-Key must be 1 to 255 visible ASCII characters, "
                            "bare or as a quoted string", param="Idempotency-Key")
    return value


def parse_cursor(value, param):
    """Return an event cursor (a non-negative integer) or raise InvalidParams."""
    if not re.fullmatch(r"[0-9]{1,18}", value):
        raise InvalidParams(f"{param} must be a non-negative integer", param=param)
    return int(value)


def _origins_regex(patterns):
    """Compile ``--allow-origin`` values: ``*`` alone is any origin; elsewhere ``*``
    stands for any run of characters but ``/`` (``http://localhost:*``)."""
    if not patterns:
        return None
    parts = [".*" if p == "*" else re.escape(p.lower()).replace(r"\*", "[^/]*") for p in patterns]
    return re.compile("|".join(parts))


@functools.lru_cache(maxsize=64)
def _loopback_host(value):
    """True if a ``Host`` header names a loopback name or address (any port)."""
    # Cached: every request of a loopback server asks, nearly always about
    # the same value, and parsing the address was about a tenth of the
    # app's own time for a GET.
    host = value.strip().lower()
    if host.startswith("["):                        # [::1]:8765
        name, closed, port = host[1:].partition("]")
        if not closed:
            return False
        port = port[1:] if port.startswith(":") else (port or None)
    else:
        name, colon, port = host.rpartition(":")
        name, port = (name, port) if colon else (host, None)
    return (port is None or re.fullmatch(r"[0-9]{1,5}", port) is not None) and _is_loopback(name)


def _same_origin(origin, host):
    """True if *origin* is this server's own: its host and port are the request's Host."""
    scheme, sep, authority = origin.strip().lower().partition("://")
    if not sep or host is None:
        return False
    host = host.strip().lower()
    default_port = {"http": ":80", "https": ":443"}.get(scheme, "")
    return authority in (host, host.removesuffix(default_port))


def _not_json(constant):
    raise ValueError(f"{constant} is not JSON")


def _finite_float(text):
    # json's parse_float: 1e999 would parse to infinity, which dumps() refuses later.
    value = float(text)
    if not math.isfinite(value):
        raise InvalidParams("the body has a number too large to represent")
    return value


def _json_body(body, content_type):
    """Parse a request body as strict JSON the store can keep (RFC 8259, valid Unicode).

    A client's mistake is always a 400: a recursion bomb, NaN/Infinity, a number
    too large for a float, or an unpaired surrogate escape never reach the store.
    """
    # Required: a page on another site can send a body with no Content-Type (or
    # text/plain) without a preflight, never one labelled application/json.
    if content_type is None:
        raise UnsupportedMediaType("a body needs Content-Type: application/json")
    media = content_type.split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise UnsupportedMediaType(f"Content-Type {_echo(media) or '(empty)'} is not JSON; "
                                   "send application/json")
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_not_json,
                           parse_float=_finite_float)
    except RecursionError:
        raise InvalidParams(f"the body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError:          # UnicodeDecodeError is one too
        raise InvalidParams("the body is not valid JSON") from None
    problem = _json_problem(value, text=body)
    if problem is not None:
        raise InvalidParams(f"the body {problem}")
    return value


def validate_create(body, backend):
    """Validate a create body; return ``(response_request, on_restart)``.

    The body is ``{"type": "response", "input": <a Responses request>,
    "on_restart": "fail" | "retry" | "resume"}``.

    Raises:
        InvalidParams: a missing or mistyped field (``param`` names it).
        UnsupportedCapability: ``on_restart: "resume"`` without backend snapshots.
    """
    if not isinstance(body, dict):
        raise InvalidParams("the body must be a JSON object")
    if body.get("type") != "response":
        raise InvalidParams('type must be "response"', param="type")
    request = body.get("input")
    if not isinstance(request, dict):
        raise InvalidParams("input must be a response request object", param="input")
    model = request.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidParams("input.model must be a non-empty string", param="input.model")
    items = request.get("input")
    if not isinstance(items, str) and not (
            isinstance(items, list) and all(isinstance(i, dict) for i in items)):
        raise InvalidParams("input.input must be a string or a list of input items",
                            param="input.input")
    limit = request.get("max_output_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidParams("input.max_output_tokens must be a positive integer",
                            param="input.max_output_tokens")
    if "metadata" in request and request["metadata"] is not None and not isinstance(
            request["metadata"], dict):
        raise InvalidParams("input.metadata must be an object", param="input.metadata")
    policy = body.get("on_restart", "fail")
    if policy not in POLICIES:
        raise InvalidParams('on_restart must be "fail", "retry" or "resume"', param="on_restart")
    if policy == "resume" and not getattr(backend, "snapshots", False):
        raise UnsupportedCapability(
            f"backend {getattr(backend, 'name', 'custom')} has no resumable snapshots",
            param="on_restart")
    check = getattr(backend, "validate", None)
    if check is not None:
        check(request)
    # A task always streams through its event log, so the request's own
    # stream flag means nothing here and is dropped rather than refused.
    request = {k: v for k, v in request.items() if k != "stream"}
    return request, policy


# -- Backends --

class ResponseOutput:
    """What a backend sees of its task: the cancel signal, a text sink, its resume point.

    ``write(text)`` streams one ``response.output_text.delta``; the first write
    (or ``start()``) also moves the task from ``loading`` to ``running`` and
    opens the output item.  With snapshots, every event saves ``{item_id,
    text, writes, state, sent}`` in its own transaction, so a ``resume`` after
    a restart continues the same item: ``resumed`` is then True, ``text`` and
    ``writes`` hold what was already streamed, ``state`` whatever JSON the
    backend kept there, and ``sent`` the structural events (item and part
    added/done) already streamed, so a kill between two of them neither repeats
    nor skips one.
    """

    _OPENING = ("response.output_item.added", "response.content_part.added")
    _CLOSING = ("response.output_text.done", "response.content_part.done",
                "response.output_item.done")

    def __init__(self, ctx, snapshots):
        self._ctx, self._snapshots = ctx, snapshots
        self.cancelled = ctx.cancelled
        snap = ctx.load_snapshot() if snapshots else None
        self.resumed = isinstance(snap, dict)
        snap = snap if self.resumed else {}
        self.item_id = snap.get("item_id") or new_id("msg", int(time.time() * 1000))
        self.text, self.writes = snap.get("text", ""), snap.get("writes", 0)
        self.state = snap.get("state")
        sent = snap.get("sent")
        if not isinstance(sent, list):     # a snapshot of 0.1.0: it had only "done"
            sent = list(self._OPENING if self.resumed else ()) + list(
                self._CLOSING if snap.get("done") else ())
        self._sent = sent

    def start(self):
        """Mark the model as producing (``loading`` -> ``running``) and open the output item."""
        self._send("response.output_item.added",
                   {"output_index": 0, "item": self._item("in_progress", [])})
        self._send("response.content_part.added", dict(self._where(), part=_text_part("")))

    def write(self, text):
        """Stream *text* as one delta (the snapshot, if any, is saved with it)."""
        self.start()
        self.text += text
        self.writes += 1
        self._send("response.output_text.delta", dict(self._where(), delta=text))

    def _where(self):
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def _send(self, name, data):
        structural = name in self._OPENING or name in self._CLOSING
        if structural and name in self._sent:
            return                  # streamed before a restart: never twice
        sent = self._sent + [name] if structural else self._sent
        # The snapshot is saved in the event's own transaction, so a kill -9
        # can never leave a streamed event out of it (or the reverse).
        snapshot = {"item_id": self.item_id, "text": self.text, "writes": self.writes,
                    "state": self.state, "sent": sent}
        try:
            if self._snapshots:
                self._ctx.emit(name, data, snapshot=snapshot)
            else:
                self._ctx.emit(name, data)
        except InvalidTransition:
            # The task was cancelled (or requeued) under us: stop the backend.
            raise Cancelled(self._ctx.task_id) from None
        self._sent = sent

    def _item(self, status, content):
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant",
                "content": content}

    def response(self, status, usage=None, incomplete_reason=None):
        """Return the response object with the text so far (used as the task result)."""
        response = response_object(self._ctx.task, status)
        opened = self._OPENING[0] in self._sent
        response.update(
            output=[self._item(status, [_text_part(self.text)])] if opened else [],
            usage=usage,
            incomplete_details={"reason": incomplete_reason} if incomplete_reason else None)
        return response

    def finish(self, usage, incomplete_reason=None):
        """Close the output item with the three ``.done`` events; return the final response."""
        self.start()
        status = "incomplete" if incomplete_reason else "completed"
        part = _text_part(self.text)
        # Each is skipped when it was streamed before a restart.
        self._send("response.output_text.done", dict(self._where(), text=self.text))
        self._send("response.content_part.done", dict(self._where(), part=part))
        self._send("response.output_item.done",
                   {"output_index": 0, "item": self._item(status, [part])})
        return self.response(status, usage, incomplete_reason)


def _text_part(text):
    return {"type": "output_text", "text": text, "annotations": []}


def _usage(input_tokens, output_tokens):
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens}


def response_handler(backend):
    """Return the Runner handler that runs *backend* for one ``response`` task.

    The backend is called as ``backend(request, out)`` with the response
    request and a ResponseOutput; it returns ``{"usage": {...},
    "incomplete_reason": str|None}`` (both optional) or raises BackendError.
    """
    def handle(ctx, request):
        out = ResponseOutput(ctx, getattr(backend, "snapshots", False))
        try:
            info = backend(request, out) or {}
        except BackendError as exc:
            raise TaskFailed({"code": "backend_error", "message": str(exc)},
                             result=out.response("failed")) from None
        if ctx.is_cancelled():
            # The runner confirms the cancel and keeps this as the partial result.
            return out.response("cancelled")
        return out.finish(info.get("usage"), info.get("incomplete_reason"))
    # A claimed response task shows loading (the model may still be loading)
    # until the backend's first output, then running.
    handle.has_loading_phase = True
    return handle


def request_text(request):
    """Return the user text of a response request (the demo backend's contract).

    ``input`` as a string is the text; otherwise the ``text`` of every
    ``input_text`` part of every ``message`` item with role ``user``, in order,
    joined with newlines (a message whose ``content`` is a string counts whole).
    """
    items = request.get("input")
    if isinstance(items, str):
        return items
    texts = []
    for item in items or ():
        if item.get("type", "message") != "message" or item.get("role") != "user":
            continue
        content = item.get("content")
        if isinstance(content, str):
            texts.append(content)
            continue
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "input_text" and isinstance(
                    part.get("text"), str):
                texts.append(part["text"])
    return "\n".join(texts)


def demo_chunks(text):
    """Split *text* into chunks: a run of non-whitespace plus the whitespace after it.

    Leading whitespace belongs to the first chunk, so the deltas a client
    joins always give back *text* exactly.
    """
    return re.findall(r"\s*\S+\s*", text) or ([text] if text else [])


class DemoBackend:
    """The deterministic backend: echoes the input text, one chunk per delta.

    ``delay`` seconds pass before each chunk; a cancel is honoured within one
    chunk.  ``max_output_tokens`` caps the chunks (the response is then
    ``incomplete``); ``metadata.demo_fail_after`` = N fails the task after N
    chunks.  Snapshots: a ``resume`` continues after the last streamed chunk.
    """

    name = "demo"
    snapshots = True

    def __init__(self, delay=DEFAULT_DEMO_DELAY_S):
        self.delay = delay

    def validate(self, request):
        """Check ``metadata.demo_fail_after`` (an integer or a numeric string)."""
        self._fail_after(request)

    @staticmethod
    def _fail_after(request):
        value = (request.get("metadata") or {}).get("demo_fail_after")
        if value is None:
            return None
        if isinstance(value, str) and re.fullmatch(r"[0-9]{1,9}", value.strip()):
            return int(value)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        raise InvalidParams("metadata.demo_fail_after must be a non-negative integer",
                            param="input.metadata.demo_fail_after")

    def __call__(self, request, out):
        text = request_text(request)
        chunks = demo_chunks(text)
        limit = request.get("max_output_tokens")
        emitted = chunks[:limit] if limit is not None else chunks
        fail_after = self._fail_after(request)
        out.start()
        for chunk in emitted[out.writes:]:      # a resumed task skips what it streamed
            if fail_after is not None and out.writes >= fail_after:
                break
            if out.cancelled.wait(self.delay):
                return None
            out.write(chunk)
        if fail_after is not None and fail_after < len(emitted):
            raise BackendError(f"demo backend failed after {fail_after} chunks "
                               "(metadata.demo_fail_after)")
        reason = "max_output_tokens" if len(emitted) < len(chunks) else None
        return {"usage": _usage(len(text.split()), out.writes), "incomplete_reason": reason}


# -- The application: routes and operations, no sockets --

class Reply:
    """One HTTP answer: status, headers, and a JSON body or an event stream."""

    def __init__(self, status, body=None, headers=(), stream=None,
                 content_type="application/json"):
        self.status, self.headers, self.stream = status, list(headers), stream
        self.body = b"" if body is None else dumps(body).encode()
        self.content_type = content_type


# -- /metrics: the Prometheus text format -------------------------------------
# GET /metrics answers in the Prometheus text exposition format 0.0.4.  Two
# sources, each said in its HELP line: gauges read from the database at each
# scrape (the unfinished tasks by kind and status, the oldest queued task's
# age, the schedules' lag), which every process sharing the store sees alike
# and which are read through the partial indexes of queued tasks and of the
# work in flight (a scrape costs what is waiting and running, never the
# finished tasks kept: no count of a million finished tasks is read); and
# counters this process keeps as its own writes commit (tasks finished,
# attempts started, requeues, run times), from a store listener: O(1) per
# change, nothing read.  As with any Prometheus client, each process exposes
# its own counters and a query sums the processes.

METRICS_PATH = "/metrics"
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Run-time histogram buckets, seconds (Prometheus's defaults, stretched to an hour).
METRICS_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                     60.0, 300.0, 900.0, 3600.0)
_METRICS_TRACKED = 100_000     # tasks whose start time is kept, at most (the oldest go first)


def _metric_label(value):
    """A label value in the exposition format: backslash, quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _metric_number(value):
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if value == math.inf:
        return "+Inf"
    return repr(float(value))


def _metric_family(out, name, kind, help_text, samples):
    """Append one family: its HELP and TYPE lines, then ``(suffix, labels, value)`` samples."""
    out.append(f"# HELP {name} " + help_text.replace("\\", "\\\\").replace("\n", "\\n"))
    out.append(f"# TYPE {name} {kind}")
    for suffix, labels, value in samples:
        label_text = ",".join(f'{key}="{_metric_label(v)}"' for key, v in labels)
        out.append(f"{name}{suffix}{'{' + label_text + '}' if labels else ''} "
                   f"{_metric_number(value)}")


class Metrics:
    """What ``GET /metrics`` shows for one store: its gauges and this process's counters.

    Made with the store, it listens to the store's commits (``close``
    stops that).  ``render()`` is the exposition text.  The attempts and
    retries of tasks are counted from the moves this process sees: an
    attempt starts when a task enters ``loading`` or ``running`` from
    ``queued`` (``task_attempts_total``), and a requeue is a move back to
    ``queued`` after a crash (``task_requeues_total``: recovery's
    restarts).  A failed attempt that a retry policy sends back to
    ``queued`` is a retry (``task_retries_total``), not a requeue: the
    move is the same ``requeue``, told apart by the not-before time only
    a retry sets (a restart queues the task at once, ``run_at`` None).
    """

    def __init__(self, store):
        self.store = store
        self._lock = threading.Lock()
        self._started = {}       # task id -> ms its attempt started here (for run times)
        self._finished = {}      # (kind, status) -> tasks finished here
        self._attempts = {}      # kind -> attempts started here
        self._requeues = {}      # kind -> tasks moved back to queued here after a crash
        self._retries = {}       # kind -> failed attempts moved back to queued here
        self._runs = {}          # kind -> [bucket counts..., +Inf count, sum seconds]
        store.add_listener(self._observe)

    def close(self):
        """Stop counting."""
        self.store.remove_listener(self._observe)

    def _observe(self, task, change):
        if change != "status":
            return
        status, kind = task.status, task.kind
        with self._lock:
            if status in (LOADING, RUNNING) and task.id not in self._started:
                self._started[task.id] = task.updated_at
                self._attempts[kind] = self._attempts.get(kind, 0) + 1
                if len(self._started) > _METRICS_TRACKED:       # finished elsewhere, say
                    del self._started[next(iter(self._started))]
            elif status == QUEUED:
                self._started.pop(task.id, None)
                counts = self._requeues if task.run_at is None else self._retries
                counts[kind] = counts.get(kind, 0) + 1
            elif status in TERMINAL_STATES:
                key = (kind, status)
                self._finished[key] = self._finished.get(key, 0) + 1
                began = self._started.pop(task.id, None)
                if began is not None:
                    seconds = max(0, task.updated_at - began) / 1000
                    run = self._runs.setdefault(kind, [0] * (len(METRICS_BUCKETS_S) + 2))
                    for i, bound in enumerate(METRICS_BUCKETS_S):
                        if seconds <= bound:
                            run[i] += 1
                    run[-2] += 1
                    run[-1] += seconds

    def render(self):
        """The exposition text (format 0.0.4), one family after another, ending in a newline."""
        now = int(self.store.clock() * 1000)
        unfinished = sorted(self.store.unfinished())
        schedules = self.store.schedules.list()
        with self._lock:
            finished, attempts = sorted(self._finished.items()), sorted(self._attempts.items())
            requeues = sorted(self._requeues.items())
            retries = sorted(self._retries.items())
            runs = sorted((kind, list(run)) for kind, run in self._runs.items())
        oldest = {}
        for kind, status, _, created_at in unfinished:
            if status == QUEUED and created_at is not None:
                oldest[kind] = min(created_at, oldest.get(kind, created_at))
        out = []
        _metric_family(out, "taskstore_tasks", "gauge",
                       "Unfinished tasks by kind and status, in the database "
                       "(finished ones: taskstore_tasks_finished_total).",
                       [("", (("kind", kind), ("status", status)), count)
                        for kind, status, count, _ in unfinished])
        _metric_family(out, "taskstore_oldest_queued_age_seconds", "gauge",
                       "Age of the oldest queued task ready to run (not delayed) by "
                       "kind, in the database.",
                       [("", (("kind", kind),), max(0, now - at) / 1000)
                        for kind, at in sorted(oldest.items())])
        _metric_family(out, "taskstore_tasks_finished_total", "counter",
                       "Tasks this process saw finish, by kind and final status.",
                       [("", (("kind", kind), ("status", status)), n)
                        for (kind, status), n in finished])
        _metric_family(out, "taskstore_task_attempts_total", "counter",
                       "Attempts this process saw start (a task entering loading or "
                       "running), by kind.", [("", (("kind", kind),), n) for kind, n in attempts])
        _metric_family(out, "taskstore_task_requeues_total", "counter",
                       "Tasks this process moved back to queued after a crash "
                       "(restarts), by kind.",
                       [("", (("kind", kind),), n) for kind, n in requeues])
        _metric_family(out, "taskstore_task_retries_total", "counter",
                       "Failed attempts this process sent back to queued under a retry "
                       "policy, by kind.", [("", (("kind", kind),), n) for kind, n in retries])
        samples = []
        for kind, run in runs:
            for bound, count in zip((*METRICS_BUCKETS_S, math.inf), run):
                samples.append(("_bucket", (("kind", kind), ("le", _metric_number(bound))),
                                count))
            samples += [("_sum", (("kind", kind),), run[-1]),
                        ("_count", (("kind", kind),), run[-2])]
        _metric_family(out, "taskstore_task_run_seconds", "histogram",
                       "Run time of the attempts this process saw start and end "
                       "(from loading or running to the final status), by kind.", samples)
        active = [s for s in schedules if not s.paused]
        _metric_family(out, "taskstore_schedule_lag_seconds", "gauge",
                       "How long the due period of each active schedule has waited "
                       "to fire (0: none is due).",
                       [("", (("schedule", s.name),), max(0, now - s.next_at) / 1000)
                        for s in active])
        _metric_family(out, "taskstore_schedule_last_lag_seconds", "gauge",
                       "How late each schedule's last period fired.",
                       [("", (("schedule", s.name),), (s.last_fired_at - s.last_due) / 1000)
                        for s in schedules if s.last_due is not None])
        _metric_family(out, "taskstore_schedule_fired_total", "counter",
                       "Periods each schedule has fired, by every process.",
                       [("", (("schedule", s.name),), s.fired) for s in schedules])
        _metric_family(out, "taskstore_schedule_paused", "gauge",
                       "1 if the schedule is paused, else 0.",
                       [("", (("schedule", s.name),), int(s.paused)) for s in schedules])
        return "\n".join(out) + "\n"


class LMSPApp:
    """The LMSP routes over one TaskStore, independent of sockets.

    ``handle(method, target, headers, read_body)`` returns a Reply; the
    transport (LMSPRequestHandler) only moves bytes.  ``tokens`` maps bearer
    token -> principal name; with none, there is no authentication.
    ``allow_origins`` are the browser origins (``--allow-origin`` patterns)
    whose pages may call the routes, besides the server's own.  *mcp*, an
    McpHttp, is served at ``/mcp`` behind the same guards; *metrics* True
    serves ``GET /metrics`` (``Metrics``) behind them too.
    """

    def __init__(self, store, backend, *, tokens=None, max_body=DEFAULT_MAX_BODY,
                 task_retention=DEFAULT_RETENTION_S, event_retention=DEFAULT_RETENTION_S,
                 idempotency_retention=DEFAULT_RETENTION_S,
                 request_timeout=DEFAULT_REQUEST_TIMEOUT_S, max_streams=DEFAULT_MAX_STREAMS,
                 keepalive_interval=DEFAULT_KEEPALIVE_S, allow_origins=(), mcp=None,
                 metrics=False):
        self.store, self.backend = store, backend
        # GET /metrics (a Metrics of the store, counting from now), or None.
        self.metrics = Metrics(store) if metrics else None
        self.mcp = mcp                  # an McpHttp served at /mcp, or None
        if mcp is not None:
            mcp.app = self
        self.allow_origins = tuple(allow_origins)
        self._allowed_origin = _origins_regex(self.allow_origins)
        self.loopback_only = False      # LMSPServer sets it from its address: Host is checked
        self.tokens = dict(tokens or {})
        self.max_body, self.request_timeout = max_body, request_timeout
        self.task_retention, self.event_retention = task_retention, event_retention
        self.idempotency_retention = idempotency_retention
        self.keepalive_interval, self.max_streams = keepalive_interval, max_streams
        self._streams = threading.BoundedSemaphore(max_streams)
        self.stopping = threading.Event()
        self.routes = [   # (pattern, {method: operation}); HEAD answers like GET, no body
            (re.compile(r"/"), {"GET": self._page, "HEAD": self._page}),
            (re.compile(r"/lmsp/v1/tasks"),
             {"GET": self._list, "HEAD": self._list, "POST": self._create}),
            # Our extension (before the task route, which would take it for an id).
            (re.compile(r"/lmsp/v1/tasks/changes"), {"GET": self._changes}),
            (re.compile(r"/lmsp/v1/tasks/([^/]*)"), {"GET": self._get, "HEAD": self._get}),
            (re.compile(r"/lmsp/v1/tasks/([^/]*)/cancel"), {"POST": self._cancel}),
            (re.compile(r"/lmsp/v1/tasks/([^/]*)/events"), {"GET": self._events}),
            # Our extension: dead letters, a failed task run again as a new task.
            (re.compile(r"/lmsp/v1/tasks/([^/]*)/rerun"), {"POST": self._rerun}),
            (re.compile(r"/lmsp/v1/capabilities"),
             {"GET": self._capabilities, "HEAD": self._capabilities}),
            (re.compile(r"/healthz"), {"GET": self._health, "HEAD": self._health}),
            # Our extension: the schedules, read-only (tasks schedules changes them).
            (re.compile(r"/lmsp/v1/schedules"),
             {"GET": self._schedules, "HEAD": self._schedules}),
        ]
        if self.metrics is not None:
            self.routes.append((re.compile(METRICS_PATH),
                                {"GET": self._metrics, "HEAD": self._metrics}))
        if mcp is not None:     # its errors are JSON-RPC errors (handle), not problems
            self.routes.append((re.compile(MCP_PATH),
                                {"POST": mcp.post, "GET": mcp.get, "DELETE": mcp.delete}))

    def close(self):
        """Refuse new requests and end every open event stream (within _STREAM_WAKE_S)."""
        self.stopping.set()
        if self.metrics is not None:
            self.metrics.close()

    def handle(self, method, target, headers, read_body, client_gone=None):
        """Route one request; every exception becomes a problem reply here.

        *client_gone* (the transport's) says whether the client has closed
        the connection: an MCP request that waits for its work gives up then.
        """
        origin = None
        path, _, query = target.partition("?")
        try:
            origin = self.check_site(headers, page=path == "/" and method in ("GET", "HEAD"))
            for pattern, methods in self.routes:
                match = pattern.fullmatch(path)
                if match:
                    break
            else:
                if path.startswith("/lmsp/"):
                    self.authenticate(headers)     # existence of routes needs a token too
                raise RouteNotFound(f"no route {_echo(path)}")
            if (method == "OPTIONS" and origin is not None
                    and "Access-Control-Request-Method" in headers):
                # A CORS preflight carries no token; the request that follows does.
                reply = Reply(204, headers=[
                    ("Access-Control-Allow-Methods", ", ".join(sorted(methods))),
                    ("Access-Control-Allow-Headers", _CORS_ALLOW_HEADERS),
                    ("Access-Control-Max-Age", str(_CORS_MAX_AGE_S))], content_type=None)
            else:
                # The board page holds no data: it asks for the token itself.
                principal = None if path in ("/healthz", "/") else self.authenticate(headers)
                op = methods.get(method)
                if op is None:
                    raise MethodNotAllowed(method, sorted(methods))
                if self.stopping.is_set():
                    raise ServiceUnavailable("the server is shutting down")
                request = {"principal": principal, "headers": headers, "read_body": read_body,
                           "method": method, "client_gone": client_gone or (lambda: False),
                           "query": urllib.parse.parse_qs(query, keep_blank_values=True)
                           if query else {}}     # most requests have none: skip the parser
                reply = op(request, *match.groups())
        except OSError:
            raise       # the client's socket failed (reset, request timeout): no answer
        except Exception as exc:   # noqa: BLE001 -- the one place errors become answers
            reply = (self.mcp.error_reply(None, exc) if path == MCP_PATH and self.mcp is not None
                     else self.problem_reply(exc))
        if origin is not None:     # an allowed page reads every answer, errors included
            reply.headers += [("Access-Control-Allow-Origin", origin), ("Vary", "Origin"),
                              ("Access-Control-Expose-Headers", _CORS_EXPOSE_HEADERS)]
        return reply

    def check_site(self, headers, page=False):
        """Refuse what a browser sends for another site's page; return an allowed origin.

        Returns the request's ``Origin`` when it is one of ``allow_origins``
        (the answer then carries CORS headers), else None.  With *page* (a
        GET of the board), a top-level navigation from another site (a link
        followed: ``Sec-Fetch-Mode: navigate``, ``Sec-Fetch-Dest: document``)
        may load it: the page holds no data, and its own requests are then
        same-origin.

        Raises:
            Forbidden: on a loopback server, a ``Host`` that is not a loopback
                name or address (DNS rebinding); an ``Origin`` that is neither
                allowed nor the server's own; ``Sec-Fetch-Site: cross-site``
                from a page that is not allowed.
        """
        if self.loopback_only:
            for host in headers.get_all("Host") or ():
                if not _loopback_host(host):
                    raise Forbidden(f"Host {host[:100]!r} is not a loopback name or address, "
                                    "and this server listens on loopback only")
        origin = headers.get("Origin")
        if origin is None:
            site = (headers.get("Sec-Fetch-Site") or "").strip().lower()
            navigation = page and (
                (headers.get("Sec-Fetch-Mode") or "").strip().lower() == "navigate"
                and (headers.get("Sec-Fetch-Dest") or "").strip().lower() == "document")
            if site == "cross-site" and not navigation:
                raise Forbidden("cross-site requests are refused")
            return None
        origin = origin.strip()
        if self._allowed_origin is not None and self._allowed_origin.fullmatch(origin.lower()):
            return origin
        site = (headers.get("Sec-Fetch-Site") or "").strip().lower()
        if site == "cross-site" or not _same_origin(origin, headers.get("Host")):
            raise Forbidden(f"origin {origin[:100]!r} is not allowed (see --allow-origin)")
        return None

    @staticmethod
    def problem_reply(exc):
        """Return the problem Reply for *exc* (a bug is logged, never shown)."""
        if not isinstance(exc, TaskStoreError):
            logger.exception("internal error while answering a request")
        status, problem = to_problem(exc)
        headers = []
        if isinstance(exc, Unauthorized):
            headers.append(("WWW-Authenticate", 'Bearer realm="lmsp"'))
        if isinstance(exc, MethodNotAllowed):
            headers.append(("Allow", ", ".join(exc.allow)))
        if status == 503:       # the store or the server is busy or down: come back soon
            headers.append(("Retry-After", str(RETRY_AFTER_S)))
        return Reply(status, problem, headers, content_type="application/problem+json")

    def authenticate(self, headers):
        """Return the principal of the request's bearer token (None without tokens).

        Raises:
            Unauthorized: tokens are configured and the header is missing or wrong.
        """
        if not self.tokens:
            return None
        values = headers.get_all("Authorization") or []
        scheme, _, token = (values[0] if len(values) == 1 else "").strip().partition(" ")
        found = None
        # Compare against every token in constant time, so neither the match nor
        # its position leaks through timing.
        for known, principal in self.tokens.items():
            if hmac.compare_digest(token.strip().encode(), known.encode()):
                found = principal
        if scheme.lower() != "bearer" or found is None:
            raise Unauthorized("a valid bearer token is required")
        return found

    def _task_id(self, task_id):
        # Shape first: an id this module cannot have issued never reaches SQL.
        if not is_task_id(task_id) or not task_id.startswith("task_"):
            raise TaskNotFound(task_id)     # the message escapes and shortens it
        return task_id

    def _query(self, request, name):
        values = request["query"].get(name)
        if not values or values[-1] == "":
            return None
        return values[-1]

    # -- operations --

    def _page(self, request):
        reply = Reply(200, headers=[
            ("Content-Security-Policy", _BOARD_CSP), ("X-Content-Type-Options", "nosniff"),
            ("Referrer-Policy", "no-referrer"), ("Cache-Control", "no-store"),
            ("X-Frame-Options", "DENY")], content_type="text/html; charset=utf-8")
        reply.body = _board_page()
        return reply

    def _changes(self, request):
        limit = self._query(request, "limit") or str(_BOARD_LIMIT)
        if not re.fullmatch(r"[0-9]{1,3}", limit) or not 1 <= int(limit) <= 100:
            raise InvalidParams("limit must be an integer from 1 to 100", param="limit")
        if not self._streams.acquire(blocking=False):
            raise ServiceUnavailable(f"too many event streams (at most {self.max_streams})")
        return Reply(200, headers=[("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no")],
                     stream=ChangeStream(self, request["principal"], int(limit)),
                     content_type="text/event-stream; charset=utf-8")

    def _health(self, request):
        return Reply(200, {"status": "ok"})

    def _metrics(self, request):
        reply = Reply(200, content_type=METRICS_CONTENT_TYPE)
        reply.body = self.metrics.render().encode()
        return reply

    def _schedules(self, request):
        return Reply(200, {"object": "list", "data": [schedule_object(s) for s in
                                                      self.store.schedules.list()]})

    def _capabilities(self, request):
        snapshots = bool(getattr(self.backend, "snapshots", False))
        return Reply(200, {
            "object": "capabilities", "lmsp_version": LMSP_VERSION,
            "tasks": {"types": ["response"],
                      "on_restart": [p for p in POLICIES if p != "resume" or snapshots],
                      "event_resume": True, "list": True, "max_body_bytes": self.max_body},
            "retention": {"task_seconds": self.task_retention,
                          "event_seconds": self.event_retention,
                          "idempotency_seconds": self.idempotency_retention},
            "backend": {"name": getattr(self.backend, "name", "custom"),
                        "snapshots": snapshots}})

    def _create(self, request):
        body = _json_body(request["read_body"](), request["headers"].get("Content-Type"))
        response_request, policy = validate_create(body, self.backend)
        key = parse_idempotency_key(request["headers"].get_all("Idempotency-Key"))
        principal = request["principal"]
        idempotency = None
        if key is not None:
            # A key is scoped to principal + method + path: two principals that
            # happen to pick the same key make two tasks, and neither sees the other's.
            scope = f"lmsp\n{principal or ''}\nPOST\n{LMSP_PREFIX}/tasks"
            idempotency = (scope, key, fingerprint(body),
                           int(self.idempotency_retention * 1000))
        task = self.store.create(
            "response", response_request, policy=policy, principal=principal,
            retention_ms=int(self.task_retention * 1000),
            meta={"response_id": new_id("resp", int(time.time() * 1000))},
            idempotency=idempotency, **create_options(body))
        headers = [("Location", f"{LMSP_PREFIX}/tasks/{task.id}")]
        if task.replayed:
            headers.append(("Idempotent-Replayed", "true"))
        return Reply(202, task_object(task), headers)

    def _get(self, request, task_id):
        task = self.store.get(self._task_id(task_id), principal=request["principal"])
        return Reply(200, task_object(self._lmsp_only(task)))

    def _lmsp_only(self, task):
        if task.kind != "response":     # an MCP task in the same file is not an LMSP task
            raise TaskNotFound(task.id)
        return task

    def _cancel(self, request, task_id):
        task_id = self._task_id(task_id)
        headers = request["headers"]
        if headers.get("Content-Length") not in (None, "0") or "Transfer-Encoding" in headers:
            body = request["read_body"]()
            if body:
                _json_body(body, headers.get("Content-Type"))
        self._lmsp_only(self.store.get(task_id, principal=request["principal"]))
        task = self.store.cancel(task_id, principal=request["principal"])
        return Reply(200, task_object(task))

    def _rerun(self, request, task_id):
        # Our extension (dead letters): 202 and the new task, as a create answers;
        # the failed task keeps its status and history (store.rerun).
        task_id = self._task_id(task_id)
        headers, options = request["headers"], {}
        if headers.get("Content-Length") not in (None, "0") or "Transfer-Encoding" in headers:
            body = request["read_body"]()
            if body:
                options = rerun_options(_json_body(body, headers.get("Content-Type")))
        self._lmsp_only(self.store.get(task_id, principal=request["principal"]))
        task = self.store.rerun(task_id, principal=request["principal"], **options)
        return Reply(202, task_object(task), [("Location", f"{LMSP_PREFIX}/tasks/{task.id}")])

    def _list(self, request):
        status = self._query(request, "status")
        if status is not None and status not in LMSP_STATUS.values():
            raise InvalidParams(f"unknown status {_echo(repr(status))}", param="status")
        limit = self._query(request, "limit") or "20"
        if not re.fullmatch(r"[0-9]{1,3}", limit) or not 1 <= int(limit) <= 100:
            raise InvalidParams("limit must be an integer from 1 to 100", param="limit")
        stored = None if status is None else [s for s, w in LMSP_STATUS.items() if w == status]
        # Our extension: ?error_code= lists the failed tasks whose error has that code.
        error_code = self._query(request, "error_code")
        try:
            tasks, cursor = self.store.list(status=stored, kind="response",
                                            principal=request["principal"],
                                            limit=int(limit), cursor=self._query(request, "after"),
                                            error_code=error_code)
        except InvalidCursor:
            raise InvalidCursor("after is not a cursor this server issued", param="after") from None
        return Reply(200, {"object": "list", "data": [task_object(t) for t in tasks],
                           "has_more": cursor is not None, "next_cursor": cursor})

    def _events(self, request, task_id):
        task_id = self._task_id(task_id)
        principal = request["principal"]
        header = request["headers"].get("Last-Event-ID")
        # Last-Event-ID wins over ?after=: a reconnecting EventSource resends the
        # URL it was opened with, and the header says where it actually got to.
        if header is not None and header.strip() != "":
            after = parse_cursor(header.strip(), "Last-Event-ID")
            param = "Last-Event-ID"
        else:
            after = self._query(request, "after")
            after = None if after is None else parse_cursor(after, "after")
            param = "after"
        task = self._lmsp_only(self.store.get(task_id, principal=principal))
        if after is not None and after > task.last_seq:
            raise InvalidParams(f"{param} {after} is beyond the last event ({task.last_seq})",
                                param=param)
        if after == task.last_seq and task.terminal:
            # The client has the final event: nothing will ever follow.  204 is
            # what makes an EventSource stop reconnecting (WHATWG HTML 9.2).
            return Reply(204, content_type=None)
        # Decided before the 200: 410 for pruned events (EventsExpired).
        events = self.store.events(task_id, after=after, limit=_EVENT_BATCH, principal=principal)
        if not self._streams.acquire(blocking=False):
            raise ServiceUnavailable(f"too many event streams (at most {self.max_streams})")
        return Reply(200, headers=[("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no")],
                     stream=EventStream(self, task, events, after),
                     content_type="text/event-stream; charset=utf-8")


class EventStream:
    """The frames of one task's event stream: missed events, then live ones.

    Iterating yields encoded SSE frames and ``: keep-alive`` comments; it ends
    after the final event (``complete`` is then True), when the server stops,
    the store closes, or ``client_gone()`` (set by the transport) says the
    client left.  ``close()`` gives back the stream slot and must be called once.
    """

    def __init__(self, app, task, events, after):
        self.app, self.task, self.events = app, task, events
        self.last = -1 if after is None else after
        self.complete = False
        self._closed = False
        self.client_gone = lambda: False

    def close(self):
        """Release this stream's slot (idempotent)."""
        if not self._closed:
            self._closed = True
            self.app._streams.release()

    def __iter__(self):
        app, store, task, events = self.app, self.app.store, self.task, self.events
        idle_since = time.monotonic()
        try:
            while not app.stopping.is_set() and not self.client_gone():
                for event in events:
                    if (event.type == "status" and event.data.get("status") in TERMINAL_STATES
                            and not task.terminal):
                        task = store.get(task.id)      # a final event needs the final task
                    name, data = lmsp_event(task, event)
                    yield sse_frame(name, data)
                    self.last, idle_since = event.seq, time.monotonic()
                    if name in FINAL_EVENTS:
                        self.complete = True
                        return
                if len(events) < _EVENT_BATCH and task.terminal:
                    self.complete = True
                    return                 # the client already had the final event
                if len(events) < _EVENT_BATCH:
                    idle = time.monotonic() - idle_since
                    if idle >= app.keepalive_interval:
                        yield b": keep-alive\n\n"
                        idle, idle_since = 0.0, time.monotonic()
                    task = store.wait(task.id, since_version=task.version,
                                      timeout=min(_STREAM_WAKE_S, app.keepalive_interval - idle))
                events = store.events(task.id, after=self.last, limit=_EVENT_BATCH)
        except (StoreClosed, TaskNotFound, EventsExpired):
            return       # after the 200 a stream can only end; the client reconnects


class ChangeStream:
    """The board's change stream (our extension): the newest tasks, then each change.

    It sends a ``task`` event (a board_item) for each of the newest *limit*
    tasks, then one whenever one of them changes or a task is created.  A
    store listener wakes it at once for a write of this process; every
    _STREAM_WAKE_S it reads the list anyway, for another process's writes.
    Same interface as EventStream; it ends only when the server stops or
    the client leaves (``complete`` stays False: the client reconnects).
    """

    def __init__(self, app, principal, limit):
        self.app, self.principal, self.limit = app, principal, limit
        self.complete = False
        self._closed = False
        self.client_gone = lambda: False
        self._changed = threading.Event()
        app.store.add_listener(self._listener)

    def _listener(self, task, change):
        self._changed.set()

    def close(self):
        """Stop listening and release this stream's slot (idempotent)."""
        if not self._closed:
            self._closed = True
            self.app.store.remove_listener(self._listener)
            self.app._streams.release()

    def __iter__(self):
        app, store = self.app, self.app.store
        sent = self.sent = {}          # task id -> version sent, for the listed tasks only
        idle_since = time.monotonic()
        try:
            yield b"retry: 1000\n\n"
            while not app.stopping.is_set() and not self.client_gone():
                self._changed.clear()
                tasks, _ = store.list(kind="response", principal=self.principal,
                                      limit=self.limit)
                listed = {task.id for task in tasks}     # forget tasks pushed off the
                for task_id in [tid for tid in sent if tid not in listed]:   # list: a
                    del sent[task_id]                     # long-lived stream stays small
                for task in reversed(tasks):       # oldest first: the newest ends on top
                    if sent.get(task.id) != task.version:
                        sent[task.id] = task.version
                        yield f"event: task\ndata: {dumps(board_item(task))}\n\n".encode()
                        idle_since = time.monotonic()
                if time.monotonic() - idle_since >= app.keepalive_interval:
                    yield b": keep-alive\n\n"
                    idle_since = time.monotonic()
                if self._changed.wait(_STREAM_WAKE_S):
                    app.stopping.wait(_CHANGES_GAP_S)      # let a burst of writes land
        except StoreClosed:
            return


def board_item(task):
    """Return what the board shows of *task*: the task object's summary plus its lifecycle.

    ``state`` is the stored status (a key of TRANSITIONS, for the diagram);
    ``status`` the LMSP word.
    """
    obj = task_object(task)
    payload = task.payload if isinstance(task.payload, dict) else {}
    error = obj["error"]
    return {"id": task.id, "status": obj["status"], "state": task.status,
            "model": payload.get("model"), "on_restart": task.policy,
            "attempt": task.attempt, "created_at": obj["created_at"],
            "updated_at": obj["updated_at"], "progress": task.progress,
            "progress_total": task.progress_total, "message": task.status_message,
            "last_seq": task.last_seq,
            "error": None if error is None else {"code": error.get("code"),
                                                 "detail": error.get("detail")},
            # The queue: when a queued task may run (seconds), its attempts, its priority.
            "run_at": obj.get("run_at"), "max_attempts": obj.get("max_attempts"),
            "priority": obj.get("priority", DEFAULT_PRIORITY)}


def _board_page():
    """Return the board page's bytes, with the lifecycle table embedded as JSON data."""
    data = dumps({"transitions": TRANSITIONS, "terminal": sorted(TERMINAL_STATES),
                  "policies": list(POLICIES)})
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return BOARD_HTML.replace("/*BOARD_DATA*/", data).encode()


# -- MCP over Streamable HTTP: /mcp --
# The transport frames; McpDispatcher (section 9) decides.  2026-07-28: every
# POST is served by a dispatcher made for it and dropped after it, so nothing
# but the store lasts between requests and any replica serves any request.
# 2025-11-25: initialize opens a session (Mcp-Session-Id) whose dispatcher
# lives in this process until DELETE (sticky: its elicitation requests travel
# on the SSE stream of a request open here, and their answers must reach the
# tool waiting here); it ends after DEFAULT_MCP_SESSION_IDLE_S without a
# request or an open stream, and its GET stream resumes with Last-Event-ID.
# A request whose work waits (the method table's "wait":
# an inline tools/call, tasks/result, subscriptions/listen) runs on a thread of
# its own while the connection's thread writes; the client closing the
# connection cancels it.  Guards are the LMSP routes': bearer tokens, Host and
# Origin checks, body, stream and connection caps.

MCP_PATH = "/mcp"
MCP_SESSION_HEADER = "Mcp-Session-Id"
DEFAULT_MCP_MAX_SESSIONS = 1024     # 2025-11-25 sessions kept; the least recently used idle one goes
# A 2025-11-25 session with no stream open and no request for this long ends
# (its Mcp-Session-Id gets 404 and the client initializes again): a client
# that vanished without DELETE frees its slot without waiting to be evicted.
DEFAULT_MCP_SESSION_IDLE_S = 30 * 60
# The HTTP status of a JSON-RPC error answer, by era and code (else the era's
# default).  2026-07-28 refuses with 400 (its transport names 400 for -32020,
# -32021, -32022 and invalid _meta, and 404 for -32601); 2025-11-25 carries an
# error answer in a 200 like any other answer, but for messages it cannot read.
_MCP_ERROR_STATUS = {_MODERN: ({-32601: 404, -32603: 500, -32005: 503}, 400),
                     _LEGACY: ({-32700: 400, -32600: 400}, 200)}
# 2026-07-28: the body field the Mcp-Name header repeats, by method.
_MCP_NAME_PARAM = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri",
                   "tasks/get": "taskId", "tasks/update": "taskId", "tasks/cancel": "taskId"}
_MCP_DONE = object()                # the end of a request's work, in its outbox
_MCP_WAKE_S = 0.25                  # how soon a waiting request notices its client left
# 2025-11-25: the messages of a session's GET stream kept for a client that
# resumes it with Last-Event-ID (the most recent ones; older ids get 400).
# At most this many per session, and DEFAULT_MCP_MAX_SESSIONS sessions: about
# 50 MB in all at ~400 bytes a message, should every session fill its log.
_MCP_REPLAY_EVENTS = 128


class HeaderMismatch(TaskStoreError):
    """2026-07-28 over HTTP: an ``Mcp-*`` header missing, malformed, or not what the body says."""

    code = "header_mismatch"
    http_status = 400
    jsonrpc_code = -32020


class NotAcceptable(TaskStoreError):
    """An MCP POST whose ``Accept`` does not list both application/json and text/event-stream."""

    code = "not_acceptable"
    http_status = 406
    jsonrpc_code = -32600


class SessionNotFound(TaskStoreError):
    """2025-11-25 over HTTP: an ``Mcp-Session-Id`` this server does not know, or has ended."""

    code = "session_not_found"
    http_status = 404
    jsonrpc_code = -32001


def _mcp_header_value(value):
    """An ``Mcp-Name``/``Mcp-Param-*`` value as the body would say it (None: malformed).

    Whitespace around it is not part of it (RFC 9110 5.5); ``=?base64?...?=``
    carries UTF-8 in strict Base64, and anything that only looks like it is
    taken literally.
    """
    value = value.strip(" \t")
    if value.startswith("=?base64?") and value.endswith("?=") and len(value) >= 11:
        try:
            return base64.b64decode(value[9:-2], validate=True).decode("utf-8")
        except (ValueError, UnicodeDecodeError):   # binascii.Error is a ValueError
            return None
    return value


def _mcp_accepts(headers):
    """True if ``Accept`` lists both application/json and text/event-stream (or ``*/*``)."""
    media = {part.split(";")[0].strip().lower()
             for part in ",".join(headers.get_all("Accept") or ()).split(",")}
    return "*/*" in media or {"application/json", "text/event-stream"} <= media


def _mcp_status(message, era):
    """The HTTP status that carries a JSON-RPC answer of *era* (``_MCP_ERROR_STATUS``)."""
    error = message.get("error")
    if not isinstance(error, dict):
        return 200
    statuses, default = _MCP_ERROR_STATUS[era]
    return statuses.get(error.get("code"), default)


class McpStream:
    """The SSE answer to one MCP request whose work runs while its client waits.

    Its work runs on a thread of its own and puts what it sends into
    ``outbox`` (the answer last, then ``_MCP_DONE``); each message is one
    ``data:`` frame, with keep-alive comments while idle.  It ends when the
    work does, when the server stops, or when the client leaves
    (``client_gone``, set by the transport), which closes the request's
    dispatcher: its work is cancelled.  Same interface as EventStream;
    ``close()`` gives back the stream slot.
    """

    def __init__(self, app, outbox, cancel, on_close=None, first=None):
        self.app, self.outbox, self._cancel, self._first = app, outbox, cancel, first
        self.complete = False
        self.client_gone = lambda: False
        self._on_close = on_close
        self._closed = False

    def close(self):
        """Release this stream's slot (idempotent)."""
        if not self._closed:
            self._closed = True
            self.app._streams.release()
            if self._on_close is not None:
                self._on_close(self.outbox)

    def __iter__(self):
        app, keepalive = self.app, self.app.keepalive_interval
        idle_since = time.monotonic()
        if self._first is not None:
            yield b"event: message\ndata: " + dumps(self._first).encode() + b"\n\n"
        while True:
            try:
                item = self.outbox.get(timeout=_MCP_WAKE_S)
            except queue.Empty:
                if app.stopping.is_set() or self.client_gone():
                    self._cancel()              # closing the stream cancels the request
                    return
                if time.monotonic() - idle_since >= keepalive:
                    yield b": keep-alive\n\n"
                    idle_since = time.monotonic()
                continue
            if item is _MCP_DONE:
                self.complete = True
                return
            if isinstance(item, tuple):         # (event id, message): a resumable stream's
                event_id, item = item
                yield (b"id: %d\nevent: message\ndata: " % event_id) + dumps(item).encode() \
                    + b"\n\n"
            else:
                yield b"event: message\ndata: " + dumps(item).encode() + b"\n\n"
            idle_since = time.monotonic()


class _McpSession:
    """A 2025-11-25 session over HTTP: its dispatcher, and the streams open for it.

    What its dispatcher sends on its own (progress, task status, our
    elicitation requests) goes on the stream most recently opened for the
    session: a request's, else the standalone GET stream.  A request (our
    question) sent while no stream is open waits for the next one opened: a
    task's question reaches a client that polls, sees ``input_required`` and
    calls tasks/result, as 2025-11-25 prescribes.

    The GET stream is resumable: what goes on it, or would while it is down,
    is numbered (its SSE ``id``) and the last ``_MCP_REPLAY_EVENTS`` kept
    (once a GET stream has been opened: before, no client can resume); a
    GET with ``Last-Event-ID`` replays what followed and takes the stream
    over.  A request's stream carries no ids: its client leaving cancels
    the request, so there is nothing to resume.
    """

    def __init__(self, mcp, principal):
        self.id = secrets.token_urlsafe(24)
        self.principal = principal
        self.version = None                 # the protocol version initialize negotiated
        self.streams = []                   # outboxes of the open request streams, oldest first
        self.standalone = None              # the GET stream's outbox
        self.pending = []                   # our requests sent while no stream was open
        self.log = []                       # (event id, message): the last ones kept
        self.resumable = False              # a GET stream was opened: it may come back
        self.last_id = 0                    # the GET stream's last event id given
        self.used = mcp.clock()             # when a request or a stream of it last ended
        self._clock = mcp.clock
        self._lock = threading.Lock()
        self.dispatcher = mcp.dispatcher(principal, self.send)

    def send(self, message):
        """Put *message* on the newest open stream of this session."""
        with self._lock:
            if self.streams:
                self.streams[-1].put(message)
            elif self.standalone is None and "id" in message:
                # Bounded by the tools waiting for an answer (each asks one at a time).
                self.pending.append(message)
            elif self.resumable:
                self._standalone_locked(message)
            else:                           # no GET stream ever: no one to resume it
                logger.debug("mcp session %s: no open stream for %s", self.id[:8],
                             message.get("method"))

    def _standalone_locked(self, message):
        """Number *message*, keep it, and put it on the GET stream if one is open."""
        self.last_id += 1
        self.log.append((self.last_id, message))
        if len(self.log) > _MCP_REPLAY_EVENTS:
            del self.log[0]                 # 128 pointers move: no deque (and its import) needed
        if self.standalone is not None:
            self.standalone.put((self.last_id, message))

    def opened(self, outbox, standalone=False, after=None):
        """Register a stream's *outbox*; the GET stream's resumes after event *after*.

        Raises:
            InvalidRequest: a second GET stream without ``Last-Event-ID``, or
                one resuming after an id whose successors are no longer kept.
        """
        with self._lock:
            pending, self.pending = self.pending, []
            if not standalone:
                self.streams.append(outbox)
                for message in pending:
                    outbox.put(message)
                return
            if after is None and self.standalone is not None:
                self.pending = pending
                raise InvalidRequest("this session has its GET stream open already")
            first = self.log[0][0] if self.log else self.last_id + 1
            if after is not None and not first - 1 <= after <= self.last_id:
                self.pending = pending
                raise InvalidRequest(f"Last-Event-ID {after}: the events after it are not "
                                     "kept; open the GET stream without it (and poll tasks/get)")
            if self.standalone is not None:     # the resumed stream takes over
                self.standalone.put(_MCP_DONE)
            self.standalone, self.resumable = outbox, True
            for event_id, message in self.log:
                if after is not None and event_id > after:
                    outbox.put((event_id, message))
            for message in pending:
                self._standalone_locked(message)

    def closed(self, outbox):
        with self._lock:
            if self.standalone is outbox:
                self.standalone = None
            elif outbox in self.streams:
                self.streams.remove(outbox)
            self.used = self._clock()       # idle from now, if nothing else is open

    @property
    def busy(self):
        """True while a stream of the session is open."""
        with self._lock:
            return bool(self.streams) or self.standalone is not None


class McpHttp:
    """MCP over Streamable HTTP at ``/mcp``: both eras, over the one sans-IO core.

    What a message means and what answers it is McpDispatcher's business,
    as on stdio; this class checks what HTTP adds (``Accept``, the headers
    2026-07-28 requires to mirror the body, sessions), and frames the
    answers: JSON, or an SSE stream scoped to the request when its work
    waits and may speak first (2026-07-28: a ``tools/call`` carrying a
    ``progressToken``, and ``subscriptions/listen``; 2025-11-25: any request
    whose work waits, since the tool may ask its user).  An LMSPApp given
    one (``mcp=``) routes ``/mcp`` here behind its own guards.

    Tools: ``add_tool``/``tool`` as on McpServer, or *tools*, another
    server's registry (``McpServer.tools``), shared: one set of tools on
    stdio and HTTP.  A Runner runs the tasks with ``run_task`` as the
    handler of kind ``mcp.tools/call``; set ``owner`` to its process_id.
    The other options are McpDispatcher's.

    Example::

        mcp = McpHttp(store)
        add_demo_tools(mcp)
        app = LMSPApp(store, DemoBackend(), mcp=mcp)
        runner = Runner(store, {MCP_TASK_KIND: mcp.run_task, ...})
    """

    def __init__(self, store, *, tools=None, max_sessions=DEFAULT_MCP_MAX_SESSIONS,
                 session_idle_s=DEFAULT_MCP_SESSION_IDLE_S, clock=time.monotonic, **options):
        self.store = store
        self.options = options
        self.tools = tools if tools is not None else {}
        self.max_sessions = max_sessions
        self.session_idle_s = session_idle_s    # an idle session ends after this long
        self.clock = clock                  # seconds, for idleness only; tests pass a fake
        self.owner = None                   # the Runner's process_id, recorded on each task
        self.app = None                     # the LMSPApp serving us (streams, stopping)
        self.sessions = {}                  # id -> _McpSession, least recently used first
        # The sessions again, by the id their dispatcher writes into each task's
        # meta ("session"): a task's run and its changes find their session by it.
        # (Not the Mcp-Session-Id, which is a credential and stays out of the store.)
        self._by_task_meta = {}
        self._lock = threading.Lock()
        self._registry = self.dispatcher(None, lambda message: None)

    def dispatcher(self, principal, send):
        """Return a new McpDispatcher over this server's tools, for *principal*."""
        dispatcher = McpDispatcher(self.store, send=send, principal=principal,
                                   tools=self.tools, **self.options)
        dispatcher.owner = self.owner
        return dispatcher

    def add_tool(self, name, handler, **options):
        """Register a tool (``McpDispatcher.add_tool``); see ``McpTool`` for its contract."""
        return self._registry.add_tool(name, handler, **options)

    def tool(self, name=None, **options):
        """Decorator form of ``add_tool``."""
        return self._registry.tool(name, **options)

    def run_task(self, task_ctx, payload):
        """Runner handler for kind ``mcp.tools/call``: run the tool for the task's session."""
        session = self._by_task_meta.get(task_ctx.task.meta.get("session"))
        dispatcher = session.dispatcher if session is not None else self._registry
        return dispatcher.run_task(task_ctx, payload)

    def on_change(self, task, change):
        """Store listener: a 2025-11-25 session hears about its tasks (``McpTaskNotices``)."""
        session = self._by_task_meta.get(task.meta.get("session")) \
            if task.kind == MCP_TASK_KIND else None
        if session is not None:
            session.dispatcher.on_change(task, change)

    def close(self):
        """End every session: their waits give up."""
        with self._lock:
            sessions, self.sessions, self._by_task_meta = list(self.sessions.values()), {}, {}
        for session in sessions:
            session.dispatcher.close()

    def _end_locked(self, session):
        """Forget *session* (its id then gets 404) and end its waits; holding ``_lock``."""
        self.sessions.pop(session.id, None)
        self._by_task_meta.pop(session.dispatcher._session, None)
        session.dispatcher.close()

    def _expired(self, session, now):
        return not session.busy and now - session.used >= self.session_idle_s

    @staticmethod
    def error_reply(msg_id, exc):
        """The Reply for *exc* refused before any method ran: its HTTP status, a JSON-RPC error."""
        reply = LMSPApp.problem_reply(exc)  # its status and headers (Allow, WWW-Authenticate)
        return Reply(reply.status, _error_message(msg_id, exc), reply.headers)

    # -- the HTTP methods (LMSPApp routes /mcp here after its guards) --

    def post(self, request):
        """POST /mcp: one JSON-RPC message (never a batch)."""
        headers, principal = request["headers"], request["principal"]
        if not _mcp_accepts(headers):
            raise NotAcceptable("Accept must list both application/json and text/event-stream")
        body = request["read_body"]()       # PayloadTooLarge past --max-body
        try:
            message = _json_body(body, headers.get("Content-Type"))
        except InvalidParams as exc:
            raise ParseError(f"parse error: {exc}") from None
        kind = _message_kind(message)       # InvalidRequest: a batch, not JSON-RPC 2.0
        try:
            return self._message(message, kind, headers, principal, request["client_gone"])
        except TaskStoreError as exc:       # refused here: the answer names the request's id
            return self.error_reply(message.get("id") if kind == "request" else None, exc)

    def _message(self, message, kind, headers, principal, client_gone):
        session_id = headers.get(MCP_SESSION_HEADER)
        if session_id is not None:
            return self._in_session(self._session(session_id, principal, headers), message,
                                    kind, client_gone)
        if kind == "response":
            raise InvalidRequest("a response is accepted only in a 2025-11-25 session "
                                 f"(with its {MCP_SESSION_HEADER}): this server asked nothing")
        if _enveloped(message):
            self._check_headers(message, headers)
            if kind == "notification":      # nothing to answer; cancel by closing a stream
                return Reply(202, content_type=None)
            outbox = queue.SimpleQueue()    # what the dispatcher sends: this request's
            dispatcher = self.dispatcher(principal, outbox.put)
            meta = message["params"]["_meta"]
            sse = message["method"] == "subscriptions/listen" or (
                message["method"] == "tools/call" and (meta.get("progressToken") is not None
                                                       or meta.get(META_LOG_LEVEL) is not None))
            return self._answer(dispatcher, dispatcher.receive(message), outbox, sse, _MODERN,
                                client_gone=client_gone)
        if kind == "request" and message["method"] == "initialize":
            return self._initialize(message, principal)
        # What a 2026-07-28 server answers a request without its envelope (a
        # 2025-11-25 client that probes falls back to initialize on it).
        raise InvalidParams(f"params._meta[{META_PROTOCOL_VERSION!r}] is required (MCP "
                            f"{MCP_MODERN_VERSION}); or send initialize first (MCP 2025-11-25), "
                            f"then its {MCP_SESSION_HEADER}", param="_meta")

    def get(self, request):
        """GET /mcp: a 2025-11-25 session's standalone SSE stream; 405 without a session."""
        session = self._session_of(request)
        header = request["headers"].get("Last-Event-ID")
        after = None
        if header is not None:
            if not re.fullmatch(r"[0-9]{1,18}", header.strip()):
                raise InvalidRequest(f"Last-Event-ID {_echo(header)} is not an event id of "
                                     "this session's GET stream")
            after = int(header.strip())
        outbox = queue.SimpleQueue()
        session.opened(outbox, standalone=True, after=after)
        try:
            return self._stream(outbox, lambda: None, session.closed)
        except ServiceUnavailable:
            session.closed(outbox)
            raise

    def delete(self, request):
        """DELETE /mcp: end a 2025-11-25 session; 405 without one."""
        session = self._session_of(request)
        with self._lock:
            self._end_locked(session)
        return Reply(204, content_type=None)

    # -- framing --

    def _session_of(self, request):
        session_id = request["headers"].get(MCP_SESSION_HEADER)
        if session_id is None:
            raise MethodNotAllowed(request["method"], ["POST"])
        return self._session(session_id, request["principal"], request["headers"])

    def _session(self, session_id, principal, headers):
        """The live session *session_id* of *principal*, now its most recently used.

        Raises:
            SessionNotFound: unknown, another principal's, ended, or idle too long.
            InvalidRequest: an ``MCP-Protocol-Version`` other than the one
                initialize negotiated (HTTP 400).  Without the header the
                session's version is assumed: the transport lets a client that
                predates the header leave it out.
        """
        with self._lock:
            session = self.sessions.get(session_id.strip())
            if session is not None and self._expired(session, self.clock()):
                self._end_locked(session)
                session = None
            # Another principal's session is as unknown as one never opened.
            if session is None or session.principal != principal:
                raise SessionNotFound(f"no session {_echo(session_id)}: it ended, or this "
                                      "server never opened it; send initialize again")
            self.sessions[session.id] = self.sessions.pop(session.id)   # now the most recent
            session.used = self.clock()
        versions = headers.get_all("MCP-Protocol-Version") or []
        if any(v.strip(" \t") != session.version for v in versions):
            raise InvalidRequest(f"this session speaks MCP {session.version}: its requests "
                                 f"must send that MCP-Protocol-Version, or none")
        return session

    def _initialize(self, message, principal):
        session = _McpSession(self, principal)
        [answer] = session.dispatcher.receive(message)     # initialize answers on the reader
        if "result" not in answer:
            return Reply(_mcp_status(answer, _LEGACY), answer)
        session.version = answer["result"]["protocolVersion"]
        with self._lock:
            now = self.clock()
            # Sessions idle too long end here too (least recently used first),
            # so that abandoned ones do not wait for their id to come back.
            for old in [s for s in self.sessions.values() if self._expired(s, now)]:
                self._end_locked(old)
            if len(self.sessions) >= self.max_sessions:
                idle = next((s for s in self.sessions.values() if not s.busy), None)
                if idle is None:
                    raise ServiceUnavailable(f"too many MCP sessions (at most "
                                             f"{self.max_sessions}); try again shortly")
                self._end_locked(idle)
            self.sessions[session.id] = session
            self._by_task_meta[session.dispatcher._session] = session
        return Reply(200, answer, [(MCP_SESSION_HEADER, session.id)])

    def _in_session(self, session, message, kind, client_gone):
        if _enveloped(message):
            raise InvalidRequest(f"a request of a 2025-11-25 session must not carry the MCP "
                                 f"{MCP_MODERN_VERSION} envelope")
        items = session.dispatcher.receive(message)
        if kind != "request":               # a notification, or an answer to our request
            for item in items:
                if isinstance(item, McpWork):
                    item.run()
            return Reply(202, content_type=None)
        return self._answer(session.dispatcher, items, queue.SimpleQueue(), True, _LEGACY, session,
                            client_gone=client_gone)

    def _answer(self, dispatcher, items, outbox, sse, era, session=None, client_gone=None):
        """Frame what ``McpDispatcher.receive`` returned for one request of *era*.

        Work that waits runs on a thread of its own while this one waits for
        its first message: the answer goes out as JSON (its status the HTTP
        status); anything before it opens an SSE stream when *sse* allows
        one (else it has no place in the answer and is dropped).  *outbox*
        receives what the work sends.  The client
        leaving (*client_gone*) cancels the request: a modern dispatcher
        serves one request and is closed; in a session only that request is.
        """
        for item in items:
            if not isinstance(item, McpWork):
                return Reply(_mcp_status(item, era), item)
            if item.kind != _WAITING:       # a write: here, on the connection's thread
                answers = item.run()
                return Reply(_mcp_status(answers[0], era), answers[0]) if answers \
                    else Reply(202, content_type=None)
            if session is None:
                cancel, on_close = dispatcher.close, None
            else:
                cancel = functools.partial(dispatcher.calls.cancel_inline, item.msg_id)
                on_close = session.closed
                session.opened(outbox)      # what the session sends goes on this stream

            def run(work=item):
                try:
                    for answer in work.run():
                        outbox.put(answer)
                finally:
                    outbox.put(_MCP_DONE)
            threading.Thread(target=run, name="taskstore-mcp-http", daemon=True).start()
            try:
                return self._wait(outbox, era, sse, cancel, on_close, client_gone)
            except BaseException:
                if on_close is not None:
                    on_close(outbox)
                raise
        return Reply(202, content_type=None)

    def _wait(self, outbox, era, sse, cancel, on_close, client_gone):
        while True:
            try:
                item = outbox.get(timeout=_MCP_WAKE_S)
            except queue.Empty:
                if self.app.stopping.is_set() or client_gone():
                    cancel()                # the client left: its request is cancelled
                    raise ConnectionAbortedError("the client left before the answer") from None
                continue
            if item is _MCP_DONE:           # cancelled: nobody waits for an answer
                raise ConnectionAbortedError("the request was cancelled")
            if "method" not in item:
                if on_close is not None:
                    on_close(outbox)
                return Reply(_mcp_status(item, era), item)
            if sse:
                return self._stream(outbox, cancel, on_close, first=item)

    def _stream(self, outbox, cancel, on_close, first=None):
        app = self.app
        if not app._streams.acquire(blocking=False):
            cancel()
            raise ServiceUnavailable(f"too many event streams (at most {app.max_streams})")
        return Reply(200, headers=[("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no")],
                     stream=McpStream(app, outbox, cancel, on_close, first),
                     content_type="text/event-stream")

    def _check_headers(self, message, headers):
        """2026-07-28: the headers that mirror the body must be there and agree with it.

        Raises:
            HeaderMismatch: -32020 (HTTP 400), naming the header.
        """
        meta = message["params"]["_meta"]
        params = message["params"]

        def one(name):
            values = headers.get_all(name) or []
            if len(values) > 1:
                raise HeaderMismatch(f"{name} is sent more than once")
            return values[0] if values else None
        version = one("MCP-Protocol-Version")
        if version is None or version.strip(" \t") != meta[META_PROTOCOL_VERSION]:
            raise HeaderMismatch("the MCP-Protocol-Version header must be sent and equal "
                                 f"params._meta[{META_PROTOCOL_VERSION!r}]")
        method = one("Mcp-Method")
        if method is None or method.strip(" \t") != message["method"]:
            raise HeaderMismatch("the Mcp-Method header must be sent and equal the method")
        field = _MCP_NAME_PARAM.get(message["method"])
        if field is not None and isinstance(params.get(field), str):
            name = one("Mcp-Name")
            if name is None or _mcp_header_value(name) != params[field]:
                raise HeaderMismatch(f"the Mcp-Name header must be sent and equal "
                                     f"params.{field}")
        if message["method"] == "tools/call":
            self._check_param_headers(params, headers, one)

    def _check_param_headers(self, params, headers, one):
        """A tool's arguments marked ``x-mcp-header`` must be mirrored in ``Mcp-Param-*``."""
        tool = self.tools.get(params.get("name"))
        arguments = params.get("arguments")
        if tool is None or not isinstance(arguments, dict):
            return                          # the dispatcher says what is wrong
        for key, schema in (tool.input_schema.get("properties") or {}).items():
            header = schema.get("x-mcp-header") if isinstance(schema, dict) else None
            if not isinstance(header, str) or arguments.get(key) is None:
                continue
            value = arguments[key]
            expected = dumps(value) if isinstance(value, bool) else str(value)
            got = one(f"Mcp-Param-{header}")
            if got is None or _mcp_header_value(got) != expected:
                raise HeaderMismatch(f"the Mcp-Param-{header} header must be sent and equal "
                                     f"arguments.{key}")


# -- Transport: http.server --

class _DeadlineReader(io.RawIOBase):
    """Socket reads that fail once the request's deadline has passed.

    A per-recv timeout alone lets a client that trickles one byte at a time
    hold a thread for ever; this bounds the whole request (--request-timeout).
    The request's clock starts at its first read from the socket, when the
    socket's timeout is the whole --request-timeout (see _dispatch): that
    read needs no settimeout() (a syscall), so a request that arrives in one
    piece costs none.  Later reads of the same request get what remains.
    """

    def __init__(self, handler):
        self.handler = handler

    def readable(self):
        return True

    def readinto(self, buffer):
        handler = self.handler
        if handler.deadline is None:
            handler.deadline = time.monotonic() + handler.server.app.request_timeout
        else:
            remaining = handler.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("request timeout")
            handler.connection.settimeout(remaining)
        return handler.connection.recv_into(buffer)


class LMSPRequestHandler(http.server.BaseHTTPRequestHandler):
    """Moves bytes between a socket and LMSPApp.handle(); HTTP/1.1 keep-alive."""

    protocol_version = "HTTP/1.1"
    server_version = f"taskstore/{__version__}"
    deadline = None             # the current request's, from its first read (_DeadlineReader)

    def setup(self):
        super().setup()
        # Without this, a keep-alive answer written as head + body waits ~40 ms
        # for the client's delayed ACK (Nagle); SSE frames would lag the same way.
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connection.settimeout(self.server.app.request_timeout)
        self.rfile.close()      # its socket reference would keep the connection open
        self.rfile = io.BufferedReader(_DeadlineReader(self))

    def handle_one_request(self):
        self.deadline = None
        self._body_read = False
        super().handle_one_request()

    def version_string(self):
        """The Server header: name and version (http.server adds " Python/x.y")."""
        return self.server_version

    def log_message(self, format, *args):   # noqa: A002 -- http.server's signature
        # The request line only: headers (and so tokens) are never logged.
        # Checked first: formatting it for a disabled level costs every request.
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s - %s", self.address_string(), format % args)

    def parse_request(self):
        """http.server's parsing, minus HTTP/0.9: its answers have no status line at all."""
        if not super().parse_request():
            return False
        if self.request_version == "HTTP/0.9":
            self.send_error(400, "HTTP/0.9 requests are not supported; send HTTP/1.1")
            return False
        return True

    def send_error(self, code, message=None, explain=None):
        """Answer http.server's own errors (bad request line, 501) as problem objects."""
        # A request line too broken to name a version leaves http.server's
        # default, HTTP/0.9, which would send the body without a status line.
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.0"
        status = code if code in (400, 501) else 400
        problem = problem_object(status, "not_implemented" if status == 501 else "invalid_request",
                                 message or "bad request")
        self.close_connection = True
        self._send(Reply(status, problem, content_type="application/problem+json"))

    def _read_body(self):
        self._body_read = True
        codings = self.headers.get_all("Transfer-Encoding")
        if codings:
            keep, self.close_connection = self.close_connection, True   # unless all is read
            codings = [c.strip().lower() for c in ",".join(codings).split(",")]
            if codings != ["chunked"] or self.request_version == "HTTP/1.0":
                raise InvalidParams("Transfer-Encoding must be chunked alone, on HTTP/1.1",
                                    param="Transfer-Encoding")
            if "Content-Length" in self.headers:
                # RFC 9112 6.1: both framings at once is how requests get smuggled.
                raise InvalidParams("send Content-Length or Transfer-Encoding: chunked, "
                                    "not both", param="Transfer-Encoding")
            body = self._read_chunked(self.server.app.max_body)
            self.close_connection = keep
            return body
        lengths = self.headers.get_all("Content-Length") or ["0"]
        length = lengths[0].strip()
        if len({v.strip() for v in lengths}) > 1 or not re.fullmatch(r"[0-9]{1,15}", length):
            # RFC 9112 6.3: differing lengths make the framing unknowable.
            self.close_connection = True
            raise InvalidParams("Content-Length must be one non-negative integer",
                                param="Content-Length")
        if int(length) > self.server.app.max_body:
            self.close_connection = True     # the body stays unread: end the connection
            raise PayloadTooLarge(f"the body has {length} bytes; at most "
                                  f"{self.server.app.max_body} are accepted")
        body = self.rfile.read(int(length))
        if len(body) != int(length):
            raise ConnectionResetError("client closed the connection inside the body")
        return body

    def _read_chunked(self, limit):
        """Decode a chunked body (RFC 9112 7.1), counting it against *limit* as chunks arrive."""
        body = bytearray()
        while True:
            size = self._chunk_line().partition(b";")[0].strip(b" \t")
            if not re.fullmatch(rb"[0-9A-Fa-f]{1,16}", size):
                raise InvalidParams("the chunked body is malformed: a chunk size is not hex",
                                    param="Transfer-Encoding")
            size = int(size, 16)
            if size == 0:
                break
            if len(body) + size > limit:     # refused before the chunk is read
                raise PayloadTooLarge(f"the body has more than {limit} bytes; at most "
                                      f"{limit} are accepted")
            data = self.rfile.read(size + 2)
            if len(data) != size + 2:
                raise ConnectionResetError("client closed the connection inside the body")
            if data[size:] != b"\r\n":
                raise InvalidParams("the chunked body is malformed: a chunk is longer than "
                                    "its size", param="Transfer-Encoding")
            body += data[:size]
        for _ in range(_MAX_TRAILERS + 1):   # trailer fields are read and ignored
            if self._chunk_line() == b"":
                return bytes(body)
        raise InvalidParams("the chunked body is malformed: too many trailer fields",
                            param="Transfer-Encoding")

    def _chunk_line(self):
        line = self.rfile.readline(_CHUNK_LINE_LIMIT + 1)
        if line.endswith(b"\r\n"):
            return line[:-2]
        if len(line) > _CHUNK_LINE_LIMIT or line.endswith(b"\n"):
            raise InvalidParams("the chunked body is malformed: a line is too long or does "
                                "not end with CRLF", param="Transfer-Encoding")
        raise ConnectionResetError("client closed the connection inside the body")

    def _dispatch(self):
        reply = self.server.app.handle(self.command, self.path, self.headers, self._read_body,
                                       self._client_gone)
        has_body = self.headers.get("Transfer-Encoding") or self.headers.get(
            "Content-Length", "0").strip() not in ("", "0")
        if has_body and not self._body_read:
            self.close_connection = True     # an unread body would be read as a request
        # Writes get the full timeout, not the rest of the request deadline;
        # that is also what the next request's first read expects.  Unless a
        # read shortened it, the socket has it already (and a syscall is saved).
        timeout = self.server.app.request_timeout
        if self.connection.gettimeout() != timeout:
            self.connection.settimeout(timeout)
        self._send(reply)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _dispatch

    def _send(self, reply):
        self.send_response(reply.status)
        if reply.content_type is not None:
            self.send_header("Content-Type", reply.content_type)
        for name, value in reply.headers:
            self.send_header(name, value)
        if reply.stream is not None:
            self._send_stream(reply.stream)
            return
        if reply.status != 204:             # RFC 9110 8.6: a 204 has no Content-Length
            self.send_header("Content-Length", str(len(reply.body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        # Headers and body leave in one write (one segment on the wire for a
        # small answer) instead of end_headers()'s flush plus a second write.
        self._headers_buffer.append(b"\r\n")
        if self.command != "HEAD":
            self._headers_buffer.append(reply.body)
        self.flush_headers()

    def _send_stream(self, stream):
        # HTTP/1.1: each frame is a chunk, and the terminating chunk follows the
        # final event only, so a stream cut short (a crash, a shutdown, pruned
        # events) is an incomplete body to any HTTP client.  HTTP/1.0 has no
        # chunks: closing the connection delimits the stream there.
        chunked = self.request_version != "HTTP/1.0"
        self.close_connection = True
        try:
            if chunked:
                self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.flush()
            stream.client_gone = self._client_gone
            for frame in stream:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(frame), frame) if chunked else frame)
                self.wfile.flush()
            if chunked and stream.complete:
                self.wfile.write(b"0\r\n\r\n")
        except OSError:
            # The client went away.  The task runs on (a stream only watches it),
            # and the client may come back with Last-Event-ID.
            pass
        finally:
            stream.close()


    def _client_gone(self):
        # An idle stream writes nothing for a while; a readable socket with
        # nothing to read means the client closed, so its slot comes back now.
        try:
            readable = select.select([self.connection], [], [], 0)[0]
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True


class LMSPServer(http.server.ThreadingHTTPServer):
    """A threaded HTTP server whose handler answers LMSPApp's routes.

    One thread per connection, at most *max_connections* at once; a
    connection past that gets a 503 from the accepting thread and is closed.
    Bound to a loopback address, it has the app refuse a ``Host`` that is not
    a loopback name or address.
    """

    daemon_threads = True
    block_on_close = False

    def __init__(self, app, host=DEFAULT_HTTP_HOST, port=0,
                 max_connections=DEFAULT_MAX_CONNECTIONS):
        self.app, self.max_connections = app, max_connections
        # The listen backlog holds a burst as large as the cap: a smaller one
        # (socketserver's 5, or 128) overflows while the accepting thread is
        # slow, and the kernel then drops or resets connections the cap would
        # have served (seen as resets under load with 500 clients at once).
        self.request_queue_size = max(128, max_connections)
        self.connections = 0            # open connections, each with its thread
        self._connections_lock = threading.Lock()
        app.loopback_only = _is_loopback(host)
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), LMSPRequestHandler)

    def process_request(self, request, client_address):
        """Serve the connection on a thread of its own, or refuse it past the cap."""
        with self._connections_lock:
            full = self.connections >= self.max_connections
            if not full:
                self.connections += 1
        if full:
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._connection_ended()     # no thread started: the slot is free again
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connection_ended()

    def _connection_ended(self):
        with self._connections_lock:
            self.connections -= 1

    def _refuse(self, sock):
        # On the accepting thread, so it must never block: one non-blocking
        # send into the new socket's empty buffer.  Whatever of the request has
        # arrived is read and dropped first, so the close is a FIN: closing
        # with unread bytes would send a reset, which can destroy the answer.
        status, problem = to_problem(ServiceUnavailable(
            f"too many connections (at most {self.max_connections}); try again shortly"))
        body = dumps(problem).encode()
        head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
                f"Server: {LMSPRequestHandler.server_version}\r\n"
                f"Date: {email.utils.formatdate(usegmt=True)}\r\n"
                f"Content-Type: application/problem+json\r\n"
                f"Retry-After: {RETRY_AFTER_S}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            for _ in range(16):
                if not sock.recv(65536):
                    break
        with contextlib.suppress(OSError):
            sock.send(head.encode() + body)
        self.shutdown_request(sock)

    def handle_error(self, request, client_address):
        """Log a failed connection: a client going away is routine, anything else a bug."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            logger.debug("connection from %s ended: %r", client_address[0], exc)
        else:
            logger.exception("error while serving %s", client_address[0])

    @property
    def url(self):
        """The base URL the server accepts connections on (the real port)."""
        host, port = self.server_address[:2]
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def _is_loopback(host):
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_backend(name, *, demo_delay=DEFAULT_DEMO_DELAY_S, url=DEFAULT_BACKEND_URL,
                 api_key=None):
    """Return the backend the ``http`` command's ``--backend`` names."""
    if name == "openai":
        return OpenAIBackend(url, api_key=api_key)
    return DemoBackend(demo_delay)


# =============================================================================
# 11. PostgreSQL engine
# =============================================================================
# Rules:
# - The second engine, for several processes on several hosts sharing one
#   database: ``Engine`` (section 6) implemented again, ``on_remote`` and
#   ``shared`` included, so the store (section 7) runs on it unchanged.
#   psycopg 3 is imported only here, when a ``postgresql://`` URL is given.
# - The SQL both engines run is section 6's ``_SqlEngine``, in this
#   engine's ``_Dialect`` (``%s`` placeholders, ``ON CONFLICT`` upserts,
#   the server's clock, ``SKIP LOCKED`` batches), and its ``SCHEMA`` in
#   ``_PG_WORDS`` (64-bit integers, byte-order text).  What PostgreSQL does
#   besides is here: rows read inside a write transaction are locked (``FOR
#   UPDATE``), so a concurrent writer in another process waits instead of
#   reusing an event seq; claims and retention batches skip rows another
#   process holds (``SKIP LOCKED``); an idempotency key is decided under a
#   transaction-scoped advisory lock; every write notes what it changed.
# - A write transaction sends nothing before it has a statement to run:
#   ``BEGIN`` goes out just before its first statement, and its creates are
#   held and sent as one statement (every row and its ``created`` event),
#   before its next statement or at the commit.  A transaction of creates
#   alone (a create, a group commit's batch of them) is that one statement,
#   a transaction of its own on the autocommit connection: one round trip,
#   committed as durably as any (``_PgConnection``).
# - Deadlocks: while it holds a key's lock a create waits for no row (a
#   replay reads its task after the write).  Rows locked in opposite orders
#   by two processes' batches cannot be ruled out (the group commit batches
#   unrelated callers): the transaction the server ends to break such a
#   deadlock, never committed, is run again by ``write``, alone and after
#   every transaction that holds task rows (``_run_again``): run again at
#   once, it deadlocked again with the survivor (1 run in 3 under load), and
#   after four such runs its caller got the error.
# - Time that decides ownership is the server's: heartbeats are written with
#   ``clock_timestamp()`` and a registration's age is computed by the server,
#   so hosts' clocks do not matter.  There is no pid check across hosts.
# - Notifications go out after the commit, never inside it: a transaction
#   that sent one holds PostgreSQL's notify queue lock from its pre-commit
#   until its commit record is flushed, so such commits cannot share a WAL
#   flush and concurrent writers commit one flush at a time.  A committed
#   write hands its ids to the notifier (``_PgNotifier``, a thread with an
#   autocommit connection of its own), which sends the ids of every commit
#   since its last send in one statement: a ``NOTIFY`` per kind of change
#   (more when the ids would not fit a payload).  That transaction writes no
#   WAL, so it waits for no flush and holds up no data commit.  A commit
#   after a quiet spell is sent at once; under a stream of commits sends are
#   ``PG_NOTIFY_GAP_S`` apart, so a busy process costs itself, the server and
#   every listening process a few sends and wake-ups a gap, not one a commit
#   (another process then learns of a change up to two gaps later, the
#   sender's and its listener's rest: half the default poll_interval).
# - A daemon thread listens on a connection of its own and hands each burst
#   of notifications to the store's ``on_remote`` callback, merged: one call
#   per kind, so a busy database costs a few lock takes per burst, not one
#   per commit.  After a delivery it rests ``PG_NOTIFY_GAP_S`` before it
#   reads again: however many processes send, a listener wakes at most once
#   a gap (a notification after a quiet spell is delivered at once).
# - A notification can be lost: a crash between a commit and its notify, a
#   dropped notifier connection.  The store's ``poll_interval`` re-read is the
#   safety net that bounds how late a waiter then learns of the change.
# - A psycopg error becomes StoreUnavailable and discards a broken connection;
#   the next use reconnects.  ``synchronous`` and ``max_bytes`` mean nothing
#   here: durability is the server's ``synchronous_commit``.

PG_INSTALL = 'pip install "taskstore[postgres]"'
PG_CHANNEL = "taskstore"               # the NOTIFY channel of every store on a database
PG_NOTIFY_BYTES = 7000                 # under NOTIFY's 8,000-byte payload limit
PG_LISTEN_RETRY_S = 1.0                # between attempts to reconnect the listener
# How many more times a write runs when the server ended its transaction to
# break a deadlock (or for a serialization failure): see PostgresEngine.write.
PG_WRITE_RETRIES = 3
# The SQLSTATEs of such an ending: deadlock_detected, serialization_failure.
_PG_RUN_AGAIN = frozenset(("40P01", "40001"))
# Under a stream of commits the notifier sends at most once per this gap,
# everything committed meanwhile together (see _PgNotifier); and after a
# delivery the listener rests as long before it reads again (_PgListener).
# bench/peers.py workers_4 (4 processes, 2 cores), 2 executions of 3 runs
# each: at 10 ms the workers spent 1,500-1,900 us of CPU a task and the
# server 1,455-1,790; at 25 ms 1,090-1,100 and 1,180-1,190 (50 ms: about
# the same again).  A process whose commits come faster than the gap sends
# once a gap, and each send wakes every other process's listener.
PG_NOTIFY_GAP_S = 0.025
# How PostgreSQL's recovery_view opens its one snapshot (a plain BEGIN is not one).
_PG_SNAPSHOT_BEGIN = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"
_PG_SCHEMA_LOCK = 0x7461736b           # advisory lock key of schema creation ("task")
# The server's clock in epoch milliseconds: ownership is judged in database time.
_PG_NOW_MS = "(extract(epoch from clock_timestamp()) * 1000)::bigint"


# PostgreSQL's words for the schema (section 6).  COLLATE "C" makes ORDER BY
# id the byte order SQLite uses, so ids sort by creation time whatever the
# database's locale.  A table here is a heap whatever its key: no WITHOUT ROWID.
_PG_WORDS = _SchemaWords(text='TEXT COLLATE "C"', integer="BIGINT", real="DOUBLE PRECISION",
                         without_rowid="")


# _purge_at (section 5) in SQL, for the set-based moves section 6 writes.  Made
# anew at every open, so the formula is always this version's constants.
_PG_PURGE_AT = f"""CREATE OR REPLACE FUNCTION taskstore_purge_at(now BIGINT, created_at BIGINT,
        ttl_ms BIGINT, retention_ms BIGINT) RETURNS BIGINT IMMUTABLE LANGUAGE SQL AS $$
    SELECT CASE WHEN ttl_ms IS NOT NULL THEN
               CASE WHEN now < created_at + ttl_ms THEN created_at + ttl_ms
                    ELSE now + {LATE_FINISH_GRACE_MS} END
           WHEN retention_ms IS NOT NULL THEN now + retention_ms END $$"""

# PG_MIGRATIONS[n] takes a database from version n-1 to n, like MIGRATIONS:
# the same schema, after the table that holds the version (SQLite's is a pragma).
PG_MIGRATIONS = _schema_ddl(_PG_WORDS)
PG_MIGRATIONS[1] = ("CREATE TABLE taskstore_schema (version BIGINT NOT NULL)",
                    "INSERT INTO taskstore_schema VALUES (0)", *PG_MIGRATIONS[1])


def _redact_url(url):
    """*url* without its password, for messages."""
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)


def _refuse_nul(params):
    # PostgreSQL's text cannot hold NUL, which SQLite's can: refuse the input
    # (JSON columns never have one, dumps() escapes it).
    for value in params:
        if isinstance(value, str) and "\x00" in value:
            raise InvalidParams("text with a NUL character cannot be stored on PostgreSQL")


def _nul_free(text):
    """*text* with NUL written ``\\0`` (and ``\\`` doubled): a lookup key PostgreSQL can hold."""
    return text.replace("\\", "\\\\").replace("\x00", "\\0")


# A write transaction's creates, held back (``_PgConnection.hold_creates``) and
# sent as this one statement: every task row and the ``created`` events the
# log stores (none for plain tasks: schema 5), each column one array (fixed
# text, so psycopg prepares it once whatever the count).
# A plain row (13 columns) is sent with the defaults of the other four (run_at
# NULL, priority 0, retry NULL, attempt 1), so plain and full rows share it.
_PG_CREATE_COLUMNS = ("id", "kind", "status", "payload", "status_message", "principal", "policy",
                      "ttl_ms", "retention_ms", "created_at", "updated_at", "meta", "owner",
                      "run_at", "priority", "retry", "attempt")
_PG_PLAIN_TAIL = (None, DEFAULT_PRIORITY, None, 1)
_PG_BIGINT_COLUMNS = frozenset(("ttl_ms", "retention_ms", "created_at", "updated_at", "run_at",
                                "priority", "attempt"))
_PG_INSERT_CREATES = (
    f"WITH t AS (INSERT INTO tasks ({', '.join(_PG_CREATE_COLUMNS)}) SELECT * FROM unnest("
    + ", ".join("%s::bigint[]" if c in _PG_BIGINT_COLUMNS else "%s::text[]"
                for c in _PG_CREATE_COLUMNS)
    + ")) INSERT INTO events (task_id, seq, type, data, created_at) "
    "SELECT e.id, 0, 'created', e.data, e.at "
    "FROM unnest(%s::text[], %s::text[], %s::bigint[]) AS e(id, data, at)")
# The same for one create, the commonest case, in plain values: twenty arrays
# cost psycopg 63 us to build and the server 40-60 us to unpack for one row,
# against 20 and 33 us for the values (per row at 8 rows the arrays cost 18
# and 10-13 us, and statements with n rows' values would each be prepared anew).
# A plain task's is the row alone (its created event is the row); any other's
# adds the event the log stores.
_PG_INSERT_TASK = (f"INSERT INTO tasks ({', '.join(_PG_CREATE_COLUMNS)}) "
                   f"VALUES ({', '.join(['%s'] * len(_PG_CREATE_COLUMNS))})")
_PG_INSERT_CREATE = (
    f"WITH t AS ({_PG_INSERT_TASK}) "
    "INSERT INTO events (task_id, seq, type, data, created_at) VALUES (%s, 0, 'created', %s, %s)")
# A move's compare-and-set ({move}: _move_statement's) and its event row in one
# statement (PostgresEngine.move_task).
_PG_LOGGED_MOVE = ("WITH moved AS ({move} RETURNING last_seq) "
                   "INSERT INTO events (task_id, seq, type, data, created_at) "
                   "SELECT %s, last_seq, 'status', %s, %s FROM moved")
# The same for move_unread's ({move} returns the row): the row comes back.
_PG_LOGGED_UNREAD_MOVE = ("WITH moved AS ({move}), logged AS ("
                          "INSERT INTO events (task_id, seq, type, data, created_at) "
                          "SELECT id, last_seq, 'status', %s, %s FROM moved) SELECT * FROM moved")


class _PgConnection:
    """A psycopg connection with the ``execute`` and ``executemany`` of sqlite3's connections.

    Statements are psycopg's (``%s`` placeholders), passed on as they are;
    parameters with a NUL are refused.  ``total_changes`` counts rows written, as
    sqlite3's does, for the engine's ``changes()``.  A transaction's
    ``BEGIN``, ``COMMIT`` and ``ROLLBACK`` (no parameters, no rows: half the
    statements of a claim or a move) go to libpq's plain exec, which costs
    the process a fraction of a psycopg cursor's execute; they return None
    and fail with psycopg's errors, as the others do.

    A write transaction (``begin``, then ``commit`` or ``rollback``) sends
    nothing until it has a statement to run: its ``BEGIN`` goes out just
    before its first statement, and the creates it is given
    (``hold_creates``) go out as one statement (``_PG_INSERT_CREATES``) just
    before the next statement or at the commit, in the order they came
    (``_PG_INSERT_CREATE`` when they are one row).  A
    transaction whose only write is those creates (a ``create``, or a group
    commit's batch of them) is that one statement without ``BEGIN`` and
    ``COMMIT``: on this autocommit connection a statement is a transaction
    of its own, committed (at the server's ``synchronous_commit``) before its
    result comes back.  One round trip instead of four for a lone create,
    and instead of 2n + 2 for a batch of n: 8 threads of one process
    enqueued 2,062-2,194 tasks/s before, 4,019-4,951 after (bench/peers.py,
    enqueue_8, medians of 3, alternating, load 4-10 on 2 CPUs).
    """

    # Any other text takes the usual path.
    _COMMANDS = {sql: sql.encode() for sql in ("BEGIN", "COMMIT", "ROLLBACK", _PG_SNAPSHOT_BEGIN)}

    def __init__(self, raw):
        self.raw = raw
        self.total_changes = 0
        from psycopg import errors, pq          # imported already: the engine connected
        self._command_ok = pq.ExecStatus.COMMAND_OK
        self._error_from_result = errors.error_from_result
        self._begin_held = False      # a write transaction is open; its BEGIN not sent yet
        self._creates = []            # (rows, events) of creates not sent yet

    def _command(self, command):
        result = self.raw.pgconn.exec_(command)    # the GIL is released while it waits
        if result.status != self._command_ok:
            raise self._error_from_result(result, self.raw.info.encoding)

    def execute(self, sql, params=()):
        if self._begin_held or self._creates:
            self._send_held()
        command = self._COMMANDS.get(sql)
        if command is not None:
            self._command(command)
            return None
        _refuse_nul(params)
        cursor = self.raw.execute(sql, params)
        if cursor.rowcount > 0 and not sql.lstrip().startswith("SELECT"):
            self.total_changes += cursor.rowcount
        return cursor

    def executemany(self, sql, rows):
        if self._begin_held or self._creates:
            self._send_held()
        rows = list(rows)
        for row in rows:
            _refuse_nul(row)
        with self.raw.cursor() as cursor:
            cursor.executemany(sql, rows)
        self.total_changes += len(rows)

    # -- a write transaction ---------------------------------------------------

    def begin(self):
        """Open a write transaction: its ``BEGIN`` is sent before its first statement."""
        self._begin_held = True

    def hold_creates(self, rows, events):
        """Insert task rows and their stored ``created`` events with the next statement.

        A NUL is refused here, so a create fails before it has written.
        Counted in ``total_changes`` at once: the body that gave them wrote.
        """
        for row in rows:
            _refuse_nul(row)
        for event in events:
            _refuse_nul(event)
        self._creates.append((rows, events))
        self.total_changes += len(rows) + len(events)

    def _send_held(self):
        if self._begin_held:
            self._begin_held = False
            self._command(b"BEGIN")
        if self._creates:
            self._insert_creates()

    def _insert_creates(self):
        creates, self._creates = self._creates, []
        rows = [row if len(row) == 17 else (*row, *_PG_PLAIN_TAIL)
                for batch, _ in creates for row in batch]
        events = [event for _, batch in creates for event in batch]
        if len(rows) == 1:
            if events:
                self.raw.execute(_PG_INSERT_CREATE, (*rows[0], *events[0]))
            else:
                self.raw.execute(_PG_INSERT_TASK, rows[0])
        else:
            # Without stored events, three empty arrays: zip would give none.
            event_columns = [list(column) for column in zip(*events)] or [[], [], []]
            self.raw.execute(_PG_INSERT_CREATES, [*map(list, zip(*rows)), *event_columns])

    def commit(self):
        """Commit the write transaction: what it holds goes out first (alone: without BEGIN)."""
        if self._begin_held:            # nothing sent: the held creates are the transaction
            self._begin_held = False
            if self._creates:
                self._insert_creates()
            return
        if self._creates:
            try:
                self._insert_creates()
            except BaseException:
                # Inside BEGIN a failed statement leaves the transaction open
                # (aborted): end it, or the next BEGIN would find it.
                if not self.broken:
                    with contextlib.suppress(Exception):
                        self._command(b"ROLLBACK")
                raise
        self._command(b"COMMIT")

    def rollback(self):
        """Roll the write transaction back: what it holds is dropped unsent."""
        self._creates = []
        if self._begin_held:
            self._begin_held = False
            return
        self._command(b"ROLLBACK")

    @property
    def broken(self):
        return self.raw.closed or self.raw.broken


class _PgConflict(StoreUnavailable):
    """The server ended the transaction to break a deadlock (or a serialization failure).

    Nothing of it was committed, so ``PostgresEngine.write`` runs its
    bodies again; only once that has failed ``PG_WRITE_RETRIES`` times does
    the caller get it, as the StoreUnavailable it is.
    """


class _PgTransaction:
    """``PostgresEngine.transaction()``: BEGIN; then COMMIT and hand the notes on, or ROLLBACK."""

    __slots__ = ("engine",)

    def __init__(self, engine):
        self.engine = engine

    def __enter__(self):
        engine = self.engine
        if engine.closed:
            raise StoreClosed()
        try:
            engine._usable_locked().begin()       # sent before its first statement
        except engine.psycopg.Error as exc:
            raise engine._unavailable(exc) from None
        engine._in_write = True
        engine._notes.clear()

    def __exit__(self, kind, exc, tb):
        engine = self.engine
        engine._in_write = False
        try:
            if kind is None:
                engine.conn.commit()
                if engine._notes:
                    engine._notifier.add(engine._notes)
            else:
                engine.conn.rollback()
        except engine.psycopg.Error as error:
            raise engine._unavailable(error) from None
        finally:
            engine._notes.clear()
        if kind is not None and issubclass(kind, engine.psycopg.Error):
            raise engine._unavailable(exc) from None
        return False


class _PgReads:
    """``PostgresEngine.reading()``: the lock, a live connection; StoreUnavailable for errors."""

    __slots__ = ("engine", "lock")

    def __init__(self, engine):
        self.engine = engine
        self.lock = engine.lock

    def __enter__(self):
        self.lock.acquire()
        try:
            if self.engine.closed:
                raise StoreClosed()
            self.engine._usable_locked()
        except BaseException:
            self.lock.release()
            raise
        return self.engine

    def __exit__(self, kind, exc, tb):
        self.lock.release()
        if kind is not None and issubclass(kind, self.engine.psycopg.Error):
            raise self.engine._unavailable(exc) from None
        return False


class _PgListener(threading.Thread):
    """The engine's ``LISTEN``: a connection of its own; each burst goes to the callback, merged.

    A payload is ``token kind id,id,``: a notification this engine sent
    itself (its token) is dropped, the store having woken its own waiters
    already.  What arrived together is delivered as one call per kind;
    after a delivery it rests ``PG_NOTIFY_GAP_S``, so what arrives
    meanwhile is delivered together at the end of the rest.
    When the connection drops, it reconnects and wakes everybody once
    (``callback("lost", ())``): they re-read what they wait for.
    """

    def __init__(self, engine, callback):
        super().__init__(name="taskstore-pg-listen", daemon=True)
        self._engine = engine
        self._callback = callback
        self._stopping = threading.Event()
        self._conn = None
        self.own_channel = f"{PG_CHANNEL}_{engine.token}"     # stop() wakes it here

    def listen(self):
        """Connect and ``LISTEN`` now (raises psycopg's errors): news from here on is heard."""
        self._conn = self._engine._connect(autocommit=True)
        self._conn.execute(f"LISTEN {PG_CHANNEL}")
        self._conn.execute(f"LISTEN {self.own_channel}")

    def run(self):
        lost = False
        while not self._stopping.is_set():
            try:
                if self._conn is None:
                    self.listen()
                if lost:
                    self._callback("lost", ())
                    lost = False
                while not self._stopping.is_set():
                    notes = list(self._conn.notifies(timeout=PG_LISTEN_RETRY_S, stop_after=1))
                    if notes:                      # and whatever else has arrived meanwhile
                        notes += self._conn.notifies(timeout=0)
                    # stop()'s wake-up (its own channel) only ends the wait.
                    self._deliver([n.payload for n in notes if n.channel == PG_CHANNEL])
                    if notes:        # rest: what arrives meanwhile is one burst, one wake-up
                        self._stopping.wait(PG_NOTIFY_GAP_S)
            except Exception as exc:             # psycopg's errors, or the closed connection
                if self._stopping.is_set():
                    return
                logger.warning("PostgreSQL listener lost (%s); reconnecting", exc)
                lost = True
                self._close()
                self._stopping.wait(PG_LISTEN_RETRY_S)
        self._close()

    def _deliver(self, payloads):
        merged = {}
        for payload in payloads:
            token, kind, ids = (payload.split(" ") + ["", ""])[:3]
            if token != self._engine.token:
                merged.setdefault(kind, set()).update(ids.split(","))
        for kind, ids in merged.items():
            ids.discard("")
            self._callback(kind, sorted(ids))

    def _close(self):
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def stop(self, wake, timeout=5.0):
        """End the thread: *wake* (a NOTIFY on ``own_channel``) ends its wait at once."""
        self._stopping.set()
        wake()
        self.join(timeout)


class _PgNotifier(threading.Thread):
    """Sends the engine's notifications after their commits, coalesced, on a connection of its own.

    ``add`` (after a commit) merges ids into what is pending; the thread
    sends all that is pending in one autocommit statement, so the commits
    made while a send is under way, or within ``PG_NOTIFY_GAP_S`` of the
    last send, go out together in the next one.  When
    the connection fails the ids stay pending and it reconnects; the poll
    covers the delay.
    """

    def __init__(self, engine):
        super().__init__(name="taskstore-pg-notify", daemon=True)
        self._engine = engine
        self._cond = threading.Condition()
        self._pending = {}            # kind -> ids committed, not sent yet
        self._stopping = threading.Event()
        self._conn = None

    def add(self, notes):
        with self._cond:
            for kind, ids in notes.items():
                self._pending.setdefault(kind, set()).update(ids)
            self._cond.notify()

    def run(self):
        sent_at = -math.inf
        while True:
            with self._cond:
                while not self._pending and not self._stopping.is_set():
                    self._cond.wait()
            # A commit after a quiet spell goes out at once; under a stream of
            # commits the next send waits out the gap, gathering what comes.
            gap = sent_at + PG_NOTIFY_GAP_S - time.monotonic()
            if gap > 0:
                self._stopping.wait(gap)                  # stop() sends at once
            with self._cond:
                notes, self._pending = self._pending, {}
            sent_at = time.monotonic()
            if not notes:
                break                               # stopping, everything sent
            try:
                self._send(notes)
            except Exception as exc:              # psycopg's errors, or the closed connection
                self._close()
                if self._stopping.is_set():
                    logger.warning("PostgreSQL notifications not sent at close (%s)", exc)
                    break
                logger.warning("PostgreSQL notifier lost (%s); reconnecting", exc)
                self.add(notes)
                self._stopping.wait(PG_LISTEN_RETRY_S)      # then all that is pending
        self._close()

    def _send(self, notes):
        payloads = []
        for kind, ids in notes.items():
            payload = head = f"{self._engine.token} {kind} "   # then ids, each followed by a comma
            for task_id in sorted(ids):
                if payload != head and len(payload) + len(task_id) >= PG_NOTIFY_BYTES:
                    payloads.append(payload)
                    payload = head
                payload += task_id + ","
            payloads.append(payload)
        if self._conn is None:
            self._conn = self._engine._connect(autocommit=True)
        # One statement, one transaction: every notification is delivered at its end.
        self._conn.execute("SELECT pg_notify(%s, p) FROM unnest(%s::text[]) AS p",
                           (PG_CHANNEL, payloads))

    def _close(self):
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def stop(self, timeout=5.0):
        """Send what is pending, then end the thread."""
        with self._cond:
            self._stopping.set()
            self._cond.notify()
        self.join(timeout)


class PostgresEngine(_SqlEngine):
    """The engine for several hosts: one PostgreSQL database, one connection per engine.

    Args:
        url: ``postgresql://user:password@host:port/database`` (or ``postgres://``).
        synchronous: accepted for the store's sake and ignored: a commit's
            durability is the server's ``synchronous_commit``.
        busy_timeout: seconds for connecting and the longest any statement
            or lock wait may take (``statement_timeout``, ``lock_timeout``);
            a session idle in a transaction for half of it is ended by the server.
        max_bytes: refused: a PostgreSQL database has no size cap of ours.
        readonly: every transaction is read-only; a write raises StoreUnavailable.

    Attributes:
        reruns: how many times ``write`` has run a body again because the
            server ended its transaction to break a deadlock (or for a
            serialization failure).

    Raises:
        StoreUnavailable: psycopg is not installed (the message says how to
            install it), the server cannot be reached, or the database holds
            a newer schema.
    """

    shared = True
    moves_unread = True               # a round trip less: move_unread
    _dialect = _Dialect(
        param="%s", no_limit=None,
        batch_lock=" FOR UPDATE SKIP LOCKED",     # reapers on several hosts take other rows
        snapshot_begin=_PG_SNAPSHOT_BEGIN,         # a plain BEGIN is not one snapshot
        registration_age=f"{_PG_NOW_MS} - heartbeat_at",     # leases in database time
        upsert_replaces=False,
        owner_in_range=None,         # a planner with statistics picks the path itself
        indexed_by="tasks",          # the planner, with statistics, picks the index
        row_lock=" FOR UPDATE",
        error_code="(error::jsonb ->> 'code')",
        # With "status = ... AND id > ...", once statistics say the status is
        # common, the planner walks the primary key from the id, over every
        # task between (554 pages over a backlog of 20,000 queued tasks,
        # against 4); repeating the index's OR, without them, it took a bitmap
        # of the status's tasks and sorted it (5,954 pages at 200,000 tasks);
        # with a range of status alone, it sought by status only (938).  The
        # row comparison seeks to (status, id), and the order by status is
        # one only tasks_finished gives: 4 pages, counted or not, custom or
        # generic plan.
        finished_after=("{finished} AND (status, id) > ('{status}', {after}) "
                        "AND status <= '{status}'"),
        principal_page=True, status_implies_index=True)
    _sql = _Statements(_dialect)

    def __init__(self, url, *, synchronous="normal", busy_timeout=DEFAULT_BUSY_TIMEOUT_S,
                 max_bytes=None, readonly=False):
        try:
            import psycopg
        except ImportError:
            raise MissingDependency(
                f"PostgreSQL needs psycopg, which is not installed: {PG_INSTALL}") from None
        if max_bytes is not None:
            raise InvalidParams("max_bytes applies to SQLite only", param="max_bytes")
        self.psycopg = psycopg
        self.path = _redact_url(url)
        self._url = url
        self.synchronous = synchronous
        self.readonly = bool(readonly)
        self._busy_timeout = float(busy_timeout)
        self.lock = threading.Lock()
        self.closed = False
        self.token = secrets.token_hex(6)      # names this engine's own notifications
        self._group = _GroupCommit(self)
        # Bodies run again because the server ended their transaction (write).
        self.reruns = 0
        self._reruns_lock = threading.Lock()
        self._move_sql = {}
        self._logged_move_sql = {}      # _move_statement's text -> _PG_LOGGED_MOVE's
        self._oldest_sql = {}           # oldest_queued's statement, by the number of kinds
        self._transaction = _PgTransaction(self)
        self._reads = _PgReads(self)
        # None: a claim reads at once until oldest_queued has come up empty.
        # Here a write transaction holds up no other writer (rows are locked,
        # not the database), so the probe SQLite needs would only cost a read.
        self._empty_gen = None
        self._in_write = False        # inside transaction(): task rows read are locked
        self._notes = {}              # kind -> ids this transaction changed, for the notifier
        self._notifier = _PgNotifier(self)
        self._listener = None
        self.conn = None
        with self.lock:
            try:
                self._usable_locked()
                if not self.readonly:
                    self._migrate_locked()
                self._check_version_locked()
            except BaseException as exc:
                if self.conn is not None:
                    self.conn.raw.close()
                if isinstance(exc, psycopg.Error):
                    raise self._unavailable(exc) from None
                raise
        self._notifier.start()

    # -- connecting ------------------------------------------------------------

    def _connect(self, autocommit=True):
        """A new psycopg connection with the engine's timeouts (raises psycopg errors)."""
        ms = max(2, int(self._busy_timeout * 1000))
        # A process paused inside a transaction (SIGSTOP, a long GC pause)
        # holds its row locks: the server ends its session after half the
        # busy timeout, so a writer waiting for those rows gets them before its
        # own lock_timeout.  Our transactions never sit idle that long.
        options = (f"-c statement_timeout={ms} -c lock_timeout={ms} "
                   f"-c idle_in_transaction_session_timeout={ms // 2}")
        if self.readonly:
            options += " -c default_transaction_read_only=on"
        return self.psycopg.connect(self._url, autocommit=autocommit, options=options,
                                    connect_timeout=max(1, math.ceil(self._busy_timeout)))

    def _usable_locked(self):
        """The connection, made anew when there is none or the last one broke."""
        if self.conn is None or self.conn.broken:
            if self.conn is not None:
                with contextlib.suppress(Exception):
                    self.conn.raw.close()
                self.conn = None
            try:
                self.conn = _PgConnection(self._connect())
            except self.psycopg.Error as exc:
                raise self._unavailable(exc) from None
        return self.conn

    def _unavailable(self, exc):
        """Turn a psycopg error into a StoreUnavailable naming the database (never SQL)."""
        text = str(exc).strip().splitlines()
        kind = _PgConflict if getattr(exc, "sqlstate", None) in _PG_RUN_AGAIN else StoreUnavailable
        return kind(f"{self.path}: database error: {exc.__class__.__name__}: "
                    f"{text[0] if text else ''}")

    def _migrate_locked(self):
        # Several processes opening an empty database at once: the advisory
        # lock lets one create the schema; the others then find it current.
        conn = self.conn
        conn.execute("BEGIN")
        try:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_PG_SCHEMA_LOCK,))
            version = self._version_locked()
            if version <= SCHEMA_VERSION:      # a newer one is refused, untouched
                for step in range(version + 1, SCHEMA_VERSION + 1):
                    for ddl in PG_MIGRATIONS[step]:
                        conn.execute(ddl)
                conn.execute("UPDATE taskstore_schema SET version = %s", (SCHEMA_VERSION,))
                conn.execute(_PG_PURGE_AT)
            conn.execute("COMMIT")
        except BaseException:
            if not conn.broken:
                conn.execute("ROLLBACK")
            raise

    def _version_locked(self):
        if self.conn.execute("SELECT to_regclass('taskstore_schema')").fetchone()[0] is None:
            return 0
        return self.conn.execute("SELECT max(version) FROM taskstore_schema").fetchone()[0]

    def _check_version_locked(self):
        version = self._version_locked()
        if version > SCHEMA_VERSION:
            raise StoreUnavailable(
                f"{self.path} was written by a newer taskstore (schema {version}; "
                f"this version reads up to {SCHEMA_VERSION})")
        if version < SCHEMA_VERSION:
            raise StoreUnavailable(f"{self.path}: read-only, and not at schema {SCHEMA_VERSION}")

    # -- transactions, notifications -------------------------------------------

    def write(self, body):
        """Run *body* through the group commit; run it again if the server broke a deadlock.

        The group commit puts the bodies of unrelated callers in one
        transaction, so two processes' transactions can lock the same rows in
        opposite orders (a worker's write to its task and a client's cancel of
        another process's task, in each), which no order of ours can rule
        out.  The server then ends one of them (``deadlock detected``), and
        every body of that batch gets a ``_PgConflict``: nothing of the
        transaction was committed (a failed statement, or a COMMIT that
        failed), so each runs again (``_run_again``), at most
        ``PG_WRITE_RETRIES`` times more; ``reruns`` counts the runs again.
        A body must therefore leave no trace outside the database before it
        returns: what it tells anyone else, it tells after ``write`` returns.
        A lost connection is never run again: its commit may have happened.
        """
        run = self._group.write
        for retries_left in range(PG_WRITE_RETRIES, -1, -1):
            try:
                return run(body)
            except _PgConflict:
                if not retries_left:
                    raise
            run = self._run_again
            with self._reruns_lock:       # callers' threads count at once
                self.reruns += 1

    def _run_again(self, body):
        """Run *body* in a transaction of its own, after every transaction holding task rows.

        Run again at once in a new transaction, a body is not queued behind
        the transaction that survived the deadlock: a row the ended one held
        is free until the survivor, woken, takes it, so the new transaction
        can take it first and the two deadlock again (it did in 1 run in 3
        of a test under load).  ``LOCK TABLE tasks IN EXCLUSIVE MODE``, taken
        first, while the transaction holds nothing, waits for every
        transaction that has locked or written a task row (the survivor
        too) to end, and keeps new ones from taking task rows until this one
        commits; reads go on.  Without a batch: it is rare (each after a
        ``deadlock_timeout``), and a batch's other bodies would take rows
        before the table.  A row of another table (a kind's limit, under a
        claim) held by a transaction that has not yet touched ``tasks`` can
        still deadlock it: then it runs again, as the first run did.
        """
        with self.lock:
            with self.transaction():
                self.conn.execute("LOCK TABLE tasks IN EXCLUSIVE MODE")
                return body()

    def transaction(self):
        """One transaction (lock held): committed, then its notes sent; or rolled back."""
        return self._transaction

    def reading(self):
        """Hold the lock and a live connection for reads; psycopg errors become StoreUnavailable."""
        return self._reads

    def on_remote(self, callback):
        """Call ``callback(kind, ids)`` for other processes' commits; starts the listener.

        *kind* is ``changed`` (ids changed), ``queued`` (ids became queued),
        ``cancelling`` (ids became cancelling), ``schedules`` (a schedule
        changed, no ids) or ``lost`` (notifications may have been missed:
        re-read everything).
        """
        self._listener = _PgListener(self, callback)
        try:
            self._listener.listen()      # before the store's first read: no news is missed
        except self.psycopg.Error as exc:
            logger.warning("PostgreSQL listener not connected yet (%s); retrying", exc)
        self._listener.start()

    def _note(self, kind, ids):
        self._notes.setdefault(kind, set()).update(ids)

    @contextlib.contextmanager
    def bulk(self):
        """A plain context: PostgreSQL has no log to checkpoint after a long job."""
        if self.closed:
            raise StoreClosed()
        yield

    def checkpoint(self):
        """Nothing to copy: the server checkpoints by itself; ``(0, 0)``."""
        return 0, 0

    def _wake_listener(self, channel):
        # Without a connection the listener sees the stop within a second anyway.
        with self.lock:
            if self.conn is not None and not self.conn.broken:
                with contextlib.suppress(self.psycopg.Error):
                    self.conn.execute(f"NOTIFY {channel}")

    def close(self):
        """Send the last notifications, stop the listener, close the connection (writers stopped)."""
        with self.lock:
            self.closed = True
            listener, self._listener = self._listener, None
        self._notifier.stop()
        if listener is not None:
            listener.stop(lambda: self._wake_listener(listener.own_channel))
        with self.lock:
            if self.conn is not None:
                self.conn.raw.close()

    # -- tasks -----------------------------------------------------------------

    def _locking(self, sql):
        # Inside a write transaction the row read is the row about to be
        # written: lock it, so another process's writer waits for our commit
        # and then reads our seq instead of reusing it.
        return sql + " FOR UPDATE" if self._in_write else sql

    # An id from outside may hold a NUL, which no stored id does (and which
    # PostgreSQL refuses as a parameter): such a lookup finds nothing.

    def read_task(self, task_id):
        if "\x00" in task_id:
            return None
        row = self.conn.execute(self._locking(self._sql.read_task), (task_id,)).fetchone()
        return None if row is None else _task_from_row(row)

    def task_row_at(self, task_id, now, summary=False):
        if "\x00" in task_id:
            return None
        sql = self._sql.summary_at if summary else self._sql.task_at
        return self.conn.execute(self._locking(sql), (now, task_id)).fetchone()

    def tombstoned(self, task_id):
        return "\x00" not in task_id and super().tombstoned(task_id)

    # A list is sent unprepared: the server plans it at every call, with its
    # values and the table's size at that moment.  Prepared (psycopg does at
    # a statement's fifth call), the server keeps its generic plan once that
    # looks no dearer than the plans made with the values, and keeps it
    # until the table is analysed again.  So lists were planned at every
    # call on a store with a history and not on a small one (the scale run's
    # ratios moved from run to run with that), and a list prepared while
    # the table was empty kept a plan that reads the whole table and sorts
    # it: newest first on 1,050 tasks, 0.58 ms and 53 buffers a call, growing
    # with the table, against 0.02 ms and 14 buffers planned with the values.
    # Written so that the generic plan is always kept (the limit a literal,
    # values the planner cannot see), lists ran 0.1 ms faster, but read the
    # table that way while the store was small, and a kind's page on 1,050
    # tasks sorted the kind's tasks (0.29 ms).  Planning a list takes
    # 0.03-0.06 ms, running it 0.01-0.02 ms, on 1,050 and on 1,000,000 tasks
    # alike (EXPLAIN ANALYZE, this 2-core VM): a cost that does not grow with
    # the store.  bench/scale.py at a million, two runs: every list's median
    # 0.97-1.12x the empty store's, its p99 0.67-1.30x (before: up to 2.44x).
    def _list_rows(self, sql, params):
        _refuse_nul(params)
        return self.conn.raw.execute(sql, params, prepare=False).fetchall()

    def event_bounds(self, task_id, now):
        return None if "\x00" in task_id else super().event_bounds(task_id, now)

    def event_head(self, task_id):
        if "\x00" in task_id:
            return None
        return self.conn.execute(self._locking(self._sql.event_head), (task_id,)).fetchone()

    def insert_tasks(self, rows, events):
        """Hold the rows back: they go out as one statement (see ``_PgConnection``)."""
        self.conn.hold_creates(rows, events)
        # A delayed task (run_at, after a plain row's columns) is news of a
        # time to wake at: other processes' runners read their next due time.
        delayed = [row[0] for row in rows if len(row) > 13 and row[13] is not None]
        if delayed:
            self._note("delayed", delayed)
        if len(delayed) < len(rows):
            self._note("queued", [row[0] for row in rows if len(row) == 13 or row[13] is None])

    def move_task(self, task_id, status, values, event_json, now):
        """The compare-and-set and its event row in one statement: one round trip.

        The event is inserted from the updated row (``WITH ... RETURNING``),
        so it is written exactly when the compare-and-set took; the row
        lock the ``UPDATE`` takes keeps the seq dense as before.  With no
        event (*event_json* None), the compare-and-set alone.
        """
        sql, args = self._move_statement(values), (*values.values(), task_id, status)
        if event_json is not None:
            logged = self._logged_move_sql.get(sql)
            if logged is None:
                logged = self._logged_move_sql[sql] = _PG_LOGGED_MOVE.format(move=sql)
            sql, args = logged, (*args, task_id, event_json, now)
        moved = self.conn.execute(sql, args).rowcount == 1
        if moved:
            self._note_move(task_id, values)
        return moved

    def move_unread(self, task_id, status, values, event_json, now, attempt):
        """``UPDATE ... RETURNING``, with the event row in the same statement: one round trip
        where the row's read and the move took two."""
        if "\x00" in task_id:
            return None                 # never an id (read_task finds nothing for it either)
        sql, args = self._unread_move(task_id, status, values, attempt)
        if event_json is not None:
            logged = self._logged_move_sql.get(sql)
            if logged is None:
                logged = self._logged_move_sql[sql] = _PG_LOGGED_UNREAD_MOVE.format(move=sql)
            sql = logged
            args += (event_json, now)
        row = self.conn.execute(sql, args).fetchone()
        if row is not None:
            self._note_move(task_id, values)
        return row

    def _note_move(self, task_id, values):
        new = values["status"]
        self._note("changed" if new != QUEUED else "delayed" if values.get("run_at")
                   else "queued", (task_id,))
        if new == CANCELLING:
            self._note("cancelling", (task_id,))

    def move_tasks(self, selector, status, values, event_json, now, *, ids=False, policy=None,
                   bump_attempt=False, finish=False):
        """The shared ``move_tasks``, the rows locked first (two recoverers of one owner wait)."""
        guard, args = self._guard(selector, status, policy)
        locked = [r[0] for r in self.conn.execute(
            f"SELECT id FROM tasks WHERE {guard} ORDER BY id FOR UPDATE", args)]
        done, moved_ids = super().move_tasks(selector, status, values, event_json, now,
                                             ids=ids, policy=policy,
                                             bump_attempt=bump_attempt, finish=finish)
        self._note("queued" if values.get("status") == QUEUED else "changed", locked)
        return done, moved_ids

    def set_progress(self, task_id, values, statuses, attempt, now):
        changed = super().set_progress(task_id, values, statuses, attempt, now)
        if changed:
            self._note("changed", (task_id,))
        return changed

    def append_event(self, task_id, seq, etype, data_json, snapshot_json, now):
        super().append_event(task_id, seq, etype, data_json, snapshot_json, now)
        self._note("changed", (task_id,))

    # The next ready task of each kind, by tasks_ready (kind, priority DESC,
    # id), then the first of those.  Asked as "kind = ANY(%s) ORDER BY id", the planner
    # walked the primary key in id order past every finished task whenever
    # its statistics were counted while most tasks were queued (after a bulk
    # enqueue, until autovacuum counts again): a drain by claims slowed to a
    # halt at 60,000 tasks.  No index gives id order across kinds, so each
    # kind is asked on its own, and as a range ordered by (kind, id): with
    # "kind = k.kind" the planner drops the kind from the order and the
    # primary key's order serves again; the range keeps an order that only
    # tasks_ready gives.  Each kind's candidate stays locked until the claim
    # commits: a claimer of several kinds holds one row a kind for a moment,
    # and others skip it and take the next.
    # The kinds are a VALUES list, one parameter each, not an array: the
    # server plans a prepared statement once (its generic plan) only when that
    # plan's estimate is no worse than those made with the values, and an
    # array of unknown length was estimated at ten kinds, so the claim was
    # planned anew at every call (0.2-0.5 ms of the server's CPU each;
    # pg_prepared_statements: 0 generic plans in 307 calls, against 302 in
    # 307 with the list).  A statement for each number of kinds, built once.
    @staticmethod
    def _each_kind(count, columns, lock=""):
        """The oldest queued row of each of *count* kinds: *columns* of it, *lock* ending its read."""
        return (f"FROM (VALUES {', '.join(['(%s)'] * count)}) AS k(kind) CROSS JOIN LATERAL "
                f"(SELECT {columns} FROM tasks WHERE status = '{QUEUED}' AND run_at IS NULL "
                f"AND kind >= k.kind AND kind <= k.kind ORDER BY kind, priority DESC, id "
                f"LIMIT 1{lock}) AS t")

    def _any_queued(self, kinds):
        # As the claim's, for the same reason: a plain "LIMIT 1" read the
        # table from its start, past every finished task, under the same
        # statistics.
        return f"SELECT 1 {self._each_kind(len(kinds), 'id')} LIMIT 1", kinds

    def oldest_queued(self, kinds, gen):
        """``(Task, limit)``: the next ready task of *kinds* nobody else claims (locked), or None."""
        sql = self._oldest_sql.get(len(kinds))
        if sql is None:
            sql = self._oldest_sql[len(kinds)] = "SELECT t.* " + self._each_kind(
                len(kinds), ", ".join(_TASK_COLUMNS) + ", " + _LIMIT_COLUMN,
                " FOR UPDATE OF tasks SKIP LOCKED") + " ORDER BY t.priority DESC, t.id LIMIT 1"
        row = self.conn.execute(sql, kinds).fetchone()
        if row is None:
            if gen is not None:
                self._empty_gen = gen
            return None
        return _task_from_row(row[:-1]), row[-1]

    def promote_due(self, now, limit):
        ids = [r[0] for r in self.conn.execute(self._sql.promote_due + " RETURNING id",
                                               (now, limit))]
        self._note("queued", ids)
        return len(ids)

    def set_kind_limit(self, kind, max_running, now):
        super().set_kind_limit(kind, max_running, now)
        self._note("queued", ())       # a raised limit may let idle workers claim

    def idempotency_get(self, scope, key):
        # Two processes creating with one key: the second waits here for the
        # first's commit, then reads its row (the unique key stays the backstop).
        scope, key = _nul_free(scope), _nul_free(key)
        if self._in_write:
            self.conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s || ' ' || %s, 0))",
                              (scope, key))
        return super().idempotency_get(scope, key)

    def idempotency_put(self, scope, key, fingerprint, task_id, now, expires_at):
        super().idempotency_put(_nul_free(scope), _nul_free(key), fingerprint, task_id, now,
                                expires_at)

    # -- processes -------------------------------------------------------------

    def register(self, proc_id, now):
        self.conn.execute(
            "INSERT INTO processes (id, pid, host, proc_start, started_at, heartbeat_at) "
            f"VALUES (%s, %s, %s, NULL, {_PG_NOW_MS}, {_PG_NOW_MS})",
            (proc_id, os.getpid(), _HOST()))

    def heartbeat(self, proc_id, now):
        return self.conn.execute(f"UPDATE processes SET heartbeat_at = {_PG_NOW_MS} WHERE id = %s",
                                 (proc_id,)).rowcount == 1

    @staticmethod
    def owner_dead(proc, now, lease_ms):
        """Is the ``Registration`` *proc* (or None) dead: unregistered, or its lease expired?

        The lease is judged by the age the server computed, never by *now*
        (this host's clock).  A registration of this very process is alive
        only while a runner holds it, as on SQLite.
        """
        if proc is None:
            return True
        if proc.age_ms > lease_ms:
            return True
        if proc.host == _HOST() and proc.pid == os.getpid():
            return proc.id not in _LIVE_PROCESS_IDS
        return False

    # -- retention -------------------------------------------------------------

    _reap_batch = ("SELECT id, first_seq, last_seq - first_seq + 1, purge_at FROM tasks "
                   "WHERE purge_at IS NOT NULL AND purge_at >= %s AND purge_at <= %s "
                   "ORDER BY purge_at LIMIT %s FOR UPDATE SKIP LOCKED")

    def reap_tasks_once(self, now, budget, counts, tombstone_ms, since=None):
        """Delete one batch of expired tasks with their events; ``(more, ids, reached)``.

        As SQLite's, except that the batch is the rows this transaction
        locked (``SKIP LOCKED``): reapers in several processes take
        different batches instead of deleting the same rows twice.  The
        batch is in ``tasks_purge``'s order, ``purge_at`` alone: that index
        holds no id here, and with ``ORDER BY purge_at, id`` the generic
        plan (psycopg prepares a statement at its fifth run, and PostgreSQL
        may then plan it once for all parameters) sorted every expired task
        for each batch: 335 ms a batch of 500 with a million expired,
        against 0.24 ms.  The ids are the batch, so ties need no order.
        A batch starts at *since*: a deleted row's index entry stays until
        a vacuum, and each batch from the start stepped over all the pass
        had deleted (482 ms for the first scan over 900,000 such entries,
        then 5-21 ms, growing with the pass).
        """
        low = -2 ** 63 if since is None else since
        rows = self.conn.execute(self._reap_batch, (low, now, budget)).fetchall()
        take = _reap_take(rows, budget)
        if not take and rows:
            return self._reap_slice(rows[0][0], rows[0][1], budget, counts), (), rows[0][3]
        ids = [row[0] for row in rows[:take]]
        if ids:
            counts["events"] += self.conn.execute(
                "DELETE FROM events WHERE task_id = ANY(%s)", (ids,)).rowcount
            self.conn.execute(
                "INSERT INTO tombstones (id, deleted_at, expires_at) "
                "SELECT unnest(%s::text[]), %s, %s ON CONFLICT (id) DO UPDATE SET "
                "deleted_at = EXCLUDED.deleted_at, expires_at = EXCLUDED.expires_at",
                (ids, now, now + tombstone_ms))
            counts["tasks"] += self.conn.execute(
                "DELETE FROM tasks WHERE id = ANY(%s)", (ids,)).rowcount
        return len(rows) == budget or take < len(rows), ids, rows[take - 1][3] if take else since

    # Not the shared ``(key) IN (batch)``: its generic plan (psycopg prepares a
    # statement at its fifth run) hash-joins the batch with a scan of the
    # whole table, 122 ms for 500 expired rows among 1,000,000 tombstones, and
    # right after a reap of a million tasks, before autovacuum has counted
    # their new tombstones, its plan joined them by a nested loop over a scan
    # (a pass with no tombstone due ran into the statement timeout, 30 s).
    # The batch's row addresses, as one array, make the delete a TID scan of
    # those rows (2.3 ms), and ``ORDER BY expires_at`` has the batch read from
    # the expiry index even with those counts missing (0.3-1 ms, against a
    # scan of the table, 55-200 ms, when none is due).
    _delete_expired = {
        table: (f"DELETE FROM {table} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {table} "
                "WHERE expires_at <= %s ORDER BY expires_at LIMIT %s FOR UPDATE SKIP LOCKED))")
        for table in ("idempotency", "tombstones")}

    def delete_expired(self, table, now, limit):
        """Drop up to *limit* expired rows of ``idempotency`` or ``tombstones`` by row address."""
        return self.conn.execute(self._delete_expired[table], (now, limit)).rowcount

    # -- schedules: other processes' runners hear of a change at once ----------

    def schedule_put(self, row):
        super().schedule_put(row)
        self._note("schedules", ())

    def schedule_update(self, name, values, next_at):
        changed = super().schedule_update(name, values, next_at)
        if changed:
            self._note("schedules", ())
        return changed

    def schedule_delete(self, name):
        deleted = super().schedule_delete(name)
        if deleted:
            self._note("schedules", ())
        return deleted


# =============================================================================
# 12. The task board page
# =============================================================================
# One page, served by this module at GET / (the HTTP server, section 10, only
# routes it here): HTML, CSS and script inline, nothing fetched from
# elsewhere.  The script talks to the public routes only (with
# the bearer token, if the server has tokens), streams with fetch() because
# EventSource cannot send a header, and puts task data into the page as
# text (textContent), never as markup.  The lifecycle diagram is drawn from
# TRANSITIONS, embedded by _board_page() as JSON data (not script).

BOARD_STYLE = """
:root { font: 15px/1.4 system-ui, sans-serif; color: #1b1b1b; background: #fafafa; }
body { margin: 0 auto; max-width: 72em; padding: 0 1em 2em; }
[hidden] { display: none !important; }
header { display: flex; flex-wrap: wrap; align-items: baseline; gap: 0 1em; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.5em; } h3 { font-size: 1em; }
#conn[data-state=live] { color: #196c2e; } #conn[data-state=down] { color: #a4262c; }
#error:not(:empty) { background: #fde7e9; border: 1px solid #a4262c; padding: .5em; }
form { display: flex; flex-wrap: wrap; gap: .5em; align-items: end; }
label { display: flex; flex-direction: column; font-weight: 600; }
textarea { min-width: min(30em, 90vw); }
button { font: inherit; padding: .3em .8em; cursor: pointer; }
:focus-visible { outline: 3px solid #0b5cad; outline-offset: 2px; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: .3em .5em; border-bottom: 1px solid #ddd; vertical-align: top; }
td button { font-family: ui-monospace, monospace; font-size: .85em; }
td button[aria-pressed=true] { background: #0b5cad; color: #fff; }
.badge { border-radius: 1em; padding: .1em .6em; font-size: .85em; font-weight: 600;
         background: #e1e1e1; white-space: nowrap; }
.badge[data-status=queued], .badge[data-status=loading] { background: #e8e3f7; color: #47318c; }
.badge[data-status=running] { background: #dbeafe; color: #0b4a8f; }
.badge[data-status=cancelling] { background: #fff1c2; color: #6b4e00; }
.badge[data-status=succeeded] { background: #d6f2dc; color: #196c2e; }
.badge[data-status=failed] { background: #fde7e9; color: #a4262c; }
.badge[data-status=cancelled] { background: #ececec; color: #444; }
progress { width: 8em; } .msg { display: block; font-size: .85em; color: #555; }
#diagram { display: flex; flex-wrap: wrap; gap: .5em; list-style: none; padding: 0; }
#diagram > li { border: 1px solid #bbb; border-radius: .4em; padding: .3em .6em; background: #fff; }
#diagram > li.current { border: 3px solid #0b5cad; background: #e8f1fb; }
#diagram ul { margin: 0; padding-left: 1.1em; font-size: .85em; }
#diagram li.next { font-weight: 700; color: #0b4a8f; }
#text-out { white-space: pre-wrap; background: #fff; border: 1px solid #ddd; padding: .5em;
            min-height: 2em; }
#log { font: .85em ui-monospace, monospace; max-height: 20em; overflow: auto; }
.sr { position: absolute; width: 1px; height: 1px; overflow: hidden; clip: rect(0 0 0 0); }
h2, dd, .msg, #log { overflow-wrap: anywhere; }
td button { max-width: 100%; text-align: left; white-space: nowrap; }
@media (max-width: 40em) {      /* narrow: each task is a block, the header only for readers */
  thead { position: absolute; width: 1px; height: 1px; overflow: hidden; clip: rect(0 0 0 0); }
  table, tbody, tr, td { display: block; } td { border: 0; padding: .15em 0; }
  tr { border-bottom: 1px solid #ddd; padding: .4em 0; } progress { width: 100%; }
  td.model, td.age { display: inline-block; margin-right: 1em; } dd { margin-left: 1em; }
  td button { white-space: normal; word-break: break-all; }
}
"""

BOARD_SCRIPT = r"""
"use strict";
const data = JSON.parse(document.getElementById("board-data").textContent);
const $ = (id) => document.getElementById(id);
const tasks = new Map(), rows = new Map();
const POLICY = {fail: "fail: a server restart fails the task (server_restarted)",
                retry: "retry: a server restart runs the task again from the start",
                resume: "resume: a server restart continues the task where it stopped"};
let token = sessionStorage.getItem("lmsp-token") || "";
let selected = null, selectCtl = null, tokenWaiters = [];

function el(tag, props, ...kids) {
  const e = Object.assign(document.createElement(tag), props || {});
  e.append(...kids);
  return e;
}
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const say = (text) => { $("live").textContent = text; };
const showError = (text) => { $("error").textContent = text; };

class HttpError extends Error {
  constructor(status, detail) { super(detail); this.status = status; }
}

function headers(extra) {
  const h = Object.assign({}, extra);
  if (token) h.Authorization = "Bearer " + token;
  return h;
}

async function problem(resp) {
  let text = "HTTP " + resp.status;
  try { const p = await resp.json(); text = p.detail || p.title || text; } catch (e) { /* not JSON */ }
  if (resp.status === 401) askToken(text);
  return new HttpError(resp.status, text);
}

async function api(method, path, body) {
  const resp = await fetch(path, {method, cache: "no-store",
    headers: headers(body ? {"Content-Type": "application/json"} : {}),
    body: body ? JSON.stringify(body) : undefined});
  if (!resp.ok) throw await problem(resp);
  return resp.json();
}

// Server-sent events over fetch(): EventSource cannot send a bearer header.
// Returns "done" on 204 (nothing more will come) or "ended" when the stream ends.
async function sse(path, lastId, onEvent, signal, onOpen) {
  const h = headers({Accept: "text/event-stream"});
  if (lastId !== null) h["Last-Event-ID"] = String(lastId);
  const resp = await fetch(path, {headers: h, signal, cache: "no-store"});
  if (resp.status === 204) return "done";
  if (!resp.ok) throw await problem(resp);
  if (onOpen) onOpen();
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "", ev = {data: []};
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return "ended";
    buf += value;
    let i;
    while ((i = buf.indexOf("\n")) >= 0) {
      let line = buf.slice(0, i);
      buf = buf.slice(i + 1);
      if (line.endsWith("\r")) line = line.slice(0, -1);
      if (line === "") {
        if (ev.data.length) onEvent(ev.event || "message", ev.data.join("\n"), ev.id);
        ev = {data: []};
        continue;
      }
      if (line[0] === ":") continue;
      const c = line.indexOf(":");
      const field = c < 0 ? line : line.slice(0, c);
      let val = c < 0 ? "" : line.slice(c + 1);
      if (val[0] === " ") val = val.slice(1);
      if (field === "data") ev.data.push(val);
      else if (field === "event") ev.event = val;
      else if (field === "id") ev.id = val;
    }
  }
}

function askToken(message) {
  $("auth").hidden = false;
  $("auth-msg").textContent = message;
  if (document.activeElement !== $("token")) $("token").focus();
}
const tokenGiven = () => new Promise((resolve) => tokenWaiters.push(resolve));

function setConn(state, text) {
  $("conn").dataset.state = state;
  if ($("conn").textContent !== text) $("conn").textContent = text;
}

async function watchBoard() {
  let down = false;
  for (;;) {
    try {
      await sse("/lmsp/v1/tasks/changes", null, (name, text) => onTask(JSON.parse(text)),
                undefined, () => {
        setConn("live", down ? "Reconnected: live" : "Live");
        down = false;
      });
      setConn("down", "The server ended the stream; reconnecting");
    } catch (e) {
      if (e.status === 401) {
        setConn("token", "Waiting for a token");
        await tokenGiven();
        continue;
      }
      down = true;
      setConn("down", "Server unreachable; reconnecting (" + e.message + ")");
    }
    down = true;
    await sleep(1000);
  }
}

function age(seconds) {
  const s = Math.max(0, Math.round(Date.now() / 1000 - seconds));
  return s < 60 ? s + " s" : s < 3600 ? Math.floor(s / 60) + " min" : Math.floor(s / 3600) + " h";
}

function fillProgress(bar, t) {
  const finished = data.terminal.includes(t.state);
  if (t.progress_total) { bar.max = t.progress_total; bar.value = t.progress || 0; }
  else if (finished) { bar.max = 1; bar.value = 1; }
  else if (t.status === "queued") { bar.max = 1; bar.value = 0; }
  else bar.removeAttribute("value");       // indeterminate
}

function message(t) {
  if (t.message) return t.message;
  if (t.run_at && t.status === "queued")
    return "not before " + new Date(t.run_at * 1000).toLocaleTimeString();
  if (t.error) return t.error.detail || t.error.code;
  if (t.status === "running") return t.last_seq + " events";
  return "";
}

function onTask(t) {
  const old = tasks.get(t.id);
  tasks.set(t.id, t);
  let row = rows.get(t.id);
  if (!row) {
    const pick = el("button", {type: "button", textContent: t.id});
    pick.setAttribute("aria-pressed", "false");
    pick.addEventListener("click", () => select(t.id));
    row = el("tr", {}, el("td", {}, pick), el("td", {className: "model"}),
             el("td", {}, el("span", {className: "badge"})),
             el("td", {}, el("progress", {}), el("span", {className: "msg"})),
             el("td", {className: "age"}));
    row.dataset.id = t.id;
    rows.set(t.id, row);
    const body = $("tasks");
    const after = [...body.children].find((r) => {
      const o = tasks.get(r.dataset.id);
      return o.created_at < t.created_at || (o.created_at === t.created_at && o.id < t.id);
    });
    body.insertBefore(row, after || null);
  }
  const cells = row.children;
  cells[1].textContent = t.model || "";
  const badge = cells[2].firstChild;
  badge.textContent = t.status;
  badge.dataset.status = t.status;
  fillProgress(cells[3].firstChild, t);
  cells[3].firstChild.setAttribute("aria-label", "progress of " + t.id);
  cells[3].lastChild.textContent = message(t);
  cells[4].textContent = age(t.created_at);
  if (old && old.status !== t.status) say(t.id + " is now " + t.status);
  if (t.id === selected) showDetail(t);
}

function showDetail(t) {
  if (!t) return;
  const badge = $("d-status");
  badge.textContent = t.status;
  badge.dataset.status = t.status;
  $("d-policy").textContent = POLICY[t.on_restart] || t.on_restart;
  $("d-attempt").textContent = String(t.attempt) + (t.max_attempts ? " of " + t.max_attempts : "");
  $("d-error").textContent = t.error ? (t.error.code + ": " + t.error.detail) : "none";
  $("cancel").disabled = data.terminal.includes(t.state) || t.state === "cancelling";
  drawDiagram(t.state);
}

function drawDiagram(state) {
  const ol = $("diagram");
  if (ol.dataset.state === state) return;
  ol.dataset.state = state;
  ol.replaceChildren();
  const next = [];
  for (const [from, moves] of Object.entries(data.transitions)) {
    const li = el("li", {className: from === state ? "current" : ""}, el("strong", {textContent: from}));
    const ul = el("ul");
    const entries = Object.entries(moves);
    if (!entries.length) ul.append(el("li", {textContent: "final"}));
    for (const [event, to] of entries) {
      ul.append(el("li", {className: from === state ? "next" : "", textContent: event + " \u2192 " + to}));
      if (from === state) next.push(event + " \u2192 " + to);
    }
    if (from === state) {
      li.setAttribute("aria-current", "step");
      li.append(el("span", {className: "sr", textContent: " (current state)"}));
    }
    li.append(ul);
    ol.append(li);
  }
  $("d-next").textContent = next.length ? "Legal next moves: " + next.join(", ")
                                        : "Final state: no move is legal";
}

function logEvent(name, obj) {
  const r = obj.response || {};
  let note = "";
  if (name === "response.output_item.added") $("text-out").textContent = "";  // a run from the start
  if (name === "response.output_text.delta") {
    $("text-out").textContent += obj.delta;
    note = JSON.stringify(obj.delta);
  } else if (name === "response.queued" && obj.sequence_number > 0) {
    note = "queued again (a server restart requeued it)";
  } else if (r.error) {
    note = (r.error.code ? r.error.code + ": " : "") + (r.error.detail || r.error.message || "");
  } else if (r.status) {
    note = r.status;
  }
  const log = $("log");
  log.append(el("li", {textContent: obj.sequence_number + " " + name + (note ? " " + note : "")}));
  while (log.children.length > 500) log.firstChild.remove();
  log.scrollTop = log.scrollHeight;
}

function select(id) {
  if (selectCtl) selectCtl.abort();
  selected = id;
  selectCtl = new AbortController();
  for (const [tid, row] of rows) row.querySelector("button").setAttribute("aria-pressed", String(tid === id));
  $("detail").hidden = false;
  $("h-detail").textContent = "Task " + id;
  $("log").replaceChildren();
  $("text-out").textContent = "";
  $("diagram").dataset.state = "";
  showDetail(tasks.get(id));
  watchTask(id, selectCtl.signal);
}

async function watchTask(id, signal) {
  let last = null, final = false;
  while (!signal.aborted && !final) {
    try {
      const how = await sse("/lmsp/v1/tasks/" + encodeURIComponent(id) + "/events", last,
        (name, text, eid) => {
          if (signal.aborted) return;
          if (eid !== undefined) last = eid;
          logEvent(name, JSON.parse(text));
          if (["response.completed", "response.incomplete", "response.failed",
               "response.cancelled"].includes(name)) final = true;
        }, signal);
      if (how === "done") return;
    } catch (e) {
      if (signal.aborted) return;
      if (e.status === 404 || e.status === 410) { showError(e.message); return; }
      if (e.status === 401) { await tokenGiven(); continue; }
    }
    if (!final) await sleep(1000);
  }
}

$("create").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  try {
    const task = await api("POST", "/lmsp/v1/tasks", {type: "response",
      input: {model: "demo", input: $("text").value}, on_restart: $("policy").value});
    showError("");
    say("Created " + task.id);
    select(task.id);
  } catch (e) { showError("Could not create the task: " + e.message); }
});

$("cancel").addEventListener("click", async () => {
  if (!selected) return;
  try {
    await api("POST", "/lmsp/v1/tasks/" + encodeURIComponent(selected) + "/cancel");
    showError("");
    say("Cancel requested for " + selected);
  } catch (e) { showError("Could not cancel: " + e.message); }
});

$("auth").addEventListener("submit", (ev) => {
  ev.preventDefault();
  token = $("token").value.trim();
  $("token").value = "";
  sessionStorage.setItem("lmsp-token", token);
  $("auth").hidden = true;
  const waiters = tokenWaiters;
  tokenWaiters = [];
  for (const resolve of waiters) resolve();
});

setInterval(() => {
  for (const [id, row] of rows) row.children[4].textContent = age(tasks.get(id).created_at);
}, 1000);
watchBoard();
"""

BOARD_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>taskstore board</title>
<link rel="icon" href="data:,">
<style>""" + BOARD_STYLE + """</style></head>
<body>
<header><h1>taskstore board</h1>
<p id="conn" role="status" aria-live="polite" data-state="down">Connecting</p></header>
<form id="auth" hidden>
<p id="auth-msg"></p>
<label for="token">Bearer token <input id="token" type="password" autocomplete="off" required></label>
<button type="submit">Use token</button></form>
<p id="error" role="alert"></p>
<main>
<section aria-labelledby="h-new"><h2 id="h-new">New demo task</h2>
<form id="create">
<label for="text">Text to echo
<textarea id="text" rows="2">The demo backend streams this text back one word at a time</textarea></label>
<label for="policy">Restart policy
<select id="policy"><option>fail</option><option>retry</option><option selected>resume</option></select></label>
<button type="submit">Create task</button></form></section>
<section aria-labelledby="h-tasks"><h2 id="h-tasks">Tasks, newest first</h2>
<table><thead><tr><th scope="col">Task</th><th scope="col" class="model">Model</th>
<th scope="col">Status</th><th scope="col">Progress</th><th scope="col">Age</th></tr></thead>
<tbody id="tasks"></tbody></table>
<p id="live" class="sr" aria-live="polite"></p></section>
<section id="detail" aria-labelledby="h-detail" hidden><h2 id="h-detail">Task</h2>
<dl><dt>Status</dt><dd><span id="d-status" class="badge"></span></dd>
<dt>Restart policy</dt><dd id="d-policy"></dd>
<dt>Attempt</dt><dd id="d-attempt"></dd>
<dt>Error</dt><dd id="d-error"></dd></dl>
<button id="cancel" type="button">Cancel task</button>
<h3>Lifecycle</h3><p id="d-next"></p><ol id="diagram" aria-label="lifecycle states"></ol>
<h3>Response text</h3><pre id="text-out"></pre>
<h3>Event log</h3><ol id="log"></ol></section></main>
<script type="application/json" id="board-data">/*BOARD_DATA*/</script>
<script>""" + BOARD_SCRIPT + """</script>
</body></html>
"""


def _csp_hash(text):
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


# Nothing from elsewhere; the page's one script and one style by their hashes.
_BOARD_CSP = (f"default-src 'none'; script-src {_csp_hash(BOARD_SCRIPT)}; "
              f"style-src {_csp_hash(BOARD_STYLE)}; connect-src 'self'; img-src data:; "
              "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


# =============================================================================
# 13. The OpenAI backend
# =============================================================================
# An LMSP backend that streams from any OpenAI-compatible chat completions
# endpoint (Ollama, vLLM, llama.cpp's server, OpenAI).  It only streams text;
# ResponseOutput (section 10) turns text into the Responses events.

def _is_api_key(key):
    """True for a key that goes into a header as it is: visible ASCII, no spaces."""
    return isinstance(key, str) and re.fullmatch(r"[!-~]+", key) is not None


class OpenAIBackend:
    """Forward response requests to an OpenAI-compatible server, streaming.

    It posts to ``{url}/chat/completions`` (what Ollama, llama.cpp and vLLM all
    serve) with ``stream: true`` and streams each content delta.  A cancel
    closes the upstream connection, which stops the generation there.  It has
    no snapshots: a remote stream cannot be resumed, so ``resume`` is refused.

    The ``api_key``, when given, is sent as ``Authorization: Bearer`` to *url*
    and nowhere else (redirects are not followed).  It is cut out of every
    error message, since upstreams echo it back ("invalid key sk-..."), and
    the repr hides it.
    """

    name = "openai"
    snapshots = False

    def __init__(self, url=DEFAULT_BACKEND_URL, timeout=300.0, api_key=None):
        parts = urllib.parse.urlsplit(url)
        if "@" in parts.netloc:
            # Not echoed: what precedes the @ is a password.
            raise ValueError("backend URL must not carry credentials (user:password@); "
                             "give the key in OPENAI_API_KEY or --backend-key-file")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"backend URL must be http(s)://host[:port][/path], not {url!r}")
        if api_key and not _is_api_key(api_key):
            # Not echoed; http.client would refuse it later with the whole value in its message.
            raise ValueError("api_key must be visible ASCII characters, without spaces")
        self.url, self.timeout, self.api_key = url.rstrip("/"), timeout, api_key or None

    def __repr__(self):
        return f"OpenAIBackend({self.url!r}, api_key={'<hidden>' if self.api_key else None})"

    def _redact(self, text):
        """Return *text* with every copy of the key, in any quoting, replaced."""
        if self.api_key:
            for form in {self.api_key, json.dumps(self.api_key)[1:-1], repr(self.api_key)[1:-1]}:
                text = text.replace(form, "[redacted]")
        return text

    @staticmethod
    def chat_request(request):
        """Translate a response request into a chat-completions request."""
        messages = []
        if isinstance(request.get("instructions"), str):
            messages.append({"role": "system", "content": request["instructions"]})
        items = request["input"]
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        for item in items:
            if item.get("type", "message") != "message":
                continue
            content = item.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict)
                                  and p.get("type") in ("input_text", "output_text", "text"))
            messages.append({"role": item.get("role", "user"), "content": content or ""})
        body = {"model": request["model"], "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}}
        for key, target in (("temperature", "temperature"), ("top_p", "top_p"),
                            ("max_output_tokens", "max_tokens")):
            if request.get(key) is not None:
                body[target] = request[key]
        return body

    def __call__(self, request, out):
        parts = urllib.parse.urlsplit(self.url)
        # The route goes after the URL's path; its query (an api-version, say) stays at the end.
        path = parts.path.rstrip("/") + "/chat/completions" + (
            "?" + parts.query if parts.query else "")
        connection = (http.client.HTTPSConnection if parts.scheme == "https"
                      else http.client.HTTPConnection)
        conn = connection(parts.hostname, parts.port, timeout=self.timeout)
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        done = threading.Event()
        # A blocking read cannot see the cancel signal, so a watcher shuts the
        # socket down; the read then fails and we return as cancelled.
        usage, finish = None, None
        try:
            conn.request("POST", path, body=dumps(self.chat_request(request)).encode(),
                         headers=headers)
            # Keep the socket: getresponse() forgets it for a Connection: close answer.
            threading.Thread(target=self._watch, args=(out.cancelled, done, conn.sock),
                             name="taskstore-openai-cancel", daemon=True).start()
            resp = conn.getresponse()
            if resp.status != 200:
                raw = resp.read(2000)
                detail = self._redact(raw.decode("utf-8", "replace"))
                if len(raw) == 2000 and self.api_key:
                    # The read may have cut a copy of the key: drop what could be its start.
                    detail = detail[:len(detail) + 1 - len(self.api_key)]
                detail = detail.strip()[:300]
                raise BackendError(f"backend answered {resp.status}: {detail}")
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if out.cancelled.is_set():
                    return None
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    raise BackendError(self._redact(f"backend error: {chunk['error']}"))
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        out.write(piece)
                    finish = choice.get("finish_reason") or finish
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if out.cancelled.is_set():
                return None
            raise BackendError(self._redact(f"backend request failed: "
                                            f"{exc.__class__.__name__}: {exc}")) from None
        finally:
            done.set()
            conn.close()
        if usage:
            usage = _usage(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))
        return {"usage": usage,
                "incomplete_reason": "max_output_tokens" if finish == "length" else None}

    @staticmethod
    def _watch(cancelled, done, sock):
        while not done.is_set():
            if cancelled.wait(_STREAM_WAKE_S):
                if not done.is_set():
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return


# =============================================================================
# 14. The terminal watch
# =============================================================================
# ``taskstore.py tasks watch``: follows tasks live from the event log, one row
# per task redrawn in place on a terminal, one line per change elsewhere.

def _printable(text):
    """*text* on one line, every control character (escape sequences too) a space."""
    return "".join(c if c.isprintable() else " " for c in str(text))


def _watch_message(task, printable=True):
    """The task's status message, or a failed task's error message, on one line.

    Not *printable*: as stored, None when there is none (``--json``).
    """
    message = task.status_message
    if message is None and isinstance(task.error, dict):
        message = task.error.get("message")
    if not printable:
        return message
    run_at = getattr(task, "run_at", None)     # a delayed task says when it may run
    if message is None and run_at is not None and task.status == QUEUED:
        return f"not before {iso_time(run_at)}"
    return "" if message is None else _printable(message)


def _watch_percent(task):
    """Progress as text: ``40%`` against a total, the count without one, "" with none."""
    if task.progress is None:
        return ""
    if task.progress_total:
        return f"{min(max(task.progress / task.progress_total, 0.0), 1.0):.0%}"
    return f"{task.progress:g}"


def _watch_json(task_id, task, awaiting, status=None, seq=None, message=None):
    """One change as ``--json`` prints it; *status*, *seq*, *message*: a past status event's."""
    if task is None:
        return {"id": task_id, "kind": None, "status": None, "mcp_status": None,
                "lmsp_status": None, "owner_dead": False, "progress": None,
                "progress_total": None, "message": _GONE, "seq": None}
    status = status or task.status
    return {"id": task_id, "kind": task.kind, "status": status,
            "mcp_status": mcp_status(status), "lmsp_status": lmsp_status(status),
            "owner_dead": task.id in awaiting and status == task.status,
            "progress": task.progress, "progress_total": task.progress_total,
            "message": _watch_message(task, printable=False) if seq is None else message,
            "seq": task.last_seq if seq is None else seq}


def _watch_fit(pieces, width, colour):
    """Join ``(text, SGR code or None)`` *pieces*, cut to *width* columns, coloured if asked."""
    out = []
    for text, code in pieces:
        if width <= 0:
            break
        text = _clip(text, width)
        width -= len(text)
        out.append(f"\x1b[{code}m{text}\x1b[0m" if colour and code and text else text)
    return "".join(out)


class _WatchView:
    """What ``tasks watch`` prints: ``show`` gets each read of the tasks.

    It prints a task only when what it shows has changed: its status (each
    status event), owner death, progress, message.
    """

    def __init__(self, out, as_json, colour):
        self._out = out
        self._json = as_json
        self._live = not as_json and out.isatty()
        self._colour = colour and self._live
        self._shown = {}        # task id -> what was printed of it last
        self._rows = 0          # lines of the board drawn last (live view)
        self._width = None

    def _key(self, task, awaiting):
        if task is None:
            return None
        return (task.status, task.id in awaiting, _watch_percent(task), _watch_message(task))

    def show(self, tasks, steps, awaiting):
        """Print what changed: *tasks* ``{id: Task or None}``, *steps* ``{id: [status Event]}``."""
        lines, changed = [], False
        for task_id, task in tasks.items():
            key = self._key(task, awaiting)
            passed = steps.get(task_id, ())
            if self._shown.get(task_id, ()) == key and not passed:
                continue
            changed = True
            if self._json:
                for event in passed[:-1]:    # the last one is the task as read now
                    data = event.data
                    lines.append(dumps(_watch_json(task_id, task, awaiting, data["status"],
                                                   event.seq, data.get("message"))))
                lines.append(dumps(_watch_json(task_id, task, awaiting)))
            elif self._live:
                for event in passed:
                    lines.append(self._step(task_id, event.data))
            else:
                for event in passed[:-1]:
                    lines.append(f"{task_id}  {event.data['status']}")
                lines.append(self._line(task_id, task, awaiting))
            self._shown[task_id] = key
        size = shutil.get_terminal_size()
        # A terminal that reports no size (a fresh pty, a serial console) gets the
        # usual fallback, as shutil itself does from Python 3.11 on.
        columns, height = size.columns or 80, size.lines or 24
        width = columns - 1             # a line filling the last column would wrap
        if self._live and (changed or width != self._width):
            self._draw(lines, self._rows_fitting(tasks, awaiting, width, height), width)
        elif lines:
            self._out.write("".join(line + "\n" for line in lines))
            self._out.flush()

    def _rows_fitting(self, tasks, awaiting, width, height):
        """The board's rows: one per task, unless more than the terminal holds (cursor up
        cannot reach a line scrolled off); then the unfinished first, and a count of the rest."""
        if len(tasks) < height:
            return [self._row(i, t, awaiting, width) for i, t in tasks.items()]
        order = sorted(tasks.items(), key=lambda item: item[1] is None or item[1].terminal)
        shown = max(1, height - 2)
        return [*(self._row(i, t, awaiting, width) for i, t in order[:shown]),
                [(f"\u2026 and {len(tasks) - shown} more tasks", None)]]

    def _line(self, task_id, task, awaiting):
        if task is None:
            return f"{task_id}  {_GONE}"
        return "  ".join(part for part in (task_id, _status_cell(task, awaiting),
                                           _watch_percent(task), _watch_message(task)) if part)

    def _step(self, task_id, data):
        """A status change on the live view: ``id  running -> succeeded  message``."""
        pieces = [(f"{task_id}  {data.get('from')} -> ", None),
                  (data["status"], _WATCH_COLOURS.get(data["status"]))]
        if data.get("message"):
            pieces.append(("  " + _printable(data["message"]), None))
        return pieces

    def _row(self, task_id, task, awaiting, width):
        """A task's row on the live view: ``id  status  [#####-----]  50%  message``."""
        if task is None:
            return [(f"{task_id}  ", None), (_GONE, None)]
        pieces = [(f"{task_id}  ", None),
                  (_status_cell(task, awaiting), _WATCH_COLOURS.get(task.status))]
        percent = _watch_percent(task)
        status = pieces[-1][0]
        # The bar gives way to 20 columns of message first, and goes when under 5.
        bar = min(_WATCH_BAR, width - len(task_id) - len(status) - 11 - 20)
        if task.progress_total and bar >= 5:
            done = round(bar * min(max(task.progress / task.progress_total, 0.0), 1.0))
            pieces.append((f"  [{'#' * done}{'-' * (bar - done)}] {percent:>4}", None))
        elif percent:
            pieces.append((f"  {percent}", None))
        message = _watch_message(task)
        if message:
            pieces.append(("  " + message, None))
        return pieces

    def _draw(self, steps, rows, width):
        """Redraw the board in place, the status changes printed above it first."""
        parts = []
        if self._rows:
            parts.append(f"\x1b[{self._rows}F\x1b[J")   # to the board's first line; clear below
        for pieces in (*steps, *rows):
            parts.append(_watch_fit(pieces, width, self._colour) + "\n")
        self._rows, self._width = len(rows), width
        self._out.write("".join(parts))
        self._out.flush()


def _watch_targets(store, ids):
    """The tasks to watch, ``{id: Task}``: *ids* in order, or every unfinished task, oldest first."""
    if ids:
        return {task_id: store.get(task_id) for task_id in dict.fromkeys(ids)}
    found, cursor = [], None
    while True:
        page, cursor = store.list(status=UNFINISHED_STATES, limit=500, cursor=cursor)
        found += page
        if cursor is None:
            return {task.id: task for task in reversed(found)}


def _watch_read(store, task):
    """*task* read again, and the status events it passed since: ``(Task or None, [Event])``."""
    try:
        new = store.get(task.id)
    except TaskNotFound:            # expired or deleted meanwhile (TaskExpired too)
        return None, []
    if new.last_seq == task.last_seq:
        return new, []
    try:
        events = store.events(task.id, after=task.last_seq)
    except (TaskNotFound, EventsExpired):
        events = []
    # Events written since the get show with the next read, not twice.
    return new, [e for e in events if e.type == "status" and e.seq <= new.last_seq]


def _tasks_watch(args):
    """``tasks watch``: print the watched tasks as they change until all have finished."""
    colour = not os.environ.get("NO_COLOR")
    with _admin_store(args) as store:
        tasks = _watch_targets(store, args.task_id)
        if not tasks:
            if not args.json:
                print("no unfinished tasks to watch")
            return 0
        view = _WatchView(sys.stdout, args.json, colour)
        steps = {}
        try:
            while True:
                live = [t for t in tasks.values() if t is not None and not t.terminal]
                view.show(tasks, steps, store.awaiting_recovery(live))
                if not live:
                    return 0
                # Wakes at once on a status change; progress shows at the next --interval.
                store.wait_any({t.id: t.last_seq for t in live}, timeout=args.interval)
                steps = {}
                for task in live:
                    tasks[task.id], steps[task.id] = _watch_read(store, task)
        except BrokenPipeError:         # the reader has gone (``| head``): nobody to tell
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0


# =============================================================================
# 15. Command line
# =============================================================================
# ``main(argv) -> int``: 0 on success, 1 on a store error (one line on
# stderr), 2 on a usage error (argparse) or a missing package (PostgreSQL's).
# Every command names its own function with ``set_defaults(func=...)`` and
# main() calls it, so no command is special:
# the mcp command, the http command (with the secrets it reads), then the
# ``tasks`` verbs.  Every command that opens a store takes
# --db and --sync from one helper, so they mean the same everywhere.  Options
# refine, never enable: every command works with no options on ./taskstore.db.
# Only command-line code prints (here and the http command); the library logs.

# -- the mcp command ----------------------------------------------------------

def _at_least(minimum, kind=int):
    """An argparse type: a number of *kind* that is at least *minimum*."""
    def parse(text):
        value = kind(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {text}")
        return value
    return parse


def add_mcp_parser(subparsers):
    """Add the ``mcp`` subcommand (an MCP server on stdin/stdout) to *subparsers*."""
    p = subparsers.add_parser(
        "mcp", help="run the MCP server (with the demo tools) on stdin/stdout",
        description="MCP server with tasks for both eras (2025-11-25 after initialize; "
                    "2026-07-28 with the io.modelcontextprotocol/tasks extension when the "
                    "first request carries the _meta envelope), one JSON-RPC message per "
                    "line on stdin/stdout; logs go to stderr.  A finished task expires at "
                    "createdAt + ttl (one that finished later: 60 s after it finished) and "
                    "answers \"has expired\" from that moment on; its row is deleted by the "
                    "next reaper pass (every --reap-interval seconds).")
    _add_db_option(p)                   # --db PATH (./taskstore.db), --sync
    _add_lease_options(p)               # --lease S (30), --heartbeat S (1)
    p.add_argument("--default-ttl", metavar="MS", type=_at_least(1), default=DEFAULT_MCP_TTL_MS,
                   help="ttl granted to a task request that names none (default: %(default)s)")
    p.add_argument("--max-ttl", metavar="MS", type=_at_least(1), default=DEFAULT_MAX_TTL_MS,
                   help="largest ttl granted; larger requests are capped (default: %(default)s)")
    p.add_argument("--allow-unlimited-ttl", action="store_true",
                   help="grant ttl null (never expires) when asked; otherwise null gets "
                        "--max-ttl (default: off)")
    p.add_argument("--poll-interval", metavar="MS", type=_at_least(1),
                   default=DEFAULT_MCP_POLL_INTERVAL_MS,
                   help="pollInterval suggested to clients (default: %(default)s)")
    p.add_argument("--no-list", action="store_true",
                   help="do not declare or serve tasks/list (default: declared)")
    p.add_argument("--page-size", metavar="N", type=_at_least(1), default=DEFAULT_MCP_PAGE_SIZE,
                   help="tasks per tasks/list page (default: %(default)s)")
    p.add_argument("--workers", metavar="N", type=_at_least(1), default=4,
                   help="worker threads running tasks (default: %(default)s)")
    p.add_argument("--max-waiting", metavar="N", type=_at_least(1),
                   default=DEFAULT_MCP_MAX_WAITING,
                   help="requests that wait for work served at once, a thread each (a "
                        "tasks/result for an unfinished task, a tools/call run inline); one "
                        "more is answered -32005 'try again later' at once "
                        "(default: %(default)s)")
    p.add_argument("--max-line-bytes", metavar="N", type=_at_least(1024),
                   default=DEFAULT_MAX_LINE_BYTES,
                   help="longest accepted input line; longer ones get -32600 "
                        "(default: %(default)s)")
    p.add_argument("--reap-interval", metavar="S", type=_at_least(0.001, float),
                   default=DEFAULT_REAP_INTERVAL_S,
                   help="seconds between passes deleting expired tasks (they answer "
                        "\"has expired\" from the moment they expire, deleted or not) and "
                        "recovering those of dead processes (default: %(default)s)")
    p.set_defaults(func=run_mcp)
    return p


def run_mcp(args):
    """Run ``taskstore.py mcp``: serve the demo tools until EOF or SIGTERM; return 0."""
    problem = _check_lease_options(args)
    if problem:
        print(f"taskstore: {problem}", file=sys.stderr)
        return 2
    out = sys.stdout.buffer
    store = TaskStore(args.db, synchronous=args.sync, max_ttl_ms=args.max_ttl,
                      lease_s=args.lease)
    with contextlib.ExitStack() as stack:
        stack.callback(store.close)     # also stops the reaper
        store.start_reaper(args.reap_interval)
        # stdout belongs to the protocol: a stray print in a tool goes to stderr.
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))
        server = McpServer(store, default_ttl_ms=args.default_ttl, max_ttl_ms=args.max_ttl,
                           allow_unlimited_ttl=args.allow_unlimited_ttl,
                           poll_interval_ms=args.poll_interval, list_tasks=not args.no_list,
                           page_size=args.page_size, workers=args.workers,
                           max_line_bytes=args.max_line_bytes, max_waiting=args.max_waiting,
                           heartbeat_s=args.heartbeat)
        add_demo_tools(server)
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, lambda signum, frame: server.stop())
            stack.callback(signal.signal, signal.SIGTERM, previous)
        server.serve(outfile=out)
    return 0


# -- Secrets: bearer tokens and the backend key, off the command line --
# Every message here names where a secret came from (file and line, variable
# and entry), never the secret or the text around it.

TOKENS_ENV = "TASKSTORE_TOKENS"
BACKEND_KEY_ENV = "OPENAI_API_KEY"      # the variable every OpenAI client reads
MIN_TOKEN_CHARS = 8
_SECRET_FILE_MAX = 1 << 20


def _warn(message):
    print(f"taskstore: {message}", file=sys.stderr, flush=True)


def _parse_token(value):
    """Split ``PRINCIPAL=TOKEN``: the one rule for --token, --token-file and TASKSTORE_TOKENS.

    Raises ValueError, whose message does not repeat *value*.
    """
    principal, sep, token = value.partition("=")
    if (not sep or not principal or len(token) < MIN_TOKEN_CHARS or not token.isprintable()
            or " " in token):
        raise ValueError(f"expected PRINCIPAL=TOKEN with a token of at least {MIN_TOKEN_CHARS} "
                         "visible characters")
    return principal, token


def _token_arg(value):
    try:
        return _parse_token(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _read_secret_file(path, what, warn):
    """Return the text of the secrets file *path*; call *warn* if other users may open it.

    ssh refuses a private key that others can read; a server that refused to
    start over a mode would surprise more than it protects, so this only warns.
    Raises ValueError naming the file (never its content).
    """
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            data = f.read(_SECRET_FILE_MAX + 1)
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(data) > _SECRET_FILE_MAX:
        raise ValueError(f"{what} {path} is larger than {_SECRET_FILE_MAX} bytes")
    if os.name == "posix" and stat.S_ISREG(mode) and mode & 0o077:
        warn(f"warning: {what} {path} is open to other users (permissions "
             f"{stat.S_IMODE(mode):04o}); chmod 600 it")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path} is not UTF-8 text") from None


def _load_tokens(given=(), files=(), environ=None, warn=None):
    """Return ``{token: principal}`` from all three sources of bearer tokens, added up.

    *given* are ``(principal, token)`` pairs (``--token``); each of *files*
    holds one ``PRINCIPAL=TOKEN`` a line, with blank lines and lines starting
    with ``#`` skipped (``--token-file``); ``TASKSTORE_TOKENS`` in *environ*
    (default ``os.environ``) holds them separated by commas or newlines.  A
    principal may have several tokens (to rotate one); one token given again
    for the same principal counts once; one token for two principals is an
    error, since a request bearing it would be either.  Raises ValueError
    naming the file and line or the variable and entry; *warn* (default:
    print to stderr) receives the warnings about open files.
    """
    environ = os.environ if environ is None else environ
    warn = warn or _warn
    entries = [(pair, "--token") for pair in given]
    sources = [(path, _read_secret_file(path, "token file", warn).split("\n"), "line")
               for path in files]
    sources.append((TOKENS_ENV, re.split(r"[,\n]", environ.get(TOKENS_ENV, "")), "entry"))
    for name, items, unit in sources:
        for number, item in enumerate(items, 1):
            item = item.strip()
            if not item or (unit == "line" and item.startswith("#")):
                continue
            try:
                entries.append((_parse_token(item), f"{name} {unit} {number}"))
            except ValueError as exc:
                raise ValueError(f"{name} {unit} {number}: {exc}") from None
    tokens, origin = {}, {}
    for (principal, token), where in entries:
        if tokens.setdefault(token, principal) != principal:
            raise ValueError(f"one token is given to {tokens[token]} ({origin[token]}) "
                             f"and to {principal} ({where})")
        origin.setdefault(token, where)
    return tokens


def _load_backend_key(key_file=None, environ=None, warn=None):
    """Return the ``openai`` backend's key: *key_file* if given, else ``OPENAI_API_KEY``.

    The explicit option wins over the environment, as options do.  The file
    holds the key alone (surrounding whitespace and a final newline are
    ignored); an empty or unset variable means no key.  Raises ValueError
    naming the source, never the key.
    """
    environ = os.environ if environ is None else environ
    warn = warn or _warn
    if key_file is not None:
        what = "backend key file"
        key, where = _read_secret_file(key_file, what, warn).strip(), f"{what} {key_file}"
    else:
        key, where = environ.get(BACKEND_KEY_ENV, "").strip(), BACKEND_KEY_ENV
        if not key:
            return None
    if not _is_api_key(key):
        raise ValueError(f"{where} must hold the key alone: visible ASCII characters without "
                         "spaces or line breaks")
    return key


# -- the http command ---------------------------------------------------------

def _origin_arg(value):
    """argparse type of ``--allow-origin``: an origin pattern, lower-cased."""
    origin = value.strip().lower()
    if origin != "*" and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/\s?#]+", origin):
        raise argparse.ArgumentTypeError(
            "expected an origin such as http://localhost:3000 (scheme://host[:port], no path, "
            "* for any part) or * for every origin")
    return origin


def _non_negative(value):
    """argparse type: a float that is at least 0."""
    number = float(value)
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {value}")
    return number


def _positive(kind):
    """An argparse type: a number of *kind* greater than 0."""
    def parse(value):
        number = kind(value)
        if number <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, not {value}")
        return number
    return parse


def add_http_parser(subparsers):
    """Add the ``http`` subcommand (the LMSP server) to the CLI's *subparsers*."""
    p = subparsers.add_parser("http", help="serve the LMSP 1.0 task routes and MCP over HTTP",
                              description="Serve the LMSP 1.0 task routes, and MCP (Streamable "
                                          "HTTP, both eras, the demo tools) at /mcp.")
    _add_db_option(p)                   # --db PATH (./taskstore.db), --sync
    _add_lease_options(p)               # --lease S (30), --heartbeat S (1)
    p.add_argument("--host", default=DEFAULT_HTTP_HOST, help="bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=DEFAULT_HTTP_PORT,
                   help="port; 0 picks a free one (default: %(default)s)")
    p.add_argument("--token", type=_token_arg, action="append", default=[],
                   metavar="PRINCIPAL=TOKEN",
                   help="accept this bearer token for PRINCIPAL; repeatable; visible in ps, so "
                        "prefer --token-file or $TASKSTORE_TOKENS (default: none, no "
                        "authentication, loopback only)")
    p.add_argument("--token-file", action="append", default=[], metavar="FILE",
                   help="read tokens from FILE, one PRINCIPAL=TOKEN a line (# comments); "
                        "repeatable; adds to --token and to $TASKSTORE_TOKENS (comma-separated "
                        "PRINCIPAL=TOKEN) (default: none)")
    p.add_argument("--workers", type=_positive(int), default=4,
                   help="tasks run at once (default: %(default)s)")
    p.add_argument("--backend", choices=("demo", "openai"), default="demo",
                   help="what runs a response task (default: %(default)s)")
    p.add_argument("--backend-url", default=DEFAULT_BACKEND_URL,
                   help="OpenAI-compatible base URL for --backend openai (default: %(default)s)")
    p.add_argument("--backend-key-file", metavar="FILE",
                   help="API key for --backend openai, sent as a bearer token to --backend-url "
                        "(default: $OPENAI_API_KEY, else none)")
    p.add_argument("--demo-delay", type=_non_negative, default=DEFAULT_DEMO_DELAY_S,
                   help="seconds before each demo chunk (default: %(default)s)")
    p.add_argument("--task-retention", type=_positive(float), default=DEFAULT_RETENTION_S,
                   help="seconds a finished task is kept (default: %(default)s)")
    p.add_argument("--event-retention", type=_positive(float), default=None,
                   help="seconds events are kept (default: the task retention)")
    p.add_argument("--idempotency-retention", type=_positive(float), default=DEFAULT_RETENTION_S,
                   help="seconds an Idempotency-Key is remembered (default: %(default)s)")
    p.add_argument("--reap-interval", type=_positive(float), default=60.0,
                   help="seconds between retention passes (default: %(default)s)")
    p.add_argument("--max-body", type=_positive(int), default=DEFAULT_MAX_BODY,
                   help="largest request body in bytes (default: %(default)s)")
    p.add_argument("--request-timeout", type=_positive(float), default=DEFAULT_REQUEST_TIMEOUT_S,
                   help="seconds a client has to send a request (default: %(default)s)")
    p.add_argument("--max-streams", type=_positive(int), default=DEFAULT_MAX_STREAMS,
                   help="concurrent event streams; 503 beyond (default: %(default)s)")
    p.add_argument("--max-connections", type=_positive(int), default=DEFAULT_MAX_CONNECTIONS,
                   help="open connections, each with its thread; 503 beyond (default: %(default)s)")
    p.add_argument("--allow-origin", type=_origin_arg, action="append", default=[],
                   metavar="ORIGIN", help="let pages from this browser origin call the server "
                   "(CORS), like Ollama's OLLAMA_ORIGINS; * matches any part; repeatable "
                   "(default: none, only the server's own pages)")
    p.add_argument("--keepalive-interval", type=_positive(float), default=DEFAULT_KEEPALIVE_S,
                   help="seconds between SSE keep-alive comments (default: %(default)s)")
    p.add_argument("--max-db-bytes", type=_positive(int), default=None,
                   help="cap on the store file's size; writes beyond it get 503 (default: none)")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="log every request line at DEBUG level (never headers or tokens; "
                        "default: INFO)")
    p.add_argument("--insecure-bind", action="store_true",
                   help="allow a non-loopback address without --token (default: refused)")
    p.add_argument("--no-mcp", action="store_true",
                   help="do not serve MCP at /mcp (default: served, with the demo tools)")
    p.add_argument("--no-metrics", action="store_true",
                   help="do not serve GET /metrics, the Prometheus text format (default: "
                        "served, behind the same Host checks and tokens as every route)")
    p.set_defaults(func=cmd_http)
    return p


def cmd_http(args):
    """Run the LMSP server until SIGTERM or Ctrl-C; return the exit status."""
    try:
        tokens = _load_tokens(args.token, args.token_file)
        key = _load_backend_key(args.backend_key_file) if args.backend == "openai" else None
        backend = make_backend(args.backend, demo_delay=args.demo_delay, url=args.backend_url,
                               api_key=key)
    except ValueError as exc:
        print(f"taskstore: {exc}", file=sys.stderr)
        return 2
    problem = _check_lease_options(args)
    if problem:
        print(f"taskstore: {problem}", file=sys.stderr)
        return 2
    if not tokens and not _is_loopback(args.host) and not args.insecure_bind:
        print(f"taskstore: refusing to serve {args.host} without tokens (--token, --token-file "
              f"or {TOKENS_ENV}; use --insecure-bind to allow it)", file=sys.stderr)
        return 2
    event_retention = args.event_retention or args.task_retention
    store_retention = None if args.event_retention is None else int(args.event_retention * 1000)
    if args.verbose:
        logging.getLogger().setLevel(logging.DEBUG)
    store = TaskStore(args.db, event_retention_ms=store_retention, synchronous=args.sync,
                      max_bytes=args.max_db_bytes, lease_s=args.lease)
    handlers = {"response": response_handler(backend)}
    mcp = None
    if not args.no_mcp:
        mcp = McpHttp(store)
        add_demo_tools(mcp)
        handlers[MCP_TASK_KIND] = mcp.run_task
    runner = Runner(store, handlers, workers=args.workers, heartbeat_s=args.heartbeat)
    app = LMSPApp(store, backend, tokens=tokens, max_body=args.max_body,
                  task_retention=args.task_retention, event_retention=event_retention,
                  idempotency_retention=args.idempotency_retention,
                  request_timeout=args.request_timeout, max_streams=args.max_streams,
                  keepalive_interval=args.keepalive_interval, allow_origins=args.allow_origin,
                  mcp=mcp, metrics=not args.no_metrics)
    try:
        server = LMSPServer(app, args.host, args.port, args.max_connections)
    except OSError as exc:
        store.close()
        print(f"taskstore: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    runner.start()
    if mcp is not None:
        mcp.owner = runner.process_id
        store.add_listener(mcp.on_change)
    store.start_reaper(args.reap_interval)

    # shutdown() waits for serve_forever() to return, so it cannot run in the
    # thread serving (where signal handlers run); a helper thread calls it.
    def stop(signum, frame):
        threading.Thread(target=server.shutdown, daemon=True).start()
    # Only the main thread may set a handler; a caller running this elsewhere
    # stops the server by its own means.  The handler we replace comes back on
    # return, so an application that runs the server and then goes on keeps its own.
    replace = threading.current_thread() is threading.main_thread()
    if replace:
        previous = signal.signal(signal.SIGTERM, stop)
    print(f"taskstore: listening on {server.url}", file=sys.stderr, flush=True)
    try:
        # shutdown() returns at the loop's next look: SIGTERM stops accepting within
        # 50 ms (a look is a select() of microseconds; longer ones made every stop wait).
        server.serve_forever(poll_interval=0.05)
    except KeyboardInterrupt:
        pass
    finally:
        app.close()
        if mcp is not None:
            mcp.close()
        server.server_close()
        runner.stop(timeout=HTTP_SHUTDOWN_GRACE_S)
        store.close()
        # The counterpart of the listening line: the server has let go of the port and the file.
        print(f"taskstore: stopped listening on {server.url}", file=sys.stderr, flush=True)
        # Last, so that a second SIGTERM while closing does not cut the close short.
        # (None: the handler was not set from Python, so the default is the best guess.)
        if replace:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    return 0


def _add_db_option(parser):
    """Add the two options of every command that opens a store file: ``--db``, ``--sync``."""
    parser.add_argument("--db", default=DEFAULT_DB, metavar="PATH",
                        help="the store file, or a postgresql:// URL (default: %(default)s in "
                             "the current folder)")
    parser.add_argument("--sync", choices=("normal", "full"), default="normal",
                        help="SQLite synchronous mode: normal survives process crashes, full "
                             "also power loss (default: %(default)s)")


def _add_lease_options(parser):
    """Add the two options of every command that runs tasks: ``--lease``, ``--heartbeat``."""
    parser.add_argument("--lease", metavar="S", type=_positive(float), default=DEFAULT_LEASE_S,
                        help="seconds without a heartbeat after which a process is dead and "
                             "any other process applies the restart policy to its tasks "
                             "(default: %(default)s)")
    parser.add_argument("--heartbeat", metavar="S", type=_positive(float),
                        default=DEFAULT_HEARTBEAT_S,
                        help="seconds between heartbeats renewing the lease; on PostgreSQL "
                             "each one also recovers dead processes' tasks; must be below "
                             "--lease (default: %(default)s)")


def _check_lease_options(args):
    """The lease options' error message, or None when they are consistent."""
    if args.heartbeat >= args.lease:
        return f"--heartbeat ({args.heartbeat:g} s) must be below --lease ({args.lease:g} s)"
    return None


def build_parser():
    """Return the argparse parser of the ``taskstore`` command."""
    parser = argparse.ArgumentParser(
        prog="taskstore", description="A durable task store: MCP and LMSP servers, admin tools.")
    parser.add_argument("--version", action="version", version=f"taskstore {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    add_mcp_parser(commands)
    add_http_parser(commands)
    _add_tasks_parser(commands)
    return parser


def _add_tasks_parser(commands):
    """Add ``tasks`` and its verbs, the admin commands, to the command line's *commands*."""
    tasks = commands.add_parser("tasks", help="inspect and manage a store file",
                                description="Inspect and manage the tasks of a store file.")
    verbs = tasks.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True

    def verb(name, help_text, func,
             json_help="print JSON for scripts instead of a table (default: table)"):
        sub = verbs.add_parser(name, help=help_text, description=help_text)
        _add_db_option(sub)
        sub.add_argument("--json", action="store_true", help=json_help)
        sub.set_defaults(func=func)
        return sub

    sub = verb("list", "List tasks, newest first.", _tasks_list)
    sub.add_argument("--status", action="append", type=_status_filter, metavar="WORD",
                     help="only tasks in this status: a stored status (" + ", ".join(STATES)
                          + "), or an MCP word (working means queued, loading and running; "
                          "completed means succeeded); mcp:WORD and lmsp:WORD take a "
                          "protocol's meaning exactly (lmsp:running includes input_required, "
                          "mcp:cancelled includes cancelling) (repeatable; default: all)")
    sub.add_argument("--kind", action="append", help="only this kind (repeatable; default: all)")
    sub.add_argument("--principal", help="only this principal's tasks (default: everyone's)")
    sub.add_argument("--limit", type=int, default=50, help="page size (default: %(default)s)")
    sub.add_argument("--cursor", help="the next_cursor a previous page printed (default: first page)")
    sub.add_argument("--error-code", metavar="CODE", help="only failed tasks whose error has "
                     "this code: the dead letters of one cause (default: any)")
    sub = verb("show", "Show one task in full.", _tasks_show)
    sub.add_argument("task_id", help="the task id")
    sub = verb("cancel", "Cancel a task.", _tasks_cancel)
    sub.add_argument("task_id", help="the task id")
    sub = verb("events", "Print a task's event log.", _tasks_events)
    sub.add_argument("task_id", help="the task id")
    sub.add_argument("--after", type=int, help="only events after this sequence number "
                     "(default: from the first)")
    sub = verb("retry", "Run a failed task again, as a new task with the next attempt number "
               "(the failed one keeps its status and history).", _tasks_retry)
    sub.add_argument("task_id", help="the failed task's id")
    sub.add_argument("--delay", type=_non_negative, metavar="S",
                     help="not before this many seconds from now (default: at once)")
    sub = verb("limit", "Set (or with --remove, drop) the most tasks of a kind that may run at "
               "once, in every process sharing the store.", _tasks_limit)
    sub.add_argument("kind", help="the task kind")
    sub.add_argument("max_running", nargs="?", type=int, metavar="N",
                     help="the most that may run at once (0 holds the kind's tasks queued)")
    sub.add_argument("--remove", action="store_true", help="drop the kind's limit (default: set N)")
    verb("limits", "List the limits per kind.", _tasks_limits)
    verb("reap", "Delete what retention says is over, now.", _tasks_reap)
    verb("recover", "Apply the restart policy to tasks whose owner is provably dead.",
         _tasks_recover)
    sub = verb("watch", "Follow tasks live, from any process sharing the file: progress bars, "
               "messages and status changes, until every watched task has finished or Ctrl-C.",
               _tasks_watch, json_help="print one JSON object per change, one a line "
               "(default: a live view on a terminal, one plain line per change otherwise)")
    sub.description += (" Exits 0 then, 1 on an unknown id. On a terminal the rows are redrawn "
                        "in place, in colour unless NO_COLOR is set.")
    sub.add_argument("task_id", nargs="*", help="the tasks to watch (default: the tasks "
                     "unfinished when watch starts; tasks created later are not watched)")
    sub.add_argument("--interval", type=_positive(float), default=WATCH_INTERVAL_S,
                     metavar="S", help="seconds between re-reads of progress and messages, "
                     "which are not events (status changes show at once) (default: %(default)s)")
    _add_schedules_parser(verbs)
    return tasks


def _add_schedules_parser(verbs):
    """Add ``tasks schedules`` and its verbs (periodic tasks) to ``tasks``'s *verbs*."""
    schedules = verbs.add_parser(
        "schedules", help="list, add, pause, resume and remove periodic tasks",
        description="Periodic tasks: a runner sharing the store creates one task per period "
                    "(cron expressions and every=N periods are UTC).")
    actions = schedules.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True

    def action(name, help_text, writes=True):
        sub = actions.add_parser(name, help=help_text, description=help_text)
        _add_db_option(sub)
        sub.add_argument("--json", action="store_true",
                         help="print JSON for scripts instead of a table (default: table)")
        sub.set_defaults(func=_tasks_schedules, writes=writes)
        return sub

    action("list", "List the schedules, by name.", writes=False)
    sub = action("add", "Add a schedule, or redefine the one of that name.")
    sub.add_argument("name", help="the schedule's name")
    sub.add_argument("kind", help="the kind of the tasks it creates")
    period = sub.add_mutually_exclusive_group(required=True)
    period.add_argument("--every", type=_positive(float), metavar="S",
                        help="one task every S seconds (periods start at multiples of S "
                             "since the epoch, UTC) (default: none; give --every or --cron)")
    period.add_argument("--cron", metavar="EXPR",
                        help='one task per match of a 5-field cron expression, in UTC '
                             '(say "*/5 * * * *") (default: none; give --every or --cron)')
    sub.add_argument("--payload", default="null", metavar="JSON",
                     help="the tasks' payload, a JSON value (default: null)")
    sub.add_argument("--policy", choices=POLICIES, default="fail",
                     help="the tasks' restart policy (default: %(default)s)")
    sub.add_argument("--retention", type=_non_negative, metavar="S",
                     help="keep each finished task S seconds (default: none, kept until "
                          "deleted, as create's)")
    for name, help_text in (("pause", "Stop firing a schedule (its periods pass unfired)."),
                            ("resume", "Fire a paused schedule again, from its next period."),
                            ("remove", "Delete a schedule (its tasks stay).")):
        action(name, help_text).add_argument("name", help="the schedule's name")


def _schedule_view(schedule):
    view = schedule._asdict()
    view["period"] = (f"every {schedule.every_ms / 1000:g} s" if schedule.every_ms is not None
                      else f"cron {schedule.cron}")
    return view


def _tasks_schedules(args):
    """``tasks schedules ACTION``: change the schedules if asked, then print them."""
    with _admin_store(args, writes=args.writes) as store:
        if args.action == "add":
            try:
                payload = json.loads(args.payload)
            except ValueError:
                raise InvalidParams("--payload must be a JSON value", param="payload") from None
            store.schedules.add(args.name, args.kind, payload, policy=args.policy,
                                every=args.every, cron=args.cron, retention_ms=None if (
                                    args.retention is None) else int(args.retention * 1000))
        elif args.action != "list":
            getattr(store.schedules, args.action)(args.name)
        schedules = store.schedules.list()
    if args.action not in ("list", "remove"):
        schedules = [s for s in schedules if s.name == args.name]
    if args.json:
        print(dumps({"schedules": [_schedule_view(s) for s in schedules]}))
    elif args.action == "remove":
        print(f"removed schedule {args.name}")
    else:
        _print_table([(s.name, s.kind, _schedule_view(s)["period"],
                       "paused" if s.paused else "active", iso_time(s.next_at),
                       iso_time(s.last_fired_at) or "-", s.last_task or "-")
                      for s in schedules],
                     ("NAME", "KIND", "PERIOD", "STATE", "NEXT", "LAST FIRED", "LAST TASK"))
    return 0


def _status_words():
    """Return ``{word: stored statuses}`` for every word ``tasks list --status`` takes.

    Built from the two projections (``mcp_status``, ``lmsp_status``) over
    the stored statuses, never written out by hand: a stored status means
    itself; ``mcp:W`` and ``lmsp:W`` mean every stored status the protocol
    shows as W; a bare MCP word that is no stored status (``working``,
    ``completed``) means what MCP means by it.
    """
    words = {state: (state,) for state in STATES}
    for prefix, project in (("mcp", mcp_status), ("lmsp", lmsp_status)):
        for state in STATES:
            word = f"{prefix}:{project(state)}"
            words[word] = words.get(word, ()) + (state,)
    for state in STATES:
        words.setdefault(mcp_status(state), words[f"mcp:{mcp_status(state)}"])
    return words


def _status_filter(text):
    """argparse type of ``--status``: the stored statuses *text* means."""
    words = _status_words()
    if text not in words:
        raise argparse.ArgumentTypeError(
            f"unknown status {text!r}; use one of {', '.join(sorted(words))}")
    return words[text]


def _clip(text, width):
    """*text* cut to *width* characters, an ellipsis marking a cut."""
    return text if len(text) <= width else text[:width - 1] + "\u2026"


def _admin_view(task, awaiting):
    """The admin commands' view of *task*: as stored, plus both protocols' words.

    ``owner_dead``: the task is unfinished and its owner provably dead
    (*awaiting*: the ids ``TaskStore.awaiting_recovery`` returned).
    """
    view = {}
    for key, value in task.to_dict().items():
        view[key] = value
        if key == "status":
            view.update(mcp_status=mcp_status(task), lmsp_status=lmsp_status(task),
                        owner_dead=task.id in awaiting)
    return view


def _status_cell(task, awaiting):
    if task.id in awaiting:
        return f"{task.status} (owner dead: will be recovered; `tasks recover` does it now)"
    queue = _queue_fields(task)
    notes = []
    if "run_at" in queue:
        notes.append(f"not before {iso_time(queue['run_at'])}")
    if "max_attempts" in queue:
        notes.append(f"attempt {queue['attempt']} of {queue['max_attempts']}")
    elif "attempt" in queue:
        notes.append(f"attempt {queue['attempt']}")
    if "priority" in queue:
        notes.append(f"priority {queue['priority']}")
    return f"{task.status} ({', '.join(notes)})" if notes else task.status


def _print_table(rows, headers):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    for row in [headers, *rows]:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())


def _admin_store(args, writes=False):
    """Open ``--db`` for a ``tasks`` verb: read-only unless it *writes*.

    Never creates a store file (a mistyped path is an error, not a new empty
    store) and never recovers on open: only ``tasks recover`` moves tasks of
    dead owners, so that looking at a store never changes it.
    """
    if not is_postgres_url(args.db) and not os.path.exists(args.db):
        raise StoreUnavailable(f"{args.db}: no such store file")
    return TaskStore(args.db, synchronous=args.sync, recover_on_open=False, readonly=not writes)


def _tasks_list(args):
    """``tasks list``: one page of tasks, newest first, and the cursor of the next."""
    with _admin_store(args) as store:
        statuses = None if args.status is None else sorted(
            {state for states in args.status for state in states})
        tasks, cursor = store.list(status=statuses, kind=args.kind, principal=args.principal,
                                   limit=args.limit, cursor=args.cursor,
                                   error_code=args.error_code)
        awaiting = store.awaiting_recovery(tasks)
        if args.json:
            print(dumps({"tasks": [_admin_view(t, awaiting) for t in tasks],
                         "next_cursor": cursor}))
        else:
            _print_table([(t.id, t.kind, _status_cell(t, awaiting), iso_time(t.created_at),
                           iso_time(t.updated_at), _clip(t.status_message or "", 40))
                          for t in tasks], ("ID", "KIND", "STATUS", "CREATED", "UPDATED",
                                            "MESSAGE"))
            if cursor:
                print(f"next page: --cursor {cursor}")
    return 0


def _tasks_show(args):
    """``tasks show``: one task in full."""
    with _admin_store(args) as store:
        _print_task(store, store.get(args.task_id), args.json)
    return 0


def _tasks_cancel(args):
    """``tasks cancel``: cancel a task, then show it as ``tasks show`` does."""
    with _admin_store(args, writes=True) as store:
        _print_task(store, store.cancel(args.task_id), args.json)
    return 0


def _tasks_retry(args):
    """``tasks retry``: run a failed task again (``TaskStore.rerun``), then show the new task."""
    with _admin_store(args, writes=True) as store:
        _print_task(store, store.rerun(args.task_id, delay=args.delay), args.json)
    return 0


def _tasks_limit(args):
    """``tasks limit``: set or drop a kind's limit, then list the limits."""
    if args.remove == (args.max_running is not None):
        raise InvalidParams("give N, or --remove", param="max_running")
    with _admin_store(args, writes=True) as store:
        store.set_kind_limit(args.kind, None if args.remove else args.max_running)
        _print_limits(store, args.json)
    return 0


def _tasks_limits(args):
    """``tasks limits``: every limit per kind."""
    with _admin_store(args) as store:
        _print_limits(store, args.json)
    return 0


def _print_limits(store, as_json):
    limits = store.kind_limits()
    if as_json:
        print(dumps(limits))
    else:
        _print_table(sorted(limits.items()), ("KIND", "MAX RUNNING"))


def _print_task(store, task, as_json):
    awaiting = store.awaiting_recovery([task])
    view = _admin_view(task, awaiting)
    if as_json:
        print(dumps(view))
        return
    view["status"] = _status_cell(task, awaiting)
    for key, value in view.items():
        if key.endswith("_at") and isinstance(value, int):
            value = iso_time(value)
        print(f"{key + ':':16}{value if isinstance(value, str) else dumps(value)}")


def _tasks_events(args):
    """``tasks events``: a task's event log, oldest first."""
    with _admin_store(args) as store:
        events = store.events(args.task_id, after=args.after)
    if args.json:
        print(dumps([{"task_id": e.task_id, "seq": e.seq, "type": e.type,
                      "data": e.data, "created_at": e.created_at} for e in events]))
    else:
        _print_table([(e.seq, iso_time(e.created_at), e.type, _clip(e.data_json, 60))
                      for e in events], ("SEQ", "TIME", "TYPE", "DATA"))
    return 0


def _tasks_reap(args):
    """``tasks reap``: one retention pass now; print what it deleted."""
    with _admin_store(args, writes=True) as store:
        begun = time.monotonic()
        counts = store.reap()
        seconds = time.monotonic() - begun
    print(dumps({**counts, "seconds": round(seconds, 3)}) if args.json else
          _reap_report(counts, seconds))
    return 0


def _tasks_recover(args):
    """``tasks recover``: hand the tasks of dead owners to their restart policy now."""
    with _admin_store(args, writes=True) as store:
        moved = store.recover()
    print(dumps({"recovered": moved}) if args.json else
          f"{moved} {'task' if moved == 1 else 'tasks'} recovered")
    return 0


# ``tasks watch``.  Status changes are events, so ``wait_any`` wakes on them
# at once (another process's within the store's poll interval); progress and
# messages are not, so every wake-up, and at the latest every --interval,
# re-reads the watched tasks.  Each status change is read from the event log,
# so a task that went running -> succeeded between two reads shows both.
# Three ways to print one change: a live board on a terminal (a row per task,
# redrawn in place, the status changes scrolling above it), a plain line on a
# pipe, a JSON object with --json.
WATCH_INTERVAL_S = 0.5
_WATCH_BAR = 20                 # the progress bar's width, at most
_WATCH_COLOURS = {QUEUED: "2", LOADING: "36", RUNNING: "36", INPUT_REQUIRED: "35",
                  CANCELLING: "33", CANCELLED: "33", SUCCEEDED: "32", FAILED: "31"}
_GONE = "gone (expired or deleted)"


def main(argv=None):
    """Run the ``taskstore`` command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="taskstore: %(levelname)s %(message)s")
    try:
        return args.func(args)              # every command sets its own (set_defaults)
    except MissingDependency as exc:
        print(f"taskstore: error: {exc}", file=sys.stderr)
        return 2
    except TaskStoreError as exc:
        print(f"taskstore: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
