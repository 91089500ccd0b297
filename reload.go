// reload.go: a new stage graph while running (SIGHUP, NOTIFY config_changed).
//
// The file and the config table are read again; if the stages changed, a new generation of
// pools replaces the old, and the old generation's workers are retired. A reload that does
// not validate ends the run with exit status 1 (doc/design/dispatch.md §7), not start-up's 2.

package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"strings"
	"time"
)

// setStages installs a stage table as a new generation of pools.
func (c *coordinator) setStages(stages map[string]*StageConfig) {
	c.gen++
	old := c.pools
	c.pools = map[string]*pool{}
	for name, s := range stages {
		p := &pool{id: c.nextPoolID, cfg: s, gen: c.gen}
		p.fuse, p.fusable = fuseList(stages, name)
		c.nextPoolID++
		if o := old[name]; o != nil {
			if o.cfg.Program == s.Program {
				p.holdUntil, p.holdDelay = o.holdUntil, o.holdDelay // same program: same trouble
			}
			p.suspects, p.alone = o.suspects, o.alone // the messages, not the program, are suspected
		}
		c.pools[name] = p
	}
	c.keys.limitsOf(c.pools)
	c.logPaused(old)
}

// reloadError is a reload that failed. It is fatal with exit status 1
// (doc/design/dispatch.md §7), not start-up's configuration status 2, although it wraps the
// configError that says what is
// wrong: run's exit-status mapping tests for this type before configError.
type reloadError struct{ err error }

func (e *reloadError) Error() string { return "reload: " + e.err.Error() }
func (e *reloadError) Unwrap() error { return e.err }

// fileStagesJSON is the stage graph of the file's entries as config_graph_check reads it
// (schema.sql): per [stage-NAME] section, whether it sets PROGRAM, and its NEXT as written.
func fileStagesJSON(entries []iniEntry) string {
	type stage struct {
		Program bool    `json:"program"`
		Next    *string `json:"next,omitempty"`
	}
	graph := map[string]*stage{}
	for _, e := range entries {
		name, ok := strings.CutPrefix(e.Section, "stage-")
		if !ok {
			continue
		}
		st := graph[name]
		if st == nil {
			st = &stage{}
			graph[name] = st
		}
		switch e.Key {
		case "PROGRAM":
			st.Program = true
		case "NEXT":
			st.Next = &e.Value
		}
	}
	b, _ := json.Marshal(graph) // maps of strings and bools: no error
	return string(b)
}

// publishFileStages writes the file's stage graph for config_graph_check, which refuses a
// config table that makes a graph this dispatcher would refuse at its next reload, as the
// writing transaction commits, instead of the dispatcher stopping then.
func publishFileStages(ctx context.Context, conn *sql.Conn, graph string) error {
	if _, err := conn.ExecContext(ctx, `UPDATE dispatch_instance SET file_stages = $1::jsonb WHERE id = 1`, graph); err != nil {
		return fmt.Errorf("publish the file's stage graph: %w", err)
	}
	return nil
}

// reload rebuilds the stage table from the file and the config table.
func (c *coordinator) reload() {
	c.reloadWanted = false
	ctx, cancel := c.budget()
	overlay, err := readOverlay(ctx, c.inst.conn)
	cancel()
	if err != nil {
		c.reloadWanted = true
		c.dbTrouble("read config table", err)
		return
	}
	fresh, err := loadConfig(c.cfg.Path)
	if err != nil {
		c.fatal = &reloadError{err}
		return
	}
	stages, err := buildStages(fresh.stageEntries, overlay)
	if err != nil {
		c.fatal = &reloadError{fmt.Errorf("the stage graph does not validate: %w", err)}
		return
	}
	if graph := fileStagesJSON(fresh.stageEntries); graph != c.fileStages {
		// The file changed (SIGHUP): the table's check judges against it from now on. A
		// failure leaves the last one published, which only makes the check judge by it.
		ctx, cancel := c.budget()
		err := publishFileStages(ctx, c.inst.conn, graph)
		cancel()
		if err != nil {
			c.log.Warn("the config table's graph check keeps the file's stages of before; tried again at the next reload", "err", err)
		} else {
			c.fileStages = graph
		}
	}
	if fresh.Dispatch != c.cfg.Dispatch || fresh.DSN != c.cfg.DSN || fresh.PoolCounter != c.cfg.PoolCounter {
		c.log.Warn("reload: [pepsi-dispatch], [database] and [poolcounter] changes need a restart; kept the running values")
	}
	if sameStages(stages, c.cfg.Stages) {
		return
	}
	if changed := pauseOnly(stages, c.cfg.Stages); changed != nil {
		c.applyPauses(stages, changed) // pepsi-queue pause/resume: no worker is retired
		return
	}
	cfg := *c.cfg
	cfg.Stages = stages
	c.cfg = &cfg
	c.setStages(stages)
	c.log.Info("stage graph reloaded; retiring workers", "stages", len(stages), "workers", len(c.workers))
	c.timers.schedule(timerKey{kind: timerStrays}, time.Now().Add(time.Second)) // a stage removed may have left rows
	for _, w := range c.workers {
		c.retire(w)
	}
	c.claimWanted = true
}

func sameStages(a, b map[string]*StageConfig) bool {
	if len(a) != len(b) {
		return false
	}
	for name, s := range a {
		if o, ok := b[name]; !ok || !s.equal(o) {
			return false
		}
	}
	return true
}

// readOverlay reads the config table.
func readOverlay(ctx context.Context, conn *sql.Conn) ([]overlayRow, error) {
	rows, err := conn.QueryContext(ctx, `SELECT section, key, value FROM config ORDER BY section, key`)
	if err != nil {
		return nil, fmt.Errorf("read config table: %w", err)
	}
	defer rows.Close()
	var out []overlayRow
	for rows.Next() {
		var r overlayRow
		if err := rows.Scan(&r.Section, &r.Key, &r.Value); err != nil {
			return nil, fmt.Errorf("read config table: %w", err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read config table: %w", err)
	}
	return out, nil
}
