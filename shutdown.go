// shutdown.go: ending the run: the signals, the clean finish, and the abort on a fatal error.
//
// The first SIGINT/SIGTERM stops claims and lets every worker finish its queue within
// SHUTDOWN_GRACE; a second one (or the end of the grace) kills them, and their messages go
// back to pending. What the database will not take at the end stays running and is reset by
// the next start.

package main

import (
	"context"
	"maps"
	"os"
	"slices"
	"time"
)

// onSignal: the first SIGINT/SIGTERM stops claiming and lets workers finish their queue;
// a second one hurries: every worker is killed and its messages go back to pending.
func (c *coordinator) onSignal(s os.Signal) {
	if !c.shutdown {
		c.notifier.send("STOPPING=1")
		c.log.Info("shutting down: workers finish their queue", "signal", s.String(),
			"workers", len(c.workers), "in_flight", c.inflightAll, "grace", c.cfg.Dispatch.ShutdownGrace)
		c.shutdown = true
		now := time.Now()
		for _, w := range c.workers {
			c.stop(w, now)
			c.timers.cancel(timerKey{timerLinger, w.id}) // the shutdown grace governs now
		}
		c.timers.schedule(timerKey{kind: timerShutdown}, now.Add(c.cfg.Dispatch.ShutdownGrace))
		return
	}
	c.log.Info("second signal: killing workers", "signal", s.String(), "workers", len(c.workers))
	c.killAll()
}

// finish completes a clean shutdown: every worker is gone; write what is left.
func (c *coordinator) finish() {
	c.writeLeftovers()
	c.flushStats(true)
	if c.metrics != nil {
		c.metrics.publish(c.snapshot())
	}
	c.log.Info("shutdown complete")
}

// abort ends the loop on a fatal error: workers are killed and their rows put back if the
// database still lets us.
func (c *coordinator) abort() {
	c.killAll()
	for len(c.workers) > 0 {
		select {
		case ev := <-c.events:
			if ex, ok := ev.(workerExit); ok {
				c.onExit(ex)
			}
		case <-time.After(exitReadGrace + time.Second):
			c.log.Error("workers did not report their exit", "workers", len(c.workers))
			return
		}
	}
	if c.locked {
		c.writeLeftovers()
	}
}

// writeLeftovers writes queued outcomes with a bounded retry; what the database will not take
// stays running in the table and is reset by the next start. So do the rows that another
// transaction holds: the wait for them has no end in sight, and the next start fences this
// run's workers' sessions, the usual holders, before it resets. A write the database refuses
// for one row by itself (an application's trigger or CHECK on workqueue) leaves that row
// alone running (failRows, resetRows): before, the failures' statement refused whole left
// every failure and every reset of the run running, its failures to run again uncharged
// (TestAbortLeftoversRefusedAlone).
func (c *coordinator) writeLeftovers() {
	c.failures = append(c.failures, c.heldFailures...)
	c.resets = append(c.resets, c.heldResets...)
	c.heldFailures, c.heldResets = nil, nil
	if len(c.failures) == 0 && len(c.resets) == 0 {
		return
	}
	held := 0
	var refused []int64
	err := withRetry(c.ctx, dbStatementBudget, "write outcomes at shutdown", func(ctx context.Context) error {
		if c.inst.conn == nil {
			if _, err := c.inst.relock(ctx); err != nil {
				return err
			}
		}
		if len(c.failures) > 0 {
			_, h, r, err := failRows(ctx, c.inst.conn, c.failures, time.Time{})
			if err != nil {
				return err
			}
			held += len(h)
			refused = append(refused, slices.Sorted(maps.Keys(r))...)
			c.failures = nil
		}
		if len(c.resets) > 0 {
			_, h, r, err := resetRows(ctx, c.inst.conn, c.resets, time.Time{})
			if err != nil {
				return err
			}
			held += len(h)
			refused = append(refused, slices.Sorted(maps.Keys(r))...)
			c.resets = nil
		}
		return nil
	})
	if err != nil {
		c.log.Error("could not write outcomes; their rows stay running and the next start puts them back to pending",
			"failures", len(c.failures), "resets", len(c.resets), "err", err)
	}
	if len(refused) > 0 {
		c.log.Warn("the database refused these rows' writes at shutdown by themselves (an application's rule on them); they stay running and the next start puts them back to pending",
			"rows", len(refused), "ids", refused[:min(len(refused), 20)])
	}
	if held > 0 {
		c.log.Warn("rows held by other transactions were not written; they stay running and the next start puts them back to pending",
			"rows", held)
	}
}
