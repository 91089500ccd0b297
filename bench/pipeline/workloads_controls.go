// workloads_controls.go: issue 20's figures for the producer's controls, `pipeline controls`.
//
//	cd bench && go run ./pipeline controls -out /tmp/controls-bench.md [-before REV] [-small]
//
// Side by side in one run, on one private cluster (the same cluster setup as the main
// benchmark, its own databases), with one stage at PARALLELISM 8 and QUEUE_LIMIT 256 (-parallelism
// and -queue-limit change them; the main benchmark's pepsi runs 4 × 1000):
//   - W1 with none of the controls used, two builds alternating run by run: "before" (REV,
//     default the merge base of HEAD and main, built from `git archive` with its own schema.sql
//     and its own stage SDK in the no-op stage) and "after" (this tree); the medians and their
//     ratio.
//   - keyed: messages over keys (a concurrency_key each), a 1 ms handler, KEY_LIMIT = 2 against
//     the same without a limit; the rates, and the claim's server time per claimed row
//     (pg_stat_statements).
//   - saturated: a backlog of one key at KEY_LIMIT = 2 enqueued first, then 1,000 messages of
//     other keys: how long the 1,000 take, against the 1,000 alone; and EXPLAIN (ANALYZE,
//     BUFFERS) of the claim with the backlog parked, against the same without it.
//   - priority: priority -1 messages enqueued one at a time into a backlog of priority 0
//     messages (1 ms handler): enqueue-to-start time, p50 and p99.
//
// It writes the figures as Markdown to -out (never BENCHMARKS.md) and stops and removes
// everything it started.
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
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"pepsi-dispatch/internal/schemafile"
)

// ctlSizes are the controls benchmark's sizes.
type ctlSizes struct {
	runs                   int
	w1, keyed, keys, sat   int64
	backlog, urgent        int64
	urgentEvery, runBudget time.Duration
}

var ctlFull = ctlSizes{runs: 5, w1: 100_000, keyed: 100_000, keys: 1000, sat: 100_000,
	backlog: 100_000, urgent: 200, urgentEvery: 25 * time.Millisecond, runBudget: 10 * time.Minute}

var ctlSmall = ctlSizes{runs: 5, w1: 30_000, keyed: 20_000, keys: 1000, sat: 100_000,
	backlog: 30_000, urgent: 100, urgentEvery: 25 * time.Millisecond, runBudget: 5 * time.Minute}

// ctlBuild is one build of pepsi-dispatch with its own database.
type ctlBuild struct {
	name, bin, schema, db, dsn string
	stage                      string // its W1 stage program, built with its own stage SDK
	pool                       *pgxpool.Pool
}

type ctlBench struct {
	root, benchDir, tmp, bin string
	pg                       *cluster
	sz                       ctlSizes
	before, after            *ctlBuild
	beforeRev                string
	running                  []*exec.Cmd // dispatchers started and not yet stopped
	queueLimit               int         // QUEUE_LIMIT of the next dispatcher started
	baseQueueLimit           int         // the bench's QUEUE_LIMIT (-queue-limit)
	parallelism              int         // PARALLELISM of every dispatcher (-parallelism)
	only                     []string    // the steps to run; nil: all
	md                       strings.Builder
}

func controlsMain(args []string) int {
	fs := flag.NewFlagSet("controls", flag.ExitOnError)
	out := fs.String("out", "controls-bench.md", "where the Markdown figures go")
	before := fs.String("before", "", "the revision of the \"before\" build (default: git merge-base HEAD main)")
	small := fs.Bool("small", false, "smaller W1, keyed and priority sizes, for a shared machine")
	runs := fs.Int("runs", 0, "W1 runs per build (default 5)")
	keep := fs.Bool("keep", false, "keep the temporary directory")
	only := fs.String("only", "", "comma-separated steps to run (w1,keyed,saturated,priority); default all")
	par := fs.Int("parallelism", 8, "PARALLELISM of the stage (the main benchmark's pepsi runs 4)")
	ql := fs.Int("queue-limit", 256, "QUEUE_LIMIT of the stage (the main benchmark's pepsi runs 1000)")
	fs.Parse(args)
	if *par < 1 || *ql < 1 {
		fmt.Fprintln(os.Stderr, "controls: -parallelism and -queue-limit must be positive")
		return 2
	}
	c := &ctlBench{sz: ctlFull, queueLimit: *ql, baseQueueLimit: *ql, parallelism: *par}
	if *small {
		c.sz = ctlSmall
	}
	if *runs > 0 {
		c.sz.runs = *runs
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if *only != "" {
		c.only = strings.Split(*only, ",")
	}
	err := c.run(ctx, *before, "cd bench && go run ./pipeline controls "+strings.Join(args, " "))
	c.cleanup(*keep)
	if err == nil {
		err = os.WriteFile(*out, []byte(c.md.String()), 0o644)
	}
	if err != nil {
		logf("controls: %v", err)
		return 1
	}
	logf("wrote %s", *out)
	return 0
}

func (c *ctlBench) run(ctx context.Context, beforeRev, command string) error {
	var err error
	if c.root, c.benchDir, err = findRoot(); err != nil {
		return err
	}
	if beforeRev == "" {
		o, err := exec.CommandContext(ctx, "git", "-C", c.root, "merge-base", "HEAD", "main").Output()
		if err != nil {
			return fmt.Errorf("git merge-base HEAD main: %w", err)
		}
		beforeRev = strings.TrimSpace(string(o))
	}
	o, err := exec.CommandContext(ctx, "git", "-C", c.root, "rev-parse", "--short", beforeRev).Output()
	if err != nil {
		return fmt.Errorf("git rev-parse %s: %w", beforeRev, err)
	}
	c.beforeRev = strings.TrimSpace(string(o))
	if c.tmp, err = os.MkdirTemp("", "pepsi-controls-bench."); err != nil {
		return err
	}
	if err := os.Chmod(c.tmp, 0o755); err != nil { // the cluster's and the workers' accounts
		return err
	}
	c.bin = filepath.Join(c.tmp, "bin")
	if err := os.MkdirAll(c.bin, 0o755); err != nil {
		return err
	}
	if err := c.build(ctx); err != nil {
		return err
	}
	logf("controls: starting a private PostgreSQL cluster in %s", filepath.Join(c.tmp, "pg"))
	if c.pg, err = startCluster(ctx, c.root, filepath.Join(c.tmp, "pg")); err != nil {
		return err
	}
	for _, b := range []*ctlBuild{c.before, c.after} {
		if b.pool, err = c.pg.createDB(ctx, b.db, 4); err != nil {
			return err
		}
		b.dsn = c.pg.dsn(b.db)
		script, err := schemafile.Read(b.schema)
		if err != nil {
			return err
		}
		if err := execScript(ctx, b.pool, script); err != nil {
			return fmt.Errorf("apply %s: %w", b.schema, err)
		}
	}
	host, _ := os.Hostname()
	fmt.Fprintf(&c.md, "# The producer's controls (issue 20): figures\n\n")
	fmt.Fprintf(&c.md, "Command: `%s` (from the repository root's `bench/`), %s, PostgreSQL %s, %d CPUs, host %s, %s. "+
		"\"before\" is %s, \"after\" this tree. One stage, PARALLELISM %d, QUEUE_LIMIT %d, MAX_MESSAGES 1000000.\n\n",
		strings.TrimSpace(command), goVersion(), c.pg.version, numCPU(), host, time.Now().UTC().Format("2006-01-02 15:04 UTC"), c.beforeRev,
		c.parallelism, c.baseQueueLimit)
	steps := []struct {
		name string
		fn   func(context.Context) error
	}{{"w1", c.w1}, {"keyed", c.keyedRuns}, {"saturated", c.saturated}, {"priority", c.priority}}
	for _, st := range steps {
		if c.only != nil && !slices.Contains(c.only, st.name) {
			continue
		}
		if err := st.fn(ctx); err != nil {
			return err
		}
	}
	return nil
}

func (c *ctlBench) build(ctx context.Context) error {
	src := filepath.Join(c.tmp, "before-src")
	if err := os.MkdirAll(src, 0o755); err != nil {
		return err
	}
	logf("controls: building pepsi-dispatch %s (before) and this tree (after)", c.beforeRev)
	arch := exec.CommandContext(ctx, "sh", "-c", fmt.Sprintf("git -C %q archive %s | tar -x -C %q", c.root, c.beforeRev, src))
	if out, err := arch.CombinedOutput(); err != nil {
		return fmt.Errorf("git archive %s: %w\n%s", c.beforeRev, err, out)
	}
	steps := []struct{ dir, pkg, out string }{
		{src, ".", "pepsi-before"}, {c.root, ".", "pepsi-after"},
		// The no-op stage of each build links that build's stage SDK (the bench module
		// replaces pepsi-dispatch with its own tree), so that a change to the SDK is measured too.
		{filepath.Join(src, "bench"), "./pipeline/stage", "bench-stage-before"}, {c.benchDir, "./pipeline/stage", "bench-stage"},
		{c.benchDir, "./pipeline/sleepstage", "sleep-stage"},
	}
	for _, s := range steps {
		cmd := exec.CommandContext(ctx, "go", "build", "-o", filepath.Join(c.bin, s.out), s.pkg)
		cmd.Dir = s.dir
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("build %s in %s: %w\n%s", s.pkg, s.dir, err, out)
		}
	}
	c.before = &ctlBuild{name: "before", bin: filepath.Join(c.bin, "pepsi-before"), schema: filepath.Join(src, "schema.sql"), db: "ctl_before", stage: "bench-stage-before"}
	c.after = &ctlBuild{name: "after", bin: filepath.Join(c.bin, "pepsi-after"), schema: filepath.Join(c.root, "schema.sql"), db: "ctl_after", stage: "bench-stage"}
	return nil
}

func (c *ctlBench) cleanup(keep bool) {
	for _, cmd := range c.running {
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		cmd.Wait()
	}
	for _, b := range []*ctlBuild{c.before, c.after} {
		if b != nil && b.pool != nil {
			b.pool.Close()
		}
	}
	if c.pg != nil {
		c.pg.stop()
	}
	if c.tmp != "" && !keep {
		os.RemoveAll(c.tmp)
	} else if keep {
		logf("controls: kept %s", c.tmp)
	}
}

// dispatcher is one running pepsi-dispatch.
type dispatcher struct {
	cmd  *exec.Cmd
	done chan error
}

// start runs build b's dispatcher with one stage s1 run by program, stage keys extra.
func (c *ctlBench) start(ctx context.Context, b *ctlBuild, program, extra string, env ...string) (*dispatcher, error) {
	var w strings.Builder
	fmt.Fprintf(&w, "[database]\nDSN = %s\n\n[pepsi-dispatch]\n", b.dsn)
	if os.Geteuid() == 0 {
		w.WriteString("USER = nobody\n")
	}
	fmt.Fprintf(&w, "\n[stage-s1]\nPROGRAM = %s\nNEXT =\nPARALLELISM = %d\nQUEUE_LIMIT = %d\nMAX_MESSAGES = 1000000\n%s\n",
		filepath.Join(c.bin, program), c.parallelism, c.queueLimit, extra)
	conf := filepath.Join(c.tmp, "pepsi-"+b.name+".conf")
	if err := os.WriteFile(conf, []byte(w.String()), 0o644); err != nil {
		return nil, err
	}
	logPath := filepath.Join(c.tmp, "pepsi-"+b.name+".log")
	lf, err := os.OpenFile(logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, err
	}
	defer lf.Close()
	cmd := exec.Command(b.bin, "-c", conf, "serve")
	cmd.Env = append(os.Environ(), env...)
	cmd.Dir = c.tmp
	cmd.Stderr = lf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	c.running = append(c.running, cmd)
	d := &dispatcher{cmd: cmd, done: make(chan error, 1)}
	go func() { d.done <- cmd.Wait() }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var pid int
		err := b.pool.QueryRow(ctx, `SELECT coalesce(pid, 0) FROM dispatch_instance WHERE id = 1`).Scan(&pid)
		if err == nil && pid == cmd.Process.Pid {
			return d, nil
		}
		select {
		case err := <-d.done:
			return nil, fmt.Errorf("%s dispatcher exited at start (%v); see %s", b.name, err, logPath)
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%s dispatcher not ready after 30 s; see %s", b.name, logPath)
		}
	}
}

// stop ends a dispatcher with SIGTERM (SIGKILL to its group after 30 s).
func (c *ctlBench) stop(d *dispatcher) {
	d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.done:
	case <-time.After(30 * time.Second):
		syscall.Kill(-d.cmd.Process.Pid, syscall.SIGKILL)
		<-d.done
	}
	c.running = slices.DeleteFunc(c.running, func(x *exec.Cmd) bool { return x == d.cmd })
}

// reset empties b's queue.
func (c *ctlBench) reset(ctx context.Context, b *ctlBuild) error {
	if _, err := b.pool.Exec(ctx, `TRUNCATE workqueue`); err != nil {
		return err
	}
	_, err := b.pool.Exec(ctx, `VACUUM ANALYZE workqueue`)
	return err
}

// waitDone waits until no row matching where (an SQL condition) is left unfinished.
func (c *ctlBench) waitDone(ctx context.Context, b *ctlBuild, where string, d *dispatcher) error {
	deadline := time.Now().Add(c.sz.runBudget)
	q := `SELECT count(*) FROM workqueue WHERE status <> 'done'`
	last := `SELECT coalesce(max(workqueue_id), 0) FROM workqueue`
	if where != "" {
		q += " AND " + where
		last += " WHERE " + where
	}
	// Until the newest row is done, watch only it (a primary-key lookup): counting what is
	// left scans the table, which would cost the system under test a share of the machine.
	var lastID int64
	if err := b.pool.QueryRow(ctx, last).Scan(&lastID); err != nil {
		return err
	}
	lastDone := false
	for {
		var n int64
		if !lastDone {
			var st string
			if err := b.pool.QueryRow(ctx, `SELECT status FROM workqueue WHERE workqueue_id = $1`, lastID).Scan(&st); err != nil {
				return err
			}
			lastDone = st == "done"
			n = 1
		}
		if lastDone {
			if err := b.pool.QueryRow(ctx, q).Scan(&n); err != nil {
				return err
			}
		}
		if n == 0 {
			return nil
		}
		select {
		case err := <-d.done:
			return fmt.Errorf("%s dispatcher exited with %d open (%v)", b.name, n, err)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: messages still open after %s", b.name, c.sz.runBudget)
		}
	}
}

// backlog runs one backlog: insert (a statement enqueueing the messages) while the dispatcher
// is idle, then the time until every row matching where is done.
func (c *ctlBench) backlog(ctx context.Context, b *ctlBuild, program, extra, insert, where string, env ...string) (time.Duration, error) {
	if err := c.reset(ctx, b); err != nil {
		return 0, err
	}
	d, err := c.start(ctx, b, program, extra, env...)
	if err != nil {
		return 0, err
	}
	defer c.stop(d)
	if _, err := c.pg.admin.Exec(ctx, `SELECT pg_stat_statements_reset()`); err != nil {
		return 0, err
	}
	if _, err := b.pool.Exec(ctx, insert); err != nil {
		return 0, err
	}
	t0 := time.Now()
	if err := c.waitDone(ctx, b, where, d); err != nil {
		return 0, err
	}
	return time.Since(t0), nil
}

func fmtFloats(xs []float64) string {
	var p []string
	for _, x := range xs {
		p = append(p, fmt.Sprintf("%.1f", x))
	}
	return strings.Join(p, ", ")
}

func fmtRates(xs []float64) string {
	var p []string
	for _, x := range xs {
		p = append(p, fmt.Sprintf("%.0f", x))
	}
	return strings.Join(p, ", ")
}

// w1: no controls used, both builds alternating (a warm-up run each first, not counted).
func (c *ctlBench) w1(ctx context.Context) error {
	logf("controls: W1, %d messages, before and after alternating, %d runs each", c.sz.w1, c.sz.runs)
	insert := fmt.Sprintf(`INSERT INTO workqueue (stage, payload) SELECT 's1', jsonb_build_object('msg', g) FROM generate_series(1, %d) g`, c.sz.w1)
	rates, claimUS := map[string][]float64{}, map[string][]float64{}
	for r := 0; r <= c.sz.runs; r++ {
		order := []*ctlBuild{c.before, c.after}
		if r%2 == 1 {
			order = []*ctlBuild{c.after, c.before}
		}
		for _, b := range order {
			el, err := c.backlog(ctx, b, b.stage, "", insert, "")
			if err != nil {
				return fmt.Errorf("W1 %s: %w", b.name, err)
			}
			rate := float64(c.sz.w1) / el.Seconds()
			calls, rows, ms, _, err := c.claimStats(ctx, b)
			if err != nil {
				return err
			}
			perRow := 1000 * ms / float64(max(rows-calls, 1))
			if os.Getenv("CONTROLS_TOP") != "" {
				c.logTop(ctx, b)
			}
			logf("controls:   W1 run %d %-6s %8.0f/s, claim %.1f µs per claimed row (%d claims)", r, b.name, rate, perRow, calls)
			if r > 0 {
				rates[b.name] = append(rates[b.name], rate)
				claimUS[b.name] = append(claimUS[b.name], perRow)
			}
		}
	}
	mb, ma := median(rates["before"]), median(rates["after"])
	fmt.Fprintf(&c.md, "## W1, no controls used: before against after\n\n")
	fmt.Fprintf(&c.md, "%d messages enqueued in one statement into an idle dispatcher, one no-op stage (`pipeline/stage`), time until all are done; "+
		"%d runs per build after one warm-up run each, the builds alternating (the first of a pair swaps every run).\n\n", c.sz.w1, c.sz.runs)
	cb, ca := median(claimUS["before"]), median(claimUS["after"])
	fmt.Fprintf(&c.md, "| build | median msg/s | runs (msg/s) | median claim µs per claimed row | runs (µs) |\n|---|---|---|---|---|\n"+
		"| before (%s) | %.0f | %s | %.1f | %s |\n| after | %.0f | %s | %.1f | %s |\n\n",
		c.beforeRev, mb, fmtRates(rates["before"]), cb, fmtFloats(claimUS["before"]), ma, fmtRates(rates["after"]), ca, fmtFloats(claimUS["after"]))
	fmt.Fprintf(&c.md, "after / before: rate **%.3f** (%+.1f %%), claim server time per claimed row **%.3f** (pg_stat_statements: "+
		"the claim's total_exec_time over its rows less one per call).\n\n", ma/mb, 100*(ma/mb-1), ca/cb)
	return c.explainW1(ctx)
}

// explainW1 shows each build's own claim (from its claim.go) on the same backlog of 100,000
// pending rows without controls, capacity 2048, in a transaction rolled back: pages read and
// server time, which the machine's other load disturbs less than a rate.
func (c *ctlBench) explainW1(ctx context.Context) error {
	fmt.Fprintf(&c.md, "Each build's claim (its own `claim.go`) on 100,000 pending rows without controls, capacity 2048, "+
		"EXPLAIN (ANALYZE, BUFFERS) in a transaction rolled back, 5 times each alternating; median execution time and the buffers:\n\n")
	fmt.Fprintf(&c.md, "| build | median ms | runs (ms) | buffers |\n|---|---|---|---|\n")
	times := map[string][]float64{}
	bufs := map[string]string{}
	for r := 0; r < 5; r++ {
		for _, b := range []*ctlBuild{c.before, c.after} {
			src := filepath.Join(c.root, "claim.go")
			args := []any{[]string{"s1"}, []int32{2048}, []int32{0}, []string{}, []string{}, []int32{}}
			if b == c.before {
				src = filepath.Join(filepath.Dir(b.schema), "claim.go")
			}
			text, err := os.ReadFile(src)
			if err != nil {
				return err
			}
			mm := claimSQLRe.FindSubmatch(text)
			if mm == nil {
				return fmt.Errorf("claimSQL not found in %s", src)
			}
			if !strings.Contains(string(mm[1]), "$3") {
				args = args[:2]
			}
			if r == 0 {
				if err := c.reset(ctx, b); err != nil {
					return err
				}
				if _, err := b.pool.Exec(ctx, `INSERT INTO workqueue (stage, payload) SELECT 's1', jsonb_build_object('msg', g) FROM generate_series(1, 100000) g`); err != nil {
					return err
				}
				if _, err := b.pool.Exec(ctx, `VACUUM ANALYZE workqueue`); err != nil {
					return err
				}
			}
			tx, err := b.pool.Begin(ctx)
			if err != nil {
				return err
			}
			rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) "+string(mm[1]), args...)
			if err != nil {
				tx.Rollback(ctx)
				return err
			}
			lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
			tx.Rollback(ctx)
			if err != nil {
				return err
			}
			for _, l := range lines {
				if v, ok := strings.CutPrefix(strings.TrimSpace(l), "Execution Time: "); ok {
					var ms float64
					fmt.Sscanf(v, "%f", &ms)
					times[b.name] = append(times[b.name], ms)
				}
			}
			if len(lines) > 1 {
				bufs[b.name] = strings.TrimSpace(lines[1])
			}
		}
	}
	for _, b := range []*ctlBuild{c.before, c.after} {
		fmt.Fprintf(&c.md, "| %s | %.2f | %s | %s |\n", b.name, median(times[b.name]), fmtFloats(times[b.name]), bufs[b.name])
	}
	c.md.WriteString("\n")
	return nil
}

// claimStats reads the claim statement's calls (found by its RETURNING list, the same in both
// builds: pg_stat_statements replaces constants, such as the sequence's name, with parameters), rows and server time from pg_stat_statements.
func (c *ctlBench) claimStats(ctx context.Context, b *ctlBuild) (calls, rows int64, ms, maxMS float64, err error) {
	err = c.pg.admin.QueryRow(ctx, `SELECT coalesce(sum(calls), 0)::bigint, coalesce(sum(rows), 0)::bigint, coalesce(sum(total_exec_time), 0),
		       coalesce(max(max_exec_time), 0)
		  FROM pg_stat_statements
		 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = $1) AND query LIKE '%RETURNING q.workqueue_id, q.stage, q.claim%'`, b.db).Scan(&calls, &rows, &ms, &maxMS)
	return
}

// logTop logs b's five statements with the most server time since the last reset.
func (c *ctlBench) logTop(ctx context.Context, b *ctlBuild) {
	rows, err := c.pg.admin.Query(ctx, `SELECT calls, rows, total_exec_time, left(regexp_replace(query, '\s+', ' ', 'g'), 90)
		  FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = $1)
		 ORDER BY total_exec_time DESC LIMIT 5`, b.db)
	if err != nil {
		logf("top: %v", err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var calls, n int64
		var ms float64
		var q string
		rows.Scan(&calls, &n, &ms, &q)
		logf("controls:     %-6s %7d calls %8d rows %9.0f ms  %s", b.name, calls, n, ms, q)
	}
}

// keyedRuns: messages over keys, a 1 ms handler, KEY_LIMIT = 2 against no limit.
func (c *ctlBench) keyedRuns(ctx context.Context) error {
	logf("controls: keyed, %d messages over %d keys, 1 ms handler, KEY_LIMIT = 2 and none", c.sz.keyed, c.sz.keys)
	insert := fmt.Sprintf(`INSERT INTO workqueue (stage, payload, concurrency_key)
		SELECT 's1', jsonb_build_object('msg', g), 'k' || (g %% %d) FROM generate_series(1, %d) g`, c.sz.keys, c.sz.keyed)
	fmt.Fprintf(&c.md, "## Keyed: %d messages over %d keys, a 1 ms handler\n\n", c.sz.keyed, c.sz.keys)
	fmt.Fprintf(&c.md, "Enqueued round-robin over the keys in one statement; the stage is `pipeline/sleepstage` with BENCH_SLEEP_US=1000 "+
		"(8 workers: at most 8,000/s). Claim cost from pg_stat_statements: the claim statement's server time over the rows it claimed "+
		"(its rows less one per call, the final row).\n\n")
	fmt.Fprintf(&c.md, "| KEY_LIMIT | msg/s | claims | claimed rows | claim ms total | longest claim ms | µs per claimed row |\n|---|---|---|---|---|---|---|\n")
	for _, lim := range []string{"", "KEY_LIMIT = 2"} {
		el, err := c.backlog(ctx, c.after, "sleep-stage", lim, insert, "", "BENCH_SLEEP_US=1000")
		if err != nil {
			return fmt.Errorf("keyed %q: %w", lim, err)
		}
		calls, rows, ms, maxMS, err := c.claimStats(ctx, c.after)
		if err != nil {
			return err
		}
		claimed := rows - calls
		name := "none"
		if lim != "" {
			name = "2"
		}
		rate := float64(c.sz.keyed) / el.Seconds()
		logf("controls:   keyed KEY_LIMIT %s: %.0f/s, %d claims, %.1f µs per claimed row, longest claim %.0f ms", name, rate, calls, 1000*ms/float64(max(claimed, 1)), maxMS)
		fmt.Fprintf(&c.md, "| %s | %.0f | %d | %d | %.0f | %.0f | %.1f |\n", name, rate, calls, claimed, ms, maxMS, 1000*ms/float64(max(claimed, 1)))
	}
	c.md.WriteString("\n")
	return nil
}

// saturated: a backlog of one key at its limit, then 1,000 messages of other keys.
func (c *ctlBench) saturated(ctx context.Context) error {
	logf("controls: saturated, %d messages of one key (KEY_LIMIT = 2), then 1,000 of other keys", c.sz.sat)
	others := `INSERT INTO workqueue (stage, payload, concurrency_key) SELECT 's1', '{}', 'o' || g FROM generate_series(1, 1000) g`
	both := fmt.Sprintf(`WITH hot AS (INSERT INTO workqueue (stage, payload, concurrency_key)
		SELECT 's1', '{}', 'hot' FROM generate_series(1, %d) RETURNING 1)
		%s`, c.sz.sat, strings.Replace(others, "generate_series(1, 1000) g", "generate_series(1, 1000) g WHERE (SELECT count(*) FROM hot) > 0", 1))
	where := `concurrency_key LIKE 'o%'`
	alone, err := c.backlog(ctx, c.after, "sleep-stage", "KEY_LIMIT = 2", others, where, "BENCH_SLEEP_US=1000")
	if err != nil {
		return err
	}
	behind, err := c.backlog(ctx, c.after, "sleep-stage", "KEY_LIMIT = 2", both, where, "BENCH_SLEEP_US=1000")
	if err != nil {
		return err
	}
	var parked int64
	c.after.pool.QueryRow(ctx, `SELECT count(*) FROM workqueue WHERE key_parked`).Scan(&parked)
	logf("controls:   1,000 other keys alone %s, behind the saturated key %s (%d parked at the end)", alone.Round(time.Millisecond), behind.Round(time.Millisecond), parked)
	fmt.Fprintf(&c.md, "## Saturated key: %d messages of one key at KEY_LIMIT = 2, then 1,000 of other keys\n\n", c.sz.sat)
	fmt.Fprintf(&c.md, "The saturated key's messages are enqueued first (ahead of the others in id order, the worst case), in the same statement; "+
		"1 ms handler. Time until the 1,000 messages of the other keys are done:\n\n")
	fmt.Fprintf(&c.md, "| case | 1,000 other keys done in |\n|---|---|\n| alone | %s |\n| behind %d rows of a saturated key | %s |\n\n",
		alone.Round(time.Millisecond), c.sz.sat, behind.Round(time.Millisecond))
	fmt.Fprintf(&c.md, "Rows of the saturated key parked when the others were done: %d (the claim parks at most 2,000 per claim and key).\n\n", parked)
	return c.explainSaturated(ctx)
}

// explainSaturated shows the claim's plan with the saturated key's rows parked and 1,000 other
// rows pending, against the 1,000 alone, each in a transaction rolled back.
func (c *ctlBench) explainSaturated(ctx context.Context) error {
	src, err := os.ReadFile(filepath.Join(c.root, "claim.go"))
	if err != nil {
		return err
	}
	// The keyed statement: the plain claimSQL is for stages without a KEY_LIMIT (claim.go).
	mm := claimKeyedSQLRe.FindSubmatch(src)
	if mm == nil {
		return errors.New("claimKeyedSQL not found in claim.go")
	}
	b := c.after
	explain := func(setup []string) (string, error) {
		tx, err := b.pool.Begin(ctx)
		if err != nil {
			return "", err
		}
		defer tx.Rollback(context.Background())
		for _, q := range setup {
			if _, err := tx.Exec(ctx, q); err != nil {
				return "", fmt.Errorf("%s: %w", q, err)
			}
		}
		rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) "+string(mm[1]),
			[]string{"s1"}, []int32{2048}, []int32{2}, []string{"s1"}, []string{"hot"}, []int32{2})
		if err != nil {
			return "", err
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		return strings.Join(lines, "\n"), err
	}
	// Park the whole backlog as the claims would, then 1,000 fresh rows of other keys.
	park := fmt.Sprintf(`INSERT INTO workqueue (stage, payload, concurrency_key, key_parked) SELECT 's1', '{}', 'hot', true FROM generate_series(1, %d)`, c.sz.sat)
	fresh := `INSERT INTO workqueue (stage, payload, concurrency_key) SELECT 's1', '{}', 'o' || g FROM generate_series(1, 1000) g`
	done := fmt.Sprintf(`INSERT INTO workqueue (stage, payload, concurrency_key, status) SELECT 's1', '{}', 'hot', 'done' FROM generate_series(1, %d)`, c.sz.sat)
	if err := c.reset(ctx, b); err != nil {
		return err
	}
	satPlan, err := explain([]string{park, fresh, "ANALYZE workqueue"})
	if err != nil {
		return err
	}
	alonePlan, err := explain([]string{done, fresh, "ANALYZE workqueue"})
	if err != nil {
		return err
	}
	fmt.Fprintf(&c.md, "EXPLAIN (ANALYZE, BUFFERS) of the claim (capacity 2048, KEY_LIMIT = 2, the key `hot` with 2 in flight), "+
		"in a transaction rolled back: first with %d parked rows of `hot` and 1,000 pending rows of other keys; then with the same "+
		"table size but the %d rows done instead (the 1,000 alone). The claim takes the 1,000 in both; what differs is what it reads.\n\n", c.sz.sat, c.sz.sat)
	fmt.Fprintf(&c.md, "With the saturated key's backlog:\n\n```\n%s\n```\n\nWithout it:\n\n```\n%s\n```\n\n", satPlan, alonePlan)
	return nil
}

// priority: priority -1 messages enqueued one at a time into a backlog of priority 0, with
// the bench's QUEUE_LIMIT and with a short one.
func (c *ctlBench) priority(ctx context.Context) error {
	fmt.Fprintf(&c.md, "## Priority: enqueue-to-start of priority -1 messages in a backlog of %d priority 0 messages\n\n", c.sz.backlog)
	fmt.Fprintf(&c.md, "The backlog enqueued in one statement, then one priority -1 message every %s (each its own INSERT) while more than a "+
		"tenth of the backlog was left; 1 ms handler, 8 workers. A message that arrives waits for what is already in workers' queues "+
		"(up to 8 × QUEUE_LIMIT messages: the one claim it may wait for), so the figure is set by QUEUE_LIMIT. Enqueue = the row's "+
		"created_at (its transaction's start), start = the handler's first look (state.t0).\n\n", c.sz.urgentEvery)
	fmt.Fprintf(&c.md, "| QUEUE_LIMIT | messages | p50 | p99 | max | run |\n|---|---|---|---|---|---|\n")
	defer func() { c.queueLimit = c.baseQueueLimit }()
	for _, ql := range []int{256, 4} {
		c.queueLimit = ql
		if err := c.priorityRun(ctx, ql); err != nil {
			return err
		}
	}
	fmt.Fprintf(&c.md, "\nFor scale: a priority 0 message enqueued with the backlog waits for the whole backlog ahead of it "+
		"(%d messages at the stage's rate).\n", c.sz.backlog)
	return nil
}

func (c *ctlBench) priorityRun(ctx context.Context, ql int) error {
	logf("controls: priority, %d priority -1 messages into a backlog of %d priority 0, 1 ms handler, QUEUE_LIMIT %d", c.sz.urgent, c.sz.backlog, ql)
	b := c.after
	if err := c.reset(ctx, b); err != nil {
		return err
	}
	d, err := c.start(ctx, b, "sleep-stage", "", "BENCH_SLEEP_US=1000")
	if err != nil {
		return err
	}
	defer c.stop(d)
	if _, err := b.pool.Exec(ctx, fmt.Sprintf(`INSERT INTO workqueue (stage, payload) SELECT 's1', '{}' FROM generate_series(1, %d)`, c.sz.backlog)); err != nil {
		return err
	}
	t0 := time.Now()
	for sent := int64(0); sent < c.sz.urgent; sent++ {
		var open int64
		if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM workqueue WHERE status = 'pending' AND NOT key_parked AND priority = 0`).Scan(&open); err != nil {
			return err
		}
		if open < c.sz.backlog/10 {
			break // the backlog is nearly gone: what follows would not be "into a backlog"
		}
		if _, err := b.pool.Exec(ctx, `INSERT INTO workqueue (stage, payload, priority) VALUES ('s1', '{"urgent": true}', -1)`); err != nil {
			return err
		}
		time.Sleep(c.sz.urgentEvery)
	}
	if err := c.waitDone(ctx, b, "", d); err != nil {
		return err
	}
	el := time.Since(t0)
	var p50, p99, pmax float64
	var n int64
	if err := b.pool.QueryRow(ctx, `
		SELECT count(*),
		       percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), percentile_cont(0.99) WITHIN GROUP (ORDER BY ms), max(ms)
		  FROM (SELECT ((state->>'t0')::numeric / 1e6 - extract(epoch FROM created_at) * 1000)::float8 AS ms
		          FROM workqueue WHERE priority = -1) x`).Scan(&n, &p50, &p99, &pmax); err != nil {
		return err
	}
	logf("controls:   priority -1 enqueue-to-start: p50 %.1f ms, p99 %.1f ms, max %.1f ms (%d messages)", p50, p99, pmax, n)
	fmt.Fprintf(&c.md, "| %d | %d | %.1f ms | %.1f ms | %.1f ms | %s |\n", ql, n, p50, p99, pmax, el.Round(time.Millisecond))
	return nil
}
