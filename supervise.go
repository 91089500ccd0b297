// supervise.go: the mechanism of worker supervision: start, stop, retire, kill, reap, throttle.
//
// A worker's life is two fields: its state (does it take messages, is it on its way out) and
// its fate (why the coordinator ended it, so that its exit is not read as a crash). Every
// transition of either is in this file, and so is the accounting of an exit: which message
// fails, which go back to pending, whether the stage is held. The policy that decides when a
// worker is wanted (how many, which one gets a message) is pool.go's and calls in here only
// through spawn and stop, as Postfix keeps master_avail.c apart from master_spawn.c. The
// process itself (exec, pipes, the goroutines that read it) is worker.go's.

package main

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// workerState is where a worker is in its life.
type workerState int

const (
	workerRunning  workerState = iota // takes new messages
	workerDraining                    // takes no new messages; stdin is closed once its queue is empty
	workerStopping                    // stdin closed or killed; waiting for its exit
)

// workerFate records why the coordinator ended a worker, so its exit is not read as a crash.
type workerFate int

const (
	fateNone      workerFate = iota // still alive, or died on its own (a crash)
	fateStopped                     // stdin closed by us (idle, recycled, shutdown): a clean exit is expected
	fateTimeout                     // killed by the watchdog: the head message timed out
	fateProtocol                    // killed after a reply that did not parse (head already failed)
	fateRetired                     // killed by a reload or a shutdown: its queue goes back to pending
	fateCancelled                   // killed because an operator cancelled its head (operate.go): as retired
)

const (
	holdMin = 1 * time.Second  // first cool-down of a stage whose program cannot start
	holdMax = 60 * time.Second // the cool-down doubles up to this

	// startupWindow: a worker that dies without answering within this long after its start
	// is taken for a program that cannot start (held stage, messages untouched), not for a
	// message that crashed it (head failed).
	startupWindow = 5 * time.Second

	// stopLinger is how long a worker whose stdin we closed may take to exit before it is killed.
	stopLinger = 5 * time.Second
)

// spawn starts a worker for p; on failure the stage is held and nil returned.
func (c *coordinator) spawn(p *pool, now time.Time) *worker {
	id := c.nextWorkerID
	c.nextWorkerID++
	env := append(c.workerEnv[:len(c.workerEnv):len(c.workerEnv)],
		"PEPSI_STAGE="+p.cfg.Name,
		"PEPSI_NEXT="+strings.Join(p.cfg.Next, " "),
		"PEPSI_DSN="+c.workerDSN,
		"PEPSI_FUSE="+p.fuse,
		"PEPSI_MAX_CHILDREN="+strconv.Itoa(p.cfg.MaxChildren),
		"PEPSI_MIN_SPAN="+strconv.FormatInt(p.cfg.MinSpan, 10))
	budget := c.stderrBudgets[p.cfg.Name]
	if budget == nil {
		budget = &stderrBudget{}
		c.stderrBudgets[p.cfg.Name] = budget
	}
	w, err := startWorker(c.ctx, c.wg, c.events, c.log, id, p.cfg, p.gen, env, c.cfg.Dispatch.ConfigFile, budget)
	if err != nil {
		d := p.hold(now)
		c.timers.schedule(timerKey{timerHold, p.id}, p.holdUntil)
		c.log.Error("cannot start the stage's program; stage held, its rows stay pending",
			"stage", p.cfg.Name, "program", p.cfg.Program, "err", err, "hold", d)
		return nil
	}
	w.fusable = p.fusable
	c.workers[id] = w
	p.workers = append(p.workers, w)
	if w.limit < p.cfg.QueueLimit && !p.smallPipeSaid {
		p.smallPipeSaid = true
		c.log.Warn("a worker's stdin pipe holds fewer ids than QUEUE_LIMIT; its workers are given that many at most "+
			"(the dispatcher's user has 1,024 pipes open: see fs.pipe-user-pages-soft)",
			"stage", p.cfg.Name, "pid", w.pid, "ids", w.limit, "queue_limit", p.cfg.QueueLimit)
	}
	c.stats.stage(p.cfg.Name).WorkersStarted++
	c.log.Debug("worker started", "stage", p.cfg.Name, "pid", w.pid, "workers", len(p.workers))
	return w
}

// onIdle handles a worker whose queue just emptied.
func (c *coordinator) onIdle(w *worker, now time.Time) {
	w.idleSince = now
	switch w.state {
	case workerDraining:
		c.stop(w, now) // recycled after MAX_MESSAGES
	case workerRunning:
		c.timers.schedule(timerKey{timerIdle, w.id}, now.Add(c.cfg.Dispatch.WorkerIdleTimeout))
	}
}

// stop closes w's stdin: it exits once its queue is done, or is killed after stopLinger.
func (c *coordinator) stop(w *worker, now time.Time) {
	if w.state == workerStopping {
		return
	}
	w.state = workerStopping
	if w.fate == fateNone {
		w.fate = fateStopped
	}
	w.closeStdin()
	c.timers.schedule(timerKey{timerLinger, w.id}, now.Add(stopLinger))
}

// retire ends a worker of an older stage generation: at once if idle, else by killing it now
// that its current message has reported; the rest of its queue goes back to pending.
func (c *coordinator) retire(w *worker) {
	if len(w.queue) == 0 {
		c.stop(w, time.Now())
		return
	}
	if w.state != workerStopping {
		w.end(fateRetired)
	}
}

// killAll ends every worker at once (a second signal, the end of the grace, a fatal error).
// A fate already set by the watchdog or a protocol error stands: its head is accounted so.
func (c *coordinator) killAll() {
	for _, w := range c.workers {
		fate := w.fate
		if fate == fateNone || fate == fateStopped {
			fate = fateRetired
		}
		w.end(fate)
	}
}

// end kills w for the given reason; its exit is accounted by fate (onExit).
func (w *worker) end(fate workerFate) {
	w.fate = fate
	w.state = workerStopping
	w.kill()
}

// spent marks a worker that has been sent MAX_MESSAGES: it takes no more, and is stopped
// (recycled) once its pipeline has drained (onIdle).
func (w *worker) spent() {
	if w.state == workerRunning {
		w.state = workerDraining
	}
}

// onIdleTimer stops a worker that has been idle for WORKER_IDLE_TIMEOUT. The deadline is kept
// lazily, like the watchdog's: checked and re-armed when it fires.
func (c *coordinator) onIdleTimer(key timerKey, now time.Time) {
	w := c.workers[key.id]
	if w == nil || w.state != workerRunning || len(w.queue) != 0 {
		return
	}
	if idle := now.Sub(w.idleSince); idle >= c.cfg.Dispatch.WorkerIdleTimeout {
		c.log.Debug("stopping idle worker", "stage", w.stage, "pid", w.pid, "idle", idle.Round(time.Millisecond))
		c.stop(w, now)
	} else {
		c.timers.schedule(key, w.idleSince.Add(c.cfg.Dispatch.WorkerIdleTimeout))
	}
}

// onLinger kills a worker that did not exit within stopLinger of its stdin being closed.
func (c *coordinator) onLinger(key timerKey) {
	if w := c.workers[key.id]; w != nil {
		c.log.Warn("worker did not exit after its stdin was closed; killing it", "stage", w.stage, "pid", w.pid)
		w.kill()
	}
}

// watchdog kills a worker whose head message has run past MAX_RUNTIME. The deadline is kept
// lazily: it is not moved on every reply, only checked (and re-armed) when it fires.
func (c *coordinator) watchdog(key timerKey, now time.Time) {
	w := c.workers[key.id]
	if w == nil || len(w.queue) == 0 || w.fate == fateTimeout {
		return
	}
	due := w.headAt.Add(c.cfg.Dispatch.MaxRuntime)
	if now.Before(due) {
		c.timers.schedule(key, due)
		return
	}
	if c.shutdown {
		// A stop is not a failure of the message: like the workers the grace's end kills, its
		// whole queue goes back to pending, attempts unchanged.
		c.log.Warn("message ran past MAX_RUNTIME during the shutdown grace; killing its worker, the message goes back to pending",
			"stage", w.stage, "pid", w.pid, "id", w.queue[0].id, "max_runtime", c.cfg.Dispatch.MaxRuntime)
		w.end(fateRetired)
		return
	}
	c.log.Warn("message ran past MAX_RUNTIME; killing its worker", "stage", w.stage, "pid", w.pid,
		"id", w.queue[0].id, "max_runtime", c.cfg.Dispatch.MaxRuntime)
	if len(w.queue) > 1 { // one alone is its own (an isolating worker's suspect among them)
		w.readAtKill = w.readCount(w.queue) // the kill closes our end of its stdin
	}
	w.end(fateTimeout)
}

// onExit accounts a worker that is gone: whatever it still held is failed or put back.
func (c *coordinator) onExit(ev workerExit) {
	w := ev.w
	if c.workers[w.id] != w {
		return
	}
	now := time.Now()
	delete(c.workers, w.id)
	if p := c.pools[w.stage]; p != nil {
		p.remove(w)
	}
	for _, k := range []timerKind{timerIdle, timerWatchdog, timerLinger} {
		c.timers.cancel(timerKey{k, w.id})
	}
	// How many of its messages it had read, asked through our end of its stdin, so before
	// closing it (the watchdog asked before its kill closed it): none, and a worker that died
	// at its start never ran its head; more than one, and which of them it was running is
	// not known (suspects.go).
	read := w.readAtKill
	if len(w.queue) > 0 && w.fate == fateNone {
		read = w.readCount(w.queue)
	}
	readNone := diedAtStart(w, now) && read == 0
	w.closeStdin()
	q := w.queue
	w.queue = nil
	c.inflight[w.stage] -= len(q)
	c.inflightAll -= len(q)
	c.keys.release(q...)
	c.claimWanted = true
	reason := exitReason(ev.state, ev.err)
	log := c.log.With("stage", w.stage, "pid", w.pid)
	// A worker whose words say it lost its session, while the dispatcher has seen no outage of
	// its own since the worker started: the lock connection is proven first. A server whose
	// machine vanished is learnt by both from their sockets giving up, at about the same time,
	// and the worker's death was taken for a crash ("worker crashed; its head message fails"),
	// saved from charging only because that failure could not be written before the re-lock
	// (TestFailoverPrimaryVanishes).
	if ev.signs.outage && !c.outageWorker(w) && c.locked && c.inst.conn != nil {
		if err := c.pingLock(); err != nil {
			c.dbTrouble("a worker lost its database session", err)
		}
	}
	// The one side effect of the classification happens here, before the switch, so the
	// switch's cases are pure predicates and their order alone decides.
	// A worker that lost its session to a database outage is neither a program that cannot
	// start nor one that a message crashed (failover.go).
	outage := ev.signs.outage && c.outageWorker(w)
	atStart := diedAtStart(w, now) && !outage
	// A worker that died at its start without reading any of its ids, or that the server
	// refused a session, never ran its head message: however many die so with the same head
	// (the claim's order gives it to each), the head is not the message that kills the stage's
	// workers. A program that does not load, or a server's refusal (a role's CONNECTION LIMIT,
	// max_connections, a password), is the stage's trouble (TestBrokenProgramChargesNothing,
	// TestWorkerConnectRefusedChargesNothing).
	noSession := atStart && ev.signs.noSession
	spared := atStart && (readNone || noSession)
	// A worker that had read several of its ids was running one of them, not starting: which
	// one is found by running each alone (suspects.go), not by its head's history of deaths.
	batch := read > 1
	poison := false
	if atStart && !spared && len(q) > 0 && !batch {
		poison = c.recordStartupDeath(w, q[0])
	}
	charged := false // q[0] charged with the death: a suspect run alone is one no more
	if w.isolating && len(q) > 0 {
		defer func() { c.pools[w.stage].isolationEnded(w, q[0], charged, now) }()
	}
	switch {
	case len(q) == 0:
		if w.fate == fateNone {
			log.Warn("worker exited on its own", "reason", reason, "answered", w.answered)
			if atStart {
				c.holdStage(w, reason, startDeath{readNone: readNone, noSession: noSession}, now)
			}
		} else {
			log.Debug("worker stopped", "reason", reason, "answered", w.answered)
		}
	case outage && w.fate == fateNone:
		log.Warn("worker lost its database session in an outage; its messages go back to pending, no attempt charged",
			"reason", reason, "requeued", len(q))
		c.resets = append(c.resets, q...)
		c.ha.update(func(s *haStatus) { s.outageRetried += int64(len(q)) })
	case w.fate == fateTimeout && read > 1:
		c.stats.stage(w.stage).Timeouts++
		c.suspectRead(w, q, read, "worker killed after MAX_RUNTIME", timeoutReason(c.cfg.Dispatch.MaxRuntime), now)
	case w.fate == fateTimeout:
		c.stats.stage(w.stage).Timeouts++
		charged = true
		c.fail(q[0], fmt.Sprintf("stage %s: %s", w.stage, timeoutReason(c.cfg.Dispatch.MaxRuntime)))
		c.resets = append(c.resets, q[1:]...)
	case w.fate == fateProtocol || w.fate == fateRetired || w.fate == fateCancelled:
		// The resets are guarded by the claim: a cancelled head is left as the operator left it.
		c.resets = append(c.resets, q...)
	case atStart && !poison && !batch:
		c.holdStage(w, reason, startDeath{readNone: readNone, noSession: noSession}, now)
		c.resets = append(c.resets, q...)
	case ev.state != nil && ev.state.Success():
		log.Warn("worker exited without answering all its messages; they go back to pending", "unanswered", len(q))
		c.resets = append(c.resets, q...)
	case read > 1:
		c.suspectRead(w, q, read, "worker crashed", reason, now)
	default:
		charged = true
		// The head fails if its row is still the claim; if the stage had committed its
		// outcome, the guarded write changes nothing and settleCrashes says so.
		log.Warn("worker crashed; its head message fails unless its outcome had committed, the rest go back to pending",
			"reason", reason, "id", q[0].id, "requeued", len(q)-1)
		c.failCrashed(q[0], fmt.Sprintf("stage %s: %s", w.stage, reason))
		c.resets = append(c.resets, q[1:]...)
	}
}

// timeoutReason is why a worker was killed by the watchdog.
func timeoutReason(maxRuntime time.Duration) string {
	return fmt.Sprintf("timeout after %v (worker killed)", maxRuntime)
}

// diedAtStart reports whether w, gone, died on its own before answering anything within
// startupWindow of its start: taken for a program that cannot start, not a message that
// crashed it (unless recordStartupDeath says the message is the same twice).
func diedAtStart(w *worker, now time.Time) bool {
	return w.fate == fateNone && w.answered == 0 && now.Sub(w.started) < startupWindow
}

// recordStartupDeath records head as the head of a worker of its stage that died at start,
// and reports whether it was also at the head of the stage's previous such worker: then it is
// the message that kills workers, and it fails like a crash. It updates the pool's memory
// (startupHead), so it is called once per exit, never from a predicate.
func (c *coordinator) recordStartupDeath(w *worker, head *message) bool {
	p := c.pools[w.stage]
	if p == nil {
		return false
	}
	if p.startupHead == head.id {
		p.startupHead = 0
		c.log.Warn("the same message was at the head of two workers that died at start; failing it as a crash",
			"stage", w.stage, "id", head.id)
		return true
	}
	p.startupHead = head.id
	return false
}

// startDeath is what is known of a worker that died at its start, for the log.
type startDeath struct {
	readNone  bool // it read none of its ids
	noSession bool // the server gave it no session
}

// holdStage puts a stage whose worker could not get going on cool-down.
func (c *coordinator) holdStage(w *worker, reason string, how startDeath, now time.Time) {
	p := c.pools[w.stage]
	if p == nil || p.gen != w.gen {
		return
	}
	d := p.hold(now)
	c.timers.schedule(timerKey{timerHold, p.id}, p.holdUntil)
	msg := "worker died before answering its first message; stage held, its rows stay pending"
	switch {
	case how.noSession:
		msg = "worker could not get a database session; stage held, its rows stay pending, no attempt charged"
	case how.readNone:
		msg = "worker died before reading its messages; stage held, its rows stay pending, no attempt charged"
	}
	c.log.Error(msg, "stage", w.stage, "pid", w.pid, "reason", reason, "hold", d)
}

// held reports whether the stage is cooling down.
func (p *pool) held(now time.Time) bool { return now.Before(p.holdUntil) }

// hold puts the stage on cool-down and returns its length.
func (p *pool) hold(now time.Time) time.Duration {
	if p.holdDelay == 0 {
		p.holdDelay = holdMin
	}
	d := p.holdDelay
	p.holdUntil = now.Add(d)
	p.holdDelay = min(2*p.holdDelay, holdMax)
	return d
}

// unhold forgets the cool-down history once a worker of the stage has proved it can work.
func (p *pool) unhold() { p.holdDelay = 0 }
