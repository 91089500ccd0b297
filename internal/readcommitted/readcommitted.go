// Package readcommitted opens the database/sql pools of pepsi's own sessions (the
// dispatcher's, pepsi-queue's) at READ COMMITTED, whatever default_transaction_isolation the
// database, the role or the DSN sets.
//
// The dispatcher's pool runs READ COMMITTED (doc/design/dispatch.md, sections 3 and 5), and its
// statements count on it: the claim re-checks a pending row that an operator changed meanwhile,
// fan-in's open-to-fired re-checks its guard (doc/design/fanin.md), the operator's functions
// change rows other sessions are changing. On a database whose default an application set to
// SERIALIZABLE or REPEATABLE READ, each of those failed instead (SQLSTATE 40001): the claim was
// refused by the database and its stage waited a second at a time
// (TestDatabaseDefaultSerializable).
//
// The level is set by a SET on each new connection rather than as a startup parameter in
// the DSN, because a connection pooler in session mode (PgBouncer) refuses a startup
// parameter it does not know, and the dispatcher may be pointed at one (doc/scale-out.md).
package readcommitted

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"

	"github.com/lib/pq"
)

// setStatement is sent on each new connection before anything else.
const setStatement = "SET default_transaction_isolation = 'read committed'"

// Open is sql.Open("postgres", dsn) whose connections are READ COMMITTED. A DSN that does
// not parse is an error here, not at the first connection.
func Open(dsn string) (*sql.DB, error) {
	c, err := pq.NewConnector(dsn)
	if err != nil {
		return nil, err
	}
	return sql.OpenDB(connector{c}), nil
}

// connector makes lib/pq's connections and sets each one's isolation.
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
		return nil, fmt.Errorf("set the session's isolation to READ COMMITTED: the driver's connection takes no statement")
	}
	if _, err := ex.ExecContext(ctx, setStatement, nil); err != nil {
		cn.Close()
		return nil, fmt.Errorf("set the session's isolation to READ COMMITTED: %w", err)
	}
	return cn, nil
}
