// failover.go: surviving a failover of the database: where the lock may be taken, how the
// lock session notices a vanished peer, which errors are the outage's and not a message's,
// and what operators see (the server, the role, the reconciles).
//
// It owns no coordinator state. takeLock is the one place that decides whether a session may
// hold the single-instance lock: never on a server in recovery or a read-only session (an
// advisory lock on a hot standby excludes nobody on the real primary). isOutage classifies
// failures so that an outage of the database is not charged to the messages it interrupted.
// The reconcile after a re-lock is reconcile.go's; waiting for the lock as a standby is
// standby.go's.

package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"pepsi-dispatch/internal/pgsession"
)

// lockKeepaliveDefault bounds how long the server keeps the lock session of a holder whose
// machine vanished (no FIN, no RST): the session's tcp_keepalives_* and tcp_user_timeout are
// set from it (lockKeepalive). Shorter takes over sooner but ends the session of a holder
// behind a network that stalls for that long; 10 s is the takeover an operator can wait for
// and longer than the usual TCP retransmission stalls of a LAN.
const lockKeepaliveDefault = pgsession.DefaultVanish

// listenerMaxReconnect caps the LISTEN connection's reconnect back-off: notifications are back
// within this of the new primary accepting connections (lib/pq retries at this period while
// every host refuses; each attempt on a refusing host costs one round trip).
const listenerMaxReconnect = 500 * time.Millisecond

// errReadOnly means the session is on a server in recovery or is read-only: the lock is not
// taken there, and the dispatcher waits for a primary.
var errReadOnly = errors.New("server is read-only (in recovery or transaction_read_only)")

// lockSQL takes the single-instance lock only on a session that can write: the test and the
// lock are one statement, so there is no window between them (a primary does not become a
// standby under a live session: that takes a restart, which ends the session and the lock).
// It also names the server (dbServer): its address, or on a Unix socket the socket's
// directory, which pg_settings shows to a superuser or a member of pg_read_all_settings alone
// (current_setting() refused every other role, so that the dispatcher of an ordinary role on a
// local socket could not start: TestOrdinaryRole), and when its postmaster started.
// $1, $2 = the lock key; $3: wait for the lock (a standby dispatcher) instead of trying once.
const lockSQL = `
SELECT ro, CASE WHEN ro THEN NULL WHEN $3 THEN pg_advisory_lock($1, $2) IS NOT NULL
                ELSE pg_try_advisory_lock($1, $2) END, server, pg_postmaster_start_time()
  FROM (SELECT pg_is_in_recovery() OR current_setting('transaction_read_only')::bool AS ro,
               coalesce(host(inet_server_addr()),
                        (SELECT setting FROM pg_settings WHERE name = 'unix_socket_directories'),
                        'local socket') || ':' || current_setting('port') AS server) s`

// dbServer is the server a lock session is on: its address, for the log and /metrics, and
// when its postmaster started, which tells a promoted standby or a restarted server behind
// the same address (a virtual IP, one DNS name) from the one a lost session was on.
type dbServer struct {
	addr    string
	started time.Time
}

// same reports whether s and o are one server in one run of it: sessions opened on the one
// can still be open on the other.
func (s dbServer) same(o dbServer) bool { return s.addr == o.addr && s.started.Equal(o.started) }

// takeLock takes the lock on conn, or reports errReadOnly; wait blocks until the holder's
// session ends (a standby). server is the server the session is on.
func takeLock(ctx context.Context, conn *sql.Conn, key int32, wait bool) (got bool, server dbServer, err error) {
	var ro bool
	var ok sql.NullBool
	if err := conn.QueryRowContext(ctx, lockSQL, lockClass, key, wait).Scan(&ro, &ok, &server.addr, &server.started); err != nil {
		return false, dbServer{}, fmt.Errorf("take single-instance lock: %w", err)
	}
	if ro {
		return false, server, fmt.Errorf("take single-instance lock on %s: %w", server.addr, errReadOnly)
	}
	return ok.Bool, server, nil
}

// lockKeepalive makes the server drop the lock session within d of its peer vanishing: idle
// probes start after d/2, then every d/10 (at least 1 s) until d is spent; tcp_user_timeout
// bounds unacknowledged data to d. On a Unix socket PostgreSQL ignores them (and so do we).
func lockKeepalive(ctx context.Context, conn *sql.Conn, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	idle, interval, count := pgsession.Keepalive(d)
	_, err := conn.ExecContext(ctx, fmt.Sprintf(`SET tcp_keepalives_idle = %d; SET tcp_keepalives_interval = %d;
		SET tcp_keepalives_count = %d; SET tcp_user_timeout = %d`,
		int(idle/time.Second), int(interval/time.Second), count, d.Milliseconds()))
	if err != nil {
		return fmt.Errorf("set the lock session's keepalives: %w", err)
	}
	return nil
}

// discard ends conn's session instead of returning it to the pool: a session that held the
// lock must end for the lock to go. Returning driver.ErrBadConn from Raw makes database/sql
// close the connection.
func discard(conn *sql.Conn) {
	conn.Raw(func(any) error { return driver.ErrBadConn })
	conn.Close() // already closed by Raw: ErrConnDone, nothing to report
}

// openWorkPool opens a pool of at most n connections for the dispatcher's statements other
// than the lock connection's (the coordinator's: statistics, retention, the fan-in flush and
// sweep; the HTTP listener's: poolShares), named with this run's epoch so that the schema's
// fence refuses it once another dispatcher has taken over. The lock connection has a pool of
// its own (tryConnect).
func openWorkPool(cfg *Config, inst *instance, n int) (*sql.DB, error) {
	db, err := pgsession.Open(dsnWith(dsnOwn(cfg.DSN), "application_name", inst.dispatchAppName()), cfg.Dispatch.LockKeepalive)
	if err != nil {
		return nil, fmt.Errorf("open database: %w", err)
	}
	db.SetMaxOpenConns(n)
	db.SetMaxIdleConns(n)
	return db, nil
}

// poolShares divides DB_POOL_SIZE between the lock connection (one), the coordinator's pool
// and the HTTP listener's (the console's pages, actions and samples, /metrics' row query).
// The HTTP side has a pool of its own so that viewers whose pages wait in the database (a
// slow search of a big table, an incident's crowd, a lock an operator's transaction holds)
// cannot take the connections the fan-in flush, the sweep, retention and the loop's
// statistics write need: with one pool, twelve viewers held every connection and the loop,
// waiting for one to write its statistics, stopped every claim for up to its statement
// budget (TestConsoleLoadLeavesLoopItsConnections). The HTTP side gets a third of what the
// lock leaves, at least one; with DB_POOL_SIZE = 2 only one connection is left besides the
// lock, and both sides share it (http 0: flushStats then does not wait for it). Without an
// HTTP listener (listening false) the coordinator has them all.
func poolShares(n int, listening bool) (work, http int) {
	if n < 3 || !listening {
		return max(1, n-1), 0
	}
	http = max(1, (n-1)/3)
	return n - 1 - http, http
}

// isOutage reports whether err is the database going away or refusing writes (a failover),
// as opposed to a statement that failed on a healthy primary.
func isOutage(err error) bool {
	return isConnLost(err) || errors.Is(err, errReadOnly) || isReadOnlyErr(err)
}

func isReadOnlyErr(err error) bool {
	if err == nil {
		return false
	}
	// lib/pq's own checks of target_session_attrs, when every host failed them.
	s := err.Error()
	return strings.Contains(s, "(25006)") || strings.Contains(s, "session is read-only") ||
		strings.Contains(s, "server is in hot standby mode")
}

// outageMarks are the texts by which a worker's reason or last standard-error line says its
// database session was cut or refused by a failover: lost connections (lib/pq, database/sql,
// libpq), the SQLSTATEs of a server shutting down or starting (57P01, 57P02, 57P03) and of a
// write on a standby (25006), as lib/pq ("... (57P01)") and libpq-based drivers word them; and
// a server whose machine vanished, as the kernel words the SDKs' sockets giving it up (Go's
// "connection timed out", "no route to host"; libpq's "could not receive data from server:
// Connection timed out").
var outageMarks = []string{
	"bad connection", "connection refused", "connection reset", "broken pipe", "unexpected EOF",
	"server closed the connection", "connection to server", "could not connect to any of the hosts",
	"connection timed out", "Connection timed out", "no route to host", "No route to host",
	"could not receive data from server", "could not send data to server",
	"(25006)", "(57P01)", "(57P02)", "(57P03)", "read-only transaction", "hot standby mode",
	"terminating connection due to administrator command", "the database system is starting up",
	"the database system is shutting down", "the database system is in recovery mode",
	"session is read-only",
}

// noSessionMarks are the texts by which a worker's standard error says that the server would
// not give it a session: the SDKs' own words for a connect that failed (both write "connect to
// the database: " and the driver's reason); the connect failures of libpq ("connection to
// server at …" or "on socket … failed") and psycopg ("connection failed: "), whatever the
// reason; and the server's refusals of a new session as lib/pq (the SQLSTATE in parentheses)
// and libpq word them: too many connections (53300: max_connections, or a role's or a
// database's CONNECTION LIMIT), authentication (28P01, 28000: a password, a pg_hba.conf rule,
// a role that may not log in), no such database (3D000), a server not accepting connections
// (57P03) or not reached at all. TestNoSessionTexts has the texts as each words them.
var noSessionMarks = []string{
	"connect to the database: ", "connection to server at ", "connection to server on socket ", "connection failed: ",
	"(53300)", "too many clients already", "too many connections for ", "remaining connection slots are reserved",
	"(28P01)", "(28000)", "password authentication failed", "no pg_hba.conf entry", "is not permitted to log in",
	"(3D000)", "(57P03)", "the database system is starting up", "could not connect to any of the hosts",
}

// isNoSessionText reports whether a line of a worker's standard error says the server would
// not give it a session.
func isNoSessionText(s string) bool { return containsAny(s, noSessionMarks) }

// isOutageText reports whether a worker's failure text names the database's outage.
func isOutageText(s string) bool { return containsAny(s, outageMarks) }

// containsAny reports whether s contains one of marks.
func containsAny(s string, marks []string) bool {
	for _, m := range marks {
		if strings.Contains(s, m) {
			return true
		}
	}
	return false
}

// haStatus is what /metrics and the log say about failover: written by the start-up path and
// the coordinator, read by the metrics handler (an atomic pointer: a new value is a new struct).
type haStatus struct {
	role   string // "waiting" (no writable server yet), "standby", "active", "relocking"
	server string // host:port (or socket directory:port) of the lock session's server
	since  time.Time

	reconciles    int64 // reconciles after a re-lock
	reset         int64 // running rows not held, put back to pending
	forgotten     int64 // held messages whose row was no longer our claim
	outageRetried int64 // failures of the outage or of a full disk (diskfull.go), retried without an attempt
	takeovers     int64 // 1 once this instance took the lock over from another (standby)

	waitedFor string // the holder a standby last waited for, until it holds the lock (acquire)
}

// haBoard publishes haStatus; the zero value publishes nothing until the first set.
type haBoard struct{ p atomic.Pointer[haStatus] }

func (b *haBoard) load() *haStatus { return b.p.Load() }

// update copies the current status, applies f and publishes the copy.
func (b *haBoard) update(f func(*haStatus)) {
	var s haStatus
	if cur := b.p.Load(); cur != nil {
		s = *cur
	}
	role := s.role
	f(&s)
	if s.role != role {
		s.since = time.Now()
	}
	b.p.Store(&s)
}

// writeHA adds the failover gauges and counters to /metrics.
func (b *haBoard) writeHA(p *promWriter) {
	s := b.load()
	if s == nil {
		return
	}
	for _, r := range []string{"waiting", "standby", "active", "relocking"} {
		v := 0
		if s.role == r {
			v = 1
		}
		p.sample("pepsi_lock_role", "gauge", "1 for the dispatcher's role: active holds the single-instance lock; "+
			"standby waits for it; waiting has no writable server; relocking lost its lock connection.",
			label("role", r), v)
	}
	p.sample("pepsi_lock_role_since_seconds", "gauge", "When the dispatcher entered its role (Unix time).", "", s.since.Unix())
	if s.server != "" {
		p.sample("pepsi_database_server_info", "gauge", "The server the lock session is on.", label("server", s.server), 1)
	}
	p.sample("pepsi_reconciles_total", "counter", "Reconciles of the table with memory after a re-lock.", "", s.reconciles)
	p.sample("pepsi_reconcile_reset_total", "counter", "Running rows no worker held, put back to pending by a reconcile.", "", s.reset)
	p.sample("pepsi_reconcile_forgotten_total", "counter", "Held messages no longer claimed by this dispatcher, forgotten by a reconcile.", "", s.forgotten)
	p.sample("pepsi_outage_retried_total", "counter", "Failures caused by a database outage or a full disk, retried without an attempt.", "", s.outageRetried)
	p.sample("pepsi_takeovers_total", "counter", "Times this dispatcher took the lock over from another one.", "", s.takeovers)
}

// outageWorker reports whether w was started before the dispatcher last lost its lock
// connection: only such a worker can have its session on the server that went away. The
// words of isOutageText alone do not prove an outage of ours (a stage calling some other
// service may fail with "connection refused"); a worker started since has a fresh session,
// and its failures are its own, so a stage that keeps failing with such words is charged as
// usual rather than retried for ever.
func (c *coordinator) outageWorker(w *worker) bool {
	return !c.outageAt.IsZero() && !w.started.After(c.outageAt)
}

// outageFailure handles a failure line whose reason names the database's outage (the stage
// lost its session, or its session is on a standby: isOutageText): the message goes back to
// pending without an attempt, and the worker is replaced, since its connection is no good;
// its exit puts the rest of its queue back. It reports whether it took the failure.
func (c *coordinator) outageFailure(w *worker, m *message, text string) bool {
	if !c.outageWorker(w) || !isOutageText(text) {
		return false
	}
	c.resets = append(c.resets, m)
	c.ha.update(func(s *haStatus) { s.outageRetried++ })
	if w.state != workerStopping {
		c.log.Warn("stage failed for the database's outage; the message goes back to pending, no attempt charged, "+
			"and the worker is replaced", "stage", w.stage, "pid", w.pid, "id", m.id, "reason", clip(text, 200))
		w.end(fateRetired)
	}
	return true
}

// retireStranded kills the workers started before the lock connection was lost, once the lock
// is on another server, or on the same one restarted: their sessions were on the server that
// went away. A server that stopped closed them, and a worker learns it at its next statement;
// one whose machine vanished (no FIN, no RST) left them waiting on its answer for as long as
// their kernel retransmits (minutes), while the dispatcher handed them the messages it claimed
// on the new primary, none of which moved (TestFailoverPrimaryVanishes). Their queues go back to
// pending, no attempt charged (fateRetired); replacements start on the new server as claims
// ask for them. A worker of a third-party program is killed alike: no SDK of ours is needed.
func (c *coordinator) retireStranded() {
	for _, w := range c.workers {
		if w.fate == fateRetired || !c.outageWorker(w) {
			continue
		}
		c.log.Warn("worker started before the lock moved to this server; its session was on the one that went away: "+
			"killing it, its messages go back to pending, no attempt charged",
			"stage", w.stage, "pid", w.pid, "requeued", len(w.queue), "server", c.inst.server.addr)
		c.ha.update(func(s *haStatus) { s.outageRetried += int64(len(w.queue)) })
		w.end(fateRetired)
	}
}

// relockMaxDelay caps the back-off between attempts to take the lock again: a failed attempt
// costs a refused connection or one read-only answer, and claims resume within this of the
// new primary accepting connections.
const relockMaxDelay = time.Second
