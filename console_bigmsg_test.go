package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
)

// peakRSS is the most resident memory process pid has had (VmHWM), in bytes.
func peakRSS(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatalf("read the daemon's memory: %v", err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) == 3 && f[0] == "VmHWM:" {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				t.Fatalf("VmHWM: %q", l)
			}
			return kb << 10
		}
	}
	t.Fatalf("no VmHWM in /proc/%d/status", pid)
	return 0
}

// TestConsoleMessageBigPayload: the console's message page of a message whose payload and
// state are tens of megabytes (a document put in the queue whole; PostgreSQL takes a jsonb
// value up to 255 MB). The dispatcher read both whole, indented, escaped and rendered them:
// one look at such a message grew the daemon by several times their size, enough to have an
// appliance's kernel kill the dispatcher and stop the pipeline. The page shows the first part
// of each, says how big the whole is and how to read it all, and the daemon's memory does not
// grow with the value's size.
func TestConsoleMessageBigPayload(t *testing.T) {
	s := newTestSchema(t)
	addr := freePort(t)
	d := startDaemon(t, baseConf(s, "METRICS_LISTEN = "+addr)+stageConf(t, "a", "", ""), "pipeline")
	d.waitLog("dispatching", dbStatementBudget)
	var id int64
	if err := s.DB.QueryRow(`INSERT INTO workqueue (stage, payload, state, status)
	    VALUES ('a', jsonb_build_object('body', repeat('<p>', 4 << 20)), jsonb_build_object('log', repeat('x', 8 << 20)), 'held')
	    RETURNING workqueue_id`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	consoleOverview(t, addr)
	before := peakRSS(t, d.cmd.Process.Pid)
	resp, err := http.Get(fmt.Sprintf("http://%s/message/%d", addr, id))
	if err != nil {
		t.Fatalf("GET the message page: %v", err)
	}
	page, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET the message page: %s, %v", resp.Status, err)
	}
	grew := peakRSS(t, d.cmd.Process.Pid) - before
	t.Logf("page %d bytes; the daemon's peak memory grew by %d MiB", len(page), grew>>20)
	if len(page) > 1<<20 {
		t.Errorf("the message page is %d bytes", len(page))
	}
	// 238 MiB before (non-race: twelve times the message); 3 MiB now, 11 MiB under the race
	// detector, whose shadow memory multiplies every allocation.
	if grew > 40<<20 {
		t.Errorf("one look at a message of 20 MiB grew the daemon's peak memory by %d MiB", grew>>20)
	}
	for _, want := range []string{"&lt;p&gt;&lt;p&gt;", "xxxxxxxx", "Longer than 65536 characters", "pepsi-queue show " + strconv.FormatInt(id, 10)} {
		if !strings.Contains(string(page), want) {
			t.Errorf("the message page lacks %q", want)
		}
	}
	d.stop()
}
