// report.go: medians, ratios, the Markdown report and the SVG chart.
package main

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

type stmtReport struct {
	Workload    string
	Top         []stmtStat
	Calls       int64
	Transitions int64
}

type results struct {
	b          *bench
	meas       []measurement
	lat        []latencyResult
	explain    []explainPlan
	explainErr string
	claimSQL   string
	idle       []idleResult
	stmts      map[string]stmtReport
	pepsiW1    pepsiStats
	pgqVersion string
	w5DoneRows map[string]int64
	elapsed    time.Duration
	diag       []diagPlan
	diagErr    string
	diagRun    measurement
}

func (r *results) init(b *bench) {
	r.b = b
	r.stmts = map[string]stmtReport{}
	r.w5DoneRows = map[string]int64{}
}

func (r *results) add(m measurement)          { r.meas = append(r.meas, m) }
func (r *results) addLatency(l latencyResult) { r.lat = append(r.lat, l) }
func (r *results) setStatements(sys, wl string, top []stmtStat, calls, transitions int64) {
	r.stmts[sys] = stmtReport{Workload: wl, Top: top, Calls: calls, Transitions: transitions}
}

// summary is the median of the successful runs of one workload on one system.
type summary struct {
	n, failed                    int
	rate, minRate, maxRate       float64
	cpu1k, self1k, child1k, pg1k float64
	wal                          float64
	rss, childRSS                float64 // KiB
	msgRate                      float64
	other                        float64 // % of the machine used by other processes
	errs, notes                  []string
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// throughputWorkloads are the workloads of the cost table, in its order.
var throughputWorkloads = []string{"W1", "W2", w1Beside, "W4", "W4f", "W4w", w5Beside, "W5"}

// autovacuumInThroughput counts the valid throughput runs during which an autovacuum worker
// was busy (quiet.go quiesces before each, so this is what woke up in the run itself), and
// names up to five of them with what was vacuumed: ": W1 river run 2 (12 %: bench_river:
// autovacuum: VACUUM ANALYZE public.river_job), …".
func (r *results) autovacuumInThroughput() (busy, of int, what string) {
	var named []string
	for _, m := range r.meas {
		if m.Err != "" || !slices.Contains(throughputWorkloads, m.Workload) {
			continue
		}
		of++
		if m.AutovacPct > 0 {
			busy++
			if len(named) < 5 {
				named = append(named, fmt.Sprintf("%s %s run %d (%.0f %%: %s)", m.Workload, m.System, m.Run, m.AutovacPct, strings.Join(m.Autovac, "; ")))
			}
		}
	}
	if len(named) > 0 {
		what = ": " + strings.Join(named, ", ")
		if busy > len(named) {
			what += ", …"
		}
	}
	return busy, of, what
}

func (r *results) summary(wl, sys string) summary {
	var s summary
	var rate, msg, cpu, self, child, pg, wal, rss, crss, other []float64
	for _, m := range r.meas {
		if m.Workload != wl || m.System != sys {
			continue
		}
		if m.Err != "" {
			s.failed++
			s.errs = append(s.errs, fmt.Sprintf("run %d: %s", m.Run, m.Err))
			continue
		}
		s.n++
		if m.Note != "" {
			s.notes = append(s.notes, fmt.Sprintf("run %d: %s", m.Run, m.Note))
		}
		rate = append(rate, m.rate())
		msg = append(msg, float64(m.Messages)/m.Seconds)
		cpu = append(cpu, m.cpuPer1k())
		t := float64(m.Transitions) / 1000
		self = append(self, m.SelfMS/t)
		child = append(child, m.ChildMS/t)
		pg = append(pg, m.PGMS/t)
		wal = append(wal, m.walPer())
		rss = append(rss, float64(m.RSSKiB))
		crss = append(crss, float64(m.ChildRSSKiB))
		other = append(other, m.OtherPct)
	}
	s.rate, s.msgRate = median(rate), median(msg)
	if len(rate) > 0 {
		s.minRate, s.maxRate = slices.Min(rate), slices.Max(rate)
	}
	s.cpu1k, s.self1k, s.child1k, s.pg1k = median(cpu), median(self), median(child), median(pg)
	s.wal, s.rss, s.childRSS, s.other = median(wal), median(rss), median(crss), median(other)
	return s
}

func (r *results) latency(wl string, rate int, sys string) *latencyResult {
	for i := range r.lat {
		l := &r.lat[i]
		if l.Workload == wl && l.Rate == rate && l.System == sys {
			return l
		}
	}
	return nil
}

// Formatting helpers.
func f0(v float64) string {
	if math.IsNaN(v) {
		return "–"
	}
	return groupThousands(fmt.Sprintf("%.0f", v))
}

// pctDown prints a ratio in per cent to one decimal, rounded down: a figure beside a target
// ("≥ 95 %") must not print as reaching it when it does not (94.96 % read "95 %" beside
// "missed" in a committed run). The 1e-9 is for ratios whose thousandths are whole: 1.001 is
// 1000.999… thousandths in binary, and would print 100.0 % without it (TestPctDown).
func pctDown(ratio float64) string {
	return fmt.Sprintf("%.1f %%", math.Floor(1000*ratio+1e-9)/10)
}

func f1(v float64) string {
	if math.IsNaN(v) {
		return "–"
	}
	return fmt.Sprintf("%.1f", v)
}

func f2(v float64) string {
	if math.IsNaN(v) {
		return "–"
	}
	return fmt.Sprintf("%.2f", v)
}

func ratio(a, b float64) string {
	if math.IsNaN(a) || math.IsNaN(b) || b == 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f×", a/b)
}

func mib(kib float64) string {
	if math.IsNaN(kib) || kib == 0 {
		return "–"
	}
	return fmt.Sprintf("%.1f", kib/1024)
}

func groupThousands(s string) string {
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var out []byte
	for i := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			out = append(out, ',')
		}
		out = append(out, s[i])
	}
	if neg {
		return "-" + string(out)
	}
	return string(out)
}

func oneLineSQL(q string, n int) string {
	q = strings.Join(strings.Fields(q), " ")
	q = strings.ReplaceAll(q, "|", `\|`)
	if len(q) > n {
		q = q[:n] + "…"
	}
	return q
}

var workloadTitles = map[string]string{
	"W1":  "W1 backlog (1 stage)",
	"W2":  "W2 continuous (1 stage)",
	"W4":  "W4 backlog (3 stages)",
	"W4f": "W4f backlog (3 stages; pepsi's fused: FUSE = yes; the others' W4)",
	"W4w": "W4w backlog (3 stages; pepsi with PARALLELISM = the whole budget on each, not a target; the others' W4)",
	"W5":  "W5 big table (1 stage)",
}

func (b *bench) sysLabel(name string) string {
	for _, s := range b.systems {
		if s.name == name {
			return s.label
		}
	}
	return name
}

// report renders BENCHMARKS.md; chartPath is the chart's path relative to it.
func (b *bench) report(chartPath string) string {
	r := &b.res
	var w strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&w, format, args...) }
	model, memMiB := machineInfo()

	p("# Benchmarks: pepsi-dispatch, River, Graphile Worker, PgQ and a raw PostgreSQL loop\n\n")
	p("Issues 7 and 23's benchmark, side by side in one run on one private PostgreSQL cluster. ")
	p("Generated by the program in `bench/pipeline/`; do not edit by hand, run it again.\n\n")
	p("```sh\n%s\n```\n\n", b.command)
	mode := "full"
	if b.quick {
		mode = "quick (-quick: smaller sizes, 1 run; indicative only)"
	}
	p("| | |\n|---|---|\n")
	p("| date | %s |\n", b.started.UTC().Format("2006-01-02 15:04 UTC"))
	p("| mode | %s; %d run(s) per throughput measurement (River and Graphile Worker with their defaults: 1), medians reported; the whole run took %s |\n",
		mode, b.sz.runs, r.elapsed.Round(time.Second))
	p("| machine | `nproc` = %d, %s MiB memory, %s |\n", numCPU(), groupThousands(fmt.Sprint(memMiB)), model)
	p("| software | PostgreSQL %s, %s, River v0.51.2 (riverpgxv5, pgx v5), %s, %s, pepsi-dispatch from this tree |\n",
		b.pg.version, goVersion(), orText(b.graphile.version, "Graphile Worker not measured"), orText(r.pgqVersion, "PgQ not measured"))
	p("\n![throughput per workload and latency distributions](%s)\n\n", chartPath)

	b.howToRead(&w)

	// Summary.
	names := b.names()
	p("## Throughput (median of %d run(s))\n\n", b.sz.runs)
	p("Transitions per second (a transition = one message through one stage); W4 also in messages/s. ")
	p("Ratios are pepsi's throughput over the other system's: above 1 means pepsi is faster. PgQ runs W1 and W2 only.\n\n")
	p("| workload |")
	for _, n := range names {
		p(" %s |", b.sysLabel(n))
	}
	p(" pepsi / River tuned | pepsi / Graphile tuned | pepsi / raw |\n|---|")
	for range names {
		p("--:|")
	}
	p("--:|--:|--:|\n")
	for _, wl := range []string{"W1", "W2", "W4", "W4f", "W4w", "W5"} {
		if !b.want(wl) {
			continue
		}
		s := map[string]summary{}
		for _, sys := range names {
			s[sys] = r.summary(wl, sys)
			if base, ok := pepsiVariants[wl]; ok && sys != "pepsi" {
				s[sys] = r.summary(base, sys) // pepsi's variant: their own workload is the comparison
			}
		}
		p("| %s, transitions/s |", workloadTitles[wl])
		for _, n := range names {
			p(" %s |", f0(s[n].rate))
		}
		p(" %s | %s | %s |\n", ratio(s["pepsi"].rate, r.summary(baseOf(wl), "river").rate),
			ratio(s["pepsi"].rate, r.summary(baseOf(wl), "graphile").rate), ratio(s["pepsi"].rate, r.summary(baseOf(wl), "raw").rate))
		if wl == "W4" || pepsiVariants[wl] == "W4" {
			p("| %s, messages/s |", workloadTitles[wl])
			for _, n := range names {
				p(" %s |", f0(s[n].msgRate))
			}
			p(" | | |\n")
		}
	}
	p("\n")
	b.pythonReport(p)

	// Cost.
	p("## Cost per transition (medians)\n\n")
	p("CPU is utime+stime from `/proc` of every process involved, before and after the measured interval: ")
	p("the system's main process (pepsi: the dispatcher; River, the raw loop and Graphile Worker with its defaults: their ")
	p("one process; Graphile Worker tuned: the parent Node process that starts its runners; PgQ: the batch consumer), its ")
	p("children (pepsi: the stage workers, including those that exited; Graphile Worker tuned: its runner processes; PgQ: ")
	p("pgqd, the ticker), and every PostgreSQL process (backends, WAL writer, ")
	p("checkpointer, autovacuum; the benchmark's own polling backend too, the same for everyone). WAL is the ")
	p("`pg_current_wal_insert_lsn()` difference over the same interval. Peak RSS is `VmHWM` at the end of the run. ")
	p("*Other load* is the CPU that processes outside the benchmark and PostgreSQL used meanwhile, in %% of the ")
	p("machine (`/proc/stat`): the noise of a shared machine, which the medians do not remove.\n\n")
	p("| workload | system | runs ok | transitions/s (min–max) | CPU ms / 1k transitions: total | main process | children | PostgreSQL | WAL bytes / transition | peak RSS main, MiB | peak RSS per worker, MiB | other load |\n")
	p("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n")
	var failures []string
	for _, wl := range throughputWorkloads {
		if !b.want(wl) {
			continue
		}
		for _, sys := range names {
			if _, ok := pepsiVariants[wl]; ok && sys != "pepsi" {
				continue
			}
			s := r.summary(wl, sys)
			if s.n+s.failed == 0 {
				continue
			}
			child := f1(s.child1k)
			crss := mib(s.childRSS)
			if !b.hasChildren(sys) {
				child, crss = "–", "–"
			}
			p("| %s | %s | %d/%d | %s (%s–%s) | %s | %s | %s | %s | %s | %s | %s | %s %% |\n", wl, b.sysLabel(sys), s.n, s.n+s.failed,
				f0(s.rate), f0(s.minRate), f0(s.maxRate), f1(s.cpu1k), f1(s.self1k), child, f1(s.pg1k), f0(s.wal),
				mib(s.rss), crss, f0(s.other))
			for _, e := range s.errs {
				failures = append(failures, fmt.Sprintf("%s %s %s (failed, left out)", wl, b.sysLabel(sys), e))
			}
			for _, e := range s.notes {
				failures = append(failures, fmt.Sprintf("%s %s %s (rate measured over the limit, kept)", wl, b.sysLabel(sys), e))
			}
		}
	}
	p("\n")
	if busy, of, what := r.autovacuumInThroughput(); of > 0 {
		p("Autovacuum (sampled every %s in every throughput run above): a worker was busy in %d of %d runs%s.\n\n",
			avSampleEvery, busy, of, what)
	}
	if len(failures) > 0 {
		p("Runs cut at the time limit (their rate over the limit is kept) or failed (left out of the medians):\n\n")
		for _, f := range failures {
			p("- %s\n", f)
		}
		p("\n")
	}

	// Latency.
	if b.want("W3") || b.want("W4") {
		p("## Latency (W3: 1 stage; W4: 3 stages)\n\n")
		p("Open-loop producer: one `INSERT` (River: `client.Insert`) every 1/rate s, after a warm-up of one second at the same ")
		p("rate whose messages are waited for and counted nowhere (the first messages after a start pay for a worker's ")
		p("start, a JIT, cold caches: a running system has paid that already). *Enqueue* is when that insert has ")
		p("returned (committed). *Start* is when the first stage's code began on the message, by the clock of the process ")
		p("that ran it (pepsi: the stage program's handler, written into `state.t0` with the outcome; River: `Work()`; raw ")
		p("loop: the claim's return). *Done* is when the benchmark received a `NOTIFY` sent by a trigger on the row's ")
		p("final transition (pepsi/raw: `status = 'done'`; River: `state = 'completed'` of the last stage's job), i.e. ")
		p("after that transaction committed, so done includes the commit and is measured the same way for all. ")
		p("Milliseconds. CPU is that of the system and of PostgreSQL (all its processes) per second of the run, in ms/s; ")
		p("*other load* as in the cost table (the tails are sensitive to it: one run each). Before every latency run each ")
		p("benchmark database is vacuumed and analyzed and the run waits until no autovacuum worker runs (the backlog workloads leave ")
		p("hundreds of thousands of dead rows behind, and a worker waking up mid-run takes one of two cores for seconds); ")
		p("*autovacuum* is the share of the run, sampled every 250 ms, in which a worker was busy anyway, and what it vacuumed. ")
		p("*DAMON*: this machine's kernel runs DAMON, a memory monitor whose reclaim thread kdamond takes a vCPU for 25–43 ms at a ")
		p("time; %s ", map[bool]string{true: "the benchmark stops it for the whole run (`-pause-damon`), and **W3d** is W3 at 20/s once more for pepsi and the raw loop with it running, for comparison;",
			false: "it ran throughout (`-pause-damon=false`, or none to stop);"}[len(b.damonStopped) > 0])
		p("the column says whether it ran and its CPU time meanwhile (why: `bench/pipeline/quiet.go`).\n\n")
		p("| workload | rate | system | messages | start p50 | start p99 | start max | done p50 | done p99 | done max | CPU ms/s | other load | autovacuum | DAMON |\n")
		p("|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|---|\n")
		for _, l := range r.lat {
			errNote := ""
			if l.Err != "" {
				errNote = " (" + l.Err + ")"
			}
			av := f0(l.AutovacPct) + " %"
			if len(l.Autovac) > 0 {
				av += " (" + strings.Join(l.Autovac, "; ") + ")"
			}
			dm := "none"
			if l.DAMON != "" {
				dm = fmt.Sprintf("%s, kdamond %s ms", l.DAMON, f0(l.KdamondMS))
			}
			p("| %s | %d/s | %s | %d%s | %s | %s | %s | %s | %s | %s | %s | %s %% | %s | %s |\n", l.Workload, l.Rate, b.sysLabel(l.System), l.Sent, errNote,
				f2(pct(l.Start, 50)), f2(pct(l.Start, 99)), f2(pct(l.Start, 100)),
				f2(pct(l.Done, 50)), f2(pct(l.Done, 99)), f2(pct(l.Done, 100)), f0(l.CPUPerSec), f0(l.OtherPct), av, dm)
		}
		p("\n")
		b.hopsSection(&w)
	}

	// Targets.
	p("## Issue 23's targets, as measured in this run\n\n")
	b.targets(&w)
	p("\n")
	b.floorNotes(&w)

	// Where the time goes.
	if len(r.stmts) > 0 {
		p("## Where the time goes (W1, last run, `pg_stat_statements`)\n\n")
		p("Statements of each system's database during its last W1 run, heaviest first: calls and execution ")
		p("time per 1,000 transitions. Execution time is server time inside the statement (not the commit's WAL ")
		p("flush wait, nor the client round trips).\n\n")
		if ps := r.pepsiW1; ps.StageRuns > 0 {
			p("pepsi's own counters for that run: %s claim statements that returned rows for %s stage runs (%.1f messages ",
				groupThousands(fmt.Sprint(ps.Claims)), groupThousands(fmt.Sprint(ps.StageRuns)), float64(ps.StageRuns)/math.Max(float64(ps.Claims), 1))
			p("per claim); %s workers started; workers' busy time %.2f ms per message as the dispatcher sees it (handed over → status line).\n\n",
				groupThousands(fmt.Sprint(ps.WorkersStarted)), float64(ps.BusyMS)/math.Max(float64(ps.Processed), 1))
		}
		for _, sys := range names {
			sr, ok := r.stmts[sys]
			if !ok || sr.Transitions == 0 {
				continue
			}
			t := float64(sr.Transitions) / 1000
			p("**%s**: %s statements for %s transitions (%.2f per transition).\n\n", b.sysLabel(sys),
				groupThousands(fmt.Sprint(sr.Calls)), groupThousands(fmt.Sprint(sr.Transitions)), float64(sr.Calls)/float64(sr.Transitions))
			p("| statement | calls / 1k tr. | rows / 1k tr. | exec ms / 1k tr. | WAL bytes / tr. |\n|---|--:|--:|--:|--:|\n")
			for _, s := range sr.Top {
				p("| `%s` | %.1f | %.1f | %.2f | %.0f |\n", oneLineSQL(s.Query, 140), float64(s.Calls)/t, float64(s.Rows)/t,
					s.TotalMS/t, float64(s.WALB)/float64(sr.Transitions))
			}
			p("\n")
		}
	}

	// Slow statements of the measured runs.
	if sec := b.slowSection(); sec != "" {
		p("%s", sec)
	}

	// Diagnostic run.
	if len(r.diag) > 0 || r.diagErr != "" {
		p("## Diagnostic run: pepsi's slow statements (`auto_explain`)\n\n")
		p("After W1's measured runs, pepsi ran W1 once more (not measured; instrumentation slows every statement) with ")
		p("`auto_explain` loaded in its database's sessions: every statement slower than 10 ms was logged with its ")
		p("`EXPLAIN (ANALYZE, BUFFERS)`. Grouped by statement, by total time; the plan shown is the slowest execution's.")
		if r.diagRun.Err == "" && r.diagRun.Seconds > 0 {
			p(" That run: %s transitions at %s/s.", groupThousands(fmt.Sprint(r.diagRun.Transitions)), f0(r.diagRun.rate()))
		}
		p("\n\n")
		if r.diagErr != "" {
			p("Diagnostic failed: %s\n\n", r.diagErr)
		}
		p("| statement | executions over 10 ms | their total ms | slowest ms |\n|---|--:|--:|--:|\n")
		for _, d := range r.diag {
			p("| `%s` | %d | %.0f | %.1f |\n", d.Query, d.Count, d.TotalMS, d.MaxMS)
		}
		p("\n")
		for i, d := range r.diag {
			if i >= 3 {
				break
			}
			p("Slowest `%s` (%.1f ms)", oneLineSQL(d.Query, 60), d.MaxMS)
			if a := pickAccess(d.Plan); a != "" && strings.Contains(d.Query, "claim") {
				p(": %s", a)
			}
			p(":\n\n```\n%s\n```\n\n", d.Plan)
		}
	}

	// W5 plan.
	if b.want("W5") {
		p("## W5: the plan of pepsi's claim on the big table\n\n")
		p("%s done and %s failed rows present, %s pending; `EXPLAIN (ANALYZE, BUFFERS)` of the claim statement ",
			groupThousands(fmt.Sprint(b.sz.w5Done)), groupThousands(fmt.Sprint(b.sz.w5Failed)), groupThousands(fmt.Sprint(b.sz.w5Messages)))
		p("taken from `claim.go` (prepared, with capacity %d for stage s1) in a transaction that is rolled back. ",
			b.pepsiWorkers*b.pepsiQueueLimit)
		p("*Rows read* is what the UPDATE's own scan of `workqueue q` returned (rows × loops): a claim that reads ")
		p("only what it takes reads about its capacity, whatever the backlog.\n\n")
		if r.explainErr != "" {
			p("EXPLAIN failed: %s\n\n", r.explainErr)
		}
		for _, e := range r.explain {
			verdict := "stays on the partial index `workqueue_pending` (no sequential scan of workqueue)"
			if !e.usesPendingIndex() {
				verdict = "does NOT stay on `workqueue_pending`"
			}
			if e.TimedOut != "" {
				p("**%s**: %s; %s, so this is the plan without ANALYZE.\n\n```\n%s\n```\n\n", e.Title, verdict, e.TimedOut, e.Plan)
				continue
			}
			p("**%s**: %s; %s.\n\n```\n%s\n```\n\n", e.Title, verdict, e.summary(), e.Plan)
		}
	}

	// W6.
	if b.want("W6") {
		p("## W6: idle for %s\n\n", b.sz.w6Idle)
		p("The systems ran side by side, idle, each on its own database, after %s of warm-up. Queries are ", b.sz.w6Warmup)
		p("`pg_stat_statements` calls in the system's database (the benchmark itself sends none there meanwhile); ")
		p("transactions are `pg_stat_database` commits + rollbacks; CPU is the system's process tree. pepsi runs with ")
		p("its default POLL_INTERVAL (30 s). The raw loop is not measured: its idle behaviour is the benchmark's choice.\n\n")
		p("| system | queries/s | queries in the period | transactions/s | CPU ms/s | peak RSS, MiB |\n|---|--:|--:|--:|--:|--:|\n")
		for _, i := range r.idle {
			if i.Err != "" && i.Seconds == 0 {
				p("| %s | failed: %s | | | | |\n", b.sysLabel(i.System), i.Err)
				continue
			}
			p("| %s | %.2f | %d | %.2f | %.2f | %s |\n", b.sysLabel(i.System), float64(i.Calls)/i.Seconds, i.Calls,
				float64(i.Xacts)/i.Seconds, i.CPUMS/i.Seconds, mib(float64(i.RSSKiB)))
		}
		p("\n")
		for _, i := range r.idle {
			if len(i.Top) == 0 {
				continue
			}
			p("%s's statements while idle:\n\n| statement | calls |\n|---|--:|\n", b.sysLabel(i.System))
			for _, s := range i.Top {
				p("| `%s` | %d |\n", oneLineSQL(s.Query, 120), s.Calls)
			}
			p("\n")
		}
	}

	// The controls' figures come from their own program (`pipeline controls`, which compares
	// two builds); the report carries its last committed output so that regenerating this
	// file keeps them.
	if ctl, err := os.ReadFile(filepath.Join(b.root, "bench", "controls-results.md")); err == nil {
		p("%s\n", demoteHeadings(string(ctl)))
	}

	// Settings.
	p("## Settings\n\n")
	p("- **PostgreSQL**: a private cluster started by `scripts/pg-private` (initdb defaults; `fsync = on`, ")
	p("`synchronous_commit = on`, `max_connections = 200`), plus `shared_preload_libraries = 'pg_stat_statements'` ")
	p("(track = top, track_utility = on) for the statement statistics; all traffic over its Unix socket. One database per ")
	p("system kind: pepsi's `schema.sql` for pepsi and the raw loop (and for pepsi's W5b, on `%s`, which keeps W5's big table out of its way), River's own migrations (`rivermigrate`) for each River, ", w5BesideDB)
	p("Graphile Worker's own migrations (`runMigrations`) for each Graphile Worker, `CREATE EXTENSION pgq` for PgQ (Debian's ")
	p("`postgresql-15-pgq3`, installed under /usr/lib/postgresql/15, the server the cluster runs). ")
	p("Before every measured run the queue table is emptied (`TRUNCATE`, `VACUUM ANALYZE`; W5: the previous run's rows ")
	p("deleted), every system's database is vacuumed and analyzed and the run waits until no autovacuum worker runs ")
	p("(`quiet.go`: a worker's CPU counts to whichever system runs then), and a `CHECKPOINT` is taken; the systems' ")
	p("order rotates from run to run. ")
	if len(b.damonStopped) > 0 {
		p("The machine's DAMON reclaim thread (kdamond) was stopped for the whole run but for W3d (`-pause-damon`, `quiet.go`).\n")
	} else {
		p("The kernel's DAMON, if the machine runs it, was left alone (`-pause-damon=false`, or it could not be stopped).\n")
	}
	p("- **pepsi-dispatch**: the real binary (`CGO_ENABLED=0 go build`), a fresh dispatcher per run, the stage program ")
	p("`bench/pipeline/stage` built with the SDK (Advance to NEXT, or Done). A budget of %d worker processes, ",
		b.pepsiWorkers)
	p("like River's and the raw loop's concurrency the same in every workload: a 1-stage pipeline has `PARALLELISM = %d`, ",
		b.pepsiWorkers)
	p("W4's three stages divide it (`PARALLELISM` %s), so W4 runs as many processes and messages in flight as W1; in W4f the ",
		strings.Trim(strings.Join(strings.Fields(fmt.Sprint(stageParallelism(b.pepsiWorkers, startOpts{stages: 3}))), ", "), "[]"))
	p("first stage, whose workers run the fused s2 and s3, has all of it; W4w shows W4 with all of it on every stage. ")
	p("Every stage: `QUEUE_LIMIT = %d`, `MAX_MESSAGES = %d`; everything else default (POLL_INTERVAL 30 s, STATS_INTERVAL 60 s, ",
		b.pepsiQueueLimit, b.pepsiMaxMessages)
	p("DB_POOL_SIZE 8); `USER = nobody` when run as root. Why: the 2 cores are shared by the dispatcher, the workers ")
	p("and PostgreSQL, and a worker spends most of a batch waiting for its commit's WAL flush and, between batches, for ")
	p("the dispatcher's next claim; the SDK runs up to 500 queued ids as one batch, so QUEUE_LIMIT = 1000 (the largest ")
	p("the dispatcher allows) gives each worker two full batches, the next already in its pipe while one commits, and ")
	p("4 workers keep several commits in flight with few processes contending for the 2 cores. Chosen by a sweep once the ")
	p("SDK's batch went from 256 to 500 (W1, 5 runs each, one round, 13:28 UTC on 3 December): 4 × 1000 57.4–63.2k/s ")
	p("(two rounds: medians 58.6k and 61.3k), 3 × 1000 53.5–60.3k, 2 × 1000 61.2–63.0k (one run at 41k with other load 36 %%); ")
	p("4 × 512 with the 256-id batches had given 49.5–53.2k/s in the same hour. ")
	p("Before that, 4 × 512 was chosen by a sweep of 2,048 in flight, as Graphile Worker's processes and concurrency were (W1, 3 runs ")
	p("each, the configurations alternating, two rounds, on 07f85c1): 4 × 512 against 8 × 256 gave 43.9k against 33.8k/s ")
	p("(W4 38.9k against 33.3k transitions/s) in one round and 44.4k against 38.1k/s in the other; CPU per 1,000 ")
	p("transitions 39–41 ms against 43–48 ms in every run. Fewer in flight lost (3 × 512: 26.6–40.6k/s, 2 × 512: ")
	p("20.4–47.4k/s, with the host's commit rate moving by 2× between rounds). ")
	p("Before that, with 8 workers, a side-by-side sweep on this machine (W1, 5 runs each, pepsi over ")
	p("the raw loop at 4 × 128, two rounds, with the SDK's earlier 64-id batches): QUEUE_LIMIT 64: 1.11×, 0.90×; 128: ")
	p("1.19×, 1.06×; 256: 1.24×, 1.29×. An earlier sweep (quick W1, 2 runs each) gave PARALLELISM × QUEUE_LIMIT = ")
	p("4 × 64: 7–14k/s, 8 × 64: 7–16.5k/s, 8 × 32: 8.5–12k/s, 16 × 32: 11.7–12.4k/s. ")
	p("MAX_MESSAGES is raised from its default (1000), which recycles each worker (a new process and connection) every ")
	p("16 batches: in the same sweep the default cost about 20 %% more CPU per transition (113–124 vs 91–97 ms per ")
	p("1,000) for no throughput.\n")
	p("- **River (tuned)**: as River's benchmark (`cmd/river/riverbench`): queue `default` with `MaxWorkers = %d`, ",
		riverTunedMaxWorkers)
	p("`FetchCooldown = %s`, `FetchPollInterval = %s`; a default pgx pool (`pgxpool.New`, max(4, NumCPU) connections) ",
		riverTunedFetchCooldown, riverTunedFetchPoll)
	p("as River's CLI opens it; a no-op `Work`. **River (defaults)**: everything default, `MaxWorkers = %d` ", riverDefaultMaxWorkers)
	p("(a queue must name it; 100 is the value of River's documentation). Each River runs in a process of its own ")
	p("(`pipeline sut river`), so its CPU and memory are measured like the dispatcher's; the producer uses a separate ")
	p("insert-only client (`InsertManyFast` for backlogs, `Insert` for single messages). W4: each job inserts the next ")
	p("stage's job with `client.Insert` from `Work` (not in the job's completion transaction, unlike pepsi's advance, ")
	p("which is atomic with the stage's outcome).\n")
	b.peerSettings(&w)
	p("- **raw loop**: %d goroutines in one process, one connection each, no coordinator: each claims up to %d rows of ", b.rawWorkers, b.rawBatch)
	p("a stage with one UPDATE … RETURNING of the dispatcher's shape (`claim.go`: the pick walks `workqueue_pending` in ")
	p("(stage, id) order whatever the statistics say, the UPDATE fetches the picked ids by primary key), plus `FOR UPDATE ")
	p("SKIP LOCKED` since several claim, then writes a claim's outcomes with the SDK's set-based UPDATE (`unnest` of ")
	p("the ids and their new stage, status and state, under the same guard), one statement per claim: a raw batched UPDATE loop. ")
	p("(Before issue 23 it wrote one guarded UPDATE per row, pipelined in one transaction: a floor pepsi's batched outcome beat.) As many messages in flight ")
	p("as pepsi (%d); fewer, bigger claims did best in short sweeps (4 × 64: ~4k/s, 8 × 32: ~3k/s, 4 × 128: ~10.5k/s ", b.rawWorkers*b.rawBatch)
	p("on quick W1, with an earlier claim shape; W1, 5 runs each, two rounds: medians 4 × 128: 39.9k, 45.2k/s; 4 × 512: 55.2k, 56.1k/s). Sessions are named `pepsi-…` like pepsi's, so the requeue trigger skips them the same way. A ")
	p("`LISTEN workqueue` connection wakes idle goroutines.\n")
	sz := b.sz
	p("- **workloads**: every backlog run (W1, W4, W5) first sends the system, once started, a priming batch of %s messages ",
		groupThousands(fmt.Sprint(b.pepsiWorkers*b.pepsiQueueLimit)))
	p("(pepsi's messages in flight, so that its first claim starts all its workers), waits for it and measures nothing of it: pepsi starts ")
	p("its workers on demand, the others start all theirs with the system, and without it pepsi's window held its 4 workers' start ")
	p("(about 125 ms to the first message done; a PostgreSQL connection takes 17–65 ms on this machine). ")
	p("W1 (after one unmeasured warm-up run of each system, for cold caches) %s messages enqueued in one transaction while the system runs idle, timed from that commit ",
		groupThousands(fmt.Sprint(sz.w1Messages)))
	p("until none is pending or running, the enqueue and an ANALYZE of the queue table in one transaction, so that every ")
	p("system starts with statistics that know the backlog (the W5 plans show what a stale one does to pepsi's claim); ")
	p("the end is watched on the last message's row (a primary-key lookup every 20 ms), then confirmed by counting ")
	p("through the partial indexes. W2 a producer ")
	p("tops the backlog up to %s pending every 200 ms, %s warm-up, %s measured (messages finished = inserted − open); ",
		groupThousands(fmt.Sprint(sz.w2Pending)), sz.w2Warmup, sz.w2Measure)
	p("W3 %v/s for %v / %v; W4 %s messages through 3 stages (as many transitions as W1, so the workers' start-up, three pools instead of one, weighs the same), and %d/s for %s; W4f the same backlog through pepsi with s2 and s3 `FUSE = yes` (stage fusion: one worker pass runs the three handlers and commits one outcome; River and the raw loop have nothing alike, so W4f compares with their W4); W4w W4 again through pepsi with three times the worker processes (not a target); W1b pepsi's W1 again, run just before each of its W4 runs, the reference of W4's every-run target (W1's own runs are half an hour earlier, and the host drifts more than that target's margin); W5b pepsi's W1 again, as many messages as W5, just before each of its W5 runs on a database of its own (an empty table), the reference of W5's target for the same reason; W5 W1 with %s messages on top of %s done ",
		sz.w3Rates, sz.w3Duration[20], sz.w3Duration[200], groupThousands(fmt.Sprint(sz.w4Messages)), sz.w4Rate, sz.w4Duration,
		groupThousands(fmt.Sprint(sz.w5Messages)), groupThousands(fmt.Sprint(sz.w5Done)))
	p("and %s failed rows (River: completed and discarded jobs; Graphile Worker, which deletes completed jobs and keeps failed ones: as many permanently failed jobs); W6 %s idle. A backlog run longer than %s is cut: its ",
		groupThousands(fmt.Sprint(sz.w5Failed)), sz.w6Idle, sz.backlogLimit)
	p("rate over that time is kept (and flagged). River (defaults) and Graphile Worker (defaults) run once per throughput workload (their rates are set by ")
	p("River's 100 ms fetch cooldown for 100 workers, about 1,000 jobs/s, and Graphile's one job at a time, not by noise), the others %d times, in an order that ", sz.runs)
	p("rotates from run to run.\n")
	return w.String()
}

// Chart.

var sysColors = map[string]string{
	"pepsi": "#d62728", consoleSystem: "#ff9896", "river": "#1f77b4", "river-default": "#9ecae1", "raw": "#7f7f7f",
	"graphile": "#2ca02c", "graphile-default": "#98df8a", "pgq": "#ff7f0e",
}

func svgEscape(s string) string {
	return strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;", `"`, "&quot;").Replace(s)
}

// niceStep picks a round tick step for a range.
func niceStep(maxV float64, ticks int) float64 {
	if maxV <= 0 {
		return 1
	}
	raw := maxV / float64(ticks)
	mag := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 2.5, 5, 10} {
		if m*mag >= raw {
			return m * mag
		}
	}
	return 10 * mag
}

// chart renders results.svg: throughput bars per workload and system, and the latency CDFs.
func (b *bench) chart() string {
	r := &b.res
	const W, H = 1000, 860
	var s strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&s, format, args...) }
	p(`<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n", W, H, W, H)
	p(`<rect width="100%%" height="100%%" fill="white"/>` + "\n")
	mode := ""
	if b.quick {
		mode = " (quick run)"
	}
	p(`<text x="%d" y="24" text-anchor="middle" font-size="16" font-weight="bold">pepsi-dispatch vs River vs Graphile Worker vs PgQ vs raw loop — %d cores, %s%s</text>`+"\n",
		W/2, numCPU(), b.started.UTC().Format("2006-01-02"), mode)
	systems := b.names()
	// Legend: two rows of four.
	for i, sys := range systems {
		lx, ly := 80+(i%4)*225, 38+(i/4)*18
		p(`<rect x="%d" y="%d" width="14" height="14" fill="%s"/><text x="%d" y="%d">%s</text>`+"\n", lx, ly, sysColors[sys], lx+18, ly+12, svgEscape(b.sysLabel(sys)))
	}

	// Panel 1: throughput.
	var wls []string
	for _, wl := range []string{"W1", "W2", "W4", "W5"} {
		if b.want(wl) {
			wls = append(wls, wl)
		}
	}
	px, py, pw, ph := 80.0, 95.0, float64(W-110), 290.0
	maxV := 0.0
	for _, wl := range wls {
		for _, sys := range systems {
			if v := r.summary(wl, sys).rate; !math.IsNaN(v) {
				maxV = math.Max(maxV, v)
			}
		}
	}
	step := niceStep(maxV*1.1, 6)
	top := step * math.Ceil(maxV*1.1/step)
	if top <= 0 {
		top = 1
	}
	p(`<text x="%.0f" y="%.0f" font-size="14" font-weight="bold">Throughput, transitions/s (median of %d run(s); higher is better)</text>`+"\n", px, py-8, b.sz.runs)
	for v := 0.0; v <= top+step/2; v += step {
		y := py + ph - v/top*ph
		p(`<line x1="%.0f" y1="%.1f" x2="%.0f" y2="%.1f" stroke="#ddd"/><text x="%.0f" y="%.1f" text-anchor="end">%s</text>`+"\n",
			px, y, px+pw, y, px-6, y+4, f0(v))
	}
	p(`<line x1="%.0f" y1="%.0f" x2="%.0f" y2="%.0f" stroke="black"/>`+"\n", px, py+ph, px+pw, py+ph)
	if len(wls) > 0 {
		gw := pw / float64(len(wls))
		bw := gw * 0.8 / float64(len(systems))
		for i, wl := range wls {
			gx := px + float64(i)*gw + gw*0.1
			for j, sys := range systems {
				v := r.summary(wl, sys).rate
				x := gx + float64(j)*bw
				if math.IsNaN(v) {
					p(`<text x="%.1f" y="%.1f" text-anchor="middle" fill="#999">n/a</text>`+"\n", x+bw/2, py+ph-4)
					continue
				}
				h := v / top * ph
				p(`<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%s %s: %s/s</title></rect>`+"\n",
					x+1, py+ph-h, bw-2, h, sysColors[sys], wl, svgEscape(b.sysLabel(sys)), f0(v))
				p(`<text x="%.1f" y="%.1f" text-anchor="middle" font-size="10">%s</text>`+"\n", x+bw/2, py+ph-h-3, f0(v))
			}
			p(`<text x="%.1f" y="%.0f" text-anchor="middle">%s</text>`+"\n", gx+gw*0.4, py+ph+18, svgEscape(workloadTitles[wl]))
		}
	}

	// Panels 2-4: latency CDFs (enqueue -> done solid, enqueue -> start dashed), log x axis.
	type panel struct {
		wl    string
		rate  int
		title string
	}
	var panels []panel
	if b.want("W3") {
		for _, rate := range b.sz.w3Rates {
			panels = append(panels, panel{"W3", rate, fmt.Sprintf("W3, 1 stage, %d/s", rate)})
		}
	}
	if b.want("W4") {
		panels = append(panels, panel{"W4", b.sz.w4Rate, fmt.Sprintf("W4, 3 stages, %d/s", b.sz.w4Rate)})
	}
	if len(panels) > 0 {
		cy := 470.0
		p(`<text x="80" y="%.0f" font-size="14" font-weight="bold">Latency distribution: share of messages within x ms of enqueue (solid: done, dashed: first stage start)</text>`+"\n", cy-22)
		cw := (float64(W) - 80 - 30 - float64(len(panels)-1)*40) / float64(len(panels))
		chh := 300.0
		lo, hi := -1.0, 4.0 // 0.1 ms .. 10 s
		for i, pn := range panels {
			x0 := 80 + float64(i)*(cw+40)
			p(`<text x="%.1f" y="%.0f" text-anchor="middle" font-weight="bold">%s</text>`+"\n", x0+cw/2, cy-4, svgEscape(pn.title))
			p(`<rect x="%.1f" y="%.0f" width="%.1f" height="%.0f" fill="none" stroke="black"/>`+"\n", x0, cy, cw, chh)
			for e := lo; e <= hi; e++ {
				x := x0 + (e-lo)/(hi-lo)*cw
				label := fmt.Sprintf("%g", math.Pow(10, e))
				p(`<line x1="%.1f" y1="%.0f" x2="%.1f" y2="%.0f" stroke="#ddd"/><text x="%.1f" y="%.0f" text-anchor="middle" font-size="10">%s</text>`+"\n",
					x, cy, x, cy+chh, x, cy+chh+14, label)
			}
			for q := 0; q <= 100; q += 25 {
				y := cy + chh - float64(q)/100*chh
				p(`<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#eee"/>`+"\n", x0, y, x0+cw, y)
				if i == 0 {
					p(`<text x="%.1f" y="%.1f" text-anchor="end" font-size="10">%d%%</text>`+"\n", x0-4, y+4, q)
				}
			}
			p(`<text x="%.1f" y="%.0f" text-anchor="middle" font-size="10">ms after enqueue (log scale)</text>`+"\n", x0+cw/2, cy+chh+28)
			for _, sys := range systems {
				l := r.latency(pn.wl, pn.rate, sys)
				if l == nil {
					continue
				}
				for _, series := range []struct {
					v    []float64
					dash string
				}{{l.Done, ""}, {l.Start, ` stroke-dasharray="4 3"`}} {
					if len(series.v) == 0 {
						continue
					}
					var pts []string
					n := len(series.v)
					stride := max(1, n/400)
					for k := 0; k < n; k += stride {
						pts = append(pts, cdfPoint(series.v[k], float64(k+1)/float64(n), x0, cy, cw, chh, lo, hi))
					}
					pts = append(pts, cdfPoint(series.v[n-1], 1, x0, cy, cw, chh, lo, hi))
					p(`<polyline fill="none" stroke="%s" stroke-width="1.8"%s points="%s"/>`+"\n", sysColors[sys], series.dash, strings.Join(pts, " "))
				}
			}
		}
	}
	p("</svg>\n")
	return s.String()
}

func cdfPoint(ms, frac, x0, y0, w, h, lo, hi float64) string {
	e := math.Log10(math.Max(ms, math.Pow(10, lo)))
	e = math.Min(e, hi)
	x := x0 + (e-lo)/(hi-lo)*w
	y := y0 + h - frac*h
	return fmt.Sprintf("%.1f,%.1f", x, y)
}

// slowSection reports the statements auto_explain logged during the measured runs (slower than
// 200 ms), per workload and system, and the plans of pepsi's slowest.
func (b *bench) slowSection() string {
	r := &b.res
	type key struct{ wl, sys, app, q string }
	agg := map[key]*diagPlan{}
	var keys []key
	for _, m := range r.meas {
		for _, d := range m.Slow {
			k := key{m.Workload, m.System, d.App, d.Query}
			a := agg[k]
			if a == nil {
				a = &diagPlan{App: d.App, Query: d.Query}
				agg[k] = a
				keys = append(keys, k)
			}
			a.Count += d.Count
			a.TotalMS += d.TotalMS
			if d.MaxMS > a.MaxMS {
				a.MaxMS, a.Plan = d.MaxMS, d.Plan
			}
		}
	}
	if len(keys) == 0 {
		return ""
	}
	slices.SortFunc(keys, func(x, y key) int {
		if c := strings.Compare(x.wl, y.wl); c != 0 {
			return c
		}
		if c := strings.Compare(x.sys, y.sys); c != 0 {
			return c
		}
		return -cmpFloat(agg[x].TotalMS, agg[y].TotalMS)
	})
	var w strings.Builder
	fmt.Fprintf(&w, "## Slow statements during the measured runs (`auto_explain`, over 200 ms)\n\n")
	fmt.Fprintf(&w, "Every session of the cluster loads `auto_explain` with a 200 ms threshold and no ANALYZE (no ")
	fmt.Fprintf(&w, "instrumentation cost): the plan of each statement slower than that is logged. Totals over all runs of ")
	fmt.Fprintf(&w, "a workload; the benchmark's own statements are left out.\n\n")
	fmt.Fprintf(&w, "| workload | system | session | statement | over 200 ms | their total s | slowest ms |\n|---|---|---|---|--:|--:|--:|\n")
	for _, k := range keys {
		a := agg[k]
		app := a.App
		if app == "" || app == "[unknown]" {
			app = "(unnamed)"
		}
		fmt.Fprintf(&w, "| %s | %s | %s | `%s` | %d | %.1f | %.0f |\n", k.wl, b.sysLabel(k.sys), app, a.Query, a.Count, a.TotalMS/1000, a.MaxMS)
	}
	fmt.Fprintf(&w, "\n")
	// pepsi's slowest statement kinds, with their plan (estimates only: no ANALYZE).
	best := map[string]*diagPlan{}
	for _, k := range keys {
		if k.sys != "pepsi" {
			continue
		}
		a := agg[k]
		if o := best[k.q]; o == nil || a.MaxMS > o.MaxMS {
			best[k.q] = a
		}
	}
	var worst []*diagPlan
	for _, a := range best {
		worst = append(worst, a)
	}
	slices.SortFunc(worst, func(x, y *diagPlan) int { return -cmpFloat(x.MaxMS, y.MaxMS) })
	for i, a := range worst {
		if i >= 2 {
			break
		}
		fmt.Fprintf(&w, "pepsi's slowest `%s` (%.0f ms), as planned:\n\n```\n%s\n```\n\n", oneLineSQL(a.Query, 60), a.MaxMS, a.Plan)
	}
	return w.String()
}

func cmpFloat(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func execTime(plan string) string {
	if m := execTimeRe.FindStringSubmatch(plan); m != nil {
		return m[1] + " ms"
	}
	return "?"
}

// demoteHeadings puts a Markdown document's headings one level down, outside code blocks,
// so that it reads as one section of the report.
func demoteHeadings(md string) string {
	lines := strings.Split(strings.TrimRight(md, "\n"), "\n")
	code := false
	for i, l := range lines {
		if strings.HasPrefix(l, "```") {
			code = !code
		}
		if !code && strings.HasPrefix(l, "#") {
			lines[i] = "#" + l
		}
	}
	return strings.Join(lines, "\n") + "\n"
}

// tickBound says, for PgQ's backlog workload, how long its runs took: a backlog of W1's size
// is consumed in a few of pgqd's ticks, so its rate moves by whole ticks between runs (0.4,
// 0.8 or 1.2 s for the same events: a rate that halves or triples), and pepsi/PgQ with it.
// The continuous and latency workloads are paced by their producer, not by the ticks' count.
func (r *results) tickBound(wl string) string {
	if wl != "W1" {
		return ""
	}
	var secs []float64
	for _, m := range r.meas {
		if m.Workload == wl && m.System == "pgq" && m.Err == "" {
			secs = append(secs, m.Seconds)
		}
	}
	if len(secs) == 0 {
		return ""
	}
	return fmt.Sprintf("; tick-bound: its runs took %s–%s s, a few of pgqd's ticks each, so its rate moves by whole ticks between runs",
		f2(slices.Min(secs)), f2(slices.Max(secs)))
}
