// poolcounter_table.go: the lock table of the lock service (doc/design/lockservice.md, The lock
// table): keys with their holders and FIFO waiter queues, each connection's stack of lock
// slots, the waiter deadline heap, and the operations on them (ACQ4ME/ACQ4ANY, RELEASE,
// timeout, disconnect).
//
// Owns: lockSlot, lockKey, lockWaiterHeap and the lockServer methods that change the table.
// Must not touch: sockets. Every function here runs with lockServer.mu held, does no I/O and
// answers other connections only through lockServer.send, which queues the reply.

package main

import (
	"container/heap"
	"time"
)

// poolCounterSlotsPerConn is MAX_LOCKS_PER_CLIENT of the reference: the 5th ACQ on a
// connection gets LOCK_HELD. Kept at 4 for parity (lockservice.md, Slots per connection).
const poolCounterSlotsPerConn = 4

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
// not stored: every request is judged by its own workers/maxqueue (lockservice.md, The lock table).
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

// acquire runs ACQ4ME/ACQ4ANY for c with the reference's decision order (lockservice.md, Acquire) and
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
		// ran the full release path here (bogus DONEs to ANY waiters, gauge leak).
		s.dropWaiter(sl)
	}
	s.stats.totalReleases++
	return pcReleased
}

// endHold ends a held slot. With broadcast (a RELEASE) every ACQ4ANY waiter of the key is
// answered DONE first; then the freed slot goes to the oldest ACQ4ME waiter, else the oldest
// ACQ4ANY waiter (only possible on disconnect), which gets LOCKED (lockservice.md, Release, Disconnect).
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
	// counted the wait too.
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
// broadcast: a freed slot goes to the next waiter as LOCKED (lockservice.md, Disconnect). Called with s.mu held.
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
