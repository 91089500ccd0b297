// retention.go: deleting old done rows, a little at a time, when the pipeline is idle.
//
// With RETENTION set, done and cancelled rows that finished (status_at) longer ago than that
// are deleted in batches of retentionBatch, only while nothing is in flight, at most
// retentionBatches per turn and one turn per retentionEvery. Rows are walked in id order from a
// cursor kept in memory, so a turn does not rescan what the previous one deleted; a batch that
// finds fewer rows than it may delete has reached the end, and the walk starts over next turn.
// Failed rows are kept until a person acts (pepsi-queue delete); children of fan-out groups
// that are still open are never touched (their parent still needs them, and the fan-in
// trigger refuses it anyway).
//
// A turn runs in the background on a pooled connection, like the fan-in sweep, and the
// coordinator cancels it as soon as it has messages in flight again. It once ran on the
// coordinator's goroutine: nothing was claimed while it ran, which is as long as a walk over
// the whole table when no row is old enough yet (about 120 ms per million rows here, each
// minute), or the statement budget when a delete waited for a lock (an application's row
// referencing a message, ON DELETE SET NULL, held by an open transaction:
// TestRetentionBlockedClaimsGoOn).

package main

import (
	"context"
	"database/sql"
	"fmt"
	"time"
)

const (
	retentionBatch   = 1000
	retentionBatches = 20
	retentionEvery   = time.Minute
)

// retentionSQL deletes up to $3 done or cancelled rows that finished more than $1 seconds ago
// (status_at; rows from before that column existed count from created_at), after id $2; it
// returns how many and the last id.
//
// The pick locks what it picks (FOR UPDATE) and passes over rows another transaction holds
// (SKIP LOCKED): the next walk comes back to them. Without the lock, the DELETE re-checked
// only its join with the pick when it met a row that changed after the statement's
// snapshot, so an operator's retry of an old cancelled message (queue_retry) that committed
// meanwhile was deleted, pending, with the retry (TestRetentionRetryCommittedMeanwhile). The
// lock's re-check reads the row as committed and drops it from the pick. Skipping, not
// waiting: a held row (an operator's open transaction, an application's FOR KEY SHARE) would
// otherwise stop the whole batch for the statement budget, and every minute again.
const retentionSQL = `
WITH doomed AS (
    SELECT w.workqueue_id FROM workqueue w
     WHERE w.workqueue_id > $2 AND w.status IN ('done', 'cancelled')
       AND coalesce(w.status_at, w.created_at) < now() - make_interval(secs => $1)
       AND (w.fanout_id IS NULL OR NOT EXISTS (
             SELECT 1 FROM fanout f WHERE f.fanout_id = w.fanout_id AND f.state = 'open'))
     ORDER BY w.workqueue_id
     LIMIT $3
       FOR UPDATE OF w SKIP LOCKED
), gone AS (
    DELETE FROM workqueue q USING doomed WHERE q.workqueue_id = doomed.workqueue_id
    RETURNING q.workqueue_id
)
SELECT count(*), coalesce(max(workqueue_id), 0) FROM gone`

// retainer is the retention's state; owned by the coordinator. While a turn runs, the
// cursor is the goroutine's: it comes back with the turn's result.
type retainer struct {
	age     time.Duration
	cursor  int64
	running bool               // a turn runs in the background
	stopped bool               // ... and the coordinator has cancelled it
	stop    context.CancelFunc // cancels the running turn
}

// retentionDone is a turn's result, sent by the goroutine that ran it.
type retentionDone struct {
	n      int64 // rows deleted, by the batches that committed
	cursor int64 // where the next turn starts
	err    error
}

// retentionTurn deletes up to retentionBatches batches from cursor on; it returns the rows
// deleted and where the next turn starts (after the last batch that committed).
func retentionTurn(ctx context.Context, db *sql.DB, age time.Duration, cursor int64) (int64, int64, error) {
	var total int64
	for i := 0; i < retentionBatches; i++ {
		var n, last int64
		err := db.QueryRowContext(ctx, retentionSQL, age.Seconds(), cursor, retentionBatch).Scan(&n, &last)
		if err != nil {
			return total, cursor, fmt.Errorf("retention: delete done rows older than %v: %w", age, err)
		}
		total += n
		if n < retentionBatch {
			return total, 0, nil // reached rows too young (or the end): start over next turn
		}
		cursor = last
	}
	return total, cursor, nil
}

// startRetention runs a turn in the background, within one statement budget.
func (c *coordinator) startRetention() {
	r := c.retain
	ctx, cancel := context.WithTimeout(c.ctx, dbStatementBudget)
	r.running, r.stopped, r.stop = true, false, cancel
	age, cursor := r.age, r.cursor
	c.inBackground(func() event {
		defer cancel()
		n, next, err := retentionTurn(ctx, c.db, age, cursor)
		return retentionDone{n: n, cursor: next, err: err}
	})
}

// stopRetention cancels a running turn: the pipeline has work again, or a shutdown began.
// The batch in progress rolls back; the next turn goes on from the last one that committed.
func (c *coordinator) stopRetention() {
	if r := c.retain; r != nil && r.running && !r.stopped {
		r.stopped = true
		r.stop()
	}
}

// retaining reports whether a turn is still running (the shutdown waits for it).
func (c *coordinator) retaining() bool { return c.retain != nil && c.retain.running }

// onRetained takes a turn's result.
func (c *coordinator) onRetained(ev retentionDone) {
	r := c.retain
	r.running = false
	r.cursor = ev.cursor
	switch {
	case ev.err != nil && r.stopped:
		c.log.Debug("retention turn stopped: messages in flight, or a shutdown", "rows", ev.n)
	case ev.err != nil:
		c.log.Warn("retention turn failed; next turn in a minute", "err", ev.err)
	}
	if ev.n > 0 {
		c.log.Info("retention: deleted old done rows", "rows", ev.n, "older_than", r.age)
	}
}
