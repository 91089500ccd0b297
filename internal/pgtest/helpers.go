// helpers.go: the helpers that the daemon's tests and the SDK's tests share: one statement,
// one integer, the one way a test waits for a condition, a buffer a process writes while the
// test reads it, and the Python interpreter. Kept apart from pgtest.go, the cluster and its
// schemas, because they need no cluster of their own.

package pgtest

import (
	"bytes"
	"database/sql"
	"os"
	"sync"
	"testing"
	"time"
)

// Python is the interpreter the tests run the Python SDK with: $PYTHON, as the Makefile sets
// it, else Debian's, where python3-psycopg installs.
func Python() string {
	if p := os.Getenv("PYTHON"); p != "" {
		return p
	}
	return "/usr/bin/python3"
}

// Exec runs one statement on db and fails the test on error.
func Exec(t testing.TB, db *sql.DB, query string, args ...any) {
	t.Helper()
	if _, err := db.Exec(query, args...); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
}

// Int runs a query returning one integer (a count, typically) on db and fails the test on
// error.
func Int(t testing.TB, db *sql.DB, query string, args ...any) int {
	t.Helper()
	var n int
	if err := db.QueryRow(query, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}

// WaitFor polls cond until it returns true, and fails the test when timeout passes first; what
// names the condition in the failure message. It is how tests wait: never a bare sleep. The
// polls start 1 ms apart and back off to 50 ms, so a condition that holds soon is seen soon
// and a long wait does not load the database.
func WaitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
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

// SyncBuffer is a bytes.Buffer that a process's output copier writes while the test reads it.
type SyncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *SyncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *SyncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
