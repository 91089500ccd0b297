// fusion_test.go: stage fusion end to end: the real daemon, and a worker program (the test
// binary) that implements stages a and b with stage.ServeStages, b marked FUSE = yes. A
// message claimed at a runs through b in the same pass: one claim, both stages' counters.

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"pepsi-dispatch/stage"
)

// fusionWorker serves stages a and b. Both record their run in the runs table, in the message's
// transaction; a advances to b, b finishes. A payload {"refuse_fused": true} makes b fail when
// it runs fused (in a process started for stage a), so the message falls back to b's pool.
func fusionWorker() int {
	cfg, err := stage.LoadConfig(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	record := func(ctx context.Context, m *stage.Message) error {
		_, err := m.Tx.ExecContext(ctx, `INSERT INTO runs (id, stage, pid) VALUES ($1, $2, $3)`, m.ID, m.Stage, os.Getpid())
		return err
	}
	handlers := map[string]stage.Handler{
		"a": func(ctx context.Context, m *stage.Message) error {
			if err := record(ctx, m); err != nil {
				return err
			}
			m.State["a"] = true
			return m.Advance("b")
		},
		"b": func(ctx context.Context, m *stage.Message) error {
			var p struct {
				RefuseFused bool `json:"refuse_fused"`
			}
			if err := json.Unmarshal(m.Payload, &p); err != nil {
				return err
			}
			if p.RefuseFused && cfg.Stage != m.Stage {
				return fmt.Errorf("refusing to run fused into %s", cfg.Stage)
			}
			if err := record(ctx, m); err != nil {
				return err
			}
			m.State["b"] = true
			return m.Done()
		},
	}
	if err := stage.ServeStages(context.Background(), cfg, os.Stdin, os.Stdout, handlers); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

func init() { testWorkers["fusion"] = fusionWorker }

// fusionConf is a (NEXT = b) → b (FUSE = yes), both run by the fusion worker.
func fusionConf(t *testing.T, s *testSchema) string {
	return baseConf(s, "") +
		stageConf(t, "a", "b", "PARALLELISM = 2\nQUEUE_LIMIT = 8") +
		stageConf(t, "b", "", "FUSE = yes")
}

// TestStageFusion: N messages enqueued at a end done at b after one claim each, b run by a's
// workers in the same pass; a's counters count the passes, b's the fused runs, and b's pool
// never starts.
func TestStageFusion(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	const n = 200
	d := startDaemon(t, fusionConf(t, s), "fusion")
	enqueue(t, s, "a", n, `{}`)
	waitFor(t, 30*time.Second, fmt.Sprintf("%d done", n), func() bool { return countStatus(t, s, "done") == n })
	if got := s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'done' AND stage = 'b' AND state @> '{"a": true, "b": true}'`); got != n {
		t.Errorf("%d rows done at b with both stages' state, want %d", got, n)
	}
	// Both stages ran once per message, in the same process: b in a's worker.
	if got := s.count(t, `SELECT count(*) FROM runs ra JOIN runs rb ON ra.id = rb.id AND rb.stage = 'b'
		WHERE ra.stage = 'a' AND ra.pid = rb.pid`); got != n {
		t.Errorf("%d messages ran a and b in the same process, want %d", got, n)
	}
	if got := s.count(t, `SELECT count(*) FROM runs`); got != 2*n {
		t.Errorf("%d runs, want %d (each stage once per message)", got, 2*n)
	}
	// Statistics flush within about a second of going idle.
	stat := func(q string) int { return s.count(t, q) }
	waitFor(t, 10*time.Second, "statistics flushed", func() bool {
		return stat(`SELECT coalesce(sum(fused), 0) FROM stage_stats WHERE stage = 'b'`) == n &&
			stat(`SELECT done FROM dispatch_stats`) == n
	})
	if got := stat(`SELECT stage_runs FROM dispatch_stats`); got != n {
		t.Errorf("dispatch_stats.stage_runs = %d, want %d (one claim per message, not %d)", got, n, 2*n)
	}
	if got := stat(`SELECT processed FROM stage_stats WHERE stage = 'a'`); got != n {
		t.Errorf("stage_stats a.processed = %d, want %d", got, n)
	}
	if got := stat(`SELECT processed + failed FROM stage_stats WHERE stage = 'b'`); got != 0 {
		t.Errorf("stage_stats b.processed + failed = %d, want 0 (b never ran on its own)", got)
	}
	if got := stat(`SELECT workers_started FROM stage_stats WHERE stage = 'b'`); got != 0 {
		t.Errorf("stage_stats b.workers_started = %d, want 0 (b's pool never started)", got)
	}
	if got := stat(`SELECT (busy_ms >= 0 AND max_ms <= busy_ms)::int FROM stage_stats WHERE stage = 'b'`); got != 1 {
		t.Error("stage_stats b timing columns inconsistent")
	}
	d.stop()
}

// TestStageFusionFallback: a fused stage that fails leaves the message advanced to it, and b's
// own pool then runs it; the fused runs and the plain ones add up.
func TestStageFusionFallback(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	const n, refused = 60, 20
	d := startDaemon(t, fusionConf(t, s), "fusion")
	enqueue(t, s, "a", n-refused, `{}`)
	enqueue(t, s, "a", refused, `{"refuse_fused": true}`)
	waitFor(t, 30*time.Second, fmt.Sprintf("%d done", n), func() bool { return countStatus(t, s, "done") == n })
	if got := s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'done' AND stage = 'b' AND attempts = 0`); got != n {
		t.Errorf("%d rows done at b with no failed attempt, want %d", got, n)
	}
	if got := s.count(t, `SELECT count(*) FROM runs WHERE stage = 'b'`); got != n {
		t.Errorf("%d committed runs of b, want %d (a failed fused run leaves nothing)", got, n)
	}
	stat := func(q string) int { return s.count(t, q) }
	waitFor(t, 10*time.Second, "statistics flushed", func() bool {
		return stat(`SELECT done FROM dispatch_stats`) == n &&
			stat(`SELECT coalesce(sum(processed), 0) FROM stage_stats WHERE stage = 'b'`) == refused
	})
	if got := stat(`SELECT fused FROM stage_stats WHERE stage = 'b'`); got != n-refused {
		t.Errorf("stage_stats b.fused = %d, want %d", got, n-refused)
	}
	if got := stat(`SELECT stage_runs FROM dispatch_stats`); got != n+refused {
		t.Errorf("dispatch_stats.stage_runs = %d, want %d (a second claim only for the refused ones)", got, n+refused)
	}
	if got := stat(`SELECT processed FROM stage_stats WHERE stage = 'a'`); got != n {
		t.Errorf("stage_stats a.processed = %d, want %d (a succeeded every time)", got, n)
	}
	if got := stat(`SELECT coalesce(sum(failed), 0) FROM stage_stats`); got != 0 {
		t.Errorf("%d failures counted, want 0 (a fused stage's failure is not one)", got)
	}
	if got := stat(`SELECT workers_started FROM stage_stats WHERE stage = 'b'`); got < 1 {
		t.Errorf("stage_stats b.workers_started = %d, want b's pool started", got)
	}
	d.stop()
}

// TestFusedReportsOnlyOfFusedStages: a stage program that writes a fused report naming a
// stage of its own per message (a tenant, here) made a stage_stats row, a set of /metrics
// series and a console section per name, for the daemon's life, and a warning per malformed
// one. Only the stages of the worker's PEPSI_FUSE count now; the others are logged once per
// worker. A fused report of a stage it may run still counts.
func TestFusedReportsOnlyOfFusedStages(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	addr := freePort(t)
	conf := baseConf(s, "METRICS_LISTEN = "+addr) + stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 8")
	d := startDaemon(t, conf, "raw")
	const n = 200
	s.exec(t, `INSERT INTO workqueue (stage, payload)
	        SELECT 'a', jsonb_build_object('reply', '0 fused=tenant-' || g || ':1') FROM generate_series(1, $1) g`, n)
	s.exec(t, `INSERT INTO workqueue (stage, payload) VALUES ('a', '{"reply": "0 fused=bad"}')`)
	waitFor(t, 60*time.Second, "every message done", func() bool { return countStatus(t, s, "done") == n+1 })
	var body string
	waitFor(t, 10*time.Second, "/metrics with every message processed", func() bool {
		body = scrape(addr)
		return strings.Contains(body, fmt.Sprintf("pepsi_stage_processed_total{stage=\"a\"} %d\n", n+1))
	})
	d.stop()
	if rows := s.count(t, `SELECT count(*) FROM stage_stats WHERE stage LIKE 'tenant-%'`); rows != 0 {
		t.Errorf("%d stage_stats rows of stages the worker may not run", rows)
	}
	if strings.Contains(body, "tenant-") {
		t.Error("/metrics has series of stages the worker may not run")
	}
	if lines := strings.Count(d.log.String(), "ignoring a fused report"); lines != 1 {
		t.Errorf("%d lines for the ignored fused reports of the stage's one worker, want one", lines)
	}
}
