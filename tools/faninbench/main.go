// Command faninbench measures fan-out / fan-in (issue 6, doc/design/fanin.md §4) in one run, through the
// real daemon and a real stage program on a private PostgreSQL:
//
//	go run ./tools/faninbench
//
// It builds pepsi-dispatch and its stage program (./stage), starts a private cluster with
// scripts/pg-private (track_commit_timestamp = on), and measures:
//
//	(a) the time to split 100,000 children: in the split stage's own transaction through the
//	    daemon (clock_timestamp() before and after SplitRange, and to its commit), and the SQL
//	    functions alone (fanout_split_range, fanout_split with 100,000 payloads), timed from
//	    the client including COMMIT, in a scratch schema of the same cluster;
//	(b) the wake latency, from the commit of a group's last child to the commit of the flush
//	    that set its parent 'pending': both are read exactly, without triggers, as the commit
//	    timestamps of the rows those transactions wrote (the child's own row, whose xmin is
//	    the child's commit; the group's fanin_wake_log row, inserted by the waking flush and
//	    never updated). p50 with the pipeline idle (many repetitions of a small group, one at
//	    a time) and p99 during a burst of 10,000 child completions (many groups at once). The
//	    time to the continuation's start (claim and hand-over included) is shown beside it;
//	(c) the cost of the fan-in bookkeeping: throughput of the same no-op stage for 20,000
//	    children in groups of 100 against 20,000 plain messages, alternating repetitions
//	    after one unmeasured repetition of each; the cost is one minus the median of the
//	    repetitions' fan-in/plain ratios (each pair runs back to back, so the machine's other
//	    load moves both arms of a pair together). Throughput is 20,000 over the span
//	    between the first and the last commit of those rows (commit timestamps again), so
//	    enqueueing is outside the window in both arms; both arms' rows appear at once (one
//	    transaction, which also refreshes the planner's statistics), and the groups' parents
//	    continue at a stage with no program, so the fan-in arm pays for inbox rows, flushes
//	    and wakes but not for running 200 continuations. Beside it, the CPU time of the whole
//	    system under test per 1,000 messages, which other load on a shared machine disturbs
//	    less than throughput, also by part (dispatcher, workers, PostgreSQL). The CPU window
//	    starts before the enqueue, so the fan-in arm's CPU includes its splits, which cost
//	    PostgreSQL more than the plain arm's one INSERT; the throughput excludes both. So does
//	    a second CPU window from the enqueue's commit on: the processing alone, whose
//	    fan-in/plain ratio (a median of the repetitions' own) is the bookkeeping's CPU.
//
// With -statements N it also lists, per arm of (c), the N statements with the most server
// time per 1,000 messages (pg_stat_statements, nested statements too, so a trigger's INSERT
// shows beside the UPDATE that fired it): where the bookkeeping's PostgreSQL time goes.
//
// The kernel's DAMON, where the machine runs it, is stopped while it measures and started again
// at the end (-pause-damon, internal/damon): its reclaim bursts would land in one arm or the
// other.
//
// Then it prints a table with the targets of issue 6: split ≤ 2 s, wake p50 ≤ 50 ms idle,
// p99 ≤ 300 ms under the burst, bookkeeping ≤ 10 %. Exit status 0 even when a target is
// missed (the table says so); 1 when the benchmark itself failed.
package main

import (
	"bufio"
	"cmp"
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/lib/pq"

	"pepsi-dispatch/internal/damon"
	"pepsi-dispatch/internal/schemafile"
)

var (
	splitN     = flag.Int("split", 100000, "children of the split measurement (a)")
	idleReps   = flag.Int("idle", 200, "repetitions of the idle wake-latency measurement (b)")
	idleSize   = flag.Int("idle-size", 4, "children per group in the idle measurement")
	burstN     = flag.Int("burst", 10000, "child completions in the burst (b)")
	burstSize  = flag.Int("burst-size", 20, "children per group in the burst")
	tputN      = flag.Int("n", 20000, "messages per throughput repetition (c)")
	tputGroup  = flag.Int("group", 100, "children per group in the fan-in arm of (c)")
	reps       = flag.Int("reps", 9, "repetitions of each arm of (c), alternating")
	phases     = flag.String("phases", "abc", "which measurements to make: a (split), b (wake latency), c (throughput)")
	explain    = flag.Duration("explain", 0, "log EXPLAIN ANALYZE of statements (nested too) slower than this to the server log (diagnosis; slows everything)")
	keep       = flag.Bool("keep", false, "keep the work directory (binaries, cluster, logs)")
	stmts      = flag.Int("statements", 0, "report the N statements (nested too, by pg_stat_statements) with the most server time per arm of (c) (diagnosis)")
	pauseDamon = flag.Bool("pause-damon", true, "stop the kernel's DAMON (kdamond), if the machine runs it, while measuring, and start it again at the end (internal/damon)")
)

func main() {
	flag.Parse()
	os.Exit(runMain())
}

// runMain is main's body, whose deferred calls (DAMON started again) run before the exit.
func runMain() int {
	b := &bench{}
	if *pauseDamon {
		// The machine's reclaim bursts (internal/damon) would land in one arm or the other.
		stopped, errs := damon.Pause()
		for _, err := range errs {
			fmt.Fprintf(os.Stderr, "faninbench: %v: its kdamond keeps running\n", err)
		}
		if len(stopped) > 0 {
			b.notes = append(b.notes, "the kernel's DAMON (kdamond) stopped while measuring (-pause-damon)")
			// An interrupt must not leave the machine without it.
			sig := make(chan os.Signal, 1)
			signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
			go func() {
				<-sig
				if err := damon.Set(stopped, "on"); err != nil {
					fmt.Fprintf(os.Stderr, "faninbench: %v\n", err)
				}
				os.Exit(130)
			}()
			defer func() {
				if err := damon.Set(stopped, "on"); err != nil {
					fmt.Fprintf(os.Stderr, "faninbench: %v\n", err)
				}
			}()
		}
	}
	err := b.run()
	b.cleanup()
	if err != nil {
		fmt.Fprintf(os.Stderr, "faninbench: %v\n", err)
		if b.daemonLog != "" {
			fmt.Fprintf(os.Stderr, "daemon log: %s\n", b.daemonLog)
		}
		return 1
	}
	return 0
}

type bench struct {
	root, work string
	pgDir      string
	pgStarted  bool
	dsn        string // the cluster's DSN (database postgres)
	db         *sql.DB
	daemon     *exec.Cmd
	daemonDone chan error
	daemonLog  string
	out        []row
	notes      []string
	stmtArms   [2]map[string]stmtUse // -statements: plain, fan-in arm of (c), summed over the repetitions
}

// stmtUse is one statement's share of the server's time, from pg_stat_statements.
type stmtUse struct {
	calls int64
	ms    float64
}

// row is one line of the result table.
type row struct{ what, value, target, verdict string }

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s faninbench: %s\n", time.Now().Format("15:04:05.000"), fmt.Sprintf(format, args...))
}

func (b *bench) run() error {
	ctx := context.Background()
	var err error
	if b.root, err = moduleRoot(); err != nil {
		return err
	}
	if b.work, err = os.MkdirTemp("", "faninbench-"); err != nil {
		return err
	}
	// The daemon drops to `nobody` when started as root: everything it and its workers read
	// must be world-readable, and the cluster's socket directory world-traversable.
	if err := os.Chmod(b.work, 0o755); err != nil {
		return err
	}
	logf("work directory %s", b.work)
	if err := b.build(); err != nil {
		return err
	}
	if err := b.startCluster(ctx); err != nil {
		return err
	}
	on := func(p string) bool { return strings.Contains(*phases, p) }
	if on("a") {
		if err := b.measureSplitSQL(ctx); err != nil {
			return err
		}
	}
	if err := b.setupSchema(ctx); err != nil {
		return err
	}
	if err := b.startDaemon(); err != nil {
		return err
	}
	if err := b.warmUp(ctx); err != nil {
		return err
	}
	for _, m := range []struct {
		phase string
		f     func(context.Context) error
	}{{"a", b.measureSplitDaemon}, {"b", b.measureIdle}, {"b", b.measureBurst}, {"c", b.measureThroughput}} {
		if on(m.phase) {
			if err := m.f(ctx); err != nil {
				return err
			}
		}
	}
	if err := b.stopDaemon(); err != nil {
		return err
	}
	if err := b.checkOracle(ctx); err != nil {
		return err
	}
	b.report()
	return nil
}

// moduleRoot finds the pepsi-dispatch module from the working directory up.
func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if data, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && strings.HasPrefix(string(data), "module pepsi-dispatch\n") {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("run me inside the pepsi-dispatch module (go run ./tools/faninbench)")
		}
		dir = parent
	}
}

func (b *bench) build() error {
	for _, t := range []struct{ out, pkg string }{
		{"pepsi-dispatch", "."},
		{"faninbench-stage", "./tools/faninbench/stage"},
	} {
		logf("go build %s", t.pkg)
		cmd := exec.Command("go", "build", "-o", filepath.Join(b.work, t.out), t.pkg)
		cmd.Dir = b.root
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("go build %s: %w", t.pkg, err)
		}
		if err := os.Chmod(filepath.Join(b.work, t.out), 0o755); err != nil {
			return err
		}
	}
	return nil
}

func (b *bench) pgPrivate(args ...string) (string, error) {
	cmd := exec.Command(filepath.Join(b.root, "scripts", "pg-private"), args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // a Ctrl-C reaches only us; we stop it
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("pg-private %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return strings.TrimSpace(out.String()), nil
}

func (b *bench) startCluster(ctx context.Context) error {
	b.pgDir = filepath.Join(b.work, "pg")
	if err := os.Mkdir(b.pgDir, 0o755); err != nil {
		return err
	}
	logf("starting PostgreSQL (scripts/pg-private)")
	dsn, err := b.pgPrivate("start", b.pgDir)
	if err != nil {
		return err
	}
	b.pgStarted = true
	b.dsn = dsn
	if b.db, err = sql.Open("postgres", dsn); err != nil {
		return err
	}
	// Commit timestamps: the exact commit time of a child and of the flush that woke its
	// parent, read from the rows they wrote (no trigger, nothing added to their work).
	if _, err := b.db.ExecContext(ctx, `ALTER SYSTEM SET track_commit_timestamp = on`); err != nil {
		return err
	}
	if *stmts > 0 {
		// pg_stat_statements defines its parameters only when preloaded, so ALTER SYSTEM
		// cannot name them before the restart: they go into postgresql.conf.
		f, err := os.OpenFile(filepath.Join(b.pgDir, "data", "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
		if err == nil {
			_, err = f.WriteString("shared_preload_libraries = 'pg_stat_statements'\n" +
				"pg_stat_statements.track = all\npg_stat_statements.max = 5000\n")
			if cerr := f.Close(); err == nil {
				err = cerr
			}
		}
		if err != nil {
			return fmt.Errorf("configure pg_stat_statements: %w", err)
		}
	}
	if *explain > 0 {
		conn, err := b.db.Conn(ctx) // LOAD makes its parameters known to this session only
		if err != nil {
			return err
		}
		defer conn.Close()
		for _, q := range []string{
			`LOAD 'auto_explain'`,
			`ALTER SYSTEM SET session_preload_libraries = 'auto_explain'`,
			fmt.Sprintf(`ALTER SYSTEM SET auto_explain.log_min_duration = '%dms'`, explain.Milliseconds()),
			`ALTER SYSTEM SET auto_explain.log_analyze = on`,
			`ALTER SYSTEM SET auto_explain.log_nested_statements = on`,
			`ALTER SYSTEM SET auto_explain.log_level = warning`,
			`ALTER SYSTEM SET log_line_prefix = '%m [%p] %a '`,
		} {
			if _, err := conn.ExecContext(ctx, q); err != nil {
				return err
			}
		}
		b.notes = append(b.notes, fmt.Sprintf("auto_explain on (≥ %v): figures are slowed; see %s", *explain, filepath.Join(b.pgDir, "server.log")))
	}
	b.db.Close()
	if _, err := b.pgPrivate("restart", b.pgDir); err != nil {
		return err
	}
	if b.db, err = sql.Open("postgres", dsn); err != nil {
		return err
	}
	var version, tcs string
	if err := b.db.QueryRowContext(ctx, `SELECT current_setting('server_version'), current_setting('track_commit_timestamp')`).Scan(&version, &tcs); err != nil {
		return err
	}
	if tcs != "on" {
		return fmt.Errorf("track_commit_timestamp is %s after the restart", tcs)
	}
	if *stmts > 0 {
		if _, err := b.db.ExecContext(ctx, `CREATE EXTENSION pg_stat_statements SCHEMA public`); err != nil {
			return fmt.Errorf("create extension pg_stat_statements: %w", err)
		}
	}
	var syncCommit, fsync string
	b.db.QueryRowContext(ctx, `SELECT current_setting('synchronous_commit'), current_setting('fsync')`).Scan(&syncCommit, &fsync)
	b.notes = append(b.notes, fmt.Sprintf("PostgreSQL %s (private cluster, synchronous_commit = %s, fsync = %s), %d CPUs, load average at start %s",
		version, syncCommit, fsync, runtime.NumCPU(), loadAvg()))
	return nil
}

// schemaDSN is the cluster's DSN with search_path set to schema.
func (b *bench) schemaDSN(schema string) string {
	return fmt.Sprintf("%s options='-c search_path=%s'", b.dsn, schema)
}

// applySchema creates schema and applies schema.sql in it; it returns a pool on it.
func (b *bench) applySchema(ctx context.Context, schema string) (*sql.DB, error) {
	if _, err := b.db.ExecContext(ctx, "CREATE SCHEMA "+schema); err != nil {
		return nil, err
	}
	db, err := sql.Open("postgres", b.schemaDSN(schema))
	if err != nil {
		return nil, err
	}
	ddl, err := schemafile.Read(filepath.Join(b.root, "schema.sql")) // with its \ir includes
	if err != nil {
		return nil, err
	}
	if _, err := db.ExecContext(ctx, ddl); err != nil {
		return nil, fmt.Errorf("apply schema.sql in %s: %w", schema, err)
	}
	return db, nil
}

// ---- (a) split, the SQL functions alone ----

func (b *bench) measureSplitSQL(ctx context.Context) error {
	db, err := b.applySchema(ctx, "scratch")
	if err != nil {
		return err
	}
	defer db.Close()
	n := *splitN
	payloads := "[" + strings.TrimSuffix(strings.Repeat(`{},`, n), ",") + "]"
	forms := []struct {
		name, q string
		arg     any
	}{
		{"fanout_split_range", `SELECT fanout_split_range($1, 'split', 'join', 'child', 1, $2::bigint, $2::int, 1)`, n},
		{"fanout_split (payloads)", `SELECT fanout_split($1, 'split', 'join', 'child', $2::jsonb)`, payloads},
	}
	for _, f := range forms {
		var times []time.Duration
		for rep := 0; rep < 3; rep++ {
			var parent int64
			if err := db.QueryRowContext(ctx, `INSERT INTO workqueue (stage, status, claim, claimed_at)
			    VALUES ('split', 'running', nextval('workqueue_claim_seq'), now()) RETURNING workqueue_id`).Scan(&parent); err != nil {
				return err
			}
			args := []any{parent, f.arg}
			start := time.Now()
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				return err
			}
			var fid int64
			if err := tx.QueryRowContext(ctx, f.q, args...).Scan(&fid); err != nil {
				tx.Rollback()
				return fmt.Errorf("%s: %w", f.name, err)
			}
			if err := tx.Commit(); err != nil {
				return err
			}
			times = append(times, time.Since(start))
			var children int
			db.QueryRowContext(ctx, `SELECT count(*) FROM workqueue WHERE fanout_id = $1`, fid).Scan(&children)
			if children != n {
				return fmt.Errorf("%s made %d children, want %d", f.name, children, n)
			}
		}
		med := medianDur(times)
		logf("(a) %s of %d children: %v (median of %v)", f.name, n, med, times)
		b.add(fmt.Sprintf("(a) split %d, SQL %s incl. COMMIT, median of 3", n, f.name), ms(med), "≤ 2 s", verdict(med <= 2*time.Second))
	}
	_, err = b.db.ExecContext(ctx, `DROP SCHEMA scratch CASCADE`)
	return err
}

// ---- the daemon's schema, config, process ----

const benchDDL = `
CREATE TABLE bench_split (id bigint PRIMARY KEY, n int NOT NULL, t0 timestamptz NOT NULL, t1 timestamptz);
CREATE TABLE bench_join (id bigint PRIMARY KEY, started timestamptz NOT NULL);`

func (b *bench) setupSchema(ctx context.Context) error {
	db, err := b.applySchema(ctx, "fb")
	if err != nil {
		return err
	}
	if _, err := db.ExecContext(ctx, benchDDL); err != nil {
		return err
	}
	b.db.Close()
	b.db = db // from here on, every statement runs in the daemon's schema
	return nil
}

func (b *bench) startDaemon() error {
	stageBin := filepath.Join(b.work, "faninbench-stage")
	conf := fmt.Sprintf(`# faninbench
[database]
DSN = %s

[pepsi-dispatch]
USER = nobody
STATS_INTERVAL = 60
WORKER_IDLE_TIMEOUT = 3600
SHUTDOWN_GRACE = 30

[stage-split]
PROGRAM = %s
NEXT = join
PARALLELISM = 1
QUEUE_LIMIT = 64

[stage-child]
PROGRAM = %[2]s
PARALLELISM = 2
QUEUE_LIMIT = 128
MAX_MESSAGES = 100000000

[stage-join]
PROGRAM = %[2]s
PARALLELISM = 1
QUEUE_LIMIT = 64
MAX_MESSAGES = 100000000
`, b.schemaDSN("fb"), stageBin)
	path := filepath.Join(b.work, "pepsi.conf")
	if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
		return err
	}
	b.daemonLog = filepath.Join(b.work, "daemon.log")
	logFile, err := os.Create(b.daemonLog)
	if err != nil {
		return err
	}
	b.daemon = exec.Command(filepath.Join(b.work, "pepsi-dispatch"), "-c", path, "serve")
	b.daemon.Stdout, b.daemon.Stderr = logFile, logFile
	if err := b.daemon.Start(); err != nil {
		logFile.Close()
		return err
	}
	b.daemonDone = make(chan error, 1)
	go func() { b.daemonDone <- b.daemon.Wait(); logFile.Close() }()
	logf("pepsi-dispatch started (pid %d), log %s", b.daemon.Process.Pid, b.daemonLog)
	return b.waitLog("msg=dispatching", 60*time.Second)
}

func (b *bench) waitLog(s string, timeout time.Duration) error {
	return b.waitFor(timeout, "daemon log line "+s, func() (bool, error) {
		data, err := os.ReadFile(b.daemonLog)
		return strings.Contains(string(data), s), err
	})
}

// waitFor polls cond every 5 ms; it fails at once if the daemon has exited.
func (b *bench) waitFor(timeout time.Duration, what string, cond func() (bool, error)) error {
	return b.waitEvery(5*time.Millisecond, timeout, what, cond)
}

// waitEvery is waitFor with another poll interval: where the wait ends does not matter to the
// figures (they come from commit timestamps), poll seldom, so as not to load the database.
func (b *bench) waitEvery(every, timeout time.Duration, what string, cond func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	for {
		ok, err := cond()
		if err != nil {
			return fmt.Errorf("waiting for %s: %w", what, err)
		}
		if ok {
			return nil
		}
		if b.daemonDone != nil {
			select {
			case err := <-b.daemonDone:
				b.daemonDone = nil
				return fmt.Errorf("waiting for %s: the daemon exited (%v)", what, err)
			default:
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(every)
	}
}

func (b *bench) stopDaemon() error {
	if b.daemon == nil || b.daemonDone == nil {
		return nil
	}
	b.daemon.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-b.daemonDone:
		b.daemonDone = nil
		if err != nil {
			return fmt.Errorf("daemon exit after SIGTERM: %v", err)
		}
	case <-time.After(60 * time.Second):
		b.daemon.Process.Kill()
		return errors.New("the daemon did not stop within 60 s of SIGTERM")
	}
	return nil
}

func (b *bench) cleanup() {
	if b.daemon != nil && b.daemonDone != nil {
		b.daemon.Process.Kill()
		<-b.daemonDone
	}
	if b.db != nil {
		b.db.Close()
	}
	if b.pgStarted {
		if _, err := b.pgPrivate("stop", b.pgDir); err != nil {
			logf("stop PostgreSQL: %v", err)
		}
	}
	if b.work != "" && !*keep {
		os.RemoveAll(b.work)
	} else if b.work != "" {
		logf("kept %s", b.work)
	}
}

// enqueueParents inserts one split message per payload in one statement and returns the ids.
func (b *bench) enqueueParents(ctx context.Context, payload string, n int) ([]int64, error) {
	var ids []int64
	err := b.db.QueryRowContext(ctx, `WITH i AS (INSERT INTO workqueue (stage, payload)
	        SELECT 'split', $1::jsonb FROM generate_series(1, $2) RETURNING workqueue_id)
	    SELECT array_agg(workqueue_id ORDER BY workqueue_id) FROM i`, payload, n).Scan(pq.Array(&ids))
	return ids, err
}

// waitJoined waits until every parent of ids is done at 'join', polling every 5 ms for a few
// ids, less often for many.
func (b *bench) waitJoined(ctx context.Context, ids []int64, timeout time.Duration) error {
	every := 5 * time.Millisecond
	if len(ids) > 10 {
		every = 50 * time.Millisecond
	}
	return b.waitEvery(every, timeout, fmt.Sprintf("%d parents joined", len(ids)), func() (bool, error) {
		var n int
		err := b.db.QueryRowContext(ctx, `SELECT count(*) FROM workqueue WHERE workqueue_id = ANY ($1)
		    AND stage = 'join' AND status = 'done'`, pq.Array(ids)).Scan(&n)
		return n == len(ids), err
	})
}

func (b *bench) warmUp(ctx context.Context) error {
	ids, err := b.enqueueParents(ctx, `{"n": 4}`, 4)
	if err != nil {
		return err
	}
	return b.waitJoined(ctx, ids, 60*time.Second)
}

// groupLatency is one group's wake latency.
type groupLatency struct {
	parent  int64
	toWake  time.Duration // last child's commit -> commit of the flush that woke the parent
	toJoin  time.Duration // last child's commit -> the continuation's start
	lastAt  time.Time     // the last child's commit
	firstAt time.Time     // the first child's commit
}

// latencies reads the wake latency of the groups of parents ids from commit timestamps.
func (b *bench) latencies(ctx context.Context, ids []int64) ([]groupLatency, error) {
	rows, err := b.db.QueryContext(ctx, `
	    SELECT f.parent_id,
	           extract(epoch FROM pg_xact_commit_timestamp(l.xmin) - c.last_commit),
	           extract(epoch FROM j.started - c.last_commit),
	           c.last_commit, c.first_commit
	      FROM fanout f
	      JOIN fanin_wake_log l USING (fanout_id)
	      JOIN bench_join j ON j.id = f.parent_id
	      CROSS JOIN LATERAL (SELECT max(pg_xact_commit_timestamp(w.xmin)) AS last_commit,
	                                 min(pg_xact_commit_timestamp(w.xmin)) AS first_commit
	                            FROM workqueue w WHERE w.fanout_id = f.fanout_id) c
	     WHERE f.parent_id = ANY ($1)`, pq.Array(ids))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []groupLatency
	for rows.Next() {
		var g groupLatency
		var wake, join sql.NullFloat64
		if err := rows.Scan(&g.parent, &wake, &join, &g.lastAt, &g.firstAt); err != nil {
			return nil, err
		}
		if !wake.Valid || !join.Valid {
			return nil, fmt.Errorf("group of parent %d: no commit timestamp", g.parent)
		}
		g.toWake, g.toJoin = secs(wake.Float64), secs(join.Float64)
		out = append(out, g)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if len(out) != len(ids) {
		return nil, fmt.Errorf("latency of %d groups, want %d (a parent without exactly one wake?)", len(out), len(ids))
	}
	return out, nil
}

func secs(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// ---- (a) split through the daemon, and the 100,000-child group end to end ----

func (b *bench) measureSplitDaemon(ctx context.Context) error {
	n := *splitN
	ids, err := b.enqueueParents(ctx, fmt.Sprintf(`{"n": %d, "range": true}`, n), 1)
	if err != nil {
		return err
	}
	logf("(a) one parent splits into %d children through the daemon (SplitRange) and waits for them", n)
	start := time.Now()
	// Once the split has committed, refresh the planner's statistics (autovacuum would, a
	// minute later): planned from the statistics of a near-empty table, every claim walks
	// all pending rows (see the notes in the report).
	if err := b.waitEvery(20*time.Millisecond, time.Minute, "the split committed", func() (bool, error) {
		var n int
		err := b.db.QueryRowContext(ctx, `SELECT count(*) FROM bench_split WHERE id = $1`, ids[0]).Scan(&n)
		return n == 1, err
	}); err != nil {
		return err
	}
	if _, err := b.db.ExecContext(ctx, `ANALYZE workqueue`); err != nil {
		return err
	}
	if err := b.waitJoined(ctx, ids, 10*time.Minute); err != nil {
		return err
	}
	wall := time.Since(start)
	var inTx, toCommit float64
	if err := b.db.QueryRowContext(ctx, `SELECT extract(epoch FROM t1 - t0),
	        extract(epoch FROM pg_xact_commit_timestamp(xmin) - t0) FROM bench_split WHERE id = $1`, ids[0]).
		Scan(&inTx, &toCommit); err != nil {
		return err
	}
	lat, err := b.latencies(ctx, ids)
	if err != nil {
		return err
	}
	g := lat[0]
	span := g.lastAt.Sub(g.firstAt)
	b.add(fmt.Sprintf("(a) split %d, split stage's SplitRange (in its transaction)", n), ms(secs(inTx)), "≤ 2 s", verdict(secs(inTx) <= 2*time.Second))
	b.add(fmt.Sprintf("(a) split %d, split stage start to its COMMIT", n), ms(secs(toCommit)), "≤ 2 s", verdict(secs(toCommit) <= 2*time.Second))
	b.add(fmt.Sprintf("    that group end to end: %d children run in", n),
		fmt.Sprintf("%.1f s (%.0f/s)", span.Seconds(), float64(n)/span.Seconds()), "", "")
	b.add("    that group: last child's commit -> parent pending", ms(g.toWake), "", "")
	logf("(a) split %v in its transaction, %v to its commit; %d children in %v; wake %v; wall %v",
		secs(inTx), secs(toCommit), n, span, g.toWake, wall)
	return nil
}

// ---- (b) wake latency ----

func (b *bench) measureIdle(ctx context.Context) error {
	logf("(b) idle: %d groups of %d children, one at a time", *idleReps, *idleSize)
	var ids []int64
	payload := fmt.Sprintf(`{"n": %d}`, *idleSize)
	for i := 0; i < *idleReps; i++ {
		one, err := b.enqueueParents(ctx, payload, 1)
		if err != nil {
			return err
		}
		if err := b.waitJoined(ctx, one, 60*time.Second); err != nil {
			return err
		}
		ids = append(ids, one...)
	}
	lat, err := b.latencies(ctx, ids)
	if err != nil {
		return err
	}
	wake, join := collect(lat)
	p50 := quantile(wake, 0.5)
	b.add(fmt.Sprintf("(b) wake latency, idle, p50 (%d groups of %d)", len(lat), *idleSize), ms(p50), "≤ 50 ms", verdict(p50 <= 50*time.Millisecond))
	b.add("    idle: p90 / p99 / max", fmt.Sprintf("%s / %s / %s", ms(quantile(wake, 0.9)), ms(quantile(wake, 0.99)), ms(quantile(wake, 1))), "", "")
	b.add("    idle: to the continuation's start, p50 / p99", fmt.Sprintf("%s / %s", ms(quantile(join, 0.5)), ms(quantile(join, 0.99))), "", "")
	logf("(b) idle p50 %v p99 %v (to join start p50 %v)", p50, quantile(wake, 0.99), quantile(join, 0.5))
	return nil
}

func (b *bench) measureBurst(ctx context.Context) error {
	groups := *burstN / *burstSize
	logf("(b) burst: %d groups of %d children (%d completions) at once", groups, *burstSize, groups**burstSize)
	ids, err := b.enqueueParents(ctx, fmt.Sprintf(`{"n": %d}`, *burstSize), groups)
	if err != nil {
		return err
	}
	if err := b.waitJoined(ctx, ids, 10*time.Minute); err != nil {
		return err
	}
	lat, err := b.latencies(ctx, ids)
	if err != nil {
		return err
	}
	first, last := lat[0].firstAt, lat[0].lastAt
	for _, g := range lat {
		if g.firstAt.Before(first) {
			first = g.firstAt
		}
		if g.lastAt.After(last) {
			last = g.lastAt
		}
	}
	span := last.Sub(first)
	wake, join := collect(lat)
	p99 := quantile(wake, 0.99)
	b.add(fmt.Sprintf("(b) wake latency, burst of %d completions in %.1f s, p99 (%d groups)", groups**burstSize, span.Seconds(), groups),
		ms(p99), "≤ 300 ms", verdict(p99 <= 300*time.Millisecond))
	b.add("    burst: p50 / p90 / max", fmt.Sprintf("%s / %s / %s", ms(quantile(wake, 0.5)), ms(quantile(wake, 0.9)), ms(quantile(wake, 1))), "", "")
	b.add("    burst: to the continuation's start, p50 / p99", fmt.Sprintf("%s / %s", ms(quantile(join, 0.5)), ms(quantile(join, 0.99))), "", "")
	logf("(b) burst over %v: p50 %v p99 %v max %v", span, quantile(wake, 0.5), p99, quantile(wake, 1))
	return nil
}

func collect(lat []groupLatency) (wake, join []time.Duration) {
	for _, g := range lat {
		wake = append(wake, g.toWake)
		join = append(join, g.toJoin)
	}
	return wake, join
}

// ---- (c) the cost of the bookkeeping ----

func (b *bench) measureThroughput(ctx context.Context) error {
	n, size := *tputN, *tputGroup
	if n%size != 0 {
		return fmt.Errorf("-n %d is not a multiple of -group %d", n, size)
	}
	logf("(c) throughput: %d plain messages vs %d children in groups of %d, %d alternating repetitions each", n, n, size, *reps)
	var plain, fanin, plainCPU, faninCPU, plainWork, faninWork []float64
	var plainParts, faninParts [3][]float64 // dispatcher, workers, PostgreSQL: CPU-s per 1,000
	var flushes, flushMs, events int64
	// One unmeasured repetition of each arm first: the first run after the earlier phases is
	// slower whichever arm it is (autovacuum and statistics of the grown tables).
	for _, grouped := range []bool{false, true} {
		if _, _, _, err := b.throughputRun(ctx, n, size, grouped); err != nil {
			return err
		}
	}
	b.stmtArms = [2]map[string]stmtUse{} // not the warm-up's
	before, err := b.statsAfter(ctx, time.Time{})
	if err != nil {
		return err
	}
	for rep := 0; rep < *reps; rep++ {
		for _, grouped := range []bool{false, true} {
			if rep%2 == 1 {
				grouped = !grouped // alternate which arm goes first
			}
			rate, use, work, err := b.throughputRun(ctx, n, size, grouped)
			if err != nil {
				return err
			}
			per := func(secs float64) float64 { return secs / float64(n) * 1000 }
			cpu := per(use.total())
			parts := &plainParts
			if grouped {
				parts = &faninParts
			}
			for i, v := range []float64{use.dispatcher, use.workers, use.pg} {
				parts[i] = append(parts[i], per(v))
			}
			after, err := b.statsAfter(ctx, time.Now())
			if err != nil {
				return err
			}
			if grouped {
				fanin = append(fanin, rate)
				faninCPU = append(faninCPU, cpu)
				faninWork = append(faninWork, per(work.total()))
				flushes += after.flushes - before.flushes
				flushMs += after.flushMs - before.flushMs
				events += after.events - before.events
			}
			before = after
			if !grouped {
				plain = append(plain, rate)
				plainCPU = append(plainCPU, cpu)
				plainWork = append(plainWork, per(work.total()))
			}
			logf("(c) rep %d %s: %.0f messages/s, %.3f CPU-s per 1000 (dispatcher %.3f, workers %.3f, PostgreSQL %.3f)",
				rep+1, map[bool]string{false: "plain", true: "fan-in"}[grouped], rate, cpu,
				per(use.dispatcher), per(use.workers), per(use.pg))
		}
	}
	mp, mf := medianF(plain), medianF(fanin)
	// The cost is the median of the repetitions' own ratios: each repetition runs both arms
	// back to back, so a change of the machine's other load (it is shared) moves both arms of
	// a pair together, where it would move the two medians apart.
	ratios := make([]float64, len(plain))
	for i := range plain {
		ratios[i] = fanin[i] / plain[i]
	}
	cost := (1 - medianF(ratios)) * 100
	b.add(fmt.Sprintf("(c) plain messages/s, median of %d (%d each)", len(plain), n), fmt.Sprintf("%.0f  %s", mp, rates(plain)), "", "")
	b.add(fmt.Sprintf("(c) children in groups of %d, messages/s, median of %d", size, len(fanin)), fmt.Sprintf("%.0f  %s", mf, rates(fanin)), "", "")
	b.add("(c) fan-in bookkeeping cost, 1 - median of the repetitions' fan-in/plain", fmt.Sprintf("%.1f %%  (ratios %s)", cost, fractions(ratios)), "≤ 10 %", verdict(cost <= 10))
	b.add("    the same from the arms' medians, 1 - fan-in/plain", fmt.Sprintf("%.1f %%", (1-mf/mp)*100), "", "")
	cp, cf := medianF(plainCPU), medianF(faninCPU)
	b.add("(c) CPU-seconds per 1,000 messages, plain / fan-in (medians)", fmt.Sprintf("%.3f / %.3f  (+%.1f %%)", cp, cf, (cf/cp-1)*100), "", "")
	b.add("    by part: dispatcher, workers, PostgreSQL (the split's inserts too)",
		fmt.Sprintf("%.3f / %.3f, %.3f / %.3f, %.3f / %.3f",
			medianF(plainParts[0]), medianF(faninParts[0]), medianF(plainParts[1]), medianF(faninParts[1]),
			medianF(plainParts[2]), medianF(faninParts[2])), "", "")
	// The same pairing for the CPU spent from the enqueue's commit on: on a shared machine
	// other load slows a run without costing its processes CPU, so this moves less than the
	// throughput; the verdict stays the throughput's (issue 6's definition).
	workRatios := make([]float64, len(plainWork))
	for i := range plainWork {
		workRatios[i] = faninWork[i] / plainWork[i]
	}
	b.add("(c) CPU-seconds per 1,000 messages from the enqueue's commit on (no split), plain / fan-in",
		fmt.Sprintf("%.4f / %.4f  (median of the repetitions' fan-in/plain: +%.1f %%; %s)", medianF(plainWork), medianF(faninWork),
			(medianF(workRatios)-1)*100, fractions(workRatios)), "", "")
	if k := int64(len(fanin)); k > 0 {
		b.add("    fan-in arm: flushes per repetition, ms each",
			fmt.Sprintf("%d, %.1f ms (%d events each)", flushes/k, float64(flushMs)/math.Max(1, float64(flushes)), events/k), "", "")
	}
	return nil
}

// cpuUse is CPU time (user + system, seconds) of the system under test, by part.
type cpuUse struct{ dispatcher, workers, pg float64 }

func (c cpuUse) total() float64 { return c.dispatcher + c.workers + c.pg }

func (c cpuUse) minus(o cpuUse) cpuUse {
	return cpuUse{c.dispatcher - o.dispatcher, c.workers - o.workers, c.pg - o.pg}
}

// cpuSeconds is the CPU time used so far by the system under test: the dispatcher, every
// process under it (the workers), and the postmaster with every process under it.
func (b *bench) cpuSeconds() cpuUse {
	daemon, postmaster := -1, -1
	if b.daemon != nil && b.daemon.Process != nil {
		daemon = b.daemon.Process.Pid
	}
	if data, err := os.ReadFile(filepath.Join(b.pgDir, "data", "postmaster.pid")); err == nil {
		line, _, _ := strings.Cut(string(data), "\n")
		if pid, err := strconv.Atoi(strings.TrimSpace(line)); err == nil {
			postmaster = pid
		}
	}
	type proc struct {
		ppid  int
		ticks int64
	}
	procs := map[int]proc{}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		data, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ... utime stime: fields 4, 14, 15, counted after the comm.
		i := strings.LastIndexByte(string(data), ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(data[i+1:]))
		if len(f) < 13 {
			continue
		}
		ppid, _ := strconv.Atoi(f[1])
		ut, _ := strconv.ParseInt(f[11], 10, 64)
		st, _ := strconv.ParseInt(f[12], 10, 64)
		procs[pid] = proc{ppid, ut + st}
	}
	var use cpuUse
	for pid, p := range procs {
		secs := float64(p.ticks) / 100 // USER_HZ
		for q, seen := pid, 0; q > 1 && seen < 64; seen++ {
			if q == postmaster {
				use.pg += secs
				break
			}
			if q == daemon {
				if pid == daemon {
					use.dispatcher += secs
				} else {
					use.workers += secs
				}
				break
			}
			q = procs[q].ppid
		}
	}
	return use
}

// dispatchStats are the dispatcher's fan-in totals.
type dispatchStats struct{ flushes, flushMs, events int64 }

// statsAfter reads dispatch_stats once the dispatcher has flushed its statistics after t (it
// does within a second of going idle), or after 5 s whatever it holds.
func (b *bench) statsAfter(ctx context.Context, t time.Time) (dispatchStats, error) {
	var st dispatchStats
	deadline := time.Now().Add(5 * time.Second)
	for {
		var at time.Time
		if err := b.db.QueryRowContext(ctx, `SELECT fanin_flushes, fanin_flush_ms, fanin_events, updated_at FROM dispatch_stats`).
			Scan(&st.flushes, &st.flushMs, &st.events, &at); err != nil {
			return st, err
		}
		if at.After(t) || time.Now().After(deadline) {
			return st, nil
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// throughputRun runs n messages through the no-op stage 'child', plain or as the children of
// n/size groups (made in one transaction, so that they appear at once like the plain ones),
// and returns messages per second over the span of their commits, and the CPU time the system
// under test used meanwhile (PostgreSQL's processes, the dispatcher and its workers: less
// sensitive than throughput to other load on a shared machine). The groups' parents
// continue at 'parked', a stage with no program: the fan-in arm pays for the bookkeeping
// (inbox rows, flushes, wakes) but not for running the continuations, which is other work.
//
// cpu is the system's CPU time from before the enqueue (the fan-in arm's splits included),
// work from the enqueue's commit on: the processing alone, the bookkeeping's share of which is
// what the fan-in arm spends more.
func (b *bench) throughputRun(ctx context.Context, n, size int, grouped bool) (rate float64, cpu, work cpuUse, err error) {
	if *stmts > 0 {
		if _, err := b.db.ExecContext(ctx, `SELECT public.pg_stat_statements_reset()`); err != nil {
			return 0, cpu, work, fmt.Errorf("reset pg_stat_statements: %w", err)
		}
	}
	var stmtErr error
	cpu0 := b.cpuSeconds()
	var work0 cpuUse
	rate, err = b.throughputOnce(ctx, n, size, grouped, func() { work0 = b.cpuSeconds() }, func() {
		end := b.cpuSeconds()
		cpu, work = end.minus(cpu0), end.minus(work0)
		if *stmts > 0 {
			stmtErr = b.addStatements(ctx, grouped)
		}
	})
	if err == nil {
		err = stmtErr
	}
	return rate, cpu, work, err
}

// addStatements adds pg_stat_statements' counts since the last reset to an arm's.
func (b *bench) addStatements(ctx context.Context, grouped bool) error {
	arm := 0
	if grouped {
		arm = 1
	}
	if b.stmtArms[arm] == nil {
		b.stmtArms[arm] = map[string]stmtUse{}
	}
	rows, err := b.db.QueryContext(ctx, `SELECT query, calls, total_exec_time FROM public.pg_stat_statements`)
	if err != nil {
		return fmt.Errorf("read pg_stat_statements: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var q string
		var u stmtUse
		if err := rows.Scan(&q, &u.calls, &u.ms); err != nil {
			return fmt.Errorf("read pg_stat_statements: %w", err)
		}
		q = strings.Join(strings.Fields(q), " ")
		old := b.stmtArms[arm][q]
		b.stmtArms[arm][q] = stmtUse{old.calls + u.calls, old.ms + u.ms}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read pg_stat_statements: %w", err)
	}
	return nil
}

// reportStatements prints each arm's costliest statements per 1,000 messages.
func (b *bench) reportStatements(w io.Writer, messages int) {
	for arm, name := range []string{"plain", "fan-in"} {
		m := b.stmtArms[arm]
		qs := make([]string, 0, len(m))
		total := 0.0
		for q, u := range m {
			qs = append(qs, q)
			total += u.ms
		}
		slices.SortFunc(qs, func(a, b string) int { return cmp.Compare(m[b].ms, m[a].ms) })
		per := 1000 / float64(max(1, messages))
		fmt.Fprintf(w, "\n(c) %s arm, server time by statement (pg_stat_statements, nested counted twice), per 1,000 messages: %.1f ms\n", name, total*per)
		for _, q := range qs[:min(*stmts, len(qs))] {
			text := q
			if r := []rune(text); len(r) > 110 {
				text = string(r[:110]) + "…"
			}
			fmt.Fprintf(w, "  %7.2f ms %7.1f calls  %s\n", m[q].ms*per, float64(m[q].calls)*per, text)
		}
	}
}

// throughputOnce is throughputRun; enqueued is called when the messages are committed, done
// when they are processed, before the clean-up.
func (b *bench) throughputOnce(ctx context.Context, n, size int, grouped bool, enqueued, done func()) (float64, error) {
	var ids []int64 // the messages measured
	var parents []int64
	if grouped {
		tx, err := b.db.BeginTx(ctx, nil)
		if err != nil {
			return 0, err
		}
		// The parents are made 'running' at 'split' here, as the claim would; the split is
		// the SQL function a stage in any language calls.
		err = tx.QueryRowContext(ctx, `WITH p AS (INSERT INTO workqueue (stage, status, claim, claimed_at)
		        SELECT 'split', 'running', nextval('workqueue_claim_seq'), now() FROM generate_series(1, $1)
		        RETURNING workqueue_id)
		    SELECT array_agg(workqueue_id ORDER BY workqueue_id) FROM p`, n/size).Scan(pq.Array(&parents))
		if err == nil {
			_, err = tx.ExecContext(ctx, `SELECT fanout_split_range(p, 'split', 'parked', 'child', 1, $2::bigint, $2::int, 1)
			    FROM unnest($1::bigint[]) AS p`, pq.Array(parents), size)
		}
		if err == nil {
			err = tx.QueryRowContext(ctx, `SELECT array_agg(w.workqueue_id) FROM workqueue w
			    JOIN fanout f USING (fanout_id) WHERE f.parent_id = ANY ($1)`, pq.Array(parents)).Scan(pq.Array(&ids))
		}
		if err == nil {
			_, err = tx.ExecContext(ctx, analyzeInTx)
		}
		if err != nil {
			tx.Rollback()
			return 0, err
		}
		if err := tx.Commit(); err != nil {
			return 0, err
		}
		enqueued()
	} else {
		tx, err := b.db.BeginTx(ctx, nil)
		if err != nil {
			return 0, err
		}
		err = tx.QueryRowContext(ctx, `WITH i AS (INSERT INTO workqueue (stage)
		        SELECT 'child' FROM generate_series(1, $1) RETURNING workqueue_id)
		    SELECT array_agg(workqueue_id) FROM i`, n).Scan(pq.Array(&ids))
		if err == nil {
			_, err = tx.ExecContext(ctx, analyzeInTx)
		}
		if err != nil {
			tx.Rollback()
			return 0, err
		}
		if err := tx.Commit(); err != nil {
			return 0, err
		}
		enqueued()
	}
	if len(ids) != n {
		return 0, fmt.Errorf("made %d messages, want %d", len(ids), n)
	}
	// Cheap to ask (two probes of partial indexes), and not often: the window is measured
	// from the rows' commit timestamps, not by this wait.
	if err := b.waitEvery(100*time.Millisecond, 10*time.Minute, fmt.Sprintf("%d messages done", n), func() (bool, error) {
		var busy bool
		err := b.db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM workqueue WHERE status = 'pending' AND stage = 'child')
		    OR EXISTS (SELECT 1 FROM workqueue WHERE status = 'running')`).Scan(&busy)
		return !busy, err
	}); err != nil {
		return 0, err
	}
	var doneN int
	if err := b.db.QueryRowContext(ctx, `SELECT count(*) FROM workqueue WHERE workqueue_id = ANY ($1) AND status = 'done'`,
		pq.Array(ids)).Scan(&doneN); err != nil {
		return 0, err
	}
	if doneN != n {
		return 0, fmt.Errorf("%d of %d messages done when the stage went idle", doneN, n)
	}
	if grouped {
		if err := b.waitEvery(100*time.Millisecond, 5*time.Minute, "the groups' parents woken", func() (bool, error) {
			var woken int
			err := b.db.QueryRowContext(ctx, `SELECT count(*) FROM workqueue WHERE workqueue_id = ANY ($1)
			    AND stage = 'parked' AND status = 'pending'`, pq.Array(parents)).Scan(&woken)
			return woken == len(parents), err
		}); err != nil {
			return 0, err
		}
	}
	done()
	var span float64
	if err := b.db.QueryRowContext(ctx, `SELECT extract(epoch FROM max(pg_xact_commit_timestamp(xmin)) - min(pg_xact_commit_timestamp(xmin)))
	    FROM workqueue WHERE workqueue_id = ANY ($1)`, pq.Array(ids)).Scan(&span); err != nil {
		return 0, err
	}
	// Leave the next repetition the same table: delete this one's rows (children of fired
	// groups may go) and vacuum.
	all := append(ids, parents...)
	if _, err := b.db.ExecContext(ctx, `DELETE FROM workqueue WHERE workqueue_id = ANY ($1)`, pq.Array(all)); err != nil {
		return 0, err
	}
	for _, t := range []string{"workqueue", "fanout", "fanin_event", "fanin_wake_log"} {
		if _, err := b.db.ExecContext(ctx, "VACUUM "+t); err != nil {
			return 0, err
		}
	}
	return float64(n) / span, nil
}

// analyzeInTx refreshes the planner's statistics of workqueue inside the transaction that
// enqueues a repetition's rows (ANALYZE counts its own transaction's inserts as live), so both
// arms start with statistics that know about their 20,000 pending rows. Without it the claim
// is planned from the statistics of the emptied table (see the notes in the report).
const analyzeInTx = `ANALYZE workqueue`

// ---- the oracle at the end ----

// checkOracle checks §3.13's invariants once the daemon has stopped: nothing lost, nobody
// woken twice.
func (b *bench) checkOracle(ctx context.Context) error {
	checks := []struct{ what, q string }{
		{"inbox empty", `SELECT count(*) FROM fanin_event`},
		{"no group open", `SELECT count(*) FROM fanout WHERE state <> 'fired'`},
		{"one wake-log row per group", `SELECT count(*) FROM fanout f WHERE (SELECT count(*) FROM fanin_wake_log l WHERE l.fanout_id = f.fanout_id) <> 1`},
		{"no parent waiting", `SELECT count(*) FROM workqueue WHERE status = 'waiting'`},
		{"every continuation ran once", `SELECT count(*) FROM fanout f WHERE NOT EXISTS (SELECT 1 FROM bench_join j WHERE j.id = f.parent_id)
		    AND EXISTS (SELECT 1 FROM workqueue p WHERE p.workqueue_id = f.parent_id)`},
		{"no repair, no quarantine", `SELECT fanin_sweep_repaired + fanin_quarantined FROM dispatch_stats`},
	}
	for _, c := range checks {
		var n int
		if err := b.db.QueryRowContext(ctx, c.q).Scan(&n); err != nil {
			return fmt.Errorf("oracle %q: %w", c.what, err)
		}
		if n != 0 {
			return fmt.Errorf("oracle %q failed: %d", c.what, n)
		}
	}
	var events, flushes, flushMs, wakes, late int64
	if err := b.db.QueryRowContext(ctx, `SELECT fanin_events, fanin_flushes, fanin_flush_ms, fanin_wakes, fanin_late_events FROM dispatch_stats`).
		Scan(&events, &flushes, &flushMs, &wakes, &late); err != nil {
		return err
	}
	b.notes = append(b.notes, fmt.Sprintf("dispatcher totals: %d events in %d flushes (%.1f ms each on average, %d ms in all), %d wakes, %d late events; invariants hold",
		events, flushes, float64(flushMs)/math.Max(1, float64(flushes)), flushMs, wakes, late))
	return nil
}

// ---- report ----

func (b *bench) add(what, value, target, verdict string) {
	b.out = append(b.out, row{what, value, target, verdict})
}

// loadAvg is the 1-minute load average: the machine may be shared.
func loadAvg() string {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	return strings.Fields(string(data))[0]
}

func (b *bench) report() {
	b.notes = append(b.notes, "load average at the end "+loadAvg())
	w := bufio.NewWriter(os.Stdout)
	defer w.Flush()
	width := [3]int{}
	for _, r := range b.out {
		width[0] = max(width[0], len([]rune(r.what)))
		width[1] = max(width[1], len([]rune(r.value)))
		width[2] = max(width[2], len([]rune(r.target)))
	}
	pad := func(s string, n int) string { return s + strings.Repeat(" ", max(0, n-len([]rune(s)))) }
	fmt.Fprintln(w)
	fmt.Fprintln(w, "pepsi-dispatch fan-out / fan-in benchmark (issue 6)")
	for _, n := range b.notes {
		fmt.Fprintln(w, "  "+n)
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "%s  %s  %s  %s\n", pad("measure", width[0]), pad("result", width[1]), pad("target", width[2]), "")
	fmt.Fprintf(w, "%s  %s  %s  %s\n", strings.Repeat("-", width[0]), strings.Repeat("-", width[1]), strings.Repeat("-", width[2]), "----")
	for _, r := range b.out {
		fmt.Fprintf(w, "%s  %s  %s  %s\n", pad(r.what, width[0]), pad(r.value, width[1]), pad(r.target, width[2]), r.verdict)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Wake latency: from the commit of a group's last child to the commit of the flush that set its")
	fmt.Fprintln(w, "parent 'pending' (commit timestamps of the child's row and of the group's fanin_wake_log row).")
	fmt.Fprintln(w, "Throughput: messages over the span of their commits, same no-op stage, same run.")
	if *stmts > 0 && strings.Contains(*phases, "c") {
		b.reportStatements(w, *reps**tputN)
	}
}

// ---- small helpers ----

func verdict(ok bool) string {
	if ok {
		return "ok"
	}
	return "MISSED"
}

func ms(d time.Duration) string {
	switch {
	case d >= 10*time.Second:
		return fmt.Sprintf("%.1f s", d.Seconds())
	case d >= time.Second:
		return fmt.Sprintf("%.2f s", d.Seconds())
	default:
		return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond))
	}
}

func fractions(xs []float64) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = fmt.Sprintf("%.2f", x)
	}
	return strings.Join(parts, " ")
}

func rates(xs []float64) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = fmt.Sprintf("%.0f", x)
	}
	return "(" + strings.Join(parts, ", ") + ")"
}

// quantile is the nearest-rank quantile of xs (q = 1: the maximum).
func quantile(xs []time.Duration, q float64) time.Duration {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return s[max(0, min(i, len(s)-1))]
}

func medianDur(xs []time.Duration) time.Duration { return quantile(xs, 0.5) }

func medianF(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
