package main

import (
	"context"
	"math"
	"math/rand"
	"testing"

	"github.com/lib/pq"
)

// TestParseIntervalAgainstPostgreSQL: the ages pepsi-queue prints are PostgreSQL's interval
// text read back by parseInterval; PostgreSQL itself says what each is in seconds. Under the
// default IntervalStyle every age of a row (a difference of timestamps: days and a time,
// never months) must read back to PostgreSQL's own epoch; under the other styles parseInterval
// may give up (the raw text is printed then) but must never give a different number.
func TestParseIntervalAgainstPostgreSQL(t *testing.T) {
	s := newQSchema(t)
	ctx := context.Background()
	conn, err := s.db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	secs := []float64{0, 0.5, 1, 59.999999, 60, 3599, 3600, 86399.5, 86400, 86401, 90061.123456, 172800,
		10*86400 + 5, 400 * 86400, 4000*86400 + 0.25, -0.5, -1, -86400, -86401, -90061.25, -400 * 86400}
	rng := rand.New(rand.NewSource(7))
	for i := 0; i < 500; i++ {
		secs = append(secs, math.Round((rng.Float64()-0.3)*math.Pow(10, float64(rng.Intn(9)))*1e6)/1e6)
	}
	for _, style := range []string{"postgres", "sql_standard", "iso_8601", "postgres_verbose"} {
		if _, err := conn.ExecContext(ctx, "SET IntervalStyle = "+style); err != nil {
			t.Fatal(err)
		}
		rows, err := conn.QueryContext(ctx, `
			SELECT i::text, extract(epoch FROM i)::float8
			  FROM unnest($1::float8[]) AS v,
			       LATERAL (SELECT (timestamptz '2026-01-01 00:00:00+00' + v * interval '1 second')
			                       - timestamptz '2026-01-01 00:00:00+00' AS i) AS x`, pq.Array(secs))
		if err != nil {
			t.Fatal(err)
		}
		parsed := 0
		for rows.Next() {
			var text string
			var epoch float64
			if err := rows.Scan(&text, &epoch); err != nil {
				t.Fatal(err)
			}
			got, ok := parseInterval(text)
			switch {
			case ok && math.Abs(got-epoch) > 1e-6:
				t.Errorf("IntervalStyle %s: parseInterval(%q) = %v, PostgreSQL says %v", style, text, got, epoch)
			case !ok && style == "postgres":
				t.Errorf("IntervalStyle postgres: parseInterval(%q) gave up (PostgreSQL says %v)", text, epoch)
			case ok:
				parsed++
			}
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		rows.Close()
		t.Logf("IntervalStyle %s: %d of %d read back", style, parsed, len(secs))
	}
}
