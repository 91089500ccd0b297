// faults_test.go: nothing is lost. Failures, garbage, crashes, hangs, a missing program,
// SIGKILL and SIGTERM of the dispatcher, a restarted PostgreSQL and killed connections —
// with real processes and a real PostgreSQL, and the (message, stage) runs checked each time.

package main

import (
	"bufio"
	"context"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// rawWorker is a stage without the SDK that misbehaves as a message's payload asks:
// {"garbage": true} answers a line that is not a status; {"commit_then_crash": true} commits
// the message's outcome and dies before answering; {"spawn_and_hang": true} starts a child
// process (recorded in runs with stage 'child') and never answers; {"reply_hex": H} answers
// the bytes H (in hex) as its line, without a write. Other messages finish, answered "0" or,
// with {"reply": L}, the line L.
func rawWorker() int {
	db, err := sql.Open("postgres", os.Getenv("PEPSI_DSN"))
	if err != nil {
		return 2
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	st := os.Getenv("PEPSI_STAGE")
	next := strings.Fields(os.Getenv("PEPSI_NEXT"))
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		id, _ := strconv.ParseInt(in.Text(), 10, 64)
		var payload []byte
		if err := db.QueryRow(`SELECT coalesce(payload, '{}') FROM workqueue WHERE workqueue_id = $1`, id).Scan(&payload); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		var b struct {
			Garbage         bool   `json:"garbage"`
			CommitThenCrash bool   `json:"commit_then_crash"`
			SpawnAndHang    bool   `json:"spawn_and_hang"`
			ReplyHex        string `json:"reply_hex"`
			Reply           string `json:"reply"` // the status line after the commit, "0" without it
		}
		json.Unmarshal(payload, &b)
		switch {
		case b.Garbage:
			fmt.Println("this is not a status")
			continue
		case b.ReplyHex != "":
			line, _ := hex.DecodeString(b.ReplyHex)
			os.Stdout.Write(append(line, '\n'))
			continue
		case b.SpawnAndHang:
			child := exec.Command("sleep", "1000")
			child.Start()
			db.Exec(`INSERT INTO runs (id, stage, pid) VALUES ($1, 'child', $2)`, id, child.Process.Pid)
			select {}
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
		if _, err := tx.Exec(q, args...); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		if err := tx.Commit(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		if b.CommitThenCrash {
			os.Exit(4)
		}
		if b.Reply == "" {
			b.Reply = "0"
		}
		fmt.Println(b.Reply)
	}
	return 0
}

func init() { testWorkers["raw"] = rawWorker }

// rowState is one workqueue row as the fault tests look at it.
type rowState struct {
	stage, status string
	attempts      int
	reason        string
}

func row(t testing.TB, s *testSchema, id int64) rowState {
	t.Helper()
	var r rowState
	var reason sql.NullString
	if err := s.DB.QueryRow(`SELECT stage, status, attempts, state->>'dispatch_error' FROM workqueue WHERE workqueue_id = $1`, id).
		Scan(&r.stage, &r.status, &r.attempts, &reason); err != nil {
		t.Fatalf("row %d: %v", id, err)
	}
	r.reason = reason.String
	return r
}

// insertOne enqueues one message and returns its id.
func insertOne(t testing.TB, s *testSchema, stage, payload string) int64 {
	t.Helper()
	var id int64
	if err := s.DB.QueryRow(`INSERT INTO workqueue (stage, payload) VALUES ($1, $2::jsonb) RETURNING workqueue_id`, stage, payload).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

// warmUp runs one message through stage so that its worker has answered once: a worker that
// dies before its first answer is taken for a program that cannot start (the stage is held).
func warmUp(t testing.TB, s *testSchema, stage string) {
	t.Helper()
	id := insertOne(t, s, stage, `{}`)
	waitFor(t, 30*time.Second, "warm-up message done", func() bool { return row(t, s, id).status == "done" })
}

func TestFailureRetriesThenFailed(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 1\nMAX_ATTEMPTS = 3\nRETRY_DELAY = 0.2"), "pipeline")
	bad := insertOne(t, s, "a", `{"fail_at": "a"}`)
	good := insertOne(t, s, "a", `{}`)
	waitFor(t, 30*time.Second, "message failed for good", func() bool { return row(t, s, bad).status == "failed" })
	r := row(t, s, bad)
	if r.attempts != 3 {
		t.Errorf("attempts %d, want MAX_ATTEMPTS = 3", r.attempts)
	}
	if !strings.Contains(r.reason, "stage a: status 1: asked to fail at a (attempt 3)") {
		t.Errorf("dispatch_error %q does not say stage, status and the worker's text", r.reason)
	}
	if row(t, s, good).status != "done" {
		waitFor(t, 10*time.Second, "good message done", func() bool { return row(t, s, good).status == "done" })
	}
	if w := s.count(t, `SELECT count(DISTINCT pid) FROM runs`); w != 1 {
		t.Errorf("the worker did not live on after failures: %d worker processes", w)
	}
	if st := s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'running'`); st != 0 {
		t.Errorf("%d rows left running", st)
	}
	d.stop()
	if s.count(t, `SELECT failed FROM stage_stats WHERE stage = 'a'`) != 3 {
		t.Errorf("stage_stats.failed: want 3")
	}
	if s.count(t, `SELECT failed FROM dispatch_stats`) != 1 {
		t.Errorf("dispatch_stats.failed: want 1")
	}
}

func TestRetryBackoffDoubles(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	// Write the failures directly through the guarded statement: attempts 0,1,2 give
	// RETRY_DELAY × 1, 2, 4.
	conn := openLockConn(t, s)
	var cl claimer
	defer cl.close()
	for attempts, want := range []float64{10, 20, 40} {
		id := insertOne(t, s, "a", `{}`)
		s.exec(t, `UPDATE workqueue SET attempts = $2 WHERE workqueue_id = $1`, id, attempts)
		res, err := cl.claim(context.Background(), conn, map[string]int{"a": 1}, &keyLoad{})
		if err != nil || len(res.byStage["a"]) != 1 {
			t.Fatalf("claim: %v %v", res, err)
		}
		m := res.byStage["a"][0]
		out, _, err := writeFailures(context.Background(), conn, []failure{{m: m, reason: "r", maxAttempts: 5, retryDelay: 10 * time.Second}})
		if err != nil || len(out) != 1 {
			t.Fatalf("write failure: %v %v", out, err)
		}
		got := time.Until(out[0].retryAt).Seconds()
		if got < want-2 || got > want+1 {
			t.Errorf("attempt %d: retry in %.1fs, want %.0fs", attempts+1, got, want)
		}
		// A stale claim is never overwritten.
		out, held, err := writeFailures(context.Background(), conn, []failure{{m: m, reason: "again", maxAttempts: 5, retryDelay: time.Second}})
		if err != nil || len(out) != 0 || len(held) != 0 {
			t.Errorf("second write with the same claim touched the row, or says it is held: %v %v %v", out, held, err)
		}
	}
}

// TestWritesPassOverHeldRows: the failure and reset writes lock what they write and pass over
// a row that another transaction holds, and name it; a row no longer our claim is neither
// written nor named; once the holder lets go, the same write goes through.
func TestWritesPassOverHeldRows(t *testing.T) {
	s := newTestSchema(t)
	conn := openLockConn(t, s)
	var cl claimer
	defer cl.close()
	s.exec(t, `INSERT INTO workqueue (stage, payload) SELECT 'a', '{}' FROM generate_series(1, 6)`)
	res, err := cl.claim(context.Background(), conn, map[string]int{"a": 6}, &keyLoad{})
	if err != nil || len(res.byStage["a"]) != 6 {
		t.Fatalf("claim 6 rows: %v %v", res, err)
	}
	ms := res.byStage["a"]
	// ms[0] and ms[3] held by an open transaction; ms[1] and ms[4] no longer our claim.
	tx, err := s.DB.Begin()
	if err != nil {
		t.Fatalf("begin the holder: %v", err)
	}
	defer tx.Rollback()
	if _, err := tx.Exec(`SELECT 1 FROM workqueue WHERE workqueue_id IN ($1, $2) FOR UPDATE`, ms[0].id, ms[3].id); err != nil {
		t.Fatalf("hold two rows: %v", err)
	}
	s.exec(t, `UPDATE workqueue SET status = 'done' WHERE workqueue_id IN ($1, $2)`, ms[1].id, ms[4].id)
	fs := []failure{{m: ms[0], reason: "r", maxAttempts: 5, retryDelay: time.Second},
		{m: ms[1], reason: "r", maxAttempts: 5, retryDelay: time.Second},
		{m: ms[2], reason: "r", maxAttempts: 1, retryDelay: time.Second}}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	out, held, err := writeFailures(ctx, conn, fs)
	if err != nil {
		t.Fatalf("write failures past a held row: %v", err)
	}
	if len(out) != 1 || out[0].id != ms[2].id || out[0].status != "failed" || !maps.Equal(held, map[int64]bool{ms[0].id: true}) {
		t.Errorf("failure writes: wrote %+v, held %v; want only %d failed, %d held", out, held, ms[2].id, ms[0].id)
	}
	n, held, err := writeResets(ctx, conn, ms[3:])
	if err != nil {
		t.Fatalf("reset past a held row: %v", err)
	}
	if n != 1 || !maps.Equal(held, map[int64]bool{ms[3].id: true}) {
		t.Errorf("resets: wrote %d, held %v; want 1 written (%d), %d held", n, held, ms[5].id, ms[3].id)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatalf("let the rows go: %v", err)
	}
	if out, held, err = writeFailures(ctx, conn, fs[:1]); err != nil || len(out) != 1 || out[0].status != "paused" || len(held) != 0 {
		t.Errorf("failure write once the holder let go: %+v, held %v, %v; want it paused", out, held, err)
	}
	if n, held, err = writeResets(ctx, conn, ms[3:4]); err != nil || n != 1 || len(held) != 0 {
		t.Errorf("reset once the holder let go: wrote %d, held %v, %v; want 1", n, held, err)
	}
	if got := s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'running'`); got != 0 {
		t.Errorf("%d rows still running, want none", got)
	}
}

func TestGarbageReply(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	bad := insertOne(t, s, "a", `{"garbage": true}`)
	var rest []int64
	for i := 0; i < 3; i++ {
		rest = append(rest, insertOne(t, s, "a", `{}`))
	}
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 4\nRETRY_DELAY = 60"), "raw")
	waitFor(t, 30*time.Second, "garbage recorded", func() bool { return row(t, s, bad).status == "paused" })
	r := row(t, s, bad)
	if r.attempts != 1 || !strings.Contains(r.reason, "protocol error") || !strings.Contains(r.reason, "this is not a status") {
		t.Errorf("garbage head: %+v", r)
	}
	for _, id := range rest {
		waitFor(t, 30*time.Second, "pipelined message done", func() bool { return row(t, s, id).status == "done" })
		if a := row(t, s, id).attempts; a != 0 {
			t.Errorf("message %d behind the garbage has attempts %d, want 0", id, a)
		}
	}
	d.waitLog("worker broke the protocol; killing it", time.Second)
	d.stop()
}

// TestFailureWriteOddReasonsAndStates: the failure write takes whatever a worker answers and
// whatever a stage keeps in its state. A worker's reason is bytes, and PostgreSQL takes only
// UTF-8 without NUL into text and jsonb: a reason in Latin-1, one with a NUL, and one that the
// 2,000-byte cut split inside a character are stored with U+FFFD for what is not UTF-8 (the
// cut before the character). A stage's state may be an array, a string or JSON null, where
// jsonb_set cannot set dispatch_error: the failure is recorded and the state left as it was.
// All of them fail in one batch beside a plain failure and a success, and the dispatcher goes
// on: messages enqueued at another stage afterwards are done. Before, PostgreSQL refused the
// whole failure write, for every message in it and at every retry; the loop writes failures
// before it claims, so no stage claimed again and the whole pipeline stopped.
func TestFailureWriteOddReasonsAndStates(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	long := strings.Repeat("a", 1980) + "€€€" // "stage a: status 1: " is 19 bytes: byte 2,000 is inside the first €
	cases := []struct{ reply, state, want string }{
		{"1 caf\xe9", `{}`, `{"dispatch_error": "stage a: status 1: caf\ufffd"}`},
		{"1 a\x00b", `{"k": 1}`, `{"k": 1, "dispatch_error": "stage a: status 1: a\ufffdb"}`},
		{"1 " + long, `{}`, `{"dispatch_error": "stage a: status 1: ` + strings.Repeat("a", 1980) + `…"}`},
		{"1 \xff\xfe", `{}`, `{"dispatch_error": "stage a: status 1: \ufffd"}`},
		{"1 plain", `{}`, `{"dispatch_error": "stage a: status 1: plain"}`},
		{"1 in an array", `[1, "two"]`, `[1, "two"]`},
		{"1 in a string", `"s"`, `"s"`},
		{"1 in null", `null`, `null`},
	}
	var values []string
	for _, c := range cases {
		values = append(values, fmt.Sprintf(`('a', '{"reply_hex": "%x"}', '%s')`, c.reply, c.state))
	}
	s.exec(t, `INSERT INTO workqueue (stage, payload, state) VALUES `+strings.Join(values, ", ")+`, ('a', '{}', '{}')`)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 16\nRETRY_DELAY = 60")+
		stageConf(t, "b", "", "PARALLELISM = 1"), "raw")
	waitFor(t, 30*time.Second, "every failure recorded and the success done", func() bool {
		return countStatus(t, s, "paused") == len(cases) && countStatus(t, s, "done") == 1
	})
	s.exec(t, `INSERT INTO workqueue (stage, payload) SELECT 'b', '{}' FROM generate_series(1, 3)`)
	waitFor(t, 30*time.Second, "the messages enqueued afterwards at stage b done", func() bool {
		return countStatus(t, s, "done") == 4
	})
	for _, c := range cases {
		var ok bool
		var state string
		var attempts int
		if err := s.DB.QueryRow(`SELECT state = $2::jsonb, state::text, attempts FROM workqueue WHERE payload->>'reply_hex' = $1`,
			fmt.Sprintf("%x", c.reply), c.want).Scan(&ok, &state, &attempts); err != nil {
			t.Fatalf("read the failure of %.40q: %v", c.reply, err)
		}
		if !ok || attempts != 1 {
			t.Errorf("reply %.40q: state %.80s (attempts %d), want %.80s (attempts 1)", c.reply, state, attempts, c.want)
		}
	}
	d.waitLog("failure recorded without its reason in the row: its state is not a JSON object", time.Second)
	d.stop()
}

// TestFailureWriteRefusedAlone: an application's trigger on workqueue refuses the failure
// write of one row (its reason says "poison"). That failure waits, tried again every second,
// while the others of its batch are recorded and every stage goes on claiming; once the
// trigger is gone, it is recorded, charged once. Before, the batch was refused at every
// retry, and since the loop writes failures before it claims, no stage claimed again.
func TestFailureWriteRefusedAlone(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	s.exec(t, `CREATE FUNCTION app_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
	    BEGIN
	        IF NEW.state->>'dispatch_error' LIKE '%poison%' THEN
	            RAISE EXCEPTION 'the application refuses message %', NEW.workqueue_id;
	        END IF;
	        RETURN NEW;
	    END $$`)
	s.exec(t, `CREATE TRIGGER app_refuse BEFORE UPDATE ON workqueue FOR EACH ROW
	    WHEN (NEW.status IN ('paused', 'failed')) EXECUTE FUNCTION app_refuse()`)
	poison := insertOne(t, s, "a", fmt.Sprintf(`{"reply_hex": "%x"}`, "1 poison"))
	plain := insertOne(t, s, "a", fmt.Sprintf(`{"reply_hex": "%x"}`, "1 plain"))
	insertOne(t, s, "a", `{}`)
	addr := freePort(t)
	d := startDaemon(t, baseConf(s, "METRICS_LISTEN = "+addr)+stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 8\nRETRY_DELAY = 60")+
		stageConf(t, "b", "", "PARALLELISM = 1"), "raw")
	waitFor(t, 30*time.Second, "the plain failure recorded and the success done", func() bool {
		return row(t, s, plain).status == "paused" && countStatus(t, s, "done") == 1
	})
	s.exec(t, `INSERT INTO workqueue (stage, payload) SELECT 'b', '{}' FROM generate_series(1, 3)`)
	waitFor(t, 30*time.Second, "the messages enqueued afterwards at stage b done", func() bool {
		return countStatus(t, s, "done") == 4
	})
	d.waitLog("the database refused this message's failure write alone", 10*time.Second)
	if r := row(t, s, poison); r.status != "running" || r.attempts != 0 {
		t.Errorf("the refused failure's row: %+v, want still running, not charged", r)
	}
	// Counted apart from the writes another transaction holds: what to do is not the same.
	waitFor(t, 5*time.Second, "pepsi_refused_writes 1 on /metrics", func() bool {
		v, ok := metric(t, addr, "pepsi_refused_writes")
		return ok && v == 1
	})
	if v, ok := metric(t, addr, "pepsi_held_writes"); !ok || v != 0 {
		t.Errorf("pepsi_held_writes = %v (%v) while no row is held, want 0", v, ok)
	}
	if page := consoleOverview(t, addr); !strings.Contains(page, "<b>1</b> failure or reset write (their messages stay running)") ||
		strings.Contains(page, `id="held"`) {
		t.Errorf("the console's overview does not show the refused write apart from held ones:\n%s", page)
	}
	s.exec(t, `DROP TRIGGER app_refuse ON workqueue`)
	waitFor(t, 10*time.Second, "the refused failure recorded once the trigger is gone", func() bool {
		return row(t, s, poison).status == "paused"
	})
	waitShownGone(t, addr, "pepsi_refused_writes", "refused")
	if r := row(t, s, poison); r.attempts != 1 || r.reason != "stage a: status 1: poison" {
		t.Errorf("the refused failure, recorded: %+v, want attempts 1 and its reason", r)
	}
	if n := strings.Count(d.log.String(), "the database refused this message's failure write alone"); n != 1 {
		t.Errorf("the refusal was logged %d times, want once", n)
	}
	d.stop()
}

// appRefuses gives the test schema an application whose trigger refuses an update of
// workqueue's status when its WHEN clause (when) holds, and counts its refusals in a sequence
// (nextval outlives the refused statement). It returns the count and the trigger's drop.
func appRefuses(t *testing.T, s *testSchema, column, when string) (refusals func() int, drop func()) {
	t.Helper()
	s.exec(t, `CREATE SEQUENCE app_refusals`)
	s.exec(t, `CREATE FUNCTION app_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
	    BEGIN
	        PERFORM nextval('app_refusals');
	        RAISE EXCEPTION 'the application refuses to update message %', NEW.workqueue_id;
	    END $$`)
	s.exec(t, `CREATE TRIGGER app_refuse BEFORE UPDATE OF `+column+` ON workqueue FOR EACH ROW
	    WHEN (`+when+`) EXECUTE FUNCTION app_refuse()`)
	refusals = func() int {
		return s.count(t, `SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM app_refusals`)
	}
	return refusals, func() { s.exec(t, `DROP TRIGGER app_refuse ON workqueue`) }
}

// TestAbortLeftoversRefusedAlone: a run that ends on a fatal error (here a reloaded graph that
// does not validate) kills its workers and writes what it has left in one go: a failure whose
// write the database refused in the loop (kept, tried every second) and the resets of every
// message the killed workers had. An application's trigger refuses every write of the two
// "poison" rows. The other two messages go back to pending, uncharged, and the two refused
// rows stay running for the next start, said in one line; once the trigger is gone, that start
// puts them back to pending and its own stop leaves nothing running. Before, the failures'
// statement refused whole ended the leftovers' writes: every reset was left running too, for
// the next start to find.
func TestAbortLeftoversRefusedAlone(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	_, drop := appRefuses(t, s, "status", `OLD.status = 'running' AND OLD.payload ? 'poison'`)
	conf := strings.Replace(baseConf(s, ""), "SHUTDOWN_GRACE = 5", "SHUTDOWN_GRACE = 1", 1) +
		stageConf(t, "a", "", "PARALLELISM = 4\nQUEUE_LIMIT = 1\nRETRY_DELAY = 60")
	d := startDaemon(t, conf, "pipeline")
	warmUp(t, s, "a")
	failing := insertOne(t, s, "a", `{"fail_at": "a", "poison": true}`)
	d.waitLog("the database refused this message's failure write alone", 30*time.Second)
	hung := []int64{insertOne(t, s, "a", `{"hang_at": "a"}`), insertOne(t, s, "a", `{"hang_at": "a"}`)}
	poisonHung := insertOne(t, s, "a", `{"hang_at": "a", "poison": true}`)
	waitFor(t, 30*time.Second, "the failing message and three hung ones running", func() bool {
		return countStatus(t, s, "running") == 4
	})

	// A graph that does not validate, from the file (the config table's check refuses one).
	if err := os.WriteFile(d.conf, []byte(strings.Replace(conf, "NEXT = \n", "NEXT = nowhere\n", 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	d.cmd.Process.Signal(syscall.SIGHUP)
	if st := d.wait(30 * time.Second); st != 1 {
		t.Fatalf("exit %d after a reload that does not validate, want 1", st)
	}
	for _, id := range hung {
		if r := row(t, s, id); r.status != "pending" || r.attempts != 0 {
			t.Errorf("hung message %d after the abort: %+v, want back to pending, uncharged", id, r)
		}
	}
	for _, id := range []int64{failing, poisonHung} {
		if r := row(t, s, id); r.status != "running" {
			t.Errorf("refused message %d after the abort: %+v, want still running", id, r)
		}
	}
	const said = "the database refused these rows' writes at shutdown by themselves"
	if n := strings.Count(d.log.String(), said); n != 1 {
		t.Errorf("the refused leftovers were said %d times, want once:\n%s", n, d.log.String())
	} else if !strings.Contains(d.log.String(), "rows=2") {
		t.Errorf("the line does not count the 2 refused rows:\n%s", d.log.String())
	}

	drop()
	s.exec(t, `DELETE FROM config`)
	d2 := startDaemon(t, conf, "pipeline")
	d2.waitLog("orphans_reset=2", 30*time.Second)
	waitFor(t, 30*time.Second, "the three hung messages running again", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'running' AND payload ? 'hang_at'`) == 3
	})
	d2.stop()
	if n := countStatus(t, s, "running"); n != 0 {
		t.Errorf("%d rows running after the second stop, want none", n)
	}
}

// refuseResets: an application that refuses to put a running message back to pending when
// its payload says "poison".
func refuseResets(t *testing.T, s *testSchema) (refusals func() int, drop func()) {
	return appRefuses(t, s, "status", `OLD.status = 'running' AND NEW.status = 'pending' AND OLD.payload ? 'poison'`)
}

// TestResetRefusedAlone: an application's trigger refuses to put one message back to pending
// (its payload says "poison"), where the dispatcher resets rows: at the start (a running row
// of an earlier run), in its loop (a message queued behind one that crashed its worker), and
// in the reconcile after a lost lock connection (a running row nobody holds). The other rows
// go back to pending and run, and every stage goes on claiming, while the refused reset waits,
// its row running, tried again every second and logged once; once the trigger is gone it is
// reset and runs, once. Before, the reset of all of them was refused at every retry: the start
// failed (and so did the next), the loop and the reconcile stopped every claim.
func TestResetRefusedAlone(t *testing.T) {
	const said = "the database refused this message's reset to pending alone"
	conf := func(s *testSchema) string {
		return baseConf(s, "") + stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 4\nMAX_ATTEMPTS = 1") +
			stageConf(t, "b", "", "PARALLELISM = 1")
	}
	// goesOn: n messages enqueued at b are done (done rows then want), the poison row stays
	// running through three refusals, said once; then the trigger goes and it runs, once.
	goesOn := func(t *testing.T, s *testSchema, d *daemon, poison int64, want int, refusals func() int, drop func()) {
		t.Helper()
		enqueue(t, s, "b", 3, `{}`)
		waitFor(t, 30*time.Second, "the other messages done, those enqueued at b included", func() bool {
			return countStatus(t, s, "done") == want
		})
		waitFor(t, 10*time.Second, "the poison row's reset refused three times", func() bool { return refusals() >= 3 })
		if r := row(t, s, poison); r.status != "running" {
			t.Errorf("the poison row is %s while its reset is refused, want running", r.status)
		}
		heldRowRunsOnce(t, s, poison, drop, want+1)
		if r := row(t, s, poison); r.attempts != 0 {
			t.Errorf("the poison row was charged %d attempts for resets, want 0", r.attempts)
		}
		if n := strings.Count(d.log.String(), said); n != 1 {
			t.Errorf("the refusal was logged %d times, want once:\n%s", n, d.log.String())
		}
		d.stop()
	}

	t.Run("start", func(t *testing.T) {
		s := newTestSchema(t)
		s.exec(t, runsDDL)
		refusals, drop := refuseResets(t, s)
		s.exec(t, `INSERT INTO workqueue (stage, payload, status, claim) VALUES ('a', '{}', 'running', 424241)`)
		poison := int64(s.count(t, `INSERT INTO workqueue (stage, payload, status, claim)
		    VALUES ('a', '{"poison": true}', 'running', 424242) RETURNING workqueue_id`))
		d := startDaemon(t, conf(s), "pipeline")
		d.waitLog("dispatching", dbStatementBudget)
		goesOn(t, s, d, poison, 4, refusals, drop)
	})

	t.Run("loop", func(t *testing.T) {
		s := newTestSchema(t)
		s.exec(t, runsDDL)
		refusals, drop := refuseResets(t, s)
		d := startDaemon(t, conf(s), "pipeline")
		warmUp(t, s, "a")
		// Enqueued together, they reach a's one worker in one write: the crasher at the head,
		// the others never run, to be reset.
		s.exec(t, `INSERT INTO workqueue (stage, payload) VALUES ('a', '{"crash_at": "a"}'), ('a', '{"poison": true}'), ('a', '{}'), ('a', '{}')`)
		poison := int64(s.count(t, `SELECT max(workqueue_id) - 2 FROM workqueue`))
		goesOn(t, s, d, poison, 6, refusals, drop)
		if n := countStatus(t, s, "failed"); n != 1 {
			t.Errorf("%d failed rows, want the crasher's", n)
		}
	})

	t.Run("reconcile", func(t *testing.T) {
		s := newTestSchema(t)
		s.exec(t, runsDDL)
		refusals, drop := refuseResets(t, s)
		d := startDaemon(t, conf(s), "pipeline")
		d.waitLog("dispatching", 30*time.Second)
		s.exec(t, `INSERT INTO workqueue (stage, payload, status, claim) VALUES ('a', '{}', 'running', 424241)`)
		poison := int64(s.count(t, `INSERT INTO workqueue (stage, payload, status, claim)
		    VALUES ('a', '{"poison": true}', 'running', 424242) RETURNING workqueue_id`))
		terminateLockSession(t, s)
		d.waitLog("single-instance lock taken again", 30*time.Second)
		goesOn(t, s, d, poison, 4, refusals, drop)
	})
}

// TestClaimRefusedStageAlone: an application's trigger refuses to set one message of stage a
// running (its payload says "poison"). Stage a waits, its claim tried again every second and
// the refusal said once, while stage b's messages are claimed and done; once the trigger is
// gone, stage a's messages run, the poison one once. Before, the claim of all stages was
// refused in one statement at every retry, and no stage claimed again.
func TestClaimRefusedStageAlone(t *testing.T) {
	const said = "the database refused this stage's claim alone"
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	refusals, drop := appRefuses(t, s, "status", `NEW.status = 'running' AND OLD.payload ? 'poison'`)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 4")+
		stageConf(t, "b", "", "PARALLELISM = 1"), "pipeline")
	d.waitLog("dispatching", 30*time.Second)
	poison := insertOne(t, s, "a", `{"poison": true}`)
	enqueue(t, s, "a", 3, `{}`)
	enqueue(t, s, "b", 5, `{}`)
	waitFor(t, 30*time.Second, "stage b's 5 messages done", func() bool { return countStatus(t, s, "done") == 5 })
	waitFor(t, 10*time.Second, "stage a's claim refused three times", func() bool { return refusals() >= 3 })
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE stage = 'a' AND status = 'pending'`); n != 4 {
		t.Errorf("%d of stage a's 4 messages pending while its claim is refused, want 4", n)
	}
	heldRowRunsOnce(t, s, poison, drop, 9)
	d.waitLog("the database takes this stage's claims again", 5*time.Second)
	if n := strings.Count(d.log.String(), said); n != 1 {
		t.Errorf("the refusal was logged %d times, want once:\n%s", n, d.log.String())
	}
	d.stop()
}

// TestFlipRefusedAlone: an application's trigger refuses to put one paused message back to
// pending when its retry is due (its payload says "poison"). The other due message is
// returned and done, and every stage goes on claiming, while the refused one stays paused,
// tried again every second and said once; once the trigger is gone it runs, once. Before,
// the flip of all due rows was refused at every retry, and since the loop flips before it
// claims, no stage claimed again.
func TestFlipRefusedAlone(t *testing.T) {
	const said = "the database refused this paused message's return to pending alone"
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	refusals, drop := appRefuses(t, s, "status", `OLD.status = 'paused' AND NEW.status = 'pending' AND OLD.payload ? 'poison'`)
	poison := int64(s.count(t, `INSERT INTO workqueue (stage, payload, status, retry_at, attempts)
	    VALUES ('a', '{"poison": true}', 'paused', now() - interval '1 second', 1) RETURNING workqueue_id`))
	s.exec(t, `INSERT INTO workqueue (stage, payload, status, retry_at, attempts)
	    VALUES ('a', '{}', 'paused', now() - interval '1 second', 1)`)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 1")+stageConf(t, "b", "", "PARALLELISM = 1"), "pipeline")
	d.waitLog("dispatching", 30*time.Second)
	enqueue(t, s, "b", 3, `{}`)
	waitFor(t, 30*time.Second, "the other due message and the 3 at stage b done", func() bool {
		return countStatus(t, s, "done") == 4
	})
	waitFor(t, 10*time.Second, "the poison row's flip refused three times", func() bool { return refusals() >= 3 })
	if r := row(t, s, poison); r.status != "paused" {
		t.Errorf("the poison row is %s while its flip is refused, want paused", r.status)
	}
	heldRowRunsOnce(t, s, poison, drop, 5)
	if n := strings.Count(d.log.String(), said); n != 1 {
		t.Errorf("the refusal was logged %d times, want once:\n%s", n, d.log.String())
	}
	d.stop()
}

// TestUnparkRefused: rows parked behind a KEY_LIMIT that the configuration no longer has are
// put back to pending by the claim's unpark first; an application's trigger refuses that for
// one of them (its payload says "poison"). The parked rows wait, tried again every second and
// said once, while stage b's messages are claimed and done; once the trigger is gone the
// parked rows run, once each. Before, the refused unpark returned from the claim at every
// retry, and no stage claimed again.
func TestUnparkRefused(t *testing.T) {
	const said = "the database refused to put parked rows back to pending"
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	refusals, drop := appRefuses(t, s, "key_parked", `OLD.key_parked AND NOT NEW.key_parked AND OLD.payload ? 'poison'`)
	s.exec(t, `INSERT INTO workqueue (stage, payload, concurrency_key, key_parked)
	    VALUES ('a', '{"poison": true}', 'k', true), ('a', '{}', 'k', true), ('a', '{}', 'k', true)`)
	poison := int64(s.count(t, `SELECT min(workqueue_id) FROM workqueue`))
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 1")+stageConf(t, "b", "", "PARALLELISM = 1"), "pipeline")
	d.waitLog("dispatching", 30*time.Second)
	enqueue(t, s, "b", 3, `{}`)
	waitFor(t, 30*time.Second, "the 3 messages at stage b done", func() bool { return countStatus(t, s, "done") == 3 })
	waitFor(t, 10*time.Second, "the unpark refused three times", func() bool { return refusals() >= 3 })
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE stage = 'a' AND status = 'pending' AND key_parked`); n != 3 {
		t.Errorf("%d of stage a's 3 parked rows still parked while the unpark is refused, want 3", n)
	}
	heldRowRunsOnce(t, s, poison, drop, 6)
	d.waitLog("the database takes the unpark of parked rows again", 5*time.Second)
	if n := strings.Count(d.log.String(), said); n != 1 {
		t.Errorf("the refusal was logged %d times, want once:\n%s", n, d.log.String())
	}
	d.stop()
}

func TestCrashFailsHeadRequeuesRest(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 4\nRETRY_DELAY = 60"), "pipeline")
	warmUp(t, s, "a")
	// Enqueued together, they reach the one worker in one write: the crasher at the head.
	s.exec(t, `INSERT INTO workqueue (stage, payload) VALUES ('a', '{"crash_at": "a"}'), ('a', '{}'), ('a', '{}'), ('a', '{}')`)
	crasher := int64(s.count(t, `SELECT max(workqueue_id) - 3 FROM workqueue`))
	waitFor(t, 30*time.Second, "crash recorded", func() bool { return row(t, s, crasher).status == "paused" })
	if r := row(t, s, crasher); r.attempts != 1 || !strings.Contains(r.reason, "worker exited with status 3") {
		t.Errorf("crashed head: %+v", r)
	}
	waitFor(t, 30*time.Second, "the others done", func() bool { return countStatus(t, s, "done") == 4 })
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'done' AND attempts <> 0`); n != 0 {
		t.Errorf("%d requeued messages were charged an attempt", n)
	}
	if bad := s.count(t, `SELECT count(*) FROM (SELECT id FROM runs GROUP BY id, stage HAVING count(*) > 1) x`); bad != 0 {
		t.Errorf("%d messages ran twice", bad)
	}
	d.stop()
	if s.count(t, `SELECT crashed FROM stage_stats WHERE stage = 'a'`) != 1 {
		t.Error("stage_stats.crashed: want 1")
	}
}

// TestCrashAfterCommit: a stage commits its advance, then dies before its status line. The
// row has moved on (and may already be claimed again for the next stage): the dispatcher's
// failure write must not touch it.
func TestCrashAfterCommit(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	conf := baseConf(s, "") + stageConf(t, "a", "b", "PARALLELISM = 1\nQUEUE_LIMIT = 1") + stageConf(t, "b", "", "PARALLELISM = 1")
	d := startDaemon(t, conf, "raw")
	warmUp(t, s, "a")
	id := insertOne(t, s, "a", `{"commit_then_crash": true}`)
	waitFor(t, 30*time.Second, "message done at b", func() bool { r := row(t, s, id); return r.status == "done" && r.stage == "b" })
	d.waitLog("worker crashed", 10*time.Second)
	if r := row(t, s, id); r.attempts != 0 || r.reason != "" {
		t.Errorf("the stage's committed advance was overwritten: %+v", r)
	}
	if n := s.count(t, `SELECT count(*) FROM runs WHERE id = $1`, id); n != 2 {
		t.Errorf("message ran %d times, want once per stage (2)", n)
	}
	d.stop()
}

// TestTimeoutKillsProcessGroup: a head unanswered for MAX_RUNTIME is a timeout; the worker's
// whole process group dies, the rest of its queue goes back to pending. The raw worker reads
// its three ids at once (a buffered reader), so the first timeout charges nobody and the
// hung message runs again alone, where its timeout is charged (suspects.go): two kills, one
// attempt.
func TestTimeoutKillsProcessGroup(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	conf := strings.Replace(baseConf(s, ""), "[pepsi-dispatch]", "[pepsi-dispatch]\nMAX_RUNTIME = 1", 1)
	d := startDaemon(t, conf+stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 3\nRETRY_DELAY = 60"), "raw")
	warmUp(t, s, "a")
	s.exec(t, `INSERT INTO workqueue (stage, payload) VALUES ('a', '{"spawn_and_hang": true}'), ('a', '{}'), ('a', '{}')`)
	hung := int64(s.count(t, `SELECT max(workqueue_id) - 2 FROM workqueue`))
	waitFor(t, 30*time.Second, "timeout recorded", func() bool { return row(t, s, hung).status == "paused" })
	if r := row(t, s, hung); r.attempts != 1 || !strings.Contains(r.reason, "timeout after 1s") {
		t.Errorf("hung head: %+v", r)
	}
	children := 0
	for _, child := range ids(t, s, `SELECT pid FROM runs WHERE stage = 'child'`) {
		children++
		waitFor(t, 10*time.Second, "the worker's child to die with it", func() bool { return syscall.Kill(int(child), 0) != nil })
	}
	if children != 2 {
		t.Errorf("the hung message ran %d times, want twice: in its batch, then alone", children)
	}
	waitFor(t, 30*time.Second, "the others done", func() bool { return countStatus(t, s, "done") == 3 })
	d.stop()
	if n := s.count(t, `SELECT timeouts FROM stage_stats WHERE stage = 'a'`); n != 2 {
		t.Errorf("stage_stats.timeouts: %d, want 2 (in its batch, then alone)", n)
	}
}

// TestMissingProgramHeldThenFixed: a PROGRAM that does not exist holds the stage (rows stay
// pending, never failed) until the config table points it at a working program.
func TestMissingProgramHeldThenFixed(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	conf := baseConf(s, "") + "[stage-a]\nPROGRAM = /nonexistent/stage-program\n"
	d := startDaemon(t, conf, "pipeline")
	enqueue(t, s, "a", 5, `{}`)
	d.waitLog("cannot start the stage's program; stage held", 30*time.Second)
	d.waitLog("hold=2s", 30*time.Second) // the cool-down doubles instead of spinning
	// While held, rows go back and forth between pending and a claim that finds no worker,
	// but are never charged an attempt, paused or failed.
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE status IN ('pending', 'running') AND attempts = 0 AND state = '{}'`); n != 5 {
		t.Fatalf("%d of 5 rows untouched while the stage is held", n)
	}
	s.exec(t, `INSERT INTO config (section, key, value) VALUES ('stage-a', 'PROGRAM', $1)`, testWorkerBin(t))
	waitFor(t, 30*time.Second, "all done after the fix", func() bool { return countStatus(t, s, "done") == 5 })
	d.waitLog("stage graph reloaded", time.Second)
	d.stop()
}

// TestProgramStartExplained: a PROGRAM that exists but does not start gets the reason the
// kernel leaves out. execve says "no such file or directory" for a script whose #! line names
// a missing interpreter, which a line saved with Windows line ends does ("/bin/sh\r"): an
// operator looking at the file could not tell what was missing. A script without a #! line is
// "exec format error". The stage is held as for any program that does not start.
func TestProgramStartExplained(t *testing.T) {
	s := newTestSchema(t)
	dir := testDir(t)
	conf := baseConf(s, "")
	for name, text := range map[string]string{
		"crlf":    "#!/bin/sh\r\nexit 0\r\n",
		"nobang":  "exit 0\n",
		"missing": "#!/nonexistent/interpreter -u\nexit 0\n",
	} {
		script := writeFile(t, dir, name+".sh", text)
		if err := os.Chmod(script, 0o755); err != nil {
			t.Fatal(err)
		}
		conf += fmt.Sprintf("[stage-%s]\nPROGRAM = %s\nPARALLELISM = 1\n", name, script)
	}
	d := startDaemon(t, conf, "none")
	for _, name := range []string{"crlf", "nobang", "missing"} {
		insertOne(t, s, name, `{}`)
	}
	d.waitLog("its #! line ends in a carriage return", 30*time.Second)
	d.waitLog("exec format error: a script needs a #! line", 30*time.Second)
	d.waitLog(`the interpreter its #! line names, \"/nonexistent/interpreter\", does not`, 30*time.Second)
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE status IN ('pending', 'running') AND attempts = 0`); n != 3 {
		t.Errorf("%d of 3 messages pending and uncharged while their stages are held", n)
	}
	d.stop()
}

// runPipelineUnderFault pushes n messages through three stages while fault runs, then checks
// that every message is done and each (message, stage) ran exactly once.
func checkExactlyOnce(t *testing.T, s *testSchema, n int) {
	t.Helper()
	if bad := s.count(t, `SELECT count(*) FROM (SELECT id, stage FROM runs GROUP BY 1, 2 HAVING count(*) <> 1) x`); bad != 0 {
		t.Errorf("%d (message, stage) pairs ran other than once", bad)
	}
	if runs := s.count(t, `SELECT count(*) FROM runs`); runs != 3*n {
		t.Errorf("%d runs, want %d", runs, 3*n)
	}
	if left := s.count(t, `SELECT count(*) FROM workqueue WHERE status <> 'done'`); left != 0 {
		t.Errorf("%d messages not done", left)
	}
}

func threeStages(t *testing.T, s *testSchema) string {
	return baseConf(s, "") +
		stageConf(t, "a", "b", "PARALLELISM = 2\nQUEUE_LIMIT = 8\nRETRY_DELAY = 0.1") +
		stageConf(t, "b", "c", "PARALLELISM = 2\nQUEUE_LIMIT = 8\nRETRY_DELAY = 0.1") +
		stageConf(t, "c", "", "PARALLELISM = 2\nQUEUE_LIMIT = 8\nRETRY_DELAY = 0.1")
}

// workerPids lists the pids of the daemon's worker processes (its children).
func workerPids(t testing.TB, d *daemon) []int {
	t.Helper()
	out, _ := exec.Command("pgrep", "-P", strconv.Itoa(d.cmd.Process.Pid)).Output()
	var pids []int
	for _, f := range strings.Fields(string(out)) {
		if p, err := strconv.Atoi(f); err == nil {
			pids = append(pids, p)
		}
	}
	return pids
}

func TestSigkillDispatcherThenRestart(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	const n = 1500
	conf := threeStages(t, s)
	d := startDaemon(t, conf, "pipeline")
	enqueue(t, s, "a", n, `{"sleep_ms": 1}`)
	waitFor(t, 60*time.Second, "some progress", func() bool { return countStatus(t, s, "done") > n/5 })
	pids := workerPids(t, d)
	if len(pids) == 0 {
		t.Fatal("no worker processes seen")
	}
	d.cmd.Process.Signal(syscall.SIGKILL)
	d.wait(10 * time.Second)
	// Workers must not outlive their dispatcher: the kernel kills them (parent-death signal).
	waitFor(t, 10*time.Second, "orphaned workers to die", func() bool {
		for _, p := range pids {
			if syscall.Kill(p, 0) == nil {
				return false
			}
		}
		return true
	})
	running := countStatus(t, s, "running")
	d2 := startDaemon(t, conf, "pipeline")
	d2.waitLog(fmt.Sprintf("orphans_reset=%d", running), 30*time.Second)
	waitFor(t, 120*time.Second, "all done after restart", func() bool { return countStatus(t, s, "done") == n })
	checkExactlyOnce(t, s, n)
	d2.stop()
}

func TestSigtermMidRun(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	const n = 1000
	conf := threeStages(t, s)
	d := startDaemon(t, conf, "pipeline")
	enqueue(t, s, "a", n, `{"sleep_ms": 2}`)
	waitFor(t, 60*time.Second, "some progress", func() bool { return countStatus(t, s, "done") > n/10 })
	d.stop() // exit status 0 is checked by stop
	if r := countStatus(t, s, "running"); r != 0 {
		t.Fatalf("%d rows left running after a clean shutdown", r)
	}
	d.waitLog("shutdown complete", time.Second)
	d2 := startDaemon(t, conf, "pipeline")
	d2.waitLog("orphans_reset=0", 30*time.Second)
	waitFor(t, 120*time.Second, "all done after restart", func() bool { return countStatus(t, s, "done") == n })
	checkExactlyOnce(t, s, n)
	d2.stop()
}

// TestSecondSignalHurries: a second SIGTERM kills workers at once; their rows go back.
func TestSecondSignalHurries(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	conf := strings.Replace(baseConf(s, ""), "SHUTDOWN_GRACE = 5", "SHUTDOWN_GRACE = 60", 1)
	d := startDaemon(t, conf+stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 2"), "pipeline")
	warmUp(t, s, "a")
	insertOne(t, s, "a", `{"sleep_ms": 100000}`)
	waitFor(t, 30*time.Second, "slow message running", func() bool { return countStatus(t, s, "running") == 1 })
	d.cmd.Process.Signal(syscall.SIGTERM)
	d.waitLog("shutting down", 10*time.Second)
	d.cmd.Process.Signal(syscall.SIGTERM)
	if st := d.wait(20 * time.Second); st != 0 {
		t.Fatalf("exit %d after two signals, want 0", st)
	}
	if r := countStatus(t, s, "running"); r != 0 {
		t.Errorf("%d rows left running", r)
	}
	if p := s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'pending' AND attempts = 0`); p != 1 {
		t.Errorf("the interrupted message is not back to pending untouched")
	}
}

func TestPostgresRestartUnderLoad(t *testing.T) {
	if testPG.Dir() == "" {
		baseDSN(t)
	}
	if testPG.Dir() == "" {
		t.Skip("PEPSI_TEST_DSN names an external server; this test restarts the private one")
	}
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	const n = 1500
	conf := threeStages(t, s)
	d := startDaemon(t, conf, "pipeline")
	enqueue(t, s, "a", n, `{"sleep_ms": 1}`)
	waitFor(t, 60*time.Second, "some progress", func() bool { return countStatus(t, s, "done") > n/5 })
	out, err := exec.Command("scripts/pg-private", "restart", testPG.Dir()).CombinedOutput()
	if err != nil {
		t.Fatalf("restart PostgreSQL: %v\n%s", err, out)
	}
	waitFor(t, 120*time.Second, "all done after the PostgreSQL restart", func() bool {
		var done int
		// The harness's own connections died with the server: retry through them.
		if err := s.DB.QueryRow(`SELECT count(*) FROM workqueue WHERE status = 'done'`).Scan(&done); err != nil {
			return false
		}
		return done == n
	})
	d.waitLog("single-instance lock taken again", time.Second)
	if bad := s.count(t, `SELECT count(*) FROM (SELECT id, stage FROM runs GROUP BY 1, 2 HAVING count(*) <> 1) x`); bad != 0 {
		t.Errorf("%d (message, stage) pairs ran other than once", bad)
	}
	d.stop()
}

// TestTerminateEachConnection: pg_terminate_backend on each of the dispatcher's sessions
// (the lock connection, the LISTEN connection, the pool) while messages flow.
func TestTerminateEachConnection(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	const n = 1200
	conf := strings.Replace(threeStages(t, s), "STATS_INTERVAL = 60", "STATS_INTERVAL = 0.2", 1)
	d := startDaemon(t, conf, "pipeline")
	enqueue(t, s, "a", n/3, `{"sleep_ms": 1}`)
	waitFor(t, 60*time.Second, "some progress", func() bool { return countStatus(t, s, "done") > 0 })
	kill := func(what, cond string) int {
		var killed int
		s.DB.QueryRow(`SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE application_name LIKE 'pepsi-dispatch %' AND ` + cond).Scan(&killed)
		t.Logf("terminated %d %s sessions", killed, what)
		return killed
	}
	if kill("LISTEN", `query LIKE 'LISTEN%'`) == 0 {
		t.Error("no LISTEN session found")
	}
	enqueue(t, s, "a", n/3, `{"sleep_ms": 1}`) // needs the notification (or the reconnect's claim)
	if kill("lock", `pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory')`) != 1 {
		t.Error("lock session not found")
	}
	enqueue(t, s, "a", n/3, `{"sleep_ms": 1}`)
	// The relock may have taken the pool's idle connection; the next statistics flush opens one.
	pool := `query NOT LIKE 'LISTEN%' AND pid NOT IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory')`
	waitFor(t, 10*time.Second, "a pool session", func() bool {
		return s.count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'pepsi-dispatch %' AND `+pool) > 0
	})
	if kill("pool", pool) == 0 {
		t.Error("no pool session found")
	}
	waitFor(t, 120*time.Second, "all done", func() bool { return countStatus(t, s, "done") == n })
	d.waitLog("single-instance lock taken again", time.Second)
	checkExactlyOnce(t, s, n)
	d.stop()
}

// TestPoisonMessageDoesNotHoldForever: a message that kills every fresh worker before its
// first answer first looks like a program that cannot start (stage held, message untouched);
// the second death with the same head message fails it like a crash, so the stage moves on.
func TestPoisonMessageDoesNotHoldForever(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 1\nMAX_ATTEMPTS = 2\nRETRY_DELAY = 0.1"), "pipeline")
	poison := insertOne(t, s, "a", `{"crash_at": "a"}`)
	good := insertOne(t, s, "a", `{}`)
	waitFor(t, 60*time.Second, "poison message failed", func() bool { return row(t, s, poison).status == "failed" })
	if r := row(t, s, poison); r.attempts != 2 || !strings.Contains(r.reason, "worker exited with status 3") {
		t.Errorf("poison message: %+v", r)
	}
	waitFor(t, 30*time.Second, "the message behind it done", func() bool { return row(t, s, good).status == "done" })
	d.waitLog("failing it as a crash", time.Second)
	d.stop()
}

// TestWorkerConnectRefusedChargesNothing: a worker that the server will not give a session
// (here the role's CONNECTION LIMIT, which the dispatcher's own sessions fill; as much a server
// at max_connections, a changed password or a pg_hba.conf rule) never ran its head message, so
// its death is the stage's trouble, not the message's: the stage is held, and the head is not
// failed as the message that kills workers at start (TestPoisonMessageDoesNotHoldForever),
// however many workers die with it at their head. Once the server lets workers in, the message
// runs, no attempt charged.
func TestWorkerConnectRefusedChargesNothing(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	// Not a superuser, whom no CONNECTION LIMIT holds; a member of the schema's owner, so that
	// the dispatcher may apply the schema at its start.
	role := "pepsi_cl_" + s.Name
	s.exec(t, `CREATE ROLE `+role+` LOGIN NOSUPERUSER`)
	t.Cleanup(func() { s.DB.Exec(`DROP ROLE IF EXISTS ` + role) })
	var owner string
	if err := s.DB.QueryRow(`SELECT quote_ident(current_user)`).Scan(&owner); err != nil {
		t.Fatal(err)
	}
	s.exec(t, `GRANT `+owner+`, pg_read_all_settings, pg_signal_backend TO `+role)
	conf := confAs(baseConf(s, ""), s, role) +
		stageConf(t, "a", "", "PARALLELISM = 1\nMAX_ATTEMPTS = 2\nRETRY_DELAY = 0.2")
	d := startDaemon(t, conf, "pipeline")
	d.waitLog("msg=dispatching", 30*time.Second)
	// The dispatcher's sessions, and not one more: its workers start on demand, none yet.
	sessions := s.count(t, `SELECT count(*) FROM pg_stat_activity WHERE usename = $1`, role)
	s.exec(t, fmt.Sprintf(`ALTER ROLE %s CONNECTION LIMIT %d`, role, sessions))
	id := insertOne(t, s, "a", `{}`)
	// The SQLSTATE, which lib/pq writes after the server's words in whatever lc_messages.
	heldUncharged(t, d, s, id, "(53300)", "worker could not get a database session; stage held")
	s.exec(t, `ALTER ROLE `+role+` CONNECTION LIMIT -1`)
	waitFor(t, 90*time.Second, "message done once workers may connect", func() bool { return row(t, s, id).status == "done" })
	if r := row(t, s, id); r.attempts != 0 {
		t.Errorf("message done after %d attempts, want 0", r.attempts)
	}
	d.stop()
}

// heldUncharged waits until the daemon's log has a word of three dead workers' standard error
// (each died at its start with message id at its head: the rule for a message that kills
// workers at start failed a head that two in a row had), then checks that id was charged
// nothing and that the log said why the stage was held (line).
func heldUncharged(t *testing.T, d *daemon, s *testSchema, id int64, word, line string) {
	t.Helper()
	waitFor(t, 60*time.Second, "three workers dead at start", func() bool {
		return strings.Count(d.log.String(), word) >= 3
	})
	if r := row(t, s, id); r.attempts != 0 || r.status == "failed" || r.status == "paused" {
		t.Fatalf("message %d: status %s, %d attempts, reason %q: charged for workers that never ran it",
			id, r.status, r.attempts, r.reason)
	}
	d.waitLog(line, time.Second)
}

// brokenWorker is a stage program deployed broken: while the file TEST_STAGE_BROKEN names
// exists (not a PEPSI_ variable: the dispatcher sets its workers' own), it exits at its start
// before reading standard input, as a program that does not load does (a missing library, a
// handler that does not import); then it is pipelineWorker.
func brokenWorker() int {
	if _, err := os.Stat(os.Getenv("TEST_STAGE_BROKEN")); err == nil {
		fmt.Fprintln(os.Stderr, "cannot load the handler: broken deploy")
		return 1
	}
	return pipelineWorker()
}

func init() { testWorkers["broken"] = brokenWorker }

// TestBrokenProgramChargesNothing: a stage program that dies at its start before reading any
// id never ran its head message, so however many of its workers die with the same message at
// their head, the message is not failed as one that kills workers at start
// (TestPoisonMessageDoesNotHoldForever, whose workers read it): the stage is held, cool-down
// after cool-down, and once the program is mended the message runs, no attempt charged.
func TestBrokenProgramChargesNothing(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	broken := writeFile(t, testDir(t), "broken", "")
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 1\nMAX_ATTEMPTS = 2\nRETRY_DELAY = 0.2"),
		"broken", "TEST_STAGE_BROKEN="+broken)
	id := insertOne(t, s, "a", `{}`)
	heldUncharged(t, d, s, id, "broken deploy", "worker died before reading its messages; stage held")
	if err := os.Remove(broken); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 90*time.Second, "message done once the program is mended", func() bool { return row(t, s, id).status == "done" })
	if r := row(t, s, id); r.attempts != 0 {
		t.Errorf("message done after %d attempts, want 0", r.attempts)
	}
	d.stop()
}

// TestDSNSettingsWarned: a DSN key that is a session setting (statement_timeout=0) works for
// lib/pq, the daemon's and the Go SDK's driver, which sends it to the server, and is refused by
// libpq, which the Python SDK and psql use ("invalid connection option"): their stages were held
// forever on a DSN the daemon had accepted. The daemon says so at start, and runs; the same
// setting in options='-c …' (which the tests' schemas use for search_path) draws no warning.
func TestDSNSettingsWarned(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	conf := baseConf(s, "") + stageConf(t, "a", "", "PARALLELISM = 1")
	d := startDaemon(t, strings.Replace(conf, s.DSN, s.DSN+" statement_timeout=0 lock_timeout=0", 1), "pipeline")
	d.waitLog(`the DSN sets session settings as connection keys`, 30*time.Second)
	d.waitLog(`keys=lock_timeout,statement_timeout`, time.Second)
	id := insertOne(t, s, "a", `{}`)
	waitFor(t, 30*time.Second, "the message done", func() bool { return row(t, s, id).status == "done" })
	d.stop()

	d = startDaemon(t, conf, "pipeline")
	id = insertOne(t, s, "a", `{}`)
	waitFor(t, 30*time.Second, "the message done", func() bool { return row(t, s, id).status == "done" })
	d.stop()
	if strings.Contains(d.log.String(), "session settings") {
		t.Errorf("a DSN with options='-c search_path=…' was warned about:\n%s", d.log.String())
	}
}

// TestScriptRefusedChargesNothing: a stage program that reads its id before it connects, a
// shell script running psql here, tells the server's refusal only on its standard error (it
// read the id): that line spares its head as TestWorkerConnectRefusedChargesNothing's workers,
// which never read theirs, are spared. The refusal is a database that does not exist.
func TestScriptRefusedChargesNothing(t *testing.T) {
	psql, err := exec.LookPath("psql")
	if err != nil {
		t.Skip("psql is not on PATH")
	}
	s := newTestSchema(t)
	dir := testDir(t)
	script := writeFile(t, dir, "stage.sh", fmt.Sprintf("#!/bin/sh\nread id\nexec %s \"$PEPSI_DSN dbname=pepsi_no_such_database\" -c 'SELECT 1'\n", psql))
	if err := os.Chmod(script, 0o755); err != nil {
		t.Fatal(err)
	}
	conf := baseConf(s, "") + fmt.Sprintf("[stage-a]\nPROGRAM = %s\nPARALLELISM = 1\nMAX_ATTEMPTS = 2\nRETRY_DELAY = 0.2\n", script)
	d := startDaemon(t, conf, "none")
	id := insertOne(t, s, "a", `{}`)
	heldUncharged(t, d, s, id, `pepsi_no_such_database`, // psql's words follow the server's lc_messages
		"worker could not get a database session; stage held")
	d.stop()
}

// pipeHog opens pipes until Linux gives it small ones (fs.pipe-user-pages-soft: past 1,024
// pipes of 64 KiB, a user without CAP_SYS_RESOURCE gets 8 KiB ones), says the size it got on
// standard output ("small N", or "none" after 8,000 pipes), and keeps them open until its
// standard input ends. Run as the daemon's USER, it makes that user's further pipes small.
func pipeHog() int {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err == nil {
		lim.Cur = lim.Max
		syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim)
	}
	var keep []*os.File
	said := "none"
	for range 8000 {
		r, w, err := os.Pipe()
		if err != nil {
			said = "error " + err.Error()
			break
		}
		keep = append(keep, r, w)
		if n, err := pipeSize(w); err == nil && n < 64<<10 {
			said = fmt.Sprintf("small %d", n)
			break
		}
	}
	fmt.Println(said)
	io.Copy(io.Discard, os.Stdin)
	runtime.KeepAlive(keep)
	return 0
}

func init() { testWorkers["pipe-hog"] = pipeHog }

// TestSmallPipeNeverBlocks: the loop writes a worker's ids itself, so a write into a stdin
// pipe that cannot hold them would wait until the worker reads, which a worker running a long
// message does not do: meanwhile no other stage was claimed. Pipes are small (8 KiB) once the
// daemon's user has 1,024 open, which a helper running as that user makes so here; a worker
// that hangs on its first message is then sent 999 more ids of 17 digits (17 KB), and another
// stage's message must still be done. Each worker is given no more ids than its pipe holds.
func TestSmallPipeNeverBlocks(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root, to run a helper as the daemon's USER (nobody)")
	}
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	hog := exec.Command(testWorkerBin(t))
	hog.Env = append(os.Environ(), "PEPSI_TEST_WORKER=pipe-hog", "PEPSI_STAGE=hog")
	hog.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	hogIn, err := hog.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	hogOut, err := hog.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := hog.Start(); err != nil {
		t.Fatalf("start the pipe hog as nobody: %v", err)
	}
	t.Cleanup(func() { hogIn.Close(); hog.Wait() })
	said, err := bufio.NewReader(hogOut).ReadString('\n')
	if err != nil {
		t.Fatalf("read the pipe hog: %v", err)
	}
	if !strings.HasPrefix(said, "small ") {
		t.Skipf("this kernel gives nobody no small pipes (the hog says %q)", strings.TrimSpace(said))
	}
	conf := baseConf(s, "") + stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 1000") +
		stageConf(t, "b", "", "PARALLELISM = 1")
	d := startDaemon(t, conf, "pipeline")
	hung := insertOne(t, s, "a", `{"hang_at": "a"}`)
	waitFor(t, 30*time.Second, "the first message running", func() bool { return row(t, s, hung).status == "running" })
	s.exec(t, `INSERT INTO workqueue (workqueue_id, stage, payload) SELECT 10000000000000000 + g, 'a', '{}' FROM generate_series(1, 999) g`)
	waitFor(t, 30*time.Second, "ids handed to the hung worker", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE stage = 'a' AND status = 'running'`) > 1
	})
	other := insertOne(t, s, "b", `{}`)
	waitFor(t, 30*time.Second, "the other stage's message done", func() bool { return row(t, s, other).status == "done" })
	if st := row(t, s, hung).status; st != "running" {
		t.Errorf("the hung message is %s, want still running", st)
	}
	d.waitLog("a worker's stdin pipe holds fewer ids than QUEUE_LIMIT", time.Second)
	d.stop()
}

// TestNoSessionTexts: the lines by which workers say the server gave them no session, as the
// Go SDK (lib/pq), the Python SDK (psycopg) and a libpq program (psql here) wrote them against
// PostgreSQL 15, are told from lines of a worker that had one.
func TestNoSessionTexts(t *testing.T) {
	for _, c := range []struct {
		line string
		want bool
	}{
		{`connect to the database: pq: too many connections for role "pepsi" (53300)`, true},
		{`connect to the database: pq: role "nosuchrole" does not exist (28000)`, true},
		{`pepsi_stage a: connect to the database: connection failed: FATAL:  too many connections for role "pepsi"`, true},
		{`connection failed: FATAL:  database "nosuchdb" does not exist`, true},
		{`psql: error: connection to server on socket "/tmp/pgx/.s.PGSQL.23383" failed: FATAL:  too many connections for role "zlim"`, true},
		{`psql: error: connection to server at "127.0.0.1", port 1 failed: Connection refused`, true},
		{`FATAL:  sorry, too many clients already`, true},
		{`FATAL:  remaining connection slots are reserved for non-replication superuser connections`, true},
		{`pq: password authentication failed for user "pepsi" (28P01)`, true},
		{`decode payload: invalid character 'x' looking for beginning of value`, false},
		{`pq: relation "orders" does not exist (42P01)`, false},
		{`pq: division by zero (22012)`, false},
		{`server closed the connection unexpectedly`, false}, // a session it had: an outage's (isOutageText)
	} {
		if got := isNoSessionText(c.line); got != c.want {
			t.Errorf("isNoSessionText(%q) = %v, want %v", c.line, got, c.want)
		}
	}
}

// TestDeferHonoured: a row the stage itself paused (a defer) is returned to pending when due,
// from the due time the claim reports: POLL_INTERVAL is long here, so no heartbeat helps.
func TestDeferHonoured(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	conf := strings.Replace(baseConf(s, ""), "POLL_INTERVAL = 1", "POLL_INTERVAL = 60", 1)
	d := startDaemon(t, conf+stageConf(t, "a", "", ""), "pipeline")
	start := time.Now()
	id := insertOne(t, s, "a", `{"defer_at": "a", "defer_ms": 700}`)
	waitFor(t, 30*time.Second, "deferred message done", func() bool { return row(t, s, id).status == "done" })
	if took := time.Since(start); took < 700*time.Millisecond || took > 10*time.Second {
		t.Errorf("a 700 ms defer finished after %v", took)
	}
	if n := s.count(t, `SELECT count(*) FROM runs WHERE id = $1`, id); n != 2 {
		t.Errorf("the stage ran %d times, want 2 (defer, then done)", n)
	}
	if r := row(t, s, id); r.attempts != 0 || r.reason != "" {
		t.Errorf("a defer was counted as a failure: %+v", r)
	}
	d.stop()
}

// TestFailureReasonOutsideDatabaseEncoding: on a database whose encoding is not UTF-8
// (LATIN1 here, as a DBA of a Western European system may have made it), a worker's failure
// reason with a character the encoding has no place for ("→") made PostgreSQL refuse the
// dispatcher's failure write, at every retry: the message stayed running for ever, said once
// as a write "the database refused by itself". The reason is written again with its
// characters outside ASCII as escapes; the message is retried and fails as its stage asked.
func TestFailureReasonOutsideDatabaseEncoding(t *testing.T) {
	admin, err := sql.Open("postgres", baseDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	db := fmt.Sprintf("pepsi_latin1_%06d", rand.IntN(1000000))
	if _, err := admin.Exec(`CREATE DATABASE ` + db + ` ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0`); err != nil {
		t.Fatalf("create a LATIN1 database: %v", err)
	}
	t.Cleanup(func() { admin.Exec(`DROP DATABASE IF EXISTS ` + db + ` WITH (FORCE)`) })
	s := &testSchema{Name: "public", DSN: baseDSN(t) + " dbname=" + db}
	s.DB, err = sql.Open("postgres", s.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer s.DB.Close()
	ddl := schemaDDL(t)
	s.exec(t, ddl)
	script := writeFile(t, testDir(t), "fail.sh", "#!/bin/sh\nwhile read id; do echo '1 naïve → ✓ failed'; done\n")
	if err := os.Chmod(script, 0o755); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, baseConf(s, "")+fmt.Sprintf("[stage-a]\nPROGRAM = %s\nMAX_ATTEMPTS = 2\nRETRY_DELAY = 0.1\n", script), "none")
	id := insertOne(t, s, "a", `{}`)
	waitFor(t, 30*time.Second, "the message failed after two attempts", func() bool { return row(t, s, id).status == "failed" })
	d.stop()
	if r := row(t, s, id); r.attempts != 2 || r.reason != `stage a: status 1: na\u00EFve \u2192 \u2713 failed` {
		t.Errorf("the failed message: %+v", r)
	}
	if strings.Contains(d.log.String(), "refused this message's failure write") {
		t.Errorf("the failure write was refused:\n%s", d.log.String())
	}
}
