// diskfull_test.go: the database server's disk full, then freed.

package main

import (
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"pepsi-dispatch/internal/pgtest"
)

// TestDatabaseDiskFull: the disk under the database fills up while a backlog runs (a cluster
// on a tmpfs of its own, filled by a file), stays full for a while, and is freed, as a DBA
// would. The server refuses what needs a new page (53100, "could not extend file"): the claim
// is refused and tried again every second, the statistics are kept for the next flush, and a
// worker's batch that the full disk refused is put back without an attempt (diskfull.go; on
// the code before, 31 to 152 of the 20,000 were charged, in six runs of eight). Once the disk
// is freed every message is done, none failed, none ran twice, none was charged, and the log
// says the claims are taken again if it said they were refused. Needs root, for the mount; it
// skips, saying so, without.
func TestDatabaseDiskFull(t *testing.T) {
	diskFullBacklog(t, nil, stageConf(t, "a", "", diskFullStage), "pipeline", `{"sleep_ms": 1}`)
}

// TestDatabaseDiskFullPython is TestDatabaseDiskFull with the Python SDK's stage: its batch,
// its outcome statement and its handler's write meet the full disk, each in its own words
// (psycopg's, without lib/pq's SQLSTATE). Needs root, for the mount, and Debian's python3
// with psycopg.
func TestDatabaseDiskFullPython(t *testing.T) { diskFullPython(t, nil, `{"sleep_ms": 1}`) }

// diskFullPython runs diskFullBacklog through the Python SDK's test stage (stage_prog.py), its
// messages with payload; prepare, if not nil, readies the schema's server first.
func diskFullPython(t *testing.T, prepare func(*testSchema), payload string) {
	py := pythonWithPsycopg(t)
	prog, err := filepath.Abs(filepath.Join("python", "tests", "stage_prog.py"))
	if err != nil {
		t.Fatal(err)
	}
	marks := t.TempDir()
	os.Chmod(marks, 0o777) // the workers run as nobody when the tests run as root
	// The program is the script (PROGRAM is a path, no arguments); its "#!/usr/bin/env python3"
	// finds py first on PATH.
	diskFullBacklog(t, prepare, "[stage-a]\nPROGRAM = "+prog+"\nNEXT =\n"+diskFullStage+"\n", "", payload,
		"PATH="+filepath.Dir(py)+string(os.PathListSeparator)+os.Getenv("PATH"),
		"PYTHONPATH="+filepath.Dir(filepath.Dir(prog)), "TEST_MARK_DIR="+marks)
}

// TestDatabaseDiskFullPythonGerman is TestDatabaseDiskFullPython with the server's messages in
// German (lc_messages, as initdb sets it on a German system): a full disk is "konnte Datei
// »…« nicht erweitern: Auf dem Gerät ist kein Speicherplatz mehr verfügbar", and only the
// SQLSTATE, which the Python SDK writes after psycopg's text as lib/pq does, says so to the
// dispatcher. Its handlers write nothing (norecord), so that every write the full disk refuses
// is the SDK's outcome statement, whose failure carries no class name (the SDK before charged
// those); with nothing in the runs table, "none ran twice" checks nothing here. Needs the
// de_DE.UTF-8 locale (.ci/run makes it) and PostgreSQL's German messages.
func TestDatabaseDiskFullPythonGerman(t *testing.T) {
	diskFullPython(t, func(s *testSchema) {
		if _, err := s.DB.Exec(`SET lc_messages = 'de_DE.UTF-8'`); err != nil {
			t.Skipf("the server has no de_DE.UTF-8 locale (%v): the German disk-full test did NOT run", err)
		}
		s.exec(t, `ALTER SYSTEM SET lc_messages = 'de_DE.UTF-8'`)
		s.exec(t, `SELECT pg_reload_conf()`)
		waitFor(t, 10*time.Second, "the server speaks German", func() bool {
			// A new session each time (the pool's may predate the reload): a DSN of its own.
			db, err := sql.Open("postgres", s.DSN)
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()
			_, err = db.Exec(`SELECT 1/0`)
			return err != nil && strings.Contains(err.Error(), "Division durch Null")
		})
	}, `{"sleep_ms": 1, "norecord": true}`)
}

// pythonWithPsycopg returns the tests' Python interpreter (pgtest.Python), as a path, if it
// imports psycopg, or skips, saying so.
func pythonWithPsycopg(t *testing.T) string {
	t.Helper()
	py, err := exec.LookPath(pgtest.Python())
	if err == nil {
		err = exec.Command(py, "-c", "import psycopg").Run()
	}
	if err != nil {
		t.Skipf("%s with psycopg (Debian's python3-psycopg): %v; the Python disk-full test did NOT run", pgtest.Python(), err)
	}
	return py
}

// diskFullStage is the stage's settings in the disk-full backlogs: two workers, each with up to
// 500 messages queued, so that when the disk fills up their batches have messages to run
// against it whoever meets it first. Whether a batch's write needs a new page before the
// claim's does is still the race's: the workers met the full disk in 7 runs of 9 here (all
// three tests), the claim alone in the others; TestDiskFilledByItsMessage and
// TestDiskFullTexts are the tests that do not depend on it.
const diskFullStage = "PARALLELISM = 2\nQUEUE_LIMIT = 500"

// diskFullBacklog: the disk under the database fills up while a backlog of 20,000 runs through
// the stage of section [stage-a], its messages with payload, stays full for a while, and is
// freed (TestDatabaseDiskFull); prepare, if not nil, readies the schema's server before the
// backlog.
func diskFullBacklog(t *testing.T, prepare func(*testSchema), section, worker, payload string, env ...string) {
	root, p := diskFullCluster(t)
	s := p.schema(t)
	if prepare != nil {
		prepare(s)
	}
	s.exec(t, runsDDL)
	const n = 20000
	enqueue(t, s, "a", n, payload)
	d := startDaemon(t, baseConf(s, "")+section, worker, env...)
	waitFor(t, 30*time.Second, "the backlog started", func() bool { return countStatus(t, s, "done") > 0 })

	// Fill the disk: dd writes until the tmpfs refuses (ENOSPC, dd's exit status 1).
	fill := filepath.Join(root, "fill")
	exec.Command("dd", "if=/dev/zero", "of="+fill, "bs=1M").Run()
	// The disk stays full until the dispatcher has met it for a while: a claim refused, or the
	// stage's messages put back for the full disk three times (a hold of a second each, after
	// which its claims run against the disk still full).
	waitFor(t, 30*time.Second, "the dispatcher meets the full disk for a while", func() bool {
		log := d.log.String()
		i := strings.Index(log, "a disk was full; the message goes back to pending")
		return strings.Contains(log, "the database refused this stage's claim alone") ||
			i >= 0 && strings.Count(log[i:], "messages put back to pending") >= 3
	})
	before := countStatus(t, s, "done")
	if err := os.Remove(fill); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 90*time.Second, "every message done once the disk is freed", func() bool {
		return countStatus(t, s, "done") == n
	})
	if before == n {
		t.Fatalf("the backlog was done before the disk filled: nothing was tried")
	}
	if twice := s.count(t, `SELECT count(*) FROM (SELECT id FROM runs GROUP BY id HAVING count(*) > 1) x`); twice != 0 {
		t.Errorf("%d messages ran twice", twice)
	}
	if failed := countStatus(t, s, "failed"); failed != 0 {
		t.Errorf("%d messages failed", failed)
	}
	if charged := s.count(t, `SELECT count(*) FROM workqueue WHERE attempts > 0`); charged != 0 {
		t.Errorf("%d of %d messages were charged an attempt for the full disk", charged, n)
	}
	log := d.log.String()
	if strings.Contains(log, "the database refused this stage's claim alone") &&
		!strings.Contains(log, "the database takes this stage's claims again") {
		t.Errorf("the log never said that the stage's claims are taken again")
	}
	t.Logf("the log said %d times that messages were put back for the full disk", strings.Count(log, "a disk was full; the message goes back to pending"))
	d.stop()
}

// TestDiskFilledByItsMessage: a message whose own query spills its rows to temporary files
// until the database's disk is full (the server frees them as the query fails) is charged as
// the failure it is, not put back for ever to fill the disk again each time: it fails after
// MAX_ATTEMPTS runs, while the messages that ran beside it (two workers: some meet the disk
// full) are done, each once, uncharged.
// Needs root, for the mount.
func TestDiskFilledByItsMessage(t *testing.T) {
	_, p := diskFullCluster(t)
	s := p.schema(t)
	s.exec(t, runsDDL)
	filler := s.count(t, `INSERT INTO workqueue (stage, payload) VALUES ('a', '{"fill_disk_at": "a"}') RETURNING workqueue_id`)
	const n = 1000
	enqueue(t, s, "a", n, `{"sleep_ms": 1}`)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 2\nMAX_ATTEMPTS = 2\nRETRY_DELAY = 0.2"), "pipeline")
	waitFor(t, 120*time.Second, "the filler failed and the others done", func() bool {
		return countStatus(t, s, "failed") == 1 && countStatus(t, s, "done") == n
	})
	if attempts := s.count(t, `SELECT attempts FROM workqueue WHERE workqueue_id = $1 AND status = 'failed'`, filler); attempts != 2 {
		t.Errorf("the filler failed after %d attempts, want 2", attempts)
	}
	// The other worker's messages that met the disk full by the filler are put back (and may
	// be logged so); the filler never is.
	for _, line := range strings.Split(d.log.String(), "\n") {
		if strings.Contains(line, "a disk was full") && strings.Contains(line, fmt.Sprintf(" id=%d ", filler)) {
			t.Errorf("the filler was put back for a full disk: %s", line)
		}
	}
	if charged := s.count(t, `SELECT count(*) FROM workqueue WHERE attempts > 0 AND workqueue_id <> $1`, filler); charged != 0 {
		t.Errorf("%d other messages were charged an attempt", charged)
	}
	if twice := s.count(t, `SELECT count(*) FROM (SELECT id FROM runs GROUP BY id HAVING count(*) > 1) x`); twice != 0 {
		t.Errorf("%d messages ran twice", twice)
	}
	d.stop()
}

// diskFullCluster starts a private cluster on a tmpfs of 160 MB of its own, and returns the
// tmpfs's root: a file written there fills the cluster's disk. It skips, saying so, where a
// tmpfs cannot be mounted (not root).
func diskFullCluster(t *testing.T) (string, *pgPair) {
	t.Helper()
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster of its own")
	}
	root, err := os.MkdirTemp("", "pepsi-test-diskfull-")
	if err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=160m", "tmpfs", root).CombinedOutput(); err != nil {
		os.Remove(root)
		t.Skipf("cannot mount a tmpfs for the cluster (%v: %s): the disk-full test did NOT run", err, out)
	}
	t.Cleanup(func() {
		exec.Command("umount", root).Run()
		os.Remove(root)
	})
	return root, newPGNodesIn(t, root, 1)
}

// TestDiskFullTexts: the failure texts that put a message back for a full disk, as each words
// them (lib/pq's from TestDatabaseDiskFull's and TestDiskFilledByItsMessage's logs, psycopg's
// class name as the Python SDK writes a handler's exception, ENOSPC as Go and Python word it),
// and those that do not: the query's own temporary files, other errors.
func TestDiskFullTexts(t *testing.T) {
	for _, c := range []struct {
		line string
		want bool
	}{
		{`record run: pq: could not extend file "base/5/16587_fsm": No space left on device (53100)`, true},
		{`commit batch transaction: pq: could not extend file "base/5/16386": No space left on device (53100)`, true},
		{`done message 80: pq: could not extend file "base/5/16386": No space left on device (53100)`, true},
		{`DiskFull: could not extend file "base/5/16587": No space left on device HINT:  Check free disk space.`, true},
		{`batch transaction failed: could not extend file "base/5/16386": No space left on device`, true},
		{`write report: write /var/spool/report.csv: no space left on device`, true},
		{`OSError: [Errno 28] No space left on device`, true},
		{`fill the disk: pq: could not write to file "base/pgsql_tmp/pgsql_tmp17511.0": No space left on device (53100)`, false},
		{`pq: could not write block 1234 of temporary file: No space left on device (53100)`, false},
		{`pq: temporary file size exceeds temp_file_limit (1024kB) (53400)`, false},
		{`pq: out of memory (53200)`, false},
		{`asked to fail at a (attempt 1)`, false},
	} {
		if got := isDiskFullText(c.line); got != c.want {
			t.Errorf("isDiskFullText(%q) = %v, want %v", c.line, got, c.want)
		}
	}
}
