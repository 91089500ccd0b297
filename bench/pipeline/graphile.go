// graphile.go: Graphile Worker (Node.js) as a system under test: its Node project in
// ./graphile (package.json, package-lock.json, run.mjs; node_modules installed with `npm ci`
// when missing), its schema, and the SQL by which the benchmark enqueues, counts and watches
// its jobs. Only a run that measures it needs Node; the Go tests do not.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
)

// graphileJobs is Graphile Worker's job table (0.16 and later). A job is deleted when it
// completes; a job that failed max_attempts times stays, with attempts = max_attempts.
const graphileJobs = "graphile_worker._private_jobs"

// Graphile Worker's settings. Tuned: its performance page (worker.graphile.org/docs/performance)
// runs concurrentJobs 24, maxPoolSize 25, localQueue.size 500, completeJobBatchDelay 0 and
// failJobBatchDelay 0, several instances; the number of processes and the concurrency are
// what a sweep on this machine chose (graphileSweepNote, in the report's settings). Defaults: one process with
// Graphile Worker's defaults (concurrentJobs 1, no local queue, no batched completion).
const (
	graphileTunedProcesses   = 1
	graphileTunedConcurrency = 24
	graphileTunedLocalQueue  = 500
)

const (
	// The producer's backlog: one add_jobs call (Graphile's batch insert) of n job specs.
	graphileAddJobsSQL = `SELECT count(*) FROM graphile_worker.add_jobs(ARRAY(
	SELECT ROW('noop', json_build_object('msg', g, 'stage', 1, 'last', $3::int),
	           NULL, NULL, NULL, NULL, NULL, NULL)::graphile_worker.job_spec
	  FROM generate_series($1::bigint, $2::bigint) g))`
	graphileAddJobSQL = `SELECT graphile_worker.add_job('noop', json_build_object('msg', $1::bigint, 'stage', 1, 'last', $2::int))`
	// Waiting jobs through the partial index jobs_main_index; locked ones (no index of their
	// own) on the primary key's range of the run's rows.
	graphileCountsSQL = `SELECT (SELECT count(*) FROM graphile_worker._private_jobs WHERE is_available = true),
	       (SELECT count(*) FROM graphile_worker._private_jobs
	         WHERE id > $1 AND locked_at IS NOT NULL AND attempts < max_attempts)`
	// The jobs made since row base (the identity's last value) and those of them still there.
	graphileMadeLeftSQL = `SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence('graphile_worker._private_jobs', 'id')), 0) - $1,
	       (SELECT count(*) FROM graphile_worker._private_jobs WHERE id > $1)`
	// Done: the last stage's job deleted (completed), its deleting transaction committed.
	graphileDoneTrigger = `CREATE OR REPLACE FUNCTION bench_done_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_notify('bench_done', OLD.payload->>'msg'); RETURN NULL; END $$;
CREATE OR REPLACE TRIGGER bench_done AFTER DELETE ON graphile_worker._private_jobs FOR EACH ROW
  WHEN (OLD.payload->>'stage' = OLD.payload->>'last')
  EXECUTE FUNCTION bench_done_notify();`
	// W5's big table: what Graphile Worker keeps is failed jobs (completed ones are deleted),
	// so the table gets as many rows as pepsi's done and failed ones, all permanently failed.
	graphileBigTableSQL = `INSERT INTO graphile_worker._private_jobs
	       (task_id, payload, run_at, attempts, max_attempts, last_error, created_at, updated_at)
	SELECT (SELECT id FROM graphile_worker._private_tasks WHERE identifier = 'noop'),
	       json_build_object('msg', g, 'stage', 1, 'last', 1), now() - interval '2 hours', 25, 25,
	       'bench: synthetic failure', now() - interval '2 hours', now() - interval '1 hour'
	  FROM generate_series(1, $1::bigint) g`
)

// graphileEnv is the Node installation and the project, checked once per benchmark run.
type graphileEnv struct {
	once    sync.Once
	err     error
	dir     string // bench/pipeline/graphile
	node    string
	version string // "graphile-worker 0.18.0 on Node v20..."
}

func (b *bench) graphileDir() string { return filepath.Join(b.benchDir, "pipeline", "graphile") }

// ensureGraphile finds node and installs the project's dependencies (npm ci, from the lock
// file) when node_modules is missing.
func (b *bench) ensureGraphile(ctx context.Context) error {
	g := &b.graphile
	g.once.Do(func() {
		g.dir = b.graphileDir()
		if g.node, g.err = exec.LookPath("node"); g.err != nil {
			g.err = fmt.Errorf("graphile: Graphile Worker needs Node.js (Debian: apt-get install nodejs npm), or leave graphile out of -systems: %w", g.err)
			return
		}
		if !fileExists(filepath.Join(g.dir, "node_modules", "graphile-worker", "package.json")) {
			logf("installing Graphile Worker in %s (npm ci)", g.dir)
			npm := exec.CommandContext(ctx, "npm", "ci", "--no-audit", "--no-fund")
			npm.Dir = g.dir
			if out, err := npm.CombinedOutput(); err != nil {
				g.err = fmt.Errorf("npm ci in %s: %w\n%s", g.dir, err, out)
				return
			}
		}
		var pkg struct{ Version string }
		raw, err := os.ReadFile(filepath.Join(g.dir, "node_modules", "graphile-worker", "package.json"))
		if err == nil {
			err = json.Unmarshal(raw, &pkg)
		}
		if err != nil {
			g.err = fmt.Errorf("read graphile-worker's package.json: %w", err)
			return
		}
		nv, err := exec.CommandContext(ctx, g.node, "--version").Output()
		if err != nil {
			g.err = fmt.Errorf("node --version: %w", err)
			return
		}
		g.version = fmt.Sprintf("Graphile Worker %s on Node.js %s", pkg.Version, strings.TrimSpace(string(nv)))
	})
	return g.err
}

// setupGraphile installs Graphile Worker's schema (its own migrations, run by run.mjs) and its
// one task, so that W5's big table can name it.
func (b *bench) setupGraphile(ctx context.Context, s *system) error {
	if err := b.ensureGraphile(ctx); err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	mig := exec.CommandContext(cctx, b.graphile.node, "run.mjs", "migrate", "-dsn", s.dsn)
	mig.Dir = b.graphile.dir
	if out, err := mig.CombinedOutput(); err != nil {
		return fmt.Errorf("graphile-worker migrations on %s: %w\n%s", s.dbname, err, out)
	}
	_, err := s.pool.Exec(ctx, `INSERT INTO graphile_worker._private_tasks (identifier) VALUES ('noop')
		ON CONFLICT (identifier) DO NOTHING`)
	return err
}

// graphileCommand is the command line of one run of Graphile Worker: tuned (the performance
// page's batching, several processes) or with its defaults.
func (b *bench) graphileCommand(s *system, o startOpts) *exec.Cmd {
	args := []string{"run.mjs", "run", "-dsn", s.dsn}
	if s.name == "graphile" {
		args = append(args, "-config", "tuned", "-processes", strconv.Itoa(b.graphileProcesses),
			"-concurrency", strconv.Itoa(b.graphileConcurrency), "-local-queue", strconv.Itoa(b.graphileLocalQueue))
	} else {
		args = append(args, "-config", "default")
	}
	cmd := exec.Command(b.graphile.node, args...)
	cmd.Dir = b.graphile.dir
	return cmd
}

// loadGraphileBigTable fills the job table with n permanently failed jobs (W5).
func loadGraphileBigTable(ctx context.Context, s *system, n int64) error {
	if _, err := s.pool.Exec(ctx, graphileBigTableSQL, n); err != nil {
		return fmt.Errorf("load graphile's big table: %w", err)
	}
	return nil
}
