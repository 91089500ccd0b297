// reconcile.go: after every re-lock, before the next claim, the table is made to agree with
// what the coordinator holds in memory.
//
// A lost lock connection leaves two kinds of disagreement. A claim whose COMMIT reached the
// server (and, with a synchronous standby, the standby) while its reply was lost left rows
// running that no worker holds: nobody would ever finish them. A commit lost with an
// asynchronous standby, or an operator's write meanwhile, left messages in workers' queues
// whose rows are no longer running under our claim: whatever is written for them must be a
// no-op. The dispatcher is the only claimer (instance.go), so every running row it does not
// hold is an orphan, and the reconcile is safe while workers go on (their commits move rows
// out of 'running', never into it). It runs on the coordinator goroutine, on the lock
// connection, and owns nothing of its own.

package main

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/lib/pq"
)

// readRunningSQL reads the running rows among the next $2 rows after id $1 in id order (a
// window), and what it says of the window: how many rows it looked at and the last of them.
// There is no index on running rows (schema.sql says why), so finding them means looking at
// every row, once per start and once per re-lock: the price of a failover, not of every claim.
// It is done a window at a time, each window a statement within its own budget, because one
// scan of the table grows with every done row kept (RETENTION = 0 keeps them all): past the
// statement budget (10 s: tens of millions of rows, far fewer with a cold cache) the reconcile
// failed at every re-lock, and past a role's statement_timeout the dispatcher could not start
// (150 ms on 4 million rows: "reset orphaned running rows: ... statement timeout";
// TestRunningReadPastRoleStatementTimeout). A window costs about 0.25 µs a row here (50,000
// rows: about 15 ms), a plain scan of the table half to a quarter of that in all; the windows
// need no common snapshot, since nothing but the dispatcher's own claim puts a row into
// running, and it does not claim before the reconcile is over: a row that leaves running
// between two windows needs no reset, and the reset's guard passes over it.
const readRunningSQL = `
WITH win AS (
    SELECT workqueue_id, stage, claim, status FROM workqueue
     WHERE workqueue_id > $1
     ORDER BY workqueue_id
     LIMIT $2
)
SELECT coalesce(array_agg(workqueue_id) FILTER (WHERE status = 'running'), '{}'),
       coalesce(array_agg(stage) FILTER (WHERE status = 'running'), '{}'),
       coalesce(array_agg(coalesce(claim, 0)) FILTER (WHERE status = 'running'), '{}'),
       count(*), coalesce(max(workqueue_id), 0)
  FROM win`

const (
	runningWindow    = 50_000 // rows one statement of readRunning looks at
	runningWindowMin = 500    // ... at the least, when a role's statement_timeout cuts it
)

// readRunning reads the running rows (readRunningSQL) for the two orphan resets, the start's
// (resetOrphans) and the reconcile's, a window at a time, each within dbStatementBudget. A
// window cut by a statement_timeout of the role's, the database's or the DSN's is read again
// at half the size, down to runningWindowMin. A row claimed by a version before claim tokens
// reads as token 0, which resetSQL guards as such.
func readRunning(ctx context.Context, conn *sql.Conn) ([]*message, error) {
	var ms []*message
	var after int64 // ids are positive (schema.sql)
	window := runningWindow
	for {
		var ids, claims []int64
		var stages []string
		var looked, last int64
		wctx, cancel := context.WithTimeout(ctx, dbStatementBudget)
		err := conn.QueryRowContext(wctx, readRunningSQL, after, window).
			Scan((*pq.Int64Array)(&ids), (*pq.StringArray)(&stages), (*pq.Int64Array)(&claims), &looked, &last)
		ours := wctx.Err() != nil // our budget or a shutdown, not the server's timeout; read before cancel
		cancel()
		if next, ok := halvedOnCut(err, ours, window, runningWindowMin); ok {
			window = next
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("read running rows (%d rows after id %d): %w", window, after, err)
		}
		for i, id := range ids {
			ms = append(ms, &message{id: id, stage: stages[i], claim: claims[i]})
		}
		if looked < int64(window) {
			return ms, nil
		}
		after = last
	}
}

// reconcileCounts is what one reconcile did.
type reconcileCounts struct {
	reset         int64 // running rows not held, back to pending
	forgotten     int   // held messages whose row is no longer our claim
	outageRetried int   // queued failures of the outage, turned into resets (no attempt)
	held          int   // running rows nobody holds but another transaction locks: reset later
}

// reconcile brings the table and the coordinator's memory into agreement; false when the
// database refused (the caller treats it like any refused statement).
func (c *coordinator) reconcile() (reconcileCounts, error) {
	var n reconcileCounts
	// Failures still queued now were reported while the database was away, or could not be
	// written before it went: the outage interrupted them. They are retried, not charged. Not
	// those that had reached the database and waited for a row another transaction holds
	// (writeHeld; the outage may have cut the next try): they stay failures, charged.
	kept := c.failures[:0]
	for _, f := range c.failures {
		if f.m.writeHeld {
			kept = append(kept, f)
			continue
		}
		c.resets = append(c.resets, f.m)
		n.outageRetried++
	}
	c.failures = kept

	type key struct {
		id    int64
		stage string
		claim int64
	}
	held := map[key]*message{}
	ours := func(m *message) { held[key{m.id, m.stage, m.claim}] = m }
	for _, w := range c.workers {
		for _, m := range w.queue {
			ours(m)
		}
	}
	for _, m := range c.resets {
		ours(m)
	}
	// Writes waiting for a row another transaction holds were not interrupted by the outage:
	// they stay what they are (a failure stays charged), and their rows are ours.
	for _, fs := range [][]failure{c.failures, c.heldFailures} {
		for _, f := range fs {
			ours(f.m)
		}
	}
	for _, m := range c.heldResets {
		ours(m)
	}
	running, err := readRunning(c.ctx, c.inst.conn) // a budget per window
	if err != nil {
		return n, fmt.Errorf("reconcile: %w", err)
	}
	ctx, cancel := context.WithTimeout(c.ctx, dbStatementBudget)
	defer cancel()
	var orphans []*message
	seen := map[key]bool{}
	for _, m := range running {
		k := key{m.id, m.stage, m.claim}
		if held[k] != nil {
			seen[k] = true
			continue
		}
		orphans = append(orphans, m)
	}
	for k, m := range held {
		if !seen[k] && !m.forgotten {
			// Its row moved on (the stage committed before the outage: its reply is still to
			// come) or went back in time (lost with an asynchronous standby). Either way every
			// write for it is a guarded no-op now; say so once and do not count it as a failure.
			m.forgotten = true
			n.forgotten++
		}
	}
	if len(orphans) > 0 {
		// A running row without a claim token (claimed by a version before tokens) is read
		// and guarded as token 0 (resetSQL). A row another transaction holds is reset once
		// it lets go, like any held reset (writeOutcomes), instead of stopping the reconcile.
		written, heldRows, refused, err := resetRows(ctx, c.inst.conn, orphans, time.Time{})
		if err != nil {
			return n, fmt.Errorf("reconcile: reset %d running rows nobody holds: %w", len(orphans), err)
		}
		n.reset = written
		c.keepRefusedResets(orphans, refused, heldRows)
		if n.held = c.keepHeldResets(orphans, heldRows); n.held > 0 {
			c.retryHeldAfter(time.Now())
		}
	}
	return n, nil
}

// afterRelock runs the reconcile once the lock is ours again, before the next claim, and
// reports it; a refusal is handled like any statement the database refused (the claim waits).
func (c *coordinator) afterRelock(moved bool) {
	c.ha.update(func(s *haStatus) { s.role, s.server = "active", c.inst.server.addr })
	if moved {
		c.retireStranded()
	}
	n, err := c.reconcile()
	if err != nil {
		c.dbTrouble("reconcile", err)
		return
	}
	c.ha.update(func(s *haStatus) {
		s.reconciles++
		s.reset += n.reset
		s.forgotten += int64(n.forgotten)
		s.outageRetried += int64(n.outageRetried)
	})
	c.log.Info("reconciled the table with memory", "running_reset", n.reset, "running_held", n.held,
		"forgotten", n.forgotten, "outage_failures_retried", n.outageRetried, "server", c.inst.server.addr)
}
