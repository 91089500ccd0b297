// fanin.go: the coordinator's side of fan-out / fan-in (doc/design/fanin.md §3.4–3.8).
//
// Children record their entry into and exit from {done, failed} themselves, in their own
// transaction, through a trigger into the fanin_event inbox (fanin.sql). The coordinator is
// the only consumer: it applies the inbox in batches (fanin_flush), which updates each group's
// counters once per flush and wakes complete groups' parents exactly once. It learns that
// there is something to flush from facts it already has — status lines of claimed children
// (the claim returns fanout_id) and its own failure writes — and, for out-of-band writers,
// from the claim's own "inbox not empty" column at every heartbeat: no NOTIFY per child, and
// no query of its own when idle. A slow keyset-paged sweep recounts open groups from the
// children rows and repairs drift; a repair is an alarm.
//
// The wake rule (doc/design/fanin.md §3.7): flush at once when a hinted group may be complete (its remaining
// children ≤ the hints seen for it), else coalesce until FANIN_MIN_HINTS hints or
// FANIN_MAX_DELAY after the previous flush. Owned by the coordinator goroutine.

package main

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/lib/pq"
)

// Defaults of the fan-in keys of [pepsi-dispatch] (doc/design/fanin.md §3.11).
const (
	faninBatchDefault    = 10000
	faninMaxDelayDefault = 250 * time.Millisecond
	faninMinHintsDefault = 100
	sweepIntervalDefault = 300 * time.Second
	sweepPageDefault     = 500
	sweepMinAgeDefault   = 60 * time.Second

	// sweepNextPage: the pause between pages of one sweep pass, so a pass over many groups
	// never monopolises the loop.
	sweepNextPage = 100 * time.Millisecond

	// faninMinGap: a flush starts at least this long after the previous one, so a burst of
	// completions costs a few large flushes instead of many small ones (a flush costs ~0.5 ms
	// of PostgreSQL's time, more with the wake-ups it causes). faninMinGapQuiet: the same
	// for a flush because a group may be complete while the pipeline is quiet (fewer than
	// faninQuietInflight messages in flight and fewer than faninQuietHints children's status
	// lines since the last flush): a parent waits on it and there is little to batch.
	// Measured with faninbench: 10 ms for every "may be complete" flush gave an idle wake p50
	// of 3 ms but 112 flushes per 20,000 children under load (bookkeeping 15 %); 50 ms gave
	// 27 flushes (9 %) but an idle p50 of 28 ms, where one group follows another within tens
	// of milliseconds. Quiet by the in-flight count alone still meant 13 flushes per 20,000
	// children when a few workers with short queues keep up with the backlog (fewer than 100
	// in flight, ~600 status lines per 10 ms); the hint count tells that load apart.
	faninMinGap        = 50 * time.Millisecond
	faninMinGapQuiet   = 10 * time.Millisecond
	faninQuietInflight = 100
	faninQuietHints    = 100
)

// readyStep is where the start's fire_ready is (faninStartup): owed until a flush has emptied
// the inbox, then due until settle starts it, then running until its event comes back, and
// due again a second later if it failed.
type readyStep int

const (
	readyDone    readyStep = iota // nothing owed: it ran
	readyOwed                     // after the next flush that succeeds
	readyDue                      // settle starts it, at readyAt
	readyRunning                  // in the background
)

// faninCounters are the fan-in statistics (dispatch_stats columns of the same names; their
// rows in stats.go's dispatchCounterDefs drive the flush and /metrics).
type faninCounters struct {
	Events        int64 // inbox rows consumed
	Flushes       int64 // flush statements
	FlushMs       int64 // time spent in them
	Wakes         int64 // parents woken
	LateEvents    int64 // events of groups already fired
	SweepRepaired int64 // groups whose counters the sweep had to correct (alarm)
	Quarantined   int64 // groups whose events tripped a guard (alarm)
}

// fanin is the coordinator's fan-in state.
type fanin struct {
	batch    int
	maxDelay time.Duration
	minHints int

	hints       int            // hints since the last flush
	hinted      map[int64]int  // hints per group since the last flush
	remaining   map[int64]int  // remaining children per open group, as of the last flush that saw it
	lastFlush   time.Time      // the start of the last flush
	busy        bool           // a flush is running in the background
	sweeping    bool           // a page of the sweep is running in the background
	ready       readyStep      // the start's fire_ready: owed, due, running or done
	readyAt     time.Time      // readyDue: not before then (zero: at once)
	readyFails  int            // its failed tries and those that passed held groups over, for the log
	sweepSoon   bool           // the sweep's timer came due meanwhile: the next page at once
	failures    int            // consecutive failed flushes, for the log
	heldGroups  int            // groups the last flush passed over (held), for /metrics
	heldFlushes int            // consecutive flushes that passed over held groups, for the log
	inbox       bool           // the last claim saw unapplied events
	sweepAfter  int64          // the sweep's keyset cursor; 0 = start of a pass
	stats       *faninCounters // in c.stats

	// refused: the groups whose completion the database refused to apply by itself, each with
	// the time to try it again (onRefusedGroups); their events wait in the inbox.
	refused map[int64]time.Time

	// fail is fault injection for the crash tests, called at each named point: nil in
	// production, which makes every point a no-op. It never decides what runs: the flush and
	// the sweep run the same statements in the same transactions with it set or not, so a
	// crash test exercises the production statements (a failpoint is inert in shape). Set
	// once in newFanin (from PEPSI_FAILPOINT) and read by the flush goroutine too.
	fail func(point string)
}

func newFanin(cfg DispatchConfig, stats *faninCounters) *fanin {
	return &fanin{
		batch: cfg.FaninBatch, maxDelay: cfg.FaninMaxDelay, minHints: cfg.FaninMinHints,
		hinted: map[int64]int{}, remaining: map[int64]int{}, refused: map[int64]time.Time{}, stats: stats,
		fail: exitAtFailpoint(os.Getenv("PEPSI_FAILPOINT")),
	}
}

// exitAtFailpoint returns the fail hook that exits the process with status 137 (as if killed)
// at the point named by PEPSI_FAILPOINT, for the crash tests (doc/design/fanin.md §3.13):
// nil when the variable is unset or empty, as in production.
func exitAtFailpoint(name string) func(string) {
	if name == "" {
		return nil
	}
	return func(point string) {
		if point == name {
			fmt.Fprintf(os.Stderr, "pepsi-dispatch: failpoint %s: exiting with status 137\n", point)
			os.Exit(137)
		}
	}
}

// hit calls the fail hook at point; without one (production) it does nothing.
func (f *fanin) hit(point string) {
	if f.fail != nil {
		f.fail(point)
	}
}

// hint notes that a child of group g may have reached (or left) a terminal status.
func (f *fanin) hint(g int64) {
	f.hints++
	f.hinted[g]++
}

// learn takes the remaining children of groups as the claim read them from their counters.
// Counters lag the children, so both these and what a flush reported are at least the true
// remaining count (barring requeues, which only make a flush come early): the smaller is the
// better estimate.
func (f *fanin) learn(remaining map[int64]int) {
	for g, r := range remaining {
		if old, ok := f.remaining[g]; !ok || r < old {
			f.remaining[g] = r
		}
	}
}

// due reports whether a flush should run now, and if not, when (zero: no hint pending).
// While a flush runs, nothing is due: its result is an event, after which this is asked again.
// inflight is the number of messages in workers' queues.
func (f *fanin) due(now time.Time, inflight int) (bool, time.Time) {
	if f.busy || f.hints == 0 && !f.inbox {
		return false, time.Time{}
	}
	if f.hints >= f.minHints && f.hints >= faninQuietHints {
		// Enough hints for a flush, and too many for the quiet gap: whatever the groups
		// below say, the answer is the same, so a burst does not walk every hinted group.
		return f.notBefore(now, now, faninMinGap)
	}
	for g, n := range f.hinted {
		if r, ok := f.remaining[g]; !ok || r <= n {
			// Unknown or possibly complete: variant 4's "few remain" path.
			gap := faninMinGap
			if inflight < faninQuietInflight && f.hints < faninQuietHints {
				gap = faninMinGapQuiet
			}
			return f.notBefore(now, now, gap)
		}
	}
	if f.hints >= f.minHints {
		return f.notBefore(now, now, faninMinGap)
	}
	return f.notBefore(now, f.lastFlush.Add(f.maxDelay), faninMinGap)
}

// notBefore is due's answer for a flush wanted at 'at' but no sooner than gap after the
// previous flush started.
func (f *fanin) notBefore(now, at time.Time, gap time.Duration) (bool, time.Time) {
	if earliest := f.lastFlush.Add(gap); at.Before(earliest) {
		at = earliest
	}
	return !now.Before(at), at
}

// flushResult is one fanin_flush call's result.
type flushResult struct {
	events, groupsFired, woken, late, quarantined int
	held                                          int // groups passed over: another transaction holds a row
	openIDs                                       []int64
	openRemaining                                 []int64
	refusedIDs                                    []int64 // groups the database refused by themselves
	refusedEvents                                 int     // their events, left in the inbox
	refusedReason                                 sql.NullString
}

// faninFlushed is the event a flush in the background sends back to the coordinator: the
// results of its statements (all of them, also when a later one failed) and the error that
// ended it, if any.
type faninFlushed struct {
	results []flushResult
	took    time.Duration
	err     error
}

// flushSQL is one flush, run in an explicit transaction of its own (flushOnce): the crash
// tests stop the process between the statement and its commit, and production runs the same
// transaction. BEGIN and COMMIT cost two round trips more than an autocommit statement, a few
// tens of microseconds on the flush goroutine per flush (tens of flushes per 20,000
// children), never on the coordinator's.
const flushSQL = `SELECT events, groups_fired, parents_woken, late_events, quarantined, held, open_ids, open_remaining,
                         refused_ids, refused_events, refused_reason
                    FROM fanin_flush($1, $2, $3, $4)`

// startFlush runs a flush in the background, on a connection of the pool, and returns at
// once: the coordinator goes on claiming and reading replies while PostgreSQL applies the
// inbox, and handles the result as an event (onFlushed). One flush at a time, and the
// coordinator is still the inbox's only consumer (I1). The hints are taken now: a hint that
// arrives meanwhile may be for an event this flush's snapshot does not see, so it counts
// towards the next flush.
func (c *coordinator) startFlush() {
	f := c.fanin
	f.busy = true
	f.lastFlush = time.Now()
	f.hints = 0
	f.inbox = false
	clear(f.hinted)
	lockFirst := f.heldGroups > 0
	retry, pass := f.refusedDue(f.lastFlush)
	c.inBackground(func() event { return f.runFlush(c.ctx, c.db, lockFirst, retry, pass) })
}

// refusedDue splits the groups the database refused to apply into those to try again now
// (refused at least heldRetryGap before now) and those the flush leaves in the inbox: each is
// tried once a second, not at every flush, and in a statement of its own (fanin_flush says
// why).
func (f *fanin) refusedDue(now time.Time) (retry, pass []int64) {
	for g, at := range f.refused {
		if now.Before(at) {
			pass = append(pass, g)
		} else {
			retry = append(retry, g)
		}
	}
	return retry, pass
}

// runFlush applies the inbox until it is empty (or a batch comes back short), leaving the
// events of the groups in pass where they are, and those of each group a statement of it
// refused for the statements after; the groups in retry, refused before, first, in a
// statement of their own. It reads only
// the settings fixed when f was made (batch, the fail hook), so it may run on the flush goroutine
// while the coordinator changes the rest of f. lockFirst (the last flush passed groups over)
// has the first statement lock its rows before applying them, and so each statement after
// one that passed groups over: a group held for long would otherwise cost every flush the
// 100 ms fanin_flush waits for a row before passing it over.
func (f *fanin) runFlush(ctx context.Context, db *sql.DB, lockFirst bool, retry, pass []int64) faninFlushed {
	start := time.Now()
	var ev faninFlushed
	if len(retry) > 0 {
		var r flushResult
		if ev.err = f.flushOnce(ctx, db, lockFirst, pass, retry, &r); ev.err != nil {
			ev.took = time.Since(start)
			return ev
		}
		ev.results = append(ev.results, r)
		pass = append(pass, retry...) // tried: applied, or refused again
	}
	for {
		var r flushResult
		if ev.err = f.flushOnce(ctx, db, lockFirst, pass, nil, &r); ev.err != nil {
			break
		}
		ev.results = append(ev.results, r)
		lockFirst = r.held > 0
		pass = append(pass, r.refusedIDs...)
		if r.events+r.refusedEvents < f.batch {
			break
		}
	}
	ev.took = time.Since(start)
	return ev
}

// onFlushed takes a flush's results into the coordinator's state.
func (c *coordinator) onFlushed(ev faninFlushed) {
	f := c.fanin
	f.busy = false
	for _, r := range ev.results {
		f.stats.Flushes++
		f.stats.Events += int64(r.events)
		f.stats.Wakes += int64(r.woken)
		f.stats.LateEvents += int64(r.late)
		f.stats.Quarantined += int64(r.quarantined)
		if r.quarantined > 0 {
			c.log.Error("fan-in: groups quarantined (inconsistent completion evidence); the sweep will recount them",
				"groups", r.quarantined)
			c.timers.schedule(timerKey{kind: timerSweep}, time.Now())
		}
		for i, g := range r.openIDs {
			f.remaining[g] = int(r.openRemaining[i])
		}
		if r.woken > 0 {
			c.claimWanted = true // the woken parents are pending at their continuation stage
			c.log.Debug("fan-in: parents woken", "parents", r.woken, "groups_fired", r.groupsFired)
		}
	}
	f.stats.FlushMs += ev.took.Milliseconds()
	c.onRefusedGroups(ev)
	// Forget groups not hinted for a long time: remaining is only a shortcut for the wake
	// rule, and a group we know nothing about is flushed at its next hint anyway.
	if len(f.remaining) > 100000 {
		clear(f.remaining)
	}
	if ev.err != nil {
		// The events stay in the inbox. Try again after FANIN_MAX_DELAY; a database that is
		// gone is the claim's business (it holds the lock connection).
		f.inbox = true
		if f.failures++; f.failures == 1 || isPowerOfTen(f.failures) {
			c.log.Warn("fan-in flush failed; the inbox is kept and flushed again", "err", ev.err,
				"failures", f.failures, "retry_in", f.maxDelay)
		}
		return
	}
	if f.failures > 0 {
		c.log.Info("fan-in flush works again", "failures_before", f.failures)
		f.failures = 0
	}
	if n := len(ev.results); n > 0 {
		c.onHeldGroups(ev.results[n-1].held) // the last statement's: the groups still passed over
	}
	if f.ready == readyOwed {
		f.ready = readyDue // the inbox is empty as of this flush: settle starts fire_ready now
	}
}

// onRefusedGroups takes the groups whose events a flush's statements refused by themselves
// (fanin_flush's refused_ids: an application's rule that will not let a waiting parent wake)
// into f.refused: each is left in the inbox by the flushes of the next heldRetryGap and then
// tried again, said once until a flush that tries it no longer refuses it. The inbox flag
// stays set while any is left, so a flush comes due for them without a hint.
func (c *coordinator) onRefusedGroups(ev faninFlushed) {
	f := c.fanin
	if len(f.refused) == 0 && !slices.ContainsFunc(ev.results, func(r flushResult) bool { return len(r.refusedIDs) > 0 }) {
		return // the usual flush: nothing refused, now or before
	}
	now := time.Now()
	refused := map[int64]bool{}
	var fresh []int64
	reason := ""
	for _, r := range ev.results {
		for _, g := range r.refusedIDs {
			if _, known := f.refused[g]; !known && !refused[g] {
				fresh = append(fresh, g)
			}
			refused[g] = true
			f.refused[g] = now.Add(heldRetryGap)
		}
		if reason == "" && r.refusedReason.Valid {
			reason = r.refusedReason.String
		}
	}
	if ev.err == nil {
		// Every group this flush tried (not passed: due at its start) and did not refuse is
		// applied, or has no events left.
		for g, at := range f.refused {
			if !f.lastFlush.Before(at) && !refused[g] {
				delete(f.refused, g)
			}
		}
	}
	if len(f.refused) > 0 {
		f.inbox = true
	}
	if len(fresh) > 0 {
		slices.Sort(fresh)
		c.sayRefused("fan-in: the database refused to apply these groups' completions by themselves (an application's rule on a waiting parent); their events wait, tried again every second, the other groups go on",
			"groups", fresh, "err", reason)
	}
}

// onHeldGroups takes the number of groups the last flush passed over because another
// transaction holds a row it would write (fanin_flush's held). Their events stay first in the
// inbox; the inbox flag makes the next flush due FANIN_MAX_DELAY after this one's start, so a
// held parent is woken within about that of being let go, as long as a hint or the claims'
// look at the inbox keep the flag (the claims set it from the inbox each time).
func (c *coordinator) onHeldGroups(held int) {
	f := c.fanin
	f.heldGroups = held
	if held == 0 {
		if f.heldFlushes > 0 {
			c.log.Info("fan-in: groups held by other transactions applied", "flushes_before", f.heldFlushes)
			f.heldFlushes = 0
		}
		return
	}
	f.inbox = true
	if f.heldFlushes++; f.heldFlushes == 1 || isPowerOfTen(f.heldFlushes) {
		c.log.Warn("fan-in: groups passed over, another transaction holds a row they write (a waiting parent, a fanout row); their events wait",
			"groups", held, "flushes", f.heldFlushes, "retry_in", f.maxDelay)
	}
}

// flushOnce runs one fanin_flush statement on a connection of db (see runFlush: fixed
// settings and the fail hook only).
func (f *fanin) flushOnce(ctx context.Context, db *sql.DB, lockFirst bool, pass, only []int64, r *flushResult) error {
	ctx, cancel := context.WithTimeout(ctx, dbStatementBudget)
	defer cancel()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("fan-in flush: begin: %w", err)
	}
	defer tx.Rollback() // a no-op after Commit; the error of a rollback after a failure adds nothing
	var onlyList any    // NULL: every group but those passed
	if only != nil {
		onlyList = pq.Array(only)
	}
	if err := tx.QueryRowContext(ctx, flushSQL, f.batch, lockFirst, idList(pass), onlyList).Scan(&r.events, &r.groupsFired,
		&r.woken, &r.late, &r.quarantined, &r.held, pq.Array(&r.openIDs), pq.Array(&r.openRemaining),
		pq.Array(&r.refusedIDs), &r.refusedEvents, &r.refusedReason); err != nil {
		return fmt.Errorf("fan-in flush: %w", err)
	}
	if r.events > 0 {
		f.hit("fanin-flush-before-commit")
	}
	if r.groupsFired > 0 {
		// The same point for a flush that fires a group: a crash test that needs the lost
		// commit to hold a wake waits for it here, not for the load to make one likely.
		f.hit("fanin-flush-fired-before-commit")
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("fan-in flush: commit: %w", err)
	}
	if r.events > 0 {
		f.hit("fanin-flush-after-commit")
	}
	return nil
}

// faninStartup asks for what a start owes fan-in (doc/design/fanin.md §3.8): the inbox
// emptied and the groups already complete fired, since after a crash evidence may be waiting
// that nobody will hint about. Both run in the background, the flush as any flush does and
// fire_ready after the first flush that succeeds (onFlushed, readyDue), so a row that another
// transaction holds (an operator's UPDATE left open on a parent, a group's fanout row) delays
// only the groups that need it: on the lock connection before the loop, fire_ready waited for
// it with no budget, and the start never said "dispatching"; the start's flush, failing at its
// budget, ended the run (TestFaninStartupReadyGroupsHeld, TestFaninStartupInboxGroupHeld).
func (c *coordinator) faninStartup() {
	c.fanin.inbox = true
	c.fanin.ready = readyOwed
	// An early sweep pass after a start: drift is most likely after a crash.
	c.timers.schedule(timerKey{kind: timerSweep}, time.Now().Add(time.Second))
}

// faninReadied is the event the start's fire_ready sends back to the coordinator.
type faninReadied struct {
	fired, woken, held, refused int
	err                         error
}

// startFireReady runs fanin_fire_ready in the background, on a connection of the pool, within
// one statement budget: it fires every complete open group with no unapplied events, and
// passes over the groups a row of which another transaction holds (held). The flushes go on
// meanwhile: a group it fires has no events, so no flush touches it, and the wake log's key
// forbids a second fire whatever the order.
func (c *coordinator) startFireReady() {
	f := c.fanin
	f.ready = readyRunning
	c.inBackground(func() event {
		f.hit("fanin-fire-ready")
		ctx, cancel := context.WithTimeout(c.ctx, dbStatementBudget)
		defer cancel()
		var ev faninReadied
		if err := c.db.QueryRowContext(ctx, `SELECT groups_fired, parents_woken, held, refused FROM fanin_fire_ready()`).
			Scan(&ev.fired, &ev.woken, &ev.held, &ev.refused); err != nil {
			ev.err = fmt.Errorf("fan-in: fire ready groups: %w", err)
		}
		return ev
	})
}

// onReadied takes the start's fire_ready into the coordinator's state. A failure, or groups
// passed over because another transaction holds a row of theirs, is tried again heldRetryGap
// later (the inbox was emptied once, which is all the order asks; another error must not make
// it spin).
func (c *coordinator) onReadied(ev faninReadied) {
	f := c.fanin
	if ev.err != nil {
		f.ready, f.readyAt = readyDue, time.Now().Add(heldRetryGap)
		if f.readyFails++; f.readyFails == 1 || isPowerOfTen(f.readyFails) {
			c.log.Warn("fan-in: firing the complete groups at start-up failed; tried again",
				"err", ev.err, "failures", f.readyFails, "retry_in", heldRetryGap)
		}
		return
	}
	f.stats.Wakes += int64(ev.woken)
	if ev.fired > 0 {
		c.log.Info("fan-in: complete groups fired at start-up", "groups", ev.fired, "parents_woken", ev.woken)
	}
	if ev.woken > 0 {
		c.claimWanted = true // the woken parents are pending at their continuation stage
	}
	if ev.held > 0 || ev.refused > 0 {
		f.ready, f.readyAt = readyDue, time.Now().Add(heldRetryGap)
		if f.readyFails++; f.readyFails == 1 || isPowerOfTen(f.readyFails) {
			if ev.held > 0 {
				c.log.Warn("fan-in: complete groups passed over at start-up, another transaction holds a row they write (a waiting parent, a fanout row); tried again",
					"groups", ev.held, "tries", f.readyFails, "retry_in", heldRetryGap)
			}
			if ev.refused > 0 {
				c.log.Warn("fan-in: the database refused to wake the parents of complete groups at start-up by themselves (an application's rule on a waiting parent); the others are woken, these tried again",
					"groups", ev.refused, "tries", f.readyFails, "retry_in", heldRetryGap)
			}
		}
		return
	}
	f.ready = readyDone
}

// sweepResult is one fanin_sweep call's result.
type sweepResult struct {
	repaired, examined, orphans, fired, woken int
	refused                                   int // wakes the database refused by themselves, left for the next pass
	broken                                    []int64
	next                                      int64 // the keyset cursor for the next page; 0 ends the pass
}

// sweepOnce runs one page of the sweep from the cursor after, on a connection of db, in an
// explicit transaction of its own, as flushOnce does and for the same reason: the failpoint
// between the statement and its commit is inert in shape. It reads only the fail hook, fixed
// when f was made, so it may run on the sweep goroutine (startSweep).
func (f *fanin) sweepOnce(ctx context.Context, db *sql.DB, after int64, page int, minAge time.Duration) (sweepResult, error) {
	ctx, cancel := context.WithTimeout(ctx, dbStatementBudget)
	defer cancel()
	var r sweepResult
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return r, fmt.Errorf("fan-in sweep: begin: %w", err)
	}
	defer tx.Rollback() // a no-op after Commit; the error of a rollback after a failure adds nothing
	if err := tx.QueryRowContext(ctx, `
			SELECT repaired, examined, orphans_woken, groups_fired, parents_woken, broken, next_after, refused
			  FROM fanin_sweep($1, $2, make_interval(secs => $3))`,
		after, page, minAge.Seconds()).
		Scan(&r.repaired, &r.examined, &r.orphans, &r.fired, &r.woken, pq.Array(&r.broken), &r.next,
			&r.refused); err != nil {
		return r, fmt.Errorf("fan-in sweep: %w", err)
	}
	if r.repaired > 0 {
		f.hit("fanin-sweep-before-commit")
	}
	if err := tx.Commit(); err != nil {
		return r, fmt.Errorf("fan-in sweep: commit: %w", err)
	}
	return r, nil
}

// faninSwept is the event a page of the sweep in the background sends back to the coordinator.
type faninSwept struct {
	r   sweepResult
	err error
}

// startSweep runs one page of the safety sweep in the background, on a connection of the
// pool, and returns at once, like startFlush and for the same reason: the claim loop never
// waits for it. A page recounts groups under row locks on fanout (fanin_recount), so a
// transaction that holds one of those rows (an operator's, a stuck flush's) can hold the page
// for up to dbStatementBudget; on the coordinator's own connection, as the sweep first ran,
// that stopped every claim meanwhile (TestFaninSweepBlockedClaimsGoOn). One page at a time;
// the result is handled by onSwept, which schedules the next.
func (c *coordinator) startSweep() {
	f := c.fanin
	d := c.cfg.Dispatch
	f.sweeping = true
	after, page, minAge := f.sweepAfter, d.SweepPage, d.SweepMinAge
	c.inBackground(func() event {
		r, err := f.sweepOnce(c.ctx, c.db, after, page, minAge)
		return faninSwept{r: r, err: err}
	})
}

// onSwept takes a page of the sweep into the coordinator's state and schedules the next.
func (c *coordinator) onSwept(ev faninSwept) {
	f := c.fanin
	f.sweeping = false
	next := c.cfg.Dispatch.SweepInterval // until the next pass
	r := ev.r
	if ev.err != nil {
		c.log.Warn("fan-in sweep failed; retried at the next interval", "err", ev.err, "in", next)
	} else {
		f.stats.SweepRepaired += int64(r.repaired)
		f.stats.Wakes += int64(r.woken)
		if r.repaired > 0 || r.orphans > 0 || len(r.broken) > 0 {
			c.log.Warn("fan-in sweep repaired drift (completion evidence was lost or inconsistent)",
				"repaired", r.repaired, "orphans_woken", r.orphans, "broken", r.broken, "examined", r.examined)
		}
		if r.refused > 0 {
			c.log.Warn("fan-in sweep: the database refused to wake these parents by themselves (an application's rule on a waiting parent); left waiting for the next pass, the rest of the page done",
				"parents", r.refused)
		}
		if r.woken > 0 || r.orphans > 0 {
			c.claimWanted = true // both are pending at their continuation now
		}
		f.sweepAfter = r.next
		if r.next != 0 {
			next = sweepNextPage // the rest of this pass
		}
	}
	if f.sweepSoon { // a quarantine asked for a recount while this page ran, failed or not
		next, f.sweepSoon = 0, false
	}
	c.timers.schedule(timerKey{kind: timerSweep}, time.Now().Add(next))
}
