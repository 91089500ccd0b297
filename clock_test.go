// clock_test.go: the database server's clock and the dispatcher's, which need not agree.

package main

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"
)

// skewedServer starts a private cluster whose clock is ahead of this machine's by offset
// (libfaketime preloaded into the server: Debian's package libfaketime), as a database on
// another host, or a VM that drifted, can be; the dispatcher and the test keep the machine's.
func skewedServer(t *testing.T, offset time.Duration) *testSchema {
	t.Helper()
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster of its own")
	}
	libs, _ := filepath.Glob("/usr/lib/*/faketime/libfaketime.so.1")
	lib := referenceTool(t, "", "libfaketime.so.1", "the tests of a database clock that is not the dispatcher's",
		"apt-get install libfaketime", libs...)
	p := newPGNodes(t, 1, "pepsi-test-clock-", "LD_PRELOAD="+lib, fmt.Sprintf("FAKETIME=%+d", int(offset.Seconds())))
	s := p.schema(t)
	var ahead float64
	if err := s.DB.QueryRow(`SELECT extract(epoch FROM now()) - $1::float8`, float64(time.Now().UnixNano())/1e9).Scan(&ahead); err != nil {
		t.Fatal(err)
	}
	if d := ahead - offset.Seconds(); d < -5 || d > 5 {
		t.Fatalf("the server's clock is %.1f s ahead of ours, want %v: libfaketime not in effect", ahead, offset)
	}
	return s
}

// TestRetryDueOnDatabaseClock: with the database's clock a minute ahead of the dispatcher's,
// a message enqueued for 2 s later (run_at) and one whose first attempt fails with
// RETRY_DELAY = 1 s both run within seconds, and not before their time on the database's
// clock. Each is a paused row due at a retry_at the database wrote, and the dispatcher read
// retry_at as a time on its own clock: they ran a minute late.
func TestRetryDueOnDatabaseClock(t *testing.T) {
	s := skewedServer(t, time.Minute)
	s.exec(t, runsDDL)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 1\nRETRY_DELAY = 1"), "pipeline")
	d.waitLog("msg=dispatching", 30*time.Second)
	later := int64(s.count(t, `INSERT INTO workqueue (stage, payload, run_at)
	    VALUES ('a', '{}', now() + interval '2 seconds') RETURNING workqueue_id`))
	failing := insertOne(t, s, "a", `{"fail_at": "a", "fail_n": 1}`)
	waitFor(t, 30*time.Second, "both messages done", func() bool {
		return poll(s, fmt.Sprintf(`SELECT count(*) FROM workqueue WHERE status = 'done' AND workqueue_id IN (%d, %d)`,
			later, failing)) == 2
	})
	if r := row(t, s, failing); r.attempts != 1 {
		t.Errorf("the failing message: %d attempts, want 1", r.attempts)
	}
	// Not early either: it ran no sooner than its run_at, both times on the database's clock.
	early := s.count(t, fmt.Sprintf(`SELECT count(*) FROM runs r JOIN workqueue w ON w.workqueue_id = r.id
	    WHERE r.id = %d AND r.at < w.run_at`, later))
	if early != 0 {
		t.Errorf("the message enqueued for later ran before its run_at")
	}
	d.stop()
}

// TestDueAtBounds: seconds from the database's now() become a time on ours, as late as they
// say; times centuries away either way (a stage's Defer of Go's zero time is due in year 1,
// 63 billion seconds ago) are held at a century rather than converted out of a
// time.Duration's range.
func TestDueAtBounds(t *testing.T) {
	century := 100 * 365 * 24 * time.Hour
	for _, c := range []struct {
		seconds float64
		want    time.Duration
	}{{0, 0}, {1.5, 1500 * time.Millisecond}, {-2, -2 * time.Second}, {-6.3e10, -century}, {1e12, century}} {
		before := time.Now()
		got := dueAt(c.seconds)
		if d := got.Sub(before); d < c.want || d > c.want+time.Second {
			t.Errorf("dueAt(%g) is %v from now, want %v", c.seconds, d, c.want)
		}
	}
}
