// Command pipeline is the benchmark of issues 7 and 23: pepsi-dispatch against River, Graphile
// Worker, PgQ and a raw PostgreSQL loop, side by side in one run, on one private PostgreSQL
// cluster.
//
//	cd bench && go run ./pipeline            # the full run (about 40 minutes on 2 cores)
//	cd bench && go run ./pipeline -quick     # a short run (about 6 minutes), smaller sizes, 1 run
//
// It builds pepsi-dispatch (CGO_ENABLED=0) and the no-op stage program (./pipeline/stage, built
// with pepsi's SDK), starts a private cluster with scripts/pg-private (PostgreSQL's defaults,
// synchronous_commit = on, plus pg_stat_statements), makes one database per system, and
// measures workloads W1-W6 for pepsi, River v0.51.2 tuned as River's own benchmark, River with
// its defaults, Graphile Worker tuned as its performance page and with its defaults (Node.js:
// ./graphile), PgQ (W1-W3) and the raw loop. It writes BENCHMARKS.md at the repository root and the chart
// bench/results.svg. Everything it started is stopped and removed on exit, error or Ctrl-C.
//
// `pipeline sut KIND ...` is internal: the process in which River or the raw loop runs.
// `pipeline controls ...` measures the producer's controls of issue 20 (workloads_controls.go).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"pepsi-dispatch/internal/damon"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "sut" {
		os.Exit(sutMain(os.Args[2:]))
	}
	if len(os.Args) > 1 && os.Args[1] == "controls" {
		os.Exit(controlsMain(os.Args[2:])) // issue 20: workloads_controls.go
	}
	os.Exit(benchMain())
}

var logMu sync.Mutex

// logf prints a progress line on stderr.
func logf(format string, args ...any) {
	logMu.Lock()
	defer logMu.Unlock()
	fmt.Fprintf(os.Stderr, "%s  %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
}

// sizes are the workload sizes of one mode.
type sizes struct {
	runs          int
	w1Messages    int64
	w2Pending     int64
	w2Warmup      time.Duration
	w2Measure     time.Duration
	w3Rates       []int
	w3Duration    map[int]time.Duration
	w4Messages    int64
	w4Rate        int
	w4Duration    time.Duration
	w5Done        int64
	w5Failed      int64
	w5Messages    int64
	w6Warmup      time.Duration
	w6Idle        time.Duration
	backlogLimit  time.Duration // a backlog run that takes longer is cut: its rate is measured over this
	explainBudget time.Duration // the longest an EXPLAIN ANALYZE of the claim may run
	latencyLinger time.Duration // after the last enqueue of a latency run, wait this long at most
}

var fullSizes = sizes{
	runs: 5, w1Messages: 100_000,
	w2Pending: 20_000, w2Warmup: 3 * time.Second, w2Measure: 30 * time.Second,
	// W3 at 20/s runs 60 s: 1,200 messages, so that its p99 is the 12th slowest, not the 3rd
	// of 300, which one stall of the host decided (the same tree gave 3.85 ms and 8.88 ms).
	w3Rates: []int{20, 200}, w3Duration: map[int]time.Duration{20: 60 * time.Second, 200: 10 * time.Second},
	w4Messages: 33_334, w4Rate: 20, w4Duration: 10 * time.Second,
	w5Done: 1_000_000, w5Failed: 100_000, w5Messages: 100_000,
	w6Warmup: 11 * time.Second, w6Idle: 60 * time.Second,
	backlogLimit: 30 * time.Second, latencyLinger: 15 * time.Second, explainBudget: 10 * time.Second,
}

var quickSizes = sizes{
	runs: 1, w1Messages: 10_000,
	w2Pending: 20_000, w2Warmup: 2 * time.Second, w2Measure: 5 * time.Second,
	w3Rates: []int{20, 200}, w3Duration: map[int]time.Duration{20: 4 * time.Second, 200: 3 * time.Second},
	w4Messages: 3_334, w4Rate: 20, w4Duration: 4 * time.Second,
	w5Done: 50_000, w5Failed: 5_000, w5Messages: 10_000,
	w6Warmup: 3 * time.Second, w6Idle: 10 * time.Second,
	backlogLimit: 6 * time.Second, latencyLinger: 10 * time.Second, explainBudget: 10 * time.Second,
}

// bench is one benchmark run: where things are, what runs, and what was measured.
type bench struct {
	root     string // the repository root (schema.sql, claim.go, scripts/)
	benchDir string // bench/
	tmp      string // a 0755 temporary directory: binaries, configs, logs, the cluster
	bin      string
	self     string // this program, re-executed as `pipeline sut ...`
	pg       *cluster
	pgPID    int
	sz       sizes
	quick    bool
	command  string
	only     map[string]bool
	onlySys  map[string]bool
	systems  []*system
	besides  []*system // set up for a reference run only (W5b's pepsi): in no table, but quiesced like the others
	started  time.Time

	pepsiWorkers     int // worker processes in all, divided among the stages that get messages
	pepsiQueueLimit  int
	pepsiMaxMessages int
	pepsiEnv         []string // -pepsi-env: more environment for pepsi's dispatcher (and so its workers)
	rawWorkers       int
	rawBatch         int

	graphileProcesses   int
	graphileConcurrency int
	graphileLocalQueue  int
	graphile            graphileEnv
	traceLatency        bool     // see the -trace-latency flag
	pauseDamon          bool     // see the -pause-damon flag (quiet.go)
	damonStopped        []string // the DAMON state files stopped for the run

	mu    sync.Mutex
	procs []*sutProc // every system process started, for the cleanup

	dbs map[string]*system // the first system set up on each database, whose handles others share

	res results
}

// track remembers a started system process, so that the cleanup stops it.
func (b *bench) track(p *sutProc) {
	b.mu.Lock()
	b.procs = append(b.procs, p)
	b.mu.Unlock()
}

func benchMain() int {
	quick := flag.Bool("quick", false, "a short run: smaller sizes, one run per measurement")
	runs := flag.Int("runs", 0, "runs per throughput measurement (default 5, or 1 with -quick)")
	out := flag.String("out", "", "the Markdown report (default: BENCHMARKS.md at the repository root)")
	svg := flag.String("svg", "", "the chart (default: bench/results.svg)")
	only := flag.String("only", "", "comma-separated workloads to run (W1,...,W6); default all")
	systems := flag.String("systems", "", "comma-separated systems to measure (pepsi,pepsi-console,river,river-default,graphile,graphile-default,pgq,raw; pepsi-python only when named); default all")
	keep := flag.Bool("keep", false, "keep the temporary directory (logs, cluster) for a look")
	par := flag.Int("pepsi-workers", pepsiWorkers, "pepsi's worker processes in all: the PARALLELISM of a 1-stage pipeline, divided among the stages of a longer one")
	ql := flag.Int("pepsi-queue-limit", pepsiQueueLimit, "QUEUE_LIMIT of every pepsi stage")
	mm := flag.Int("pepsi-max-messages", pepsiMaxMessages, "MAX_MESSAGES of every pepsi stage")
	pepsiEnv := flag.String("pepsi-env", "", "space-separated NAME=VALUE settings added to pepsi-dispatch's environment, which its workers inherit (experiments: GOMAXPROCS=1, GODEBUG=...)")
	rw := flag.Int("raw-workers", rawWorkersDefault, "goroutines of the raw loop")
	rb := flag.Int("raw-batch", rawBatchDefault, "rows per claim of the raw loop")
	w1 := flag.Int64("w1-messages", 0, "messages of the W1 backlog (default: the mode's size)")
	w4 := flag.Int64("w4-messages", 0, "messages of the W4 backlog (default: the mode's size)")
	trace := flag.Bool("trace-latency", false, "latency runs: log every statement of pepsi's database, run its dispatcher and workers with GODEBUG=gctrace=1, and write each message's times to logs/*.latency.csv (use with -keep)")
	damon := flag.Bool("pause-damon", true, "stop the kernel's DAMON (kdamond) for the run and start it again at the end, and run W3 at 20/s once more for pepsi and the raw loop with it running (W3d); see quiet.go")
	gp := flag.Int("graphile-processes", graphileTunedProcesses, "Graphile Worker tuned: runner processes")
	gc := flag.Int("graphile-concurrency", graphileTunedConcurrency, "Graphile Worker tuned: concurrentJobs of each process")
	gl := flag.Int("graphile-local-queue", graphileTunedLocalQueue, "Graphile Worker tuned: localQueue.size of each process")
	flag.Parse()

	b := &bench{quick: *quick, sz: fullSizes, started: time.Now(), dbs: map[string]*system{},
		pepsiWorkers: *par, pepsiQueueLimit: *ql, pepsiMaxMessages: *mm, rawWorkers: *rw, rawBatch: *rb,
		graphileProcesses: *gp, graphileConcurrency: *gc, graphileLocalQueue: *gl, traceLatency: *trace,
		pauseDamon: *damon,
		pepsiEnv:   strings.Fields(*pepsiEnv)}
	if *quick {
		b.sz = quickSizes
	}
	if *w1 > 0 {
		b.sz.w1Messages = *w1
	}
	if *w4 > 0 {
		b.sz.w4Messages = *w4
	}
	if *runs > 0 {
		b.sz.runs = *runs
	}
	b.command = "cd bench && go run ./pipeline"
	if len(os.Args) > 1 {
		b.command += " " + strings.Join(os.Args[1:], " ")
	}
	if *systems != "" {
		b.onlySys = map[string]bool{}
		for _, w := range strings.Split(*systems, ",") {
			b.onlySys[strings.TrimSpace(w)] = true
		}
	}
	if *only != "" {
		b.only = map[string]bool{}
		for _, w := range strings.Split(*only, ",") {
			b.only[strings.ToUpper(strings.TrimSpace(w))] = true
		}
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	defer func() {
		// A bug must not leave a cluster and dispatchers behind either.
		if r := recover(); r != nil {
			b.cleanup(*keep)
			panic(r)
		}
	}()
	err := b.run(ctx, *out, *svg)
	b.cleanup(*keep)
	if err != nil {
		if ctx.Err() != nil {
			logf("interrupted: %v", err)
			return 130
		}
		logf("failed: %v", err)
		return 1
	}
	logf("done in %s", time.Since(b.started).Round(time.Second))
	return 0
}

// cleanup stops every system process and the cluster and removes the temporary directory.
// It runs on success, on error and after Ctrl-C.
func (b *bench) cleanup(keep bool) {
	b.mu.Lock()
	procs := append([]*sutProc(nil), b.procs...)
	b.mu.Unlock()
	for _, p := range procs {
		if p.alive() {
			_ = p.stop()
		}
	}
	for _, s := range b.dbs {
		if s.pool != nil {
			s.pool.Close()
		}
		if s.probe != nil {
			s.probe.Close()
		}
	}
	if b.pg != nil {
		b.pg.stop()
	}
	if b.tmp != "" {
		if keep {
			logf("kept %s", b.tmp)
		} else if err := os.RemoveAll(b.tmp); err != nil {
			logf("remove %s: %v", b.tmp, err)
		}
	}
}

// want reports whether workload w runs; pepsi's variants (W4f, W4w) are part of their workload.
func (b *bench) want(w string) bool {
	if base, ok := pepsiVariants[w]; ok {
		w = base
	}
	return b.only == nil || b.only[w]
}

// pepsiVariants are workloads that only pepsi runs, each a variant of the workload named: the
// other systems' figures in its rows are those of that workload.
var pepsiVariants = map[string]string{
	"W4f":    "W4", // stages s2 and s3 FUSE = yes
	"W4w":    "W4", // PARALLELISM = the whole worker budget on every stage (not a target)
	w1Beside: "W4", // pepsi's W1, run just before each of its W4 runs: W4's reference
	w5Beside: "W5", // pepsi's W1, run just before each of its W5 runs on a database of its own: W5's reference
}

func (b *bench) run(ctx context.Context, outPath, svgPath string) error {
	var err error
	if b.root, b.benchDir, err = findRoot(); err != nil {
		return err
	}
	if outPath == "" {
		outPath = filepath.Join(b.root, "BENCHMARKS.md")
	}
	if svgPath == "" {
		svgPath = filepath.Join(b.benchDir, "results.svg")
	}
	if b.self, err = os.Executable(); err != nil {
		return err
	}
	if b.tmp, err = os.MkdirTemp("", "pepsi-bench."); err != nil {
		return err
	}
	// The cluster runs as postgres and the dispatcher as nobody: both must get in here.
	if err := os.Chmod(b.tmp, 0o755); err != nil {
		return err
	}
	b.bin = filepath.Join(b.tmp, "bin")
	for _, d := range []string{b.bin, filepath.Join(b.tmp, "logs")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if err := b.build(ctx); err != nil {
		return err
	}
	if b.pauseDamon {
		var errs []error
		b.damonStopped, errs = damon.Pause()
		for _, err := range errs {
			logf("%v: its kdamond keeps running", err)
		}
		if len(b.damonStopped) > 0 {
			logf("stopped the kernel's DAMON for the run (-pause-damon; quiet.go); it starts again at the end")
			defer func() {
				if err := damon.Set(b.damonStopped, "on"); err != nil {
					logf("%v", err)
				}
			}()
		}
	}
	logf("starting a private PostgreSQL cluster in %s", filepath.Join(b.tmp, "pg"))
	if b.pg, err = startCluster(ctx, b.root, filepath.Join(b.tmp, "pg")); err != nil {
		// On a busy machine pg_ctl now and then gives up on a fresh cluster (seen with several
		// engineers' clusters running): one more try, in a new directory and on a new port.
		logf("starting the cluster failed (%v); trying once more", err)
		if b.pg != nil {
			b.pg.stop()
		}
		if b.pg, err = startCluster(ctx, b.root, filepath.Join(b.tmp, "pg2")); err != nil {
			return err
		}
	}
	if b.pgPID = b.pg.postmasterPID(); b.pgPID == 0 {
		return errors.New("cannot read the postmaster's pid")
	}
	b.systems = []*system{
		// Systems of one kind share a database: they never run at the same time, except in W6,
		// where River with its defaults idles on a database of its own.
		{name: "pepsi", kind: kindPepsi, label: "pepsi-dispatch", dbname: "bench_workqueue"},
		{name: consoleSystem, kind: kindPepsi, label: "pepsi-dispatch + console open", dbname: "bench_workqueue", only: map[string]bool{"W1": true}},
		{name: "river", kind: kindRiver, label: "River (tuned)", dbname: "bench_river"},
		{name: "river-default", kind: kindRiver, label: "River (defaults)", dbname: "bench_river", once: true},
		{name: "graphile", kind: kindGraphile, label: "Graphile Worker (tuned)", dbname: "bench_graphile"},
		{name: "graphile-default", kind: kindGraphile, label: "Graphile Worker (defaults)", dbname: "bench_graphile", once: true},
		{name: "pgq", kind: kindPgq, label: "PgQ", dbname: "bench_pgq", only: map[string]bool{"W1": true, "W2": true, "W3": true}},
		{name: "raw", kind: kindRaw, label: "raw loop", dbname: "bench_workqueue"},
	}
	py, err := b.pythonSystems() // pepsi-python, only when -systems names it
	if err != nil {
		return err
	}
	b.systems = append(b.systems, py...)
	if b.onlySys != nil {
		var keep []*system
		for _, s := range b.systems {
			if b.onlySys[s.name] {
				keep = append(keep, s)
			}
		}
		b.systems = keep
	}
	for _, s := range b.systems {
		if err := b.setupSystem(ctx, s); err != nil {
			return err
		}
	}
	b.res.init(b)
	steps := []struct {
		name string
		fn   func(context.Context) error
	}{
		{"W1", b.w1}, {"W2", b.w2}, {"W3", b.w3}, {"W4", b.w4}, {"W5", b.w5}, {"W6", b.w6},
	}
	for _, st := range steps {
		if !b.want(st.name) {
			continue
		}
		t0 := time.Now()
		logf("=== %s", st.name)
		if err := st.fn(ctx); err != nil {
			return fmt.Errorf("%s: %w", st.name, err)
		}
		logf("=== %s took %s", st.name, time.Since(t0).Round(time.Second))
		if err := ctx.Err(); err != nil {
			return err
		}
	}
	b.res.elapsed = time.Since(b.started)
	if err := os.WriteFile(svgPath, []byte(b.chart()), 0o644); err != nil {
		return err
	}
	rel, err := filepath.Rel(filepath.Dir(outPath), svgPath)
	if err != nil {
		rel = svgPath
	}
	if err := os.WriteFile(outPath, []byte(b.report(rel)), 0o644); err != nil {
		return err
	}
	logf("wrote %s and %s", outPath, svgPath)
	return nil
}

// findRoot finds the repository root (with schema.sql and scripts/pg-private) from the
// working directory: bench/ or the root itself.
func findRoot() (root, benchDir string, err error) {
	wd, err := os.Getwd()
	if err != nil {
		return "", "", err
	}
	for d := wd; ; d = filepath.Dir(d) {
		if fileExists(filepath.Join(d, "schema.sql")) && fileExists(filepath.Join(d, "scripts", "pg-private")) {
			return d, filepath.Join(d, "bench"), nil
		}
		if filepath.Dir(d) == d {
			return "", "", fmt.Errorf("no repository root (schema.sql, scripts/pg-private) above %s", wd)
		}
	}
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// build compiles the daemon and the stage program into tmp/bin.
func (b *bench) build(ctx context.Context) error {
	logf("building pepsi-dispatch and the no-op stage program")
	daemon := exec.CommandContext(ctx, "go", "build", "-o", filepath.Join(b.bin, "pepsi-dispatch"), ".")
	daemon.Dir = b.root
	daemon.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := daemon.CombinedOutput(); err != nil {
		return fmt.Errorf("build pepsi-dispatch: %w\n%s", err, out)
	}
	st := exec.CommandContext(ctx, "go", "build", "-o", filepath.Join(b.bin, "bench-stage"), "./pipeline/stage")
	st.Dir = b.benchDir
	st.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := st.CombinedOutput(); err != nil {
		return fmt.Errorf("build the stage program: %w\n%s", err, out)
	}
	for _, f := range []string{"pepsi-dispatch", "bench-stage"} {
		if err := os.Chmod(filepath.Join(b.bin, f), 0o755); err != nil {
			return err
		}
	}
	return nil
}

// goVersion is the toolchain that built this program.
func goVersion() string { return runtime.Version() }

// numCPU is what nproc says.
func numCPU() int { return runtime.NumCPU() }
