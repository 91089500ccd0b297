"""pepsi_stage: write pepsi-dispatch stages in Python.

A stage becomes a handler function; this module speaks the worker protocol of
pepsi-worker(7), holds the database connection (psycopg 3) and writes each message's
outcome, batching the ids waiting on standard input the way the Go SDK (package
pepsi-dispatch/stage) does::

    import pepsi_stage

    def handle(m: pepsi_stage.Message) -> None:
        m.state["seen"] = True
        m.execute("INSERT INTO audit (id) VALUES (%s)", (m.id,))
        m.advance("next-stage")

    if __name__ == "__main__":
        pepsi_stage.run(handle)

It is one module with no dependency besides psycopg 3 (Debian: python3-psycopg), for Python
3.9 or later: install it with ``pip install ./python`` or copy this file beside the stage.
doc/python.md is the guide; what follows is how it works.

The batch. Every id already waiting on standard input (at least one, at most 256) is one
batch, and its status lines are written together at its end:

* one load ``SELECT ... FROM workqueue WHERE workqueue_id = ANY($ids) AND status = 'running'
  AND stage = $stage`` (``workqueue_id = $id`` for a batch of one; an id it does not return is
  answered "1 ... (claim lost)");
* for each message, in order, the handler. Its statements (Message.execute) run in a
  savepoint of its own, opened lazily before its first statement (the batch's first savepoint
  also sends BEGIN): a handler that raises has its writes rolled back to that savepoint, and
  the other messages of the batch are not affected;
* COMMIT, if BEGIN was sent;
* the outcomes of the handlers that sent no statement ("kept" outcomes: they have nothing to
  commit with) in one guarded UPDATE ... FROM unnest(...) by primary key, after the commit.

A batch stops taking messages (the ids left over start the next one) when the next could take
the transaction past 64 savepoints (the subtransactions PostgreSQL caches per backend), or
when it has run for 100 ms. After a batch that began a transaction, at most 64 ids are read.
A batch of no-op handlers thus costs 2 statements, whatever its size.

Guards. Every outcome is one UPDATE (or fanout_split*) guarded by ``status = 'running' AND
stage = <this stage>``; when it changes no row, the claim is gone and the message is answered
non-zero (the dispatcher's failure write is guarded too and changes nothing). A handler never
writes a failure: it raises, and the dispatcher records the failure.

Isolation. The batch transaction is READ COMMITTED (``BEGIN ISOLATION LEVEL READ COMMITTED``)
whatever the database's or role's default_transaction_isolation, as the dispatcher's sessions
are (and the Go SDK's): a batch of many messages at SERIALIZABLE takes a predicate lock on the
whole queue table and fails every other worker's batch, each failure failing all its messages.
The statements sent alone (the load, the kept outcomes) run at the session's level; a batch or
an outcome statement that ends in a serialization failure or a deadlock (40001, 40P01) before
anything of it committed is run again, up to TRANSIENT_TRIES times in all.

Encoding. The connection asks for UTF8 (``client_encoding``) whatever the role, the database or
the DSN sets, as lib/pq does for the Go SDK and the dispatcher: a payload or a state may hold
any character, and under a role's LATIN1 the server refused to send one it has no LATIN1 for.

Idle sessions. The worker's session is idle between batches, for up to the dispatcher's
WORKER_IDLE_TIMEOUT, and the dispatcher stops an idle worker itself: the session turns off a
role's idle_session_timeout (PostgreSQL 14) for itself when it connects, as the Go SDK's and the
dispatcher's sessions do; the server would otherwise end it at every quiet spell longer than
the timeout.

Lost connection. The Go SDK exits; this one reconnects (for up to RECONNECT_TIMEOUT seconds,
and only while the dispatcher that started it is its parent) and runs the interrupted batch
again. That is safe because nothing of an interrupted batch is trusted: the batch is loaded
again under the same guards plus the claim token the dispatcher wrote when it handed the rows
out, so a row whose outcome did commit before the connection broke (it is no longer running
here) is answered "1 ... (claim lost)" and is not run twice, and a row that a new claim took
over is not touched.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import random
import re
import sys
import time
import traceback
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import psycopg
from psycopg import errors as pg_errors

__all__ = [
    "Config",
    "Message",
    "Handler",
    "FaninResult",
    "FailedChild",
    "Fail",
    "ClaimLost",
    "NotNext",
    "OutcomeChosen",
    "NotParent",
    "GroupOpen",
    "ConnectionLost",
    "load_config",
    "run",
    "run_stages",
    "serve",
]

__version__ = "1.0.0"

MAX_SUBXIDS = 64
"""Savepoints one batch transaction may open: PostgreSQL caches 64 subtransaction XIDs per
backend (PGPROC_MAX_CACHED_SUBXIDS); past that every snapshot in the cluster gets slower."""

MAX_BATCH = 256
"""Most ids read for one batch."""

MAX_BATCH_TIME = 0.1
"""Seconds a batch takes new messages: its replies wait for its end, and MAX_RUNTIME counts
for its first message from the previous batch's answer."""

MAX_REASON = 1000
"""Longest failure reason put on a status line, in bytes."""

TRANSIENT_TRIES = 8
"""Times in all a batch, or an outcome statement sent alone, is run when each try ends in a
serialization failure or a deadlock: then the last error fails its messages as any other."""

# The connection parameters that give up on a vanished server (connect): libpq's keyword, the
# environment variable that sets it instead, and the value, on the schedule of the
# dispatcher's LOCK_KEEPALIVE default (internal/pgsession/vanish.go): probes after 5 s of
# silence, then every second, 10 s in all; 5 s for a connect, per host.
_VANISH_PARAMS = (
    ("connect_timeout", "PGCONNECT_TIMEOUT", "5"),
    ("keepalives_idle", "", "5"),
    ("keepalives_interval", "", "1"),
    ("keepalives_count", "", "5"),
    ("tcp_user_timeout", "", "10000"),
)

_NO_IDLE_TIMEOUT = ("SELECT set_config('idle_session_timeout', '0', false) "
                    "WHERE current_setting('idle_session_timeout', true) <> '0'")
# Sent once per connection: turns idle_session_timeout off where the server has it (PostgreSQL
# 14 and later: current_setting(..., true) is NULL before) and the role, the database or the
# DSN turned it on; nothing is set otherwise. The Go SDK sends the same statement
# (internal/pgsession.NoIdleTimeout).

RECONNECT_TIMEOUT = 30.0
"""Seconds spent reconnecting after the connection is lost, before the worker gives up and
exits 1 (the dispatcher then recovers its messages)."""

MAX_CHILDREN_DEFAULT = 10000
MIN_SPAN_DEFAULT = 1000

_READ_SIZE = 64 << 10
# A line of standard input longer than this is cut to its first _MAX_LINE bytes, as the Go
# SDK's read buffer cuts it (it is no id, and gets its one reply); the rest is not kept.
_MAX_LINE = 64 << 10
_MAX_ID = (1 << 63) - 1
_STAGE_NAME = re.compile(r"[a-z0-9_-]+\Z")  # \Z, not $: "$" would take "name\n"
# What Go's strings.Fields splits on (unicode.IsSpace), which the Go SDK splits PEPSI_NEXT and
# PEPSI_FUSE on: str.split() also splits on \x1c-\x1f, which Go keeps in a name and refuses.
_GO_SPACE = re.compile("[\t\n\v\f\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]+")
# What Go's strconv.ParseInt(text, 10, 32) accepts: ASCII digits (str.isdigit() also takes
# "\u0663" and "\u00b2"), a sign, at most 2**31 - 1.
_GO_INT = re.compile(r"[+-]?[0-9]+\Z")
_SQL_CLAIM_GONE = "PF001"


class Fail(Exception):
    """Raise Fail("reason") in a handler to fail the message with exactly that reason.

    Any other exception fails it too, with "ExceptionType: text" as the reason (and its
    traceback on standard error). Either way, what the handler wrote is rolled back and the
    dispatcher records the failure (attempts + 1, state.dispatch_error, retry or failed).
    """


class ClaimLost(Exception):
    """The row is no longer running at this stage: the dispatcher took the claim back (a
    timeout, a shutdown) or another outcome already moved it."""


class NotNext(ValueError):
    """Advance (or a split's continuation) names a stage that is not in this stage's NEXT."""


class OutcomeChosen(Exception):
    """A second outcome was chosen for the same message."""


class NotParent(Exception):
    """fanin_result: the message never split into a group."""


class GroupOpen(Exception):
    """fanin_result: the message's group has not fired: some children are not terminal."""


class ConnectionLost(Exception):
    """The database connection broke and could not be made again."""


class _Fatal(Exception):
    """Ends the worker with exit status 1 and no answer for the batch in flight."""


class _Lost(Exception):
    """The connection broke during a batch: reconnect and run the batch again."""


class _Transient(Exception):
    """The batch ended in a serialization failure or a deadlock before it committed: nothing
    of it was written, and it may run again."""


def _is_transient(e: BaseException) -> bool:
    return isinstance(e, psycopg.Error) and getattr(e, "sqlstate", None) in ("40001", "40P01")


def _again_after(attempt: int) -> None:
    """Wait before try number attempt (2, 3, ...) of something that failed transiently: 2, 4,
    8 ... ms, at most 100, with jitter, so that two workers that failed each other do not meet
    again at once (the Go SDK's againAfter)."""
    d = min(0.001 * (1 << (attempt - 1)), 0.1)
    time.sleep(d / 2 + random.random() * d)  # a back-off between tries, not a wait for a condition


class Config:
    """What a stage program is started with (see load_config).

    Attributes:
        stage: PEPSI_STAGE, the stage served; every outcome is guarded by it.
        next: PEPSI_NEXT, the stages Message.advance may move a message to.
        dsn: PEPSI_DSN, the libpq connection string (keep its application_name).
        config_file: the ``-c FILE`` argument, "" without one (for the program's own use).
        max_children, min_span: PEPSI_MAX_CHILDREN and PEPSI_MIN_SPAN (0: the defaults),
            Message.split_range's defaults.
        fuse: PEPSI_FUSE parsed: stage -> its NEXT list (stage fusion; run_stages uses it).
    """

    def __init__(self, stage: str, next: Sequence[str] = (), dsn: str = "", config_file: str = "",
                 max_children: int = 0, min_span: int = 0,
                 fuse: Optional[Mapping[str, Sequence[str]]] = None) -> None:
        self.stage = stage
        self.next = list(next)
        self.dsn = dsn
        self.config_file = config_file
        self.max_children = max_children
        self.min_span = min_span
        self.fuse: Dict[str, List[str]] = {k: list(v) for k, v in (fuse or {}).items()}

    def validate(self) -> None:
        """Raise ValueError when a stage name is not [a-z0-9_-]+."""
        if not _STAGE_NAME.match(self.stage or ""):
            raise ValueError(f"stage name {self.stage!r}: want [a-z0-9_-]+ (is PEPSI_STAGE set?)")
        for n in self.next:
            if not _STAGE_NAME.match(n):
                raise ValueError(f"next stage name {n!r}: want [a-z0-9_-]+")
        for name, nxt in self.fuse.items():
            for n in [name, *nxt]:
                if not _STAGE_NAME.match(n):
                    raise ValueError(f"fused stage name {n!r}: want [a-z0-9_-]+")


def _fields(text: str) -> List[str]:
    """text split as Go's strings.Fields splits it."""
    return [f for f in _GO_SPACE.split(text) if f]


def _parse_fuse(text: str) -> Dict[str, List[str]]:
    """PEPSI_FUSE read as the Go SDK reads it: entries STAGE=NEXT1,NEXT2 separated by spaces,
    the list possibly empty ("deliver="); a stage listed twice or an empty or malformed name is
    an error (the dispatcher writes neither)."""
    fuse: Dict[str, List[str]] = {}
    for entry in _fields(text):
        name, sep, rest = entry.partition("=")
        if not sep:
            raise ValueError(f"PEPSI_FUSE entry {entry!r}: want STAGE=NEXT1,NEXT2 (STAGE= for a final stage)")
        if not _STAGE_NAME.match(name):
            raise ValueError(f"PEPSI_FUSE entry {entry!r}: stage name {name!r}: want [a-z0-9_-]+")
        if name in fuse:
            raise ValueError(f"PEPSI_FUSE entry {entry!r}: stage {name} is listed twice")
        nxt = rest.split(",") if rest else []
        for n in nxt:
            if not _STAGE_NAME.match(n):
                raise ValueError(f"PEPSI_FUSE entry {entry!r}: next stage name {n!r}: want [a-z0-9_-]+")
        fuse[name] = nxt
    return fuse


def _parse_args(args: List[str]) -> str:
    """``[-c FILE] worker`` read as Go's flag package reads it for the Go SDK: ``-c FILE``,
    ``-c=FILE``, ``--c FILE`` or ``--c=FILE`` (the last one given wins), ``--`` ends the
    options; ``-cFILE`` is an unknown option there, so it is here. Returns FILE, "" without."""
    config_file = ""
    i = 0
    while i < len(args):
        s = args[i]
        if len(s) < 2 or s[0] != "-":
            break
        i += 1
        if s == "--":
            break
        name = s[2:] if s[1] == "-" else s[1:]
        if not name or name[0] in "-=":
            raise ValueError(f"parse arguments {args!r}: bad option syntax {s!r} (usage: PROGRAM [-c FILE] worker)")
        name, eq, value = name.partition("=")
        if name != "c":
            raise ValueError(f"parse arguments {args!r}: unknown option {s!r} (usage: PROGRAM [-c FILE] worker)")
        if not eq:
            if i == len(args):
                raise ValueError(f"parse arguments {args!r}: option {s!r} needs a FILE (usage: PROGRAM [-c FILE] worker)")
            value = args[i]
            i += 1
        config_file = value
    if args[i:] != ["worker"]:
        raise ValueError(f"parse arguments {args!r}: usage: PROGRAM [-c FILE] worker")
    return config_file


def load_config(argv: Optional[Sequence[str]] = None,
                environ: Optional[Mapping[str, str]] = None) -> Config:
    """Parse ``[-c FILE] worker`` (default sys.argv[1:]) and the PEPSI_* environment.

    Raises ValueError with a message naming what is wrong.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if environ is None else environ
    config_file = _parse_args(args)
    dsn = env.get("PEPSI_DSN", "")
    if not dsn:
        raise ValueError("read environment: PEPSI_DSN is not set (a stage is started by pepsi-dispatch)")
    numbers = {}
    for name in ("PEPSI_MAX_CHILDREN", "PEPSI_MIN_SPAN"):
        text = env.get(name, "")
        if text:
            n = _digits_value(text.lstrip("+-"), 2**31 - 1) if _GO_INT.match(text) else None
            if n is None or n < 1 or text.startswith("-"):
                raise ValueError(f"read environment: {name} = {text!r}: want a positive whole number")
            numbers[name] = n
    cfg = Config(stage=env.get("PEPSI_STAGE", ""), next=_fields(env.get("PEPSI_NEXT", "")), dsn=dsn,
                 config_file=config_file, max_children=numbers.get("PEPSI_MAX_CHILDREN", 0),
                 min_span=numbers.get("PEPSI_MIN_SPAN", 0), fuse=_parse_fuse(env.get("PEPSI_FUSE", "")))
    cfg.validate()
    return cfg


Handler = Callable[["Message"], None]
"""A stage's handler: it chooses exactly one outcome of its Message and returns; raising (or
returning without an outcome, or choosing two) fails the message."""


class FailedChild:
    """A child that ended 'failed', as the continuation stage sees it (fanin_result)."""

    __slots__ = ("id", "seq", "range_lo", "range_hi", "error", "payload")

    def __init__(self, id: int, seq: int, range_lo: Optional[int], range_hi: Optional[int],
                 error: str, payload: Any) -> None:
        self.id = id
        self.seq = seq
        self.range_lo = range_lo
        self.range_hi = range_hi
        self.error = error
        self.payload = payload

    def __repr__(self) -> str:
        return f"FailedChild(id={self.id}, seq={self.seq}, error={self.error!r})"


class FaninResult:
    """How the children of a message's last split ended: counts and the failed ones."""

    __slots__ = ("done", "failed", "failed_children")

    def __init__(self, done: int, failed: int, failed_children: List[FailedChild]) -> None:
        self.done = done
        self.failed = failed
        self.failed_children = failed_children


_UNSET = object()


class Message:
    """One message handed to a handler: its row as loaded at the start of the batch.

    Attributes:
        id: the row's workqueue_id.
        stage: the stage running it (PEPSI_STAGE, or a fused stage).
        attempts: the failed attempts so far (0 at a fused stage).
        payload: the payload, decoded from JSON (None for NULL); never changed by pepsi.
        state: the state object, decoded (a dict); change it freely: the outcome writes it
            back in the same UPDATE. Changes made after the outcome was chosen are not
            written. The dispatcher owns the key "dispatch_error".

    Exactly one outcome: advance, done, defer, split or split_range (or raise to fail).
    """

    __slots__ = ("id", "stage", "attempts", "_payload", "_state_loaded", "_state",
                 "_batch", "_index", "_live", "_chosen", "_second", "_write_error", "_kept",
                 "_took", "_srv")

    def __init__(self, batch: "_Batch", srv: "_Server", index: int, id: int, stage: str, attempts: int,
                 payload: Any, state: Any) -> None:
        self.id = id
        self.stage = stage
        self.attempts = attempts
        self._payload = payload
        self._state_loaded = state
        self._state: Any = _UNSET
        self._batch = batch
        self._srv = srv
        self._index = index
        self._live = True
        self._chosen = ""
        self._second = ""
        self._write_error: Optional[BaseException] = None
        # (stage, status, retry, state): retry is a timestamptz's text, or seconds from the
        # server's now() (a float), or None.
        self._kept: Optional[Tuple[Optional[str], str, Union[str, float, None], Optional[str]]] = None
        self._took = 0.0

    # --- the row -------------------------------------------------------------------------

    @property
    def payload(self) -> Any:
        """The payload, decoded from JSON (None for NULL)."""
        return self._payload

    @property
    def state(self) -> Dict[str, Any]:
        """The state dict. A handler that never uses it leaves the column as it is (the
        outcome does not rewrite it)."""
        if self._state is _UNSET:
            st = self._state_loaded
            if st is None:
                st = {}
            if not isinstance(st, dict):
                raise Fail(f"message {self.id}: state is a JSON {type(st).__name__}, not an object")
            self._state = st
        return self._state

    @state.setter
    def state(self, value: Dict[str, Any]) -> None:
        if not isinstance(value, dict):
            raise TypeError("Message.state must be a dict")
        self._state = value

    def _state_json(self) -> Optional[str]:
        """The state to write: None when the handler never touched it (kept as it is)."""
        if self._state is _UNSET:
            return None
        return json.dumps(self._state, separators=(",", ":"), allow_nan=False)

    # --- the transaction -----------------------------------------------------------------

    def execute(self, query: Any, params: Optional[Union[Sequence[Any], Mapping[str, Any]]] = None,
                prepare: Optional[bool] = None) -> psycopg.Cursor:
        """Run a statement in the message's transaction and return its psycopg cursor.

        The first statement of a message opens its savepoint (and the batch's first, BEGIN):
        what it writes commits together with the message's outcome, and is rolled back alone
        if the handler fails. Do not COMMIT or ROLLBACK; use %s placeholders (psycopg).
        ``prepare`` is psycopg's: pass False for a statement on the queue table (see
        _UNPREPARED).
        """
        if not self._live:
            raise RuntimeError(f"message {self.id}: the handler has already returned")
        return self._batch.execute(self._index, query, params, prepare=prepare)

    def executemany(self, query: Any, params_seq: Iterable[Union[Sequence[Any], Mapping[str, Any]]]) -> None:
        """executemany in the message's transaction (see execute)."""
        if not self._live:
            raise RuntimeError(f"message {self.id}: the handler has already returned")
        self._batch.open_savepoint(self._index)
        self._batch.srv.conn.cursor().executemany(query, params_seq)

    # --- outcomes ------------------------------------------------------------------------

    def advance(self, next: str) -> None:
        """Move the message to ``next``, one of the stage's NEXT stages: stage = next,
        status = 'pending', attempts = 0, and the state, in one UPDATE guarded by the claim.

        Raises NotNext for another stage, OutcomeChosen for a second outcome. When the
        handler has not used execute, the write waits for the end of the batch, and a claim
        found lost then fails the message.
        """
        if next not in self._srv.next_set:
            raise NotNext(f"advance message {self.id} to {next!r}: not a NEXT stage of {self.stage} "
                          f"(NEXT: {' '.join(self._srv.cfg.next)!r})")
        self._choose("advance to " + next, next, "pending", None)

    def done(self) -> None:
        """Finish the message: status = 'done' and the state, in one guarded UPDATE."""
        self._choose("done", None, "done", None)

    def defer(self, until: Union[datetime.datetime, datetime.timedelta, float, int]) -> None:
        """Pause the message until ``until`` (a datetime, naive meaning UTC; or a timedelta
        or a number of seconds from now): status = 'paused', retry_at, and the state. The
        dispatcher makes it pending at this stage again when it is due. Not a failure:
        attempts is unchanged.

        "From now" is from the database server's now(), as RETRY_DELAY is: the worker's
        clock need not agree with the server's, and a delay added to the worker's clock was
        due at once on a server whose clock was ahead by more than it. A datetime is a time
        the server's clock judges."""
        if isinstance(until, datetime.datetime):
            at = until if until.tzinfo else until.replace(tzinfo=datetime.timezone.utc)
            self._choose("defer until " + at.isoformat(), None, "paused", at.isoformat())
            return
        seconds = until.total_seconds() if isinstance(until, datetime.timedelta) else float(until)
        if not math.isfinite(seconds):
            raise ValueError(f"defer message {self.id}: {until!r} is not a finite delay")
        self._choose(f"defer for {seconds:g} s", None, "paused", seconds)

    def split(self, continuation: str, child_stage: str, payloads: Sequence[Any]) -> Optional[int]:
        """Fan out: one child message at ``child_stage`` per element of ``payloads`` (its
        payload, any JSON value), and this message 'waiting' at ``continuation`` (one of NEXT)
        with its state, until every child is done or failed; the dispatcher then makes it
        pending at ``continuation`` once. No payloads: it advances to continuation at once.

        One statement, fanout_split, in the message's transaction (an outcome written at
        once). Returns the group's fanout_id (None for no children). Raises ClaimLost when
        the claim is gone. The child stage need not be in NEXT; the continuation must be.
        """
        what = f"split into {len(payloads)} children at {child_stage}"
        self._check_split(what, continuation, child_stage)
        arr = json.dumps(list(payloads), separators=(",", ":"), allow_nan=False)
        return self._split(what, "SELECT fanout_split(%s, %s, %s, %s, %s::jsonb, %s::jsonb)",
                           lambda st: (self.id, self.stage, continuation, child_stage, arr, st))

    def split_range(self, continuation: str, child_stage: str, lo: Optional[int], hi: Optional[int],
                    max_children: int = 0, min_span: int = 0, id_query: Optional[str] = None,
                    payload: Any = None) -> Optional[int]:
        """Fan out over the id range [lo, hi] (both inclusive; None, None: no rows, an empty
        split): children at ``child_stage`` for contiguous half-open slices [range_lo,
        range_hi) covering it, equal width, or equal row counts with ``id_query`` (a query
        whose first column is the ids, run once, without parameters). ``max_children`` and
        ``min_span`` default to the stage's MAX_CHILDREN and MIN_SPAN. ``payload`` is every
        child's payload. Otherwise as split."""
        what = f"split [{lo}, {hi}] at {child_stage}"
        self._check_split(what, continuation, child_stage)
        mc = max_children or self._srv.cfg.max_children or MAX_CHILDREN_DEFAULT
        ms = min_span or self._srv.cfg.min_span or MIN_SPAN_DEFAULT
        if mc < 0 or ms < 0:
            raise ValueError(f"{what}, message {self.id}: max_children and min_span must not be negative")
        pl = None if payload is None else json.dumps(payload, separators=(",", ":"), allow_nan=False)
        if id_query is None:
            q = "SELECT fanout_split_range(%s, %s, %s, %s, %s, %s, %s, %s, %s::jsonb, %s::jsonb)"
            return self._split(what, q, lambda st: (self.id, self.stage, continuation, child_stage, lo, hi,
                                                    mc, ms, pl, st))
        q = ("SELECT fanout_split_bounds(%s, %s, %s, %s, fanout_count_bounds(%s, %s, %s, %s, %s),"
             " %s::jsonb, %s::jsonb)")
        return self._split(what, q, lambda st: (self.id, self.stage, continuation, child_stage, id_query,
                                                lo, hi, mc, ms, pl, st))

    def fanin_result(self) -> FaninResult:
        """In the continuation stage: how the children of the last split ended (counts as of
        the group's fire, failed children in split order). Reads; chooses no outcome.
        Raises NotParent if the message never split, GroupOpen if its group has not fired."""
        row = self.execute("SELECT state, done_n, failed_n FROM fanin_result(%s)", (self.id,)).fetchone()
        if row is None:
            raise NotParent(f"fan-in result of message {self.id}: message has no fan-out group")
        state, done, failed = row
        if state != "fired":
            raise GroupOpen(f"fan-in result of message {self.id}: fan-out group has not fired yet "
                            f"({done} done, {failed} failed so far)")
        children: List[FailedChild] = []
        if failed:
            cur = self.execute("SELECT workqueue_id, fanout_seq, range_lo, range_hi, "
                               "coalesce(dispatch_error, ''), payload FROM fanin_failed_children(%s)",
                               (self.id,))
            children = [FailedChild(*r) for r in cur.fetchall()]
        return FaninResult(done, failed, children)

    # --- outcome machinery ---------------------------------------------------------------

    def _begin_outcome(self, what: str) -> None:
        if not self._live:
            raise RuntimeError(f"{what} for message {self.id}: the handler has already returned")
        if self._chosen:
            if not self._second:
                self._second = what
            raise OutcomeChosen(f"{what} for message {self.id}: an outcome was already chosen ({self._chosen})")
        self._chosen = what

    def _choose(self, what: str, stage: Optional[str], status: str, retry_at: Union[str, float, None]) -> None:
        self._begin_outcome(what)
        try:
            state = self._state_json()
        except (TypeError, ValueError) as e:
            self._write_error = e
            raise Fail(f"{what} message {self.id}: encode state: {e}") from e
        self._kept = (stage, status, retry_at, state)
        if self._batch.is_open(self._index):
            # The handler has written: the outcome goes with its writes, in its savepoint.
            self._write_kept()

    def _write_kept(self) -> None:
        assert self._kept is not None
        stage, status, retry_at, state = self._kept
        self._kept = None
        sets = ["status = %s, status_at = now()"]  # status_at: see operate.sql
        args: List[Any] = [status]
        if stage is not None:
            sets.append("stage = %s, attempts = 0")
            args.append(stage)
        if isinstance(retry_at, float):
            sets.append("retry_at = now() + make_interval(secs => %s::float8)")
            args.append(retry_at)
        elif retry_at is not None:
            sets.append("retry_at = %s::timestamptz")
            args.append(retry_at)
        if state is not None:
            sets.append("state = %s::jsonb")
            args.append(state)
        args += [self.id, self._srv.cfg.stage]
        try:
            cur = self._batch.execute(self._index, "UPDATE workqueue SET " + ", ".join(sets) +
                                      " WHERE workqueue_id = %s AND status = 'running' AND stage = %s", args,
                                      prepare=False)  # _UNPREPARED
        except psycopg.Error as e:
            self._write_error = e
            raise
        if cur.rowcount == 0:
            err = ClaimLost(f"{self._chosen} message {self.id}: row is no longer running at stage "
                            f"{self._srv.cfg.stage} (claim lost)")
            self._write_error = err
            raise err

    def _check_split(self, what: str, continuation: str, child_stage: str) -> None:
        if continuation not in self._srv.next_set:
            raise NotNext(f"{what}, message {self.id}: continuation {continuation!r} is not a NEXT stage "
                          f"of {self.stage} (NEXT: {' '.join(self._srv.cfg.next)!r})")
        if not _STAGE_NAME.match(child_stage or ""):
            raise ValueError(f"{what}, message {self.id}: child stage {child_stage!r}: want [a-z0-9_-]+")

    def _split(self, what: str, query: str, args: Callable[[Optional[str]], Tuple[Any, ...]]) -> Optional[int]:
        self._begin_outcome(what)
        try:
            state = self._state_json()
        except (TypeError, ValueError) as e:
            self._write_error = e
            raise Fail(f"{what}, message {self.id}: encode state: {e}") from e
        try:
            # p_state NULL keeps the row's state; otherwise it replaces it, and it is the
            # whole state as loaded plus the handler's changes.
            row = self._batch.execute(self._index, query, args(state), prepare=False).fetchone()  # _UNPREPARED
        except psycopg.Error as e:
            if getattr(e, "sqlstate", None) == _SQL_CLAIM_GONE:
                err = ClaimLost(f"{what}, message {self.id}: {e.diag.message_primary} (claim lost)")
                self._write_error = err
                raise err from e
            self._write_error = e
            raise
        return None if row is None else row[0]


def _parse_id(line: bytes) -> Optional[int]:
    """A line of standard input as a message id, or None: ASCII decimal digits (leading zeros
    allowed), at most 2**63-1, with ASCII white space around them ignored (the CR of a line
    ended CRLF). The Go SDK's parseID has the same rule (stage/ids_python_test.go)."""
    text = line.strip(b" \t\r\x0b\x0c")
    if not text.isdigit():  # bytes.isdigit(): ASCII digits only
        return None
    return _digits_value(text.decode("ascii"), _MAX_ID)


def _digits_value(digits: str, most: int) -> Optional[int]:
    """The value of ASCII digits (any number of leading zeros), or None past most. int() sees
    only the digits after the zeros, and no more of them than most has: past 4,300 digits
    int() raises (Python 3.11), which killed a worker on a long id line."""
    digits = digits.lstrip("0") or "0"
    if len(digits) > len(str(most)):
        return None
    n = int(digits)
    return n if n <= most else None


class _Batch:
    """One batch's transaction: lazy BEGIN, a lazy savepoint per message that writes."""

    __slots__ = ("srv", "begun", "savepoints", "open_index", "last")

    def __init__(self, srv: "_Server") -> None:
        self.srv = srv
        self.begun = False
        self.savepoints = 0
        self.open_index = -1  # the message whose savepoint is open
        self.last = ""        # the savepoint to release before the next message's

    def is_open(self, index: int) -> bool:
        return self.open_index == index

    def open_savepoint(self, index: int) -> None:
        if self.open_index == index:
            return
        q = []
        if not self.begun:
            q.append("BEGIN ISOLATION LEVEL READ COMMITTED")
        if self.last:
            # Released, the previous message's subtransaction merges into the batch's and the
            # savepoint stack stays one deep.
            q.append("RELEASE SAVEPOINT " + self.last)
        name = f"pepsi_msg_{index}"
        q.append("SAVEPOINT " + name)
        self.srv.statement("; ".join(q))
        self.begun = True
        self.savepoints += 1
        self.open_index = index
        self.last = name

    def execute(self, index: int, query: Any, params: Any, prepare: Optional[bool] = None) -> psycopg.Cursor:
        self.open_savepoint(index)
        return self.srv.conn.execute(query, params, prepare=prepare)

    def rollback_message(self, index: int) -> None:
        if self.open_index == index:
            self.srv.statement(f"ROLLBACK TO SAVEPOINT pepsi_msg_{index}")


# _UNPREPARED: the SDK's statements on the queue table are sent unprepared (prepare=False),
# never as server-side prepared statements, which psycopg makes of any statement run five
# times. A prepared statement gets a generic plan, made for the table as it was then, and a
# queue table's statistics always lag: a worker started on a small queue kept a plan that
# scanned the table whole at every batch once it had grown, until the next ANALYZE (the
# Go SDK's statements are unnamed too). An unnamed statement is planned for its values, at
# a planning cost of 0.1-0.2 ms for 500 ids (a batch holds at most MAX_BATCH) in a warm
# session (EXPLAIN ANALYZE).
# test_queue_statements_unprepared checks it.

# The batch's rows as one JSON text, [[id, attempts, payload, state, claim], ...]: decoded by
# json.loads (C) in one call, where psycopg's pure-Python row loading would cost some 15 µs
# per row, as much as the rest of a no-op handler's pass.
_LOAD = ("SELECT coalesce(json_agg(json_build_array(workqueue_id, attempts, payload, state, claim)), '[]')::text"
         " FROM workqueue WHERE workqueue_id = ANY(%s::bigint[]) AND status = 'running' AND stage = %s")
# A batch of one id, every batch of a stage that receives a message at a time: an equality on
# the primary key, which the planner settles sooner than a one-element ANY (0.05 against
# 0.13 ms, PostgreSQL 15, warm; the Go SDK's loadStatement does the same).
_LOAD_ONE = _LOAD.replace("workqueue_id = ANY(%s::bigint[])", "workqueue_id = %s::bigint")

# The kept outcomes of a batch, in one statement (the Go SDK's outcomeStatement): rows found by
# primary key only, matched to their values by id, the guard compared with a one-row subquery
# behind OFFSET 0 so that the planner does not take the stale "1 running row" statistics at
# their word. Sent unprepared (an unnamed statement is planned with its parameters' values, so
# the planner knows the arrays' lengths). NULL state keeps the row's state; retry_in, a
# relative defer's seconds from the server's now(), stands in for a NULL retry_at.
_OUTCOMES = """WITH written AS (UPDATE workqueue AS w SET stage = coalesce(v.stage, w.stage), status = v.status,
       attempts = CASE WHEN v.stage IS NULL THEN w.attempts ELSE 0 END,
       retry_at = coalesce(v.retry_at, now() + make_interval(secs => v.retry_in), w.retry_at),
       state = coalesce(v.state, w.state), status_at = now()
  FROM unnest(%(ids)s::bigint[], %(stages)s::text[], %(statuses)s::text[],
              %(retry)s::timestamptz[], %(retry_in)s::float8[], %(states)s::jsonb[])
       AS v (id, stage, status, retry_at, retry_in, state),
       (SELECT 'running'::text AS status, %(guard)s::text AS stage OFFSET 0) AS guard
 WHERE w.workqueue_id = ANY (%(ids)s::bigint[]) AND w.workqueue_id = v.id
   AND w.status = guard.status AND w.stage = guard.stage
RETURNING w.workqueue_id)
SELECT count(*), CASE WHEN count(*) < %(n)s THEN array_agg(workqueue_id)::text END FROM written"""


def _pg_text(e: BaseException) -> str:
    """e's text, and, for an error the server sent, its SQLSTATE in parentheses after it, as
    lib/pq words its errors (the Go SDK's): the dispatcher reads a failure's reason for the
    database's outage or a full disk by those codes as well as by the server's words, which
    follow the server's lc_messages (a German server's full disk is "Auf dem Gerät ist kein
    Speicherplatz mehr verfügbar"; TestDatabaseDiskFullPythonGerman)."""
    code = getattr(e, "sqlstate", None) if isinstance(e, psycopg.Error) else None
    return f"{e} ({code})" if code else str(e)


def _one_line(s: str) -> str:
    # A lone surrogate (os.fsdecode's form of a byte that is not UTF-8, in a file name an
    # exception quotes) has no UTF-8: written as its escape, \udce9, or the encode raised and
    # the worker exited with its batch.
    s = s.encode("utf-8", "backslashreplace").decode("utf-8")
    s = "".join(" " if (c < " " or c == "\x7f") else c for c in s).strip() or "failed"
    b = s.encode("utf-8")
    if len(b) > MAX_REASON:
        s = b[:MAX_REASON - 3].decode("utf-8", "ignore") + "..."
    return s


def _is_connection_error(e: BaseException, conn: Optional[psycopg.Connection]) -> bool:
    if conn is None or conn.closed or conn.broken:
        return True
    return isinstance(e, psycopg.OperationalError) and conn.info.status != psycopg.pq.ConnStatus.OK


class _Server:
    """One serve(): the connection and the batch loop."""

    def __init__(self, cfg: Config, handlers: Mapping[str, Handler], stdin_fd: int, stdout_fd: int) -> None:
        cfg.validate()
        if cfg.stage not in handlers:
            raise ValueError(f"this program has no handler for stage {cfg.stage} "
                             f"(it implements {sorted(handlers)!r})")
        self.cfg = cfg
        self.handler = handlers[cfg.stage]
        self.next_set = frozenset(cfg.next)
        self.stdin_fd = stdin_fd
        self.stdout_fd = stdout_fd
        self.conn: psycopg.Connection = None  # type: ignore[assignment]
        self.parent = os.getppid()
        self.failures = 0
        self.wrote = False
        self.statements = 0  # requests sent by the SDK itself (tests count round trips)
        self.reconnects = 0
        self.transient_batches = 0  # batches run again after a serialization failure or deadlock

    # --- connection ----------------------------------------------------------------------

    def connect(self) -> None:
        # UTF8 whatever the role, the database or the DSN sets: payloads and states are jsonb,
        # which can hold any character, and under a role's LATIN1 the server refused to send
        # one it has no LATIN1 for, failing the message's batch (test_role_client_encoding).
        # lib/pq, under the Go SDK and the dispatcher, always asks for UTF8. A startup
        # parameter, which poolers (PgBouncer) forward.
        kwargs: Dict[str, Any] = {"autocommit": True, "client_encoding": "UTF8"}
        try:
            given = psycopg.conninfo.conninfo_to_dict(self.cfg.dsn)
        except psycopg.ProgrammingError as e:
            raise _Fatal(f"parse DSN: {e}") from e
        if "application_name" not in given:
            kwargs["application_name"] = "pepsi-stage-" + self.cfg.stage
        # A server whose machine vanished (no FIN, no RST) is given up within 10 s, as the
        # dispatcher and the Go SDK give it up, and a connect to one within 5 s per host: a
        # worker started after a failover tried the DSN's vanished first host for as long as
        # the kernel resends its SYNs (about 2 minutes behind a router) before the promoted
        # standby listed second. What the DSN or libpq's environment sets stands.
        for key, env, value in _VANISH_PARAMS:
            if key == "tcp_user_timeout" and psycopg.pq.version() < 120000:
                continue  # a libpq older than 12 refuses the keyword: the probes bound it alone
            if key not in given and not (env and env in os.environ):
                kwargs[key] = value
        self.conn = psycopg.connect(self.cfg.dsn, **kwargs)
        # The session is idle between batches, for up to the dispatcher's WORKER_IDLE_TIMEOUT:
        # a role's idle_session_timeout shorter than that ended it at every quiet spell. The
        # dispatcher stops idle workers itself, so the session turns the timeout off, as the
        # dispatcher's own sessions and the Go SDK's do (see "Idle sessions" above).
        try:
            self.conn.execute(_NO_IDLE_TIMEOUT)
        except psycopg.OperationalError:
            raise  # the connection went: made again like any lost one
        except psycopg.Error as e:
            raise _Fatal(f"turn the session's idle_session_timeout off: {_one_line(str(e))}") from e

    def reconnect(self, why: BaseException) -> None:
        """Make the connection again, or raise _Fatal."""
        try:
            if self.conn is not None:
                self.conn.close()
        except Exception:
            pass
        deadline = time.monotonic() + RECONNECT_TIMEOUT
        delay = 0.05
        self.log(f"database connection lost ({_one_line(str(why))}); reconnecting")
        while True:
            if os.getppid() != self.parent:
                raise _Fatal("database connection lost and the dispatcher that started this worker is gone")
            try:
                self.connect()
                self.reconnects += 1
                self.log("reconnected; running the interrupted batch again")
                return
            except psycopg.Error as e:
                if time.monotonic() + delay > deadline:
                    raise _Fatal(f"database connection lost; reconnecting for {RECONNECT_TIMEOUT:g} s "
                                 f"failed: {_one_line(str(e))}") from e
            time.sleep(delay)  # retrying a connection: there is nothing to wait on
            delay = min(delay * 2, 1.0)

    def statement(self, q: str) -> psycopg.Cursor:
        self.statements += 1
        return self.conn.execute(q)

    def log(self, text: str) -> None:
        try:
            sys.stderr.write(f"pepsi_stage {self.cfg.stage}[{os.getpid()}]: {text}\n")
            sys.stderr.flush()
        except Exception:
            pass

    def note_failure(self, id: int, reason: str, exc: Optional[BaseException]) -> None:
        """Log a handler's unexpected exception at a limited rate: the first three, then one
        in each power of ten (the dispatcher logs every failure already)."""
        self.failures += 1
        n = self.failures
        if n > 3 and not _power_of_ten(n):
            return
        where = ""
        if exc is not None and not isinstance(exc, (Fail, ClaimLost, NotNext, OutcomeChosen)):
            # One line (the dispatcher logs each line as a record): where it was raised.
            frames = traceback.extract_tb(exc.__traceback__)
            if frames:
                f = frames[-1]
                where = f" (raised at {os.path.basename(f.filename)}:{f.lineno} in {f.name})"
        self.log(f"message {id} failed ({n} so far): {_one_line(reason)}{where}")

    # --- the loop ------------------------------------------------------------------------

    def serve(self) -> None:
        self.connect()
        buf = b""
        long: Optional[bytes] = None  # a line past _MAX_LINE: its first bytes; its LF not read yet
        eof = False
        rest: List[bytes] = []
        while True:
            limit = MAX_BATCH if not self.wrote else MAX_SUBXIDS
            lines = rest
            rest = []
            while len(lines) < limit:
                nl = buf.find(b"\n")
                if nl >= 0:
                    lines.append((buf[:nl] if long is None else long)[:_MAX_LINE])
                    long = None
                    buf = buf[nl + 1:]
                    continue
                if long is None and len(buf) > _MAX_LINE:
                    long = buf[:_MAX_LINE]
                if long is not None:
                    buf = b""
                if lines or eof:
                    break
                chunk = os.read(self.stdin_fd, _READ_SIZE)
                if not chunk:
                    eof = True
                    if buf or long is not None:
                        lines.append((buf if long is None else long)[:_MAX_LINE])
                        buf, long = b"", None
                    break
                buf += chunk
            if lines:
                out, rest = self.run_batch(lines)
                _write_all(self.stdout_fd, out)
            if eof and not rest and not buf:
                return

    def run_batch(self, lines: List[bytes]) -> Tuple[bytes, List[bytes]]:
        """Run one batch; return its status lines and the lines left for the next batch."""
        claims: Optional[Dict[int, Any]] = None
        lost_n = 0
        tries = 1
        while True:
            try:
                return self._run_batch(lines, claims, tries == TRANSIENT_TRIES)
            except _Lost as lost:
                if claims is None:
                    claims = lost.args[1]
                lost_n += 1
                if lost_n == 3:
                    raise _Fatal("database connection lost three times in the same batch")
                self.reconnect(lost.args[0])
            except _Transient as t:
                self.transient_batches += 1
                if _power_of_ten(self.transient_batches):
                    self.log(f"batch ended in a serialization failure or a deadlock before it committed; "
                             f"running it again ({self.transient_batches} so far): {_one_line(str(t.args[0]))}")
                tries += 1
                _again_after(tries)

    def _run_batch(self, lines: List[bytes], claims: Optional[Dict[int, Any]],
                   last_try: bool = True) -> Tuple[bytes, List[bytes]]:
        n = len(lines)
        replies: List[Optional[str]] = [None] * n
        ids: List[int] = []
        order: List[int] = []
        for i, line in enumerate(lines):
            id = _parse_id(line)
            if id is not None:
                ids.append(id)
                order.append(i)
            else:
                replies[i] = "1 " + _one_line(f"bad message id {line.decode('utf-8', 'replace')!r}: want a decimal number")
        batch = _Batch(self)
        loaded: Dict[int, Any] = {}
        ran = n
        kept: List[Message] = []
        try:
            if ids:
                self.statements += 1
                if len(ids) == 1:
                    load, key = _LOAD_ONE, ids[0]
                else:
                    load, key = _LOAD, "{" + ",".join(map(str, ids)) + "}"
                rows = json.loads(self.conn.execute(load, (key, self.cfg.stage),
                                                    prepare=False).fetchone()[0])  # _UNPREPARED
                for r in rows:
                    loaded[r[0]] = r
                rerun = claims is not None
                if claims is None:
                    claims = {r[0]: r[4] for r in rows}
                start = time.monotonic()
                stage = self.cfg.stage
                first = True
                for i, id in zip(order, ids):
                    if not first and (batch.savepoints + 1 > MAX_SUBXIDS or
                                      time.monotonic() - start >= MAX_BATCH_TIME):
                        ran = i
                        break
                    first = False
                    row = loaded.pop(id, None)
                    if row is None or claims.get(id, _UNSET) != row[4]:
                        # After a reconnect, a row whose claim token changed was handed out
                        # again by the dispatcher: not ours any more.
                        replies[i] = f"1 message {id} is not running at stage {stage} (claim lost)"
                        if rerun:
                            replies[i] = replies[i][:-1] + ("; the connection was lost during its batch, "
                                                            "whose outcome may have committed)")
                        continue
                    m = Message(batch, self, i, id, stage, row[1], row[2], row[3])
                    reason = self._run_message(batch, m)
                    if reason is not None:
                        replies[i] = "1 " + _one_line(reason)
                    elif m._kept is not None:
                        kept.append(m)
                        replies[i] = "0 done" if m._kept[1] == "done" else "0"
                    else:
                        replies[i] = "0 done" if m._chosen == "done" else "0"
            self.wrote = batch.begun
            if batch.begun:
                self.statements += 1
                cur = self.conn.execute("COMMIT")
                if cur.statusmessage != "COMMIT":
                    raise psycopg.errors.InFailedSqlTransaction(
                        f"commit batch transaction: the server rolled it back ({cur.statusmessage})")
        except _Fatal:
            raise
        except psycopg.Error as e:
            if _is_connection_error(e, self.conn):
                raise _Lost(e, claims)  # None when the load did not run: nothing of the batch did
            try:
                if batch.begun and self.conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    self.statement("ROLLBACK")
            except psycopg.Error as e2:
                if _is_connection_error(e2, self.conn):
                    raise _Lost(e2, claims)
            if _is_transient(e) and not last_try:
                raise _Transient(e)
            # The transaction is gone with everything in it: every message run fails.
            reason = "1 " + _one_line(f"batch transaction failed: {_pg_text(e)}")
            for i in range(ran):
                if replies[i] is None or replies[i].startswith("0"):  # type: ignore[union-attr]
                    replies[i] = reason
            kept = []
        if kept:
            self._write_outcomes(kept, replies, claims)
        out = "".join(r + "\n" for r in replies[:ran])  # type: ignore[operator]
        return out.encode("utf-8"), lines[ran:]

    def _run_message(self, batch: _Batch, m: Message) -> Optional[str]:
        """Run the handler; return the failure reason, or None for success."""
        exc: Optional[BaseException] = None
        reason: Optional[str] = None
        t0 = time.monotonic()
        try:
            self.handler(m)
        except (_Fatal, _Lost):
            raise
        except psycopg.Error as e:
            if _is_connection_error(e, self.conn):
                raise
            exc, reason = e, f"{type(e).__name__}: {_pg_text(e)}"
        except Fail as e:
            exc, reason = e, str(e) or "failed"
        except Exception as e:
            exc, reason = e, f"{type(e).__name__}: {e}"
        m._took = time.monotonic() - t0
        m._live = False
        if reason is None:
            if m._write_error is not None:
                reason = f"handler returned after its outcome failed: {_pg_text(m._write_error)}"
            elif m._second:
                reason = f"handler chose more than one outcome ({m._chosen}, then {m._second})"
            elif not m._chosen:
                reason = ("handler returned without choosing an outcome (advance, done, defer, split); "
                          "the row would stay running")
        if reason is None and m._kept is not None and batch.is_open(m._index):
            # The handler wrote after choosing: the outcome joins its writes.
            try:
                m._write_kept()
            except ClaimLost as e:
                reason = str(e)
            except psycopg.Error as e:
                if _is_connection_error(e, self.conn):
                    raise
                reason = f"{m._chosen} message {m.id}: {_pg_text(e)}"
        if batch.begun and self.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
            raise _Fatal(f"message {m.id}: the handler committed or rolled back the batch transaction "
                         "(the SDK owns it)")
        if reason is not None:
            m._kept = None
            batch.rollback_message(m._index)
            self.note_failure(m.id, reason, exc)
        return reason

    def _write_outcomes(self, kept: List[Message], replies: List[Optional[str]],
                        claims: Optional[Dict[int, Any]]) -> None:
        """Write the kept outcomes in one statement; fail the messages whose row it did not
        find. Should the statement fail, write them one by one, so one bad message fails alone."""
        try:
            written = self._again_if_transient(lambda: self._outcome_statement(kept))
        except psycopg.Error as e:
            if _is_connection_error(e, self.conn):
                raise _Lost(e, claims)
            self.log(f"outcome statement failed; writing the {len(kept)} outcomes one by one: {_one_line(str(e))}")
            written = set()
            for m in kept:
                try:
                    written |= self._again_if_transient(lambda: self._outcome_statement([m]))
                except psycopg.Error as e1:
                    if _is_connection_error(e1, self.conn):
                        raise _Lost(e1, claims)
                    replies[m._index] = "1 " + _one_line(f"{m._chosen} message {m.id}: {_pg_text(e1)}")
                    m._kept = None
        for m in kept:
            if m._kept is not None and m.id not in written:
                replies[m._index] = (f"1 {m._chosen} message {m.id}: row is no longer running at stage "
                                     f"{self.cfg.stage} (claim lost)")

    def _again_if_transient(self, op: Callable[[], Any]) -> Any:
        """Run op, a statement sent alone, again after each serialization failure or deadlock
        (nothing of it was written), up to TRANSIENT_TRIES times in all."""
        tries = 1
        while True:
            try:
                return op()
            except psycopg.Error as e:
                if not _is_transient(e) or tries == TRANSIENT_TRIES or _is_connection_error(e, self.conn):
                    raise
            tries += 1
            _again_after(tries)

    def _outcome_statement(self, kept: List[Message]) -> set:
        """Run _OUTCOMES for kept; return the ids of the rows it wrote."""
        ks = [m._kept for m in kept]
        params = {
            "ids": "{" + ",".join([str(m.id) for m in kept]) + "}",
            "stages": _text_array([k[0] for k in ks]),  # type: ignore[index]
            "statuses": _text_array([k[1] for k in ks]),  # type: ignore[index]
            "retry": _text_array([k[2] if isinstance(k[2], str) else None for k in ks]),  # type: ignore[index]
            "retry_in": _float_array([k[2] if isinstance(k[2], float) else None for k in ks]),  # type: ignore[index]
            "states": _text_array([k[3] for k in ks]),  # type: ignore[index]
            "guard": self.cfg.stage,
            "n": len(kept),
        }
        self.statements += 1
        n, ids = self.conn.execute(_OUTCOMES, params, prepare=False).fetchone()
        if n == len(kept):
            return {m.id for m in kept}
        return {int(x) for x in ids.strip("{}").split(",") if x} if ids else set()

    def close(self) -> None:
        try:
            if self.conn is not None:
                self.conn.close()
        except Exception:
            pass


def _text_array(values: List[Optional[str]]) -> str:
    """A PostgreSQL array literal of the values (None: NULL), every element quoted: building it
    here costs a fraction of psycopg's list adaptation, which is pure Python per element."""
    parts = []
    for v in values:
        if v is None:
            parts.append("NULL")
        else:
            parts.append('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"')
    return "{" + ",".join(parts) + "}"


def _float_array(values: List[Optional[float]]) -> str:
    """_text_array for numbers: a PostgreSQL array literal of the values (None: NULL)."""
    return "{" + ",".join("NULL" if v is None else repr(v) for v in values) + "}"


def _power_of_ten(n: int) -> bool:
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        k = os.write(fd, view)
        view = view[k:]


def serve(cfg: Config, handlers: Mapping[str, Handler], stdin_fd: int = 0, stdout_fd: int = 1) -> None:
    """Serve the worker protocol on the given file descriptors until EOF on stdin_fd.

    handlers maps stage names to handlers; handlers[cfg.stage] is required. Returns after EOF
    once every id read is answered. Raises ConnectionLost when the database connection is
    lost and cannot be made again (no answer is written for the batch in flight: the
    dispatcher recovers its messages), ValueError for a bad configuration.
    """
    srv = _Server(cfg, handlers, stdin_fd, stdout_fd)
    try:
        try:
            srv.serve()
        except psycopg.OperationalError as e:
            if srv.conn is None:
                raise ConnectionLost(f"connect to the database: {e}") from e
            raise ConnectionLost(str(e)) from e
        except _Fatal as e:
            raise ConnectionLost(str(e)) from e
    finally:
        srv.close()


def run_stages(handlers: Mapping[str, Handler]) -> None:
    """A stage program's main for a program with a handler per stage: it serves PEPSI_STAGE
    (whose handler is required) and exits: 0 after EOF, 2 for a usage or environment error,
    1 for a fatal error (the reason on standard error). The same program can be the PROGRAM
    of several stages."""
    try:
        cfg = load_config()
    except ValueError as e:
        sys.stderr.write(f"pepsi_stage: {e}\n")
        sys.exit(2)
    if cfg.stage not in handlers:
        sys.stderr.write(f"pepsi_stage {cfg.stage}: this program has no handler for stage {cfg.stage} "
                         f"(it implements {sorted(handlers)!r})\n")
        sys.exit(2)
    try:
        stdin_fd, stdout_fd = _protocol_fds()
        serve(cfg, handlers, stdin_fd, stdout_fd)
    except (ConnectionLost, OSError) as e:
        # One line: the dispatcher logs a worker's standard error line by line, and libpq's
        # messages end in a newline (a line per host when it tried several).
        sys.stderr.write(f"pepsi_stage {cfg.stage}: {_one_line(str(e))}\n")
        sys.exit(1)
    sys.exit(0)


def _move_fd(fd: int, target: Optional[str]) -> Optional[int]:
    """Copy descriptor fd to a new one (not inherited by children) and return it, pointing fd
    at the file named, or at standard error for None; None if a step fails."""
    try:
        cp = os.dup(fd)  # non-inheritable
    except OSError:
        return None
    try:
        if target is None:
            os.dup2(2, fd)
        else:
            src = os.open(target, os.O_RDONLY)
            try:
                os.dup2(src, fd)
            finally:
                os.close(src)
    except OSError:
        os.close(cp)
        return None
    return cp


def _protocol_fds() -> Tuple[int, int]:
    """Move the protocol off file descriptors 0 and 1 before the first handler runs: return
    copies of standard input and output for the ids and the replies (not inherited by a
    handler's children); descriptor 0 then reads /dev/null and descriptor 1 writes to standard
    error, line-buffered. What a handler prints, or a program it runs without capturing its
    output, reaches the dispatcher's log as its stderr lines: on the reply pipe it was a line
    that is no reply, a protocol error for which the dispatcher kills the worker, failing its
    message in flight (pepsi-worker(7)). A program that reads its standard input (ssh, ffmpeg
    without -nostdin) finds it at its end: on the id pipe it took the ids written while it
    ran, which were then never answered. Where a step fails, that half stays where it was."""
    in_fd = _move_fd(0, os.devnull)
    out_fd = _move_fd(1, None)
    # sys.stdout still writes to descriptor 1, now standard error; what it holds, printed
    # before (at import), goes there too. A line at a time, as the dispatcher logs them.
    if out_fd is not None and hasattr(sys.stdout, "reconfigure"):
        try:
            sys.stdout.reconfigure(line_buffering=True)
        except (OSError, ValueError):
            pass
    return (0 if in_fd is None else in_fd), (1 if out_fd is None else out_fd)


def run(handler: Handler) -> None:
    """A stage program's main: serve PEPSI_STAGE with ``handler`` (see run_stages)."""
    stage = os.environ.get("PEPSI_STAGE", "")
    run_stages({stage: handler})
