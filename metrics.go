// metrics.go: the /metrics endpoint, in the Prometheus text format.
//
// The coordinator publishes a snapshot of its counters and live gauges (at most once a second,
// only when the endpoint is on); the HTTP handler reads the latest snapshot through an atomic
// pointer and never waits for the coordinator. Row counts per stage and status come from one
// query of the handler's own, on the pool, so a scrape costs the database one statement and
// the coordinator nothing.

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// metricsPublishEvery bounds how often the coordinator copies its state for /metrics.
const metricsPublishEvery = time.Second

// metricsSnapshot is what the coordinator publishes.
type metricsSnapshot struct {
	at           time.Time
	started      time.Time
	epoch        int64
	stages       []stageSnapshot // sorted by name
	global       globalCounters
	fanin        faninCounters
	workers      int
	inflight     int
	config       []*StageConfig // the stage table as the coordinator runs it, sorted by name
	claimMax     time.Duration
	held         int // writes waiting for a row another transaction holds (outcome.go)
	refused      int // writes the database refused by themselves, tried again (outcome.go)
	faninHeld    int // fan-in groups the last flush passed over: another transaction holds a row (fanin.go)
	faninRefused int // fan-in groups whose events the database refused to apply by themselves (fanin.go)
	strays       int // stages with pending rows that the configuration lacks, at the last listing (strays.go)
}

type stageSnapshot struct {
	name     string
	workers  int
	inflight int
	running  int // rows of the stage this dispatcher holds running: in flight, and writes not yet made
	held     bool
	paused   bool // PAUSED = yes (pepsi-queue pause): not claimed
	c        stageCounters
}

// metricsServer serves /metrics.
type metricsServer struct {
	snap    atomic.Pointer[metricsSnapshot]
	db      atomic.Pointer[sql.DB] // nil when the lock service runs alone, and until the pool exists
	ha      *haBoard               // the dispatcher's role and server; nil without a dispatcher
	locks   *lockServer            // nil without [poolcounter]
	log     *slog.Logger
	version string
	console *console // the web console under /; nil for the lock service alone
}

// countHeld adds the held write of m to held, or to refused when the database refused it by
// itself.
func countHeld(m *message, held, refused int) (int, int) {
	if m.writeRefused {
		return held, refused + 1
	}
	return held + 1, refused
}

// publish is called by the coordinator with a fresh snapshot.
func (m *metricsServer) publish(s *metricsSnapshot) { m.snap.Store(s) }

// snapshot builds the coordinator's snapshot; it runs on the coordinator goroutine.
func (c *coordinator) snapshot() *metricsSnapshot {
	s := &metricsSnapshot{at: time.Now(), started: c.started, epoch: c.inst.epoch,
		global: c.stats.Global, fanin: c.stats.Fanin, workers: len(c.workers), inflight: c.inflightAll,
		claimMax: c.claimMax, faninHeld: c.fanin.heldGroups, faninRefused: len(c.fanin.refused),
		strays: len(c.strays.logged)}
	// A held write the database refused by itself (noteRefused) waits with those another
	// transaction holds, but what to do about it is not the same: counted apart.
	for _, f := range c.heldFailures {
		s.held, s.refused = countHeld(f.m, s.held, s.refused)
	}
	for _, m := range c.heldResets {
		s.held, s.refused = countHeld(m, s.held, s.refused)
	}
	now := time.Now()
	names := map[string]bool{}
	for name := range c.pools {
		names[name] = true
	}
	for name := range c.stats.Stages {
		names[name] = true
	}
	perStage := map[string]int{}
	for _, w := range c.workers {
		perStage[w.stage]++
	}
	// The rows still running that no worker has: their failure or reset is yet to be written
	// (queued, or waiting for a row another transaction holds). A forgotten one's row is no
	// longer our claim.
	unwritten := map[string]int{}
	for _, fs := range [][]failure{c.failures, c.heldFailures} {
		for _, f := range fs {
			if !f.m.forgotten {
				unwritten[f.m.stage]++
			}
		}
	}
	for _, ms := range [][]*message{c.resets, c.heldResets} {
		for _, m := range ms {
			if !m.forgotten {
				unwritten[m.stage]++
			}
		}
	}
	for name := range unwritten {
		names[name] = true
	}
	for name := range names {
		ss := stageSnapshot{name: name, workers: perStage[name], inflight: c.inflight[name],
			running: c.inflight[name] + unwritten[name]}
		if p := c.pools[name]; p != nil {
			ss.held = p.held(now)
			ss.paused = p.cfg.Paused
		}
		if sc := c.stats.Stages[name]; sc != nil {
			ss.c = *sc
		}
		s.stages = append(s.stages, ss)
	}
	slices.SortFunc(s.stages, func(a, b stageSnapshot) int { return strings.Compare(a.name, b.name) })
	for _, p := range c.pools {
		sc := *p.cfg // a copy: the console reads it on another goroutine
		s.config = append(s.config, &sc)
	}
	slices.SortFunc(s.config, func(a, b *StageConfig) int { return strings.Compare(a.Name, b.Name) })
	return s
}

// listenMetrics opens the endpoint's socket (before privileges are dropped).
func listenMetrics(addr string) (net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on METRICS_LISTEN %s: %w", addr, err)
	}
	return ln, nil
}

// httpLimits are the HTTP listener's timeouts. Each connection is a goroutine and a
// descriptor of the daemon's, whose workers' pipes and PoolCounter clients need descriptors
// too: with only the header's timeout (as before), a keep-alive connection left idle, or a
// request whose body came a byte at a time, was kept for as long as its client liked
// (TestHTTPServerTimeouts).
type httpLimits struct {
	header time.Duration // the request line and headers
	read   time.Duration // the whole request, body included (forms are small)
	write  time.Duration // from the end of the headers to the end of the answer: above the longest page (a group action's 30 s)
	idle   time.Duration // a keep-alive connection between requests (Prometheus scrapes every 15 to 60 s)
}

var httpTimeouts = httpLimits{header: 5 * time.Second, read: 30 * time.Second, write: 2 * time.Minute, idle: 2 * time.Minute}

// newHTTPServer is the listener's server for handler h.
func newHTTPServer(h http.Handler, l httpLimits) *http.Server {
	return &http.Server{Handler: h, ReadHeaderTimeout: l.header, ReadTimeout: l.read, WriteTimeout: l.write,
		IdleTimeout: l.idle, MaxHeaderBytes: 64 << 10}
}

// serve runs the HTTP server until ctx ends.
func (m *metricsServer) serve(ctx context.Context, ln net.Listener) {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /metrics", m.handle)
	var sampling sync.WaitGroup
	if m.console != nil {
		m.console.routes(mux)
		sampling.Add(1)
		go func() { defer sampling.Done(); m.console.samples.sampleLoop(ctx) }()
	}
	var h http.Handler = mux
	if m.console != nil {
		h = withConsoleHeaders(mux)
	}
	srv := newHTTPServer(h, httpTimeouts)
	done := make(chan struct{})
	go func() {
		defer close(done)
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		srv.Shutdown(sctx) // a scrape still running after 2 s is cut off: nothing is lost
	}()
	if err := srv.Serve(ln); err != nil && err != http.ErrServerClosed {
		m.log.Error("metrics endpoint stopped", "err", err)
	}
	<-done
	sampling.Wait()
}

func (m *metricsServer) handle(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	var b strings.Builder
	m.write(r.Context(), &b)
	io.WriteString(w, b.String())
}

// promWriter writes metric families, each HELP/TYPE header once.
type promWriter struct {
	w    io.Writer
	seen map[string]bool
}

func (p *promWriter) sample(name, typ, help, labels string, v any) {
	if !p.seen[name] {
		p.seen[name] = true
		fmt.Fprintf(p.w, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, typ)
	}
	if labels != "" {
		labels = "{" + labels + "}"
	}
	fmt.Fprintf(p.w, "%s%s %v\n", name, labels, v)
}

// counterValue is a counter's /metrics value: milliseconds shown as seconds.
func counterValue(def counterDef, v int64) any {
	if def.ms {
		return fmt.Sprintf("%.3f", float64(v)/1000)
	}
	return v
}

func stageLabel(name string) string { return label("stage", name) }

// promEscaper escapes a label value as the exposition format asks: a backslash, a double
// quote and a line feed, and nothing else. Not Go's %q: it also writes \t, \x1b or \u202e,
// which Prometheus refuses, so one row at a stage named with a tab (a producer can insert any
// stage name) made the whole scrape fail (TestMetricsOddStageNames).
var promEscaper = strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`)

// label is one label of a sample, name="value".
func label(name, value string) string { return name + `="` + promEscaper.Replace(value) + `"` }

func (m *metricsServer) write(ctx context.Context, w io.Writer) {
	p := &promWriter{w: w, seen: map[string]bool{}}
	p.sample("pepsi_build_info", "gauge", "Version of the running pepsi-dispatch.", label("version", m.version), 1)
	if s := m.snap.Load(); s != nil {
		p.sample("pepsi_start_time_seconds", "gauge", "When this dispatcher started (Unix time).", "", s.started.Unix())
		p.sample("pepsi_instance_epoch", "gauge", "Start number of this dispatcher in dispatch_instance.", "", s.epoch)
		p.sample("pepsi_snapshot_age_seconds", "gauge", "Age of the coordinator's snapshot behind these figures.", "", fmt.Sprintf("%.3f", time.Since(s.at).Seconds()))
		for _, def := range dispatchCounterDefs {
			p.sample(def.metric, "counter", def.help, "", counterValue(def.counterDef, def.get(&s.global, &s.fanin)))
		}
		p.sample("pepsi_workers", "gauge", "Live worker processes.", "", s.workers)
		p.sample("pepsi_in_flight", "gauge", "Messages in workers' queues.", "", s.inflight)
		p.sample("pepsi_claim_seconds_max", "gauge", "Longest claim statement since the start.", "",
			fmt.Sprintf("%.6f", s.claimMax.Seconds()))
		p.sample("pepsi_held_writes", "gauge", "Failure and reset writes waiting for a row another transaction holds.", "", s.held)
		p.sample("pepsi_refused_writes", "gauge", "Failure and reset writes the database refused by themselves (an application's rule on the row), tried again every second.", "", s.refused)
		p.sample("pepsi_fanin_held_groups", "gauge", "Fan-in groups the last flush passed over: another transaction holds a row they write.", "", s.faninHeld)
		p.sample("pepsi_fanin_refused_groups", "gauge", "Fan-in groups whose completions the database refused to apply by themselves (an application's rule on a waiting parent).", "", s.faninRefused)
		p.sample("pepsi_stray_stages", "gauge", "Stages with pending rows that the configuration does not have: nothing claims them (listed once a minute).", "", s.strays)
		for _, st := range s.stages {
			l := stageLabel(st.name)
			p.sample("pepsi_stage_workers", "gauge", "Live worker processes per stage.", l, st.workers)
			p.sample("pepsi_stage_in_flight", "gauge", "Messages in workers' queues per stage.", l, st.inflight)
			held := 0
			if st.held {
				held = 1
			}
			p.sample("pepsi_stage_held", "gauge", "1 while the stage's program is on launch cool-down.", l, held)
			paused := 0
			if st.paused {
				paused = 1
			}
			p.sample("pepsi_stage_paused", "gauge", "1 while the stage is paused (PAUSED = yes, pepsi-queue pause).", l, paused)
		}
		for _, def := range stageCounterDefs {
			typ := "counter"
			if def.max {
				typ = "gauge"
			}
			for _, st := range s.stages {
				p.sample(def.metric, typ, def.help, stageLabel(st.name), counterValue(def.counterDef, *def.field(&st.c)))
			}
		}
	}
	if m.ha != nil {
		m.ha.writeHA(p)
	}
	if db := m.db.Load(); db != nil {
		var known []string // the configured stages and those with counters: their rows gauges exist even at 0
		running := map[string]int{}
		if s := m.snap.Load(); s != nil {
			for _, st := range s.stages {
				known = append(known, st.name)
				running[st.name] = st.running
			}
		}
		m.writeRows(ctx, db, p, known, running)
	}
	if m.locks != nil {
		m.locks.writeMetrics(w)
	}
	writeProcessMetrics(p)
}

// otherStages is the stage label of the rows of the stages past strayListMax that the
// dispatcher does not run (writeRows): no stage can be configured by that name.
const otherStages = "(other stages)"

// rowStatuses are the statuses pepsi_rows counts (done and cancelled rows are not counted: they only grow).
var rowStatuses = []string{"failed", "held", "paused", "pending", "running", "waiting"}

// writeRows adds the row gauges: rows per stage and status, and the oldest pending row's age.
// Every stage of known and every stage with rows gets a sample for every status of rowStatuses,
// 0 when it has none: a gauge that vanishes when the queue empties reads as "no data" to an
// alert on it (pepsi_rows{status="failed"} > 0 would go silent instead of false). The rows
// are counted through their statuses' partial indexes (liveRowsSQL), and the running ones are
// the dispatcher's own count (running, from the coordinator's snapshot): no index serves them.
func (m *metricsServer) writeRows(ctx context.Context, db *sql.DB, p *promWriter, known []string, running map[string]int) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	lines, err := countPerStage(ctx, db)
	if err != nil {
		p.sample("pepsi_rows_query_ok", "gauge", "0 when the row gauges could not be read.", "", 0)
		if r := ctx.Err(); r == nil || errors.Is(r, context.DeadlineExceeded) {
			m.log.Warn("metrics: row gauges not read", "err", err) // not for a scraper that left
		}
		return
	}
	type key struct{ stage, status string }
	counts := map[key]int64{}
	ages := map[string]float64{}
	stages := map[string]bool{}
	for _, st := range known {
		stages[st] = true
	}
	for _, l := range lines {
		if l.status == "cancelled" {
			continue // ended, like done: not a gauge of work
		}
		counts[key{l.stage, l.status}] = l.n
		stages[l.stage] = true
		if l.status == "pending" {
			ages[l.stage] = l.oldest.Seconds()
		}
	}
	for stage, n := range running {
		if n > 0 {
			counts[key{stage, "running"}] = int64(n)
			stages[stage] = true
		}
	}
	// The stages the dispatcher does not know (strays.go) get series of their own up to
	// strayListMax, those with the most rows; the rows of the others are summed under
	// otherStages, so that a sum over stages stays right and the series stay few.
	isKnown := map[string]bool{}
	for _, st := range known {
		isKnown[st] = true
	}
	unknown := map[string]int64{}
	for k, n := range counts {
		if !isKnown[k.stage] {
			unknown[k.stage] += n
		}
	}
	if _, rest := topStages(unknown, strayListMax); len(rest) > 0 {
		for _, stage := range rest {
			for _, status := range rowStatuses {
				counts[key{otherStages, status}] += counts[key{stage, status}]
			}
			ages[otherStages] = max(ages[otherStages], ages[stage])
			delete(stages, stage)
		}
		stages[otherStages] = true
	}
	names := slices.Sorted(maps.Keys(stages))
	for _, stage := range names {
		for _, status := range rowStatuses {
			p.sample("pepsi_rows", "gauge", "Rows per stage and status (done and cancelled rows are not counted).",
				label("stage", stage)+","+label("status", status), counts[key{stage, status}])
		}
	}
	for _, stage := range names {
		p.sample("pepsi_oldest_pending_seconds", "gauge", "Age of the oldest pending row per stage (0: none).",
			stageLabel(stage), fmt.Sprintf("%.3f", ages[stage]))
	}
	p.sample("pepsi_rows_query_ok", "gauge", "0 when the row gauges could not be read.", "", 1)
	var open, quarantined int64
	var oldest float64
	if err := db.QueryRowContext(ctx, `SELECT open_groups, oldest_open_age_s, quarantined FROM fanin_status()`).
		Scan(&open, &oldest, &quarantined); err == nil {
		p.sample("pepsi_fanin_open_groups", "gauge", "Fan-out groups waiting for children.", "", open)
		p.sample("pepsi_fanin_oldest_open_age_seconds", "gauge", "Age of the oldest open fan-out group.", "", fmt.Sprintf("%.3f", oldest))
		p.sample("pepsi_fanin_quarantine_rows", "gauge", "Groups in fanin_quarantine now.", "", quarantined)
	}
}
