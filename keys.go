// keys.go: concurrency keys: how many messages of each (stage, key) sit in workers' queues.
//
// KEY_LIMIT = N bounds the messages of one stage with one concurrency_key that are in
// workers' queues at once, pipelined ones included. Only the coordinator knows that number
// exactly (a message is in a queue from its hand-out in assign to its reply or its worker's
// reaped exit), so it keeps the count here and passes it to every claim (claim.go), which
// takes at most N minus that many rows of the key. The count lives only in memory and needs
// no repair: a restart starts with empty queues (the workers of the previous run die with it,
// and its running rows are reset before the first claim), a crash or timeout releases a
// worker's messages only once its exit is reaped, and a reload changes N for the next claim
// while the messages already handed out stay counted until they leave their queues.
//
// The coordinator goroutine owns every field.

package main

import "time"

// stageKey is one concurrency key of one stage.
type stageKey struct{ stage, key string }

// keyLoad is what a claim needs to know about concurrency keys.
type keyLoad struct {
	limit map[string]int   // KEY_LIMIT per stage with one; set with each stage table
	busy  map[stageKey]int // messages with a key in workers' queues; no zero entries
	// unpark: rows may be parked in stages without a limit (at start, from the previous
	// run's configuration; after a reload that removed one), so the claim first runs
	// unparkSQL, until a run of it finds less than a chunk and leaves no parked row behind
	// (one another transaction holds: then not again before unparkAt).
	unpark   bool
	unparkAt time.Time
	refused  bool // the database refused the last unpark by itself: said, its end still to be said
}

// limitsOf takes the limits of a new stage table (at start and with every reload).
func (k *keyLoad) limitsOf(pools map[string]*pool) {
	if k.limit == nil {
		k.unpark = true // the first table: the previous run may have parked rows
		k.limit = map[string]int{}
	}
	for name := range k.limit {
		if p := pools[name]; p == nil || p.cfg.KeyLimit == 0 {
			k.unpark = true // a stage lost its limit: its parked rows must come back
		}
	}
	clear(k.limit)
	for name, p := range pools {
		if p.cfg.KeyLimit > 0 {
			k.limit[name] = p.cfg.KeyLimit
		}
	}
}

// take counts messages handed to a worker.
func (k *keyLoad) take(ms []*message) {
	for _, m := range ms {
		if m.keyed {
			if k.busy == nil {
				k.busy = map[stageKey]int{}
			}
			k.busy[stageKey{m.stage, m.key}]++
		}
	}
}

// release uncounts messages that left a worker's queue (a reply, or the worker's exit).
func (k *keyLoad) release(ms ...*message) {
	for _, m := range ms {
		if !m.keyed {
			continue
		}
		sk := stageKey{m.stage, m.key}
		switch n := k.busy[sk]; {
		case n > 1:
			k.busy[sk] = n - 1
		case n == 1:
			delete(k.busy, sk)
		default:
			panic("keys: released a keyed message that was not counted") // our own tables disagree
		}
	}
}
