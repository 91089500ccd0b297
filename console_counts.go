// console_counts.go: the overview's row counts, one count shared by every viewer.
//
// The overview counts the rows that are not done, per stage and status: the running ones are
// the dispatcher's own count (no index serves them), the others are counted through the
// partial index of each status's rows (liveRowsSQL, which /metrics uses at every scrape too),
// so a count costs the size of those rows, not of the table. It was a scan of the table: the
// done rows are the ones that pile up, and a count of a few tens of millions ran past the
// statement timeout. A backlog of millions of pending rows is still millions of index entries,
// and an open overview reloads every second, so the count is made for all viewers together,
// at most once per consoleCountEvery, and no more often than keeps its own time at
// 1/consoleCountDuty of the wall clock: a count that took 80 ms is made again 4 s later at the
// soonest, and so is one that failed after 80 ms (a count that ran into the statement timeout
// cost as much as one that finished). The counts are never older than consoleCountMaxAge,
// though, so a count that takes longer than 0.6 s costs more than that share: at most a tenth
// of a backend, since a count longer than consoleStatementTimeout (3 s) fails. A viewer who
// arrives while a count runs waits for it rather than starting another. An action taken on the
// console makes the next overview count again; the page says how old its counts are.

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

// liveRowsSQL counts the rows that are neither done nor running, per stage and status, with
// the age of each stage's oldest pending row: one branch per partial index of such rows
// (schema.sql), each read only where its index's predicate holds, so that the count costs the
// size of those rows and never the table's. It was one scan of the table (status <> 'done'),
// done rows and all, at every scrape of /metrics and every console count: 0.4 s on 4 million
// done rows, beyond /metrics' 5 s budget with a few tens of millions, which a table reaches in
// days without RETENTION (TestLiveRowsByIndex). Running rows have no index (it would cost
// every claim an entry): their count is the dispatcher's own (stageSnapshot.running).
const liveRowsSQL = `
SELECT stage, status, count(*), coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8
  FROM (SELECT stage, status, created_at FROM workqueue WHERE status = 'pending' AND NOT key_parked
        UNION ALL
        SELECT stage, status, created_at FROM workqueue WHERE status = 'pending' AND key_parked
        UNION ALL
        SELECT stage, status, NULL FROM workqueue WHERE status = 'waiting'
        UNION ALL
        SELECT stage, status, NULL FROM workqueue WHERE status IN ('failed', 'paused', 'held', 'cancelled')) live
 GROUP BY stage, status`

// countPerStage counts the rows that are neither done nor running (liveRowsSQL).
func countPerStage(ctx context.Context, db interface {
	QueryContext(context.Context, string, ...any) (*sql.Rows, error)
}) ([]stageCount, error) {
	rows, err := db.QueryContext(ctx, liveRowsSQL)
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
