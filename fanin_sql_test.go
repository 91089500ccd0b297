// fanin_sql_test.go: tests of fanin.sql alone (doc/design/fanin.md §3.13), against real PostgreSQL.
//
// No dispatcher runs here: a test plays the claim by setting rows 'running' by hand, the
// stages by writing the children's outcomes, and the coordinator by calling fanin_flush,
// fanin_sweep and fanin_fire_ready. checkFaninInvariants is the oracle of §3.13; every test
// ends with it. Run them alone with `go test -race -run Fanin .`.

package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/big"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/lib/pq"
)

// faninQuerier is what the helpers run statements on: *sql.DB, *sql.Conn or *sql.Tx.
type faninQuerier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// faninFlushResult is one row of fanin_flush.
type faninFlushResult struct {
	Events, GroupsUpdated, GroupsFired, ParentsWoken, LateEvents, Quarantined, Held int
	Woken, OpenIDs, OpenRemaining, QuarantinedIDs                                   []int64
	RefusedIDs                                                                      []int64 // as of one flush
	RefusedEvents                                                                   int
	RefusedReason                                                                   sql.NullString
}

func (r *faninFlushResult) add(o faninFlushResult) {
	r.Events += o.Events
	r.GroupsUpdated += o.GroupsUpdated
	r.GroupsFired += o.GroupsFired
	r.ParentsWoken += o.ParentsWoken
	r.LateEvents += o.LateEvents
	r.Quarantined += o.Quarantined
	r.Held = o.Held // as of the last flush
	r.Woken = append(r.Woken, o.Woken...)
	r.OpenIDs = append(r.OpenIDs, o.OpenIDs...)
	r.OpenRemaining = append(r.OpenRemaining, o.OpenRemaining...)
	r.QuarantinedIDs = append(r.QuarantinedIDs, o.QuarantinedIDs...)
}

// faninFlush runs one fanin_flush(batch).
func faninFlush(ctx context.Context, q faninQuerier, batch int) (faninFlushResult, error) {
	return faninFlushMode(ctx, q, batch, false)
}

// faninFlushMode runs one fanin_flush(batch, lockFirst).
func faninFlushMode(ctx context.Context, q faninQuerier, batch int, lockFirst bool) (faninFlushResult, error) {
	return faninFlushPass(ctx, q, batch, lockFirst, nil, nil)
}

// faninFlushPass runs one fanin_flush(batch, lockFirst, pass, only); a nil only is NULL.
func faninFlushPass(ctx context.Context, q faninQuerier, batch int, lockFirst bool, pass, only []int64) (faninFlushResult, error) {
	var r faninFlushResult
	var onlyList any
	if only != nil {
		onlyList = pq.Array(only)
	}
	err := q.QueryRowContext(ctx, `SELECT events, groups_updated, groups_fired, parents_woken,
	        late_events, quarantined, woken, open_ids, open_remaining, quarantined_ids, held,
	        refused_ids, refused_events, refused_reason
	   FROM fanin_flush($1, $2, $3, $4)`, batch, lockFirst, idList(pass), onlyList).Scan(&r.Events, &r.GroupsUpdated,
		&r.GroupsFired, &r.ParentsWoken, &r.LateEvents, &r.Quarantined, pq.Array(&r.Woken),
		pq.Array(&r.OpenIDs), pq.Array(&r.OpenRemaining), pq.Array(&r.QuarantinedIDs), &r.Held,
		pq.Array(&r.RefusedIDs), &r.RefusedEvents, &r.RefusedReason)
	if err != nil {
		return r, fmt.Errorf("fanin_flush(%d, %t, %v, %v): %w", batch, lockFirst, pass, only, err)
	}
	return r, nil
}

// faninFlushBounded runs one fanin_flush(batch, lockFirst) within 5 s, failing the test on an
// error (a flush that waits for a held row until then fails it), and says how long it took.
func faninFlushBounded(t *testing.T, s *testSchema, batch int, lockFirst bool) (faninFlushResult, time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	r, err := faninFlushMode(ctx, s.DB, batch, lockFirst)
	if err != nil {
		t.Fatalf("a flush (batch %d, lock first %t): %v", batch, lockFirst, err)
	}
	return r, time.Since(start)
}

// faninExpectFired requires n wake-log rows (each group fired once) and the fan-in invariants.
func faninExpectFired(t *testing.T, s *testSchema, n int) {
	t.Helper()
	if got := s.count(t, `SELECT count(*) FROM fanin_wake_log`); got != n {
		t.Errorf("%d wake-log rows, want %d", got, n)
	}
	checkFaninInvariants(t, s)
}

// faninFlushAll flushes as the coordinator does: again while a flush consumed a full batch.
func faninFlushAll(t testing.TB, s *testSchema, batch int) faninFlushResult {
	t.Helper()
	var total faninFlushResult
	for {
		r, err := faninFlush(context.Background(), s.DB, batch)
		if err != nil {
			t.Fatal(err)
		}
		total.add(r)
		if r.Events < batch {
			return total
		}
	}
}

// faninSweepResult is one row of fanin_sweep.
type faninSweepResult struct {
	Repaired, Examined, QuarantineCleared, OrphansWoken, GroupsFired, ParentsWoken int
	Woken, Broken                                                                  []int64
	NextAfter                                                                      int64
}

func faninSweep(ctx context.Context, q faninQuerier, after int64, page int, minAge string) (faninSweepResult, error) {
	var r faninSweepResult
	err := q.QueryRowContext(ctx, `SELECT repaired, examined, quarantine_cleared, orphans_woken,
	        groups_fired, parents_woken, woken, broken, next_after
	   FROM fanin_sweep($1, $2, $3::interval)`, after, page, minAge).Scan(&r.Repaired, &r.Examined,
		&r.QuarantineCleared, &r.OrphansWoken, &r.GroupsFired, &r.ParentsWoken,
		pq.Array(&r.Woken), pq.Array(&r.Broken), &r.NextAfter)
	if err != nil {
		return r, fmt.Errorf("fanin_sweep(%d, %d, %s): %w", after, page, minAge, err)
	}
	return r, nil
}

// faninSweepPass runs one full sweep pass (pages until next_after = 0) and sums it.
func faninSweepPass(t testing.TB, s *testSchema, page int, minAge string) faninSweepResult {
	t.Helper()
	var total faninSweepResult
	var after int64
	for {
		r, err := faninSweep(context.Background(), s.DB, after, page, minAge)
		if err != nil {
			t.Fatal(err)
		}
		total.Repaired += r.Repaired
		total.Examined += r.Examined
		total.QuarantineCleared += r.QuarantineCleared
		total.OrphansWoken += r.OrphansWoken
		total.GroupsFired += r.GroupsFired
		total.ParentsWoken += r.ParentsWoken
		total.Woken = append(total.Woken, r.Woken...)
		total.Broken = append(total.Broken, r.Broken...)
		if r.NextAfter == 0 {
			return total
		}
		if r.NextAfter <= after {
			t.Fatalf("sweep cursor went back from %d to %d", after, r.NextAfter)
		}
		after = r.NextAfter
	}
}

// faninParent inserts a message and claims it at stage, as the dispatcher's claim would.
func faninParent(t testing.TB, s *testSchema, stage string) int64 {
	t.Helper()
	var id int64
	err := s.DB.QueryRow(`INSERT INTO workqueue (stage, status, attempts, claim, claimed_at)
	    VALUES ($1, 'running', 0, nextval('workqueue_claim_seq'), now()) RETURNING workqueue_id`,
		stage).Scan(&id)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// faninSplitPayloads splits parent (running at "split") into n payload children at "child",
// continuing at "cont". It returns the group, or 0 when n = 0.
func faninSplitPayloads(t testing.TB, q faninQuerier, parent int64, n int) int64 {
	t.Helper()
	payloads := make([]json.RawMessage, n)
	for i := range payloads {
		payloads[i] = json.RawMessage(fmt.Sprintf(`{"i":%d}`, i))
	}
	arr, err := json.Marshal(payloads)
	if err != nil {
		t.Fatal(err)
	}
	var fid sql.NullInt64
	err = q.QueryRowContext(context.Background(),
		`SELECT fanout_split($1, 'split', 'cont', 'child', $2::jsonb)`, parent, string(arr)).Scan(&fid)
	if err != nil {
		t.Fatalf("fanout_split(%d, %d payloads): %v", parent, n, err)
	}
	return fid.Int64
}

// faninSplitRange splits parent (running at "split") over [lo, hi] with equal-width slices.
func faninSplitRange(t testing.TB, q faninQuerier, parent, lo, hi int64, maxChildren int, minSpan int64) int64 {
	t.Helper()
	var fid sql.NullInt64
	err := q.QueryRowContext(context.Background(),
		`SELECT fanout_split_range($1, 'split', 'cont', 'child', $2, $3, $4, $5)`,
		parent, lo, hi, maxChildren, minSpan).Scan(&fid)
	if err != nil {
		t.Fatalf("fanout_split_range(%d, [%d, %d], %d, %d): %v", parent, lo, hi, maxChildren, minSpan, err)
	}
	return fid.Int64
}

// faninChildren returns the children of group fid in slice order.
func faninChildren(t testing.TB, s *testSchema, fid int64) []int64 {
	t.Helper()
	var ids []int64
	if err := s.DB.QueryRow(`SELECT coalesce(array_agg(workqueue_id ORDER BY fanout_seq), '{}')
	    FROM workqueue WHERE fanout_id = $1`, fid).Scan(pq.Array(&ids)); err != nil {
		t.Fatal(err)
	}
	return ids
}

// faninNewGroup is the setup of most tests: a parent running at "split" split into n payload
// children at "child" (continuing at "cont"), pending. It returns the parent, the group and the
// children in slice order.
func faninNewGroup(t testing.TB, s *testSchema, n int) (parent, fid int64, kids []int64) {
	t.Helper()
	parent = faninParent(t, s, "split")
	fid = faninSplitPayloads(t, s.DB, parent, n)
	return parent, fid, faninChildren(t, s, fid)
}

// faninClaimedGroup is faninNewGroup with the children claimed, as the dispatcher would.
func faninClaimedGroup(t testing.TB, s *testSchema, n int) (parent, fid int64, kids []int64) {
	t.Helper()
	parent, fid, kids = faninNewGroup(t, s, n)
	faninClaim(t, s, kids)
	return parent, fid, kids
}

// faninNewRangeGroup is faninNewGroup for a range split of [lo, hi] (faninSplitRange).
func faninNewRangeGroup(t testing.TB, s *testSchema, lo, hi int64, maxChildren int, minSpan int64) (parent, fid int64, kids []int64) {
	t.Helper()
	parent = faninParent(t, s, "split")
	fid = faninSplitRange(t, s.DB, parent, lo, hi, maxChildren, minSpan)
	return parent, fid, faninChildren(t, s, fid)
}

// faninCheckIDRange checks the id range a split recorded for its group: from the first child
// to the last, which the sweep's recount scans.
func faninCheckIDRange(t testing.TB, s *testSchema, fid int64, kids []int64) {
	t.Helper()
	var lo, hi sql.NullInt64
	if err := s.DB.QueryRow(`SELECT child_lo, child_hi FROM fanout WHERE fanout_id = $1`, fid).Scan(&lo, &hi); err != nil {
		t.Fatal(err)
	}
	if !lo.Valid || !hi.Valid || lo.Int64 != slices.Min(kids) || hi.Int64 != slices.Max(kids) {
		t.Fatalf("group %d: id range %v..%v, want %d..%d", fid, lo, hi, slices.Min(kids), slices.Max(kids))
	}
}

// faninWriteUnseen sets a row's status with the evidence trigger disabled for that one
// statement: a lost completion, which only the sweep's recount can find.
func faninWriteUnseen(t testing.TB, s *testSchema, id int64, status string) {
	t.Helper()
	tx, err := s.DB.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	for _, q := range []string{
		`ALTER TABLE workqueue DISABLE TRIGGER fanin_evt_upd`,
		fmt.Sprintf(`UPDATE workqueue SET status = %s WHERE workqueue_id = %d`, pq.QuoteLiteral(status), id),
		`ALTER TABLE workqueue ENABLE TRIGGER fanin_evt_upd`,
	} {
		if _, err := tx.Exec(q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
}

// faninBreakEvidence makes the evidence of running child id's group inconsistent: a done write
// escapes the trigger, then its inverse does not, so applying the inbox would take done_n to -1
// (a tripwire: the flush quarantines the group).
func faninBreakEvidence(t testing.TB, s *testSchema, id int64) {
	t.Helper()
	faninWriteUnseen(t, s, id, "done")
	s.exec(t, `UPDATE workqueue SET status = 'pending' WHERE workqueue_id = $1`, id)
}

// faninHold locks the one row that lock selects (a SELECT … FOR UPDATE) in an open transaction,
// as an operator's UPDATE left open in psql would, and returns its rollback (also run at the
// end of the test, so a test that stops early does not leave the lock behind).
func faninHold(t *testing.T, s *testSchema, lock string, args ...any) (rollback func()) {
	t.Helper()
	tx, err := s.DB.Begin()
	if err != nil {
		t.Fatalf("begin the lock holder: %v", err)
	}
	var n int
	if err := tx.QueryRow(`SELECT count(*) FROM (`+lock+`) x`, args...).Scan(&n); err != nil || n != 1 {
		tx.Rollback()
		t.Fatalf("hold %q: %d rows, %v", lock, n, err)
	}
	t.Cleanup(func() { tx.Rollback() })
	return func() { tx.Rollback() }
}

// faninClaim plays the dispatcher's claim of pending rows.
func faninClaim(t testing.TB, s *testSchema, ids []int64) {
	t.Helper()
	s.exec(t, `UPDATE workqueue SET status = 'running', claim = nextval('workqueue_claim_seq'),
	    claimed_at = now() WHERE workqueue_id = ANY ($1) AND status = 'pending'`, pq.Array(ids))
}

// faninFinish plays the stages' terminal write, guarded as a stage's is.
func faninFinish(t testing.TB, s *testSchema, ids []int64, status string) {
	t.Helper()
	s.exec(t, `UPDATE workqueue SET status = $2 WHERE workqueue_id = ANY ($1) AND status = 'running'`,
		pq.Array(ids), status)
}

// faninFail plays the dispatcher's terminal failure write, with its reason.
func faninFail(t testing.TB, s *testSchema, ids []int64, reason string) {
	t.Helper()
	s.exec(t, `UPDATE workqueue SET status = 'failed', attempts = attempts + 1,
	    state = jsonb_set(state, '{dispatch_error}', to_jsonb($2::text))
	    WHERE workqueue_id = ANY ($1) AND status = 'running'`, pq.Array(ids), reason)
}

// faninRowStatus returns a row's stage and status.
func faninRowStatus(t testing.TB, s *testSchema, id int64) (stage, status string) {
	t.Helper()
	if err := s.DB.QueryRow(`SELECT stage, status FROM workqueue WHERE workqueue_id = $1`, id).
		Scan(&stage, &status); err != nil {
		t.Fatal(err)
	}
	return stage, status
}

// faninGroup returns a group's state and counters.
func faninGroup(t testing.TB, s *testSchema, fid int64) (state string, expected, done, failed int) {
	t.Helper()
	if err := s.DB.QueryRow(`SELECT state, expected_n, done_n, failed_n FROM fanout WHERE fanout_id = $1`,
		fid).Scan(&state, &expected, &done, &failed); err != nil {
		t.Fatal(err)
	}
	return
}

// faninSQLState returns the SQLSTATE of err, or "".
func faninSQLState(err error) string {
	var pqErr *pq.Error
	if errors.As(err, &pqErr) {
		return string(pqErr.Code)
	}
	return ""
}

// checkFaninInvariants is the oracle of doc/design/fanin.md §3.13, to be called at quiescence (every
// event flushed): it reports each violation with the rows that show it.
func checkFaninInvariants(t testing.TB, s *testSchema) {
	t.Helper()
	checks := []struct{ what, query string }{
		{"the inbox is empty", `SELECT id FROM fanin_event`},
		{"no open group is complete",
			`SELECT fanout_id FROM fanout WHERE state = 'open' AND done_n + failed_n = expected_n`},
		{"open groups' counters equal their children's statuses",
			`SELECT f.fanout_id FROM fanout f,
			        LATERAL (SELECT count(*) FILTER (WHERE w.status = 'done') AS d,
			                        count(*) FILTER (WHERE w.status = 'failed') AS x
			                   FROM workqueue w WHERE w.fanout_id = f.fanout_id) t
			  WHERE f.state = 'open' AND (f.done_n <> t.d OR f.failed_n <> t.x)`},
		{"open groups' children lie in the group's id range (the sweep recounts only that)",
			`SELECT DISTINCT f.fanout_id FROM fanout f JOIN workqueue w ON w.fanout_id = f.fanout_id
			  WHERE f.state = 'open' AND (w.workqueue_id BETWEEN f.child_lo AND f.child_hi) IS NOT TRUE`},
		{"open groups have expected_n children",
			`SELECT f.fanout_id FROM fanout f WHERE f.state = 'open'
			   AND f.expected_n <> (SELECT count(*) FROM workqueue w WHERE w.fanout_id = f.fanout_id)`},
		{"every fired group has exactly one wake-log row, with its counts, that woke its parent",
			`SELECT f.fanout_id FROM fanout f LEFT JOIN fanin_wake_log l USING (fanout_id)
			   WHERE f.state = 'fired'
			     AND (l.fanout_id IS NULL OR l.done_n <> f.done_n OR l.failed_n <> f.failed_n
			          OR NOT l.parent_woken OR l.parent_id <> f.parent_id)`},
		{"wake-log rows belong to fired groups",
			`SELECT l.fanout_id FROM fanin_wake_log l LEFT JOIN fanout f USING (fanout_id)
			   WHERE f.state IS DISTINCT FROM 'fired'`},
		{"every waiting parent waits on an open group of its own",
			`SELECT p.workqueue_id FROM workqueue p LEFT JOIN fanout f ON f.fanout_id = p.wait_fanout_id
			   WHERE p.status = 'waiting'
			     AND (f.state IS DISTINCT FROM 'open' OR f.parent_id <> p.workqueue_id)`},
		{"every open group's parent waits on it",
			`SELECT f.fanout_id FROM fanout f LEFT JOIN workqueue p ON p.workqueue_id = f.parent_id
			   WHERE f.state = 'open'
			     AND (p.status IS DISTINCT FROM 'waiting' OR p.wait_fanout_id IS DISTINCT FROM f.fanout_id)`},
		{"no group is quarantined", `SELECT fanout_id FROM fanin_quarantine`},
	}
	for _, c := range checks {
		var bad []int64
		q := `SELECT coalesce(array_agg(x ORDER BY x), '{}') FROM (` + c.query + `) AS v(x)`
		if err := s.DB.QueryRow(q).Scan(pq.Array(&bad)); err != nil {
			t.Fatalf("invariant %q: %v", c.what, err)
		}
		if len(bad) > 0 {
			if len(bad) > 20 {
				bad = bad[:20]
			}
			t.Errorf("invariant violated: %s: ids %v", c.what, bad)
		}
	}
}

// --- T1, T2: all done; empty split -----------------------------------------------------

func TestFaninAllDone(t *testing.T) {
	s := newTestSchema(t)
	for _, n := range []int{1, 3, 1000} {
		for _, kind := range []string{"payloads", "range", "bounds"} {
			parent := faninParent(t, s, "split")
			var fid int64
			switch kind {
			case "payloads":
				fid = faninSplitPayloads(t, s.DB, parent, n)
			case "range":
				fid = faninSplitRange(t, s.DB, parent, 1, int64(n), 10000, 1)
			case "bounds":
				err := s.DB.QueryRow(`SELECT fanout_split_bounds($1, 'split', 'cont', 'child',
				    ARRAY(SELECT g * 10 FROM generate_series(0, $2) g))`, parent, n).Scan(&fid)
				if err != nil {
					t.Fatalf("n=%d bounds: %v", n, err)
				}
			}
			if stage, status := faninRowStatus(t, s, parent); stage != "cont" || status != "waiting" {
				t.Fatalf("n=%d %s: parent at %s/%s after the split, want cont/waiting", n, kind, stage, status)
			}
			kids := faninChildren(t, s, fid)
			if len(kids) != n {
				t.Fatalf("n=%d %s: %d children", n, kind, len(kids))
			}
			if got := s.count(t, `SELECT count(*) FROM fanin_event`); got != 0 {
				t.Fatalf("n=%d %s: split wrote %d inbox rows", n, kind, got)
			}
			faninCheckIDRange(t, s, fid, kids)
			faninClaim(t, s, kids)
			faninFinish(t, s, kids[:n-1], "done")
			r := faninFlushAll(t, s, 10000)
			if r.ParentsWoken != 0 || n > 1 && !slices.Equal(r.OpenRemaining, []int64{1}) {
				t.Fatalf("n=%d %s: flush before the last child: %+v", n, kind, r)
			}
			faninFinish(t, s, kids[n-1:], "done")
			r = faninFlushAll(t, s, 10000)
			if r.ParentsWoken != 1 || r.GroupsFired != 1 || !slices.Equal(r.Woken, []int64{parent}) {
				t.Fatalf("n=%d %s: last flush %+v, want one wake of %d", n, kind, r, parent)
			}
			if state, _, done, failed := faninGroup(t, s, fid); state != "fired" || done != n || failed != 0 {
				t.Fatalf("n=%d %s: group %s %d/%d", n, kind, state, done, failed)
			}
			if stage, status := faninRowStatus(t, s, parent); stage != "cont" || status != "pending" {
				t.Fatalf("n=%d %s: woken parent at %s/%s", n, kind, stage, status)
			}
			if r := faninFlushAll(t, s, 10000); r.Events != 0 || r.ParentsWoken != 0 {
				t.Fatalf("n=%d %s: a re-flush did something: %+v", n, kind, r)
			}
		}
	}
	if got := s.count(t, `SELECT count(*) FROM fanin_wake_log`); got != 9 {
		t.Errorf("%d wake-log rows, want 9", got)
	}
	checkFaninInvariants(t, s)
}

// TestFaninAllDone100k is T1 at N = 100,000: the split is timed (target ≤ 2 s, doc/design/fanin.md §4) and so is
// the wake after the last child's commit.
func TestFaninAllDone100k(t *testing.T) {
	if testing.Short() {
		t.Skip("100,000 children: skipped with -short")
	}
	s := newTestSchema(t)
	const n = 100000
	for _, kind := range []string{"range", "payloads"} {
		parent := faninParent(t, s, "split")
		tx, err := s.DB.Begin()
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		var fid int64
		if kind == "range" {
			fid = faninSplitRange(t, tx, parent, 1, n, n, 1)
		} else {
			fid = faninSplitPayloads(t, tx, parent, n)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		took := time.Since(start)
		t.Logf("T1: split of %d children (%s), committed: %v", n, kind, took)
		// The target is checked only on request: on a shared CI machine the time says more
		// about the neighbours than about the split.
		if took > 2*time.Second {
			if os.Getenv("PEPSI_TEST_PERF") != "" {
				t.Errorf("split of %d children took %v, over the 2 s target", n, took)
			} else {
				t.Logf("T1: the split took %v, over the 2 s target (enforced with PEPSI_TEST_PERF=1)", took)
			}
		}
		if got := s.count(t, `SELECT count(*) FROM workqueue WHERE fanout_id = $1`, fid); got != n {
			t.Fatalf("%d children", got)
		}
		// All but the last child end (straight from pending: the claim adds nothing here).
		s.exec(t, `UPDATE workqueue SET status = 'done' WHERE fanout_id = $1 AND fanout_seq < $2`, fid, n-1)
		start = time.Now()
		r := faninFlushAll(t, s, 10000)
		t.Logf("T1: flush of %d events: %v (%d statements of up to 10,000)", r.Events, time.Since(start), (r.Events+9999)/10000+1)
		if _, _, done, _ := faninGroup(t, s, fid); done != n-1 || r.ParentsWoken != 0 {
			t.Fatalf("flush of the first %d: done_n = %d, %+v", n-1, done, r)
		}
		s.exec(t, `UPDATE workqueue SET status = 'done' WHERE fanout_id = $1 AND fanout_seq = $2`, fid, n-1)
		start = time.Now()
		r = faninFlushAll(t, s, 10000)
		t.Logf("T1: wake latency from the last child's commit to the parent pending (one flush): %v", time.Since(start))
		if r.ParentsWoken != 1 {
			t.Fatalf("last flush: %+v", r)
		}
		if state, _, done, failed := faninGroup(t, s, fid); state != "fired" || done != n || failed != 0 {
			t.Fatalf("group %s %d/%d", state, done, failed)
		}
	}
	checkFaninInvariants(t, s)
}

func TestFaninEmptySplit(t *testing.T) {
	s := newTestSchema(t)
	for _, how := range []string{
		`SELECT fanout_split($1, 'split', 'cont', 'child', '[]')`,
		`SELECT fanout_split_range($1, 'split', 'cont', 'child', 10, 9)`,
		`SELECT fanout_split_range($1, 'split', 'cont', 'child', NULL, NULL)`,
		`SELECT fanout_split_bounds($1, 'split', 'cont', 'child', '{}')`,
		`SELECT fanout_split_bounds($1, 'split', 'cont', 'child',
		        fanout_count_bounds('SELECT 1 WHERE false', 0, 100))`,
	} {
		parent := faninParent(t, s, "split")
		var fid sql.NullInt64
		if err := s.DB.QueryRow(how, parent).Scan(&fid); err != nil {
			t.Fatalf("%s: %v", how, err)
		}
		if fid.Valid {
			t.Errorf("%s: returned group %d, want NULL", how, fid.Int64)
		}
		var stage, status string
		var wait sql.NullInt64
		if err := s.DB.QueryRow(`SELECT stage, status, wait_fanout_id FROM workqueue WHERE workqueue_id = $1`,
			parent).Scan(&stage, &status, &wait); err != nil {
			t.Fatal(err)
		}
		if stage != "cont" || status != "pending" || wait.Valid {
			t.Errorf("%s: parent at %s/%s waiting on %v, want cont/pending and no group", how, stage, status, wait)
		}
	}
	if n := s.count(t, `SELECT count(*) FROM fanout`); n != 0 {
		t.Errorf("%d groups created by empty splits", n)
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE fanout_id IS NOT NULL`); n != 0 {
		t.Errorf("%d children created by empty splits", n)
	}
	checkFaninInvariants(t, s)
}

// TestFaninSplitGuard: a split whose claim is gone (not running, or at another stage, or a
// duplicate execution after the first split committed) raises PF001 and writes nothing.
func TestFaninSplitGuard(t *testing.T) {
	s := newTestSchema(t)
	parent := faninParent(t, s, "split")
	s.exec(t, `UPDATE workqueue SET status = 'pending' WHERE workqueue_id = $1`, parent)
	other := faninParent(t, s, "elsewhere")
	for _, c := range []struct {
		id    int64
		query string
	}{
		{parent, `SELECT fanout_split($1, 'split', 'cont', 'child', '[1, 2]')`},
		{parent, `SELECT fanout_split($1, 'split', 'cont', 'child', '[]')`},
		{other, `SELECT fanout_split_range($1, 'split', 'cont', 'child', 1, 10, 10, 1)`},
		{other, `SELECT fanout_split_bounds($1, 'split', 'cont', 'child', '{}')`},
	} {
		_, err := s.DB.Exec(c.query, c.id)
		if faninSQLState(err) != "PF001" {
			t.Errorf("%s on %d: err %v, want SQLSTATE PF001", c.query, c.id, err)
		}
	}
	// A duplicate execution: the first split committed, the re-run finds the row waiting.
	dup := faninParent(t, s, "split")
	faninSplitPayloads(t, s.DB, dup, 2)
	if _, err := s.DB.Exec(`SELECT fanout_split($1, 'split', 'cont', 'child', '[1]')`, dup); faninSQLState(err) != "PF001" {
		t.Errorf("second split of %d: err %v, want PF001", dup, err)
	}
	// Bad arguments.
	for _, q := range []string{
		`SELECT fanout_split_bounds($1, 'split', 'cont', 'child', '{5,5}')`,
		`SELECT fanout_split_bounds($1, 'split', 'cont', 'child', '{1,NULL,9}')`,
		`SELECT fanout_split($1, 'split', 'cont', 'child', '{"a": 1}')`,
		`SELECT fanout_split_range($1, 'split', 'cont', 'child', 1, 10, 0, 1)`,
	} {
		p := faninParent(t, s, "split")
		if _, err := s.DB.Exec(q, p); faninSQLState(err) != "22023" {
			t.Errorf("%s: err %v, want SQLSTATE 22023", q, err)
		}
		if _, status := faninRowStatus(t, s, p); status != "running" {
			t.Errorf("%s: parent is %s after a refused split", q, status)
		}
	}
	if n := s.count(t, `SELECT count(*) FROM fanout`); n != 1 {
		t.Errorf("%d groups, want only the first split of %d", n, dup)
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE fanout_id IS NOT NULL`); n != 2 {
		t.Errorf("%d children, want 2", n)
	}
}

// --- T3, T4, T5: outcomes, retries, duplicates ------------------------------------------

func TestFaninMixedOutcomes(t *testing.T) {
	s := newTestSchema(t)
	parent, fid, kids := faninNewRangeGroup(t, s, 0, 999, 10, 100) // 10 slices of 100
	faninClaim(t, s, kids)
	failed := []int64{kids[2], kids[5], kids[9]}
	for _, id := range failed {
		faninFail(t, s, []int64{id}, fmt.Sprintf("exit status 3 on %d", id))
	}
	var rest []int64
	for _, id := range kids {
		if !slices.Contains(failed, id) {
			rest = append(rest, id)
		}
	}
	faninFinish(t, s, rest, "done")
	r := faninFlushAll(t, s, 10000)
	if r.ParentsWoken != 1 || r.Events != 4 { // three failure writes, one write of the other seven
		t.Fatalf("flush: %+v", r)
	}
	var gotFid int64
	var gen, expected, done, nfailed int
	var state string
	if err := s.DB.QueryRow(`SELECT * FROM fanin_result($1)`, parent).
		Scan(&gotFid, &gen, &state, &expected, &done, &nfailed); err != nil {
		t.Fatal(err)
	}
	if gotFid != fid || gen != 0 || state != "fired" || expected != 10 || done != 7 || nfailed != 3 {
		t.Fatalf("fanin_result: %d gen %d %s %d/%d of %d", gotFid, gen, state, done, nfailed, expected)
	}
	rows, err := s.DB.Query(`SELECT workqueue_id, fanout_seq, range_lo, range_hi, dispatch_error
	    FROM fanin_failed_children($1)`, parent)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var got []string
	for rows.Next() {
		var id, lo, hi int64
		var seq int
		var reason string
		if err := rows.Scan(&id, &seq, &lo, &hi, &reason); err != nil {
			t.Fatal(err)
		}
		got = append(got, fmt.Sprintf("%d:%d:[%d,%d):%s", id, seq, lo, hi, reason))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	var want []string
	for _, seq := range []int{2, 5, 9} {
		id := kids[seq]
		want = append(want, fmt.Sprintf("%d:%d:[%d,%d):exit status 3 on %d", id, seq, seq*100, seq*100+100, id))
	}
	if !slices.Equal(got, want) {
		t.Errorf("failed children:\n got %v\nwant %v", got, want)
	}
	// Paging the failed list.
	var page []int64
	if err := s.DB.QueryRow(`SELECT array_agg(workqueue_id ORDER BY fanout_seq)
	    FROM fanin_failed_children($1, 2, 1)`, parent).Scan(pq.Array(&page)); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(page, []int64{kids[5]}) {
		t.Errorf("failed page after seq 2, limit 1: %v, want [%d]", page, kids[5])
	}
	checkFaninInvariants(t, s)
}

func TestFaninRetries(t *testing.T) {
	s := newTestSchema(t)
	_, fid, kids := faninNewGroup(t, s, 5)
	for k := 0; k < 3; k++ {
		faninClaim(t, s, kids)
		s.exec(t, `UPDATE workqueue SET status = 'paused', attempts = attempts + 1,
		    retry_at = now() WHERE workqueue_id = ANY ($1) AND status = 'running'`, pq.Array(kids))
		s.exec(t, `UPDATE workqueue SET status = 'pending' WHERE workqueue_id = ANY ($1)
		    AND status = 'paused'`, pq.Array(kids))
	}
	if n := s.count(t, `SELECT count(*) FROM fanin_event`); n != 0 {
		t.Fatalf("retries wrote %d inbox rows", n)
	}
	faninClaim(t, s, kids)
	faninFinish(t, s, kids, "done")
	if n := s.count(t, `SELECT sum(d_done) FROM fanin_event WHERE d_failed = 0`); n != 5 {
		t.Fatalf("the inbox holds %d done children, want 5", n)
	}
	if r := faninFlushAll(t, s, 10000); r.ParentsWoken != 1 {
		t.Fatalf("flush: %+v", r)
	}
	if _, _, done, _ := faninGroup(t, s, fid); done != 5 {
		t.Errorf("done_n = %d, want 5", done)
	}
	checkFaninInvariants(t, s)
}

// TestFaninDuplicateTerminal is T5 at the SQL level: the stage committed 'done' and the
// worker died before its status line; the restarted dispatcher's reset of running rows and
// a re-run's guarded write leave the row alone, and an unguarded done -> done is no event.
func TestFaninDuplicateTerminal(t *testing.T) {
	s := newTestSchema(t)
	_, _, kids := faninClaimedGroup(t, s, 2)
	faninFinish(t, s, kids[:1], "done")
	// Dispatcher restart: orphaned running rows go back to pending (kids[1] only).
	s.exec(t, `UPDATE workqueue SET status = 'pending' WHERE status = 'running'`)
	// A duplicate execution of kids[0] writes again, guarded: nothing happens.
	faninFinish(t, s, kids[:1], "done")
	// An operator writes done over done.
	s.exec(t, `UPDATE workqueue SET status = 'done' WHERE workqueue_id = $1`, kids[0])
	if n := s.count(t, `SELECT count(*) FROM fanin_event WHERE child_id = $1`, kids[0]); n != 1 {
		t.Fatalf("%d events for child %d, want 1", n, kids[0])
	}
	faninClaim(t, s, kids[1:])
	faninFinish(t, s, kids[1:], "done")
	if r := faninFlushAll(t, s, 10000); r.ParentsWoken != 1 || r.Events != 2 {
		t.Fatalf("flush: %+v", r)
	}
	checkFaninInvariants(t, s)
}

// --- T8: concurrent last children -------------------------------------------------------

// TestFaninConcurrentLastChildren: 2 … 64 children, each on its own connection, commit
// 'done' at the same moment while the coordinator flushes in a loop: one wake.
func TestFaninConcurrentLastChildren(t *testing.T) {
	s := newTestSchema(t)
	ctx := context.Background()
	for _, n := range []int{2, 8, 64} {
		for round := 0; round < 3; round++ {
			parent, _, kids := faninClaimedGroup(t, s, n)

			// Each child updates in its own open transaction; all commit after a barrier.
			txs := make([]*sql.Tx, n)
			conns := make([]*sql.Conn, n)
			for i, id := range kids {
				c, err := s.DB.Conn(ctx)
				if err != nil {
					t.Fatal(err)
				}
				conns[i] = c
				tx, err := c.BeginTx(ctx, nil)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := tx.Exec(`UPDATE workqueue SET status = 'done'
				    WHERE workqueue_id = $1 AND status = 'running'`, id); err != nil {
					t.Fatal(err)
				}
				txs[i] = tx
			}
			stop := make(chan struct{})
			var flushed faninFlushResult
			var flushErr error
			var wg sync.WaitGroup
			wg.Add(1)
			go func() { // the coordinator: flush until the group fired
				defer wg.Done()
				for {
					// Stop after a flush that started once every child had committed
					// and found nothing left.
					stopped := false
					select {
					case <-stop:
						stopped = true
					default:
					}
					r, err := faninFlush(ctx, s.DB, 10000)
					if err != nil {
						flushErr = err
						return
					}
					flushed.add(r)
					if stopped && r.Events == 0 {
						return
					}
				}
			}()
			start := make(chan struct{})
			var commits sync.WaitGroup
			for i := range txs {
				commits.Add(1)
				go func(tx *sql.Tx) {
					defer commits.Done()
					<-start
					if err := tx.Commit(); err != nil {
						t.Errorf("commit: %v", err)
					}
				}(txs[i])
			}
			close(start)
			commits.Wait()
			close(stop)
			wg.Wait()
			for _, c := range conns {
				c.Close()
			}
			if flushErr != nil {
				t.Fatal(flushErr)
			}
			if flushed.ParentsWoken != 1 || flushed.GroupsFired != 1 || !slices.Equal(flushed.Woken, []int64{parent}) {
				t.Fatalf("n=%d round %d: flushes %+v, want exactly one wake of %d", n, round, flushed, parent)
			}
		}
	}
	checkFaninInvariants(t, s)
}

// --- T10: lost evidence, repaired by the sweep ------------------------------------------

// The recount reads the children through the primary key over the group's id range, so it
// runs with the range the split recorded ("exact"), with a range that also holds other rows,
// done and failed, of other groups and of none (what concurrent inserts during a split make:
// "wide"), and with no range at all (a group made by hand: "unknown").
func TestFaninLostEvidence(t *testing.T) {
	for _, how := range []string{"trigger disabled", "inbox row deleted"} {
		for _, bounds := range []string{"exact", "wide", "unknown"} {
			t.Run(strings.ReplaceAll(how, " ", "_")+"/"+bounds, func(t *testing.T) {
				testFaninLostEvidence(t, how, bounds)
			})
		}
	}
}

func testFaninLostEvidence(t *testing.T, how, bounds string) {
	s := newTestSchema(t)
	// Rows on both sides of the group: plain messages and a fired group's children,
	// all terminal, which a recount must not count.
	other := faninSplitPayloads(t, s.DB, faninParent(t, s, "split"), 2)
	s.exec(t, `INSERT INTO workqueue (stage, status) VALUES ('zz', 'done'), ('zz', 'failed')`)
	parent := faninParent(t, s, "split")
	fid := faninSplitPayloads(t, s.DB, parent, 3)
	s.exec(t, `INSERT INTO workqueue (stage, status) VALUES ('zz', 'done'), ('zz', 'failed')`)
	otherKids := faninChildren(t, s, other)
	faninClaim(t, s, otherKids)
	faninFinish(t, s, otherKids[:1], "done")
	faninFail(t, s, otherKids[1:], "other")
	if r := faninFlushAll(t, s, 10000); r.GroupsFired != 1 {
		t.Fatalf("the other group did not fire: %+v", r)
	}
	kids := faninChildren(t, s, fid)
	faninCheckIDRange(t, s, fid, kids)
	switch bounds {
	case "wide":
		s.exec(t, `UPDATE fanout SET child_lo = 0, child_hi = child_hi + 100 WHERE fanout_id = $1`, fid)
	case "unknown":
		s.exec(t, `UPDATE fanout SET child_lo = NULL, child_hi = NULL WHERE fanout_id = $1`, fid)
	}
	faninClaim(t, s, kids)
	faninFinish(t, s, kids[:2], "done")
	switch how {
	case "trigger disabled":
		faninWriteUnseen(t, s, kids[2], "failed")
	case "inbox row deleted":
		faninFail(t, s, kids[2:], "boom")
		s.exec(t, `DELETE FROM fanin_event WHERE child_id = $1`, kids[2])
	}
	if r := faninFlushAll(t, s, 10000); r.ParentsWoken != 0 {
		t.Fatalf("flush woke without the evidence: %+v", r)
	}
	if state, _, done, failed := faninGroup(t, s, fid); state != "open" || done != 2 || failed != 0 {
		t.Fatalf("group %s %d/%d before the sweep, want open 2/0", state, done, failed)
	}
	// Too young for the sweep: nothing examined.
	if r := faninSweepPass(t, s, 500, "1 hour"); r.Examined != 0 || r.Repaired != 0 {
		t.Fatalf("sweep of young groups: %+v", r)
	}
	r := faninSweepPass(t, s, 500, "0")
	if r.Repaired != 1 || r.ParentsWoken != 1 || !slices.Equal(r.Woken, []int64{parent}) {
		t.Fatalf("sweep: %+v, want repaired=1 and one wake", r)
	}
	if state, _, done, failed := faninGroup(t, s, fid); state != "fired" || done != 2 || failed != 1 {
		t.Fatalf("group %s %d/%d after the sweep, want fired 2/1", state, done, failed)
	}
	if r := faninSweepPass(t, s, 500, "0"); r.Repaired != 0 || r.ParentsWoken != 0 {
		t.Fatalf("second sweep: %+v", r)
	}
	if r := faninFlushAll(t, s, 10000); r.ParentsWoken != 0 {
		t.Fatalf("flush after the sweep: %+v", r)
	}
	checkFaninInvariants(t, s)
}

// TestFaninFireReady: counters corrected out of band (here by fanin_recount, as the sweep
// does) leave a complete open group; fanin_fire_ready fires it once.
func TestFaninFireReady(t *testing.T) {
	s := newTestSchema(t)
	_, fid, kids := faninClaimedGroup(t, s, 2)
	faninFinish(t, s, kids[:1], "done")
	faninFinish(t, s, kids[1:], "done") // a statement of its own: its inbox row names it
	s.exec(t, `DELETE FROM fanin_event WHERE child_id = $1`, kids[1])
	faninFlushAll(t, s, 10000)
	var repaired int
	if err := s.DB.QueryRow(`SELECT repaired FROM fanin_recount($1)`, pq.Array([]int64{fid})).Scan(&repaired); err != nil {
		t.Fatal(err)
	}
	if repaired != 1 {
		t.Fatalf("recount repaired %d", repaired)
	}
	var fired, woken int
	if err := s.DB.QueryRow(`SELECT groups_fired, parents_woken FROM fanin_fire_ready()`).Scan(&fired, &woken); err != nil {
		t.Fatal(err)
	}
	if fired != 1 || woken != 1 {
		t.Fatalf("fire_ready: fired %d woke %d", fired, woken)
	}
	if err := s.DB.QueryRow(`SELECT groups_fired, parents_woken FROM fanin_fire_ready()`).Scan(&fired, &woken); err != nil {
		t.Fatal(err)
	}
	if fired != 0 || woken != 0 {
		t.Fatalf("second fire_ready: fired %d woke %d", fired, woken)
	}
	checkFaninInvariants(t, s)
}

// --- T11, T12: requeues before and after the fire ---------------------------------------

func TestFaninRequeueBeforeFire(t *testing.T) {
	s := newTestSchema(t)
	_, fid, kids := faninClaimedGroup(t, s, 4)
	faninFinish(t, s, kids[:2], "done")
	faninFail(t, s, kids[2:3], "boom")
	faninFlushAll(t, s, 10000)
	if _, _, done, failed := faninGroup(t, s, fid); done != 2 || failed != 1 {
		t.Fatalf("%d/%d, want 2/1", done, failed)
	}
	// An operator requeues the failed child: -1.
	s.exec(t, `UPDATE workqueue SET status = 'pending' WHERE workqueue_id = $1`, kids[2])
	r := faninFlushAll(t, s, 10000)
	if state, _, done, failed := faninGroup(t, s, fid); state != "open" || done != 2 || failed != 0 {
		t.Fatalf("after the requeue: %s %d/%d, want open 2/0", state, done, failed)
	}
	if !slices.Equal(r.OpenRemaining, []int64{2}) {
		t.Fatalf("remaining %v, want [2]", r.OpenRemaining)
	}
	faninClaim(t, s, kids[2:3])
	faninFinish(t, s, kids[2:3], "done")
	if r := faninFlushAll(t, s, 10000); r.ParentsWoken != 0 {
		t.Fatalf("woke with a child still running: %+v", r)
	}
	faninFinish(t, s, kids[3:], "done")
	if r := faninFlushAll(t, s, 10000); r.ParentsWoken != 1 {
		t.Fatalf("last flush: %+v", r)
	}
	if _, _, done, failed := faninGroup(t, s, fid); done != 4 || failed != 0 {
		t.Fatalf("%d/%d, want 4/0", done, failed)
	}
	checkFaninInvariants(t, s)
}

func TestFaninLateEvents(t *testing.T) {
	s := newTestSchema(t)
	_, fid, kids := faninClaimedGroup(t, s, 2)
	faninFinish(t, s, kids, "done")
	if r := faninFlushAll(t, s, 10000); r.ParentsWoken != 1 {
		t.Fatalf("flush: %+v", r)
	}
	// Requeue a child after the fire and finish it again: two late events, no second wake.
	s.exec(t, `UPDATE workqueue SET status = 'pending' WHERE workqueue_id = $1`, kids[0])
	faninClaim(t, s, kids[:1])
	faninFinish(t, s, kids[:1], "done")
	r := faninFlushAll(t, s, 10000)
	if r.LateEvents != 2 || r.Events != 2 || r.ParentsWoken != 0 || r.GroupsUpdated != 0 {
		t.Fatalf("flush of late events: %+v, want 2 late events and nothing else", r)
	}
	if n := s.count(t, `SELECT count(*) FROM fanin_wake_log WHERE fanout_id = $1`, fid); n != 1 {
		t.Fatalf("%d wake-log rows", n)
	}
	checkFaninInvariants(t, s)
}

// --- T13, T14: delete; replica role -------------------------------------------------------

func TestFaninDeleteChild(t *testing.T) {
	s := newTestSchema(t)
	parent, fid, kids := faninNewGroup(t, s, 2)
	_, err := s.DB.Exec(`DELETE FROM workqueue WHERE workqueue_id = $1`, kids[0])
	if err == nil || !strings.Contains(err.Error(), "open fanout") {
		t.Fatalf("delete of a child of an open group: %v, want refused", err)
	}
	if _, err := s.DB.Exec(`UPDATE workqueue SET fanout_id = fanout_id + 1 WHERE workqueue_id = $1`, kids[0]); err == nil {
		t.Fatal("fanout_id of a child changed")
	}
	if _, err := s.DB.Exec(`UPDATE workqueue SET fanout_id = $1 WHERE workqueue_id = $2`, fid, parent); err == nil {
		t.Fatal("a row was adopted into a group")
	}
	faninClaim(t, s, kids)
	faninFinish(t, s, kids, "done")
	faninFlushAll(t, s, 10000)
	s.exec(t, `DELETE FROM workqueue WHERE fanout_id = $1`, fid)
	if n := s.count(t, `SELECT count(*) FROM fanin_event`); n != 0 {
		t.Errorf("deleting children of a fired group wrote %d events", n)
	}
	checkFaninInvariants(t, s)
}

func TestFaninReplicaRole(t *testing.T) {
	s := newTestSchema(t)
	ctx := context.Background()
	_, _, kids := faninClaimedGroup(t, s, 1)
	c, err := s.DB.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.ExecContext(ctx, `SET session_replication_role = replica`); err != nil {
		t.Fatal(err)
	}
	if _, err := c.ExecContext(ctx, `UPDATE workqueue SET status = 'done' WHERE workqueue_id = $1`, kids[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := c.ExecContext(ctx, `RESET session_replication_role`); err != nil {
		t.Fatal(err)
	}
	if n := s.count(t, `SELECT count(*) FROM fanin_event WHERE child_id = $1`, kids[0]); n != 1 {
		t.Fatalf("replica-role write produced %d events, want 1", n)
	}
	if r := faninFlushAll(t, s, 10000); r.ParentsWoken != 1 {
		t.Fatalf("flush: %+v", r)
	}
	checkFaninInvariants(t, s)
}

// TestFaninEvidenceRoles checks the evidence of updates in both replication roles: the
// statement trigger in the ordinary role and the row trigger in the replica role must record
// the same net change per group (+1 / -1 per child whose membership of {done} or {failed}
// changed, whatever else the statement touched); the statement trigger in one row per group
// and statement, naming the child when there is only one, the row trigger in one row per child.
func TestFaninEvidenceRoles(t *testing.T) {
	for _, role := range []string{"origin", "replica"} {
		t.Run(role, func(t *testing.T) {
			s := newTestSchema(t)
			ctx := context.Background()
			_, fa, a := faninNewGroup(t, s, 3)
			_, fb, b := faninNewGroup(t, s, 2)
			var plain int64
			if err := s.DB.QueryRow(`INSERT INTO workqueue (stage) VALUES ('child') RETURNING workqueue_id`).Scan(&plain); err != nil {
				t.Fatal(err)
			}
			c, err := s.DB.Conn(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if _, err := c.ExecContext(ctx, `SET session_replication_role = `+role); err != nil {
				t.Fatal(err)
			}
			type net struct{ dDone, dFailed int }
			// step runs query and checks the inbox rows it wrote: their sum per group, and the
			// children they name; with the row trigger every changed child is named, with the
			// statement trigger only a group's single changed child.
			step := func(what, query string, want map[int64]net, changed map[int64][]int64) {
				t.Helper()
				if _, err := c.ExecContext(ctx, query); err != nil {
					t.Fatalf("%s: %v", what, err)
				}
				got := map[int64]net{}
				var named []int64
				rs, err := s.DB.Query(`DELETE FROM fanin_event RETURNING fanout_id, child_id, d_done, d_failed`)
				if err != nil {
					t.Fatal(err)
				}
				for rs.Next() {
					var g int64
					var child sql.NullInt64
					var dd, df int
					if err := rs.Scan(&g, &child, &dd, &df); err != nil {
						t.Fatal(err)
					}
					got[g] = net{got[g].dDone + dd, got[g].dFailed + df}
					if child.Valid {
						named = append(named, child.Int64)
					}
				}
				if err := rs.Err(); err != nil {
					t.Fatal(err)
				}
				var wantNamed []int64
				for _, kids := range changed {
					if role == "replica" || len(kids) == 1 {
						wantNamed = append(wantNamed, kids...)
					}
				}
				slices.Sort(named)
				slices.Sort(wantNamed)
				if !maps.Equal(got, want) || !slices.Equal(named, wantNamed) {
					t.Errorf("%s: per group %v naming %v, want %v naming %v", what, got, named, want, wantNamed)
				}
			}
			none := map[int64]net{}
			all := fmt.Sprintf("(%d, %d, %d, %d, %d, %d)", a[0], a[1], a[2], b[0], b[1], plain)
			step("claim", `UPDATE workqueue SET status = 'running' WHERE workqueue_id IN `+all, none, nil)
			// Several children enter {done} and {failed} in one statement; cancelled counts as failed.
			step("terminal writes in one statement", fmt.Sprintf(`UPDATE workqueue SET status = CASE
			    WHEN workqueue_id IN (%d, %d, %d) THEN 'done' WHEN workqueue_id = %d THEN 'failed'
			    WHEN workqueue_id = %d THEN 'cancelled' ELSE status END WHERE workqueue_id IN %s`,
				a[0], a[1], plain, b[0], a[2], all),
				map[int64]net{fa: {2, 1}, fb: {0, 1}}, map[int64][]int64{fa: {a[0], a[1], a[2]}, fb: {b[0]}})
			step("done <-> failed", fmt.Sprintf(`UPDATE workqueue SET status = CASE status
			    WHEN 'done' THEN 'failed' ELSE 'done' END WHERE workqueue_id IN (%d, %d)`, a[0], b[0]),
				map[int64]net{fa: {-1, 1}, fb: {1, -1}}, map[int64][]int64{fa: {a[0]}, fb: {b[0]}})
			step("a duplicate terminal write", fmt.Sprintf(`UPDATE workqueue SET status = 'done' WHERE workqueue_id = %d`, a[1]), none, nil)
			step("other columns", fmt.Sprintf(`UPDATE workqueue SET state = '{"x": 1}' WHERE workqueue_id IN %s`, all), none, nil)
			step("requeue", fmt.Sprintf(`UPDATE workqueue SET status = 'pending' WHERE workqueue_id IN (%d, %d)`, a[0], a[1]),
				map[int64]net{fa: {-1, -1}}, map[int64][]int64{fa: {a[0], a[1]}})
			// One child enters and another leaves in one statement: the netting form; a plain
			// row finishing beside children entering: the one-grouping form, plain row ignored.
			step("enter and leave in one statement", fmt.Sprintf(`UPDATE workqueue SET status = CASE
			    WHEN workqueue_id = %d THEN 'done' ELSE 'pending' END WHERE workqueue_id IN (%d, %d)`, a[0], a[0], a[2]),
				map[int64]net{fa: {1, -1}}, map[int64][]int64{fa: {a[0], a[2]}})
			step("children enter beside a plain row's terminal write", fmt.Sprintf(`UPDATE workqueue SET status = 'failed'
			    WHERE workqueue_id IN (%d, %d, %d)`, a[1], a[2], plain),
				map[int64]net{fa: {0, 2}}, map[int64][]int64{fa: {a[1], a[2]}})
			_, err = c.ExecContext(ctx, fmt.Sprintf(`UPDATE workqueue SET fanout_id = %d WHERE workqueue_id = %d`, fb, a[2]))
			if err == nil || !strings.Contains(err.Error(), "immutable") {
				t.Errorf("moving a child to another group: %v, want the immutability error", err)
			}
		})
	}
}

// --- T15: nested fan-out ----------------------------------------------------------------

func TestFaninNested(t *testing.T) {
	s := newTestSchema(t)
	outer, fo, kids := faninNewGroup(t, s, 2)
	// kids[0] is itself a split stage: claimed at "split", it splits into two grandchildren.
	s.exec(t, `UPDATE workqueue SET stage = 'split' WHERE workqueue_id = $1`, kids[0])
	faninClaim(t, s, kids)
	fi := faninSplitPayloads(t, s.DB, kids[0], 2)
	grand := faninChildren(t, s, fi)
	faninFinish(t, s, kids[1:], "done")
	faninClaim(t, s, grand)
	faninFinish(t, s, grand, "done")
	r := faninFlushAll(t, s, 10000)
	if !slices.Equal(r.Woken, []int64{kids[0]}) {
		t.Fatalf("first flush woke %v, want the inner parent %d only", r.Woken, kids[0])
	}
	if _, _, done, _ := faninGroup(t, s, fo); done != 1 {
		t.Fatalf("outer group counts %d done, want 1 (the inner parent is not terminal yet)", done)
	}
	if stage, status := faninRowStatus(t, s, kids[0]); stage != "cont" || status != "pending" {
		t.Fatalf("inner parent at %s/%s", stage, status)
	}
	// Its continuation runs and ends: now the outer group completes.
	faninClaim(t, s, kids[:1])
	faninFinish(t, s, kids[:1], "done")
	r = faninFlushAll(t, s, 10000)
	if !slices.Equal(r.Woken, []int64{outer}) {
		t.Fatalf("second flush woke %v, want the outer parent %d", r.Woken, outer)
	}
	if n := s.count(t, `SELECT count(*) FROM fanin_wake_log`); n != 2 {
		t.Fatalf("%d wake-log rows, want 2", n)
	}
	checkFaninInvariants(t, s)
}

// --- T16: range-split properties --------------------------------------------------------

// faninSeed returns the seed of a randomized test: PEPSI_FANIN_SEED when set, else the clock.
func faninSeed(t *testing.T) uint64 {
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("PEPSI_FANIN_SEED"); v != "" {
		var err error
		if seed, err = strconv.ParseUint(v, 10, 64); err != nil {
			t.Fatalf("PEPSI_FANIN_SEED=%q: %v", v, err)
		}
	}
	t.Logf("seed %d (replay with PEPSI_FANIN_SEED=%d)", seed, seed)
	return seed
}

// faninCheckBounds checks the split properties of bounds for [lo, hi]: contiguous, non-overlapping,
// exact cover, no empty slice, and at most maxChildren slices.
func faninCheckBounds(lo, hi int64, maxChildren int, b []sql.NullInt64) error {
	if lo > hi {
		if len(b) != 0 {
			return fmt.Errorf("empty range gave %d bounds", len(b))
		}
		return nil
	}
	if len(b) < 2 {
		return fmt.Errorf("%d bounds", len(b))
	}
	if n := len(b) - 1; n > maxChildren {
		return fmt.Errorf("%d slices > max %d", n, maxChildren)
	}
	if !b[0].Valid || b[0].Int64 != lo {
		return fmt.Errorf("first bound %v, want %d", b[0], lo)
	}
	last := b[len(b)-1]
	if hi == math.MaxInt64 {
		if last.Valid {
			return fmt.Errorf("last bound %d, want NULL for hi = int8 max", last.Int64)
		}
	} else if !last.Valid || last.Int64 != hi+1 {
		return fmt.Errorf("last bound %v, want %d", last, hi+1)
	}
	for i := 0; i+1 < len(b); i++ {
		if !b[i].Valid {
			return fmt.Errorf("bound %d is NULL", i)
		}
		if b[i+1].Valid && b[i+1].Int64 <= b[i].Int64 {
			return fmt.Errorf("slice %d is [%d, %d): empty or backwards", i, b[i].Int64, b[i+1].Int64)
		}
	}
	return nil
}

// faninBoundWidths returns the widths of the slices (the last one up to hi inclusive).
func faninBoundWidths(hi int64, b []sql.NullInt64) []*big.Int {
	var w []*big.Int
	for i := 0; i+1 < len(b); i++ {
		end := big.NewInt(hi)
		end.Add(end, big.NewInt(1))
		if b[i+1].Valid {
			end = big.NewInt(b[i+1].Int64)
		}
		w = append(w, end.Sub(end, big.NewInt(b[i].Int64)))
	}
	return w
}

func faninRangeBounds(t testing.TB, s *testSchema, lo, hi int64, maxChildren int, minSpan int64) []sql.NullInt64 {
	t.Helper()
	var b []sql.NullInt64
	if err := s.DB.QueryRow(`SELECT fanout_range_bounds($1, $2, $3, $4)`, lo, hi, maxChildren, minSpan).
		Scan(pq.Array(&b)); err != nil {
		t.Fatalf("fanout_range_bounds(%d, %d, %d, %d): %v", lo, hi, maxChildren, minSpan, err)
	}
	return b
}

func TestFaninRangeSplitProperties(t *testing.T) {
	s := newTestSchema(t)
	rng := rand.New(rand.NewPCG(faninSeed(t), 0x5eed))
	type tc struct {
		lo, hi  int64
		maxc    int
		minSpan int64
	}
	cases := []tc{
		{0, 0, 1, 1}, {5, 5, 10, 1000}, {-10, -1, 3, 1}, {-5, 5, 100, 1},
		{1, 100001, 64, 1000}, {1, 10, 100, 1}, {1, 10, 3, 1}, {1, 10, 100, 3},
		{math.MaxInt64, math.MaxInt64, 4, 1}, {math.MaxInt64 - 10, math.MaxInt64, 4, 1},
		{math.MinInt64, math.MinInt64 + 10, 4, 1}, {math.MinInt64, math.MaxInt64, 7, 1},
		{math.MinInt64, math.MaxInt64, 10000, math.MaxInt64}, {0, math.MaxInt64, 3, 1},
		{10, 9, 5, 1}, {math.MaxInt64, math.MinInt64, 5, 1},
	}
	randInt := func() int64 {
		switch rng.IntN(4) {
		case 0:
			return rng.Int64N(2000) - 1000
		case 1:
			return int64(rng.Uint64())
		case 2:
			return math.MaxInt64 - rng.Int64N(1000)
		default:
			return math.MinInt64 + rng.Int64N(1000)
		}
	}
	for i := 0; i < 400; i++ {
		lo, hi := randInt(), randInt()
		if rng.IntN(10) > 0 && lo > hi {
			lo, hi = hi, lo
		}
		minSpan := int64(1) << rng.IntN(63)
		if rng.IntN(2) == 0 {
			minSpan = 1 + rng.Int64N(100)
		}
		cases = append(cases, tc{lo, hi, 1 + rng.IntN(200), minSpan})
	}
	for _, c := range cases {
		b := faninRangeBounds(t, s, c.lo, c.hi, c.maxc, c.minSpan)
		if err := faninCheckBounds(c.lo, c.hi, c.maxc, b); err != nil {
			t.Fatalf("fanout_range_bounds(%d, %d, %d, %d) = %v: %v", c.lo, c.hi, c.maxc, c.minSpan, b, err)
		}
		if c.lo > c.hi {
			continue
		}
		// Equal width: widths differ by at most one, each >= min_span unless there is one
		// slice, and N = min(max_children, max(1, floor(width / min_span))).
		ws := faninBoundWidths(c.hi, b)
		width := new(big.Int).Sub(big.NewInt(c.hi), big.NewInt(c.lo))
		width.Add(width, big.NewInt(1))
		wantN := new(big.Int).Div(width, big.NewInt(c.minSpan))
		if wantN.Cmp(big.NewInt(1)) < 0 {
			wantN.SetInt64(1)
		}
		if wantN.Cmp(big.NewInt(int64(c.maxc))) > 0 {
			wantN.SetInt64(int64(c.maxc))
		}
		if int64(len(ws)) != wantN.Int64() {
			t.Fatalf("%+v: %d slices, want %d", c, len(ws), wantN.Int64())
		}
		minW, maxW := ws[0], ws[0]
		for _, w := range ws {
			if w.Cmp(minW) < 0 {
				minW = w
			}
			if w.Cmp(maxW) > 0 {
				maxW = w
			}
		}
		if new(big.Int).Sub(maxW, minW).Cmp(big.NewInt(1)) > 0 {
			t.Fatalf("%+v: widths from %v to %v", c, minW, maxW)
		}
		if len(ws) > 1 && minW.Cmp(big.NewInt(c.minSpan)) < 0 {
			t.Fatalf("%+v: a slice of %v < min_span", c, minW)
		}
	}

	// Through real splits: the children's slices are the bounds, and every id of [lo, hi]
	// (sampled, plus the edges) lies in exactly one child; ids outside lie in none.
	for i := 0; i < 20; i++ {
		c := cases[rng.IntN(len(cases))]
		if i < 4 {
			c = cases[[]int{1, 8, 11, 13}[i]]
		}
		parent := faninParent(t, s, "split")
		fid := faninSplitRange(t, s.DB, parent, c.lo, c.hi, c.maxc, c.minSpan)
		if c.lo > c.hi {
			continue
		}
		points := []int64{c.lo, c.hi}
		for k := 0; k < 20; k++ {
			span := uint64(c.hi-c.lo) + 1 // two's complement: right even when hi-lo overflows
			off := rng.Uint64()
			if span != 0 { // 0: the whole int8 range
				off = rng.Uint64N(span)
			}
			points = append(points, c.lo+int64(off))
		}
		if c.lo > math.MinInt64 {
			points = append(points, c.lo-1)
		}
		if c.hi < math.MaxInt64 {
			points = append(points, c.hi+1)
		}
		for _, x := range points {
			in := s.count(t, `SELECT count(*) FROM workqueue WHERE fanout_id = $1
			    AND range_lo <= $2 AND (range_hi IS NULL OR $2 < range_hi)`, fid, x)
			want := 0
			if c.lo <= x && x <= c.hi {
				want = 1
			}
			if in != want {
				t.Fatalf("%+v: id %d is in %d slices, want %d", c, x, in, want)
			}
		}
	}

	// Equal count over skewed ids: every slice holds rows, counts are balanced (unique ids),
	// the cover is exact.
	s.exec(t, `CREATE TABLE skewed (id bigint NOT NULL)`)
	for round := 0; round < 30; round++ {
		s.exec(t, `TRUNCATE skewed`)
		var ids []int64
		nrows := 1 + rng.IntN(3000)
		dups := round%3 == 2
		seen := map[int64]bool{}
		for len(ids) < nrows {
			var id int64
			switch rng.IntN(3) {
			case 0: // dense cluster
				id = rng.Int64N(int64(nrows))
			case 1: // sparse, huge
				id = int64(rng.Uint64() >> rng.IntN(64))
			default: // near the int8 edges
				if rng.IntN(2) == 0 {
					id = math.MaxInt64 - rng.Int64N(100)
				} else {
					id = math.MinInt64 + rng.Int64N(100)
				}
			}
			if seen[id] && !dups {
				continue
			}
			seen[id] = true
			ids = append(ids, id)
		}
		sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
		if _, err := s.DB.Exec(`INSERT INTO skewed SELECT unnest($1::bigint[])`, pq.Array(ids)); err != nil {
			t.Fatal(err)
		}
		lo, hi := ids[0], ids[len(ids)-1]
		switch rng.IntN(3) {
		case 0: // the whole int8 range
			lo, hi = math.MinInt64, math.MaxInt64
		case 1: // a sub-range: the ids outside it are not the group's
			a, b := ids[rng.IntN(len(ids))], ids[rng.IntN(len(ids))]
			lo, hi = min(a, b), max(a, b)
		}
		var in []int64
		for _, id := range ids {
			if lo <= id && id <= hi {
				in = append(in, id)
			}
		}
		maxc, minSpan := 1+rng.IntN(100), int64(1+rng.IntN(50))
		var b []sql.NullInt64
		if err := s.DB.QueryRow(`SELECT fanout_count_bounds('SELECT id FROM skewed', $1, $2, $3, $4)`,
			lo, hi, maxc, minSpan).Scan(pq.Array(&b)); err != nil {
			t.Fatal(err)
		}
		if len(in) > 0 {
			if err := faninCheckBounds(lo, hi, maxc, b); err != nil {
				t.Fatalf("round %d (%d rows, [%d, %d], %d, %d): %v: %v", round, nrows, lo, hi, maxc, minSpan, b, err)
			}
		}
		if len(in) == 0 {
			if len(b) != 0 {
				t.Fatalf("round %d: no ids in [%d, %d] but bounds %v", round, lo, hi, b)
			}
			continue
		}
		counts := make([]int, len(b)-1)
		for _, id := range in {
			k := sort.Search(len(b)-1, func(k int) bool { return !b[k+1].Valid || id < b[k+1].Int64 })
			counts[k]++
		}
		wantN := min(maxc, max(1, len(in)/int(minSpan)))
		lowest, highest := slices.Min(counts), slices.Max(counts)
		if lowest == 0 {
			t.Fatalf("round %d: an empty slice: counts %v bounds %v", round, counts, b)
		}
		if !dups && (len(counts) != wantN || highest-lowest > 1) {
			t.Fatalf("round %d: %d rows, counts %v, want %d balanced slices", round, len(in), counts, wantN)
		}
		if dups && len(counts) > wantN {
			t.Fatalf("round %d: %d slices > %d", round, len(counts), wantN)
		}
	}
}

// --- T18, T21: sweep and flushes concurrent with completions ----------------------------

// faninLoad makes groups of children and completes them from several goroutines, each child
// in its own transaction, as workers do.
type faninLoad struct {
	parents []int64
	kids    []int64
}

func newFaninLoad(t *testing.T, s *testSchema, groups, perGroup int) *faninLoad {
	l := &faninLoad{}
	for g := 0; g < groups; g++ {
		p, _, kids := faninNewGroup(t, s, perGroup)
		l.parents = append(l.parents, p)
		l.kids = append(l.kids, kids...)
	}
	faninClaim(t, s, l.kids)
	rand.Shuffle(len(l.kids), func(i, j int) { l.kids[i], l.kids[j] = l.kids[j], l.kids[i] })
	return l
}

// complete finishes every child using workers goroutines (some failed), then returns.
func (l *faninLoad) complete(t *testing.T, s *testSchema, workers int) {
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := w; i < len(l.kids); i += workers {
				status := "done"
				if l.kids[i]%7 == 0 {
					status = "failed"
				}
				if _, err := s.DB.Exec(`UPDATE workqueue SET status = $2
				    WHERE workqueue_id = $1 AND status = 'running'`, l.kids[i], status); err != nil {
					t.Errorf("finish %d: %v", l.kids[i], err)
					return
				}
			}
		}(w)
	}
	wg.Wait()
}

// faninRetryable tells the errors a coordinator's retry helper re-runs: serialization failure
// and deadlock (two flushes updating the same groups in different orders, T21 only).
func faninRetryable(err error) bool {
	c := faninSQLState(err)
	return c == "40001" || c == "40P01"
}

func TestFaninSweepConcurrent(t *testing.T) {
	s := newTestSchema(t)
	ctx := context.Background()
	l := newFaninLoad(t, s, 40, 50)
	done := make(chan struct{})
	var mu sync.Mutex // guards repaired, woken
	repaired := 0
	var woken []int64
	var wg sync.WaitGroup
	// The coordinator: flush, then one sweep page, in a tight loop.
	wg.Add(1)
	go func() {
		defer wg.Done()
		var after int64
		for {
			select {
			case <-done:
				return
			default:
			}
			r, err := faninFlush(ctx, s.DB, 200)
			if faninRetryable(err) {
				continue
			} else if err != nil {
				t.Errorf("flush: %v", err)
				return
			}
			sw, err := faninSweep(ctx, s.DB, after, 7, "0")
			if faninRetryable(err) {
				continue
			} else if err != nil {
				t.Errorf("sweep: %v", err)
				return
			}
			after = sw.NextAfter
			mu.Lock()
			repaired += sw.Repaired + sw.OrphansWoken
			woken = append(woken, r.Woken...)
			woken = append(woken, sw.Woken...)
			mu.Unlock()
		}
	}()
	// A second sweeper, concurrent with the flushes: the lock-then-read recount must not
	// "repair" a group a flush is applying.
	wg.Add(1)
	go func() {
		defer wg.Done()
		var after int64
		for {
			select {
			case <-done:
				return
			default:
			}
			sw, err := faninSweep(ctx, s.DB, after, 11, "0")
			if faninRetryable(err) {
				continue
			} else if err != nil {
				t.Errorf("sweep: %v", err)
				return
			}
			after = sw.NextAfter
			mu.Lock()
			repaired += sw.Repaired + sw.OrphansWoken
			woken = append(woken, sw.Woken...)
			mu.Unlock()
		}
	}()
	l.complete(t, s, 8)
	close(done)
	wg.Wait()
	r := faninFlushAll(t, s, 10000)
	woken = append(woken, r.Woken...)
	sw := faninSweepPass(t, s, 500, "0")
	repaired += sw.Repaired
	woken = append(woken, sw.Woken...)
	if repaired != 0 {
		t.Errorf("the sweep repaired %d groups while children committed: want 0", repaired)
	}
	slices.Sort(woken)
	want := slices.Clone(l.parents)
	slices.Sort(want)
	if !slices.Equal(woken, want) {
		t.Errorf("woken parents %v, want each of %v once", woken, want)
	}
	checkFaninInvariants(t, s)
}

func TestFaninConcurrentFlushes(t *testing.T) {
	s := newTestSchema(t)
	ctx := context.Background()
	l := newFaninLoad(t, s, 30, 40)
	done := make(chan struct{})
	var mu sync.Mutex // guards woken, retries
	var woken []int64
	retries := 0
	var wg sync.WaitGroup
	for f := 0; f < 2; f++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				stopped := false
				select {
				case <-done:
					stopped = true
				default:
				}
				r, err := faninFlush(ctx, s.DB, 100)
				switch {
				case faninRetryable(err):
					mu.Lock()
					retries++
					mu.Unlock()
					continue
				case err != nil:
					t.Errorf("flush: %v", err)
					return
				}
				if r.Quarantined != 0 {
					t.Errorf("a concurrent flush quarantined %v", r.QuarantinedIDs)
				}
				mu.Lock()
				woken = append(woken, r.Woken...)
				mu.Unlock()
				if stopped && r.Events == 0 {
					return
				}
			}
		}()
	}
	l.complete(t, s, 8)
	close(done)
	wg.Wait()
	t.Logf("T21: %d flushes retried after a deadlock or serialization failure", retries)
	slices.Sort(woken)
	want := slices.Clone(l.parents)
	slices.Sort(want)
	if !slices.Equal(woken, want) {
		t.Errorf("woken parents %v, want each of %v exactly once", woken, want)
	}
	checkFaninInvariants(t, s)
}

// TestFaninFlushPassesHeldGroups: a flush passes over a group whose rows another transaction
// holds (its fanout row; the parent's row of a group the batch completes) instead of waiting,
// applies the other groups, and says how many it passed over; the held groups' events stay in
// the inbox and are applied, once, when let go. The held group's events come first and fill
// the batch, which must not keep the groups behind them waiting.
func TestFaninFlushPassesHeldGroups(t *testing.T) {
	s := newTestSchema(t)
	_, fidA, kidsA := faninClaimedGroup(t, s, 3)
	parentB, fidB, kidsB := faninClaimedGroup(t, s, 2)
	parentC, fidC, kidsC := faninClaimedGroup(t, s, 2)
	for _, k := range kidsA {
		faninFinish(t, s, []int64{k}, "done") // three inbox rows of A, first in the inbox
	}
	faninFinish(t, s, kidsB, "done")
	faninFinish(t, s, kidsC, "done")
	letGoA := faninHold(t, s, `SELECT 1 FROM fanout WHERE fanout_id = $1 FOR UPDATE`, fidA)
	letGoC := faninHold(t, s, `SELECT 1 FROM workqueue WHERE workqueue_id = $1 FOR UPDATE`, parentC)
	flush := func(batch int) faninFlushResult {
		t.Helper()
		r, _ := faninFlushBounded(t, s, batch, false)
		return r
	}

	r := flush(2)
	if r.Events != 1 || r.GroupsFired != 1 || !slices.Equal(r.Woken, []int64{parentB}) || r.Held != 2 {
		t.Fatalf("flush with A and C held: %+v; want B's one event applied and B fired, 2 groups held", r)
	}
	if n := s.count(t, `SELECT count(*) FROM fanin_event WHERE fanout_id IN ($1, $2)`, fidA, fidC); n != 4 {
		t.Fatalf("%d inbox rows of the held groups, want 4 (3 of A, 1 of C)", n)
	}
	for _, g := range []int64{fidA, fidC} {
		if state, _, done, _ := faninGroup(t, s, g); state != "open" || done != 0 {
			t.Fatalf("held group %d is %s with %d done, want open with nothing applied", g, state, done)
		}
	}
	if state, _, done, _ := faninGroup(t, s, fidB); state != "fired" || done != 2 {
		t.Fatalf("group B is %s with %d done, want fired with 2", state, done)
	}

	letGoA()
	r = flush(2)
	if r.Events != 2 || r.Held != 0 || r.GroupsFired != 0 {
		t.Fatalf("flush after A let go: %+v; want A's first two events applied (C's is past the batch)", r)
	}
	r = flush(2)
	if r.Events != 1 || r.Held != 1 || r.GroupsFired != 1 {
		t.Fatalf("next flush with C held: %+v; want A's last event applied and A fired, C held", r)
	}
	letGoC()
	r = flush(2)
	if r.Events != 1 || r.Held != 0 || !slices.Equal(r.Woken, []int64{parentC}) {
		t.Fatalf("flush after C let go: %+v; want C's event applied and its parent woken", r)
	}
	if r := flush(2); r.Events != 0 || r.Held != 0 {
		t.Fatalf("a re-flush did something: %+v", r)
	}
	faninExpectFired(t, s, 3)
}

// TestFaninFlushRefusedGroup: the database refuses the wake of two groups' parents by itself,
// one through an application's trigger (a raised exception), the other through its CHECK
// constraint on workqueue (a check_violation, which is not the flush's own tripwire). The flush
// applies the other groups and wakes their parents, leaves the refused groups' events in the
// inbox, unapplied, and names the groups; passed over, they are left unread; once the rules are
// gone, they are applied and their parents woken, once each. Before, the whole batch failed,
// at every flush: one parent an application would not let wake stopped every wake. With a
// batch that the refused events fill, the dispatcher's flush goes on past them (runFlush) to
// the groups behind.
func TestFaninFlushRefusedGroup(t *testing.T) {
	s := newTestSchema(t)
	parentB, fidB, kidsB := faninClaimedGroup(t, s, 2)
	parentA, _, kidsA := faninClaimedGroup(t, s, 2)
	parentD, fidD, kidsD := faninClaimedGroup(t, s, 3)
	parentC, _, kidsC := faninClaimedGroup(t, s, 1)
	for _, kids := range [][]int64{kidsB, kidsA, kidsD, kidsC} { // B's events first in the inbox
		for _, k := range kids {
			faninFinish(t, s, []int64{k}, "done") // a statement, and an inbox row, each
		}
	}
	refusals, dropTrigger := appRefuses(t, s, "status",
		fmt.Sprintf(`OLD.workqueue_id = %d AND NEW.status = 'pending'`, parentB))
	s.exec(t, fmt.Sprintf(`ALTER TABLE workqueue ADD CONSTRAINT app_no_wake
	    CHECK (workqueue_id <> %d OR status <> 'pending') NOT VALID`, parentD))
	flushOnly := func(batch int, pass, only []int64) faninFlushResult {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		r, err := faninFlushPass(ctx, s.DB, batch, false, pass, only)
		if err != nil {
			t.Fatalf("a flush with B's and D's wakes refused: %v", err)
		}
		return r
	}
	flush := func(batch int, pass ...int64) faninFlushResult { return flushOnly(batch, pass, nil) }
	inboxOf := func(fid int64) int {
		return s.count(t, `SELECT count(*) FROM fanin_event WHERE fanout_id = $1`, fid)
	}

	r := flush(100)
	if r.Events != 3 || r.GroupsFired != 2 || !slices.Equal(r.Woken, []int64{parentA, parentC}) ||
		!slices.Equal(r.RefusedIDs, []int64{fidB, fidD}) || r.RefusedEvents != 5 || r.Quarantined != 0 {
		t.Fatalf("flush with B's and D's wakes refused: %+v; want A and C applied and woken, B and D refused with 5 events", r)
	}
	if !strings.Contains(r.RefusedReason.String, fmt.Sprintf("refuses to update message %d", parentB)) {
		t.Errorf("refused_reason %q does not say the application's refusal of B's parent", r.RefusedReason.String)
	}
	if refusals() == 0 {
		t.Fatal("the application's trigger never ran")
	}
	for fid, n := range map[int64]int{fidB: 2, fidD: 3} {
		if got := inboxOf(fid); got != n {
			t.Errorf("group %d has %d inbox rows after its refusal, want its %d kept", fid, got, n)
		}
		if state, _, done, _ := faninGroup(t, s, fid); state != "open" || done != 0 {
			t.Errorf("refused group %d is %s with %d done, want open with nothing applied", fid, state, done)
		}
	}
	for _, p := range []int64{parentB, parentD} {
		if _, st := faninRowStatus(t, s, p); st != "waiting" {
			t.Errorf("parent %d of a refused group is %s, want waiting", p, st)
		}
	}
	if r := flush(100, fidB, fidD); r.Events != 0 || len(r.RefusedIDs) != 0 || r.RefusedEvents != 0 {
		t.Fatalf("a flush passing B and D over: %+v; want nothing read", r)
	}
	// Tried again alone, as the dispatcher does each second: only B's events are read, and a
	// group F behind them is left to the flushes that pass B over.
	_, fidF, kidsF := faninClaimedGroup(t, s, 1)
	faninFinish(t, s, kidsF, "done")
	if r := flushOnly(100, nil, []int64{fidB}); r.Events != 0 || !slices.Equal(r.RefusedIDs, []int64{fidB}) ||
		r.RefusedEvents != 2 || inboxOf(fidF) != 1 {
		t.Fatalf("a flush of B alone: %+v, F's inbox rows %d; want B refused again with its 2 events, F untouched", r, inboxOf(fidF))
	}

	// The dispatcher's flush with a batch of 2: B's two events fill the first, D's three the
	// second and part of the third; it goes on past them, passing each group over once refused.
	parentE, _, kidsE := faninClaimedGroup(t, s, 1)
	faninFinish(t, s, kidsE, "done")
	cfg := DispatchConfig{FaninBatch: 2, FaninMaxDelay: faninMaxDelayDefault, FaninMinHints: faninMinHintsDefault}
	ev := newFanin(cfg, &faninCounters{}).runFlush(context.Background(), s.DB, false, nil, nil)
	var refused []int64
	for _, r := range ev.results {
		refused = append(refused, r.refusedIDs...)
	}
	if ev.err != nil || !slices.Equal(refused, []int64{fidB, fidD}) {
		t.Fatalf("runFlush with a batch of 2: err %v, refused %v; want B and D refused, one statement each", ev.err, refused)
	}
	if _, st := faninRowStatus(t, s, parentE); st != "pending" {
		t.Fatalf("parent %d behind the refused groups' events is %s after the flush, want pending (statements: %+v)",
			parentE, st, ev.results)
	}
	// D's first two events came in a batch without its last: they complete nothing, so they
	// were applied; its last, which completes it, is the one refused.
	if state, _, done, _ := faninGroup(t, s, fidD); state != "open" || done != 2 || inboxOf(fidD) != 1 {
		t.Fatalf("group D is %s with %d done and %d inbox rows, want open with 2 applied and its last kept",
			state, done, inboxOf(fidD))
	}

	dropTrigger()
	s.exec(t, `ALTER TABLE workqueue DROP CONSTRAINT app_no_wake`)
	if r := flush(100); r.Events != 3 || !slices.Equal(r.Woken, []int64{parentB, parentD}) || len(r.RefusedIDs) != 0 {
		t.Fatalf("flush after the rules are gone: %+v; want B's 2 and D's last event applied and both parents woken", r)
	}
	if r := flush(100); r.Events != 0 {
		t.Fatalf("a re-flush did something: %+v", r)
	}
	faninExpectFired(t, s, 6)
}

// TestFaninFlushLockFirst: fanin_flush(batch, true), what the dispatcher asks for while its last
// flush passed groups over, applies the same batch as the default but locks its rows first:
// it passes the held groups over without the 100 ms the default waits for a held row (a group
// held for minutes cost every flush that wait before), and with nothing held it applies the
// whole batch as the default does.
func TestFaninFlushLockFirst(t *testing.T) {
	s := newTestSchema(t)
	_, fidA, kidsA := faninClaimedGroup(t, s, 2)
	parentB, _, kidsB := faninClaimedGroup(t, s, 2)
	parentC, fidC, kidsC := faninClaimedGroup(t, s, 2)
	faninFinish(t, s, kidsA[:1], "done")
	faninFinish(t, s, kidsB, "done")
	faninFinish(t, s, kidsC[:1], "done")
	letGoA := faninHold(t, s, `SELECT 1 FROM fanout WHERE fanout_id = $1 FOR UPDATE`, fidA)
	flush := func(lockFirst bool) (faninFlushResult, time.Duration) {
		t.Helper()
		return faninFlushBounded(t, s, 100, lockFirst)
	}

	// The default waits its lock_timeout for A's row once, then passes A over: the wait this
	// test's lock-first flush must not have.
	r, took := flush(false)
	if r.Held != 1 || !slices.Equal(r.Woken, []int64{parentB}) {
		t.Fatalf("default flush with A held: %+v; want B woken, A held", r)
	}
	if took < 100*time.Millisecond {
		t.Fatalf("the default flush took %v with a row held; its lock_timeout is 100ms (the test's premise)", took)
	}
	faninFinish(t, s, kidsA[1:], "done")
	faninFinish(t, s, kidsC[1:], "done")
	r, took = flush(true)
	if r.Held != 1 || r.Events != 1 || !slices.Equal(r.Woken, []int64{parentC}) {
		t.Fatalf("lock-first flush with A held: %+v; want C's event applied and C woken, A held", r)
	}
	if took >= 100*time.Millisecond {
		t.Errorf("the lock-first flush took %v: it waited for A's held row", took)
	}
	if n := s.count(t, `SELECT count(*) FROM fanin_event WHERE fanout_id = $1`, fidA); n != 2 {
		t.Fatalf("%d inbox rows of held A, want 2", n)
	}
	if state, _, done, _ := faninGroup(t, s, fidC); state != "fired" || done != 2 {
		t.Fatalf("group C is %s with %d done, want fired with 2", state, done)
	}

	letGoA()
	r, _ = flush(true)
	if r.Held != 0 || r.Events != 2 || r.GroupsFired != 1 {
		t.Fatalf("lock-first flush after A let go: %+v; want A's two events applied and A fired", r)
	}
	if r, _ := flush(true); r.Events != 0 || r.Held != 0 {
		t.Fatalf("a re-flush did something: %+v", r)
	}
	faninExpectFired(t, s, 3)
}

// TestFaninFireReadyPassesHeld: fanin_fire_ready fires the complete groups whose rows it can
// lock and passes over, and counts, those of which another transaction holds a row (A's fanout
// row, B's parent), without waiting for them; once let go, a second call fires them, each once.
func TestFaninFireReadyPassesHeld(t *testing.T) {
	s := newTestSchema(t)
	_, fidA := faninHandGroup(t, s, 2, handApplied)
	parentB, _ := faninHandGroup(t, s, 3, handApplied)
	parentC, _ := faninHandGroup(t, s, 1, handApplied)
	letGoA := faninHold(t, s, `SELECT 1 FROM fanout WHERE fanout_id = $1 FOR UPDATE`, fidA)
	letGoB := faninHold(t, s, `SELECT 1 FROM workqueue WHERE workqueue_id = $1 FOR UPDATE`, parentB)
	fire := func() (fired, held int, woken []int64) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := s.DB.QueryRowContext(ctx, `SELECT groups_fired, held, woken FROM fanin_fire_ready()`).
			Scan(&fired, &held, pq.Array(&woken)); err != nil {
			t.Fatalf("fanin_fire_ready with rows held: %v", err)
		}
		return fired, held, woken
	}
	if fired, held, woken := fire(); fired != 1 || held != 2 || !slices.Equal(woken, []int64{parentC}) {
		t.Fatalf("fire_ready with A and B held: %d fired, %d held, woken %v; want C alone fired and woken, 2 held", fired, held, woken)
	}
	letGoA()
	letGoB()
	if fired, held, _ := fire(); fired != 2 || held != 0 {
		t.Fatalf("fire_ready after the rows were let go: %d fired, %d held; want A and B fired", fired, held)
	}
	if fired, held, _ := fire(); fired != 0 || held != 0 {
		t.Fatalf("a third fire_ready: %d fired, %d held; want nothing", fired, held)
	}
	faninExpectFired(t, s, 3)
}

// TestFaninFireRefusedGroup: three complete groups wait to be fired (their events applied, as
// after a crash between a flush and its fire), and the database refuses the wake of one
// group's parent by itself (an application's trigger), and of one orphan waiter. The start's
// fanin_fire_ready fires the two others and counts the one refused; a sweep pass wakes the
// other orphan, goes through its page to the end and leaves the refused group open and both
// refused parents waiting; once the rule is gone, the next pass fires the group and wakes the
// orphan, once each. Before, one refused wake failed fire_ready whole, and the sweep's page
// at every pass, so the sweep never went past it.
func TestFaninFireRefusedGroup(t *testing.T) {
	s := newTestSchema(t)
	parentA, _ := faninHandGroup(t, s, 2, handApplied)
	parentB, fidB := faninHandGroup(t, s, 3, handApplied)
	parentC, _ := faninHandGroup(t, s, 1, handApplied)
	orphan := faninParent(t, s, "split")
	refusedOrphan := faninParent(t, s, "split")
	s.exec(t, `UPDATE workqueue SET status = 'waiting', stage = 'join', wait_fanout_id = 424242
	    WHERE workqueue_id = ANY ($1)`, pq.Array([]int64{orphan, refusedOrphan}))
	refusals, dropTrigger := appRefuses(t, s, "status", fmt.Sprintf(
		`OLD.workqueue_id IN (%d, %d) AND NEW.status = 'pending'`, parentB, refusedOrphan))

	var fired, held, refused int
	var woken []int64
	if err := s.DB.QueryRow(`SELECT groups_fired, held, refused, woken FROM fanin_fire_ready()`).
		Scan(&fired, &held, &refused, pq.Array(&woken)); err != nil {
		t.Fatalf("fanin_fire_ready with B's wake refused: %v", err)
	}
	if fired != 2 || held != 0 || refused != 1 || !slices.Equal(woken, []int64{parentA, parentC}) {
		t.Fatalf("fire_ready: %d fired, %d held, %d refused, woken %v; want A and C fired and woken, B refused",
			fired, held, refused, woken)
	}
	if state, _, _, _ := faninGroup(t, s, fidB); state != "open" {
		t.Fatalf("refused group B is %s, want open", state)
	}

	sweep := func() (faninSweepResult, int) {
		t.Helper()
		var r faninSweepResult
		var refused int
		if err := s.DB.QueryRow(`SELECT orphans_woken, groups_fired, woken, next_after, refused
		        FROM fanin_sweep(0, 500, '0')`).Scan(&r.OrphansWoken, &r.GroupsFired, pq.Array(&r.Woken),
			&r.NextAfter, &refused); err != nil {
			t.Fatalf("fanin_sweep with two wakes refused: %v", err)
		}
		return r, refused
	}
	r, refused := sweep()
	if r.OrphansWoken != 1 || r.GroupsFired != 0 || !slices.Equal(r.Woken, []int64{orphan}) || r.NextAfter != 0 || refused != 2 {
		t.Fatalf("sweep: %+v, %d refused; want the other orphan woken, the pass ended, B's and the orphan's wakes refused", r, refused)
	}
	for _, p := range []int64{parentB, refusedOrphan} {
		if _, st := faninRowStatus(t, s, p); st != "waiting" {
			t.Errorf("parent %d whose wake was refused is %s, want waiting", p, st)
		}
	}
	if refusals() < 3 {
		t.Errorf("the application's trigger refused %d wakes, want at least 3 (fire_ready's, the sweep's two)", refusals())
	}

	dropTrigger()
	r, refused = sweep()
	if r.OrphansWoken != 1 || r.GroupsFired != 1 || !slices.Equal(r.Woken, []int64{parentB, refusedOrphan}) || refused != 0 {
		t.Fatalf("sweep after the rule is gone: %+v, %d refused; want B fired and its parent and the orphan woken", r, refused)
	}
	faninExpectFired(t, s, 3)
}

// TestFaninFlushHeldAndQuarantined: one batch has a group whose evidence trips a guard, a
// healthy group, and a group the batch completes whose parent's row another transaction holds.
// Whichever the flush meets first, the corrupt group is quarantined, the healthy one fired,
// and the held one passed over with its events kept, then applied once when let go.
func TestFaninFlushHeldAndQuarantined(t *testing.T) {
	s := newTestSchema(t)
	_, fa, ka := faninNewGroup(t, s, 3)
	pb, _, kb := faninNewGroup(t, s, 2)
	pc, fc, kc := faninNewGroup(t, s, 2)
	faninClaim(t, s, slices.Concat(ka, kb, kc))
	faninBreakEvidence(t, s, ka[0])
	faninFinish(t, s, kb, "done")
	faninFinish(t, s, kc, "done")
	letGo := faninHold(t, s, `SELECT 1 FROM workqueue WHERE workqueue_id = $1 FOR UPDATE`, pc)
	defer letGo()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	r, err := faninFlush(ctx, s.DB, 10000)
	if err != nil {
		t.Fatalf("flush: %v", err)
	}
	if !slices.Equal(r.QuarantinedIDs, []int64{fa}) || !slices.Equal(r.Woken, []int64{pb}) || r.Held != 1 {
		t.Fatalf("flush: %+v; want %d quarantined, %d woken, one group held", r, fa, pb)
	}
	if n := s.count(t, `SELECT count(*) FROM fanin_event WHERE fanout_id = $1`, fc); n != 1 {
		t.Fatalf("%d inbox rows of the held group, want its 1", n)
	}
	letGo()
	if r := faninFlushAll(t, s, 10000); !slices.Equal(r.Woken, []int64{pc}) || r.Held != 0 {
		t.Fatalf("flush after the holder let go: %+v, want %d woken", r, pc)
	}
	if sw := faninSweepPass(t, s, 500, "0"); sw.QuarantineCleared != 1 {
		t.Fatalf("sweep: %+v, want the quarantined group recounted and cleared", sw)
	}
	checkFaninInvariants(t, s)
}

// --- quarantine, orphans, paging, cursor ------------------------------------------------

// TestFaninQuarantine: inconsistent evidence trips a guard; the flush applies the other
// groups of its batch, drops the bad group's events, queues it; the sweep recounts it.
func TestFaninQuarantine(t *testing.T) {
	s := newTestSchema(t)
	// Group A: its evidence trips the counter's guard (faninBreakEvidence).
	pa, fa, ka := faninNewGroup(t, s, 3)
	// Group B: healthy, completes in the same batch.
	pb, fb, kb := faninNewGroup(t, s, 2)
	faninClaim(t, s, append(slices.Clone(ka), kb...))
	faninBreakEvidence(t, s, ka[0])
	faninFinish(t, s, kb, "done")
	r := faninFlushAll(t, s, 10000)
	if r.Quarantined != 1 || !slices.Equal(r.QuarantinedIDs, []int64{fa}) {
		t.Fatalf("flush: %+v, want group %d quarantined", r, fa)
	}
	if !slices.Equal(r.Woken, []int64{pb}) || r.Events != 2 { // A's -1, B's two children in one row
		t.Fatalf("flush: %+v, want the healthy group's parent %d woken and 2 events consumed", r, pb)
	}
	if n := s.count(t, `SELECT count(*) FROM fanin_quarantine WHERE fanout_id = $1 AND dropped_events = 1`, fa); n != 1 {
		t.Fatalf("no quarantine row for %d", fa)
	}
	// The sweep recounts it whatever its cursor and age.
	sw, err := faninSweep(context.Background(), s.DB, math.MaxInt64-1, 500, "1 hour")
	if err != nil {
		t.Fatal(err)
	}
	if sw.QuarantineCleared != 1 || sw.Examined != 1 || sw.Repaired != 0 {
		t.Fatalf("sweep: %+v, want the quarantined group recounted (already right) and cleared", sw)
	}
	faninClaim(t, s, ka)
	faninFinish(t, s, ka, "done")
	if r := faninFlushAll(t, s, 10000); !slices.Equal(r.Woken, []int64{pa}) {
		t.Fatalf("flush: %+v, want %d woken", r, pa)
	}
	checkFaninInvariants(t, s)

	// A fired group reopened by hand would fire twice: the wake-log key trips; the sweep
	// marks the group fired again and nobody is woken twice.
	s.exec(t, `UPDATE fanout SET state = 'open', done_n = done_n - 1 WHERE fanout_id = $1`, fb)
	s.exec(t, `INSERT INTO fanin_event (fanout_id, child_id, d_done, d_failed) VALUES ($1, $2, 1, 0)`, fb, kb[0])
	r = faninFlushAll(t, s, 10000)
	if r.Quarantined != 1 || r.ParentsWoken != 0 {
		t.Fatalf("flush: %+v, want a quarantine and no wake", r)
	}
	sw = faninSweepPass(t, s, 500, "0")
	if sw.Repaired != 1 || sw.QuarantineCleared != 1 || sw.ParentsWoken != 0 {
		t.Fatalf("sweep: %+v", sw)
	}
	if state, _, _, _ := faninGroup(t, s, fb); state != "fired" {
		t.Fatalf("group %d is %s", fb, state)
	}
	checkFaninInvariants(t, s)
}

func TestFaninOrphanWaiter(t *testing.T) {
	s := newTestSchema(t)
	parent := faninParent(t, s, "split")
	// A parent waiting on a group that does not exist (should be impossible).
	s.exec(t, `UPDATE workqueue SET status = 'waiting', stage = 'cont', wait_fanout_id = 424242
	    WHERE workqueue_id = $1`, parent)
	nogroup := faninParent(t, s, "split")
	s.exec(t, `UPDATE workqueue SET status = 'waiting' WHERE workqueue_id = $1`, nogroup)
	healthy := faninParent(t, s, "split")
	faninSplitPayloads(t, s.DB, healthy, 1)
	sw := faninSweepPass(t, s, 500, "0")
	if sw.OrphansWoken != 2 {
		t.Fatalf("sweep: %+v, want 2 orphans woken", sw)
	}
	for _, p := range []int64{parent, nogroup} {
		if _, status := faninRowStatus(t, s, p); status != "pending" {
			t.Errorf("orphan %d is %s", p, status)
		}
	}
	if _, status := faninRowStatus(t, s, healthy); status != "waiting" {
		t.Errorf("a healthy waiter was woken: %s", status)
	}
	checkFaninInvariants(t, s)
}

func TestFaninSweepPaging(t *testing.T) {
	s := newTestSchema(t)
	var fids []int64
	for i := 0; i < 25; i++ {
		fids = append(fids, faninSplitPayloads(t, s.DB, faninParent(t, s, "split"), 2))
	}
	var after int64
	var pages []int64
	for {
		r, err := faninSweep(context.Background(), s.DB, after, 10, "0")
		if err != nil {
			t.Fatal(err)
		}
		if r.Repaired != 0 {
			t.Fatalf("repaired %d healthy groups", r.Repaired)
		}
		pages = append(pages, int64(r.Examined))
		if r.NextAfter == 0 {
			break
		}
		after = r.NextAfter
	}
	if !slices.Equal(pages, []int64{10, 10, 5}) {
		t.Errorf("pages examined %v, want [10 10 5]", pages)
	}
	var remaining []int64
	if err := s.DB.QueryRow(`SELECT array_agg(remaining ORDER BY fanout_id) FROM fanin_group_remaining($1)`,
		pq.Array(fids[:3])).Scan(pq.Array(&remaining)); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(remaining, []int64{2, 2, 2}) {
		t.Errorf("remaining %v", remaining)
	}
	var nonempty bool
	var open int
	var age float64
	var quarantined int
	if err := s.DB.QueryRow(`SELECT * FROM fanin_status()`).Scan(&nonempty, &open, &age, &quarantined); err != nil {
		t.Fatal(err)
	}
	if nonempty || open != 25 || age < 0 || quarantined != 0 {
		t.Errorf("fanin_status: %v %d %v %d", nonempty, open, age, quarantined)
	}
}

// TestFaninChildCursor: the keyset cursor of a range child (doc/design/fanin.md §3.3).
func TestFaninChildCursor(t *testing.T) {
	s := newTestSchema(t)
	parent, _, kids := faninNewRangeGroup(t, s, 1, 100, 2, 1) // [1, 51) and [51, 101)
	cursor := func(id int64) sql.NullInt64 {
		var c sql.NullInt64
		if err := s.DB.QueryRow(`SELECT fanout_child_cursor($1)`, id).Scan(&c); err != nil {
			t.Fatal(err)
		}
		return c
	}
	if c := cursor(kids[1]); c.Int64 != 51 {
		t.Fatalf("initial cursor %v, want 51", c)
	}
	if _, err := s.DB.Exec(`SELECT fanout_child_advance($1, 'child', 60)`, kids[1]); faninSQLState(err) != "PF001" {
		t.Fatalf("advance of a pending child: %v, want PF001", err)
	}
	faninClaim(t, s, kids)
	s.exec(t, `SELECT fanout_child_advance($1, 'child', 60)`, kids[1])
	if c := cursor(kids[1]); c.Int64 != 61 {
		t.Fatalf("cursor %v, want 61", c)
	}
	s.exec(t, `SELECT fanout_child_advance($1, 'child', 100)`, kids[1])
	if c := cursor(kids[1]); c.Valid {
		t.Fatalf("cursor %v at the end of the slice, want NULL", c)
	}
	if _, err := s.DB.Exec(`SELECT fanout_child_cursor($1)`, parent); faninSQLState(err) != "PF002" {
		t.Fatalf("cursor of a non-child: %v, want PF002", err)
	}
	// The top of int8: the cursor passes the maximum.
	_, _, tk := faninNewRangeGroup(t, s, math.MaxInt64-5, math.MaxInt64, 1, 1)
	faninClaim(t, s, tk)
	s.exec(t, `SELECT fanout_child_advance($1, 'child', $2)`, tk[0], int64(math.MaxInt64))
	if c := cursor(tk[0]); c.Valid {
		t.Fatalf("cursor %v past int8 max, want NULL", c)
	}
}

// TestFaninUpgradeIDRange re-applies schema.sql over the data of the version before groups
// recorded their children's id range (no child_lo/child_hi, the workqueue_children index):
// open groups get their range from the children rows, the old index goes, the sweep recounts
// through the range, and applying the file once more changes nothing.
func TestFaninUpgradeIDRange(t *testing.T) {
	s := newTestSchema(t)
	ddl := schemaDDL(t)
	openParent := faninParent(t, s, "split")
	open := faninSplitPayloads(t, s.DB, openParent, 3)
	s.exec(t, `INSERT INTO workqueue (stage, status) VALUES ('zz', 'done')`)
	_, fired, firedKids := faninNewRangeGroup(t, s, 1, 20, 10, 1)
	faninClaim(t, s, firedKids)
	faninFinish(t, s, firedKids, "done")
	if r := faninFlushAll(t, s, 10000); r.GroupsFired != 1 {
		t.Fatalf("flush: %+v, want the range group fired", r)
	}
	kids := faninChildren(t, s, open)
	faninClaim(t, s, kids)
	faninFinish(t, s, kids[:1], "done")
	faninFlushAll(t, s, 10000)

	// The earlier version's shape.
	s.exec(t, `ALTER TABLE fanout DROP COLUMN child_lo, DROP COLUMN child_hi`)
	s.exec(t, `DROP INDEX workqueue_failed_children`)
	s.exec(t, `CREATE INDEX workqueue_children ON workqueue (fanout_id, status, fanout_seq)
	    WHERE fanout_id IS NOT NULL AND status IN ('done', 'failed')`)

	for pass := 1; pass <= 2; pass++ {
		if _, err := s.DB.Exec(ddl); err != nil {
			t.Fatalf("apply schema.sql over the earlier version (pass %d): %v", pass, err)
		}
		faninCheckIDRange(t, s, open, kids)
		if n := s.count(t, `SELECT count(*) FROM fanout WHERE fanout_id = $1 AND child_lo IS NULL`, fired); n != 1 {
			t.Errorf("pass %d: the fired group got an id range; only open groups need one", pass)
		}
		if n := s.count(t, `SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND indexname = 'workqueue_children'`, s.Name); n != 0 {
			t.Errorf("pass %d: the workqueue_children index is still there", pass)
		}
		if n := s.count(t, `SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND indexname = 'workqueue_failed_children'`, s.Name); n != 1 {
			t.Errorf("pass %d: no workqueue_failed_children index", pass)
		}
	}

	// Evidence lost for the last two children: only the recount over the range finds them.
	s.exec(t, `UPDATE workqueue SET status = 'done' WHERE workqueue_id = ANY ($1)`, pq.Array(kids[1:]))
	s.exec(t, `DELETE FROM fanin_event WHERE fanout_id = $1`, open)
	r := faninSweepPass(t, s, 500, "0")
	if r.Repaired != 1 || !slices.Equal(r.Woken, []int64{openParent}) {
		t.Fatalf("sweep after the upgrade: %+v, want one repair and %d woken", r, openParent)
	}
	if state, _, done, failed := faninGroup(t, s, open); state != "fired" || done != 3 || failed != 0 {
		t.Fatalf("group %s %d/%d after the sweep, want fired 3/0", state, done, failed)
	}
	checkFaninInvariants(t, s)
}

// faninSchemaObjects lists what the schema schema holds: its tables, indexes, functions and
// triggers with their definitions, one string each, sorted.
func faninSchemaObjects(t *testing.T, s *testSchema, schema string) []string {
	t.Helper()
	rows, err := s.DB.Query(`
	    SELECT 'table ' || c.relname || ' ' || c.relkind::text || ' ' ||
	           (SELECT string_agg(a.attname || ':' || format_type(a.atttypid, a.atttypmod), ',' ORDER BY a.attnum)
	              FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped)
	      FROM pg_class c WHERE c.relnamespace = $1::text::regnamespace AND c.relkind IN ('r', 'S')
	    UNION ALL
	    SELECT 'index ' || replace(indexdef, $1::text || '.', '') FROM pg_indexes WHERE schemaname = $1::text
	    UNION ALL
	    SELECT 'function ' || p.proname || ' ' || md5(replace(p.prosrc, $1::text, '')) || ' ' ||
	           coalesce(array_to_string(p.proconfig, ','), '')
	      FROM pg_proc p WHERE p.pronamespace = $1::text::regnamespace
	    UNION ALL
	    SELECT 'trigger ' || tg.tgname || ' ' || tg.tgenabled::text || ' ' ||
	           replace(pg_get_triggerdef(tg.oid), $1::text || '.', '')
	      FROM pg_trigger tg JOIN pg_class c ON c.oid = tg.tgrelid
	     WHERE c.relnamespace = $1::text::regnamespace AND NOT tg.tgisinternal
	    ORDER BY 1`, schema)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var objs []string
	for rows.Next() {
		var o string
		if err := rows.Scan(&o); err != nil {
			t.Fatal(err)
		}
		objs = append(objs, strings.ReplaceAll(o, schema, "SCHEMA"))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return objs
}

// TestFaninSchemaInstalledPsql: the schema as the contract applies it, `psql -v
// ON_ERROR_STOP=1 -f schema.sql` on the files `make install` puts in SHAREDIR, works (every
// file schema.sql includes is installed beside it), works again on its own result
// (idempotent), and makes the same objects as the tests' way of applying it
// (internal/schemafile through database/sql), so the tests exercise what users install.
func TestFaninSchemaInstalledPsql(t *testing.T) {
	psql, err := exec.LookPath("psql")
	if err != nil {
		if m, _ := filepath.Glob("/usr/lib/postgresql/*/bin/psql"); len(m) > 0 {
			psql, err = m[len(m)-1], nil
		}
	}
	if err != nil {
		t.Skip("psql not installed")
	}
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("make not installed")
	}
	share := t.TempDir()
	if out, err := exec.Command("make", "-s", "-f", "dist/install.mk", "install-share", "SHAREDIR="+share).CombinedOutput(); err != nil {
		t.Fatalf("make install-share: %v\n%s", err, out)
	}
	ref := newTestSchema(t) // applied with internal/schemafile
	name := ref.Name + "_psql"
	ref.exec(t, "CREATE SCHEMA "+name)
	t.Cleanup(func() { ref.DB.Exec("DROP SCHEMA " + name + " CASCADE") })
	for pass := 1; pass <= 2; pass++ {
		cmd := exec.Command(psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-f", filepath.Join(share, "schema.sql"), baseDSN(t))
		cmd.Dir = t.TempDir() // \ir must resolve beside schema.sql, not in the working directory
		cmd.Env = append(os.Environ(), "PGOPTIONS=-c search_path="+name)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("psql -f schema.sql (pass %d): %v\n%s", pass, err, out)
		}
	}
	got, want := faninSchemaObjects(t, ref, name), faninSchemaObjects(t, ref, ref.Name)
	if len(want) < 20 || !slices.ContainsFunc(want, func(o string) bool { return strings.HasPrefix(o, "function fanin_flush ") }) {
		t.Fatalf("the reference schema lacks fan-in: %v", want)
	}
	if !slices.Equal(got, want) {
		t.Errorf("psql's schema differs from internal/schemafile's:\npsql:\n  %s\nschemafile:\n  %s",
			strings.Join(got, "\n  "), strings.Join(want, "\n  "))
	}
}

// TestFaninSplitPlansStaleStatistics: a split stage splits a batch of messages in one
// transaction while the planner's statistics describe a small table (a queue table's always
// lag: claim.go). Every statement of the split functions, of the child cursor and of its
// advance must find its rows by key. A first version read the parent's priority, and moved the
// parent and the group, with generic plans that scanned workqueue and fanout whole: each split
// of a batch then read every row the batch had inserted before it (faninbench, 1,000 splits of
// 100 children: 1.7 ms per parent lookup, against microseconds). The transaction's own scan
// counters (pg_stat_xact_user_tables) show a sequential scan however small the tables are.
func TestFaninSplitPlansStaleStatistics(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `INSERT INTO workqueue (stage, status) SELECT 'old', 'done' FROM generate_series(1, 200)`)
	s.exec(t, `INSERT INTO fanout (parent_id, expected_n, state) SELECT g, 1, 'fired' FROM generate_series(1, 20) g`)
	ctx := context.Background()
	tx, seqScans := staleStatsTx(t, s)
	// call runs one function call and fails if it scanned either table sequentially.
	call := func(what, query string, args ...any) {
		t.Helper()
		before := seqScans()
		if _, err := tx.ExecContext(ctx, query, args...); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if n := seqScans() - before; n != 0 {
			t.Fatalf("%s: %d sequential scans of workqueue or fanout, want none", what, n)
		}
	}
	var parents []int64
	if err := tx.QueryRowContext(ctx, `WITH p AS (INSERT INTO workqueue (stage, status, claim, claimed_at)
	        SELECT 'split', 'running', nextval('workqueue_claim_seq'), now() FROM generate_series(1, 60)
	        RETURNING workqueue_id)
	    SELECT array_agg(workqueue_id ORDER BY workqueue_id) FROM p`).Scan(pq.Array(&parents)); err != nil {
		t.Fatal(err)
	}
	// Past the five custom plans after which plpgsql may keep a generic one: 20 calls each.
	for i, p := range parents {
		switch i % 3 {
		case 0:
			call("fanout_split", `SELECT fanout_split($1, 'split', 'cont', 'child', $2::jsonb)`,
				p, `[{}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}]`)
		case 1:
			call("fanout_split_range", `SELECT fanout_split_range($1, 'split', 'cont', 'child', 1, 1000, 20, 1)`, p)
		case 2:
			call("fanout_split_bounds", `SELECT fanout_split_bounds($1, 'split', 'cont', 'child', '{1, 10, 100, 1000}')`, p)
		}
	}
	var kids []int64
	if err := tx.QueryRowContext(ctx, `SELECT array_agg(workqueue_id ORDER BY workqueue_id) FROM workqueue
	    WHERE range_lo IS NOT NULL AND fanout_seq = 0`).Scan(pq.Array(&kids)); err != nil {
		t.Fatal(err)
	}
	if len(kids) != 40 {
		t.Fatalf("%d first range children, want 40", len(kids))
	}
	if _, err := tx.ExecContext(ctx, `UPDATE workqueue SET status = 'running', claim = 1, claimed_at = now()
	    WHERE workqueue_id = ANY ($1)`, pq.Array(kids)); err != nil {
		t.Fatal(err)
	}
	for _, k := range kids {
		call("fanout_child_cursor", `SELECT fanout_child_cursor($1)`, k)
		call("fanout_child_advance", `SELECT fanout_child_advance($1, 'child', 5)`, k)
	}
	var n int
	if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM workqueue WHERE status = 'waiting' AND stage = 'cont'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != len(parents) {
		t.Errorf("%d parents waiting, want %d", n, len(parents))
	}
}

// TestFaninSweepPlansStaleStatistics: the sweep runs every SWEEP_INTERVAL on one of the
// dispatcher's pooled, long-lived connections (fanin.go: startSweep), where plpgsql plans go
// generic after five calls. Its recount reads each group's children through the primary key
// between child_lo and child_hi, and a plan made for a small table must not turn that into a
// scan of the grown table per group: the sweep and the recount it calls scan neither workqueue
// nor fanout sequentially after the table has grown a thousandfold since its statistics.
func TestFaninSweepPlansStaleStatistics(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `ALTER TABLE workqueue SET (autovacuum_enabled = false)`)
	for i := 0; i < 20; i++ {
		faninNewGroup(t, s, 3)
	}
	ctx := context.Background()
	tx, seqScans := staleStatsTx(t, s)
	sweep := func(check bool) {
		t.Helper()
		before := seqScans()
		var examined int
		if err := tx.QueryRowContext(ctx, `SELECT examined FROM fanin_sweep(0, 500, '-1 hour')`).Scan(&examined); err != nil {
			t.Fatalf("fanin_sweep: %v", err)
		}
		if examined != 20 {
			t.Fatalf("the sweep examined %d groups, want 20", examined)
		}
		if n := seqScans() - before; check && n != 0 {
			t.Fatalf("fanin_sweep on a table grown since its statistics: %d sequential scans of workqueue or fanout, want none", n)
		}
	}
	for i := 0; i < 8; i++ {
		sweep(false)
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO workqueue (stage) SELECT 'a' FROM generate_series(1, 100000)`); err != nil {
		t.Fatalf("grow workqueue: %v", err)
	}
	for i := 0; i < 3; i++ {
		sweep(true)
	}
}

// Every function that runs with enable_seqscan = off runs with jit = off too: where no index
// serves, enable_seqscan = off costs the scan at 10^10, past every JIT threshold, and the
// statement is compiled at each execution (fanin.sql, the head of the coordinator's side).
// The rule is read from the catalog, so a function added later without it fails here.
func TestSeqscanOffFunctionsSetJitOff(t *testing.T) {
	s := newTestSchema(t)
	rows, err := s.DB.Query(`SELECT p.proname, 'jit=off' = ANY (p.proconfig)
	    FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
	    WHERE n.nspname = $1 AND 'enable_seqscan=off' = ANY (p.proconfig)
	    ORDER BY 1`, s.Name)
	if err != nil {
		t.Fatalf("read the functions' settings: %v", err)
	}
	defer rows.Close()
	var seen int
	for rows.Next() {
		var name string
		var jitOff bool
		if err := rows.Scan(&name, &jitOff); err != nil {
			t.Fatalf("read the functions' settings: %v", err)
		}
		seen++
		if !jitOff {
			t.Errorf("%s runs with enable_seqscan = off but not jit = off", name)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("read the functions' settings: %v", err)
	}
	// fanin_apply, fire, recount, sweep, the four split functions, the child cursor's two,
	// and the five queue actions: a schema that loses them has lost its plan fixes.
	if seen < 15 {
		t.Errorf("%d functions run with enable_seqscan = off, want at least 15", seen)
	}
}
