"""Fixtures of the Python SDK's tests: a private PostgreSQL cluster (scripts/pg-private, or
PEPSI_TEST_DSN), a fresh schema per test with schema.sql applied by psql, the daemon built
with `go build`, and helpers that run a stage program under the real dispatcher or drive it
directly over its pipes, as the dispatcher would.

Nothing is mocked: the stage programs are real processes, the database is real.
"""

from __future__ import annotations

import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]
PYDIR = ROOT / "python"
TESTS = Path(__file__).resolve().parent


def wait_for(what: str, cond: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll cond until it holds; fail the test after timeout seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(delay)  # polling a condition of another process: nothing to wait on
        delay = min(delay * 2, 0.1)


def world_dir(prefix: str) -> str:
    """A fresh directory that the account `nobody` can enter (the daemon drops to it)."""
    d = tempfile.mkdtemp(prefix=prefix)
    os.chmod(d, 0o755)
    return d


@pytest.fixture(scope="session")
def cluster_dsn() -> Iterator[str]:
    """The test run's PostgreSQL: PEPSI_TEST_DSN, else a private cluster."""
    dsn = os.environ.get("PEPSI_TEST_DSN")
    if dsn:
        yield dsn
        return
    d = world_dir("pepsi-pytest-pg-")
    out = subprocess.run([str(ROOT / "scripts/pg-private"), "start", d], check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    try:
        yield out.strip()
    finally:
        subprocess.run([str(ROOT / "scripts/pg-private"), "stop", d], check=False)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def daemon_bin() -> Iterator[str]:
    """pepsi-dispatch built from this repository with `go build`."""
    d = world_dir("pepsi-pytest-bin-")
    path = os.path.join(d, "pepsi-dispatch")
    subprocess.run(["go", "build", "-o", path, "."], cwd=ROOT, check=True)
    yield path
    shutil.rmtree(d, ignore_errors=True)


class Schema:
    """A fresh schema with schema.sql applied; dsn has search_path set to it."""

    def __init__(self, name: str, dsn: str) -> None:
        self.name = name
        self.dsn = dsn
        self.conn = psycopg.connect(dsn, autocommit=True)

    def q(self, query: str, params=None) -> List[tuple]:
        cur = self.conn.execute(query, params)
        return cur.fetchall() if cur.description else []

    def one(self, query: str, params=None):
        rows = self.q(query, params)
        assert len(rows) == 1, f"{query}: {len(rows)} rows"
        return rows[0][0] if len(rows[0]) == 1 else rows[0]

    def failed(self) -> List[tuple]:
        """The first three messages charged an attempt or holding a dispatch_error: none is
        what a test of a run that should fail nothing asserts."""
        return self.q("SELECT workqueue_id, state->>'dispatch_error' FROM workqueue "
                      "WHERE attempts > 0 OR state ? 'dispatch_error' ORDER BY 1 LIMIT 3")

    def enqueue(self, stage: str, payloads: List[object]) -> List[int]:
        """Insert one pending message per payload at stage; return the ids in order."""
        from psycopg.types.json import Jsonb
        rows = self.q("INSERT INTO workqueue (stage, payload) SELECT %s, p FROM unnest(%s::jsonb[]) "
                      "WITH ORDINALITY AS u(p, k) ORDER BY k RETURNING workqueue_id",
                      (stage, [Jsonb(p) for p in payloads]))
        return sorted(r[0] for r in rows)

    def claim(self, stage: str, ids: List[int]) -> None:
        """What the dispatcher's claim does: pending -> running with a fresh claim token."""
        n = self.one("WITH c AS (UPDATE workqueue SET status = 'running', "
                     "claim = nextval('workqueue_claim_seq'), claimed_at = now() "
                     "WHERE workqueue_id = ANY(%s) AND stage = %s AND status = 'pending' RETURNING 1) "
                     "SELECT count(*) FROM c", (ids, stage))
        assert n == len(ids)


RUNS_DDL = """CREATE TABLE IF NOT EXISTS runs (
    id bigint NOT NULL, stage text NOT NULL, pid int NOT NULL, tx bigint NOT NULL DEFAULT txid_current(),
    at timestamptz NOT NULL DEFAULT clock_timestamp())"""


@pytest.fixture
def schema(cluster_dsn: str, request) -> Iterator[Schema]:
    name = re.sub(r"[^a-z0-9_]+", "_", request.node.name.lower())[:40]
    name = f"py_{name}_{random.randrange(1000000):06d}"
    with psycopg.connect(cluster_dsn, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {name}")
    dsn = f"{cluster_dsn} options='-c search_path={name}'"
    # psql applies it as an operator would: schema.sql may \ir files of its own.
    subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-f", "schema.sql", dsn],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    s = Schema(name, dsn)
    s.q(RUNS_DDL)
    try:
        yield s
    finally:
        s.conn.close()
        with psycopg.connect(cluster_dsn, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA {name} CASCADE")


def stage_env(schema: Schema, stage: str, next: str = "", **extra: str) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(PEPSI_STAGE=stage, PEPSI_NEXT=next, PEPSI_FUSE="",
               PEPSI_DSN=schema.dsn + " application_name='pepsi-worker test'",
               PYTHONPATH=str(PYDIR))
    env.update(extra)
    return env


class Worker:
    """A stage program driven directly over its pipes, as the dispatcher drives it."""

    def __init__(self, program: List[str], env: Dict[str, str]) -> None:
        self.env = env
        self.proc = subprocess.Popen(program + ["worker"], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.buf = b""
        self.stderr = b""
        self._errt = threading.Thread(target=self._drain_stderr, daemon=True)
        self._errt.start()

    def _drain_stderr(self) -> None:
        for chunk in iter(lambda: self.proc.stderr.read1(65536), b""):  # type: ignore[union-attr]
            self.stderr += chunk

    def send(self, ids: List[int]) -> None:
        """Write the ids in one write, as the dispatcher writes a worker's queue."""
        self.proc.stdin.write("".join(f"{i}\n" for i in ids).encode())  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def replies(self, n: int, timeout: float = 60.0) -> List[str]:
        """Read n status lines."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        while self.buf.count(b"\n") < n:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"got {self.buf!r}, want {n} lines; stderr: {self.stderr.decode()}")
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    pytest.fail(f"worker exited ({self.proc.wait()}) after {self.buf!r}; "
                                f"stderr: {self.stderr.decode()}")
                self.buf += chunk
        lines = self.buf.split(b"\n")
        self.buf = b"\n".join(lines[n:])
        return [line.decode() for line in lines[:n]]

    def close(self, timeout: float = 30.0) -> int:
        """EOF on its standard input; return its exit status."""
        self.proc.stdin.close()  # type: ignore[union-attr]
        st = self.proc.wait(timeout)
        self._errt.join(5)
        return st

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def worker_factory() -> Iterator[Callable[..., Worker]]:
    started: List[Worker] = []

    def start(program: List[str], env: Dict[str, str]) -> Worker:
        w = Worker(program, env)
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()
        mark = w.env.get("TEST_MARK_DIR", "")
        if mark.startswith(tempfile.gettempdir() + "/pepsi-pytest-mark-"):
            shutil.rmtree(mark, ignore_errors=True)


TEST_STAGE = [sys.executable, str(TESTS / "stage_prog.py")]


class Daemon:
    """One running pepsi-dispatch."""

    def __init__(self, bin: str, conf: str, env: Dict[str, str]) -> None:
        self.dir = world_dir("pepsi-pytest-conf-")
        self.conf = os.path.join(self.dir, "pepsi.conf")
        with open(self.conf, "w") as f:
            f.write(conf)
        os.chmod(self.conf, 0o644)
        self.log_path = os.path.join(self.dir, "log")
        self.log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen([bin, "-c", self.conf, "-v", "serve"], env=env,
                                     stdout=self.log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log_file.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def base_conf(schema: Schema, stages: str, extra: str = "") -> str:
    return f"""# written by a test
[database]
DSN = {schema.dsn}

[pepsi-dispatch]
USER = nobody
WORKER_IDLE_TIMEOUT = 2
POLL_INTERVAL = 1
STATS_INTERVAL = 60
SHUTDOWN_GRACE = 5
{extra}
{stages}
"""


@pytest.fixture
def role_factory(schema: Schema) -> Iterator[Callable[..., str]]:
    """role_factory(prefix, *settings) creates a login role for the test, with settings
    ("name = 'value'") as an operator's ALTER ROLE ... SET gives them; dropped at the end."""
    made: List[str] = []

    def make(prefix: str, *settings: str) -> str:
        role = f"{prefix}_{schema.name[-20:]}"
        schema.q(f"CREATE ROLE {role} LOGIN SUPERUSER")
        made.append(role)
        for setting in settings:
            schema.q(f"ALTER ROLE {role} SET {setting}")
        return role

    yield make
    for role in made:
        schema.conn.execute(f"DROP ROLE IF EXISTS {role}")


def conf_as(conf: str, schema: Schema, role: str) -> str:
    """conf (of base_conf(schema, ...)) with its DSN connecting as role."""
    return conf.replace(f"DSN = {schema.dsn}", f"DSN = {schema.dsn} user={role}", 1)


def stage_conf(name: str, program: str, next: str = "", extra: str = "") -> str:
    return f"[stage-{name}]\nPROGRAM = {program}\nNEXT = {next}\n{extra}\n"


@pytest.fixture
def daemon_factory(daemon_bin: str, request) -> Iterator[Callable[[str], Daemon]]:
    started: List[Daemon] = []

    def start(conf: str) -> Daemon:
        env = dict(os.environ)
        # Stage programs run `#!/usr/bin/env python3`: the interpreter running the tests,
        # which has psycopg; and they import pepsi_stage from python/.
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        env["PYTHONPATH"] = str(PYDIR)
        d = Daemon(daemon_bin, conf, env)
        started.append(d)
        return d

    yield start
    failed = getattr(request.node, "rep_call", None)
    for d in started:
        if failed is not None and failed.failed:
            sys.stderr.write(f"--- daemon log ---\n{d.log()}\n")
        d.cleanup()


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
