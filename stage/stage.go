// stage.go: the stage SDK: configuration, the serving loop, messages and their outcomes, and the
// wrapper around the worker's one database connection that takes savepoints lazily.
//
// It owns the worker's side of the protocol of doc.go: the reading of ids, the batch transaction
// and the status lines. It writes only the rows it was handed, and only under the guard
// status = 'running' AND stage = <this stage>; failures are the dispatcher's to record.
package stage

import (
	"bufio"
	"bytes"
	"context"
	"database/sql"
	"database/sql/driver"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"regexp"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/lib/pq"
)

const (
	// maxBatch caps the messages run in one transaction. Every message that writes opens a
	// subtransaction with its own XID, and PostgreSQL caches at most 64 of those per backend
	// (PGPROC_MAX_CACHED_SUBXIDS); past that the backend's snapshot entry overflows and every
	// snapshot in the cluster gets slower. A batch also delays its first reply until its last
	// message is done, so a bigger one would buy little.
	maxBatch = 64

	// readBufferSize bounds the bytes read from stdin ahead of processing: a few thousand ids.
	readBufferSize = 64 << 10

	// maxReason is the longest reason put on a status line, in bytes.
	maxReason = 1000
)

// Sentinel errors, for errors.Is.
var (
	// ErrConnectionLost means the database connection broke. A stage connects once and never
	// reconnects: the outcome of the batch in flight is unknown, so the process must end and
	// let the dispatcher recover its rows.
	ErrConnectionLost = errors.New("database connection lost (a stage connects once and does not reconnect)")

	// ErrClaimLost means the row is no longer running at this stage: the dispatcher took the
	// claim back (timeout, shutdown) or another outcome already moved it.
	ErrClaimLost = errors.New("claim lost")

	// ErrOutcomeChosen is returned by a second outcome for the same message.
	ErrOutcomeChosen = errors.New("an outcome was already chosen for this message")

	// ErrNotNext is returned by Advance for a stage that is not in the stage's NEXT list.
	ErrNotNext = errors.New("not a NEXT stage of this stage")

	// ErrHandlerDone is returned by an outcome chosen after the handler returned.
	ErrHandlerDone = errors.New("the handler has already returned")

	// errTxOwned is what Commit and Rollback of Message.Tx return inside a handler.
	errTxOwned = errors.New("the stage SDK owns Message.Tx: a handler must not commit or roll it back")
)

// Handler processes one message. It chooses exactly one outcome (Advance, Done or Defer) and
// returns nil; any other return fails the message and rolls back everything it wrote in m.Tx.
// Handlers run one at a time, in the order of the ids.
type Handler func(ctx context.Context, m *Message) error

// Config is what a stage program is started with. Run reads it from the command line and the
// environment (LoadConfig); embedding programs and tests fill it in for Serve.
type Config struct {
	// Stage is the stage this program serves (PEPSI_STAGE). Every outcome is guarded by it.
	// Required; a name is [a-z0-9_-]+ as in the configuration file.
	Stage string

	// Next lists the stages Advance may move a message to (PEPSI_NEXT, space-separated). Empty
	// for a final stage, which can only finish or defer its messages.
	Next []string

	// DSN is the libpq connection string or URL (PEPSI_DSN). The dispatcher's DSN carries an
	// application_name starting with "pepsi-", which keeps a stage's advances from firing the
	// requeue NOTIFY trigger of schema.sql; the SDK keeps any name it is given and sets
	// "pepsi-stage-<Stage>" only when there is none. Empty means lib/pq's defaults (PG*
	// environment variables).
	DSN string

	// ConfigFile is the -c FILE argument, "" without one. The SDK does not read it: it is for
	// stage programs that keep settings of their own in the shared file.
	ConfigFile string

	// hooks lets this package's tests observe a session; nil in every other use.
	hooks *testHooks
}

// testHooks are the package tests' view into a running Serve.
type testHooks struct {
	// session receives the session once it is connected.
	session func(s *session)
}

var stageName = regexp.MustCompile(`^[a-z0-9_-]+$`)

func (c *Config) validate() error {
	if !stageName.MatchString(c.Stage) {
		return fmt.Errorf("stage name %q: want [a-z0-9_-]+ (is PEPSI_STAGE set?)", c.Stage)
	}
	for _, n := range c.Next {
		if !stageName.MatchString(n) {
			return fmt.Errorf("next stage name %q: want [a-z0-9_-]+", n)
		}
	}
	return nil
}

// LoadConfig parses `[-c FILE] worker` (os.Args[1:]) and reads PEPSI_STAGE, PEPSI_NEXT and
// PEPSI_DSN from the environment. Programs that need the configuration before serving call it
// and then Serve; the others just call Run.
func LoadConfig(args []string) (Config, error) {
	return loadConfig(args, os.Getenv)
}

func loadConfig(args []string, getenv func(string) string) (Config, error) {
	fs := flag.NewFlagSet("stage", flag.ContinueOnError)
	fs.SetOutput(io.Discard) // the error returned says it all; no usage dump on the dispatcher's log
	file := fs.String("c", "", "configuration file")
	if err := fs.Parse(args); err != nil {
		return Config{}, fmt.Errorf("parse arguments: %w (usage: PROGRAM [-c FILE] worker)", err)
	}
	if fs.NArg() != 1 || fs.Arg(0) != "worker" {
		return Config{}, fmt.Errorf("parse arguments %q: usage: PROGRAM [-c FILE] worker", args)
	}
	cfg := Config{
		Stage:      getenv("PEPSI_STAGE"),
		Next:       strings.Fields(getenv("PEPSI_NEXT")),
		DSN:        getenv("PEPSI_DSN"),
		ConfigFile: *file,
	}
	if cfg.DSN == "" {
		return Config{}, errors.New("read environment: PEPSI_DSN is not set (a stage is started by pepsi-dispatch)")
	}
	if err := cfg.validate(); err != nil {
		return Config{}, fmt.Errorf("read environment: %w", err)
	}
	return cfg, nil
}

// Run is a stage program's main: it parses `[-c FILE] worker` from os.Args, reads PEPSI_STAGE,
// PEPSI_NEXT (space-separated), PEPSI_DSN from the environment, connects once and serves
// os.Stdin/os.Stdout until EOF; it exits the process (0 after EOF, non-zero on a fatal error
// such as a lost database connection, with the reason on stderr).
//
// Exit statuses: 0 after EOF on stdin, 2 for a usage or environment error, 1 for any other
// fatal error. Signals keep their default action: SIGTERM or SIGINT end the process at once,
// which is safe, because the batch in flight has not committed (PostgreSQL rolls it back when
// the connection drops) or has committed under the guard (the dispatcher's recovery writes
// are guarded too and leave a moved row alone).
func Run(h Handler) {
	os.Exit(run(context.Background(), os.Args[1:], os.Getenv, os.Stdin, os.Stdout, os.Stderr, h))
}

// run is Run with its dependencies passed in; it returns the exit status.
func run(ctx context.Context, args []string, getenv func(string) string,
	stdin io.Reader, stdout, stderr io.Writer, h Handler) int {
	cfg, err := loadConfig(args, getenv)
	if err != nil {
		fmt.Fprintf(stderr, "stage: %v\n", err)
		return 2
	}
	if err := Serve(ctx, cfg, stdin, stdout, h); err != nil {
		fmt.Fprintf(stderr, "stage %s: %v\n", cfg.Stage, err)
		return 1
	}
	return 0
}

// Serve is Run without the process: tests and embedding programs call it. It connects to
// cfg.DSN once, reads ids from in and writes one status line per id to out, in order, until in
// reaches EOF (it then returns nil once the ids read are answered), a fatal error (a lost
// connection, a failed write to out) or ctx is done. ctx is noticed between batches and in
// database calls, where lib/pq closes the connection to cancel them; a Read of in that is
// blocked is not interrupted: close in to stop it.
//
// Every id already available on in (up to 64) is run as one batch in one transaction, whose
// status lines are written together after the commit; see doc.go.
func Serve(ctx context.Context, cfg Config, in io.Reader, out io.Writer, h Handler) error {
	if err := cfg.validate(); err != nil {
		return fmt.Errorf("check configuration: %w", err)
	}
	srv, err := connect(ctx, cfg, h)
	if err != nil {
		return err
	}
	defer srv.close()
	r := bufio.NewReaderSize(in, readBufferSize)
	for {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("serve: %w", err)
		}
		lines, eof, err := readBatch(r, maxBatch)
		if err != nil {
			return fmt.Errorf("read message ids: %w", err)
		}
		if len(lines) > 0 {
			replies, err := srv.runBatch(ctx, lines)
			if err != nil {
				return err
			}
			// One write for the whole batch: the dispatcher reads all of it at once.
			if _, err := out.Write(replies); err != nil {
				return fmt.Errorf("write status lines: %w", err)
			}
		}
		if eof {
			return nil
		}
	}
}

// readBatch reads one line, waiting for it, and then every further complete line that is
// already buffered, up to max. Waiting for more would delay the replies of the lines in hand,
// and the dispatcher writes a worker's queue in one buffer, so one read brings in all of it. A
// last line without a newline before EOF counts as a line.
func readBatch(r *bufio.Reader, max int) (lines []string, eof bool, err error) {
	for len(lines) < max {
		if len(lines) > 0 {
			buffered, _ := r.Peek(r.Buffered()) // cannot fail: it asks for no more than is buffered
			if bytes.IndexByte(buffered, '\n') < 0 {
				break
			}
		}
		line, err := readLine(r)
		if err == io.EOF {
			if line != "" {
				lines = append(lines, line)
			}
			return lines, true, nil
		}
		if err != nil {
			return lines, false, err
		}
		lines = append(lines, line)
	}
	return lines, false, nil
}

// readLine returns the next line without its newline. A line longer than the buffer is cut to
// its first bytes (it is not an id anyway, and still gets its one reply).
func readLine(r *bufio.Reader) (string, error) {
	b, err := r.ReadSlice('\n')
	line := string(bytes.TrimRight(b, "\r\n"))
	for err == bufio.ErrBufferFull {
		_, err = r.ReadSlice('\n')
	}
	return line, err
}

// server is one Serve: the connection and what the batches share. Only Serve's goroutine uses
// it, except the session, which handler goroutines may reach through Message.Tx.
type server struct {
	cfg  Config
	h    Handler
	db   *sql.DB
	sess *session
	load *sql.Stmt // prepared once, so a batch's load is one round trip
	log  *slog.Logger
}

const loadQuery = `SELECT workqueue_id, attempts, payload, state FROM workqueue
WHERE workqueue_id = ANY($1::bigint[]) AND status = 'running' AND stage = $2`

// connect opens the worker's one connection and prepares the load statement.
func connect(ctx context.Context, cfg Config, h Handler) (*server, error) {
	pcfg, err := pq.NewConfig(cfg.DSN)
	if err != nil {
		return nil, fmt.Errorf("parse DSN: %w", err)
	}
	if pcfg.ApplicationName == "" {
		pcfg.ApplicationName = "pepsi-stage-" + cfg.Stage
	}
	pconn, err := pq.NewConnectorConfig(pcfg)
	if err != nil {
		return nil, fmt.Errorf("configure connection: %w", err)
	}
	sess := &session{}
	db := sql.OpenDB(&onceConnector{pq: pconn, sess: sess})
	// One connection, kept for the life of the process: database/sql must neither open a
	// second one nor close this one for being idle or old.
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)
	db.SetConnMaxLifetime(0)
	db.SetConnMaxIdleTime(0)
	srv := &server{cfg: cfg, h: h, db: db, sess: sess, log: slog.Default().With("stage", cfg.Stage)}
	if err := db.PingContext(ctx); err != nil {
		db.Close()
		return nil, fmt.Errorf("connect to the database: %w", err)
	}
	if srv.load, err = db.PrepareContext(ctx, loadQuery); err != nil {
		db.Close()
		return nil, fmt.Errorf("prepare load statement: %w", err)
	}
	if cfg.hooks != nil && cfg.hooks.session != nil {
		cfg.hooks.session(sess)
	}
	return srv, nil
}

func (s *server) close() {
	// Errors do not matter here: the process is ending or the connection is gone, and closing
	// the connection rolls back whatever it had open.
	s.load.Close()
	s.db.Close()
}

// reply is one status line in the making.
type reply struct {
	id     int64
	ok     bool
	words  string // after "0 " on success: "done" when the message finished (dispatch_stats.done)
	reason string // why it failed, when !ok
	done   bool   // decided (bad id, claim lost) before the handler would run
}

func (r *reply) fail(reason string) { r.ok, r.reason, r.done = false, reason, true }

// runBatch runs the messages of lines in one transaction and returns their status lines, or a
// fatal error (the connection is gone; nothing is to be written then: the dispatcher treats
// the exit as a crash and puts the rows back).
//
// The design, and its round trips. Commits are the expensive part (one WAL flush each), so the
// batch has one. Within it, a message's work must be undoable alone, which takes a savepoint
// (a subtransaction) — but only for a message that sends statements of its own. So:
//
//   - The savepoint is lazy: the connection wrapper opens it in front of the handler's first
//     statement on m.Tx (or in the same request as an outcome written at once).
//   - The outcome of a handler that has sent nothing when it chooses Advance, Done or Defer is
//     not written at once but kept, with the state as it was then; after the handler returns
//     nil it joins the batch's one outcome statement (see writeOutcomes). Such a message has
//     nothing of its own to undo, so it needs no savepoint at all. If the handler sends a
//     statement after choosing, its outcome is written in its savepoint when it returns.
//
// Requests per batch of N messages whose handlers leave m.Tx alone: BEGIN, the load, the
// outcome statement, COMMIT — 4, whatever N is. A handler that uses m.Tx adds one SAVEPOINT,
// its own statements and its outcome UPDATE; a failed message that wrote adds a ROLLBACK TO.
// Writing every outcome at once in its own savepoint (the simple way) would cost N + 3
// requests, N statements to parse and plan, and N subtransaction XIDs per batch.
func (s *server) runBatch(ctx context.Context, lines []string) ([]byte, error) {
	replies := make([]reply, len(lines))
	ids := make([]int64, 0, len(lines))
	for i, line := range lines {
		id, err := strconv.ParseInt(strings.TrimSpace(line), 10, 64)
		if err != nil {
			replies[i].fail(fmt.Sprintf("bad message id %q: want a decimal number", line))
			continue
		}
		replies[i].id = id
		ids = append(ids, id)
	}
	if len(ids) == 0 {
		return formatReplies(replies), nil
	}
	if err := s.runTx(ctx, replies, ids); err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("run batch of %d ids: %w", len(ids), ctx.Err())
		}
		if errors.Is(err, ErrConnectionLost) || errors.Is(err, errTxOwned) {
			return nil, fmt.Errorf("run batch of %d ids: %w", len(ids), err)
		}
		if s.sess.lost() {
			return nil, fmt.Errorf("run batch of %d ids: %w (%w)", len(ids), err, ErrConnectionLost)
		}
		// The transaction is gone with everything in it: every message of the batch fails,
		// including those whose handler succeeded.
		for i := range replies {
			if !replies[i].done { // a failure already decided keeps its own reason
				replies[i].fail(err.Error())
			}
		}
	}
	return formatReplies(replies), nil
}

// runTx is one batch transaction. It fills replies; an error means the transaction was rolled
// back (or is lost) and every message fails with it.
func (s *server) runTx(ctx context.Context, replies []reply, ids []int64) (err error) {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin batch transaction: %w", err)
	}
	s.sess.beginTx()
	defer func() {
		if err != nil {
			// The error that ended the batch is the one to report; a failed rollback only
			// matters when the connection is gone, which sess.lost() tells the caller.
			tx.Rollback()
		}
	}()
	rows, err := s.loadRows(ctx, tx, ids)
	if err != nil {
		return err
	}
	var kept []keptOutcome
	for i := range replies {
		r := &replies[i]
		if r.done {
			continue
		}
		row, ok := rows[r.id]
		if !ok {
			r.fail(fmt.Sprintf("message %d is not running at stage %s (claim lost)", r.id, s.cfg.Stage))
			continue
		}
		delete(rows, r.id) // the same id twice in a batch finds its claim taken the second time
		m, reason, err := s.runMessage(ctx, tx, i, row)
		if err != nil {
			return err
		}
		if reason == "" && m.chosen == "done" {
			r.words = "done"
		}
		switch {
		case reason != "":
			r.fail(reason)
		case m.kept != nil:
			kept = append(kept, keptOutcome{index: i, m: m})
			r.ok = true // unless the outcome statement finds the claim gone
		default:
			r.ok = true
		}
	}
	if len(kept) > 0 {
		if err := s.writeOutcomes(ctx, tx, kept, replies); err != nil {
			return err
		}
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("commit batch transaction: %w", err)
	}
	return nil
}

// loadedRow is a message's row as loaded at the start of the batch.
type loadedRow struct {
	id       int64
	attempts int
	payload  []byte
	state    []byte
}

// loadRows loads the rows of ids that are running at this stage, in one query.
func (s *server) loadRows(ctx context.Context, tx *sql.Tx, ids []int64) (map[int64]loadedRow, error) {
	rs, err := tx.StmtContext(ctx, s.load).QueryContext(ctx, pq.Array(ids), s.cfg.Stage)
	if err != nil {
		return nil, fmt.Errorf("load messages: %w", err)
	}
	defer rs.Close()
	rows := make(map[int64]loadedRow, len(ids))
	for rs.Next() {
		var r loadedRow
		if err := rs.Scan(&r.id, &r.attempts, &r.payload, &r.state); err != nil {
			return nil, fmt.Errorf("load messages: scan: %w", err)
		}
		rows[r.id] = r
	}
	if err := rs.Err(); err != nil {
		return nil, fmt.Errorf("load messages: %w", err)
	}
	return rows, nil
}

// runMessage runs the handler for one loaded row inside its own (lazy) savepoint. It returns
// the message and the reason it failed ("" for success; the message's outcome may still be
// kept for the outcome statement), or an error that ends the batch.
func (s *server) runMessage(ctx context.Context, tx *sql.Tx, index int, row loadedRow) (
	m *Message, reason string, err error) {
	m = &Message{
		ID:       row.id,
		Stage:    s.cfg.Stage,
		Attempts: row.attempts,
		Tx:       tx,
		ctx:      ctx,
		srv:      s,
		live:     true,
	}
	if row.payload != nil {
		m.Payload = json.RawMessage(row.payload)
	}
	if m.State, err = decodeState(row.state); err != nil {
		// A state that is not an object is nothing the handler could work with; its outcome
		// would overwrite it. Fail the message and let an operator look.
		return m, fmt.Sprintf("message %d: %v", row.id, err), nil
	}
	s.sess.startMessage(index)
	herr := s.callHandler(ctx, m)
	s.sess.endMessage()
	m.live = false

	if s.sess.txOwnedViolation() {
		return m, "", fmt.Errorf("message %d: %w", row.id, errTxOwned)
	}
	if err := s.sess.brokenErr(); err != nil {
		return m, "", err
	}
	switch {
	case herr != nil:
		reason = herr.Error()
	case m.writeErr != nil:
		reason = fmt.Sprintf("handler returned nil after its outcome failed: %v", m.writeErr)
	case m.second != "":
		reason = fmt.Sprintf("handler chose more than one outcome (%s, then %s)", m.chosen, m.second)
	case m.chosen == "":
		reason = "handler returned without choosing an outcome (Advance, Done or Defer); the row would stay running"
	case m.kept != nil && s.sess.isOpen():
		// The handler wrote after choosing: its outcome goes in its savepoint, with its writes.
		k := m.kept
		m.kept = nil
		if err := m.update(ctx, tx, k.change, k.state); err != nil {
			reason = err.Error()
		}
	}
	if reason == "" {
		return m, "", nil
	}
	m.kept = nil
	if err := s.sess.rollbackMessage(ctx, tx); err != nil {
		return m, "", err
	}
	return m, reason, nil
}

// keptOutcome is a message whose outcome waits for the batch's outcome statement.
type keptOutcome struct {
	index int // in the batch's replies
	m     *Message
}

// writeOutcomes writes the kept outcomes in one UPDATE … FROM (VALUES …) RETURNING, each row
// under the same guard as a single outcome, and fails the messages whose row it did not find.
// The statement runs in a savepoint of its own: should it fail (say one state that jsonb
// rejects), it is rolled back and the outcomes are written one by one, each in its own
// savepoint, so that one bad message does not fail the batch.
func (s *server) writeOutcomes(ctx context.Context, tx *sql.Tx, kept []keptOutcome, replies []reply) error {
	var b strings.Builder
	// An advance resets attempts: MAX_ATTEMPTS counts failures at one stage, not across them.
	b.WriteString("UPDATE workqueue AS w SET stage = coalesce(v.stage, w.stage), status = v.status," +
		" attempts = CASE WHEN v.stage IS NULL THEN w.attempts ELSE 0 END," +
		" retry_at = coalesce(v.retry_at, w.retry_at), state = v.state FROM (VALUES ")
	for i, k := range kept {
		if i > 0 {
			b.WriteString(", ")
		}
		c := k.m.kept.change
		fmt.Fprintf(&b, "(%d::bigint, %s::text, %s::text, %s::timestamptz, %s::jsonb)", k.m.ID,
			literalOrNull(c.stage), pq.QuoteLiteral(c.status), literalOrNull(c.retryAt),
			pq.QuoteLiteral(string(k.m.kept.state)))
	}
	b.WriteString(") AS v (id, stage, status, retry_at, state) WHERE w.workqueue_id = v.id" +
		" AND w.status = 'running' AND w.stage = " + pq.QuoteLiteral(s.cfg.Stage) +
		" RETURNING w.workqueue_id")

	s.sess.startSavepoint("pepsi_outcomes")
	written, err := queryIDs(ctx, tx, s.sess.savepointPrefix()+b.String())
	if err != nil {
		if s.sess.lost() {
			return fmt.Errorf("write %d outcomes: %w", len(kept), err)
		}
		if rerr := s.sess.rollbackMessage(ctx, tx); rerr != nil {
			return fmt.Errorf("write %d outcomes: %w; then %w", len(kept), err, rerr)
		}
		s.log.Warn("outcome statement failed; writing the outcomes one by one", "outcomes", len(kept), "error", err)
		for _, k := range kept {
			s.sess.startSavepoint("pepsi_outcome_" + strconv.Itoa(k.index))
			if err := k.m.update(ctx, tx, k.m.kept.change, k.m.kept.state); err != nil {
				if rerr := s.sess.rollbackMessage(ctx, tx); rerr != nil {
					return rerr
				}
				replies[k.index].fail(err.Error())
			}
		}
		return nil
	}
	for _, k := range kept {
		if !written[k.m.ID] {
			replies[k.index].fail(fmt.Sprintf("%s message %d: row is no longer running at stage %s (claim lost)",
				k.m.kept.change.what, k.m.ID, s.cfg.Stage))
		}
	}
	return nil
}

// queryIDs runs a query of one bigint column and returns the set of its values.
func queryIDs(ctx context.Context, tx *sql.Tx, q string) (map[int64]bool, error) {
	rs, err := tx.QueryContext(ctx, q)
	if err != nil {
		return nil, err
	}
	defer rs.Close()
	ids := map[int64]bool{}
	for rs.Next() {
		var id int64
		if err := rs.Scan(&id); err != nil {
			return nil, err
		}
		ids[id] = true
	}
	return ids, rs.Err()
}

func literalOrNull(s string) string {
	if s == "" {
		return "NULL"
	}
	return pq.QuoteLiteral(s)
}

// callHandler runs the handler, turning a panic into a failure of the message.
func (s *server) callHandler(ctx context.Context, m *Message) (err error) {
	defer func() {
		if p := recover(); p != nil {
			s.log.Error("handler panicked", "message", m.ID, "panic", fmt.Sprint(p), "stack", string(debug.Stack()))
			err = fmt.Errorf("handler panicked: %v", p)
		}
	}()
	return s.h(ctx, m)
}

// decodeState decodes a state column. Numbers stay json.Number so that large integers survive
// the round trip unchanged.
func decodeState(raw []byte) (map[string]any, error) {
	state := map[string]any{}
	if len(raw) == 0 {
		return state, nil
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	if err := dec.Decode(&state); err != nil {
		return nil, fmt.Errorf("decode state %.100s: %w", raw, err)
	}
	if state == nil { // JSON null
		state = map[string]any{}
	}
	return state, nil
}

// formatReplies renders the status lines of a batch.
func formatReplies(replies []reply) []byte {
	var b bytes.Buffer
	for _, r := range replies {
		if r.ok {
			b.WriteString("0")
			if r.words != "" {
				b.WriteString(" " + r.words)
			}
			b.WriteByte('\n')
			continue
		}
		b.WriteString("1 ")
		b.WriteString(oneLine(r.reason))
		b.WriteByte('\n')
	}
	return b.Bytes()
}

// oneLine makes a reason fit a status line: no line breaks or other control characters, at
// most maxReason bytes, cut on a rune boundary.
func oneLine(s string) string {
	s = strings.Map(func(r rune) rune {
		if r < ' ' || r == 0x7f {
			return ' '
		}
		return r
	}, s)
	s = strings.TrimSpace(s)
	if s == "" {
		s = "failed"
	}
	if len(s) > maxReason {
		cut := maxReason - len("...")
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + "..."
	}
	return s
}

// Message is one message handed to the handler: its row as it was when the batch began, and
// the transaction its outcome commits in.
type Message struct {
	// ID is the row's workqueue_id.
	ID int64

	// Stage is the stage running it (Config.Stage).
	Stage string

	// Attempts counts the failed attempts so far (the dispatcher increments it on failure).
	Attempts int

	// Payload is the row's payload, set at enqueue and never changed by pepsi; nil for NULL.
	Payload json.RawMessage

	// State is the row's state jsonb, decoded (numbers as json.Number). The handler changes it
	// freely; the outcome writes it back, in the same UPDATE. Changes made after the outcome
	// was chosen are not written. The dispatcher owns the key "dispatch_error".
	State map[string]any

	// Tx is the transaction the outcome commits in. The handler may use it for its own writes:
	// they commit with the outcome, and a failure of the message rolls them back (a savepoint
	// is taken before its first statement). The handler must not Commit or Roll it back, must
	// close the rows it opens before returning, and must not cancel the context of a query on
	// it (lib/pq closes the connection to cancel a query, which ends the process).
	Tx *sql.Tx

	ctx context.Context
	srv *server

	// Set by Serve's goroutine before and after the handler runs; used by the handler's
	// goroutine in between. A Message's methods are not safe for concurrent use.
	live     bool        // the handler is running: an outcome may be chosen
	chosen   string      // the outcome chosen, "" while none
	second   string      // a further outcome attempted
	writeErr error       // the chosen outcome's write failed
	kept     *keptChange // an outcome waiting for the batch's outcome statement
}

// change is what Advance, Done or Defer set besides the state.
type change struct {
	what    string // for reasons: "advance to b", "done", "defer until …"
	stage   string // "" keeps the stage
	status  string
	retryAt string // a timestamptz in text, "" keeps retry_at
}

// keptChange is an outcome chosen before the handler sent any statement, with the state as it
// was when it was chosen.
type keptChange struct {
	change change
	state  []byte
}

// Advance moves the message to stage next, which must be one of the stage's NEXT stages:
// stage = next, status = 'pending', and the state, in one UPDATE guarded by the claim.
//
// It returns an error for a stage not in NEXT, a second outcome, or a failed write. When the
// handler has not used m.Tx yet, the write waits for the end of the batch (see the package
// documentation), and a claim found lost then fails the message after the handler returned;
// either way the state written is the state as it was when Advance was called.
func (m *Message) Advance(next string) error {
	if !slices.Contains(m.srv.cfg.Next, next) {
		return fmt.Errorf("advance message %d to %q: %w (NEXT of %s: %q)",
			m.ID, next, ErrNotNext, m.Stage, strings.Join(m.srv.cfg.Next, " "))
	}
	return m.choose(change{what: "advance to " + next, stage: next, status: "pending"})
}

// Done finishes the message: status = 'done', and the state, in one UPDATE guarded by the
// claim. Errors and timing as for Advance.
func (m *Message) Done() error {
	return m.choose(change{what: "done", status: "done"})
}

// Defer pauses the message until the given time: status = 'paused', retry_at = until, and the
// state, in one UPDATE guarded by the claim. The dispatcher puts it back to pending at this
// stage when it is due. A deferral is not a failure: attempts is unchanged. Errors and timing
// as for Advance.
func (m *Message) Defer(until time.Time) error {
	return m.choose(change{
		what:    "defer until " + until.Format(time.RFC3339),
		status:  "paused",
		retryAt: until.UTC().Format("2006-01-02 15:04:05.999999Z07:00"),
	})
}

// choose is Advance, Done and Defer: the outcome is written at once when the message's
// savepoint is open (the handler has used m.Tx), and kept for the batch's outcome statement
// otherwise.
func (m *Message) choose(c change) error {
	return m.outcomeNamed(m.ctx, c.what, func(tx *sql.Tx) error {
		state, err := m.stateJSON()
		if err != nil {
			return fmt.Errorf("%s message %d: encode state: %w", c.what, m.ID, err)
		}
		if !m.srv.sess.isOpen() {
			m.kept = &keptChange{change: c, state: state}
			return nil
		}
		return m.update(m.ctx, tx, c, state)
	})
}

// outcome records that the handler chose an outcome and runs write in m.Tx; it fails if an outcome was already chosen.
//
// It is the one door to a message's outcome, for the outcomes of this file and of the other
// files of the package (fan-out splits). write runs at once, inside the message's savepoint
// (the session opens it before write's first statement), so a later failure of the handler
// rolls it back. write must change the row in one statement guarded by
// `workqueue_id = m.ID AND status = 'running' AND stage = m.Stage`, write the state (m.stateJSON)
// in it, and return an error wrapping ErrClaimLost when that statement changes no row. An error
// from write fails the message even if the handler then returns nil.
func (m *Message) outcome(ctx context.Context, write func(tx *sql.Tx) error) error {
	return m.outcomeNamed(ctx, "an outcome", write)
}

// outcomeNamed is outcome with a description of the outcome, for the reasons of failures.
func (m *Message) outcomeNamed(ctx context.Context, what string, write func(tx *sql.Tx) error) error {
	if !m.live {
		return fmt.Errorf("%s for message %d: %w", what, m.ID, ErrHandlerDone)
	}
	if m.chosen != "" {
		if m.second == "" {
			m.second = what
		}
		return fmt.Errorf("%s for message %d: %w (%s)", what, m.ID, ErrOutcomeChosen, m.chosen)
	}
	m.chosen = what
	if err := write(m.Tx); err != nil {
		m.writeErr = err
		return err
	}
	return nil
}

// stateJSON encodes the state for the outcome's UPDATE.
func (m *Message) stateJSON() ([]byte, error) {
	if m.State == nil {
		return []byte("{}"), nil
	}
	return json.Marshal(m.State)
}

// update writes one outcome: the guarded UPDATE, sent as one simple-protocol request together
// with the savepoint when it is not open yet. Hence the literals: a parameterised statement
// needs the extended protocol, which cannot carry two statements. The values are an integer,
// stage names checked against [a-z0-9_-]+, a timestamp and the state's JSON, each quoted by
// pq.QuoteLiteral (the E'...' form when there are backslashes, so that the quoting does not
// depend on standard_conforming_strings).
func (m *Message) update(ctx context.Context, tx *sql.Tx, c change, state []byte) error {
	set := "status = " + pq.QuoteLiteral(c.status)
	if c.stage != "" {
		// An advance resets attempts: MAX_ATTEMPTS counts failures at one stage.
		set += ", stage = " + pq.QuoteLiteral(c.stage) + ", attempts = 0"
	}
	if c.retryAt != "" {
		set += ", retry_at = " + pq.QuoteLiteral(c.retryAt) + "::timestamptz"
	}
	q := m.srv.sess.savepointPrefix() +
		"UPDATE workqueue SET " + set + ", state = " + pq.QuoteLiteral(string(state)) + "::jsonb" +
		" WHERE workqueue_id = " + strconv.FormatInt(m.ID, 10) +
		" AND status = 'running' AND stage = " + pq.QuoteLiteral(m.Stage)
	res, err := tx.ExecContext(ctx, q)
	if err != nil {
		return fmt.Errorf("%s message %d: %w", c.what, m.ID, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return fmt.Errorf("%s message %d: rows affected: %w", c.what, m.ID, err)
	}
	if n == 0 {
		return fmt.Errorf("%s message %d: row is no longer running at stage %s: %w",
			c.what, m.ID, m.Stage, ErrClaimLost)
	}
	return nil
}

// session is the state of the worker's one connection that the driver wrapper needs: which
// message's savepoint is open, whether a handler is running, and whether the connection is
// gone. Its fields are guarded by mu, because a handler may use m.Tx from goroutines of its
// own; Serve's goroutine is the only other user.
type session struct {
	mu         sync.Mutex
	conn       *wrappedConn // the one connection, nil before it is made
	refused    bool         // database/sql asked for a second connection: the first is lost
	inHandler  bool         // a handler is running: its statements need the savepoint
	cur        string       // the savepoint name of the current message
	open       bool         // cur is established
	last       string       // the newest savepoint still on the stack, released before the next
	broken     error        // a savepoint statement failed: the batch transaction is unusable
	txOwned    bool         // the handler tried to commit or roll back m.Tx
	statements int64        // requests sent on the connection (tests count round trips with it)
}

func (s *session) beginTx() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.last, s.cur, s.open, s.broken = "", "", false, nil
}

func (s *session) startMessage(index int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cur = "pepsi_msg_" + strconv.Itoa(index)
	s.open = false
	s.inHandler = true
}

// startSavepoint names the savepoint that the SDK's next statement opens (savepointPrefix).
func (s *session) startSavepoint(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cur, s.open = name, false
}

// isOpen reports whether the current message's savepoint is open: it has sent a statement.
func (s *session) isOpen() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.open
}

func (s *session) endMessage() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.inHandler = false
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

// savepointPrefix returns the statements that open the current message's savepoint, to be
// sent in the same request as the caller's statement, and records it as open; "" when it is
// open already. Should the request fail before the savepoint is made, ROLLBACK TO it fails
// too, and the batch ends: nothing is ever rolled back to the wrong savepoint, because each
// message's has its own name.
func (s *session) savepointPrefix() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.savepointPrefixLocked()
}

func (s *session) savepointPrefixLocked() string {
	if s.open || s.cur == "" {
		return ""
	}
	var b strings.Builder
	if s.last != "" {
		// Released, the previous message's subtransaction merges into the batch and the
		// savepoint stack stays one deep.
		b.WriteString("RELEASE SAVEPOINT " + s.last + "; ")
	}
	b.WriteString("SAVEPOINT " + s.cur + "; ")
	s.open, s.last = true, s.cur
	return b.String()
}

// beforeStatement opens the current message's savepoint before a handler's first statement.
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
		s.broken = fmt.Errorf("open savepoint %s: %w", s.cur, err)
		return s.broken
	}
	return nil
}

// rollbackMessage undoes what the current message wrote, if it wrote anything.
func (s *session) rollbackMessage(ctx context.Context, tx *sql.Tx) error {
	s.mu.Lock()
	open, name, broken := s.open, s.cur, s.broken
	s.mu.Unlock()
	if broken != nil {
		return broken
	}
	if !open {
		return nil // the message sent nothing: there is nothing to undo
	}
	if _, err := tx.ExecContext(ctx, "ROLLBACK TO SAVEPOINT "+name); err != nil {
		return fmt.Errorf("roll back to savepoint %s: %w", name, err)
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
	c.sess.conn = &wrappedConn{inner: pc, sess: c.sess}
	return c.sess.conn, nil
}

func (c *onceConnector) Driver() driver.Driver { return c.pq.Driver() }

// pqConn is what lib/pq's connection implements and database/sql looks for.
type pqConn interface {
	driver.Conn
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

func (c *wrappedConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	c.sess.mu.Lock()
	c.sess.statements++
	c.sess.mu.Unlock()
	tx, err := c.inner.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &wrappedTx{inner: tx, sess: c.sess}, nil
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

// wrappedTx refuses Commit and Rollback while a handler runs: the batch transaction is the SDK's.
type wrappedTx struct {
	inner driver.Tx
	sess  *session
}

func (t *wrappedTx) Commit() error {
	if t.refuse() {
		return errTxOwned
	}
	return t.inner.Commit()
}

func (t *wrappedTx) Rollback() error {
	if t.refuse() {
		return errTxOwned
	}
	return t.inner.Rollback()
}

func (t *wrappedTx) refuse() bool {
	t.sess.mu.Lock()
	defer t.sess.mu.Unlock()
	if t.sess.inHandler {
		t.sess.txOwned = true
		return true
	}
	t.sess.statements++
	return false
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
