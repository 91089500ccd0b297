// transient.go: a serialization failure or a deadlock (SQLSTATE 40001, 40P01) ends what the
// SDK sent without doing any of it, and the same thing sent again will most likely pass (the
// server's own hint: "The transaction might succeed if retried"). The batch transaction is
// READ COMMITTED (conn.go, as the dispatcher's sessions are: doc/design/dispatch.md, section
// 5), but the load and the outcome statement are sent alone and run at the session's default
// level, which an application may have set to SERIALIZABLE for its own writes; there the
// statements of concurrent workers on one queue table fail each other now and then, and each
// failure failed every message of the batch, or each outcome of the statement, charged an
// attempt for nothing wrong with any of them (TestDatabaseDefaultSerializable: 104 to 241 of
// 1,000 messages without the tries). A deadlock (40P01) between two batches' handlers is the
// same at any level.

package stage

import (
	"context"
	"errors"
	"math/rand/v2"
	"time"

	"github.com/lib/pq"
)

// transientTries is how many times in all a batch or an outcome statement is sent when each
// try ends in a transient failure; the last one's error then fails its messages as any other
// does, and the dispatcher retries them under the stage's retry rules.
const transientTries = 8

// isTransient reports whether err is a serialization failure or a deadlock.
func isTransient(err error) bool {
	var pe *pq.Error
	return errors.As(err, &pe) && (pe.Code == "40001" || pe.Code == "40P01")
}

// againAfter waits before try number try (2, 3, …) of something that failed transiently:
// 2, 4, 8 … ms, at most 100, with jitter, so that two workers that failed each other do not
// meet again at once. It returns false when ctx ends first.
func againAfter(ctx context.Context, try int) bool {
	d := min(time.Millisecond<<(try-1), 100*time.Millisecond)
	d = d/2 + time.Duration(rand.Int64N(int64(d)))
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// againIfTransient runs op, again after each transient failure, up to transientTries times.
// op must be a statement of its own (not in the batch transaction): a failed one did nothing.
func againIfTransient(ctx context.Context, op func() error) error {
	for try := 1; ; try++ {
		err := op()
		if err == nil || !isTransient(err) || try == transientTries || !againAfter(ctx, try+1) {
			return err
		}
	}
}
