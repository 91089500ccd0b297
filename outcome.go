// outcome.go: what the coordinator does with a worker's replies: credit, fail, condemn, and
// the queued failure and reset writes that record the outcomes.

package main

import (
	"fmt"
	"time"
)

// onReplies consumes status lines, in order, against the worker's queue.
func (c *coordinator) onReplies(ev workerReplies) {
	w := ev.w
	if c.workers[w.id] != w {
		return // a worker already reaped
	}
	now := time.Now()
	st := c.stats.stage(w.stage)
	for _, line := range ev.lines {
		if w.fate == fateProtocol {
			return // condemned: nothing it says can be matched to a message any more
		}
		if len(w.queue) == 0 {
			c.protocolError(w, fmt.Sprintf("status line %q with no message in flight", clip(line, 80)))
			return
		}
		r, err := parseReply(line)
		if err != nil {
			c.protocolError(w, err.Error())
			return
		}
		m := c.pop(w, now)
		w.answered++
		if r.status == 0 {
			st.Processed++
			c.onSuccess(w, m, r)
		} else if c.outageFailure(w, m, r.text) {
			// the database's outage, not the message's: back to pending (failover.go)
		} else {
			st.Failed++
			reason := fmt.Sprintf("stage %s: status %d", w.stage, r.status)
			if r.text != "" {
				reason += ": " + r.text
			}
			c.fail(m, reason)
		}
	}
	if ev.err != nil {
		c.protocolError(w, "protocol error: "+ev.err.Error())
		return
	}
	if p := c.pools[w.stage]; p != nil && p.gen == w.gen {
		if w.answered > 0 {
			p.unhold()
		}
	} else {
		c.retire(w)
		return
	}
	if len(w.queue) == 0 {
		c.onIdle(w, now)
	}
}

// pop removes the head of w's queue and accounts its processing time.
func (c *coordinator) pop(w *worker, now time.Time) *message {
	m := w.queue[0]
	w.queue[0] = nil
	w.queue = w.queue[1:]
	c.inflight[m.stage]--
	c.inflightAll--
	if c.backlog {
		c.claimWanted = true
	}
	ms := now.Sub(w.headAt).Milliseconds()
	c.stats.stage(w.stage).observe(ms)
	w.headAt = now
	return m
}

// onSuccess credits a message the stage has already moved on.
func (c *coordinator) onSuccess(w *worker, m *message, r reply) {
	c.claimWanted = true // the stage may have advanced it: the next claim takes it
	if m.fanout != 0 {
		c.fanin.hint(m.fanout) // a child may have finished: cheap, and the flush is batched
	}
	if n := c.stageFailing[w.stage]; n > 0 {
		c.log.Info("stage recovered", "stage", w.stage, "failures_before", n)
		delete(c.stageFailing, w.stage)
	}
	if r.done {
		c.stats.Global.Done++
	}
	for _, f := range r.fused {
		fs := c.stats.stage(f.stage)
		fs.Fused++
		fs.observe(f.ms)
	}
	for _, word := range r.malformed {
		c.log.Warn("ignoring malformed fused report", "stage", w.stage, "pid", w.pid, "word", clip(word, 80))
	}
}

// fail queues a failure write for m: an attempt, then paused or failed.
func (c *coordinator) fail(m *message, reason string) {
	if m.forgotten {
		return // a reconcile found its row no longer our claim: the guarded write would be a no-op
	}
	f := failure{m: m, reason: reason, maxAttempts: maxAttemptsDefault, retryDelay: retryDelayDefault}
	if p := c.pools[m.stage]; p != nil {
		f.maxAttempts, f.retryDelay = p.cfg.MaxAttempts, p.cfg.RetryDelay
	}
	c.failures = append(c.failures, f)
	n := c.stageFailing[m.stage] + 1
	c.stageFailing[m.stage] = n
	// Rate-limited: the first failures of a run in full, then one line per power of ten.
	if n <= 3 || isPowerOfTen(n) {
		c.log.Warn("message failed", "stage", m.stage, "id", m.id, "attempt", m.attempts+1,
			"reason", reason, "consecutive_failures", n)
	}
}

func isPowerOfTen(n int) bool {
	for n >= 10 && n%10 == 0 {
		n /= 10
	}
	return n == 1
}

// protocolError condemns a worker whose output cannot be matched to its messages: the head
// fails with the reason, the worker is killed, and its exit puts the rest back to pending.
func (c *coordinator) protocolError(w *worker, reason string) {
	c.log.Warn("worker broke the protocol; killing it", "stage", w.stage, "pid", w.pid, "reason", reason)
	if len(w.queue) > 0 {
		m := c.pop(w, time.Now())
		c.stats.stage(w.stage).Failed++
		c.fail(m, fmt.Sprintf("stage %s: %s", w.stage, reason))
	}
	w.end(fateProtocol)
}

// writeOutcomes sends the queued failure and reset writes; false if the database refused.
func (c *coordinator) writeOutcomes() bool {
	if len(c.failures) > 0 {
		ctx, cancel := c.budget()
		out, err := writeFailures(ctx, c.inst.conn, c.failures)
		cancel()
		if err != nil {
			c.dbTrouble("record failures", err)
			return false
		}
		groups := map[int64]int64{} // failed message -> its fan-out group, for the hints
		for _, f := range c.failures {
			if f.m.fanout != 0 {
				groups[f.m.id] = f.m.fanout
			}
		}
		for _, o := range out {
			if o.status == "failed" {
				c.stats.Global.Failed++
				if g := groups[o.id]; g != 0 {
					c.fanin.hint(g) // our own terminal write of a child
				}
			} else {
				c.timers.scheduleEarlier(timerKey{kind: timerRetry}, o.retryAt)
			}
		}
		if skipped := len(c.failures) - len(out); skipped > 0 {
			c.log.Debug("failure writes skipped: rows no longer held by their claim", "rows", skipped)
		}
		c.failures = c.failures[:0]
	}
	if len(c.resets) > 0 {
		ctx, cancel := c.budget()
		n, err := writeResets(ctx, c.inst.conn, c.resets)
		cancel()
		if err != nil {
			c.dbTrouble("reset messages to pending", err)
			return false
		}
		c.log.Debug("messages put back to pending", "rows", n, "queued", len(c.resets))
		c.resets = c.resets[:0]
		c.claimWanted = true
	}
	c.dbBackoff.reset()
	return true
}
