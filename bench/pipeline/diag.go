// diag.go: the diagnostic run. After W1's measured runs, pepsi runs W1 once more with
// auto_explain loaded in its database's sessions (EXPLAIN ANALYZE of every statement slower
// than 10 ms goes to the server log). It is not measured: auto_explain's instrumentation slows
// every statement. It shows which statements are slow and why, as PostgreSQL planned them.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

type diagPlan struct {
	App     string // the sessions' application_name (pepsi's are "pepsi-…")
	Query   string
	Count   int
	TotalMS float64
	MaxMS   float64
	Plan    string // of the slowest execution
}

func (b *bench) diagnosePepsi(ctx context.Context) {
	var s *system
	for _, x := range b.systems {
		if x.name == "pepsi" {
			s = x
		}
	}
	if s == nil {
		return
	}
	db := "DATABASE " + s.dbname
	for _, set := range []string{"auto_explain.log_analyze = on", "auto_explain.log_buffers = on",
		"auto_explain.log_min_duration = '10ms'"} {
		if _, err := b.pg.admin.Exec(ctx, "ALTER "+db+" SET "+set); err != nil {
			b.res.diagErr = err.Error()
			return
		}
	}
	defer func() {
		for _, set := range []string{"auto_explain.log_analyze", "auto_explain.log_buffers", "auto_explain.log_min_duration"} {
			if _, err := b.pg.admin.Exec(context.Background(), "ALTER "+db+" RESET "+set); err != nil {
				logf("reset %s: %v", set, err)
			}
		}
	}()
	off := b.pg.logOffset()
	logf("  diagnostic run: pepsi W1 with auto_explain (statements over 10 ms), not measured")
	m := b.backlogRun(ctx, s, "W1-diag", 1, b.sz.w1Messages, 1, 0, false)
	b.res.diagRun = m
	if m.Err != "" {
		logf("  diagnostic run: %s", m.Err)
	} else {
		logf("  diagnostic run: %d transitions in %.2f s = %.0f/s (under auto_explain)", m.Transitions, m.Seconds, m.rate())
	}
	plans, err := parseAutoExplain(b.pg.logPath(), off)
	if err != nil {
		b.res.diagErr = err.Error()
		return
	}
	b.res.diag = plans
}

var durationRe = regexp.MustCompile(`^\S+ \S+ \S+ \[[0-9]+\] (.*?)@\S* WARNING:  duration: ([0-9.]+) ms\s+plan:`)

// parseAutoExplain reads auto_explain's blocks from the server log after offset, grouped by
// statement (its first words), slowest group first, leaving out the benchmark's own sessions.
func parseAutoExplain(path string, off int64) ([]diagPlan, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if _, err := f.Seek(off, 0); err != nil {
		return nil, err
	}
	raw, err := io.ReadAll(io.LimitReader(f, 256<<20))
	if err != nil {
		return nil, fmt.Errorf("read server log: %w", err)
	}
	groups := map[string]*diagPlan{}
	lines := strings.Split(string(raw), "\n")
	for i := 0; i < len(lines); i++ {
		mm := durationRe.FindStringSubmatch(lines[i])
		if mm == nil {
			continue
		}
		app := mm[1]
		ms, _ := strconv.ParseFloat(mm[2], 64)
		var block []string
		for i+1 < len(lines) && strings.HasPrefix(lines[i+1], "\t") {
			i++
			block = append(block, strings.TrimPrefix(lines[i], "\t"))
		}
		if len(block) == 0 || app == "bench" {
			continue
		}
		if strings.HasPrefix(app, "pepsi-") {
			app = "pepsi-…" // one name per system and instance key: group them
		}
		// The query text may span lines: the plan starts at the first node, which carries costs.
		planAt := len(block)
		for j, l := range block {
			if strings.Contains(l, "(cost=") || strings.Contains(l, "(actual") {
				planAt = j
				break
			}
		}
		if planAt == 0 {
			planAt = 1
		}
		q := strings.TrimPrefix(strings.Join(block[:planAt], " "), "Query Text: ")
		planLines := block[planAt:]
		key := app + "\x00" + oneLineSQL(q, 90)
		g := groups[key]
		if g == nil {
			g = &diagPlan{App: app, Query: oneLineSQL(q, 90)}
			groups[key] = g
		}
		g.Count++
		g.TotalMS += ms
		if ms > g.MaxMS {
			g.MaxMS = ms
			plan := planLines
			if len(plan) > 40 {
				plan = append(plan[:40:40], "…")
			}
			g.Plan = strings.Join(plan, "\n")
		}
	}
	var out []diagPlan
	for _, g := range groups {
		out = append(out, *g)
	}
	slices.SortFunc(out, func(a, b diagPlan) int {
		switch {
		case a.TotalMS > b.TotalMS:
			return -1
		case a.TotalMS < b.TotalMS:
			return 1
		}
		return strings.Compare(a.Query, b.Query)
	})
	return out, nil
}
