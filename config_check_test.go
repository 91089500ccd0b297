package main

// The config table's check (schema.sql: config_check) against the daemon's reading of the
// same row (buildStages): a row the trigger refuses is one the daemon would refuse, and a row
// the daemon would refuse on its own (not for want of the file) is refused by the trigger.

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"unicode/utf8"
)

// configRowVerdicts inserts the row in a transaction it rolls back, and reads it as the daemon
// does on top of a file that defines stages a and b.
func configRowVerdicts(t *testing.T, s *testSchema, section, key, value string) (sqlErr, goErr error) {
	t.Helper()
	ctx := context.Background()
	tx, err := s.DB.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	_, sqlErr = tx.ExecContext(ctx, `INSERT INTO config (section, key, value) VALUES ($1, $2, $3)`, section, key, value)
	if sqlErr != nil && !strings.Contains(sqlErr.Error(), "(23514)") {
		t.Fatalf("INSERT (%q, %q, %q): %v, want a check violation or nothing", section, key, value, sqlErr)
	}
	file := []iniEntry{
		{Section: "stage-a", Key: "PROGRAM", Value: "/bin/true", Where: "f:1"},
		{Section: "stage-b", Key: "PROGRAM", Value: "/bin/true", Where: "f:2"},
	}
	_, goErr = buildStages(file, []overlayRow{{Section: section, Key: key, Value: value}})
	return sqlErr, goErr
}

// laxRetryDelay is a RETRY_DELAY the trigger leaves to the dispatcher: a hexadecimal float,
// digits with '_' (Go's ParseFloat takes "0_0"), or an exponent past numeric's range.
var laxRetryDelay = regexp.MustCompile(`(?i)0x|_|e[+-]?0*[0-9]{4,}`)

func checkConfigRow(t *testing.T, s *testSchema, section, key, value string) {
	t.Helper()
	sqlErr, goErr := configRowVerdicts(t, s, section, key, value)
	defined := section == "stage-a" || section == "stage-b"
	switch {
	case sqlErr != nil && goErr == nil && !(key == "PAUSED" && !defined):
		// A PAUSED row of a stage defined nowhere is ignored by the dispatcher; one whose
		// value is no boolean is refused here, before the stage is defined.
		t.Errorf("(%q, %q, %q): the trigger refuses what the dispatcher takes: %v", section, key, value, sqlErr)
	case sqlErr == nil && goErr != nil && defined && key != "NEXT" && !(key == "RETRY_DELAY" && laxRetryDelay.MatchString(value)):
		t.Errorf("(%q, %q, %q): the trigger lets through what the dispatcher refuses: %v", section, key, value, goErr)
	}
}

var configRowSeeds = [][3]string{
	{"stage-a", "PARALLELISM", "4"}, {"stage-a", "PARALELLISM", "4"}, {"stage-a", "PARALLELISM", "four"},
	{"stage-a", "PARALLELISM", "+7"}, {"stage-a", "PARALLELISM", "007"}, {"stage-a", "PARALLELISM", "10001"},
	{"stage-a", "PARALLELISM", " 4"}, {"stage-a", "PARALLELISM", "99999999999999999999999"},
	{"stage-a", "QUEUE_LIMIT", "1000"}, {"stage-a", "QUEUE_LIMIT", "1001"}, {"stage-b", "MAX_ATTEMPTS", "0"},
	{"stage-a", "MAX_MESSAGES", "2147483647"}, {"stage-a", "MAX_CHILDREN", "10000001"}, {"stage-a", "KEY_LIMIT", "-1"},
	{"stage-a", "MIN_SPAN", "1"}, {"stage-a", "RETRY_DELAY", "5s"}, {"stage-a", "RETRY_DELAY", "5 s"},
	{"stage-a", "RETRY_DELAY", " 5s "}, {"stage-a", "RETRY_DELAY", " 5"}, {"stage-a", "RETRY_DELAY", "0.5"},
	{"stage-a", "RETRY_DELAY", "1e3ms"}, {"stage-a", "RETRY_DELAY", "-0"}, {"stage-a", "RETRY_DELAY", "-1s"},
	{"stage-a", "RETRY_DELAY", ".5m"}, {"stage-a", "RETRY_DELAY", "5."}, {"stage-a", "RETRY_DELAY", "inf"},
	{"stage-a", "RETRY_DELAY", "NaN"}, {"stage-a", "RETRY_DELAY", "5 sec"}, {"stage-a", "RETRY_DELAY", "200000d"},
	{"stage-a", "RETRY_DELAY", "0x1p-2"}, {"stage-a", "RETRY_DELAY", "1e99999999"}, {"stage-a", "RETRY_DELAY", "5\u00a0s"},
	{"stage-a", "FUSE", "yes"}, {"stage-a", "FUSE", "Maybe"}, {"stage-a", "FUSE", ""}, {"stage-a", "FUSE", "ON"},
	{"stage-a", "PAUSED", "yes"}, {"stage-a", "PAUSED", "si"}, {"stage-zzz", "PAUSED", "yes"}, {"stage-zzz", "PAUSED", "si"},
	{"stage-a", "PROGRAM", ""}, {"stage-a", "PROGRAM", "/usr/bin/x"}, {"stage-c", "PROGRAM", "/usr/bin/x"},
	{"stage-a", "NEXT", "b"}, {"stage-a", "NEXT", "B"}, {"stage-a", "NEXT", " b\u00a0a "}, {"stage-a", "NEXT", "nowhere"},
	{"stage-A", "PROGRAM", "/x"}, {"stage-", "PROGRAM", "/x"}, {"stage-a", "parallelism", "4"}, {"stage-a", "", "4"},
	{"stage-a", "MAX_RUNTIME", "5"}, {"pepsi-dispatch", "USER", "root"}, {"other", "anything", "at all"},
}

// TestConfigCheckAgreesWithDaemon: the cases above, which include the rows that stopped the
// dispatcher before the trigger (a misspelt key, a word for a number, a stage name in capitals).
func TestConfigCheckAgreesWithDaemon(t *testing.T) {
	s := newTestSchema(t)
	for _, c := range configRowSeeds {
		checkConfigRow(t, s, c[0], c[1], c[2])
	}
	for _, c := range [][3]string{{"stage-a", "PARALELLISM", "4"}, {"stage-a", "PARALLELISM", "four"}, {"stage-A", "PROGRAM", "/x"}} {
		if sqlErr, _ := configRowVerdicts(t, s, c[0], c[1], c[2]); sqlErr == nil {
			t.Errorf("(%q, %q, %q): the trigger lets it through", c[0], c[1], c[2])
		}
	}
	_, err := s.DB.Exec(`INSERT INTO config (section, key, value) VALUES ('stage-a', 'PARALELLISM', '4')`)
	if err == nil || !strings.Contains(err.Error(), `config table (section "stage-a"): PARALELLISM: unknown key in [stage-a]`) {
		t.Errorf("a misspelt key: %v, want the dispatcher's words", err)
	}
}

func FuzzConfigCheck(f *testing.F) {
	for _, c := range configRowSeeds {
		f.Add(c[0], c[1], c[2])
	}
	s := newTestSchema(f)
	f.Fuzz(func(t *testing.T, section, key, value string) {
		for _, x := range []string{section, key, value} {
			if !utf8.ValidString(x) || strings.IndexByte(x, 0) >= 0 {
				return // text PostgreSQL cannot hold: no such row can exist
			}
		}
		checkConfigRow(t, s, section, key, value)
	})
}
