package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"math"
	"math/rand"
	"strings"
	"testing"

	"github.com/lib/pq"
)

// TestParseIntervalAgainstPostgreSQL: the ages pepsi-queue prints are PostgreSQL's interval
// text read back by parseInterval; PostgreSQL itself says what each is in seconds. Under each
// of the four IntervalStyles (a role or a database may set any), every age of a row (a
// difference of timestamps: days and a time) and every interval of months, days and a time
// with mixed signs must read back to PostgreSQL's own extract(epoch ...).
func TestParseIntervalAgainstPostgreSQL(t *testing.T) {
	s := newQSchema(t)
	ctx := context.Background()
	conn, err := s.db.Conn(ctx)
	if err != nil {
		t.Fatalf("a connection of the schema: %v", err)
	}
	defer conn.Close()
	// PostgreSQL's epoch, the reference, exact: a role's or a server's extra_float_digits = 0
	// (the default before PostgreSQL 12) prints 15 significant digits, short of a microsecond
	// on years.
	if _, err := conn.ExecContext(ctx, "SET extra_float_digits = 3"); err != nil {
		t.Fatalf("SET extra_float_digits: %v", err)
	}
	secs := []float64{0, 0.5, 1, 59.999999, 60, 3599, 3600, 86399.5, 86400, 86401, 90061.123456, 172800,
		10*86400 + 5, 400 * 86400, 4000*86400 + 0.25, -0.5, -1, -86400, -86401, -90061.25, -400 * 86400}
	rng := rand.New(rand.NewSource(7))
	for i := 0; i < 500; i++ {
		secs = append(secs, math.Round((rng.Float64()-0.3)*math.Pow(10, float64(rng.Intn(9)))*1e6)/1e6)
	}
	// Intervals of months, days and a time (make_interval's years, months, days, hours, mins,
	// secs), the signs mixed: what no age of a row is, but a style must print all the same.
	parts := [][6]float64{{0, 0, 0, 0, 0, -0.5}, {0, 0, 1, 0, 0, -0.5}, {0, 1, 0, 0, 0, -1}, {1, 0, 0, 0, 0, 0},
		{-1, -2, 0, 0, 0, 0}, {0, 0, -3, 4, 5, 6.5}, {0, 0, 3, -4, 0, 0}, {1, 2, 0, 0, 0, 0.000001},
		{0, 0, 0, 1000000, 0, 0}, {0, -11, 0, 0, 0, 0}, {0, 13, -1, 0, 0, 0}, {-2, 0, 0, 0, -1, 0}}
	for i := 0; i < 500; i++ {
		var p [6]float64
		for j, scale := range []float64{300, 30, 1000, 100000, 1000} {
			if rng.Intn(2) == 0 {
				p[j] = float64(rng.Intn(int(2*scale+1))) - scale
			}
		}
		if rng.Intn(2) == 0 {
			p[5] = math.Round((rng.Float64()-0.5)*2e5*1e6) / 1e6
		}
		parts = append(parts, p)
	}
	var cols [6][]float64
	for _, p := range parts {
		for j := range cols {
			cols[j] = append(cols[j], p[j])
		}
	}
	for _, style := range []string{"postgres", "sql_standard", "iso_8601", "postgres_verbose"} {
		if _, err := conn.ExecContext(ctx, "SET IntervalStyle = "+style); err != nil {
			t.Fatalf("SET IntervalStyle = %s: %v", style, err)
		}
		rows, err := conn.QueryContext(ctx, `
			SELECT i::text, extract(epoch FROM i)::float8
			  FROM unnest($1::float8[]) AS v,
			       LATERAL (SELECT (timestamptz '2026-01-01 00:00:00+00' + v * interval '1 second')
			                       - timestamptz '2026-01-01 00:00:00+00' AS i) AS x
			UNION ALL
			SELECT i::text, extract(epoch FROM i)::float8
			  FROM unnest($2::int[], $3::int[], $4::int[], $5::int[], $6::int[], $7::float8[]) AS p(y, mo, d, h, mi, se),
			       LATERAL (SELECT make_interval(y, mo, 0, d, h, mi, se) AS i) AS x`,
			pq.Array(secs), pq.Array(cols[0]), pq.Array(cols[1]), pq.Array(cols[2]), pq.Array(cols[3]),
			pq.Array(cols[4]), pq.Array(cols[5]))
		if err != nil {
			t.Fatalf("intervals as text and epoch under IntervalStyle %s: %v", style, err)
		}
		n := 0
		for rows.Next() {
			var text string
			var epoch float64
			if err := rows.Scan(&text, &epoch); err != nil {
				t.Fatalf("read an interval under IntervalStyle %s: %v", style, err)
			}
			n++
			got, ok := parseInterval(text)
			switch {
			case !ok:
				t.Errorf("IntervalStyle %s: parseInterval(%q) gave up (PostgreSQL says %v)", style, text, epoch)
			case math.Abs(got-epoch) > 1e-6*math.Max(1, math.Abs(epoch)*1e-9):
				t.Errorf("IntervalStyle %s: parseInterval(%q) = %v, PostgreSQL says %v", style, text, got, epoch)
			}
		}
		if err := rows.Err(); err != nil {
			t.Fatalf("read the intervals under IntervalStyle %s: %v", style, err)
		}
		rows.Close()
		if n != len(secs)+len(parts) {
			t.Errorf("IntervalStyle %s: %d intervals back, want %d", style, n, len(secs)+len(parts))
		}
	}
}

// TestAgesUnderEveryIntervalStyle: a role or database may set IntervalStyle; pepsi-queue's
// ages are then still seconds in JSON and 1m30s in the table, through the command, for the
// status's oldest pending message and a listed message's age.
func TestAgesUnderEveryIntervalStyle(t *testing.T) {
	s := newQSchema(t)
	id := s.insert(t, "deliver", "pending", "")
	s.exec(t, `UPDATE workqueue SET created_at = now() - interval '90 seconds',
	                                status_at = now() - interval '90 seconds' WHERE workqueue_id = $1`, id)
	if !strings.Contains(s.dsn, "options='-c search_path=") {
		t.Fatalf("the schema's DSN has no options to add a setting to: %s", s.dsn)
	}
	for _, style := range []string{"postgres", "sql_standard", "iso_8601", "postgres_verbose"} {
		dsn := strings.Replace(s.dsn, "options='", "options='-c IntervalStyle="+style+" ", 1)
		pepsiQueue := func(args ...string) result { // the command, its DSN with the style
			t.Helper()
			r := pqWith(t, dsn, "", args...)
			if r.code != 0 {
				t.Fatalf("IntervalStyle %s: pepsi-queue %v: exit %d: %s", style, args, r.code, r.stderr)
			}
			return r
		}
		for _, c := range []struct {
			args []string
			key  string
		}{{[]string{"--json", "status"}, "oldest_pending"}, {[]string{"--json", "list"}, "age"}} {
			var m map[string]any
			line, _, _ := strings.Cut(pepsiQueue(c.args...).stdout, "\n")
			if err := json.Unmarshal([]byte(line), &m); err != nil {
				t.Fatalf("IntervalStyle %s: %v: not JSON: %q", style, c.args, line)
			}
			if secs, ok := m[c.key].(float64); !ok || secs < 90 || secs > 90+60 {
				t.Errorf("IntervalStyle %s: %v: %s = %#v, want about 90 seconds", style, c.args, c.key, m[c.key])
			}
		}
		if out := pepsiQueue("list").stdout; !strings.Contains(out, " 1m3") {
			t.Errorf("IntervalStyle %s: list's table has no age of 1m3Xs:\n%s", style, out)
		}
	}
}

// FuzzParseInterval: whatever text parseInterval reads as seconds, PostgreSQL reads as an
// interval of the same seconds (its own extract(epoch ...)), under the style whose form the
// text has (the postgres form and sql_standard's one sign for all differ on "-3 days 04:05:06"
// as input, though neither style prints that), or refuses as input. parseInterval may take
// what PostgreSQL refuses (61 minutes, "1 day 1 day": what no style prints); it reads only
// what PostgreSQL printed, so that costs nothing, but a different number would be a wrong age.
func FuzzParseInterval(f *testing.F) {
	for _, s := range []string{"00:00:00", "1 day 02:03:04.5", "-3 days +04:05:06", "1 year 2 mons", "-00:00:00.5",
		"@ 0", "@ 1 year 2 mons 3 days 4 hours 5 mins 6.5 secs ago", "@ 1 day -0.5 secs",
		"0", "1-2", "-1-2", "3 4:05:06", "-3 4:05:06.5", "+1-2 -3 +4:05:06", "-0:00:01",
		"PT0S", "P1Y2M3DT4H5M6.5S", "P-1Y-2M3DT-4H-5M-6S", "PT-0.5S", "P1M", "PT1M"} {
		f.Add(s)
	}
	dbs := map[string]*sql.DB{}
	for _, style := range []string{"postgres", "sql_standard"} {
		db, err := sql.Open("postgres", testPG.DSN(f)+" options='-c IntervalStyle="+style+"'")
		if err != nil {
			f.Fatalf("open a connection with IntervalStyle %s: %v", style, err)
		}
		defer db.Close()
		dbs[style] = db
	}
	f.Fuzz(func(t *testing.T, text string) {
		secs, ok := parseInterval(text)
		if !ok {
			return
		}
		style := "postgres"
		if iv := (interval{}); !iv.postgres(text) && !strings.HasPrefix(text, "P") && !strings.HasPrefix(text, "@") {
			style = "sql_standard"
		}
		var epoch float64
		err := dbs[style].QueryRow(`SELECT extract(epoch FROM $1::interval)::float8`, text).Scan(&epoch)
		var pe *pq.Error
		if errors.As(err, &pe) && pe.Code.Class() == "22" { // data exception: not an interval PostgreSQL takes
			return
		}
		if err != nil {
			t.Fatalf("%q as an interval under IntervalStyle %s: %v", text, style, err)
		}
		if math.Abs(secs-epoch) > 1e-6+1e-12*math.Abs(epoch) {
			t.Errorf("parseInterval(%q) = %v, PostgreSQL (IntervalStyle %s) says %v", text, secs, style, epoch)
		}
	})
}

// FuzzIntervalOutput: the other direction, the one pepsi-queue meets: any interval (months,
// days, microseconds) as PostgreSQL prints it under each of the four styles reads back to
// PostgreSQL's own extract(epoch ...). A function per style prints it (its SET clause holds for
// the call), so one query asks for all four.
func FuzzIntervalOutput(f *testing.F) {
	f.Add(int32(0), int32(0), int64(0))
	f.Add(int32(14), int32(-3), int64(14706500000))
	f.Add(int32(-1), int32(1), int64(-500000))
	f.Add(int32(0), int32(0), int64(-1))
	styles := []string{"postgres", "postgres_verbose", "sql_standard", "iso_8601"}
	_, _, db := testPG.Schema(f, "fz")
	for _, style := range styles {
		if _, err := db.Exec(`CREATE FUNCTION in_` + style + `(i interval) RETURNS text LANGUAGE sql
		                      SET IntervalStyle = ` + style + ` AS $$ SELECT i::text $$`); err != nil {
			f.Fatalf("create the function printing under IntervalStyle %s: %v", style, err)
		}
	}
	f.Fuzz(func(t *testing.T, months, days int32, micros int64) {
		texts := make([]string, len(styles))
		var epoch float64
		err := db.QueryRow(`SELECT in_postgres(i), in_postgres_verbose(i), in_sql_standard(i), in_iso_8601(i),
		                           extract(epoch FROM i)::float8
		                      FROM (SELECT make_interval(months => $1, days => $2) + $3 * interval '1 microsecond' AS i) AS x`,
			months, days, micros).Scan(&texts[0], &texts[1], &texts[2], &texts[3], &epoch)
		var pe *pq.Error
		if errors.As(err, &pe) && pe.Code.Class() == "22" { // out of an interval's range
			return
		}
		if err != nil {
			t.Fatalf("interval of %d months, %d days, %d µs: %v", months, days, micros, err)
		}
		for i, text := range texts {
			got, ok := parseInterval(text)
			if !ok || math.Abs(got-epoch) > 1e-6+1e-12*math.Abs(epoch) {
				t.Errorf("IntervalStyle %s: parseInterval(%q) = %v, %v; PostgreSQL says %v", styles[i], text, got, ok, epoch)
			}
		}
	})
}
