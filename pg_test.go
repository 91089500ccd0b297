// pg_test.go: the test harness shared by every test of the package.
//
// The private PostgreSQL cluster of a test run and the schema per test come from
// internal/pgtest (shared with the SDK's tests); this file adds test-binary impersonation: the test binary runs as
// a worker program (PEPSI_TEST_WORKER) or as the daemon itself (PEPSI_TEST_DAEMON), so the
// tests need no other binary and the race detector covers the subprocesses too.

package main

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"pepsi-dispatch/internal/pgtest"
	"pepsi-dispatch/internal/schemafile"
)

// testWorkers maps a PEPSI_TEST_WORKER value to the worker program it runs. Test files add
// their stage programs here from init functions.
var testWorkers = map[string]func() int{}

func TestMain(m *testing.M) {
	// Impersonation comes first: a worker is started as `PROGRAM -c FILE worker`, which the
	// testing flags would reject. A worker has PEPSI_STAGE; the daemon that started it does not.
	if name := os.Getenv("PEPSI_TEST_WORKER"); name != "" && os.Getenv("PEPSI_STAGE") != "" {
		w, ok := testWorkers[name]
		if !ok {
			fmt.Fprintf(os.Stderr, "test worker %q is not registered\n", name)
			os.Exit(3)
		}
		os.Exit(w())
	}
	if os.Getenv("PEPSI_TEST_DAEMON") != "" {
		oneProc(os.Getenv) // as main does
		os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
	}
	before := runtime.NumGoroutine()
	code := m.Run()
	testPG.Stop()
	if code == 0 {
		code = pgtest.CheckGoroutineLeaks(before)
	}
	os.Exit(code)
}

// testPG is the run's PostgreSQL.
var testPG = pgtest.New(".")

// baseDSN returns the DSN of the run's PostgreSQL, starting a private cluster on first use.
func baseDSN(t testing.TB) string { return testPG.DSN(t) }

// testSchema is one test's private copy of schema.sql: its own schema in the run's database,
// so tests are independent (the single-instance lock is per schema too).
type testSchema struct {
	Name string
	DSN  string // the base DSN with search_path set to Name
	DB   *sql.DB
}

// newTestSchema creates a fresh schema for t, applies schema.sql in it and drops it after t.
func newTestSchema(t testing.TB) *testSchema {
	t.Helper()
	name, dsn, db := testPG.Schema(t, "t")
	return &testSchema{Name: name, DSN: dsn, DB: db}
}

// exec runs one statement and fails the test on error.
func (s *testSchema) exec(t testing.TB, query string, args ...any) {
	t.Helper()
	pgtest.Exec(t, s.DB, query, args...)
}

// count runs a query returning one integer.
func (s *testSchema) count(t testing.TB, query string, args ...any) int {
	t.Helper()
	return pgtest.Int(t, s.DB, query, args...)
}

// waitFor is pgtest.WaitFor, shared with the SDK's tests: the only way tests wait.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	pgtest.WaitFor(t, timeout, what, cond)
}

// writeFile writes content to name inside dir and returns the path.
func writeFile(t testing.TB, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// staleStatsTx analyzes workqueue and fanout and opens a transaction on s, so that whatever
// the transaction adds next is missing from the planner's statistics (the plan tests:
// TestFaninSplitPlansStaleStatistics, TestOperatePlansStaleStatistics). seqScans counts the
// sequential scans of those two tables that the transaction has made so far
// (pg_stat_xact_user_tables: a scan counts however small the table). Rolled back at the end.
func staleStatsTx(t testing.TB, s *testSchema) (tx *sql.Tx, seqScans func() int64) {
	t.Helper()
	s.exec(t, `ANALYZE workqueue`)
	s.exec(t, `ANALYZE fanout`)
	tx, err := s.DB.Begin()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback() })
	return tx, func() (n int64) {
		t.Helper()
		if err := tx.QueryRow(`SELECT coalesce(sum(seq_scan), 0) FROM pg_stat_xact_user_tables
		    WHERE relid IN ('workqueue'::regclass, 'fanout'::regclass)`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
}

// schemaDDL is schema.sql with its includes, as the tests apply it through a connection.
func schemaDDL(t testing.TB) string {
	t.Helper()
	ddl, err := schemafile.Read("schema.sql")
	if err != nil {
		t.Fatal(err)
	}
	return ddl
}
