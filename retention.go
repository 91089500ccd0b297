// retention.go: deleting old done rows, a little at a time, when the pipeline is idle.
//
// With RETENTION set, done and cancelled rows that finished (status_at) longer ago than that
// are deleted in batches of retentionBatch, only while nothing is in flight, at most
// retentionBatches per turn and one turn per retentionEvery. Rows are walked in id order from a
// cursor kept in memory, so a turn does not rescan what the previous one deleted; a batch that
// finds fewer rows than it may delete has reached the end, and the walk starts over next turn.
// Failed rows are kept until a person acts (pepsi-queue delete); children of fan-out groups that are still open are never touched (their parent still
// needs them, and the fan-in trigger refuses it anyway).

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

// retainer keeps the walk's cursor between turns; owned by the coordinator.
type retainer struct {
	age    time.Duration
	cursor int64
}

// turn deletes up to retentionBatches batches; it returns the rows deleted.
func (r *retainer) turn(ctx context.Context, db *sql.DB) (int64, error) {
	var total int64
	for i := 0; i < retentionBatches; i++ {
		var n, last int64
		err := db.QueryRowContext(ctx, retentionSQL, r.age.Seconds(), r.cursor, retentionBatch).Scan(&n, &last)
		if err != nil {
			return total, fmt.Errorf("retention: delete done rows older than %v: %w", r.age, err)
		}
		total += n
		if n < retentionBatch {
			r.cursor = 0 // reached rows too young (or the end): start over next turn
			break
		}
		r.cursor = last
	}
	return total, nil
}
