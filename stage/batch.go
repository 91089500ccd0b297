// batch.go: the batch engine: one batch of ids in one (lazy) transaction, its bounds, the
// load of its rows, and each message's pass through its handler inside a savepoint of its own
// (conn.go takes the savepoints). Fused stages are fuse.go's, the writing of outcomes
// outcome.go's.
//
// It writes only the rows it was handed, and only under the guard status = 'running' AND
// stage = <the stage the row is running at in the transaction: the claimed one, or a fused one
// it moved the row to>; failures are the dispatcher's to record.

package stage

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/lib/pq"
)

const (
	// maxSubxids caps the savepoints a batch's transaction opens. Every savepoint that writes
	// takes a subtransaction XID, and PostgreSQL caches at most 64 of those per backend
	// (PGPROC_MAX_CACHED_SUBXIDS); past that the backend's snapshot entry overflows and every
	// snapshot in the cluster gets slower. A message's pass opens at most one savepoint per
	// stage it runs, so a batch takes no further message once the next one could overflow.
	maxSubxids = 64

	// maxBatch caps the ids read for one batch. Messages whose handlers leave Message.Tx
	// alone take no savepoint (their outcomes are written by one statement after the
	// transaction), so only this and maxBatchTime bound such a batch: a bigger batch costs
	// fewer statements per message. After a batch that wrote, a read takes only as many ids
	// as maxSubxids allows, so that the ids left over are not loaded twice. 500 rather than
	// the earlier 256: with QUEUE_LIMIT 1000 a worker has its next batch in its pipe while one
	// commits, and a no-op stage on 2 cores then ran W1 at 58-61k/s against 52k/s with 256
	// and QUEUE_LIMIT 512 (bench/pipeline, BENCHMARKS.md says how pepsi is set up there).
	maxBatch = 500

	// maxBatchTime is how long a batch takes new messages: its replies come after its last
	// message, and MAX_RUNTIME counts for the first from when the previous batch answered.
	maxBatchTime = 100 * time.Millisecond
)

// runBatch runs the messages of lines in one transaction (or none) and returns their status
// lines and the lines it left for the next batch (see runTx), or a fatal error (the connection
// is gone; nothing is to be written then: the dispatcher treats the exit as a crash and puts
// the rows back).
//
// The design, and its round trips. Commits are the expensive part (one WAL flush each), so the
// batch has one. Within it, a message's work must be undoable alone, which takes a savepoint
// (a subtransaction) — but only for a message that sends statements of its own. So:
//
//   - The savepoint is lazy: the connection wrapper opens it in front of the handler's first
//     statement on m.Tx (or in the same request as an outcome written at once).
//   - The outcome of a handler that has sent nothing when it chooses Advance, Done or Defer is
//     not written at once but kept, with the state as it was then; after the handler returns
//     nil it joins the batch's one outcome statement (see writeOutcomes), which runs after the
//     transaction. Such a message has nothing of its own to undo or to commit with, so it
//     needs no savepoint and no transaction. If the handler sends a statement after choosing,
//     its outcome is written in its savepoint when it returns.
//   - A fused stage (ServeStages) is one more link of the message's pass, with a lazy
//     savepoint of its own (nested in its predecessor's when that one is open), opened
//     together with the move of the row to its stage. An advance that leads to it is always
//     kept, so that it can be dropped when the fused stage succeeds and written when it fails.
//   - The transaction is lazy as well (conn.go): BEGIN goes out with the first savepoint. A
//     batch that needs none runs its load and its outcome statement as two statements of their
//     own, each atomic; nothing is held between them that a transaction would have held (the
//     load locks nothing, and READ COMMITTED gives each statement its own snapshot).
//   - So only the messages that write take savepoints, and the batch is bounded by those: it
//     takes no further message once the next could open more than maxSubxids. Messages that
//     do not write make batches of up to maxBatch; no batch takes messages past maxBatchTime.
//
// Requests per batch of N messages whose handlers leave m.Tx alone: the load and the outcome
// statement — 2, whatever N is and whatever they fuse. A handler that uses m.Tx adds one
// request for BEGIN (the first in the batch only) and its SAVEPOINT, its own statements, its
// outcome UPDATE, and the COMMIT at the end. A failed message that wrote adds a ROLLBACK TO.
// Writing every outcome at once in its own savepoint (the simple way) would cost N + 3
// requests, N statements to parse and plan, and N subtransaction XIDs per batch.
func (s *server) runBatch(ctx context.Context, lines []string) (out []byte, rest []string, err error) {
	replies, ids := parseLines(lines)
	if len(ids) == 0 {
		return formatReplies(replies), nil, nil
	}
	// A batch whose transaction ends in a serialization failure or a deadlock committed
	// nothing, and runs again from the start (transient.go): its handlers once more, each
	// message's reply as the lines make it.
	var ran int
	for try := 1; ; try++ {
		ran, err = s.runTx(ctx, replies, ids)
		if err == nil || !isTransient(err) || try == transientTries || s.sess.lost() || !againAfter(ctx, try+1) {
			break
		}
		if s.transientBatches++; isPowerOfTen(s.transientBatches) {
			s.log.Warn("batch ended in a serialization failure or a deadlock before it committed; running it again",
				"batches_run_again", s.transientBatches, "error", err)
		}
		replies, _ = parseLines(lines)
	}
	if err != nil {
		if ctx.Err() != nil {
			return nil, nil, fmt.Errorf("run batch of %d ids: %w", len(ids), ctx.Err())
		}
		if errors.Is(err, ErrConnectionLost) || errors.Is(err, errTxOwned) {
			return nil, nil, fmt.Errorf("run batch of %d ids: %w", len(ids), err)
		}
		if s.sess.lost() {
			return nil, nil, fmt.Errorf("run batch of %d ids: %w (%w)", len(ids), err, ErrConnectionLost)
		}
		// The transaction is gone with everything in it: every message it ran fails,
		// including those whose handler succeeded.
		for i := range replies[:ran] {
			if !replies[i].done { // a failure already decided keeps its own reason
				replies[i].fail(err.Error())
			}
		}
	}
	return formatReplies(replies[:ran]), lines[ran:], nil
}

// parseLines makes a batch's replies from its id lines, a bad line's failed already, and
// returns the ids of the others, in order.
func parseLines(lines []string) ([]reply, []int64) {
	replies := make([]reply, len(lines))
	ids := make([]int64, 0, len(lines))
	for i, line := range lines {
		id, ok := parseID(line)
		if !ok {
			replies[i].fail(fmt.Sprintf("bad message id %q: want a decimal number", line))
			continue
		}
		replies[i].id = id
		ids = append(ids, id)
	}
	return replies, ids
}

// runTx is one batch: the load, the messages of replies in order, the transaction's COMMIT if
// a handler began one, then the kept outcomes in one statement of their own. It fills
// replies[:ran]; the messages after those are for the next batch: the next one could have
// taken more savepoints than maxSubxids allows, or the batch had run for batchTime.
//
// An error means that the transaction was rolled back (or is lost) and every message run
// fails with it; nothing of the batch is written then, because the kept outcomes come last,
// after the COMMIT, and fail only their own messages (or end the process, should the
// connection break).
func (s *server) runTx(ctx context.Context, replies []reply, ids []int64) (ran int, err error) {
	start := time.Now()
	ran = len(replies)
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return ran, fmt.Errorf("begin batch transaction: %w", err)
	}
	s.sess.beginTx()
	defer func() {
		if err != nil {
			// The error that ended the batch is the one to report; a failed rollback only
			// matters when the connection is gone, which sess.lost() tells the caller.
			tx.Rollback()
		}
	}()
	rows, err := s.loadRows(ctx, tx, ids)
	if err != nil {
		return ran, err
	}
	var kept []keptOutcome
	perPass := 1 + len(s.views) // savepoints a message's pass may open
	for i := range replies {
		r := &replies[i]
		if r.done {
			continue
		}
		if i > 0 && (s.sess.savepointsOpened()+perPass > maxSubxids || time.Since(start) >= s.batchTime) {
			ran = i
			break
		}
		row, ok := rows[r.id]
		if !ok {
			r.fail(fmt.Sprintf("message %d is not running at stage %s (claim lost)", r.id, s.cfg.Stage))
			continue
		}
		delete(rows, r.id) // the same id twice in a batch finds its claim taken the second time
		final, fused, reason, err := s.runMessage(ctx, tx, i, row)
		if err != nil {
			return ran, err
		}
		if reason != "" {
			r.fail(reason)
			continue
		}
		r.ok, r.final, r.fused = true, final, fused // unless the outcome statement finds the claim gone
		if final.kept != nil {
			kept = append(kept, keptOutcome{index: i, m: final})
		}
	}
	s.wrote = s.sess.began()
	if err := tx.Commit(); err != nil {
		return ran, fmt.Errorf("commit batch transaction: %w", err)
	}
	if len(kept) > 0 {
		if err := s.writeOutcomes(ctx, kept, replies); err != nil {
			// Only a lost connection or the end of ctx gets here (any other failure fails its
			// messages): the process ends without replies, and the dispatcher recovers the
			// rows whose outcomes it does not find written.
			if ctx.Err() == nil {
				err = fmt.Errorf("%w (%w)", err, ErrConnectionLost)
			}
			return ran, fmt.Errorf("write %d outcomes: %w", len(kept), err)
		}
	}
	return ran, nil
}

// loadStatement is the batch's load: the rows of ids running at stage. Like outcomeStatement
// (outcome.go), it carries its values as literals in one simple-protocol request, so that it
// is planned for this batch, as one round trip. It used to be prepared once per connection:
// a prepared statement's plan goes generic after five executions, made for the table as it
// was then, and a queue table's statistics always lag, so a worker started on a small queue
// kept a plan that scanned the grown table at every batch until the next ANALYZE (the query
// under PREPARE in psql: a Seq Scan after 100,000 inserts into a table analyzed at 100 rows;
// TestLoadUnprepared). Planning takes 0.1-0.2 ms for 500 ids (EXPLAIN ANALYZE, a warm
// session). The stage name is checked against [a-z0-9_-]+ (LoadConfig) and quoted anyway.
//
// A batch of one id, which is every batch of a stage that receives a message at a time, says
// workqueue_id = id: the planner settles an equality on the primary key sooner than a one-element
// ANY, 0.05 ms against 0.13 ms (PostgreSQL 15, the mean of 30 EXPLAIN ANALYZE of each, warm),
// and a lone message waits for the whole of it (bench/pipeline W3).
func loadStatement(ids []int64, stage string) string {
	const cols = `SELECT workqueue_id, attempts, payload, state FROM workqueue WHERE workqueue_id `
	guard := ` AND status = 'running' AND stage = ` + pq.QuoteLiteral(stage)
	if len(ids) == 1 {
		return cols + `= ` + strconv.FormatInt(ids[0], 10) + guard
	}
	idList := arrayLiteral(len(ids), func(b []byte, i int) []byte { return strconv.AppendInt(b, ids[i], 10) })
	return cols + `= ANY (` + idList + `::bigint[])` + guard
}

// loadedRow is a message's row as loaded at the start of the batch.
type loadedRow struct {
	id       int64
	attempts int
	payload  []byte
	state    []byte
}

// loadRows loads the rows of ids that are running at this stage, in one query.
func (s *server) loadRows(ctx context.Context, tx *sql.Tx, ids []int64) (map[int64]loadedRow, error) {
	rs, err := tx.QueryContext(ctx, loadStatement(ids, s.cfg.Stage))
	if err != nil {
		return nil, fmt.Errorf("load messages: %w", err)
	}
	defer rs.Close()
	rows := make(map[int64]loadedRow, len(ids))
	for rs.Next() {
		var r loadedRow
		if err := rs.Scan(&r.id, &r.attempts, &r.payload, &r.state); err != nil {
			return nil, fmt.Errorf("load messages: scan: %w", err)
		}
		rows[r.id] = r
	}
	if err := rs.Err(); err != nil {
		return nil, fmt.Errorf("load messages: %w", err)
	}
	return rows, nil
}

// runMessage runs one loaded row's pass: the handler of the claimed stage, inside its own
// (lazy) savepoint, and the fused stages its advance leads to. It returns the message whose
// outcome stands (written, or kept for the outcome statement), the fused stages that
// succeeded, and the reason the message failed ("" for success), or an error that ends the
// batch.
func (s *server) runMessage(ctx context.Context, tx *sql.Tx, index int, row loadedRow) (
	final *Message, fused []*Message, reason string, err error) {
	m := &Message{
		ID:       row.id,
		Stage:    s.cfg.Stage,
		Attempts: row.attempts,
		Tx:       tx,
		ctx:      ctx,
		srv:      s,
		live:     true,
		link:     link{index: index, chain: []string{s.cfg.Stage}, at: s.cfg.Stage},
	}
	if row.payload != nil {
		m.Payload = json.RawMessage(row.payload)
	}
	if m.State, err = decodeState(row.state); err != nil {
		// A state that is not an object is nothing the handler could work with; its outcome
		// would overwrite it. Fail the message and let an operator look.
		return m, nil, fmt.Sprintf("message %d: %v", row.id, err), nil
	}
	m.stateEmpty = string(row.state) == "{}"
	s.sess.setLink(spLink{name: "pepsi_msg_" + strconv.Itoa(index)})
	return s.runLink(ctx, tx, m)
}

// runLink runs m's handler, in the savepoint context the caller has set (the session's link),
// and settles its outcome: a fused stage runs next (runFused), or the outcome is written at
// once when the pass has written anything, or it stays kept for the outcome statement. A
// failure rolls back m's savepoint. It returns what runMessage does, for the pass from m on.
func (s *server) runLink(ctx context.Context, tx *sql.Tx, m *Message) (
	final *Message, fused []*Message, reason string, err error) {
	s.sess.handlerRunning(true)
	start := time.Now()
	herr := m.srv.callHandler(ctx, m)
	m.link.took = time.Since(start)
	s.sess.handlerRunning(false)
	m.live = false

	if s.sess.txOwnedViolation() {
		return m, nil, "", fmt.Errorf("message %d: %w", m.ID, errTxOwned)
	}
	if err := s.sess.brokenErr(); err != nil {
		return m, nil, "", err
	}
	switch {
	case herr != nil:
		reason = herr.Error()
	case m.writeErr != nil:
		reason = fmt.Sprintf("handler returned nil after its outcome failed: %v", m.writeErr)
	case m.second != "":
		reason = fmt.Sprintf("handler chose more than one outcome (%s, then %s)", m.chosen, m.second)
	case m.chosen == "":
		reason = "handler returned without choosing an outcome (" + outcomeMethods() + "); the row would stay running"
	}
	if reason == "" && m.kept != nil && m.fusable(m.kept.change) {
		f, fz, err := s.runFused(ctx, tx, m)
		if err != nil {
			return m, nil, "", err
		}
		if f != nil {
			if m.link.prev != nil {
				fz = append([]*Message{m}, fz...)
			}
			return f, fz, "", nil
		}
		// The fused stage failed and is undone: the advance to it stands, settled below.
	}
	if reason == "" && m.kept != nil && (m.link.nested || s.sess.isOpen()) {
		// The pass has written: the outcome goes with the writes, in this stage's savepoint
		// (which the UPDATE's request opens if need be, moving a fused stage's row first).
		k := m.kept
		m.kept = nil
		if err := m.update(ctx, tx, k.change, k.state, m.Stage); err != nil {
			reason = err.Error()
		}
	}
	if reason != "" {
		m.kept = nil
		if err := s.sess.rollbackMessage(ctx, tx); err != nil {
			return m, nil, "", err
		}
		return m, nil, reason, nil
	}
	if m.link.prev != nil {
		fused = []*Message{m}
	}
	return m, fused, "", nil
}

// callHandler runs the handler, turning a panic into a failure of the message.
func (s *server) callHandler(ctx context.Context, m *Message) (err error) {
	defer func() {
		if p := recover(); p != nil {
			s.log.Error("handler panicked", "message", m.ID, "panic", fmt.Sprint(p), "stack", string(debug.Stack()))
			err = fmt.Errorf("handler panicked: %v", p)
		}
	}()
	return s.h(ctx, m)
}

// decodeState decodes a state column. Numbers stay json.Number so that large integers survive
// the round trip unchanged.
func decodeState(raw []byte) (map[string]any, error) {
	state := map[string]any{}
	if len(raw) == 0 || string(raw) == "{}" { // the column's default, and most rows': no decoder
		return state, nil
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	if err := dec.Decode(&state); err != nil {
		return nil, fmt.Errorf("decode state %.100s: %w", raw, err)
	}
	if state == nil { // JSON null
		state = map[string]any{}
	}
	return state, nil
}

// parseID reads a line of standard input as a message id: ASCII decimal digits (leading zeros
// allowed), at most 2^63-1, with ASCII white space around them ignored (the CR of a line
// ended CRLF, a space typed by hand). Anything else, a sign or a Unicode digit or space
// included, is no id and gets "bad message id". The Python SDK's _parse_id has the same rule
// (ids_python_test.go holds the two to each other); pepsi-worker(7) gives it.
func parseID(line string) (int64, bool) {
	s := strings.Trim(line, " \t\r\v\f")
	if s == "" {
		return 0, false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return 0, false
		}
	}
	id, err := strconv.ParseInt(s, 10, 64)
	return id, err == nil
}
