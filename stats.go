// stats.go: the dispatcher's counters, in memory, and their flush to stage_stats and
// dispatch_stats.
//
// The coordinator goroutine owns Stats and is the only writer of both tables (the workers of a
// stage never contend for its row). Totals only grow; a flush writes total − flushed as deltas
// in one transaction, and only when something changed. /metrics reads a published copy.

package main

import (
	"context"
	"database/sql"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/lib/pq"
)

// stageCounters are one stage's totals since start. Each counter is listed once here.
type stageCounters struct {
	Processed      int64 // status lines with status 0
	Failed         int64 // non-zero status or protocol error
	Crashed        int64 // worker died with a message of this stage at its head
	Timeouts       int64 // head killed by the MAX_RUNTIME watchdog
	Fused          int64 // passes of this stage run inside another stage's worker
	BusyMs         int64 // processing time, summed
	MaxMs          int64 // longest single message (not a sum: flushed with GREATEST)
	WorkersStarted int64 // worker processes started
}

// sub returns the counters accumulated since old (MaxMs is carried as is).
func (c stageCounters) sub(old stageCounters) stageCounters {
	return stageCounters{
		Processed:      c.Processed - old.Processed,
		Failed:         c.Failed - old.Failed,
		Crashed:        c.Crashed - old.Crashed,
		Timeouts:       c.Timeouts - old.Timeouts,
		Fused:          c.Fused - old.Fused,
		BusyMs:         c.BusyMs - old.BusyMs,
		MaxMs:          c.MaxMs,
		WorkersStarted: c.WorkersStarted - old.WorkersStarted,
	}
}

func (c stageCounters) isZero() bool {
	return c.Processed == 0 && c.Failed == 0 && c.Crashed == 0 && c.Timeouts == 0 &&
		c.Fused == 0 && c.BusyMs == 0 && c.WorkersStarted == 0
}

// globalCounters are the dispatcher-wide totals since start.
type globalCounters struct {
	StageRuns int64 // messages handed to workers
	Claims    int64 // claim statements that returned rows
	Done      int64 // messages whose status line reported that they reached done
	Failed    int64 // messages the dispatcher marked failed (MAX_ATTEMPTS reached)
	Retried   int64 // paused rows returned to pending
}

func (g globalCounters) sub(old globalCounters) globalCounters {
	return globalCounters{
		StageRuns: g.StageRuns - old.StageRuns,
		Claims:    g.Claims - old.Claims,
		Done:      g.Done - old.Done,
		Failed:    g.Failed - old.Failed,
		Retried:   g.Retried - old.Retried,
	}
}

// Stats holds the totals and what was flushed of them.
type Stats struct {
	Stages  map[string]*stageCounters
	Global  globalCounters
	Fanin   faninCounters
	flushed struct {
		stages map[string]stageCounters
		global globalCounters
		fanin  faninCounters
	}
}

func newStats() *Stats {
	s := &Stats{Stages: map[string]*stageCounters{}}
	s.flushed.stages = map[string]stageCounters{}
	return s
}

// stage returns the counters of a stage, creating them on first use.
func (s *Stats) stage(name string) *stageCounters {
	c, ok := s.Stages[name]
	if !ok {
		c = &stageCounters{}
		s.Stages[name] = c
	}
	return c
}

// observe adds one processing time to a stage.
func (c *stageCounters) observe(ms int64) {
	c.BusyMs += ms
	if ms > c.MaxMs {
		c.MaxMs = ms
	}
}

// dirty reports whether anything changed since the last flush.
func (s *Stats) dirty() bool {
	if s.Global != s.flushed.global || s.Fanin != s.flushed.fanin {
		return true
	}
	for name, c := range s.Stages {
		if !c.sub(s.flushed.stages[name]).isZero() || c.MaxMs > s.flushed.stages[name].MaxMs {
			return true
		}
	}
	return false
}

const flushStageSQL = `
INSERT INTO stage_stats AS t (stage, processed, failed, crashed, timeouts, fused, busy_ms, max_ms, workers_started)
SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::bigint[], $5::bigint[], $6::bigint[], $7::bigint[], $8::bigint[], $9::bigint[])
ON CONFLICT (stage) DO UPDATE SET
    processed = t.processed + EXCLUDED.processed,
    failed = t.failed + EXCLUDED.failed,
    crashed = t.crashed + EXCLUDED.crashed,
    timeouts = t.timeouts + EXCLUDED.timeouts,
    fused = t.fused + EXCLUDED.fused,
    busy_ms = t.busy_ms + EXCLUDED.busy_ms,
    max_ms = greatest(t.max_ms, EXCLUDED.max_ms),
    workers_started = t.workers_started + EXCLUDED.workers_started,
    updated_at = now()`

const flushGlobalSQL = `
UPDATE dispatch_stats SET stage_runs = stage_runs + $1, claims = claims + $2, done = done + $3,
       failed = failed + $4, retried = retried + $5,
       fanin_events = fanin_events + $6, fanin_flushes = fanin_flushes + $7,
       fanin_flush_ms = fanin_flush_ms + $8, fanin_wakes = fanin_wakes + $9,
       fanin_late_events = fanin_late_events + $10, fanin_sweep_repaired = fanin_sweep_repaired + $11,
       fanin_quarantined = fanin_quarantined + $12, updated_at = now()
 WHERE id = 1`

// flush writes the deltas since the last flush in one transaction. Nothing is written when
// nothing changed; on error nothing is marked flushed, so the next flush carries it.
func (s *Stats) flush(ctx context.Context, db *sql.DB) (bool, error) {
	if !s.dirty() {
		return false, nil
	}
	names := slices.Sorted(maps.Keys(s.Stages)) // fixed order: no deadlock with a concurrent flush
	var cols [8][]int64
	var stages []string
	for _, name := range names {
		d := s.Stages[name].sub(s.flushed.stages[name])
		if d.isZero() && d.MaxMs <= s.flushed.stages[name].MaxMs {
			continue
		}
		stages = append(stages, name)
		for i, v := range []int64{d.Processed, d.Failed, d.Crashed, d.Timeouts, d.Fused, d.BusyMs, d.MaxMs, d.WorkersStarted} {
			cols[i] = append(cols[i], v)
		}
	}
	g := s.Global.sub(s.flushed.global)
	f := s.Fanin.sub(s.flushed.fanin)
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return false, fmt.Errorf("flush statistics: %w", err)
	}
	defer tx.Rollback() // after Commit this is a no-op
	if len(stages) > 0 {
		args := []any{pq.Array(stages)}
		for i := range cols {
			args = append(args, pq.Array(cols[i]))
		}
		if _, err := tx.ExecContext(ctx, flushStageSQL, args...); err != nil {
			return false, fmt.Errorf("flush statistics: stage_stats: %w", err)
		}
	}
	if g != (globalCounters{}) || f != (faninCounters{}) {
		if _, err := tx.ExecContext(ctx, flushGlobalSQL, g.StageRuns, g.Claims, g.Done, g.Failed, g.Retried,
			f.Events, f.Flushes, f.FlushMs, f.Wakes, f.LateEvents, f.SweepRepaired, f.Quarantined); err != nil {
			return false, fmt.Errorf("flush statistics: dispatch_stats: %w", err)
		}
	}
	if err := tx.Commit(); err != nil {
		return false, fmt.Errorf("flush statistics: commit: %w", err)
	}
	for name, c := range s.Stages {
		s.flushed.stages[name] = *c
	}
	s.flushed.global = s.Global
	s.flushed.fanin = s.Fanin
	return true, nil
}

// flushStats writes the statistics deltas; a failure keeps them for the next flush.
func (c *coordinator) flushStats() {
	ctx, cancel := context.WithTimeout(c.ctx, dbStatementBudget)
	defer cancel()
	if !c.stats.dirty() {
		return
	}
	c.lastStatsFlush = time.Now()
	if _, err := c.stats.flush(ctx, c.db); err != nil {
		c.log.Warn("statistics not flushed; kept for the next flush", "err", err)
	}
}
