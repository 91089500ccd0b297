package main

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/lib/pq"

	"pepsi-dispatch/internal/schemafile"
)

// TestIDsArePositive: a message or a group given an id of 0 or below by hand is refused at
// its INSERT, naming the rule. Every walk over the tables by id starts after 0 (retention's,
// queue_select's pages, fanin_sweep's) and the SDKs read an id line as digits, so such a row
// was never deleted, never listed or acted on by filter, and failed at every stage with "bad
// message id". A database made before the rule gets it when schema.sql is applied again; one
// that holds such rows is refused with their count, and gets the rule once they are gone.
func TestIDsArePositive(t *testing.T) {
	s := newTestSchema(t)
	refused := func(what, query, constraint string) {
		t.Helper()
		_, err := s.DB.Exec(query)
		var pe *pq.Error
		if !errors.As(err, &pe) || pe.Code != "23514" || pe.Constraint != constraint {
			t.Errorf("%s: err %v, want a check violation of %s", what, err, constraint)
		}
	}
	// A group's parent_id is its id here: (parent_id, generation) is unique.
	for _, id := range []string{"0", "-1", "-9223372036854775808"} {
		refused("a message with id "+id,
			`INSERT INTO workqueue (workqueue_id, stage) VALUES (`+id+`, 'a')`, "workqueue_id_positive")
		refused("a group with id "+id,
			`INSERT INTO fanout (fanout_id, parent_id, expected_n) VALUES (`+id+`, `+id+`, 1)`, "fanout_id_positive")
	}
	s.exec(t, `INSERT INTO workqueue (workqueue_id, stage) VALUES (9223372036854775807, 'a')`)
	s.exec(t, `INSERT INTO fanout (fanout_id, parent_id, expected_n) VALUES (9223372036854775807, 9223372036854775807, 1)`)

	ddl := schemaDDL(t)
	// The earlier version's shape, with rows the rule refuses.
	s.exec(t, `ALTER TABLE workqueue DROP CONSTRAINT workqueue_id_positive`)
	s.exec(t, `ALTER TABLE fanout DROP CONSTRAINT fanout_id_positive`)
	s.exec(t, `INSERT INTO workqueue (workqueue_id, stage) VALUES (0, 'a'), (-5, 'a')`)
	s.exec(t, `INSERT INTO fanout (fanout_id, parent_id, expected_n) VALUES (-7, -7, 1)`)
	_, err := s.DB.Exec(ddl)
	if err == nil || !strings.Contains(err.Error(), "2 rows of workqueue have an id of 0 or below") {
		t.Fatalf("apply schema.sql over messages with ids 0 and -5: err %v, want them counted", err)
	}
	s.exec(t, `DELETE FROM workqueue WHERE workqueue_id <= 0`)
	_, err = s.DB.Exec(ddl)
	if err == nil || !strings.Contains(err.Error(), "1 rows of fanout have an id of 0 or below") {
		t.Fatalf("apply schema.sql over a group with id -7: err %v, want it counted", err)
	}
	s.exec(t, `DELETE FROM fanout WHERE fanout_id <= 0`)
	for pass := 1; pass <= 2; pass++ {
		if _, err := s.DB.Exec(ddl); err != nil {
			t.Fatalf("apply schema.sql once the rows are gone (pass %d): %v", pass, err)
		}
		if n := s.count(t, `SELECT count(*) FROM pg_constraint
		     WHERE conname IN ('workqueue_id_positive', 'fanout_id_positive') AND convalidated
		       AND connamespace = $1::regnamespace`, s.Name); n != 2 {
			t.Errorf("pass %d: %d of the two rules in force, want both, validated", pass, n)
		}
	}
	refused("a message with id 0 after the upgrade",
		`INSERT INTO workqueue (workqueue_id, stage) VALUES (0, 'a')`, "workqueue_id_positive")
}

// TestTimesAreFinite: a message given an infinite time is refused at its INSERT or UPDATE,
// naming the rule. A run_at of 'infinity' made the row paused until then, and the next due
// time the dispatcher reads (min(retry_at)) could not be read as a due time: every return
// of due rows and every claim failed, and no stage claimed again. An infinite created_at or
// status_at made every age fail ("cannot subtract infinite timestamps"). A far date is fine.
func TestTimesAreFinite(t *testing.T) {
	s := newTestSchema(t)
	for _, c := range []struct{ what, query string }{
		{"run_at infinity", `INSERT INTO workqueue (stage, run_at) VALUES ('a', 'infinity')`},
		{"run_at -infinity", `INSERT INTO workqueue (stage, run_at) VALUES ('a', '-infinity')`},
		{"created_at -infinity", `INSERT INTO workqueue (stage, created_at) VALUES ('a', '-infinity')`},
		{"status_at infinity", `INSERT INTO workqueue (stage, status_at) VALUES ('a', 'infinity')`},
		{"a paused row due at infinity", `INSERT INTO workqueue (stage, status, retry_at) VALUES ('a', 'paused', 'infinity')`},
	} {
		_, err := s.DB.Exec(c.query)
		var pe *pq.Error
		if !errors.As(err, &pe) || pe.Code != "23514" || pe.Constraint != "workqueue_times_finite" {
			t.Errorf("%s: err %v, want a check violation of workqueue_times_finite", c.what, err)
		}
	}
	s.exec(t, `INSERT INTO workqueue (stage, run_at) VALUES ('a', '9999-12-31')`)
	s.exec(t, `INSERT INTO workqueue (stage, status) VALUES ('a', 'held')`)

	ddl := schemaDDL(t)
	// The earlier version's shape: no rule on times, and the status check from before held
	// and cancelled (operate.sql widens it; its lookup must not take the times' rule, which
	// names status_at, for it).
	s.exec(t, `ALTER TABLE workqueue DROP CONSTRAINT workqueue_times_finite`)
	s.exec(t, `DELETE FROM workqueue WHERE status = 'held'`)
	s.exec(t, `ALTER TABLE workqueue DROP CONSTRAINT workqueue_status_check`)
	s.exec(t, `ALTER TABLE workqueue ADD CONSTRAINT workqueue_status_check
	    CHECK (status IN ('pending', 'running', 'paused', 'waiting', 'done', 'failed'))`)
	s.exec(t, `INSERT INTO workqueue (stage, created_at) VALUES ('a', '-infinity')`)
	_, err := s.DB.Exec(ddl)
	if err == nil || !strings.Contains(err.Error(), "1 rows of workqueue have an infinite created_at, status_at, run_at or retry_at") {
		t.Fatalf("apply schema.sql over a message created at -infinity: err %v, want it counted", err)
	}
	s.exec(t, `DELETE FROM workqueue WHERE NOT isfinite(created_at)`)
	for pass := 1; pass <= 2; pass++ {
		if _, err := s.DB.Exec(ddl); err != nil {
			t.Fatalf("apply schema.sql once the row is gone (pass %d): %v", pass, err)
		}
		if n := s.count(t, `SELECT count(*) FROM pg_constraint WHERE conname = 'workqueue_times_finite' AND convalidated
		       AND connamespace = $1::regnamespace`, s.Name); n != 1 {
			t.Errorf("pass %d: the times' rule is not in force", pass)
		}
		s.exec(t, `INSERT INTO workqueue (stage, status) VALUES ('a', 'held'), ('a', 'cancelled')`)
	}
}

// TestSchemaUpgrade: schema.sql applied over the schema of the first version
// (testdata/schema-round1.sql: schema.sql of 8a8e2b0, the first round's last commit), with
// rows in it, as an operator upgrading re-applies the file. It failed at fanin.sql, whose
// functions write status_at, a column operate.sql added to older tables after it. Now the
// file applies (twice: it is idempotent), says its version, keeps every row, and the
// dispatcher runs the old backlog.
func TestSchemaUpgrade(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `DROP SCHEMA `+s.Name+` CASCADE`)
	s.exec(t, `CREATE SCHEMA `+s.Name)
	old, err := schemafile.Read("testdata/schema-round1.sql")
	if err != nil {
		t.Fatal(err)
	}
	s.exec(t, old)
	s.exec(t, runsDDL)
	s.exec(t, `INSERT INTO workqueue (stage, payload) SELECT 'a', '{}' FROM generate_series(1, 20)`)
	s.exec(t, `INSERT INTO workqueue (stage, payload, status, attempts, retry_at) VALUES ('a', '{}', 'paused', 1, now() - interval '1 minute')`)
	s.exec(t, `INSERT INTO workqueue (stage, payload, status, attempts, state)
	           VALUES ('a', '{}', 'failed', 5, '{"dispatch_error": "stage a: gone"}'), ('a', '{}', 'done', 1, '{}')`)

	ddl := schemaDDL(t)
	for pass := 1; pass <= 2; pass++ {
		if _, err := s.DB.Exec(ddl); err != nil {
			t.Fatalf("apply schema.sql over the first version's (pass %d): %v", pass, err)
		}
	}
	if v := s.count(t, `SELECT pepsi_schema_version()`); v != schemafile.Version {
		t.Fatalf("schema version %d after the upgrade, want %d", v, schemafile.Version)
	}
	fresh := newTestSchema(t)
	fresh.exec(t, runsDDL)
	sameShape(t, schemaShape(t, s), schemaShape(t, fresh))
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE status_at IS NULL`); n != 23 {
		t.Errorf("%d rows without a status_at, want the 23 older than the column", n)
	}
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 2"), "pipeline")
	waitFor(t, 30*time.Second, "the old backlog done", func() bool { return countStatus(t, s, "done") == 22 })
	d.stop()
	if n := countStatus(t, s, "failed"); n != 1 {
		t.Errorf("%d failed rows, want the one failed before the upgrade", n)
	}
	if n := s.count(t, `SELECT count(*) FROM queue_errors()`); n != 1 {
		t.Errorf("queue_errors over the upgraded table: %d groups, want 1", n)
	}
}

// TestSchemaUpgradeReplacesOld: what earlier versions made under a name the schema still uses,
// or left behind, is replaced or dropped when schema.sql is applied again: IF NOT EXISTS kept
// an earlier workqueue_stopped index (stage, status, no paused rows), so that on a database
// made then the pages of failed rows by id walked the table; a draft's workqueue_fence trigger
// and an earlier queue_errors_statuses stayed too. Applying the schema over every one of the
// 57 schema states in the history showed them (each then equal to a fresh schema); these are
// those states, made by hand on a fresh schema.
func TestSchemaUpgradeReplacesOld(t *testing.T) {
	s := newTestSchema(t)
	fresh := schemaShape(t, s)
	s.exec(t, `DROP INDEX workqueue_stopped`)
	s.exec(t, `CREATE INDEX workqueue_stopped ON workqueue (stage, status) WHERE status IN ('failed', 'held', 'cancelled')`)
	s.exec(t, `CREATE FUNCTION workqueue_fence() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$`)
	s.exec(t, `CREATE TRIGGER workqueue_fence BEFORE INSERT OR UPDATE OR DELETE ON workqueue
	           FOR EACH STATEMENT EXECUTE FUNCTION workqueue_fence()`)
	s.exec(t, `CREATE FUNCTION queue_errors_statuses(p_filter jsonb) RETURNS text[] LANGUAGE sql IMMUTABLE AS $$ SELECT '{}'::text[] $$`)
	ddl := schemaDDL(t)
	if _, err := s.DB.Exec(ddl); err != nil {
		t.Fatalf("apply schema.sql again: %v", err)
	}
	sameShape(t, schemaShape(t, s), fresh)
}

// TestSchemaFilesASCII: PostgreSQL converts a statement into the database's encoding before it
// parses it, comments included, so that a character the encoding lacks ("…" in LATIN1, "§" in
// KOI8R) refused the whole file on such a database (TestFailureReasonOutsideDatabaseEncoding
// applies it to a LATIN1 one). The files are ASCII; error_pattern's micro sign is the regular
// expression's escape \u00B5.
func TestSchemaFilesASCII(t *testing.T) {
	for _, f := range []string{"schema.sql", "fanin.sql", "operate.sql"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, line := range strings.Split(string(b), "\n") {
			if j := strings.IndexFunc(line, func(r rune) bool { return r >= utf8.RuneSelf }); j >= 0 {
				t.Errorf("%s:%d: a character outside ASCII: %q", f, i+1, line[j:min(len(line), j+12)])
			}
		}
	}
}

// versionLine is schema.sql's statement that says its version.
var versionLine = regexp.MustCompile(`(?m)^CREATE OR REPLACE FUNCTION pepsi_schema_version\(\) .* AS 'SELECT ([0-9]+)';\n`)

// TestSchemaVersion: the schema files' text (their version line aside) is the one recorded
// for schemafile.Version in testdata/schema-version; a change to any of them without a new
// version fails here, so that a dispatcher or pepsi-queue of the new version refuses a
// database that was not given the new schema (schemafile.CheckVersion).
func TestSchemaVersion(t *testing.T) {
	h := sha256.New()
	var version string
	for _, f := range []string{"schema.sql", "fanin.sql", "operate.sql"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if m := versionLine.FindSubmatch(b); m != nil {
			version = string(m[1])
			b = versionLine.ReplaceAll(b, nil)
		}
		h.Write(b)
	}
	if version != strconv.Itoa(schemafile.Version) {
		t.Fatalf("schema.sql says version %q, schemafile.Version is %d: raise both together", version, schemafile.Version)
	}
	got := fmt.Sprintf("%d %x", schemafile.Version, h.Sum(nil))
	want, err := os.ReadFile("testdata/schema-version")
	if err != nil {
		t.Fatal(err)
	}
	if w := strings.TrimSpace(string(want)); w != got {
		t.Fatalf("the schema files changed since version %s (testdata/schema-version has %q, they are %q now): "+
			"raise the version in schema.sql's pepsi_schema_version() and in schemafile.Version, "+
			"and write the new line into testdata/schema-version", strings.Fields(w)[0], w, got)
	}
}

// TestNewerSchemaSaid: a dispatcher rolled back under a schema a newer version applied runs,
// and says so once, with both versions.
func TestNewerSchemaSaid(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, fmt.Sprintf(`CREATE OR REPLACE FUNCTION pepsi_schema_version() RETURNS int LANGUAGE sql AS 'SELECT %d'`, schemafile.Version+1))
	s.exec(t, runsDDL)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", ""), "pipeline")
	id := insertOne(t, s, "a", `{}`)
	waitFor(t, 30*time.Second, "the message done", func() bool { return row(t, s, id).status == "done" })
	d.stop()
	want := fmt.Sprintf("schema_version=%d program_schema_version=%d", schemafile.Version+1, schemafile.Version)
	if n := strings.Count(d.log.String(), "the schema in the database is newer than this program"); n != 1 || !strings.Contains(d.log.String(), want) {
		t.Errorf("the newer schema said %d times (want once, with %s):\n%s", n, want, d.log.String())
	}
}

// TestOlderSchemaRefused: a dispatcher started on a schema older than it (the binary upgraded,
// schema.sql not applied again) ran and failed every claim, every second, on a column it did
// not find ("the database refused this stage's claim alone"). It now refuses to start, saying
// which version it found and needs and how to apply it.
func TestOlderSchemaRefused(t *testing.T) {
	for _, c := range []struct{ name, ddl, want string }{
		{"version 0", `CREATE OR REPLACE FUNCTION pepsi_schema_version() RETURNS int LANGUAGE sql AS 'SELECT 0'`, "is version 0, older"},
		{"no version", `DROP FUNCTION pepsi_schema_version()`, "is from before versions, older"},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := newTestSchema(t)
			s.exec(t, c.ddl)
			d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", ""), "pipeline")
			if st := d.wait(30 * time.Second); st != 1 {
				t.Fatalf("exit %d, want 1", st)
			}
			for _, w := range []string{c.want, fmt.Sprintf("which needs version %d", schemafile.Version), "psql -v ON_ERROR_STOP=1 -f schema.sql"} {
				if !strings.Contains(d.log.String(), w) {
					t.Errorf("the log lacks %q:\n%s", w, d.log.String())
				}
			}
		})
	}
}

// schemaShape lists what s's schema holds, one line per column, index, constraint, trigger,
// function and relation, with the schema's name written S: two schemas with the same lines
// are the same to every program (a column's place in its table aside, which an upgrade that
// adds it cannot choose).
func schemaShape(t *testing.T, s *testSchema) []string {
	t.Helper()
	rows, err := s.DB.Query(`
		WITH ns AS (SELECT oid FROM pg_namespace WHERE nspname = $1)
		SELECT replace(line, $1, 'S') FROM (
		    SELECT format('relation %s %s', c.relkind, c.relname) AS line
		      FROM pg_class c WHERE c.relnamespace = (SELECT oid FROM ns)
		    UNION ALL
		    SELECT format('column %s.%s %s not null %s default %s', c.relname, a.attname,
		                  format_type(a.atttypid, a.atttypmod), a.attnotnull, pg_get_expr(d.adbin, d.adrelid))
		      FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
		      LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
		     WHERE c.relnamespace = (SELECT oid FROM ns) AND c.relkind IN ('r', 'p') AND a.attnum > 0 AND NOT a.attisdropped
		    UNION ALL
		    SELECT 'index ' || pg_get_indexdef(i.indexrelid)
		      FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relnamespace = (SELECT oid FROM ns)
		    UNION ALL
		    SELECT format('constraint %s %s %s', conrelid::regclass, conname, pg_get_constraintdef(oid))
		      FROM pg_constraint WHERE connamespace = (SELECT oid FROM ns)
		    UNION ALL
		    SELECT 'trigger ' || pg_get_triggerdef(t.oid)
		      FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
		     WHERE c.relnamespace = (SELECT oid FROM ns) AND NOT t.tgisinternal
		    UNION ALL
		    SELECT 'function ' || pg_get_functiondef(p.oid)
		      FROM pg_proc p WHERE p.pronamespace = (SELECT oid FROM ns) AND p.prokind IN ('f', 'p')
		) x ORDER BY 1`, s.Name)
	if err != nil {
		t.Fatalf("read the schema's shape: %v", err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var l string
		if err := rows.Scan(&l); err != nil {
			t.Fatal(err)
		}
		out = append(out, l)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// sameShape fails t with the lines that differ between got's schema and want's (a fresh one,
// or the same schema before).
func sameShape(t *testing.T, got []string, want []string) {
	t.Helper()
	for _, l := range got {
		if !slices.Contains(want, l) {
			t.Errorf("the schema has, and should not:\n%s", l)
		}
	}
	for _, l := range want {
		if !slices.Contains(got, l) {
			t.Errorf("the schema lacks:\n%s", l)
		}
	}
}

// TestSchemaStandardStrings: every function of the schema means the same under
// standard_conforming_strings = off, which a server kept for older applications sets (the
// server's default, so every session of pepsi's has it). A backslash in a plain ” string is
// an escape there: error_pattern's '\m[0-9]…' patterns matched nothing ('\m' became 'm'), so
// that the failures page and `pepsi-queue errors` split one cause into a group per time, IP
// and number, and '\1<n>' put a control character into every signature; config_check's
// character class of white space took the letter v. PostgreSQL's own lexer says where:
// each function's body is checked by its language's validator in a session with the setting
// off, and a "nonstandard use of escape" warning (22P06) names it.
func TestSchemaStandardStrings(t *testing.T) {
	s := newTestSchema(t)
	base, err := pq.NewConnector(s.DSN)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var notices []string
	db := sql.OpenDB(pq.ConnectorWithNoticeHandler(base, func(e *pq.Error) {
		mu.Lock()
		defer mu.Unlock()
		if e.Code == "22P06" { // nonstandard_use_of_escape_character, in any lc_messages
			notices = append(notices, e.Message)
		}
	}))
	defer db.Close()
	ctx := context.Background()
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	sample := `stage a: status 1: relay 10.0.0.1:25 at 12:03:04 said 0x1f after 30s in 250µs, id 4242 (line 7)`
	var want string
	if err := conn.QueryRowContext(ctx, `SELECT error_pattern($1)`, sample).Scan(&want); err != nil {
		t.Fatal(err)
	}
	if want != "stage a: status 1: relay <ip> at <time> said <hex> after <dur> in <dur>, id <n> (line <n>)" {
		t.Fatalf("error_pattern with the standard setting: %q", want)
	}
	if _, err := conn.ExecContext(ctx, `SET standard_conforming_strings = off`); err != nil {
		t.Fatal(err)
	}
	rows, err := conn.QueryContext(ctx, `SELECT p.oid, p.proname, l.lanname FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
		WHERE p.pronamespace = $1::regnamespace AND l.lanname IN ('plpgsql', 'sql') ORDER BY p.proname`, s.Name)
	if err != nil {
		t.Fatal(err)
	}
	type fn struct {
		oid        uint32
		name, lang string
	}
	var fns []fn
	for rows.Next() {
		var f fn
		if err := rows.Scan(&f.oid, &f.name, &f.lang); err != nil {
			t.Fatal(err)
		}
		fns = append(fns, f)
	}
	if err := rows.Err(); err != nil || len(fns) < 20 {
		t.Fatalf("the schema's functions: %d, %v", len(fns), err)
	}
	validator := map[string]string{"plpgsql": "plpgsql_validator", "sql": "fmgr_sql_validator"}
	for _, f := range fns {
		mu.Lock()
		notices = nil
		mu.Unlock()
		if _, err := conn.ExecContext(ctx, `SELECT `+validator[f.lang]+`($1)`, f.oid); err != nil {
			t.Errorf("function %s under standard_conforming_strings = off: %v", f.name, err)
		}
		mu.Lock()
		for _, n := range notices {
			t.Errorf("function %s: %s: write the literal as an E'' string, its backslashes doubled", f.name, n)
		}
		mu.Unlock()
	}
	// What it does, in a session of its own (a session keeps a function as it first compiled
	// it): the server's default, as a DBA sets it.
	off, err := sql.Open("postgres", s.DSN+" options='-c search_path="+s.Name+" -c standard_conforming_strings=off -c escape_string_warning=off'")
	if err != nil {
		t.Fatal(err)
	}
	defer off.Close()
	var got string
	if err := off.QueryRow(`SELECT error_pattern($1)`, sample).Scan(&got); err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Errorf("error_pattern under standard_conforming_strings = off: %q, want %q", got, want)
	}
	if _, err := off.Exec(`INSERT INTO config (section, key, value) VALUES ('stage-a', 'RETRY_DELAY', '0s'), ('stage-a', 'NEXT', 'route')`); err != nil {
		t.Errorf("config_check under standard_conforming_strings = off refused good rows: %v", err)
	}
}

// TestSchemaAppliesToOneSchema: schema.sql applied in a session whose search_path names
// several schemas (here the new system's, then another system's) makes everything in the
// first and touches nothing else. Its DROP FUNCTION IF EXISTS of an earlier version's
// signature, not yet in the new schema, found the other system's current fanin_flush further
// down the path and dropped it; and every function's pin (SET search_path FROM CURRENT) took
// the whole path, so that the functions of one system could read another's tables.
func TestSchemaAppliesToOneSchema(t *testing.T) {
	s := newTestSchema(t) // the other system
	before := schemaShape(t, s)
	b := s.Name + "_b"
	s.exec(t, `CREATE SCHEMA `+b)
	t.Cleanup(func() { s.DB.Exec(`DROP SCHEMA ` + b + ` CASCADE`) })
	db, err := sql.Open("postgres", s.DSN+" options='-c search_path="+b+","+s.Name+"'")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ddl := schemaDDL(t)
	if _, err := db.Exec(ddl); err != nil {
		t.Fatalf("apply schema.sql with search_path %s, %s: %v", b, s.Name, err)
	}
	sameShape(t, schemaShape(t, s), before)
	rows, err := s.DB.Query(`SELECT proname, c FROM pg_proc, unnest(proconfig) c
		WHERE pronamespace = $1::regnamespace AND c LIKE 'search_path=%' AND c <> 'search_path=' || $1`, b)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var name, c string
		if err := rows.Scan(&name, &c); err != nil {
			t.Fatal(err)
		}
		t.Errorf("%s.%s is pinned to %s, not to its own schema", b, name, c)
	}
	if n := s.count(t, `SELECT count(*) FROM pg_proc WHERE pronamespace = $1::regnamespace`, b); n < 40 {
		t.Errorf("%d functions in %s: the schema was not made there", n, b)
	}
}

// TestSchemaApplyWaitsNotLong: re-applying schema.sql on a running system while a stage's
// transaction holds a row of workqueue. The file's ALTER TABLE waited for that transaction,
// and every claim, outcome and producer's INSERT waited behind the ALTER in turn: the whole
// pipeline stopped for as long as the transaction lasted. The file now gives up a lock after
// 2 s ("lock timeout", 55P03), and the INSERT waits at most that long; applied again once the
// transaction is gone, it completes.
func TestSchemaApplyWaitsNotLong(t *testing.T) {
	s := newTestSchema(t)
	_, rollback := holdRow(t, s, `INSERT INTO workqueue (stage, payload) VALUES ('a', '{}') RETURNING workqueue_id`)
	defer rollback()
	apply, err := sql.Open("postgres", s.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer apply.Close()
	ddl := schemaDDL(t)
	applied := make(chan error, 1)
	go func() { _, err := apply.Exec(ddl); applied <- err }()
	// The INSERT starts once the apply waits for its lock (pg_locks: not granted).
	waitFor(t, 10*time.Second, "the apply waiting for a lock", func() bool {
		return s.count(t, `SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'workqueue'::regclass`) > 0
	})
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Second)
	_, err = s.DB.ExecContext(ctx, `INSERT INTO workqueue (stage, payload) VALUES ('a', '{}')`)
	cancel()
	if waited := time.Since(start); err != nil || waited > 4*time.Second {
		t.Errorf("a producer's INSERT behind the schema's apply: %v after %v", err, waited)
	}
	select {
	case err := <-applied:
		var pe *pq.Error
		if !errors.As(err, &pe) || pe.Code != "55P03" {
			t.Errorf("the apply behind a held row: %v, want a lock timeout (55P03)", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the apply still waits for its lock after 10 s")
	}
	rollback()
	if _, err := apply.Exec(ddl); err != nil {
		t.Fatalf("apply again once the transaction is gone: %v", err)
	}
}
