package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

// holdRow inserts one row (insert ends in RETURNING workqueue_id) and holds its lock in an
// open transaction, as an UPDATE left uncommitted in psql would. The lock goes with the
// returned rollback.
func holdRow(t *testing.T, s *testSchema, insert string, args ...any) (id int64, rollback func()) {
	t.Helper()
	if err := s.DB.QueryRow(insert, args...).Scan(&id); err != nil {
		t.Fatalf("insert the row to hold: %v", err)
	}
	tx, err := s.DB.Begin()
	if err != nil {
		t.Fatalf("begin the lock holder: %v", err)
	}
	if _, err := tx.Exec(`UPDATE workqueue SET priority = priority WHERE workqueue_id = $1`, id); err != nil {
		t.Fatalf("lock row %d: %v", id, err)
	}
	return id, func() { tx.Rollback() }
}

// lockPendingRow makes a pending row at stage and holds its lock in an open transaction, as a
// producer's or an operator's UPDATE left open in psql would (the row stays pending and
// visible to the claim).
func lockPendingRow(t *testing.T, s *testSchema, stage, key string) (id int64, rollback func()) {
	t.Helper()
	return holdRow(t, s, `INSERT INTO workqueue (stage, payload, concurrency_key) VALUES ($1, '{}', nullif($2, ''))
	    RETURNING workqueue_id`, stage, key)
}

// TestClaimSkipLockedVariants: in skip mode both claims (with and without a KEY_LIMIT) take
// every pending row but the one another transaction holds, at once, and in the order of the
// ordinary claim; the ordinary claim, meanwhile, waits for that row (here until its context
// gives up), which is why the mode exists.
func TestClaimSkipLockedVariants(t *testing.T) {
	s := newTestSchema(t)
	// Each locked row comes first in its stage's claim order.
	locked, rollback := lockPendingRow(t, s, "a", "")
	defer rollback()
	lockedKeyed, rollbackKeyed := lockPendingRow(t, s, "k", "key-0")
	defer rollbackKeyed()
	s.exec(t, `INSERT INTO workqueue (stage) SELECT 'a' FROM generate_series(1, 5)`)
	s.exec(t, `INSERT INTO workqueue (stage, concurrency_key) SELECT 'k', 'key-' || (g % 2) FROM generate_series(1, 6) g`)
	conn := openLockConn(t, s)
	keys := &keyLoad{limit: map[string]int{"k": 2}, busy: map[stageKey]int{}}

	// The ordinary claims wait for the locked rows, and a claimer whose claim ran out of time
	// says it now skips locked rows (a fresh claimer each: the first one is in skip mode after).
	for _, c := range []struct {
		stage string
		keys  *keyLoad
	}{{"a", &keyLoad{}}, {"k", keys}} {
		var plain claimer
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		_, err := plain.claim(ctx, conn, map[string]int{c.stage: 10}, c.keys)
		cancel()
		plain.close()
		if err == nil {
			t.Fatalf("the ordinary claim of stage %s did not wait for its locked row: the test's premise is gone", c.stage)
		}
		if !errors.Is(err, errSkipLocked) || !time.Now().Before(plain.skipUntil) {
			t.Errorf("claim of stage %s out of time: %v, skip mode until %v; want errSkipLocked and skip mode", c.stage, err, plain.skipUntil)
		}
	}

	var cl claimer
	defer cl.close()
	cl.skipUntil = time.Now().Add(time.Hour)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := cl.claim(ctx, conn, map[string]int{"a": 10}, &keyLoad{})
	if err != nil {
		t.Fatalf("skip-locked claim: %v", err)
	}
	var prev int64
	for _, m := range res.byStage["a"] {
		if m.id == locked {
			t.Errorf("the skip-locked claim took the locked row %d", locked)
		}
		if m.id <= prev {
			t.Errorf("stage a not in id order: %v", res.byStage["a"])
		}
		prev = m.id
	}
	if len(res.byStage["a"]) != 5 {
		t.Errorf("the skip-locked claim took %d rows of stage a, want the 5 unlocked ones", len(res.byStage["a"]))
	}

	res, err = cl.claim(ctx, conn, map[string]int{"k": 10}, keys)
	if err != nil {
		t.Fatalf("skip-locked keyed claim: %v", err)
	}
	perKey := map[string]int{}
	for _, m := range res.byStage["k"] {
		if m.id == lockedKeyed {
			t.Errorf("the skip-locked keyed claim took the locked row %d", lockedKeyed)
		}
		perKey[m.key]++
	}
	if perKey["key-0"] != 2 || perKey["key-1"] != 2 || len(res.byStage["k"]) != 4 {
		t.Errorf("the skip-locked keyed claim took %v, want 2 rows of each key (KEY_LIMIT 2)", perKey)
	}
	rollback()
	rollbackKeyed()
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = ANY (ARRAY[$1, $2]::bigint[]) AND status = 'pending'`,
		locked, lockedKeyed); n != 2 {
		t.Errorf("%d of the two locked rows still pending after their lock went, want 2", n)
	}
}

// TestClaimRowLockedElsewhere: a transaction that holds one pending row's lock, left open, does
// not stop the dispatcher. Stage a (PARALLELISM 1) is busy with a slow message when the row
// behind it is locked; the claim meets the lock when the slow one ends, waits its budget, and
// from then on claims past locked rows: messages of another stage enqueued after the lock run,
// and the locked row runs exactly once after the lock is gone. Before the skip mode those
// messages did not run in 40 s: every claim waited for the row and was cancelled at its budget.
func TestClaimRowLockedElsewhere(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 1")+
		stageConf(t, "b", "", "PARALLELISM = 2\nQUEUE_LIMIT = 4"), "pipeline")
	enqueue(t, s, "b", 2, `{}`)
	waitFor(t, 30*time.Second, "2 done", func() bool { return countStatus(t, s, "done") == 2 })
	enqueue(t, s, "a", 1, `{"sleep_ms": 1000}`)
	waitFor(t, 30*time.Second, "the slow message running", func() bool { return countStatus(t, s, "running") == 1 })
	locked, rollback := lockPendingRow(t, s, "a", "")
	defer rollback()
	// The slow message ends and the claim waits for the locked row.
	waitFor(t, 30*time.Second, "a claim waiting for the locked row", func() bool {
		return s.count(t, `SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid()
		    AND wait_event_type = 'Lock' AND query LIKE '%workqueue_claim_seq%'`) == 1
	})
	enqueue(t, s, "b", 5, `{}`)
	waitFor(t, dbStatementBudget+30*time.Second, "the 5 messages of stage b done", func() bool {
		return countStatus(t, s, "done") == 8
	})
	if !strings.Contains(d.log.String(), "claiming past locked rows") {
		t.Errorf("the daemon did not say it claims past locked rows:\n%s", d.log.String())
	}
	if n := countStatus(t, s, "pending"); n != 1 {
		t.Errorf("%d rows pending while the lock is held, want the locked one", n)
	}
	heldRowRunsOnce(t, s, locked, rollback, 9)
	d.stop()
}

// heldRowRunsOnce lets a held row go (rollback) and requires that it then runs exactly once,
// with wantDone rows done in all, and that no (message, stage) ran twice (runsDDL's table).
func heldRowRunsOnce(t *testing.T, s *testSchema, held int64, rollback func(), wantDone int) {
	t.Helper()
	rollback()
	waitFor(t, 30*time.Second, "the held row done once its lock went", func() bool { return countStatus(t, s, "done") == wantDone })
	if n := s.count(t, `SELECT count(*) FROM runs WHERE id = $1`, held); n != 1 {
		t.Errorf("the held row ran %d times, want 1", n)
	}
	noRunTwice(t, s)
}

// noRunTwice requires that no (message, stage) ran more than once (runsDDL's table).
func noRunTwice(t *testing.T, s *testSchema) {
	t.Helper()
	if n := s.count(t, `SELECT count(*) FROM (SELECT id, stage FROM runs GROUP BY id, stage HAVING count(*) > 1) x`); n != 0 {
		t.Errorf("%d (message, stage) pairs ran more than once", n)
	}
}

// TestRetryFlipRowLockedElsewhere: a transaction that holds the lock of a paused row that is
// due, left open, does not stop the dispatcher. The return of due paused rows passes the
// held row over: messages enqueued meanwhile run, and the held row runs exactly once after its
// lock goes (the claims report it due again). Before, the flip waited for the row on the
// coordinator's loop, was cancelled at its budget (the lock connection with it) and tried
// again, and no claim was made in between.
func TestRetryFlipRowLockedElsewhere(t *testing.T) {
	heldRowPassedOver(t, stageConf(t, "a", "", "PARALLELISM = 2\nQUEUE_LIMIT = 4"), "a",
		`INSERT INTO workqueue (stage, payload, status, retry_at, attempts)
		 VALUES ('a', '{}', 'paused', now() - interval '1 second', 1) RETURNING workqueue_id`,
		`SELECT count(*) FROM workqueue WHERE workqueue_id = $1 AND status = 'paused'`)
}

// heldRowPassedOver is the scenario of the tests around it: a row made by insert is held by an
// open transaction from before the dispatcher (stages) starts; five messages enqueued at stage
// must then be done within half a statement budget, with the held row still as whileHeld
// (a count of it) says and the lock connection never lost; once the lock goes, the held row
// must run exactly once.
func heldRowPassedOver(t *testing.T, stages, stage, insert, whileHeld string) {
	t.Helper()
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	held, rollback := holdRow(t, s, insert)
	defer rollback()
	d := startDaemon(t, baseConf(s, "")+stages, "pipeline")
	d.waitLog("dispatching", 30*time.Second)
	enqueue(t, s, stage, 5, `{}`)
	waitFor(t, dbStatementBudget/2, "the 5 new messages done while a row is held", func() bool {
		return countStatus(t, s, "done") == 5
	})
	if n := s.count(t, whileHeld, held); n != 1 {
		t.Errorf("the held row changed while its lock is held (%s: %d)", whileHeld, n)
	}
	if strings.Contains(d.log.String(), "database connection lost") {
		t.Errorf("the dispatcher lost its lock connection over a held row:\n%s", d.log.String())
	}
	heldRowRunsOnce(t, s, held, rollback, 6)
	d.stop()
}

// TestScheduleRetryPassedOver: a due time that was already past when the last flip started
// (a row the flip passed over because another transaction held it) is tried again a gap after
// that flip, however often claims report it; one that came due after the flip started is kept.
func TestScheduleRetryPassedOver(t *testing.T) {
	c := &coordinator{timers: newTimerHeap()}
	c.lastFlip = time.Now()
	for _, tc := range []struct {
		what      string
		due, want time.Time
	}{
		{"due before the flip (passed over)", c.lastFlip.Add(-time.Minute), c.lastFlip.Add(heldRetryGap)},
		{"due as the flip started", c.lastFlip, c.lastFlip.Add(heldRetryGap)},
		{"due after the flip started", c.lastFlip.Add(time.Millisecond), c.lastFlip.Add(time.Millisecond)},
		{"due later", c.lastFlip.Add(time.Hour), c.lastFlip.Add(time.Hour)},
	} {
		c.scheduleRetry(tc.due)
		if at, ok := c.timers.next(); !ok || !at.Equal(tc.want) {
			t.Errorf("%s: retry timer at %v (set %v), want %v", tc.what, at, ok, tc.want)
		}
	}
	c.scheduleRetry(time.Time{})
	if at, ok := c.timers.next(); ok {
		t.Errorf("no paused row: the retry timer is still set, at %v", at)
	}
}

// TestUnparkRowLockedElsewhere: a parked row (a KEY_LIMIT's, left by a run whose stage had one)
// held by an open transaction when the dispatcher starts does not stop it. The unpark at start
// passes the held row over: messages of another stage run, and the held row is unparked and
// runs exactly once after its lock goes. Before, the unpark waited for the row on the
// coordinator's loop ahead of every claim, was cancelled at its budget (the lock connection
// with it) and ran again.
func TestUnparkRowLockedElsewhere(t *testing.T) {
	heldRowPassedOver(t, stageConf(t, "a", "", "")+stageConf(t, "b", "", "PARALLELISM = 2\nQUEUE_LIMIT = 4"), "b",
		`INSERT INTO workqueue (stage, payload, concurrency_key, key_parked) VALUES ('a', '{}', 'k', true) RETURNING workqueue_id`,
		`SELECT count(*) FROM workqueue WHERE workqueue_id = $1 AND status = 'pending' AND key_parked`)
}

// TestTimeoutRowHeldByItsSession: a handler that wrote its own row and then waits in a
// statement past MAX_RUNTIME is killed, but its session goes on with the statement and keeps
// the row's lock (PostgreSQL notices a vanished client only when it next talks to it). The
// timeout's failure write must not wait for that lock on the coordinator's loop: messages of
// another stage enqueued meanwhile run, the lock connection stays, and the timed-out row stays
// running, unfailed, while held (whether its stage committed is not known until the session
// ends), through a re-lock too. Once the session's statement is cancelled, the timeout is
// recorded and charged as an attempt, and the message runs again, once. Before, no message
// was claimed while the row was held: the write was cancelled at its budget with the lock
// connection, every 10 s, and the re-lock turned the timeout into a reset that charged no
// attempt, so such a message would run again for ever.
func TestTimeoutRowHeldByItsSession(t *testing.T) {
	s := newTestSchema(t)
	d, held, session := startHeldTimeout(t, s, `{"hold_at": "a"}`,
		stageConf(t, "b", "", "PARALLELISM = 2\nQUEUE_LIMIT = 4"))
	enqueue(t, s, "b", 5, `{}`)
	waitFor(t, dbStatementBudget/2, "the 5 messages of stage b done while the timed-out row is held", func() bool {
		return countStatus(t, s, "done") == 5
	})
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1 AND status = 'running' AND attempts = 0`, held); n != 1 {
		t.Errorf("the timed-out row is not running and unfailed while its session holds it")
	}
	if strings.Contains(d.log.String(), "database connection lost") {
		t.Errorf("the dispatcher lost its lock connection over a held row:\n%s", d.log.String())
	}
	stillThere := func() {
		t.Helper()
		if n := s.count(t, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND query = 'SELECT pg_sleep(3600)'`, session); n != 1 {
			t.Fatalf("the handler's session is no longer in its statement: the test's premise is gone")
		}
	}
	stillThere()
	// A re-lock meanwhile (its reconcile turns the failures an outage interrupted into
	// resets, which charge nothing) leaves the waiting failure a failure.
	terminateLockSession(t, s)
	d.waitLog("reconciled the table with memory", 30*time.Second)
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1 AND status = 'running' AND attempts = 0`, held); n != 1 {
		t.Errorf("the timed-out row is not running and unfailed after the re-lock, while still held")
	}
	stillThere()
	s.exec(t, `SELECT pg_cancel_backend($1)`, session)
	timedOutRunsOnce(t, s, held)
	d.stop()
}

// TestReconcileOrphanRowHeld: a re-lock's reconcile that finds a running row nobody holds (a
// claim whose reply the outage lost) while another transaction holds that row's lock passes it
// over and resets it once the lock goes: the claims resume at once, and the row runs exactly
// once. Before, the reconcile waited for the row, was cancelled at its budget with the lock
// connection, and began again after the re-lock, with no claim in between.
func TestReconcileOrphanRowHeld(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 2\nQUEUE_LIMIT = 4"), "pipeline")
	d.waitLog("dispatching", 30*time.Second)
	held, rollback := holdRow(t, s, `INSERT INTO workqueue (stage, payload, status, claim)
	    VALUES ('a', '{}', 'running', 424242) RETURNING workqueue_id`)
	defer rollback()
	terminateLockSession(t, s)
	d.waitLog("single-instance lock taken again", 30*time.Second)
	enqueue(t, s, "a", 5, `{}`)
	waitFor(t, dbStatementBudget/2, "the 5 new messages done while the orphan is held", func() bool {
		return countStatus(t, s, "done") == 5
	})
	if !strings.Contains(d.log.String(), "running_held=1") {
		t.Errorf("the reconcile did not say it passed a held running row over:\n%s", d.log.String())
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1 AND status = 'running'`, held); n != 1 {
		t.Errorf("the held orphan changed while its lock is held")
	}
	heldRowRunsOnce(t, s, held, rollback, 6)
	d.stop()
}

// TestStartupOrphanRowHeld: at start, a running row left by an earlier run whose lock another
// transaction holds (an operator's UPDATE left open in psql) is passed over by the reset of
// the earlier run's rows: the dispatcher starts, resets and runs the other orphan and new
// messages at once, and resets the held row once its lock goes; it runs exactly once. Before,
// the start waited for that row with no budget: no claim, no "dispatching", for as long as
// the transaction stayed open.
func TestStartupOrphanRowHeld(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	s.exec(t, `INSERT INTO workqueue (stage, payload, status, claim) VALUES ('a', '{}', 'running', 424241)`)
	held, rollback := holdRow(t, s, `INSERT INTO workqueue (stage, payload, status, claim)
	    VALUES ('a', '{}', 'running', 424242) RETURNING workqueue_id`)
	defer rollback()
	addr := freePort(t)
	d := startDaemon(t, baseConf(s, "METRICS_LISTEN = "+addr)+stageConf(t, "a", "", "PARALLELISM = 2\nQUEUE_LIMIT = 4"), "pipeline")
	d.waitLog("dispatching", dbStatementBudget)
	if !strings.Contains(d.log.String(), "orphans_held=1") {
		t.Errorf("the start did not say it passed a held running row over:\n%s", d.log.String())
	}
	waitFor(t, 5*time.Second, "pepsi_held_writes 1 on /metrics", func() bool {
		v, ok := metric(t, addr, "pepsi_held_writes")
		return ok && v == 1
	})
	if page := consoleOverview(t, addr); !strings.Contains(page, "<b>1</b> failure or reset write (their messages stay running)") {
		t.Errorf("the console's overview does not show the held write:\n%s", page)
	}
	enqueue(t, s, "a", 5, `{}`)
	waitFor(t, dbStatementBudget/2, "the unheld orphan and the 5 new messages done while the held orphan is held", func() bool {
		return countStatus(t, s, "done") == 6
	})
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1 AND status = 'running'`, held); n != 1 {
		t.Errorf("the held orphan changed while its lock is held")
	}
	// Its row is running, and the rows gauges count it: the dispatcher's count of running rows
	// (no index serves them) includes its writes not yet made.
	waitFor(t, 5*time.Second, "the held orphan counted running on /metrics", func() bool {
		v, ok := metric(t, addr, `pepsi_rows{stage="a",status="running"}`)
		return ok && v == 1
	})
	heldRowRunsOnce(t, s, held, rollback, 7)
	waitFor(t, 5*time.Second, "pepsi_held_writes back to 0 on /metrics", func() bool {
		v, ok := metric(t, addr, "pepsi_held_writes")
		return ok && v == 0
	})
	d.stop()
}

// TestTimedOutWorkersSessionEnds: a handler whose session checks its client while a statement
// runs (client_connection_check_interval, as pepsi-worker(7) advises for long statements) and
// that wrote its row and then waits in a statement past MAX_RUNTIME: once the dispatcher kills
// its worker, the session ends by itself within seconds, its transaction rolled back and the
// row let go; the timeout is written and charged once, and the message runs again, once.
func TestTimedOutWorkersSessionEnds(t *testing.T) {
	s := newTestSchema(t)
	d, held, session := startHeldTimeout(t, s, `{"hold_at": "a", "hold_checked": true}`, "")
	waitFor(t, 5*time.Second, "the killed worker's session gone by itself", func() bool {
		return s.count(t, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, session) == 0
	})
	timedOutRunsOnce(t, s, held)
	d.stop()
}

// startHeldTimeout starts a dispatcher with MAX_RUNTIME = 1 s, stage a (one worker, one message
// at a time, RETRY_DELAY 0.2 s) and the stages of more, and one message at a with payload
// (pipelineWorker's HoldAt): it returns once the message's worker has been killed for its
// timeout, with the message and the pid of the worker's session, which was then in its
// endless statement (cancelled at the end of the test, if still there).
func startHeldTimeout(t *testing.T, s *testSchema, payload, more string) (d *daemon, held int64, session int) {
	t.Helper()
	s.exec(t, runsDDL)
	d = startDaemon(t, baseConf(s, "MAX_RUNTIME = 1")+
		stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 1\nRETRY_DELAY = 0.2")+more, "pipeline")
	d.waitLog("dispatching", 30*time.Second)
	if err := s.DB.QueryRow(`INSERT INTO workqueue (stage, payload) VALUES ('a', $1) RETURNING workqueue_id`,
		payload).Scan(&held); err != nil {
		t.Fatalf("enqueue the message that holds its row: %v", err)
	}
	waitFor(t, 30*time.Second, "the handler's session in its endless statement", func() bool {
		session = s.count(t, `SELECT coalesce(max(pid), 0) FROM pg_stat_activity
		    WHERE datname = current_database() AND query = 'SELECT pg_sleep(3600)'`)
		return session != 0
	})
	t.Cleanup(func() { s.DB.Exec(`SELECT pg_cancel_backend($1)`, session) })
	d.waitLog("timeout after 1s (worker killed)", 30*time.Second)
	return d, held, session
}

// timedOutRunsOnce requires that the message held, whose first attempt timed out, is done at
// its second attempt: charged once, run to its end once, and no (message, stage) run twice.
func timedOutRunsOnce(t *testing.T, s *testSchema, held int64) {
	t.Helper()
	waitFor(t, 30*time.Second, "the timed-out message done at its second attempt", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1 AND status = 'done'`, held) == 1
	})
	if n := s.count(t, `SELECT attempts FROM workqueue WHERE workqueue_id = $1`, held); n != 1 {
		t.Errorf("the timed-out message has %d attempts, want 1: its timeout was not charged once", n)
	}
	if n := s.count(t, `SELECT count(*) FROM runs WHERE id = $1`, held); n != 1 {
		t.Errorf("the timed-out message ran to its end %d times, want 1", n)
	}
	noRunTwice(t, s)
}

// terminateLockSession ends the dispatcher's lock connection (the session that holds its
// advisory lock), as a network cut would: the dispatcher re-locks and reconciles.
func terminateLockSession(t *testing.T, s *testSchema) {
	t.Helper()
	if n := s.count(t, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
	    WHERE pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory'
	                   AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))
	      AND application_name LIKE 'pepsi-dispatch %'`); n != 1 {
		t.Fatalf("terminated %d lock sessions, want 1", n)
	}
}

// TestStatsRowHeldClaimsGoOn: another transaction holds the dispatch_stats row (an operator's
// UPDATE left open, a schema upgrade's ALTER waiting behind something). The statistics write,
// which runs on the coordinator's loop every STATS_INTERVAL, gives up at once and keeps its
// figures, so messages go on flowing; once the row is let go, the figures are written, none
// lost.
func TestStatsRowHeldClaimsGoOn(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	s.exec(t, `INSERT INTO dispatch_stats (id) VALUES (1) ON CONFLICT DO NOTHING`)
	holder, err := s.DB.Begin()
	if err != nil {
		t.Fatalf("begin the lock holder: %v", err)
	}
	defer holder.Rollback()
	if _, err := holder.Exec(`UPDATE dispatch_stats SET updated_at = updated_at WHERE id = 1`); err != nil {
		t.Fatalf("hold the dispatch_stats row: %v", err)
	}
	conf := strings.Replace(baseConf(s, ""), "STATS_INTERVAL = 60", "STATS_INTERVAL = 0.2", 1) +
		stageConf(t, "a", "", "PARALLELISM = 2\nQUEUE_LIMIT = 16")
	d := startDaemon(t, conf, "pipeline")
	d.waitLog("dispatching", 30*time.Second)
	const batches, per = 5, 40
	for i := 0; i < batches; i++ {
		enqueue(t, s, "a", per, `{}`)
		waitFor(t, 2*time.Second, fmt.Sprintf("batch %d of %d done while the statistics row is held", i+1, batches), func() bool {
			return countStatus(t, s, "done") == (i+1)*per
		})
	}
	d.waitLog("statistics not flushed; kept for the next flush", time.Second)
	if err := holder.Rollback(); err != nil {
		t.Fatalf("let the row go: %v", err)
	}
	waitFor(t, 10*time.Second, "every message counted in dispatch_stats", func() bool {
		return s.count(t, `SELECT done FROM dispatch_stats WHERE id = 1`) == batches*per
	})
	d.stop()
}
