// outage.go: a database that refuses a statement, and a lock connection that is lost.
//
// A refused statement puts the queued work on a back-off (timerDB); a lost lock connection
// stops claims until the single-instance lock is taken again (timerRelock), or ends the run
// if another dispatcher took it meanwhile.

package main

import (
	"context"
	"errors"
	"time"
)

// dbTrouble handles a statement the database refused: if the lock connection is gone, the
// lock is gone with it; otherwise the queued work waits for a back-off and is tried again.
func (c *coordinator) dbTrouble(what string, err error) {
	// A read-only answer (25006: the server went into recovery, or a primary was set
	// read-only) is as good as a lost connection: the lock must not stay there (failover.go).
	if isOutage(err) || c.inst.conn == nil || c.pingLock() != nil {
		c.log.Error("database connection lost; claims stop until the lock is taken again", "op", what, "err", err,
			"server", c.inst.server.addr)
		if c.locked {
			c.outageAt = time.Now() // the workers started before this had sessions on that server
		}
		c.locked = false
		c.ha.update(func(s *haStatus) { s.role = "relocking" })
		c.claimer.close()
		c.timers.schedule(timerKey{kind: timerRelock}, time.Now().Add(c.relockBackoff.next()))
		return
	}
	d := c.dbBackoff.next()
	c.log.Warn("database refused a statement; will retry", "op", what, "err", err, "retry_in", d.Round(time.Millisecond))
	c.dbWaiting = true
	c.timers.schedule(timerKey{kind: timerDB}, time.Now().Add(d))
}

// refusedByDatabase reports whether err, a statement's on the lock connection, is the database
// refusing what the statement did while the connection still answers (not an outage, not the
// daemon stopping): a refusal that may be one row's or one stage's, which the caller redoes
// row by row or stage by stage (the claim, the unpark, the flip). retry.go's refusedAlive is
// the same test for the functions that take a connection and a context, not the coordinator.
func (c *coordinator) refusedByDatabase(err error) bool {
	return err != nil && !isOutage(err) && c.ctx.Err() == nil && c.inst.conn != nil && c.pingLock() == nil
}

// pingLock checks the lock connection: the context bounds a server that answers slowly (lib/pq
// cancels the statement); one whose machine vanished is bounded by the connection's Dialer
// (LOCK_KEEPALIVE), since lib/pq's read waits for the socket whatever the context says.
func (c *coordinator) pingLock() error {
	ctx, cancel := context.WithTimeout(c.ctx, 5*time.Second)
	defer cancel()
	return c.inst.conn.PingContext(ctx)
}

// relock tries to take the single-instance lock again after its connection was lost.
func (c *coordinator) relock() {
	ctx, cancel := c.budget()
	moved, err := c.inst.relock(ctx)
	cancel()
	switch {
	case err == nil:
		c.log.Info("single-instance lock taken again; claims resume", "server", c.inst.server.addr)
		c.locked = true
		c.relockBackoff.reset()
		c.dbBackoff.reset()
		c.dbWaiting = false
		c.claimWanted, c.retryWanted = true, true
		c.afterRelock(moved)
	case errors.Is(err, errLockLost):
		c.fatal = err
	default:
		d := c.relockBackoff.next()
		c.log.Warn("cannot take the single-instance lock again yet", "err", err, "retry_in", d.Round(time.Millisecond))
		c.timers.schedule(timerKey{kind: timerRelock}, time.Now().Add(d))
	}
}
