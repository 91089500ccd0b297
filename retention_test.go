package main

import (
	"context"
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
		t.Fatal(err)
	}
	defer tx.Rollback()
	var ok bool
	var holder int
	if err := tx.QueryRow(`SELECT ok FROM queue_retry(ARRAY[$1]::bigint[])`, x).Scan(&ok); err != nil || !ok {
		t.Fatalf("queue_retry(%d): ok %v, err %v", x, ok, err)
	}
	if err := tx.QueryRow(`SELECT pg_backend_pid()`).Scan(&holder); err != nil {
		t.Fatal(err)
	}

	type result struct {
		n   int64
		err error
	}
	turned := make(chan result, 1)
	r := &retainer{age: 7 * 24 * time.Hour}
	go func() {
		n, err := r.turn(context.Background(), s.DB)
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
		t.Fatal(err)
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
		t.Fatal(err)
	}
	if status != "pending" {
		t.Errorf("message %d, retried by an operator while retention ran, is %s (want pending): the retry is lost", x, status)
	}
	if got.n != 2 || s.count(t, `SELECT count(*) FROM workqueue`) != 1 {
		t.Errorf("the turn deleted %d rows, %d left; want the 2 other old cancelled rows deleted, 1 left",
			got.n, s.count(t, `SELECT count(*) FROM workqueue`))
	}
}
