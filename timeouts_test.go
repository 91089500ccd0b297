// timeouts_test.go: a role whose sessions the server ends when idle (idle_session_timeout), or
// whose statements it cuts short when they wait (lock_timeout, statement_timeout).

package main

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// cutStatement sets a session's statement_timeout (exec runs a statement on that session) to
// 1/part of stmt's quickest time of three there, so that stmt outlasts it however fast the
// machine is today, and checks that it does; a role's setting cuts a statement the same way
// (57014). A fixed timeout cut a window on a slow day and none on a fast one (CI, session 27).
func cutStatement(t *testing.T, exec func(query string) error, stmt func() error, part int, what string) time.Duration {
	t.Helper()
	took := time.Hour
	for i := 0; i < 3; i++ {
		start := time.Now()
		if err := stmt(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		took = min(took, time.Since(start))
	}
	timeout := took / time.Duration(part)
	if timeout < time.Millisecond {
		t.Fatalf("premise: %s took %v, too short to cut", what, took)
	}
	if err := exec(fmt.Sprintf(`SET statement_timeout = %d`, timeout.Milliseconds())); err != nil {
		t.Fatal(err)
	}
	if err := stmt(); !cutWaiting(err) {
		t.Fatalf("premise: %s (%v at its quickest) should outlast statement_timeout = %v; err %v", what, took, timeout, err)
	}
	return timeout
}

// TestIdleSessionTimeout runs a pipeline for a role whose idle_session_timeout (PostgreSQL 14)
// is shorter than the dispatcher's and the workers' idle times, as a DBA sets it to reap
// forgotten sessions. pepsi's sessions are idle by design: the LISTEN connection always (the
// server sees no statement while it only receives notifications), the lock connection between
// heartbeats (POLL_INTERVAL), a worker between batches (up to WORKER_IDLE_TIMEOUT). Ended by
// the server, the LISTEN connection was lost and made again at every timeout, the lock
// connection with it the single-instance lock, and a Go SDK worker exited, its head message
// charged an attempt ("worker exited with status 1"). Each round below runs messages, then
// waits until every worker's session has been idle for twice the timeout.
func TestIdleSessionTimeout(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	role := newTestRole(t, s, "pepsi_idle", "idle_session_timeout = '1s'")
	conf := confAs(baseConf(s, ""), s, role)
	conf = strings.Replace(conf, "WORKER_IDLE_TIMEOUT = 2", "WORKER_IDLE_TIMEOUT = 120", 1)
	conf = strings.Replace(conf, "POLL_INTERVAL = 1", "POLL_INTERVAL = 4", 1)
	conf += stageConf(t, "parse", "deliver", "PARALLELISM = 2") + stageConf(t, "deliver", "", "PARALLELISM = 2")
	d := startDaemon(t, conf, "pipeline")
	const perRound, rounds = 200, 3
	for round := 1; round <= rounds; round++ {
		s.exec(t, `INSERT INTO workqueue (stage, payload) SELECT 'parse', '{}' FROM generate_series(1, $1)`, perRound)
		waitFor(t, 60*time.Second, "the round's messages done", func() bool { return countStatus(t, s, "done") == round*perRound })
		// Idle for twice the timeout: every worker's session, and the dispatcher's lock
		// connection (no heartbeat for 4 s; the LISTEN connection has its name too, but is
		// pinged now).
		waitFor(t, 30*time.Second, "the workers' sessions and the lock connection idle for 2 s", func() bool {
			idle := `SELECT count(*) FROM pg_stat_activity WHERE usename = $1 AND application_name ~ $2
				AND state = 'idle' AND state_change < now() - interval '2 s'`
			return s.count(t, idle, role, `^pepsi-worker `) == 4 && s.count(t, idle, role, `^pepsi-dispatch [0-9]+$`) >= 1
		})
	}
	d.stop()

	if failed := s.count(t, `SELECT count(*) FROM workqueue WHERE attempts > 0 OR state ? 'dispatch_error'`); failed != 0 {
		t.Errorf("%d messages failed at least once; the first: %s", failed, s.count0(t,
			`SELECT state->>'dispatch_error' FROM workqueue WHERE state ? 'dispatch_error' ORDER BY workqueue_id LIMIT 1`))
	}
	if bad := s.count(t, `SELECT count(*) FROM (SELECT id, stage FROM runs GROUP BY 1, 2 HAVING count(*) <> 1) x`); bad != 0 {
		t.Errorf("%d (message, stage) pairs ran other than once", bad)
	}
	log := d.log.String()
	if n := strings.Count(log, "worker started"); n != 4 {
		t.Errorf("%d workers started, want 4 (none replaced)", n)
	}
	if n := strings.Count(log, "single-instance lock taken"); n != 1 {
		t.Errorf("the single-instance lock was taken %d times, want once", n)
	}
	for _, line := range []string{"LISTEN connection lost", "worker crashed", "connection lost", "level=ERROR"} {
		if strings.Contains(log, line) {
			t.Errorf("the log says %q", line)
		}
	}
	if t.Failed() {
		t.Logf("daemon log:\n%s", log)
	}
}

// TestListenerIdleTimeoutLearned sets the role's idle_session_timeout while the dispatcher runs,
// then ends its LISTEN connection, which reconnects with the new setting. The keeper read no
// timeout at the start (listen.go); the server ends the new connection for idleness once
// (SQLSTATE 57P05), and from then on the keeper pings it at half the time it lived: it must
// not be ended again, and notifications must still come (a message is done without waiting
// for the heartbeat, POLL_INTERVAL = 60 s).
func TestListenerIdleTimeoutLearned(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	role := newTestRole(t, s, "pepsi_learn")
	conf := confAs(baseConf(s, ""), s, role)
	conf = strings.Replace(conf, "POLL_INTERVAL = 1", "POLL_INTERVAL = 60", 1)
	conf += stageConf(t, "parse", "", "PARALLELISM = 1")
	d := startDaemon(t, conf, "pipeline")
	d.waitLog("msg=dispatching", 30*time.Second)

	s.exec(t, `ALTER ROLE `+role+` SET idle_session_timeout = '1s'`)
	listenerSession := `SELECT pid FROM pg_stat_activity WHERE usename = $1 AND application_name ~ '^pepsi-dispatch [0-9]+$'
		AND (query LIKE 'LISTEN %' OR query = '')`
	if n := s.count(t, `SELECT count(pg_terminate_backend(pid)) FROM (`+listenerSession+`) l`, role); n != 1 {
		t.Fatalf("%d LISTEN sessions ended, want 1", n)
	}
	// Kept: a LISTEN session of the role that has lived for three timeouts.
	waitFor(t, 30*time.Second, "a LISTEN session 3 s old", func() bool {
		return s.count(t, `SELECT count(*) FROM pg_stat_activity WHERE pid IN (`+listenerSession+`)
			AND backend_start < now() - interval '3 s'`, role) == 1
	})
	if !strings.Contains(d.log.String(), "the LISTEN connection is pinged from now on") {
		t.Errorf("the log does not say that the LISTEN connection is pinged now")
	}
	if n := strings.Count(d.log.String(), "LISTEN connection lost"); n != 2 {
		t.Errorf("the LISTEN connection was lost %d times, want 2 (ended by the test, then once for idleness)", n)
	}
	s.exec(t, `INSERT INTO workqueue (stage, payload) VALUES ('parse', '{}')`)
	waitFor(t, 20*time.Second, "the message done (notified)", func() bool { return countStatus(t, s, "done") == 1 })
	d.stop()
}

// TestClaimPastRoleLockTimeout holds one pending row locked in an open transaction (a
// producer's or an operator's UPDATE left open in psql), first in its stage's claim order, for
// a role whose lock_timeout or statement_timeout is shorter than the claim's budget. The claim
// waits for that row, and the server cuts it short (55P03, 57014): that is its budget running
// out, sooner, and the claimer passes over locked rows for a while (claimSkipLockedSQL). It was
// taken for the database refusing the stage's claim: the stage waited a second and met the same
// row again, and none of its messages ran while the row was held.
func TestClaimPastRoleLockTimeout(t *testing.T) {
	for _, setting := range []string{"lock_timeout = '100ms'", "statement_timeout = '300ms'"} {
		t.Run(strings.Fields(setting)[0], func(t *testing.T) {
			s := newTestSchema(t)
			s.exec(t, runsDDL)
			role := newTestRole(t, s, "pepsi_lt", setting)
			_, rollback := lockPendingRow(t, s, "parse", "")
			defer rollback()
			const n = 200
			s.exec(t, `INSERT INTO workqueue (stage, payload) SELECT 'parse', '{}' FROM generate_series(1, $1)`, n)
			d := startDaemon(t, confAs(baseConf(s, ""), s, role)+stageConf(t, "parse", "", "PARALLELISM = 2"), "pipeline")
			waitFor(t, 30*time.Second, "every message but the held one done", func() bool { return countStatus(t, s, "done") == n })
			d.waitLog("claiming past locked rows", 5*time.Second)
			if strings.Contains(d.log.String(), "refused this stage's claim") {
				t.Errorf("the claim cut short by the role's %s was taken for a refusal", setting)
			}
			rollback()
			waitFor(t, 90*time.Second, "the held one done once its lock went", func() bool { return countStatus(t, s, "done") == n+1 })
			d.stop()
		})
	}
}

// TestStandbyWaitCutByRoleTimeout runs a standby dispatcher for a role whose lock_timeout cuts
// its wait for the single-instance lock (55P03, cutWaiting): it waits again, says so, and takes
// the lock once the holder has stopped. The path had no test before cutWaiting replaced its own
// copy of the check.
func TestStandbyWaitCutByRoleTimeout(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	conf := baseConf(s, "STANDBY = yes") + stageConf(t, "parse", "", "")
	first := startDaemon(t, conf, "pipeline")
	first.waitLog("single-instance lock taken", 30*time.Second)
	role := newTestRole(t, s, "pepsi_sbw", "lock_timeout = '200ms'")
	second := startDaemon(t, confAs(conf, s, role), "pipeline")
	second.waitLog("standby: the wait for the lock was cut by a timeout; waiting again", 30*time.Second)
	first.stop()
	second.waitLog("single-instance lock taken", 30*time.Second)
	s.exec(t, `INSERT INTO workqueue (stage, payload) VALUES ('parse', '{}')`)
	waitFor(t, 30*time.Second, "the message done by the new holder", func() bool { return countStatus(t, s, "done") == 1 })
	second.stop()
	if strings.Contains(second.log.String(), "level=ERROR") {
		t.Errorf("the standby logged an error:\n%s", second.log.String())
	}
}
