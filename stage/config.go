// config.go: a stage program's configuration: Config, its validation, and LoadConfig, which
// reads it from the command line and the environment the dispatcher starts a worker with
// (doc.go, "Start"). It reads nothing else: the -c FILE is the program's own business.

package stage

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// Config is what a stage program is started with. Run reads it from the command line and the
// environment (LoadConfig); embedding programs and tests fill it in for Serve, which checks it
// before it connects. Serve keeps Next and Fuse as they are, without a copy: do not change
// them while it runs.
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
	// the defaults (MaxChildrenDefault, MinSpanDefault; doc/design/fanin.md, "Configuration").
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
// PEPSI_FUSE, PEPSI_DSN, PEPSI_MAX_CHILDREN and PEPSI_MIN_SPAN from the environment. Programs
// that need the configuration before serving call it and then Serve (or ServeStages); the
// others just call Run (or RunStages), which exits 2 where LoadConfig returns an error.
//
// It returns an error for other arguments, an unset PEPSI_DSN (the program was not started by
// pepsi-dispatch), a stage name that is not [a-z0-9_-]+, a malformed PEPSI_FUSE, or a
// PEPSI_MAX_CHILDREN or PEPSI_MIN_SPAN that is not a positive whole number. It connects to
// nothing.
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
