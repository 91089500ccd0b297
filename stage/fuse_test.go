// fuse_test.go: stage fusion (ServeStages): a stage's advance running the next stage's handler
// in the same pass and transaction, the fallback to the plain advance when that stage fails,
// the status line's report, and PEPSI_FUSE. Against a real PostgreSQL, through ServeStages
// with pipes, as stage_test.go does.

package stage

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"strings"
	"testing"
	"time"
)

// serveFused starts ServeStages for cfg (its DSN and session hook set here; a batchTime in
// cfg.hooks is kept) and stops it at the end of the test.
func serveFused(t *testing.T, sch *schema, cfg Config, handlers map[string]Handler) *serving {
	t.Helper()
	inR, inW := io.Pipe()
	sv := &serving{in: inW, out: newRecorder(), done: make(chan error, 1)}
	sessCh := make(chan *session, 1)
	cfg.DSN = sch.dsn
	hooks := testHooks{session: func(s *session) { sessCh <- s }}
	if cfg.hooks != nil {
		hooks.batchTime = cfg.hooks.batchTime
	}
	cfg.hooks = &hooks
	go func() {
		err := ServeStages(context.Background(), cfg, inR, sv.out, handlers)
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

// statements returns the requests sent on the session's connection so far.
func (sv *serving) statements() int64 {
	sv.sess.mu.Lock()
	defer sv.sess.mu.Unlock()
	return sv.sess.statements
}

// wantReply checks a status line against a regular expression (anchored).
func wantReply(t testing.TB, reply, pattern string) {
	t.Helper()
	if !regexp.MustCompile(`^(?:` + pattern + `)$`).MatchString(reply) {
		t.Errorf("reply %q, want %s", reply, pattern)
	}
}

// fusedRow is a row as the fusion tests check it.
type fusedRow struct {
	stage, status string
	attempts      int
	state         map[string]any
}

func (s *schema) fusedRow(t testing.TB, id int64) fusedRow {
	t.Helper()
	var r fusedRow
	var state string
	err := s.db.QueryRow(`SELECT stage, status, attempts, state::text FROM workqueue WHERE workqueue_id = $1`, id).
		Scan(&r.stage, &r.status, &r.attempts, &state)
	if err != nil {
		t.Fatalf("row %d: %v", id, err)
	}
	if err := json.Unmarshal([]byte(state), &r.state); err != nil {
		t.Fatalf("row %d state %s: %v", id, state, err)
	}
	return r
}

// sideStages returns the stages that recorded message id in fused_side, in order.
func (s *schema) sideStages(t testing.TB, id int64) string {
	t.Helper()
	rows, err := s.db.Query(`SELECT stage FROM fused_side WHERE id = $1 ORDER BY seq`, id)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var st string
		if err := rows.Scan(&st); err != nil {
			t.Fatal(err)
		}
		out = append(out, st)
	}
	return strings.Join(out, ",")
}

const fusedSideDDL = `CREATE TABLE fused_side (seq bigserial, id bigint NOT NULL, stage text NOT NULL)`

// The basic case: a advances to b, which this program fuses: b's handler runs in the same
// pass, sees the message as a left it, and its Done is the message's one outcome, written at
// stage b in the batch's outcome statement. The status line reports done and the fused stage.
func TestFusionAdvanceToDone(t *testing.T) {
	sch := newSchema(t)
	id := sch.put(t, "a", "running", `{"n": 7}`)
	sch.exec(t, `UPDATE workqueue SET attempts = 2 WHERE workqueue_id = $1`, id)
	var seen *Message
	sv := serveFused(t, sch, Config{Stage: "a", Next: []string{"b"}, Fuse: map[string][]string{"b": {}}},
		map[string]Handler{
			"a": func(ctx context.Context, m *Message) error {
				m.State["by_a"] = m.Attempts
				if err := m.Advance("b"); err != nil {
					return err
				}
				m.State["after_advance"] = true // not written, and not seen by b
				return nil
			},
			"b": func(ctx context.Context, m *Message) error {
				seen = m
				if _, ok := m.State["after_advance"]; ok {
					t.Error("b saw a change a made after its advance")
				}
				m.State["by_b"] = m.Attempts
				time.Sleep(15 * time.Millisecond)
				return m.Done()
			},
		})
	before := sv.statements()
	sv.send(t, id)
	r := sv.replies(t, 1)[0]
	wantReply(t, r, `0 done fused=b:\d+`)
	if ms := strings.TrimPrefix(r, "0 done fused=b:"); len(ms) < 2 { // at least 15 ms: two digits
		t.Errorf("fused time %q ms: want b's handler time (>= 15)", ms)
	}
	if got := sv.statements() - before; got != 2 {
		t.Errorf("fused pass without statements of its own: %d requests, want 2 (load, outcome)", got)
	}
	if seen == nil || seen.Stage != "b" || seen.Attempts != 0 || seen.ID != id || string(seen.Payload) != `{"n": 7}` {
		t.Fatalf("b's message: %+v", seen)
	}
	row := sch.fusedRow(t, id)
	if row.stage != "b" || row.status != "done" || row.attempts != 0 {
		t.Errorf("row %s/%s attempts %d, want b/done attempts 0", row.stage, row.status, row.attempts)
	}
	if fmt.Sprint(row.state) != "map[by_a:2 by_b:0 orig:1]" {
		t.Errorf("state %v, want a's and b's changes", row.state)
	}
}

// Every combination of which stages of a two-stage chain (a → b → c, b and c fused) use m.Tx
// and which stage fails, run as messages of the same batches: the savepoints (lazy, nested or
// not, released or rolled back) must keep each message's writes exactly those of the stages
// whose outcome stands, and every stage must see the row running at its own stage.
func TestFusionChainMatrix(t *testing.T) {
	sch := newSchema(t)
	sch.exec(t, fusedSideDDL)
	type tcase struct {
		writes, fail string // stages that use m.Tx; the stage that fails ("" for none)
		id           int64
	}
	var cases []*tcase
	for _, fail := range []string{"", "b", "c"} {
		for mask := range 8 {
			var w string
			for i, st := range []string{"a", "b", "c"} {
				if mask&(1<<i) != 0 {
					w += st
				}
			}
			c := &tcase{writes: w, fail: fail}
			c.id = sch.put(t, "a", "running", fmt.Sprintf(`{"writes": %q, "fail": %q}`, w, fail))
			cases = append(cases, c)
		}
	}
	h := func(next string) Handler {
		return func(ctx context.Context, m *Message) error {
			var p struct{ Writes, Fail string }
			if err := json.Unmarshal(m.Payload, &p); err != nil {
				return err
			}
			m.State[m.Stage] = true
			if strings.Contains(p.Writes, m.Stage) {
				var stage, status string
				if err := m.Tx.QueryRowContext(ctx, `SELECT stage, status FROM workqueue WHERE workqueue_id = $1`, m.ID).
					Scan(&stage, &status); err != nil {
					return err
				}
				if stage != m.Stage || status != "running" {
					t.Errorf("message %d at %s sees its row %s/%s", m.ID, m.Stage, stage, status)
				}
				if _, err := m.Tx.ExecContext(ctx, `INSERT INTO fused_side (id, stage) VALUES ($1, $2)`, m.ID, m.Stage); err != nil {
					return err
				}
			}
			var err error
			if next == "" {
				err = m.Done()
			} else {
				err = m.Advance(next)
			}
			if err != nil {
				return err
			}
			if p.Fail == m.Stage {
				return fmt.Errorf("%s fails", m.Stage)
			}
			return nil
		}
	}
	// The batches are bounded by their savepoints alone (a batch time of an hour), as in
	// TestBatchBounds: on a loaded machine the 100 ms of maxBatchTime cut them after a message
	// or two (5 to 18 writes at load 20, every cut by time with 2 to 10 savepoints taken).
	sv := serveFused(t, sch, Config{Stage: "a", Next: []string{"b"}, Fuse: map[string][]string{"b": {"c"}, "c": {}},
		hooks: &testHooks{batchTime: time.Hour}},
		map[string]Handler{"a": h("b"), "b": h("c"), "c": h("")})
	ids := make([]int64, len(cases))
	for i, c := range cases {
		ids[i] = c.id
	}
	sv.send(t, ids...)
	replies := sv.replies(t, len(ids))
	for i, c := range cases {
		name := fmt.Sprintf("writes %q, fail %q", c.writes, c.fail)
		ran := map[string]string{"": "abc", "b": "a", "c": "ab"}[c.fail] // the stages whose outcome stands
		var wantSide []string
		for _, st := range ran {
			if strings.ContainsRune(c.writes, st) {
				wantSide = append(wantSide, string(st))
			}
		}
		row := sch.fusedRow(t, c.id)
		var wantStage, wantStatus, wantReplyRE string
		switch c.fail {
		case "":
			wantStage, wantStatus, wantReplyRE = "c", "done", `0 done fused=b:\d+,c:\d+`
		case "b":
			wantStage, wantStatus, wantReplyRE = "b", "pending", `0`
		case "c":
			wantStage, wantStatus, wantReplyRE = "c", "pending", `0 fused=b:\d+`
		}
		if !regexp.MustCompile(`^` + wantReplyRE + `$`).MatchString(replies[i]) {
			t.Errorf("%s: reply %q, want %s", name, replies[i], wantReplyRE)
		}
		if row.stage != wantStage || row.status != wantStatus || row.attempts != 0 {
			t.Errorf("%s: row %s/%s attempts %d, want %s/%s attempts 0", name, row.stage, row.status, row.attempts, wantStage, wantStatus)
		}
		for _, st := range "abc" {
			if _, ok := row.state[string(st)]; ok != strings.ContainsRune(ran, st) {
				t.Errorf("%s: state %v: want the marks of %q only", name, row.state, ran)
				break
			}
		}
		if got := sch.sideStages(t, c.id); got != strings.Join(wantSide, ",") {
			t.Errorf("%s: side rows of stages %q, want %q", name, got, strings.Join(wantSide, ","))
		}
	}
	// No batch opened more savepoints than PostgreSQL caches subtransactions for, and they were
	// batches: 24 messages in at most 2 writes.
	sv.sess.mu.Lock()
	peak := sv.sess.peak
	sv.sess.mu.Unlock()
	if peak > maxSubxids || peak == 0 {
		t.Errorf("a batch opened %d savepoints, want 1 to %d", peak, maxSubxids)
	}
	if n := sv.out.count(); n > 2 {
		t.Errorf("%d writes for 24 messages with two fusable stages, want at most 2", n)
	}
}

// The ways a fused stage can fail: each falls back to the plain advance of the stage before
// it, whose work is kept, and nothing of the failed stage is.
func TestFusionFailureFallsBack(t *testing.T) {
	sch := newSchema(t)
	sch.exec(t, fusedSideDDL)
	kinds := []string{"error", "panic", "none", "two", "notnext", "sqlerror", "badstate", "claimlost"}
	ids := map[string]int64{}
	var order []int64
	for _, k := range kinds {
		ids[k] = sch.put(t, "a", "running", fmt.Sprintf(`{"kind": %q}`, k))
		order = append(order, ids[k])
	}
	sv := serveFused(t, sch, Config{Stage: "a", Next: []string{"b"}, Fuse: map[string][]string{"b": {"c"}}},
		map[string]Handler{
			"a": func(ctx context.Context, m *Message) error {
				if _, err := m.Tx.ExecContext(ctx, `INSERT INTO fused_side (id, stage) VALUES ($1, 'a')`, m.ID); err != nil {
					return err
				}
				m.State["a"] = true
				return m.Advance("b")
			},
			"b": func(ctx context.Context, m *Message) error {
				var p struct{ Kind string }
				if err := json.Unmarshal(m.Payload, &p); err != nil {
					return err
				}
				m.State["b"] = true
				if p.Kind != "badstate" {
					if _, err := m.Tx.ExecContext(ctx, `INSERT INTO fused_side (id, stage) VALUES ($1, 'b')`, m.ID); err != nil {
						return err
					}
				}
				switch p.Kind {
				case "error":
					return errors.New("b says no")
				case "panic":
					panic("b panics")
				case "none":
					return nil
				case "two":
					m.Done()
					m.Advance("c")
					return nil
				case "notnext":
					return m.Advance("a") // a is not in b's NEXT (PEPSI_FUSE b=c)
				case "sqlerror":
					m.Tx.ExecContext(ctx, `SELECT 1/0`) // aborts the transaction; ignored on purpose
					return m.Done()
				case "badstate":
					m.State["bad"] = "a\x00b" // refused by jsonb: the outcome's write fails
					return m.Done()
				default: // the row moved away: b's outcome and then a's find no claim
					if _, err := m.Tx.ExecContext(ctx, `UPDATE workqueue SET status = 'pending' WHERE workqueue_id = $1`, m.ID); err != nil {
						return err
					}
					return m.Done()
				}
			},
		})
	sv.send(t, order...)
	r := sv.replies(t, len(order))
	for i, k := range kinds {
		id := ids[k]
		// claimlost too: b's write to the row is rolled back with b, so a's claim is intact.
		if r[i] != "0" {
			t.Errorf("%s: reply %q, want 0 (a succeeded; b's failure is not reported)", k, r[i])
		}
		row := sch.fusedRow(t, id)
		if row.stage != "b" || row.status != "pending" || fmt.Sprint(row.state) != "map[a:true orig:1]" {
			t.Errorf("%s: row %s/%s %v, want b/pending with a's state", k, row.stage, row.status, row.state)
		}
		if got := sch.sideStages(t, id); got != "a" {
			t.Errorf("%s: side rows of %q, want a's only", k, got)
		}
	}
}

// The stage before a failed fused stage wrote, and its own outcome, written after the fused
// stage's rollback, fails: the claim is gone, or its state is refused. The message fails and
// everything it wrote is rolled back to its savepoint (which the fused stage's savepoint,
// nested in it, must not have released), while the rest of the batch goes on.
func TestFusionFallbackFails(t *testing.T) {
	sch := newSchema(t)
	sch.exec(t, fusedSideDDL)
	lost := sch.put(t, "a", "running", `{"lost": true}`)
	bad := sch.put(t, "a", "running", `{"bad": true}`)
	next := sch.put(t, "a", "running", `{}`)
	entered, release := make(chan struct{}), make(chan struct{})
	sv := serveFused(t, sch, Config{Stage: "a", Next: []string{"b"}, Fuse: map[string][]string{"b": {}}},
		map[string]Handler{
			"a": func(ctx context.Context, m *Message) error {
				if _, err := m.Tx.ExecContext(ctx, `INSERT INTO fused_side (id, stage) VALUES ($1, 'a')`, m.ID); err != nil {
					return err
				}
				if strings.Contains(string(m.Payload), "bad") {
					m.State["bad"] = "a\x00b" // refused by jsonb when a's advance is written
				}
				return m.Advance("b")
			},
			"b": func(ctx context.Context, m *Message) error {
				p := string(m.Payload)
				if strings.Contains(p, "lost") {
					// No statement: the row is not locked, and the dispatcher can take it back.
					close(entered)
					<-release
					return errors.New("b fails")
				}
				if _, err := m.Tx.ExecContext(ctx, `INSERT INTO fused_side (id, stage) VALUES ($1, 'b')`, m.ID); err != nil {
					return err
				}
				if strings.Contains(p, "bad") {
					return errors.New("b fails after writing")
				}
				return m.Done()
			},
		})
	sv.send(t, lost, bad, next)
	select {
	case <-entered:
	case <-time.After(waitTimeout):
		t.Fatal("timed out waiting for the handler")
	}
	sch.exec(t, `UPDATE workqueue SET status = 'pending' WHERE workqueue_id = $1`, lost) // the dispatcher took it back
	close(release)
	r := sv.replies(t, 3)
	wantFailure(t, r[0], "claim lost")
	wantFailure(t, r[1], "(22P05)") // untranslatable_character: "unsupported Unicode escape" in English
	wantReply(t, r[2], `0 done fused=b:\d+`)
	for _, c := range []struct {
		id                  int64
		stage, status, side string
	}{{lost, "a", "pending", ""}, {bad, "a", "running", ""}, {next, "b", "done", "a,b"}} {
		if row := sch.fusedRow(t, c.id); row.stage != c.stage || row.status != c.status {
			t.Errorf("row %d: %s/%s, want %s/%s", c.id, row.stage, row.status, c.stage, c.status)
		}
		if got := sch.sideStages(t, c.id); got != c.side {
			t.Errorf("row %d: side rows of %q, want %q", c.id, got, c.side)
		}
	}
}

// A fused stage whose outcome is kept for the outcome statement (its handler did not use m.Tx)
// and refused there (a state jsonb rejects) falls back to the advance that led to it; a lost
// claim fails the message.
func TestFusionKeptOutcomeRefused(t *testing.T) {
	sch := newSchema(t)
	bad := sch.put(t, "a", "running", `{"bad": true}`)
	good := sch.put(t, "a", "running", `{}`)
	moved := sch.put(t, "a", "running", `{"moved": true}`)
	entered, release := make(chan struct{}), make(chan struct{})
	sv := serveFused(t, sch, Config{Stage: "a", Next: []string{"b"}, Fuse: map[string][]string{"b": {}}},
		map[string]Handler{
			"a": func(ctx context.Context, m *Message) error { return m.Advance("b") },
			"b": func(ctx context.Context, m *Message) error {
				switch {
				case strings.Contains(string(m.Payload), "bad"):
					m.State["bad"] = "a\x00b"
				case strings.Contains(string(m.Payload), "moved"):
					close(entered)
					<-release
				}
				return m.Done()
			},
		})
	sv.send(t, bad, good, moved)
	select {
	case <-entered:
	case <-time.After(waitTimeout):
		t.Fatal("timed out waiting for the handler")
	}
	sch.exec(t, `UPDATE workqueue SET status = 'pending' WHERE workqueue_id = $1`, moved) // the dispatcher took it back
	close(release)
	r := sv.replies(t, 3)
	if r[0] != "0" {
		t.Errorf("refused fused outcome: reply %q, want 0 (a's advance)", r[0])
	}
	wantReply(t, r[1], `0 done fused=b:\d+`)
	wantFailure(t, r[2], "claim lost")
	for _, c := range []struct {
		id            int64
		stage, status string
	}{{bad, "b", "pending"}, {good, "b", "done"}, {moved, "a", "pending"}} {
		if row := sch.fusedRow(t, c.id); row.stage != c.stage || row.status != c.status {
			t.Errorf("row %d: %s/%s, want %s/%s", c.id, row.stage, row.status, c.stage, c.status)
		}
	}
}

// No fusion where it does not apply: a stage the program has no handler for, a NEXT stage
// that is not in PEPSI_FUSE, a fused stage's NEXT that is not fusable, a way back to the
// claimed stage (each stage runs at most once per pass), and Serve with one handler.
func TestFusionOnlyWhereItApplies(t *testing.T) {
	sch := newSchema(t)
	toB := sch.put(t, "a", "running", `{"to": "b"}`)
	toC := sch.put(t, "a", "running", `{"to": "c"}`)
	toD := sch.put(t, "a", "running", `{"to": "d"}`)
	back := sch.put(t, "a", "running", `{"to": "e"}`)
	fuse := map[string][]string{"b": {"x"}, "d": {}, "e": {"a"}}
	var ranAt []string
	handler := func(ctx context.Context, m *Message) error {
		ranAt = append(ranAt, m.Stage)
		var p struct{ To string }
		if err := json.Unmarshal(m.Payload, &p); err != nil {
			return err
		}
		switch m.Stage {
		case "a":
			return m.Advance(p.To)
		case "b":
			return m.Advance("x") // x is in b's NEXT but not fusable
		case "e":
			return m.Advance("a") // back to the claimed stage
		}
		return m.Done()
	}
	sv := serveFused(t, sch, Config{Stage: "a", Next: []string{"b", "c", "d", "e"}, Fuse: fuse},
		map[string]Handler{"a": handler, "b": handler, "c": handler, "e": handler, "x": handler})
	sv.send(t, toB, toC, toD, back)
	r := sv.replies(t, 4)
	wantReply(t, r[0], `0 fused=b:\d+`)
	wantReply(t, r[1], `0`) // c: implemented, but not FUSE = yes
	wantReply(t, r[2], `0`) // d: fusable, but not implemented here
	wantReply(t, r[3], `0 fused=e:\d+`)
	for _, c := range []struct {
		id    int64
		stage string
	}{{toB, "x"}, {toC, "c"}, {toD, "d"}, {back, "a"}} {
		if row := sch.fusedRow(t, c.id); row.stage != c.stage || row.status != "pending" || row.attempts != 0 {
			t.Errorf("row %d: %s/%s attempts %d, want %s/pending", c.id, row.stage, row.status, row.attempts, c.stage)
		}
	}
	if got := strings.Join(ranAt, " "); got != "a b a a a e" {
		t.Errorf("handlers ran at %q, want a b a a a e", got)
	}

	// Serve has one handler: it fuses nothing, whatever Fuse says.
	sch2 := newSchema(t)
	id := sch2.put(t, "a", "running", `{}`)
	inR, inW := io.Pipe()
	out := newRecorder()
	done := make(chan error, 1)
	go func() {
		done <- Serve(context.Background(), Config{Stage: "a", Next: []string{"b"}, DSN: sch2.dsn, Fuse: map[string][]string{"b": {}}},
			inR, out, func(ctx context.Context, m *Message) error {
				if m.Stage != "a" {
					t.Errorf("Serve ran a handler at %s", m.Stage)
				}
				return m.Advance("b")
			})
	}()
	fmt.Fprintf(inW, "%d\n", id)
	inW.Close()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(waitTimeout):
		t.Fatal("timed out waiting for Serve")
	}
	if got := string(out.writes[0]); got != "0\n" {
		t.Errorf("Serve with Fuse: reply %q, want 0", got)
	}
	if row := sch2.fusedRow(t, id); row.stage != "b" || row.status != "pending" {
		t.Errorf("Serve with Fuse: row %s/%s, want b/pending", row.stage, row.status)
	}
}

// A fused stage's Defer pauses the row at that stage; its statements' round trips are those
// of any handler that uses m.Tx, plus none for being fused: SAVEPOINT (with the move of the
// row), its statement, its outcome.
func TestFusionDeferAndRoundTrips(t *testing.T) {
	sch := newSchema(t)
	id := sch.put(t, "a", "running", `{}`)
	until := time.Date(2031, 2, 3, 4, 5, 6, 0, time.UTC)
	sv := serveFused(t, sch, Config{Stage: "a", Next: []string{"b"}, Fuse: map[string][]string{"b": {}}},
		map[string]Handler{
			"a": func(ctx context.Context, m *Message) error { return m.Advance("b") },
			"b": func(ctx context.Context, m *Message) error {
				if _, err := m.Tx.ExecContext(ctx, `INSERT INTO side (id, note) VALUES ($1, 'b')`, m.ID); err != nil {
					return err
				}
				return m.Defer(until)
			},
		})
	before := sv.statements()
	sv.send(t, id)
	wantReply(t, sv.replies(t, 1)[0], `0 fused=b:\d+`)
	if got := sv.statements() - before; got != 5 {
		t.Errorf("fused stage with one statement: %d requests, want 5 (load, BEGIN with SAVEPOINT and move, INSERT, UPDATE, COMMIT)", got)
	}
	row := sch.fusedRow(t, id)
	if row.stage != "b" || row.status != "paused" {
		t.Errorf("row %s/%s, want b/paused", row.stage, row.status)
	}
	if n := sch.int(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1 AND retry_at = $2`, id, until); n != 1 {
		t.Errorf("retry_at is not %v", until)
	}
	if n := sch.int(t, `SELECT count(*) FROM side WHERE id = $1`, id); n != 1 {
		t.Errorf("b's side row: %d, want 1", n)
	}
}

// A fused stage may split: inside its savepoint the row is running at its stage, which is what
// the split's guard names. The split is its outcome and ends the pass.
func TestFusionSplit(t *testing.T) {
	sch := newSchema(t)
	if sch.int(t, `SELECT count(*) FROM pg_proc WHERE proname = 'fanout_split'`) == 0 {
		t.Skip("schema.sql has no fanout_split")
	}
	id := sch.put(t, "a", "running", `{}`)
	sv := serveFused(t, sch, Config{Stage: "a", Next: []string{"b"}, Fuse: map[string][]string{"b": {"cont"}}},
		map[string]Handler{
			"a": func(ctx context.Context, m *Message) error { return m.Advance("b") },
			"b": func(ctx context.Context, m *Message) error {
				m.State["split_by"] = m.Stage
				return m.Split(ctx, "cont", "kid", []json.RawMessage{json.RawMessage(`1`), json.RawMessage(`2`)})
			},
		})
	sv.send(t, id)
	wantReply(t, sv.replies(t, 1)[0], `0 fused=b:\d+`)
	row := sch.fusedRow(t, id)
	if row.stage != "cont" || row.status != "waiting" || row.state["split_by"] != "b" {
		t.Errorf("row %s/%s %v, want waiting at cont, split by b", row.stage, row.status, row.state)
	}
	if n := sch.int(t, `SELECT count(*) FROM workqueue WHERE stage = 'kid' AND status = 'pending'`); n != 2 {
		t.Errorf("%d children, want 2", n)
	}
}

func TestFusionParseFuse(t *testing.T) {
	env := map[string]string{"PEPSI_STAGE": "parse", "PEPSI_NEXT": "enrich", "PEPSI_DSN": "host=/x",
		"PEPSI_FUSE": " enrich=deliver,archive  deliver= archive="}
	getenv := func(k string) string { return env[k] }
	cfg, err := loadConfig([]string{"worker"}, getenv)
	if err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(cfg.Fuse); got != "map[archive:[] deliver:[] enrich:[deliver archive]]" {
		t.Errorf("Fuse %s", got)
	}
	env["PEPSI_FUSE"] = ""
	if cfg, err := loadConfig([]string{"worker"}, getenv); err != nil || cfg.Fuse != nil {
		t.Errorf("empty PEPSI_FUSE: %v, %v; want no fusion", cfg.Fuse, err)
	}
	for in, want := range map[string]string{
		"enrich":             "want STAGE=NEXT1,NEXT2",
		"=deliver":           `stage name ""`,
		"Enrich=deliver":     `stage name "Enrich"`,
		"enrich=deliver,":    `next stage name ""`,
		"enrich=,deliver":    `next stage name ""`,
		"enrich=del iver":    "want STAGE=NEXT1,NEXT2", // "iver" is an entry of its own
		"enrich=a=b":         `next stage name "a=b"`,
		"enrich=a enrich=b":  "listed twice",
		"enrich=deliver;rm":  `next stage name "deliver;rm"`,
		"deliver= enrich=X1": `next stage name "X1"`,
	} {
		env["PEPSI_FUSE"] = in
		_, err := loadConfig([]string{"worker"}, getenv)
		if err == nil || !strings.Contains(err.Error(), "PEPSI_FUSE") || !strings.Contains(err.Error(), want) {
			t.Errorf("PEPSI_FUSE=%q: %v, want an error naming PEPSI_FUSE and %q", in, err, want)
		}
	}

	// As a process: a malformed PEPSI_FUSE, or a stage the program has no handler for, is a
	// start-up error (exit 2) that names the problem.
	var stderr strings.Builder
	env["PEPSI_FUSE"] = "enrich"
	if code := run(context.Background(), []string{"worker"}, getenv, strings.NewReader(""), io.Discard, &stderr,
		map[string]Handler{"parse": func(context.Context, *Message) error { return nil }}, nil); code != 2 ||
		!strings.Contains(stderr.String(), "PEPSI_FUSE") {
		t.Errorf("malformed PEPSI_FUSE: exit %d, stderr %q; want 2 naming PEPSI_FUSE", code, stderr.String())
	}
	env["PEPSI_FUSE"] = "enrich=deliver deliver="
	stderr.Reset()
	if code := run(context.Background(), []string{"worker"}, getenv, strings.NewReader(""), io.Discard, &stderr,
		map[string]Handler{"enrich": func(context.Context, *Message) error { return nil }}, nil); code != 2 ||
		!strings.Contains(stderr.String(), "no handler for stage parse") {
		t.Errorf("stage not implemented: exit %d, stderr %q; want 2 naming the stage", code, stderr.String())
	}

	// Serve's and ServeStages' own checks.
	bad := []struct {
		cfg      Config
		handlers map[string]Handler
		want     string
	}{
		{Config{Stage: "a", Fuse: map[string][]string{"B": nil}}, map[string]Handler{"a": func(context.Context, *Message) error { return nil }}, "fused stage name"},
		{Config{Stage: "a", Fuse: map[string][]string{"b": {"C"}}}, map[string]Handler{"a": func(context.Context, *Message) error { return nil }}, "next stage name"},
		{Config{Stage: "a"}, map[string]Handler{"b": func(context.Context, *Message) error { return nil }}, "no handler for stage a"},
		{Config{Stage: "a"}, map[string]Handler{"a": nil}, "handler for stage a is nil"},
		{Config{Stage: "a"}, map[string]Handler{"a": func(context.Context, *Message) error { return nil }, "B": func(context.Context, *Message) error { return nil }}, `stage "B"`},
	}
	for _, c := range bad {
		err := ServeStages(context.Background(), c.cfg, strings.NewReader(""), io.Discard, c.handlers)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("ServeStages(%+v): %v, want an error mentioning %q", c.cfg, err, c.want)
		}
	}
}

// The status line's words: done, fused, both, neither; each separated by one space.
func TestFusionReplyWords(t *testing.T) {
	done := &Message{Stage: "c", chosen: "done", kind: doneKind}
	done.link.took = 2500 * time.Microsecond
	adv := &Message{Stage: "b", chosen: "advance to c", kind: advanceKind}
	adv.link.took = 3 * time.Millisecond
	for _, c := range []struct {
		r    reply
		want string
	}{
		{reply{ok: true, final: &Message{chosen: "done", kind: doneKind}}, "0 done\n"},
		{reply{ok: true, final: &Message{chosen: "advance to b", kind: advanceKind}}, "0\n"},
		{reply{ok: true, final: adv, fused: []*Message{adv}}, "0 fused=b:3\n"},
		{reply{ok: true, final: done, fused: []*Message{adv, done}}, "0 done fused=b:3,c:2\n"},
		{reply{reason: "x"}, "1 x\n"},
	} {
		if got := string(formatReplies([]reply{c.r})); got != c.want {
			t.Errorf("reply %q, want %q", got, c.want)
		}
	}
	r := reply{ok: true, final: done, fused: []*Message{adv, done}}
	r.fallBackTo(adv)
	if got := string(formatReplies([]reply{r})); got != "0 fused=b:3\n" {
		t.Errorf("after falling back to b: %q", got)
	}
}
