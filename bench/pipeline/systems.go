// systems.go: the systems under test, as the benchmark drives them: their database, how to
// enqueue, how to count what is left, and how to start and stop them.
package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"pepsi-dispatch/internal/schemafile"
)

const (
	kindPepsi    = "pepsi"
	kindRiver    = "river"
	kindRaw      = "raw"
	kindGraphile = "graphile"
	kindPgq      = "pgq"
)

type system struct {
	name   string // pepsi, river, river-default, graphile, graphile-default, pgq, raw
	kind   string // kindPepsi, kindRiver, kindRaw, kindGraphile, kindPgq
	label  string // for the report
	dbname string
	once   bool            // measured once per throughput workload: its rate is set by its defaults, not by noise
	only   map[string]bool // the workloads it runs (nil: all)
	dsn    string
	pool   *pgxpool.Pool
	probe  *pgxpool.Pool         // the observer's counts: index scans only (enable_seqscan = off)
	rc     *river.Client[pgx.Tx] // River: an insert-only client, the producer's

	// PgQ keeps no row per message: what was produced is counted here (the producer is one
	// goroutine at a time), what was consumed by the consumer in bench_pgq_progress.
	produced atomic.Int64
}

func (s *system) isRiver() bool { return s.kind == kindRiver }

// runs tells whether the system takes part in workload wl (PgQ: W1, W2 and W3 only).
func (s *system) runs(wl string) bool {
	if base, ok := pepsiVariants[wl]; ok {
		wl = base
	}
	return s.only == nil || s.only[wl]
}

// setupSystem creates the system's database and its schema, or shares those of a system of the
// same kind already set up on it.
func (b *bench) setupSystem(ctx context.Context, s *system) error {
	if o := b.dbs[s.dbname]; o != nil {
		if o.kind != s.kind && !(o.kind == kindPepsi && s.kind == kindRaw || o.kind == kindRaw && s.kind == kindPepsi) {
			return fmt.Errorf("database %s: %s and %s need different schemas", s.dbname, o.name, s.name)
		}
		s.dsn, s.pool, s.probe, s.rc = o.dsn, o.pool, o.probe, o.rc
		return nil
	}
	b.dbs[s.dbname] = s
	var err error
	s.pool, err = b.pg.createDB(ctx, s.dbname, 8)
	if err != nil {
		return err
	}
	s.dsn = b.pg.dsn(s.dbname)
	// The observer counts what is left through the partial (pepsi) or state-leading (River)
	// indexes: a sequential scan of the table on every poll would cost the system under test
	// a good share of a core, and more on W5's big table. And no JIT: a count that has to
	// scan (pepsi's rows in flight have no index) is costed at enable_seqscan's penalty, far
	// above jit_above_cost, and compiling it took 350-450 ms of the server's CPU inside each
	// W1 run's window (auto_explain: "JIT: Functions: 15, Inlining true").
	s.probe, err = newPool(ctx, s.dsn, 2, "enable_seqscan", "off", "jit", "off")
	if err != nil {
		return err
	}
	switch s.kind {
	case kindPepsi, kindRaw:
		schema, err := schemafile.Read(filepath.Join(b.root, "schema.sql")) // with its \ir includes
		if err != nil {
			return err
		}
		if err := execScript(ctx, s.pool, schema); err != nil {
			return fmt.Errorf("apply schema.sql to %s: %w", s.dbname, err)
		}
	case kindRiver:
		m, err := rivermigrate.New(riverpgxv5.New(s.pool), nil)
		if err != nil {
			return err
		}
		if _, err := m.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
			return fmt.Errorf("river migrations on %s: %w", s.dbname, err)
		}
		s.rc, err = river.NewClient(riverpgxv5.New(s.pool), &river.Config{})
		if err != nil {
			return err
		}
	case kindGraphile:
		return b.setupGraphile(ctx, s)
	case kindPgq:
		if err := setupPgq(ctx, s); err != nil {
			return err
		}
		b.res.pgqVersion = pgqVersion(ctx, s)
	}
	return nil
}

// table is the system's queue table.
func (s *system) table() string {
	switch s.kind {
	case kindRiver:
		return "river_job"
	case kindGraphile:
		return graphileJobs
	case kindPgq:
		return "bench_pgq_progress"
	}
	return "workqueue"
}

// reset empties the queue table (every workload but W5 starts from an empty table).
func (s *system) reset(ctx context.Context) error {
	if s.kind == kindPgq {
		return s.resetPgq(ctx)
	}
	q := "TRUNCATE " + s.table() + " RESTART IDENTITY"
	if _, err := s.pool.Exec(ctx, q); err != nil {
		return fmt.Errorf("%s: %w", q, err)
	}
	return s.vacuum(ctx)
}

func (s *system) vacuum(ctx context.Context) error {
	q := "VACUUM ANALYZE " + s.table()
	if _, err := s.pool.Exec(ctx, q); err != nil {
		return fmt.Errorf("%s: %w", q, err)
	}
	return nil
}

// deleteAbove removes the rows a W5 run added on top of the big table.
func (s *system) deleteAbove(ctx context.Context, base int64) error {
	q := "DELETE FROM workqueue WHERE workqueue_id > $1"
	switch s.kind {
	case kindRiver:
		q = "DELETE FROM river_job WHERE id > $1"
	case kindGraphile:
		q = "DELETE FROM " + graphileJobs + " WHERE id > $1"
	}
	if _, err := s.pool.Exec(ctx, q, base); err != nil {
		return fmt.Errorf("delete run rows: %w", err)
	}
	if s.kind == kindGraphile {
		// The run's jobs are counted from the identity's last value: start it again at base.
		if _, err := s.pool.Exec(ctx, `SELECT setval(pg_get_serial_sequence('graphile_worker._private_jobs', 'id'), $1)`, base); err != nil {
			return fmt.Errorf("restart the job ids: %w", err)
		}
	}
	return s.vacuum(ctx)
}

// maxID is the highest row id of the queue table.
func (s *system) maxID(ctx context.Context) (int64, error) {
	q := "SELECT coalesce(max(workqueue_id), 0) FROM workqueue"
	switch s.kind {
	case kindRiver:
		q = "SELECT coalesce(max(id), 0) FROM river_job"
	case kindGraphile:
		q = "SELECT coalesce(max(id), 0) FROM " + graphileJobs
	}
	var n int64
	err := s.pool.QueryRow(ctx, q).Scan(&n)
	return n, err
}

// enqueueBulk enqueues n messages of a pipeline of `stages` stages, numbered from first, as one
// transaction: one INSERT for pepsi and the raw loop, one InsertManyFastTx (COPY) for River.
//
// With analyze, the same transaction ANALYZEs the queue table (ANALYZE counts the
// transaction's own new rows), so that the backlog and fresh statistics become visible at the
// same commit: every system plans its first statements knowing the backlog. Without it, a
// backlog lands on statistics that say the queue is empty, and both pepsi's and River's batch
// statements can fall into nested-loop plans that read the whole backlog for every row (see the
// report's W5 plans): a real hazard, but a matter of when autovacuum last ran, not of the
// systems' throughput, and it made runs bimodal.
func (s *system) enqueueBulk(ctx context.Context, first, n int64, stages int, analyze bool) error {
	if n <= 0 {
		return nil
	}
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(context.Background()) // a no-op after Commit
	switch s.kind {
	case kindRiver:
		params := make([]river.InsertManyParams, n)
		for i := range params {
			params[i].Args = benchArgs{Msg: first + int64(i), Stage: 1, Last: stages}
		}
		_, err = s.rc.InsertManyFastTx(ctx, tx, params)
	case kindGraphile:
		_, err = tx.Exec(ctx, graphileAddJobsSQL, first, first+n-1, stages)
	case kindPgq:
		_, err = tx.Exec(ctx, pgqInsertManySQL, first, first+n-1)
	default:
		_, err = tx.Exec(ctx, `INSERT INTO workqueue (stage, payload)
			SELECT 's1', jsonb_build_object('msg', g) FROM generate_series($1::bigint, $2::bigint) g`,
			first, first+n-1)
	}
	if err != nil {
		return err
	}
	if analyze && s.kind != kindPgq {
		if _, err := tx.Exec(ctx, "ANALYZE "+s.table()); err != nil {
			return err
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	s.produced.Add(n)
	return nil
}

// enqueueOne enqueues one message and returns the key its done notification will carry: the
// workqueue_id for pepsi and the raw loop, msg for River (whose chain of jobs has new ids).
func (s *system) enqueueOne(ctx context.Context, msg int64, stages int) (int64, error) {
	var err error
	switch s.kind {
	case kindRiver:
		_, err = s.rc.Insert(ctx, benchArgs{Msg: msg, Stage: 1, Last: stages}, nil)
	case kindGraphile:
		_, err = s.pool.Exec(ctx, graphileAddJobSQL, msg, stages)
	case kindPgq:
		_, err = s.pool.Exec(ctx, pgqInsertSQL, msg)
		if err == nil {
			s.produced.Add(1)
		}
	default:
		var id int64
		err = s.pool.QueryRow(ctx, `INSERT INTO workqueue (stage, payload) VALUES ('s1', jsonb_build_object('msg', $1::bigint))
			RETURNING workqueue_id`, msg).Scan(&id)
		return id, err
	}
	return msg, err
}

// counts returns the messages waiting to be taken and those not finished yet (waiting or in
// flight). Both come from the partial/leading-state indexes (the probe session forbids
// sequential scans), so a count costs the index entries of what is left, not the table.
// base is the highest row id before the run (W5's big table; 0 otherwise): Graphile Worker
// has no index on a locked job, so its jobs in flight are counted on the primary key's range
// of the run's rows.
func (s *system) counts(ctx context.Context, base int64) (pending, open int64, err error) {
	// Pending rows are in two partial indexes: workqueue_pending, and workqueue_parked for
	// those waiting behind a concurrency key at its KEY_LIMIT. Running rows have no index
	// (schema.sql says why): they are counted on the primary key's range of the run's rows,
	// which is the whole table except on W5's. That is a scan, which is why the loops call
	// counts only near their end (W1, W5) or at the window's edges (W2, which polls pending).
	q := `SELECT ` + pepsiPendingSQL + `,
	             (SELECT count(*) FROM workqueue WHERE workqueue_id > $1 AND status = 'running')`
	args := []any{base}
	switch s.kind {
	case kindRiver:
		q = `SELECT (SELECT count(*) FROM river_job WHERE state = 'available'),
		            (SELECT count(*) FROM river_job WHERE state IN ('running', 'pending', 'scheduled', 'retryable'))`
		args = nil
	case kindGraphile:
		q = graphileCountsSQL
	case kindPgq:
		var consumed int64
		if err := s.probe.QueryRow(ctx, pgqConsumedSQL).Scan(&consumed); err != nil {
			return 0, 0, err
		}
		// PgQ cannot tell waiting events from those in a batch being read.
		left := s.produced.Load() - consumed
		return left, left, nil
	}
	var running int64
	err = s.probe.QueryRow(ctx, q, args...).Scan(&pending, &running)
	return pending, pending + running, err
}

// pepsiPendingSQL counts pepsi's (and the raw loop's) pending rows on their partial indexes.
const pepsiPendingSQL = `(SELECT (SELECT count(*) FROM workqueue WHERE status = 'pending' AND NOT key_parked) +
	        (SELECT count(*) FROM workqueue WHERE status = 'pending' AND key_parked))`

// pending returns the messages waiting to be taken: what W2 polls to keep its backlog topped
// up. For pepsi and the raw loop it is counts' first figure alone, which costs only the partial
// indexes' entries; the other systems' counts cost that much already.
func (s *system) pending(ctx context.Context) (int64, error) {
	if s.kind != kindPepsi && s.kind != kindRaw {
		pending, _, err := s.counts(ctx, 0)
		return pending, err
	}
	var n int64
	err := s.probe.QueryRow(ctx, `SELECT `+pepsiPendingSQL).Scan(&n)
	return n, err
}

// lastRow returns the id of the newest row, the last message of a backlog just enqueued; 0 when
// its completion cannot be read from one row (River's multi-stage chains make new rows).
func (s *system) lastRow(ctx context.Context, stages int) (int64, error) {
	if s.isRiver() && stages > 1 || s.kind == kindGraphile && stages > 1 || s.kind == kindPgq {
		return 0, nil
	}
	return s.maxID(ctx)
}

// rowFinished tells whether row id has finished (a primary-key lookup). Every system takes its
// backlog in id order, so the last row finishing means the end is at most a batch away.
func (s *system) rowFinished(ctx context.Context, id int64) (bool, error) {
	q := `SELECT status = 'done' FROM workqueue WHERE workqueue_id = $1`
	switch s.kind {
	case kindRiver:
		q = `SELECT state = 'completed' FROM river_job WHERE id = $1`
	case kindGraphile:
		// Graphile Worker deletes a job when it completes.
		q = `SELECT NOT EXISTS (SELECT FROM ` + graphileJobs + ` WHERE id = $1)`
	}
	var done bool
	err := s.probe.QueryRow(ctx, q, id).Scan(&done)
	return done, err
}

// finished counts the messages that completed their last stage (pepsi and River: on the whole
// table, W5's done rows included; Graphile Worker and PgQ: those of the run, above base).
func (s *system) finished(ctx context.Context, stages int, base int64) (int64, error) {
	q := `SELECT count(*) FROM workqueue WHERE status = 'done'`
	args := []any{}
	switch s.kind {
	case kindRiver:
		q = `SELECT count(*) FROM river_job WHERE state = 'completed' AND (args->>'stage')::int = $1`
		args = append(args, stages)
	case kindGraphile:
		// Completed jobs are deleted: with none of the run's left, all it made completed.
		var made, left int64
		if err := s.pool.QueryRow(ctx, graphileMadeLeftSQL, base).Scan(&made, &left); err != nil {
			return 0, err
		}
		if left > 0 {
			return 0, fmt.Errorf("%d of the run's jobs left (failed or unfinished)", left)
		}
		return made / int64(stages), nil
	case kindPgq:
		q = pgqConsumedSQL
	}
	var n int64
	err := s.pool.QueryRow(ctx, q, args...).Scan(&n)
	return n, err
}

// transitionsDone counts the transitions made by the messages above row base: for pepsi and
// the raw loop from each row's stage (s1..sN) and status, for River the completed jobs.
func (s *system) transitionsDone(ctx context.Context, stages int, base int64) (int64, error) {
	q := `SELECT coalesce(sum(CASE WHEN status = 'done' THEN $2 ELSE substr(stage, 2)::int - 1 END), 0)::bigint
	        FROM workqueue WHERE workqueue_id > $1`
	args := []any{base, stages}
	switch s.kind {
	case kindRiver:
		q = `SELECT count(*) FROM river_job WHERE state = 'completed' AND id > $1`
		args = args[:1]
	case kindGraphile:
		// Every job the run made (the identity's last value) that is gone has completed.
		var made, left int64
		err := s.pool.QueryRow(ctx, graphileMadeLeftSQL, base).Scan(&made, &left)
		return made - left, err
	case kindPgq:
		q, args = pgqConsumedSQL, nil
	}
	var n int64
	err := s.pool.QueryRow(ctx, q, args...).Scan(&n)
	return n, err
}

// installDoneTrigger makes every message that finishes its last stage send NOTIFY bench_done
// with its key, delivered when that transaction commits: the benchmark's view of "done" is the
// moment the outcome is durable and visible, for every system alike.
func (s *system) installDoneTrigger(ctx context.Context) error {
	var q string
	switch {
	case s.kind == kindPgq:
		return nil // the consumer notifies at each batch's commit (pgq.go)
	case s.kind == kindGraphile:
		q = graphileDoneTrigger
	case s.isRiver():
		q = `CREATE OR REPLACE FUNCTION bench_done_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_notify('bench_done', NEW.args->>'msg'); RETURN NULL; END $$;
CREATE OR REPLACE TRIGGER bench_done AFTER UPDATE OF state ON river_job FOR EACH ROW
  WHEN (NEW.state = 'completed' AND OLD.state <> 'completed' AND NEW.args->>'stage' = NEW.args->>'last')
  EXECUTE FUNCTION bench_done_notify();`
	default:
		q = `CREATE OR REPLACE FUNCTION bench_done_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_notify('bench_done', NEW.workqueue_id::text); RETURN NULL; END $$;
CREATE OR REPLACE TRIGGER bench_done AFTER UPDATE OF status ON workqueue FOR EACH ROW
  WHEN (NEW.status = 'done' AND OLD.status <> 'done')
  EXECUTE FUNCTION bench_done_notify();`
	}
	return execScript(ctx, s.pool, q)
}

func (s *system) dropDoneTrigger(ctx context.Context) error {
	if s.kind == kindPgq {
		return nil
	}
	_, err := s.pool.Exec(ctx, "DROP TRIGGER IF EXISTS bench_done ON "+s.table())
	return err
}

// readPepsiStamps reads state.t0 that the stage program writes in latency runs.
func (s *system) readPepsiStamps(ctx context.Context) (map[int64]int64, error) {
	rows, err := s.pool.Query(ctx, `SELECT workqueue_id, (state->>'t0')::bigint FROM workqueue WHERE state ? 't0'`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[int64]int64{}
	for rows.Next() {
		var k, v int64
		if err := rows.Scan(&k, &v); err != nil {
			return nil, err
		}
		out[k] = v
	}
	return out, rows.Err()
}

// sutProc is a running system under test: pepsi-dispatch, or `pipeline sut ...`.
type sutProc struct {
	sys       *system
	cmd       *exec.Cmd
	pid       int
	logPath   string
	stampPath string
	exited    chan struct{}
	waitErr   error
	stopped   bool
	leftover  int            // sessions still busy after the system stopped
	console   *consoleClient // pepsi-console: the client on its web console
}

// startOpts says how to start a system for one run.
type startOpts struct {
	stages  int  // 1 or 3
	stamp   bool // record first-stage start times (latency workloads)
	fuse    bool // pepsi: FUSE = yes on every stage after the first (W4f)
	wide    bool // pepsi: the whole worker budget on every stage (W4w), not divided
	tag     string
	console string // pepsi-console: METRICS_LISTEN, set by startSUT
}

// startSUT starts the system and waits until it is ready to work.
func (b *bench) startSUT(ctx context.Context, s *system, o startOpts) (*sutProc, error) {
	p := &sutProc{sys: s, exited: make(chan struct{})}
	base := filepath.Join(b.tmp, "logs", fmt.Sprintf("%s-%s", s.name, o.tag))
	p.logPath = base + ".log"
	logf, err := os.Create(p.logPath)
	if err != nil {
		return nil, err
	}
	defer logf.Close() // the child has its own copy
	var ready func() error
	switch s.kind {
	case kindPepsi:
		if s.name == consoleSystem {
			if o.console, err = consoleAddr(); err != nil {
				return nil, err
			}
		}
		conf, err := b.writePepsiConf(s, o)
		if err != nil {
			return nil, err
		}
		p.cmd = exec.Command(filepath.Join(b.bin, "pepsi-dispatch"), "-c", conf, "serve")
		p.cmd.Env = append(os.Environ(), b.pepsiEnv...)
		if o.stamp {
			p.cmd.Env = append(p.cmd.Env, "BENCH_STAMP=1")
			if b.traceLatency {
				// The dispatcher's and the workers' garbage collections, timestamped by the log.
				p.cmd.Env = append(p.cmd.Env, "GODEBUG=gctrace=1")
			}
		}
		p.cmd.Dir = b.tmp
		p.cmd.Stderr = logf
		ready = func() error { return b.waitPepsiReady(ctx, p) }
	case kindGraphile:
		p.cmd = b.graphileCommand(s, o)
		if o.stamp {
			p.stampPath = base + ".stamps"
			p.cmd.Args = append(p.cmd.Args, "-stamp", p.stampPath)
		}
		if ready, err = readyLine(ctx, p, logf); err != nil {
			return nil, err
		}
	default:
		args := []string{"sut", s.name, "-dsn", s.dsn, "-stages", strconv.Itoa(o.stages),
			"-raw-workers", strconv.Itoa(b.rawWorkers), "-raw-batch", strconv.Itoa(b.rawBatch)}
		if o.stamp {
			p.stampPath = base + ".stamps"
			args = append(args, "-stamp", p.stampPath)
		}
		p.cmd = exec.Command(b.self, args...)
		p.cmd.Dir = b.tmp
		if ready, err = readyLine(ctx, p, logf); err != nil {
			return nil, err
		}
	}
	// A process group of its own: a Ctrl-C at the terminal reaches only the benchmark, which
	// stops the system in order.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", s.name, err)
	}
	p.pid = p.cmd.Process.Pid
	b.track(p)
	go func() {
		p.waitErr = p.cmd.Wait()
		close(p.exited)
	}()
	if err := ready(); err != nil {
		p.stop()
		return nil, err
	}
	if o.console != "" {
		p.console = startConsoleClient(o.console)
	}
	return p, nil
}

// readyLine connects the system's stderr to its log and waits, in the function it returns, for
// the line "ready" on its stdout (then keeps draining stdout, so that the child never blocks).
func readyLine(ctx context.Context, p *sutProc, logf *os.File) (func() error, error) {
	p.cmd.Stderr = logf
	out, err := p.cmd.StdoutPipe()
	if err != nil {
		return nil, fmt.Errorf("%s: stdout: %w", p.sys.name, err)
	}
	line := make(chan string, 1)
	go func() {
		r := bufio.NewReader(out)
		l, _ := r.ReadString('\n')
		line <- strings.TrimSpace(l)
		for {
			if _, err := r.ReadString('\n'); err != nil {
				return
			}
		}
	}()
	return func() error {
		select {
		case l := <-line:
			if l != "ready" {
				return fmt.Errorf("%s did not start (said %q); see %s", p.sys.name, l, p.logPath)
			}
			return nil
		case <-time.After(60 * time.Second):
			return fmt.Errorf("%s not ready after 60 s; see %s", p.sys.name, p.logPath)
		case <-ctx.Done():
			return ctx.Err()
		}
	}, nil
}

// stop ends the system: SIGTERM, then SIGKILL to its process group after 20 s. Then it ends
// the sessions the system left running in its database (a statement the server is still
// executing for a client that has gone): they would hold row locks and CPU into the next run.
func (p *sutProc) stop() error {
	if p.stopped {
		return p.waitErr
	}
	p.stopped = true
	defer p.endSessions()
	if p.console != nil {
		p.console.stop()
	}
	select {
	case <-p.exited:
		return fmt.Errorf("%s had exited: %v (see %s)", p.sys.name, p.waitErr, p.logPath)
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
		return p.waitErr
	case <-time.After(20 * time.Second):
		logf("%s did not stop within 20 s: killing its process group", p.sys.name)
		_ = syscall.Kill(-p.pid, syscall.SIGKILL)
		<-p.exited
		return errors.New("killed after 20 s")
	}
}

func (p *sutProc) endSessions() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var n int64
	err := p.sys.pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
		  AND application_name <> 'bench' AND state <> 'idle'`).Scan(&n)
	if err != nil {
		logf("  %s: end leftover sessions: %v", p.sys.name, err)
	} else if n > 0 {
		logf("  %s: ended %d session(s) still running a statement after the system stopped", p.sys.name, n)
		p.leftover = int(n)
	}
}

// alive reports whether the process still runs.
func (p *sutProc) alive() bool {
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

// readStamps returns the first-stage start times recorded in this run (after stop).
func (p *sutProc) readStamps(ctx context.Context) (map[int64]int64, error) {
	if p.sys.kind == kindPepsi {
		return p.sys.readPepsiStamps(ctx)
	}
	f, err := os.Open(p.stampPath)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[int64]int64{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), " ")
		if !ok {
			continue
		}
		kk, err1 := strconv.ParseInt(k, 10, 64)
		vv, err2 := strconv.ParseInt(v, 10, 64)
		if err1 == nil && err2 == nil {
			out[kk] = vv
		}
	}
	return out, sc.Err()
}

// pepsi's settings, for 2 cores (see the report for why). pepsiWorkers is the number of
// worker processes in all, like River's and the raw loop's fixed concurrency: a pipeline of
// several stages divides it among them (stageParallelism).
const (
	pepsiWorkers     = 4
	pepsiQueueLimit  = 1000
	pepsiMaxMessages = 1000000
)

// writePepsiConf writes the dispatcher's INI for one run, world-readable: the dispatcher drops
// to USER (nobody) when started as root, and its workers read the same file.
func (b *bench) writePepsiConf(s *system, o startOpts) (string, error) {
	var w strings.Builder
	fmt.Fprintf(&w, "[database]\nDSN = %s\n\n[pepsi-dispatch]\n", s.dsn)
	if os.Geteuid() == 0 {
		w.WriteString("USER = nobody\n")
	}
	if o.console != "" {
		fmt.Fprintf(&w, "METRICS_LISTEN = %s\n", o.console)
	}
	conf := filepath.Join(b.tmp, fmt.Sprintf("pepsi-%s.conf", o.tag))
	fmt.Fprintf(&w, "CONFIG_FILE = %s\n", conf)
	par := stageParallelism(b.pepsiWorkers, o)
	for i := 1; i <= o.stages; i++ {
		next := ""
		if i < o.stages {
			next = fmt.Sprintf("s%d", i+1)
		}
		fmt.Fprintf(&w, "\n[stage-s%d]\nPROGRAM = %s\nNEXT = %s\nPARALLELISM = %d\nQUEUE_LIMIT = %d\nMAX_MESSAGES = %d\n",
			i, b.stageProgram(s), next, par[i-1], b.pepsiQueueLimit, b.pepsiMaxMessages)
		if o.fuse && i > 1 {
			w.WriteString("FUSE = yes\n")
		}
	}
	if err := os.WriteFile(conf, []byte(w.String()), 0o644); err != nil {
		return "", err
	}
	return conf, os.Chmod(conf, 0o644)
}

// stageParallelism divides a budget of workers among the stages of one run, the first stages
// taking the remainder (4 over 3 stages: 2, 1, 1; 8: 3, 3, 2), so that pepsi runs as many worker processes
// and has as many messages in flight in W4 as in W1, as River and the raw loop keep theirs.
// Fused stages (W4f) are run inside the first stage's workers and get no messages of their
// own: the first stage takes the whole budget and they keep one worker each, never started.
// o.wide gives every stage the whole budget (W4w: three times the processes; not a target).
func stageParallelism(workers int, o startOpts) []int {
	par := make([]int, o.stages)
	for i := range par {
		switch {
		case o.wide:
			par[i] = workers
		case o.fuse:
			par[i] = 1
			if i == 0 {
				par[i] = workers
			}
		case workers < o.stages:
			par[i] = 1 // a stage needs one worker to run at all
		default:
			par[i] = workers / o.stages
			if i < workers%o.stages {
				par[i]++
			}
		}
	}
	return par
}

// waitPepsiReady waits until this dispatcher holds its system's lock (dispatch_instance names
// its pid) and has its sessions open.
func (b *bench) waitPepsiReady(ctx context.Context, p *sutProc) error {
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		if !p.alive() {
			return fmt.Errorf("pepsi-dispatch exited at start-up: %v; see %s", p.waitErr, p.logPath)
		}
		var pid *int64
		var sessions int64
		err := p.sys.pool.QueryRow(ctx, `SELECT (SELECT pid FROM dispatch_instance WHERE id = 1),
			(SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name LIKE 'pepsi-%')`).
			Scan(&pid, &sessions)
		if err != nil {
			return err
		}
		if pid != nil && int(*pid) == p.pid && sessions > 0 {
			// Leave it a moment to LISTEN; its first claim would find a backlog anyway.
			time.Sleep(300 * time.Millisecond)
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("pepsi-dispatch not ready after 30 s; see %s", p.logPath)
}
