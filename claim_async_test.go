// claim_async_test.go: the claim commits asynchronously (claim.go). Its own transaction only,
// whichever statement ran; and a real server crash that loses claims loses no message, runs
// no (message, stage) twice and charges no attempt.

package main

import (
	"context"
	"database/sql"
	"regexp"
	"strconv"
	"testing"
	"time"

	"pepsi-dispatch/internal/pgtest"

	"github.com/lib/pq"
)

// TestClaimCommitsAsynchronously runs both claim statements inside a transaction of the test's
// and reads synchronous_commit before its COMMIT: off, with rows claimed and with none (the
// final row sets it); after the transaction the session's own setting is back, so the lock
// connection's other writes (failures, resets, fan-in) still commit synchronously.
func TestClaimCommitsAsynchronously(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `INSERT INTO workqueue (stage) SELECT 'a' FROM generate_series(1, 10)`)
	conn := openLockConn(t, s)
	ctx := context.Background()
	show := func(q interface {
		QueryRowContext(context.Context, string, ...any) *sql.Row
	}) string {
		var v string
		if err := q.QueryRowContext(ctx, `SELECT current_setting('synchronous_commit')`).Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	if v := show(conn); v != "on" {
		t.Fatalf("the session's synchronous_commit is %q before any claim, want on", v)
	}
	statements := []struct {
		name string
		sql  string
		args []any
	}{
		{"claimSQL", claimSQL, []any{pq.Array([]string{"a"}), pq.Array([]int64{4})}},
		{"claimKeyedSQL", claimKeyedSQL, []any{pq.Array([]string{"a"}), pq.Array([]int64{4}), pq.Array([]int64{1}),
			pq.Array([]string{}), pq.Array([]string{}), pq.Array([]int64{})}},
		{"claimSQL, nothing to claim", claimSQL, []any{pq.Array([]string{"nosuchstage"}), pq.Array([]int64{4})}},
	}
	for _, st := range statements {
		tx, err := conn.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		rows, err := tx.QueryContext(ctx, st.sql, st.args...)
		if err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		n := 0
		for rows.Next() {
			n++
		}
		if err := rows.Err(); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		rows.Close()
		if n == 0 {
			t.Fatalf("%s returned no rows: its final row is missing", st.name)
		}
		if v := show(tx); v != "off" {
			t.Errorf("%s: synchronous_commit in its transaction is %q, want off", st.name, v)
		}
		if err := tx.Rollback(); err != nil {
			t.Fatal(err)
		}
		if v := show(conn); v != "on" {
			t.Errorf("after %s: the session's synchronous_commit is %q, want on (the setting must not outlive the claim's transaction)", st.name, v)
		}
	}
}

// TestClaimLostInServerCrash crashes PostgreSQL (pg_ctl stop -m immediate) while every message
// is claimed and its handler is still working. The cluster's WAL writer waits 10 s between
// flushes and the background writer writes no pages, so nothing flushes the claims' WAL
// before the crash: the claims are lost and the rows are pending again after recovery. The
// dispatcher, never restarted, must forget the messages it had handed out (the reconcile's
// count says so: that is what shows the claims were lost), run each message again, commit
// each (message, stage) once, and charge no attempt.
func TestClaimLostInServerCrash(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster of its own")
	}
	p := newPGNodes(t, 1, "pepsi-test-crash-")
	admin := p.nodeDB(0)
	for _, q := range []string{
		`ALTER SYSTEM SET wal_writer_delay = '10s'`,
		`ALTER SYSTEM SET bgwriter_lru_maxpages = 0`,
		`SELECT pg_reload_conf()`,
	} {
		pgtest.Exec(t, admin, q)
	}
	waitFor(t, 10*time.Second, "wal_writer_delay reloaded", func() bool {
		var v string
		return admin.QueryRow(`SHOW wal_writer_delay`).Scan(&v) == nil && v == "10s"
	})

	s := p.schema(t)
	s.exec(t, runsDDL)

	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 3\nQUEUE_LIMIT = 2"), "pipeline")
	warmUp(t, s, "a")
	const n = 6
	enqueue(t, s, "a", n, `{"sleep_ms": 3000}`)
	waitFor(t, 30*time.Second, "every message claimed", func() bool { return poll(s, `SELECT count(*) FROM workqueue WHERE status = 'running'`) == n })
	p.run("kill", p.dirs[0])
	p.run("start", p.dirs[0]) // crash recovery

	d.waitLog("reconciled the table with memory", 60*time.Second)
	m := regexp.MustCompile(`reconciled the table with memory.* forgotten=(\d+)`).FindStringSubmatch(d.log.String())
	if m == nil {
		t.Fatalf("no forgotten count in the reconcile's line:\n%s", d.log.String())
	}
	if forgotten, _ := strconv.Atoi(m[1]); forgotten != n {
		t.Fatalf("the reconcile forgot %d messages, want %d: the crash did not lose the claims (the test's premise)\n%s",
			forgotten, n, d.log.String())
	}
	waitFor(t, 60*time.Second, "every message done", func() bool {
		return poll(s, `SELECT count(*) FROM workqueue WHERE status = 'done'`) == n+1
	})
	if bad := s.count(t, `SELECT count(*) FROM (SELECT id, stage FROM runs GROUP BY 1, 2 HAVING count(*) <> 1) x`); bad != 0 {
		t.Errorf("%d (message, stage) pairs committed other than once", bad)
	}
	if runs := s.count(t, `SELECT count(*) FROM runs`); runs != n+1 {
		t.Errorf("%d runs committed, want %d", runs, n+1)
	}
	checkRodeOut(t, s, d, "the crash")
	d.stop()
}
