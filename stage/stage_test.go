// stage_test.go: the SDK against a real PostgreSQL, driven through Serve with pipes, and Run
// driven as a process (the test binary impersonates a stage program).
//
// The run's PostgreSQL is PEPSI_TEST_DSN (a key=value DSN) when set, else a private cluster
// started with ../scripts/pg-private and stopped at the end. Every test gets its own schema
// with ../schema.sql applied.

package stage

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/lib/pq"

	"pepsi-dispatch/internal/pgtest"
)

// waitTimeout bounds every wait of the tests; nothing waits on time otherwise.
const waitTimeout = 20 * time.Second

func TestMain(m *testing.M) {
	// Impersonation first: the stage program is started as `EXE -c FILE worker`, which the
	// testing flags would reject.
	if os.Getenv("PEPSI_SDK_TEST_RUN") != "" {
		Run(func(ctx context.Context, m *Message) error {
			m.State["by"] = "run"
			m.State["procs"] = runtime.GOMAXPROCS(0)
			if strings.Contains(string(m.Payload), "stdin") { // TestRunProcess
				child := exec.Command("sh", "-c", `echo child reading >&2; read line; echo "child read: [$line]" >&2`)
				child.Stdin, child.Stderr = os.Stdin, os.Stderr
				if err := child.Run(); err != nil {
					return err
				}
			}
			if strings.Contains(string(m.Payload), "print") { // TestRunProcess
				fmt.Println("debug: a handler's print")
				child := exec.Command("sh", "-c", "echo debug: a child of the handler")
				child.Stdout = os.Stdout
				if err := child.Run(); err != nil {
					return err
				}
			}
			return m.Advance("b")
		})
	}
	before := runtime.NumGoroutine()
	code := m.Run()
	testPG.Stop()
	if code == 0 {
		code = pgtest.CheckGoroutineLeaks(before)
	}
	os.Exit(code)
}

// testPG is the run's PostgreSQL (internal/pgtest: shared with the daemon's tests).
var testPG = pgtest.New("..")

// schema is one test's copy of schema.sql.
type schema struct {
	name string
	dsn  string // for the stage under test: search_path and an application_name of its own
	db   *sql.DB
}

func newSchema(t *testing.T) *schema {
	t.Helper()
	name, dsn, db := testPG.Schema(t, "sdk")
	sch := &schema{
		name: name,
		dsn:  fmt.Sprintf("%s application_name=pepsi-%s", dsn, name),
		db:   db,
	}
	sch.exec(t, `CREATE TABLE side (id bigint PRIMARY KEY, note text)`)
	return sch
}

func (s *schema) exec(t testing.TB, q string, args ...any) {
	t.Helper()
	pgtest.Exec(t, s.db, q, args...)
}

// ids returns the one bigint column of q's rows.
func (s *schema) ids(t testing.TB, q string, args ...any) []int64 {
	t.Helper()
	rows, err := s.db.Query(q, args...)
	if err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	defer rows.Close()
	var ids []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		ids = append(ids, id)
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	return ids
}

func (s *schema) int(t testing.TB, q string, args ...any) int {
	t.Helper()
	return pgtest.Int(t, s.db, q, args...)
}

// put inserts a row as the dispatcher's claim would leave it and returns its id.
// explain returns the plan PostgreSQL makes for q, one line per row of EXPLAIN.
func (s *schema) explain(t testing.TB, q string) string {
	t.Helper()
	rs, err := s.db.Query("EXPLAIN " + q)
	if err != nil {
		t.Fatalf("explain: %v", err)
	}
	defer rs.Close()
	var plan []string
	for rs.Next() {
		var line string
		if err := rs.Scan(&line); err != nil {
			t.Fatalf("explain: scan: %v", err)
		}
		plan = append(plan, line)
	}
	if err := rs.Err(); err != nil {
		t.Fatalf("explain: %v", err)
	}
	return strings.Join(plan, "\n")
}

func (s *schema) put(t testing.TB, stage, status, payload string) int64 {
	t.Helper()
	var id int64
	err := s.db.QueryRow(`INSERT INTO workqueue (stage, status, payload, state)
		VALUES ($1, $2, $3::jsonb, '{"orig": 1}') RETURNING workqueue_id`, stage, status, payload).Scan(&id)
	if err != nil {
		t.Fatalf("insert row: %v", err)
	}
	return id
}

// rowOf is a row's stage, status and state, as text.
func (s *schema) rowOf(t testing.TB, id int64) (stage, status, state string) {
	t.Helper()
	err := s.db.QueryRow(`SELECT stage, status, state::text FROM workqueue WHERE workqueue_id = $1`, id).
		Scan(&stage, &status, &state)
	if err != nil {
		t.Fatalf("row %d: %v", id, err)
	}
	return stage, status, state
}

// recorder is Serve's stdout: it keeps every Write apart, to check that a batch's replies
// come in one.
type recorder struct {
	mu     sync.Mutex
	writes [][]byte
	notify chan struct{} // one token per Write; buffered past any test's needs
}

func newRecorder() *recorder { return &recorder{notify: make(chan struct{}, 1024)} }

func (r *recorder) Write(p []byte) (int, error) {
	r.mu.Lock()
	r.writes = append(r.writes, bytes.Clone(p))
	r.mu.Unlock()
	r.notify <- struct{}{}
	return len(p), nil
}

func (r *recorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.writes)
}

// serving is one Serve under test.
type serving struct {
	in   *io.PipeWriter
	out  *recorder
	done chan error
	sess *session
	seen int // lines of out already returned by replies
}

// serve starts Serve for stage "a" with NEXT "b c" and stops it at the end of the test.
// (Serve is ServeStages with the one handler: serveFused does the work.)
func serve(t *testing.T, sch *schema, h Handler) *serving {
	t.Helper()
	return serveFused(t, sch, Config{Stage: "a", Next: []string{"b", "c"}}, map[string]Handler{"a": h})
}

// send writes ids to Serve's stdin in one write.
func (sv *serving) send(t testing.TB, ids ...int64) {
	t.Helper()
	var b strings.Builder
	for _, id := range ids {
		fmt.Fprintf(&b, "%d\n", id)
	}
	sv.sendRaw(t, b.String())
}

func (sv *serving) sendRaw(t testing.TB, s string) {
	t.Helper()
	if _, err := io.WriteString(sv.in, s); err != nil {
		t.Fatalf("write ids: %v", err)
	}
}

// replies waits for the next n status lines.
func (sv *serving) replies(t testing.TB, n int) []string {
	t.Helper()
	deadline := time.After(waitTimeout)
	for {
		sv.out.mu.Lock()
		var all []string
		for _, w := range sv.out.writes {
			all = append(all, strings.Split(strings.TrimSuffix(string(w), "\n"), "\n")...)
		}
		sv.out.mu.Unlock()
		if len(all) >= sv.seen+n {
			got := all[sv.seen : sv.seen+n]
			sv.seen += n
			return got
		}
		select {
		case <-sv.out.notify:
		case err := <-sv.done:
			sv.done <- err // for the cleanup
			t.Fatalf("serve ended (%v) with %d of %d replies", err, len(all)-sv.seen, n)
		case <-deadline:
			t.Fatalf("timed out waiting for %d replies, have %d", n, len(all)-sv.seen)
		}
	}
}

// end closes stdin and returns Serve's result.
func (sv *serving) end(t testing.TB) error {
	t.Helper()
	sv.in.Close()
	return sv.wait(t)
}

func (sv *serving) wait(t testing.TB) error {
	t.Helper()
	select {
	case err := <-sv.done:
		sv.done <- err // for the cleanup
		return err
	case <-time.After(waitTimeout):
		t.Fatal("timed out waiting for serve to return")
		return nil
	}
}

func wantFailure(t testing.TB, reply, substr string) {
	t.Helper()
	if !strings.HasPrefix(reply, "1 ") || !strings.Contains(reply, substr) {
		t.Errorf("reply %q: want a failure mentioning %q", reply, substr)
	}
}

func TestOutcomes(t *testing.T) {
	sch := newSchema(t)
	adv := sch.put(t, "a", "running", `{"op": "advance"}`)
	done := sch.put(t, "a", "running", `{"op": "done"}`)
	deferred := sch.put(t, "a", "running", `{"op": "defer"}`)
	// DeferFor, kept for the batch's outcome statement, and written at once after a statement
	// of the handler's (the savepoint open).
	deferredFor := sch.put(t, "a", "running", `{"op": "for"}`)
	deferredForTx := sch.put(t, "a", "running", `{"op": "for", "tx": true}`)
	until := time.Date(2031, 2, 3, 4, 5, 6, 789000000, time.UTC)
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		m.State["seen_by"] = m.Stage
		m.State["attempts"] = m.Attempts
		switch {
		case strings.Contains(string(m.Payload), `"for"`):
			if strings.Contains(string(m.Payload), "tx") {
				if _, err := m.Tx.ExecContext(ctx, `SELECT 1`); err != nil {
					return err
				}
			}
			return m.DeferFor(time.Hour)
		case strings.Contains(string(m.Payload), "advance"):
			return m.Advance("c")
		case strings.Contains(string(m.Payload), "done"):
			return m.Done()
		default:
			return m.Defer(until)
		}
	})
	sv.send(t, adv, done, deferred, deferredFor, deferredForTx)
	// A message that finished says so ("0 done": the dispatcher counts it); the others say "0".
	for i, r := range sv.replies(t, 5) {
		if want := []string{"0", "0 done", "0", "0", "0"}[i]; r != want {
			t.Errorf("reply %d = %q, want %q", i, r, want)
		}
	}
	for _, c := range []struct {
		id            int64
		stage, status string
	}{{adv, "c", "pending"}, {done, "a", "done"}, {deferred, "a", "paused"}, {deferredFor, "a", "paused"}, {deferredForTx, "a", "paused"}} {
		stage, status, state := sch.rowOf(t, c.id)
		if stage != c.stage || status != c.status {
			t.Errorf("row %d: stage %s status %s, want %s %s", c.id, stage, status, c.stage, c.status)
		}
		if want := `{"orig": 1, "seen_by": "a", "attempts": 0}`; state != want {
			t.Errorf("row %d state %s, want %s", c.id, state, want)
		}
	}
	if n := sch.int(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1 AND retry_at = $2`, deferred, until); n != 1 {
		t.Errorf("deferred row: retry_at is not %v", until)
	}
	// An hour from the server's now(), which is also the outcome's status_at: not from the
	// worker's clock, which need not agree with the server's.
	for _, id := range []int64{deferredFor, deferredForTx} {
		if n := sch.int(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1 AND retry_at = status_at + interval '1 hour'`, id); n != 1 {
			t.Errorf("row %d deferred for an hour: retry_at is not status_at + 1 hour", id)
		}
	}
	if err := sv.end(t); err != nil {
		t.Errorf("serve after EOF: %v", err)
	}
}

func TestClaimLost(t *testing.T) {
	sch := newSchema(t)
	pending := sch.put(t, "a", "pending", `{}`)
	other := sch.put(t, "b", "running", `{}`)
	good := sch.put(t, "a", "running", `{}`)
	var ran []int64
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		ran = append(ran, m.ID)
		return m.Done()
	})
	sv.send(t, pending, other, 999999, good)
	r := sv.replies(t, 4)
	wantFailure(t, r[0], "not running at stage a (claim lost)")
	wantFailure(t, r[1], "not running at stage a (claim lost)")
	wantFailure(t, r[2], "not running at stage a (claim lost)")
	if r[3] != "0 done" {
		t.Errorf("reply for the running row = %q, want 0 done", r[3])
	}
	if err := sv.end(t); err != nil {
		t.Fatal(err)
	}
	if len(ran) != 1 || ran[0] != good {
		t.Errorf("handler ran for %v, want only %d", ran, good)
	}
	if _, status, _ := sch.rowOf(t, pending); status != "pending" {
		t.Errorf("pending row became %s", status)
	}
	if stage, status, _ := sch.rowOf(t, other); stage != "b" || status != "running" {
		t.Errorf("other stage's row became %s/%s", stage, status)
	}
}

// A failing handler's writes and outcome are rolled back to its savepoint; the other
// messages of the batch, before and after it, keep theirs.
func TestHandlerErrorRollsBack(t *testing.T) {
	sch := newSchema(t)
	ok1 := sch.put(t, "a", "running", `{}`)
	bad := sch.put(t, "a", "running", `{"fail": true}`)
	ok2 := sch.put(t, "a", "running", `{}`)
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		if _, err := m.Tx.ExecContext(ctx, `INSERT INTO side (id, note) VALUES ($1, 'mine')`, m.ID); err != nil {
			return err
		}
		m.State["touched"] = true
		if err := m.Advance("b"); err != nil {
			return err
		}
		if strings.Contains(string(m.Payload), "fail") {
			return errors.New("enrichment service said no")
		}
		return nil
	})
	sv.send(t, ok1, bad, ok2)
	r := sv.replies(t, 3)
	if r[0] != "0" || r[2] != "0" {
		t.Errorf("replies %q: want 0 for the good messages", r)
	}
	wantFailure(t, r[1], "enrichment service said no")
	if n := sch.int(t, `SELECT count(*) FROM side WHERE id IN ($1, $2)`, ok1, ok2); n != 2 {
		t.Errorf("side rows of the good messages: %d, want 2", n)
	}
	if n := sch.int(t, `SELECT count(*) FROM side WHERE id = $1`, bad); n != 0 {
		t.Errorf("side row of the failed message survived")
	}
	if stage, status, state := sch.rowOf(t, bad); stage != "a" || status != "running" || state != `{"orig": 1}` {
		t.Errorf("failed message's row: %s/%s %s, want a/running with its state untouched", stage, status, state)
	}
	for _, id := range []int64{ok1, ok2} {
		if stage, status, _ := sch.rowOf(t, id); stage != "b" || status != "pending" {
			t.Errorf("row %d: %s/%s, want b/pending", id, stage, status)
		}
	}
}

// A handler that fails through an SQL error (the transaction aborted inside its savepoint)
// does not spoil the batch.
func TestHandlerSQLErrorRecovers(t *testing.T) {
	sch := newSchema(t)
	bad := sch.put(t, "a", "running", `{"fail": true}`)
	good := sch.put(t, "a", "running", `{}`)
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		if strings.Contains(string(m.Payload), "fail") {
			m.Tx.ExecContext(ctx, `SELECT 1/0`) // ignored on purpose: the outcome must fail too
			if err := m.Done(); err == nil {
				t.Error("Done in an aborted transaction succeeded")
			}
			return nil
		}
		return m.Done()
	})
	sv.send(t, bad, good)
	r := sv.replies(t, 2)
	wantFailure(t, r[0], "outcome failed")
	if r[1] != "0 done" {
		t.Errorf("reply for the good message = %q", r[1])
	}
	if _, status, _ := sch.rowOf(t, good); status != "done" {
		t.Errorf("good message: %s, want done", status)
	}
}

func TestOutcomeMistakes(t *testing.T) {
	sch := newSchema(t)
	none := sch.put(t, "a", "running", `{"case": "none"}`)
	two := sch.put(t, "a", "running", `{"case": "two"}`)
	notNext := sch.put(t, "a", "running", `{"case": "notnext"}`)
	panics := sch.put(t, "a", "running", `{"case": "panic"}`)
	ownRow := sch.put(t, "a", "running", `{"case": "ownrow"}`)
	var late *Message
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		switch {
		case strings.Contains(string(m.Payload), `"none"`):
			m.State["x"] = 1
			return nil
		case strings.Contains(string(m.Payload), `"two"`):
			if err := m.Done(); err != nil {
				return err
			}
			if err := m.Advance("b"); !errors.Is(err, ErrOutcomeChosen) {
				t.Errorf("second outcome: %v, want ErrOutcomeChosen", err)
			}
			late = m
			return nil // the failure must not depend on the handler passing the error on
		case strings.Contains(string(m.Payload), `"notnext"`):
			err := m.Advance("zzz")
			if !errors.Is(err, ErrNotNext) {
				t.Errorf("advance to zzz: %v, want ErrNotNext", err)
			}
			return err
		case strings.Contains(string(m.Payload), `"panic"`):
			panic("boom")
		default: // the handler moves its own row, so the guarded outcome finds no row
			if _, err := m.Tx.ExecContext(ctx, `UPDATE workqueue SET status = 'done' WHERE workqueue_id = $1`, m.ID); err != nil {
				return err
			}
			err := m.Done()
			if !errors.Is(err, ErrClaimLost) {
				t.Errorf("done after the row moved: %v, want ErrClaimLost", err)
			}
			return err
		}
	})
	sv.send(t, none, two, notNext, panics, ownRow)
	r := sv.replies(t, 5)
	wantFailure(t, r[0], "without choosing an outcome (Advance, Done or Defer)")
	wantFailure(t, r[1], "more than one outcome (done, then advance to b)")
	wantFailure(t, r[2], `"zzz"`)
	wantFailure(t, r[3], "handler panicked: boom")
	wantFailure(t, r[4], "claim lost")
	for _, id := range []int64{none, two, notNext, panics, ownRow} {
		if stage, status, state := sch.rowOf(t, id); stage != "a" || status != "running" || state != `{"orig": 1}` {
			t.Errorf("row %d: %s/%s %s, want it untouched", id, stage, status, state)
		}
	}
	if err := late.Done(); !errors.Is(err, ErrHandlerDone) {
		t.Errorf("outcome after the handler returned: %v, want ErrHandlerDone", err)
	}
}

// The hook for other kinds of outcome (fan-out splits): its write runs in the message's
// savepoint and counts as the message's one outcome.
func TestOutcomeHook(t *testing.T) {
	sch := newSchema(t)
	split := sch.put(t, "a", "running", `{}`)
	undone := sch.put(t, "a", "running", `{"fail": true}`)
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		err := m.outcome(ctx, func(tx *sql.Tx) error {
			state, err := m.stateJSON()
			if err != nil {
				return err
			}
			_, err = tx.ExecContext(ctx, `UPDATE workqueue SET status = 'waiting', state = $2
				WHERE workqueue_id = $1 AND status = 'running' AND stage = $3`, m.ID, state, m.Stage)
			return err
		})
		if err != nil {
			return err
		}
		if err := m.Done(); !errors.Is(err, ErrOutcomeChosen) {
			t.Errorf("done after a split: %v, want ErrOutcomeChosen", err)
		}
		if strings.Contains(string(m.Payload), "fail") {
			return errors.New("children refused")
		}
		return nil
	})
	sv.send(t, split, undone)
	r := sv.replies(t, 2)
	if r[0] == "0" {
		t.Errorf("split with a second outcome attempted: reply 0, want a failure")
	}
	wantFailure(t, r[1], "children refused")
	for _, id := range []int64{split, undone} {
		if _, status, _ := sch.rowOf(t, id); status != "running" {
			t.Errorf("row %d: %s, want running (the split rolled back)", id, status)
		}
	}
}

func TestOutcomeHookAlone(t *testing.T) {
	sch := newSchema(t)
	split := sch.put(t, "a", "running", `{}`)
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		m.State["children"] = 3
		return m.outcome(ctx, func(tx *sql.Tx) error {
			state, err := m.stateJSON()
			if err != nil {
				return err
			}
			_, err = tx.ExecContext(ctx, `UPDATE workqueue SET status = 'waiting', state = $2
				WHERE workqueue_id = $1 AND status = 'running' AND stage = $3`, m.ID, state, m.Stage)
			return err
		})
	})
	sv.send(t, split)
	if r := sv.replies(t, 1); r[0] != "0" {
		t.Fatalf("reply %q", r[0])
	}
	if _, status, state := sch.rowOf(t, split); status != "waiting" || state != `{"orig": 1, "children": 3}` {
		t.Errorf("split row: %s %s", status, state)
	}
}

// Several ids in one read are one transaction, and their replies come in one write after its
// commit: while the last handler runs, nothing is replied and nothing of the others is
// visible from outside.
func TestBatchIsOneTransaction(t *testing.T) {
	sch := newSchema(t)
	ids := []int64{sch.put(t, "a", "running", `{}`), sch.put(t, "a", "running", `{}`), sch.put(t, "a", "running", `{"last": true}`)}
	entered, release := make(chan struct{}), make(chan struct{})
	// Without the time bound (a batch time of an hour): on a loaded machine the batch's BEGIN,
	// load and first two messages took over maxBatchTime's 100 ms, the third message went to a
	// batch of its own, and the test took the first batch's write for a reply before the commit.
	sv := serveFused(t, sch, Config{Stage: "a", Next: []string{"b", "c"}, hooks: &testHooks{batchTime: time.Hour}},
		map[string]Handler{"a": func(ctx context.Context, m *Message) error {
			if strings.Contains(string(m.Payload), "last") {
				close(entered)
				<-release
			}
			return m.Advance("b")
		}})
	sv.send(t, ids...)
	select {
	case <-entered:
	case <-time.After(waitTimeout):
		t.Fatal("timed out waiting for the last handler")
	}
	if n := sv.out.count(); n != 0 {
		t.Errorf("%d writes to stdout before the batch committed", n)
	}
	if n := sch.int(t, `SELECT count(*) FROM workqueue WHERE stage = 'b'`); n != 0 {
		t.Errorf("%d advances visible before the last message ran: not one transaction", n)
	}
	close(release)
	r := sv.replies(t, 3)
	if strings.Join(r, ",") != "0,0,0" {
		t.Errorf("replies %q", r)
	}
	if n := sv.out.count(); n != 1 {
		t.Errorf("%d writes for one batch, want 1", n)
	}
	if n := sch.int(t, `SELECT count(*) FROM workqueue WHERE stage = 'b' AND status = 'pending'`); n != 3 {
		t.Errorf("%d rows advanced, want 3", n)
	}
}

// A batch of messages whose handlers leave m.Tx alone costs 2 requests, the load and the
// outcome statement, with no transaction around them. A handler with a statement of its own
// begins one: BEGIN and its SAVEPOINT in one request, that statement, its outcome's UPDATE and
// the COMMIT.
func TestRoundTrips(t *testing.T) {
	sch := newSchema(t)
	var ids []int64
	for range 5 {
		ids = append(ids, sch.put(t, "a", "running", `{}`))
	}
	touch := sch.put(t, "a", "running", `{"touch": true}`)
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		if strings.Contains(string(m.Payload), "touch") {
			if _, err := m.Tx.ExecContext(ctx, `INSERT INTO side (id) VALUES (1)`); err != nil {
				return err
			}
		}
		return m.Advance("b")
	})
	before := sv.statements()
	sv.send(t, ids...)
	sv.replies(t, len(ids))
	if got := sv.statements() - before; got != 2 {
		t.Errorf("batch of %d: %d requests, want 2 (load, outcomes)", len(ids), got)
	}
	before = sv.statements()
	sv.send(t, touch)
	sv.replies(t, 1)
	if got := sv.statements() - before; got != 5 {
		t.Errorf("one message with a statement of its own: %d requests, want 5 (load, BEGIN and SAVEPOINT, INSERT, UPDATE, COMMIT)", got)
	}
}

func TestEOFAndBadLines(t *testing.T) {
	sch := newSchema(t)
	a, b, c := sch.put(t, "a", "running", `{}`), sch.put(t, "a", "running", `{}`), sch.put(t, "a", "running", `{}`)
	sv := serve(t, sch, func(ctx context.Context, m *Message) error { return m.Done() })
	// A bad line and an empty one still get their replies; an id with a sign, or with a
	// Unicode space, is no id (parseID's rule, the Python SDK's too); a CR and spaces around
	// an id are nothing; the last line, a lone CR, has no newline and is a line all the same.
	sv.sendRaw(t, fmt.Sprintf("%d\nnot-a-number\n\n+%d\n%d\u00a0\n \t%d\r\n\r", a, b, b, c))
	sv.in.Close()
	r := sv.replies(t, 7)
	if r[0] != "0 done" || r[5] != "0 done" {
		t.Errorf("replies %q: want 0 done for the ids", r)
	}
	wantFailure(t, r[1], `bad message id "not-a-number"`)
	wantFailure(t, r[2], `bad message id ""`)
	wantFailure(t, r[3], fmt.Sprintf(`bad message id "+%d"`, b))
	wantFailure(t, r[4], fmt.Sprintf(`bad message id "%d\u00a0"`, b))
	wantFailure(t, r[6], `bad message id "\r"`)
	if _, status, _ := sch.rowOf(t, b); status != "running" {
		t.Errorf("row %d, named only with a sign or a Unicode space: %s, want running (not run)", b, status)
	}
	if err := sv.wait(t); err != nil {
		t.Errorf("serve after EOF: %v, want nil", err)
	}
}

func TestReasonIsOneLine(t *testing.T) {
	sch := newSchema(t)
	id := sch.put(t, "a", "running", `{}`)
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		return fmt.Errorf("first line\nsecond\r\tline %s", strings.Repeat("é", 3000))
	})
	sv.send(t, id)
	r := sv.replies(t, 1)[0]
	wantFailure(t, r, "first line second  line é")
	if len(r) > maxReason+2 {
		t.Errorf("reply of %d bytes, want at most %d", len(r), maxReason+2)
	}
	if !strings.HasSuffix(r, "é...") {
		t.Errorf("reply not cut on a rune boundary: ...%q", r[len(r)-10:])
	}
	if n := sv.out.count(); n != 1 || strings.Count(string(sv.out.writes[0]), "\n") != 1 {
		t.Errorf("reply is not one line")
	}
}

// Big integers and nested values of the state survive the decode and encode unchanged.
func TestStateRoundTrip(t *testing.T) {
	sch := newSchema(t)
	id := sch.put(t, "a", "running", `{}`)
	sch.exec(t, `UPDATE workqueue SET state = '{"big": 9007199254740993, "nested": {"l": [1.5, "x", null]}}' WHERE workqueue_id = $1`, id)
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		m.State["added"] = "yes"
		return m.Advance("b")
	})
	sv.send(t, id)
	sv.replies(t, 1)
	_, _, state := sch.rowOf(t, id)
	if want := `{"big": 9007199254740993, "added": "yes", "nested": {"l": [1.5, "x", null]}}`; state != want {
		t.Errorf("state %s, want %s", state, want)
	}
}

// The outcome statement's hand-written array literals read back, in PostgreSQL, as the values
// they were made of: quotes, backslashes, the array syntax's own characters, the word NULL,
// empty strings, real NULLs and JSON.
func TestArrayLiteral(t *testing.T) {
	sch := newSchema(t)
	in := []sql.NullString{{String: `plain`, Valid: true}, {String: `a "quoted" \ back\slash`, Valid: true},
		{String: `{,}`, Valid: true}, {String: `NULL`, Valid: true}, {}, {String: ``, Valid: true},
		{String: `it's`, Valid: true}, {String: " space\ttab\n", Valid: true}, {String: `é € 😀`, Valid: true},
		{String: `{"k": "v \" \\ ''", "n": [1, null]}`, Valid: true}}
	var out []sql.NullString
	if err := sch.db.QueryRow(`SELECT ` + nullStrings(in) + `::text[]`).Scan(pq.Array(&out)); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(in, out) {
		t.Errorf("text[] read back as\n%v\nwant\n%v", out, in)
	}
	ids := []int64{0, -1, 9223372036854775807, 42}
	var back []int64
	lit := arrayLiteral(len(ids), func(b []byte, i int) []byte { return strconv.AppendInt(b, ids[i], 10) })
	if err := sch.db.QueryRow(`SELECT ` + lit + `::bigint[]`).Scan(pq.Array(&back)); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(ids, back) {
		t.Errorf("bigint[] read back as %v, want %v", back, ids)
	}
	var n int
	if err := sch.db.QueryRow(`SELECT cardinality(` + nullStrings(nil) + `::text[])`).Scan(&n); err != nil || n != 0 {
		t.Errorf("empty array: cardinality %d, %v; want 0", n, err)
	}
}

// An empty state that the handler leaves empty is not sent: the outcome statement keeps the
// column (NULL in its array), so a no-op stage's outcome costs the server no jsonb parse. The
// first row shows it: its state, changed by someone else while its handler ran, stays. Every
// other state is written: filled, emptied, or non-empty and unchanged.
func TestEmptyStateNotSent(t *testing.T) {
	sch := newSchema(t)
	untouched := sch.put(t, "a", "running", `{}`)
	filled := sch.put(t, "a", "running", `{}`)
	emptied := sch.put(t, "a", "running", `{}`)
	kept := sch.put(t, "a", "running", `{}`)
	sch.exec(t, `UPDATE workqueue SET state = CASE WHEN workqueue_id IN ($1, $2) THEN '{}'::jsonb ELSE '{"a": 1}'::jsonb END`, untouched, filled)
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		switch m.ID {
		case untouched:
			if _, err := sch.db.ExecContext(ctx, `UPDATE workqueue SET state = '{"elsewhere": 1}' WHERE workqueue_id = $1`, m.ID); err != nil {
				return err
			}
		case filled:
			m.State["x"] = 1
		case emptied:
			delete(m.State, "a")
		}
		return m.Done()
	})
	before := sv.statements()
	sv.send(t, untouched, filled, emptied, kept)
	if r := sv.replies(t, 4); !slices.Equal(r, []string{"0 done", "0 done", "0 done", "0 done"}) {
		t.Fatalf("replies %q, want four successes", r)
	}
	if got := sv.statements() - before; got != 2 {
		t.Errorf("%d requests, want 2 (load, outcome statement)", got)
	}
	for _, c := range []struct {
		id    int64
		state string
	}{{untouched, `{"elsewhere": 1}`}, {filled, `{"x": 1}`}, {emptied, `{}`}, {kept, `{"a": 1}`}} {
		if _, status, state := sch.rowOf(t, c.id); status != "done" || state != c.state {
			t.Errorf("row %d: %s %s, want done %s", c.id, status, state, c.state)
		}
	}
}

// A handler that commits m.Tx is a programming error that ends Serve.
func TestHandlerMustNotCommit(t *testing.T) {
	sch := newSchema(t)
	id := sch.put(t, "a", "running", `{}`)
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		if err := m.Tx.Commit(); err == nil {
			t.Error("commit of m.Tx succeeded")
		}
		return m.Done()
	})
	sv.send(t, id)
	if err := sv.wait(t); err == nil || !strings.Contains(err.Error(), "owns Message.Tx") {
		t.Errorf("serve: %v, want the Message.Tx ownership error", err)
	}
	if _, status, _ := sch.rowOf(t, id); status != "running" {
		t.Errorf("row became %s", status)
	}
}

// A lost connection ends Serve without replying; it never reconnects.
func TestConnectionLost(t *testing.T) {
	sch := newSchema(t)
	first, second := sch.put(t, "a", "running", `{}`), sch.put(t, "a", "running", `{}`)
	sv := serve(t, sch, func(ctx context.Context, m *Message) error { return m.Done() })
	sv.send(t, first)
	sv.replies(t, 1)
	app := "pepsi-" + sch.name
	if n := sch.int(t, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1`, app); n != 1 {
		t.Fatalf("terminated %d backends, want 1", n)
	}
	pgtest.WaitFor(t, waitTimeout, "the backend to end", func() bool {
		return sch.int(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, app) == 0
	})
	sv.send(t, second)
	err := sv.wait(t)
	if !errors.Is(err, ErrConnectionLost) {
		t.Errorf("serve: %v, want ErrConnectionLost", err)
	}
	if n := sv.out.count(); n != 1 {
		t.Errorf("%d writes, want only the first batch's", n)
	}
	if n := sch.int(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, app); n != 0 {
		t.Errorf("%d sessions after the loss: the stage reconnected", n)
	}
	if _, status, _ := sch.rowOf(t, second); status != "running" {
		t.Errorf("second row became %s", status)
	}
}

func TestLoadConfig(t *testing.T) {
	env := map[string]string{"PEPSI_STAGE": "parse", "PEPSI_NEXT": " enrich  deliver ", "PEPSI_DSN": "host=/x"}
	getenv := func(k string) string { return env[k] }
	cfg, err := loadConfig([]string{"-c", "/etc/pepsi/pepsi.conf", "worker"}, getenv)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Stage != "parse" || strings.Join(cfg.Next, ",") != "enrich,deliver" || cfg.DSN != "host=/x" || cfg.ConfigFile != "/etc/pepsi/pepsi.conf" {
		t.Errorf("config %+v", cfg)
	}
	if cfg, err := loadConfig([]string{"worker"}, getenv); err != nil || cfg.ConfigFile != "" {
		t.Errorf("without -c: %+v, %v", cfg, err)
	}
	for _, c := range []struct {
		args []string
		key  string
		val  string
		want string
	}{
		{[]string{}, "", "", "usage"},
		{[]string{"serve"}, "", "", "usage"},
		{[]string{"-x", "worker"}, "", "", "usage"},
		{[]string{"worker", "extra"}, "", "", "usage"},
		{[]string{"worker"}, "PEPSI_STAGE", "", "PEPSI_STAGE"},
		{[]string{"worker"}, "PEPSI_STAGE", "Bad Name", "stage name"},
		{[]string{"worker"}, "PEPSI_NEXT", "ok b@d", "next stage name"},
		{[]string{"worker"}, "PEPSI_DSN", "", "PEPSI_DSN"},
	} {
		saved := env[c.key]
		if c.key != "" {
			env[c.key] = c.val
		}
		_, err := loadConfig(c.args, getenv)
		if c.key != "" {
			env[c.key] = saved
		}
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("args %q %s=%q: %v, want an error mentioning %q", c.args, c.key, c.val, err, c.want)
		}
	}
}

// Run as a real process: the test binary is the stage program (see TestMain).
// TestRunProcess: Run as a process's main. What a handler writes to standard output (a
// debugging print, a program it runs without capturing its output: row a's) goes to
// standard error, which the dispatcher logs, and not into the replies, where the dispatcher
// would take it for a protocol error and kill the worker with its messages.
func TestRunProcess(t *testing.T) {
	sch := newSchema(t)
	a, b := sch.put(t, "a", "running", `{"print": true}`), sch.put(t, "a", "running", `{}`)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// Without GOMAXPROCS in its environment, a worker process runs on one processor.
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "GOMAXPROCS=") {
			env = append(env, kv)
		}
	}
	env = append(env, "PEPSI_SDK_TEST_RUN=1", "PEPSI_STAGE=a", "PEPSI_NEXT=b", "PEPSI_DSN="+sch.dsn)

	cmd := exec.Command(exe, "-c", "/nonexistent/pepsi.conf", "worker")
	cmd.Env = env
	cmd.Stdin = strings.NewReader(fmt.Sprintf("%d\n%d\n", a, b))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("stage program: %v\n%s", err, stderr.Bytes())
	}
	if string(out) != "0\n0\n" {
		t.Errorf("stdout %q, want two successes alone", out)
	}
	for _, w := range []string{"debug: a handler's print\n", "debug: a child of the handler\n"} {
		if !strings.Contains(stderr.String(), w) {
			t.Errorf("stderr %q lacks %q", stderr.String(), w)
		}
	}
	for _, id := range []int64{a, b} {
		if stage, _, state := sch.rowOf(t, id); stage != "b" || !strings.Contains(state, `"by": "run"`) ||
			!strings.Contains(state, `"procs": 1`) {
			t.Errorf("row %d: stage %s state %s, want by run on 1 processor", id, stage, state)
		}
	}

	// A program the handler runs that reads its standard input (ssh, ffmpeg without
	// -nostdin, a shell's read) finds it at its end: the ids written next are the SDK's. It
	// took the one written while it ran, which was then never answered.
	d, e := sch.put(t, "a", "running", `{"stdin": true}`), sch.put(t, "a", "running", `{}`)
	cmd = exec.Command(exe, "worker")
	cmd.Env = env
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	var outs, errs pgtest.SyncBuffer
	cmd.Stdout, cmd.Stderr = &outs, &errs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(in, "%d\n", d)
	pgtest.WaitFor(t, 30*time.Second, "the handler's child to start", func() bool {
		return strings.Contains(errs.String(), "child reading")
	})
	fmt.Fprintf(in, "%d\n", e)
	in.Close()
	if err := cmd.Wait(); err != nil || outs.String() != "0\n0\n" || !strings.Contains(errs.String(), "child read: []") {
		t.Errorf("a handler's child reading standard input: %v, stdout %q, stderr %q; want both answered, the child reading nothing",
			err, outs.String(), errs.String())
	}

	// GOMAXPROCS in the environment wins.
	c := sch.put(t, "a", "running", `{}`)
	cmd = exec.Command(exe, "worker")
	cmd.Env = append(env, "GOMAXPROCS=3")
	cmd.Stdin = strings.NewReader(fmt.Sprintf("%d\n", c))
	if out, err := cmd.Output(); err != nil || string(out) != "0\n" {
		t.Fatalf("stage program with GOMAXPROCS=3: %v, stdout %q", err, out)
	}
	if _, _, state := sch.rowOf(t, c); !strings.Contains(state, `"procs": 3`) {
		t.Errorf("row %d: state %s, want procs 3 (GOMAXPROCS=3 in the environment)", c, state)
	}

	cmd = exec.Command(exe, "serve")
	cmd.Env = env
	stderr.Reset()
	cmd.Stderr = &stderr
	err = cmd.Run()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 2 || !strings.Contains(stderr.String(), "usage") {
		t.Errorf("bad usage: %v, stderr %q; want exit 2 and the usage", err, stderr.String())
	}

	cmd = exec.Command(exe, "worker")
	cmd.Env = append(env, "PEPSI_DSN=host=/nonexistent port=1 sslmode=disable connect_timeout=5")
	stderr.Reset()
	cmd.Stderr = &stderr
	cmd.Stdin = strings.NewReader("1\n")
	err = cmd.Run()
	if !errors.As(err, &exit) || exit.ExitCode() != 1 || !strings.Contains(stderr.String(), "connect to the database") {
		t.Errorf("no database: %v, stderr %q; want exit 1 naming the connection", err, stderr.String())
	}
}

// Many messages through many batches: every one gets its reply in order.
func TestManyMessages(t *testing.T) {
	sch := newSchema(t)
	sch.exec(t, `INSERT INTO workqueue (stage, status, payload) SELECT 'a', 'running', jsonb_build_object('n', i) FROM generate_series(1, 500) i`)
	ids := sch.ids(t, `SELECT workqueue_id FROM workqueue ORDER BY workqueue_id`)
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		if m.ID%7 == 0 {
			return errors.New("seven " + strconv.FormatInt(m.ID, 10))
		}
		return m.Advance("b")
	})
	// Written in chunks of varying size, the way the dispatcher tops up a worker's queue.
	go func() {
		for i := 0; i < len(ids); {
			n := min(1+i%37, len(ids)-i)
			var b strings.Builder
			for _, id := range ids[i : i+n] {
				fmt.Fprintf(&b, "%d\n", id)
			}
			if _, err := io.WriteString(sv.in, b.String()); err != nil {
				return // serve ended; the test reports it
			}
			i += n
		}
	}()
	r := sv.replies(t, len(ids))
	for i, id := range ids {
		want := "0"
		if id%7 == 0 {
			want = "1 seven " + strconv.FormatInt(id, 10)
		}
		if r[i] != want {
			t.Fatalf("reply %d for id %d = %q, want %q", i, id, r[i], want)
		}
	}
	if n := sch.int(t, `SELECT count(*) FROM workqueue WHERE stage = 'b' AND status = 'pending'`); n != len(ids)-len(ids)/7 {
		t.Errorf("%d advanced", n)
	}
	if w := sv.out.count(); w >= len(ids) {
		t.Errorf("%d writes for %d messages: no batching", w, len(ids))
	}
}

func TestOneLine(t *testing.T) {
	for in, want := range map[string]string{
		"":           "failed",
		" \n ":       "failed",
		"a\nb":       "a b",
		"x\x00y\x7f": "x y",
	} {
		if got := oneLine(in); got != want {
			t.Errorf("oneLine(%q) = %q, want %q", in, got, want)
		}
	}
}

// keptCases is the handler of the kept-outcome tests, by the payload's case: "moved" advances
// and then waits until the test has taken its claim back (takeBack); "nul" chooses Done with a
// state that jsonb refuses; "after" advances and then writes in m.Tx (and fails if "fail");
// any other defers by an hour.
type keptCases struct {
	entered, release chan struct{}
}

func newKeptCases() *keptCases {
	return &keptCases{entered: make(chan struct{}), release: make(chan struct{})}
}

func (k *keptCases) handler(ctx context.Context, m *Message) error {
	p := string(m.Payload)
	switch {
	case strings.Contains(p, "moved"):
		if err := m.Advance("b"); err != nil {
			return err
		}
		close(k.entered)
		<-k.release
	case strings.Contains(p, "nul"):
		m.State["bad"] = "a\x00b" // valid JSON ("\u0000"), refused by jsonb
		return m.Done()
	case strings.Contains(p, "after"):
		if err := m.Advance("c"); err != nil {
			return err
		}
		m.State["late"] = true // after the outcome: not written
		if _, err := m.Tx.ExecContext(ctx, `INSERT INTO side (id, note) VALUES ($1, 'after')`, m.ID); err != nil {
			return err
		}
		if strings.Contains(p, "fail") {
			return errors.New("failed after writing")
		}
	default:
		return m.Defer(time.Now().Add(time.Hour))
	}
	return nil
}

// takeBack waits for the "moved" handler, puts its row back to pending as the dispatcher does
// after a timeout, and lets the handler return.
func (k *keptCases) takeBack(t *testing.T, sch *schema, id int64) {
	t.Helper()
	select {
	case <-k.entered:
	case <-time.After(waitTimeout):
		t.Fatal("timed out waiting for the handler")
	}
	sch.exec(t, `UPDATE workqueue SET status = 'pending' WHERE workqueue_id = $1`, id)
	close(k.release)
}

// Outcomes kept for the batch's outcome statement: a row that moved meanwhile fails only its
// message; a state that jsonb rejects fails only its message (the statement falls back to one
// UPDATE per outcome); an outcome chosen before the handler's own statement is written with it.
func TestKeptOutcomes(t *testing.T) {
	sch := newSchema(t)
	moved := sch.put(t, "a", "running", `{"case": "moved"}`)
	badState := sch.put(t, "a", "running", `{"case": "nul"}`)
	writesAfter := sch.put(t, "a", "running", `{"case": "after"}`)
	failsAfter := sch.put(t, "a", "running", `{"case": "after", "fail": true}`)
	plain := sch.put(t, "a", "running", `{"case": "plain"}`)
	k := newKeptCases()
	sv := serve(t, sch, k.handler)
	sv.send(t, moved, badState, writesAfter, failsAfter, plain)
	k.takeBack(t, sch, moved)
	r := sv.replies(t, 5)
	wantFailure(t, r[0], "claim lost")
	wantFailure(t, r[1], "(22P05)") // untranslatable_character: "unsupported Unicode escape" in English
	if r[2] != "0" || r[4] != "0" {
		t.Errorf("replies %q: want 0 for the third and fifth", r)
	}
	wantFailure(t, r[3], "failed after writing")
	check := func(id int64, wantStage, wantStatus, wantState string) {
		t.Helper()
		if stage, status, state := sch.rowOf(t, id); stage != wantStage || status != wantStatus || state != wantState {
			t.Errorf("row %d: %s/%s %s, want %s/%s %s", id, stage, status, state, wantStage, wantStatus, wantState)
		}
	}
	check(moved, "a", "pending", `{"orig": 1}`)
	check(badState, "a", "running", `{"orig": 1}`)
	check(writesAfter, "c", "pending", `{"orig": 1}`)
	check(failsAfter, "a", "running", `{"orig": 1}`)
	check(plain, "a", "paused", `{"orig": 1}`)
	if n := sch.int(t, `SELECT count(*) FROM side`); n != 1 {
		t.Errorf("%d side rows, want only the one of the message that succeeded", n)
	}
}

// The same without a transaction: when no handler of the batch uses m.Tx, the outcome
// statement runs alone, and when it fails the outcomes are written one by one, each alone. A
// row that moved fails its message, a state that jsonb rejects fails its own, and the rest are
// written: load, outcome statement, then one UPDATE per outcome, and no BEGIN or COMMIT.
func TestKeptOutcomesWithoutTransaction(t *testing.T) {
	sch := newSchema(t)
	moved := sch.put(t, "a", "running", `{"case": "moved"}`)
	badState := sch.put(t, "a", "running", `{"case": "nul"}`)
	plain := sch.put(t, "a", "running", `{"case": "plain"}`)
	k := newKeptCases()
	sv := serve(t, sch, k.handler)
	before := sv.statements()
	sv.send(t, moved, badState, plain)
	k.takeBack(t, sch, moved)
	r := sv.replies(t, 3)
	wantFailure(t, r[0], "claim lost")
	wantFailure(t, r[1], "(22P05)") // untranslatable_character: "unsupported Unicode escape" in English
	if r[2] != "0" {
		t.Errorf("reply %q for the deferred message, want 0", r[2])
	}
	if got := sv.statements() - before; got != 1+1+3 {
		t.Errorf("%d requests, want 5 (load, outcome statement, 3 single outcomes)", got)
	}
	for _, c := range []struct {
		id                  int64
		stage, status, note string
	}{{moved, "a", "pending", "claim taken back"}, {badState, "a", "running", "refused state"}, {plain, "a", "paused", "deferred"}} {
		if stage, status, _ := sch.rowOf(t, c.id); stage != c.stage || status != c.status {
			t.Errorf("%s row %d: %s/%s, want %s/%s", c.note, c.id, stage, status, c.stage, c.status)
		}
	}
}

// What bounds a batch. Messages whose handlers leave m.Tx alone take no savepoint: 200 of them
// are one batch, 2 requests. Messages that write take one savepoint each, and PostgreSQL caches
// 64 subtransactions: 70 of them are two batches, 64 and 6. A pass through two fused stages
// that all write takes 3: 30 of them are batches of 21 and 9. And a batch takes no message
// after it has run for batchTime.
func TestBatchBounds(t *testing.T) {
	sch := newSchema(t)
	// The bounds by size are checked with a batch time that cannot pass: on a loaded machine
	// the 100 ms of maxBatchTime cut these batches before their size did, and the test then
	// failed for a bound it does not check. The last subtest checks the time bound.
	untimed := &testHooks{batchTime: time.Hour}
	putN := func(n int, payload string) []int64 {
		ids := make([]int64, n)
		for i := range ids {
			ids[i] = sch.put(t, "a", "running", payload)
		}
		return ids
	}
	check := func(t *testing.T, sv *serving, ids []int64, wantWrites int, wantPeak int) {
		t.Helper()
		sv.send(t, ids...)
		for i, r := range sv.replies(t, len(ids)) {
			if !strings.HasPrefix(r, "0") {
				t.Fatalf("reply %d: %q", i, r)
			}
		}
		if n := sv.out.count(); n != wantWrites {
			t.Errorf("%d writes for %d messages, want %d", n, len(ids), wantWrites)
		}
		sv.sess.mu.Lock()
		peak := sv.sess.peak
		sv.sess.mu.Unlock()
		if peak != wantPeak {
			t.Errorf("the most savepoints of a batch: %d, want %d", peak, wantPeak)
		}
	}
	t.Run("no writes", func(t *testing.T) {
		ids := putN(200, `{}`)
		sv := serveFused(t, sch, Config{Stage: "a", Next: []string{"b", "c"}, hooks: untimed},
			map[string]Handler{"a": func(ctx context.Context, m *Message) error { return m.Advance("b") }})
		before := sv.statements()
		check(t, sv, ids, 1, 0)
		if got := sv.statements() - before; got != 2 {
			t.Errorf("%d requests for a batch of 200 without writes, want 2", got)
		}
	})
	t.Run("writes", func(t *testing.T) {
		ids := putN(70, `{}`)
		sv := serveFused(t, sch, Config{Stage: "a", Next: []string{"b", "c"}, hooks: untimed},
			map[string]Handler{"a": func(ctx context.Context, m *Message) error {
				if _, err := m.Tx.ExecContext(ctx, `INSERT INTO side (id) VALUES ($1)`, m.ID); err != nil {
					return err
				}
				return m.Advance("b")
			}})
		check(t, sv, ids, 2, maxSubxids)
	})
	t.Run("fused writes", func(t *testing.T) {
		ids := putN(30, `{}`)
		write := func(next string, k int64) Handler {
			return func(ctx context.Context, m *Message) error {
				if _, err := m.Tx.ExecContext(ctx, `INSERT INTO side (id, note) VALUES ($1, $2)`, 10*m.ID+k, m.Stage); err != nil {
					return err
				}
				if next == "" {
					return m.Done()
				}
				return m.Advance(next)
			}
		}
		sv := serveFused(t, sch, Config{Stage: "a", Next: []string{"b"}, Fuse: map[string][]string{"b": {"c"}, "c": {}},
			hooks: untimed},
			map[string]Handler{"a": write("b", 1), "b": write("c", 2), "c": write("", 3)})
		check(t, sv, ids, 2, 63)
		if n := sch.int(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = ANY($1) AND stage = 'c' AND status = 'done'`, pq.Array(ids)); n != len(ids) {
			t.Errorf("%d of %d messages through the fused stages", n, len(ids))
		}
	})
	t.Run("time", func(t *testing.T) {
		ids := putN(6, `{}`)
		sv := serveFused(t, sch, Config{Stage: "a", Next: []string{"b"}, hooks: &testHooks{batchTime: 40 * time.Millisecond}},
			map[string]Handler{"a": func(ctx context.Context, m *Message) error {
				time.Sleep(25 * time.Millisecond) // the work: a batch of 6 would take 150 ms
				return m.Advance("b")
			}})
		sv.send(t, ids...)
		sv.replies(t, len(ids))
		// 25 ms, 50 ms: the third message finds the batch over its 40 ms. Without the bound:
		// one write; a slower machine makes more.
		if n := sv.out.count(); n < 3 {
			t.Errorf("%d writes for 6 messages of 25 ms with a batch time of 40 ms, want 3 or more", n)
		}
	})
}

// A context cancelled while a batch runs ends Serve before the outcomes are written, without
// replies: the dispatcher recovers the rows, which are untouched. (database/sql refuses the
// Commit of a transaction whose context is done, and the outcome statement after it checks
// ctx as well: either alone keeps the replies back.)
func TestContextCancelledInBatch(t *testing.T) {
	sch := newSchema(t)
	ids := []int64{sch.put(t, "a", "running", `{}`), sch.put(t, "a", "running", `{"cancel": true}`)}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	inR, inW := io.Pipe()
	defer inW.Close()
	out := newRecorder()
	done := make(chan error, 1)
	go func() {
		done <- Serve(ctx, Config{Stage: "a", DSN: sch.dsn}, inR, out, func(_ context.Context, m *Message) error {
			if strings.Contains(string(m.Payload), "cancel") {
				cancel() // as a shutdown would, while the batch runs
			}
			return m.Done()
		})
		inR.Close()
	}()
	if _, err := io.WriteString(inW, fmt.Sprintf("%d\n%d\n", ids[0], ids[1])); err != nil {
		t.Fatal(err)
	}
	wantCancelledServe(t, done, out)
	for _, id := range ids {
		if _, status, _ := sch.rowOf(t, id); status != "running" {
			t.Errorf("row %d became %s", id, status)
		}
	}
}

// The outcome statement's plan finds the rows by primary key even when the statistics were
// taken before the rows were running (they then say "1 row running"): it does not scan the
// table, and does not compare every running row with every element.
func TestOutcomePlan(t *testing.T) {
	sch := newSchema(t)
	sch.exec(t, `INSERT INTO workqueue (stage, payload) SELECT 'a', jsonb_build_object('n', g) FROM generate_series(1, 33334) g`)
	sch.exec(t, `ANALYZE workqueue`)
	sch.exec(t, `UPDATE workqueue SET status = 'running' WHERE workqueue_id IN (SELECT workqueue_id FROM workqueue ORDER BY 1 LIMIT 2048)`)
	ids := sch.ids(t, `SELECT workqueue_id FROM workqueue WHERE status = 'running' ORDER BY 1 LIMIT 256`)
	n := len(ids)
	stages, statuses, retryAts, states := make([]sql.NullString, n), make([]string, n), make([]sql.NullString, n), make([]sql.NullString, n)
	for i := range ids {
		stages[i] = sql.NullString{String: "b", Valid: true}
		statuses[i], states[i] = "pending", sql.NullString{String: "{}", Valid: i%2 == 0}
	}
	q := outcomeStatement(ids, stages, statuses, retryAts, make([]sql.NullFloat64, n), states, "a")
	text := sch.explain(t, q)
	if strings.Contains(text, "Seq Scan on workqueue") || !strings.Contains(text, "Index Cond: (workqueue_id = ANY") {
		t.Errorf("the outcome statement does not find its rows by primary key:\n%s", text)
	}
	if strings.Contains(text, "Join Filter: (w.workqueue_id = v.id)") || !strings.Contains(text, "Hash Cond:") {
		t.Errorf("the outcome statement does not hash-join its rows with their values:\n%s", text)
	}
}

// TestLoadStatementForms: the load of one id is an equality on the primary key (planned sooner
// than a one-element ANY, which a lone message waits for), the load of several an ANY; both read
// the rows running at the stage and no other, by primary key.
func TestLoadStatementForms(t *testing.T) {
	sch := newSchema(t)
	// A queue's table, not a handful of rows, of which a scan of the whole is the cheaper read.
	sch.exec(t, `INSERT INTO workqueue (stage, status) SELECT 'a', 'done' FROM generate_series(1, 10000)`)
	sch.exec(t, `ANALYZE workqueue`)
	run := sch.put(t, "a", "running", `{"n": 1}`)
	run2 := sch.put(t, "a", "running", `{"n": 2}`)
	other := sch.put(t, "b", "running", `{}`)
	pending := sch.put(t, "a", "pending", `{}`)
	for _, c := range []struct {
		ids      []int64
		form     string
		wantRows []int64
	}{
		{[]int64{run}, fmt.Sprintf("WHERE workqueue_id = %d AND status = 'running'", run), []int64{run}},
		{[]int64{other}, fmt.Sprintf("WHERE workqueue_id = %d AND", other), nil},
		{[]int64{pending}, fmt.Sprintf("WHERE workqueue_id = %d AND", pending), nil},
		{[]int64{run, other, pending, run2}, "WHERE workqueue_id = ANY ('{", []int64{run, run2}},
	} {
		q := loadStatement(c.ids, "a")
		if !strings.Contains(q, c.form) {
			t.Errorf("load of %v: %s\nwant it to say %q", c.ids, q, c.form)
		}
		got := sch.ids(t, `SELECT workqueue_id FROM (`+q+`) l ORDER BY 1`)
		if !slices.Equal(got, c.wantRows) {
			t.Errorf("load of %v read %v, want %v", c.ids, got, c.wantRows)
		}
		if text := sch.explain(t, q); !strings.Contains(text, "workqueue_pkey") {
			t.Errorf("load of %v does not read by primary key:\n%s", c.ids, text)
		}
	}
}

// wantCancelledServe waits for Serve to return context.Canceled, having written nothing.
func wantCancelledServe(t *testing.T, done <-chan error, out *recorder) {
	t.Helper()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("serve: %v, want context.Canceled", err)
		}
	case <-time.After(waitTimeout):
		t.Fatal("timed out waiting for serve to return")
	}
	if n := out.count(); n != 0 {
		t.Errorf("%d writes after the cancel", n)
	}
}

// A cancelled context ends Serve at its next batch, without replies: nothing is committed.
func TestContextCancelled(t *testing.T) {
	sch := newSchema(t)
	id := sch.put(t, "a", "running", `{}`)
	ctx, cancel := context.WithCancel(context.Background())
	inR, inW := io.Pipe()
	out := newRecorder()
	done := make(chan error, 1)
	go func() {
		done <- Serve(ctx, Config{Stage: "a", DSN: sch.dsn}, inR, out, func(ctx context.Context, m *Message) error {
			return m.Done()
		})
		inR.Close()
	}()
	cancel()
	io.WriteString(inW, fmt.Sprintf("%d\n", id)) // may fail if Serve saw the cancel first
	wantCancelledServe(t, done, out)
	if _, status, _ := sch.rowOf(t, id); status != "running" {
		t.Errorf("row became %s", status)
	}
}

// TestLoadUnprepared: the worker's session holds no prepared statement on the queue table. A
// prepared statement's plan goes generic after five executions, made for the table as it was
// then, and a queue table's statistics always lag: the batch's load, prepared once per
// connection, kept a plan that scanned the table at every batch once it had grown, until the
// next ANALYZE (its query under PREPARE in psql: a Seq Scan after 100,000 inserts into a
// table analyzed at 100 rows). The handler reads its own session's prepared statements.
func TestLoadUnprepared(t *testing.T) {
	sch := newSchema(t)
	var prepared []string
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		if strings.Contains(string(m.Payload), "probe") {
			rs, err := m.Tx.QueryContext(ctx, `SELECT statement FROM pg_prepared_statements WHERE statement LIKE '%work' || 'queue%'`)
			if err != nil {
				return err
			}
			defer rs.Close()
			for rs.Next() {
				var q string
				if err := rs.Scan(&q); err != nil {
					return err
				}
				prepared = append(prepared, q)
			}
			if err := rs.Err(); err != nil {
				return err
			}
		}
		return m.Done()
	})
	for range 8 {
		id := sch.put(t, "a", "running", `{}`)
		sv.send(t, id)
		if r := sv.replies(t, 1); r[0] != "0 done" {
			t.Fatalf("reply %q", r[0])
		}
	}
	sv.send(t, sch.put(t, "a", "running", `{"probe": true}`))
	if r := sv.replies(t, 1); r[0] != "0 done" {
		t.Fatalf("probe's reply %q", r[0])
	}
	if len(prepared) != 0 {
		t.Errorf("the worker's session prepared %q on the queue table, want nothing", prepared)
	}
}
