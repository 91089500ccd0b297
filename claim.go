// claim.go: taking pending rows for every stage with free capacity, in one statement.
//
// The claim is the only pending->running writer, and there is exactly one claimer per system
// (instance.go), so it needs no FOR UPDATE SKIP LOCKED: each stage's LATERAL subquery walks
// the partial index of pending rows in id order and stops at that stage's free capacity. The
// claim token (one sequence value per statement) goes into every claimed row; the dispatcher's
// later writes to those rows are guarded by it. The statement also returns the earliest due
// time of paused rows, so retry scheduling costs no query of its own.

package main

import (
	"cmp"
	"context"
	"database/sql"
	"fmt"
	"slices"
	"time"

	"github.com/lib/pq"
)

// claimSQL takes up to cap pending rows per stage. $1 = stage names, $2 = capacities.
//
// Its shape keeps the plan right whatever the statistics say (a queue table's statistics are
// always stale: a burst lands between two ANALYZEs), each choice measured with EXPLAIN ANALYZE:
//   - The ids are picked first, as an array (an InitPlan), and the UPDATE finds them through
//     the primary key. Joined instead, the planner cannot see that each LATERAL stops at its
//     cap and hashes every pending row (40 ms per claim with 100,000 pending, against 1-2 ms).
//   - The pick orders by (stage, id) with stage = ANY (ARRAY[...]): only the partial pending
//     index yields that order. With stage = c.stage the planner treats stage as a constant,
//     drops it from the order, and with stale statistics walks the primary key past every
//     claimed or done row (17 ms after 8,000 done rows and growing, against 1.9 ms).
//   - The UPDATE's status test is wrapped in coalesce() (see the SQL), which the
//     partial index's predicate cannot match: with stale statistics the planner would scan
//     all pending rows through it and filter by id (218 ms with 20,000 pending). It still
//     re-checks the row under READ COMMITTED, so a row changed by someone else between the
//     pick and the update (an operator, say) is skipped, not overwritten.
//   - The inbox test reads the first inbox id through its primary key rather than EXISTS,
//     which scans the heap and its dead rows until autovacuum has run.
//
// After the claimed rows come, for the open fan-out groups of the claimed children, one row
// each with the group's remaining children as its counters say (workqueue_id NULL, fanout_id
// set): the wake rule's "may this group be complete?" needs it, and without it the first
// completion of every group would cost a flush. The final row (workqueue_id and fanout_id
// NULL) carries the earliest paused retry_at and whether the fan-in inbox holds unapplied
// events (for writers the coordinator cannot hear).
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
                     WHERE w.status = 'pending' AND w.stage = ANY (ARRAY[c.stage])
                     ORDER BY w.stage, w.workqueue_id
                     LIMIT c.cap) p))
       AND coalesce(q.status, '') = 'pending'
    RETURNING q.workqueue_id, q.stage, q.claim, q.attempts, q.fanout_id
)
SELECT workqueue_id, stage, claim, attempts, fanout_id, NULL::int, NULL::timestamptz, NULL::boolean FROM claimed
UNION ALL
SELECT NULL, NULL, NULL, NULL, f.fanout_id, f.expected_n - f.done_n - f.failed_n, NULL, NULL
  FROM fanout f
 WHERE f.fanout_id = ANY (ARRAY(SELECT DISTINCT fanout_id FROM claimed WHERE fanout_id IS NOT NULL))
   AND f.state = 'open'
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, (SELECT min(retry_at) FROM workqueue WHERE status = 'paused'),
       (SELECT id FROM fanin_event ORDER BY id LIMIT 1) IS NOT NULL`

// claimResult is what one claim returned.
type claimResult struct {
	byStage   map[string][]*message // claimed rows per stage, in id order
	total     int
	nextRetry time.Time     // earliest paused row's due time; zero if none
	inbox     bool          // the fan-in inbox is not empty
	remaining map[int64]int // open groups of the claimed children: remaining children per the counters
}

// claimer runs the claim statement on the lock connection, prepared once per connection.
type claimer struct {
	stmt *sql.Stmt
	conn *sql.Conn // the connection stmt was prepared on

	// Reused between claims: the claim loop runs once per burst of replies, so these
	// slices would otherwise be garbage every time.
	names []string
	caps  []int64
}

// claim takes up to want[stage] rows per stage.
func (cl *claimer) claim(ctx context.Context, conn *sql.Conn, want map[string]int) (claimResult, error) {
	res := claimResult{byStage: map[string][]*message{}}
	if cl.conn != conn || cl.stmt == nil {
		if cl.stmt != nil {
			cl.stmt.Close() // prepared on a connection that is gone
		}
		stmt, err := conn.PrepareContext(ctx, claimSQL)
		if err != nil {
			cl.stmt, cl.conn = nil, nil
			return res, fmt.Errorf("prepare claim: %w", err)
		}
		cl.stmt, cl.conn = stmt, conn
	}
	cl.names, cl.caps = cl.names[:0], cl.caps[:0]
	for name, n := range want {
		if n > 0 {
			cl.names = append(cl.names, name)
			cl.caps = append(cl.caps, int64(n))
		}
	}
	rows, err := cl.stmt.QueryContext(ctx, pq.Array(cl.names), pq.Array(cl.caps))
	if err != nil {
		return res, fmt.Errorf("claim: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id, claim, attempts, fanout, remaining sql.NullInt64
		var stage sql.NullString
		var next sql.NullTime
		var inbox sql.NullBool
		if err := rows.Scan(&id, &stage, &claim, &attempts, &fanout, &remaining, &next, &inbox); err != nil {
			return res, fmt.Errorf("claim: read row: %w", err)
		}
		if !id.Valid && fanout.Valid {
			if res.remaining == nil {
				res.remaining = map[int64]int{}
			}
			res.remaining[fanout.Int64] = int(remaining.Int64)
			continue
		}
		if !id.Valid {
			if next.Valid {
				res.nextRetry = next.Time
			}
			res.inbox = inbox.Bool
			continue
		}
		m := &message{id: id.Int64, stage: stage.String, claim: claim.Int64,
			attempts: int(attempts.Int64), fanout: fanout.Int64}
		res.byStage[m.stage] = append(res.byStage[m.stage], m)
		res.total++
	}
	if err := rows.Err(); err != nil {
		return res, fmt.Errorf("claim: %w", err)
	}
	// RETURNING has no order; workers get their messages in id (enqueue) order.
	for _, msgs := range res.byStage {
		slices.SortFunc(msgs, func(a, b *message) int { return cmp.Compare(a.id, b.id) })
	}
	return res, nil
}

func (cl *claimer) close() {
	if cl.stmt != nil {
		cl.stmt.Close()
		cl.stmt, cl.conn = nil, nil
	}
}

// claim takes work for every stage with free capacity in one statement and hands it out.
func (c *coordinator) claim() {
	now := time.Now()
	clear(c.want)
	for name, p := range c.pools {
		if p.held(now) || p.cfg.Paused {
			continue
		}
		if free := p.cfg.Capacity() - c.inflight[name]; free > 0 {
			c.want[name] = free
		}
	}
	c.claimWanted = false
	if len(c.want) == 0 {
		return // every stage is full or held: replies and timers will ask again
	}
	ctx, cancel := c.budget()
	t0 := time.Now()
	res, err := c.claimer.claim(ctx, c.inst.conn, c.want)
	c.claimMax = max(c.claimMax, time.Since(t0))
	cancel()
	if err != nil {
		c.claimWanted = true
		c.dbTrouble("claim", err)
		return
	}
	c.dbBackoff.reset()
	c.scheduleRetry(res.nextRetry)
	c.fanin.inbox = res.inbox
	c.fanin.learn(res.remaining)
	c.backlog = false
	if res.total == 0 {
		return
	}
	c.stats.Global.Claims++
	for name, msgs := range res.byStage {
		if len(msgs) == c.want[name] {
			c.backlog = true
		}
		c.assign(c.pools[name], msgs)
	}
}

// assign hands claimed messages (in id order) to the stage's workers, packing them.
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
		if len(w.queue) == 0 {
			w.headAt = now
			c.timers.scheduleEarlier(timerKey{timerWatchdog, w.id}, now.Add(c.cfg.Dispatch.MaxRuntime))
		}
		w.queue = append(w.queue, batch...)
		w.sent += n
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
}
