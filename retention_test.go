package main

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestRetentionRetryCommittedMeanwhile: an operator's retry of an old cancelled message that
// commits while a retention turn is deleting must win: the message is pending afterwards, not
// gone. The retry's transaction is held open until the turn has met its row lock (or passed
// it by), then committed; the turn was planned from a snapshot in which the row was still
// cancelled and old.
func TestRetentionRetryCommittedMeanwhile(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `INSERT INTO workqueue (stage, status, created_at, status_at)
		SELECT 'zz', 'cancelled', now() - interval '10 days', now() - interval '8 days' FROM generate_series(1, 3)`)
	x := int64(s.count(t, `SELECT min(workqueue_id) FROM workqueue`))

	tx, err := s.DB.Begin()
	if err != nil {
		t.Fatalf("begin the operator's retry: %v", err)
	}
	defer tx.Rollback()
	var ok bool
	var holder int
	if err := tx.QueryRow(`SELECT ok FROM queue_retry(ARRAY[$1]::bigint[])`, x).Scan(&ok); err != nil || !ok {
		t.Fatalf("queue_retry(%d): ok %v, err %v", x, ok, err)
	}
	if err := tx.QueryRow(`SELECT pg_backend_pid()`).Scan(&holder); err != nil {
		t.Fatalf("the retry's backend: %v", err)
	}

	type result struct {
		n   int64
		err error
	}
	turned := make(chan result, 1)
	go func() {
		res := retentionTurn(context.Background(), s.DB, walkOf(7*24*time.Hour, false), 0)
		turned <- result{res.n, res.err}
	}()
	var got *result
	waitFor(t, 10*time.Second, "the retention turn waiting for the retry's row lock, or done", func() bool {
		select {
		case res := <-turned:
			got = &res
			return true
		default:
		}
		return s.count(t, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid))`, holder) > 0
	})
	if err := tx.Commit(); err != nil {
		t.Fatalf("commit the operator's retry: %v", err)
	}
	if got == nil {
		select {
		case res := <-turned:
			got = &res
		case <-time.After(10 * time.Second):
			t.Fatal("the retention turn did not finish after the retry committed")
		}
	}
	if got.err != nil {
		t.Fatalf("retention turn: %v", got.err)
	}
	var status string
	if err := s.DB.QueryRow(`SELECT coalesce((SELECT status FROM workqueue WHERE workqueue_id = $1), 'gone')`, x).Scan(&status); err != nil {
		t.Fatalf("read message %d's status: %v", x, err)
	}
	if status != "pending" {
		t.Errorf("message %d, retried by an operator while retention ran, is %s (want pending): the retry is lost", x, status)
	}
	if got.n != 2 || s.count(t, `SELECT count(*) FROM workqueue`) != 1 {
		t.Errorf("the turn deleted %d rows, %d left; want the 2 other old cancelled rows deleted, 1 left",
			got.n, s.count(t, `SELECT count(*) FROM workqueue`))
	}
}

// TestRetentionBlockedClaimsGoOn: a retention turn that waits (here for a row lock, through an
// application's foreign key to a message, ON DELETE SET NULL, whose referencing row an open
// transaction holds) does not stop the dispatcher: messages enqueued meanwhile run at once,
// and the turn, cancelled because the pipeline has work again, deletes nothing. On the
// coordinator's own goroutine, as it was, the turn held every claim for the statement
// budget.
func TestRetentionBlockedClaimsGoOn(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	s.exec(t, `CREATE TABLE app_ref (msg bigint REFERENCES workqueue ON DELETE SET NULL)`)
	old := int64(s.count(t, `INSERT INTO workqueue (stage, status, created_at, status_at)
	    VALUES ('zz', 'done', now() - interval '10 days', now() - interval '8 days') RETURNING workqueue_id`))
	s.exec(t, `INSERT INTO app_ref VALUES ($1)`, old)
	tx, err := s.DB.Begin()
	if err != nil {
		t.Fatalf("begin the referencing row's holder: %v", err)
	}
	defer tx.Rollback()
	var holder int
	if err := tx.QueryRow(`SELECT pg_backend_pid() FROM app_ref FOR UPDATE`).Scan(&holder); err != nil {
		t.Fatalf("lock the referencing row: %v", err)
	}

	d := startDaemon(t, baseConf(s, "RETENTION = 7d")+stageConf(t, "a", "", "PARALLELISM = 2\nQUEUE_LIMIT = 4"), "pipeline")
	blocked := func() int {
		return s.count(t, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid))`, holder)
	}
	// The first turn comes 1 s after the start; its delete waits for the referencing row.
	waitFor(t, 30*time.Second, "the retention turn waiting for the referencing row's lock", func() bool { return blocked() == 1 })
	since := time.Now()
	enqueue(t, s, "a", 5, `{}`)
	waitFor(t, dbStatementBudget/2, "the 5 messages done while the retention turn waits", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE stage = 'a' AND status = 'done'`) == 5
	})
	took := time.Since(since)
	waitFor(t, 10*time.Second, "the retention turn cancelled", func() bool { return blocked() == 0 })
	d.waitLog("retention turn stopped: messages in flight, or a shutdown", 5*time.Second)
	if strings.Contains(d.log.String(), "retention turn failed") {
		t.Errorf("the turn failed instead of being stopped:\n%s", d.log.String())
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1`, old); n != 1 {
		t.Errorf("the old done row is gone, but its delete was cancelled")
	}
	noRunTwice(t, s)
	t.Logf("5 messages done %v after they were enqueued, while the turn waited", took.Round(time.Millisecond))
	tx.Rollback()
	d.stop()
}

// TestRetentionStopsAtYoungRows: 20,000 old done rows, then 250,000 young ones. A walk
// deletes the old ones and stops at the first window of young rows, not at the end of the
// table, and does not look at a whole window again for each batch of old ones; a row whose
// id is out of time order (finished long ago, inserted last) is left to the full walk, which
// goes on to the end of the table and deletes it. The rows looked at are PostgreSQL's count of
// heap rows fetched through an index on the table.
func TestRetentionStopsAtYoungRows(t *testing.T) {
	const old, young = 20_000, 250_000
	s := newTestSchema(t)
	oldDoneRows(t, s, old)
	s.exec(t, `INSERT INTO workqueue (stage, status) SELECT 'zz', 'done' FROM generate_series(1, $1)`, young)
	straggler := oldDoneRows(t, s, 1)
	s.exec(t, `ANALYZE workqueue`)

	// One connection, so that its statistics can be flushed on demand (pg_stat_force_next_flush:
	// the backend sends them before it reports that it is ready for the next statement).
	db, err := sql.Open("postgres", s.DSN)
	if err != nil {
		t.Fatalf("open the turn's pool: %v", err)
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	fetched := func() int {
		if _, err := db.Exec(`SELECT pg_stat_force_next_flush()`); err != nil {
			t.Fatalf("flush the turn's statistics: %v", err)
		}
		return s.count(t, `SELECT coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables WHERE relid = 'workqueue'::regclass`)
	}
	turn := func(full bool) (int64, int) {
		before := fetched()
		w := walkOf(7*24*time.Hour, full)
		var total int64
		for cursor, turns := int64(0), 0; ; turns++ {
			if turns == 100 {
				t.Fatalf("the walk (full %v) did not end in 100 turns", full)
			}
			res := retentionTurn(context.Background(), db, w, cursor)
			if res.err != nil {
				t.Fatalf("retention turn: %v", res.err)
			}
			if total += res.n; res.cursor == 0 {
				break
			}
			cursor = res.cursor
		}
		return total, fetched() - before
	}

	n, looked := turn(false)
	if n != old {
		t.Errorf("the walk deleted %d rows, want the %d old ones at the start", n, old)
	}
	// Each old row is fetched about four times: in a window of twice a batch (two per row
	// deleted), again to be locked, and by the DELETE; and two whole windows: the first, and
	// the one of young rows that ends the walk. Looking at a whole window for each batch would
	// be 21 windows; walking on to the end of the table, the whole table. 1,000 to spare for
	// the test's own lookups.
	if most := 4*old + 2*retentionWindow + 1000; looked > most {
		t.Errorf("the walk looked at %d rows of %d, want at most %d: it stops at the first window of young rows",
			looked, old+young+1, most)
	}
	if s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1`, straggler) != 1 {
		t.Errorf("the walk deleted the row past the young ones; only a full walk goes there")
	}
	t.Logf("a walk looked at %d rows of %d", looked, old+young+1)

	n, looked = turn(true)
	if n != 1 || s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1`, straggler) != 0 {
		t.Errorf("the full walk deleted %d rows, want 1: the row past the young ones", n)
	}
	if looked < young {
		t.Errorf("the full walk looked at %d rows, want the whole table (%d)", looked, young+1)
	}
	if left := s.count(t, `SELECT count(*) FROM workqueue`); left != young {
		t.Errorf("%d rows left, want the %d young ones", left, young)
	}
}

// TestRetentionWalkAcrossTurns: small windows over a table of old failed rows, then old done
// and cancelled rows, then young ones and an old done row inserted last. Turns carry the walk
// on from where the last one stopped, so the old done rows behind the failed ones go, the
// failed and young ones stay; walks stop at the young rows, so the row inserted last stays
// until the day's full walk (the first after the start is one), which deletes it.
func TestRetentionWalkAcrossTurns(t *testing.T) {
	s := newTestSchema(t)
	old := `now() - interval '10 days', now() - interval '9 days'`
	s.exec(t, `INSERT INTO workqueue (stage, status, created_at, status_at) SELECT 'zz', 'failed', `+old+` FROM generate_series(1, 37)`)
	s.exec(t, `INSERT INTO workqueue (stage, status, created_at, status_at) SELECT 'zz', st, `+old+`
		FROM generate_series(1, 13), unnest(ARRAY['done', 'cancelled']) st`)
	s.exec(t, `INSERT INTO workqueue (stage, status) SELECT 'zz', 'done' FROM generate_series(1, 40)`)
	last := int64(s.count(t, `INSERT INTO workqueue (stage, status, created_at, status_at) VALUES ('zz', 'done', `+old+`) RETURNING workqueue_id`))

	start := time.Now()
	r := &retainer{age: 7 * 24 * time.Hour, lastFull: start} // a full walk has just ended
	run := func(now time.Time) (walks int, full []bool) {
		for turns := 0; walks < 2; turns++ {
			if turns == 50 {
				t.Fatalf("two walks did not end in 50 turns")
			}
			w := r.nextWalk(now)
			w.batch, w.window, w.batches = 4, 10, 2
			if r.cursor == 0 {
				full = append(full, w.full)
			}
			res := retentionTurn(context.Background(), s.DB, w, r.cursor)
			r.ended(res, now)
			if res.err != nil {
				t.Fatalf("retention turn: %v", res.err)
			}
			if res.cursor == 0 {
				walks++
			}
		}
		return walks, full
	}

	_, full := run(start.Add(time.Minute))
	if full[0] || full[1] {
		t.Errorf("walks within a day of the last full one: full %v, want none", full)
	}
	for st, want := range map[string]int{"failed": 37, "done": 41, "cancelled": 0} {
		if n := s.count(t, `SELECT count(*) FROM workqueue WHERE status = $1`, st); n != want {
			t.Errorf("%d %s rows left after two walks, want %d", n, st, want)
		}
	}
	if s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1`, last) != 1 {
		t.Errorf("a walk deleted the old row inserted last, past the young ones: only a full walk goes there")
	}

	_, full = run(start.Add(retentionFullEvery))
	if !full[0] || full[1] {
		t.Errorf("walks a day after the last full one: full %v, want the first only", full)
	}
	if s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1`, last) != 0 {
		t.Errorf("the full walk left the old row inserted last")
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue`); n != 37+40 {
		t.Errorf("%d rows left, want the 37 failed and 40 young ones", n)
	}
	if !(&retainer{}).nextWalk(start).full {
		t.Errorf("the first walk after the start is not a full one")
	}
}

// oldDoneRows inserts n rows done nine days ago (created ten), past a RETENTION of 7d, and
// returns the first one's id.
func oldDoneRows(t *testing.T, s *testSchema, n int) int64 {
	t.Helper()
	return int64(s.count(t, `WITH i AS (INSERT INTO workqueue (stage, status, created_at, status_at)
		SELECT 'zz', 'done', now() - interval '10 days', now() - interval '9 days' FROM generate_series(1, $1)
		RETURNING workqueue_id) SELECT min(workqueue_id) FROM i`, n))
}

// refusingApp gives the test schema an application that refuses the deletion of two rows
// by a foreign key without ON DELETE (a and c) and of one by its trigger (b).
func refusingApp(t *testing.T, s *testSchema, a, b, c int64) {
	t.Helper()
	s.exec(t, `CREATE TABLE app_ref (msg bigint REFERENCES workqueue)`)
	s.exec(t, `INSERT INTO app_ref VALUES ($1), ($2)`, a, c)
	s.exec(t, `CREATE FUNCTION app_keep() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF OLD.workqueue_id = `+strconv.FormatInt(b, 10)+` THEN
				RAISE EXCEPTION 'the application keeps message %', OLD.workqueue_id;
			END IF;
			RETURN OLD;
		END $$`)
	s.exec(t, `CREATE TRIGGER app_keep BEFORE DELETE ON workqueue FOR EACH ROW EXECUTE FUNCTION app_keep()`)
}

// TestRetentionRowRefused: the database refuses to delete three of 30 old done rows (an
// application's foreign key to two, its trigger for one). The walk deletes the 27 others,
// those after the refused rows included, and reports the three; the next walk leaves them
// out (no batch is refused again); the daily full walk tries them again and, the
// application having let go, deletes them. A batch refused for one row used to fail its turn
// at the same place every minute, and nothing past it was deleted again.
func TestRetentionRowRefused(t *testing.T) {
	s := newTestSchema(t)
	first := oldDoneRows(t, s, 30)
	s.exec(t, `INSERT INTO workqueue (stage, status) SELECT 'zz', 'done' FROM generate_series(1, 5)`)
	kept := []int64{first + 4, first + 11, first + 19}
	refusingApp(t, s, kept[0], kept[1], kept[2])

	start := time.Now()
	r := &retainer{age: 7 * 24 * time.Hour, lastFull: start} // a full walk has just ended
	walk := func(now time.Time) (deleted int64, refused []int64, full bool) {
		for turns := 0; ; turns++ {
			if turns == 50 {
				t.Fatalf("a walk did not end in 50 turns")
			}
			w := r.nextWalk(now)
			w.batch, w.window, w.batches = 4, 10, 2
			full = full || w.full
			res := retentionTurn(context.Background(), s.DB, w, r.cursor)
			r.ended(res, now)
			if res.err != nil {
				t.Fatalf("retention turn: %v", res.err)
			}
			deleted += res.n
			for _, rr := range res.refused {
				refused = append(refused, rr.id)
				// The constraint's name and the trigger's own text: the server's words follow its lc_messages.
				if !strings.Contains(rr.err.Error(), "app_ref_msg_fkey") && !strings.Contains(rr.err.Error(), "the application keeps") {
					t.Errorf("row %d refused with %v, want the foreign key's or the trigger's error", rr.id, rr.err)
				}
			}
			if res.cursor == 0 {
				return deleted, refused, full
			}
		}
	}
	left := func() []int64 {
		var ids []int64
		rows, err := s.DB.Query(`SELECT workqueue_id FROM workqueue WHERE created_at < now() - interval '9 days' ORDER BY 1`)
		if err != nil {
			t.Fatalf("read the old rows left: %v", err)
		}
		defer rows.Close()
		for rows.Next() {
			var id int64
			if err := rows.Scan(&id); err != nil {
				t.Fatalf("read the old rows left: %v", err)
			}
			ids = append(ids, id)
		}
		return ids
	}

	_, refused, _ := walk(start.Add(time.Minute))
	if !slices.Equal(refused, kept) {
		t.Errorf("the walk reported rows %v refused, want %v", refused, kept)
	}
	if got := left(); !slices.Equal(got, kept) {
		t.Errorf("old rows left after the walk: %v, want only the refused %v", got, kept)
	}
	if deleted, refused, full := walk(start.Add(2 * time.Minute)); deleted != 0 || len(refused) != 0 || full {
		t.Errorf("the next walk (full %v) deleted %d rows and had %v refused again; want none: the refused rows are left out",
			full, deleted, refused)
	}

	s.exec(t, `DELETE FROM app_ref`)
	s.exec(t, `DROP TRIGGER app_keep ON workqueue`)
	if deleted, refused, full := walk(start.Add(retentionFullEvery)); deleted != 3 || len(refused) != 0 || !full {
		t.Errorf("the day's full walk (full %v) deleted %d rows, %v refused; want the 3 let go deleted", full, deleted, refused)
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue`); n != 5 {
		t.Errorf("%d rows left, want the 5 young ones", n)
	}
}

// TestRetentionRowRefusedDaemon: the same application, under the daemon: the first turn
// after the start deletes the rows it may and says which ones the database refused, once.
func TestRetentionRowRefusedDaemon(t *testing.T) {
	s := newTestSchema(t)
	first := oldDoneRows(t, s, 3000)
	refusingApp(t, s, first+10, first+1500, first+2999)
	d := startDaemon(t, baseConf(s, "RETENTION = 7d"), "pipeline")
	waitFor(t, 30*time.Second, "the old rows deleted but the three refused", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue`) == 3
	})
	const said = "retention: the database refused to delete these old rows"
	d.waitLog(said, 5*time.Second)
	var line string
	for _, l := range strings.Split(d.log.String(), "\n") {
		if strings.Contains(l, said) {
			line = l
		}
	}
	want := fmt.Sprintf("rows=3 ids=\"[%d %d %d]\"", first+10, first+1500, first+2999)
	if !strings.Contains(line, want) {
		t.Errorf("the refusal's line %q does not say %s", line, want)
	}
	d.stop()
	if n := strings.Count(d.log.String(), "retention: the database refused"); n != 1 {
		t.Errorf("%d refusal lines, want 1", n)
	}
}

// TestRetentionRefusedBatchFewStatements: a batch the database refuses for one row is
// halved until that row stands alone, about 2 log2(batch) statements, where it was deleted
// again one row per statement: a thousand for one refused row, which on a busy server ran
// past the turn's budget (CI, under load: "delete row 2589 alone: context deadline
// exceeded", the rest of the walk a minute later).
func TestRetentionRefusedBatchFewStatements(t *testing.T) {
	s := newTestSchema(t)
	first := oldDoneRows(t, s, 1000)
	refusingApp(t, s, first+10, first+500, first+999)
	// Every DELETE statement on the table, whatever it deleted.
	s.exec(t, `CREATE TABLE deletes (n int)`)
	s.exec(t, `CREATE FUNCTION count_delete() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN INSERT INTO deletes VALUES (1); RETURN NULL; END $$`)
	s.exec(t, `CREATE TRIGGER count_delete AFTER DELETE ON workqueue FOR EACH STATEMENT EXECUTE FUNCTION count_delete()`)
	r := &retainer{age: 7 * 24 * time.Hour, lastFull: time.Now()}
	w := r.nextWalk(time.Now())
	w.batch, w.window, w.batches = 1000, 1000, 1
	res := retentionTurn(context.Background(), s.DB, w, r.cursor)
	if res.err != nil {
		t.Fatalf("retention turn: %v", res.err)
	}
	var refused []int64
	for _, rr := range res.refused {
		refused = append(refused, rr.id)
	}
	slices.Sort(refused)
	if res.n != 997 || !slices.Equal(refused, []int64{first + 10, first + 500, first + 999}) {
		t.Errorf("deleted %d, refused %v; want 997 and the three", res.n, refused)
	}
	// Statements that committed; a refused one rolled back its own row in deletes.
	if n := s.count(t, `SELECT count(*) FROM deletes`); n > 3*2*10 {
		t.Errorf("%d DELETE statements committed for a batch of 1,000 with three refused rows, want at most 60", n)
	}
}

// TestRetentionAllRefused: an application that references every old row. A turn spends one
// statement per row on the first batch only, reports its rows refused and ends there; the
// next goes on after them, and no turn deletes anything.
func TestRetentionAllRefused(t *testing.T) {
	s := newTestSchema(t)
	first := oldDoneRows(t, s, 12)
	s.exec(t, `CREATE TABLE app_ref (msg bigint REFERENCES workqueue)`)
	s.exec(t, `INSERT INTO app_ref SELECT workqueue_id FROM workqueue`)

	r := &retainer{age: 7 * 24 * time.Hour, lastFull: time.Now()}
	for turn, want := range [][]int64{{first, first + 3}, {first + 4, first + 7}, {first + 8, first + 11}} {
		w := r.nextWalk(time.Now())
		w.batch, w.window, w.batches = 4, 10, 3
		res := retentionTurn(context.Background(), s.DB, w, r.cursor)
		r.ended(res, time.Now())
		if res.err != nil {
			t.Fatalf("turn %d: %v", turn+1, res.err)
		}
		if len(res.refused) != 4 || res.refused[0].id != want[0] || res.refused[3].id != want[1] || res.n != 0 {
			t.Errorf("turn %d deleted %d rows and had %d refused (%v); want rows %d to %d refused, nothing else",
				turn+1, res.n, len(res.refused), res.refused, want[0], want[1])
		}
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue`); n != 12 {
		t.Errorf("%d rows left, want all 12", n)
	}
	if len(r.refused) != 12 {
		t.Errorf("the retainer remembers %d refused rows, want 12", len(r.refused))
	}
}

// TestRetentionPastRoleStatementTimeout: a statement_timeout of the role's (or the database's,
// or the DSN's) shorter than one window's statement cut it at every turn, at the same window,
// and retention deleted nothing again while the table grew. A cut window is looked at again at
// half the size, and the turn deletes. The timeout is the session's here (the same cut, 57014),
// so that it can follow the machine's speed of the day.
func TestRetentionPastRoleStatementTimeout(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `ALTER TABLE workqueue SET (autovacuum_enabled = false)`)
	s.exec(t, `INSERT INTO workqueue (stage, status, created_at, status_at)
	           SELECT 'a', 'done', now() - interval '30 days', now() - interval '30 days' FROM generate_series(1, 120000)`)
	s.exec(t, `VACUUM ANALYZE workqueue`)
	db, err := sql.Open("postgres", s.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	db.SetMaxOpenConns(1) // one session: the premise's, its timeout's and the turn's
	w := walkOf(24*time.Hour, false)
	window := func() error { // a window's statement, rolled back: the premise deletes nothing
		tx, err := db.Begin()
		if err != nil {
			return err
		}
		defer tx.Rollback()
		var n, lastGone, looked, lastLooked int64
		var young bool
		return tx.QueryRow(retentionSQL, w.age.Seconds(), 0, w.batch, w.window, "{}").
			Scan(&n, &lastGone, &looked, &lastLooked, &young)
	}
	// The timeout a quarter of a window's quickest time here, so that a window outlasts it
	// however fast the machine is today; set on the session, as a role's setting is.
	exec := func(q string) error { _, err := db.Exec(q); return err }
	cutStatement(t, exec, window, 4, fmt.Sprintf("a window of %d rows", w.window))
	res := retentionTurn(context.Background(), db, w, 0)
	if res.err != nil {
		t.Fatalf("retention turn: %v", res.err)
	}
	left := s.count(t, `SELECT count(*) FROM workqueue`)
	t.Logf("the turn deleted %d rows", res.n)
	if res.n == 0 || int64(left) != 120000-res.n {
		t.Errorf("the turn deleted %d rows, %d left of 120000", res.n, left)
	}
}
