package main

import (
	"strings"
	"testing"
	"time"
)

// TestStrayStageLogged: a message at a stage the configuration lacks (a producer's misspelt
// stage) was left pending and nothing said so. The daemon logs the stage, once while it stays
// a stray (a reload lists the stages again a second later), leaves the message alone, and
// claims it once a stage of that name is configured.
func TestStrayStageLogged(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	stray := insertOne(t, s, "typo", `{}`)
	addr := freePort(t)
	d := startDaemon(t, baseConf(s, "METRICS_LISTEN = "+addr)+stageConf(t, "a", "", "PARALLELISM = 1"), "pipeline")
	const line = "messages are pending at a stage this configuration does not have"
	d.waitLog(line, 30*time.Second)
	if !strings.Contains(d.log.String(), "stage=typo") {
		t.Fatalf("the stray line does not name the stage:\n%s", d.log.String())
	}
	waitFor(t, 5*time.Second, "pepsi_stray_stages 1 on /metrics", func() bool {
		v, ok := metric(t, addr, "pepsi_stray_stages")
		return ok && v == 1
	})
	if page := consoleOverview(t, addr); !strings.Contains(page, `<h2>typo <span class="badge warn">not configured</span></h2>`) {
		t.Errorf("the console does not mark the stray stage:\n%s", page)
	}
	listed := func() int { return strings.Count(d.log.String(), "stages with pending rows listed") }
	before := listed()
	s.exec(t, `INSERT INTO config (section, key, value) VALUES ('stage-a', 'MAX_ATTEMPTS', '4')`)
	waitFor(t, 30*time.Second, "the stages listed again after the reload", func() bool { return listed() > before })
	if n := strings.Count(d.log.String(), line); n != 1 {
		t.Errorf("the stray stage logged %d times, want once", n)
	}
	if r := row(t, s, stray); r.status != "pending" || r.attempts != 0 {
		t.Errorf("the stray message: %+v, want pending and uncharged", r)
	}
	s.exec(t, `INSERT INTO config (section, key, value) VALUES ('stage-typo', 'PROGRAM', $1)`, testWorkerBin(t))
	waitFor(t, 30*time.Second, "the message done once its stage is configured", func() bool { return row(t, s, stray).status == "done" })
	waitFor(t, 90*time.Second, "pepsi_stray_stages back to 0 on /metrics", func() bool {
		v, ok := metric(t, addr, "pepsi_stray_stages")
		return ok && v == 0
	})
	d.stop()
}
