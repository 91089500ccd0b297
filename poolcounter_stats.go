// poolcounter_stats.go: the lock service's statistics (doc/design/lockservice.md, Statistics):
// the counters, the STATS replies (FULL, UPTIME, one counter, our STATS KEY) in poolcounterd's
// exact format, and the same figures on /metrics.
//
// Owns: lockStats, the one table of counters (pcCounters) that drives STATS FULL, STATS
// <name> and /metrics, and the duration format exporters parse.
// Must not touch: the table's structure; it only reads it (under lockServer.mu).

package main

import (
	"fmt"
	"io"
	"strconv"
	"time"
)

// lockStats is the reference's statistics block (its stats.list) plus our own counters.
// Guarded by lockServer.mu. Gauges are kept exact: every change of the table adjusts them in
// the same critical section (no drift, unlike the reference's RELEASE-while-waiting).
type lockStats struct {
	processingTime       time.Duration // sum of ended holds, each measured from its own grant
	gainedTime           time.Duration // per DONE waiter: the releaser's hold, the work it was spared
	waitingTime          time.Duration // sum of waits that ended in a handoff LOCKED
	waitingTimeForMe     time.Duration // ... of those, ACQ4ME waiters
	waitingTimeForAnyone time.Duration // ... of those, ACQ4ANY waiters
	waitingTimeForGood   time.Duration // sum of waits that ended in DONE
	wastedTimeoutTime    time.Duration // sum of waits that ended in TIMEOUT

	totalAcquired     int64 // LOCKED replies, immediate or handoff
	totalReleases     int64 // RELEASED replies (incl. a RELEASE that cancelled a wait)
	hashtableEntries  int64 // gauge: keys with a holder or waiter
	processingWorkers int64 // gauge: held slots
	waitingWorkers    int64 // gauge: waiting slots
	connectErrors     int64 // failed accepts
	failedSends       int64 // replies lost: write failed, or queue overflow, or dropped connection
	fullQueues        int64 // QUEUE_FULL replies
	lockMismatch      int64 // LOCK_HELD replies
	lockWhileWaiting  int64 // ERROR WAIT_FOR_RESPONSE replies
	releaseMismatch   int64 // NOT_LOCKED replies
	processedCount    int64 // ended holds (RELEASE or disconnect)

	// Ours, on /metrics only (STATS FULL keeps the reference's exact line set).
	connections      int64 // gauge: open client connections
	connectionsTotal int64 // accepted connections
	linesTooLong     int64 // ERROR LINE_TOO_LONG replies
	slowClients      int64 // connections dropped because they did not read their replies
}

// sub returns the change from old to st for counters; gauges keep st's value.
func (st lockStats) sub(old lockStats) lockStats {
	d := st
	d.processingTime -= old.processingTime
	d.gainedTime -= old.gainedTime
	d.waitingTime -= old.waitingTime
	d.waitingTimeForMe -= old.waitingTimeForMe
	d.waitingTimeForAnyone -= old.waitingTimeForAnyone
	d.waitingTimeForGood -= old.waitingTimeForGood
	d.wastedTimeoutTime -= old.wastedTimeoutTime
	d.totalAcquired -= old.totalAcquired
	d.totalReleases -= old.totalReleases
	d.connectErrors -= old.connectErrors
	d.failedSends -= old.failedSends
	d.fullQueues -= old.fullQueues
	d.lockMismatch -= old.lockMismatch
	d.lockWhileWaiting -= old.lockWhileWaiting
	d.releaseMismatch -= old.releaseMismatch
	d.processedCount -= old.processedCount
	d.connectionsTotal -= old.connectionsTotal
	d.linesTooLong -= old.linesTooLong
	d.slowClients -= old.slowClients
	return d
}

// pcCounters lists the twelve STATS counters in STATS FULL order, with their /metrics names.
var pcCounters = []struct {
	name   string // PoolCounter name (STATS <name>)
	metric string // pepsi_poolcounter_<metric>
	gauge  bool
	help   string
	get    func(*lockStats) int64
}{
	{"total_acquired", "acquired_total", false, "Locks granted (LOCKED), immediately or by handoff.", func(s *lockStats) int64 { return s.totalAcquired }},
	{"total_releases", "releases_total", false, "RELEASED replies.", func(s *lockStats) int64 { return s.totalReleases }},
	{"hashtable_entries", "keys", true, "Keys with at least one holder or waiter.", func(s *lockStats) int64 { return s.hashtableEntries }},
	{"processing_workers", "processing_workers", true, "Locks currently held.", func(s *lockStats) int64 { return s.processingWorkers }},
	{"waiting_workers", "waiting_workers", true, "Requests currently waiting for a lock.", func(s *lockStats) int64 { return s.waitingWorkers }},
	{"connect_errors", "connect_errors_total", false, "Failed accepts.", func(s *lockStats) int64 { return s.connectErrors }},
	{"failed_sends", "failed_sends_total", false, "Replies that could not be delivered.", func(s *lockStats) int64 { return s.failedSends }},
	{"full_queues", "full_queues_total", false, "QUEUE_FULL replies.", func(s *lockStats) int64 { return s.fullQueues }},
	{"lock_mismatch", "lock_held_total", false, "LOCK_HELD replies (connection already has 4 lock slots).", func(s *lockStats) int64 { return s.lockMismatch }},
	{"lock_while_waiting", "lock_while_waiting_total", false, "ERROR WAIT_FOR_RESPONSE replies.", func(s *lockStats) int64 { return s.lockWhileWaiting }},
	{"release_mismatch", "release_mismatch_total", false, "NOT_LOCKED replies.", func(s *lockStats) int64 { return s.releaseMismatch }},
	{"processed_count", "processed_total", false, "Holds that ended (RELEASE or disconnect).", func(s *lockStats) int64 { return s.processedCount }},
}

// keyInfo is the reply to our STATS KEY <key> extension: one line describing one key.
func (s *lockServer) keyInfo(b []byte, key []byte, now time.Time) []byte {
	var holders, waitMe, waitAny int
	var held, waited time.Duration
	holder := "-"
	if k := s.keys[string(key)]; k != nil {
		holders, waitMe, waitAny = k.holders.n, k.waitMe.n, k.waitAny.n
		if h := k.holders.head; h != nil {
			held = now.Sub(h.since)
			holder = h.conn.remote
		}
		for _, w := range []*lockSlot{k.waitMe.head, k.waitAny.head} {
			if w != nil && now.Sub(w.since) > waited {
				waited = now.Sub(w.since)
			}
		}
	}
	b = append(b, "key="...)
	b = append(b, key...)
	b = fmt.Appendf(b, " holders=%d waiting_for_me=%d waiting_for_anyone=%d longest_hold=%.6fs longest_wait=%.6fs oldest_holder=%s\n",
		holders, waitMe, waitAny, held.Seconds(), waited.Seconds(), holder)
	return b
}

// ---------------------------------------------------------------------------------------------
// STATS replies (doc/design/lockservice.md, Statistics)

func (s *lockServer) appendStats(b []byte, item []byte, now time.Time) []byte {
	switch {
	case pcEqualFold(item, "FULL"):
		b = s.appendUptime(b, now)
		st := &s.stats
		avg := time.Duration(0)
		if st.processedCount > 0 {
			avg = st.processingTime / time.Duration(st.processedCount)
		}
		for _, d := range []struct {
			name string
			v    time.Duration
		}{
			{"total processing time", st.processingTime},
			{"average processing time", avg},
			{"gained time", st.gainedTime},
			{"waiting time", st.waitingTime},
			{"waiting time for me", st.waitingTimeForMe},
			{"waiting time for anyone", st.waitingTimeForAnyone},
			{"waiting time for good", st.waitingTimeForGood},
			{"wasted timeout time", st.wastedTimeoutTime},
		} {
			b = append(b, d.name...)
			b = append(b, ": "...)
			b = appendPCDuration(b, d.v)
			b = append(b, '\n')
		}
		for _, c := range pcCounters {
			b = pcAppendCounter(b, c.name, c.get(st))
		}
		return append(b, '\n') // the empty line that ends the block for exporters
	case pcEqualFold(item, "UPTIME"):
		return s.appendUptime(b, now)
	case len(item) >= 3 && pcEqualFold(item[:3], "KEY") && (len(item) == 3 || item[3] == ' '):
		key, _ := pcNextToken(item[3:])
		if len(key) == 0 {
			return append(b, pcBadSyntax...)
		}
		return s.keyInfo(b, key, now)
	}
	for _, c := range pcCounters {
		if pcEqualFold(item, c.name) {
			return pcAppendCounter(b, c.name, c.get(&s.stats))
		}
	}
	return append(b, pcWrongStat...)
}

func (s *lockServer) appendUptime(b []byte, now time.Time) []byte {
	sec := int64(now.Sub(s.start) / time.Second)
	return fmt.Appendf(b, "uptime: %d days, %dh %dm %ds\n", sec/86400, sec/3600%24, sec/60%60, sec%60)
}

func pcAppendCounter(b []byte, name string, v int64) []byte {
	b = append(b, name...)
	b = append(b, ": "...)
	b = strconv.AppendInt(b, v, 10)
	return append(b, '\n')
}

// appendPCDuration formats like the reference's strtimeval: "[[[D days ]Hh ]Mm ]S.uuuuuus",
// larger units only when the value reaches them; microseconds exact (the reference went through
// a 32-bit float).
func appendPCDuration(b []byte, d time.Duration) []byte {
	if d < 0 {
		d = 0
	}
	us := int64(d / time.Microsecond)
	sec, frac := us/1e6, us%1e6
	if sec >= 60 {
		min := sec / 60
		sec %= 60
		if min >= 60 {
			h := min / 60
			min %= 60
			if h >= 24 {
				b = fmt.Appendf(b, "%d days ", h/24)
				h %= 24
			}
			b = fmt.Appendf(b, "%dh ", h)
		}
		b = fmt.Appendf(b, "%dm ", min)
	}
	return fmt.Appendf(b, "%d.%06ds", sec, frac)
}

// pcEqualFold compares ASCII case-insensitively (strcasecmp), without allocating.
func pcEqualFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := 0; i < len(b); i++ {
		x, y := b[i], s[i]
		if 'a' <= x && x <= 'z' {
			x -= 'a' - 'A'
		}
		if 'a' <= y && y <= 'z' {
			y -= 'a' - 'A'
		}
		if x != y {
			return false
		}
	}
	return true
}

// ---------------------------------------------------------------------------------------------
// Metrics

// writeMetrics writes the lock counters and gauges in Prometheus text format (names prefixed
// pepsi_poolcounter_).
func (s *lockServer) writeMetrics(w io.Writer) {
	s.mu.Lock()
	st := s.stats
	uptime := s.clock().Sub(s.start)
	s.mu.Unlock()

	var b []byte
	metric := func(name, typ, help string, v float64) {
		b = fmt.Appendf(b, "# HELP pepsi_poolcounter_%s %s\n# TYPE pepsi_poolcounter_%s %s\npepsi_poolcounter_%s %s\n",
			name, help, name, typ, name, strconv.FormatFloat(v, 'g', -1, 64))
	}
	for _, c := range pcCounters {
		typ := "counter"
		if c.gauge {
			typ = "gauge"
		}
		metric(c.metric, typ, c.help, float64(c.get(&st)))
	}
	metric("processing_seconds_total", "counter", "Time locks were held, summed over ended holds.", st.processingTime.Seconds())
	metric("gained_seconds_total", "counter", "Per DONE waiter, the releaser's hold time (work it was spared).", st.gainedTime.Seconds())
	b = fmt.Appendf(b, "# HELP pepsi_poolcounter_waiting_seconds_total Time waited before a handoff LOCKED, by request type.\n# TYPE pepsi_poolcounter_waiting_seconds_total counter\n")
	b = fmt.Appendf(b, "pepsi_poolcounter_waiting_seconds_total{type=\"me\"} %s\n", strconv.FormatFloat(st.waitingTimeForMe.Seconds(), 'g', -1, 64))
	b = fmt.Appendf(b, "pepsi_poolcounter_waiting_seconds_total{type=\"anyone\"} %s\n", strconv.FormatFloat(st.waitingTimeForAnyone.Seconds(), 'g', -1, 64))
	metric("waiting_for_good_seconds_total", "counter", "Time waited before a DONE.", st.waitingTimeForGood.Seconds())
	metric("wasted_timeout_seconds_total", "counter", "Time waited before a TIMEOUT.", st.wastedTimeoutTime.Seconds())
	metric("connections", "gauge", "Open client connections.", float64(st.connections))
	metric("connections_total", "counter", "Accepted client connections.", float64(st.connectionsTotal))
	metric("lines_too_long_total", "counter", "Request lines rejected with ERROR LINE_TOO_LONG.", float64(st.linesTooLong))
	metric("slow_clients_total", "counter", "Connections dropped because they did not read their replies.", float64(st.slowClients))
	metric("uptime_seconds", "gauge", "Seconds since the lock service started.", uptime.Seconds())
	w.Write(b) //nolint:errcheck // the HTTP handler owns the writer and its errors
}
