"""Python stages under the real dispatcher: every outcome end to end, the example stage, and
a 3-stage pipeline that survives kill -9 of a worker and of the dispatcher with every message
done and every (message, stage) run exactly once."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

from conftest import ROOT, TESTS, Schema, base_conf, conf_as, stage_conf, wait_for, world_dir

PROG = str(TESTS / "stage_prog.py")
EXAMPLE = str(ROOT / "doc/examples/python-stage")


def kill_a_worker(d) -> int:
    """kill -9 of one of d's workers; its pid, once its exit is logged as killed by the signal.
    A worker that retires after MAX_MESSAGES at that very moment exits with status 0 before
    the signal lands (its exit line says so, and CI saw it once): then the next one is killed."""
    for _ in range(5):
        workers = children_of(d.proc.pid)
        assert workers, "no worker running"
        pid = workers[0]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue  # gone between the listing and the kill
        exited = re.compile(rf'msg="worker (?!started)[^"]*" component=dispatch stage=\S+ pid={pid} ')
        wait_for(f"the exit of worker {pid} logged", lambda: exited.search(d.log()), 30)
        if re.search(rf'pid={pid} .*killed by signal 9', d.log()):
            return pid
    raise AssertionError("five workers killed, none logged as killed by signal 9")


def unfinished(schema: Schema) -> int:
    return schema.one("SELECT count(*) FROM workqueue WHERE status NOT IN ('done', 'failed')")


def children_of(pid: int):
    """The live child processes of pid (the dispatcher's workers)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(d))
    return out


def test_every_outcome(schema: Schema, daemon_factory) -> None:
    ids = schema.enqueue("a", [
        {"do": "advance"},
        {"do": "done"},
        {"do": "defer", "defer_s": 0.3},
        {"do": {"a": "split", "b": "fanin"}, "child": "kid", "children": [{}, {"do": "fail"}]},
        {"do": {"a": "split_range", "b": "fanin"}, "child": "kid", "lo": 1, "hi": 3000, "min_span": 1000},
        {"do": {"a": "split"}, "child": "kid", "children": []},
        {"do": "fail"},
        {"do": "raise"},
    ])
    stages = (stage_conf("a", PROG, "b", "MAX_ATTEMPTS = 2\nRETRY_DELAY = 0.1") +
              stage_conf("b", PROG) +
              stage_conf("kid", PROG, "", "MAX_ATTEMPTS = 2\nRETRY_DELAY = 0.1"))
    d = daemon_factory(base_conf(schema, stages))
    wait_for("every message finished", lambda: unfinished(schema) == 0 and
             schema.one("SELECT count(*) FROM workqueue") == len(ids) + 5, 120)
    assert d.stop() == 0
    r = {i: row for i, *row in schema.q(
        "SELECT workqueue_id, stage, status, state FROM workqueue WHERE workqueue_id = ANY(%s)", (ids,))}
    adv, done, dfr, split, srange, split0, fail, exc = ids
    assert r[adv][:2] == ["b", "done"]
    assert r[done][:2] == ["a", "done"]
    assert r[dfr][:2] == ["b", "done"] and r[dfr][2]["deferred"] is True
    assert r[split][:2] == ["b", "done"] and r[split][2]["fanin"] == [1, 1, [1]]
    assert r[srange][:2] == ["b", "done"] and r[srange][2]["fanin"] == [3, 0, []]
    assert r[split0][:2] == ["b", "done"]  # no children: straight to the continuation (no fan-in)
    assert r[fail][:2] == ["a", "failed"]
    assert r[fail][2]["dispatch_error"] == "stage a: status 1: asked to fail at a (attempt 2)"
    assert r[exc][:2] == ["a", "failed"] and r[exc][2]["dispatch_error"].endswith("ValueError: a bug")
    # Each success ran once at each stage; the failures' runs rolled back.
    counts = dict(((i, s), n) for i, s, n in schema.q("SELECT id, stage, count(*) FROM runs GROUP BY 1, 2"))
    assert counts[(adv, "a")] == counts[(adv, "b")] == counts[(dfr, "b")] == 1
    assert counts[(dfr, "a")] == 2  # deferred once, then advanced: two runs
    assert (fail, "a") not in counts and (exc, "a") not in counts


def test_example_stage(schema: Schema, daemon_factory) -> None:
    """doc/examples/python-stage, as the documentation runs it: two stages of it."""
    schema.q("CREATE TABLE shouts (id bigint, stage text, shout text)")
    texts = [f"message number {i} says hi" for i in range(300)]
    ids = schema.enqueue("upper", [{"text": t} for t in texts] +
                         [{"nope": 1}, {"text": "later", "hold_until": "2999-01-01T00:00:00Z"}])
    stages = (stage_conf("upper", EXAMPLE, "count", "MAX_ATTEMPTS = 2\nRETRY_DELAY = 0.1\nQUEUE_LIMIT = 64") +
              stage_conf("count", EXAMPLE, "", "QUEUE_LIMIT = 64"))
    d = daemon_factory(base_conf(schema, stages))
    wait_for("the messages finished", lambda: schema.one(
        "SELECT count(*) FROM workqueue WHERE status IN ('done', 'failed', 'paused') AND attempts < 2 "
        "OR status = 'failed'") == len(ids), 120)
    assert d.stop() == 0
    r = {i: row for i, *row in schema.q("SELECT workqueue_id, stage, status, state FROM workqueue")}
    for i, t in zip(ids, texts):
        assert r[i][:2] == ["count", "done"]
        want = {"words": 5, "shout": t.upper()}
        assert r[i][2]["upper"] == want and r[i][2]["count"] == {"words": 5, "shout": t.upper()}
    bad, held = ids[-2:]
    assert r[bad][:2] == ["upper", "failed"]
    assert r[bad][2]["dispatch_error"] == 'stage upper: status 1: payload has no "text"'
    assert r[held][:2] == ["upper", "paused"]
    assert schema.one("SELECT count(*) FROM shouts") == 2 * len(texts) + 1  # the held one too
    assert schema.one("SELECT count(*) FROM (SELECT id, stage FROM shouts GROUP BY 1, 2 "
                      "HAVING count(*) > 1) d") == 0


def test_pipeline_kill9(schema: Schema, daemon_factory) -> None:
    """3 Python stages; kill -9 of a worker, then of the dispatcher; a new dispatcher
    finishes: every message done, every (message, stage) committed exactly once."""
    n = 3000
    ids = schema.enqueue("s1", [{"sleep_ms": 0} for _ in range(n)])
    extra = "PARALLELISM = 2\nQUEUE_LIMIT = 64\nRETRY_DELAY = 0.1\nMAX_ATTEMPTS = 10"
    stages = stage_conf("s1", PROG, "s2", extra) + stage_conf("s2", PROG, "s3", extra) + stage_conf("s3", PROG, "", extra)
    conf = base_conf(schema, stages)
    d = daemon_factory(conf)

    def runs() -> int:
        return schema.one("SELECT count(*) FROM runs")

    wait_for("a third of the runs", lambda: runs() >= n, 180)
    killed = kill_a_worker(d)
    wait_for("two thirds of the runs", lambda: runs() >= 2 * n, 180)
    d.kill9()
    # The workers die with their dispatcher (parent-death signal).
    wait_for("the old workers gone", lambda: not schema.q(
        "SELECT 1 FROM pg_stat_activity WHERE application_name LIKE 'pepsi-worker%%'"), 30)
    assert unfinished(schema) > 0
    d2 = daemon_factory(conf)
    wait_for("every message done", lambda: schema.one(
        "SELECT count(*) FROM workqueue WHERE status = 'done'") == n, 300)
    assert d2.stop() == 0
    assert schema.one("SELECT count(*) FROM workqueue WHERE workqueue_id = ANY(%s) AND stage = 's3' "
                      "AND status = 'done'", (ids,)) == n
    dup = schema.q("SELECT id, stage, count(*) FROM runs GROUP BY 1, 2 HAVING count(*) <> 1")
    assert dup == []
    assert runs() == 3 * n
    # The kill -9 of the worker was seen. Whether it logged "worker crashed" depends on what
    # it held: a worker retiring after MAX_REQUESTS, or idle, had an empty queue and is only
    # "worker stopped"; both lines carry the pid and the signal.
    assert re.search(rf'pid={killed} .*killed by signal 9', d.log()), f"no exit logged for worker {killed}"


def test_timed_out_workers_session_ends(schema: Schema, daemon_factory) -> None:
    """A handler that wrote its row, set client_connection_check_interval (as pepsi-worker(7)
    advises for long statements) and then waits in a statement past MAX_RUNTIME: the dispatcher
    kills its worker, and the session ends by itself within seconds, letting the row go; the
    timeout is charged once and the message runs again, once."""
    (held,) = schema.enqueue("a", [{"do": "hold"}])
    stages = stage_conf("a", PROG, "", "PARALLELISM = 1\nQUEUE_LIMIT = 1\nRETRY_DELAY = 0.2")
    d = daemon_factory(base_conf(schema, stages, "MAX_RUNTIME = 1"))
    sleeping = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND query = 'SELECT pg_sleep(3600)'")
    try:
        wait_for("the handler's session in its endless statement", lambda: schema.one(sleeping) == 1, 30)
        wait_for("the timeout logged", lambda: "timeout after 1s (worker killed)" in d.log(), 30)
        wait_for("the killed worker's session gone by itself", lambda: schema.one(sleeping) == 0, 5)
        wait_for("the message done at its second attempt", lambda: schema.one(
            "SELECT count(*) FROM workqueue WHERE workqueue_id = %s AND status = 'done'", (held,)) == 1, 30)
    finally:
        schema.q("SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
                 "AND query = 'SELECT pg_sleep(3600)'")
    assert d.stop() == 0
    assert schema.one("SELECT attempts FROM workqueue WHERE workqueue_id = %s", (held,)) == 1
    assert schema.one("SELECT count(*) FROM runs WHERE id = %s", (held,)) == 1


def test_stats_lost_on_kill9(schema: Schema, daemon_factory) -> None:
    """dispatch_stats and stage_stats are flushed from memory (every STATS_INTERVAL, when the
    pipeline goes idle, at shutdown): a dispatcher killed while busy loses what it counted
    since its last flush, as pepsi-dispatch(1), STATISTICS, says. The rows lose nothing."""
    schema.enqueue("a", [{"sleep_ms": 20} for _ in range(400)])
    d = daemon_factory(base_conf(schema, stage_conf("a", PROG, "", "PARALLELISM = 1\nQUEUE_LIMIT = 2")))
    wait_for("30 messages done", lambda: schema.one("SELECT count(*) FROM runs") >= 30, 120)
    d.kill9()
    done = schema.one("SELECT count(*) FROM workqueue WHERE status = 'done'")
    assert done >= 30
    runs = schema.one("SELECT coalesce(sum(stage_runs), 0) FROM dispatch_stats")
    processed = schema.one("SELECT coalesce(sum(processed), 0) FROM stage_stats")
    assert runs < done and processed < done, (runs, processed, done)


def test_database_default_serializable(schema: Schema, daemon_factory, role_factory) -> None:
    """A role whose default_transaction_isolation is SERIALIZABLE (an application's choice for
    its own writes): the batch transactions still run READ COMMITTED (a batch of many messages
    at SERIALIZABLE locks the whole queue table's predicate and failed the other workers'
    batches, each failure failing all its messages), and a statement sent alone that a
    serialization failure ends runs again. Every message done, none failed, every (message,
    stage) committed once; an application's trigger records the level each row's UPDATE ran at,
    and who sent it."""
    role = role_factory("py_ser", "default_transaction_isolation = 'serializable'")
    schema.q("CREATE TABLE iso_seen (app text NOT NULL, iso text NOT NULL, id bigint NOT NULL)")
    schema.q("""CREATE FUNCTION iso_seen() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO iso_seen SELECT current_setting('application_name'),
                current_setting('transaction_isolation'), workqueue_id FROM iso_new;
            RETURN NULL;
        END $$""")
    schema.q("CREATE TRIGGER iso_seen AFTER UPDATE ON workqueue REFERENCING NEW TABLE AS iso_new "
             "FOR EACH STATEMENT EXECUTE FUNCTION iso_seen()")
    n = 600
    # Every other message's handler sends nothing (norecord): its outcome is kept, sent alone.
    schema.enqueue("s1", [{"norecord": i % 2 == 1} for i in range(n)])
    extra = "PARALLELISM = 3\nQUEUE_LIMIT = 32"
    stages = stage_conf("s1", PROG, "s2", extra) + stage_conf("s2", PROG, "s3", extra) + stage_conf("s3", PROG, "", extra)
    conf = conf_as(base_conf(schema, stages), schema, role)
    d = daemon_factory(conf)
    wait_for("every message done", lambda: schema.one(
        "SELECT count(*) FROM workqueue WHERE status = 'done'") == n, 120)
    assert d.stop() == 0
    failed = schema.failed()
    assert failed == [], f"messages failed: {failed}"
    assert schema.q("SELECT id, stage FROM runs GROUP BY 1, 2 HAVING count(*) <> 1") == []
    assert schema.one("SELECT count(*) FROM runs") == 3 * n // 2
    # The outcome of a message whose handler wrote is in the batch transaction; the others'
    # are kept, sent alone after it.
    seen = dict(schema.q("SELECT (w.payload->>'norecord')::boolean, string_agg(DISTINCT iso, ',') "
                         "FROM iso_seen JOIN workqueue w ON w.workqueue_id = iso_seen.id "
                         "WHERE app LIKE 'pepsi-worker%%' GROUP BY 1"))
    assert seen == {False: "read committed", True: "serializable"}, seen
    assert schema.one("SELECT string_agg(DISTINCT iso, ',') FROM iso_seen "
                      "WHERE app LIKE 'pepsi-dispatch%%'") == "read committed"
    assert "message failed" not in d.log()


def test_idle_session_timeout(schema: Schema, daemon_factory, role_factory) -> None:
    """A role whose idle_session_timeout (PostgreSQL 14) is shorter than the workers' idle time
    between batches, as a DBA sets it to reap forgotten sessions: the server ended every idle
    worker's session, and the worker reconnected at its next batch ("database connection lost
    ...; reconnecting"). The SDK turns the timeout off for its own session when it connects, as
    the dispatcher's sessions do. Each round runs messages, then waits until every worker's
    session has been idle for twice the timeout; no worker may reconnect or be replaced."""
    role = role_factory("py_idle", "idle_session_timeout = '1s'")
    stages = stage_conf("s1", PROG, "s2", "PARALLELISM = 2") + stage_conf("s2", PROG, "", "PARALLELISM = 2")
    conf = conf_as(base_conf(schema, stages), schema, role)
    conf = conf.replace("WORKER_IDLE_TIMEOUT = 2", "WORKER_IDLE_TIMEOUT = 120", 1)
    d = daemon_factory(conf)
    per_round, rounds = 100, 3
    for r in range(1, rounds + 1):
        schema.enqueue("s1", [{} for _ in range(per_round)])
        wait_for("the round's messages done", lambda: schema.one(
            "SELECT count(*) FROM workqueue WHERE status = 'done'") == r * per_round)
        wait_for("every worker's session idle for 2 s", lambda: schema.one(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = %s AND application_name ~ '^pepsi-worker ' "
            "AND state = 'idle' AND state_change < now() - interval '2 s'", (role,)) == 4, 30)
    assert d.stop() == 0
    failed = schema.failed()
    assert failed == [], f"messages failed: {failed}"
    assert schema.q("SELECT id, stage FROM runs GROUP BY 1, 2 HAVING count(*) <> 1") == []
    log = d.log()
    assert "reconnecting" not in log, log
    assert log.count("worker started") == 4, log


def test_role_client_encoding(schema: Schema, daemon_factory, role_factory) -> None:
    """A role whose client_encoding is not UTF8 (a legacy application's LATIN1): payloads and
    states hold any Unicode character, which the server cannot send in LATIN1."""
    role = role_factory("py_enc", "client_encoding = 'LATIN1'")
    text = "Zürich 東京 ✓ \U0001F600"
    n = 20
    schema.enqueue("s1", [{"name": text, "set_state": {"seen": text}} for _ in range(n)])
    stages = stage_conf("s1", PROG, "s2") + stage_conf("s2", PROG, "")
    conf = conf_as(base_conf(schema, stages), schema, role)
    d = daemon_factory(conf)
    wait_for("every message done", lambda: schema.one(
        "SELECT count(*) FROM workqueue WHERE status = 'done'") == n, 60)
    assert d.stop() == 0
    failed = schema.failed()
    assert failed == [], f"messages failed: {failed}"
    assert schema.one("SELECT count(*) FROM workqueue WHERE state->>'seen' = %s", (text,)) == n


def test_batch_timeout_charges_the_hanger(schema: Schema, daemon_factory) -> None:
    """The SDK runs a worker's ids as a batch and answers them at its commit: when the second
    message of a batch hangs, the head has run and waits for its answer. The dispatcher
    charged the head (innocent, failed after two timeouts) and put the hanging one back
    uncharged. Now the worker had read four ids: none is charged, each runs next alone, and
    only the hanging one times out there, twice, and fails (pepsi-worker(7), "Several ids
    read")."""
    ids = schema.enqueue("a", [{}, {"sleep_ms": 3600_000}, {}, {}])
    stages = stage_conf("a", PROG, "", "PARALLELISM = 1\nQUEUE_LIMIT = 4\nMAX_ATTEMPTS = 2\nRETRY_DELAY = 0")
    d = daemon_factory(base_conf(schema, stages, "MAX_RUNTIME = 3"))
    wait_for("every message of the batch ended", lambda: unfinished(schema) == 0, 60)
    assert d.stop() == 0
    for i, id_ in enumerate(ids):
        status, attempts, runs = schema.one(
            "SELECT status, attempts, (SELECT count(*) FROM runs WHERE runs.id = w.workqueue_id) "
            "FROM workqueue w WHERE workqueue_id = %s", (id_,))
        if i == 1:
            assert (status, attempts, runs) == ("failed", 2, 0), f"the hanging message {id_}"
        else:
            assert (status, attempts, runs) == ("done", 0, 1), f"message {id_}, innocent"
    assert "which of them it was running is not known" in d.log()
