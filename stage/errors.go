// errors.go: the SDK's sentinel errors, in one place for errors.Is.

package stage

import (
	"errors"
)

// Sentinel errors, for errors.Is. The outcome methods (Advance, Done, Defer, Split,
// SplitRange, and Paginate's deferral) return them wrapped, with the operation and the
// message's id; a handler normally just returns such an error, which fails its message.
var (
	// ErrConnectionLost means the database connection broke. Serve and ServeStages return it
	// (wrapped), and Run and RunStages exit 1 with it. A stage connects once and never
	// reconnects: the outcome of the batch in flight is unknown, so the process must end and
	// let the dispatcher recover its rows; no status line is written for that batch.
	ErrConnectionLost = errors.New("database connection lost (a stage connects once and does not reconnect)")

	// ErrClaimLost means the row is no longer running at this stage: the dispatcher took the
	// claim back (MAX_RUNTIME passed, or it shut down) or another outcome already moved it.
	// An outcome written at once returns it; one kept for the end of the batch (the handler
	// had not used Message.Tx) fails its message with it after the handler returned. Either
	// way the message's status line is a failure and nothing of it is committed.
	ErrClaimLost = errors.New("claim lost")

	// ErrOutcomeChosen is returned by a second outcome for the same message. The first stands
	// as far as the method is concerned, but the message fails even if the handler then
	// returns nil: choosing two outcomes is a bug the operator should see.
	ErrOutcomeChosen = errors.New("an outcome was already chosen for this message")

	// ErrNotNext is returned by Advance, and by Split and SplitRange for their continuation,
	// for a stage that is not in the stage's NEXT list (Config.Next, PEPSI_NEXT). No outcome
	// is chosen then: the handler may still choose another.
	ErrNotNext = errors.New("not a NEXT stage of this stage")

	// ErrHandlerDone is returned by an outcome chosen after the handler returned (from a
	// goroutine the handler left running, or through a Message kept after it): nothing is
	// written, and the message's status line was decided when the handler returned.
	ErrHandlerDone = errors.New("the handler has already returned")

	// errTxOwned is what Commit and Rollback of Message.Tx return inside a handler.
	errTxOwned = errors.New("the stage SDK owns Message.Tx: a handler must not commit or roll it back")
)
