// message.go: the Message API: what a handler is given, and the outcomes it chooses (Advance,
// Done, Defer; fan-out's Split in fanout.go), each recorded through one door, outcomeNamed,
// and the table of outcome kinds (outcomeKinds) that the rest of the package consults: a new
// outcome starts here.
//
// It sends no statement of its own: an outcome is written by outcome.go, at once or at the
// end of the batch. choose decides which; batch.go's runLink writes a kept outcome at once
// after all when the handler went on to use Message.Tx.

package stage

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"
)

// Handler processes one message. It chooses exactly one outcome (Advance, Done or Defer; or
// Split or SplitRange for a fan-out, or leaves it to Paginate) and returns nil. Anything else
// (an error, a panic, no outcome, two outcomes, an outcome that failed) fails the message: its
// status line reports the reason, which the dispatcher records in state.dispatch_error, and
// everything the handler wrote in m.Tx is rolled back; the other messages of the batch are not
// affected. ctx is the one given to Serve (Run's never ends): pass it to m.Tx's queries.
//
// Handlers run one at a time, in the order of the ids, on Serve's goroutine; a fused stage's
// handler runs right after the handler whose advance led to it (see ServeStages). A handler
// must not keep m, or use it from another goroutine, after it returns.
type Handler func(ctx context.Context, m *Message) error

// Message is one message handed to the handler: its row as it was when the batch began, and
// the transaction its outcome commits in. It is valid while its handler runs, and its methods
// are not safe for concurrent use (m.Tx is, as any *sql.Tx).
type Message struct {
	// ID is the row's workqueue_id.
	ID int64

	// Stage is the stage running it: Config.Stage, or a fused stage run in the same pass
	// (ServeStages), whose handler sees the row running at this stage.
	Stage string

	// Attempts counts the failed attempts so far (the dispatcher increments it on failure);
	// 0 at a fused stage, which the message has just reached.
	Attempts int

	// Payload is the row's payload, set at enqueue and never changed by pepsi; nil for NULL.
	Payload json.RawMessage

	// State is the row's state jsonb, decoded (numbers as json.Number). The handler changes it
	// freely; the outcome writes it back, in the same UPDATE. Changes made after the outcome
	// was chosen are not written. The dispatcher owns the key "dispatch_error". At a fused
	// stage it is the state that the advance leading there chose. A state that was the empty
	// object and is still empty when the outcome is chosen is not written (the column keeps
	// what it holds), which spares the server a jsonb parse for stages that use no state.
	State map[string]any

	// Tx is the transaction the outcome commits in. The handler may use it for its own writes:
	// they commit with the outcome, and a failure of the message rolls them back (a savepoint
	// is taken before its first statement). The handler must not Commit or Roll it back, must
	// close the rows it opens before returning, and must not cancel the context of a query on
	// it (lib/pq closes the connection to cancel a query, which ends the process). Commit or
	// Rollback return an error, and the SDK then ends Serve with an error too: the batch's
	// transaction can no longer be trusted.
	Tx *sql.Tx

	ctx context.Context
	srv *server

	// Set by Serve's goroutine before and after the handler runs; used by the handler's
	// goroutine in between. A Message's methods are not safe for concurrent use.
	live     bool         // the handler is running: an outcome may be chosen
	chosen   string       // the outcome chosen, "" while none
	kind     *outcomeKind // the kind of the outcome chosen; nil for none, or for one of fanout.go
	second   string       // a further outcome attempted
	writeErr error        // the chosen outcome's write failed
	kept     *keptChange  // an outcome waiting for the batch's outcome statement
	// stateEmpty: the row's state column was an empty object when the batch loaded it (at
	// the claimed stage only; a fused stage's state comes from the advance before it).
	stateEmpty bool
	link       link // the message's place in its pass (stage fusion)
}

// outcomeKind is one kind of outcome that a handler chooses through the Message API (besides
// the fan-out outcomes of fanout.go, which write through SQL functions of their own): what it
// sets in the row besides the state, and what the status line says of a pass that ends in it.
// The batch engine, fusion, the writers of outcome.go and the status lines consult only this
// (and change, which carries it), never an outcome's name. So a new outcome that sets the
// status, the stage and retry_at is a row here and a method like Done that calls choose; one
// that sets another column adds that column to change, update and outcomeStatement
// (outcome.go), and a row to TestOutcomePlan.
type outcomeKind struct {
	method  string // the Message method that chooses it, for the reason of a handler that chose none
	status  string // the status the row gets
	advance bool   // it moves the row to another stage (change.stage), which may run in the same pass (fuse.go)
	word    string // the status line's word for a pass that ends in it (doc.go), "" for none
}

var (
	advanceKind = &outcomeKind{method: "Advance", status: "pending", advance: true}
	doneKind    = &outcomeKind{method: "Done", status: "done", word: "done"}
	deferKind   = &outcomeKind{method: "Defer", status: "paused"}

	// outcomeKinds lists every kind, in the order the documentation names them.
	outcomeKinds = []*outcomeKind{advanceKind, doneKind, deferKind}
)

// outcomeMethods names the methods of outcomeKinds for a reason: "Advance, Done or Defer".
func outcomeMethods() string {
	names := make([]string, len(outcomeKinds))
	for i, k := range outcomeKinds {
		names[i] = k.method
	}
	if len(names) < 2 {
		return strings.Join(names, "")
	}
	return strings.Join(names[:len(names)-1], ", ") + " or " + names[len(names)-1]
}

// Advance moves the message to stage next, which must be one of the stage's NEXT stages:
// stage = next, status = 'pending', and the state, in one UPDATE guarded by the claim.
//
// It returns an error for a stage not in NEXT, a second outcome, or a failed write. When the
// handler has not used m.Tx yet, the write waits for the end of the batch (see the package
// documentation), and a claim found lost then fails the message after the handler returned;
// either way the state written is the state as it was when Advance was called. An advance to
// a stage that this program fuses (ServeStages) always waits: that stage's handler runs after
// this one returns, and the advance is written only if it fails.
func (m *Message) Advance(next string) error {
	if !slices.Contains(m.srv.cfg.Next, next) {
		return fmt.Errorf("advance message %d to %q: %w (NEXT of %s: %q)",
			m.ID, next, ErrNotNext, m.Stage, strings.Join(m.srv.cfg.Next, " "))
	}
	return m.choose(change{kind: advanceKind, what: "advance to " + next, stage: next})
}

// Done finishes the message: status = 'done', and the state, in one UPDATE guarded by the
// claim (at a fused stage, stage = that stage too). Errors and timing as for Advance.
func (m *Message) Done() error {
	return m.choose(change{kind: doneKind, what: "done"})
}

// Defer pauses the message until the given time: status = 'paused', retry_at = until, and the
// state, in one UPDATE guarded by the claim. The dispatcher puts it back to pending at this
// stage when it is due (at a fused stage, stage = that stage too: it runs there again). A
// deferral is not a failure: attempts is unchanged. Errors and timing as for Advance.
func (m *Message) Defer(until time.Time) error {
	return m.choose(change{
		kind:    deferKind,
		what:    "defer until " + until.Format(time.RFC3339),
		retryAt: until.UTC().Format("2006-01-02 15:04:05.999999Z07:00"),
	})
}

// DeferFor is Defer for a delay counted from the database server's now(), as RETRY_DELAY is:
// retry_at = now() + d, in the server's own terms. Defer's time is judged by the server's
// clock, which need not agree with the worker's (another host, a VM that drifted): a
// Defer(time.Now().Add(d)) on a worker whose clock is ahead of the server's by more than d
// waits that much longer, and on one behind it by more than d is due at once. d may be 0:
// pending again at once.
func (m *Message) DeferFor(d time.Duration) error {
	return m.choose(change{
		kind:    deferKind,
		what:    "defer for " + d.String(),
		retryIn: sql.NullFloat64{Float64: d.Seconds(), Valid: true},
	})
}

// choose is Advance, Done and Defer: the outcome is written at once when the message's
// savepoint is open (the handler has used m.Tx), and kept for the batch's outcome statement
// (or for the fused stage it advances to) otherwise.
func (m *Message) choose(c change) error {
	if m.link.prev != nil && c.stage == "" {
		// The row was claimed at another stage: a fused stage's done or defer names its own.
		c.stage = m.Stage
	}
	return m.outcomeNamed(m.ctx, c.what, func(tx *sql.Tx) error {
		m.kind = c.kind
		state, err := m.stateJSON()
		if err != nil {
			return fmt.Errorf("%s message %d: encode state: %w", c.what, m.ID, err)
		}
		if !m.srv.sess.isOpen() || m.fusable(c) {
			m.kept = &keptChange{change: c, state: state, same: m.stateEmpty && len(m.State) == 0}
			return nil
		}
		return m.update(m.ctx, tx, c, state, m.Stage)
	})
}

// outcome records that the handler chose an outcome and runs write in m.Tx; it fails if an outcome was already chosen.
//
// It is the one door to a message's outcome, for the outcomes of this file and of the other
// files of the package (fan-out splits). write runs at once, inside the message's savepoint
// (the session opens it before write's first statement), so a later failure of the handler
// rolls it back. write must change the row in one statement guarded by
// `workqueue_id = m.ID AND status = 'running' AND stage = m.Stage`, write the state (m.stateJSON)
// in it, and return an error wrapping ErrClaimLost when that statement changes no row. An error
// from write fails the message even if the handler then returns nil. At a fused stage the
// guard holds as well: the savepoint's request has moved the running row to m.Stage. Such an
// outcome is not an advance, so it ends the pass: nothing is fused after it.
func (m *Message) outcome(ctx context.Context, write func(tx *sql.Tx) error) error {
	return m.outcomeNamed(ctx, "an outcome", write)
}

// outcomeNamed is outcome with a description of the outcome, for the reasons of failures.
func (m *Message) outcomeNamed(ctx context.Context, what string, write func(tx *sql.Tx) error) error {
	if !m.live {
		return fmt.Errorf("%s for message %d: %w", what, m.ID, ErrHandlerDone)
	}
	if m.chosen != "" {
		if m.second == "" {
			m.second = what
		}
		return fmt.Errorf("%s for message %d: %w (%s)", what, m.ID, ErrOutcomeChosen, m.chosen)
	}
	m.chosen = what
	if err := write(m.Tx); err != nil {
		m.writeErr = err
		return err
	}
	return nil
}

// stateJSON encodes the state for the outcome's UPDATE.
func (m *Message) stateJSON() ([]byte, error) {
	if len(m.State) == 0 {
		return []byte("{}"), nil
	}
	return json.Marshal(m.State)
}
