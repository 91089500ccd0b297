// errors.go: the SDK's sentinel errors, in one place for errors.Is.

package stage

import (
	"errors"
)

// Sentinel errors, for errors.Is.
var (
	// ErrConnectionLost means the database connection broke. A stage connects once and never
	// reconnects: the outcome of the batch in flight is unknown, so the process must end and
	// let the dispatcher recover its rows.
	ErrConnectionLost = errors.New("database connection lost (a stage connects once and does not reconnect)")

	// ErrClaimLost means the row is no longer running at this stage: the dispatcher took the
	// claim back (timeout, shutdown) or another outcome already moved it.
	ErrClaimLost = errors.New("claim lost")

	// ErrOutcomeChosen is returned by a second outcome for the same message.
	ErrOutcomeChosen = errors.New("an outcome was already chosen for this message")

	// ErrNotNext is returned by Advance for a stage that is not in the stage's NEXT list.
	ErrNotNext = errors.New("not a NEXT stage of this stage")

	// ErrHandlerDone is returned by an outcome chosen after the handler returned.
	ErrHandlerDone = errors.New("the handler has already returned")

	// errTxOwned is what Commit and Rollback of Message.Tx return inside a handler.
	errTxOwned = errors.New("the stage SDK owns Message.Tx: a handler must not commit or roll it back")
)
