// operate.go: the dispatcher's side of the operator's actions (operate.sql, pepsi-queue(1)):
// running messages an operator cancelled, and paused stages.
//
// Cancelling a running message is a guarded write of operate.sql's queue_cancel; it does not
// touch the claim token, and it notifies workqueue_cancel with the message's id and claim. A
// cancelled message at the head of a worker's queue stops that worker (the rest of its queue
// goes back to pending, as after a timeout; the resets are guarded by the claim, so the
// cancelled row itself is left alone); one further back is left in the queue, and the stage's
// own outcome write, guarded by status = 'running', changes nothing when the worker reaches it.
// A paused stage (PAUSED = yes) is simply not claimed; the reload that sees a change of PAUSED
// alone applies it in place (reload.go), so no worker of any stage is retired.

package main

import (
	"strconv"
	"strings"
)

// cancelKey names one claim of one message.
type cancelKey struct{ id, claim int64 }

// onCancel handles a workqueue_cancel notification: "TABLE-OID ID:CLAIM ID:CLAIM ...".
// Notifications of other systems in the same database (another table oid) are ignored.
func (c *coordinator) onCancel(payload string) {
	f := strings.Fields(payload)
	if len(f) < 2 {
		return
	}
	if oid, err := strconv.ParseInt(f[0], 10, 64); err != nil || int32(uint32(oid)) != c.inst.key {
		return
	}
	want := make(map[cancelKey]bool, len(f)-1)
	for _, word := range f[1:] {
		idText, claimText, _ := strings.Cut(word, ":")
		id, err1 := strconv.ParseInt(idText, 10, 64)
		claim, err2 := strconv.ParseInt(claimText, 10, 64)
		if err1 != nil || err2 != nil {
			c.log.Warn("ignoring a malformed cancel notification", "word", clip(word, 80))
			continue
		}
		want[cancelKey{id, claim}] = true
	}
	for _, w := range c.workers {
		for i, m := range w.queue {
			if !want[cancelKey{m.id, m.claim}] {
				continue
			}
			m.cancelled = true
			switch {
			case i > 0:
				c.log.Info("cancelled message is in a worker's queue; its outcome will change nothing",
					"stage", w.stage, "pid", w.pid, "id", m.id, "position", i)
			case w.state == workerStopping:
				// Already ending (timeout, retirement, shutdown): its exit accounts the queue.
			default:
				c.log.Info("cancelled message at the head of its worker: stopping the worker; the rest of its queue goes back to pending",
					"stage", w.stage, "pid", w.pid, "id", m.id, "requeued", len(w.queue)-1)
				w.end(fateCancelled)
			}
		}
	}
}

// pauseOnly reports, when fresh differs from cur in PAUSED alone, the stages whose PAUSED
// changed; nil when nothing changed or anything else did.
func pauseOnly(fresh, cur map[string]*StageConfig) []string {
	if len(fresh) != len(cur) {
		return nil
	}
	var changed []string
	for name, s := range fresh {
		o, ok := cur[name]
		if !ok {
			return nil
		}
		t := *s
		t.Paused = o.Paused
		if !t.equal(o) {
			return nil
		}
		if s.Paused != o.Paused {
			changed = append(changed, name)
		}
	}
	return changed
}

// applyPauses installs fresh, which differs from the running stages in PAUSED only: each pool
// keeps its workers, generation and state, and takes the new configuration.
func (c *coordinator) applyPauses(fresh map[string]*StageConfig, changed []string) {
	cfg := *c.cfg
	cfg.Stages = fresh
	c.cfg = &cfg
	for name, p := range c.pools {
		p.cfg = fresh[name]
		// A pool whose workers run a stage that is now paused (or resumed) fused into their
		// own pass gets a new fuse list, and only its workers are retired to take it.
		if fuse, fusable := fuseList(fresh, name); fuse != p.fuse {
			p.fuse, p.fusable = fuse, fusable
			c.gen++ // a generation of its own: its old workers no longer match it
			p.gen = c.gen
			c.log.Info("a paused or resumed stage is fused into this stage's workers: retiring them", "stage", name)
			for _, w := range p.workers {
				c.retire(w)
			}
		}
	}
	for _, name := range changed {
		if fresh[name].Paused {
			c.log.Info("stage paused: no more claims for it; messages already in its workers' queues finish",
				"stage", name, "in_flight", c.inflight[name])
		} else {
			c.log.Info("stage resumed: claiming again", "stage", name)
		}
	}
	c.claimWanted = true
}

// logPaused says which stages start paused (at start-up, or after a full reload).
func (c *coordinator) logPaused(old map[string]*pool) {
	for name, p := range c.pools {
		o := old[name]
		switch {
		case p.cfg.Paused && o == nil:
			c.log.Info("stage is paused (PAUSED = yes): not claiming for it until pepsi-queue resume", "stage", name)
		case p.cfg.Paused && !o.cfg.Paused:
			c.log.Info("stage paused: no more claims for it", "stage", name)
		case !p.cfg.Paused && o != nil && o.cfg.Paused:
			c.log.Info("stage resumed: claiming again", "stage", name)
		}
	}
}
