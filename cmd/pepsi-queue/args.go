// args.go: the command line: global options, the command, its filter, ids and options.

package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"pepsi-dispatch/internal/conffile"
)

// usageError is a mistake on the command line or in the configuration: exit status 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, a ...any) error { return &usageError{fmt.Sprintf(format, a...)} }

// errHelp is --help (-h, help): the usage is then the answer, on standard output with exit
// status 0 (pepsi-queue --help | less), not a usage error.
var errHelp = errors.New("help asked for")

const usageText = `usage: pepsi-queue [-c FILE] [--json] COMMAND [ARGUMENTS]

commands:
  status                              counts per stage and status, oldest pending, paused stages
  shape [--stage S] [--status ST]     messages per stage by age of their last state change
  list [FILTER] [--limit N]           one message per line
  show ID...                          each message whole
  errors [FILTER]                     failures grouped by signature
  retry [--reset] SELECTION           failed, cancelled, paused, held -> pending
  hold SELECTION                      pending, paused -> held
  release SELECTION                   held -> pending
  cancel SELECTION                    pending, paused, held, waiting, running -> cancelled
  delete SELECTION                    done, failed, cancelled -> removed
  pause STAGE, resume STAGE           stop / restart claiming for one stage

SELECTION: ids as arguments, - (ids on standard input), or FILTER --all
FILTER: --stage S --status ST[,ST] --error TEXT --signature SIG --older DURATION
        --id-from N --id-to N
more than 1,000 rows need --yes, or a yes on the terminal
`

// invocation is one parsed command line.
type invocation struct {
	config  string
	json    bool
	command string
	ids     []int64
	stdin   bool // "-": ids on standard input
	all     bool
	yes     bool
	reset   bool
	limit   int
	filter  map[string]string // operate.sql's filter keys
	words   []string          // the filter as given, for operator_log
	stages  []string          // pause, resume
}

var commands = map[string]bool{
	"status": true, "shape": true, "list": true, "show": true, "errors": true,
	"retry": true, "hold": true, "release": true, "cancel": true, "delete": true,
	"pause": true, "resume": true,
}

func isAction(c string) bool {
	switch c {
	case "retry", "hold", "release", "cancel", "delete":
		return true
	}
	return false
}

// parseArgs parses the whole command line; options may come before or after the command.
func parseArgs(args []string) (*invocation, error) {
	inv := &invocation{config: "/etc/pepsi/pepsi.conf", limit: 100, filter: map[string]string{}}
	value := func(i *int, name string) (string, error) {
		if *i+1 >= len(args) {
			return "", usagef("%s needs a value", name)
		}
		*i++
		return args[*i], nil
	}
	for i := 0; i < len(args); i++ {
		a := args[i]
		name, val, hasVal := strings.Cut(a, "=")
		if !strings.HasPrefix(a, "-") || a == "-" {
			hasVal = false
			name = a
		}
		get := func() (string, error) {
			if hasVal {
				return val, nil
			}
			return value(&i, name)
		}
		var err error
		var v string
		switch name {
		case "-c", "--config":
			inv.config, err = get()
		case "--json", "-j":
			inv.json = true
		case "--all":
			inv.all = true
		case "--yes", "-y":
			inv.yes = true
		case "--reset":
			inv.reset = true
		case "-h", "--help", "help":
			return nil, errHelp
		case "--limit":
			if v, err = get(); err == nil {
				inv.limit, err = strconv.Atoi(v)
				if err != nil || inv.limit < 1 {
					err = usagef("--limit: want a positive whole number, got %q", v)
				}
			}
		case "--stage", "--status", "--error", "--signature", "--older", "--id-from", "--id-to":
			if v, err = get(); err == nil {
				err = inv.addFilter(name, v)
			}
		case "-":
			inv.stdin = true
		default:
			switch {
			case strings.HasPrefix(a, "-"):
				err = usagef("unknown option %s", a)
			case inv.command == "":
				if !commands[a] {
					err = usagef("unknown command %q (pepsi-queue --help lists them)", a)
				}
				inv.command = a
			case inv.command == "pause" || inv.command == "resume":
				err = checkText("stage name", a)
				inv.stages = append(inv.stages, a)
			default:
				id, perr := strconv.ParseInt(a, 10, 64)
				if perr != nil || id < 1 {
					err = usagef("%s: not a message id", a)
				}
				inv.ids = append(inv.ids, id)
			}
		}
		if err != nil {
			var ue *usageError
			if errors.As(err, &ue) {
				return nil, err
			}
			return nil, usagef("%s", err)
		}
	}
	if err := inv.check(); err != nil {
		return nil, err // nothing half-checked for a caller to act on
	}
	return inv, nil
}

func (inv *invocation) addFilter(name, v string) error {
	key := strings.ReplaceAll(strings.TrimPrefix(name, "--"), "-", "_")
	if err := checkText(name, v); err != nil {
		return err
	}
	switch key {
	case "status":
		// Stored as checked: the SQL side splits on commas and drops only spaces, so " \tfailed"
		// would pass here and match nothing there.
		list := strings.Split(v, ",")
		for i, s := range list {
			list[i] = strings.TrimSpace(s)
			switch list[i] {
			case "pending", "running", "paused", "waiting", "done", "failed", "held", "cancelled":
			default:
				return usagef("--status: %q is not a status (pending, running, paused, waiting, held, done, failed, cancelled)", s)
			}
		}
		v = strings.Join(list, ",")
	case "older":
		d, err := parseDuration(v)
		if err != nil {
			return usagef("--older: %v", err)
		}
		v = strconv.FormatFloat(d.Seconds(), 'f', -1, 64) + " seconds"
	case "id_from", "id_to":
		if n, err := strconv.ParseInt(v, 10, 64); err != nil || n < 0 {
			return usagef("%s: want a message id, got %q", name, v)
		}
	}
	inv.filter[key] = v
	inv.words = append(inv.words, name+" "+quoteWord(v))
	return nil
}

// checkText refuses what PostgreSQL cannot hold as text (invalid UTF-8, NUL): json.Marshal
// would turn the first into U+FFFD, a filter other than the one typed, and the server would
// refuse the second with an error that does not name the option.
func checkText(name, v string) error {
	if !utf8.ValidString(v) || strings.IndexByte(v, 0) >= 0 {
		return usagef("%s %q: not valid text (UTF-8 without NUL)", name, v)
	}
	return nil
}

func quoteWord(v string) string {
	if v == "" || strings.ContainsAny(v, " \t'\"\\") {
		return strconv.Quote(v)
	}
	return v
}

// check enforces what goes with what.
func (inv *invocation) check() error {
	switch {
	case inv.command == "":
		return usagef("no command given\n%s", strings.TrimSuffix(usageText, "\n"))
	case inv.command == "pause" || inv.command == "resume":
		if len(inv.stages) != 1 {
			return usagef("%s takes one stage name", inv.command)
		}
		if len(inv.filter) > 0 || inv.all || inv.stdin {
			return usagef("%s takes a stage name only", inv.command)
		}
	case inv.command == "show":
		if len(inv.ids) == 0 && !inv.stdin {
			return usagef("show needs message ids (or - for ids on standard input)")
		}
	case isAction(inv.command):
		hasIDs := len(inv.ids) > 0 || inv.stdin
		switch {
		case hasIDs && len(inv.filter) > 0:
			return usagef("%s: give ids or a filter with --all, not both", inv.command)
		case !hasIDs && len(inv.filter) == 0 && !inv.all:
			return usagef("%s: name the messages: ids, - (ids on standard input), or a filter with --all", inv.command)
		case !hasIDs && !inv.all:
			return usagef("%s: a filter acts only with --all (it selects every matching message)", inv.command)
		case hasIDs && inv.all:
			return usagef("%s: --all goes with a filter, not with ids", inv.command)
		}
		if inv.reset && inv.command != "retry" {
			return usagef("--reset goes with retry only")
		}
	default: // queries
		if len(inv.ids) > 0 || inv.stdin || inv.all {
			return usagef("%s takes no ids and no --all", inv.command)
		}
		if inv.command == "shape" || inv.command == "status" {
			for k := range inv.filter {
				if inv.command == "status" || (k != "stage" && k != "status") {
					return usagef("%s does not take --%s", inv.command, strings.ReplaceAll(k, "_", "-"))
				}
			}
		}
	}
	if inv.reset && inv.command != "retry" {
		return usagef("--reset goes with retry only")
	}
	return nil
}

// filterJSON is the filter as operate.sql's functions take it.
func (inv *invocation) filterJSON() string {
	b, _ := json.Marshal(inv.filter) // a map of strings always marshals
	return string(b)
}

// filterText is the selection as given, for operator_log.
func (inv *invocation) filterText() string {
	switch {
	case inv.all:
		return strings.Join(append(inv.words, "--all"), " ")
	case inv.stdin:
		return "ids on standard input"
	}
	return ""
}

// parseDuration accepts Go's forms such as 1h30m and what the daemon's configuration accepts
// (plain seconds, or a number with ms, s, m, h or d: conffile.ParseDuration).
func parseDuration(v string) (time.Duration, error) {
	if d, err := time.ParseDuration(v); err == nil && d >= 0 {
		return d, nil
	}
	d, err := conffile.ParseDuration(v)
	if err != nil {
		return 0, fmt.Errorf("want a duration such as 90, 30s, 10m, 2h, 7d or 1h30m, got %q", v)
	}
	return d, nil
}
