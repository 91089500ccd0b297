// workloads.go: W1-W6 of issue 7 and the measurements they take.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"pepsi-dispatch/internal/damon"
)

// snapshot is the state of the counters at one instant.
type snapshot struct {
	t   time.Time
	sut treeCPU // the system's process tree (pepsi: dispatcher + workers)
	pg  int64   // every PostgreSQL process (postmaster tree)
	wal int64   // WAL insert position

	// The noise: the machine's busy ticks and the benchmark's own process tree (which holds
	// the system under test); what is neither this tree nor PostgreSQL is other people's load.
	busy, total, benchTree int64
}

func (b *bench) snap(ctx context.Context, p *sutProc) snapshot {
	wal := b.pg.walLSN(ctx)
	procs := allProcs()
	s := snapshot{t: time.Now(), pg: cpuOfTree(procs, b.pgPID).total(), wal: wal,
		benchTree: cpuOfTree(procs, os.Getpid()).total()}
	s.busy, s.total = machineCPU()
	if p != nil {
		s.sut = cpuOfTree(procs, p.pid)
	}
	return s
}

const msPerTick = 1000 / ticksPerSecond

// measurement is one run of one throughput workload on one system.
type measurement struct {
	Workload    string
	System      string
	Run         int
	Messages    int64
	Transitions int64
	Seconds     float64
	SelfMS      float64 // the system's main process (pepsi: the dispatcher)
	ChildMS     float64 // its children (pepsi: the stage workers)
	PGMS        float64 // PostgreSQL, all processes
	WAL         int64
	RSSKiB      int64      // peak RSS of the main process (VmHWM)
	ChildRSSKiB int64      // the largest peak RSS among its live children at the end
	OtherPct    float64    // CPU of processes outside the benchmark and PostgreSQL, % of the machine
	AutovacPct  float64    // share of the run's autovacuum samples with a worker busy, % (quiet.go)
	Autovac     []string   // what those workers vacuumed ("bench_workqueue: autovacuum: VACUUM ANALYZE public.workqueue")
	Slow        []diagPlan // statements slower than 200 ms meanwhile (auto_explain), by statement
	Note        string     // a valid run with a remark (cut at the time limit)
	Err         string     // a failed run, left out of the medians
}

func (m measurement) rate() float64 {
	if m.Seconds <= 0 {
		return 0
	}
	return float64(m.Transitions) / m.Seconds
}

func (m measurement) cpuPer1k() float64 {
	if m.Transitions == 0 {
		return 0
	}
	return (m.SelfMS + m.ChildMS + m.PGMS) / float64(m.Transitions) * 1000
}

func (m measurement) walPer() float64 {
	if m.Transitions == 0 {
		return 0
	}
	return float64(m.WAL) / float64(m.Transitions)
}

func fill(m *measurement, s0, s1 snapshot) {
	m.Seconds = s1.t.Sub(s0.t).Seconds()
	m.SelfMS = float64((s1.sut.self - s0.sut.self) * msPerTick)
	m.ChildMS = float64((s1.sut.rest - s0.sut.rest) * msPerTick)
	m.PGMS = float64((s1.pg - s0.pg) * msPerTick)
	m.WAL = s1.wal - s0.wal
	if dt := s1.total - s0.total; dt > 0 {
		other := (s1.busy - s0.busy) - (s1.benchTree - s0.benchTree) - (s1.pg - s0.pg)
		m.OtherPct = 100 * float64(max(other, 0)) / float64(dt)
	}
}

// order rotates the systems that run workload wl from run to run, so that no system always
// runs first (on a fresher cluster) or last.
//
// The systems with their defaults run in the first run only: River's rate is set by its fetch
// cooldown (100 ms for up to 100 workers, about 1,000 jobs/s), Graphile Worker's by its one
// job at a time, not by the machine's noise, and their slow runs would otherwise take a good
// share of the time budget.
func (b *bench) order(wl string, run int) []*system {
	n := len(b.systems)
	var out []*system
	for i := 0; i < n; i++ {
		s := b.systems[(i+run-1)%n]
		if s.once && run > 1 || !s.runs(wl) {
			continue
		}
		out = append(out, s)
	}
	return out
}

// systemsFor are the systems that run workload wl, in their order.
func (b *bench) systemsFor(wl string) []*system {
	var out []*system
	for _, s := range b.systems {
		if s.runs(wl) {
			out = append(out, s)
		}
	}
	return out
}

// W1: a backlog of pending messages, one no-op stage, time until all are done. Each system
// first runs it once unmeasured: the first run of the benchmark otherwise pays for cold caches
// (binaries, the new databases' catalogs; 20-35 % slower for pepsi and River in one full run).
func (b *bench) w1(ctx context.Context) error {
	for _, s := range b.order("W1", 1) {
		if s.once {
			continue // long at its fixed rate, which a warm cache does not change
		}
		m := b.backlogRun(ctx, s, "W1-warm-up", 0, b.sz.w1Messages, 1, 0, false)
		if m.Err != "" {
			logf("  W1 warm-up %-14s failed: %s (its measured runs will tell)", s.name, m.Err)
			continue
		}
		logf("  W1 warm-up %-14s %.0f/s, not measured", s.name, m.rate())
	}
	for r := 1; r <= b.sz.runs; r++ {
		for _, s := range b.order("W1", r) {
			m := b.backlogRun(ctx, s, "W1", r, b.sz.w1Messages, 1, 0, r == b.sz.runs)
			if err := b.record(ctx, m); err != nil {
				return err
			}
		}
	}
	b.diagnosePepsi(ctx)
	return ctx.Err()
}

// W4 (backlog): the same through three stages; River: each job inserts the next one.
// W4f: pepsi alone, its stages s2 and s3 FUSE = yes, so one worker pass runs all three
// handlers and writes one outcome (stage fusion, the spec's way of making a hop cheap); the
// other systems have no such thing, and W4f compares pepsi fused with their W4. W4w: pepsi
// alone with the whole worker budget on every stage (three times W4's processes), to show
// what dividing it is worth; not a target.
// W1b: pepsi's W1 again, run just before each of its W4 runs, so that the target "W4 ≥ 1/3 of
// W1 in every run" compares each W4 run with a W1 run of the same minute: W1's own runs are half
// an hour earlier, and the host's speed drifts more than that target's margin in that time (one
// full run's W1, first in it, 22.3k transitions/s; the same build's W1 alone after it, 35.0k).
// W4 (latency): 20 messages/s through three stages.
func (b *bench) w4(ctx context.Context) error {
	for r := 1; r <= b.sz.runs; r++ {
		for _, s := range b.order("W4", r) {
			if s.name == "pepsi" {
				m := b.backlogRun(ctx, s, w1Beside, r, b.sz.w1Messages, 1, 0, false)
				if err := b.record(ctx, m); err != nil {
					return err
				}
			}
			m := b.backlogRun(ctx, s, "W4", r, b.sz.w4Messages, 3, 0, false)
			if err := b.record(ctx, m); err != nil {
				return err
			}
			if s.name != "pepsi" {
				continue
			}
			for _, v := range []string{"W4f", "W4w"} {
				m = b.backlogRun(ctx, s, v, r, b.sz.w4Messages, 3, 0, false)
				if err := b.record(ctx, m); err != nil {
					return err
				}
			}
		}
	}
	for _, s := range b.systemsFor("W4") {
		l := b.latencyRun(ctx, s, "W4", b.sz.w4Rate, b.sz.w4Duration, 3)
		b.res.addLatency(l)
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
	return nil
}

// w1Beside names the W1 runs measured in W4's rounds (see w4).
const w1Beside = "W1b"

// w5Beside names the W1 runs measured in W5's rounds, on w5BesideDB (see w5).
const (
	w5Beside   = "W5b"
	w5BesideDB = "bench_workqueue_w5b"
)

// record keeps a measurement and logs it; it returns an error only when the benchmark is
// being interrupted.
func (b *bench) record(ctx context.Context, m measurement) error {
	b.res.add(m)
	if m.Err != "" {
		logf("  %s run %d %-14s FAILED: %s", m.Workload, m.Run, m.System, m.Err)
	} else {
		if m.Note != "" {
			logf("  %s run %d %-14s %s", m.Workload, m.Run, m.System, m.Note)
		}
		logf("  %s run %d %-14s %7d transitions in %6.2f s = %8.0f/s  cpu %6.1f ms/1k  wal %5.0f B/tr  rss %d KiB  other load %.0f%%  autovacuum %.0f%% %v",
			m.Workload, m.Run, m.System, m.Transitions, m.Seconds, m.rate(), m.cpuPer1k(), m.walPer(), m.RSSKiB, m.OtherPct, m.AutovacPct, m.Autovac)
	}
	return ctx.Err()
}

// backlogRun enqueues n messages in one transaction while the system is running and idle,
// and measures from that commit until none is left open. base > 0 means the big table of W5:
// the rows above base are deleted instead of truncating the table.
func (b *bench) backlogRun(ctx context.Context, s *system, wl string, run int, n int64, stages int, base int64, statements bool) (m measurement) {
	m = measurement{Workload: wl, System: s.name, Run: run, Messages: n, Transitions: n * int64(stages)}
	fail := func(err error) measurement {
		m.Err = err.Error()
		return m
	}
	var err error
	if base > 0 {
		err = s.deleteAbove(ctx, base)
	} else {
		err = s.reset(ctx)
	}
	if err != nil {
		return fail(err)
	}
	logOff := b.pg.logOffset()
	p, err := b.startSUT(ctx, s, startOpts{stages: stages, fuse: wl == "W4f", wide: wl == "W4w", tag: fmt.Sprintf("%s-r%d", wl, run)})
	if err != nil {
		return fail(err)
	}
	defer p.stop()
	defer func() { m.Slow = b.slowSince(logOff) }()
	primed, err := b.prime(ctx, s, base, stages)
	if err != nil {
		return fail(fmt.Errorf("priming batch: %w", err))
	}
	// No run pays for the vacuum debt of the system before it (quiet.go): in one W1 with every
	// system, a worker vacuumed River's or Graphile Worker's table in 8 of 32 runs, its CPU
	// counted to whoever ran then.
	b.quiesce(ctx)
	b.pg.checkpoint(ctx) // after the priming batch's writes: every run starts from a checkpoint
	av := b.sampleAutovacuum(ctx)
	defer func() { m.AutovacPct, m.Autovac = av.finish() }()
	var pepsiBefore pepsiStats
	if statements {
		b.pg.resetStatements(ctx, s.dbname)
		if s.kind == kindPepsi {
			pepsiBefore = readPepsiStats(ctx, s)
		}
	}
	if err := s.enqueueBulk(ctx, base+primed+1, n, stages, true); err != nil {
		return fail(fmt.Errorf("enqueue: %w", err))
	}
	s0 := b.snap(ctx, p)
	last, err := s.lastRow(ctx, stages)
	if err != nil {
		return fail(err)
	}
	deadline := s0.t.Add(b.sz.backlogLimit)
	lastDone := last == 0
	open := n
	for {
		// Until the last message is done, watch only its row (a primary-key lookup); then count
		// what is left, which is little by then.
		if !lastDone {
			if lastDone, err = s.rowFinished(ctx, last); err != nil {
				return fail(err)
			}
		}
		if lastDone {
			if _, open, err = s.counts(ctx, base); err != nil {
				return fail(err)
			}
			if open == 0 {
				break
			}
		}
		if !p.alive() {
			return fail(fmt.Errorf("%s exited with messages open: %v (see %s)", s.name, p.waitErr, p.logPath))
		}
		if time.Now().After(deadline) {
			// Too slow to finish within the budget: its rate over the limit is still a rate.
			s1 := b.snap(ctx, p)
			fill(&m, s0, s1)
			b.peaks(&m, p)
			done, err := s.transitionsDone(ctx, stages, base)
			if err != nil {
				return fail(err)
			}
			if done == 0 {
				return fail(fmt.Errorf("not one of %d transitions made within %s", n*int64(stages), b.sz.backlogLimit))
			}
			done -= primed * int64(stages) // counted done above base like the run's own
			m.Transitions, m.Messages = done, done/int64(stages)
			m.Note = fmt.Sprintf("cut after %s: %d of %d transitions made", b.sz.backlogLimit, done, n*int64(stages))
			return m
		}
		// Without a last row to watch (River's chains), counting costs what is left: poll
		// slowly while much is left, then closely.
		wait := 20 * time.Millisecond
		if last == 0 && open > 5000 {
			wait = 200 * time.Millisecond
		}
		select {
		case <-ctx.Done():
			return fail(ctx.Err())
		case <-time.After(wait):
		}
	}
	s1 := b.snap(ctx, p)
	fill(&m, s0, s1)
	b.peaks(&m, p)
	if statements {
		top, calls := b.pg.topStatements(ctx, s.dbname, 12)
		b.res.setStatements(s.name, wl, top, calls, m.Transitions)
	}
	if err := p.stop(); err != nil {
		logf("  %s: stop: %v (see %s)", s.name, err, p.logPath)
	}
	if statements && s.name == "pepsi" {
		after := readPepsiStats(ctx, s)
		b.res.pepsiW1 = after.minus(pepsiBefore)
	}
	got, err := s.finished(ctx, stages, base)
	if err != nil {
		return fail(err)
	}
	got -= primed // the priming batch's, finished before the run
	if base > 0 {
		got -= b.res.w5DoneRows[s.name] // the big table's done rows were there before
	}
	if got != n {
		return fail(fmt.Errorf("%d of %d messages finished", got, n))
	}
	return m
}

// slowSince reads the statements that auto_explain logged since offset (after the system has
// stopped, so that its last statements are in).
func (b *bench) slowSince(off int64) []diagPlan {
	plans, err := parseAutoExplain(b.pg.logPath(), off)
	if err != nil {
		logf("read the server log: %v", err)
	}
	return plans
}

// peaks records the peak RSS of the system's main process and of its largest child.
func (b *bench) peaks(m *measurement, p *sutProc) {
	m.RSSKiB = peakRSSKiB(p.pid)
	for _, c := range descendants(allProcs(), p.pid) {
		m.ChildRSSKiB = max(m.ChildRSSKiB, peakRSSKiB(c))
	}
}

// pepsiStats are the dispatcher's own counters (stage_stats, dispatch_stats).
type pepsiStats struct {
	Processed, BusyMS, WorkersStarted, Claims, StageRuns int64
}

func (a pepsiStats) minus(b pepsiStats) pepsiStats {
	return pepsiStats{a.Processed - b.Processed, a.BusyMS - b.BusyMS, a.WorkersStarted - b.WorkersStarted,
		a.Claims - b.Claims, a.StageRuns - b.StageRuns}
}

func readPepsiStats(ctx context.Context, s *system) pepsiStats {
	var st pepsiStats
	err := s.pool.QueryRow(ctx, `SELECT coalesce(sum(processed), 0), coalesce(sum(busy_ms), 0),
		coalesce(sum(workers_started), 0),
		(SELECT claims FROM dispatch_stats WHERE id = 1), (SELECT stage_runs FROM dispatch_stats WHERE id = 1)
		FROM stage_stats`).Scan(&st.Processed, &st.BusyMS, &st.WorkersStarted, &st.Claims, &st.StageRuns)
	if err != nil {
		logf("read pepsi's statistics: %v", err)
	}
	return st
}

// prime sends s a priming batch after starting it and before a backlog run's measured backlog
// (W1, W4, W5), waited for and measured nowhere: as many messages as pepsi has in flight
// (PARALLELISM × QUEUE_LIMIT: a claim that large starts every worker; fewer would start only
// some, as the dispatcher packs), of a stages-stage pipeline, the same for every system. pepsi
// starts its workers on demand, while River, Graphile Worker, PgQ's consumer and the raw loop
// start all theirs with the system, before the window. Without it pepsi's window held the
// start of its 4 workers (exec, a PostgreSQL connection at 17-65 ms on this machine, the first
// statements of a new backend): about 125 ms before the first message was done, 6 % of a W1
// run. The measured backlog comes within a second, inside WORKER_IDLE_TIMEOUT (5 s). It
// returns the size of the batch, which the run's finished rows include.
func (b *bench) prime(ctx context.Context, s *system, base int64, stages int) (int64, error) {
	n := int64(b.pepsiWorkers * b.pepsiQueueLimit)
	if err := s.enqueueBulk(ctx, base+1, n, stages, false); err != nil {
		return 0, err
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		_, open, err := s.counts(ctx, base)
		if err != nil {
			return 0, err
		}
		if open == 0 {
			return n, nil
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("%d of %d messages still open after 2 minutes", open, n)
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// W2: a producer keeps target messages pending; throughput over a window after a warm-up.
func (b *bench) w2(ctx context.Context) error {
	for r := 1; r <= b.sz.runs; r++ {
		for _, s := range b.order("W2", r) {
			m := b.continuousRun(ctx, s, r)
			if err := b.record(ctx, m); err != nil {
				return err
			}
		}
	}
	return nil
}

func (b *bench) continuousRun(ctx context.Context, s *system, run int) (m measurement) {
	m = measurement{Workload: "W2", System: s.name, Run: run}
	fail := func(err error) measurement {
		m.Err = err.Error()
		return m
	}
	if err := s.reset(ctx); err != nil {
		return fail(err)
	}
	b.quiesce(ctx) // as before a backlog run
	b.pg.checkpoint(ctx)
	av := b.sampleAutovacuum(ctx)
	defer func() { m.AutovacPct, m.Autovac = av.finish() }()
	logOff := b.pg.logOffset()
	p, err := b.startSUT(ctx, s, startOpts{stages: 1, tag: fmt.Sprintf("W2-r%d", run)})
	if err != nil {
		return fail(err)
	}
	defer p.stop()
	defer func() { m.Slow = b.slowSince(logOff) }()
	var inserted, next int64 = 0, 1
	start := time.Now()
	warmEnd, measureEnd := start.Add(b.sz.w2Warmup), start.Add(b.sz.w2Warmup+b.sz.w2Measure)
	var s0 snapshot
	var done0 int64
	measuring := false
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for {
		// Every tick counts the pending rows (to top the backlog up); the rows done only at
		// the window's two edges, because for pepsi that is a scan of its table, which keeps
		// every row (see counts).
		pending, err := s.pending(ctx)
		if err != nil {
			return fail(err)
		}
		// The rows done, counted at the window's edges: the scan runs outside the window
		// (before s0, after s1), its snapshot a scan's length off the edge (a few ms of
		// transitions in 30 s).
		countDone := func() (int64, error) {
			_, open, err := s.counts(ctx, 0)
			return inserted - open, err // everything inserted so far committed before the count
		}
		now := time.Now()
		if !measuring && !now.Before(warmEnd) {
			if done0, err = countDone(); err != nil {
				return fail(err)
			}
			s0, measuring = b.snap(ctx, p), true
		} else if measuring && !now.Before(measureEnd) {
			s1 := b.snap(ctx, p)
			done, err := countDone()
			if err != nil {
				return fail(err)
			}
			fill(&m, s0, s1)
			m.Transitions, m.Messages = done-done0, done-done0
			b.peaks(&m, p)
			break
		}
		if !p.alive() {
			return fail(fmt.Errorf("%s exited: %v (see %s)", s.name, p.waitErr, p.logPath))
		}
		if k := b.sz.w2Pending - pending; k > 0 {
			if err := s.enqueueBulk(ctx, next, k, 1, inserted == 0); err != nil {
				return fail(fmt.Errorf("enqueue: %w", err))
			}
			next += k
			inserted += k
		}
		select {
		case <-ctx.Done():
			return fail(ctx.Err())
		case <-tick.C:
		}
	}
	if err := p.stop(); err != nil {
		logf("  %s: stop: %v (see %s)", s.name, err, p.logPath)
	}
	return m
}

// latencyResult is one latency run: enqueue -> first stage start, enqueue -> done, in ms.
type latencyResult struct {
	Workload   string
	System     string
	Rate       int
	Stages     int
	Sent       int
	Start      []float64   // sorted
	Done       []float64   // sorted
	CPUPerSec  float64     // ms of CPU per second of the run: the system and PostgreSQL, idle time included
	OtherPct   float64     // CPU of processes outside the benchmark and PostgreSQL meanwhile, % of the machine
	AutovacPct float64     // share of the run's autovacuum samples with a worker busy, % (quiet.go)
	Autovac    []string    // what those workers vacuumed ("bench_river: VACUUM public.river_job")
	DAMON      string      // the machine's kdamond: "stopped" for the run, "on", or "" (none)
	KdamondMS  float64     // its CPU time during the run
	Hops       [][]float64 // -trace-latency, pepsi: per hop of hopNames, sorted ms
	Err        string
}

// W3: single inserts at 20/s and 200/s; latency to stage start and to done.
func (b *bench) w3(ctx context.Context) error {
	for _, rate := range b.sz.w3Rates {
		for _, s := range b.systemsFor("W3") {
			l := b.latencyRun(ctx, s, "W3", rate, b.sz.w3Duration[rate], 1)
			b.res.addLatency(l)
			if ctx.Err() != nil {
				return ctx.Err()
			}
		}
	}
	// The same at 20/s with the machine's DAMON left running, for pepsi and the raw loop: what
	// the kernel's reclaim does to the tails (quiet.go).
	if len(b.damonStopped) == 0 {
		return nil
	}
	for _, s := range b.systemsFor("W3") {
		if s.name != "pepsi" && s.name != "raw" {
			continue
		}
		b.res.addLatency(b.latencyRun(ctx, s, w3DamonOn, 20, b.sz.w3Duration[20], 1))
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
	return nil
}

// w3DamonOn is the workload name of W3's context runs with DAMON running.
const w3DamonOn = "W3d"

func (b *bench) latencyRun(ctx context.Context, s *system, wl string, rate int, dur time.Duration, stages int) (l latencyResult) {
	l = latencyResult{Workload: wl, System: s.name, Rate: rate, Stages: stages}
	defer func() {
		if l.Err != "" {
			logf("  %s %d/s %-14s FAILED: %s", wl, rate, s.name, l.Err)
		} else {
			logf("  %s %d/s %-14s %d sent; start p50 %.2f p99 %.2f max %.2f ms; done p50 %.2f p99 %.2f max %.2f ms  other load %.0f%%  autovacuum %.0f%% %v  DAMON %q kdamond %.0f ms",
				wl, rate, s.name, l.Sent, pct(l.Start, 50), pct(l.Start, 99), pct(l.Start, 100),
				pct(l.Done, 50), pct(l.Done, 99), pct(l.Done, 100), l.OtherPct, l.AutovacPct, l.Autovac, l.DAMON, l.KdamondMS)
		}
	}()
	fail := func(err error) latencyResult {
		l.Err = err.Error()
		return l
	}
	if err := s.reset(ctx); err != nil {
		return fail(err)
	}
	if err := s.installDoneTrigger(ctx); err != nil {
		return fail(fmt.Errorf("install the done trigger: %w", err))
	}
	defer func() {
		if err := s.dropDoneTrigger(context.Background()); err != nil {
			logf("drop the done trigger: %v", err)
		}
	}()
	b.quiesce(ctx)
	if wl == w3DamonOn {
		if err := damon.Set(b.damonStopped, "on"); err != nil {
			logf("  %v", err)
		}
		defer func() {
			if err := damon.Set(b.damonStopped, "off"); err != nil {
				logf("  %v", err)
			}
		}()
	}
	if damon.Running() {
		l.DAMON = "on"
	} else if len(b.damonStopped) > 0 {
		l.DAMON = "stopped"
	}
	b.pg.checkpoint(ctx)
	var traceOff int64
	if b.traceLatency && s.kind == kindPepsi {
		traceOff = b.pg.logOffset()
		db := "ALTER DATABASE " + s.dbname
		if _, err := b.pg.admin.Exec(ctx, db+" SET log_min_duration_statement = 0"); err != nil {
			return fail(err)
		}
		defer b.pg.admin.Exec(context.Background(), db+" RESET log_min_duration_statement")
	}

	// The observer: LISTEN bench_done on a connection of its own; a notification arrives once
	// the transaction that finished the message has committed.
	lctx, lcancel := context.WithCancel(ctx)
	defer lcancel()
	lconn, err := pgx.Connect(ctx, s.dsn)
	if err != nil {
		return fail(err)
	}
	defer lconn.Close(context.Background())
	if _, err := lconn.Exec(ctx, "LISTEN bench_done"); err != nil {
		return fail(err)
	}
	var (
		mu     sync.Mutex
		doneAt = map[int64]time.Time{}
	)
	var lwg sync.WaitGroup
	lwg.Add(1)
	go func() {
		defer lwg.Done()
		for lctx.Err() == nil {
			n, err := lconn.WaitForNotification(lctx)
			if err != nil {
				return
			}
			t := time.Now()
			mu.Lock()
			for _, f := range strings.Split(n.Payload, ",") { // PgQ: a batch's messages in one
				if k, err := strconv.ParseInt(f, 10, 64); err == nil {
					if _, ok := doneAt[k]; !ok {
						doneAt[k] = t
					}
				}
			}
			mu.Unlock()
		}
	}()

	p, err := b.startSUT(ctx, s, startOpts{stages: stages, stamp: true, tag: fmt.Sprintf("%s-%d", wl, rate)})
	if err != nil {
		return fail(err)
	}
	defer p.stop()
	total := int(dur.Seconds() * float64(rate))
	interval := time.Second / time.Duration(rate)
	// allDone reports whether every message of keys has finished (doneAt has the warm-up's
	// messages and the measured ones).
	allDone := func(keys []int64) bool {
		mu.Lock()
		defer mu.Unlock()
		for _, k := range keys {
			if _, ok := doneAt[k]; !ok {
				return false
			}
		}
		return true
	}
	// Warm-up: the first messages after a start pay for what a running system has already
	// done: pepsi starts its first worker on demand (its first message waited 36-50 ms for it,
	// and at 200/s the next ten behind it), Node compiles the hot path, every process fills its
	// caches. One second at the run's rate, waited for, for every system alike; its messages
	// are in no figure, its CPU in no count.
	warm, err := sendOpenLoop(ctx, s, rate, interval, warmLatencyMsg, stages, nil)
	if err != nil {
		return fail(fmt.Errorf("warm-up: %w", err))
	}
	if err := waitDone(ctx, warm, allDone, b.sz.latencyLinger); err != nil {
		return fail(fmt.Errorf("warm-up: %w", err))
	}
	enq := make(map[int64]time.Time, total)
	av := b.sampleAutovacuum(ctx)
	defer av.stop()
	k0 := kdamondMS()
	s0 := b.snap(ctx, p)
	sent, err := sendOpenLoop(ctx, s, total, interval, 1, stages, func(key int64) {
		enq[key] = time.Now() // the INSERT has committed: the message exists from here
	})
	if err != nil {
		return fail(err)
	}
	l.Sent = total
	// Past the linger the run goes on: the messages still missing are counted below.
	_ = waitDone(ctx, sent, allDone, b.sz.latencyLinger)
	if ctx.Err() != nil {
		return fail(ctx.Err())
	}
	s1 := b.snap(ctx, p)
	l.AutovacPct, l.Autovac = av.finish()
	l.KdamondMS = kdamondMS() - k0
	var m measurement
	fill(&m, s0, s1)
	m.Transitions = int64(total * stages)
	if m.Seconds > 0 {
		l.CPUPerSec = (m.SelfMS + m.ChildMS + m.PGMS) / m.Seconds
	}
	l.OtherPct = m.OtherPct
	if err := p.stop(); err != nil {
		logf("  %s: stop: %v (see %s)", s.name, err, p.logPath)
	}
	lcancel()
	lwg.Wait()
	starts, err := p.readStamps(ctx)
	if err != nil {
		return fail(fmt.Errorf("read start stamps: %w", err))
	}
	mu.Lock()
	defer mu.Unlock()
	missing := 0
	for k, t := range enq {
		if st, ok := starts[k]; ok {
			l.Start = append(l.Start, float64(st-t.UnixNano())/1e6)
		}
		if d, ok := doneAt[k]; ok {
			l.Done = append(l.Done, float64(d.Sub(t).Nanoseconds())/1e6)
		} else {
			missing++
		}
	}
	if b.traceLatency {
		b.writeLatencyCSV(fmt.Sprintf("%s-%s-%d", s.name, wl, rate), enq, starts, doneAt)
		if s.kind == kindPepsi && stages == 1 {
			l.Hops = b.traceHops(traceOff, enq, starts, doneAt)
		}
	}
	slices.Sort(l.Start)
	slices.Sort(l.Done)
	if missing > 0 {
		l.Err = fmt.Sprintf("%d of %d messages not done within %s of the last enqueue", missing, total, b.sz.latencyLinger)
	}
	return l
}

// warmLatencyMsg numbers the warm-up's messages (River, Graphile Worker and PgQ key a message
// by its number): far above any measured message's.
const warmLatencyMsg = 1 << 40

// sendOpenLoop enqueues n messages numbered from first, message i at its start + i*interval
// whatever happened before (an open loop), and returns their keys; sent, if not nil, is
// called with each key once its INSERT has committed.
func sendOpenLoop(ctx context.Context, s *system, n int, interval time.Duration, first int64, stages int,
	sent func(key int64)) ([]int64, error) {
	keys := make([]int64, 0, n)
	begin := time.Now()
	for i := 0; i < n; i++ {
		if d := time.Until(begin.Add(time.Duration(i) * interval)); d > 0 {
			select {
			case <-ctx.Done():
				return keys, ctx.Err()
			case <-time.After(d):
			}
		}
		key, err := s.enqueueOne(ctx, first+int64(i), stages)
		if err != nil {
			return keys, fmt.Errorf("enqueue: %w", err)
		}
		if sent != nil {
			sent(key)
		}
		keys = append(keys, key)
	}
	return keys, nil
}

// waitDone polls allDone for keys every 10 ms, for at most limit.
func waitDone(ctx context.Context, keys []int64, allDone func([]int64) bool, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for !allDone(keys) {
		if time.Now().After(deadline) {
			return fmt.Errorf("not all of %d messages done within %s", len(keys), limit)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	return nil
}

// writeLatencyCSV writes each message's enqueue, start and done times (Unix ns; 0: none) to
// logs/NAME.latency.csv, for matching the slow ones with the server's statement log.
func (b *bench) writeLatencyCSV(name string, enq map[int64]time.Time, starts map[int64]int64, done map[int64]time.Time) {
	var w strings.Builder
	w.WriteString("key,enqueued_ns,start_ns,done_ns\n")
	keys := make([]int64, 0, len(enq))
	for k := range enq {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		var d int64
		if t, ok := done[k]; ok {
			d = t.UnixNano()
		}
		fmt.Fprintf(&w, "%d,%d,%d,%d\n", k, enq[k].UnixNano(), starts[k], d)
	}
	path := filepath.Join(b.tmp, "logs", name+".latency.csv")
	if err := os.WriteFile(path, []byte(w.String()), 0o644); err != nil {
		logf("  write %s: %v", path, err)
	}
}

// pct is the p-th percentile (nearest rank) of sorted values; p = 100 is the maximum.
func pct(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted))*p/100+0.999999) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// W5: W1 on a big table: done and failed rows already present.
// W5b: pepsi's W1 again, as many messages as W5, run just before each of pepsi's W5 runs on a
// database of its own (an empty table: pepsi's W1 on its own table would truncate the big
// one), so that the target "W5 ≥ 95 % of W1" compares rounds of the same minutes: W1's own runs
// are forty minutes earlier, and the host drifts by more than the target's margin in that time
// (the committed run of 1955cb0: W5 71 % of W1's median, 102 % of W1b's, minutes before W5).
func (b *bench) w5(ctx context.Context) error {
	var beside *system
	for _, s := range b.systemsFor("W5") {
		if s.name == "pepsi" {
			beside = &system{name: s.name, kind: s.kind, label: s.label, dbname: w5BesideDB}
			if err := b.setupSystem(ctx, beside); err != nil {
				return fmt.Errorf("%s: set up: %w", w5BesideDB, err)
			}
			b.besides = append(b.besides, beside)
			// Its first run on a database no one has used yet: a warm-up, as W1 has.
			if m := b.backlogRun(ctx, beside, w5Beside+"-warm-up", 0, b.sz.w5Messages, 1, 0, false); m.Err != "" {
				logf("  %s warm-up failed: %s (its measured runs will tell)", w5Beside, m.Err)
			} else {
				logf("  %s warm-up %.0f/s, not measured", w5Beside, m.rate())
			}
		}
	}
	bases := map[string]int64{}
	loaded := map[string]int64{} // by database: systems of one kind share it
	for _, s := range b.systemsFor("W5") {
		base, ok := loaded[s.dbname]
		if !ok {
			logf("  %s: loading %d done and %d failed rows", s.dbname, b.sz.w5Done, b.sz.w5Failed)
			var err error
			if base, err = b.loadBigTable(ctx, s); err != nil {
				return fmt.Errorf("%s: load the big table: %w", s.dbname, err)
			}
			loaded[s.dbname] = base
		}
		bases[s.name] = base
		if s.kind != kindGraphile { // which counts the run's jobs only
			b.res.w5DoneRows[s.name] = b.sz.w5Done
		}
	}
	explained := map[string]bool{} // pepsi and pepsi-console share one database and one claim
	for _, s := range b.systems {
		if s.kind == kindPepsi && !explained[s.dbname] {
			explained[s.dbname] = true
			b.explainClaim(ctx, s)
		}
	}
	for r := 1; r <= b.sz.runs; r++ {
		for _, s := range b.order("W5", r) {
			if s.name == "pepsi" && beside != nil {
				m := b.backlogRun(ctx, beside, w5Beside, r, b.sz.w5Messages, 1, 0, false)
				if err := b.record(ctx, m); err != nil {
					return err
				}
			}
			m := b.backlogRun(ctx, s, "W5", r, b.sz.w5Messages, 1, bases[s.name], false)
			if err := b.record(ctx, m); err != nil {
				return err
			}
		}
	}
	return nil
}

func (b *bench) loadBigTable(ctx context.Context, s *system) (int64, error) {
	if err := s.reset(ctx); err != nil {
		return 0, err
	}
	all := b.sz.w5Done + b.sz.w5Failed
	var q string
	if s.kind == kindGraphile {
		if err := loadGraphileBigTable(ctx, s, all); err != nil {
			return 0, err
		}
		if err := s.vacuum(ctx); err != nil {
			return 0, err
		}
		return s.maxID(ctx)
	}
	if s.isRiver() {
		q = `INSERT INTO river_job (state, attempt, max_attempts, attempted_at, finalized_at, scheduled_at,
		        created_at, priority, args, kind, queue, errors)
		     SELECT CASE WHEN g <= $1 THEN 'completed' ELSE 'discarded' END::river_job_state,
		            CASE WHEN g <= $1 THEN 1 ELSE 25 END, 25,
		            now() - interval '1 hour', now() - interval '1 hour', now() - interval '2 hours',
		            now() - interval '2 hours', 1,
		            jsonb_build_object('msg', g, 'stage', 1, 'last', 1), 'bench', 'default',
		            CASE WHEN g > $1 THEN ARRAY[jsonb_build_object('attempt', 25, 'error', 'bench: synthetic failure',
		                                     'at', now() - interval '1 hour')] END
		       FROM generate_series(1, $2::bigint) g`
	} else {
		q = `INSERT INTO workqueue (stage, status, attempts, payload, state, created_at)
		     SELECT 's1', CASE WHEN g <= $1 THEN 'done' ELSE 'failed' END, CASE WHEN g <= $1 THEN 0 ELSE 5 END,
		            jsonb_build_object('msg', g),
		            CASE WHEN g <= $1 THEN '{}'::jsonb ELSE '{"dispatch_error": "bench: synthetic failure"}'::jsonb END,
		            now() - interval '2 hours'
		       FROM generate_series(1, $2::bigint) g`
	}
	if _, err := s.pool.Exec(ctx, q, b.sz.w5Done, all); err != nil {
		return 0, err
	}
	if err := s.vacuum(ctx); err != nil {
		return 0, err
	}
	return s.maxID(ctx)
}

// claimSQLRe finds the dispatcher's claim statement in claim.go, so that the plan shown is
// the one of the code being measured.
var claimSQLRe = regexp.MustCompile("(?s)const claimSQL = `(.*?)`")

// claimKeyedSQLRe finds the claim for stages with a KEY_LIMIT (claim.go).
var claimKeyedSQLRe = regexp.MustCompile("(?s)const claimKeyedSQL = `(.*?)`")

// explainClaim shows the plan of pepsi's claim on the big table with a backlog pending, in a
// transaction that is rolled back. First with the statistics a run starts with (the table was
// analysed before the backlog arrived, as in a real system where a burst lands on a quiet
// queue), as a custom and as a generic plan (which a long-lived prepared statement may switch
// to); then after ANALYZE with the backlog present.
func (b *bench) explainClaim(ctx context.Context, s *system) {
	src, err := os.ReadFile(filepath.Join(b.root, "claim.go"))
	if err != nil {
		b.res.explainErr = err.Error()
		return
	}
	mm := claimSQLRe.FindSubmatch(src)
	if mm == nil {
		b.res.explainErr = "claimSQL not found in claim.go"
		return
	}
	claim := strings.TrimSpace(string(mm[1]))
	capacity := b.pepsiWorkers * b.pepsiQueueLimit // W5 has one stage: all of the budget
	err = func() error {
		tx, err := s.pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(context.Background())
		if _, err := tx.Exec(ctx, `INSERT INTO workqueue (stage, payload)
			SELECT 's1', jsonb_build_object('msg', g) FROM generate_series(1, $1::bigint) g`, b.sz.w5Messages); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "PREPARE bench_claim(text[], int[]) AS "+claim); err != nil {
			return err
		}
		cases := []struct{ title, mode, before string }{
			{"statistics from before the backlog (as a run starts), custom plan", "force_custom_plan", ""},
			{"statistics from before the backlog, generic plan", "force_generic_plan", ""},
			{"after ANALYZE with the backlog present, custom plan", "force_custom_plan", "ANALYZE workqueue"},
		}
		for i, c := range cases {
			sp := fmt.Sprintf("bench_explain_%d", i)
			if _, err := tx.Exec(ctx, "SAVEPOINT "+sp); err != nil {
				return err
			}
			if c.before != "" {
				if _, err := tx.Exec(ctx, c.before); err != nil {
					return err
				}
			}
			if _, err := tx.Exec(ctx, "SET LOCAL plan_cache_mode = "+c.mode); err != nil {
				return err
			}
			// A bad plan on a big backlog can run for minutes: give EXPLAIN ANALYZE a budget,
			// and show the plan without ANALYZE when it runs out.
			if _, err := tx.Exec(ctx, fmt.Sprintf("SET LOCAL statement_timeout = %d", b.sz.explainBudget.Milliseconds())); err != nil {
				return err
			}
			e := explainPlan{Title: c.title, Cap: capacity}
			lines, err := queryLines(ctx, tx, fmt.Sprintf("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) EXECUTE bench_claim('{s1}', '{%d}')", capacity))
			if err != nil {
				e.TimedOut = fmt.Sprintf("EXPLAIN ANALYZE stopped after %s (%v)", b.sz.explainBudget, err)
				if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+sp); err != nil {
					return err
				}
				if c.before != "" {
					if _, err := tx.Exec(ctx, c.before); err != nil {
						return err
					}
				}
				if _, err := tx.Exec(ctx, "SET LOCAL plan_cache_mode = "+c.mode); err != nil {
					return err
				}
				if lines, err = queryLines(ctx, tx, fmt.Sprintf("EXPLAIN EXECUTE bench_claim('{s1}', '{%d}')", capacity)); err != nil {
					return err
				}
			}
			e.Plan = strings.Join(lines, "\n")
			e.Read, e.Claimed = e.rowsRead()
			b.res.explain = append(b.res.explain, e)
			logf("  claim plan, %s: %s", c.title, e.summary())
		}
		b.res.claimSQL = claim
		// PREPARE is not undone by the rollback: the pool's connection would keep it.
		_, err = tx.Exec(ctx, "DEALLOCATE bench_claim")
		return err
	}()
	if err != nil {
		b.res.explainErr = err.Error()
		logf("  explain the claim: %v", err)
	}
}

type explainPlan struct {
	Title    string
	Plan     string
	Cap      int
	Read     int64  // rows of workqueue the UPDATE's scan returned (rows × loops)
	Claimed  int64  // rows the UPDATE changed
	TimedOut string // EXPLAIN ANALYZE ran out of time: Plan is the plan without ANALYZE
}

func (e explainPlan) summary() string {
	if e.TimedOut != "" {
		return e.TimedOut
	}
	ms := ""
	if m := execTimeRe.FindStringSubmatch(e.Plan); m != nil {
		ms = m[1] + " ms, "
	}
	return fmt.Sprintf("%sclaimed %d, read %d rows", ms, e.Claimed, e.Read)
}

var execTimeRe = regexp.MustCompile(`Execution Time: ([0-9.]+) ms`)

// queryLines runs a query of one text column and returns its rows.
func queryLines(ctx context.Context, tx pgx.Tx, q string) ([]string, error) {
	rows, err := tx.Query(ctx, q)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var lines []string
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			return nil, err
		}
		lines = append(lines, line)
	}
	return lines, rows.Err()
}

// usesPendingIndex tells whether a plan reaches workqueue through the partial index, never a
// sequential scan of the table.
func (e explainPlan) usesPendingIndex() bool {
	return strings.Contains(e.Plan, "workqueue_pending") && !strings.Contains(e.Plan, "Seq Scan on workqueue")
}

var planRowsRe = regexp.MustCompile(`actual time=[0-9.]+\.\.[0-9.]+ rows=([0-9]+) loops=([0-9]+)`)

// rowsRead finds how many rows of workqueue the claim's UPDATE read (its scan of "workqueue q",
// not the pick "w"/"q_1": the rows it returned plus those its filter removed), and how many it
// updated.
func (e explainPlan) rowsRead() (read, claimed int64) {
	lines := strings.Split(e.Plan, "\n")
	for i, line := range lines {
		m := planRowsRe.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		r, _ := strconv.ParseInt(m[1], 10, 64)
		l, _ := strconv.ParseInt(m[2], 10, 64)
		switch {
		case strings.Contains(line, "Update on workqueue q"):
			claimed = r * l
		case strings.Contains(line, "on workqueue q ("):
			n := r*l + removedBelow(lines, i)*l
			read = max(read, n)
		}
	}
	return read, claimed
}

// removedBelow returns the "Rows Removed by Filter" of the plan node at lines[i] (per loop).
func removedBelow(lines []string, i int) int64 {
	for j := i + 1; j < len(lines) && !strings.Contains(lines[j], "->"); j++ {
		if _, v, ok := strings.Cut(lines[j], "Rows Removed by Filter: "); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return n
		}
	}
	return 0
}

// pickAccess describes how a logged claim plan found its pending rows, when it walked the
// primary key and filtered (the pick reads every row since the start of the table that is no
// longer pending).
func pickAccess(plan string) string {
	lines := strings.Split(plan, "\n")
	for i, line := range lines {
		if !strings.Contains(line, "using workqueue_pkey on workqueue w") {
			continue
		}
		m := planRowsRe.FindStringSubmatch(line)
		removed := removedBelow(lines, i)
		if m == nil || removed == 0 {
			return ""
		}
		return fmt.Sprintf("its pick of pending rows walked `workqueue_pkey` and filtered: %s rows removed by the filter to find %s pending ones",
			groupThousands(fmt.Sprint(removed)), m[1])
	}
	return ""
}

// idleResult is W6 for one system.
type idleResult struct {
	System  string
	Seconds float64
	Calls   int64   // pg_stat_statements calls in the system's database
	Xacts   int64   // pg_stat_database commits + rollbacks
	CPUMS   float64 // the system's process tree
	RSSKiB  int64
	Top     []stmtStat
	Err     string
}

// W6: the systems run idle side by side, each on its own database: queries and CPU.
func (b *bench) w6(ctx context.Context) error {
	type idler struct {
		s *system
		p *sutProc
		c treeCPU
		x int64
	}
	var idlers []*idler
	defer func() {
		for _, i := range idlers {
			i.p.stop()
		}
	}()
	idleDB := map[string]bool{}
	for _, s := range b.systemsFor("W6") {
		if s.kind == kindRaw {
			continue // the raw loop is not a product; its idle behaviour is ours to choose
		}
		if idleDB[s.dbname] {
			// Two Rivers (or Graphile Workers) on one database would share leadership and
			// queues, and their statements would mix: idle apart.
			own := &system{name: s.name, kind: s.kind, label: s.label, dbname: s.dbname + "_idle", once: s.once, only: s.only}
			if err := b.setupSystem(ctx, own); err != nil {
				return err
			}
			s = own
		}
		idleDB[s.dbname] = true
		p, err := b.startSUT(ctx, s, startOpts{stages: 1, tag: "W6"})
		if err != nil {
			b.res.idle = append(b.res.idle, idleResult{System: s.name, Err: err.Error()})
			continue
		}
		idlers = append(idlers, &idler{s: s, p: p})
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(b.sz.w6Warmup):
	}
	procs := allProcs()
	for _, i := range idlers {
		b.pg.resetStatements(ctx, i.s.dbname)
		i.c = cpuOfTree(procs, i.p.pid)
		i.x = b.pg.xactCommits(ctx, i.s.dbname)
	}
	t0 := time.Now()
	logf("  idle for %s: %d systems side by side", b.sz.w6Idle, len(idlers))
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(b.sz.w6Idle):
	}
	secs := time.Since(t0).Seconds()
	procs = allProcs()
	for _, i := range idlers {
		c := cpuOfTree(procs, i.p.pid)
		top, calls := b.pg.topStatements(ctx, i.s.dbname, 8)
		r := idleResult{System: i.s.name, Seconds: secs, Calls: calls, Top: top,
			Xacts: b.pg.xactCommits(ctx, i.s.dbname) - i.x,
			CPUMS: float64((c.total() - i.c.total()) * msPerTick), RSSKiB: peakRSSKiB(i.p.pid)}
		if !i.p.alive() {
			r.Err = fmt.Sprintf("exited during the idle period: %v", i.p.waitErr)
		}
		b.res.idle = append(b.res.idle, r)
		logf("  W6 %-14s %5.2f queries/s  %5.2f xacts/s  cpu %.0f ms in %.0f s", i.s.name,
			float64(calls)/secs, float64(r.Xacts)/secs, r.CPUMS, secs)
	}
	return nil
}
