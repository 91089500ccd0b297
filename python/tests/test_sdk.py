"""The SDK driven directly over its pipes, as the dispatcher drives a worker: the outcomes,
the batch and its savepoints, the guards, claim gone, reconnect, EOF. The rows are claimed
the way the dispatcher claims them (status running, a fresh claim token)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from conftest import TEST_STAGE, Schema, stage_env, wait_for, world_dir


def start(schema: Schema, worker_factory, stage: str = "a", next: str = "b", **env: str):
    env.setdefault("TEST_MARK_DIR", world_dir("pepsi-pytest-mark-"))
    return worker_factory(TEST_STAGE, stage_env(schema, stage, next, **env))


def rows(schema: Schema, ids):
    """id -> (stage, status, attempts, state) of the given rows."""
    return {r[0]: r[1:] for r in schema.q(
        "SELECT workqueue_id, stage, status, attempts, state FROM workqueue WHERE workqueue_id = ANY(%s)",
        (list(ids),))}


def runs(schema: Schema):
    return sorted(schema.q("SELECT id, stage FROM runs"))


def test_outcomes(schema: Schema, worker_factory) -> None:
    payloads = [
        {"do": "advance"},
        {"do": "done"},
        {"do": "defer", "defer_s": 3600},
        {"do": "split", "child": "kid", "children": [{"n": 1}, {"n": 2}]},
        {"do": "split", "child": "kid", "children": []},
        {"do": "split_range", "child": "kid", "lo": 1, "hi": 3000, "min_span": 1000},
        {"do": "fail"},
        {"do": "none"},
        {"do": "two"},
        {"do": "bad_next"},
        {"do": "state", "norecord": True},
        {"do": "advance", "norecord": True},
        {"do": "state", "norecord": True, "state_value": 'q"uote \\back\\slash {br,ace} NULL é \u2603'},
        {"do": "defer", "defer_s": 3600, "norecord": True},
        {"do": "defer", "defer_s": "inf"},
    ]
    ids = schema.enqueue("a", payloads)
    schema.claim("a", ids)
    w = start(schema, worker_factory)
    w.send(ids)
    got = w.replies(len(ids))
    assert w.close() == 0
    r = rows(schema, ids)
    adv, done, dfr, split, split0, srange, fail, none, two, bad, st, adv2, tricky, dfr2, dfr_inf = ids
    assert got[0] == "0" and r[adv][:3] == ("b", "pending", 0)
    assert got[1] == "0 done" and r[done][:2] == ("a", "done")
    assert got[2] == "0" and r[dfr][:2] == ("a", "paused") and r[dfr][3]["deferred"] is True
    # A delay counts from the server's now(), the outcome's status_at, not from the worker's
    # clock (which need not agree with the server's): written with the handler's writes (dfr)
    # and by the batch's outcome statement (dfr2).
    for d in (dfr, dfr2):
        assert schema.one("SELECT retry_at = status_at + interval '3600 seconds' FROM workqueue"
                          " WHERE workqueue_id = %s", (d,))
    assert got[3] == "0" and r[split][:2] == ("b", "waiting")
    kids = schema.q("SELECT payload, fanout_seq FROM workqueue WHERE stage = 'kid' AND fanout_id = "
                    "(SELECT wait_fanout_id FROM workqueue WHERE workqueue_id = %s) ORDER BY fanout_seq", (split,))
    assert kids == [({"n": 1}, 0), ({"n": 2}, 1)]
    assert got[4] == "0" and r[split0][:2] == ("b", "pending")
    assert got[5] == "0" and r[srange][:2] == ("b", "waiting")
    slices = schema.q("SELECT range_lo, range_hi FROM workqueue WHERE stage = 'kid' AND fanout_id = "
                      "(SELECT wait_fanout_id FROM workqueue WHERE workqueue_id = %s) ORDER BY fanout_seq",
                      (srange,))
    assert slices == [(1, 1001), (1001, 2001), (2001, 3001)]
    assert got[6] == "1 asked to fail at a (attempt 1)"
    assert got[7].startswith("1 handler returned without choosing an outcome")
    assert got[8].startswith("1 ") and "already chosen" in got[8]
    assert got[9].startswith("1 NotNext: ") and "'nowhere'" in got[9]
    assert got[10] == "0" and r[st][3] == {"by_a": st}
    assert got[11] == "0" and r[adv2][:2] == ("b", "pending")
    assert got[12] == "0" and r[tricky][3] == {"by_a": payloads[12]["state_value"]}
    assert got[13] == "0" and r[dfr2][:2] == ("a", "paused") and r[dfr2][3]["deferred"] is True
    assert got[14] == f"1 ValueError: defer message {dfr_inf}: 'inf' is not a finite delay"
    # A failed message is left running for the dispatcher to fail; its writes are undone.
    for i in (fail, none, two, bad, dfr_inf):
        assert r[i][:3] == ("a", "running", 0)
    assert [i for i, s in runs(schema)] == sorted([adv, done, dfr, split, split0, srange])


def test_batch_commit_refused(schema: Schema, worker_factory) -> None:
    """A batch whose COMMIT the server refuses fails every message it ran, with the server's
    words and the SQLSTATE after them, as lib/pq words its errors: the dispatcher reads a
    failure for an outage or a full disk by the code as well as by the words, which follow the
    server's lc_messages. Nothing of the batch is written."""
    schema.q("CREATE TABLE uniq_deferred (k int UNIQUE DEFERRABLE INITIALLY DEFERRED)")
    schema.q("INSERT INTO uniq_deferred VALUES (1)")
    ids = schema.enqueue("a", [{}, {"do": "dup_at_commit"}, {}])
    schema.claim("a", ids)
    w = start(schema, worker_factory)
    w.send(ids)
    got = w.replies(len(ids))
    assert w.close() == 0
    assert len(set(got)) == 1 and got[0].startswith("1 batch transaction failed: ") and got[0].endswith(" (23505)"), got
    assert runs(schema) == []
    assert [rows(schema, ids)[i][1] for i in ids] == ["running"] * 3


def test_batch_savepoints(schema: Schema, worker_factory) -> None:
    """One batch, one transaction: a message whose handler raises after writing rolls back
    only its own writes; the others commit together."""
    payloads = [{}, {"do": "write_fail"}, {}, {"do": "raise"}, {}, {"do": "dup"}, {"do": "done"}]
    schema.q("CREATE TABLE uniq (k int PRIMARY KEY)")
    schema.q("INSERT INTO uniq VALUES (1)")
    ids = schema.enqueue("a", payloads)
    schema.claim("a", ids)
    w = start(schema, worker_factory)
    w.send(ids)
    got = w.replies(len(ids))
    assert w.close() == 0
    assert got[0] == got[2] == got[4] == "0" and got[6] == "0 done"
    assert got[1] == "1 RuntimeError: wrote, then failed"
    assert got[3] == "1 ValueError: a bug"
    assert got[5].startswith("1 ") and "InFailedSqlTransaction" in got[5] and got[5].endswith(" (25P02)")
    ok = [ids[0], ids[2], ids[4], ids[6]]
    assert [i for i, _ in runs(schema)] == ok
    # They committed in one transaction (txid_current() is the top-level transaction).
    assert schema.one("SELECT count(DISTINCT tx) FROM runs") == 1
    r = rows(schema, ids)
    assert [r[i][1] for i in ids] == ["pending", "running", "pending", "running", "pending", "running", "done"]


def test_reason_not_utf8(schema: Schema, worker_factory) -> None:
    """A handler's exception whose text cannot be written as UTF-8 (a lone surrogate: a file
    name os.fsdecode made of bytes that are not UTF-8) is answered as a failure with the
    surrogate escaped, and the worker goes on to the next message. Before, encoding the reply
    raised, and the worker exited with every message of its batch."""
    ids = schema.enqueue("a", [{"do": "raise_surrogate"}, {}])
    schema.claim("a", ids)
    w = start(schema, worker_factory)
    w.send(ids)
    got = w.replies(len(ids))
    assert w.close() == 0
    assert got == ["1 ValueError: no such file: caf\\udce9", "0"]


def test_kept_outcomes_one_statement(schema: Schema, worker_factory) -> None:
    """Handlers that send nothing: their outcomes are one statement after the load."""
    n = 200
    ids = schema.enqueue("a", [{"norecord": True, "do": "done" if i % 2 else "advance"} for i in range(n)])
    schema.claim("a", ids)
    w = start(schema, worker_factory)
    w.send(ids)
    got = w.replies(n)
    assert w.close() == 0
    assert got == ["0" if i % 2 == 0 else "0 done" for i in range(n)]
    assert schema.one("SELECT count(DISTINCT xmin::text) FROM workqueue WHERE workqueue_id = ANY(%s)", (ids,)) == 1
    r = rows(schema, ids)
    assert all(r[i][:2] == (("b", "pending") if k % 2 == 0 else ("a", "done")) for k, i in enumerate(ids))


def test_savepoint_budget(schema: Schema, worker_factory) -> None:
    """Messages that write take a savepoint each: a batch takes at most 64 of them."""
    n = 150
    ids = schema.enqueue("a", [{} for _ in range(n)])
    schema.claim("a", ids)
    w = start(schema, worker_factory, TEST_BATCH_TIME="60")  # the budget, not the clock, ends batches
    w.send(ids)
    assert w.replies(n) == ["0"] * n
    assert w.close() == 0
    sizes = [c for (c,) in schema.q("SELECT count(*) FROM runs GROUP BY tx ORDER BY 1 DESC")]
    assert sizes == [64, 64, 22]  # all waiting at once: full batches


def test_claim_gone(schema: Schema, worker_factory) -> None:
    ids = schema.enqueue("a", [{}, {}, {"norecord": True, "sleep_ms": 1500}, {"sleep_ms": 1500}])
    schema.claim("a", ids)
    # Taken back before the worker loaded it.
    schema.q("UPDATE workqueue SET status = 'pending' WHERE workqueue_id = %s", (ids[1],))
    w = start(schema, worker_factory)
    w.send(ids)

    # Taken back while the handlers of the 3rd (kept outcome) and 4th (writes) sleep.
    def in_batch() -> bool:  # the first message written, the batch transaction open
        return bool(schema.q("SELECT 1 FROM pg_stat_activity WHERE application_name = 'pepsi-worker test' "
                             "AND state = 'idle in transaction'"))
    wait_for("the worker's batch transaction", in_batch)
    schema.q("UPDATE workqueue SET status = 'pending' WHERE workqueue_id = ANY(%s)", ([ids[2], ids[3]],))
    got = w.replies(4)
    assert w.close() == 0
    assert got[0] == "0"
    assert got[1] == f"1 message {ids[1]} is not running at stage a (claim lost)"
    assert got[2] == f"1 advance to b message {ids[2]}: row is no longer running at stage a (claim lost)"
    assert got[3].startswith("1 ") and "claim lost" in got[3]
    assert [i for i, _ in runs(schema)] == [ids[0]]  # the 4th's run rolled back with its outcome
    r = rows(schema, ids)
    assert [r[i][:2] for i in ids] == [("b", "pending")] + [("a", "pending")] * 3


def test_reconnect_between_batches(schema: Schema, worker_factory) -> None:
    ids = schema.enqueue("a", [{}, {}])
    schema.claim("a", ids)
    w = start(schema, worker_factory)
    w.send(ids[:1])
    assert w.replies(1) == ["0"]
    pid = schema.one("SELECT pid FROM pg_stat_activity WHERE application_name = 'pepsi-worker test'")
    assert schema.one("SELECT pg_terminate_backend(%s)", (pid,))
    wait_for("the backend to go", lambda: not schema.q("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)))
    w.send(ids[1:])
    assert w.replies(1) == ["0"]
    assert w.close() == 0
    assert b"reconnected" in w.stderr
    assert [i for i, _ in runs(schema)] == ids
    assert [r[1] for r in rows(schema, ids).values()] == ["pending", "pending"]


def test_reconnect_mid_batch(schema: Schema, worker_factory) -> None:
    """The connection dies in the middle of a batch that has written: the batch rolled back,
    the worker reconnects and runs it again; every message runs (commits) once."""
    ids = schema.enqueue("a", [{}, {"norecord": True}, {"do": "terminate"}, {}, {"do": "done", "norecord": True}])
    schema.claim("a", ids)
    w = start(schema, worker_factory)
    w.send(ids)
    got = w.replies(len(ids))
    assert w.close() == 0
    assert got == ["0", "0", "0", "0", "0 done"]
    assert b"reconnected" in w.stderr
    assert runs(schema) == sorted([(ids[0], "a"), (ids[2], "a"), (ids[3], "a")])  # no "a-lost"
    r = rows(schema, ids)
    assert [r[i][:2] for i in ids] == [("b", "pending")] * 4 + [("a", "done")]


def test_reconnect_keeps_claim_token(schema: Schema, worker_factory) -> None:
    """After a reconnect, a row of the interrupted batch that was handed out again (a new
    claim token, as a new dispatcher's claim writes) is not run: its claim is gone."""
    ids = schema.enqueue("a", [{"do": "terminate", "reclaim_next": True}, {}])
    schema.claim("a", ids)
    w = start(schema, worker_factory)
    w.send(ids)
    got = w.replies(2)
    assert w.close() == 0
    assert got[0] == "0"
    assert got[1].startswith(f"1 message {ids[1]} is not running at stage a (claim lost; the connection was lost")
    assert runs(schema) == [(ids[0], "a")]


def test_eof(schema: Schema, worker_factory) -> None:
    """EOF: the ids read are answered, a last line without a newline too, then exit 0."""
    ids = schema.enqueue("a", [{}, {}, {}])
    schema.claim("a", ids)
    w = start(schema, worker_factory)
    w.proc.stdin.write(f"{ids[0]}\n{ids[1]}\nnot-an-id\n{ids[2]}".encode())
    w.proc.stdin.close()
    assert w.proc.wait(30) == 0
    out = w.proc.stdout.read().decode().splitlines()
    assert out == ["0", "0", "1 bad message id 'not-an-id': want a decimal number", "0"]
    assert [i for i, _ in runs(schema)] == ids


def test_handler_output_to_stderr(schema: Schema, worker_factory) -> None:
    """What a handler writes to standard output (a print, a program it runs without capturing
    its output, a write to descriptor 1) goes to standard error, which the dispatcher logs,
    promptly and line by line; on the reply pipe it was a line that is no reply, for which the
    dispatcher kills the worker."""
    ids = schema.enqueue("a", [{"do": "print"}, {}])
    schema.claim("a", ids)
    w = start(schema, worker_factory)
    w.send(ids)
    assert w.replies(2) == ["0", "0"]
    want = (b"debug: a handler's print\n", b"debug: a child of the handler\n", b"debug: written to descriptor 1\n")
    # Before the worker exits: not held in a buffer until then.
    wait_for(f"the three lines on standard error (so far {w.stderr!r})", lambda: all(x in w.stderr for x in want), 30)
    assert w.close() == 0
    assert w.buf + w.proc.stdout.read() == b""
    assert [i for i, _ in runs(schema)] == ids


def test_handler_child_reads_no_id(schema: Schema, worker_factory) -> None:
    """A program a handler runs that reads its standard input (ssh, ffmpeg without -nostdin, a
    shell's read) finds it at its end: the id written while it runs is the SDK's. It took that
    id, which was then never answered."""
    ids = schema.enqueue("a", [{"do": "stdin"}, {}])
    schema.claim("a", ids)
    w = start(schema, worker_factory)
    w.send(ids[:1])
    wait_for("the handler's child started", lambda: b"child reading" in w.stderr, 30)
    w.send(ids[1:])
    assert w.replies(2, timeout=30) == ["0", "0"]
    assert w.close() == 0
    assert b"child read: []" in w.stderr, w.stderr
    assert [i for i, _ in runs(schema)] == ids


def test_bad_lines(schema: Schema, worker_factory) -> None:
    """Lines that are no id get "bad message id" and the worker goes on: thousands of digits
    (int() refuses past 4,300: the worker died of it), a sign, a Unicode digit, an id past
    2**63-1. A line past 64 KiB is cut to its first 64 KiB (and not kept whole in memory):
    70,000 zeros and an id are the id 0. stage/ids_python_test.go holds the rule to the Go
    SDK's."""
    ids = schema.enqueue("a", [{}, {}, {}])
    schema.claim("a", ids)
    w = start(schema, worker_factory)
    bad = [b"9" * 5000, b"0" * 70000 + str(ids[0]).encode(), b"+" + str(ids[1]).encode(),
           "\u0663".encode(), b"9223372036854775808"]
    w.proc.stdin.write(b"\n".join(bad + [b" %d\r" % ids[2], b""]))
    w.proc.stdin.close()
    assert w.proc.wait(30) == 0
    out = w.proc.stdout.read().decode().splitlines()
    assert len(out) == len(bad) + 1
    assert out[1] == "1 message 0 is not running at stage a (claim lost)"
    assert all(line.startswith("1 bad message id ") for line in out[:1] + out[2:-1]), [line[:60] for line in out]
    assert out[-1] == "0"
    assert [i for i, _ in runs(schema)] == [ids[2]]


def test_eof_at_once(schema: Schema, worker_factory) -> None:
    w = start(schema, worker_factory)
    assert w.close() == 0
    assert w.proc.stdout.read() == b""


def test_handler_commit_is_fatal(schema: Schema, worker_factory) -> None:
    ids = schema.enqueue("a", [{}, {"do": "commit"}])
    schema.claim("a", ids)
    w = start(schema, worker_factory)
    w.send(ids)
    assert w.proc.wait(30) == 1
    assert w.proc.stdout.read() == b""
    assert b"the SDK owns it" in w.stderr or wait_for("stderr", lambda: b"the SDK owns it" in w.stderr, 5) is None


def test_bad_environment(schema: Schema, worker_factory) -> None:
    env = stage_env(schema, "a", "b")
    del env["PEPSI_DSN"]
    w = worker_factory(TEST_STAGE, env)
    assert w.proc.wait(30) == 2
    w._errt.join(5)
    assert b"PEPSI_DSN is not set" in w.stderr


def test_connect_failure_exits_1(schema: Schema, worker_factory) -> None:
    env = stage_env(schema, "a", "b", PEPSI_DSN="host=/nonexistent-dir port=1 dbname=x")
    w = worker_factory(TEST_STAGE, env)
    assert w.proc.wait(30) == 1
    w._errt.join(5)
    assert b"connect to the database" in w.stderr


def test_fatal_error_is_one_line(schema: Schema, worker_factory) -> None:
    """A fatal error is one line on standard error, which the dispatcher logs line by line:
    libpq's messages end in a newline (the dispatcher logged an empty line after each), and a
    failed connect to several hosts is a line per host."""
    for dsn, want in (("host=/nonexistent-dir port=1 dbname=x statement_timeout=0",
                       b'invalid connection option "statement_timeout"'),
                      ("host=/nonexistent-dir,/nonexistent-too port=1 dbname=x",
                       b"connect to the database")):
        w = worker_factory(TEST_STAGE, stage_env(schema, "a", "b", PEPSI_DSN=dsn))
        assert w.proc.wait(30) == 1
        w._errt.join(5)
        assert want in w.stderr
        assert w.stderr.count(b"\n") == 1 and w.stderr.endswith(b"\n"), w.stderr


def test_split_state(schema: Schema, worker_factory) -> None:
    """fanout_split's state argument replaces the parent's state (NULL keeps it), as
    pepsi-worker(7) says; the SDK passes the state as loaded plus the handler's changes, so
    the other keys survive."""
    ids = schema.enqueue("a", [{}, {}, {"do": "split", "child": "kid", "children": [1], "set_state": {"new": 3}}])
    schema.q("UPDATE workqueue SET state = '{\"earlier\": 1, \"dispatch_error\": \"x\"}'")
    schema.claim("a", ids)
    schema.q("SELECT fanout_split(%s, 'a', 'b', 'kid', '[1]', '{\"mine\": 2}')", (ids[0],))
    schema.q("SELECT fanout_split(%s, 'a', 'b', 'kid', '[1]')", (ids[1],))
    w = start(schema, worker_factory)
    w.send(ids[2:])
    assert w.replies(1) == ["0"]  # a split answers 0: the message waits, it is not done
    assert w.close() == 0
    r = rows(schema, ids)
    assert r[ids[0]][3] == {"mine": 2}
    assert r[ids[1]][3] == {"earlier": 1, "dispatch_error": "x"}
    assert r[ids[2]][3] == {"earlier": 1, "dispatch_error": "x", "new": 3}
    assert all(r[i][:2] == ("b", "waiting") for i in ids)


def test_load_statement_forms(schema: Schema) -> None:
    """The load of one id is an equality on the primary key (planned sooner than a one-element
    ANY, which a lone message waits for), the load of several an ANY; both read the rows running
    at the stage and no other, by primary key (the Go SDK's TestLoadStatementForms)."""
    import pepsi_stage
    # A queue's table, not a handful of rows, of which a scan of the whole is the cheaper read.
    schema.q("INSERT INTO workqueue (stage, status) SELECT 'a', 'done' FROM generate_series(1, 10000)")
    schema.q("ANALYZE workqueue")
    run, run2 = schema.enqueue("a", [{"n": 1}, {"n": 2}])
    schema.claim("a", [run, run2])
    [other] = schema.enqueue("b", [{}])
    schema.claim("b", [other])
    [pending] = schema.enqueue("a", [{}])
    assert "workqueue_id = %s::bigint" in pepsi_stage._LOAD_ONE
    assert "workqueue_id = ANY(%s::bigint[])" in pepsi_stage._LOAD

    def read(q: str, key) -> list:
        plan = "\n".join(r[0] for r in schema.q("EXPLAIN " + q, (key, "a")))
        assert "workqueue_pkey" in plan, plan
        return sorted(r[0] for r in json.loads(schema.one(q, (key, "a"))))

    assert read(pepsi_stage._LOAD_ONE, run) == [run]
    assert read(pepsi_stage._LOAD_ONE, other) == []
    assert read(pepsi_stage._LOAD_ONE, pending) == []
    assert read(pepsi_stage._LOAD, "{%d,%d,%d,%d}" % (run, other, pending, run2)) == [run, run2]


def test_queue_statements_unprepared(schema: Schema, worker_factory) -> None:
    """The SDK's own statements on the queue table are never prepared on the server. psycopg
    prepares a statement after five executions, and a prepared statement gets a generic plan,
    made for the table as it was then: the statistics of a queue table always lag, and a
    worker that started on a small queue went on scanning the table whole at every batch
    once it had grown, until the next ANALYZE (the batch's SELECT under PREPARE in psql: a
    Seq Scan after 100,000 inserts). Unprepared, each statement is planned for its ids."""
    w = start(schema, worker_factory)
    for _ in range(8):
        ids = schema.enqueue("a", [{"do": "advance"}, {"do": "done"}, {"do": "advance", "norecord": True},
                                   {"do": "split", "child": "kid", "children": [{"n": 1}]}])
        schema.claim("a", ids)
        w.send(ids)
        assert w.replies(len(ids)) == ["0", "0 done", "0", "0"]
    [probe] = schema.enqueue("a", [{"do": "prepared"}])
    schema.claim("a", [probe])
    w.send([probe])
    assert w.replies(1) == ["0 done"]
    assert w.close() == 0
    assert rows(schema, [probe])[probe][3]["prepared"] == []


def test_connect_gives_up_on_a_vanished_server(schema: Schema, monkeypatch) -> None:
    """A worker's connection asks libpq to give a silent server up as the dispatcher and the
    Go SDK do: a 5 s connect per host, keepalive probes after 5 s of silence then every
    second, 10 s for unacknowledged data. A worker started after a failover waited minutes on
    the DSN's vanished first host before trying the promoted standby. What the DSN or
    PGCONNECT_TIMEOUT sets stands."""
    import socket

    import psycopg

    import pepsi_stage

    d = psycopg.conninfo.conninfo_to_dict(schema.dsn)
    if str(d.get("host", "")).startswith("/"):
        d["host"] = "127.0.0.1"  # pg-private listens there too: a TCP socket shows its options
    tcp = psycopg.conninfo.make_conninfo(**d)
    cases = [(tcp, None, "5"), (tcp + " connect_timeout=7", None, "7"), (tcp, "8", "8")]
    for dsn, env_timeout, want in cases:
        if env_timeout is None:
            monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
        else:
            monkeypatch.setenv("PGCONNECT_TIMEOUT", env_timeout)
        cfg = pepsi_stage.load_config(["worker"], {"PEPSI_DSN": dsn, "PEPSI_STAGE": "a"})
        r, w = os.pipe()
        srv = pepsi_stage._Server(cfg, {"a": lambda m: m.done()}, r, w)
        try:
            srv.connect()
            params = srv.conn.info.get_parameters()
            assert params.get("connect_timeout") == want, (dsn, env_timeout, params)
            for key, value in (("keepalives_idle", "5"), ("keepalives_interval", "1"),
                               ("keepalives_count", "5"), ("tcp_user_timeout", "10000")):
                assert params.get(key) == value, (key, params)
            sock = socket.socket(fileno=srv.conn.pgconn.socket)
            try:
                if sock.family == socket.AF_INET:
                    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5
                    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 10000
            finally:
                sock.detach()
        finally:
            if srv.conn is not None:
                srv.conn.close()
            os.close(r)
            os.close(w)
