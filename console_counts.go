// console_counts.go: the overview's row counts, one count shared by every viewer.
//
// The overview counts the rows that are not done, per stage and status: a scan of the queue
// table, since no index serves status <> 'done' (the done rows are the ones that pile up, and
// an index of everything else would cost every transition an entry). An open overview reloads
// every second, so each viewer would add a scan a second, and a scan of a big table is long.
// The count is therefore made for all viewers together, at most once per consoleCountEvery,
// and no more often than keeps its own time at 1/consoleCountDuty of the wall clock: a count
// that took 80 ms is made again 4 s later at the soonest, and so is one that failed after
// 80 ms (a count that ran into the statement timeout cost as much as one that finished). The
// counts are never older than consoleCountMaxAge, though, so a count that takes longer than
// 0.6 s costs more than that share: at most a tenth of a backend, since a count longer than
// consoleStatementTimeout (3 s) fails. A viewer who arrives while a count runs waits for it
// rather than starting another. An action taken on the console makes the next overview count
// again; the page says how old its counts are.

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

const (
	consoleCountEvery  = time.Second      // the soonest a count is made again
	consoleCountDuty   = 50               // a count waits at least this many times its own duration
	consoleCountMaxAge = 30 * time.Second // and at most this long
)

// stageCount is one (stage, status) line of a count.
type stageCount struct {
	stage, status string
	n             int64
	oldest        time.Duration // pending: the age of the oldest row when counted
}

// countCache is the last count and when it was made. Any number of HTTP handlers use it.
type countCache struct {
	mu    sync.Mutex // held during a count, so that the viewers waiting share it
	rows  []stageCount
	err   error         // the count's failure, kept like its rows (see above)
	at    time.Time     // when the last count started (its snapshot is a little later)
	took  time.Duration // how long it took
	atGen int64         // gen when it started; another value means an action came since

	gen atomic.Int64 // bumped by every action, outside mu: an action never waits for a count
}

// get returns a count at most as old as the rule above allows, and when it was made.
func (cc *countCache) get(ctx context.Context, db *sql.DB) ([]stageCount, time.Time, error) {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	if !cc.at.IsZero() && cc.atGen == cc.gen.Load() && time.Since(cc.at) < cc.every() {
		return cc.rows, cc.at, cc.err
	}
	gen, start := cc.gen.Load(), time.Now()
	rows, err := countPerStage(ctx, db)
	if err != nil && errors.Is(ctx.Err(), context.Canceled) {
		return nil, time.Time{}, err // this viewer left: that says nothing about the count
	}
	cc.rows, cc.err, cc.at, cc.took, cc.atGen = rows, err, start, time.Since(start), gen
	return rows, start, err
}

// every is how long the last count is good for.
func (cc *countCache) every() time.Duration {
	return min(max(consoleCountEvery, consoleCountDuty*cc.took), consoleCountMaxAge)
}

// invalidate makes the next get count again: an action changed the rows.
func (cc *countCache) invalidate() { cc.gen.Add(1) }

// countPerStage counts the rows that are not done, per stage and status, with the age of each
// stage's oldest pending row. It runs without parallel workers: a parallel plan starts a
// worker process for every execution (17-65 ms for a backend on the test machine), which cost
// more than the scan itself; W1 with the overview open ran at 92.9 % of W1 (BENCHMARKS.md,
// issue 21's ≥ 97 %). The setting is local to its read-only transaction, which ends before the
// page goes on.
func countPerStage(ctx context.Context, db *sql.DB) ([]stageCount, error) {
	tx, err := db.BeginTx(ctx, &sql.TxOptions{ReadOnly: true})
	if err != nil {
		return nil, fmt.Errorf("count rows per stage: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // read only: nothing to keep or lose
	if _, err := tx.ExecContext(ctx, `SET LOCAL max_parallel_workers_per_gather = 0`); err != nil {
		return nil, fmt.Errorf("count rows per stage: %w", err)
	}
	rows, err := tx.QueryContext(ctx, `
		SELECT stage, status, count(*),
		       coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending')), 0)::float8
		  FROM workqueue WHERE status <> 'done'
		 GROUP BY stage, status`)
	if err != nil {
		return nil, fmt.Errorf("count rows per stage: %w", err)
	}
	defer rows.Close()
	var out []stageCount
	for rows.Next() {
		var c stageCount
		var oldest float64
		if err := rows.Scan(&c.stage, &c.status, &c.n, &oldest); err != nil {
			return nil, fmt.Errorf("count rows per stage: %w", err)
		}
		c.oldest = time.Duration(oldest * float64(time.Second))
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("count rows per stage: %w", err)
	}
	return out, nil
}
