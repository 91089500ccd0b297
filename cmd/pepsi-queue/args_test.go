package main

import (
	"encoding/json"
	"errors"
	"maps"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzQueueArgs: whatever the command line, parseArgs refuses it as a usage error (exit 2)
// or returns an invocation whose filter reaches operate.sql's functions as typed: text
// PostgreSQL can hold, through json.Marshal unchanged (it would replace invalid UTF-8), a
// status list in the form the SQL side splits, ids and durations it can cast. Arguments are
// separated by NUL in the fuzzer's string (an argument holds none, but the test puts NUL
// inside one too, through the value after "=").
func FuzzQueueArgs(f *testing.F) {
	for _, s := range []string{"status", "list\x00--stage\x00a\x00--status\x00failed, pending",
		"retry\x00--error=relay\x00--all", "cancel\x001\x002", "hold\x00-", "pause\x00a",
		"list\x00--older\x001h30m", "list\x00--id-from=5\x00--id-to\x009", "list\x00--status\x00\tfailed",
		"list\x00--error\x00\xff", "list\x00--stage=a\x00", "retry\x00--reset\x00--signature\x00abc\x00--all",
		"--json\x00errors\x00--limit\x003", "-c\x00/f\x00show\x00+5", "shape\x00--status=done,", "-h", "retry\x00--help"} {
		f.Add(s)
	}
	older := regexp.MustCompile(`^[0-9.e+]+ seconds$`)
	f.Fuzz(func(t *testing.T, line string) {
		args := strings.Split(line, "\x00")
		inv, err := parseArgs(args)
		if errors.Is(err, errHelp) { // the usage asked for: the answer, and nothing else runs
			if inv != nil {
				t.Fatalf("parseArgs(%q): help and an invocation %+v", args, inv)
			}
			return
		}
		if err != nil {
			var ue *usageError
			if !errors.As(err, &ue) || ue.msg == "" || inv != nil {
				t.Fatalf("parseArgs(%q): %v, %+v; want a usage error and no invocation", args, err, inv)
			}
			return
		}
		if !commands[inv.command] || inv.limit < 1 {
			t.Fatalf("parseArgs(%q) = %+v", args, inv)
		}
		for _, id := range inv.ids {
			if id < 1 {
				t.Fatalf("parseArgs(%q): id %d", args, id)
			}
		}
		for _, s := range inv.stages {
			if !utf8.ValidString(s) || strings.IndexByte(s, 0) >= 0 {
				t.Fatalf("parseArgs(%q): stage %q", args, s)
			}
		}
		var back map[string]string
		if err := json.Unmarshal([]byte(inv.filterJSON()), &back); err != nil || !maps.Equal(back, inv.filter) {
			t.Fatalf("parseArgs(%q): filter %q reaches SQL as %q (%v)", args, inv.filter, back, err)
		}
		for k, v := range inv.filter {
			if !utf8.ValidString(v) || strings.IndexByte(v, 0) >= 0 {
				t.Fatalf("parseArgs(%q): filter %s = %q", args, k, v)
			}
			switch k {
			case "status":
				for _, s := range strings.Split(v, ",") {
					if !strings.Contains("|pending|running|paused|waiting|done|failed|held|cancelled|", "|"+s+"|") || s == "" {
						t.Fatalf("parseArgs(%q): status list %q, want statuses separated by commas", args, v)
					}
				}
			case "id_from", "id_to":
				if n, err := strconv.ParseInt(v, 10, 64); err != nil || n < 0 {
					t.Fatalf("parseArgs(%q): %s = %q", args, k, v)
				}
			case "older":
				if !older.MatchString(v) {
					t.Fatalf("parseArgs(%q): older = %q, want N seconds", args, v)
				}
			case "stage", "error", "signature":
			default:
				t.Fatalf("parseArgs(%q): filter key %q", args, k)
			}
		}
	})
}
