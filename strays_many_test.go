package main

import (
	"context"
	"database/sql"
	"io"
	"log/slog"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestManyStrayStagesBounded: a producer that writes a stage per tenant (a bug) leaves
// 20,001 stages the configuration lacks, one of them with 50 rows. Each was a warning, a
// section of the console's overview and a set of /metrics series: 20,000 warnings, an
// overview of 27 MB made in 2.4-3.6 s, 7.2 MB of /metrics per scrape. Now the log names 20
// and counts the rest in one line, the overview shows the configured stage and the 20 others
// with the most rows and counts the rest in one line, and /metrics has series for those 21
// stages and one "(other stages)" set that sums the rest: a sum over stages stays right.
func TestManyStrayStagesBounded(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `INSERT INTO workqueue (stage, payload) SELECT 'tenant-' || g, '{}' FROM generate_series(1, 20000) g`)
	s.exec(t, `INSERT INTO workqueue (stage, payload) SELECT 'tenant-big', '{}' FROM generate_series(1, 50)`)
	s.exec(t, `INSERT INTO workqueue (stage, payload, status) SELECT 'a', '{}', 'failed' FROM generate_series(1, 3)`)
	addr := freePort(t)
	d := startDaemon(t, baseConf(s, "METRICS_LISTEN = "+addr)+stageConf(t, "a", "", ""), "pipeline")
	d.waitLog("messages are pending at more stages this configuration does not have", 10*time.Second)
	named := strings.Count(d.log.String(), "messages are pending at a stage this configuration does not have")
	if named != strayListMax {
		t.Errorf("%d stray stages named in the log, want %d", named, strayListMax)
	}
	if !strings.Contains(d.log.String(), "stages=19981 strays=20001") {
		t.Errorf("the summary line does not count the stages not named:\n%s", lastLines(d.log.String(), 5))
	}

	page := consoleOverview(t, addr)
	if len(page) > 1<<20 {
		t.Errorf("the overview is %d bytes", len(page))
	}
	if n := strings.Count(page, `<section class="stage`); n != 1+strayListMax {
		t.Errorf("the overview shows %d stages, want %d", n, 1+strayListMax)
	}
	for _, want := range []string{`id="stage-a"`, `id="stage-tenant-big"`, "<b>19981</b> more stages", "<b>19981</b> rows"} {
		if !strings.Contains(page, want) {
			t.Errorf("the overview lacks %q", want)
		}
	}

	body := scrape(addr)
	stages := map[string]bool{}
	var pending float64
	for _, m := range regexp.MustCompile(`(?m)^pepsi_rows\{stage="([^"]*)",status="([a-z]+)"\} (\d+)$`).FindAllStringSubmatch(body, -1) {
		stages[m[1]] = true
		if m[2] == "pending" {
			n, _ := strconv.ParseFloat(m[3], 64)
			pending += n
		}
	}
	if len(stages) != 1+strayListMax+1 || !stages["a"] || !stages["tenant-big"] || !stages[otherStages] {
		t.Errorf("pepsi_rows has %d stages (a: %v, tenant-big: %v, %s: %v), want a, 20 others and %s",
			len(stages), stages["a"], stages["tenant-big"], otherStages, stages[otherStages], otherStages)
	}
	if pending != 20050 {
		t.Errorf("pepsi_rows{status=\"pending\"} sums to %v over the stages, want 20050", pending)
	}
	if len(body) > 64<<10 {
		t.Errorf("/metrics is %d bytes", len(body))
	}
	d.stop()
}

// lastLines returns the last n lines of s.
func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(l[max(0, len(l)-n):], "\n")
}

// TestSamplerSeriesBounded: the console's sampler keeps a series for each stage the
// dispatcher runs and for at most strayListMax others, those with the biggest backlog; a
// series with no point for the whole window goes. It kept one for every stage with pending
// rows it ever saw (a producer writing a stage per tenant: thousands of new series a sample,
// for the daemon's life).
func TestSamplerSeriesBounded(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `INSERT INTO workqueue (stage, payload) SELECT 'tenant-' || g, '{}' FROM generate_series(1, 500) g`)
	s.exec(t, `INSERT INTO workqueue (stage, payload) SELECT 'tenant-big', '{}' FROM generate_series(1, 5)`)
	snap := &metricsSnapshot{stages: []stageSnapshot{{name: "a"}}}
	sm := newSampler(func() *metricsSnapshot { return snap }, func() *sql.DB { return s.DB }, slog.New(slog.NewTextHandler(io.Discard, nil)))
	now := time.Now()
	sm.sample(context.Background(), now)
	if len(sm.series) != 1+strayListMax || sm.series["a"] == nil || sm.series["tenant-big"] == nil {
		t.Fatalf("%d series after a sample (a: %v, tenant-big: %v), want a and %d others, tenant-big among them",
			len(sm.series), sm.series["a"] != nil, sm.series["tenant-big"] != nil, strayListMax)
	}
	s.exec(t, `DELETE FROM workqueue`)
	snap = &metricsSnapshot{stages: []stageSnapshot{{name: "b"}}} // a reload replaced a with b
	later := now.Add(consoleSamples*consoleSampleEvery + time.Second)
	sm.sample(context.Background(), later)
	if len(sm.series) != 1 || sm.series["b"] == nil {
		t.Errorf("series after a window with no point of the old stages: %d (b: %v), want only b", len(sm.series), sm.series["b"] != nil)
	}
}
