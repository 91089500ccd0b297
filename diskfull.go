// diskfull.go: a full disk is not a message's fault.
//
// A full disk under the database refuses whatever needs a new page: a worker's handler, its
// batch's COMMIT, its outcome statement. Each message of such a batch is answered as a failure
// (stage/batch.go), and was charged as one, so a disk full for longer than MAX_ATTEMPTS retries
// failed messages that did nothing wrong (TestDatabaseDiskFull: 31 to 152 of 20,000 charged
// in six runs of eight, the disk full for a second or two). A failure whose reason says a disk was full now
// puts its message back to pending without an attempt, and holds its stage for heldRetryGap,
// after which a claim the full disk refused is tried again too (claim.go), so that its workers
// do not run its backlog against the full disk meanwhile.
//
// Save one kind: a message whose own query spilled its rows to temporary files until the disk
// was full. The server frees those files as the query fails, so the disk is not full for
// anyone else, and the next run of the message would fill it again: put back for ever, it
// would fill the database's disk once a second. Its failure names the temporary file
// ("could not write to file "base/pgsql_tmp/…"", or a block "of temporary file"), and is
// charged as its own (TestDiskFilledByItsMessage). The cost: a message whose query spills to
// temporary files while the disk is full for another reason is charged too, as every message
// was before. A message that fills the disk with rows of a table does not give the space back
// (a table's file keeps its size when the rows are rolled back), so the disk stays full for
// everyone, and nothing is charged until a DBA frees it.

package main

import "time"

// diskFullMarks are the texts by which a failure says that a disk was full: lib/pq's SQLSTATE
// 53100 (disk_full) as it prints it, psycopg's class name for it ("DiskFull: …", as the Python
// SDK names a handler's exception), the server's words for a relation it could not extend, and
// ENOSPC as the C library words it (the server's %m; Python's OSError) and as Go does (a
// stage's own files). A stage's own disk, full, is no more its message's fault than the
// database's.
var diskFullMarks = []string{
	"(53100)", "DiskFull: ", "could not extend file", "No space left on device", "no space left on device",
}

// ownTempFileMarks are the texts by which the server says that the write refused was one of
// the failing query's temporary files (buffile.c's path under pgsql_tmp, logtape.c's block).
var ownTempFileMarks = []string{"pgsql_tmp", "of temporary file"}

// isDiskFullText reports whether a worker's failure text says a disk was full, and not by the
// failing query's own temporary files.
func isDiskFullText(s string) bool {
	return containsAny(s, diskFullMarks) && !containsAny(s, ownTempFileMarks)
}

// diskFullFailure handles a failure line whose reason says a disk was full: the message goes
// back to pending without an attempt and the stage is held for a second (see the top of the
// file). It reports whether it took the failure.
func (c *coordinator) diskFullFailure(w *worker, m *message, text string, now time.Time) bool {
	if !isDiskFullText(text) {
		return false
	}
	p := c.pools[w.stage]
	if p == nil {
		return false // the stage is gone (a reload): nothing to hold, the failure is as it is
	}
	// One line per hold (the first message of it), rate-limited as a stage's failure lines
	// are: a disk full for an hour holds the stage every second.
	held := p.held(now)
	if !held {
		p.holdUntil = now.Add(heldRetryGap)
		c.timers.schedule(timerKey{timerHold, p.id}, p.holdUntil)
	}
	if unlogged, ok := p.diskFullLog.admit(now, held); ok {
		c.log.Error("a disk was full; the message goes back to pending, no attempt charged, and the stage is held",
			"stage", w.stage, "pid", w.pid, "id", m.id, "hold", heldRetryGap, "put_back_not_logged", unlogged,
			"reason", clip(text, 200))
	}
	c.resets = append(c.resets, m)
	c.ha.update(func(s *haStatus) { s.outageRetried++ })
	return true
}
