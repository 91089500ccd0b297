// timers.go: the coordinator's deadlines, in one heap behind one time.Timer.
//
// Every deadline the coordinator knows (heartbeat, retry due, idle reaping, MAX_RUNTIME
// watchdogs, stage hold, stats flush, database back-off) is an entry keyed by (kind, id).
// Scheduling a key again moves its deadline; cancelling a key that is not there is a no-op
// (Postfix event_request_timer). The heap is owned by the coordinator goroutine.

package main

import (
	"container/heap"
	"time"
)

type timerKind int

const (
	timerHeartbeat  timerKind = iota // POLL_INTERVAL claim
	timerRetry                       // earliest paused row is due
	timerIdle                        // id = worker: reap it if still idle
	timerWatchdog                    // id = worker: its head may have run past MAX_RUNTIME
	timerLinger                      // id = worker: stdin closed, kill it if still alive
	timerHold                        // id = pool: the stage's launch cool-down is over
	timerStats                       // flush statistics
	timerDB                          // retry the writes the database refused
	timerHeldWrites                  // send again the writes whose rows were held
	timerRelock                      // take the single-instance lock again
	timerShutdown                    // shutdown grace is over: kill what remains
	timerFanin                       // flush the fan-in inbox
	timerSweep                       // fan-in safety sweep
	timerRetention                   // delete old done rows
	timerMetrics                     // publish a /metrics snapshot
	timerSDWatchdog                  // tell systemd the loop is alive
	timerRefused                     // id = pool: claim the stage whose claim was refused again
	timerStrays                      // list the stages with pending rows (strays.go)
)

type timerKey struct {
	kind timerKind
	id   int
}

type timerEntry struct {
	key   timerKey
	at    time.Time
	index int
}

// timerHeap is a min-heap of deadlines with an index for moves and removals.
type timerHeap struct {
	items []*timerEntry
	byKey map[timerKey]*timerEntry
}

func newTimerHeap() *timerHeap { return &timerHeap{byKey: map[timerKey]*timerEntry{}} }

func (h *timerHeap) Len() int           { return len(h.items) }
func (h *timerHeap) Less(i, j int) bool { return h.items[i].at.Before(h.items[j].at) }
func (h *timerHeap) Swap(i, j int) {
	h.items[i], h.items[j] = h.items[j], h.items[i]
	h.items[i].index = i
	h.items[j].index = j
}
func (h *timerHeap) Push(x any) {
	e := x.(*timerEntry)
	e.index = len(h.items)
	h.items = append(h.items, e)
}
func (h *timerHeap) Pop() any {
	n := len(h.items) - 1
	e := h.items[n]
	h.items[n] = nil
	h.items = h.items[:n]
	e.index = -1
	return e
}

// schedule sets key's deadline to at, adding the key or moving it.
func (h *timerHeap) schedule(key timerKey, at time.Time) {
	if e, ok := h.byKey[key]; ok {
		e.at = at
		heap.Fix(h, e.index)
		return
	}
	e := &timerEntry{key: key, at: at}
	h.byKey[key] = e
	heap.Push(h, e)
}

// scheduleEarlier sets key's deadline to at unless it is already due sooner.
func (h *timerHeap) scheduleEarlier(key timerKey, at time.Time) {
	if e, ok := h.byKey[key]; ok && !at.Before(e.at) {
		return
	}
	h.schedule(key, at)
}

// cancel removes key; a key that is not scheduled is ignored.
func (h *timerHeap) cancel(key timerKey) {
	if e, ok := h.byKey[key]; ok {
		heap.Remove(h, e.index)
		delete(h.byKey, key)
	}
}

// next returns the earliest deadline, or false when the heap is empty.
func (h *timerHeap) next() (time.Time, bool) {
	if len(h.items) == 0 {
		return time.Time{}, false
	}
	return h.items[0].at, true
}

// popDue removes and returns the earliest entry if it is due at now.
func (h *timerHeap) popDue(now time.Time) (timerKey, bool) {
	if len(h.items) == 0 || h.items[0].at.After(now) {
		return timerKey{}, false
	}
	e := heap.Pop(h).(*timerEntry)
	delete(h.byKey, e.key)
	return e.key, true
}
