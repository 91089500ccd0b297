// controls_test.go: the producer's controls (priority, run_at, concurrency_key with
// KEY_LIMIT, unique_key) with a real dispatcher, real workers and a real PostgreSQL.

package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/lib/pq"

	"pepsi-dispatch/stage"
)

// keylogDDL is the stage's own log of start and end times (written by controlsWorker on a
// connection of its own, committed at once), and, from a trigger, the claim and release of
// every row: 'claimed' when the dispatcher's claim makes it running, 'left' when it stops
// being running under that claim (its outcome, its failure after the worker was reaped, a
// reset, or the next dispatcher's reset of orphans). A message sits in a worker's queue from
// just after 'claimed' to just after 'left' (its reply comes after the commit that wrote
// 'left'), so [claimed, left] and [start, left] are the intervals the key bound is checked on.
const keylogDDL = `
CREATE TABLE keylog (
    id bigint NOT NULL, claim bigint, key text, ev text NOT NULL, pid int,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION keylog_claims() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'running' AND (OLD.status <> 'running' OR OLD.claim IS DISTINCT FROM NEW.claim) THEN
        INSERT INTO keylog (id, claim, key, ev) VALUES (NEW.workqueue_id, NEW.claim, NEW.concurrency_key, 'claimed');
    END IF;
    IF OLD.status = 'running' AND (NEW.status <> 'running' OR OLD.claim IS DISTINCT FROM NEW.claim) THEN
        INSERT INTO keylog (id, claim, key, ev) VALUES (OLD.workqueue_id, OLD.claim, OLD.concurrency_key, 'left');
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER keylog_claims AFTER UPDATE ON workqueue FOR EACH ROW EXECUTE FUNCTION keylog_claims();`

// controlsBehaviour is what a message's payload asks of controlsWorker.
type controlsBehaviour struct {
	SleepMs    int  `json:"sleep_ms"`
	CrashFirst bool `json:"crash_first"` // exit the process the first time it runs
	HangFirst  bool `json:"hang_first"`  // never answer the first time it runs (MAX_RUNTIME kills it)
}

// controlsWorker logs each message's start and end (with its claim) in keylog, on its own
// connection, behaves as the payload asks, and finishes the message.
func controlsWorker() int {
	cfg, err := stage.LoadConfig(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	logdb, err := sql.Open("postgres", cfg.DSN)
	if err != nil {
		return 2
	}
	defer logdb.Close()
	logdb.SetMaxOpenConns(1)
	event := func(id int64, ev string) error {
		_, err := logdb.Exec(`INSERT INTO keylog (id, claim, key, ev, pid)
			SELECT workqueue_id, claim, concurrency_key, $2, $3 FROM workqueue WHERE workqueue_id = $1`, id, ev, os.Getpid())
		return err
	}
	h := func(ctx context.Context, m *stage.Message) error {
		var b controlsBehaviour
		if len(m.Payload) > 0 {
			if err := json.Unmarshal(m.Payload, &b); err != nil {
				return fmt.Errorf("decode payload: %w", err)
			}
		}
		if err := event(m.ID, "start"); err != nil {
			return fmt.Errorf("log start: %w", err)
		}
		time.Sleep(time.Duration(b.SleepMs) * time.Millisecond)
		// Once per message, whatever its attempts say: the SDK answers a batch at its end, so
		// a crash blames the batch's head, which need not be this message.
		once := func(ev string) bool {
			var n int
			logdb.QueryRow(`SELECT count(*) FROM keylog WHERE id = $1 AND ev = $2`, m.ID, ev).Scan(&n)
			return n == 0 && event(m.ID, ev) == nil
		}
		switch {
		case b.CrashFirst && once("crash"):
			os.Exit(3)
		case b.HangFirst && once("hang"):
			select {}
		}
		if err := event(m.ID, "end"); err != nil {
			return fmt.Errorf("log end: %w", err)
		}
		return m.Done()
	}
	if err := stage.Serve(context.Background(), cfg, os.Stdin, os.Stdout, h); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

func init() { testWorkers["controls"] = controlsWorker }

// ---- priority ----

// Across claims of one message each, messages start in (priority, id) order; and a
// high-priority message enqueued into a running backlog starts after at most the messages
// already in workers' queues (one claim).
func TestControlsPriorityOrder(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 20))
	for i := 0; i < 40; i++ {
		s.exec(t, `INSERT INTO workqueue (stage, payload, priority) VALUES ('a', '{}', $1)`, rng.IntN(7)-3)
	}
	conf := baseConf(s, "") + stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 1")
	d := startDaemon(t, conf, "pipeline")
	waitFor(t, 60*time.Second, "the 40 messages done", func() bool { return countStatus(t, s, "done") == 40 })
	got := ids(t, s, `SELECT r.id FROM runs r ORDER BY r.at`)
	want := ids(t, s, `SELECT workqueue_id FROM workqueue ORDER BY priority, workqueue_id`)
	if !slices.Equal(got, want) {
		t.Fatalf("start order %v\nwant (priority, id) order %v", got, want)
	}
	d.stop()

	// A backlog of 300 priority-0 messages, capacity 2: a priority -1 message waits for the
	// two already handed out, no more.
	s.exec(t, `TRUNCATE runs`)
	conf = baseConf(s, "") + stageConf(t, "b", "", "PARALLELISM = 1\nQUEUE_LIMIT = 2")
	d = startDaemon(t, conf, "pipeline")
	enqueue(t, s, "b", 300, `{"sleep_ms": 10}`)
	waitFor(t, 60*time.Second, "the backlog under way", func() bool { return s.count(t, `SELECT count(*) FROM runs`) >= 5 })
	var urgent int64
	var enq time.Time
	if err := s.DB.QueryRow(`INSERT INTO workqueue (stage, payload, priority) VALUES ('b', '{}', -1)
		RETURNING workqueue_id, clock_timestamp()`).Scan(&urgent, &enq); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 60*time.Second, "the urgent message run", func() bool {
		return s.count(t, `SELECT count(*) FROM runs WHERE id = $1`, urgent) == 1
	})
	before := s.count(t, `SELECT count(*) FROM runs WHERE at > $1 AND at < (SELECT at FROM runs WHERE id = $2)`, enq, urgent)
	if before > 2 {
		t.Errorf("%d backlog messages ran between the urgent message's enqueue and its run; want at most 2 (the queue it found)", before)
	}
	t.Logf("backlog messages run ahead of the urgent one: %d (capacity 2)", before)
	d.stop()
}

func ids(t *testing.T, s *testSchema, query string, args ...any) []int64 {
	t.Helper()
	return idsOf(t, s.DB, query, args...)
}

// idsOf runs a query of one bigint column on q (the schema's pool, or a transaction of it).
func idsOf(t *testing.T, q interface {
	Query(string, ...any) (*sql.Rows, error)
}, query string, args ...any) []int64 {
	t.Helper()
	rows, err := q.Query(query, args...)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		out = append(out, id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// ---- run_at ----

// runAtLate is how late a run_at message may be claimed in these tests: the dispatcher's own
// delay is a few milliseconds, but the machine running the tests may be loaded.
const runAtLate = 1500 * time.Millisecond

// checkRunAt checks that message id was claimed not before its run_at and at most runAtLate
// after it, and returns how late it was.
func checkRunAt(t *testing.T, s *testSchema, id int64) time.Duration {
	t.Helper()
	var lateMs float64
	if err := s.DB.QueryRow(`SELECT extract(epoch FROM claimed_at - run_at) * 1000 FROM workqueue WHERE workqueue_id = $1`, id).Scan(&lateMs); err != nil {
		t.Fatal(err)
	}
	late := time.Duration(lateMs * float64(time.Millisecond))
	if late < 0 {
		t.Errorf("message %d claimed %v before its run_at", id, -late)
	}
	if late > runAtLate {
		t.Errorf("message %d claimed %v after its run_at, want at most %v", id, late, runAtLate)
	}
	return late
}

// A message with run_at waits (paused, due at run_at) and is claimed right after it, without
// a poll (POLL_INTERVAL is an hour here); the same across a restart of the dispatcher.
func TestControlsRunAt(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	conf := baseConf(s, "") + stageConf(t, "a", "", "")
	conf = strings.Replace(conf, "POLL_INTERVAL = 1", "POLL_INTERVAL = 1h", 1)
	d := startDaemon(t, conf, "pipeline")
	warmUp(t, s, "a")
	var later []int64
	for _, ms := range []int{1200, 1700, 2300} {
		var id int64
		if err := s.DB.QueryRow(`INSERT INTO workqueue (stage, payload, run_at)
			VALUES ('a', '{}', now() + make_interval(secs => $1::float8 / 1000)) RETURNING workqueue_id`, ms).Scan(&id); err != nil {
			t.Fatal(err)
		}
		if st := row(t, s, id).status; st != "paused" {
			t.Fatalf("a message with a future run_at is %s, want paused", st)
		}
		later = append(later, id)
	}
	// One in the past is claimed at once.
	now := insertOne(t, s, "a", `{}`)
	s.exec(t, `UPDATE workqueue SET run_at = now() - interval '1 hour' WHERE workqueue_id = $1`, now)
	waitFor(t, 30*time.Second, "the run_at messages done", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = ANY ($1) AND status = 'done'`, pq.Array(later)) == 3
	})
	for _, id := range later {
		t.Logf("message %d claimed %v after its run_at", id, checkRunAt(t, s, id))
	}

	// Across a restart: one enqueued before the stop and due after the next start, one
	// enqueued and due while no dispatcher runs. (Enqueued before the stop and due during
	// it, a row may be returned to pending by the stopping dispatcher, which no longer
	// claims: correct, but not "due while none runs".)
	var gone, after int64
	if err := s.DB.QueryRow(`INSERT INTO workqueue (stage, payload, run_at) VALUES ('a', '{}', now() + interval '20 seconds') RETURNING workqueue_id`).Scan(&after); err != nil {
		t.Fatal(err)
	}
	d.stop()
	if err := s.DB.QueryRow(`INSERT INTO workqueue (stage, payload, run_at) VALUES ('a', '{}', now() + interval '500 milliseconds') RETURNING workqueue_id`).Scan(&gone); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the second run_at to pass", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1 AND run_at < now()`, gone) == 1
	})
	if st := row(t, s, gone).status; st != "paused" {
		t.Fatalf("run_at message is %s with no dispatcher running", st)
	}
	d = startDaemon(t, conf, "pipeline")
	d.waitLog("dispatching", 30*time.Second)
	if s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1 AND run_at > now()`, after) != 1 {
		t.Fatal("the restart took longer than the 20 s before the first message's run_at")
	}
	waitFor(t, 60*time.Second, "both done after the restart", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id IN ($1, $2) AND status = 'done'`, gone, after) == 2
	})
	// Due while none ran: not early; how late is the restart's business, not the timer's.
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = $1 AND claimed_at >= run_at`, gone); n != 1 {
		t.Errorf("the message due while no dispatcher ran was claimed before its run_at")
	}
	t.Logf("message due after the restart claimed %v after its run_at", checkRunAt(t, s, after))
	d.stop()
}

// ---- unique_key ----

// Many connections insert the same keys at once: exactly one row per key, and each producer
// learns from RETURNING whether its insert was the one. A key is free again once its message
// is done or failed, not while it is pending, running or paused.
func TestControlsUniqueKeyConcurrent(t *testing.T) {
	s := newTestSchema(t)
	const producers, keys = 16, 60
	start := make(chan struct{})
	var wg sync.WaitGroup
	inserted := make([]int, producers)
	errs := make(chan error, producers)
	for p := 0; p < producers; p++ {
		db, err := sql.Open("postgres", s.DSN)
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		db.SetMaxOpenConns(1)
		if err := db.Ping(); err != nil {
			t.Fatal(err)
		}
		order := rand.Perm(keys)
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for _, k := range order {
				rows, err := db.Query(`INSERT INTO workqueue (stage, payload, unique_key) VALUES ('a', $1, $2)
					ON CONFLICT DO NOTHING RETURNING workqueue_id`, fmt.Sprintf(`{"producer": %d}`, p), "key-"+strconv.Itoa(k))
				if err != nil {
					errs <- err
					return
				}
				for rows.Next() {
					inserted[p]++
				}
				rows.Close()
			}
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	total := 0
	for _, n := range inserted {
		total += n
	}
	if total != keys {
		t.Errorf("producers were told %d inserts succeeded, want %d", total, keys)
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue`); n != keys {
		t.Errorf("%d rows for %d keys", n, keys)
	}
	if n := s.count(t, `SELECT count(DISTINCT unique_key) FROM workqueue`); n != keys {
		t.Errorf("%d distinct keys, want %d", n, keys)
	}
	dup := func(key string) bool {
		t.Helper()
		rows, err := s.DB.Query(`INSERT INTO workqueue (stage, unique_key) VALUES ('a', $1) ON CONFLICT DO NOTHING RETURNING workqueue_id`, key)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		return !rows.Next()
	}
	for _, st := range []string{"running", "paused", "waiting"} {
		s.exec(t, `UPDATE workqueue SET status = $1 WHERE unique_key = 'key-1'`, st)
		if !dup("key-1") {
			t.Errorf("a second message with the key of a %s one was accepted", st)
		}
	}
	s.exec(t, `UPDATE workqueue SET status = 'done' WHERE unique_key = 'key-1'`)
	s.exec(t, `UPDATE workqueue SET status = 'failed' WHERE unique_key = 'key-2'`)
	if dup("key-1") || dup("key-2") {
		t.Errorf("a key is not free again once its message is done or failed")
	}
	if !dup("key-1") {
		t.Errorf("the key of the new pending message is not taken")
	}
}

// ---- concurrency_key and KEY_LIMIT ----

// interval is one stretch of time a message of a key spent in a worker's queue (from its
// claim) or in its handler (from its start), up to the row leaving running.
type keyInterval struct {
	key        string
	id, claim  int64
	from, till time.Time
	claimedAt  time.Time
}

// keyIntervals reads keylog: from kind ('claimed' or 'start') to the matching 'left'.
func keyIntervals(t *testing.T, s *testSchema, kind string) []keyInterval {
	t.Helper()
	rows, err := s.DB.Query(`
		SELECT f.key, f.id, f.claim, f.at, l.at, c.at
		  FROM keylog f
		  JOIN keylog c ON c.id = f.id AND c.claim = f.claim AND c.ev = 'claimed'
		  LEFT JOIN keylog l ON l.id = f.id AND l.claim = f.claim AND l.ev = 'left'
		 WHERE f.ev = $1 AND f.key IS NOT NULL ORDER BY f.at`, kind)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []keyInterval
	for rows.Next() {
		var iv keyInterval
		var till sql.NullTime
		if err := rows.Scan(&iv.key, &iv.id, &iv.claim, &iv.from, &till, &iv.claimedAt); err != nil {
			t.Fatal(err)
		}
		if !till.Valid {
			t.Fatalf("message %d, claim %d: %s but never left running", iv.id, iv.claim, kind)
		}
		iv.till = till.Time
		out = append(out, iv)
	}
	return out
}

// limitPhase is the KEY_LIMIT that applies to claims made from a time on.
type limitPhase struct {
	from  time.Time
	limit int
}

// checkKeyBound checks that when each interval begins, no more intervals of its key are open
// than the limit in force at its claim.
func checkKeyBound(t *testing.T, what string, ivs []keyInterval, phases []limitPhase) (maxSeen map[int]int) {
	t.Helper()
	maxSeen = map[int]int{}
	limitAt := func(at time.Time) int {
		n := 0
		for _, p := range phases {
			if !at.Before(p.from) {
				n = p.limit
			}
		}
		return n
	}
	for i, a := range ivs {
		open := 0
		for j, b := range ivs {
			if b.key == a.key && !b.from.After(a.from) && b.till.After(a.from) {
				open++
			}
			_ = j
		}
		lim := limitAt(a.claimedAt)
		if open > maxSeen[lim] {
			maxSeen[lim] = open
		}
		if open > lim {
			t.Errorf("%s: when message %d (key %s) began at %s, %d of its key were open; KEY_LIMIT then was %d",
				what, a.id, a.key, a.from.Format("15:04:05.000000"), open, lim)
			if i > 20 {
				return
			}
		}
	}
	return maxSeen
}

// dbNow is the database's clock, which keylog uses.
func dbNow(t *testing.T, s *testSchema) time.Time {
	t.Helper()
	var at time.Time
	if err := s.DB.QueryRow(`SELECT clock_timestamp()`).Scan(&at); err != nil {
		t.Fatal(err)
	}
	return at
}

// The per-key bound, checked from the stage's own log and the claims, through crashes,
// timeouts, a reload lowering KEY_LIMIT, a SIGKILL of the dispatcher, a restart, and a
// reload raising it again; other keys' messages and unkeyed ones keep flowing.
func TestControlsKeyLimit(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, keylogDDL)
	conf := baseConf(s, "MAX_RUNTIME = 1.5") +
		stageConf(t, "a", "", "PARALLELISM = 4\nQUEUE_LIMIT = 4\nKEY_LIMIT = 3\nRETRY_DELAY = 0.2\nMAX_ATTEMPTS = 5")
	d := startDaemon(t, conf, "controls")
	phases := []limitPhase{{time.Time{}, 3}}
	var total int
	batch := func(perKey int) {
		t.Helper()
		for i := 0; i < perKey; i++ {
			for k := 0; k < 4; k++ {
				b := controlsBehaviour{SleepMs: 15 + rand.IntN(20)}
				switch rand.IntN(25) {
				case 0:
					b.CrashFirst = true
				case 1:
					b.HangFirst = true
				}
				p, _ := json.Marshal(b)
				s.exec(t, `INSERT INTO workqueue (stage, payload, concurrency_key, priority) VALUES ('a', $1, $2, $3)`,
					string(p), "key-"+strconv.Itoa(k), rand.IntN(3))
				total++
			}
			s.exec(t, `INSERT INTO workqueue (stage, payload) VALUES ('a', '{"sleep_ms": 5}')`)
			total++
		}
	}
	doneAtLeast := func(n int, what string) {
		t.Helper()
		waitFor(t, 120*time.Second, what, func() bool { return countStatus(t, s, "done") >= n })
	}
	batch(25)
	doneAtLeast(40, "progress at KEY_LIMIT = 3")

	// Lower the limit to 1 through the config table.
	phases = append(phases, limitPhase{dbNow(t, s), 3})
	s.exec(t, `INSERT INTO config (section, key, value) VALUES ('stage-a', 'KEY_LIMIT', '1')`)
	d.waitLog("stage graph reloaded", 30*time.Second)
	phases = append(phases, limitPhase{dbNow(t, s), 1})
	batch(15)
	doneAtLeast(countStatus(t, s, "done")+20, "progress at KEY_LIMIT = 1")

	// SIGKILL the dispatcher mid-run; its workers die with it; the next one starts clean.
	d.cmd.Process.Signal(syscall.SIGKILL)
	d.wait(10 * time.Second)
	d = startDaemon(t, conf, "controls")
	d.waitLog("orphans_reset=", 30*time.Second)
	doneAtLeast(countStatus(t, s, "done")+10, "progress after the restart")

	// Raise it to 2.
	phases = append(phases, limitPhase{dbNow(t, s), 1}) // max(old, new) until seen applied
	s.exec(t, `UPDATE config SET value = '2' WHERE section = 'stage-a' AND key = 'KEY_LIMIT'`)
	phases[len(phases)-1].limit = 2
	d.waitLog("stage graph reloaded", 30*time.Second)
	batch(15)
	waitFor(t, 180*time.Second, "every message done", func() bool { return countStatus(t, s, "done") == total })
	d.stop()

	claims := keyIntervals(t, s, "claimed")
	starts := keyIntervals(t, s, "start")
	seenC := checkKeyBound(t, "in workers' queues (claimed..left)", claims, phases)
	seenS := checkKeyBound(t, "in the handler (start..left)", starts, phases)
	t.Logf("%d claims, %d starts of keyed messages; most open at once per limit: queues %v, handlers %v", len(claims), len(starts), seenC, seenS)
	if seenC[3] < 2 {
		t.Errorf("with KEY_LIMIT = 3 never more than %d of a key at once: the test did not load the keys", seenC[3])
	}
	crashed := s.count(t, `SELECT count(*) FROM keylog WHERE ev = 'crash'`)
	timedOut := s.count(t, `SELECT count(*) FROM keylog WHERE ev = 'hang'`)
	t.Logf("messages that crashed their worker: %d, timed out: %d", crashed, timedOut)
	if crashed == 0 || timedOut == 0 {
		t.Errorf("the run had %d crashes and %d timeouts, want some of each", crashed, timedOut)
	}
	// Within a key, claims follow (priority, id) among the rows pending at the time; checked
	// on the first claim of each row at limit 1 after the restart would need the pending set,
	// so here: every row ran, none twice at once (the bound above), and nothing is left parked.
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE key_parked`); n != 0 {
		t.Errorf("%d rows left parked after the run", n)
	}
}

// ---- the claim's cost with a saturated key ----

// claimBuffers runs the claim under EXPLAIN (ANALYZE, BUFFERS) in a transaction rolled back,
// and returns the buffers it read to choose its rows (not those its writes touched) and the plan.
func claimBuffers(t *testing.T, s *testSchema, keys *keyLoad) (int, string) {
	t.Helper()
	tx, err := s.DB.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	var names []string
	var limits []int64
	for n, l := range keys.limit {
		names, limits = append(names, n), append(limits, int64(l))
	}
	var bs, bk []string
	var bn []int64
	for k, n := range keys.busy {
		bs, bk, bn = append(bs, k.stage), append(bk, k.key), append(bn, int64(n))
	}
	rows, err := tx.Query("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) "+claimKeyedSQL, pq.Array(names), pq.Array([]int64{64}),
		pq.Array(limits), pq.Array(bs), pq.Array(bk), pq.Array(bn))
	if err != nil {
		t.Fatal(err)
	}
	var plan strings.Builder
	for rows.Next() {
		var line string
		rows.Scan(&line)
		plan.WriteString(line + "\n")
	}
	rows.Close()
	buffers := func(re string) int {
		m := regexp.MustCompile(re + `.*\n\s+Buffers: shared hit=(\d+)(?: read=(\d+))?`).FindStringSubmatch(plan.String())
		if m == nil {
			t.Fatalf("no buffer count for %s in the plan:\n%s", re, plan.String())
		}
		hit, _ := strconv.Atoi(m[1])
		read, _ := strconv.Atoi(m[2])
		return hit + read
	}
	// What the claim reads to decide: everything but the claimed rows' writes (the UPDATE's
	// own pages, less the pick it runs as an InitPlan).
	total := buffers(`(?m)^\S`)
	writes := buffers(`Update on workqueue q `) - buffers(`CTE Scan on pick `)
	return total - writes, plan.String()
}

// With 100,000 pending rows of one key at its limit and 1,000 rows of other keys, a claim
// touches what it touches with the 1,000 alone (within a few pages for the skip over the
// parked key), once the saturated key's rows are parked; while they are being parked, each
// claim still takes a full cap of the other keys' rows.
func TestControlsSaturatedKeyClaimCost(t *testing.T) {
	if testing.Short() {
		t.Skip("100,000 rows")
	}
	if !strings.Contains(claimKeyedSQL, fmt.Sprintf("LIMIT %d) r\n              LIMIT %d))", parkChunk, parkChunk)) {
		t.Fatalf("claimKeyedSQL's parking LIMIT is not parkChunk (%d)", parkChunk)
	}
	s := newTestSchema(t)
	s.exec(t, `INSERT INTO workqueue (stage, concurrency_key) SELECT 'a', 'hot' FROM generate_series(1, 100000)`)
	s.exec(t, `INSERT INTO workqueue (stage, concurrency_key) SELECT 'a', 'k' || g FROM generate_series(1, 1000) g`)
	s.exec(t, `ANALYZE workqueue`)
	conn := openLockConn(t, s)
	var cl claimer
	defer cl.close()
	keys := &keyLoad{limit: map[string]int{"a": 2}, busy: map[stageKey]int{{"a", "hot"}: 2}}
	claims := 0
	for {
		res, err := cl.claim(context.Background(), conn, map[string]int{"a": 64}, keys)
		if err != nil {
			t.Fatal(err)
		}
		claims++
		for _, m := range res.byStage["a"] {
			if m.key == "hot" {
				t.Fatalf("claimed a row of the saturated key")
			}
		}
		if others := s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'pending' AND concurrency_key <> 'hot'`); res.total != 64 && others > 0 {
			t.Fatalf("claim %d took %d rows while %d other rows were pending: the saturated key held the others back", claims, res.total, others)
		}
		if res.parked > parkChunk {
			t.Fatalf("one claim parked %d rows", res.parked)
		}
		if res.parked == 0 {
			break
		}
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE key_parked`); n != 100000 {
		t.Fatalf("%d rows parked, want 100000", n)
	}
	t.Logf("parked in %d claims", claims)
	s.exec(t, `UPDATE workqueue SET status = 'done' WHERE status = 'running'`)
	s.exec(t, `INSERT INTO workqueue (stage, concurrency_key) SELECT 'a', 'k' || g FROM generate_series(1, 1000) g`)
	s.exec(t, `VACUUM ANALYZE workqueue`)
	sat, satPlan := claimBuffers(t, s, keys)

	// The same table without the backlog: the hot rows done (the table and its primary key
	// as big, the pending indexes holding the 1,000 alone).
	base := newTestSchema(t)
	base.exec(t, `INSERT INTO workqueue (stage, concurrency_key, status) SELECT 'a', 'hot', 'done' FROM generate_series(1, 101000)`)
	base.exec(t, `INSERT INTO workqueue (stage, concurrency_key) SELECT 'a', 'k' || g FROM generate_series(1, 1000) g`)
	base.exec(t, `VACUUM ANALYZE workqueue`)
	alone, alonePlan := claimBuffers(t, base, &keyLoad{limit: map[string]int{"a": 2}})
	t.Logf("claim of 64 with 100,000 parked rows of a saturated key and 1,000 others: read %d buffers; with the 1,000 alone: %d", sat, alone)
	// The skip over the one parked key costs a few pages; reading its rows would cost hundreds.
	if sat > alone+16 {
		t.Errorf("the claim touched %d buffers with the saturated key's backlog, %d without it\n%s\n---\n%s", sat, alone, satPlan, alonePlan)
	}
	if os.Getenv("PEPSI_SHOW_PLAN") != "" {
		t.Logf("saturated:\n%s\nalone:\n%s", satPlan, alonePlan)
	}
}

// Rows parked under a KEY_LIMIT that a reload then removed are not stranded: unparkSQL puts
// back those of stages without a limit, parkChunk per run, leaves a limited stage's alone,
// and the plain claims that follow take every one of them, once each.
func TestControlsKeyLimitRemovedUnparks(t *testing.T) {
	if !strings.Contains(unparkSQL, fmt.Sprintf("LIMIT %d\n", parkChunk)) {
		t.Fatalf("unparkSQL's LIMIT is not parkChunk (%d)", parkChunk)
	}
	s := newTestSchema(t)
	const n = 5000
	s.exec(t, `INSERT INTO workqueue (stage, concurrency_key) SELECT st, 'hot' FROM generate_series(1, $1), unnest(ARRAY['a', 'b']) st`, n)
	conn := openLockConn(t, s)
	var cl claimer
	defer cl.close()
	ctx := context.Background()
	saturated := &keyLoad{limit: map[string]int{"a": 1, "b": 1}, busy: map[stageKey]int{{"a", "hot"}: 1, {"b", "hot"}: 1}}
	for {
		res, err := cl.claim(ctx, conn, map[string]int{"a": 64, "b": 64}, saturated)
		if err != nil {
			t.Fatal(err)
		}
		if res.total != 0 {
			t.Fatalf("claimed %d rows of a key at its limit", res.total)
		}
		if res.parked == 0 {
			break
		}
	}
	parkedOf := func(stage string) int {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE key_parked AND stage = $1`, stage)
	}
	parkedA, parkedB := parkedOf("a"), parkedOf("b")
	if parkedA < n-64 || parkedB < n-64 {
		t.Fatalf("%d and %d of %d rows parked: the test did not park the keys", parkedA, parkedB, n)
	}

	// a's KEY_LIMIT removed, b keeps its own: a's rows come back in chunks, b's stay.
	unparked, runs := int64(0), 0
	for {
		got, left, err := cl.unpark(ctx, conn, map[string]int{"b": 1})
		if err != nil {
			t.Fatal(err)
		}
		runs++
		if got > parkChunk {
			t.Fatalf("one run unparked %d rows", got)
		}
		unparked += got
		if got < parkChunk {
			if left {
				t.Errorf("the last run (%d rows) says parked rows of a are left; nobody holds any", got)
			}
			break
		}
	}
	if unparked != int64(parkedA) || parkedOf("a") != 0 {
		t.Errorf("unparked %d rows in %d runs, %d were parked; %d still are", unparked, runs, parkedA, parkedOf("a"))
	}
	if left := parkedOf("b"); left != parkedB {
		t.Errorf("b keeps its KEY_LIMIT, yet %d of its %d parked rows were unparked", parkedB-left, parkedB)
	}

	// The plain claim (no limits, nothing in flight) takes all of a, once each.
	var got []int64
	claims := 0
	for claims = 1; claims < 1000; claims++ {
		res, err := cl.claim(ctx, conn, map[string]int{"a": 256}, &keyLoad{})
		if err != nil {
			t.Fatal(err)
		}
		if res.total == 0 {
			break
		}
		for _, m := range res.byStage["a"] {
			got = append(got, m.id)
		}
	}
	if len(got) != n {
		t.Fatalf("claimed %d of %d rows in %d claims", len(got), n, claims)
	}
	seen := map[int64]bool{}
	for _, id := range got {
		if seen[id] {
			t.Fatalf("row %d claimed twice", id)
		}
		seen[id] = true
	}
	if left := s.count(t, `SELECT count(*) FROM workqueue WHERE stage = 'a' AND (status <> 'running' OR key_parked)`); left != 0 {
		t.Errorf("%d rows of a not claimed or still parked", left)
	}
}

// The daemon unparks on its own: rows parked by one run come back when the next starts
// without the limit, and rows parked under a limit a reload removes come back after the
// reload; every message is done, none is left parked.
func TestControlsKeyLimitRemovedDaemon(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, keylogDDL)
	conf := baseConf(s, "") + stageConf(t, "a", "", "PARALLELISM = 8\nQUEUE_LIMIT = 16")
	limit := func() {
		s.exec(t, `INSERT INTO config (section, key, value) VALUES ('stage-a', 'KEY_LIMIT', '1')`)
	}
	unlimit := func() { s.exec(t, `DELETE FROM config WHERE section = 'stage-a' AND key = 'KEY_LIMIT'`) }
	enqueue := func() {
		s.exec(t, `INSERT INTO workqueue (stage, payload, concurrency_key)
			SELECT 'a', '{"sleep_ms": 20}', 'hot' FROM generate_series(1, 400)`)
	}
	parked := func() int { return s.count(t, `SELECT count(*) FROM workqueue WHERE key_parked`) }
	logged := func(d *daemon) int { return strings.Count(d.log.String(), "go back to pending") }

	// Parked by one run, unparked by the next.
	limit()
	enqueue()
	d := startDaemon(t, conf, "controls")
	waitFor(t, 30*time.Second, "rows of the hot key parked", func() bool { return parked() > 0 })
	d.cmd.Process.Signal(syscall.SIGKILL)
	d.wait(10 * time.Second)
	unlimit()
	d = startDaemon(t, conf, "controls")
	d.waitLog("go back to pending", 30*time.Second)
	waitFor(t, 60*time.Second, "the first 400 done", func() bool { return countStatus(t, s, "done") == 400 })

	// Parked under a limit that a reload then removes.
	limit()
	d.waitLog("stage graph reloaded", 30*time.Second)
	enqueue()
	waitFor(t, 30*time.Second, "rows of the hot key parked again", func() bool { return parked() > 0 })
	unlimit()
	waitFor(t, 30*time.Second, "a second unparking", func() bool { return logged(d) == 2 })
	waitFor(t, 60*time.Second, "all 800 done", func() bool { return countStatus(t, s, "done") == 800 })
	d.stop()
	if n := parked(); n != 0 {
		t.Errorf("%d rows left parked", n)
	}
}

// ---- all four ----

// One message with a priority, a run_at, a concurrency key at its limit and a unique key:
// a duplicate is refused, it is not claimed before run_at nor while its key is at its limit,
// it goes before the larger priorities of its key, and its unique key is free once it is done.
func TestControlsAllFour(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, keylogDDL)
	conf := baseConf(s, "") + stageConf(t, "a", "", "PARALLELISM = 2\nQUEUE_LIMIT = 4\nKEY_LIMIT = 1")
	conf = strings.Replace(conf, "POLL_INTERVAL = 1", "POLL_INTERVAL = 1h", 1)
	d := startDaemon(t, conf, "controls")
	// The key is busy for a while: a slow message, then three more of priority 5.
	s.exec(t, `INSERT INTO workqueue (stage, payload, concurrency_key) VALUES ('a', '{"sleep_ms": 2500}', 'k')`)
	waitFor(t, 30*time.Second, "the slow message started", func() bool {
		return s.count(t, `SELECT count(*) FROM keylog WHERE ev = 'start'`) == 1
	})
	s.exec(t, `INSERT INTO workqueue (stage, payload, concurrency_key, priority) SELECT 'a', '{"sleep_ms": 10}', 'k', 5 FROM generate_series(1, 3)`)
	insert := func() (int64, bool) {
		rows, err := s.DB.Query(`INSERT INTO workqueue (stage, payload, priority, run_at, concurrency_key, unique_key)
			VALUES ('a', '{"sleep_ms": 10}', -1, now() + interval '1 second', 'k', 'u-1')
			ON CONFLICT DO NOTHING RETURNING workqueue_id`)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		var id int64
		if !rows.Next() {
			return 0, false
		}
		rows.Scan(&id)
		return id, true
	}
	id, ok := insert()
	if !ok {
		t.Fatal("the first insert of u-1 inserted nothing")
	}
	if _, ok := insert(); ok {
		t.Fatal("a duplicate of u-1 was inserted")
	}
	waitFor(t, 60*time.Second, "every message done", func() bool { return countStatus(t, s, "done") == 5 })
	// Due at run_at, but the key was busy until the slow message ended: claimed after both,
	// and before the three priority-5 messages of its key.
	var claimed, runAt, slowLeft time.Time
	if err := s.DB.QueryRow(`SELECT w.claimed_at, w.run_at, (SELECT at FROM keylog WHERE ev = 'left' ORDER BY at LIMIT 1)
		FROM workqueue w WHERE workqueue_id = $1`, id).Scan(&claimed, &runAt, &slowLeft); err != nil {
		t.Fatal(err)
	}
	if claimed.Before(runAt) || claimed.Before(slowLeft) {
		t.Errorf("claimed at %v: run_at %v, the key was free from %v", claimed, runAt, slowLeft)
	}
	order := ids(t, s, `SELECT id FROM keylog WHERE ev = 'start' ORDER BY at`)
	if len(order) != 5 || order[1] != id {
		t.Errorf("start order %v: want the priority -1 message (%d) second, after the slow one", order, id)
	}
	if _, ok := insert(); !ok {
		t.Error("u-1 is not free again once its message is done")
	}
	d.stop()
}

// With the statistics of a table analysed before its backlog arrived (as a run starts), a
// key's rows are found through workqueue_keyed, not by reading the stage's pending rows and
// filtering on the key; custom and generic plans alike.
func TestControlsClaimPlanStaleStatistics(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `VACUUM ANALYZE workqueue`)
	s.exec(t, `INSERT INTO workqueue (stage, concurrency_key) SELECT 's1', 'k' || (g % 1000) FROM generate_series(1, 20000) g`)
	s.exec(t, `UPDATE workqueue SET key_parked = true WHERE workqueue_id > 4000 AND workqueue_id % 3 = 0`)
	conn := openLockConn(t, s)
	ctx := context.Background()
	bs, bk, bn := []string{}, []string{}, []int64{}
	for i := 0; i < 1000; i += 2 {
		bs, bk, bn = append(bs, "s1"), append(bk, "k"+strconv.Itoa(i)), append(bn, 1)
	}
	for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
		if _, err := conn.ExecContext(ctx, "SET plan_cache_mode = "+mode); err != nil {
			t.Fatal(err)
		}
		tx, err := conn.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		rows, err := tx.QueryContext(ctx, "EXPLAIN (ANALYZE, COSTS OFF) "+claimKeyedSQL, pq.Array([]string{"s1"}), pq.Array([]int64{2048}),
			pq.Array([]int64{2}), pq.Array(bs), pq.Array(bk), pq.Array(bn))
		if err != nil {
			t.Fatal(err)
		}
		var plan strings.Builder
		for rows.Next() {
			var line string
			rows.Scan(&line)
			plan.WriteString(line + "\n")
		}
		rows.Close()
		tx.Rollback()
		p := plan.String()
		if strings.Contains(p, "Seq Scan on workqueue") {
			t.Errorf("%s: a sequential scan of workqueue:\n%s", mode, p)
		}
		if !strings.Contains(p, "using workqueue_keyed") {
			t.Errorf("%s: a key's rows are not read through workqueue_keyed:\n%s", mode, p)
		}
		if regexp.MustCompile(`using workqueue_pending on workqueue \w+ \(actual[^\n]*loops=([2-9]|\d\d+)\)`).MatchString(p) {
			t.Errorf("%s: workqueue_pending is read per key:\n%s", mode, p)
		}
	}
}

// Within a key, messages are claimed in priority, then enqueue, order, whether they wait
// parked or not, one at a time at KEY_LIMIT = 1 while unkeyed messages flow.
func TestControlsKeyOrder(t *testing.T) {
	s := newTestSchema(t)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	// Enough rows of k that the walk meets more than parking's threshold (64) it cannot take.
	for i := 0; i < 250; i++ {
		key := sql.NullString{String: "k", Valid: i%5 != 0} // one in five has no key
		s.exec(t, `INSERT INTO workqueue (stage, concurrency_key, priority) VALUES ('a', $1, $2)`, key, rng.IntN(5)-2)
	}
	conn := openLockConn(t, s)
	var cl claimer
	defer cl.close()
	keys := &keyLoad{limit: map[string]int{"a": 1}}
	var got []int64
	var parked int64
	for round := 0; round < 400; round++ {
		res, err := cl.claim(context.Background(), conn, map[string]int{"a": 128}, keys)
		if err != nil {
			t.Fatal(err)
		}
		parked += res.parked
		ms := res.byStage["a"]
		n := 0
		for _, m := range ms {
			if m.key == "k" {
				got = append(got, m.id)
				n++
			}
		}
		if n > 1 {
			t.Fatalf("claim took %d rows of key k at KEY_LIMIT = 1", n)
		}
		keys.take(ms)
		var ids []int64
		for _, m := range ms {
			ids = append(ids, m.id)
		}
		// The new rows finish at once: the next claim sees their slots free.
		s.exec(t, `UPDATE workqueue SET status = 'done' WHERE workqueue_id = ANY ($1)`, pq.Array(ids))
		keys.release(ms...)
		if s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'pending'`) == 0 {
			break
		}
		if round == 2 {
			// Late arrivals of the key with the smallest priority go first among what is left.
			s.exec(t, `INSERT INTO workqueue (stage, concurrency_key, priority) VALUES ('a', 'k', -3), ('a', 'k', -3)`)
		}
	}
	if parked == 0 {
		t.Error("no row of k was ever parked: the test did not reach the parked path")
	}
	// Replay: at each claim of k, the row taken was the first in (priority, id) of those of k
	// still pending then, which is the order of got among rows inserted before it was taken.
	want := ids(t, s, `SELECT workqueue_id FROM workqueue WHERE concurrency_key = 'k' ORDER BY priority, workqueue_id`)
	late := ids(t, s, `SELECT workqueue_id FROM workqueue WHERE concurrency_key = 'k' AND priority = -3 ORDER BY workqueue_id`)
	if len(got) != len(want) {
		t.Fatalf("took %d rows of k, want %d", len(got), len(want))
	}
	// The two late rows were inserted after three claims: they come right after the rows
	// taken before, then the rest in order.
	initial := slices.DeleteFunc(slices.Clone(want), func(id int64) bool { return slices.Contains(late, id) })
	wantOrder := append(append(slices.Clone(initial[:3]), late...), initial[3:]...)
	if !slices.Equal(got, wantOrder) {
		t.Errorf("key k taken in order %v\nwant %v", got, wantOrder)
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE status <> 'done'`); n != 0 {
		t.Errorf("%d rows left", n)
	}
}

// The children of a fan-out split, by payloads, by range and by bounds, start with their
// parent's priority (an urgent parent's work stays urgent); they do not take its
// concurrency_key or unique_key (a child's key would make its siblings wait on one another,
// and a unique key cannot be shared).
func TestControlsFanoutChildrenPriority(t *testing.T) {
	s := newTestSchema(t)
	for i, split := range []func(parent int64) int64{
		func(parent int64) int64 { return faninSplitPayloads(t, s.DB, parent, 3) },
		func(parent int64) int64 { return faninSplitRange(t, s.DB, parent, 1, 300, 3, 1) },
		func(parent int64) int64 {
			var fid int64
			if err := s.DB.QueryRow(`SELECT fanout_split_bounds($1, 'split', 'cont', 'child', '{1,10,20,30}')`, parent).Scan(&fid); err != nil {
				t.Fatal(err)
			}
			return fid
		},
	} {
		parent := faninParent(t, s, "split")
		s.exec(t, `UPDATE workqueue SET priority = -7, concurrency_key = 'relay', unique_key = $2 WHERE workqueue_id = $1`,
			parent, fmt.Sprintf("order-%d", i))
		fid := split(parent)
		if n := s.count(t, `SELECT count(*) FROM workqueue WHERE fanout_id = $1`, fid); n != 3 {
			t.Fatalf("split %d: %d children, want 3", i, n)
		}
		if n := s.count(t, `SELECT count(*) FROM workqueue WHERE fanout_id = $1
		                     AND (priority <> -7 OR concurrency_key IS NOT NULL OR unique_key IS NOT NULL)`, fid); n != 0 {
			t.Errorf("split %d: %d children without the parent's priority, or with its keys", i, n)
		}
	}
}
