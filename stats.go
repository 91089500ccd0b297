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
	"strings"
	"time"

	"github.com/lib/pq"
)

// stageCounters are one stage's totals since start (stage_stats, one row per stage).
type stageCounters struct {
	Processed      int64
	Failed         int64
	Crashed        int64
	Timeouts       int64
	Fused          int64
	BusyMs         int64
	MaxMs          int64 // not a sum: flushed with GREATEST, carried whole in a delta
	WorkersStarted int64
}

// globalCounters are the dispatcher-wide totals since start (dispatch_stats, with the fan-in
// counters of fanin.go).
type globalCounters struct {
	StageRuns int64
	Claims    int64
	Done      int64
	Failed    int64
	Retried   int64
}

// A counterDef is one statistics counter: its column, its /metrics family, and where it lives.
// The two tables below are the only list of the counters: the deltas, the flush statements and
// /metrics are all driven by them, so a new counter is one field and one row (and its column
// in schema.sql), as poolcounter.go's pcCounters is for the lock service.
type counterDef struct {
	column string // the column of stage_stats or dispatch_stats
	metric string // the /metrics family
	help   string
	ms     bool // milliseconds: /metrics shows seconds
	max    bool // a maximum, not a sum: a gauge, flushed with GREATEST
}

// stageCounterDefs lists stage_stats's counters, in column order.
var stageCounterDefs = []struct {
	counterDef
	field func(*stageCounters) *int64
}{
	{counterDef{"processed", "pepsi_stage_processed_total", "Status lines with status 0.", false, false}, func(c *stageCounters) *int64 { return &c.Processed }},
	{counterDef{"failed", "pepsi_stage_failed_total", "Non-zero statuses and protocol errors.", false, false}, func(c *stageCounters) *int64 { return &c.Failed }},
	{counterDef{"crashed", "pepsi_stage_crashed_total", "Workers that died with a message of the stage at their head.", false, false}, func(c *stageCounters) *int64 { return &c.Crashed }},
	{counterDef{"timeouts", "pepsi_stage_timeouts_total", "Messages killed by the MAX_RUNTIME watchdog.", false, false}, func(c *stageCounters) *int64 { return &c.Timeouts }},
	{counterDef{"fused", "pepsi_stage_fused_total", "Passes of the stage run inside another stage's worker.", false, false}, func(c *stageCounters) *int64 { return &c.Fused }},
	{counterDef{"busy_ms", "pepsi_stage_busy_seconds_total", "Processing time.", true, false}, func(c *stageCounters) *int64 { return &c.BusyMs }},
	{counterDef{"max_ms", "pepsi_stage_max_seconds", "Longest single message since start.", true, true}, func(c *stageCounters) *int64 { return &c.MaxMs }},
	{counterDef{"workers_started", "pepsi_stage_workers_started_total", "Worker processes started.", false, false}, func(c *stageCounters) *int64 { return &c.WorkersStarted }},
}

// dispatchCounterDefs lists dispatch_stats's counters, in column order: the dispatcher's own,
// then fan-in's.
var dispatchCounterDefs = []struct {
	counterDef
	get func(*globalCounters, *faninCounters) int64
}{
	{counterDef{"stage_runs", "pepsi_stage_runs_total", "Messages handed to workers.", false, false}, func(g *globalCounters, _ *faninCounters) int64 { return g.StageRuns }},
	{counterDef{"claims", "pepsi_claims_total", "Claim statements that returned rows.", false, false}, func(g *globalCounters, _ *faninCounters) int64 { return g.Claims }},
	{counterDef{"done", "pepsi_messages_done_total", "Messages reported as reaching done.", false, false}, func(g *globalCounters, _ *faninCounters) int64 { return g.Done }},
	{counterDef{"failed", "pepsi_messages_failed_total", "Messages the dispatcher marked failed.", false, false}, func(g *globalCounters, _ *faninCounters) int64 { return g.Failed }},
	{counterDef{"retried", "pepsi_retried_total", "Paused rows returned to pending.", false, false}, func(g *globalCounters, _ *faninCounters) int64 { return g.Retried }},
	{counterDef{"fanin_events", "pepsi_fanin_events_total", "Fan-in inbox rows consumed.", false, false}, func(_ *globalCounters, f *faninCounters) int64 { return f.Events }},
	{counterDef{"fanin_flushes", "pepsi_fanin_flushes_total", "Fan-in flush statements.", false, false}, func(_ *globalCounters, f *faninCounters) int64 { return f.Flushes }},
	{counterDef{"fanin_flush_ms", "pepsi_fanin_flush_seconds_total", "Time spent in fan-in flushes.", true, false}, func(_ *globalCounters, f *faninCounters) int64 { return f.FlushMs }},
	{counterDef{"fanin_wakes", "pepsi_fanin_wakes_total", "Parents woken by fan-in.", false, false}, func(_ *globalCounters, f *faninCounters) int64 { return f.Wakes }},
	{counterDef{"fanin_late_events", "pepsi_fanin_late_events_total", "Events of groups already fired.", false, false}, func(_ *globalCounters, f *faninCounters) int64 { return f.LateEvents }},
	{counterDef{"fanin_sweep_repaired", "pepsi_fanin_sweep_repaired_total", "Groups the sweep had to correct (alarm: should stay 0).", false, false}, func(_ *globalCounters, f *faninCounters) int64 { return f.SweepRepaired }},
	{counterDef{"fanin_quarantined", "pepsi_fanin_quarantined_total", "Groups whose evidence tripped a guard (alarm: should stay 0).", false, false}, func(_ *globalCounters, f *faninCounters) int64 { return f.Quarantined }},
}

// sub returns the counters accumulated since old (a maximum is carried as is).
func (c stageCounters) sub(old stageCounters) stageCounters {
	d := c
	for _, def := range stageCounterDefs {
		if !def.max {
			*def.field(&d) -= *def.field(&old)
		}
	}
	return d
}

// isZero reports whether no sum moved (a maximum is compared by the caller).
func (c stageCounters) isZero() bool {
	for _, def := range stageCounterDefs {
		if !def.max && *def.field(&c) != 0 {
			return false
		}
	}
	return true
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

// flushStageSQL adds a batch of stage deltas to stage_stats: $1 the stage names, then one
// array per counter, in stageCounterDefs order.
var flushStageSQL = func() string {
	cols, params, sets := []string{"stage"}, []string{"$1::text[]"}, []string{}
	for i, def := range stageCounterDefs {
		cols = append(cols, def.column)
		params = append(params, fmt.Sprintf("$%d::bigint[]", i+2))
		if def.max {
			sets = append(sets, fmt.Sprintf("%[1]s = greatest(t.%[1]s, EXCLUDED.%[1]s)", def.column))
		} else {
			sets = append(sets, fmt.Sprintf("%[1]s = t.%[1]s + EXCLUDED.%[1]s", def.column))
		}
	}
	return "INSERT INTO stage_stats AS t (" + strings.Join(cols, ", ") + ")\n" +
		"SELECT * FROM unnest(" + strings.Join(params, ", ") + ")\n" +
		"ON CONFLICT (stage) DO UPDATE SET\n    " + strings.Join(sets, ",\n    ") + ",\n    updated_at = now()"
}()

// flushGlobalSQL adds the dispatcher-wide deltas to dispatch_stats's one row, one parameter
// per counter in dispatchCounterDefs order.
var flushGlobalSQL = func() string {
	var sets []string
	for i, def := range dispatchCounterDefs {
		sets = append(sets, fmt.Sprintf("%[1]s = %[1]s + $%[2]d", def.column, i+1))
	}
	return "UPDATE dispatch_stats SET " + strings.Join(sets, ", ") + ", updated_at = now()\n WHERE id = 1"
}()

// flush writes the deltas since the last flush in one transaction. Nothing is written when
// nothing changed; on error nothing is marked flushed, so the next flush carries it.
func (s *Stats) flush(ctx context.Context, db *sql.DB) (bool, error) {
	if !s.dirty() {
		return false, nil
	}
	names := slices.Sorted(maps.Keys(s.Stages)) // fixed order: no deadlock with a concurrent flush
	cols := make([][]int64, len(stageCounterDefs))
	var stages []string
	for _, name := range names {
		d := s.Stages[name].sub(s.flushed.stages[name])
		if d.isZero() && d.MaxMs <= s.flushed.stages[name].MaxMs {
			continue
		}
		stages = append(stages, name)
		for i, def := range stageCounterDefs {
			cols[i] = append(cols[i], *def.field(&d))
		}
	}
	var globals []any
	moved := false
	for _, def := range dispatchCounterDefs {
		d := def.get(&s.Global, &s.Fanin) - def.get(&s.flushed.global, &s.flushed.fanin)
		globals = append(globals, d)
		moved = moved || d != 0
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return false, fmt.Errorf("flush statistics: %w", err)
	}
	defer tx.Rollback() // after Commit this is a no-op
	// The write runs on the coordinator's loop: a row another transaction holds (an operator's
	// UPDATE left open, a schema upgrade's ALTER queued behind something) would stop every
	// claim for the whole budget at every STATS_INTERVAL (TestStatsRowHeldClaimsGoOn). The
	// figures stay in memory for the next flush, so giving up at once loses nothing.
	if _, err := tx.ExecContext(ctx, `SET LOCAL lock_timeout = '100ms'`); err != nil {
		return false, fmt.Errorf("flush statistics: %w", err)
	}
	if len(stages) > 0 {
		args := []any{pq.Array(stages)}
		for i := range cols {
			args = append(args, pq.Array(cols[i]))
		}
		if _, err := tx.ExecContext(ctx, flushStageSQL, args...); err != nil {
			return false, fmt.Errorf("flush statistics: stage_stats: %w", err)
		}
	}
	if moved {
		if _, err := tx.ExecContext(ctx, flushGlobalSQL, globals...); err != nil {
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

// flushStats writes the statistics deltas; a failure keeps them for the next flush. A failure
// is logged when it starts and then once a minute: while the database refuses the flush (a
// full disk, a rule on stage_stats) an idle pipeline tries it every second (settle), and said
// a line a second (TestStatsFlushRefusedLoggedOnce).
//
// The loop makes this write itself, through the pool whose connections the fan-in flush, the
// sweep, the strays check and retention take in the background (and with DB_POOL_SIZE = 2 the
// HTTP listener: poolShares). Waiting there for a connection would stop every claim for as
// long as they keep theirs, up to a statement budget each
// (TestConsoleLoadLeavesLoopItsConnections), so while the pool has every connection in use the
// flush is put off, its figures kept; except the last one, at the end of a clean shutdown
// (final), which waits, as nothing else is left to do.
func (c *coordinator) flushStats(final bool) {
	ctx, cancel := context.WithTimeout(c.ctx, dbStatementBudget)
	defer cancel()
	if !c.stats.dirty() {
		return
	}
	now := time.Now()
	c.lastStatsFlush = now
	var err error
	if st := c.db.Stats(); !final && st.MaxOpenConnections > 0 && st.InUse >= st.MaxOpenConnections {
		err = fmt.Errorf("flush statistics: every connection of the pool is in use (%d); not waiting for one", st.InUse)
	} else {
		_, err = c.stats.flush(ctx, c.db)
	}
	if err != nil {
		c.statsRefused++
		if c.statsRefused == 1 || now.Sub(c.statsWarnedAt) >= time.Minute {
			c.statsWarnedAt = now
			c.log.Warn("statistics not flushed; kept for the next flush", "err", err, "failed_flushes", c.statsRefused)
		}
		return
	}
	if c.statsRefused > 0 {
		c.log.Info("statistics flushed again", "failed_flushes", c.statsRefused)
		c.statsRefused = 0
	}
}
