// poolcounter.go: the PoolCounter-compatible lock service's server (issue 5; how it works and
// why: doc/design/lockservice.md): the lockServer type that the other poolcounter_*.go files
// hang their methods on, the listening socket, the accept loop, the waiter timer's goroutine,
// shutdown, and the log rate limiter.
//
// The lock service is split by concept: poolcounter_protocol.go (request lines: framing and
// parsing, the reply words), poolcounter_table.go (keys, holders, waiter queues, timeouts),
// poolcounter_conn.go (one client connection: its reader and its bounded output), and
// poolcounter_stats.go (the counters, STATS replies and /metrics).
//
// Owns: the lockServer struct, listenPoolCounter, Serve and its goroutines.
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
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

const (
	// Accept back-off after a failed accept (EMFILE...), doubled per failure up to the max,
	// like net/http's Serve, instead of the reference's busy loop.
	poolCounterAcceptBackoffMin = 5 * time.Millisecond
	poolCounterAcceptBackoffMax = time.Second

	// poolCounterLogEvery rate-limits repeated warnings (accept failures, slow clients).
	poolCounterLogEvery = 10 * time.Second

	// poolCounterBacklogWant is the listen backlog below which Serve warns. MediaWiki and
	// Thumbor open one connection per lock, so a burst of connects can outrun accept for a
	// moment; a connect that finds the queue full waits for a SYN retransmit (1 s, then 3 s).
	// poolcounterd's backlog of 20 gave p99 1 s at 256 churning clients; 4096 (the kernel's
	// default somaxconn since Linux 5.4) gives no overflow at all (bench/poolcounter). Older
	// kernels default to 128.
	poolCounterBacklogWant = 1024
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
// Listening, accepting, shutdown

// listenPoolCounter opens the listening socket for "host:port" (address reuse, large backlog,
// and TCP keepalive on accepted conns with the spread, patient schedule of
// poolcounter_keepalive.go).
//
// Go sets SO_REUSEADDR on listening sockets and uses the kernel's somaxconn as the backlog (the
// kernel caps any larger value to it), against the reference's missing SO_REUSEADDR and
// backlog of 20; SO_REUSEADDR is set again explicitly so the intent does not rest on a default.
//
// The parts of the keepalive policy that every connection shares, SO_KEEPALIVE and
// TCP_KEEPCNT, are set here once: Linux copies a listener's socket options to each connection
// it accepts, so pcListener sets only the two drawn per connection (see pcListener.Accept).
func listenPoolCounter(addr string) (net.Listener, error) {
	ka := poolCounterKeepAlive()
	lc := net.ListenConfig{
		// No keepalive from Go's listener (its default is 15 s for every connection, in step):
		// pcListener gives each accepted connection its own schedule.
		KeepAlive: -1,
		Control: func(network, address string, rc syscall.RawConn) error {
			var serr error
			err := rc.Control(func(fd uintptr) {
				for _, o := range []struct{ level, opt, v int }{
					{syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1},
					{syscall.SOL_SOCKET, syscall.SO_KEEPALIVE, 1},
					{syscall.IPPROTO_TCP, syscall.TCP_KEEPCNT, ka.count},
				} {
					if serr = syscall.SetsockoptInt(int(fd), o.level, o.opt, o.v); serr != nil {
						serr = fmt.Errorf("setsockopt %d/%d: %w", o.level, o.opt, serr)
						return
					}
				}
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
	return &pcListener{TCPListener: ln.(*net.TCPListener), keepAlive: ka}, nil
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
	if b, err := os.ReadFile("/proc/sys/net/core/somaxconn"); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			s.checkBacklog(n)
		}
	}

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

// checkBacklog warns once when the kernel caps the listen backlog (Go asks for somaxconn) below
// poolCounterBacklogWant: the daemon cannot raise it, the operator can.
func (s *lockServer) checkBacklog(somaxconn int) {
	if somaxconn < poolCounterBacklogWant {
		s.log.Warn("net.core.somaxconn caps the lock service's listen backlog; connection bursts beyond it wait 1 s or more for a SYN retransmit",
			"somaxconn", somaxconn, "want", poolCounterBacklogWant, "fix", "sysctl -w net.core.somaxconn=4096")
	}
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
