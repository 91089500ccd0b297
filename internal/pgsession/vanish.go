// vanish.go: a server whose machine vanishes.
//
// A server that stops or crashes closes its sockets, and a session learns it at its next read.
// A server whose machine loses its power or its network says nothing: no FIN, no RST. Then a
// statement whose bytes the server never acknowledged waits for the kernel's retransmissions to
// give up (net.ipv4.tcp_retries2: about 15 minutes on Linux), one whose answer never comes
// waits for Go's default keepalive (15 s, then 9 probes 15 s apart: 2.5 minutes), and a new
// connection waits for its SYNs (net.ipv4.tcp_syn_retries: about 2 minutes) before lib/pq tries
// the DSN's next host. After a failover to a standby that is how long the dispatcher held on
// to the old primary (TestFailoverPrimaryVanishes). The Dialer bounds each of the three by one
// duration, the one the lock session asks of the server (LOCK_KEEPALIVE), so that both ends of
// it give up on a vanished peer alike.

package pgsession

import (
	"context"
	"net"
	"syscall"
	"time"
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
// Vanish: keepalive probes on the Keepalive schedule, TCP_USER_TIMEOUT (data unacknowledged
// for that long ends the connection; Linux), and at most that long for a connection to be
// accepted unless the DSN's connect_timeout says otherwise. Vanish 0 leaves the system's
// defaults. Unix sockets are left as they are: their peer cannot vanish.
type Dialer struct{ Vanish time.Duration }

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

// DialContext is lib/pq's DialerContext.DialContext: a deadline of ctx (connect_timeout, a
// statement's budget) stands; without one, Vanish bounds the connect.
func (d Dialer) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	if d.Vanish <= 0 || network == "unix" {
		var nd net.Dialer
		return nd.DialContext(ctx, network, address)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d.Vanish)
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
	return nd.DialContext(ctx, network, address)
}
