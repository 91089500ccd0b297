#!/usr/bin/env python3
"""The tests' stage program: what each message does is in its payload.

payload keys:
  do        an action for every stage, or {"stage": action, ...}; the default advances to
            the first NEXT stage, or finishes at a final stage
  norecord  true: do not record the run in the runs table (the handler then sends nothing)
  defer_s   seconds for "defer"
  children  payloads for "split"; lo, hi for "split_range"; child the child stage
  sleep_ms  work this long first
  set_state keys to set in the state before the action

actions: advance, done, defer (once), split, split_range, fanin (read the children's
outcome, then done), fail, write_fail (record, then fail: the record must roll back), raise,
none (no outcome), two (two outcomes), bad_next, terminate (pg_terminate_backend of its own
session, once per message: a marker file in $TEST_MARK_DIR), exit (crash), commit (commits
the SDK's transaction: fatal), state (set state keys), dup (violate a unique index, catch it,
then done: the outcome must fail), dup_at_commit (insert a row that a deferred unique constraint
refuses at the batch's COMMIT, then the default), hold (the first attempt writes its own row, sets
client_connection_check_interval for its transaction, then waits in a statement that does not
end: MAX_RUNTIME kills the worker; then as the default), print (print a line, run a program
that writes one to its standard output, write one to descriptor 1; then as the default), stdin
(run a program that reads a line of its standard input; then as the default).
"""

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import pepsi_stage  # noqa: E402
from pepsi_stage import Fail, Message  # noqa: E402


def action(m: Message) -> str:
    p = m.payload if isinstance(m.payload, dict) else {}
    do = p.get("do", "")
    if isinstance(do, dict):
        do = do.get(m.stage, "")
    return do


def once(m: Message, what: str) -> bool:
    """True the first time (for this message, stage and what), durably: a marker file."""
    mark = os.path.join(os.environ["TEST_MARK_DIR"], f"{what}-{m.id}-{m.stage}")
    try:
        fd = os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def handle(m: Message) -> None:
    p = m.payload if isinstance(m.payload, dict) else {}
    cfg = pepsi_stage.load_config()
    if p.get("sleep_ms"):
        time.sleep(p["sleep_ms"] / 1000)
    do = action(m)
    if do == "terminate" and once(m, "terminate"):
        m.execute("INSERT INTO runs (id, stage, pid) VALUES (%s, %s, %s)", (m.id, m.stage + "-lost", os.getpid()))
        if p.get("reclaim_next"):
            # Another claim of the next message, on a connection of its own (it commits).
            with pepsi_stage.psycopg.connect(os.environ["PEPSI_DSN"], autocommit=True) as c:
                c.execute("UPDATE workqueue SET claim = nextval('workqueue_claim_seq') WHERE workqueue_id = %s",
                          (m.id + 1,))
        m.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    if do == "exit":
        os._exit(3)
    if do == "print":
        print("debug: a handler's print")
        subprocess.run(["sh", "-c", "echo debug: a child of the handler"], check=True)
        os.write(1, b"debug: written to descriptor 1\n")
    if do == "stdin":
        r = subprocess.run(["sh", "-c", "echo child reading >&2; read line; echo \"child read: [$line]\" >&2"])
        m.state["child_status"] = r.returncode
    if do == "hold" and m.attempts == 0:
        m.execute("UPDATE workqueue SET state = state || '{\"progress\": 1}' WHERE workqueue_id = %s", (m.id,))
        m.execute("SET LOCAL client_connection_check_interval = '1s'")
        m.execute("SELECT pg_sleep(3600)")
    if not p.get("norecord"):
        m.execute("INSERT INTO runs (id, stage, pid) VALUES (%s, %s, %s)", (m.id, m.stage, os.getpid()))
    if p.get("set_state"):
        m.state.update(p["set_state"])
    if do == "fail":
        raise Fail(f"asked to fail at {m.stage} (attempt {m.attempts + 1})")
    if do == "write_fail":
        raise RuntimeError("wrote, then failed")
    if do == "raise":
        raise ValueError("a bug")
    if do == "raise_surrogate":
        # A file name decoded with surrogateescape, as os.listdir gives one that is not UTF-8.
        raise ValueError("no such file: " + os.fsdecode(b"caf\xe9"))
    if do == "none":
        return
    if do == "two":
        m.done()
        m.done()
        return
    if do == "bad_next":
        m.advance("nowhere")
        return
    if do == "commit":
        m.execute("COMMIT")
    if do == "state":
        m.state["by_" + m.stage] = p.get("state_value", m.id)
    if do == "dup_at_commit":
        m.execute("INSERT INTO uniq_deferred (k) VALUES (1)")
    if do == "dup":
        try:
            m.execute("INSERT INTO uniq (k) VALUES (1)")
        except Exception:
            pass
        m.done()
        return
    if do == "defer" and not m.state.get("deferred"):
        m.state["deferred"] = True
        m.defer(p.get("defer_s", 0.2))
        return
    if do == "split":
        m.split(cfg.next[0], p["child"], p["children"])
        return
    if do == "split_range":
        m.split_range(cfg.next[0], p["child"], p["lo"], p["hi"], min_span=p.get("min_span", 0))
        return
    if do == "prepared":
        # A handler's own read of the queue table, unprepared however often it runs
        # (m.execute's prepare=False), then the session's server-side prepared statements on
        # the queue table (the query's own text must not match itself once psycopg prepares
        # it too).
        for _ in range(6):
            m.execute("SELECT range_lo, range_hi FROM workqueue WHERE workqueue_id = %s", (m.id,), prepare=False)
        m.state["prepared"] = [r[0] for r in m.execute(
            "SELECT statement FROM pg_prepared_statements WHERE statement LIKE '%work' || 'queue%'").fetchall()]
        m.done()
        return
    if do == "fanin":
        r = m.fanin_result()
        m.state["fanin"] = [r.done, r.failed, [c.seq for c in r.failed_children]]
        m.done()
        return
    if do == "done" or not cfg.next:
        m.done()
    else:
        m.advance(cfg.next[0])


if __name__ == "__main__":
    if os.environ.get("TEST_BATCH_TIME"):
        pepsi_stage.MAX_BATCH_TIME = float(os.environ["TEST_BATCH_TIME"])
    pepsi_stage.run(handle)
