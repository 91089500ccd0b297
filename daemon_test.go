// daemon_test.go: running the real daemon and real worker processes from tests.
//
// The daemon is this test binary re-executed with PEPSI_TEST_DAEMON (so it is built with the
// race detector when the tests are); workers are a copy of it in a world-readable directory,
// because a daemon started as root (CI) drops to the account `nobody` before it starts them.
// Which worker program runs is chosen by PEPSI_TEST_WORKER, inherited through the daemon.

package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"pepsi-dispatch/internal/pgtest"
	"pepsi-dispatch/stage"
)

// workerBin returns the path of the copy of the test binary that workers run.
var workerBin = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "pepsi-test-bin-")
	if err != nil {
		return "", err
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return "", err
	}
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	src, err := os.Open(self)
	if err != nil {
		return "", err
	}
	defer src.Close()
	path := filepath.Join(dir, "pepsi-test-worker")
	dst, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		return "", err
	}
	if _, err := io.Copy(dst, src); err != nil {
		dst.Close()
		return "", err
	}
	return path, dst.Close()
})

func testWorkerBin(t testing.TB) string {
	t.Helper()
	p, err := workerBin()
	if err != nil {
		t.Fatalf("copy test binary for workers: %v", err)
	}
	return p
}

// syncBuffer is the daemon's stderr, shared by its copier and the test.
type syncBuffer = pgtest.SyncBuffer

// daemon is one running pepsi-dispatch process.
type daemon struct {
	t      testing.TB
	cmd    *exec.Cmd
	log    *syncBuffer
	done   chan struct{}
	status int    // exit status, valid after done
	conf   string // the configuration file's path: a test may write it again and send SIGHUP
}

// testDir returns a fresh world-readable directory for config files: a daemon started as
// root re-reads its file on reload after dropping to `nobody`. (t.TempDir's parent is 0700.)
func testDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "pepsi-test-conf-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// baseConf returns a configuration for s with fast timers; stages are appended by the caller.
func baseConf(s *testSchema, extra string) string {
	return fmt.Sprintf(`# written by a test
[database]
DSN = %s

[pepsi-dispatch]
USER = nobody
WORKER_IDLE_TIMEOUT = 2
POLL_INTERVAL = 1
STATS_INTERVAL = 60
SHUTDOWN_GRACE = 5
%s
`, s.DSN, extra)
}

// newTestRole creates a login role for s's tests, dropped at the end, with settings
// ("name = 'value'") as an operator's ALTER ROLE … SET gives them; confAs points a
// configuration at it.
func newTestRole(t testing.TB, s *testSchema, prefix string, settings ...string) string {
	t.Helper()
	role := prefix + "_" + s.Name
	s.exec(t, `CREATE ROLE `+role+` LOGIN SUPERUSER`)
	t.Cleanup(func() { s.DB.Exec(`DROP ROLE IF EXISTS ` + role) })
	for _, set := range settings {
		s.exec(t, `ALTER ROLE `+role+` SET `+set)
	}
	return role
}

// confAs returns conf (of baseConf(s, …)) with its DSN connecting as role.
func confAs(conf string, s *testSchema, role string) string {
	return strings.Replace(conf, "DSN = "+s.DSN, "DSN = "+s.DSN+" user="+role, 1)
}

// stageConf returns a [stage-NAME] section run by the test worker.
func stageConf(t testing.TB, name, next, extra string) string {
	return fmt.Sprintf("[stage-%s]\nPROGRAM = %s\nNEXT = %s\n%s\n", name, testWorkerBin(t), next, extra)
}

// startDaemon starts `pepsi-dispatch -c conf -v serve` with worker program `worker`.
func startDaemon(t testing.TB, conf, worker string, env ...string) *daemon {
	t.Helper()
	return startDaemonWrapped(t, nil, conf, worker, env...)
}

// startDaemonWrapped is startDaemon with the daemon's command line run by wrap (a network
// namespace's ip netns exec, which execs it: the process is the daemon's).
func startDaemonWrapped(t testing.TB, wrap func(argv ...string) []string, conf, worker string, env ...string) *daemon {
	t.Helper()
	path := writeFile(t, testDir(t), "pepsi.conf", conf)
	argv := []string{os.Args[0], "-c", path, "-v", "serve"}
	if wrap != nil {
		argv = wrap(argv...)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), "PEPSI_TEST_DAEMON=1", "PEPSI_TEST_WORKER="+worker)
	cmd.Env = append(cmd.Env, env...)
	d := &daemon{t: t, cmd: cmd, log: &syncBuffer{}, done: make(chan struct{}), conf: path}
	cmd.Stdout, cmd.Stderr = d.log, d.log
	if err := cmd.Start(); err != nil {
		t.Fatalf("start daemon: %v", err)
	}
	go func() {
		err := cmd.Wait()
		var ee *exec.ExitError
		switch {
		case err == nil:
		case errors.As(err, &ee):
			d.status = ee.ExitCode()
			if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
				d.status = 128 + int(ws.Signal())
			}
		default:
			d.status = -1
		}
		close(d.done)
	}()
	t.Cleanup(func() {
		select {
		case <-d.done:
		default:
			cmd.Process.Kill()
			<-d.done
		}
		if t.Failed() {
			t.Logf("daemon log:\n%s", d.log.String())
		}
	})
	return d
}

// wait waits for the daemon to exit and returns its status.
func (d *daemon) wait(timeout time.Duration) int {
	d.t.Helper()
	select {
	case <-d.done:
		return d.status
	case <-time.After(timeout):
		d.t.Fatalf("daemon did not exit within %v", timeout)
		return -1
	}
}

// stop sends SIGTERM and expects a clean exit.
func (d *daemon) stop() {
	d.t.Helper()
	d.cmd.Process.Signal(syscall.SIGTERM)
	if st := d.wait(30 * time.Second); st != 0 {
		d.t.Fatalf("daemon exited with status %d after SIGTERM, want 0", st)
	}
}

// waitLog waits until the daemon's log contains s.
func (d *daemon) waitLog(s string, timeout time.Duration) {
	d.t.Helper()
	waitFor(d.t, timeout, fmt.Sprintf("daemon log line %q", s), func() bool {
		return strings.Contains(d.log.String(), s)
	})
}

// ---- test worker programs ----

// runsDDL records every run of a stage handler, in the handler's own transaction, so that
// "each (message, stage) ran exactly once" can be checked from the table.
const runsDDL = `CREATE TABLE IF NOT EXISTS runs (
    id bigint NOT NULL, stage text NOT NULL, pid int NOT NULL, batch int NOT NULL DEFAULT 1, uid int,
    at timestamptz NOT NULL DEFAULT clock_timestamp())`

// behaviour is what a message's payload asks of the test pipeline worker.
type behaviour struct {
	SleepMs int    `json:"sleep_ms"` // work this long
	FailAt  string `json:"fail_at"`  // return an error at this stage (while attempts < FailN)
	FailN   int    `json:"fail_n"`   // how many attempts fail at FailAt (0 = all)
	CrashAt string `json:"crash_at"` // exit the process mid-message at this stage
	// CrashWarm: exit mid-message at this stage, but only in a worker that has handled more
	// than 8 messages, two batches of a QUEUE_LIMIT of 4 (so it answered some: a crash, not a
	// program that cannot start, which holds the stage); in a fresh one, go on as if not asked.
	CrashWarm string `json:"crash_warm"`
	HangAt    string `json:"hang_at"` // never answer at this stage
	// HoldAt: at this stage, the first attempt writes its own row in the outcome's transaction
	// and then waits in a statement that does not end (pg_sleep): MAX_RUNTIME kills the worker.
	// Its session, busy in the statement, keeps the row's lock until the statement is
	// cancelled, or, with HoldChecked (the handler sets client_connection_check_interval, as
	// pepsi-worker(7) advises for long statements), until the server sees the worker gone.
	HoldAt      string `json:"hold_at"`
	HoldChecked bool   `json:"hold_checked"`
	DeferAt     string `json:"defer_at"`  // defer once at this stage, for DeferMs
	DeferMs     int    `json:"defer_ms"`  //
	Branch      string `json:"branch"`    // advance to this NEXT stage instead of the first
	DoneAtMe    string `json:"done_here"` // finish at this stage even if it has a NEXT
	// NoRun: record no run, leaving m.Tx alone, so that the outcome is kept and written by
	// the batch's one outcome statement after the transaction (stage/batch.go).
	NoRun bool `json:"no_run"`
	// FillDiskAt: at this stage, run a query whose function scan spills more rows to temporary
	// files than a small disk holds (work_mem at its least), so that the server fails it for a
	// full disk (53100) and frees its files as it fails (TestDiskFilledByItsMessage).
	FillDiskAt string `json:"fill_disk_at"`
}

// pipelineWorker is the SDK stage used by most tests: it records the run, then advances to
// the first NEXT stage, or finishes at a final stage, as the payload's behaviour allows.
func pipelineWorker() int {
	cfg, err := stage.LoadConfig(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	handled := 0 // messages this process has handled before this one
	h := func(ctx context.Context, m *stage.Message) error {
		handled++
		var b behaviour
		if len(m.Payload) > 0 {
			if err := json.Unmarshal(m.Payload, &b); err != nil {
				return fmt.Errorf("decode payload: %w", err)
			}
		}
		if b.CrashWarm == m.Stage && handled > 8 {
			os.Exit(3)
		}
		if b.SleepMs > 0 {
			time.Sleep(time.Duration(b.SleepMs) * time.Millisecond)
		}
		switch m.Stage {
		case b.CrashAt:
			os.Exit(3)
		case b.HangAt:
			select {}
		case b.HoldAt:
			if m.Attempts == 0 {
				if _, err := m.Tx.ExecContext(ctx, `UPDATE workqueue SET state = state || '{"progress": 1}' WHERE workqueue_id = $1`, m.ID); err != nil {
					return fmt.Errorf("write progress: %w", err)
				}
				if b.HoldChecked {
					if _, err := m.Tx.ExecContext(ctx, `SET LOCAL client_connection_check_interval = '1s'`); err != nil {
						return fmt.Errorf("turn the connection check on: %w", err)
					}
				}
				_, err := m.Tx.ExecContext(ctx, `SELECT pg_sleep(3600)`)
				return fmt.Errorf("the held statement ended: %v", err)
			}
		case b.FillDiskAt:
			if _, err := m.Tx.ExecContext(ctx, `SET LOCAL work_mem = '64kB'`); err != nil {
				return fmt.Errorf("set work_mem: %w", err)
			}
			var n int64
			if err := m.Tx.QueryRowContext(ctx, `SELECT count(*) FROM generate_series(1, 1000000000)`).Scan(&n); err != nil {
				return fmt.Errorf("fill the disk: %w", err)
			}
		case b.FailAt:
			if b.FailN == 0 || m.Attempts < b.FailN {
				return fmt.Errorf("asked to fail at %s (attempt %d)", m.Stage, m.Attempts+1)
			}
		}
		if !b.NoRun {
			if _, err := m.Tx.ExecContext(ctx, `INSERT INTO runs (id, stage, pid, uid) VALUES ($1, $2, $3, $4)`,
				m.ID, m.Stage, os.Getpid(), os.Getuid()); err != nil {
				return fmt.Errorf("record run: %w", err)
			}
		}
		if b.DeferAt == m.Stage && m.State["deferred"] == nil {
			m.State["deferred"] = true
			return m.Defer(time.Now().Add(time.Duration(b.DeferMs) * time.Millisecond))
		}
		next := cfg.Next
		switch {
		case b.DoneAtMe == m.Stage || len(next) == 0:
			return m.Done()
		case b.Branch != "" && strings.Contains(" "+strings.Join(next, " ")+" ", " "+b.Branch+" "):
			return m.Advance(b.Branch)
		default:
			return m.Advance(next[0])
		}
	}
	if err := stage.Serve(context.Background(), cfg, os.Stdin, os.Stdout, h); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// batchWorker is a raw (SDK-less) stage that shows pipelining: after the first id it keeps
// reading for a moment and records how many ids it had before answering any, then finishes
// them all with one guarded UPDATE each.
func batchWorker() int {
	db, err := sql.Open("postgres", os.Getenv("PEPSI_DSN"))
	if err != nil {
		return 2
	}
	defer db.Close()
	st := os.Getenv("PEPSI_STAGE")
	var buf []byte
	chunk := make([]byte, 4096)
	for {
		n, err := os.Stdin.Read(chunk)
		buf = append(buf, chunk[:n]...)
		if err != nil {
			return 0
		}
		if !bytes.HasSuffix(buf, []byte("\n")) {
			continue
		}
		ids := strings.Fields(string(buf))
		buf = buf[:0]
		for _, id := range ids {
			if _, err := db.Exec(`INSERT INTO runs (id, stage, pid, batch) VALUES ($1, $2, $3, $4)`,
				id, st, os.Getpid(), len(ids)); err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
			if _, err := db.Exec(`UPDATE workqueue SET status = 'done' WHERE workqueue_id = $1 AND status = 'running' AND stage = $2`, id, st); err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
		}
		var out []byte
		for range ids {
			out = append(out, "0\n"...)
		}
		os.Stdout.Write(out)
	}
}

func init() {
	testWorkers["pipeline"] = pipelineWorker
	testWorkers["batch"] = batchWorker
}
