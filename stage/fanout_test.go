// fanout_test.go: the fan-out helpers of fanout.go against a real PostgreSQL with fanin.sql,
// driven through Serve as stage_test.go does; the dispatcher's part (claims, flushes) is
// played by the tests with SQL. T17 (a worker killed between pages; doc/design/fanin.md,
// "Test scenarios") runs the test binary as a stage program (PEPSI_SDK_FANOUT_WORKER) and
// SIGKILLs it.

package stage

import (
	"bufio"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/lib/pq"

	"pepsi-dispatch/internal/pgtest"
)

// The worker of TestFanoutPaginateKilled: it paginates range children at stage "a" two pages
// per run, reports each page on stderr, and after the first page of a run waits to be killed
// (before the run could commit).
func init() {
	if os.Getenv("PEPSI_SDK_FANOUT_WORKER") == "" {
		return
	}
	Run(func(ctx context.Context, m *Message) error {
		pages := 0
		_, err := m.Paginate(ctx, PageOpts{PageSize: 10, PagesPerRun: 2}, func(ctx context.Context, tx *sql.Tx, p Page) (int, int64, error) {
			n, last, err := hitPage(ctx, tx, p)
			if err != nil {
				return 0, 0, err
			}
			pages++
			fmt.Fprintf(os.Stderr, "page %d %d\n", p.From, n)
			if pages == 1 {
				time.Sleep(time.Hour) // waiting for SIGKILL, with the page's work uncommitted
			}
			return n, last, nil
		})
		return err
	})
}

// serveStage is serve of stage_test.go for any stage and NEXT list.
func serveStage(t *testing.T, sch *schema, stage string, next []string, h Handler) *serving {
	t.Helper()
	inR, inW := io.Pipe()
	sv := &serving{in: inW, out: newRecorder(), done: make(chan error, 1)}
	sessCh := make(chan *session, 1)
	cfg := Config{Stage: stage, Next: next, DSN: sch.dsn,
		hooks: &testHooks{session: func(s *session) { sessCh <- s }}}
	go func() {
		err := Serve(context.Background(), cfg, inR, sv.out, h)
		inR.CloseWithError(errors.New("serve returned"))
		sv.done <- err
	}()
	select {
	case sv.sess = <-sessCh:
	case err := <-sv.done:
		t.Fatalf("serve ended before connecting: %v", err)
	case <-time.After(waitTimeout):
		t.Fatal("timed out waiting for serve to connect")
	}
	t.Cleanup(func() {
		inW.Close()
		select {
		case <-sv.done:
		case <-time.After(waitTimeout):
			t.Error("timed out waiting for serve to end")
		}
	})
	return sv
}

// flush plays the dispatcher's fan-in flush; it returns the parents woken.
func (s *schema) flush(t testing.TB) []int64 {
	t.Helper()
	var woken []int64
	if err := s.db.QueryRow(`SELECT woken FROM fanin_flush(10000)`).Scan(pq.Array(&woken)); err != nil {
		t.Fatalf("fanin_flush: %v", err)
	}
	return woken
}

// children returns the children of id's group: ids, slices and payloads, in split order.
func (s *schema) children(t testing.TB, parent int64) (ids []int64, slices []string, payloads []string) {
	t.Helper()
	rows, err := s.db.Query(`SELECT c.workqueue_id, coalesce(c.range_lo::text, '-') || ':' || coalesce(c.range_hi::text, '-'),
	        coalesce(c.payload::text, 'NULL'), c.stage, c.status
	   FROM workqueue p JOIN workqueue c ON c.fanout_id = p.wait_fanout_id
	  WHERE p.workqueue_id = $1 ORDER BY c.fanout_seq`, parent)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var id int64
		var slice, payload, stage, status string
		if err := rows.Scan(&id, &slice, &payload, &stage, &status); err != nil {
			t.Fatal(err)
		}
		if stage != "kid" || status != "pending" {
			t.Errorf("child %d at %s/%s, want kid/pending", id, stage, status)
		}
		ids, slices, payloads = append(ids, id), append(slices, slice), append(payloads, payload)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return ids, slices, payloads
}

func TestFanoutSplit(t *testing.T) {
	sch := newSchema(t)
	three := sch.put(t, "a", "running", `{"n": 3}`)
	none := sch.put(t, "a", "running", `{"n": 0}`)
	notNext := sch.put(t, "a", "running", `{"n": -1}`)
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		var p struct{ N int }
		if err := json.Unmarshal(m.Payload, &p); err != nil {
			return err
		}
		m.State["split"] = p.N
		if p.N < 0 {
			err := m.Split(ctx, "zzz", "kid", nil)
			if !errors.Is(err, ErrNotNext) {
				t.Errorf("split to continuation zzz: %v, want ErrNotNext", err)
			}
			return err
		}
		var payloads []json.RawMessage
		for i := range p.N {
			payloads = append(payloads, json.RawMessage(fmt.Sprintf(`{"to": "r%d"}`, i)))
		}
		return m.Split(ctx, "b", "kid", payloads)
	})
	sv.send(t, three, none, notNext)
	r := sv.replies(t, 3)
	if r[0] != "0" || r[1] != "0" {
		t.Fatalf("replies %q", r)
	}
	wantFailure(t, r[2], `"zzz"`)
	if stage, status, state := sch.rowOf(t, three); stage != "b" || status != "waiting" || state != `{"orig": 1, "split": 3}` {
		t.Errorf("split message: %s/%s %s, want b/waiting with its state", stage, status, state)
	}
	ids, _, payloads := sch.children(t, three)
	if want := `{"to": "r0"},{"to": "r1"},{"to": "r2"}`; strings.Join(payloads, ",") != want {
		t.Errorf("children's payloads %v, want %s", payloads, want)
	}
	if stage, status, state := sch.rowOf(t, none); stage != "b" || status != "pending" || state != `{"orig": 1, "split": 0}` {
		t.Errorf("empty split: %s/%s %s, want b/pending (advanced)", stage, status, state)
	}
	if n := sch.int(t, `SELECT count(*) FROM fanout`); n != 1 {
		t.Errorf("%d groups, want 1", n)
	}
	if stage, status, _ := sch.rowOf(t, notNext); stage != "a" || status != "running" {
		t.Errorf("refused split moved the row: %s/%s", stage, status)
	}
	// The children end; the dispatcher's flush wakes the parent at its continuation.
	sch.exec(t, `UPDATE workqueue SET status = 'done' WHERE workqueue_id = ANY ($1)`, pq.Array(ids))
	if woken := sch.flush(t); len(woken) != 1 || woken[0] != three {
		t.Errorf("flush woke %v, want [%d]", woken, three)
	}
	if stage, status, _ := sch.rowOf(t, three); stage != "b" || status != "pending" {
		t.Errorf("woken parent: %s/%s, want b/pending", stage, status)
	}
}

// A split whose claim is gone (the dispatcher took the row back meanwhile) fails with
// ErrClaimLost and writes nothing; the batch's other messages are not affected.
func TestFanoutSplitClaimLost(t *testing.T) {
	sch := newSchema(t)
	lost := sch.put(t, "a", "running", `{"lose": true}`)
	good := sch.put(t, "a", "running", `{}`)
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		if strings.Contains(string(m.Payload), "lose") {
			// The batch transaction holds no lock on the row: the dispatcher's reset goes through.
			sch.exec(t, `UPDATE workqueue SET status = 'pending' WHERE workqueue_id = $1`, m.ID)
		}
		err := m.Split(ctx, "b", "kid", []json.RawMessage{json.RawMessage(`1`), nil})
		if strings.Contains(string(m.Payload), "lose") && !errors.Is(err, ErrClaimLost) {
			t.Errorf("split after the claim was lost: %v, want ErrClaimLost", err)
		}
		return err
	})
	sv.send(t, lost, good)
	r := sv.replies(t, 2)
	wantFailure(t, r[0], "claim lost")
	if r[1] != "0" {
		t.Errorf("reply for the good message %q", r[1])
	}
	if _, _, payloads := sch.children(t, good); strings.Join(payloads, ",") != "1,null" {
		t.Errorf("good split's payloads %v, want [1 null]", payloads)
	}
	if n := sch.int(t, `SELECT count(*) FROM fanout`); n != 1 {
		t.Errorf("%d groups, want only the good split's", n)
	}
}

func TestFanoutSplitRange(t *testing.T) {
	sch := newSchema(t)
	sch.exec(t, `CREATE TABLE target (id bigint PRIMARY KEY, hits int NOT NULL DEFAULT 0)`)
	// Skewed ids: 90 dense ones, 10 far apart.
	sch.exec(t, `INSERT INTO target (id) SELECT g FROM generate_series(1, 90) g
	             UNION ALL SELECT g * 1000000 FROM generate_series(1, 10) g`)
	width := sch.put(t, "a", "running", `{"how": "width"}`)
	count := sch.put(t, "a", "running", `{"how": "count"}`)
	empty := sch.put(t, "a", "running", `{"how": "empty"}`)
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		var lo, hi int64
		if err := m.Tx.QueryRowContext(ctx, `SELECT min(id), max(id) FROM target`).Scan(&lo, &hi); err != nil {
			return err
		}
		switch {
		case strings.Contains(string(m.Payload), "width"):
			return m.SplitRange(ctx, "c", "kid", lo, hi, RangeOpts{MaxChildren: 4, MinSpan: 1, Payload: json.RawMessage(`{"table": "target"}`)})
		case strings.Contains(string(m.Payload), "count"):
			return m.SplitRange(ctx, "c", "kid", lo, hi, RangeOpts{MaxChildren: 4, MinSpan: 1,
				IDQuery: "SELECT id FROM target WHERE hits = " + pq.QuoteLiteral("0")})
		default:
			return m.SplitRange(ctx, "c", "kid", 10, 9, RangeOpts{})
		}
	})
	sv.send(t, width, count, empty)
	if r := sv.replies(t, 3); strings.Join(r, ",") != "0,0,0" {
		t.Fatalf("replies %q", r)
	}
	_, slices, payloads := sch.children(t, width)
	if want := "1:2500001,2500001:5000001,5000001:7500001,7500001:10000001"; strings.Join(slices, ",") != want {
		t.Errorf("equal-width slices %v, want %s", slices, want)
	}
	if payloads[0] != `{"table": "target"}` {
		t.Errorf("children's payload %s", payloads[0])
	}
	// Equal count: 25 rows each.
	_, slices, _ = sch.children(t, count)
	if want := "1:26,26:51,51:76,76:10000001"; strings.Join(slices, ",") != want {
		t.Errorf("equal-count slices %v, want %s", slices, want)
	}
	if stage, status, _ := sch.rowOf(t, empty); stage != "c" || status != "pending" {
		t.Errorf("empty range: %s/%s, want c/pending", stage, status)
	}
}

func TestFanoutFaninResult(t *testing.T) {
	sch := newSchema(t)
	parent := sch.put(t, "a", "running", `{}`)
	if _, err := sch.db.Exec(`SELECT fanout_split_range($1, 'a', 'b', 'kid', 0, 399, 4, 1)`, parent); err != nil {
		t.Fatal(err)
	}
	kids, _, _ := sch.children(t, parent)
	sch.exec(t, `UPDATE workqueue SET status = 'done' WHERE workqueue_id = ANY ($1)`, pq.Array([]int64{kids[0], kids[2]}))
	sch.exec(t, `UPDATE workqueue SET status = 'failed', state = '{"dispatch_error": "exit status 1: no route"}'
	    WHERE workqueue_id = ANY ($1)`, pq.Array([]int64{kids[1], kids[3]}))
	never := sch.put(t, "b", "running", `{}`)
	open := sch.put(t, "a", "running", `{}`)
	if _, err := sch.db.Exec(`SELECT fanout_split($1, 'a', 'b', 'kid', '[1]')`, open); err != nil {
		t.Fatal(err)
	}
	sch.exec(t, `UPDATE workqueue SET status = 'running' WHERE workqueue_id = $1`, open) // moved by hand
	if woken := sch.flush(t); len(woken) != 1 {
		t.Fatalf("flush woke %v", woken)
	}
	claimed := parent
	sch.exec(t, `UPDATE workqueue SET status = 'running' WHERE workqueue_id = $1`, claimed)
	type result struct {
		done, failed int
		children     []FailedChild
		err          error
	}
	results := map[int64]result{}
	sv := serveStage(t, sch, "b", []string{"end"}, func(ctx context.Context, m *Message) error {
		done, failed, children, err := m.FaninResult(ctx)
		results[m.ID] = result{done, failed, children, err}
		return m.Done()
	})
	sv.send(t, claimed, never, open)
	sv.replies(t, 3)
	got := results[claimed]
	if got.err != nil || got.done != 2 || got.failed != 2 || len(got.children) != 2 {
		t.Fatalf("FaninResult: %d done, %d failed, %+v, %v", got.done, got.failed, got.children, got.err)
	}
	for i, c := range got.children {
		seq := 1 + 2*i
		if c.ID != kids[seq] || c.Seq != seq || c.RangeLo == nil || *c.RangeLo != int64(seq*100) ||
			c.RangeHi == nil || *c.RangeHi != int64(seq*100+100) || c.Error != "exit status 1: no route" || c.Payload != nil {
			t.Errorf("failed child %d: %+v", i, c)
		}
	}
	if err := results[never].err; !errors.Is(err, ErrNotParent) {
		t.Errorf("a message that never split: %v, want ErrNotParent", err)
	}
	if err := results[open].err; !errors.Is(err, ErrGroupOpen) {
		t.Errorf("a message whose group is open: %v, want ErrGroupOpen", err)
	}
}

// hitPage is the PageFunc of the tests: it counts a hit on each row of the page.
func hitPage(ctx context.Context, tx *sql.Tx, p Page) (n int, last int64, err error) {
	err = tx.QueryRowContext(ctx, `
	    WITH page AS (SELECT id FROM target WHERE id >= $1 AND ($2::bigint IS NULL OR id < $2)
	                   ORDER BY id LIMIT $3),
	         act AS (UPDATE target t SET hits = hits + 1 FROM page WHERE t.id = page.id RETURNING t.id)
	    SELECT count(*), coalesce(max(id), 0) FROM act`, p.From, p.To, p.Limit).Scan(&n, &last)
	return n, last, err
}

// paginateFixture is a parent split over target's ids into two range children at stage "a".
func paginateFixture(t *testing.T, sch *schema) (parent int64, kids []int64) {
	sch.exec(t, `CREATE TABLE target (id bigint PRIMARY KEY, hits int NOT NULL DEFAULT 0)`)
	sch.exec(t, `INSERT INTO target (id) SELECT g * 3 FROM generate_series(1, 100) g`) // 3 … 300
	parent = sch.put(t, "split", "running", `{}`)
	if _, err := sch.db.Exec(`SELECT fanout_split_range($1, 'split', 'cont', 'a', 1, 300, 2, 1)`, parent); err != nil {
		t.Fatal(err)
	}
	if err := sch.db.QueryRow(`SELECT array_agg(workqueue_id ORDER BY fanout_seq) FROM workqueue
	    WHERE fanout_id IS NOT NULL`).Scan(pq.Array(&kids)); err != nil {
		t.Fatal(err)
	}
	sch.exec(t, `UPDATE workqueue SET status = 'running' WHERE workqueue_id = ANY ($1)`, pq.Array(kids))
	return parent, kids
}

// runUntilDone plays the dispatcher for the children: it sends each running child to the
// stage, and puts a deferred (paused) one back to running, until all are done.
func runUntilDone(t *testing.T, sch *schema, sv *serving, kids []int64) (runs int) {
	t.Helper()
	for runs = 0; runs < 100; runs++ {
		var running []int64
		if err := sch.db.QueryRow(`SELECT coalesce(array_agg(workqueue_id ORDER BY workqueue_id), '{}')
		    FROM workqueue WHERE workqueue_id = ANY ($1) AND status = 'running'`, pq.Array(kids)).
			Scan(pq.Array(&running)); err != nil {
			t.Fatal(err)
		}
		if len(running) == 0 {
			return runs
		}
		sv.send(t, running...)
		for _, r := range sv.replies(t, len(running)) {
			if r != "0" && r != "0 done" {
				t.Fatalf("reply %q", r)
			}
		}
		sch.exec(t, `UPDATE workqueue SET status = 'running', retry_at = NULL
		    WHERE workqueue_id = ANY ($1) AND status = 'paused'`, pq.Array(kids))
	}
	t.Fatal("children not done after 100 runs")
	return runs
}

// checkHitOnce checks that every target row was acted on exactly once.
func checkHitOnce(t *testing.T, sch *schema) {
	t.Helper()
	if n := sch.int(t, `SELECT count(*) FROM target WHERE hits <> 1`); n != 0 {
		t.Errorf("%d target rows acted on other than once", n)
	}
}

// TestFanoutPaginate is T17 in process: a run that fails after a page has acted rolls back
// the page and the cursor together; the re-run resumes; no row is acted on twice.
func TestFanoutPaginate(t *testing.T) {
	sch := newSchema(t)
	parent, kids := paginateFixture(t, sch)
	failOnce := true
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		pages := 0
		finished, err := m.Paginate(ctx, PageOpts{PageSize: 7, PagesPerRun: 2}, func(ctx context.Context, tx *sql.Tx, p Page) (int, int64, error) {
			if p.To.Int64 != 151 && p.To.Int64 != 301 {
				t.Errorf("page to %v", p.To)
			}
			n, last, err := hitPage(ctx, tx, p)
			pages++
			if err == nil && pages == 2 && failOnce && p.From > 200 {
				failOnce = false
				return 0, 0, errors.New("worker fell over mid-run")
			}
			return n, last, err
		})
		if err != nil {
			return err
		}
		if finished {
			return m.Done()
		}
		return nil
	})
	// The first run of each child: two pages of 7, deferred with the cursor.
	sv.send(t, kids...)
	sv.replies(t, 2)
	for _, id := range kids {
		if _, status, _ := sch.rowOf(t, id); status != "paused" {
			t.Fatalf("child %d after one run: %s, want paused (deferred for the next run)", id, status)
		}
		// Due at once by the server's clock (DeferFor(0)): a time from the worker's clock was
		// a minute in the server's future when the worker's clock was a minute ahead.
		if n := sch.int(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1 AND retry_at = status_at`, id); n != 1 {
			t.Errorf("child %d deferred for its next page: retry_at is not its status_at", id)
		}
	}
	var cursor int64
	if err := sch.db.QueryRow(`SELECT fanout_child_cursor($1)`, kids[0]).Scan(&cursor); err != nil {
		t.Fatal(err)
	}
	if cursor != 43 { // 14 rows, 3 … 42
		t.Errorf("cursor after one run %d, want 43", cursor)
	}
	sch.exec(t, `UPDATE workqueue SET status = 'running' WHERE workqueue_id = ANY ($1)`, pq.Array(kids))
	// Runs until done; one of them fails after its second page and is rolled back.
	var failed bool
	for runs := 0; ; runs++ {
		if runs > 100 {
			t.Fatal("children not done after 100 runs")
		}
		var running []int64
		if err := sch.db.QueryRow(`SELECT coalesce(array_agg(workqueue_id ORDER BY workqueue_id), '{}')
		    FROM workqueue WHERE workqueue_id = ANY ($1) AND status = 'running'`, pq.Array(kids)).
			Scan(pq.Array(&running)); err != nil {
			t.Fatal(err)
		}
		if len(running) == 0 {
			break
		}
		sv.send(t, running...)
		for _, r := range sv.replies(t, len(running)) {
			if strings.Contains(r, "worker fell over") {
				failed = true
				if n := sch.int(t, `SELECT count(*) FROM target WHERE hits > 1`); n != 0 {
					t.Fatalf("%d rows hit twice", n)
				}
			} else if r != "0" && r != "0 done" {
				t.Fatalf("reply %q", r)
			}
		}
		sch.exec(t, `UPDATE workqueue SET status = 'running', retry_at = NULL
		    WHERE workqueue_id = ANY ($1) AND status = 'paused'`, pq.Array(kids))
	}
	if !failed {
		t.Error("the failing run never happened")
	}
	checkHitOnce(t, sch)
	if n := sch.int(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = ANY ($1) AND status = 'done'`, pq.Array(kids)); n != 2 {
		t.Errorf("%d children done, want 2", n)
	}
	if woken := sch.flush(t); len(woken) != 1 || woken[0] != parent {
		t.Errorf("flush woke %v, want the parent %d", woken, parent)
	}
}

// TestFanoutPaginateKilled is T17 with a real kill: the stage program is SIGKILLed after a
// page acted, before its run committed; the re-run resumes and no row is acted on twice.
func TestFanoutPaginateKilled(t *testing.T) {
	sch := newSchema(t)
	_, kids := paginateFixture(t, sch)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// A first run that commits (in process), so the killed run starts from a cursor.
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		_, err := m.Paginate(ctx, PageOpts{PageSize: 10}, hitPage)
		return err
	})
	sv.send(t, kids[0])
	if r := sv.replies(t, 1); r[0] != "0" {
		t.Fatalf("reply %q", r[0])
	}
	if err := sv.end(t); err != nil {
		t.Fatal(err)
	}
	sch.exec(t, `UPDATE workqueue SET status = 'running' WHERE workqueue_id = $1`, kids[0])

	cmd := exec.Command(exe, "worker")
	cmd.Env = append(os.Environ(), "PEPSI_SDK_FANOUT_WORKER=1", "PEPSI_STAGE=a", "PEPSI_NEXT=", "PEPSI_DSN="+sch.dsn)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(stdin, "%d\n", kids[0])
	lines := make(chan string, 1)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	select {
	case line := <-lines:
		if line != "page 31 10" {
			t.Errorf("worker's first page: %q, want page 31 10 (resumed after the committed run)", line)
		}
	case <-time.After(waitTimeout):
		t.Fatal("timed out waiting for the worker's first page")
	}
	if n := sch.int(t, `SELECT count(*) FROM target WHERE hits > 0`); n != 10 {
		t.Errorf("%d rows hit while the run is open, want the 10 of the committed run", n)
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	cmd.Wait() // killed: the error is the signal
	for range lines {
	}
	// The killed run's backend rolls back when the server notices the closed socket.
	app := "pepsi-" + sch.name
	pgtest.WaitFor(t, waitTimeout, "the killed worker's backend to end", func() bool {
		return sch.int(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, app) == 0
	})
	if n := sch.int(t, `SELECT count(*) FROM target WHERE hits > 0`); n != 10 {
		t.Errorf("%d rows hit after the kill, want 10: the killed run committed something", n)
	}
	// The dispatcher would put the row back; the next worker resumes from the cursor.
	sv = serve(t, sch, func(ctx context.Context, m *Message) error {
		finished, err := m.Paginate(ctx, PageOpts{PageSize: 10, PagesPerRun: 3}, hitPage)
		if err != nil || !finished {
			return err
		}
		return m.Done()
	})
	runUntilDone(t, sch, sv, kids)
	checkHitOnce(t, sch)
}

// Paginate's edges: not a range child; the top of int8, where the cursor passes the maximum.
func TestFanoutPaginateEdges(t *testing.T) {
	sch := newSchema(t)
	sch.exec(t, `CREATE TABLE target (id bigint PRIMARY KEY, hits int NOT NULL DEFAULT 0)`)
	sch.exec(t, `INSERT INTO target (id) VALUES (9223372036854775806), (9223372036854775807)`)
	parent := sch.put(t, "split", "running", `{}`)
	if _, err := sch.db.Exec(`SELECT fanout_split_range($1, 'split', 'cont', 'a', 9223372036854775800, 9223372036854775807, 1, 1)`, parent); err != nil {
		t.Fatal(err)
	}
	var kid int64
	if err := sch.db.QueryRow(`SELECT workqueue_id FROM workqueue WHERE fanout_id IS NOT NULL`).Scan(&kid); err != nil {
		t.Fatal(err)
	}
	sch.exec(t, `UPDATE workqueue SET status = 'running' WHERE workqueue_id = $1`, kid)
	plain := sch.put(t, "a", "running", `{}`)
	var plainErr error
	sv := serve(t, sch, func(ctx context.Context, m *Message) error {
		finished, err := m.Paginate(ctx, PageOpts{PageSize: 2}, func(ctx context.Context, tx *sql.Tx, p Page) (int, int64, error) {
			if p.To.Valid {
				t.Errorf("slice ending at int8 max: To %v, want NULL", p.To)
			}
			return hitPage(ctx, tx, p)
		})
		if m.ID == plain {
			plainErr = err
		}
		if err != nil || !finished {
			return err
		}
		return m.Done()
	})
	sv.send(t, kid, plain)
	r := sv.replies(t, 2)
	if r[0] != "0 done" {
		t.Fatalf("reply %q", r[0])
	}
	wantFailure(t, r[1], "not a range child")
	if !errors.Is(plainErr, ErrNotRangeChild) {
		t.Errorf("paginate a plain message: %v, want ErrNotRangeChild", plainErr)
	}
	if _, status, state := sch.rowOf(t, kid); status != "done" || !strings.Contains(state, `"cursor": 9223372036854775808`) {
		t.Errorf("child at int8 max: %s %s, want done with the cursor past the maximum", status, state)
	}
	checkHitOnce(t, sch)
}

// TestFanoutSplitRangeStageLimits: RangeOpts left at 0 take the split stage's MAX_CHILDREN and
// MIN_SPAN, which the dispatcher passes as PEPSI_MAX_CHILDREN and PEPSI_MIN_SPAN.
func TestFanoutSplitRangeStageLimits(t *testing.T) {
	env := map[string]string{"PEPSI_STAGE": "a", "PEPSI_DSN": "host=/x", "PEPSI_MAX_CHILDREN": "3", "PEPSI_MIN_SPAN": "10"}
	cfg, err := loadConfig([]string{"worker"}, func(k string) string { return env[k] })
	if err != nil || cfg.MaxChildren != 3 || cfg.MinSpan != 10 {
		t.Fatalf("loadConfig: %+v, %v", cfg, err)
	}
	env["PEPSI_MIN_SPAN"] = "-1"
	if _, err := loadConfig([]string{"worker"}, func(k string) string { return env[k] }); err == nil || !strings.Contains(err.Error(), "PEPSI_MIN_SPAN") {
		t.Errorf("bad PEPSI_MIN_SPAN accepted: %v", err)
	}
	sch := newSchema(t)
	wide := sch.put(t, "a", "running", `{}`)
	narrow := sch.put(t, "a", "running", `{}`)
	sv := serveFused(t, sch, Config{Stage: "a", Next: []string{"b", "c"}, MaxChildren: 3, MinSpan: 10},
		map[string]Handler{"a": func(ctx context.Context, m *Message) error {
			if m.ID == wide {
				return m.SplitRange(ctx, "c", "kid", 1, 1000, RangeOpts{}) // capped at 3 children
			}
			return m.SplitRange(ctx, "c", "kid", 1, 25, RangeOpts{}) // 25 ids, slices of ≥ 10: 2
		}})
	sv.send(t, wide, narrow)
	if r := sv.replies(t, 2); strings.Join(r, ",") != "0,0" {
		t.Fatalf("replies %q", r)
	}
	for parent, want := range map[int64]int{wide: 3, narrow: 2} {
		n := sch.int(t, `SELECT count(*) FROM workqueue w JOIN fanout f ON f.fanout_id = w.fanout_id WHERE f.parent_id = $1`, parent)
		if n != want {
			t.Errorf("parent %d: %d children, want %d", parent, n, want)
		}
	}
}
