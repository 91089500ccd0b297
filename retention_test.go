package main

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestRetentionRetryCommittedMeanwhile: an operator's retry of an old cancelled message that
// commits while a retention turn is deleting must win: the message is pending afterwards, not
// gone. The retry's transaction is held open until the turn has met its row lock (or passed
// it by), then committed; the turn was planned from a snapshot in which the row was still
// cancelled and old.
func TestRetentionRetryCommittedMeanwhile(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `INSERT INTO workqueue (stage, status, created_at, status_at)
		SELECT 'zz', 'cancelled', now() - interval '10 days', now() - interval '8 days' FROM generate_series(1, 3)`)
	x := int64(s.count(t, `SELECT min(workqueue_id) FROM workqueue`))

	tx, err := s.DB.Begin()
	if err != nil {
		t.Fatalf("begin the operator's retry: %v", err)
	}
	defer tx.Rollback()
	var ok bool
	var holder int
	if err := tx.QueryRow(`SELECT ok FROM queue_retry(ARRAY[$1]::bigint[])`, x).Scan(&ok); err != nil || !ok {
		t.Fatalf("queue_retry(%d): ok %v, err %v", x, ok, err)
	}
	if err := tx.QueryRow(`SELECT pg_backend_pid()`).Scan(&holder); err != nil {
		t.Fatalf("the retry's backend: %v", err)
	}

	type result struct {
		n   int64
		err error
	}
	turned := make(chan result, 1)
	go func() {
		n, _, err := retentionTurn(context.Background(), s.DB, 7*24*time.Hour, 0)
		turned <- result{n, err}
	}()
	var got *result
	waitFor(t, 10*time.Second, "the retention turn waiting for the retry's row lock, or done", func() bool {
		select {
		case res := <-turned:
			got = &res
			return true
		default:
		}
		return s.count(t, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid))`, holder) > 0
	})
	if err := tx.Commit(); err != nil {
		t.Fatalf("commit the operator's retry: %v", err)
	}
	if got == nil {
		select {
		case res := <-turned:
			got = &res
		case <-time.After(10 * time.Second):
			t.Fatal("the retention turn did not finish after the retry committed")
		}
	}
	if got.err != nil {
		t.Fatalf("retention turn: %v", got.err)
	}
	var status string
	if err := s.DB.QueryRow(`SELECT coalesce((SELECT status FROM workqueue WHERE workqueue_id = $1), 'gone')`, x).Scan(&status); err != nil {
		t.Fatalf("read message %d's status: %v", x, err)
	}
	if status != "pending" {
		t.Errorf("message %d, retried by an operator while retention ran, is %s (want pending): the retry is lost", x, status)
	}
	if got.n != 2 || s.count(t, `SELECT count(*) FROM workqueue`) != 1 {
		t.Errorf("the turn deleted %d rows, %d left; want the 2 other old cancelled rows deleted, 1 left",
			got.n, s.count(t, `SELECT count(*) FROM workqueue`))
	}
}

// TestRetentionBlockedClaimsGoOn: a retention turn that waits (here for a row lock, through an
// application's foreign key to a message, ON DELETE SET NULL, whose referencing row an open
// transaction holds) does not stop the dispatcher: messages enqueued meanwhile run at once,
// and the turn, cancelled because the pipeline has work again, deletes nothing. On the
// coordinator's own goroutine, as it was, the turn held every claim for the statement
// budget.
func TestRetentionBlockedClaimsGoOn(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	s.exec(t, `CREATE TABLE app_ref (msg bigint REFERENCES workqueue ON DELETE SET NULL)`)
	old := int64(s.count(t, `INSERT INTO workqueue (stage, status, created_at, status_at)
	    VALUES ('zz', 'done', now() - interval '10 days', now() - interval '8 days') RETURNING workqueue_id`))
	s.exec(t, `INSERT INTO app_ref VALUES ($1)`, old)
	tx, err := s.DB.Begin()
	if err != nil {
		t.Fatalf("begin the referencing row's holder: %v", err)
	}
	defer tx.Rollback()
	var holder int
	if err := tx.QueryRow(`SELECT pg_backend_pid() FROM app_ref FOR UPDATE`).Scan(&holder); err != nil {
		t.Fatalf("lock the referencing row: %v", err)
	}

	d := startDaemon(t, baseConf(s, "RETENTION = 7d")+stageConf(t, "a", "", "PARALLELISM = 2\nQUEUE_LIMIT = 4"), "pipeline")
	blocked := func() int {
		return s.count(t, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid))`, holder)
	}
	// The first turn comes 1 s after the start; its delete waits for the referencing row.
	waitFor(t, 30*time.Second, "the retention turn waiting for the referencing row's lock", func() bool { return blocked() == 1 })
	since := time.Now()
	enqueue(t, s, "a", 5, `{}`)
	waitFor(t, dbStatementBudget/2, "the 5 messages done while the retention turn waits", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE stage = 'a' AND status = 'done'`) == 5
	})
	took := time.Since(since)
	waitFor(t, 10*time.Second, "the retention turn cancelled", func() bool { return blocked() == 0 })
	d.waitLog("retention turn stopped: messages in flight, or a shutdown", 5*time.Second)
	if strings.Contains(d.log.String(), "retention turn failed") {
		t.Errorf("the turn failed instead of being stopped:\n%s", d.log.String())
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1`, old); n != 1 {
		t.Errorf("the old done row is gone, but its delete was cancelled")
	}
	noRunTwice(t, s)
	t.Logf("5 messages done %v after they were enqueued, while the turn waited", took.Round(time.Millisecond))
	tx.Rollback()
	d.stop()
}
