// Package pgtest is the PostgreSQL harness of pepsi-dispatch's tests: the test run's private
// cluster (or PEPSI_TEST_DSN), one fresh schema per test with schema.sql applied, and the
// goroutine-leak check that ends each test binary; and the helpers both packages' tests use
// (helpers.go: Exec, Int, WaitFor, Python). It is imported only by _test files.
package pgtest

import (
	"database/sql"
	"errors"
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

	_ "github.com/lib/pq" // the driver the schemas are opened with

	"pepsi-dispatch/internal/schemafile"
)

// Cluster is a test run's PostgreSQL: PEPSI_TEST_DSN when set, else a private cluster started
// on first use with scripts/pg-private and stopped by Stop.
type Cluster struct {
	root string // the repository: scripts/pg-private and schema.sql live there

	once sync.Once
	dsn  string
	dir  string // private cluster directory, "" when PEPSI_TEST_DSN is used
	err  error
}

// New returns the cluster of a test binary whose repository root is root (relative paths are
// taken from the test's working directory, the package directory).
func New(root string) *Cluster {
	abs, err := filepath.Abs(root)
	if err != nil {
		abs = root
	}
	return &Cluster{root: abs}
}

// DSN returns the cluster's DSN, starting the private cluster on first use.
func (c *Cluster) DSN(t testing.TB) string {
	t.Helper()
	c.once.Do(func() {
		if dsn := os.Getenv("PEPSI_TEST_DSN"); dsn != "" {
			c.dsn = dsn
			return
		}
		dir, err := os.MkdirTemp("", "pepsi-test-pg-")
		if err != nil {
			c.err = fmt.Errorf("make cluster directory: %w", err)
			return
		}
		os.Chmod(dir, 0o755) // as root the cluster runs as another account, which must enter it
		c.dir = dir
		out, err := exec.Command(filepath.Join(c.root, "scripts/pg-private"), "start", dir).Output()
		if err != nil {
			var ee *exec.ExitError
			if errors.As(err, &ee) { // what pg-private said, or the failure says nothing
				err = fmt.Errorf("%w: %s", err, strings.TrimSpace(string(ee.Stderr)))
			}
			c.err = fmt.Errorf("start private PostgreSQL in %s: %w", dir, err)
			return
		}
		c.dsn = strings.TrimSpace(string(out))
	})
	if c.err != nil {
		t.Fatal(c.err)
	}
	return c.dsn
}

// Dir is the private cluster's directory ("" with PEPSI_TEST_DSN, or before first use).
func (c *Cluster) Dir() string { return c.dir }

// Root is the repository root the cluster was made for.
func (c *Cluster) Root() string { return c.root }

// Stop stops a private cluster and removes it.
func (c *Cluster) Stop() {
	if c.dir == "" {
		return
	}
	if out, err := exec.Command(filepath.Join(c.root, "scripts/pg-private"), "stop", c.dir).CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "stop private PostgreSQL: %v\n%s", err, out)
	}
	os.RemoveAll(c.dir)
}

var unsafeName = regexp.MustCompile(`[^a-z0-9_]+`)

// Schema creates a fresh schema for t, named from prefix and the test's name, applies the
// repository's schema.sql in it, and drops it when t ends. It returns the schema's name, the
// cluster DSN with search_path set to it, and a pool on that DSN (closed when t ends).
func (c *Cluster) Schema(t testing.TB, prefix string) (name, dsn string, db *sql.DB) {
	t.Helper()
	base := c.DSN(t)
	name = unsafeName.ReplaceAllString(strings.ToLower(t.Name()), "_")
	if len(name) > 40 {
		name = name[:40]
	}
	name = fmt.Sprintf("%s_%s_%06d", prefix, name, rand.IntN(1000000))
	admin, err := sql.Open("postgres", base)
	if err != nil {
		t.Fatalf("open %s: %v", base, err)
	}
	defer admin.Close()
	if _, err := admin.Exec("CREATE SCHEMA " + name); err != nil {
		t.Fatalf("create schema %s: %v", name, err)
	}
	t.Cleanup(func() {
		admin, err := sql.Open("postgres", base)
		if err != nil {
			return
		}
		defer admin.Close()
		if _, err := admin.Exec("DROP SCHEMA " + name + " CASCADE"); err != nil {
			t.Logf("drop schema %s: %v", name, err)
		}
	})
	dsn = fmt.Sprintf("%s options='-c search_path=%s'", base, name)
	db, err = sql.Open("postgres", dsn)
	if err != nil {
		t.Fatalf("open %s: %v", dsn, err)
	}
	t.Cleanup(func() { db.Close() })
	ddl, err := schemafile.Read(filepath.Join(c.root, "schema.sql")) // with its \ir includes
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ddl); err != nil {
		t.Fatalf("apply schema.sql in %s: %v", name, err)
	}
	return name, dsn, db
}

// CheckGoroutineLeaks returns 1 (and prints every stack) when goroutines started by tests
// outlive them. They end asynchronously after Close, so it waits a little for them to settle.
func CheckGoroutineLeaks(before int) int {
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > before+2 { // +2: the signal handler and lib/pq's idle timers
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			n := runtime.Stack(buf, true)
			fmt.Fprintf(os.Stderr, "goroutine leak: %d before tests, %d after\n%s\n",
				before, runtime.NumGoroutine(), buf[:n])
			return 1
		}
		time.Sleep(20 * time.Millisecond) // polling the runtime: there is no event to wait on
	}
	return 0
}
