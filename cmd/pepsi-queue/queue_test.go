// queue_test.go: pepsi-queue and operate.sql against a real PostgreSQL (internal/pgtest): every
// transition of the table and every refusal, the selection (ids, standard input, filters),
// --json parsed back, the exit statuses, the confirmation, the error signature, operator_log.
// The races with a running dispatcher and its workers are in the root package (operate_test.go).

package main

import (
	"bytes"
	"context"
	"crypto/md5"
	"database/sql"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/lib/pq"

	"pepsi-dispatch/internal/pgtest"
)

var testPG = pgtest.New("../..")

func TestMain(m *testing.M) {
	before := runtime.NumGoroutine()
	code := m.Run()
	testPG.Stop()
	if code == 0 {
		code = pgtest.CheckGoroutineLeaks(before)
	}
	os.Exit(code)
}

type qschema struct {
	dsn string
	db  *sql.DB
}

func newQSchema(t *testing.T) *qschema {
	t.Helper()
	_, dsn, db := testPG.Schema(t, "q")
	return &qschema{dsn: dsn, db: db}
}

func (s *qschema) exec(t *testing.T, q string, args ...any) {
	t.Helper()
	if _, err := s.db.Exec(q, args...); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
}

func (s *qschema) one(t *testing.T, q string, args ...any) string {
	t.Helper()
	var v sql.NullString
	if err := s.db.QueryRow(q, args...).Scan(&v); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	return v.String
}

// insert adds a row in status st at stage and returns its id.
func (s *qschema) insert(t *testing.T, stage, st, err string) int64 {
	t.Helper()
	state := "{}"
	if err != "" {
		b, _ := json.Marshal(map[string]string{"dispatch_error": err})
		state = string(b)
	}
	var id int64
	if e := s.db.QueryRow(`INSERT INTO workqueue (stage, status, state, attempts, claim, claimed_at)
	        VALUES ($1, $2, $3, 2, CASE WHEN $2 = 'running' THEN 1 END, CASE WHEN $2 = 'running' THEN now() END)
	        RETURNING workqueue_id`, stage, st, state).Scan(&id); e != nil {
		t.Fatal(e)
	}
	return id
}

type result struct {
	code           int
	stdout, stderr string
}

// pq runs pepsi-queue in process against s with args, stdin as standard input.
func (s *qschema) pq(t *testing.T, stdin string, args ...string) result {
	t.Helper()
	return pqWith(t, s.dsn, stdin, args...)
}

// pqWith runs pepsi-queue in process on the database dsn.
func pqWith(t *testing.T, dsn, stdin string, args ...string) result {
	t.Helper()
	t.Setenv("PEPSI_DSN", dsn)
	var out, errOut bytes.Buffer
	code := run(context.Background(), append([]string{"-c", "/nonexistent/pepsi.conf"}, args...),
		strings.NewReader(stdin), &out, &errOut)
	return result{code, out.String(), errOut.String()}
}

var allStates = []string{"pending", "running", "paused", "waiting", "held", "done", "failed", "cancelled"}

// The transition table of operate.md §1: action -> from -> to ("" = refused, "gone" = deleted).
var transitions = map[string]map[string]string{
	"retry":   {"failed": "pending", "cancelled": "pending", "paused": "pending", "held": "pending"},
	"hold":    {"pending": "held", "paused": "held"},
	"release": {"held": "pending"},
	"cancel":  {"pending": "cancelled", "paused": "cancelled", "held": "cancelled", "waiting": "cancelled", "running": "cancelled"},
	"delete":  {"done": "gone", "failed": "gone", "cancelled": "gone"},
}

// TestTransitions: every action from every state, through the command: allowed ones change the
// row as the table says (attempts and error kept, except retry --reset), refused ones leave it
// exactly as it was and are reported with their reason on standard error and exit status 1;
// operator_log has one row per call with the changed ids.
func TestTransitions(t *testing.T) {
	s := newQSchema(t)
	for _, action := range []string{"retry", "hold", "release", "cancel", "delete"} {
		for _, from := range allStates {
			id := s.insert(t, "a", from, "stage a: status 1: boom")
			before := s.one(t, `SELECT row_to_json(w)::text FROM workqueue w WHERE workqueue_id = $1`, id)
			r := s.pq(t, "", action, fmt.Sprint(id))
			want := transitions[action][from]
			got := s.one(t, `SELECT coalesce((SELECT status FROM workqueue WHERE workqueue_id = $1), 'gone')`, id)
			switch want {
			case "":
				if r.code != exitRefused || !strings.Contains(r.stderr, fmt.Sprintf("%s %d refused: is %s", action, id, from)) {
					t.Errorf("%s from %s: exit %d, stderr %q; want 1 and the refusal", action, from, r.code, r.stderr)
				}
				if after := s.one(t, `SELECT row_to_json(w)::text FROM workqueue w WHERE workqueue_id = $1`, id); after != before {
					t.Errorf("%s from %s was refused but changed the row:\n%s\n%s", action, from, before, after)
				}
			default:
				if r.code != exitOK || got != want {
					t.Errorf("%s from %s: exit %d, status %s, stderr %q; want 0 and %s", action, from, r.code, got, r.stderr, want)
				}
				if want != "gone" {
					kept := s.one(t, `SELECT attempts || ' ' || (state->>'dispatch_error') FROM workqueue WHERE workqueue_id = $1`, id)
					if kept != "2 stage a: status 1: boom" {
						t.Errorf("%s from %s: attempts and error not kept: %q", action, from, kept)
					}
				}
			}
			logged := s.one(t, `SELECT action || ' ' || requested || ' ' || changed || ' ' || ids::text
			        FROM operator_log ORDER BY id DESC LIMIT 1`)
			wantLog := fmt.Sprintf("%s 1 0 {}", action)
			if want != "" {
				wantLog = fmt.Sprintf("%s 1 1 {%d}", action, id)
			}
			if logged != wantLog {
				t.Errorf("%s from %s: operator_log %q, want %q", action, from, logged, wantLog)
			}
		}
	}
	// --reset sets attempts to 0; held and cancelled keep what retry_at said nothing about.
	id := s.insert(t, "a", "failed", "x")
	if r := s.pq(t, "", "retry", "--reset", fmt.Sprint(id)); r.code != 0 {
		t.Fatalf("retry --reset: %+v", r)
	}
	if a := s.one(t, `SELECT attempts FROM workqueue WHERE workqueue_id = $1`, id); a != "0" {
		t.Errorf("retry --reset: attempts %s", a)
	}
	if a := s.one(t, `SELECT action FROM operator_log ORDER BY id DESC LIMIT 1`); a != "retry --reset" {
		t.Errorf("operator_log action %q", a)
	}
	// A missing id is refused as such.
	if r := s.pq(t, "", "hold", "999999"); r.code != 1 || !strings.Contains(r.stderr, "hold 999999 refused: no such message") {
		t.Errorf("hold of a missing id: %+v", r)
	}
}

// TestFanoutRefusals: a child of an open group cannot be deleted; a cancelled parent whose
// group is open cannot be retried; once the group fired, both are allowed.
func TestFanoutRefusals(t *testing.T) {
	s := newQSchema(t)
	var fid int64
	if err := s.db.QueryRow(`INSERT INTO fanout (parent_id, expected_n) VALUES (1, 1) RETURNING fanout_id`).Scan(&fid); err != nil {
		t.Fatal(err)
	}
	var parent, child int64
	s.db.QueryRow(`INSERT INTO workqueue (stage, status, wait_fanout_id) VALUES ('join', 'waiting', $1) RETURNING workqueue_id`, fid).Scan(&parent)
	s.exec(t, `UPDATE fanout SET parent_id = $1`, parent)
	s.db.QueryRow(`INSERT INTO workqueue (stage, status, fanout_id, fanout_seq) VALUES ('kid', 'pending', $1, 0) RETURNING workqueue_id`, fid).Scan(&child)
	if r := s.pq(t, "", "cancel", fmt.Sprint(parent), fmt.Sprint(child)); r.code != 0 {
		t.Fatalf("cancel parent and child: %+v", r)
	}
	if r := s.pq(t, "", "delete", fmt.Sprint(child)); r.code != 1 || !strings.Contains(r.stderr, "has not completed") {
		t.Errorf("delete of a child of an open group: %+v", r)
	}
	if r := s.pq(t, "", "retry", fmt.Sprint(parent)); r.code != 1 || !strings.Contains(r.stderr, fmt.Sprintf("waits on fan-out group %d", fid)) {
		t.Errorf("retry of a cancelled parent of an open group: %+v", r)
	}
	s.exec(t, `UPDATE fanout SET state = 'fired'`)
	if r := s.pq(t, "", "retry", fmt.Sprint(parent)); r.code != 0 {
		t.Errorf("retry of the parent after the fire: %+v", r)
	}
	if r := s.pq(t, "", "delete", fmt.Sprint(child)); r.code != 0 {
		t.Errorf("delete of the child after the fire: %+v", r)
	}
}

// TestSelection: ids as arguments, on standard input (spaces, newlines, commas, comments), and
// filters with --all; a filter without --all, ids with a filter, and bad ids are usage errors.
func TestSelection(t *testing.T) {
	s := newQSchema(t)
	var ids []int64
	for i := 0; i < 6; i++ {
		ids = append(ids, s.insert(t, []string{"a", "b"}[i%2], "failed", fmt.Sprintf("stage x: status 1: relay 10.0.0.%d down", i)))
	}
	in := fmt.Sprintf("%d %d\n%d,%d # a comment\n\n", ids[0], ids[1], ids[2], ids[2])
	if r := s.pq(t, in, "hold", "-"); r.code != 1 || strings.Count(r.stderr, "refused") != 3 {
		t.Errorf("hold - of failed rows: %+v (want 3 distinct refusals)", r)
	}
	if r := s.pq(t, in, "retry", "-"); r.code != 0 || !strings.Contains(r.stdout, "3 of 3") {
		t.Errorf("retry -: %+v", r)
	}
	if r := s.pq(t, "", "cancel", "--stage", "a", "--status", "pending", "--all"); r.code != 0 || !strings.Contains(r.stdout, "2 of 2") {
		t.Errorf("cancel --stage a --status pending --all: %+v", r)
	}
	if got := s.one(t, `SELECT string_agg(status, ',' ORDER BY workqueue_id) FROM workqueue`); got != "cancelled,pending,cancelled,failed,failed,failed" {
		t.Errorf("statuses after the selections: %s", got)
	}
	if f := s.one(t, `SELECT filter FROM operator_log ORDER BY id DESC LIMIT 1`); f != "--stage a --status pending --all" {
		t.Errorf("operator_log filter %q", f)
	}
	// A status list is read as the check reads it: " failed" and "\tfailed" are failed (the SQL
	// side drops only spaces, and once matched nothing here).
	if r := s.pq(t, "", "--json", "list", "--status", "cancelled,\tfailed"); r.code != 0 || strings.Count(r.stdout, "\n") != 5 {
		t.Errorf("list --status 'cancelled,\\tfailed': %+v, want 5 rows", r)
	}
	if r := s.pq(t, "", "retry", "--id-from", fmt.Sprint(ids[3]), "--id-to", fmt.Sprint(ids[4]), "--all"); r.code != 0 || !strings.Contains(r.stdout, "2 of 2") {
		t.Errorf("retry by id range: %+v", r)
	}
	// --older: since the last state change (status_at).
	s.exec(t, `UPDATE workqueue SET status_at = now() - interval '2 hours' WHERE workqueue_id = $1`, ids[5])
	if r := s.pq(t, "", "--json", "list", "--older", "1h30m"); r.code != 0 || strings.Count(r.stdout, "\n") != 1 ||
		!strings.Contains(r.stdout, fmt.Sprintf(`"workqueue_id":%d,`, ids[5])) {
		t.Errorf("list --older 1h30m: %+v", r)
	}
	if r := s.pq(t, "", "hold", "--older", "90m", "--status", "failed", "--all"); r.code != 1 || !strings.Contains(r.stderr, "is failed") {
		t.Errorf("hold --older of a failed row: %+v", r)
	}
	for _, bad := range [][]string{
		{"retry", "--status", "failed"}, // a filter without --all
		{"retry", "1", "--stage", "a"},  // ids and a filter
		{"retry", "x1"},                 // not an id
		{"retry"},                       // nothing named
		{"hold", "--reset", "1"},        // --reset without retry
		{"list", "--status", "bogus"},   // no such status
		{"frobnicate"},                  // no such command
		{"pause"},                       // no stage
		{"list", "--older", "soon"},     // not a duration
		{"status", "--stage", "a"},      // status takes no filter
		{"retry", "--all", "1"},         // --all with ids
		{"list", "--error", "\xff"},     // text PostgreSQL cannot compare (json.Marshal made it U+FFFD)
		{"list", "--stage", "a\x00"},    // nor this
		{"pause", "\xff"},               // a stage name that cannot be one
	} {
		if r := s.pq(t, "", bad...); r.code != exitUsage || r.stderr == "" {
			t.Errorf("%q: exit %d, stderr %q; want 2 and a message", bad, r.code, r.stderr)
		}
	}
	if r := s.pq(t, "1 zz\n", "retry", "-"); r.code != exitUsage || !strings.Contains(r.stderr, "line 1") {
		t.Errorf("bad id on standard input: %+v", r)
	}
}

// TestConfirmation: more than 1,000 rows without --yes and without a terminal is refused
// (exit 2) and changes nothing; with --yes it acts, in batches, each logged.
func TestConfirmation(t *testing.T) {
	s := newQSchema(t)
	s.exec(t, `INSERT INTO workqueue (stage, status) SELECT 'a', 'failed' FROM generate_series(1, 2500)`)
	r := s.pq(t, "", "retry", "--status", "failed", "--all")
	if r.code != exitUsage || !strings.Contains(r.stderr, "2500 messages: add --yes") {
		t.Errorf("without --yes: %+v", r)
	}
	if n := s.one(t, `SELECT count(*) FROM workqueue WHERE status = 'failed'`); n != "2500" {
		t.Errorf("refused confirmation changed rows: %s failed left", n)
	}
	// Ids on standard input are no terminal either.
	var in strings.Builder
	for i := 1; i <= 1001; i++ {
		fmt.Fprintln(&in, i)
	}
	if r := s.pq(t, in.String(), "retry", "-"); r.code != exitUsage {
		t.Errorf("1001 ids on stdin without --yes: %+v", r)
	}
	// /dev/null is a character device, not a terminal: refused, not asked.
	null, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	var out, errOut bytes.Buffer
	if code := run(context.Background(), []string{"-c", "/nonexistent/pepsi.conf", "retry", "--status", "failed", "--all"},
		null, &out, &errOut); code != exitUsage || strings.Contains(errOut.String(), "[y/N]") {
		t.Errorf("stdin /dev/null: exit %d, stderr %q; want 2 without a prompt", code, errOut.String())
	}
	r = s.pq(t, "", "retry", "--status", "failed", "--all", "--yes")
	if r.code != 0 || !strings.Contains(r.stdout, "2500 of 2500") {
		t.Errorf("with --yes: %+v", r)
	}
	if got := s.one(t, `SELECT count(*) || ' ' || sum(changed) FROM operator_log`); got != "3 2500" {
		t.Errorf("operator_log: %s, want 3 batches changing 2500", got)
	}
}

// TestJSON: every query's --json output parses back, one object per line, with the schema's
// column names and typed values.
func TestJSON(t *testing.T) {
	s := newQSchema(t)
	a := s.insert(t, "deliver", "failed", "stage deliver: status 75: connect to 10.1.2.3:25: timeout after 30s")
	s.insert(t, "deliver", "failed", "stage deliver: status 75: connect to 10.9.9.9:25: timeout after 31s")
	s.insert(t, "parse", "pending", "")
	lines := func(r result) []map[string]any {
		t.Helper()
		if r.code != 0 {
			t.Fatalf("exit %d: %s", r.code, r.stderr)
		}
		var out []map[string]any
		for _, l := range strings.Split(strings.TrimSpace(r.stdout), "\n") {
			var m map[string]any
			if err := json.Unmarshal([]byte(l), &m); err != nil {
				t.Fatalf("not JSON: %q: %v", l, err)
			}
			out = append(out, m)
		}
		return out
	}
	st := lines(s.pq(t, "", "--json", "status"))
	if len(st) != 3 || st[0]["stage"] != "deliver" || st[0]["failed"] != 2.0 || st[2]["stage"] != nil || st[2]["total"] != 3.0 {
		t.Errorf("status --json: %v", st)
	}
	if _, ok := st[1]["oldest_pending"].(float64); !ok || st[1]["stage_paused"] != false {
		t.Errorf("status --json: oldest_pending not seconds or stage_paused not a boolean: %v", st[1])
	}
	er := lines(s.pq(t, "", "errors", "--json"))
	if len(er) != 1 || er[0]["count"] != 2.0 || !slices.Equal(toStrings(er[0]["stages"]), []string{"deliver"}) {
		t.Fatalf("errors --json: %v", er)
	}
	sig := er[0]["signature"].(string)
	ls := lines(s.pq(t, "", "--json", "list", "--signature", sig))
	if len(ls) != 2 || ls[0]["workqueue_id"] != float64(a) || ls[0]["status"] != "failed" {
		t.Errorf("list --signature --json: %v", ls)
	}
	sh := lines(s.pq(t, "", "--json", "shape"))
	if len(sh) != 2 || sh[0]["<1m"] != 1.0 {
		t.Errorf("shape --json: %v", sh)
	}
	sw := lines(s.pq(t, "", "--json", "show", fmt.Sprint(a)))
	if len(sw) != 1 || sw[0]["error_signature"] != sig || sw[0]["stage"] != "deliver" {
		t.Errorf("show --json: %v", sw)
	}
	rt := lines(s.pq(t, "", "--json", "retry", "--signature", sig, "--all"))
	if len(rt) != 2 || rt[0]["ok"] != true || rt[0]["status"] != "pending" {
		t.Errorf("retry --json: %v", rt)
	}
	ps := lines(s.pq(t, "", "--json", "pause", "deliver"))
	if len(ps) != 1 || ps[0]["paused"] != true {
		t.Errorf("pause --json: %v", ps)
	}
	st = lines(s.pq(t, "", "--json", "status"))
	if st[0]["stage_paused"] != true {
		t.Errorf("status after pause: %v", st[0])
	}
}

func toStrings(v any) []string {
	var out []string
	for _, x := range v.([]any) {
		out = append(out, x.(string))
	}
	return out
}

// TestExitStatuses: 0, 1 (refused), 2 (usage, configuration), 3 (no database).
func TestExitStatuses(t *testing.T) {
	s := newQSchema(t)
	id := s.insert(t, "a", "done", "")
	if r := s.pq(t, "", "status"); r.code != 0 {
		t.Errorf("status: %+v", r)
	}
	if r := s.pq(t, "", "retry", fmt.Sprint(id)); r.code != 1 {
		t.Errorf("refused: %+v", r)
	}
	if r := s.pq(t, "", "--bogus"); r.code != 2 {
		t.Errorf("usage: %+v", r)
	}
	// Asked for, the usage is the answer (standard output, exit 0: pepsi-queue --help | less),
	// not a usage error; anywhere on the line, it is all that runs.
	for _, args := range [][]string{{"--help"}, {"-h"}, {"help"}, {"retry", "--help"}} {
		if r := s.pq(t, "", args...); r.code != 0 || !strings.HasPrefix(r.stdout, "usage: pepsi-queue") || r.stderr != "" {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want the usage on standard output, exit 0", args, r.code, r.stdout, r.stderr)
		}
	}
	t.Setenv("PEPSI_DSN", "")
	var out, errOut bytes.Buffer
	if code := run(context.Background(), []string{"-c", "/nonexistent/pepsi.conf", "status"}, strings.NewReader(""), &out, &errOut); code != 2 {
		t.Errorf("missing configuration: exit %d: %s", code, errOut.String())
	}
	conf := t.TempDir() + "/pepsi.conf"
	os.WriteFile(conf, []byte("[database]\nDSN = host=/nonexistent-dir port=1 connect_timeout=2 sslmode=disable\n[stage-a]\nPROGRAM = /bin/true\n"), 0o644)
	errOut.Reset()
	if code := run(context.Background(), []string{"-c", conf, "status"}, strings.NewReader(""), &out, &errOut); code != 3 {
		t.Errorf("unreachable database: exit %d: %s", code, errOut.String())
	}
	// A stage the file does not define is refused by pause.
	os.WriteFile(conf, []byte("[database]\nDSN = "+s.dsn+"\n[stage-a]\nPROGRAM = /bin/true\n"), 0o644)
	errOut.Reset()
	if code := run(context.Background(), []string{"-c", conf, "pause", "b"}, strings.NewReader(""), &out, &errOut); code != 1 || !strings.Contains(errOut.String(), `no stage "b"`) {
		t.Errorf("pause of an unknown stage: exit %d: %s", code, errOut.String())
	}
	if code := run(context.Background(), []string{"-c", conf, "pause", "a"}, strings.NewReader(""), &out, &errOut); code != 0 {
		t.Errorf("pause a: exit %d: %s", code, errOut.String())
	}
	if v := s.one(t, `SELECT value FROM config WHERE section = 'stage-a' AND key = 'PAUSED'`); v != "yes" {
		t.Errorf("pause wrote %q", v)
	}
	if code := run(context.Background(), []string{"-c", conf, "resume", "a"}, strings.NewReader(""), &out, &errOut); code != 0 {
		t.Errorf("resume a: exit %d: %s", code, errOut.String())
	}
	if v := s.one(t, `SELECT value FROM config WHERE section = 'stage-a' AND key = 'PAUSED'`); v != "no" {
		t.Errorf("resume wrote %q", v)
	}
	if got := s.one(t, `SELECT string_agg(action || ':' || stage || ':' || changed, ' ' ORDER BY id) FROM operator_log WHERE stage IS NOT NULL`); got != "pause:a:1 resume:a:1" {
		t.Errorf("operator_log of pause/resume: %q", got)
	}
}

// TestSignature: a table of real-looking error texts; pairs that differ only in what varies
// between occurrences of one cause share a signature, the others do not.
func TestSignature(t *testing.T) {
	s := newQSchema(t)
	sig := func(text string) string { return s.one(t, `SELECT error_signature($1)`, text) }
	same := [][2]string{
		{"stage deliver: status 75: connect to 10.1.2.3:25: timeout after 30s",
			"stage deliver: status 75: connect to 10.9.9.9:25: timeout after 31s"},
		{"stage deliver: status 75: dial tcp [2001:db8::1]:25: i/o timeout",
			"stage deliver: status 75: dial tcp [fe80::2]:587: i/o timeout"},
		{`stage enrich: status 1: pq: duplicate key value violates unique constraint "users_email_key"`,
			`stage enrich: status 1: pq: duplicate key value violates unique constraint "orders_pkey"`},
		{"stage fetch: status 1: GET https://api.example.com/v1/items/123?x=1: 503 Service Unavailable",
			"stage fetch: status 1: GET https://api.example.com/v1/items/98765: 503 Service Unavailable"},
		{"stage deliver: status 1: 550 5.1.1 <bob@example.com>: Recipient address rejected: User unknown",
			"stage deliver: status 1: 550 5.1.1 <alice.smith@mail.example.org>: Recipient address rejected: User unknown"},
		{"stage parse: timeout after 5m0s (worker killed)", "stage parse: timeout after 2m30s (worker killed)"},
		{"request 550e8400-e29b-41d4-a716-446655440000 failed after 3 retries in 1.5s",
			"request 123e4567-e89b-12d3-a456-426614174000 failed after 5 retries in 900ms"},
		{"message 0x7f3a2b1c not found in shard 12 at 2026-12-02T14:57:01.123Z",
			"message 0xdeadbeef not found in shard 7 at 2026-11-30T01:02:03Z"},
		{"deadlock detected at 14:03:22; process 12345 waits for ShareLock on transaction 987654",
			"deadlock detected at 09:13:02; process 777 waits for ShareLock on transaction 1"},
		{"object s3://bucket/key-99 missing (etag 9f86d081884c7d65)", "object s3://bucket/other missing (etag 1234abcd5678ef90)"},
		{"stage x: status 1: read   body:\tunexpected EOF", "stage x: status 1: read body: unexpected EOF"},
	}
	differ := [][2]string{
		{"stage deliver: status 75: connect to 10.1.2.3:25: timeout after 30s",
			"stage deliver: status 75: connect to 10.1.2.3:25: connection refused"},
		{"stage deliver: status 75: relay down", "stage deliver: status 1: relay down"},
		{"stage deliver: status 1: relay down", "stage parse: status 1: relay down"},
		{"stage fetch: status 1: 503 Service Unavailable", "stage fetch: status 1: 502 Bad Gateway"},
		{"stage enrich: status 1: pq: relation \"users\" does not exist", "stage enrich: status 1: pq: permission denied for table \"users\""},
		{"stage x: signal: killed", "stage x: signal: segmentation fault"},
		{"stage s3: status 1: disk full", "stage s4: status 1: disk full"},
	}
	for _, p := range same {
		if a, b := sig(p[0]), sig(p[1]); a != b || len(a) != 12 {
			t.Errorf("want one signature:\n  %q -> %s (%s)\n  %q -> %s (%s)", p[0], a,
				s.one(t, `SELECT error_pattern($1)`, p[0]), p[1], b, s.one(t, `SELECT error_pattern($1)`, p[1]))
		}
	}
	for _, p := range differ {
		if a, b := sig(p[0]), sig(p[1]); a == b {
			t.Errorf("want two signatures, got %s for both:\n  %q\n  %q (pattern %s)", a, p[0], p[1],
				s.one(t, `SELECT error_pattern($1)`, p[0]))
		}
	}
	// Stable: a fixed text has a fixed signature, in every session and version.
	if got := sig("stage deliver: status 75: connect to 10.1.2.3:25: timeout after 30s"); got != left12md5("stage deliver: status 75: connect to <ip>: timeout after <dur>") {
		t.Errorf("signature is not the MD5 of the documented pattern: %s", got)
	}
}

func left12md5(s string) string {
	return fmt.Sprintf("%x", md5.Sum([]byte(s)))[:12]
}

// TestRetrySignature: `retry --signature SIG --all` retries exactly the group `errors` shows,
// failed and paused rows, and nothing else.
func TestRetrySignature(t *testing.T) {
	s := newQSchema(t)
	var relay, other []int64
	for i := 0; i < 30; i++ {
		relay = append(relay, s.insert(t, "deliver", []string{"failed", "paused"}[i%2],
			fmt.Sprintf("stage deliver: status 75: connect to 10.1.%d.%d:25: timeout after %ds", i, i*7%255, 30+i)))
		if i < 20 {
			other = append(other, s.insert(t, "deliver", "failed", fmt.Sprintf("stage deliver: status 1: 550 unknown user u%d@example.com", i)))
		}
	}
	s.insert(t, "deliver", "done", "stage deliver: status 75: connect to 10.1.1.1:25: timeout after 30s") // old error, succeeded since
	var sig string
	var count int
	if err := s.db.QueryRow(`SELECT signature, count FROM queue_errors() ORDER BY count DESC, signature LIMIT 1`).Scan(&sig, &count); err != nil {
		t.Fatal(err)
	}
	if r := s.pq(t, "", "retry", "--signature", sig, "--all"); r.code != 0 || !strings.Contains(r.stdout, "30 of 30") {
		t.Fatalf("retry --signature: %+v", r)
	}
	var moved []int64
	rows, _ := s.db.Query(`SELECT workqueue_id FROM workqueue WHERE status = 'pending' ORDER BY 1`)
	for rows.Next() {
		var id int64
		rows.Scan(&id)
		moved = append(moved, id)
	}
	rows.Close()
	if !slices.Equal(moved, relay) {
		t.Errorf("retried %v, want exactly %v", moved, relay)
	}
	if n := s.one(t, `SELECT count(*) FROM workqueue WHERE workqueue_id = ANY ($1) AND status = 'failed'`, pq.Array(other)); n != "20" {
		t.Errorf("the other cause's rows: %s still failed, want 20", n)
	}
}

// TestCancelledChildCountsAsFailed: a cancelled fan-out child counts as failed for its group
// (the completion triggers, the flush, fanin_failed_children, the recount); its retry takes it
// out of the failed count again; a cancelled waiting parent is not woken when the group fires.
func TestCancelledChildCountsAsFailed(t *testing.T) {
	s := newQSchema(t)
	group := func() (parent int64, kids []int64, fid int64) {
		t.Helper()
		if err := s.db.QueryRow(`INSERT INTO fanout (parent_id, expected_n) VALUES (0, 3) RETURNING fanout_id`).Scan(&fid); err != nil {
			t.Fatal(err)
		}
		s.db.QueryRow(`INSERT INTO workqueue (stage, status, wait_fanout_id) VALUES ('join', 'waiting', $1) RETURNING workqueue_id`, fid).Scan(&parent)
		s.exec(t, `UPDATE fanout SET parent_id = $1 WHERE fanout_id = $2`, parent, fid)
		for i := 0; i < 3; i++ {
			var k int64
			s.db.QueryRow(`INSERT INTO workqueue (stage, status, fanout_id, fanout_seq) VALUES ('kid', 'pending', $1, $2) RETURNING workqueue_id`, fid, i).Scan(&k)
			kids = append(kids, k)
		}
		return parent, kids, fid
	}
	counts := func(fid int64) string {
		t.Helper()
		s.exec(t, `SELECT fanin_flush()`)
		return s.one(t, `SELECT done_n || '/' || failed_n || ' ' || state FROM fanout WHERE fanout_id = $1`, fid)
	}
	parent, kids, fid := group()
	if r := s.pq(t, "", "cancel", fmt.Sprint(kids[0])); r.code != 0 {
		t.Fatalf("cancel child: %+v", r)
	}
	if got := counts(fid); got != "0/1 open" {
		t.Errorf("after cancelling a child: %s, want 0/1 open", got)
	}
	if r := s.pq(t, "", "retry", fmt.Sprint(kids[0])); r.code != 0 {
		t.Fatalf("retry child: %+v", r)
	}
	if got := counts(fid); got != "0/0 open" {
		t.Errorf("after retrying the cancelled child: %s, want 0/0 open", got)
	}
	s.pq(t, "", "cancel", fmt.Sprint(kids[0]))
	s.exec(t, `UPDATE workqueue SET status = 'done' WHERE workqueue_id = ANY ($1)`, pq.Array(kids[1:]))
	if got := counts(fid); got != "2/1 fired" {
		t.Errorf("after the others finished: %s, want 2/1 fired", got)
	}
	if st := s.one(t, `SELECT status FROM workqueue WHERE workqueue_id = $1`, parent); st != "pending" {
		t.Errorf("parent %s, want woken (pending)", st)
	}
	if got := s.one(t, `SELECT string_agg(workqueue_id::text, ',') FROM fanin_failed_children($1)`, parent); got != fmt.Sprint(kids[0]) {
		t.Errorf("fanin_failed_children: %q, want the cancelled child %d", got, kids[0])
	}
	// A cancelled waiting parent: the group still fires, and wakes nobody.
	parent, kids, fid = group()
	if r := s.pq(t, "", "cancel", fmt.Sprint(parent)); r.code != 0 {
		t.Fatalf("cancel waiting parent: %+v", r)
	}
	s.exec(t, `UPDATE workqueue SET status = 'done' WHERE workqueue_id = ANY ($1)`, pq.Array(kids))
	if got := counts(fid); got != "3/0 fired" {
		t.Errorf("group of a cancelled parent: %s, want 3/0 fired", got)
	}
	if got := s.one(t, `SELECT status || ' ' || (SELECT parent_woken FROM fanin_wake_log WHERE fanout_id = $2)
	        FROM workqueue WHERE workqueue_id = $1`, parent, fid); got != "cancelled false" {
		t.Errorf("cancelled parent after its group fired: %q, want cancelled, not woken", got)
	}
}

// TestOlderSchemaRefused: on a schema older than this pepsi-queue (a binary upgraded without
// re-applying schema.sql) every command failed on its own missing function or column; now
// the first thing said is that the schema is older, and how to apply it (exit 1).
// TestStatusListsConfiguredStages: status has a line for every stage the configuration
// defines (the file's and the config table's), with zero counts for one without rows: on a
// fresh system it printed the header and a TOTAL of dashes, and an operator could not tell
// a stage with nothing to do from a stage pepsi does not know.
func TestStatusListsConfiguredStages(t *testing.T) {
	s := newQSchema(t)
	s.insert(t, "a", "pending", "")
	s.insert(t, "stray", "failed", "boom")
	s.exec(t, `INSERT INTO config (section, key, value) VALUES ('stage-c', 'PROGRAM', '/bin/true')`)
	conf := filepath.Join(t.TempDir(), "pepsi.conf")
	if err := os.WriteFile(conf, []byte("[database]\nDSN = "+s.dsn+"\n[stage-a]\nPROGRAM = /bin/true\n[stage-b]\nPROGRAM = /bin/true\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var out, errOut bytes.Buffer
	if code := run(context.Background(), []string{"-c", conf, "status"}, strings.NewReader(""), &out, &errOut); code != 0 {
		t.Fatalf("status: exit %d: %s", code, errOut.String())
	}
	var got []string
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n")[1:] {
		f := strings.Fields(line)
		got = append(got, f[0]+" "+f[1]+" "+f[7]) // stage, pending, failed
	}
	want := []string{"a 1 0", "b 0 0", "c 0 0", "stray 0 1", "TOTAL 1 1"}
	if !slices.Equal(got, want) {
		t.Errorf("status lines (stage, pending, failed): %q, want %q\n%s", got, want, out.String())
	}
	// A stage paused by the file says so, unless the config table's row (pepsi-queue resume)
	// says otherwise: the table is the overlay (it said no for the file's pause before).
	if err := os.WriteFile(conf, []byte("[database]\nDSN = "+s.dsn+"\n[stage-a]\nPROGRAM = /bin/true\n"+
		"[stage-b]\nPROGRAM = /bin/true\nPAUSED = Yes\n[stage-d]\nPROGRAM = /bin/true\nPAUSED = yes\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	s.exec(t, `INSERT INTO config (section, key, value) VALUES ('stage-d', 'PAUSED', 'no')`)
	out.Reset()
	if code := run(context.Background(), []string{"-c", conf, "--json", "status"}, strings.NewReader(""), &out, &errOut); code != 0 {
		t.Fatalf("status: exit %d: %s", code, errOut.String())
	}
	paused := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		var r struct {
			Stage  *string `json:"stage"`
			Paused bool    `json:"stage_paused"`
		}
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatal(err)
		}
		if r.Stage != nil {
			paused[*r.Stage] = r.Paused
		}
	}
	if want := map[string]bool{"a": false, "b": true, "c": false, "d": false, "stray": false}; !maps.Equal(paused, want) {
		t.Errorf("stage_paused: %v, want %v", paused, want)
	}

	// No rows at all: the totals are zeros (they were the dashes of sums of nothing).
	s.exec(t, `TRUNCATE workqueue`)
	out.Reset()
	if code := run(context.Background(), []string{"-c", conf, "status"}, strings.NewReader(""), &out, &errOut); code != 0 ||
		!regexp.MustCompile(`(?m)^TOTAL( +0){9} +- +-$`).MatchString(out.String()) {
		t.Errorf("status of an empty table: exit %d, want a TOTAL of zeros\n%s", code, out.String())
	}
}

// TestShowTimesInUTC: show gives a message's times in UTC, as list and errors give theirs
// (and the console): it printed PostgreSQL's JSON text, in the session's TimeZone, the
// server's (2026-12-08T02:32:33.25654+13:45 under Pacific/Chatham).
func TestShowTimesInUTC(t *testing.T) {
	s := newQSchema(t)
	id := s.insert(t, "a", "running", "")
	var created, claimed time.Time
	if err := s.db.QueryRow(`SELECT created_at, claimed_at FROM workqueue WHERE workqueue_id = $1`, id).Scan(&created, &claimed); err != nil {
		t.Fatal(err)
	}
	far := strings.Replace(s.dsn, "options='-c ", "options='-c TimeZone=Pacific/Chatham -c ", 1)
	r := pqWith(t, far, "", "show", fmt.Sprint(id))
	if r.code != 0 {
		t.Fatalf("show: %d %s", r.code, r.stderr)
	}
	for key, at := range map[string]time.Time{"created_at": created, "claimed_at": claimed} {
		want := fmt.Sprintf("%-16s %s\n", key+":", at.UTC().Format("2006-01-02 15:04:05.999999Z"))
		if !strings.Contains(r.stdout, want) {
			t.Errorf("show lacks %q:\n%s", want, r.stdout)
		}
	}
}

func TestOlderSchemaRefused(t *testing.T) {
	s := newQSchema(t)
	s.exec(t, `CREATE OR REPLACE FUNCTION pepsi_schema_version() RETURNS int LANGUAGE sql AS 'SELECT 0'`)
	r := s.pq(t, "", "status")
	if r.code != exitRefused || !strings.Contains(r.stderr, "the schema in the database is version 0, older than this program") ||
		!strings.Contains(r.stderr, "psql -v ON_ERROR_STOP=1 -f schema.sql") {
		t.Errorf("version 0: exit %d, stderr %q", r.code, r.stderr)
	}
	s.exec(t, `DROP FUNCTION pepsi_schema_version()`)
	if r := s.pq(t, "", "status"); r.code != exitRefused || !strings.Contains(r.stderr, "from before versions") {
		t.Errorf("no version: exit %d, stderr %q", r.code, r.stderr)
	}
	// No schema at all where the DSN points (a search_path without the system's schema) is
	// not an older one.
	r = pqWith(t, s.dsn+" options='-c search_path=pepsi_no_such_schema'", "", "status")
	if r.code != exitRefused || !strings.Contains(r.stderr, "no workqueue table in the search_path of this connection (pepsi_no_such_schema)") {
		t.Errorf("no schema: exit %d, stderr %q", r.code, r.stderr)
	}
}
