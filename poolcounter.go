// poolcounter.go: the PoolCounter-compatible lock service (issue 5,
// ../shared/spec/poolcounter.md).
//
// Owns: the lock table (keys, their holders and FIFO waiter queues), each connection's stack of
// up to four lock slots, the waiter timeout heap, the PoolCounter statistics, the accept loop
// and every accepted connection with its reader and writer.
// Must not touch: configuration parsing, process signals, the dispatch queue or PostgreSQL.
// main.go builds the server with newLockServer, opens the socket with listenPoolCounter, runs
// Serve until its ctx is cancelled and calls writeMetrics from /metrics.
//
// Concurrency: one mutex, lockServer.mu, guards the whole table (keys, slots, heap, stats);
// every command, disconnect and timeout runs as one critical section under it, so the
// reference server's single-threaded decision order holds. Nothing under mu blocks or does
// I/O: replies are appended to the receiving connection's bounded output queue (guarded by
// lockConn.outMu, taken inside mu or alone) and written after mu is released. A connection's
// reader writes its own replies; replies caused by others (a handoff LOCKED, a DONE, a
// TIMEOUT) are written by whoever caused them with one non-blocking write, and what the socket
// does not take goes to a short-lived writer goroutine, so a client that stops reading stalls
// nobody but itself.

package main

import (
	"bytes"
	"container/heap"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"syscall"
	"time"
)

const (
	// poolCounterSlotsPerConn is MAX_LOCKS_PER_CLIENT of the reference: the 5th ACQ on a
	// connection gets LOCK_HELD. Kept at 4 for parity (spec §15.6).
	poolCounterSlotsPerConn = 4

	// poolCounterMaxLineDefault bounds one request line, "\n" included. The reference reads into
	// a 1024-byte buffer, so 1023 bytes + "\n" is the longest line it ever understood; a longer
	// line here gets "ERROR LINE_TOO_LONG" instead of being silently mangled.
	poolCounterMaxLineDefault = 1024

	// poolCounterMaxOutputDefault bounds the replies queued for one connection and not yet
	// accepted by its socket. A well-behaved client has at most a few short replies in flight
	// (one per request plus one LOCKED/DONE/TIMEOUT); only a client that pipelines requests
	// without reading can reach this, and it is then disconnected (its locks are freed).
	poolCounterMaxOutputDefault = 64 << 10

	// poolCounterWriteTimeoutDefault: a write that cannot complete this long means the client's
	// receive window stayed full; the connection is closed and its locks freed.
	poolCounterWriteTimeoutDefault = 30 * time.Second

	// Keepalive on accepted connections, so a holder whose host died without a reset frees its
	// locks after Idle + Interval*Count (35 s) instead of never (spec §16).
	poolCounterKeepAliveIdle     = 15 * time.Second
	poolCounterKeepAliveInterval = 5 * time.Second
	poolCounterKeepAliveCount    = 4

	// Accept back-off after a failed accept (EMFILE...), doubled per failure up to the max,
	// like net/http's Serve, instead of the reference's busy loop.
	poolCounterAcceptBackoffMin = 5 * time.Millisecond
	poolCounterAcceptBackoffMax = time.Second

	// poolCounterLogEvery rate-limits repeated warnings (accept failures, slow clients).
	poolCounterLogEvery = 10 * time.Second
)

// Replies, exact bytes of spec §4 plus our two additions.
const (
	pcLocked          = "LOCKED\n"
	pcDone            = "DONE\n"
	pcTimeout         = "TIMEOUT\n"
	pcQueueFull       = "QUEUE_FULL\n"
	pcLockHeld        = "LOCK_HELD\n"
	pcReleased        = "RELEASED\n"
	pcNotLocked       = "NOT_LOCKED\n"
	pcBadCommand      = "ERROR BAD_COMMAND\n"
	pcBadSyntax       = "ERROR BAD_SYNTAX\n"
	pcWaitForResponse = "ERROR WAIT_FOR_RESPONSE\n"
	pcWrongStat       = "ERROR WRONG_STAT\n" // the reference omits the "\n" (defect, §9)
	pcLineTooLong     = "ERROR LINE_TOO_LONG\n"
)

// lockServer is the lock table and the server around it. Build it with newLockServer; the
// settings may be changed only before Serve.
type lockServer struct {
	log *slog.Logger

	// maxLine is the longest request line accepted, "\n" included (config MAX_LINE_BYTES).
	maxLine int
	// maxOutput is the most reply bytes queued for one connection before it is dropped.
	maxOutput int
	// writeTimeout bounds one write to a client before the connection is dropped.
	writeTimeout time.Duration
	// now is a test hook for the statistics clock; nil means time.Now.
	now func() time.Time

	start time.Time // for STATS UPTIME

	warnAccept pcLogLimiter
	warnSlow   pcLogLimiter

	// handlers counts connection readers and writer goroutines; Serve waits for it.
	handlers sync.WaitGroup

	// mu guards all fields below, every lockConn's slot stack (slots, n) and every lockSlot.
	// Critical sections never block: no I/O, no channel sends that can wait.
	mu       sync.Mutex
	keys     map[string]*lockKey // keys with at least one holder or waiter
	waiters  lockWaiterHeap      // every waiting slot, earliest deadline first
	timer    *time.Timer         // armed for waiters[0].deadline; fires into timeoutLoop
	seq      uint64              // enqueue order, ties timeouts FIFO
	stats    lockStats
	woken    []*lockConn // connections given an asynchronous reply in this critical section
	conns    map[*lockConn]struct{}
	closing  bool // Serve is shutting down: accepted connections are closed at once
	serveRan bool // Serve was called; it may run once
}

// newLockServer returns a server with empty tables; log gets component attributes.
func newLockServer(log *slog.Logger) *lockServer {
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	t := time.NewTimer(time.Hour)
	t.Stop()
	return &lockServer{
		log:          log.With("component", "poolcounter"),
		maxLine:      poolCounterMaxLineDefault,
		maxOutput:    poolCounterMaxOutputDefault,
		writeTimeout: poolCounterWriteTimeoutDefault,
		start:        time.Now(),
		keys:         make(map[string]*lockKey),
		timer:        t,
		conns:        make(map[*lockConn]struct{}),
	}
}

func (s *lockServer) clock() time.Time {
	if s.now != nil {
		return s.now()
	}
	return time.Now()
}

// ---------------------------------------------------------------------------------------------
// Lock table

type lockSlotState uint8

const (
	slotFree    lockSlotState = iota
	slotWaitMe                // queued by ACQ4ME
	slotWaitAny               // queued by ACQ4ANY
	slotHeld
)

// lockSlot is one entry of a connection's lock stack. All fields are guarded by lockServer.mu.
type lockSlot struct {
	conn  *lockConn
	key   *lockKey
	state lockSlotState
	since time.Time // start of the current wait or hold

	prev, next *lockSlot // siblings in key.holders, key.waitMe or key.waitAny

	deadline time.Time // while waiting
	seq      uint64    // while waiting: enqueue order
	heapIdx  int       // index in lockServer.waiters while waiting, else -1
}

// lockSlotList is an intrusive FIFO list of slots (no allocation per lock).
type lockSlotList struct {
	head, tail *lockSlot
	n          int
}

func (l *lockSlotList) push(sl *lockSlot) {
	sl.prev, sl.next = l.tail, nil
	if l.tail != nil {
		l.tail.next = sl
	} else {
		l.head = sl
	}
	l.tail = sl
	l.n++
}

func (l *lockSlotList) remove(sl *lockSlot) {
	if sl.prev != nil {
		sl.prev.next = sl.next
	} else {
		l.head = sl.next
	}
	if sl.next != nil {
		sl.next.prev = sl.prev
	} else {
		l.tail = sl.prev
	}
	sl.prev, sl.next = nil, nil
	l.n--
}

// lockKey is the state of one key; it exists while someone holds or waits for it. Limits are
// not stored: every request is judged by its own workers/maxqueue (spec §5).
type lockKey struct {
	name    string
	holders lockSlotList // in acquisition order
	waitMe  lockSlotList // ACQ4ME waiters, FIFO
	waitAny lockSlotList // ACQ4ANY waiters, FIFO
}

func (k *lockKey) count() int { return k.holders.n + k.waitMe.n + k.waitAny.n }

// lockWaiterHeap orders waiting slots by deadline (then enqueue order) for container/heap.
type lockWaiterHeap []*lockSlot

func (h lockWaiterHeap) Len() int { return len(h) }
func (h lockWaiterHeap) Less(i, j int) bool {
	if !h[i].deadline.Equal(h[j].deadline) {
		return h[i].deadline.Before(h[j].deadline)
	}
	return h[i].seq < h[j].seq
}
func (h lockWaiterHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].heapIdx, h[j].heapIdx = i, j
}
func (h *lockWaiterHeap) Push(x any) {
	sl := x.(*lockSlot)
	sl.heapIdx = len(*h)
	*h = append(*h, sl)
}
func (h *lockWaiterHeap) Pop() any {
	old := *h
	sl := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	sl.heapIdx = -1
	return sl
}

// lockStats is the reference's statistics block (stats.list, spec §8) plus our own counters.
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

// acquire runs ACQ4ME/ACQ4ANY for c with the reference's decision order (spec §3, §6.1) and
// returns the immediate reply, or "" when the request now waits. Called with s.mu held.
func (s *lockServer) acquire(c *lockConn, req *pcRequest, now time.Time) string {
	if c.n >= poolCounterSlotsPerConn {
		s.stats.lockMismatch++
		return pcLockHeld
	}
	if c.n > 0 && c.slots[c.n-1].state != slotHeld {
		s.stats.lockWhileWaiting++
		return pcWaitForResponse
	}
	if req.badSyntax {
		return pcBadSyntax
	}
	k := s.keys[string(req.key)] // no allocation for the lookup
	count, holders := 0, 0
	if k != nil {
		count, holders = k.count(), k.holders.n
	}
	if uint64(count) >= uint64(req.maxQueue) {
		s.stats.fullQueues++
		return pcQueueFull
	}
	if uint64(holders) >= uint64(req.workers) && req.timeout == 0 {
		return pcTimeout // nothing queued, no counter moves
	}
	if k == nil {
		k = &lockKey{name: string(req.key)}
		s.keys[k.name] = k
		s.stats.hashtableEntries++
	}
	sl := &c.slots[c.n]
	c.n++
	sl.key, sl.since = k, now
	if uint64(holders) < uint64(req.workers) {
		sl.state = slotHeld
		k.holders.push(sl)
		s.stats.processingWorkers++
		s.stats.totalAcquired++
		return pcLocked
	}
	if req.op == pcOpAcqAny {
		sl.state = slotWaitAny
		k.waitAny.push(sl)
	} else {
		sl.state = slotWaitMe
		k.waitMe.push(sl)
	}
	s.stats.waitingWorkers++
	s.seq++
	sl.seq = s.seq
	sl.deadline = now.Add(time.Duration(req.timeout) * time.Second)
	heap.Push(&s.waiters, sl)
	if sl.heapIdx == 0 {
		s.timer.Reset(sl.deadline.Sub(now))
	}
	return ""
}

// release runs RELEASE for c: pop the newest slot (LIFO). Called with s.mu held.
func (s *lockServer) release(c *lockConn, now time.Time) string {
	if c.n == 0 {
		s.stats.releaseMismatch++
		return pcNotLocked
	}
	sl := &c.slots[c.n-1]
	c.n--
	if sl.state == slotHeld {
		s.endHold(sl, now, true)
	} else {
		// Only the newest slot can be waiting: RELEASE just cancels that wait. The reference
		// ran the full release path here (bogus DONEs to ANY waiters, gauge leak, §6.5).
		s.dropWaiter(sl)
	}
	s.stats.totalReleases++
	return pcReleased
}

// endHold ends a held slot. With broadcast (a RELEASE) every ACQ4ANY waiter of the key is
// answered DONE first; then the freed slot goes to the oldest ACQ4ME waiter, else the oldest
// ACQ4ANY waiter (only possible on disconnect), which gets LOCKED (spec §6.2, §6.3).
func (s *lockServer) endHold(sl *lockSlot, now time.Time, broadcast bool) {
	k := sl.key
	k.holders.remove(sl)
	held := now.Sub(sl.since)
	if broadcast {
		for w := k.waitAny.head; w != nil; w = k.waitAny.head {
			s.stats.waitingTimeForGood += now.Sub(w.since)
			s.stats.gainedTime += held
			s.popTop(w)
			s.unqueue(w)
			s.send(w.conn, pcDone)
		}
	}
	s.stats.processingTime += held
	s.stats.processedCount++

	var next *lockSlot
	switch {
	case k.waitMe.head != nil:
		next = k.waitMe.head
		k.waitMe.remove(next)
		s.stats.waitingTimeForMe += now.Sub(next.since)
	case k.waitAny.head != nil:
		next = k.waitAny.head
		k.waitAny.remove(next)
		s.stats.waitingTimeForAnyone += now.Sub(next.since)
	}
	sl.state, sl.key = slotFree, nil
	if next == nil {
		s.stats.processingWorkers--
		s.freeKeyIfIdle(k)
		return
	}
	heap.Remove(&s.waiters, next.heapIdx)
	s.stats.waitingWorkers--
	s.stats.waitingTime += now.Sub(next.since)
	// The new hold starts now; the reference kept the wait start, so its processing time
	// counted the wait too (§8).
	next.state, next.since = slotHeld, now
	k.holders.push(next)
	s.stats.totalAcquired++
	s.send(next.conn, pcLocked)
}

// dropWaiter takes a waiting slot out of its queue and the timeout heap and frees its key if
// nobody is left. The caller has already removed it from its connection's stack and answers
// (or not) itself.
func (s *lockServer) dropWaiter(sl *lockSlot) {
	k := sl.key
	s.unqueue(sl)
	s.freeKeyIfIdle(k)
}

// unqueue is dropWaiter without freeing the key, for endHold, which frees it once at the end.
func (s *lockServer) unqueue(sl *lockSlot) {
	k := sl.key
	if sl.state == slotWaitAny {
		k.waitAny.remove(sl)
	} else {
		k.waitMe.remove(sl)
	}
	if sl.heapIdx >= 0 {
		heap.Remove(&s.waiters, sl.heapIdx)
	}
	s.stats.waitingWorkers--
	sl.state, sl.key = slotFree, nil
}

// popTop removes a waiting slot from its connection's stack; a waiting slot is always the top.
func (s *lockServer) popTop(sl *lockSlot) {
	c := sl.conn
	if c.n == 0 || &c.slots[c.n-1] != sl {
		panic("poolcounter: waiting slot is not its connection's newest")
	}
	c.n--
}

func (s *lockServer) freeKeyIfIdle(k *lockKey) {
	if k.count() == 0 {
		delete(s.keys, k.name)
		s.stats.hashtableEntries--
	}
}

// expireWaiters answers TIMEOUT to every waiter whose deadline has passed and re-arms the
// timer for the next one. Locks the waiter already holds stay held. Called with s.mu held.
func (s *lockServer) expireWaiters(now time.Time) {
	for len(s.waiters) > 0 && !s.waiters[0].deadline.After(now) {
		w := s.waiters[0]
		s.stats.wastedTimeoutTime += now.Sub(w.since)
		s.popTop(w)
		s.dropWaiter(w)
		s.send(w.conn, pcTimeout)
	}
	if len(s.waiters) > 0 {
		s.timer.Reset(s.waiters[0].deadline.Sub(now))
	}
}

// disconnect frees everything c held or waited for, newest first and without the DONE
// broadcast: a freed slot goes to the next waiter as LOCKED (spec §6.3). Called with s.mu held.
func (s *lockServer) disconnect(c *lockConn, now time.Time) {
	for c.n > 0 {
		sl := &c.slots[c.n-1]
		c.n--
		if sl.state == slotHeld {
			s.endHold(sl, now, false)
		} else {
			s.dropWaiter(sl)
		}
	}
	delete(s.conns, c)
	s.stats.connections--
	c.outMu.Lock()
	c.closed = true
	c.outMu.Unlock()
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
// Request parsing (spec §3)

type pcOp uint8

const (
	pcOpBad pcOp = iota
	pcOpAcqMe
	pcOpAcqAny
	pcOpRelease
	pcOpStats
)

type pcRequest struct {
	op        pcOp
	key       []byte // ACQ: aliases the line
	workers   uint32
	maxQueue  uint32
	timeout   uint32 // seconds; 0 = do not wait
	badSyntax bool   // ACQ without key, or workers/maxqueue 0 or not a number
	item      []byte // STATS: everything after "STATS "
}

// parsePoolCounterLine decodes one request line (without its "\n") the way the reference does:
// one trailing "\r" is dropped, the line ends at a NUL byte (C strings), commands are
// case-sensitive prefixes, ACQ arguments are separated by runs of spaces only.
func parsePoolCounterLine(line []byte) pcRequest {
	if n := len(line); n > 0 && line[n-1] == '\r' {
		line = line[:n-1]
	}
	if i := bytes.IndexByte(line, 0); i >= 0 {
		line = line[:i]
	}
	var req pcRequest
	var args []byte
	switch {
	case bytes.HasPrefix(line, []byte("ACQ4ME ")):
		req.op, args = pcOpAcqMe, line[len("ACQ4ME "):]
	case bytes.HasPrefix(line, []byte("ACQ4ANY ")):
		req.op, args = pcOpAcqAny, line[len("ACQ4ANY "):]
	case bytes.HasPrefix(line, []byte("RELEASE")):
		req.op = pcOpRelease // any continuation is ignored (python-poolcounter sends the key)
		return req
	case bytes.HasPrefix(line, []byte("STATS ")):
		req.op, req.item = pcOpStats, line[len("STATS "):]
		return req
	default:
		return req
	}
	var tok [4][]byte
	for i := range tok {
		tok[i], args = pcNextToken(args)
	}
	req.key = tok[0]
	req.workers, req.maxQueue, req.timeout = pcAtou32(tok[1]), pcAtou32(tok[2]), pcAtou32(tok[3])
	req.badSyntax = len(req.key) == 0 || req.workers == 0 || req.maxQueue == 0
	return req
}

// pcNextToken splits off the next space-separated token, skipping runs of spaces (strtok " ").
func pcNextToken(b []byte) (tok, rest []byte) {
	for len(b) > 0 && b[0] == ' ' {
		b = b[1:]
	}
	i := bytes.IndexByte(b, ' ')
	if i < 0 {
		return b, nil
	}
	return b[:i], b[i+1:]
}

// pcAtou32 is the reference's atou: all ASCII digits or the value is 0; wraps modulo 2^32.
func pcAtou32(b []byte) uint32 {
	var n uint32
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0
		}
		n = n*10 + uint32(c-'0')
	}
	return n
}

// ---------------------------------------------------------------------------------------------
// STATS replies (spec §9)

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
// Line framing

// pcLineFramer splits a byte stream into lines through one fixed buffer of maxLine bytes, so a
// connection's input memory is bounded. A line that does not fit is reported once as tooLong
// and its bytes are skipped up to the next "\n"; the lines after it are read normally.
type pcLineFramer struct {
	buf      []byte
	r, w     int  // buf[r:w] are unread bytes
	scan     int  // buf[r:scan] is known to hold no "\n"
	skipping bool // inside an overlong line
}

func newPCLineFramer(maxLine int) *pcLineFramer { return &pcLineFramer{buf: make([]byte, maxLine)} }

// space returns where to read more input, first moving a partial line to the buffer's start.
// It is never empty.
func (f *pcLineFramer) space() []byte {
	if f.r == f.w {
		f.r, f.w, f.scan = 0, 0, 0
	} else if f.w == len(f.buf) {
		n := copy(f.buf, f.buf[f.r:f.w])
		f.scan -= f.r
		f.r, f.w = 0, n
	}
	return f.buf[f.w:]
}

// wrote records n bytes read into space().
func (f *pcLineFramer) wrote(n int) { f.w += n }

// next returns the next complete line (without "\n", aliasing the buffer until the next
// space()), or tooLong once per overlong line, or ok=false when more input is needed.
func (f *pcLineFramer) next() (line []byte, tooLong, ok bool) {
	for {
		i := bytes.IndexByte(f.buf[f.scan:f.w], '\n')
		if i < 0 {
			break
		}
		end := f.scan + i
		line = f.buf[f.r:end]
		f.r, f.scan = end+1, end+1
		if f.skipping {
			f.skipping = false
			continue
		}
		return line, false, true
	}
	f.scan = f.w
	if f.skipping {
		f.r, f.w, f.scan = 0, 0, 0
		return nil, false, false
	}
	if f.r == 0 && f.w == len(f.buf) {
		f.skipping = true
		f.r, f.w, f.scan = 0, 0, 0
		return nil, true, true
	}
	return nil, false, false
}

// ---------------------------------------------------------------------------------------------
// Connections

// lockConn is one client connection.
type lockConn struct {
	s      *lockServer
	nc     net.Conn
	rc     syscall.RawConn // nc's socket for non-blocking writes; nil for other conns
	remote string
	woken  []*lockConn // reader's scratch list for beginOp/endOp

	// Guarded by s.mu.
	slots [poolCounterSlotsPerConn]lockSlot
	n     int // slots in use; slots[:n] is the stack, only slots[n-1] may be waiting

	// outMu guards the fields below. Lock order: s.mu before outMu.
	outMu   sync.Mutex
	out     []byte // replies not yet handed to the socket, in order
	spare   []byte // the other buffer, reused to avoid allocation
	writing bool   // a goroutine is writing; it takes out when done, others only append
	broken  bool   // write failed or queue overflowed: output is dropped, nc is closed
	closed  bool   // disconnected: its reader is returning, start no writer for it
	// overflowed: the queue passed s.maxOutput (the client pipelines without reading).
	overflowed bool
}

// send queues an asynchronous reply for c (a handoff LOCKED, a DONE, a TIMEOUT: caused by
// another connection or the timer). Called with s.mu held, which fixes the order of c's replies
// with respect to the table. The caller flushes s.woken once it has released s.mu.
func (s *lockServer) send(c *lockConn, msg string) {
	s.queue(c, msg)
	s.woken = append(s.woken, c)
}

// queue appends a reply to c's output; past s.maxOutput the client is dropped. Called with s.mu
// held.
func (s *lockServer) queue(c *lockConn, msg string) {
	c.outMu.Lock()
	defer c.outMu.Unlock()
	if c.broken {
		s.stats.failedSends++
		return
	}
	if len(c.out)+len(msg) > s.maxOutput {
		c.broken = true
		c.overflowed = true // logged by the reader on its way out, not here under s.mu
		s.stats.failedSends++
		s.stats.slowClients++
		// Closing makes the reader return, which frees the client's locks.
		c.nc.Close() //nolint:errcheck // the close error of a connection we drop means nothing
		return
	}
	c.out = append(c.out, msg...)
}

// beginOp starts a critical section that may wake other connections; scratch is the caller's
// reusable list. endOp ends it and writes the replies to the woken connections.
func (s *lockServer) beginOp(scratch []*lockConn) {
	s.mu.Lock()
	s.woken = scratch[:0]
}

func (s *lockServer) endOp() (scratch []*lockConn) {
	woken := s.woken
	s.woken = nil
	s.mu.Unlock()
	for _, c := range woken {
		c.flush(false)
	}
	clear(woken) // do not keep closed connections reachable
	return woken[:0]
}

func (c *lockConn) queued() int {
	c.outMu.Lock()
	defer c.outMu.Unlock()
	return len(c.out)
}

// flush writes c's queued replies unless another goroutine is already writing them. The first
// attempt is a non-blocking write, which is all a client that reads its replies ever needs.
// What the socket does not take is written by a blocking write with a deadline: by the caller
// itself when it may block (c's own reader), else by a new writer goroutine, so that no
// goroutine ever waits on another client's socket.
func (c *lockConn) flush(mayBlock bool) {
	c.outMu.Lock()
	if c.writing || len(c.out) == 0 || c.broken {
		c.outMu.Unlock()
		return
	}
	c.writing = true
	c.outMu.Unlock()
	c.drain(mayBlock)
}

// drain writes until c.out is empty. The caller has set c.writing; drain clears it, or hands
// it to the writer goroutine it starts.
func (c *lockConn) drain(mayBlock bool) {
	s := c.s
	for {
		c.outMu.Lock()
		if len(c.out) == 0 || c.broken {
			c.writing = false
			c.outMu.Unlock()
			return
		}
		buf := c.out
		c.out, c.spare = c.spare[:0], nil
		c.outMu.Unlock()

		n, err := c.tryWrite(buf)
		if err == nil && n < len(buf) && mayBlock {
			var m int
			if err = c.nc.SetWriteDeadline(time.Now().Add(s.writeTimeout)); err == nil {
				m, err = c.nc.Write(buf[n:])
			}
			n += m
		}

		c.outMu.Lock()
		if err != nil {
			c.writing, c.broken = false, true
			c.outMu.Unlock()
			c.writeFailed(err)
			return
		}
		if n < len(buf) {
			// Socket full and we may not block: the rest goes first, to a writer goroutine
			// that keeps c.writing. Unless c is disconnected, its reader has not returned, so
			// the handler count is above zero and Add is allowed while Serve may be in Wait.
			rest := append(make([]byte, 0, len(buf)-n+len(c.out)), buf[n:]...)
			c.out, c.spare = append(rest, c.out...), buf[:0]
			if c.closed {
				c.writing = false
			} else {
				s.handlers.Add(1)
				go func() {
					defer s.handlers.Done()
					c.drain(true)
				}()
			}
			c.outMu.Unlock()
			return
		}
		c.spare = buf[:0]
		c.outMu.Unlock()
	}
}

// tryWrite writes what the socket takes now without waiting. Connections without a raw
// socket (tests' pipes) take nothing and leave the work to the blocking path.
func (c *lockConn) tryWrite(buf []byte) (int, error) {
	if c.rc == nil {
		return 0, nil
	}
	n, werr := 0, error(nil)
	err := c.rc.Write(func(fd uintptr) bool {
		for {
			n, werr = syscall.Write(int(fd), buf)
			if werr != syscall.EINTR {
				return true // never wait for writability here
			}
		}
	})
	if n < 0 {
		n = 0
	}
	if werr == syscall.EAGAIN {
		werr = nil
	}
	if err == nil {
		err = werr
	}
	return n, err
}

// writeFailed records a failed write and drops the connection; its reader frees the locks.
func (c *lockConn) writeFailed(err error) {
	s := c.s
	slow := pcIsTimeout(err)
	s.mu.Lock()
	s.stats.failedSends++
	if slow {
		s.stats.slowClients++
	}
	s.mu.Unlock()
	if slow {
		s.warnSlow.warn(s.log, "dropping a client whose socket stayed full", "remote", c.remote, "timeout", s.writeTimeout)
	}
	c.nc.Close() //nolint:errcheck // the reader sees the close and frees the locks
}

func pcIsTimeout(err error) bool {
	var te interface{ Timeout() bool }
	return errors.As(err, &te) && te.Timeout()
}

// serveConn is the reader of one connection: it frames lines, runs each command under s.mu and
// flushes the replies, until EOF (a half-close counts), an error or shutdown; then it frees
// the connection's locks. No read deadline: a client may hold a lock idle for as long as its
// work takes (keepalive detects dead peers).
func (s *lockServer) serveConn(c *lockConn) {
	defer c.nc.Close() //nolint:errcheck // nothing to do about a failed close of a finished conn
	f := newPCLineFramer(s.maxLine)
	var scratch []byte
	for {
		n, err := c.nc.Read(f.space())
		f.wrote(n)
		for {
			line, tooLong, ok := f.next()
			if !ok {
				break
			}
			scratch = s.handleLine(c, line, tooLong, scratch[:0])
			// A client pipelining large replies (STATS FULL) is made to wait for its socket
			// here, before its queue nears s.maxOutput, which is meant for slow readers only.
			if c.queued() > s.maxOutput/4 {
				c.flush(true)
			}
		}
		// Replies are written before the connection is dropped, so "RELEASE\n" followed by a
		// half-close still gets its RELEASED.
		c.flush(true)
		if err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				s.log.Debug("client read failed", "remote", c.remote, "err", err)
			}
			break
		}
	}
	s.beginOp(c.woken)
	s.disconnect(c, s.clock())
	c.woken = s.endOp()
	c.outMu.Lock()
	overflowed := c.overflowed
	c.outMu.Unlock()
	if overflowed {
		s.warnSlow.warn(s.log, "dropped a client that does not read its replies", "remote", c.remote, "max_output", s.maxOutput)
	}
}

// handleLine runs one request line for c. scratch is reused for building STATS replies.
func (s *lockServer) handleLine(c *lockConn, line []byte, tooLong bool, scratch []byte) []byte {
	var req pcRequest
	if !tooLong {
		req = parsePoolCounterLine(line)
	}
	s.beginOp(c.woken)
	defer func() { c.woken = s.endOp() }()
	now := s.clock()
	var reply string
	switch {
	case tooLong:
		s.stats.linesTooLong++
		reply = pcLineTooLong
	case req.op == pcOpAcqMe || req.op == pcOpAcqAny:
		reply = s.acquire(c, &req, now)
	case req.op == pcOpRelease:
		reply = s.release(c, now)
	case req.op == pcOpStats:
		scratch = s.appendStats(scratch, req.item, now)
		s.queue(c, string(scratch))
		return scratch
	default:
		reply = pcBadCommand
	}
	if reply != "" {
		s.queue(c, reply)
	}
	return scratch
}

// ---------------------------------------------------------------------------------------------
// Listening, accepting, shutdown

// listenPoolCounter opens the listening socket for "host:port" (address reuse, large backlog,
// TCP keepalive on accepted conns).
//
// Go sets SO_REUSEADDR on listening sockets and uses the kernel's somaxconn as the backlog (the
// kernel caps any larger value to it), against the reference's missing SO_REUSEADDR and
// backlog of 20; SO_REUSEADDR is set again explicitly so the intent does not rest on a default.
func listenPoolCounter(addr string) (net.Listener, error) {
	lc := net.ListenConfig{
		KeepAliveConfig: net.KeepAliveConfig{
			Enable:   true,
			Idle:     poolCounterKeepAliveIdle,
			Interval: poolCounterKeepAliveInterval,
			Count:    poolCounterKeepAliveCount,
		},
		Control: func(network, address string, rc syscall.RawConn) error {
			var serr error
			err := rc.Control(func(fd uintptr) {
				serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1)
			})
			if err != nil {
				return err
			}
			return serr
		},
	}
	ln, err := lc.Listen(context.Background(), "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("poolcounter listen %s: %w", addr, err)
	}
	return ln, nil
}

// Serve accepts until ctx is cancelled, then closes every connection and returns nil after all
// handlers finished. A failed accept is retried with back-off; an accept error that is not
// transient (the listener closed by someone else) ends Serve with that error, after the same
// cleanup.
func (s *lockServer) Serve(ctx context.Context, ln net.Listener) error {
	s.mu.Lock()
	if s.serveRan {
		s.mu.Unlock()
		return errors.New("poolcounter serve: already called")
	}
	s.serveRan = true
	s.mu.Unlock()

	timerCtx, stopTimer := context.WithCancel(context.Background())
	var timerDone sync.WaitGroup
	timerDone.Add(1)
	go func() {
		defer timerDone.Done()
		s.timeoutLoop(timerCtx)
	}()

	// On cancel: stop accepting and close every connection so blocked readers return.
	watchDone := make(chan struct{})
	stopWatch := context.AfterFunc(ctx, func() {
		defer close(watchDone)
		ln.Close() //nolint:errcheck // Accept reports the close; nothing else to do
		s.closeAll()
	})

	err := s.acceptLoop(ctx, ln)

	if !stopWatch() {
		<-watchDone // it ran: let it finish so no goroutine outlives Serve
	}
	ln.Close() //nolint:errcheck // may already be closed by the AfterFunc
	s.closeAll()
	s.handlers.Wait()
	stopTimer()
	timerDone.Wait()
	return err
}

func (s *lockServer) acceptLoop(ctx context.Context, ln net.Listener) error {
	var delay time.Duration
	failures := 0
	for {
		nc, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if errors.Is(err, net.ErrClosed) || !pcTransientAcceptError(err) {
				return fmt.Errorf("poolcounter accept: %w", err)
			}
			s.mu.Lock()
			s.stats.connectErrors++
			s.mu.Unlock()
			failures++
			if delay == 0 {
				delay = poolCounterAcceptBackoffMin
			} else {
				delay = min(2*delay, poolCounterAcceptBackoffMax)
			}
			s.warnAccept.warn(s.log, "accept failed; backing off", "err", err, "delay", delay, "failures", failures)
			t := time.NewTimer(delay)
			select {
			case <-ctx.Done():
				t.Stop()
				return nil
			case <-t.C:
			}
			continue
		}
		if failures > 0 {
			s.log.Info("accept recovered", "failures", failures)
			s.warnAccept.reset()
			delay, failures = 0, 0
		}
		c := &lockConn{s: s, nc: nc, remote: nc.RemoteAddr().String()}
		if sc, ok := nc.(syscall.Conn); ok {
			c.rc, _ = sc.SyscallConn() // on error rc stays nil: blocking writes only
		}
		for i := range c.slots {
			c.slots[i].conn = c
			c.slots[i].heapIdx = -1
		}
		s.mu.Lock()
		if s.closing {
			s.mu.Unlock()
			nc.Close() //nolint:errcheck // shutting down; the client sees the close
			continue
		}
		s.conns[c] = struct{}{}
		s.stats.connections++
		s.stats.connectionsTotal++
		s.handlers.Add(1)
		s.mu.Unlock()
		go func() {
			defer s.handlers.Done()
			s.serveConn(c)
		}()
	}
}

// pcTransientAcceptError reports accept failures worth retrying: descriptor or memory
// exhaustion and connections that died in the queue.
func pcTransientAcceptError(err error) bool {
	for _, e := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM,
		syscall.ECONNABORTED, syscall.ECONNRESET, syscall.EINTR, syscall.EAGAIN, syscall.EPROTO,
		syscall.EPERM, syscall.ETIMEDOUT} {
		if errors.Is(err, e) {
			return true
		}
	}
	return pcIsTimeout(err)
}

// closeAll closes every connection; their readers then free their locks and exit.
func (s *lockServer) closeAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closing = true
	for c := range s.conns {
		c.nc.Close() //nolint:errcheck // shutting down
	}
}

// timeoutLoop sends TIMEOUT replies when the earliest waiter deadline passes.
func (s *lockServer) timeoutLoop(ctx context.Context) {
	var scratch []*lockConn
	for {
		select {
		case <-ctx.Done():
			s.timer.Stop()
			return
		case <-s.timer.C:
			s.beginOp(scratch)
			s.expireWaiters(s.clock())
			scratch = s.endOp()
		}
	}
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

// ---------------------------------------------------------------------------------------------
// Log rate limiting

// pcLogLimiter emits a warning at most once per poolCounterLogEvery and says how many it held
// back, so an EMFILE storm or a flood of bad clients does not flood the log.
type pcLogLimiter struct {
	mu         sync.Mutex
	last       time.Time
	suppressed int
}

func (l *pcLogLimiter) warn(log *slog.Logger, msg string, args ...any) {
	l.mu.Lock()
	now := time.Now()
	if !l.last.IsZero() && now.Sub(l.last) < poolCounterLogEvery {
		l.suppressed++
		l.mu.Unlock()
		return
	}
	n := l.suppressed
	l.last, l.suppressed = now, 0
	l.mu.Unlock()
	if n > 0 {
		args = append(args, "suppressed", n)
	}
	log.Warn(msg, args...)
}

func (l *pcLogLimiter) reset() {
	l.mu.Lock()
	l.last, l.suppressed = time.Time{}, 0
	l.mu.Unlock()
}
