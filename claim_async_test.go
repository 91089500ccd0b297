// claim_async_test.go: the claim commits asynchronously (claim.go). Its own transaction only,
// whichever statement ran; and a real server crash that loses claims loses no message, runs
// no (message, stage) twice and charges no attempt.

package main

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"pepsi-dispatch/internal/pgtest"
	"pepsi-dispatch/internal/schemafile"

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
// before the crash: the claims are lost, the rows are pending again after recovery, and the
// claim sequence's advance may be lost with them. The dispatcher, never restarted, must forget
// the messages it had handed out (the reconcile's count says so: that is what shows the claims
// were lost), run each message again, commit each (message, stage) once, and charge no
// attempt.
func TestClaimLostInServerCrash(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster of its own")
	}
	root, err := os.MkdirTemp("", "pepsi-test-crash-")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(root, 0o755) // the cluster runs as another account when the tests run as root
	p := &pgPair{t: t, script: filepath.Join(testPG.Root(), "scripts/pg-private")}
	p.dirs[0] = filepath.Join(root, "n0")
	t.Cleanup(func() {
		exec.Command(p.script, "stop", p.dirs[0]).Run() // best effort: the directory goes anyway
		os.RemoveAll(root)
	})
	p.run("start", p.dirs[0])
	port, err := os.ReadFile(filepath.Join(p.dirs[0], "port"))
	if err != nil {
		t.Fatal(err)
	}
	p.ports[0] = strings.TrimSpace(string(port))
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

	name := fmt.Sprintf("crash_%d", time.Now().UnixNano()%1e9)
	pgtest.Exec(t, admin, "CREATE SCHEMA "+name)
	ddl, err := schemafile.Read(filepath.Join(testPG.Root(), "schema.sql"))
	if err != nil {
		t.Fatal(err)
	}
	dsn := p.dsn([]int{0}, fmt.Sprintf("options='-c search_path=%s'", name))
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxIdleConns(0) // no idle connection for the crash to cut under the test's queries
	t.Cleanup(func() { db.Close() })
	pgtest.Exec(t, db, ddl)
	s := &testSchema{Name: name, DSN: dsn, DB: db}
	s.exec(t, runsDDL)

	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 3\nQUEUE_LIMIT = 2"), "pipeline")
	warmUp(t, s, "a")
	const n = 6
	enqueue(t, s, "a", n, `{"sleep_ms": 3000}`)
	waitFor(t, 30*time.Second, "every message claimed", func() bool { return poll(s, `SELECT count(*) FROM workqueue WHERE status = 'running'`) == n })
	var tokens []int64
	rows, err := db.Query(`SELECT DISTINCT claim FROM workqueue WHERE status = 'running' ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var c int64
		if err := rows.Scan(&c); err != nil {
			t.Fatal(err)
		}
		tokens = append(tokens, c)
	}
	rows.Close()
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
	if c := s.count(t, `SELECT count(*) FROM workqueue WHERE attempts <> 0`); c != 0 {
		t.Errorf("%d messages were charged an attempt for the crash", c)
	}
	var reused int
	if err := db.QueryRow(`SELECT count(*) FROM workqueue WHERE claim = ANY ($1)`, pq.Array(tokens)).Scan(&reused); err != nil {
		t.Fatal(err)
	}
	t.Logf("claim tokens before the crash %v; rows finished under one of those tokens after it (handed out again): %d", tokens, reused)
	select {
	case <-d.done:
		t.Fatalf("the dispatcher exited (status %d); it must ride the crash out", d.status)
	default:
	}
	d.stop()
}
