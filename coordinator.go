// coordinator.go: the one goroutine that owns the dispatcher's state, and its select loop.
//
// The coordinator owns the pools, the workers, the in-flight messages, the timer heap, the
// queued writes and the statistics; nothing else touches them. Other goroutines only send it
// events: worker replies and exits (worker.go), notifications (pq.Listener), signals. Each turn
// of the loop handles one event, drains whatever else is pending (so per-stage free capacity is
// current), then settles: writes queued outcomes, returns due paused rows, and claims for every
// stage with free capacity in one statement. Then it sleeps until the next event or deadline.
//
// This file keeps the loop and the state; the handlers it calls are methods of the same
// coordinator, in the files named for what they handle: claim.go (claim, hand-out),
// outcome.go (replies), supervise.go (worker lives and exits), reload.go, shutdown.go,
// outage.go (refused statements, lost lock), stats.go (flush), fanin.go (fan-in).

package main

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/lib/pq"
)

// dbStatementBudget bounds how long the coordinator waits on one of its own statements before
// treating the database as unavailable and carrying on with its other duties. Every statement
// the loop itself runs takes its context from budget(); a hung server then costs one budget
// and a back-off, not the whole dispatcher.
const dbStatementBudget = 10 * time.Second

// statsIdleMinGap: the idle flush of statistics happens at most once per this period.
const statsIdleMinGap = time.Second

// eventBuffer sizes the worker event channel: a send blocks only while the coordinator is in a
// database statement, and one reply burst per worker is the most that can pile up meanwhile.
// Senders also watch the coordinator's context, so a full channel never strands them.
const eventBuffer = 256

type coordinator struct {
	cfg     *Config
	version string
	log     *slog.Logger
	db      *sql.DB   // the pool: statistics, overlay reads
	inst    *instance // the lock connection: claims and row writes
	claimer claimer

	notify <-chan *pq.Notification // nil once the listener is closed
	sigs   <-chan os.Signal        // SIGINT, SIGTERM: shut down
	hups   <-chan os.Signal        // SIGHUP: reload the stage graph, as config_changed does

	ctx    context.Context // lives until the workers' goroutines are done sending
	wg     *sync.WaitGroup // the workers' goroutines and a background fan-in flush or sweep page
	events chan event      // workerReplies, workerExit, faninFlushed, faninSwept, faninReadied

	timers *timerHeap
	timer  *time.Timer

	pools        map[string]*pool // by stage name; replaced as a whole by a reload
	gen          int              // stage-table generation
	nextPoolID   int
	workers      map[int]*worker // every live worker process, current generation or not
	nextWorkerID int
	inflight     map[string]int // messages in workers' queues, per stage
	inflightAll  int
	keys         keyLoad  // the same, per concurrency key, and the stages' KEY_LIMITs (keys.go)
	workerEnv    []string // environment common to all workers
	workerDSN    string   // PEPSI_DSN: the DSN with the worker application_name

	claimWanted  bool   // something may have become claimable
	lockUnheard  bool   // a heartbeat came and no statement has gone over the lock connection since
	backlog      bool   // the last claim filled a stage: claim again as soon as room frees
	retryWanted  bool   // paused rows may be due
	reloadWanted bool   // config_changed (or a listener reconnect) asks for a reload
	fileStages   string // the file's stage graph as last published (fileStagesJSON)

	failures  []failure  // failure writes not yet committed
	resets    []*message // reset writes not yet committed
	dbWaiting bool       // the database refused a write: wait for timerDB
	dbBackoff backoff
	// Writes whose rows another transaction held when they were sent (retry.go): sent again
	// with the queued ones from heldWritesAt on, not at every settle (outcome.go).
	heldFailures []failure
	heldResets   []*message
	// flipRefused: paused rows whose return to pending the database refused by itself; left
	// out of the flip's statement and tried alone at each flip (flip).
	flipRefused  map[int64]bool
	heldWritesAt time.Time
	refusedLog   failureLog // the rate limit of "refused this message's failure write alone" lines

	locked        bool      // the lock connection is up and ours
	outageAt      time.Time // when the lock connection was last lost (failover.go: outageWorker)
	relockBackoff backoff

	stats          *Stats
	lastStatsFlush time.Time // the last flush attempt
	statsRefused   int       // flushes failed in a row (flushStats)
	statsWarnedAt  time.Time // when the last of them was logged
	lastFlip       time.Time // when the last return of due paused rows started (scheduleRetry)

	shutdown bool  // a signal arrived: no claims, workers finish their queues
	fatal    error // ends the loop with exit status 1

	fanin    *fanin         // fan-in hints, flush and sweep state
	metrics  *metricsServer // nil unless METRICS_LISTEN is set
	notifier *notifier      // systemd readiness and watchdog; no-op outside systemd
	retain   *retainer      // nil unless RETENTION is set
	ha       *haBoard       // the role, the server and the reconciles (failover.go)
	strays   strays         // pending rows at stages the configuration lacks (strays.go)
	started  time.Time
	claimMax time.Duration // the longest claim statement since the start (/metrics)

	stageFailing map[string]*failureLog // per stage: the rate limit of its failure lines
	// stderrBudgets: per stage, the rate limit of its workers' standard-error lines (shared with
	// their logLoop goroutines; kept across reloads, as a stage's name is).
	stderrBudgets map[string]*stderrBudget
	sendBuf       []byte
	want          map[string]int
}

// coordinatorDeps is what a coordinator is built from: the running configuration and the
// connections, channels and services main has set up for it.
type coordinatorDeps struct {
	cfg     *Config // with the stage table as read at start (file and config table)
	version string
	log     *slog.Logger
	db      *sql.DB
	inst    *instance // the single-instance lock, already taken

	notify <-chan *pq.Notification // the LISTEN channel
	sigs   <-chan os.Signal        // SIGINT, SIGTERM
	hups   <-chan os.Signal        // SIGHUP

	metrics  *metricsServer // nil unless METRICS_LISTEN is set
	notifier *notifier      // systemd; a no-op value outside it
	retain   *retainer      // nil unless RETENTION is set
	ha       *haBoard       // the role and the server, shared with /metrics

	orphans     []*message     // the running rows of an earlier run that resetOrphans met
	orphansHeld map[int64]bool // those it could not reset: another transaction held them
	// orphansRefused: those whose reset the database refused by itself (resetRows)
	orphansRefused map[int64]error
}

// newCoordinator builds a coordinator over an acquired instance. ctx must outlive the
// workers' goroutines (loop's caller cancels it, then waits for c.wg).
func newCoordinator(ctx context.Context, d coordinatorDeps) *coordinator {
	cfg, inst := d.cfg, d.inst
	c := &coordinator{
		cfg: cfg, version: d.version, log: d.log, db: d.db, inst: inst,
		notify: d.notify, sigs: d.sigs, hups: d.hups,
		metrics: d.metrics, notifier: d.notifier, retain: d.retain, ha: d.ha,
		ctx: ctx, wg: &sync.WaitGroup{}, events: make(chan event, eventBuffer),
		timers: newTimerHeap(), timer: time.NewTimer(time.Hour),
		workers: map[int]*worker{}, inflight: map[string]int{},
		dbBackoff:     backoff{min: 100 * time.Millisecond, max: 5 * time.Second},
		relockBackoff: backoff{min: 100 * time.Millisecond, max: relockMaxDelay},
		stats:         newStats(), locked: true, stageFailing: map[string]*failureLog{}, stderrBudgets: map[string]*stderrBudget{},
		want: map[string]int{}, started: time.Now(),
	}
	c.workerDSN = dsnWith(cfg.DSN, "application_name", inst.workerAppName())
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch {
		case strings.HasPrefix(k, "PEPSI_") && k != "PEPSI_TEST_WORKER", k == "PGAPPNAME":
			continue // set per worker below
		case k == "NOTIFY_SOCKET" || k == "WATCHDOG_USEC" || k == "WATCHDOG_PID" || k == "LISTEN_FDS" || k == "LISTEN_PID":
			continue // systemd's, for the daemon alone: a worker must not answer for it
		case k == "JOURNAL_STREAM":
			continue // a worker's standard error is a pipe to the daemon, not the journal
		}
		c.workerEnv = append(c.workerEnv, kv)
	}
	c.workerEnv = append(c.workerEnv, "PGAPPNAME="+inst.workerAppName())
	c.fanin = newFanin(cfg.Dispatch, &c.stats.Fanin)
	c.setStages(cfg.Stages)
	// Held orphans are reset once their holder lets go, like the reconcile's; refused ones
	// are tried again as often.
	c.keepRefusedResets(d.orphans, d.orphansRefused, d.orphansHeld)
	if c.keepHeldResets(d.orphans, d.orphansHeld) > 0 {
		c.retryHeldAfter(time.Now())
	}
	return c
}

// loop runs until shutdown completes (nil) or a fatal error.
func (c *coordinator) loop() error {
	now := time.Now()
	c.timers.schedule(timerKey{kind: timerHeartbeat}, now.Add(c.cfg.Dispatch.PollInterval))
	c.timers.schedule(timerKey{kind: timerStats}, now.Add(c.cfg.Dispatch.StatsInterval))
	if c.metrics != nil {
		c.metrics.publish(c.snapshot())
		c.timers.schedule(timerKey{kind: timerMetrics}, now.Add(metricsPublishEvery))
	}
	if c.retain != nil {
		// The first turn comes soon after start (old rows may have piled up while stopped).
		c.timers.schedule(timerKey{kind: timerRetention}, now.Add(time.Second))
	}
	if d := watchdogInterval(); d > 0 {
		c.timers.schedule(timerKey{kind: timerSDWatchdog}, now)
	}
	c.timers.schedule(timerKey{kind: timerStrays}, now.Add(time.Second))
	c.claimWanted, c.retryWanted = true, true
	for {
		c.settle()
		if c.inflightAll > 0 || c.shutdown {
			c.stopRetention() // a turn runs only while the pipeline is idle (after any return of settle)
		}
		if c.fatal != nil {
			c.abort()
			return c.fatal
		}
		if c.shutdown && len(c.workers) == 0 && !c.fanin.busy && !c.fanin.sweeping && c.fanin.ready != readyRunning && !c.retaining() {
			c.finish()
			return nil
		}
		c.arm()
		select {
		case ev := <-c.events:
			c.handle(ev)
		case n, ok := <-c.notify:
			c.onNotify(n, ok)
		case s := <-c.sigs:
			c.onSignal(s)
		case <-c.hups:
			c.log.Info("SIGHUP: reloading the stage graph")
			c.reloadWanted = true
		case <-c.timer.C:
			c.onTimers()
		}
		c.drain()
	}
}

// drain handles every event already waiting, so that the claim sees current capacity.
func (c *coordinator) drain() {
	for {
		select {
		case ev := <-c.events:
			c.handle(ev)
		case n, ok := <-c.notify:
			c.onNotify(n, ok)
		default:
			return
		}
	}
}

// arm sets the one timer to the earliest deadline.
func (c *coordinator) arm() {
	at, ok := c.timers.next()
	if !ok {
		at = time.Now().Add(time.Hour)
	}
	c.timer.Reset(time.Until(at)) // go ≥ 1.23: no drain needed before Reset
}

// event is what another goroutine sends the coordinator. Each kind names its handler, so the
// loop cannot be sent a kind it does not handle (the compiler checks what a type switch could
// only find at run time).
type event interface {
	handleIn(c *coordinator)
}

func (ev workerReplies) handleIn(c *coordinator) { c.onReplies(ev) }  // outcome.go
func (ev workerExit) handleIn(c *coordinator)    { c.onExit(ev) }     // supervise.go
func (ev faninFlushed) handleIn(c *coordinator)  { c.onFlushed(ev) }  // fanin.go
func (ev faninSwept) handleIn(c *coordinator)    { c.onSwept(ev) }    // fanin.go
func (ev faninReadied) handleIn(c *coordinator)  { c.onReadied(ev) }  // fanin.go
func (ev retentionDone) handleIn(c *coordinator) { c.onRetained(ev) } // retention.go
func (ev straysFound) handleIn(c *coordinator)   { c.onStrays(ev) }   // strays.go

func (c *coordinator) handle(ev event) { ev.handleIn(c) }

// inBackground runs work on a goroutine of the coordinator's wait group (the flush, a page of
// the sweep, a retention turn) and sends its result to the loop as an event; when the run is
// ending, nobody reads the events any more, and the goroutine ends without sending.
func (c *coordinator) inBackground(work func() event) {
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		ev := work()
		select {
		case c.events <- ev:
		case <-c.ctx.Done():
		}
	}()
}

// budget is the context of one of the loop's own statements: dbStatementBudget at most.
func (c *coordinator) budget() (context.Context, context.CancelFunc) {
	return context.WithTimeout(c.ctx, dbStatementBudget)
}

// settle does the database work the events asked for: queued writes, due retries, the claim.
func (c *coordinator) settle() {
	if !c.locked || c.dbWaiting {
		return
	}
	if c.outcomesDue(time.Now()) {
		if !c.writeOutcomes() {
			return
		}
	}
	if c.reloadWanted && !c.shutdown {
		c.reload()
		if c.fatal != nil || c.dbWaiting {
			return
		}
	}
	if due, at := c.fanin.due(time.Now(), c.inflightAll); due {
		c.startFlush()
	} else if !at.IsZero() {
		c.timers.scheduleEarlier(timerKey{kind: timerFanin}, at)
	}
	if f := c.fanin; f.ready == readyDue && !c.shutdown {
		if now := time.Now(); now.Before(f.readyAt) {
			c.timers.scheduleEarlier(timerKey{kind: timerFanin}, f.readyAt)
		} else {
			c.startFireReady()
		}
	}
	if c.retryWanted {
		n, next, err := c.flip()
		if err != nil {
			c.dbTrouble("return due paused rows", err)
			return
		}
		c.retryWanted = false
		c.stats.Global.Retried += n
		c.scheduleRetry(next)
		if n > 0 {
			c.claimWanted = true
			c.log.Debug("paused rows due again", "rows", n)
		}
	}
	if c.claimWanted && !c.shutdown {
		c.claim()
	}
	if c.lockUnheard && c.locked && !c.dbWaiting {
		// Every stage full or held, so the heartbeat's claim sent nothing: the lock connection
		// is proven otherwise, once per POLL_INTERVAL. Workers stuck on a server that vanished
		// send no replies and so ask for no claim, and its loss went unseen for as long as they
		// were stuck (TestFailoverPrimaryVanishes); its Dialer bounds the ping (LOCK_KEEPALIVE).
		c.lockUnheard = false
		if err := c.pingLock(); err != nil {
			c.dbTrouble("prove the lock connection", err)
		}
	}
	if c.inflightAll == 0 && c.stats.dirty() {
		// The pipeline went idle: flush soon, so a finished burst's figures need not wait
		// for the next STATS_INTERVAL tick, but at most once a second (also while the
		// database refuses the flush: lastStatsFlush is the last attempt).
		at := c.lastStatsFlush.Add(statsIdleMinGap)
		if now := time.Now(); at.Before(now) {
			at = now
		}
		c.timers.scheduleEarlier(timerKey{kind: timerStats}, at)
	}
}

// heldRetryGap: how soon a due paused row that the last flip did not return is tried again.
const heldRetryGap = time.Second

// scheduleRetry sets the retry timer to the earliest paused row's due time (zero: none), on
// our clock (dueAt). A due time no later than the start of the last flip belongs to a row that
// flip passed over, held by another transaction (retrySQL). Every claim reports it again; it
// is tried heldRetryGap after that flip, not once after every claim.
func (c *coordinator) scheduleRetry(next time.Time) {
	key := timerKey{kind: timerRetry}
	if next.IsZero() {
		c.timers.cancel(key)
		return
	}
	if !c.lastFlip.IsZero() && !next.After(c.lastFlip) {
		next = c.lastFlip.Add(heldRetryGap)
	}
	c.timers.schedule(key, next)
}

// onNotify handles LISTEN traffic. nil means the listener reconnected and may have missed
// notifications: claim now and re-read the configuration.
func (c *coordinator) onNotify(n *pq.Notification, ok bool) {
	if !ok {
		c.notify = nil
		return
	}
	switch {
	case n == nil:
		c.claimWanted, c.retryWanted, c.reloadWanted = true, true, true
	case n.Channel == "config_changed":
		c.reloadWanted = true
	case n.Channel == "workqueue_cancel":
		c.onCancel(n.Extra)
	default:
		c.claimWanted = true
	}
}

// onTimers runs every due deadline.
func (c *coordinator) onTimers() {
	now := time.Now()
	for {
		key, ok := c.timers.popDue(now)
		if !ok {
			return
		}
		switch key.kind {
		case timerHeartbeat:
			// One statement per POLL_INTERVAL when idle: the claim also returns the earliest
			// paused row's due time, and the retry timer (set from it) flips due rows.
			c.log.Debug("heartbeat")
			c.claimWanted, c.lockUnheard = true, true
			c.timers.schedule(key, now.Add(c.cfg.Dispatch.PollInterval))
		case timerRetry:
			c.retryWanted = true
		case timerIdle:
			c.onIdleTimer(key, now)
		case timerWatchdog:
			c.watchdog(key, now)
		case timerLinger:
			c.onLinger(key)
		case timerHold, timerRefused:
			c.claimWanted = true
		case timerStats:
			c.flushStats(false)
			c.timers.schedule(key, now.Add(c.cfg.Dispatch.StatsInterval))
		case timerDB:
			c.dbWaiting = false
		case timerHeldWrites:
			// settle sends them again: outcomesDue.
		case timerRelock:
			c.relock()
		case timerFanin:
			// settle decides: the coalescing delay is over, or the start's fire_ready is due.
		case timerSweep:
			switch {
			case c.fanin.sweeping:
				c.fanin.sweepSoon = true // onSwept schedules the next page at once
			case c.locked && !c.shutdown:
				c.startSweep()
			default:
				c.timers.schedule(key, now.Add(time.Second))
			}
		case timerSDWatchdog:
			// Sent from the loop itself: a coordinator stuck anywhere stops the pings.
			c.notifier.send("WATCHDOG=1")
			c.timers.schedule(key, now.Add(watchdogInterval()))
		case timerRetention:
			c.timers.schedule(key, now.Add(retentionEvery))
			if c.inflightAll == 0 && c.locked && !c.shutdown && !c.retain.running {
				c.startRetention() // the loop stops it when messages are in flight again
			}
		case timerStrays:
			c.timers.schedule(key, now.Add(strayEvery))
			if c.locked && !c.shutdown && !c.strays.running {
				c.startStrayCheck()
			}
		case timerMetrics:
			c.metrics.publish(c.snapshot())
			c.timers.schedule(key, now.Add(metricsPublishEvery))
		case timerShutdown:
			if len(c.workers) > 0 {
				c.log.Warn("shutdown grace over: killing remaining workers", "workers", len(c.workers))
				c.killAll()
			}
		default:
			panic(fmt.Sprintf("coordinator: unknown timer %v", key)) // our own tables disagree
		}
	}
}
