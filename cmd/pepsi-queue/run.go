// run.go: configuration, the database connection, and each command.

package main

import (
	"bufio"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/user"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/lib/pq"

	"pepsi-dispatch/internal/dsnsecret"
	"pepsi-dispatch/internal/pgsession"
	"pepsi-dispatch/internal/schemafile"
)

// batchSize is how many ids one action call takes: one transaction, one operator_log row.
// Its row locks are held until it commits, and a claim or a stage's outcome meeting one of
// them waits; 1,000 rows commit in a few milliseconds.
const batchSize = 1000

// confirmAbove: an action on more rows than this asks first (or needs --yes).
const confirmAbove = 1000

// Exit statuses (pepsi-queue(1)).
const (
	exitOK      = 0
	exitRefused = 1
	exitUsage   = 2
	exitNoDB    = 3
)

// unreachable wraps a failure to reach the database: exit status 3.
type unreachable struct{ err error }

func (e *unreachable) Error() string { return "cannot reach the database: " + e.err.Error() }
func (e *unreachable) Unwrap() error { return e.err }

// refused means the database answered but refused some rows: exit status 1 (the rows were
// already reported).
var errRefused = errors.New("some messages were refused")

// env is one invocation's surroundings.
type env struct {
	inv    *invocation
	db     *sql.DB
	stdin  io.Reader
	out    io.Writer
	errOut io.Writer
	actor  string
	conf   *confFile
	// isTerminal reports whether the prompt can be asked (standard input is a terminal and is
	// not carrying ids).
	isTerminal bool
}

func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	inv, err := parseArgs(args)
	if errors.Is(err, errHelp) {
		io.WriteString(stdout, usageText)
		return exitOK
	}
	if err != nil {
		fmt.Fprintln(stderr, "pepsi-queue:", err)
		return exitUsage
	}
	conf, err := readConf(inv.config)
	dsn := os.Getenv("PEPSI_DSN")
	if err != nil && (dsn == "" || !errors.Is(err, os.ErrNotExist)) {
		fmt.Fprintln(stderr, "pepsi-queue:", err)
		return exitUsage
	}
	from := "PEPSI_DSN"
	if dsn == "" {
		dsn, from = conf.dsn, inv.config
	}
	if dsn == "" {
		fmt.Fprintf(stderr, "pepsi-queue: %s: no [database] DSN (and PEPSI_DSN is not set)\n", inv.config)
		return exitUsage
	}
	// Until the connection is made, an error may come from the driver, which can quote the
	// DSN (its URL parser repeats the whole URL) or a fragment of it (the word it stopped at):
	// none is printed before the password is taken out.
	secrets := append(dsnsecret.Secrets(dsn), dsnsecret.FromEnv()...)
	fail := func(code int, err error) int {
		fmt.Fprintln(stderr, "pepsi-queue:", dsnsecret.Redact(err.Error(), secrets))
		return code
	}
	// A DSN the driver cannot parse is the operator's configuration to fix, not a database
	// to wait for; checked as written, before withAppName adds to it.
	if err := dsnsecret.Check(dsn); err != nil {
		return fail(exitUsage, fmt.Errorf("database DSN (%s): %w", from, err))
	}
	db, err := pgsession.Open(withAppName(dsn), pgsession.DefaultVanish)
	if err != nil {
		return fail(exitUsage, fmt.Errorf("database DSN (%s): %w", from, err))
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	pctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	err = db.PingContext(pctx)
	cancel()
	if err != nil {
		return fail(exitNoDB, &unreachable{err})
	}
	// An older schema fails its statements one by one ("function queue_select(…) does not
	// exist"): said once, before any.
	vctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	_, err = schemafile.CheckVersion(vctx, db)
	cancel()
	if err != nil {
		if isConnErr(err) {
			return fail(exitNoDB, &unreachable{err})
		}
		return fail(exitRefused, err)
	}
	e := &env{inv: inv, db: db, stdin: stdin, out: stdout, errOut: stderr, actor: osUser(), conf: conf}
	if f, ok := stdin.(*os.File); ok && !inv.stdin {
		e.isTerminal = isTerminal(f)
	}
	err = e.dispatch(ctx)
	if err == nil {
		return exitOK
	}
	if errors.Is(err, errRefused) {
		return exitRefused // the rows were reported
	}
	code := exitRefused
	var ue *usageError
	var un *unreachable
	switch {
	case errors.As(err, &ue):
		code = exitUsage
	case errors.As(err, &un) || isConnErr(err):
		code = exitNoDB
	}
	// A lost connection's error may still hold the password; only whole secrets are taken
	// out here, as a quoted id or stage name of an ordinary error may be part of one by chance.
	fmt.Fprintln(stderr, "pepsi-queue:", dsnsecret.Replace(err.Error(), secrets))
	return code
}

// withAppName names the session. Not "pepsi-…": schema.sql's requeue trigger stays silent for
// sessions so named, and a retry or release must wake the dispatcher.
func withAppName(dsn string) string {
	if strings.Contains(dsn, "://") {
		sep := "?"
		if strings.Contains(dsn, "?") {
			sep = "&"
		}
		if strings.Contains(dsn, "application_name=") {
			return dsn
		}
		return dsn + sep + "application_name=pepsi_queue"
	}
	if strings.Contains(dsn, "application_name=") {
		return dsn
	}
	return dsn + " application_name=pepsi_queue"
}

func isConnErr(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, sql.ErrConnDone) || errors.Is(err, syscall.ECONNREFUSED)
}

// osUser is the OS user for operator_log: the login name, and who used sudo to become it.
func osUser() string {
	name := ""
	if u, err := user.Current(); err == nil {
		name = u.Username
	} else {
		name = os.Getenv("USER")
	}
	if s := os.Getenv("SUDO_USER"); s != "" && s != name {
		name += " (sudo from " + s + ")"
	}
	return name
}

func (e *env) dispatch(ctx context.Context) error {
	inv := e.inv
	switch inv.command {
	case "status":
		// A line for every stage the configuration defines too (the file's and the config
		// table's), with zeros when it has no rows, so that a stage with nothing to do is told
		// from one pepsi does not know; totals of zeros for a table without rows, not the sums
		// of nothing. A stage's pause is the config table's PAUSED row (pause and resume write
		// it) over the file's, as the dispatcher reads them: queue_status knows the table's.
		var stages, pausedStages, pausedValues []string
		if e.conf != nil {
			for st := range e.conf.stages {
				stages = append(stages, st)
			}
			for st, v := range e.conf.paused {
				pausedStages, pausedValues = append(pausedStages, st), append(pausedValues, v)
			}
		}
		return e.query(ctx, `
		WITH s AS (SELECT * FROM queue_status()),
		     cfg AS (SELECT unnest($1::text[]) AS stage
		             UNION SELECT substr(section, 7) FROM config WHERE section LIKE 'stage-%' AND key = 'PROGRAM'),
		     paused AS (SELECT stage, coalesce(c.value, f.value) AS value
		                  FROM unnest($2::text[], $3::text[]) f (stage, value)
		                  FULL JOIN (SELECT substr(section, 7) AS stage, value FROM config
		                              WHERE section LIKE 'stage-%' AND key = 'PAUSED') c USING (stage))
		SELECT stage, coalesce(pending, 0) AS pending, coalesce(running, 0) AS running, coalesce(paused, 0) AS paused,
		       coalesce(waiting, 0) AS waiting, coalesce(held, 0) AS held, coalesce(done, 0) AS done,
		       coalesce(failed, 0) AS failed, coalesce(cancelled, 0) AS cancelled, coalesce(total, 0) AS total,
		       oldest_pending,
		       coalesce((SELECT lower(p.value) IN ('yes', 'true', 'on', '1') FROM paused p WHERE p.stage = x.stage),
		                false) AS stage_paused
		  FROM (SELECT * FROM s
		        UNION ALL
		        SELECT cfg.stage, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, false FROM cfg
		         WHERE cfg.stage NOT IN (SELECT s.stage FROM s WHERE s.stage IS NOT NULL)) x
		 ORDER BY stage IS NULL, stage`, pq.Array(stages), pq.Array(pausedStages), pq.Array(pausedValues))
	case "shape":
		return e.query(ctx, `SELECT stage, total, lt_1m AS "<1m", age_1m AS "1m", age_5m AS "5m",
		        age_10m AS "10m", age_30m AS "30m", age_1h AS "1h", age_4h AS "4h", age_1d AS "1d",
		        gt_1d AS ">1d" FROM queue_shape($1, $2)`, nullable(inv.filter["stage"]), nullable(inv.filter["status"]))
	case "list":
		return e.query(ctx, `SELECT workqueue_id, stage, status, attempts, age, dispatch_error
		        FROM queue_list($1::jsonb, $2)`, inv.filterJSON(), inv.limit)
	case "errors":
		return e.query(ctx, `SELECT signature, count, stages, first_seen, last_seen, example_id,
		        example_error, pattern FROM queue_errors($1::jsonb)`, inv.filterJSON())
	case "show":
		return e.show(ctx)
	case "pause", "resume":
		return e.pause(ctx)
	}
	return e.act(ctx)
}

func nullable(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// selection gathers the ids an action names: arguments, standard input or the filter.
func (e *env) selection(ctx context.Context) ([]int64, error) {
	inv := e.inv
	ids := append([]int64(nil), inv.ids...)
	if inv.stdin {
		more, err := readIDs(e.stdin)
		if err != nil {
			return nil, err
		}
		ids = append(ids, more...)
	}
	if !inv.all {
		return ids, nil
	}
	// Page through the filter's matches by id: one scan in all, no long-running snapshot.
	var after int64
	for {
		rows, err := e.db.QueryContext(ctx, `SELECT queue_select($1::jsonb, $2, $3)`, inv.filterJSON(), after, 10000)
		if err != nil {
			return nil, fmt.Errorf("select messages: %w", err)
		}
		n := 0
		for rows.Next() {
			var id int64
			if err := rows.Scan(&id); err != nil {
				rows.Close()
				return nil, fmt.Errorf("select messages: %w", err)
			}
			ids = append(ids, id)
			after = id
			n++
		}
		err = rows.Err()
		rows.Close()
		if err != nil {
			return nil, fmt.Errorf("select messages: %w", err)
		}
		if n < 10000 {
			return ids, nil
		}
	}
}

var idSep = regexp.MustCompile(`[\s,]+`)

// readIDs reads ids separated by white space, commas or newlines; '#' starts a comment.
func readIDs(r io.Reader) ([]int64, error) {
	var ids []int64
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 16<<20)
	line := 0
	for sc.Scan() {
		line++
		text, _, _ := strings.Cut(sc.Text(), "#")
		for _, w := range idSep.Split(strings.TrimSpace(text), -1) {
			if w == "" {
				continue
			}
			id, err := strconv.ParseInt(w, 10, 64)
			if err != nil || id < 1 {
				return nil, usagef("standard input, line %d: %q is not a message id", line, w)
			}
			ids = append(ids, id)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read ids from standard input: %w", err)
	}
	return ids, nil
}

// act runs an action over the selection in batches and reports every refused row.
func (e *env) act(ctx context.Context) error {
	inv := e.inv
	ids, err := e.selection(ctx)
	if err != nil {
		return err
	}
	if len(ids) == 0 {
		if !inv.json {
			fmt.Fprintf(e.out, "%s: no messages selected\n", inv.command)
		}
		return nil
	}
	if len(ids) > confirmAbove && !inv.yes {
		if err := e.confirm(len(ids)); err != nil {
			return err
		}
	}
	var q string
	args := func(batch []int64) []any {
		return []any{pq.Array(batch), e.actor, nullable(inv.filterText())}
	}
	switch inv.command {
	case "retry":
		q = `SELECT workqueue_id, ok, status, reason FROM queue_retry($1, $4, $2, $3)`
	default:
		q = `SELECT workqueue_id, ok, status, reason FROM queue_` + inv.command + `($1, $2, $3)`
	}
	changed, refused := 0, 0
	for start := 0; start < len(ids); start += batchSize {
		batch := ids[start:min(start+batchSize, len(ids))]
		a := args(batch)
		if inv.command == "retry" {
			a = append(a, inv.reset)
		}
		rows, err := e.db.QueryContext(ctx, q, a...)
		if err != nil {
			return e.partial(changed, fmt.Errorf("%s: %w", inv.command, err))
		}
		for rows.Next() {
			var id int64
			var ok bool
			var status, reason sql.NullString
			if err := rows.Scan(&id, &ok, &status, &reason); err != nil {
				rows.Close()
				return e.partial(changed, fmt.Errorf("%s: %w", inv.command, err))
			}
			if ok {
				changed++
			} else {
				refused++
				fmt.Fprintf(e.errOut, "pepsi-queue: %s %d refused: %s\n", inv.command, id, reason.String)
			}
			if inv.json {
				writeJSON(e.out, []string{"workqueue_id", "ok", "status", "reason"},
					[]any{id, ok, nullString(status), nullString(reason)})
			}
		}
		err = rows.Err()
		rows.Close()
		if err != nil {
			return e.partial(changed, fmt.Errorf("%s: %w", inv.command, err))
		}
	}
	if !inv.json {
		fmt.Fprintf(e.out, "%s: %d of %d messages %s%s\n", inv.command, changed, changed+refused,
			pastTense[inv.command], refusedNote(refused))
	}
	if refused > 0 {
		return errRefused
	}
	return nil
}

var pastTense = map[string]string{
	"retry": "retried", "hold": "held", "release": "released", "cancel": "cancelled", "delete": "deleted",
}

func refusedNote(n int) string {
	if n == 0 {
		return ""
	}
	return fmt.Sprintf(", %d refused (reasons above)", n)
}

// partial reports how far an action got before an error: earlier batches are committed.
func (e *env) partial(changed int, err error) error {
	if changed > 0 {
		fmt.Fprintf(e.errOut, "pepsi-queue: %s: %d messages were changed before the error (committed)\n", e.inv.command, changed)
	}
	return err
}

// confirm asks before acting on many rows; without a terminal it refuses.
func (e *env) confirm(n int) error {
	if !e.isTerminal {
		return usagef("%s would act on %d messages: add --yes (there is no terminal to ask on)", e.inv.command, n)
	}
	fmt.Fprintf(e.errOut, "%s %d messages? [y/N] ", e.inv.command, n)
	answer, _ := bufio.NewReader(e.stdin).ReadString('\n') // EOF: no answer, which is no
	switch strings.ToLower(strings.TrimSpace(answer)) {
	case "y", "yes":
		return nil
	}
	return usagef("%s: not confirmed; nothing changed", e.inv.command)
}

// show prints each message whole.
func (e *env) show(ctx context.Context) error {
	ids := append([]int64(nil), e.inv.ids...)
	if e.inv.stdin {
		more, err := readIDs(e.stdin)
		if err != nil {
			return err
		}
		ids = append(ids, more...)
	}
	rows, err := e.db.QueryContext(ctx, `SELECT workqueue_id, message FROM queue_show($1)`, pq.Array(ids))
	if err != nil {
		return fmt.Errorf("show: %w", err)
	}
	defer rows.Close()
	seen := map[int64]bool{}
	for rows.Next() {
		var id int64
		var msg []byte
		if err := rows.Scan(&id, &msg); err != nil {
			return fmt.Errorf("show: %w", err)
		}
		seen[id] = true
		if e.inv.json {
			fmt.Fprintf(e.out, "%s\n", msg)
			continue
		}
		if err := printMessage(e.out, msg); err != nil {
			return fmt.Errorf("show %d: %w", id, err)
		}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("show: %w", err)
	}
	missing := 0
	for _, id := range ids {
		if !seen[id] {
			seen[id] = true
			missing++
			fmt.Fprintf(e.errOut, "pepsi-queue: show %d: no such message\n", id)
		}
	}
	if missing > 0 {
		return errRefused
	}
	return nil
}

// pause writes (or clears) a stage's PAUSED overlay row.
func (e *env) pause(ctx context.Context) error {
	stage := e.inv.stages[0]
	if e.conf != nil && e.conf.path != "" && !e.conf.stages[stage] {
		var n int
		err := e.db.QueryRowContext(ctx, `SELECT count(*) FROM config WHERE section = $1 AND key = 'PROGRAM'`,
			"stage-"+stage).Scan(&n)
		if err != nil {
			return fmt.Errorf("%s: read config table: %w", e.inv.command, err)
		}
		if n == 0 {
			fmt.Fprintf(e.errOut, "pepsi-queue: %s %s refused: no stage %q in %s or in the config table\n",
				e.inv.command, stage, stage, e.conf.path)
			return errRefused
		}
	}
	var name string
	var ok bool
	var paused sql.NullBool
	var reason sql.NullString
	err := e.db.QueryRowContext(ctx, `SELECT stage, ok, paused, reason FROM queue_pause($1, $2, $3)`,
		stage, e.inv.command == "pause", e.actor).Scan(&name, &ok, &paused, &reason)
	if err != nil {
		return fmt.Errorf("%s %s: %w", e.inv.command, stage, err)
	}
	if e.inv.json {
		writeJSON(e.out, []string{"stage", "ok", "paused", "reason"}, []any{name, ok, nullBool(paused), nullString(reason)})
	} else if ok {
		word := "paused: claiming stops; messages already in workers' queues finish"
		if !paused.Bool {
			word = "resumed: claiming starts again"
		}
		fmt.Fprintf(e.out, "stage %s %s\n", name, word)
	}
	if !ok {
		fmt.Fprintf(e.errOut, "pepsi-queue: %s %s refused: %s\n", e.inv.command, stage, reason.String)
		return errRefused
	}
	return nil
}

func nullString(s sql.NullString) any {
	if !s.Valid {
		return nil
	}
	return s.String
}

func nullBool(b sql.NullBool) any {
	if !b.Valid {
		return nil
	}
	return b.Bool
}
