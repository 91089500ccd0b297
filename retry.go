// retry.go: what the dispatcher writes to rows it claimed, and the return of paused rows.
//
// Every write here is guarded by the claim the dispatcher handed out: status = 'running',
// the same stage and the same claim token. A stage may commit its advance and then crash, and
// the row may already be claimed again for the next stage before the crash is read; the guard
// makes the stale write a no-op instead of an overwrite (doc/design/dispatch.md §1).
//
// Writes are queued in memory and sent in one statement per kind when the coordinator settles.
// If the database refuses them (down, restarting), they stay queued and are sent again after a
// back-off: an outcome is never dropped because the database was away for a while.

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/lib/pq"
)

// failure is one message the dispatcher fails: counted as an attempt, then paused or failed.
type failure struct {
	m           *message
	reason      string
	maxAttempts int
	retryDelay  time.Duration
	// crash: the head of a worker that died. Whether it fails is known only after the guarded
	// write: if its stage had committed the outcome (the worker died before its status line
	// got out), the row is no longer the claim and nothing is failed; writeOutcomes logs and
	// counts which it was.
	crash bool
}

// The failure and reset writes lock the rows they write first and pass over the rows that
// another transaction holds (FOR NO KEY UPDATE SKIP LOCKED), and say which those are: rows
// still our claim as far as the statement sees, but locked. They run on the coordinator's
// loop, and the common holder is the session of the very worker whose message failed: a
// handler that wrote its own row and then ran past MAX_RUNTIME in a long statement is killed,
// but its session goes on with the statement, holding the row, until the statement ends
// (PostgreSQL notices a vanished client only when it next talks to it). Waiting for it there
// stopped every claim; the write was cancelled at its budget with the lock connection, and the
// re-lock's reconcile then turned the timeout into a reset that charged no attempt, so such a
// message ran again for ever (TestTimeoutRowHeldByItsSession). A held row's write waits: its
// outcome is not known while its holder may still commit, and the coordinator tries it again
// heldRetryGap later (writeOutcomes). The row lock costs a WAL record per row, on paths that
// are rare (failures, crashes, stops), never on a claim or an outcome.

// failSQL records failures. retry_at = now + RETRY_DELAY × 2^(attempts−1), with attempts the
// new count; the exponent is capped so a large MAX_ATTEMPTS cannot overflow the interval.
// Rows written come back with their new status, in how many seconds they are due again (dueAt)
// and whether the reason was stored; held rows with the status 'held'.
//
// The reason goes into the state only when the state is a JSON object. The state is the
// stage's, and a stage may keep an array or a scalar there (JSON null too: the column is NOT
// NULL, not its value); jsonb_set refuses to set a key in those, and that refusal failed the
// whole write, for every message in it and at every retry of it; the loop writes failures
// before it claims (coordinator.go, settle), so the whole dispatcher stopped
// (TestFailureWriteOddReasonsAndStates). Such a state is left as the stage wrote it; the
// failure is recorded all the same, and its reason is in the log.
const failSQL = `
WITH f AS (
    SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::text[], $5::int[], $6::float8[])
        AS f(id, stage, claim, reason, max_attempts, delay)
), mine AS (
    SELECT q.workqueue_id FROM workqueue q JOIN f ON q.workqueue_id = f.id
     WHERE q.status = 'running' AND q.stage = f.stage AND q.claim = f.claim
       FOR NO KEY UPDATE OF q SKIP LOCKED
), w AS (
    UPDATE workqueue q
       SET attempts = q.attempts + 1,
           state    = CASE WHEN jsonb_typeof(q.state) = 'object' OR q.state IS NULL
                           THEN jsonb_set(coalesce(q.state, '{}'), '{dispatch_error}', to_jsonb(f.reason))
                           ELSE q.state END,
           status   = CASE WHEN q.attempts + 1 >= f.max_attempts THEN 'failed' ELSE 'paused' END,
           status_at = now(),
           retry_at = CASE WHEN q.attempts + 1 >= f.max_attempts THEN NULL
                           ELSE now() + make_interval(secs => f.delay * power(2, least(q.attempts, 40))) END
      FROM f
     WHERE q.workqueue_id = f.id AND q.workqueue_id IN (SELECT workqueue_id FROM mine)
       AND q.status = 'running' AND q.stage = f.stage AND q.claim = f.claim
    RETURNING q.workqueue_id, q.status, q.retry_at, jsonb_typeof(q.state) = 'object' AS stored
)
SELECT workqueue_id, status, extract(epoch FROM retry_at - now())::float8, stored FROM w
UNION ALL
SELECT q.workqueue_id, 'held', NULL, NULL FROM workqueue q JOIN f ON q.workqueue_id = f.id
 WHERE q.status = 'running' AND q.stage = f.stage AND q.claim = f.claim
   AND q.workqueue_id NOT IN (SELECT workqueue_id FROM mine)`

// resetSQL puts claimed rows back to pending, attempts unchanged: pipelined messages that
// never ran, and (reconcile.go) running rows that nobody holds. It returns the rows written
// and the held rows passed over. A running row without a claim token (claimed by a version
// before tokens) is guarded as token 0.
const resetSQL = `
WITH f AS (
    SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS f(id, stage, claim)
), mine AS (
    SELECT q.workqueue_id FROM workqueue q JOIN f ON q.workqueue_id = f.id
     WHERE q.status = 'running' AND q.stage = f.stage AND coalesce(q.claim, 0) = f.claim
       FOR NO KEY UPDATE OF q SKIP LOCKED
), w AS (
    UPDATE workqueue q SET status = 'pending', status_at = now()
      FROM f
     WHERE q.workqueue_id = f.id AND q.workqueue_id IN (SELECT workqueue_id FROM mine)
       AND q.status = 'running' AND q.stage = f.stage AND coalesce(q.claim, 0) = f.claim
    RETURNING q.workqueue_id
)
SELECT (SELECT count(*) FROM w),
       ARRAY(SELECT q.workqueue_id FROM workqueue q JOIN f ON q.workqueue_id = f.id
              WHERE q.status = 'running' AND q.stage = f.stage AND coalesce(q.claim, 0) = f.claim
                AND q.workqueue_id NOT IN (SELECT workqueue_id FROM mine))`

// retrySQL returns due paused rows to pending (whoever paused them: a failure or a stage's
// defer), and says in how many seconds the next one is due (dueAt).
//
// It locks what it picks and passes over the rows another transaction holds (SKIP LOCKED):
// it runs on the coordinator's loop, and waiting there for one row that an operator's open
// transaction holds stopped every claim, the flip cancelled at its budget and tried again,
// for as long as the lock lasted (TestRetryFlipRowLockedElsewhere). A held row stays paused
// and overdue; every claim reports the earliest paused retry_at, overdue ones included, and
// scheduleRetry tries such a row again a second after the flip that passed it over (the
// heartbeat's claim reports it when the pipeline is idle), so it is returned soon after its
// lock goes. Flips are rare (failures and defers), so the row lock before the update costs
// nothing that matters.
//
// Rows whose flip the database refused by itself ($1: flipRows) are left out; $2, when not
// NULL, flips that one row alone.
const retrySQL = `
WITH due AS (
    UPDATE workqueue w SET status = 'pending', retry_at = NULL, status_at = now()
     WHERE w.workqueue_id IN (SELECT p.workqueue_id FROM workqueue p
                               WHERE p.status = 'paused' AND p.retry_at <= now()
                                 AND p.workqueue_id <> ALL ($1::bigint[])
                                 AND ($2::bigint IS NULL OR p.workqueue_id = $2)
                                 FOR UPDATE SKIP LOCKED)
       AND w.status = 'paused'
    RETURNING 1
)
SELECT (SELECT count(*) FROM due),
       extract(epoch FROM (SELECT min(retry_at) FROM workqueue
                            WHERE status = 'paused' AND retry_at > now()) - now())::float8`

// failOutcome is what became of one failure write.
type failOutcome struct {
	id      int64
	status  string // "paused" or "failed"
	retryAt time.Time
	stored  bool // the reason is in state.dispatch_error (not when the state is no JSON object)
}

// reasonMaxBytes bounds a reason stored in state.dispatch_error (pepsi-worker(7)).
const reasonMaxBytes = 2000

// storableReason is reason as PostgreSQL takes it into jsonb: bytes that are not UTF-8 and
// NULs replaced by U+FFFD, then clipped to reasonMaxBytes. A worker's reason is its bytes
// (a Latin-1 message, a NUL from a C string; the two SDKs send UTF-8 without NUL, a stage in
// another language need not), and one that PostgreSQL refused failed the whole failure write
// at every retry of it, which stopped the whole dispatcher, as a state that is no JSON object
// did (failSQL).
func storableReason(reason string) string {
	reason = strings.ReplaceAll(strings.ToValidUTF8(reason, "\ufffd"), "\x00", "\ufffd")
	return clip(reason, reasonMaxBytes)
}

// asciiReason is reason with every character outside ASCII written as a \u or \U escape, for a
// database whose encoding (not UTF-8) has no place for one of them: PostgreSQL refuses the
// reason's conversion (untranslatable_character, 22P05), and the failure write with it, at
// every retry. ok is false when reason is ASCII already, or err is another refusal.
func asciiReason(reason string, err error) (string, bool) {
	var pe *pq.Error
	if !errors.As(err, &pe) || (pe.Code != "22P05" && pe.Code != "22021") {
		return reason, false
	}
	var b strings.Builder
	for _, r := range reason {
		switch {
		case r < utf8.RuneSelf:
			b.WriteRune(r)
		case r <= 0xFFFF:
			fmt.Fprintf(&b, "\\u%04X", r)
		default:
			fmt.Fprintf(&b, "\\U%08X", r)
		}
	}
	out := b.String()
	return out, out != reason
}

// writeFailures records fs in one statement. Rows whose claim is no longer ours are skipped by
// the guard and missing from both results; rows another transaction holds are in held.
func writeFailures(ctx context.Context, conn *sql.Conn, fs []failure) (out []failOutcome, held map[int64]bool, err error) {
	n := len(fs)
	ids, stages, claims, reasons := make([]int64, n), make([]string, n), make([]int64, n), make([]string, n)
	maxes, delays := make([]int64, n), make([]float64, n)
	for i, f := range fs {
		ids[i], stages[i], claims[i] = f.m.id, f.m.stage, f.m.claim
		reasons[i] = storableReason(f.reason)
		maxes[i], delays[i] = int64(f.maxAttempts), f.retryDelay.Seconds()
	}
	rows, err := conn.QueryContext(ctx, failSQL, pq.Array(ids), pq.Array(stages), pq.Array(claims),
		pq.Array(reasons), pq.Array(maxes), pq.Array(delays))
	if err != nil {
		return nil, nil, fmt.Errorf("record %d failures: %w", n, err)
	}
	defer rows.Close()
	for rows.Next() {
		var o failOutcome
		var in sql.NullFloat64
		var stored sql.NullBool
		if err := rows.Scan(&o.id, &o.status, &in, &stored); err != nil {
			return nil, nil, fmt.Errorf("record %d failures: %w", n, err)
		}
		if o.status == "held" {
			if held == nil {
				held = map[int64]bool{}
			}
			held[o.id] = true
			continue
		}
		if in.Valid {
			o.retryAt = dueAt(in.Float64)
		}
		o.stored = stored.Bool
		out = append(out, o)
	}
	if err := rows.Err(); err != nil {
		return nil, nil, fmt.Errorf("record %d failures: %w", n, err)
	}
	return out, held, nil
}

// writeResets puts ms back to pending; it returns how many rows were still ours and written,
// and the rows another transaction holds.
func writeResets(ctx context.Context, conn *sql.Conn, ms []*message) (written int64, held map[int64]bool, err error) {
	n := len(ms)
	ids, stages, claims := make([]int64, n), make([]string, n), make([]int64, n)
	for i, m := range ms {
		ids[i], stages[i], claims[i] = m.id, m.stage, m.claim
	}
	var heldIDs []int64
	if err := conn.QueryRowContext(ctx, resetSQL, pq.Array(ids), pq.Array(stages), pq.Array(claims)).
		Scan(&written, (*pq.Int64Array)(&heldIDs)); err != nil {
		return 0, nil, fmt.Errorf("reset %d messages to pending: %w", n, err)
	}
	for _, id := range heldIDs {
		if held == nil {
			held = map[int64]bool{}
		}
		held[id] = true
	}
	return written, held, nil
}

// resetRows is writeResets for the dispatcher's own resets (the loop's, the reconcile's, the
// start's, the shutdown's): when the database refuses the statement on a connection that still
// answers, it writes the rows one statement each (eachAlone), so that a refusal that is one
// row's (an application's trigger or CHECK on workqueue) keeps only that row running, in
// refused, and the others go back to pending. The statement of all of them refused again and
// again stopped every claim (the loop's and the reconcile's) or the start itself
// (TestResetRefusedAlone). Rows not tried by deadline (zero: no deadline) are in held, to be
// tried again with the rows another transaction holds; held is never nil when refused holds
// a row. It returns an error only when the connection or ctx is gone.
func resetRows(ctx context.Context, conn *sql.Conn, ms []*message, deadline time.Time) (
	written int64, held map[int64]bool, refused map[int64]error, err error) {
	written, held, err = writeResets(ctx, conn, ms)
	if !refusedAlive(ctx, conn, err) {
		return written, held, nil, err
	}
	written = 0
	held, refused, err = eachAlone(ctx, ms, deadline, func(m *message) *message { return m },
		func(one []*message) (map[int64]bool, error) {
			n, h, err := writeResets(ctx, conn, one)
			written += n
			return h, err
		})
	return written, held, refused, err
}

// failRows is writeFailures for the dispatcher's failures (the loop's, the shutdown's), as
// resetRows is for its resets: when the database refuses the statement on a connection that
// still answers, one statement each, the refused ones in refused and the rest written. The
// statement of all of them refused again and again stopped every stage
// (TestFailureWriteRefusedAlone) and, at shutdown, left every failure and every reset of the
// run running for the next start (TestAbortLeftoversRefusedAlone).
func failRows(ctx context.Context, conn *sql.Conn, fs []failure, deadline time.Time) (
	out []failOutcome, held map[int64]bool, refused map[int64]error, err error) {
	out, held, err = writeFailures(ctx, conn, fs)
	if !refusedAlive(ctx, conn, err) {
		return out, held, nil, err
	}
	out = nil
	held, refused, err = eachAlone(ctx, fs, deadline, func(f failure) *message { return f.m },
		func(one []failure) (map[int64]bool, error) {
			o, h, err := writeFailures(ctx, conn, one)
			out = append(out, o...)
			return h, err
		})
	return out, held, refused, err
}

// refusedAlive reports whether err, a write's, is the database refusing it on a connection
// that still answers (not an outage, not ctx's end): the refusal may be one row's.
func refusedAlive(ctx context.Context, conn *sql.Conn, err error) bool {
	return err != nil && !isOutage(err) && ctx.Err() == nil && conn.PingContext(ctx) == nil
}

// eachAlone writes each of items in a statement of its own (write) until deadline (zero: no
// deadline), after the database refused them in one: it returns the rows another transaction
// holds and those not tried by deadline (held, never nil; the latter with writeHeld set: no
// other transaction's lock, no "a write waits" line), and the rows whose own write the
// database refused, with why. It returns an error only when the connection or ctx is gone.
func eachAlone[T any](ctx context.Context, items []T, deadline time.Time, msg func(T) *message,
	write func(one []T) (map[int64]bool, error)) (held map[int64]bool, refused map[int64]error, err error) {
	held, refused = map[int64]bool{}, map[int64]error{}
	for _, it := range items {
		m := msg(it)
		if !deadline.IsZero() && time.Now().After(deadline) {
			held[m.id] = true
			m.writeHeld = true
			continue
		}
		h, err := write([]T{it})
		switch {
		case err != nil && (isOutage(err) || ctx.Err() != nil):
			return nil, nil, err
		case err != nil:
			refused[m.id] = err
		default:
			maps.Copy(held, h)
		}
	}
	return held, refused, nil
}

// flipDue returns due paused rows to pending, but those in skip; it reports how many, and the
// next due time.
func flipDue(ctx context.Context, conn *sql.Conn, skip []int64) (int64, time.Time, error) {
	var n int64
	var in sql.NullFloat64
	if err := conn.QueryRowContext(ctx, retrySQL, idList(skip), nil).Scan(&n, &in); err != nil {
		return 0, time.Time{}, fmt.Errorf("return due paused rows to pending: %w", err)
	}
	if !in.Valid {
		return n, time.Time{}, nil
	}
	return n, dueAt(in.Float64), nil
}

// dueAt is a due time the database gave as seconds from its now(), on our clock. The
// dispatcher's clock and the database's need not agree (another host, a VM's drift):
// retry_at is the database's time, and read as a time on ours it came due late by as much as
// the database's clock was ahead, every retry and every run_at (TestRetryDueOnDatabaseClock),
// and early, for a flip every second until the clocks agreed, when it was behind. Read as an
// interval, it is as late as the statement took to answer, never early. Times centuries away,
// either way (a stage's Defer of Go's zero time is in year 1), are held at a century: a
// time.Duration holds 292 years, and a float out of its range converts to whatever the
// machine makes of it.
func dueAt(seconds float64) time.Time {
	const far = 100 * 365 * 24 * time.Hour
	seconds = max(-far.Seconds(), min(seconds, far.Seconds()))
	return time.Now().Add(time.Duration(seconds * float64(time.Second)))
}

// dueSQL lists due paused rows, for a flip the database refused.
const dueSQL = `SELECT workqueue_id FROM workqueue WHERE status = 'paused' AND retry_at <= now()
    AND workqueue_id <> ALL ($1::bigint[]) ORDER BY retry_at, workqueue_id LIMIT 1000`

// flipRows is flipDue for one row at a time, after the database refused the flip of all of
// them on a connection that still answers: an application's trigger or CHECK on workqueue
// that refuses to put one row back to pending made the one statement fail at every retry,
// and since the loop flips before it claims, no stage claimed again
// (TestFlipRefusedAlone). It flips the due rows (those in ids, or when ids is nil the due
// rows not in skip) one statement each until deadline, and returns how many it flipped and
// the rows whose own flip the database refused. It returns an error only when the
// connection or ctx is gone.
func flipRows(ctx context.Context, conn *sql.Conn, ids, skip []int64, deadline time.Time) (
	flipped int64, refused map[int64]error, err error) {
	if ids == nil {
		rows, err := conn.QueryContext(ctx, dueSQL, idList(skip))
		if err != nil {
			return 0, nil, fmt.Errorf("list due paused rows: %w", err)
		}
		for rows.Next() {
			var id int64
			if err := rows.Scan(&id); err != nil {
				rows.Close()
				return 0, nil, fmt.Errorf("list due paused rows: %w", err)
			}
			ids = append(ids, id)
		}
		if err := rows.Close(); err != nil {
			return 0, nil, fmt.Errorf("list due paused rows: %w", err)
		}
	}
	refused = map[int64]error{}
	for _, id := range ids {
		if time.Now().After(deadline) {
			break // still due: the next flip, a second later (scheduleRetry)
		}
		var n int64
		var next sql.NullFloat64
		err := conn.QueryRowContext(ctx, retrySQL, idList(nil), id).Scan(&n, &next)
		switch {
		case err != nil && (isOutage(err) || ctx.Err() != nil):
			return flipped, refused, fmt.Errorf("return paused row %d to pending: %w", id, err)
		case err != nil:
			refused[id] = err
		default:
			flipped += n
		}
	}
	return flipped, refused, nil
}

// flip returns due paused rows to pending (retrySQL): all of them in one statement, but the
// rows whose own flip the database refused before, which are tried alone after it. When the
// database refuses the statement on a connection that still answers, the due rows are
// flipped one statement each (flipRows, at most refusedSplitBudget of the loop), and a row
// refused alone joins flipRefused, said once, while everything else goes on; it stays paused
// and due, so the claims report it and the flip comes back a second later (scheduleRetry).
// It returns an error only when the connection or the daemon's context is gone, or for a
// refusal on a connection that does not answer.
func (c *coordinator) flip() (n int64, next time.Time, err error) {
	ctx, cancel := c.budget()
	defer cancel()
	now := time.Now()
	c.lastFlip = now
	skip := slices.Sorted(maps.Keys(c.flipRefused))
	n, next, err = flipDue(ctx, c.inst.conn, skip)
	var refused map[int64]error
	switch {
	case err != nil && !c.refusedByDatabase(err):
		return 0, time.Time{}, err
	case err != nil:
		n, refused, err = flipRows(ctx, c.inst.conn, nil, skip, now.Add(refusedSplitBudget))
		next = now // the rows not tried, and the next due time: a second after this flip
	case len(skip) > 0:
		var m int64
		m, refused, err = flipRows(ctx, c.inst.conn, skip, nil, now.Add(refusedSplitBudget))
		n += m
		for _, id := range skip {
			if _, again := refused[id]; !again {
				delete(c.flipRefused, id) // flipped, or no longer a due paused row
			}
		}
	}
	for id, rerr := range refused {
		if c.flipRefused[id] {
			continue
		}
		if c.flipRefused == nil {
			c.flipRefused = map[int64]bool{}
		}
		c.flipRefused[id] = true
		c.sayRefused("the database refused this paused message's return to pending alone; tried again every second, claims go on",
			"id", id, "err", rerr)
	}
	return n, next, err
}
