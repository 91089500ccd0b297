// coordinator.go: the one goroutine that owns the dispatcher's state, and its select loop.
//
// The coordinator owns the pools, the workers, the in-flight messages, the timer heap, the
// queued writes and the statistics; nothing else touches them. Other goroutines only send it
// events: worker replies and exits (worker.go), notifications (pq.Listener), signals. Each turn
// of the loop handles one event, drains whatever else is pending (so per-stage free capacity is
// current), then settles: writes queued outcomes, returns due paused rows, and claims for every
// stage with free capacity in one statement. Then it sleeps until the next event or deadline.

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/lib/pq"
)

// dbStatementBudget bounds how long the coordinator waits on one of its own statements before
// treating the database as unavailable and carrying on with its other duties.
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
	wg     *sync.WaitGroup // the workers' goroutines and a background fan-in flush
	events chan any        // workerReplies, workerExit, faninFlushed

	timers *timerHeap
	timer  *time.Timer

	pools        map[string]*pool // by stage name; replaced as a whole by a reload
	gen          int              // stage-table generation
	nextPoolID   int
	workers      map[int]*worker // every live worker process, current generation or not
	nextWorkerID int
	inflight     map[string]int // messages in workers' queues, per stage
	inflightAll  int
	workerEnv    []string // environment common to all workers
	workerDSN    string   // PEPSI_DSN: the DSN with the worker application_name

	claimWanted  bool // something may have become claimable
	backlog      bool // the last claim filled a stage: claim again as soon as room frees
	retryWanted  bool // paused rows may be due
	reloadWanted bool // config_changed (or a listener reconnect) asks for a reload

	failures  []failure  // failure writes not yet committed
	resets    []*message // reset writes not yet committed
	dbWaiting bool       // the database refused a write: wait for timerDB
	dbBackoff backoff

	locked       bool // the lock connection is up and ours
	relockBackof backoff

	stats          *Stats
	lastStatsFlush time.Time // the last flush attempt

	shutdown bool  // a signal arrived: no claims, workers finish their queues
	fatal    error // ends the loop with exit status 1

	fanin    *fanin         // fan-in hints, flush and sweep state
	metrics  *metricsServer // nil unless METRICS_LISTEN is set
	notifier *notifier      // systemd readiness and watchdog; no-op outside systemd
	retain   *retainer      // nil unless RETENTION is set
	started  time.Time

	stageFailing map[string]int // consecutive failures per stage, for log rate-limiting
	sendBuf      []byte
	want         map[string]int
}

// newCoordinator builds a coordinator for cfg over an acquired instance.
func newCoordinator(ctx context.Context, cfg *Config, log *slog.Logger, db *sql.DB, inst *instance,
	notify <-chan *pq.Notification, sigs <-chan os.Signal, version string) *coordinator {
	c := &coordinator{
		cfg: cfg, version: version, log: log, db: db, inst: inst, notify: notify, sigs: sigs,
		ctx: ctx, wg: &sync.WaitGroup{}, events: make(chan any, eventBuffer),
		timers: newTimerHeap(), timer: time.NewTimer(time.Hour),
		workers: map[int]*worker{}, inflight: map[string]int{},
		dbBackoff:    backoff{min: 100 * time.Millisecond, max: 5 * time.Second},
		relockBackof: backoff{min: 100 * time.Millisecond, max: 5 * time.Second},
		stats:        newStats(), locked: true, stageFailing: map[string]int{},
		want: map[string]int{}, started: time.Now(),
	}
	c.workerDSN = dsnWith(cfg.DSN, "application_name", inst.appName(appWorker))
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch {
		case strings.HasPrefix(k, "PEPSI_") && k != "PEPSI_TEST_WORKER", k == "PGAPPNAME":
			continue // set per worker below
		case k == "NOTIFY_SOCKET" || k == "WATCHDOG_USEC" || k == "WATCHDOG_PID" || k == "LISTEN_FDS" || k == "LISTEN_PID":
			continue // systemd's, for the daemon alone: a worker must not answer for it
		}
		c.workerEnv = append(c.workerEnv, kv)
	}
	c.workerEnv = append(c.workerEnv, "PGAPPNAME="+inst.appName(appWorker))
	c.fanin = newFanin(cfg.Dispatch, &c.stats.Fanin)
	c.setStages(cfg.Stages)
	return c
}

// setStages installs a stage table as a new generation of pools.
func (c *coordinator) setStages(stages map[string]*StageConfig) {
	c.gen++
	old := c.pools
	c.pools = map[string]*pool{}
	for name, s := range stages {
		p := &pool{id: c.nextPoolID, cfg: s, gen: c.gen, fuse: fuseList(stages, name)}
		c.nextPoolID++
		if o := old[name]; o != nil && o.cfg.Program == s.Program {
			p.holdUntil, p.holdDelay = o.holdUntil, o.holdDelay // same program: same trouble
		}
		c.pools[name] = p
	}
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
	c.claimWanted, c.retryWanted = true, true
	for {
		c.settle()
		if c.fatal != nil {
			c.abort()
			return c.fatal
		}
		if c.shutdown && len(c.workers) == 0 && !c.fanin.busy {
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

func (c *coordinator) handle(ev any) {
	switch ev := ev.(type) {
	case workerReplies:
		c.onReplies(ev)
	case workerExit:
		c.onExit(ev)
	case faninFlushed:
		c.onFlushed(ev)
	default:
		panic(fmt.Sprintf("coordinator: unknown event %T", ev)) // our own tables disagree
	}
}

// settle does the database work the events asked for: queued writes, due retries, the claim.
func (c *coordinator) settle() {
	if !c.locked || c.dbWaiting {
		return
	}
	if len(c.failures) > 0 || len(c.resets) > 0 {
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
	if c.retryWanted {
		n, next, err := flipDue(c.ctx, c.inst.conn)
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

// writeOutcomes sends the queued failure and reset writes; false if the database refused.
func (c *coordinator) writeOutcomes() bool {
	if len(c.failures) > 0 {
		out, err := writeFailures(c.ctx, c.inst.conn, c.failures)
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
		n, err := writeResets(c.ctx, c.inst.conn, c.resets)
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

// dbTrouble handles a statement the database refused: if the lock connection is gone, the
// lock is gone with it; otherwise the queued work waits for a back-off and is tried again.
func (c *coordinator) dbTrouble(what string, err error) {
	if isConnLost(err) || c.inst.conn == nil || c.pingLock() != nil {
		c.log.Error("database connection lost; claims stop until the lock is taken again", "op", what, "err", err)
		c.locked = false
		c.claimer.close()
		c.timers.schedule(timerKey{kind: timerRelock}, time.Now().Add(c.relockBackof.next()))
		return
	}
	d := c.dbBackoff.next()
	c.log.Warn("database refused a statement; will retry", "op", what, "err", err, "retry_in", d.Round(time.Millisecond))
	c.dbWaiting = true
	c.timers.schedule(timerKey{kind: timerDB}, time.Now().Add(d))
}

// pingLock checks the lock connection, without letting a hung server hold the loop.
func (c *coordinator) pingLock() error {
	ctx, cancel := context.WithTimeout(c.ctx, 5*time.Second)
	defer cancel()
	return c.inst.conn.PingContext(ctx)
}

// scheduleRetry sets the retry timer to the earliest paused row's due time (zero: none).
func (c *coordinator) scheduleRetry(next time.Time) {
	key := timerKey{kind: timerRetry}
	if next.IsZero() {
		c.timers.cancel(key)
		return
	}
	c.timers.schedule(key, next)
}

// claim takes work for every stage with free capacity in one statement and hands it out.
func (c *coordinator) claim() {
	now := time.Now()
	clear(c.want)
	for name, p := range c.pools {
		if p.held(now) {
			continue
		}
		if free := p.cfg.Capacity() - c.inflight[name]; free > 0 {
			c.want[name] = free
		}
	}
	c.claimWanted = false
	if len(c.want) == 0 {
		return // every stage is full or held: replies and timers will ask again
	}
	res, err := c.claimer.claim(c.ctx, c.inst.conn, c.want)
	if err != nil {
		c.claimWanted = true
		c.dbTrouble("claim", err)
		return
	}
	c.dbBackoff.reset()
	c.scheduleRetry(res.nextRetry)
	c.fanin.inbox = res.inbox
	c.fanin.learn(res.remaining)
	c.backlog = false
	if res.total == 0 {
		return
	}
	c.stats.Global.Claims++
	for name, msgs := range res.byStage {
		if len(msgs) == c.want[name] {
			c.backlog = true
		}
		c.assign(c.pools[name], msgs)
	}
}

// assign hands claimed messages (in id order) to the stage's workers, packing them.
func (c *coordinator) assign(p *pool, msgs []*message) {
	now := time.Now()
	for len(msgs) > 0 {
		w := p.pick()
		if w == nil {
			if !p.canGrow(now) {
				break
			}
			if w = c.spawn(p, now); w == nil {
				break
			}
		}
		n := min(p.room(w), len(msgs))
		batch := msgs[:n:n]
		msgs = msgs[n:]
		if len(w.queue) == 0 {
			w.headAt = now
			c.timers.scheduleEarlier(timerKey{timerWatchdog, w.id}, now.Add(c.cfg.Dispatch.MaxRuntime))
		}
		w.queue = append(w.queue, batch...)
		w.sent += n
		c.inflight[p.cfg.Name] += n
		c.inflightAll += n
		c.stats.Global.StageRuns += int64(n)
		var err error
		if c.sendBuf, err = w.send(batch, c.sendBuf); err != nil {
			// The worker is dying; its exit fails the head and puts the rest back.
			c.log.Warn("write to worker failed", "stage", w.stage, "pid", w.pid, "err", err)
			w.kill()
		}
		if w.sent >= p.cfg.MaxMessages && w.state == workerRunning {
			w.state = workerDraining // recycled once its pipeline has drained
		}
	}
	if len(msgs) > 0 {
		// No worker could take them (the program would not start): they were claimed, so
		// they go back to pending, untouched.
		c.resets = append(c.resets, msgs...)
	}
}

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
	w, err := startWorker(c.ctx, c.wg, c.events, c.log, id, p.cfg, p.gen, env, c.cfg.Dispatch.ConfigFile)
	if err != nil {
		d := p.hold(now)
		c.timers.schedule(timerKey{timerHold, p.id}, p.holdUntil)
		c.log.Error("cannot start the stage's program; stage held, its rows stay pending",
			"stage", p.cfg.Name, "program", p.cfg.Program, "err", err, "hold", d)
		return nil
	}
	c.workers[id] = w
	p.workers = append(p.workers, w)
	c.stats.stage(p.cfg.Name).WorkersStarted++
	c.log.Debug("worker started", "stage", p.cfg.Name, "pid", w.pid, "workers", len(p.workers))
	return w
}

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
			c.onSuccess(w, m, r.text)
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
func (c *coordinator) onSuccess(w *worker, m *message, text string) {
	c.claimWanted = true // the stage may have advanced it: the next claim takes it
	if m.fanout != 0 {
		c.fanin.hint(m.fanout) // a child may have finished: cheap, and the flush is batched
	}
	if n := c.stageFailing[w.stage]; n > 0 {
		c.log.Info("stage recovered", "stage", w.stage, "failures_before", n)
		delete(c.stageFailing, w.stage)
	}
	if text == "" {
		return
	}
	for _, word := range strings.Fields(text) {
		switch {
		case word == "done":
			c.stats.Global.Done++
		case strings.HasPrefix(word, "fused="):
			// fused=STAGE:MS[,STAGE:MS…]: stages the worker ran in the same pass.
			for _, f := range strings.Split(strings.TrimPrefix(word, "fused="), ",") {
				name, msText, ok := strings.Cut(f, ":")
				ms, err := strconv.ParseInt(msText, 10, 64)
				if !ok || err != nil || ms < 0 || !stageNameRe.MatchString(name) {
					c.log.Warn("ignoring malformed fused report", "stage", w.stage, "pid", w.pid, "word", clip(word, 80))
					break
				}
				fs := c.stats.stage(name)
				fs.Fused++
				fs.observe(ms)
			}
		}
	}
}

// fail queues a failure write for m: an attempt, then paused or failed.
func (c *coordinator) fail(m *message, reason string) {
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
	w.fate = fateProtocol
	w.state = workerStopping
	w.kill()
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
		w.fate = fateRetired
		w.state = workerStopping
		w.kill()
	}
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
	w.closeStdin()
	q := w.queue
	w.queue = nil
	c.inflight[w.stage] -= len(q)
	c.inflightAll -= len(q)
	c.claimWanted = true
	reason := exitReason(ev.state, ev.err)
	log := c.log.With("stage", w.stage, "pid", w.pid)
	switch {
	case len(q) == 0:
		if w.fate == fateNone {
			log.Warn("worker exited on its own", "reason", reason, "answered", w.answered)
			if w.answered == 0 && now.Sub(w.started) < startupWindow {
				c.holdStage(w, reason, now)
			}
		} else {
			log.Debug("worker stopped", "reason", reason, "answered", w.answered)
		}
	case w.fate == fateTimeout:
		c.stats.stage(w.stage).Timeouts++
		c.fail(q[0], fmt.Sprintf("stage %s: timeout after %v (worker killed)", w.stage, c.cfg.Dispatch.MaxRuntime))
		c.resets = append(c.resets, q[1:]...)
	case w.fate == fateProtocol || w.fate == fateRetired:
		c.resets = append(c.resets, q...)
	case w.answered == 0 && now.Sub(w.started) < startupWindow && w.fate == fateNone && !c.samePoison(w, q[0]):
		c.holdStage(w, reason, now)
		c.resets = append(c.resets, q...)
	case ev.state != nil && ev.state.Success():
		log.Warn("worker exited without answering all its messages; they go back to pending", "unanswered", len(q))
		c.resets = append(c.resets, q...)
	default:
		c.stats.stage(w.stage).Crashed++
		log.Warn("worker crashed; its head message fails, the rest go back to pending",
			"reason", reason, "id", q[0].id, "requeued", len(q)-1)
		c.fail(q[0], fmt.Sprintf("stage %s: %s", w.stage, reason))
		c.resets = append(c.resets, q[1:]...)
	}
}

// samePoison reports whether head was also at the head of the stage's previous worker that
// died before answering: then it is the message that kills workers, and it fails like a crash.
func (c *coordinator) samePoison(w *worker, head *message) bool {
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

// holdStage puts a stage whose worker could not get going on cool-down.
func (c *coordinator) holdStage(w *worker, reason string, now time.Time) {
	p := c.pools[w.stage]
	if p == nil || p.gen != w.gen {
		return
	}
	d := p.hold(now)
	c.timers.schedule(timerKey{timerHold, p.id}, p.holdUntil)
	c.log.Error("worker died before answering its first message; stage held, its rows stay pending",
		"stage", w.stage, "pid", w.pid, "reason", reason, "hold", d)
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
	default:
		c.claimWanted = true
	}
}

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

func (c *coordinator) killAll() {
	for _, w := range c.workers {
		if w.fate == fateNone || w.fate == fateStopped {
			w.fate = fateRetired
		}
		w.state = workerStopping
		w.kill()
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
			c.claimWanted = true
			c.timers.schedule(key, now.Add(c.cfg.Dispatch.PollInterval))
		case timerRetry:
			c.retryWanted = true
		case timerIdle:
			if w := c.workers[key.id]; w != nil && w.state == workerRunning && len(w.queue) == 0 {
				if idle := now.Sub(w.idleSince); idle >= c.cfg.Dispatch.WorkerIdleTimeout {
					c.log.Debug("stopping idle worker", "stage", w.stage, "pid", w.pid, "idle", idle.Round(time.Millisecond))
					c.stop(w, now)
				} else {
					c.timers.schedule(key, w.idleSince.Add(c.cfg.Dispatch.WorkerIdleTimeout))
				}
			}
		case timerWatchdog:
			c.watchdog(key, now)
		case timerLinger:
			if w := c.workers[key.id]; w != nil {
				c.log.Warn("worker did not exit after its stdin was closed; killing it", "stage", w.stage, "pid", w.pid)
				w.kill()
			}
		case timerHold:
			c.claimWanted = true
		case timerStats:
			c.flushStats()
			c.timers.schedule(key, now.Add(c.cfg.Dispatch.StatsInterval))
		case timerDB:
			c.dbWaiting = false
		case timerRelock:
			c.relock()
		case timerFanin:
			// settle decides: the coalescing delay is over.
		case timerSweep:
			if c.locked && !c.shutdown {
				c.faninSweep()
			} else {
				c.timers.schedule(key, now.Add(time.Second))
			}
		case timerSDWatchdog:
			// Sent from the loop itself: a coordinator stuck anywhere stops the pings.
			c.notifier.send("WATCHDOG=1")
			c.timers.schedule(key, now.Add(watchdogInterval()))
		case timerRetention:
			c.timers.schedule(key, now.Add(retentionEvery))
			if c.inflightAll == 0 && !c.shutdown {
				ctx, cancel := context.WithTimeout(c.ctx, dbStatementBudget)
				n, err := c.retain.turn(ctx, c.db)
				cancel()
				if err != nil {
					c.log.Warn("retention turn failed; next turn in a minute", "err", err)
				} else if n > 0 {
					c.log.Info("retention: deleted old done rows", "rows", n, "older_than", c.cfg.Dispatch.Retention)
				}
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
	c.log.Warn("message ran past MAX_RUNTIME; killing its worker", "stage", w.stage, "pid", w.pid,
		"id", w.queue[0].id, "max_runtime", c.cfg.Dispatch.MaxRuntime)
	w.fate = fateTimeout
	w.state = workerStopping
	w.kill()
}

// relock tries to take the single-instance lock again after its connection was lost.
func (c *coordinator) relock() {
	err := c.inst.relock(c.ctx)
	switch {
	case err == nil:
		c.log.Info("single-instance lock taken again; claims resume")
		c.locked = true
		c.relockBackof.reset()
		c.dbBackoff.reset()
		c.dbWaiting = false
		c.claimWanted, c.retryWanted = true, true
	case errors.Is(err, errLockLost):
		c.fatal = err
	default:
		d := c.relockBackof.next()
		c.log.Warn("cannot take the single-instance lock again yet", "err", err, "retry_in", d.Round(time.Millisecond))
		c.timers.schedule(timerKey{kind: timerRelock}, time.Now().Add(d))
	}
}

// flushStats writes the statistics deltas; a failure keeps them for the next flush.
func (c *coordinator) flushStats() {
	ctx, cancel := context.WithTimeout(c.ctx, dbStatementBudget)
	defer cancel()
	if !c.stats.dirty() {
		return
	}
	c.lastStatsFlush = time.Now()
	if _, err := c.stats.flush(ctx, c.db); err != nil {
		c.log.Warn("statistics not flushed; kept for the next flush", "err", err)
	}
}

// finish completes a clean shutdown: every worker is gone; write what is left.
func (c *coordinator) finish() {
	c.writeLeftovers()
	c.flushStats()
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
// stays running in the table and is reset by the next start.
func (c *coordinator) writeLeftovers() {
	if len(c.failures) == 0 && len(c.resets) == 0 {
		return
	}
	err := withRetry(c.ctx, dbStatementBudget, "write outcomes at shutdown", func(ctx context.Context) error {
		if c.inst.conn == nil {
			if err := c.inst.relock(ctx); err != nil {
				return err
			}
		}
		if len(c.failures) > 0 {
			if _, err := writeFailures(ctx, c.inst.conn, c.failures); err != nil {
				return err
			}
			c.failures = nil
		}
		if len(c.resets) > 0 {
			if _, err := writeResets(ctx, c.inst.conn, c.resets); err != nil {
				return err
			}
			c.resets = nil
		}
		return nil
	})
	if err != nil {
		c.log.Error("could not write outcomes; their rows stay running and the next start puts them back to pending",
			"failures", len(c.failures), "resets", len(c.resets), "err", err)
	}
}

// reload rebuilds the stage table from the file and the config table.
func (c *coordinator) reload() {
	c.reloadWanted = false
	overlay, err := readOverlay(c.ctx, c.inst.conn)
	if err != nil {
		c.reloadWanted = true
		c.dbTrouble("read config table", err)
		return
	}
	// A reload that fails is fatal with exit status 1 (dispatch.md), not the start-up
	// configuration status 2: the errors are formatted, not wrapped, so the configError type
	// does not reach run's exit-status mapping.
	fresh, err := loadConfig(c.cfg.Path)
	if err != nil {
		c.fatal = fmt.Errorf("reload: %s", err)
		return
	}
	stages, err := buildStages(fresh.stageEntries, overlay)
	if err != nil {
		c.fatal = fmt.Errorf("reload: the stage graph does not validate: %s", err)
		return
	}
	if fresh.Dispatch != c.cfg.Dispatch || fresh.DSN != c.cfg.DSN || fresh.PoolCounter != c.cfg.PoolCounter {
		c.log.Warn("reload: [pepsi-dispatch], [database] and [poolcounter] changes need a restart; kept the running values")
	}
	if sameStages(stages, c.cfg.Stages) {
		return
	}
	cfg := *c.cfg
	cfg.Stages = stages
	c.cfg = &cfg
	c.setStages(stages)
	c.log.Info("stage graph reloaded; retiring workers", "stages", len(stages), "workers", len(c.workers))
	for _, w := range c.workers {
		c.retire(w)
	}
	c.claimWanted = true
}

func sameStages(a, b map[string]*StageConfig) bool {
	if len(a) != len(b) {
		return false
	}
	for name, s := range a {
		if o, ok := b[name]; !ok || !s.equal(o) {
			return false
		}
	}
	return true
}

// readOverlay reads the config table.
func readOverlay(ctx context.Context, conn *sql.Conn) ([]overlayRow, error) {
	rows, err := conn.QueryContext(ctx, `SELECT section, key, value FROM config ORDER BY section, key`)
	if err != nil {
		return nil, fmt.Errorf("read config table: %w", err)
	}
	defer rows.Close()
	var out []overlayRow
	for rows.Next() {
		var r overlayRow
		if err := rows.Scan(&r.Section, &r.Key, &r.Value); err != nil {
			return nil, fmt.Errorf("read config table: %w", err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read config table: %w", err)
	}
	return out, nil
}
