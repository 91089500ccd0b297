// churn_epoll.go: the churn case's default load generator (-churn-client epoll): one goroutine,
// locked to its OS thread, drives all N clients as state machines over non-blocking sockets and
// one epoll set.
//
// Why it exists: the generator, not the server, was the bottleneck. With one goroutine per
// client over Go's net package (net.DialTimeout, bufio, SetDeadline per cycle; measure in
// main.go, still there as -churn-client net), the generator's CPU was 100 % busy at 256 clients
// (95-99 % in its own process time, the rest softirq) while pepsi's server used 78-84 % of its
// own, and the floor server (no lock table at all) reached the same rate, about 13,500 cycles
// a second, and the same tail: the churn figures measured the generator. Here a cycle costs
// only the system calls it needs (socket, connect, epoll_ctl, write, read, write, read, close,
// and its share of one epoll_wait) and no goroutine switch; with -churn-sources 16 it drives
// 18,000 cycles a second with its CPU 85 % busy, and the server's CPU is the one at 100 %.
//
// Owns: measureChurnEpoll and the per-client state machine. Must not touch: the servers. It
// returns the same result as measure does for churn (per-cycle latency, the connect / ACQ4ME /
// RELEASE parts, errors), so the report is the same whichever client ran.
//
// Ephemeral ports: the client closes first, so TIME_WAIT (60 s) stays on this side, one per
// cycle. connect may reuse a local port whose TIME_WAIT is older than 1 s, as
// net.ipv4.tcp_tw_reuse allows (its default, 2, allows it on loopback only, which is all we
// use), and it tries the even ports of ip_local_port_range first (Linux 4.6 and later; the odd
// ones are left to bind): from one source address to one server that is 14,116 ports a second
// with the default range of 32768-60999. This client's first ceiling, about 14,100 cycles a
// second for pepsi and the floor alike, was that: once every even port had been used within the
// last second (about 0.8 s into a measurement), each connect searched through ports still in
// a young TIME_WAIT (perf on the generator's CPU: __inet_check_established, __inet_hash_connect
// and the clock reads of the TIME_WAIT check, 25 % of it), and the slowest 1 % of the cycles
// (p99 100-160 ms, connect, ACQ4ME and RELEASE alike) all came after that moment.
// -churn-sources N (default 16) spreads the clients over the source addresses 127.0.0.1 to
// 127.0.0.N, each bound with IP_BIND_ADDRESS_NO_PORT so that connect still picks the port
// (shared by 4-tuple, not reserved by bind): each address has its own ports, for two more
// system calls per cycle. Production clients come from many hosts.
// Widening ip_local_port_range would do the same but is machine-wide; SO_LINGER 0 (a reset
// instead of TIME_WAIT) would change what the server sees.
//
// Linux only (epoll), like the rest of this bench (taskset, /proc).

package main

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"runtime"
	"strconv"
	"syscall"
	"time"
	"unsafe"
)

const (
	// churnCycleTimeout fails a cycle that has not finished this long after it started, as
	// the net client's SetDeadline does: a server that stops answering ends the measurement
	// with an error instead of hanging it.
	churnCycleTimeout = 30 * time.Second

	// ipBindAddressNoPort is IP_BIND_ADDRESS_NO_PORT (linux/in.h; Linux 4.2), missing from
	// package syscall.
	ipBindAddressNoPort = 24

	// epollET is EPOLLET as a uint32 (package syscall spells it as a negative int).
	epollET = 1 << 31
)

// churnPhase is where a client is in its cycle.
type churnPhase uint8

const (
	churnIdle       churnPhase = iota // no cycle in flight
	churnConnecting                   // connect returned EINPROGRESS; waiting for writability
	churnLocking                      // ACQ4ME (being) sent; waiting for LOCKED
	churnReleasing                    // RELEASE (being) sent; waiting for RELEASED
)

// step names a phase in error messages.
func (p churnPhase) step() string {
	switch p {
	case churnConnecting:
		return "connect"
	case churnLocking:
		return "ACQ4ME"
	case churnReleasing:
		return "RELEASE"
	}
	return "idle"
}

// churnClient is one client of the epoll generator.
type churnClient struct {
	fd         int
	phase      churnPhase
	src        *syscall.RawSockaddrInet4 // source address (port 0: chosen by connect); nil: unbound
	acq        []byte                    // its ACQ4ME line
	out        []byte                    // request being written
	sent       int                       // bytes of out written so far
	in         [16]byte                  // reply being read; both replies fit
	got        int                       // bytes of in read so far
	t0, t1, t2 time.Time                 // cycle start, connected, LOCKED received
}

// churnGen is the state of one epoll measurement; only the goroutine running
// measureChurnEpoll touches it.
type churnGen struct {
	epfd     int
	dst      syscall.RawSockaddrInet4
	release  []byte // "RELEASE\n"
	clients  []churnClient
	inflight int       // clients with a cycle in flight
	start    time.Time // of the measurement
	deadline time.Time // no cycle starts after it
	budget   int64     // cycles left to start
	stopping bool      // an error happened: start no more cycles
	errors   int64
	firstErr error
	r        result
}

// measureChurnEpoll runs the churn case with n clients until the duration or the cycle budget
// is used up, then waits for the cycles in flight. sources > 1 spreads the clients over that
// many loopback source addresses.
func measureChurnEpoll(addr string, n int, d time.Duration, maxCycles int64, sources int) (result, error) {
	// One thread does all the work: no goroutine switches, and no other thread's wake-ups on
	// the generator's one CPU.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()

	dst, err := sockaddr4(addr)
	if err != nil {
		return result{}, fmt.Errorf("churn epoll: %w", err)
	}
	epfd, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		return result{}, fmt.Errorf("churn epoll: epoll_create1: %w", err)
	}
	defer syscall.Close(epfd) //nolint:errcheck // nothing registered is left; the close cannot matter
	g := &churnGen{epfd: epfd, dst: *rawSockaddr(dst.Addr, dst.Port), release: []byte("RELEASE\n"), clients: make([]churnClient, n), budget: maxCycles}
	// Room for a fast 2 s measurement without regrowing; more is appended.
	capHint := int(min(maxCycles, 1<<16))
	g.r.lat = make([]time.Duration, 0, capHint)
	g.r.connect = make([]time.Duration, 0, capHint)
	g.r.acq = make([]time.Duration, 0, capHint)
	g.r.release = make([]time.Duration, 0, capHint)
	g.r.ends = make([]time.Duration, 0, capHint)
	for i := range g.clients {
		c := &g.clients[i]
		c.fd = -1
		c.acq = []byte("ACQ4ME bench-churn-" + strconv.Itoa(i) + " 1 10 10\n")
		if sources > 1 {
			c.src = rawSockaddr([4]byte{127, 0, 0, byte(1 + i%sources)}, 0)
		}
	}
	events := make([]syscall.EpollEvent, n)

	before, cpus0 := readNetCounters(), readCPUTimes()
	start := time.Now()
	g.start, g.deadline = start, start.Add(d)
	for i := range g.clients {
		g.begin(i)
	}
	lastScan := start
	for g.inflight > 0 {
		// Poll first without blocking: under load something is always ready, and a raw call
		// that cannot block keeps the runtime out of it (see Raw system calls). The blocking
		// wait's timeout only serves the cycle-timeout scan below.
		k, err := rawEpollPoll(epfd, events)
		if err == nil && k == 0 {
			k, err = syscall.EpollWait(epfd, events, 1000)
		}
		if err != nil && err != syscall.EINTR {
			g.abort()
			return result{}, fmt.Errorf("churn epoll: epoll_wait: %w", err)
		}
		for _, ev := range events[:max(k, 0)] {
			g.event(int(ev.Fd), ev.Events)
		}
		if now := time.Now(); now.Sub(lastScan) >= time.Second {
			lastScan = now
			g.expire(now)
		}
	}
	r := g.r
	r.elapsed, r.errors, r.net, r.cpus = time.Since(start), g.errors, readNetCounters().sub(before), subCPUTimes(readCPUTimes(), cpus0)
	r.sortAll()
	if g.firstErr != nil && r.cycles == 0 {
		return r, g.firstErr
	}
	if g.firstErr != nil {
		fmt.Fprintf(os.Stderr, "%s churn %d (epoll): %d errors, first: %v\n", addr, n, r.errors, g.firstErr)
	}
	return r, nil
}

// sockaddr4 parses an IPv4 "host:port".
func sockaddr4(addr string) (syscall.SockaddrInet4, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return syscall.SockaddrInet4{}, err
	}
	ip := net.ParseIP(host).To4()
	p, err := strconv.Atoi(port)
	if ip == nil || err != nil {
		return syscall.SockaddrInet4{}, fmt.Errorf("%q is not an IPv4 host:port", addr)
	}
	sa := syscall.SockaddrInet4{Port: p}
	copy(sa.Addr[:], ip)
	return sa, nil
}

// begin starts client i's next cycle, unless the measurement is over: socket, bind to its
// source address, connect, register with epoll.
func (g *churnGen) begin(i int) {
	now := time.Now()
	if g.stopping || g.budget <= 0 || !now.Before(g.deadline) {
		return
	}
	g.budget--
	c := &g.clients[i]
	c.t0, c.phase, c.got = now, churnConnecting, 0
	g.inflight++
	fd, err := rawSocket()
	if err != nil {
		g.fail(i, fmt.Errorf("socket: %w", err))
		return
	}
	c.fd = fd
	if c.src != nil {
		if err := rawSetsockoptInt(fd, syscall.IPPROTO_IP, ipBindAddressNoPort, 1); err != nil {
			g.fail(i, fmt.Errorf("setsockopt IP_BIND_ADDRESS_NO_PORT: %w", err))
			return
		}
		if err := rawBind(fd, c.src); err != nil {
			g.fail(i, fmt.Errorf("bind %v: %w", c.src.Addr, err))
			return
		}
	}
	err = rawConnect(fd, &g.dst)
	if err != nil && err != syscall.EINPROGRESS {
		g.fail(i, fmt.Errorf("connect: %w", err)) // EADDRNOTAVAIL: ephemeral ports used up
		return
	}
	// Edge-triggered, both directions, registered once per socket: no epoll_ctl MOD between
	// the phases; a phase ignores the edges it has no use for (a read that finds EAGAIN).
	ev := syscall.EpollEvent{Events: syscall.EPOLLIN | syscall.EPOLLOUT | syscall.EPOLLRDHUP | epollET, Fd: int32(i)}
	if err := rawEpollAdd(g.epfd, fd, &ev); err != nil {
		g.fail(i, fmt.Errorf("epoll_ctl add: %w", err))
		return
	}
	if err == nil { // connected at once
		g.connected(i)
	}
}

// event advances client i on an epoll event.
func (g *churnGen) event(i int, events uint32) {
	c := &g.clients[i]
	switch c.phase {
	case churnConnecting:
		if events&(syscall.EPOLLOUT|syscall.EPOLLERR|syscall.EPOLLHUP) == 0 {
			return
		}
		// A failed connect is reported as EPOLLERR (tcp_poll sets it whenever sk_err is
		// set), so SO_ERROR is read only then, to name the error: one system call per cycle
		// saved, out of about nine.
		if events&(syscall.EPOLLERR|syscall.EPOLLHUP) != 0 {
			soerr, err := syscall.GetsockoptInt(c.fd, syscall.SOL_SOCKET, syscall.SO_ERROR)
			if err != nil {
				g.fail(i, fmt.Errorf("getsockopt SO_ERROR: %w", err))
				return
			}
			if soerr == 0 {
				soerr = int(syscall.ECONNRESET) // hung up without an error: no connection
			}
			g.fail(i, syscall.Errno(soerr))
			return
		}
		g.connected(i)
	case churnLocking, churnReleasing:
		g.progress(i)
	}
}

// connected records the end of the connect and sends ACQ4ME.
func (g *churnGen) connected(i int) {
	c := &g.clients[i]
	c.t1 = time.Now()
	c.phase, c.out, c.sent = churnLocking, c.acq, 0
	g.progress(i)
}

// progress writes what is left of the request, then reads the reply; on a complete reply it
// moves to the next phase. It returns when the socket has nothing more to give (EAGAIN): the
// next edge brings the client back.
func (g *churnGen) progress(i int) {
	c := &g.clients[i]
	wrote := false
	for c.sent < len(c.out) {
		m, err := rawWrite(c.fd, c.out[c.sent:])
		if err == syscall.EINTR {
			continue
		}
		if err == syscall.EAGAIN {
			return // the socket is full; EPOLLOUT brings us back
		}
		if err != nil {
			g.fail(i, fmt.Errorf("write: %w", err))
			return
		}
		c.sent += m
		wrote = true
	}
	if wrote {
		// The reply cannot be here yet: the server has to run first. Its arrival is an edge
		// (the socket was registered before the request was sent); a read now would only
		// find EAGAIN, one wasted system call per request.
		return
	}
	want := "LOCKED\n"
	if c.phase == churnReleasing {
		want = "RELEASED\n"
	}
	for {
		m, err := rawRead(c.fd, c.in[c.got:])
		if err == syscall.EINTR {
			continue
		}
		if err == syscall.EAGAIN {
			return
		}
		if err != nil {
			g.fail(i, fmt.Errorf("read: %w", err))
			return
		}
		if m == 0 {
			g.fail(i, fmt.Errorf("read: connection closed by the server after %q, want %q", c.in[:c.got], want))
			return
		}
		c.got += m
		nl := bytes.IndexByte(c.in[:c.got], '\n')
		if nl < 0 && c.got < len(c.in) {
			continue // partial reply
		}
		if string(c.in[:c.got]) != want {
			g.fail(i, fmt.Errorf("got %q, want %q", c.in[:c.got], want))
			return
		}
		c.got = 0
		break
	}
	now := time.Now()
	if c.phase == churnLocking {
		c.t2 = now
		c.phase, c.out, c.sent = churnReleasing, g.release, 0
		g.progress(i)
		return
	}
	g.end(i)
	g.r.lat = append(g.r.lat, now.Sub(c.t0))
	g.r.connect = append(g.r.connect, c.t1.Sub(c.t0))
	g.r.acq = append(g.r.acq, c.t2.Sub(c.t1))
	g.r.release = append(g.r.release, now.Sub(c.t2))
	g.r.ends = append(g.r.ends, now.Sub(g.start))
	g.begin(i)
}

// end closes client i's socket (which also takes it out of the epoll set).
func (g *churnGen) end(i int) {
	c := &g.clients[i]
	if c.fd >= 0 {
		rawClose(c.fd) //nolint:errcheck // close of a socket we are done with: nothing to do on error
	}
	c.fd, c.phase, c.got = -1, churnIdle, 0
	g.inflight--
}

// fail ends client i's cycle with an error naming its step and starts no more cycles; the
// cycles in flight finish, as the net client's do.
func (g *churnGen) fail(i int, err error) {
	c := &g.clients[i]
	g.errors++
	if g.firstErr == nil {
		g.firstErr = fmt.Errorf("churn client %d, %s: %w", i, c.phase.step(), err)
	}
	g.stopping = true
	g.end(i)
}

// expire fails the cycles that have run longer than churnCycleTimeout.
func (g *churnGen) expire(now time.Time) {
	for i := range g.clients {
		if c := &g.clients[i]; c.phase != churnIdle && now.Sub(c.t0) > churnCycleTimeout {
			g.fail(i, fmt.Errorf("no progress for %v", churnCycleTimeout))
		}
	}
}

// abort closes every socket in flight.
func (g *churnGen) abort() {
	for i := range g.clients {
		if g.clients[i].phase != churnIdle {
			g.end(i)
		}
	}
}

// ---------------------------------------------------------------------------------------------
// Raw system calls
//
// Every call below returns at once (the sockets are non-blocking), so it goes through
// RawSyscall, which does not tell the Go runtime that the thread entered the kernel. Through
// package syscall's wrappers (Syscall: entersyscall/exitsyscall), the runtime's monitor thread
// saw the generator's P in a system call on nearly every wake-up, took it away and handed it
// back: about 4,400 involuntary context switches a second on the generator's one CPU, each
// one a switch to another thread on that CPU, whatever the load. Only the blocking
// epoll_wait, made when a poll found nothing, goes through package syscall.

// rawErr is nil for errno 0, so that err == nil and err == syscall.EAGAIN work as with package
// syscall's wrappers.
func rawErr(e syscall.Errno) error {
	if e == 0 {
		return nil
	}
	return e
}

// rawSockaddr is an IPv4 address and port in the kernel's layout (port in network order).
func rawSockaddr(addr [4]byte, port int) *syscall.RawSockaddrInet4 {
	sa := &syscall.RawSockaddrInet4{Family: syscall.AF_INET, Addr: addr}
	p := (*[2]byte)(unsafe.Pointer(&sa.Port))
	p[0], p[1] = byte(port>>8), byte(port)
	return sa
}

func rawSocket() (int, error) {
	fd, _, e := syscall.RawSyscall(syscall.SYS_SOCKET, syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC, 0)
	return int(fd), rawErr(e)
}

func rawConnect(fd int, sa *syscall.RawSockaddrInet4) error {
	_, _, e := syscall.RawSyscall(syscall.SYS_CONNECT, uintptr(fd), uintptr(unsafe.Pointer(sa)), syscall.SizeofSockaddrInet4)
	return rawErr(e)
}

func rawBind(fd int, sa *syscall.RawSockaddrInet4) error {
	_, _, e := syscall.RawSyscall(syscall.SYS_BIND, uintptr(fd), uintptr(unsafe.Pointer(sa)), syscall.SizeofSockaddrInet4)
	return rawErr(e)
}

func rawSetsockoptInt(fd, level, opt, v int) error {
	v32 := int32(v)
	_, _, e := syscall.RawSyscall6(syscall.SYS_SETSOCKOPT, uintptr(fd), uintptr(level), uintptr(opt), uintptr(unsafe.Pointer(&v32)), 4, 0)
	return rawErr(e)
}

func rawWrite(fd int, b []byte) (int, error) {
	n, _, e := syscall.RawSyscall(syscall.SYS_WRITE, uintptr(fd), uintptr(unsafe.Pointer(unsafe.SliceData(b))), uintptr(len(b)))
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}

func rawRead(fd int, b []byte) (int, error) {
	n, _, e := syscall.RawSyscall(syscall.SYS_READ, uintptr(fd), uintptr(unsafe.Pointer(unsafe.SliceData(b))), uintptr(len(b)))
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}

func rawClose(fd int) error {
	_, _, e := syscall.RawSyscall(syscall.SYS_CLOSE, uintptr(fd), 0, 0)
	return rawErr(e)
}

func rawEpollAdd(epfd, fd int, ev *syscall.EpollEvent) error {
	_, _, e := syscall.RawSyscall6(syscall.SYS_EPOLL_CTL, uintptr(epfd), syscall.EPOLL_CTL_ADD, uintptr(fd), uintptr(unsafe.Pointer(ev)), 0, 0)
	return rawErr(e)
}

// rawEpollPoll returns the ready events without waiting (epoll_pwait, timeout 0, no mask).
func rawEpollPoll(epfd int, events []syscall.EpollEvent) (int, error) {
	n, _, e := syscall.RawSyscall6(syscall.SYS_EPOLL_PWAIT, uintptr(epfd), uintptr(unsafe.Pointer(unsafe.SliceData(events))), uintptr(len(events)), 0, 0, 0)
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}
