// latencytrace.go: with -trace-latency, where a pepsi message's time goes between its enqueue
// and its done, hop by hop, from the server's statement log (every statement of pepsi's
// database, log_min_duration_statement = 0) and the message's own times: enqueue → the end of
// the dispatcher's claim that took it → the end of the worker's SELECT of the batch's payloads
// (the SDK's first statement) → the stage handler's start → the end of the worker's
// outcome UPDATE (with its commit, the WAL flush) → the benchmark's receipt of the done
// NOTIFY. The log's timestamps have millisecond resolution: the hops are good to about 1 ms.
package main

import (
	"bufio"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"time"
)

// hopNames are the hops of a traced message, in order.
var hopNames = []string{
	"enqueue → claim returned (notification, dispatcher wake-up, claim)",
	"claim returned → the worker's payload SELECT returned (pipe, worker wake-up, one round trip)",
	"payload SELECT returned → handler start",
	"handler start → outcome UPDATE returned (the statement and its commit)",
	"outcome UPDATE returned → done NOTIFY received",
}

// logStmtRe matches a statement's duration line under the cluster's log_line_prefix
// ('%m [%p] %a@%d ').
var logStmtRe = regexp.MustCompile(`^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) \S+ \[\d+\] (.*?)@\S+ LOG:  duration: ([0-9.]+) ms  (.*)$`)

// traceHops reads the server log from offset and returns, for each hop, the sorted times in
// ms of the messages it could follow (enqueue, start and done times by message key).
func (b *bench) traceHops(off int64, enq map[int64]time.Time, starts map[int64]int64, done map[int64]time.Time) [][]float64 {
	f, err := os.Open(b.pg.logPath())
	if err != nil {
		logf("  trace: %v", err)
		return nil
	}
	defer f.Close()
	if _, err := f.Seek(off, 0); err != nil {
		logf("  trace: %v", err)
		return nil
	}
	var claims, selects, updates []time.Time // statement end times
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		m := logStmtRe.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		t, err := time.Parse("2006-01-02 15:04:05.000", m[1])
		if err != nil {
			continue
		}
		app, stmt := m[2], m[4]
		switch {
		case strings.HasPrefix(app, "pepsi-dispatch") && strings.HasPrefix(stmt, "execute"):
			// The claim is the dispatcher's prepared statement (the log's execute lines do not
			// repeat its text); its other executions are rare while messages flow.
			claims = append(claims, t)
		case strings.HasPrefix(app, "pepsi-worker") && strings.Contains(stmt, "SELECT workqueue_id, attempts, payload"):
			selects = append(selects, t)
		case strings.HasPrefix(app, "pepsi-worker") && strings.Contains(stmt, "UPDATE workqueue"):
			updates = append(updates, t)
		}
	}
	slices.SortFunc(claims, func(x, y time.Time) int { return x.Compare(y) })
	slices.SortFunc(updates, func(x, y time.Time) int { return x.Compare(y) })
	slices.SortFunc(selects, func(x, y time.Time) int { return x.Compare(y) })
	after := func(ts []time.Time, t time.Time) (time.Time, bool) {
		// The log truncates to the millisecond: a statement that ended within the same
		// millisecond as t may show as just before it.
		i, _ := slices.BinarySearchFunc(ts, t.Add(-time.Millisecond), func(x, y time.Time) int { return x.Compare(y) })
		if i >= len(ts) {
			return time.Time{}, false
		}
		return ts[i], true
	}
	hops := make([][]float64, len(hopNames))
	ms := func(a, b time.Time) float64 { return float64(b.Sub(a).Microseconds()) / 1000 }
	for k, e := range enq {
		s0, ok1 := starts[k]
		d, ok2 := done[k]
		if !ok1 || !ok2 {
			continue
		}
		s := time.Unix(0, s0)
		c, ok := after(claims, e)
		if !ok || c.After(s.Add(time.Millisecond)) {
			continue
		}
		q, ok := after(selects, c)
		if !ok || q.After(s.Add(time.Millisecond)) {
			continue
		}
		u, ok := after(updates, s)
		if !ok || u.After(d.Add(time.Millisecond)) {
			continue
		}
		for i, v := range []float64{ms(e, c), ms(c, q), ms(q, s), ms(s, u), ms(u, d)} {
			hops[i] = append(hops[i], max(v, 0))
		}
	}
	for _, h := range hops {
		slices.Sort(h)
	}
	return hops
}

// hopsSection writes the hop-by-hop table of the traced latency runs, if any.
func (b *bench) hopsSection(w *strings.Builder) {
	first := true
	for _, l := range b.res.lat {
		if len(l.Hops) == 0 {
			continue
		}
		if first {
			first = false
			fmt.Fprintf(w, "### Where pepsi's latency goes, hop by hop (`-trace-latency`)\n\n")
			fmt.Fprintf(w, "Every statement of pepsi's database logged with its duration (`log_min_duration_statement = 0`, which ")
			fmt.Fprintf(w, "itself costs a little), matched with each message's enqueue, start and done times. Timestamps of the log ")
			fmt.Fprintf(w, "have millisecond resolution. The dispatcher and workers ran with `GODEBUG=gctrace=1`: their garbage ")
			fmt.Fprintf(w, "collections are in the kept logs (`-keep`).\n\n")
			fmt.Fprintf(w, "| run | hop | messages | p50 | p90 | p99 | max |\n|---|---|--:|--:|--:|--:|--:|\n")
		}
		for i, h := range l.Hops {
			fmt.Fprintf(w, "| %s %d/s | %s | %d | %s | %s | %s | %s |\n", l.Workload, l.Rate, hopNames[i], len(h),
				f2(pct(h, 50)), f2(pct(h, 90)), f2(pct(h, 99)), f2(pct(h, 100)))
		}
	}
	if !first {
		fmt.Fprintf(w, "\n")
	}
}
