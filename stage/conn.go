// conn.go: the worker's one database connection: the session that takes each message's
// savepoint lazily (and a fused stage's, nested in its predecessor's), and the database/sql
// driver wrapper around lib/pq that calls it before every statement, refuses a second
// connection and keeps the batch transaction out of the handlers' hands.
//
// It sends only BEGIN and savepoint statements (and a fused stage's move of its row, which
// runFused composes); what the batches do is batch.go's.
//
// The batch transaction is lazy too: BeginTx sends nothing, and BEGIN goes out in the request
// of the first savepoint, which only a handler's statement needs. Until then the load runs
// alone, and if no handler sends a statement Commit has nothing to send: under READ COMMITTED
// each statement takes its own snapshot anyway, and the load locks nothing, so a batch whose
// handlers leave Message.Tx alone sees what it would in a transaction, and its outcomes are one
// statement after it (outcome.go), in 2 requests instead of 5.

package stage

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/lib/pq"

	"pepsi-dispatch/internal/pgsession"
)

// session is the state of the worker's one connection that the driver wrapper needs: which
// savepoint the current link of a message's pass (or the SDK's next statement) runs in, and
// whether it is open, whether a handler is running, and whether the connection is gone. Its
// fields are guarded by mu, because a handler may use m.Tx from goroutines of its own; Serve's
// goroutine is the only other user.
type session struct {
	mu         sync.Mutex
	conn       *wrappedConn // the one connection, nil before it is made
	refused    bool         // database/sql asked for a second connection: the first is lost
	inHandler  bool         // a handler is running: its statements need the savepoint
	link       spLink       // the savepoint of the current link
	last       string       // the outermost savepoint of the last message still on the stack, released before the next
	broken     error        // a savepoint statement failed: the batch transaction is unusable
	txOwned    bool         // the handler tried to commit or roll back m.Tx
	statements int64        // requests sent on the connection (tests count round trips with it)
	tx         txState      // the batch transaction, as the server sees it
	savepoints int          // SAVEPOINT statements sent in the batch: at most one subtransaction XID each
	peak       int          // the most savepoints a batch opened (tests check it against maxSubxids)
}

// txState is where the batch transaction stands.
type txState int

const (
	txNone  txState = iota // database/sql has no transaction open
	txLazy                 // database/sql has one; BEGIN is not sent yet
	txBegun                // BEGIN is sent: the server has a transaction
)

// spLink is the savepoint of one link of a message's pass (or of an SDK statement): the
// session opens it lazily, in the request of the first statement that needs it.
type spLink struct {
	name   string // the savepoint's name, unique in the batch
	open   bool   // established
	nested bool   // made inside an open savepoint of the same message: it leaves last alone
	move   string // sent right after the SAVEPOINT: a fused stage's move of the running row to its stage
}

func (s *session) beginTx() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.last, s.link, s.broken, s.savepoints = "", spLink{}, nil, 0
}

// savepointsOpened returns the savepoints the batch has opened so far (see maxSubxids).
func (s *session) savepointsOpened() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.savepoints
}

// began reports whether the batch has begun its transaction on the server (before its end).
func (s *session) began() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.tx == txBegun
}

// setLink makes l the savepoint that the next statement needs (savepointPrefix): a message's,
// a fused stage's, or one of the SDK's own; or, restoring a saved one, the savepoint of the
// stage before a fused stage that failed.
func (s *session) setLink(l spLink) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.link = l
}

// currentLink returns the current savepoint, to be restored with setLink.
func (s *session) currentLink() spLink {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.link
}

// handlerRunning tells whether a handler runs: only then do the statements on the connection
// open the savepoint of their own, and may m.Tx not be committed or rolled back.
func (s *session) handlerRunning(running bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.inHandler = running
}

// isOpen reports whether the current link's savepoint is open: it has sent a statement.
func (s *session) isOpen() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.link.open
}

func (s *session) brokenErr() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.broken
}

func (s *session) txOwnedViolation() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.txOwned
}

// lost reports whether the connection is gone: database/sql tried to replace it, or lib/pq
// marked it bad (network error, FATAL from the server, cancelled query).
func (s *session) lost() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.refused || s.conn == nil || s.conn.closed || !s.conn.inner.IsValid()
}

// savepointPrefix returns the statements that open the current link's savepoint, to be sent
// in the same request as the caller's statement, and records it as open; "" when it is open
// already. Should the request fail before the savepoint is made, ROLLBACK TO it fails too, and
// the batch ends: nothing is ever rolled back to the wrong savepoint, because each has its own
// name.
func (s *session) savepointPrefix() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.savepointPrefixLocked()
}

func (s *session) savepointPrefixLocked() string {
	l := &s.link
	if l.open || l.name == "" {
		return ""
	}
	var b strings.Builder
	if s.tx == txLazy {
		b.WriteString("BEGIN ISOLATION LEVEL READ COMMITTED; ")
		s.tx = txBegun
	}
	if !l.nested {
		if s.last != "" {
			// Released, the previous message's subtransaction merges into the batch and the
			// savepoint stack stays short: one deep, plus one per fused stage nested in it.
			b.WriteString("RELEASE SAVEPOINT " + s.last + "; ")
		}
		s.last = l.name
	}
	b.WriteString("SAVEPOINT " + l.name + "; ")
	s.savepoints++
	s.peak = max(s.peak, s.savepoints)
	if l.move != "" {
		b.WriteString(l.move + "; ")
	}
	l.open = true
	return b.String()
}

// beforeStatement opens the current link's savepoint before a handler's first statement.
// Any statement counts, a Prepare too: an error in a transaction aborts it, whatever failed.
func (s *session) beforeStatement(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.statements++
	if !s.inHandler || s.broken != nil {
		return s.broken
	}
	q := s.savepointPrefixLocked()
	if q == "" {
		return nil
	}
	s.statements++
	if _, err := s.conn.inner.ExecContext(ctx, q, nil); err != nil {
		s.broken = fmt.Errorf("open savepoint %s: %w", s.link.name, err)
		return s.broken
	}
	return nil
}

// rollbackMessage undoes what the current link wrote, if it wrote anything. A fused stage's
// savepoint is released too, in the same request: what its predecessor writes next then
// belongs to the predecessor's subtransaction, and takes no new one.
func (s *session) rollbackMessage(ctx context.Context, tx *sql.Tx) error {
	s.mu.Lock()
	l, broken := s.link, s.broken
	s.mu.Unlock()
	if broken != nil {
		return broken
	}
	if !l.open {
		return nil // the link sent nothing: there is nothing to undo
	}
	q := "ROLLBACK TO SAVEPOINT " + l.name
	if l.move != "" {
		q += "; RELEASE SAVEPOINT " + l.name
	}
	if _, err := tx.ExecContext(ctx, q); err != nil {
		return fmt.Errorf("roll back to savepoint %s: %w", l.name, err)
	}
	if l.move != "" {
		s.mu.Lock()
		s.link.open = false
		if !l.nested && s.last == l.name {
			s.last = "" // it released the previous message's savepoint when it was made
		}
		s.mu.Unlock()
	}
	return nil
}

// onceConnector makes the worker's one connection, and refuses every later request for one:
// database/sql replaces a bad connection silently, but a stage must not, because the outcome
// of the transaction it was in is unknown and the dispatcher recovers from the crash instead.
type onceConnector struct {
	pq   *pq.Connector
	sess *session
}

func (c *onceConnector) Connect(ctx context.Context) (driver.Conn, error) {
	c.sess.mu.Lock()
	defer c.sess.mu.Unlock()
	if c.sess.conn != nil || c.sess.refused {
		c.sess.refused = true
		return nil, ErrConnectionLost
	}
	inner, err := c.pq.Connect(ctx)
	if err != nil {
		c.sess.refused = true // one try: a stage that cannot connect exits and is restarted
		return nil, err
	}
	pc, ok := inner.(pqConn)
	if !ok {
		inner.Close()
		c.sess.refused = true
		return nil, fmt.Errorf("lib/pq connection %T lacks an interface the stage SDK wraps", inner)
	}
	// A worker's session is idle between batches, for up to the dispatcher's
	// WORKER_IDLE_TIMEOUT: a role's idle_session_timeout shorter than that ended it, and the
	// worker exited with its batch, its first message charged an attempt
	// (TestIdleSessionTimeout). The dispatcher stops idle workers itself, so the session turns
	// the timeout off for itself, as the dispatcher's own sessions do (internal/pgsession).
	if _, err := pc.ExecContext(ctx, pgsession.NoIdleTimeout, nil); err != nil {
		inner.Close()
		c.sess.refused = true
		return nil, fmt.Errorf("turn the session's idle_session_timeout off: %w", err)
	}
	c.sess.conn = &wrappedConn{inner: pc, sess: c.sess}
	return c.sess.conn, nil
}

func (c *onceConnector) Driver() driver.Driver { return c.pq.Driver() }

// pqConn is what lib/pq's connection implements and database/sql looks for.
type pqConn interface {
	driver.Conn
	driver.Tx // lib/pq's connection commits and rolls back the transaction it is in
	driver.ConnBeginTx
	driver.ConnPrepareContext
	driver.ExecerContext
	driver.QueryerContext
	driver.Pinger
	driver.SessionResetter
	driver.Validator
	driver.NamedValueChecker
}

// wrappedConn forwards to lib/pq, calling the session before every statement so that a
// handler's statements run inside the message's savepoint, and keeping the batch transaction
// out of the handler's hands.
type wrappedConn struct {
	inner  pqConn
	sess   *session
	closed bool // guarded by sess.mu
}

var (
	_ driver.Conn               = (*wrappedConn)(nil)
	_ driver.ConnBeginTx        = (*wrappedConn)(nil)
	_ driver.ConnPrepareContext = (*wrappedConn)(nil)
	_ driver.ExecerContext      = (*wrappedConn)(nil)
	_ driver.QueryerContext     = (*wrappedConn)(nil)
	_ driver.Pinger             = (*wrappedConn)(nil)
	_ driver.SessionResetter    = (*wrappedConn)(nil)
	_ driver.Validator          = (*wrappedConn)(nil)
	_ driver.NamedValueChecker  = (*wrappedConn)(nil)
	_ driver.StmtExecContext    = (*wrappedStmt)(nil)
	_ driver.StmtQueryContext   = (*wrappedStmt)(nil)
)

func (c *wrappedConn) Prepare(query string) (driver.Stmt, error) {
	return c.PrepareContext(context.Background(), query)
}

func (c *wrappedConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	if err := c.sess.beforeStatement(ctx); err != nil {
		return nil, err
	}
	st, err := c.inner.PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	cst, ok := st.(ctxStmt)
	if !ok {
		st.Close()
		return nil, fmt.Errorf("prepare: lib/pq statement %T lacks the context methods the stage SDK wraps", st)
	}
	return &wrappedStmt{inner: cst, sess: c.sess}, nil
}

func (c *wrappedConn) Close() error {
	c.sess.mu.Lock()
	c.closed = true
	c.sess.mu.Unlock()
	return c.inner.Close()
}

func (c *wrappedConn) Begin() (driver.Tx, error) {
	return c.BeginTx(context.Background(), driver.TxOptions{})
}

// BeginTx begins the batch transaction lazily (see the top of the file): the first savepoint
// sends BEGIN. The SDK is the only caller (handlers get a transaction, not the database), and
// it asks for the defaults: a plain BEGIN.
func (c *wrappedConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	c.sess.mu.Lock()
	defer c.sess.mu.Unlock()
	if c.sess.tx != txNone {
		return nil, errors.New("begin transaction: the stage SDK's connection is in one already")
	}
	if opts.Isolation != driver.IsolationLevel(sql.LevelDefault) || opts.ReadOnly {
		return nil, errors.New("begin transaction: the stage SDK begins only default transactions")
	}
	c.sess.tx = txLazy
	return &wrappedTx{conn: c}, nil
}

func (c *wrappedConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (
	driver.Result, error) {
	if err := c.sess.beforeStatement(ctx); err != nil {
		return nil, err
	}
	return c.inner.ExecContext(ctx, query, args)
}

func (c *wrappedConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (
	driver.Rows, error) {
	if err := c.sess.beforeStatement(ctx); err != nil {
		return nil, err
	}
	return c.inner.QueryContext(ctx, query, args)
}

func (c *wrappedConn) Ping(ctx context.Context) error { return c.inner.Ping(ctx) }

func (c *wrappedConn) ResetSession(ctx context.Context) error { return c.inner.ResetSession(ctx) }

func (c *wrappedConn) IsValid() bool { return c.inner.IsValid() }

func (c *wrappedConn) CheckNamedValue(nv *driver.NamedValue) error {
	return c.inner.CheckNamedValue(nv)
}

// wrappedTx is the batch transaction. It refuses Commit and Rollback while a handler runs (the
// transaction is the SDK's), and sends neither when BEGIN was never sent.
type wrappedTx struct {
	conn *wrappedConn
}

func (t *wrappedTx) Commit() error {
	begun, err := t.end()
	if err != nil || !begun {
		return err
	}
	return t.conn.inner.Commit()
}

func (t *wrappedTx) Rollback() error {
	begun, err := t.end()
	if err != nil || !begun {
		return err
	}
	return t.conn.inner.Rollback()
}

// end ends the transaction for the session, unless a handler runs, and tells whether the
// server has one to end.
func (t *wrappedTx) end() (begun bool, err error) {
	s := t.conn.sess
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.inHandler {
		s.txOwned = true
		return false, errTxOwned
	}
	begun = s.tx == txBegun
	s.tx = txNone
	if begun {
		s.statements++
	}
	return begun, nil
}

// ctxStmt is what lib/pq's prepared statement implements.
type ctxStmt interface {
	driver.Stmt
	driver.StmtExecContext
	driver.StmtQueryContext
}

// wrappedStmt is a prepared statement; executing it is a statement like any other.
type wrappedStmt struct {
	inner ctxStmt
	sess  *session
}

func (s *wrappedStmt) Close() error  { return s.inner.Close() }
func (s *wrappedStmt) NumInput() int { return s.inner.NumInput() }

func (s *wrappedStmt) Exec(args []driver.Value) (driver.Result, error) {
	return s.ExecContext(context.Background(), namedValues(args))
}

func (s *wrappedStmt) Query(args []driver.Value) (driver.Rows, error) {
	return s.QueryContext(context.Background(), namedValues(args))
}

func (s *wrappedStmt) ExecContext(ctx context.Context, args []driver.NamedValue) (driver.Result, error) {
	if err := s.sess.beforeStatement(ctx); err != nil {
		return nil, err
	}
	return s.inner.ExecContext(ctx, args)
}

func (s *wrappedStmt) QueryContext(ctx context.Context, args []driver.NamedValue) (driver.Rows, error) {
	if err := s.sess.beforeStatement(ctx); err != nil {
		return nil, err
	}
	return s.inner.QueryContext(ctx, args)
}

func namedValues(args []driver.Value) []driver.NamedValue {
	nv := make([]driver.NamedValue, len(args))
	for i, v := range args {
		nv[i] = driver.NamedValue{Ordinal: i + 1, Value: v}
	}
	return nv
}
