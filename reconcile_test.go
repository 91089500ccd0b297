package main

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/lib/pq"
)

// TestRunningReadPastRoleStatementTimeout reads the running rows of a table whose one scan
// takes longer than the session's statement_timeout, as a role's setting makes it for every
// session of the dispatcher: the start's orphan reset read them in one statement, which was
// cut, and the dispatcher could not start ("reset orphaned running rows: read running rows:
// ... statement timeout"), nor reconcile after a re-lock once the table outgrew the statement
// budget. The read goes a window at a time, halving a window the timeout cuts; it must find
// every running row, wherever the windows' edges fall.
func TestRunningReadPastRoleStatementTimeout(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `ALTER TABLE workqueue SET (autovacuum_enabled = false)`)
	s.exec(t, `INSERT INTO workqueue (workqueue_id, stage, status)
	           SELECT i, 'a', 'done' FROM generate_series(1, 600000) i`)
	s.exec(t, `VACUUM ANALYZE workqueue`)
	// Running rows at the first id, at both sides of the first full window's edge, in the
	// middle, without a claim token (a version before tokens), and at the last id.
	want := []message{{id: 1, stage: "a", claim: 11}, {id: runningWindow, stage: "b", claim: 12},
		{id: runningWindow + 1, stage: "a", claim: 13}, {id: 123457, stage: "c", claim: 0},
		{id: 600000, stage: "a", claim: 14}}
	for _, m := range want {
		var claim any
		if m.claim != 0 {
			claim = m.claim
		}
		s.exec(t, `UPDATE workqueue SET status = 'running', stage = $2, claim = $3 WHERE workqueue_id = $1`, m.id, m.stage, claim)
	}
	ctx := context.Background()
	conn, err := s.DB.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// The timeout a third of one full window's quickest time here, so that a window of
	// runningWindow rows outlasts it however fast the machine is today (one scan of the table,
	// twelve windows long, all the more): the read gets through only by halving its windows.
	window := func() error {
		var ids, claims []int64
		var stages []string
		var looked, last int64
		return conn.QueryRowContext(ctx, readRunningSQL, 0, runningWindow).
			Scan((*pq.Int64Array)(&ids), (*pq.StringArray)(&stages), (*pq.Int64Array)(&claims), &looked, &last)
	}
	exec := func(q string) error { _, err := conn.ExecContext(ctx, q); return err }
	cutStatement(t, exec, window, 3, fmt.Sprintf("a window of %d rows", runningWindow))
	got, err := readRunning(ctx, conn)
	if err != nil {
		t.Fatalf("read running rows: %v", err)
	}
	var rows []message
	for _, m := range got {
		rows = append(rows, message{id: m.id, stage: m.stage, claim: m.claim})
	}
	slices.SortFunc(rows, func(a, b message) int { return int(a.id - b.id) })
	if !slices.EqualFunc(rows, want, func(a, b message) bool { return a.id == b.id && a.stage == b.stage && a.claim == b.claim }) {
		t.Errorf("running rows: got %+v, want %+v", rows, want)
	}
}
