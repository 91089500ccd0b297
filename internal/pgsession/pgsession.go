// Package pgsession opens the database/sql pools of pepsi's own sessions (the dispatcher's,
// pepsi-queue's) with the two settings they need, whatever the database, the role or the DSN
// sets: READ COMMITTED, and no idle_session_timeout.
//
// The dispatcher's pool runs READ COMMITTED (doc/design/dispatch.md, sections 3 and 5), and its
// statements count on it: the claim re-checks a pending row that an operator changed meanwhile,
// fan-in's open-to-fired re-checks its guard (doc/design/fanin.md), the operator's functions
// change rows other sessions are changing. On a database whose default an application set to
// SERIALIZABLE or REPEATABLE READ, each of those failed instead (SQLSTATE 40001): the claim was
// refused by the database and its stage waited a second at a time
// (TestDatabaseDefaultSerializable).
//
// The dispatcher's sessions are idle by design between heartbeats (POLL_INTERVAL) and when no
// work comes: a role's idle_session_timeout (PostgreSQL 14), which a DBA sets to reap
// forgotten sessions, ended the lock connection at every quiet spell longer than it, and the
// single-instance lock with it (TestIdleSessionTimeout). pepsi ends its sessions itself (a
// worker idle for WORKER_IDLE_TIMEOUT is stopped), so each one turns the timeout off for
// itself; where the role sets none (the default), nothing is set. The LISTEN connection, which
// lib/pq's Listener opens and pepsi cannot send a SET on, is kept from idling instead
// (listen.go).
//
// The settings are sent as statements on each new connection rather than as startup
// parameters in the DSN, because a connection pooler in session mode (PgBouncer) refuses a
// startup parameter it does not know, and the dispatcher may be pointed at one
// (doc/scale-out.md).
package pgsession

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"time"

	"github.com/lib/pq"
)

// setStatements are sent on each new connection before anything else, in one round trip.
const setStatements = "SET default_transaction_isolation = 'read committed'; " + NoIdleTimeout

// NoIdleTimeout turns idle_session_timeout off for the session, where the server has it
// (PostgreSQL 14 and later) and it is on: current_setting(…, true) is NULL on a server
// without it, and the WHERE then keeps set_config from being called. The stage SDKs send the
// same statement when they connect (stage/conn.go, python/pepsi_stage.py).
const NoIdleTimeout = "SELECT set_config('idle_session_timeout', '0', false) WHERE current_setting('idle_session_timeout', true) <> '0'"

// DefaultVanish is how long pepsi's sessions wait on a server whose machine vanished before
// they give it up (vanish.go), unless told otherwise (the dispatcher's LOCK_KEEPALIVE).
const DefaultVanish = 10 * time.Second

// Open is sql.Open("postgres", dsn) whose connections are READ COMMITTED, never ended by the
// server for being idle, and given up within vanish when their server's machine vanishes
// (Dialer; 0: the system's TCP defaults). A DSN that does not parse is an error here, not at
// the first connection.
func Open(dsn string, vanish time.Duration) (*sql.DB, error) {
	c, err := pq.NewConnector(dsn)
	if err != nil {
		return nil, err
	}
	c.Dialer(DialerFor(dsn, vanish))
	return sql.OpenDB(connector{c}), nil
}

// connector makes lib/pq's connections and sets each one's session.
type connector struct{ pq *pq.Connector }

func (c connector) Driver() driver.Driver { return c.pq.Driver() }

func (c connector) Connect(ctx context.Context) (driver.Conn, error) {
	cn, err := c.pq.Connect(ctx)
	if err != nil {
		return nil, err
	}
	ex, ok := cn.(driver.ExecerContext)
	if !ok { // lib/pq's connections are; a driver that changed would be caught by the tests
		cn.Close()
		return nil, fmt.Errorf("set the session's isolation and idle timeout: the driver's connection takes no statement")
	}
	if _, err := ex.ExecContext(ctx, setStatements, nil); err != nil {
		cn.Close()
		return nil, fmt.Errorf("set the session's isolation and idle timeout: %w", err)
	}
	return cn, nil
}
