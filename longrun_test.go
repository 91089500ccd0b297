// longrun_test.go: what months of running leave in the daemon.
//
// A dispatcher on an appliance runs for months. Every path a message, a worker, a lock client
// or a viewer can take must give back what it took: the worker's process and pipes, its
// goroutines, its entries in the coordinator's maps and timer heap, the lock service's keys
// and connections. A leak of a few hundred bytes per message or a goroutine per crashed
// worker does not fail any test of a minute; it ends the daemon after a few months.

package main

import (
	"bufio"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/lib/pq"
)

// TestLongRunLeavesNoTrace runs rounds of every path a message can take (done, failed after
// its attempts, crashed twice, killed by MAX_RUNTIME twice, deferred, failed once and then
// done, held and released, cancelled pending and running, failed and retried by an
// operator), with lock-service clients that release or just hang up, console viewers,
// /metrics scrapes and a reload per round, the graph changing on every other one. After
// each round, once the daemon is idle (every worker gone by WORKER_IDLE_TIMEOUT), it must
// hold what it held after the first: no child process, no pipe, no more goroutines, no more
// descriptors, no lock-service key or connection, and a live heap (as the garbage collector
// marks it) no bigger than noise.
func TestLongRunLeavesNoTrace(t *testing.T) {
	if testing.Short() {
		t.Skip("rounds of every path a message can take, thousands of messages: not with -short")
	}
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	addr, lockAddr := freePort(t), freePort(t)
	stageOpts := "PARALLELISM = 3\nQUEUE_LIMIT = 4\nMAX_MESSAGES = 40\nMAX_ATTEMPTS = 2\nRETRY_DELAY = 0"
	conf := strings.Replace(baseConf(s, "METRICS_LISTEN = "+addr+"\nMAX_RUNTIME = 3"),
		"WORKER_IDLE_TIMEOUT = 2", "WORKER_IDLE_TIMEOUT = 0.3", 1) +
		"[poolcounter]\nLISTEN = " + lockAddr + "\n\n" +
		stageConf(t, "a", "b", stageOpts) + stageConf(t, "b", "", stageOpts)
	d := startDaemon(t, conf, "pipeline")
	d.waitLog("dispatching", dbStatementBudget)
	pid := d.cmd.Process.Pid
	// What it had before its first worker: its listeners, its sessions, and what its parent
	// left open (a test runner's descriptors): not what the rounds give back.
	before := fdTargets(t, pid)
	web := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}

	const rounds, plain = 4, 1000
	var base processHold
	for r := range rounds {
		first := int64(s.count(t, `SELECT coalesce(max(workqueue_id), 0) FROM workqueue`))
		longRunRound(t, s, d, web, addr, lockAddr, r, plain)
		waitFor(t, 120*time.Second, "every message of the round ended", func() bool {
			return s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id > $1
			        AND status NOT IN ('done', 'failed', 'cancelled')`, first) == 0
		})
		waitFor(t, 30*time.Second, "the daemon idle: no worker, no child process, no lock client", func() bool {
			w, _ := metric(t, addr, "pepsi_workers")
			k, _ := metric(t, addr, "pepsi_poolcounter_keys")
			c, _ := metric(t, addr, "pepsi_poolcounter_connections")
			return w == 0 && k == 0 && c == 0 && len(workerPids(t, d)) == 0
		})
		h := measureHold(t, web, addr, pid, before)
		t.Logf("after round %d: %s", r+1, h)
		if h.pipes != 0 {
			t.Errorf("round %d: the idle daemon holds %d pipes (%v)", r+1, h.pipes, h.fds)
		}
		if r == 0 {
			base = h
			continue
		}
		if h.goroutines > base.goroutines+2 {
			t.Errorf("round %d: %d goroutines, %d after the first round", r+1, h.goroutines, base.goroutines)
		}
		if h.other > base.other {
			t.Errorf("round %d: %d descriptors other than sockets and pipes, %d after the first round: %v",
				r+1, h.other, base.other, h.fds)
		}
		// The sockets: the two listeners, the LISTEN session and at most DB_POOL_SIZE (8)
		// sessions of the pools, which close when idle.
		if h.sockets > 11 {
			t.Errorf("round %d: %d sockets (listeners 2, LISTEN 1, pool at most 8): %v", r+1, h.sockets, h.fds)
		}
		if grown := h.heapLive - base.heapLive; grown > 512<<10 {
			t.Errorf("round %d: the live heap grew by %d KiB since the first round (%d messages since)",
				r+1, grown>>10, r*plain)
		}
	}
	d.stop()
	if bad := s.count(t, `SELECT count(*) FROM (SELECT id, stage FROM runs GROUP BY 1, 2 HAVING count(*) > 1) x
	        WHERE NOT EXISTS (SELECT FROM workqueue WHERE workqueue_id = x.id AND payload ? 'defer_at')`); bad != 0 {
		t.Errorf("%d (message, stage) pairs ran twice", bad)
	}
	// A deferred message records its run at a before it defers, and again when it comes back.
	if bad := s.count(t, `SELECT count(*) FROM workqueue w WHERE status = 'done'
	        AND (SELECT count(*) FROM runs r WHERE r.id = w.workqueue_id) <> CASE WHEN payload ? 'defer_at' THEN 3 ELSE 2 END`); bad != 0 {
		t.Errorf("%d done messages did not run each stage exactly once", bad)
	}
	// Only the messages asked to fail or hang may fail: a crash or a timeout is charged to
	// the message that caused it, not to another of its worker's batch (suspects.go).
	if bad := s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'failed'
	        AND NOT (payload ? 'fail_at' AND payload->>'fail_n' IS NULL) AND NOT payload ? 'hang_at' AND NOT payload ? 'crash_warm'`); bad != 0 {
		t.Errorf("%d messages failed that were not asked to fail, hang or crash", bad)
	}
	if n := countStatus(t, s, "done"); n < rounds*plain {
		t.Errorf("%d messages done, want at least %d", n, rounds*plain)
	}
}

// longRunRound enqueues one round's messages and drives the operator's actions, the lock
// clients, the viewers and the reload of round r beside them; it returns once its own
// actions are done (the messages may still be running).
func longRunRound(t *testing.T, s *testSchema, d *daemon, web *http.Client, addr, lockAddr string, r, plain int) {
	t.Helper()
	lo := int64(s.count(t, `SELECT coalesce(max(workqueue_id), 0) FROM workqueue`))
	enqueue(t, s, "a", plain, `{}`)
	enqueue(t, s, "a", 20, `{"sleep_ms": 50}`)   // held and released, or cancelled, while pending
	enqueue(t, s, "a", 20, `{"fail_at": "b"}`)   // failed at b after two attempts, retried, failed again
	enqueue(t, s, "a", 8, `{"crash_warm": "a"}`) // its worker dies (unless it is a fresh one), twice
	enqueue(t, s, "a", 2, `{"hang_at": "b"}`)    // killed by MAX_RUNTIME, twice; one cancelled while it runs
	enqueue(t, s, "a", 20, `{"defer_at": "a", "defer_ms": 200}`)
	enqueue(t, s, "a", 20, `{"fail_at": "a", "fail_n": 1}`) // fails once, then done
	sel := func(where string) []int64 {
		t.Helper()
		return ids(t, s, `SELECT workqueue_id FROM workqueue WHERE workqueue_id > $1 AND `+where+` ORDER BY 1`, lo)
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // viewers and a scraper
		defer wg.Done()
		for _, path := range []string{"/", "/stages", "/failures", "/search?status=failed", fmt.Sprintf("/message/%d", lo+1), "/metrics"} {
			resp, err := web.Get("http://" + addr + path)
			if err != nil {
				t.Errorf("GET %s: %v", path, err)
				continue
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	go func() { defer wg.Done(); lockClients(t, lockAddr, 16) }()

	slow := sel(`payload->>'sleep_ms' = '50'`)
	var back []int64
	for id := range act(t, s.DB, "hold", slow[:10]...) {
		back = append(back, id)
	}
	act(t, s.DB, "release", back...)
	act(t, s.DB, "cancel", slow[10:]...)
	// The reload: a signal, and on every other round a change to the graph's settings
	// through the config table (which reloads it too).
	if err := d.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	if r%2 == 1 {
		s.exec(t, `INSERT INTO config (section, key, value) VALUES ('stage-b', 'PARALLELISM', '2')`)
	} else if r > 0 {
		s.exec(t, `DELETE FROM config WHERE section = 'stage-b'`)
	}
	// A message that hangs at b, cancelled while its worker runs it (or while it waits).
	hang := sel(`payload ? 'hang_at'`)
	waitFor(t, 60*time.Second, "a hanging message at b", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1 AND stage = 'b'`, hang[0]) == 1
	})
	act(t, s.DB, "cancel", hang[0])
	// The failing ones, retried by the operator once they failed: they fail again.
	fail := sel(`payload->>'fail_at' = 'b'`)
	waitFor(t, 60*time.Second, "the round's failing messages failed", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = ANY ($1) AND status = 'failed'`, pq.Array(fail)) == len(fail)
	})
	act(t, s.DB, "retry", fail...)
	wg.Wait()
}

// lockClients has n PoolCounter clients take one of four keys (one worker each, so most
// wait): the even ones release what they got and hang up, the odd ones hang up holding or
// waiting.
func lockClients(t *testing.T, addr string, n int) {
	t.Helper()
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := net.DialTimeout("tcp", addr, 5*time.Second)
			if err != nil {
				t.Errorf("lock client %d: %v", i, err)
				return
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(10 * time.Second))
			rd := bufio.NewReader(c)
			fmt.Fprintf(c, "ACQ4ME longrun-%d 1 32 1\n", i%4)
			if i%2 == 1 {
				time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond) // hangs up at a random point of its wait or hold
				return
			}
			reply, err := rd.ReadString('\n')
			if err != nil {
				t.Errorf("lock client %d: %v", i, err)
				return
			}
			if reply == "LOCKED\n" {
				fmt.Fprintf(c, "RELEASE\n")
				rd.ReadString('\n')
			}
		}()
	}
	wg.Wait()
}

// processHold is what an idle daemon holds.
type processHold struct {
	goroutines, heapLive  int64
	pipes, sockets, other int
	fds                   []string // what its descriptors from 3 on point at
}

func (h processHold) String() string {
	return fmt.Sprintf("%d goroutines, live heap %d KiB, descriptors: %d pipes, %d sockets, %d others",
		h.goroutines, h.heapLive>>10, h.pipes, h.sockets, h.other)
}

// measureHold reads what the idle daemon pid holds: its descriptors from /proc, and from
// its /metrics its goroutines and its live heap as marked by a garbage collection that began
// after this call (the viewers' pages, loaded until two collections have ended, allocate
// what starts one).
func measureHold(t *testing.T, web *http.Client, addr string, pid int, before map[string]string) processHold {
	t.Helper()
	var h processHold
	cycles, ok := metric(t, addr, "go_gc_cycles_total")
	if !ok {
		t.Fatal("/metrics has no go_gc_cycles_total")
	}
	waitFor(t, 60*time.Second, "two garbage collections in the daemon", func() bool {
		for range 20 {
			if resp, err := web.Get("http://" + addr + "/"); err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}
		c, _ := metric(t, addr, "go_gc_cycles_total")
		return c >= cycles+2
	})
	g, ok1 := metric(t, addr, "go_goroutines")
	live, ok2 := metric(t, addr, "go_gc_heap_live_bytes")
	if !ok1 || !ok2 {
		t.Fatal("/metrics has no go_goroutines or go_gc_heap_live_bytes")
	}
	h.goroutines, h.heapLive = int64(g), int64(live)
	for fd, to := range fdTargets(t, pid) {
		if n, _ := strconv.Atoi(fd); n < 3 || before[fd] == to && !strings.HasPrefix(to, "socket:") {
			continue // its standard streams, or a descriptor it was started with
		}
		h.fds = append(h.fds, fd+" "+to)
		switch {
		case strings.HasPrefix(to, "pipe:"):
			h.pipes++
		case strings.HasPrefix(to, "socket:"):
			h.sockets++
		default:
			h.other++
		}
	}
	return h
}

// fdTargets returns what each descriptor of process pid points at, by number.
func fdTargets(t *testing.T, pid int) map[string]string {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatalf("read the daemon's descriptors: %v", err)
	}
	out := map[string]string{}
	for _, e := range ents {
		if to, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil { // else closed meanwhile
			out[e.Name()] = to
		}
	}
	return out
}
