// claim.go: taking pending rows for every stage with free capacity, in one statement.
//
// The claim is the only pending->running writer, and there is exactly one claimer per system
// (instance.go), so it needs no FOR UPDATE SKIP LOCKED: each stage's LATERAL subquery walks
// the partial index of pending rows in id order and stops at that stage's free capacity. The
// claim token (one sequence value per statement) goes into every claimed row; the dispatcher's
// later writes to those rows are guarded by it. The statement also returns the earliest due
// time of paused rows, so retry scheduling costs no query of its own.
//
// The claim commits asynchronously: its final row sets synchronous_commit = off for the
// statement's own transaction (set_config(..., true)), so the coordinator's loop does not wait
// for a WAL flush per claim, and the lock connection's other writes (failures, resets, fan-in)
// keep synchronous commits. A claim is a lease, not a result. If the server crashes before
// its WAL is flushed, its rows are pending again as if it had never run, and the reconcile
// after the re-lock forgets the messages it had handed out (reconcile.go), as after a failover
// to an asynchronous standby. Nothing a stage commits can outlive the claim it ran under: WAL is
// flushed in order, so the stage's own commit flushes every claim before it. A lost claim can
// take the sequence's advance with it, so a token may be handed out twice; the writes of a
// forgotten message are dropped (outcome.go), so that never matters. Measured with
// bench/pipeline -only W3, builds alternating on a quiet machine: enqueue → handler start p50
// 0.83-0.90 ms against 1.11-1.17 ms with the claim's flush; W1 unchanged (bench/pipeline controls).

package main

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/lib/pq"
)

// claimKeyedSQL takes up to cap pending rows per stage, smallest priority first, then in id
// (enqueue) order, at most KEY_LIMIT - in flight rows per concurrency key. $1 = stage names,
// $2 = capacities, $3 = KEY_LIMITs (0: none); $4, $5, $6 = (stage, key, messages in workers'
// queues) for every key the coordinator has in flight: the coordinator, not the table, knows
// what sits in workers' queues (a pipelined message counts from its claim to its reply).
//
// Its shape keeps the plan right whatever the statistics say (a queue table's statistics are
// always stale: a burst lands between two ANALYZEs), each choice measured with EXPLAIN ANALYZE:
//   - The ids are picked first, as an array (an InitPlan), and the UPDATE finds them through
//     the primary key. Joined instead, the planner cannot see that each LATERAL stops at its
//     cap and hashes every pending row (40 ms per claim with 100,000 pending, against 1-2 ms).
//   - The walk orders by (stage, priority, id) with stage = ANY (ARRAY[...]): only the partial
//     pending index yields that order. With stage = c.stage the planner treats stage as a
//     constant, drops it from the order, and with stale statistics walks the primary key past
//     every claimed or done row (17 ms after 8,000 done rows and growing, against 1.9 ms).
//   - The UPDATE's status test is wrapped in coalesce() (see the SQL), which the
//     partial index's predicate cannot match: with stale statistics the planner would scan
//     all pending rows through it and filter by id (218 ms with 20,000 pending). It still
//     re-checks the row under READ COMMITTED, so a row changed by someone else between the
//     pick and the update (an operator, say) is skipped, not overwritten.
//   - The inbox test reads the first inbox id through its primary key rather than EXISTS,
//     which scans the heap and its dead rows until autovacuum has run.
//
// Concurrency keys (KEY_LIMIT) cost nothing for rows without one: the walk is the only read
// (its key filter stops at concurrency_key IS NULL); parked is one probe of an empty index,
// and blocked, walked, peek, pkeys and to_park are empty. For keyed rows, each choice
// measured in the controls benchmark (bench/pipeline/workloads_controls.go) or a test:
//   - A key's rows in the walk are taken from the walk, at most its free slots (KEY_LIMIT
//     less what the coordinator has in workers' queues), numbered within the key: the walk
//     is in (priority, id) order, so they are the key's first rows. Routing every walked key
//     through a per-key lookup, as a first version did, cost two index probes per key per
//     claim (1,000 keys: 3,247 messages/s against 5,274 without KEY_LIMIT, 273 µs of claim
//     per claimed row against 94).
//   - The walk skips the rows of blocked keys: those the coordinator has at their limit, and
//     those with parked rows (served by key, below), through a hashed subplan on the index's
//     own entries. Without it a key with one free slot put its unparked backlog in front of
//     the other keys until all of it was parked (1,000 other keys behind 100,000 rows of one:
//     10.7 s against 1.4 s alone); a per-row = ANY (array) there was quadratic in the keys.
//   - A key whose rows fill the walk beyond its free slots by 64 or more, or that fills as
//     much of the unfiltered front (peek, read only while some key is at its limit), has its
//     next pending rows parked (key_parked), at most parkChunk per claim: parked rows leave
//     workqueue_pending, so later walks never read them again (with 100,000 parked rows of one
//     key and 1,000 others, a claim reads what it reads for the 1,000: TestControls-
//     SaturatedKeyClaimCost). A key with a few rows ahead of its slots is not parked: a
//     round-robin backlog over 1,000 keys would otherwise be parked whole and served key by
//     key. A key with parked rows goes on being parked until none of it is left unparked.
//   - parked lists the keys with parked rows by a skip scan of workqueue_parked: one probe
//     per parked key, whatever its backlog, so a key whose slot freed is found again without
//     any memory in the coordinator (a restart, an operator's edit lose nothing). Those keys'
//     next rows come from workqueue_keyed and workqueue_parked merged in (priority, id) order,
//     so a key's rows start in that order whether or not they were parked.
//   - A key's unparked rows are looked up as key >= k AND key <= k, not key = k: equality makes
//     the key a constant to the planner, and then workqueue_pending, ordered (stage, priority,
//     id), serves the lookup as well as workqueue_keyed, by reading every pending row of the
//     stage and filtering on the key; with the statistics of a table analysed before its
//     backlog it chose that (9 s claims, 339 messages/s with 1,000 keys:
//     TestControlsClaimPlanStaleStatistics). As a range the key stays in the ORDER BY, which
//     only workqueue_keyed yields.
//   - The walk's rows are at most cap per stage, so only rows of keys served by key (keyed)
//     can make a stage's pick exceed its cap: the window that cuts them runs only then. Run
//     always, its sort and row_number over 2048 rows took the pick from 0.7 ms to 4-40 ms under
//     EXPLAIN ANALYZE on the W1 backlog (bench controls, W1's EXPLAIN).
//   - The ids to park, like the ids to claim, are picked through the index first and updated
//     by primary key; both UPDATEs read one snapshot and touch disjoint rows (park excludes
//     the pick, through a hashed subplan: = ANY (ARRAY(...)) there compared each candidate
//     with every picked id).
//
// After the claimed rows come, for the open fan-out groups of the claimed children, one row
// each with the group's remaining children as its counters say (workqueue_id NULL, fanout_id
// set): the wake rule's "may this group be complete?" needs it, and without it the first
// completion of every group would cost a flush. The final row (workqueue_id and fanout_id
// NULL) carries the earliest paused retry_at (as seconds from the server's now(): dueAt),
// whether the fan-in inbox holds unapplied events (for writers the coordinator cannot hear),
// and how many rows this claim parked.
const claimKeyedSQL = `
WITH RECURSIVE stages AS (
    SELECT * FROM unnest($1::text[], $2::int[], $3::int[]) AS c(stage, cap, key_limit)
), busy AS (
    SELECT * FROM unnest($4::text[], $5::text[], $6::int[]) AS b(stage, key, n)
), parked (stage, key) AS (
    (SELECT w.stage, w.concurrency_key FROM workqueue w
      WHERE w.status = 'pending' AND w.key_parked
      ORDER BY w.stage, w.concurrency_key LIMIT 1)
    UNION ALL
    SELECT n.stage, n.key FROM parked k CROSS JOIN LATERAL (
           SELECT w.stage, w.concurrency_key AS key FROM workqueue w
            WHERE w.status = 'pending' AND w.key_parked AND (w.stage, w.concurrency_key) > (k.stage, k.key)
            ORDER BY w.stage, w.concurrency_key LIMIT 1) n
), full_keys AS MATERIALIZED (
    SELECT b.stage, b.key FROM busy b JOIN stages c ON c.stage = b.stage
     WHERE c.key_limit > 0 AND b.n >= c.key_limit
), blocked AS MATERIALIZED (
    SELECT stage, key FROM full_keys UNION SELECT stage, key FROM parked
), walk AS MATERIALIZED (
    SELECT c.stage, c.cap, c.key_limit, p.workqueue_id, p.priority, p.concurrency_key
      FROM stages c
     CROSS JOIN LATERAL (
           SELECT w.workqueue_id, w.priority, w.concurrency_key FROM workqueue w
            WHERE w.status = 'pending' AND NOT w.key_parked AND w.stage = ANY (ARRAY[c.stage])
              AND (w.concurrency_key IS NULL
                   OR NOT ((w.stage, w.concurrency_key) IN (SELECT stage, key FROM blocked)))
            ORDER BY w.stage, w.priority, w.workqueue_id
            LIMIT c.cap) p
), walked AS MATERIALIZED (
    SELECT w.stage, w.cap, w.workqueue_id, w.priority, w.concurrency_key,
           greatest(w.key_limit - coalesce(b.n, 0), 0) AS free,
           row_number() OVER (PARTITION BY w.stage, w.concurrency_key ORDER BY w.priority, w.workqueue_id) AS kn
      FROM walk w
      LEFT JOIN busy b ON b.stage = w.stage AND b.key = w.concurrency_key
     WHERE w.concurrency_key IS NOT NULL AND w.key_limit > 0
), peek AS (
    SELECT c.stage, p.concurrency_key AS key, count(*) AS n
      FROM stages c
     CROSS JOIN LATERAL (
           SELECT w.concurrency_key FROM workqueue w
            WHERE EXISTS (SELECT 1 FROM full_keys f WHERE f.stage = c.stage)
              AND w.status = 'pending' AND NOT w.key_parked AND w.stage = ANY (ARRAY[c.stage])
            ORDER BY w.stage, w.priority, w.workqueue_id
            LIMIT c.cap) p
     WHERE (c.stage, p.concurrency_key) IN (SELECT stage, key FROM full_keys)
     GROUP BY c.stage, p.concurrency_key
), pkeys AS MATERIALIZED (
    SELECT k.stage, k.key, c.cap, c.key_limit,
           least(CASE WHEN c.key_limit > 0 THEN greatest(c.key_limit - coalesce(b.n, 0), 0) ELSE c.cap END, c.cap) AS free
      FROM parked k
      JOIN stages c ON c.stage = k.stage
      LEFT JOIN busy b ON b.stage = k.stage AND b.key = k.key
), keyed AS (
    SELECT k.stage, k.cap, r.workqueue_id, r.priority, r.concurrency_key
      FROM pkeys k
     CROSS JOIN LATERAL (
           SELECT u.* FROM (
                  (SELECT w.workqueue_id, w.priority, w.concurrency_key FROM workqueue w
                    WHERE w.status = 'pending' AND w.concurrency_key IS NOT NULL AND NOT w.key_parked
                      AND w.stage = k.stage AND w.concurrency_key >= k.key AND w.concurrency_key <= k.key
                    ORDER BY w.stage, w.concurrency_key, w.priority, w.workqueue_id LIMIT k.free)
                  UNION ALL
                  (SELECT w.workqueue_id, w.priority, w.concurrency_key FROM workqueue w
                    WHERE w.status = 'pending' AND w.key_parked
                      AND w.stage = k.stage AND w.concurrency_key = k.key
                    ORDER BY w.stage, w.concurrency_key, w.priority, w.workqueue_id LIMIT k.free)) u
            ORDER BY u.priority, u.workqueue_id LIMIT k.free) r
), pick AS MATERIALIZED (
    SELECT stage, workqueue_id FROM walk
     WHERE (concurrency_key IS NULL OR NOT key_limit > 0) AND NOT EXISTS (SELECT 1 FROM keyed)
    UNION ALL
    SELECT stage, workqueue_id FROM walked WHERE kn <= free AND NOT EXISTS (SELECT 1 FROM keyed)
    UNION ALL
    SELECT x.stage, x.workqueue_id
      FROM (SELECT u.*, row_number() OVER (PARTITION BY u.stage ORDER BY u.priority, u.workqueue_id) AS rn
              FROM (SELECT stage, cap, workqueue_id, priority FROM walk
                     WHERE concurrency_key IS NULL OR NOT key_limit > 0
                    UNION ALL
                    SELECT stage, cap, workqueue_id, priority FROM walked WHERE kn <= free
                    UNION ALL
                    SELECT stage, cap, workqueue_id, priority FROM keyed) u) x
     WHERE x.rn <= x.cap AND EXISTS (SELECT 1 FROM keyed)
), claimed AS (
    UPDATE workqueue q
       SET status = 'running', key_parked = false,
           claim = (SELECT nextval('workqueue_claim_seq')), claimed_at = now(),
           status_at = now()
     WHERE q.workqueue_id = ANY (ARRAY(SELECT workqueue_id FROM pick))
       AND coalesce(q.status, '') = 'pending'
    RETURNING q.workqueue_id, q.stage, q.claim, q.attempts, q.fanout_id, q.priority, q.concurrency_key
), to_park AS (
    SELECT stage, concurrency_key AS key FROM walked
     GROUP BY stage, concurrency_key, free HAVING count(*) - free >= 64
    UNION
    SELECT k.stage, k.key FROM pkeys k WHERE k.key_limit > 0
    UNION
    SELECT stage, key FROM peek WHERE n >= 64
), parking AS (
    UPDATE workqueue q SET key_parked = true
     WHERE q.workqueue_id = ANY (ARRAY(
             SELECT r.workqueue_id
               FROM to_park s
              CROSS JOIN LATERAL (
                    SELECT w.workqueue_id FROM workqueue w
                     WHERE w.status = 'pending' AND w.concurrency_key IS NOT NULL AND NOT w.key_parked
                       AND w.stage = s.stage AND w.concurrency_key >= s.key AND w.concurrency_key <= s.key
                       AND w.workqueue_id NOT IN (SELECT workqueue_id FROM pick)
                     ORDER BY w.stage, w.concurrency_key, w.priority, w.workqueue_id
                     LIMIT 2000) r
              LIMIT 2000))
       AND coalesce(q.status, '') = 'pending'
    RETURNING 1
)
SELECT workqueue_id, stage, claim, attempts, fanout_id, priority, concurrency_key,
       NULL::int, NULL::float8, NULL::boolean, NULL::bigint FROM claimed
UNION ALL
SELECT NULL, NULL, NULL, NULL, f.fanout_id, NULL, NULL, f.expected_n - f.done_n - f.failed_n, NULL, NULL, NULL
  FROM fanout f
 WHERE f.fanout_id = ANY (ARRAY(SELECT DISTINCT fanout_id FROM claimed WHERE fanout_id IS NOT NULL))
   AND f.state = 'open'
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       extract(epoch FROM (SELECT min(retry_at) FROM workqueue WHERE status = 'paused') - now())::float8,
       (SELECT id FROM fanin_event ORDER BY id LIMIT 1) IS NOT NULL, (SELECT count(*) FROM parking)
 WHERE set_config('synchronous_commit', 'off', true) = 'off'`

// claimSQL is the claim when no stage asked for has a KEY_LIMIT, the common case: the walk
// of workqueue_pending and nothing else, as before the controls. claimKeyedSQL's CTEs cost
// a claim with no key about three times this one's time (W1: 12,500 messages/s against
// 33,700, bench/pipeline -only W1), though each read an empty set. $1 = stage names,
// $2 = capacities. Its rows have claimKeyedSQL's columns, the parked count always 0.
//
// It does not unpark: a data-modifying CTE runs on every execution even when it finds
// nothing, and one here cost W1 about 10 % (bench/pipeline controls). unparkSQL does that,
// on its own, only when the stage table says rows may be parked without a limit.
const claimSQL = `
WITH claimed AS (
    UPDATE workqueue q
       SET status = 'running', claim = (SELECT nextval('workqueue_claim_seq')), claimed_at = now(),
           status_at = now()
     WHERE q.workqueue_id = ANY (ARRAY(
             SELECT p.workqueue_id
               FROM unnest($1::text[], $2::int[]) AS c(stage, cap)
              CROSS JOIN LATERAL (
                    SELECT w.workqueue_id FROM workqueue w
                     WHERE w.status = 'pending' AND NOT w.key_parked AND w.stage = ANY (ARRAY[c.stage])
                     ORDER BY w.stage, w.priority, w.workqueue_id
                     LIMIT c.cap) p))
       AND coalesce(q.status, '') = 'pending'
    RETURNING q.workqueue_id, q.stage, q.claim, q.attempts, q.fanout_id, q.priority, q.concurrency_key
)
SELECT workqueue_id, stage, claim, attempts, fanout_id, priority, concurrency_key,
       NULL::int, NULL::float8, NULL::boolean, NULL::bigint FROM claimed
UNION ALL
SELECT NULL, NULL, NULL, NULL, f.fanout_id, NULL, NULL, f.expected_n - f.done_n - f.failed_n, NULL, NULL, NULL
  FROM fanout f
 WHERE f.fanout_id = ANY (ARRAY(SELECT DISTINCT fanout_id FROM claimed WHERE fanout_id IS NOT NULL))
   AND f.state = 'open'
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       extract(epoch FROM (SELECT min(retry_at) FROM workqueue WHERE status = 'paused') - now())::float8,
       (SELECT id FROM fanin_event ORDER BY id LIMIT 1) IS NOT NULL, 0::bigint
 WHERE set_config('synchronous_commit', 'off', true) = 'off'`

// The claims that skip locked rows. The claim walks pending rows and updates them without
// FOR UPDATE: it is the only pending->running writer (instance.go), and a row lock costs a WAL
// record per claimed row. But a transaction that holds a pending row's lock (a producer's or
// an operator's UPDATE of it, left open in psql) makes the claim's UPDATE wait for it, and
// with it every stage's claim: until the statement budget cancels the claim, which then meets
// the same row again (TestClaimRowLockedElsewhere: another stage's messages did not run in 40
// s). So a claim cancelled at its budget puts the claimer in skip mode for skipLockedFor, in
// which these variants lock what they pick, FOR NO KEY UPDATE SKIP LOCKED, and pass over rows
// another transaction holds; the ordinary claim, the hot path, stays as it is. A locking
// clause is not allowed on a UNION's branches, so the keyed claim's two per-key branches
// lock inside a subquery each.
var (
	claimSkipLockedSQL = mustReplace(claimSQL,
		"LIMIT c.cap) p))", "LIMIT c.cap FOR NO KEY UPDATE OF w SKIP LOCKED) p))", 1)
	claimKeyedSkipLockedSQL = func() string {
		s := mustReplace(claimKeyedSQL, // the walk
			"LIMIT c.cap) p\n), walked", "LIMIT c.cap FOR NO KEY UPDATE OF w SKIP LOCKED) p\n), walked", 1)
		s = mustReplace(s, // the keyed claim's two per-key branches, each in a subquery
			"(SELECT w.workqueue_id, w.priority, w.concurrency_key FROM workqueue w\n",
			"(SELECT * FROM (SELECT w.workqueue_id, w.priority, w.concurrency_key FROM workqueue w\n", 2)
		s = mustReplace(s,
			"w.priority, w.workqueue_id LIMIT k.free)",
			"w.priority, w.workqueue_id LIMIT k.free FOR NO KEY UPDATE OF w SKIP LOCKED) l)", 2)
		return mustReplace(s, // the parking walk
			"LIMIT 2000) r", "LIMIT 2000 FOR NO KEY UPDATE OF w SKIP LOCKED) r", 1)
	}()
)

// skipLockedFor is how long the claimer skips locked rows after a claim that waited its whole
// budget. The lock that held it may be gone long before; the ordinary claim then waits for a
// row lock once more at most once per period (another full budget, if the lock is still held).
const skipLockedFor = time.Minute

// errSkipLocked marks a claim that waited its whole budget and put the claimer in skip mode:
// the coordinator says so in its log.
var errSkipLocked = errors.New("the claim waited its whole budget (or the role's lock_timeout or statement_timeout), " +
	"most likely for a row lock another transaction holds; claiming past locked rows for a while")

// mustReplace replaces old with new in s, which must hold exactly n of them (checked when the
// program starts, and by the tests: a claim edited out of the shape these variants expect
// stops the daemon at once, not at the first locked row).
func mustReplace(s, old, new string, n int) string {
	if got := strings.Count(s, old); got != n {
		panic(fmt.Sprintf("claim.go: %d of %q in a claim statement, want %d", got, old, n))
	}
	return strings.ReplaceAll(s, old, new)
}

// unparkSQL puts back to pending up to parkChunk parked rows of stages without a KEY_LIMIT
// ($1 = the stages that have one), in the order the keys would be served, and returns how
// many. Only the keyed claim parks, and only for a stage with a limit, so such rows exist
// only after a reload removed a stage's limit, or from a previous run with another
// configuration: the coordinator runs it at start and after such a reload, until a run
// finds less than a chunk (keys.go's unpark), and never on the path of an ordinary claim.
//
// It locks what it picks and passes over the rows another transaction holds (SKIP LOCKED),
// like the return of paused rows (retry.go) and for the same reason: it runs on the loop
// ahead of the claim, and waiting there for one parked row that an open transaction holds
// stopped every claim, the unpark cancelled at its budget (the lock connection with it) and
// run again (TestUnparkRowLockedElsewhere). Its second column says whether parked rows of
// those stages are left besides the ones it took, which, in a run that took less than a
// chunk, are rows it passed over: the coordinator runs it again a second later.
const unparkSQL = `
WITH unparking AS (
    UPDATE workqueue q SET key_parked = false
     WHERE q.workqueue_id = ANY (ARRAY(
             SELECT w.workqueue_id FROM workqueue w
              WHERE w.status = 'pending' AND w.key_parked AND w.stage <> ALL ($1::text[])
              ORDER BY w.stage, w.concurrency_key, w.priority, w.workqueue_id
              LIMIT 2000
                FOR NO KEY UPDATE OF w SKIP LOCKED))
       AND coalesce(q.status, '') = 'pending'
    RETURNING q.workqueue_id
)
SELECT (SELECT count(*) FROM unparking),
       EXISTS (SELECT 1 FROM workqueue w
                WHERE w.status = 'pending' AND w.key_parked AND w.stage <> ALL ($1::text[])
                  AND w.workqueue_id <> ALL (ARRAY(SELECT workqueue_id FROM unparking)))`

// parkChunk bounds the rows one claim parks (claimKeyedSQL's LIMIT 2000, per key and in all)
// and one unparkSQL puts back (the statements stay literals, which the benchmark reads out
// of this file): parking costs about 50 µs a row (each is a new row version in three
// indexes, and the fan-in statement trigger reads it), so a backlog of 100,000 parked at once
// would hold the claim for seconds, past dbStatementBudget on a loaded machine. Until a key's
// backlog is parked, the walk skips its rows by a filter on the index's own entries (no heap
// access).
const parkChunk = 2000

// claimResult is what one claim returned.
type claimResult struct {
	byStage   map[string][]*message // claimed rows per stage, in (priority, id) order
	total     int
	nextRetry time.Time     // earliest paused row's due time; zero if none
	inbox     bool          // the fan-in inbox is not empty
	remaining map[int64]int // open groups of the claimed children: remaining children per the counters
	parked    int64         // rows this claim parked behind a saturated concurrency key
}

// claimer runs the claim statement on the lock connection, prepared once per connection.
type claimer struct {
	stmt, keyed, unparkSt *sql.Stmt // claimSQL, claimKeyedSQL, unparkSQL; each prepared on first use
	stmtSkip, keyedSkip   *sql.Stmt // their skip-locked variants, prepared on first use too
	conn                  *sql.Conn // the connection they were prepared on
	skipUntil             time.Time // skip locked rows until then (see claimSkipLockedSQL)

	// Reused between claims: the claim loop runs once per burst of replies, so these
	// slices would otherwise be garbage every time.
	names              []string
	caps, limits       []int64
	busyStages, busyKs []string
	busyNs             []int64
}

// claim takes up to want[stage] rows per stage, at most keys' limit per concurrency key.
func (cl *claimer) claim(ctx context.Context, conn *sql.Conn, want map[string]int, keys *keyLoad) (claimResult, error) {
	res := claimResult{byStage: map[string][]*message{}}
	cl.use(conn)
	cl.names, cl.caps, cl.limits = cl.names[:0], cl.caps[:0], cl.limits[:0]
	anyLimit := false
	for name, n := range want {
		if n > 0 {
			cl.names = append(cl.names, name)
			cl.caps = append(cl.caps, int64(n))
			cl.limits = append(cl.limits, int64(keys.limit[name]))
			anyLimit = anyLimit || keys.limit[name] > 0
		}
	}
	var rows *sql.Rows
	var err error
	skip := time.Now().Before(cl.skipUntil)
	if anyLimit {
		rows, err = cl.queryKeyed(ctx, keys, skip)
	} else {
		stp, query := &cl.stmt, claimSQL
		if skip {
			stp, query = &cl.stmtSkip, claimSkipLockedSQL
		}
		var st *sql.Stmt
		if st, err = cl.prepared(ctx, stp, query); err != nil {
			return res, fmt.Errorf("prepare claim: %w", err)
		}
		rows, err = st.QueryContext(ctx, pq.Array(cl.names), pq.Array(cl.caps))
	}
	if err != nil {
		// Cancelled at its budget: most likely a row lock held elsewhere (claimSkipLockedSQL).
		// The claimer owns its mode, so it switches here, once per period. Not when the
		// connection failed meanwhile (a server whose machine vanished answers nothing until
		// the socket gives up): that is an outage, and the row-lock warning misled.
		if !skip && !isConnLost(err) && (errors.Is(ctx.Err(), context.DeadlineExceeded) || ctx.Err() == nil && cutWaiting(err)) {
			cl.skipUntil = time.Now().Add(skipLockedFor)
			return res, fmt.Errorf("claim: %w (%w)", err, errSkipLocked)
		}
		return res, fmt.Errorf("claim: %w", err)
	}
	defer rows.Close()
	// The columns are scanned into interfaces and asserted (claimCols), not into sql.Null*
	// values: database/sql converts an int64 into a NullInt64 by reflection, and 7 of the 11
	// columns are integers, for every claimed row (perf: convertAssignRows in the claim's
	// profile; the A/B of this change in W1 was within noise, 1.018x).
	var col [11]any
	dest := make([]any, len(col))
	for i := range col {
		dest[i] = &col[i]
	}
	for rows.Next() {
		if err := rows.Scan(dest...); err != nil {
			return res, fmt.Errorf("claim: read row: %w", err)
		}
		var c claimCols
		id, idOK := c.int(col[0])
		fanout, fanoutOK := c.int(col[4])
		if !idOK && fanoutOK {
			if res.remaining == nil {
				res.remaining = map[int64]int{}
			}
			remaining, _ := c.int(col[7])
			res.remaining[fanout] = int(remaining)
			continue
		}
		if !idOK {
			if in, ok := col[8].(float64); ok {
				res.nextRetry = dueAt(in)
			}
			res.inbox, _ = col[9].(bool)
			res.parked, _ = c.int(col[10])
			if c.err != nil {
				return res, c.err
			}
			continue
		}
		stage, _ := c.str(col[1])
		claim, _ := c.int(col[2])
		attempts, _ := c.int(col[3])
		priority, _ := c.int(col[5])
		key, keyed := c.str(col[6])
		if c.err != nil {
			return res, c.err
		}
		m := &message{id: id, stage: stage, claim: claim, attempts: int(attempts), fanout: fanout,
			priority: int(priority), key: key, keyed: keyed}
		res.byStage[m.stage] = append(res.byStage[m.stage], m)
		res.total++
	}
	if err := rows.Err(); err != nil {
		return res, fmt.Errorf("claim: %w", err)
	}
	// RETURNING has no order; workers get their messages in claim order: priority, then id.
	for _, msgs := range res.byStage {
		slices.SortFunc(msgs, func(a, b *message) int {
			return cmp.Or(cmp.Compare(a.priority, b.priority), cmp.Compare(a.id, b.id))
		})
	}
	return res, nil
}

// claimCols reads the claim's columns as lib/pq returns them (int64, string, or nil for NULL),
// keeping the first column of an unexpected type as an error.
type claimCols struct{ err error }

func (c *claimCols) int(v any) (int64, bool) {
	switch x := v.(type) {
	case int64:
		return x, true
	case nil:
		return 0, false
	}
	if c.err == nil {
		c.err = fmt.Errorf("claim: read row: integer column holds %T", v)
	}
	return 0, false
}

func (c *claimCols) str(v any) (string, bool) {
	switch x := v.(type) {
	case string:
		return x, true
	case []byte:
		return string(x), true
	case nil:
		return "", false
	}
	if c.err == nil {
		c.err = fmt.Errorf("claim: read row: text column holds %T", v)
	}
	return "", false
}

// queryKeyed runs claimKeyedSQL (claimKeyedSkipLockedSQL if skip) with cl.names, caps and
// limits and what keys has in flight.
func (cl *claimer) queryKeyed(ctx context.Context, keys *keyLoad, skip bool) (*sql.Rows, error) {
	stp, query := &cl.keyed, claimKeyedSQL
	if skip {
		stp, query = &cl.keyedSkip, claimKeyedSkipLockedSQL
	}
	st, err := cl.prepared(ctx, stp, query)
	if err != nil {
		return nil, fmt.Errorf("prepare: %w", err)
	}
	cl.busyStages, cl.busyKs, cl.busyNs = cl.busyStages[:0], cl.busyKs[:0], cl.busyNs[:0]
	for k, n := range keys.busy {
		cl.busyStages = append(cl.busyStages, k.stage)
		cl.busyKs = append(cl.busyKs, k.key)
		cl.busyNs = append(cl.busyNs, int64(n))
	}
	return st.QueryContext(ctx, pq.Array(cl.names), pq.Array(cl.caps), pq.Array(cl.limits),
		pq.Array(cl.busyStages), pq.Array(cl.busyKs), pq.Array(cl.busyNs))
}

// unpark runs unparkSQL for the stages without a limit: limit holds those with one. It
// returns the rows it unparked and whether parked rows of those stages are left.
func (cl *claimer) unpark(ctx context.Context, conn *sql.Conn, limit map[string]int) (int64, bool, error) {
	cl.use(conn)
	st, err := cl.prepared(ctx, &cl.unparkSt, unparkSQL)
	if err != nil {
		return 0, false, fmt.Errorf("prepare unpark: %w", err)
	}
	// Not nil when empty: pq.Array sends a nil slice as NULL, and <> ALL (NULL) is never true.
	limited := make([]string, 0, len(limit))
	for name := range limit {
		limited = append(limited, name)
	}
	var n int64
	var left bool
	if err := st.QueryRowContext(ctx, pq.Array(limited)).Scan(&n, &left); err != nil {
		return 0, false, fmt.Errorf("unpark: %w", err)
	}
	return n, left, nil
}

// use makes conn the connection the statements are prepared on; those prepared on another
// (one that is gone) are closed.
func (cl *claimer) use(conn *sql.Conn) {
	if cl.conn != conn {
		cl.close()
		cl.conn = conn
	}
}

// prepared returns *st, preparing query on the claimer's connection on first use.
func (cl *claimer) prepared(ctx context.Context, st **sql.Stmt, query string) (*sql.Stmt, error) {
	if *st == nil {
		prepared, err := cl.conn.PrepareContext(ctx, query)
		if err != nil {
			return nil, err
		}
		*st = prepared
	}
	return *st, nil
}

func (cl *claimer) close() {
	for _, st := range []*sql.Stmt{cl.stmt, cl.keyed, cl.unparkSt, cl.stmtSkip, cl.keyedSkip} {
		if st != nil {
			st.Close()
		}
	}
	cl.stmt, cl.keyed, cl.unparkSt, cl.stmtSkip, cl.keyedSkip, cl.conn = nil, nil, nil, nil, nil, nil
}

// claim takes work for every stage with free capacity in one statement and hands it out.
func (c *coordinator) claim() {
	now := time.Now()
	clear(c.want)
	for name, p := range c.pools {
		if len(p.suspects) > 0 || p.alone {
			p.updateAlone(now)
		}
		if p.held(now) || p.cfg.Paused || now.Before(p.refusedUntil) {
			continue
		}
		if free := p.capacity() - c.inflight[name]; free > 0 {
			c.want[name] = free
		}
	}
	c.claimWanted = false
	if len(c.want) == 0 {
		return // every stage is full or held: replies and timers will ask again
	}
	ctx, cancel := c.budget()
	if c.keys.unpark && !now.Before(c.keys.unparkAt) {
		n, left, err := c.claimer.unpark(ctx, c.inst.conn, c.keys.limit)
		switch {
		case err != nil && !c.refusedByDatabase(err):
			cancel()
			c.claimWanted = true
			c.dbTrouble("unpark", err)
			return
		case err != nil:
			// Refused by the database itself (an application's trigger that refuses to
			// update one of the rows): they stay parked and are tried again a second later,
			// while the claim goes on. Returning here, as for a lost connection, stopped
			// every claim (TestUnparkRefused).
			n, left = 0, true
			if !c.keys.refused {
				c.keys.refused = true
				c.log.Warn("the database refused to put parked rows back to pending; they wait, tried again every second, claims go on",
					"err", err)
			}
		case c.keys.refused:
			c.keys.refused = false
			c.log.Info("the database takes the unpark of parked rows again")
		}
		if n > 0 {
			c.log.Info("rows parked under a KEY_LIMIT since removed go back to pending", "rows", n)
		}
		// A full chunk: there may be more, for the next claim. Less, with parked rows left:
		// rows another transaction holds, passed over; again a second later, not before
		// every claim.
		c.keys.unpark = n >= parkChunk || left
		if n < parkChunk && left {
			c.keys.unparkAt = now.Add(heldRetryGap)
		}
	}
	t0 := time.Now()
	res, err := c.claimer.claim(ctx, c.inst.conn, c.want, &c.keys)
	c.claimMax = max(c.claimMax, time.Since(t0))
	cancel()
	if err != nil {
		c.claimWanted = true
		if errors.Is(err, errSkipLocked) {
			c.log.Warn(errSkipLocked.Error(), "budget", dbStatementBudget, "for", skipLockedFor)
		} else if c.claimStagesAlone(now, err) {
			return
		}
		c.dbTrouble("claim", err)
		return
	}
	c.dbBackoff.reset()
	c.lockUnheard = false
	c.fanin.inbox = false
	c.backlog = false
	c.takeClaim(res, c.want)
}

// takeClaim takes a claim statement's result for the stages of want: the rows to hand out,
// the next due paused row, what it says of fan-in.
func (c *coordinator) takeClaim(res claimResult, want map[string]int) {
	for name := range want {
		if p := c.pools[name]; p.refused {
			p.refused = false
			c.log.Info("the database takes this stage's claims again", "stage", name)
		}
	}
	c.scheduleRetry(res.nextRetry)
	c.fanin.inbox = c.fanin.inbox || res.inbox
	c.fanin.learn(res.remaining)
	if res.parked > 0 {
		c.log.Debug("rows parked behind saturated concurrency keys", "rows", res.parked)
	}
	if c.keys.unpark {
		c.claimWanted = true // the next chunk of parked rows, whether or not this claim took any
	}
	if res.total == 0 {
		return
	}
	c.stats.Global.Claims++
	for name, msgs := range res.byStage {
		if len(msgs) == want[name] {
			c.backlog = true
		}
		c.assign(c.pools[name], msgs)
	}
}

// claimStagesAlone claims each stage of c.want in a statement of its own, after the database
// refused the claim of all of them on a connection that still answers. The refusal may be one
// stage's alone: an application's trigger or CHECK on workqueue that refuses to set a row
// running (a rule of its own, a bug in its audit trigger), and the claim takes a stage's
// rows in order, so the row at the head of that stage's queue is in every claim of it.
// Claiming all stages in one statement again and again stopped every stage
// (TestClaimRefusedStageAlone). A stage whose own claim is refused waits a second
// (refusedUntil), said once until the database takes its claims again; the others are
// claimed now. It returns false when the refusal is not for it to handle: a lost connection,
// the daemon stopping.
func (c *coordinator) claimStagesAlone(now time.Time, err error) bool {
	if !c.refusedByDatabase(err) {
		return false
	}
	names := slices.Sorted(maps.Keys(c.want))
	c.fanin.inbox = false
	c.backlog = false
	for _, name := range names {
		if len(names) > 1 {
			want := map[string]int{name: c.want[name]}
			ctx, cancel := c.budget()
			var res claimResult
			res, err = c.claimer.claim(ctx, c.inst.conn, want, &c.keys)
			cancel()
			switch {
			case err == nil:
				c.takeClaim(res, want)
				continue
			case isOutage(err) || errors.Is(err, errSkipLocked) || c.ctx.Err() != nil:
				c.dbTrouble("claim", err)
				return true
			}
		}
		p := c.pools[name]
		p.refusedUntil = now.Add(heldRetryGap)
		c.timers.schedule(timerKey{timerRefused, p.id}, p.refusedUntil)
		if !p.refused {
			p.refused = true
			c.log.Warn("the database refused this stage's claim alone; its messages wait, tried again every second, the other stages go on",
				"stage", name, "err", err)
		}
	}
	c.dbBackoff.reset()
	return true
}

// assign hands claimed messages (in claim order) to the stage's workers, packing them.
func (c *coordinator) assign(p *pool, msgs []*message) {
	now := time.Now()
	for len(msgs) > 0 {
		w := p.pick()
		if w == nil {
			if !p.canGrow(now) {
				break
			}
			if w = c.spawn(p, now); w == nil {
				break
			}
		}
		n := min(p.room(w), len(msgs))
		batch := msgs[:n:n]
		msgs = msgs[n:]
		if len(p.suspects) > 0 {
			if _, ok := p.suspects[batch[0].id]; ok && n == 1 && len(w.queue) == 0 {
				p.isolate(w, batch[0])
			}
		}
		if len(w.queue) == 0 {
			w.headAt = now
			c.timers.scheduleEarlier(timerKey{timerWatchdog, w.id}, now.Add(c.cfg.Dispatch.MaxRuntime))
		}
		w.queue = append(w.queue, batch...)
		w.sent += n
		c.keys.take(batch)
		c.inflight[p.cfg.Name] += n
		c.inflightAll += n
		c.stats.Global.StageRuns += int64(n)
		var err error
		if c.sendBuf, err = w.send(batch, c.sendBuf); err != nil {
			// The worker is dying; its exit fails the head and puts the rest back.
			c.log.Warn("write to worker failed", "stage", w.stage, "pid", w.pid, "err", err)
			w.kill()
		}
		if w.sent >= p.cfg.MaxMessages {
			w.spent()
		}
	}
	if len(msgs) > 0 {
		// No worker could take them (the program would not start): they were claimed, so
		// they go back to pending, untouched.
		c.resets = append(c.resets, msgs...)
	}
	if len(p.suspects) > 0 || p.alone {
		p.updateAlone(now)
	}
}
