// serve.go: the serving loop and the worker protocol's two ends: Run and Serve (and their
// several-stage forms), the reading of ids from stdin into batches, the worker's one
// connection (connect), and the status lines written back. What a batch does with its ids is
// batch.go's.

package stage

import (
	"bufio"
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/lib/pq"

	"pepsi-dispatch/internal/pgsession"
)

const (
	// readBufferSize bounds the bytes read from stdin ahead of processing: a few thousand ids.
	readBufferSize = 64 << 10

	// maxReason is the longest reason put on a status line, in bytes.
	maxReason = 1000
)

// Run is a stage program's main: it parses `[-c FILE] worker` from os.Args, reads PEPSI_STAGE,
// PEPSI_NEXT (space-separated), PEPSI_FUSE, PEPSI_DSN, PEPSI_MAX_CHILDREN and PEPSI_MIN_SPAN
// from the environment (LoadConfig), sets runtime.GOMAXPROCS(1) unless the environment sets
// GOMAXPROCS (see the package documentation), connects once
// and serves os.Stdin/os.Stdout until EOF with h as the handler of PEPSI_STAGE; it exits the
// process (0 after EOF, non-zero on a fatal error such as a lost database connection, with the
// reason on stderr). A program with one handler runs no fused stage: see RunStages.
//
// The ids and replies move to descriptors of their own before the first handler runs: to
// the handler and the programs it runs, standard input is then /dev/null, and standard output
// writes to standard error, which the dispatcher logs.
//
// Exit statuses: 0 after EOF on stdin, 2 for a usage or environment error, 1 for any other
// fatal error. Signals keep their default action: SIGTERM or SIGINT end the process at once,
// which is safe, because the batch in flight has not committed (PostgreSQL rolls it back when
// the connection drops) or has committed under the guard (the dispatcher's recovery writes
// are guarded too and leave a moved row alone).
func Run(h Handler) {
	oneProc(os.Getenv)
	in, out := protocolFiles()
	os.Exit(run(context.Background(), os.Args[1:], os.Getenv, in, out, os.Stderr, nil, h))
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
	in, out := protocolFiles()
	os.Exit(run(context.Background(), os.Args[1:], os.Getenv, in, out, os.Stderr, handlers, nil))
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
// Every id already available on in (up to 500, fewer after a batch whose handlers used
// Message.Tx) is run as one batch in one transaction, whose status lines are written together
// after the commit, and a batch takes no new message after 100 ms: see "What this package
// does" in the package documentation. Serve is ServeStages with h as the only handler, that of
// cfg.Stage: it fuses nothing.
//
// It returns an error wrapping the cause: an invalid cfg (nothing is started), a failed
// connection, ErrConnectionLost, a failed read of in or write to out, or ctx's error.
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

// readLine returns the next line without its LF (a CR before it is parseID's to ignore). A
// line longer than the buffer (64 KiB) is cut to its first 64 KiB: it is no id anyway, and
// still gets its one reply. The Python SDK cuts at the same length.
func readLine(r *bufio.Reader) (string, error) {
	b, err := r.ReadSlice('\n')
	line := string(bytes.TrimSuffix(b, []byte{'\n'}))
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
	log   *slog.Logger
	// wrote tells whether the last batch began a transaction: the next reads fewer ids.
	wrote bool
	// batchTime is maxBatchTime, or a test's.
	batchTime time.Duration

	fuseFailures     int // a view's fused runs that failed, for rate-limited logging
	transientBatches int // batches run again after a serialization failure or deadlock (transient.go), for rate-limited logging
}

// connect opens the worker's one connection and makes the views of the fused stages that
// handlers implement.
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
	// A server whose machine vanished is given up within 10 s, as the dispatcher gives it up
	// (internal/pgsession's Dialer), and a connect to it within 5 s per host unless the DSN
	// sets connect_timeout: a worker started after a failover tried the DSN's vanished first
	// host for as long as the kernel resends its SYNs (about 2 minutes behind a router) before
	// the promoted standby listed second (TestFailoverPrimaryVanishes).
	pconn.Dialer(pgsession.DialerOf(pcfg, pgsession.DefaultVanish))
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

// words returns what follows "0 " on a success line: the word of the kind of the outcome that
// stands ("done" when the message finished: dispatch_stats.done), and fused=STAGE:MS,… for the fused stages (stage_stats.fused and
// busy_ms of each), separated by single spaces; "" for neither.
func (r *reply) words() string {
	var words []string
	if r.final != nil && r.final.kind != nil && r.final.kind.word != "" {
		words = append(words, r.final.kind.word)
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
