// outcome.go: the writing of outcomes: the guarded UPDATE of one outcome (at once, inside the
// message's savepoint), and the batch's one outcome statement for the outcomes kept until after
// the transaction. What an outcome writes is chosen in message.go.
//
// Every statement here changes only rows running at the guard stage (status = 'running' AND
// stage = guard), and their statements and round trips are what TestRoundTrips and
// TestOutcomePlan measure: change them only with those tests' figures.

package stage

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strconv"

	"github.com/lib/pq"
)

// change is what an outcome of the Message API (Advance, Done, Defer) sets besides the state.
type change struct {
	kind    *outcomeKind // the status it writes, and how the pass treats it
	what    string       // for reasons: "advance to b", "done", "defer until …"
	stage   string       // "" keeps the stage
	retryAt string       // a timestamptz in text, "" keeps retry_at
	// retryIn: retry_at is the server's now() plus this many seconds (DeferFor), whatever the
	// worker's clock says.
	retryIn sql.NullFloat64
}

// keptChange is an outcome chosen before the handler sent any statement, with the state as it
// was when it was chosen.
type keptChange struct {
	change change
	state  []byte
	// same: the state is the row's own, an empty object loaded and left empty, so the outcome
	// statement need not send it (NULL: keep the column). A no-op stage's outcome then costs
	// the server no jsonb parse (about 6 % of the machine's CPU in the W1 benchmark).
	same bool
}

// keptOutcome is a message whose outcome waits for the batch's outcome statement.
type keptOutcome struct {
	index int // in the batch's replies
	m     *Message
}

// execer is a transaction, or the database for a statement of its own.
type execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// update writes one outcome: the guarded UPDATE, sent as one simple-protocol request together
// with the savepoint when it is not open yet. Hence the literals: a parameterised statement
// needs the extended protocol, which cannot carry two statements. The values are an integer,
// stage names checked against [a-z0-9_-]+, a timestamp and the state's JSON, each quoted by
// pq.QuoteLiteral (the E'...' form when there are backslashes, so that the quoting does not
// depend on standard_conforming_strings).
//
// guard is the stage the row is running at in the transaction: m.Stage inside the message's
// own savepoint (a fused stage's savepoint moves the row there), the claimed stage for an
// outcome kept until the end of the batch.
func (m *Message) update(ctx context.Context, on execer, c change, state []byte, guard string) error {
	// Every writer of a status sets status_at in the same UPDATE (operate.sql says why it is
	// not a trigger's job).
	set := "status = " + pq.QuoteLiteral(c.kind.status) + ", status_at = now()"
	if c.stage != "" {
		// An advance resets attempts: MAX_ATTEMPTS counts failures at one stage.
		set += ", stage = " + pq.QuoteLiteral(c.stage) + ", attempts = 0"
	}
	if c.retryAt != "" {
		set += ", retry_at = " + pq.QuoteLiteral(c.retryAt) + "::timestamptz"
	}
	if c.retryIn.Valid {
		set += ", retry_at = now() + make_interval(secs => " + strconv.FormatFloat(c.retryIn.Float64, 'g', -1, 64) + ")"
	}
	q := m.srv.sess.savepointPrefix() +
		"UPDATE workqueue SET " + set + ", state = " + pq.QuoteLiteral(string(state)) + "::jsonb" +
		" WHERE workqueue_id = " + strconv.FormatInt(m.ID, 10) +
		" AND status = 'running' AND stage = " + pq.QuoteLiteral(guard)
	res, err := on.ExecContext(ctx, q)
	if err != nil {
		return fmt.Errorf("%s message %d: %w", c.what, m.ID, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return fmt.Errorf("%s message %d: rows affected: %w", c.what, m.ID, err)
	}
	if n == 0 {
		return fmt.Errorf("%s message %d: row is no longer running at stage %s: %w",
			c.what, m.ID, guard, ErrClaimLost)
	}
	return nil
}

// outcomeStatement is the statement that writes a batch's kept outcomes, one array element per
// message: ids, the stages they advance to (NULL: they stay), statuses, retry_at (NULL:
// unchanged, unless retryIns gives seconds from the server's now()), states (NULL:
// unchanged); guard is the claimed stage. An advance resets
// attempts: MAX_ATTEMPTS counts failures at one stage, not across them.
//
// Its shape is for the planner. The rows are found by primary key only (= ANY ids), and matched
// to their values by a hash join. The guard is compared in a join with a one-row subquery
// behind OFFSET 0, so that the planner does not estimate the running rows from the column
// statistics: those were taken while the rows were pending, and say "1 row". With the guard in
// the WHERE clause and a batch of 256, a plan that took that 1 row at its word scanned the
// whole table and compared each running row with every element (179 ms instead of 3 ms for
// 256 outcomes with 2,048 rows running in a table of 33,000).
//
// And the arrays are literals, sent as one simple-protocol request: the planner then knows
// their lengths and plans the statement for this batch. A prepared statement's generic plan
// guesses 10 elements, and on a table of 1.2 million rows chose to compare every row with
// every element (65,280 comparisons for 256 outcomes). Planning costs about 1 ms per batch,
// 4 µs per outcome. TestOutcomePlan checks the plans.
func outcomeStatement(ids []int64, stages []sql.NullString, statuses []string, retryAts []sql.NullString,
	retryIns []sql.NullFloat64, states []sql.NullString, guard string) string {
	idList := arrayLiteral(len(ids), func(b []byte, i int) []byte { return strconv.AppendInt(b, ids[i], 10) })
	// A batch without DeferFor, the common one, sends no retry_in column: a no-op stage's
	// statement stays as short as before it existed.
	retry, retryIn, columns := `coalesce(v.retry_at, w.retry_at)`, ``, `v (id, stage, status, retry_at, state)`
	if slices.ContainsFunc(retryIns, func(f sql.NullFloat64) bool { return f.Valid }) {
		retry = `coalesce(v.retry_at, now() + make_interval(secs => v.retry_in), w.retry_at)`
		retryIn = nullFloats(retryIns) + `::float8[], `
		columns = `v (id, stage, status, retry_at, retry_in, state)`
	}
	return `UPDATE workqueue AS w SET stage = coalesce(v.stage, w.stage), status = v.status,
       attempts = CASE WHEN v.stage IS NULL THEN w.attempts ELSE 0 END,
       retry_at = ` + retry + `, state = coalesce(v.state, w.state), status_at = now()
  FROM unnest(` + idList + `::bigint[], ` + nullStrings(stages) + `::text[], ` +
		arrayLiteral(len(statuses), func(b []byte, i int) []byte { return appendArrayString(b, statuses[i]) }) + `::text[], ` +
		nullStrings(retryAts) + `::timestamptz[], ` + retryIn + nullStrings(states) + `::jsonb[])
       AS ` + columns + `,
       (SELECT 'running'::text AS status, ` + pq.QuoteLiteral(guard) + `::text AS stage OFFSET 0) AS guard
 WHERE w.workqueue_id = ANY (` + idList + `::bigint[]) AND w.workqueue_id = v.id
   AND w.status = guard.status AND w.stage = guard.stage
RETURNING w.workqueue_id`
}

// arrayLiteral is the SQL string literal of a PostgreSQL array's text form with n elements,
// each appended by elem. It is written by hand rather than with lib/pq's GenericArray, whose
// reflection was about 5 % of a no-op worker's CPU in the W1 benchmark (perf).
func arrayLiteral(n int, elem func(b []byte, i int) []byte) string {
	b := make([]byte, 0, 2+n*8)
	b = append(b, '{')
	for i := 0; i < n; i++ {
		if i > 0 {
			b = append(b, ',')
		}
		b = elem(b, i)
	}
	b = append(b, '}')
	return pq.QuoteLiteral(string(b))
}

// nullStrings is arrayLiteral of nullable text elements (NULL for the invalid ones).
func nullStrings(v []sql.NullString) string {
	return arrayLiteral(len(v), func(b []byte, i int) []byte {
		if !v[i].Valid {
			return append(b, "NULL"...)
		}
		return appendArrayString(b, v[i].String)
	})
}

// nullFloats is nullStrings for numbers.
func nullFloats(v []sql.NullFloat64) string {
	return arrayLiteral(len(v), func(b []byte, i int) []byte {
		if !v[i].Valid {
			return append(b, "NULL"...)
		}
		return strconv.AppendFloat(b, v[i].Float64, 'g', -1, 64)
	})
}

// appendArrayString appends s as a quoted array element: double quotes around it, and a
// backslash before each double quote and backslash in it (the array input syntax).
func appendArrayString(b []byte, s string) []byte {
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		if s[i] == '"' || s[i] == '\\' {
			b = append(b, '\\')
		}
		b = append(b, s[i])
	}
	return append(b, '"')
}

// writeOutcomes writes the kept outcomes in one statement (outcomeStatement), each row under the
// same guard as a single outcome, and fails the messages whose row it did not find. It runs
// after the batch's transaction, alone: a kept outcome has nothing to commit with (no stage of
// its pass wrote), and outside the transaction it takes no savepoint, so that the savepoints of
// the messages that write are all that maxSubxids has to count. Should the statement fail (say
// one state that jsonb rejects), nothing of it is written, and the outcomes are written one by
// one, so that one bad message fails alone. A kept outcome is that of the last stage of its
// pass; every row is still running at the claimed stage, which is the guard. One by one, an
// outcome of a fused stage that is refused for another reason than a lost claim falls back to
// the advance that led to that stage, as a failure of the fused stage's handler does.
//
// It returns an error only when the connection is lost or ctx is done.
func (s *server) writeOutcomes(ctx context.Context, kept []keptOutcome, replies []reply) error {
	s.sess.setLink(spLink{}) // no savepoint: there is no transaction
	if len(kept) == 1 {
		// One outcome: no list to parse and plan.
		return s.writeOutcome(ctx, kept[0], &replies[kept[0].index])
	}
	ids := make([]int64, len(kept))
	stages := make([]sql.NullString, len(kept))
	statuses := make([]string, len(kept))
	retryAts := make([]sql.NullString, len(kept))
	retryIns := make([]sql.NullFloat64, len(kept))
	states := make([]sql.NullString, len(kept))
	for i, k := range kept {
		c := k.m.kept.change
		ids[i] = k.m.ID
		stages[i] = sql.NullString{String: c.stage, Valid: c.stage != ""}
		statuses[i] = c.kind.status
		retryAts[i] = sql.NullString{String: c.retryAt, Valid: c.retryAt != ""}
		retryIns[i] = c.retryIn
		states[i] = sql.NullString{String: string(k.m.kept.state), Valid: !k.m.kept.same}
	}
	q := outcomeStatement(ids, stages, statuses, retryAts, retryIns, states, s.cfg.Stage)
	var written map[int64]bool
	err := againIfTransient(ctx, func() (err error) {
		written, err = queryIDs(ctx, s.db, q)
		return err
	})
	if err != nil {
		if s.sess.lost() || ctx.Err() != nil {
			return err
		}
		s.log.Warn("outcome statement failed; writing the outcomes one by one", "outcomes", len(kept), "error", err)
		for _, k := range kept {
			if err := s.writeOutcome(ctx, k, &replies[k.index]); err != nil {
				return err
			}
		}
		return nil
	}
	for _, k := range kept {
		if !written[k.m.ID] {
			replies[k.index].fail(fmt.Sprintf("%s message %d: row is no longer running at stage %s (claim lost)",
				k.m.kept.change.what, k.m.ID, s.cfg.Stage))
		}
	}
	return nil
}

// writeOutcome writes one kept outcome alone, falling back along the pass to the advance that
// led to a fused stage whose outcome is refused. It returns an error only when the connection
// is lost or ctx is done.
func (s *server) writeOutcome(ctx context.Context, k keptOutcome, r *reply) error {
	for m := k.m; ; m = m.link.prev {
		err := againIfTransient(ctx, func() error {
			return m.update(ctx, s.db, m.kept.change, m.kept.state, s.cfg.Stage)
		})
		if err == nil {
			r.fallBackTo(m)
			return nil
		}
		if s.sess.lost() || ctx.Err() != nil {
			return err
		}
		if m.link.prev == nil || errors.Is(err, ErrClaimLost) {
			r.fail(err.Error())
			return nil
		}
		m.srv.noteFailure(m.ID, err.Error())
	}
}

// queryIDs runs a statement returning one bigint column and returns the set of its values.
func queryIDs(ctx context.Context, db *sql.DB, q string) (map[int64]bool, error) {
	rs, err := db.QueryContext(ctx, q)
	if err != nil {
		return nil, err
	}
	defer rs.Close()
	ids := map[int64]bool{}
	for rs.Next() {
		var id int64
		if err := rs.Scan(&id); err != nil {
			return nil, err
		}
		ids[id] = true
	}
	return ids, rs.Err()
}
