// retention.go: deleting old done rows, a little at a time, when the pipeline is idle.
//
// With RETENTION set, done and cancelled rows that finished (status_at) longer ago than that
// are deleted, only while nothing is in flight, one turn per retentionEvery. A turn walks the
// table in id order from a cursor kept in memory, so it does not rescan what the previous one
// looked at: each statement looks at the next retentionWindow rows (twice retentionBatch
// after one that deleted a whole batch: old rows are dense there) and deletes up to
// retentionBatch of them, at most retentionBatches statements per turn. Failed rows are kept
// until a person acts (pepsi-queue delete); children of fan-out groups that are still open
// are never touched (their parent still needs them, and the fan-in trigger refuses it anyway).
//
// Where a walk stops. A row's status_at is never before its created_at, and ids are given in
// insert order, so once a walk meets a window of rows that were all created less than
// RETENTION ago (a stretch of 2,000 rows at least), the rows after them finished later still:
// the walk stops there and starts over from the beginning next turn. An idle dispatcher so
// looks at the old rows it keeps (failed ones, say) and a window or two of young ones each
// minute. It once walked on to the end of the table every minute: about 120 ms per million
// rows here when nothing was old enough, and on a table large enough, past the statement
// budget every minute. Rows whose ids are out of time order (an id or created_at the
// producer gave, a transaction open for longer than RETENTION) can lie beyond that stop, so
// a full walk, which goes on to the end of the table, comes first after the start and then
// once every retentionFullEvery.
//
// A turn runs in the background on a pooled connection, like the fan-in sweep, and the
// coordinator cancels it as soon as it has messages in flight again. It once ran on the
// coordinator's goroutine: nothing was claimed while it ran, which is as long as the statement
// budget when a delete waited for a lock (an application's row referencing a message, ON
// DELETE SET NULL, held by an open transaction: TestRetentionBlockedClaimsGoOn).
//
// A row the database refuses to delete (an application's foreign key to it without ON
// DELETE, its trigger) is kept alone: the batch it was in is done again in halves until the
// refused row stands alone, and the row is left out of the walks until the day's full one
// (deleteRowsAlone). One such row used to fail every turn at the same batch.

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/lib/pq"
)

const (
	retentionBatch     = 1000           // rows one statement deletes, at most
	retentionWindow    = 50_000         // rows one statement looks at, at most
	retentionWindowMin = 500            // ... at the least, when a statement_timeout cuts it
	retentionBatches   = 20             // statements per turn, at most
	retentionEvery     = time.Minute    // one turn per
	retentionFullEvery = 24 * time.Hour // a full walk per (see the file's comment)
)

// retentionSQL looks at up to $4 rows after id $2 (the window) and deletes up to $3 of them,
// the done or cancelled rows that finished more than $1 seconds ago (status_at; rows from
// before that column existed count from created_at). It returns how many it deleted and the
// last of them, how many rows it looked at and the last of those, and whether every one of
// them was created less than $1 seconds ago. Rows the database refused to delete before
// ($5: retainer.refused) are left out, so that one such row does not fail every batch that
// meets it (deleteRowsAlone).
//
// The window is read once (its CTE is used twice, so PostgreSQL materializes it), and only
// the rows it found old enough are read again, by primary key, to be locked and deleted. The
// pick repeats the window's conditions: they are what the lock checks again on a row that
// changed after the statement's snapshot (below).
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
WITH win AS (` + retentionWindowSQL + `
), doomed AS (
    SELECT w.workqueue_id FROM workqueue w
     WHERE w.workqueue_id = ANY (ARRAY(SELECT workqueue_id FROM win WHERE old))
       AND w.workqueue_id <> ALL ($5::bigint[])
       AND ` + retentionDueSQL + `
     ORDER BY w.workqueue_id
     LIMIT $3
       FOR UPDATE OF w SKIP LOCKED
), gone AS (
    DELETE FROM workqueue q USING doomed WHERE q.workqueue_id = doomed.workqueue_id
    RETURNING q.workqueue_id
)
SELECT (SELECT count(*) FROM gone), (SELECT coalesce(max(workqueue_id), 0) FROM gone),
       count(*), coalesce(max(workqueue_id), 0), coalesce(bool_and(young), false)
  FROM win`

// retentionWindowSQL is the window: up to $4 rows after id $2, each with whether it is old
// enough to go and whether it was created less than $1 seconds ago.
const retentionWindowSQL = `
    SELECT w.workqueue_id,
           w.status IN ('done', 'cancelled')
             AND coalesce(w.status_at, w.created_at) < now() - make_interval(secs => $1) AS old,
           w.created_at >= now() - make_interval(secs => $1) AS young
      FROM workqueue w
     WHERE w.workqueue_id > $2
     ORDER BY w.workqueue_id
     LIMIT $4`

// retentionDueSQL says that the row w may go: done or cancelled more than $1 seconds ago,
// and no child of a fan-out group that is still open.
const retentionDueSQL = `w.status IN ('done', 'cancelled')
       AND coalesce(w.status_at, w.created_at) < now() - make_interval(secs => $1)
       AND (w.fanout_id IS NULL OR NOT EXISTS (
             SELECT 1 FROM fanout f WHERE f.fanout_id = w.fanout_id AND f.state = 'open'))`

// retentionPickSQL is retentionSQL without its DELETE, for a batch the database refused:
// the rows it would have deleted (the first $3 old enough in the window, those refused before,
// $5, left out), and what it says of the window.
const retentionPickSQL = `
WITH win AS (` + retentionWindowSQL + `
)
SELECT ARRAY(SELECT w.workqueue_id FROM workqueue w
              WHERE w.workqueue_id = ANY (ARRAY(SELECT workqueue_id FROM win WHERE old))
                AND w.workqueue_id <> ALL ($5::bigint[])
                AND ` + retentionDueSQL + `
              ORDER BY w.workqueue_id
              LIMIT $3),
       count(*), coalesce(max(workqueue_id), 0), coalesce(bool_and(young), false)
  FROM win`

// retentionSomeSQL deletes the rows $2 that may still go, passing over those another
// transaction holds (as retentionSQL does).
const retentionSomeSQL = `
WITH doomed AS (
    SELECT w.workqueue_id FROM workqueue w
     WHERE w.workqueue_id = ANY ($2::bigint[]) AND ` + retentionDueSQL + `
       FOR UPDATE OF w SKIP LOCKED
)
DELETE FROM workqueue q USING doomed WHERE q.workqueue_id = doomed.workqueue_id`

// retentionWalk is what a turn does: the age of the rows it deletes, whether it is a full
// walk, its sizes (the constants above; the tests' are smaller), and the rows it leaves out.
type retentionWalk struct {
	age                    time.Duration
	full                   bool // go on to the end of the table, past windows of young rows
	batch, window, batches int
	skip                   []int64 // rows the database refused to delete before, in id order
}

// retainer is the retention's state; owned by the coordinator. While a turn runs, the
// cursor is the goroutine's: it comes back with the turn's result. A walk starts after id 0:
// ids are positive (schema.sql's last statement).
type retainer struct {
	age      time.Duration
	cursor   int64              // where the walk under way goes on; 0: the next turn starts one
	full     bool               // the walk under way is a full one
	lastFull time.Time          // when the last full walk reached the end of the table
	running  bool               // a turn runs in the background
	stopped  bool               // ... and the coordinator has cancelled it
	stop     context.CancelFunc // cancels the running turn
	// refused holds the rows the database refused to delete (at most retentionRefusedMax),
	// left out of the walks until the next full one tries them again.
	refused map[int64]bool
}

// retentionRefusedMax bounds retainer.refused; a row refused past it is met again by the
// next walk's batch, and deleted or refused alone again (deleteRowsAlone).
const retentionRefusedMax = 10_000

// retentionDone is a turn's result, sent by the goroutine that ran it.
type retentionDone struct {
	n       int64 // rows deleted, by the statements that committed
	cursor  int64 // where the next turn goes on; 0: the walk ended
	refused []refusedRow
	err     error
}

// refusedRow is a row the database refused to delete, and why.
type refusedRow struct {
	id  int64
	err error
}

// retentionTurn runs up to w.batches statements from cursor on; it returns the rows deleted
// and where the next turn goes on (after the last statement that committed; 0 when the walk
// ended), and the rows the database refused to delete.
func retentionTurn(ctx context.Context, db *sql.DB, w retentionWalk, cursor int64) (res retentionDone) {
	window, widest := w.window, w.window
	for i := 0; i < w.batches; i++ {
		skip := w.skip[sort.Search(len(w.skip), func(i int) bool { return w.skip[i] > cursor }):] // those after the cursor
		var n, lastGone, looked, lastLooked int64
		var young bool
		err := db.QueryRowContext(ctx, retentionSQL, w.age.Seconds(), cursor, min(w.batch, window), window, idList(skip)).
			Scan(&n, &lastGone, &looked, &lastLooked, &young)
		if next, ok := halvedOnCut(err, ctx.Err() != nil, window, retentionWindowMin); ok {
			// A statement_timeout of the role's, the database's or the DSN's shorter than a
			// window's statement: the same rows again, half as many (and no wider for the rest
			// of the turn). It failed every turn at the same window, and nothing was deleted
			// again (TestRetentionPastRoleStatementTimeout).
			window, widest = next, next
			i--
			continue
		}
		deleted, allRefused := n, false
		if refusesRows(err) && ctx.Err() == nil {
			var one rowsAlone
			one, err = deleteRowsAlone(ctx, db, w, cursor, window, skip)
			res.refused = append(res.refused, one.refused...)
			n, lastGone, looked, lastLooked, young = one.picked, one.lastPicked, one.looked, one.lastLooked, one.young
			deleted, allRefused = one.deleted, one.picked > 0 && len(one.refused) == int(one.picked)
		}
		if err != nil {
			res.err = fmt.Errorf("retention: delete done rows older than %v: %w", w.age, err)
			res.cursor = cursor
			return res
		}
		res.n += deleted
		batch := int64(min(w.batch, window))
		switch {
		case allRefused && n == batch:
			// Every row of the batch refused (an application that references all of
			// them): the turn ends here rather than spend a statement per row on every
			// batch of it; the next turn goes on after these rows.
			res.cursor = lastGone
			return res
		case n == batch:
			// The window may hold more rows old enough, and they are dense here: the next
			// statement looks at twice a batch, not at a whole window again for one batch.
			cursor, window = lastGone, min(widest, 2*w.batch)
		case looked < int64(window) || young && !w.full:
			return res // the end of the table, or of the rows old enough: start over next turn
		default:
			cursor, window = lastLooked, widest
		}
	}
	res.cursor = cursor
	return res
}

// refusesRows reports whether err is the database refusing what a statement did to some of
// its rows (an integrity rule: an application's foreign key to a message without ON DELETE;
// or an exception a trigger raised), as opposed to a lost connection, a cancellation or a
// statement it could not run at all.
func refusesRows(err error) bool {
	var pe *pq.Error
	return errors.As(err, &pe) && (pe.Code.Class() == "23" || pe.Code.Class() == "P0")
}

// rowsAlone is what deleteRowsAlone did with one batch.
type rowsAlone struct {
	picked, lastPicked int64 // the rows the batch would have deleted: how many, the last
	deleted            int64
	refused            []refusedRow
	looked, lastLooked int64 // the window, as retentionSQL says it
	young              bool
}

// deleteRowsAlone is one batch of retentionSQL, for a window whose batch the database refused:
// it picks the rows the batch would have deleted and deletes them in halves, each half that
// is refused halved again, so that a refusal that is one row's (an application's foreign key
// to it, its trigger) keeps only that row, not the whole walk: a batch refused so failed every
// turn at the same place, and retention deleted nothing past it again
// (TestRetentionRowRefused). The walk goes on after the picked rows as after a batch that
// deleted them. Each statement is its own transaction; a refused row costs about
// 2 log2(batch) of them, 20 for a batch of 1,000, once per walk (retainer.refused leaves the
// row out afterwards). One statement a row, as before, was a thousand, past the turn's budget
// on a busy server (TestRetentionRefusedBatchFewStatements).
func deleteRowsAlone(ctx context.Context, db *sql.DB, w retentionWalk, cursor int64, window int, skip []int64) (rowsAlone, error) {
	var r rowsAlone
	var picked []int64
	if err := db.QueryRowContext(ctx, retentionPickSQL, w.age.Seconds(), cursor, w.batch, window, idList(skip)).
		Scan((*pq.Int64Array)(&picked), &r.looked, &r.lastLooked, &r.young); err != nil {
		return r, fmt.Errorf("pick the rows of a refused batch: %w", err)
	}
	var del, halve func(ids []int64) error
	del = func(ids []int64) error {
		res, err := db.ExecContext(ctx, retentionSomeSQL, w.age.Seconds(), pq.Array(ids))
		switch {
		case refusesRows(err) && ctx.Err() == nil && len(ids) == 1:
			r.refused = append(r.refused, refusedRow{id: ids[0], err: err})
		case refusesRows(err) && ctx.Err() == nil:
			return halve(ids)
		case err != nil:
			return fmt.Errorf("delete %d rows of a refused batch, from %d: %w", len(ids), ids[0], err)
		default:
			n, _ := res.RowsAffected() // lib/pq reads it from the command tag: no error
			r.deleted += n
		}
		return nil
	}
	halve = func(ids []int64) error {
		if err := del(ids[:len(ids)/2]); err != nil {
			return err
		}
		return del(ids[len(ids)/2:])
	}
	var err error
	switch len(picked) {
	case 0:
	case 1:
		err = del(picked)
	default:
		err = halve(picked) // the whole batch was just refused
	}
	if err != nil {
		return r, err
	}
	r.picked = int64(len(picked))
	if len(picked) > 0 {
		r.lastPicked = picked[len(picked)-1]
	}
	return r, nil
}

// nextWalk is the walk the next turn makes at now: the one under way, or a new one from the
// start of the table, full when no full walk has ended in the last retentionFullEvery (and so
// the first after the start).
func (r *retainer) nextWalk(now time.Time) retentionWalk {
	if r.cursor == 0 {
		r.full = r.lastFull.IsZero() || now.Sub(r.lastFull) >= retentionFullEvery
		if r.full {
			r.refused = nil // tried again: the application may have let go of them
		}
	}
	w := walkOf(r.age, r.full)
	for id := range r.refused {
		w.skip = append(w.skip, id)
	}
	slices.Sort(w.skip)
	return w
}

// walkOf is a walk with the daemon's sizes.
func walkOf(age time.Duration, full bool) retentionWalk {
	return retentionWalk{age: age, full: full, batch: retentionBatch, window: retentionWindow, batches: retentionBatches}
}

// startRetention runs a turn in the background, within one statement budget.
func (c *coordinator) startRetention() {
	r := c.retain
	ctx, cancel := context.WithTimeout(c.ctx, dbStatementBudget)
	r.running, r.stopped, r.stop = true, false, cancel
	walk, cursor := r.nextWalk(time.Now()), r.cursor
	c.inBackground(func() event {
		defer cancel()
		return retentionTurn(ctx, c.db, walk, cursor)
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
	r.ended(ev, time.Now())
	switch {
	case ev.err != nil && r.stopped:
		c.log.Debug("retention turn stopped: messages in flight, or a shutdown", "rows", ev.n)
	case ev.err != nil:
		c.log.Warn("retention turn failed; next turn in a minute", "err", ev.err)
	}
	if ev.n > 0 {
		c.log.Info("retention: deleted old done rows", "rows", ev.n, "older_than", r.age)
	}
	if len(ev.refused) > 0 {
		ids := make([]int64, 0, min(len(ev.refused), 10))
		for _, rr := range ev.refused[:cap(ids)] {
			ids = append(ids, rr.id)
		}
		c.log.Warn("retention: the database refused to delete these old rows; kept, and tried again at the next full walk (daily)",
			"rows", len(ev.refused), "ids", ids, "err", ev.refused[0].err)
	}
}

// ended records where a turn left the walk: a full walk that reached the end of the table
// is the last full walk.
func (r *retainer) ended(ev retentionDone, now time.Time) {
	if ev.err == nil && ev.cursor == 0 && r.full {
		r.lastFull = now
	}
	r.cursor = ev.cursor
	for _, rr := range ev.refused {
		if len(r.refused) >= retentionRefusedMax {
			break
		}
		if r.refused == nil {
			r.refused = map[int64]bool{}
		}
		r.refused[rr.id] = true
	}
}
