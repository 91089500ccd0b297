// poolcounter_keepalive.go: how the lock service tells a dead holder from a silent one (issue
// 17, D1): the TCP keepalive policy of accepted connections and the listener that applies it.
//
// Owns: pcKeepAlive (a policy), poolCounterKeepAlive (the one the daemon uses) and
// pcListener, which gives every accepted connection its own, jittered, probe schedule (the
// parts every connection shares are set on the listening socket by listenPoolCounter).
// Must not touch: the lock table. The kernel aborts a connection whose probes go unanswered;
// serveConn then sees a read error and frees the locks like any other disconnect.
//
// What a holder is owed. A PoolCounter client holds its connection silent for the whole of its
// work (MediaWiki sends nothing between ACQ4ME and RELEASE while it parses), and pepsi-
// dispatch(1) promises that holders that stay connected never time out. Keepalive is the only
// way to free the locks of a holder whose host died without a reset (poolcounterd has none:
// such a key stays locked until the server restarts), but it must never take a lock from a
// holder that is alive: that breaks mutual exclusion, the one thing a lock service is for.
//
// What went wrong (doc/design/lockservice.md, "Keepalive"): every connection probed after the
// same 15 s and gave up after 4 probes 5 s apart. The kernel times a connection's probes from
// the last segment it received and rounds timers to its wheel's ticks, so holders that locked
// together probed together, in bursts of thousands; on loopback a burst overflows the per-CPU
// input backlog (net.core.netdev_max_backlog, 1000), the lost probes were retried 5 s later in
// the same burst, and after 20 s of that live holders were aborted and their locks handed to
// the next waiter. A real network blip of 20 s did the same. TestPoolCounterKeepAliveSoak
// (make soak-locks) shows it: 18,000 holders, 4,598 keys granted twice, TCPAbortOnTimeout
// +4,598, 41,236 packets dropped; with this policy 0, 0 and 0.
//
// The decision: keep keepalive, spread the probes and make them far more patient.
//   - Spread: each connection draws its idle time from [Idle, Idle+IdleJitter) and its probe
//     interval from [Interval, Interval+IntervalJitter), in whole seconds, so connections that
//     locked in one burst probe over a whole minute (18,000 of them: about 300 probes in any
//     one second, where the backlog holds 1000 per CPU), and a retried probe lands in a
//     different second from the one that was lost.
//   - Patient: a connection is aborted only after Count probes in a row go unanswered, at
//     least Count*Interval = 4 minutes of silence from the peer's kernel. A holder's kernel
//     answers probes however busy or hung its program is, so only a dead host or a network cut
//     off for minutes loses its locks; a burst of lost probes or a blip of seconds cannot.
// The price: a dead holder's locks are freed after 5 to 8 minutes instead of 35 s. That is
// still eventually, where poolcounterd never frees them, and waiters are not stuck meanwhile:
// they time out on their own deadline. Keepalive off for holders was the other choice, but it
// gives the reference's defect back: one dead app server would lock its keys until a restart.
// A holder cut off from the lock service for more than 4 minutes cannot be told from a dead
// one by any server; we treat it as dead.

package main

import (
	"math/rand/v2"
	"net"
	"syscall"
	"time"
)

// pcKeepAlive is a keepalive policy: the kernel probes a connection after idle, then every
// interval, and aborts it after count unanswered probes. The kernel counts in whole seconds.
type pcKeepAlive struct {
	idle, idleJitter         time.Duration
	interval, intervalJitter time.Duration
	count                    int
}

// The daemon's policy (see the file comment for why these numbers): first probe 60-120 s after
// the last segment received, then every 20-30 s, abort after 12 in a row unanswered (4-6
// minutes): a dead host's locks are freed 5-8 minutes after it fell silent.
const (
	poolCounterKeepAliveIdle           = 60 * time.Second
	poolCounterKeepAliveIdleJitter     = 60 * time.Second
	poolCounterKeepAliveInterval       = 20 * time.Second
	poolCounterKeepAliveIntervalJitter = 10 * time.Second
	poolCounterKeepAliveCount          = 12
)

func poolCounterKeepAlive() pcKeepAlive {
	return pcKeepAlive{
		idle: poolCounterKeepAliveIdle, idleJitter: poolCounterKeepAliveIdleJitter,
		interval: poolCounterKeepAliveInterval, intervalJitter: poolCounterKeepAliveIntervalJitter,
		count: poolCounterKeepAliveCount,
	}
}

// next draws one connection's schedule.
func (p pcKeepAlive) next() net.KeepAliveConfig {
	draw := func(base, jitter time.Duration) time.Duration {
		d := base
		if s := int64(jitter / time.Second); s > 0 {
			d += time.Duration(rand.Int64N(s)) * time.Second
		}
		return d
	}
	return net.KeepAliveConfig{
		Enable:   true,
		Idle:     draw(p.idle, p.idleJitter),
		Interval: draw(p.interval, p.intervalJitter),
		Count:    p.count,
	}
}

// patience is the shortest silence after which a connection can be aborted once probing has
// begun: count probes at the shortest interval.
func (p pcKeepAlive) patience() time.Duration { return time.Duration(p.count) * p.interval }

// pcListener is the lock service's listening socket: it gives every accepted connection its
// own draw of the keepalive policy. It must be made by listenPoolCounter, which sets the parts
// every connection shares (SO_KEEPALIVE, TCP_KEEPCNT) on the listening socket.
type pcListener struct {
	*net.TCPListener
	keepAlive pcKeepAlive
}

// Accept sets the connection's drawn idle time and interval, two system calls. It used
// SetKeepAliveConfig, which also sets SO_KEEPALIVE and TCP_KEEPCNT on every connection: four
// setsockopt calls, 10 % of the server's CPU under churn (bench/poolcounter, 256 clients, one
// connection per lock, perf on this VM, where every system call is expensive). The two shared
// options are inherited from the listener instead (Linux copies a listener's options to the
// connections it accepts); TestPoolCounterKeepAlivePolicy reads all four back from accepted
// connections.
func (l *pcListener) Accept() (net.Conn, error) {
	c, err := l.AcceptTCP()
	if err != nil {
		return nil, err
	}
	// A failure leaves the connection with the listener's schedule (first probe after the
	// kernel's tcp_keepalive_time) or none: it can only fail for a socket already dead,
	// whose reader sees that at once.
	ka := l.keepAlive.next()
	if rc, err := c.SyscallConn(); err == nil {
		rc.Control(func(fd uintptr) { //nolint:errcheck // see above
			if syscall.SetsockoptInt(int(fd), syscall.IPPROTO_TCP, syscall.TCP_KEEPIDLE, int(ka.Idle/time.Second)) == nil {
				syscall.SetsockoptInt(int(fd), syscall.IPPROTO_TCP, syscall.TCP_KEEPINTVL, int(ka.Interval/time.Second)) //nolint:errcheck // see above
			}
		})
	}
	return c, nil
}
