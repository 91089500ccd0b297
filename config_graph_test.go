package main

import (
	"context"
	"database/sql"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
)

// graphCase is a file's stage sections, rows the config table has before, and one
// transaction's change of the table.
type graphCase struct {
	name   string
	file   string // INI text of [stage-*] sections
	before []overlayRow
	change string // SQL run in one transaction
}

var graphCases = []graphCase{
	{"nothing in the table", "[stage-a]\nPROGRAM = /x\nNEXT = b\n[stage-b]\nPROGRAM = /x\n", nil, `SELECT 1`},
	{"NEXT to a misspelt stage", "[stage-a]\nPROGRAM = /x\nNEXT = b\n[stage-b]\nPROGRAM = /x\n", nil,
		`INSERT INTO config VALUES ('stage-a', 'NEXT', 'b deliverr')`},
	{"NEXT to a stage added in the same transaction, after", "[stage-a]\nPROGRAM = /x\n", nil,
		`INSERT INTO config VALUES ('stage-a', 'NEXT', 'c'); INSERT INTO config VALUES ('stage-c', 'PROGRAM', '/y')`},
	{"a setting of a misspelt section", "[stage-deliver]\nPROGRAM = /x\n", nil,
		`INSERT INTO config VALUES ('stage-delivr', 'PARALLELISM', '4')`},
	{"a setting of a stage of the file", "[stage-deliver]\nPROGRAM = /x\n", nil,
		`INSERT INTO config VALUES ('stage-deliver', 'PARALLELISM', '4')`},
	{"the PROGRAM of a stage only the table defines, deleted", "[stage-a]\nPROGRAM = /x\n",
		[]overlayRow{{"stage-x", "PROGRAM", "/y"}, {"stage-x", "MAX_ATTEMPTS", "3"}},
		`DELETE FROM config WHERE section = 'stage-x' AND key = 'PROGRAM'`},
	{"a stage only the table defines, deleted whole", "[stage-a]\nPROGRAM = /x\n",
		[]overlayRow{{"stage-x", "PROGRAM", "/y"}, {"stage-x", "MAX_ATTEMPTS", "3"}},
		`DELETE FROM config WHERE section = 'stage-x'`},
	{"a stage the file's NEXT names, deleted", "[stage-a]\nPROGRAM = /x\nNEXT = x\n",
		[]overlayRow{{"stage-x", "PROGRAM", "/y"}},
		`DELETE FROM config WHERE section = 'stage-x'`},
	{"the file's NEXT replaced by the table's", "[stage-a]\nPROGRAM = /x\nNEXT = gone\n[stage-gone]\nPROGRAM = /x\n", nil,
		`INSERT INTO config VALUES ('stage-a', 'NEXT', '')`},
	{"a PAUSED row of no stage", "[stage-a]\nPROGRAM = /x\n", nil,
		`INSERT INTO config VALUES ('stage-nowhere', 'PAUSED', 'yes')`},
	{"NEXT split on Go's white space (no-break space)", "[stage-a]\nPROGRAM = /x\n[stage-b]\nPROGRAM = /x\n", nil,
		`INSERT INTO config VALUES ('stage-a', 'NEXT', 'b' || chr(160) || 'c')`},
	{"NEXT split on Go's white space, both defined", "[stage-a]\nPROGRAM = /x\n[stage-b]\nPROGRAM = /x\n[stage-c]\nPROGRAM = /x\n", nil,
		`INSERT INTO config VALUES ('stage-a', 'NEXT', E'b\u2003c\t')`},
	{"a file stage without PROGRAM, the table gives it", "[stage-a]\nNEXT =\n", []overlayRow{{"stage-a", "PROGRAM", "/y"}},
		`UPDATE config SET value = '/z' WHERE section = 'stage-a'`},
	{"rows of another section", "[stage-a]\nPROGRAM = /x\n", nil,
		`INSERT INTO config VALUES ('pepsi-dispatch', 'NEXT', 'nowhere')`},
	{"the table truncated: the file's NEXT names a stage only the table had", "[stage-a]\nPROGRAM = /x\nNEXT = x\n",
		[]overlayRow{{"stage-x", "PROGRAM", "/y"}}, `TRUNCATE config`},
	{"the table truncated: the file stands alone", "[stage-a]\nPROGRAM = /x\n",
		[]overlayRow{{"stage-x", "PROGRAM", "/y"}, {"stage-a", "NEXT", "x"}}, `TRUNCATE config`},
	{"the table emptied and a row put back in one transaction", "[stage-a]\nPROGRAM = /x\nNEXT = x\n",
		[]overlayRow{{"stage-x", "PROGRAM", "/y"}}, `DELETE FROM config; INSERT INTO config VALUES ('stage-x', 'PROGRAM', '/z')`},
}

// TestConfigGraphCheckAgreesWithDaemon: the config table's graph check (config_graph_check,
// at each commit that writes the table) refuses exactly the tables whose graph, with the
// running dispatcher's file, buildStages refuses: the reload that would have ended the
// dispatcher, and every start after it, is a refused commit instead.
func TestConfigGraphCheckAgreesWithDaemon(t *testing.T) {
	s := newTestSchema(t)
	ctx := context.Background()
	for _, c := range graphCases {
		entries, err := parseINI("f", strings.NewReader(c.file))
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		s.exec(t, `UPDATE dispatch_instance SET file_stages = NULL`) // no check while the case is set up
		s.exec(t, `DELETE FROM config`)
		for _, r := range c.before {
			s.exec(t, `INSERT INTO config (section, key, value) VALUES ($1, $2, $3)`, r.Section, r.Key, r.Value)
		}
		if _, err := buildStages(entries, c.before); err != nil {
			t.Fatalf("%s: the case's table before its change is refused: %v", c.name, err)
		}
		s.exec(t, `UPDATE dispatch_instance SET file_stages = $1::jsonb`, fileStagesJSON(entries))

		tx, err := s.DB.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.ExecContext(ctx, c.change); err != nil {
			// A TRUNCATE is checked as it runs (no constraint trigger can be on it): judged
			// by the table it would have left, empty.
			tx.Rollback()
			if !strings.HasPrefix(c.change, "TRUNCATE") {
				t.Fatalf("%s: %v", c.name, err)
			}
			_, goErr := buildStages(entries, nil)
			judgeGraph(t, c.name, goErr, err)
			continue
		}
		var overlay []overlayRow
		rows, err := tx.QueryContext(ctx, `SELECT section, key, value FROM config ORDER BY section, key`)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var r overlayRow
			if err := rows.Scan(&r.Section, &r.Key, &r.Value); err != nil {
				t.Fatal(err)
			}
			overlay = append(overlay, r)
		}
		rows.Close()
		_, goErr := buildStages(entries, overlay)
		judgeGraph(t, c.name, goErr, tx.Commit())
	}
}

// judgeGraph compares the dispatcher's verdict on a graph (goErr) with the table's check's.
func judgeGraph(t *testing.T, name string, goErr, sqlErr error) {
	t.Helper()
	switch {
	case goErr == nil && sqlErr != nil:
		t.Errorf("%s: the table's check refuses a graph the dispatcher takes: %v", name, sqlErr)
	case goErr != nil && sqlErr == nil:
		t.Errorf("%s: the table's check lets through a graph the dispatcher refuses (%v)", name, goErr)
	case sqlErr != nil && !strings.Contains(sqlErr.Error(), "(23514)"):
		t.Errorf("%s: %v, want a check violation", name, sqlErr)
	default:
		t.Logf("%s: dispatcher %v; table %v", name, goErr, sqlErr)
	}
}

// TestConfigGraphTypoRefusedDaemonRuns: with a dispatcher running, an operator's NEXT to a
// misspelt stage in the config table is refused at its commit, with the dispatcher's words
// and the file's stages, and the dispatcher goes on. Before, the row went in, the reload it
// asked for found the graph broken, and the dispatcher ended with status 1, as it did at
// every start after that. A NEXT to a stage added in the same transaction goes in, and the
// messages take the new path. A file changed and reloaded (SIGHUP) is what the check judges by.
func TestConfigGraphTypoRefusedDaemonRuns(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	conf := baseConf(s, "") + stageConf(t, "a", "", "")
	d := startDaemon(t, conf, "pipeline")
	d.waitLog("dispatching", dbStatementBudget)

	_, err := s.DB.Exec(`INSERT INTO config (section, key, value) VALUES ('stage-a', 'NEXT', 'delivr')`)
	if err == nil || !strings.Contains(err.Error(), `[stage-a] NEXT names stage "delivr", which is not defined`) {
		t.Fatalf("a NEXT to a misspelt stage: %v, want a refusal in the dispatcher's words", err)
	}
	if n := s.count(t, `SELECT count(*) FROM config`); n != 0 {
		t.Fatalf("the refused row is in the table (%d rows)", n)
	}

	tx, err := s.DB.Begin()
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		`INSERT INTO config (section, key, value) VALUES ('stage-a', 'NEXT', 'b')`,
		`INSERT INTO config (section, key, value) VALUES ('stage-b', 'PROGRAM', '` + testWorkerBin(t) + `')`,
	} {
		if _, err := tx.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatalf("a NEXT to a stage added in the same transaction: %v", err)
	}
	d.waitLog("stage graph reloaded", 10*time.Second)
	enqueue(t, s, "a", 3, `{}`)
	waitFor(t, 10*time.Second, "three messages through a and then b", func() bool {
		return s.count(t, `SELECT count(*) FROM runs WHERE stage = 'b'`) == 3
	})

	// The file gains stage c and is reloaded: a NEXT to c goes in.
	if err := os.WriteFile(d.conf, []byte(conf+stageConf(t, "c", "", "")), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := d.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the file's stage c published", func() bool {
		return s.count(t, `SELECT count(*) FROM dispatch_instance WHERE file_stages ? 'c'`) == 1
	})
	if _, err := s.DB.Exec(`UPDATE config SET value = 'b c' WHERE section = 'stage-a' AND key = 'NEXT'`); err != nil {
		t.Errorf("a NEXT to a stage the reloaded file defines: %v", err)
	}
	select {
	case <-d.done:
		t.Fatalf("the dispatcher ended (status %d)", d.status)
	default:
	}
	d.stop()
	if strings.Contains(d.log.String(), "does not validate") {
		t.Errorf("the dispatcher met a graph that does not validate:\n%s", lastLines(d.log.String(), 10))
	}
}

// TestConfigGraphCheckNarrowRole: a role granted the config table alone (an operator's role
// for stage settings) writes a row the graph takes, and is refused one it does not, in the
// dispatcher's words: the check reads dispatch_instance as the schema's owner (SECURITY
// DEFINER). Run as the writer, it failed every write of such a role, "permission denied for
// table dispatch_instance".
func TestConfigGraphCheckNarrowRole(t *testing.T) {
	s := newTestSchema(t)
	entries, err := parseINI("f", strings.NewReader("[stage-a]\nPROGRAM = /x\n[stage-b]\nPROGRAM = /x\n"))
	if err != nil {
		t.Fatal(err)
	}
	s.exec(t, `UPDATE dispatch_instance SET file_stages = $1::jsonb`, fileStagesJSON(entries))
	role := "narrow_" + s.Name
	s.exec(t, `CREATE ROLE `+role+` LOGIN NOSUPERUSER`)
	t.Cleanup(func() {
		s.DB.Exec(`DROP OWNED BY ` + role)
		s.DB.Exec(`DROP ROLE IF EXISTS ` + role)
	})
	s.exec(t, `GRANT USAGE ON SCHEMA `+s.Name+` TO `+role)
	s.exec(t, `GRANT SELECT, INSERT, UPDATE, DELETE ON `+s.Name+`.config TO `+role)
	db, err := sql.Open("postgres", s.DSN+" user="+role)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec(`INSERT INTO config (section, key, value) VALUES ('stage-a', 'NEXT', 'b')`); err != nil {
		t.Errorf("a NEXT to a stage of the file, by a role granted the config table: %v", err)
	}
	_, err = db.Exec(`INSERT INTO config (section, key, value) VALUES ('stage-b', 'NEXT', 'c')`)
	if err == nil || !strings.Contains(err.Error(), `[stage-b] NEXT names stage "c", which is not defined`) {
		t.Errorf("a NEXT to a stage defined nowhere, by a role granted the config table: %v", err)
	}
}
