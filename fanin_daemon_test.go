// fanin_daemon_test.go: fan-out / fan-in through the real daemon (doc/design/fanin.md §3.13).
//
// The SQL layer has its own tests (fanin_sql_test.go); these run pepsi-dispatch itself, with
// real worker processes built on the stage SDK, and check at quiescence, with the same oracle
// (checkFaninInvariants), that every parent was woken exactly once and its continuation ran
// once with the right counts — also when the dispatcher is SIGKILLed at each point between a
// child's commit and its parent's claim (PEPSI_FAILPOINT), when a split stage crashes before
// or after its commit, when evidence is lost and the sweep repairs it, across a reload and a
// restart, and across a SIGTERM.
//
// The test pipeline (the "fanin" worker) is three stages:
//
//	split  splits its message into N children at 'child' (Split), or a range into slices
//	       (SplitRange), continuing at 'join'; N = 0 advances it to 'join' directly
//	child  records its run in fanin_runs in its own transaction and finishes (Done), or
//	       fails, or loses its own completion evidence, as the payload asks
//	join   reads FaninResult and records (parent, done_n, failed_n, failed list) in fanin_joins
//
// Every child gets its parent's payload; what it does depends on its fanout_seq.

package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/lib/pq"

	"pepsi-dispatch/stage"
)

// faninDaemonDDL is the tables the fanin worker writes (in the test's schema).
const faninDaemonDDL = `
CREATE TABLE fanin_splits (id bigint NOT NULL, attempts int NOT NULL, pid int NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE fanin_runs (id bigint NOT NULL, fanout_id bigint NOT NULL, seq int NOT NULL,
    pid int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE fanin_joins (id bigint NOT NULL, fanout_id bigint, done_n int NOT NULL,
    failed_n int NOT NULL, failed jsonb NOT NULL, no_group boolean NOT NULL, pid int NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE fanin_once (id bigint NOT NULL, what text NOT NULL, PRIMARY KEY (id, what));`

// faninBehaviour is what a split message's payload asks of the fanin worker; its children get
// the same payload and act on the fields that name their fanout_seq.
type faninBehaviour struct {
	N           int     `json:"n"`            // split: number of children (Split)
	Range       []int64 `json:"range"`        // split: [lo, hi] for SplitRange instead
	MaxChildren int     `json:"max_children"` // SplitRange's RangeOpts
	MinSpan     int64   `json:"min_span"`

	SplitCrashBefore bool `json:"split_crash_before"` // split: exit before the commit (once)
	SplitCrashAfter  bool `json:"split_crash_after"`  // split: exit after the commit, before the status line (once)

	SleepMs   int   `json:"sleep_ms"`   // child: work this long
	Barrier   int64 `json:"barrier"`    // child: wait for this advisory lock (shared) before finishing
	FailSeqs  []int `json:"fail_seqs"`  // child: these seqs always fail (to exhaust MAX_ATTEMPTS)
	LoseSeqs  []int `json:"lose_seqs"`  // child: these seqs delete their own inbox row (lost evidence)
	CrashSeqs []int `json:"crash_seqs"` // child: these seqs exit after the commit, before the status line (once)
}

// faninOut is the worker's standard output. A handler that wants to die after its batch has
// committed but before the dispatcher reads its status line sets crash: the SDK commits the
// batch and then writes the status lines here, so exiting in Write is exactly that point.
type faninOut struct{ crash atomic.Bool }

func (o *faninOut) Write(p []byte) (int, error) {
	if o.crash.Load() {
		os.Exit(4)
	}
	return os.Stdout.Write(p)
}

// faninWorker is the test pipeline's stage program (PEPSI_TEST_WORKER=fanin).
func faninWorker() int {
	cfg, err := stage.LoadConfig(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	out := &faninOut{}
	// once records (id, what) on a connection of its own, committed at once: true the first
	// time only, so a crash asked for is not repeated by the retry or the re-run.
	var side *sql.DB
	var sideOnce sync.Once
	once := func(ctx context.Context, id int64, what string) bool {
		sideOnce.Do(func() { side, _ = sql.Open("postgres", cfg.DSN) })
		res, err := side.ExecContext(ctx, `INSERT INTO fanin_once (id, what) VALUES ($1, $2) ON CONFLICT DO NOTHING`, id, what)
		if err != nil {
			fmt.Fprintln(os.Stderr, "once:", err)
			os.Exit(5)
		}
		n, _ := res.RowsAffected()
		return n == 1
	}
	h := func(ctx context.Context, m *stage.Message) error {
		var b faninBehaviour
		if len(m.Payload) > 0 {
			if err := json.Unmarshal(m.Payload, &b); err != nil {
				return fmt.Errorf("decode payload: %w", err)
			}
		}
		switch m.Stage {
		case "split":
			return faninSplitStage(ctx, m, b, out, once)
		case "child":
			return faninChildStage(ctx, m, b, out, once)
		case "join":
			return faninJoinStage(ctx, m)
		}
		return fmt.Errorf("fanin worker: unknown stage %q", m.Stage)
	}
	if err := stage.Serve(context.Background(), cfg, os.Stdin, out, h); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

func faninSplitStage(ctx context.Context, m *stage.Message, b faninBehaviour, out *faninOut,
	once func(context.Context, int64, string) bool) error {
	if _, err := m.Tx.ExecContext(ctx, `INSERT INTO fanin_splits (id, attempts, pid) VALUES ($1, $2, $3)`,
		m.ID, m.Attempts, os.Getpid()); err != nil {
		return err
	}
	var err error
	if len(b.Range) == 2 {
		err = m.SplitRange(ctx, "join", "child", b.Range[0], b.Range[1],
			stage.RangeOpts{MaxChildren: b.MaxChildren, MinSpan: b.MinSpan, Payload: m.Payload})
	} else {
		payloads := make([]json.RawMessage, b.N)
		for i := range payloads {
			payloads[i] = m.Payload
		}
		err = m.Split(ctx, "join", "child", payloads)
	}
	if err != nil {
		return err
	}
	if b.SplitCrashBefore && once(ctx, m.ID, "split-crash-before") {
		os.Exit(3) // the split's transaction is open: it rolls back
	}
	if b.SplitCrashAfter && once(ctx, m.ID, "split-crash-after") {
		out.crash.Store(true)
	}
	return nil
}

func faninChildStage(ctx context.Context, m *stage.Message, b faninBehaviour, out *faninOut,
	once func(context.Context, int64, string) bool) error {
	var fid int64
	var seq int
	if err := m.Tx.QueryRowContext(ctx, `SELECT fanout_id, fanout_seq FROM workqueue WHERE workqueue_id = $1`,
		m.ID).Scan(&fid, &seq); err != nil {
		return fmt.Errorf("read own row: %w", err)
	}
	if b.SleepMs > 0 {
		time.Sleep(time.Duration(b.SleepMs) * time.Millisecond)
	}
	if b.Barrier != 0 {
		if _, err := m.Tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock_shared($1)`, b.Barrier); err != nil {
			return err
		}
	}
	if slices.Contains(b.FailSeqs, seq) {
		return fmt.Errorf("asked to fail (seq %d, attempt %d)", seq, m.Attempts+1)
	}
	if _, err := m.Tx.ExecContext(ctx, `INSERT INTO fanin_runs (id, fanout_id, seq, pid) VALUES ($1, $2, $3, $4)`,
		m.ID, fid, seq, os.Getpid()); err != nil {
		return err
	}
	if err := m.Done(); err != nil {
		return err
	}
	if slices.Contains(b.LoseSeqs, seq) {
		// The trigger wrote this child's inbox row in this transaction; deleting it here
		// commits the child's 'done' with no evidence at all: only the sweep can see it.
		if _, err := m.Tx.ExecContext(ctx, `DELETE FROM fanin_event WHERE child_id = $1`, m.ID); err != nil {
			return err
		}
	}
	if slices.Contains(b.CrashSeqs, seq) && once(ctx, m.ID, "child-crash-after") {
		out.crash.Store(true)
	}
	return nil
}

// faninFailed is one failed child as the join stage records it.
type faninFailed struct {
	Seq   int    `json:"seq"`
	Lo    *int64 `json:"lo"`
	Hi    *int64 `json:"hi"`
	Error string `json:"error"`
}

func faninJoinStage(ctx context.Context, m *stage.Message) error {
	done, failed, children, err := m.FaninResult(ctx)
	noGroup := errors.Is(err, stage.ErrNotParent)
	if err != nil && !noGroup {
		return err
	}
	list := []faninFailed{}
	for _, c := range children {
		list = append(list, faninFailed{Seq: c.Seq, Lo: c.RangeLo, Hi: c.RangeHi, Error: c.Error})
	}
	js, err := json.Marshal(list)
	if err != nil {
		return err
	}
	if _, err := m.Tx.ExecContext(ctx, `INSERT INTO fanin_joins (id, fanout_id, done_n, failed_n, failed, no_group, pid)
	    SELECT $1, wait_fanout_id, $2, $3, $4::jsonb, $5, $6 FROM workqueue WHERE workqueue_id = $1`,
		m.ID, done, failed, string(js), noGroup, os.Getpid()); err != nil {
		return err
	}
	return m.Done()
}

func init() { testWorkers["fanin"] = faninWorker }

// ---- harness ----

// faninSetup makes a schema with the fanin worker's tables.
func faninSetup(t *testing.T) *testSchema {
	t.Helper()
	s := newTestSchema(t)
	s.exec(t, faninDaemonDDL)
	return s
}

// faninConf is the three-stage fan-in pipeline; dispatch adds [pepsi-dispatch] keys, child
// replaces the child stage's options.
func faninConf(t *testing.T, s *testSchema, dispatch, child string) string {
	if child == "" {
		child = "PARALLELISM = 2\nQUEUE_LIMIT = 32"
	}
	// Workers live through the whole test: a crash test's crash must hit a worker that has
	// answered before (a fresh one that dies is taken for a program that cannot start).
	base := strings.Replace(baseConf(s, dispatch), "WORKER_IDLE_TIMEOUT = 2", "WORKER_IDLE_TIMEOUT = 120", 1)
	return base +
		stageConf(t, "split", "join", "PARALLELISM = 1\nQUEUE_LIMIT = 4\nRETRY_DELAY = 0.05") +
		stageConf(t, "child", "", child) +
		stageConf(t, "join", "", "PARALLELISM = 1\nQUEUE_LIMIT = 16")
}

// faninParents enqueues one split message per payload, in one statement, and returns their ids.
func faninParents(t *testing.T, s *testSchema, payloads ...string) []int64 {
	t.Helper()
	var ids []int64
	if err := s.DB.QueryRow(`WITH i AS (INSERT INTO workqueue (stage, payload)
	        SELECT 'split', p::jsonb FROM unnest($1::text[]) WITH ORDINALITY AS u(p, k) ORDER BY k
	        RETURNING workqueue_id)
	    SELECT array_agg(workqueue_id ORDER BY workqueue_id) FROM i`, pq.Array(payloads)).Scan(pq.Array(&ids)); err != nil {
		t.Fatal(err)
	}
	return ids
}

// faninJoined counts the parents among ids whose continuation has run (and committed).
func faninJoined(t *testing.T, s *testSchema, ids []int64) int {
	return s.count(t, `SELECT count(DISTINCT id) FROM fanin_joins WHERE id = ANY ($1)`, pq.Array(ids))
}

// faninWaitJoined waits until every parent of ids is done at 'join' and the inbox is empty.
func faninWaitJoined(t *testing.T, s *testSchema, ids []int64, timeout time.Duration) {
	t.Helper()
	waitFor(t, timeout, fmt.Sprintf("%d parents joined", len(ids)), func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = ANY ($1)
		    AND stage = 'join' AND status = 'done'`, pq.Array(ids)) == len(ids)
	})
	waitFor(t, timeout, "the inbox empty", func() bool {
		return s.count(t, `SELECT count(*) FROM fanin_event`) == 0
	})
}

// faninJoin is one row of fanin_joins.
type faninJoin struct {
	fanout        sql.NullInt64
	done, failed  int
	failedList    []faninFailed
	noGroup       bool
	runs          int // how many times the continuation ran (committed)
	wakeLog       int // wake-log rows of the parent's group
	groups        int // groups of the parent
	parentAttempt int
	parentError   string
}

func faninJoinOf(t *testing.T, s *testSchema, id int64) faninJoin {
	t.Helper()
	var j faninJoin
	var list []byte
	var reason sql.NullString
	err := s.DB.QueryRow(`SELECT j.fanout_id, j.done_n, j.failed_n, j.failed, j.no_group,
	        (SELECT count(*) FROM fanin_joins WHERE id = $1),
	        (SELECT count(*) FROM fanin_wake_log WHERE parent_id = $1),
	        (SELECT count(*) FROM fanout WHERE parent_id = $1),
	        w.attempts, w.state->>'dispatch_error'
	   FROM fanin_joins j JOIN workqueue w ON w.workqueue_id = j.id
	  WHERE j.id = $1 ORDER BY j.at LIMIT 1`, id).Scan(&j.fanout, &j.done, &j.failed, &list, &j.noGroup,
		&j.runs, &j.wakeLog, &j.groups, &j.parentAttempt, &reason)
	if err != nil {
		t.Fatalf("join of parent %d: %v", id, err)
	}
	j.parentError = reason.String
	if err := json.Unmarshal(list, &j.failedList); err != nil {
		t.Fatal(err)
	}
	return j
}

// faninExpectJoin checks that parent id was woken once and its continuation ran once, seeing
// done and failed children.
func faninExpectJoin(t *testing.T, s *testSchema, id int64, done, failed int) faninJoin {
	t.Helper()
	j := faninJoinOf(t, s, id)
	if j.runs != 1 {
		t.Errorf("parent %d: continuation ran %d times, want once", id, j.runs)
	}
	if j.noGroup || j.groups != 1 || j.wakeLog != 1 {
		t.Errorf("parent %d: no_group %v, %d groups, %d wake-log rows; want one group woken once",
			id, j.noGroup, j.groups, j.wakeLog)
	}
	if j.done != done || j.failed != failed {
		t.Errorf("parent %d: continuation saw %d done / %d failed, want %d / %d", id, j.done, j.failed, done, failed)
	}
	return j
}

// faninCheckQuiescent is the oracle at quiescence: the invariants of §3.13, one wake-log row
// per fired group and no group left open, no child that ran twice, every child terminal.
func faninCheckQuiescent(t *testing.T, s *testSchema) {
	t.Helper()
	checkFaninInvariants(t, s)
	if n := s.count(t, `SELECT count(*) FROM fanout WHERE state <> 'fired'`); n != 0 {
		t.Errorf("%d groups not fired at quiescence", n)
	}
	if n := s.count(t, `SELECT count(*) FROM fanout f WHERE (SELECT count(*) FROM fanin_wake_log l
	        WHERE l.fanout_id = f.fanout_id) <> 1`); n != 0 {
		t.Errorf("%d groups without exactly one wake-log row", n)
	}
	if n := s.count(t, `SELECT count(*) FROM (SELECT id FROM fanin_runs GROUP BY id HAVING count(*) > 1) x`); n != 0 {
		t.Errorf("%d children ran (committed) more than once", n)
	}
	if n := s.count(t, `SELECT count(*) FROM (SELECT id FROM fanin_joins GROUP BY id HAVING count(*) > 1) x`); n != 0 {
		t.Errorf("%d continuations ran more than once", n)
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE fanout_id IS NOT NULL AND status NOT IN ('done', 'failed')`); n != 0 {
		t.Errorf("%d children not terminal at quiescence", n)
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE status IN ('running', 'waiting')`); n != 0 {
		t.Errorf("%d rows still running or waiting at quiescence", n)
	}
}

// faninWarmUp runs a one-child split through the three stages, so that their workers have
// answered once (a worker that dies before its first answer is taken for a program that
// cannot start, and its stage is held instead of its message failed).
func faninWarmUp(t *testing.T, s *testSchema) int64 {
	t.Helper()
	ids := faninParents(t, s, `{"n": 1}`)
	faninWaitJoined(t, s, ids, 60*time.Second)
	return ids[0]
}

// faninStart starts the daemon with the fanin worker. With PEPSI_TEST_FANIN_LOGS set to a
// directory, every daemon's log is kept there (to look for warnings in passing runs).
func faninStart(t *testing.T, conf, worker string, env ...string) *daemon {
	t.Helper()
	d := startDaemon(t, conf, worker, env...)
	if dir := os.Getenv("PEPSI_TEST_FANIN_LOGS"); dir != "" {
		t.Cleanup(func() {
			name := fmt.Sprintf("%s/%s-%d.log", dir, strings.ReplaceAll(t.Name(), "/", "_"), d.cmd.Process.Pid)
			os.WriteFile(name, []byte(d.log.String()), 0o644)
		})
	}
	return d
}

// faninKill SIGKILLs the daemon and waits for it to go.
func faninKill(t *testing.T, d *daemon) {
	t.Helper()
	d.cmd.Process.Signal(syscall.SIGKILL)
	if st := d.wait(30 * time.Second); st != 137 {
		t.Fatalf("daemon exited with %d after SIGKILL, want 137", st)
	}
}

// faninStat reads one dispatch_stats column.
func faninStat(t *testing.T, s *testSchema, col string) int {
	return s.count(t, `SELECT `+col+` FROM dispatch_stats`)
}

// ---- T1, T2, T3: the ordinary paths ----

// TestFaninDaemonEndToEnd (T1, T2): groups of 1, 3 and 1000 children (Split and SplitRange)
// and empty splits, through the real daemon: one wake each, the continuation runs once with
// the right counts, every child runs once; an empty split goes straight to its continuation.
func TestFaninDaemonEndToEnd(t *testing.T) {
	s := faninSetup(t)
	d := faninStart(t, faninConf(t, s, "", "PARALLELISM = 2\nQUEUE_LIMIT = 64\nMAX_MESSAGES = 100000"), "fanin")
	ids := faninParents(t, s,
		`{"n": 1}`, `{"n": 3}`, `{"n": 1000}`,
		`{"range": [1, 3000], "max_children": 3, "min_span": 1}`,
		`{"range": [-500, 499499], "max_children": 1000, "min_span": 500}`,
		`{"n": 0}`, `{"range": [10, 9]}`)
	faninWaitJoined(t, s, ids, 120*time.Second)
	want := []int{1, 3, 1000, 3, 1000}
	for i, n := range want {
		faninExpectJoin(t, s, ids[i], n, 0)
		if r := s.count(t, `SELECT count(*) FROM fanin_runs r JOIN fanout f USING (fanout_id) WHERE f.parent_id = $1`, ids[i]); r != n {
			t.Errorf("parent %d: %d child runs, want %d", ids[i], r, n)
		}
	}
	// The range split's slices cover [lo, hi] exactly.
	if bad := s.count(t, `SELECT count(*) FROM (SELECT range_lo, range_hi,
	        lag(range_hi) OVER (ORDER BY fanout_seq) AS prev, fanout_seq
	        FROM workqueue w JOIN fanout f USING (fanout_id) WHERE f.parent_id = $1) x
	      WHERE (fanout_seq = 0 AND range_lo <> -500) OR (fanout_seq > 0 AND range_lo <> prev)
	         OR (fanout_seq = 999 AND range_hi <> 499500)`, ids[4]); bad != 0 {
		t.Errorf("range children do not cover [-500, 499499] exactly: %d bad slices", bad)
	}
	for _, id := range ids[5:] {
		j := faninJoinOf(t, s, id)
		if !j.noGroup || j.groups != 0 || j.wakeLog != 0 || j.runs != 1 {
			t.Errorf("empty split %d: no_group %v, %d groups, %d wake-log rows, %d continuation runs; want a direct advance",
				id, j.noGroup, j.groups, j.wakeLog, j.runs)
		}
	}
	faninCheckQuiescent(t, s)
	d.stop()
	if w := faninStat(t, s, "fanin_wakes"); w != 5 {
		t.Errorf("dispatch_stats.fanin_wakes = %d, want 5", w)
	}
	if e, c := faninStat(t, s, "fanin_events"), s.count(t, `SELECT count(*) FROM workqueue WHERE fanout_id IS NOT NULL`); e != c {
		// The test stage writes in each child's transaction, so each outcome is a statement
		// of its own, and each inbox row one child's.
		t.Errorf("dispatch_stats.fanin_events = %d, want one per child (%d)", e, c)
	}
	for _, col := range []string{"fanin_late_events", "fanin_sweep_repaired", "fanin_quarantined"} {
		if n := faninStat(t, s, col); n != 0 {
			t.Errorf("dispatch_stats.%s = %d, want 0", col, n)
		}
	}
}

// TestFaninDaemonFlushFails: while the flush statement fails (here: its function is renamed
// away), the evidence stays in the inbox, the parent waits, and the dispatcher says so and
// goes on dispatching; once the flush works again, the parent is woken once.
func TestFaninDaemonFlushFails(t *testing.T) {
	s := faninSetup(t)
	d := faninStart(t, faninConf(t, s, "", "PARALLELISM = 2\nQUEUE_LIMIT = 8"), "fanin")
	faninWarmUp(t, s)
	s.exec(t, `ALTER FUNCTION fanin_flush(int, boolean, bigint[], bigint[]) RENAME TO fanin_flush_away`)
	ids := faninParents(t, s, `{"n": 3}`)
	waitFor(t, 30*time.Second, "the three children done", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue w JOIN fanout f USING (fanout_id)
		    WHERE f.parent_id = $1 AND w.status = 'done'`, ids[0]) == 3
	})
	d.waitLog("fan-in flush failed", 30*time.Second)
	if _, status := faninRowStatus(t, s, ids[0]); status != "waiting" {
		t.Fatalf("parent %s while the flush fails, want waiting", status)
	}
	// Plain work goes on meanwhile.
	plain := faninParents(t, s, `{"n": 0}`)
	waitFor(t, 30*time.Second, "an empty split continued while the flush fails", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1 AND stage = 'join' AND status = 'done'`, plain[0]) == 1
	})
	if n := s.count(t, `SELECT count(*) FROM fanin_event`); n == 0 {
		t.Fatal("the inbox is empty while the flush fails")
	}
	s.exec(t, `ALTER FUNCTION fanin_flush_away(int, boolean, bigint[], bigint[]) RENAME TO fanin_flush`)
	faninWaitJoined(t, s, ids, 30*time.Second)
	d.waitLog("fan-in flush works again", 30*time.Second)
	faninExpectJoin(t, s, ids[0], 3, 0)
	faninCheckQuiescent(t, s)
	d.stop()
}

// TestFaninDaemonWakeRefused: an application's trigger refuses to let one parent wake (its
// payload says "nowake"). Its children run and end; the dispatcher's flush leaves that group's
// evidence in the inbox, says so once and shows it on /metrics and the console's overview,
// tries it again every second, and wakes the other parents meanwhile; once the trigger is
// gone, the parent is woken and its continuation runs, once. Before, the flush failed whole at
// every try, and no parent of any group was woken while the refusal lasted.
func TestFaninDaemonWakeRefused(t *testing.T) {
	s := faninSetup(t)
	addr := freePort(t)
	d := faninStart(t, faninConf(t, s, "METRICS_LISTEN = "+addr, ""), "fanin")
	faninWarmUp(t, s)
	refusals, drop := appRefuses(t, s, "status",
		`OLD.status = 'waiting' AND NEW.status = 'pending' AND OLD.payload ? 'nowake'`)
	refused := faninParents(t, s, `{"n": 3, "nowake": true}`)
	waitFor(t, 30*time.Second, "the refused parent's three children done", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue w JOIN fanout f USING (fanout_id)
		    WHERE f.parent_id = $1 AND w.status = 'done'`, refused[0]) == 3
	})
	const said = "fan-in: the database refused to apply these groups' completions"
	d.waitLog(said, 30*time.Second)
	ids := faninParents(t, s, `{"n": 4}`, `{"n": 1}`)
	waitFor(t, 30*time.Second, "2 other parents joined while the refused group waits", func() bool {
		return faninJoined(t, s, ids) == 2
	})
	waitFor(t, 5*time.Second, "pepsi_fanin_refused_groups 1 on /metrics", func() bool {
		v, ok := metric(t, addr, "pepsi_fanin_refused_groups")
		return ok && v == 1
	})
	if page := consoleOverview(t, addr); !strings.Contains(page, "the wake of the parents of <b>1</b> fan-in group (they stay waiting)") {
		t.Errorf("the console's overview does not show the refused group:\n%s", page)
	}
	// Each try is refused twice (its statement's batch, then the group alone): two tries more.
	first := refusals()
	waitFor(t, 10*time.Second, "the refused group tried again", func() bool { return refusals() >= first+4 })
	if n := strings.Count(d.log.String(), said); n != 1 {
		t.Errorf("the refusal was said %d times, want once:\n%s", n, d.log.String())
	}
	if _, st := faninRowStatus(t, s, refused[0]); st != "waiting" {
		t.Fatalf("the refused parent is %s, want waiting", st)
	}
	if n := s.count(t, `SELECT count(*) FROM fanin_event e JOIN fanout f USING (fanout_id) WHERE f.parent_id = $1`, refused[0]); n == 0 {
		t.Fatal("the refused group's evidence is gone from the inbox")
	}

	drop()
	faninWaitJoined(t, s, refused, 30*time.Second)
	faninExpectJoin(t, s, refused[0], 3, 0)
	waitShownGone(t, addr, "pepsi_fanin_refused_groups", "refused")
	faninCheckQuiescent(t, s)
	d.stop()
}

// TestFaninDaemonMixedOutcomes (T3): some children exhaust MAX_ATTEMPTS and fail; the parent
// is woken once all are terminal, and its continuation reads the counts and exactly the
// failed children, with their slices and the dispatcher's reason.
func TestFaninDaemonMixedOutcomes(t *testing.T) {
	s := faninSetup(t)
	d := faninStart(t, faninConf(t, s, "", "PARALLELISM = 2\nQUEUE_LIMIT = 8\nMAX_ATTEMPTS = 2\nRETRY_DELAY = 0.05"), "fanin")
	ids := faninParents(t, s,
		`{"n": 6, "fail_seqs": [1, 4]}`,
		`{"range": [1, 6000], "max_children": 10, "min_span": 1000, "fail_seqs": [0, 5]}`,
		`{"n": 2, "fail_seqs": [0, 1]}`)
	faninWaitJoined(t, s, ids, 60*time.Second)
	checkList := func(j faninJoin, seqs []int, bounds [][2]int64) {
		t.Helper()
		if len(j.failedList) != len(seqs) {
			t.Fatalf("failed list %+v, want seqs %v", j.failedList, seqs)
		}
		for i, f := range j.failedList {
			if f.Seq != seqs[i] || !strings.Contains(f.Error, fmt.Sprintf("stage child: status 1: asked to fail (seq %d, attempt 2)", f.Seq)) {
				t.Errorf("failed child %d: %+v, want seq %d failed at its second attempt", i, f, seqs[i])
			}
			if bounds != nil && (f.Lo == nil || f.Hi == nil || *f.Lo != bounds[i][0] || *f.Hi != bounds[i][1]) {
				t.Errorf("failed child seq %d: slice %v..%v, want [%d, %d)", f.Seq, f.Lo, f.Hi, bounds[i][0], bounds[i][1])
			}
		}
	}
	checkList(faninExpectJoin(t, s, ids[0], 4, 2), []int{1, 4}, nil)
	checkList(faninExpectJoin(t, s, ids[1], 4, 2), []int{0, 5}, [][2]int64{{1, 1001}, {5001, 6001}})
	checkList(faninExpectJoin(t, s, ids[2], 0, 2), []int{0, 1}, nil)
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE fanout_id IS NOT NULL AND status = 'failed' AND attempts <> 2`); n != 0 {
		t.Errorf("%d failed children without MAX_ATTEMPTS = 2 attempts", n)
	}
	faninCheckQuiescent(t, s)
	d.stop()
	if w := faninStat(t, s, "fanin_wakes"); w != 3 {
		t.Errorf("dispatch_stats.fanin_wakes = %d, want 3", w)
	}
}

// ---- T5, T6: crashes between a child's commit and its parent's claim ----

// faninCrashPayloads are the groups of the crash tests: several sizes, so that some flushes
// complete groups and others do not.
var faninCrashPayloads = []string{`{"n": 3}`, `{"n": 3}`, `{"n": 40, "sleep_ms": 4}`, `{"n": 120, "sleep_ms": 4}`}

func faninCrashWant(t *testing.T, s *testSchema, ids []int64) {
	t.Helper()
	for i, id := range ids {
		var b faninBehaviour
		json.Unmarshal([]byte(faninCrashPayloads[i%len(faninCrashPayloads)]), &b)
		faninExpectJoin(t, s, id, b.N, 0)
	}
	faninCheckQuiescent(t, s)
	if n := s.count(t, `SELECT count(*) FROM workqueue w JOIN fanout f USING (fanout_id)
	        WHERE f.parent_id = ANY ($1)
	          AND NOT EXISTS (SELECT 1 FROM fanin_runs r WHERE r.id = w.workqueue_id)`, pq.Array(ids)); n != 0 {
		t.Errorf("%d done children have no committed run", n)
	}
}

// TestFaninDaemonSigkillWithChildren (T6 a): SIGKILL of the dispatcher while children are
// being processed, with completion evidence waiting in the inbox (hints coalesce for a long
// time in the first run): after a restart, one wake per group.
func TestFaninDaemonSigkillWithChildren(t *testing.T) {
	s := faninSetup(t)
	slow := faninConf(t, s, "FANIN_MAX_DELAY = 60\nFANIN_MIN_HINTS = 100000", "PARALLELISM = 2\nQUEUE_LIMIT = 8")
	d := faninStart(t, slow, "fanin")
	ids := faninParents(t, s, faninCrashPayloads...)
	waitFor(t, 60*time.Second, "children running and evidence waiting", func() bool {
		return s.count(t, `SELECT count(*) FROM fanin_runs`) >= 60 && s.count(t, `SELECT count(*) FROM fanin_event`) > 0
	})
	faninKill(t, d)
	if n := s.count(t, `SELECT count(*) FROM fanin_event`); n == 0 {
		t.Fatal("no evidence waiting in the inbox after the kill: the scenario did not happen")
	}
	d2 := faninStart(t, faninConf(t, s, "", "PARALLELISM = 2\nQUEUE_LIMIT = 8"), "fanin")
	faninWaitJoined(t, s, ids, 90*time.Second)
	faninCrashWant(t, s, ids)
	d2.stop()
}

// TestFaninDaemonChildCommitThenCrash (T5): a child commits 'done' and its worker dies before
// the status line. The dispatcher's failure write must leave the row alone (guard), the child
// counts once, and after a dispatcher restart the parent is woken once.
func TestFaninDaemonChildCommitThenCrash(t *testing.T) {
	s := faninSetup(t)
	conf := faninConf(t, s, "", "PARALLELISM = 1\nQUEUE_LIMIT = 1\nRETRY_DELAY = 0.05")
	d := faninStart(t, conf, "fanin")
	faninWarmUp(t, s)
	ids := faninParents(t, s, `{"n": 4, "crash_seqs": [0, 2]}`)
	// The first crash is seen (its head's failure write skipped); restart the dispatcher.
	d.waitLog("worker crashed; its head message fails", 60*time.Second)
	d.stop()
	d2 := faninStart(t, conf, "fanin")
	faninWaitJoined(t, s, ids, 60*time.Second)
	faninExpectJoin(t, s, ids[0], 4, 0)
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE fanout_id IS NOT NULL
	        AND (attempts <> 0 OR state ? 'dispatch_error')`); n != 0 {
		t.Errorf("%d children whose committed 'done' was charged a failure", n)
	}
	if n := s.count(t, `SELECT count(*) FROM fanin_once WHERE what = 'child-crash-after'`); n != 2 {
		t.Errorf("%d children crashed after their commit, want 2", n)
	}
	faninCheckQuiescent(t, s)
	d2.stop()
	// Both runs stopped cleanly, so their statistics add up: one event per child (the four
	// and the warm-up's one), none late.
	if e := faninStat(t, s, "fanin_events"); e != 5 {
		t.Errorf("dispatch_stats.fanin_events = %d over both runs, want 5 (one per child)", e)
	}
	if n := faninStat(t, s, "fanin_late_events") + faninStat(t, s, "fanin_quarantined"); n != 0 {
		t.Errorf("late or quarantined events: %d", n)
	}
}

// faninFailpointRun starts the daemon with PEPSI_FAILPOINT=fp and waits for it to hit it.
func faninFailpointRun(t *testing.T, conf, fp string) *daemon {
	t.Helper()
	d := faninStart(t, conf, "fanin", "PEPSI_FAILPOINT="+fp)
	if st := d.wait(90 * time.Second); st != 137 {
		t.Fatalf("daemon with PEPSI_FAILPOINT=%s exited with %d, want 137\n%s", fp, st, d.log.String())
	}
	if !strings.Contains(d.log.String(), "failpoint "+fp) {
		t.Fatalf("daemon exited 137 but not at failpoint %s", fp)
	}
	return d
}

// TestFaninDaemonFailpointFlushBeforeCommit (T6 b): the dispatcher dies inside a flush that
// fires groups, after its DELETE of the inbox rows and its wakes, before COMMIT. The evidence is
// intact; the next start applies it.
//
// The point is fanin-flush-fired-before-commit, not fanin-flush-before-commit: whether the
// first flush that consumes events also completes a group depends on how many children have
// reported by then, which a loaded machine decides (the first flush then held no complete
// group, and "the scenario did not happen"). Earlier flushes commit; the first that fires dies.
func TestFaninDaemonFailpointFlushBeforeCommit(t *testing.T) {
	s := faninSetup(t)
	conf := faninConf(t, s, "", "PARALLELISM = 1\nQUEUE_LIMIT = 64")
	ids := faninParents(t, s, faninCrashPayloads...)
	faninFailpointRun(t, conf, "fanin-flush-fired-before-commit")
	if n := s.count(t, `SELECT count(*) FROM fanin_wake_log`); n != 0 {
		t.Errorf("%d wake-log rows after a flush that did not commit", n)
	}
	if n := s.count(t, `SELECT count(*) FROM fanin_event`); n == 0 {
		t.Error("the uncommitted flush's events are gone")
	}
	// The flush that died would have fired groups: all their children are terminal.
	if n := s.count(t, `SELECT count(*) FROM fanout f WHERE f.state = 'open' AND f.expected_n =
	        (SELECT count(*) FROM workqueue w WHERE w.fanout_id = f.fanout_id AND w.status IN ('done', 'failed'))`); n == 0 {
		t.Error("no group was complete when the flush died: the scenario did not happen")
	}
	d := faninStart(t, conf, "fanin")
	faninWaitJoined(t, s, ids, 90*time.Second)
	faninCrashWant(t, s, ids)
	d.stop()
}

// TestFaninDaemonFailpointFlushAfterCommit (T6 c): the dispatcher dies right after each flush
// that applied events commits, before it claims the woken parents. Every start commits one
// flush and dies again, until nothing is left to flush; then the parents are claimed once.
//
// How many starts that takes is the load's doing: a start flushes at its first hint, and on a
// loaded machine the workers' batches are cut by time to a message or two, so a start applies
// a few children (30 starts were not enough for 166 children). What bounds it is the evidence:
// every child here enters 'done' once, as +1 in one inbox row, and every crash follows a
// committed flush that applied events, so the applied counts grow with each crash (checked),
// and there cannot be more crashes than children.
func TestFaninDaemonFailpointFlushAfterCommit(t *testing.T) {
	s := faninSetup(t)
	conf := faninConf(t, s, "", "PARALLELISM = 2\nQUEUE_LIMIT = 16")
	ids := faninParents(t, s, faninCrashPayloads...)
	children := 0
	for _, p := range faninCrashPayloads {
		var b faninBehaviour
		if err := json.Unmarshal([]byte(p), &b); err != nil {
			t.Fatal(err)
		}
		children += b.N
	}
	applied := func() int { return s.count(t, `SELECT coalesce(sum(done_n + failed_n), 0)::int FROM fanout`) }
	crashes, last := 0, applied()
	for run := 0; ; run++ {
		if run > children {
			t.Fatalf("still crashing after %d runs, more than there are children (%d)", run, children)
		}
		d := faninStart(t, conf, "fanin", "PEPSI_FAILPOINT=fanin-flush-after-commit")
		exited := false
		waitFor(t, 90*time.Second, "a crash or every parent joined", func() bool {
			select {
			case <-d.done:
				exited = true
				return true
			default:
			}
			return faninJoined(t, s, ids) == len(ids) && s.count(t, `SELECT count(*) FROM fanin_event`) == 0
		})
		if !exited {
			d.stop()
			break
		}
		if d.status != 137 || !strings.Contains(d.log.String(), "failpoint fanin-flush-after-commit") {
			t.Fatalf("run %d exited with %d, not at the failpoint:\n%s", run, d.status, d.log.String())
		}
		crashes++
		a := applied()
		if a <= last {
			t.Fatalf("run %d died after a flush commit, but the applied counts did not grow (%d, before %d)", run, a, last)
		}
		last = a
	}
	if crashes < 2 {
		t.Errorf("only %d crashes at the failpoint; the scenario did not happen", crashes)
	}
	t.Logf("%d crashes after a flush commit, for %d children", crashes, children)
	faninCrashWant(t, s, ids)
}

// TestFaninDaemonFailpointFireReady (T6 d): the dispatcher dies at start-up after its flush,
// before fire_ready. A group that is complete with no events waiting (counters set by an
// operator's repair; nothing else leaves a group so) is fired by the next start, once.
func TestFaninDaemonFailpointFireReady(t *testing.T) {
	s := faninSetup(t)
	slow := faninConf(t, s, "FANIN_MAX_DELAY = 60\nFANIN_MIN_HINTS = 100000", "PARALLELISM = 2\nQUEUE_LIMIT = 8")
	d := faninStart(t, slow, "fanin")
	ids := faninParents(t, s, faninCrashPayloads...)
	waitFor(t, 60*time.Second, "evidence waiting", func() bool {
		return s.count(t, `SELECT count(*) FROM fanin_runs`) >= 40 && s.count(t, `SELECT count(*) FROM fanin_event`) > 0
	})
	faninKill(t, d)
	// The operator's group: three children done, their events consumed by hand, counters set.
	var hand int64
	tx, err := s.DB.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	var fid int64
	if err := tx.QueryRow(`INSERT INTO workqueue (stage, status, claim, claimed_at)
	        VALUES ('split', 'running', nextval('workqueue_claim_seq'), now()) RETURNING workqueue_id`).Scan(&hand); err != nil {
		t.Fatal(err)
	}
	if err := tx.QueryRow(`SELECT fanout_split($1, 'split', 'join', 'child', '[{}, {}, {}]')`, hand).Scan(&fid); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		`UPDATE workqueue SET status = 'done' WHERE fanout_id = $1`,
		`DELETE FROM fanin_event WHERE fanout_id = $1`,
		`UPDATE fanout SET done_n = 3 WHERE fanout_id = $1`,
	} {
		if _, err := tx.Exec(q, fid); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	conf := faninConf(t, s, "", "PARALLELISM = 2\nQUEUE_LIMIT = 8")
	faninFailpointRun(t, conf, "fanin-fire-ready")
	if st, _, _, _ := faninGroup(t, s, fid); st != "open" {
		t.Fatalf("the complete group was fired (%s) although the start died before fire_ready", st)
	}
	if n := s.count(t, `SELECT count(*) FROM fanin_event`); n != 0 {
		t.Errorf("the start-up flush left %d events", n)
	}
	d3 := faninStart(t, conf, "fanin")
	d3.waitLog("complete groups fired at start-up", 30*time.Second)
	faninWaitJoined(t, s, append(slices.Clone(ids), hand), 90*time.Second)
	faninExpectJoin(t, s, hand, 3, 0)
	faninCrashWant(t, s, ids)
	d3.stop()
}

// TestFaninDaemonFailpointSweep (T6 e, T10): a child commits 'done' with its evidence lost.
// The sweep finds the drift; the dispatcher dies before the repair commits; the next start's
// sweep repairs it and wakes the parent once, and fanin_sweep_repaired counts 1.
func TestFaninDaemonFailpointSweep(t *testing.T) {
	s := faninSetup(t)
	conf := faninConf(t, s, "SWEEP_INTERVAL = 0.2\nSWEEP_MIN_AGE = 0", "PARALLELISM = 1\nQUEUE_LIMIT = 8")
	ids := faninParents(t, s, `{"n": 4, "lose_seqs": [2]}`, `{"n": 3}`)
	faninFailpointRun(t, conf, "fanin-sweep-before-commit")
	if n := s.count(t, `SELECT count(*) FROM fanin_wake_log l JOIN fanout f USING (fanout_id) WHERE f.parent_id = $1`, ids[0]); n != 0 {
		t.Errorf("the group with the lost event was woken by a sweep that did not commit")
	}
	d := faninStart(t, conf, "fanin")
	faninWaitJoined(t, s, ids, 60*time.Second)
	faninExpectJoin(t, s, ids[0], 4, 0)
	faninExpectJoin(t, s, ids[1], 3, 0)
	faninCheckQuiescent(t, s)
	d.stop()
	if r := faninStat(t, s, "fanin_sweep_repaired"); r != 1 {
		t.Errorf("dispatch_stats.fanin_sweep_repaired = %d, want 1", r)
	}
}

// TestFaninFailpointShape: a failpoint is inert in shape. The flush and the sweep that the
// daemon runs (flushOnce, sweepOnce) reach each failpoint inside the transaction of their
// statement, with the statement run and nothing of it committed yet (another session still
// sees the evidence), and the after-commit point with it committed; without a hook (as in
// production) the same functions run the same transactions to the same result.
func TestFaninFailpointShape(t *testing.T) {
	s := newTestSchema(t)
	ctx := context.Background()
	cfg := DispatchConfig{FaninBatch: faninBatchDefault, FaninMaxDelay: faninMaxDelayDefault, FaninMinHints: faninMinHintsDefault}
	if f := newFanin(cfg, &faninCounters{}); f.fail != nil {
		t.Fatal("newFanin set a fail hook without PEPSI_FAILPOINT")
	}
	// complete makes a group of n children, all done, evidence in the inbox; and lost one
	// whose last child's evidence is lost, for the sweep.
	complete := func(n int) int64 {
		parent, _, kids := faninClaimedGroup(t, s, n)
		faninFinish(t, s, kids, "done")
		return parent
	}
	lost := func() int64 {
		parent, _, kids := faninClaimedGroup(t, s, 2)
		faninFinish(t, s, kids[:1], "done")
		faninWriteUnseen(t, s, kids[1], "done")
		return parent
	}
	inbox := func() int { return s.count(t, `SELECT count(*) FROM fanin_event`) }

	for _, hooked := range []bool{true, false} {
		f := newFanin(cfg, &faninCounters{})
		var seen []string
		if hooked {
			f.fail = func(point string) {
				seen = append(seen, point)
				switch point {
				case "fanin-flush-before-commit":
					if n := inbox(); n == 0 {
						t.Errorf("at %s the flush's DELETE of the inbox is already visible: it did not run in a transaction", point)
					}
				case "fanin-flush-fired-before-commit":
					if n := inbox(); n == 0 {
						t.Errorf("at %s the flush's DELETE of the inbox is already visible: it did not run in a transaction", point)
					}
					if n := s.count(t, `SELECT count(*) FROM fanin_wake_log`); n != 0 {
						t.Errorf("at %s the flush's fire is visible before its commit (%d wake-log rows)", point, n)
					}
				case "fanin-flush-after-commit":
					if n := inbox(); n != 0 {
						t.Errorf("at %s another session still sees %d inbox rows", point, n)
					}
				case "fanin-sweep-before-commit":
					if n := s.count(t, `SELECT count(*) FROM fanin_wake_log`); n != 1 {
						t.Errorf("at %s the sweep's fire is visible before its commit (%d wake-log rows, want the flush's 1)", point, n)
					}
				}
			}
		}
		s.exec(t, `DELETE FROM fanin_wake_log`)
		parent := complete(3)
		ev := f.runFlush(ctx, s.DB, false, nil, nil)
		if ev.err != nil || len(ev.results) != 1 || ev.results[0].woken != 1 {
			t.Fatalf("hooked=%v: flush %+v, want one statement waking one parent", hooked, ev)
		}
		if _, st := faninRowStatus(t, s, parent); st != "pending" || inbox() != 0 {
			t.Errorf("hooked=%v: after the flush the parent is %s with %d inbox rows, want pending and 0", hooked, st, inbox())
		}
		orphan := lost()
		f.runFlush(ctx, s.DB, false, nil, nil)
		r, err := f.sweepOnce(ctx, s.DB, 0, 500, 0)
		if err != nil || r.repaired != 1 || r.woken != 1 {
			t.Fatalf("hooked=%v: sweep %+v, %v: want one group repaired and its parent woken", hooked, r, err)
		}
		if _, st := faninRowStatus(t, s, orphan); st != "pending" {
			t.Errorf("hooked=%v: after the sweep the parent is %s, want pending", hooked, st)
		}
		// The first flush fires the complete group; the second applies the lost group's one
		// event and fires nothing.
		want := []string{"fanin-flush-before-commit", "fanin-flush-fired-before-commit", "fanin-flush-after-commit",
			"fanin-flush-before-commit", "fanin-flush-after-commit", "fanin-sweep-before-commit"}
		if !hooked {
			want = nil
		}
		if !slices.Equal(seen, want) {
			t.Errorf("hooked=%v: failpoints reached %v, want %v", hooked, seen, want)
		}
	}
}

// ---- T7: the split stage crashes ----

// TestFaninDaemonSplitCrash (T7): (a) the split stage dies before its commit: nothing of the
// split exists, the parent is retried as any failed message and splits once; (b) it dies after
// the commit, before its status line: the parent stays waiting (the failure write is guarded),
// its children run, and it is woken once.
func TestFaninDaemonSplitCrash(t *testing.T) {
	s := faninSetup(t)
	d := faninStart(t, faninConf(t, s, "", ""), "fanin")
	faninWarmUp(t, s)
	before := faninParents(t, s, `{"n": 3, "split_crash_before": true}`)[0]
	waitFor(t, 60*time.Second, "the split's crash recorded", func() bool { return row(t, s, before).attempts >= 1 })
	if n := s.count(t, `SELECT count(*) FROM fanout WHERE parent_id = $1`, before); n > 1 {
		t.Errorf("%d groups for a parent whose first split rolled back", n)
	}
	faninWaitJoined(t, s, []int64{before}, 60*time.Second)
	faninWarmUp(t, s) // the crash left a fresh split worker: let it answer once
	after := faninParents(t, s, `{"n": 3, "split_crash_after": true}`)[0]
	faninWaitJoined(t, s, []int64{after}, 60*time.Second)

	jb := faninExpectJoin(t, s, before, 3, 0)
	if !strings.Contains(jb.parentError, "worker exited with status 3") {
		t.Errorf("(a) parent's dispatch_error %q, want the split worker's crash", jb.parentError)
	}
	if n := s.count(t, `SELECT count(*) FROM fanin_splits WHERE id = $1`, before); n != 1 {
		t.Errorf("(a) %d committed splits, want 1 (the crashed one rolled back)", n)
	}
	if n := s.count(t, `SELECT count(*) FROM fanout WHERE parent_id = $1 AND generation = 0`, before); n != 1 {
		t.Errorf("(a) want exactly one group, of generation 0")
	}
	ja := faninExpectJoin(t, s, after, 3, 0)
	if ja.parentAttempt != 0 || ja.parentError != "" {
		t.Errorf("(b) the committed split was charged a failure: attempts %d, %q", ja.parentAttempt, ja.parentError)
	}
	if n := s.count(t, `SELECT count(*) FROM fanin_once WHERE what LIKE 'split-crash-%'`); n != 2 {
		t.Errorf("%d split crashes happened, want 2", n)
	}
	// Both crashes were taken for what they are (the head's failure write, guarded), not
	// for a program that cannot start.
	waitFor(t, 10*time.Second, "both crashes handled", func() bool {
		return strings.Count(d.log.String(), "worker crashed; its head message fails") == 2
	})
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE fanout_id IS NOT NULL
	        AND fanout_id NOT IN (SELECT fanout_id FROM fanout)`); n != 0 {
		t.Errorf("%d children of no group", n)
	}
	faninCheckQuiescent(t, s)
	d.stop()
}

// ---- T8: concurrent last children ----

// TestFaninDaemonConcurrentLastChildren (T8): the children of two groups are held by a barrier
// (an advisory lock the test holds) in four workers, then released together, so the last
// children of each group commit at the same moment on different workers: one wake each.
func TestFaninDaemonConcurrentLastChildren(t *testing.T) {
	s := faninSetup(t)
	d := faninStart(t, faninConf(t, s, "", "PARALLELISM = 4\nQUEUE_LIMIT = 32"), "fanin")
	const key = 0x66616e69 // "fani"
	ctx := context.Background()
	conn, err := s.DB.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, `SELECT pg_advisory_lock($1)`, key); err != nil {
		t.Fatal(err)
	}
	payload := fmt.Sprintf(`{"n": 64, "barrier": %d}`, key)
	ids := faninParents(t, s, payload, payload)
	waitFor(t, 60*time.Second, "four workers at the barrier", func() bool {
		return s.count(t, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted`) >= 4
	})
	if _, err := conn.ExecContext(ctx, `SELECT pg_advisory_unlock($1)`, key); err != nil {
		t.Fatal(err)
	}
	faninWaitJoined(t, s, ids, 60*time.Second)
	for _, id := range ids {
		faninExpectJoin(t, s, id, 64, 0)
	}
	if w := s.count(t, `SELECT count(DISTINCT pid) FROM fanin_runs`); w < 2 {
		t.Errorf("the children ran in %d worker(s), want several", w)
	}
	faninCheckQuiescent(t, s)
	d.stop()
}

// ---- T10: lost evidence, repaired by the sweep ----

// TestFaninDaemonLostEvidenceSweep (T10): one child commits 'done' and deletes its own inbox
// row in the same transaction, so no flush can ever count it. The sweep (SWEEP_INTERVAL small,
// SWEEP_MIN_AGE 0) repairs the group from the children rows, the parent is woken once, and
// dispatch_stats.fanin_sweep_repaired = 1.
func TestFaninDaemonLostEvidenceSweep(t *testing.T) {
	s := faninSetup(t)
	d := faninStart(t, faninConf(t, s, "SWEEP_INTERVAL = 0.3\nSWEEP_MIN_AGE = 0", ""), "fanin")
	ids := faninParents(t, s, `{"n": 5, "lose_seqs": [3]}`, `{"n": 20}`)
	faninWaitJoined(t, s, ids, 60*time.Second)
	faninExpectJoin(t, s, ids[0], 5, 0)
	faninExpectJoin(t, s, ids[1], 20, 0)
	d.waitLog("fan-in sweep repaired drift", time.Second)
	faninCheckQuiescent(t, s)
	d.stop()
	if r := faninStat(t, s, "fanin_sweep_repaired"); r != 1 {
		t.Errorf("dispatch_stats.fanin_sweep_repaired = %d, want 1", r)
	}
	if w := faninStat(t, s, "fanin_wakes"); w != 2 {
		t.Errorf("dispatch_stats.fanin_wakes = %d, want 2", w)
	}
}

// TestFaninSweepBlockedClaimsGoOn: a page of the sweep that waits for a row lock does not stop
// the pipeline. The sweep's recount locks the open groups of its page (fanin_recount: FOR
// UPDATE on fanout), so another transaction holding one of those rows (an operator's, say)
// holds the page for up to dbStatementBudget. Here a test transaction holds an open group's row
// while the sweep runs every 0.2 s; then groups go through split, children and join. They must
// all finish while one and the same sweep statement is still waiting for the lock (the waiting
// backend's query_start unchanged), which is impossible if the sweep runs on the coordinator's
// own connection: every claim would wait behind it (the sweep first ran there, fanin.go:
// startSweep). Then the lock goes, the sweep completes, and SIGTERM stops the daemon at once.
func TestFaninSweepBlockedClaimsGoOn(t *testing.T) {
	s := faninSetup(t)
	d := faninStart(t, faninConf(t, s, "SWEEP_INTERVAL = 0.2\nSWEEP_MIN_AGE = 0", ""), "fanin")
	faninWarmUp(t, s)

	// An open group nobody runs: its parent and children are at stages the configuration
	// does not have, so only the sweep ever looks at it.
	var parent, fid int64
	if err := s.DB.QueryRow(`INSERT INTO workqueue (stage, status, attempts, claim, claimed_at)
	    VALUES ('offstage', 'running', 0, nextval('workqueue_claim_seq'), now()) RETURNING workqueue_id`).Scan(&parent); err != nil {
		t.Fatalf("insert the offstage parent: %v", err)
	}
	if err := s.DB.QueryRow(`SELECT fanout_split($1, 'offstage', 'offstage-join', 'offstage-child', '[{"i":0},{"i":1}]'::jsonb)`,
		parent).Scan(&fid); err != nil {
		t.Fatalf("fanout_split of the offstage parent: %v", err)
	}

	ctx := context.Background()
	holder, err := s.DB.BeginTx(ctx, nil)
	if err != nil {
		t.Fatalf("begin the lock holder: %v", err)
	}
	defer holder.Rollback()
	var holderPID int
	if err := holder.QueryRow(`SELECT pg_backend_pid() FROM fanout WHERE fanout_id = $1 FOR UPDATE`, fid).Scan(&holderPID); err != nil {
		t.Fatalf("lock the group's fanout row: %v", err)
	}
	// blockedSweep is the query_start of the sweep statement waiting for holder, if one is.
	blockedSweep := func() (time.Time, bool) {
		var at time.Time
		err := s.DB.QueryRow(`SELECT query_start FROM pg_stat_activity
		    WHERE query LIKE '%FROM fanin_sweep(%' AND pid <> pg_backend_pid()
		      AND $1 = ANY (pg_blocking_pids(pid))`, holderPID).Scan(&at)
		if errors.Is(err, sql.ErrNoRows) {
			return time.Time{}, false
		}
		if err != nil {
			t.Fatalf("read the sweep's lock wait: %v", err)
		}
		return at, true
	}
	var since time.Time
	waitFor(t, 30*time.Second, "a sweep waiting for the group's row lock", func() bool {
		at, ok := blockedSweep()
		since = at
		return ok
	})

	ids := faninParents(t, s, `{"n": 4}`, `{"n": 7}`, `{"n": 1}`)
	faninWaitJoined(t, s, ids, 30*time.Second)
	at, ok := blockedSweep()
	if !ok || !at.Equal(since) {
		t.Fatalf("the groups joined, but the sweep that waited since %s is no longer waiting (now: %v, %v): "+
			"they did not run while it was blocked", since.Format(time.RFC3339Nano), at, ok)
	}
	faninExpectJoin(t, s, ids[0], 4, 0)
	faninExpectJoin(t, s, ids[1], 7, 0)
	faninExpectJoin(t, s, ids[2], 1, 0)
	if strings.Contains(d.log.String(), "fan-in sweep failed") {
		t.Errorf("a sweep failed while blocked (its budget is %s):\n%s", dbStatementBudget, d.log.String())
	}

	if err := holder.Rollback(); err != nil {
		t.Fatalf("release the group's row lock: %v", err)
	}
	waitFor(t, 30*time.Second, "no sweep waiting any more", func() bool {
		_, ok := blockedSweep()
		return !ok
	})
	if _, st := faninRowStatus(t, s, parent); st != "waiting" {
		t.Errorf("the offstage parent is %s, want still waiting (its children never ran)", st)
	}
	d.stop()
}

// ---- T19, T20: reload, restart, SIGTERM ----

// TestFaninDaemonReloadAndRestart (T19): groups are open while the dispatcher is restarted
// (their child stage cannot run yet: its program is missing) and while the configuration is
// reloaded twice (the program fixed through the config table, then a change that retires the
// workers in the middle of the children). One wake each.
func TestFaninDaemonReloadAndRestart(t *testing.T) {
	s := faninSetup(t)
	conf := baseConf(s, "") +
		stageConf(t, "split", "join", "PARALLELISM = 1\nQUEUE_LIMIT = 4") +
		"[stage-child]\nPROGRAM = /nonexistent/fanin-child\nPARALLELISM = 2\nQUEUE_LIMIT = 8\n\n" +
		stageConf(t, "join", "", "PARALLELISM = 1")
	d := faninStart(t, conf, "fanin")
	ids := faninParents(t, s, `{"n": 30, "sleep_ms": 20}`, `{"n": 30, "sleep_ms": 20}`, `{"n": 5}`)
	waitFor(t, 60*time.Second, "the parents waiting", func() bool { return countStatus(t, s, "waiting") == 3 })
	d.waitLog("cannot start the stage's program", 30*time.Second)
	d.stop()
	d2 := faninStart(t, conf, "fanin")
	d2.waitLog("dispatching", 30*time.Second)
	if n := countStatus(t, s, "waiting"); n != 3 {
		t.Fatalf("%d parents waiting after the restart, want 3", n)
	}
	s.exec(t, `INSERT INTO config (section, key, value) VALUES ('stage-child', 'PROGRAM', $1)`, testWorkerBin(t))
	waitFor(t, 60*time.Second, "children running", func() bool { return s.count(t, `SELECT count(*) FROM fanin_runs`) >= 10 })
	s.exec(t, `INSERT INTO config (section, key, value) VALUES ('stage-child', 'QUEUE_LIMIT', '3')`)
	waitFor(t, 30*time.Second, "the second reload", func() bool {
		return strings.Count(d2.log.String(), "stage graph reloaded") == 2
	})
	faninWaitJoined(t, s, ids, 60*time.Second)
	faninExpectJoin(t, s, ids[0], 30, 0)
	faninExpectJoin(t, s, ids[1], 30, 0)
	faninExpectJoin(t, s, ids[2], 5, 0)
	faninCheckQuiescent(t, s)
	d2.stop()
}

// TestFaninDaemonSigterm (T20): SIGTERM while children run and while a long split is in its
// transaction: exit 0, nothing left running, and the restart completes every group once.
func TestFaninDaemonSigterm(t *testing.T) {
	s := faninSetup(t)
	conf := faninConf(t, s, "", "PARALLELISM = 2\nQUEUE_LIMIT = 4")
	d := faninStart(t, conf, "fanin")
	ids := faninParents(t, s, `{"n": 40, "sleep_ms": 10}`, `{"n": 40, "sleep_ms": 10}`)
	waitFor(t, 60*time.Second, "children running", func() bool { return s.count(t, `SELECT count(*) FROM fanin_runs`) >= 10 })
	long := faninParents(t, s, `{"range": [1, 2000000], "max_children": 2000, "min_span": 1}`)
	waitFor(t, 30*time.Second, "the long split claimed", func() bool { return row(t, s, long[0]).status != "pending" })
	d.stop()
	if n := countStatus(t, s, "running"); n != 0 {
		t.Fatalf("%d rows left running after a clean shutdown", n)
	}
	d2 := faninStart(t, faninConf(t, s, "", "PARALLELISM = 2\nQUEUE_LIMIT = 64\nMAX_MESSAGES = 100000"), "fanin")
	d2.waitLog("orphans_reset=0", 30*time.Second)
	ids = append(ids, long...)
	faninWaitJoined(t, s, ids, 120*time.Second)
	faninExpectJoin(t, s, ids[0], 40, 0)
	faninExpectJoin(t, s, ids[1], 40, 0)
	faninExpectJoin(t, s, ids[2], 2000, 0)
	faninCheckQuiescent(t, s)
	d2.stop()
}

// TestFaninDaemonOrphanWaiter: a parent left 'waiting' on no open group (an operator's doing;
// the sweep's orphan check) is woken by the sweep and claimed at once, not at the next
// heartbeat (POLL_INTERVAL is long here).
//
// The orphan is inserted 'waiting' in one statement. Inserting it 'pending' and then setting
// it 'waiting' let the daemon claim it (the insert's NOTIFY) and run its continuation to 'done'
// between the two statements on a loaded machine; the UPDATE then made a done row wait again
// and the sweep rightly woke and ran it a second time, which the oracle counted as "ran more
// than once" (or found it still running).
func TestFaninDaemonOrphanWaiter(t *testing.T) {
	s := faninSetup(t)
	conf := strings.Replace(faninConf(t, s, "SWEEP_INTERVAL = 0.2\nSWEEP_MIN_AGE = 0", ""), "POLL_INTERVAL = 1", "POLL_INTERVAL = 60", 1)
	d := faninStart(t, conf, "fanin")
	faninWarmUp(t, s)
	var orphan int64
	if err := s.DB.QueryRow(`INSERT INTO workqueue (stage, status, payload) VALUES ('join', 'waiting', '{}')
	        RETURNING workqueue_id`).Scan(&orphan); err != nil {
		t.Fatal(err)
	}
	d.waitLog("orphans_woken=1", 30*time.Second)
	waitFor(t, 30*time.Second, "the orphan's continuation", func() bool { return faninJoined(t, s, []int64{orphan}) == 1 })
	if j := faninJoinOf(t, s, orphan); !j.noGroup || j.runs != 1 {
		t.Errorf("orphan's continuation: %+v", j)
	}
	faninCheckQuiescent(t, s)
	d.stop()
}

// ---- the start-up's fan-in pass and rows another transaction holds ----

// The states of a hand-made group's children (faninHandGroup).
const (
	handPending = iota // pending at child, for the dispatcher to run
	handInbox          // done, their events waiting in the inbox (a flush fires the group)
	handApplied        // done, their events consumed and the counters complete (only fire_ready fires it)
)

// faninHandGroup makes a group by hand, as a split, an operator's repair or a crash would leave
// it: a split parent waiting at join on n children at child, in the state children says. It
// returns the parent and the group.
func faninHandGroup(t *testing.T, s *testSchema, n int, children int) (parent, fid int64) {
	t.Helper()
	tx, err := s.DB.Begin()
	if err != nil {
		t.Fatalf("begin the hand-made group: %v", err)
	}
	defer tx.Rollback()
	if err := tx.QueryRow(`INSERT INTO workqueue (stage, status, claim, claimed_at)
	        VALUES ('split', 'running', nextval('workqueue_claim_seq'), now()) RETURNING workqueue_id`).Scan(&parent); err != nil {
		t.Fatalf("insert the hand-made parent: %v", err)
	}
	if err := tx.QueryRow(`SELECT fanout_split($1, 'split', 'join', 'child',
	        (SELECT jsonb_agg('{}'::jsonb) FROM generate_series(1, $2)))`, parent, n).Scan(&fid); err != nil {
		t.Fatalf("fanout_split of the hand-made parent: %v", err)
	}
	var steps []string
	if children != handPending {
		steps = append(steps, `UPDATE workqueue SET status = 'done' WHERE fanout_id = $1`)
	}
	if children == handApplied {
		steps = append(steps, `DELETE FROM fanin_event WHERE fanout_id = $1`,
			fmt.Sprintf(`UPDATE fanout SET done_n = %d WHERE fanout_id = $1`, n))
	}
	for _, q := range steps {
		if _, err := tx.Exec(q, fid); err != nil {
			t.Fatalf("hand-made group: %s: %v", q, err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatalf("commit the hand-made group: %v", err)
	}
	return parent, fid
}

// faninPlainDone enqueues n messages at join that belong to no group (the continuation runs them
// as such) and waits, up to timeout, until they are done.
func faninPlainDone(t *testing.T, s *testSchema, n int, timeout time.Duration) {
	t.Helper()
	var ids []int64
	if err := s.DB.QueryRow(`WITH i AS (INSERT INTO workqueue (stage, payload)
	        SELECT 'join', '{}' FROM generate_series(1, $1) RETURNING workqueue_id)
	    SELECT array_agg(workqueue_id) FROM i`, n).Scan(pq.Array(&ids)); err != nil {
		t.Fatalf("enqueue plain messages at join: %v", err)
	}
	waitFor(t, timeout, fmt.Sprintf("%d plain messages done", n), func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = ANY ($1) AND status = 'done'`,
			pq.Array(ids)) == n
	})
}

// heldGroups are two hand-made groups (faninHandGroup) whose rows another transaction holds:
// A (3 children) by its parent's workqueue row, which the wake writes, B (2 children) by its
// fanout row, which every application of its evidence writes.
type heldGroups struct {
	parents [2]int64
	letGo   func()
}

// faninHeldGroups makes the two groups with their children in the state children says, holds
// their rows, and starts a dispatcher with /metrics at the address it returns, which must say
// "dispatching" within a budget.
func faninHeldGroups(t *testing.T, s *testSchema, children int) (heldGroups, *daemon, string) {
	t.Helper()
	var h heldGroups
	var fidB int64
	h.parents[0], _ = faninHandGroup(t, s, 3, children)
	h.parents[1], fidB = faninHandGroup(t, s, 2, children)
	letGoA := faninHold(t, s, `SELECT 1 FROM workqueue WHERE workqueue_id = $1 FOR UPDATE`, h.parents[0])
	letGoB := faninHold(t, s, `SELECT 1 FROM fanout WHERE fanout_id = $1 FOR UPDATE`, fidB)
	h.letGo = func() { letGoA(); letGoB() }
	addr := freePort(t)
	d := faninStart(t, faninConf(t, s, "METRICS_LISTEN = "+addr, ""), "fanin")
	d.waitLog("dispatching", dbStatementBudget)
	return h, d, addr
}

// stillWaiting requires both parents still waiting, as they must while their rows are held.
func (h heldGroups) stillWaiting(t *testing.T, s *testSchema) {
	t.Helper()
	for _, p := range h.parents {
		if _, st := faninRowStatus(t, s, p); st != "waiting" {
			t.Fatalf("parent %d is %s while its group's rows are held, want waiting", p, st)
		}
	}
}

// joinOnce lets the rows go and requires each parent woken, and its continuation run, once.
func (h heldGroups) joinOnce(t *testing.T, s *testSchema) {
	t.Helper()
	h.letGo()
	faninWaitJoined(t, s, h.parents[:], 30*time.Second)
	faninExpectJoin(t, s, h.parents[0], 3, 0)
	faninExpectJoin(t, s, h.parents[1], 2, 0)
}

// TestFaninStartupReadyGroupsHeld: at start-up three groups are complete with nothing in the
// inbox (only fire_ready fires them), and another transaction holds a row that firing two of
// them needs: one parent's workqueue row, the other group's fanout row. The dispatcher starts
// and dispatches within a budget, the third group's parent is woken and joins at once, and new
// groups join while the rows are held; fire_ready passes the two over, says so and tries again;
// once the rows are let go, both groups fire and their parents' continuations run, once each.
// Before, fire_ready fired all ready groups in one statement that waited for the held rows: the
// third parent waited with them until its budget, then at every retry.
func TestFaninStartupReadyGroupsHeld(t *testing.T) {
	s := faninSetup(t)
	free, _ := faninHandGroup(t, s, 2, handApplied)
	h, d, _ := faninHeldGroups(t, s, handApplied)
	faninWaitJoined(t, s, []int64{free}, dbStatementBudget/2)
	faninExpectJoin(t, s, free, 2, 0)
	faninPlainDone(t, s, 5, dbStatementBudget/2)
	ids := faninParents(t, s, `{"n": 4}`, `{"n": 1}`)
	faninWaitJoined(t, s, ids, 30*time.Second)
	faninExpectJoin(t, s, ids[0], 4, 0)
	faninExpectJoin(t, s, ids[1], 1, 0)
	h.stillWaiting(t, s)
	d.waitLog("fan-in: complete groups passed over at start-up", dbStatementBudget)
	if strings.Contains(d.log.String(), "firing the complete groups at start-up failed") {
		t.Errorf("the start's fire_ready failed (waited for a held row?):\n%s", d.log.String())
	}
	faninPlainDone(t, s, 5, dbStatementBudget/2)

	h.joinOnce(t, s)
	if !strings.Contains(d.log.String(), "complete groups fired at start-up") {
		t.Errorf("the start's fire_ready did not say it fired the groups:\n%s", d.log.String())
	}
	faninCheckQuiescent(t, s)
	d.stop()
}

// TestFaninStartupInboxGroupHeld: at start-up a group's last events wait in the inbox, and
// another transaction holds its fanout row, which the start's flush must update. The
// dispatcher starts and dispatches within a budget (the flush passes the group over, as any
// flush does: TestFaninHeldGroupsOthersWake); once the row is let go, a flush applies the
// events and the parent's continuation runs, once.
func TestFaninStartupInboxGroupHeld(t *testing.T) {
	s := faninSetup(t)
	parent, fid := faninHandGroup(t, s, 3, handInbox)
	if n := s.count(t, `SELECT coalesce(sum(d_done), 0) FROM fanin_event WHERE fanout_id = $1`, fid); n != 3 {
		t.Fatalf("the inbox holds %d children done of the hand-made group, want 3", n)
	}
	letGo := faninHold(t, s, `SELECT 1 FROM fanout WHERE fanout_id = $1 FOR UPDATE`, fid)
	defer letGo()

	d := faninStart(t, faninConf(t, s, "", ""), "fanin")
	d.waitLog("dispatching", dbStatementBudget)
	faninPlainDone(t, s, 5, dbStatementBudget/2)
	if _, st := faninRowStatus(t, s, parent); st != "waiting" {
		t.Fatalf("parent %d is %s while its group's row is held, want waiting", parent, st)
	}

	letGo()
	faninWaitJoined(t, s, []int64{parent}, 30*time.Second)
	faninExpectJoin(t, s, parent, 3, 0)
	faninCheckQuiescent(t, s)
	d.stop()
}

// TestFaninHeldGroupsOthersWake: while the dispatcher runs, two groups complete whose rows
// another transaction holds (one parent's workqueue row, the other group's fanout row). The
// flushes pass them over and say so, new groups join meanwhile, and once the rows are let go
// both parents are woken and their continuations run, once each. Before, each flush waited for
// the held row until its budget and failed, and no group of any parent was woken meanwhile.
func TestFaninHeldGroupsOthersWake(t *testing.T) {
	s := faninSetup(t)
	h, d, addr := faninHeldGroups(t, s, handPending)
	waitFor(t, 30*time.Second, "the held groups' children done", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE stage = 'child' AND status = 'done'`) == 5
	})
	ids := faninParents(t, s, `{"n": 4}`, `{"n": 1}`)
	waitFor(t, dbStatementBudget/2, "2 new parents joined while the held groups wait", func() bool {
		return faninJoined(t, s, ids) == 2
	})
	d.waitLog("fan-in: groups passed over", time.Second)
	waitFor(t, 5*time.Second, "pepsi_fanin_held_groups 2 on /metrics", func() bool {
		v, ok := metric(t, addr, "pepsi_fanin_held_groups")
		return ok && v == 2
	})
	if page := consoleOverview(t, addr); !strings.Contains(page, "<b>2</b> fan-in groups (their parents stay waiting)") {
		t.Errorf("the console's overview does not show the 2 held groups:\n%s", page)
	}
	// While the groups stay held, each flush locks its rows first (the last one passed groups
	// over) instead of waiting fanin_flush's 100 ms lock_timeout for them again.
	flushes := func() (n, secs float64) {
		t.Helper()
		n, okN := metric(t, addr, "pepsi_fanin_flushes_total")
		secs, okS := metric(t, addr, "pepsi_fanin_flush_seconds_total")
		if !okN || !okS {
			t.Fatalf("/metrics lacks pepsi_fanin_flushes_total (%t) or pepsi_fanin_flush_seconds_total (%t)", okN, okS)
		}
		return n, secs
	}
	n0, secs0 := flushes()
	var n1, secs1 float64
	waitFor(t, 30*time.Second, "3 more flushes while the groups are held", func() bool {
		n1, secs1 = flushes()
		return n1 >= n0+3
	})
	if per := (secs1 - secs0) / (n1 - n0); per >= 0.1 {
		t.Errorf("flushes while the groups stay held took %.3f s each: they waited for the held rows", per)
	}
	faninExpectJoin(t, s, ids[0], 4, 0)
	faninExpectJoin(t, s, ids[1], 1, 0)
	h.stillWaiting(t, s)
	if strings.Contains(d.log.String(), "fan-in flush failed") {
		t.Errorf("a flush failed (waited for a held row?):\n%s", d.log.String())
	}

	h.joinOnce(t, s)
	d.waitLog("fan-in: groups held by other transactions applied", 5*time.Second)
	waitShownGone(t, addr, "pepsi_fanin_held_groups", "held")
	faninCheckQuiescent(t, s)
	d.stop()
}
