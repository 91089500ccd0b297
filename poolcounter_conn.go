// poolcounter_conn.go: one client connection of the lock service: its reader (frame, run each
// command under lockServer.mu, write the replies) and its bounded output queue, written so
// that a client that stops reading stalls nobody but itself.
//
// Owns: lockConn, serveConn and handleLine, and the write path (queue, flush, drain); why it is
// written this way: doc/design/lockservice.md, Concurrency and output.
// Must not touch: the lock table's internals (it calls acquire, release and disconnect).

package main

import (
	"errors"
	"io"
	"net"
	"sync"
	"syscall"
	"time"
)

const (
	// poolCounterMaxOutputDefault bounds the replies queued for one connection and not yet
	// accepted by its socket. A well-behaved client has at most a few short replies in flight
	// (one per request plus one LOCKED/DONE/TIMEOUT); only a client that pipelines requests
	// without reading can reach this, and it is then disconnected (its locks are freed).
	poolCounterMaxOutputDefault = 64 << 10

	// poolCounterWriteTimeoutDefault: a write that cannot complete this long means the client's
	// receive window stayed full; the connection is closed and its locks freed.
	poolCounterWriteTimeoutDefault = 30 * time.Second
)

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
