// stage.go: the stage SDK: configuration, the serving loop, messages and their outcomes, and
// stage fusion (the stages run in the pass of another's message). The wrapper around the
// worker's one database connection, which takes savepoints lazily, is conn.go's.
//
// It owns the worker's side of the protocol of doc.go: the reading of ids, the batch transaction
// and the status lines. It writes only the rows it was handed, and only under the guard
// status = 'running' AND stage = <the stage the row is running at in the transaction: the
// claimed one, or a fused one it moved the row to>; failures are the dispatcher's to record.

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
	"maps"
	"os"
	"regexp"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/lib/pq"
)

const (
	// maxSubxids caps the savepoints a batch's transaction opens. Every savepoint that writes
	// takes a subtransaction XID, and PostgreSQL caches at most 64 of those per backend
	// (PGPROC_MAX_CACHED_SUBXIDS); past that the backend's snapshot entry overflows and every
	// snapshot in the cluster gets slower. A message's pass opens at most one savepoint per
	// stage it runs, so a batch takes no further message once the next one could overflow.
	maxSubxids = 64

	// maxBatch caps the ids read for one batch. Messages whose handlers leave Message.Tx
	// alone take no savepoint (their outcomes are written by one statement after the
	// transaction), so only this and maxBatchTime bound such a batch: a bigger batch costs
	// fewer statements per message. After a batch that wrote, a read takes only as many ids
	// as maxSubxids allows, so that the ids left over are not loaded twice.
	maxBatch = 256

	// maxBatchTime is how long a batch takes new messages: its replies come after its last
	// message, and MAX_RUNTIME counts for the first from when the previous batch answered.
	maxBatchTime = 100 * time.Millisecond

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
// Handlers run one at a time, in the order of the ids; a fused stage's handler runs right
// after the handler whose advance led to it (see ServeStages).
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

	// MaxChildren and MinSpan are the stage's MAX_CHILDREN and MIN_SPAN (PEPSI_MAX_CHILDREN,
	// PEPSI_MIN_SPAN): SplitRange's defaults when its RangeOpts leave them 0. 0 here means
	// the defaults of fanin.md (MaxChildrenDefault, MinSpanDefault).
	MaxChildren int
	MinSpan     int64

	// Fuse lists the stages that may run in the pass of a message of Stage (stage fusion,
	// PEPSI_FUSE): every FUSE = yes stage reachable from Stage through NEXT links to FUSE = yes
	// stages, mapped to its own NEXT list (empty for a final stage). A program serving several
	// stages (ServeStages) runs those it has a handler for in the same transaction as the
	// advance that leads to them; the others, and every stage with Serve, are advanced to as
	// usual. nil: no fusion. Names are [a-z0-9_-]+. Set it before Serve; it is not changed.
	Fuse map[string][]string

	// hooks lets this package's tests observe a session; nil in every other use.
	hooks *testHooks
}

// testHooks are the package tests' view into a running Serve.
type testHooks struct {
	// session receives the session once it is connected.
	session func(s *session)
	// batchTime replaces maxBatchTime when it is not 0.
	batchTime time.Duration
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
	for name, next := range c.Fuse {
		if !stageName.MatchString(name) {
			return fmt.Errorf("fused stage name %q: want [a-z0-9_-]+", name)
		}
		for _, n := range next {
			if !stageName.MatchString(n) {
				return fmt.Errorf("fused stage %s: next stage name %q: want [a-z0-9_-]+", name, n)
			}
		}
	}
	return nil
}

// parseFuse parses PEPSI_FUSE: entries separated by spaces, each STAGE=NEXT1,NEXT2 with the
// stage's NEXT list separated by commas, possibly empty ("deliver="). Nothing at all is no
// fusion (nil). A stage listed twice, an empty name or a name that is not [a-z0-9_-]+ is an
// error: the dispatcher never writes one, so it is a stage started by something else.
func parseFuse(text string) (map[string][]string, error) {
	entries := strings.Fields(text)
	if len(entries) == 0 {
		return nil, nil
	}
	fuse := make(map[string][]string, len(entries))
	for _, e := range entries {
		name, list, ok := strings.Cut(e, "=")
		if !ok {
			return nil, fmt.Errorf("PEPSI_FUSE entry %q: want STAGE=NEXT1,NEXT2 (STAGE= for a final stage)", e)
		}
		if !stageName.MatchString(name) {
			return nil, fmt.Errorf("PEPSI_FUSE entry %q: stage name %q: want [a-z0-9_-]+", e, name)
		}
		if _, dup := fuse[name]; dup {
			return nil, fmt.Errorf("PEPSI_FUSE entry %q: stage %s is listed twice", e, name)
		}
		next := []string{}
		if list != "" {
			for _, n := range strings.Split(list, ",") {
				if !stageName.MatchString(n) {
					return nil, fmt.Errorf("PEPSI_FUSE entry %q: next stage name %q: want [a-z0-9_-]+", e, n)
				}
				next = append(next, n)
			}
		}
		fuse[name] = next
	}
	return fuse, nil
}

// LoadConfig parses `[-c FILE] worker` (os.Args[1:]) and reads PEPSI_STAGE, PEPSI_NEXT,
// PEPSI_FUSE and PEPSI_DSN from the environment. Programs that need the configuration before
// serving call it and then Serve (or ServeStages); the others just call Run (or RunStages).
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
	for _, v := range []struct {
		name string
		set  func(int64)
	}{
		{"PEPSI_MAX_CHILDREN", func(n int64) { cfg.MaxChildren = int(n) }},
		{"PEPSI_MIN_SPAN", func(n int64) { cfg.MinSpan = n }},
	} {
		if text := getenv(v.name); text != "" {
			n, err := strconv.ParseInt(text, 10, 32)
			if err != nil || n < 1 {
				return Config{}, fmt.Errorf("read environment: %s = %q: want a positive whole number", v.name, text)
			}
			v.set(n)
		}
	}
	if cfg.DSN == "" {
		return Config{}, errors.New("read environment: PEPSI_DSN is not set (a stage is started by pepsi-dispatch)")
	}
	fuse, err := parseFuse(getenv("PEPSI_FUSE"))
	if err != nil {
		return Config{}, fmt.Errorf("read environment: %w", err)
	}
	cfg.Fuse = fuse
	if err := cfg.validate(); err != nil {
		return Config{}, fmt.Errorf("read environment: %w", err)
	}
	return cfg, nil
}

// Run is a stage program's main: it parses `[-c FILE] worker` from os.Args, reads PEPSI_STAGE,
// PEPSI_NEXT (space-separated), PEPSI_FUSE and PEPSI_DSN from the environment, connects once
// and serves os.Stdin/os.Stdout until EOF with h as the handler of PEPSI_STAGE; it exits the
// process (0 after EOF, non-zero on a fatal error such as a lost database connection, with the
// reason on stderr). A program with one handler runs no fused stage: see RunStages.
//
// Exit statuses: 0 after EOF on stdin, 2 for a usage or environment error, 1 for any other
// fatal error. Signals keep their default action: SIGTERM or SIGINT end the process at once,
// which is safe, because the batch in flight has not committed (PostgreSQL rolls it back when
// the connection drops) or has committed under the guard (the dispatcher's recovery writes
// are guarded too and leave a moved row alone).
func Run(h Handler) {
	oneProc(os.Getenv)
	os.Exit(run(context.Background(), os.Args[1:], os.Getenv, os.Stdin, os.Stdout, os.Stderr, nil, h))
}

// oneProc runs the worker process on one processor (runtime.GOMAXPROCS(1)) unless its
// environment sets GOMAXPROCS. A worker has one connection and runs one batch at a time, so
// it never has two goroutines ready at once; with a processor per core, the Go runtime wakes
// idle threads to look for work at every pipe and socket event, and on a machine whose cores
// PostgreSQL and the other workers share, those wake-ups cost throughput. Measured with the
// benchmark (2 cores, 8 and 24 workers): W1 from ~54,000 to ~63,000 transitions/s, W4 (three
// stages) from ~50,000 to ~64,000. Serve and ServeStages leave the runtime alone: they run
// inside programs (and tests) that own it.
func oneProc(getenv func(string) string) {
	if getenv("GOMAXPROCS") == "" {
		runtime.GOMAXPROCS(1)
	}
}

// RunStages is Run for a program that implements several stages: handlers maps stage names
// to their handlers. The process serves PEPSI_STAGE, whose handler is required (without one
// it exits 2, naming the stages it has), and runs the others that PEPSI_FUSE lists in the
// same pass, as ServeStages describes. The same program can be the PROGRAM of all those
// stages: the dispatcher starts it with the PEPSI_STAGE of each pool.
func RunStages(handlers map[string]Handler) {
	oneProc(os.Getenv)
	os.Exit(run(context.Background(), os.Args[1:], os.Getenv, os.Stdin, os.Stdout, os.Stderr, handlers, nil))
}

// run is Run (h set) and RunStages (handlers set) with their dependencies passed in; it
// returns the exit status.
func run(ctx context.Context, args []string, getenv func(string) string,
	stdin io.Reader, stdout, stderr io.Writer, handlers map[string]Handler, h Handler) int {
	cfg, err := loadConfig(args, getenv)
	if err != nil {
		fmt.Fprintf(stderr, "stage: %v\n", err)
		return 2
	}
	if h != nil {
		handlers = map[string]Handler{cfg.Stage: h}
	}
	if err := checkHandlers(cfg, handlers); err != nil {
		fmt.Fprintf(stderr, "stage %s: %v\n", cfg.Stage, err)
		return 2
	}
	if err := ServeStages(ctx, cfg, stdin, stdout, handlers); err != nil {
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
// Every id already available on in (up to 256; see maxBatch, maxSubxids, maxBatchTime) is run
// as one batch in one transaction, whose status lines are written together after the commit;
// see doc.go. Serve is ServeStages with
// h as the only handler, that of cfg.Stage: it fuses nothing.
func Serve(ctx context.Context, cfg Config, in io.Reader, out io.Writer, h Handler) error {
	return ServeStages(ctx, cfg, in, out, map[string]Handler{cfg.Stage: h})
}

// ServeStages is Serve for a program that implements several stages. handlers[cfg.Stage] is
// required and serves the messages on in; the handlers of the stages in cfg.Fuse are fused.
// Handlers of other stages are ignored: the program can be the PROGRAM of several stages and
// serve the one it is started for.
//
// Stage fusion. When a handler chooses Advance(Y), Y is in cfg.Fuse, handlers has Y and Y has
// not run in this pass yet, the SDK does not write the advance: it runs Y's handler at once,
// for the same message, in the same transaction, with a Message whose Stage is Y, Attempts 0,
// Payload the same, State as the advance would have written it, Tx the same, and whose Advance
// accepts Y's NEXT list (cfg.Fuse[Y]). Y's outcome becomes the message's: its Advance(Z) sets
// stage = Z, pending (or fuses Z in turn); its Done and Defer set stage = Y, so that the row
// says which stage finished or deferred it; a Split by Y makes the row wait at Y's continuation
// and ends the pass, as every outcome but a fused advance does. The row is claimed at cfg.Stage
// and still running there until the pass commits; every outcome of the pass keeps the guard of
// that claim (status = 'running' and the claimed stage). Before a fused stage's first
// statement on Tx, in the same request as its savepoint, the SDK moves the running row to that
// stage (stage = Y, attempts = 0, still running), so that inside its handler the row is
// running at m.Stage as for any other message, and guards written against m.Stage hold.
//
// If Y fails (an error, a panic, no outcome or two, a failed write of its outcome), what Y
// wrote is rolled back (to a savepoint taken before its first statement) and the advance to Y
// is written instead, as if Y were not fused: the stage that advanced succeeded, Y's pool
// claims the message as usual and fails it there if it must. The failure is logged on stderr,
// and is not on the status line. A status line's success report lists the fused stages that
// succeeded, with the running time of their handlers: `0 done fused=enrich:3,deliver:1`.
// To the dispatcher the whole pass is the claimed stage's: MAX_RUNTIME covers all of it, and
// a crash or a timeout during a fused stage fails the message at the claimed stage.
//
// Costs. A pass whose handlers leave Tx alone costs no request of its own: its one outcome
// joins the batch's outcome statement. A fused stage that uses Tx adds one request (its
// savepoint and the move of the row) besides its own statements, and its outcome is written
// at once. Each stage that writes takes a subtransaction; to keep a batch within the 64 that
// PostgreSQL caches per backend, a batch takes no further message once the next pass could
// take more, counting N+1 for a program that can fuse N stages.
func ServeStages(ctx context.Context, cfg Config, in io.Reader, out io.Writer, handlers map[string]Handler) error {
	if err := cfg.validate(); err != nil {
		return fmt.Errorf("check configuration: %w", err)
	}
	if err := checkHandlers(cfg, handlers); err != nil {
		return fmt.Errorf("check handlers: %w", err)
	}
	srv, err := connect(ctx, cfg, handlers)
	if err != nil {
		return err
	}
	defer srv.close()
	r := bufio.NewReaderSize(in, readBufferSize)
	var rest []string // ids read but not run: the last batch reached its budget before them
	for {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("serve: %w", err)
		}
		limit := maxBatch
		if srv.wrote {
			limit = max(1, maxSubxids/(1+len(srv.views)))
		}
		lines, eof, err := readBatch(r, rest, limit)
		if err != nil {
			return fmt.Errorf("read message ids: %w", err)
		}
		if len(lines) > 0 {
			var replies []byte
			replies, rest, err = srv.runBatch(ctx, lines)
			if err != nil {
				return err
			}
			// One write for the whole batch: the dispatcher reads all of it at once.
			if _, err := out.Write(replies); err != nil {
				return fmt.Errorf("write status lines: %w", err)
			}
		}
		if eof && len(rest) == 0 {
			return nil
		}
	}
}

// checkHandlers checks that handlers serve cfg.Stage and name only valid stages.
func checkHandlers(cfg Config, handlers map[string]Handler) error {
	for name, h := range handlers {
		if !stageName.MatchString(name) {
			return fmt.Errorf("handler for stage %q: want a name [a-z0-9_-]+", name)
		}
		if h == nil {
			return fmt.Errorf("handler for stage %s is nil", name)
		}
	}
	if handlers[cfg.Stage] == nil {
		names := slices.Sorted(maps.Keys(handlers))
		return fmt.Errorf("this program has no handler for stage %s (it implements %q)", cfg.Stage, names)
	}
	return nil
}

// readBatch returns the lines in hand (have) and every further complete line that is already
// buffered, up to max, after waiting for one line when there are none in hand. Waiting for
// more would delay the replies of the lines in hand, and the dispatcher writes a worker's
// queue in one buffer, so one read brings in all of it. A last line without a newline before
// EOF counts as a line.
func readBatch(r *bufio.Reader, have []string, max int) (lines []string, eof bool, err error) {
	lines = have
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
//
// A fused stage's messages see a view of it: a copy whose cfg has that stage's Stage and Next
// (its Fuse entry), whose h is its handler and whose log names it; the other fields are the
// same pointers. Batches run on the server itself, whose cfg.Stage is the claim's stage.
type server struct {
	cfg   Config
	h     Handler
	views map[string]*server // the fused stages this program implements; shared by the views
	db    *sql.DB
	sess  *session
	load  *sql.Stmt // prepared once, so a batch's load is one round trip
	log   *slog.Logger
	// wrote tells whether the last batch began a transaction: the next reads fewer ids.
	wrote bool
	// batchTime is maxBatchTime, or a test's.
	batchTime time.Duration

	fuseFailures int // a view's fused runs that failed, for rate-limited logging
}

const loadQuery = `SELECT workqueue_id, attempts, payload, state FROM workqueue
WHERE workqueue_id = ANY($1::bigint[]) AND status = 'running' AND stage = $2`

// connect opens the worker's one connection, prepares the load statement and makes the views
// of the fused stages that handlers implement.
func connect(ctx context.Context, cfg Config, handlers map[string]Handler) (*server, error) {
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
	srv := &server{cfg: cfg, h: handlers[cfg.Stage], views: map[string]*server{}, db: db, sess: sess,
		log: slog.Default().With("stage", cfg.Stage), batchTime: maxBatchTime}
	if cfg.hooks != nil && cfg.hooks.batchTime != 0 {
		srv.batchTime = cfg.hooks.batchTime
	}
	if err := db.PingContext(ctx); err != nil {
		db.Close()
		return nil, fmt.Errorf("connect to the database: %w", err)
	}
	if srv.load, err = db.PrepareContext(ctx, loadQuery); err != nil {
		db.Close()
		return nil, fmt.Errorf("prepare load statement: %w", err)
	}
	for name, next := range cfg.Fuse {
		h := handlers[name]
		if h == nil || name == cfg.Stage {
			continue // not implemented here, or the claim's own stage (a cycle): advanced to as usual
		}
		v := *srv
		v.cfg.Stage, v.cfg.Next, v.h = name, next, h
		v.log = slog.Default().With("stage", name, "fused_into", cfg.Stage)
		srv.views[name] = &v
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
	final  *Message   // on success: the message whose outcome stands, the last stage of the pass
	fused  []*Message // on success: the fused stages that succeeded, in the order they ran
	reason string     // why it failed, when !ok
	done   bool       // decided (bad id, claim lost) before the handler would run
}

func (r *reply) fail(reason string) { r.ok, r.reason, r.done = false, reason, true }

// fallBackTo makes m, an earlier stage of the pass, the one whose outcome stands: the fused
// stages after it are no longer reported.
func (r *reply) fallBackTo(m *Message) {
	r.final = m
	for i, f := range r.fused {
		if f == m {
			r.fused = r.fused[:i+1]
			return
		}
	}
	r.fused = nil
}

// words returns what follows "0 " on a success line: "done" when the message finished
// (dispatch_stats.done), and fused=STAGE:MS,… for the fused stages (stage_stats.fused and
// busy_ms of each), separated by single spaces; "" for neither.
func (r *reply) words() string {
	var words []string
	if r.final != nil && r.final.chosen == "done" {
		words = append(words, "done")
	}
	if len(r.fused) > 0 {
		runs := make([]string, len(r.fused))
		for i, f := range r.fused {
			runs[i] = f.Stage + ":" + strconv.FormatInt(f.link.took.Milliseconds(), 10)
		}
		words = append(words, "fused="+strings.Join(runs, ","))
	}
	return strings.Join(words, " ")
}

// runBatch runs the messages of lines in one transaction (or none) and returns their status
// lines and the lines it left for the next batch (see runTx), or a fatal error (the connection
// is gone; nothing is to be written then: the dispatcher treats the exit as a crash and puts
// the rows back).
//
// The design, and its round trips. Commits are the expensive part (one WAL flush each), so the
// batch has one. Within it, a message's work must be undoable alone, which takes a savepoint
// (a subtransaction) — but only for a message that sends statements of its own. So:
//
//   - The savepoint is lazy: the connection wrapper opens it in front of the handler's first
//     statement on m.Tx (or in the same request as an outcome written at once).
//   - The outcome of a handler that has sent nothing when it chooses Advance, Done or Defer is
//     not written at once but kept, with the state as it was then; after the handler returns
//     nil it joins the batch's one outcome statement (see writeOutcomes), which runs after the
//     transaction. Such a message has nothing of its own to undo or to commit with, so it
//     needs no savepoint and no transaction. If the handler sends a statement after choosing,
//     its outcome is written in its savepoint when it returns.
//   - A fused stage (ServeStages) is one more link of the message's pass, with a lazy
//     savepoint of its own (nested in its predecessor's when that one is open), opened
//     together with the move of the row to its stage. An advance that leads to it is always
//     kept, so that it can be dropped when the fused stage succeeds and written when it fails.
//   - The transaction is lazy as well (conn.go): BEGIN goes out with the first savepoint. A
//     batch that needs none runs its load and its outcome statement as two statements of their
//     own, each atomic; nothing is held between them that a transaction would have held (the
//     load locks nothing, and READ COMMITTED gives each statement its own snapshot).
//   - So only the messages that write take savepoints, and the batch is bounded by those: it
//     takes no further message once the next could open more than maxSubxids. Messages that
//     do not write make batches of up to maxBatch; no batch takes messages past maxBatchTime.
//
// Requests per batch of N messages whose handlers leave m.Tx alone: the load and the outcome
// statement — 2, whatever N is and whatever they fuse. A handler that uses m.Tx adds one
// request for BEGIN (the first in the batch only) and its SAVEPOINT, its own statements, its
// outcome UPDATE, and the COMMIT at the end. A failed message that wrote adds a ROLLBACK TO.
// Writing every outcome at once in its own savepoint (the simple way) would cost N + 3
// requests, N statements to parse and plan, and N subtransaction XIDs per batch.
func (s *server) runBatch(ctx context.Context, lines []string) (out []byte, rest []string, err error) {
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
		return formatReplies(replies), nil, nil
	}
	ran, err := s.runTx(ctx, replies, ids)
	if err != nil {
		if ctx.Err() != nil {
			return nil, nil, fmt.Errorf("run batch of %d ids: %w", len(ids), ctx.Err())
		}
		if errors.Is(err, ErrConnectionLost) || errors.Is(err, errTxOwned) {
			return nil, nil, fmt.Errorf("run batch of %d ids: %w", len(ids), err)
		}
		if s.sess.lost() {
			return nil, nil, fmt.Errorf("run batch of %d ids: %w (%w)", len(ids), err, ErrConnectionLost)
		}
		// The transaction is gone with everything in it: every message it ran fails,
		// including those whose handler succeeded.
		for i := range replies[:ran] {
			if !replies[i].done { // a failure already decided keeps its own reason
				replies[i].fail(err.Error())
			}
		}
	}
	return formatReplies(replies[:ran]), lines[ran:], nil
}

// runTx is one batch: the load, the messages of replies in order, the transaction's COMMIT if
// a handler began one, then the kept outcomes in one statement of their own. It fills
// replies[:ran]; the messages after those are for the next batch: the next one could have
// taken more savepoints than maxSubxids allows, or the batch had run for batchTime.
//
// An error means that the transaction was rolled back (or is lost) and every message run
// fails with it; nothing of the batch is written then, because the kept outcomes come last,
// after the COMMIT, and fail only their own messages (or end the process, should the
// connection break).
func (s *server) runTx(ctx context.Context, replies []reply, ids []int64) (ran int, err error) {
	start := time.Now()
	ran = len(replies)
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return ran, fmt.Errorf("begin batch transaction: %w", err)
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
		return ran, err
	}
	var kept []keptOutcome
	perPass := 1 + len(s.views) // savepoints a message's pass may open
	for i := range replies {
		r := &replies[i]
		if r.done {
			continue
		}
		if i > 0 && (s.sess.savepointsOpened()+perPass > maxSubxids || time.Since(start) >= s.batchTime) {
			ran = i
			break
		}
		row, ok := rows[r.id]
		if !ok {
			r.fail(fmt.Sprintf("message %d is not running at stage %s (claim lost)", r.id, s.cfg.Stage))
			continue
		}
		delete(rows, r.id) // the same id twice in a batch finds its claim taken the second time
		final, fused, reason, err := s.runMessage(ctx, tx, i, row)
		if err != nil {
			return ran, err
		}
		if reason != "" {
			r.fail(reason)
			continue
		}
		r.ok, r.final, r.fused = true, final, fused // unless the outcome statement finds the claim gone
		if final.kept != nil {
			kept = append(kept, keptOutcome{index: i, m: final})
		}
	}
	s.wrote = s.sess.began()
	if err := tx.Commit(); err != nil {
		return ran, fmt.Errorf("commit batch transaction: %w", err)
	}
	if len(kept) > 0 {
		if err := s.writeOutcomes(ctx, kept, replies); err != nil {
			// Only a lost connection or the end of ctx gets here (any other failure fails its
			// messages): the process ends without replies, and the dispatcher recovers the
			// rows whose outcomes it does not find written.
			if ctx.Err() == nil {
				err = fmt.Errorf("%w (%w)", err, ErrConnectionLost)
			}
			return ran, fmt.Errorf("write %d outcomes: %w", len(kept), err)
		}
	}
	return ran, nil
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

// runMessage runs one loaded row's pass: the handler of the claimed stage, inside its own
// (lazy) savepoint, and the fused stages its advance leads to. It returns the message whose
// outcome stands (written, or kept for the outcome statement), the fused stages that
// succeeded, and the reason the message failed ("" for success), or an error that ends the
// batch.
func (s *server) runMessage(ctx context.Context, tx *sql.Tx, index int, row loadedRow) (
	final *Message, fused []*Message, reason string, err error) {
	m := &Message{
		ID:       row.id,
		Stage:    s.cfg.Stage,
		Attempts: row.attempts,
		Tx:       tx,
		ctx:      ctx,
		srv:      s,
		live:     true,
		link:     link{index: index, chain: []string{s.cfg.Stage}, at: s.cfg.Stage},
	}
	if row.payload != nil {
		m.Payload = json.RawMessage(row.payload)
	}
	if m.State, err = decodeState(row.state); err != nil {
		// A state that is not an object is nothing the handler could work with; its outcome
		// would overwrite it. Fail the message and let an operator look.
		return m, nil, fmt.Sprintf("message %d: %v", row.id, err), nil
	}
	s.sess.setLink(spLink{name: "pepsi_msg_" + strconv.Itoa(index)})
	return s.runLink(ctx, tx, m)
}

// runLink runs m's handler, in the savepoint context the caller has set (the session's link),
// and settles its outcome: a fused stage runs next (runFused), or the outcome is written at
// once when the pass has written anything, or it stays kept for the outcome statement. A
// failure rolls back m's savepoint. It returns what runMessage does, for the pass from m on.
func (s *server) runLink(ctx context.Context, tx *sql.Tx, m *Message) (
	final *Message, fused []*Message, reason string, err error) {
	s.sess.handlerRunning(true)
	start := time.Now()
	herr := m.srv.callHandler(ctx, m)
	m.link.took = time.Since(start)
	s.sess.handlerRunning(false)
	m.live = false

	if s.sess.txOwnedViolation() {
		return m, nil, "", fmt.Errorf("message %d: %w", m.ID, errTxOwned)
	}
	if err := s.sess.brokenErr(); err != nil {
		return m, nil, "", err
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
	}
	if reason == "" && m.kept != nil && m.fusable(m.kept.change) {
		f, fz, err := s.runFused(ctx, tx, m)
		if err != nil {
			return m, nil, "", err
		}
		if f != nil {
			if m.link.prev != nil {
				fz = append([]*Message{m}, fz...)
			}
			return f, fz, "", nil
		}
		// The fused stage failed and is undone: the advance to it stands, settled below.
	}
	if reason == "" && m.kept != nil && (m.link.nested || s.sess.isOpen()) {
		// The pass has written: the outcome goes with the writes, in this stage's savepoint
		// (which the UPDATE's request opens if need be, moving a fused stage's row first).
		k := m.kept
		m.kept = nil
		if err := m.update(ctx, tx, k.change, k.state, m.Stage); err != nil {
			reason = err.Error()
		}
	}
	if reason != "" {
		m.kept = nil
		if err := s.sess.rollbackMessage(ctx, tx); err != nil {
			return m, nil, "", err
		}
		return m, nil, reason, nil
	}
	if m.link.prev != nil {
		fused = []*Message{m}
	}
	return m, fused, "", nil
}

// runFused runs the stage that m's kept advance leads to, in the same pass (stage fusion, see
// ServeStages). It returns the message whose outcome stands and the fused stages that
// succeeded, from that stage on; nil when the stage failed: its writes are rolled back, the
// session is back in m's savepoint context, and m's advance is the outcome. An error ends the
// batch.
func (s *server) runFused(ctx context.Context, tx *sql.Tx, m *Message) (final *Message, fused []*Message, err error) {
	next := m.kept.change.stage
	view := m.srv.views[next]
	state, err := decodeState(m.kept.state)
	if err != nil { // cannot happen: json.Marshal wrote it; not worth failing the advance for
		view.noteFailure(m.ID, err.Error())
		return nil, nil, nil
	}
	var payload json.RawMessage
	if m.Payload != nil {
		payload = bytes.Clone(m.Payload) // a handler may scribble on its copy
	}
	saved := s.sess.currentLink()
	at := m.link.at // the stage the row is at in the transaction: moved by every link that wrote
	if saved.open {
		at = m.Stage
	}
	y := &Message{
		ID:      m.ID,
		Stage:   next,
		Payload: payload,
		State:   state,
		Tx:      tx,
		ctx:     ctx,
		srv:     view,
		live:    true,
		link: link{
			index:  m.link.index,
			prev:   m,
			chain:  append(slices.Clip(m.link.chain), next),
			at:     at,
			nested: m.link.nested || saved.open,
		},
	}
	s.sess.setLink(spLink{
		name:   "pepsi_msg_" + strconv.Itoa(m.link.index) + "_" + strconv.Itoa(len(y.link.chain)-1),
		nested: y.link.nested,
		move: "UPDATE workqueue SET stage = " + pq.QuoteLiteral(next) + ", attempts = 0" +
			" WHERE workqueue_id = " + strconv.FormatInt(m.ID, 10) +
			" AND status = 'running' AND stage = " + pq.QuoteLiteral(at),
	})
	final, fused, reason, err := s.runLink(ctx, tx, y)
	if err != nil {
		return nil, nil, err
	}
	if reason == "" {
		return final, fused, nil
	}
	view.noteFailure(m.ID, reason)
	s.sess.setLink(saved)
	return nil, nil, nil
}

// noteFailure logs that this view's fused stage failed for message id, at a limited rate:
// the first three of a run, then one in each power of ten. The dispatcher never sees such a
// failure; it sees the message again at this stage, where a real failure is counted.
func (s *server) noteFailure(id int64, reason string) {
	s.fuseFailures++
	n := s.fuseFailures
	if n > 3 && !isPowerOfTen(n) {
		return
	}
	s.log.Warn("fused stage failed; the message is advanced to it instead", "message", id,
		"reason", oneLine(reason), "fused_failures", n)
}

func isPowerOfTen(n int) bool {
	for n >= 10 && n%10 == 0 {
		n /= 10
	}
	return n == 1
}

// keptOutcome is a message whose outcome waits for the batch's outcome statement.
type keptOutcome struct {
	index int // in the batch's replies
	m     *Message
}

// outcomeStatement is the statement that writes a batch's kept outcomes, one array element per
// message: ids, the stages they advance to (NULL: they stay), statuses, retry_at (NULL:
// unchanged), states; guard is the claimed stage. An advance resets attempts: MAX_ATTEMPTS
// counts failures at one stage, not across them.
//
// Its shape is for the planner. The rows are found by primary key only (= ANY ids), and matched
// to their values by a hash join. The guard is compared in a join with a one-row subquery
// behind OFFSET 0, so that the planner does not estimate the running rows from the column
// statistics: those were taken while the rows were pending, and say "1 row". With the guard in
// the WHERE clause and a batch of 256, a plan that took that 1 row at its word scanned the
// whole table and compared each running row with every element (179 ms instead of 3 ms for
// 256 outcomes with 2,048 rows running in a table of 33,000).
//
// And the arrays are literals, sent as one simple-protocol request: the planner then knows
// their lengths and plans the statement for this batch. A prepared statement's generic plan
// guesses 10 elements, and on a table of 1.2 million rows chose to compare every row with
// every element (65,280 comparisons for 256 outcomes). Planning costs about 1 ms per batch,
// 4 µs per outcome. TestOutcomePlan checks the plans.
func outcomeStatement(ids []int64, stages []sql.NullString, statuses []string, retryAts []sql.NullString,
	states []string, guard string) (string, error) {
	var lits [5]string
	for i, a := range []driver.Valuer{pq.Array(ids), pq.GenericArray{A: stages}, pq.Array(statuses),
		pq.GenericArray{A: retryAts}, pq.Array(states)} {
		v, err := a.Value()
		if err != nil {
			return "", fmt.Errorf("outcome statement: encode array %d: %w", i+1, err)
		}
		text, ok := v.(string) // lib/pq's arrays encode as text; a nil slice as NULL
		if !ok {
			return "", fmt.Errorf("outcome statement: array %d encodes as %T, not text", i+1, v)
		}
		lits[i] = pq.QuoteLiteral(text)
	}
	return `UPDATE workqueue AS w SET stage = coalesce(v.stage, w.stage), status = v.status,
       attempts = CASE WHEN v.stage IS NULL THEN w.attempts ELSE 0 END,
       retry_at = coalesce(v.retry_at, w.retry_at), state = v.state
  FROM unnest(` + lits[0] + `::bigint[], ` + lits[1] + `::text[], ` + lits[2] + `::text[], ` +
		lits[3] + `::timestamptz[], ` + lits[4] + `::jsonb[])
       AS v (id, stage, status, retry_at, state),
       (SELECT 'running'::text AS status, ` + pq.QuoteLiteral(guard) + `::text AS stage OFFSET 0) AS guard
 WHERE w.workqueue_id = ANY (` + lits[0] + `::bigint[]) AND w.workqueue_id = v.id
   AND w.status = guard.status AND w.stage = guard.stage
RETURNING w.workqueue_id`, nil
}

// writeOutcomes writes the kept outcomes in one statement (outcomeStatement), each row under the
// same guard as a single outcome, and fails the messages whose row it did not find. It runs
// after the batch's transaction, alone: a kept outcome has nothing to commit with (no stage of
// its pass wrote), and outside the transaction it takes no savepoint, so that the savepoints of
// the messages that write are all that maxSubxids has to count. Should the statement fail (say
// one state that jsonb rejects), nothing of it is written, and the outcomes are written one by
// one, so that one bad message fails alone. A kept outcome is that of the last stage of its
// pass; every row is still running at the claimed stage, which is the guard. One by one, an
// outcome of a fused stage that is refused for another reason than a lost claim falls back to
// the advance that led to that stage, as a failure of the fused stage's handler does.
//
// It returns an error only when the connection is lost or ctx is done.
func (s *server) writeOutcomes(ctx context.Context, kept []keptOutcome, replies []reply) error {
	s.sess.setLink(spLink{}) // no savepoint: there is no transaction
	if len(kept) == 1 {
		// One outcome: no list to parse and plan.
		return s.writeOutcome(ctx, kept[0], &replies[kept[0].index])
	}
	ids := make([]int64, len(kept))
	stages := make([]sql.NullString, len(kept))
	statuses := make([]string, len(kept))
	retryAts := make([]sql.NullString, len(kept))
	states := make([]string, len(kept))
	for i, k := range kept {
		c := k.m.kept.change
		ids[i] = k.m.ID
		stages[i] = sql.NullString{String: c.stage, Valid: c.stage != ""}
		statuses[i] = c.status
		retryAts[i] = sql.NullString{String: c.retryAt, Valid: c.retryAt != ""}
		states[i] = string(k.m.kept.state)
	}
	q, err := outcomeStatement(ids, stages, statuses, retryAts, states, s.cfg.Stage)
	var written map[int64]bool
	if err == nil {
		written, err = queryIDs(ctx, s.db, q)
	}
	if err != nil {
		if s.sess.lost() || ctx.Err() != nil {
			return err
		}
		s.log.Warn("outcome statement failed; writing the outcomes one by one", "outcomes", len(kept), "error", err)
		for _, k := range kept {
			if err := s.writeOutcome(ctx, k, &replies[k.index]); err != nil {
				return err
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

// writeOutcome writes one kept outcome alone, falling back along the pass to the advance that
// led to a fused stage whose outcome is refused. It returns an error only when the connection
// is lost or ctx is done.
func (s *server) writeOutcome(ctx context.Context, k keptOutcome, r *reply) error {
	for m := k.m; ; m = m.link.prev {
		err := m.update(ctx, s.db, m.kept.change, m.kept.state, s.cfg.Stage)
		if err == nil {
			r.fallBackTo(m)
			return nil
		}
		if s.sess.lost() || ctx.Err() != nil {
			return err
		}
		if m.link.prev == nil || errors.Is(err, ErrClaimLost) {
			r.fail(err.Error())
			return nil
		}
		m.srv.noteFailure(m.ID, err.Error())
	}
}

// queryIDs runs a statement returning one bigint column and returns the set of its values.
func queryIDs(ctx context.Context, db *sql.DB, q string) (map[int64]bool, error) {
	rs, err := db.QueryContext(ctx, q)
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
			if w := r.words(); w != "" {
				b.WriteString(" " + w)
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

	// Stage is the stage running it: Config.Stage, or a fused stage run in the same pass
	// (ServeStages), whose handler sees the row running at this stage.
	Stage string

	// Attempts counts the failed attempts so far (the dispatcher increments it on failure);
	// 0 at a fused stage, which the message has just reached.
	Attempts int

	// Payload is the row's payload, set at enqueue and never changed by pepsi; nil for NULL.
	Payload json.RawMessage

	// State is the row's state jsonb, decoded (numbers as json.Number). The handler changes it
	// freely; the outcome writes it back, in the same UPDATE. Changes made after the outcome
	// was chosen are not written. The dispatcher owns the key "dispatch_error". At a fused
	// stage it is the state that the advance leading there chose.
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
	link     link        // the message's place in its pass (stage fusion)
}

// link is a Message's place in the pass of its row: the claimed stage first, then the stages
// fused after it, each run by runLink. Set before the handler runs, except took.
type link struct {
	index  int           // the message's index in the batch, for savepoint names
	prev   *Message      // the stage whose advance led here; nil for the claimed stage
	chain  []string      // the stages of the pass so far, this one last: none is fused twice
	at     string        // the stage the row is at in the transaction when this stage starts
	nested bool          // an earlier stage of the pass has its savepoint open: this one's nests in it, and its outcome is written at once
	took   time.Duration // the handler's running time
}

// fusable reports whether the outcome c, chosen by m's handler, is an advance to a stage that
// runs in the same pass: one this program implements (a view), not already in the pass.
func (m *Message) fusable(c change) bool {
	return c.status == "pending" && c.stage != "" && m.srv.views[c.stage] != nil &&
		!slices.Contains(m.link.chain, c.stage)
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
// either way the state written is the state as it was when Advance was called. An advance to
// a stage that this program fuses (ServeStages) always waits: that stage's handler runs after
// this one returns, and the advance is written only if it fails.
func (m *Message) Advance(next string) error {
	if !slices.Contains(m.srv.cfg.Next, next) {
		return fmt.Errorf("advance message %d to %q: %w (NEXT of %s: %q)",
			m.ID, next, ErrNotNext, m.Stage, strings.Join(m.srv.cfg.Next, " "))
	}
	return m.choose(change{what: "advance to " + next, stage: next, status: "pending"})
}

// Done finishes the message: status = 'done', and the state, in one UPDATE guarded by the
// claim (at a fused stage, stage = that stage too). Errors and timing as for Advance.
func (m *Message) Done() error {
	return m.choose(change{what: "done", status: "done"})
}

// Defer pauses the message until the given time: status = 'paused', retry_at = until, and the
// state, in one UPDATE guarded by the claim. The dispatcher puts it back to pending at this
// stage when it is due (at a fused stage, stage = that stage too: it runs there again). A
// deferral is not a failure: attempts is unchanged. Errors and timing as for Advance.
func (m *Message) Defer(until time.Time) error {
	return m.choose(change{
		what:    "defer until " + until.Format(time.RFC3339),
		status:  "paused",
		retryAt: until.UTC().Format("2006-01-02 15:04:05.999999Z07:00"),
	})
}

// choose is Advance, Done and Defer: the outcome is written at once when the message's
// savepoint is open (the handler has used m.Tx), and kept for the batch's outcome statement
// (or for the fused stage it advances to) otherwise.
func (m *Message) choose(c change) error {
	if m.link.prev != nil && c.stage == "" {
		// The row was claimed at another stage: a fused stage's done or defer names its own.
		c.stage = m.Stage
	}
	return m.outcomeNamed(m.ctx, c.what, func(tx *sql.Tx) error {
		state, err := m.stateJSON()
		if err != nil {
			return fmt.Errorf("%s message %d: encode state: %w", c.what, m.ID, err)
		}
		if !m.srv.sess.isOpen() || m.fusable(c) {
			m.kept = &keptChange{change: c, state: state}
			return nil
		}
		return m.update(m.ctx, tx, c, state, m.Stage)
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
// from write fails the message even if the handler then returns nil. At a fused stage the
// guard holds as well: the savepoint's request has moved the running row to m.Stage. Such an
// outcome is not an advance, so it ends the pass: nothing is fused after it.
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

// execer is a transaction, or the database for a statement of its own.
type execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
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
//
// guard is the stage the row is running at in the transaction: m.Stage inside the message's
// own savepoint (a fused stage's savepoint moves the row there), the claimed stage for an
// outcome kept until the end of the batch.
func (m *Message) update(ctx context.Context, on execer, c change, state []byte, guard string) error {
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
		" AND status = 'running' AND stage = " + pq.QuoteLiteral(guard)
	res, err := on.ExecContext(ctx, q)
	if err != nil {
		return fmt.Errorf("%s message %d: %w", c.what, m.ID, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return fmt.Errorf("%s message %d: rows affected: %w", c.what, m.ID, err)
	}
	if n == 0 {
		return fmt.Errorf("%s message %d: row is no longer running at stage %s: %w",
			c.what, m.ID, guard, ErrClaimLost)
	}
	return nil
}
