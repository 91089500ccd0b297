package main

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestConsoleLoadLeavesLoopItsConnections: console viewers whose pages wait in the database
// (here on a lock an operator's transaction holds on the config table; in life a slow search
// of a big table, or an incident's crowd of viewers) must not stop the pipeline. With one pool
// for the loop and the HTTP listener, twelve viewers held every connection and the loop,
// waiting for one to write its statistics, left a message enqueued meanwhile undone for 6 s.
// Now the HTTP listener has a pool of its own (poolShares: with DB_POOL_SIZE = 4, one
// connection, which no more than one viewer's query holds at a time), and with
// DB_POOL_SIZE = 2, where both share one connection, the loop puts its statistics write off
// rather than wait. Messages enqueued one at a time meanwhile each run within a second, the
// viewers are answered (503 while the database holds their page), the statistics are written
// once the lock goes, and the viewers that left are not logged as failed pages.
func TestConsoleLoadLeavesLoopItsConnections(t *testing.T) {
	for _, tc := range []struct {
		pool    int
		webConn int // the most viewers' queries that may wait at once; 0: no bound (shared)
	}{{4, 1}, {2, 0}} {
		t.Run(map[int]string{4: "own pool", 2: "shared pool"}[tc.pool], func(t *testing.T) {
			s := newTestSchema(t)
			s.exec(t, runsDDL)
			addr := freePort(t)
			conf := strings.Replace(baseConf(s, "METRICS_LISTEN = "+addr+"\nDB_POOL_SIZE = "+map[int]string{4: "4", 2: "2"}[tc.pool]),
				"STATS_INTERVAL = 60", "STATS_INTERVAL = 1", 1) + stageConf(t, "a", "", "")
			d := startDaemon(t, conf, "pipeline")
			d.waitLog("dispatching", dbStatementBudget)
			consoleOverview(t, addr)

			tx, err := s.DB.Begin()
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback()
			var holder int
			if err := tx.QueryRow(`SELECT pg_backend_pid()`).Scan(&holder); err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(`LOCK TABLE config IN ACCESS EXCLUSIVE MODE`); err != nil {
				t.Fatalf("hold the config table: %v", err)
			}
			ctx, stop := context.WithCancel(context.Background())
			var viewers sync.WaitGroup
			var answered, unavailable atomic.Int64
			for range 12 {
				viewers.Add(1)
				go func() {
					defer viewers.Done()
					for ctx.Err() == nil {
						req, _ := http.NewRequestWithContext(ctx, "GET", "http://"+addr+"/", nil)
						resp, err := http.DefaultClient.Do(req)
						if err != nil {
							continue // this viewer left (ctx)
						}
						resp.Body.Close()
						answered.Add(1)
						if resp.StatusCode == http.StatusServiceUnavailable {
							unavailable.Add(1)
						}
					}
				}()
			}
			// The viewers' queries that wait on the lock: no more than the HTTP pool's share.
			mostWaiting := 0
			waiting := func() int {
				n := s.count(t, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid))`, holder)
				mostWaiting = max(mostWaiting, n)
				return n
			}
			waitFor(t, 10*time.Second, "a viewer's query waiting on the held table", func() bool { return waiting() > 0 })

			var worst time.Duration
			for end := time.Now().Add(8 * time.Second); time.Now().Before(end); {
				var id int64
				if err := s.DB.QueryRow(`INSERT INTO workqueue (stage, payload) VALUES ('a', '{}') RETURNING workqueue_id`).Scan(&id); err != nil {
					t.Fatal(err)
				}
				start := time.Now()
				waitFor(t, 30*time.Second, "the message done", func() bool {
					waiting()
					return s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1 AND status = 'done'`, id) == 1
				})
				worst = max(worst, time.Since(start))
			}
			stop()
			viewers.Wait()
			tx.Rollback()
			t.Logf("worst enqueue to done: %v; viewers answered %d times (%d with 503); at most %d viewers' queries waited at once",
				worst, answered.Load(), unavailable.Load(), mostWaiting)
			if worst > time.Second {
				t.Errorf("a message took %v from enqueue to done while the console's viewers waited in the database", worst)
			}
			if unavailable.Load() == 0 {
				t.Errorf("no viewer was answered 503 while their page waited on the held table (%d answers)", answered.Load())
			}
			if tc.webConn > 0 && mostWaiting > tc.webConn {
				t.Errorf("%d viewers' queries waited in the database at once; the HTTP listener's pool has %d", mostWaiting, tc.webConn)
			}
			// The statistics put off meanwhile are written once the pool has a free connection.
			waitFor(t, 10*time.Second, "the statistics flushed with every message counted", func() bool {
				return s.count(t, `SELECT coalesce(sum(processed), 0) FROM stage_stats WHERE stage = 'a'`) == countStatus(t, s, "done")
			})
			consoleOverview(t, addr) // answered whole again (it fails the test on anything but 200)
			d.stop()
			// Shared, the loop found the one connection busy and put its write off, saying so.
			if put := strings.Contains(d.log.String(), "every connection of the pool is in use"); put != (tc.webConn == 0) {
				t.Errorf("statistics write put off for a busy pool: %v, want %v", put, tc.webConn == 0)
			}
			if strings.Contains(d.log.String(), "page failed") {
				t.Errorf("viewers that left were logged as failed pages:\n%s", d.log.String())
			}
		})
	}
}

// TestPoolShares: DB_POOL_SIZE is the lock connection, the coordinator's pool and, with an
// HTTP listener, the listener's third of the rest; the sum never passes DB_POOL_SIZE but
// where the lock leaves one connection, which both sides then share.
func TestPoolShares(t *testing.T) {
	for _, tc := range []struct {
		n          int
		listening  bool
		work, http int
	}{{2, true, 1, 0}, {3, true, 1, 1}, {4, true, 2, 1}, {8, true, 5, 2}, {8, false, 7, 0}, {1000, true, 666, 333}} {
		work, http := poolShares(tc.n, tc.listening)
		if work != tc.work || http != tc.http {
			t.Errorf("poolShares(%d, %v) = %d, %d; want %d, %d", tc.n, tc.listening, work, http, tc.work, tc.http)
		}
	}
	for n := 2; n <= 1000; n++ {
		for _, listening := range []bool{true, false} {
			if work, http := poolShares(n, listening); work < 1 || 1+work+http > n || (listening && n >= 3 && http < 1) {
				t.Errorf("poolShares(%d, %v) = %d, %d", n, listening, work, http)
			}
		}
	}
}
