// vanish.go: a server whose machine vanishes.
//
// A server that stops or crashes closes its sockets, and a session learns it at its next read.
// A server whose machine loses its power or its network says nothing: no FIN, no RST. Then a
// statement whose bytes the server never acknowledged waits for the kernel's retransmissions to
// give up (net.ipv4.tcp_retries2: about 15 minutes on Linux), one whose answer never comes
// waits for Go's default keepalive (15 s, then 9 probes 15 s apart: 2.5 minutes), and a new
// connection waits for its SYNs (net.ipv4.tcp_syn_retries: about 2 minutes), or to the end of
// its statement's budget, before lib/pq tries the DSN's next host. After a failover to a
// standby that is how long the dispatcher held on to the old primary, or for ever
// (TestFailoverPrimaryVanishes). The Dialer bounds each of the three by one duration, the one
// the lock session asks of the server (LOCK_KEEPALIVE), so that both ends of it give up on a
// vanished peer alike.

package pgsession

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/lib/pq"
)

// Keepalive is the probe schedule that gives up on a silent peer within d: the first probe
// after half of it, then one every tenth (at least 1 s), as many as fit in the rest. The lock
// session asks the server for the same (tcp_keepalives_*), and the Dialer sets it on pepsi's
// own sockets.
func Keepalive(d time.Duration) (idle, interval time.Duration, count int) {
	idle = max(time.Second, d/2)
	interval = max(time.Second, d/10)
	return idle, interval, max(1, int((d-idle)/interval))
}

// Dialer makes the TCP connections of pepsi's sessions give up on a vanished server within
// Vanish: keepalive probes on the Keepalive schedule and TCP_USER_TIMEOUT (data unacknowledged
// for that long ends the connection; Linux). A connect is given half of it per host unless the
// DSN sets connect_timeout (ConnectTimeout: lib/pq then bounds each host's connect by it), and
// where the DSN lists several hosts, one that did not answer a connect is passed over for
// Vanish (unanswered): with one host, there is no other to go to. Vanish 0 leaves the system's
// defaults. Unix sockets are left as they are: their peer cannot vanish.
type Dialer struct {
	Vanish         time.Duration
	ConnectTimeout time.Duration // the DSN's connect_timeout, 0 if it sets none
	PassOver       bool          // the DSN lists several hosts
}

// DialerOf is the Dialer of the sessions of a DSN parsed into cfg.
func DialerOf(cfg pq.Config, vanish time.Duration) Dialer {
	return Dialer{Vanish: vanish, ConnectTimeout: cfg.ConnectTimeout, PassOver: len(cfg.Multi) > 0}
}

// DialerFor is DialerOf the DSN dsn (with the defaults, when it does not parse: the connector it
// is for reports that).
func DialerFor(dsn string, vanish time.Duration) Dialer {
	cfg, err := pq.NewConfig(dsn)
	if err != nil {
		return Dialer{Vanish: vanish}
	}
	return DialerOf(cfg, vanish)
}

// Dial is lib/pq's Dialer.Dial.
func (d Dialer) Dial(network, address string) (net.Conn, error) {
	return d.DialContext(context.Background(), network, address)
}

// DialTimeout is lib/pq's Dialer.DialTimeout, for a DSN's connect_timeout.
func (d Dialer) DialTimeout(network, address string, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return d.DialContext(ctx, network, address)
}

// DialContext is lib/pq's DialerContext.DialContext. lib/pq passes the statement's context for
// every host of the DSN in turn, so a first host that swallowed the connect to the end of the
// statement's budget left none for the next: behind a router, where a vanished machine's SYNs
// are lost rather than refused, the dispatcher could then never reach the promoted standby
// listed second (TestFailoverPrimaryVanishes). Half of Vanish per host leaves the rest of a
// budget as long as Vanish (the statements' 10 s) to the next.
func (d Dialer) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	if d.Vanish <= 0 || network == "unix" {
		var nd net.Dialer
		return nd.DialContext(ctx, network, address)
	}
	if d.PassOver {
		if err := unanswered.check(network, address); err != nil {
			return nil, err
		}
	}
	bound := max(time.Second, d.Vanish/2)
	if dl, ok := ctx.Deadline(); d.ConnectTimeout <= 0 && (!ok || time.Until(dl) > bound) {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, bound)
		defer cancel()
	}
	idle, interval, count := Keepalive(d.Vanish)
	nd := net.Dialer{
		KeepAliveConfig: net.KeepAliveConfig{Enable: true, Idle: idle, Interval: interval, Count: count},
		Control: func(_, _ string, c syscall.RawConn) error {
			var err error
			if cerr := c.Control(func(fd uintptr) { err = setUserTimeout(fd, d.Vanish) }); cerr != nil {
				return cerr
			}
			return err
		},
	}
	start := time.Now()
	c, err := nd.DialContext(ctx, network, address)
	unanswered.note(address, err, time.Since(start), d.Vanish)
	return c, err
}

// errUnanswered is the error of a connect not tried: the host did not answer the last one.
var errUnanswered = errors.New("not tried: the host did not answer a connect a moment ago")

// unanswered remembers the hosts whose last connect went unanswered (no reply within the bound,
// no route to them) and passes them over for a while. lib/pq tries a DSN's hosts in order for
// every new session, and the dispatcher opens several after a failover (the re-lock's, the
// pool's, the LISTEN connection's, a standby's at its takeover): each paid the wait on the
// vanished first host again, 3 s on a LAN whose ARP cache expired, the whole bound behind a
// router (a standby's takeover to its first claim: 6 s here). A connect refused at once
// (ECONNREFUSED: the machine is up, its server down or starting) costs nothing and is not
// remembered; a host that answers again is tried again after the while, and at once once
// any connect to it succeeded.
var unanswered = unansweredHosts{until: map[string]time.Time{}}

type unansweredHosts struct {
	mu    sync.Mutex
	until map[string]time.Time
}

// check returns errUnanswered (as a dial's net.OpError) while address is passed over.
func (u *unansweredHosts) check(network, address string) error {
	u.mu.Lock()
	until, ok := u.until[address]
	u.mu.Unlock()
	if ok && time.Now().Before(until) {
		return &net.OpError{Op: "dial", Net: network, Err: fmt.Errorf("%s: %w", address, errUnanswered)}
	}
	return nil
}

// note records how a connect to address ended after took: passed over for d after one that
// went unanswered, forgotten after one that succeeded.
func (u *unansweredHosts) note(address string, err error, took, d time.Duration) {
	u.mu.Lock()
	defer u.mu.Unlock()
	switch {
	case err == nil:
		delete(u.until, address)
	case isUnanswered(err, took):
		u.until[address] = time.Now().Add(d)
	}
}

// isUnanswered: a connect that found no route, or that timed out after a second at least (a
// live host answers a SYN in milliseconds, and resends come a second apart): not one whose
// caller's deadline was all but spent when it began, nor one the caller cancelled.
func isUnanswered(err error, took time.Duration) bool {
	if errors.Is(err, syscall.EHOSTUNREACH) || errors.Is(err, syscall.ENETUNREACH) {
		return true
	}
	var ne net.Error
	timedOut := errors.Is(err, context.DeadlineExceeded) || errors.Is(err, syscall.ETIMEDOUT) ||
		errors.As(err, &ne) && ne.Timeout()
	return timedOut && took >= time.Second
}
