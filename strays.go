// strays.go: messages pending at a stage the running configuration does not have.
//
// A producer's typo in a stage name ('deliever'), or a stage taken out of the configuration
// with messages left in it, leaves rows pending that no pool claims: nothing fails, nothing
// is logged, and they wait for a stage of that name for ever. Once a minute, and a second
// after the start and after each reload, the loop lists the stages that have pending rows, in
// the background, and logs each stage it does not run, once for as long as it stays so. The
// rows are left alone: a stage of that name may be configured later (the config table can
// add one), and the operator decides (pepsi-queue cancel, or an UPDATE of their stage).

package main

import (
	"cmp"
	"context"
	"database/sql"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
)

const strayEvery = time.Minute

// strayListMax is how many stages the configuration lacks the log, the console's overview and
// charts, and /metrics name one by one; the others are counted together. A producer that
// writes a stage per tenant or per id (a bug) made each such stage a warning, a section of the
// overview and a set of /metrics series: with 20,000 of them, 20,000 warnings (6.8 MB of
// log), an overview of 27 MB that took 2.4-3.6 s to make (its page reloads every 5 s) and
// 7.2 MB of /metrics, every scrape (TestManyStrayStagesBounded).
const strayListMax = 20

// topStages splits the stages of rows into the n with the most rows (ties by name) and the
// others, each part in name order.
func topStages(rows map[string]int64, n int) (top, rest []string) {
	names := slices.Collect(maps.Keys(rows))
	slices.SortFunc(names, func(a, b string) int {
		return cmp.Or(cmp.Compare(rows[b], rows[a]), strings.Compare(a, b))
	})
	if len(names) > n {
		rest = names[n:]
		names = names[:n]
	}
	slices.Sort(names)
	slices.Sort(rest)
	return names, rest
}

// pendingStagesSQL lists the stages that have pending rows, unparked or parked, one probe of
// the partial index per stage (a skip scan): its cost is the number of stages, not of rows.
const pendingStagesSQL = `
WITH RECURSIVE unparked(stage) AS (
    (SELECT stage FROM workqueue WHERE status = 'pending' AND NOT key_parked ORDER BY stage LIMIT 1)
  UNION ALL
    SELECT (SELECT w.stage FROM workqueue w
             WHERE w.status = 'pending' AND NOT w.key_parked AND w.stage > u.stage
             ORDER BY w.stage LIMIT 1)
      FROM unparked u WHERE u.stage IS NOT NULL
), parked(stage) AS (
    (SELECT stage FROM workqueue WHERE status = 'pending' AND key_parked ORDER BY stage LIMIT 1)
  UNION ALL
    SELECT (SELECT w.stage FROM workqueue w
             WHERE w.status = 'pending' AND w.key_parked AND w.stage > p.stage
             ORDER BY w.stage LIMIT 1)
      FROM parked p WHERE p.stage IS NOT NULL
)
SELECT stage FROM unparked WHERE stage IS NOT NULL
 UNION
SELECT stage FROM parked WHERE stage IS NOT NULL`

// straysFound is a listing's result: the stages with pending rows.
type straysFound struct {
	stages []string
	err    error
}

// strays is the loop's state of the check.
type strays struct {
	running bool
	logged  map[string]bool // stray stages already logged, until they are not strays
}

// startStrayCheck lists the stages with pending rows in the background.
func (c *coordinator) startStrayCheck() {
	c.strays.running = true
	db := c.db
	c.inBackground(func() event {
		ctx, cancel := context.WithTimeout(c.ctx, dbStatementBudget)
		defer cancel()
		stages, err := pendingStages(ctx, db)
		return straysFound{stages, err}
	})
}

// pendingStages runs pendingStagesSQL.
func pendingStages(ctx context.Context, db interface {
	QueryContext(context.Context, string, ...any) (*sql.Rows, error)
}) ([]string, error) {
	rows, err := db.QueryContext(ctx, pendingStagesSQL)
	if err != nil {
		return nil, fmt.Errorf("list the stages with pending rows: %w", err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			return nil, fmt.Errorf("list the stages with pending rows: %w", err)
		}
		out = append(out, s)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list the stages with pending rows: %w", err)
	}
	return out, nil
}

// onStrays logs the stages with pending rows that the running configuration lacks, each
// once while it stays so. The configuration is the one in force now, so a stage a reload
// added while the listing ran is not one.
func (c *coordinator) onStrays(ev straysFound) {
	c.strays.running = false
	if ev.err != nil {
		// Not worth a line of its own: the next listing is a minute away, and a database in
		// trouble says so through the claim and the writes.
		c.log.Debug("stray stages not listed", "err", ev.err)
		return
	}
	now := map[string]bool{}
	named, unnamed := 0, 0 // new strays of this listing: named one by one up to strayListMax, then counted
	for _, s := range ev.stages {
		if c.pools[s] != nil {
			continue
		}
		now[s] = true
		if c.strays.logged[s] {
			continue
		}
		if named == strayListMax {
			unnamed++
			continue
		}
		named++
		c.log.Warn("messages are pending at a stage this configuration does not have: nothing claims them "+
			"until one of that name is configured (a producer's misspelt stage, or a stage removed with "+
			"messages left); configure it, or cancel or move them (pepsi-queue list --stage)", "stage", s)
	}
	if unnamed > 0 {
		c.log.Warn("messages are pending at more stages this configuration does not have, not named here: "+
			"pepsi-queue status lists every stage", "stages", unnamed, "strays", len(now))
	}
	c.strays.logged = now
	c.log.Debug("stages with pending rows listed", "stages", len(ev.stages), "strays", len(now))
}
