// outcome.go: what the coordinator does with a worker's replies: credit, fail, condemn, and
// the queued failure and reset writes that record the outcomes.

package main

import (
	"fmt"
	"slices"
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
		} else if c.diskFullFailure(w, m, r.text, now) {
			// a full disk, not the message: back to pending, the stage held (diskfull.go)
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
	c.keys.release(m)
	if c.backlog {
		c.claimWanted = true
	}
	ms := now.Sub(w.headAt).Milliseconds()
	c.stats.stage(w.stage).observe(ms)
	w.headAt = now
	if w.isolating {
		c.pools[w.stage].isolationEnded(w, m, true, now) // answered: resolved, whatever its status
	}
	return m
}

// onSuccess credits a message the stage has already moved on.
func (c *coordinator) onSuccess(w *worker, m *message, r reply) {
	c.claimWanted = true // the stage may have advanced it: the next claim takes it
	if m.fanout != 0 {
		c.fanin.hint(m.fanout) // a child may have finished: cheap, and the flush is batched
	}
	if fl := c.stageFailing[w.stage]; fl != nil {
		if fl.run >= failureRunRecovered {
			c.log.Info("stage recovered", "stage", w.stage, "failures_before", fl.run)
		}
		fl.run = 0
	}
	if r.done {
		c.stats.Global.Done++
	}
	for _, f := range r.fused {
		// Only the stages its PEPSI_FUSE named: each stage reported is a stage_stats row, a
		// set of /metrics series and a section of the console for the daemon's life, and a
		// stage program that wrote a name of its own per message (a tenant, an id) made as
		// many (TestFusedReportsOnlyOfFusedStages).
		if !w.fusable[f.stage] {
			c.fusedReportIgnored(w, "a stage this stage's workers may not run (PEPSI_FUSE)", f.stage)
			continue
		}
		fs := c.stats.stage(f.stage)
		fs.Fused++
		fs.observe(f.ms)
	}
	for _, word := range r.malformed {
		c.fusedReportIgnored(w, "malformed", word)
	}
}

// fusedReportIgnored logs a fused report of w's that is not counted, once per worker: a
// program that writes one per message would otherwise make a warning per message.
func (c *coordinator) fusedReportIgnored(w *worker, why, what string) {
	if w.fusedIgnored {
		return
	}
	w.fusedIgnored = true
	c.log.Warn("ignoring a fused report: "+why+"; said once per worker", "stage", w.stage, "pid", w.pid, "report", clip(what, 80))
}

// fail queues a failure write for m: an attempt, then paused or failed.
func (c *coordinator) fail(m *message, reason string) {
	if m.forgotten {
		return // a reconcile found its row no longer our claim: the guarded write would be a no-op
	}
	if m.cancelled {
		// An operator cancelled it while it ran: the stage's refused outcome (or a kill) is
		// expected, and the write, guarded by status = 'running', would change nothing.
		c.log.Debug("cancelled message's failure not recorded", "stage", m.stage, "id", m.id, "reason", reason)
		return
	}
	c.queueFailure(m, reason, false)
	c.noteFailure(m, reason, time.Now())
}

// failCrashed queues the failure write of a dead worker's head message; whether it failed is
// noted when the write tells (writeOutcomes, settleCrashes).
func (c *coordinator) failCrashed(m *message, reason string) {
	if m.forgotten || m.cancelled {
		return // as in fail
	}
	c.queueFailure(m, reason, true)
}

func (c *coordinator) queueFailure(m *message, reason string, crash bool) {
	f := failure{m: m, reason: reason, maxAttempts: maxAttemptsDefault, retryDelay: retryDelayDefault, crash: crash}
	if p := c.pools[m.stage]; p != nil {
		f.maxAttempts, f.retryDelay = p.cfg.MaxAttempts, p.cfg.RetryDelay
	}
	c.failures = append(c.failures, f)
}

const (
	// failureLinesPerMinute caps a stage's "message failed" lines per minute: failures mixed
	// among successes never make a run, so the per-run limit alone let every one of them
	// through (with a "stage recovered" after each: 570 lines for 2,000 messages).
	failureLinesPerMinute = 10
	// failureRunRecovered is the run of consecutive failures whose end "stage recovered"
	// reports: a stage that was failing, not one that had one failure among successes.
	failureRunRecovered = 3
)

// failureLog is the rate limit of one stage's failure lines (and of the refused-write lines and
// a stage's full-disk lines, whose run is unused).
type failureLog struct {
	run      int       // consecutive failures, ended by a success
	window   time.Time // start of the minute the lines below count in
	logged   int       // lines logged in the window
	unlogged int       // failures not logged since the last line logged
}

// admit reports whether a line may be logged at now, and counts it: not when skip (the
// caller's own reason to leave it out) or when failureLinesPerMinute lines were logged in the
// minute. unlogged is how many were left out since the last line logged.
func (l *failureLog) admit(now time.Time, skip bool) (unlogged int, ok bool) {
	if now.Sub(l.window) >= time.Minute {
		l.window, l.logged = now, 0
	}
	if skip || l.logged >= failureLinesPerMinute {
		l.unlogged++
		return 0, false
	}
	l.logged++
	unlogged, l.unlogged = l.unlogged, 0
	return unlogged, true
}

// noteFailure logs a failure, rate-limited per stage: the first failures of a run in full,
// then one line per power of ten, and never more than failureLinesPerMinute lines a minute;
// the next line logged says how many were left out.
func (c *coordinator) noteFailure(m *message, reason string, now time.Time) {
	fl := c.stageFailing[m.stage]
	if fl == nil {
		fl = &failureLog{}
		c.stageFailing[m.stage] = fl
	}
	fl.run++
	unlogged, ok := fl.admit(now, fl.run > 3 && !isPowerOfTen(fl.run))
	if !ok {
		return
	}
	args := []any{"stage", m.stage, "id", m.id, "attempt", m.attempts + 1, "reason", reason,
		"consecutive_failures", fl.run}
	if unlogged > 0 {
		args = append(args, "failures_not_logged", unlogged)
	}
	if fl.logged == failureLinesPerMinute {
		args = append(args, "next_failure_line_after", fl.window.Add(time.Minute).Format(time.RFC3339))
	}
	c.log.Warn("message failed", args...)
}

// settleCrashes counts and logs the heads of crashed workers once their failure writes have
// run: written (the row was still the claim) is a crash that failed the message; not written
// means the stage had committed the message's outcome before the worker died, and only its
// status line was lost: the message is processed, not failed, and the worker's death is
// logged as what it was. A held row is neither yet: its write waits (writeOutcomes).
func (c *coordinator) settleCrashes(fs []failure, written, held map[int64]bool) {
	now := time.Now()
	for _, f := range fs {
		if !f.crash || held[f.m.id] {
			continue
		}
		st := c.stats.stage(f.m.stage)
		if written[f.m.id] {
			st.Crashed++
			c.noteFailure(f.m, f.reason, now)
			continue
		}
		st.Processed++
		c.log.Warn("worker died after its head message's outcome had committed; the message is not failed",
			"stage", f.m.stage, "id", f.m.id, "reason", f.reason)
	}
}

// reasonOf is the reason of id's failure in fs.
func reasonOf(fs []failure, id int64) string {
	for _, f := range fs {
		if f.m.id == id {
			return f.reason
		}
	}
	return ""
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

// outcomesDue reports whether settle has writes to send: queued ones, or held ones whose
// wait is over.
func (c *coordinator) outcomesDue(now time.Time) bool {
	return len(c.failures) > 0 || len(c.resets) > 0 || c.heldDue(now)
}

// heldDue reports whether writes passed over for a held row are waiting and their wait is over.
func (c *coordinator) heldDue(now time.Time) bool {
	return (len(c.heldFailures) > 0 || len(c.heldResets) > 0) && !now.Before(c.heldWritesAt)
}

// writeOutcomes sends the queued failure and reset writes; false if the database refused.
// Writes whose rows another transaction holds are passed over by the statements (retry.go)
// and kept apart, to be sent again heldRetryGap later, until the holder lets go: the claims
// go on meanwhile.
func (c *coordinator) writeOutcomes() bool {
	// Held writes that are due go with the queued ones; those that are not wait for
	// timerHeldWrites, set when they were passed over (retryHeldAfter).
	now := time.Now()
	if c.heldDue(now) {
		c.failures = append(c.failures, c.heldFailures...)
		c.resets = append(c.resets, c.heldResets...)
		c.heldFailures, c.heldResets = nil, nil
	}
	passedOver := false
	if len(c.failures) > 0 {
		ctx, cancel := c.budget()
		out, held, refused, err := failRows(ctx, c.inst.conn, c.failures, now.Add(refusedSplitBudget))
		cancel()
		if err != nil {
			c.dbTrouble("record failures", err)
			return false
		}
		c.keepRefusedFailures(refused, held)
		groups := map[int64]int64{} // failed message -> its fan-out group, for the hints
		for _, f := range c.failures {
			if f.m.fanout != 0 {
				groups[f.m.id] = f.m.fanout
			}
		}
		written := make(map[int64]bool, len(out))
		for _, o := range out {
			written[o.id] = true
			if !o.stored {
				c.log.Warn("failure recorded without its reason in the row: its state is not a JSON object",
					"id", o.id, "status", o.status, "reason", reasonOf(c.failures, o.id))
			}
			if o.status == "failed" {
				c.stats.Global.Failed++
				if g := groups[o.id]; g != 0 {
					c.fanin.hint(g) // our own terminal write of a child
				}
			} else {
				c.timers.scheduleEarlier(timerKey{kind: timerRetry}, o.retryAt)
			}
		}
		c.settleCrashes(c.failures, written, held)
		for _, f := range c.failures {
			if held[f.m.id] {
				c.heldFailures = append(c.heldFailures, f)
				c.noteHeld(f.m, "failure")
			}
		}
		passedOver = passedOver || len(held) > 0
		if skipped := len(c.failures) - len(out) - len(held); skipped > 0 {
			c.log.Debug("failure writes skipped: rows no longer held by their claim", "rows", skipped)
		}
		c.failures = c.failures[:0]
	}
	// A forgotten message's row is no longer its claim (reconcile.go), and its token may be
	// handed out again: the claim commits asynchronously (claim.go), so a server crash can lose
	// the sequence's advance with the claim, and the next claim after the restart reuses the
	// lost claim's token. Its reset, guarded by that token, could hit the new claim; like its
	// failure (fail), it is not written.
	c.resets = slices.DeleteFunc(c.resets, func(m *message) bool { return m.forgotten })
	if len(c.resets) > 0 {
		ctx, cancel := c.budget()
		n, held, refused, err := resetRows(ctx, c.inst.conn, c.resets, now.Add(refusedSplitBudget))
		cancel()
		if err != nil {
			c.dbTrouble("reset messages to pending", err)
			return false
		}
		c.keepRefusedResets(c.resets, refused, held)
		passedOver = c.keepHeldResets(c.resets, held) > 0 || passedOver
		c.log.Debug("messages put back to pending", "rows", n, "queued", len(c.resets), "held", len(held))
		c.resets = c.resets[:0]
		c.claimWanted = true
	}
	if passedOver {
		c.retryHeldAfter(now)
	}
	c.dbBackoff.reset()
	return true
}

// refusedSplitBudget bounds the loop's time spent writing refused failures one by one in
// one settle; those not tried within it wait for the next round (heldRetryGap).
const refusedSplitBudget = 100 * time.Millisecond

// keepRefusedFailures marks the queued failures whose own write the database refused by
// itself (refused, from failRows) as held: no longer pepsi's own writes (storableReason,
// failSQL), but an application's trigger or CHECK on workqueue may refuse the write of one row.
// Such a failure waits as a held one does: said (at most failureLinesPerMinute lines a
// minute), tried again every second, its row running and ours, the claims going on; so do
// those failRows did not try within refusedSplitBudget of the loop's time.
//
// One refusal is pepsi's to mend: a database whose encoding is not UTF-8 has no place for a
// character of the reason (a worker's "→" in LATIN1). The reason is then written again a
// second later with its characters outside ASCII as escapes (asciiReason), said nowhere: the
// message fails or is retried as it would have, and its reason can still be read.
func (c *coordinator) keepRefusedFailures(refused map[int64]error, held map[int64]bool) {
	for i := range c.failures {
		f := &c.failures[i]
		if err, ok := refused[f.m.id]; ok {
			held[f.m.id] = true
			f.m.writeHeld = true // over an outage it stays a failure (reconcile.go)
			if r, ok := asciiReason(f.reason, err); ok {
				f.reason = r
				continue
			}
			c.noteRefused(f.m, "failure write", err)
		}
	}
}

// noteRefused logs, once per message and at most failureLinesPerMinute lines a minute, that
// the database refused m's write (what) by itself.
func (c *coordinator) noteRefused(m *message, what string, err error) {
	if m.writeRefused {
		return
	}
	m.writeRefused = true
	c.sayRefused("the database refused this message's "+what+" alone; tried again every second, claims go on",
		"stage", m.stage, "id", m.id, "err", err)
}

// sayRefused logs msg for a write the database refused for one row alone, at most
// failureLinesPerMinute such lines a minute (failures, resets, flips share the limit).
func (c *coordinator) sayRefused(msg string, args ...any) {
	unlogged, ok := c.refusedLog.admit(time.Now(), false)
	if !ok {
		return
	}
	if unlogged > 0 {
		args = append(args, "refusals_not_logged", unlogged)
	}
	c.log.Warn(msg, args...)
}

// keepRefusedResets marks the resets of ms that the database refused by themselves (refused,
// from resetRows) as held: they wait with the rows another transaction holds, tried again
// every second, their rows running and ours, said once each (noteRefused, not noteHeld).
func (c *coordinator) keepRefusedResets(ms []*message, refused map[int64]error, held map[int64]bool) {
	for _, m := range ms {
		if err, ok := refused[m.id]; ok {
			held[m.id] = true
			m.writeHeld = true
			c.noteRefused(m, "reset to pending", err)
		}
	}
}

// keepHeldResets keeps the resets of ms whose rows another transaction held (held, from
// writeResets) for a later try, says so once per message, and returns how many it kept.
func (c *coordinator) keepHeldResets(ms []*message, held map[int64]bool) int {
	kept := 0
	for _, m := range ms {
		if held[m.id] {
			c.heldResets = append(c.heldResets, m)
			c.noteHeld(m, "reset")
			kept++
		}
	}
	return kept
}

// retryHeldAfter sends the held writes again heldRetryGap after now.
func (c *coordinator) retryHeldAfter(now time.Time) {
	c.heldWritesAt = now.Add(heldRetryGap)
	c.timers.schedule(timerKey{kind: timerHeldWrites}, c.heldWritesAt)
}

// noteHeld says, once per message, that its write (what) waits for another transaction that
// holds its row; the row stays running until then.
func (c *coordinator) noteHeld(m *message, what string) {
	if m.writeHeld {
		return
	}
	m.writeHeld = true
	c.log.Warn("a write waits: another transaction holds the message's row; tried again every second, claims go on",
		"write", what, "stage", m.stage, "id", m.id)
}
