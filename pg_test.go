// pg_test.go: the test harness shared by every test of the package.
//
// It owns the private PostgreSQL cluster of a test run (started on first use, stopped when the
// run ends), one fresh schema per test, and test-binary impersonation: the test binary runs as
// a worker program (PEPSI_TEST_WORKER) or as the daemon itself (PEPSI_TEST_DAEMON), so the
// tests need no other binary and the race detector covers the subprocesses too.
package main

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	_ "github.com/lib/pq"
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
		os.Exit(run(context.Background(), os.Args[1:], os.Stderr))
	}
	before := runtime.NumGoroutine()
	code := m.Run()
	testPG.stop()
	if code == 0 {
		code = checkGoroutineLeaks(before)
	}
	os.Exit(code)
}

// checkGoroutineLeaks fails the run when goroutines started by tests outlive them.
// Goroutines finish asynchronously after Close, so it waits a little for them to settle.
func checkGoroutineLeaks(before int) int {
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > before+2 { // +2: the signal handler and lib/pq's idle timers
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			n := runtime.Stack(buf, true)
			fmt.Fprintf(os.Stderr, "goroutine leak: %d before tests, %d after\n%s\n",
				before, runtime.NumGoroutine(), buf[:n])
			return 1
		}
		time.Sleep(20 * time.Millisecond)
	}
	return 0
}

// testPG is the run's PostgreSQL: PEPSI_TEST_DSN when set, else a private cluster.
var testPG privatePG

type privatePG struct {
	once sync.Once
	dsn  string
	dir  string // private cluster directory, "" when PEPSI_TEST_DSN is used
	err  error
}

func (p *privatePG) stop() {
	if p.dir == "" {
		return
	}
	out, err := exec.Command("scripts/pg-private", "stop", p.dir).CombinedOutput()
	if err != nil {
		fmt.Fprintf(os.Stderr, "stop private PostgreSQL: %v\n%s", err, out)
	}
	os.RemoveAll(p.dir)
}

// baseDSN returns the DSN of the run's PostgreSQL, starting a private cluster on first use.
func baseDSN(t testing.TB) string {
	t.Helper()
	testPG.once.Do(func() {
		if dsn := os.Getenv("PEPSI_TEST_DSN"); dsn != "" {
			testPG.dsn = dsn
			return
		}
		dir, err := os.MkdirTemp("", "pepsi-test-pg-")
		if err != nil {
			testPG.err = fmt.Errorf("make cluster directory: %w", err)
			return
		}
		os.Chmod(dir, 0o755) // the cluster runs as another account when we are root
		testPG.dir = dir
		out, err := exec.Command("scripts/pg-private", "start", dir).Output()
		if err != nil {
			testPG.err = fmt.Errorf("start private PostgreSQL in %s: %w", dir, err)
			return
		}
		testPG.dsn = strings.TrimSpace(string(out))
	})
	if testPG.err != nil {
		t.Fatal(testPG.err)
	}
	return testPG.dsn
}

var schemaNameUnsafe = regexp.MustCompile(`[^a-z0-9_]+`)

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
	base := baseDSN(t)
	name := strings.ToLower(t.Name())
	name = schemaNameUnsafe.ReplaceAllString(name, "_")
	if len(name) > 40 {
		name = name[:40]
	}
	name = fmt.Sprintf("t_%s_%06d", name, rand.IntN(1000000))
	admin, err := sql.Open("postgres", base)
	if err != nil {
		t.Fatalf("open %s: %v", base, err)
	}
	defer admin.Close()
	if _, err := admin.Exec("CREATE SCHEMA " + name); err != nil {
		t.Fatalf("create schema %s: %v", name, err)
	}
	dsn := fmt.Sprintf("%s options='-c search_path=%s'", base, name)
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatalf("open %s: %v", dsn, err)
	}
	ddl, err := os.ReadFile("schema.sql")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(string(ddl)); err != nil {
		t.Fatalf("apply schema.sql in %s: %v", name, err)
	}
	t.Cleanup(func() {
		db.Close()
		admin, err := sql.Open("postgres", base)
		if err != nil {
			return
		}
		defer admin.Close()
		if _, err := admin.Exec("DROP SCHEMA " + name + " CASCADE"); err != nil {
			t.Logf("drop schema %s: %v", name, err)
		}
	})
	return &testSchema{Name: name, DSN: dsn, DB: db}
}

// exec runs one statement and fails the test on error.
func (s *testSchema) exec(t testing.TB, query string, args ...any) {
	t.Helper()
	if _, err := s.DB.Exec(query, args...); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
}

// count runs a query returning one integer.
func (s *testSchema) count(t testing.TB, query string, args ...any) int {
	t.Helper()
	var n int
	if err := s.DB.QueryRow(query, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}

// waitFor polls cond until it returns true or the timeout passes; what names the condition in
// the failure message. It is the only way tests wait: never a bare sleep.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	delay := time.Millisecond
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(delay)
		if delay < 50*time.Millisecond {
			delay *= 2
		}
	}
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
