// operate_test.go: the operator's actions (operate.sql) against the real dispatcher and real
// workers: each race of issue 18 made to happen, or looped thousands of times, with the
// invariants checked afterwards (every message ends in one state, no (message, stage) runs
// twice, no operator write is lost); cancelling a running message at and behind the head of
// its worker's queue; paused stages under load and across a restart; a bulk retry of 100,000
// rows beside a running backlog. The command line itself is tested in cmd/pepsi-queue.

package main

import (
	"bufio"
	"context"
	"database/sql"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/lib/pq"
)

// gatedWorker is a raw stage whose outcome transaction waits, after its UPDATE and before its
// COMMIT, until the test opens the gate for the message (a row in table gate), so that an
// operator's action can be made to meet a stage's open transaction: gate row (id, stage). A
// message with {"pregate": true} also waits before its transaction starts, for (id, pre-STAGE). It records the run in
// that transaction, advances to its first NEXT stage (or finishes), and answers 0; when the
// guarded UPDATE matched nothing (the claim is gone) it rolls back and answers 1.
func gatedWorker() int {
	db, err := sql.Open("postgres", os.Getenv("PEPSI_DSN"))
	if err != nil {
		return 2
	}
	defer db.Close()
	st := os.Getenv("PEPSI_STAGE")
	next := strings.Fields(os.Getenv("PEPSI_NEXT"))
	wait := func(id int64, at string) bool {
		for {
			var open bool
			if err := db.QueryRow(`SELECT EXISTS (SELECT 1 FROM gate WHERE id = $1 AND stage = $2)`, id, at).Scan(&open); err != nil {
				return false
			}
			if open {
				return true
			}
			time.Sleep(5 * time.Millisecond) // a worker's poll: there is no event to wait on
		}
	}
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		id, _ := strconv.ParseInt(in.Text(), 10, 64)
		var pregate bool
		db.QueryRow(`SELECT coalesce((payload->>'pregate')::boolean, false) FROM workqueue WHERE workqueue_id = $1`, id).Scan(&pregate)
		if pregate && !wait(id, "pre-"+st) { // before the outcome's transaction
			return 1
		}
		tx, err := db.Begin()
		if err != nil {
			return 1
		}
		tx.Exec(`INSERT INTO runs (id, stage, pid) VALUES ($1, $2, $3)`, id, st, os.Getpid())
		q := `UPDATE workqueue SET status = 'done' WHERE workqueue_id = $1 AND status = 'running' AND stage = $2`
		args := []any{id, st}
		if len(next) > 0 {
			q = `UPDATE workqueue SET stage = $3, status = 'pending' WHERE workqueue_id = $1 AND status = 'running' AND stage = $2`
			args = append(args, next[0])
		}
		res, err := tx.Exec(q, args...)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		if n, _ := res.RowsAffected(); n == 0 {
			tx.Rollback()
			fmt.Println("1 claim lost")
			continue
		}
		// The test cannot see an uncommitted row: it watches pg_stat_activity for this
		// session, which says 'idle in transaction' (last query: the UPDATE) while it waits.
		if !wait(id, st) {
			return 1
		}
		if err := tx.Commit(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Println("0")
	}
	return 0
}

// failingWorker fails every message, recording each run on its own connection (committed
// whatever the outcome), so that attempts can be compared with runs.
func failingWorker() int {
	db, err := sql.Open("postgres", os.Getenv("PEPSI_DSN"))
	if err != nil {
		return 2
	}
	defer db.Close()
	st := os.Getenv("PEPSI_STAGE")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		id, _ := strconv.ParseInt(in.Text(), 10, 64)
		if _, err := db.Exec(`INSERT INTO runs (id, stage, pid) VALUES ($1, $2, $3)`, id, st, os.Getpid()); err != nil {
			return 1
		}
		fmt.Printf("1 relay 10.0.0.%d:25 down\n", id%250)
	}
	return 0
}

func init() {
	testWorkers["gated"] = gatedWorker
	testWorkers["failing"] = failingWorker
}

const gateDDL = `CREATE TABLE gate (id bigint, stage text, PRIMARY KEY (id, stage))`

// act calls one of operate.sql's actions on ids and returns the changed ids.
// actQuerier is what an action runs on: the pool, or one connection of it.
type actQuerier interface {
	QueryContext(context.Context, string, ...any) (*sql.Rows, error)
}

// act runs queue_ACTION on ids and returns the ids it changed; an error fails the test. It
// calls t.Fatal, so only the test's own goroutine may call it: others use tryAct.
func act(t testing.TB, q actQuerier, action string, ids ...int64) map[int64]bool {
	t.Helper()
	ok, err := tryAct(q, action, ids...)
	if err != nil {
		t.Fatal(err)
	}
	return ok
}

// tryAct is act for the test's other goroutines: it returns the error instead.
func tryAct(q actQuerier, action string, ids ...int64) (map[int64]bool, error) {
	rows, err := q.QueryContext(context.Background(), `SELECT workqueue_id, ok FROM queue_`+action+`($1)`, pq.Array(ids))
	if err != nil {
		return nil, fmt.Errorf("queue_%s: %w", action, err)
	}
	defer rows.Close()
	ok := map[int64]bool{}
	for rows.Next() {
		var id int64
		var changed bool
		if err := rows.Scan(&id, &changed); err != nil {
			return nil, fmt.Errorf("queue_%s: %w", action, err)
		}
		if changed {
			ok[id] = true
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("queue_%s: %w", action, err)
	}
	return ok, nil
}

func status(t testing.TB, s *testSchema, id int64) string {
	t.Helper()
	var st string
	if err := s.DB.QueryRow(`SELECT status FROM workqueue WHERE workqueue_id = $1`, id).Scan(&st); err != nil {
		t.Fatalf("status of %d: %v", id, err)
	}
	return st
}

// waitIdleInTx waits until a session of this test's gated workers is idle in a transaction
// after the UPDATE that holds the message's row (the worker between its UPDATE and its
// COMMIT): update is a part of that statement's text, which tells the worker of one stage
// from another's. Any worker's UPDATE, as this first was, let the moment between stage a's
// advance and its commit (its gate already open) pass for stage b's final outcome: the
// action then ran before b's worker held the row (CI on 36a765c: the cancel stopped b's
// worker at the head instead of waiting for its commit). The application_name keeps it to
// this test's system.
func waitIdleInTx(t testing.TB, s *testSchema, update string) {
	t.Helper()
	key, err := systemKey(context.Background(), slog.New(slog.NewTextHandler(io.Discard, nil)), s.DB)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the stage's transaction to be open after "+update, func() bool {
		return s.count(t, `SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction'
		        AND application_name LIKE $1 AND query LIKE $2`,
			fmt.Sprintf("%s %d %%", appWorker, key), "%"+update+"%") > 0
	})
}

// waitLockWait waits until some session waits for a row lock on workqueue.
func waitLockWait(t testing.TB, s *testSchema, app string) {
	t.Helper()
	waitFor(t, 30*time.Second, app+" waiting for a row lock", func() bool {
		return s.count(t, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
		        AND application_name LIKE $1`, app) > 0
	})
}

// TestRaceStageCommitsDuringCancel: the stage's outcome is written and its transaction held
// open; a cancel meets the row lock and waits; the stage commits: the cancel then finds the
// row at its next stage and cancels it there (its write is not lost, and neither is the
// stage's advance). At a final stage it finds the row done and is refused.
func TestRaceStageCommitsDuringCancel(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	s.exec(t, gateDDL)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "b", "PARALLELISM = 1")+
		stageConf(t, "b", "", "PARALLELISM = 1"), "gated")
	for _, final := range []bool{false, true} {
		id := insertOne(t, s, "a", `{}`)
		if final {
			s.exec(t, `INSERT INTO gate VALUES ($1, 'a')`, id) // straight through a
			waitFor(t, 30*time.Second, "the message at b", func() bool { return row(t, s, id).stage == "b" })
		}
		waitIdleInTx(t, s, map[bool]string{false: "UPDATE workqueue SET stage =", true: "UPDATE workqueue SET status = 'done'"}[final])
		op, err := s.DB.Conn(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		op.ExecContext(context.Background(), `SET application_name = 'op-cancel'`)
		done := make(chan map[int64]bool, 1)
		go func() {
			got, err := tryAct(op, "cancel", id)
			if err != nil {
				t.Error(err) // the receive below then sees no change, and the case fails too
			}
			done <- got
		}()
		waitLockWait(t, s, "op-cancel")
		s.exec(t, `INSERT INTO gate VALUES ($1, $2)`, id, map[bool]string{false: "a", true: "b"}[final]) // the stage commits
		got := <-done
		op.Close()
		r := row(t, s, id)
		switch {
		case !final && (!got[id] || r.status != "cancelled" || r.stage != "b"):
			t.Errorf("cancel meeting the advance: changed=%v, row %+v; want cancelled at b", got[id], r)
		case final && (got[id] || r.status != "done"):
			t.Errorf("cancel meeting the final outcome: changed=%v, row %+v; want refused, done", got[id], r)
		}
		if n := s.count(t, `SELECT count(*) FROM runs WHERE id = $1`, id); (final && n != 2) || (!final && n != 1) {
			t.Errorf("message %d ran %d times", id, n)
		}
	}
	d.stop()
}

// TestRaceCancelBeforeStageCommits: the cancel commits first while the stage's transaction
// waits (the operator's transaction is held open until the stage's UPDATE waits on its row
// lock): the stage's guarded outcome then matches nothing, the message stays cancelled, its
// attempts and error untouched (the dispatcher's failure write is guarded by the claim too).
func TestRaceCancelBeforeStageCommits(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	s.exec(t, gateDDL)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 1\nRETRY_DELAY = 0.1"), "gated")
	warm := insertOne(t, s, "a", `{}`)
	s.exec(t, `INSERT INTO gate VALUES ($1, 'a')`, warm)
	waitFor(t, 30*time.Second, "warm-up done", func() bool { return status(t, s, warm) == "done" })

	// The row is claimed (running) and its stage waits before its outcome; the operator's
	// transaction cancels it and holds the row lock.
	id := insertOne(t, s, "a", `{"pregate": true}`)
	waitFor(t, 30*time.Second, "the message running", func() bool { return status(t, s, id) == "running" })
	tx, err := s.DB.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback() // after the Commit below: a no-op
	var ok bool
	if err := tx.QueryRow(`SELECT ok FROM queue_cancel($1)`, pq.Array([]int64{id})).Scan(&ok); err != nil || !ok {
		t.Fatalf("cancel in the open transaction: ok=%v err=%v", ok, err)
	}
	s.exec(t, `INSERT INTO gate VALUES ($1, 'pre-a'), ($1, 'a')`, id)
	// The stage meets the lock (unless it already finished: then the cancel could not have
	// found it running, which the Scan above rules out).
	waitLockWait(t, s, "pepsi-worker%")
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the stage's answer to be handled", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'running'`) == 0
	})
	r := row(t, s, id)
	if r.status != "cancelled" || r.attempts != 0 || r.reason != "" {
		t.Errorf("cancelled message after the stage's outcome: %+v; want cancelled, attempts 0, no error", r)
	}
	if n := s.count(t, `SELECT count(*) FROM runs WHERE id = $1`, id); n != 0 {
		t.Errorf("the stage's run committed after the cancel (%d runs)", n)
	}
	d.stop()
}

// TestCancelRunningHead: cancelling the message at the head of a worker's queue stops that
// worker; its other messages go back to pending untouched and finish in a new worker; the
// cancelled message is not charged an attempt.
func TestCancelRunningHead(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 8"), "pipeline")
	warmUp(t, s, "a")
	hung := insertOne(t, s, "a", `{"hang_at": "a"}`)
	s.exec(t, `INSERT INTO workqueue (stage, payload) SELECT 'a', '{}' FROM generate_series(1, 5)`)
	waitFor(t, 30*time.Second, "the hung message and its neighbours running", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'running'`) == 6
	})
	pids := workerPids(t, d)
	if got := act(t, s.DB, "cancel", hung); !got[hung] {
		t.Fatalf("cancel of the running head refused")
	}
	d.waitLog("cancelled message at the head of its worker", 30*time.Second)
	waitFor(t, 30*time.Second, "the neighbours done", func() bool { return countStatus(t, s, "done") == 6 })
	if r := row(t, s, hung); r.status != "cancelled" || r.attempts != 0 || r.reason != "" {
		t.Errorf("cancelled head: %+v", r)
	}
	for _, p := range pids {
		if pidAlive(p) {
			t.Errorf("worker %d still alive after its head was cancelled", p)
		}
	}
	if bad := s.count(t, `SELECT count(*) FROM (SELECT id FROM runs GROUP BY id HAVING count(*) > 1) x`); bad != 0 {
		t.Errorf("%d messages ran twice", bad)
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'done' AND attempts = 0`); n != 6 {
		t.Errorf("%d of 6 neighbours done without an attempt charged", n)
	}
	d.stop()
}

func pidAlive(pid int) bool {
	p, err := os.FindProcess(pid)
	return err == nil && p.Signal(syscall.Signal(0)) == nil
}

// TestCancelRunningBehindHead: a cancelled message behind the head is left in the worker's
// queue; when the stage reaches it, its guarded outcome matches nothing: the message stays
// cancelled, the worker lives on.
func TestCancelRunningBehindHead(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	s.exec(t, gateDDL)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 8\nRETRY_DELAY = 60"), "gated")
	warm := insertOne(t, s, "a", `{}`)
	s.exec(t, `INSERT INTO gate VALUES ($1, 'a')`, warm)
	waitFor(t, 30*time.Second, "warm-up done", func() bool { return status(t, s, warm) == "done" })
	head := insertOne(t, s, "a", `{}`)
	behind := insertOne(t, s, "a", `{}`)
	waitIdleInTx(t, s, "UPDATE workqueue SET status = 'done'") // the head's transaction is open
	// The second insert's claim may come after the head's transaction opened (CI saw it
	// pending here once): wait until both are in the worker's queue.
	waitFor(t, 30*time.Second, "the message behind the head claimed", func() bool { return status(t, s, behind) == "running" })
	pids := workerPids(t, d)
	if got := act(t, s.DB, "cancel", behind); !got[behind] {
		t.Fatal("cancel behind the head refused")
	}
	s.exec(t, `INSERT INTO gate VALUES ($1, 'a'), ($2, 'a')`, head, behind)
	waitFor(t, 30*time.Second, "the head done", func() bool { return status(t, s, head) == "done" })
	waitFor(t, 30*time.Second, "no message running", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'running'`) == 0
	})
	if r := row(t, s, behind); r.status != "cancelled" || r.attempts != 0 || r.reason != "" {
		t.Errorf("cancelled message behind the head: %+v", r)
	}
	if n := s.count(t, `SELECT count(*) FROM runs WHERE id = $1`, behind); n != 0 {
		t.Errorf("the cancelled message's run committed")
	}
	for _, p := range pids {
		if !pidAlive(p) {
			t.Errorf("worker %d was stopped, though the cancelled message was not at its head", p)
		}
	}
	d.stop()
}

// TestOperatorLoopAgainstPipeline: while 2,500 messages run through three stages, two
// operators hold and release random messages thousands of times (a hold of a row being
// claimed, a release of a row the claim then takes) and another cancels some. Afterwards:
// every message is done or cancelled; nothing is running, pending or held; no (message, stage)
// ran twice; every hold that succeeded was still in force when released (nobody overwrote
// it); every cancel that succeeded is the message's final state; every message not cancelled
// ran each of its stages exactly once.
func TestOperatorLoopAgainstPipeline(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	d := startDaemon(t, threeStages(t, s), "pipeline")
	const n = 2500
	enqueue(t, s, "a", n, `{"sleep_ms": 3}`)
	lo := int64(s.count(t, `SELECT min(workqueue_id) FROM workqueue`))
	var cancelled sync.Map
	var wg sync.WaitGroup
	stop := make(chan struct{})
	var holds, tries int
	var unreleased []int64
	var mu sync.Mutex
	wg.Add(3)
	for g := uint64(0); g < 2; g++ { // two holders
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(1, g))
			for {
				select {
				case <-stop:
					return
				default:
				}
				var ids []int64
				for k := 0; k < 8; k++ {
					ids = append(ids, lo+rng.Int64N(n))
				}
				held, err := tryAct(s.DB, "hold", ids...)
				if err != nil {
					t.Error(err)
					return
				}
				var back []int64
				for id := range held {
					back = append(back, id)
				}
				released, err := tryAct(s.DB, "release", back...)
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				holds += len(held)
				tries += len(ids)
				for id := range held {
					if !released[id] {
						unreleased = append(unreleased, id)
					}
				}
				mu.Unlock()
			}
		}()
	}
	go func() {
		defer wg.Done()
		rng := rand.New(rand.NewPCG(3, 4))
		for i := 0; i < 60; i++ {
			id := lo + rng.Int64N(n)
			got, err := tryAct(s.DB, "cancel", id)
			if err != nil {
				t.Error(err)
				return
			}
			if got[id] {
				cancelled.Store(id, true)
			}
			time.Sleep(20 * time.Millisecond) // spread the cancels over the run
		}
	}()
	waitFor(t, 120*time.Second, "every message finished", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE status IN ('done', 'cancelled')`) >= n-50
	})
	close(stop)
	wg.Wait()
	waitFor(t, 120*time.Second, "every message done or cancelled", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE status IN ('done', 'cancelled')`) == n
	})
	d.stop()
	t.Logf("%d holds tried, %d succeeded (each released), %d cancels", tries, holds,
		s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'cancelled'`))
	if tries < 2000 || holds < 300 {
		t.Errorf("only %d holds tried, %d succeeded during the run; the race was not exercised", tries, holds)
	}
	// A hold is lost if its release found the row changed, unless the other operator
	// cancelled it meanwhile (held -> cancelled is allowed).
	for _, id := range unreleased {
		if _, ok := cancelled.Load(id); !ok {
			t.Errorf("the hold of message %d was overwritten before its release (now %s)", id, status(t, s, id))
		}
	}
	if bad := s.count(t, `SELECT count(*) FROM (SELECT id, stage FROM runs GROUP BY 1, 2 HAVING count(*) > 1) x`); bad != 0 {
		t.Errorf("%d (message, stage) pairs ran twice", bad)
	}
	cancelled.Range(func(k, _ any) bool {
		if st := status(t, s, k.(int64)); st != "cancelled" {
			t.Errorf("message %d was cancelled but ended %s", k, st)
		}
		return true
	})
	if bad := s.count(t, `SELECT count(*) FROM workqueue w WHERE status = 'done'
	        AND (SELECT count(*) FROM runs r WHERE r.id = w.workqueue_id) <> 3`); bad != 0 {
		t.Errorf("%d done messages did not run each stage exactly once", bad)
	}
	if n := s.count(t, `SELECT count(*) FROM operator_log`); n < holds/8 {
		t.Errorf("operator_log has %d rows for %d holds", n, holds)
	}
}

// TestRetryWhileDispatcherFails: a stage fails every message (MAX_ATTEMPTS = 1: each run ends
// failed) while an operator retries random messages thousands of times. A retry changes only
// a failed row (never the running row the dispatcher is about to fail), and the dispatcher's
// failure write is guarded by its claim: so for every message, runs = 1 + the retries that
// succeeded, and attempts = runs.
func TestRetryWhileDispatcherFails(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 2\nQUEUE_LIMIT = 4\nMAX_ATTEMPTS = 1"), "failing")
	const n = 200
	enqueue(t, s, "a", n, `{}`)
	lo := int64(s.count(t, `SELECT min(workqueue_id) FROM workqueue`))
	retries := map[int64]int{}
	rng := rand.New(rand.NewPCG(5, 6))
	calls := 0
	for total := 0; calls < 3000; calls++ {
		var ids []int64
		for k := 0; k < 4; k++ {
			ids = append(ids, lo+rng.Int64N(n))
		}
		for id := range act(t, s.DB, "retry", ids...) {
			retries[id]++
			total++
		}
	}
	waitFor(t, 120*time.Second, "every message failed", func() bool { return countStatus(t, s, "failed") == n })
	d.stop()
	sum := 0
	for id := lo; id < lo+n; id++ {
		runs := s.count(t, `SELECT count(*) FROM runs WHERE id = $1`, id)
		r := row(t, s, id)
		if runs != 1+retries[id] || r.attempts != runs {
			t.Errorf("message %d: %d runs, %d successful retries, attempts %d; want runs = 1 + retries = attempts",
				id, runs, retries[id], r.attempts)
		}
		sum += retries[id]
	}
	t.Logf("%d retry calls, %d retries succeeded", calls, sum)
	if sum < 200 {
		t.Errorf("only %d retries succeeded: the race was not exercised", sum)
	}
}

// waitShownGone waits until the gauge reads 0 on /metrics, then requires the console's
// overview to show no element with the id that told of it.
func waitShownGone(t *testing.T, addr, gauge, id string) {
	t.Helper()
	waitFor(t, 5*time.Second, gauge+" back to 0 on /metrics", func() bool {
		v, ok := metric(t, addr, gauge)
		return ok && v == 0
	})
	if page := consoleOverview(t, addr); strings.Contains(page, `id="`+id+`"`) {
		t.Errorf("the console's overview still shows #%s with %s at 0:\n%s", id, gauge, page)
	}
}

// metricClient keeps no connection between scrapes: each kept would be a goroutine and a
// descriptor of the daemon's (TestLongRunLeavesNoTrace counts them).
var metricClient = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}

// metric reads one sample of the daemon's /metrics.
func metric(t testing.TB, addr, name string) (float64, bool) {
	t.Helper()
	resp, err := metricClient.Get("http://" + addr + "/metrics")
	if err != nil {
		return 0, false
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + ` ([0-9.e+-]+)$`)
	m := re.FindSubmatch(body)
	if m == nil {
		return 0, false
	}
	v, err := strconv.ParseFloat(string(m[1]), 64)
	return v, err == nil
}

// TestPauseUnderLoad: pausing stage b while a backlog flows a -> b stops b's claims at once
// (b's messages already in workers' queues finish), stage a goes on with the same workers;
// /metrics, queue_status and the log show it; the pause survives a restart of the dispatcher;
// resume lets everything finish, each (message, stage) once.
func TestPauseUnderLoad(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	addr := freePort(t)
	conf := baseConf(s, "METRICS_LISTEN = "+addr) +
		stageConf(t, "a", "b", "PARALLELISM = 2\nQUEUE_LIMIT = 8") +
		stageConf(t, "b", "", "PARALLELISM = 2\nQUEUE_LIMIT = 8")
	d := startDaemon(t, conf, "pipeline")
	const n = 3000
	enqueue(t, s, "a", n, `{"sleep_ms": 3}`)
	waitFor(t, 60*time.Second, "b under way", func() bool {
		return s.count(t, `SELECT count(*) FROM runs WHERE stage = 'b'`) > 50
	})
	s.exec(t, `SELECT * FROM queue_pause('b')`)
	d.waitLog(`stage paused`, 30*time.Second)
	// What b had claimed before the pause finishes; then nothing more is claimed there.
	waitFor(t, 30*time.Second, "b's queues drained", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE stage = 'b' AND status = 'running'`) == 0
	})
	bRuns := s.count(t, `SELECT count(*) FROM runs WHERE stage = 'b'`)
	aPids := s.count(t, `SELECT count(DISTINCT pid) FROM runs WHERE stage = 'a'`)
	aRuns := s.count(t, `SELECT count(*) FROM runs WHERE stage = 'a'`)
	waitFor(t, 60*time.Second, "a going on while b is paused", func() bool {
		return s.count(t, `SELECT count(*) FROM runs WHERE stage = 'a'`) >= aRuns+300
	})
	if got := s.count(t, `SELECT count(*) FROM runs WHERE stage = 'b'`); got != bRuns {
		t.Errorf("b ran %d more messages while paused", got-bRuns)
	}
	if s.count(t, `SELECT count(*) FROM workqueue WHERE stage = 'b' AND status = 'running'`) != 0 {
		t.Error("b claimed while paused")
	}
	if got := s.count(t, `SELECT count(DISTINCT pid) FROM runs WHERE stage = 'a'`); got != aPids {
		t.Errorf("stage a's workers changed with b's pause: %d worker pids, were %d", got, aPids)
	}
	if strings.Contains(d.log.String(), "retiring workers") {
		t.Error("the pause retired workers")
	}
	waitFor(t, 10*time.Second, "pepsi_stage_paused on /metrics", func() bool {
		v, ok := metric(t, addr, `pepsi_stage_paused{stage="b"}`)
		return ok && v == 1
	})
	if v, ok := metric(t, addr, `pepsi_stage_paused{stage="a"}`); !ok || v != 0 {
		t.Errorf(`pepsi_stage_paused{stage="a"} = %v (present %v), want 0`, v, ok)
	}
	if p := s.count(t, `SELECT count(*) FROM queue_status() WHERE stage = 'b' AND stage_paused`); p != 1 {
		t.Error("queue_status does not show b paused")
	}
	// A restart keeps the pause.
	d.stop()
	d = startDaemon(t, conf, "pipeline")
	d.waitLog("stage is paused", 30*time.Second)
	waitFor(t, 120*time.Second, "a finished", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE stage = 'a'`) == 0
	})
	if got := s.count(t, `SELECT count(*) FROM runs WHERE stage = 'b'`); got != bRuns {
		t.Errorf("b ran %d messages after the restart while paused", got-bRuns)
	}
	s.exec(t, `SELECT * FROM queue_resume('b')`)
	d.waitLog("stage resumed", 30*time.Second)
	waitFor(t, 120*time.Second, "all done after resume", func() bool { return countStatus(t, s, "done") == n })
	d.stop()
	if bad := s.count(t, `SELECT count(*) FROM (SELECT id, stage FROM runs GROUP BY 1, 2 HAVING count(*) <> 1) x`); bad != 0 {
		t.Errorf("%d (message, stage) pairs ran other than once", bad)
	}
}

// buildQueueTool builds cmd/pepsi-queue once per test binary.
var queueTool = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "pepsi-test-queue-")
	if err != nil {
		return "", err
	}
	out := filepath.Join(dir, "pepsi-queue")
	if b, err := exec.Command("go", "build", "-o", out, "./cmd/pepsi-queue").CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/pepsi-queue: %v\n%s", err, b)
	}
	return out, nil
})

// TestOperateActionRefusedRow: for each of the five actions, one of three rows is one the
// database refuses to change by itself: an application's trigger refuses any status change of
// a message its payload marks "locked", and its audit table references the row to delete
// (a foreign key without ON DELETE). The other two rows change; the refused one is left as it
// was and reported refused, with what the database said; the operator log counts the two.
// Before, the refusal failed the whole call: nothing changed, and pepsi-queue stopped at that
// batch with an error, the console's action likewise.
func TestOperateActionRefusedRow(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `CREATE FUNCTION app_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
	    BEGIN
	        RAISE EXCEPTION 'message % is locked by the application', OLD.workqueue_id;
	    END $$`)
	s.exec(t, `CREATE TRIGGER app_refuse BEFORE UPDATE OF status ON workqueue FOR EACH ROW
	    WHEN (OLD.payload ? 'locked') EXECUTE FUNCTION app_refuse()`)
	s.exec(t, `CREATE TABLE app_audit (id bigint NOT NULL REFERENCES workqueue (workqueue_id))`)
	for _, c := range []struct{ action, from, to, said string }{
		{"retry", "failed", "pending", "is locked by the application"},
		{"hold", "pending", "held", "is locked by the application"},
		{"release", "held", "pending", "is locked by the application"},
		{"cancel", "pending", "cancelled", "is locked by the application"},
		{"delete", "done", "", "app_audit_id_fkey"}, // the constraint's name: the words follow lc_messages
	} {
		var ids []int64
		for i := range 3 {
			payload := `{}`
			if i == 1 && c.action != "delete" {
				payload = `{"locked": true}`
			}
			var id int64
			if err := s.DB.QueryRow(`INSERT INTO workqueue (stage, status, payload) VALUES ('a', $1, $2)
			        RETURNING workqueue_id`, c.from, payload).Scan(&id); err != nil {
				t.Fatal(err)
			}
			ids = append(ids, id)
		}
		if c.action == "delete" {
			s.exec(t, `INSERT INTO app_audit VALUES ($1)`, ids[1])
		}
		rows, err := s.DB.Query(`SELECT workqueue_id, ok, coalesce(status, ''), coalesce(reason, '')
		        FROM queue_`+c.action+`(p_ids => $1, p_actor => 'test')`, pq.Array(ids))
		if err != nil {
			t.Fatalf("queue_%s with one row the database refuses: %v", c.action, err)
		}
		got := map[int64]string{}
		for rows.Next() {
			var id int64
			var ok bool
			var st, reason string
			if err := rows.Scan(&id, &ok, &st, &reason); err != nil {
				t.Fatal(err)
			}
			if ok != (id != ids[1]) {
				t.Errorf("%s: row %d ok = %v, want %v (reason %q)", c.action, id, ok, id != ids[1], reason)
			}
			got[id] = reason
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		rows.Close()
		if r := got[ids[1]]; !strings.HasPrefix(r, "the database refused the change: ") || !strings.Contains(r, c.said) {
			t.Errorf("%s: the refused row's reason is %q, want the database's refusal (%q)", c.action, r, c.said)
		}
		for i, id := range ids {
			want := c.to
			if i == 1 {
				want = c.from
			}
			var st string
			err := s.DB.QueryRow(`SELECT status FROM workqueue WHERE workqueue_id = $1`, id).Scan(&st)
			if want == "" && err != sql.ErrNoRows || want != "" && (err != nil || st != want) {
				t.Errorf("%s: row %d is %q (%v), want %q", c.action, id, st, err, want)
			}
		}
		if n := s.count(t, `SELECT changed FROM operator_log ORDER BY id DESC LIMIT 1`); n != 2 {
			t.Errorf("%s: the operator log says %d changed, want 2", c.action, n)
		}
	}

	// A batch as pepsi-queue sends it: 1,000 rows, three of them refused (found by halving).
	var ids []int64
	if err := s.DB.QueryRow(`WITH i AS (INSERT INTO workqueue (stage, status, payload)
	        SELECT 'a', 'failed', CASE WHEN n IN (1, 500, 1000) THEN '{"locked": true}' ELSE '{}' END::jsonb
	          FROM generate_series(1, 1000) AS n RETURNING workqueue_id)
	    SELECT array_agg(workqueue_id ORDER BY workqueue_id) FROM i`).Scan(pq.Array(&ids)); err != nil {
		t.Fatal(err)
	}
	var ok, refused int
	if err := s.DB.QueryRow(`SELECT count(*) FILTER (WHERE ok),
	        count(*) FILTER (WHERE NOT ok AND reason LIKE 'the database refused the change: %')
	   FROM queue_retry(p_ids => $1)`, pq.Array(ids)).Scan(&ok, &refused); err != nil {
		t.Fatalf("queue_retry of 1,000 rows, three refused: %v", err)
	}
	if ok != 997 || refused != 3 {
		t.Errorf("queue_retry of 1,000 rows, three refused: %d ok, %d refused by the database; want 997 and 3", ok, refused)
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = ANY ($1) AND status = 'failed'
	        AND payload ? 'locked'`, pq.Array(ids)); n != 3 {
		t.Errorf("%d of the three refused rows still failed, want 3", n)
	}
}

// TestBulkRetryBesideBacklog: 100,000 failed rows are retried with pepsi-queue while the
// dispatcher drains a backlog at the same stage. The retry works in batches of 1,000, each its
// own transaction, so the dispatcher never waits long for a lock (sampled from
// pg_stat_activity while the retry runs), and the longest claim statement (/metrics) stays
// close to the longest before it; every row ends done, each run once.
func TestBulkRetryBesideBacklog(t *testing.T) {
	if testing.Short() {
		t.Skip("100,000 rows")
	}
	tool, err := queueTool()
	if err != nil {
		t.Fatal(err)
	}
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	addr := freePort(t)
	const failed, backlog = 100000, 10000
	s.exec(t, `INSERT INTO workqueue (stage, status, attempts, state)
	        SELECT 'a', 'failed', 5, '{"dispatch_error": "stage a: status 75: relay down"}' FROM generate_series(1, $1)`, failed)
	s.exec(t, `ANALYZE workqueue`)
	d := startDaemon(t, baseConf(s, "METRICS_LISTEN = "+addr)+stageConf(t, "a", "", "PARALLELISM = 2\nQUEUE_LIMIT = 256"), "pipeline")
	enqueue(t, s, "a", backlog, `{}`)
	waitFor(t, 60*time.Second, "the backlog under way", func() bool {
		return s.count(t, `SELECT count(*) FROM runs`) > 2000
	})
	before, _ := metric(t, addr, "pepsi_claim_seconds_max")
	// While the retry runs, sample the dispatcher's sessions for lock waits (the claim is on
	// its lock connection): the longest stretch of consecutive samples that saw one waiting.
	sampling := make(chan struct{})
	var lockWait time.Duration
	var samples int
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		var since time.Time
		for {
			select {
			case <-sampling:
				return
			default:
			}
			var waiting bool
			if err := s.DB.QueryRow(`SELECT count(*) > 0 FROM pg_stat_activity
			        WHERE application_name LIKE 'pepsi-dispatch%' AND wait_event_type = 'Lock'`).Scan(&waiting); err != nil {
				continue
			}
			samples++
			now := time.Now()
			switch {
			case waiting && since.IsZero():
				since = now
			case waiting:
				lockWait = max(lockWait, now.Sub(since))
			default:
				since = time.Time{}
			}
		}
	}()
	cmd := exec.Command(tool, "retry", "--status", "failed", "--all", "--yes")
	cmd.Env = append(os.Environ(), "PEPSI_DSN="+s.DSN)
	start := time.Now()
	out, err := cmd.CombinedOutput()
	took := time.Since(start)
	close(sampling)
	<-sampled
	if err != nil || !strings.Contains(string(out), "100000 of 100000 messages retried") {
		t.Fatalf("pepsi-queue retry: %v\n%s", err, out)
	}
	waitFor(t, 600*time.Second, "every row done", func() bool { return countStatus(t, s, "done") == failed+backlog })
	during, ok := metric(t, addr, "pepsi_claim_seconds_max")
	d.stop()
	if !ok {
		t.Fatal("no pepsi_claim_seconds_max on /metrics")
	}
	t.Logf("bulk retry of %d rows took %v beside a %d-row backlog; longest claim statement before it %.1f ms, over the whole run %.1f ms; "+
		"longest lock wait of the dispatcher seen during the retry %v (%d samples)",
		failed, took.Round(time.Millisecond), backlog, before*1000, during*1000, lockWait, samples)
	if lockWait > time.Second {
		t.Errorf("the dispatcher waited %v for a lock during the bulk retry", lockWait)
	}
	if bad := s.count(t, `SELECT count(*) FROM (SELECT id FROM runs GROUP BY 1 HAVING count(*) <> 1) x`); bad != 0 {
		t.Errorf("%d messages ran other than once", bad)
	}
	if n := s.count(t, `SELECT count(*) FROM operator_log`); n != failed/1000 {
		t.Errorf("operator_log: %d rows, want one per batch of 1,000", n)
	}
	// A few milliseconds on an idle machine; this one is shared, so the bound is loose, but a
	// claim stalled behind one transaction over all 100,000 rows (seconds) fails it.
	if during > before+0.5 {
		t.Errorf("the longest claim grew from %.1f ms to %.1f ms during the bulk retry", before*1000, during*1000)
	}
}

// TestPauseFusedStage: pausing a stage that its predecessor's workers run fused (FUSE = yes)
// stops those passes too: the predecessor's workers are retired to take a fuse list without
// it, its messages stop at it, pending; resume fuses it again.
func TestPauseFusedStage(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	d := startDaemon(t, fusionConf(t, s), "fusion")
	enqueue(t, s, "a", 20, `{}`)
	waitFor(t, 30*time.Second, "the first 20 done", func() bool { return countStatus(t, s, "done") == 20 })
	s.exec(t, `SELECT * FROM queue_pause('b')`)
	d.waitLog("stage paused", 30*time.Second)
	d.waitLog("retiring them", 30*time.Second)
	enqueue(t, s, "a", 20, `{}`)
	waitFor(t, 30*time.Second, "20 pending at the paused b", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE stage = 'b' AND status = 'pending'`) == 20
	})
	if n := s.count(t, `SELECT count(*) FROM runs WHERE stage = 'b'`); n != 20 {
		t.Errorf("b ran %d times, want 20: it ran fused while paused", n)
	}
	s.exec(t, `SELECT * FROM queue_resume('b')`)
	waitFor(t, 30*time.Second, "all 40 done", func() bool { return countStatus(t, s, "done") == 40 })
	d.stop()
	if bad := s.count(t, `SELECT count(*) FROM (SELECT id, stage FROM runs GROUP BY 1, 2 HAVING count(*) <> 1) x`); bad != 0 {
		t.Errorf("%d (message, stage) pairs ran other than once", bad)
	}
}

// TestOperatePlansStaleStatistics: the operator's actions by id are plpgsql and SQL functions,
// and plpgsql keeps a generic plan after five calls, planned for the table as it was then (the
// console's pooled sessions make many calls). The split functions' generic plans scanned
// the table whole once it had grown (TestFaninSplitPlansStaleStatistics); the actions must
// go on finding their rows by key: a session acts on a small table until the plans are
// generic, the table grows a thousandfold without an ANALYZE, and the same actions then scan
// neither workqueue nor fanout sequentially (the transaction's own counters).
func TestOperatePlansStaleStatistics(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `ALTER TABLE workqueue SET (autovacuum_enabled = false)`)
	s.exec(t, `INSERT INTO workqueue (stage, status) SELECT 'a', 'pending' FROM generate_series(1, 100)`)
	ctx := context.Background()
	tx, seqScans := staleStatsTx(t, s)
	// round acts on ids: hold, release, hold, cancel, retry, cancel, delete; and shows them.
	round := func(ids []int64, check bool) {
		t.Helper()
		for _, action := range []string{"hold", "release", "hold", "cancel", "retry", "cancel", "delete", "show"} {
			before := seqScans()
			if _, err := tx.ExecContext(ctx, `SELECT * FROM queue_`+action+`($1)`, pq.Array(ids)); err != nil {
				t.Fatalf("queue_%s: %v", action, err)
			}
			if n := seqScans() - before; check && n != 0 {
				t.Fatalf("queue_%s on a table grown since its statistics: %d sequential scans of workqueue or fanout, want none", action, n)
			}
		}
	}
	for i := int64(0); i < 10; i++ {
		round([]int64{1 + 3*i, 2 + 3*i, 3 + 3*i}, false)
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO workqueue (stage) SELECT 'a' FROM generate_series(1, 100000)`); err != nil {
		t.Fatal(err)
	}
	for i := int64(0); i < 10; i++ {
		round([]int64{50001 + 3*i, 50002 + 3*i, 50003 + 3*i}, true)
	}
}

// TestOperateErrorsByIndex holds queue_errors (the console's failures page, at every load;
// pepsi-queue errors) to the partial indexes of failed, paused, held and cancelled rows: it was
// one scan of the whole table, done rows and all. Only a status without such an index (pending
// here) reads the table. Its groups stay what they were: without a status in the filter, the
// failed and paused rows with an error, per signature; the statuses the filter names otherwise.
func TestOperateErrorsByIndex(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `ALTER TABLE workqueue SET (autovacuum_enabled = false)`)
	s.exec(t, `INSERT INTO workqueue (stage, status) SELECT 'a', 'done' FROM generate_series(1, 20000)`)
	s.exec(t, `INSERT INTO workqueue (stage, status, state)
	           SELECT 'a', 'failed', jsonb_build_object('dispatch_error', 'exit status ' || i) FROM generate_series(1, 3) i`)
	s.exec(t, `INSERT INTO workqueue (stage, status, state) VALUES
	           ('b', 'paused', '{"dispatch_error": "exit status 9"}'),
	           ('b', 'failed', '{"dispatch_error": "relay 10.0.0.1:25 down"}'),
	           ('b', 'held', '{"dispatch_error": "relay 10.0.0.2:25 down"}'),
	           ('b', 'pending', '{"dispatch_error": "exit status 7"}'),
	           ('b', 'failed', '{}')`)
	tx, seqScans := staleStatsTx(t, s)
	groups := func(filter string) map[string]int64 {
		t.Helper()
		rows, err := tx.Query(`SELECT pattern, count FROM queue_errors($1::jsonb)`, filter)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		out := map[string]int64{}
		for rows.Next() {
			var p string
			var n int64
			if err := rows.Scan(&p, &n); err != nil {
				t.Fatal(err)
			}
			out[p] = n
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return out
	}
	for _, tc := range []struct {
		filter string
		want   map[string]int64
		scan   bool // a status without a partial index reads the table
	}{
		{`{}`, map[string]int64{"exit status <n>": 4, "relay <ip> down": 1}, false},
		{`{"stage": "b"}`, map[string]int64{"exit status <n>": 1, "relay <ip> down": 1}, false},
		{`{"signature": "` + errorSignatureOf(t, tx, "exit status 1") + `"}`, map[string]int64{"exit status <n>": 4}, false},
		{`{"status": "held"}`, map[string]int64{"relay <ip> down": 1}, false},
		{`{"status": "failed, held"}`, map[string]int64{"exit status <n>": 3, "relay <ip> down": 2}, false},
		{`{"status": "cancelled"}`, map[string]int64{}, false},
		{`{"status": "pending,failed", "stage": "b"}`, map[string]int64{"exit status <n>": 1, "relay <ip> down": 1}, true},
		{`{"status": ""}`, map[string]int64{}, false},
	} {
		before := seqScans()
		if got := groups(tc.filter); !maps.Equal(got, tc.want) {
			t.Errorf("queue_errors(%s): got %v, want %v", tc.filter, got, tc.want)
		}
		if n := seqScans() - before; !tc.scan && n != 0 {
			t.Errorf("queue_errors(%s) scanned workqueue %d times, want none (the partial indexes of the statuses)", tc.filter, n)
		}
	}
}

// errorSignatureOf is error_signature(text), from the schema.
func errorSignatureOf(t *testing.T, tx *sql.Tx, text string) string {
	t.Helper()
	var sig string
	if err := tx.QueryRow(`SELECT error_signature($1)`, text).Scan(&sig); err != nil {
		t.Fatal(err)
	}
	return sig
}

// TestOperateSelectByIndex: queue_select (every --all selection of pepsi-queue, the console's
// search and group actions) reads the failed, paused, held and cancelled rows a filter keeps
// to from their own index, in id order, a page at a time: a page of "--status failed" or of a
// signature (failed and paused) was a walk of the table until it had found its rows. Every filter's pages must still be exactly the rows
// that pass it, in id order, whichever statuses it names.
func TestOperateSelectByIndex(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `ALTER TABLE workqueue SET (autovacuum_enabled = false)`)
	s.exec(t, `INSERT INTO workqueue (stage, status, state)
	           SELECT CASE WHEN i % 2 = 0 THEN 'a' ELSE 'b' END,
	                  CASE WHEN i % 997 = 0 THEN 'failed' WHEN i % 991 = 0 THEN 'held'
	                       WHEN i % 983 = 0 THEN 'cancelled' WHEN i % 977 = 0 THEN 'paused'
	                       WHEN i % 971 = 0 THEN 'pending' ELSE 'done' END,
	                  CASE WHEN i % 3 = 0 THEN jsonb_build_object('dispatch_error', 'relay 10.0.0.' || i % 7 || ':25 down')
	                       ELSE jsonb_build_object('dispatch_error', 'exit status ' || i) END
	             FROM generate_series(1, 30000) i`)
	tx, seqScans := staleStatsTx(t, s)
	sig := errorSignatureOf(t, tx, "relay 10.0.0.1:25 down")
	var stopped int64 // the rows of the indexed statuses: a page reads its statuses' rows at most
	if err := tx.QueryRow(`SELECT count(*) FROM workqueue WHERE status IN ('failed', 'paused', 'held', 'cancelled')`).Scan(&stopped); err != nil {
		t.Fatal(err)
	}
	ids := func(query string, args ...any) []int64 { t.Helper(); return idsOf(t, tx, query, args...) }
	for _, tc := range []struct {
		filter string
		scan   bool // a status without an ordered index (or none named) reads the table
	}{
		{`{"status": "failed"}`, false},
		{`{"status": "failed, held"}`, false},
		{`{"status": "cancelled", "stage": "b"}`, false},
		{`{"status": "failed", "id_from": 5000, "id_to": 20000}`, false},
		{`{"status": "held", "error": "relay"}`, false},
		{`{"status": ""}`, false},
		{`{"status": "pending,failed"}`, true},
		{`{"signature": "` + sig + `"}`, false},
		{`{"status": "paused,cancelled", "stage": "a"}`, false},
		{`{"error": "relay", "stage": "a"}`, true},
		{`{}`, true},
	} {
		want := ids(`SELECT w.workqueue_id FROM workqueue w WHERE queue_match(w, $1::jsonb) ORDER BY 1`, tc.filter)
		var got []int64
		size := max(7, len(want)/20) // pages of a few rows, and not thousands of pages
		before, readBefore := seqScans(), tuplesRead(t, tx)
		for after := int64(0); ; {
			page := ids(`SELECT queue_select($1::jsonb, $2, $3)`, tc.filter, after, size)
			got = append(got, page...)
			if len(page) < size {
				break
			}
			after = page[len(page)-1]
		}
		// A walk of the primary key is no sequential scan: the rows it read tell it.
		if n, read := seqScans()-before, tuplesRead(t, tx)-readBefore; !tc.scan && (n != 0 || read > 2*stopped) {
			t.Errorf("queue_select(%s) scanned workqueue %d times and read %d rows (%d match), want no scan and no more than the %d rows of the indexed statuses, twice (workqueue_stopped)",
				tc.filter, n, read, len(want), stopped)
		}
		if !slices.Equal(got, want) || (len(want) == 0 && tc.filter != `{"status": ""}`) {
			t.Errorf("queue_select(%s), pages of %d: got %d ids %v, want %d %v", tc.filter, size, len(got), got, len(want), want)
		}
	}
}

// tuplesRead is how many rows of workqueue the transaction has read so far, by sequential
// scans and through indexes (pg_stat_xact_user_tables).
func tuplesRead(t *testing.T, tx *sql.Tx) (n int64) {
	t.Helper()
	if err := tx.QueryRow(`SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)
	    FROM pg_stat_xact_user_tables WHERE relid = 'workqueue'::regclass`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestOperatorActionDeadlockRetried: an operator's hold of two pending rows meets another
// transaction that locks them in the other order (as the claim, a stage's outcome statement or
// another operator's call planned otherwise may): the deadlock aborts the operator's write, the
// first to wait, and the function runs it again once the other transaction has its rows, so
// that both rows are held and the call succeeds. Before, the call failed with 40P01 (seen in
// TestOperatorLoopAgainstPipeline) and nothing was held.
func TestOperatorActionDeadlockRetried(t *testing.T) {
	s := newTestSchema(t)
	a, b := insertOne(t, s, "a", `{}`), insertOne(t, s, "a", `{}`)
	other, err := s.DB.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer other.Rollback()
	// Which side of a deadlock is aborted is the one whose deadlock_timeout runs out first
	// once the cycle exists; a side whose check ran before it existed does not check again.
	// With the server's 1 s for both, a slow poll below let the hold's check run before the
	// other transaction's second UPDATE, and that UPDATE was the one aborted (the server
	// settings' pass of a CI). The other side waits 60 s; the hold checks after 5 s.
	if _, err := other.Exec(`SET LOCAL deadlock_timeout = '60s'`); err != nil {
		t.Fatal(err)
	}
	if _, err := other.Exec(`UPDATE workqueue SET state = '{"touched": 1}' WHERE workqueue_id = $1`, b); err != nil {
		t.Fatal(err)
	}
	holder, err := s.DB.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	if _, err := holder.ExecContext(context.Background(), `SET deadlock_timeout = '5s'`); err != nil {
		t.Fatal(err)
	}
	type result struct {
		held map[int64]bool
		err  error
	}
	done := make(chan result, 1)
	go func() {
		held, err := tryAct(holder, "hold", a, b) // locks a, then waits for b
		done <- result{held, err}
	}()
	waitFor(t, 10*time.Second, "the hold waiting for the other transaction's row", func() bool {
		return s.count(t, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%queue_hold%'`) == 1
	})
	// The other transaction now wants a, which the hold has: a deadlock, which the hold (the
	// first to wait) finds and gives up, its lock on a with it.
	if _, err := other.Exec(`UPDATE workqueue SET state = '{"touched": 2}' WHERE workqueue_id = $1`, a); err != nil {
		t.Fatalf("the other transaction's second row: %v", err)
	}
	if err := other.Commit(); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil {
		t.Fatalf("the hold that met a deadlock: %v", r.err)
	}
	if !r.held[a] || !r.held[b] || status(t, s, a) != "held" || status(t, s, b) != "held" {
		t.Errorf("held %v; statuses %s, %s; want both held", r.held, status(t, s, a), status(t, s, b))
	}
}
