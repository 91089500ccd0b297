// conf.go: the configuration file, the database overlay and the stage graph.
//
// It owns parsing (a small INI dialect), defaults, validation and the merge of the `config`
// table over the file's [stage-*] sections. It reads files and rows it is given; it never opens
// a database connection itself. Every mistake is reported once, at load time, as
// "FILE:LINE: KEY: what is wrong", so an operator can fix the file without reading code.

package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"pepsi-dispatch/internal/dsnsecret"
)

// Defaults of the [pepsi-dispatch] and [stage-*] keys (doc/design/dispatch.md, doc/design/fanin.md §3.11).
const (
	maxRuntimeDefault        = 300 * time.Second
	workerIdleTimeoutDefault = 5 * time.Second
	pollIntervalDefault      = 30 * time.Second
	statsIntervalDefault     = 60 * time.Second
	shutdownGraceDefault     = 10 * time.Second
	dbPoolSizeDefault        = 8
	userDefault              = "pepsi"
	configFileDefault        = "/etc/pepsi/pepsi.conf"

	parallelismDefault = 4
	queueLimitDefault  = 4
	maxMessagesDefault = 1000
	maxAttemptsDefault = 5
	retryDelayDefault  = 30 * time.Second
	maxChildrenDefault = 10000 // doc/design/fanin.md §3.11
	minSpanDefault     = 1000

	// queueLimitMax bounds QUEUE_LIMIT so that a worker's whole pipeline of ids (at most
	// 21 bytes each) fits in a pipe buffer of 64 KiB, Linux's default: the coordinator's write
	// to a worker's stdin then never blocks, whatever the worker does. A smaller pipe (8 KiB
	// past a user's 1,024 pipes) lowers the worker's own limit (pipeLimit, worker.go).
	queueLimitMax = 1000
)

// Config is one loaded configuration: the file plus, for stages, the database overlay.
// It is immutable once loaded; a reload builds a new one.
type Config struct {
	Path string // the file it was read from

	DSN         string // [database] DSN
	Dispatch    DispatchConfig
	Stages      map[string]*StageConfig
	PoolCounter PoolCounterConfig

	// stageEntries are the file's [stage-*] entries, over which the config table's overlay
	// is applied (buildStages); a reload reads the file again for fresh ones.
	stageEntries []iniEntry

	// consoleToken is the credential read from CONSOLE_TOKEN_FILE at start-up, before the
	// privilege drop (loadConsoleToken); never logged.
	consoleToken string
}

// DispatchConfig is the [pepsi-dispatch] section. It is read once at start-up; a reload
// never changes it (the process must be restarted).
type DispatchConfig struct {
	MaxRuntime        time.Duration // a head message unanswered this long is a timeout
	WorkerIdleTimeout time.Duration // an idle worker is stopped after this long
	PollInterval      time.Duration // heartbeat claim when no notification arrives
	StatsInterval     time.Duration // statistics flush period
	ShutdownGrace     time.Duration // how long workers may finish their pipeline at shutdown
	DBPoolSize        int           // connections for the dispatcher's own writes
	ConfigFile        string        // passed to workers as -c; "" passes nothing
	User              string        // account to drop to when started as root
	MetricsListen     string        // host:port of the /metrics endpoint; "" = off
	ConsoleTokenFile  string        // the web console's credential file; "" = read-only console
	consoleTokenAt    string        // FILE:LINE of CONSOLE_TOKEN_FILE, for its errors
	Retention         time.Duration // delete done rows older than this; 0 = keep
	Standby           bool          // wait for the single-instance lock instead of exiting 1 (standby.go)
	LockKeepalive     time.Duration // a vanished holder's lock session ends within this; 0 = server's settings

	FaninBatch    int           // inbox rows per flush statement
	FaninMaxDelay time.Duration // longest a fan-in hint waits for company before a flush
	FaninMinHints int           // this many hints flush at once
	SweepInterval time.Duration // between passes of the fan-in safety sweep
	SweepPage     int           // open groups recounted per sweep statement
	SweepMinAge   time.Duration // groups younger than this are left to the flushes
}

// PoolCounterConfig is the [poolcounter] section: the lock service is off unless Listen is set.
type PoolCounterConfig struct {
	Listen string
}

// StageConfig is one [stage-NAME] section after the overlay was applied.
type StageConfig struct {
	Name        string
	Program     string
	Next        []string
	Parallelism int           // at most this many worker processes
	QueueLimit  int           // ids pipelined to one worker at once
	MaxMessages int           // a worker is recycled after this many messages
	MaxAttempts int           // failures before a message is marked failed
	RetryDelay  time.Duration // first retry delay, doubled per failed attempt
	Fuse        bool          // a predecessor's worker may run this stage in its own pass
	MaxChildren int           // a range split makes at most this many children (PEPSI_MAX_CHILDREN)
	MinSpan     int64         // each range slice spans at least this much (PEPSI_MIN_SPAN)
	// Paused: not claimed (PAUSED = yes, normally a config row written by pepsi-queue pause).
	// Changing it alone is applied in place by a reload: no worker is retired (reload.go).
	Paused   bool
	KeyLimit int // at most this many messages per concurrency_key in workers' queues; 0: no limit

	origin map[string]string // key (and "" for the section) -> "FILE:LINE" for errors
}

// equal reports whether two stage configurations would run workers identically.
func (s *StageConfig) equal(o *StageConfig) bool {
	return s.Name == o.Name && s.Program == o.Program && slices.Equal(s.Next, o.Next) &&
		s.Parallelism == o.Parallelism && s.QueueLimit == o.QueueLimit &&
		s.MaxMessages == o.MaxMessages && s.MaxAttempts == o.MaxAttempts &&
		s.RetryDelay == o.RetryDelay && s.Fuse == o.Fuse &&
		s.MaxChildren == o.MaxChildren && s.MinSpan == o.MinSpan && s.Paused == o.Paused &&
		s.KeyLimit == o.KeyLimit
}

// configError is an operator mistake in the file or the overlay; start-up maps it to exit 2.
type configError struct {
	Where string // "FILE:LINE" or "config table"
	Key   string // the key, or "[section]"
	Msg   string
}

func (e *configError) Error() string {
	if e.Key == "" {
		return fmt.Sprintf("%s: %s", e.Where, e.Msg)
	}
	return fmt.Sprintf("%s: %s: %s", e.Where, visible(e.Key), e.Msg)
}

// visible returns s as it is when it is short, printable text, and otherwise quoted with Go
// escapes and cut to a few dozen bytes: the "key" of a binary file given by mistake must not
// send control characters, or 64 KiB of them, to the operator's terminal.
func visible(s string) string {
	const most = 60
	printable := utf8.ValidString(s) && strings.IndexFunc(s, func(r rune) bool { return !strconv.IsPrint(r) }) < 0
	if printable && len(s) <= most {
		return s
	}
	return quoteShort(s)
}

// quoteShort is %q of at most the first 60 bytes of s (cut on a rune), with "…" when cut.
func quoteShort(s string) string {
	const most = 60
	if len(s) <= most {
		return strconv.Quote(s)
	}
	cut := most
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return strconv.Quote(s[:cut]) + "…"
}

// iniEntry is one KEY = value line of a section.
type iniEntry struct {
	Section string
	Key     string
	Value   string
	Where   string // FILE:LINE
}

// iniMaxLine bounds one line (its terminator aside), so a binary file given by mistake fails
// fast and clearly; pepsi.conf(5) promises lines "up to 64 KiB".
const iniMaxLine = 64 << 10

// parseINI reads the INI dialect of pepsi.conf: [section] headers, KEY = value lines,
// '#' and ';' comment lines and blank lines; surrounding spaces are trimmed. Lines of sections
// that are not ours are skipped unchecked, whatever they contain: they belong to other
// programs.
// A section header alone is returned as an entry with an empty Key, so that empty sections
// and their line numbers are known. pepsi-queue reads the file with internal/conffile, the
// same rules outside this package (which reads its configuration with no code of the module's
// other packages); FuzzConfReaders holds the two to one dialect.
func parseINI(name string, r io.Reader) ([]iniEntry, error) {
	var out []iniEntry
	sc := bufio.NewScanner(r)
	// The buffer must hold the longest allowed line with its "\r\n": the scanner gives up
	// when a line and its terminator do not fit, and drops the terminator from the token.
	sc.Buffer(make([]byte, 4096), iniMaxLine+2)
	section := ""
	seen := map[string]string{} // section + "\x00" + key -> where
	// n is the line being read; after the loop, the line that stopped it.
	n := 1
	for ; sc.Scan(); n++ {
		where := fmt.Sprintf("%s:%d", name, n)
		if len(sc.Bytes()) > iniMaxLine {
			return nil, tooLong(where)
		}
		line := sc.Text()
		if n == 1 {
			// A byte order mark, which some editors (Windows' Notepad) write at the start
			// of a UTF-8 file: not part of the first line's text.
			line = strings.TrimPrefix(line, "\uFEFF")
		}
		line = strings.TrimSpace(line)
		switch {
		case line == "" || line[0] == '#' || line[0] == ';':
			continue
		case line[0] == '[':
			if !strings.HasSuffix(line, "]") {
				return nil, &configError{where, "", fmt.Sprintf("section header %s lacks its closing ']'", quoteShort(line))}
			}
			section = strings.TrimSpace(line[1 : len(line)-1])
			if section == "" {
				return nil, &configError{where, "", "empty section name"}
			}
			if ours(section) && !validText(section) {
				return nil, &configError{where, "", fmt.Sprintf("section name %s contains a control character", quoteShort(section))}
			}
			out = append(out, iniEntry{Section: section, Where: where})
			continue
		}
		key, value, ok := strings.Cut(line, "=")
		if !ok {
			if ours(section) {
				return nil, &configError{where, "", fmt.Sprintf("expected KEY = value, got %s", quoteShort(line))}
			}
			continue
		}
		if section == "" {
			return nil, &configError{where, strings.TrimSpace(key), "key outside any [section]"}
		}
		key, value = strings.TrimSpace(key), strings.TrimSpace(value)
		if !ours(section) {
			continue
		}
		if !validKey(key) {
			return nil, &configError{where, key, "keys are upper-case letters, digits and '_'"}
		}
		if i := strings.IndexFunc(value, isControl); i >= 0 {
			// A NUL cannot even be passed to a worker (environment, argv); the others are a
			// binary file or an editor accident. The value is not echoed: it may be a password.
			r, _ := utf8.DecodeRuneInString(value[i:]) // the character, not its first byte
			return nil, &configError{where, key, fmt.Sprintf("the value contains the control character %U at byte %d; values are text", r, i+1)}
		}
		id := section + "\x00" + key
		if first, dup := seen[id]; dup {
			return nil, &configError{where, key, fmt.Sprintf("set twice in [%s] (first at %s)", section, first)}
		}
		seen[id] = where
		out = append(out, iniEntry{Section: section, Key: key, Value: value, Where: where})
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return nil, tooLong(fmt.Sprintf("%s:%d", name, n))
		}
		var pe *fs.PathError
		if errors.As(err, &pe) {
			return nil, &configError{name, "", fmt.Sprintf("cannot read: %v", pe.Err)} // pe names the file again
		}
		return nil, &configError{name, "", fmt.Sprintf("cannot read: %v", err)}
	}
	return out, nil
}

func tooLong(where string) error {
	return &configError{where, "", fmt.Sprintf("line longer than %d bytes (64 KiB), the most a line may be", iniMaxLine)}
}

// isControl reports a control character other than TAB (which trimming and NEXT's field
// splitting treat as a space).
func isControl(r rune) bool { return r != '\t' && unicode.IsControl(r) }

func validText(s string) bool { return strings.IndexFunc(s, isControl) < 0 }

// ours reports whether a section belongs to pepsi-dispatch (its keys are checked).
func ours(section string) bool {
	switch section {
	case "database", "pepsi-dispatch", "poolcounter":
		return true
	}
	return strings.HasPrefix(section, "stage-")
}

func validKey(k string) bool {
	if k == "" {
		return false
	}
	for _, c := range k {
		if !(c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

var stageNameRe = regexp.MustCompile(`^[a-z0-9_-]+$`)

// loadConfig reads and validates the file. The stage graph is validated without the
// overlay; buildStages applies the overlay and validates again.
func loadConfig(path string) (*Config, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, &configError{path, "", fmt.Sprintf("cannot open: %v", errors.Unwrap(err))}
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.IsDir() {
		return nil, &configError{path, "", "is a directory; -c names the configuration file"}
	}
	entries, err := parseINI(path, f)
	if err != nil {
		return nil, err
	}
	cfg := &Config{
		Path: path,
		Dispatch: DispatchConfig{
			MaxRuntime:        maxRuntimeDefault,
			WorkerIdleTimeout: workerIdleTimeoutDefault,
			PollInterval:      pollIntervalDefault,
			StatsInterval:     statsIntervalDefault,
			ShutdownGrace:     shutdownGraceDefault,
			DBPoolSize:        dbPoolSizeDefault,
			LockKeepalive:     lockKeepaliveDefault,
			User:              userDefault,
			FaninBatch:        faninBatchDefault,
			FaninMaxDelay:     faninMaxDelayDefault,
			FaninMinHints:     faninMinHintsDefault,
			SweepInterval:     sweepIntervalDefault,
			SweepPage:         sweepPageDefault,
			SweepMinAge:       sweepMinAgeDefault,
		},
	}
	for _, e := range entries {
		if e.Key == "" {
			if strings.HasPrefix(e.Section, "stage-") {
				cfg.stageEntries = append(cfg.stageEntries, e)
			}
			continue
		}
		switch {
		case e.Section == "database":
			if e.Key != "DSN" {
				return nil, &configError{e.Where, e.Key, "unknown key in [database] (known: DSN)"}
			}
			if e.Value != "" {
				if err := dsnsecret.Check(e.Value); err != nil {
					return nil, &configError{e.Where, e.Key, err.Error()}
				}
			}
			cfg.DSN = withSSLModeDefault(e.Value)
		case e.Section == "pepsi-dispatch":
			if err := cfg.Dispatch.set(e); err != nil {
				return nil, err
			}
		case e.Section == "poolcounter":
			if e.Key != "LISTEN" {
				return nil, &configError{e.Where, e.Key, "unknown key in [poolcounter] (known: LISTEN)"}
			}
			if err := checkListen(e.Value); err != nil {
				return nil, &configError{e.Where, e.Key, err.Error()}
			}
			cfg.PoolCounter.Listen = e.Value
		default:
			cfg.stageEntries = append(cfg.stageEntries, e)
		}
	}
	cfg.Stages, err = buildStages(cfg.stageEntries, nil)
	if err != nil {
		return nil, err
	}
	if len(cfg.Stages) > 0 && cfg.DSN == "" {
		return nil, &configError{path, "DSN", "[database] DSN is required when stages are configured"}
	}
	return cfg, nil
}

func (d *DispatchConfig) set(e iniEntry) error {
	var err error
	switch e.Key {
	case "MAX_RUNTIME":
		d.MaxRuntime, err = parsePositiveDuration(e.Value)
	case "WORKER_IDLE_TIMEOUT":
		d.WorkerIdleTimeout, err = parsePositiveDuration(e.Value)
	case "POLL_INTERVAL":
		d.PollInterval, err = parsePositiveDuration(e.Value)
	case "STATS_INTERVAL":
		d.StatsInterval, err = parsePositiveDuration(e.Value)
	case "SHUTDOWN_GRACE":
		d.ShutdownGrace, err = parseDuration(e.Value)
	case "RETENTION":
		d.Retention, err = parseDuration(e.Value)
	case "DB_POOL_SIZE":
		d.DBPoolSize, err = parseCount(e.Value, 2, 1000)
	case "CONFIG_FILE":
		d.ConfigFile = e.Value
	case "USER":
		if e.Value == "" {
			err = errors.New("must name an account")
		}
		d.User = e.Value
	case "FANIN_BATCH":
		d.FaninBatch, err = parseCount(e.Value, 1, 1000000)
	case "FANIN_MAX_DELAY":
		d.FaninMaxDelay, err = parsePositiveDuration(e.Value)
	case "FANIN_MIN_HINTS":
		d.FaninMinHints, err = parseCount(e.Value, 1, 1000000)
	case "SWEEP_INTERVAL":
		d.SweepInterval, err = parsePositiveDuration(e.Value)
	case "SWEEP_PAGE":
		d.SweepPage, err = parseCount(e.Value, 1, 100000)
	case "SWEEP_MIN_AGE":
		d.SweepMinAge, err = parseDuration(e.Value)
	case "STANDBY":
		d.Standby, err = parseBool(e.Value)
	case "LOCK_KEEPALIVE":
		if d.LockKeepalive, err = parseDuration(e.Value); err == nil && d.LockKeepalive > 0 && d.LockKeepalive < 2*time.Second {
			err = fmt.Errorf("want 0 (the server's keepalive settings) or at least 2s, got %q", e.Value)
		}
	case "METRICS_LISTEN":
		err = checkListen(e.Value)
		d.MetricsListen = e.Value
	case "CONSOLE_TOKEN_FILE":
		if e.Value == "" || !filepath.IsAbs(e.Value) {
			err = fmt.Errorf("want an absolute path, got %q", e.Value)
		}
		d.ConsoleTokenFile, d.consoleTokenAt = e.Value, e.Where
	default:
		err = errors.New("unknown key in [pepsi-dispatch]")
	}
	if err != nil {
		return &configError{e.Where, e.Key, err.Error()}
	}
	return nil
}

// checkListen validates a host:port to listen on as net.Listen("tcp", v) will read it, so
// that a mistake is an exit 2 with FILE:LINE at load time, not a failure to bind later. The
// port is a number (0 lets the kernel choose); the host is empty (every address), an IP
// address, or a syntactically valid host name (it is not resolved here).
func checkListen(v string) error {
	bad := func(why string) error {
		hint := ""
		if strings.ContainsAny(v, "#;") {
			hint = " (there are no inline comments: a '#' or ';' after the value is part of it)"
		}
		return fmt.Errorf("want host:port such as 127.0.0.1:7531, :7531 or [::1]:7531, got %s: %s%s", quoteShort(v), why, hint)
	}
	host, port, err := net.SplitHostPort(v)
	if err != nil {
		var ae *net.AddrError
		if errors.As(err, &ae) {
			return bad(ae.Err) // ae.Error() repeats the address
		}
		return bad(err.Error())
	}
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		return bad(fmt.Sprintf("port %s is not a number from 0 to 65535", quoteShort(port)))
	}
	if host == "" {
		return nil
	}
	if _, err := netip.ParseAddr(host); err == nil {
		return nil
	}
	if strings.Trim(host, "0123456789.") == "" {
		return bad(fmt.Sprintf("host %s is not an IPv4 address", quoteShort(host)))
	}
	if !validHostname(host) {
		return bad(fmt.Sprintf("host %s is neither an IP address nor a host name", quoteShort(host)))
	}
	return nil
}

// validHostname: dot-separated labels of letters, digits and '-' (RFC 1123), 253 bytes at most.
func validHostname(h string) bool {
	h = strings.TrimSuffix(h, ".")
	if h == "" || len(h) > 253 {
		return false
	}
	for _, label := range strings.Split(h, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for _, c := range label {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-') {
				return false
			}
		}
	}
	return true
}

// overlayRow is one row of the `config` table.
type overlayRow struct{ Section, Key, Value string }

// buildStages builds the stage table from the file's [stage-*] entries with the overlay rows
// applied over them (an overlay row may define a stage the file lacks), then validates the
// graph. Rows of sections other than [stage-*] are ignored: [pepsi-dispatch] is not reloaded.
func buildStages(file []iniEntry, overlay []overlayRow) (map[string]*StageConfig, error) {
	stages := map[string]*StageConfig{}
	get := func(section, where string) (*StageConfig, error) {
		name := strings.TrimPrefix(section, "stage-")
		if s, ok := stages[name]; ok {
			return s, nil
		}
		if !stageNameRe.MatchString(name) {
			return nil, &configError{where, "[" + section + "]", "stage names are [a-z0-9_-]+"}
		}
		s := &StageConfig{
			Name:        name,
			Parallelism: parallelismDefault,
			QueueLimit:  queueLimitDefault,
			MaxMessages: maxMessagesDefault,
			MaxAttempts: maxAttemptsDefault,
			RetryDelay:  retryDelayDefault,
			MaxChildren: maxChildrenDefault,
			MinSpan:     minSpanDefault,
			origin:      map[string]string{"": where},
		}
		stages[name] = s
		return s, nil
	}
	apply := func(section, key, value, where string) error {
		s, err := get(section, where)
		if err != nil || key == "" {
			return err
		}
		if err := s.set(key, value); err != nil {
			return &configError{where, key, err.Error()}
		}
		s.origin[key] = where
		return nil
	}
	for _, e := range file {
		if err := apply(e.Section, e.Key, e.Value, e.Where); err != nil {
			return nil, err
		}
	}
	// A PAUSED row (pepsi-queue pause) of a stage defined nowhere else does not define the
	// stage: it would have no PROGRAM, and the whole graph would fail to validate. So PAUSED
	// rows are applied last, to stages that exist by then, and the others are ignored.
	var pausedRows []overlayRow
	for _, r := range overlay {
		if !strings.HasPrefix(r.Section, "stage-") {
			continue
		}
		if r.Key == "PAUSED" {
			pausedRows = append(pausedRows, r)
			continue
		}
		where := fmt.Sprintf("config table (section %q)", r.Section)
		if !validKey(r.Key) {
			return nil, &configError{where, r.Key, "keys are upper-case letters, digits and '_'"}
		}
		if err := apply(r.Section, r.Key, r.Value, where); err != nil {
			return nil, err
		}
	}
	for _, r := range pausedRows {
		if _, ok := stages[strings.TrimPrefix(r.Section, "stage-")]; !ok {
			continue
		}
		if err := apply(r.Section, r.Key, r.Value, fmt.Sprintf("config table (section %q)", r.Section)); err != nil {
			return nil, err
		}
	}
	if err := validateGraph(stages); err != nil {
		return nil, err
	}
	return stages, nil
}

func (s *StageConfig) set(key, value string) error {
	var err error
	switch key {
	case "PROGRAM":
		if value == "" {
			return errors.New("must name a program")
		}
		s.Program = value
	case "NEXT":
		s.Next = strings.Fields(value)
	case "PARALLELISM":
		s.Parallelism, err = parseCount(value, 1, 10000)
	case "QUEUE_LIMIT":
		s.QueueLimit, err = parseCount(value, 1, queueLimitMax)
	case "MAX_MESSAGES":
		s.MaxMessages, err = parseCount(value, 1, 1<<31-1)
	case "MAX_ATTEMPTS":
		s.MaxAttempts, err = parseCount(value, 1, 1000)
	case "RETRY_DELAY":
		s.RetryDelay, err = parseDuration(value)
	case "FUSE":
		s.Fuse, err = parseBool(value)
	case "MAX_CHILDREN":
		s.MaxChildren, err = parseCount(value, 1, 10000000)
	case "PAUSED":
		s.Paused, err = parseBool(value)
	case "KEY_LIMIT":
		s.KeyLimit, err = parseCount(value, 1, 1<<31-1)
	case "MIN_SPAN":
		var n int
		n, err = parseCount(value, 1, 1<<31-1)
		s.MinSpan = int64(n)
	default:
		return fmt.Errorf("unknown key in [stage-%s]", s.Name)
	}
	return err
}

// validateGraph checks that every stage has a PROGRAM and every NEXT names a defined stage.
func validateGraph(stages map[string]*StageConfig) error {
	names := make([]string, 0, len(stages))
	for n := range stages {
		names = append(names, n)
	}
	slices.Sort(names) // report the same error every time
	for _, n := range names {
		s := stages[n]
		if s.Program == "" {
			return &configError{s.origin[""], "PROGRAM", fmt.Sprintf("[stage-%s] has no PROGRAM", n)}
		}
		for _, next := range s.Next {
			if _, ok := stages[next]; !ok {
				return &configError{s.origin["NEXT"], "NEXT", fmt.Sprintf("names stage %q, which is not defined", next)}
			}
		}
	}
	return nil
}

// parseDuration accepts plain seconds ("300", "0.5") or a number with a unit suffix
// ("250ms", "5s", "2m", "1h", "7d" for retention periods).
func parseDuration(v string) (time.Duration, error) {
	num, unit := v, time.Second
	for _, u := range []struct {
		suffix string
		d      time.Duration
	}{{"ms", time.Millisecond}, {"s", time.Second}, {"m", time.Minute}, {"h", time.Hour}, {"d", 24 * time.Hour}} {
		if strings.HasSuffix(v, u.suffix) {
			num, unit = strings.TrimSpace(strings.TrimSuffix(v, u.suffix)), u.d
			break
		}
	}
	f, err := strconv.ParseFloat(num, 64)
	if err != nil || f < 0 || f != f || f > float64(1<<62)/float64(unit) {
		return 0, fmt.Errorf("want a duration such as 30, 0.5, 250ms, 5s, 2m or 1h, got %q", v)
	}
	return time.Duration(f * float64(unit)), nil
}

func parsePositiveDuration(v string) (time.Duration, error) {
	d, err := parseDuration(v)
	if err == nil && d <= 0 {
		err = fmt.Errorf("must be greater than zero, got %q", v)
	}
	return d, err
}

func parseCount(v string, lo, hi int) (int, error) {
	n, err := strconv.Atoi(v)
	if err != nil || n < lo || n > hi {
		return 0, fmt.Errorf("want a whole number from %d to %d, got %q", lo, hi, v)
	}
	return n, nil
}

func parseBool(v string) (bool, error) {
	switch strings.ToLower(v) {
	case "yes", "true", "on", "1":
		return true, nil
	case "no", "false", "off", "0", "":
		return false, nil
	}
	return false, fmt.Errorf("want yes or no, got %q", v)
}
